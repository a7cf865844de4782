-- lockstep: who may define, change, see and run jobs: row-level security keeps each role to the jobs it
-- manages, and a job's code runs as its owner. Role recipes: docs/security.md.

-- lockstep._is_admin(): the current role is a member of the role owning lockstep's tables, or a superuser.
create or replace function lockstep._is_admin() returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select pg_catalog.pg_has_role(current_user, c.relowner, 'MEMBER')
            from pg_catalog.pg_class c where c.oid = 'lockstep.job'::pg_catalog.regclass);
end;
$$;

-- lockstep._may_manage_id(owner): the current role may see and change the rows of a job owned by the role
-- of oid owner (lockstep.job.owner_id): it is that role, a member of it, or the admin; or no role has that
-- oid any more (the job may be taken over).
create or replace function lockstep._may_manage_id(owner oid) returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return case when not exists (select from pg_catalog.pg_roles r where r.oid = owner) then true
                else pg_catalog.pg_has_role(current_user, owner, 'MEMBER') or lockstep._is_admin() end;
end;
$$;

-- lockstep._caller(): the role a SECURITY DEFINER function of lockstep acts for: the session's role (SET
-- ROLE, which no security-definer function can change), else its login role.
create or replace function lockstep._caller() returns name
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return coalesce(nullif(pg_catalog.current_setting('role'), 'none'), session_user)::name;
end;
$$;

-- lockstep._caller_manages(job): the caller (lockstep._caller) manages job, as lockstep._may_manage_id judges
-- for the current role: it is the owner, a member of it or an admin, or the owner role is gone. True for a
-- job that does not exist: there is nothing of it to change.
create or replace function lockstep._caller_manages(job text) returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_who name := lockstep._caller();
    v_owner oid := (select x.owner_id from lockstep.job x where x.job = _caller_manages.job);
begin
    return v_owner is null
       or not exists (select from pg_catalog.pg_roles r where r.oid = v_owner)
       or pg_catalog.pg_has_role(v_who, v_owner, 'MEMBER')
       or (select pg_catalog.pg_has_role(v_who, c.relowner, 'MEMBER')
           from pg_catalog.pg_class c where c.oid = 'lockstep.job'::pg_catalog.regclass);
end;
$$;

-- lockstep._check_manages(job): the caller manages job (lockstep._caller_manages); else 42501.
create or replace function lockstep._check_manages(job text) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_who name := lockstep._caller();
    v_owner regrole := (select x.owner_id from lockstep.job x where x.job = _check_manages.job);
begin
    if lockstep._caller_manages(job) then
        return;
    end if;
    raise exception 'lockstep: role "%" may not change the rows of job "%", owned by role "%"', v_who, job, v_owner
        using errcode = '42501', hint = 'Only members of the owner role, and lockstep admins, may.';
end;
$$;

-- lockstep._delete(tbl, job, keys, other_keys): delete job's rows of lockstep.<tbl> (queue, key_failure,
-- recompute_flag, or job: the registry row, its status and failures by cascade): all, or those whose key
-- is in keys and not in other_keys; for a caller that manages job (42501). Returns the keys deleted.
-- Security definer: owners and runners hold no DELETE on lockstep's tables, so none may lock them.
-- locks: those rows (deleted).
create or replace function lockstep._delete(tbl text, job text, keys text[] default null,
                                            other_keys text[] default null)
returns text[]
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v text[];
begin
    perform lockstep._check_manages(job);
    if tbl in ('job', 'recompute_flag') and keys is null and other_keys is null then
        execute pg_catalog.format('delete from lockstep.%I x where x.job = $1', tbl) using job;
        return null;
    elsif tbl in ('queue', 'key_failure') then
        execute pg_catalog.format(
            'with d as (delete from lockstep.%I x where x.job = $1 and ($2 is null or x.key = any($2))'
            ' and ($3 is null or x.key <> all($3)) returning x.key) select pg_catalog.array_agg(d.key) from d', tbl)
            into v using job, keys, other_keys;
        return v;
    end if;
    raise exception 'lockstep: _delete(%, ...) is not a deletion lockstep makes', tbl using errcode = '22023';
end;
$$;
comment on function lockstep._delete(text, text, text[], text[]) is
    'Delete a job''s rows of lockstep.queue, key_failure, recompute_flag or job (all, or by key), for a '
    'caller that manages the job (42501); the keys deleted. Security definer: no recipe role holds DELETE on '
    'lockstep''s tables. Locks: those rows (deleted).';

-- lockstep._is_member_id(role): the current role is the role of oid role or a member of it; false for an
-- oid no role has.
create or replace function lockstep._is_member_id(role oid) returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if not exists (select from pg_catalog.pg_roles r where r.oid = _is_member_id.role) then
        return false;
    end if;
    return pg_catalog.pg_has_role(current_user, role, 'MEMBER');
end;
$$;
drop policy if exists viewer_read on lockstep.viewer;
create policy viewer_read on lockstep.viewer for select
    using (lockstep._is_member_id(viewer_id) or lockstep._may_manage_id(owner_id));
drop policy if exists viewer_write on lockstep.viewer;
create policy viewer_write on lockstep.viewer for all
    using (lockstep._may_manage_id(owner_id)) with check (lockstep._may_manage_id(owner_id));

-- lockstep._may_view_id(owner): the current role may read the rows of a job owned by the role of oid owner
-- (lockstep.job.owner_id): it may manage them, or lockstep.viewer names that role for a role it is a member
-- of (by oid).
create or replace function lockstep._may_view_id(owner oid) returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if lockstep._may_manage_id(owner) then
        return true;
    end if;
    if not pg_catalog.has_table_privilege('lockstep.viewer', 'SELECT') then
        return false;  -- apart: a query naming the table checks its privilege before it runs
    end if;
    return exists (select from lockstep.viewer v where v.owner_id = _may_view_id.owner
                                                   and lockstep._is_member_id(v.viewer_id));
end;
$$;

-- lockstep._may_own_id(owner): a registry row written by the current role may name the role of oid owner:
-- an existing role the current role is, or is a member of (or any role, for an admin).
create or replace function lockstep._may_own_id(owner oid) returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return exists (select from pg_catalog.pg_roles r where r.oid = owner)
       and (pg_catalog.pg_has_role(current_user, owner, 'MEMBER') or lockstep._is_admin());
end;
$$;

-- lockstep._may_own(owner): a registry row written by the current role may name owner: an existing role
-- the current role is, or is a member of (or any role, for an admin).
create or replace function lockstep._may_own(owner name) returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select from pg_catalog.pg_roles r where r.rolname = owner)
       and (pg_catalog.pg_has_role(current_user, owner, 'MEMBER') or lockstep._is_admin());
$$;

-- lockstep._group_holder(lock_group, job): the first job but job in lock_group (and its owner) owned by a
-- role the current role may not manage; NULLs if none. A lock group belongs to its jobs' owners.
create or replace function lockstep._group_holder(lock_group text, job text, out holder text, out holder_owner name)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    select x.job, pg_catalog.pg_get_userbyid(x.owner_id) into holder, holder_owner from lockstep.job x
    where x.lock_group = _group_holder.lock_group and x.job <> _group_holder.job
      and not lockstep._may_manage_id(x.owner_id)
    order by x.job limit 1;
end;
$$;

-- lockstep._group_free(lock_group, job): no other owner's job holds lock_group (lockstep._group_holder).
create or replace function lockstep._group_free(lock_group text, job text) returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (lockstep._group_holder(lock_group, job)).holder is null;
end;
$$;
-- lockstep._owner_id(): trigger before a registry, run_log or viewer row is written with an owner (but a
-- run_log row inserted with its owner_id): owner_id is the role of that name now, oid 0 if none (and a
-- viewer row's viewer_id, likewise). Every right follows owner_id, so a
-- later rename of the role changes nothing, and a new role of the old name gets nothing.
-- locks: nothing.
create or replace function lockstep._owner_id() returns trigger
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if tg_table_name = 'viewer' then
        new.viewer_id := coalesce(pg_catalog.to_regrole(pg_catalog.quote_ident(new.viewer)), 0::oid::regrole);
    end if;
    if tg_table_name <> 'run_log' or tg_op = 'UPDATE' or new.owner_id is null then
        new.owner_id := coalesce(pg_catalog.to_regrole(pg_catalog.quote_ident(new.owner)), 0::oid::regrole);
    end if;
    return new;
end;
$$;
create or replace trigger job_owner_id before insert or update of owner on lockstep.job
    for each row execute function lockstep._owner_id();
create or replace trigger run_log_owner_id before insert or update of owner on lockstep.run_log
    for each row execute function lockstep._owner_id();
create or replace trigger viewer_owner_id before insert or update on lockstep.viewer
    for each row execute function lockstep._owner_id();

drop policy if exists job_read on lockstep.job;
create policy job_read on lockstep.job for select using (true);
drop policy if exists job_insert on lockstep.job;
create policy job_insert on lockstep.job for insert
    with check (owner = current_user and owner_id = pg_catalog.to_regrole(pg_catalog.quote_ident(current_user))
                and lockstep._safe_key_type(key_type) and lockstep._group_free(lock_group, job));
drop policy if exists job_update on lockstep.job;
create policy job_update on lockstep.job for update
    using (lockstep._may_manage_id(owner_id))
    with check (lockstep._may_own_id(owner_id) and lockstep._safe_key_type(key_type) and lockstep._group_free(lock_group, job));
drop policy if exists job_delete on lockstep.job;
create policy job_delete on lockstep.job for delete using (lockstep._may_manage_id(owner_id));
drop policy if exists job_state_own on lockstep.job_state;
create policy job_state_own on lockstep.job_state for all
    using (job in (select j.job from lockstep.job j where lockstep._may_manage_id(j.owner_id)))
    with check (job in (select j.job from lockstep.job j where lockstep._may_manage_id(j.owner_id)));
drop policy if exists key_failure_own on lockstep.key_failure;
create policy key_failure_own on lockstep.key_failure for all
    using (job in (select j.job from lockstep.job j where lockstep._may_manage_id(j.owner_id)))
    with check (job in (select j.job from lockstep.job j where lockstep._may_manage_id(j.owner_id)));
-- and read by the roles lockstep.viewer names (permissive policies: either one lets a row through)
drop policy if exists job_state_view on lockstep.job_state;
create policy job_state_view on lockstep.job_state for select
    using (job in (select j.job from lockstep.job j where lockstep._may_view_id(j.owner_id)));
drop policy if exists key_failure_view on lockstep.key_failure;
create policy key_failure_view on lockstep.key_failure for select
    using (job in (select j.job from lockstep.job j where lockstep._may_view_id(j.owner_id)));
drop policy if exists queue_append on lockstep.queue;
create policy queue_append on lockstep.queue for insert with check (true);
drop policy if exists queue_read on lockstep.queue;
create policy queue_read on lockstep.queue for select
    using (job in (select j.job from lockstep.job j where lockstep._may_view_id(j.owner_id))
           or not pg_catalog.has_column_privilege('lockstep.queue'::pg_catalog.regclass, 'key', 'SELECT'));
drop policy if exists queue_update on lockstep.queue;
create policy queue_update on lockstep.queue for update
    using (job in (select j.job from lockstep.job j where lockstep._may_manage_id(j.owner_id)))
    with check (job in (select j.job from lockstep.job j where lockstep._may_manage_id(j.owner_id)));
drop policy if exists queue_delete on lockstep.queue;
create policy queue_delete on lockstep.queue for delete
    using (job in (select j.job from lockstep.job j where lockstep._may_manage_id(j.owner_id)));
drop policy if exists recompute_flag_append on lockstep.recompute_flag;
create policy recompute_flag_append on lockstep.recompute_flag for insert with check (true);
drop policy if exists recompute_flag_own on lockstep.recompute_flag;
create policy recompute_flag_own on lockstep.recompute_flag for select
    using (job in (select j.job from lockstep.job j where lockstep._may_view_id(j.owner_id)));
drop policy if exists recompute_flag_delete on lockstep.recompute_flag;
create policy recompute_flag_delete on lockstep.recompute_flag for delete
    using (job in (select j.job from lockstep.job j where lockstep._may_manage_id(j.owner_id)));

-- lockstep._check_privileges(target, fn, parent): the calling role may itself run fn, read and write
-- target, and read and pin parent; else 42501. The job will run with exactly these rights.
create or replace function lockstep._check_privileges(target regclass, fn regprocedure, parent regclass) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    p text;
    v_problem text;
begin
    if fn is not null and not pg_catalog.has_function_privilege(fn, 'EXECUTE') then
        raise exception 'lockstep: role "%" may not execute %', current_user, fn using errcode = '42501';
    end if;
    if target is not null then
        -- one privilege at a time: with a list, has_table_privilege is true if any one is held
        foreach p in array array['SELECT', 'INSERT', 'UPDATE', 'DELETE'] loop
            if not pg_catalog.has_table_privilege(target, p) then
                raise exception 'lockstep: role "%" lacks % on %', current_user, p, target
                    using errcode = '42501', hint = 'A job may only maintain a table its definer may write.';
            end if;
        end loop;
    end if;
    if parent is not null and not pg_catalog.has_table_privilege(parent, 'SELECT') then
        raise exception 'lockstep: role "%" lacks SELECT on %', current_user, parent using errcode = '42501';
    end if;
    if parent is not null and not pg_catalog.has_any_column_privilege(parent, 'UPDATE') then
        raise exception 'lockstep: role "%" lacks UPDATE on parent % (on any column)', current_user, parent
            using errcode = '42501',
                  hint = pg_catalog.format('The write phase pins parents with FOR KEY SHARE, which needs UPDATE on one '
                                           'column: grant update (<its key column>) on %s to %I.', parent, current_user);
    end if;
    if parent is not null then
        v_problem := lockstep._key_type_problem(
            (select a.atttypid from pg_catalog.pg_constraint con
             join pg_catalog.pg_attribute a on a.attrelid = con.conrelid and a.attnum = con.conkey[1]
             where con.conrelid = parent and con.contype = 'p'));
    end if;
    if v_problem is not null then
        raise exception 'lockstep: the primary key of parent % is of a type lockstep refuses for keys: %', parent, v_problem
            using errcode = 'LSD04',
                  hint = 'lockstep converts queued keys outside the job owner''s rights; use a base type (bigint, '
                         'text, uuid, ...) or an enum with no cast of its own.';
    end if;
end;
$$;

-- jobs run as their owner ------------------------------------------------------------------------------

-- lockstep._check_act_as(j): the session may act as j's owner; else 42501 with what to grant.
create or replace function lockstep._check_act_as(j lockstep.job) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_owner name := (select r.rolname from pg_catalog.pg_roles r where r.oid = j.owner_id);  -- its name now
begin
    if v_owner is null then
        raise exception 'lockstep: job "%" is owned by role "%", which does not exist; it is not run', j.job, j.owner
            using errcode = '42501',
                  hint = 'A job runs with its owner''s rights only. Drop it and define it again as the role it should run as.';
    end if;
    if not pg_catalog.pg_has_role(session_user, j.owner_id, 'MEMBER') then
        raise exception 'lockstep: role "%" may not act as role "%", the owner of job "%"; it is not run',
            session_user, v_owner, j.job
            using errcode = '42501',
                  hint = pg_catalog.format('A job runs with its owner''s rights only: grant %I to %I (docs/security.md).',
                                           v_owner, session_user);
    end if;
end;
$$;

-- lockstep._trampoline(): name of this session's SECURITY DEFINER trampoline owned by the current role,
-- created in pg_temp on first use and checked to be exactly that.
-- locks: nothing (creates a temporary function once per session and role).
create or replace function lockstep._trampoline() returns text
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_me oid := (select r.oid from pg_catalog.pg_roles r where r.rolname = current_user);
    v_src text := ' begin return lockstep._owner_run(j, keys, true, queued_from); end ';
    v_name name;
begin
    select p.proname into v_name
    from pg_catalog.pg_proc p
    where p.pronamespace = pg_catalog.pg_my_temp_schema() and p.proname like 'lockstep\_as\_%'
      and p.proowner = v_me and p.prosecdef and p.prosrc = v_src and p.prokind = 'f'
      and p.prolang = (select l.oid from pg_catalog.pg_language l where l.lanname = 'plpgsql')
      and p.proargtypes = pg_catalog.array_to_string(array['lockstep.job'::regtype::oid, 'text[]'::regtype::oid,
                                                           'bigint'::regtype::oid], ' ')::oidvector
      and p.prorettype = 'lockstep._pass'::regtype
      and p.proconfig = array['search_path=pg_catalog, pg_temp']
      and p.proacl = array[pg_catalog.makeaclitem(v_me, v_me, 'EXECUTE', false)]
    limit 1;
    if v_name is null then
        v_name := pg_catalog.format('lockstep_as_%s_%s', v_me, pg_catalog.substr(pg_catalog.md5(pg_catalog.random()::text), 1, 8));
        execute pg_catalog.format(
            'create function pg_temp.%I(j lockstep.job, keys text[], queued_from bigint default null) '
            'returns lockstep._pass language plpgsql '
            'security definer set search_path = pg_catalog, pg_temp as %L', v_name, v_src);
        execute pg_catalog.format('revoke all on function pg_temp.%I(lockstep.job, text[], bigint) from public', v_name);
    end if;
    return v_name;
end;
$$;

-- lockstep._owner_run(j, keys, sandboxed, queued_from): run the owner's code (the call, lockstep._apply
-- with queued_from, or the parent keys' read); sandboxed: then undo or refuse what it could leave behind for the runner's session.
-- locks: as the job's function or lockstep._apply.
create or replace function lockstep._owner_run(j lockstep.job, keys text[], sandboxed boolean,
                                    queued_from bigint default null)
returns lockstep._pass
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_sql text;
    v_stmts text[];
    v_cursors text[];
    p lockstep._pass;
begin
    if sandboxed then
        v_stmts := lockstep._prepared();
        v_cursors := lockstep._held_cursors();
    end if;
    if j.kind = 'job' then
        -- by the stored regprocedure: a function dropped or made ambiguous since define_job fails the run
        v_sql := pg_catalog.format('select %s()', lockstep._callable(j.call::regprocedure, 0));
        execute v_sql;
    elsif j.kind = 'verify' then  -- lockstep.verify: the difference, read-only (14_verify.sql)
        p := lockstep._verify_pass(j, keys);
    elsif j.kind = 'through_map' then  -- lockstep._resolve_through: the parent keys of through keys, in p.skipped
        execute lockstep._through_map_sql(j) using keys into p.skipped;  -- 17_through.sql
    elsif j.kind = 'parent_keys' then  -- lockstep._parent_keys: every parent key, in p.skipped
        p := row(0, 0, 0, '{}', 0, 0, 0, '{}', '{}');
        execute pg_catalog.format('select coalesce(array_agg(%1$s order by %2$s), ''{}'') from %3$s r',
                                  lockstep._key_text(j, 'r', j.parent_keys), lockstep._key_expr(j, 'r', j.parent_keys),
                                  j.parent) into p.skipped;
    else
        p := lockstep._apply(j, keys, queued_from);
    end if;
    if sandboxed then
        perform pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', false);
        set constraints all immediate;
        perform pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', false);
        perform lockstep._drop_temp_objects();
        if lockstep._held_cursors() is distinct from v_cursors then
            raise exception 'lockstep: job "%" left a WITH HOLD cursor open', j.job using errcode = '42501';
        end if;
        if lockstep._prepared() is distinct from v_stmts then
            -- prepared statements are not transactional: drop what the job's code prepared or replaced
            perform lockstep._deallocate_changed(v_stmts);
            raise exception 'lockstep: job "%" changed the session''s prepared statements', j.job using errcode = '42501';
        end if;
    end if;
    return p;
end;
$$;
comment on function lockstep._owner_run(lockstep.job, text[], boolean, bigint) is
    'Run the owner''s code (the call, lockstep._apply with queued_from, or the parent keys'' read); '
    'sandboxed: then undo or refuse what it could leave behind for the runner''s session. Locks: as the '
    'job''s function or lockstep._apply.';

-- lockstep._drop_temp_objects(): drop the current role's temporary relations and types but lockstep's own
-- work tables (kept plain and private): the runner's session serves other owners next.
-- locks: those objects (dropped; nobody else can hold them: they are this session's).
create or replace function lockstep._drop_temp_objects() returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_me oid := (select r.oid from pg_catalog.pg_roles r where r.rolname = current_user);
    v text;
begin
    if pg_catalog.pg_my_temp_schema() = 0 then
        return;
    end if;
    for v in
        with mine as (
            select c.oid, c.relname, c.relkind,
                   c.relkind = 'r' and c.relname ~ '^lockstep_(put|gone|rest)_[0-9a-f]{16}(_[0-9a-f]{8})?$'
                   and not c.relhastriggers and not c.relhasrules and not c.relrowsecurity
                   and not c.relhassubclass as keep
            from pg_catalog.pg_class c
            where c.relnamespace = pg_catalog.pg_my_temp_schema() and c.relowner = v_me
              and c.relkind in ('r', 'p', 'v', 'm', 'S', 'f', 'c'))
        select pg_catalog.format('drop %s if exists pg_temp.%I cascade',
                                 case m.relkind when 'v' then 'view' when 'm' then 'materialized view'
                                                when 'S' then 'sequence' when 'f' then 'foreign table'
                                                when 'c' then 'type' else 'table' end, m.relname)
        from mine m where not m.keep
        union all  -- a kept table another role may read (table or column grants): revoked
        select pg_catalog.format('revoke all on table pg_temp.%I from %s', m.relname,
                                 pg_catalog.string_agg(distinct case when g.grantee = 0 then 'public'
                                                                     else pg_catalog.quote_ident(r.rolname) end, ', '))
        from mine m
        cross join lateral (select a.grantee from pg_catalog.pg_class c, pg_catalog.aclexplode(c.relacl) a
                            where c.oid = m.oid
                            union all
                            select a.grantee from pg_catalog.pg_attribute t, pg_catalog.aclexplode(t.attacl) a
                            where t.attrelid = m.oid) g
        left join pg_catalog.pg_roles r on r.oid = g.grantee
        where m.keep and g.grantee <> v_me
        group by m.relname
        union all
        select pg_catalog.format('drop type if exists pg_temp.%I cascade', t.typname)
        from pg_catalog.pg_type t
        where t.typnamespace = pg_catalog.pg_my_temp_schema() and t.typowner = v_me
          and t.typtype in ('d', 'e', 'r', 'm') and t.typname not like '\_%'
    loop
        execute v;
    end loop;
end;
$$;
comment on function lockstep._drop_temp_objects() is
    'Drop the current role''s temporary relations and types but lockstep''s own work tables (kept plain '
    'and private): the runner''s session serves other owners next. Locks: those objects (dropped; nobody '
    'else can hold them: they are this session''s).';

-- lockstep._prepared(): the session's prepared statements (name, prepare time, parameter types, text): a
-- statement dropped, replaced or re-prepared by a job's code shows as a difference.
create or replace function lockstep._prepared() returns text[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select pg_catalog.array_agg(pg_catalog.concat_ws(' ', s.name, s.prepare_time, s.parameter_types, s.statement)
                                        order by s.name)
            from pg_catalog.pg_prepared_statements s);
end;
$$;

-- lockstep._held_cursors(): the session's WITH HOLD cursors (name, creation time).
create or replace function lockstep._held_cursors() returns text[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select pg_catalog.array_agg(pg_catalog.concat_ws(' ', c.name, c.creation_time) order by c.name)
            from pg_catalog.pg_cursors c where c.is_holdable);
end;
$$;

-- lockstep._deallocate_changed(kept): deallocate every prepared statement not in kept (as lockstep._prepared).
create or replace function lockstep._deallocate_changed(kept text[]) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v name;
begin
    for v in select s.name from pg_catalog.pg_prepared_statements s
             where not pg_catalog.concat_ws(' ', s.name, s.prepare_time, s.parameter_types, s.statement)
                       = any(coalesce(kept, '{}')) loop
        execute pg_catalog.format('deallocate %I', v);
    end loop;
end;
$$;

-- lockstep._as_owner(j, keys, queued_from): run lockstep._owner_run as j's owner: directly, or after checking the
-- session may act as the owner (42501), by SET LOCAL ROLE and the owner's trampoline.
-- locks: as lockstep._owner_run.
create or replace function lockstep._as_owner(j lockstep.job, keys text[], queued_from bigint default null)
returns lockstep._pass
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_role text;
    p lockstep._pass;
begin
    if j.owner_id = pg_catalog.to_regrole(pg_catalog.quote_ident(current_user)) then
        return lockstep._owner_run(j, keys, false, queued_from);
    end if;
    perform lockstep._check_act_as(j);
    v_role := pg_catalog.current_setting('role');
    perform pg_catalog.set_config('role', pg_catalog.pg_get_userbyid(j.owner_id), true);  -- checked above
    execute pg_catalog.format('select * from pg_temp.%I($1, $2, $3)', lockstep._trampoline())
        into p using j, keys, queued_from;
    perform pg_catalog.set_config('role', v_role, true);
    return p;
end;
$$;
comment on function lockstep._as_owner(lockstep.job, text[], bigint) is
    'Run lockstep._owner_run as j''s owner: directly, or after checking the session may act as the owner '
    '(42501), by SET LOCAL ROLE and the owner''s trampoline. Locks: as lockstep._owner_run.';
