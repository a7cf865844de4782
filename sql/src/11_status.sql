-- lockstep: what operators and the runner read. Views and the runner's due query; nothing here locks.

-- lockstep._queue_depth(job): the job's queue entries, those of parked keys aside. A function with JIT off,
-- read by lockstep.status: as a subquery of the view, its estimate (the queue's statistics stay at a past
-- size: VACUUM extrapolates over the emptied pages it skips) passed jit_above_cost, and each read of the view
-- compiled ~80 functions: 285-360 ms against 0.5 ms, on an empty queue that once held 500,000 entries.
-- locks: nothing.
create or replace function lockstep._queue_depth(job text) returns bigint
language sql stable
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select count(*) from lockstep.queue q
    where q.job = _queue_depth.job
      and not exists (select from lockstep.key_failure f where f.job = q.job and f.key = q.key and f.parked);
$$;

-- lockstep._handoff_todo(job, from_id, to_id): distinct keys of a recompute's hand-off (queue ids from_id
-- to to_id) still queued, those of parked keys aside. JIT off, as lockstep._queue_depth.
-- locks: nothing.
create or replace function lockstep._handoff_todo(job text, from_id bigint, to_id bigint) returns bigint
language sql stable
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select count(distinct q.key) from lockstep.queue q
    where q.job = _handoff_todo.job and q.id between from_id and to_id
      and not exists (select from lockstep.key_failure f where f.job = q.job and f.key = q.key and f.parked);
$$;

-- lockstep._handoff_any(job, from_id, to_id): lockstep._handoff_todo(job, from_id, to_id) > 0, stopping at
-- the first entry: lockstep._hand_off runs it with a batch's row locks held.
-- locks: nothing.
create or replace function lockstep._handoff_any(job text, from_id bigint, to_id bigint) returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select exists (select from lockstep.queue q
                   where q.job = _handoff_any.job and q.id between from_id and to_id
                     and not exists (select from lockstep.key_failure f
                                     where f.job = q.job and f.key = q.key and f.parked));
$$;

-- lockstep._queue_lag(job): how long ago the job's oldest queue entry was enqueued (parked keys' entries
-- aside; NULL: none). Its lowest id, by the primary key (job, id): ids grow with time, so the first entry
-- not of a parked key is the oldest, and no other entry is read. An alert on it catches a queue nothing
-- drains (no runner, or a runner whose failures cannot be recorded: a read-only session). JIT off, as
-- lockstep._queue_depth.
-- locks: nothing.
create or replace function lockstep._queue_lag(job text) returns interval
language sql stable
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select now() - q.enqueued_at from lockstep.queue q
    where q.job = _queue_lag.job
      and not exists (select from lockstep.key_failure f where f.job = q.job and f.key = q.key and f.parked)
    order by q.id limit 1;
$$;

-- lockstep._state_gone(owner): for a job of owner whose status row the current role does not see: the row
-- is gone (deleted by hand), not hidden by row-level security, because the role manages the job
-- (lockstep._may_manage, 11_privileges.sql: PL/pgSQL binds it at the first call).
-- locks: nothing.
create or replace function lockstep._state_gone(owner name) returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return lockstep._may_manage(owner);
end;
$$;

-- one row per job.
create or replace view lockstep.status with (security_invoker = true) as
select j.job,
       j.kind,
       j.lock_group,
       lockstep._queue_depth(j.job) as queue_depth,
       (select count(*) from lockstep.key_failure f where f.job = j.job and f.parked) as parked_keys,
       (select count(*) from lockstep.key_failure f where f.job = j.job and not f.parked) as failing_keys,
       s.last_outcome,
       s.last_action,
       s.last_started_at,
       s.last_finished_at,
       s.last_duration_ms,
       s.last_inserted,
       s.last_updated,
       s.last_deleted,
       s.last_skipped,
       s.consecutive_failures,
       s.last_error,
       s.recompute_error,
       s.next_run_at,
       s.retry_at,
       s.runs,
       coalesce(j.call, j.compute) as function,
       j.target,
       j.parent,
       j.every,
       j.backoff,
       j.max_attempts,
       -- a recompute spread over transactions: parents done / changed, until the worker has taken the
       -- hand-off (its queue entries still there, parked ones aside); NULL when none is in progress
       case when h.todo > 0 then s.recompute_total - h.todo
            when s.recompute_rest > 0 then s.recompute_total - s.recompute_rest end as recompute_done,
       case when h.todo > 0 or s.recompute_rest > 0 then s.recompute_total end as recompute_total,
       (select min(f.flagged_at) from lockstep.recompute_flag f where f.job = j.job) as needs_recompute,
       (select f.problem from lockstep.recompute_flag f where f.job = j.job order by f.flagged_at desc limit 1)
           as trigger_problem,
       lockstep._queue_lag(j.job) as queue_lag,
       -- its flags held since a recompute met poison parents, until they are cured (written again), the
       -- next periodic recompute or lockstep.retry(job): "flagged" alone left an operator nothing to act on
       -- (found by a review)
       s.recompute_poisoned_at as recompute_held_since
from lockstep.job j
-- a status row deleted by hand: the job is shown (and due: run() makes the row again) to the roles that
-- manage it; to others a missing row is one row-level security hides, as before
left join lockstep.job_state s on s.job = j.job
cross join lateral (
    select case when s.recompute_total is not null
                then lockstep._handoff_todo(j.job, s.recompute_queue_from, s.recompute_queue_to) end as todo
) h
where s.job is not null or lockstep._state_gone(j.owner);

-- keys set aside after max_attempts failures; lockstep.retry(job, keys) puts them back.
create or replace view lockstep.parked_keys with (security_invoker = true) as
select f.job, f.key, f.attempts, f.last_error, f.first_failed_at, f.last_failed_at
from lockstep.key_failure f
where f.parked;

-- every failing key: parked, or waiting for its next attempt (retry_at). A parked key is tried again only
-- when it is queued again (then not before its retry_at, shown: an operator saw nothing of a fix waiting
-- for it; a review), or by retry().
create or replace view lockstep.failing_keys with (security_invoker = true) as
select f.job, f.key, f.attempts, f.last_error, f.first_failed_at, f.last_failed_at,
       case when not f.parked
                 or exists (select from lockstep.queue q where q.key = f.key and (q.job = f.job) is true
                            and q.id > f.failed_upto)
            then f.retry_at end as retry_at, f.parked
from lockstep.key_failure f;

-- lockstep.due(jobs): when each job next has something to do (the runner's one query per tick).
--   generic and parentless jobs: next_run_at; a job flagged for its recompute (lockstep.recompute_flag): now;
--   derived jobs: the earlier of next_run_at and, if ready keys are queued, now (or the worker's retry_at);
--   also the earliest retry of a failing key that still has queue entries (a parked key: entries queued
--   since it was parked), and when the earliest deferred
--   entry is ready (a key skipped because an application held its parent: job_state.deferred_until, so no
--   read of the queue beyond its first ready entry).
-- jobs: restrict to these names (NULL: all).
-- gather: after a worker pass of a derived job that ended well and left no backlog behind (by any
--   runner; a full pass that left another full batch ready opens no window: lockstep._work), its ready
--   keys are due only gather after that pass
--   ended (lockstep run --batch-wait): keys that arrive meanwhile gather for one larger pass (a server
--   clock stepped back delays them no longer). NULL (the default): at once. Kept in the job's status row,
--   so several runners make the passes one runner would: with a window per runner, two runners made
--   261-285 passes in a 30 s round of bench oltp, 108-110 with this one (each pass has a fixed cost).
-- locks: nothing.
create or replace function lockstep.due(jobs text[] default null, gather interval default null)
returns table (job text, lock_group text, due_at timestamptz)
language sql stable
set search_path = pg_catalog, pg_temp
set jit = off  -- lockstep._no_jit_note (03_helpers.sql)
as $$
    select j.job, j.lock_group,
           least(s.next_run_at,
                 case when s.job is null then now() end,  -- its status row deleted by hand: run() makes it again
                 case when j.kind = 'derived' and lockstep._flag_due(s) then now() end,
                 case when j.parent is null and s.recompute_rest > 0 then now() end,
                 case when j.parent is not null and lockstep._has_ready(j)
                      then greatest(now(), coalesce(s.retry_at, now()),
                                    case when s.last_action = 'work' and s.last_outcome = 'done'
                                              and not coalesce(s.last_more, false)
                                         then least(s.last_finished_at, now()) + gather end) end,
                 case when j.parent is not null then
                      (select case when min(f.retry_at) is not null
                                   then greatest(min(f.retry_at), coalesce(s.retry_at, now())) end
                       from lockstep.key_failure f
                       where f.job = j.job
                         and exists (select from lockstep.queue q where q.key = f.key and (q.job = f.job) is true
                                     and (not f.parked or q.id > f.failed_upto))) end,  -- as lockstep._claim
                 case when j.parent is not null then
                      case when s.deferred_until > now() then s.deferred_until end end)
    from lockstep.job j
    left join lockstep.job_state s on s.job = j.job  -- a row deleted by hand, as in lockstep.status
    where (jobs is null or j.job = any(jobs)) and (s.job is not null or lockstep._state_gone(j.owner))
    order by 3, 1;
$$;
