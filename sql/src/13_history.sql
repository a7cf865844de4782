-- lockstep: run history: row security of lockstep.run_log, its writer and its pruning.

drop policy if exists run_log_read on lockstep.run_log;
create policy run_log_read on lockstep.run_log for select using (lockstep._may_view_id(owner_id));
drop policy if exists run_log_insert on lockstep.run_log;
create policy run_log_insert on lockstep.run_log for insert with check (lockstep._may_manage_id(owner_id));
drop policy if exists run_log_delete on lockstep.run_log;
create policy run_log_delete on lockstep.run_log for delete using (lockstep._may_manage_id(owner_id));

-- lockstep._spared_run(job, action, run_no, max_per_job): whether the count limit spares this run_log row:
-- the job's newest recompute is kept until the next one is logged (its error stays visible).
create or replace function lockstep._spared_run(job text, action text, run_no bigint, max_per_job integer)
returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select case when max_per_job > 0 and action = 'recompute'
                then run_no >= (select max(r.run_no) from lockstep.run_log r
                                where r.job = _spared_run.job and r.action = 'recompute')
                else false end;
$$;

-- lockstep.set_run_log_retention(keep, max_per_job): change the retention (NULL: leave as is), and apply
-- it to the rows already there at once.
-- locks: the pruners' advisory lock (lockstep, run_log), waiting for a run that holds it to commit; then the
-- lockstep.setting row (update); then the run_log rows it deletes.
create or replace function lockstep.set_run_log_retention(keep interval default null, max_per_job integer default null)
returns lockstep.setting
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    s lockstep.setting;
begin
    if keep is not null and keep <= interval '0' then
        raise exception 'lockstep: run_log_keep must be a positive interval (got %)', keep
            using errcode = '22023', hint = 'For example interval ''7 days''.';
    end if;
    if max_per_job is not null and max_per_job < 0 then
        raise exception 'lockstep: run_log_max_per_job must be >= 0 (got %)', max_per_job
            using errcode = '22023', hint = '0 stops logging runs (the rows already logged are pruned).';
    end if;
    perform pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtext('lockstep'), pg_catalog.hashtext('run_log'));
    insert into lockstep.setting as t (only_row, run_log_keep, run_log_max_per_job)
    values (true, coalesce(keep, interval '14 days'), coalesce(max_per_job, 1000))
    on conflict (only_row) do update
        set run_log_keep = coalesce(set_run_log_retention.keep, t.run_log_keep),
            run_log_max_per_job = coalesce(set_run_log_retention.max_per_job, t.run_log_max_per_job)
    returning * into s;
    delete from lockstep.run_log r where r.finished_at < now() - s.run_log_keep;
    delete from lockstep.run_log r
    using lockstep.job_state st
    where st.job = r.job and r.run_no <= st.runs - s.run_log_max_per_job
      and not lockstep._spared_run(r.job, r.action, r.run_no, s.run_log_max_per_job);
    return s;
end;
$$;
comment on function lockstep.set_run_log_retention(interval, integer) is
    'Change the retention (NULL: leave as is), and apply it to the rows already there at once. Locks: the'
    ' pruners'' advisory lock (lockstep, run_log), waiting for a run that holds it to commit; then the '
    'lockstep.setting row (update); then the run_log rows it deletes.';

-- lockstep._prune_run_log(job, run_no, keep, max_per_job, action): delete at most 10 rows older than keep
-- and job's rows that just fell off its max_per_job newest (lockstep._spared_run spared). One pruner at a time.
-- Security definer, for a caller that manages job (42501): no recipe role holds DELETE on run_log. It reads
-- every job's rows, so it never prunes beyond lockstep.setting's retention, nor past job's own run count
-- (lockstep.job_state.runs; none for a job that does not exist), whatever its caller passes.
-- locks: the advisory lock (lockstep, run_log), transaction-level, without waiting (not taken: no prune);
-- then the run_log rows it deletes (no application touches them).
create or replace function lockstep._prune_run_log(job text, run_no bigint, keep interval, max_per_job integer,
                                        action text default null)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set plan_cache_mode = force_generic_plan
as $$
begin
    perform lockstep._check_manages(job);
    if not pg_catalog.pg_try_advisory_xact_lock(pg_catalog.hashtext('lockstep'), pg_catalog.hashtext('run_log')) then
        return;
    end if;
    keep := greatest(keep, coalesce((select t.run_log_keep from lockstep.setting t), interval '14 days'));
    max_per_job := greatest(max_per_job, coalesce((select t.run_log_max_per_job from lockstep.setting t), 1000));
    run_no := least(run_no, coalesce((select s.runs from lockstep.job_state s where s.job = _prune_run_log.job), 0));
    delete from lockstep.run_log l
    where l.id in (select o.id from lockstep.run_log o
                   where o.finished_at < now() - keep order by o.finished_at limit 10);
    delete from lockstep.run_log l
    where l.id in (select o.id from lockstep.run_log o
                   where o.job = _prune_run_log.job
                     and o.run_no > _prune_run_log.run_no - max_per_job - 10
                     and o.run_no <= _prune_run_log.run_no - max_per_job
                     and not lockstep._spared_run(o.job, o.action, o.run_no, max_per_job)
                   order by o.run_no limit 10);
    if action = 'recompute' then  -- the recompute lockstep._spared_run spared until now (below the window)
        delete from lockstep.run_log l
        where l.id in (select o.id from lockstep.run_log o
                       where o.job = _prune_run_log.job and o.run_no <= _prune_run_log.run_no - max_per_job
                         and o.action = 'recompute'
                       order by o.run_no limit 10);
    end if;
end;
$$;
comment on function lockstep._prune_run_log(text, bigint, interval, integer, text) is
    'Delete at most 10 rows older than keep and job''s rows that just fell off its max_per_job newest '
    '(lockstep._spared_run spared), never beyond lockstep.setting''s retention or job''s run count. One '
    'pruner at a time. Locks: the advisory lock (lockstep, run_log), '
    'transaction-level, without waiting (not taken: no prune); then the run_log rows it deletes (no '
    'application touches them).';

-- lockstep._log_run(j, action, outcome, started, p, error): append the run just recorded in j's status row
-- to lockstep.run_log, then prune. Never fails the run: any error is a WARNING and the run is not logged.
-- Called by lockstep._finish, a security definer function: the owner, lock group and kind logged are the
-- registry's, not the caller's j; a job that is not in the registry is not logged.
-- locks: reads the job's status row (already locked by lockstep._finish); inserts one run_log row; then as
-- lockstep._prune_run_log.
create or replace function lockstep._log_run(j lockstep.job, action text, outcome text, started timestamptz,
                                  p lockstep._pass default null, error text default null)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    s lockstep.job_state;
    v_keep interval;
    v_max integer;
begin
    begin
        select t.run_log_keep, t.run_log_max_per_job into v_keep, v_max from lockstep.setting t;
        v_keep := coalesce(v_keep, interval '14 days');   -- the setting row deleted: the defaults
        v_max := coalesce(v_max, 1000);
        select * into s from lockstep.job_state st where st.job = j.job;
        select x.owner_id, x.lock_group, x.kind into j.owner_id, j.lock_group, j.kind
        from lockstep.job x where x.job = j.job;
        if v_max > 0 and found then  -- no history of a job that does not exist
            insert into lockstep.run_log (job, owner, owner_id, lock_group, kind, action, outcome, started_at,
                                          finished_at, duration_ms, compute_ms, write_ms, inserted, updated,
                                          deleted, skipped, gone, failed_keys, error, run_no, role)
            values (j.job, pg_catalog.pg_get_userbyid(j.owner_id), j.owner_id, j.lock_group, j.kind, action, outcome, started,
                    coalesce(s.last_finished_at, clock_timestamp()),
                    coalesce(s.last_duration_ms, extract(epoch from clock_timestamp() - started) * 1000),
                    p.compute_ms, p.write_ms,
                    coalesce(p.inserted, 0), coalesce(p.updated, 0), coalesce(p.deleted, 0),
                    coalesce(cardinality(p.skipped), 0), coalesce(p.gone, 0),
                    coalesce(cardinality(p.failed), 0),
                    coalesce(error, case when cardinality(p.failed) > 0 then
                        pg_catalog.format('%s key(s) failed, first %s: %s',
                                          cardinality(p.failed), p.failed[1], p.errors[1]) end),
                    coalesce(s.runs, 0), lockstep._caller());
        end if;
        perform lockstep._prune_run_log(j.job, coalesce(s.runs, 0), v_keep, v_max, action);
    exception when others then
        raise warning 'lockstep: run of job "%" not logged in lockstep.run_log: %', j.job, sqlerrm
            using hint = 'lockstep.run_log is written by lockstep._finish, for a role that manages the job.';
    end;
end;
$$;
comment on function lockstep._log_run(lockstep.job, text, text, timestamp with time zone, lockstep._pass, text) is
    'Append the run just recorded in j''s status row to lockstep.run_log, then prune. Never fails the '
    'run: any error is a WARNING and the run is not logged. Locks: reads the job''s status row (already '
    'locked by lockstep._finish); inserts one run_log row; then as lockstep._prune_run_log.';
