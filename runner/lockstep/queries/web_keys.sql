-- The web page's parked and failing keys: parked first, then the most recent failures; with the totals.
select f.job, f.key, f.attempts, f.parked, f.last_error, f.first_failed_at, f.last_failed_at, f.retry_at,
       count(*) over () as total
from lockstep.failing_keys f
order by f.parked desc, f.last_failed_at desc, f.job, f.key
limit %(limit)s
