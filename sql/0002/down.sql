-- lockstep 0002 down, before 0001's code is installed again: drop what 0001 did not have (functions,
-- views), restore the state of 0001, and clear the function comments 0001 did not set.
-- locks: ACCESS EXCLUSIVE on each table altered, for the migration's transaction.
-- lockstep's own tables first, as in up.sql.
do $$
begin
    perform lockstep._ddl(array(select c.oid::regclass from pg_catalog.pg_class c
                                where c.relnamespace = 'lockstep'::regnamespace and c.relkind in ('r', 'p')
                                order by c.relname), '{}', 'the downgrade to lockstep 0001');
end;
$$;

comment on schema lockstep is
    'lockstep: derived tables kept up to date by background jobs, with no deadlocks and no long row locks';

-- composite parent keys (0002): 0001 cannot run a job keyed by several columns; such jobs are dropped first
do $$
declare
    v text := (select pg_catalog.string_agg(x.job, ', ' order by x.job) from lockstep.job x
               where pg_catalog.cardinality(x.parent_columns) > 1);
begin
    if v is not null then
        raise exception 'lockstep: the downgrade to lockstep 0001 is refused: job(s) % have a composite parent key', v
            using errcode = '55000', hint = 'Drop them first (lockstep.drop_job), then downgrade.';
    end if;
end;
$$;
alter table lockstep.job drop column parent_columns, drop column parent_keys;
-- owners by oid: the policies reading owner_id go first (0001's code creates its own again)
do $$
declare
    p record;
begin
    for p in select pol.polname, pol.polrelid::regclass as rel from pg_catalog.pg_policy pol
             join pg_catalog.pg_class c on c.oid = pol.polrelid
             where c.relnamespace = 'lockstep'::regnamespace loop
        execute pg_catalog.format('drop policy %I on %s', p.polname, p.rel);
    end loop;
end;
$$;
drop trigger if exists job_owner_id on lockstep.job;
drop trigger if exists run_log_owner_id on lockstep.run_log;
drop trigger if exists viewer_owner_id on lockstep.viewer;
drop function if exists lockstep._owner_id();
drop view if exists lockstep.status;  -- it reads owner_id (lockstep._state_gone_id)
alter table lockstep.job drop column owner_id;
alter table lockstep.run_log drop column owner_id;
alter table lockstep.viewer drop column viewer_id, drop column owner_id;
drop function if exists lockstep.define_derived(text, regclass, regprocedure, regclass, name, text, interval, interval,
                                                text, text, interval, name[]);
drop function if exists lockstep._key_fields(lockstep.job);
drop function if exists lockstep._key_expr(lockstep.job, text, name[]);
drop function if exists lockstep._key_text(lockstep.job, text, name[]);
drop function if exists lockstep._key_match(lockstep.job, text, text, name[]);
drop function if exists lockstep._key_in(lockstep.job, text, text, name[]);
drop function if exists lockstep._key_name(lockstep.job);
drop function if exists lockstep._key_unnest(lockstep.job, text);
drop function if exists lockstep._key_order(lockstep.job, text);
drop function if exists lockstep._key_pattern(regtype);
drop function if exists lockstep._canonical_keys(regtype, text[]);
drop function if exists lockstep._is_parent_fk(lockstep.job, oid);
drop function if exists lockstep._composite_key_problem(regtype);
drop function if exists lockstep._parent_fks(regclass, regclass, name[]);
drop function if exists lockstep._check_key_composite(regprocedure, regclass, name[]);
drop function if exists lockstep._check_parent_keys(regclass, regprocedure, name[], regclass, name[]);
drop function if exists lockstep._check_parents(regclass, regprocedure, name[], regclass, name, name[]);
drop function if exists lockstep._warn_index_keys(regclass, name[]);
drop function if exists lockstep._save_parent_keys(text, name[], name[]);
drop function if exists lockstep._check_may_own(text, oid);
drop function if exists lockstep._check_may_define();
drop function if exists lockstep._put_job(lockstep.job);
drop function if exists lockstep._update_job(text, integer, integer, interval, boolean, name);
drop function if exists lockstep._flag_job(text, text);
drop function if exists lockstep._watched_via_wal(text, regclass);

-- functions 0001 did not have, or had with other arguments or results
drop function if exists lockstep._whole_pass_error(text, boolean);
drop function if exists lockstep._isolate(lockstep.job, text[], text, boolean, boolean);
drop function if exists lockstep._write_good(lockstep.job, text[], lockstep._pass, boolean);
drop function if exists lockstep._retry_each(lockstep.job, text[], boolean);
drop function if exists lockstep._attempt(lockstep.job, text[], text, boolean);
drop function if exists lockstep._settle(lockstep.job, text, text[], bigint[], tid[], text[], lockstep._pass, text[], text[]);
drop function if exists lockstep._record_failures(lockstep.job, text[], bigint[], lockstep._pass, text[], text[], text[]);
drop function if exists lockstep._settle_message(lockstep.job, lockstep._pass, text[], text[], text[]);
drop function if exists lockstep._limit_batch(lockstep.job, integer, bigint);
drop function if exists lockstep._keep_batch(lockstep.job);
drop function if exists lockstep._hand_off_rest(lockstep.job, bigint);
drop function if exists lockstep._hand_off(lockstep.job, text[], bigint, bigint, bigint, bigint);
drop function if exists lockstep._recompute_failed(lockstep.job, timestamptz, text, text, bigint);
drop function if exists lockstep._write(lockstep.job, text[], bigint);
drop function if exists lockstep._apply(lockstep.job, text[], bigint);
drop function if exists lockstep._owner_run(lockstep.job, text[], boolean, bigint);
drop function if exists lockstep._as_owner(lockstep.job, text[], bigint);
drop function if exists lockstep._owner_pass(lockstep.job, text[], bigint, boolean);
drop function if exists lockstep._take(lockstep.job, text, boolean);
drop function if exists lockstep._session_get(text);
drop function if exists lockstep._session_set(text, text);
drop function if exists lockstep._diff_run(lockstep.job, text[], text, text, text, text, text, text);
drop function if exists lockstep._compute_sql(lockstep.job);
drop function if exists lockstep._trigger_general(oid, name, text, text, text, integer, text[]);
drop function if exists lockstep._trigger_template_check();
drop function if exists lockstep._trigger_template_enqueue();
drop function if exists lockstep._trigger_template_queue();
drop function if exists lockstep._comment_safe(text);
drop function if exists lockstep._check_watch(lockstep.job, regclass, name);
drop function if exists lockstep._watch_news(lockstep.job, regclass, name, regclass[]);
drop function if exists lockstep._watch_ddl(lockstep.job, regclass[], text, text[]);
drop function if exists lockstep._check_parent_column(regclass, regclass, name, name);
drop function if exists lockstep._parent_key(regclass);
alter type lockstep._pass
    drop attribute timed_out, drop attribute timed_out_error, drop attribute transient, drop attribute untried,
    drop attribute cured, drop attribute handed_off, drop attribute handoff_from, drop attribute handoff_todo;
alter type lockstep._diff_counts drop attribute rest;

do $$
declare
    f regprocedure;
begin
    for f in select p.oid::regprocedure from pg_catalog.pg_proc p
             where p.pronamespace = 'lockstep'::regnamespace and pg_catalog.obj_description(p.oid, 'pg_proc') is not null
    loop
        execute pg_catalog.format('comment on function %s is null', f);
    end loop;
end;
$$;

-- watches through a join (0002): their triggers go with their functions; 0001's watch() comes back
do $$
declare
    t record;
begin
    for t in select tg.tgname, tg.tgrelid::regclass rel from pg_catalog.pg_trigger tg
             join pg_catalog.pg_proc p on p.oid = tg.tgfoid
             where p.oid = pg_catalog.to_regprocedure('lockstep.enqueue_through()')
                or (p.pronamespace = 'lockstep'::regnamespace and p.proname like 'enqueue\_w\_%' and tg.tgnargs = 6)
    loop
        execute pg_catalog.format('drop trigger %I on %s', t.tgname, t.rel);
    end loop;
    -- the generated functions of those triggers (lockstep._gen_through), now used by none
    for t in select p.oid::regprocedure f from pg_catalog.pg_proc p
             where p.pronamespace = 'lockstep'::regnamespace and p.proname like 'enqueue\_w\_%'
               and pg_catalog.strpos(p.prosrc, 'lockstep._gen_through') > 0
               and not exists (select from pg_catalog.pg_trigger tg where tg.tgfoid = p.oid)
    loop
        execute pg_catalog.format('drop function %s', t.f);
    end loop;
end;
$$;
drop function if exists lockstep.watch(text, regclass, name, regclass, name, text, name[], name[]);
drop function if exists lockstep.enqueue_through();
drop function if exists lockstep._append_through(text, oid, text[]);
drop function if exists lockstep._take_through(text);
drop function if exists lockstep._caller();
drop function if exists lockstep._may_manage_id(oid);
drop function if exists lockstep._may_view_id(oid);
drop function if exists lockstep._is_member_id(oid);
drop function if exists lockstep._may_own_id(oid);
drop function if exists lockstep._state_gone_id(oid);
drop function if exists lockstep._check_manages(text);
drop function if exists lockstep._caller_manages(text);
drop function if exists lockstep._delete(text, text, text[], text[]);
drop function if exists lockstep._settle_failures(text, text[], text[], text[]);
drop function if exists lockstep._resolve_through(lockstep.job);
drop table if exists lockstep.through_entry;
drop function if exists lockstep._watch_through(lockstep.job, regclass, name, regclass, name);
drop function if exists lockstep._key_columns_problem(regclass, name[], regtype);
drop function if exists lockstep._check_key_columns(lockstep.job, regclass, name[]);
drop function if exists lockstep._key_columns_sql(regtype, name[], text);
drop function if exists lockstep._gen_key_columns(lockstep.job, regclass, name[]);
drop function if exists lockstep._watch_key_columns(lockstep.job, regclass, name[], regclass, text);
drop function if exists lockstep._through_key(regclass, name, regclass);
drop function if exists lockstep._through_keys(regclass, name[], regclass);
drop function if exists lockstep._watch_through_columns(lockstep.job, regclass, name[], regclass, name, name[], text);
drop function if exists lockstep._through_sql(text, text, text, text, text, text);
drop function if exists lockstep._through_types_problem(regclass, name[], regtype);
drop function if exists lockstep._through_map_sql(lockstep.job);
drop function if exists lockstep._gen_through(lockstep.job, regclass, name[], regclass, name[], name[]);
drop function if exists lockstep._through_template();
drop function if exists lockstep._through_castable(regtype, regtype);
drop function if exists lockstep._through_row_security(oid, oid);
drop function if exists lockstep._check_through(regclass, regclass, name[], regtype);
drop function if exists lockstep._check_source_key(lockstep.job, regclass, name);

-- the WAL capture: its slot and publication first (nothing of 0001 reads them), then its code and state
do $$
declare
    v_slot name := (select c.slot from lockstep.capture_state c);
begin
    if exists (select from pg_catalog.pg_replication_slots s where s.slot_name = v_slot) then
        perform pg_catalog.pg_drop_replication_slot(v_slot);
    end if;
end;
$$;
drop publication if exists lockstep_capture;
drop view if exists lockstep.capture_status;
drop function if exists lockstep.capture(integer);
drop function if exists lockstep.set_capture_bounds(bigint, bigint);
drop function if exists lockstep._capture_read(name, pg_lsn, integer);
drop function if exists lockstep._trim_keys(text[], regtype, oid, text[]);
drop function if exists lockstep._capture_slot_ready(name);
drop function if exists lockstep._capture_families();
drop function if exists lockstep._pgo_truncated(bytea);
drop function if exists lockstep._pgo_keys(bytea, integer);
drop function if exists lockstep._pgo_records(bytea, integer[]);
drop function if exists lockstep._pgo_places(name[], oid[], name[], text[]);
drop function if exists lockstep._wal_watched();
drop function if exists lockstep._wal_types_problem(oid, name[], text[], regtype);
drop function if exists lockstep._pgo_relation(bytea);
drop function if exists lockstep._pgo_int(bytea, integer, integer);
drop function if exists lockstep._capture_cleanup();
drop function if exists lockstep._capture_in_use();
drop function if exists lockstep._unwatch_wal(text, regclass);
drop function if exists lockstep._watch_wal(lockstep.job, regclass, name[]);
drop function if exists lockstep._publication_ddl();
drop function if exists lockstep._check_wal(regclass, name[]);
drop function if exists lockstep._check_wal_key(lockstep.job, regclass, name[]);
drop function if exists lockstep._columns_text(name[]);
drop function if exists lockstep._identity_covers(regclass, name[]);
drop function if exists lockstep._capture_publication();
drop function if exists lockstep._capture_slot();
drop table if exists lockstep.capture_state;
drop table if exists lockstep.wal_watch;
alter table lockstep.setting drop column if exists capture_unhealthy_bytes, drop column if exists capture_max_bytes;

-- jobs defined by a query (0002) keep their generated compute function, as a job of 0001 would
drop function if exists lockstep.define_derived(text, regclass, regprocedure, regclass, name, text, interval, interval, text, text);
drop function if exists lockstep._query_compute(text, regclass, text, regclass, name, text, name[]);
drop function if exists lockstep._query_parent(regclass, regclass, name, name[]);
drop function if exists lockstep._query_key_type(regclass, regclass, name[]);
drop function if exists lockstep._drop_query_objects(text, regtype);
drop function if exists lockstep._query_name(regclass, text);
drop function if exists lockstep._query_body(text, text, name[], regtype);
drop function if exists lockstep._query_filter(name[], regtype, text, text[]);
drop function if exists lockstep._query_fields(regtype);
drop function if exists lockstep._query_scans(text, text, name[], regtype);
drop function if exists lockstep._query_columns(text, text);
drop function if exists lockstep.verify(text, anyarray);
drop function if exists lockstep.verify(text);
drop function if exists lockstep._verify(lockstep.job, text[]);
drop function if exists lockstep._verify_pass(lockstep.job, text[]);

-- operator controls (15_controls.sql): gone in 0001
drop view if exists lockstep.status;
drop function if exists lockstep.preview(text, anyarray);
drop function if exists lockstep._preview(lockstep.job, text[]);
drop function if exists lockstep._preview_diff(lockstep.job, text[]);
drop function if exists lockstep._preview_job(text);
drop function if exists lockstep.pause(text);
drop function if exists lockstep.resume(text);
drop function if exists lockstep._paused(lockstep.job, text);
drop function if exists lockstep._check_controls(lockstep.job, text);
drop function if exists lockstep._deps();
drop function if exists lockstep._watch_rels();
drop function if exists lockstep._wal_watches();
drop function if exists lockstep._depths();
drop function if exists lockstep._dep_path(text, text);
drop function if exists lockstep._check_cycle(text, regclass, regclass);
alter table lockstep.job drop column paused_at, drop column paused_by;
alter table lockstep.queue drop constraint if exists queue_finite_times;
alter table lockstep.recompute_flag alter column flagged_at set default now(),
    drop constraint if exists recompute_flag_finite_time;
-- functions new in 0002 (0001's _safe_key_type, installed again, reads the catalogs itself)
drop function if exists lockstep._check_key_type_safe(text, regtype);
drop function if exists lockstep._key_type_refused(text, regtype);
drop function if exists lockstep._key_type_problem(regtype);
drop function if exists lockstep._trusted_fn(oid);
drop function if exists lockstep._has_equality(regtype);
drop function if exists lockstep.set_time_limit(text);
drop function if exists lockstep._check_timeout(interval);
drop function if exists lockstep.define_job(text, regprocedure, text, interval, interval, interval);
drop function if exists lockstep.define_derived(text, regclass, regprocedure, regclass, name, text, interval, interval,
                                                text, text, interval);
alter table lockstep.job drop column timeout;
drop function if exists lockstep._run_job(text);
drop function if exists lockstep._recompute_job(text);
drop function if exists lockstep._work_job(text, integer);
drop function if exists lockstep._settings();
drop function if exists lockstep._restore_settings(text[], text[]);
drop function if exists lockstep._settle_entries(lockstep.job, bigint[], tid[], text[], text[], text[], text[]);
drop function if exists lockstep._canon_each(lockstep.job, text[]);
drop function if exists lockstep._keys_from_text(text, text[], anyarray);
drop function if exists lockstep._keys_cast_sql(regtype);
drop function if exists lockstep._trims_scale(regtype);
drop function if exists lockstep._numeric_fields(regtype);
drop function if exists lockstep._handoff_pending(lockstep.job_state);
drop function if exists lockstep._wait_lock(text);
drop view if exists lockstep.status;
drop function if exists lockstep._stall(text);
-- watches of a replica (0002): their row triggers go with their function
do $$
declare
    t record;
begin
    for t in select tg.tgname, tg.tgrelid::regclass rel from pg_catalog.pg_trigger tg
             where tg.tgfoid = pg_catalog.to_regprocedure('lockstep.enqueue_replica()')
    loop
        execute pg_catalog.format('drop trigger %I on %s', t.tgname, t.rel);
    end loop;
end;
$$;
drop function if exists lockstep.watch_replica(text, regclass, name);
drop function if exists lockstep.enqueue_replica();
drop function if exists lockstep._stall_passes(text, timestamptz);
drop function if exists lockstep._verify_keys(text, anyarray);
drop function if exists lockstep._verify_all(text);
-- the runner's writes through security definer functions (0002)
drop function if exists lockstep._due_by(text, timestamptz, boolean);
drop function if exists lockstep._add_suspects(text, text[]);
drop function if exists lockstep._state_rest(text, bigint, bigint, text);
drop function if exists lockstep._state_handoff(text, bigint, bigint, bigint);
drop function if exists lockstep._state_poisoned(text);
drop function if exists lockstep._failures_due(text, text[]);
drop function if exists lockstep._state_make(text);
drop function if exists lockstep._append_keys(text, text[]);
drop function if exists lockstep._queue_keys(lockstep.job, text[]);
drop function if exists lockstep._check_captures();
drop function if exists lockstep._capture_slot_made(name, text, boolean);
drop function if exists lockstep._capture_queue(text[], text[], text[], text[]);
drop function if exists lockstep._capture_done(pg_lsn, bigint);
drop function if exists lockstep._capture_forget();
drop function if exists lockstep.add_viewer(regrole, regrole);
drop function if exists lockstep.remove_viewer(regrole, regrole);
drop function if exists lockstep._check_may_name_viewers(regrole);
drop function if exists lockstep._delete_wal_watch(text, regclass);
drop function if exists lockstep._put_wal_watch(text, regclass, name[], boolean);
drop function if exists lockstep._wal_sources();
