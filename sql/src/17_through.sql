-- lockstep: watches through a join: a source that holds the key of a table between it and the parent
-- (order_lines.order_id, with orders.customer_id the parent key). One hop only: the source's column
-- references the through table, and the through table's column holds the parent's key.

-- lockstep._through_key(source, key_column, through): the column of through that source.key_column
-- references with a foreign key (LSQ02 if none does).
-- locks: nothing.
create or replace function lockstep._through_key(source regclass, key_column name, through regclass) returns name
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_key name;
begin
    select fa.attname into v_key
    from pg_catalog.pg_constraint c
    join pg_catalog.pg_attribute a on a.attrelid = c.conrelid and a.attnum = c.conkey[1]
    join pg_catalog.pg_attribute fa on fa.attrelid = c.confrelid and fa.attnum = c.confkey[1]
    where c.contype = 'f' and c.conrelid = source and c.confrelid = any(lockstep._family(through))
      and pg_catalog.cardinality(c.conkey) = 1 and a.attname = key_column
    limit 1;
    if v_key is null then
        raise exception 'lockstep: %.% has no foreign key to %: a watch through % maps it by that key', source,
            key_column, through, through
            using errcode = 'LSQ02',
                  hint = pg_catalog.format('Declare the foreign key (alter table %s add foreign key (%I) references %s), '
                                           'or watch the column of %s that references %s.', source, key_column,
                                           through, source, through);
    end if;
    return v_key;
end;
$$;

comment on function lockstep._through_key(regclass, name, regclass) is
    'The column of through that source.key_column references (LSQ02 if none). Locks nothing.';

-- lockstep._through_castable(source, target): values of a through column of type source convert to the key
-- type (or key field type) target with no code of any role: the same type, a domain over it, or a built-in
-- implicit cast (lockstep._castable without the casts roles add). PL/pgSQL: the shared trigger of a watch
-- through a join calls it at each statement, and a SQL function with a SET clause is planned at every call.
-- locks: nothing.
create or replace function lockstep._through_castable(source regtype, target regtype) returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if source = target then
        return true;
    end if;
    return (with recursive base(t) as (
                select source::oid
                union
                select ty.typbasetype from base join pg_catalog.pg_type ty on ty.oid = base.t where ty.typtype = 'd')
            select exists (select from base where base.t = target)
                or exists (select from base join pg_catalog.pg_cast c on c.castsource = base.t
                           where c.casttarget = target and c.castcontext = 'i' and c.oid < 16384));
end;
$$;

-- lockstep._through_row_security(through, source): through, or a table below it, has row security enabled
-- and an owner other than source's: reading it as source's writer would run that owner's policies. One
-- catalog read unless through has tables below it.
-- locks: nothing.
create or replace function lockstep._through_row_security(through oid, source oid) returns boolean
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_owner oid := (select c.relowner from pg_catalog.pg_class c where c.oid = source);
    v_foreign boolean;
    v_below boolean;
begin
    select c.relrowsecurity and c.relowner <> v_owner, c.relhassubclass into v_foreign, v_below
    from pg_catalog.pg_class c where c.oid = through;
    if v_foreign or not v_below then
        return v_foreign;
    end if;
    return exists (select from pg_catalog.pg_class c
                   where c.oid = any(lockstep._family(through::regclass)) and c.relrowsecurity and c.relowner <> v_owner);
end;
$$;

-- lockstep._check_through(source, through, columns, key_type): watch()'s refusals of a through table whose
-- reading would run another role's code as the writer: row security owned by another role than source's
-- (42501), or a column of the parent key that converts to the key type (or its field) only by a cast a
-- role added (LSQ01). Writes nothing.
-- locks: nothing.
create or replace function lockstep._check_through(source regclass, through regclass, columns name[],
                                                   key_type regtype) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_bad text;
begin
    if lockstep._through_row_security(through, source) then
        raise exception 'lockstep: % (or a table below it) has row security and another owner than %: the trigger '
            'on % would run its policies as the application''s writer', through, source, source
            using errcode = '42501',
                  hint = pg_catalog.format('Have the owner of %s own %s, or disable its row security, then watch again.',
                                           source, through);
    end if;
    select pg_catalog.format('%s.%I is %s', through, c.n, a.atttypid::regtype) into v_bad
    from pg_catalog.unnest(columns) with ordinality c(n, o)
    join pg_catalog.pg_attribute a on a.attrelid = through and a.attname = c.n and a.attnum > 0 and not a.attisdropped
    left join (select fa.atttypid, pg_catalog.row_number() over (order by fa.attnum) o
               from pg_catalog.pg_type y
               join pg_catalog.pg_attribute fa on fa.attrelid = y.typrelid and fa.attnum > 0 and not fa.attisdropped
               where y.oid = key_type and y.typtype = 'c') f on f.o = c.o
    where not lockstep._through_castable(a.atttypid::regtype, coalesce(f.atttypid, key_type)::regtype)
    order by c.o limit 1;
    if v_bad is not null then
        raise exception 'lockstep: %, which converts to the key type % only by a cast a role added', v_bad, key_type
            using errcode = 'LSQ01',
                  hint = 'Give the through column the key type (or its field''s type), or a domain over it.';
    end if;
end;
$$;

-- lockstep._watch_through(j, source, key_column, through, through_column): watch()'s path for a source
-- one hop below the parent. The triggers on source (and the tables below it) run lockstep.enqueue_through,
-- which maps the changed rows' keys, old and new, through the through table to parent keys; the through
-- table itself is watched on through_column, so a mapping row changed or deleted queues its old and new
-- parent keys too.
-- locks: source and the tables below it, then through and the tables below it (DROP / CREATE TRIGGER)
-- through lockstep._ddl, as lockstep.watch.
create or replace function lockstep._watch_through(j lockstep.job, source regclass, key_column name,
                                                   through regclass, through_column name) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_map name := lockstep._through_key(source, key_column, through);
    v_type regtype := (select a.atttypid from pg_catalog.pg_attribute a
                       where a.attrelid = through and a.attname = through_column and a.attnum > 0
                         and not a.attisdropped);
    v_tables regclass[] := lockstep._family(source);
    v_flag text;
begin
    if v_type is null then
        raise exception 'lockstep: table % has no column %', through, through_column using errcode = '42703';
    end if;
    if not lockstep._castable(v_type, j.key_type) then
        raise exception 'lockstep: %.% is %, which does not always convert to the parent key type % of job "%"',
            through, through_column, v_type, j.key_type, j.job
            using errcode = 'LSQ01',
                  hint = 'through_column names the column of the through table that holds the parent''s key.';
    end if;
    if through = any(v_tables) then
        raise exception 'lockstep: a watch of % through itself', source
            using errcode = '22023', hint = 'Watch the column that holds the parent''s key directly.';
    end if;
    perform lockstep._check_through(source, through, array[through_column], j.key_type);  -- 42501, LSQ01
    v_flag := lockstep._watch_news(j, source, key_column, v_tables);  -- before the triggers change
    perform lockstep._ddl(v_tables, lockstep._drop_watch_ddl(j.job, v_tables)
                                    || lockstep._watch_ddl(j, v_tables,
                                                           coalesce(lockstep._gen_through(j, source, array[key_column], through,
                                                                                          array[v_map], array[through_column]),
                                                                    'lockstep.enqueue_through'),
                                                           array[key_column::text, j.key_type::text, through::oid::text,
                                                                 v_map, through_column]),
                          pg_catalog.format('watch(%L, %L)', j.job, source));
    if v_flag is not null then
        perform lockstep._flag_job(j.job, v_flag);  -- security definer
    end if;
    perform lockstep._warn_writers(v_tables || through);
    perform lockstep.watch(j.job, through, through_column);
end;
$$;

comment on function lockstep._watch_through(lockstep.job, regclass, name, regclass, name) is
    'watch() of a source one hop below the parent, mapped through a table''s foreign key. '
    'Locks: source and the tables below it, then through and the tables below it (trigger DDL, lockstep._ddl).';

-- lockstep._through_keys(source, key_columns, through): the columns of through that the foreign key of source
-- on exactly key_columns, in that order, references, in the same order (42703 for a column source lacks;
-- LSQ02 if no foreign key to through has those columns in that order).
-- locks: nothing.
create or replace function lockstep._through_keys(source regclass, key_columns name[], through regclass) returns name[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_atts smallint[] := array(select a.attnum from pg_catalog.unnest(key_columns) with ordinality c(n, o)
                               join pg_catalog.pg_attribute a on a.attrelid = source and a.attname = c.n
                                                                 and a.attnum > 0 and not a.attisdropped
                               order by c.o);
    v_keys name[];
    v_fks text;
begin
    if pg_catalog.cardinality(v_atts) <> pg_catalog.cardinality(key_columns) then
        raise exception 'lockstep: table % has no column %', source,
            (select c.n from pg_catalog.unnest(key_columns) c(n)
             where not exists (select from pg_catalog.pg_attribute a where a.attrelid = source and a.attname = c.n
                                                                      and a.attnum > 0 and not a.attisdropped) limit 1)
            using errcode = '42703';
    end if;
    select array(select fa.attname from pg_catalog.unnest(c.confkey) with ordinality k(n, o)
                 join pg_catalog.pg_attribute fa on fa.attrelid = c.confrelid and fa.attnum = k.n order by k.o)
    into v_keys
    from pg_catalog.pg_constraint c
    where c.contype = 'f' and c.conrelid = source and c.confrelid = any(lockstep._family(through)) and c.conkey = v_atts
    order by c.conname limit 1;
    if v_keys is not null then
        return v_keys;
    end if;
    select pg_catalog.string_agg(pg_catalog.format('(%s)', (select lockstep._cols(pg_catalog.array_agg(a.attname order by k.o))
                                                            from pg_catalog.unnest(c.conkey) with ordinality k(n, o)
                                                            join pg_catalog.pg_attribute a on a.attrelid = c.conrelid
                                                                                          and a.attnum = k.n)),
                                 ', ' order by c.conname)
    into v_fks
    from pg_catalog.pg_constraint c
    where c.contype = 'f' and c.conrelid = source and c.confrelid = any(lockstep._family(through));
    raise exception 'lockstep: %(%) is not a foreign key of % to %: a watch through % maps rows by that key', source,
        lockstep._cols(key_columns), source, through, through
        using errcode = 'LSQ02',
              hint = case when v_fks is null
                          then pg_catalog.format('Declare the foreign key (alter table %s add foreign key (%s) references %s), '
                                                 'or watch the columns of %s that reference %s.', source,
                                                 lockstep._cols(key_columns), through, source, through)
                          else pg_catalog.format('Pass key_columns => the columns of a foreign key of %s to %s, in its order: %s.',
                                                 source, through, v_fks) end;
end;
$$;

-- lockstep._watch_through_columns(j, source, key_columns, through, through_column, through_columns, via):
-- watch()'s path for a composite parent key one hop below the parent: source's foreign key on key_columns
-- references through, whose columns through_columns hold the parent key's fields in order. As
-- lockstep._watch_through otherwise: through is watched on through_columns too. Checks all before any DDL.
-- locks: source and the tables below it, then through and the tables below it (DROP / CREATE TRIGGER)
-- through lockstep._ddl, as lockstep.watch.
create or replace function lockstep._watch_through_columns(j lockstep.job, source regclass, key_columns name[],
                                                           through regclass, through_column name,
                                                           through_columns name[], via text) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_tables regclass[] := lockstep._family(source);
    v_map name[];
    v_flag text;
begin
    if via = 'wal' then
        raise exception 'lockstep: via => ''wal'' watches the table that holds the key''s columns, not through another'
            using errcode = '0A000',
                  hint = 'Drop via for a watch through a join, or watch the table whose columns hold the key via the WAL.';
    elsif key_columns is null then
        raise exception 'lockstep: job "%" has a composite parent key %: pass key_columns', j.job, lockstep._key_name(j)
            using errcode = '22004',
                  hint = 'key_columns => array[...]::name[], the columns of the source''s foreign key to the through table.';
    elsif through_column is not null then
        raise exception 'lockstep: job "%" has a composite parent key %: pass through_columns, not through_column',
            j.job, lockstep._key_name(j)
            using errcode = '22023',
                  hint = 'through_columns => array[...]::name[], the through table''s columns of the parent key, in its order.';
    elsif through is null or through_columns is null then
        raise exception 'lockstep: through and through_columns go together' using errcode = '22004',
            hint = 'through => the table the source''s key_columns reference, through_columns => its columns of the parent key.';
    elsif via is distinct from 'trigger' then
        raise exception 'lockstep: via => % is not a way to watch a table through another', pg_catalog.quote_nullable(via)
            using errcode = '22023', hint = 'Use via => ''trigger''.';
    end if;
    perform lockstep._check_watch(j, source, key_columns[1]);
    if lockstep._key_fields(j) is null then
        raise exception 'lockstep: job "%" has a one-column parent key %: watch it with key_column', j.job,
            lockstep._key_name(j)
            using errcode = 'LSQ01', hint = 'Pass key_column => ..., through => ..., through_column => ....';
    end if;
    perform lockstep._check_watch(j, through, through_columns[1]);
    if through = any(v_tables) then
        raise exception 'lockstep: a watch of % through itself', source
            using errcode = '22023', hint = 'Watch the columns that hold the parent''s key directly.';
    end if;
    v_map := lockstep._through_keys(source, key_columns, through);
    perform lockstep._check_key_columns(j, through, through_columns);  -- LSQ01, LSQ02
    perform lockstep._check_through(source, through, through_columns, j.key_type);  -- 42501, LSQ01
    v_flag := lockstep._watch_news(j, source, key_columns::text, v_tables);  -- before the triggers change
    perform lockstep._ddl(v_tables, lockstep._drop_watch_ddl(j.job, v_tables)
                                    || lockstep._watch_ddl(j, v_tables,
                                                           coalesce(lockstep._gen_through(j, source, key_columns, through,
                                                                                          v_map, through_columns),
                                                                    'lockstep.enqueue_through'),
                                                           array[key_columns::text, j.key_type::text, through::oid::text,
                                                                 v_map::text, through_columns::text]),
                          pg_catalog.format('watch(%L, %L)', j.job, source));
    if v_flag is not null then
        perform lockstep._flag_job(j.job, v_flag);  -- security definer
    end if;
    perform lockstep._warn_writers(v_tables || through);
    perform lockstep.watch(j.job, through, key_columns => through_columns);
end;
$$;

comment on function lockstep._watch_through_columns(lockstep.job, regclass, name[], regclass, name, name[], text) is
    'watch() of a composite parent key one hop below the parent, mapped through a table''s foreign key. '
    'Locks: source and the tables below it, then through and the tables below it (trigger DDL, lockstep._ddl).';

-- lockstep._through_sql(op, key_column, key_type, through, through_key, parent_column): the two queries of
-- lockstep.enqueue_through for a statement op: src, the changed rows' through keys as text (a composite
-- one as a JSON array), and map, the parent keys they map to now in canonical text. A composite key's
-- arguments are arrays of columns; its through columns must still convert to the key type's fields with
-- no code of another role (LSQ01 otherwise).
-- locks: nothing.
create or replace function lockstep._through_sql(op text, key_column text, key_type text, through text,
                                                 through_key text, parent_column text, out src text, out map text)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_type regtype := key_type::regtype;
    v_rel regclass := through::oid::regclass;
    v_comp boolean := exists (select from pg_catalog.pg_type y where y.oid = v_type and y.typtype = 'c');
    v_cols name[] := case when v_comp then key_column::name[] else array[key_column::name] end;
    v_problem text;
    v_from text;
begin
    if v_comp then
        v_problem := coalesce(lockstep._key_columns_problem(v_rel, parent_column::name[], v_type),
                              lockstep._through_types_problem(v_rel, parent_column::name[], v_type));
        if v_problem is not null then
            raise exception 'lockstep: %', v_problem using errcode = 'LSQ01';
        end if;
    elsif not lockstep._through_castable((select a.atttypid from pg_catalog.pg_attribute a
                                          where a.attrelid = v_rel and a.attname = parent_column and a.attnum > 0
                                            and not a.attisdropped)::regtype, v_type) then
        raise exception 'lockstep: column %.% converts to the key type % only by a cast a role added', v_rel,
            parent_column, v_type using errcode = 'LSQ01';
    end if;
    v_from := pg_catalog.concat_ws(' union ',
        case when op <> 'DELETE' then pg_catalog.format('select %s from lockstep_new x', lockstep._cols(v_cols, 'x')) end,
        case when op <> 'INSERT' then pg_catalog.format('select %s from lockstep_old x', lockstep._cols(v_cols, 'x')) end);
    src := pg_catalog.format('select array(select %s from (%s) s where (%s) is not null)',
                             case when v_comp then pg_catalog.format('pg_catalog.jsonb_build_array(%s)::pg_catalog.text',
                                                                     lockstep._cols(v_cols, 's'))
                                  else pg_catalog.format('s.%I::pg_catalog.text', key_column) end,
                             v_from, lockstep._cols(v_cols, 's'));
    map := pg_catalog.format('select lockstep._canon(pg_catalog.array_agg(%s)) from %s m where (%s) in (%s)',
                             case when v_comp then lockstep._key_columns_sql(v_type, parent_column::name[], 'm')
                                  else pg_catalog.format('m.%I::%s', parent_column, lockstep._type_sql(v_type)) end,
                             v_rel, lockstep._cols(case when v_comp then through_key::name[]
                                                        else array[through_key::name] end, 'm'),
                             v_from);
end;
$$;

-- lockstep._through_types_problem(through, columns, key_type): why converting through's columns to the
-- composite key_type's fields could run code of another role (a column and its field of different types,
-- either not built in); NULL: it cannot.
-- locks: nothing.
create or replace function lockstep._through_types_problem(through regclass, columns name[], key_type regtype)
returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.format('column %s.%I is %s, not %s as field %I of the key type %s', through, c.n,
                             a.atttypid::regtype, f.atttypid::regtype, f.attname, key_type)
    from pg_catalog.unnest(columns) with ordinality c(n, o)
    join pg_catalog.pg_attribute a on a.attrelid = through and a.attname = c.n and a.attnum > 0 and not a.attisdropped
    join (select fa.attname, fa.atttypid, pg_catalog.row_number() over (order by fa.attnum) o
          from pg_catalog.pg_type y
          join pg_catalog.pg_attribute fa on fa.attrelid = y.typrelid and fa.attnum > 0 and not fa.attisdropped
          where y.oid = key_type) f on f.o = c.o
    where a.atttypid <> f.atttypid and greatest(a.atttypid, f.atttypid) >= 16384
    order by c.o limit 1;
$$;

-- lockstep._through_template(): the text (a format() string) of a trigger function lockstep._gen_through
-- writes: reads the through keys and the parent keys they map to in one static statement when the through
-- table, the columns and the key type are as watch() found them and reading it runs no row security policy
-- of another owner (lockstep._through_row_security), else flags the job; then records the
-- through keys and queues the parent keys, as lockstep.enqueue_through does.
create or replace function lockstep._through_template() returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select $t$
create or replace function lockstep.%1$I() returns trigger
language plpgsql
as $body$
-- generated by lockstep.watch() (lockstep._gen_through): maps %2$s through %3$s
declare
    v_src pg_catalog.text[];
    v_keys pg_catalog.text[];
    v_problem pg_catalog.text;
begin
    begin  -- reads only: the subtransaction gets no transaction id
        if coalesce(pg_catalog.to_regclass(%4$L)::pg_catalog.oid, 0) operator(pg_catalog.<>) %5$s::pg_catalog.oid
           or array(select a.atttypid from pg_catalog.unnest(%6$L::pg_catalog.name[]) with ordinality c(n, o)
                    left join pg_catalog.pg_attribute a on a.attrelid operator(pg_catalog.=) tg_relid
                         and a.attname operator(pg_catalog.=) c.n and a.attnum operator(pg_catalog.>) 0
                         and not a.attisdropped
                    order by c.o) operator(pg_catalog.<>) %7$L::pg_catalog.oid[]
           or array(select a.atttypid from pg_catalog.unnest(%8$L::pg_catalog.name[]) with ordinality c(n, o)
                    left join pg_catalog.pg_attribute a on a.attrelid operator(pg_catalog.=) %5$s::pg_catalog.oid
                         and a.attname operator(pg_catalog.=) c.n and a.attnum operator(pg_catalog.>) 0
                         and not a.attisdropped
                    order by c.o) operator(pg_catalog.<>) %9$L::pg_catalog.oid[]
           %10$s then
            v_problem := 'the through table, its columns or the key type changed since watch(): watch again';
        elsif (case when exists (select from pg_catalog.pg_class c where c.oid operator(pg_catalog.=) %5$s::pg_catalog.oid
                                 and (c.relrowsecurity or c.relhassubclass))
                    then lockstep._through_row_security(%5$s::pg_catalog.oid, tg_relid) else false end) then
            v_problem := 'it has row security and another owner than the source: not read as the writer';
        elsif tg_op operator(pg_catalog.=) 'UPDATE' then
            %11$s
        elsif tg_op operator(pg_catalog.=) 'INSERT' then
            %12$s
        else
            %13$s
        end if;
    exception when others then
        get stacked diagnostics v_problem = message_text;
    end;
    -- mapped again by a worker once this commits: a mapping row changed meanwhile maps them elsewhere
    if pg_catalog.cardinality(v_src) operator(pg_catalog.>) 0 then
        perform lockstep._append_through(tg_argv[0], %5$s::pg_catalog.oid, v_src);
    end if;
    if v_problem is not null then
        perform lockstep._flag(tg_argv[0], pg_catalog.concat('watch of ', tg_relid::pg_catalog.regclass, ' through ',
                                                             %4$L, ': ', v_problem));
        return null;
    end if;
    if pg_catalog.octet_length(pg_catalog.array_to_string(v_keys, ''))
       operator(pg_catalog.+) pg_catalog.octet_length(tg_argv[0]) operator(pg_catalog.>) %14$s then
        v_keys := lockstep._queueable(tg_argv[0], v_keys);  -- a key too long for the queue flags the job
    end if;
$t$ || lockstep._trigger_template_queue();
$$;

-- lockstep._gen_through(j, source, key_columns, through, through_keys, parent_columns): generate
-- lockstep.enqueue_w_<hash>(), the trigger function of a watch through a join (one column or several): static
-- SQL that reads the source's key columns from the transition tables and through's columns through_keys
-- and parent_columns, with pg_catalog's operators only. NULL where the session may not create it, or where
-- a type involved is not built in (watch() then uses lockstep.enqueue_through). Never raises; no SET clause.
-- locks: nothing (creates or replaces the function).
create or replace function lockstep._gen_through(j lockstep.job, source regclass, key_columns name[], through regclass,
                                                 through_keys name[], parent_columns name[]) returns text
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_name name := ('enqueue_w_' || pg_catalog.left(pg_catalog.md5(pg_catalog.concat_ws(pg_catalog.chr(1), j.job,
                        source::oid, key_columns::text, through::oid, through_keys::text, parent_columns::text)), 24))::name;
    v_comp boolean := lockstep._key_fields(j) is not null;
    v_fields oid[] := case when v_comp then array(select a.atttypid from pg_catalog.pg_type y
                                                  join pg_catalog.pg_attribute a on a.attrelid = y.typrelid and a.attnum > 0
                                                  where y.oid = j.key_type and not a.attisdropped order by a.attnum)
                           else array[j.key_type::oid] end;
    v_src oid[] := array(select a.atttypid from pg_catalog.unnest(key_columns) with ordinality c(n, o)
                         join pg_catalog.pg_attribute a on a.attrelid = source and a.attname = c.n order by c.o);
    v_thr oid[] := array(select a.atttypid from pg_catalog.unnest(through_keys || parent_columns) with ordinality c(n, o)
                         join pg_catalog.pg_attribute a on a.attrelid = through and a.attname = c.n order by c.o);
    v_key text := case when v_comp then lockstep._key_columns_sql(j.key_type, parent_columns, 'm')
                       else pg_catalog.format('m.%I::%s', parent_columns[1], lockstep._type_sql(j.key_type)) end;
    v_on text := (select pg_catalog.string_agg(pg_catalog.format('m.%I operator(pg_catalog.=) s.%I', r, c), ' and ')
                  from unnest(through_keys, key_columns) u(r, c));  -- ROWS FROM: not qualified
    v_read text;
    v_args text[];
    v_x text := lockstep._cols(key_columns, 'x');
begin
    if not pg_catalog.has_schema_privilege('lockstep', 'CREATE')
       or exists (select from pg_catalog.unnest(v_fields || v_src || v_thr) t where t >= 16384) then
        return null;
    end if;
    -- the statement (a format() string, its first argument the rows s): the changed rows' through keys, as
    -- text, and the parent keys they map to now (identifiers only in the other arguments)
    v_read := 'with s as (%s) select array(select %s from s where (%s) is not null), %s into v_src, v_keys;';
    v_args := array[case when v_comp then pg_catalog.format('pg_catalog.jsonb_build_array(%s)::pg_catalog.text',
                                                            lockstep._cols(key_columns, 's'))
                         else pg_catalog.format('s.%I::pg_catalog.text', key_columns[1]) end,
                    lockstep._cols(key_columns, 's'),
                    case when not exists (select from pg_catalog.unnest(v_fields) f
                                          where f::regtype::text <> all (array['bigint', 'integer', 'smallint', 'text',
                                                                               'character varying', 'uuid']))
                         then pg_catalog.format('array(select d.k::pg_catalog.text from (select distinct %s as k from s '
                                                'join %s m on %s) d where d.k is not null order by d.k)', v_key, through, v_on)
                         else pg_catalog.format('lockstep._canon(array(select %s from s join %s m on %s))',
                                                v_key, through, v_on) end];
    execute pg_catalog.format(lockstep._through_template(), v_name,
        lockstep._comment_safe(pg_catalog.format('(%s)', lockstep._cols(key_columns))), lockstep._comment_safe(through::text),
        through::text, through::oid, key_columns, v_src, through_keys || parent_columns, v_thr,
        case when v_comp then pg_catalog.format(
            'or coalesce(pg_catalog.to_regtype(%L)::pg_catalog.oid, 0) operator(pg_catalog.<>) %s::pg_catalog.oid '
            'or array(select a.atttypid from pg_catalog.pg_attribute a where a.attrelid operator(pg_catalog.=) %s::pg_catalog.oid '
            'and a.attnum operator(pg_catalog.>) 0 and not a.attisdropped order by a.attnum) operator(pg_catalog.<>) %L::pg_catalog.oid[] '
            'or exists (select from pg_catalog.pg_cast k where k.castsource operator(pg_catalog.=) any (%L::pg_catalog.oid[]) '
            'or k.casttarget operator(pg_catalog.=) any (%L::pg_catalog.oid[]))',
            lockstep._type_sql(j.key_type), j.key_type::oid,
            (select y.typrelid from pg_catalog.pg_type y where y.oid = j.key_type), v_fields,
            array[j.key_type, (select y.typarray from pg_catalog.pg_type y where y.oid = j.key_type)]::oid[],
            array[j.key_type, (select y.typarray from pg_catalog.pg_type y where y.oid = j.key_type)]::oid[]) else '' end,
        pg_catalog.format(v_read, pg_catalog.format('select %s from lockstep_new x union select %s from lockstep_old x',
                                                    v_x, v_x), v_args[1], v_args[2], v_args[3]),
        pg_catalog.format(v_read, pg_catalog.format('select distinct %s from lockstep_new x', v_x),
                          v_args[1], v_args[2], v_args[3]),
        pg_catalog.format(v_read, pg_catalog.format('select distinct %s from lockstep_old x', v_x),
                          v_args[1], v_args[2], v_args[3]),
        lockstep._max_key_bytes());
    return pg_catalog.format('lockstep.%I', v_name);
exception when insufficient_privilege then  -- a function of that name owned by another role
    return null;
end;
$$;

-- lockstep.enqueue_through(): trigger function of the watches through a join. Arguments: job, source key
-- column, parent key type, through table (oid), its key column, its column that holds the parent key; for
-- a composite parent key, the three columns are arrays of columns (the source's foreign key to the through
-- table, the columns it references, the through table's columns of the parent key's fields, in order).
-- Queues the parent keys the changed rows map to now, read without locks in a block that only reads, and
-- records their through keys (lockstep.through_entry) for a worker to map again after the commit. Any
-- error there, a TRUNCATE, or a through table whose reading would run its owner's row security policies
-- (lockstep._through_row_security) flags the job instead (lockstep._flag). Never raises.
-- locks: the insert into lockstep.queue (or lockstep.recompute_flag); no lock on the through table beyond
-- the ACCESS SHARE of a plain read.
create or replace function lockstep.enqueue_through() returns trigger
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_keys text[];
    v_src text[];
    v_sql record;
    v_problem text;
begin
    if tg_op = 'TRUNCATE' or tg_nargs <> 6 then
        perform lockstep._flag(case when tg_nargs > 0 then tg_argv[0] end,
                               format('%s of %s (no transition table names its rows)', tg_op, tg_relid::regclass));
        return null;
    end if;
    begin
        if lockstep._through_row_security(tg_argv[3]::oid, tg_relid) then  -- its policies would run as the writer
            v_problem := 'it has row security and another owner than the source: not read as the writer';
        else
            select x.src, x.map into v_sql
            from lockstep._through_sql(tg_op, tg_argv[1], tg_argv[2], tg_argv[3], tg_argv[4], tg_argv[5]) x;
            execute v_sql.src into v_src;
            execute v_sql.map into v_keys;
        end if;
    exception when others then
        get stacked diagnostics v_problem = message_text;
    end;
    -- mapped again by a worker once this commits: a mapping row changed meanwhile maps them elsewhere
    perform lockstep._append_through(tg_argv[0], tg_argv[3]::oid, v_src);
    if v_problem is not null then
        perform lockstep._flag(tg_argv[0], format('watch of %s through %s: %s', tg_relid::regclass,
                                                  tg_argv[3]::oid::regclass, v_problem));
        return null;
    end if;
    perform lockstep._append(tg_argv[0], lockstep._queueable(tg_argv[0], v_keys));
    return null;
end;
$$;

comment on function lockstep.enqueue_through() is
    'Statement trigger of a watch through a join: queues the parent keys the changed rows map to, old and new. '
    'Never raises: flags the job where it cannot map. Locks: the queue insert only; reads the through table '
    'without row locks.';

-- lockstep._append_through(job, through, keys): record through keys for job (lockstep.through_entry).
-- Security definer: application roles need no grant; a forged row is only read back for a through table
-- the job really watches through (lockstep._resolve_through). PL/pgSQL: each statement of a watch through a
-- join calls it, and a SQL function with a SET clause is planned at every call.
-- locks: none beyond the insert into lockstep.through_entry.
create or replace function lockstep._append_through(job text, through oid, keys text[]) returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
begin
    insert into lockstep.through_entry (job, through, key)
    select _append_through.job, _append_through.through, u.k from pg_catalog.unnest(keys) u(k)
    where exists (select from lockstep.job x where x.job = _append_through.job);  -- else never taken back
end;
$$;

comment on function lockstep._append_through(text, oid, text[]) is
    'Record through keys of a job for a worker to map after the commit. Locks: the insert into '
    'lockstep.through_entry only.';

-- lockstep._take_through(job): delete and return the job's committed through keys, by through table, for a
-- role that may manage the job (nothing otherwise).
-- locks: the job's lockstep.through_entry rows (deleted).
create or replace function lockstep._take_through(job text) returns table (through oid, keys text[])
language sql
security definer
set search_path = pg_catalog, pg_temp
as $$
    with taken as (
        delete from lockstep.through_entry t
        where t.job = _take_through.job
          and exists (select from lockstep.job x where x.job = _take_through.job)
          and lockstep._caller_manages(_take_through.job)  -- not _may_manage_id: current_user is the definer here
        returning t.through, t.key)
    select taken.through, array_agg(distinct taken.key) from taken group by taken.through;
$$;

comment on function lockstep._take_through(text) is
    'Delete and return the committed through keys of a job its caller may manage. Locks: those '
    'lockstep.through_entry rows (deleted).';

-- lockstep._resolve_through(j): map j's committed through keys to parent keys as j's owner, with the
-- mapping as committed now, and queue them; keys of a table j no longer watches through are dropped; a
-- mapping that fails flags j for its full recompute.
-- locks: the job's lockstep.through_entry rows (deleted); appends to lockstep.queue.
create or replace function lockstep._resolve_through(j lockstep.job) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    e record;
    v lockstep.job;
begin
    for e in select x.through, x.keys, tg.key_column, tg.parent_column
             from lockstep._take_through(j.job) x
             cross join lateral (select lockstep._tgarg(t.tgargs, 4) key_column, lockstep._tgarg(t.tgargs, 5) parent_column
                                 from pg_catalog.pg_trigger t
                                 where t.tgfoid in (select lockstep._trigger_fns()) and t.tgnargs = 6
                                   and lockstep._tgarg(t.tgargs, 0) = j.job
                                   and lockstep._tgarg(t.tgargs, 3) = x.through::text
                                 limit 1) tg
    loop
        v := j;
        v.kind := 'through_map';  -- lockstep._owner_run maps the keys instead of running a pass
        v.parent := e.through::regclass;
        if lockstep._key_fields(j) is null then
            v.parent_column := e.key_column;
            v.parent_key := e.parent_column;
        else  -- a composite key: arrays of columns (lockstep.enqueue_through)
            v.parent_column := null;
            v.parent_key := null;
            v.parent_columns := e.key_column::name[];
            v.parent_keys := e.parent_column::name[];
        end if;
        begin
            perform lockstep._append_keys(j.job, lockstep._queueable(j.job, (lockstep._as_owner(v, e.keys)).skipped));
        exception when others then
            perform lockstep._flag(j.job, pg_catalog.format('watch through %s: %s', e.through::regclass, sqlerrm));
        end;
    end loop;
end;
$$;

comment on function lockstep._resolve_through(lockstep.job) is
    'Map a job''s committed through keys to parent keys as its owner and queue them. Locks: those '
    'lockstep.through_entry rows (deleted); appends to lockstep.queue.';

-- lockstep._through_map_sql(j): the query of lockstep._owner_run for a through_map pass j (lockstep._resolve_through):
-- the canonical parent keys ($1, text[]) of through keys map to in j.parent, the through table: its
-- columns j.parent_column (j.parent_columns for a composite key, whose through keys are JSON arrays of
-- their values, lockstep._through_sql) hold the through key, j.parent_key (j.parent_keys) the parent key.
-- locks: nothing.
create or replace function lockstep._through_map_sql(j lockstep.job) returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if j.parent_column is not null then
        return pg_catalog.format('select lockstep._canon(pg_catalog.array_agg(m.%I::%s)) from %s m where m.%I = any($1::%s[])',
                                 j.parent_key, lockstep._type_sql(j.key_type), j.parent, j.parent_column,
                                 (select pg_catalog.format_type(a.atttypid, null) from pg_catalog.pg_attribute a
                                  where a.attrelid = j.parent and a.attname = j.parent_column));
    end if;
    return pg_catalog.format('select lockstep._canon(pg_catalog.array_agg(%s)) from %s m where (%s) in (select %s from '
                             'pg_catalog.unnest($1::pg_catalog.text[]) u(k))',
                             lockstep._key_expr(j, 'm', j.parent_keys), j.parent, lockstep._cols(j.parent_columns, 'm'),
                             (select pg_catalog.string_agg(pg_catalog.format(
                                         '((u.k::pg_catalog.jsonb) operator(pg_catalog.->>) %s)::%s',
                                         c.o - 1, pg_catalog.format_type(a.atttypid, null)), ', ' order by c.o)
                              from pg_catalog.unnest(j.parent_columns) with ordinality c(n, o)
                              join pg_catalog.pg_attribute a on a.attrelid = j.parent and a.attname = c.n
                                                               and a.attnum > 0 and not a.attisdropped));
end;
$$;
