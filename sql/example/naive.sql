-- The patterns lockstep replaces, kept runnable for tests, bench and demo. Do not copy them.

-- naive full recompute (the seed's periodic job): status row FOR UPDATE, delete everything, reinsert.
-- locks: the status row, then every derived row (deleted), then the parents (FK checks), for the whole run.
create or replace function example.naive_recompute()
returns void
language plpgsql
as $$
begin
    perform 1 from example.exam_status where job = 'exam_keys' for update;
    delete from example.exam_key;
    insert into example.exam_key select * from example.exam_key_compute(null);
    update example.exam_status set last_run = now() where job = 'exam_keys';
end;
$$;

-- naive queue worker (the seed's): for each changed parent, rewrite its derived rows, then upsert the
-- status row. locks: derived rows, then the status row: the opposite order to naive_recompute.
create or replace function example.naive_work(ids bigint[])
returns void
language plpgsql
as $$
begin
    delete from example.exam_key where exam_id = any(ids);
    insert into example.exam_key select * from example.exam_key_compute(ids);
    insert into example.exam_status values ('exam_keys', now())
        on conflict (job) do update set last_run = excluded.last_run;
end;
$$;

-- the "usual fix" (seed pattern): advisory lock, compute into a temp table, anti-join delete, then insert
-- joined to the parents FOR KEY SHARE. Split in phases so schedules can interleave an app between them.
create or replace function example.seed_compute()
returns void
language plpgsql
as $$
begin
    perform pg_advisory_xact_lock(hashtextextended('example:seed', 0));
    drop table if exists pg_temp.seed_desired;
    create temp table seed_desired on commit drop as select * from example.exam_key_compute(null);
end;
$$;

create or replace function example.seed_delete()
returns bigint
language plpgsql
as $$
declare
    n bigint;
begin
    delete from example.exam_key k
    where not exists (select from pg_temp.seed_desired d where d.exam_id = k.exam_id and d.key = k.key);
    get diagnostics n = row_count;
    return n;
end;
$$;

create or replace function example.seed_insert()
returns bigint
language plpgsql
as $$
declare
    n bigint;
begin
    with p as (select e.id from example.exam e
               where e.id in (select exam_id from pg_temp.seed_desired) for key share of e)
    insert into example.exam_key
    select d.* from pg_temp.seed_desired d join p on p.id = d.exam_id
    on conflict (exam_id, key) do update set weight = excluded.weight
        where exam_key.weight is distinct from excluded.weight;
    get diagnostics n = row_count;
    return n;
end;
$$;

create or replace function example.seed_recompute()
returns void
language plpgsql
as $$
begin
    perform example.seed_compute();
    perform example.seed_delete();
    perform example.seed_insert();
end;
$$;
