-- lockstep: watches of a composite parent key: watch(job, source, key_columns => array['tenant_id', 'id']).
-- The triggers queue row(c1, c2, ...)::key_type of the old and new rows, in canonical text; like every
-- watch trigger they never raise: where they cannot enqueue they flag the job (lockstep._flag).

-- lockstep._key_columns_problem(rel, key_columns, key_type): why rel's columns key_columns cannot give keys of
-- the composite type key_type (NULL: they can): as many columns as the type has fields, each converting
-- without loss to its field, in the fields' order.
create or replace function lockstep._key_columns_problem(rel regclass, key_columns name[], key_type regtype)
returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_fields int := (select pg_catalog.count(*) from pg_catalog.pg_type y
                     join pg_catalog.pg_attribute a on a.attrelid = y.typrelid and a.attnum > 0 and not a.attisdropped
                     where y.oid = key_type);
begin
    if pg_catalog.cardinality(key_columns) is distinct from v_fields then
        return pg_catalog.format('%s key columns given, but the key type %s has %s fields',
                                 coalesce(pg_catalog.cardinality(key_columns), 0), key_type, v_fields);
    end if;
    return (select pg_catalog.format('column %s.%I %s', rel, c.name,
                                     case when a.atttypid is null then 'does not exist'
                                          else pg_catalog.format('is %s, which does not always convert to field %I (%s) '
                                                                 'of the key type %s', a.atttypid::regtype, f.attname,
                                                                 f.atttypid::regtype, key_type) end)
            from pg_catalog.unnest(key_columns) with ordinality c(name, o)
            join (select fa.attname, fa.atttypid, pg_catalog.row_number() over (order by fa.attnum) o
                  from pg_catalog.pg_type y
                  join pg_catalog.pg_attribute fa on fa.attrelid = y.typrelid and fa.attnum > 0 and not fa.attisdropped
                  where y.oid = key_type) f on f.o = c.o
            left join pg_catalog.pg_attribute a on a.attrelid = rel and a.attname = c.name and a.attnum > 0
                                                   and not a.attisdropped
            where a.atttypid is null or not lockstep._castable(a.atttypid::regtype, f.atttypid::regtype)
            order by c.o limit 1);
end;
$$;

-- lockstep._check_key_columns(j, source, key_columns): watch()'s checks of a composite key's columns:
-- they match the key type's fields (LSQ01), and no foreign key on them leads elsewhere than the parent, or
-- to the parent's key columns in another order (LSQ02: their values are not the parent's keys).
-- locks: nothing.
create or replace function lockstep._check_key_columns(j lockstep.job, source regclass, key_columns name[]) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_problem text := lockstep._key_columns_problem(source, key_columns, j.key_type);
    v_family regclass[] := lockstep._family(j.parent);
    v_atts smallint[] := array(select a.attnum from pg_catalog.unnest(key_columns) with ordinality c(name, o)
                               join pg_catalog.pg_attribute a on a.attrelid = source and a.attname = c.name
                               order by c.o);
    v_refs regclass;
    v_con oid;
begin
    if v_problem is not null then
        raise exception 'lockstep: watch of job "%" on %: %', j.job, source, v_problem
            using errcode = 'LSQ01',
                  hint = pg_catalog.format('key_columns names the columns of %s holding the fields of %s, in its order.',
                                           source, j.key_type);
    end if;
    select c.confrelid::regclass, c.oid into v_refs, v_con from pg_catalog.pg_constraint c
    where c.conrelid = source and c.contype = 'f' and c.conkey @> v_atts and c.conkey <@ v_atts
    order by c.confrelid = any(v_family) desc, c.conname limit 1;
    if source = any(v_family) or v_refs is null then
        return;
    elsif v_refs = any(v_family) then  -- each column references the parent's column of its field
        if exists (select from pg_catalog.unnest(v_atts) with ordinality c(att, o)
                   join pg_catalog.pg_constraint k on k.oid = v_con
                   cross join lateral unnest(k.conkey, k.confkey) p(f, r)  -- ROWS FROM: not qualified
                   join pg_catalog.pg_attribute ra on ra.attrelid = k.confrelid and ra.attnum = p.r
                   where p.f = c.att and ra.attname is distinct from j.parent_keys[c.o]) then
            raise exception 'lockstep: %(%) references % in another order than its key (%) of job "%"', source,
                pg_catalog.array_to_string(key_columns, ', '), v_refs, lockstep._cols(j.parent_keys), j.job
                using errcode = 'LSQ02',
                      hint = pg_catalog.format('Name the columns in the order of the key: those that reference %s.',
                                               lockstep._cols(j.parent_keys));
        end if;
        return;
    end if;
    raise exception 'lockstep: %(%) references %, not the parent % of job "%": its values are keys of %',
        source, pg_catalog.array_to_string(key_columns, ', '), v_refs, j.parent, j.job, v_refs
        using errcode = 'LSQ02',
              hint = pg_catalog.format('Watch the columns that reference the parent, or watch these through %s: '
                                       'lockstep.watch(%L, %L, key_columns => ..., through => %L, through_columns => '
                                       '<the columns of %s that hold %s''s key>).', v_refs, j.job, source, v_refs,
                                       v_refs, j.parent);
end;
$$;
comment on function lockstep._check_key_columns(lockstep.job, regclass, name[]) is
    'watch()''s checks of a composite key''s columns: they match the key type''s fields (LSQ01), and no '
    'foreign key on them leads elsewhere than the parent, or to its key columns in another order (LSQ02). '
    'Locks nothing.';

-- lockstep._key_columns_sql(key_type, key_columns, alias): SQL for the key of row alias:
-- row(alias.c1, ...)::key_type.
create or replace function lockstep._key_columns_sql(key_type regtype, key_columns name[], alias text) returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.format('row(%s)::%s', (select pg_catalog.string_agg(pg_catalog.format('%I.%I', alias, c), ', '
                                                                          order by o)
                                             from pg_catalog.unnest(key_columns) with ordinality u(c, o)),
                             lockstep._type_sql(key_type));
$$;

-- lockstep._gen_key_columns(j, source, key_columns): generate lockstep.enqueue_w_<hash>(), the trigger
-- function of a composite key's watch: static SQL that reads only the key columns; NULL where the session
-- may not create it, or where a key column's type is not its field's and either is not built in (watch()
-- then uses lockstep.enqueue_trigger(), which checks the key type at each statement). Its reads run in a
-- block. It converts no key unless the key type's fields, the source's key column types and the absence
-- of a cast on the key type are as watch() found them: the type's owner could make a field a domain or
-- add a cast, whose function would run as the writer; then lockstep._trigger_problem says why, and the
-- job is flagged. No SET clause: every name qualified.
-- locks: nothing (creates or replaces the function).
create or replace function lockstep._gen_key_columns(j lockstep.job, source regclass, key_columns name[]) returns text
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_name name := ('enqueue_w_' || pg_catalog.left(pg_catalog.md5(
                        pg_catalog.concat_ws(pg_catalog.chr(1), j.job, source::oid, key_columns::text)), 24))::name;
    v_key text := lockstep._key_columns_sql(j.key_type, key_columns, 'x');
    v_fields oid[] := array(select a.atttypid from pg_catalog.pg_type y
                            join pg_catalog.pg_attribute a on a.attrelid = y.typrelid and a.attnum > 0
                            where y.oid = j.key_type and not a.attisdropped order by a.attnum);
    -- fields whose text is the same under every setting: the record's text is canonical (lockstep._canon);
    -- not a numeric's, whose trailing zeros lockstep._canon trims
    v_read text := case when not exists (select from pg_catalog.unnest(v_fields) f
                                         where f::regtype::text <> all (lockstep._fast_types()) or f = 'pg_catalog.numeric'::regtype)
                        then 'v_keys := array(select s.k::pg_catalog.text from (%s) s where s.k is not null order by s.k);'
                        else 'v_keys := lockstep._canon(array(select s.k from (%s) s where s.k is not null));' end;
    v_cols oid[] := array(select a.atttypid from pg_catalog.unnest(key_columns) with ordinality c(n, o)
                          join pg_catalog.pg_attribute a on a.attrelid = source and a.attname = c.n order by c.o);
begin
    if not pg_catalog.has_schema_privilege('lockstep', 'CREATE')
       or exists (select from unnest(v_cols, v_fields) p(c, f) where p.c <> p.f and greatest(p.c, p.f) >= 16384) then
        return null;
    end if;
    execute pg_catalog.format($t$
create or replace function lockstep.%1$I() returns trigger
language plpgsql
as $body$
-- generated by lockstep.watch() (lockstep._gen_key_columns): reads only the key columns %11$s
declare
    v_keys pg_catalog.text[];
    v_problem pg_catalog.text;
begin
    begin  -- reads only: the subtransaction gets no transaction id
        if array(select a.atttypid from pg_catalog.pg_attribute a
                 where a.attrelid operator(pg_catalog.=) %7$s::pg_catalog.oid and a.attnum operator(pg_catalog.>) 0
                   and not a.attisdropped order by a.attnum) operator(pg_catalog.<>) %8$L::pg_catalog.oid[]
           or array(select a.atttypid from pg_catalog.unnest(%2$L::pg_catalog.name[]) with ordinality c(n, o)
                    left join pg_catalog.pg_attribute a on a.attrelid operator(pg_catalog.=) tg_relid
                                                        and a.attname operator(pg_catalog.=) c.n and not a.attisdropped
                    order by c.o) operator(pg_catalog.<>) %9$L::pg_catalog.oid[]
           or exists (select from pg_catalog.pg_cast k
                      where k.castsource operator(pg_catalog.=) any (%10$L::pg_catalog.oid[])
                         or k.casttarget operator(pg_catalog.=) any (%10$L::pg_catalog.oid[])) then
            v_problem := coalesce((select p.problem from lockstep._trigger_problem(tg_argv[0], tg_argv[1], tg_relid,
                                                                                     tg_op, 'lockstep_new', 'lockstep_old') p),
                                  'the key type or the key columns changed since watch(): watch again');
        elsif tg_op operator(pg_catalog.=) 'UPDATE' then
            %3$s
        elsif tg_op operator(pg_catalog.=) 'INSERT' then
            %4$s
        else
            %5$s
        end if;
    exception when others then
        get stacked diagnostics v_problem = message_text;
    end;
    if v_problem is not null then
        perform lockstep._flag(tg_argv[0], pg_catalog.concat('watch of ', tg_relid::pg_catalog.regclass, ' on ',
                                                             tg_argv[1], ': ', v_problem));
        return null;
    end if;
    if pg_catalog.octet_length(pg_catalog.array_to_string(v_keys, ''))
       operator(pg_catalog.+) pg_catalog.octet_length(tg_argv[0]) operator(pg_catalog.>) %6$s then
        v_keys := lockstep._queueable(tg_argv[0], v_keys);  -- a key too long for the queue flags the job
    end if;
$t$ || lockstep._trigger_template_queue(), v_name, key_columns::text,
        pg_catalog.format(v_read, pg_catalog.format('select %s as k from lockstep_new x union select %s from lockstep_old x',
                                                    v_key, v_key)),
        pg_catalog.format(v_read, pg_catalog.format('select distinct %s as k from lockstep_new x', v_key)),
        pg_catalog.format(v_read, pg_catalog.format('select distinct %s as k from lockstep_old x', v_key)),
        lockstep._max_key_bytes(),
        (select y.typrelid from pg_catalog.pg_type y where y.oid = j.key_type), v_fields, v_cols,
        array[j.key_type, (select y.typarray from pg_catalog.pg_type y where y.oid = j.key_type)]::oid[],
        lockstep._comment_safe(key_columns::text));
    return pg_catalog.format('lockstep.%I', v_name);
exception when insufficient_privilege then  -- a function of that name owned by another role
    return null;
end;
$$;

-- lockstep._watch_key_columns(j, source, key_columns, through, via): watch()'s path for a composite key:
-- checks, then the triggers on source and every table below it, as watch() makes them for one column; with
-- via => 'wal', a watch through the WAL instead (lockstep._watch_wal).
-- locks: as lockstep.watch: the advisory lock (lockstep, define) until the transaction ends; then source
-- and the tables below it (DROP / CREATE TRIGGER) through lockstep._ddl; then maybe a recompute_flag row.
create or replace function lockstep._watch_key_columns(j lockstep.job, source regclass, key_columns name[],
                                                       through regclass, via text) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_tables regclass[] := lockstep._family(source);
    v_flag text;
    v_fn text;
begin
    if key_columns is null then
        raise exception 'lockstep: job "%" has a composite parent key %: pass key_columns', j.job, lockstep._key_name(j)
            using errcode = '22004', hint = 'key_columns => array[...]::name[], the source''s columns of the key, in its order.';
    end if;
    perform lockstep._check_watch(j, source, key_columns[1]);
    if lockstep._key_fields(j) is null then
        raise exception 'lockstep: job "%" has a one-column parent key %: watch it with key_column', j.job,
            lockstep._key_name(j)
            using errcode = 'LSQ01', hint = 'Pass key_column => the column of the source that holds the parent''s key.';
    elsif through is not null then
        raise exception 'lockstep: a composite key is watched on the table that holds its columns, not through another'
            using errcode = '0A000',
                  hint = 'Drop through and through_column, and watch the table whose columns hold the parent''s key fields.';
    elsif via is distinct from 'trigger' and via is distinct from 'wal' then
        raise exception 'lockstep: via => % is not a way to watch', pg_catalog.quote_nullable(via)
            using errcode = '22023', hint = 'Use via => ''trigger'' or via => ''wal''.';
    end if;
    perform lockstep._check_key_columns(j, source, key_columns);
    if via = 'wal' then  -- no trigger: lockstep.capture() reads the WAL (16_capture.sql)
        perform lockstep._watch_wal(j, source, key_columns);
        return;
    end if;
    v_flag := lockstep._watch_news(j, source, key_columns::text, v_tables);  -- before the triggers change
    v_fn := coalesce(lockstep._gen_key_columns(j, source, key_columns), 'lockstep.enqueue_trigger');
    perform lockstep._ddl(v_tables, lockstep._drop_watch_ddl(j.job, v_tables)
                                    || lockstep._watch_ddl(j, v_tables, v_fn, array[key_columns::text, j.key_type::text]),
                          pg_catalog.format('watch(%L, %L)', j.job, source));
    if v_flag is not null then
        perform lockstep._flag_job(j.job, v_flag);  -- security definer
    end if;
    perform lockstep._warn_writers(v_tables);
    perform lockstep._drop_unused_triggers();
    perform lockstep._unwatch_wal(j.job, source);
end;
$$;
comment on function lockstep._watch_key_columns(lockstep.job, regclass, name[], regclass, text) is
    'watch()''s path for a composite parent key: the triggers on source and every table below it queue '
    'row(key_columns)::key_type of the old and new rows; with via => ''wal'', lockstep._watch_wal instead. '
    'Locks: as lockstep.watch: the advisory lock '
    '(lockstep, define) until the transaction ends; then source and the tables below it (DROP / CREATE '
    'TRIGGER) through lockstep._ddl; then maybe a recompute_flag row.';
