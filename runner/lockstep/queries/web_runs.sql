-- The web page's recent runs (lockstep.run_log, newest first; row security hides other owners' runs).
select r.id, r.job, r.action, r.outcome, r.started_at, r.finished_at, r.duration_ms,
       r.inserted, r.updated, r.deleted, r.skipped, r.failed_keys, r.error
from lockstep.run_log r
order by r.id desc
limit %(limit)s
