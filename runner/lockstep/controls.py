"""Operator controls behind ``lockstep diff`` and ``lockstep backfill`` (docs/controls.md): the preview's
summary, and a backfill that runs a recompute and its hand-off to the end while it shows its progress."""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

import psycopg

from lockstep import db

log = logging.getLogger("lockstep.controls")

ACTIONS = ("insert", "update", "delete")
BUSY_WAIT = 0.2  # seconds between two tries while another runner holds the job's lock group
LINE_EVERY = 1.0  # seconds between two plain progress lines


# lockstep diff ---------------------------------------------------------------------------------------------


def summary(rows: list[tuple[str, str, int]], limit: int) -> dict[str, Any]:
    """The preview's totals (parents and rows per action) and at most ``limit`` example rows per action."""
    out: dict[str, Any] = {"parents": len({k for k, _, _ in rows}), "actions": {}}
    for action in ACTIONS:
        mine = [(k, n) for k, a, n in rows if a == action]
        out["actions"][action] = {
            "parents": len(mine),
            "rows": sum(n for _, n in mine),
            "examples": [{"key": k, "rows": n} for k, n in mine[:limit]],
        }
    return out


def summary_text(job: str, s: dict[str, Any], keys: list[str] | None = None) -> str:
    """``lockstep diff``'s text: a line of totals, then one per action with its examples. ``keys``: the
    parents of ``--keys`` (a worker pass over them), else None (a recompute)."""
    if s["parents"] == 0 and keys is not None:
        return f"{job}: no difference: a worker pass over these {len(keys)} parent(s) would write nothing"
    if s["parents"] == 0:
        return f"{job}: no difference: a recompute now would write nothing"
    lines = [f"{job}: {s['parents']} parent(s) would change (nothing was written)"]
    for action in ACTIONS:
        a = s["actions"][action]
        if not a["parents"]:
            continue
        shown = ", ".join(f"{e['key']} ({e['rows']})" for e in a["examples"])
        more = a["parents"] - len(a["examples"])
        lines.append(
            f"  {action}: {a['rows']} row(s) of {a['parents']} parent(s)"
            + (f"; e.g. {shown}" if shown else "")
            + (f" and {more} more" if more > 0 else "")
        )
    return "\n".join(lines)


# lockstep backfill -----------------------------------------------------------------------------------------


@dataclass
class Progress:
    """Where a backfill stands: parents of the recompute written, and how many it changed in all."""

    done: int = 0
    total: int = 0
    passes: int = 0
    rows: int = 0  # target rows written (inserted, updated, deleted)
    started: float = field(default_factory=time.monotonic)

    @property
    def todo(self) -> int:
        return max(self.total - self.done, 0)

    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.done / elapsed if elapsed > 0 else 0.0

    def eta(self) -> float | None:
        rate = self.rate()
        return self.todo / rate if rate > 0 else None

    def add(self, r: db.Result) -> None:
        """Count a run that did something."""
        if r.outcome == "done":
            self.passes += 1
            self.rows += (r.inserted or 0) + (r.updated or 0) + (r.deleted or 0)

    def line(self) -> str:
        if self.total == 0:  # nothing handed off: the whole difference was one batch
            return f"the whole difference in one pass: {self.rows} rows written"
        eta = self.eta()
        return (
            f"{self.done}/{self.total} parents done, {self.todo} to do, {self.rate():.0f} parents/s,"
            f" ETA {'-' if eta is None else f'{eta:.0f} s'} ({self.rows} rows, {passes(self.passes)})"
        )

    def summary(self) -> str:
        """The end of a converged backfill: the parents of its hand-off, or the rows of its one batch."""
        if self.total == 0:
            return f"{self.rows} rows written in {passes(self.passes)}"
        return f"{self.done} parents in {passes(self.passes)}"


def passes(n: int) -> str:
    return f"{n} pass" if n == 1 else f"{n} passes"


@dataclass
class Outcome:
    """How a backfill ended: ``done`` (converged), ``interrupted`` (Ctrl-C, between batches), ``paused``,
    ``failed`` (with the run's error) or ``backoff`` (the job's failure backoff holds its passes)."""

    state: str
    progress: Progress
    error: str | None = None


class Stopper:
    """SIGINT (Ctrl-C) and SIGTERM ask to stop; the backfill looks between two batches, so the batch being
    written commits whole and the rest stays queued for the runner."""

    def __init__(self) -> None:
        self.stopping = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Stopper:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopping = True


def _refresh(conn: psycopg.Connection, job: str, p: Progress) -> None:
    """The recompute's progress (lockstep.status); once the hand-off is worked off, every parent is done."""
    done, total, _depth, _paused = db.progress(conn, job)
    if total is not None:
        p.total = max(p.total, int(total))
        p.done = int(done or 0)
    else:
        p.done = p.total


def backfill(
    conn: psycopg.Connection, job: str, stopper: Stopper, report: Callable[[Progress], None]
) -> Outcome:
    """Recompute ``job`` now, then run its passes (lockstep.run) until the hand-off is worked off and nothing
    is left to do. ``report`` is called after every pass."""
    p = Progress()
    r = db.recompute(conn, job)
    while r.outcome == "busy":  # another run of its lock group: the recompute waits its turn
        if stopper.stopping:
            return Outcome("interrupted", p)
        time.sleep(BUSY_WAIT)
        r = db.recompute(conn, job)
    if r.outcome in ("paused", "failed"):
        return Outcome(r.outcome, p, r.error)
    p.add(r)
    _refresh(conn, job, p)
    report(p)
    while not stopper.stopping:
        if r.outcome == "busy":
            time.sleep(BUSY_WAIT)
        r = db.run_job(conn, job)
        if r.outcome in ("paused", "failed"):
            return Outcome(r.outcome, p, r.error)
        p.add(r)
        _refresh(conn, job, p)
        report(p)
        if r.outcome in ("idle", "not_due", "backoff") and p.todo == 0:
            return Outcome("done", p)
        if r.outcome == "backoff":
            return Outcome("backoff", p, "the job is in its failure backoff: lockstep status shows its error")
        if r.outcome == "not_due":  # keys deferred a second (a parent held by the application)
            time.sleep(BUSY_WAIT)
    return Outcome("interrupted", p)


def reporter(stream: TextIO, job: str) -> tuple[Callable[[Progress], None], Callable[[], None]]:
    """(report, close): a rich progress bar on a terminal, else a plain line at most every LINE_EVERY s."""
    if stream.isatty():
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeRemainingColumn,
        )
        from rich.progress import (
            Progress as Bar,
        )

        bar = Bar(
            TextColumn(f"backfill {job}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("parents · {task.fields[rate]:.0f}/s"),
            TimeRemainingColumn(),
            console=Console(file=stream),
        )
        task = bar.add_task(job, total=None, rate=0.0)
        bar.start()

        def report_bar(p: Progress) -> None:
            bar.update(task, completed=p.done, total=p.total or None, rate=p.rate())

        return report_bar, bar.stop
    last: dict[str, Any] = {"at": 0.0, "done": None}

    def report_line(p: Progress) -> None:
        now = time.monotonic()
        if (now - last["at"] >= LINE_EVERY or p.todo == 0) and p.done != last["done"]:
            last.update(at=now, done=p.done)
            print(f"backfill {job}: {p.line()}", file=stream, flush=True)

    return report_line, lambda: None


def run_backfill(conn: psycopg.Connection, job: str, stream: TextIO = sys.stdout) -> Outcome:
    """``lockstep backfill``: the backfill with its progress on ``stream``, stopping cleanly on Ctrl-C."""
    report, close = reporter(stream, job)
    try:
        with Stopper() as stopper:
            return backfill(conn, job, stopper, report)
    finally:
        close()
