-- lockstep: what operators and the runner read. Views and the runner's due query; nothing here locks.

-- lockstep._queue_depth(job): the job's queue entries, a failing key's among them (its failing pass folded
-- the entries it saw into one). A function with JIT off: as a subquery of lockstep.status, stale
-- statistics made every read of the view compile.
create or replace function lockstep._queue_depth(job text) returns bigint
language sql stable
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select count(*) from lockstep.queue q where q.job = _queue_depth.job;
$$;

-- lockstep._handoff_todo(job, from_id, to_id): distinct keys of a recompute's hand-off (queue ids from_id
-- to to_id) still queued, those of parked keys aside. JIT off, as lockstep._queue_depth.
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

-- lockstep._handoff_pending(s): some parents the job's last recompute handed to the worker are still queued
-- (parked keys aside): its recompute flags wait meanwhile (lockstep.run, lockstep.due), so flags at every
-- call cannot starve the hand-off.
create or replace function lockstep._handoff_pending(s lockstep.job_state) returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select s.recompute_total is not null
           and lockstep._handoff_any(s.job, s.recompute_queue_from, s.recompute_queue_to);
$$;

-- lockstep._stall_passes(job, since): the job's worker passes done that started after since (lockstep.run_log,
-- up to 100): a function of its own, called only by a role that may read run_log.
create or replace function lockstep._stall_passes(job text, since timestamptz) returns bigint
language sql stable
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select count(*) from (select from lockstep.run_log r
                          where r.job = _stall_passes.job and r.action = 'work' and r.outcome = 'done'
                            and r.started_at > since
                          order by r.run_no desc limit 100) x;
$$;

-- lockstep._stall(job): the job's oldest queue entry a worker pass should take now (ready; its key not
-- failing, or failing and due, and not the entry a failing pass folded the ones it saw into): since when
-- it has been ready, and how many of the job's worker passes started since (NULL for a role that may not
-- read lockstep.run_log). Each pass takes the oldest such entries first, so passes, or time, going by
-- while it stays is a stall.
create or replace function lockstep._stall(job text, out since timestamptz, out passes bigint)
language sql stable
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select w.since, case when pg_catalog.has_table_privilege('lockstep.run_log', 'select')
                         then lockstep._stall_passes(_stall.job, w.since) end
    from (select greatest(q.ready_at, f.retry_at) as since
          from lockstep.queue q
          left join lockstep.key_failure f on f.job = q.job and f.key = q.key
          where q.job = _stall.job and q.ready_at <= now()
            and (f.key is null or (f.retry_at <= now() and not (f.parked and q.id = f.failed_upto)))
          order by q.id limit 1) w;
$$;

-- lockstep._queue_lag(job): how long ago the job's oldest queue entry was enqueued, a failing key's among
-- them (its change waits too); NULL: none. An alert on it catches a queue nothing drains. JIT off.
create or replace function lockstep._queue_lag(job text) returns interval
language sql stable
set search_path = pg_catalog, pg_temp
set jit = off
as $$
    select now() - least(q.enqueued_at, now()) from lockstep.queue q  -- never negative
    where q.job = _queue_lag.job
    order by q.id limit 1;
$$;

-- lockstep._state_gone_id(owner): for a job of the role of oid owner (lockstep.job.owner_id) whose status
-- row the current role does not see: the row is gone, not hidden by row-level security, because the role
-- manages the job.
create or replace function lockstep._state_gone_id(owner oid) returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return lockstep._may_manage_id(owner);
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
       -- a recompute spread over transactions: parents done / changed; NULL when none is in progress
       case when h.todo > 0 then s.recompute_total - h.todo
            when s.recompute_rest > 0 then s.recompute_total - s.recompute_rest end as recompute_done,
       case when h.todo > 0 or s.recompute_rest > 0 then s.recompute_total end as recompute_total,
       (select min(f.flagged_at) from lockstep.recompute_flag f where f.job = j.job) as needs_recompute,
       (select f.problem from lockstep.recompute_flag f where f.job = j.job order by f.flagged_at desc limit 1)
           as trigger_problem,
       lockstep._queue_lag(j.job) as queue_lag,
       -- its flags held since a recompute met poison parents, until cured, the next periodic recompute or retry
       s.recompute_poisoned_at as recompute_held_since,
       -- lockstep.pause: when and by whom (NULL: not paused); depends_on: the jobs whose targets it reads
       j.paused_at,
       j.paused_by,
       array(select d.depends_on from lockstep._deps() d where d.job = j.job order by 1) as depends_on,
       -- the oldest entry a worker pass should take now: how long it has been ready, and how many worker
       -- passes started since (lockstep._stall; lockstep status bounds both)
       now() - w.since as stalled_for,
       w.passes as stalled_passes
from lockstep.job j
-- a status row deleted by hand: the job is shown (and due) to the roles that manage it
left join lockstep.job_state s on s.job = j.job
left join lateral (select * from lockstep._stall(j.job) st where j.parent is not null) w on true
cross join lateral (
    select case when s.recompute_total is not null
                then lockstep._handoff_todo(j.job, s.recompute_queue_from, s.recompute_queue_to) end as todo
) h
where s.job is not null or lockstep._state_gone_id(j.owner_id);

-- keys set aside after max_attempts failures; lockstep.retry(job, keys) puts them back.
create or replace view lockstep.parked_keys with (security_invoker = true) as
select f.job, f.key, f.attempts, f.last_error, f.first_failed_at, f.last_failed_at
from lockstep.key_failure f
where f.parked;

-- every failing key: parked, or waiting for its next attempt (retry_at). A parked key is tried again when
-- it is queued again (not before its retry_at), or by retry().
create or replace view lockstep.failing_keys with (security_invoker = true) as
select f.job, f.key, f.attempts, f.last_error, f.first_failed_at, f.last_failed_at,
       case when not f.parked
                 or exists (select from lockstep.queue q where q.key = f.key and (q.job = f.job) is true
                            and q.id <> f.failed_upto)
            then f.retry_at end as retry_at, f.parked
from lockstep.key_failure f;

-- lockstep.due(jobs, gather): when each job next has something to do (the runner's one query per tick);
-- jobs: these names (NULL: all); gather: ready keys wait that long after a pass that left no backlog.
-- Paused jobs (lockstep.pause) are never due ('infinity'). Ordered by depth in the graph of derived jobs
-- (lockstep._depths, 10_graph.sql), then by due time: a tick runs a job after the jobs whose targets it reads.
create or replace function lockstep.due(jobs text[] default null, gather interval default null)
returns table (job text, lock_group text, due_at timestamptz)
language sql stable
set search_path = pg_catalog, pg_temp
set jit = off  -- lockstep._no_jit_note (03_helpers.sql)
as $$
    select j.job, j.lock_group,
           case when j.paused_at is not null then 'infinity'::timestamptz else  -- lockstep.pause: never due
           least(s.next_run_at,
                 case when s.job is null then now() end,  -- its status row deleted by hand: run() makes it again
                 case when j.kind = 'derived' and lockstep._flag_due(s) and not lockstep._handoff_pending(s)
                      then now() end,
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
                                     and (not f.parked or q.id <> f.failed_upto))) end,  -- as lockstep._claim
                 case when j.parent is not null then
                      case when s.deferred_until > now() then s.deferred_until end end) end
    from lockstep.job j
    left join lockstep.job_state s on s.job = j.job  -- a row deleted by hand, as in lockstep.status
    left join lockstep._depths() d on d.job = j.job  -- 10_graph.sql
    where (jobs is null or j.job = any(jobs)) and (s.job is not null or lockstep._state_gone_id(j.owner_id))
    order by coalesce(d.depth, 0), 3, 1;
$$;
comment on function lockstep.due(text[], interval) is
    'When each job next has something to do (the runner''s one query per tick); jobs: these names (NULL: '
    'all); gather: ready keys wait that long after a pass that left no backlog. A paused job is never due '
    '(infinity); a job comes after the jobs whose targets it reads (lockstep._depths). Locks: nothing.';
