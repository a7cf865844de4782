-- lockstep: watching a table through the WAL (watch(..., via => 'wal')) and the capture that reads it. No
-- trigger on the table: one publication and one pgoutput slot per database; a capture queues the changed keys
-- and records the LSN read up to in one transaction, and the next capture advances the slot to it first.

-- lockstep._capture_slot(): the name of this database's capture slot (slot names are cluster-wide).
create or replace function lockstep._capture_slot() returns name
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.format('lockstep_%s', d.oid)::name from pg_catalog.pg_database d
    where d.datname = pg_catalog.current_database();
$$;

-- lockstep._capture_publication(): the name of this database's capture publication.
create or replace function lockstep._capture_publication() returns name
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select 'lockstep_capture'::name;
$$;

-- lockstep._capture_in_use(): the database has the capture's publication or slot (read from catalogs every
-- role may read).
create or replace function lockstep._capture_in_use() returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select exists (select from pg_catalog.pg_publication p where p.pubname = lockstep._capture_publication())
           or exists (select from pg_catalog.pg_replication_slots s where s.slot_name = lockstep._capture_slot());
$$;

-- lockstep._identity_covers(rel, key_columns): the WAL record of an UPDATE or DELETE of rel holds the old
-- values of every column of key_columns (rel's replica identity is FULL, or its primary key or replica
-- identity index holds them all). Else an update that moves a row to another key would queue the new key
-- only. PL/pgSQL: each capture calls it, and a SQL function with a SET clause is planned at every call.
create or replace function lockstep._identity_covers(rel regclass, key_columns name[]) returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return (select c.relreplident = 'f'
                   or exists (select from pg_catalog.pg_index i
                              where i.indrelid = c.oid
                                and ((c.relreplident = 'd' and i.indisprimary) or (c.relreplident = 'i' and i.indisreplident))
                                and not exists (select from pg_catalog.unnest(key_columns) k(name)
                                                where not exists (select from pg_catalog.pg_attribute a
                                                                  where a.attrelid = i.indrelid and a.attname = k.name
                                                                    and a.attnum = any(i.indkey))))
            from pg_catalog.pg_class c where c.oid = rel);
end;
$$;

-- lockstep._columns_text(key_columns): key_columns for messages: column a, or columns (a, b).
create or replace function lockstep._columns_text(key_columns name[]) returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select case when pg_catalog.cardinality(key_columns) = 1 then pg_catalog.format('column %I', key_columns[1])
                else pg_catalog.format('columns (%s)', lockstep._cols(key_columns)) end;
$$;

-- lockstep._check_wal(source, key_columns): refuse a WAL watch the capture could not follow: wal_level not
-- logical (55000), no right to use replication slots (42501), a replica identity of source or of a table
-- below it without every key column (55000).
create or replace function lockstep._check_wal(source regclass, key_columns name[]) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_bad regclass;
begin
    if pg_catalog.current_setting('wal_level') <> 'logical' then
        raise exception 'lockstep: watch(..., via => ''wal'') needs wal_level = logical; this server has %',
            pg_catalog.current_setting('wal_level')
            using errcode = '55000',
                  hint = 'Set wal_level = logical (and max_replication_slots >= 1) and restart the server, or watch '
                         'through triggers (the default).';
    end if;
    if not exists (select from pg_catalog.pg_roles r
                   where r.rolname = current_user and (r.rolreplication or r.rolsuper)) then
        raise exception 'lockstep: role % may not use replication slots, which watch(..., via => ''wal'') needs', current_user
            using errcode = '42501',
                  hint = pg_catalog.format('ALTER ROLE %I REPLICATION (the runner''s role needs it too), or watch '
                                           'through triggers (the default).', current_user);
    end if;
    select t into v_bad from pg_catalog.unnest(lockstep._family(source)) t
    where not coalesce(lockstep._identity_covers(t, key_columns), false) limit 1;
    if v_bad is not null then
        raise exception 'lockstep: the replica identity of % does not hold %: the WAL would not say which key an update or delete left',
            v_bad, lockstep._columns_text(key_columns)
            using errcode = '55000',
                  hint = pg_catalog.format('ALTER TABLE %s REPLICA IDENTITY FULL (or USING INDEX of a unique index on %s); '
                                           'a primary key on %s is enough.', v_bad, lockstep._cols(key_columns),
                                           lockstep._cols(key_columns));
    end if;
end;
$$;

-- lockstep._check_wal_key(j, source, key_columns): the WAL holds each key column's text, queued as it is
-- (one column) or as the fields of the key's record text: each column's text must be its field's own
-- (lockstep._fast_pairs, and a field with no type modifier), else LSQ01. No conversion, so no code of a
-- type's owner runs in the capture. A generated key column is not in the WAL's changes: 55000.
create or replace function lockstep._check_wal_key(j lockstep.job, source regclass, key_columns name[]) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_composite boolean := lockstep._key_fields(j) is not null;
    v_fields text[] := case when v_composite then array(select pg_catalog.format_type(a.atttypid, a.atttypmod)
                                                        from pg_catalog.pg_type y
                                                        join pg_catalog.pg_attribute a on a.attrelid = y.typrelid and a.attnum > 0
                                                        where y.oid = j.key_type and not a.attisdropped order by a.attnum)
                            else array[j.key_type::text] end;
    v_names name[] := lockstep._key_fields(j);
    v_bad text;
    v_gen text;
begin
    select pg_catalog.format('%s.%I is %s, and %s %s', source, c.name, a.atttypid::regtype,
                             case when not v_composite then 'the job''s key type is'
                                  else pg_catalog.format('field %I of the key type %s is', v_names[c.o], j.key_type) end,
                             v_fields[c.o])
    into v_bad
    from pg_catalog.unnest(key_columns) with ordinality c(name, o)
    join pg_catalog.pg_attribute a on a.attrelid = source and a.attname = c.name and a.attnum > 0 and not a.attisdropped
    where pg_catalog.concat(a.atttypid, ':', v_fields[c.o]) <> all(lockstep._fast_pairs())
    order by c.o limit 1;
    select pg_catalog.format('%s.%I', source, a.attname) into v_gen from pg_catalog.pg_attribute a
    where a.attrelid = source and a.attname = any(key_columns) and a.attgenerated <> '' order by a.attnum limit 1;
    if v_gen is not null then
        raise exception 'lockstep: % is a generated column, which the WAL''s changes do not carry', v_gen
            using errcode = '55000', hint = 'Watch it through triggers (the default).';
    end if;
    if v_bad is not null then
        raise exception 'lockstep: %: watch(..., via => ''wal'') takes columns whose text is the key''s', v_bad
            using errcode = 'LSQ01',
                  hint = pg_catalog.format('Key and column types of %s, with no type modifier on a key field (a column of '
                                           'the same type is always fine), or watch through triggers (the default).',
                                           pg_catalog.array_to_string(lockstep._fast_types(), ', '));
    end if;
end;
$$;

-- lockstep._wal_sources(): the tables some job watches through the WAL (lockstep.wal_watch's sources), each
-- once, in oid order. Security definer, read-only: every role may read them in pg_publication_rel, and an
-- owner's unwatch and drop_job, which hold nothing on lockstep.wal_watch, keep the publication to them.
create or replace function lockstep._wal_sources() returns regclass[]
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    return array(select distinct w.source from lockstep.wal_watch w order by 1);
end;
$$;
comment on function lockstep._wal_sources() is
    'The tables some job watches through the WAL (lockstep.wal_watch''s sources), each once, in oid order. '
    'Security definer, read-only: pg_publication_rel shows them to every role. Locks: nothing.';

-- lockstep._delete_wal_watch(job, source): delete job's lockstep.wal_watch row of source, for a caller that
-- manages job (lockstep._check_manages, 42501). False: there was none. Security definer: the owner recipe
-- holds nothing on lockstep.wal_watch.
-- locks: that row (deleted).
create or replace function lockstep._delete_wal_watch(job text, source regclass) returns boolean
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    perform lockstep._check_manages(job);
    delete from lockstep.wal_watch w where w.job = _delete_wal_watch.job and w.source = _delete_wal_watch.source;
    return found;
end;
$$;
comment on function lockstep._delete_wal_watch(text, regclass) is
    'Delete job''s lockstep.wal_watch row of source, for a caller that manages job (42501). False: there was '
    'none. Security definer: the owner recipe holds nothing on lockstep.wal_watch. Locks: that row (deleted).';

-- lockstep._publication_ddl(): the ALTER PUBLICATION statements that make the capture publication hold
-- exactly the tables of lockstep.wal_watch (CREATE PUBLICATION when there is none and a table to hold).
create or replace function lockstep._publication_ddl() returns text[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_pub name := lockstep._capture_publication();
    v_has boolean := exists (select from pg_catalog.pg_publication p where p.pubname = v_pub);
    v_want regclass[] := lockstep._wal_sources();  -- security definer: an owner reads no lockstep.wal_watch
    v_now regclass[] := array(select pr.prrelid::regclass from pg_catalog.pg_publication_rel pr
                              join pg_catalog.pg_publication p on p.oid = pr.prpubid where p.pubname = v_pub);
    v_add regclass[] := array(select t from pg_catalog.unnest(v_want) t where t <> all(v_now));
    v_drop regclass[] := array(select t from pg_catalog.unnest(v_now) t
                               where t <> all(v_want)
                                 and not exists (select from pg_catalog.unnest(v_want) w
                                                 where t = any(lockstep._family(w))));
    v_ddl text[] := '{}';
begin
    if not v_has and cardinality(v_want) > 0 then
        v_ddl := v_ddl || pg_catalog.format('create publication %I', v_pub);
    end if;
    if cardinality(v_add) > 0 then
        v_ddl := v_ddl || pg_catalog.format('alter publication %I add table %s', v_pub,
                                            pg_catalog.array_to_string(v_add, ', '));
    end if;
    if v_has and cardinality(v_want) = 0 then
        v_ddl := v_ddl || pg_catalog.format('drop publication %I', v_pub);
    elsif cardinality(v_drop) > 0 then
        v_ddl := v_ddl || pg_catalog.format('alter publication %I drop table %s', v_pub,
                                            pg_catalog.array_to_string(v_drop, ', '));
    end if;
    return v_ddl;
end;
$$;

-- lockstep._put_wal_watch(job, source, key_columns, composite): record that job watches source through the
-- WAL on key_columns (a composite key's columns, or one column), for a caller that manages job (42501);
-- returns the columns it was watched on before (NULL: it was not). Security definer: the owner recipe holds
-- no INSERT or UPDATE on lockstep.wal_watch.
-- locks: job's lockstep.wal_watch row of source (insert or update).
create or replace function lockstep._put_wal_watch(job text, source regclass, key_columns name[],
                                                   composite boolean) returns name[]
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_old name[];
begin
    perform lockstep._check_manages(job);
    perform lockstep._job(job);  -- LSJ01: no rows for a job that does not exist
    select coalesce(w.key_columns, array[w.key_column]) into v_old from lockstep.wal_watch w
    where w.job = _put_wal_watch.job and w.source = _put_wal_watch.source;
    insert into lockstep.wal_watch (job, source, key_column, key_columns)
    values (job, source, key_columns[1], case when composite then key_columns end)
    on conflict on constraint wal_watch_pkey
    do update set key_column = excluded.key_column, key_columns = excluded.key_columns, watched_at = now();
    return v_old;
end;
$$;
comment on function lockstep._put_wal_watch(text, regclass, name[], boolean) is
    'Record that job watches source through the WAL on key_columns, for a caller that manages job (42501); '
    'the columns it was watched on before. Security definer: the owner recipe holds no INSERT or UPDATE on '
    'lockstep.wal_watch. Locks: job''s lockstep.wal_watch row of source (insert or update).';

-- lockstep._watch_wal(j, source, key_columns): watch source through the WAL for job j on its key column
-- (one element) or a composite key's columns: the checks of lockstep._check_wal and lockstep._check_wal_key,
-- then one lockstep.wal_watch row, source in the capture publication, and the job's triggers on source (an
-- earlier watch()) dropped, all in one lockstep._ddl call. Flags the job for its full recompute when source is
-- newly watched or watched on other columns (as watch() through triggers does).
-- locks: source and the tables below it (ACCESS EXCLUSIVE, never waited for long: lockstep._ddl).
create or replace function lockstep._watch_wal(j lockstep.job, source regclass, key_columns name[]) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_tables regclass[] := lockstep._family(source);
    v_composite boolean := lockstep._key_fields(j) is not null;
    v_old name[];
begin
    if not v_composite then  -- LSQ02: a column that does not lead to the parent (lockstep._check_key_columns's)
        perform lockstep._check_source_key(j, source, key_columns[1]);
    end if;
    perform lockstep._check_wal(source, key_columns);
    perform lockstep._check_wal_key(j, source, key_columns);
    v_old := lockstep._put_wal_watch(j.job, source, key_columns, v_composite);  -- security definer
    perform lockstep._ddl(v_tables, lockstep._drop_watch_ddl(j.job, v_tables) || lockstep._publication_ddl(),
                          pg_catalog.format('watch(%L, %L, via => ''wal'')', j.job, source));
    if v_old is distinct from key_columns then
        perform lockstep._flag_job(j.job, pg_catalog.format('%s watched through the WAL on %s now: its earlier '
                                                            'changes wait for the full recompute', source,
                                                            lockstep._columns_text(key_columns)));
    end if;
    perform lockstep._drop_unused_triggers();
end;
$$;
comment on function lockstep._watch_wal(lockstep.job, regclass, name[]) is
    'Watch source through the WAL for job j on its key column (one element) or a composite key''s columns: '
    'the checks of lockstep._check_wal and lockstep._check_wal_key, then one lockstep.wal_watch row, source in '
    'the capture publication, and the job''s triggers on source (an earlier watch()) dropped, all in one '
    'lockstep._ddl call. Flags the job for its full recompute when source is newly watched or watched on other '
    'columns (as watch() through triggers does). Locks: source and the tables below it (ACCESS EXCLUSIVE, '
    'never waited for long: lockstep._ddl).';

-- lockstep._watched_via_wal(job, source): job watches source (NULL: any table) through the WAL: it has
-- such a lockstep.wal_watch row. For a caller that manages job (42501). Security definer, read-only: an
-- owner of the recipe holds nothing on lockstep.wal_watch, and its watch, unwatch and drop_job ask while
-- the database captures the WAL for another job.
create or replace function lockstep._watched_via_wal(job text, source regclass default null) returns boolean
language plpgsql stable
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    perform lockstep._check_manages(job);
    return exists (select from lockstep.wal_watch w
                   where w.job = _watched_via_wal.job
                     and (_watched_via_wal.source is null or w.source = _watched_via_wal.source));
end;
$$;
comment on function lockstep._watched_via_wal(text, regclass) is
    'Job watches source (NULL: any table) through the WAL, for a caller that manages job (42501). Security '
    'definer, read-only: an owner of the recipe holds nothing on lockstep.wal_watch. Locks: nothing.';

-- lockstep._unwatch_wal(job, source): stop watching source through the WAL for job (its lockstep.wal_watch
-- row); source leaves the capture publication when no job watches it, and the publication and the slot go
-- when no table is left (lockstep._capture_cleanup). False: the job did not watch source through the WAL.
-- locks: source and the tables below it (ACCESS EXCLUSIVE, never waited for long: lockstep._ddl).
create or replace function lockstep._unwatch_wal(job text, source regclass) returns boolean
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    -- never watched through the WAL (nothing of lockstep.wal_watch read), or not this job and source
    if not lockstep._capture_in_use() or not lockstep._watched_via_wal(job, source) then
        return false;
    end if;
    if not lockstep._delete_wal_watch(job, source) then  -- security definer
        return false;
    end if;
    perform lockstep._capture_cleanup();
    return true;
end;
$$;
comment on function lockstep._unwatch_wal(text, regclass) is
    'Stop watching source through the WAL for job (its lockstep.wal_watch row); source leaves the capture'
    ' publication when no job watches it, and the publication and the slot go when no table is left '
    '(lockstep._capture_cleanup). False: the job did not watch source through the WAL. Locks: source and '
    'the tables below it (ACCESS EXCLUSIVE, never waited for long: lockstep._ddl).';

-- lockstep._capture_forget(): delete the capture's state row (no table is watched through the WAL any
-- more). Security definer, for a caller that may capture (lockstep._check_captures, 42501): no recipe role
-- holds DELETE on lockstep.capture_state.
-- locks: the lockstep.capture_state row (deleted).
create or replace function lockstep._capture_forget() returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    perform lockstep._check_captures();
    delete from lockstep.capture_state;
end;
$$;
comment on function lockstep._capture_forget() is
    'Delete the capture''s state row (no table is watched through the WAL any more). Security definer, for '
    'a caller that may capture (lockstep._check_captures, 42501). Locks: the lockstep.capture_state row '
    '(deleted).';

-- lockstep._capture_cleanup(): the capture publication holds the tables of lockstep.wal_watch and nothing
-- else; with none left, the publication, the slot and the capture's state go (a slot nobody reads would
-- keep WAL for ever). Called by unwatch, drop_job and lockstep.capture.
-- locks: the tables leaving the publication (ACCESS EXCLUSIVE, never waited for long: lockstep._ddl).
create or replace function lockstep._capture_cleanup() returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_ddl text[];
    v_slot name := lockstep._capture_slot();
    v_sources regclass[];
begin
    if not lockstep._capture_in_use() then
        return;
    end if;
    v_ddl := lockstep._publication_ddl();
    v_sources := lockstep._wal_sources();  -- security definer: an owner reads no lockstep.wal_watch
    if cardinality(v_ddl) > 0 then
        perform lockstep._ddl(array(select pr.prrelid::regclass from pg_catalog.pg_publication_rel pr
                                    join pg_catalog.pg_publication p on p.oid = pr.prpubid
                                    where p.pubname = lockstep._capture_publication()
                                      and pr.prrelid::regclass <> all(v_sources)),
                              v_ddl, 'the capture publication''s update');
    end if;
    if cardinality(v_sources) = 0 then
        perform lockstep._capture_forget();
        if exists (select from pg_catalog.pg_replication_slots s where s.slot_name = v_slot) then
            perform pg_catalog.pg_drop_replication_slot(v_slot);
        end if;
    end if;
end;
$$;
comment on function lockstep._capture_cleanup() is
    'The capture publication holds the tables of lockstep.wal_watch and nothing else; with none left, the'
    ' publication, the slot and the capture''s state go (a slot nobody reads would keep WAL for ever). '
    'Called by unwatch, drop_job and lockstep.capture. Locks: the tables leaving the publication (ACCESS '
    'EXCLUSIVE, never waited for long: lockstep._ddl).';

-- lockstep._pgo_int(d, at, bytes): the big-endian unsigned integer of 2 or 4 bytes at offset at (from 0) of
-- a pgoutput message. No SET clause and not strict, so the planner inlines it into lockstep._capture_read's
-- statement (it runs once per change); every operator is schema-qualified instead.
create or replace function lockstep._pgo_int(d bytea, at integer, bytes integer) returns bigint
language sql immutable parallel safe
as $$
    select case bytes when 2 then pg_catalog.get_byte(d, at)::pg_catalog.int8 operator(pg_catalog.<<) 8
                                  operator(pg_catalog.|) pg_catalog.get_byte(d, at operator(pg_catalog.+) 1)
           else pg_catalog.get_byte(d, at)::pg_catalog.int8 operator(pg_catalog.<<) 24
                operator(pg_catalog.|) pg_catalog.get_byte(d, at operator(pg_catalog.+) 1)::pg_catalog.int8 operator(pg_catalog.<<) 16
                operator(pg_catalog.|) pg_catalog.get_byte(d, at operator(pg_catalog.+) 2)::pg_catalog.int8 operator(pg_catalog.<<) 8
                operator(pg_catalog.|) pg_catalog.get_byte(d, at operator(pg_catalog.+) 3) end;
$$;

-- lockstep._pgo_relation(d): a pgoutput Relation message ('R'): the relation's oid, its columns' names and
-- type oids in the order the change messages that follow send them (dropped and generated columns left
-- out, as of when the change was made, not now: a column renamed since is under its name of then).
create or replace function lockstep._pgo_relation(d bytea, out relid oid, out cols name[], out types oid[])
language plpgsql immutable strict
set search_path = pg_catalog, pg_temp
as $$
declare
    v_pos integer := 5;
    v_end integer;
    v_n integer;
    v_enc name := pg_catalog.getdatabaseencoding();
begin
    relid := lockstep._pgo_int(d, 1, 4)::oid;
    for i in 1 .. 2 loop  -- the namespace and the relation's name, each ending in a zero byte
        v_pos := v_pos + pg_catalog.position(pg_catalog.substr(d, v_pos + 1), '\x00'::bytea);
    end loop;
    v_n := lockstep._pgo_int(d, v_pos + 1, 2);  -- after the replica identity byte
    v_pos := v_pos + 3;
    cols := '{}';
    types := '{}';
    for i in 1 .. v_n loop  -- flags, name and a zero byte, type oid, type modifier
        v_end := v_pos + 1 + pg_catalog.position(pg_catalog.substr(d, v_pos + 2), '\x00'::bytea);
        cols := cols || pg_catalog.convert_from(pg_catalog.substr(d, v_pos + 2, v_end - v_pos - 2), v_enc)::name;
        types := types || lockstep._pgo_int(d, v_end, 4)::oid;
        v_pos := v_end + 8;
    end loop;
end;
$$;

-- lockstep._pgo_keys(d, idx): the values of column idx (from 0) in the tuples of a pgoutput Insert, Update
-- or Delete message: the old row's ('K': its replica identity, 'O': all of it) and the new row's ('N'),
-- NULLs left out. NULL when the value cannot be told: the new row's column is an unchanged TOAST value ('u')
-- and no old row came with it.
create or replace function lockstep._pgo_keys(d bytea, idx integer) returns text[]
language plpgsql immutable strict
set search_path = pg_catalog, pg_temp
as $$
declare
    v_len integer := pg_catalog.length(d);
    v_pos integer := 5;  -- past the message type and the relation oid
    v_keys text[] := '{}';
    v_unknown boolean := false;
    v_tag integer;
    v_n integer;
    v_kind integer;
    v_l integer;
begin
    while v_pos < v_len loop
        v_tag := pg_catalog.get_byte(d, v_pos);
        v_n := pg_catalog.get_byte(d, v_pos + 1) << 8 | pg_catalog.get_byte(d, v_pos + 2);
        v_pos := v_pos + 3;
        for i in 0 .. v_n - 1 loop
            v_kind := pg_catalog.get_byte(d, v_pos);
            if v_kind in (116, 98) then  -- 't' text, 'b' binary: a 4-byte length and the value
                v_l := pg_catalog.get_byte(d, v_pos + 1) << 24 | pg_catalog.get_byte(d, v_pos + 2) << 16
                       | pg_catalog.get_byte(d, v_pos + 3) << 8 | pg_catalog.get_byte(d, v_pos + 4);
                if i = idx then
                    v_keys := v_keys || pg_catalog.convert_from(pg_catalog.substr(d, v_pos + 6, v_l),
                                                                pg_catalog.getdatabaseencoding());
                    if v_tag = 78 then  -- the new row comes last: nothing more to read
                        return v_keys;
                    end if;
                end if;
                v_pos := v_pos + 5 + v_l;
            else  -- 'n' NULL, 'u' unchanged TOAST value
                v_unknown := v_unknown or (i = idx and v_kind = 117);
                v_pos := v_pos + 1;
            end if;
        end loop;
    end loop;
    if v_unknown and cardinality(v_keys) = 0 then
        return null;
    end if;
    return v_keys;
end;
$$;

-- lockstep._pgo_records(d, idx): the composite keys of the tuples of a pgoutput Insert, Update or Delete
-- message, the old row's ('K', 'O') and the new row's ('N'): the record text of columns idx (from 0, in the
-- key's field order), as row(...)::key_type::text gives it when each column's text is its field's (the
-- quoting is record_out's, of one text field at a time: no code of a type's owner runs). A key with a NULL
-- field is left out, as watch()'s triggers leave it out. NULL when a key cannot be told: a column of a new
-- row is an unchanged TOAST value ('u') that no old row gives, or one of an old row is.
create or replace function lockstep._pgo_records(d bytea, idx integer[]) returns text[]
language plpgsql immutable strict
set search_path = pg_catalog, pg_temp
as $$
declare
    v_len integer := pg_catalog.length(d);
    v_k integer := pg_catalog.cardinality(idx);
    v_enc name := pg_catalog.getdatabaseencoding();
    v_pos integer := 5;  -- past the message type and the relation oid
    v_keys text[] := '{}';
    v_old text[];
    v_vals text[];
    v_unknown boolean[];
    v_key text;
    v_field text;
    v_tag integer;
    v_n integer;
    v_kind integer;
    v_l integer;
begin
    if pg_catalog.array_position(idx, null) is not null then
        return null;
    end if;
    while v_pos < v_len loop
        v_tag := pg_catalog.get_byte(d, v_pos);
        v_n := pg_catalog.get_byte(d, v_pos + 1) << 8 | pg_catalog.get_byte(d, v_pos + 2);
        v_pos := v_pos + 3;
        v_vals := pg_catalog.array_fill(null::text, array[v_k]);
        v_unknown := pg_catalog.array_fill(false, array[v_k]);
        for i in 0 .. v_n - 1 loop
            v_kind := pg_catalog.get_byte(d, v_pos);
            v_l := case when v_kind in (116, 98) then pg_catalog.get_byte(d, v_pos + 1) << 24 | pg_catalog.get_byte(d, v_pos + 2) << 16
                                                      | pg_catalog.get_byte(d, v_pos + 3) << 8 | pg_catalog.get_byte(d, v_pos + 4) end;
            for f in 1 .. v_k loop
                if idx[f] = i and v_l is not null then  -- 't' text, 'b' binary: a 4-byte length and the value
                    v_vals[f] := pg_catalog.convert_from(pg_catalog.substr(d, v_pos + 6, v_l), v_enc);
                elsif idx[f] = i and v_kind = 117 then  -- 'u': an unchanged TOAST value, the old row's if it came
                    v_unknown[f] := v_tag <> 78 or v_old is null or v_old[f] is null;
                    v_vals[f] := case when v_tag = 78 then v_old[f] end;
                end if;
            end loop;
            v_pos := v_pos + 1 + coalesce(4 + v_l, 0);
        end loop;
        if true = any(v_unknown) then
            return null;
        elsif pg_catalog.array_position(v_vals, null) is null then
            v_key := '(';
            for f in 1 .. v_k loop  -- row(v)::text is (v) with v quoted as record_out quotes it
                v_field := row(v_vals[f])::text;
                v_key := v_key || case when f > 1 then ',' else '' end
                         || pg_catalog.substr(v_field, 2, pg_catalog.length(v_field) - 2);
            end loop;
            v_keys := v_keys || (v_key || ')');
        end if;
        v_old := v_vals;
    end loop;
    return v_keys;
end;
$$;

-- lockstep._pgo_places(rel_cols, rel_types, cols, kinds): where the key columns cols are in a pgoutput
-- Relation message's columns and types (lockstep._pgo_relation): idx and typ, the first one's place (from
-- 0) and type oid; for a composite key (kinds: its fields' types) idxs, each one's place, and typs, each
-- 'column type oid:field type' pair. A column not there: a NULL place. Run once per Relation message.
create or replace function lockstep._pgo_places(rel_cols name[], rel_types oid[], cols name[], kinds text[],
                                                out idx integer, out typ oid, out idxs integer[], out typs text[])
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.array_position(rel_cols, cols[1]) - 1, rel_types[pg_catalog.array_position(rel_cols, cols[1])],
           case when kinds is not null
                then array(select pg_catalog.array_position(rel_cols, k.c) - 1
                           from pg_catalog.unnest(cols) with ordinality k(c, o) order by k.o) end,
           case when kinds is not null
                then array(select pg_catalog.concat(rel_types[pg_catalog.array_position(rel_cols, k.c)], ':', kinds[k.o])
                           from pg_catalog.unnest(cols) with ordinality k(c, o) order by k.o) end;
$$;

-- lockstep._pgo_truncated(d): the relation oids of a pgoutput Truncate message ('T').
create or replace function lockstep._pgo_truncated(d bytea) returns oid[]
language sql immutable strict
set search_path = pg_catalog, pg_temp
as $$
    select array(select lockstep._pgo_int(d, 6 + 4 * i, 4)::oid
                 from pg_catalog.generate_series(0, lockstep._pgo_int(d, 1, 4)::integer - 1) i);
$$;

-- lockstep._check_captures(): the caller (lockstep._caller) may record a capture: it may read the capture
-- slot (REPLICATION, or a superuser), or it is a lockstep admin; else 42501. What the capture's definer
-- functions write (the queue, flags, the LSN read up to), such a role could already cause through the slot.
create or replace function lockstep._check_captures() returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if not exists (select from pg_catalog.pg_roles r
                   where r.rolname = lockstep._caller() and (r.rolreplication or r.rolsuper))
       and not (select pg_catalog.pg_has_role(lockstep._caller(), c.relowner, 'MEMBER')
                from pg_catalog.pg_class c where c.oid = 'lockstep.job'::pg_catalog.regclass) then
        raise exception 'lockstep: role "%" may not record a capture of the WAL', lockstep._caller()
            using errcode = '42501',
                  hint = 'The capture reads the replication slot: the runner''s role needs REPLICATION (docs/wal.md).';
    end if;
end;
$$;

-- lockstep._capture_slot_made(slot, why, recreated): the capture slot was created (recreated: again): its
-- state row restarts, and every job watching through the WAL is flagged for why; returns how many.
-- Security definer, for a caller that may capture (lockstep._check_captures, 42501): no recipe role holds
-- INSERT or UPDATE on lockstep.capture_state or lockstep.recompute_flag's flagged_at.
-- locks: the lockstep.capture_state row (inserted or updated).
create or replace function lockstep._capture_slot_made(slot name, why text, recreated boolean) returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_flagged bigint;
begin
    perform lockstep._check_captures();
    insert into lockstep.capture_state as c (slot) values (slot)
    on conflict (only_row) do update
    set slot = excluded.slot, queued_lsn = null, slot_created_at = now(),
        recreated = c.recreated + _capture_slot_made.recreated::integer;
    insert into lockstep.recompute_flag (job, flagged_at, problem)
    select d.job, pg_catalog.clock_timestamp(), why from (select distinct w.job from lockstep.wal_watch w) d;
    get diagnostics v_flagged = row_count;
    return v_flagged;
end;
$$;
comment on function lockstep._capture_slot_made(name, text, boolean) is
    'The capture slot was created (recreated: again): its state row restarts, and every job watching '
    'through the WAL is flagged for why; returns how many. Security definer, for a caller that may capture '
    '(lockstep._check_captures, 42501). Locks: the lockstep.capture_state row (inserted or updated).';

-- lockstep._capture_slot_ready(slot): create the capture slot, or drop and create it again when it holds
-- more WAL than capture_max_bytes or was invalidated, flagging every WAL-watching job; returns how many. Runs
-- before the transaction writes anything (PostgreSQL creates a logical slot only then).
-- locks: nothing lockstep or an application holds (the slot's creation waits on running transaction ids);
-- then as lockstep._capture_slot_made.
create or replace function lockstep._capture_slot_ready(slot name) returns bigint
language plpgsql
set search_path = pg_catalog, pg_temp
set lock_timeout = '10s'
as $$
declare
    v_max bigint := (select s.capture_max_bytes from lockstep.setting s);
    v_held bigint;
    v_status text;
    v_why text;
    v_flagged bigint;
begin
    select pg_catalog.pg_current_wal_lsn() - s.restart_lsn, s.wal_status into v_held, v_status
    from pg_catalog.pg_replication_slots s where s.slot_name = _capture_slot_ready.slot;
    if not found then
        v_why := 'the capture slot was created: the changes made before it were not read';
    elsif v_status = 'lost' or v_held > v_max then
        v_why := pg_catalog.format('the capture slot held %s of WAL (capture_max_bytes %s, or invalidated by the server): '
                                   'it was recreated, the changes it held were not read',
                                   coalesce(pg_catalog.pg_size_pretty(v_held), 'lost'), pg_catalog.pg_size_pretty(v_max));
        perform pg_catalog.pg_drop_replication_slot(slot);
    else
        return 0;
    end if;
    perform pg_catalog.pg_create_logical_replication_slot(slot, 'pgoutput');
    v_flagged := lockstep._capture_slot_made(slot, v_why, v_status is not null);
    raise warning 'lockstep: %; % job(s) flagged for a full recompute', v_why, v_flagged
        using hint = 'See lockstep.capture_status.';
    return v_flagged;
end;
$$;

-- lockstep._capture_families(): flag each job that watches through the WAL a table whose partitions (the
-- tables below it) changed since the last capture: attached, detached or dropped, their rows joined or left
-- the table with no change in the WAL to say so. Records what it saw in lockstep.capture_state.families
-- ('source oid:table oid' pairs); returns how many jobs it flagged. Security definer, for a caller that may
-- capture (lockstep._check_captures, 42501): it runs no user code, and no recipe role holds UPDATE on
-- lockstep.capture_state.
-- locks: the lockstep.capture_state row, when the tables changed.
create or replace function lockstep._capture_families() returns bigint
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_now text[] := array(select distinct pg_catalog.concat(w.source::oid, ':', f.rel::oid)
                          from lockstep.wal_watch w cross join lateral pg_catalog.unnest(lockstep._family(w.source)) f(rel)
                          order by 1);
    v_was text[] := (select c.families from lockstep.capture_state c);
    v_flagged bigint;
begin
    perform lockstep._check_captures();
    if v_was is not distinct from v_now then
        return 0;
    end if;
    update lockstep.capture_state set families = v_now;
    if v_was is null then  -- the first capture: the slot's creation flagged the jobs
        return 0;
    end if;
    insert into lockstep.recompute_flag (job, flagged_at, problem)
    select w.job, pg_catalog.clock_timestamp(),
           pg_catalog.format('the tables below %s changed (attached, detached or dropped): their rows wait for the full '
                             'recompute', min(w.source::text))
    from lockstep.wal_watch w
    cross join lateral (select pg_catalog.concat(w.source::oid, ':') p) s
    where exists (select from pg_catalog.unnest(v_now) n  -- a table below a source watched before
                  where n <> all(v_was) and pg_catalog.starts_with(n, s.p) and n <> s.p || w.source::oid
                    and s.p || w.source::oid = any(v_was))
       or exists (select from pg_catalog.unnest(v_was) o  -- a table below a source watched still, gone
                  where o <> all(v_now) and pg_catalog.starts_with(o, s.p))
    group by w.job;
    get diagnostics v_flagged = row_count;
    return v_flagged;
end;
$$;
comment on function lockstep._capture_families() is
    'Flag each job that watches through the WAL a table whose partitions (the tables below it) changed since '
    'the last capture: attached, detached or dropped, their rows joined or left the table with no change in '
    'the WAL to say so. Records what it saw in lockstep.capture_state.families; returns how many jobs it '
    'flagged. Security definer, for a caller that may capture (lockstep._check_captures, 42501). Locks: '
    'the lockstep.capture_state row, when the tables changed.';

-- lockstep._wal_watched(): each table lockstep.capture() reads for each job (a source watched through the
-- WAL and the tables below it): its key columns (cols: one, or a composite key's), a composite key's field
-- types as the WAL's text must match them (kinds; NULL for one column), and whether the table's replica
-- identity holds the key columns (covered). Read once per capture.
create or replace function lockstep._wal_watched()
returns table (job text, relid oid, key_column name, key_type regtype, cols name[], kinds text[], covered boolean)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return query
    select w.job, f.rel::oid, w.key_column, j.key_type, k.cols,
           case when w.key_columns is not null
                then array(select pg_catalog.format_type(a.atttypid, a.atttypmod) from pg_catalog.pg_type y
                           join pg_catalog.pg_attribute a on a.attrelid = y.typrelid and a.attnum > 0 and not a.attisdropped
                           where y.oid = j.key_type order by a.attnum) end,
           lockstep._identity_covers(f.rel, k.cols)
    from lockstep.wal_watch w join lockstep.job j on j.job = w.job
    cross join lateral (select coalesce(w.key_columns, array[w.key_column]) cols) k
    cross join lateral pg_catalog.unnest(lockstep._family(w.source)) f(rel);
end;
$$;

-- lockstep._wal_types_problem(relid, cols, typs, key_type): the recompute flag's problem when the key
-- columns cols of table relid are of types (typs: 'column type oid:field type' pairs, as the WAL said) whose
-- text is not the composite key type's fields'.
create or replace function lockstep._wal_types_problem(relid oid, cols name[], typs text[], key_type regtype)
returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.format('columns (%s) of %s are of types (%s) now, the fields of the key type %s (%s)',
                             lockstep._cols(cols), relid::regclass,
                             pg_catalog.string_agg(pg_catalog.split_part(t, ':', 1)::oid::regtype::text, ', ' order by o),
                             key_type, pg_catalog.string_agg(pg_catalog.substr(t, pg_catalog.strpos(t, ':') + 1), ', ' order by o))
    from pg_catalog.unnest(typs) with ordinality u(t, o);
$$;

-- lockstep._trim_keys(keys, key_type, typ, kinds): the keys the WAL gave for a key of key_type, numerics
-- without trailing zeros, as lockstep._canon writes them: a one-column numeric key's from a column of type
-- typ whose text a numeric reads (kinds NULL); a composite key's with a numeric field (kinds, its fields'
-- types) through lockstep._canon; else keys as they are.
create or replace function lockstep._trim_keys(keys text[], key_type regtype, typ oid, kinds text[]) returns text[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if kinds is not null and 'numeric' = any(kinds) and keys is not null then
        begin  -- record text of fields of lockstep._fast_types() (_capture_read checked them): it reads back
            execute pg_catalog.format('select lockstep._canon($1::%s)', lockstep._array_type(key_type))
                into keys using keys;
        exception when others then
            null;  -- as the WAL said
        end;
        return keys;
    elsif key_type is distinct from 'pg_catalog.numeric'::pg_catalog.regtype or kinds is not null
       or typ is null or typ not in (20, 21, 23, 1700) then  -- int8, int2, int4, numeric: lockstep._fast_pairs()
        return keys;
    end if;
    return array(select pg_catalog.trim_scale(u.k::pg_catalog.numeric)::text
                 from pg_catalog.unnest(keys) with ordinality u(k, o) order by u.o);
end;
$$;

-- lockstep._capture_read(slot, upto, max_rows): peek the slot's changes up to upto (about max_rows
-- messages, whole transactions), queue the watched tables' old and new keys (a composite key's record text:
-- lockstep._pgo_records), flag the jobs whose changes say nothing of their keys (TRUNCATE, key column
-- changed, a key too long; lockstep._capture_queue writes them); the slot does not move.
-- locks: nothing (inserts into lockstep.queue and lockstep.recompute_flag: lockstep._capture_queue).
create or replace function lockstep._capture_read(slot name, upto pg_lsn, max_rows integer,
                                                  out messages bigint, out changes bigint, out keys bigint,
                                                  out flagged bigint, out last_commit pg_lsn)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    -- lockstep._fast_pairs(), inline: it reads the catalogs for some milliseconds, which every capture would pay
    v_pairs text[] := '{21:smallint,21:integer,21:bigint,21:numeric,23:integer,23:bigint,23:numeric,20:bigint,'
                      '20:numeric,1700:numeric,25:text,"25:character varying",1043:text,"1043:character varying",'
                      '2950:uuid}';
    v_max integer := lockstep._max_key_bytes();
    v_enc name := pg_catalog.getdatabaseencoding();
begin
    with raw as materialized (
        select c.o, c.lsn, c.data, pg_catalog.get_byte(c.data, 0) t
        from pg_catalog.pg_logical_slot_peek_binary_changes(slot, upto, max_rows, 'proto_version', '1',
             'publication_names', lockstep._capture_publication()) with ordinality c(lsn, xid, data, o)
    ), rel as materialized (  -- 'R': the columns of a relation, before its first change (and after DDL)
        select r.o, x.relid, x.cols, x.types from raw r, lateral lockstep._pgo_relation(r.data) x where r.t = 82
    ), watched as materialized (
        select w.job, w.relid, w.key_column, w.key_type, w.cols, w.kinds, w.covered from lockstep._wal_watched() w
    ), place as materialized (  -- each watch's key columns' places in each 'R' of its table
        select l.o, w.job, w.relid, w.cols, p.idx, p.typ, p.idxs, p.typs from rel l join watched w on w.relid = l.relid
        cross join lateral lockstep._pgo_places(l.cols, l.types, w.cols, w.kinds) p
    ), change as materialized (  -- 'I', 'U', 'D' of a watched table, with the key columns' places then
        select w.job, w.relid, w.key_column, w.key_type, w.cols, w.kinds, w.covered, r.t, r.data, x.idx, x.typ, x.idxs, x.typs
        from raw r
        join watched w on w.relid = lockstep._pgo_int(r.data, 1, 4)::oid
        left join lateral (select p.idx, p.typ, p.idxs, p.typs from place p
                           where p.job = w.job and p.relid = w.relid and p.cols = w.cols and p.o < r.o
                           order by p.o desc limit 1) x on true
        where r.t in (73, 85, 68)
    ), keyed as materialized (
        select c.job, lockstep._trim_keys(k.keys, c.key_type, c.typ, c.kinds) keys, case
            when c.idx is null or pg_catalog.array_position(c.idxs, null) is not null
                then pg_catalog.format('column %I of %s is not in its WAL records (renamed or dropped)',
                                       coalesce(c.cols[pg_catalog.array_position(c.idxs, null)], c.key_column), c.relid::regclass)
            when c.kinds is null and pg_catalog.concat(c.typ, ':', c.key_type) <> all(v_pairs)
                then pg_catalog.format('column %I of %s is of type %s now', c.key_column, c.relid::regclass, c.typ::regtype)
            when not c.typs <@ v_pairs then lockstep._wal_types_problem(c.relid, c.cols, c.typs, c.key_type)
            when k.keys is null then pg_catalog.format('a change of %s does not say its key (unchanged TOAST value)',
                                                       c.relid::regclass)
            when not c.covered and c.t <> 73 then pg_catalog.format('the replica identity of %s no longer holds %s',
                                                                   c.relid::regclass, lockstep._columns_text(c.cols)) end problem
        from change c cross join lateral (  -- the common case inline: only a new row, the key first
            select case when c.kinds is not null
                        then case when c.typs <@ v_pairs then lockstep._pgo_records(c.data, c.idxs) end
                        when c.idx = 0 and pg_catalog.get_byte(c.data, 5) = 78 and pg_catalog.get_byte(c.data, 8) = 116
                        then array[pg_catalog.convert_from(pg_catalog.substr(c.data, 14, lockstep._pgo_int(c.data, 9, 4)::integer), v_enc)]
                        else lockstep._pgo_keys(c.data, c.idx) end keys) k
    ), queued as (
        select distinct k.job, u.key from keyed k cross join lateral pg_catalog.unnest(k.keys) u(key)
        where pg_catalog.octet_length(u.key) + pg_catalog.octet_length(k.job) <= v_max
    ), problem as (
        select k.job, k.problem from keyed k where k.problem is not null
        union all
        select k.job, pg_catalog.format('a key too long for the queue (at most %s bytes with the job name)', v_max)
        from keyed k cross join lateral pg_catalog.unnest(k.keys) u(key)
        where pg_catalog.octet_length(u.key) + pg_catalog.octet_length(k.job) > v_max
        union all
        select w.job, pg_catalog.format('TRUNCATE of %s', w.relid::regclass)
        from raw r cross join lateral pg_catalog.unnest(lockstep._pgo_truncated(r.data)) t(relid)
        join watched w on w.relid = t.relid
        where r.t = 84
    ), flags as (
        select p.job, min(p.problem) problem from problem p group by p.job
    )
    select (select count(*) from raw), (select count(*) from change), w.queued, w.flagged,
           (select max(r.lsn) from raw r where r.t = 67)
    into messages, changes, keys, flagged, last_commit
    from lockstep._capture_queue((select pg_catalog.array_agg(q.job order by q.job, q.key) from queued q),
                                 (select pg_catalog.array_agg(q.key order by q.job, q.key) from queued q),
                                 (select pg_catalog.array_agg(f.job order by f.job) from flags f),
                                 (select pg_catalog.array_agg(f.problem order by f.job) from flags f)) w;
end;
$$;

-- lockstep._capture_queue(jobs, keys, flag_jobs, problems): what a capture read: queue each (job, key) pair,
-- in the order given; flag each of flag_jobs for its problem; only for jobs watching through the WAL.
-- Returns how many keys and jobs it was given; nothing is checked or written for none. Security definer, for a caller that may capture
-- (lockstep._check_captures, 42501): no recipe role but the application's holds INSERT on the queue, and
-- none sets a flag's flagged_at.
-- locks: none beyond the inserts into lockstep.queue and lockstep.recompute_flag.
create or replace function lockstep._capture_queue(jobs text[], keys text[], flag_jobs text[], problems text[],
                                                   out queued bigint, out flagged bigint)
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    queued := coalesce(cardinality(jobs), 0);
    flagged := coalesce(cardinality(flag_jobs), 0);
    if queued + flagged = 0 then
        return;
    end if;
    perform lockstep._check_captures();
    insert into lockstep.queue (job, key)  -- ROWS FROM: not qualified
    select u.j, u.k from unnest(jobs, keys) with ordinality u(j, k, o)
    where u.j in (select w.job from lockstep.wal_watch w) order by u.o;
    insert into lockstep.recompute_flag (job, flagged_at, problem)
    select u.j, pg_catalog.clock_timestamp(), u.p from unnest(flag_jobs, problems) u(j, p)
    where u.j in (select w.job from lockstep.wal_watch w);
end;
$$;
comment on function lockstep._capture_queue(text[], text[], text[], text[]) is
    'What a capture read: queue each (job, key) pair, in the order given; flag each of flag_jobs for its '
    'problem; only for jobs watching through the WAL. Returns how many keys and jobs it was given. Security '
    'definer, for a caller that may '
    'capture (lockstep._check_captures, 42501). Locks: none beyond the inserts into lockstep.queue and '
    'lockstep.recompute_flag.';

-- lockstep._capture_done(queued_lsn, changes): record a capture in its state row: the LSN it read up to (the
-- next capture advances the slot to it) and the changes it read. Security definer, for a caller that may
-- capture (lockstep._check_captures, 42501): no recipe role holds UPDATE on lockstep.capture_state.
-- locks: the lockstep.capture_state row (by the update).
create or replace function lockstep._capture_done(queued_lsn pg_lsn, changes bigint) returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    perform lockstep._check_captures();
    update lockstep.capture_state s
    set queued_lsn = _capture_done.queued_lsn, last_capture_at = now(), last_changes = _capture_done.changes,
        changes = s.changes + _capture_done.changes;
end;
$$;
comment on function lockstep._capture_done(pg_lsn, bigint) is
    'Record a capture in its state row: the LSN it read up to (the next capture advances the slot to it) '
    'and the changes it read. Security definer, for a caller that may capture (lockstep._check_captures, '
    '42501). Locks: the lockstep.capture_state row (by the update).';

-- lockstep.capture(max_rows): queue the keys of the changes made to tables watched through the WAL since
-- the last capture: advance the slot to the LSN the last committed capture recorded, make the slot ready,
-- read (lockstep._capture_read), record the LSN read up to. outcome: done, idle (nothing new; no table
-- watched: slot and publication removed) or busy. Call it in a transaction that has written nothing yet.
-- locks: the advisory lock 'lockstep:capture' (try, transaction-level); the slot while it reads.
create or replace function lockstep.capture(max_rows integer default 20000, out outcome text, out changes bigint,
                                            out keys bigint, out flagged bigint, out queued_lsn pg_lsn,
                                            out retained_bytes bigint)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_slot name := lockstep._capture_slot();
    v_upto pg_lsn;
    v_confirmed pg_lsn;
    r record;
begin
    if max_rows is null or max_rows < 1 then
        raise exception 'lockstep: max_rows must be positive' using errcode = '22023';
    end if;
    changes := 0; keys := 0; flagged := 0;
    if not lockstep._capture_in_use() then  -- nothing was ever watched through the WAL here
        outcome := 'idle';
        return;
    end if;
    if not exists (select from lockstep.wal_watch) then
        if exists (select from lockstep.capture_state) then
            perform lockstep._capture_cleanup();
        end if;
        outcome := 'idle';
        return;
    end if;
    if not pg_catalog.pg_try_advisory_xact_lock(pg_catalog.hashtextextended('lockstep:capture', 0)) then
        outcome := 'busy';
        return;
    end if;
    flagged := lockstep._capture_slot_ready(v_slot);
    flagged := flagged + lockstep._capture_families();
    select s.queued_lsn into queued_lsn from lockstep.capture_state s;
    select s.confirmed_flush_lsn into v_confirmed from pg_catalog.pg_replication_slots s where s.slot_name = v_slot;
    if queued_lsn > v_confirmed then  -- what the last committed capture queued
        perform pg_catalog.pg_replication_slot_advance(v_slot, queued_lsn);
    end if;
    v_upto := pg_catalog.pg_current_wal_flush_lsn();  -- decoding reads no further than the WAL flushed
    retained_bytes := (select pg_catalog.pg_current_wal_lsn() - s.restart_lsn
                       from pg_catalog.pg_replication_slots s where s.slot_name = v_slot);
    if v_upto <= greatest(v_confirmed, queued_lsn) then  -- no WAL since: nothing to decode
        outcome := case when flagged > 0 then 'done' else 'idle' end;
        return;
    end if;
    r := lockstep._capture_read(v_slot, v_upto, max_rows);
    if r.messages = 0 and flagged = 0 then
        -- no change of a watched table up to v_upto: the slot moves there now, and no row is written (a
        -- write would be new WAL for the next capture to decode)
        perform pg_catalog.pg_replication_slot_advance(v_slot, v_upto);
        outcome := 'idle';
        return;
    end if;
    -- fewer messages than asked: every transaction that ended before v_upto was read
    queued_lsn := greatest(v_confirmed, queued_lsn, case when r.messages < max_rows then v_upto else r.last_commit end);
    perform lockstep._capture_done(queued_lsn, r.changes);
    changes := r.changes;
    keys := r.keys;
    flagged := flagged + r.flagged;
    if r.flagged > 0 then
        raise warning 'lockstep: the capture flagged % job(s) for a full recompute', r.flagged
            using hint = 'See trigger_problem in lockstep.status.';
    end if;
    outcome := case when r.changes > 0 or flagged > 0 then 'done' else 'idle' end;
end;
$$;

-- lockstep.set_capture_bounds(unhealthy_bytes, max_bytes): the WAL the capture slot may hold before
-- lockstep.capture_status says unhealthy, and before lockstep.capture recreates the slot (the jobs then
-- recompute in full). NULL keeps a bound. Keep max_bytes below the server's max_slot_wal_keep_size.
-- locks: the lockstep.setting row.
create or replace function lockstep.set_capture_bounds(unhealthy_bytes bigint default null, max_bytes bigint default null)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
begin
    if unhealthy_bytes <= 0 or max_bytes <= 0 or coalesce(unhealthy_bytes, 1) > coalesce(max_bytes, unhealthy_bytes) then
        raise exception 'lockstep: capture bounds must be positive, unhealthy_bytes at most max_bytes' using errcode = '22023',
            hint = 'For example lockstep.set_capture_bounds(256 * 1024 * 1024, 1024 * 1024 * 1024).';
    end if;
    update lockstep.setting s
    set capture_unhealthy_bytes = coalesce(unhealthy_bytes, s.capture_unhealthy_bytes),
        capture_max_bytes = coalesce(max_bytes, s.capture_max_bytes);
end;
$$;

-- lockstep.capture_status: the WAL capture at a glance (no row: no table is watched through the WAL).
--   retained_bytes: WAL the slot keeps on disk; lag_bytes: WAL written since the LSN the capture queued up
--   to, or read up to when it found no watched change there (the slot's confirmed_flush_lsn); healthy: the slot is valid and retains at most lockstep.setting.capture_unhealthy_bytes.
create or replace view lockstep.capture_status with (security_invoker = true) as
select c.slot, l.slot_name is not null as slot_exists, l.wal_status,
       c.queued_lsn, l.confirmed_flush_lsn, l.restart_lsn,
       (pg_catalog.pg_current_wal_lsn() - l.restart_lsn)::bigint as retained_bytes,
       (pg_catalog.pg_current_wal_lsn() - greatest(c.queued_lsn, l.confirmed_flush_lsn))::bigint as lag_bytes,
       c.last_capture_at, c.last_changes, c.changes, c.recreated, c.slot_created_at,
       (select count(*) from lockstep.wal_watch) as watched,
       coalesce(l.wal_status in ('reserved', 'extended')
                and pg_catalog.pg_current_wal_lsn() - l.restart_lsn <= s.capture_unhealthy_bytes, false) as healthy,
       s.capture_unhealthy_bytes, s.capture_max_bytes
from lockstep.capture_state c
cross join lockstep.setting s
left join pg_catalog.pg_replication_slots l on l.slot_name = c.slot;

-- row security: anyone granted SELECT reads what is watched through the WAL (the runner's capture does);
-- only who manages a job changes its rows. The capture's state is one row with nothing of any job in it.
drop policy if exists wal_watch_read on lockstep.wal_watch;
create policy wal_watch_read on lockstep.wal_watch for select using (true);
drop policy if exists wal_watch_own on lockstep.wal_watch;
create policy wal_watch_own on lockstep.wal_watch for all
    using (job in (select j.job from lockstep.job j where lockstep._may_manage_id(j.owner_id)))
    with check (job in (select j.job from lockstep.job j where lockstep._may_manage_id(j.owner_id)));
drop policy if exists capture_state_all on lockstep.capture_state;
create policy capture_state_all on lockstep.capture_state for all using (true) with check (true);

comment on function lockstep.capture(integer) is
    'Queue the keys of the changes made to tables watched through the WAL (watch(..., via => ''wal'')) since '
    'the last capture, at most about max_rows WAL messages: advances the slot to what the last committed '
    'capture recorded, reads with pg_logical_slot_peek_binary_changes, records the LSN read up to with the '
    'queue rows. Call it in a transaction that has written nothing yet; the runner does, every '
    '--capture-every. Locks: the advisory lock lockstep:capture (try).';
comment on function lockstep.set_capture_bounds(bigint, bigint) is
    'The WAL the capture slot may hold before lockstep.capture_status says unhealthy, and before '
    'lockstep.capture recreates the slot and flags the jobs watching through the WAL. Locks: the '
    'lockstep.setting row.';
