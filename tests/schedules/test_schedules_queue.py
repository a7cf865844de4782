"""Enqueue against workers, as isolation schedules (docs/design.md rules 4-5).

s1 is the worker (deadlock_timeout 1s: the victim when a cycle forms; long enough that the harness always
sees its wait before the deadlock check ends it), s2 and s3 are application sessions pushing keys (10s), s4
a gate holding the worker's compute phase open. Each schedule's whole trace is compared with
tests/expected/schedules_queue/<test>.out (``expected_trace``; rewrite with --update-expected).
"""

from __future__ import annotations

import psycopg
import pytest
from isolation import Spec
from util import drain, not_due

from lockstep.lab.example import JOB, divergence

SESSIONS = {
    "s1": ["set deadlock_timeout = '1s'"],
    "s2": ["set deadlock_timeout = '10s'"],
    "s3": ["set deadlock_timeout = '10s'"],
    "s4": ["set deadlock_timeout = '10s'"],
}
GATE = 4343


def steps(spec: Spec) -> Spec:
    for s in ("s1", "s2", "s3"):
        spec.step(f"{s}begin", s, "begin;")
        spec.step(f"{s}c", s, "commit;")
    return spec


def test_naive_unique_upsert_queue_deadlocks_with_its_worker(ex, example_dsn, expected_trace):
    """Chancy #89's shape: push_many upserts in caller order, the worker
    updates claimed rows in queue order."""
    ex.execute("create table naive_queue (key bigint primary key, n int not null default 0)")
    ex.execute("insert into naive_queue select g from generate_series(1, 4) g")
    spec = steps(Spec(example_dsn, sessions=SESSIONS))
    spec.step("s1claim1", "s1", "update naive_queue set n = -1 where key = 1;")
    spec.step("s1claim2", "s1", "update naive_queue set n = -1 where key = 2;")
    spec.step(
        "s2push2",
        "s2",
        "insert into naive_queue values (2) on conflict (key) do update set n = naive_queue.n + 1;",
    )
    spec.step(
        "s2push1",
        "s2",
        "insert into naive_queue values (1) on conflict (key) do update set n = naive_queue.n + 1;",
    )
    # property: the pusher holds key 2 and waits for the worker's key 1; the worker then wants key 2: 40P01
    # (trace: s2push1 <waiting ...>, s1claim2 ERROR 40P01, then s2push1 completes)
    r = spec.run(["s1begin", "s1claim1", "s2begin", "s2push2", "s2push1", "s1claim2", "s1c", "s2c"])
    expected_trace(r)
    assert r.blocked_by("s2push1") == ["s1"]


def test_lockstep_enqueues_in_opposite_orders_never_wait_for_a_worker(ex, example_dsn, expected_trace):
    ex.execute("update example.exam set body = body || ' chancy' where id between 1 and 6")
    spec = steps(Spec(example_dsn, sessions=SESSIONS))
    spec.step("s1work", "s1", f"select outcome, inserted from lockstep.work('{JOB}');")
    spec.step("s2push", "s2", f"select lockstep.enqueue('{JOB}', array[1, 2, 3, 4]);")
    spec.step("s3push", "s3", f"select lockstep.enqueue('{JOB}', array[4, 3, 2, 1]);")
    spec.step("s2push2", "s2", f"select lockstep.enqueue('{JOB}', array[6, 5]);")
    spec.step("s3push2", "s3", f"select lockstep.enqueue('{JOB}', array[5, 6]);")
    # property: while a worker pass holds its claimed batch (uncommitted), two batch enqueues of
    # overlapping keys in opposite orders run to completion without waiting; nothing deadlocks.
    order = [
        "s1begin",
        "s1work",
        "s2begin",
        "s3begin",
        "s2push",
        "s3push",
        "s2push2",
        "s3push2",
        "s2c",
        "s3c",
        "s1c",
    ]
    # (trace: no step waits, no error, s1work done with 6 inserted)
    r = spec.run(order)
    expected_trace(r)
    drain(ex, JOB)
    assert ex.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
    assert divergence(ex) == (0, 0)


@pytest.mark.parametrize("app_first", [False, True])
def test_app_deleting_a_claimed_parent_does_not_wait_for_the_worker(
    ex, example_dsn, app_first, expected_trace
):
    X = 9
    ex.execute(
        f"""
        create function example.gated(ids bigint[]) returns table (exam_id bigint, key text, weight integer)
        language plpgsql as $$ begin
            perform pg_advisory_xact_lock_shared({GATE});
            return query select * from example.exam_key_compute(ids); end $$;
        select lockstep.define_derived('{JOB}', 'example.exam_key', 'example.gated(bigint[])',
                                       'example.exam');
        update example.exam set body = body || ' claimed' where id in (8, {X}, 10);
        """
    )
    not_due(ex, JOB)
    spec = steps(Spec(example_dsn, sessions=SESSIONS))
    spec.step("s4hold", "s4", f"select pg_advisory_lock({GATE});", show_rows=False)
    spec.step("s4release", "s4", f"select pg_advisory_unlock({GATE});", show_rows=False)
    spec.step("s1work", "s1", f"select outcome from lockstep.work('{JOB}');")
    spec.step("s2del", "s2", f"delete from example.exam where id = {X};")  # its triggers enqueue X again
    # property: the worker has claimed X and is computing; the app deletes X (enqueueing it) and commits
    # without waiting; the worker finds X gone or skips it: no 23503, no 40P01; X ends with no rows.
    if app_first:
        order = ["s2begin", "s2del", "s1begin", "s1work", "s1c", "s2c"]
    else:
        order = ["s4hold", "s1begin", "s1work", "s2begin", "s2del", "s2c", "s4release", "s1c"]
    # (trace: s2del and s2c never wait, no error, s1work done; app_first=False: s1work <waiting ...> at
    # the gate until s4release)
    r = spec.run(order)
    expected_trace(r)
    drain(ex, JOB)
    assert ex.execute(f"select count(*) from example.exam_key where exam_id = {X}").fetchone()[0] == 0
    assert ex.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
    assert divergence(ex) == (0, 0)


def test_enqueue_from_a_trigger_while_a_recompute_writes(ex: psycopg.Connection, example_dsn, expected_trace):
    spec = steps(Spec(example_dsn, sessions=SESSIONS))
    ex.execute("update example.exam set body = 'all new words here' where id between 1 and 50")
    ex.execute("delete from lockstep.queue")
    spec.step("s1recompute", "s1", f"select outcome from lockstep.recompute('{JOB}');")
    spec.step("s2edit", "s2", "update example.exam set body = 'edited again' where id = 20;")
    # property: the recompute holds KEY SHARE on exam 20 and its rows until commit; an app UPDATE of the
    # body (FOR NO KEY UPDATE) and its trigger's enqueue do not conflict with it: no wait.
    # (trace: s2edit and s2c complete at once)
    r = spec.run(["s1begin", "s1recompute", "s2begin", "s2edit", "s2c", "s1c"])
    expected_trace(r)
    drain(ex, JOB)
    assert divergence(ex) == (0, 0)
