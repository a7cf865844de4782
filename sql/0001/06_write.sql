-- lockstep 0001: the compute phase and the one write path (lockstep._write), shared by the periodic
-- recompute and the queue worker.

-- lockstep._compute_into(j, keys): fill pg_temp.lockstep_desired with compute(keys) (NULL: all), keep only
-- rows of the parents in keys, reject duplicate or NULL primary keys, and ANALYZE it.
-- JIT is off in lockstep's compute and write functions: their queries are short, and JIT compilation,
-- triggered by a bad estimate, cost more than the query itself in measurements (200 ms for a 500-key pass).
-- locks: no row locks (whatever the compute function reads, under MVCC).
create function lockstep._compute_into(j lockstep.job, keys text[]) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
set jit = off
as $$
declare
    v_cols text := lockstep._cols(j.columns);
    v_pk text := lockstep._cols(j.target_key);
    v_fn text;
    v_arg text;
    v_bad text;
begin
    select pg_catalog.format('%I.%I', n.nspname, p.proname), pg_catalog.format_type(p.proargtypes[0], null)
    into v_fn, v_arg
    from pg_catalog.pg_proc p join pg_catalog.pg_namespace n on n.oid = p.pronamespace
    where p.oid = j.compute::regprocedure;
    drop table if exists pg_temp.lockstep_desired;
    execute pg_catalog.format('create temp table lockstep_desired on commit drop as select %s from %s limit 0',
                              v_cols, j.target);
    execute pg_catalog.format('insert into pg_temp.lockstep_desired (%1$s) select %1$s from %2$s($1::%3$s)',
                              v_cols, v_fn, v_arg) using keys;
    if keys is not null then
        execute pg_catalog.format('delete from pg_temp.lockstep_desired where not coalesce(%I = any($1::%s), false)',
                                  j.parent_column, lockstep._array_type(j.key_type)) using keys;
    end if;
    execute pg_catalog.format('select row(%s)::text from pg_temp.lockstep_desired where %s limit 1',
                              v_pk, (select pg_catalog.string_agg(pg_catalog.format('%I is null', k), ' or ')
                                     from pg_catalog.unnest(j.target_key) k)) into v_bad;
    if v_bad is not null then
        raise exception 'lockstep: compute function % returned a NULL primary key %', j.compute, v_bad
            using errcode = 'LSD05';
    end if;
    execute pg_catalog.format('select row(%1$s)::text from pg_temp.lockstep_desired group by %1$s having count(*) > 1 limit 1',
                              v_pk) into v_bad;
    if v_bad is not null then
        raise exception 'lockstep: compute function % returned more than one row for primary key % of %',
            j.compute, v_bad, j.target using errcode = 'LSD05';
    end if;
    analyze pg_temp.lockstep_desired;
end;
$$;

-- lockstep._drop_rows(tbl, cond, keys): delete from a pg_temp work table the rows matching cond (with $1 =
-- keys) and return the parent keys of the rows removed.
-- locks: nothing outside pg_temp.
create function lockstep._drop_rows(tbl text, cond text, keys text[] default null) returns text[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v text[];
begin
    execute pg_catalog.format('with d as (delete from pg_temp.%I where %s returning lockstep_parent) '
                              'select coalesce(array_agg(distinct lockstep_parent) filter (where lockstep_parent is not null), ''{}'') from d',
                              tbl, cond) into v using keys;
    return v;
end;
$$;

-- lockstep._write(j, keys): THE write path. Apply pg_temp.lockstep_desired (filled by _compute_into) to
-- the target, restricted to the parents in keys (NULL: the whole table). Used by recompute and by work.
--
-- First, without any row lock: the difference (rows gone; rows new or changed by IS DISTINCT FROM).
-- Then the write phase. locks, in this order, never waiting for any of them:
--   1. parent rows of every derived row about to be deleted, inserted or updated (its new and its old
--      parent): FOR KEY SHARE SKIP LOCKED, in parent-key order. A parent locked by a deleter is skipped.
--   2. rows referenced through each other foreign key of the target: FOR KEY SHARE SKIP LOCKED, one
--      constraint at a time in constraint-name order, each in key order.
--   3. the target rows to delete or update: FOR UPDATE SKIP LOCKED, in primary-key order; then the
--      deletes, then one INSERT ... ON CONFLICT DO UPDATE ... WHERE IS DISTINCT FROM, in primary-key order.
-- Rows whose locks were skipped are not written (never a wait, never a 23503); their parent keys are
-- returned in skipped (still existing, to be re-queued) or counted in gone (deleted meanwhile).
-- The caller writes the job's status row after this.
create function lockstep._write(j lockstep.job, keys text[]) returns lockstep._pass
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
set jit = off
as $$
declare
    v_dcols text := lockstep._cols(j.columns, 'd');
    v_tcols text := lockstep._cols(j.columns, 't');
    v_pk text := lockstep._cols(j.target_key);
    v_keyarr text := lockstep._array_type(j.key_type);
    v_cur text;
    v_ctid text;
    v_tpar text := 'null::text';
    v_dpar text := 'null::text';
    v_set text;
    v_need text[];
    v_pinned text[];
    v_skip text[] := '{}';
    v_t0 timestamptz := clock_timestamp();
    v_t1 timestamptz;
    v_gone bigint;
    v_put bigint;
    v_new bigint;
    n bigint;
    c record;
    p lockstep._pass := row(0, 0, 0, '{}', 0, 0, 0, '{}', '{}');
begin
    if j.parent_column is not null then
        v_tpar := pg_catalog.format('t.%I::text', j.parent_column);
        v_dpar := pg_catalog.format('d.%I::text', j.parent_column);
    end if;

    -- the difference, without row locks ---------------------------------------------------------------
    -- current rows: for a subset, copied by one index probe per parent key (the lateral subquery is not
    -- flattened, so a stale estimate right after a big fill cannot turn it into a scan of the whole
    -- target); for the whole table, the target itself.
    drop table if exists pg_temp.lockstep_current, pg_temp.lockstep_gone, pg_temp.lockstep_put,
                         pg_temp.lockstep_locked;
    if keys is not null and j.parent_column is not null then
        execute pg_catalog.format(
            'create temp table lockstep_current on commit drop as '
            'select t.* from pg_catalog.unnest($1::%s) k(v), '
            'lateral (select %s, t.ctid as lockstep_ctid from %s t where t.%I = k.v offset 0) t',
            v_keyarr, v_tcols, j.target, j.parent_column) using keys;
        analyze pg_temp.lockstep_current;
        v_cur := 'pg_temp.lockstep_current';
        v_ctid := 't.lockstep_ctid';
    else
        v_cur := j.target::text;
        v_ctid := 't.ctid';
    end if;
    -- gone and put carry the current row's ctid, so the write phase locks existing rows by a TID scan
    execute pg_catalog.format(
        'create temp table lockstep_gone on commit drop as '
        'select %1$s, %2$s as lockstep_parent, %5$s as lockstep_ctid from %3$s t '
        'where not exists (select from pg_temp.lockstep_desired d where %4$s)',
        v_tcols, v_tpar, v_cur, lockstep._eq(j.target_key, 'd', 't'), v_ctid);
    get diagnostics v_gone = row_count;
    execute pg_catalog.format(
        'create temp table lockstep_put on commit drop as '
        'select %1$s, %2$s as lockstep_parent, %3$s as lockstep_old_parent, t.ctid is null as lockstep_new, '
        '%7$s as lockstep_ctid '
        'from pg_temp.lockstep_desired d left join %4$s t on %5$s '
        'where t.ctid is null or (%1$s) is distinct from (%6$s)',
        v_dcols, v_dpar, v_tpar, v_cur, lockstep._eq(j.target_key, 'd', 't'), v_tcols, v_ctid);
    get diagnostics v_put = row_count;
    if v_cur <> j.target::text then
        -- a row taken for new may exist under another parent (it moves): probe the target by primary key
        execute pg_catalog.format(
            'update pg_temp.lockstep_put p set lockstep_new = false, lockstep_old_parent = t.%1$I::text, '
            'lockstep_ctid = t.ctid '
            'from %2$s t where p.lockstep_new and %3$s',
            j.parent_column, j.target, lockstep._eq(j.target_key, 'p', 't'));
    end if;
    if v_gone > 0 or v_put > 0 then
        analyze pg_temp.lockstep_gone;
        analyze pg_temp.lockstep_put;
    end if;
    v_t1 := clock_timestamp();
    p.compute_ms := extract(epoch from v_t1 - v_t0) * 1000;
    if v_gone = 0 and v_put = 0 then
        return p;  -- nothing to write: no lock taken at all
    end if;

    -- 1. pin the parents, in key order, skipping those an application holds --------------------------
    if j.parent is not null then
        execute 'select coalesce(array_agg(distinct k), ''{}'') from ('
                '  select lockstep_parent from pg_temp.lockstep_gone'
                '  union all select lockstep_parent from pg_temp.lockstep_put'
                '  union all select lockstep_old_parent from pg_temp.lockstep_put) s(k) where k is not null'
            into v_need;
        execute pg_catalog.format(
            'select coalesce(array_agg(k), ''{}'') from ('
            '  select %1$I::text as k from %2$s where %1$I = any($1::%3$s)'
            '  order by %1$I for key share skip locked) s',
            j.parent_key, j.parent, v_keyarr) into v_pinned using v_need;
        v_skip := array(select pg_catalog.unnest(v_need) except select pg_catalog.unnest(v_pinned));
        if cardinality(v_skip) > 0 then
            perform lockstep._drop_rows('lockstep_gone', 'lockstep_parent = any($1)', v_skip);
            v_skip := v_skip || lockstep._drop_rows('lockstep_put',
                'lockstep_parent = any($1) or lockstep_old_parent = any($1)', v_skip);
        end if;
    end if;

    -- 2. pin the rows the target's other foreign keys reference ----------------------------------------
    for c in
        select con.conname, con.confrelid::regclass as ref,
               array(select a.attname from pg_catalog.unnest(con.conkey) with ordinality k(n, o)
                     join pg_catalog.pg_attribute a on a.attrelid = con.conrelid and a.attnum = k.n order by k.o) as fk,
               array(select a.attname from pg_catalog.unnest(con.confkey) with ordinality k(n, o)
                     join pg_catalog.pg_attribute a on a.attrelid = con.confrelid and a.attnum = k.n order by k.o) as rk
        from pg_catalog.pg_constraint con
        where con.conrelid = j.target and con.contype = 'f'
          and not (j.parent is not null and con.confrelid = j.parent
                   and con.conkey = array[(select a.attnum from pg_catalog.pg_attribute a
                                           where a.attrelid = j.target and a.attname = j.parent_column)])
        order by con.conname
    loop
        continue when not (c.fk <@ j.columns);
        drop table if exists pg_temp.lockstep_ref;
        execute pg_catalog.format(
            'create temp table lockstep_ref on commit drop as '
            'select %1$s from %2$s r where (%1$s) in ('
            '  select %3$s from pg_temp.lockstep_put where %4$s'
            '  union select %3$s from pg_temp.lockstep_gone where %4$s) '
            'order by %1$s for key share skip locked',
            lockstep._cols(c.rk, 'r'), c.ref, lockstep._cols(c.fk),
            (select pg_catalog.string_agg(pg_catalog.format('%I is not null', x), ' and ') from pg_catalog.unnest(c.fk) x));
        v_set := pg_catalog.format('(%s) is not null and not exists (select from pg_temp.lockstep_ref r where (%s) = (%s))',
            lockstep._cols(c.fk), lockstep._cols(c.rk, 'r'), lockstep._cols(c.fk));
        v_skip := v_skip || lockstep._drop_rows('lockstep_put', v_set) || lockstep._drop_rows('lockstep_gone', v_set);
    end loop;

    -- 3. lock the target rows to delete or update, in key order; then delete; then upsert ------------
    -- found by ctid (a TID scan); a row whose ctid no longer holds its key is not in lockstep_locked and
    -- is skipped like a locked one.
    execute pg_catalog.format(
        'create temp table lockstep_locked on commit drop as '
        'select %1$s from %2$s t where t.ctid = any(array('
        '  select lockstep_ctid from pg_temp.lockstep_gone'
        '  union all select lockstep_ctid from pg_temp.lockstep_put where not lockstep_new)) '
        'order by %1$s for update of t skip locked',
        lockstep._cols(j.target_key, 't'), j.target);
    v_set := pg_catalog.format('not exists (select from pg_temp.lockstep_locked l where %s)',
                               lockstep._eq(j.target_key, 'l', 'lockstep_gone'));
    v_skip := v_skip || lockstep._drop_rows('lockstep_gone', v_set);
    v_set := pg_catalog.format('not lockstep_new and not exists (select from pg_temp.lockstep_locked l where %s)',
                               lockstep._eq(j.target_key, 'l', 'lockstep_put'));
    v_skip := v_skip || lockstep._drop_rows('lockstep_put', v_set);

    execute pg_catalog.format('delete from %s t using pg_temp.lockstep_gone g where %s',
                              j.target, lockstep._eq(j.target_key, 't', 'g'));
    get diagnostics n = row_count;
    p.deleted := n;

    select pg_catalog.string_agg(pg_catalog.format('%I = excluded.%I', x, x), ', ')
    into v_set from pg_catalog.unnest(j.columns) x where not x = any(j.target_key);
    execute pg_catalog.format(
        'insert into %1$s as t (%2$s) select %2$s from pg_temp.lockstep_put order by %3$s on conflict (%3$s) %4$s',
        j.target, lockstep._cols(j.columns), v_pk,
        case when v_set is null then 'do nothing'
             else pg_catalog.format('do update set %s where (%s) is distinct from (%s)', v_set,
                  (select lockstep._cols(array_agg(x), 't') from pg_catalog.unnest(j.columns) x where not x = any(j.target_key)),
                  (select lockstep._cols(array_agg(x), 'excluded') from pg_catalog.unnest(j.columns) x where not x = any(j.target_key)))
        end);
    get diagnostics n = row_count;
    execute 'select count(*) from pg_temp.lockstep_put where lockstep_new' into v_new;
    p.inserted := least(n, v_new);
    p.updated := n - p.inserted;

    -- skipped parents: those that still exist go back to the queue; the others were deleted meanwhile
    v_skip := array(select distinct pg_catalog.unnest(v_skip));
    if j.parent is not null and cardinality(v_skip) > 0 then
        execute pg_catalog.format('select coalesce(array_agg(k order by k), ''{}'') from pg_catalog.unnest($1) k '
                                  'where exists (select from %s where %I = k::%s)',
                                  j.parent, j.parent_key, j.key_type) into p.skipped using v_skip;
        p.gone := cardinality(v_skip) - cardinality(p.skipped);
    else
        p.skipped := v_skip;
    end if;
    p.write_ms := extract(epoch from clock_timestamp() - v_t1) * 1000;
    return p;
end;
$$;

-- lockstep._apply(j, keys): compute, diff and write for the parents in keys (NULL: all). The only path by
-- which lockstep writes a derived table.
-- locks: as lockstep._write (the compute phase takes no row lock).
create function lockstep._apply(j lockstep.job, keys text[]) returns lockstep._pass
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_t0 timestamptz := clock_timestamp();
    p lockstep._pass;
begin
    perform lockstep._compute_into(j, keys);
    p := lockstep._write(j, keys);
    p.compute_ms := extract(epoch from clock_timestamp() - v_t0) * 1000 - p.write_ms;
    return p;
end;
$$;
