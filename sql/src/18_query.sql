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

-- lockstep._query_scans(query, path, key_column, key_type): the tables a generic plan of the query for a
-- handful of keys reads whole (Seq Scan with sequential scans disabled: no index can serve the filter).
-- locks: nothing (EXPLAIN of a prepared statement, deallocated).
create or replace function lockstep._query_scans(query text, path text, key_column name, key_type regtype)
returns text
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_name text := 'lockstep_query_' || pg_catalog.pg_backend_pid();
    v_plan json;
    v_scans text;
begin
    perform pg_catalog.set_config('search_path', path || ', pg_temp', true);
    perform pg_catalog.set_config('enable_seqscan', 'off', true);
    perform pg_catalog.set_config('plan_cache_mode', 'force_generic_plan', true);
    execute pg_catalog.format('prepare %I(%s[]) as select * from (%s) q where q.%I = any($1)',
                              v_name, key_type, query, key_column);
    begin
        execute pg_catalog.format('explain (format json, verbose) execute %I(null)', v_name) into v_plan;
    exception when others then
        execute pg_catalog.format('deallocate %I', v_name);
        raise;
    end;
    execute pg_catalog.format('deallocate %I', v_name);
    perform pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true);
    perform pg_catalog.set_config('enable_seqscan', 'on', true);
    perform pg_catalog.set_config('plan_cache_mode', 'auto', true);
    select pg_catalog.string_agg(distinct pg_catalog.format('%I.%I', n ->> 'Schema', n ->> 'Relation Name'), ', ')
    into v_scans
    from pg_catalog.jsonb_path_query(v_plan::jsonb, 'strict $.**') n
    where pg_catalog.jsonb_typeof(n) = 'object' and n ->> 'Node Type' = 'Seq Scan';
    return v_scans;
end;
$$;

comment on function lockstep._query_scans(text, text, name, regtype) is
    'Tables that a job''s query, filtered on a few keys, still reads whole. Locks nothing.';

-- lockstep._query_parent(target, parent, parent_column): the parent column, checked or inferred as
-- define_derived does (lockstep._check_parent_column), and the parent key's type, for the function's argument.
-- locks: nothing.
create or replace function lockstep._query_parent(target regclass, parent regclass, inout parent_column name,
                                                  out key_type regtype)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_key name;
begin
    if parent is null then
        raise exception 'lockstep: a job defined by a query needs a parent' using errcode = 'LSD04',
            hint = 'Pass parent => the table whose key the query''s rows are grouped by.';
    end if;
    select k.parent_key, k.key_type into v_key, key_type from lockstep._parent_key(parent) k;
    parent_column := lockstep._check_parent_column(target, parent, v_key, parent_column);
end;
$$;

comment on function lockstep._query_parent(regclass, regclass, name) is
    'The parent column and key type a query-defined job''s compute function is keyed by. Locks nothing.';

-- lockstep._query_compute(job, target, query, parent, parent_column, path): create or replace the compute
-- function of a job defined by a query, <target>_lockstep_compute in the target's schema, and return it.
-- A target name too long for that (63 bytes) keeps its start and a hash of the whole name, so two long
-- names that share a start get two functions. Refuses a function of that name lockstep did not write,
-- or wrote for another job (42723).
-- locks: nothing of the application's (creates or replaces a function).
create or replace function lockstep._query_compute(job text, target regclass, query text, parent regclass,
                                                   parent_column name, path text) returns regprocedure
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_par record := lockstep._query_parent(target, parent, parent_column);
    v_schema name := (select n.nspname from pg_catalog.pg_class c
                      join pg_catalog.pg_namespace n on n.oid = c.relnamespace where c.oid = target);
    v_rel text := (select c.relname from pg_catalog.pg_class c where c.oid = target);
    v_name name := v_rel || '_lockstep_compute';
    v_fn text;
    v_old regprocedure;
    v_cols text;
    v_list text;
    v_has_key boolean;
    v_scans text;
begin
    if pg_catalog.octet_length(v_rel) > 46 then  -- the name would be cut: the start, then a hash of it all
        v_name := pg_catalog.left(pg_catalog.md5(v_rel), 8) || '_lockstep_compute';
        while pg_catalog.octet_length(v_rel) > 28 loop
            v_rel := pg_catalog.left(v_rel, -1);
        end loop;
        v_name := v_rel || '_' || v_name;
    end if;
    v_fn := pg_catalog.format('%I.%I(%s[])', v_schema, v_name, v_par.key_type);
    v_old := pg_catalog.to_regprocedure(v_fn);
    select pg_catalog.string_agg(pg_catalog.format('%I %s', q.col, q.typ), ', '),
           pg_catalog.string_agg(pg_catalog.format('q.%I', q.col), ', '),
           pg_catalog.bool_or(q.col = v_par.parent_column)
    into v_cols, v_list, v_has_key
    from lockstep._query_columns(query, path) q;
    if not coalesce(v_has_key, false) then
        raise exception 'lockstep: the query does not return the parent column %', v_par.parent_column
            using errcode = 'LSD03', hint = 'Select the column that holds the parent''s key, named as in the target.';
    end if;
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
    execute pg_catalog.format(
        'create function %I.%I(keys %s[]) returns table (%s) language plpgsql stable set search_path = %s as %L',
        v_schema, v_name, v_par.key_type, v_cols, path,
        pg_catalog.format(E'#variable_conflict use_column\nbegin\n    if keys is null then\n        return query %s;\n'
                          || E'        return;\n    end if;\n    return query select %s from (%s) q where q.%I = any(keys);\nend',
                          query, v_list, query, v_par.parent_column));
    execute pg_catalog.format('comment on function %s is %L', v_fn, 'lockstep: compute of a job defined by a query');
    v_scans := lockstep._query_scans(query, path, v_par.parent_column, v_par.key_type);
    if v_scans is not null then
        raise warning 'lockstep: job "%": computing a few parents reads all of %', job, v_scans
            using hint = pg_catalog.format('Index the column(s) the query joins or filters %s by, so the worker reads only '
                                           'the rows of the parents it computes.', v_scans);
    end if;
    return v_fn::regprocedure;
end;
$$;

comment on function lockstep._query_compute(text, regclass, text, regclass, name, text) is
    'Write the compute function of a job defined by a query (<target>_lockstep_compute, in the target''s '
    'schema) and return it. Locks nothing of the application''s.';
