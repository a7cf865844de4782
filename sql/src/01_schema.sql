-- lockstep: the state: schema, types, tables, indexes, row security switched on. Fresh install only:
-- a revision's up.sql changes them. Functions, views and policies live in the files that follow.
--
-- SQLSTATEs raised by lockstep (the one list):
--   0A000  watch() of a composite parent key with through and via => 'wal' (the WAL: the table holding its columns)
--   22004  a NULL argument or a NULL key
--   22023  an invalid value (empty name, non-positive interval, batch or batch_parents, bad trigger arguments)
--   25000  run / work / recompute called in a transaction that is not READ COMMITTED (checked first)
--   42501  insufficient privilege: redefining another role's job; running a job whose owner the session may
--          not act as; a job's code leaving a WITH HOLD cursor or changed prepared statements
--   42725  a call of the job's or the compute function by name would be ambiguous
--   LSJ01  unknown job
--   LSJ02  the job is of the wrong kind for this call (generic vs derived, no parent)
--   LSD01  target table has no primary key
--   LSD02  compute function signature does not match (argument count or type, return type)
--   LSD03  compute columns do not match the target's
--   LSD04  parent / parent_column(s) invalid, the parent FK's ON DELETE action would fail the app's deletes,
--          or the parent's key is of a type lockstep refuses for keys (a domain, an array, a type with a
--          cast or text I/O function that is not a superuser's, a composite key type that is a table's
--          row type, has a cast, or a field of a refused type), at define_* and before keys are converted
--   LSD05  compute returned invalid rows (duplicate or NULL primary key)
--   LSD06  a foreign key lockstep cannot write through without waiting
--   LSD07  the target is already written by another job
--   LSD08  a job's query calls a volatile function
--   LSD09  a chain of derived jobs would form a cycle (a job would read its own target)
--   LSQ01  keys of the wrong type for the job's parent key
--   LSQ02  a watched key column that does not lead to the parent (a foreign key to another table; with
--          through, no foreign key to the through table)
--   55000  watch(..., via => 'wal') on a server whose wal_level is not logical, or of a table whose
--          replica identity does not hold the key column(s), or on a generated key column

create schema lockstep;

-- the comment names the revision the schema is at (an upgrade of a schema already there records it only)
comment on schema lockstep is
    'lockstep: derived tables kept up to date by background jobs, with no deadlocks and no long row locks '
    '(revision 0002)';

-- types ---------------------------------------------------------------------------------------------------

-- what every public entry point returns. outcome: done | idle | busy | not_due | backoff | failed | paused;
-- skipped: parent keys left for later; write_ms: the phase that holds row locks; more: keys left ready.
create type lockstep.result as (
    outcome     text,
    inserted    bigint,
    updated     bigint,
    deleted     bigint,
    skipped     bigint,
    compute_ms  double precision,
    write_ms    double precision,
    error       text,
    job         text,
    action      text,
    more        boolean
);

-- what one application of a diff produced (internal).
create type lockstep._pass as (
    inserted    bigint,
    updated     bigint,
    deleted     bigint,
    skipped     text[],     -- parent keys that still exist but could not be pinned: to be re-queued
    gone        bigint,     -- parent keys that vanished meanwhile: nothing to do
    compute_ms  double precision,
    write_ms    double precision,
    failed      text[],     -- worker only: keys whose computation or write raised
    errors      text[],     -- worker only: the matching error messages
    timed_out   text[],     -- worker only: the keys of the attempt a statement timeout ended (NULL: none)
    timed_out_error text,   -- worker only: that timeout's message
    transient   text,       -- worker only: an error that fails the pass as a whole (lockstep._whole_pass_error)
    untried     text[],     -- worker only: keys a retry pass left for the next one (lockstep._retry_each)
    cured       boolean,    -- worker only: a key that had failed was written (lockstep._settle)
    handed_off  bigint,     -- recompute only: parents handed to the queue, or rows left in the rest table
    handoff_from bigint,    -- recompute only: the first queue id of the hand-off (lockstep._limit_batch)
    handoff_todo bigint     -- recompute only: its parents to do, counted before the write
);

-- what a diff put in the work tables (internal): a write step with nothing to do is not run.
create type lockstep._diff_counts as (
    gone        bigint,     -- rows to delete
    fresh       bigint,     -- rows to insert (no current row of that primary key)
    pin         bigint,     -- rows whose parent the FK check looks up: new, or moving to another parent
    kept        bigint,     -- rows to update in place (a current row of that primary key)
    rest        bigint      -- lockstep._load_rest only: rows still in the rest table (-1: none)
);

-- session settings --------------------------------------------------------------------------------------
-- The only state lockstep keeps outside arguments and results: transaction-local settings, read and
-- written only through lockstep._session_get(setting) and lockstep._session_set(setting, value) (03_helpers.sql).
--   lockstep.tmp      the suffix of the work tables (06_write.sql) of the job named by lockstep.tmp_job,
--   lockstep.tmp_job  as lockstep._tmp_setup found or made them: a cache for the transaction, read by each
--                     step of the write path (lockstep._tmp), which runs as the job's owner below the
--                     owner's SECURITY DEFINER trampoline; finding them again costs catalog reads per step.

-- tables --------------------------------------------------------------------------------------------------

-- the registry: one row per job, written only by define_*, drop_job, pause and resume. Functions are stored as
-- regprocedure text: pg_upgrade refuses user tables with regprocedure columns.
create table lockstep.job (
    job             text primary key,
    kind            text not null check (kind in ('job', 'derived')),
    lock_group      text not null,
    call            text,           -- kind job: the function run on schedule
    target          regclass,       -- kind derived: the derived table
    compute         text,           -- kind derived: compute(keys) function
    parent          regclass,       -- kind derived: parent table (null: whole-table diff only)
    parent_column   name,           -- target column referencing parent
    parent_key      name,           -- parent's primary-key column
    key_type        regtype,        -- parent's primary-key type (type of compute's array elements)
    target_key      name[],         -- target's primary-key columns, in index order
    columns         name[],         -- columns compute returns (all of them written to the target)
    -- compared by binary image: their type's equality does not tell every change (lockstep._image_columns)
    image_columns   name[] not null default '{}',
    every           interval not null check (every > interval '0'),
    backoff         interval not null check (backoff > interval '0'),
    max_attempts    integer not null default 5 check (max_attempts > 0),
    -- parents written per transaction by a recompute batch or a worker pass (lockstep.set_batch_parents)
    batch_parents   integer not null default 500 check (batch_parents between 1 and 1000000),
    owner           name not null default current_user,
    created_at      timestamptz not null default now(),
    updated_at      timestamptz not null default now(),
    -- lockstep.pause / lockstep.resume: while paused_at is set, run(), work() and recompute() write nothing
    -- and return outcome paused; triggers keep queueing (15_controls.sql)
    paused_at       timestamptz,
    paused_by       name,
    -- the longest a run of the job may take: the runner's statement_timeout for it (lockstep.set_time_limit)
    timeout         interval not null default '5 minutes' check (timeout > interval '0'),
    -- kind derived with a parent: the target's columns referencing the parent's primary key, and that key's
    -- columns, both in the key's index order (one element each for a one-column key). parent_column and
    -- parent_key are their one element for a one-column key, NULL for a composite one (so code reading only
    -- them fails instead of using one column); key_type is then the composite type compute takes an array of.
    parent_columns  name[],
    parent_keys     name[],
    -- the owner role by oid: every right is judged by it, so a renamed role keeps its jobs and a new role of
    -- the old name gets none. owner is its name when the job was defined (a label)
    owner_id        regrole not null default pg_catalog.to_regrole(pg_catalog.quote_ident(current_user)),
    check (job <> ''),
    check (lock_group <> ''),
    check ((kind = 'job') = (call is not null)),
    check ((kind = 'derived') = (target is not null and compute is not null))
);

-- the status row of each job: written last by every run that did something.
create table lockstep.job_state (
    job                     text primary key references lockstep.job (job) on delete cascade,
    next_run_at             timestamptz not null default now(),   -- periodic part due
    retry_at                timestamptz,                          -- worker backoff after a failed pass
    last_outcome            text,
    last_action             text,
    last_started_at         timestamptz,
    last_finished_at        timestamptz,
    last_duration_ms        double precision,
    last_inserted           bigint,
    last_updated            bigint,
    last_deleted            bigint,
    last_skipped            bigint,
    last_more               boolean,                              -- the last worker pass left a backlog (lockstep._work)
    consecutive_failures    integer not null default 0,
    last_error              text,
    -- the error of the job's last full recompute, NULL once one succeeds
    recompute_error         text,
    runs                    bigint not null default 0,
    -- a recompute spread over several transactions: parents changed, and the queue-id range handed off
    recompute_total         bigint,
    recompute_queue_from    bigint,
    recompute_queue_to      bigint,
    -- when the job's earliest deferred queue entry is ready, for lockstep.due() (not read from the queue)
    deferred_until          timestamptz,
    -- a parentless recompute spread over several transactions: rows left, kept in a temp table of that session
    recompute_rest          bigint,
    recompute_rest_session  text,
    recompute_rest_at       timestamptz,
    -- set when a recompute found poison parents and handed every parent off: its flags wait until cured
    recompute_poisoned_at   timestamptz,
    -- a worker pass wrote a key that had failed: once no key fails and the hand-off is done, the hold ends
    recompute_poison_cured  boolean not null default false
);

-- the queue of changed parents: append-only, no unique constraint and no FK, so an enqueuer never waits
-- for a worker nor locks the job row; duplicates are folded when a worker claims them.
create table lockstep.queue (
    job         text not null,
    id          bigint generated always as identity,
    key         text not null,
    enqueued_at timestamptz not null default now(),
    ready_at    timestamptz not null default now(),   -- later for a key whose parent was locked (skipped)
    primary key (job, id),
    -- an entry at -infinity failed every reader of queue_lag, one at infinity was never taken
    constraint queue_finite_times check (pg_catalog.isfinite(enqueued_at) and pg_catalog.isfinite(ready_at))
);

-- by key first: one probe per claimed key, whatever the queue's (often stale) statistics say
create index queue_key_job_idx on lockstep.queue (key, job);

-- keys of a through table (an order's id) whose rows changed in a source watched through it: a worker maps
-- them to parent keys after they commit (lockstep._resolve_through), since the mapping row may change in a
-- transaction the trigger could not see. Written and read only through lockstep's definer functions.
create table lockstep.through_entry (
    id      bigint generated always as identity primary key,
    job     text not null,
    through oid not null,
    key     text not null
);
create index through_entry_job_idx on lockstep.through_entry (job, id);


-- the queue churns: vacuum it often, without cost delay; vacuum_truncate = false, so no vacuum takes
-- the ACCESS EXCLUSIVE lock an enqueuing application would wait for.
alter table lockstep.queue set (
    vacuum_truncate = false,
    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = 10000,
    autovacuum_vacuum_cost_delay = 0);

-- jobs to recompute in full because a trigger could not enqueue: append-only, written by lockstep._flag,
-- cleared by lockstep._clear_flag. No FK and no unique constraint: a flag never waits and never fails.
create table lockstep.recompute_flag (
    job         text not null,
    flagged_at  timestamptz not null default pg_catalog.clock_timestamp(),  -- clock time: lockstep._clear_flag
    problem     text not null,
    xid         xid8 not null default pg_catalog.pg_current_xact_id(),
    constraint recompute_flag_finite_time check (pg_catalog.isfinite(flagged_at))
);

create index recompute_flag_job_idx on lockstep.recompute_flag (job, flagged_at);

-- keys whose computation failed: retried with exponential backoff, parked after max_attempts.
create table lockstep.key_failure (
    job             text not null references lockstep.job (job) on delete cascade,
    key             text not null,
    attempts        integer not null,
    last_error      text,
    first_failed_at timestamptz not null default now(),
    last_failed_at  timestamptz not null default now(),
    retry_at        timestamptz not null,
    parked          boolean not null default false,
    -- the queue entry the last failing pass folded the key's entries it saw into: any other entry of the
    -- key is a change that pass did not see, whatever order ids were taken in (docs/design.md)
    failed_upto     bigint not null default 0,
    primary key (job, key)
);

-- viewers and run history ---------------------------------------------------------------------------

-- lockstep.viewer: roles that may read, never change, the jobs of an owner, without membership of the
-- owner role (membership is the owner's rights).
create table lockstep.viewer (
    viewer name not null,
    owner  name not null,
    -- the two roles by oid, set from the names when a row is written: a rename keeps a view, a new role of
    -- the old name gets none
    viewer_id regrole not null,
    owner_id  regrole not null,
    primary key (viewer, owner)
);
alter table lockstep.viewer enable row level security;

-- the registry: readable by every role granted SELECT; written only for an owner the writer may act as.
alter table lockstep.job enable row level security;

-- status rows and failures (they hold last_error): only the jobs the role manages.
alter table lockstep.job_state enable row level security;

alter table lockstep.key_failure enable row level security;

-- the queue: any role granted INSERT may append; only the jobs a role manages may be read or changed.
alter table lockstep.queue enable row level security;

-- recompute flags: any role granted INSERT may flag; only the jobs a role manages may be read or cleared.
alter table lockstep.recompute_flag enable row level security;
-- run history: one row per run that did something, written in the run's transaction, pruned by the writer.

-- settings: one row, typed columns (a bad value is refused when it is set).
-- run_log_keep: rows finished longer ago are pruned; run_log_max_per_job: rows kept per job (0: none).
create table lockstep.setting (
    only_row            boolean primary key default true check (only_row),
    run_log_keep        interval not null default '14 days' check (run_log_keep > interval '0'),
    run_log_max_per_job integer not null default 1000 check (run_log_max_per_job >= 0),
    -- the WAL capture (lockstep.capture): lockstep.capture_status turns unhealthy once its slot holds more
    -- WAL than capture_unhealthy_bytes; past capture_max_bytes the capture drops and recreates the slot
    -- and flags every job watching through the WAL for its full recompute
    capture_unhealthy_bytes bigint not null default 268435456 check (capture_unhealthy_bytes > 0),
    capture_max_bytes   bigint not null default 1073741824 check (capture_max_bytes > 0)
);

insert into lockstep.setting default values;

-- the history. No FK to lockstep.job: history outlives a dropped job, and an FK check would lock the job row.
create table lockstep.run_log (
    id          bigint generated always as identity primary key,
    job         text not null,
    owner       name not null,                  -- the job's owner at the time of the run (row security)
    lock_group  text not null,
    kind        text not null,                  -- job | derived
    action      text not null,                  -- call | recompute | work
    outcome     text not null,                  -- done | failed
    started_at  timestamptz not null,
    finished_at timestamptz not null,
    duration_ms double precision not null,
    compute_ms  double precision,               -- derived jobs: compute and diff, no row locks held
    write_ms    double precision,               -- derived jobs: the write phase
    inserted    bigint not null default 0,
    updated     bigint not null default 0,
    deleted     bigint not null default 0,
    skipped     bigint not null default 0,      -- parents held by an application, re-queued
    gone        bigint not null default 0,      -- parents that vanished meanwhile
    failed_keys bigint not null default 0,      -- worker: keys whose computation failed (key_failure)
    error       text,                           -- failed: the error; done with failed keys: the first one
    run_no      bigint not null,                -- lockstep.job_state.runs after this run
    role        name not null default current_user,  -- the role that ran it (the runner's)
    pid         integer not null default pg_catalog.pg_backend_pid(),
    owner_id    regrole                         -- the job's owner by oid (row security); owner is its name then
) with (
    -- rows are deleted as fast as they are inserted: vacuum every 1000 dead rows
    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000
);

create index run_log_job_run_no_idx on lockstep.run_log (job, run_no);
create index run_log_finished_at_idx on lockstep.run_log (finished_at);

-- row security: a role sees only the runs of jobs whose owner it may manage; no UPDATE policy.
alter table lockstep.run_log enable row level security;

-- WAL capture ----------------------------------------------------------------------------------------------

-- the tables jobs watch through the WAL (watch(..., via => 'wal')): no trigger on them; lockstep.capture()
-- reads their changes from the database's logical replication slot and queues the key column's values (a
-- composite key's record text, as watch()'s triggers queue it).
create table lockstep.wal_watch (
    job         text not null references lockstep.job (job) on delete cascade,
    source      regclass not null,
    key_column  name not null,                    -- a composite key's first column
    watched_at  timestamptz not null default now(),
    key_columns name[],                           -- a composite key's columns, in its fields' order; else NULL
    primary key (job, source)
);
alter table lockstep.wal_watch enable row level security;

-- where the capture is: one row per database, written by lockstep.capture() only.
--   slot: the logical replication slot it reads (one per database, shared by every job watching via wal)
--   queued_lsn: the changes up to here are in the queue (committed with them); the next capture first
--   advances the slot to it, so a capture that rolls back or dies re-reads them (at least once).
create table lockstep.capture_state (
    only_row        boolean primary key default true check (only_row),
    slot            name not null,
    queued_lsn      pg_lsn,
    slot_created_at timestamptz not null default now(),
    last_capture_at timestamptz,
    last_changes    bigint not null default 0,    -- changes of watched tables the last capture read
    changes         bigint not null default 0,    -- all of them since the slot was created
    recreated       bigint not null default 0,    -- times the slot fell too far behind and was recreated
    families        text[]                        -- the watched tables' partitions as last seen (lockstep._capture_families)
);
alter table lockstep.capture_state enable row level security;
