-- lockstep: the watch side: the statement trigger, its generation, watch / unwatch and their DDL. The
-- trigger never raises: where it cannot enqueue it flags the job (lockstep._flag) and raises a WARNING.

-- lockstep._trigger_problem(job, key_column, rel, op, new_table, old_table): why the general path of
-- lockstep.enqueue_trigger cannot enqueue (NULL: it can), and the job's key type, in one static query.
create or replace function lockstep._trigger_problem(job text, key_column text, rel oid, op text, new_table name,
                                          old_table name, out problem text, out key_type regtype)
language plpgsql stable
set search_path = pg_catalog, pg_temp
set row_security = on  -- it reads lockstep.job (see _append)
as $$
declare
    v_queue boolean;
    v_type regtype;
    v_conv boolean;
begin
    if (op in ('INSERT', 'UPDATE') and new_table is null) or (op in ('UPDATE', 'DELETE') and old_table is null) then
        problem := pg_catalog.format('the trigger on %s has no %s transition table (REFERENCING ... TABLE AS)',
                                     rel::regclass, case when new_table is null and op <> 'DELETE' then 'NEW' else 'OLD' end);
        return;
    end if;
    select j.key_type, case when j.job is not null then j.kind = 'derived' and j.parent is not null end, a.atttypid,
           a.atttypid = j.key_type or t.typbasetype = j.key_type
           or exists (select from pg_catalog.pg_cast c
                      where c.castsource in (a.atttypid, t.typbasetype) and c.casttarget = j.key_type
                        and c.castcontext = 'i' and (c.castfunc = 0 or lockstep._trusted_fn(c.castfunc)))
    into key_type, v_queue, v_type, v_conv
    from (values (1)) one(x)
    left join lockstep.job j on j.job = _trigger_problem.job
    left join pg_catalog.pg_attribute a
        on a.attrelid = rel and a.attname = key_column and a.attnum > 0 and not a.attisdropped
    left join pg_catalog.pg_type t on t.oid = a.atttypid;
    problem := case when v_queue is null then 'unknown job'
                    when not v_queue then 'the job has no parent, so it has no queue'
                    when exists (select from pg_catalog.pg_type y where y.oid = key_type and y.typtype = 'c')
                        then lockstep._key_columns_problem(rel, key_column::name[], key_type)  -- 20_watch_columns.sql
                    when v_type is null then pg_catalog.format('table %s has no column %I', rel::regclass, key_column)
                    when not v_conv then pg_catalog.format('column %s.%I is %s, which does not always convert to the key type %s',
                                                           rel::regclass, key_column, v_type, key_type) end;
    if problem is null and key_type >= 16384 then  -- converted by no code of the key type's owner
        problem := pg_catalog.format('the key type %s is refused: ', key_type) || lockstep._key_type_problem(key_type);
    end if;
end;
$$;

-- lockstep.enqueue_trigger(): AFTER ... FOR EACH STATEMENT trigger function with transition tables.
-- Arguments: job, key column, optionally the key type. Never raises: where it cannot enqueue it flags the
-- job. No SET search_path: every name is qualified. Only it can read the transition tables: the general
-- path's checks and query text come from lockstep._trigger_general.
-- locks: the insert into lockstep.queue (or lockstep.recompute_flag): nothing a worker or a recompute holds.
create or replace function lockstep.enqueue_trigger() returns trigger
language plpgsql
as $$
declare
    v_keys pg_catalog.text[];
    v_sql pg_catalog.text;
    v_problem pg_catalog.text;
begin
    if tg_nargs operator(pg_catalog.=) 3 and tg_level operator(pg_catalog.=) 'STATEMENT'
       and tg_when operator(pg_catalog.=) 'AFTER' and tg_op operator(pg_catalog.<>) 'TRUNCATE'
       and tg_argv[2] operator(pg_catalog.=) any ('{bigint,integer,smallint,numeric,text,"character varying",uuid}'
                                                   ::pg_catalog.text[]) then  -- lockstep._fast_types()
        begin  -- reads only: the subtransaction gets no transaction id
            -- in the block, as all that reads: a pair of lockstep._fast_pairs() and no relation named like the tables
            if pg_catalog.concat((select a.atttypid from pg_catalog.pg_attribute a
                                  where a.attrelid operator(pg_catalog.=) tg_relid
                                    and a.attname operator(pg_catalog.=) tg_argv[1]
                                    and a.attnum operator(pg_catalog.>) 0 and not a.attisdropped), ':', tg_argv[2])
                   operator(pg_catalog.<>) all ('{21:smallint,21:integer,21:bigint,21:numeric,23:integer,23:bigint,'
                                                '23:numeric,20:bigint,20:numeric,1700:numeric,25:text,'
                                                '"25:character varying",1043:text,"1043:character varying",2950:uuid}'
                                                ::pg_catalog.text[])  -- lockstep._fast_pairs()
               or pg_catalog.to_regclass('lockstep_new') is not null or pg_catalog.to_regclass('lockstep_old') is not null then
                v_keys := null;
            -- the distinct non-NULL keys as JSON, sorted by key; x.*, the row (plain x may be a column named x)
            elsif tg_op operator(pg_catalog.=) 'UPDATE' then
                v_keys := array(select d.t from (select s.k, s.k operator(pg_catalog.#>>) '{}' t from (
                                    select pg_catalog.to_jsonb(x.*) operator(pg_catalog.->) tg_argv[1] k from lockstep_new x
                                    union select pg_catalog.to_jsonb(x.*) operator(pg_catalog.->) tg_argv[1] from lockstep_old x
                                    offset 0) s) d
                                where d.t is not null order by d.k);
            elsif tg_op operator(pg_catalog.=) 'INSERT' then
                v_keys := array(select d.t from (select s.k, s.k operator(pg_catalog.#>>) '{}' t from (
                                    select distinct pg_catalog.to_jsonb(x.*) operator(pg_catalog.->) tg_argv[1] k
                                    from lockstep_new x offset 0) s) d
                                where d.t is not null order by d.k);
            else
                v_keys := array(select d.t from (select s.k, s.k operator(pg_catalog.#>>) '{}' t from (
                                    select distinct pg_catalog.to_jsonb(x.*) operator(pg_catalog.->) tg_argv[1] k
                                    from lockstep_old x offset 0) s) d
                                where d.t is not null order by d.k);
            end if;
            if tg_argv[2] operator(pg_catalog.=) 'numeric' then  -- no trailing zeros, as lockstep._canon
                v_keys := array(select pg_catalog.trim_scale(u.k::pg_catalog.numeric)::pg_catalog.text from pg_catalog.unnest(v_keys) u(k));
            end if;
        exception when others then
            v_keys := null;  -- the general path says why
        end;
        if pg_catalog.octet_length(pg_catalog.array_to_string(v_keys, ''))
           operator(pg_catalog.+) pg_catalog.octet_length(tg_argv[0]) operator(pg_catalog.>) lockstep._max_key_bytes() then
            v_keys := lockstep._queueable(tg_argv[0], v_keys);  -- a key too long for the queue flags the job
        end if;
        if pg_catalog.cardinality(v_keys) operator(pg_catalog.>) 0
           and pg_catalog.current_setting('row_security') operator(pg_catalog.=) 'off' then
            perform lockstep._append(tg_argv[0], v_keys);  -- the queue's policies refuse a plain insert then
            return null;
        elsif pg_catalog.cardinality(v_keys) operator(pg_catalog.=) 1 then  -- the common case: no function scan
            insert into lockstep.queue (job, key) values (tg_argv[0], v_keys[1]);
            return null;
        elsif pg_catalog.cardinality(v_keys) operator(pg_catalog.>) 1 then  -- in array order: ids follow the keys'
            insert into lockstep.queue (job, key) select tg_argv[0], u.k from pg_catalog.unnest(v_keys) u(k);
            return null;
        elsif v_keys is not null then  -- nothing to enqueue: NULL keys, or no row (the column is there: probed)
            return null;
        end if;
    end if;
    -- the general path: any transition-table names, any key type (EXECUTE, here: only this function sees
    -- the transition tables)
    select x.sql, x.problem into v_sql, v_problem
    from lockstep._trigger_general(tg_relid, tg_name, tg_level, tg_when, tg_op, tg_nargs, tg_argv) x;
    if v_problem is not null then
        perform lockstep._flag(case when tg_nargs operator(pg_catalog.>) 0 then tg_argv[0] end, v_problem);
        return null;
    end if;
    execute v_sql into v_keys;  -- checked: the column exists and converts without loss, so no subtransaction
    v_keys := lockstep._queueable(tg_argv[0], v_keys);  -- a key too long for the queue flags the job
    perform lockstep._append(tg_argv[0], v_keys);
    return null;
end;
$$;
comment on function lockstep.enqueue_trigger() is
    'AFTER ... FOR EACH STATEMENT trigger function with transition tables. Arguments: job, key column, '
    'optionally the key type. Never raises: where it cannot enqueue it flags the job. No SET search_path: '
    'every name is qualified. Only it can read the transition tables: the general path''s checks and '
    'query text come from lockstep._trigger_general. Locks: the insert into lockstep.queue (or '
    'lockstep.recompute_flag): nothing a worker or a recompute holds.';

-- lockstep._trigger_general(relid, trigger_name, level, tg_when, op, nargs, argv): the general path of
-- lockstep.enqueue_trigger for trigger_name on relid: why it cannot enqueue (problem; NULL: it can),
-- or the query (sql) that reads the distinct keys of its transition tables as canonical text.
create or replace function lockstep._trigger_general(relid oid, trigger_name name, level text, tg_when text, op text,
                                          nargs integer, argv text[], out sql text, out problem text)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_new name;
    v_old name;
    v_type regtype;
    v_key text;
begin
    select t.tgnewtable, t.tgoldtable into v_new, v_old
    from pg_catalog.pg_trigger t where t.tgrelid = relid and t.tgname = trigger_name;
    if level <> 'STATEMENT' or tg_when <> 'AFTER' or not nargs = any ('{2,3}'::int4[]) then
        problem := 'lockstep.enqueue_trigger() must be used in AFTER ... FOR EACH STATEMENT triggers with '
                   'arguments (job, key column)';
        return;
    elsif op = 'TRUNCATE' then
        problem := pg_catalog.format('TRUNCATE of %s (no transition table names its rows)', relid::regclass);
        return;
    end if;
    v_new := case when op <> 'DELETE' then v_new end;
    v_old := case when op <> 'INSERT' then v_old end;
    begin  -- reads only: the subtransaction gets no transaction id
        select x.problem, x.key_type into problem, v_type
        from lockstep._trigger_problem(argv[0], argv[1], relid, op, v_new, v_old) x;
    exception when others then
        get stacked diagnostics problem = message_text;
    end;
    if problem is not null then
        return;
    end if;
    v_key := case when exists (select from pg_catalog.pg_type y where y.oid = v_type and y.typtype = 'c')
                  then lockstep._key_columns_sql(v_type, argv[1]::name[], 'x')  -- a composite key's columns
                  else pg_catalog.format('x.%I::%s', argv[1], lockstep._type_sql(v_type)) end;
    sql := pg_catalog.concat_ws(' union all ',
        case when v_new is not null then pg_catalog.format('select %s k from %I x', v_key, v_new) end,
        case when v_old is not null then pg_catalog.format('select %s k from %I x', v_key, v_old) end);
    if v_type::text = any (lockstep._fast_types()) then  -- the same text under every setting
        sql := pg_catalog.format('select array(select %s '
                                 'from (select distinct k from (%s) s where k is not null) d order by k)',
                                 case when v_type = 'numeric'::regtype then 'pg_catalog.trim_scale(k)::pg_catalog.text'
                                      else 'k::pg_catalog.text' end, sql);  -- numerics as lockstep._canon
    else
        sql := pg_catalog.format('select lockstep._canon(pg_catalog.array_agg(k)) from (%s) s', sql);
    end if;
end;
$$;

-- lockstep._trigger_fns(): every trigger function that enqueues for lockstep: lockstep.enqueue_trigger()
-- and the ones lockstep.watch() generated (lockstep._gen_trigger).
create or replace function lockstep._trigger_fns() returns setof oid
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select p.oid from pg_catalog.pg_proc p
    where p.pronamespace = 'lockstep'::regnamespace and p.prorettype = 'trigger'::regtype
      and (p.proname in ('enqueue_trigger', 'enqueue_through', 'enqueue_replica') or p.proname like 'enqueue\_w\_%');
$$;

-- lockstep._comment_safe(t): t for a comment line of generated code: control characters (a newline in a
-- column or type name would end the comment and make the rest of the name code) become '?'.
create or replace function lockstep._comment_safe(t text) returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select pg_catalog.regexp_replace(t, '[[:cntrl:]]', '?', 'g');
$$;

-- lockstep._trigger_template_check(): the first part of the text of a trigger function lockstep._gen_trigger
-- writes (a format() string): reads the key column when it is still as watch() found it, else finds why not.
create or replace function lockstep._trigger_template_check() returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select $t$
create or replace function lockstep.%1$I() returns trigger
language plpgsql
as $body$
-- generated by lockstep.watch() (lockstep._gen_trigger): reads only the key column %2$s (type %9$s)
declare
    v_keys pg_catalog.text[];
    v_problem pg_catalog.text;
    v_type pg_catalog.oid;
begin
    -- a role that may not read pg_attribute takes the slow path, whose reads are in blocks (a review; the
    -- privilege of a query is checked when it starts, whatever branch of it would run: a test of its own)
    if pg_catalog.has_table_privilege('pg_catalog.pg_attribute'::pg_catalog.regclass, 'SELECT') then
        v_type := (select a.atttypid from pg_catalog.pg_attribute a
                   where a.attrelid operator(pg_catalog.=) tg_relid
                     and a.attnum operator(pg_catalog.=) (%3$s)::pg_catalog.int2
                     and a.attname operator(pg_catalog.=) %4$L::pg_catalog.name);
    end if;
    -- the column is still %2$s, of type %9$s, at the attribute number watch() found in this table, and
    -- row_security is not off: no subtransaction
    if v_type operator(pg_catalog.=) %10$s::pg_catalog.oid
       and pg_catalog.current_setting('row_security') operator(pg_catalog.<>) 'off' then
        %5$s
%6$s
    else
        if v_type is null then  -- not at that attribute number (renamed, dropped, a table not known here)
            begin  -- reads only
                v_type := (select a.atttypid from pg_catalog.pg_attribute a
                           where a.attrelid operator(pg_catalog.=) tg_relid
                             and a.attname operator(pg_catalog.=) %4$L::pg_catalog.name
                             and a.attnum operator(pg_catalog.>) 0 and not a.attisdropped);
            exception when others then
                get stacked diagnostics v_problem = message_text;
            end;
        end if;
        if v_problem is not null then
            null;  -- the job is flagged below
        elsif v_type is null or v_type operator(pg_catalog.<>) %10$s::pg_catalog.oid then
            v_problem := pg_catalog.concat('column ', %11$L, ' of ', tg_relid::pg_catalog.regclass,
                                           coalesce(' is of type ' operator(pg_catalog.||) v_type::pg_catalog.regtype,
                                                    ' is gone'),
                                           %12$L);
        else
            begin  -- reads only: the subtransaction gets no transaction id
                %7$s
            exception when others then
                get stacked diagnostics v_problem = message_text;
            end;
        end if;
    end if;
$t$;
$$;

-- lockstep._trigger_template_queue(): the end of a generated trigger function's text (lockstep._gen_trigger,
-- lockstep._gen_key_columns): append the keys read in v_keys to the queue, with row_security on.
create or replace function lockstep._trigger_template_queue() returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select $t$    if pg_catalog.current_setting('row_security') operator(pg_catalog.=) 'off' then
        perform lockstep._append(tg_argv[0], v_keys);  -- the queue's policies refuse a plain insert then
    elsif pg_catalog.cardinality(v_keys) operator(pg_catalog.=) 1 then
        insert into lockstep.queue (job, key) values (tg_argv[0], v_keys[1]);
    elsif pg_catalog.cardinality(v_keys) operator(pg_catalog.>) 1 then
        insert into lockstep.queue (job, key) select tg_argv[0], u.k from pg_catalog.unnest(v_keys) u(k);
    end if;
    return null;
end;
$body$
$t$;
$$;

-- lockstep._trigger_template_enqueue(): the rest of lockstep._trigger_template_check's text: flag the job
-- with the problem found, or enqueue the keys read.
create or replace function lockstep._trigger_template_enqueue() returns text
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select $t$    if v_problem is not null then
        begin  -- the same words as lockstep.enqueue_trigger's general path where it can tell
            select coalesce(x.problem, v_problem) into v_problem
            from lockstep._trigger_problem(tg_argv[0], tg_argv[1], tg_relid, tg_op,
                                           case when tg_op operator(pg_catalog.<>) 'DELETE' then 'lockstep_new' end,
                                           case when tg_op operator(pg_catalog.<>) 'INSERT' then 'lockstep_old' end) x;
        exception when others then
            null;
        end;
        perform lockstep._flag(tg_argv[0], v_problem);
        return null;
    end if;
%8$s
$t$ || lockstep._trigger_template_queue();
$$;

-- lockstep._gen_trigger(j, source, key_column): generate lockstep.enqueue_w_<hash>(), a trigger function
-- that reads only the key column; NULL where the session may not create it (watch() then uses
-- lockstep.enqueue_trigger()). Never raises; no SET clause: every name and operator qualified.
-- locks: nothing (creates or replaces the function).
create or replace function lockstep._gen_trigger(j lockstep.job, source regclass, key_column name) returns text
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_name name := ('enqueue_w_' || pg_catalog.left(pg_catalog.md5(
                        pg_catalog.concat_ws(pg_catalog.chr(1), j.job, source::oid, key_column)), 24))::name;
    -- a key's text: a numeric's without trailing zeros, as lockstep._canon
    v_text text := case when j.key_type = 'numeric'::regtype then 'pg_catalog.trim_scale(s.k)::pg_catalog.text'
                        else 's.k::pg_catalog.text' end;
    v_read text := 'v_keys := array(select ' || v_text || ' from (%s) s where s.k is not null order by s.k);';
    -- a key type whose text always fits the queue: one statement
    v_long boolean := j.key_type in ('text'::regtype, 'character varying'::regtype, 'numeric'::regtype);
    v_fast text := case when v_long then v_read
                        else 'insert into lockstep.queue (job, key) select tg_argv[0], ' || v_text || ' '
                             'from (%s) s where s.k is not null order by s.k;' end;
    v_upd text := pg_catalog.format('select x.%1$I as k from lockstep_new x union select x.%1$I from lockstep_old x',
                                    key_column);
    v_ins text := pg_catalog.format('select distinct x.%I as k from lockstep_new x', key_column);
    v_del text := pg_catalog.format('select distinct x.%I as k from lockstep_old x', key_column);
    -- the branch on tg_op: %1$s, %3$s, %4$s the UPDATE, INSERT, DELETE statements, %2$s the indent
    v_ops text := E'if tg_op operator(pg_catalog.=) ''UPDATE'' then\n%2$s    %1$s\n'
                  || E'%2$selsif tg_op operator(pg_catalog.=) ''INSERT'' then\n%2$s    %3$s\n'
                  || E'%2$selse\n%2$s    %4$s\n%2$send if;';
    v_attnum text;
    v_type oid := (select a.atttypid from pg_catalog.pg_attribute a
                   where a.attrelid = source and a.attname = key_column and a.attnum > 0 and not a.attisdropped);
begin
    if not pg_catalog.has_schema_privilege('lockstep', 'CREATE') then
        return null;
    end if;
    -- the key column's attribute number in each table (a partition may number its columns otherwise)
    select pg_catalog.concat('case ', pg_catalog.string_agg(
               pg_catalog.format('when tg_relid operator(pg_catalog.=) %s::pg_catalog.oid then %s', t.rel::oid, a.attnum),
               ' ' order by t.o), ' end')
    into v_attnum
    from pg_catalog.unnest(lockstep._family(source)) with ordinality t(rel, o)
    join pg_catalog.pg_attribute a on a.attrelid = t.rel and a.attname = key_column and a.attnum > 0
                                      and not a.attisdropped;
    execute pg_catalog.format(lockstep._trigger_template_check() || lockstep._trigger_template_enqueue(),
        v_name, lockstep._comment_safe(pg_catalog.quote_ident(key_column)), coalesce(v_attnum, 'null::pg_catalog.int4'), key_column,
        pg_catalog.format(v_ops, pg_catalog.format(v_fast, v_upd), '        ', pg_catalog.format(v_fast, v_ins),
                          pg_catalog.format(v_fast, v_del)),
        case when v_long then '' else '        return null;  -- queued' end,
        pg_catalog.format(v_ops, pg_catalog.format(v_read, v_upd), '                ', pg_catalog.format(v_read, v_ins),
                          pg_catalog.format(v_read, v_del)),
        case when v_long then
pg_catalog.format('    if pg_catalog.octet_length(pg_catalog.array_to_string(v_keys, ''''))
       operator(pg_catalog.+) pg_catalog.octet_length(tg_argv[0]) operator(pg_catalog.>) %s then
        v_keys := lockstep._queueable(tg_argv[0], v_keys);  -- a key too long for the queue flags the job
    end if;', lockstep._max_key_bytes()) else '' end,
        lockstep._comment_safe(pg_catalog.format_type(v_type, null)), coalesce(v_type, 0), pg_catalog.quote_ident(key_column),
        pg_catalog.format(', not of type %s as when watch() ran: run lockstep.watch() again',
                          pg_catalog.format_type(v_type, null)));
    return pg_catalog.format('lockstep.%I', v_name);
exception when insufficient_privilege then  -- a function of that name owned by another role
    return null;
end;
$$;

-- lockstep._drop_unused_triggers(): drop the generated trigger functions no trigger uses any more; one the
-- session may not drop is left for a role that may.
-- locks: nothing beyond the functions dropped.
create or replace function lockstep._drop_unused_triggers() returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    f regprocedure;
begin
    for f in select p.oid from pg_catalog.pg_proc p
             where p.oid in (select lockstep._trigger_fns()) and p.proname like 'enqueue\_w\_%'
               and not exists (select from pg_catalog.pg_trigger t where t.tgfoid = p.oid) loop
        begin
            execute pg_catalog.format('drop function %s', f);
        exception when insufficient_privilege or dependent_objects_still_exist then
            null;
        end;
    end loop;
end;
$$;

-- lockstep._trigger_name(job, op): name of a trigger lockstep.watch() creates: at most 20 bytes of the job
-- name, 12 hex digits of its md5, the operation (at most 55 bytes).
create or replace function lockstep._trigger_name(job text, op text) returns name
language sql immutable
set search_path = pg_catalog, pg_temp
as $$
    select ('lockstep_' || (select s from pg_catalog.generate_series(least(pg_catalog.length(job), 20), 0, -1) n,
                                           pg_catalog.left(job, n) s
                            where pg_catalog.octet_length(s) <= 20 limit 1)
            || '_' || pg_catalog.left(pg_catalog.md5(job), 12) || '_' || op)::name;
$$;

-- lockstep._tgarg(args, n): the n-th (0-based) argument of pg_trigger.tgargs, compared as bytes.
create or replace function lockstep._tgarg(args bytea, n integer) returns text
language plpgsql immutable
set search_path = pg_catalog, pg_temp
as $$
declare
    v bytea := args;
    p integer;
begin
    for i in 0..n loop
        p := pg_catalog.position(v, '\x00'::bytea);
        if p = 0 then
            return null;
        end if;
        if i = n then
            return pg_catalog.convert_from(pg_catalog.substr(v, 1, p - 1), pg_catalog.getdatabaseencoding());
        end if;
        v := pg_catalog.substr(v, p + 1);
    end loop;
    return null;
end;
$$;

-- lockstep._watchers(job): every trigger that feeds job through lockstep.enqueue_trigger or a function
-- lockstep.watch() generated (lockstep.watch's triggers and one's own): table, trigger name, key column.
create or replace function lockstep._watchers(job text)
returns table (rel regclass, tgname name, key_column text)
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select tg.tgrelid::regclass, tg.tgname, lockstep._tgarg(tg.tgargs, 1)
    from pg_catalog.pg_trigger tg
    where tg.tgfoid in (select lockstep._trigger_fns()) and tg.tgnargs >= 1
      and pg_catalog.substr(tg.tgargs, 1, pg_catalog.position(tg.tgargs, '\x00'::bytea) - 1)
          = pg_catalog.convert_to(job, pg_catalog.getdatabaseencoding())
    order by 1, 2;
$$;

-- lockstep._check_watchers(job, parent, key_type): define_derived's check on a job that triggers feed: it
-- keeps a parent, and every watched column converts to the new key type; else LSJ02 / LSQ01. A source
-- watched through a join keeps its own columns (its foreign key's type); its through columns must convert.
create or replace function lockstep._check_watchers(job text, parent regclass, key_type regtype) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    w record;
    v_rel regclass;
    v_col text;
    v_args bytea;
    v_type regtype;
    v_old regtype := (select x.key_type from lockstep.job x where x.job = _check_watchers.job);
    v_why text;
    v_gone text;
    -- every table that feeds the job, for the hint
    v_all text := (select pg_catalog.string_agg(distinct pg_catalog.format('lockstep.unwatch(%L, %L)', job, x.rel::text), ', ')
                   from lockstep._watchers(job) x);
begin
    for w in select * from lockstep._watchers(job) loop
        if parent is null then
            raise exception 'lockstep: job "%" is fed by trigger % on %, so it needs a parent (its queue)', job, w.tgname, w.rel
                using errcode = 'LSJ02',
                      hint = pg_catalog.format('Pass parent => ..., or first select lockstep.unwatch(%L, %L).', job, w.rel);
        end if;
        v_rel := w.rel;
        v_col := w.key_column;
        v_gone := null;
        -- a watch through a join: its row-change triggers name the through table's columns (not its TRUNCATE one)
        v_args := (select tg.tgargs from pg_catalog.pg_trigger tg
                   where tg.tgrelid = w.rel and lockstep._tgarg(tg.tgargs, 5) is not null
                     and tg.tgname in (select lockstep._trigger_name(job, o)
                                       from pg_catalog.unnest(array['insert', 'update', 'delete']) o)
                   limit 1);
        if v_args is not null then
            v_gone := (select pg_catalog.format('its column %I is gone (renamed or dropped)', c.n)
                      from pg_catalog.unnest(case when v_col like '{%}' then v_col::name[] else array[v_col::name] end) c(n)
                      where not exists (select from pg_catalog.pg_attribute a where a.attrelid = w.rel and a.attname = c.n
                                                                               and a.attnum > 0 and not a.attisdropped)
                      limit 1);
            v_rel := lockstep._tgarg(v_args, 3)::oid;
            v_col := lockstep._tgarg(v_args, 5);
        end if;
        select a.atttypid into v_type from pg_catalog.pg_attribute a
        where a.attrelid = v_rel and a.attname = v_col and a.attnum > 0 and not a.attisdropped;
        -- the reason in words that say which
        v_why := case when v_type is null and v_col like '{%}' then  -- a composite key's columns
                          coalesce(lockstep._key_columns_problem(v_rel, v_col::name[], key_type),
                                   case when v_old <> key_type then pg_catalog.format(
                                       'its trigger was made for the parent key type %s, not the new %s', v_old, key_type) end)
                      when v_type is null then pg_catalog.format('its column %I is gone (renamed or dropped)', v_col)
                      when not lockstep._castable(v_type, _check_watchers.key_type) then
                          pg_catalog.format('its column %I is %s, which does not always convert to the new parent key type %s',
                                            v_col, v_type, key_type)
                      when v_old <> _check_watchers.key_type then
                          pg_catalog.format('its trigger was made for the parent key type %s, not the new %s', v_old, key_type)
                 end;
        if v_why is not null and v_rel <> w.rel then
            v_why := pg_catalog.format('through %s, %s', v_rel, v_why);
        end if;
        v_why := coalesce(v_gone, v_why);
        if v_why is not null then
            raise exception 'lockstep: job "%" is fed by trigger % on %: %', job, w.tgname, w.rel, v_why
                using errcode = 'LSQ01',
                      hint = pg_catalog.format('First select %s (every table that feeds it), then watch() again '
                                               'after redefining.', v_all);
        end if;
    end loop;
end;
$$;

-- lockstep._ddl(tables, stmts, what): run DDL on application tables, all or none. Each attempt waits in the
-- lock queue for one table only, holding nothing; it retries each other table with NOWAIT for at most
-- 100 ms: so no application transaction can deadlock with it, whatever its deadlock_timeout. On a miss
-- every lock goes back and the next attempt waits for the missed table first. After ~10 s, 55P03.
-- locks: tables (ACCESS EXCLUSIVE), in the order of the array, the last contended one first: the first
-- waited for at most 100 ms (unless it has children or the transaction holds a strong lock), the others
-- NOWAIT.
create or replace function lockstep._ddl(tables regclass[], stmts text[], what text) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_ms text := (extract(epoch from least(interval '100 ms',
                  pg_catalog.current_setting('deadlock_timeout')::interval / 2)) * 1000)::bigint::text;
    v_old text := pg_catalog.current_setting('lock_timeout');
    v_order regclass[] := array(select t from pg_catalog.unnest(tables) with ordinality u(t, o)
                                group by t order by min(o));
    -- a strong table lock the caller's transaction already holds could close a cycle: then no lock waits
    v_wait boolean := not exists (select from pg_catalog.pg_locks l
                                  where l.pid = pg_catalog.pg_backend_pid() and l.locktype = 'relation'
                                    and l.granted
                                    and l.mode not in ('AccessShareLock', 'RowShareLock', 'RowExclusiveLock'));
    v_until timestamptz;
    v_at regclass;
    t regclass;
    s text;
begin
    for attempt in 1..50 loop
        begin
            perform pg_catalog.set_config('lock_timeout', v_ms, true);  -- undone if the attempt fails
            v_at := v_order[1];
            -- the one lock waited for, holding nothing yet; not a table with children (it locks them too)
            if v_wait and v_at is not null
               and not exists (select from pg_catalog.pg_inherits i where i.inhparent = v_at) then
                execute pg_catalog.format('lock table %s in access exclusive mode', v_at);
            end if;
            foreach t in array v_order loop  -- never waiting while holding: a retried NOWAIT is no lock wait
                v_at := t;
                v_until := pg_catalog.clock_timestamp() + pg_catalog.make_interval(secs => v_ms::numeric / 1000);
                loop
                    begin
                        execute pg_catalog.format('lock table %s in access exclusive mode nowait', t);
                        exit;
                    exception when lock_not_available then
                        if pg_catalog.clock_timestamp() >= v_until then
                            raise;
                        end if;
                        perform pg_catalog.pg_sleep(0.005);
                    end;
                end loop;
            end loop;
            v_at := null;
            foreach s in array stmts loop
                execute s;
            end loop;
            perform pg_catalog.set_config('lock_timeout', v_old, true);
            return;
        exception when lock_not_available then
            if v_at is not null then  -- the next attempt waits for this one first, holding nothing
                v_order := v_at || pg_catalog.array_remove(v_order, v_at);
            end if;
            perform pg_catalog.pg_sleep(0.05 + 0.1 * pg_catalog.random());
        end;
    end loop;
    raise exception 'lockstep: % could not lock its tables: application transactions kept them busy', what
        using errcode = '55P03',
              hint = pg_catalog.format('Nothing was changed. Each of 50 attempts waited at most %s ms for each of %s; '
                                       'try again when fewer or shorter transactions use them.',
                                       v_ms, pg_catalog.array_to_string(v_order, ', '));
end;
$$;
comment on function lockstep._ddl(regclass[], text[], text) is
    'Run DDL on application tables, all or none. Each attempt waits in the lock queue for one table only, '
    'holding nothing; it retries each other table with NOWAIT for at most 100 ms: so no application '
    'transaction can deadlock with it. On a miss every lock goes back and the next attempt waits for the '
    'missed table first. After ~10 s, 55P03. Locks: tables (ACCESS EXCLUSIVE), in the order of the array, '
    'the last contended one first: the first waited for at most 100 ms (unless it has children or the '
    'transaction holds a strong lock), the others NOWAIT.';

-- lockstep._family(source): source and every table below it, parents first, foreign tables left out (a
-- statement trigger fires only for statements that name its table). PL/pgSQL: each capture calls it, and a
-- SQL function with a SET clause is planned at every call.
create or replace function lockstep._family(source regclass) returns regclass[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    return array(with recursive f (rel, depth) as (
                     select source::oid, 0
                     union all
                     select i.inhrelid, f.depth + 1 from f join pg_catalog.pg_inherits i on i.inhparent = f.rel
                     where f.depth < 100
                 )
                 select f.rel::regclass from f join pg_catalog.pg_class c on c.oid = f.rel
                 where c.relkind in ('r', 'p') group by f.rel order by min(f.depth), f.rel);
end;
$$;

-- lockstep._drop_watch_ddl(job, tables): the DROP TRIGGER IF EXISTS statements for the four triggers
-- lockstep.watch() creates for job on each of tables, and lockstep.watch_replica's row trigger (run
-- through lockstep._ddl by watch and unwatch).
-- locks: nothing (returns text).
create or replace function lockstep._drop_watch_ddl(job text, tables regclass[]) returns text[]
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select array(select pg_catalog.format('drop trigger if exists %I on %s', lockstep._trigger_name(job, o), x)
                 from pg_catalog.unnest(tables) x,
                      pg_catalog.unnest(array['insert', 'update', 'delete', 'truncate', 'replica']) o);
$$;

-- lockstep._warn_writers(tables): after watch(): a WARNING for each role that may write one of tables but
-- lacks what the triggers need as that role.
create or replace function lockstep._warn_writers(tables regclass[]) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_roles text;
begin
    with w as (
        select a.grantee as r
        from pg_catalog.pg_class c, pg_catalog.aclexplode(c.relacl) a
        where c.oid = any(tables) and a.privilege_type in ('INSERT', 'UPDATE', 'DELETE', 'TRUNCATE')
        union
        select a.grantee
        from pg_catalog.pg_attribute t, pg_catalog.aclexplode(t.attacl) a
        where t.attrelid = any(tables) and t.attacl is not null and a.privilege_type in ('INSERT', 'UPDATE')
        union
        select c.relowner from pg_catalog.pg_class c where c.oid = any(tables)
    ), n as (
        select coalesce(r.rolname, 'public') as name, coalesce(r.rolname, 'PUBLIC') as shown
        from w left join pg_catalog.pg_roles r on r.oid = w.r
        where not coalesce(r.rolsuper, false)
    ), m as (
        select n.shown, pg_catalog.concat_ws(', ',
                   case when not pg_catalog.has_schema_privilege(n.name, 'lockstep', 'USAGE') then 'USAGE on schema lockstep' end,
                   -- on the table, or on the two columns every insert of lockstep's triggers names (docs/security.md)
                   case when not (pg_catalog.has_column_privilege(n.name, 'lockstep.queue', 'job', 'INSERT')
                                  and pg_catalog.has_column_privilege(n.name, 'lockstep.queue', 'key', 'INSERT'))
                        then 'INSERT on lockstep.queue' end,
                   case when not (pg_catalog.has_column_privilege(n.name, 'lockstep.recompute_flag', 'job', 'INSERT')
                                  and pg_catalog.has_column_privilege(n.name, 'lockstep.recompute_flag', 'problem', 'INSERT'))
                        then 'INSERT on lockstep.recompute_flag' end) as lacks
        from n
    )
    select pg_catalog.string_agg(pg_catalog.format('%s (lacks %s)', m.shown, m.lacks), '; ' order by m.shown)
    into v_roles
    from m where m.lacks <> '';
    if v_roles is not null then
        raise warning 'lockstep: roles that may write % lack grants watch()''s triggers need: %',
            pg_catalog.array_to_string(tables, ', '), v_roles
            using hint = 'Without USAGE on schema lockstep or INSERT on lockstep.queue every write of theirs fails '
                         'with 42501; without INSERT on lockstep.recompute_flag one the trigger cannot enqueue does '
                         '(docs/security.md, Application).';
    end if;
end;
$$;

-- lockstep._check_source_key(j, source, key_column): refuse a key column whose foreign keys all reference
-- a table other than the job's parent: its values are that table's keys (LSQ02; watch through that table).
-- locks: nothing.
create or replace function lockstep._check_source_key(j lockstep.job, source regclass, key_column name) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_family regclass[] := lockstep._family(j.parent);
    v_att smallint := (select a.attnum from pg_catalog.pg_attribute a
                       where a.attrelid = source and a.attname = key_column and a.attnum > 0 and not a.attisdropped);
    v_refs regclass := (select c.confrelid::regclass from pg_catalog.pg_constraint c
                        where c.conrelid = source and c.contype = 'f' and c.conkey = array[v_att]
                        order by c.conname limit 1);
begin
    if source = any(v_family) or v_refs is null
       or exists (select from pg_catalog.pg_constraint p
                  where p.conrelid = source and p.contype = 'f' and p.conkey = array[v_att]
                    and p.confrelid = any(v_family)) then
        return;
    end if;
    raise exception 'lockstep: %.% references %, not the parent % of job "%": its values are keys of %',
        source, key_column, v_refs, j.parent, j.job, v_refs
        using errcode = 'LSQ02',
              hint = pg_catalog.format('Watch it through that table: lockstep.watch(%L, %L, %L, through => %L, '
                                       'through_column => <the column of %s that holds %s''s key>).',
                                       j.job, source, key_column, v_refs, v_refs, j.parent);
end;
$$;

-- lockstep._warn_source(j, source, key_column, below): watch()'s warnings about what its triggers will not
-- see, and about a key column that holds another table's keys. below: how many tables below source got
-- triggers; NULL when watched through the WAL, which sees every partition's writes (no partition warning).
create or replace function lockstep._warn_source(j lockstep.job, source regclass, key_column name, below integer) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_up regclass := (select i.inhparent::regclass from pg_catalog.pg_inherits i where i.inhrelid = source limit 1);
    v_family regclass[] := lockstep._family(j.parent);
    v_att smallint := (select a.attnum from pg_catalog.pg_attribute a
                       where a.attrelid = source and a.attname = key_column and a.attnum > 0 and not a.attisdropped);
begin
    if below is not null and exists (select from pg_catalog.pg_class c where c.oid = source and c.relkind = 'p') then
        raise warning 'lockstep: watch(%, %) covers its % partition(s) of today; run it again after attaching or creating one',
            j.job, source, below
            using hint = 'A write made directly to a partition that is not watched reaches the job only at its next recompute.';
    end if;
    if v_up is not null and below is not null then
        raise warning 'lockstep: % is a partition or child of %: a write made through % fires the triggers of %, not of %',
            source, v_up, v_up, v_up, source
            using hint = pg_catalog.format('Watch %s instead (watch() covers every table below it).', v_up);
    end if;
    if source = any(v_family) then  -- the parent's own key, whatever it references
        return;
    end if;
    if exists (select from pg_catalog.pg_constraint c
                  where c.conrelid = source and c.contype = 'p' and c.conkey = array[v_att])
          and not exists (select from pg_catalog.pg_constraint c
                          where c.conrelid = source and c.contype = 'f' and v_att = any(c.conkey))
          -- nor referenced by the parent's key: a reverse one-to-one, whose keys are the parent's
          and not exists (select from pg_catalog.pg_constraint c
                          join pg_catalog.pg_attribute pa on pa.attrelid = c.conrelid and pa.attname = j.parent_key
                          where c.conrelid = any(v_family) and c.contype = 'f'
                            and c.conkey = array[pa.attnum] and c.confrelid = source and c.confkey = array[v_att]) then
        raise warning 'lockstep: %.% is the primary key of %, not a reference to the parent % of job "%": its values are keys of % itself',
            source, key_column, source, j.parent, j.job, source
            using hint = pg_catalog.format('Watch the column of %s that holds %s''s keys, or write a trigger that enqueues them '
                                           '(docs/operations.md, Writing your own triggers); if %s.%s does hold them (no foreign key '
                                           'declared), nothing is wrong.', source, j.parent, source, key_column);
    end if;
end;
$$;

-- lockstep._check_watch(j, source, key_column): watch()'s first checks of its arguments, in order, before
-- anything changes; returns the type of source.key_column.
-- locks: as lockstep._check_cycle (the advisory lock (lockstep, define), until the transaction ends).
create or replace function lockstep._check_watch(j lockstep.job, source regclass, key_column name)
returns regtype
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_type regtype;
begin
    if source is null or key_column is null then
        raise exception 'lockstep: source and key_column must not be NULL' using errcode = '22004';
    end if;
    -- only who manages the job feeds it
    perform lockstep._check_owner(j);
    if not exists (select from pg_catalog.pg_class c where c.oid = source and c.relkind in ('r', 'p')) then
        raise exception 'lockstep: source % is not a table', source using errcode = '42809';
    end if;
    -- lockstep's own tables: a watched queue would feed itself
    perform lockstep._check_not_ours(source, 'a watched table');
    if j.target = any(lockstep._family(source)) or source = any(lockstep._family(j.target)) then
        raise exception 'lockstep: % is the target of job "%" (or a partition of it)', source, j.job
            using errcode = '22023',
                  hint = 'The job writes this table: its own writes would queue its parents again, for ever. '
                         'watch the tables compute reads.';
    end if;
    perform lockstep._check_cycle(j.job, null, source);  -- LSD09 (10_graph.sql)
    select a.atttypid into v_type from pg_catalog.pg_attribute a
    where a.attrelid = source and a.attname = key_column and a.attnum > 0 and not a.attisdropped;
    if v_type is null then
        raise exception 'lockstep: table % has no column %', source, key_column using errcode = '42703';
    end if;
    return v_type;
end;
$$;
comment on function lockstep._check_watch(lockstep.job, regclass, name) is
    'Watch()''s first checks of its arguments, in order, before anything changes; returns the type of '
    'source.key_column. Locks: as lockstep._check_cycle (the advisory lock (lockstep, define), until the '
    'transaction ends).';

-- lockstep._watch_news(j, source, key_column, tables): the recompute flag's problem when watch() starts
-- feeding job j from tables (source and those below it) that it did not watch on key_column until now (their
-- earlier changes reached no queue); NULL otherwise. Trigger arguments compared as bytes, NUL-terminated.
create or replace function lockstep._watch_news(j lockstep.job, source regclass, key_column name, tables regclass[])
returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_args bytea := pg_catalog.convert_to(j.job, pg_catalog.getdatabaseencoding()) || '\x00'::bytea
                    || pg_catalog.convert_to(key_column, pg_catalog.getdatabaseencoding()) || '\x00'::bytea;
begin
    if exists (select from pg_catalog.unnest(tables) t(rel)
               where not exists (select from pg_catalog.pg_trigger tg
                                 where tg.tgrelid = t.rel and tg.tgname = lockstep._trigger_name(j.job, 'insert'))) then
        return pg_catalog.format('%s newly watched: its earlier changes wait for the full recompute', source);
    elsif exists (select from pg_catalog.unnest(tables) t(rel)
                  join pg_catalog.pg_trigger tg on tg.tgrelid = t.rel and tg.tgname = lockstep._trigger_name(j.job, 'insert')
                  where pg_catalog.substring(tg.tgargs, 1, pg_catalog.length(v_args)) <> v_args) then
        return pg_catalog.format('%s watched on column %s now: its earlier changes wait for the full recompute',
                                 source, key_column);
    end if;
    return null;
end;
$$;

-- lockstep._watch_ddl(j, tables, fn, args): the CREATE TRIGGER statements of watch(): on each table,
-- insert, update and delete triggers calling fn(job, args...) with transition tables, and a truncate trigger
-- calling the shared lockstep.enqueue_trigger(job, args[1]), which flags the job.
create or replace function lockstep._watch_ddl(j lockstep.job, tables regclass[], fn text, args text[])
returns text[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_ddl text[] := '{}';
    v_args text := (select pg_catalog.string_agg(pg_catalog.format(', %L', a), '' order by o)
                    from pg_catalog.unnest(args) with ordinality u(a, o));
    op text;
    t regclass;
begin
    foreach t in array tables loop  -- one function for all: its arguments name only columns, which they share
        foreach op in array array['insert', 'update', 'delete'] loop
            v_ddl := v_ddl || pg_catalog.format(
                'create trigger %I after %s on %s referencing %s for each statement '
                'execute function %s(%L%s)',
                lockstep._trigger_name(j.job, op), op, t,
                case op when 'insert' then 'new table as lockstep_new'
                        when 'update' then 'old table as lockstep_old new table as lockstep_new'
                        else 'old table as lockstep_old' end,
                fn, j.job, v_args);
        end loop;
        v_ddl := v_ddl || pg_catalog.format('create trigger %I after truncate on %s for each statement '
                                            'execute function lockstep.enqueue_trigger(%L, %L)',
                                            lockstep._trigger_name(j.job, 'truncate'), t, j.job, args[1]);
    end loop;
    return v_ddl;
end;
$$;

-- lockstep.watch(job, source, key_column, through, through_column, via, key_columns, through_columns): create
-- the triggers that enqueue source.key_column for job (and flag it on truncate) on source and every table
-- below it; re-running replaces them. With through, source is one hop below the parent
-- (lockstep._watch_through); with key_columns, the columns of a composite parent key
-- (lockstep._watch_key_columns), and with through too, through_columns (lockstep._watch_through_columns).
-- locks: the advisory lock (lockstep, define), until the transaction ends (lockstep._check_cycle); then
-- source and the tables below it (DROP / CREATE TRIGGER) through lockstep._ddl, never more than
-- 100 ms at a time (55P03 after ~10 s); then, if source was not watched for job on that column, appends a
-- lockstep.recompute_flag row.
create or replace function lockstep.watch(job text, source regclass, key_column name default null,
                                          through regclass default null, through_column name default null,
                                          via text default 'trigger', key_columns name[] default null,
                                          through_columns name[] default null) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
as $$
declare
    j lockstep.job := lockstep._queue_job(job);
    v_type regtype;
    v_fast boolean;
    v_fn text := 'lockstep.enqueue_trigger';
    v_ddl text[];
    v_tables regclass[] := lockstep._family(source);
    v_flag text;
begin
    if key_column is not null and key_columns is not null then
        raise exception 'lockstep: key_column and key_columns given together: pass one' using errcode = '22023',
            hint = 'key_column => the column holding a one-column key, key_columns => the columns of a composite one.';
    elsif through is not null and (key_columns is not null or lockstep._key_fields(j) is not null) then
        perform lockstep._watch_through_columns(j, source, key_columns, through, through_column, through_columns, via);
        return;  -- a composite key through a join (17_through.sql)
    elsif key_columns is not null or lockstep._key_fields(j) is not null then  -- a composite key (20_watch_columns.sql)
        perform lockstep._watch_key_columns(j, source, key_columns, through, via);
        return;
    elsif through_columns is not null then
        raise exception 'lockstep: job "%" has a one-column parent key %: pass through_column, not through_columns',
            j.job, lockstep._key_name(j)
            using errcode = '22023', hint = 'through_column => the column of the through table holding the parent key.';
    end if;
    v_type := lockstep._check_watch(j, source, key_column);
    if via = 'wal' and through is null then  -- no trigger: lockstep.capture() reads the WAL (16_capture.sql)
        perform lockstep._watch_wal(j, source, array[key_column]);
        perform lockstep._warn_source(j, source, key_column, null);
        return;
    elsif via is distinct from 'trigger' then
        raise exception 'lockstep: via => % is not a way to watch%', pg_catalog.quote_nullable(via),
            case when via = 'wal' then ' a table through another' else '' end
            using errcode = '22023', hint = 'Use via => ''trigger'' or, without through, via => ''wal''.';
    end if;
    if through is null then
        perform lockstep._check_source_key(j, source, key_column);
    end if;
    if (through is null) <> (through_column is null) then
        raise exception 'lockstep: through and through_column go together' using errcode = '22004',
            hint = 'through => the table source.key_column references, through_column => its column holding the parent key.';
    elsif through is not null then
        perform lockstep._watch_through(j, source, key_column, through, through_column);
        return;
    end if;
    -- a trigger cannot report a value that does not convert: only lossless conversions
    if not lockstep._castable(v_type, j.key_type) then
        raise exception 'lockstep: %.% is %, which does not always convert to the parent key type % of job "%"',
            source, key_column, v_type, j.key_type, j.job
            using errcode = 'LSQ01',
                  hint = pg_catalog.format('Watch a column of type %s (or of a type with an implicit cast to it).', j.key_type);
    end if;
    -- the fast path (a third argument) where the column's JSON text is the key's canonical text
    v_fast := v_type::text = any(lockstep._fast_types()) and j.key_type::text = any(lockstep._fast_types());
    v_flag := lockstep._watch_news(j, source, key_column, v_tables);  -- before the triggers change
    if v_fast then  -- a function that reads only the key column, where the session may create one
        v_fn := coalesce(lockstep._gen_trigger(j, source, key_column), v_fn);
    end if;
    v_ddl := lockstep._drop_watch_ddl(j.job, v_tables)
             || lockstep._watch_ddl(j, v_tables, v_fn,
                                    array[key_column::text] || case when v_fast then array[j.key_type::text] end);
    perform lockstep._ddl(v_tables, v_ddl, pg_catalog.format('watch(%L, %L)', j.job, source));
    if v_flag is not null then
        perform lockstep._flag_job(j.job, v_flag);  -- security definer
    end if;
    perform lockstep._warn_writers(v_tables);
    perform lockstep._warn_source(j, source, key_column, cardinality(v_tables) - 1);
    perform lockstep._drop_unused_triggers();  -- a function the replaced triggers used, if no longer any
    perform lockstep._unwatch_wal(j.job, source);  -- watched through the WAL until now (16_capture.sql)
end;
$$;
comment on function lockstep.watch(text, regclass, name, regclass, name, text, name[], name[]) is
    'Create the triggers that enqueue source.key_column for job (and flag it on truncate) on source and '
    'every table below it; re-running replaces them. With through, source is one hop below the parent '
    '(lockstep._watch_through); with key_columns, the columns of a composite parent key '
    '(lockstep._watch_key_columns), and with through too, through_columns (lockstep._watch_through_columns); LSD09 if it would close a cycle of derived jobs. Locks: the advisory lock '
    '(lockstep, define) until the transaction ends; then source and the tables below it (DROP / CREATE TRIGGER) through '
    'lockstep._ddl, never more than 100 ms at a time (55P03 after ~10 s); then, if source was not watched'
    ' for job on that column, appends a lockstep.recompute_flag row.';

-- lockstep.unwatch(job, source): drop the triggers lockstep.watch() created on source and the tables below
-- it (LSJ01 for an unknown job with none there; a WARNING for a known job with none there).
-- locks: source and the tables below it (DROP TRIGGER) through lockstep._ddl, as lockstep.watch.
create or replace function lockstep.unwatch(job text, source regclass) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
set client_min_messages = warning
as $$
declare
    v_tables regclass[] := lockstep._family(source);
begin
    if job is null or source is null then
        raise exception 'lockstep: job and source must not be NULL' using errcode = '22004';
    end if;
    if lockstep._unwatch_wal(job, source) then  -- watched through the WAL (16_capture.sql)
        return;
    end if;
    if exists (select from lockstep.job x where x.job = unwatch.job) then
        perform lockstep._job(job, 'derived');  -- LSJ02 for a generic job, as watch()
    elsif not exists (select from pg_catalog.pg_trigger t
                       where t.tgrelid = source and t.tgname in (select lockstep._trigger_name(unwatch.job, o)
                             from pg_catalog.unnest(array['insert', 'update', 'delete', 'truncate']) o)) then
        perform lockstep._job(job);  -- LSJ01
    end if;
    if not exists (select from pg_catalog.pg_trigger t
                   where t.tgrelid = any(v_tables) and t.tgname in (select lockstep._trigger_name(unwatch.job, o)
                         from pg_catalog.unnest(array['insert', 'update', 'delete', 'truncate']) o)) then
        -- a warning, not an error: unwatch() stays safe to repeat in a deploy script
        raise warning 'lockstep: job "%" does not watch %: nothing to unwatch', job, source
            using hint = 'The triggers named lockstep_<job>_* on a table show what a job watches.';
    end if;
    perform lockstep._ddl(v_tables, lockstep._drop_watch_ddl(job, v_tables),
                          pg_catalog.format('unwatch(%L, %L)', job, source));
    perform lockstep._drop_unused_triggers();
end;
$$;
comment on function lockstep.unwatch(text, regclass) is
    'Drop the triggers lockstep.watch() created on source and the tables below it (LSJ01 for an unknown '
    'job with none there; a WARNING for a known job with none there). Locks: source and the tables below '
    'it (DROP TRIGGER) through lockstep._ddl, as lockstep.watch.';
