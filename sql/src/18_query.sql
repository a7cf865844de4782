-- lockstep: jobs defined by a query. define_derived(..., query => 'select ...') writes the keyed compute
-- function itself, in the target's schema, owned by the caller: the query unfiltered for every parent,
-- and filtered on the parent column (pushed down by the planner) for some.

-- lockstep._query_columns(query, path): the query's output columns, read from a temporary view made with
-- the caller's search path. Refuses a volatile function (LSD08): a compute runs again and again.
-- locks: nothing of the application's (creates and drops a temporary view).
create or replace function lockstep._query_columns(query text, path text)
returns table (col name, typ regtype)
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_view text := 'lockstep_query_' || pg_catalog.pg_backend_pid();
    v_volatile text;
begin
    if query is null or pg_catalog.btrim(query) = '' then
        raise exception 'lockstep: query must not be empty' using errcode = '22004';
    end if;
    perform pg_catalog.set_config('search_path', path || ', pg_temp', true);
    execute pg_catalog.format('create temporary view %I as %s', v_view, query);
    perform pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true);
    -- every function the parsed query calls, read from its rule's node tree (built-in ones have no pg_depend)
    select pg_catalog.string_agg(distinct p.oid::regprocedure::text, ', ') into v_volatile
    from pg_catalog.pg_rewrite r,
         pg_catalog.regexp_matches(r.ev_action::text, ':(funcid|opno|aggfnoid|winfnoid) (\d+)', 'g') m
    join pg_catalog.pg_proc p
      on p.oid = case when m[1] = 'opno' then (select o.oprcode from pg_catalog.pg_operator o where o.oid = m[2]::oid)
                      else m[2]::oid end
    where r.ev_class = pg_catalog.format('pg_temp.%I', v_view)::regclass and p.provolatile = 'v';
    return query select a.attname, a.atttypid::regtype from pg_catalog.pg_attribute a
                 where a.attrelid = pg_catalog.format('pg_temp.%I', v_view)::regclass and a.attnum > 0
                 order by a.attnum;
    execute pg_catalog.format('drop view pg_temp.%I', v_view);
    if v_volatile is not null then
        raise exception 'lockstep: the query calls the volatile function(s) %', v_volatile
            using errcode = 'LSD08',
                  hint = 'A compute runs again for every change: use stable or immutable functions only.';
    end if;
end;
$$;

comment on function lockstep._query_columns(text, text) is
    'The output columns of a job''s query, resolved in the caller''s search path; LSD08 on a volatile function. '
    'Locks nothing of the application''s.';

-- lockstep._query_filter(columns, key_type, keys, fields): SQL true where the row q of a job's query holds one
-- of the parent keys of the array keys: q.c = any(keys) for a one-column key; for a composite one, each
-- column against fields[n], the array of the keys' n-th field, then the whole row: plain restrictions
-- without a subquery, which PostgreSQL pushes down to the tables, where an index on the key's columns serves.
create or replace function lockstep._query_filter(columns name[], key_type regtype, keys text, fields text[])
returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select case when ty.typtype <> 'c' then pg_catalog.format('q.%I = any(%s)', columns[1], keys)
                else pg_catalog.format('%s and row(%s)::%s = any(%s)',
                                       pg_catalog.string_agg(pg_catalog.format('q.%I = any(%s)', c.n, fields[c.o]),
                                                             ' and ' order by c.o),
                                       pg_catalog.string_agg(pg_catalog.format('q.%I', c.n), ', ' order by c.o),
                                       lockstep._type_sql(key_type), keys) end
    from pg_catalog.pg_type ty, pg_catalog.unnest(columns) with ordinality c(n, o)
    where ty.oid = key_type
    group by ty.typtype;
$$;

-- lockstep._query_fields(key_type): the fields of a composite key type, in order: name, type as SQL, position.
create or replace function lockstep._query_fields(key_type regtype) returns table (name name, type text, o bigint)
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select a.attname, lockstep._type_sql(a.atttypid::regtype), pg_catalog.row_number() over (order by a.attnum)
    from pg_catalog.pg_type y
    join pg_catalog.pg_attribute a on a.attrelid = y.typrelid and a.attnum > 0 and not a.attisdropped
    where y.oid = key_type and y.typtype = 'c'
    order by a.attnum;
$$;

-- lockstep._query_scans(query, path, columns, key_type): the tables a generic plan of the query for a
-- handful of keys reads whole (Seq Scan with sequential scans disabled: no index can serve the filter).
-- locks: nothing (EXPLAIN of a prepared statement, deallocated).
create or replace function lockstep._query_scans(query text, path text, columns name[], key_type regtype)
returns text
language plpgsql
set search_path = pg_catalog, pg_temp
set enable_seqscan = off  -- SET clauses: the caller's own values come back on return
set plan_cache_mode = force_generic_plan
as $$
declare
    v_name text := 'lockstep_query_' || pg_catalog.pg_backend_pid();
    v_n int := (select pg_catalog.count(*) from lockstep._query_fields(key_type));
    -- the key array $1, then a composite key's fields' arrays $2, $3, ...
    v_types text := lockstep._array_type(key_type) || coalesce((select pg_catalog.string_agg(', ' || f.type || '[]', ''
                                                                                             order by f.o)
                                                                from lockstep._query_fields(key_type) f), '');
    v_filter text := lockstep._query_filter(columns, key_type, '$1',
                                            array(select '$' || (i + 1) from pg_catalog.generate_series(1, v_n) i));
    v_plan json;
    v_scans text;
begin
    perform pg_catalog.set_config('search_path', path || ', pg_temp', true);
    execute pg_catalog.format('prepare %I(%s) as select * from (%s) q where %s', v_name, v_types, query, v_filter);
    begin
        execute pg_catalog.format('explain (format json, verbose) execute %I(%s)', v_name,
                                  pg_catalog.array_to_string(pg_catalog.array_fill('null'::text, array[1 + v_n]), ', '))
            into v_plan;
    exception when others then
        execute pg_catalog.format('deallocate %I', v_name);
        raise;
    end;
    execute pg_catalog.format('deallocate %I', v_name);
    perform pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true);
    select pg_catalog.string_agg(distinct pg_catalog.format('%I.%I', n ->> 'Schema', n ->> 'Relation Name'), ', ')
    into v_scans
    from pg_catalog.jsonb_path_query(v_plan::jsonb, 'strict $.**') n
    where pg_catalog.jsonb_typeof(n) = 'object' and n ->> 'Node Type' = 'Seq Scan';
    return v_scans;
end;
$$;

comment on function lockstep._query_scans(text, text, name[], regtype) is
    'Tables that a job''s query, filtered on a few keys, still reads whole. Locks nothing.';

-- lockstep._query_parent(target, parent, parent_column, parent_columns): the query's key columns (the
-- target's columns referencing the parent's key) and the parent's key columns, checked or inferred as
-- define_derived does: lockstep._check_parent_column for a one-column key, whose type it returns; the one
-- foreign key of target covering the parent's key (lockstep._parent_fks) for a composite one (key_type NULL:
-- lockstep._query_key_type makes it). define_derived's checks then refuse what does not fit, with the fix.
-- locks: nothing.
create or replace function lockstep._query_parent(target regclass, parent regclass, parent_column name,
                                                  parent_columns name[], out columns name[], out keys name[],
                                                  out key_type regtype)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if parent is null then
        raise exception 'lockstep: a job defined by a query needs a parent' using errcode = 'LSD04',
            hint = 'Pass parent => the table whose key the query''s rows are grouped by.';
    end if;
    keys := (select lockstep._attnames(con.conrelid, con.conkey) from pg_catalog.pg_constraint con
             where con.conrelid = parent and con.contype = 'p');
    if cardinality(keys) > 1 or cardinality(parent_columns) > 1 then
        columns := coalesce(parent_columns, (select pg_catalog.min(f) from lockstep._parent_fks(target, parent, keys) f
                                             having pg_catalog.count(*) = 1));
        if columns is null or keys is null then
            raise exception 'lockstep: cannot infer parent_columns: % has no single foreign key to the primary key of %',
                target, parent
                using errcode = 'LSD04', hint = 'Pass parent_columns => array[...]::name[] naming the target''s columns '
                                                'that reference the parent''s primary key, in its order.';
        end if;
        return;
    end if;
    select array[k.parent_key], k.key_type into keys, key_type from lockstep._parent_key(parent) k;
    columns := array[lockstep._check_parent_column(target, parent, keys[1], coalesce(parent_column, parent_columns[1]))];
end;
$$;

comment on function lockstep._query_parent(regclass, regclass, name, name[]) is
    'The key columns a query-defined job''s compute function filters on, the parent''s key columns and (one '
    'column) the key type. Locks nothing.';

-- lockstep._query_name(target, suffix): the name of an object lockstep writes for a query-defined job on
-- target (<target><suffix>, in the target's schema, quoted and qualified). A target name too long for that
-- (63 bytes) keeps its start and a hash of the whole name, so two long names that share a start get two.
create or replace function lockstep._query_name(target regclass, suffix text) returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_rel text := (select c.relname from pg_catalog.pg_class c where c.oid = target);
    v_name text := v_rel || suffix;
begin
    if pg_catalog.octet_length(v_name) > 63 then  -- the name would be cut: the start, then a hash of it all
        v_name := pg_catalog.left(pg_catalog.md5(v_rel), 8) || suffix;
        while pg_catalog.octet_length(v_rel) > 28 loop
            v_rel := pg_catalog.left(v_rel, -1);
        end loop;
        v_name := v_rel || '_' || v_name;
    end if;
    return (select pg_catalog.format('%I.%I', n.nspname, v_name) from pg_catalog.pg_class c
            join pg_catalog.pg_namespace n on n.oid = c.relnamespace where c.oid = target);
end;
$$;

-- lockstep._query_key_type(target, parent, keys): the composite key type of a query-defined job,
-- <target>_lockstep_key in the target's schema (lockstep._query_name), fields as the parent's key columns
-- keys (names, types, collations, in order): kept if it has them, else made again. Refuses a type of that
-- name lockstep did not write (42710).
-- locks: nothing of the application's (creates or drops a type).
create or replace function lockstep._query_key_type(target regclass, parent regclass, keys name[]) returns regtype
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_name text := lockstep._query_name(target, '_lockstep_key');
    v_old regtype := pg_catalog.to_regtype(v_name);
    v_fields text := (select pg_catalog.string_agg(pg_catalog.format('%I %s%s', a.attname, lockstep._type_sql(a.atttypid),
                                                   case when a.attcollation not in (0, 100)
                                                        then pg_catalog.format(' collate %s', a.attcollation::regcollation)
                                                        else '' end), ', ' order by k.o)
                      from pg_catalog.unnest(keys) with ordinality k(n, o)
                      join pg_catalog.pg_attribute a on a.attrelid = parent and a.attname = k.n);
begin
    if v_old is not null and pg_catalog.obj_description(v_old, 'pg_type') is distinct from 'lockstep: key of a job defined by a query' then
        raise exception 'lockstep: type % exists and lockstep did not write it', v_old using errcode = '42710',
            hint = 'Rename or drop it: lockstep writes the key type of a query-defined job under that name.';
    elsif v_old is not null and v_fields = (select pg_catalog.string_agg(pg_catalog.format('%I %s%s', a.attname,
                                                lockstep._type_sql(a.atttypid),
                                                case when a.attcollation not in (0, 100)
                                                     then pg_catalog.format(' collate %s', a.attcollation::regcollation)
                                                     else '' end), ', ' order by a.attnum)
                                            from pg_catalog.pg_type y join pg_catalog.pg_attribute a on a.attrelid = y.typrelid
                                            where y.oid = v_old and a.attnum > 0 and not a.attisdropped) then
        return v_old;  -- the same key: the job's key type stays (its queue and watches with it)
    elsif v_old is not null then
        execute pg_catalog.format('drop type %s', v_old);
    end if;
    execute pg_catalog.format('create type %s as (%s)', v_name, v_fields);
    execute pg_catalog.format('comment on type %s is %L', v_name, 'lockstep: key of a job defined by a query');
    return v_name::regtype;
end;
$$;

-- lockstep._drop_query_objects(compute, key_type): drop the compute function and the key type
-- lockstep._query_compute wrote (told by their comments) once no job has them: after drop_job, or a
-- redefinition that no longer uses them. A type other objects still use is kept, with a WARNING.
-- locks: nothing of the application's (drops a function and a type).
create or replace function lockstep._drop_query_objects(compute text, key_type regtype) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_fn regprocedure := pg_catalog.to_regprocedure(compute);
begin
    if pg_catalog.obj_description(v_fn, 'pg_proc') = 'lockstep: compute of a job defined by a query'
       and not exists (select from lockstep.job x where pg_catalog.to_regprocedure(x.compute) = v_fn) then
        execute pg_catalog.format('drop function %s', v_fn);
    end if;
    if pg_catalog.obj_description(key_type, 'pg_type') = 'lockstep: key of a job defined by a query'
       and not exists (select from lockstep.job x where x.key_type = _drop_query_objects.key_type) then
        begin
            execute pg_catalog.format('drop type %s', key_type);
        exception when dependent_objects_still_exist then
            raise warning 'lockstep: type % is kept: other objects use it', key_type
                using hint = 'lockstep wrote it for a job defined by a query; drop it once nothing uses it.';
        end;
    end if;
end;
$$;
comment on function lockstep._drop_query_objects(text, regtype) is
    'Drop the compute function and the key type lockstep._query_compute wrote, once no job has them; a '
    'type other objects still use is kept, with a WARNING. Locks: nothing of the application''s (drops a '
    'function and a type).';

-- lockstep._query_compute(job, target, query, parent, parent_column, path, parent_columns): create or replace
-- the compute function of a job defined by a query, <target>_lockstep_compute in the target's schema
-- (lockstep._query_name), and return it; for a composite key, its key type too (lockstep._query_key_type).
-- Refuses a function of that name lockstep did not write, or wrote for another job (42723).
-- locks: nothing of the application's (creates or replaces a function).
create or replace function lockstep._query_compute(job text, target regclass, query text, parent regclass,
                                                   parent_column name, path text, parent_columns name[])
returns regprocedure
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_par record := lockstep._query_parent(target, parent, parent_column, parent_columns);
    v_schema name := (select n.nspname from pg_catalog.pg_class c
                      join pg_catalog.pg_namespace n on n.oid = c.relnamespace where c.oid = target);
    v_name text := lockstep._query_name(target, '_lockstep_compute');
    v_old regprocedure;
    v_type regtype := v_par.key_type;
    v_cols text;
    v_list text;
    v_missing name;
    v_scans text;
begin
    query := query || E'\n';  -- a last line comment in the query must not swallow what follows it
    select pg_catalog.string_agg(pg_catalog.format('%I %s', q.col, q.typ), ', '),
           pg_catalog.string_agg(pg_catalog.format('q.%I', q.col), ', '),
           (select c from pg_catalog.unnest(v_par.columns) c where c <> all(pg_catalog.array_agg(q.col)) limit 1)
    into v_cols, v_list, v_missing
    from lockstep._query_columns(query, path) q;
    if v_missing is not null then
        raise exception 'lockstep: the query does not return the parent column %', v_missing
            using errcode = 'LSD03', hint = 'Select the column that holds the parent''s key, named as in the target.';
    end if;
    v_old := (select p.oid from pg_catalog.pg_proc p  -- of any key type
              where p.pronamespace = (select c.relnamespace from pg_catalog.pg_class c where c.oid = target)
                and p.pronargs = 1
                and pg_catalog.format('%I.%I', v_schema, p.proname) = v_name limit 1);
    if v_old is not null and pg_catalog.obj_description(v_old, 'pg_proc') is distinct from 'lockstep: compute of a job defined by a query' then
        raise exception 'lockstep: function % exists and lockstep did not write it', v_old using errcode = '42723',
            hint = 'Rename or drop it: lockstep writes the compute of a query-defined job under that name.';
    elsif v_old is not null and exists (select from lockstep.job x
                                        where x.job <> _query_compute.job
                                          and pg_catalog.to_regprocedure(x.compute) = v_old) then
        raise exception 'lockstep: function % is the compute of another job', v_old using errcode = '42723',
            hint = 'Rename the target: lockstep names the compute of a query-defined job after it.';
    elsif v_old is not null then
        execute pg_catalog.format('drop function %s', v_old);
    end if;
    v_type := coalesce(v_type, lockstep._query_key_type(target, parent, v_par.keys));
    execute pg_catalog.format(
        'create function %s(keys %s) returns table (%s) language plpgsql stable set search_path = %s as %L',
        v_name, lockstep._array_type(v_type), v_cols, path, lockstep._query_body(query, v_list, v_par.columns, v_type));
    v_old := pg_catalog.format('%s(%s)', v_name, lockstep._array_type(v_type))::regprocedure;
    execute pg_catalog.format('comment on function %s is %L', v_old, 'lockstep: compute of a job defined by a query');
    v_scans := lockstep._query_scans(query, path, v_par.columns, v_type);
    if v_scans is not null then
        raise warning 'lockstep: job "%": computing a few parents reads all of %', job, v_scans
            using hint = pg_catalog.format('Index the column(s) the query joins or filters %s by, so the worker reads only '
                                           'the rows of the parents it computes.', v_scans);
    end if;
    return v_old;
end;
$$;

comment on function lockstep._query_compute(text, regclass, text, regclass, name, text, name[]) is
    'Write the compute function of a job defined by a query (<target>_lockstep_compute, in the target''s '
    'schema), and for a composite key its key type, and return the function. Locks nothing of the application''s.';

-- lockstep._query_body(query, list, columns, key_type): the body of a query-defined job's compute function:
-- the query for every parent (keys NULL), else filtered by lockstep._query_filter; a composite key's fields'
-- arrays are variables set first, so the filter has no subquery and is pushed down.
create or replace function lockstep._query_body(query text, list text, columns name[], key_type regtype) returns text
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.format(E'#variable_conflict use_column\n%sbegin\n    if keys is null then\n'
                             || E'        return query %s;\n        return;\n    end if;\n%s'
                             || E'    return query select %s from (%s) q where %s;\nend',
                             (select 'declare' || pg_catalog.string_agg(pg_catalog.format(E'\n    lockstep_f%s %s[];', f.o, f.type),
                                                                        '' order by f.o) || E'\n'
                              from lockstep._query_fields(key_type) f),
                             query,
                             (select pg_catalog.string_agg(pg_catalog.format(
                                         E'    lockstep_f%s := array(select distinct k.%I from pg_catalog.unnest(keys) k);\n',
                                         f.o, f.name), '' order by f.o)
                              from lockstep._query_fields(key_type) f),
                             list, query,
                             lockstep._query_filter(columns, key_type, 'keys',
                                                    array(select 'lockstep_f' || i from pg_catalog.generate_series(1, 100) i)));
$$;
