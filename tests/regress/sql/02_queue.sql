-- watch, enqueue and the worker: keys queued by the application's statements or by enqueue(), worked off
-- by work(), and every refusal of bad input with its SQLSTATE.
create schema shop;
create table shop.customer (id bigint primary key, name text not null);
create table shop.orders (id bigint primary key, customer_id bigint not null references shop.customer on delete cascade,
                          amount numeric not null);
create table shop.total (customer_id bigint primary key references shop.customer on delete cascade on update cascade,
                         orders bigint not null, amount numeric not null);
create function shop.total_of(keys bigint[]) returns table (customer_id bigint, orders bigint, amount numeric)
language sql stable as $$
    select c.id, count(o.id), coalesce(sum(o.amount), 0)
    from shop.customer c left join shop.orders o on o.customer_id = c.id
    where keys is null or c.id = any(keys)
    group by c.id
$$;
insert into shop.customer select g, 'c' || g from generate_series(1, 5) g;
insert into shop.orders select g, 1 + g % 5, g from generate_series(1, 20) g;
select lockstep.define_derived('totals', 'shop.total', 'shop.total_of(bigint[])', 'shop.customer',
                               every => '1 hour', backoff => '1 hour');
-- the first run is the recompute: every parent written
select outcome, inserted, updated, deleted, skipped, error, job, action, more from lockstep.run('totals');
select * from shop.total order by customer_id;

-- watch: the application's writes queue their parents' keys
select lockstep.watch('totals', 'shop.orders', 'customer_id');
select job, count(*) as flags from lockstep.recompute_flag group by job;
insert into shop.orders values (21, 2, 100), (22, 3, 100);
update shop.orders set customer_id = 4 where id = 1;
delete from shop.orders where id = 5;
select job, key from lockstep.queue order by id;
-- the flag watch() raised makes the recompute due first, then the worker takes the queue
select outcome, inserted, updated, deleted, skipped, error, action, more from lockstep.run('totals');
select outcome, inserted, updated, deleted, skipped, error, action, more from lockstep.run('totals');
select outcome, inserted, updated, deleted, skipped, error, action, more from lockstep.run('totals');
select * from shop.total order by customer_id;

-- enqueue(): keys of the parent key's type, or of one that converts to it; duplicates folded
update shop.orders set amount = amount + 1 where customer_id = 5;
select lockstep.enqueue('totals', array[5, 5, 1]::bigint[]);
select lockstep.enqueue('totals', array[2]::int[]);
select key from lockstep.queue order by id;
select outcome, inserted, updated, deleted, skipped, error, action, more from lockstep.work('totals', 2);
select outcome, inserted, updated, deleted, skipped, error, action, more from lockstep.work('totals');
select outcome, inserted, updated, deleted, skipped, error, action, more from lockstep.work('totals');
select * from shop.total order by customer_id;
-- a deleted parent: its rows go with it (ON DELETE CASCADE), its queued key needs nothing
delete from shop.customer where id = 4;
select outcome, inserted, updated, deleted, skipped, error, action, more from lockstep.work('totals');
select customer_id from shop.total order by customer_id;

-- 22004: NULL job or keys, NULL key elements
select lockstep.enqueue(null, array[1]::bigint[]);
select lockstep.enqueue('totals', null::bigint[]);
select lockstep.enqueue('totals', array[1, null]::bigint[]);
-- 22023: a batch that is not positive
select lockstep.work('totals', 0);
-- LSJ01: unknown job
select lockstep.enqueue('nope', array[1]::bigint[]);
select lockstep.work('nope');
select lockstep.watch('nope', 'shop.orders', 'customer_id');
-- LSQ01: keys of another type
select lockstep.enqueue('totals', array['a']::text[]);
select lockstep.enqueue('totals', array[1.5]::numeric[]);
-- LSQ01: a watched column that does not convert to the key type without loss
alter table shop.orders add column ref text;
select lockstep.watch('totals', 'shop.orders', 'ref');
-- LSQ02: a watched column whose foreign key leads to another table than the parent
create table shop.other (id bigint primary key);
create table shop.misc (id bigint primary key, other_id bigint references shop.other);
select lockstep.watch('totals', 'shop.misc', 'other_id');
-- 55000: a watch through the WAL the capture could not follow (wal_level not logical, or a replica identity
-- without the key column): which of the two depends on the server, so only the SQLSTATE is shown
create table shop.line (id bigint primary key, customer_id bigint not null references shop.customer on delete cascade);
do $$
begin
    perform lockstep.watch('totals', 'shop.line', 'customer_id', via => 'wal');
exception when others then
    raise warning 'refused with SQLSTATE %', sqlstate;
end
$$;
-- a column that does not exist
select lockstep.watch('totals', 'shop.orders', 'nope');
-- LSJ02: a job without a parent has no queue
create table shop.grand (one int primary key, amount numeric not null);
create function shop.grand_of(keys int[]) returns table (one int, amount numeric) language sql stable as
    $$ select 1, coalesce(sum(amount), 0) from shop.orders $$;
select lockstep.define_derived('grand', 'shop.grand', 'shop.grand_of(int[])', every => '1 hour');
select lockstep.enqueue('grand', array[1]);
select lockstep.work('grand');
select lockstep.watch('grand', 'shop.orders', 'id');
-- nothing of the above was queued
select count(*) as queued from lockstep.queue;

-- unwatch: the triggers go; unwatching again warns
select lockstep.unwatch('totals', 'shop.orders');
select count(*) as triggers from pg_trigger where tgrelid = 'shop.orders'::regclass and not tgisinternal;
select lockstep.unwatch('totals', 'shop.orders');
