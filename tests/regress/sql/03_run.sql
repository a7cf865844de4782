-- run(), recompute(), status, failing keys, retry() and drop_job(): outcomes and refusals.
create schema shop;
create table shop.customer (id bigint primary key, name text not null);
create table shop.total (customer_id bigint primary key references shop.customer on delete cascade on update cascade,
                         label text not null);
-- compute fails for a customer named 'bad', and returns its row twice for one named 'twice'
create function shop.label_of(keys bigint[]) returns table (customer_id bigint, label text)
language plpgsql stable as $$
begin
    if exists (select from shop.customer c where c.name = 'bad' and (keys is null or c.id = any(keys))) then
        raise exception 'bad customer';
    end if;
    return query select c.id, upper(c.name) from shop.customer c where keys is null or c.id = any(keys)
                 union all
                 select c.id, 'again' from shop.customer c where c.name = 'twice' and (keys is null or c.id = any(keys));
end
$$;
insert into shop.customer select g, 'c' || g from generate_series(1, 4) g;
select lockstep.define_derived('labels', 'shop.total', 'shop.label_of(bigint[])', 'shop.customer',
                               every => '1 hour', backoff => '1 hour');
select lockstep.set_max_attempts('labels', 2);

-- status before any run
select job, kind, lock_group, queue_depth, parked_keys, failing_keys, last_outcome, last_action, runs,
       consecutive_failures, last_error, function, target, parent, every, backoff, max_attempts
from lockstep.status;
-- the recompute is due at once; then nothing is due
select outcome, inserted, updated, deleted, skipped, error, action, more from lockstep.run('labels');
select outcome, inserted, updated, deleted, skipped, error, action, more from lockstep.run('labels');
-- recompute() runs even when not due, and finds nothing to change
select outcome, inserted, updated, deleted, skipped, error, action, more from lockstep.recompute('labels');
select * from shop.total order by customer_id;

-- a poison key: the worker isolates it and writes the others; it waits for its retry_at
update shop.customer set name = 'bad' where id = 2;
update shop.customer set name = 'c3b' where id = 3;
select lockstep.enqueue('labels', array[2, 3]::bigint[]);
select outcome, inserted, updated, deleted, skipped, error, action, more from lockstep.work('labels');
select key, attempts, last_error, parked from lockstep.key_failure order by key;
select * from shop.total order by customer_id;
-- retry_at is in the future: the next pass does not take it
select outcome, inserted, updated, deleted, skipped, error, action, more from lockstep.work('labels');
select job, queue_depth, parked_keys, failing_keys, last_outcome, last_action from lockstep.status;
-- its data fixed, retry() puts it back at once
update shop.customer set name = 'c2' where id = 2;
select lockstep.retry('labels', array[2]::bigint[]);
select outcome, inserted, updated, deleted, skipped, error, action, more from lockstep.work('labels');
select count(*) as failing from lockstep.key_failure;
select * from shop.total order by customer_id;

-- LSD05: compute returns one primary key twice; the worker parks that key
update shop.customer set name = 'twice' where id = 4;
select lockstep.enqueue('labels', array[4]::bigint[]);
select outcome, inserted, updated, deleted, skipped, error, action, more from lockstep.work('labels');
select key, attempts, parked from lockstep.key_failure order by key;
-- retry(job): every failing key back, and the job's backoff ended
update shop.customer set name = 'c4' where id = 4;
select lockstep.retry('labels');
select outcome, inserted, updated, deleted, skipped, error, action, more from lockstep.work('labels');
select count(*) as failing from lockstep.key_failure;

-- a generic job: done, not_due; another call is due at once, fails, then backs off
create function shop.tick() returns void language sql as $$ select $$;
create function shop.broken() returns void language plpgsql as $$ begin raise exception 'broken tick'; end $$;
select lockstep.define_job('tick', 'shop.tick()', every => '1 hour', backoff => '1 hour');
select outcome, error, action from lockstep.run('tick');
select outcome, error, action from lockstep.run('tick');
select lockstep.define_job('tick', 'shop.broken()', every => '1 hour', backoff => '1 hour');
select outcome, error, action from lockstep.run('tick');
select outcome, error, action from lockstep.run('tick');
select job, last_outcome, last_action, consecutive_failures, last_error from lockstep.status where job = 'tick';
-- retry(job) of a job without a queue ends its backoff: the next run calls it again
select lockstep.retry('tick');
select outcome, error, action from lockstep.run('tick');
select job, last_outcome, consecutive_failures from lockstep.status where job = 'tick';
-- LSJ02: recompute() and work() of a generic job
select lockstep.recompute('tick');
select lockstep.work('tick');

-- 25000: run, work and recompute refuse a transaction that is not READ COMMITTED
begin isolation level repeatable read;
select lockstep.run('labels');
rollback;
begin isolation level serializable;
select lockstep.work('labels');
rollback;
-- 22004 and LSJ01
select lockstep.run(null);
select lockstep.run('nope');
select lockstep.recompute('nope');
select lockstep.retry('nope');
-- LSD08: a job defined by a query that calls a volatile function
create table shop.lucky (customer_id bigint primary key references shop.customer on delete cascade, draw float8);
select lockstep.define_derived('lucky', 'shop.lucky', query => 'select c.id as customer_id, random() as draw from shop.customer c',
                               parent => 'shop.customer');
-- 42501: dropping or changing another role's job (both roles made here, so the names are the same anywhere)
do $$ begin create role lockstep_regress_owner; exception when duplicate_object or unique_violation then null; end $$;
do $$ begin create role lockstep_regress_other; exception when duplicate_object or unique_violation then null; end $$;
grant usage on schema lockstep, shop to lockstep_regress_owner, lockstep_regress_other;
grant select, insert, update, delete on all tables in schema lockstep to lockstep_regress_owner, lockstep_regress_other;
set role lockstep_regress_owner;
select lockstep.define_job('mine', 'shop.tick()', every => '1 hour');
set role lockstep_regress_other;
select lockstep.drop_job('mine');
select lockstep.define_job('mine', 'shop.tick()', every => '2 hours');
reset role;
select job, owner from lockstep.job where job = 'mine';
select lockstep.drop_job('mine');
revoke all on all tables in schema lockstep from lockstep_regress_owner, lockstep_regress_other;
revoke usage on schema lockstep, shop from lockstep_regress_owner, lockstep_regress_other;

-- drop_job removes each job, its state, its queue and its failures
select lockstep.drop_job('labels');
select lockstep.drop_job('tick');
select (select count(*) from lockstep.job) as jobs, (select count(*) from lockstep.job_state) as states,
       (select count(*) from lockstep.queue) as queued, (select count(*) from lockstep.key_failure) as failures;
