"""A throw-away cluster with wal_level = logical for the tests of watching through the WAL (watch(...,
via => 'wal'), lockstep.capture()), and databases on it: lockstep and the example (10 exams) installed from
a template, exam and exam_item watched through the WAL, the capture's slot made, converged, nothing queued.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator

import pg_cluster
import psycopg
from psycopg.conninfo import make_conninfo

from lockstep.lab import example
from lockstep.lab.example import JOB
from lockstep.migrate import migrate

SETTINGS = {
    "wal_level": "logical",
    "max_replication_slots": "20",
    "max_wal_senders": "20",
    "max_connections": "40",
}
TEMPLATE = "lockstep_wal_template"
_names = itertools.count()


@contextlib.contextmanager
def running() -> Iterator[pg_cluster.Cluster]:
    with pg_cluster.running("lockstep-wal-", **SETTINGS) as c:
        with psycopg.connect(c.dsn, autocommit=True) as admin:
            admin.execute(f"create database {TEMPLATE}")
        dsn = make_conninfo(c.dsn, dbname=TEMPLATE)
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            example.install(conn, parents=10)
            conn.execute("alter table example.exam_item replica identity full")
        yield c


def connect(dsn: str) -> psycopg.Connection:
    return psycopg.connect(dsn, autocommit=True)


@contextlib.contextmanager
def database(cluster: pg_cluster.Cluster, watched: bool = True) -> Iterator[str]:
    """A database from the template; with ``watched``, exam and exam_item watched through the WAL for the
    example's job, the slot made by a first capture, then recomputed: converged, nothing queued or flagged."""
    name = f"wal_{os.getpid()}_{next(_names)}"
    with connect(cluster.dsn) as admin:
        admin.execute(f"create database {name} template {TEMPLATE}")
    dsn = make_conninfo(cluster.dsn, dbname=name)
    try:
        if watched:
            with connect(dsn) as c:
                c.execute("select lockstep.watch(%s, 'example.exam', 'id', via => 'wal')", [JOB])
                c.execute("select lockstep.watch(%s, 'example.exam_item', 'exam_id', via => 'wal')", [JOB])
                c.execute("select lockstep.capture()")
                c.execute("select lockstep.recompute(%s)", [JOB])
                c.execute("select lockstep.capture()")
                c.execute("delete from lockstep.queue")
                c.execute(
                    "update lockstep.job_state set next_run_at = now() + interval '1 year' where job = %s",
                    [JOB],
                )
        yield dsn
    finally:
        drop(cluster, name)


def drop(cluster: pg_cluster.Cluster, name: str) -> None:
    """Drop the database and its slots: its sessions ended first (a killed runner's backend may still
    hold the slot for a moment)."""
    with connect(cluster.dsn) as admin:
        for _ in range(200):
            admin.execute(
                "select pg_terminate_backend(pid, 1000) from pg_stat_activity"
                " where datname = %s and pid <> pg_backend_pid()",
                [name],
            )
            left = admin.execute(
                "select count(pg_drop_replication_slot(slot_name) is null) from pg_replication_slots"
                " where database = %s and not active",
                [name],
            ).fetchone()[0]
            if (
                not left
                and not admin.execute(
                    "select count(*) from pg_replication_slots where database = %s", [name]
                ).fetchone()[0]
            ):
                break
        admin.execute(f"drop database if exists {name} with (force)")
