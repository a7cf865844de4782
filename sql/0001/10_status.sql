-- lockstep 0001: what operators and the runner read. Views and the runner's due query; nothing here locks.

-- one row per job.
create view lockstep.status with (security_invoker = true) as
select j.job,
       j.kind,
       j.lock_group,
       (select count(*) from lockstep.queue q
        where q.job = j.job
          and not exists (select from lockstep.key_failure f where f.job = q.job and f.key = q.key and f.parked))
           as queue_depth,
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
       case when h.todo > 0 then s.recompute_total - h.todo end as recompute_done,
       case when h.todo > 0 then s.recompute_total end as recompute_total,
       (select min(f.flagged_at) from lockstep.recompute_flag f where f.job = j.job) as needs_recompute,
       (select f.problem from lockstep.recompute_flag f where f.job = j.job order by f.flagged_at desc limit 1)
           as trigger_problem
from lockstep.job j
join lockstep.job_state s on s.job = j.job
left join lateral (
    select count(distinct q.key) as todo from lockstep.queue q
    where s.recompute_total is not null
      and q.job = j.job and q.id between s.recompute_queue_from and s.recompute_queue_to
      and not exists (select from lockstep.key_failure f where f.job = q.job and f.key = q.key and f.parked)
) h on true;

-- keys set aside after max_attempts failures; lockstep.retry(job, keys) puts them back.
create view lockstep.parked_keys with (security_invoker = true) as
select f.job, f.key, f.attempts, f.last_error, f.first_failed_at, f.last_failed_at
from lockstep.key_failure f
where f.parked;

-- every failing key: parked, or waiting for its next attempt.
create view lockstep.failing_keys with (security_invoker = true) as
select f.job, f.key, f.attempts, f.last_error, f.first_failed_at, f.last_failed_at, f.retry_at, f.parked
from lockstep.key_failure f;

-- lockstep.due(jobs): when each job next has something to do (the runner's one query per tick).
--   generic and parentless jobs: next_run_at; a job flagged for its recompute (lockstep.recompute_flag): now;
--   derived jobs: the earlier of next_run_at and, if ready keys are queued, now (or the worker's retry_at);
--   also the earliest retry of a failing key that still has queue entries, and when the earliest deferred
--   entry is ready (a key skipped because an application held its parent: job_state.deferred_until, so no
--   read of the queue beyond its first ready entry).
-- jobs: restrict to these names (NULL: all).
-- locks: nothing.
create function lockstep.due(jobs text[] default null)
returns table (job text, lock_group text, due_at timestamptz)
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select j.job, j.lock_group,
           least(s.next_run_at,
                 case when j.kind = 'derived' and s.consecutive_failures = 0
                       and exists (select from lockstep.recompute_flag f where f.job = j.job) then now() end,
                 case when j.parent is not null and lockstep._has_ready(j)
                      then greatest(now(), coalesce(s.retry_at, now())) end,
                 case when j.parent is not null then
                      (select case when min(f.retry_at) is not null
                                   then greatest(min(f.retry_at), coalesce(s.retry_at, now())) end
                       from lockstep.key_failure f
                       where f.job = j.job and not f.parked
                         and exists (select from lockstep.queue q where q.key = f.key and (q.job = f.job) is true)) end,
                 case when j.parent is not null then
                      case when s.deferred_until > now() then s.deferred_until end end)
    from lockstep.job j
    join lockstep.job_state s on s.job = j.job
    where jobs is null or j.job = any(jobs)
    order by 3, 1;
$$;
