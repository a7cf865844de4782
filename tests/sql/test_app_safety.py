"""An application statement never fails because of lockstep, and nothing it changed is lost.

One test per way an application could fail or lose a change, each failing on the code before its fix, and
the "hostile
application" catalogue: app statements under every isolation level, two DateStyles, PREPARE TRANSACTION and
user-written triggers, again after each admin action; 0 application failures, and afterwards the derived
rows equal compute after draining with work() alone, or the job is flagged and converges after its
recompute.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator

import pg_cluster
import psycopg
import pytest
from isolation import Spec
from psycopg.conninfo import make_conninfo
from util import raises_sqlstate, result, snapshot

from lockstep.migrate import migrate

APP_SQL = """
create schema app;
create table app.acc (aid bigint primary key, bal integer not null default 0);
create table app.txn (id bigint generated always as identity primary key,
                      aid bigint not null references app.acc on delete cascade, amount integer not null);
create table app.band (aid bigint primary key references app.acc on delete cascade,
                       band text, balance integer);
create function app.band_compute(keys bigint[]) returns table (aid bigint, band text, balance integer)
language sql stable as $$
    select a.aid, case when a.bal + coalesce(t.s, 0) < 0 then 'neg' else 'pos' end, a.bal + coalesce(t.s, 0)
    from app.acc a
    left join (select x.aid, sum(x.amount)::integer s from app.txn x group by x.aid) t on t.aid = a.aid
    where keys is null or a.aid = any(keys)
$$;
insert into app.acc (aid, bal) select g, g from generate_series(1, 20) g;
select lockstep.define_derived('band', 'app.band', 'app.band_compute(bigint[])', parent => 'app.acc',
                               every => '1 day');
select lockstep.watch('band', 'app.acc', 'aid');
select lockstep.watch('band', 'app.txn', 'aid');

create table app.day (d date primary key, v integer not null);
create table app.day_sum (d date primary key references app.day on delete cascade, v integer not null);
create function app.day_compute(keys date[]) returns table (d date, v integer)
language sql stable as $$ select x.d, x.v * 10 from app.day x where keys is null or x.d = any(keys) $$;
insert into app.day select date '2024-01-01' + g, g from generate_series(0, 40) g;
select lockstep.define_derived('days', 'app.day_sum', 'app.day_compute(date[])', parent => 'app.day',
                               every => '1 day');
select lockstep.watch('days', 'app.day', 'd');
-- a composite parent key (tenant, aid): the same guarantees as one column
create table app.tacc (tenant int not null, aid bigint not null, bal integer not null default 0,
                       primary key (tenant, aid));
create table app.ttxn (id bigint generated always as identity primary key, tenant int not null,
                       aid bigint not null, amount integer not null,
                       foreign key (tenant, aid) references app.tacc on delete cascade);
create table app.tband (tenant int not null, aid bigint not null, balance integer, primary key (tenant, aid),
                        foreign key (tenant, aid) references app.tacc on delete cascade);
create type app.tacc_key as (tenant int, aid bigint);
create function app.tband_compute(keys app.tacc_key[]) returns table (tenant int, aid bigint, balance integer)
language sql stable as $$
    select a.tenant, a.aid, a.bal + coalesce((select sum(x.amount)::integer from app.ttxn x
                                              where x.tenant = a.tenant and x.aid = a.aid), 0)
    from app.tacc a where keys is null or (a.tenant, a.aid) in (select k.tenant, k.aid from unnest(keys) k)
$$;
insert into app.tacc (tenant, aid, bal) select t, g, g from generate_series(1, 2) t, generate_series(1, 20) g;
select lockstep.define_derived('tband', 'app.tband', 'app.tband_compute(app.tacc_key[])',
                               parent => 'app.tacc',
                               every => '1 day');
select lockstep.watch('tband', 'app.tacc', key_columns => array['tenant', 'aid']::name[]);
select lockstep.watch('tband', 'app.ttxn', key_columns => array['tenant', 'aid']::name[]);
create table app.tledger (id bigint generated always as identity primary key, tenant int not null,
                          aid bigint not null, amount integer not null);  -- watched, not read by compute
select lockstep.watch('tband', 'app.tledger', key_columns => array['tenant', 'aid']::name[]);
select lockstep.recompute('band');
select lockstep.recompute('days');
select lockstep.recompute('tband');
delete from lockstep.queue;
"""


def install_app(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(APP_SQL)


@pytest.fixture
def app(conn, dsn) -> psycopg.Connection:
    install_app(dsn)
    return conn


def drain(conn: psycopg.Connection, job: str) -> None:
    """work() until the queue is idle (bounded: a pass of 500 keys; a few are plenty here)."""
    for _ in range(50):
        r = conn.execute("select outcome, error from lockstep.work(%s)", [job]).fetchone()
        assert r[0] in ("done", "idle"), r
        if r[0] == "idle":
            return
    raise AssertionError(f"{job}: the queue did not drain in 50 passes")


def divergence(conn: psycopg.Connection, job: str) -> int:
    """Rows that differ between the target and compute(NULL), both ways."""
    target, fn = {
        "band": ("app.band", "app.band_compute"),
        "days": ("app.day_sum", "app.day_compute"),
        "tband": ("app.tband", "app.tband_compute"),
    }[job]
    return conn.execute(
        f"select count(*) from ((select * from {target} except all select * from {fn}(null))"
        f" union all (select * from {fn}(null) except all select * from {target})) s"
    ).fetchone()[0]


def flag(conn: psycopg.Connection, job: str) -> tuple:
    return conn.execute(
        "select needs_recompute is not null, trigger_problem from lockstep.status where job = %s", [job]
    ).fetchone()


def queue(conn: psycopg.Connection, job: str) -> list[str]:
    return [k for (k,) in conn.execute("select key from lockstep.queue where job = %s order by id", [job])]


def enqueue_triggers(conn: psycopg.Connection, table: str) -> list[str]:
    return [
        n
        for (n,) in conn.execute(
            "select tgname from pg_trigger where tgrelid = %s::regclass"
            " and tgfoid in (select lockstep._trigger_fns()) order by 1",
            [table],
        )
    ]


# -- item 1: one's own triggers, with one's own transition-table names -------------------------------------


def test_item1_a_trigger_written_as_the_manual_shows_enqueues(app):
    app.execute("select lockstep.unwatch('band', 'app.txn')")
    for op, ref in [
        ("insert", "new table as new_rows"),
        ("update", "new table as new_rows old table as old_rows"),
        ("delete", "old table as old_rows"),
    ]:
        app.execute(
            f"create trigger my_{op} after {op} on app.txn referencing {ref} for each statement"
            " execute function lockstep.enqueue_trigger('band', 'aid')"
        )
    app.execute("insert into app.txn (aid, amount) values (3, 5), (7, -100)")
    assert queue(app, "band") == ["3", "7"]
    app.execute("update app.txn set aid = 4 where aid = 3")  # a move: old and new parent
    app.execute("delete from app.txn where aid = 7")
    assert sorted(set(queue(app, "band"))) == ["3", "4", "7"]
    drain(app, "band")
    assert divergence(app, "band") == 0
    assert flag(app, "band") == (False, None)


def test_drop_job_names_the_applications_own_triggers_that_still_enqueue_for_it(app):
    """`lockstep drop` said only "dropped", and the application's own trigger calling lockstep.enqueue for
    that job failed its next write with LSJ01. drop_job names such triggers."""
    app.execute(
        "create function app.my_enqueue() returns trigger language plpgsql as $$ begin"
        " perform lockstep.enqueue('band', array(select distinct aid from new_rows)); return null; end $$;"
        "create trigger my_txn_ins after insert on app.txn referencing new table as new_rows"
        " for each statement execute function app.my_enqueue()"
    )
    notices: list[str] = []
    app.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    app.execute("select lockstep.drop_job('days')")  # not named in that function: no warning
    assert not [n for n in notices if "your own" in n], notices
    app.execute("select lockstep.drop_job('band')")
    assert [
        n for n in notices if "your own trigger my_txn_ins on app.txn (function app.my_enqueue())" in n
    ], notices
    # precise both ways: a job name that only appears elsewhere in the function is not a call;
    # a job passed as a trigger argument, or through a quoted schema name, is
    app.execute(
        "select lockstep.define_derived('band', 'app.band', 'app.band_compute(bigint[])',"
        " parent => 'app.acc');"
        "select lockstep.define_derived('days', 'app.day_sum', 'app.day_compute(date[])',"
        " parent => 'app.day');"
        "create function app.by_arg() returns trigger language plpgsql as $$ begin"
        ' perform "lockstep".enqueue(tg_argv[0], array(select distinct aid from new_rows));'
        " return null; end $$;"
        "create trigger my_arg after insert on app.txn referencing new table as new_rows"
        " for each statement execute function app.by_arg('days');"
        "create or replace function app.my_enqueue() returns trigger language plpgsql as $$ begin"
        " perform lockstep.enqueue('band', array(select distinct aid from new_rows where 'days' <> ''));"
        " return null; end $$"
    )
    notices.clear()
    app.execute("select lockstep.drop_job('days')")
    named = [n for n in notices if "your own" in n]
    assert len(named) == 1 and "my_arg" in named[0] and "my_txn_ins" not in named[0], notices


# -- item 2: redefining a watched job without a parent -----------------------------------------------------


def test_item2_redefining_a_watched_job_without_parent_is_refused(app):
    before = snapshot(app)
    with raises_sqlstate("LSJ02", "needs a parent") as info:
        app.execute("select lockstep.define_derived('band', 'app.band', 'app.band_compute(bigint[])')")
    assert "unwatch" in (info.value.diag.message_hint or "")
    assert snapshot(app) == before
    app.execute("update app.acc set bal = bal + 1 where aid = 2")  # the app's writes go on
    assert queue(app, "band") == ["2"]


# -- item 3: drop_job of a job with a non-ASCII or backslash name ------------------------------------------


@pytest.mark.parametrize("name", ["bänd", "band\\x", "b\\\\000d"])
def test_item3_drop_job_drops_the_triggers_of_any_name(app, name):
    app.execute("select lockstep.drop_job('band')")
    app.execute(
        "select lockstep.define_derived(%s, 'app.band', 'app.band_compute(bigint[])', parent => 'app.acc')",
        [name],
    )
    app.execute("select lockstep.watch(%s, 'app.acc', 'aid')", [name])
    assert len(enqueue_triggers(app, "app.acc")) == 4  # insert, update, delete, truncate
    app.execute("select lockstep.drop_job(%s)", [name])
    assert enqueue_triggers(app, "app.acc") == []
    app.execute("update app.acc set bal = bal + 1 where aid = 2")


# -- item 4: a column that does not convert, a renamed column ----------------------------------------------


def test_item4_a_numeric_column_for_a_bigint_key_is_refused_at_watch(app):
    app.execute("alter table app.acc add column ref numeric")
    before = snapshot(app)
    with raises_sqlstate("LSQ01", "does not always convert"):
        app.execute("select lockstep.watch('band', 'app.acc', 'ref')")
    assert snapshot(app) == before
    app.execute("update app.acc set ref = 3.00, bal = bal + 1 where aid = 3")


def test_watching_the_jobs_own_target_is_refused(app):
    # accepted before: every pass's writes queued their parents again through the
    # target's own triggers, so the worker never went idle (318 passes in 5 s with a volatile compute)
    before = snapshot(app)
    with raises_sqlstate("22023", "is the target of job") as info:
        app.execute("select lockstep.watch('band', 'app.band', 'aid')")
    assert "watch the tables compute reads" in (info.value.diag.message_hint or "")
    assert snapshot(app) == before


@pytest.mark.parametrize(
    ("table", "column"),
    [
        ("lockstep.queue", "id"),
        ("lockstep.job_state", "job"),
        ("lockstep.key_failure", "key"),
        ("app.q2", "key"),  # a grandchild of the queue (not only one level up)
        ("public.lockstep_alembic_version", "version_num"),
    ],
)
def test_watching_one_of_locksteps_own_tables_is_refused(app, table, column):
    """Accepted before: a watched queue fed itself on every enqueue until the stack ran
    out, so every application write of every watched table failed with 54001; a watched job_state made a
    job that never went idle (999 empty passes in one run --once)."""
    app.execute(
        "create table app.byname (name text primary key);"
        "create table app.byname_d (name text primary key references app.byname on delete cascade);"
        "create function app.byname_c(keys text[]) returns setof app.byname_d language sql stable"
        " as $$ select b.name from app.byname b where keys is null or b.name = any(keys) $$;"
        "select lockstep.define_derived('names', 'app.byname_d', 'app.byname_c(text[])',"
        " parent => 'app.byname')"
    )
    app.execute("create table app.q1 () inherits (lockstep.queue); create table app.q2 () inherits (app.q1)")
    app.execute("create table if not exists public.lockstep_alembic_version (version_num text primary key)")
    job = "band" if column == "id" else "names"
    before = snapshot(app)
    with raises_sqlstate("22023", "one of lockstep's own tables"):
        app.execute("select lockstep.watch(%s, %s, %s)", [job, table, column])
    assert snapshot(app) == before
    app.execute("update app.acc set bal = bal + 1 where aid = 2")  # the application's write still enqueues
    assert queue(app, "band") == ["2"]


def test_work_makes_a_status_row_deleted_by_hand_again(app):
    """run() makes it again, and so does work() called directly (it wrote its rows and recorded nothing)."""
    app.execute("delete from lockstep.job_state where job = 'band'")
    app.execute("update app.acc set bal = bal + 1 where aid = 3")
    r = result(app, "lockstep.work('band')")  # the row's defaults: the recompute is due, the worker gives way
    assert r["outcome"] == "busy" and "periodic" in (r["error"] or ""), r
    assert app.execute("select count(*) from lockstep.job_state where job = 'band'").fetchone()[0] == 1
    assert result(app, "lockstep.run('band')")["action"] == "recompute"
    assert divergence(app, "band") == 0


def test_a_temporary_table_is_refused_as_a_watched_table_and_as_a_target(app):
    """Accepted before: the runner never sees a temporary table's rows, and its triggers
    went with its session, leaving their generated function behind."""
    app.execute(
        "create temp table tmp_acc (aid bigint primary key);"
        "create temp table tmp_band (aid bigint primary key, band text, balance integer)"
    )
    before = snapshot(app)
    with raises_sqlstate("22023", "temporary table"):
        app.execute("select lockstep.watch('band', 'pg_temp.tmp_acc', 'aid')")
    with raises_sqlstate("22023", "temporary table"):
        app.execute(
            "select lockstep.define_derived('tmpjob', 'pg_temp.tmp_band', 'app.band_compute(bigint[])',"
            " parent => 'app.acc')"
        )
    assert snapshot(app) == before


def test_a_target_among_locksteps_own_tables_is_refused(app):
    app.execute(
        "create function app.fake_failures(keys bigint[]) returns setof lockstep.key_failure"
        " language sql stable as $$ select * from lockstep.key_failure where false $$"
    )
    before = snapshot(app)
    with raises_sqlstate("22023", "one of lockstep's own tables"):
        app.execute(
            "select lockstep.define_derived('evil', 'lockstep.key_failure', 'app.fake_failures(bigint[])')"
        )
    assert snapshot(app) == before


def test_unwatch_of_a_generic_job_is_refused_as_watch_is(app):
    app.execute("create function app.noop() returns void language sql as $$ select $$")
    app.execute("select lockstep.define_job('gen', 'app.noop()')")
    with raises_sqlstate("LSJ02", "generic job"):
        app.execute("select lockstep.watch('gen', 'app.acc', 'aid')")
    with raises_sqlstate("LSJ02", "generic job"):
        app.execute("select lockstep.unwatch('gen', 'app.acc')")


def test_a_job_name_with_a_control_character_is_refused(app):
    app.execute("create function app.noop() returns void language sql as $$ select $$")
    before = snapshot(app)
    for name in ["x\n", "a\tb", "j\u2028x", "j\u202ex", "\x1b[31mred"]:
        with raises_sqlstate("22023", "control characters"):
            app.execute("select lockstep.define_job(%s, 'app.noop()')", [name])
    assert snapshot(app) == before


def test_a_new_parent_key_type_drops_the_keys_queued_as_the_old_one(app):
    """Kept, the old type's queued keys were parked as unreadable after the redefinition, and lockstep
    status said unhealthy until the next periodic recompute."""
    app.execute(
        "create table app.code (c text primary key);"
        "insert into app.code values ('x'), ('y');"
        "create table app.by_code (c text primary key references app.code on delete cascade);"
        "create function app.by_code_c(keys text[]) returns table (c text) language sql stable"
        " as $$ select x.c from app.code x where keys is null or x.c = any(keys) $$;"
        "create table app.by_acc (aid bigint primary key references app.acc on delete cascade);"
        "create function app.by_acc_c(keys bigint[]) returns table (aid bigint) language sql stable"
        " as $$ select a.aid from app.acc a where keys is null or a.aid = any(keys) $$;"
        "select lockstep.define_derived('codes', 'app.by_code', 'app.by_code_c(text[])',"
        " parent => 'app.code');"
        "select lockstep.enqueue('codes', array['x', 'y'])"
    )
    assert app.execute("select count(*) from lockstep.queue where job = 'codes'").fetchone()[0] == 2
    app.execute(  # the job now keyed by the accounts (bigint)
        "select lockstep.define_derived('codes', 'app.by_acc', 'app.by_acc_c(bigint[])', parent => 'app.acc')"
    )
    assert app.execute("select count(*) from lockstep.queue where job = 'codes'").fetchone()[0] == 0
    assert result(app, "lockstep.run('codes')")["outcome"] == "done"  # the recompute, due: the definition
    assert result(app, "lockstep.run('codes')")["outcome"] == "idle"
    assert app.execute("select count(*) from lockstep.parked_keys where job = 'codes'").fetchone()[0] == 0
    assert app.execute("select count(*) from app.by_acc").fetchone()[0] == 20


def test_item4_a_renamed_key_column_falls_back_on_the_recompute(app, dsn):
    app.execute("alter table app.txn rename column aid to acc_id")
    app.execute("insert into app.txn (acc_id, amount) values (5, -50)")  # does not fail
    flagged, problem = flag(app, "band")
    assert flagged and "has no column" in problem
    p = subprocess.run(
        [sys.executable, "-m", "lockstep", "status", "--dsn", dsn], capture_output=True, timeout=30
    )
    assert p.returncode != 0  # a flagged job is unhealthy
    app.execute("alter table app.txn rename column acc_id to aid")  # the admin's fix (compute reads aid)
    assert app.execute("select outcome from lockstep.run('band')").fetchone()[0] == "done"  # due: flagged
    assert flag(app, "band") == (False, None)
    assert divergence(app, "band") == 0


WIDE_KEY = (
    "(select string_agg(md5(random()::text), '') from generate_series(1, 100))"  # ~3 KB, incompressible
)


@pytest.mark.parametrize(
    ("new_type", "value"),
    [("text", WIDE_KEY), ("json", "'5'"), ("integer", "5")],
    ids=["text", "json", "integer"],
)
def test_a_watched_column_of_another_type_flags_the_job_instead_of_failing(app, new_type, value):
    """After `alter column ... type` of a watched column that kept its name, watch()'s generated trigger
    took its fast path and failed the application's statement: text under a bigint key with a 3 KB value
    (54000, the queue's index), json (42883, no equality for its UNION). The fast path now
    checks the column's type too: the job is flagged (nothing is lost: its recompute), the problem names the
    fix, and watch() again, where the type converts, makes the trigger fast and exact again."""
    app.execute("alter table app.txn drop constraint txn_aid_fkey")
    app.execute(f"alter table app.txn alter column aid type {new_type} using aid::text::{new_type}")
    app.execute(f"insert into app.txn (aid, amount) values ({value}, -50)")  # does not fail
    flagged, problem = flag(app, "band")
    assert flagged and "app.txn" in problem and new_type in problem, problem
    assert queue(app, "band") == []
    app.execute("select lockstep.recompute('band')")
    if new_type == "integer":  # converts to the key type: watch() again makes the trigger fast and exact
        assert "not of type bigint as when watch() ran: run lockstep.watch() again" in problem
        app.execute("select lockstep.watch('band', 'app.txn', 'aid')")
        app.execute("select lockstep.recompute('band')")
        app.execute("insert into app.txn (aid, amount) values (7, 1)")
        assert queue(app, "band") == ["7"] and flag(app, "band") == (False, None)


def test_a_session_with_row_security_off_still_enqueues(app, connect, dsn):
    """An application role's session with `row_security = off` (pg_dump's scripts set it) got 42501 "query
    would be affected by row-level security policy" on every write of a watched table, its TRUNCATE and its
    enqueue(): PostgreSQL refuses such a statement on a table with row-level security
    (lockstep.queue, lockstep.recompute_flag, lockstep.job) rather than filter it. lockstep's inserts there
    run with row_security = on; the application's own statements keep its setting."""
    role = f"app_rls_{secrets.token_hex(4)}"
    app.execute(f"create role {role} login")
    try:
        app.execute(f"grant usage on schema app, lockstep to {role}")
        app.execute(f"grant select, insert, update, delete, truncate on all tables in schema app to {role}")
        app.execute(f"grant insert on lockstep.queue, lockstep.recompute_flag to {role}")
        app.execute(f"grant select on lockstep.job to {role}")
        with connect(make_conninfo(dsn, user=role)) as c:
            c.execute("set row_security = off")
            c.execute("update app.acc set bal = bal + 1 where aid = 3")  # generated trigger, fast path
            c.execute("insert into app.txn (aid, amount) values (4, 1), (5, 2)")
            c.execute("select lockstep.enqueue('band', array[6])")
            c.execute("update app.day set v = v + 1 where d = date '2024-01-02'")
            c.execute("insert into app.ttxn (tenant, aid, amount) values (2, 4, 1)")  # a composite key
            assert c.execute("show row_security").fetchone()[0] == "off"  # the session's own setting kept
        assert sorted(queue(app, "band")) == ["3", "4", "5", "6"] and queue(app, "days") == ["2024-01-02"]
        assert queue(app, "tband") == ["(2,4)"]
        with connect(make_conninfo(dsn, user=role)) as c:
            c.execute("set row_security = off")
            c.execute("truncate app.day_sum, app.day cascade")  # the TRUNCATE trigger flags the job
        assert flag(app, "days")[0]
        # the shared trigger function (watch() by a role that may not create functions in lockstep)
        app.execute("create table app.note (aid bigint not null, body text)")
        app.execute(
            "create trigger note_ins after insert on app.note referencing new table as lockstep_new"
            " for each statement execute function lockstep.enqueue_trigger('band', 'aid', 'bigint')"
        )
        app.execute(f"grant insert on app.note to {role}")
        with connect(make_conninfo(dsn, user=role)) as c:
            c.execute("set row_security = off")
            c.execute("insert into app.note values (8, 'x')")
        assert sorted(queue(app, "band")) == ["3", "4", "5", "6", "8"]
    finally:
        app.execute(f"drop owned by {role}")
        app.execute(f"drop role {role}")


# -- item 5: SERIALIZABLE transactions on different parents ------------------------------------------------


def test_item5_serializable_writers_of_different_parents_both_commit(app, connect):
    t1, t2 = connect(autocommit=False), connect(autocommit=False)
    for t in (t1, t2):
        t.execute("set transaction isolation level serializable")
    t1.execute("update app.acc set bal = bal + 1 where aid = 1")
    t2.execute("update app.acc set bal = bal + 1 where aid = 2")
    t1.commit()
    t2.commit()  # before: 40001, through the trigger's read of lockstep.queue
    assert sorted(queue(app, "band")) == ["1", "2"]


# -- item 7 / 8: bounded job names, trigger names unique in bytes ------------------------------------------


def test_item7_a_job_name_too_long_is_refused_at_define(app):
    before = snapshot(app)
    with raises_sqlstate("22023", "at most 63 bytes"):
        app.execute(
            "select lockstep.define_derived(repeat('j', 8001), 'app.band', 'app.band_compute(bigint[])',"
            " parent => 'app.acc')"
        )
    assert snapshot(app) == before


def test_item8_multibyte_job_names_get_four_distinct_triggers(app):
    app.execute("select lockstep.drop_job('band')")
    name = "é" * 31  # 62 bytes
    app.execute(
        "select lockstep.define_derived(%s, 'app.band', 'app.band_compute(bigint[])', parent => 'app.acc')",
        [name],
    )
    app.execute("select lockstep.watch(%s, 'app.acc', 'aid')", [name])
    names = enqueue_triggers(app, "app.acc")
    assert len(names) == 4 and all(len(n.encode()) <= 63 for n in names)
    app.execute("insert into app.acc (aid) values (100)")
    app.execute("update app.acc set bal = 1 where aid = 100")
    app.execute("delete from app.acc where aid = 100")
    assert queue(app, name) == ["100", "100", "100"]


# -- item 9: keys independent of session settings ----------------------------------------------------------


def test_item9_keys_do_not_depend_on_the_enqueuing_sessions_settings(app, connect):
    odd = connect()
    odd.execute("set datestyle = 'SQL, DMY'; set intervalstyle = 'sql_standard'; set timezone = 'Asia/Tokyo'")
    odd.execute("set extra_float_digits = -3")
    odd.execute("update app.day set v = v + 100 where d in ('2024-01-02', '2024-01-13')")  # 2 Jan, 13 Jan
    odd.execute("select lockstep.enqueue('days', array[date '2024-01-03'])")
    assert queue(app, "days") == ["2024-01-02", "2024-01-13", "2024-01-03"]
    drain(odd, "days")  # and worked from a session with the same odd settings
    assert divergence(app, "days") == 0


# -- item 12: enqueue sorts by key -------------------------------------------------------------------------


def test_item12_enqueue_sorts_keys_by_key_not_as_text(app):
    app.execute("select lockstep.enqueue('band', array[10, 2, 1, 11, 2])")
    assert queue(app, "band") == ["1", "2", "10", "11"]


# -- the fallback: never raise, flag, WARNING, visible, cleared by the recompute ---------------------------


def test_a_trigger_that_cannot_enqueue_flags_the_job_with_an_insert_only(app, connect):
    app.execute(
        "create trigger stale after insert on app.txn referencing new table as n for each statement"
        " execute function lockstep.enqueue_trigger('no_such_job', 'aid')"
    )
    notices: list[str] = []
    app.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    app.execute("insert into app.txn (aid, amount) values (1, 1)")
    assert any("could not enqueue" in n and "unknown job" in n for n in notices)
    assert app.execute("select job, problem from lockstep.recompute_flag").fetchall() == [
        ("no_such_job", "unknown job")
    ]
    # a flag committed after a recompute's snapshot survives it; one the snapshot saw is cleared
    app.execute(
        "create trigger notrans after insert on app.txn for each statement"
        " execute function lockstep.enqueue_trigger('band', 'aid')"
    )
    late = connect(autocommit=False)
    late.execute("insert into app.txn (aid, amount) values (2, 2)")  # flags band, not yet committed
    app.execute("select lockstep.recompute('band')")
    late.commit()
    assert flag(app, "band")[0]
    app.execute("select lockstep.recompute('band')")
    assert flag(app, "band") == (False, None)


def test_a_truncate_of_a_watched_table_flags_the_job(app, connect):
    # watch() created insert, update and delete triggers only: a TRUNCATE of a watched table was neither
    # queued nor flagged (the README said it was flagged), and the derived rows stayed stale until the next
    # periodic recompute
    user = connect()
    user.execute("insert into app.txn (aid, amount) values (1, -100), (2, 5)")
    drain(app, "band")
    assert divergence(app, "band") == 0
    notices: list[str] = []
    user.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    user.execute("truncate app.txn")  # does not fail
    assert divergence(app, "band") > 0
    needs, problem = flag(app, "band")
    assert needs and "TRUNCATE of app.txn" in problem, problem
    assert any("could not enqueue" in n for n in notices)
    assert app.execute("select due_at <= now() from lockstep.due(array['band'])").fetchone()[0]
    app.execute("select lockstep.run('band')")  # the flagged recompute runs at once
    assert divergence(app, "band") == 0 and flag(app, "band") == (False, None)


def test_drop_job_never_deadlocks_an_application_transaction(app, dsn):
    """drop_job locks app.acc, then app.txn, which an application transaction holds; that transaction then
    reads app.acc. lockstep._ddl waits in the lock queue only for its first table, holding nothing, and
    takes the others with NOWAIT: so drop_job never holds app.acc while it waits for app.txn. The read
    neither waits nor fails, even with a deadlock_timeout far below drop_job's 100 ms lock_timeout, and
    drop_job is done once the transaction commits."""
    spec = Spec(dsn, sessions={"app": ["set deadlock_timeout = '10ms'"],  # would be the victim
                               "admin": ["set deadlock_timeout = '10s'"]})  # fmt: skip
    spec.step("app_begin", "app", "begin;")
    app.execute("insert into app.txn (aid, amount) values (1, 1)")
    # an update that leaves the key alone: no FK check, so no lock on app.acc yet
    spec.step("app_write", "app", "update app.txn set amount = amount + 1;")
    spec.step("admin_drop", "admin", "select lockstep.drop_job('band');")
    spec.step("app_read", "app", "select count(*) from app.acc;")
    spec.step("app_commit", "app", "commit;")
    r = spec.run(["app_begin", "app_write", "admin_drop", "app_read", "app_commit"], step_timeout=20)
    assert r.waited("admin_drop") and r.blocked_by("admin_drop") == ["app"], r.trace
    # holding app.acc while waiting for app.txn would close a cycle: the read's deadlock check, run before
    # drop_job's lock_timeout gives app.acc back, would kill it (40P01)
    assert not r.waited("app_read"), r.trace
    assert r.sqlstate("app_read") is None and r.rows("app_read") == [(20,)], r.trace
    assert r.sqlstate("app_commit") is None and r.sqlstate("admin_drop") is None, r.trace
    assert enqueue_triggers(app, "app.acc") == [] and enqueue_triggers(app, "app.txn") == []
    assert app.execute("select amount from app.txn").fetchall() == [(2,)]


def test_drop_job_after_other_ddl_in_its_transaction_never_deadlocks_an_application(app, dsn):
    """An admin transaction unwatches app.day (holding it), then drops 'band' while an application
    transaction holds app.txn and then reads app.day. A wait in the lock queue for app.txn would close a
    cycle through app.day, and the read would die with 40P01. lockstep._ddl waits in no lock queue while its
    transaction holds a strong table lock: drop_job gives up (55P03, nothing changed), its failure ends the
    admin transaction, and the read goes on."""
    spec = Spec(dsn, sessions={"app": ["set deadlock_timeout = '10ms'"],  # would be the victim
                               "admin": ["set deadlock_timeout = '10s'"]})  # fmt: skip
    spec.step("app2_begin", "app", "begin;")
    spec.step("app2_write", "app", "update app.txn set amount = amount + 1;")
    spec.step("admin2_begin", "admin", "begin;")
    spec.step("admin2_unwatch", "admin", "select lockstep.unwatch('days', 'app.day');", show_rows=False)
    spec.step("admin2_drop", "admin", "select lockstep.drop_job('band');", show_rows=False)
    spec.step("app2_read", "app", "select count(*) from app.day;")
    spec.step("admin2_rollback", "admin", "rollback;")
    spec.step("app2_commit", "app", "commit;")
    app.execute("insert into app.txn (aid, amount) values (1, 1)")
    r = spec.run(["app2_begin", "app2_write", "admin2_begin", "admin2_unwatch", "admin2_drop", "app2_read",
                  "admin2_rollback", "app2_commit"], step_timeout=30)  # fmt: skip
    assert r.sqlstate("admin2_drop") == "55P03" and not r.waited("admin2_drop"), r.trace
    assert r.sqlstate("app2_read") is None and r.rows("app2_read") == [(41,)], r.trace
    assert not r.waited("app2_read") and r.sqlstate("app2_commit") is None, r.trace  # the failure ended it
    assert enqueue_triggers(app, "app.txn") != [] and enqueue_triggers(app, "app.day") != []
    assert app.execute("select amount from app.txn").fetchall() == [(2,)]


def test_drop_job_gets_its_tables_between_transactions_that_write_child_then_parent(app, dsn):
    """drop_job locks the watched tables one by one (app.acc, then app.txn). Application transactions that
    write app.txn and then app.acc, back to back, always held app.txn while drop_job, holding app.acc, waited
    for it: every attempt timed out and drop_job failed after ~10 s with 55P03. Now the
    next attempt waits for the contended table first, holding nothing, and gets both."""
    stop = threading.Event()
    errors: list[str] = []

    def client(n: int) -> None:
        with psycopg.connect(dsn) as c:
            while not stop.is_set():
                try:
                    with c.transaction():
                        c.execute("update app.txn set amount = amount where aid = %s", [n])
                        c.execute("update app.acc set bal = bal where aid = %s", [n])
                except psycopg.Error as exc:  # never expected: the promise is that none fails
                    errors.append(f"{exc.sqlstate}: {exc}")
                    return

    app.execute("insert into app.txn (aid, amount) values (1, 1), (2, 1)")
    threads = [threading.Thread(target=client, args=(n,)) for n in (1, 2)]
    for t in threads:
        t.start()
    try:
        app.execute("select lockstep.drop_job('band')")  # raised 55P03 after ~10 s
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert enqueue_triggers(app, "app.acc") == [] and enqueue_triggers(app, "app.txn") == []


def test_watch_that_cannot_lock_its_table_says_so_and_changes_nothing(app, connect):
    """watch() on a table an application transaction keeps busy gives up (55P03) after its attempts, with
    the application never waiting more than lock_timeout at a time. The message named unwatch (watch
    dropped the old triggers through unwatch's own attempts): now one set of attempts, named watch."""
    before = enqueue_triggers(app, "app.txn")
    user = connect()
    user.execute("begin")
    user.execute("update app.txn set amount = amount")  # ROW EXCLUSIVE on app.txn until it ends
    admin = connect()
    admin.execute("set deadlock_timeout = '20ms'")  # lock_timeout 10 ms per attempt: ~5 s in all
    with raises_sqlstate("55P03", r"lockstep: watch\('band', 'app.txn'\) could not lock its tables"):
        admin.execute("select lockstep.watch('band', 'app.txn', 'aid')")
    user.execute("rollback")
    assert enqueue_triggers(app, "app.txn") == before


def test_watch_names_the_writers_whose_writes_its_triggers_would_fail(app, connect):
    """A role that may write a watched table but not lockstep's queue gets 42501 on every write once the
    table is watched (docs/security.md lists the grants). watch() names such roles in a WARNING."""
    role = f"lsw_{os.getpid()}_{secrets.token_hex(3)}"
    app.execute(f"create role {role} login")
    try:
        app.execute(f"grant usage on schema app to {role}; grant insert, update on app.txn to {role}")
        col = f"{role}_col"  # a column-level UPDATE is a write too (it was not named)
        app.execute(f"create role {col} login; grant usage on schema app to {col}")
        app.execute(f"grant update (amount) on app.txn to {col}")
        notices: list[str] = []
        app.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
        app.execute("select lockstep.watch('band', 'app.txn', 'aid')")
        text = " ".join(notices)
        assert f"{role} (lacks USAGE on schema lockstep, INSERT on lockstep.queue, INSERT on" in text, notices
        assert f"{col} (lacks USAGE" in text, notices
        app.execute(f"grant usage on schema lockstep to {col}; grant insert on lockstep.queue to {col}")
        notices.clear()
        app.execute("select lockstep.watch('band', 'app.txn', 'aid')")  # says what is still missing
        assert f"{col} (lacks INSERT on lockstep.recompute_flag)" in " ".join(notices), notices
        notices.clear()
        app.execute(
            f"grant usage on schema lockstep to {role};"
            f" grant insert on lockstep.queue, lockstep.recompute_flag to {role}"
        )
        app.execute("select lockstep.watch('band', 'app.txn', 'aid')")
        assert not any("42501" in n for n in notices), notices
    finally:
        app.execute(f"drop owned by {role}; drop role {role}")
        app.execute(f"drop owned by {role}_col; drop role if exists {role}_col")


LONG_SQL = """
create table app.tag (name text primary key, hits integer not null default 0);
create table app.tag_hits (name text primary key references app.tag on delete cascade, hits integer not null);
create function app.tag_compute(keys text[]) returns table (name text, hits integer)
language sql stable as $$ select t.name, t.hits from app.tag t where keys is null or t.name = any(keys) $$;
select lockstep.define_derived('tags_job_with_a_name_of_36_bytes_xx', 'app.tag_hits',
                               'app.tag_compute(text[])', parent => 'app.tag');
"""
# 2,680 bytes that pglz does not compress: the parent's own primary key index holds them (at most 2,704
# bytes a row), the queue's (key, job) index, with the job's name beside them, did not
LONG_KEY = (
    "select left(string_agg(encode(sha256(g::text::bytea), 'base64'), ''), 2680)"
    " from generate_series(1, 61) g"
)
TAGS = "tags_job_with_a_name_of_36_bytes_xx"


@pytest.mark.parametrize("how", ["generated", "shared", "general", "enqueue"])
def test_a_key_too_long_for_the_queue_flags_the_job_instead_of_failing(app, connect, how):
    # the queue's (key, job) index row holds at most 2,704 bytes: a watched INSERT of a parent whose text
    # key was 2,661 bytes or more failed with 54000 (index row size ... exceeds btree maximum)
    app.execute(LONG_SQL)
    if how == "generated":
        app.execute(f"select lockstep.watch('{TAGS}', 'app.tag', 'name')")
    elif how != "enqueue":  # the shared function: fast path (key type given), general path (other names)
        names = "new table as lockstep_new" if how == "shared" else "new table as n"
        arg = ", 'text'" if how == "shared" else ""
        app.execute(
            f"create trigger t after insert on app.tag referencing {names} for each statement"
            f" execute function lockstep.enqueue_trigger('{TAGS}', 'name'{arg})"
        )
    user = connect()
    notices: list[str] = []
    user.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    if how == "enqueue":
        user.execute(f"insert into app.tag (name) values (({LONG_KEY})), ('short')")
        n = user.execute(f"select lockstep.enqueue('{TAGS}', array[({LONG_KEY}), 'short'])").fetchone()[0]
        assert n == 1
    else:
        user.execute(f"insert into app.tag (name) values (({LONG_KEY})), ('short')")  # does not fail
    assert queue(app, TAGS) == ["short"]
    assert flag(app, TAGS)[0] and "too long for the queue" in flag(app, TAGS)[1]
    assert any("too long for the queue" in n for n in notices)
    app.execute(f"select lockstep.recompute('{TAGS}')")
    assert app.execute("select count(*) from app.tag_hits").fetchone()[0] == 2
    assert flag(app, TAGS) == (False, None)


@pytest.mark.parametrize("col_type", ["char(8)", "varchar(8)"])
def test_the_shared_fast_path_queues_the_key_as_the_key_type_reads_the_column(app, col_type):
    """The shared trigger function's fast path (watch() by a job owner who may not create functions in
    schema lockstep, or one's own trigger following README's recipe) read the key through to_jsonb of the
    row, trusting its third argument for the column's type: a char(8) column under a text key queued 'ab'
    as 'ab      ' (JSON keeps char(n)'s padding, the cast to text drops it), a key that names no parent, so
    the pass wrote nothing and the change waited for the periodic recompute, status healthy (an owner's
    `alter column ... type char(8)` after watch() is enough). The fast path now takes only
    a column whose own type reads as the key type's text; any other goes by the general path's cast."""
    app.execute(LONG_SQL)
    app.execute(
        f"create table app.tag_use (id integer primary key, name {col_type} not null references app.tag"
        " on delete cascade)"
    )
    for op, names in [
        ("insert", "new table as lockstep_new"),
        ("update", "old table as lockstep_old new table as lockstep_new"),
    ]:  # as watch() makes them for a job owner: the key type given
        app.execute(
            f"create trigger use_{op} after {op} on app.tag_use referencing {names} for each statement"
            f" execute function lockstep.enqueue_trigger('{TAGS}', 'name', 'text')"
        )
    app.execute("insert into app.tag (name) values ('ab'), ('cd')")
    app.execute("delete from lockstep.queue")
    app.execute("insert into app.tag_use values (1, 'ab')")
    app.execute("update app.tag_use set name = 'cd' where id = 1")  # a move: the old parent and the new
    assert queue(app, TAGS) == ["ab", "ab", "cd"]
    assert flag(app, TAGS) == (False, None)


@pytest.mark.parametrize("how", ["shared", "generated"])
def test_a_watched_table_with_a_column_named_like_the_row_alias_queues_its_keys(app, how):
    """The shared function read the key through to_jsonb(x) ... from lockstep_new x: in a table with a
    column named x, x is that column, so a jsonb x queued its "name" member and an int x queued nothing,
    nothing flagged. It reads to_jsonb(x.*), the row, now."""
    app.execute(LONG_SQL)
    app.execute(
        "create table app.tag_use (id int primary key, name text not null references app.tag, x jsonb)"
    )
    if how == "generated":
        app.execute(f"select lockstep.watch('{TAGS}', 'app.tag_use', 'name')")
    else:  # as watch() makes it for a job owner who may not create functions in schema lockstep
        app.execute(
            "create trigger use_ins after insert on app.tag_use referencing new table as lockstep_new"
            f" for each statement execute function lockstep.enqueue_trigger('{TAGS}', 'name', 'text')"
        )
    app.execute("insert into app.tag (name) values ('ab'), ('cd')")
    app.execute("delete from lockstep.queue; delete from lockstep.recompute_flag")
    app.execute("""insert into app.tag_use values (1, 'ab', '{"name": "zz"}'), (2, 'cd', null)""")
    assert queue(app, TAGS) == ["ab", "cd"] and flag(app, TAGS) == (False, None)


def test_a_hand_written_trigger_never_reads_a_session_table_named_like_watchs_transition_tables(app):
    """A trigger of one's own with other transition-table names and the key type argument took the fast
    path, whose static read names lockstep_new: a temp table of that name was read instead of the
    statement's rows. The fast path is not taken while such a relation is visible."""
    app.execute(LONG_SQL)
    app.execute("create table app.t2 (id int primary key, name text not null references app.tag)")
    app.execute(
        "create trigger t2i after insert on app.t2 referencing new table as n for each statement"
        f" execute function lockstep.enqueue_trigger('{TAGS}', 'name', 'text')"
    )
    app.execute("insert into app.tag (name) values ('ab')")
    app.execute("create temp table lockstep_new (name text); insert into lockstep_new values ('zz')")
    app.execute("delete from lockstep.queue")
    app.execute("insert into app.t2 values (1, 'ab')")
    assert queue(app, TAGS) == ["ab"]


def test_a_role_that_may_not_read_pg_attribute_writes_and_flags_the_job(app, connect, dsn):
    """The fast paths probe pg_attribute for the key column's type: with SELECT on it revoked from PUBLIC,
    the shared function's probe (outside any block) failed every write of the application (42501),
    and so did the generated function's. Both now take the general path, whose reads are in
    blocks: the write goes through and the job is flagged for its recompute, saying why."""
    app.execute(LONG_SQL)
    role = f"lsa_{os.getpid()}_{secrets.token_hex(3)}"
    app.execute(
        "create table app.use_s (id int primary key, name text not null references app.tag);"
        " create table app.use_g (id int primary key, name text not null references app.tag);"
        " create trigger s_ins after insert on app.use_s referencing new table as lockstep_new"
        f" for each statement execute function lockstep.enqueue_trigger('{TAGS}', 'name', 'text');"
        f" select lockstep.watch('{TAGS}', 'app.use_g', 'name');"
        " insert into app.tag (name) values ('ab');"
        f" create role {role} login; grant usage on schema app, lockstep to {role};"
        f" grant insert on lockstep.queue, lockstep.recompute_flag to {role};"
        f" grant select on app.tag to {role}; grant insert on app.use_s, app.use_g to {role}"
    )
    try:
        app.execute("revoke select on pg_catalog.pg_attribute from public")
        with connect(make_conninfo(dsn, user=role)) as user:
            for n, table in enumerate(["app.use_s", "app.use_g"]):
                app.execute("delete from lockstep.recompute_flag")
                user.execute(f"insert into {table} values ({n}, 'ab')")  # does not fail
                flagged, problem = flag(app, TAGS)
                assert flagged and "permission denied" in problem, (table, problem)
    finally:
        app.execute("grant select on pg_catalog.pg_attribute to public")
        app.execute(f"drop owned by {role}; drop role {role}")


def test_a_recompute_keeps_the_flag_its_own_hand_off_raised_even_in_one_transaction(app, connect):
    """A recompute that hands a key too long for the queue off flags the job (that parent is not written
    yet). Two recomputes in one transaction: the second cleared the first one's flag and its own
    (pg_visible_in_snapshot counts the transaction's own xid as seen once a later one has committed), the
    parent stayed stale and nothing said so. The flag is kept."""
    app.execute(LONG_SQL)
    longs = [f"'{c}' || ({LONG_KEY})" for c in "xyz"]  # three, so that each recompute hands one off
    app.execute(
        f"insert into app.tag (name, hits) values ('a', 1), ('b', 2), {', '.join(f'({k}, 3)' for k in longs)}"
    )
    app.execute(f"select lockstep.set_batch_parents('{TAGS}', 1)")
    other = connect()
    with app.transaction():
        app.execute("select pg_current_xact_id()")  # the transaction has its xid before either snapshot
        for _ in range(2):  # each writes the first parent left (a long key first), hands the others off
            other.execute("select pg_current_xact_id()")  # a later xid commits: xmax passes ours
            assert result(app, f"lockstep.recompute('{TAGS}')")["outcome"] == "done"
    assert [r[0][0] for r in app.execute("select name from app.tag_hits order by name")] == ["x", "y"]
    assert flag(app, TAGS)[0] and "too long for the queue" in flag(app, TAGS)[1]  # before: no flag
    # the flag makes the recompute due: run() writes the long key's parent and only then clears it
    for _ in range(5):
        result(app, f"lockstep.run('{TAGS}')")
    assert app.execute("select count(*) from app.tag_hits").fetchone()[0] == 5
    assert flag(app, TAGS) == (False, None)


def test_a_recompute_writes_the_parents_of_keys_too_long_for_the_queue_in_its_batch(app):
    """A recompute hands what exceeds its batch to the queue; a key too long for the queue flags the job for
    another full recompute instead. With the long key last, each recompute wrote one batch and flagged the
    job again while the worker had not caught up: one whole compute per batch_parents parents.
    Parents of long keys are now written in the batch, so one recompute and the worker converge."""
    app.execute(LONG_SQL)
    app.execute(
        "insert into app.tag (name, hits) select 'k' || g, g from generate_series(1, 6) g;"
        f" insert into app.tag (name, hits) values ('zz' || ({LONG_KEY}), 7)"
    )
    app.execute(f"select lockstep.set_batch_parents('{TAGS}', 2)")
    app.execute("delete from lockstep.run_log")
    r = result(app, f"lockstep.recompute('{TAGS}')")
    assert (r["outcome"], r["inserted"]) == ("done", 2)
    assert app.execute("select count(*) from app.tag_hits where name like 'zz%'").fetchone()[0] == 1
    assert flag(app, TAGS) == (False, None)  # before: flagged, so the next run() recomputed everything
    assert queue(app, TAGS) == ["k2", "k3", "k4", "k5", "k6"]
    for _ in range(10):
        result(app, f"lockstep.run('{TAGS}')")
    assert app.execute("select count(*) from app.tag_hits").fetchone()[0] == 7
    assert (
        app.execute(
            f"select count(*) from lockstep.run_log where job = '{TAGS}' and action = 'recompute'"
        ).fetchone()[0]
        == 1
    )


# -- the hostile application catalogue ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def twopc_dsn() -> Iterator[str]:
    if not pg_cluster.AVAILABLE:
        pytest.skip(pg_cluster.MISSING)
    with pg_cluster.running("lockstep-2pc-", full_page_writes="on", max_prepared_transactions="5") as c:
        dsn = make_conninfo(c.dsn, dbname="app")
        with psycopg.connect(c.dsn, autocommit=True) as admin:
            admin.execute("create database app")
        migrate(dsn)
        install_app(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "create table app.ledger (id bigint generated always as identity primary key,"
                " aid bigint not null references app.acc on delete cascade, amount integer not null)"
            )
            for op, ref in [
                ("insert", "new table as fresh"),
                ("update", "old table as stale new table as fresh"),
                ("delete", "old table as stale"),
            ]:
                conn.execute(
                    f"create trigger mine_{op} after {op} on app.ledger referencing {ref} for each statement"
                    " execute function lockstep.enqueue_trigger('band', 'aid')"
                )
        yield dsn


def test_item6_prepare_transaction_on_a_watched_table(twopc_dsn):
    with psycopg.connect(twopc_dsn, autocommit=True) as c:
        c.execute("delete from lockstep.queue")  # the old trigger's NOTIFY fired on an empty queue
        c.execute("begin")
        c.execute("update app.acc set bal = bal + 1 where aid = 9")
        c.execute(
            "prepare transaction 'item6'"
        )  # before: "cannot PREPARE a transaction that has executed NOTIFY"
        c.execute("commit prepared 'item6'")
        assert queue(c, "band") == ["9"]


APP_STATEMENTS = [
    "update app.acc set bal = bal + 1 where aid = {a}",
    "insert into app.txn (aid, amount) values ({a}, -7), ({b}, 3)",
    "update app.txn set aid = {b} where id = (select min(id) from app.txn where aid = {a})",
    "insert into app.ledger values (default, {a}, 1)",  # positional: the admin renames its columns
    "delete from app.ledger where id = (select max(id) from app.ledger)",
    "update app.day set v = v + 1 where d = date '2024-01-01' + {a}",
    "insert into app.acc (aid) values ({new}) on conflict do nothing",
    "delete from app.acc where aid = {new}",
    "update app.tacc set bal = bal + 1 where tenant = 1 + {a} % 2 and aid = {a}",
    "insert into app.ttxn values (default, 1, {a}, -7), (default, 2, {b}, 3)",  # positional, as app.ledger
    "update app.ttxn set amount = amount + 1 where id = (select max(id) from app.ttxn)",
    "delete from app.ttxn where id = (select min(id) from app.ttxn)",
    "insert into app.tledger values (default, 1, {a}, 1)",  # positional: the admin renames its columns
    "delete from app.tledger where id = (select max(id) from app.tledger)",
    "insert into app.tacc (tenant, aid) values (2, {new}) on conflict do nothing",
    "delete from app.tacc where tenant = 2 and aid = {new}",
]
LEVELS = ["read committed", "repeatable read", "serializable"]
DATESTYLES = ["ISO, MDY", "SQL, DMY"]


def _app_round(dsn: str, round_no: int) -> list[str]:
    """Every app statement, under every isolation level and DateStyle, committed or prepared: the errors."""
    errors: list[str] = []
    n = 0
    for level in LEVELS:
        for style in DATESTYLES:
            for prepared in (False, True):
                n += 1
                a, b = 1 + (round_no * 7 + n) % 12, 13 + n % 7
                with psycopg.connect(dsn, autocommit=True) as c:
                    c.execute(f"set datestyle = '{style}'")
                    try:
                        c.execute(f"begin isolation level {level}")
                        for s in APP_STATEMENTS:
                            c.execute(s.format(a=a, b=b, new=1000 + round_no * 100 + n))
                        if prepared:
                            gid = f"r{round_no}_{n}"
                            c.execute(f"prepare transaction '{gid}'")
                            c.execute(f"commit prepared '{gid}'")
                        else:
                            c.execute("commit")
                    except psycopg.Error as exc:
                        errors.append(f"{level} / {style} / prepared={prepared}: {exc}")
    return errors


def _settle(conn: psycopg.Connection, jobs: list[str]) -> None:
    """Drain with work() alone: converged, or flagged and then converged after the recompute."""
    for job in jobs:
        drain(conn, job)
        if flag(conn, job)[0]:
            conn.execute("select lockstep.recompute(%s)", [job])
            assert flag(conn, job) == (False, None)
        assert divergence(conn, job) == 0, job


def test_hostile_application_catalogue(twopc_dsn):
    admin = psycopg.connect(twopc_dsn, autocommit=True)
    actions: list[tuple[str, list[str], str | None]] = [
        # (admin action, jobs to check, the job that must end flagged)
        ("select 1", ["band", "days", "tband"], None),
        (
            "select lockstep.define_derived('band', 'app.band', 'app.band_compute(bigint[])',"
            " parent => 'app.acc', every => '1 day', backoff => '2 hours')",
            ["band", "days", "tband"],
            None,
        ),
        ("alter table app.ledger rename column aid to account", ["band", "days", "tband"], "band"),
        ("alter table app.ledger rename column account to aid", ["band", "days", "tband"], None),
        ("alter table app.tledger rename column aid to account", ["band", "days", "tband"], "tband"),
        ("alter table app.tledger rename column account to aid", ["band", "days", "tband"], None),
        ("select lockstep.unwatch('days', 'app.day')", ["band", "tband"], None),
        ("select lockstep.drop_job('days')", ["band", "tband"], None),
        ("select lockstep.drop_job('band')", ["tband"], None),
        ("select lockstep.drop_job('tband')", [], None),
    ]
    for i, (action, jobs, flagged) in enumerate(actions):
        admin.execute(action)
        errors = _app_round(twopc_dsn, i)
        assert errors == [], f"after {action}: {errors}"
        for job in jobs:
            assert flag(admin, job)[0] == (job == flagged), (action, job, flag(admin, job))
        if "unwatch" in action:  # no longer fed: the admin recomputes (or watches again)
            admin.execute("select lockstep.recompute('days')")
        _settle(admin, jobs)
    # drop_job took the user's own triggers too (they name the job)
    tables = ("app.acc", "app.txn", "app.ledger", "app.day", "app.tacc", "app.ttxn", "app.tledger")
    assert [enqueue_triggers(admin, t) for t in tables] == [[]] * len(tables)
    admin.close()


# -- the queue stays small under churn -----------------------------------------------------------------


def test_a_runner_that_owns_the_queue_vacuums_it_without_locking_writers_out(app, connect):
    from lockstep import db

    for _ in range(3):
        app.execute("update app.acc set bal = bal + 1")
        drain(app, "band")
    assert db.may_vacuum_queue(app)  # the tests' superuser
    writer = connect(autocommit=False)
    writer.execute("update app.acc set bal = bal + 1 where aid = 1")  # holds RowExclusiveLock on the queue
    db.vacuum_queue(app)  # does not wait for it
    writer.commit()
    options = app.execute(
        "select reloptions from pg_class where oid = 'lockstep.queue'::regclass"
    ).fetchone()[0]
    assert (
        "vacuum_truncate=false" in options
    )  # no vacuum takes the ACCESS EXCLUSIVE lock enqueuers would wait for
    role = f"ls_not_owner_{os.getpid()}"
    app.execute(f"create role {role}")
    try:
        app.execute(f"set role {role}")
        assert not db.may_vacuum_queue(app)
    finally:
        app.execute("reset role")
        app.execute(f"drop role {role}")
