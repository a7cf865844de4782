-- lockstep: generic scheduled jobs, lockstep.run() (the runner's entry point) and drop_job.

-- lockstep._check_schedule(job, lock_group, every, backoff): argument checks shared by define_*, and the
-- lock group free of jobs of roles the caller may not manage.
create or replace function lockstep._check_schedule(job text, lock_group text, every interval, backoff interval)
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
set intervalstyle = 'postgres'
as $$
declare
    g record;
    v_long boolean;
    v_blank text := case when pg_catalog.btrim(job, E' \t\n\r') = '' then job
                         when pg_catalog.btrim(lock_group, E' \t\n\r') = '' then lock_group end;
    -- a control character or bidirectional override in a name garbles every log line that shows it
    v_garbling constant text := '[[:cntrl:]\u2028\u2029\u202a-\u202e\u2066-\u2069]';
begin
    if job is null or every is null or backoff is null then
        raise exception 'lockstep: job, every and backoff must not be NULL' using errcode = '22004';
    end if;
    if v_blank is not null then
        raise exception 'lockstep: job and lock_group must not be empty or blank strings (got %)',
            pg_catalog.quote_literal(v_blank) using errcode = '22023';
    end if;
    if job ~ v_garbling or lock_group ~ v_garbling then
        raise exception 'lockstep: job and lock_group must not contain control characters (got %)',
            pg_catalog.quote_literal(case when job ~ v_garbling then job else lock_group end)
            using errcode = '22023', hint = 'Choose a name of printable characters.';
    end if;
    if pg_catalog.octet_length(job) > 63 then
        raise exception 'lockstep: job names must be at most 63 bytes (got %)', pg_catalog.octet_length(job)
            using errcode = '22023', hint = 'Like an SQL identifier: choose a shorter name.';
    end if;
    -- positive in every part: '1 month -29 days' is above zero, yet can be in the past
    if every <= interval '0' or backoff <= interval '0' or every::text like '%-%' or backoff::text like '%-%' then
        raise exception 'lockstep: every and backoff must be positive intervals with no negative part (got every %, backoff %)',
            every, backoff using errcode = '22023';
    end if;
    -- a next_run_at past the year 294276 overflows: checked on timestamps (intervals count a month as 30 days)
    begin
        v_long := now() + every > now() + interval '100 years' or now() + backoff > now() + interval '100 years';
    exception when datetime_field_overflow then
        v_long := true;
    end;
    if v_long then
        raise exception 'lockstep: every and backoff must be at most 100 years (got every %, backoff %)',
            every, backoff using errcode = '22023';
    end if;
    -- the lock group free of other owners' jobs (lockstep._group_holder, 12_privileges.sql)
    if not pg_catalog.has_table_privilege('lockstep.job', 'SELECT') then
        return;
    end if;
    g := lockstep._group_holder(coalesce(lock_group, job), job);
    if g.holder is not null then
        raise exception 'lockstep: lock group "%" is used by job "%" of role "%"',
            coalesce(lock_group, job), g.holder, g.holder_owner
            using errcode = '42501', hint = 'Choose another lock_group: a group holds the jobs of one owner.';
    end if;
end;
$$;

-- lockstep._callable(f, nargs): the schema-qualified name by which f is called with its first nargs
-- arguments, after making sure that call resolves to f alone (else 42725 naming the overload).
create or replace function lockstep._callable(f regprocedure, nargs integer) returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    p pg_catalog.pg_proc;
    v_other text;
begin
    select * into p from pg_catalog.pg_proc x where x.oid = f;
    select pg_catalog.string_agg(q.oid::regprocedure::text, ', ' order by q.oid) into v_other
    from pg_catalog.pg_proc q
    where q.pronamespace = p.pronamespace and q.proname = p.proname and q.oid <> p.oid
      and q.pronargs >= nargs and q.pronargs - q.pronargdefaults <= nargs
      and (q.proargtypes::oid[])[0:nargs - 1] = (p.proargtypes::oid[])[0:nargs - 1];
    if v_other is not null then
        raise exception 'lockstep: a call of % with % argument(s) is ambiguous: % accepts it too', f, nargs, v_other
            using errcode = '42725',
                  hint = 'PostgreSQL resolves calls by name, and lockstep calls jobs and compute functions with no '
                         'argument (a job) or one (compute): rename or drop the overload, or define the job with another function.';
    end if;
    return pg_catalog.format('%I.%I', (select n.nspname from pg_catalog.pg_namespace n where n.oid = p.pronamespace),
                             p.proname);
end;
$$;

-- lockstep._check_isolation(what): raise 25000 unless READ COMMITTED: under REPEATABLE READ or
-- SERIALIZABLE, pinning a row changed since the snapshot raises 40001 instead of skipping it.
create or replace function lockstep._check_isolation(what text) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if pg_catalog.current_setting('transaction_isolation') not in ('read committed', 'read uncommitted') then
        raise exception 'lockstep: % needs a READ COMMITTED transaction, this one is %', what,
            pg_catalog.upper(pg_catalog.current_setting('transaction_isolation'))
            using errcode = '25000',
                  hint = 'Call it in its own transaction: begin isolation level read committed; select ...; commit; '
                         '(the runner does this whatever default_transaction_isolation says).';
    end if;
end;
$$;

-- lockstep._check_timeout(timeout): a job's time limit is a positive interval statement_timeout can hold
-- (it takes milliseconds below 2^31: under 24 days); else 22023 (22004 for NULL).
create or replace function lockstep._check_timeout(timeout interval) returns void
language plpgsql immutable
set search_path = pg_catalog, pg_temp
set intervalstyle = 'postgres'
as $$
begin
    if timeout is null then
        raise exception 'lockstep: timeout must not be NULL' using errcode = '22004';
    end if;
    if timeout < interval '1 millisecond' or timeout >= interval '24 days' or timeout::text like '%-%' then
        raise exception 'lockstep: timeout must be at least 1 millisecond and under 24 days, with no negative part (got %)',
            timeout using errcode = '22023', hint = 'It is the statement_timeout a run of the job gets: e.g. ''5 minutes''.';
    end if;
end;
$$;

-- lockstep.set_time_limit(job): SET LOCAL statement_timeout to job's timeout, unless the session's own is
-- shorter. For the statement after it (PostgreSQL arms statement_timeout when a statement starts): the
-- runner sends it before lockstep.run(job), in the same transaction. A run over its limit is cancelled
-- and recorded as failed, with its backoff (lockstep._is_statement_timeout).
-- locks: nothing.
create or replace function lockstep.set_time_limit(job text) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_ms bigint := (select pg_catalog.ceil(extract(epoch from x.timeout) * 1000) from lockstep.job x
                    where x.job = set_time_limit.job);
    v_cur numeric := extract(epoch from pg_catalog.current_setting('statement_timeout')::interval) * 1000;
begin
    if v_ms is not null and (v_cur = 0 or v_ms < v_cur) then
        perform pg_catalog.set_config('statement_timeout', v_ms::text, true);
    end if;
end;
$$;

comment on function lockstep.set_time_limit(text) is
    'SET LOCAL statement_timeout to the job''s timeout, unless the session''s own is shorter, for the '
    'statement after this one (PostgreSQL arms statement_timeout when a statement starts): the runner sends '
    'it before lockstep.run(job). Locks: nothing.';

-- lockstep.define_job(job, call, lock_group, every, backoff): register or update a generic job: call, a
-- function callable with no argument, runs on schedule under the lock-group rules. Another call is due at once.
-- locks: the job's registry row (insert or update), then, on a redefinition, its status row.
create or replace function lockstep.define_job(job text, call regprocedure, lock_group text default null,
                                    every interval default '1 minute', backoff interval default '1 hour',
                                    timeout interval default '5 minutes')
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    p pg_catalog.pg_proc;
    old lockstep.job;
    v_new lockstep.job;
begin
    perform lockstep._check_schedule(job, lock_group, every, backoff);
    perform lockstep._check_timeout(timeout);
    if call is null then
        raise exception 'lockstep: call must not be NULL' using errcode = '22004';
    end if;
    perform lockstep._check_privileges(null, call, null);
    select * into p from pg_catalog.pg_proc where oid = call;
    if p.prokind <> 'f' then
        raise exception 'lockstep: % is not a plain function (procedures, aggregates and window functions cannot be jobs)',
            call using errcode = 'LSD02';
    end if;
    if p.pronargs - p.pronargdefaults <> 0 then
        raise exception 'lockstep: % needs % argument(s); a job function must be callable with none',
            call, p.pronargs - p.pronargdefaults using errcode = 'LSD02';
    end if;
    perform lockstep._callable(call, 0);
    select * into old from lockstep.job j where j.job = define_job.job;
    if found then
        perform lockstep._check_owner(old);
        if old.kind <> 'job' then
            raise exception 'lockstep: job "%" is a derived job; use lockstep.define_derived() or drop it first', job
                using errcode = 'LSJ02';
        end if;
    end if;
    -- another call is due now; a new every counts from the last run; the same every keeps next_run_at
    v_new.job := job;
    v_new.kind := 'job';
    v_new.owner := current_user;
    v_new.lock_group := coalesce(lock_group, job);
    v_new.call := call::text;
    v_new.every := every;
    v_new.backoff := backoff;
    v_new.timeout := timeout;
    perform lockstep._put_job(v_new);  -- security definer: the registry and status rows
end;
$$;
comment on function lockstep.define_job(text, regprocedure, text, interval, interval, interval) is
    'Register or update a generic job: call, a function callable with no argument, runs on schedule under'
    ' the lock-group rules. Another call is due at once. timeout: the longest a run may take (the runner''s'
    ' statement_timeout for it, lockstep.set_time_limit). Locks: the job''s registry row (insert or '
    'update), then, on a redefinition, its status row.';

-- lockstep._call(job): run a generic job's function once, as its owner (lockstep._as_owner), under the
-- group lock, recording the outcome.
-- locks: the group lock (try; busy if taken: lockstep._take); then whatever the job's function locks; the
-- status row last.
create or replace function lockstep._call(j lockstep.job, only_if_due boolean) returns lockstep.result
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    t record;
    r record;
begin
    select * into t from lockstep._take(j, 'call', only_if_due);
    if (t.refused).outcome is not null then
        return t.refused;
    end if;
    select * into r from lockstep._owner_pass(j, null, null, false);
    if r.error is not null then
        return lockstep._failed(j, 'call', t.started, r.error);
    end if;
    perform lockstep._finish(j, 'call', 'done', t.started);
    return lockstep._result('done', j.job, 'call');
end;
$$;
comment on function lockstep._call(lockstep.job, boolean) is
    'Run a generic job''s function once, as its owner (lockstep._as_owner), under the group lock, '
    'recording the outcome. Locks: the group lock (try; busy if taken: lockstep._take); then whatever the '
    'job''s function locks; the status row last.';

-- lockstep._restore_state(j): the job's status row, made again with defaults (recompute due now) where
-- it is gone; NULL (a row of NULLs) when the group is busy.
-- locks: the group lock (try); the new lockstep.job_state row (insert).
create or replace function lockstep._restore_state(j lockstep.job) returns lockstep.job_state
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    s lockstep.job_state;
begin
    perform lockstep._check_act_as(j);
    if not lockstep._try_lock(j.lock_group) then
        return s;
    end if;
    begin
        perform lockstep._state_make(j.job);
    exception when insufficient_privilege then
        raise exception 'lockstep: the status row of job "%" is gone (lockstep.job_state), and role % may not make it again',
            j.job, lockstep._caller()
            using errcode = '42501',
                  hint = pg_catalog.format('Run lockstep.define_%s(%L, ...) again as its owner, or grant the owner '
                                           'role to the runner (docs/security.md).',
                                           case when j.kind = 'job' then 'job' else 'derived' end, j.job);
    end;
    select * into s from lockstep.job_state st where st.job = j.job;
    return s;
end;
$$;
comment on function lockstep._restore_state(lockstep.job) is
    'The job''s status row, made again with defaults (recompute due now) where it is gone; NULL (a row of'
    ' NULLs) when the group is busy. Locks: the group lock (try); the new lockstep.job_state row '
    '(insert).';

-- lockstep._state_make(job): job's status row, with defaults (its recompute due now), if it has none.
-- Security definer, for a caller that manages job (42501): no recipe role holds INSERT on job_state.
-- locks: the new lockstep.job_state row (insert).
create or replace function lockstep._state_make(job text) returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    perform lockstep._check_manages(job);
    insert into lockstep.job_state (job) values (_state_make.job) on conflict do nothing;
end;
$$;
comment on function lockstep._state_make(text) is
    'Job''s status row, with defaults (its recompute due now), if it has none. Security definer, for a '
    'caller that manages job (42501). Locks: the new lockstep.job_state row (insert).';

-- lockstep.run(job): what the runner calls. Runs whatever part of the job is due: a generic job's
-- function; a derived job's recompute if due or flagged, else a worker pass over up to batch_parents keys.
-- A paused job (lockstep.pause): outcome paused, nothing written, its status row untouched.
-- locks: nothing while looking for work (but the group lock, try, when its status row is gone); then as
-- lockstep._call, lockstep.recompute or lockstep.work.
create or replace function lockstep._run_job(job text) returns lockstep.result
language plpgsql
set search_path = pg_catalog, pg_temp
set jit = off  -- lockstep._no_jit_note (03_helpers.sql)
set datestyle = 'ISO, YMD'
set intervalstyle = 'postgres'
set extra_float_digits = 1
as $$
declare
    j lockstep.job := lockstep._job(job);
    s lockstep.job_state;
    r lockstep.result;
begin
    perform lockstep._check_isolation('lockstep.run()');
    if j.paused_at is not null then  -- lockstep.pause (15_controls.sql): nothing written
        return lockstep._paused(j, case when j.kind = 'job' then 'call' else 'recompute' end);
    end if;
    select * into s from lockstep.job_state st where st.job = j.job;
    if not found then
        s := lockstep._restore_state(j);
        if s.job is null then
            return lockstep._result('busy', j.job, case when j.kind = 'job' then 'call' else 'recompute' end);
        end if;
    end if;
    if j.kind = 'job' then
        if s.next_run_at > now() then
            return lockstep._result(lockstep._not_due(s), j.job, 'call');
        end if;
        return lockstep._call(j, true);
    end if;
    if s.next_run_at <= now() then
        return lockstep._recompute(j, true);
    end if;
    -- a trigger fell back on flagging the job: its recompute is due now (lockstep._flag_due), once the
    -- worker has taken the last recompute's hand-off (lockstep._handoff_pending)
    if lockstep._flag_due(s) and not lockstep._handoff_pending(s) then
        return lockstep._recompute(j, false);
    end if;
    if j.parent is null then
        if s.recompute_rest is not null then  -- a recompute spread over transactions (07_recompute.sql)
            return lockstep._continue(j);
        end if;
        return lockstep._result(lockstep._not_due(s), j.job, 'recompute');
    end if;
    r := lockstep._work(j, j.batch_parents);
    if r.outcome = 'idle' and lockstep._not_due(s) = 'backoff' then
        r.outcome := 'backoff';
    end if;
    return r;
end;
$$;

comment on function lockstep._run_job(text) is
    'The body of lockstep.run, under lockstep''s pinned settings (lockstep.run puts back the caller''s '
    'settings after it). Locks: as lockstep.run.';

-- lockstep.run(job): what the runner calls (lockstep._run_job).
-- Runs as the caller, with no SET clause: it reads the caller's settings (lockstep._settings) and puts
-- back any the job's code changed for the session; every name is qualified.
-- locks: as lockstep._run_job.
create or replace function lockstep.run(job text) returns lockstep.result
language plpgsql
as $$
declare
    v_was pg_catalog.text[] := lockstep._settings();
    v_now pg_catalog.text[];
    r lockstep.result;
begin
    r := lockstep._run_job(job);
    v_now := lockstep._settings();
    if v_now operator(pg_catalog.<>) v_was then
        perform lockstep._restore_settings(v_was, v_now);
    end if;
    return r;
end;
$$;

comment on function lockstep.run(text) is
    'What the runner calls. Runs whatever part of the job is due: a generic job''s function; a derived '
    'job''s recompute if due or flagged, else a worker pass over up to batch_parents keys; a paused job: '
    'outcome paused, nothing written. Locks: nothing'
    ' while looking for work (but the group lock, try, when its status row is gone); then as '
    'lockstep._call, lockstep.recompute or lockstep.work.';

-- lockstep._own_enqueuers(job): the application's own triggers whose function calls lockstep.enqueue
-- for job (NULL: any), read from their source: drop_job and the downgrade warn about them.
create or replace function lockstep._own_enqueuers(job text) returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    with c(call) as (select text '"?lockstep"?\s*\.\s*"?enqueue"?\s*\(\s*')  -- the call, up to its first argument
    select pg_catalog.string_agg(pg_catalog.format('trigger %I on %s (function %s)', t.tgname,
                                                   t.tgrelid::regclass, p.oid::regprocedure), ', '
                                 order by t.tgrelid::regclass::text, t.tgname)
    from c, pg_catalog.pg_trigger t
    join pg_catalog.pg_proc p on p.oid = t.tgfoid
    where not t.tgisinternal and p.pronamespace <> 'lockstep'::regnamespace
      and p.prosrc ~* c.call
      and (job is null
           -- the job's name right after the call's parenthesis, or a trigger argument passed on to it
           or pg_catalog.strpos(pg_catalog.regexp_replace(p.prosrc, c.call, 'lockstep.enqueue(', 'gi'),
                                'lockstep.enqueue(' || pg_catalog.quote_literal(job)) > 0
           or (p.prosrc ~* (c.call || 'tg_argv')
               and job = any(pg_catalog.string_to_array(pg_catalog.encode(t.tgargs, 'escape'), '\000'))));
$$;

-- lockstep.drop_job(job): remove a job, its state, its queue, its failures and the triggers that feed it.
-- locks: the watched tables (drop trigger, through lockstep._ddl); then the job's registry, state, queue and
-- failure rows (deleted).
create or replace function lockstep.drop_job(job text) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
set jit = off  -- lockstep._no_jit_note (03_helpers.sql)
as $$
declare
    j lockstep.job := lockstep._job(job);
    v_rels regclass[];
    v_drops text[];
    v_own text;
    v_wal boolean;
begin
    perform lockstep._check_owner(j);
    v_wal := lockstep._capture_in_use() and lockstep._watched_via_wal(j.job);  -- watched through the WAL
    -- all the watched tables at once, never holding an application up for long (lockstep._ddl)
    select coalesce(array_agg(w.rel), '{}'),
           coalesce(array_agg(pg_catalog.format('drop trigger %I on %s', w.tgname, w.rel)), '{}')
    into v_rels, v_drops
    from lockstep._watchers(j.job) w;
    perform lockstep._ddl(v_rels, v_drops,
                          pg_catalog.format('drop_job(%L)', j.job));
    perform lockstep._drop_unused_triggers();  -- 08_enqueue.sql
    perform lockstep._delete('queue', j.job);
    perform lockstep._delete('recompute_flag', j.job);
    perform lockstep._take_through(j.job);  -- its through keys (17_through.sql), while the job still exists
    perform lockstep._delete('job', j.job);
    if v_wal then
        perform lockstep._capture_cleanup();  -- its lockstep.wal_watch rows went with it (16_capture.sql)
    end if;
    perform lockstep._drop_query_objects(j.compute, j.key_type);  -- written by lockstep._query_compute (18_query.sql)
    v_own := lockstep._own_enqueuers(j.job);
    if v_own is not null then
        raise warning 'lockstep: job "%" is dropped, but your own % call(s) lockstep.enqueue(''%'', ...): the next write that fires them fails (LSJ01)',
            j.job, v_own, j.job
            using hint = 'Drop those triggers, or define the job again.';
    end if;
end;
$$;
comment on function lockstep.drop_job(text) is
    'Remove a job, its state, its queue, its failures and the triggers that feed it. Locks: the watched '
    'tables (drop trigger, through lockstep._ddl); then the job''s registry, state, queue and failure '
    'rows (deleted).';
