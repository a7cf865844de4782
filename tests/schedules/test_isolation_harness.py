"""The isolation harness (tests/isolation.py) detects waits without sleeping, reports deadlocks and errors
with their SQLSTATE, fails a hanging step cleanly, and leaves no session behind.

Each test writes its schedule like an isolation spec; the trace is compared with the expected text.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from isolation import (
    APP_PREFIX,
    IsolationError,
    Spec,
    StepTimeout,
    awaited_locks,
    blocking_pids,
    check_expected,
    wait_for_lock_wait,
)
from psycopg import sql

ADMIN_DSN = os.environ.get("LOCKSTEP_TEST_ADMIN_DSN", "postgresql://root@127.0.0.1:5432/postgres")

TABLE = [
    "create table t (id int primary key, v text not null)",
    "insert into t values (1, 'a'), (2, 'b')",
]
DROP = ["drop table if exists t"]


@pytest.fixture(scope="module")
def iso_dsn() -> Iterator[str]:
    """A throwaway database for this module (replaceable by the project's ``dsn`` fixture)."""
    name = f"iso_{os.getpid()}"
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))
        admin.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    try:
        yield urlunsplit(urlsplit(ADMIN_DSN)._replace(path="/" + name))
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
            admin.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))


def harness_backends(dsn: str) -> list[tuple[int, str]]:
    """Backends of the harness (sessions and observer) still connected to the test database."""
    with psycopg.connect(dsn, autocommit=True) as c:
        return c.execute(
            "select pid, application_name from pg_stat_activity"
            " where datname = current_database() and application_name like %s",
            [APP_PREFIX + "%"],
        ).fetchall()


def harness_gone(dsn: str, timeout: float = 10.0) -> bool:
    """No backend of the harness is left: a closed connection's backend exits on its own time, so a busy
    server may still list it for a moment after the client closed it."""
    deadline = time.monotonic() + timeout
    while harness_backends(dsn):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def harness_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("isolation-")]


def two_writers(dsn: str) -> Spec:
    spec = Spec(
        dsn,
        setup=TABLE,
        teardown=DROP,
        sessions={"s1": ["set deadlock_timeout = '100ms'"], "s2": ["set deadlock_timeout = '10s'"]},
    )
    spec.step("s1begin", "s1", "begin;")
    spec.step("s1up", "s1", "update t set v = 's1' where id = 1;")
    spec.step("s1lock", "s1", "select * from t where id = 1 for update;")
    spec.step("s1lock2", "s1", "select * from t where id = 2 for update;")
    spec.step("s1c", "s1", "commit;")
    spec.step("s2begin", "s2", "begin;")
    spec.step("s2up", "s2", "update t set v = v || '+s2' where id = 1 returning v;")
    spec.step("s2lock", "s2", "select * from t where id = 2 for update;")
    spec.step("s2lock2", "s2", "select * from t where id = 1 for update;")
    spec.step("s2c", "s2", "commit;")
    return spec


# property: a second writer of the same row waits for the first one's commit, and the harness sees the
# wait through pg_blocking_pids within milliseconds (no sleep anywhere)
ROW_LOCK_OUT = """\
starting permutation: s1begin s2begin s1up s2up s1c s2c
step s1begin: begin;
step s2begin: begin;
step s1up: update t set v = 's1' where id = 1;
step s2up: update t set v = v || '+s2' where id = 1 returning v; <waiting ...>
step s1c: commit;
step s2up: <... completed>
v
-----
s1+s2
(1 row)

step s2c: commit;
"""


def test_row_lock_wait_is_detected_without_sleeping(iso_dsn: str) -> None:
    r = two_writers(iso_dsn).run(["s1begin", "s2begin", "s1up", "s2up", "s1c", "s2c"], step_timeout=10)
    assert r.trace == ROW_LOCK_OUT
    assert r.waited("s2up") and not r.waited("s1up")
    assert r.detected_by("s2up") == "pg_blocking_pids"
    assert r.blocked_by("s2up") == ["s1"]
    assert r.rows("s2up") == [("s1+s2",)]
    # events, not durations: the wait was seen before s1c was sent (so the harness did not wait for a
    # timeout to call it blocked), and s2up completed only after s1c was sent
    s2up, s1c = r["s2up"], r["s1c"]
    assert s2up.waited_at is not None and s2up.sent_at + s2up.waited_at <= s1c.sent_at, r.timings
    assert s2up.finished_at is not None and s2up.finished_at >= s1c.sent_at, r.timings
    assert harness_gone(iso_dsn) and harness_threads() == []


def test_slow_step_is_not_a_wait(iso_dsn: str) -> None:
    spec = Spec(iso_dsn, sessions={"s1": [], "s2": ["select pg_advisory_lock(1)"]})
    spec.step("s1nap", "s1", "select pg_sleep(0.2) is null as slept;")
    spec.step("s2nap", "s2", "select pg_sleep(0.2);", show_rows=False)
    r = spec.run(["s1nap", "s2nap"])
    assert r.trace == (
        "starting permutation: s1nap s2nap\n"
        "step s1nap: select pg_sleep(0.2) is null as slept;\n"
        "slept\n-----\nf\n(1 row)\n\n"
        "step s2nap: select pg_sleep(0.2);\n"
    )
    assert not r.waited("s1nap") and r.detected_by("s1nap") is None and r.blocked_by("s1nap") == []
    # the slow step was waited for (not reported early): s2nap was sent only once s1nap had finished
    s1nap = r["s1nap"]
    assert s1nap.finished_at is not None and r["s2nap"].sent_at >= s1nap.finished_at, r.timings


def test_session_setup_error_is_reported(iso_dsn: str) -> None:
    spec = Spec(iso_dsn, sessions={"s1": [], "s2": ["set deadlock_timeout = 'soon'"]})
    spec.step("s1one", "s1", "select 1;")
    with pytest.raises(IsolationError, match="setup of session s2 failed: 22023"):
        spec.run(["s1one"])
    assert harness_gone(iso_dsn) and harness_threads() == []


# property: in a lock-order cycle the session with the short deadlock_timeout (s1, whose step closes
# the cycle) is the victim with 40P01, and s2 then gets its row
DEADLOCK_OUT = """\
starting permutation: s1begin s2begin s1lock s2lock s2lock2 s1lock2 s1c s2c
step s1begin: begin;
step s2begin: begin;
step s1lock: select * from t where id = 1 for update;
id|v
--+-
 1|a
(1 row)

step s2lock: select * from t where id = 2 for update;
id|v
--+-
 2|b
(1 row)

step s2lock2: select * from t where id = 1 for update; <waiting ...>
step s1lock2: select * from t where id = 2 for update; <waiting ...>
step s1lock2: <... completed>
ERROR:  40P01: deadlock detected
step s1c: commit;
step s2lock2: <... completed>
id|v
--+-
 1|a
(1 row)

step s2c: commit;
"""


def test_deadlock_victim_is_the_short_timeout_session(iso_dsn: str) -> None:
    perm = ["s1begin", "s2begin", "s1lock", "s2lock", "s2lock2", "s1lock2", "s1c", "s2c"]
    r = two_writers(iso_dsn).run(perm, step_timeout=10)
    assert r.trace == DEADLOCK_OUT
    assert r.sqlstate("s1lock2") == "40P01"
    assert isinstance(r.error("s1lock2"), psycopg.errors.DeadlockDetected)
    assert r.error("s2lock2") is None and r.rows("s2lock2") == [(1, "a")]
    assert r.blocked_by("s1lock2") == ["s2"] and r.blocked_by("s2lock2") == ["s1"]


# property: an error is captured with its SQLSTATE, the aborted transaction rejects statements until
# the rollback step, and the session then goes on
UNIQUE_OUT = """\
starting permutation: s1begin s1dup s1one s1rb s1ins s1count
step s1begin: begin;
step s1dup: insert into t values (1, 'dup');
ERROR:  23505: duplicate key value violates unique constraint "t_pkey"
step s1one: select 1 as one;
ERROR:  25P02: current transaction is aborted, commands ignored until end of transaction block
step s1rb: rollback;
step s1ins: insert into t values (3, 'c');
step s1count: select count(*) as n, bool_and(v <> '') as ok, null as nothing from t; select 'two' as sets;
n|ok|nothing
-+--+-------
3|t |
(1 row)

sets
----
two
(1 row)

"""


def test_error_is_captured_and_session_continues(iso_dsn: str) -> None:
    spec = Spec(iso_dsn, setup=TABLE, teardown=DROP, sessions={"s1": []})
    spec.step("s1begin", "s1", "begin;")
    spec.step("s1dup", "s1", "insert into t values (1, 'dup');")
    spec.step("s1one", "s1", "select 1 as one;")
    spec.step("s1rb", "s1", "rollback;")
    spec.step("s1ins", "s1", "insert into t values (3, 'c');")
    spec.step(
        "s1count",
        "s1",
        "select count(*) as n, bool_and(v <> '') as ok, null as nothing from t; select 'two' as sets;",
    )
    r = spec.run(["s1begin", "s1dup", "s1one", "s1rb", "s1ins", "s1count"], step_timeout=5)
    assert r.trace == UNIQUE_OUT
    assert r.sqlstate("s1dup") == "23505" and r.sqlstate("s1one") == "25P02"
    assert r.error("s1rb") is None and r.sqlstate("s1ins") is None
    assert r.rows("s1count") == [("two",)]
    assert r["s1count"].tables[0][1] == [(3, True, None)]


def test_hanging_step_fails_after_step_timeout_and_leaves_nothing(iso_dsn: str) -> None:
    spec = Spec(iso_dsn, sessions={"s1": []})
    spec.step("s1sleep", "s1", "select pg_sleep(1000);")
    with pytest.raises(StepTimeout) as info:
        spec.run(["s1sleep"], step_timeout=1)
    message = str(info.value)
    assert "step s1sleep (session s1) neither completed nor blocked on a lock within 1 s" in message
    assert "wait_event=PgSleep" in message and "starting permutation: s1sleep" in message
    assert info.value.result is not None
    assert isinstance(info.value.result.error("s1sleep"), psycopg.errors.QueryCanceled)
    assert harness_gone(iso_dsn) and harness_threads() == []


def test_step_left_blocked_fails_and_teardown_releases_it(iso_dsn: str) -> None:
    # the permutation never commits s1, so s2up stays blocked: a spec bug the harness must report
    with pytest.raises(StepTimeout) as info:
        two_writers(iso_dsn).run(["s1begin", "s1up", "s2up"], step_timeout=1)
    message = str(info.value)
    assert "step s2up (session s2) did not complete within 1 s at the end of the permutation" in message
    assert "blocked by: s1" in message and "<waiting ...>" in message
    assert harness_gone(iso_dsn) and harness_threads() == []
    with psycopg.connect(iso_dsn) as c:  # teardown ran: t is gone
        assert c.execute("select to_regclass('t')").fetchone() == (None,)


def test_callable_steps(iso_dsn: str) -> None:
    def update_with_params(conn: psycopg.Connection) -> list[tuple[str]]:
        return conn.execute("update t set v = %s where id = %s returning v", ["fn", 1]).fetchall()

    def notice(conn: psycopg.Connection) -> int:
        conn.execute("do $$ begin raise notice 'hello from %', 's2'; end $$")
        return 42

    def broken(conn: psycopg.Connection) -> None:
        raise ValueError("bug in the test")

    spec = two_writers(iso_dsn)
    spec.step("s2fn", "s2", update_with_params)
    spec.step("s2notice", "s2", notice, label="notice()")
    spec.step("s2bad", "s2", lambda conn: conn.execute("select 1/0"), label="divide")
    spec.step("s2broken", "s2", broken)
    r = spec.run(["s1begin", "s1up", "s2fn", "s1c", "s2notice", "s2bad"], step_timeout=5)
    assert r.trace == (
        "starting permutation: s1begin s1up s2fn s1c s2notice s2bad\n"
        "step s1begin: begin;\n"
        "step s1up: update t set v = 's1' where id = 1;\n"
        "step s2fn: <python update_with_params> <waiting ...>\n"
        "step s1c: commit;\n"
        "step s2fn: <... completed>\n"
        "step s2notice: <python notice()>\n"
        "s2: NOTICE:  hello from s2\n"
        "step s2bad: <python divide>\n"
        "ERROR:  22012: division by zero\n"
    )
    assert r.waited("s2fn") and r.blocked_by("s2fn") == ["s1"]
    assert r.value("s2fn") == [("fn",)] and r.value("s2notice") == 42

    with pytest.raises(IsolationError, match=r"step s2broken raised ValueError\('bug in the test'\)"):
        spec.run(["s1begin", "s1up", "s2broken"], step_timeout=5)
    assert harness_gone(iso_dsn) and harness_threads() == []


def test_permutation_must_name_known_steps(iso_dsn: str) -> None:
    spec = two_writers(iso_dsn)
    with pytest.raises(ValueError, match="unknown steps in permutation: nope"):
        spec.run(["s1begin", "nope"])
    with pytest.raises(ValueError, match="duplicate step name 's1c'"):
        spec.step("s1c", "s1", "commit")
    with pytest.raises(ValueError, match="unknown session 's9'"):
        spec.step("s9c", "s9", "commit")


def test_wait_for_lock_wait_helper(iso_dsn: str) -> None:
    with (
        psycopg.connect(iso_dsn, autocommit=True) as holder,
        psycopg.connect(iso_dsn, autocommit=True, application_name="iso-waiter") as waiter,
        psycopg.connect(iso_dsn, autocommit=True) as observer,
    ):
        holder.execute("select pg_advisory_lock(7)")
        with pytest.raises(TimeoutError, match="was not seen waiting for a lock within 0.05 s"):
            wait_for_lock_wait(observer, waiter.info.backend_pid, timeout=0.05)
        thread = threading.Thread(target=lambda: waiter.execute("select pg_advisory_lock(7)"))
        thread.start()
        try:
            wait = wait_for_lock_wait(observer, waiter.info.backend_pid, timeout=5)
            assert wait.blockers == (holder.info.backend_pid,)
            assert wait.detected_by == "pg_blocking_pids"
            by_name = wait_for_lock_wait(observer, application_name="iso-waiter", timeout=5)
            assert by_name == wait
            assert blocking_pids(observer, [holder.info.backend_pid, waiter.info.backend_pid]) == {
                waiter.info.backend_pid: wait
            }
            (awaited,) = awaited_locks(observer, waiter.info.backend_pid)
            assert (awaited.locktype, awaited.objid, awaited.mode) == ("advisory", 7, "ExclusiveLock")
            assert not awaited.is_notify_queue  # only PreCommit_Notify's object lock is
            assert awaited_locks(observer, holder.info.backend_pid) == []
            with pytest.raises(RuntimeError, match="abort_if"):
                wait_for_lock_wait(observer, holder.info.backend_pid, timeout=5, abort_if=lambda: True)
        finally:
            holder.execute("select pg_advisory_unlock(7)")
            thread.join(5)
        assert not thread.is_alive()


def test_expected_file_mismatch_shows_a_unified_diff_and_update_rewrites_it(iso_dsn: str, tmp_path) -> None:
    r = two_writers(iso_dsn).run(["s1begin", "s2begin", "s1up", "s2up", "s1c", "s2c"], step_timeout=10)
    out = tmp_path / "expected" / "row_lock.out"
    with pytest.raises(AssertionError, match="no expected file .*--update-expected"):
        check_expected(out, r.trace)
    check_expected(out, r.trace, update=True)  # creates it
    assert out.read_text() == ROW_LOCK_OUT
    check_expected(out, r.trace)  # equal: passes
    # a schedule that did not wait where it used to (the old trace expected a wait)
    out.write_text(ROW_LOCK_OUT.replace("returning v; <waiting ...>", "returning v;"))
    with pytest.raises(AssertionError) as info:
        check_expected(out, r.trace)
    message = str(info.value)
    assert f"--- {out} (expected)" in message and "+++ actual" in message
    assert "\n-step s2up: update t set v = v || '+s2' where id = 1 returning v;\n" in message
    assert "\n+step s2up: update t set v = v || '+s2' where id = 1 returning v; <waiting ...>\n" in message
    check_expected(out, r.trace, update=True)
    assert out.read_text() == ROW_LOCK_OUT
