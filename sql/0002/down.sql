-- lockstep 0002 down, before 0001's code is installed again: drop what 0001 did not have (functions,
-- views), restore the state of 0001, and clear the function comments 0001 did not set.
-- locks: ACCESS EXCLUSIVE on each table altered, for the migration's transaction.
do $$
declare
    f regprocedure;
begin
    for f in select p.oid::regprocedure from pg_catalog.pg_proc p
             where p.pronamespace = 'lockstep'::regnamespace and pg_catalog.obj_description(p.oid, 'pg_proc') is not null
    loop
        execute pg_catalog.format('comment on function %s is null', f);
    end loop;
end;
$$;

-- watches through a join (0002): their triggers go with their functions; 0001's watch() comes back
do $$
declare
    t record;
begin
    for t in select tg.tgname, tg.tgrelid::regclass rel from pg_catalog.pg_trigger tg
             join pg_catalog.pg_proc p on p.oid = tg.tgfoid
             where p.oid = pg_catalog.to_regprocedure('lockstep.enqueue_through()')
    loop
        execute pg_catalog.format('drop trigger %I on %s', t.tgname, t.rel);
    end loop;
end;
$$;
drop function if exists lockstep.watch(text, regclass, name, regclass, name, text);
drop function if exists lockstep.enqueue_through();
drop function if exists lockstep._watch_through(lockstep.job, regclass, name, regclass, name);
drop function if exists lockstep._through_key(regclass, name, regclass);
drop function if exists lockstep._check_source_key(lockstep.job, regclass, name);
