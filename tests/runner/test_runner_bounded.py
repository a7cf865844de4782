"""Recompute in bounded batches with a real runner process: kill -9 between batches, then one
``lockstep run --once`` converges. The first batch commits together with its hand-off to the queue, so the
parents not yet written survive the runner; the batch in flight rolls back.
"""

from __future__ import annotations

import signal
from pathlib import Path

import psycopg
from isolation import wait_for_lock_wait
from runner_procs import Runner, runner_backends, wait_for

from lockstep.lab.example import JOB, divergence

STATUS_SQL = f"select recompute_done, recompute_total from lockstep.status where job = '{JOB}'"


def _rewrite(ex: psycopg.Connection, ids: list[int]) -> None:
    """New bodies for these exams, then an empty queue: only a recompute sees them"""
    ex.execute(
        "update example.exam set body = example.words(8, 5000 + id) || ' new' where id = any(%s)", [ids]
    )
    ex.execute("delete from lockstep.queue")


def _queued(ex: psycopg.Connection) -> list[int]:
    return [r[0] for r in ex.execute("select distinct key::bigint from lockstep.queue order by 1")]


# -- kill -9 between batches (a real runner process) -------------------------------------------------------

KILL_GATE = 747474
# the first INSERT into the target (the recompute's batch) passes; later ones wait for the test's lock
GATE_AFTER_FIRST_SQL = f"""
create sequence example.target_inserts;
create function example.gate_after_first() returns trigger language plpgsql as $$
begin
    if nextval('example.target_inserts') > 1 then
        perform pg_catalog.pg_advisory_xact_lock_shared({KILL_GATE});
    end if;
    return null;
end $$;
create trigger gate_after_first after insert on example.exam_key
    for each statement execute function example.gate_after_first();
"""


def test_kill_9_between_batches_then_one_run_converges(ex, connect, example_dsn, tmp_path: Path):
    ex.execute(f"select lockstep.set_batch_parents('{JOB}', 20)")
    _rewrite(ex, list(range(1, 101)))
    ex.execute(GATE_AFTER_FIRST_SQL)
    holder = connect(example_dsn)
    holder.execute("select pg_advisory_lock(%s)", [KILL_GATE])
    ex.execute(f"update lockstep.job_state set next_run_at = now() where job = '{JOB}'")
    r = Runner(example_dsn, ["--tick", "0.2", "--log-format", "json"], tmp_path / "killed.log")
    try:
        pid = wait_for(lambda: runner_backends(ex), what="runner backend")[0]
        # today: the recompute writes all 100 parents in one transaction and nothing waits at the gate
        lw = wait_for_lock_wait(ex, pid=pid, abort_if=lambda: r.proc.poll() is not None, timeout=20)
        assert holder.info.backend_pid in lw.blockers
    finally:
        r.proc.send_signal(signal.SIGKILL)
        r.wait(10)
    # batch 1 is committed with its hand-off; batch 2 (a worker pass) dies with the runner's backend
    ex.execute("select pg_terminate_backend(%s)", [pid])
    wait_for(
        lambda: not ex.execute("select 1 from pg_stat_activity where pid = %s", [pid]).fetchone(),
        what="backend gone",
    )
    holder.execute("select pg_advisory_unlock(%s)", [KILL_GATE])
    assert ex.execute(STATUS_SQL).fetchone() == (20, 100)
    assert _queued(ex) == list(range(21, 101))
    one = Runner(example_dsn, ["--once", "--log-format", "json"], tmp_path / "after.log")
    assert one.wait(60) == 0, one.stderr
    assert [x["action"] for x in one.json_lines() if "outcome" in x] == ["work"] * 4
    assert _queued(ex) == [] and divergence(ex) == (0, 0)
    assert ex.execute(STATUS_SQL).fetchone() == (None, None)
