"""A logical-replication subscriber on a throw-away wal_level = logical cluster (tests/wal_cluster.py): its
apply worker fires row triggers only, so watch()'s statement triggers miss its changes even enabled ALWAYS,
and watch_replica()'s row trigger (ENABLE REPLICA) queues them."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pg_cluster
import psycopg
import pytest
import wal_cluster
from psycopg.conninfo import make_conninfo
from runner_procs import wait_for

from lockstep.lab.example import JOB, divergence

pytestmark = pytest.mark.skipif(not pg_cluster.AVAILABLE, reason=pg_cluster.MISSING)


@pytest.fixture(scope="module")
def cluster() -> Iterator[pg_cluster.Cluster]:
    with wal_cluster.running() as c:
        yield c


def queued(c: psycopg.Connection) -> set[str]:
    return {k for (k,) in c.execute("select key from lockstep.queue where job = %s", [JOB])}


def applied(sub: psycopg.Connection, body: str) -> bool:
    return (
        sub.execute("select count(*) from example.exam where body like %s", [f"%{body}%"]).fetchone()[0] > 0
    )


def test_a_subscribers_changes_are_queued_by_watch_replica_not_by_watch(cluster):
    with (
        wal_cluster.database(cluster, watched=False) as pub_dsn,
        wal_cluster.database(cluster, watched=False) as sub_dsn,
    ):
        pub, sub = wal_cluster.connect(pub_dsn), wal_cluster.connect(sub_dsn)
        slot = f"rsub_{os.getpid()}"
        try:
            sub.execute("select lockstep.watch(%s, 'example.exam', 'id')", [JOB])
            sub.execute("select lockstep.watch(%s, 'example.exam_item', 'exam_id')", [JOB])
            for name, rel in sub.execute(
                "select tgname, tgrelid::regclass::text from pg_trigger where tgname like 'lockstep%'"
            ).fetchall():
                sub.execute(f'alter table {rel} enable always trigger "{name}"')
            sub.execute("select lockstep.recompute(%s)", [JOB])
            sub.execute("delete from lockstep.queue; delete from lockstep.recompute_flag")
            sub.execute("update lockstep.job_state set next_run_at = now() + interval '1 year'")
            pub.execute("create publication app for table example.exam, example.exam_item")
            pub.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", [slot])
            sub.execute(
                f"create subscription app connection '{make_conninfo(pub_dsn)}' publication app"
                f" with (create_slot = false, slot_name = '{slot}', copy_data = false)"
            )
            # watch() alone, its statement triggers enabled ALWAYS: the apply worker fires none of them
            pub.execute("update example.exam set body = body || ' first' where id = 3")
            wait_for(lambda: applied(sub, " first"), timeout=30, what="the subscriber applying the change")
            assert queued(sub) == set()
            assert divergence(sub) != (0, 0)
            # watch_replica(): its row trigger, enabled for replica sessions, queues what the worker applies
            sub.execute("select lockstep.watch_replica(%s, 'example.exam', 'id')", [JOB])
            sub.execute("select lockstep.watch_replica(%s, 'example.exam_item', 'exam_id')", [JOB])
            sub.execute("delete from lockstep.recompute_flag")
            pub.execute("update example.exam set body = body || ' second' where id in (3, 4)")
            pub.execute("update example.exam_item set exam_id = 6 where exam_id = 5")
            wait_for(lambda: applied(sub, " second"), timeout=30, what="the subscriber applying the changes")
            wait_for(lambda: {"3", "4", "5", "6"} <= queued(sub), timeout=30, what="the moved items queued")
            for _ in range(10):
                if sub.execute("select outcome from lockstep.work(%s)", [JOB]).fetchone()[0] == "idle":
                    break
            assert divergence(sub) == (0, 0)
            assert sub.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0
        finally:
            sub.execute("alter subscription app disable")
            sub.execute("alter subscription app set (slot_name = none)")
            sub.execute("drop subscription app")
            # the publisher's walsender lets the slot go once it sees the subscriber's worker gone
            wait_for(
                lambda: (
                    not pub.execute(
                        "select active from pg_replication_slots where slot_name = %s", [slot]
                    ).fetchone()[0]
                ),
                timeout=60,
                what="the walsender releasing the slot",
            )
            pub.execute("select pg_drop_replication_slot(%s)", [slot])
            pub.close()
            sub.close()
