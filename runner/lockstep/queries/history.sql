-- `lockstep status --history`: the newest runs (of one job, or all), oldest first.
select h.* from (
    select r.id, r.finished_at, r.job, r.action, r.outcome, r.duration_ms, r.inserted, r.updated,
           r.deleted, r.skipped, r.failed_keys, r.error, r.started_at, r.owner, r.role, r.pid, r.run_no,
           r.compute_ms, r.write_ms, r.gone, r.lock_group, r.kind
    from lockstep.run_log r
    where %(job)s::text is null or r.job = %(job)s
    order by r.id desc
    limit %(limit)s
) h
order by h.id
