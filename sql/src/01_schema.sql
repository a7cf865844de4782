-- lockstep: the state: schema, types, tables, indexes and row security switched on (fresh install only;
-- a revision's up.sql changes them). Functions, views and policies live in the files that follow.
-- Sections: schema, types, tables, indexes. Functions live in the files that follow, one file per concern.
--
-- SQLSTATEs raised by lockstep (the one list; docs/design.md explains each):
--   22004  a NULL argument or a NULL key
--   22023  an invalid value (empty name, non-positive interval, batch or batch_parents, bad trigger arguments)
--   25000  run / work / recompute called in a transaction that is not READ COMMITTED (checked first)
--   42501  insufficient privilege: redefining a job owned by another role; running a job whose owner the
--          session may not act as (or whose owner role is gone; recorded in last_error, never run with
--          the runner's rights); a job's code leaving a WITH HOLD cursor or changed prepared statements
--   42725  a call of the job's or the compute function by name would be ambiguous (an overload accepts it)
--   LSJ01  unknown job
--   LSJ02  the job is of the wrong kind for this call (generic vs derived, no parent)
--   LSD01  target table has no primary key
--   LSD02  compute function signature does not match (argument count or type, return type)
--   LSD03  compute columns do not match the target's
--   LSD04  parent / parent_column invalid, or the parent FK's ON DELETE action would fail the app's deletes,
--          or the parent's key is of a domain or composite type
--   LSD05  compute returned invalid rows (duplicate or NULL primary key)
--   LSD06  a foreign key lockstep cannot write through without waiting: a target FK column with a default
--          compute does not return; a referencing FK ON DELETE NO ACTION / RESTRICT / SET DEFAULT, more
--          than one level deep, or on columns compute writes
--   LSD07  the target is already written by another job
--   LSQ01  keys of the wrong type for the job's parent key

create schema lockstep;

comment on schema lockstep is
    'lockstep: derived tables kept up to date by background jobs, with no deadlocks and no long row locks';

-- types ---------------------------------------------------------------------------------------------------

-- what every public entry point returns.
--   outcome: done | idle | busy | not_due | backoff | failed
--   inserted / updated / deleted: target rows written; skipped: parent keys left for later (locked by an
--   application, re-queued), or rows for a job without a parent.
--   compute_ms: compute and diff, no row locks held; write_ms: the write phase (locks held).
--   more: a worker pass left ready keys in the queue (the runner goes again at once).
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
    errors      text[]      -- worker only: the matching error messages
);

-- what a diff put in the work tables (internal): the write steps with nothing to do are not run (each is
-- a statement planned at every pass).
create type lockstep._diff_counts as (
    gone        bigint,     -- rows to delete
    fresh       bigint,     -- rows to insert (no current row of that primary key)
    pin         bigint,     -- rows whose parent the FK check looks up: new, or moving to another parent
    kept        bigint      -- rows to update in place (a current row of that primary key)
);

-- tables --------------------------------------------------------------------------------------------------

-- the registry: one row per job, written only by define_* and drop_job.
-- Functions are stored as their regprocedure text (schema-qualified signature), not as regprocedure:
-- pg_upgrade refuses user tables with regprocedure columns, and function oids do not survive it.
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
    -- columns compared by their binary image, not by their type's equality, which does not tell every change
    -- (numeric 1.0 = 1.000, box by area, text under a nondeterministic collation): lockstep._image_columns
    image_columns   name[] not null default '{}',
    every           interval not null check (every > interval '0'),
    backoff         interval not null check (backoff > interval '0'),
    max_attempts    integer not null default 5 check (max_attempts > 0),
    -- parents written per transaction: a recompute whose difference touches more parents writes the first
    -- batch_parents (in parent-key order) and hands the rest to the queue; a worker pass of lockstep.run()
    -- claims this many (lockstep.set_batch_parents).
    batch_parents   integer not null default 500 check (batch_parents between 1 and 1000000),
    owner           name not null default current_user,
    created_at      timestamptz not null default now(),
    updated_at      timestamptz not null default now(),
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
    -- the error of the job's last full recompute (recompute or a generic job's call) if it failed, NULL
    -- once one succeeds: a worker pass that succeeds meanwhile resets consecutive_failures and last_error,
    -- but not this, nor the recompute's backoff (next_run_at)
    recompute_error         text,
    runs                    bigint not null default 0,
    -- a recompute spread over several transactions (its difference exceeded batch_parents): how many
    -- parents it changed, and the queue ids of the hand-off of those it left to the worker (lockstep.status
    -- derives recompute_done from the entries of that range still queued). NULL: none handed off.
    recompute_total         bigint,
    recompute_queue_from    bigint,
    recompute_queue_to      bigint,
    -- when the job's earliest deferred queue entry is ready (a key skipped because an application held its
    -- parent waits a second: lockstep._defer_until), for lockstep.due(); written by lockstep._finish. Kept
    -- here, not found in the queue: min(ready_at) over the job's entries read every entry at every tick
    -- (84-128 ms with a million handed-off keys queued; a sequential scan of the whole heap with stale
    -- statistics), and an index for it cost every enqueue ~2.6 us (17 % of the trigger).
    deferred_until          timestamptz,
    -- a recompute of a job without a parent spread over several transactions (its difference exceeded
    -- batch_parents rows): the rows still to write (recompute_total: all of them), kept in a temp table of
    -- the session recompute_rest_session (backend pid and start) that wrote the last batch, at
    -- recompute_rest_at (lockstep._continue). NULL: none.
    recompute_rest          bigint,
    recompute_rest_session  text,
    recompute_rest_at       timestamptz,
    -- when the job's last recompute found poison parents and handed every parent to the worker
    -- (lockstep._recompute_failed): its recompute flags wait, not cleared (that pass saw what they flag only
    -- for the parents it handed off) and not taken again at once (each time the same pass failed the same
    -- way: a loop of ~120 recomputes a second, and no parent written; found by a probe), until the next
    -- periodic recompute or lockstep.retry, or until the poison is cured. NULL after any other recompute.
    recompute_poisoned_at   timestamptz,
    -- a worker pass wrote a key that had failed since (its data fixed): once no key fails and the hand-off
    -- is worked off, the hold ends (lockstep._finish). Kept here, not only in the pass that cured it: a key
    -- cured while the hand-off was still queued (the common case: retries come first) ended no hold, and a
    -- later TRUNCATE's flag waited for the periodic recompute (found by a review).
    recompute_poison_cured  boolean not null default false
);

-- the queue of changed parents: append-only, no unique constraint on (job, key), so an enqueuer never
-- waits for a worker; duplicates are folded when a worker claims them. No foreign key either: an FK check
-- would make every enqueue lock the job row.
create table lockstep.queue (
    job         text not null,
    id          bigint generated always as identity,
    key         text not null,
    enqueued_at timestamptz not null default now(),
    ready_at    timestamptz not null default now(),   -- later for a key whose parent was locked (skipped)
    primary key (job, id)
);

-- by key first: the worker finds a pass's entries with one probe per key whose job condition is only a filter,
-- so no plan can take the primary key (job, id) and filter every entry of the job instead (the planner did,
-- with the queue's statistics stale: a VACUUM of the queue while empty leaves reltuples = 0; see _entries)
create index queue_key_job_idx on lockstep.queue (key, job);


-- the queue churns (every worker pass deletes what it processed): vacuum it after a thousand dead rows, not
-- after 20 % of the table, and without cost delay (it is small). Autovacuum visits a database at most once
-- per autovacuum_naptime (default 1 min), or never (autovacuum = off), so runners that may also VACUUM it
-- every 10 s while they work. vacuum_truncate = false: no vacuum ever takes the ACCESS EXCLUSIVE lock that
-- truncating the file needs, so an enqueuing application never waits for one.
alter table lockstep.queue set (
    vacuum_truncate = false,
    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = 10000,
    autovacuum_vacuum_cost_delay = 0);

-- jobs to recompute in full because a trigger could not enqueue (unknown job, no queue, a column gone, a
-- key that does not convert): append-only, written by lockstep._flag with an INSERT (application roles may
-- insert, never update), deleted by lockstep._clear_flag after a recompute whose snapshot saw them (xid).
-- No foreign key and no unique constraint: a flag never waits and never fails.
create table lockstep.recompute_flag (
    job         text not null,
    flagged_at  timestamptz not null default now(),
    problem     text not null,
    xid         xid8 not null default pg_catalog.pg_current_xact_id()
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
    -- the highest queue id the pass that last failed on the key had claimed: an entry of the key above it
    -- is a change that pass did not see (a parked key tried once more, a cure). Compared by time
    -- (enqueued_at, its transaction's start, against last_failed_at), a fix whose transaction began before
    -- the failing try and committed after it was missed: the key stayed parked on fixed data (a review).
    failed_upto     bigint not null default 0,
    primary key (job, key)
);

-- viewers and run history ---------------------------------------------------------------------------

-- lockstep.viewer: roles that may read, never change, the jobs of an owner (lockstep status, lockstep web),
-- without being members of the owner role: membership is the owner's rights, and SET ROLE to it (a viewer
-- recipe that granted the owner role could delete derived rows and drop tables; found by a review).
-- Written by the owner for its own jobs, or by an admin.
create table lockstep.viewer (
    viewer name not null,
    owner  name not null,
    primary key (viewer, owner)
);
alter table lockstep.viewer enable row level security;

-- the registry: readable by every role granted SELECT (applications look their jobs up); rows are
-- written only for an owner the writer may act as, with a key type that runs no code.
alter table lockstep.job enable row level security;

-- status rows and failures (they hold last_error): only the jobs the role manages, for every command.
-- The subquery is uncorrelated: planned once per query as a hashed subplan, not once per row.
alter table lockstep.job_state enable row level security;

alter table lockstep.key_failure enable row level security;

-- the queue: any role granted INSERT may append (applications enqueue through triggers running as
-- themselves); only the jobs a role manages may be read, updated or deleted. A role granted SELECT on
-- the job column alone sees that every job's rows exist, not their keys (the trigger reads nothing).
alter table lockstep.queue enable row level security;

-- recompute flags: like the queue, any role granted INSERT may flag a job (a trigger that could not
-- enqueue, running as the application); only the jobs a role manages may be read or cleared.
alter table lockstep.recompute_flag enable row level security;
-- lockstep: run history. One row per run that did something (outcome done or failed; idle, busy,
-- not_due and backoff look-ups are not runs and are not logged), in the spirit of pg_cron's
-- cron.job_run_details. Written by lockstep._finish through lockstep._log_run, in the run's own
-- transaction, after the status row. Retention is bounded by lockstep.setting and enforced by the writer.

-- settings: one row, typed columns (a bad value is refused when it is set, never when a run reads it).
--   run_log_keep         rows finished longer ago than this are pruned (default 14 days)
--   run_log_max_per_job  at most this many rows per job are kept (default 1000; 0: runs are not logged)
create table lockstep.setting (
    only_row            boolean primary key default true check (only_row),
    run_log_keep        interval not null default '14 days' check (run_log_keep > interval '0'),
    run_log_max_per_job integer not null default 1000 check (run_log_max_per_job >= 0)
);

insert into lockstep.setting default values;

-- the history. No foreign key to lockstep.job: history outlives a dropped job (pruned by age), and an FK
-- check would lock the job row on every run.
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
    pid         integer not null default pg_catalog.pg_backend_pid()
) with (
    -- rows are deleted at the rate they are inserted, from the low end of both indexes: vacuum every
    -- 1000 dead rows, so a prune's index scan never steps over a long run of dead entries first.
    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000
);

create index run_log_job_run_no_idx on lockstep.run_log (job, run_no);
create index run_log_finished_at_idx on lockstep.run_log (finished_at);

-- row security: a role sees, writes and prunes only the runs of jobs whose owner it may manage (the
-- rules of lockstep.job); no UPDATE policy, so rows are never changed. Superusers and the table owner
-- bypass it. Nothing is granted: see the role recipes in docs/web.md.
alter table lockstep.run_log enable row level security;
