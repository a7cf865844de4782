-- lockstep 0001: the queue of changed parents: enqueue, the statement trigger, watch / unwatch.

-- lockstep._enqueue_text(j, keys): append keys (text, cast to the parent key type, NULLs dropped) to the
-- queue, once each, sorted. Wakes listening runners (NOTIFY lockstep) when the job's queue was empty.
-- locks: none beyond the insert into lockstep.queue. The queue is append-only with no unique constraint on
-- keys, so this never waits for a worker, whatever the worker holds.
create function lockstep._enqueue_text(j lockstep.job, keys text[]) returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_empty boolean;
    n bigint;
begin
    if keys is null or cardinality(keys) = 0 then
        return 0;
    end if;
    v_empty := not exists (select from lockstep.queue q where q.job = j.job);
    execute pg_catalog.format(
        'insert into lockstep.queue (job, key) '
        'select $1, s.k::text from (select distinct k from pg_catalog.unnest($2::%s) k where k is not null) s order by s.k',
        lockstep._array_type(j.key_type)) using j.job, keys;
    get diagnostics n = row_count;
    if v_empty and n > 0 then
        perform pg_catalog.pg_notify('lockstep', j.job);
    end if;
    return n;
end;
$$;

-- lockstep._queue_job(job): the registry row of a derived job that has a queue (it has a parent).
-- locks: nothing.
create function lockstep._queue_job(job text) returns lockstep.job
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    j lockstep.job := lockstep._job(job, 'derived');
begin
    if j.parent is null then
        raise exception 'lockstep: job "%" has no parent, so it has no queue', j.job
            using errcode = 'LSJ02', hint = 'Use lockstep.recompute(), or redefine it with parent => ...';
    end if;
    return j;
end;
$$;

-- lockstep._check_key_type(j, t, what): t (an element type) can stand for the job's parent key.
-- Same type, or same type category (integer for bigint, varchar for text): values are cast, and a value
-- that does not fit raises.
-- locks: nothing.
create function lockstep._check_key_type(j lockstep.job, t regtype, what text) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if t is distinct from j.key_type
       and (select typcategory from pg_catalog.pg_type where oid = t)
           is distinct from (select typcategory from pg_catalog.pg_type where oid = j.key_type) then
        raise exception 'lockstep: % is %, but the parent key %.% of job "%" is %', what, coalesce(t::text, 'not an array'),
            j.parent, j.parent_key, j.job, j.key_type
            using errcode = 'LSQ01', hint = pg_catalog.format('Pass an array of %s.', j.key_type);
    end if;
end;
$$;

-- lockstep._keys_text(j, keys): keys checked (not NULL, no NULL element, a type of the parent key's
-- category) and converted to the parent key's canonical text, as the queue stores them.
-- locks: nothing.
create function lockstep._keys_text(j lockstep.job, keys anyarray) returns text[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v text[];
begin
    if keys is null then
        raise exception 'lockstep: keys must not be NULL' using errcode = '22004';
    end if;
    perform lockstep._check_key_type(j, (select typelem from pg_catalog.pg_type where oid = pg_catalog.pg_typeof(keys)),
                                     'keys');
    if pg_catalog.array_position(keys, null) is not null then
        raise exception 'lockstep: keys must not contain NULL (job "%")', j.job using errcode = '22004';
    end if;
    execute pg_catalog.format('select array_agg(k::%s::text) from pg_catalog.unnest($1::text[]) k', j.key_type)
        into v using keys::text[];
    return coalesce(v, '{}');
end;
$$;

-- lockstep.enqueue(job, keys): mark parents as changed. Returns the number of distinct keys appended.
-- locks: as lockstep._enqueue_text: nothing a worker or a recompute holds.
create function lockstep.enqueue(job text, keys anyarray) returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    j lockstep.job := lockstep._queue_job(job);
begin
    return lockstep._enqueue_text(j, lockstep._keys_text(j, keys));
end;
$$;

-- lockstep.enqueue_trigger(): trigger function for AFTER ... FOR EACH STATEMENT triggers with transition
-- tables named lockstep_new (INSERT, UPDATE) and lockstep_old (UPDATE, DELETE).
-- Arguments: job name, name of the column that holds the parent key. lockstep.watch() creates the triggers.
-- Keys are enqueued once per statement, sorted.
-- locks: as lockstep._enqueue_text: nothing a worker or a recompute holds.
create function lockstep.enqueue_trigger() returns trigger
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    j lockstep.job;
    v_keys text[] := '{}';
    v_part text[];
begin
    if tg_level <> 'STATEMENT' or tg_when <> 'AFTER' or tg_nargs <> 2 then
        raise exception 'lockstep.enqueue_trigger() must be used in AFTER ... FOR EACH STATEMENT triggers with two arguments (job, key column)'
            using errcode = '22023';
    end if;
    j := lockstep._queue_job(tg_argv[0]);
    if tg_op in ('INSERT', 'UPDATE') then
        execute pg_catalog.format('select array_agg(%I::text) from lockstep_new', tg_argv[1]) into v_part;
        v_keys := v_keys || coalesce(v_part, '{}');
    end if;
    if tg_op in ('DELETE', 'UPDATE') then
        execute pg_catalog.format('select array_agg(%I::text) from lockstep_old', tg_argv[1]) into v_part;
        v_keys := v_keys || coalesce(v_part, '{}');
    end if;
    perform lockstep._enqueue_text(j, v_keys);
    return null;
end;
$$;

-- lockstep._trigger_name(job, op): name of the trigger lockstep.watch() creates.
-- locks: nothing.
create function lockstep._trigger_name(job text, op text) returns name
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select ('lockstep_' || left(job, 40) || '_' || left(pg_catalog.md5(job), 6) || '_' || op)::name;
$$;

-- lockstep.watch(job, source, key_column): create the three statement triggers (insert, update, delete)
-- that enqueue source.key_column for job. Re-running it replaces them.
-- locks: the source table in SHARE ROW EXCLUSIVE mode (CREATE TRIGGER): it waits for the source's writers,
-- like any DDL. Run it at deploy time.
create function lockstep.watch(job text, source regclass, key_column name) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    j lockstep.job := lockstep._queue_job(job);
    v_type regtype;
    op text;
begin
    if source is null or key_column is null then
        raise exception 'lockstep: source and key_column must not be NULL' using errcode = '22004';
    end if;
    select a.atttypid into v_type from pg_catalog.pg_attribute a
    where a.attrelid = source and a.attname = key_column and a.attnum > 0 and not a.attisdropped;
    if v_type is null then
        raise exception 'lockstep: table % has no column %', source, key_column using errcode = '42703';
    end if;
    perform lockstep._check_key_type(j, v_type, pg_catalog.format('%s.%s', source, key_column));
    perform lockstep.unwatch(job, source);
    foreach op in array array['insert', 'update', 'delete'] loop
        execute pg_catalog.format(
            'create trigger %I after %s on %s referencing %s for each statement '
            'execute function lockstep.enqueue_trigger(%L, %L)',
            lockstep._trigger_name(j.job, op), op, source,
            case op when 'insert' then 'new table as lockstep_new'
                    when 'update' then 'old table as lockstep_old new table as lockstep_new'
                    else 'old table as lockstep_old' end,
            j.job, key_column);
    end loop;
end;
$$;

-- lockstep.unwatch(job, source): drop the triggers lockstep.watch() created.
-- locks: the source table (DROP TRIGGER), as lockstep.watch.
create function lockstep.unwatch(job text, source regclass) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
as $$
declare
    op text;
begin
    if job is null or source is null then
        raise exception 'lockstep: job and source must not be NULL' using errcode = '22004';
    end if;
    foreach op in array array['insert', 'update', 'delete'] loop
        execute pg_catalog.format('drop trigger if exists %I on %s', lockstep._trigger_name(job, op), source);
    end loop;
end;
$$;
