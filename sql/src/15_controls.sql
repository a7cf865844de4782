-- lockstep: operator controls: preview a job's difference, pause and resume a job. The graph of derived jobs
-- that read each other's targets is in 10_graph.sql (lockstep.due and lockstep.status read it).

-- lockstep._check_controls(j, what): the current role may pause or resume j: its owner, a member of the
-- owner role, or a lockstep admin (lockstep._may_manage_id); else 42501, naming who may.
-- locks: nothing.
create or replace function lockstep._check_controls(j lockstep.job, what text) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if not lockstep._may_manage_id(j.owner_id) then
        raise exception 'lockstep: role % may not % job "%"', current_user, what, j.job
            using errcode = '42501',
                  hint = pg_catalog.format('Only the owner %s, a member of it or a lockstep admin may %s it.',
                                           j.owner_id, what);
    end if;
end;
$$;

comment on function lockstep._check_controls(lockstep.job, text) is
    'The current role may pause or resume j (lockstep._may_manage_id), else 42501. Locks: none.';

-- lockstep._paused(j, action): the result of a call of a paused job (outcome paused, nothing written), or
-- NULL when j is not paused. run(), work() and recompute() return it before anything else.
-- locks: nothing.
create or replace function lockstep._paused(j lockstep.job, action text) returns lockstep.result
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if j.paused_at is null then
        return null;
    end if;
    return lockstep._result('paused', j.job, action);
end;
$$;

comment on function lockstep._paused(lockstep.job, text) is
    'The result of a call of a paused job (outcome paused), or NULL when j is not paused. Locks: '
    'none.';

-- lockstep.pause(job): stop lockstep from writing for job until lockstep.resume(job). run(), work() and
-- recompute() then return outcome paused and write nothing; lockstep.due() never calls the job due, so
-- runners skip it; the triggers keep queueing, so the application sees no change. A pass already
-- running finishes (one batch at most). Pausing a paused job keeps its first paused_at and paused_by.
-- Returns paused_at.
-- locks: the job's registry row (FOR NO KEY UPDATE, by the update).
create or replace function lockstep.pause(job text) returns timestamptz
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    j lockstep.job := lockstep._job(job);
begin
    perform lockstep._check_controls(j, 'pause');
    return lockstep._update_job(j.job, pause => true, paused_by => current_user);  -- security definer
end;
$$;

comment on function lockstep.pause(text) is
    'Stop lockstep from writing for job until lockstep.resume: run, work and recompute return paused, '
    'due() never calls it due, triggers keep queueing. Returns paused_at. Locks: the job''s registry '
    'row.';

-- lockstep.resume(job): undo lockstep.pause(job). A derived job is also flagged for its full recompute
-- (lockstep.recompute_flag): the keys queued meanwhile are worked as usual, and the recompute catches what
-- reached no queue while lockstep was off the tables (triggers disabled during a migration, say). Returns
-- whether the job was paused (false: nothing changed).
-- locks: the job's registry row (FOR NO KEY UPDATE, by the update); then appends to lockstep.recompute_flag.
create or replace function lockstep.resume(job text) returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    j lockstep.job := lockstep._job(job);
begin
    perform lockstep._check_controls(j, 'resume');
    if j.paused_at is null then
        return false;
    end if;
    perform lockstep._update_job(j.job, pause => false);  -- security definer, as the flag below
    if j.kind = 'derived' then
        perform lockstep._flag_job(j.job, pg_catalog.format(
            'resumed after a pause (since %s, by %s): the full recompute checks what the pause may have missed',
            j.paused_at, j.paused_by));
    end if;
    return true;
end;
$$;

comment on function lockstep.resume(text) is
    'Undo lockstep.pause: a derived job is flagged for its full recompute. Returns whether it was '
    'paused. Locks: the job''s registry row, then an append to lockstep.recompute_flag.';

-- lockstep._preview_diff(j, keys): the owner's part of lockstep.preview (lockstep._apply, j.kind =
-- 'preview'): the difference lockstep._diff computes for keys (NULL: the whole table), summed up per parent
-- and action, returned in p.errors as one JSON object per row ({"key", "action", "rows"}), in key order.
-- It leaves rows in the work tables: lockstep.preview rolls its subtransaction back.
-- locks: no row locks (as lockstep._diff); writes only pg_temp work tables.
create or replace function lockstep._preview_diff(j lockstep.job, keys text[]) returns lockstep._pass
language plpgsql
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    p lockstep._pass := row(0, 0, 0, '{}', 0, 0, 0, '{}', '{}');
    v_order text := 'k';
begin
    perform lockstep._diff(j, keys);
    if j.parent is not null then  -- parents in their key type's order, as the write steps take them
        v_order := pg_catalog.format('k::%s', lockstep._type_sql(j.key_type));
    end if;
    execute pg_catalog.format(
        'select coalesce(array_agg(pg_catalog.json_build_object(''key'', k, ''action'', a, ''rows'', n)::text '
        '                          order by %3$s, a), ''{}'') '
        'from (select lockstep_parent, case when lockstep_new then ''insert'' else ''update'' end, count(*) '
        '      from pg_temp.%1$I group by 1, 2 '
        '      union all '
        '      select lockstep_parent, ''delete'', count(*) from pg_temp.%2$I group by 1) s(k, a, n)',
        lockstep._tmp(j, 'put'), lockstep._tmp(j, 'gone'), v_order)
        into p.errors;
    return p;
end;
$$;

comment on function lockstep._preview_diff(lockstep.job, text[]) is
    'As j''s owner (lockstep._apply, kind preview): lockstep._diff for keys, summed per parent and '
    'action, as JSON rows in p.errors. Locks: no row locks; writes only pg_temp work tables.';

-- lockstep._preview(j, keys): lockstep.preview for keys in canonical text (NULL: the whole table). The
-- difference is computed as the job's owner (lockstep._apply, as a run computes it), in a subtransaction
-- rolled back before this returns: the work tables, the temporary objects and the role are as before.
-- locks: no row locks (compute reads, the target is read under MVCC).
create or replace function lockstep._preview(j lockstep.job, keys text[])
returns table (key text, action text, rows bigint)
language plpgsql
set search_path = pg_catalog, pg_temp
set jit = off  -- lockstep._no_jit_note (03_helpers.sql)
set datestyle = 'ISO, YMD'
set intervalstyle = 'postgres'
set extra_float_digits = 1
as $$
declare
    p lockstep._pass;
begin
    j.kind := 'preview';  -- lockstep._apply: the difference only (lockstep._preview_diff)
    begin
        p := lockstep._apply(j, _preview.keys);
        raise exception 'lockstep: preview done' using errcode = 'LSP00';
    exception when sqlstate 'LSP00' then
        null;  -- rolled back: nothing the difference wrote outlives it
    end;
    return query
        select x ->> 'key', x ->> 'action', (x ->> 'rows')::bigint
        from pg_catalog.unnest(p.errors) with ordinality u(t, o), lateral (select u.t::jsonb as x) s
        order by u.o;
end;
$$;

comment on function lockstep._preview(lockstep.job, text[]) is
    'lockstep.preview for keys as text (NULL: all), in a subtransaction rolled back before it '
    'returns. Locks: no row locks, and none left.';

-- lockstep._preview_job(job): the registry row of a derived job whose difference can be previewed for
-- some parent keys: LSJ02 for a job without a parent, whose difference is previewed whole.
create or replace function lockstep._preview_job(job text) returns lockstep.job
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    j lockstep.job := lockstep._job(job, 'derived');
begin
    if j.parent is null then
        raise exception 'lockstep: job "%" has no parent, so it has no keys: preview it whole', j.job
            using errcode = 'LSJ02',
                  hint = pg_catalog.format('Leave the keys out: select * from lockstep.preview(%L), or lockstep diff '
                                           'without --keys.', j.job);
    end if;
    return j;
end;
$$;

-- lockstep.preview(job, keys): what a recompute of job (keys NULL) or a worker pass over keys would change,
-- without changing it: one row per changed parent and action (insert, update, delete) with its count of
-- target rows, in key order. For a job without a parent (no keys then), key is the row's primary key. The
-- difference is lockstep._diff's, computed as a run computes it, as the job's owner; nothing is written and
-- no row lock is taken (lockstep._preview). A row that moves to another parent is an update under its new
-- parent. Keys are checked as lockstep.enqueue checks them (LSQ01, 22004).
-- A SQL function: PL/pgSQL cannot take an anyarray left NULL by its default.
-- locks: no row locks (compute reads, the target is read under MVCC).
create or replace function lockstep.preview(job text, keys anyarray default null)
returns table (key text, action text, rows bigint)
language sql
set search_path = pg_catalog, pg_temp
as $$
    select * from lockstep._preview(lockstep._job(job, 'derived'),
                                    case when keys is not null then lockstep._keys_text(lockstep._preview_job(job), keys) end);
$$;

comment on function lockstep.preview(text, anyarray) is
    'What a recompute (keys NULL) or a pass over keys would write: one row per changed parent and '
    'action with its rows, computed as the job''s owner; nothing written. Locks: no row locks, and '
    'none left.';
