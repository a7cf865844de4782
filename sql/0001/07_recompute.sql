-- lockstep 0001: the periodic full recompute, applied in bounded batches.
--
-- A recompute computes every parent (compute(NULL)) and diffs the whole target without any row lock. If
-- the difference touches more than the job's batch_parents parents, it writes only the first batch_parents
-- of them (in parent-key order) and hands the others to the queue in the same transaction, where worker
-- passes recompute them fresh, batch_parents at most per transaction. So no transaction holds row locks
-- for longer than one batch, whatever the size of the change; the hand-off is as durable as the batch it
-- commits with (nothing is lost if the runner dies between batches), and every later batch is computed from
-- a fresh snapshot (an application change is never overwritten by older rows). If the whole-table pass
-- fails while an empty pass works, some parents are poison: every parent is handed to the queue, where the
-- worker's bisection isolates, retries and parks the failing ones and writes all the others.

-- lockstep._limit_batch(j, budget): write step 0. Keep in j's work tables (gone, put) only the
-- rows of the first budget changed parents, in parent-key order (a row moving between parents stays if
-- either is kept; rows without a parent always stay), and hand the other changed parents to the queue, in
-- key order, before any row lock is taken. Returns how many it handed off, also left in the transaction's
-- setting lockstep.handed_off for the recompute (it runs as the job's owner, whose temp tables the caller
-- may not read); they are listed in pg_temp.lockstep_rest (key text, ON COMMIT DROP).
-- budget NULL, or a job without a parent: no limit. The two tables are rewritten compactly (truncate and
-- refill), so the write steps scan only the batch.
-- locks: appends to lockstep.queue (as lockstep._enqueue_text: no lock anyone else holds); nothing else
-- outside pg_temp.
create function lockstep._limit_batch(j lockstep.job, budget integer) returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
set jit = off
as $$
declare
    v_gone text := lockstep._tmp(j, 'gone');
    v_put text := lockstep._tmp(j, 'put');
    v_changed bigint;
    v_rest text[];
begin
    if budget is null or j.parent is null then
        return 0;
    end if;
    -- a bound without deduplicating (each gone row names at most one parent, each put row two): a small
    -- difference returns here, creating no temp table (no catalog row, no WAL). A large one is deduplicated
    -- once, below (counting the distinct parents here too cost 671 ms of _limit_batch's 1.37 s at 100 % of
    -- 50,000 parents).
    execute pg_catalog.format('select (select count(*) from pg_temp.%I) + 2 * (select count(*) from pg_temp.%I)',
                              v_gone, v_put) into v_changed;
    if v_changed <= budget then
        return 0;
    end if;
    -- every changed parent once, in key order, numbered: the first budget are the batch, the rest is handed off.
    -- The filters below test membership in the batch's small set (an uncorrelated IN, hashed), never in the
    -- rest (a NOT EXISTS inside an OR cannot become an anti-join and rescanned the rest for every row:
    -- quadratic in the size of the change).
    drop table if exists pg_temp.lockstep_parents, pg_temp.lockstep_rest, pg_temp.lockstep_first;
    execute pg_catalog.format(
        'create temp table lockstep_parents on commit drop as '
        'select k::text as key, pg_catalog.row_number() over (order by k) as n from (select distinct k::%1$s as k from ('
        '  select lockstep_parent from pg_temp.%2$I'
        '  union all select lockstep_parent from pg_temp.%3$I'
        '  union all select lockstep_old_parent from pg_temp.%3$I) s(k) where k is not null) s',
        j.key_type, v_gone, v_put);
    if not exists (select from pg_temp.lockstep_parents c where c.n > budget) then
        drop table pg_temp.lockstep_parents;
        return 0;
    end if;
    create temp table lockstep_rest on commit drop as
        select c.key from pg_temp.lockstep_parents c where c.n > budget order by c.n;
    create temp table lockstep_first on commit drop as
        select c.key from pg_temp.lockstep_parents c where c.n <= budget;
    drop table pg_temp.lockstep_parents;
    -- keep the batch's rows, compacted (a DELETE would leave the write steps scanning every dead row)
    drop table if exists pg_temp.lockstep_keep;
    execute pg_catalog.format(
        'create temp table lockstep_keep on commit drop as select * from pg_temp.%I g '
        'where g.lockstep_parent is null or g.lockstep_parent in (select f.key from pg_temp.lockstep_first f)',
        v_gone);
    execute pg_catalog.format('truncate pg_temp.%1$I; insert into pg_temp.%1$I select * from pg_temp.lockstep_keep',
                              v_gone);
    drop table pg_temp.lockstep_keep;
    execute pg_catalog.format(
        'create temp table lockstep_keep on commit drop as select * from pg_temp.%I p '
        'where (p.lockstep_parent is null and p.lockstep_old_parent is null)'
        '   or p.lockstep_parent in (select f.key from pg_temp.lockstep_first f)'
        '   or p.lockstep_old_parent in (select f.key from pg_temp.lockstep_first f)', v_put);
    execute pg_catalog.format('truncate pg_temp.%1$I; insert into pg_temp.%1$I select * from pg_temp.lockstep_keep',
                              v_put);
    drop table pg_temp.lockstep_keep;
    drop table pg_temp.lockstep_first;
    execute pg_catalog.format('analyze pg_temp.%I', v_gone);
    execute pg_catalog.format('analyze pg_temp.%I', v_put);
    -- the rest goes to the queue, but not a second time: a parent still queued (an earlier hand-off, the
    -- application's change) is computed afresh by the pass that takes that entry
    v_rest := array(select r.key from pg_temp.lockstep_rest r);
    perform lockstep._enqueue_missing(j, v_rest);
    v_changed := cardinality(v_rest);
    perform pg_catalog.set_config('lockstep.handed_off', v_changed::text, true);
    return v_changed;
end;
$$;

-- lockstep._hand_off(j, keys, before, written): queue the keys not yet queued (the parents the write
-- skipped, or every parent: lockstep._enqueue_missing) and record the recompute's hand-off in the job's
-- status row: parents written in this transaction, plus the distinct parents still queued in the range of
-- queue ids above before (the job's highest id when the recompute started), from which lockstep.status
-- derives recompute_done until the worker has taken them all. written NULL: this recompute is not spread
-- over transactions. An earlier hand-off still in progress is carried on, not forgotten: the range starts
-- at its first id, so its entries still queued count as to do (each parent once), and a parent the
-- second recompute found still queued is not queued again; the total never exceeds the parents changed.
-- locks: appends to lockstep.queue; the job's lockstep.job_state row (FOR NO KEY UPDATE, by the update).
create function lockstep._hand_off(j lockstep.job, keys text[], before bigint, written bigint) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    s lockstep.job_state;
    v_from bigint;
    v_to bigint;
    v_old boolean;
begin
    perform lockstep._enqueue_missing(j, keys);
    select * into s from lockstep.job_state x where x.job = j.job;
    v_old := s.recompute_total is not null
             and lockstep._handoff_todo(j.job, s.recompute_queue_from, s.recompute_queue_to) > 0;
    if written is null then  -- nothing spread over transactions: an earlier hand-off's progress, if done, goes
        if s.recompute_total is not null and not v_old then
            update lockstep.job_state x set recompute_total = null, recompute_queue_from = null, recompute_queue_to = null
            where x.job = j.job;
        end if;
        return;
    end if;
    select min(q.id), max(q.id) into v_from, v_to from lockstep.queue q where q.job = j.job and q.id > before;
    if v_old then
        v_from := s.recompute_queue_from;
        v_to := coalesce(v_to, s.recompute_queue_to);
    end if;
    update lockstep.job_state x set
        recompute_total = written + lockstep._handoff_todo(j.job, v_from, v_to),
        recompute_queue_from = v_from,
        recompute_queue_to = v_to
    where x.job = j.job;
end;
$$;

-- lockstep._parent_keys(j): every parent key of j, in key order, read as j's owner through the owner's
-- sandbox (lockstep._as_owner, as a pass: the read of the owner's table may run the owner's code, a row
-- security policy's function, which must not get the runner's session). Read with the caller's rights, a
-- runner of the least-privilege recipe (no right on the owner's tables) failed here with 42501, so a
-- poison parent stalled the job instead of being handed to the worker and parked.
-- locks: nothing (reads the parent table).
create function lockstep._parent_keys(j lockstep.job) returns text[]
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v lockstep.job := j;
begin
    v.kind := 'parent_keys';  -- lockstep._owner_run reads the keys instead of running a pass
    return (lockstep._as_owner(v, null)).skipped;
end;
$$;

-- lockstep._recompute_failed(j, started, error, sqlstate): the whole-table pass raised error. If it is a
-- definition error (SQLSTATE class 42, or lockstep's LSDxx: the target, its keys, its foreign keys or the
-- shape of compute's rows; not LSD05, a primary key computed twice or NULL, which is a fault of the rows of
-- some parents, as the worker treats it), or an empty pass raises too, or the job has no parent, the job
-- itself is broken: a failed run with its backoff. Otherwise (an error of compute or of a constraint, or
-- LSD05) some parents are poison: every parent is handed to the queue, where the worker's bisection isolates,
-- retries and parks the failing ones (lockstep.failing_keys / parked_keys) and writes all the others; the
-- recompute is done (no backoff) and reports the error.
-- locks: the group lock is already held; the empty pass as lockstep._write (no row lock: nothing to write);
-- then as lockstep._hand_off; the job's status row last.
create function lockstep._recompute_failed(j lockstep.job, started timestamptz, error text, sqlstate text)
returns lockstep.result
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_keys text[];
    v_before bigint;
begin
    if j.parent is null or sqlstate like '42%' or (sqlstate like 'LSD%' and sqlstate <> 'LSD05') then
        return lockstep._failed(j, 'recompute', started, error);
    end if;
    begin
        perform lockstep._apply(j, '{}'::text[]);
    exception when others then
        return lockstep._failed(j, 'recompute', started, error);
    end;
    v_keys := lockstep._parent_keys(j);
    select coalesce(max(q.id), 0) into v_before from lockstep.queue q where q.job = j.job;
    perform lockstep._hand_off(j, v_keys, v_before, case when cardinality(v_keys) > 0 then 0 end);
    perform lockstep._finish(j, 'recompute', 'done', started);
    return lockstep._result('done', j.job, 'recompute', null,
        pg_catalog.format('the whole-table pass failed (%s); its %s parents were handed to the worker, which '
                          'isolates the failing ones (lockstep.failing_keys)', error, cardinality(v_keys)),
        cardinality(v_keys) > 0);
end;
$$;

-- lockstep._recompute(j, only_if_due): the full recompute under the group lock, writing at most
-- j.batch_parents parents in this transaction and handing the rest to the queue (see the top of this file).
-- locks: the group lock (try: busy if taken); then as lockstep._write for the first batch of the difference
-- (the rest appended to the queue before its first row lock); then the queue (skipped parents appended);
-- the job's status row last.
create function lockstep._recompute(j lockstep.job, only_if_due boolean) returns lockstep.result
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    s lockstep.job_state;
    v_started timestamptz;
    v_err text;
    v_state text;
    v_before bigint;
    v_rest bigint := 0;
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
    select coalesce(max(q.id), 0) into v_before from lockstep.queue q where q.job = j.job;
    perform pg_catalog.set_config('lockstep.handed_off', '0', true);
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
            get stacked diagnostics v_err = message_text, v_state = returned_sqlstate;
            return lockstep._recompute_failed(j, v_started, v_err, v_state);
    end;
    -- the rest of the difference was handed to the queue before the write (_limit_batch)
    v_rest := coalesce(nullif(pg_catalog.current_setting('lockstep.handed_off', true), ''), '0')::bigint;
    if j.parent is not null then
        -- the batch was j.batch_parents parents (the first of the difference), its skipped ones re-queued
        perform lockstep._hand_off(j, p.skipped, v_before,
                                   case when v_rest > 0 then j.batch_parents - cardinality(p.skipped) end);
    end if;
    perform lockstep._clear_flag(j, v_snap, v_started);
    perform lockstep._finish(j, 'recompute', 'done', v_started, p);
    return lockstep._result('done', j.job, 'recompute', p, null, v_rest > 0);
end;
$$;

-- lockstep.recompute(job): full recompute now, even if not due (and even during a failure backoff).
-- locks: as lockstep._recompute.
create function lockstep.recompute(job text) returns lockstep.result
language plpgsql
set search_path = pg_catalog, pg_temp
set jit = off  -- lockstep._no_jit_note (03_helpers.sql)
set datestyle = 'ISO, YMD'
set intervalstyle = 'postgres'
set extra_float_digits = 1
as $$
begin
    perform lockstep._check_isolation('lockstep.recompute()');
    return lockstep._recompute(lockstep._job(job, 'derived'), false);
end;
$$;

-- lockstep.set_batch_parents(job, batch_parents): parents written per transaction (default 500): a
-- recompute writes at most this many and hands the rest to the queue, and a worker pass of lockstep.run()
-- claims this many. Smaller: shorter row locks, more transactions.
-- locks: the job's registry row.
create function lockstep.set_batch_parents(job text, batch_parents integer) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    j lockstep.job := lockstep._queue_job(job);
begin
    if batch_parents is null or batch_parents not between 1 and 1000000 then
        raise exception 'lockstep: batch_parents must be an integer between 1 and 1000000 (got %)',
            coalesce(batch_parents::text, 'NULL')
            using errcode = case when batch_parents is null then '22004' else '22023' end,
                  hint = 'The default is 500 parents per transaction.';
    end if;
    perform lockstep._check_owner(j);
    update lockstep.job x set batch_parents = set_batch_parents.batch_parents, updated_at = now()
    where x.job = j.job;
end;
$$;
