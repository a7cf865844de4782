"""``lockstep run`` across a real PostgreSQL restart.

A throw-away cluster (tests/pg_cluster.py), stopped (``-m immediate``) and removed at teardown, even on
failure.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pg_cluster
import psycopg
import pytest
from pg_cluster import Cluster
from psycopg.conninfo import make_conninfo
from runner_procs import runner_backends, wait_for

from lockstep.lab.example import JOB, divergence
from lockstep.migrate import migrate

pytestmark = pytest.mark.skipif(not pg_cluster.AVAILABLE, reason=pg_cluster.MISSING)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with pg_cluster.running(synchronous_commit="off") as c:
        yield c


@pytest.fixture
def cluster_dsn(cluster: Cluster) -> Iterator[str]:
    """A database in the throw-away cluster with lockstep and the example (30 exams, converged)."""
    from lockstep.lab import example

    name = f"restart_{os.getpid()}_{time.monotonic_ns()}"
    with psycopg.connect(cluster.dsn, autocommit=True) as admin:
        admin.execute(f'create database "{name}"')
    dsn = make_conninfo(cluster.dsn, dbname=name)
    migrate(dsn)
    with psycopg.connect(dsn, autocommit=True) as c:
        example.install(c, parents=30)
        c.execute("select lockstep.recompute(%s)", [JOB])
        c.execute("delete from lockstep.queue")
        c.execute(
            "update lockstep.job_state set next_run_at = now() + interval '1 hour' where job = %s", [JOB]
        )
    yield dsn
    with psycopg.connect(cluster.dsn, autocommit=True) as admin:
        admin.execute(f'drop database if exists "{name}" with (force)')


def _try(dsn: str, fn):
    """fn(conn) on a fresh connection, or None while the server is down."""
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=2) as c:
            return fn(c)
    except psycopg.OperationalError:
        return None


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_runner_reconnects_after_a_server_restart(cluster, cluster_dsn, runners, mode):
    r = runners(cluster_dsn, "--tick", "0.2")
    with psycopg.connect(cluster_dsn, autocommit=True) as c:
        old = wait_for(lambda: runner_backends(c), what="runner connected")
        c.execute("update example.exam_item set body = body || ' before' where exam_id in (1, 2)")
        wait_for(lambda: c.execute("select count(*) from lockstep.queue").fetchone()[0] == 0, what="worked")
        assert divergence(c) == (0, 0)

    cluster.pg_ctl("-m", mode, "restart")
    back = time.monotonic()

    def app_write(c: psycopg.Connection) -> bool:
        c.execute("update example.exam_item set body = body || ' after' where exam_id in (3, 4, 5)")
        c.execute("delete from example.exam where id = 6")
        return True

    assert _try(cluster_dsn, app_write)

    def converged(c: psycopg.Connection) -> bool:
        return (
            c.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
            and divergence(c) == (0, 0)
            and bool(runner_backends(c))
        )

    # the runner's backoff is capped at 10 s but starts at 0.1 s: back within a few seconds of the server
    wait_for(lambda: _try(cluster_dsn, converged), timeout=6, what="work enqueued after the restart done")
    took = time.monotonic() - back
    new = _try(cluster_dsn, runner_backends)
    assert new and not set(new) & set(old), (old, new)
    wait_for(lambda: "recovered after" in r.stderr, timeout=3, what="recovery line")

    r.signal(signal.SIGTERM)
    assert r.wait() == 0
    err = r.stderr
    lines = err.splitlines()
    assert "Traceback" not in err, err
    problems = [ln for ln in lines if " WARNING " in ln or " ERROR " in ln]
    assert len(problems) == 1 and "retrying with backoff" in problems[0], err
    assert len([ln for ln in lines if "recovered after" in ln]) == 1, err
    assert "exam_keys work done" in err
    print(f"restart -m {mode}: converged {took:.2f} s after the server was back; {problems[0]}")
