-- lockstep: define_derived: one named check per concern, each raising with a SQLSTATE and a hint, all
-- before anything is written; then _save_derived.

-- lockstep._proc_columns(f): the output columns (name, type) of a set-returning function.
create or replace function lockstep._proc_columns(f regprocedure)
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

-- lockstep._attnames(rel, attnums): the column names of attnums of rel, in the order given.
create or replace function lockstep._attnames(rel oid, attnums smallint[]) returns name[]
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select array(select a.attname from pg_catalog.unnest(attnums) with ordinality k(n, o)
                 join pg_catalog.pg_attribute a on a.attrelid = rel and a.attnum = k.n order by k.o);
$$;

-- lockstep._target_key(target): target is a table with a primary key; returns its columns in index order.
create or replace function lockstep._target_key(target regclass) returns name[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_key name[];
begin
    if not exists (select from pg_catalog.pg_class c where c.oid = target and c.relkind in ('r', 'p')) then
        raise exception 'lockstep: target % is not a table', target using errcode = '42809';
    end if;
    select lockstep._attnames(con.conrelid, con.conkey) into v_key
    from pg_catalog.pg_constraint con
    where con.conrelid = target and con.contype = 'p';
    if v_key is null then
        raise exception 'lockstep: target % has no primary key', target
            using errcode = 'LSD01', hint = 'lockstep uses the primary key as the identity of a derived row; add one.';
    end if;
    return v_key;
end;
$$;

-- lockstep._check_target(target, compute, parent): target is a table the caller may write, with a primary
-- key. Returns the primary-key columns, in index order.
create or replace function lockstep._check_target(target regclass, compute regprocedure, parent regclass) returns name[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if target is null or compute is null then
        raise exception 'lockstep: target and compute must not be NULL' using errcode = '22004';
    end if;
    if not exists (select from pg_catalog.pg_class c where c.oid = target and c.relkind in ('r', 'p')) then
        raise exception 'lockstep: target % is not a table', target using errcode = '42809';
    end if;
    perform lockstep._check_not_ours(target, 'the target of a job');
    perform lockstep._check_privileges(target, compute, parent);
    return lockstep._target_key(target);
end;
$$;

-- lockstep._check_target_rls(target): row-level security does not apply to the defining role on
-- target: a run would see only the rows its policies show.
create or replace function lockstep._check_target_rls(target regclass) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if pg_catalog.row_security_active(target) then
        raise exception 'lockstep: row-level security applies to % for role %: lockstep must read and write all its rows',
            target, current_user
            using errcode = '42501',
                  hint = pg_catalog.format('Define the job as the table''s owner (without FORCE ROW LEVEL SECURITY) or '
                                           'as a role with BYPASSRLS, or alter table %s no force row level security.',
                                           target);
    end if;
end;
$$;

-- lockstep._check_target_free(job, target): no other job writes target, a table below it or above it.
-- Definitions are serialized so two concurrent ones cannot both pass.
-- locks: the advisory lock (lockstep, define), until the transaction ends: concurrent definitions wait.
create or replace function lockstep._check_target_free(job text, target regclass) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_other text;
    v_table regclass;
begin
    perform pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtext('lockstep'), pg_catalog.hashtext('define'));
    with recursive up (rel, depth) as (
        select _check_target_free.target::oid, 0
        union all
        select i.inhparent, up.depth + 1 from up join pg_catalog.pg_inherits i on i.inhrelid = up.rel
        where up.depth < 100
    )
    select x.job, x.target into v_other, v_table from lockstep.job x
    where x.job <> _check_target_free.job
      and (x.target in (select up.rel from up) or x.target = any(lockstep._family(_check_target_free.target)))
    order by x.job limit 1;
    if v_other is not null then
        raise exception 'lockstep: target % is already written by job "%"%', target, v_other,
            case when v_table <> target then pg_catalog.format(' (through %s)', v_table) else '' end
            using errcode = 'LSD07',
                  hint = pg_catalog.format('One job per derived table: each would rewrite the other''s rows. '
                                           'Redefine %L, or select lockstep.drop_job(%L) first.', v_other, v_other);
    end if;
end;
$$;
comment on function lockstep._check_target_free(text, regclass) is
    'No other job writes target, a table below it or above it. Definitions are serialized so two '
    'concurrent ones cannot both pass. Locks: the advisory lock (lockstep, define), until the transaction'
    ' ends: concurrent definitions wait.';

-- lockstep._check_compute(compute): compute is a function of one array argument returning a set of rows
-- with named columns. Returns those column names, in order.
create or replace function lockstep._check_compute(compute regprocedure) returns name[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    p pg_catalog.pg_proc;
    v_cols name[];
begin
    select * into p from pg_catalog.pg_proc where oid = compute;
    if p.prokind <> 'f' or not p.proretset or p.pronargs <> 1 then
        raise exception 'lockstep: compute function % must be a function of one array argument returning a set of rows', compute
            using errcode = 'LSD02',
                  hint = 'e.g. create function f(keys bigint[]) returns table (...) or returns setof target_table';
    end if;
    select array_agg(c.name order by c.ord) into v_cols from lockstep._proc_columns(compute) c;
    if v_cols is null then
        raise exception 'lockstep: compute function % must return named columns (returns table (...) or setof a table type)', compute
            using errcode = 'LSD02';
    end if;
    return v_cols;
end;
$$;

-- lockstep._check_parent_column(target, parent, parent_key, parent_column): the column of target that
-- references parent(parent_key) through a single-column foreign key: parent_column, checked, or (NULL)
-- inferred where only one does; LSD04 otherwise, with a hint.
create or replace function lockstep._check_parent_column(target regclass, parent regclass, parent_key name,
                                              parent_column name)
returns name
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_fks name[];
    v_other text;
begin
    select array_agg(a.attname order by a.attname) into v_fks
    from pg_catalog.pg_constraint con
    join pg_catalog.pg_attribute a on a.attrelid = con.conrelid and a.attnum = con.conkey[1]
    join pg_catalog.pg_attribute pa on pa.attrelid = con.confrelid and pa.attnum = con.confkey[1]
    where con.conrelid = target and con.confrelid = parent and con.contype = 'f'
      and cardinality(con.conkey) = 1 and pa.attname = parent_key;
    if parent_column is null then
        if cardinality(v_fks) is distinct from 1 then
            raise exception 'lockstep: cannot infer parent_column: % has % single-column foreign keys to %(%)',
                target, coalesce(cardinality(v_fks), 0), parent, parent_key
                using errcode = 'LSD04', hint = 'Pass parent_column => ''...'' naming a column with a foreign key to the parent.';
        end if;
        return v_fks[1];
    elsif not exists (select from pg_catalog.pg_attribute a
                      where a.attrelid = target and a.attname = parent_column and a.attnum > 0 and not a.attisdropped) then
        raise exception 'lockstep: target % has no column %', target, parent_column using errcode = 'LSD04';
    elsif not parent_column = any(coalesce(v_fks, '{}')) then
        select pg_catalog.string_agg(pa.attname, ', ') into v_other  -- a key to another (unique) column
        from pg_catalog.pg_constraint con
        join pg_catalog.pg_attribute a on a.attrelid = con.conrelid and a.attnum = con.conkey[1]
        join pg_catalog.pg_attribute pa on pa.attrelid = con.confrelid and pa.attnum = con.confkey[1]
        where con.conrelid = target and con.confrelid = parent and con.contype = 'f'
          and cardinality(con.conkey) = 1 and a.attname = parent_column;
        if v_other is not null then
            raise exception 'lockstep: %.% references %(%), not the primary key %(%)', target, parent_column,
                parent, v_other, parent, parent_key
                using errcode = 'LSD04',
                      hint = pg_catalog.format('The parent key must be the parent''s primary key: reference %s(%I), '
                                               'or make %s the primary key.', parent, parent_key, v_other);
        end if;
        raise exception 'lockstep: %.% does not reference %(%) through a foreign key', target, parent_column, parent, parent_key
            using errcode = 'LSD04',
                  hint = 'lockstep pins parents with the lock an FK check takes; add the foreign key.';
    end if;
    return parent_column;
end;
$$;

-- lockstep._parent_key(parent): parent is a table with a one-column primary key; returns that column and
-- its type (42809, LSD04 otherwise).
create or replace function lockstep._parent_key(parent regclass, out parent_key name, out key_type regtype)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if not exists (select from pg_catalog.pg_class c where c.oid = parent and c.relkind in ('r', 'p')) then
        raise exception 'lockstep: parent % is not a table', parent using errcode = '42809';
    end if;
    select a.attname, a.atttypid into parent_key, key_type
    from pg_catalog.pg_constraint con
    join pg_catalog.pg_attribute a on a.attrelid = con.conrelid and a.attnum = con.conkey[1]
    where con.conrelid = parent and con.contype = 'p' and cardinality(con.conkey) = 1;
    if parent_key is null then
        raise exception 'lockstep: parent % needs a single-column primary key', parent
            using errcode = 'LSD04', hint = 'For a primary key of several columns pass parent_columns => array[...]::name[].';
    end if;
end;
$$;

-- lockstep._check_parent(target, compute, cols, parent, parent_column): parent has a one-column primary key
-- that parent_column (inferred if unique) references; compute returns it and takes the key type's array.
create or replace function lockstep._check_parent(target regclass, compute regprocedure, cols name[], parent regclass,
                                       inout parent_column name, out parent_key name, out key_type regtype)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_arg oid := (select p.proargtypes[0] from pg_catalog.pg_proc p where p.oid = compute);
begin
    if parent is null and parent_column is not null then
        raise exception 'lockstep: parent_column % given without parent', parent_column using errcode = 'LSD04';
    end if;
    if parent is null then
        if not exists (select from pg_catalog.pg_type t where t.oid = v_arg and t.typcategory = 'A') then
            raise exception 'lockstep: compute function % must take an array argument (it is called with NULL: all rows)', compute
                using errcode = 'LSD02';
        end if;
        return;
    end if;
    select k.parent_key, k.key_type into parent_key, key_type from lockstep._parent_key(parent) k;
    parent_column := lockstep._check_parent_column(target, parent, parent_key, parent_column);
    if not parent_column = any(cols) then
        raise exception 'lockstep: compute function % does not return the parent column %', compute, parent_column
            using errcode = 'LSD03';
    end if;
    -- an array of the key's type, or of one every key converts to without loss (binary-coercible, wider integer)
    if not exists (select from pg_catalog.pg_type t
                   where t.oid = v_arg and t.typcategory = 'A' and t.typelem <> 0
                     and (t.typelem = key_type
                          or exists (select from pg_catalog.pg_cast c
                                     where c.castsource = key_type and c.casttarget = t.typelem
                                       and c.castcontext = 'i' and c.castmethod = 'b')
                          or (key_type::text, t.typelem::regtype::text)
                             in (('smallint', 'integer'), ('smallint', 'bigint'), ('integer', 'bigint')))) then
        raise exception 'lockstep: compute function % takes %, but the parent key %.% is %: it must take %[] '
                        '(or an array of a type every key converts to without loss: binary-coercible, or a wider '
                        'integer)', compute, v_arg::regtype, parent, parent_key, key_type, key_type
            using errcode = 'LSD02';
    end if;
end;
$$;

-- lockstep._parent_fks(target, parent, pk): for each foreign key of target to parent on exactly the
-- columns pk (in any order), the target's columns that reference them, in pk's order.
create or replace function lockstep._parent_fks(target regclass, parent regclass, pk name[]) returns setof name[]
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select array(select a.attname from pg_catalog.unnest(pk) with ordinality p(n, o)
                 join pg_catalog.pg_attribute pa on pa.attrelid = con.confrelid and pa.attname = p.n
                 join unnest(con.conkey, con.confkey) k(f, r) on k.r = pa.attnum  -- ROWS FROM: not qualified
                 join pg_catalog.pg_attribute a on a.attrelid = con.conrelid and a.attnum = k.f
                 order by p.o)
    from pg_catalog.pg_constraint con
    where con.conrelid = target and con.confrelid = parent and con.contype = 'f'
      and pg_catalog.cardinality(con.confkey) = pg_catalog.cardinality(pk)
      and lockstep._attnames(con.confrelid, con.confkey) @> pk and lockstep._attnames(con.confrelid, con.confkey) <@ pk
    order by con.conname;
$$;

-- lockstep._check_key_composite(compute, parent, pk): compute takes an array of a composite type whose
-- fields have the types and collations of parent's key columns pk, in order, and which
-- lockstep._key_type_problem allows; returns that type. LSD02 (with the CREATE TYPE to write) or LSD04.
create or replace function lockstep._check_key_composite(compute regprocedure, parent regclass, pk name[])
returns regtype
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_elem regtype := (select y.typelem from pg_catalog.pg_proc p join pg_catalog.pg_type y on y.oid = p.proargtypes[0]
                       where p.oid = compute and y.typcategory = 'A' and y.typelem <> 0);
    v_want text[];
    v_have text[];
    v_fields text;
begin
    select array_agg(pg_catalog.concat_ws(' ', a.atttypid, a.attcollation) order by k.o),
           pg_catalog.string_agg(pg_catalog.format('%I %s%s', a.attname, pg_catalog.format_type(a.atttypid, null),
                                 case when a.attcollation not in (0, 100)
                                      then pg_catalog.format(' collate %s', a.attcollation::regcollation) else '' end),
                                 ', ' order by k.o)
    into v_want, v_fields
    from pg_catalog.unnest(pk) with ordinality k(n, o)
    join pg_catalog.pg_attribute a on a.attrelid = parent and a.attname = k.n;
    select array_agg(pg_catalog.concat_ws(' ', a.atttypid, a.attcollation) order by a.attnum) into v_have
    from pg_catalog.pg_type y join pg_catalog.pg_attribute a on a.attrelid = y.typrelid and a.attnum > 0
    where y.oid = v_elem and y.typtype = 'c' and not a.attisdropped;
    if v_have is distinct from v_want then
        raise exception 'lockstep: compute function % takes %, but the primary key of % is (%): it must take an array '
                        'of a composite type whose fields have those types, in that order', compute,
                        coalesce((select p.proargtypes[0]::regtype::text from pg_catalog.pg_proc p where p.oid = compute), '?'),
                        parent, v_fields
            using errcode = 'LSD02',
                  hint = pg_catalog.format('create type %I as (%s); and create function ...(keys %I[]) returns ...',
                                           (select c.relname || '_key' from pg_catalog.pg_class c where c.oid = parent),
                                           v_fields, (select c.relname || '_key' from pg_catalog.pg_class c where c.oid = parent));
    end if;
    perform lockstep._check_key_type_safe(null, v_elem);  -- LSD04: a table's row type, a cast, a field type
    return v_elem;
end;
$$;

-- lockstep._check_parent_keys(target, compute, cols, parent, parent_columns): a parent keyed by several
-- columns. parent_columns (inferred where one foreign key of target covers the parent's primary key) are
-- target columns referencing that key through one foreign key, column for column in the key's order;
-- compute returns them and takes the key type's array (lockstep._check_key_composite). LSD04 otherwise.
create or replace function lockstep._check_parent_keys(target regclass, compute regprocedure, cols name[],
                                            parent regclass, inout parent_columns name[], out parent_keys name[],
                                            out key_type regtype)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_n bigint;
    v_missing name;
    v_order name[];
begin
    select lockstep._attnames(con.conrelid, con.conkey) into parent_keys
    from pg_catalog.pg_constraint con where con.conrelid = parent and con.contype = 'p';
    if parent_keys is null then
        raise exception 'lockstep: parent % has no primary key', parent using errcode = 'LSD04';
    end if;
    if parent_columns is null then
        select count(*) into v_n from lockstep._parent_fks(target, parent, parent_keys) f;
        if v_n <> 1 then
            raise exception 'lockstep: cannot infer parent_columns: % has % foreign keys to %(%)', target, v_n, parent,
                lockstep._cols(parent_keys)
                using errcode = 'LSD04', hint = pg_catalog.format('Pass parent_columns => array[...]::name[] naming the '
                                                                  'columns of %s that reference %s(%s), in that order.',
                                                                  target, parent, lockstep._cols(parent_keys));
        end if;
        parent_columns := (select f from lockstep._parent_fks(target, parent, parent_keys) f);
    end if;
    select c into v_missing from pg_catalog.unnest(parent_columns) c
    where c is null or not exists (select from pg_catalog.pg_attribute a
                                   where a.attrelid = target and a.attname = c and a.attnum > 0 and not a.attisdropped)
    limit 1;
    if cardinality(parent_columns) <> cardinality(parent_keys) or v_missing is not null
       or array_position(parent_columns, null) is not null then
        raise exception 'lockstep: parent_columns (%) must name % column(s) of % referencing %(%), in that order%',
            pg_catalog.array_to_string(parent_columns, ', ', 'NULL'), cardinality(parent_keys), target, parent,
            lockstep._cols(parent_keys), case when v_missing is not null
                                                then pg_catalog.format(' (%s has no column %I)', target, v_missing)
                                                else '' end
            using errcode = 'LSD04';
    end if;
    if not exists (select from lockstep._parent_fks(target, parent, parent_keys) f where f = parent_columns) then
        -- the same columns in another order: the key's order is asked for, not another foreign key
        v_order := (select f from lockstep._parent_fks(target, parent, parent_keys) f
                    where f @> parent_columns and f <@ parent_columns limit 1);
        raise exception 'lockstep: %(%) does not reference %(%) through a foreign key, column for column', target,
            lockstep._cols(parent_columns), parent, lockstep._cols(parent_keys)
            using errcode = 'LSD04',
                  hint = coalesce(case when v_order is not null then pg_catalog.format('Name them in the order of %s''s primary key: parent_columns => '
                                                    'array[%s]::name[]', parent, (select pg_catalog.string_agg(
                                                        pg_catalog.quote_literal(c), ', ') from pg_catalog.unnest(v_order) c)) end,
                                  pg_catalog.format('lockstep pins parents with the lock an FK check takes: alter table %s add '
                                                    'foreign key (%s) references %s (%s) on delete cascade;', target,
                                                    lockstep._cols(parent_columns), parent, lockstep._cols(parent_keys)));
    end if;
    select c into v_missing from pg_catalog.unnest(parent_columns) c where not c = any(cols) limit 1;
    if v_missing is not null then
        raise exception 'lockstep: compute function % does not return the parent column %', compute, v_missing
            using errcode = 'LSD03';
    end if;
    key_type := lockstep._check_key_composite(compute, parent, parent_keys);
end;
$$;

-- lockstep._check_parents(target, compute, cols, parent, parent_column, parent_columns): the parent key of
-- a definition: of several columns where parent_columns names more than one or the parent's primary key
-- has more (lockstep._check_parent_keys), else of one (lockstep._check_parent). Both arrays are set for
-- every parent; parent_column and parent_key only for a one-column key (LSD04 for a parent_column given
-- with a parent keyed by several columns).
create or replace function lockstep._check_parents(target regclass, compute regprocedure, cols name[],
                                        parent regclass, inout parent_column name, inout parent_columns name[],
                                        out parent_key name, out parent_keys name[], out key_type regtype)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if parent_column is not null and parent_columns is not null then
        raise exception 'lockstep: parent_column and parent_columns given together' using errcode = 'LSD04',
            hint = 'Pass parent_columns => array[...]::name[] alone (parent_column is its one-column form).';
    elsif cardinality(parent_columns) = 0 then
        raise exception 'lockstep: parent_columns is empty' using errcode = 'LSD04',
            hint = 'Name the target''s columns that reference the parent''s primary key, in its order.';
    elsif parent_columns is not null and parent is null then
        raise exception 'lockstep: parent_columns given without parent' using errcode = 'LSD04';
    end if;
    if parent is not null
       and (cardinality(parent_columns) > 1
            or (select cardinality(con.conkey) > 1 from pg_catalog.pg_constraint con
                where con.conrelid = parent and con.contype = 'p')) then
        if not exists (select from pg_catalog.pg_class c where c.oid = parent and c.relkind in ('r', 'p')) then
            raise exception 'lockstep: parent % is not a table', parent using errcode = '42809';
        elsif parent_column is not null then
            raise exception 'lockstep: parent % has a primary key of several columns: parent_column % names one',
                parent, parent_column
                using errcode = 'LSD04',
                      hint = 'Pass parent_columns => array[...]::name[], the target''s columns that reference the '
                             'parent''s primary key, in its order; or neither, to infer them.';
        end if;
        select k.parent_columns, k.parent_keys, k.key_type into parent_columns, parent_keys, key_type
        from lockstep._check_parent_keys(target, compute, cols, parent, parent_columns) k;
        return;
    end if;
    select c.parent_column, c.parent_key, c.key_type into parent_column, parent_key, key_type
    from lockstep._check_parent(target, compute, cols, parent, coalesce(parent_column, parent_columns[1])) c;
    if parent is not null then
        parent_columns := array[parent_column];
        parent_keys := array[parent_key];
    end if;
end;
$$;

-- lockstep._image_columns(target, cols): the columns among cols whose type's equality does not imply
-- identical values (no equalimage saying so for the column's collation): compared by binary image.
create or replace function lockstep._image_columns(target regclass, cols name[]) returns name[]
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    c record;
    v_proc regproc;
    v_same boolean;
    v_out name[] := '{}';
begin
    for c in
        select a.attname, a.attcollation,
               (with recursive b(t, base) as (
                    select y.oid, y.typbasetype from pg_catalog.pg_type y where y.oid = a.atttypid
                    union all
                    select y.oid, y.typbasetype from b join pg_catalog.pg_type y on y.oid = b.base where b.base <> 0)
                select b.t from b where b.base = 0) as base
        from pg_catalog.unnest(cols) with ordinality x(name, o)
        join pg_catalog.pg_attribute a on a.attrelid = target and a.attname = x.name and a.attnum > 0
        order by x.o
    loop
        -- the default btree class as PostgreSQL picks it (GetDefaultOpClass), then its equalimage function
        select p.amproc into v_proc
        from (select oc.opcfamily, oc.opcintype
              from pg_catalog.pg_opclass oc
              join pg_catalog.pg_am am on am.oid = oc.opcmethod and am.amname = 'btree'
              where oc.opcdefault
                and (oc.opcintype = c.base
                     or exists (select from pg_catalog.pg_cast k
                                where k.castsource = c.base and k.casttarget = oc.opcintype and k.castmethod = 'b'))
              order by oc.opcintype = c.base desc
              limit 1) oc
        left join pg_catalog.pg_amproc p on p.amprocfamily = oc.opcfamily and p.amproclefttype = oc.opcintype
                                        and p.amprocrighttype = oc.opcintype and p.amprocnum = 4;
        -- btequalimage says yes; btvarstrequalimage yes for a deterministic collation
        v_same := v_proc = 'pg_catalog.btequalimage'::regproc
                  or (v_proc = 'pg_catalog.btvarstrequalimage'::regproc
                      and coalesce((select l.collisdeterministic from pg_catalog.pg_collation l
                                    where l.oid = c.attcollation), true));
        if not coalesce(v_same, false) then
            v_out := v_out || c.attname;
        end if;
    end loop;
    return v_out;
end;
$$;

-- lockstep._has_equality(t): IS DISTINCT FROM between two values of type t resolves under lockstep's
-- search_path: pg_catalog has an = for t's base type (a domain's), for a type it casts to implicitly
-- (citext -> text), or for its family (arrays, enums, ranges, multiranges, composites). Read from the
-- catalogs, never by evaluating an expression of type t: a cast to a domain runs its CHECK, the owner's
-- code, with the caller's rights (lockstep._drift runs this as a runner or an admin).
create or replace function lockstep._has_equality(t regtype) returns boolean
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    with recursive d(oid) as (
        select t::oid
        union
        select y.typbasetype from d join pg_catalog.pg_type y on y.oid = d.oid where y.typtype = 'd'),
    base as (select y.oid, y.typtype, y.typsubscript from d join pg_catalog.pg_type y on y.oid = d.oid
             where y.typtype <> 'd'),
    cand(oid) as (
        select base.oid from base
        union all
        select c.casttarget from base join pg_catalog.pg_cast c on c.castsource = base.oid and c.castcontext = 'i'
        union all
        select 'pg_catalog.anyarray'::pg_catalog.regtype from base
        where base.typsubscript = 'pg_catalog.array_subscript_handler'::pg_catalog.regproc
        union all
        select 'pg_catalog.anyenum'::pg_catalog.regtype from base where base.typtype = 'e'
        union all
        select 'pg_catalog.anyrange'::pg_catalog.regtype from base where base.typtype = 'r'
        union all
        select 'pg_catalog.anymultirange'::pg_catalog.regtype from base where base.typtype = 'm'
        union all
        select 'pg_catalog.record'::pg_catalog.regtype from base where base.typtype = 'c')
    select exists (select from cand join pg_catalog.pg_operator o
                   on o.oprname = '=' and o.oprnamespace = 'pg_catalog'::pg_catalog.regnamespace
                  and o.oprleft = cand.oid and o.oprright = cand.oid);
$$;

-- lockstep._check_columns(target, compute, key, cols): every column compute returns exists in the target
-- with the same type, once, is writable and comparable; the primary key and every NOT NULL column without
-- a default are among them. The errors name the query, not the function, of a job defined by a query.
create or replace function lockstep._check_columns(target regclass, compute regprocedure, key name[], cols name[])
returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_col record;
    v_err text;
    v_what text := case when pg_catalog.obj_description(compute, 'pg_proc')
                             = 'lockstep: compute of a job defined by a query' then 'the query'
                        else pg_catalog.format('compute function %s', compute) end;
begin
    for v_col in
        select c.name, c.type, a.atttypid, a.attgenerated, a.attidentity, count(*) over (partition by c.name) as dup
        from lockstep._proc_columns(compute) c
        left join pg_catalog.pg_attribute a
            on a.attrelid = target and a.attname = c.name and a.attnum > 0 and not a.attisdropped
        order by c.ord
    loop
        if v_col.dup > 1 then
            raise exception 'lockstep: % returns column % twice', v_what, v_col.name using errcode = 'LSD03';
        elsif v_col.atttypid is null then
            raise exception 'lockstep: % returns column %, which target % does not have', v_what, v_col.name, target
                using errcode = 'LSD03',
                      hint = 'Name each result column as the target column it fills, or add the column to the target.';
        elsif v_col.atttypid <> v_col.type then
            raise exception 'lockstep: column %: % returns %, target % has %', v_col.name, v_what,
                v_col.type::regtype, target, v_col.atttypid::regtype
                using errcode = 'LSD03',
                      hint = pg_catalog.format('Cast it: (<expression>)::%s as %I; or change the type of %I in '
                                               'the target.', v_col.atttypid::regtype, v_col.name, v_col.name);
        elsif v_col.attgenerated <> '' then
            raise exception 'lockstep: column % of % is generated; compute must not return it', v_col.name, target
                using errcode = 'LSD03';
        elsif v_col.attidentity = 'a' then  -- every insert of a value for it fails (428C9)
            raise exception 'lockstep: column % of % is GENERATED ALWAYS AS IDENTITY; compute must not return it',
                v_col.name, target
                using errcode = 'LSD03',
                      hint = 'Leave it out of compute''s result, or declare it GENERATED BY DEFAULT AS IDENTITY.';
        elsif v_col.name like 'lockstep\_%' then
            raise exception 'lockstep: column names starting with lockstep_ are reserved (%)', v_col.name using errcode = 'LSD03';
        end if;
        if not lockstep._has_equality(v_col.type) then
            raise exception 'lockstep: column % has type %, which has no equality operator', v_col.name, v_col.type::regtype
                using errcode = 'LSD03',
                      hint = 'lockstep compares each column with its type''s equality; use a type that has one '
                             '(jsonb rather than json, text rather than xml).';
        end if;
    end loop;
    select array_agg(k) into v_err from pg_catalog.unnest(key) k where not k = any(cols);
    if v_err is not null then
        raise exception 'lockstep: % does not return the target''s primary-key column(s) %', v_what, v_err
            using errcode = 'LSD03';
    end if;
    select pg_catalog.string_agg(a.attname, ', ') into v_err
    from pg_catalog.pg_attribute a
    where a.attrelid = target and a.attnum > 0 and not a.attisdropped and a.attnotnull and not a.atthasdef
      and a.attidentity = '' and a.attgenerated = '' and not a.attname = any(cols);
    if v_err is not null then
        raise exception 'lockstep: target % has NOT NULL column(s) % without default that % does not return',
            target, v_err, v_what using errcode = 'LSD03';
    end if;
end;
$$;

-- lockstep._check_target_fks(target, cols): every FK column compute does not return is always NULL in
-- inserted rows (so _pin_refs pins every key an FK check looks up); no FK references the target itself.
create or replace function lockstep._check_target_fks(target regclass, cols name[]) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    c record;
begin
    select con.conname into c from pg_catalog.pg_constraint con
    where con.conrelid = target and con.confrelid = target and con.contype = 'f' and con.conparentid = 0
    order by con.conname limit 1;
    if found then
        raise exception 'lockstep: target % references itself (foreign key %)', target, c.conname
            using errcode = 'LSD06',
                  hint = 'lockstep pins referenced rows before it inserts, and a row inserted in the same pass is not '
                         'there yet; keep such links in another table.';
    end if;
    for c in
        select con.conname, con.confrelid::regclass as ref, a.attname
        from pg_catalog.pg_constraint con
        join pg_catalog.pg_attribute a on a.attrelid = con.conrelid and a.attnum = any(con.conkey)
        join pg_catalog.pg_type t on t.oid = a.atttypid
        where con.conrelid = target and con.contype = 'f' and con.conparentid = 0
          and not a.attname = any(cols)
          and (a.atthasdef or a.attgenerated <> '' or a.attidentity <> '' or t.typdefaultbin is not null)
        order by con.conname, a.attnum
        limit 1
    loop
        raise exception 'lockstep: column % of % (foreign key % to %) gets a value compute does not return',
            c.attname, target, c.conname, c.ref
            using errcode = 'LSD06',
                  hint = pg_catalog.format('lockstep pins the rows an insert references before it writes, and can only '
                                           'pin values it has: return %I from the compute function (or drop its default).',
                                           c.attname);
    end loop;
end;
$$;

-- lockstep._check_parent_delete(target, parent): refuse a parent FK whose ON DELETE action would fail the
-- application's deletes; warn for SET NULL / SET DEFAULT and NO ACTION / RESTRICT on other keys or ON UPDATE.
create or replace function lockstep._check_parent_delete(target regclass, parent regclass) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    c record;
begin
    for c in
        select con.conname, con.confdeltype, coalesce(con.confrelid = parent, false) as is_parent, con.confrelid::regclass as ref,
               lockstep._attnames(con.conrelid, con.conkey) as cols,
               exists (select from pg_catalog.pg_attribute a
                       where a.attrelid = con.conrelid and a.attnum = any(coalesce(con.confdelsetcols, con.conkey))
                         and a.attnotnull and (con.confdeltype = 'n' or not a.atthasdef)) as cannot
        from pg_catalog.pg_constraint con
        where con.conrelid = target and con.contype = 'f' and con.conparentid = 0 and con.confdeltype <> 'c'
        order by con.conname
    loop
        if not c.is_parent then
            if c.confdeltype in ('a', 'r') then
                raise warning 'lockstep: foreign key % of % to % is ON DELETE %: an application delete of a row of % '
                              'fails while derived rows still reference it', c.conname, target, c.ref,
                              case c.confdeltype when 'a' then 'NO ACTION' else 'RESTRICT' end, c.ref;
            end if;
        elsif c.confdeltype in ('a', 'r') or c.cannot then
            raise exception 'lockstep: foreign key % of %(%) to % is ON DELETE %: once lockstep writes derived rows, '
                            'the application''s deletes of their parents fail', c.conname, target, c.cols, parent,
                    case c.confdeltype when 'a' then 'NO ACTION' when 'r' then 'RESTRICT'
                                       when 'n' then 'SET NULL (on a NOT NULL column)'
                                       else 'SET DEFAULT (on a NOT NULL column without default)' end
                using errcode = 'LSD04',
                      hint = pg_catalog.format('alter table %s drop constraint %I, add foreign key (%s) references %s on delete cascade;',
                                               target, c.conname, lockstep._cols(c.cols), parent);
        else
            raise warning 'lockstep: foreign key % of %(%) to % is ON DELETE %: an application delete of a parent keeps '
                          'its derived rows (%), and lockstep removes them only at the next recompute', c.conname, target,
                          c.cols, parent, case c.confdeltype when 'n' then 'SET NULL' else 'SET DEFAULT' end,
                          case c.confdeltype when 'n' then 'their parent column set to NULL' else 'moved to the default parent' end
                using hint = 'ON DELETE CASCADE deletes them with the parent.';
        end if;
    end loop;
    -- the parent key's ON UPDATE NO ACTION / RESTRICT fails an update of the key while derived rows exist: warn
    for c in
        select con.conname, lockstep._attnames(con.conrelid, con.conkey) as cols
        from pg_catalog.pg_constraint con
        where con.conrelid = target and con.contype = 'f' and con.conparentid = 0 and con.confrelid = parent
          and con.confupdtype in ('a', 'r')
        order by con.conname
    loop
        raise warning 'lockstep: foreign key % of %(%) to % is ON UPDATE NO ACTION / RESTRICT: an application update '
                      'of a parent''s key fails while derived rows reference it', c.conname, target, c.cols, parent
            using hint = 'ON UPDATE CASCADE moves the derived rows with their parent''s key.';
    end loop;
end;
$$;

-- lockstep._warn_index(target, parent_column): a warning when no index starts with parent_column.
create or replace function lockstep._warn_index(target regclass, parent_column name) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    perform lockstep._warn_index_keys(target, array[parent_column]);
end;
$$;

-- lockstep._warn_index_keys(target, cols): a warning when no index starts with the columns cols (in any
-- order); nothing for NULL.
create or replace function lockstep._warn_index_keys(target regclass, cols name[]) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if cols is not null and array_position(cols, null) is null and not exists (
            select from pg_catalog.pg_index i
            where i.indrelid = target and i.indnkeyatts >= cardinality(cols)
              and (select array_agg(a.attname) from pg_catalog.pg_attribute a
                   where a.attrelid = target and a.attnum = any((i.indkey::smallint[])[0:cardinality(cols) - 1]))
                  @> cols) then
        raise warning 'lockstep: no index on %(%): every worker pass and every cascade delete will scan %',
            target, lockstep._cols(cols), target
            using hint = pg_catalog.format('create index on %s (%s);', target, lockstep._cols(cols));
    end if;
end;
$$;

-- lockstep._warn_unique(target, parent): a warning for each non-deferrable unique index besides the primary
-- key: values that move between rows in one pass fail with 23505.
create or replace function lockstep._warn_unique(target regclass, parent regclass) returns void
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    c record;
begin
    for c in
        select i.indexrelid::regclass as idx, pg_catalog.pg_get_indexdef(i.indexrelid) as def
        from pg_catalog.pg_index i
        where i.indrelid = target and i.indisunique and not i.indisprimary and i.indimmediate
        order by 1
    loop
        raise warning 'lockstep: unique index % on % besides its primary key: %', c.idx, target,
            case when parent is null then 'values that move between rows (a swap) fail the recompute with 23505 at '
                                          'every try'
                 else 'rows whose values move between parents (a swap) fail with 23505 at every try and their '
                      'parents are parked' end
            using detail = c.def,
                  hint = 'Drop it if compute guarantees it, or make it a DEFERRABLE unique constraint (checked at '
                         'the end of each statement: a swap within one pass then works).';
    end loop;
end;
$$;

-- lockstep._dry_run(compute, key_type): run compute on no keys, then roll it back: catches what only
-- execution shows (e.g. tables the function cannot see with lockstep's search_path).
-- locks: whatever compute locks, released by the rollback of the subtransaction.
create or replace function lockstep._dry_run(compute regprocedure, key_type regtype) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_err text;
    v_state text;
begin
    if key_type is null then
        return;
    end if;
    execute pg_catalog.format('select count(*) from %s($1::%s)', lockstep._callable(compute, 1),
                              lockstep._array_type(key_type))
        using '{}'::text[];
    raise exception using errcode = 'LSDRY';  -- roll back whatever the dry run did
exception when sqlstate 'LSDRY' then
    null;
when others then
    get stacked diagnostics v_err = message_text, v_state = returned_sqlstate;
    raise exception 'lockstep: compute function % failed on an empty key array: %', compute, v_err
        using errcode = 'LSD02',
              hint = case when v_state like '42%'  -- an unknown table, function, operator...: the path
                          then 'lockstep runs compute with search_path = pg_catalog, pg_temp: schema-qualify '
                               'table names or give the function its own SET search_path (or, if what it '
                               'names is really gone, create it again).'
                          else 'compute must return no rows, without error, for an empty key array.' end;
end;
$$;
comment on function lockstep._dry_run(regprocedure, regtype) is
    'Run compute on no keys, then roll it back: catches what only execution shows (e.g. tables the '
    'function cannot see with lockstep''s search_path). Locks: whatever compute locks, released by the '
    'rollback of the subtransaction.';

-- lockstep.define_derived(...): register or update a derived table: compute(keys) returns the rows of the
-- parents in keys (NULL: all) in the target's shape; without a parent, only whole-table recomputes. A
-- redefinition drops what lockstep wrote for a query of the old one and no longer uses
-- (lockstep._drop_query_objects).
-- locks: the advisory lock (lockstep, define), until the transaction ends (lockstep._check_target_free);
-- then the job's registry row (insert or update).
create or replace function lockstep.define_derived(job text, target regclass, compute regprocedure default null,
                                        parent regclass default null, parent_column name default null,
                                        lock_group text default null, every interval default '1 minute',
                                        backoff interval default '1 hour', query text default null,
                                        query_search_path text default pg_catalog.current_setting('search_path'),
                                        timeout interval default '5 minutes', parent_columns name[] default null)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_key name[];
    v_cols name[];
    v_par record;
    v_old lockstep.job;  -- the definition being replaced, read once every check has passed
begin
    if (compute is null) = (query is null) then
        raise exception 'lockstep: compute and query must not be NULL together, nor given together: pass one' using errcode = '22004',
            hint = 'compute => a function of the parent keys, or query => ''select ...'' returning the target''s columns.';
    elsif query is not null then
        compute := lockstep._query_compute(job, target, pg_catalog.rtrim(pg_catalog.btrim(query), ';'), parent,
                                           parent_column, query_search_path, parent_columns);
    end if;
    perform lockstep._check_schedule(job, lock_group, every, backoff);
    perform lockstep._check_timeout(timeout);
    v_key := lockstep._check_target(target, compute, parent);
    perform lockstep._check_target_rls(target);
    v_cols := lockstep._check_compute(compute);
    select * into v_par from lockstep._check_parents(target, compute, v_cols, parent, parent_column, parent_columns);
    perform lockstep._check_columns(target, compute, v_key, v_cols);
    perform lockstep._check_target_fks(target, v_cols);
    perform lockstep._check_referencing(target, v_key, v_cols);
    -- a taken table: LSD07 before the dry run; every refusal before any warning
    perform lockstep._check_target_free(job, target);
    perform lockstep._callable(compute, 1);
    perform lockstep._dry_run(compute, v_par.key_type);
    perform lockstep._check_watchers(job, parent, v_par.key_type);
    perform lockstep._check_cycle(job, target, null);  -- LSD09 (10_graph.sql)
    perform lockstep._check_parent_delete(target, parent);  -- LSD04 refusals, then warnings
    perform lockstep._warn_index_keys(target, v_par.parent_columns);
    perform lockstep._warn_unique(target, parent);
    v_old := (select x from lockstep.job x where x.job = define_derived.job);
    perform lockstep._save_derived(job, target, compute, parent, v_par.parent_column, v_par.parent_key,
                                   v_par.key_type, v_key, v_cols, lock_group, every, backoff);
    perform lockstep._save_parent_keys(job, v_par.parent_columns, v_par.parent_keys);
    perform lockstep._update_job(job, timeout => timeout);  -- security definer
    perform lockstep._drop_query_objects(v_old.compute, v_old.key_type);  -- what lockstep wrote for it before
end;
$$;
comment on function lockstep.define_derived(text, regclass, regprocedure, regclass, name, text, interval, interval,
                                           text, text, interval, name[]) is
    'Register or update a derived table: compute(keys) returns the rows of the parents in keys (NULL: '
    'all) in the target''s shape, or query returns them and lockstep writes that function; without a parent, '
    'only whole-table recomputes; LSD09 if it would close a cycle of derived jobs. timeout: the longest a run '
    'may take (the runner''s statement_timeout for it, lockstep.set_time_limit). parent_columns: the '
    'target''s columns referencing a parent key of several columns, in its order (compute then takes an '
    'array of a composite type of those columns). A redefinition drops the function and key type lockstep '
    'wrote for a query of the old one and no longer uses. Locks: the advisory '
    'lock (lockstep, define) until the transaction ends, then the job''s registry row (insert or update).';

-- lockstep._drift(j): for a failed run of a derived job, what no longer holds of its definition; NULL if
-- all holds or the caller may not look.
create or replace function lockstep._drift(j lockstep.job) returns text
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
declare
    v_fn regprocedure;
    v_key name[];
    v_cols name[];
    v_par record;
    v_fix text := 'fix it, or run lockstep.define_derived again';
begin
    if j.kind <> 'derived' or j.target is null then
        return null;
    end if;
    begin
        v_fn := j.compute::regprocedure;
        v_key := lockstep._target_key(j.target);  -- not _check_target: a runner has no privilege on the target
        v_cols := lockstep._check_compute(v_fn);
        if j.parent is not null then
            select * into v_par from lockstep._check_parents(j.target, v_fn, v_cols, j.parent, j.parent_column,
                                                             case when j.parent_column is null then j.parent_columns end);
        end if;
        perform lockstep._check_columns(j.target, v_fn, v_key, v_cols);
    exception
        when insufficient_privilege then  -- a runner of the recipe may not even name the compute: no claim
            return null;
        when others then
            return pg_catalog.format('the job''s definition no longer holds: %s; %s', sqlerrm, v_fix);
    end;
    if not (v_key @> j.target_key and v_key <@ j.target_key) then  -- as sets: the index order may differ
        return pg_catalog.format('the primary key of %s is now (%s), not (%s) as at define_derived; %s', j.target,
                                 pg_catalog.array_to_string(v_key, ', '), pg_catalog.array_to_string(j.target_key, ', '), v_fix);
    end if;
    if not (v_cols @> j.columns and v_cols <@ j.columns) then
        return pg_catalog.format('compute now returns (%s), not (%s) as at define_derived; %s',
                                 pg_catalog.array_to_string(v_cols, ', '), pg_catalog.array_to_string(j.columns, ', '), v_fix);
    end if;
    if j.parent is null then
        return null;
    end if;
    if (v_par.parent_keys, v_par.key_type) is distinct from (coalesce(j.parent_keys, array[j.parent_key]), j.key_type) then
        return pg_catalog.format('the parent key of %s is now %s (%s), not %s (%s) as at define_derived; %s', j.parent,
                                 pg_catalog.array_to_string(v_par.parent_keys, ', '), v_par.key_type,
                                 pg_catalog.array_to_string(coalesce(j.parent_keys, array[j.parent_key]), ', '),
                                 j.key_type, v_fix);
    end if;
    return null;
end;
$$;

-- lockstep._save_derived(...): write a derived job's registry and status rows (define_derived, last).
-- locks: the job's registry row (insert or update) and its status row (insert, or update on a redefinition);
-- with another parent key type, the job's queue and key_failure rows (deleted).
create or replace function lockstep._save_derived(job text, target regclass, compute regprocedure, parent regclass,
                                       parent_column name, parent_key name, key_type regtype, target_key name[],
                                       columns name[], lock_group text, every interval, backoff interval)
returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    old lockstep.job;
    v_new lockstep.job;
begin
    select * into old from lockstep.job j where j.job = _save_derived.job;
    if found then
        perform lockstep._check_owner(old);
        if old.kind <> 'derived' then
            raise exception 'lockstep: job "%" is a generic job; use lockstep.define_job() or drop it first', job
                using errcode = 'LSJ02';
        end if;
    end if;
    v_new.job := job;
    v_new.kind := 'derived';
    v_new.owner := current_user;
    v_new.lock_group := coalesce(lock_group, job);
    v_new.target := target;
    v_new.compute := compute::text;
    v_new.parent := parent;
    v_new.parent_column := parent_column;
    v_new.parent_key := parent_key;
    v_new.key_type := key_type;
    v_new.target_key := target_key;
    v_new.columns := columns;
    -- the primary key is matched by its own equality, never by image
    v_new.image_columns := lockstep._image_columns(target, array(select c from pg_catalog.unnest(columns) c
                                                                 where c <> all(target_key)));
    v_new.every := every;
    v_new.backoff := backoff;
    -- a redefinition whose rows may differ makes the recompute due now; a new every counts from the last run
    perform lockstep._put_job(v_new);  -- security definer: the registry and status rows
    -- another parent key type: the queued keys and their failures name old parents; the due recompute covers all
    if old.job is not null and old.key_type is distinct from key_type then
        perform lockstep._delete('queue', _save_derived.job);
        perform lockstep._delete('key_failure', _save_derived.job);
    end if;
end;
$$;
comment on function lockstep._save_derived(text, regclass, regprocedure, regclass, name, name, regtype, name[], name[], text, interval, interval) is
    'Write a derived job''s registry and status rows (define_derived, last). Locks: the job''s registry '
    'row (insert or update) and its status row (insert, or update on a redefinition); with another parent'
    ' key type, the job''s queue and key_failure rows (deleted).';

-- lockstep._save_parent_keys(job, parent_columns, parent_keys): record a derived job's parent key columns
-- (define_derived, after lockstep._save_derived); other columns than before make its recompute due now.
-- For a caller that may write the job (lockstep._check_manages, lockstep._check_may_own: 42501).
-- Security definer: the owner recipe holds no UPDATE on lockstep's tables.
-- locks: the job's registry row and, when they change on a redefinition, its status row (updates).
create or replace function lockstep._save_parent_keys(job text, parent_columns name[], parent_keys name[]) returns void
language plpgsql
security definer
set search_path = pg_catalog, pg_temp
as $$
declare
    v_old name[];
begin
    perform lockstep._check_manages(job);
    perform lockstep._check_may_own(job, (select x.owner_id from lockstep.job x where x.job = _save_parent_keys.job));
    select x.parent_columns into v_old from lockstep.job x where x.job = _save_parent_keys.job;
    if not found or (v_old, (select x.parent_keys from lockstep.job x where x.job = _save_parent_keys.job))
                    is not distinct from (parent_columns, parent_keys) then
        return;
    end if;
    update lockstep.job x set parent_columns = _save_parent_keys.parent_columns,
                              parent_keys = _save_parent_keys.parent_keys
    where x.job = _save_parent_keys.job;
    if v_old is not null then
        update lockstep.job_state s set next_run_at = now() where s.job = _save_parent_keys.job;
    end if;
end;
$$;
comment on function lockstep._save_parent_keys(text, name[], name[]) is
    'Record a derived job''s parent key columns (define_derived, after lockstep._save_derived); other '
    'columns than before make its recompute due now, for a caller that may write the job (42501). Security '
    'definer: the owner recipe holds no UPDATE on lockstep''s tables. Locks: the job''s registry row and, '
    'when they change on a redefinition, its status row (updates).';
