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
