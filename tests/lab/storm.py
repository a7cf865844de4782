"""The storm: application transactions and lockstep runners at full tilt, then check the invariants.

Creates its own database ``lockstep_storm_<pid>`` on the admin DSN's server (dropped at the end unless
``keep``), installs lockstep and the example (``parents`` exams, recompute ``every``), then for ``seconds``:

- ``runners`` ``lockstep run --tick 0.2 --log-format json`` processes (subprocesses, logs in a temp dir);
- ``clients`` application threads, each with its own autocommit connection and explicit transactions:
  single-parent deletes, multi-parent deletes in random key order (``= any(...)`` and separate statements in
  one transaction), merges (move exam_item rows from A to B, delete A), body edits, inserts of new parents
  with items. Keys are enqueued by the watch triggers only. Each client owns the exam ids ``id % clients ==
  its index``, so application transactions never wait for each other: every lock wait they meet is lockstep.

Then: stop the clients, let the runners drain the queue (deadline), stop them with SIGTERM (exit 0 expected),
run a final ``lockstep.recompute`` (must write nothing) and ``lockstep.work`` (must be ``idle``; it gives way
while the recompute is due, hence that order), and check:
no deadlocks (``pg_stat_database.deadlocks`` delta, and no 40P01 anywhere), no FK violation (23503), no
failed run (runner JSON logs), no application error, no failing key, divergence (0, 0, 0): rows missing,
extra and different by ``lockstep.verify``.

Hostile options (``python -m lab.storm --poison --flag-every 1 --runner-tz Asia/Kolkata``): a parent whose
compute raises from the start, fixed halfway (``example.storm_poison``, read by ``example.storm_compute``);
a watched side table truncated every ``flag_every`` seconds, each TRUNCATE a recompute flag; the last
runner in another TimeZone (``PGTZ``). The storm must still end converged, with ``lockstep status`` healthy.

Connection errors (a server restart: class 08, 57P01-57P03) are not application errors: clients count them
apart and reconnect; ``allow_disconnects`` lets the fault tests accept them (and the runners' retries).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import psycopg
from psycopg import sql

from lab.procs import Runners
from lockstep.cli import dsn_option
from lockstep.db import status as db_status
from lockstep.lab import example, scratch
from lockstep.lab.app import STORM, AppClient, Stats, is_disconnect, partition
from lockstep.lab.scratch import percentile
from lockstep.status import reasons as status_reasons

JOB = example.JOB
DEADLOCKS_SQL = "select coalesce(sum(deadlocks), 0)::bigint from pg_stat_database where datname = %s"
QUEUE_SQL = "select count(*) from lockstep.queue where job = %s"
WORK_SQL = "select outcome, inserted, updated, deleted, skipped, error from lockstep.work(%s)"
RECOMPUTE_SQL = "select outcome, inserted, updated, deleted, skipped, error from lockstep.recompute(%s)"
FAILING_SQL = "select count(*) from lockstep.key_failure where job = %s"
DEADLOCK_TIMEOUT_SQL = "alter database {} set deadlock_timeout = '100ms'"

Progress = Callable[[str], None]

# the hostile options' schema: a poison list the job's compute reads, and a side table a flagger truncates
POISON_SQL = """
create table example.storm_poison (exam_id bigint primary key);
create table example.storm_side (exam_id bigint);
create function example.storm_compute(ids bigint[]) returns table (exam_id bigint, key text, weight integer)
language plpgsql stable as $$ begin
    if exists (select from example.storm_poison p where ids is null or p.exam_id = any(ids)) then
        raise exception 'storm: poison parent';
    end if;
    return query select * from example.exam_key_compute(ids);
end $$;
-- the poison parent outlives the clients' deletes while it is poisoned, so the worker meets it
create function example.storm_keep_poison() returns trigger language plpgsql as $$ begin
    return case when exists (select from example.storm_poison p where p.exam_id = old.id)
                then null else old end;
end $$;
create trigger storm_keep_poison before delete on example.exam
    for each row execute function example.storm_keep_poison();
"""


def _stderr_progress(msg: str) -> None:
    print(f"[storm] {msg}", file=sys.stderr, flush=True)


def summarize_runner_logs(records: list[dict]) -> dict[str, Any]:
    runs: Counter[str] = Counter()
    rows = Counter()
    failed_errors: list[str] = []
    problems: list[str] = []
    disconnects = 0
    poison_passes = 0
    for r in records:
        if "outcome" in r:
            runs[f"{r.get('action')}:{r['outcome']}"] += 1
            if r.get("action") == "work" and "storm: poison parent" in str(r.get("error") or ""):
                poison_passes += 1
            for k in ("inserted", "updated", "deleted", "skipped"):
                rows[k] += int(r.get(k) or 0)
            if r["outcome"] == "failed" and len(failed_errors) < 5:
                failed_errors.append(str(r.get("error")))
        elif r.get("level") in ("warning", "error", "critical"):
            msg = str(r.get("msg"))
            if any(s in msg for s in ("[08", "[57P0", "OperationalError", "connection")):
                disconnects += 1
            else:
                problems.append(msg)
    return {
        "runs": dict(sorted(runs.items())),
        "failed": sum(n for k, n in runs.items() if k.endswith(":failed")),
        "failed_errors": failed_errors,
        "rows": dict(rows),
        "problems": problems,
        "disconnects": disconnects,
        "poison_passes": poison_passes,  # worker passes that met the poison parent
    }


def _one_result(conn: psycopg.Connection, query: str) -> dict[str, Any]:
    row = conn.execute(query, [JOB]).fetchone()
    assert row is not None
    keys = ("outcome", "inserted", "updated", "deleted", "skipped", "error")
    return dict(zip(keys, row, strict=True))


def _retry(fn: Callable[[], Any], deadline: float) -> Any:
    """Call ``fn`` until it does not raise a connection error (a server restarting), up to ``deadline``."""
    while True:
        try:
            return fn()
        except psycopg.Error as exc:
            if not is_disconnect(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class Storm:
    def __init__(self, dsn: str, admin_dsn: str, dbname: str, progress: Progress = _stderr_progress):
        self.dsn, self.admin_dsn, self.dbname, self.progress = dsn, admin_dsn, dbname, progress

    def deadlocks(self) -> int:
        with psycopg.connect(self.admin_dsn, autocommit=True) as a:
            a.execute("select pg_stat_clear_snapshot()")
            row = a.execute(DEADLOCKS_SQL, [self.dbname]).fetchone()
            return int(row[0]) if row else 0

    def setup(self, parents: int, every: str, hostile: bool = False) -> None:
        from lockstep.migrate import migrate

        self.progress("migrate")
        migrate(self.dsn)
        self.progress(f"install example: {parents} parents, recompute every {every}")
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            example.install(conn, parents=parents, every=every)
            if hostile:  # the poison list and the flagged side table (they change nothing while empty)
                conn.execute(POISON_SQL)
                conn.execute(
                    "select lockstep.define_derived(%s, 'example.exam_key',"
                    " 'example.storm_compute(bigint[])', 'example.exam', every => %s::interval)",
                    [JOB, every],
                )
                conn.execute("select lockstep.watch(%s, 'example.storm_side', 'exam_id')", [JOB])
                conn.execute("delete from lockstep.recompute_flag")
            r = _one_result(conn, RECOMPUTE_SQL)
            if r["outcome"] != "done":
                raise RuntimeError(f"initial recompute: {r}")
            conn.execute("delete from lockstep.queue where job = %s", [JOB])

    def storm(
        self,
        seconds: float,
        parents: int,
        clients: int = 4,
        runners: int = 2,
        log_dir: Path | None = None,
        during: Callable[[], None] | None = None,
        drain_timeout: float = 120.0,
        pause: float = 0.002,
        seed: int | None = None,
        poison: int | None = None,
        flag_every: float | None = None,
        runner_tz: str | None = None,
    ) -> dict[str, Any]:
        """Run the storm on an installed database; ``during`` is called once, halfway through. ``poison``: a
        parent poisoned from the start and fixed halfway; ``flag_every``: seconds between recompute flags;
        ``runner_tz``: the last runner's TimeZone (all three need ``setup(..., hostile=True)``)."""
        seed = random.randrange(1 << 30) if seed is None else seed
        tmp = None
        if log_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="lockstep-storm-")
            log_dir = Path(tmp.name)
        deadlocks0 = self.deadlocks()
        self.progress(f"storm: {seconds:g} s, {clients} clients, {runners} runners (seed {seed})")
        envs: list[dict[str, str] | None] = [None] * runners
        if runner_tz and runners:
            envs[-1] = {"PGTZ": runner_tz}
        rs = Runners(self.dsn, runners, log_dir, envs=envs)
        flagger = _Flagger(self.dsn, flag_every) if flag_every else None
        if poison is not None:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                conn.execute("insert into example.storm_poison values (%s)", [poison])
                conn.execute("update example.exam set body = body where id = %s", [poison])
        workload = dataclasses.replace(STORM, pause=pause)
        owned = partition(list(range(1, parents + 1)), parents + 1, clients)
        cs = [
            AppClient(self.dsn, i, clients, live, first, workload, seed + i, name="storm-client")
            for i, (live, first) in enumerate(owned)
        ]
        codes: list[int | None] = []
        drained = False
        drain_s = None
        try:
            started = time.monotonic()
            for c in cs:
                c.start()
            if flagger is not None:
                flagger.start()
            end = started + seconds
            half = started + seconds / 2
            did_during = during is None and poison is None
            while time.monotonic() < end:
                if not did_during and time.monotonic() >= half:
                    self.progress("halfway: fault injection")
                    if during is not None:
                        during()
                    if poison is not None:
                        self._cure(poison)
                    did_during = True
                time.sleep(0.1)
            for c in cs:
                c.stop.set()
            if flagger is not None:
                flagger.stop.set()
                flagger.join(30)
            for c in cs:
                c.join(30)
            app_s = time.monotonic() - started
            self.progress("clients stopped; draining the queue")
            t0 = time.monotonic()
            deadline = t0 + drain_timeout
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while time.monotonic() < deadline:
                    if conn.execute(QUEUE_SQL, [JOB]).fetchone()[0] == 0:
                        drained = True
                        break
                    time.sleep(0.2)
            drain_s = time.monotonic() - t0
            runners_alive = rs.alive()
        finally:
            for c in cs:
                c.stop.set()
            codes = rs.stop()
        self.progress(f"runners stopped (exit codes {codes}); final checks")
        records = rs.records()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            queue_left = conn.execute(QUEUE_SQL, [JOB]).fetchone()[0]
            # recompute first: work gives way ("busy") while the group's periodic recompute is due
            final_recompute = _one_result(conn, RECOMPUTE_SQL)
            final_work = _one_result(conn, WORK_SQL)
            failing_keys = conn.execute(FAILING_SQL, [JOB]).fetchone()[0]
            divergence = list(example.verify(conn))
            exams = conn.execute("select count(*) from example.exam").fetchone()[0]
            keys = conn.execute("select count(*) from example.exam_key").fetchone()[0]
            unhealthy = status_reasons(db_status(conn))
        deadlocks = self.deadlocks() - deadlocks0
        if tmp is not None:
            tmp.cleanup()
        return self._result(
            seconds=seconds,
            parents=parents,
            clients=cs,
            runners=runners,
            seed=seed,
            app_s=app_s,
            drained=drained,
            drain_s=drain_s,
            runners_alive=runners_alive,
            codes=codes,
            logs=summarize_runner_logs(records),
            queue_left=queue_left,
            final_work=final_work,
            final_recompute=final_recompute,
            failing_keys=failing_keys,
            poisoned=poison is not None,
            divergence=divergence,
            deadlocks=deadlocks,
            exams=exams,
            keys=keys,
            unhealthy=unhealthy,
            flags=flagger.flags if flagger is not None else 0,
        )

    def _cure(self, poison: int) -> None:
        """The poison parent fixed by the application: its poison gone, the parent changed (queued)."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("delete from example.storm_poison")
            conn.execute("update example.exam set body = body where id = %s", [poison])

    @staticmethod
    def _result(clients: list[AppClient], **kw: Any) -> dict[str, Any]:
        stats: list[Stats] = [c.stats for c in clients]
        lat = [x for st in stats for x in st.latencies_ms]
        ops: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        samples: list[str] = []
        for st in stats:
            ops.update(st.ok)
            errors.update(st.errors)
            samples.extend(st.error_samples)
        logs = kw.pop("logs")
        app = {
            "transactions": sum(ops.values()),
            "tps": round(sum(ops.values()) / kw["app_s"], 1) if kw["app_s"] else None,
            "ops": dict(sorted(ops.items())),
            "errors": dict(sorted(errors.items())),
            "error_samples": samples[:10],
            "disconnects": sum(st.disconnects for st in stats),
            "parents_deleted": sum(st.deleted for st in stats),
            "parents_inserted": sum(st.inserted for st in stats),
            "latency_ms": {
                "p50": _round(percentile(lat, 0.5)),
                "p99": _round(percentile(lat, 0.99)),
                "max": _round(max(lat, default=None)),
            },
        }
        fr = kw["final_recompute"]
        r: dict[str, Any] = {
            "seconds": kw["seconds"],
            "parents": kw["parents"],
            "clients": len(clients),
            "runners": kw["runners"],
            "seed": kw["seed"],
            "app": app,
            "runner": {**logs, "exit_codes": kw["codes"], "alive_at_end": kw["runners_alive"]},
            "drain": {
                "drained": kw["drained"],
                "seconds": _round(kw["drain_s"]),
                "queue_left": kw["queue_left"],
            },
            "final_work": kw["final_work"],
            "final_recompute": fr,
            "failing_keys": kw["failing_keys"],
            "deadlocks": kw["deadlocks"],
            "divergence": kw["divergence"],
            "exams": kw["exams"],
            "exam_keys": kw["keys"],
            "flags": kw["flags"],
            "status_unhealthy": kw["unhealthy"],
        }
        fk = errors.get("23503", 0) + sum("23503" in e for e in logs["failed_errors"])
        r["checks"] = {
            "deadlocks == 0": kw["deadlocks"] == 0
            and errors.get("40P01", 0) == 0
            and not any("40P01" in p for p in logs["problems"]),
            "fk_violations == 0": fk == 0,
            "failed_runs == 0": logs["failed"] == 0,
            "app_errors == 0": sum(errors.values()) == 0,
            "runner_errors == 0": not logs["problems"],
            "queue drained": bool(kw["drained"]) and kw["queue_left"] == 0,
            "runners exit 0 on SIGTERM": all(code == 0 for code in kw["codes"]) and bool(kw["runners_alive"]),
            "final work idle": kw["final_work"]["outcome"] == "idle",
            "final recompute writes nothing": fr["outcome"] == "done"
            and fr["inserted"] == fr["updated"] == fr["deleted"] == 0,
            "no failing keys": kw["failing_keys"] == 0,
            "divergence == (0, 0, 0)": list(kw["divergence"]) == [0, 0, 0],
            "status healthy": not kw["unhealthy"],
        }
        if kw["poisoned"]:
            r["checks"]["the worker met the poison parent"] = logs["poison_passes"] > 0
        r["ok"] = all(r["checks"].values())
        return r


class _Flagger(threading.Thread):
    """Truncates the watched side table every ``every`` seconds: each TRUNCATE flags the job for its full
    recompute (a trigger's fallback), as an application that truncates a watched table would."""

    def __init__(self, dsn: str, every: float) -> None:
        super().__init__(name="storm-flagger", daemon=True)
        self.dsn, self.every, self.flags = dsn, every, 0
        self.stop = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stop.wait(self.every):
                conn.execute("truncate example.storm_side")
                self.flags += 1


def _round(v: float | None, nd: int = 1) -> float | None:
    return None if v is None else round(v, nd)


def create_db(admin_dsn: str, name: str) -> str:
    dsn = scratch.create_database(admin_dsn, name)
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL(DEADLOCK_TIMEOUT_SQL).format(sql.Identifier(name)))
    return dsn


drop_db = scratch.drop_database


def run(
    admin_dsn: str | None,
    seconds: float = 60,
    parents: int = 2000,
    clients: int = 4,
    runners: int = 2,
    every: str = "3 seconds",
    keep: bool = False,
    progress: Progress = _stderr_progress,
    during: Callable[[], None] | None = None,
    log_dir: Path | None = None,
    poison: bool = False,
    flag_every: float | None = None,
    runner_tz: str | None = None,
) -> dict[str, Any]:
    """Run a storm in a database of its own and return the result dict (``ok`` False if a check failed).
    ``poison``, ``flag_every``, ``runner_tz``: the hostile options (module docstring)."""
    admin_dsn = admin_dsn or ""
    name = f"lockstep_storm_{os.getpid()}"
    progress(f"create database {name}")
    dsn = create_db(admin_dsn, name)
    try:
        s = Storm(dsn, admin_dsn, name, progress)
        hostile = poison or bool(flag_every) or bool(runner_tz)
        s.setup(parents, every, hostile=hostile)
        result = s.storm(
            seconds,
            parents,
            clients,
            runners,
            log_dir=log_dir,
            during=during,
            poison=parents // 2 if poison else None,
            flag_every=flag_every,
            runner_tz=runner_tz,
        )
        result["database"] = name if keep else None
        result["every"] = every
        return result
    finally:
        if not keep:
            _retry(lambda: drop_db(admin_dsn, name), time.monotonic() + 30)


def to_json(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2, default=str)


def render(r: dict[str, Any]) -> str:
    app, rn = r["app"], r["runner"]
    lat = app["latency_ms"]
    lines = [
        f"storm: {r['seconds']:g} s, {r['parents']} parents, {r['clients']} app clients, "
        f"{r['runners']} runners, recompute every {r.get('every', '?')} (seed {r['seed']})",
        "",
        f"app transactions   {app['transactions']} ({app['tps']}/s): "
        + ", ".join(f"{k} {v}" for k, v in app["ops"].items()),
        f"app latency ms     p50 {lat['p50']}  p99 {lat['p99']}  max {lat['max']}",
        f"app errors         {app['errors'] or 'none'}"
        + (f"  (disconnects {app['disconnects']})" if app["disconnects"] else ""),
        f"parents            -{app['parents_deleted']} +{app['parents_inserted']} -> {r['exams']} exams, "
        f"{r['exam_keys']} exam_key rows",
        "runs by outcome    " + ", ".join(f"{k} {v}" for k, v in rn["runs"].items()),
        "rows written       " + ", ".join(f"{k} {v}" for k, v in rn["rows"].items()),
        f"drain              {r['drain']['seconds']} s (queue left {r['drain']['queue_left']}); "
        f"runner exit codes {rn['exit_codes']}"
        + (f"; runner connection losses {rn['disconnects']}" if rn["disconnects"] else ""),
        f"final passes       work {r['final_work']['outcome']}, recompute {r['final_recompute']['outcome']} "
        f"+{r['final_recompute']['inserted']} ~{r['final_recompute']['updated']} "
        f"-{r['final_recompute']['deleted']}",
        f"deadlocks          {r['deadlocks']}",
        f"divergence         {tuple(r['divergence'])}",
    ]
    if r.get("flags"):
        lines.append(f"recompute flags    {r['flags']} (a watched table truncated)")
    for s in r.get("status_unhealthy") or []:
        lines.append(f"  status: {s}")
    for s in app["error_samples"]:
        lines.append(f"  app error: {s}")
    for s in rn["failed_errors"]:
        lines.append(f"  failed run: {s}")
    for s in rn["problems"][:10]:
        lines.append(f"  runner: {s}")
    lines.append("")
    for name, ok in r["checks"].items():
        lines.append(f"{'ok  ' if ok else 'FAIL'} {name}")
    lines.append("")
    lines.append("storm: OK" if r["ok"] else "storm: FAILED")
    if r.get("database"):
        lines.append(f"database kept: {r['database']}")
    return "\n".join(lines)


@click.command()
@dsn_option
@click.option("--seconds", default=60.0, show_default=True, help="How long the application clients run.")
@click.option("--parents", default=2000, show_default=True, help="Parents (exams) in the example.")
@click.option("--clients", default=4, show_default=True, help="Application client threads.")
@click.option("--runners", default=2, show_default=True, help="`lockstep run` processes.")
@click.option("--every", default="3 seconds", show_default=True, help="Full recompute interval.")
@click.option("--keep", is_flag=True, help="Keep the storm database (lockstep_storm_<pid>).")
@click.option("--poison", is_flag=True, help="A parent whose compute raises from the start, fixed halfway.")
@click.option(
    "--flag-every",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="Truncate a watched side table this often: a recompute flag each time.",
)
@click.option("--runner-tz", default=None, metavar="ZONE", help="The last runner's TimeZone (PGTZ).")
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON instead of the report.")
def main(
    dsn: str | None,
    seconds: float,
    parents: int,
    clients: int,
    runners: int,
    every: str,
    keep: bool,
    poison: bool,
    flag_every: float | None,
    runner_tz: str | None,
    as_json: bool,
) -> None:
    """App transactions and runners at once in a database of its own; exit 1 if an invariant fails."""
    logging.basicConfig(level=logging.WARNING)
    result = run(
        dsn,
        seconds,
        parents,
        clients,
        runners,
        every,
        keep,
        poison=poison,
        flag_every=flag_every,
        runner_tz=runner_tz,
    )
    click.echo(to_json(result) if as_json else render(result))
    raise SystemExit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
