-- lockstep 0001: the incremental worker: claim queued keys, apply them, isolate poison keys; retry.

-- lockstep._add(a, b): sum two passes.
-- locks: nothing.
create function lockstep._add(a lockstep._pass, b lockstep._pass) returns lockstep._pass
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select row(a.inserted + b.inserted, a.updated + b.updated, a.deleted + b.deleted, a.skipped || b.skipped,
               a.gone + b.gone, a.compute_ms + b.compute_ms, a.write_ms + b.write_ms,
               a.failed || b.failed, a.errors || b.errors)::lockstep._pass;
$$;

-- lockstep._isolate(j, keys, error): apply keys, bisecting on failure until the failing keys are alone.
-- error: the batch is already known to fail with this message (skip the first attempt).
-- locks: as lockstep._write, once per part that succeeds; each attempt is a subtransaction, so a failed
-- part leaves nothing behind.
create function lockstep._isolate(j lockstep.job, keys text[], error text default null) returns lockstep._pass
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    n integer := cardinality(keys);
    v_err text := error;
begin
    if v_err is null then
        begin
            return lockstep._apply(j, keys);
        exception when others then
            get stacked diagnostics v_err = message_text;
        end;
    end if;
    if n = 1 then
        return row(0, 0, 0, '{}', 0, 0, 0, keys, array[v_err])::lockstep._pass;
    end if;
    return lockstep._add(lockstep._isolate(j, keys[1:n / 2]), lockstep._isolate(j, keys[n / 2 + 1:n]));
end;
$$;

-- lockstep._has_ready(j): j has queue entries that are ready, whose key is neither parked nor waiting
-- for a retry.
-- locks: nothing.
create function lockstep._has_ready(j lockstep.job) returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (
        select from lockstep.queue q
        where q.job = j.job and q.ready_at <= now()
          and not exists (select from lockstep.key_failure f
                          where f.job = q.job and f.key = q.key and (f.parked or f.retry_at > now())));
$$;

-- lockstep._work(j, batch): one incremental pass.
-- locks, in this order: nothing until there is work (idle) and no periodic job of the group is due
-- (busy: give way); the group lock (try: busy if taken); then, through lockstep._write, the parents of the
-- claimed keys' rows (FOR KEY SHARE SKIP LOCKED, key order) and the target's rows (key order); then
-- lockstep's own rows: the processed queue entries (deleted), the key_failure rows; the status row last.
create function lockstep._work(j lockstep.job, batch integer) returns lockstep.result
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    s lockstep.job_state;
    v_started timestamptz;
    v_keys text[];
    v_ids bigint[];
    v_leave text[];
    v_err text;
    p lockstep._pass;
begin
    select * into s from lockstep.job_state st where st.job = j.job;
    if s.retry_at > now() then
        return lockstep._result('backoff', j.job, 'work', null, s.last_error);
    end if;
    if lockstep._group_due(j.lock_group) then
        return lockstep._result('busy', j.job, 'work', null, 'a periodic job of the lock group is due');
    end if;
    if not lockstep._has_ready(j) then
        return lockstep._result('idle', j.job, 'work');
    end if;
    if not lockstep._try_lock(j.lock_group) then
        return lockstep._result('busy', j.job, 'work');
    end if;
    v_started := clock_timestamp();

    -- claim: the oldest ready entries give up to batch distinct keys; every visible entry of those keys
    -- goes with them (a key enqueued many times is computed once). Entries appended after this snapshot
    -- stay queued for the next pass.
    select array_agg(distinct c.key) into v_keys
    from (select q.key from lockstep.queue q
          where q.job = j.job and q.ready_at <= now()
            and not exists (select from lockstep.key_failure f
                            where f.job = q.job and f.key = q.key and (f.parked or f.retry_at > now()))
          order by q.id limit batch) c;
    if v_keys is null then
        return lockstep._result('idle', j.job, 'work');
    end if;
    select array_agg(q.id) into v_ids from lockstep.queue q where q.job = j.job and q.key = any(v_keys);
    execute pg_catalog.format('select array_agg(k::text order by k) from pg_catalog.unnest($1::%s) k',
                              lockstep._array_type(j.key_type)) into v_keys using v_keys;

    begin
        p := lockstep._apply(j, v_keys);
    exception
        when query_canceled then
            if not lockstep._is_statement_timeout(v_started) then
                raise;
            end if;
            get stacked diagnostics v_err = message_text;
            return lockstep._failed(j, 'work', v_started, v_err);
        when others then
            get stacked diagnostics v_err = message_text;
            -- the job itself is broken (every key would fail) or some keys are poison: an empty pass tells.
            begin
                perform lockstep._apply(j, '{}'::text[]);
            exception when others then
                return lockstep._failed(j, 'work', v_started, v_err);
            end;
            p := lockstep._isolate(j, v_keys, v_err);
    end;

    -- lockstep's own rows, after the target's
    v_leave := p.skipped || p.failed;
    delete from lockstep.queue q where q.job = j.job and q.id = any(v_ids) and q.key <> all(v_leave);
    -- a parent an application holds is retried a second later, not in a hot loop
    update lockstep.queue q set ready_at = now() + interval '1 second'
    where q.job = j.job and q.id = any(v_ids) and q.key = any(p.skipped);
    delete from lockstep.key_failure f where f.job = j.job and f.key = any(v_keys) and f.key <> all(v_leave);
    insert into lockstep.key_failure as f (job, key, attempts, last_error, retry_at, parked)
    select j.job, x.k, 1, x.e, now() + least(j.backoff, interval '2 seconds'), j.max_attempts <= 1
    from unnest(p.failed, p.errors) as x(k, e)
    order by x.k
    on conflict (job, key) do update
        set attempts = f.attempts + 1, last_error = excluded.last_error, last_failed_at = now(),
            retry_at = now() + least(j.backoff, interval '1 second' * power(2, least(f.attempts + 1, 20))),
            parked = f.attempts + 1 >= j.max_attempts;
    v_err := case when cardinality(p.failed) > 0 then
        pg_catalog.format('%s key(s) failed, first %s: %s', cardinality(p.failed), p.failed[1], p.errors[1]) end;
    perform lockstep._finish(j, 'work', 'done', v_started, p, null);
    return lockstep._result('done', j.job, 'work', p, v_err, lockstep._has_ready(j));
end;
$$;

-- lockstep.work(job, batch): one incremental pass over up to batch queued parents.
-- locks: as lockstep._work.
create function lockstep.work(job text, batch integer default 500) returns lockstep.result
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    perform lockstep._check_isolation('lockstep.work()');
    if batch is null or batch < 1 then
        raise exception 'lockstep: batch must be a positive integer (got %)', coalesce(batch::text, 'NULL')
            using errcode = '22023';
    end if;
    return lockstep._work(lockstep._queue_job(job), batch);
end;
$$;

-- lockstep._retry(j, keys): forget the failures of keys (NULL: all of j's), queue them again, and end the
-- job's failure backoff, if its last run failed: the worker may run at once (retry_at) and the periodic
-- recompute is due now (next_run_at). A job whose last run did not fail keeps its schedule.
-- locks: the job's key_failure rows of those keys (deleted); appends to the queue; then, if its last run
-- failed, the job's lockstep.job_state row (FOR NO KEY UPDATE, by the update).
create function lockstep._retry(j lockstep.job, keys text[]) returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_keys text[];
begin
    with d as (delete from lockstep.key_failure f
               where f.job = j.job and (keys is null or f.key = any(keys)) returning f.key)
    select array_agg(d.key) into v_keys from d;
    perform lockstep._enqueue_text(j, v_keys);
    update lockstep.job_state s set retry_at = null, next_run_at = least(s.next_run_at, now())
    where s.job = j.job and s.consecutive_failures > 0 and s.last_outcome = 'failed';
    return coalesce(cardinality(v_keys), 0);
end;
$$;

-- lockstep.retry(job, keys): put these failing or parked keys back in the queue now. Returns how many.
-- locks: as lockstep._retry.
create function lockstep.retry(job text, keys anyarray) returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    j lockstep.job := lockstep._queue_job(job);
begin
    return lockstep._retry(j, lockstep._keys_text(j, keys));
end;
$$;

-- lockstep.retry(job): put every failing or parked key of job back in the queue now.
-- locks: as lockstep._retry.
create function lockstep.retry(job text) returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    return lockstep._retry(lockstep._queue_job(job), null);
end;
$$;

-- lockstep.set_max_attempts(job, max_attempts): failures of one key before it is parked (default 5).
-- locks: the job's registry row.
create function lockstep.set_max_attempts(job text, max_attempts integer) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    j lockstep.job := lockstep._queue_job(job);
begin
    if max_attempts is null or max_attempts < 1 then
        raise exception 'lockstep: max_attempts must be a positive integer' using errcode = '22023';
    end if;
    perform lockstep._check_owner(j);
    update lockstep.job x set max_attempts = set_max_attempts.max_attempts, updated_at = now() where x.job = j.job;
end;
$$;
