-- lockstep 0001: who may define, change and drop jobs.
-- lockstep's functions are SECURITY INVOKER: a role that defines jobs needs DML on lockstep.job. Row-level
-- security keeps it to its own jobs (or those of roles it is a member of), and define_* refuse a target,
-- parent or function the calling role could not use itself, so no role can make the runner's privileges
-- work for it. Superusers and the schema's owner bypass row-level security, as usual.

-- lockstep._may_manage(owner): the current role may change a job owned by owner.
-- locks: nothing.
create function lockstep._may_manage(owner name) returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select case when owner = current_user then true
                when not exists (select from pg_catalog.pg_roles r where r.rolname = owner) then true
                else pg_catalog.pg_has_role(current_user, owner, 'MEMBER') end;
$$;

alter table lockstep.job enable row level security;
create policy job_read on lockstep.job for select using (true);
create policy job_insert on lockstep.job for insert with check (owner = current_user);
create policy job_update on lockstep.job for update
    using (lockstep._may_manage(owner)) with check (lockstep._may_manage(owner));
create policy job_delete on lockstep.job for delete using (lockstep._may_manage(owner));

-- lockstep._check_privileges(target, fn, parent): the calling role may itself run fn and read and write
-- target (and read parent); else 42501 and nothing is defined.
-- locks: nothing.
create function lockstep._check_privileges(target regclass, fn regprocedure, parent regclass) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    p text;
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
end;
$$;
