-- lockstep 0002 up, before the code: the state's change from 0001 (tables, types, indexes), and the
-- functions and views whose signature or columns change or that go away. The code (sql/src, frozen into
-- sql/0002/code/ at release) follows, then up_after.sql.
-- locks: ACCESS EXCLUSIVE on each table altered, for the migration's transaction.

-- lockstep's own tables first, each waited for at most 100 ms at a time (lockstep._ddl): the columns and
-- policies below need them, and an ALTER queued behind one open application transaction would hold every
-- application write to a watched table behind it.
do $$
begin
    perform lockstep._ddl(array(select c.oid::regclass from pg_catalog.pg_class c
                                where c.relnamespace = 'lockstep'::regnamespace and c.relkind in ('r', 'p')
                                order by c.relname), '{}', 'the upgrade to lockstep 0002');
end;
$$;

comment on schema lockstep is
    'lockstep: derived tables kept up to date by background jobs, with no deadlocks and no long row locks '
    '(revision 0002)';

-- watch() gains through, through_column and via
drop function if exists lockstep.watch(text, regclass, name);

alter table lockstep.setting
    add column capture_unhealthy_bytes bigint not null default 268435456 check (capture_unhealthy_bytes > 0),
    add column capture_max_bytes bigint not null default 1073741824 check (capture_max_bytes > 0);

create table lockstep.wal_watch (
    job         text not null references lockstep.job (job) on delete cascade,
    source      regclass not null,
    key_column  name not null,
    watched_at  timestamptz not null default now(),
    key_columns name[],
    primary key (job, source)
);
alter table lockstep.wal_watch enable row level security;

create table lockstep.capture_state (
    only_row        boolean primary key default true check (only_row),
    slot            name not null,
    queued_lsn      pg_lsn,
    slot_created_at timestamptz not null default now(),
    last_capture_at timestamptz,
    last_changes    bigint not null default 0,
    changes         bigint not null default 0,
    recreated       bigint not null default 0,
    families        text[]
);
alter table lockstep.capture_state enable row level security;

-- define_derived() gains query and query_search_path (compute may be NULL then)
drop function if exists lockstep.define_derived(text, regclass, regprocedure, regclass, name, text, interval, interval);
-- the pass carries what the worker and the recompute passed through session settings; the diff counts
-- carry the rows left in a recompute's rest table
alter type lockstep._pass
    add attribute timed_out text[], add attribute timed_out_error text, add attribute transient text,
    add attribute untried text[], add attribute cured boolean, add attribute handed_off bigint,
    add attribute handoff_from bigint, add attribute handoff_todo bigint;
alter type lockstep._diff_counts add attribute rest bigint;

-- functions whose arguments or results change, or that go
drop function if exists lockstep._whole_pass_error(text);
drop function if exists lockstep._timed_out();
drop function if exists lockstep._isolate(lockstep.job, text[], text, boolean);
drop function if exists lockstep._write_good(lockstep.job, text[], lockstep._pass);
drop function if exists lockstep._attempt(lockstep.job, text[], text);
drop function if exists lockstep._settle(lockstep.job, text, text[], bigint[], tid[], text[], lockstep._pass, text[], text[]);
drop function if exists lockstep._limit_batch(lockstep.job, integer);
drop function if exists lockstep._hand_off(lockstep.job, text[], bigint, bigint);
drop function if exists lockstep._recompute_failed(lockstep.job, timestamptz, text, text);
drop function if exists lockstep._write(lockstep.job, text[]);
drop function if exists lockstep._apply(lockstep.job, text[]);
drop function if exists lockstep._owner_run(lockstep.job, text[], boolean);
drop function if exists lockstep._as_owner(lockstep.job, text[]);

-- pause / resume (15_controls.sql): the job's pause, kept with its definition
alter table lockstep.job add column paused_at timestamptz, add column paused_by name;
-- lockstep.status gains paused_at, paused_by and depends_on (11_status.sql makes it again)
-- lockstep._settle_entries returns the entries it folded (a failing key's entries folded into one)
drop function if exists lockstep._settle_entries(lockstep.job, bigint[], tid[], text[], text[], text[]);
-- lockstep.status gains stalled_for and stalled_passes
drop view if exists lockstep.status;
-- lockstep's timestamps are finite (an entry at -infinity failed lockstep.status for every reader, one at
-- infinity was never taken): such rows are made current first
update lockstep.queue set enqueued_at = now() where not pg_catalog.isfinite(enqueued_at);
update lockstep.queue set ready_at = now() where not pg_catalog.isfinite(ready_at);
update lockstep.recompute_flag set flagged_at = now() where not pg_catalog.isfinite(flagged_at);
alter table lockstep.queue
    add constraint queue_finite_times check (pg_catalog.isfinite(enqueued_at) and pg_catalog.isfinite(ready_at));
-- flags are inserted naming (job, problem) only: application roles get that column grant
alter table lockstep.recompute_flag alter column flagged_at set default pg_catalog.clock_timestamp(),
    add constraint recompute_flag_finite_time check (pg_catalog.isfinite(flagged_at));
-- a time limit per job (lockstep.set_time_limit); define_* take it, so their old signatures go
alter table lockstep.job add column timeout interval not null default '5 minutes' check (timeout > interval '0');
drop function if exists lockstep.define_job(text, regprocedure, text, interval, interval);
drop function if exists lockstep.define_derived(text, regclass, regprocedure, regclass, name, text, interval, interval,
                                                text, text);

-- keys of through tables, mapped to parent keys by the worker after they commit (17_through.sql)
create table lockstep.through_entry (
    id      bigint generated always as identity primary key,
    job     text not null,
    through oid not null,
    key     text not null
);
create index through_entry_job_idx on lockstep.through_entry (job, id);

-- composite parent keys: every job with a parent names its key columns in arrays (one element each here)
alter table lockstep.job add column parent_columns name[], add column parent_keys name[];
-- owners by oid: rights follow the role, not its name (a role gone since: oid 0, anyone may drop its jobs)
alter table lockstep.job
    add column owner_id regrole not null default pg_catalog.to_regrole(pg_catalog.quote_ident(current_user));
update lockstep.job set owner_id = coalesce(pg_catalog.to_regrole(pg_catalog.quote_ident(owner)), 0::oid::regrole);
alter table lockstep.run_log add column owner_id regrole;
alter table lockstep.viewer add column viewer_id regrole, add column owner_id regrole;
update lockstep.viewer set viewer_id = coalesce(pg_catalog.to_regrole(pg_catalog.quote_ident(viewer)), 0::oid::regrole),
                           owner_id = coalesce(pg_catalog.to_regrole(pg_catalog.quote_ident(owner)), 0::oid::regrole);
alter table lockstep.viewer alter column viewer_id set not null, alter column owner_id set not null;
update lockstep.run_log set owner_id = coalesce(pg_catalog.to_regrole(pg_catalog.quote_ident(owner)), 0::oid::regrole);
update lockstep.job set parent_columns = array[parent_column], parent_keys = array[parent_key]
where parent is not null and parent_column is not null;
