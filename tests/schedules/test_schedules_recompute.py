"""Recompute against an application's parent DELETE, as isolation schedules (docs/design.md rules 3-4).

Each test keeps the naive or seed pattern failing (40P01) beside lockstep not failing in the same schedule.
Each schedule's whole trace (every wait, completion, error with its SQLSTATE and the rows shown) is compared
with tests/expected/schedules_recompute/<test>.out (``expected_trace``; rewrite with --update-expected).
Session s1 is the job (deadlock_timeout 1s: the victim when a cycle forms; long enough that the harness
always sees its wait before the deadlock check ends it, so the trace is stable), s2 the application (10s),
s3 a gate that holds lockstep's compute phase open when a test needs to act during it.
X = exam 5: its body is rewritten before each schedule, so some of its derived rows vanish and others
appear, and every method must delete and insert rows of X.
"""

from __future__ import annotations

import psycopg
import pytest
from isolation import Spec
from util import drain

from lockstep.lab.example import JOB, divergence

X = 5
SESSIONS = {
    "s1": ["set deadlock_timeout = '1s'"],
    "s2": ["set deadlock_timeout = '10s'"],
    "s3": ["set deadlock_timeout = '10s'"],
}
GATE = 4242
GATED_COMPUTE = f"""
create function example.gated(ids bigint[]) returns table (exam_id bigint, key text, weight integer)
language plpgsql as $$
begin
    perform pg_advisory_xact_lock_shared({GATE});   -- held open by s3 when a schedule needs it
    return query select * from example.exam_key_compute(ids);
end $$;
select lockstep.define_derived('{JOB}', 'example.exam_key', 'example.gated(bigint[])', 'example.exam');
"""


@pytest.fixture
def spec(ex: psycopg.Connection, example_dsn: str) -> Spec:
    ex.execute(f"update example.exam set body = example.words(8, 999), title = 'brand new' where id = {X}")
    ex.execute("update example.exam set body = body || ' tailword' where id in (3, 7)")
    ex.execute("delete from lockstep.queue")
    s = Spec(example_dsn, sessions=SESSIONS)
    s.step("s1begin", "s1", "begin;")
    s.step("s1c", "s1", "commit;")
    s.step("s2begin", "s2", "begin;")
    s.step("s2del", "s2", f"delete from example.exam where id = {X};")
    s.step("s2c", "s2", "commit;")
    return s


# -- naive: status row, delete all, reinsert ---------------------------------------------------------------


def test_naive_recompute_deadlocks_with_an_app_delete(spec, expected_trace):
    spec.step("s1status", "s1", "select 1 from example.exam_status for update;", show_rows=False)
    spec.step("s1delete", "s1", "delete from example.exam_key;")
    spec.step("s1insert", "s1", "insert into example.exam_key select * from example.exam_key_compute(null);")
    # property: the naive job holds every derived row; the app's cascade waits on them; the job's FK check
    # then waits on the app's parent row: 40P01, the job dies.
    # (trace: s2del <waiting ...>, s1insert ERROR 40P01, s2del completes without error)
    r = spec.run(["s1begin", "s1status", "s1delete", "s2begin", "s2del", "s1insert", "s1c", "s2c"])
    expected_trace(r)
    assert r.blocked_by("s2del") == ["s1"]


# -- seed: advisory lock, temp table, anti-join delete, insert joined to parents FOR KEY SHARE ---------


def test_seed_pattern_deadlocks_between_its_delete_and_insert_phases(spec, expected_trace):
    spec.step("s1compute", "s1", "select example.seed_compute();", show_rows=False)
    spec.step("s1delete", "s1", "select example.seed_delete() > 0 as deleted_some;")
    spec.step("s1insert", "s1", "select example.seed_insert();", show_rows=False)
    # property: the job holds derived rows of X (delete phase) and waits for KEY SHARE on X (insert phase);
    # the app holds X and waits for those rows: 40P01.
    # (trace: s1delete deleted_some t, s2del <waiting ...>, s1insert ERROR 40P01)
    r = spec.run(["s1begin", "s1compute", "s1delete", "s2begin", "s2del", "s1insert", "s1c", "s2c"])
    expected_trace(r)


# -- lockstep in the same places ---------------------------------------------------------------------------


def test_lockstep_skips_a_parent_the_app_is_deleting(spec, ex, expected_trace):
    spec.step("s1recompute", "s1", f"select outcome, skipped from lockstep.recompute('{JOB}');")
    # property: the app deletes X first and keeps its transaction open; lockstep neither waits nor fails:
    # X is skipped (pinned FOR KEY SHARE SKIP LOCKED) and re-queued.
    # (trace: no step waits, no error, s1recompute done with 1 skipped)
    r = spec.run(["s2begin", "s2del", "s1begin", "s1recompute", "s1c", "s2c"])
    expected_trace(r)
    # re-queued by the recompute (and by the app's own delete triggers)
    assert ex.execute("select distinct key from lockstep.queue").fetchall() == [(str(X),)]
    assert ex.execute(f"select outcome from lockstep.work('{JOB}')").fetchone()[0] == "done"
    assert divergence(ex) == (0, 0)


def test_app_delete_waits_only_for_locksteps_write_phase(spec, ex, expected_trace):
    spec.step("s1recompute", "s1", f"select outcome, skipped from lockstep.recompute('{JOB}');")
    # property: lockstep wrote X's rows and holds KEY SHARE on X until commit; the app's delete waits for
    # that commit (the short write phase), then succeeds. No cycle can form: lockstep waits for nothing.
    # (trace: s1recompute done with 0 skipped, s2del <waiting ...> until s1c, then completes, no error)
    r = spec.run(["s1begin", "s1recompute", "s2begin", "s2del", "s1c", "s2c"])
    expected_trace(r)
    assert r.blocked_by("s2del") == ["s1"]
    assert divergence(ex) == (0, 0)


def test_app_delete_never_waits_during_the_compute_phase(spec, ex, expected_trace):
    ex.execute(GATED_COMPUTE)
    spec.step("s3hold", "s3", f"select pg_advisory_lock({GATE});", show_rows=False)
    spec.step("s3release", "s3", f"select pg_advisory_unlock({GATE});", show_rows=False)
    spec.step("s1recompute", "s1", f"select outcome, skipped from lockstep.recompute('{JOB}');")
    spec.step("s2del3", "s2", "delete from example.exam where id = 3;")
    # property: while lockstep computes (held at the gate), the app deletes X and 3 and commits without
    # waiting; lockstep then finds them gone: no 23503, no 40P01.
    r = spec.run(
        ["s3hold", "s1begin", "s1recompute", "s2begin", "s2del", "s2del3", "s2c", "s3release", "s1c"]
    )
    # (trace: s1recompute <waiting ...> at the gate; s2del, s2del3, s2c complete at once; s1recompute
    # completes done after s3release, no error)
    expected_trace(r)
    assert r.blocked_by("s1recompute") == ["s3"]
    assert divergence(ex) == (0, 0)


def test_app_deleting_two_parents_in_descending_order_during_the_write_phase(spec, ex, expected_trace):
    spec.step("s2delhigh", "s2", "delete from example.exam where id = 7;")
    spec.step("s2dellow", "s2", "delete from example.exam where id = 3;")
    spec.step("s1recompute", "s1", f"select outcome, skipped from lockstep.recompute('{JOB}');")
    # property: the app holds 7, lockstep pins 3 (and X) and skips 7; the app then wants 3 and waits for
    # lockstep's commit only; no deadlock whatever the order.
    # (trace: s1recompute does not wait, done with 1 skipped; s2dellow <waiting ...> until s1c, no error)
    r = spec.run(["s2begin", "s2delhigh", "s1begin", "s1recompute", "s2dellow", "s1c", "s2c"])
    expected_trace(r)
    drain(ex, JOB)
    assert divergence(ex) == (0, 0)
