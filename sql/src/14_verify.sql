-- lockstep: verify a derived table against its compute, read-only (lockstep.verify).

-- lockstep._verify_pass(j, keys): run as j's owner (lockstep._owner_run, kind 'verify'): lockstep._diff for
-- the parents in keys (NULL: all), then its counts and up to 3 examples of each kind, in primary-key order;
-- the work tables are emptied again. The result rides in lockstep._pass: inserted = rows missing,
-- deleted = rows extra, updated = rows different, errors = the examples (jsonb objects as text).
-- locks: no row locks; writes only pg_temp work tables.
create or replace function lockstep._verify_pass(j lockstep.job, keys text[]) returns lockstep._pass
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
as $$
declare
    n lockstep._diff_counts := lockstep._diff(j, keys);
    v_pk text := lockstep._cols(j.target_key, 'w');
    p lockstep._pass := row(n.fresh, n.kept, n.gone, '{}', 0, 0, 0, '{}', '{}');
begin
    execute pg_catalog.format(
        'select coalesce(pg_catalog.array_agg(e::text order by o, r), ''{}'') from ('
        ' (select 1 as o, pg_catalog.row_number() over (order by %1$s) as r, pg_catalog.jsonb_build_object('
        '    ''kind'', ''missing'', ''computed'', pg_catalog.to_jsonb(w) - $1) as e'
        '  from pg_temp.%2$I w where w.lockstep_new order by %1$s limit 3)'
        ' union all'
        ' (select 2, pg_catalog.row_number() over (order by %1$s), pg_catalog.jsonb_build_object('
        '    ''kind'', ''extra'', ''target'', pg_catalog.to_jsonb(w) - $1)'
        '  from pg_temp.%3$I w order by %1$s limit 3)'
        ' union all'
        ' (select 3, pg_catalog.row_number() over (order by %1$s), pg_catalog.jsonb_build_object('
        '    ''kind'', ''different'', ''computed'', pg_catalog.to_jsonb(w) - $1,'
        '    ''target'', (select pg_catalog.to_jsonb(s) from (select %4$s from %5$s t where t.ctid = w.lockstep_ctid) s))'
        '  from pg_temp.%2$I w where not w.lockstep_new order by %1$s limit 3)) x',
        v_pk, lockstep._tmp(j, 'put'), lockstep._tmp(j, 'gone'), lockstep._cols(j.columns, 't'), j.target)
        into p.errors
        using array['lockstep_parent', 'lockstep_old_parent', 'lockstep_new', 'lockstep_ctid'];
    perform lockstep._tmp_clear(j);
    return p;
end;
$$;
comment on function lockstep._verify_pass(lockstep.job, text[]) is
    'As j''s owner: lockstep._diff for the parents in keys (NULL: all), its counts and up to 3 examples of '
    'each kind, in lockstep._pass (inserted = missing, deleted = extra, updated = different, errors = the '
    'examples). Locks: no row locks; writes only pg_temp work tables.';

-- lockstep._verify(job, keys): lockstep.verify for keys as text (NULL: all parents).
-- locks: none (no row lock, no lock group); reads the target, the parent and what compute reads.
create or replace function lockstep._verify(j lockstep.job, keys text[])
returns table (missing bigint, extra bigint, different bigint, examples jsonb)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    p lockstep._pass;
begin
    j.kind := 'verify';  -- lockstep._owner_run runs lockstep._verify_pass instead of a pass
    p := lockstep._as_owner(j, keys);
    return query select p.inserted, p.deleted, p.updated,
                        coalesce((select pg_catalog.jsonb_agg(e::jsonb) from pg_catalog.unnest(p.errors) e), '[]');
end;
$$;
comment on function lockstep._verify(lockstep.job, text[]) is
    'Lockstep.verify for keys as text (NULL: all parents). Locks: none.';

-- lockstep.verify(job, keys): compare job's target with what its compute returns now, for the parents in
-- keys, as the job's owner, writing nothing: rows missing (computed, not in the target), extra (in the
-- target, not computed) and different (same primary key, other values), with up to 3 examples of each
-- as {"kind", "computed", "target"}. Keys still queued may differ until the worker has run.
-- locks: none (no row lock, no lock group); reads the target, the parent and what compute reads.
create or replace function lockstep._verify_keys(job text, keys anyarray)
returns table (missing bigint, extra bigint, different bigint, examples jsonb)
language plpgsql
set search_path = pg_catalog, pg_temp
set jit = off  -- lockstep._no_jit_note (03_helpers.sql)
set datestyle = 'ISO, YMD'
set intervalstyle = 'postgres'
set extra_float_digits = 1
as $$
declare
    j lockstep.job := lockstep._job(job, 'derived');
begin
    if j.parent is null then
        raise exception 'lockstep: job "%" has no parent: verify it whole', j.job
            using errcode = 'LSJ02', hint = pg_catalog.format('select * from lockstep.verify(%L)', j.job);
    end if;
    return query select * from lockstep._verify(j, lockstep._keys_text(j, keys));
end;
$$;
comment on function lockstep._verify_keys(text, anyarray) is
    'The body of lockstep.verify(job, keys), under lockstep''s pinned settings (it puts back the '
    'caller''s settings after it). Locks: none.';

-- lockstep.verify(job, keys): as its body (lockstep._verify_keys), run as the caller with no SET clause: it reads the caller's
-- settings (lockstep._settings) and puts back any the job's code changed for the session; every name is
-- qualified.
-- locks: none, as lockstep._verify_keys.
create or replace function lockstep.verify(job text, keys anyarray)
returns table (missing bigint, extra bigint, different bigint, examples jsonb)
language plpgsql
as $$
declare
    v_was pg_catalog.text[] := lockstep._settings();
    v_now pg_catalog.text[];
begin
    return query select * from lockstep._verify_keys(job, keys);
    v_now := lockstep._settings();
    if v_now operator(pg_catalog.<>) v_was then
        perform lockstep._restore_settings(v_was, v_now);
    end if;
end;
$$;
comment on function lockstep.verify(text, anyarray) is
    'Compare job''s target with what its compute returns now for these parents, as the job''s owner, '
    'writing nothing: rows missing, extra and different, with up to 3 examples of each. Locks: none.';

-- lockstep.verify(job): lockstep.verify for every parent (the whole target).
-- locks: none (no row lock, no lock group); reads the target, the parent and what compute reads.
create or replace function lockstep._verify_all(job text)
returns table (missing bigint, extra bigint, different bigint, examples jsonb)
language plpgsql
set search_path = pg_catalog, pg_temp
set jit = off  -- lockstep._no_jit_note (03_helpers.sql)
set datestyle = 'ISO, YMD'
set intervalstyle = 'postgres'
set extra_float_digits = 1
as $$
begin
    return query select * from lockstep._verify(lockstep._job(job, 'derived'), null);
end;
$$;
comment on function lockstep._verify_all(text) is
    'The body of lockstep.verify(job), under lockstep''s pinned settings (it puts back the caller''s '
    'settings after it). Locks: none.';

-- lockstep.verify(job): as its body (lockstep._verify_all), run as the caller with no SET clause: it reads the caller's
-- settings (lockstep._settings) and puts back any the job's code changed for the session; every name is
-- qualified.
-- locks: none, as lockstep._verify_all.
create or replace function lockstep.verify(job text)
returns table (missing bigint, extra bigint, different bigint, examples jsonb)
language plpgsql
as $$
declare
    v_was pg_catalog.text[] := lockstep._settings();
    v_now pg_catalog.text[];
begin
    return query select * from lockstep._verify_all(job);
    v_now := lockstep._settings();
    if v_now operator(pg_catalog.<>) v_was then
        perform lockstep._restore_settings(v_was, v_now);
    end if;
end;
$$;
comment on function lockstep.verify(text) is
    'Compare job''s whole target with what its compute returns now, as the job''s owner, writing '
    'nothing: rows missing, extra and different, with up to 3 examples of each. Locks: none.';
