-- lockstep: the periodic full recompute, applied in bounded batches.
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
-- rows of the first budget changed parents, in parent-key order after those whose key is too long for the
-- queue (a row moving between parents stays if
-- either is kept; rows without a parent always stay), and hand the other changed parents to the queue, in
-- key order, before any row lock is taken. Returns how many it handed off, also left in the transaction's
-- setting lockstep.handed_off for the recompute (it runs as the job's owner, whose temp tables the caller
-- may not read); they are listed in pg_temp.lockstep_rest (key text, ON COMMIT DROP).
-- budget NULL, or a job without a parent: no limit. The two tables are rewritten compactly (truncate and
-- refill), so the write steps scan only the batch.
-- locks: appends to lockstep.queue (as lockstep._enqueue_text: no lock anyone else holds); nothing else
-- outside pg_temp.
create or replace function lockstep._limit_batch(j lockstep.job, budget integer) returns bigint
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
    v_first bigint;
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
    -- Parents whose key is too long for the queue (lockstep._queueable) come first: handed off, each flagged
    -- the job for another full recompute, which again wrote one batch and flagged again while the worker had
    -- not caught up: one whole compute per batch (found by a probe). In the batch they are written now.
    -- The filters below test membership in the batch's small set (an uncorrelated IN, hashed), never in the
    -- rest (a NOT EXISTS inside an OR cannot become an anti-join and rescanned the rest for every row:
    -- quadratic in the size of the change).
    drop table if exists pg_temp.lockstep_parents, pg_temp.lockstep_rest, pg_temp.lockstep_first;
    execute pg_catalog.format(
        'create temp table lockstep_parents on commit drop as '
        'select k::text as key, pg_catalog.row_number() over (order by pg_catalog.octet_length(k::text) > %4$s desc, k) as n '
        'from (select distinct k::%1$s as k from ('
        '  select lockstep_parent from pg_temp.%2$I'
        '  union all select lockstep_parent from pg_temp.%3$I'
        '  union all select lockstep_old_parent from pg_temp.%3$I) s(k) where k is not null) s',
        lockstep._type_sql(j.key_type), v_gone, v_put, lockstep._max_key_bytes() - pg_catalog.octet_length(j.job));
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
    -- a changed parent queued already (the application's change): the hand-off's range starts at its entry,
    -- which the worker takes first (by id). Counted from the hand-off's own entries only, the progress of
    -- 200 parents changed with 150 queued showed 10 / 50, unmoving while the worker took those (a probe)
    select least(nullif(pg_catalog.current_setting('lockstep.handoff_from', true), '')::bigint, min(q.id))
    into v_first from lockstep.queue q
    where q.job = j.job and q.key in (select r.key from pg_temp.lockstep_rest r);
    if v_first is not null then
        perform pg_catalog.set_config('lockstep.handoff_from', v_first::text, true);
    end if;
    perform lockstep._enqueue_missing(j, v_rest);
    v_changed := cardinality(v_rest);
    perform pg_catalog.set_config('lockstep.handed_off', v_changed::text, true);
    -- the hand-off's parents to do, counted now, before the first row lock (lockstep._hand_off): counted
    -- after the write, a distinct count over the whole hand-off, they held the batch's row locks ~1 ms per
    -- 1,000 parents handed off (582 ms at 600,000; found by a probe)
    if pg_catalog.current_setting('lockstep.handoff_from', true) <> '' then
        perform pg_catalog.set_config('lockstep.handoff_todo', lockstep._handoff_todo(j.job,
            pg_catalog.current_setting('lockstep.handoff_from')::bigint,
            (select max(q.id) from lockstep.queue q where q.job = j.job))::text, true);
    end if;
    return v_changed;
end;
$$;

-- A job without a parent has no queue to hand its rest to: a recompute whose difference exceeds
-- batch_parents rows writes the first batch_parents of them (in primary-key order) and keeps the others in a
-- temp table of its session (pg_temp.lockstep_rest_<s>, the work tables' shape), which the next run() calls
-- of that session write, batch_parents rows each (lockstep._continue). A new recompute supersedes it. The
-- session is recorded in the job's status row; if it ends (a killed runner, a pooler's other connection),
-- the rest is gone with it and the next run recomputes: nothing is lost, one batch is written per compute.

-- lockstep._limit_rows(j, budget): write step 0 for a job without a parent: if j's work tables hold more
-- than budget rows, move them all to the rest table, numbered in primary-key order, and load the first
-- budget back (lockstep._load_rest). Returns how many rows were left in the rest table.
-- Not split where the target (or a partition of it) has a DEFERRABLE unique or exclusion constraint besides
-- its primary key: such a job's rows swap unique values (a top-N whose users change ranks), and the first
-- batch then held a value the rest still had, so every recompute failed with 23505 (23P01) and the job
-- never converged (found by a probe and a review). Its difference is written in one transaction (README:
-- a row-lock time that grows with the change).
-- locks: nothing outside pg_temp.
create or replace function lockstep._limit_rows(j lockstep.job, budget integer) returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
set jit = off
as $$
declare
    v_gone text := lockstep._tmp(j, 'gone');
    v_put text := lockstep._tmp(j, 'put');
    v_rest text := lockstep._tmp(j, 'rest');
    v_n bigint;
begin
    execute pg_catalog.format('select (select count(*) from pg_temp.%I) + (select count(*) from pg_temp.%I)',
                              v_gone, v_put) into v_n;
    if budget is null or v_n <= budget
       or exists (select from pg_catalog.pg_constraint c
                  where c.conrelid = any(lockstep._family(j.target)::oid[]) and c.contype in ('u', 'x')
                    and c.condeferrable) then
        return 0;
    end if;
    execute pg_catalog.format('create temp table if not exists %I as select p.*, false as lockstep_gone, '
                              '0::bigint as lockstep_n from pg_temp.%I p with no data', v_rest, v_put);
    if not lockstep._own_temp(v_rest) then  -- another role's table of that name: never written (06_write.sql)
        raise exception 'lockstep: pg_temp.% belongs to another role: another job''s code created it in this session', v_rest
            using errcode = '42501', hint = 'The next session (a runner restart) starts without it.';
    end if;
    execute pg_catalog.format('truncate pg_temp.%I', v_rest);  -- an earlier recompute's rest: superseded
    execute pg_catalog.format(
        'insert into pg_temp.%1$I (%4$s, lockstep_parent, lockstep_old_parent, lockstep_new, lockstep_ctid, '
        '                          lockstep_gone, lockstep_n) '
        'select %4$s, lockstep_parent, lockstep_old_parent, lockstep_new, lockstep_ctid, lockstep_gone, '
        '       pg_catalog.row_number() over (order by %5$s) from ('
        '  select %4$s, lockstep_parent, null::text as lockstep_old_parent, null::boolean as lockstep_new, '
        '         lockstep_ctid, true as lockstep_gone from pg_temp.%2$I'
        '  union all select %4$s, lockstep_parent, lockstep_old_parent, lockstep_new, lockstep_ctid, false '
        '  from pg_temp.%3$I) s',
        v_rest, v_gone, v_put, lockstep._cols(j.columns), lockstep._cols(j.target_key));
    execute pg_catalog.format('truncate pg_temp.%I, pg_temp.%I', v_gone, v_put);
    perform lockstep._load_rest(j, budget);
    return v_n - budget;
end;
$$;

-- lockstep._load_rest(j, budget): move the first budget rows of j's rest table to its work tables, each
-- checked against the target as it is now (its current ctid; a row already as wanted, or one to delete that
-- is gone, is dropped). Returns what the work tables hold, and leaves how many rows the rest table still
-- holds in the transaction's setting lockstep.handed_off (-1: this session has no rest table for j).
-- locks: nothing outside pg_temp (the target is read under MVCC).
create or replace function lockstep._load_rest(j lockstep.job, budget integer) returns lockstep._diff_counts
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
set jit = off
as $$
declare
    v_rest text := lockstep._tmp(j, 'rest');
    v_left bigint;
    n lockstep._diff_counts := row(0, 0, 0, 0);
begin
    if not lockstep._own_temp(v_rest) then  -- none (or another role's: never read, 06_write.sql)
        perform pg_catalog.set_config('lockstep.handed_off', '-1', true);
        return n;
    end if;
    execute pg_catalog.format(
        'with m as (delete from pg_temp.%1$I r where r.lockstep_n in '
        '             (select x.lockstep_n from pg_temp.%1$I x order by x.lockstep_n limit $1) returning r.*), '
        'c as materialized (select m.*, t.ctid as lockstep_now, %6$s as lockstep_differs '
        '                   from m left join %4$s t on %5$s), '
        'g as (insert into pg_temp.%2$I (%8$s, lockstep_parent, lockstep_ctid) '
        '      select %8$s, lockstep_parent, lockstep_now from c where lockstep_gone and lockstep_now is not null '
        '      returning 1), '
        'p as (insert into pg_temp.%3$I (%8$s, lockstep_parent, lockstep_old_parent, lockstep_new, lockstep_ctid) '
        '      select %8$s, lockstep_parent, case when lockstep_now is not null then lockstep_parent end, '
        '             lockstep_now is null, lockstep_now from c '
        '      where not lockstep_gone and (lockstep_now is null or lockstep_differs) returning lockstep_new) '
        'select (select count(*) from g), (select count(*) filter (where lockstep_new) from p), '
        '       (select count(*) filter (where not lockstep_new) from p), '
        '       (select count(*) from pg_temp.%1$I) - (select count(*) from m)',
        v_rest, lockstep._tmp(j, 'gone'), lockstep._tmp(j, 'put'), j.target,
        lockstep._eq(j.target_key, 'm', 't', j.target), lockstep._differs(j, 'm', 't'), null,
        lockstep._cols(j.columns))
        into n.gone, n.fresh, n.kept, v_left using budget;
    perform pg_catalog.set_config('lockstep.handed_off', v_left::text, true);
    return n;
end;
$$;

-- lockstep._session(pid): the session of backend pid (default: this one), as recorded with a rest (pid @
-- backend start); NULL if no such backend is running.
-- locks: nothing.
create or replace function lockstep._session(pid integer default pg_catalog.pg_backend_pid()) returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select a.pid::text || '@' || extract(epoch from a.backend_start)::text
    from pg_catalog.pg_stat_activity a where a.pid = _session.pid;
$$;

-- lockstep._set_rest(j, rows_left, total): record in j's status row the rows of a recompute without a
-- parent still to write, held by this session (total NULL: keep the one recorded); none when rows_left is 0.
-- locks: the job's lockstep.job_state row (by the update).
create or replace function lockstep._set_rest(j lockstep.job, rows_left bigint, total bigint default null) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    update lockstep.job_state st
    set recompute_rest = nullif(rows_left, 0),
        recompute_total = case when rows_left > 0 then coalesce(total, st.recompute_total) end,
        recompute_rest_session = case when rows_left > 0 then lockstep._session() end,
        recompute_rest_at = clock_timestamp()
    where st.job = j.job;
end;
$$;

-- lockstep._continue(j, s): run() for a job without a parent whose recompute left a rest (s its status
-- row): write the next batch if this session holds the rest; busy while another live session that wrote a
-- batch in the last 30 s holds it; else (that session ended, or stalled behind a pooler) recompute again.
-- locks: the group lock (try: busy if taken); then as lockstep._write_steps; the job's status row last.
create or replace function lockstep._continue(j lockstep.job) returns lockstep.result
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    s lockstep.job_state;
    v lockstep.job := j;
    v_started timestamptz := clock_timestamp();
    v_left bigint;
    v_err text;
    p lockstep._pass;
begin
    if not lockstep._try_lock(j.lock_group) then
        return lockstep._result('busy', j.job, 'recompute');
    end if;
    select * into s from lockstep.job_state st where st.job = j.job;
    if s.recompute_rest is null then
        return lockstep._result(lockstep._not_due(s), j.job, 'recompute');
    end if;
    if s.recompute_rest_session is distinct from lockstep._session() then
        if s.recompute_rest_at > now() - interval '30 seconds'
           and lockstep._session(pg_catalog.split_part(s.recompute_rest_session, '@', 1)::integer)
               = s.recompute_rest_session then  -- that session still runs
            return lockstep._result('busy', j.job, 'recompute');
        end if;
        return lockstep._recompute(j, false);
    end if;
    v.kind := 'rest';  -- lockstep._apply: the next batch of the rest (as the owner)
    begin
        p := lockstep._apply(v, null);
    exception when others then
        get stacked diagnostics v_err = message_text;
        perform lockstep._set_rest(j, 0);
        return lockstep._failed(j, 'recompute', v_started, v_err);
    end;
    v_left := pg_catalog.current_setting('lockstep.handed_off')::bigint;
    if v_left < 0 then  -- this session's rest table is gone (DISCARD TEMP): recompute again
        return lockstep._recompute(j, false);
    end if;
    perform lockstep._set_rest(j, v_left);
    perform lockstep._finish(j, 'recompute', 'done', v_started, p);
    return lockstep._result('done', j.job, 'recompute', p, null, v_left > 0);
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
-- The earlier hand-off's total is carried on too: the total is the larger of it and this recompute's own
-- (written + to do), so what that hand-off had done stays done where this recompute found nothing new.
-- Without that, a recompute that came due when the worker had done half of a hand-off showed 50 / 150
-- where the first had shown 100 / 200 (found by a probe). Adding up the two instead counted a parent twice
-- when this recompute found it changed again (100 / 300 with 200 parents; found by a review): which
-- parents the earlier hand-off wrote is not kept, so an exact union is not known.
-- With the batch's row locks held, it reads nothing whose size grows with the hand-off: the count of the
-- parents to do was taken before the write (lockstep._limit_batch, from lockstep.handoff_from, which
-- lockstep._recompute sets), and an earlier hand-off is seen in progress by its first entry still queued.
-- locks: appends to lockstep.queue; the job's lockstep.job_state row (FOR NO KEY UPDATE, by the update).
create or replace function lockstep._hand_off(j lockstep.job, keys text[], before bigint, written bigint) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    s lockstep.job_state;
    v_from bigint;
    v_to bigint;
    v_old boolean;
    v_total bigint;
    v_queued bigint;
begin
    v_queued := lockstep._enqueue_missing(j, keys);
    select * into s from lockstep.job_state x where x.job = j.job;
    v_old := s.recompute_total is not null
             and lockstep._handoff_any(j.job, s.recompute_queue_from, s.recompute_queue_to);
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
    -- from the first entry of a changed parent queued before this recompute (lockstep._limit_batch)
    v_from := least(v_from, nullif(pg_catalog.current_setting('lockstep.handoff_from', true), '')::bigint);
    -- to do: as counted before the write (lockstep._limit_batch), plus the skipped parents queued since
    v_total := written + coalesce(nullif(pg_catalog.current_setting('lockstep.handoff_todo', true), '')::bigint + v_queued,
                                  lockstep._handoff_todo(j.job, v_from, v_to));
    update lockstep.job_state x set
        recompute_total = case when v_old then greatest(s.recompute_total, v_total) else v_total end,
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
create or replace function lockstep._parent_keys(j lockstep.job) returns text[]
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

-- lockstep._key_type_drift(j): what to do when j's parent key column is no longer of the job's key type
-- (retyped since define_derived), else NULL.
-- locks: nothing.
create or replace function lockstep._key_type_drift(j lockstep.job) returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.format('the parent key %s.%I is %s, but job "%s" was defined with key type %s: run '
                             'lockstep.define_derived again, with a compute taking %s[] and a target that can '
                             'hold it, then lockstep.watch() again', j.parent, j.parent_key,
                             pg_catalog.format_type(a.atttypid, null), j.job, j.key_type,
                             pg_catalog.format_type(a.atttypid, null))
    from pg_catalog.pg_attribute a
    where a.attrelid = j.parent and a.attname = j.parent_key and not a.attisdropped and a.atttypid <> j.key_type;
$$;

-- lockstep._recompute_failed(j, started, error, sqlstate): the whole-table pass raised error. If it is a
-- definition error (SQLSTATE class 42, or lockstep's LSDxx: the target, its keys, its foreign keys or the
-- shape of compute's rows; not LSD05, a primary key computed twice or NULL, which is a fault of the rows of
-- some parents, as the worker treats it), or an empty pass raises too, or the job has no parent, the job
-- itself is broken: a failed run with its backoff. An error of the moment (lockstep._transient: a lock
-- timeout, say) fails the run too, retried within a minute, unless the last recompute failed already. Otherwise (an error of compute or of a constraint, or
-- LSD05) some parents are poison: every parent is handed to the queue, where the worker's bisection isolates,
-- retries and parks the failing ones (lockstep.failing_keys / parked_keys) and writes all the others; the
-- recompute is done (no backoff) and reports the error; the job's recompute flags wait for the next
-- periodic recompute or a retry (recompute_poisoned_at). With no parent to hand off, the run fails.
-- locks: the group lock is already held; the empty pass as lockstep._write (no row lock: nothing to write);
-- then as lockstep._hand_off; the job's status row last.
create or replace function lockstep._recompute_failed(j lockstep.job, started timestamptz, error text, sqlstate text)
returns lockstep.result
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_keys text[];
    v_before bigint;
    v_msg text;
    v_result lockstep.result;
begin
    if j.parent is null or sqlstate like '42%' or (sqlstate like 'LSD%' and sqlstate <> 'LSD05') then
        return lockstep._failed(j, 'recompute', started, error);
    end if;
    -- a lock timeout (say) is likely the moment's, not some parents': the first time, a failed run tried
    -- again within a minute (not after the job's whole backoff: a review); if it fails again, the parents go
    -- to the worker's bisection as below (a parent whose compute always raises it is isolated, not a stall)
    if lockstep._transient(sqlstate)
       and (select s.recompute_error is null from lockstep.job_state s where s.job = j.job) then
        v_result := lockstep._failed(j, 'recompute', started, error);
        update lockstep.job_state s set next_run_at = least(s.next_run_at, now() + interval '1 minute')
        where s.job = j.job;
        return v_result;
    end if;
    begin
        perform lockstep._apply(j, '{}'::text[]);
    exception when others then
        return lockstep._failed(j, 'recompute', started, error);
    end;
    v_keys := lockstep._parent_keys(j);
    if cardinality(v_keys) = 0 then  -- no parent to blame or hand off: the job's failure
        return lockstep._failed(j, 'recompute', started, error);
    end if;
    select coalesce(max(q.id), 0) into v_before from lockstep.queue q where q.job = j.job;
    begin
        perform lockstep._hand_off(j, v_keys, v_before, case when cardinality(v_keys) > 0 then 0 end);
    exception when data_exception then
        -- a parent key the job's key type cannot hold: the parent key column was retyped (int -> bigint)
        -- since define_derived. This raised out of run() (22003), recording nothing (found by a probe)
        get stacked diagnostics v_msg = message_text;
        return lockstep._failed(j, 'recompute', started, pg_catalog.format(
            '%s; its parents could not be handed to the worker either (%s)%s', error, v_msg,
            coalesce('; ' || lockstep._key_type_drift(j), '')));
    end;
    v_msg := pg_catalog.format('the whole-table pass failed (%s); its %s parents were handed to the worker, '
                               'which isolates the failing ones (lockstep.failing_keys)', error, cardinality(v_keys));
    -- a done run with its reason: lockstep.run_log.error has it (the status row keeps last_error for failures)
    perform lockstep._finish(j, 'recompute', 'done', started, null, v_msg);
    -- the job's flags wait for the next periodic recompute or a retry (job_state.recompute_poisoned_at):
    -- taken again at once, the same pass failed the same way, forever, and the worker never took the
    -- hand-off (found by a probe). Not cleared: what they flag (a key too long for the queue, rows of a
    -- parent gone) this hand-off does not cover.
    update lockstep.job_state s set recompute_poisoned_at = now(), recompute_poison_cured = false
    where s.job = j.job;
    return lockstep._result('done', j.job, 'recompute', null, v_msg, cardinality(v_keys) > 0);
end;
$$;

-- lockstep._recompute(j, only_if_due): the full recompute under the group lock, writing at most
-- j.batch_parents parents in this transaction and handing the rest to the queue (see the top of this file).
-- locks: the group lock (try: busy if taken); then as lockstep._write for the first batch of the difference
-- (the rest appended to the queue before its first row lock); then the queue (skipped parents appended);
-- the job's status row last.
create or replace function lockstep._recompute(j lockstep.job, only_if_due boolean) returns lockstep.result
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
    -- where this recompute's hand-off starts in the queue, for lockstep._limit_batch to count it before the
    -- write: at an earlier hand-off still in progress (lockstep._hand_off carries it on), else after v_before
    perform pg_catalog.set_config('lockstep.handoff_todo', '', true);
    perform pg_catalog.set_config('lockstep.handoff_from',
        case when s.recompute_total is not null
                  and lockstep._handoff_any(j.job, s.recompute_queue_from, s.recompute_queue_to)
             then s.recompute_queue_from else v_before + 1 end::text, true);
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
    -- the rest of the difference was handed to the queue before the write (_limit_batch), or, without a
    -- parent, left in this session's rest table (_limit_rows)
    v_rest := coalesce(nullif(pg_catalog.current_setting('lockstep.handed_off', true), ''), '0')::bigint;
    if j.parent is null and (v_rest > 0 or s.recompute_rest is not null) then
        perform lockstep._set_rest(j, v_rest, v_rest + p.inserted + p.updated + p.deleted + cardinality(p.skipped));
    elsif j.parent is not null then
        -- the batch was j.batch_parents parents (the first of the difference), its skipped ones re-queued
        perform lockstep._hand_off(j, p.skipped, v_before,
                                   case when v_rest > 0 then j.batch_parents - cardinality(p.skipped) end);
    end if;
    perform lockstep._clear_flag(j, v_snap, v_started);
    -- every parent computed and written without an error in this transaction (the whole-table pass went
    -- through and handed nothing off): the job's failing and parked keys are cured (a parked key fixed
    -- meanwhile kept lockstep status unhealthy until someone ran retry: a probe). After a hand-off the
    -- worker still has to write some parents: a key that fails only at its write keeps its attempts, but
    -- is tried at once, and the keys this recompute wrote or found right are cured (a fixed parked parent
    -- handed off waited for its retry_at, up to the job's backoff, unwritten; found by a probe).
    if v_rest = 0 then
        perform lockstep._cure(j);
    elsif j.parent is not null then
        perform lockstep._cure(j, true);
    end if;
    perform lockstep._finish(j, 'recompute', 'done', v_started, p);
    return lockstep._result('done', j.job, 'recompute', p, null, v_rest > 0);
end;
$$;

-- lockstep._cure(j, handed_off): after a recompute that computed and wrote every parent of j: forget its
-- failing and parked keys. A key among them that cannot be read as the parent key type (a queue row written
-- by hand, or by a trigger on a column whose type changed) names no parent: its queue entries go too (left,
-- they parked it again at the next pass; found by a probe). handed_off (the recompute computed every parent
-- but handed some to the worker): a readable key still queued (handed off, or skipped, or changed since; a
-- failing key keeps its entries, so one handed off may have no new entry) keeps its attempts and is due at
-- once, tried alone, a parked one too (its entries so far count as queued again: failed_upto 0); a key not
-- queued was written or found right, and goes (a first version went by entries newer than the recompute's
-- start and forgot a still failing key whose old entry stood for its hand-off; a review). An unreadable
-- key goes either way: kept, it was parked again at the next pass, which made the recompute due, which
-- handed off again: 310 full recomputes in 8 s of a job every hour (a review).
-- locks: the job's key_failure rows (updated, deleted), then the queue entries of keys that do not read back.
create or replace function lockstep._cure(j lockstep.job, handed_off boolean default false) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_keys text[] := array(select f.key from lockstep.key_failure f where f.job = j.job);
    v_bad text[];
    v_kept text[] := '{}';  -- readable keys still queued after a hand-off
begin
    if cardinality(v_keys) = 0 then
        return;
    end if;
    v_bad := coalesce((lockstep._readable(j, v_keys)).bad, '{}');
    if handed_off then
        v_kept := array(select k from pg_catalog.unnest(v_keys) k
                        where k <> all(v_bad)
                          and exists (select from lockstep.queue q where q.key = k and (q.job = j.job) is true));
        update lockstep.key_failure f set retry_at = now(), failed_upto = case when f.parked then 0 else f.failed_upto end
        where f.job = j.job and f.key = any(v_kept);
    end if;
    delete from lockstep.key_failure f where f.job = j.job and f.key <> all(v_kept);
    if cardinality(v_bad) > 0 then
        delete from lockstep.queue q where q.job = j.job and q.key = any(v_bad);
    end if;
end;
$$;

-- lockstep.recompute(job): full recompute now, even if not due (and even during a failure backoff).
-- locks: as lockstep._recompute.
create or replace function lockstep.recompute(job text) returns lockstep.result
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
create or replace function lockstep.set_batch_parents(job text, batch_parents integer) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    j lockstep.job := lockstep._job(job, 'derived');  -- without a parent: rows per transaction
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
