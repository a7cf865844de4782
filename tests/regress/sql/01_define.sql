-- define_derived and define_job: what they accept, and every refusal of bad input with its SQLSTATE.
-- A refusal changes nothing: the registry is read after each group of refusals.
create schema shop;
create table shop.customer (id bigint primary key, name text not null);
create table shop.orders (id bigint primary key, customer_id bigint not null references shop.customer on delete cascade,
                          amount numeric not null);
create table shop.total (customer_id bigint primary key references shop.customer on delete cascade,
                         orders bigint not null, amount numeric not null);
create function shop.total_of(keys bigint[]) returns table (customer_id bigint, orders bigint, amount numeric)
language sql stable as $$
    select c.id, count(o.id), coalesce(sum(o.amount), 0)
    from shop.customer c left join shop.orders o on o.customer_id = c.id
    where keys is null or c.id = any(keys)
    group by c.id
$$;
create function shop.tick() returns void language sql as $$ select $$;

-- accepted: a derived job and a generic job
select lockstep.define_derived('totals', 'shop.total', 'shop.total_of(bigint[])', 'shop.customer',
                               every => '1 hour', backoff => '1 hour');
select lockstep.define_job('tick', 'shop.tick()', every => '1 hour');
select job, kind, lock_group, target, compute, parent, parent_column, parent_key, key_type, target_key, columns,
       every, backoff, max_attempts, batch_parents
from lockstep.job order by job;
-- redefining is allowed, and keeps one row
select lockstep.define_job('tick', 'shop.tick()', every => '2 hours');
select job, every from lockstep.job order by job;

-- 22004: NULL arguments
select lockstep.define_job(null, 'shop.tick()');
select lockstep.define_derived('d', null, 'shop.total_of(bigint[])', 'shop.customer');
-- 22023: invalid values
select lockstep.define_job('', 'shop.tick()');
select lockstep.define_job('t2', 'shop.tick()', every => '0 seconds');
select lockstep.define_job('t2', 'shop.tick()', backoff => '-1 hour');
select lockstep.define_job('t2', 'shop.tick()', lock_group => '');
select lockstep.set_batch_parents('totals', 0);
select lockstep.set_max_attempts('totals', 0);
-- LSJ01: unknown job
select lockstep.set_batch_parents('nope', 10);
select lockstep.drop_job('nope');

-- LSD01: a target without a primary key
create table shop.nopk (customer_id bigint references shop.customer on delete cascade, orders bigint, amount numeric);
select lockstep.define_derived('d', 'shop.nopk', 'shop.total_of(bigint[])', 'shop.customer');
-- LSD02: a compute function of the wrong shape
create function shop.scalar(keys bigint[]) returns bigint language sql as $$ select 1::bigint $$;
select lockstep.define_derived('d', 'shop.total', 'shop.scalar(bigint[])', 'shop.customer');
-- LSD03: compute's columns do not match the target's
create table shop.total2 (customer_id bigint primary key references shop.customer on delete cascade,
                          orders bigint not null, amount numeric not null, extra text not null);
select lockstep.define_derived('d', 'shop.total2', 'shop.total_of(bigint[])', 'shop.customer');
-- LSD04: a parent the target does not reference
create table shop.other (id bigint primary key);
select lockstep.define_derived('d2', 'shop.total2', 'shop.total_of(bigint[])', 'shop.other');
-- LSD04: the parent's foreign key would fail the application's deletes (ON DELETE NO ACTION)
create table shop.total3 (customer_id bigint primary key references shop.customer,
                          orders bigint not null, amount numeric not null);
select lockstep.define_derived('d3', 'shop.total3', 'shop.total_of(bigint[])', 'shop.customer');
-- LSD06: a table referencing the target with ON DELETE NO ACTION
create table shop.total4 (customer_id bigint primary key references shop.customer on delete cascade,
                          orders bigint not null, amount numeric not null);
create table shop.note (customer_id bigint primary key references shop.total4);
select lockstep.define_derived('d4', 'shop.total4', 'shop.total_of(bigint[])', 'shop.customer');
-- LSD07: the target is written by another job already
select lockstep.define_derived('again', 'shop.total', 'shop.total_of(bigint[])', 'shop.customer');
-- 42725: an overload makes the call ambiguous
create function shop.tock() returns void language sql as $$ select $$;
create function shop.tock(x int default 0) returns void language sql as $$ select $$;
select lockstep.define_job('tock', 'shop.tock()');
-- LSJ02: a derived-only call on a generic job
select lockstep.watch('tick', 'shop.orders', 'customer_id');
-- nothing of the above was written
select job from lockstep.job order by job;

-- drop_job removes a job and its state
select lockstep.drop_job('tick');
select job from lockstep.job order by job;
select count(*) as states from lockstep.job_state;
