"""``lockstep demo``: see lockstep work, then see the naive jobs fail, on the same workload.

1. Picks a server: the admin DSN (``--dsn``, ``DATABASE_URL`` or libpq's defaults) if it answers within 2 s.
   With ``--embedded``, or when no connection was configured (no DSN, no PGHOST/PGPORT/PGSERVICE) and
   nothing answers at libpq's defaults, an embedded PostgreSQL from the ``pgserver`` package, its data in
   ``.lockstep-demo/pgdata``, stopped at the end; it says so before starting it. A configured server
   that fails, or any server that answers with an error (authentication, missing database), is an error.
2. Creates database ``lockstep_demo`` (``--database``) with a marker comment: an existing one is dropped
   only if it carries the marker, else the demo stops, changing nothing. Migrates lockstep, installs the
   example with ``--parents`` exams and runs one ``lockstep.recompute``.
3. lockstep phase (``--seconds``): two ``lockstep run --tick 0.2 --log-format json`` processes, and
   application clients (threads, one connection each) doing deletes, merges, edits, inserts and explicit
   ``lockstep.enqueue`` calls. Each client owns the exams whose id is congruent to its number, so clients
   never wait for each other: every wait or deadlock involves a job. Then the runners drain the queue and
   the derived table is compared with a full computation (``lockstep.verify``, as users check theirs).
4. naive phase (``--naive-seconds``): the same clients against ``example.naive_recompute()`` (looped: the
   periodic job) and ``example.naive_work(ids)`` (looped over keys taken from ``lockstep.queue``: the
   queue worker).
5. Prints both side by side. Exit code 0 when lockstep had no deadlock and converged.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from lockstep.lab import app, example, scratch
from lockstep.lab.app import AppClient, Stats, partition
from lockstep.lab.procs import RunnerProcess
from lockstep.lab.scratch import percentile

JOB = example.JOB
DEMO_DIR = ".lockstep-demo"
EVERY = "5 seconds"  # the example job's full-recompute period during the demo
CLIENTS = 4
PAUSE = 0.01  # think time of an application client between transactions, seconds
DRAIN_TIMEOUT = 120.0
PLAIN_EVERY = 5.0  # seconds between progress lines when stderr is not a terminal

DEADLOCKS_SQL = "select deadlocks from pg_stat_database where datname = current_database()"
OTHER_BACKENDS_SQL = (
    "select count(*) from pg_stat_activity where datname = current_database() and pid <> pg_backend_pid()"
)
QUEUE_DEPTH_SQL = "select coalesce(sum(queue_depth), 0)::bigint from lockstep.status where job = %s"
KEY_FAILURES_SQL = (
    "select coalesce(sum(parked_keys + failing_keys), 0)::bigint from lockstep.status where job = %s"
)
XACT_ROWS_SQL = (
    "select coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint"
    " from pg_stat_xact_user_tables where relid = 'example.exam_key'::regclass"
)
TAKE_KEYS_SQL = (
    "select array_agg(id), array_agg(distinct key::bigint) from"
    " (select id, key from lockstep.queue where job = %s order by id limit 500) q"
)
CONSUME_KEYS_SQL = "delete from lockstep.queue where job = %s and id = any(%s)"


class NoServer(RuntimeError):
    """The server the demo was told to use (or the one that answered) cannot be used; nothing started.

    ``answered``: a server answered with an error (login refused, missing database), not just silence.
    """

    def __init__(self, message: str, answered: bool = False) -> None:
        super().__init__(message)
        self.answered = answered


def _sqlstate(exc: BaseException) -> str:
    return getattr(exc, "sqlstate", None) or type(exc).__name__


@dataclass
class Options:
    dsn: str | None = None
    parents: int = 50000
    seconds: float = 60.0
    naive_seconds: float = 15.0
    embedded: bool = False
    database: str = "lockstep_demo"
    clients: int = CLIENTS
    keep: bool = False


# ---------------------------------------------------------------------------------------------- server


class Server:
    """The admin DSN to use, and the embedded server to stop at the end (if one was started)."""

    def __init__(self, admin_dsn: str, embedded: Any = None, note: str = "") -> None:
        self.admin_dsn, self.embedded, self.note = admin_dsn, embedded, note

    def stop(self) -> None:
        if self.embedded is not None:
            self.embedded.cleanup()
            self.embedded = None


LIBPQ_WHERE = ("PGHOST", "PGHOSTADDR", "PGPORT", "PGSERVICE")  # set: the user said which server to use


def _answers(dsn: str) -> tuple[str | None, bool]:
    """(None, True) if a server accepts a connection within 2 s, else (why not in one line, whether a
    server answered at all: an authentication or missing-database error is an answer)."""
    try:
        with psycopg.connect(dsn, connect_timeout=2, autocommit=True):
            return None, True
    except psycopg.Error as exc:
        text = " ".join(str(exc).split())
        return (text or type(exc).__name__), "FATAL" in text


def start_embedded(base: Path) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
            import pgserver
    except ImportError as exc:
        raise RuntimeError(
            "no PostgreSQL server answers and the embedded one needs the pgserver package: "
            "pip install 'pg-lockstep[demo]' (or pgserver), or give --dsn"
        ) from exc
    base.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pgserver.get_server(base / "pgdata", cleanup_mode="stop")


def pick_server(opts: Options, say) -> Server:
    if not opts.embedded:
        admin = opts.dsn or ""
        why, answered = _answers(admin)
        if why is None:
            return Server(admin, note=f"server: {_describe(admin)}")
        configured = [v for v in LIBPQ_WHERE if os.environ.get(v)]
        if admin or configured or answered:
            given = "the given DSN" if admin else (", ".join(configured) or "libpq's defaults")
            raise NoServer(
                f"cannot use the server at {_describe(admin)} ({given}): {why}. "
                "Fix the connection, or run `lockstep demo --embedded` for a throw-away embedded server",
                answered=answered,
            )
        say(f"no PostgreSQL server answers at {_describe(admin)} ({why})")
    say(_embedded_plan())
    srv = start_embedded(Path.cwd() / DEMO_DIR)
    return Server(srv.get_uri(), srv, note=f"server: embedded pgserver, data in {DEMO_DIR}/pgdata")


def _embedded_plan() -> str:
    """What starting the embedded server will do, said before doing it."""
    data = Path.cwd() / DEMO_DIR / "pgdata"
    plan = f"starting an embedded PostgreSQL (pgserver package): data in {data}, server stopped at the end"
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        plan += (
            "; running as root, so pgserver runs PostgreSQL as the system user 'pgserver', which it "
            "creates with useradd if missing"
        )
    return plan


def _describe(dsn: str) -> str:
    if not dsn:
        return "libpq defaults (PGHOST, PGPORT, ...)"
    try:
        from psycopg.conninfo import conninfo_to_dict

        d = conninfo_to_dict(dsn)
        d.pop("password", None)
        return " ".join(f"{k}={v}" for k, v in d.items())
    except psycopg.Error:
        return "the given DSN"


# ---------------------------------------------------------------------------------------------- app


def start_clients(
    dsn: str, opts: Options, first_new: int, live_ids: list[int], stats: Stats, stop: threading.Event
) -> list[AppClient]:
    """opts.clients application clients (lockstep.lab.app, the demo workload), each owning its exams."""
    owned = partition(live_ids, first_new, opts.clients)
    clients = [
        AppClient(
            dsn, k, opts.clients, live, first, app.DEMO, seed=k, stats=stats, stop=stop, name="demo-app"
        )
        for k, (live, first) in enumerate(owned)
    ]
    for c in clients:
        c.start()
    return clients


# ---------------------------------------------------------------------------------------------- runners

RUNNER_ARGS = ("--job", JOB, "--tick", "0.2", "--log-format", "json")


@dataclass
class RunnerTally:
    """What a runner's JSON log says so far."""

    outcomes: Counter[str] = field(default_factory=Counter)
    actions: Counter[str] = field(default_factory=Counter)  # "done work", "failed recompute", ...
    rows: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # deadlock / foreign key, from log lines
    other: list[str] = field(default_factory=list)  # warnings and errors that are not a run's outcome


def tally(records: list[dict[str, Any]]) -> RunnerTally:
    t = RunnerTally()
    for rec in records:
        text = f"{rec.get('msg', '')} {rec.get('error', '')} {rec.get('exc', '')}"
        if "outcome" in rec:
            t.outcomes[rec["outcome"]] += 1
            t.actions[f"{rec['outcome']} {rec.get('action', '?')}"] += 1
            t.rows += sum(int(rec.get(k) or 0) for k in ("inserted", "updated", "deleted"))
        if "deadlock detected" in text or "40P01" in text:
            t.errors["40P01"] += 1
        if "violates foreign key constraint" in text or "23503" in text:
            t.errors["23503"] += 1
        if rec.get("level", "error") in ("warning", "error", "critical") and "outcome" not in rec:
            t.other.append(str(rec.get("msg", "")))
    return t


# ---------------------------------------------------------------------------------------------- naive


class NaiveJob(threading.Thread):
    """One of the seed's jobs, looped: ``recompute`` (the periodic job) or ``work`` (the queue worker)."""

    def __init__(self, dsn: str, kind: str, stop: threading.Event) -> None:
        super().__init__(daemon=True, name=f"demo-naive-{kind}")
        self.dsn, self.kind, self.stop = dsn, kind, stop
        self.runs = 0
        self.rows = 0
        self.errors: Counter[str] = Counter()

    def _once(self, conn: psycopg.Connection) -> bool:
        """One transaction; False when there was nothing to do."""
        with conn.transaction():
            before = conn.execute(XACT_ROWS_SQL).fetchone()[0]
            if self.kind == "recompute":
                conn.execute("select example.naive_recompute()")
            else:
                ids, keys = conn.execute(TAKE_KEYS_SQL, [JOB]).fetchone()
                if not ids:
                    return False
                conn.execute("select example.naive_work(%s::bigint[])", [keys])
                conn.execute(CONSUME_KEYS_SQL, [JOB, ids])
            self.rows += conn.execute(XACT_ROWS_SQL).fetchone()[0] - before
        return True

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True, application_name=f"naive {self.kind}") as conn:
            while not self.stop.is_set():
                try:
                    did = self._once(conn)
                    self.runs += did
                except psycopg.Error as exc:
                    self.errors[_sqlstate(exc)] += 1
                    did = True
                    if conn.broken:
                        return
                if not did:
                    self.stop.wait(0.2)


# ---------------------------------------------------------------------------------------------- demo


@dataclass
class Phase:
    name: str
    seconds: float = 0.0
    deadlocks: int = 0
    fk_errors: int = 0
    job_runs: Counter[str] = field(default_factory=Counter)  # by outcome: done, failed
    job_actions: Counter[str] = field(default_factory=Counter)  # "done work", "failed recompute", ...
    job_errors: Counter[str] = field(default_factory=Counter)
    app: Stats = field(default_factory=Stats)
    rows_written: int = 0
    key_failures: int = 0
    divergence: tuple[int, int, int] | None = None  # rows missing, extra, different (lockstep.verify)
    drained: bool | None = None
    drain_seconds: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def converged(self) -> bool:
        return self.divergence == (0, 0, 0)

    def to_dict(self) -> dict[str, Any]:
        a = self.app
        return {
            "name": self.name,
            "seconds": round(self.seconds, 1),
            "deadlocks": self.deadlocks,
            "fk_errors": self.fk_errors,
            "job_runs": dict(self.job_runs),
            "job_actions": dict(self.job_actions),
            "job_errors": dict(self.job_errors),
            "app_transactions": len(a.tx_ms),
            "app_ops": dict(a.attempts),
            "app_errors": dict(a.errors),
            "app_tx_p99_ms": percentile(a.tx_ms, 0.99),
            "app_delete_n": len(a.delete_ms),
            "app_delete_p50_ms": percentile(a.delete_ms, 0.5),
            "app_delete_p99_ms": percentile(a.delete_ms, 0.99),
            "app_delete_max_ms": max(a.delete_ms) if a.delete_ms else None,
            "rows_written": self.rows_written,
            "key_failures": self.key_failures,
            "divergence": list(self.divergence) if self.divergence is not None else None,
            "converged": self.converged,
            "drained": self.drained,
            "drain_seconds": self.drain_seconds,
            "notes": self.notes,
        }


class Demo:
    def __init__(self, opts: Options, out=sys.stderr) -> None:
        self.opts, self.out = opts, out
        self.tty = hasattr(out, "isatty") and out.isatty()
        self.width = 0
        self._plain_at = -PLAIN_EVERY
        self._phase = ""

    # -- output
    def say(self, msg: str) -> None:
        self._clear()
        print(f"[demo] {msg}", file=self.out, flush=True)

    def _line(self, msg: str, force: bool = False) -> None:
        """The one refreshed progress line (carriage return, padded over the previous one) on a terminal;
        elsewhere (a pipe, a log file) one plain line every PLAIN_EVERY seconds."""
        if not self.tty:
            now = time.monotonic()
            if force or now - self._plain_at >= PLAIN_EVERY:
                self._plain_at = now
                print(msg, file=self.out, flush=True)
            return
        pad = max(0, self.width - len(msg))
        self.out.write("\r" + msg + " " * pad)
        self.out.flush()
        self.width = len(msg)

    def _clear(self) -> None:
        if self.width:
            self.out.write("\n")
            self.out.flush()
            self.width = 0

    # -- setup
    def setup(self, admin_dsn: str) -> str:
        from lockstep.migrate import migrate

        name = self.opts.database
        self.say(f"create database {name} (one lockstep made before is dropped first)")
        dsn = scratch.create_database(admin_dsn, name)
        self.say("migrate lockstep")
        migrate(dsn)
        self.say(f"install the example: {self.opts.parents} exams, job {JOB} (full recompute every {EVERY})")
        with psycopg.connect(dsn, autocommit=True) as conn:
            with conn.transaction():
                example.install(conn, parents=self.opts.parents, every=EVERY)
            t0 = time.perf_counter()
            # the initial fill is set-up, not measured: one unbounded transaction, so no hand-off is left
            # (deleting the queue afterwards dropped the hand-off of a bounded recompute: the demo's first
            # fill wrote 500 exams and a short demo did not converge)
            with conn.transaction():
                conn.execute("update lockstep.job set batch_parents = 1000000 where job = %s", [JOB])
                outcome, error, ins = conn.execute(
                    "select outcome, error, inserted from lockstep.recompute(%s)", [JOB]
                ).fetchone()
                conn.execute("update lockstep.job set batch_parents = default where job = %s", [JOB])
            if outcome != "done":
                raise RuntimeError(f"first lockstep.recompute: {outcome} {error}")
            # the keys the install's own inserts queued: the fill computed every exam after they committed
            conn.execute("delete from lockstep.queue where job = %s", [JOB])
            conn.execute("vacuum analyze example.exam, example.exam_item, example.exam_key")
            self.say(f"first lockstep.recompute: {ins} exam_key rows in {time.perf_counter() - t0:.1f} s")
        return dsn

    def _deadlocks(self, conn: psycopg.Connection) -> int:
        """pg_stat_database.deadlocks once every other session of the database is gone (exit flushes)."""
        deadline = time.monotonic() + 10
        while conn.execute(OTHER_BACKENDS_SQL).fetchone()[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        conn.execute("select pg_stat_clear_snapshot()")
        return int(conn.execute(DEADLOCKS_SQL).fetchone()[0])

    @staticmethod
    def _ids(conn: psycopg.Connection) -> tuple[list[int], int]:
        ids = [r[0] for r in conn.execute("select id from example.exam order by id")]
        return ids, (max(ids) if ids else 0) + 1

    # -- lockstep phase
    def lockstep_phase(self, dsn: str, conn: psycopg.Connection) -> Phase:
        runners: list[RunnerProcess] = []
        with tempfile.TemporaryDirectory(prefix="lockstep-demo-") as logs:
            try:
                return self._lockstep_phase(dsn, conn, runners, Path(logs))
            finally:  # on an error or Ctrl-C too: no runner is left behind
                for r in runners:
                    if r.alive():
                        r.stop()

    def _lockstep_phase(
        self, dsn: str, conn: psycopg.Connection, runners: list[RunnerProcess], logs: Path
    ) -> Phase:
        ph = Phase("lockstep")
        d0 = self._deadlocks(conn)
        ids, first_new = self._ids(conn)
        runners.extend(RunnerProcess(dsn, RUNNER_ARGS, logs / f"runner-{i}.log") for i in range(2))
        stop = threading.Event()
        self.say(
            f"lockstep phase: 2 runners (lockstep run --tick 0.2) + {self.opts.clients} app clients "
            f"for {self.opts.seconds:g} s"
        )
        t0 = time.monotonic()
        clients = start_clients(dsn, self.opts, first_new, ids, ph.app, stop)
        try:
            while (elapsed := time.monotonic() - t0) < self.opts.seconds:
                self._progress("lockstep", elapsed, self.opts.seconds, conn, ph, runners=runners)
                time.sleep(0.25)
        finally:
            stop.set()
            for c in clients:
                c.join()
        ph.seconds = time.monotonic() - t0
        self._progress("lockstep", ph.seconds, self.opts.seconds, conn, ph, runners=runners, final=True)
        self._clear()
        # let the runners drain what the app left in the queue
        self.say("app clients stopped; letting the runners drain the queue")
        t1 = time.monotonic()
        ph.drained = False
        while time.monotonic() - t1 < DRAIN_TIMEOUT:
            depth = conn.execute(QUEUE_DEPTH_SQL, [JOB]).fetchone()[0]
            busy = conn.execute(
                "select count(*) from pg_stat_activity where datname = current_database()"
                " and application_name = 'lockstep-runner' and state = 'active'"
            ).fetchone()[0]
            if depth == 0 and busy == 0:
                ph.drained = True
                break
            self._line(f"[drain] queue {depth}")
            time.sleep(0.2)
        self._clear()
        ph.drain_seconds = round(time.monotonic() - t1, 1)
        for r in runners:
            rc = r.stop()
            if rc != 0:
                ph.notes.append(f"a runner exited with code {rc}")
            t = tally(r.records())
            ph.job_actions.update(t.actions)
            ph.job_runs.update(t.outcomes)
            ph.rows_written += t.rows
            ph.job_errors.update(t.errors)
            ph.notes.extend(f"runner: {m}" for m in t.other[:5])
        ph.deadlocks = self._deadlocks(conn) - d0
        ph.fk_errors = ph.app.errors.get("23503", 0) + ph.job_errors.get("23503", 0)
        ph.key_failures = int(conn.execute(KEY_FAILURES_SQL, [JOB]).fetchone()[0])
        ph.divergence = example.verify(conn)
        return ph

    # -- naive phase
    def naive_phase(self, dsn: str, conn: psycopg.Connection) -> Phase:
        ph = Phase("naive")
        conn.execute("delete from lockstep.queue where job = %s", [JOB])
        d0 = self._deadlocks(conn)
        ids, first_new = self._ids(conn)
        stop = threading.Event()
        jobs = [NaiveJob(dsn, "recompute", stop), NaiveJob(dsn, "work", stop)]
        self.say(
            f"naive phase: naive_recompute() looped + naive_work(keys from lockstep.queue) looped + "
            f"{self.opts.clients} app clients for {self.opts.naive_seconds:g} s"
        )
        t0 = time.monotonic()
        for j in jobs:
            j.start()
        clients = start_clients(dsn, self.opts, first_new, ids, ph.app, stop)
        try:
            while (elapsed := time.monotonic() - t0) < self.opts.naive_seconds:
                self._progress("naive", elapsed, self.opts.naive_seconds, conn, ph, naive=jobs)
                time.sleep(0.25)
            self._progress(
                "naive", time.monotonic() - t0, self.opts.naive_seconds, conn, ph, naive=jobs, final=True
            )
        finally:
            stop.set()
            self._clear()
            self.say("stopping: waiting for the naive jobs' current transactions to end")
            for t in [*clients, *jobs]:
                t.join()
        ph.seconds = time.monotonic() - t0
        self._clear()
        for j in jobs:
            ph.job_runs["done"] += j.runs
            ph.job_actions[f"done {j.kind}"] += j.runs
            ph.job_actions[f"failed {j.kind}"] += sum(j.errors.values())
            ph.job_runs["failed"] += sum(j.errors.values())
            ph.job_errors.update(j.errors)
            ph.rows_written += j.rows
        ph.deadlocks = self._deadlocks(conn) - d0
        ph.fk_errors = ph.app.errors.get("23503", 0) + ph.job_errors.get("23503", 0)
        ph.divergence = example.verify(conn)
        return ph

    def _progress(
        self,
        name: str,
        elapsed: float,
        total: float,
        conn: psycopg.Connection,
        ph: Phase,
        runners: list[RunnerProcess] | None = None,
        naive: list[NaiveJob] | None = None,
        final: bool = False,
    ) -> None:
        try:
            depth = conn.execute(QUEUE_DEPTH_SQL, [JOB]).fetchone()[0]
        except psycopg.Error:
            depth = "?"
        outcomes: Counter[str] = Counter()
        for r in runners or []:
            outcomes.update(tally(r.records()).outcomes)
        for j in naive or []:
            outcomes["done"] += j.runs
            outcomes["failed"] += sum(j.errors.values())
        with ph.app.lock:
            n = len(ph.app.tx_ms)
            p99 = percentile(ph.app.tx_ms[-2000:], 0.99)
            errs = sum(ph.app.errors.values())
        runs = " ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) or "none yet"
        p99s = "-" if p99 is None else f"{p99:.1f} ms"
        first = name != self._phase  # the first line of a phase is never held back
        self._phase = name
        self._line(
            f"[{name} {elapsed:4.0f}/{total:g} s] runs: {runs} | queue {depth} | "
            f"app tx {n} (p99 {p99s}, errors {errs})",
            force=final or first,
        )

    def run(self) -> dict[str, Any]:
        server = pick_server(self.opts, self.say)
        self.say(server.note)
        try:
            dsn = self.setup(server.admin_dsn)
            with psycopg.connect(dsn, autocommit=True, application_name="lockstep demo") as conn:
                machine = {
                    "nproc": os.cpu_count(),
                    "postgresql": conn.execute("show server_version").fetchone()[0],
                }
                ls = self.lockstep_phase(dsn, conn)
                naive = self.naive_phase(dsn, conn) if self.opts.naive_seconds > 0 else None
            result = {
                "machine": machine,
                "server": server.note,
                "parents": self.opts.parents,
                "clients": self.opts.clients,
                "lockstep": ls.to_dict(),
                "naive": naive.to_dict() if naive else None,
                "ok": ls.deadlocks == 0 and ls.converged,
            }
            if not self.opts.keep:
                scratch.drop_database(server.admin_dsn, self.opts.database)
            return result
        finally:
            self._clear()
            server.stop()


def run(opts: Options) -> dict[str, Any]:
    return Demo(opts).run()


def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _errors(d: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(d.items())) or "0"


def render(r: dict[str, Any]) -> str:
    ls, nv = r["lockstep"], r["naive"]
    m = r["machine"]
    lines = [
        f"lockstep demo: {r['parents']} exams, {r['clients']} app clients, {m['nproc']} CPUs, "
        f"PostgreSQL {m['postgresql']} ({r['server']})",
        "",
    ]

    def conv(p: dict[str, Any]) -> str:
        if p["divergence"] is None:
            return "-"
        if p["converged"]:
            return "yes"
        missing, extra, different = p["divergence"]
        return f"NO: {missing} missing, {extra} extra, {different} different"

    def runs(p: dict[str, Any]) -> str:
        parts = []
        for outcome in ("done", "failed"):
            by = ", ".join(
                f"{k.split(' ', 1)[1]} {v}"
                for k, v in sorted(p["job_actions"].items())
                if v and k.startswith(outcome + " ")
            )
            parts.append(f"{outcome} {p['job_runs'].get(outcome, 0)}" + (f" ({by})" if by else ""))
        return ", ".join(parts)

    rows = [
        ("", "lockstep", "naive"),
        ("seconds", lambda p: _f(p["seconds"])),
        ("job runs", runs),
        ("deadlocks (pg_stat_database)", lambda p: str(p["deadlocks"])),
        ("FK errors (23503)", lambda p: str(p["fk_errors"])),
        ("job errors", lambda p: _errors(p["job_errors"])),
        ("app transactions", lambda p: str(p["app_transactions"])),
        ("app errors", lambda p: _errors(p["app_errors"])),
        ("app transaction p99 ms", lambda p: _f(p["app_tx_p99_ms"], "{:.2f}")),
        ("app DELETE n", lambda p: str(p["app_delete_n"])),
        ("app DELETE p50 ms", lambda p: _f(p["app_delete_p50_ms"], "{:.2f}")),
        ("app DELETE p99 ms", lambda p: _f(p["app_delete_p99_ms"], "{:.2f}")),
        ("app DELETE max ms", lambda p: _f(p["app_delete_max_ms"], "{:.2f}")),
        ("exam_key rows written", lambda p: f"{p['rows_written']:,}"),
        ("converged (exam_key = compute)", conv),
    ]
    table = [rows[0]] + [
        (label, fn(ls), fn(nv) if nv else "skipped")
        for label, fn in rows[1:]  # type: ignore[operator]
    ]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    for row in table:
        lines.append(f"  {row[0].ljust(widths[0])}  {row[1].rjust(widths[1])}  {row[2].rjust(widths[2])}")
    lines.append("")
    drained = f"in {_f(ls['drain_seconds'])} s" if ls["drained"] else "NOT drained"
    failures = ls["key_failures"]
    lines.append(f"lockstep: queue drained {drained} after the app stopped; key failures {failures}")
    for note in ls["notes"]:
        lines.append(f"lockstep note: {note}")
    if nv:
        lines.append(
            "naive: the convergence check is taken right after it stopped (no drain); "
            "its failures are the point of the comparison"
        )
    lines.append("")
    if r["ok"]:
        lines.append("OK: lockstep had 0 deadlocks and exam_key converged.")
    else:
        lines.append("FAILED: lockstep " + ("deadlocked" if ls["deadlocks"] else "did not converge") + ".")
    return "\n".join(lines)


def to_json(r: dict[str, Any]) -> str:
    return json.dumps(r, indent=2, default=str)
