-- lockstep: the graph of derived jobs that read each other's targets (a chain: a job watches another job's
-- target). lockstep.due runs a job after the jobs it reads, lockstep.status shows depends_on, and a cycle is
-- refused when define_derived or watch would make it.

-- lockstep._deps(): the graph of derived jobs: job reads depends_on's target, through a trigger of job
-- (lockstep.watch's, or one's own calling lockstep.enqueue_trigger) on that target or a table below it.
-- locks: nothing.
create or replace function lockstep._deps() returns table (job text, depends_on text)
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    with recursive below (root, rel, depth) as (
        select j.job, j.target::oid, 0 from lockstep.job j where j.target is not null
        union all
        select b.root, i.inhrelid, b.depth + 1 from below b join pg_catalog.pg_inherits i on i.inhparent = b.rel
        where b.depth < 100
    )
    select distinct x.job, b.root
    from pg_catalog.pg_trigger tg
    join lockstep.job x
      on pg_catalog.convert_to(x.job, pg_catalog.getdatabaseencoding())
         = pg_catalog.substr(tg.tgargs, 1, pg_catalog.position(tg.tgargs, '\x00'::bytea) - 1)
    join below b on b.rel = tg.tgrelid and b.root <> x.job
    where tg.tgfoid in (select lockstep._trigger_fns()) and tg.tgnargs >= 1;
$$;

-- lockstep._depths(): each job that reads another job's target, with its depth: 1 + the largest depth of
-- the jobs it reads (a job that reads none has depth 0 and is not listed). The runner runs a tick's due
-- jobs by depth (lockstep.due), so a job runs after the jobs it reads.
-- locks: nothing.
create or replace function lockstep._depths() returns table (job text, depth integer)
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    with recursive e as materialized (select * from lockstep._deps()),
    r (job, depth) as (
        select e.job, 1 from e
        union all
        select e.job, r.depth + 1 from r join e on e.depends_on = r.job
        where r.depth < 100  -- a cycle is refused when made (lockstep._check_cycle); bounded all the same
    )
    select r.job, max(r.depth)::integer from r group by r.job;
$$;

-- lockstep._dep_path(from_job, to_job): the shortest chain of jobs from from_job to to_job, each reading the
-- next one's target (lockstep._deps), both ends included; NULL if there is none. [from_job] when they are one.
-- locks: nothing.
create or replace function lockstep._dep_path(from_job text, to_job text) returns text[]
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    with recursive e as materialized (select * from lockstep._deps()),
    p (job, path) as (
        select from_job, array[from_job]
        union all
        select e.depends_on, p.path || e.depends_on from p join e on e.job = p.job
        where not e.depends_on = any(p.path) and pg_catalog.cardinality(p.path) < 100
    )
    select p.path from p where p.job = to_job order by pg_catalog.cardinality(p.path) limit 1;
$$;

-- lockstep._check_cycle(job, target, source): the graph of derived jobs stays without a cycle when job is
-- defined with target (define_derived; source NULL) or watches source (watch; target NULL). Else LSD09,
-- naming the cycle. A cycle would have each job queue the other's parents for ever.
-- locks: the advisory lock (lockstep, define) of lockstep._check_target_free, until the transaction ends: a
-- concurrent define or watch waits (two of them could each pass alone and close a cycle together).
create or replace function lockstep._check_cycle(job text, target regclass, source regclass) returns void
language plpgsql
set search_path = pg_catalog, pg_temp
as $$
declare
    v_path text[];
begin
    perform pg_catalog.pg_advisory_xact_lock(pg_catalog.hashtext('lockstep'), pg_catalog.hashtext('define'));
    if _check_cycle.source is not null then  -- job will read the target of each job a: a cycle if a reads job already
        select array[_check_cycle.job] || lockstep._dep_path(a.job, _check_cycle.job) into v_path
        from lockstep.job a
        where a.target is not null
          and (_check_cycle.source = any(lockstep._family(a.target))
               or a.target = any(lockstep._family(_check_cycle.source)))
          and lockstep._dep_path(a.job, _check_cycle.job) is not null
        order by a.job limit 1;
    else  -- each job x that watches target will read job: a cycle if job reads x already
        select lockstep._dep_path(_check_cycle.job, x.job) || array[_check_cycle.job] into v_path
        from lockstep.job x
        where exists (select from lockstep._watchers(x.job) w where w.rel = any(lockstep._family(_check_cycle.target)))
          and lockstep._dep_path(_check_cycle.job, x.job) is not null
        order by x.job limit 1;
    end if;
    if v_path is not null then
        raise exception 'lockstep: this would make a cycle of derived jobs: %',
                        pg_catalog.array_to_string(v_path, ' -> ')
            using errcode = 'LSD09',
                  hint = 'Each job in a chain reads (watches) the target of the next: a job may read another job''s '
                         'target, never, through the chain, its own. Unwatch one of those tables (lockstep.unwatch).';
    end if;
end;
$$;
