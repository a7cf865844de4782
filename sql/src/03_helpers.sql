-- lockstep: shared helpers: the registry row, identifier lists, results and the job's status row.

-- lockstep._job(job, kind): the registry row of a job, or a clear error.
create or replace function lockstep._job(job text, kind text default null) returns lockstep.job
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    j lockstep.job;
begin
    if _job.job is null then
        raise exception 'lockstep: job must not be NULL' using errcode = '22004';
    end if;
    select * into j from lockstep.job where lockstep.job.job = _job.job;
    if not found then
        raise exception 'lockstep: unknown job "%"', _job.job
            using errcode = 'LSJ01',
                  hint = 'Define it with lockstep.define_job() or lockstep.define_derived(); '
                         'select job from lockstep.status lists the jobs.';
    end if;
    if _job.kind is not null and j.kind <> _job.kind then
        raise exception 'lockstep: job "%" is a % job, not a % job', j.job,
                case j.kind when 'job' then 'generic' else 'derived' end,
                case _job.kind when 'job' then 'generic' else 'derived' end
            using errcode = 'LSJ02';
    end if;
    return j;
end;
$$;

-- lockstep._check_not_ours(rel, what): rel (or a table above it) is neither one of lockstep's own tables
-- nor a temporary table.
create or replace function lockstep._check_not_ours(rel regclass, what text) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    -- rel and every table it inherits from, and the version table lockstep migrate keeps
    if exists (with recursive up(oid) as (select rel::oid
                                          union
                                          select i.inhparent from pg_catalog.pg_inherits i join up on i.inhrelid = up.oid)
               select from up join pg_catalog.pg_class c on c.oid = up.oid
               where c.relnamespace = 'lockstep'::regnamespace or c.relname = 'lockstep_alembic_version') then
        raise exception 'lockstep: % is one of lockstep''s own tables: it cannot be %', rel, what
            using errcode = '22023',
                  hint = 'Name the application''s tables: the ones compute reads (watch) or the job writes (target).';
    end if;
    -- a temporary table: the runner's sessions never see its rows
    if exists (select from pg_catalog.pg_class c where c.oid = rel and c.relpersistence = 't') then
        raise exception 'lockstep: % is a temporary table: it cannot be %', rel, what
            using errcode = '22023', hint = 'Only the session that created it sees its rows; use a regular table.';
    end if;
end;
$$;

-- lockstep._cols(cols, alias): "a.c1, a.c2" with quoted identifiers.
create or replace function lockstep._cols(cols name[], alias text default null) returns text
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select pg_catalog.string_agg(coalesce(pg_catalog.quote_ident(alias) || '.', '') || pg_catalog.quote_ident(c),
                                         ', ' order by o)
            from pg_catalog.unnest(cols) with ordinality as u(c, o));
end;
$$;

-- lockstep._op_sql(op): operator op as SQL text to put between two operands: its bare name if it is
-- pg_catalog's (lockstep's search_path finds it), else schema-qualified ('operator(public.=)').
create or replace function lockstep._op_sql(op oid) returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select case when o.oprnamespace = 'pg_catalog'::regnamespace then o.oprname::text
                else pg_catalog.format('operator(%I.%s)', n.nspname, o.oprname) end
    from pg_catalog.pg_operator o
    join pg_catalog.pg_namespace n on n.oid = o.oprnamespace
    where o.oid = op
$$;

-- lockstep._eq_op(t): the equality operator of type t (of its base type, for a domain) as SQL text,
-- qualified unless pg_catalog's: a bare = under lockstep's search_path compares citext as text.
create or replace function lockstep._eq_op(t regtype) returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_base oid;
    v text;
begin
    if t is null or t < 16384 then  -- made by initdb (below FirstNormalObjectId): pg_catalog's operators
        return '=';
    end if;
    v_base := (select case when y.typtype = 'd' then y.typbasetype else y.oid end
               from pg_catalog.pg_type y where y.oid = t);
    if (select y.typnamespace from pg_catalog.pg_type y where y.oid = v_base) = 'pg_catalog'::regnamespace then
        return '=';
    end if;
    select lockstep._op_sql(ao.amopopr) into v
    from pg_catalog.pg_opclass c
    join pg_catalog.pg_am a on a.oid = c.opcmethod and a.amname = 'btree'
    join pg_catalog.pg_amop ao on ao.amopfamily = c.opcfamily and ao.amoplefttype = c.opcintype
                              and ao.amoprighttype = c.opcintype and ao.amopstrategy = 3
    where c.opcdefault and c.opcintype = v_base;
    return coalesce(v, '=');
end;
$$;

-- lockstep._eq(cols, a, b, rel): "a.c1 = b.c1 and a.c2 = b.c2", each = that of the column's type in rel
-- (lockstep._eq_op; rel NULL: a bare =).
create or replace function lockstep._eq(cols name[], a text, b text, rel regclass default null) returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v text[] := '{}';
    v_type oid;
    c name;
begin
    foreach c in array cols loop
        v_type := null;
        if rel is not null then
            select t.atttypid into v_type from pg_catalog.pg_attribute t
            where t.attrelid = rel and t.attname = c and not t.attisdropped;
        end if;
        v := v || pg_catalog.format('%I.%I %s %I.%I', a, c, lockstep._eq_op(v_type), b, c);
    end loop;
    return pg_catalog.array_to_string(v, ' and ');
end;
$$;

-- lockstep._key_eq(j): the comparison of two of j's parent keys as SQL text: the key type's equality,
-- after a COLLATE of the parent key's collation when it is nondeterministic (compute's rows carry the default).
create or replace function lockstep._key_eq(j lockstep.job) returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_coll text;
begin
    if j.parent is not null
       and (select y.typcollation <> 0 from pg_catalog.pg_type y where y.oid = j.key_type) then
        select pg_catalog.format('collate %I.%I ', n.nspname, c.collname) into v_coll
        from pg_catalog.pg_attribute a
        join pg_catalog.pg_collation c on c.oid = a.attcollation and not c.collisdeterministic
        join pg_catalog.pg_namespace n on n.oid = c.collnamespace
        where a.attrelid = j.parent and a.attname = j.parent_key;
    end if;
    return coalesce(v_coll, '') || lockstep._eq_op(j.key_type);
end;
$$;

-- parent keys of one or several columns ----------------------------------------------------------------
-- A job's parent key is one column (j.parent_column of the target, j.parent_key of the parent, of type
-- j.key_type) or several (j.parent_columns, j.parent_keys; j.key_type is then a composite type whose fields
-- are those columns' types, in order). The helpers below write the SQL for either, so no caller branches.

-- lockstep._key_fields(j): the fields of j's composite key type, in order; NULL for a one-column key.
create or replace function lockstep._key_fields(j lockstep.job) returns name[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if j.parent is null or j.parent_column is not null then
        return null;
    end if;
    return array(select a.attname from pg_catalog.pg_type y
                 join pg_catalog.pg_attribute a on a.attrelid = y.typrelid and a.attnum > 0 and not a.attisdropped
                 where y.oid = j.key_type order by a.attnum);
end;
$$;

-- lockstep._key_pattern(t): a regular expression matching the text of a key of the composite type t exactly
-- when it is that key's canonical text (lockstep._canon), which reads back as t: (f1,f2), each field a
-- canonical smallint, integer, bigint or uuid, none NULL (lockstep._canon drops such a key). NULL if t has
-- a field of another type.
create or replace function lockstep._key_pattern(t regtype) returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    -- record text quotes no such field: digits, a minus sign, hex digits and hyphens only
    return (select '[(]' || pg_catalog.string_agg(case a.atttypid
                        when 'pg_catalog.int2'::pg_catalog.regtype then '(0|-?[1-9][0-9]{0,3})'
                        when 'pg_catalog.int4'::pg_catalog.regtype then '(0|-?[1-9][0-9]{0,8})'
                        when 'pg_catalog.int8'::pg_catalog.regtype then '(0|-?[1-9][0-9]{0,17})'
                        when 'pg_catalog.uuid'::pg_catalog.regtype
                            then '[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}' end,
                        ',' order by a.attnum) || '[)]'
            from pg_catalog.pg_type y
            join pg_catalog.pg_attribute a on a.attrelid = y.typrelid and a.attnum > 0 and not a.attisdropped
            where y.oid = t and y.typtype = 'c'
            having pg_catalog.bool_and(a.atttypid in ('pg_catalog.int2'::pg_catalog.regtype,
                                                      'pg_catalog.int4'::pg_catalog.regtype,
                                                      'pg_catalog.int8'::pg_catalog.regtype,
                                                      'pg_catalog.uuid'::pg_catalog.regtype)));
end;
$$;

-- lockstep._canonical_keys(t, keys): every key of keys, none NULL, is the canonical text of a key of the
-- composite type t (lockstep._key_pattern): it reads back as t, and converting it gives it back. False when
-- t has no such pattern, or keys is empty. Reads the keys as text only: no key is converted.
create or replace function lockstep._canonical_keys(t regtype, keys text[]) returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_pat text := lockstep._key_pattern(t);
    v_all text := pg_catalog.array_to_string(keys, ';');  -- no pattern matches a ;
begin
    return coalesce(v_pat is not null and pg_catalog.cardinality(keys) > 0
                    -- one ; between keys, none in a key: each piece matched below is one key
                    and pg_catalog.length(v_all) - pg_catalog.length(pg_catalog.replace(v_all, ';', ''))
                        = pg_catalog.cardinality(keys) - 1
                    and v_all ~ pg_catalog.format('^%1$s(;%1$s)*$', v_pat), false);
end;
$$;

-- lockstep._key_expr(j, alias, cols): SQL for the parent key held in columns cols (NULL: the target's,
-- j.parent_columns; pass j.parent_keys for the parent's) of row alias: the column for a one-column key, else
-- row(alias.c1, ...)::key_type, which compares and sorts field by field.
create or replace function lockstep._key_expr(j lockstep.job, alias text, cols name[] default null) returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_cols name[] := coalesce(cols, j.parent_columns, array[j.parent_column]);
begin
    if j.parent_column is not null then
        return lockstep._cols(v_cols[1:1], alias);
    end if;
    return pg_catalog.format('row(%s)::%s', lockstep._cols(v_cols, alias), lockstep._type_sql(j.key_type));
end;
$$;

-- lockstep._key_text(j, alias, cols): SQL for that key as text (lockstep._key_expr): the column's text, or
-- the composite's record text, e.g. (1,42); canonical under lockstep._canon's settings.
create or replace function lockstep._key_text(j lockstep.job, alias text, cols name[] default null) returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return pg_catalog.format('(%s)::text', lockstep._key_expr(j, alias, cols));
end;
$$;

-- lockstep._key_match(j, alias, value, cols): SQL true where the key columns cols (as lockstep._key_expr)
-- of row alias equal value, an expression of j's key type: alias.c = value, or for a composite key
-- alias.c1 = (value).f1 and ..., each with its type's equality, so an index on the columns serves it.
create or replace function lockstep._key_match(j lockstep.job, alias text, value text, cols name[] default null)
returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_cols name[] := coalesce(cols, j.parent_columns, array[j.parent_column]);
begin
    if j.parent_column is not null then
        return pg_catalog.format('%s %s %s', lockstep._cols(v_cols[1:1], alias), lockstep._key_eq(j), value);
    end if;
    return (select pg_catalog.format('(%s)', pg_catalog.string_agg(
                       pg_catalog.format('%s %s (%s).%I', lockstep._cols(array[v_cols[f.o]], alias),
                                         lockstep._eq_op(a.atttypid::regtype), value, f.n), ' and ' order by f.o))
            from pg_catalog.unnest(lockstep._key_fields(j)) with ordinality f(n, o)
            join pg_catalog.pg_type y on y.oid = j.key_type
            join pg_catalog.pg_attribute a on a.attrelid = y.typrelid and a.attname = f.n);
end;
$$;

-- lockstep._key_in(j, alias, arr, cols): SQL true where the key columns cols of row alias are among the
-- keys of arr, an expression of j's key type's array: = any(arr), or for a composite key an EXISTS over
-- unnest(arr) matched field by field (lockstep._key_match), which a join on an index serves.
create or replace function lockstep._key_in(j lockstep.job, alias text, arr text, cols name[] default null)
returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if j.parent_column is not null then
        return lockstep._key_match(j, alias, pg_catalog.format('any(%s)', arr), cols);
    end if;
    -- the array in a scalar subquery: cast once (record input is not immutable, so never folded); the key
    -- as lockstep_k.*, the whole row: a field named lockstep_k would shadow a bare lockstep_k
    return pg_catalog.format('exists (select from pg_catalog.unnest((select %s)) lockstep_k where %s)', arr,
                             lockstep._key_match(j, alias, 'lockstep_k.*', cols));
end;
$$;

-- lockstep._key_unnest(j, arr): a FROM item k with one column v, each key of arr (text of a key array)
-- cast to j's key type's array: unnest(arr) k(v), or for a composite key (select unnest(arr) as v) k,
-- whose v is the whole key (a column list would rename its first field; a field named v would shadow it).
create or replace function lockstep._key_unnest(j lockstep.job, arr text) returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if j.parent_column is not null then
        return pg_catalog.format('pg_catalog.unnest(%s::%s) k(v)', arr, lockstep._array_type(j.key_type));
    end if;
    return pg_catalog.format('(select pg_catalog.unnest((select %s::%s)) as v) k', arr, lockstep._array_type(j.key_type));
end;
$$;

-- lockstep._is_parent_fk(j, con): the foreign key con is the one of j's target to its parent on the
-- parent key columns (j.parent_columns, as a set).
create or replace function lockstep._is_parent_fk(j lockstep.job, con oid) returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select from pg_catalog.pg_constraint c
                   where c.oid = con and c.conrelid = j.target and c.confrelid = j.parent and c.contype = 'f'
                     and pg_catalog.cardinality(c.conkey) = pg_catalog.cardinality(j.parent_columns)
                     and (select array_agg(a.attname) from pg_catalog.pg_attribute a
                          where a.attrelid = c.conrelid and a.attnum = any(c.conkey)) @> j.parent_columns);
$$;

-- lockstep._key_order(j, value): value, an expression of j's key type, as a list to sort or group by in the
-- key type's order: value itself, or for a composite key its fields (value).f1, (value).f2, which sort
-- as the record does (same types and collations) without a record comparison per pair.
create or replace function lockstep._key_order(j lockstep.job, value text) returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if j.parent_column is not null then
        return value;
    end if;
    return (select pg_catalog.string_agg(pg_catalog.format('(%s).%I', value, f.n), ', ' order by f.o)
            from pg_catalog.unnest(lockstep._key_fields(j)) with ordinality f(n, o));
end;
$$;

-- lockstep._key_name(j): j's parent key for messages: parent.column, or parent(c1, c2) for a composite key.
create or replace function lockstep._key_name(j lockstep.job) returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select case when j.parent_key is not null then pg_catalog.format('%s.%I', j.parent, j.parent_key)
                else pg_catalog.format('%s(%s)', j.parent, lockstep._cols(j.parent_keys)) end;
$$;

-- lockstep._fk_eq(con, pk, fk): "pk.r1 = fk.c1 and ...", with the constraint's own PK = FK operators
-- (conpfeqop), the match its FK check makes.
create or replace function lockstep._fk_eq(con oid, pk text, fk text) returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.string_agg(
               pg_catalog.format('%I.%I %s %I.%I', pk, ra.attname, lockstep._op_sql(k.op), fk, fa.attname),
               ' and ' order by k.o)
    from pg_catalog.pg_constraint c
    cross join lateral unnest(c.confkey, c.conkey, c.conpfeqop) with ordinality k(r, f, op, o)  -- ROWS FROM: not qualified
    join pg_catalog.pg_attribute ra on ra.attrelid = c.confrelid and ra.attnum = k.r
    join pg_catalog.pg_attribute fa on fa.attrelid = c.conrelid and fa.attnum = k.f
    where c.oid = con
$$;

-- lockstep._type_sql(t): type t as SQL text for a cast, with no type modifier (format_type(t, -1):
-- 'character' alone means char(1)).
create or replace function lockstep._type_sql(t regtype) returns text
language sql stable strict
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.format_type(t, -1)
$$;

-- lockstep._array_type(t): the array type of t, as SQL text for a cast (no type modifier: _type_sql).
create or replace function lockstep._array_type(t regtype) returns text
language plpgsql stable strict
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select pg_catalog.format_type(ty.typarray, -1) from pg_catalog.pg_type ty where ty.oid = t);
end;
$$;

-- lockstep._check_owner(j): a job may be redefined or dropped only by a member of its owner role.
create or replace function lockstep._check_owner(j lockstep.job) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if not lockstep._may_manage_id(j.owner_id) then
        raise exception 'lockstep: job "%" is owned by role "%"', j.job, pg_catalog.pg_get_userbyid(j.owner_id)
            using errcode = '42501', hint = 'Only members of the owner role can redefine, watch, retry or drop it.';
    end if;
end;
$$;

-- lockstep._result(...): build a lockstep.result.
create or replace function lockstep._result(outcome text, job text, action text, p lockstep._pass default null,
                                 error text default null, more boolean default false)
returns lockstep.result
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
begin
    return row(outcome,
               coalesce(p.inserted, 0), coalesce(p.updated, 0), coalesce(p.deleted, 0),
               coalesce(pg_catalog.cardinality(p.skipped), 0),
               -- to the microsecond: no float noise
               pg_catalog.round(coalesce(p.compute_ms, 0)::numeric, 3)::float8,
               pg_catalog.round(coalesce(p.write_ms, 0)::numeric, 3)::float8,
               error, job, action, more)::lockstep.result;
end;
$$;

-- lockstep._no_jit_note: the entry points a runner calls set jit = off for everything they run: under
-- row-level security every statement would pass jit_above_cost and be compiled.

-- lockstep._defer_until(): when a queue entry deferred now (its parent held) is ready again.
create or replace function lockstep._defer_until() returns timestamptz
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select now() + interval '1 second';
$$;

-- lockstep._finish(job, action, outcome, started, pass, error, only_skipped, more): write the job's
-- status row, last in every run that did something (a second only-skipped pass in a row is no new run).
-- Security definer, for a caller that manages j (42501): it runs no user code, and no recipe role holds
-- UPDATE on lockstep.job_state.
-- locks: the job's lockstep.job_state row (FOR NO KEY UPDATE, by the update); then as lockstep._log_run.
create or replace function lockstep._finish(j lockstep.job, action text, outcome text, started timestamptz,
                                 p lockstep._pass default null, error text default null,
                                 only_skipped boolean default false, more boolean default null)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_failed boolean := outcome = 'failed';
    v_only_skipped boolean := only_skipped and action = 'work' and outcome = 'done' and error is null
                              and p.inserted + p.updated + p.deleted + p.gone = 0
                              and cardinality(p.failed) = 0 and cardinality(p.skipped) > 0;
    v_cured boolean := coalesce(p.cured, false);  -- lockstep._settle
    v_s lockstep.job_state;
    v_again boolean;
    v_release boolean;
    v_end timestamptz := pg_catalog.clock_timestamp();  -- when the run ended
begin
    perform lockstep._check_manages(j.job);
    -- the status row as it was (read under the group lock: no other writer)
    select * into v_s from lockstep.job_state s where s.job = j.job;
    -- the previous pass only skipped too
    v_again := v_only_skipped and v_s.last_action = 'work' and v_s.last_outcome = 'done' and v_s.last_error is null
               and v_s.last_inserted + v_s.last_updated + v_s.last_deleted = 0 and v_s.last_skipped > 0;
    -- a poisoned recompute's hold ends once a failed key was written, no key fails and the hand-off is done
    v_release := action = 'work' and not v_failed and v_s.recompute_poisoned_at is not null
                 and (v_s.recompute_poison_cured or v_cured)
                 and not exists (select from lockstep.key_failure f where f.job = j.job)
                 and not lockstep._handoff_any(j.job, v_s.recompute_queue_from, v_s.recompute_queue_to);
    update lockstep.job_state s set
        next_run_at = case
            when action in ('recompute', 'call') and v_failed then now() + j.backoff
            -- a run that outlasted its every is next due min(every, 1 minute) after it ended (rule 7)
            when action in ('recompute', 'call') and v_end >= started + j.every
                then v_end + least(j.every, interval '1 minute')
            when action in ('recompute', 'call') then started + j.every
            else s.next_run_at end,
        retry_at = case
            when action = 'work' and v_failed
                then now() + least(j.backoff, interval '1 second' * power(2, least(s.consecutive_failures, 20)))
            when action = 'work' then null
            else s.retry_at end,
        last_outcome = outcome,
        last_action = action,
        last_started_at = started,
        last_finished_at = v_end,
        last_duration_ms = extract(epoch from v_end - started) * 1000,
        last_inserted = coalesce(p.inserted, 0),
        last_updated = coalesce(p.updated, 0),
        last_deleted = coalesce(p.deleted, 0),
        last_skipped = coalesce(cardinality(p.skipped), 0),
        last_more = more,
        -- the earliest pending deferral (least ignores NULL; a past one is dropped)
        deferred_until = case
            when action = 'work' and coalesce(cardinality(p.skipped), 0) > 0
                then least(case when s.deferred_until > now() then s.deferred_until end, lockstep._defer_until())
            else s.deferred_until end,
        consecutive_failures = case when v_failed then s.consecutive_failures + 1 else 0 end,
        last_error = case when v_failed then error else null end,
        recompute_error = case when action in ('recompute', 'call') then case when v_failed then error end
                               else s.recompute_error end,
        recompute_poisoned_at = case when action = 'recompute' or v_release then null else s.recompute_poisoned_at end,
        recompute_poison_cured = case
            when action = 'recompute' or v_release then false
            when action = 'work' and s.recompute_poisoned_at is not null and v_cured then true
            else s.recompute_poison_cured end,
        runs = s.runs + case when v_again then 0 else 1 end
    where s.job = j.job;
    if not coalesce(v_again, false) then
        perform lockstep._log_run(j, action, outcome, started, p, error);
    end if;
end;
$$;
comment on function lockstep._finish(lockstep.job, text, text, timestamp with time zone, lockstep._pass, text, boolean, boolean) is
    'Write the job''s status row, last in every run that did something (a second only-skipped pass in a '
    'row is no new run). Security definer, for a caller that manages j (42501). Locks: the job''s '
    'lockstep.job_state row (FOR NO KEY UPDATE, by the update); then as lockstep._log_run.';

-- lockstep._failed(j, action, started, error): record a failed run (status row) and return its result.
-- The error says what no longer holds of a derived job's definition, if anything (lockstep._drift).
-- locks: the job's lockstep.job_state row, as lockstep._finish.
create or replace function lockstep._failed(j lockstep.job, action text, started timestamptz, error text)
returns lockstep.result
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_drift text := lockstep._drift(j);
begin
    if v_drift is not null then
        error := pg_catalog.concat(error, ' (', v_drift, ')');
    end if;
    perform lockstep._finish(j, action, 'failed', started, null, error);
    return lockstep._result('failed', j.job, action, null, error);
end;
$$;
comment on function lockstep._failed(lockstep.job, text, timestamp with time zone, text) is
    'Record a failed run (status row) and return its result. The error says what no longer holds of a '
    'derived job''s definition, if anything (lockstep._drift). Locks: the job''s lockstep.job_state row, '
    'as lockstep._finish.';

-- lockstep._due_by(job, at, unless_poisoned): job's next run is due by at (next_run_at lowered to it, never
-- raised); unless_poisoned: not while a poisoned recompute holds its flags. Security definer, for a caller
-- that manages job (42501): no recipe role holds UPDATE on lockstep.job_state.
-- locks: the job's lockstep.job_state row (FOR NO KEY UPDATE, by the update).
create or replace function lockstep._due_by(job text, at timestamptz, unless_poisoned boolean default false)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    perform lockstep._check_manages(job);
    update lockstep.job_state s set next_run_at = least(s.next_run_at, at)
    where s.job = _due_by.job and not (unless_poisoned and s.recompute_poisoned_at is not null);
end;
$$;
comment on function lockstep._due_by(text, timestamp with time zone, boolean) is
    'Job''s next run is due by at (next_run_at lowered to it, never raised); unless_poisoned: not while a '
    'poisoned recompute holds its flags. Security definer, for a caller that manages job (42501). Locks: '
    'the job''s lockstep.job_state row (FOR NO KEY UPDATE, by the update).';

-- lockstep._session_get(setting): the transaction's value of lockstep.<setting> (01_schema.sql lists them), NULL if
-- unset or empty. With lockstep._session_set, the only reader and writer of lockstep's session settings.
create or replace function lockstep._session_get(setting text) returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return nullif(pg_catalog.current_setting(pg_catalog.concat('lockstep.', setting), true), '');
end;
$$;

-- lockstep._session_set(setting, value): set lockstep.<setting> to value (NULL: empty) until the transaction ends.
create or replace function lockstep._session_set(setting text, value text) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    perform pg_catalog.set_config(pg_catalog.concat('lockstep.', setting), coalesce(value, ''), true);
end;
$$;

-- key types ---------------------------------------------------------------------------------------------

-- lockstep._trusted_fn(f): function f is a superuser's (PostgreSQL's own, or an extension's a superuser
-- installed, as citext's): code no job owner wrote.
create or replace function lockstep._trusted_fn(f oid) returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select from pg_catalog.pg_proc p join pg_catalog.pg_roles r on r.oid = p.proowner
                   where p.oid = f and r.rolsuper);
$$;

-- lockstep._composite_key_problem(t): why the composite type t may not be a parent key type (NULL: it may).
-- It must be free-standing (CREATE TYPE ... AS, not a table's row type, which changes with its table), have
-- no cast from or to it or its array (whatever the cast runs), and every field must be of a type
-- lockstep._key_type_problem allows that is not composite itself: record I/O and comparison then run only
-- the fields' own, a superuser's, functions. PL/pgSQL: it and lockstep._key_type_problem call each other.
create or replace function lockstep._composite_key_problem(t regtype) returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select case
        when c.relkind is distinct from 'c' then 'a table''s row type, not a type made by CREATE TYPE ... AS (...)'
        when exists (select from pg_catalog.pg_cast k
                     where k.castsource in (t, ty.typarray) or k.casttarget in (t, ty.typarray))
            then 'a cast from or to it exists (CREATE CAST): a composite key type may have none'
        -- PostgreSQL's own types (below FirstNormalObjectId) take no cast or I/O function of a role that is
        -- not a superuser: only their kind is checked, without lockstep._key_type_problem's look-ups
        else (select pg_catalog.format('its field %I is %s, which is %s', a.attname, a.atttypid::regtype, w.why)
              from pg_catalog.pg_attribute a join pg_catalog.pg_type y on y.oid = a.atttypid,
                   lateral (select case
                       when y.typtype = 'c' then 'a composite type'
                       when a.atttypid::pg_catalog.oid >= 16384 then lockstep._key_type_problem(a.atttypid)
                       when y.typtype not in ('b', 'e') or y.typcategory = 'A'
                           then 'not a base type, an enum or a composite type' end) w(why)
              where a.attrelid = ty.typrelid and a.attnum > 0 and not a.attisdropped and w.why is not null
              order by a.attnum limit 1)
        end
    from pg_catalog.pg_type ty left join pg_catalog.pg_class c on c.oid = ty.typrelid
    where ty.oid = t);
end;
$$;

-- lockstep._key_type_problem(t): why t may not be a parent key type (NULL: it may). A base type that is
-- not an array, or an enum, whose text input and output functions and every cast from or to it (or its
-- array) are a superuser's (lockstep._trusted_fn); or a composite type as lockstep._composite_key_problem
-- allows: lockstep converts, compares and sorts queued keys as the runner, the admin and the application,
-- outside the owner's sandbox, and a domain's CHECK, an array's element type or a cast the owner of an enum
-- made (CREATE CAST ... WITH FUNCTION) would run code of the owner's there, with their rights. Decided from
-- the catalogs alone.
create or replace function lockstep._key_type_problem(t regtype) returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    ty pg_catalog.pg_type;
begin
    if t is null then
        return null;
    end if;
    select * into ty from pg_catalog.pg_type y where y.oid = t;
    if not found then
        return 'does not exist';
    end if;
    -- the look-ups of lockstep._trusted_fn, written as joins: this runs at every conversion of keys
    return case
        when ty.typtype = 'd' then 'a domain'
        when ty.typtype = 'c' then lockstep._composite_key_problem(t)
        when ty.typtype not in ('b', 'e') or ty.typcategory = 'A' then 'not a base type, an enum or a composite type'
        when (select pg_catalog.count(*) from pg_catalog.pg_proc p join pg_catalog.pg_roles r on r.oid = p.proowner
              where p.oid in (ty.typinput, ty.typoutput) and r.rolsuper) < 2
            then 'its text input or output function is not a superuser''s'
        when exists (select from pg_catalog.pg_cast c
                     join pg_catalog.pg_proc p on p.oid = c.castfunc
                     left join pg_catalog.pg_roles r on r.oid = p.proowner and r.rolsuper
                     where (c.castsource in (t, ty.typarray) or c.casttarget in (t, ty.typarray))
                       and c.castfunc <> 0 and r.oid is null)
            then 'a cast from or to it runs a function that is not a superuser''s (CREATE CAST ... WITH FUNCTION)'
        end;
end;
$$;

-- lockstep._safe_key_type(t): t may be a parent key type (lockstep._key_type_problem); NULL may (no parent).
create or replace function lockstep._safe_key_type(t regtype) returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select lockstep._key_type_problem(t) is null;
$$;

-- lockstep._key_type_refused(job, t): why lockstep may not convert keys of type t for job now, as the
-- error's text (lockstep._key_type_problem; NULL: it may). Checked again before lockstep converts queued
-- keys: a cast can be created after define_derived. PostgreSQL's own types (below FirstNormalObjectId)
-- cannot get a cast from a role that is not a superuser: no look-up for them.
create or replace function lockstep._key_type_refused(job text, t regtype) returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.format('lockstep: the parent key type %s%s is refused: ', t,
                             case when job is not null then pg_catalog.format(' of job "%s"', job) else '' end)
           || lockstep._key_type_problem(t)
    where t >= 16384;
$$;

-- lockstep._check_key_type_safe(job, t): raise LSD04 if lockstep may not convert keys of type t for job
-- now (lockstep._key_type_refused).
create or replace function lockstep._check_key_type_safe(job text, t regtype) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v text := lockstep._key_type_refused(job, t);
begin
    if v is not null then
        raise exception '%', v
            using errcode = 'LSD04',
                  hint = 'lockstep converts queued keys outside the job owner''s rights: drop the cast, or '
                         'key the parent by a base type (bigint, text, uuid, ...).';
    end if;
end;
$$;

-- the caller's settings ----------------------------------------------------------------------------------
-- A job's code may SET a setting for the session (a plain SET outlives the SET clauses of the functions it
-- runs in). lockstep.run, recompute and work read the caller's values first and put back those changed.

-- lockstep._settings(): the values of the settings lockstep's entry points pin or a job's code most likely
-- sets, in the order of lockstep._restore_settings. No SET clause: it reads the caller's values (a SET
-- search_path would show its own); every name is qualified.
create or replace function lockstep._settings() returns text[]
language sql stable
as $$
    select array[pg_catalog.current_setting('search_path'), pg_catalog.current_setting('DateStyle'),
                 pg_catalog.current_setting('IntervalStyle'), pg_catalog.current_setting('extra_float_digits'),
                 pg_catalog.current_setting('TimeZone'), pg_catalog.current_setting('jit'),
                 pg_catalog.current_setting('statement_timeout'), pg_catalog.current_setting('lock_timeout')];
$$;

-- lockstep._restore_settings(was, now): set back, for the session, each setting of lockstep._settings()
-- whose value now differs from was.
create or replace function lockstep._restore_settings(was text[], now text[]) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_names constant text[] := array['search_path', 'DateStyle', 'IntervalStyle', 'extra_float_digits', 'TimeZone',
                                     'jit', 'statement_timeout', 'lock_timeout'];
begin
    for i in 1 .. pg_catalog.cardinality(v_names) loop
        if was[i] is distinct from now[i] then
            perform pg_catalog.set_config(v_names[i], was[i], false);
        end if;
    end loop;
end;
$$;
