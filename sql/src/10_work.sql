-- lockstep: the incremental worker: claim queued keys, apply them, isolate poison keys; retry.

-- lockstep._add(a, b): sum two passes.
create or replace function lockstep._add(a lockstep._pass, b lockstep._pass) returns lockstep._pass
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select row(a.inserted + b.inserted, a.updated + b.updated, a.deleted + b.deleted, a.skipped || b.skipped,
               a.gone + b.gone, a.compute_ms + b.compute_ms, a.write_ms + b.write_ms,
               a.failed || b.failed, a.errors || b.errors,
               coalesce(a.timed_out, b.timed_out), coalesce(a.timed_out_error, b.timed_out_error),
               coalesce(a.transient, b.transient), a.untried || b.untried,
               a.cured or b.cured, coalesce(a.handed_off, b.handed_off), coalesce(a.handoff_from, b.handoff_from),
               coalesce(a.handoff_todo, b.handoff_todo))::lockstep._pass;
$$;

-- lockstep._transient(state): an error likely the moment's, not the keys': 55P03, 40P01, 40001. A pass
-- that meets one fails as a whole and its keys stay queued; after 3 such passes in a row it bisects.
create or replace function lockstep._transient(state text) returns boolean
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select coalesce(state in ('55P03', '40P01', '40001'), false);
$$;

-- lockstep._whole_pass_error(state, whole): this pass treats that SQLSTATE as the moment's
-- (lockstep._transient), failing the pass as a whole: whole, set by lockstep._work for the job's first 3
-- failed passes in a row.
create or replace function lockstep._whole_pass_error(state text, whole boolean) returns boolean
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select lockstep._transient(state) and coalesce(whole, false);
$$;

-- lockstep._try(j, keys, dry): one attempt at keys, in a subtransaction (lockstep._owner_pass): its pass,
-- or its error and SQLSTATE. A statement timeout returns an empty pass naming the keys (timed_out): after
-- it nothing in the statement is bounded, so the callers try nothing else. dry: a good attempt is rolled
-- back too.
-- locks: as lockstep._write (nothing is left behind by a failed or dry attempt).
create or replace function lockstep._try(j lockstep.job, keys text[], dry boolean default false, out p lockstep._pass,
                              out error text, out state text)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    t record;
begin
    select * into t from lockstep._owner_pass(j, keys, null, dry);
    if t.timed_out then
        p := row(0, 0, 0, '{}', 0, 0, 0, '{}', '{}');
        p.timed_out := keys;
        p.timed_out_error := t.error;
        return;
    end if;
    p := t.p;
    error := t.error;
    state := t.state;
end;
$$;
comment on function lockstep._try(lockstep.job, text[], boolean) is
    'One attempt at keys, in a subtransaction (lockstep._owner_pass): its pass, or its error and '
    'SQLSTATE. A statement timeout returns an empty pass naming the keys (timed_out): after it nothing in '
    'the statement is bounded, so the callers try nothing else. dry: a good attempt is rolled back too. '
    'Locks: as lockstep._write (nothing is left behind by a failed or dry attempt).';

-- lockstep._isolate(j, keys, error, dry, whole): apply keys, bisecting on failure until the failing keys
-- are alone (dry: only find them). After a statement timeout (timed_out) or an error that fails the pass as
-- a whole (transient: lockstep._whole_pass_error), the parts not tried come back in skipped, not blamed.
-- locks: as lockstep._write, once per part that succeeds (dry: released with the part).
create or replace function lockstep._isolate(j lockstep.job, keys text[], error text default null, dry boolean default false,
                                  whole boolean default false)
returns lockstep._pass
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    n integer := cardinality(keys);
    v_err text := error;
    t record;
    a lockstep._pass := row(0, 0, 0, '{}', 0, 0, 0, '{}', '{}');
begin
    if v_err is null then
        select * into t from lockstep._try(j, keys, dry);
        if t.error is null and dry then  -- went through, rolled back: only its compute time counts
            a.compute_ms := (t.p).compute_ms;
            a.timed_out := (t.p).timed_out;
            a.timed_out_error := (t.p).timed_out_error;
            return a;
        elsif t.error is null then
            return t.p;
        elsif lockstep._whole_pass_error(t.state, whole) then  -- lockstep._work fails the pass
            a.skipped := keys;
            a.transient := t.error;
            return a;
        end if;
        v_err := t.error;
    end if;
    if n = 1 then
        a.failed := keys;
        a.errors := array[v_err];
        return a;
    end if;
    a := lockstep._isolate(j, keys[1:n / 2], null, dry, whole);
    if a.timed_out is not null or a.transient is not null then
        a.skipped := a.skipped || keys[n / 2 + 1:n];  -- not tried, not blamed
        return a;
    end if;
    return lockstep._add(a, lockstep._isolate(j, keys[n / 2 + 1:n], null, dry, whole));
end;
$$;
comment on function lockstep._isolate(lockstep.job, text[], text, boolean, boolean) is
    'Apply keys, bisecting on failure until the failing keys are alone (dry: only find them). After a '
    'statement timeout (timed_out) or an error that fails the pass as a whole (transient: '
    'lockstep._whole_pass_error), the parts not tried come back in skipped, not blamed. Locks: as '
    'lockstep._write, once per part that succeeds (dry: released with the part).';

-- lockstep._write_good(j, keys, p, whole): after a dry bisection, write the good keys in one attempt, so
-- one write phase holds row locks; if that fails, bisect writing each part. After a statement timeout or
-- a transient error nothing more is tried (skipped).
-- locks: as lockstep._write, for the good keys (or, on a failure, once per part that succeeds).
create or replace function lockstep._write_good(j lockstep.job, keys text[], p lockstep._pass, whole boolean)
returns lockstep._pass
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_good text[] := array(select k from pg_catalog.unnest(keys) k
                           where k <> all(p.failed) and k <> all(p.skipped)
                             and k <> all(coalesce(p.timed_out, '{}')));
    t record;
begin
    if cardinality(v_good) = 0 then
        return p;
    elsif p.timed_out is not null or p.transient is not null then
        p.skipped := p.skipped || v_good;
        return p;
    end if;
    select * into t from lockstep._try(j, v_good);
    if t.error is null then
        return lockstep._add(p, t.p);
    elsif lockstep._whole_pass_error(t.state, whole) then  -- lockstep._work fails the pass
        p.skipped := p.skipped || v_good;
        p.transient := t.error;
        return p;
    end if;
    return lockstep._add(p, lockstep._isolate(j, v_good, t.error, false, whole));
end;
$$;
comment on function lockstep._write_good(lockstep.job, text[], lockstep._pass, boolean) is
    'After a dry bisection, write the good keys in one attempt, so one write phase holds row locks; if '
    'that fails, bisect writing each part. After a statement timeout or a transient error nothing more is '
    'tried (skipped). Locks: as lockstep._write, for the good keys (or, on a failure, once per part that '
    'succeeds).';

-- lockstep._has_ready(j): j has ready queue entries whose key is neither parked nor waiting for a retry.
-- Custom plans, index scans only: it stops at the first ready entry whatever the statistics.
create or replace function lockstep._has_ready(j lockstep.job) returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
set enable_bitmapscan = off
set enable_seqscan = off
as $$
begin
    return exists (
        select from lockstep.queue q
        where q.job = j.job and q.ready_at <= now()
          and not exists (select from lockstep.key_failure f
                          where f.job = q.job and f.key = q.key
                            and (f.retry_at > now() or (f.parked and q.id = f.failed_upto))));  -- see _claim
end;
$$;

-- lockstep._batch(j, batch): the keys of the oldest ready entries, up to batch entries whose key has no
-- key_failure row, and whether batch entries were taken (full: more may be ready).
create or replace function lockstep._batch(j lockstep.job, batch integer, out keys text[], out full boolean)
language plpgsql stable
set search_path = pg_catalog, pg_temp
set plan_cache_mode = force_generic_plan
as $$
begin
    select array_agg(distinct c.key), count(*) >= batch into keys, full
    from (select q.key from lockstep.queue q
          where q.job = j.job and q.ready_at <= now()
            and not exists (select from lockstep.key_failure f where f.job = q.job and f.key = q.key)
          order by q.id limit batch) c;
end;
$$;

-- lockstep._entries(j, keys): every visible queue entry of j with one of these keys: id, ctid, key. One
-- probe of the (key, job) index per key; the job test only filters (`is true`), whatever the statistics.
create or replace function lockstep._entries(j lockstep.job, keys text[], out ids bigint[], out ctids tid[], out entry_keys text[])
language plpgsql stable
set search_path = pg_catalog, pg_temp
set plan_cache_mode = force_generic_plan
set enable_seqscan = off
set enable_bitmapscan = off
as $$
begin
    select array_agg(e.id), array_agg(e.ctid), array_agg(e.key) into ids, ctids, entry_keys
    from (select distinct x from pg_catalog.unnest(keys) x) k(key),
         lateral (select q.id, q.ctid, q.key from lockstep.queue q
                  where q.key = k.key and (q.job = j.job) is true offset 0) e;
end;
$$;

-- lockstep._settle_entries(j, ids, ctids, entry_canon, leave, skip, fold): delete the entries done (not of a
-- key in leave), defer those of keys in skip a second, and fold those of a key in fold into its oldest
-- entry, its key rewritten in canonical text (returned: held_keys, held_ids); each by row id, checked again
-- by id and job. Security definer, for a caller that manages j (42501): no recipe role holds UPDATE or
-- DELETE on the queue.
-- locks: those queue entries (deleted or updated; disjoint rows: skip and fold are part of leave, fold wins).
create or replace function lockstep._settle_entries(j lockstep.job, ids bigint[], ctids tid[], entry_canon text[], leave text[],
                                         skip text[], fold text[], out held_keys text[], out held_ids bigint[])
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set plan_cache_mode = force_generic_plan
set enable_seqscan = off
set enable_bitmapscan = off
as $$
declare
    v_done tid[] := ctids;
    v_done_ids bigint[] := ids;
    v_skipped tid[] := '{}';
    v_skipped_ids bigint[] := '{}';
    v_held tid[] := '{}';
begin
    perform lockstep._check_manages(j.job);
    held_keys := '{}';
    held_ids := '{}';
    if cardinality(leave) > 0 then
        select coalesce(array_agg(e.c) filter (where l.k is null or (f.k is not null and e.i <> e.first)), '{}'),
               coalesce(array_agg(e.i) filter (where l.k is null or (f.k is not null and e.i <> e.first)), '{}'),
               coalesce(array_agg(e.c) filter (where s.k is not null and f.k is null), '{}'),
               coalesce(array_agg(e.i) filter (where s.k is not null and f.k is null), '{}'),
               coalesce(array_agg(e.c) filter (where f.k is not null and e.i = e.first), '{}'),
               coalesce(array_agg(e.k) filter (where f.k is not null and e.i = e.first), '{}'),
               coalesce(array_agg(e.i) filter (where f.k is not null and e.i = e.first), '{}')
        into v_done, v_done_ids, v_skipped, v_skipped_ids, v_held, held_keys, held_ids
        from (select u.*, min(u.i) over (partition by u.k) as first
              from unnest(ctids, ids, entry_canon) u(c, i, k)) e  -- ROWS FROM syntax: not schema-qualified
        left join (select distinct x from pg_catalog.unnest(leave) x) l(k) on l.k = e.k
        left join (select distinct x from pg_catalog.unnest(skip) x) s(k) on s.k = e.k
        left join (select distinct x from pg_catalog.unnest(fold) x) f(k) on f.k = e.k;
    end if;
    -- one statement for both, run even with no row: a missing privilege fails every pass at once
    with d as (delete from lockstep.queue q using unnest(v_done, v_done_ids) u(c, i)
               where q.ctid = u.c and (q.id = u.i) is true and (q.job = j.job) is true),
         h as (update lockstep.queue q set key = u.k
               from unnest(v_held, held_ids, held_keys) u(c, i, k)
               where q.ctid = u.c and (q.id = u.i) is true and (q.job = j.job) is true and q.key <> u.k)
    update lockstep.queue q set ready_at = lockstep._defer_until()
    from unnest(v_skipped, v_skipped_ids) u(c, i)
    where q.ctid = u.c and (q.id = u.i) is true and (q.job = j.job) is true;
end;
$$;
comment on function lockstep._settle_entries(lockstep.job, bigint[], tid[], text[], text[], text[], text[]) is
    'Delete the entries done (not of a key in leave), defer those of keys in skip a second, and fold those '
    'of a key in fold into its oldest entry, its key in canonical text; each by row id, checked again by id. '
    'Locks: those queue entries (deleted or updated; disjoint rows: skip and fold are part of leave).';

-- lockstep._claim(j, batch): the keys of this pass and how to apply them (kind), first of: probe (half of
-- the ready suspects), retry (ready failing keys, and parked keys queued again; each alone), batch. Generic
-- plans: it runs no user code.
create or replace function lockstep._claim(j lockstep.job, batch integer, out keys text[], out kind text, out full boolean)
language plpgsql stable
set search_path = pg_catalog, pg_temp
set plan_cache_mode = force_generic_plan
as $$
begin
    -- the common case, no failing key due and no parked key queued again: straight to the batch
    if not exists (select from lockstep.key_failure f where f.job = j.job and not f.parked and f.retry_at <= now())
       and not exists (select from lockstep.key_failure f
                       where f.job = j.job and f.parked and f.retry_at <= now()
                         and exists (select from lockstep.queue q where q.key = f.key and (q.job = f.job) is true
                                     and q.id <> f.failed_upto)) then
        select b.keys, b.full, 'batch' into keys, full, kind from lockstep._batch(j, batch) b;
        return;
    end if;
    select array_agg(f.key order by f.key) into keys
    from (select f.key from lockstep.key_failure f
          where f.job = j.job and f.attempts = 0 and not f.parked and f.retry_at <= now()
            and exists (select from lockstep.queue q where q.key = f.key and (q.job = f.job) is true
                        and q.ready_at <= now())
          order by f.key limit 2 * batch) f;
    if keys is not null then
        keys := keys[1:(cardinality(keys) + 1) / 2];
        kind := 'probe';
        return;
    end if;
    select array_agg(f.key order by f.key) into keys
    from (select f.key from lockstep.key_failure f
          where f.job = j.job and f.attempts > 0 and f.retry_at <= now()
            and exists (select from lockstep.queue q where q.key = f.key and (q.job = f.job) is true
                        and (not f.parked or q.id <> f.failed_upto) and q.ready_at <= now())
          order by f.retry_at, f.key limit batch) f;
    if keys is not null then
        kind := 'retry';
        return;
    end if;
    select b.keys, b.full, 'batch' into keys, full, kind from lockstep._batch(j, batch) b;
end;
$$;

-- lockstep._sorted_keys(j, keys): keys read back as j's parent key type, distinct, sorted as the type
-- sorts, as canonical text (lockstep._canon, under its settings); raises if one does not read back.
-- Composite keys in canonical text already (lockstep._canonical_keys) are sorted by their fields as they
-- are: no record comparison and no record text made again.
create or replace function lockstep._sorted_keys(j lockstep.job, keys text[]) returns text[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
set datestyle = 'ISO, YMD'
set intervalstyle = 'postgres'
set extra_float_digits = 1
set timezone = 'UTC'
set bytea_output = 'hex'
set lc_monetary = 'C'
as $$
declare
    v text[];
begin
    perform lockstep._check_key_type_safe(j.job, j.key_type);
    if j.parent_column is null and lockstep._canonical_keys(j.key_type, keys) then
        -- one canonical text per key: distinct by its fields, in the record's order (lockstep._key_order)
        execute pg_catalog.format(
            'select array(select distinct on (%1$s) u.t from (select pg_catalog.unnest($1) as t, '
            'pg_catalog.unnest($1::%2$s) as k) u order by %1$s)',
            lockstep._key_order(j, 'u.k'), lockstep._array_type(j.key_type)) into v using keys;
        return v;
    end if;
    execute pg_catalog.format('select lockstep._canon($1::%s)', lockstep._array_type(j.key_type)) into v using keys;
    return v;
end;
$$;

-- lockstep._canon_each(j, keys): the canonical text of each queued key, in the order given; NULL for a key
-- that does not read back as j's parent key type. Maps the queued text of a pass's entries to the keys
-- its failures are recorded under ('04' and '4' name one parent).
create or replace function lockstep._canon_each(j lockstep.job, keys text[]) returns text[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    k text;
    v text[] := '{}';
begin
    if j.key_type = 'text'::pg_catalog.regtype
       or (j.key_type = any(array['bigint', 'integer']::pg_catalog.regtype[])
           and pg_catalog.array_to_string(keys, ',') ~ '^(0|-?[1-9][0-9]{0,8})(,(0|-?[1-9][0-9]{0,8}))*$')
       or (j.parent_column is null and lockstep._canonical_keys(j.key_type, keys)) then
        return keys;  -- canonical already (the common case)
    end if;
    begin  -- every key is canonical when each is the canonical text of some key: one conversion, not one per key
        if keys <@ lockstep._sorted_keys(j, keys) then
            return keys;
        end if;
    exception when others then
        null;  -- some key does not read back: one by one
    end;
    foreach k in array keys loop
        v := v || (lockstep._readable(j, array[k])).canon[1];
    end loop;
    return v;
end;
$$;

-- lockstep._readable(j, keys): the queued keys read back as the parent key type: canon (canonical,
-- distinct, sorted) and raw; a key that does not read back goes to bad, its error in errors.
create or replace function lockstep._readable(j lockstep.job, keys text[], out canon text[], out raw text[],
                                   out bad text[], out errors text[])
language plpgsql stable
set search_path = pg_catalog, pg_temp
set datestyle = 'ISO, YMD'
set intervalstyle = 'postgres'
set extra_float_digits = 1
set timezone = 'UTC'
set bytea_output = 'hex'
set lc_monetary = 'C'
as $$
declare
    k text;
    v_one text;
    v_err text;
    v_all text := pg_catalog.array_to_string(keys, ',');
    v_one_each boolean := pg_catalog.length(v_all) - pg_catalog.length(pg_catalog.replace(v_all, ',', ''))
                          = pg_catalog.cardinality(keys) - 1;
begin
    bad := '{}';
    errors := '{}';
    raw := keys;
    if j.key_type = 'bigint'::pg_catalog.regtype and v_one_each and v_all ~ '^-?[0-9]{1,18}(,-?[0-9]{1,18})*$' then
        select array_agg(v::text order by v) into canon from (select distinct r::bigint as v from pg_catalog.unnest(keys) r) s;
        return;
    elsif j.key_type = 'integer'::pg_catalog.regtype and v_one_each and v_all ~ '^-?[0-9]{1,9}(,-?[0-9]{1,9})*$' then
        select array_agg(v::text order by v) into canon from (select distinct r::integer as v from pg_catalog.unnest(keys) r) s;
        return;
    elsif j.key_type = 'text'::pg_catalog.regtype then
        select array_agg(v order by v) into canon from (select distinct r as v from pg_catalog.unnest(keys) r) s;
        return;
    elsif j.parent_column is null and lockstep._canonical_keys(j.key_type, keys) then
        canon := lockstep._sorted_keys(j, keys);  -- raises if the key type is refused; each key reads back
        return;
    end if;
    perform lockstep._check_key_type_safe(j.job, j.key_type);  -- raises: no key is converted
    begin
        canon := lockstep._sorted_keys(j, keys);
        raw := keys;
        return;
    exception when others then
        null;  -- some key does not read back: find which, one by one
    end;
    raw := '{}';
    canon := '{}';
    foreach k in array keys loop
        begin
            execute pg_catalog.format('select (lockstep._canon(array[$1::%s]))[1]', lockstep._type_sql(j.key_type))
                into v_one using k;
            raw := raw || k;
            canon := canon || v_one;
        exception when others then
            get stacked diagnostics v_err = message_text;
            bad := bad || k;
            errors := errors || pg_catalog.format('lockstep: queued key cannot be read as %s: %s', j.key_type, v_err);
        end;
    end loop;
    -- canonical and sorted as the type sorts when the keys left read back together, else as text
    if cardinality(canon) > 0 then
        begin
            canon := lockstep._sorted_keys(j, canon);
        exception when others then
            canon := array(select distinct c from pg_catalog.unnest(canon) c order by c);
        end;
    end if;
end;
$$;

-- lockstep._retry_budget(): how long a retry pass goes on trying keys once it holds row locks: 50 ms.
create or replace function lockstep._retry_budget() returns interval
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select interval '50 milliseconds';
$$;

-- lockstep._retry_each(j, keys, whole): a retry pass: each key alone, written as it goes, until row locks
-- have been held for lockstep._retry_budget() or a statement timeout: the rest is left for the next pass
-- (untried). After a transient error the rest is not tried (skipped).
-- locks: as lockstep._isolate, once per key.
create or replace function lockstep._retry_each(j lockstep.job, keys text[], whole boolean) returns lockstep._pass
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    k text;
    p lockstep._pass := row(0, 0, 0, '{}', 0, 0, 0, '{}', '{}');
    v_untried text[] := '{}';
    v_first_write timestamptz := 'infinity';
begin
    foreach k in array keys loop
        if clock_timestamp() > v_first_write + lockstep._retry_budget() or p.timed_out is not null then
            v_untried := v_untried || k;
        elsif p.transient is not null then
            p.skipped := p.skipped || k;  -- not tried, not blamed
        else
            p := lockstep._add(p, lockstep._isolate(j, array[k], null, false, whole));
            if v_first_write = 'infinity' and p.inserted + p.updated + p.deleted > 0 then
                v_first_write := clock_timestamp();
            end if;
        end if;
    end loop;
    p.untried := v_untried;
    return p;
end;
$$;
comment on function lockstep._retry_each(lockstep.job, text[], boolean) is
    'A retry pass: each key alone, written as it goes, until row locks have been held for '
    'lockstep._retry_budget() or a statement timeout: the rest is left for the next pass (untried). After '
    'a transient error the rest is not tried (skipped). Locks: as lockstep._isolate, once per key.';

-- lockstep._attempt(j, keys, kind, whole): apply the claimed keys (canonical, sorted): as one part,
-- bisected on failure (batch, probe), or each alone (retry: lockstep._retry_each). job_error: the job
-- itself is broken (an empty pass fails too, or the error is of class 42, the job's wherever it is
-- raised), so every key would fail and none is blamed; or a batch timed out as a whole, which a broken job
-- does too: the next pass tells (lockstep._check_timed_out). whole: as lockstep._whole_pass_error.
-- locks: as lockstep._isolate.
create or replace function lockstep._attempt(j lockstep.job, keys text[], kind text, whole boolean,
                                  out p lockstep._pass, out job_error text)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    t record;
    e record;
begin
    p := row(0, 0, 0, '{}', 0, 0, 0, '{}', '{}');
    if cardinality(keys) = 0 then
        return;
    elsif kind = 'retry' then
        p := lockstep._retry_each(j, keys, whole);
        return;
    end if;
    select * into t from lockstep._try(j, keys);
    if t.error is null and kind = 'batch' and (t.p).timed_out is not null then
        job_error := pg_catalog.format('lockstep: statement timeout on a batch of %s keys (%s); the next pass '
                                       'checks the job with an empty pass, then bisects the batch',
                                       cardinality(keys), (t.p).timed_out_error);
        return;
    elsif t.error is null then
        p := t.p;
        return;
    -- the job itself is broken (an empty pass fails too), or an error of class 42: the job's wherever raised
    elsif pg_catalog.left(t.state, 2) = '42' or lockstep._whole_pass_error(t.state, whole) then
        job_error := t.error;
        return;
    end if;
    select * into e from lockstep._try(j, '{}'::text[]);  -- the job itself is broken, or some keys are poison
    if e.error is not null or (e.p).timed_out is not null then
        job_error := t.error;
        return;
    end if;
    p := lockstep._write_good(j, keys, lockstep._isolate(j, keys, t.error, true, whole), whole);
end;
$$;
comment on function lockstep._attempt(lockstep.job, text[], text, boolean) is
    'Apply the claimed keys (canonical, sorted): as one part, bisected on failure (batch, probe), or each '
    'alone (retry: lockstep._retry_each). job_error: the job itself is broken (an empty pass fails too, '
    'or the error is of class 42, the job''s wherever it is raised), so every key would fail and none is '
    'blamed; or a batch timed out as a whole, which a broken job does too: the next pass tells '
    '(lockstep._check_timed_out). whole: as lockstep._whole_pass_error. Locks: as lockstep._isolate.';

-- lockstep._check_timed_out(j, batch): the last batch timed out whole: an empty pass tells a broken job
-- (its error returned) from a slow key (the batch's keys become suspects).
-- locks: as lockstep._write for an empty key set (nothing); the job's key_failure rows of those keys.
create or replace function lockstep._check_timed_out(j lockstep.job, batch integer) returns text
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    t record;
begin
    select * into t from lockstep._try(j, '{}'::text[]);
    if (t.p).timed_out is not null then
        return pg_catalog.format('lockstep: statement timeout on an empty pass (%s): the job itself is too slow '
                                 'for this session''s statement_timeout of %s (the runner role''s or '
                                 'database''s setting, or the job''s own)',
                                 (t.p).timed_out_error, pg_catalog.current_setting('statement_timeout'));
    elsif t.error is not null then
        return t.error;
    end if;
    perform lockstep._add_suspects(j.job, (select c.keys from lockstep._claim(j, batch) c where c.kind = 'batch'));
    return null;
end;
$$;
comment on function lockstep._check_timed_out(lockstep.job, integer) is
    'The last batch timed out whole: an empty pass tells a broken job (its error returned) from a slow '
    'key (the batch''s keys become suspects). Locks: as lockstep._write for an empty key set (nothing); '
    'the job''s key_failure rows of those keys.';

-- lockstep._add_suspects(job, keys): record keys of job as suspects of a batch that timed out (attempts 0,
-- due now); a key already failing keeps its row. Security definer, for a caller that manages job (42501):
-- no recipe role holds INSERT on key_failure.
-- locks: those key_failure rows (inserted), key order.
create or replace function lockstep._add_suspects(job text, keys text[]) returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    perform lockstep._check_manages(job);
    insert into lockstep.key_failure (job, key, attempts, last_error, retry_at)
    select _add_suspects.job, k, 0, 'lockstep: in a batch that timed out; being bisected', now()
    from pg_catalog.unnest(keys) k
    order by k
    on conflict do nothing;
end;
$$;
comment on function lockstep._add_suspects(text, text[]) is
    'Record keys of job as suspects of a batch that timed out (attempts 0, due now); a key already failing '
    'keeps its row. Security definer, for a caller that manages job (42501). Locks: those key_failure rows '
    '(inserted), key order.';

-- lockstep._settle_failures(job, canon, leave, probe_suspects): after a pass over the keys canon, forget
-- job's failures of those keys not in leave; after a probe that timed out, also the other suspects (keys
-- never attempted, due, not parked) but probe_suspects. Security definer, for a caller that manages job
-- (42501): no recipe role holds DELETE on key_failure.
-- locks: those key_failure rows (deleted).
create or replace function lockstep._settle_failures(job text, canon text[], leave text[], probe_suspects text[])
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    perform lockstep._check_manages(job);
    delete from lockstep.key_failure f
    where f.job = _settle_failures.job
      and ((f.key = any(canon) and f.key <> all(leave))
           or (coalesce(cardinality(probe_suspects), 0) > 0 and f.attempts = 0 and not f.parked
               and f.retry_at <= now() and f.key <> all(probe_suspects)));
end;
$$;
comment on function lockstep._settle_failures(text, text[], text[], text[]) is
    'After a pass: forget the job''s failures of the keys passed but those left; after a timed-out probe, '
    'the other due suspects. Security definer, for a caller that manages the job (42501). Locks: those '
    'key_failure rows (deleted).';

-- lockstep._settle(j, kind, raw, ids, ctids, entry_keys, p, bad, bad_errors): lockstep's own rows for a
-- pass: entries done deleted, skipped deferred, failing keys, suspects and unreadable keys recorded
-- (lockstep._record_failures); message for the result (lockstep._settle_message); cured: a failed key
-- written now, changed since it failed (lockstep._finish may end a poison hold).
-- locks: the processed queue entries (deleted or updated), then the job's key_failure rows, key order;
-- then, if a key does not read back, the job's status row.
create or replace function lockstep._settle(j lockstep.job, kind text, raw text[], ids bigint[], ctids tid[], entry_keys text[],
                                 p lockstep._pass, bad text[], bad_errors text[], out message text, out cured boolean)
language plpgsql
set search_path = pg_catalog, pg_temp
set plan_cache_mode = force_generic_plan
as $$
declare
    v_susp text[] := coalesce(p.timed_out, '{}');
    v_ecanon text[];  -- the key of each entry, in canonical text
    v_leave text[];
    h record;
begin
    if cardinality(v_susp) = 1 then  -- a key that is slow alone fails like a poison key
        p.failed := p.failed || v_susp;
        p.errors := p.errors || p.timed_out_error;
        v_susp := '{}';
    end if;
    select array_agg(coalesce(m.c, e.k) order by e.o) into v_ecanon
    from unnest(entry_keys) with ordinality e(k, o)
    left join unnest(raw, lockstep._canon_each(j, raw)) m(r, c) on m.r = e.k;
    v_leave := p.failed || p.skipped || v_susp || bad || coalesce(p.untried, '{}');  -- untried: a retry pass's
    -- cured: an entry other than the one its failure folded its entries into
    select pg_catalog.count(*) > 0 into cured
    from lockstep.key_failure f
    where f.job = j.job and f.attempts > 0 and f.key = any(v_ecanon) and f.key <> all(v_leave)
      and exists (select from unnest(ids, v_ecanon) e(i, k) where e.k = f.key and e.i <> f.failed_upto);
    -- entries done go, skipped ones wait a second, a failing key's fold into one
    select * into h from lockstep._settle_entries(j, ids, ctids, v_ecanon, v_leave, p.skipped, p.failed || bad);
    perform lockstep._settle_failures(j.job, v_ecanon, v_leave, case when kind = 'probe' then v_susp end);
    perform lockstep._record_failures(j, h.held_keys, h.held_ids, p, v_susp, bad, bad_errors);
    message := lockstep._settle_message(j, p, v_susp, bad, bad_errors);
end;
$$;
comment on function lockstep._settle(lockstep.job, text, text[], bigint[], tid[], text[], lockstep._pass, text[], text[]) is
    'Lockstep''s own rows for a pass: entries done deleted, skipped deferred, a failing key''s folded into '
    'one, failing keys, suspects and unreadable keys recorded (lockstep._record_failures); message for the '
    'result (lockstep._settle_message); cured: a failed key written now, changed since it failed '
    '(lockstep._finish may end a poison hold). Locks: the processed queue entries (deleted or updated), '
    'then the job''s key_failure rows, key order; then, if a key does not read back, the job''s status '
    'row.';

-- lockstep._record_failures(j, held_keys, held_ids, p, susp, bad, bad_errors): the key_failure rows of a
-- pass: its failing keys (p.failed: backoff, parked after max_attempts), its suspects (susp: the keys of a
-- part a statement timeout ended, bisected by the next passes) and its keys that cannot be read back (bad:
-- parked at once). failed_upto: the entry a failing key's entries folded into (held_ids of held_keys; 0:
-- none), so any other entry of the key is a change the pass did not see (docs/design.md, "What a failing
-- pass saw"). Security definer, for a caller that manages j (42501): no recipe role holds INSERT or UPDATE
-- on key_failure.
-- locks: the job's key_failure rows of those keys, key order.
create or replace function lockstep._record_failures(j lockstep.job, held_keys text[], held_ids bigint[],
                                          p lockstep._pass, susp text[], bad text[], bad_errors text[])
returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
set plan_cache_mode = force_generic_plan
as $$
begin
    perform lockstep._check_manages(j.job);
    insert into lockstep.key_failure as f (job, key, attempts, last_error, retry_at, parked, failed_upto)
    select j.job, x.k, x.a, x.e, x.r, x.p,
           coalesce((select u.i from unnest(held_keys, held_ids) u(k, i) where u.k = x.k), 0)
    from (select k, 1 as a, e, now() + least(j.backoff, interval '2 seconds') as r, j.max_attempts <= 1 as p
          from unnest(p.failed, p.errors) as u(k, e)
          union all
          select k, 0, pg_catalog.format('%s (one of %s keys computed together; being bisected)', p.timed_out_error,
                                         cardinality(susp)),
                 now() + least(j.backoff, greatest(interval '1 second',
                                                   pg_catalog.current_setting('statement_timeout')::interval)), false
          from unnest(susp) k
          union all
          select k, j.max_attempts, e, now(), true from unnest(bad, bad_errors) as u(k, e)) x
    order by x.k
    on conflict (job, key) do update
        set attempts = case when excluded.attempts = 0 then f.attempts
                            else greatest(f.attempts + 1, excluded.attempts) end,
            last_error = excluded.last_error, last_failed_at = now(),
            failed_upto = case when excluded.attempts = 0 then f.failed_upto else excluded.failed_upto end,
            retry_at = case when excluded.attempts = 0 then excluded.retry_at
                            else now() + least(j.backoff, interval '1 second' * power(2, least(f.attempts + 1, 20))) end,
            parked = excluded.parked or (excluded.attempts > 0 and f.attempts + 1 >= j.max_attempts);
end;
$$;
comment on function lockstep._record_failures(lockstep.job, text[], bigint[], lockstep._pass, text[], text[], text[]) is
    'The key_failure rows of a pass: its failing keys (p.failed: backoff, parked after max_attempts), its '
    'suspects (susp: bisected by the next passes) and its keys that cannot be read back (bad: parked at '
    'once); failed_upto: the entry a failing key''s entries folded into (held_ids). Security definer, for '
    'a caller that manages j (42501). Locks: the job''s key_failure rows of those keys, key order.';

-- lockstep._settle_message(j, p, susp, bad, bad_errors): the result's message for a pass whose keys failed
-- (p.failed), timed out together (susp) or cannot be read back (bad); NULL if none did. A key that cannot
-- be read back names no parent this pass could compute (an enum label renamed since, a key typed by hand):
-- it is parked, and the periodic recompute, which covers every parent and cures parked keys
-- (lockstep._cure), is due now; not while another parent of the job fails (that recompute would fail too
-- and hand every parent to the queue again).
-- locks: the job's status row (by the update), if a key cannot be read back.
create or replace function lockstep._settle_message(j lockstep.job, p lockstep._pass, susp text[], bad text[],
                                         bad_errors text[])
returns text
language plpgsql
set search_path = pg_catalog, pg_temp
set plan_cache_mode = force_generic_plan
as $$
begin
    if cardinality(bad) > 0
       and not exists (select from lockstep.key_failure f where f.job = j.job and f.attempts > 0 and f.key <> all(bad))
       and cardinality(p.failed) = 0 then
        perform lockstep._due_by(j.job, now(), true);
    end if;
    if cardinality(p.failed) + cardinality(bad) + cardinality(susp) = 0 then
        return null;
    end if;
    return pg_catalog.concat_ws('; ',
        case when cardinality(p.failed) > 0 then
            pg_catalog.format('%s key(s) failed, first %s: %s', cardinality(p.failed), p.failed[1], p.errors[1]) end,
        case when cardinality(bad) > 0 then
            pg_catalog.format('%s queued key(s) parked, first %s: %s', cardinality(bad), bad[1], bad_errors[1]) end,
        case when cardinality(susp) > 0 then
            pg_catalog.format('%s key(s) timed out together (%s): bisected over the next passes',
                              cardinality(susp), p.timed_out_error) end);
end;
$$;
comment on function lockstep._settle_message(lockstep.job, lockstep._pass, text[], text[], text[]) is
    'The result''s message for a pass whose keys failed (p.failed), timed out together (susp) or cannot '
    'be read back (bad); NULL if none did. A key that cannot be read back names no parent this pass could '
    'compute (an enum label renamed since, a key typed by hand): it is parked, and the periodic '
    'recompute, which covers every parent and cures parked keys (lockstep._cure), is due now; not while '
    'another parent of the job fails (that recompute would fail too and hand every parent to the queue '
    'again). Locks: the job''s status row (by the update), if a key cannot be read back.';

-- lockstep._work(j, batch): one incremental pass.
-- locks: nothing until there is work (idle) and no periodic job of the group is due (busy: give way); the
-- group lock (try: busy if taken); then, through lockstep._write, the parents of the claimed keys' new rows
-- (FOR KEY SHARE SKIP LOCKED, key order) and the target's rows (key order); then lockstep's own rows
-- (lockstep._settle): the processed queue entries, the key_failure rows; the status row last.
create or replace function lockstep._work(j lockstep.job, batch integer) returns lockstep.result
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    s lockstep.job_state;
    v_started timestamptz;
    c record;
    r record;
    a record;
    e record;
    v_err text;
    v_more boolean;
    p lockstep._pass;
begin
    select * into s from lockstep.job_state st where st.job = j.job;
    if s.retry_at > now() then
        return lockstep._result('backoff', j.job, 'work', null, s.last_error);
    end if;
    if lockstep._group_due(j.lock_group) then
        return lockstep._result('busy', j.job, 'work', null, 'a periodic job of the lock group is due');
    end if;
    perform lockstep._resolve_through(j);  -- 17_through.sql: through keys committed since, mapped now
    select * into c from lockstep._claim(j, batch);  -- takes no lock: idle costs one look
    if c.keys is null then
        return lockstep._result('idle', j.job, 'work');
    end if;
    if not lockstep._try_lock(j.lock_group) then
        return lockstep._result('busy', j.job, 'work');
    end if;
    v_started := clock_timestamp();
    if s.last_action = 'work' and s.last_outcome = 'failed' and s.last_error like 'lockstep: statement timeout on %' then
        v_err := lockstep._check_timed_out(j, batch);
        if v_err is not null then
            return lockstep._failed(j, 'work', v_started, v_err);
        end if;
        select * into c from lockstep._claim(j, batch);
    end if;
    v_err := lockstep._key_type_refused(j.job, j.key_type);  -- no key converted: a failed run, with backoff
    if v_err is not null then
        return lockstep._failed(j, 'work', v_started, v_err);
    end if;
    select * into r from lockstep._readable(j, c.keys);
    -- every visible entry of those keys goes with them, read under the group lock, those queued in
    -- canonical text too ('4' with '04': one parent)
    select * into e from lockstep._entries(j, c.keys || coalesce(r.canon, '{}'));
    if e.ids is null then
        return lockstep._result('idle', j.job, 'work');
    end if;
    -- a lock timeout, deadlock or serialization failure fails the job's first 3 failed passes in a row as a
    -- whole (lockstep._whole_pass_error)
    select * into a from lockstep._attempt(j, coalesce(r.canon, '{}'), c.kind, s.consecutive_failures < 3);
    p := a.p;
    v_err := coalesce(a.job_error, p.transient);
    if v_err is not null then
        return lockstep._failed(j, 'work', v_started, v_err);
    end if;
    select t.message, t.cured into v_err, p.cured
    from lockstep._settle(j, c.kind, r.raw, e.ids, e.ctids, e.entry_keys, p, r.bad, r.errors) t;
    v_more := (c.kind <> 'batch' or c.full) and lockstep._has_ready(j);  -- a retry's untried keys are ready
    -- whether a backlog is left: lockstep.due() opens no --batch-wait window after it
    perform lockstep._finish(j, 'work', 'done', v_started, p, null,
                             cardinality(p.skipped) = cardinality(coalesce(r.canon, '{}')) and cardinality(r.bad) = 0,
                             v_more and (c.kind <> 'batch' or (select b.full from lockstep._batch(j, batch) b)));
    return lockstep._result('done', j.job, 'work', p, v_err, v_more);
end;
$$;

-- lockstep.work(job, batch): one incremental pass over up to batch queued parents (NULL, the default: the
-- job's batch_parents, as lockstep.run(); a larger batch is the caller's explicit choice). A paused job
-- (lockstep.pause): outcome paused, nothing written.
-- locks: as lockstep._work.
create or replace function lockstep._work_job(job text, batch integer) returns lockstep.result
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
    perform lockstep._check_isolation('lockstep.work()');
    if batch < 1 then
        raise exception 'lockstep: batch must be a positive integer or NULL for the job''s batch_parents (got %)', batch
            using errcode = '22023';
    end if;
    j := lockstep._queue_job(job);
    if j.paused_at is not null then  -- lockstep.pause (15_controls.sql): nothing written
        return lockstep._paused(j, 'work');
    end if;
    -- its status row deleted by hand: made again, as run() does
    if not exists (select from lockstep.job_state s where s.job = j.job)
       and (lockstep._restore_state(j)).job is null then
        return lockstep._result('busy', j.job, 'work');
    end if;
    return lockstep._work(j, coalesce(batch, j.batch_parents));
end;
$$;

comment on function lockstep._work_job(text, integer) is
    'The body of lockstep.work, under lockstep''s pinned settings (lockstep.work puts back the caller''s '
    'settings after it). Locks: as lockstep.work.';

-- lockstep.work(job, batch): one worker pass (lockstep._work_job).
-- Runs as the caller, with no SET clause: it reads the caller's settings (lockstep._settings) and puts
-- back any the job's code changed for the session; every name is qualified.
-- locks: as lockstep._work_job.
create or replace function lockstep.work(job text, batch integer default null) returns lockstep.result
language plpgsql
as $$
declare
    v_was pg_catalog.text[] := lockstep._settings();
    v_now pg_catalog.text[];
    r lockstep.result;
begin
    r := lockstep._work_job(job, batch);
    v_now := lockstep._settings();
    if v_now operator(pg_catalog.<>) v_was then
        perform lockstep._restore_settings(v_was, v_now);
    end if;
    return r;
end;
$$;

comment on function lockstep.work(text, integer) is
    'One incremental pass over up to batch queued parents (NULL, the default: the job''s batch_parents, '
    'as lockstep.run(); a larger batch is the caller''s explicit choice); a paused job: outcome paused, '
    'nothing written. Locks: as lockstep._work.';

-- lockstep._end_backoff(j, whole): end the job's failure backoff, if it is in one; for a retry of the whole
-- job (whole), the recompute flags held since a poisoned recompute count again.
-- For a caller that manages the job (42501). Security definer: the owner recipe holds no UPDATE on
-- lockstep's tables.
-- locks: the job's lockstep.job_state row (FOR NO KEY UPDATE, by the update), if so.
create or replace function lockstep._end_backoff(j lockstep.job, whole boolean) returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    perform lockstep._check_manages(j.job);
    update lockstep.job_state s set retry_at = null, next_run_at = least(s.next_run_at, now()),
                                    recompute_poisoned_at = case when whole then null else s.recompute_poisoned_at end,
                                    recompute_poison_cured = case when whole then false else s.recompute_poison_cured end
    where s.job = j.job and (lockstep._not_due(s) = 'backoff' or (whole and s.recompute_poisoned_at is not null));
end;
$$;
comment on function lockstep._end_backoff(lockstep.job, boolean) is
    'End the job''s failure backoff, if it is in one; for a retry of the whole job (whole), the recompute'
    ' flags held since a poisoned recompute count again. For a caller that manages the job (42501); '
    'security definer: the owner recipe holds no UPDATE on lockstep''s tables. Locks: the job''s '
    'lockstep.job_state row (FOR NO KEY UPDATE, by the update), if so.';

-- lockstep._retry(j, keys): forget the failures of keys (NULL: all of j's), queue them again, and end the
-- job's failure backoff. A key that does not read back as the parent key type is deleted with a WARNING.
-- locks: the group lock (waiting for a pass that holds it: without it, a retry's transaction and a pass
-- locked key_failure rows in different orders, 40P01); the job's key_failure rows of those keys (deleted); the queue entries of unreadable keys (deleted);
-- appends to the queue; then, if its last run failed or it dropped unreadable keys, the job's
-- lockstep.job_state row (FOR NO KEY UPDATE, by the update).
create or replace function lockstep._retry(j lockstep.job, keys text[]) returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_keys text[];
    r record;
begin
    -- the owner's (or a member's, or the admin's): row-level security would hide another owner's failures
    perform lockstep._check_owner(j);
    perform lockstep._wait_lock(j.lock_group);
    v_keys := lockstep._delete('key_failure', j.job, keys);
    select * into r from lockstep._readable(j, coalesce(v_keys, '{}'));
    if cardinality(r.bad) > 0 then
        perform lockstep._delete('queue', j.job, r.bad);
        raise warning 'lockstep: % queued key(s) of job "%" cannot be read as %, so name no parent: dropped, first %',
            cardinality(r.bad), j.job, j.key_type, pg_catalog.quote_literal(r.bad[1])
            using detail = r.errors[1];
        v_keys := r.raw;
    end if;
    perform lockstep._enqueue_text(j, v_keys);
    if cardinality(r.bad) > 0 then
        -- dropped: their parents are the periodic recompute's, due now
        perform lockstep._due_by(j.job, now());
    end if;
    -- no failing key left behind: as a retry of the whole job (the retried keys are all the poison known)
    perform lockstep._end_backoff(j, keys is null
                                     or not exists (select from lockstep.key_failure f where f.job = j.job));
    return coalesce(cardinality(v_keys), 0);
end;
$$;
comment on function lockstep._retry(lockstep.job, text[]) is
    'Forget the failures of keys (NULL: all of j''s), queue them again, and end the job''s failure '
    'backoff. A key that does not read back as the parent key type is deleted with a WARNING. Locks: the '
    'group lock (waiting for a pass that holds it); the job''s key_failure rows of those keys (deleted); the queue entries of unreadable keys (deleted); '
    'appends to the queue; then, if its last run failed or it dropped unreadable keys, the job''s '
    'lockstep.job_state row (FOR NO KEY UPDATE, by the update).';

-- lockstep.retry(job, keys): put these failing or parked keys back in the queue now. Returns how many.
-- locks: as lockstep._retry.
create or replace function lockstep.retry(job text, keys anyarray) returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
set jit = off  -- lockstep._no_jit_note (03_helpers.sql)
as $$
declare
    j lockstep.job := lockstep._queue_job(job);
begin
    return lockstep._retry(j, lockstep._keys_text(j, keys));
end;
$$;
comment on function lockstep.retry(text, anyarray) is
    'Put these failing or parked keys back in the queue now. Returns how many. Locks: as lockstep._retry.';

-- lockstep.retry(job): put every failing or parked key of job back in the queue now, and end the job's
-- failure backoff. A job with no queue has no key to put back: its backoff ends, 0 is returned.
-- locks: as lockstep._retry; for a job with no queue, as lockstep._end_backoff.
create or replace function lockstep.retry(job text) returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
set jit = off  -- lockstep._no_jit_note (03_helpers.sql)
as $$
declare
    j lockstep.job := lockstep._job(job);
begin
    if j.kind = 'derived' and j.parent is not null then
        return lockstep._retry(j, null);
    end if;
    perform lockstep._check_owner(j);
    perform lockstep._end_backoff(j, true);
    return 0;
end;
$$;
comment on function lockstep.retry(text) is
    'Put every failing or parked key of job back in the queue now, and end the job''s failure backoff. A '
    'job with no queue has no key to put back: its backoff ends, 0 is returned. Locks: as '
    'lockstep._retry; for a job with no queue, as lockstep._end_backoff.';

-- lockstep.set_max_attempts(job, max_attempts): failures of one key before it is parked (default 5).
-- locks: the job's registry row.
create or replace function lockstep.set_max_attempts(job text, max_attempts integer) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    j lockstep.job := lockstep._queue_job(job);
begin
    if max_attempts is null or max_attempts < 1 then
        raise exception 'lockstep: max_attempts must be a positive integer (got %)', coalesce(max_attempts::text, 'NULL')
            using errcode = case when max_attempts is null then '22004' else '22023' end;
    end if;
    perform lockstep._check_owner(j);
    perform lockstep._update_job(j.job, max_attempts => max_attempts);  -- security definer
end;
$$;
comment on function lockstep.set_max_attempts(text, integer) is
    'Failures of one key before it is parked (default 5). Locks: the job''s registry row.';
