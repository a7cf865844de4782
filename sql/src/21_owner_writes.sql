-- lockstep: the writes a job owner makes through lockstep (define, redefine, settings, pause, resume,
-- retry, watch), in SECURITY DEFINER functions (enqueue's: lockstep._append_keys, 08_queue.sql): the owner
-- recipe holds no INSERT, UPDATE or DELETE on lockstep's tables, so no owner may lock them. Each acts for a caller that manages the job
-- (lockstep._check_manages), as the row security of those writes did, and runs no code of the caller's:
-- no dynamic SQL, no cast through a key type.

-- lockstep._check_may_own(job, owner): the caller (lockstep._caller) may write a registry row of job owned
-- by the role of oid owner: an existing role it is or is a member of, or any, for an admin; else 42501
-- (the registry's policies: a new row's owner, and an updated row's, must be such a role).
create or replace function lockstep._check_may_own(job text, owner oid) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_who name := lockstep._caller();
begin
    if exists (select from pg_catalog.pg_roles r where r.oid = owner)
       and (pg_catalog.pg_has_role(v_who, owner, 'MEMBER')
            or (select pg_catalog.pg_has_role(v_who, c.relowner, 'MEMBER')
                from pg_catalog.pg_class c where c.oid = 'lockstep.job'::pg_catalog.regclass)) then
        return;
    end if;
    raise exception 'lockstep: role "%" may not write job "%" owned by role %', v_who, job,
        coalesce(pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(owner)), 'none')
        using errcode = '42501', hint = 'A job is written by its owner, a member of it, or a lockstep admin; a '
                                        'job whose owner role is gone can only be dropped.';
end;
$$;

-- lockstep._check_may_define(): the caller (lockstep._caller) may define a new job: it holds EXECUTE on
-- lockstep._put_job by a grant to it or to a role it is a member of (the owner recipe's; PUBLIC's default
-- does not count), or INSERT on lockstep.job (a table or column grant, an admin); else 42501. The
-- application and a role with only USAGE on the schema define no job, as when a job took an INSERT.
create or replace function lockstep._check_may_define() returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_who name := lockstep._caller();
begin
    if exists (select from pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
               where p.oid = 'lockstep._put_job(lockstep.job)'::pg_catalog.regprocedure
                 and a.privilege_type = 'EXECUTE' and a.grantee <> 0
                 and pg_catalog.pg_has_role(v_who, a.grantee, 'MEMBER'))
       or pg_catalog.has_any_column_privilege(v_who, 'lockstep.job', 'INSERT') then
        return;
    end if;
    raise exception 'lockstep: role "%" may not define jobs', v_who
        using errcode = '42501',
              hint = 'A job owner is granted it: grant execute on function lockstep._put_job(lockstep.job) to <role> '
                     '(docs/security.md).';
end;
$$;

-- lockstep._put_job(j): write the registry row of a job define_job or define_derived checked (the fields
-- of its kind), and its status row. A new job is owned by j.owner, an existing one keeps its owner: either
-- must be a role the caller may act as (lockstep._check_may_own); a new job needs a caller that may define
-- jobs (lockstep._check_may_define); an existing job must be of j's kind. A changed definition makes the
-- job due now; a new every counts from the last run, the same every keeps next_run_at. The lock group must hold no job
-- the caller does not manage, and the key type be one lockstep converts (LSD04), as the policies ask; a
-- timeout one statement_timeout holds (lockstep._check_timeout, 22023).
-- Security definer: the owner recipe holds no INSERT or UPDATE on lockstep's tables.
-- locks: the job's registry row (insert or update), then its status row (insert, or update).
create or replace function lockstep._put_job(j lockstep.job) returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    old lockstep.job;
    v_changed boolean;
begin
    perform lockstep._check_manages(j.job);
    select * into old from lockstep.job x where x.job = j.job;
    perform lockstep._check_may_own(j.job, coalesce(old.owner_id,
                                                    (select r.oid from pg_catalog.pg_roles r where r.rolname = j.owner)));
    if old.job is null then
        perform lockstep._check_may_define();
    end if;
    if old.kind <> j.kind or j.kind is null or j.kind not in ('job', 'derived') then
        raise exception 'lockstep: job "%" is a % job, not a %', j.job, old.kind, j.kind using errcode = 'LSJ02';
    end if;
    if not lockstep._safe_key_type(j.key_type) then
        raise exception 'lockstep: the key type % of job "%" is refused', j.key_type, j.job using errcode = 'LSD04';
    end if;
    if j.timeout is not null then  -- as set_time_limit can apply it (22023)
        perform lockstep._check_timeout(j.timeout);
    end if;
    if exists (select from lockstep.job x where x.lock_group = j.lock_group and x.job <> j.job
                                            and not lockstep._caller_manages(x.job)) then
        raise exception 'lockstep: lock group "%" is used by a job of another role', j.lock_group
            using errcode = '42501', hint = 'Choose another lock_group: a group holds the jobs of one owner.';
    end if;
    insert into lockstep.job as x (job, kind, owner, lock_group, call, target, compute, parent, parent_column,
                                   parent_key, key_type, target_key, columns, image_columns, every, backoff, timeout)
    values (j.job, j.kind, j.owner, j.lock_group, j.call, j.target, j.compute, j.parent, j.parent_column,
            j.parent_key, j.key_type, j.target_key, j.columns, coalesce(j.image_columns, '{}'), j.every, j.backoff,
            coalesce(j.timeout, interval '5 minutes'))
    on conflict on constraint job_pkey do update
        set lock_group = excluded.lock_group, call = excluded.call, target = excluded.target,
            compute = excluded.compute, parent = excluded.parent, parent_column = excluded.parent_column,
            parent_key = excluded.parent_key, key_type = excluded.key_type, target_key = excluded.target_key,
            columns = excluded.columns, image_columns = excluded.image_columns, every = excluded.every,
            backoff = excluded.backoff, timeout = coalesce(j.timeout, x.timeout), updated_at = now();
    perform lockstep._check_manages(j.job);  -- a concurrent define of the same name: its row, maybe not ours
    insert into lockstep.job_state (job) values (j.job) on conflict do nothing;
    if old.job is null then
        return;
    end if;
    v_changed := (old.call, old.compute, old.target, old.parent, old.parent_column, old.parent_key, old.key_type,
                  old.columns, old.target_key, old.image_columns)
                 is distinct from (j.call, j.compute, j.target, j.parent, j.parent_column, j.parent_key, j.key_type,
                                   j.columns, j.target_key, coalesce(j.image_columns, '{}'));
    update lockstep.job_state s
    set next_run_at = case when v_changed then now()
                           when old.every = j.every then s.next_run_at  -- the same schedule: kept
                           else least(s.next_run_at, coalesce(s.last_started_at, now()) + j.every) end
    where s.job = j.job;
end;
$$;
comment on function lockstep._put_job(lockstep.job) is
    'Write the registry and status rows of a job define_job or define_derived checked: a new job for an '
    'owner the caller may act as, an existing one for a caller that manages it (42501). Security definer: '
    'the owner recipe holds no INSERT or UPDATE on lockstep''s tables. Locks: the job''s registry row '
    '(insert or update), then its status row (insert, or update).';

-- lockstep._update_job(job, batch_parents, max_attempts, timeout, pause, paused_by): set those of a job's
-- settings given (not NULL): pause true keeps the first paused_at and paused_by, false clears them.
-- Returns paused_at. For a caller that manages the job (42501); a timeout as lockstep._check_timeout (22023).
-- Security definer: the owner recipe holds no UPDATE on lockstep's tables.
-- locks: the job's registry row (FOR NO KEY UPDATE, by the update).
create or replace function lockstep._update_job(job text, batch_parents integer default null,
                                                max_attempts integer default null, timeout interval default null,
                                                pause boolean default null, paused_by name default null)
returns timestamptz
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v timestamptz;
begin
    perform lockstep._check_manages(job);
    perform lockstep._check_may_own(job, (select x.owner_id from lockstep.job x where x.job = _update_job.job));
    if _update_job.timeout is not null then  -- as set_time_limit can apply it (22023)
        perform lockstep._check_timeout(_update_job.timeout);
    end if;
    update lockstep.job x
    set batch_parents = coalesce(_update_job.batch_parents, x.batch_parents),
        max_attempts = coalesce(_update_job.max_attempts, x.max_attempts),
        timeout = coalesce(_update_job.timeout, x.timeout),
        updated_at = case when coalesce(_update_job.batch_parents, _update_job.max_attempts) is not null
                          then now() else x.updated_at end,
        paused_at = case when pause then coalesce(x.paused_at, pg_catalog.now())
                         when not pause then null else x.paused_at end,
        paused_by = case when pause then coalesce(x.paused_by, _update_job.paused_by)
                         when not pause then null else x.paused_by end
    where x.job = _update_job.job
      and (coalesce(_update_job.batch_parents, _update_job.max_attempts) is not null or pause is not null
           or x.timeout is distinct from coalesce(_update_job.timeout, x.timeout))
    returning x.paused_at into v;
    return v;
end;
$$;
comment on function lockstep._update_job(text, integer, integer, interval, boolean, name) is
    'Set those of a job''s settings given (batch_parents, max_attempts, timeout, pause), for a caller '
    'that manages it (42501); returns paused_at. Security definer: the owner recipe holds no UPDATE on '
    'lockstep''s tables. Locks: the job''s registry row (by the update).';

-- lockstep._flag_job(job, problem): flag job for its full recompute (a lockstep.recompute_flag row at
-- clock time), for a caller that manages it (42501; LSJ01 if there is no such job): watch(), resume()
-- and an owner's own trigger.
-- Security definer: the owner recipe holds no INSERT on lockstep's tables.
-- locks: none beyond the insert into lockstep.recompute_flag.
create or replace function lockstep._flag_job(job text, problem text) returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    perform lockstep._check_manages(job);
    perform lockstep._job(job);  -- LSJ01: no rows for a job that does not exist
    insert into lockstep.recompute_flag (job, problem) values (job, problem);
end;
$$;
comment on function lockstep._flag_job(text, text) is
    'Flag job for its full recompute, for a caller that manages it (42501). Security definer: the owner '
    'recipe holds no INSERT on lockstep''s tables. Locks: none beyond the insert into '
    'lockstep.recompute_flag.';

-- lockstep._check_may_name_viewers(owner): the caller (lockstep._caller) may name the viewers of the jobs of
-- the role owner: it is that role, a member of it, or a lockstep admin; else 42501.
create or replace function lockstep._check_may_name_viewers(owner regrole) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_who name := lockstep._caller();
begin
    if pg_catalog.pg_has_role(v_who, owner, 'MEMBER')
       or (select pg_catalog.pg_has_role(v_who, c.relowner, 'MEMBER')
           from pg_catalog.pg_class c where c.oid = 'lockstep.job'::pg_catalog.regclass) then
        return;
    end if;
    raise exception 'lockstep: role "%" may not name the viewers of the jobs of role %', v_who, owner
        using errcode = '42501', hint = 'The owner role, a member of it, or a lockstep admin may.';
end;
$$;

-- lockstep.add_viewer(viewer, owner): let the role viewer read, never change, every job of the role owner
-- (a lockstep.viewer row). For a caller that is owner, a member of it, or a lockstep admin (42501).
-- Security definer: the owner recipe holds nothing on lockstep.viewer. False: the row was there already.
-- locks: the lockstep.viewer row (inserted).
create or replace function lockstep.add_viewer(viewer regrole, owner regrole) returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    if viewer is null or owner is null then
        raise exception 'lockstep: add_viewer needs a viewer and an owner role' using errcode = '22004';
    end if;
    perform lockstep._check_may_name_viewers(owner);
    insert into lockstep.viewer (viewer, owner)
    values (pg_catalog.pg_get_userbyid(viewer), pg_catalog.pg_get_userbyid(owner))
    on conflict do nothing;
    return found;
end;
$$;
comment on function lockstep.add_viewer(regrole, regrole) is
    'Let the role viewer read, never change, every job of the role owner (a lockstep.viewer row). For a '
    'caller that is owner, a member of it, or a lockstep admin (42501). Security definer. False: the row was '
    'there already. Locks: the lockstep.viewer row (inserted).';

-- lockstep.remove_viewer(viewer, owner): undo lockstep.add_viewer (the lockstep.viewer rows of those two
-- roles, by oid). Same callers (42501). False: there was none.
-- locks: those lockstep.viewer rows (deleted).
create or replace function lockstep.remove_viewer(viewer regrole, owner regrole) returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    if viewer is null or owner is null then
        raise exception 'lockstep: remove_viewer needs a viewer and an owner role' using errcode = '22004';
    end if;
    perform lockstep._check_may_name_viewers(owner);
    delete from lockstep.viewer v where v.viewer_id = remove_viewer.viewer and v.owner_id = remove_viewer.owner;
    return found;
end;
$$;
comment on function lockstep.remove_viewer(regrole, regrole) is
    'Undo lockstep.add_viewer: the lockstep.viewer rows of those two roles, by oid. For a caller that is '
    'owner, a member of it, or a lockstep admin (42501). Security definer. False: there was none. Locks: '
    'those lockstep.viewer rows (deleted).';
