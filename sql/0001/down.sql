-- lockstep 0001 downgrade: remove everything revision 0001 installed.
-- First the triggers lockstep.watch() created on application tables are dropped, with those tables and
-- lockstep's own tables and views locked through lockstep._ddl (08_enqueue.sql): a plain DROP SCHEMA
-- queued behind one open application transaction on a watched table (a dropped trigger needs ACCESS
-- EXCLUSIVE on its table) while already holding locks on lockstep's objects, so the application's next
-- writes waited behind it until that transaction ended, or deadlocked with it. _ddl waits at most 100 ms
-- at a time and gives way between attempts; after ~10 s, 55P03 and nothing is dropped. Then the schema,
-- whose tables are all locked by then.
-- locks: the watched tables, then lockstep's tables and views (ACCESS EXCLUSIVE, as lockstep._ddl).
do $$
declare
    v_tables regclass[];
    v_stmts text[];
    v_denied text;
begin
    if pg_catalog.to_regnamespace('lockstep') is null then
        return;
    end if;
    if lockstep._own_enqueuers(null) is not null then  -- they fail once the schema is gone
        raise warning 'lockstep: your own % call lockstep.enqueue: once lockstep is removed, the next write that fires them fails',
            lockstep._own_enqueuers(null)
            using hint = 'Drop those triggers (or upgrade again).';
    end if;
    select coalesce(array_agg(t.tgrelid::regclass order by t.tgrelid, t.tgname), '{}'),
           coalesce(array_agg(pg_catalog.format('drop trigger if exists %I on %s', t.tgname, t.tgrelid::regclass)
                              order by t.tgrelid, t.tgname), '{}')
    into v_tables, v_stmts
    from pg_catalog.pg_trigger t
    join pg_catalog.pg_proc p on p.oid = t.tgfoid
    where p.pronamespace = 'lockstep'::regnamespace and not t.tgisinternal;
    -- dropping a trigger needs the table's ownership: say up front which tables this role may not touch,
    -- and what to do, before anything is locked or dropped (an installer whose job owners watched their own
    -- tables got "permission denied for schema blog" and the install hint; found by a probe)
    select pg_catalog.string_agg(distinct pg_catalog.format('%s (%s)', c.oid::regclass,
                                                            case when not pg_catalog.pg_has_role(c.relowner, 'USAGE')
                                                                 then 'owner ' || c.relowner::regrole::text
                                                                 else 'no USAGE on its schema' end), ', ')
    into v_denied
    from pg_catalog.unnest(v_tables) t(rel) join pg_catalog.pg_class c on c.oid = t.rel
    where not pg_catalog.pg_has_role(c.relowner, 'USAGE') or not pg_catalog.has_schema_privilege(c.relnamespace, 'USAGE');
    if v_denied is not null then
        raise exception 'lockstep: the downgrade drops the triggers watch() put on %, and role % may not: %',
            (select pg_catalog.string_agg(distinct t.rel::text, ', ') from pg_catalog.unnest(v_tables) t(rel)),
            current_user, v_denied
            using errcode = '42501',
                  hint = 'Have each of those owners drop its jobs first (lockstep drop JOB), or run the downgrade as '
                         'a superuser or a member of those owner roles with USAGE on their schemas. Nothing was changed.';
    end if;
    v_tables := v_tables || array(select c.oid::regclass from pg_catalog.pg_class c
                                  where c.relnamespace = 'lockstep'::regnamespace and c.relkind in ('r', 'p', 'v')
                                  order by c.relname);
    perform lockstep._ddl(v_tables, v_stmts, 'the downgrade');
end;
$$;
drop schema if exists lockstep cascade;
