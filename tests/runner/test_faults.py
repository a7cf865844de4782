"""Faults with real runner processes and real PostgreSQL: a compute that times out or raises, a runner killed
(-9) in its write phase, and a PostgreSQL restart in the middle of a storm. After each: nothing partial in
the target, the queue keeps its keys, and the job converges (divergence (0, 0)) once the fault is gone.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from isolation import wait_for_lock_wait
from lab import storm
from runner_procs import Runner, runner_backends, wait_for
from util import advisory_locks, pg_bindir

from lockstep.lab import example

JOB = example.JOB
GATE = 727272  # advisory lock key the write-gate trigger waits for (shared) while the test holds it

FAULTY_COMPUTE_SQL = """
create table example.fault (kind text not null);
insert into example.fault values ('none');
create function example.faulty_compute(ids bigint[])
returns table (exam_id bigint, key text, weight integer)
language plpgsql stable
as $$
declare
    k text := (select f.kind from example.fault f);
begin
    if k = 'sleep' then
        perform pg_catalog.pg_sleep(30);
    elsif k = 'raise' then
        raise exception 'injected compute fault';
    end if;
    return query select * from example.exam_key_compute(ids);
end;
$$;
"""
DEFINE_SQL = (
    "select lockstep.define_derived('exam_keys', 'example.exam_key', %s::regprocedure,"
    " parent => 'example.exam', parent_column => 'exam_id', every => %s::interval, backoff => '1 hour')"
)
WRITE_GATE_SQL = f"""
create function example.write_gate() returns trigger
language plpgsql
as $$
begin
    perform pg_catalog.pg_advisory_xact_lock_shared({GATE});
    return null;
end;
$$;
create trigger write_gate after insert on example.exam_key
    for each statement execute function example.write_gate();
"""


def _target(conn: psycopg.Connection) -> list[tuple]:
    return conn.execute("select exam_id, key, weight from example.exam_key order by 1, 2").fetchall()


def _queue(conn: psycopg.Connection) -> list[tuple]:
    return conn.execute("select id, key from lockstep.queue where job = %s order by id", [JOB]).fetchall()


def _status(conn: psycopg.Connection) -> dict:
    cur = conn.execute("select * from lockstep.status where job = %s", [JOB])
    return dict(zip([d.name for d in cur.description], cur.fetchone(), strict=True))


def _run_once(dsn: str, tmp_path: Path, name: str, env: dict | None = None) -> tuple[int, list[dict]]:
    r = Runner(dsn, ["--once", "--log-format", "json"], tmp_path / f"{name}.log", env=env)
    code = r.wait(60)
    return code, r.json_lines()


def _change_exams(conn: psycopg.Connection, ids: list[int]) -> None:
    """An application edit: new bodies (new keys for the target), enqueued by the watch trigger."""
    conn.execute("update example.exam set body = example.words(8, 777000 + id) where id = any(%s)", [ids])


# compute fails: statement_timeout, exception -------------------------------------------------------------


@pytest.mark.parametrize("fault", ["statement_timeout", "exception"])
def test_failing_compute_writes_nothing_keeps_queue_backs_off(ex, example_dsn, tmp_path, fault):
    """The recompute is due and keys are queued: one ``run --once`` tries both, and both fail."""
    ex.execute(FAULTY_COMPUTE_SQL)
    ex.execute(DEFINE_SQL, ["example.faulty_compute(bigint[])", "1 second"])
    assert ex.execute("select outcome from lockstep.recompute(%s)", [JOB]).fetchone()[0] == "done"
    _change_exams(ex, list(range(1, 21)))
    ex.execute("delete from example.exam where id in (41, 42)")
    wait_for(
        lambda: ex.execute(
            "select next_run_at <= now() from lockstep.job_state where job = %s", [JOB]
        ).fetchone()[0],
        what="recompute due",
    )
    before_target, before_queue = _target(ex), _queue(ex)
    assert len({k for _, k in before_queue}) == 22

    env = None
    if fault == "statement_timeout":
        ex.execute("update example.fault set kind = 'sleep'")
        env = {"PGOPTIONS": "-c statement_timeout=700"}
    else:
        ex.execute("update example.fault set kind = 'raise'")
    code, lines = _run_once(example_dsn, tmp_path, "faulty", env)

    runs = [x for x in lines if "outcome" in x]
    assert code == 1, lines
    # the worker may be due again before --once looks for the last time (retry after 2 s): more failures
    first = [(x["action"], x["outcome"]) for x in runs[:2]]
    assert first == [("recompute", "failed"), ("work", "failed")], lines
    assert {(x["action"], x["outcome"]) for x in runs[2:]} <= {("work", "failed")}, lines
    expected = "statement timeout" if fault == "statement_timeout" else "injected compute fault"
    assert all(expected in x["error"] for x in runs), runs
    # nothing partial in the target, the queue untouched, no key blamed (the job itself is broken)
    assert _target(ex) == before_target
    assert _queue(ex) == before_queue
    st = _status(ex)
    assert (st["last_outcome"], st["consecutive_failures"], st["failing_keys"]) == ("failed", len(runs), 0)
    assert expected in st["last_error"]
    # backoff recorded: the recompute waits its backoff (1 hour), the worker min(backoff, 2^failures s)
    assert ex.execute(
        "select next_run_at > now() + interval '50 minutes' from lockstep.job_state where job = %s", [JOB]
    ).fetchone()[0]
    assert st["retry_at"] > st["last_finished_at"]

    # fault gone: converges
    ex.execute("update example.fault set kind = 'none'")
    assert ex.execute("select outcome from lockstep.recompute(%s)", [JOB]).fetchone()[0] == "done"
    wait_for(
        lambda: ex.execute(
            "select retry_at is null or retry_at <= now() from lockstep.job_state where job = %s", [JOB]
        ).fetchone()[0],
        what="work backoff over",
    )
    code, lines = _run_once(example_dsn, tmp_path, "recovered")
    assert code == 0, lines
    assert _queue(ex) == []
    assert example.divergence(ex) == (0, 0)


# kill -9 of a runner in its write phase ---------------------------------------------------------------------


@pytest.mark.parametrize("orphan", ["terminate", "check_interval", "release"])
def test_runner_killed_in_write_phase_leaves_nothing_partial(ex, example_dsn, connect, tmp_path, orphan):
    """The runner's backend is blocked inside the write phase (an AFTER INSERT trigger on the target waits for
    an advisory lock the test holds); the runner process gets SIGKILL.

    A backend blocked on a lock does not notice that its client is gone: with the default
    client_connection_check_interval = 0 it keeps waiting, with the group lock and its uncommitted writes.
    - ``terminate``: pg_terminate_backend ends it; the transaction rolls back.
    - ``check_interval``: with client_connection_check_interval = 100ms (through PGOPTIONS) it notices the
      lost client while waiting and exits alone; the transaction rolls back.
    - ``release``: the lock is granted; the backend finishes the pass and commits it (autocommit: the
      commit precedes sending the result to the dead client), then exits.
    Either way the pass is atomic: nothing partial in the target, and the queue keeps the keys unless the
    whole pass committed.
    """
    ex.execute(DEFINE_SQL, ["example.exam_key_compute(bigint[])", "1 hour"])
    assert ex.execute("select outcome from lockstep.recompute(%s)", [JOB]).fetchone()[0] == "done"
    ex.execute(WRITE_GATE_SQL)
    holder = connect(example_dsn, autocommit=True)
    holder.execute("select pg_advisory_lock(%s)", [GATE])
    holder_pid = holder.info.backend_pid
    _change_exams(ex, list(range(1, 31)))
    ex.execute("delete from example.exam where id in (41, 42)")
    before_target, before_queue = _target(ex), _queue(ex)

    env = {"PGOPTIONS": "-c client_connection_check_interval=100ms"} if orphan == "check_interval" else None
    r = Runner(example_dsn, ["--tick", "0.2", "--log-format", "json"], tmp_path / "killed.log", env=env)
    try:
        pid = wait_for(lambda: runner_backends(ex), what="runner backend")[0]
        lw = wait_for_lock_wait(ex, pid=pid, abort_if=lambda: r.proc.poll() is not None, timeout=20)
        assert holder_pid in lw.blockers
        query = ex.execute("select query from pg_stat_activity where pid = %s", [pid]).fetchone()[0]
        assert "lockstep.run" in query
        # in the write phase: it holds the group lock and waits for the gate
        locks = advisory_locks(ex, pid)
        assert any(granted for *_, granted in locks) and any(not granted for *_, granted in locks), locks
    finally:
        r.proc.send_signal(signal.SIGKILL)
        r.wait(10)
    assert r.proc.returncode == -signal.SIGKILL

    def backend_gone() -> bool:
        return not ex.execute("select 1 from pg_stat_activity where pid = %s", [pid]).fetchone()

    if orphan == "check_interval":
        wait_for(backend_gone, timeout=10, what="orphaned backend exiting by itself")
    else:
        # it lingers, still blocked: observed for a second (an observation, not a concurrency proof)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert not backend_gone()
            time.sleep(0.1)
        assert wait_for_lock_wait(ex, pid=pid, timeout=2).blockers == lw.blockers
        if orphan == "terminate":
            ex.execute("select pg_terminate_backend(%s)", [pid])
        else:
            holder.execute("select pg_advisory_unlock(%s)", [GATE])
        wait_for(backend_gone, timeout=10, what="orphaned backend gone")
    assert not advisory_locks(ex, pid)

    if orphan == "release":  # the whole pass committed
        assert _queue(ex) == []
        assert example.divergence(ex) == (0, 0)
        assert _target(ex) != before_target
    else:  # rolled back entirely
        assert _target(ex) == before_target
        assert _queue(ex) == before_queue
        holder.execute("select pg_advisory_unlock(%s)", [GATE])

    code, lines = _run_once(example_dsn, tmp_path, "after-kill")
    assert code == 0, lines
    expected = [] if orphan == "release" else ["done"]
    assert [x["outcome"] for x in lines if "outcome" in x] == expected, lines
    assert _queue(ex) == []
    assert example.divergence(ex) == (0, 0)


# PostgreSQL restart in the middle of a storm -------------------------------------------------------------

PG_BIN = pg_bindir()  # pg_config --bindir, or env LOCKSTEP_PG_BIN


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_cluster_owner(cmd: list[str]) -> list[str]:
    """initdb refuses root: run the cluster's commands as the postgres user when we are root."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@pytest.fixture
def throwaway_cluster(tmp_path_factory):
    """A PostgreSQL 15 cluster of its own (initdb + pg_ctl, trust auth, superuser named like us)."""
    if PG_BIN is None or not (PG_BIN / "initdb").exists():
        pytest.skip(f"no initdb in {PG_BIN} (pg_config --bindir; or set LOCKSTEP_PG_BIN)")
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        pytest.skip("running as root without runuser: initdb refuses root")
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="lockstep-pg-", dir="/tmp"))
    data = base / "data"
    if os.geteuid() == 0:
        shutil.chown(base, "postgres", "postgres")
    user = "root" if os.geteuid() == 0 else os.environ.get("USER", "postgres")
    port = _free_port()
    subprocess.run(
        _as_cluster_owner(
            [str(PG_BIN / "initdb"), "-D", str(data), "-A", "trust", "-U", user, "--no-sync", "-E", "UTF8"]
        ),
        check=True,
        capture_output=True,
    )
    opts = f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=50"
    ctl = [str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(base / "log"), "-w", "-t", "60", "-o", opts]
    subprocess.run(_as_cluster_owner([*ctl, "start"]), check=True, capture_output=True)
    try:
        yield {"dsn": f"postgresql://{user}@127.0.0.1:{port}/postgres", "ctl": ctl, "log": base / "log"}
    finally:
        subprocess.run(_as_cluster_owner([*ctl, "-m", "immediate", "stop"]), capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_storm_survives_a_postgres_restart(throwaway_cluster, tmp_path):
    restarts: list[float] = []

    def restart() -> None:
        t0 = time.monotonic()
        p = subprocess.run(
            _as_cluster_owner([*throwaway_cluster["ctl"], "-m", "fast", "restart"]),
            capture_output=True,
            text=True,
        )
        assert p.returncode == 0, p.stdout + p.stderr
        restarts.append(time.monotonic() - t0)

    r = storm.run(
        throwaway_cluster["dsn"],
        seconds=16,
        parents=200,
        clients=4,
        runners=2,
        every="3 seconds",
        progress=lambda msg: None,
        during=restart,
        log_dir=tmp_path,
    )
    report = storm.render(r)
    print(report, file=sys.stderr)
    assert len(restarts) == 1
    # the restart cut every connection: clients reconnected (counted apart), nothing else went wrong
    assert r["app"]["disconnects"] > 0, report
    assert r["runner"]["disconnects"] > 0, report
    assert r["app"]["errors"] == {}, report
    assert r["deadlocks"] == 0, report
    assert r["runner"]["failed"] == 0, report
    assert r["runner"]["problems"] == [], report
    assert r["runner"]["exit_codes"] == [0, 0], report
    assert r["drain"]["queue_left"] == 0, report
    assert r["failing_keys"] == 0, report
    assert r["divergence"] == [0, 0, 0], report
    assert r["ok"], report
