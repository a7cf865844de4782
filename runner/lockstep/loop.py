"""The runner's schedule: ask what is due, run it, sleep until the next due time or until keys are enqueued
(the queue's identity sequence moved). No SQL here."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import psycopg

from lockstep import db
from lockstep.errors import (
    EXIT_SETUP,
    EXIT_UNREACHABLE,
    POOLER_HINT,
    POOLER_SQLSTATES,
    Backoff,
    describe,
    is_transient,
    permanent_hint,
)
from lockstep.status import no_jobs

log = logging.getLogger("lockstep.runner")

DRAIN_LIMIT = 50  # consecutive calls of one job in a tick (outcome done, more) before the others' turn
SHARED_DRAIN = 5  # the same when another job of its lock group is due too: they take turns
SLICE = 0.25  # longest uninterrupted wait, so a signal is noticed quickly
POLL = 0.1  # how often a sleeping runner looks at the queue's sequence (wake-up latency)
VACUUM_EVERY = 10.0  # seconds between two VACUUMs of the queue by a runner that worked meanwhile
BATCH_WAIT = 0.2  # after a worker pass that left no ready keys: let keys gather this long before the next
WARN_EVERY = 600.0  # the same server WARNING (a run not logged, say: every run says it) once in this long
CAPTURE_EVERY = 0.2  # seconds between two captures of the WAL while tables are watched through it
RECHECK = 1.0  # after the sequence moved: look at the schedule every POLL this long (the enqueuer may not
# have committed yet when the sequence moved)


@dataclass
class Options:
    dsn: str | None = None
    jobs: list[str] | None = None
    once: bool = False
    tick: float = 1.0
    listen: bool = True  # wake early when keys are enqueued (--no-listen: every tick only)
    prepare: bool | None = None
    drain_limit: int = DRAIN_LIMIT
    check_interval: str | None = None  # client_connection_check_interval for the runner's sessions
    batch_wait: float = BATCH_WAIT  # seconds between a job's worker passes while keys trickle in
    synchronous_commit: str = "off"  # how each pass commits (db.RUN_SQL)
    capture_every: float = CAPTURE_EVERY  # seconds between two lockstep.capture() calls (WAL watching)


class Metrics:
    """Prometheus counters when prometheus_client is importable and a port is given; no-ops otherwise."""

    def __init__(self, port: int | None = None, host: str = "0.0.0.0"):
        self.enabled = False
        # where the metrics are served (the bound port: --metrics-port 0 picks one)
        self.url: str | None = None
        if port is None:
            return
        try:
            import prometheus_client as p
        except ImportError:
            log.warning("--metrics-port given but prometheus_client is not installed; no metrics")
            return
        self.runs = p.Counter("lockstep_runs", "lockstep.run() calls", ["job", "outcome"])
        self.seconds = p.Histogram("lockstep_run_seconds", "Duration of lockstep.run() calls", ["job"])
        self.depth = p.Gauge("lockstep_queue_depth", "Ready keys queued per job", ["job"])
        self.parked = p.Gauge("lockstep_parked_keys", "Keys set aside after max_attempts failures", ["job"])
        self.retries = p.Counter("lockstep_runner_retries", "Transient errors retried with backoff")
        self.capture_changes = p.Counter(
            "lockstep_capture_changes", "Changes of tables watched through the WAL read by lockstep.capture()"
        )
        self.capture_retained = p.Gauge(
            "lockstep_capture_retained_bytes", "WAL held by the capture's replication slot"
        )
        self.last_tick = p.Gauge(
            "lockstep_runner_last_tick_seconds", "Unix time of the runner's last look at what is due"
        )
        server = p.start_http_server(port, addr=host)
        if isinstance(server, tuple):  # prometheus_client >= 0.17 returns (server, thread)
            port = server[0].server_port
        self.url = f"http://{host}:{port}/metrics"
        self.enabled = True

    def run(self, job: str, outcome: str, seconds: float) -> None:
        if self.enabled:
            self.runs.labels(job, outcome).inc()
            self.seconds.labels(job).observe(seconds)

    def retry(self) -> None:
        if self.enabled:
            self.retries.inc()

    def capture(self, c: db.Capture) -> None:
        if self.enabled:
            self.capture_changes.inc(c.changes)
            if c.retained_bytes is not None:
                self.capture_retained.set(c.retained_bytes)

    def tick(self) -> None:
        if self.enabled:
            self.last_tick.set_to_current_time()

    def depths(self, depths: dict[str, tuple[int, int]]) -> None:
        if self.enabled:
            for job, (n, parked) in depths.items():
                self.depth.labels(job).set(n)
                self.parked.labels(job).set(parked)


class UnknownJobs(Exception):
    """--job named jobs that do not exist when the runner starts: a typo retrying cannot fix."""


@dataclass
class _JobError:
    until: float
    backoff: Backoff = field(default_factory=lambda: Backoff(base=1.0, cap=60.0))


class Runner:
    def __init__(self, opts: Options, metrics: Metrics | None = None):
        self.opts = opts
        self.metrics = metrics or Metrics()
        self.conn: psycopg.Connection | None = None
        self.pid: int | None = None
        self.stopping = False
        self.any_failed = False
        self._sequence: str | None = None
        self._mark: int | None = None
        self._recheck_until = 0.0
        self._may_vacuum = False
        self._vacuum_at = time.monotonic()
        self._job_errors: dict[str, _JobError] = {}
        self._depths_at = 0.0
        self._unknown: set[str] = set()
        self._pooler_seen = False  # a prepared statement was lost or doubled: the session is pooled
        self._looked_for_jobs = False  # due() named no job, and this runner said whether any is defined
        self._gather_until: dict[str, float] = {}  # job -> monotonic time its next worker pass may start
        self._announced = False  # the first connection was logged with its host, port, database and user
        self.started = False  # a tick succeeded: from then on every database error is retried
        self._ran = False  # a run went through since the last database error (a backlog's tick is long)
        self._warned: dict[str, float] = {}  # server WARNING text -> when this runner last logged it
        self._capture_at = 0.0  # monotonic time of the last lockstep.capture() call
        self._capture_on = True  # False: the schema has no capture (an older revision)
        self._capture_error: _JobError | None = None
        # captures of a database with a capture slot run on a connection of their own: reading a slot
        # (pg_logical_slot_peek_binary_changes, pg_replication_slot_advance) clears the session's catalog
        # caches and so its cached plans, which the worker's passes would rebuild after every capture
        self._capture_conn: psycopg.Connection | None = None
        self._capture_own = False  # a capture found a slot: the next ones run on self._capture_conn

    # signals -------------------------------------------------------------------------------------------
    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if not self.stopping:
            self.stopping = True
            log.info("%s: finishing the current call, then exiting", name)
            return
        pid, conn = self.pid, self.conn
        log.warning("second signal (%s): cancelling backend %s and exiting", name, pid)
        if conn is not None and not conn.closed:
            try:
                db.cancel(conn)
            except Exception as exc:  # noqa: BLE001 - best effort on the way out
                log.warning("could not cancel backend %s: %s", pid, describe(exc))
        logging.shutdown()
        os._exit(1)

    # connection ----------------------------------------------------------------------------------------
    def _connect(self) -> None:
        self._close()
        prepare = False if self._pooler_seen else self.opts.prepare
        conn = db.connect(self.opts.dsn, prepare=prepare, check_interval=self.opts.check_interval)
        conn.add_notice_handler(self._server_warning)
        self.conn = conn
        self.pid = db.backend_pid(conn)
        self._may_vacuum = db.may_vacuum_queue(conn)
        if not self._may_vacuum and db.lockstep_installed(conn):  # no schema: the error that follows says so
            log.info("not the queue's owner: autovacuum alone cleans lockstep.queue")
        self._sequence = None
        if self.opts.listen and not self.opts.once:
            try:
                sequence = db.queue_sequence(conn)
                if sequence is not None:
                    db.queue_mark(conn, sequence)
                    self._sequence = sequence
            except psycopg.errors.InsufficientPrivilege as exc:
                log.warning("cannot read the queue's sequence (%s); waking every --tick only", describe(exc))
        if (
            not self._announced
        ):  # the server, database and user libpq really chose (PG* variables, service...)
            self._announced = True
            info = conn.info
            log.info(
                "connected to host %s port %s database %s as user %s (backend pid %s)",
                info.host,
                info.port,
                info.dbname,
                info.user,
                self.pid,
                extra={
                    "fields": {"host": info.host, "port": info.port, "dbname": info.dbname, "user": info.user}
                },
            )
        log.debug("connected: backend pid %s, database %s", self.pid, conn.info.dbname)

    def _server_warning(self, diag: Any) -> None:  # psycopg.errors.Diagnostic
        """The server's WARNINGs reach the runner's log, each text at most once per WARN_EVERY: a run whose
        history it may not write said so only to the server log."""
        if diag.severity_nonlocalized != "WARNING" or diag.message_primary is None:
            return
        if (diag.sqlstate or "").startswith("57P"):  # "terminating connection due to ... shutdown": the
            return  # connection error that follows is logged, once (the restart tests count the lines)
        now = time.monotonic()
        last = self._warned.get(diag.message_primary)
        if last is None or now - last >= WARN_EVERY:
            self._warned[diag.message_primary] = now
            hint = f" (hint: {diag.message_hint})" if diag.message_hint else ""
            log.warning("server: %s%s", diag.message_primary, hint)

    def _close(self) -> None:
        for conn in (self.conn, self._capture_conn):
            if conn is not None:
                try:
                    conn.close()
                except Exception:  # noqa: BLE001 - a broken connection may fail to close cleanly
                    pass
        self.conn, self.pid, self._capture_conn = None, None, None

    def _capturing_conn(self) -> psycopg.Connection:
        """The connection captures run on: the runner's own until a capture found a slot, then one of their
        own (opened again if it broke)."""
        assert self.conn is not None
        if not self._capture_own:
            return self.conn
        conn = self._capture_conn
        if conn is None or conn.closed or conn.broken:
            prepare = False if self._pooler_seen else self.opts.prepare
            conn = db.connect(self.opts.dsn, prepare=prepare, check_interval=self.opts.check_interval)
            conn.add_notice_handler(self._server_warning)
            self._capture_conn = conn
            log.debug("capture: own connection, backend pid %s", db.backend_pid(conn))
        return conn

    # main loops ----------------------------------------------------------------------------------------
    def run(self) -> int:
        return self.run_once() if self.opts.once else self.run_forever()

    def run_once(self) -> int:
        """Run what is due now (draining queues): 0 if all went well, 1 if a run failed, 3 if no server
        answered at start-up, 4 on a permanent start-up error (missing database, role or schema...)."""
        try:
            self._connect()
        except psycopg.OperationalError as exc:
            self._close()
            if self._refuse_to_start(exc):
                return EXIT_SETUP
            log.error("cannot connect: %s", describe(exc))
            return EXIT_UNREACHABLE
        try:
            for _ in range(1000):
                if self.stopping or not self._tick(sleep=False):
                    break
        except UnknownJobs:
            return EXIT_SETUP
        except psycopg.Error as exc:
            if self._refuse_to_start(exc):
                return EXIT_SETUP
            log.error("database error: %s", describe(exc))
            return 1
        finally:
            self._close()
        return 1 if self.any_failed else 0

    def _pooled(self, exc: psycopg.Error) -> None:
        """A prepared statement lost or doubled: the session is shared behind a transaction pooler, so
        the runner stops preparing statements on this connection (it kept retrying, and drained about 14
        times slower), unless --prepare was asked for."""
        conn = self.conn
        if (
            getattr(exc, "sqlstate", None) in POOLER_SQLSTATES
            and self.opts.prepare is None
            and conn is not None
            and not conn.closed
            and conn.prepare_threshold is not None
        ):
            conn.prepare_threshold = None
            self._pooler_seen = True  # and on the connections after it
            log.warning("prepared statements turned off: %s", POOLER_HINT)

    def _refuse_to_start(self, exc: psycopg.Error) -> bool:
        """Before the first good tick, an error retrying cannot fix: log it with its hint, True."""
        hint = None if self.started else permanent_hint(exc)
        if hint is None:
            return False
        log.error("cannot start: %s; hint: %s", describe(exc), hint, extra={"fields": {"hint": hint}})
        return True

    def run_forever(self) -> int:
        backoff = Backoff()
        trouble: str | None = None
        while not self.stopping:
            try:
                if self.conn is None or self.conn.closed or self.conn.broken:
                    self._connect()
                self._tick(sleep=True)
                self.started = True
                if trouble is not None:
                    log.info(
                        "recovered after %s retr%s; backend pid %s",
                        backoff.attempt,
                        "y" if backoff.attempt == 1 else "ies",
                        self.pid,
                    )
                    trouble = None
                    backoff.reset()
            except UnknownJobs:
                self._close()
                return EXIT_SETUP
            except psycopg.Error as exc:
                if self._refuse_to_start(exc):
                    self._close()
                    return EXIT_SETUP
                if self._ran and trouble is not None:
                    # runs went through since the last error: this is a new error, not the same one
                    # lasting, so the pause starts again from the shortest (a tick that drains a backlog
                    # may never end between two connection losses, and the pauses grew to seconds)
                    log.info(
                        "recovered after %s retr%s", backoff.attempt, "y" if backoff.attempt == 1 else "ies"
                    )
                    trouble = None
                    backoff.reset()
                self._ran = False
                self._pooled(exc)
                if trouble is None:
                    trouble = describe(exc)
                    log.warning("%s; retrying with backoff", trouble)
                else:
                    log.debug("still failing: %s", describe(exc))
                self.metrics.retry()
                if self.conn is not None and (self.conn.broken or self.conn.closed):
                    self._close()
                self._sleep(backoff.next())
        self._close()
        log.info("stopped")
        return 0

    # one tick ------------------------------------------------------------------------------------------
    def _tick(self, sleep: bool) -> bool:
        """Run every job due now; then (if nothing happened and ``sleep``) wait. True if a run did work."""
        assert self.conn is not None
        if self._sequence is not None:
            self._mark = db.queue_mark(self.conn, self._sequence)  # before due(): later keys wake us
        self._capture()
        rows = db.due(self.conn, self.opts.jobs, self.opts.batch_wait if sleep else 0.0)
        self.metrics.tick()
        if self.opts.jobs:
            self._check_known(rows)
        elif not rows and not self._looked_for_jobs:
            # a runner that is not a member of the jobs' owner roles sees none of them and ran nothing,
            # exit 0, without a word; no job defined at all is no problem
            defined = db.job_count(self.conn)
            if defined:
                log.warning("%s job(s) defined, but %s", defined, no_jobs(self.conn.info.user))
        self._looked_for_jobs = not rows
        now = time.monotonic()
        progressed = False
        gathering: list[float] = []
        # jobs of one lock group exclude each other: while one drains its queue the others are busy, so
        # they take turns: a job draining a large hand-off would hold its siblings up for its whole drain
        groups = Counter(r.lock_group for r in rows if r.wait is not None and r.wait <= 0)
        for row in rows:
            if self.stopping:
                return progressed
            if row.wait is None:
                continue
            if row.wait > 0:
                # lockstep.due() keeps the --batch-wait window of the job's last pass, whichever runner
                # made it; after this runner's own pass, new keys need not wake it before the window ends
                own_window = self._gather_until.get(row.job, 0.0) > now
                if sleep and own_window and row.wait <= self.opts.batch_wait:
                    gathering.append(row.wait)
                continue
            held = self._job_errors.get(row.job)
            if held is not None and held.until > now:
                continue
            # due now: run it, whatever this runner's own window says. The window is due()'s, for ready
            # keys only; applied here as well, it held back a periodic recompute, a flag or a retry that
            # came due within --batch-wait of this runner's pass
            shared = groups[row.lock_group] > 1
            progressed |= self._drain(row.job, min(self.opts.drain_limit, SHARED_DRAIN) if shared else None)
        self._update_depths()
        if progressed:
            self._vacuum()
        if progressed or not sleep or self.stopping:
            return progressed
        waits = [r.wait for r in rows if r.wait is not None and r.wait > 0]
        if gathering:  # keys are queued for a job that just ran: wake when its wait ends, not on new keys
            self._sleep(min([self.opts.tick, *waits, *gathering]))
        elif self._sleep(min([self.opts.tick, *waits]), wake=self._sequence is not None):
            self._recheck_until = time.monotonic() + RECHECK
        return False

    def _drain(self, job: str, limit: int | None = None) -> bool:
        """Call lockstep.run(job), again at once while it leaves a backlog (at most ``limit`` times, default
        --drain-limit)."""
        assert self.conn is not None
        progressed = False
        for _ in range(limit or self.opts.drain_limit):
            started = time.monotonic()
            try:
                r = db.run_job(self.conn, job, self.opts.synchronous_commit)
            except psycopg.Error as exc:
                if is_transient(exc):
                    raise
                self._job_error(job, exc)
                return progressed
            elapsed = time.monotonic() - started
            self._ran = True
            self._job_errors.pop(job, None)
            self.metrics.run(job, r.outcome, elapsed)
            if r.outcome in ("done", "failed"):
                progressed = True
                self._log_result(r, elapsed)
            more = r.outcome == "done" and r.more
            if more and r.action == "work" and self.opts.batch_wait > 0 and not self.opts.once:
                # keys are left, but a backlog only if another full batch is ready (lockstep._work): the
                # rest of a steady load's window gathers with the keys that arrive, for one full pass, not
                # a small pass at once after every full one (bench oltp: half its passes were such)
                due = db.due(self.conn, [job], self.opts.batch_wait)
                more = any(d.job == job and d.wait is not None and d.wait <= 0 for d in due)
            if r.outcome == "done" and r.action == "work" and not more:
                # the queue was drained: the keys that arrive meanwhile gather for one larger pass
                self._gather_until[job] = started + self.opts.batch_wait
            if r.outcome == "failed":
                self.any_failed = True
            if not more or self.stopping:
                break
        return progressed

    def _capture(self) -> bool:
        """Call lockstep.capture() (the WAL's changes of watched tables into the queue), at most once per
        --capture-every, until it says idle; True if it queued or flagged something. A non-transient error
        (the role lacks REPLICATION, say) is logged and retried with backoff, like a job's."""
        now = time.monotonic()
        if not self._capture_on or self.conn is None or now - self._capture_at < self.opts.capture_every:
            return False
        held = self._capture_error
        if held is not None and held.until > now:
            return False
        self._capture_at = now
        try:
            c = db.capture(self._capturing_conn())
        except psycopg.Error as exc:
            if is_transient(exc) or (
                not self.started and getattr(exc, "sqlstate", None) in ("3F000", "42P01")
            ):
                raise  # at start-up, no lockstep schema is the runner's own error: exit 4, in one line
            self.any_failed = True
            if held is None:
                held = self._capture_error = _JobError(until=0.0)
                log.error("capture: %s; retrying with backoff", describe(exc))
            held.until = time.monotonic() + held.backoff.next()
            return False
        self._capture_error = None
        self._capture_own = self._capture_own or c.retained_bytes is not None  # a slot: its own connection
        if c.outcome == "absent":
            self._capture_on = False
            return False
        self.metrics.capture(c)
        if c.outcome == "done":
            self._ran = True
            log.debug(
                "capture: %s change(s), %s key(s) queued, %s job(s) flagged", c.changes, c.keys, c.flagged
            )
        return c.outcome == "done"

    def _check_known(self, rows: list[db.Due]) -> None:
        """--job names that are not jobs at start-up: UnknownJobs after one error line naming the jobs there
        are (exit 4); dropped since: one error line each, and --once then exits 1."""
        assert self.opts.jobs is not None and self.conn is not None
        missing = set(self.opts.jobs) - {r.job for r in rows}
        if missing and not self.started:
            names = db.job_names(self.conn)
            there = (
                f"the jobs are: {', '.join(names)}" if names else "no job is defined (that this role sees)"
            )
            log.error(
                "cannot start: no job %s (--job); hint: %s",
                ", ".join(sorted(missing)),
                there,
                extra={"fields": {"hint": there}},
            )
            raise UnknownJobs(sorted(missing))
        for job in sorted(missing - self._unknown):
            log.error("job %s does not exist (lockstep.job); skipping it", job)
        self._unknown = missing
        if missing:
            self.any_failed = True

    def _job_error(self, job: str, exc: psycopg.Error) -> None:
        """A non-transient error calling one job (dropped meanwhile, permissions...): skip it for a while."""
        self.any_failed = True
        held = self._job_errors.get(job)
        if held is None:
            held = self._job_errors[job] = _JobError(until=0.0)
            log.error("job %s: %s; skipping it with backoff", job, describe(exc))
        held.until = time.monotonic() + held.backoff.next()

    def _log_result(self, r: db.Result, seconds: float) -> None:
        fields = {
            "job": r.job,
            "action": r.action,
            "outcome": r.outcome,
            "inserted": r.inserted,
            "updated": r.updated,
            "deleted": r.deleted,
            "skipped": r.skipped,
            "compute_ms": round(r.compute_ms or 0, 1),
            "write_ms": round(r.write_ms or 0, 1),
            "ms": round(seconds * 1000, 1),
            "more": r.more,
        }
        if r.outcome == "failed":
            fields["error"] = r.error
            log.warning(
                "%s %s failed after %.1f ms: %s",
                r.job,
                r.action,
                seconds * 1000,
                r.error,
                extra={"fields": fields},
            )
        elif r.action == "call":  # a generic job: no rows counted (they read +0 ~0 -0)
            log.info("%s call done in %.1f ms", r.job, fields["ms"], extra={"fields": fields})
        else:
            log.info(
                "%s %s done: +%d ~%d -%d skipped %d (compute %.1f ms, write %.1f ms, total %.1f ms)",
                r.job,
                r.action,
                r.inserted,
                r.updated,
                r.deleted,
                r.skipped,
                fields["compute_ms"],
                fields["write_ms"],
                fields["ms"],
                extra={"fields": fields},
            )
            if r.error:  # done, but some keys failed (isolated, retried, parked) or the recompute handed off
                fields["error"] = r.error
                log.warning("%s %s: %s", r.job, r.action, r.error, extra={"fields": fields})

    def _vacuum(self) -> None:
        """Every VACUUM_EVERY seconds of work, VACUUM the queue: it churns (every pass deletes what it
        processed) faster than autovacuum visits it (at most once per autovacuum_naptime, or never)."""
        if self._may_vacuum and self.conn is not None and time.monotonic() - self._vacuum_at > VACUUM_EVERY:
            self._vacuum_at = time.monotonic()
            db.vacuum_queue(self.conn)

    def _update_depths(self) -> None:
        if self.metrics.enabled and self.conn is not None and time.monotonic() - self._depths_at > 5:
            self._depths_at = time.monotonic()
            self.metrics.depths(db.queue_depths(self.conn))

    def _sleep(self, seconds: float, wake: bool = False) -> bool:
        """Sleep up to ``seconds``, in slices so a signal is noticed. With ``wake``, look at the queue's
        sequence every POLL seconds and return True as soon as it moved (keys were enqueued): a query on the
        runner's own connection, nothing the application pays for. Shortly after such a wake, sleep at most
        POLL (the enqueuing transaction may commit a little later than its keys took their ids)."""
        deadline = time.monotonic() + seconds
        if wake and time.monotonic() < self._recheck_until:
            deadline = min(deadline, time.monotonic() + POLL)
        while not self.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if wake and self.conn is not None and self._sequence is not None:
                time.sleep(min(left, POLL))
                if self._capture():  # keys of the WAL's changes queued: look at what is due
                    return True
                mark = db.queue_mark(self.conn, self._sequence)
                if mark != self._mark:
                    self._mark = mark
                    return True
            else:
                time.sleep(min(left, SLICE))
        return False


def run(opts: Options, metrics: Metrics | None = None) -> int:
    runner = Runner(opts, metrics)
    runner.install_signals()
    return runner.run()
