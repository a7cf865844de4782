-- lockstep 0001: the periodic full recompute.

-- lockstep._recompute(j, only_if_due): the full recompute under the group lock.
-- locks: the group lock (try: busy if taken); then as lockstep._write for the whole table; then the
-- queue (skipped parents appended); the job's status row last.
create function lockstep._recompute(j lockstep.job, only_if_due boolean) returns lockstep.result
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    s lockstep.job_state;
    v_started timestamptz;
    v_err text;
    v_snap pg_snapshot;
    p lockstep._pass;
begin
    if not lockstep._try_lock(j.lock_group) then
        return lockstep._result('busy', j.job, 'recompute');
    end if;
    -- re-read under the lock: another runner may have run it between our look and our lock.
    select * into s from lockstep.job_state st where st.job = j.job;
    if only_if_due and s.next_run_at > now() then
        return lockstep._result(lockstep._not_due(s), j.job, 'recompute');
    end if;
    v_started := clock_timestamp();
    v_snap := pg_catalog.pg_current_snapshot();  -- flags this snapshot sees are covered by this recompute
    begin
        p := lockstep._apply(j, null);
    exception
        when query_canceled then
            if not lockstep._is_statement_timeout(v_started) then
                raise;
            end if;
            get stacked diagnostics v_err = message_text;
            return lockstep._failed(j, 'recompute', v_started, v_err);
        when others then
            get stacked diagnostics v_err = message_text;
            return lockstep._failed(j, 'recompute', v_started, v_err);
    end;
    if j.parent is not null and cardinality(p.skipped) > 0 then
        perform lockstep._enqueue_text(j, p.skipped);
    end if;
    perform lockstep._clear_flag(j, v_snap);
    perform lockstep._finish(j, 'recompute', 'done', v_started, p);
    return lockstep._result('done', j.job, 'recompute', p);
end;
$$;

-- lockstep.recompute(job): full recompute now, even if not due (and even during a failure backoff).
-- locks: as lockstep._recompute.
create function lockstep.recompute(job text) returns lockstep.result
language plpgsql
set search_path = pg_catalog, pg_temp
set datestyle = 'ISO, YMD'
set intervalstyle = 'postgres'
set extra_float_digits = 1
as $$
begin
    perform lockstep._check_isolation('lockstep.recompute()');
    return lockstep._recompute(lockstep._job(job, 'derived'), false);
end;
$$;
