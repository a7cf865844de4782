"""The worker pass: reused work tables (no catalog churn, pooler-safe), unreadable queued keys, slow keys.

A no-op recompute and a no-op worker pass write no catalog row once the session's
work tables exist; two jobs of different shapes alternating on one connection, a DISCARD ALL in between
(what a pooler's server_reset_query does) and a retyped target column all keep working.
A queued key that cannot be read back is parked with its error, the rest moves.
A key slower than statement_timeout is isolated like a poison key, the rest moves.
"""

from __future__ import annotations

import threading

import psycopg
import pytest
from isolation import wait_for_lock_wait
from util import not_due, result

from lockstep.lab.example import JOB, divergence

CATALOG_WRITES_SQL = (
    "select coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint from pg_stat_xact_sys_tables"
    " where schemaname = 'pg_catalog'"
)
FLUSH_SQL = "select pg_stat_force_next_flush()"


def catalog_writes(conn: psycopg.Connection, call: str) -> int:
    """Catalog rows inserted, updated or deleted by ``select * from <call>``, in its own transaction."""
    conn.execute(FLUSH_SQL)  # PostgreSQL 15's pg_stat_xact_* also show this session's unflushed counts
    with conn.transaction():
        conn.execute(f"select * from {call}").fetchall()
        n = conn.execute(CATALOG_WRITES_SQL).fetchone()[0]
    return int(n)


def work_until_idle(conn: psycopg.Connection, job: str = JOB, batch: int = 500, limit: int = 50) -> None:
    for _ in range(limit):
        if not result(conn, f"lockstep.work('{job}', {batch})")["more"]:
            return
    raise AssertionError(f"{job}: still more after {limit} passes")


# no catalog churn, pooled use --------------------------------------------------------------------------


def test_noop_runs_write_no_catalog_row_once_the_work_tables_exist(ex):
    # first run of the session: creates its work tables (catalog rows, once)
    assert catalog_writes(ex, f"lockstep.recompute('{JOB}')") > 0
    # the same no-op recompute again: nothing in the catalog (no CREATE, DROP or ANALYZE)
    assert catalog_writes(ex, f"lockstep.recompute('{JOB}')") == 0
    # a worker pass over keys whose rows are unchanged: no catalog row either, twice
    for _ in range(2):
        ex.execute(f"select lockstep.enqueue('{JOB}', array[1, 2, 3, 50, 77])")
        assert catalog_writes(ex, f"lockstep.work('{JOB}')") == 0
        assert ex.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
    # a pass that writes rows: still no catalog row
    ex.execute("update example.exam set body = body || ' catalogfree' where id in (4, 5)")
    assert catalog_writes(ex, f"lockstep.work('{JOB}')") == 0
    assert divergence(ex) == (0, 0)


SECOND_JOB_SQL = """
create table example.exam_len (
    exam_id bigint primary key references example.exam (id) on delete cascade,
    body_len integer not null,
    title text not null
);
create function example.exam_len_compute(ids bigint[])
returns table (exam_id bigint, body_len integer, title text)
language sql stable
as $$
    select e.id, length(e.body), e.title from example.exam e where ids is null or e.id = any(ids)
$$;
select lockstep.define_derived('exam_len', 'example.exam_len', 'example.exam_len_compute(bigint[])',
                               parent => 'example.exam', parent_column => 'exam_id', every => '1 day');
select lockstep.watch('exam_len', 'example.exam', 'id');
"""


def len_divergence(conn: psycopg.Connection) -> int:
    return conn.execute(
        "select count(*) from ((select * from example.exam_len_compute(null) except all"
        " select exam_id, body_len, title from example.exam_len) union all"
        " (select exam_id, body_len, title from example.exam_len except all"
        " select * from example.exam_len_compute(null))) d"
    ).fetchone()[0]


def temp_rows(conn: psycopg.Connection) -> int:
    """Rows in this session's lockstep work tables (as another client of the same connection sees them)."""
    n = 0
    for (name,) in conn.execute(
        "select c.oid::regclass::text from pg_class c where c.relnamespace = pg_my_temp_schema()"
        " and c.relname like 'lockstep\\_%' and c.relkind = 'r'"
    ).fetchall():
        n += conn.execute(f"select count(*) from {name}").fetchone()[0]
    return n


def test_two_jobs_alternating_on_one_connection_discard_all_and_a_retyped_column(ex):
    """What a transaction pooler does: consecutive transactions of one server connection serve other jobs
    and clients; a server reset (DISCARD ALL) drops the temp tables."""
    ex.execute(SECOND_JOB_SQL)
    assert result(ex, "lockstep.recompute('exam_len')")["outcome"] == "done"
    for step in range(6):
        ids = [1 + step * 7, 2 + step * 7, 150 - step]
        ex.execute("update example.exam set body = body || %s where id = any(%s)", [f" s{step}word", ids])
        # the two jobs (different shapes) take turns on this connection
        for job in ("exam_len", JOB) if step % 2 else (JOB, "exam_len"):
            r = result(ex, f"lockstep.work('{job}')")
            assert r["outcome"] == "done" and r["error"] is None, r
        # another client of the connection finds nothing left over
        assert temp_rows(ex) == 0
        if step == 2:
            ex.execute("discard all")
            assert temp_rows(ex) == 0
        if step == 3:
            # a retyped target column: another shape, other work tables (never the old column type)
            ex.execute("alter table example.exam_len alter column title type varchar(200)")
    assert ex.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
    assert divergence(ex) == (0, 0)
    assert len_divergence(ex) == 0
    # both recomputes are no-ops now, and in this session they no longer touch the catalog
    result(ex, "lockstep.recompute('exam_len')")
    assert catalog_writes(ex, "lockstep.recompute('exam_len')") == 0
    assert catalog_writes(ex, f"lockstep.recompute('{JOB}')") == 0


def test_two_sessions_running_the_same_job_one_after_the_other(ex, exconnect):
    other = exconnect()
    for step, conn in enumerate((ex, other, ex, other)):
        ex.execute("update example.exam set body = body || %s where id = %s", [f" t{step}x", 10 + step])
        assert result(conn, f"lockstep.work('{JOB}')")["outcome"] == "done"
    assert divergence(ex) == (0, 0)


# a queued key that cannot be read back ----------------------------------------------------------------


def test_an_unreadable_queued_key_is_parked_and_the_rest_of_the_queue_moves(ex):
    ex.execute("update example.exam set body = body || ' fresh' where id in (3, 4)")
    # what an application role that may INSERT into the queue can do
    ex.execute(f"insert into lockstep.queue (job, key) values ('{JOB}', '3.00'), ('{JOB}', 'x7')")
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["outcome"] == "done", r
    assert "cannot be read as bigint" in r["error"]
    assert r["inserted"] >= 2
    parked = ex.execute("select key, last_error from lockstep.parked_keys order by key").fetchall()
    assert [k for k, _ in parked] == ["3.00", "x7"]
    assert all("invalid input syntax for type bigint" in e for _, e in parked)
    # the good keys are done, the bad entries stay visible (parked, counted in queue_depth)
    assert ex.execute("select key from lockstep.queue order by key").fetchall() == [("3.00",), ("x7",)]
    st = ex.execute("select parked_keys, queue_depth, last_outcome from lockstep.status").fetchone()
    assert st == (2, 2, "done")
    # such a key names no parent a pass could compute (an enum label renamed since, say): the change it
    # stands for waited for the periodic recompute, up to its `every`. That recompute is
    # due now: run() recomputes, which cures the parked keys; the queue moves on
    assert ex.execute("select next_run_at <= now() from lockstep.status").fetchone()[0]
    assert result(ex, f"lockstep.run('{JOB}')")["action"] == "recompute"
    st = ex.execute("select parked_keys, queue_depth, needs_recompute from lockstep.status").fetchone()
    assert st == (0, 0, None)
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "idle"
    ex.execute("update example.exam set body = body || ' later' where id = 9")
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "done"
    assert divergence(ex) == (0, 0)


# a slow key under statement_timeout -------------------------------------------------------------------

SLOW_COMPUTE_SQL = """
create function example.slow_13(ids bigint[]) returns table (exam_id bigint, key text, weight integer)
language plpgsql stable as $$
begin
    if 13 = any(ids) then
        perform pg_catalog.pg_sleep(60);  -- far beyond statement_timeout: only the timeout ends it
    end if;
    return query select * from example.exam_key_compute(ids);
end $$;
"""


def test_a_slow_key_is_isolated_like_a_poison_key_and_the_rest_moves(ex):
    ex.execute(SLOW_COMPUTE_SQL)
    ex.execute(
        f"select lockstep.define_derived('{JOB}', 'example.exam_key', 'example.slow_13(bigint[])',"
        " 'example.exam', every => '1 day')"
    )
    not_due(ex, JOB)
    ex.execute("update example.exam set body = body || ' slowword' where id between 1 and 24")
    ex.execute("set statement_timeout = '400ms'")
    outcomes = []
    for _ in range(30):
        r = result(ex, f"lockstep.work('{JOB}', 500)")
        outcomes.append(r["outcome"])
        left = {k for (k,) in ex.execute("select distinct key from lockstep.queue")}
        failing = ex.execute("select key, attempts from lockstep.key_failure where attempts > 0").fetchall()
        if left == {"13"} and [k for k, _ in failing] == ["13"]:
            break
        # no waiting in a test: make every backoff and every suspect's wait due now
        ex.execute("update lockstep.job_state set retry_at = now() - interval '1 second'")
        ex.execute("update lockstep.key_failure set retry_at = now() - interval '1 second'")
    else:
        raise AssertionError(f"key 13 not isolated after 30 passes: {outcomes}")
    ex.execute("reset statement_timeout")
    err = ex.execute("select last_error from lockstep.failing_keys where key = '13'").fetchone()[0]
    assert "statement timeout" in err
    # every other changed exam is written; only exam 13 is stale
    stale = ex.execute(
        "select distinct exam_id from ((select * from example.exam_key_compute(null) except all"
        " select * from example.exam_key) union all (select * from example.exam_key except all"
        " select * from example.exam_key_compute(null))) d"
    ).fetchall()
    assert stale == [(13,)]
    assert "failed" not in outcomes[-1:]
    # the job is not failed and not in backoff: new work moves at once
    ex.execute("update example.exam set body = body || ' afterwards' where id = 30")
    ex.execute("set statement_timeout = '400ms'")
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "done"
    ex.execute("reset statement_timeout")
    assert ex.execute("select count(*) from lockstep.queue where key = '30'").fetchone()[0] == 0


# a pass that isolates failures holds row locks for one write phase ------------------------------------
GATED_SCHEMA = """
create table p (id int primary key, v int not null);
create table d (p_id int primary key references p on delete cascade, v int not null);
create function gate(id int) returns int language plpgsql as $$
begin
    if id = 2 then
        perform pg_advisory_xact_lock_shared(4242);  -- held by the test: key 2's compute waits here
    end if;
    return 0;
end $$;
create function dc(ids int[]) returns table (p_id int, v int) language sql stable
    as $$ select id, v / v + public.gate(id) from public.p where ids is null or id = any(ids) $$;
select lockstep.define_derived('d', 'd', 'dc(int[])', 'p');
"""


@pytest.mark.parametrize("kind", ["retry", "bisection"])
def test_a_part_written_early_in_a_pass_holds_no_lock_while_later_parts_compute(conn, connect, kind):
    """A retry pass (its keys tried one by one) and a bisection wrote each good part as it went, in
    subtransactions whose row locks stay to the end of the pass, through the computes of every later part:
    an application's DELETE of a parent written early waited for them. A bisection now tries its
    parts dry and writes the good keys together at the end (one write phase holds row locks); a retry pass
    ends after the first key it writes."""
    conn.execute(GATED_SCHEMA)
    conn.execute("insert into p values (1, 1), (2, 1), (3, 0)")  # 3 is poison: 1 / 0
    conn.execute("select lockstep.enqueue('d', array[1, 2, 3])")
    not_due(conn, "d")
    if kind == "retry":
        conn.execute(
            "insert into lockstep.key_failure (job, key, attempts, last_error, retry_at, parked)"
            " values ('d', '1', 1, 'x', now(), false), ('d', '2', 1, 'x', now(), false)"
        )
    gate = connect()
    gate.execute("begin")
    gate.execute("select pg_advisory_xact_lock(4242)")
    if kind == "retry":
        # the pass ends once it has held row locks for its budget (here 0: after key 1, the first key it
        # wrote): key 2's compute (at the gate) is the next pass's, so this one returns with key 1's locks
        # held only to its commit
        conn.execute(
            "create or replace function lockstep._retry_budget() returns interval language sql immutable"
            " as $$ select interval '0' $$"
        )
        worker = connect()
        worker.execute("set statement_timeout = '20s'")  # before: waited at key 2's gate, key 1's locks held
        r = result(worker, "lockstep.work('d')")
        assert (r["outcome"], r["inserted"], r["more"]) == ("done", 1, True), r
        app = connect()
        app.execute("set lock_timeout = '2s'")
        app.execute("delete from p where id = 1")
        gate.execute("commit")
        for _ in range(5):
            conn.execute("update lockstep.key_failure set retry_at = now() where not parked")
            result(conn, "lockstep.work('d')")
        assert conn.execute("select p_id from d order by 1").fetchall() == [(2,)]
        return
    worker = connect()
    wpid = worker.execute("select pg_backend_pid()").fetchone()[0]
    out: list = []
    t = threading.Thread(target=lambda: out.append(result(worker, "lockstep.work('d')")))
    t.start()
    try:
        # batch [1, 2, 3]: the whole pass waits at key 2's gate; let it through once, so it fails on 3 and
        # bisects: [1] goes through (before: written, its locks held), [2, 3] waits at the gate again
        wait_for_lock_wait(conn, pid=wpid)
        gate.execute("commit")
        gate.execute("begin")
        gate.execute("select pg_advisory_xact_lock(4242)")
        wait_for_lock_wait(conn, pid=wpid)
        app = connect()
        app.execute("set lock_timeout = '2s'")
        app.execute("delete from p where id = 1")  # before: 55P03, waiting on the pass's pin of parent 1
    finally:
        gate.execute("commit")
        t.join(timeout=30)
    assert out and out[0]["outcome"] == "done", out
    for _ in range(5):
        conn.execute("update lockstep.key_failure set retry_at = now() where not parked")
        result(conn, "lockstep.work('d')")
    assert conn.execute("select p_id from d order by 1").fetchall() == [(2,)]


def test_a_recompute_that_hands_off_cures_the_keys_it_wrote_and_tries_the_handed_off_ones_at_once(conn):
    """A recompute whose whole-table pass went through but handed parents off (more than batch_parents
    changed) cured no failing or parked key: a parked parent the application had fixed was handed off, and
    the worker left it for its retry_at (up to the job's backoff, an hour) unwritten, lockstep status
    unhealthy. The keys still queued are now due at once, parked ones too, and keep
    their attempts: the fixed parent is written, and a parent that still fails at its write is parked again,
    not forgotten (going by entries newer than the recompute alone would forget it)."""
    conn.execute(
        """
        create table p (id int primary key, v int not null);
        insert into p select g, g from generate_series(1, 5) g;
        create table d (id int primary key references p on delete cascade, w int not null check (w <= 50));
        create function d_compute(ids int[]) returns table (id int, w int) language sql stable as $$
            select p.id, 100 / (p.v - 3) from public.p p where ids is null or p.id = any(ids) $$;
        select lockstep.define_derived('d', 'public.d', 'public.d_compute(int[])', parent => 'public.p');
        select lockstep.watch('d', 'public.p', 'id');
        select lockstep.set_max_attempts('d', 1);
        select lockstep.set_batch_parents('d', 1);
        """
    )
    # the whole-table pass fails on parent 3 (division by zero): every parent handed off, 3 parked, and 4
    # (100 > 50: its write fails the check) parked too
    conn.execute("select lockstep.run('d')")
    for _ in range(10):
        conn.execute("select lockstep.work('d')")
    parked = "select key, parked from lockstep.failing_keys where job = 'd' order by key"
    assert conn.execute(parked).fetchall() == [("3", True), ("4", True)]
    conn.execute("set session_replication_role = replica")  # parent 3 fixed behind the triggers' back
    conn.execute("update p set v = v + 10 where id in (1, 2, 3)")
    conn.execute("reset session_replication_role")
    r = result(conn, "lockstep.recompute('d')")
    assert (r["outcome"], r["more"]) == ("done", True)  # one parent written, the others handed off
    assert conn.execute(parked).fetchall() == [("3", True), ("4", True)]  # kept, due at once
    for _ in range(10):
        if result(conn, "lockstep.run('d')")["outcome"] == "idle":
            break
    assert conn.execute("select id, w from d order by id").fetchall() == [(1, 12), (2, 11), (3, 10), (5, 50)]
    assert conn.execute(parked).fetchall() == [("4", True)]  # still failing: parked again, not forgotten


def test_an_unreadable_key_is_forgotten_by_a_recompute_that_hands_off(conn):
    """A recompute that handed off kept every failing key still queued, an unreadable one too (a queue row
    written by hand): the next pass parked it again, which made the recompute due, which handed off again,
    for ever (310 full recomputes in 8 s of a job every hour). It is forgotten, with its
    entries, as by a recompute that hands nothing off."""
    conn.execute(
        """
        create table p (id int primary key, v int not null);
        insert into p select g, g from generate_series(1, 10) g;
        create table e (id int primary key references p on delete cascade, w int not null);
        create function e_compute(ids int[]) returns table (id int, w int) language sql stable as $$
            select p.id, p.v from public.p p where ids is null or p.id = any(ids) $$;
        select lockstep.define_derived('e', 'public.e', 'public.e_compute(int[])', parent => 'public.p',
                                       every => '1 hour');
        select lockstep.watch('e', 'public.p', 'id');
        select lockstep.set_batch_parents('e', 2);
        """
    )
    for _ in range(10):
        if result(conn, "lockstep.run('e')")["outcome"] == "idle":
            break
    conn.execute("insert into lockstep.queue (job, key) values ('e', 'abc')")  # names no parent
    assert result(conn, "lockstep.run('e')")["action"] == "work"  # parks it, makes the recompute due
    conn.execute("set session_replication_role = replica")  # every parent changed behind the triggers' back
    conn.execute("update p set v = v + 1")
    conn.execute("reset session_replication_role")
    actions = []
    for _ in range(30):
        r = result(conn, "lockstep.run('e')")
        if r["outcome"] == "idle":
            break
        actions.append(r["action"])
    assert r["outcome"] == "idle" and actions.count("recompute") == 1, actions
    assert conn.execute("select count(*) from lockstep.failing_keys where job = 'e'").fetchone()[0] == 0
    assert conn.execute("select count(*) from e where w <> id + 1").fetchone()[0] == 0
