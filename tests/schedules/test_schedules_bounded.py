"""Recompute in bounded batches, as deterministic schedules and with a real runner process.

A recompute whose difference touches more than the job's batch_parents parents writes the first batch (in
parent-key order) and hands the others to the queue, where worker passes recompute them fresh, one bounded
transaction each. The schedules show what that changes for an application (it never waits for a batch it
is not in), and that the guarantees still hold: no lost update, convergence, nothing lost on kill -9
between batches (tests/runner/test_runner_bounded.py), rule 7, skipped parents retried, poison parents
isolated, 0 deadlocks.

Each schedule's whole trace is compared with tests/expected/schedules_bounded/<test>.out
(``expected_trace``; rewrite with --update-expected). Session s1 is lockstep (deadlock_timeout 1s: the
victim if a cycle ever formed), s2 the application, s3 a gate holding lockstep's compute open. Every test
gets a fresh copy of the example (200 exams).
"""

from __future__ import annotations

import psycopg
import pytest
from isolation import Spec
from util import raises_sqlstate, result

from lockstep.lab.example import JOB, divergence

SESSIONS = {
    "s1": ["set deadlock_timeout = '1s'"],
    "s2": ["set deadlock_timeout = '10s'"],
    "s3": ["set deadlock_timeout = '10s'"],
}
GATE = 4343
# stable: it reads under the snapshot of the statement that calls it, taken before the gate is passed
GATED_COMPUTE = f"""
create function example.gated(ids bigint[]) returns table (exam_id bigint, key text, weight integer)
language plpgsql stable as $$
begin
    perform pg_advisory_xact_lock_shared({GATE});   -- held open by s3 when a schedule needs it
    return query select * from example.exam_key_compute(ids);
end $$;
select lockstep.define_derived('{JOB}', 'example.exam_key', 'example.gated(bigint[])', 'example.exam');
"""
STATUS_SQL = f"select recompute_done, recompute_total from lockstep.status where job = '{JOB}'"


def _rewrite(ex: psycopg.Connection, ids: list[int], tag: str = "new") -> None:
    """New bodies for these exams (keys vanish and appear), then an empty queue: only a recompute sees them"""
    ex.execute(
        "update example.exam set body = example.words(8, 5000 + id) || %s where id = any(%s)",
        [f" {tag}", ids],
    )
    ex.execute("delete from lockstep.queue")


def _queued(ex: psycopg.Connection) -> list[int]:
    return [r[0] for r in ex.execute("select distinct key::bigint from lockstep.queue order by 1")]


def _wrong_parents(ex: psycopg.Connection) -> list[int]:
    """Exams whose derived rows differ from what compute returns."""
    return [
        r[0]
        for r in ex.execute(
            "select distinct exam_id from ("
            " (select * from example.exam_key_compute(null) except select * from example.exam_key)"
            " union all"
            " (select * from example.exam_key except select * from example.exam_key_compute(null))) d"
            " order by 1"
        )
    ]


def _drain(ex: psycopg.Connection, limit: int = 200) -> int:
    """lockstep.run() until it reports nothing more (bounded); returns how many passes did work."""
    passes = 0
    for _ in range(limit):
        r = result(ex, f"lockstep.run('{JOB}')")
        assert r["outcome"] in ("done", "idle"), r
        if r["outcome"] == "idle":
            return passes
        passes += 1
    raise AssertionError(f"not converged after {limit} runs")


def _deadlocks(ex: psycopg.Connection) -> int:
    ex.execute("select pg_stat_force_next_flush()")
    ex.execute("select pg_stat_clear_snapshot()")
    return ex.execute("select deadlocks from pg_stat_database where datname = current_database()").fetchone()[
        0
    ]


@pytest.fixture
def spec(ex: psycopg.Connection, example_dsn: str) -> Spec:
    s = Spec(example_dsn, sessions=SESSIONS)
    s.step("s1begin", "s1", "begin;")
    s.step("s1c", "s1", "commit;")
    s.step("s1recompute", "s1", f"select outcome, skipped, more from lockstep.recompute('{JOB}');")
    s.step("s1run", "s1", f"select action, outcome, inserted > 0 as wrote from lockstep.run('{JOB}');")
    s.step("s2begin", "s2", "begin;")
    s.step("s2c", "s2", "commit;")
    return s


# -- the application does not wait for a batch it is not in -----------------------------------------------


def test_the_hand_off_is_counted_before_the_batch_is_locked(spec, ex):
    """A hand-off's bookkeeping reads the queue and key_failure over the whole hand-off (how many parents
    are left to do). It ran after the write, with the batch's row locks held: ~1 ms per 1,000 parents handed
    off, 582 ms at 600,000, while an application's DELETE of a parent of the batch waited.
    It now runs before the first row lock. Shown by an admin's lock on lockstep.key_failure (s3), which
    holds the recompute where it first reads the table: now before the write, so the application's
    DELETE of exam 3 (batch 1) does not wait; before, after it, so the DELETE waited for the recompute."""
    ex.execute(f"select lockstep.set_batch_parents('{JOB}', 2)")
    _rewrite(ex, [3, 5, 7, 9, 11])
    spec.step("s3begin", "s3", "begin;")
    spec.step("s3lock", "s3", "lock table lockstep.key_failure in access exclusive mode;")
    spec.step("s3c", "s3", "commit;")
    spec.step("s2del3", "s2", "delete from example.exam where id = 3;")
    r = spec.run(["s3begin", "s3lock", "s1begin", "s1recompute", "s2begin", "s2del3", "s3c", "s1c", "s2c"])
    assert r.waited("s1recompute") and r.blocked_by("s1recompute") == ["s3"], r.trace
    assert not r.waited("s2del3") and r.error("s2del3") is None, r.trace  # before: blocked by s1
    # exam 3 (the app's open DELETE holds it) skipped and re-queued; exam 5 written; 7, 9, 11 handed off
    assert r.rows("s1recompute") == [("done", 1, True)], r.trace
    assert ex.execute(STATUS_SQL).fetchone() == (1, 5), r.trace
    _drain(ex)
    assert divergence(ex) == (0, 0)


def test_app_deletes_a_parent_of_the_next_batch_while_a_batch_is_written_without_waiting(
    spec, ex, expected_trace
):
    ex.execute(f"select lockstep.set_batch_parents('{JOB}', 2)")
    _rewrite(ex, [3, 5, 7, 9, 11])
    spec.step("s2del7", "s2", "delete from example.exam where id = 7;")
    spec.step("s2del11", "s2", "delete from example.exam where id = 11;")
    spec.step("s2del3", "s2", "delete from example.exam where id = 3;")
    deadlocks = _deadlocks(ex)
    # property: batch 1 = exams 3 and 5 (parent-key order), written and held until s1 commits; the app
    # deletes exam 7, of batch 2, meanwhile and does not wait (today: the one transaction holds all five).
    r1 = r = spec.run(["s1begin", "s1recompute", "s2begin", "s2del7", "s2c", "s1c"])
    assert r.rows("s1recompute") == [("done", 0, True)], r.trace
    assert not r.waited("s2del7") and not r.waited("s2c"), r.trace
    assert ex.execute(STATUS_SQL).fetchone() == (2, 5)
    assert _queued(ex) == [7, 9, 11]  # the hand-off, and the app's own enqueue of 7
    # property: the same for batch k+1 while batch k is a worker pass (exams 7 and 9; 11 is the next one)
    r2 = r = spec.run(["s1begin", "s1run", "s2begin", "s2del11", "s2c", "s1c"])
    assert r.rows("s1run") == [("work", "done", True)], r.trace
    assert not r.waited("s2del11") and not r.waited("s2c"), r.trace
    assert ex.execute(STATUS_SQL).fetchone() == (4, 5)
    # contrast: a parent of the batch being written is waited for, for that one short transaction only
    _rewrite(ex, [3, 13, 15], "again")
    r = spec.run(["s1begin", "s1recompute", "s2begin", "s2del3", "s1c", "s2c"])
    assert r.waited("s2del3") and r.blocked_by("s2del3") == ["s1"] and r.error("s2del3") is None, r.trace
    expected_trace(r1, r2, r)
    _drain(ex)
    assert ex.execute(STATUS_SQL).fetchone() == (None, None)
    assert divergence(ex) == (0, 0)
    assert _deadlocks(ex) == deadlocks


def test_batches_are_bounded_and_the_recompute_converges_through_the_queue(ex):
    ex.execute(f"select lockstep.set_batch_parents('{JOB}', 30)")
    _rewrite(ex, list(range(1, 201)))
    r = result(ex, f"lockstep.recompute('{JOB}')")
    assert (r["outcome"], r["more"]) == ("done", True)
    # the first 30 parents in key order are written, no other one
    written = _wrong_parents(ex)
    assert written == list(range(31, 201))  # the parents not yet right
    assert _queued(ex) == list(range(31, 201))
    assert ex.execute(STATUS_SQL).fetchone() == (30, 200)
    # rule 7 and no re-run: the recompute is not due again, the next runs are worker passes of <= 30 parents
    r = result(ex, f"lockstep.run('{JOB}')")
    assert (r["action"], r["outcome"]) == ("work", "done")
    assert ex.execute(STATUS_SQL).fetchone() == (60, 200)
    assert _drain(ex) == 5
    assert divergence(ex) == (0, 0) and _queued(ex) == []
    assert ex.execute(STATUS_SQL).fetchone() == (None, None)


def test_a_due_recompute_is_not_starved_by_its_own_hand_off(ex):
    ex.execute(f"select lockstep.set_batch_parents('{JOB}', 50)")
    _rewrite(ex, list(range(1, 201)))
    assert result(ex, f"lockstep.recompute('{JOB}')")["more"] is True
    ex.execute(f"update lockstep.job_state set next_run_at = now() where job = '{JOB}'")
    # rule 7: the recompute is due: work() gives way, run() runs the recompute (not a worker pass)
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "busy"
    r = result(ex, f"lockstep.run('{JOB}')")
    assert (r["action"], r["outcome"], r["more"]) == ("recompute", "done", True)
    # a new recompute: its difference is the 150 parents not yet written; it writes 50, hands off 100.
    # Its progress carries the first hand-off on: its 50 written parents done, the 150 parents still queued
    # to do (the first one's entries for 51-200, its own for 101-200: each parent once).
    assert ex.execute(STATUS_SQL).fetchone() == (50, 200)
    # and it queued none of them again: each is still queued once (before: 250 entries, 100 duplicates)
    assert ex.execute("select count(*), count(distinct key) from lockstep.queue").fetchone() == (150, 150)
    # and it is not due again: no re-run loop; the worker finishes, and each pass shows in the progress
    # (before, the passes over the first hand-off's entries left it at 50 / 150)
    r = result(ex, f"lockstep.run('{JOB}')")
    assert r["action"] == "work"
    assert ex.execute(STATUS_SQL).fetchone() == (100, 200)
    _drain(ex)
    assert divergence(ex) == (0, 0)


def test_a_recompute_due_during_a_hand_off_carries_its_progress_on(ex):
    # a recompute that came due when the worker had done half of a hand-off started its progress over:
    # 50 / 150 where the first had shown 100 / 200
    ex.execute(f"select lockstep.set_batch_parents('{JOB}', 50)")
    _rewrite(ex, list(range(1, 201)))
    assert result(ex, f"lockstep.recompute('{JOB}')")["more"] is True
    assert ex.execute(STATUS_SQL).fetchone() == (50, 200)
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "done"  # parents 51-100
    assert ex.execute(STATUS_SQL).fetchone() == (100, 200)
    # the second recompute: its difference is parents 101-200, all still queued; it writes 101-150
    r = result(ex, f"lockstep.recompute('{JOB}')")
    assert (r["outcome"], r["more"]) == ("done", True)
    assert ex.execute(STATUS_SQL).fetchone() == (100, 200)  # 101-150 stay "to do" until their entries go
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "done"  # entries of 101-150: nothing to write
    assert ex.execute(STATUS_SQL).fetchone() == (150, 200)
    _drain(ex)
    assert ex.execute(STATUS_SQL).fetchone() == (None, None)
    assert divergence(ex) == (0, 0)


def test_the_progress_counts_the_changed_parents_the_application_had_queued_already(ex):
    """200 parents changed, 150 of them queued already by the application: the hand-off queued only the
    other 40, and the progress counted those, 10 / 50, unmoving while the worker took the older entries
    first. It counts from the first entry of a changed parent."""
    ex.execute(f"select lockstep.set_batch_parents('{JOB}', 10)")
    _rewrite(ex, list(range(1, 201)))
    ex.execute("select lockstep.enqueue(%s, %s::bigint[])", [JOB, list(range(51, 201))])  # the app's
    r = result(ex, f"lockstep.recompute('{JOB}')")
    assert (r["outcome"], r["more"]) == ("done", True)
    assert ex.execute(STATUS_SQL).fetchone() == (10, 200)
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "done"  # the oldest 10 entries: 51-60
    assert ex.execute(STATUS_SQL).fetchone() == (20, 200)
    _drain(ex)
    assert ex.execute(STATUS_SQL).fetchone() == (None, None)
    assert divergence(ex) == (0, 0)


# -- no lost update, skipped parents retried -----------------------------------------------------------------


def test_app_change_after_the_snapshot_is_queued_again_and_converges(spec, ex, expected_trace):
    ex.execute(GATED_COMPUTE)
    ex.execute(f"select lockstep.set_batch_parents('{JOB}', 2)")
    _rewrite(ex, [3, 5, 7, 9])
    spec.step("s3hold", "s3", f"select pg_advisory_lock({GATE});", show_rows=False)
    spec.step("s3release", "s3", f"select pg_advisory_unlock({GATE});", show_rows=False)
    spec.step("s2edit", "s2", "update example.exam set body = body || ' lateword' where id in (3, 9);")
    # property: the recompute's snapshot is taken, then held at the gate; the app edits exam 3 (batch 1,
    # written from the older snapshot) and exam 9 (a later batch) and commits without waiting.
    r = spec.run(["s3hold", "s1begin", "s1recompute", "s2begin", "s2edit", "s2c", "s3release", "s1c"])
    assert r.waited("s1recompute") and r.blocked_by("s1recompute") == ["s3"], r.trace
    assert not r.waited("s2edit") and not r.waited("s2c")
    assert r.rows("s1recompute") == [("done", 0, True)], r.trace
    expected_trace(r)
    # exam 3 got older rows, but it is queued again (the app's trigger), so it is not lost
    assert (
        ex.execute("select count(*) from example.exam_key where exam_id = 3 and key = 'lateword'").fetchone()[
            0
        ]
        == 0
    )
    assert 3 in _queued(ex)
    _drain(ex)
    assert (
        ex.execute(
            "select count(*) from example.exam_key where exam_id in (3, 9) and key = 'lateword'"
        ).fetchone()[0]
        == 2
    )
    assert divergence(ex) == (0, 0)


def test_a_skipped_parent_of_a_batch_is_retried(spec, ex, expected_trace):
    ex.execute(f"select lockstep.set_batch_parents('{JOB}', 2)")
    _rewrite(ex, [3, 5, 7])
    spec.step("s2hold3", "s2", "select id from example.exam where id = 3 for update;", show_rows=False)
    spec.step("s2rollback", "s2", "rollback;")
    # property: the app holds exam 3 (of batch 1); lockstep skips it without waiting, queues it with the rest
    r = spec.run(["s2begin", "s2hold3", "s1begin", "s1recompute", "s1c", "s2rollback"])
    assert not r.waited("s1recompute") and r.rows("s1recompute") == [("done", 1, True)], r.trace
    expected_trace(r)
    assert _queued(ex) == [3, 7]
    ex.execute("update lockstep.queue set ready_at = now()")  # a skipped key waits a second: not here
    _drain(ex)
    assert divergence(ex) == (0, 0)


# -- poison parents ------------------------------------------------------------------------------------------

PICKY = """
create function example.picky(ids bigint[]) returns table (exam_id bigint, key text, weight integer)
language plpgsql stable as $$ begin
    if (select body like '%poisonword%' from example.exam where id = 13)
       and (ids is null or 13 = any(ids)) then
        raise exception 'cannot compute exam 13';
    end if;
    return query select * from example.exam_key_compute(ids); end $$;
"""


DEFINE_PICKY = (
    f"select lockstep.define_derived('{JOB}', 'example.exam_key', 'example.picky(bigint[])', 'example.exam',"
    " every => '1 day')"
)


def test_a_carried_hand_off_never_counts_more_parents_than_there_are(ex):
    # adding the earlier hand-off's done parents to the new recompute's count counted a parent changed
    # again twice, after a recompute that handed every parent off: done never exceeds total
    ex.execute(PICKY)
    ex.execute(DEFINE_PICKY)
    ex.execute(f"select lockstep.set_batch_parents('{JOB}', 50)")
    _rewrite(ex, list(range(51, 201)))
    assert result(ex, f"lockstep.recompute('{JOB}')")["more"] is True
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "done"
    assert ex.execute(STATUS_SQL).fetchone() == (100, 150)
    ex.execute("update example.exam set body = body || ' poisonword' where id = 13")
    ex.execute("delete from lockstep.queue where key = '13'")
    r = result(ex, f"lockstep.recompute('{JOB}')")  # compute(NULL) fails: every parent is handed off
    assert (r["outcome"], r["more"]) == ("done", True), r
    done, total = ex.execute(STATUS_SQL).fetchone()
    parents = ex.execute("select count(*) from example.exam").fetchone()[0]
    assert 0 <= done <= total <= parents, (done, total, parents)


def test_a_poison_parent_in_a_recompute_is_parked_while_the_rest_is_written(ex):
    ex.execute(PICKY)
    ex.execute(DEFINE_PICKY)
    ex.execute(f"select lockstep.set_max_attempts('{JOB}', 2)")
    _rewrite(ex, list(range(10, 17)))
    ex.execute("update example.exam set body = body || ' poisonword' where id = 13")
    ex.execute("delete from lockstep.queue")
    r = result(ex, f"lockstep.recompute('{JOB}')")
    # today: the whole recompute fails and backs off an hour; now the parents go to the worker's bisection
    assert (r["outcome"], r["more"]) == ("done", True), r
    assert "cannot compute exam 13" in r["error"] and "handed to the worker" in r["error"]
    # the history says why too: run_log.error was NULL for this run
    logged = ex.execute(
        f"select outcome, error from lockstep.run_log where job = '{JOB}' and action = 'recompute'"
        " order by id desc limit 1"
    ).fetchone()
    assert logged == ("done", r["error"])
    assert ex.execute(STATUS_SQL).fetchone() == (0, 200)
    _drain(ex)
    st = ex.execute(
        f"select failing_keys, parked_keys, last_outcome, next_run_at > now() + interval '23 hours'"
        f" from lockstep.status where job = '{JOB}'"
    ).fetchone()
    assert st == (1, 0, "done", True)  # no backoff: on its normal schedule
    ex.execute("update lockstep.key_failure set retry_at = now()")
    _drain(ex)
    assert ex.execute("select key, attempts from lockstep.parked_keys").fetchall() == [("13", 2)]
    assert ex.execute(STATUS_SQL).fetchone() == (None, None)  # the parked key is not "to do"
    # everything else is written: only exam 13's rows differ
    assert (
        ex.execute(
            "select count(*) from (select * from example.exam_key_compute(null) where exam_id <> 13"
            " except select * from example.exam_key where exam_id <> 13) s"
        ).fetchone()[0]
        == 0
    )
    ex.execute("update example.exam set body = replace(body, 'poisonword', 'fixedword') where id = 13")
    assert ex.execute(f"select lockstep.retry('{JOB}', array[13])").fetchone()[0] == 1
    _drain(ex)
    assert divergence(ex) == (0, 0)


DOUBLED = """
create function example.doubled(ids bigint[]) returns table (exam_id bigint, key text, weight integer)
language sql stable as $$
    select * from example.exam_key_compute(ids)
    union all  -- exam 13's first key twice: a duplicate primary key (LSD05) for that parent only
    (select * from example.exam_key_compute(array[13]::bigint[]) where ids is null or 13 = any(ids)
     order by key limit 1) $$;
"""


def test_a_parent_computed_with_a_duplicate_key_in_a_recompute_is_isolated(ex):
    # LSD05 (compute returned a primary key twice) is a fault of one parent's rows, as the worker treats it:
    # the recompute failed as a whole and backed off for an hour, writing no other parent. Now its parents
    # go to the worker's bisection like any poison parent's.
    ex.execute(DOUBLED)
    ex.execute(
        f"select lockstep.define_derived('{JOB}', 'example.exam_key', 'example.doubled(bigint[])',"
        " 'example.exam', every => '1 day')"
    )
    _rewrite(ex, list(range(10, 17)))
    ex.execute("delete from lockstep.queue")
    r = result(ex, f"lockstep.recompute('{JOB}')")
    assert (r["outcome"], r["more"]) == ("done", True), r
    assert "more than one row for primary key" in r["error"] and "handed to the worker" in r["error"]
    _drain(ex)
    st = ex.execute(f"select failing_keys, last_outcome from lockstep.status where job = '{JOB}'").fetchone()
    assert st == (1, "done")
    assert ex.execute("select key from lockstep.failing_keys").fetchall() == [("13",)]
    assert (
        ex.execute(
            "select count(*) from (select * from example.exam_key_compute(null) where exam_id <> 13"
            " except select * from example.exam_key where exam_id <> 13) s"
        ).fetchone()[0]
        == 0
    )


def test_retry_ends_the_failure_backoff_of_the_recompute(ex):
    ex.execute(PICKY)
    ex.execute(DEFINE_PICKY)
    ex.execute("create table example.broken (on_ boolean)")
    ex.execute("insert into example.broken values (true)")
    ex.execute(
        "create or replace function example.picky(ids bigint[]) returns table (exam_id bigint, key text,"
        " weight integer) language plpgsql stable as $$ begin"
        " if (select on_ from example.broken) then raise exception 'broken for every key'; end if;"
        " return query select * from example.exam_key_compute(ids); end $$"
    )
    _rewrite(ex, [3])
    r = result(ex, f"lockstep.recompute('{JOB}')")
    # raised before any row is computed (an empty pass fails too): the job's error, with its backoff
    assert (r["outcome"], r["error"]) == ("failed", "broken for every key")
    assert result(ex, f"lockstep.run('{JOB}')")["outcome"] == "backoff"
    ex.execute("update example.broken set on_ = false")
    assert ex.execute(f"select lockstep.retry('{JOB}')").fetchone()[0] == 0
    # the backoff is over: the recompute runs at once
    r = result(ex, f"lockstep.run('{JOB}')")
    assert (r["action"], r["outcome"]) == ("recompute", "done"), r
    assert divergence(ex) == (0, 0)
    # a job on its normal schedule is not moved by retry
    ex.execute(f"select lockstep.retry('{JOB}')")
    assert ex.execute(
        f"select next_run_at > now() + interval '23 hours' from lockstep.job_state where job = '{JOB}'"
    ).fetchone()[0]


def test_set_batch_parents_checks_its_arguments(ex, conn):
    with raises_sqlstate("22023", "between 1 and 1000000"):
        ex.execute(f"select lockstep.set_batch_parents('{JOB}', 0)")
    with raises_sqlstate("22023", "between 1 and 1000000"):
        ex.execute(f"select lockstep.set_batch_parents('{JOB}', 1000001)")
    with raises_sqlstate("22004", "between 1 and 1000000"):  # a NULL argument: 22004, as everywhere
        ex.execute(f"select lockstep.set_batch_parents('{JOB}', null)")
    with raises_sqlstate("LSJ01"):
        ex.execute("select lockstep.set_batch_parents('nope', 10)")
    assert ex.execute(f"select batch_parents from lockstep.job where job = '{JOB}'").fetchone()[0] == 500


# -- a job without a parent: batches of rows, the rest in the session that wrote the first -------------------

PARENTLESS = """
create schema lb;
create table lb.src (id int primary key, bucket int not null, n int not null);
create table lb.total (bucket int primary key, total bigint not null);
create table lb.note (id int generated always as identity primary key,
                      bucket int not null references lb.total on delete cascade);
create function lb.totals(ignored int[]) returns table (bucket int, total bigint) language sql stable
    as $$ select bucket, sum(n) from lb.src group by bucket $$;
insert into lb.src select g, g % 9 + 1, g from generate_series(1, 90) g;
select lockstep.define_derived('lb', 'lb.total', 'lb.totals(int[])', every => '1 day');
select lockstep.recompute('lb');
select lockstep.set_batch_parents('lb', 3);
"""
LB_STATUS = "select recompute_done, recompute_total from lockstep.status where job = 'lb'"
LB_DIVERGENCE = (
    "select count(*) from ((select * from lb.total except all select * from lb.totals(null))"
    " union all (select * from lb.totals(null) except all select * from lb.total)) s"
)


def test_a_recompute_without_a_parent_writes_bounded_batches_of_rows(conn, dsn, expected_trace):
    # A job without a parent has no queue to hand its rest to: its recompute wrote the whole difference in
    # one transaction, holding every row it changed (an application inserting a note for any bucket waited
    # for all of it). Now batch_parents rows per transaction, in primary-key order; the rest waits in the
    # session that wrote the first batch, and its next run() calls write it.
    conn.execute(PARENTLESS)
    conn.execute("update lb.src set n = n + 1")  # every bucket changes: 9 rows, batches of 3
    spec = Spec(dsn, sessions=SESSIONS)
    for s in SESSIONS:
        spec.step(f"{s}begin", s, "begin;")
        spec.step(f"{s}c", s, "commit;")
    spec.step("s1recompute", "s1", "select updated, more from lockstep.recompute('lb');")
    spec.step("s1run", "s1", "select action, outcome, updated, more from lockstep.run('lb');")
    spec.step("s1again", "s1", "select action, outcome, updated, more from lockstep.run('lb');")
    spec.step("s2note5", "s2", "insert into lb.note (bucket) values (5);")
    spec.step("s2note8", "s2", "insert into lb.note (bucket) values (8);")
    spec.step("s2note9", "s2", "insert into lb.note (bucket) values (9);")
    spec.step("s2lock7", "s2", "select bucket from lb.total where bucket = 7 for update;")
    for n in (1, 2, 3):
        spec.step(f"s3status{n}", "s3", LB_STATUS + ";")
    spec.step("s3run", "s3", "select outcome from lockstep.run('lb');")
    deadlocks = _deadlocks(conn)
    r = spec.run(
        # batch 1 = buckets 1-3; the app's foreign-key check on bucket 5 (batch 2) does not wait
        ["s1begin", "s1recompute", "s2begin", "s2note5", "s2c", "s1c", "s3status1"]
        # batch 2 (buckets 4-6) from the same session; bucket 8 (batch 3) does not wait
        + ["s1begin", "s1run", "s2begin", "s2note8", "s2c", "s1c", "s3status2"]
        # another session leaves the rest to the live session that holds it
        + ["s3run"]
        # a row of the batch being written: a foreign-key check of it does not wait either (lockstep
        # holds FOR NO KEY UPDATE on a row it updates in place); a FOR UPDATE of it waits for that one
        # short transaction only
        + ["s1begin", "s1again", "s2begin", "s2note9", "s2lock7", "s1c", "s2c", "s3status3"]
    )
    assert r.rows("s1recompute") == [(3, True)], r.trace
    assert not r.waited("s2note5") and r.rows("s3status1") == [(3, 9)], r.trace
    assert r.rows("s1run") == [("recompute", "done", 3, True)], r.trace
    assert not r.waited("s2note8") and r.rows("s3status2") == [(6, 9)], r.trace
    assert r.rows("s3run") == [("busy",)], r.trace
    assert r.rows("s1again") == [("recompute", "done", 3, False)], r.trace
    assert not r.waited("s2note9"), r.trace
    assert r.waited("s2lock7") and r.blocked_by("s2lock7") == ["s1"] and r.error("s2lock7") is None, r.trace
    assert r.rows("s3status3") == [(None, None)], r.trace
    assert conn.execute(LB_DIVERGENCE).fetchone()[0] == 0
    expected_trace(r)
    assert _deadlocks(conn) == deadlocks


def test_the_rest_of_a_recompute_without_a_parent_survives_its_session(conn, connect):
    # the session holding the rest ends (a runner killed between batches): nothing is lost, the next run
    # recomputes and goes on in its own session
    conn.execute(PARENTLESS)
    conn.execute("update lb.src set n = n + 1")
    runner = connect()
    assert result(runner, "lockstep.recompute('lb')")["more"] is True
    assert result(conn, "lockstep.run('lb')")["outcome"] == "busy"  # the holder is alive
    conn.execute("select pg_terminate_backend(%s, 10000)", [runner.info.backend_pid])  # waits for its exit
    conn.execute("select pg_stat_clear_snapshot()")
    r = result(conn, "lockstep.run('lb')")
    assert (r["action"], r["outcome"], r["updated"], r["more"]) == ("recompute", "done", 3, True), r
    assert conn.execute(LB_STATUS).fetchone() == (3, 6)  # buckets 4-9 left: the first 3 were written
    due = conn.execute("select due_at <= now() from lockstep.due(array['lb'])").fetchone()[0]
    assert due  # the runner's one query says: now
    for _ in range(5):
        if not result(conn, "lockstep.run('lb')")["more"]:
            break
    assert conn.execute(LB_STATUS).fetchone() == (None, None)
    assert conn.execute(LB_DIVERGENCE).fetchone()[0] == 0
    assert result(conn, "lockstep.run('lb')")["outcome"] == "not_due"


def test_the_rest_of_a_recompute_without_a_parent_lost_to_discard_temp_is_recomputed(conn):
    # a pooler's server_reset_query (DISCARD ALL / DISCARD TEMP) drops the session's rest table between
    # two calls of the same session: the next run recomputes instead of writing a rest it no longer has
    conn.execute(PARENTLESS)
    conn.execute("update lb.src set n = n + 1")
    assert result(conn, "lockstep.recompute('lb')")["more"] is True
    conn.execute("discard temp")
    r = result(conn, "lockstep.run('lb')")
    assert (r["action"], r["outcome"], r["updated"], r["more"]) == ("recompute", "done", 3, True), r
    assert conn.execute(LB_STATUS).fetchone() == (3, 6)
    for _ in range(5):
        if not result(conn, "lockstep.run('lb')")["more"]:
            break
    assert conn.execute(LB_STATUS).fetchone() == (None, None)
    assert conn.execute(LB_DIVERGENCE).fetchone()[0] == 0
