-- lockstep: watching a table that logical replication writes: a row trigger enabled for replica sessions.
-- A subscriber's apply worker runs with session_replication_role = replica and fires row triggers only,
-- never statement triggers, so watch()'s triggers never see its changes, even with ENABLE ALWAYS.

-- lockstep.enqueue_replica(): a row trigger function (arguments: job, key column) that queues the old and
-- new key of the changed row, in canonical text. Never raises: where it cannot enqueue it flags the job.
-- locks: the insert into lockstep.queue (or lockstep.recompute_flag): nothing a worker or a recompute holds.
create or replace function lockstep.enqueue_replica() returns trigger
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    j lockstep.job;
    v_keys text[];
    v_err text;
begin
    begin
        j := lockstep._queue_job(tg_argv[0]);
        execute pg_catalog.format('select lockstep._canon(array[($1).%1$I, ($2).%1$I]::%2$s)',
                                  tg_argv[1], lockstep._array_type(j.key_type))
            into v_keys using new, old;
        perform lockstep._append(j.job, lockstep._queueable(j.job, v_keys));
    exception when others then
        get stacked diagnostics v_err = message_text;
        perform lockstep._flag(tg_argv[0], pg_catalog.format('a replicated change of %s could not be queued: %s',
                                                             tg_relid::regclass, v_err));
    end;
    return null;
end;
$$;

comment on function lockstep.enqueue_replica() is
    'Row trigger (arguments: job, key column) that queues the old and new key of the changed row, for '
    'changes a logical-replication apply worker makes. Never raises: where it cannot enqueue it flags the '
    'job. Locks: the insert into lockstep.queue (or lockstep.recompute_flag).';

-- lockstep.watch_replica(job, source, key_column): watch() (statement triggers: the session's own writes),
-- and on source and the tables below it a row trigger enabled only for session_replication_role =
-- replica (ENABLE REPLICA): a subscriber's apply worker fires it, an ordinary session does not. unwatch()
-- and drop_job() drop it; watch() again drops it too (call watch_replica again). A job keyed by several
-- columns is refused (0A000): its subscriber's tables are watched through the WAL.
-- locks: as lockstep.watch; then each table's SHARE ROW EXCLUSIVE lock for its row trigger (lockstep._ddl).
create or replace function lockstep.watch_replica(job text, source regclass, key_column name) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
as $$
declare
    v_tables regclass[];
    v_name name := lockstep._trigger_name(job, 'replica');
begin
    if job is not null and cardinality((lockstep._job(job)).parent_columns) > 1 then
        raise exception 'lockstep: watch_replica takes a one-column parent key; job "%" has a composite one', job
            using errcode = '0A000',
                  hint = pg_catalog.format('Watch %s through the WAL of this database: lockstep.watch(%L, %L, '
                                           'key_columns => array[...]::name[], via => ''wal'').', source, job, source);
    end if;
    perform lockstep.watch(job, source, key_column);
    v_tables := lockstep._family(source);
    perform lockstep._ddl(v_tables, array(
        select s from pg_catalog.unnest(v_tables) t, lateral (values
            (pg_catalog.format('create trigger %I after insert or update or delete on %s for each row '
                               'execute function lockstep.enqueue_replica(%L, %L)', v_name, t, job, key_column)),
            (pg_catalog.format('alter table %s enable replica trigger %I', t, v_name))) x(s)),
        pg_catalog.format('watch_replica(%L, %L)', job, source));
end;
$$;

comment on function lockstep.watch_replica(text, regclass, name) is
    'watch(), and a row trigger enabled only for session_replication_role = replica on source and the '
    'tables below it, so a logical-replication subscriber''s apply worker queues the keys it changes. '
    'unwatch() and drop_job() drop it; watch() again drops it too. A job keyed by several columns is '
    'refused (0A000): watch its tables through the WAL. Locks: as lockstep.watch; then each '
    'table''s SHARE ROW EXCLUSIVE lock for its row trigger.';
