-- lockstep: watches through a join: a source that holds the key of a table between it and the parent
-- (order_lines.order_id, with orders.customer_id the parent key). One hop only: the source's column
-- references the through table, and the through table's column holds the parent's key.

-- lockstep._through_key(source, key_column, through): the column of through that source.key_column
-- references with a foreign key (LSQ02 if none does).
-- locks: nothing.
create or replace function lockstep._through_key(source regclass, key_column name, through regclass) returns name
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_key name;
begin
    select fa.attname into v_key
    from pg_catalog.pg_constraint c
    join pg_catalog.pg_attribute a on a.attrelid = c.conrelid and a.attnum = c.conkey[1]
    join pg_catalog.pg_attribute fa on fa.attrelid = c.confrelid and fa.attnum = c.confkey[1]
    where c.contype = 'f' and c.conrelid = source and c.confrelid = any(lockstep._family(through))
      and pg_catalog.cardinality(c.conkey) = 1 and a.attname = key_column
    limit 1;
    if v_key is null then
        raise exception 'lockstep: %.% has no foreign key to %: a watch through % maps it by that key', source,
            key_column, through, through
            using errcode = 'LSQ02',
                  hint = pg_catalog.format('Declare the foreign key (alter table %s add foreign key (%I) references %s), '
                                           'or watch the column of %s that references %s.', source, key_column,
                                           through, source, through);
    end if;
    return v_key;
end;
$$;

comment on function lockstep._through_key(regclass, name, regclass) is
    'The column of through that source.key_column references (LSQ02 if none). Locks nothing.';

-- lockstep._watch_through(j, source, key_column, through, through_column): watch()'s path for a source
-- one hop below the parent. The triggers on source (and the tables below it) run lockstep.enqueue_through,
-- which maps the changed rows' keys, old and new, through the through table to parent keys; the through
-- table itself is watched on through_column, so a mapping row changed or deleted queues its old and new
-- parent keys too.
-- locks: source and the tables below it, then through and the tables below it (DROP / CREATE TRIGGER)
-- through lockstep._ddl, as lockstep.watch.
create or replace function lockstep._watch_through(j lockstep.job, source regclass, key_column name,
                                                   through regclass, through_column name) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_map name := lockstep._through_key(source, key_column, through);
    v_type regtype := (select a.atttypid from pg_catalog.pg_attribute a
                       where a.attrelid = through and a.attname = through_column and a.attnum > 0
                         and not a.attisdropped);
    v_tables regclass[] := lockstep._family(source);
    v_flag text;
begin
    if v_type is null then
        raise exception 'lockstep: table % has no column %', through, through_column using errcode = '42703';
    end if;
    if not lockstep._castable(v_type, j.key_type) then
        raise exception 'lockstep: %.% is %, which does not always convert to the parent key type % of job "%"',
            through, through_column, v_type, j.key_type, j.job
            using errcode = 'LSQ01',
                  hint = 'through_column names the column of the through table that holds the parent''s key.';
    end if;
    if through = any(v_tables) then
        raise exception 'lockstep: a watch of % through itself', source
            using errcode = '22023', hint = 'Watch the column that holds the parent''s key directly.';
    end if;
    v_flag := lockstep._watch_news(j, source, key_column, v_tables);  -- before the triggers change
    perform lockstep._ddl(v_tables, lockstep._drop_watch_ddl(j.job, v_tables)
                                    || lockstep._watch_ddl(j, v_tables, 'lockstep.enqueue_through',
                                                           array[key_column::text, j.key_type::text, through::oid::text,
                                                                 v_map, through_column]),
                          pg_catalog.format('watch(%L, %L)', j.job, source));
    if v_flag is not null then
        insert into lockstep.recompute_flag (job, problem)  -- flagged_at: clock time, as _flag (_clear_flag)
        values (j.job, v_flag);
    end if;
    perform lockstep._warn_writers(v_tables || through);
    perform lockstep.watch(j.job, through, through_column);
end;
$$;

comment on function lockstep._watch_through(lockstep.job, regclass, name, regclass, name) is
    'watch() of a source one hop below the parent, mapped through a table''s foreign key. '
    'Locks: source and the tables below it, then through and the tables below it (trigger DDL, lockstep._ddl).';

-- lockstep.enqueue_through(): trigger function of the watches through a join. Arguments: job, source key
-- column, parent key type, through table (oid), its key column, its column that holds the parent key.
-- Queues the parent keys the changed rows map to now, read without locks in a block that only reads, and
-- records their through keys (lockstep.through_entry) for a worker to map again after the commit. Any
-- error there, or a TRUNCATE, flags the job instead (lockstep._flag). Never raises.
-- locks: the insert into lockstep.queue (or lockstep.recompute_flag); no lock on the through table beyond
-- the ACCESS SHARE of a plain read.
create or replace function lockstep.enqueue_through() returns trigger
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_keys text[];
    v_src text[];
    v_from text;
    v_problem text;
begin
    if tg_op = 'TRUNCATE' or tg_nargs <> 6 then
        perform lockstep._flag(case when tg_nargs > 0 then tg_argv[0] end,
                               format('%s of %s (no transition table names its rows)', tg_op, tg_relid::regclass));
        return null;
    end if;
    v_from := concat_ws(' union ',
        case when tg_op <> 'DELETE' then format('select %I k from lockstep_new', tg_argv[1]) end,
        case when tg_op <> 'INSERT' then format('select %I k from lockstep_old', tg_argv[1]) end);
    begin
        execute format('select array(select s.k::text from (%s) s where s.k is not null)', v_from) into v_src;
        execute format('select lockstep._canon(array_agg(m.%I::%s)) from %s m where m.%I in (%s)',
                       tg_argv[5], tg_argv[2]::regtype, tg_argv[3]::oid::regclass, tg_argv[4], v_from)
            into v_keys;
    exception when others then
        get stacked diagnostics v_problem = message_text;
    end;
    -- mapped again by a worker once this commits: a mapping row changed meanwhile maps them elsewhere
    perform lockstep._append_through(tg_argv[0], tg_argv[3]::oid, v_src);
    if v_problem is not null then
        perform lockstep._flag(tg_argv[0], format('watch of %s through %s: %s', tg_relid::regclass,
                                                  tg_argv[3]::oid::regclass, v_problem));
        return null;
    end if;
    perform lockstep._append(tg_argv[0], lockstep._queueable(tg_argv[0], v_keys));
    return null;
end;
$$;

comment on function lockstep.enqueue_through() is
    'Statement trigger of a watch through a join: queues the parent keys the changed rows map to, old and new. '
    'Never raises: flags the job where it cannot map. Locks: the queue insert only; reads the through table '
    'without row locks.';

-- lockstep._append_through(job, through, keys): record through keys for job (lockstep.through_entry).
-- Security definer: application roles need no grant; a forged row is only read back for a through table
-- the job really watches through (lockstep._resolve_through).
-- locks: none beyond the insert into lockstep.through_entry.
create or replace function lockstep._append_through(job text, through oid, keys text[]) returns void
language sql
security definer
set search_path = pg_catalog, pg_temp
as $$
    insert into lockstep.through_entry (job, through, key)
    select _append_through.job, _append_through.through, k from pg_catalog.unnest(keys) k
    where exists (select from lockstep.job x where x.job = _append_through.job);  -- else never taken back
$$;

comment on function lockstep._append_through(text, oid, text[]) is
    'Record through keys of a job for a worker to map after the commit. Locks: the insert into '
    'lockstep.through_entry only.';

-- lockstep._take_through(job): delete and return the job's committed through keys, by through table, for a
-- role that may manage the job (nothing otherwise).
-- locks: the job's lockstep.through_entry rows (deleted).
create or replace function lockstep._take_through(job text) returns table (through oid, keys text[])
language sql
security definer
set search_path = pg_catalog, pg_temp
as $$
    with taken as (
        delete from lockstep.through_entry t
        where t.job = _take_through.job
          and exists (select from lockstep.job x where x.job = _take_through.job)
          and lockstep._caller_manages(_take_through.job)  -- not _may_manage_id: current_user is the definer here
        returning t.through, t.key)
    select taken.through, array_agg(distinct taken.key) from taken group by taken.through;
$$;

comment on function lockstep._take_through(text) is
    'Delete and return the committed through keys of a job its caller may manage. Locks: those '
    'lockstep.through_entry rows (deleted).';

-- lockstep._resolve_through(j): map j's committed through keys to parent keys as j's owner, with the
-- mapping as committed now, and queue them; keys of a table j no longer watches through are dropped; a
-- mapping that fails flags j for its full recompute.
-- locks: the job's lockstep.through_entry rows (deleted); appends to lockstep.queue.
create or replace function lockstep._resolve_through(j lockstep.job) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    e record;
    v lockstep.job;
begin
    for e in select x.through, x.keys, tg.key_column, tg.parent_column
             from lockstep._take_through(j.job) x
             cross join lateral (select lockstep._tgarg(t.tgargs, 4) key_column, lockstep._tgarg(t.tgargs, 5) parent_column
                                 from pg_catalog.pg_trigger t
                                 where t.tgfoid = 'lockstep.enqueue_through()'::regprocedure and t.tgnargs = 6
                                   and lockstep._tgarg(t.tgargs, 0) = j.job
                                   and lockstep._tgarg(t.tgargs, 3) = x.through::text
                                 limit 1) tg
    loop
        v := j;
        v.kind := 'through_map';  -- lockstep._owner_run maps the keys instead of running a pass
        v.parent := e.through::regclass;
        v.parent_column := e.key_column;
        v.parent_key := e.parent_column;
        begin
            perform lockstep._append_keys(j.job, lockstep._queueable(j.job, (lockstep._as_owner(v, e.keys)).skipped));
        exception when others then
            perform lockstep._flag(j.job, pg_catalog.format('watch through %s: %s', e.through::regclass, sqlerrm));
        end;
    end loop;
end;
$$;

comment on function lockstep._resolve_through(lockstep.job) is
    'Map a job''s committed through keys to parent keys as its owner and queue them. Locks: those '
    'lockstep.through_entry rows (deleted); appends to lockstep.queue.';
