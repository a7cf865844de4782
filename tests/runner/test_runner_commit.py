"""How a runner's pass commits: without waiting for the WAL flush, and nothing lost by it.

A pass's transaction deletes its queue entries and writes the derived rows together, so a crash that
loses its commit loses both: the entries are back and the next pass redoes them. The runner therefore
commits each pass with synchronous_commit = off (SET LOCAL: the session's own setting is untouched), unless
the operator asks otherwise (--synchronous-commit). The application's commits are untouched.

A throw-away cluster (tests/pg_cluster.py) whose synchronous_standby_names names a standby that never
connects: a transaction committing with synchronous_commit = on waits for it forever (wait event SyncRep),
one with off does not. That makes the commit mode visible in pg_stat_activity, with no timing. The
test's own sessions commit with synchronous_commit = local.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pg_cluster
import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from runner_procs import wait_for

from lockstep import db
from lockstep.lab import example
from lockstep.lab.example import JOB, divergence
from lockstep.migrate import migrate

pytestmark = pytest.mark.skipif(not pg_cluster.AVAILABLE, reason=pg_cluster.MISSING)
LOCAL = "-c synchronous_commit=local"  # the test's own sessions: never wait for the absent standby


@pytest.fixture(scope="module")
def cluster() -> Iterator[pg_cluster.Cluster]:
    # wal_writer_delay 10 s: an asynchronous commit stays in the WAL buffers until a crash takes it, unless
    # something flushes it first
    with pg_cluster.running(
        "lockstep-syncrep-",
        synchronous_standby_names="nobody",
        wal_writer_delay="10s",
        synchronous_commit="on",
    ) as c:
        yield c


@pytest.fixture
def dsn(cluster: pg_cluster.Cluster) -> Iterator[str]:
    """A database with lockstep and the example (10 exams, converged, nothing queued); its DSN carries no
    options, so a session on it commits as the server's default says (on)."""
    name = f"commit_{os.getpid()}_{time.monotonic_ns()}"
    local = make_conninfo(cluster.dsn, options=LOCAL)
    with psycopg.connect(local, autocommit=True) as admin:
        admin.execute(f'create database "{name}"')
    plain = make_conninfo(cluster.dsn, dbname=name)
    migrate(make_conninfo(plain, options=LOCAL))
    with app(plain) as c:
        example.install(c, parents=10)
        c.execute("select lockstep.recompute(%s)", [JOB])
        c.execute("delete from lockstep.queue")
        c.execute("update lockstep.job_state set next_run_at = 'infinity' where job = %s", [JOB])
    # not dropped: a pass's session that made temp tables drops them in a transaction as it exits, which
    # waits for the absent standby (its session commits as the server's default says). The cluster goes
    # at the end of the module, with those sessions.
    yield plain


def app(dsn: str) -> psycopg.Connection:
    return psycopg.connect(make_conninfo(dsn, options=LOCAL), autocommit=True)


def change(c: psycopg.Connection) -> None:
    c.execute("update example.exam_item set body = body || ' changed' where exam_id in (2, 3)")
    assert c.execute("select count(*) from lockstep.queue").fetchone()[0] > 0
    assert divergence(c) != (0, 0)


def pass_in_thread(dsn: str, **kw: str) -> tuple[threading.Thread, dict, int]:
    conn = db.connect(dsn)
    out: dict = {}

    def go() -> None:
        try:
            out["result"] = db.run_job(conn, JOB, **kw)
        except psycopg.Error as exc:
            out["error"] = exc
        finally:
            conn.close()

    pid = conn.info.backend_pid
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, out, pid


def wait_event(c: psycopg.Connection, pid: int) -> str | None:
    return c.execute("select wait_event from pg_stat_activity where pid = %s", [pid]).fetchone()[0]


def test_a_pass_commits_without_waiting_for_the_flush_and_the_operator_may_ask_it_to(dsn):
    with app(dsn) as c:
        # permutation: app_change pass(default) -> done, never in SyncRep
        change(c)
        t, out, pid = pass_in_thread(dsn)
        seen = set()

        def look() -> bool:
            event = wait_event(c, pid)
            # read before the result is checked: once the result is in, the thread is closing the session,
            # whose exit-time transaction (dropping its temp tables) commits as the session's default says
            # and may wait in SyncRep; that is the session's exit, not the pass (CI saw it)
            if "result" not in out:
                seen.add(event)
            return "SyncRep" in seen or not t.is_alive()

        wait_for(look, timeout=30)
        if "SyncRep" in seen:
            c.execute("select pg_cancel_backend(%s)", [pid])
        assert "SyncRep" not in seen and "error" not in out, (seen, out)
        assert out["result"].outcome == "done"
        assert c.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
        assert divergence(c) == (0, 0)

        # permutation: app_change pass(synchronous_commit on) -> waits for the standby (SyncRep): cancelled
        change(c)
        t, out, pid = pass_in_thread(dsn, synchronous_commit="on")
        wait_for(lambda: wait_event(c, pid) == "SyncRep", what="the pass waiting for the absent standby")
        c.execute("select pg_cancel_backend(%s)", [pid])  # the commit is local already: a WARNING, no error
        t.join(10)
        assert not t.is_alive() and out["result"].outcome == "done", out
        assert divergence(c) == (0, 0)


def test_the_cli_runner_commits_without_waiting_for_the_flush(dsn, runners):
    with app(dsn) as c:
        change(c)
    r = runners(dsn, "--once")
    assert r.wait(60) == 0, r.stderr
    assert "synchronous commit off" in r.stderr
    with app(dsn) as c:
        assert divergence(c) == (0, 0)


def test_a_crash_after_an_unflushed_pass_leaves_its_queue_entries_and_the_next_pass_redoes_them(cluster, dsn):
    with app(dsn) as c:
        change(c)
        before = c.execute("select count(*) from lockstep.queue").fetchone()[0]
    conn = db.connect(dsn)
    assert db.run_job(conn, JOB).outcome == "done"
    # nothing written since, the pass's session left open (its exit would drop its temp tables in a
    # transaction of its own, whose commit flushes): the pass's commit is in the WAL buffers unless the WAL
    # writer took it
    cluster.pg_ctl("-m", "immediate", "restart")  # a crash: no shutdown checkpoint, the WAL buffers lost
    conn.close()
    with app(dsn) as c:
        queued = c.execute("select count(*) from lockstep.queue").fetchone()[0]
        # the pass is there whole or gone whole: never its queue entries deleted and its rows unwritten
        assert (queued, divergence(c) == (0, 0)) in {(0, True), (before, False)}, (queued, divergence(c))
        print(f"after the crash: {queued} of {before} queue entries back")
        conn = db.connect(dsn)
        db.run_job(conn, JOB)
        conn.close()
        assert c.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
        assert divergence(c) == (0, 0)
