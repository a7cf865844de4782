-- lockstep: the periodic full recompute: the first batch_parents changed parents are written, the rest
-- handed to the queue in the same transaction; poison parents go to the worker's bisection.

-- lockstep._limit_batch(j, budget, queued_from): write step 0. Keep only the rows of the first budget
-- changed parents (lockstep._keep_batch) and hand the others to the queue before any row lock
-- (lockstep._hand_off_rest, counting the hand-off from queued_from); returns how many it handed off, where
-- the hand-off starts and its parents to do (NULL budget or no parent: nothing handed off).
-- locks: appends to lockstep.queue (as lockstep._enqueue_text); nothing else outside pg_temp.
create or replace function lockstep._limit_batch(j lockstep.job, budget integer, queued_from bigint,
                                      out handed_off bigint, out handoff_from bigint, out handoff_todo bigint)
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
set jit = off
as $$
declare
    v_gone text := lockstep._tmp(j, 'gone');
    v_put text := lockstep._tmp(j, 'put');
    v_changed bigint;
begin
    handed_off := 0;
    handoff_from := queued_from;
    if budget is null or j.parent is null then
        return;
    end if;
    -- a bound without deduplicating: a small difference returns here, creating no temp table
    execute pg_catalog.format('select (select count(*) from pg_temp.%I) + 2 * (select count(*) from pg_temp.%I)',
                              v_gone, v_put) into v_changed;
    if v_changed <= budget then
        return;
    end if;
    -- every changed parent once, numbered: keys too long for the queue first, then key order
    drop table if exists pg_temp.lockstep_parents, pg_temp.lockstep_rest, pg_temp.lockstep_first;
    execute pg_catalog.format(
        'create temp table lockstep_parents on commit drop as '
        'select min(t)::text as key, pg_catalog.row_number() over (order by pg_catalog.octet_length(min(t)) > %4$s desc, %5$s) as n '
        'from (select t, t::%1$s as k from (select distinct k from ('  -- each text once, read back once
        '  select lockstep_parent from pg_temp.%2$I'
        '  union all select lockstep_parent from pg_temp.%3$I'
        '  union all select lockstep_old_parent from pg_temp.%3$I) s(k) where k is not null) s(t)) s group by %5$s',
        lockstep._type_sql(j.key_type), v_gone, v_put, lockstep._max_key_bytes() - pg_catalog.octet_length(j.job),
        lockstep._key_order(j, 'k'));
    if not exists (select from pg_temp.lockstep_parents c where c.n > budget) then
        drop table pg_temp.lockstep_parents;
        return;
    end if;
    create temp table lockstep_rest on commit drop as
        select c.key from pg_temp.lockstep_parents c where c.n > budget order by c.n;
    create temp table lockstep_first on commit drop as
        select c.key from pg_temp.lockstep_parents c where c.n <= budget;
    drop table pg_temp.lockstep_parents;
    perform lockstep._keep_batch(j);
    select r.handed_off, r.handoff_from, r.handoff_todo into handed_off, handoff_from, handoff_todo
    from lockstep._hand_off_rest(j, queued_from) r;
end;
$$;
comment on function lockstep._limit_batch(lockstep.job, integer, bigint) is
    'Write step 0. Keep only the rows of the first budget changed parents (lockstep._keep_batch) and hand '
    'the others to the queue before any row lock (lockstep._hand_off_rest, counting the hand-off from '
    'queued_from); returns how many it handed off, where the hand-off starts and its parents to do (NULL '
    'budget or no parent: nothing handed off). Locks: appends to lockstep.queue (as '
    'lockstep._enqueue_text); nothing else outside pg_temp.';

-- lockstep._keep_batch(j): keep in j's work tables only the rows of the parents in pg_temp.lockstep_first
-- (a row moving between parents stays if either is kept; rows without a parent always stay), compacted:
-- each table is rewritten (truncate and refill; a DELETE would leave the write steps scanning every dead
-- row) and analyzed. The filters test membership in the batch's small set (an uncorrelated IN, hashed),
-- never in the rest (a NOT EXISTS inside an OR cannot become an anti-join: quadratic in the change).
-- locks: nothing outside pg_temp.
create or replace function lockstep._keep_batch(j lockstep.job) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
set jit = off
as $$
declare
    v_gone text := lockstep._tmp(j, 'gone');
    v_put text := lockstep._tmp(j, 'put');
begin
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
end;
$$;

-- lockstep._hand_off_rest(j, queued_from): queue the parents of pg_temp.lockstep_rest that have no entry
-- yet (a parent still queued, by an earlier hand-off or the application's change, is computed afresh by
-- the pass that takes that entry). Returns how many parents it handed off; where the hand-off starts
-- (queued_from, or the first entry of a parent of the rest queued already, which the worker takes first);
-- and the hand-off's parents to do, counted now, before the first row lock (lockstep._hand_off), not with
-- the batch's row locks held. queued_from NULL: nothing counted.
-- locks: appends to lockstep.queue (as lockstep._enqueue_missing).
create or replace function lockstep._hand_off_rest(j lockstep.job, queued_from bigint, out handed_off bigint,
                                        out handoff_from bigint, out handoff_todo bigint)
language plpgsql
set search_path = pg_catalog, pg_temp
set jit = off
as $$
declare
    v_rest text[] := array(select r.key from pg_temp.lockstep_rest r);
begin
    select least(queued_from, min(q.id)) into handoff_from
    from lockstep.queue q
    where q.job = j.job and q.key in (select r.key from pg_temp.lockstep_rest r);
    perform lockstep._enqueue_missing(j, v_rest);
    handed_off := cardinality(v_rest);
    if handoff_from is not null then
        handoff_todo := lockstep._handoff_todo(j.job, handoff_from,
                                               (select max(q.id) from lockstep.queue q where q.job = j.job));
    end if;
end;
$$;
comment on function lockstep._hand_off_rest(lockstep.job, bigint) is
    'Queue the parents of pg_temp.lockstep_rest that have no entry yet (a parent still queued, by an '
    'earlier hand-off or the application''s change, is computed afresh by the pass that takes that '
    'entry). Returns how many parents it handed off; where the hand-off starts (queued_from, or the first '
    'entry of a parent of the rest queued already, which the worker takes first); and the hand-off''s '
    'parents to do, counted now, before the first row lock (lockstep._hand_off), not with the batch''s '
    'row locks held. queued_from NULL: nothing counted. Locks: appends to lockstep.queue (as '
    'lockstep._enqueue_missing).';

-- lockstep._limit_rows(j, budget): write step 0 without a parent: keep budget rows, move the rest to
-- this session's rest table (lockstep._continue writes it). Not where a deferrable unique constraint is.
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
-- checked against the target as it is now. Returns what the work tables hold, and in rest the rows left
-- in the rest table (-1: no rest table).
-- locks: nothing outside pg_temp (the target is read under MVCC).
create or replace function lockstep._load_rest(j lockstep.job, budget integer) returns lockstep._diff_counts
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
set jit = off
as $$
declare
    v_rest text := lockstep._tmp(j, 'rest');
    n lockstep._diff_counts := row(0, 0, 0, 0, -1);
begin
    if not lockstep._own_temp(v_rest) then  -- none (or another role's: never read, 06_write.sql)
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
        into n.gone, n.fresh, n.kept, n.rest using budget;
    return n;
end;
$$;

-- lockstep._session(pid): the session of backend pid (default: this one), as recorded with a rest (pid @
-- backend start); NULL if no such backend is running.
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
    -- this session read as its role: pg_stat_activity hides another role's backend_start
    perform lockstep._state_rest(j.job, rows_left, total, case when rows_left > 0 then lockstep._session() end);
end;
$$;
comment on function lockstep._set_rest(lockstep.job, bigint, bigint) is
    'Record in j''s status row the rows of a recompute without a parent still to write, held by this '
    'session (total NULL: keep the one recorded); none when rows_left is 0. Locks: the job''s '
    'lockstep.job_state row (by the update).';

-- lockstep._state_rest(job, rows_left, total, session): lockstep._set_rest's update of job's status row
-- (session: the one holding the rest). Security definer, for a caller that manages job (42501): no recipe
-- role holds UPDATE on lockstep.job_state.
-- locks: the job's lockstep.job_state row (by the update).
create or replace function lockstep._state_rest(job text, rows_left bigint, total bigint, session text) returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    perform lockstep._check_manages(job);
    update lockstep.job_state st
    set recompute_rest = nullif(rows_left, 0),
        recompute_total = case when rows_left > 0 then coalesce(total, st.recompute_total) end,
        recompute_rest_session = case when rows_left > 0 then session end,
        recompute_rest_at = clock_timestamp()
    where st.job = _state_rest.job;
end;
$$;
comment on function lockstep._state_rest(text, bigint, bigint, text) is
    'Lockstep._set_rest''s update of job''s status row (session: the one holding the rest). Security '
    'definer, for a caller that manages job (42501). Locks: the job''s lockstep.job_state row (by the '
    'update).';

-- lockstep._continue(j): run() of a parentless job with a recompute's rest: write its next batch if this
-- session holds it; busy while another live session does; else recompute again.
-- locks: the group lock (try: busy if taken: lockstep._take); then as lockstep._write_steps; the job's
-- status row last.
create or replace function lockstep._continue(j lockstep.job) returns lockstep.result
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    s lockstep.job_state;
    t record;
    v lockstep.job := j;
    v_started timestamptz := clock_timestamp();
    v_left bigint;
    v_err text;
    p lockstep._pass;
begin
    select * into t from lockstep._take(j, 'recompute', false);
    if (t.refused).outcome is not null then
        return t.refused;
    end if;
    s := t.s;
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
    v_left := p.handed_off;
    if v_left < 0 then  -- this session's rest table is gone (DISCARD TEMP): recompute again
        return lockstep._recompute(j, false);
    end if;
    perform lockstep._set_rest(j, v_left);
    perform lockstep._finish(j, 'recompute', 'done', v_started, p);
    return lockstep._result('done', j.job, 'recompute', p, null, v_left > 0);
end;
$$;
comment on function lockstep._continue(lockstep.job) is
    'Run() of a parentless job with a recompute''s rest: write its next batch if this session holds it; '
    'busy while another live session does; else recompute again. Locks: the group lock (try: busy if '
    'taken: lockstep._take); then as lockstep._write_steps; the job''s status row last.';

-- lockstep._hand_off(j, keys, before, written, queued_from, todo): queue the keys not yet queued and
-- record the hand-off's queue-id range (from queued_from at most) and total (todo: counted before the
-- write; NULL: counted here) in the job's status row, carrying on an earlier hand-off in progress.
-- locks: appends to lockstep.queue; the job's lockstep.job_state row (FOR NO KEY UPDATE, by the update).
create or replace function lockstep._hand_off(j lockstep.job, keys text[], before bigint, written bigint,
                                   queued_from bigint, todo bigint)
returns void
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
            perform lockstep._state_handoff(j.job, null, null, null);
        end if;
        return;
    end if;
    select min(q.id), max(q.id) into v_from, v_to from lockstep.queue q where q.job = j.job and q.id > before;
    if v_old then
        v_from := s.recompute_queue_from;
        v_to := coalesce(v_to, s.recompute_queue_to);
    end if;
    -- from the first entry of a changed parent queued before this recompute, or of a handed-off parent
    -- queued already (every parent, after a poisoned whole-table pass)
    v_from := least(v_from, queued_from,
                    (select min(e.id) from pg_catalog.unnest(keys) k(key),
                         lateral (select min(q.id) as id from lockstep.queue q
                                  where q.key = k.key and (q.job = j.job) is true and q.id <= before) e));
    -- to at least the queue's end when the recompute began, if the range starts before it (parents all
    -- queued already leave no new entry)
    if v_from <= before then
        v_to := greatest(v_to, before);
    end if;
    -- to do: as counted before the write, plus the skipped parents queued since
    v_total := written + coalesce(todo + v_queued, lockstep._handoff_todo(j.job, v_from, v_to));
    perform lockstep._state_handoff(j.job, case when v_old then greatest(s.recompute_total, v_total) else v_total end,
                                    v_from, v_to);
end;
$$;
comment on function lockstep._hand_off(lockstep.job, text[], bigint, bigint, bigint, bigint) is
    'Queue the keys not yet queued and record the hand-off''s queue-id range (from queued_from at most) '
    'and total (todo: counted before the write; NULL: counted here) in the job''s status row, carrying on '
    'an earlier hand-off in progress. Locks: appends to lockstep.queue; the job''s lockstep.job_state row '
    '(FOR NO KEY UPDATE, by the update).';

-- lockstep._state_handoff(job, total, queue_from, queue_to): record a recompute's hand-off in job's status
-- row: its parents to do and its queue-id range (all NULL: none in progress). Security definer, for a
-- caller that manages job (42501): no recipe role holds UPDATE on lockstep.job_state.
-- locks: the job's lockstep.job_state row (FOR NO KEY UPDATE, by the update).
create or replace function lockstep._state_handoff(job text, total bigint, queue_from bigint, queue_to bigint)
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    perform lockstep._check_manages(job);
    update lockstep.job_state x set recompute_total = total, recompute_queue_from = queue_from,
                                    recompute_queue_to = queue_to
    where x.job = _state_handoff.job;
end;
$$;
comment on function lockstep._state_handoff(text, bigint, bigint, bigint) is
    'Record a recompute''s hand-off in job''s status row: its parents to do and its queue-id range (all '
    'NULL: none in progress). Security definer, for a caller that manages job (42501). Locks: the job''s '
    'lockstep.job_state row (FOR NO KEY UPDATE, by the update).';

-- lockstep._state_poisoned(job): a recompute's whole-table pass failed on poison parents: job's recompute
-- flags wait (recompute_poisoned_at now) until a failed key is written. Security definer, for a caller
-- that manages job (42501): no recipe role holds UPDATE on lockstep.job_state.
-- locks: the job's lockstep.job_state row (FOR NO KEY UPDATE, by the update).
create or replace function lockstep._state_poisoned(job text) returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    perform lockstep._check_manages(job);
    update lockstep.job_state s set recompute_poisoned_at = now(), recompute_poison_cured = false
    where s.job = _state_poisoned.job;
end;
$$;
comment on function lockstep._state_poisoned(text) is
    'A recompute''s whole-table pass failed on poison parents: job''s recompute flags wait until a failed '
    'key is written. Security definer, for a caller that manages job (42501). Locks: the job''s '
    'lockstep.job_state row (FOR NO KEY UPDATE, by the update).';

-- lockstep._parent_keys(j): every parent key of j, in key order, read as j's owner (lockstep._as_owner).
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
    where a.attrelid = j.parent and a.attname = j.parent_key and not a.attisdropped and a.atttypid <> j.key_type
    union all  -- a composite key: a key column whose type is no longer its field's
    select pg_catalog.format('the parent key column %s.%I is %s, but field %I of job "%s"''s key type %s is %s: run '
                             'lockstep.define_derived again, with a key type of the parent key''s column types',
                             j.parent, k.c, pg_catalog.format_type(a.atttypid, null), f.attname, j.job, j.key_type,
                             pg_catalog.format_type(f.atttypid, null))
    from pg_catalog.unnest(j.parent_keys) with ordinality k(c, o)
    join pg_catalog.pg_attribute a on a.attrelid = j.parent and a.attname = k.c and not a.attisdropped
    join pg_catalog.pg_type y on y.oid = j.key_type
    join pg_catalog.pg_attribute f on f.attrelid = y.typrelid and f.attnum = k.o
    where j.parent_key is null and a.atttypid <> f.atttypid
    limit 1;
$$;

-- lockstep._recompute_failed(j, started, error, sqlstate, queued_from): the whole-table pass raised: a
-- definition or job error fails the run; else (poison parents) every parent goes to the worker and the flags wait.
-- locks: the group lock is already held; the empty pass as lockstep._write (no row lock); then as
-- lockstep._hand_off; the job's status row last.
create or replace function lockstep._recompute_failed(j lockstep.job, started timestamptz, error text, sqlstate text,
                                          queued_from bigint)
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
    -- a transient error is likely the moment's: retried once within a minute before the bisection
    if lockstep._transient(sqlstate)
       and (select s.recompute_error is null from lockstep.job_state s where s.job = j.job) then
        v_result := lockstep._failed(j, 'recompute', started, error);
        perform lockstep._due_by(j.job, now() + interval '1 minute');
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
        perform lockstep._hand_off(j, v_keys, v_before, case when cardinality(v_keys) > 0 then 0 end, queued_from, null);
    exception when data_exception then
        -- a parent key the job's key type cannot hold: the parent key column was retyped
        get stacked diagnostics v_msg = message_text;
        return lockstep._failed(j, 'recompute', started, pg_catalog.format(
            '%s; its parents could not be handed to the worker either (%s)%s', error, v_msg,
            coalesce('; ' || lockstep._key_type_drift(j), '')));
    end;
    v_msg := pg_catalog.format('the whole-table pass failed (%s); its %s parents were handed to the worker, '
                               'which isolates the failing ones (lockstep.failing_keys)', error, cardinality(v_keys));
    -- a done run with its reason: lockstep.run_log.error has it (the status row keeps last_error for failures)
    perform lockstep._finish(j, 'recompute', 'done', started, null, v_msg);
    -- the flags wait for the next periodic recompute, a retry or a cure: the same pass would fail again
    perform lockstep._state_poisoned(j.job);
    return lockstep._result('done', j.job, 'recompute', null, v_msg, cardinality(v_keys) > 0);
end;
$$;
comment on function lockstep._recompute_failed(lockstep.job, timestamp with time zone, text, text, bigint) is
    'The whole-table pass raised: a definition or job error fails the run; else (poison parents) every '
    'parent goes to the worker and the flags wait. Locks: the group lock is already held; the empty pass '
    'as lockstep._write (no row lock); then as lockstep._hand_off; the job''s status row last.';

-- lockstep._recompute(j, only_if_due): the full recompute under the group lock, writing at most
-- j.batch_parents parents in this transaction and handing the rest to the queue. A flagged recompute that
-- writes every parent hands off the entries queued before it: its next flag waits for the worker (rule 7).
-- locks: the group lock (try: busy if taken: lockstep._take); then as lockstep._write for the first batch (the rest
-- appended to the queue before its first row lock); then the queue (skipped parents); the job's status row last.
create or replace function lockstep._recompute(j lockstep.job, only_if_due boolean) returns lockstep.result
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    t record;
    r record;
    v_before bigint;
    v_from bigint;
    v_rest bigint;
    v_snap pg_snapshot;
    v_first bigint;
    p lockstep._pass;
begin
    select * into t from lockstep._take(j, 'recompute', only_if_due);
    if (t.refused).outcome is not null then
        return t.refused;
    end if;
    select coalesce(max(q.id), 0) into v_before from lockstep.queue q where q.job = j.job;
    -- where this recompute's hand-off starts: at an earlier hand-off in progress, else after v_before
    v_from := case when (t.s).recompute_total is not null
                        and lockstep._handoff_any(j.job, (t.s).recompute_queue_from, (t.s).recompute_queue_to)
                   then (t.s).recompute_queue_from else v_before + 1 end;
    v_snap := pg_catalog.pg_current_snapshot();  -- flags this snapshot sees are covered by this recompute
    if exists (select from lockstep.recompute_flag f where f.job = j.job) then
        select min(q.id) into v_first from lockstep.queue q where q.job = j.job and q.id <= v_before;
    end if;
    select * into r from lockstep._owner_pass(j, null, v_from, false);
    if r.timed_out then
        return lockstep._failed(j, 'recompute', t.started, r.error);
    elsif r.error is not null then
        return lockstep._recompute_failed(j, t.started, r.error, r.state, v_from);
    end if;
    p := r.p;
    -- the rest of the difference was handed off (_limit_batch) or, without a parent, kept (_limit_rows)
    v_rest := coalesce(p.handed_off, 0);
    if j.parent is null and (v_rest > 0 or (t.s).recompute_rest is not null) then
        perform lockstep._set_rest(j, v_rest, v_rest + p.inserted + p.updated + p.deleted + cardinality(p.skipped));
    elsif j.parent is not null then
        perform lockstep._hand_off(j, p.skipped, v_before,
                                   case when v_rest > 0 then j.batch_parents - cardinality(p.skipped)
                                        when v_first is not null then 0 end,
                                   case when v_rest > 0 then coalesce(p.handoff_from, v_from) else v_first end,
                                   p.handoff_todo);
    end if;
    perform lockstep._clear_flag(j, v_snap, t.started);
    -- every parent computed and written here: failing and parked keys cured (after a hand-off: due at once)
    if v_rest = 0 then
        perform lockstep._cure(j);
    elsif j.parent is not null then
        perform lockstep._cure(j, true);
    end if;
    perform lockstep._finish(j, 'recompute', 'done', t.started, p);
    return lockstep._result('done', j.job, 'recompute', p, null, v_rest > 0);
end;
$$;
comment on function lockstep._recompute(lockstep.job, boolean) is
    'The full recompute under the group lock, writing at most j.batch_parents parents in this transaction '
    'and handing the rest to the queue. A flagged recompute that writes every parent hands off the entries '
    'queued before it: its next flag waits for the worker. Locks: the group lock (try: busy if taken: lockstep._take); then '
    'as lockstep._write for the first batch (the rest appended to the queue before its first row lock); '
    'then the queue (skipped parents); the job''s status row last.';

-- lockstep._cure(j, handed_off): after a recompute that computed every parent: forget j's failing and
-- parked keys (handed_off: those still queued keep their attempts, due at once).
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
    -- a key type lockstep may not convert (lockstep._key_type_refused): the failures stay, and the next
    -- worker pass fails saying why
    if cardinality(v_keys) = 0 or lockstep._key_type_refused(j.job, j.key_type) is not null then
        return;
    end if;
    v_bad := coalesce((lockstep._readable(j, v_keys)).bad, '{}');
    if handed_off then
        v_kept := array(select k from pg_catalog.unnest(v_keys) k
                        where k <> all(v_bad)
                          and exists (select from lockstep.queue q where q.key = k and (q.job = j.job) is true));
        perform lockstep._failures_due(j.job, v_kept);
    end if;
    perform lockstep._delete('key_failure', j.job, other_keys => v_kept);
    if cardinality(v_bad) > 0 then
        perform lockstep._delete('queue', j.job, v_bad);
    end if;
end;
$$;
comment on function lockstep._cure(lockstep.job, boolean) is
    'After a recompute that computed every parent: forget j''s failing and parked keys (handed_off: those'
    ' still queued keep their attempts, due at once). Locks: the job''s key_failure rows (updated, '
    'deleted), then the queue entries of keys that do not read back.';

-- lockstep._failures_due(job, keys): job's failing and parked keys in keys are due at once, keeping their
-- attempts (a parked key's fold point forgotten: its entries are all news). Security definer, for a caller
-- that manages job (42501): no recipe role holds UPDATE on key_failure.
-- locks: those key_failure rows (by the update).
create or replace function lockstep._failures_due(job text, keys text[]) returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    perform lockstep._check_manages(job);
    update lockstep.key_failure f set retry_at = now(), failed_upto = case when f.parked then 0 else f.failed_upto end
    where f.job = _failures_due.job and f.key = any(keys);
end;
$$;
comment on function lockstep._failures_due(text, text[]) is
    'Job''s failing and parked keys in keys are due at once, keeping their attempts (a parked key''s fold '
    'point forgotten). Security definer, for a caller that manages job (42501). Locks: those key_failure '
    'rows (by the update).';

-- lockstep.recompute(job): full recompute now, even if not due (and even during a failure backoff); a paused
-- job (lockstep.pause): outcome paused, nothing written.
-- locks: as lockstep._recompute.
create or replace function lockstep._recompute_job(job text) returns lockstep.result
language plpgsql
set search_path = pg_catalog, pg_temp
set jit = off  -- lockstep._no_jit_note (03_helpers.sql)
set datestyle = 'ISO, YMD'
set intervalstyle = 'postgres'
set extra_float_digits = 1
as $$
declare
    j lockstep.job;
begin
    perform lockstep._check_isolation('lockstep.recompute()');
    j := lockstep._job(job, 'derived');
    if j.paused_at is not null then  -- lockstep.pause (15_controls.sql): nothing written
        return lockstep._paused(j, 'recompute');
    end if;
    return lockstep._recompute(j, false);
end;
$$;

comment on function lockstep._recompute_job(text) is
    'The body of lockstep.recompute, under lockstep''s pinned settings (lockstep.recompute puts back the caller''s '
    'settings after it). Locks: as lockstep.recompute.';

-- lockstep.recompute(job): a full recompute now (lockstep._recompute_job).
-- Runs as the caller, with no SET clause: it reads the caller's settings (lockstep._settings) and puts
-- back any the job's code changed for the session; every name is qualified.
-- locks: as lockstep._recompute_job.
create or replace function lockstep.recompute(job text) returns lockstep.result
language plpgsql
as $$
declare
    v_was pg_catalog.text[] := lockstep._settings();
    v_now pg_catalog.text[];
    r lockstep.result;
begin
    r := lockstep._recompute_job(job);
    v_now := lockstep._settings();
    if v_now operator(pg_catalog.<>) v_was then
        perform lockstep._restore_settings(v_was, v_now);
    end if;
    return r;
end;
$$;

comment on function lockstep.recompute(text) is
    'Full recompute now, even if not due (and even during a failure backoff); a paused job: outcome '
    'paused, nothing written. Locks: as '
    'lockstep._recompute.';

-- lockstep.set_batch_parents(job, batch_parents): parents written per transaction (default 500) by a
-- recompute batch and a worker pass. Smaller: shorter row locks, more transactions.
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
    perform lockstep._update_job(j.job, batch_parents => batch_parents);  -- security definer
end;
$$;
comment on function lockstep.set_batch_parents(text, integer) is
    'Parents written per transaction (default 500) by a recompute batch and a worker pass. Smaller: '
    'shorter row locks, more transactions. Locks: the job''s registry row.';
