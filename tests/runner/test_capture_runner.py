"""The runner and the WAL capture (watch(..., via => 'wal')) on a throw-away wal_level = logical cluster
(tests/wal_cluster.py): the runner keeps the derived table current with no trigger; a capture whose
client is killed (kill -9), a `lockstep run` killed inside a capture, and a server restart, lose
nothing; a logical-replication subscriber's derived table follows its publisher's changes, which its
apply worker writes and no trigger sees."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pg_cluster
import psycopg
import pytest
import wal_cluster
from psycopg.conninfo import make_conninfo
from runner_procs import wait_for

from lockstep import web
from lockstep.lab.example import JOB, divergence

pytestmark = pytest.mark.skipif(not pg_cluster.AVAILABLE, reason=pg_cluster.MISSING)


@pytest.fixture(scope="module")
def cluster() -> Iterator[pg_cluster.Cluster]:
    with wal_cluster.running() as c:
        yield c


@pytest.fixture
def wdsn(cluster: pg_cluster.Cluster) -> Iterator[str]:
    with wal_cluster.database(cluster) as dsn:
        yield dsn


def change(c: psycopg.Connection) -> None:
    c.execute("update example.exam_item set body = body || ' changed' where exam_id in (2, 3)")
    c.execute(
        "update example.exam_item set exam_id = 5"
        " where id = (select min(id) from example.exam_item where exam_id = 4)"
    )
    c.execute("delete from example.exam where id = 7")
    assert divergence(c) != (0, 0)


# a job keyed by a composite parent key, (tenant_id, id) of public.doc, its notes watched through the WAL
COMPOSITE = """
create table public.doc (tenant_id int not null, id bigint not null, primary key (tenant_id, id));
create table public.note (id bigint generated always as identity primary key, tenant_id int not null,
                          doc_id bigint not null, body text not null,
                          foreign key (tenant_id, doc_id) references public.doc on delete cascade);
alter table public.note replica identity full;
create table public.doc_stat (tenant_id int not null, doc_id bigint not null, notes bigint not null,
                              primary key (tenant_id, doc_id),
                              foreign key (tenant_id, doc_id) references public.doc on delete cascade);
create type public.doc_key as (tenant_id int, id bigint);
create function public.doc_stats(keys public.doc_key[])
returns table (tenant_id int, doc_id bigint, notes bigint)
language sql stable as $$
    select d.tenant_id, d.id,
           (select count(*) from public.note n where n.tenant_id = d.tenant_id and n.doc_id = d.id)
    from public.doc d
    where keys is null or (d.tenant_id, d.id) in (select k.tenant_id, k.id from unnest(keys) k) $$;
insert into public.doc select t, i from generate_series(1, 3) t, generate_series(1, 5) i;
insert into public.note (tenant_id, doc_id, body)
select t, i, 'n' from generate_series(1, 3) t, generate_series(1, 5) i;
select lockstep.define_derived('ds', 'public.doc_stat', 'public.doc_stats(public.doc_key[])', 'public.doc',
                               every => '1 year');
select lockstep.watch('ds', 'public.note', key_columns => array['tenant_id', 'doc_id']::name[], via => 'wal');
select lockstep.watch('ds', 'public.doc', key_columns => array['tenant_id', 'id']::name[], via => 'wal');
"""


def watch_composite(c: psycopg.Connection) -> None:
    """The composite key's job, watched through the WAL, converged; nothing queued or flagged."""
    c.execute(COMPOSITE)
    c.execute("select lockstep.capture()")
    c.execute("select lockstep.recompute('ds')")
    c.execute("select lockstep.capture()")
    c.execute("delete from lockstep.queue")
    c.execute("delete from lockstep.recompute_flag")


def change_composite(c: psycopg.Connection) -> None:
    c.execute("update public.note set body = body || ' changed' where tenant_id = 2 and doc_id = 3")
    c.execute("update public.note set doc_id = 5 where tenant_id = 1 and doc_id = 4")  # moved: both docs
    c.execute("delete from public.note where tenant_id = 3 and doc_id = 1")
    c.execute("insert into public.note (tenant_id, doc_id, body) values (3, 2, 'new')")


def composite_divergence(c: psycopg.Connection) -> int:
    if c.execute("select to_regclass('public.doc_stat') is null").fetchone()[0]:
        return 0
    return c.execute(
        "select count(*) from ((select * from public.doc_stat except select * from public.doc_stats(null))"
        " union all (select * from public.doc_stats(null) except select * from public.doc_stat)) d"
    ).fetchone()[0]


def diverged(c: psycopg.Connection) -> bool:
    return divergence(c) != (0, 0) or composite_divergence(c) != 0


def converged(c: psycopg.Connection) -> bool:
    return not diverged(c) and c.execute("select count(*) from lockstep.queue").fetchone()[0] == 0


def drain(c: psycopg.Connection) -> None:
    c.execute("select lockstep.capture()")
    for _ in range(20):
        if c.execute("select outcome from lockstep.run(%s)", [JOB]).fetchone()[0] == "idle":
            break
    assert converged(c)


def settle(c: psycopg.Connection) -> bool:
    c.execute("select lockstep.capture()")
    for _ in range(20):
        if c.execute("select outcome from lockstep.run(%s)", [JOB]).fetchone()[0] == "idle":
            break
    return converged(c)


def test_the_runner_keeps_a_table_watched_through_the_wal_current(wdsn, runners):
    with wal_cluster.connect(wdsn) as c:
        r = runners(wdsn, "--tick", "0.2", "--capture-every", "0.1")
        change(c)
        wait_for(lambda: converged(c), timeout=30, what="converged through the WAL")
        assert c.execute("select changes > 0 from lockstep.capture_status").fetchone()[0]
        assert r.alive()
        # the captures run on a connection of their own: reading the slot clears its session's caches,
        # which the worker's connection keeps
        # (from the capture after the first: the first found the slot)
        wait_for(
            lambda: (
                c.execute(
                    "select count(*), count(*) filter (where query like '%%lockstep.capture()%%')"
                    " from pg_stat_activity where application_name = 'lockstep-runner'"
                    " and datname = current_database()"
                ).fetchone()
                == (2, 1)
            ),
            what="the runner's two connections, one capturing",
        )


CAPTURE_AND_HANG = """
import sys, time, psycopg
c = psycopg.connect(sys.argv[1])
print(c.execute("select keys from lockstep.capture()").fetchone()[0], flush=True)
time.sleep(120)
"""


def test_a_capture_whose_client_is_killed_before_its_commit_loses_nothing(wdsn):
    with wal_cluster.connect(wdsn) as c:
        change(c)
        with subprocess.Popen(
            [sys.executable, "-c", CAPTURE_AND_HANG, wdsn], stdout=subprocess.PIPE, text=True
        ) as p:
            try:
                assert int(p.stdout.readline()) > 0  # it read and queued the keys, in its open transaction
                os.kill(p.pid, signal.SIGKILL)
            finally:
                p.kill()
        wait_for(
            lambda: c.execute(
                "select not exists (select from pg_stat_activity"
                " where datname = current_database() and pid <> pg_backend_pid()"
                " and backend_type = 'client backend')"
            ).fetchone()[0],
            what="the killed client's backend to end",
        )
        assert c.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
        drain(c)


def capture_blocked_after_its_queue_insert(c: psycopg.Connection, holder: int) -> int | None:
    """The pid of a runner's backend inside lockstep.capture() that has inserted its queue rows (it holds
    the queue's ROW EXCLUSIVE lock) and waits for ``holder``'s lock on lockstep.capture_state, to record
    the LSN it read up to."""
    row = c.execute(
        "select a.pid from pg_stat_activity a"
        " where a.application_name = 'lockstep-runner' and a.datname = current_database()"
        " and a.query like '%%lockstep.capture()%%' and %s = any(pg_blocking_pids(a.pid))"
        " and exists (select from pg_locks l where l.pid = a.pid and l.granted"
        " and l.relation = 'lockstep.queue'::regclass and l.mode = 'RowExclusiveLock')",
        [holder],
    ).fetchone()
    return row[0] if row else None


@pytest.mark.parametrize("key", ["one column", "composite"])
@pytest.mark.parametrize("its_transaction", ["rolled back", "committed"])
def test_a_runner_killed_during_a_capture_loses_nothing(wdsn, runners, its_transaction, key):
    """kill -9 of ``lockstep run`` held inside a capture, between its queue insert and the LSN it records:
    its backend either rolls back (the server notices the lost client: client_connection_check_interval)
    or commits once the test lets it go. Either way, a new runner converges from the queue alone: no full
    recompute, the slot confirmed past the changes. For a one-column key and a composite one."""
    with wal_cluster.connect(wdsn) as c, wal_cluster.connect(wdsn) as holder:
        if key == "composite":
            watch_composite(c)
        if its_transaction == "rolled back":
            c.execute(f"alter database {c.info.dbname} set client_connection_check_interval = '50ms'")
        before = c.execute("select queued_lsn from lockstep.capture_state").fetchone()[0]
        recomputes = "select count(*) from lockstep.run_log where action = 'recompute'"
        recomputed = c.execute(recomputes).fetchone()[0]
        holder.execute("begin")
        holder.execute("select from lockstep.capture_state for update")  # where the capture records its LSN
        if key == "composite":
            change_composite(c)
            assert diverged(c)
        else:
            change(c)
        changed_at = c.execute("select pg_current_wal_lsn()").fetchone()[0]
        r = runners(wdsn, "--tick", "0.2", "--capture-every", "0.1")
        pid = wait_for(
            lambda: capture_blocked_after_its_queue_insert(c, holder.info.backend_pid),
            timeout=30,
            what="the runner's capture waiting to record its LSN",
        )
        r.signal(signal.SIGKILL)
        r.reap()
        gone = "select not exists (select from pg_stat_activity where pid = %s)"
        if its_transaction == "rolled back":
            wait_for(lambda: c.execute(gone, [pid]).fetchone()[0], what="the killed runner's backend to end")
            holder.execute("rollback")
            assert c.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
            assert c.execute("select queued_lsn from lockstep.capture_state").fetchone()[0] == before
        else:
            holder.execute("rollback")
            wait_for(lambda: c.execute(gone, [pid]).fetchone()[0], what="the killed runner's backend to end")
            assert c.execute("select count(*) from lockstep.queue").fetchone()[0] > 0
            assert c.execute("select queued_lsn from lockstep.capture_state").fetchone()[0] != before
        assert diverged(c)
        runners(wdsn, "--tick", "0.2", "--capture-every", "0.1")
        wait_for(lambda: converged(c), timeout=30, what="converged after the restart")
        wait_for(
            lambda: c.execute(
                "select s.confirmed_flush_lsn >= %s::pg_lsn"
                " from pg_replication_slots s, lockstep.capture_state t where s.slot_name = t.slot",
                [changed_at],
            ).fetchone()[0],
            timeout=30,
            what="the slot confirmed past the changes",
        )
        assert c.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0
        assert c.execute(recomputes).fetchone()[0] == recomputed  # converged from the queue alone


def test_a_server_restart_loses_nothing(cluster, wdsn):
    c = wal_cluster.connect(wdsn)
    change(c)
    c.execute("select lockstep.capture()")  # committed: the slot is advanced at the next capture
    c.execute("update example.exam_item set body = body || ' again' where exam_id = 6")
    c.execute("begin")
    c.execute("select lockstep.capture()")  # not committed when the server goes
    cluster.pg_ctl("restart", "-m", "immediate")
    c.close()
    with wal_cluster.connect(wdsn) as c:
        drain(c)


def test_a_subscribers_derived_table_follows_its_publisher_through_the_wal(cluster, wdsn):
    # the publisher: the example's tables (the same rows as the subscriber's, from one template)
    with wal_cluster.database(cluster, watched=False) as pub_dsn:
        pub = wal_cluster.connect(pub_dsn)
        sub = wal_cluster.connect(wdsn)
        slot = f"sub_{os.getpid()}"
        try:
            pub.execute("create publication app for table example.exam, example.exam_item")
            pub.execute("select pg_create_logical_replication_slot(%s, 'pgoutput')", [slot])
            conninfo = make_conninfo(pub_dsn)
            sub.execute(
                f"create subscription app connection '{conninfo}' publication app"
                f" with (create_slot = false, slot_name = '{slot}', copy_data = false)"
            )
            change(pub)
            pub.execute("insert into example.exam_item (exam_id, body) values (9, 'brand new words')")
            # the subscriber's apply worker writes the changes: no trigger fires for them
            wait_for(
                lambda: sub.execute(
                    "select count(*) from example.exam_item where body like '%brand new%'"
                ).fetchone()[0],
                timeout=30,
                what="the subscriber applying the changes",
            )
            wait_for(lambda: sub.execute("select count(*) from example.exam where id = 7").fetchone()[0] == 0)
            assert divergence(sub) != (0, 0)
            # captured from the subscriber's own WAL (its apply worker commits without waiting for the
            # flush, and a capture reads the flushed WAL: a moment later)
            wait_for(lambda: settle(sub), timeout=30, what="the subscriber's derived table current")
        finally:
            sub.execute("alter subscription app disable")
            sub.execute("alter subscription app set (slot_name = none)")
            sub.execute("drop subscription app")
            pub.close()
            sub.close()


def test_the_web_page_shows_the_capture(wdsn):
    with wal_cluster.connect(wdsn) as c:
        slot = c.execute("select slot from lockstep.capture_state").fetchone()[0]
        change(c)
        c.execute("select lockstep.capture()")
        data = web.collect(c, web.Sampler())
        assert data["errors"] == {}
        cap = data["capture"]
        assert (cap["slot"], cap["healthy"], cap["watched"]) == (slot, True, 2)
        assert cap["changes"] > 0 and cap["retained_bytes"] > 0 and cap["lag_bytes"] is not None
        html = web.render(data, 5)
        assert '<section id="capture">' in html
        assert f'<td class="slot">{slot}</td>' in html
        assert '<span class="badge done">healthy</span>' in html
        assert '<td class="retained-bytes">' in html and '<td class="lag-bytes">' in html
        # past its bound: unhealthy, and why
        c.execute("select lockstep.set_capture_bounds(1, 1024 * 1024 * 1024)")
        html = web.render(web.collect(c, web.Sampler()), 5)
        assert '<span class="badge failed">unhealthy</span>' in html
        assert f"slot {slot} (reserved) holds" in html and "is a runner capturing?" in html
