-- lockstep: the one lock of a lock group, and when a run may take it.

-- lockstep._try_lock(lock_group): the one lock of a lock group, without waiting.
-- locks: the group's transaction-level advisory lock (released at commit, rollback or disconnect).
create or replace function lockstep._try_lock(lock_group text) returns boolean
language plpgsql volatile strict
set search_path = pg_catalog, pg_temp
as $$
begin
    return pg_catalog.pg_try_advisory_xact_lock(pg_catalog.hashtextextended('lockstep:' || lock_group, 0));
end;
$$;

-- lockstep._wait_lock(lock_group): the one lock of a lock group, waiting for the pass or batch that holds
-- it (the session's lock_timeout applies). Only for lockstep.retry, an operator's call: holding the lock
-- first, it never holds a key_failure row a worker pass waits for while it waits for one the pass holds.
-- locks: the group's transaction-level advisory lock (released at commit, rollback or disconnect).
create or replace function lockstep._wait_lock(lock_group text) returns void
language plpgsql volatile strict
set search_path = pg_catalog, pg_temp
as $$
begin
    perform pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtextextended('lockstep:' || lock_group, 0));
end;
$$;

comment on function lockstep._wait_lock(text) is
    'The one lock of a lock group, waiting for the pass or batch that holds it; only for lockstep.retry. '
    'Locks: the group''s transaction-level advisory lock.';
comment on function lockstep._try_lock(text) is
    'The one lock of a lock group, without waiting. Locks: the group''s transaction-level advisory lock '
    '(released at commit, rollback or disconnect).';

-- lockstep._group_due(lock_group): a periodic part of a job of the group is due (rule 7: a worker gives
-- way to it); a job overdue by more than a minute is not waited for.
create or replace function lockstep._group_due(lock_group text) returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return exists (
        select from lockstep.job j join lockstep.job_state s on s.job = j.job
        where j.lock_group = _group_due.lock_group
          and s.next_run_at <= now()
          and s.next_run_at > now() - interval '1 minute');
end;
$$;

-- lockstep._not_due(state): not_due or backoff, for a periodic part that is not due yet.
create or replace function lockstep._not_due(s lockstep.job_state) returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select case when (s.consecutive_failures > 0 and s.last_outcome = 'failed') or s.recompute_error is not null
                then 'backoff' else 'not_due' end;
$$;

-- lockstep._flag_due(s): a recompute flag makes a derived job's recompute due now, unless a failed
-- recompute's backoff or a poisoned recompute's hold (recompute_poisoned_at) holds it back.
create or replace function lockstep._flag_due(s lockstep.job_state) returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select s.consecutive_failures = 0 and s.recompute_error is null and s.recompute_poisoned_at is null
           and exists (select from lockstep.recompute_flag f where f.job = s.job);
$$;

-- lockstep._is_statement_timeout(started): a query_canceled error came from statement_timeout (recorded
-- as a failure with backoff) rather than from a cancel request (re-raised: the runner is shutting down).
create or replace function lockstep._is_statement_timeout(started timestamptz) returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select current_setting('statement_timeout') not in ('0', '0ms')
       and clock_timestamp() - statement_timestamp()
           >= current_setting('statement_timeout')::interval * 0.9;
$$;

-- lockstep._take(j, action, only_if_due): take j's group lock and re-read j's status row under it (another
-- runner may have run the job between our look and our lock). refused: the result to return instead of
-- running (busy: the lock is taken; not_due or backoff: only_if_due and the periodic part is not due);
-- NULL fields otherwise. started: when the run starts (after the lock).
-- locks: the group lock (try).
create or replace function lockstep._take(j lockstep.job, action text, only_if_due boolean,
                               out refused lockstep.result, out s lockstep.job_state, out started timestamptz)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if not lockstep._try_lock(j.lock_group) then
        refused := lockstep._result('busy', j.job, action);
        return;
    end if;
    select * into s from lockstep.job_state st where st.job = j.job;
    if only_if_due and s.next_run_at > now() then
        refused := lockstep._result(lockstep._not_due(s), j.job, action);
        return;
    end if;
    started := clock_timestamp();
end;
$$;
comment on function lockstep._take(lockstep.job, text, boolean) is
    'Take j''s group lock and re-read j''s status row under it (another runner may have run the job '
    'between our look and our lock). refused: the result to return instead of running (busy: the lock is '
    'taken; not_due or backoff: only_if_due and the periodic part is not due); NULL fields otherwise. '
    'started: when the run starts (after the lock). Locks: the group lock (try).';
