"""``lockstep run`` behind PgBouncer in transaction mode.

A transaction pooler hands each transaction to whichever server connection is free, so the runner must keep
no session state that matters: one autocommit statement per call, transaction-level advisory locks, work
tables in pg_temp that are empty whenever a call returns (kept for the next call, whoever makes it), no
LISTEN (``--no-listen``) and no server-side prepared statements (``--no-prepare``; PgBouncer 1.18 does not
track them, and the runner only guesses a pooler from port 6432).

PgBouncer refuses to run as root: as root it is started with ``-u postgres`` (it reads its files first, then
drops privileges), and it logs to stderr, captured into tmp_path.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from runner_procs import SLOW_FN, in_slow_call, wait_for

from lockstep.errors import EXIT_SETUP
from lockstep.lab.example import JOB, divergence

pytestmark = pytest.mark.skipif(shutil.which("pgbouncer") is None, reason="pgbouncer is not installed")

ALIAS = "lockstep_pgb"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgBouncer:
    def __init__(self, server_dsn: str, tmp: Path, pool_size: int = 4):
        server = conninfo_to_dict(server_dsn)
        self.port = free_port()
        self.log = tmp / "pgbouncer.log"
        (tmp / "users.txt").write_text('"root" ""\n')
        ini = tmp / "pgbouncer.ini"
        ini.write_text(
            f"""[databases]
{ALIAS} = host=127.0.0.1 port={server.get("port", 5432)} dbname={server["dbname"]}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {tmp / "users.txt"}
pool_mode = transaction
max_client_conn = 50
default_pool_size = {pool_size}
"""
        )
        cmd = ["pgbouncer", str(ini)]
        if os.geteuid() == 0:
            cmd[1:1] = ["-u", "postgres"]
        self._f = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._f, stderr=subprocess.STDOUT)
        self.dsn = make_conninfo(host="127.0.0.1", port=self.port, dbname=ALIAS, user="root")
        wait_for(self._accepts, timeout=10, what=f"pgbouncer on port {self.port}")

    def _accepts(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"pgbouncer exited {self.proc.returncode}: {self.log.read_text()}")
        try:
            with psycopg.connect(self.dsn, connect_timeout=2, prepare_threshold=None) as c:
                return c.execute("select 1").fetchone() == (1,)
        except psycopg.OperationalError:
            return False

    def connect(self) -> psycopg.Connection:
        return psycopg.connect(self.dsn, autocommit=True, prepare_threshold=None)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._f.close()


@pytest.fixture
def pgbouncer(example_dsn: str, tmp_path: Path) -> Iterator[PgBouncer]:
    """PgBouncer in transaction mode in front of ``example_dsn`` (database alias lockstep_pgb)."""
    pgb = PgBouncer(example_dsn, tmp_path)
    try:
        yield pgb
    finally:
        pgb.stop()


def queue_depth(conn: psycopg.Connection) -> int:
    return conn.execute("select queue_depth from lockstep.status where job = %s", [JOB]).fetchone()[0]


def test_two_runners_through_pgbouncer_work_the_queue_and_recompute(ex, pgbouncer, runners):
    args = ("--no-listen", "--no-prepare", "--tick", "0.2", "--log-format", "json")
    ex.execute("update lockstep.job_state set next_run_at = now() + interval '1 hour' where job = %s", [JOB])
    a = runners(pgbouncer.dsn, *args)
    b = runners(pgbouncer.dsn, *args)

    # the app writes through PgBouncer too: its triggers enqueue in the app's own transactions
    with pgbouncer.connect() as app:
        for i in range(30):
            app.execute(
                "update example.exam_item set body = body || %s where exam_id %% 30 = %s", [f" pgb{i}", i]
            )
        app.execute("delete from example.exam where id % 11 = 0")
        app.execute("select example.seed(20, 1001)")
        with app.transaction():
            app.execute("update example.exam set title = title || ' moved' where id between 1 and 40")
            app.execute("update example.exam_item set exam_id = 2 where exam_id = 1")
    wait_for(lambda: queue_depth(ex) == 0, timeout=15, what="queue drained through pgbouncer")
    assert divergence(ex) == (0, 0)

    # drift that only a recompute repairs (no trigger on exam_key), then the recompute made due now
    before = ex.execute("select runs from lockstep.job_state where job = %s", [JOB]).fetchone()[0]
    ex.execute("delete from example.exam_key where exam_id between 100 and 120")
    assert divergence(ex) != (0, 0)
    ex.execute("update lockstep.job_state set next_run_at = now() where job = %s", [JOB])

    def recomputed() -> bool:
        row = ex.execute(
            "select runs > %s and last_action = 'recompute' and next_run_at > now()"
            " from lockstep.job_state where job = %s",
            [before, JOB],
        ).fetchone()
        return bool(row[0])

    wait_for(recomputed, timeout=15, what="a recompute through pgbouncer")
    wait_for(lambda: queue_depth(ex) == 0, timeout=10, what="queue drained again")
    assert divergence(ex) == (0, 0)

    for r in (a, b):
        r.signal(signal.SIGTERM)
    assert a.wait() == 0 and b.wait() == 0
    lines = a.json_lines() + b.json_lines()
    assert "Traceback" not in a.stderr + b.stderr, a.stderr + b.stderr
    assert not [x for x in lines if x["level"] in ("warning", "error")], lines
    done = {(x.get("action"), x.get("outcome")) for x in lines}
    assert ("work", "done") in done and ("recompute", "done") in done, done
    pgb_log = pgbouncer.log.read_text()
    assert "login attempt: db=lockstep_pgb user=root" in pgb_log, pgb_log
    assert "prepared statement" not in pgb_log, pgb_log


def test_each_call_is_one_statement_with_no_session_state(ex, pgbouncer, connect):
    """Consecutive statements of one client land on different server connections; the calls still work."""
    client = pgbouncer.connect()
    holders: list[psycopg.Connection] = []

    def pin(pid: int) -> list[int]:
        """Open transactions from other clients until one holds server connection ``pid`` (at most 3 of
        the pool's 4, so the client still gets one); the server pids they hold."""
        held: list[int] = []
        while pid not in held and len(held) < 3:
            h = pgbouncer.connect()
            holders.append(h)
            h.execute("begin")
            held.append(h.execute("select pg_backend_pid()").fetchone()[0])
        assert pid in held, (pid, held)
        return held

    def unpin() -> None:
        while holders:
            holders.pop().close()

    try:
        pid1 = client.execute(
            "select pg_backend_pid(), lockstep.enqueue(%s, array[3, 4, 5]::bigint[])", [JOB]
        ).fetchone()[0]
        ex.execute("delete from example.exam_key where exam_id in (3, 4, 5)")
        held = pin(pid1)  # the client's next statement must run on another server connection
        row = client.execute(
            "select pg_backend_pid(), r.outcome, r.inserted from lockstep.work(%s) r", [JOB]
        ).fetchone()
        assert row[0] not in held, (row, held)
        assert row[1] == "done" and row[2] > 0, row
        unpin()
        held = pin(row[0])
        row2 = client.execute(
            "select pg_backend_pid(), r.outcome from lockstep.recompute(%s) r", [JOB]
        ).fetchone()
        assert row2[0] not in held and row2[1] == "done", (row2, held)
    finally:
        unpin()
        client.close()
    assert queue_depth(ex) == 0
    assert divergence(ex) == (0, 0)

    # what a call leaves in its session: nothing but its empty work tables, which the next call on this
    # server connection reuses, whichever client makes it (checked on a direct connection)
    direct = connect(ex.info.dsn)
    direct.execute("select lockstep.enqueue(%s, array[6]::bigint[])", [JOB])
    path = direct.execute("show search_path").fetchone()[0]
    assert direct.execute("select (lockstep.work(%s)).outcome", [JOB]).fetchone()[0] == "done"
    assert direct.execute("select (lockstep.recompute(%s)).outcome", [JOB]).fetchone()[0] == "done"
    work_tables = [
        t
        for (t,) in direct.execute(
            "select oid::regclass::text from pg_class where relnamespace = pg_my_temp_schema()"
            " and relname ~ '^lockstep_(gone|put)_[0-9a-f]{16}$'"
        )
    ]
    assert work_tables
    rows = [direct.execute(f"select count(*) from {t}").fetchone()[0] for t in work_tables]
    assert rows == [0] * len(work_tables), (work_tables, rows)
    leftovers = direct.execute(
        "select (select count(*) from pg_class where relnamespace = pg_my_temp_schema()"
        " and relname !~ '^lockstep_(gone|put)_[0-9a-f]{16}$'),"
        " (select count(*) from pg_locks where pid = pg_backend_pid() and locktype = 'advisory'),"
        " (select count(*) from pg_prepared_statements),"
        " (select count(*) from pg_listening_channels()),"
        " current_setting('search_path')"
    ).fetchone()
    assert leftovers == (0, 0, 0, 0, path), leftovers


def test_a_runner_behind_a_pooler_it_did_not_recognise_stops_preparing_statements(
    ex, example_dsn, tmp_path, runners
):
    """Behind a transaction pooler on another port than 6432, without --no-prepare, the runner's prepared
    statements met other clients' on the shared server connection ("prepared statement ... already
    exists"): it retried for ever and drained ~14x slower. At the first such error it now
    stops preparing, says why, and works on."""
    pgb = PgBouncer(example_dsn, tmp_path, pool_size=1)
    try:
        ex.execute(
            "update lockstep.job_state set next_run_at = now() + interval '1 hour' where job = %s", [JOB]
        )
        with pgb.connect() as other:  # another client's statements, left on the one server connection
            for n in range(20):
                other.execute(f"prepare _pg3_{n} as select {n}")
        r = runners(pgb.dsn, "--no-listen", "--tick", "0.1")
        wait_for(lambda: "prepared statements turned off" in r.stderr, timeout=20, what="prepare turned off")
        with pgb.connect() as app:
            app.execute("update example.exam set title = title || ' pooled' where id between 1 and 30")
        wait_for(lambda: queue_depth(ex) == 0, timeout=15, what="queue drained through pgbouncer")
        assert divergence(ex) == (0, 0)
        r.signal(signal.SIGTERM)
        assert r.wait() == 0
        assert "--no-prepare" in r.stderr
    finally:
        pgb.stop()


def test_a_second_signal_cancels_the_call_through_pgbouncer(ex, pgbouncer, runners):
    """The backend pid a client sees behind PgBouncer is not the server's: the runner must cancel with the
    protocol's cancel request (which PgBouncer forwards), not with pg_cancel_backend(pid)."""
    ex.execute("update lockstep.job_state set next_run_at = now() + interval '1 hour' where job = %s", [JOB])
    ex.execute(SLOW_FN)
    r = runners(pgbouncer.dsn, "--no-listen", "--no-prepare", "--tick", "0.2")
    wait_for(lambda: in_slow_call(ex, runner_name=False), what="runner inside slow_fn")
    r.signal(signal.SIGTERM)
    r.signal(signal.SIGINT)
    assert r.wait(timeout=10) == 1
    wait_for(lambda: in_slow_call(ex, runner_name=False) is None, timeout=5, what="slow call cancelled")
    locks = ex.execute(
        "select count(*) from pg_locks where locktype = 'advisory'"
        " and database = (select oid from pg_database where datname = current_database())"
    )
    assert locks.fetchone()[0] == 0
    assert ex.execute("select count(*) from public.ticks").fetchone()[0] == 0
    assert "cancelling" in r.stderr and "could not cancel" not in r.stderr, r.stderr


@pytest.mark.parametrize("mode", [[], ["--once"]], ids=["loop", "once"])
def test_a_database_pgbouncer_does_not_know_is_a_permanent_start_up_error(pgbouncer, mode):
    """PgBouncer answers a database missing from its [databases] with its own FATAL text ("no such
    database: x"), not PostgreSQL's: the runner exited 3 (no server answered) and, in its loop, retried for
    ever. It is exit 4 with the database hint, as behind no pooler."""
    dsn = make_conninfo(pgbouncer.dsn, dbname="lockstep_pgb_no_such_alias")
    try:
        p = subprocess.run(
            [sys.executable, "-m", "lockstep", "run", *mode, "--dsn", dsn, "--no-listen", "--no-prepare"],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("lockstep run was still retrying after 30 s")
    assert p.returncode == EXIT_SETUP, p.stderr
    assert "no such database" in p.stderr and "database name" in p.stderr, p.stderr


def test_the_runners_application_name_survives_its_calls_through_pgbouncer(ex, pgbouncer):
    """The runner resets every setting after each call (RESET ALL): behind PgBouncer that also reset the
    application_name the pooler had set on the server connection, the pooler took '' as the client's, and
    the runner vanished from pg_stat_activity's lockstep-runner sessions that docs/runner.md says to watch.
    It sets the application_name it had again, in the same transaction; and a job's
    search_path no longer reaches the application clients given that server connection next."""
    from lockstep import db

    ex.execute(
        "create table public.seen (name text);"
        " create function public.record() returns void language plpgsql as $$ begin"
        " insert into public.seen values (current_setting('application_name')); set search_path = nowhere;"
        " end $$;"
        " select lockstep.define_job('rec', 'public.record()', every => '1 hour')"
    )
    with db.connect(pgbouncer.dsn, prepare=False) as c:
        for _ in range(3):
            ex.execute("update lockstep.job_state set next_run_at = now() where job = 'rec'")
            assert db.run_job(c, "rec").outcome == "done"
    assert [n for (n,) in ex.execute("select name from public.seen")] == [db.APP_NAME] * 3
    with pgbouncer.connect() as app:  # the pool's server connections: none kept the job's search_path
        for _ in range(4):
            assert app.execute("select current_setting('search_path')").fetchone()[0] == '"$user", public'


def test_the_runners_time_zone_survives_its_calls_through_pgbouncer(ex, pgbouncer, monkeypatch):
    """Behind PgBouncer, the reset after each call put the server connection back to the server's TimeZone,
    and the pooler took it as the client's: a runner started with PGTZ saw it in its first call only.
    The reported parameters are set back to what the session had before the call."""
    from lockstep import db

    ex.execute(
        "create table public.tz (name text);"
        " create function public.tz_record() returns void language sql"
        " as $$ insert into public.tz values (current_setting('TimeZone')) $$;"
        " select lockstep.define_job('tzrec', 'public.tz_record()', every => '1 hour')"
    )
    monkeypatch.setenv("PGTZ", "Pacific/Auckland")
    with db.connect(pgbouncer.dsn, prepare=False) as c:
        for _ in range(3):
            ex.execute("update lockstep.job_state set next_run_at = now() where job = 'tzrec'")
            assert db.run_job(c, "tzrec").outcome == "done"
    assert [n for (n,) in ex.execute("select name from public.tz")] == ["Pacific/Auckland"] * 3
