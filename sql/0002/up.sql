-- lockstep 0002 up, before the code: the state's change from 0001 (tables, types, indexes), and the
-- functions and views whose signature or columns change or that go away. The code (sql/src, frozen into
-- sql/0002/code/ at release) follows, then up_after.sql.
-- locks: ACCESS EXCLUSIVE on each table altered, for the migration's transaction.
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
    recreated       bigint not null default 0
);
alter table lockstep.capture_state enable row level security;

-- define_derived() gains query and query_search_path (compute may be NULL then)
drop function if exists lockstep.define_derived(text, regclass, regprocedure, regclass, name, text, interval, interval);
