-- lockstep: the compute phase and the one write path (lockstep._write), shared by recompute and worker.
-- Work tables (lockstep._tmp_setup): session temp tables per job shape and role, empty between calls:
-- pg_temp.lockstep_gone_<s>  j.columns, lockstep_parent, lockstep_ctid
-- pg_temp.lockstep_put_<s>   j.columns, lockstep_parent, lockstep_old_parent, lockstep_new, lockstep_ctid

-- lockstep._tmp_setup(j): make sure this session has the work tables of j's shape and return their suffix.
-- locks: nothing outside pg_temp (the first time in a session: creates the tables).
create or replace function lockstep._tmp_setup(j lockstep.job) returns text
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
as $$
declare
    v_layout constant text := 'v3 parent,ctid | parent,old_parent,new,ctid';
    v_me oid := (select r.oid from pg_catalog.pg_roles r where r.rolname = current_user);
    v_s text;
    v_other text;
    v_cols text;
begin
    select pg_catalog.left(pg_catalog.md5(pg_catalog.concat_ws('|', j.target::oid, v_layout, current_user,
                    j.target_key::text,
                    pg_catalog.string_agg(pg_catalog.concat_ws(' ', a.attname, a.atttypid, a.atttypmod, a.attcollation),
                                          ',' order by u.o))), 16),
           pg_catalog.string_agg(pg_catalog.format('t.%I', u.c), ', ' order by u.o)
    into v_s, v_cols
    from pg_catalog.unnest(j.columns) with ordinality u(c, o)
    left join pg_catalog.pg_attribute a on a.attrelid = j.target and a.attname = u.c and not a.attisdropped;
    -- only tables this role owns: another owner's code could make tables of these names fire triggers as it
    if not (lockstep._own_temp('lockstep_put_' || v_s) and lockstep._own_temp('lockstep_gone_' || v_s)) then
        select pg_catalog.substr(c.relname, 14) into v_other  -- this role's pair under another suffix (14:
        from pg_catalog.pg_class c                            -- after 'lockstep_put_')
        where c.relnamespace = pg_catalog.pg_my_temp_schema() and c.relowner = v_me and c.relkind = 'r'
          and c.relname like 'lockstep\_put\_' || v_s || '\_%'
          and lockstep._own_temp('lockstep_gone_' || pg_catalog.substr(c.relname, 14))
        order by c.relname limit 1;
        if v_other is not null then
            v_s := v_other;
        else
            if pg_catalog.to_regclass(pg_catalog.format('pg_temp.%I', 'lockstep_put_' || v_s)) is not null
               or pg_catalog.to_regclass(pg_catalog.format('pg_temp.%I', 'lockstep_gone_' || v_s)) is not null
               or pg_catalog.to_regclass(pg_catalog.format('pg_temp.%I', 'lockstep_rest_' || v_s)) is not null then
                v_s := v_s || '_' || pg_catalog.substr(pg_catalog.md5(pg_catalog.random()::text), 1, 8);
            end if;
            execute pg_catalog.format('create temp table %I as '
                                      'select %s, null::text as lockstep_parent, null::tid as lockstep_ctid '
                                      'from %s t with no data', 'lockstep_gone_' || v_s, v_cols, j.target);
            execute pg_catalog.format('create temp table %I as '
                                      'select %s, null::text as lockstep_parent, null::text as lockstep_old_parent, '
                                      'null::boolean as lockstep_new, null::tid as lockstep_ctid '
                                      'from %s t with no data', 'lockstep_put_' || v_s, v_cols, j.target);
        end if;
    end if;
    perform lockstep._session_set('tmp', v_s);
    perform lockstep._session_set('tmp_job', j.job);
    return v_s;
end;
$$;

-- lockstep._own_temp(name): a table of that name exists in this session's temp schema and the current
-- role owns it.
create or replace function lockstep._own_temp(name text) returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return exists (select from pg_catalog.pg_class c
                   where c.relname = _own_temp.name and c.relnamespace = pg_catalog.pg_my_temp_schema()
                     and c.relkind = 'r'
                     and c.relowner = (select r.oid from pg_catalog.pg_roles r where r.rolname = current_user));
end;
$$;

-- lockstep._tmp(j, what): the name (in pg_temp) of j's work table what: gone or put.
-- locks: nothing (as lockstep._tmp_setup when this transaction has not set them up for j yet).
create or replace function lockstep._tmp(j lockstep.job, what text) returns text
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_s text := lockstep._session_get('tmp');
begin
    if v_s is null or lockstep._session_get('tmp_job') is distinct from j.job then
        v_s := lockstep._tmp_setup(j);
    end if;
    return 'lockstep_' || what || '_' || v_s;
end;
$$;

-- lockstep._tmp_clear(j): empty j's work tables: DELETE, or TRUNCATE once their dead rows pass 1 MB.
-- locks: nothing outside pg_temp.
create or replace function lockstep._tmp_clear(j lockstep.job) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_gone text := lockstep._tmp(j, 'gone');
    v_put text := lockstep._tmp(j, 'put');
begin
    if pg_catalog.pg_relation_size(pg_catalog.format('pg_temp.%I', v_gone)::regclass)
       + pg_catalog.pg_relation_size(pg_catalog.format('pg_temp.%I', v_put)::regclass) > 1048576 then
        execute pg_catalog.format('truncate pg_temp.%I, pg_temp.%I', v_gone, v_put);
    else
        execute pg_catalog.format('with a as (delete from pg_temp.%I) delete from pg_temp.%I', v_gone, v_put);
    end if;
end;
$$;

-- lockstep._drop_rows(tbl, cond, keys): delete from a pg_temp work table (alias w) the rows matching cond
-- (with $1 = keys) and return the parent keys of the rows removed.
-- locks: nothing outside pg_temp.
create or replace function lockstep._drop_rows(tbl text, cond text, keys text[] default null) returns text[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v text[];
begin
    execute pg_catalog.format('with d as (delete from pg_temp.%I w where %s returning lockstep_parent) '
                              'select coalesce(array_agg(distinct lockstep_parent) filter (where lockstep_parent is not null), ''{}'') from d',
                              tbl, cond) into v using keys;
    return v;
end;
$$;

-- lockstep._check_computed_key(j, bad, is_null): raise LSD05 for the primary key bad that compute
-- returned NULL (is_null) or more than once; nothing if bad is NULL and is_null is not true.
create or replace function lockstep._check_computed_key(j lockstep.job, bad text, is_null boolean) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if is_null then
        raise exception 'lockstep: compute function % returned a NULL primary key %', j.compute, bad
            using errcode = 'LSD05';
    elsif bad is not null then
        raise exception 'lockstep: compute function % returned more than one row for primary key % of %',
            j.compute, bad, j.target using errcode = 'LSD05';
    end if;
end;
$$;

-- lockstep._differs(j, a, b, cols): SQL true where row a's columns cols (NULL: all) differ from row b's
-- (the target's): IS DISTINCT FROM, or binary image (*=) for j.image_columns. Parenthesized: it is an OR.
create or replace function lockstep._differs(j lockstep.job, a text, b text, cols name[] default null) returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_cols name[] := coalesce(cols, j.columns);
    v_eq name[] := array(select c from pg_catalog.unnest(v_cols) c where c <> all(j.image_columns));
    v_img name[] := array(select c from pg_catalog.unnest(v_cols) c where c = any(j.image_columns));
    v_out text[] := '{}';
begin
    if cardinality(v_eq) > 0 then
        v_out := v_out || pg_catalog.format('(%s) is distinct from (%s)', lockstep._cols(v_eq, a), lockstep._cols(v_eq, b));
    end if;
    if cardinality(v_img) > 0 then
        v_out := v_out || pg_catalog.format(
            'not (row(%s)::record operator(pg_catalog.*=) row(%s)::record)',
            (select pg_catalog.string_agg(pg_catalog.format('%s::%s', lockstep._cols(array[x.c], a),
                                                            pg_catalog.format_type(t.atttypid, t.atttypmod)), ', ' order by x.o)
             from pg_catalog.unnest(v_img) with ordinality x(c, o)
             join pg_catalog.pg_attribute t on t.attrelid = j.target and t.attname = x.c),
            lockstep._cols(v_img, b));
    end if;
    return pg_catalog.format('(%s)', coalesce(nullif(pg_catalog.array_to_string(v_out, ' or '), ''), 'false'));
end;
$$;

-- lockstep._diff_run(j, keys, d, c, dup, g, p, once): the diff pipeline shared by lockstep._diff and
-- lockstep._diff_all, one statement over compute(keys) ($1 = keys): empty j's work tables, then the CTEs
-- d (compute's rows), c (the current rows, or the join), the first duplicate or NULL primary key among the
-- rows of dup (a FROM clause, alias d), g (the rows for the gone table: j's columns, parent, ctid) and p
-- (the rows for the put table: j's columns, parent, old parent, new, ctid). Returns the work tables'
-- counts, that key (bad, is_null: it is NULL) and once (an expression over the CTEs, true where no
-- current row matched two computed rows).
-- locks: no row locks (compute reads and the target is read under MVCC); writes only pg_temp work tables.
create or replace function lockstep._diff_run(j lockstep.job, keys text[], d text, c text, dup text, g text, p text,
                                   once text, out n lockstep._diff_counts, out bad text, out is_null boolean,
                                   out once_ok boolean)
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
set jit = off
as $$
declare
    v_pk text := lockstep._cols(j.target_key);
    v_pknull text := (select pg_catalog.string_agg(pg_catalog.format('%I is null', k), ' or ')
                      from pg_catalog.unnest(j.target_key) k);
    v_cols text := lockstep._cols(j.columns);
begin
    execute pg_catalog.format('with e1 as (delete from pg_temp.%I), e2 as (delete from pg_temp.%I), ',
                              lockstep._tmp(j, 'gone'), lockstep._tmp(j, 'put'))
         || pg_catalog.format('d as materialized (%s), c as materialized (%s), ', d, c)
         || pg_catalog.format('x as (select row(%1$s)::text as k, bool_or(%2$s) as n from %3$s group by %1$s '
                              '      having count(*) > 1 or bool_or(%2$s) order by 2 desc limit 1), ', v_pk, v_pknull, dup)
         || pg_catalog.format('g as (insert into pg_temp.%I (%s, lockstep_parent, lockstep_ctid) %s returning 1), ',
                              lockstep._tmp(j, 'gone'), v_cols, g)
         || pg_catalog.format('p as (insert into pg_temp.%I (%s, lockstep_parent, lockstep_old_parent, lockstep_new, '
                              '                             lockstep_ctid) %s '
                              '      returning lockstep_new, lockstep_new or lockstep_parent is distinct from '
                              '                lockstep_old_parent as lockstep_pin) ', lockstep._tmp(j, 'put'), v_cols, p)
         || pg_catalog.format('select (select count(*) from g), pc.n, pc.pin, pc.kept, (select k from x), '
                              '       (select n from x), %s '
                              'from (select count(*) filter (where p.lockstep_new) as n, '
                              '             count(*) filter (where p.lockstep_pin) as pin, '
                              '             count(*) filter (where not p.lockstep_new) as kept from p) pc', once)
        into n.gone, n.fresh, n.pin, n.kept, bad, is_null, once_ok using keys;
end;
$$;
comment on function lockstep._diff_run(lockstep.job, text[], text, text, text, text, text, text) is
    'The diff pipeline shared by lockstep._diff and lockstep._diff_all, one statement over compute(keys) '
    '($1 = keys): empty j''s work tables, then the CTEs d (compute''s rows), c (the current rows, or the '
    'join), the first duplicate or NULL primary key among the rows of dup (a FROM clause, alias d), g '
    '(the rows for the gone table: j''s columns, parent, ctid) and p (the rows for the put table: j''s '
    'columns, parent, old parent, new, ctid). Returns the work tables'' counts, that key (bad, is_null: '
    'it is NULL) and once (an expression over the CTEs, true where no current row matched two computed '
    'rows). Locks: no row locks (compute reads and the target is read under MVCC); writes only pg_temp '
    'work tables.';

-- lockstep._compute_sql(j): compute called with $1, as a FROM item kept from seeing filters around it
-- (offset 0: a filter pushed into compute spoiled its plan). An array of composite keys is cast once, in a
-- scalar subquery: record input is not immutable, so a cast inlined into compute's filter ran per row.
create or replace function lockstep._compute_sql(j lockstep.job) returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select pg_catalog.format(case when y.typtype = 'c' then '(select * from %s((select $1::%s)) offset 0)'
                                          else '(select * from %s($1::%s) offset 0)' end,
                                     lockstep._callable(p.oid, 1), pg_catalog.format_type(p.proargtypes[0], -1))
            from pg_catalog.pg_proc p
            join pg_catalog.pg_type a on a.oid = p.proargtypes[0]
            left join pg_catalog.pg_type y on y.oid = a.typelem
            where p.oid = j.compute::regprocedure);
end;
$$;

-- lockstep._diff_all(j, keys): lockstep._diff of the whole table (lockstep._diff_run): one hash full join of
-- compute's rows and the target's on the primary key, keeping the rows that differ; no sort of every
-- computed row. A primary key computed twice is looked for only when the counts show one (error path).
-- locks: no row locks; writes only pg_temp work tables.
create or replace function lockstep._diff_all(j lockstep.job, keys text[]) returns lockstep._diff_counts
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
set jit = off
as $$
declare
    v_t name[] := array(select ('lockstep_t' || o)::name from pg_catalog.generate_series(1, cardinality(j.columns)) o);
    v_par text;
    v_tpar text;
    v_bad text;
    r record;
begin
    if j.parent is not null then
        v_par := lockstep._key_text(j, 'd');
        v_tpar := lockstep._key_text(j, 't');
    else  -- no parent: the row's primary key, which the write steps return for a row they skip
        v_par := pg_catalog.format('row(%s)::text', lockstep._cols(j.target_key, 'd'));
        v_tpar := pg_catalog.format('row(%s)::text', lockstep._cols(j.target_key, 't'));
    end if;
    select * into r from lockstep._diff_run(j, keys,
        d => pg_catalog.format('select %s, true as lockstep_d from %s d', lockstep._cols(j.columns),
                               lockstep._compute_sql(j)),
        c => pg_catalog.format('select %s, d.lockstep_d, t.ctid as lockstep_ctid, %s as lockstep_tpar, %s '
                               'from d full join %s t on %s '
                               'where d.lockstep_d is null or t.ctid is null or %s',
                               lockstep._cols(j.columns, 'd'), v_tpar,
                               (select pg_catalog.string_agg(pg_catalog.format('t.%I as %I', c, v_t[o]), ', ' order by o)
                                from pg_catalog.unnest(j.columns) with ordinality u(c, o)),
                               j.target, lockstep._eq(j.target_key, 't', 'd', j.target), lockstep._differs(j, 'd', 't')),
        dup => 'c d where d.lockstep_d and d.lockstep_ctid is null',
        g => pg_catalog.format('select %s, c.lockstep_tpar, c.lockstep_ctid from c where c.lockstep_d is null',
                               lockstep._cols(v_t, 'c')),
        p => pg_catalog.format('select %s, %s, d.lockstep_tpar, d.lockstep_ctid is null, d.lockstep_ctid from c d '
                               'where d.lockstep_d', lockstep._cols(j.columns, 'd'), v_par),
        once => pg_catalog.format('(select count(*) from d) - (select count(*) from c where c.lockstep_d and '
                                  'c.lockstep_ctid is null) <= (select count(*) from %s) - '
                                  '(select count(*) from c where c.lockstep_d is null)', j.target));
    v_bad := r.bad;
    if not r.once_ok and v_bad is null then  -- a current row matched twice: name its key (error path only)
        execute pg_catalog.format('select row(%1$s)::text from %2$s d group by %1$s having count(*) > 1 limit 1',
                                  lockstep._cols(j.target_key), lockstep._compute_sql(j))
            into v_bad using keys;
        v_bad := coalesce(v_bad, '(unknown: the second look found none)');
    end if;
    perform lockstep._check_computed_key(j, v_bad, r.is_null);
    return r.n;
end;
$$;
comment on function lockstep._diff_all(lockstep.job, text[]) is
    'Lockstep._diff of the whole table (lockstep._diff_run): one hash full join of compute''s rows and '
    'the target''s on the primary key, keeping the rows that differ; no sort of every computed row. A '
    'primary key computed twice is looked for only when the counts show one (error path). Locks: no row '
    'locks; writes only pg_temp work tables.';

-- lockstep._diff(j, keys): compute(keys) and its difference with the target, for the parents in keys, in
-- one statement (lockstep._diff_run; the whole table: lockstep._diff_all): fills j's gone and put work
-- tables and returns their counts; LSD05 for a bad primary key. The current rows of those parents are read
-- by one index probe per parent key; a computed row none of them has may exist under another parent (m).
-- locks: no row locks; writes only pg_temp work tables.
create or replace function lockstep._diff(j lockstep.job, keys text[]) returns lockstep._diff_counts
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
set jit = off
as $$
declare
    v_cpar text;
    v_moved text := '';
    v_old text := 'c.lockstep_ctid';
    v_new text := 'c.lockstep_ctid is null';
    v_oldpar text;
    r record;
begin
    perform lockstep._tmp_setup(j);
    if keys is null or j.parent is null then
        return lockstep._diff_all(j, keys);
    end if;
    v_cpar := lockstep._key_text(j, 'c');
    v_oldpar := v_cpar;
    if not j.parent_columns <@ j.target_key then  -- else a row of that key cannot move: no probe per new row
        v_moved := pg_catalog.format('left join lateral (select %s as p, t.ctid from %s t '
                                     'where c.lockstep_ctid is null and %s offset 0) m on true',
                                     lockstep._key_text(j, 't'), j.target, lockstep._eq(j.target_key, 't', 'd', j.target));
        v_old := 'coalesce(c.lockstep_ctid, m.ctid)';
        v_new := 'c.lockstep_ctid is null and m.ctid is null';
        v_oldpar := pg_catalog.format('coalesce(%s, m.p)', v_cpar);
    end if;
    select * into r from lockstep._diff_run(j, keys,
        d => pg_catalog.format('select %s from %s d where %s', lockstep._cols(j.columns), lockstep._compute_sql(j),
                               lockstep._key_in(j, 'd', pg_catalog.format('$1::%s', lockstep._array_type(j.key_type)))),
        c => pg_catalog.format('select t.* from %s, lateral (select %s, t.ctid as lockstep_ctid from %s t where %s '
                               'offset 0) t', lockstep._key_unnest(j, '$1'), lockstep._cols(j.columns, 't'), j.target,
                               lockstep._key_match(j, 't', 'k.v')),
        dup => 'd',
        g => pg_catalog.format('select %s, %s, c.lockstep_ctid from c where not exists (select from d where %s)',
                               lockstep._cols(j.columns, 'c'), v_cpar, lockstep._eq(j.target_key, 'd', 'c', j.target)),
        p => pg_catalog.format('select %s, %s, %s, %s, %s from d left join c on %s %s where c.lockstep_ctid is null or %s',
                               lockstep._cols(j.columns, 'd'), lockstep._key_text(j, 'd'),
                               v_oldpar, v_new, v_old, lockstep._eq(j.target_key, 'd', 'c', j.target), v_moved,
                               lockstep._differs(j, 'd', 'c')),
        once => 'true');
    perform lockstep._check_computed_key(j, r.bad, r.is_null);
    return r.n;
end;
$$;
comment on function lockstep._diff(lockstep.job, text[]) is
    'Compute(keys) and its difference with the target, for the parents in keys, in one statement '
    '(lockstep._diff_run; the whole table: lockstep._diff_all): fills j''s gone and put work tables and '
    'returns their counts; LSD05 for a bad primary key. The current rows of those parents are read by one '
    'index probe per parent key; a computed row none of them has may exist under another parent (m). '
    'Locks: no row locks; writes only pg_temp work tables.';

-- lockstep._pin_timeout(): lock_timeout of a pin: 10ms, or the session's if shorter. SKIP LOCKED still
-- waits on a row an application updated and then deleted or locked: that wait is cut short.
create or replace function lockstep._pin_timeout() returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select case when s::interval > interval '0' and s::interval < interval '10ms' then s else '10ms' end
    from pg_catalog.current_setting('lock_timeout') s;
$$;

-- lockstep._pin_waits(): how many waits lockstep._pin_each cuts short before it leaves every row not
-- pinned yet out: 4, so one table's pin waits 50 ms at most, far below deadlock_timeout.
create or replace function lockstep._pin_waits() returns integer
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select 4;
$$;

-- lockstep._pin_try(stmt, args): run stmt, a FOR KEY SHARE SKIP LOCKED pin of the rows named by args ($1)
-- returning those it pinned, in a subtransaction with lockstep._pin_timeout(); NULL if the timeout ended a wait.
-- locks: as stmt.
create or replace function lockstep._pin_try(stmt text, args text[]) returns text[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_timeout text := pg_catalog.current_setting('lock_timeout');
    v text[];
begin
    perform pg_catalog.set_config('lock_timeout', lockstep._pin_timeout(), true);
    execute stmt into v using args;
    perform pg_catalog.set_config('lock_timeout', v_timeout, true);
    return coalesce(v, '{}');
exception when lock_not_available then
    return null;
end;
$$;
comment on function lockstep._pin_try(text, text[]) is
    'Run stmt, a FOR KEY SHARE SKIP LOCKED pin of the rows named by args ($1) returning those it pinned, '
    'in a subtransaction with lockstep._pin_timeout(); NULL if the timeout ended a wait. Locks: as stmt.';

-- lockstep._pin_each(rel, stmt, args): the slow path after a pin timed out: the table lock, then stmt
-- 16 rows at a time, one at a time within 16 that time out, until _pin_waits() waits. Returns the pinned.
-- locks: rel ROW SHARE; then the rows of args, FOR KEY SHARE SKIP LOCKED, in the order of args.
create or replace function lockstep._pin_each(rel regclass, stmt text, args text[]) returns text[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_pinned text[] := '{}';
    v_chunk text[];
    v_got text[];
    v_waits integer := 0;  -- waits cut short so far
    a text;
begin
    execute pg_catalog.format('select from %s r where false for key share', rel);
    <<chunks>>
    for i in 0 .. (coalesce(cardinality(args), 0) + 15) / 16 - 1 loop
        exit chunks when v_waits >= lockstep._pin_waits();
        v_chunk := args[i * 16 + 1:i * 16 + 16];
        v_got := lockstep._pin_try(stmt, v_chunk);
        if v_got is null then
            v_waits := v_waits + 1;
            foreach a in array v_chunk loop
                exit chunks when v_waits >= lockstep._pin_waits();
                v_got := lockstep._pin_try(stmt, array[a]);
                v_waits := v_waits + (v_got is null)::integer;
                v_pinned := v_pinned || coalesce(v_got, '{}');
            end loop;
        else
            v_pinned := v_pinned || v_got;
        end if;
    end loop;
    return v_pinned;
end;
$$;
comment on function lockstep._pin_each(regclass, text, text[]) is
    'The slow path after a pin timed out: the table lock, then stmt 16 rows at a time, one at a time '
    'within 16 that time out, until _pin_waits() waits. Returns the pinned. Locks: rel ROW SHARE; then '
    'the rows of args, FOR KEY SHARE SKIP LOCKED, in the order of args.';

-- lockstep._pin_parents(j): write step 1. Pin the parent of every put row an FK check will look up (new,
-- or moving); drop the rows whose parent could not be pinned and return their parent keys.
-- locks: those parent rows, FOR KEY SHARE SKIP LOCKED, in parent-key order, with lockstep._pin_timeout();
-- if that ends a wait, the same rows in the same order a few at a time (lockstep._pin_each).
create or replace function lockstep._pin_parents(j lockstep.job) returns text[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_need text[];
    v_pinned text[];
    v_skip text[];
    v_pin text;
begin
    if j.parent is null then
        return '{}';
    end if;
    execute pg_catalog.format(
        'select coalesce(array_agg(distinct k), ''{}'') from ('
        '  select lockstep_parent from pg_temp.%1$I'
        '  where lockstep_new or lockstep_parent is distinct from lockstep_old_parent) s(k) where k is not null',
        lockstep._tmp(j, 'put')) into v_need;
    if cardinality(v_need) = 0 then
        return '{}';
    end if;
    v_pin := pg_catalog.format(
        'with p as (select %1$s as k from %2$s r where %3$s order by %1$s '
        '           for key share of r skip locked) '
        'select array_agg(a) from pg_catalog.unnest($1) a where exists (select from p where p.k %4$s a::%5$s)',
        lockstep._key_expr(j, 'r', j.parent_keys), j.parent,
        lockstep._key_in(j, 'r', pg_catalog.format('$1::%s', lockstep._array_type(j.key_type)), j.parent_keys),
        lockstep._key_eq(j), lockstep._type_sql(j.key_type));
    v_pinned := lockstep._pin_try(v_pin, v_need);  -- one statement, its waits cut short (lockstep._pin_timeout)
    if v_pinned is null then  -- a row an application updated, then holds: a few at a time
        -- the keys in the parent key column's own order (its collation), as the one statement locks them
        execute pg_catalog.format(
            'select array_agg(x order by (select %1$s from %2$s p where %3$s limit 1), x) '
            'from pg_catalog.unnest($1) x', lockstep._key_expr(j, 'p', j.parent_keys), j.parent,
            lockstep._key_match(j, 'p', pg_catalog.format('x::%s', lockstep._type_sql(j.key_type)), j.parent_keys))
            into v_need using v_need;
        v_pinned := lockstep._pin_each(j.parent, v_pin, v_need);
    end if;
    v_skip := array(select pg_catalog.unnest(v_need) except select pg_catalog.unnest(v_pinned));
    if cardinality(v_skip) > 0 then
        perform lockstep._drop_rows(lockstep._tmp(j, 'gone'), 'lockstep_parent = any($1)', v_skip);
        v_skip := v_skip || lockstep._drop_rows(lockstep._tmp(j, 'put'),
            'lockstep_parent = any($1) or lockstep_old_parent = any($1)', v_skip);
    end if;
    return v_skip;
end;
$$;
comment on function lockstep._pin_parents(lockstep.job) is
    'Write step 1. Pin the parent of every put row an FK check will look up (new, or moving); drop the '
    'rows whose parent could not be pinned and return their parent keys. Locks: those parent rows, FOR '
    'KEY SHARE SKIP LOCKED, in parent-key order, with lockstep._pin_timeout(); if that ends a wait, the '
    'same rows in the same order a few at a time (lockstep._pin_each).';

-- lockstep._pin_refs(j): write step 2. Pin the rows the target's other foreign keys reference, for every
-- put row an FK check will look them up for; drop the rows not pinned and return their parent keys.
-- locks: the referenced rows, FOR KEY SHARE SKIP LOCKED, one constraint at a time in constraint-name order,
-- each in key order; a few at a time after lockstep._pin_timeout, as lockstep._pin_parents.
create or replace function lockstep._pin_refs(j lockstep.job) returns text[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_needs text;
    v_match text;
    v_skip text[] := '{}';
    v_unpinned text;
    v_timeout text := pg_catalog.current_setting('lock_timeout');
    v_rows text[];
    c record;
begin
    -- the common case, no foreign key but the parent's: nothing to pin or check
    if not exists (select from pg_catalog.pg_constraint con
                   where con.conrelid = j.target and con.contype = 'f' and con.conparentid = 0
                     and not (j.parent is not null and con.confrelid = j.parent and j.parent <> j.target
                              and j.parent_columns <@ j.columns and lockstep._is_parent_fk(j, con.oid))) then
        return v_skip;
    end if;
    perform lockstep._check_target_fks(j.target, j.columns);
    for c in
        select con.oid, con.conname, con.confrelid::regclass as ref,
               array(select a.attname from pg_catalog.unnest(con.conkey) with ordinality k(n, o)
                     join pg_catalog.pg_attribute a on a.attrelid = con.conrelid and a.attnum = k.n order by k.o) as fk,
               array(select a.attname from pg_catalog.unnest(con.confkey) with ordinality k(n, o)
                     join pg_catalog.pg_attribute a on a.attrelid = con.confrelid and a.attnum = k.n order by k.o) as rk
        from pg_catalog.pg_constraint con
        where con.conrelid = j.target and con.contype = 'f' and con.conparentid = 0
          and not (j.parent is not null and con.confrelid = j.parent and lockstep._is_parent_fk(j, con.oid))
        order by con.conname
    loop
        continue when not (c.fk <@ j.columns);
        -- a row of put (alias w) the FK check looks up: new, or its key columns change
        v_needs := pg_catalog.format(
            '(%1$s) is not null and (w.lockstep_new or exists (select from %2$s t where t.ctid = w.lockstep_ctid '
            'and %3$s and (%4$s) is distinct from (%1$s)))',
            lockstep._cols(c.fk, 'w'), j.target, lockstep._eq(j.target_key, 't', 'w', j.target), lockstep._cols(c.fk, 't'));
        -- a referenced row r of that row w, in the table and in lockstep_ref (which keeps rk's names)
        v_match := lockstep._fk_eq(c.oid, 'r', 'w');
        drop table if exists pg_temp.lockstep_ref;
        begin  -- as lockstep._pin_parents
            perform pg_catalog.set_config('lock_timeout', lockstep._pin_timeout(), true);
            execute pg_catalog.format(
                'create temp table lockstep_ref on commit drop as '
                'select %1$s from %2$s r where exists (select from pg_temp.%3$I w where %4$s and %5$s) '
                'order by %1$s for key share skip locked',
                lockstep._cols(c.rk, 'r'), c.ref, lockstep._tmp(j, 'put'), v_needs, v_match);
            perform pg_catalog.set_config('lock_timeout', v_timeout, true);
        exception when lock_not_available then  -- a few rows at a time, named by (tableoid, ctid), in key order
            execute pg_catalog.format(
                'create temp table lockstep_ref on commit drop as '
                'select %1$s, r.tableoid::text || '':'' || r.ctid::text as lockstep_row, '
                '       pg_catalog.row_number() over (order by %1$s) as lockstep_n '
                'from %2$s r where exists (select from pg_temp.%3$I w where %4$s and %5$s)',
                lockstep._cols(c.rk, 'r'), c.ref, lockstep._tmp(j, 'put'), v_needs, v_match);
            v_rows := array(select x.lockstep_row from pg_temp.lockstep_ref x order by x.lockstep_n);
            v_rows := lockstep._pin_each(c.ref, pg_catalog.format(
                'select array_agg(k) from (select r.tableoid::text || '':'' || r.ctid::text as k from %1$s r '
                '  where r.ctid = any(array(select pg_catalog.split_part(a, '':'', 2)::tid from pg_catalog.unnest($1) a)) '
                '    and r.tableoid::text || '':'' || r.ctid::text = any($1) '
                '  order by %2$s for key share skip locked) s', c.ref, lockstep._cols(c.rk, 'r')), v_rows);
            delete from pg_temp.lockstep_ref x where x.lockstep_row <> all(v_rows);
        end;
        v_unpinned := pg_catalog.format('%s and not exists (select from pg_temp.lockstep_ref r where %s)',
                                        v_needs, v_match);
        v_skip := v_skip || lockstep._drop_rows(lockstep._tmp(j, 'put'), v_unpinned);
    end loop;
    return v_skip;
end;
$$;
comment on function lockstep._pin_refs(lockstep.job) is
    'Write step 2. Pin the rows the target''s other foreign keys reference, for every put row an FK check'
    ' will look them up for; drop the rows not pinned and return their parent keys. Locks: the referenced'
    ' rows, FOR KEY SHARE SKIP LOCKED, one constraint at a time in constraint-name order, each in key '
    'order; a few at a time after lockstep._pin_timeout, as lockstep._pin_parents.';

-- lockstep._lock_rows(j, expected): write step 3a. Lock the target rows to delete or update, found by ctid;
-- drop the rows not locked and return their parent keys. expected: how many to lock, if known.
-- locks: those target rows, SKIP LOCKED, in primary-key order: the rows to delete FOR UPDATE, then the rows
-- to update FOR NO KEY UPDATE (FOR UPDATE where the target has another unique index).
create or replace function lockstep._lock_rows(j lockstep.job, expected bigint default null) returns text[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_skip text[];
    v_gone text := lockstep._tmp(j, 'gone');
    v_put text := lockstep._tmp(j, 'put');
    v_mine_g text := '';
    v_mine_p text := '';
    v_strength text := 'no key update';
    v_lock_g text;
    v_lock_p text;
    v_locked bigint;
begin
    if exists (select from pg_catalog.pg_class c where c.oid = j.target and (c.relkind = 'p' or c.relhassubclass)) then
        v_mine_g := pg_catalog.format(' and (%s) in (select %s from pg_temp.%I)',
                                      lockstep._cols(j.target_key, 't'), lockstep._cols(j.target_key), v_gone);
        v_mine_p := pg_catalog.format(' and (%s) in (select %s from pg_temp.%I where not lockstep_new)',
                                      lockstep._cols(j.target_key, 't'), lockstep._cols(j.target_key), v_put);
    end if;
    -- in place: FOR NO KEY UPDATE, which FK checks neither wait for nor block (unless another unique index)
    if exists (select from pg_catalog.pg_index i where i.indrelid = j.target and i.indisunique and not i.indisprimary) then
        v_strength := 'update';
    end if;
    v_lock_g := pg_catalog.format(
        'select %1$s from %2$s t where t.ctid = any(array(select lockstep_ctid from pg_temp.%3$I))%4$s '
        'order by %1$s for update of t skip locked',
        lockstep._cols(j.target_key, 't'), j.target, v_gone, v_mine_g);
    v_lock_p := pg_catalog.format(
        'select %1$s from %2$s t where t.ctid = any(array(select lockstep_ctid from pg_temp.%3$I where not lockstep_new))%4$s '
        'order by %1$s for %5$s of t skip locked',
        lockstep._cols(j.target_key, 't'), j.target, v_put, v_mine_p, v_strength);
    if expected is not null then
        execute pg_catalog.format('select (select count(*) from (%s) g) + (select count(*) from (%s) p)', v_lock_g, v_lock_p)
            into v_locked;
        if v_locked = expected then
            return '{}';
        end if;
    end if;
    execute pg_catalog.format(
        'with lg as materialized (%1$s), lp as materialized (%2$s), '
        'dg as (delete from pg_temp.%3$I w where not exists (select from lg l where %5$s) returning lockstep_parent), '
        'dp as (delete from pg_temp.%4$I w where not lockstep_new and not exists (select from lp l where %5$s) '
        '       returning lockstep_parent) '
        'select coalesce(array_agg(distinct k) filter (where k is not null), ''{}'') '
        'from (select * from dg union all select * from dp) s(k)',
        v_lock_g, v_lock_p, v_gone, v_put, lockstep._eq(j.target_key, 'l', 'w', j.target)) into v_skip;
    return v_skip;
end;
$$;
comment on function lockstep._lock_rows(lockstep.job, bigint) is
    'Write step 3a. Lock the target rows to delete or update, found by ctid; drop the rows not locked and'
    ' return their parent keys. expected: how many to lock, if known. Locks: those target rows, SKIP '
    'LOCKED, in primary-key order: the rows to delete FOR UPDATE, then the rows to update FOR NO KEY '
    'UPDATE (FOR UPDATE where the target has another unique index).';

-- lockstep._referencing(rel, key, cols): the foreign keys referencing rel, with what a delete does through
-- them; LSD06 for those lockstep cannot delete through without waiting, 42501 if it may not lock their rows.
create or replace function lockstep._referencing(rel regclass, key name[] default null, cols name[] default null)
returns table (conoid oid, conname name, refrel regclass, fk name[], rk name[], ord name[], deletes boolean)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    c record;
begin
    for c in
        select con.oid, con.conname, con.conrelid::regclass as refrel, con.confdeltype,
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
        conoid := c.oid; conname := c.conname; refrel := c.refrel; fk := c.fk; rk := c.rk; ord := c.ord; deletes := c.confdeltype = 'c';
        return next;
    end loop;
end;
$$;

-- lockstep._check_referencing(target, key, cols): every foreign key a delete of target rows acts on, at
-- any depth (through ON DELETE CASCADE, cycles included), is one lockstep can lock through (_referencing).
create or replace function lockstep._check_referencing(target regclass, key name[], cols name[]) returns void
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

-- lockstep._lock_level(t, depth): lock the rows referencing the rows of t at this depth of
-- pg_temp.lockstep_doomed, add them at depth + 1, and return the roots of which a row could not be locked.
-- locks: the referencing rows, FOR UPDATE SKIP LOCKED, one foreign key at a time in constraint-name order,
-- each in the referencing table's primary-key order (ctid order without one).
create or replace function lockstep._lock_level(t regclass, depth integer) returns text[]
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
            'join %2$s n on %3$s '
            'where p.ctid = any(array(select lockstep_ctid from pg_temp.lockstep_doomed '
            '                         where lockstep_depth = $1 and lockstep_table = $2 and lockstep_deletes))',
            t, c.refrel, lockstep._fk_eq(c.conoid, 'p', 'n'));
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
comment on function lockstep._lock_level(regclass, integer) is
    'Lock the rows referencing the rows of t at this depth of pg_temp.lockstep_doomed, add them at depth '
    '+ 1, and return the roots of which a row could not be locked. Locks: the referencing rows, FOR '
    'UPDATE SKIP LOCKED, one foreign key at a time in constraint-name order, each in the referencing '
    'table''s primary-key order (ctid order without one).';

-- lockstep._lock_referencing(j): write step 3a'. Lock the rows a delete of the gone rows acts on, level by
-- level; a target row of which one could not be locked is not deleted, its parent key returned.
-- locks: the referencing rows, FOR UPDATE SKIP LOCKED, level by level, each as _lock_level.
create or replace function lockstep._lock_referencing(j lockstep.job) returns text[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_blocked text[] := '{}';
    v_depth integer := 0;
    v_t regclass;
    v_any boolean;
begin
    if not exists (select from pg_catalog.pg_constraint con  -- the common case: no foreign key to the target
                   where con.confrelid = j.target and con.contype = 'f' and con.conparentid = 0)
       or not exists (select from lockstep._referencing(j.target, j.target_key, j.columns)) then
        return '{}';
    end if;
    execute pg_catalog.format('select exists (select from pg_temp.%I)', lockstep._tmp(j, 'gone')) into v_any;
    if not v_any then
        return '{}';
    end if;
    drop table if exists pg_temp.lockstep_doomed;
    execute pg_catalog.format(
        'create temp table lockstep_doomed on commit drop as '
        'select row(%1$s)::text as lockstep_root, t.tableoid as lockstep_rel, t.ctid as lockstep_ctid, '
        '$1::regclass as lockstep_table, true as lockstep_deletes, 0 as lockstep_depth '
        'from pg_temp.%4$I g join %2$s t on %3$s',
        lockstep._cols(j.target_key, 'g'), j.target, lockstep._eq(j.target_key, 't', 'g', j.target), lockstep._tmp(j, 'gone'))
        using j.target;
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
    return lockstep._drop_rows(lockstep._tmp(j, 'gone'),
                               pg_catalog.format('row(%s)::text = any($1)', lockstep._cols(j.target_key)), v_blocked);
end;
$$;
comment on function lockstep._lock_referencing(lockstep.job) is
    'Write step 3a''. Lock the rows a delete of the gone rows acts on, level by level; a target row of '
    'which one could not be locked is not deleted, its parent key returned. Locks: the referencing rows, '
    'FOR UPDATE SKIP LOCKED, level by level, each as _lock_level.';

-- lockstep._delete_rows(j): write step 3b. Delete the gone rows where _lock_rows locked them (by ctid, and
-- primary key in a partitioned target). Returns how many.
-- locks: those target rows (already held).
create or replace function lockstep._delete_rows(j lockstep.job) returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    n bigint;
begin
    execute pg_catalog.format('delete from %1$s t using pg_temp.%2$I g '
                              'where t.ctid = any(array(select lockstep_ctid from pg_temp.%2$I)) and %3$s',
                              j.target, lockstep._tmp(j, 'gone'), lockstep._eq(j.target_key, 't', 'g', j.target));
    get diagnostics n = row_count;
    return n;
end;
$$;
comment on function lockstep._delete_rows(lockstep.job) is
    'Write step 3b. Delete the gone rows where _lock_rows locked them (by ctid, and primary key in a '
    'partitioned target). Returns how many. Locks: those target rows (already held).';

-- lockstep._upsert_rows(j, updates, inserts): write step 3c. Update the put rows that exist where
-- _lock_rows locked them; insert the new ones in primary-key order by one INSERT ... ON CONFLICT DO UPDATE.
-- locks: the target rows it updates (already held by _lock_rows), then those it inserts.
create or replace function lockstep._upsert_rows(j lockstep.job, updates boolean, inserts boolean,
                                      out inserted bigint, out updated bigint)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rest name[] := array(select x from pg_catalog.unnest(j.columns) x where not x = any(j.target_key));
    v_put text := lockstep._tmp(j, 'put');
    v_action text := 'do nothing';
begin
    updated := 0;
    inserted := 0;
    if cardinality(v_rest) > 0 and updates then
        execute pg_catalog.format(
            'with u as (update %1$s t set %2$s from pg_temp.%3$I w '
            '           where t.ctid = any(array(select lockstep_ctid from pg_temp.%3$I where not lockstep_new)) '
            '             and not w.lockstep_new and %4$s and %5$s returning 1) '
            'select count(*) from u',
            j.target, (select pg_catalog.string_agg(pg_catalog.format('%I = w.%I', x, x), ', ') from pg_catalog.unnest(v_rest) x),
            v_put, lockstep._eq(j.target_key, 't', 'w', j.target), lockstep._differs(j, 'w', 't', v_rest))
            into updated;
    end if;
    if not inserts then
        return;
    end if;
    if cardinality(v_rest) > 0 then
        v_action := pg_catalog.format('do update set %s where %s',
            (select pg_catalog.string_agg(pg_catalog.format('%I = excluded.%I', x, x), ', ') from pg_catalog.unnest(v_rest) x),
            lockstep._differs(j, 'excluded', 't', v_rest));
    end if;
    execute pg_catalog.format(
        'with i as (insert into %1$s as t (%2$s) select %2$s from pg_temp.%5$I where lockstep_new order by %3$s '
        '           on conflict (%3$s) %4$s returning 1) '
        'select count(*) from i',
        j.target, lockstep._cols(j.columns), lockstep._cols(j.target_key), v_action, v_put)
        into inserted;
end;
$$;
comment on function lockstep._upsert_rows(lockstep.job, boolean, boolean) is
    'Write step 3c. Update the put rows that exist where _lock_rows locked them; insert the new ones in '
    'primary-key order by one INSERT ... ON CONFLICT DO UPDATE. Locks: the target rows it updates '
    '(already held by _lock_rows), then those it inserts.';

-- lockstep._write(j, keys, queued_from): THE write path: apply compute(keys) for the parents in keys (NULL: the whole
-- table, cut to a batch by _limit_batch): diff without row locks, then the steps, never waiting. A parent's
-- rows are written together or not at all; those left out come back in skipped. Work tables left empty.
-- queued_from: where a recompute's hand-off starts in the queue; what _limit_batch handed off comes back
-- in handed_off, handoff_from and handoff_todo.
-- locks: parents of new rows (FOR KEY SHARE SKIP LOCKED, key order), then other referenced rows (same,
-- constraint-name order), then target rows (SKIP LOCKED, primary-key order), then the rows referencing
-- target rows to delete (FOR UPDATE SKIP LOCKED, constraint-name then key order).
create or replace function lockstep._write(j lockstep.job, keys text[], queued_from bigint default null)
returns lockstep._pass
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
set jit = off
as $$
declare
    v_t0 timestamptz := clock_timestamp();
    v_handed bigint := 0;
    v_from bigint;
    v_todo bigint;
    d lockstep._diff_counts := lockstep._diff(j, keys);
    p lockstep._pass;
begin
    if d.gone + d.fresh + d.kept = 0 then
        p := row(0, 0, 0, '{}', 0, 0, 0, '{}', '{}');
        p.compute_ms := extract(epoch from clock_timestamp() - v_t0) * 1000;
        return p;  -- nothing to write: no lock taken at all, and the work tables are empty (nothing to clear)
    end if;
    if keys is null and j.parent is null then  -- 07_recompute.sql: the rest waits in a session table
        v_handed := lockstep._limit_rows(j, j.batch_parents);
    elsif keys is null then  -- 07_recompute.sql: the rest is handed to the queue
        select l.handed_off, l.handoff_from, l.handoff_todo into v_handed, v_from, v_todo
        from lockstep._limit_batch(j, j.batch_parents, queued_from) l;
    end if;
    p := lockstep._write_steps(j, d, v_handed = 0);
    p.compute_ms := extract(epoch from clock_timestamp() - v_t0) * 1000 - p.write_ms;
    p.handed_off := v_handed;
    p.handoff_from := v_from;
    p.handoff_todo := v_todo;
    return p;
end;
$$;
comment on function lockstep._write(lockstep.job, text[], bigint) is
    'THE write path: apply compute(keys) for the parents in keys (NULL: the whole table, cut to a batch '
    'by _limit_batch): diff without row locks, then the steps, never waiting. A parent''s rows are '
    'written together or not at all; those left out come back in skipped. Work tables left empty. '
    'queued_from: where a recompute''s hand-off starts in the queue; what _limit_batch handed off comes '
    'back in handed_off, handoff_from and handoff_todo. Locks: parents of new rows (FOR KEY SHARE SKIP '
    'LOCKED, key order), then other referenced rows (same, constraint-name order), then target rows (SKIP '
    'LOCKED, primary-key order), then the rows referencing target rows to delete (FOR UPDATE SKIP LOCKED, '
    'constraint-name then key order).';

-- lockstep._write_steps(j, d, exact): the write phase of lockstep._write over j's work tables (d: what the
-- difference held; exact: they still hold all of it). A step with no rows is not run.
-- locks: as lockstep._write: parents of new rows, other referenced rows, target rows, referencing rows.
create or replace function lockstep._write_steps(j lockstep.job, d lockstep._diff_counts, exact boolean) returns lockstep._pass
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
set jit = off
as $$
declare
    v_t1 timestamptz := clock_timestamp();
    v_skip text[] := '{}';
    p lockstep._pass := row(0, 0, 0, '{}', 0, 0, 0, '{}', '{}');
begin
    -- a step with nothing to do is not run (d is an upper bound: counted before rows were dropped)
    if d.pin > 0 then
        v_skip := lockstep._pin_parents(j);
    end if;
    v_skip := v_skip || lockstep._pin_refs(j);
    if d.gone + d.kept > 0 then  -- how many rows to lock is known while no step has dropped any
        v_skip := v_skip || lockstep._lock_rows(j, case when exact and cardinality(v_skip) = 0
                                                        then d.gone + d.kept end);
    end if;
    if d.gone > 0 then
        v_skip := v_skip || lockstep._lock_referencing(j);
    end if;
    if j.parent is not null and cardinality(v_skip) > 0 then
        -- a parent's rows are written together or not at all: none of a skipped parent's rows is written
        perform lockstep._drop_rows(lockstep._tmp(j, 'gone'), 'lockstep_parent = any($1)', v_skip);
        perform lockstep._drop_rows(lockstep._tmp(j, 'put'), 'lockstep_parent = any($1) or lockstep_old_parent = any($1)',
                                    v_skip);
    end if;
    if d.gone > 0 then
        p.deleted := lockstep._delete_rows(j);
    end if;
    select u.inserted, u.updated into p.inserted, p.updated from lockstep._upsert_rows(j, d.kept > 0, d.fresh > 0) u;
    v_skip := array(select distinct pg_catalog.unnest(v_skip));
    if j.parent is not null and cardinality(v_skip) > 0 then
        execute pg_catalog.format('select coalesce(array_agg(u.k order by u.k), ''{}'') from pg_catalog.unnest($1) u(k) '
                                  'where exists (select from %s r where %s)', j.parent,
                                  lockstep._key_match(j, 'r', pg_catalog.format('u.k::%s', lockstep._type_sql(j.key_type)),
                                                      j.parent_keys))
            into p.skipped using v_skip;
        p.gone := cardinality(v_skip) - cardinality(p.skipped);
    else
        p.skipped := v_skip;
    end if;
    p.write_ms := extract(epoch from clock_timestamp() - v_t1) * 1000;
    perform lockstep._tmp_clear(j);  -- no row outlives this call (pooled connections: see lockstep._tmp)
    return p;
end;
$$;
comment on function lockstep._write_steps(lockstep.job, lockstep._diff_counts, boolean) is
    'The write phase of lockstep._write over j''s work tables (d: what the difference held; exact: they '
    'still hold all of it). A step with no rows is not run. Locks: as lockstep._write: parents of new '
    'rows, other referenced rows, target rows, referencing rows.';

-- lockstep._apply(j, keys, queued_from): compute, diff and write for the parents in keys (NULL: all): the
-- only path by which lockstep writes a derived table. Runs as the job's owner (lockstep._as_owner) or raises
-- 42501. queued_from: as lockstep._write.
-- locks: as lockstep._write (the compute phase takes no row lock).
create or replace function lockstep._apply(j lockstep.job, keys text[], queued_from bigint default null)
returns lockstep._pass
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_t0 timestamptz := clock_timestamp();
    v_gone record;
    d lockstep._diff_counts;
    p lockstep._pass;
begin
    -- a table dropped since define_derived: the job's error at once (class 42), no key blamed
    select t.what, t.rel into v_gone
    from (values ('target', j.target, 1), ('parent', j.parent, 2)) t(what, rel, o)
    where t.rel is not null and not exists (select from pg_catalog.pg_class c where c.oid = t.rel)
    order by t.o limit 1;
    if v_gone.what is not null then
        raise exception 'lockstep: the % table of job "%" no longer exists (it was oid %)', v_gone.what, j.job,
                        v_gone.rel::oid
            using errcode = '42P01',
                  hint = 'Create it again and run lockstep.define_derived() again, or lockstep.drop_job().';
    end if;
    if j.owner_id is distinct from pg_catalog.to_regrole(pg_catalog.quote_ident(current_user)) then
        return lockstep._as_owner(j, keys, queued_from);
    end if;
    if j.kind = 'rest' then  -- lockstep._continue: the next batch of a recompute without a parent (07_recompute.sql)
        d := lockstep._load_rest(j, j.batch_parents);
        p := lockstep._write_steps(j, d, true);
        p.handed_off := d.rest;  -- rows still in the rest table (-1: none)
    elsif j.kind = 'preview' then  -- lockstep.preview: the difference only, nothing written (15_controls.sql)
        return lockstep._preview_diff(j, keys);
    else
        p := lockstep._write(j, keys, queued_from);  -- it leaves the work tables empty (a failed call: rolled back)
    end if;
    -- deferred checks fire here, inside the pass, where a failure is the pass's, not the COMMIT's
    set constraints all immediate;
    p.compute_ms := extract(epoch from clock_timestamp() - v_t0) * 1000 - p.write_ms;
    return p;
end;
$$;
comment on function lockstep._apply(lockstep.job, text[], bigint) is
    'Compute, diff and write for the parents in keys (NULL: all): the only path by which lockstep writes '
    'a derived table. Runs as the job''s owner (lockstep._as_owner) or raises 42501. queued_from: as '
    'lockstep._write. Locks: as lockstep._write (the compute phase takes no row lock).';

-- lockstep._owner_pass(j, keys, queued_from, dry): run j's owner code once in a subtransaction: a generic
-- job's call (lockstep._as_owner), or lockstep._apply(j, keys, queued_from). Returns its pass, or the error
-- it raised and its SQLSTATE (pass NULL). timed_out: that error is a statement timeout; a cancel request
-- is raised again (the runner is shutting down). A run still going when the statement_timeout in force at
-- the start had passed fails as timed out too: the owner's code may catch the timeout's cancel. dry: a
-- good run is rolled back too (its pass is still returned: PL/pgSQL variables are not transactional), with
-- its row locks.
-- locks: as the job's function or lockstep._apply (nothing is left behind by a failed or dry run).
create or replace function lockstep._owner_pass(j lockstep.job, keys text[], queued_from bigint, dry boolean,
                                     out p lockstep._pass, out error text, out state text, out timed_out boolean)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_limit interval := pg_catalog.current_setting('statement_timeout')::interval;  -- 0: none
begin
    timed_out := false;
    if j.kind = 'job' then
        perform lockstep._as_owner(j, null);
    else
        p := lockstep._apply(j, keys, queued_from);
    end if;
    if v_limit > interval '0' and pg_catalog.clock_timestamp() - pg_catalog.statement_timestamp() >= v_limit then
        raise exception 'lockstep: job "%" went on past its time limit (%): its code caught the statement timeout',
            j.job, v_limit using errcode = '57014';
    end if;
    if dry then
        raise exception using errcode = 'LSDRY';
    end if;
exception
    when sqlstate 'LSDRY' then
        null;
    when query_canceled then
        if not (v_limit > interval '0'
                and pg_catalog.clock_timestamp() - pg_catalog.statement_timestamp() >= v_limit * 0.9) then
            raise;
        end if;
        get stacked diagnostics error = message_text, state = returned_sqlstate;
        timed_out := true;
    when others then
        get stacked diagnostics error = message_text, state = returned_sqlstate;
end;
$$;
comment on function lockstep._owner_pass(lockstep.job, text[], bigint, boolean) is
    'Run j''s owner code once in a subtransaction: a generic job''s call (lockstep._as_owner), or '
    'lockstep._apply(j, keys, queued_from). Returns its pass, or the error it raised and its SQLSTATE '
    '(pass NULL). timed_out: that error is a statement timeout, or the run went on past the '
    'statement_timeout in force at its start; a cancel request is raised again (the runner is shutting '
    'down). dry: a good run is rolled back too (its pass is still returned: PL/pgSQL '
    'variables are not transactional), with its row locks. Locks: as the job''s function or '
    'lockstep._apply (nothing is left behind by a failed or dry run).';
