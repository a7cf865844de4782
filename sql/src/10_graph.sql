-- lockstep: the graph of derived jobs that read each other's targets (a chain: a job watches another job's
-- target). lockstep.due runs a job after the jobs it reads, lockstep.status shows depends_on, and a cycle is
-- refused when define_derived or watch would make it.

-- lockstep._wal_watches(): the tables each job watches through the WAL (lockstep.wal_watch, 16_capture.sql),
-- as the current role sees them; none when it may not read that table (PL/pgSQL: the query is not even
-- planned then, so lockstep.status and lockstep.due never fail for a role without that grant).
-- locks: nothing.
create or replace function lockstep._wal_watches() returns table (job text, rel regclass)
language plpgsql stable
set search_path = pg_catalog, pg_temp
as $$
begin
    if pg_catalog.has_table_privilege('lockstep.wal_watch', 'select') then
        return query select w.job, w.source from lockstep.wal_watch w;
    end if;
end;
$$;

comment on function lockstep._wal_watches() is
    'The tables each job watches through the WAL, as the role sees them; none without SELECT on '
    'lockstep.wal_watch. Locks: none.';

-- lockstep._watch_rels(): every table a job watches: a trigger of the job (lockstep.watch's, a watch through
-- a join, or one's own calling lockstep.enqueue_trigger) or a WAL watch.
-- locks: nothing.
create or replace function lockstep._watch_rels() returns table (job text, rel oid)
language sql stable
set search_path = pg_catalog, pg_temp
as $$
    select x.job, tg.tgrelid
    from pg_catalog.pg_trigger tg
    join lockstep.job x
      on pg_catalog.convert_to(x.job, pg_catalog.getdatabaseencoding())
         = pg_catalog.substr(tg.tgargs, 1, pg_catalog.position(tg.tgargs, '\x00'::bytea) - 1)
    where tg.tgfoid in (select lockstep._trigger_fns()) and tg.tgnargs >= 1
    union
    select w.job, w.rel::oid from lockstep._wal_watches() w;
$$;

comment on function lockstep._watch_rels() is
    'Every table a job watches (its triggers, its WAL watches). Locks: none.';

-- lockstep._deps(): the graph of derived jobs: job reads depends_on's target, a table it watches
-- (lockstep._watch_rels) being that target or a table below it.
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
    select distinct w.job, b.root
    from lockstep._watch_rels() w
    join below b on b.rel = w.rel and b.root <> w.job;
$$;

comment on function lockstep._deps() is
    'The graph of derived jobs: job reads the target of depends_on through a table it watches. Locks: '
    'none.';

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

comment on function lockstep._depths() is
    'Each job that reads another job''s target, with its depth in the graph (lockstep.due''s order). '
    'Locks: none.';

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

comment on function lockstep._dep_path(text, text) is
    'The shortest chain of jobs from from_job to to_job, each reading the next one''s target; NULL if '
    'none. Locks: none.';

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
        where exists (select from lockstep._watch_rels() w
                      where w.job = x.job and w.rel::regclass = any(lockstep._family(_check_cycle.target)))
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

comment on function lockstep._check_cycle(text, regclass, regclass) is
    'LSD09 with the cycle''s path if defining job with target, or job watching source, would close a '
    'cycle of derived jobs. Locks: the advisory lock (lockstep, define) until the transaction ends.';
