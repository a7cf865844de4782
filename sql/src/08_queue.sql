-- lockstep: the queue of changed parents: enqueue, canonical keys, and the recompute flag.
-- Keys are stored as canonical text (lockstep._canon: DateStyle ISO, IntervalStyle postgres,
-- extra_float_digits 1, TimeZone UTC, bytea_output hex, lc_monetary C, numeric without trailing zeros),
-- which reads back to the same value under any setting: one text per parent.


-- lockstep._trims_scale(t): t (an array type) holds numerics, whose text keeps trailing zeros (1.00 and 1
-- name one parent): lockstep._canon trims them. PL/pgSQL: each lockstep._canon calls it, and a SQL function
-- with a SET clause is planned at every call.
create or replace function lockstep._trims_scale(t regtype) returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v oid := (select e.typelem from pg_catalog.pg_type e where e.oid = t);
begin
    while v <> 0 loop  -- the element type, then the base type of each domain over it
        if v = 'pg_catalog.numeric'::pg_catalog.regtype then
            return true;
        end if;
        v := (select ty.typbasetype from pg_catalog.pg_type ty where ty.oid = v and ty.typtype = 'd');
    end loop;
    return false;
end;
$$;

-- lockstep._numeric_fields(t): the fields of numeric type of the composite type t holds (t an array type),
-- whose text keeps trailing zeros: lockstep._canon trims them; NULL if none. PL/pgSQL, as _trims_scale.
create or replace function lockstep._numeric_fields(t regtype) returns text[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select pg_catalog.array_agg(a.attname::text order by a.attnum)
            from pg_catalog.pg_type e
            join pg_catalog.pg_type y on y.oid = e.typelem and y.typtype = 'c'
            join pg_catalog.pg_attribute a on a.attrelid = y.typrelid and a.attnum > 0 and not a.attisdropped
            where e.oid = t and a.atttypid = 'pg_catalog.numeric'::pg_catalog.regtype);
end;
$$;

-- lockstep._canon(keys): the distinct non-NULL keys in canonical text, sorted by key (not as text): the one
-- place a key value becomes text (queue, key_failure, retry, the worker's keys). Numerics, and a composite
-- key's numeric fields, without trailing zeros.
create or replace function lockstep._canon(keys anyarray) returns text[]
language sql stable
set search_path = pg_catalog, pg_temp
set datestyle = 'ISO, YMD'
set intervalstyle = 'postgres'
set extra_float_digits = 1
set timezone = 'UTC'
set bytea_output = 'hex'
set lc_monetary = 'C'
as $$
    select lockstep._check_key_type_safe(null, (select y.typelem from pg_catalog.pg_type y
                                                where y.oid = pg_catalog.pg_typeof(keys)));
    select coalesce(pg_catalog.array_agg(case when t.trim then pg_catalog.trim_scale(k::text::numeric)::text
                                              when t.fields is null then k::text
                                              -- the key with its numeric fields read again from their trimmed text
                                              else pg_catalog.jsonb_populate_record(k, (
                                                  select pg_catalog.jsonb_object_agg(f.key, pg_catalog.trim_scale(f.value::numeric))
                                                  from pg_catalog.jsonb_each(pg_catalog.to_jsonb(k)) f
                                                  where f.key = any(t.fields) and pg_catalog.jsonb_typeof(f.value) = 'number'))::text
                                         end order by k), '{}')
    -- unnest in the select list: a composite key's field named k cannot shadow the whole key
    from (select distinct u.k from (select pg_catalog.unnest(keys) as k) u where u.k is not null) s,
         (select lockstep._trims_scale(pg_catalog.pg_typeof(keys)) as trim,  -- once, not per key
                 lockstep._numeric_fields(pg_catalog.pg_typeof(keys)) as fields offset 0) t;
$$;

-- lockstep._fast_types(): key types whose JSON text (to_jsonb) is their canonical text under every setting;
-- lockstep.enqueue_trigger's fast path checks the same list inline.
create or replace function lockstep._fast_types() returns text[]
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select array['bigint', 'integer', 'smallint', 'numeric', 'text', 'character varying', 'uuid'];
$$;

-- lockstep._max_key_bytes(): the most bytes of key and job name together a queue entry takes: 2,600, so its
-- (key, job) index row always fits. Immutable: folded into callers' plans and generated triggers.
create or replace function lockstep._max_key_bytes() returns integer
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select 2600;
$$;

-- lockstep._queueable(job, keys): keys without those too long for the queue, each of which flags the job
-- for its full recompute instead (lockstep._flag).
-- locks: none beyond the insert into lockstep.recompute_flag (as lockstep._flag).
create or replace function lockstep._queueable(job text, keys text[]) returns text[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_max integer := lockstep._max_key_bytes();
    v_long text[] := array(select k from pg_catalog.unnest(keys) k
                           where pg_catalog.octet_length(k) + pg_catalog.octet_length(job) > v_max);
begin
    if cardinality(v_long) = 0 then
        return keys;
    end if;
    perform lockstep._flag(job, pg_catalog.format(
        '%s key(s) too long for the queue (%s bytes with the job name, at most %s), first starting %L',
        cardinality(v_long), pg_catalog.octet_length(v_long[1]) + pg_catalog.octet_length(job), v_max,
        pg_catalog.left(v_long[1], 20)));
    return array(select k from pg_catalog.unnest(keys) with ordinality u(k, o)
                 where pg_catalog.octet_length(k) + pg_catalog.octet_length(job) <= v_max order by o);
end;
$$;
comment on function lockstep._queueable(text, text[]) is
    'Keys without those too long for the queue, each of which flags the job for its full recompute '
    'instead (lockstep._flag). Locks: none beyond the insert into lockstep.recompute_flag (as '
    'lockstep._flag).';

-- lockstep._queue_keys(j, keys): keys (text, cast to the parent key type, NULLs dropped) once each, sorted
-- by key, in canonical text, without those too long for the queue (they flag the job: lockstep._queueable).
-- locks: none beyond the insert into lockstep.recompute_flag (as lockstep._flag).
create or replace function lockstep._queue_keys(j lockstep.job, keys text[]) returns text[]
language plpgsql
set search_path = pg_catalog, pg_temp
set datestyle = 'ISO, YMD'
set intervalstyle = 'postgres'
set extra_float_digits = 1
set timezone = 'UTC'
set lc_monetary = 'C'
as $$
declare
    v text[];
begin
    if keys is null or cardinality(keys) = 0 then
        return '{}';
    end if;
    v := lockstep._sorted_keys(j, keys);  -- the key type checked before the cast from text
    return lockstep._queueable(j.job, v);  -- a key too long for the queue flags the job instead
end;
$$;
comment on function lockstep._queue_keys(lockstep.job, text[]) is
    'Keys (text, cast to the parent key type, NULLs dropped) once each, sorted by key, in canonical text, '
    'without those too long for the queue (they flag the job: lockstep._queueable). Locks: none beyond the '
    'insert into lockstep.recompute_flag (as lockstep._flag).';

-- lockstep._enqueue_text(j, keys): append keys (text, cast to the parent key type, NULLs dropped) to the
-- queue once each, sorted by key, in canonical text (lockstep._queue_keys). No read of lockstep's tables
-- and no NOTIFY. A role without INSERT on the queue (an owner) appends through lockstep._append_keys, for
-- a job it manages (42501).
-- locks: none beyond the insert into lockstep.queue: append-only, so this never waits for a worker.
create or replace function lockstep._enqueue_text(j lockstep.job, keys text[]) returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v text[] := lockstep._queue_keys(j, keys);
begin
    if pg_catalog.has_column_privilege('lockstep.queue', 'key', 'INSERT') then  -- the application's grant
        insert into lockstep.queue (job, key) select j.job, k from pg_catalog.unnest(v) with ordinality u(k, o) order by o;
    else  -- an owner's: lockstep's security-definer function
        perform lockstep._append_keys(j.job, v);
    end if;
    return cardinality(v);
end;
$$;
comment on function lockstep._enqueue_text(lockstep.job, text[]) is
    'Append keys (text, cast to the parent key type, NULLs dropped) to the queue once each, sorted by '
    'key, in canonical text. No read of lockstep''s tables and no NOTIFY. A role without INSERT on the queue '
    'appends through lockstep._append_keys, for a job it manages (42501). Locks: none beyond the insert '
    'into lockstep.queue: append-only, so this never waits for a worker.';

-- lockstep._enqueue_missing(j, keys): lockstep._enqueue_text of the keys that have no queue entry of j yet.
-- Only for callers holding the job's group lock (no worker is taking those entries meanwhile).
-- locks: as lockstep._enqueue_text.
create or replace function lockstep._enqueue_missing(j lockstep.job, keys text[]) returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v text[] := lockstep._queue_keys(j, array(
        select k from pg_catalog.unnest(keys) k
        where not exists (select from lockstep.queue q where q.key = k and (q.job = j.job) is true)));
begin
    perform lockstep._append_keys(j.job, v);  -- the runner's or the owner's: a definer function appends
    return cardinality(v);
end;
$$;
comment on function lockstep._enqueue_missing(lockstep.job, text[]) is
    'Lockstep._enqueue_text of the keys that have no queue entry of j yet. Only for callers holding the '
    'job''s group lock (no worker is taking those entries meanwhile). Locks: as lockstep._enqueue_text.';

-- lockstep._append_keys(job, keys): append keys (canonical text, in the order given) to the queue for job,
-- for a caller that manages job (42501), a job that exists (LSJ01: one that does not has no owner to
-- check): a runner's hand-off, skipped or mapped parents. Security definer: no recipe role but the
-- application's holds INSERT on the queue. Nothing is checked or written for no key.
-- locks: none beyond the insert into lockstep.queue.
create or replace function lockstep._append_keys(job text, keys text[]) returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    if coalesce(cardinality(keys), 0) = 0 then
        return;
    end if;
    perform lockstep._job(job);  -- LSJ01: no rows for a job that does not exist
    perform lockstep._check_manages(job);
    insert into lockstep.queue (job, key)
    select _append_keys.job, u.k from pg_catalog.unnest(keys) with ordinality u(k, o) order by u.o;
end;
$$;
comment on function lockstep._append_keys(text, text[]) is
    'Append keys (canonical text, in the order given) to the queue for job, for a caller that manages job '
    '(42501), a job that exists (LSJ01). Security definer: no recipe role but the application''s holds INSERT on the queue. Locks: '
    'none beyond the insert into lockstep.queue.';

-- lockstep._queue_job(job): the registry row of a derived job that has a queue (it has a parent).
create or replace function lockstep._queue_job(job text) returns lockstep.job
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

-- lockstep._castable(source, target): values of type source always convert to target: the same type, a
-- domain over it, or an implicit cast (not numeric -> bigint, nor text -> uuid).
create or replace function lockstep._castable(source regtype, target regtype) returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    with recursive base(t) as (
        select source::oid
        union
        select ty.typbasetype from base join pg_catalog.pg_type ty on ty.oid = base.t where ty.typtype = 'd')
    select exists (select from base where base.t = target)
        or exists (select from base join pg_catalog.pg_cast c on c.castsource = base.t
                   where c.casttarget = target and c.castcontext = 'i');
$$;

-- lockstep._fast_pairs(): the (column type oid, key type) pairs of lockstep._fast_types() where the column
-- converts to the key type without loss, as 'oid:key type'; enqueue_trigger checks the same list inline.
create or replace function lockstep._fast_pairs() returns text[]
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.array_agg(pg_catalog.concat(c.oid, ':', k.t) order by c.oid, k.t)
    from pg_catalog.unnest(lockstep._fast_types()) f(t)
    join pg_catalog.pg_type c on c.oid = f.t::pg_catalog.regtype
    cross join pg_catalog.unnest(lockstep._fast_types()) k(t)
    where lockstep._castable(c.oid, k.t::pg_catalog.regtype);
$$;

-- lockstep._check_key_type(j, t, what): t (an element type) can stand for the job's parent key: the same
-- type, one that always converts to it (lockstep._castable), or another integer type; else LSQ01.
create or replace function lockstep._check_key_type(j lockstep.job, t regtype, what text) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if t is distinct from j.key_type and not lockstep._castable(t, j.key_type)
       and not (t::text = any(array['smallint', 'integer', 'bigint'])
                and j.key_type::text = any(array['smallint', 'integer', 'bigint'])) then
        raise exception 'lockstep: % is %, but the parent key % of job "%" is %', what, coalesce(t::text, 'not an array'),
            lockstep._key_name(j), j.job, j.key_type
            using errcode = 'LSQ01',
                  hint = pg_catalog.format('Pass an array of %s%s.', j.key_type,
                                           case when j.parent_column is null
                                                then pg_catalog.format(', e.g. array[row(...)]::%s[]', j.key_type) end);
    end if;
end;
$$;

-- lockstep._keys_cast_sql(key_type): the query casting each element of the array $1 to key_type by
-- PostgreSQL's own cast, as an array (NULL: no element); its callers sort the keys (lockstep._canon). They
-- check key_type first (lockstep._check_key_type_safe): the cast runs no code of the type's owner.
create or replace function lockstep._keys_cast_sql(key_type regtype) returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    -- unnest in the select list: a composite key's field named k cannot shadow the whole key
    select pg_catalog.format('select pg_catalog.array_agg(u.k::%s) from (select pg_catalog.unnest($1) as k) u',
                             lockstep._type_sql(key_type));
$$;

-- lockstep._keys_text(j, keys): keys checked (not NULL, no NULL element, a type that converts) and cast to
-- the parent key type by PostgreSQL's own cast in the caller's settings, then to canonical text
-- (lockstep._canon).
create or replace function lockstep._keys_text(j lockstep.job, keys anyarray) returns text[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v text[];
begin
    if keys is null then
        raise exception 'lockstep: keys must not be NULL' using errcode = '22004';
    end if;
    if pg_catalog.array_ndims(keys) > 1 then  -- it failed with 0A000 in the NULL check below
        raise exception 'lockstep: keys must be a one-dimensional array (got % dimensions)', pg_catalog.array_ndims(keys)
            using errcode = '22023';
    end if;
    perform lockstep._check_key_type(j, (select typelem from pg_catalog.pg_type where oid = pg_catalog.pg_typeof(keys)),
                                     'keys');
    -- the cast below and _canon run no code of a key type's owner (lockstep._key_type_problem)
    perform lockstep._check_key_type_safe(j.job, j.key_type);
    perform lockstep._check_key_type_safe(j.job, (select typelem from pg_catalog.pg_type
                                                  where oid = pg_catalog.pg_typeof(keys)));
    if pg_catalog.array_position(keys, null) is not null then
        raise exception 'lockstep: keys must not contain NULL (job "%")', j.job using errcode = '22004';
    end if;
    -- a composite key with a NULL field names no parent (the parent's key columns are NOT NULL)
    if j.parent_column is null and exists (select from (select pg_catalog.unnest(keys) as k) u where not (u.k is not null)) then
        raise exception 'lockstep: keys of job "%" must not have a NULL field', j.job
            using errcode = '22004', hint = 'Each field of a composite key is a column of the parent''s primary key.';
    end if;
    begin
        execute pg_catalog.format('select lockstep._canon((%s))', lockstep._keys_cast_sql(j.key_type)) into v using keys;
    exception when data_exception then  -- 3000000000 for an integer key: say whose key, keep the SQLSTATE
        raise exception 'lockstep: a key does not fit the parent key type % of job "%": %', j.key_type, j.job, sqlerrm
            using errcode = sqlstate, hint = 'Enqueue keys the parent table can hold.';
    end;
    return coalesce(v, '{}');
end;
$$;

-- lockstep._keys_from_text(job, keys, as_type): keys given as text (a command line's) as an array of the
-- job's parent key type, as_type being a NULL of that array type (text[] for a job with no parent). The conversion runs here, after the key
-- type is checked (lockstep._check_key_type_safe): a cast of the type's owner never runs as the caller.
create or replace function lockstep._keys_from_text(job text, keys text[], as_type anyarray) returns anyarray
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    j lockstep.job := lockstep._job(job);
begin
    if j.key_type is null then  -- no parent: the keys stay text, and the call they are for says what to do
        as_type := keys;
        return as_type;
    end if;
    perform lockstep._check_key_type(j, (select y.typelem from pg_catalog.pg_type y
                                         where y.oid = pg_catalog.pg_typeof(as_type)), 'the type asked for');
    perform lockstep._check_key_type_safe(j.job, j.key_type);
    execute lockstep._keys_cast_sql(j.key_type) into as_type using keys;
    return as_type;
end;
$$;

-- lockstep.enqueue(job, keys): mark parents as changed. Returns the number of distinct keys appended.
-- locks: as lockstep._enqueue_text: nothing a worker or a recompute holds.
create or replace function lockstep.enqueue(job text, keys anyarray) returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
set row_security = on  -- under off, the policies of lockstep.job and lockstep.queue refuse it (see _append)
as $$
declare
    j lockstep.job := lockstep._queue_job(job);
begin
    return lockstep._enqueue_text(j, lockstep._keys_text(j, keys));
end;
$$;
comment on function lockstep.enqueue(text, anyarray) is
    'Mark parents as changed. Returns the number of distinct keys appended. Locks: as '
    'lockstep._enqueue_text: nothing a worker or a recompute holds.';

-- lockstep._append(job, keys): append keys (canonical text) to the queue for job, with row_security = on:
-- with it off, PostgreSQL refuses any statement on the queue from a role its policies apply to.
-- locks: none beyond the insert into lockstep.queue.
create or replace function lockstep._append(job text, keys text[]) returns void
language sql
set search_path = pg_catalog, pg_temp
set row_security = on
as $$
    insert into lockstep.queue (job, key)
    select _append.job, u.k from pg_catalog.unnest(keys) with ordinality u(k, o) order by u.o;
$$;
comment on function lockstep._append(text, text[]) is
    'Append keys (canonical text) to the queue for job, with row_security = on: with it off, PostgreSQL '
    'refuses any statement on the queue from a role its policies apply to. Locks: none beyond the insert '
    'into lockstep.queue.';

-- lockstep._flag(job, problem): the trigger could not enqueue: mark job for its full recompute (one INSERT:
-- application roles may only insert), and say so with a WARNING. A role without INSERT on the flags flags
-- a job it manages through lockstep._flag_job (42501 for another's).
-- locks: none beyond the insert into lockstep.recompute_flag.
create or replace function lockstep._flag(job text, problem text) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
set row_security = on  -- under off, the policies of lockstep.recompute_flag refuse the insert (see _append)
as $$
begin
    if pg_catalog.has_column_privilege('lockstep.recompute_flag', 'problem', 'INSERT') then
        insert into lockstep.recompute_flag (job, problem)  -- (job, problem): the application's column grant
        values (coalesce(job, ''), problem);
    else  -- an owner writing its own watched table: lockstep's security-definer function, for its jobs
        perform lockstep._flag_job(coalesce(job, ''), problem);
    end if;
    raise warning 'lockstep: could not enqueue for job "%": %; job flagged for a full recompute', job, problem
        using hint = 'See trigger_problem in lockstep.status; lockstep.recompute(job) clears the flag.';
end;
$$;
comment on function lockstep._flag(text, text) is
    'The trigger could not enqueue: mark job for its full recompute (one INSERT: application roles may '
    'only insert), and say so with a WARNING; a role without INSERT on the flags, through '
    'lockstep._flag_job for a job it manages. Locks: none beyond the insert into lockstep.recompute_flag.';

-- lockstep._clear_flag(j, snap, started): after a successful full recompute that began at started with
-- snapshot snap: forget the flags snap saw; this transaction's own flags only if raised before started.
-- Security definer, for a caller that manages j (42501): no recipe role holds DELETE on the flags.
-- locks: the job's lockstep.recompute_flag rows (deleted).
create or replace function lockstep._clear_flag(j lockstep.job, snap pg_snapshot, started timestamptz) returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    perform lockstep._check_manages(j.job);
    delete from lockstep.recompute_flag f
    where f.job = j.job
      and (case when f.xid = pg_catalog.pg_current_xact_id_if_assigned() then f.flagged_at < started
                else pg_catalog.pg_visible_in_snapshot(f.xid, snap) end
           -- an xid not assigned yet (written by hand): no snapshot would see it before it wraps
           or f.xid >= pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot()));
end;
$$;
comment on function lockstep._clear_flag(lockstep.job, pg_snapshot, timestamp with time zone) is
    'After a successful full recompute that began at started with snapshot snap: forget the flags snap '
    'saw; this transaction''s own flags only if raised before started. Locks: the job''s '
    'lockstep.recompute_flag rows (deleted).';
