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
    select lockstep._callable(p.oid, 1), pg_catalog.format_type(p.proargtypes[0], null) into v_fn, v_arg
    from pg_catalog.pg_proc p where p.oid = j.compute::regprocedure;
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

-- lockstep._diff(j, keys): the difference between pg_temp.lockstep_desired (filled by _compute_into) and
-- the target, restricted to the parents in keys (NULL: the whole table), without any row lock.
-- Fills pg_temp.lockstep_gone (current rows compute no longer returns) and pg_temp.lockstep_put (rows new
-- or changed by IS DISTINCT FROM), each with the row's parent key (lockstep_parent) and the current row's
-- ctid (lockstep_ctid); lockstep_put also has lockstep_old_parent and lockstep_new. Returns how many rows
-- the two hold. For a job without a parent, lockstep_parent is the row's primary key as text: what the
-- write steps return for a row they skip, so skipped counts rows there.
-- For a subset, current rows are copied by one index probe per parent key (the lateral subquery is not
-- flattened, so a stale estimate right after a big fill cannot turn it into a scan of the whole target).
-- locks: no row locks (reads the target under MVCC); creates pg_temp tables.
create function lockstep._diff(j lockstep.job, keys text[]) returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
set jit = off
as $$
declare
    v_tcols text := lockstep._cols(j.columns, 't');
    v_tpar text := 'null::text';
    v_dpar text := 'null::text';
    v_cur text := j.target::text;
    v_ctid text := 't.ctid';
    v_gone bigint;
    v_put bigint;
begin
    if j.parent_column is not null then
        v_tpar := pg_catalog.format('t.%I::text', j.parent_column);
        v_dpar := pg_catalog.format('d.%I::text', j.parent_column);
    else
        v_tpar := pg_catalog.format('row(%s)::text', lockstep._cols(j.target_key, 't'));
        v_dpar := pg_catalog.format('row(%s)::text', lockstep._cols(j.target_key, 'd'));
    end if;
    drop table if exists pg_temp.lockstep_current, pg_temp.lockstep_gone, pg_temp.lockstep_put,
                         pg_temp.lockstep_locked;
    if keys is not null and j.parent_column is not null then
        execute pg_catalog.format(
            'create temp table lockstep_current on commit drop as '
            'select t.* from pg_catalog.unnest($1::%s) k(v), '
            'lateral (select %s, t.ctid as lockstep_ctid from %s t where t.%I = k.v offset 0) t',
            lockstep._array_type(j.key_type), v_tcols, j.target, j.parent_column) using keys;
        analyze pg_temp.lockstep_current;
        v_cur := 'pg_temp.lockstep_current';
        v_ctid := 't.lockstep_ctid';
    end if;
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
        lockstep._cols(j.columns, 'd'), v_dpar, v_tpar, v_cur, lockstep._eq(j.target_key, 'd', 't'), v_tcols, v_ctid);
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
    return v_gone + v_put;
end;
$$;

-- lockstep._pin_parents(j): write step 1. Pin the parent of every row in pg_temp.lockstep_gone and
-- pg_temp.lockstep_put (its new and its old parent); rows whose parent could not be pinned are dropped
-- from both. Returns the parent keys left out.
-- locks: the parent rows, FOR KEY SHARE SKIP LOCKED, in parent-key order (a parent an application holds,
-- e.g. one being deleted, is skipped, never waited for).
create function lockstep._pin_parents(j lockstep.job) returns text[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_need text[];
    v_pinned text[];
    v_skip text[];
begin
    if j.parent is null then
        return '{}';
    end if;
    execute 'select coalesce(array_agg(distinct k), ''{}'') from ('
            '  select lockstep_parent from pg_temp.lockstep_gone'
            '  union all select lockstep_parent from pg_temp.lockstep_put'
            '  union all select lockstep_old_parent from pg_temp.lockstep_put) s(k) where k is not null'
        into v_need;
    execute pg_catalog.format(
        'select coalesce(array_agg(k), ''{}'') from ('
        '  select %1$I::text as k from %2$s where %1$I = any($1::%3$s)'
        '  order by %1$I for key share skip locked) s',
        j.parent_key, j.parent, lockstep._array_type(j.key_type)) into v_pinned using v_need;
    v_skip := array(select pg_catalog.unnest(v_need) except select pg_catalog.unnest(v_pinned));
    if cardinality(v_skip) > 0 then
        perform lockstep._drop_rows('lockstep_gone', 'lockstep_parent = any($1)', v_skip);
        v_skip := v_skip || lockstep._drop_rows('lockstep_put',
            'lockstep_parent = any($1) or lockstep_old_parent = any($1)', v_skip);
    end if;
    return v_skip;
end;
$$;

-- lockstep._pin_refs(j): write step 2. Pin the rows the target's other foreign keys reference, for every
-- row in pg_temp.lockstep_put and pg_temp.lockstep_gone; rows whose referenced row could not be pinned
-- are dropped. Returns the parent keys of the rows dropped. A foreign key whose columns compute does not
-- all return is one whose missing columns are always NULL (_check_target_fks, also run here for keys
-- added after define_derived): no FK check looks anything up for it.
-- locks: the referenced rows, FOR KEY SHARE SKIP LOCKED, one constraint at a time in constraint-name
-- order, each in key order.
create function lockstep._pin_refs(j lockstep.job) returns text[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_skip text[] := '{}';
    v_unpinned text;
    c record;
begin
    perform lockstep._check_target_fks(j.target, j.columns);
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
        v_unpinned := pg_catalog.format(
            '(%s) is not null and not exists (select from pg_temp.lockstep_ref r where (%s) = (%s))',
            lockstep._cols(c.fk), lockstep._cols(c.rk, 'r'), lockstep._cols(c.fk));
        v_skip := v_skip || lockstep._drop_rows('lockstep_put', v_unpinned)
                         || lockstep._drop_rows('lockstep_gone', v_unpinned);
    end loop;
    return v_skip;
end;
$$;

-- lockstep._lock_rows(j): write step 3a. Lock the existing target rows about to be deleted or updated,
-- found by their ctid (a TID scan); a row that is locked, or whose ctid no longer holds its key, is dropped
-- from pg_temp.lockstep_gone / lockstep_put. Returns the parent keys of the rows dropped.
-- A partitioned target (or one with inheritance children) has one ctid space per partition: the same
-- ctid names a row of another parent in another partition, so there the rows found by ctid are also
-- matched by primary key before they are locked (the primary key is unique across partitions).
-- locks: those target rows, FOR UPDATE SKIP LOCKED, in primary-key order.
create function lockstep._lock_rows(j lockstep.job) returns text[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_unlocked text;
    v_skip text[];
    v_mine text := '';
begin
    if exists (select from pg_catalog.pg_class c where c.oid = j.target and (c.relkind = 'p' or c.relhassubclass)) then
        v_mine := pg_catalog.format(
            ' and (%1$s) in (select %2$s from pg_temp.lockstep_gone'
            '  union all select %2$s from pg_temp.lockstep_put where not lockstep_new)',
            lockstep._cols(j.target_key, 't'), lockstep._cols(j.target_key));
    end if;
    execute pg_catalog.format(
        'create temp table lockstep_locked on commit drop as '
        'select %1$s from %2$s t where t.ctid = any(array('
        '  select lockstep_ctid from pg_temp.lockstep_gone'
        '  union all select lockstep_ctid from pg_temp.lockstep_put where not lockstep_new))%3$s '
        'order by %1$s for update of t skip locked',
        lockstep._cols(j.target_key, 't'), j.target, v_mine);
    v_unlocked := pg_catalog.format('not exists (select from pg_temp.lockstep_locked l where %s)',
                                    lockstep._eq(j.target_key, 'l', 'lockstep_gone'));
    v_skip := lockstep._drop_rows('lockstep_gone', v_unlocked);
    v_unlocked := pg_catalog.format('not lockstep_new and not exists (select from pg_temp.lockstep_locked l where %s)',
                                    lockstep._eq(j.target_key, 'l', 'lockstep_put'));
    return v_skip || lockstep._drop_rows('lockstep_put', v_unlocked);
end;
$$;

-- lockstep._referencing(rel, key, cols): the foreign keys that reference rel (rows of other tables, or of
-- rel itself, that a delete of rel's rows acts on), with the columns to join on, the referencing table's
-- primary key (lock order) and whether the action deletes (CASCADE: its rows are deleted in turn) or
-- updates (SET NULL). Raises LSD06 for what lockstep cannot delete through without waiting or failing:
-- ON DELETE NO ACTION / RESTRICT (the delete would fail with 23503 while referenced), SET DEFAULT (its FK
-- check locks a row lockstep did not pin), SET NULL on columns that are referenced in turn, and, when rel
-- is the target (key, cols given), a key on columns compute writes (the update would run its ON UPDATE
-- action); 42501 when the role cannot lock the referencing rows (SELECT and UPDATE).
-- Used by _check_referencing (define_derived refuses) and _lock_level (a key added later fails the run).
-- locks: nothing.
create function lockstep._referencing(rel regclass, key name[] default null, cols name[] default null)
returns table (conname name, refrel regclass, fk name[], rk name[], ord name[], deletes boolean)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    c record;
begin
    for c in
        select con.conname, con.conrelid::regclass as refrel, con.confdeltype,
               lockstep._attnames(con.conrelid, con.conkey) as fk, lockstep._attnames(con.confrelid, con.confkey) as rk,
               (select lockstep._attnames(pk.conrelid, pk.conkey) from pg_catalog.pg_constraint pk
                where pk.conrelid = con.conrelid and pk.contype = 'p') as ord,
               (select x.conrelid::regclass::text from pg_catalog.pg_constraint x
                where x.confrelid = con.conrelid and x.contype = 'f' and x.conparentid = 0
                  and x.confkey && coalesce(con.confdelsetcols, con.conkey)
                order by x.conname limit 1) as setnull_referenced
        from pg_catalog.pg_constraint con
        where con.confrelid = rel and con.contype = 'f' and con.conparentid = 0
        order by con.conname
    loop
        if c.confdeltype not in ('c', 'n') then
            raise exception 'lockstep: foreign key % of % references % ON DELETE %', c.conname, c.refrel, rel,
                    case c.confdeltype when 'a' then 'NO ACTION' when 'r' then 'RESTRICT' else 'SET DEFAULT' end
                using errcode = 'LSD06',
                      hint = 'lockstep deletes derived rows compute no longer returns: declare the key ON DELETE CASCADE '
                             'or ON DELETE SET NULL, so the delete acts on rows lockstep locks first (skipping any the '
                             'application holds).';
        elsif c.confdeltype = 'n' and c.setnull_referenced is not null then
            raise exception 'lockstep: foreign key % of % to % is ON DELETE SET NULL on columns % references', c.conname,
                    c.refrel, rel, c.setnull_referenced
                using errcode = 'LSD06', hint = 'Make it ON DELETE CASCADE, or reference other columns.';
        elsif not (pg_catalog.has_table_privilege(c.refrel, 'SELECT') and pg_catalog.has_table_privilege(c.refrel, 'UPDATE')) then
            raise exception 'lockstep: role "%" may not lock rows of %, which references % (foreign key %)', current_user,
                    c.refrel, rel, c.conname
                using errcode = '42501',
                      hint = 'lockstep locks the referencing rows FOR UPDATE SKIP LOCKED before a delete: grant SELECT, UPDATE.';
        elsif exists (select from pg_catalog.unnest(c.rk) r where r = any(cols) and not r = any(key)) then
            raise exception 'lockstep: foreign key % of % references columns % of % that compute writes', c.conname,
                    c.refrel, c.rk, rel
                using errcode = 'LSD06', hint = 'Reference the target''s primary key.';
        end if;
        conname := c.conname; refrel := c.refrel; fk := c.fk; rk := c.rk; ord := c.ord; deletes := c.confdeltype = 'c';
        return next;
    end loop;
end;
$$;

-- lockstep._check_referencing(target, key, cols): every foreign key a delete of target rows acts on, at
-- any depth (through ON DELETE CASCADE, cycles included), is one lockstep can lock through (_referencing).
-- locks: nothing.
create function lockstep._check_referencing(target regclass, key name[], cols name[]) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_seen oid[] := array[target::oid];
    v_front oid[] := array[target::oid];
    v_next oid[];
    c record;
begin
    while cardinality(v_front) > 0 loop
        v_next := '{}';
        for c in
            select r.refrel, r.deletes
            from pg_catalog.unnest(v_front) f(rel),
                 lateral lockstep._referencing(f.rel::regclass, case when f.rel = target then key end,
                                               case when f.rel = target then cols end) r
        loop
            if c.deletes and not c.refrel::oid = any(v_seen) then
                v_seen := v_seen || c.refrel::oid;
                v_next := v_next || c.refrel::oid;
            end if;
        end loop;
        v_front := v_next;
    end loop;
end;
$$;

-- lockstep._lock_level(t, depth): lock the rows referencing the rows of table t at this depth of
-- pg_temp.lockstep_doomed (rows the delete will remove), add them at depth + 1 (each row once), and return
-- the roots (target rows) of which a referencing row could not be locked.
-- locks: the referencing rows, FOR UPDATE SKIP LOCKED, one foreign key at a time in constraint-name order,
-- each in the referencing table's primary-key order (ctid order without one).
create function lockstep._lock_level(t regclass, depth integer) returns text[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    c record;
    v_from text;
    v_blocked text[] := '{}';
    v_part text[];
begin
    for c in select * from lockstep._referencing(t) loop
        -- rows of t at this depth, found by ctid (a TID scan), then the rows referencing them
        v_from := pg_catalog.format(
            'from %1$s p join pg_temp.lockstep_doomed d on d.lockstep_rel = p.tableoid and d.lockstep_ctid = p.ctid '
            'and d.lockstep_depth = $1 and d.lockstep_table = $2 and d.lockstep_deletes '
            'join %2$s n on (%3$s) = (%4$s) '
            'where p.ctid = any(array(select lockstep_ctid from pg_temp.lockstep_doomed '
            '                         where lockstep_depth = $1 and lockstep_table = $2 and lockstep_deletes))',
            t, c.refrel, lockstep._cols(c.fk, 'n'), lockstep._cols(c.rk, 'p'));
        execute pg_catalog.format(
            'with l as (select d.lockstep_root, n.tableoid as rel, n.ctid as tid %1$s '
            '  and not exists (select from pg_temp.lockstep_doomed x where x.lockstep_rel = n.tableoid and x.lockstep_ctid = n.ctid) '
            '  order by %2$s for update of n skip locked) '
            'insert into pg_temp.lockstep_doomed '
            'select distinct on (rel, tid) lockstep_root, rel, tid, $3, $4, $1 + 1 from l',
            v_from, coalesce(lockstep._cols(c.ord, 'n'), 'n.ctid'))
            using depth, t, c.refrel, c.deletes;
        execute pg_catalog.format(
            'select array_agg(distinct d.lockstep_root) %s and not exists (select from pg_temp.lockstep_doomed x '
            'where x.lockstep_rel = n.tableoid and x.lockstep_ctid = n.ctid)', v_from)
            into v_part using depth, t;
        v_blocked := v_blocked || coalesce(v_part, '{}');
    end loop;
    return v_blocked;
end;
$$;

-- lockstep._lock_referencing(j): write step 3a'. Lock the rows the delete of the target rows in
-- pg_temp.lockstep_gone acts on through foreign keys that reference the target (ON DELETE CASCADE / SET
-- NULL), and through the cascade on, level by level (pg_temp.lockstep_doomed). A target row of which any
-- such row could not be locked (an application holds it) is not deleted: dropped from lockstep_gone, its
-- parent key returned (re-queued like any skipped parent). No new referencing row can appear meanwhile:
-- inserting one takes FOR KEY SHARE on the row it references, which lockstep already holds FOR UPDATE.
-- locks: the referencing rows, FOR UPDATE SKIP LOCKED, level by level, each as _lock_level.
create function lockstep._lock_referencing(j lockstep.job) returns text[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_blocked text[] := '{}';
    v_depth integer := 0;
    v_t regclass;
begin
    if not exists (select from pg_temp.lockstep_gone)
       or not exists (select from lockstep._referencing(j.target, j.target_key, j.columns)) then
        return '{}';
    end if;
    drop table if exists pg_temp.lockstep_doomed;
    execute pg_catalog.format(
        'create temp table lockstep_doomed on commit drop as '
        'select row(%1$s)::text as lockstep_root, t.tableoid as lockstep_rel, t.ctid as lockstep_ctid, '
        '$1::regclass as lockstep_table, true as lockstep_deletes, 0 as lockstep_depth '
        'from pg_temp.lockstep_gone g join %2$s t on %3$s',
        lockstep._cols(j.target_key, 'g'), j.target, lockstep._eq(j.target_key, 't', 'g')) using j.target;
    while exists (select from pg_temp.lockstep_doomed d where d.lockstep_depth = v_depth) loop
        if v_depth > 100 then
            raise exception 'lockstep: the delete of % cascades more than 100 levels deep', j.target using errcode = 'LSD06';
        end if;
        for v_t in select distinct d.lockstep_table from pg_temp.lockstep_doomed d
                   where d.lockstep_depth = v_depth and d.lockstep_deletes order by 1 loop
            v_blocked := v_blocked || lockstep._lock_level(v_t, v_depth);
        end loop;
        v_depth := v_depth + 1;
    end loop;
    if cardinality(v_blocked) = 0 then
        return '{}';
    end if;
    return lockstep._drop_rows('lockstep_gone', pg_catalog.format('row(%s)::text = any($1)', lockstep._cols(j.target_key)),
                               v_blocked);
end;
$$;

-- lockstep._delete_rows(j): write step 3b. Delete the target rows in pg_temp.lockstep_gone (locked by
-- _lock_rows). Returns how many.
-- locks: those target rows (already held).
create function lockstep._delete_rows(j lockstep.job) returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    n bigint;
begin
    execute pg_catalog.format('delete from %s t using pg_temp.lockstep_gone g where %s',
                              j.target, lockstep._eq(j.target_key, 't', 'g'));
    get diagnostics n = row_count;
    return n;
end;
$$;

-- lockstep._upsert_rows(j): write step 3c. One INSERT ... ON CONFLICT DO UPDATE ... WHERE IS DISTINCT FROM
-- of pg_temp.lockstep_put, in primary-key order.
-- locks: the target rows it inserts (new) or updates (already held by _lock_rows).
create function lockstep._upsert_rows(j lockstep.job, out inserted bigint, out updated bigint)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rest name[] := array(select x from pg_catalog.unnest(j.columns) x where not x = any(j.target_key));
    v_action text := 'do nothing';
    v_new bigint;
    n bigint;
begin
    if cardinality(v_rest) > 0 then
        v_action := pg_catalog.format('do update set %s where (%s) is distinct from (%s)',
            (select pg_catalog.string_agg(pg_catalog.format('%I = excluded.%I', x, x), ', ') from pg_catalog.unnest(v_rest) x),
            lockstep._cols(v_rest, 't'), lockstep._cols(v_rest, 'excluded'));
    end if;
    execute pg_catalog.format(
        'insert into %1$s as t (%2$s) select %2$s from pg_temp.lockstep_put order by %3$s on conflict (%3$s) %4$s',
        j.target, lockstep._cols(j.columns), lockstep._cols(j.target_key), v_action);
    get diagnostics n = row_count;
    execute 'select count(*) from pg_temp.lockstep_put where lockstep_new' into v_new;
    inserted := least(n, v_new);
    updated := n - inserted;
end;
$$;

-- lockstep._write(j, keys): THE write path. Apply pg_temp.lockstep_desired (filled by _compute_into) to
-- the target, restricted to the parents in keys (NULL: the whole table). Used by recompute and by work.
-- First the difference, without any row lock (_diff), cut to the first j.batch_parents parents when keys is
-- NULL (_limit_batch: the rest is handed to the queue, before any row lock); then the write phase, in this
-- order, never waiting for any lock:
--   1. _pin_parents: parents of every row about to be deleted, inserted or updated;
--   2. _pin_refs: rows referenced through the target's other foreign keys;
--   3. _lock_rows, _lock_referencing, _delete_rows, _upsert_rows: the target rows, in primary-key order
--      (and, before a delete, the rows referencing them that its ON DELETE action changes).
-- Rows whose locks were skipped are not written (never a wait, never a 23503), nor is any other row of
-- their parents (a parent's rows are written together or not at all); those parent keys are returned in
-- skipped (still existing, to be re-queued) or counted in gone (deleted meanwhile).
-- The caller writes the job's status row after this.
-- locks: parents (FOR KEY SHARE SKIP LOCKED, key order), then other referenced rows (same, constraint-name
-- order), then target rows (FOR UPDATE SKIP LOCKED, primary-key order), then the rows referencing target
-- rows to delete (FOR UPDATE SKIP LOCKED, constraint-name then key order): see the steps.
create function lockstep._write(j lockstep.job, keys text[]) returns lockstep._pass
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
set jit = off
as $$
declare
    v_t0 timestamptz := clock_timestamp();
    v_t1 timestamptz;
    v_skip text[];
    p lockstep._pass := row(0, 0, 0, '{}', 0, 0, 0, '{}', '{}');
begin
    if lockstep._diff(j, keys) = 0 then
        p.compute_ms := extract(epoch from clock_timestamp() - v_t0) * 1000;
        return p;  -- nothing to write: no lock taken at all
    end if;
    perform lockstep._limit_batch(j, case when keys is null then j.batch_parents end);  -- 07_recompute.sql
    v_t1 := clock_timestamp();
    p.compute_ms := extract(epoch from v_t1 - v_t0) * 1000;
    v_skip := lockstep._pin_parents(j);
    v_skip := v_skip || lockstep._pin_refs(j);
    v_skip := v_skip || lockstep._lock_rows(j);
    v_skip := v_skip || lockstep._lock_referencing(j);
    if j.parent is not null and cardinality(v_skip) > 0 then
        -- a parent's rows are written together or not at all: none of a skipped parent's rows is written
        perform lockstep._drop_rows('lockstep_gone', 'lockstep_parent = any($1)', v_skip);
        perform lockstep._drop_rows('lockstep_put', 'lockstep_parent = any($1) or lockstep_old_parent = any($1)', v_skip);
    end if;
    p.deleted := lockstep._delete_rows(j);
    select u.inserted, u.updated into p.inserted, p.updated from lockstep._upsert_rows(j) u;
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
-- which lockstep writes a derived table. It runs as the job's owner: called by another role, it comes back
-- here through lockstep._as_owner (SET LOCAL ROLE owner, in the owner's SECURITY DEFINER trampoline), or
-- raises 42501 if that role may not act as the owner.
-- locks: as lockstep._write (the compute phase takes no row lock).
create function lockstep._apply(j lockstep.job, keys text[]) returns lockstep._pass
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_t0 timestamptz := clock_timestamp();
    p lockstep._pass;
begin
    if j.owner is distinct from current_user then
        return lockstep._as_owner(j, keys);
    end if;
    perform lockstep._compute_into(j, keys);
    p := lockstep._write(j, keys);
    p.compute_ms := extract(epoch from clock_timestamp() - v_t0) * 1000 - p.write_ms;
    return p;
end;
$$;
