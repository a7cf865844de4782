"""Nothing stalls, nothing hides: every queued change reaches the derived table, whatever the order in
which queue entries commit and whatever the sessions' settings, and the status figures count every entry."""

from __future__ import annotations

import psycopg
import pytest
from isolation import Spec
from test_queue import DUE_NOW, picky_job, queue_keys
from util import not_due, result

from lockstep import db
from lockstep.lab.example import JOB, divergence
from lockstep.status import exit_code, reasons, unhealthy

PARKED = "select key from lockstep.parked_keys order by 1"


def test_a_fix_committed_after_the_failing_pass_with_a_lower_queue_id_is_written(ex, exconnect):
    """Queue ids are taken at insert, not at commit: a fix whose entry got id N and committed after a pass
    that failed on the key with entries up to N + 1 was taken for a change that pass had seen, and the key
    stayed parked on fixed data (work() idle for ever)."""
    picky_job(ex)
    ex.execute("update example.exam set title = title || ' poison' where id = 5")
    fix = exconnect()
    fix.execute("begin")
    fix.execute("update example.exam set title = replace(title, ' poison', '') where id = 5")  # id N
    ex.execute("update example.exam set body = body || ' other' where id = 6")  # id N + 1, committed
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["outcome"] == "done" and "poisoned" in r["error"]
    assert ex.execute(PARKED).fetchall() == [("5",)]
    fix.execute("commit")
    ex.execute(DUE_NOW)
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["outcome"] == "done" and r["error"] is None, r  # before: idle, 5 parked on fixed data
    assert ex.execute(PARKED).fetchall() == [] and queue_keys(ex) == []
    assert divergence(ex) == (0, 0)


def test_a_fix_committed_after_a_failing_retry_pass_with_a_lower_queue_id_is_written(ex, exconnect):
    """The same gap in a parked key's retry pass: the fix's entry (id N) commits after a retry pass that saw
    a later entry of the key (N + 1) and failed again."""
    picky_job(ex)
    ex.execute("update example.exam set title = title || ' poison' where id = 5")
    result(ex, f"lockstep.work('{JOB}')")
    assert ex.execute(PARKED).fetchall() == [("5",)]
    fix = exconnect()
    fix.execute("begin")
    fix.execute("update example.exam set title = replace(title, ' poison', '') where id = 5")  # id N
    ex.execute("insert into example.exam_item (exam_id, body) values (5, 'still poisoned')")  # N + 1
    ex.execute(DUE_NOW)
    r = result(ex, f"lockstep.work('{JOB}')")  # the retry pass: fails again on the data it sees
    assert r["outcome"] == "done" and "poisoned" in r["error"]
    fix.execute("commit")
    ex.execute(DUE_NOW)
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["outcome"] == "done" and r["error"] is None, r
    assert ex.execute(PARKED).fetchall() == [] and queue_keys(ex) == []
    assert divergence(ex) == (0, 0)


def test_a_parked_keys_entries_are_folded_into_one_and_counted(ex):
    """A parked key's entries piled up (3,000 updates of its children: 3,001 entries), hidden from
    queue_depth and queue_lag, and the pass that finally wrote it deleted them all with its row locks
    held. A failing pass folds the entries it saw of a failing key into one, which the status counts."""
    picky_job(ex)
    ex.execute("update example.exam set title = title || ' poison' where id = 5")
    result(ex, f"lockstep.work('{JOB}')")
    for n in range(40):  # one entry per statement
        ex.execute(f"insert into example.exam_item (exam_id, body) values (5, 'item {n}')")
    assert queue_keys(ex) == ["5"] * 41
    ex.execute(DUE_NOW)
    assert "poisoned" in result(ex, f"lockstep.work('{JOB}')")["error"]
    assert queue_keys(ex) == ["5"]  # before: 41
    depth, lag, parked = ex.execute(
        "select queue_depth, queue_lag, parked_keys from lockstep.status"
    ).fetchone()
    assert (depth, parked) == (1, 1) and lag is not None  # before: 0 and NULL
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "idle"
    ex.execute("update example.exam set title = replace(title, ' poison', '') where id = 5")
    ex.execute(DUE_NOW)
    assert result(ex, f"lockstep.work('{JOB}')")["error"] is None
    assert queue_keys(ex) == [] and divergence(ex) == (0, 0)


def test_a_hand_queued_key_in_another_text_is_not_tried_at_every_pass(ex):
    """'05' for a bigint key names parent 5, whose failure was recorded as '5': the entry '05' matched no
    key_failure row, so every pass claimed it again, without backoff, parked or not."""
    picky_job(ex)
    ex.execute("update example.exam set title = title || ' poison' where id = 5")
    ex.execute(f"delete from lockstep.queue; insert into lockstep.queue (job, key) values ('{JOB}', '05')")
    assert "poisoned" in result(ex, f"lockstep.work('{JOB}')")["error"]
    assert ex.execute(PARKED).fetchall() == [("5",)]
    for _ in range(3):
        assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "idle"  # before: done, failing again
    assert ex.execute("select attempts from lockstep.key_failure").fetchall() == [(1,)]
    assert queue_keys(ex) == ["5"]
    assert ex.execute(f"select lockstep.retry('{JOB}', array[5])").fetchone()[0] == 1


# a parent key of each type whose text depends on session settings, and a poison compute
KEYED_SQL = """
create schema k;
create table k.p_{name} (k {type} primary key, v integer not null);
create table k.d_{name} (k {type} primary key references k.p_{name} on delete cascade, v integer not null);
create function k.c_{name}(keys {type}[]) returns table (k {type}, v integer) language plpgsql as $$ begin
    if exists (select from k.p_{name} p where p.k = any(keys) and p.v < 0) then
        raise exception 'poison'; end if;
    return query select p.k, p.v * 10 from k.p_{name} p where keys is null or p.k = any(keys); end $$;
insert into k.p_{name} values ({a}, 1), ({b}, 2);
select lockstep.define_derived('{name}', 'k.d_{name}', 'k.c_{name}({type}[])', parent => 'k.p_{name}');
select lockstep.watch('{name}', 'k.p_{name}', 'k');
select lockstep.set_max_attempts('{name}', 1);
select lockstep.recompute('{name}');
update lockstep.job_state set next_run_at = now() + interval '1 hour';
"""

KEYS = {
    "tz": ("timestamptz", "timestamptz '2024-03-31 01:30:00+00'", "timestamptz '2024-07-01 12:00:00.5+00'"),
    "by": ("bytea", "'\\x41ff'::bytea", "'\\x00'::bytea"),
    "nu": ("numeric", "1.50", "2.0"),
}

SETTINGS = [
    ("timezone", "UTC", "Europe/Berlin"),
    ("datestyle", "ISO, YMD", "SQL, DMY"),
    ("intervalstyle", "postgres", "sql_standard"),
    ("extra_float_digits", "1", "-3"),
    ("bytea_output", "hex", "escape"),
    ("lc_monetary", "C", "C.utf8"),
    ("lc_numeric", "C", "C.utf8"),
    ("lc_time", "C", "C.utf8"),
]


@pytest.mark.parametrize("name", sorted(KEYS))
@pytest.mark.parametrize(("setting", "one", "other"), SETTINGS, ids=[s[0] for s in SETTINGS])
def test_a_key_is_one_text_whatever_the_session_settings(dsn, connect, name, setting, one, other):
    """The application under one value of a setting, the worker, retry() and the status under the other:
    a poison key is parked once (not claimed at every pass), its fix is written, retry(job, keys) finds it,
    and the derived table converges. Before, under another TimeZone or bytea_output, the worker recorded
    the key's failure in its session's text, which matched no queue entry: claimed at every pass, retry
    found 0 keys."""
    typ, a, b = KEYS[name]
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(KEYED_SQL.format(name=name, type=typ, a=a, b=b))
    app = connect(dsn, autocommit=True)
    work = connect(dsn, autocommit=True)
    app.execute("select set_config(%s, %s, false)", [setting, one])
    work.execute("select set_config(%s, %s, false)", [setting, other])
    app.execute(f"update k.p_{name} set v = -1 where k = {a}")
    assert "poison" in (result(work, f"lockstep.work('{name}')")["error"] or "")
    for _ in range(2):
        assert result(work, f"lockstep.work('{name}')")["outcome"] == "idle"
    assert work.execute("select count(*), max(attempts) from lockstep.key_failure").fetchone() == (1, 1)
    # the failure's key is the queue's text for the parent, and retry(job, keys) finds it in either session
    assert (
        work.execute(
            "select count(*) from lockstep.queue q join lockstep.key_failure f using (job, key)"
        ).fetchone()[0]
        == 1
    )
    app.execute(f"update k.p_{name} set v = 3 where k = {a}")
    work.execute("update lockstep.key_failure set retry_at = now()")
    r = result(work, f"lockstep.work('{name}')")
    assert r["outcome"] == "done" and r["error"] is None, r
    assert work.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0
    app.execute(f"update k.p_{name} set v = -1 where k = {b}")
    assert "poison" in (result(work, f"lockstep.work('{name}')")["error"] or "")
    app.execute(f"update k.p_{name} set v = 4 where k = {b}")
    assert app.execute(f"select lockstep.retry('{name}', array[{b}])").fetchone()[0] == 1
    assert work.execute(f"select lockstep.retry('{name}', array[{b}])").fetchone()[0] == 0  # already retried
    assert result(work, f"lockstep.work('{name}')")["error"] is None
    assert result(work, f"lockstep.work('{name}')")["outcome"] == "idle"
    assert work.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
    st = work.execute("select parked_keys, failing_keys, queue_depth from lockstep.status").fetchone()
    assert st == (0, 0, 0)
    diff = work.execute(
        f"select count(*) from ((select * from k.c_{name}(null) except select * from k.d_{name})"
        f" union all (select * from k.d_{name} except select * from k.c_{name}(null))) s"
    ).fetchone()[0]
    assert diff == 0


def test_numeric_keys_of_one_value_are_one_parent(dsn, connect):
    """numeric 1 and 1.00 are one parent (equal in its primary key) but two texts: queued as two keys, and
    a failure recorded under one left the other claimed at every pass."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(KEYED_SQL.format(name="nu", type="numeric", a="1.00", b="2"))
    conn = connect(dsn, autocommit=True)
    assert conn.execute("select lockstep.enqueue('nu', array[1, 1.00, 1.0]::numeric[])").fetchone()[0] == 1
    assert conn.execute("select key from lockstep.queue").fetchall() == [("1",)]
    conn.execute("delete from lockstep.queue")
    conn.execute("update k.p_nu set v = -1 where k = 1")  # the trigger queues the column's text, '1.00'
    conn.execute("insert into lockstep.queue (job, key) values ('nu', '1'), ('nu', '1.0')")
    assert "poison" in result(conn, "lockstep.work('nu')")["error"]
    assert conn.execute("select key, attempts from lockstep.key_failure").fetchall() == [("1", 1)]
    assert result(conn, "lockstep.work('nu')")["outcome"] == "idle"
    assert conn.execute("select key from lockstep.queue").fetchall() == [("1",)]
    conn.execute("update k.p_nu set v = 5 where k = 1.0")
    conn.execute("update lockstep.key_failure set retry_at = now()")
    assert result(conn, "lockstep.work('nu')")["error"] is None
    assert conn.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
    assert conn.execute("select v from k.d_nu where k = 1").fetchone()[0] == 50


FLAGGED_SQL = """
create table p (id int primary key, v int not null, bad boolean not null default false);
create table side (p_id int not null);
create table d (p_id int primary key references p on delete cascade, v int not null);
create function d_c(ids int[]) returns table (p_id int, v int) language plpgsql stable as $$
begin
    if exists (select from public.p x where (ids is null or x.id = any(ids)) and x.bad) then
        raise exception 'bad parent';
    end if;
    return query select x.id, x.v * 10 from public.p x where ids is null or x.id = any(ids);
end $$;
insert into p select g, g from generate_series(1, 100) g;
select lockstep.define_derived('dj', 'd', 'd_c(int[])', parent => 'p', every => '1 day');
select lockstep.set_batch_parents('dj', 10);
select lockstep.watch('dj', 'p', 'id');
select lockstep.watch('dj', 'side', 'p_id');
"""

HELD = "select recompute_held_since is not null from lockstep.status"
PROGRESS = "select recompute_done, recompute_total from lockstep.status"


def d_diverges(conn) -> int:
    return conn.execute(
        "select count(*) from ((select * from d except select * from d_c(null))"
        " union all (select * from d_c(null) except select * from d)) x"
    ).fetchone()[0]


def flagged_job(conn) -> None:
    conn.execute(FLAGGED_SQL)
    for _ in range(30):  # the first fill (newly watched: the recompute, then its hand-off)
        if run_now(conn, "dj")["outcome"] in ("idle", "not_due"):
            break
    assert conn.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
    assert conn.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0


def run_now(conn, job: str) -> dict:
    """lockstep.run(job) with every wait over (queued keys ready, retry times past)."""
    conn.execute("update lockstep.queue set ready_at = now()")
    conn.execute("update lockstep.job_state set retry_at = null")
    conn.execute("update lockstep.key_failure set retry_at = now()")
    return result(conn, f"lockstep.run('{job}')")


def test_a_recompute_of_parents_already_queued_shows_its_progress(conn):
    """recompute_done / recompute_total were NULL after a recompute that handed off parents the
    application's own changes had queued already (its hand-off's range held only new entries: none)."""
    flagged_job(conn)
    conn.execute("update p set v = v + 1")  # every parent changed, every parent queued
    r = result(conn, "lockstep.recompute('dj')")
    assert r["outcome"] == "done" and r["more"], r
    done, total = conn.execute(PROGRESS).fetchone()
    assert total is not None and 10 <= done < total, (done, total)  # before: NULL, NULL
    for _ in range(30):
        if run_now(conn, "dj")["outcome"] == "idle":
            break
    assert conn.execute(PROGRESS).fetchone() == (None, None) and d_diverges(conn) == 0


def test_a_held_recompute_is_released_only_after_its_hand_off(conn):
    """A recompute that met a poison parent handed every parent to the worker and held its flags until the
    poison was cured and the hand-off worked off. Handed-off parents queued already made the hand-off's range
    empty, and the first pass that cured the poison released the hold, the hand-off still queued."""
    flagged_job(conn)
    conn.execute("update p set v = v + 1")  # every parent queued
    conn.execute("update p set bad = true where id = 1")
    conn.execute("truncate side")  # a flag: the recompute, poisoned by parent 1, hands all 100 off
    r = run_now(conn, "dj")
    assert r["action"] == "recompute" and "handed to the worker" in (r["error"] or ""), r
    r = run_now(conn, "dj")  # the first pass: parent 1 fails
    assert conn.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 1
    conn.execute("update p set bad = false where id = 1")  # the fix
    r = run_now(conn, "dj")  # the retry pass: the cure
    assert r["action"] == "work" and r["error"] is None, r
    assert conn.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0
    assert conn.execute("select count(*) from lockstep.queue").fetchone()[0] > 0
    assert conn.execute(HELD).fetchone()[0]  # before: released, the hand-off still queued
    actions = [run_now(conn, "dj")["action"] for _ in range(20)]
    assert actions.index("recompute") > 0 and "work" in actions, actions
    assert conn.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0
    assert not conn.execute(HELD).fetchone()[0] and d_diverges(conn) == 0


def test_recompute_flags_at_every_call_do_not_starve_the_hand_off(conn):
    """A watched table truncated before every run() (a flag each time) made every call a full recompute
    that wrote the first batch_parents changed parents in key order and handed off the rest, which no worker
    pass ever took: the high parent was never written (60 calls), the queue grew. Now flags wait while a
    recompute's hand-off is being worked, and each is honoured after it."""
    flagged_job(conn)
    conn.execute("update p set v = v + 1000 where id = 100")
    written_at = None
    actions = []
    for n in range(60):
        conn.execute("update p set v = v + 1 where id <= 40")  # 40 low parents change between calls
        conn.execute("truncate side")  # a recompute flag before every call
        actions.append(run_now(conn, "dj")["action"])
        if written_at is None and conn.execute("select v from d where p_id = 100").fetchone()[0] == 11000:
            written_at = n
    assert written_at is not None and written_at <= 10, (written_at, actions)  # before: never
    # while a hand-off is queued, no recompute: between two recomputes, the worker takes the hand-off
    assert actions.count("work") >= 30 and actions.count("recompute") >= 5, actions
    for _ in range(100):  # the load stops: every flag is honoured, the queue drains
        if run_now(conn, "dj")["outcome"] in ("idle", "not_due"):
            break
    assert conn.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0
    assert conn.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
    assert d_diverges(conn) == 0


def test_recompute_flags_at_every_call_do_not_starve_a_queue_one_batch_covers(conn):
    """A flag before every run() and a whole recompute that fits one batch: every call was a recompute (it
    had no hand-off for the flag to wait for), no worker pass ever ran, and the entries the application
    queued piled up (150 after 30 calls). A flagged recompute now hands off the entries queued before it."""
    flagged_job(conn)
    actions = []
    for _ in range(30):
        conn.execute("update p set v = v + 1 where id <= 5")  # 5 parents queued between calls
        conn.execute("truncate side")  # a recompute flag before every call
        actions.append(run_now(conn, "dj")["action"])
        assert conn.execute("select count(*) from lockstep.queue").fetchone()[0] <= 10, actions
    assert actions.count("work") >= 10 and actions.count("recompute") >= 10, actions
    done, total = conn.execute(PROGRESS).fetchone()
    assert total is None or 0 <= done <= total, (done, total)
    for _ in range(100):  # the load stops: every flag is honoured, the queue drains
        if run_now(conn, "dj")["outcome"] in ("idle", "not_due"):
            break
    assert conn.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0
    assert conn.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
    assert conn.execute(PROGRESS).fetchone() == (None, None) and d_diverges(conn) == 0


def test_retry_in_a_transaction_never_deadlocks_with_a_worker_pass(ex, example_dsn):
    """retry() deleted key_failure rows without the group lock while a worker pass deleted and upserted
    them: an admin transaction that retried one key, then another while a pass held the second's row and
    waited for the first's, deadlocked with the pass (40P01). retry() takes the group lock: the pass is
    busy while an uncommitted retry holds it, and runs after."""
    picky_job(ex)
    ex.execute("update lockstep.job set max_attempts = 5")
    ex.execute("update example.exam set title = title || ' poison' where id in (5, 9)")
    assert "poisoned" in result(ex, f"lockstep.work('{JOB}')")["error"]
    assert ex.execute("select key from lockstep.failing_keys order by 1").fetchall() == [("5",), ("9",)]
    ex.execute("update example.exam set title = replace(title, ' poison', '') where id = 5")  # 5 fixed
    ex.execute(DUE_NOW)
    spec = Spec(
        example_dsn,
        sessions={"admin": ["set deadlock_timeout = '100ms'"], "worker": ["set deadlock_timeout = '10s'"]},
    )
    spec.step("abegin", "admin", "begin;")
    spec.step("aretry9", "admin", f"select lockstep.retry('{JOB}', array[9]);")
    spec.step("wwork", "worker", f"select outcome from lockstep.work('{JOB}');")
    spec.step("aretry5", "admin", f"select lockstep.retry('{JOB}', array[5]);")
    spec.step("acommit", "admin", "commit;")
    r = spec.run(["abegin", "aretry9", "wwork", "aretry5", "acommit"])
    assert "40P01" not in r.trace, r.trace  # before: the admin's second retry was the deadlock's victim
    assert r.sqlstate("aretry5") is None and r.rows("wwork") == [("busy",)], r.trace
    assert not r.waited("wwork") and not r.waited("aretry5"), r.trace
    ex.execute(DUE_NOW)
    for _ in range(5):
        result(ex, f"lockstep.work('{JOB}')")
        ex.execute(DUE_NOW)
    assert ex.execute("select key from lockstep.failing_keys").fetchall() == [("9",)]


def stall_reasons(conn) -> list[str]:
    return [r for r in reasons(db.status(conn)) if "ready queued key" in r]


def test_status_is_unhealthy_when_a_ready_key_stays_untaken(ex):
    """Each stall above left lockstep status healthy until --max-lag (15 minutes), the derived rows stale.
    The status now names the oldest key a worker pass should take (ready, its key not failing or due again,
    not a parked key's folded entry) and says unhealthy once it has waited past --max-stall or through
    --max-stall-passes worker passes."""
    not_due(ex, JOB)
    ex.execute(f"select lockstep.enqueue('{JOB}', array[7])")
    assert ex.execute("select stalled_passes from lockstep.status").fetchone()[0] == 0
    assert stall_reasons(ex) == [] and not unhealthy(db.status(ex))
    # ten worker passes of the job went by and left it (as when a claim no longer saw it)
    ex.execute(
        "insert into lockstep.run_log (job, owner, lock_group, kind, action, outcome, started_at,"
        " finished_at, duration_ms, run_no) select j.job, j.owner, j.lock_group, j.kind, 'work', 'done',"
        " now() + g * interval '1 ms', now() + g * interval '1 ms', 1, 1000 + g"
        " from lockstep.job j, generate_series(1, 10) g"
    )
    assert ex.execute("select stalled_passes from lockstep.status").fetchone()[0] == 10
    assert stall_reasons(ex) == [
        f"unhealthy: job {JOB}: a ready queued key was left by 10 worker passes (--max-stall-passes 10)"
    ]  # before: no reason, healthy
    assert exit_code(db.status(ex), max_stall_passes=0) == 0  # 0: not checked
    # or no pass at all while it waited longer than --max-stall (queue_lag alone: 15 minutes)
    ex.execute("delete from lockstep.run_log")
    ex.execute(
        "update lockstep.queue set enqueued_at = now() - interval '5 minutes',"
        " ready_at = now() - interval '5 minutes'"
    )
    assert unhealthy(db.status(ex)) and "waits 30" in stall_reasons(ex)[0]
    assert not unhealthy(db.status(ex), max_stall=600)
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "done"
    assert not unhealthy(db.status(ex))


def test_a_parked_keys_folded_entry_is_no_stall_and_its_later_fix_is(ex):
    """A parked key's folded entry waits for a change, not for a pass: no stall. A later change of it whose
    retry time has come is one a pass should take: left past the bound, it is a stall."""
    picky_job(ex)
    ex.execute("update example.exam set title = title || ' poison' where id = 5")
    result(ex, f"lockstep.work('{JOB}')")
    ex.execute(
        "update lockstep.queue set enqueued_at = now() - interval '1 hour',"
        " ready_at = now() - interval '1 hour'"
    )
    assert ex.execute("select stalled_for, stalled_passes from lockstep.status").fetchone() == (None, None)
    assert stall_reasons(ex) == []
    ex.execute("update example.exam set title = replace(title, ' poison', '') where id = 5")  # the fix
    # not before its retry time
    assert ex.execute("select stalled_for from lockstep.status").fetchone()[0] is None
    ex.execute("update lockstep.key_failure set retry_at = now() - interval '10 minutes'")
    ex.execute(
        "update lockstep.queue set ready_at = now() - interval '10 minutes'"
        " where ready_at > now() - interval '1 minute'"
    )
    assert "waits 60" in stall_reasons(ex)[0]
    assert result(ex, f"lockstep.work('{JOB}')")["error"] is None
    assert stall_reasons(ex) == [] and not unhealthy(db.status(ex))


def test_watch_replica_queues_what_a_replica_session_changes(ex):
    """A logical-replication subscriber's apply worker runs with session_replication_role = replica: watch()'s
    triggers (enabled for origin sessions) do not fire for it. watch_replica() adds a row trigger enabled for
    replica sessions only (the apply worker fires row triggers only): such a session's changes are queued
    (old and new key), an ordinary session's once, by the statement triggers. (The apply worker itself:
    tests/runner/test_replica.py.)"""
    not_due(ex, JOB)
    replica = "set session_replication_role = replica"
    ex.execute(replica)
    ex.execute("update example.exam set body = body || ' applied' where id = 3")
    ex.execute("reset session_replication_role")
    assert queue_keys(ex) == []  # watch() alone: nothing
    ex.execute(f"select lockstep.watch_replica('{JOB}', 'example.exam', 'id')")
    ex.execute(f"select lockstep.watch_replica('{JOB}', 'example.exam_item', 'exam_id')")
    ex.execute("delete from lockstep.recompute_flag")
    ex.execute(replica)
    ex.execute("update example.exam set body = body || ' applied' where id in (3, 4)")
    ex.execute("update example.exam_item set exam_id = 6 where exam_id = 5")  # a move: old and new parent
    ex.execute("reset session_replication_role")
    keys = queue_keys(ex)
    assert set(keys) == {"3", "4", "5", "6"} and keys.count("5") == keys.count("6") >= 1, keys
    ex.execute("delete from lockstep.queue")
    ex.execute("update example.exam set body = body || ' local' where id = 7")  # an ordinary session
    assert queue_keys(ex) == ["7"]
    assert result(ex, f"lockstep.work('{JOB}')")["error"] is None
    ex.execute(f"select lockstep.unwatch('{JOB}', 'example.exam')")
    ex.execute(f"select lockstep.drop_job('{JOB}')")
    assert ex.execute("select count(*) from pg_trigger where tgname like 'lockstep%'").fetchone()[0] == 0
