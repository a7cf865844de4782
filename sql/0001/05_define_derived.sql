-- lockstep 0001: define_derived: every check on a derived job's definition, before anything is written.

-- lockstep._proc_columns(f): the output columns (name, type) of a set-returning function.
-- locks: nothing.
create function lockstep._proc_columns(f regprocedure)
returns table (name name, type oid, ord bigint)
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select a.n::name, a.t, a.o
    from pg_catalog.pg_proc p,
         unnest(p.proallargtypes, p.proargmodes, p.proargnames) with ordinality as a(t, m, n, o)
    where p.oid = f and p.proallargtypes is not null and a.m in ('o', 't', 'b')
    union all
    select att.attname, att.atttypid, att.attnum
    from pg_catalog.pg_proc p
    join pg_catalog.pg_type ty on ty.oid = p.prorettype and ty.typtype = 'c'
    join pg_catalog.pg_attribute att on att.attrelid = ty.typrelid and att.attnum > 0 and not att.attisdropped
    where p.oid = f and p.proallargtypes is null
    order by 3;
$$;

-- lockstep.define_derived(...): register or update a derived table.
--   compute(keys parent_key_type[]) returns the desired rows of the parents in keys (NULL: all parents),
--   with columns named and typed like the target's; the target's primary key is the row identity.
--   parent / parent_column: the table whose rows own the derived rows, and the target column that
--   references it through a foreign key (inferred when there is exactly one such key). Without a parent,
--   only whole-table recomputes are possible.
-- Everything is validated before anything is written; an error changes nothing.
-- locks: the job's registry row (insert or update). Nothing a runner holds.
create function lockstep.define_derived(job text, target regclass, compute regprocedure,
                                        parent regclass default null, parent_column name default null,
                                        lock_group text default null, every interval default '1 minute',
                                        backoff interval default '1 hour')
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    p pg_catalog.pg_proc;
    old lockstep.job;
    v_key name[];
    v_cols name[];
    v_parent_key name;
    v_key_type regtype;
    v_arg regtype;
    v_col record;
    v_fks name[];
    v_err text;
begin
    perform lockstep._check_schedule(job, lock_group, every, backoff);
    if target is null or compute is null then
        raise exception 'lockstep: target and compute must not be NULL' using errcode = '22004';
    end if;
    if not exists (select from pg_catalog.pg_class c where c.oid = target and c.relkind in ('r', 'p')) then
        raise exception 'lockstep: target % is not a table', target using errcode = '42809';
    end if;
    perform lockstep._check_privileges(target, compute, parent);

    -- the target's primary key
    select array_agg(a.attname order by k.o) into v_key
    from pg_catalog.pg_constraint con,
         pg_catalog.unnest(con.conkey) with ordinality as k(n, o)
    join pg_catalog.pg_attribute a on a.attrelid = target and a.attnum = k.n
    where con.conrelid = target and con.contype = 'p';
    if v_key is null then
        raise exception 'lockstep: target % has no primary key', target
            using errcode = 'LSD01', hint = 'lockstep uses the primary key as the identity of a derived row; add one.';
    end if;

    -- the compute function: one array argument, returns a set of rows with named columns
    select * into p from pg_catalog.pg_proc where oid = compute;
    if p.prokind <> 'f' or not p.proretset or p.pronargs <> 1 then
        raise exception 'lockstep: compute function % must be a function of one array argument returning a set of rows', compute
            using errcode = 'LSD02',
                  hint = 'e.g. create function f(keys bigint[]) returns table (...) or returns setof target_table';
    end if;
    v_arg := p.proargtypes[0];
    select array_agg(c.name order by c.ord) into v_cols from lockstep._proc_columns(compute) c;
    if v_cols is null then
        raise exception 'lockstep: compute function % must return named columns (returns table (...) or setof a table type)', compute
            using errcode = 'LSD02';
    end if;

    -- parent, parent_column and the key type
    if parent is null and parent_column is not null then
        raise exception 'lockstep: parent_column % given without parent', parent_column using errcode = 'LSD04';
    end if;
    if parent is not null then
        if not exists (select from pg_catalog.pg_class c where c.oid = parent and c.relkind in ('r', 'p')) then
            raise exception 'lockstep: parent % is not a table', parent using errcode = '42809';
        end if;
        select a.attname, a.atttypid into v_parent_key, v_key_type
        from pg_catalog.pg_constraint con
        join pg_catalog.pg_attribute a on a.attrelid = con.conrelid and a.attnum = con.conkey[1]
        where con.conrelid = parent and con.contype = 'p' and cardinality(con.conkey) = 1;
        if v_parent_key is null then
            raise exception 'lockstep: parent % needs a single-column primary key', parent
                using errcode = 'LSD04', hint = 'Multi-column parent keys are not supported; use the parent''s surrogate key.';
        end if;
        select array_agg(a.attname order by a.attname) into v_fks
        from pg_catalog.pg_constraint con
        join pg_catalog.pg_attribute a on a.attrelid = con.conrelid and a.attnum = con.conkey[1]
        join pg_catalog.pg_attribute pa on pa.attrelid = con.confrelid and pa.attnum = con.confkey[1]
        where con.conrelid = target and con.confrelid = parent and con.contype = 'f'
          and cardinality(con.conkey) = 1 and pa.attname = v_parent_key;
        if parent_column is null then
            if cardinality(v_fks) is distinct from 1 then
                raise exception 'lockstep: cannot infer parent_column: % has % single-column foreign keys to %(%)',
                    target, coalesce(cardinality(v_fks), 0), parent, v_parent_key
                    using errcode = 'LSD04', hint = 'Pass parent_column => ''...'' naming a column with a foreign key to the parent.';
            end if;
            parent_column := v_fks[1];
        elsif not exists (select from pg_catalog.pg_attribute a
                          where a.attrelid = target and a.attname = parent_column and a.attnum > 0 and not a.attisdropped) then
            raise exception 'lockstep: target % has no column %', target, parent_column using errcode = 'LSD04';
        elsif not parent_column = any(coalesce(v_fks, '{}')) then
            raise exception 'lockstep: %.% does not reference %(%) through a foreign key', target, parent_column, parent, v_parent_key
                using errcode = 'LSD04',
                      hint = 'lockstep pins parents with the lock an FK check takes; add the foreign key.';
        end if;
        if not parent_column = any(v_cols) then
            raise exception 'lockstep: compute function % does not return the parent column %', compute, parent_column
                using errcode = 'LSD03';
        end if;
        if v_arg <> (select t.typarray from pg_catalog.pg_type t where t.oid = v_key_type) then
            raise exception 'lockstep: compute function % takes %, but the parent key %.% is %: it must take %[]',
                compute, v_arg, parent, v_parent_key, v_key_type, v_key_type using errcode = 'LSD02';
        end if;
    elsif not exists (select from pg_catalog.pg_type t where t.oid = v_arg and t.typcategory = 'A') then
        raise exception 'lockstep: compute function % must take an array argument (it is called with NULL: all rows)', compute
            using errcode = 'LSD02';
    end if;

    -- compute's columns against the target's
    for v_col in
        select c.name, c.type, a.atttypid, a.attgenerated, count(*) over (partition by c.name) as dup
        from lockstep._proc_columns(compute) c
        left join pg_catalog.pg_attribute a
            on a.attrelid = target and a.attname = c.name and a.attnum > 0 and not a.attisdropped
        order by c.ord
    loop
        if v_col.dup > 1 then
            raise exception 'lockstep: compute function % returns column % twice', compute, v_col.name using errcode = 'LSD03';
        elsif v_col.atttypid is null then
            raise exception 'lockstep: compute function % returns column %, which target % does not have', compute, v_col.name, target
                using errcode = 'LSD03';
        elsif v_col.atttypid <> v_col.type then
            raise exception 'lockstep: column %: compute function % returns %, target % has %', v_col.name, compute,
                v_col.type::regtype, target, v_col.atttypid::regtype using errcode = 'LSD03';
        elsif v_col.attgenerated <> '' then
            raise exception 'lockstep: column % of % is generated; compute must not return it', v_col.name, target
                using errcode = 'LSD03';
        elsif v_col.name like 'lockstep\_%' then
            raise exception 'lockstep: column names starting with lockstep_ are reserved (%)', v_col.name using errcode = 'LSD03';
        end if;
        begin
            execute pg_catalog.format('select null::%s is distinct from null::%s', v_col.type::regtype, v_col.type::regtype);
        exception when undefined_function then
            raise exception 'lockstep: column % has type %, which has no equality operator', v_col.name, v_col.type::regtype
                using errcode = 'LSD03', hint = 'lockstep compares rows with IS DISTINCT FROM; use jsonb rather than json.';
        end;
    end loop;
    select array_agg(k) into v_err from pg_catalog.unnest(v_key) k where not k = any(v_cols);
    if v_err is not null then
        raise exception 'lockstep: compute function % does not return the target''s primary-key column(s) %', compute, v_err
            using errcode = 'LSD03';
    end if;
    select pg_catalog.string_agg(a.attname, ', ') into v_err
    from pg_catalog.pg_attribute a
    where a.attrelid = target and a.attnum > 0 and not a.attisdropped and a.attnotnull and not a.atthasdef
      and a.attidentity = '' and a.attgenerated = '' and not a.attname = any(v_cols);
    if v_err is not null then
        raise exception 'lockstep: target % has NOT NULL column(s) % without default that compute function % does not return',
            target, v_err, compute using errcode = 'LSD03';
    end if;

    if parent is not null and not exists (
            select from pg_catalog.pg_index i
            where i.indrelid = target and i.indkey[0] = (select a.attnum from pg_catalog.pg_attribute a
                                                         where a.attrelid = target and a.attname = parent_column)) then
        raise warning 'lockstep: no index on %(%): every worker pass and every cascade delete will scan %',
            target, parent_column, target
            using hint = pg_catalog.format('create index on %s (%I);', target, parent_column);
    end if;

    -- a dry run on no keys: catches what only execution shows (e.g. tables the function cannot see)
    if parent is not null then
        begin
            execute pg_catalog.format('select count(*) from %s($1::%s)', compute::regproc, lockstep._array_type(v_key_type))
                using '{}'::text[];
            raise exception using errcode = 'LSDRY';  -- roll back whatever the dry run did
        exception when sqlstate 'LSDRY' then
            null;
        when others then
            get stacked diagnostics v_err = message_text;
            raise exception 'lockstep: compute function % failed on an empty key array: %', compute, v_err
                using errcode = 'LSD02',
                      hint = 'lockstep runs compute with search_path = pg_catalog, pg_temp: schema-qualify table names '
                             'or give the function its own SET search_path.';
        end;
    end if;

    select * into old from lockstep.job j where j.job = define_derived.job;
    if found then
        perform lockstep._check_owner(old);
        if old.kind <> 'derived' then
            raise exception 'lockstep: job "%" is a generic job; use lockstep.define_job() or drop it first', job
                using errcode = 'LSJ02';
        end if;
    end if;
    insert into lockstep.job as j (job, kind, lock_group, target, compute, parent, parent_column, parent_key,
                                   key_type, target_key, columns, every, backoff)
    values (job, 'derived', coalesce(lock_group, job), target, compute::text, parent, parent_column, v_parent_key,
            v_key_type, v_key, v_cols, every, backoff)
    on conflict on constraint job_pkey do update
        set lock_group = excluded.lock_group, target = excluded.target, compute = excluded.compute,
            parent = excluded.parent, parent_column = excluded.parent_column, parent_key = excluded.parent_key,
            key_type = excluded.key_type, target_key = excluded.target_key, columns = excluded.columns,
            every = excluded.every, backoff = excluded.backoff, updated_at = now();
    insert into lockstep.job_state (job) values (job) on conflict do nothing;
end;
$$;
