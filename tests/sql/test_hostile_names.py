"""Hostile identifiers: quotes, semicolons, spaces, mixed case and SQL fragments in every name lockstep
quotes into dynamic SQL (schema, tables, columns, compute function, job name, lock group).

A derived job over such names goes through define_derived, watch (triggers enqueue), work, recompute,
retry and drop_job, converges, and nothing is injected: a canary table survives and no relation,
function or trigger appears other than the ones the test made (and the watch triggers, while watched).
"""

from __future__ import annotations

import psycopg
import pytest

JOB = "job'); drop table public.canary; --"
GROUP = 'gr"oup; drop table public.canary'

SETUP = r"""
create table public.canary (v int);
insert into public.canary values (1);
create schema "we;ird";
create table "we;ird"."Par ent" (
    "Id"        bigint primary key,
    "Body; x"   text not null
);
create table "we;ird"."tar""get" (
    "p Id"              bigint not null references "we;ird"."Par ent" ("Id") on delete cascade,
    "Key;drop table x"  text not null,
    "n'"                integer not null,
    primary key ("p Id", "Key;drop table x")
);
create function "we;ird"."com pute"(ids bigint[])
returns table ("p Id" bigint, "Key;drop table x" text, "n'" integer)
language sql stable as $$
    select p."Id", w, count(*)::integer
    from "we;ird"."Par ent" p, regexp_split_to_table(p."Body; x", ' ') w
    where (ids is null or p."Id" = any(ids)) and w <> ''
    group by 1, 2
$$;
insert into "we;ird"."Par ent"
select g, 'a''b "c" d;e ' || (g % 7) || ' drop table public.canary; ' || g
from generate_series(1, 40) g;
"""

DIVERGENCE = """
select (select count(*) from (select * from "we;ird"."com pute"(null)
                              except all select * from "we;ird"."tar""get") s),
       (select count(*) from (select * from "we;ird"."tar""get"
                              except all select * from "we;ird"."com pute"(null)) s)
"""

OBJECTS = """
select 'rel ' || c.oid::regclass::text from pg_class c
where c.relnamespace not in ('pg_catalog'::regnamespace, 'information_schema'::regnamespace)
  and c.relnamespace::regnamespace::text not like 'pg\\_%%'
union all
select 'fn ' || p.oid::regprocedure::text from pg_proc p
where p.pronamespace not in ('pg_catalog'::regnamespace, 'information_schema'::regnamespace)
union all
select 'trg ' || t.tgrelid::regclass::text || ' ' || t.tgname from pg_trigger t where not t.tgisinternal
union all
select 'ns ' || nspname from pg_namespace where nspname not like 'pg\\_%%'
"""


def objects(c: psycopg.Connection) -> set[str]:
    return {r[0] for r in c.execute(OBJECTS)}


def divergence(c: psycopg.Connection) -> tuple[int, int]:
    return tuple(c.execute(DIVERGENCE).fetchone())


def outcome(c: psycopg.Connection, call: str) -> tuple:
    return c.execute(f"select outcome, error from {call}", [JOB]).fetchone()


@pytest.fixture
def hostile(conn):
    conn.execute(SETUP)
    return conn


def test_hostile_names_define_watch_work_recompute_drop(hostile):
    c = hostile
    before = objects(c)
    c.execute(
        """select lockstep.define_derived(%s, '"we;ird"."tar""get"', '"we;ird"."com pute"(bigint[])',
                                          parent => '"we;ird"."Par ent"', parent_column => 'p Id',
                                          lock_group => %s)""",
        [JOB, GROUP],
    )
    c.execute("""select lockstep.watch(%s, '"we;ird"."Par ent"', 'Id')""", [JOB])
    watched = objects(c) - before
    # the three triggers, and the function watch() generated for them (its name a hash, its body the column
    # through format %I)
    fns = {o for o in watched if o.startswith("fn lockstep.enqueue_w_")}
    assert len(fns) == 1, watched
    assert watched - fns and all(o.startswith('trg "we;ird"."Par ent" ') for o in watched - fns), watched

    assert outcome(c, "lockstep.recompute(%s)") == ("done", None)
    assert divergence(c) == (0, 0)
    assert c.execute('select count(*) from "we;ird"."tar""get"').fetchone()[0] > 100

    # app writes of every kind enqueue through the watch triggers
    c.execute("""update "we;ird"."Par ent" set "Body; x" = 'x''y; "z" ' || "Id" where "Id" <= 10""")
    c.execute("""delete from "we;ird"."Par ent" where "Id" between 11 and 15""")
    c.execute("""insert into "we;ird"."Par ent" values (100, 'it''s; a "new" one'), (101, '--; /* */')""")
    queued = {k for (k,) in c.execute("select key from lockstep.queue where job = %s", [JOB])}
    assert queued == {str(i) for i in [*range(1, 16), 100, 101]}
    assert divergence(c) != (0, 0)
    # lockstep.verify sees the same difference, through every quoted name
    missing, extra, different, examples = c.execute("select * from lockstep.verify(%s)", [JOB]).fetchone()
    assert missing + extra + different > 0 and examples
    assert c.execute("select (lockstep.verify(%s, array[20, 21]::bigint[])).missing", [JOB]).fetchone() == (
        0,
    )
    assert outcome(c, "lockstep.work(%s)") == ("done", None)
    assert divergence(c) == (0, 0)
    assert c.execute("select * from lockstep.verify(%s)", [JOB]).fetchone() == (0, 0, 0, [])
    assert outcome(c, "lockstep.work(%s)")[0] == "idle"

    # enqueue by hand, retry, run, status
    assert c.execute("select lockstep.enqueue(%s, array[1, 2]::bigint[])", [JOB]).fetchone()[0] == 2
    assert outcome(c, "lockstep.work(%s)") == ("done", None)
    c.execute("select lockstep.retry(%s)", [JOB])
    c.execute("update lockstep.job_state set next_run_at = now() where job = %s", [JOB])
    assert outcome(c, "lockstep.run(%s)") == ("done", None)
    row = c.execute("select lock_group, consecutive_failures from lockstep.status where job = %s", [JOB])
    assert row.fetchone() == (GROUP, 0)
    assert c.execute("select count(*) from lockstep.due(array[%s])", [JOB]).fetchone()[0] == 1
    assert divergence(c) == (0, 0)

    c.execute("select lockstep.drop_job(%s)", [JOB])
    assert objects(c) == before  # the watch triggers are gone, nothing else appeared
    assert c.execute("select v from public.canary").fetchall() == [(1,)]
    assert c.execute("select count(*) from lockstep.job").fetchone()[0] == 0


def test_hostile_names_in_a_generic_job(hostile):
    c = hostile
    c.execute(
        """create function "we;ird"."ca'll; drop table public.canary"() returns void language sql
           as $$ update "we;ird"."Par ent" set "Body; x" = "Body; x" || ' !' where "Id" = 1 $$"""
    )
    before = objects(c)
    c.execute(
        """select lockstep.define_job(%s, '"we;ird"."ca''ll; drop table public.canary"()',
                                      lock_group => %s)""",
        [JOB, GROUP],
    )
    assert outcome(c, "lockstep.run(%s)") == ("done", None)
    assert c.execute("""select "Body; x" like '%% !' from "we;ird"."Par ent" where "Id" = 1""").fetchone()[0]
    c.execute("select lockstep.drop_job(%s)", [JOB])
    assert objects(c) == before
    assert c.execute("select v from public.canary").fetchall() == [(1,)]


def test_unwatch_with_hostile_names(hostile):
    c = hostile
    before = objects(c)
    c.execute(
        """select lockstep.define_derived(%s, '"we;ird"."tar""get"', '"we;ird"."com pute"(bigint[])',
                                          parent => '"we;ird"."Par ent"', parent_column => 'p Id')""",
        [JOB],
    )
    c.execute("""select lockstep.watch(%s, '"we;ird"."Par ent"', 'Id')""", [JOB])
    c.execute("""select lockstep.unwatch(%s, '"we;ird"."Par ent"')""", [JOB])
    assert objects(c) == before
    c.execute("""update "we;ird"."Par ent" set "Body; x" = 'q' where "Id" = 3""")
    assert c.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
    assert c.execute("select v from public.canary").fetchall() == [(1,)]
