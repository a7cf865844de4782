"""Watching a table through the WAL (watch(..., via => 'wal')) and lockstep.capture(), on a throw-away
cluster with wal_level = logical (tests/wal_cluster.py), one per module: no trigger in the application's
transaction, every change's keys queued (old and new), at least once, TRUNCATE and DDL flag the job, the
refusals, and nothing retained for ever."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator

import pg_cluster
import psycopg
import pytest
import wal_cluster
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from util import raises_sqlstate, snapshot

from lockstep.lab.example import JOB, divergence
from lockstep.migrate import migrate

pytestmark = pytest.mark.skipif(not pg_cluster.AVAILABLE, reason=pg_cluster.MISSING)


@pytest.fixture(scope="module")
def cluster() -> Iterator[pg_cluster.Cluster]:
    with wal_cluster.running() as c:
        yield c


@pytest.fixture
def wdsn(cluster: pg_cluster.Cluster) -> Iterator[str]:
    with wal_cluster.database(cluster) as dsn:
        yield dsn


@pytest.fixture
def c(wdsn: str) -> Iterator[psycopg.Connection]:
    with wal_cluster.connect(wdsn) as conn:
        yield conn


def capture(c: psycopg.Connection) -> dict:
    cur = c.execute("select * from lockstep.capture()")
    return dict(zip([d.name for d in cur.description], cur.fetchone(), strict=True))


def queued(c: psycopg.Connection) -> list[str]:
    return [r[0] for r in c.execute("select distinct key from lockstep.queue order by 1")]


def flags(c: psycopg.Connection) -> list[str]:
    return [r[0] for r in c.execute("select problem from lockstep.recompute_flag order by flagged_at")]


def converge(c: psycopg.Connection) -> None:
    for _ in range(20):
        r = c.execute("select outcome from lockstep.run(%s)", [JOB]).fetchone()[0]
        if r == "idle":
            break
    assert divergence(c) == (0, 0)


def test_no_trigger_and_every_change_queues_its_keys_old_and_new(c):
    assert (
        c.execute(
            "select count(*) from pg_trigger where not tgisinternal"
            " and tgrelid in ('example.exam'::regclass, 'example.exam_item'::regclass)"
        ).fetchone()[0]
        == 0
    )
    c.execute("update example.exam_item set body = body || ' x' where exam_id = 2")
    c.execute("insert into example.exam_item (exam_id, body) values (3, 'new words')")
    # a key column update: the old exam (4) and the new one (5)
    c.execute(
        "update example.exam_item set exam_id = 5"
        " where id = (select min(id) from example.exam_item where exam_id = 4)"
    )
    c.execute("delete from example.exam where id = 7")
    c.execute("insert into example.exam (id, title, body) values (12, 'twelve', 'twelve')")
    c.execute("update example.exam set id = 13 where id = 12")  # the parent's own key: old and new
    assert divergence(c) != (0, 0)
    r = capture(c)
    assert r["outcome"] == "done" and r["flagged"] == 0
    assert queued(c) == ["12", "13", "2", "3", "4", "5", "7"]
    converge(c)
    assert capture(c)["outcome"] == "idle"


def test_changes_committed_in_any_order_all_arrive(c, wdsn):
    with wal_cluster.connect(wdsn) as a, wal_cluster.connect(wdsn) as b:
        a.execute("begin")
        a.execute("update example.exam_item set body = body || ' a' where exam_id = 2")
        b.execute("begin")
        b.execute("update example.exam_item set body = body || ' b' where exam_id = 3")
        b.execute("commit")
        capture(c)  # b's change; a's is not committed yet
        assert queued(c) == ["3"]
        c.execute("update example.exam_item set body = body || ' c' where exam_id = 6")
        capture(c)
        a.execute("commit")  # began before the two captures, committed after them
    capture(c)
    assert queued(c) == ["2", "3", "6"]
    converge(c)


def test_a_capture_that_rolls_back_is_read_again_and_the_slot_does_not_move_past_it(c):
    c.execute("update example.exam_item set body = body || ' x' where exam_id in (2, 9)")
    slot = c.execute("select slot from lockstep.capture_state").fetchone()[0]
    # how far the slot may go: what it has confirmed, or what the last committed capture recorded
    bound = c.execute(
        "select greatest(s.confirmed_flush_lsn, c.queued_lsn)"
        " from pg_replication_slots s, lockstep.capture_state c where s.slot_name = c.slot"
    ).fetchone()[0]
    c.execute("begin")
    assert capture(c)["keys"] == 2
    c.execute("rollback")  # a capture that failed after its read: nothing of it stays
    assert queued(c) == []
    moved = c.execute(
        "select confirmed_flush_lsn > %s::pg_lsn from pg_replication_slots where slot_name = %s",
        [bound, slot],
    ).fetchone()[0]
    assert moved is False
    # the next capture reads the same changes again
    assert capture(c)["keys"] == 2
    assert queued(c) == ["2", "9"]
    converge(c)


def test_a_capture_failing_midway_changes_nothing(c):
    c.execute("update example.exam_item set body = body || ' x' where exam_id = 2")
    # a queue insert that fails: the capture's statement is one, so it rolls back whole
    c.execute("alter table lockstep.queue add constraint no_two check (key <> '2')")
    before = c.execute("select queued_lsn from lockstep.capture_state").fetchone()[0]
    with pytest.raises(psycopg.errors.CheckViolation):
        capture(c)
    assert c.execute("select queued_lsn from lockstep.capture_state").fetchone()[0] == before
    c.execute("alter table lockstep.queue drop constraint no_two")
    assert capture(c)["keys"] == 1
    assert queued(c) == ["2"]
    converge(c)


def test_truncate_of_a_watched_table_flags_the_job(c):
    c.execute("truncate example.exam_item")
    r = capture(c)
    assert r["flagged"] == 1
    assert flags(c) == ["TRUNCATE of example.exam_item"]
    assert c.execute("select outcome, action from lockstep.run(%s)", [JOB]).fetchone() == (
        "done",
        "recompute",
    )
    converge(c)
    assert flags(c) == []


def test_a_renamed_or_dropped_key_column_flags_the_job_and_the_capture_goes_on(c):
    c.execute("update example.exam_item set body = body || ' x' where exam_id = 2")
    c.execute("alter table example.exam_item rename column exam_id to exam")
    c.execute("update example.exam_item set body = body || ' y' where exam = 3")
    c.execute("update example.exam set title = title || ' z' where id = 4")
    r = capture(c)
    assert r["flagged"] == 1
    assert queued(c) == ["2", "4"]  # before the rename, and the other table's change after it
    assert flags(c) == ["column exam_id of example.exam_item is not in its WAL records (renamed or dropped)"]
    c.execute("update example.exam set title = title || ' w' where id = 5")
    assert capture(c)["keys"] == 1  # not stalled
    assert "5" in queued(c)


def test_watch_via_wal_refuses_a_replica_identity_without_the_key_column_and_changes_nothing(c):
    c.execute("alter table example.exam_item replica identity default")  # the primary key: id only
    c.execute("select lockstep.unwatch(%s, 'example.exam_item')", [JOB])
    before = snapshot(c, "lockstep.wal_watch")
    with raises_sqlstate(
        "55000", match="replica identity of example.exam_item does not hold column exam_id"
    ) as e:
        c.execute("select lockstep.watch(%s, 'example.exam_item', 'exam_id', via => 'wal')", [JOB])
    assert "REPLICA IDENTITY FULL" in e.value.diag.message_hint
    assert snapshot(c, "lockstep.wal_watch") == before


def test_watch_via_wal_refuses_bad_input(c):
    before = snapshot(c, "lockstep.wal_watch")
    with raises_sqlstate("22023", match="not a way to watch"):
        c.execute("select lockstep.watch(%s, 'example.exam', 'id', via => 'logical')", [JOB])
    with raises_sqlstate("22023", match="not a way to watch a table through another"):
        c.execute(
            "select lockstep.watch(%s, 'example.exam_item', 'id', through => 'example.exam_item',"
            " through_column => 'exam_id', via => 'wal')",
            [JOB],
        )
    with raises_sqlstate("22023"):
        c.execute("select lockstep.watch(%s, 'example.exam', 'id', via => null)", [JOB])
    with raises_sqlstate("42703"):
        c.execute("select lockstep.watch(%s, 'example.exam', 'nope', via => 'wal')", [JOB])
    with raises_sqlstate("LSJ01"):
        c.execute("select lockstep.watch('nope', 'example.exam', 'id', via => 'wal')")
    c.execute("create role walless login")
    try:
        c.execute("grant root to walless")  # may act for the job's owner, but has no REPLICATION
        c.execute("set role walless")
        with raises_sqlstate("42501", match="may not use replication slots") as e:
            c.execute("select lockstep.watch(%s, 'example.exam', 'id', via => 'wal')", [JOB])
        assert "REPLICATION" in e.value.diag.message_hint
    finally:
        c.execute("reset role")
        c.execute("drop role walless")
    assert snapshot(c, "lockstep.wal_watch") == before


def test_watch_via_wal_refuses_a_server_whose_wal_level_is_not_logical(ex):
    assert ex.execute("show wal_level").fetchone()[0] != "logical"
    before = snapshot(ex)
    with raises_sqlstate("55000", match="wal_level = logical") as e:
        ex.execute("select lockstep.watch(%s, 'example.exam', 'id', via => 'wal')", [JOB])
    assert "triggers" in e.value.diag.message_hint
    assert snapshot(ex) == before


def test_switching_between_triggers_and_the_wal(c):
    c.execute("select lockstep.watch(%s, 'example.exam_item', 'exam_id', via => 'trigger')", [JOB])
    assert (
        c.execute(
            "select count(*) from lockstep.wal_watch where source = 'example.exam_item'::regclass"
        ).fetchone()[0]
        == 0
    )
    assert (
        c.execute(
            "select count(*) from pg_trigger"
            " where tgrelid = 'example.exam_item'::regclass and not tgisinternal"
        ).fetchone()[0]
        == 4
    )
    c.execute("select lockstep.watch(%s, 'example.exam_item', 'exam_id', via => 'wal')", [JOB])
    assert (
        c.execute(
            "select count(*) from pg_trigger"
            " where tgrelid = 'example.exam_item'::regclass and not tgisinternal"
        ).fetchone()[0]
        == 0
    )
    c.execute("update example.exam_item set body = body || ' x' where exam_id = 2")
    assert queued(c) == []  # no trigger
    capture(c)
    assert queued(c) == ["2"]


def test_the_application_never_waits_for_a_capture(c, wdsn):
    c.execute("begin")
    capture(c)  # its transaction open: what it holds
    held = c.execute(
        "select count(*) from pg_locks where pid = pg_backend_pid() and locktype = 'relation'"
        " and relation in ('example.exam'::regclass, 'example.exam_item'::regclass)"
    ).fetchone()[0]
    assert held == 0
    with wal_cluster.connect(wdsn) as app:
        app.execute("set lock_timeout = '5s'")  # a wait would fail it
        app.execute("update example.exam_item set body = body || ' x' where exam_id = 2")
        app.execute("delete from example.exam where id = 3")
        app.execute("truncate example.exam_item")  # ACCESS EXCLUSIVE: nothing of lockstep's in its way
    c.execute("commit")


def test_unwatch_and_drop_job_remove_the_publication_and_the_slot_when_nothing_uses_them(c):
    slot = c.execute("select slot from lockstep.capture_state").fetchone()[0]

    def state() -> tuple[int, int, int]:
        return c.execute(
            "select (select count(*) from pg_replication_slots where slot_name = %s),"
            " (select count(*) from pg_publication where pubname = 'lockstep_capture'),"
            " (select count(*) from pg_publication_tables where pubname = 'lockstep_capture')",
            [slot],
        ).fetchone()

    assert state() == (1, 1, 2)
    c.execute("select lockstep.unwatch(%s, 'example.exam_item')", [JOB])
    assert state() == (1, 1, 1)
    c.execute("select lockstep.drop_job(%s)", [JOB])
    assert state() == (0, 0, 0)
    assert c.execute("select count(*) from lockstep.capture_state").fetchone()[0] == 0
    assert capture(c)["outcome"] == "idle"


def test_past_its_bounds_the_slot_is_unhealthy_then_recreated_and_the_jobs_flagged(c, wdsn):
    with raises_sqlstate("22023"):
        c.execute("select lockstep.set_capture_bounds(10, 5)")
    c.execute("select lockstep.set_capture_bounds(1, 1024 * 1024 * 1024)")
    c.execute("create table filler as select g, repeat('x', 100) t from generate_series(1, 1000) g")
    assert c.execute("select healthy from lockstep.capture_status").fetchone()[0] is False
    c.execute("select lockstep.set_capture_bounds(1, 1)")
    r = capture(c)
    assert r["flagged"] == 1
    assert c.execute("select recreated from lockstep.capture_status").fetchone()[0] == 1
    assert "it was recreated" in flags(c)[0]
    # lockstep status says so, and exits 1
    p = subprocess.run(
        [sys.executable, "-m", "lockstep", "status", "--dsn", wdsn],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 1 and "capture: slot" in p.stderr, p.stderr
    c.execute("select lockstep.set_capture_bounds(256 * 1024 * 1024, 1024 * 1024 * 1024)")
    assert c.execute("select healthy from lockstep.capture_status").fetchone()[0] is True
    converge(c)


def test_the_downgrade_removes_the_slot_and_the_publication(c, wdsn):
    slot = c.execute("select slot from lockstep.capture_state").fetchone()[0]
    migrate(wdsn, "lockstep_0001", downgrade=True)
    assert (
        c.execute("select count(*) from pg_replication_slots where slot_name = %s", [slot]).fetchone()[0] == 0
    )
    assert c.execute("select count(*) from pg_publication").fetchone()[0] == 0


def test_a_capture_that_finds_no_watched_change_moves_the_slot_and_writes_nothing(c):
    c.execute("create table public.other (id int)")
    c.execute("insert into public.other select generate_series(1, 100)")  # not watched
    lsn = c.execute("select pg_current_wal_flush_lsn()").fetchone()[0]
    row = c.execute("select xmin::text from lockstep.capture_state").fetchone()[0]
    assert capture(c)["outcome"] == "idle"
    assert c.execute("select xmin::text from lockstep.capture_state").fetchone()[0] == row
    moved = c.execute(
        "select s.confirmed_flush_lsn >= %s::pg_lsn from pg_replication_slots s, lockstep.capture_state c"
        " where s.slot_name = c.slot",
        [lsn],
    ).fetchone()[0]
    assert moved is True
    c.execute("update example.exam_item set body = body || ' x' where exam_id = 2")  # then one watched
    assert capture(c)["keys"] == 1


def test_lag_counts_from_where_an_idle_capture_moved_the_slot(c):
    c.execute("update example.exam_item set body = body || ' x' where exam_id = 2")  # a watched change
    assert capture(c)["keys"] == 1
    c.execute("create table public.other (id int)")
    c.execute("insert into public.other select generate_series(1, 50000)")  # about 2 MB of WAL, not watched
    assert capture(c)["outcome"] == "idle"
    lag, behind_slot = c.execute(
        "select lag_bytes, pg_current_wal_lsn() - confirmed_flush_lsn from lockstep.capture_status"
    ).fetchone()
    assert lag <= behind_slot < 100_000


NOTES = """
create table public.notes (id int, exam_id int not null, body text, primary key (id, exam_id))
    partition by range (exam_id);
create table public.notes_low partition of public.notes for values from (1) to (6);
create table public.notes_high partition of public.notes for values from (6) to (11);
insert into public.notes select g, g, 'note' from generate_series(1, 10) g;
"""


@pytest.fixture
def notes(c: psycopg.Connection) -> psycopg.Connection:
    """public.notes, partitioned on exam_id (two partitions, one row per exam), watched through the WAL:
    its partitions' primary keys hold exam_id, their replica identity; nothing queued or flagged."""
    c.execute(NOTES)
    notices: list[str] = []
    c.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    c.execute("select lockstep.watch(%s, 'public.notes', 'exam_id', via => 'wal')", [JOB])
    # no "run it again after attaching": the capture follows the partitions of the day it reads
    assert not any("partition" in n for n in notices), notices
    capture(c)
    converge(c)
    assert flags(c) == [] and queued(c) == []
    return c


def test_a_partitioned_table_watched_through_the_wal_queues_its_partitions_changes(notes):
    c = notes
    # the publication holds the partitioned table; PostgreSQL publishes each change under its partition
    assert c.execute(
        "select array_agg(tablename::text order by tablename) from pg_publication_tables"
        " where pubname = 'lockstep_capture' and schemaname = 'public'"
    ).fetchone()[0] == ["notes_high", "notes_low"]
    c.execute("insert into public.notes values (11, 2, 'new'), (12, 7, 'new')")
    c.execute("update public.notes set body = 'changed' where exam_id = 3")
    c.execute("delete from public.notes where exam_id = 9")
    c.execute("update public.notes set exam_id = 8 where id = 4")  # moves to the other partition
    c.execute("update public.notes set exam_id = 5 where id = 10")  # and back
    r = capture(c)
    assert r["flagged"] == 0
    assert queued(c) == ["10", "2", "3", "4", "5", "7", "8", "9"]
    converge(c)
    assert capture(c)["outcome"] == "idle"


def test_a_partition_attached_or_detached_after_watch_flags_the_job_and_is_followed(notes):
    c = notes
    c.execute("create table public.notes_more (like public.notes including all)")
    c.execute("insert into public.notes_more values (13, 12, 'already there')")
    c.execute("alter table public.notes attach partition public.notes_more for values from (11) to (21)")
    r = capture(c)  # its rows joined the table with no change in the WAL: the job recomputes in full
    assert r["flagged"] == 1
    assert flags(c) == [
        "the tables below public.notes changed (attached, detached or dropped):"
        " their rows wait for the full recompute"
    ]
    converge(c)
    c.execute("insert into public.notes values (14, 15, 'new')")  # published under the new partition
    c.execute("update public.notes set body = 'x' where exam_id = 12")
    assert capture(c)["flagged"] == 0
    assert queued(c) == ["12", "15"]
    converge(c)
    # changed, then detached before the capture reads the change: the flag covers both
    c.execute("update public.notes set body = 'y' where exam_id = 7")
    c.execute("alter table public.notes detach partition public.notes_high")
    r = capture(c)
    assert r["flagged"] == 1
    assert flags(c)[-1].startswith("the tables below public.notes changed")
    converge(c)
    c.execute("update public.notes_high set body = 'z' where exam_id = 8")  # no longer watched
    assert capture(c)["flagged"] == 0
    assert queued(c) == []
    c.execute("drop table public.notes_more")  # a partition dropped: its rows left the table
    assert capture(c)["flagged"] == 1
    converge(c)
    assert capture(c)["outcome"] == "idle"


def test_a_table_partitioned_on_another_column_needs_each_partitions_identity(c):
    """Partitioned on kind, watched on exam_id: each partition's replica identity must hold exam_id (the
    root's does not reach its partitions); a row moved between partitions queues its key; a partition
    attached later with a narrower identity flags the job at its first update or delete."""
    c.execute(
        "create table public.marks (id int, kind text, exam_id int not null, primary key (id, kind))"
        " partition by list (kind);"
        " create table public.marks_a partition of public.marks for values in ('a');"
        " create table public.marks_b partition of public.marks for values in ('b');"
        " insert into public.marks values (1, 'a', 2), (2, 'b', 3);"
        " alter table public.marks replica identity full; alter table public.marks_a replica identity full"
    )
    with raises_sqlstate("55000", match="replica identity of public.marks_b does not hold column exam_id"):
        c.execute("select lockstep.watch(%s, 'public.marks', 'exam_id', via => 'wal')", [JOB])
    c.execute("alter table public.marks_b replica identity full")
    c.execute("select lockstep.watch(%s, 'public.marks', 'exam_id', via => 'wal')", [JOB])
    capture(c)
    converge(c)
    c.execute("update public.marks set kind = 'b' where id = 1")  # from marks_a to marks_b, same exam
    c.execute("update public.marks set exam_id = 4 where id = 2")  # within marks_b, another exam
    assert capture(c)["flagged"] == 0
    assert queued(c) == ["2", "3", "4"]
    converge(c)
    c.execute(
        "create table public.marks_c partition of public.marks for values in ('c')"
    )  # identity: (id, kind)
    assert capture(c)["flagged"] == 1  # attached
    converge(c)
    c.execute("insert into public.marks values (3, 'c', 5)")
    assert capture(c)["flagged"] == 0 and queued(c) == ["5"]
    converge(c)
    c.execute(
        "update public.marks set exam_id = 6 where id = 3"
    )  # the WAL has (id, kind) of the old row only
    assert capture(c)["flagged"] == 1
    assert flags(c)[-1] == "the replica identity of public.marks_c no longer holds column exam_id"
    converge(c)


CAPTURE_OWNER_GRANTS = [
    "grant usage on schema example to {role}",
    "grant select on example.exam, example.exam_item to {role}",
    "grant update (id) on example.exam to {role}",
    "grant select, insert, update, delete on example.exam_key to {role}",
]
# what a runner of the recipe reads besides, to capture (and REPLICATION)
CAPTURE_RUNNER_GRANTS = [
    "grant select on lockstep.wal_watch, lockstep.capture_state, lockstep.setting to {role}",
]
WRITES_HELD = (
    "select c.relname, p.p from pg_class c cross join unnest(array['INSERT', 'UPDATE', 'DELETE']) p(p)"
    " where c.relnamespace = 'lockstep'::regnamespace and c.relkind in ('r', 'p')"
    " and (has_table_privilege(%(r)s, c.oid, p.p)"
    " or (p.p <> 'DELETE' and has_any_column_privilege(%(r)s, c.oid, p.p)))"
)
NOT_CAPTURERS_CALLS = [
    "lockstep._capture_queue(array['exam_keys'], array['1'], null, null)",
    "lockstep._capture_done('0/0', 1)",
    "lockstep._capture_forget()",
    "lockstep._capture_slot_made('x', 'why', false)",
    "lockstep._capture_families()",
]


def test_a_runner_holding_no_write_on_lockstep_tables_captures_and_runs(c, wdsn):
    """A runner of the recipe (docs/security.md) with REPLICATION and the capture's reads, which holds no
    INSERT, UPDATE or DELETE on lockstep's tables: `lockstep run --once` captures the WAL's changes
    (lockstep's definer functions queue them and record the LSN read) and its worker converges the job. A
    role with neither REPLICATION nor lockstep's admin rights is refused by those functions (42501)."""
    from test_security import OWNER_GRANTS, RUNNER_GRANTS

    tag = secrets.token_hex(4)
    owner, runner, other = f"wal_owner_{tag}", f"wal_runner_{tag}", f"wal_other_{tag}"
    names = {"db": conninfo_to_dict(wdsn)["dbname"], "owner": owner}
    made: list[str] = []

    def grant(role: str, *grant_lists: list[str]) -> None:
        idents = {k: sql.Identifier(v) for k, v in names.items()}
        for grants in grant_lists:
            for g in grants:
                c.execute(sql.SQL(g).format(role=sql.Identifier(role), **idents))

    try:
        for name, attrs in ((owner, "nologin"), (runner, "login noinherit replication"), (other, "login")):
            c.execute(sql.SQL("create role {} " + attrs).format(sql.Identifier(name)))
            made.append(name)
        grant(owner, OWNER_GRANTS, CAPTURE_OWNER_GRANTS)
        grant(runner, RUNNER_GRANTS, CAPTURE_RUNNER_GRANTS)
        grant(other, ["grant usage on schema lockstep to {role}"])
        c.execute("update lockstep.job set owner = %s where job = %s", [owner, JOB])
        assert c.execute(WRITES_HELD, {"r": runner}).fetchall() == []
        c.execute("update example.exam_item set body = body || ' x' where exam_id = 2")
        c.execute("truncate example.exam_item")  # says nothing of its keys: the job is flagged
        p = subprocess.run(
            [sys.executable, "-m", "lockstep", "run", "--once", "--dsn", make_conninfo(wdsn, user=runner)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, p.stderr
        assert "Traceback" not in p.stderr and "ERROR" not in p.stderr, p.stderr
        state = c.execute("select changes > 0, last_capture_at is not null from lockstep.capture_state")
        assert state.fetchone() == (True, True), p.stderr
        with psycopg.connect(make_conninfo(wdsn, user=runner), autocommit=True) as r:
            for _ in range(20):
                if r.execute("select outcome from lockstep.run(%s)", [JOB]).fetchone()[0] == "idle":
                    break
        assert c.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0
        assert divergence(c) == (0, 0)
        # a role that may capture queues and flags only the jobs watched through the WAL
        before = snapshot(c)
        with psycopg.connect(make_conninfo(wdsn, user=runner), autocommit=True) as r:
            r.execute(
                "select lockstep._capture_queue(array['no_such_job'], array['1'], array['no_such_job'],"
                " array['forged'])"
            )
        assert snapshot(c) == before
        with psycopg.connect(make_conninfo(wdsn, user=other), autocommit=True) as o:
            for call in NOT_CAPTURERS_CALLS:
                with raises_sqlstate("42501", match="may not record a capture"):
                    o.execute(f"select {call}")
    finally:
        for name in reversed(made):
            c.execute(sql.SQL("drop owned by {} cascade").format(sql.Identifier(name)))
        for name in reversed(made):
            c.execute(sql.SQL("drop role {}").format(sql.Identifier(name)))


def test_a_numeric_key_read_from_the_wal_is_queued_without_trailing_zeros(c):
    """The WAL holds a numeric(10,2) column's text, 1.00: it was queued as it is, while enqueue() and the
    triggers queue lockstep._canon's 1 for the same parent."""
    c.execute(
        "create table public.np (id numeric(10,2) primary key, body text not null default '');"
        " create table public.nt (p_id numeric(10,2) primary key references public.np on delete cascade,"
        " n int not null);"
        " create function public.nt_c(keys numeric[]) returns table (p_id numeric, n int) language sql stable"
        " as $$ select p.id, length(p.body) from public.np p where keys is null or p.id = any(keys) $$;"
        " create table public.ns (id int primary key, p_id numeric(10,2));"
        " alter table public.ns replica identity full;"
        " insert into public.np values (1), (2.5)"
    )
    c.execute("select lockstep.define_derived('kn', 'public.nt', 'public.nt_c(numeric[])', 'public.np')")
    c.execute("select lockstep.watch('kn', 'public.ns', 'p_id', via => 'wal')")
    capture(c)
    c.execute("delete from lockstep.queue")
    c.execute("insert into public.ns values (1, 1), (2, 2.5)")
    assert capture(c)["outcome"] == "done"
    c.execute("select lockstep.enqueue('kn', array[1.000, 2.50]::numeric[])")
    keys = c.execute("select array_agg(distinct key order by key) from lockstep.queue where job = 'kn'")
    assert keys.fetchone()[0] == ["1", "2.5"]


def test_a_composite_keys_numeric_field_read_from_the_wal_is_queued_without_trailing_zeros(c):
    c.execute(
        "create table public.cp (a numeric(10,2) not null, b int not null, body text not null default '',"
        " primary key (a, b));"
        " create table public.ct (a numeric(10,2) not null, b int not null, n int not null,"
        " primary key (a, b), foreign key (a, b) references public.cp on delete cascade);"
        " create type public.ck as (a numeric, b int);"
        " create function public.ct_c(keys public.ck[]) returns table (a numeric, b int, n int) language sql"
        " stable as $$ select p.a, p.b, length(p.body) from public.cp p"
        " where keys is null or (p.a, p.b) in (select k.a, k.b from unnest(keys) k) $$;"
        " create table public.cs (id int primary key, a numeric(10,2), b int);"
        " alter table public.cs replica identity full;"
        " insert into public.cp values (1, 1), (2.5, 2)"
    )
    c.execute(
        "select lockstep.define_derived('kc', 'public.ct', 'public.ct_c(public.ck[])', 'public.cp',"
        " parent_columns => array['a', 'b']::name[])"
    )
    c.execute(
        "select lockstep.watch('kc', 'public.cs', key_columns => array['a', 'b']::name[], via => 'wal')"
    )
    capture(c)
    c.execute("delete from lockstep.queue")
    c.execute("insert into public.cs values (1, 1, 1), (2, 2.5, 2)")
    assert capture(c)["outcome"] == "done"
    c.execute("select lockstep.enqueue('kc', array[row(1, 1), row(2.50, 2)]::public.ck[])")
    keys = c.execute("select array_agg(distinct key order by key) from lockstep.queue where job = 'kc'")
    assert keys.fetchone()[0] == ["(1,1)", "(2.5,2)"]


def test_an_owner_of_the_recipe_unwatches_and_drops_a_job_watched_through_the_wal(c, wdsn):
    """The owner recipe holds nothing on lockstep.wal_watch: its watch, unwatch and drop_job write and read
    it through lockstep's definer functions. An owner of the recipe with REPLICATION, owning the watched
    tables and the capture publication, unwatches a table, watches it again (the job is flagged), unwatches
    it, then drops the job: the table leaves the publication, then the publication, the slot and the
    capture's state go."""
    from test_security import OWNER_GRANTS

    owner = f"wal_owner_{secrets.token_hex(4)}"
    idents = {"role": sql.Identifier(owner), "db": sql.Identifier(conninfo_to_dict(wdsn)["dbname"])}
    pub = c.execute("select lockstep._capture_publication()").fetchone()[0]
    published = "select array_agg(tablename::text order by 1) from pg_publication_tables where pubname = %s"
    c.execute(sql.SQL("create role {} login replication").format(sql.Identifier(owner)))
    try:
        for g in [*OWNER_GRANTS, *CAPTURE_OWNER_GRANTS, "grant create on database {db} to {role}"]:
            c.execute(sql.SQL(g).format(**idents))
        for t in ("exam", "exam_item"):
            c.execute(
                sql.SQL("alter table {} owner to {}").format(sql.Identifier("example", t), idents["role"])
            )
        c.execute(sql.SQL("alter publication {} owner to {}").format(sql.Identifier(pub), idents["role"]))
        c.execute("update lockstep.job set owner = %s where job = %s", [owner, JOB])
        with psycopg.connect(make_conninfo(wdsn, user=owner), autocommit=True) as o:
            assert (
                o.execute("select has_table_privilege('lockstep.wal_watch', 'select')").fetchone()[0] is False
            )
            o.execute("select lockstep.unwatch(%s, 'example.exam_item')", [JOB])
            watched = c.execute("select array_agg(source::text) from lockstep.wal_watch").fetchone()[0]
            assert watched == ["example.exam"]
            assert c.execute(published, [pub]).fetchone()[0] == ["exam"]
            c.execute("delete from lockstep.recompute_flag")
            o.execute("select lockstep.watch(%s, 'example.exam_item', 'exam_id', via => 'wal')", [JOB])
            assert c.execute(published, [pub]).fetchone()[0] == ["exam", "exam_item"]
            assert flags(c) == [
                "example.exam_item watched through the WAL on column exam_id now: its earlier changes "
                "wait for the full recompute"
            ]
            o.execute("select lockstep.unwatch(%s, 'example.exam_item')", [JOB])
            o.execute("select lockstep.drop_job(%s)", [JOB])
        assert c.execute("select count(*) from lockstep.wal_watch").fetchone()[0] == 0
        assert c.execute("select count(*) from pg_publication where pubname = %s", [pub]).fetchone()[0] == 0
        assert c.execute("select count(*) from lockstep.capture_state").fetchone()[0] == 0
        slot = c.execute("select lockstep._capture_slot()").fetchone()[0]
        assert (
            c.execute("select count(*) from pg_replication_slots where slot_name = %s", [slot]).fetchone()[0]
            == 0
        )
    finally:
        c.execute(sql.SQL("drop owned by {} cascade").format(idents["role"]))
        c.execute(sql.SQL("drop role {}").format(idents["role"]))
