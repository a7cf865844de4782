"""A small Python equivalent of PostgreSQL's isolation tester (``src/test/isolation``).

A *spec* names sessions (each one a real psycopg 3 connection, ``autocommit=True``, so ``begin`` and
``commit`` are explicit steps) and steps (SQL text, or a Python callable ``fn(conn)`` run in the
session's own thread). A *permutation* is the order in which steps are sent. ``Spec.run`` sends each step
without waiting for it, then waits until the step either completes or is seen BLOCKED on a lock, and
returns a ``Result`` whose ``trace`` reads like an isolation ``expected/*.out`` file::

    spec = Spec(dsn, setup=["create table t (id int primary key, v text)",
                            "insert into t values (1, 'a'), (2, 'b')"],
                teardown=["drop table t"],
                sessions={"s1": ["set deadlock_timeout = '100ms'"],   # the victim
                          "s2": ["set deadlock_timeout = '10s'"]})
    spec.step("s1begin", "s1", "begin;")
    spec.step("s1up", "s1", "update t set v = 's1' where id = 1;")
    spec.step("s1c", "s1", "commit;")
    spec.step("s2begin", "s2", "begin;")
    spec.step("s2up", "s2", "update t set v = 's2' where id = 1;")
    spec.step("s2c", "s2", "commit;")
    # property: a second writer of the same row waits for the first one's commit
    r = spec.run(["s1begin", "s2begin", "s1up", "s2up", "s1c", "s2c"], step_timeout=10)
    assert r.waited("s2up") and r.blocked_by("s2up") == ["s1"]

gives this ``r.trace``::

    starting permutation: s1begin s2begin s1up s2up s1c s2c
    step s1begin: begin;
    step s2begin: begin;
    step s1up: update t set v = 's1' where id = 1;
    step s2up: update t set v = 's2' where id = 1; <waiting ...>
    step s1c: commit;
    step s2up: <... completed>
    step s2c: commit;

Trace format (stable for a deterministic schedule: no pids, no timings; those are in ``Result.steps``):
- ``step NAME: SQL`` when the step completes at once, ``step NAME: SQL <waiting ...>`` when it blocked,
  then ``step NAME: <... completed>`` when the runner later sees it done;
- result sets as ``col|col`` / ``---+---`` / rows / ``(N rows)`` and a blank line (numbers right-aligned,
  NULL empty, booleans ``t``/``f``); pass ``show_rows=False`` to ``Spec.step`` to hide them;
- errors as ``ERROR:  SQLSTATE: message`` (psql's verbose form, primary message only);
- notices as ``s1: NOTICE:  message``; callable steps as ``step NAME: <python LABEL>``.

Semantics, as in PostgreSQL's isolation tester:
- Blocked means ``pg_blocking_pids(pid)`` (or ``pg_safe_snapshot_blocking_pids(pid)``) of the session's
  backend is non-empty, polled every ``poll`` seconds (2 ms) from a separate observer connection. Nothing
  is ever assumed from elapsed time. A step that neither completes nor blocks within ``step_timeout``
  fails the run (``StepTimeout``, with the trace so far).
- After every step, earlier blocked steps are checked, in the order they were sent. A pending step that
  is no longer blocked is waited for (it is about to complete), so the trace does not depend on timing.
- A step for a session whose previous step is still pending first WAITS for that step (printed as
  ``<... completed>``), up to ``step_timeout``. So a permutation may send ``s1c`` right after a blocked
  ``s1`` step that a deadlock check or a ``lock_timeout`` will end.
- Errors (``psycopg.Error``) are captured with their SQLSTATE and printed; the session goes on (after an
  error inside ``begin``, the next statements fail with 25P02 until a ``rollback`` step). Any other
  exception raised by a callable step fails the run (``IsolationError``).
- At the end (or on failure) steps still running are cancelled (``pg_cancel_backend``, then
  ``pg_terminate_backend``), every session is rolled back and closed, its thread joined and its backend
  seen gone from ``pg_stat_activity``; then the spec's ``teardown`` runs. Sessions are named
  ``application_name = 'isolation/<session>'``, the observer ``'isolation/observer'``.

Deadlock idiom: give the session meant to be the victim ``deadlock_timeout = '100ms'`` and every other
session ``'10s'``. PostgreSQL runs the deadlock check once per lock wait, ``deadlock_timeout`` after the
wait began; so the victim's step should be the one that closes the cycle (it waits last). Then the
victim always gets 40P01 about 100 ms later and the others complete: the outcome and the trace are stable
and the test stays fast. A test that compares its whole trace with an expected file gives the victim
``'1s'`` instead: the trace shows the victim's ``<waiting ...>`` only if the observer sees the wait before
the deadlock check ends it, and 1 s leaves room for a loaded machine (the schedule tests do so).

``wait_for_lock_wait(observer, pid, timeout=...)`` is the same blocked-detection for other tests (for
example a test that starts processes rather than connections).

Expected files, as PostgreSQL's ``expected/*.out``: a schedule test hands its results to the
``expected_trace`` fixture (tests/conftest.py), which compares the whole trace with
``tests/expected/<module>/<test>.out`` (``check_expected``) and fails with a unified diff on any
difference: an unexpected wait, a missing ``<... completed>``, another SQLSTATE, other rows. Run pytest with
``--update-expected`` (or ``LOCKSTEP_UPDATE_EXPECTED=1``) to rewrite the files, then review ``git diff``.
"""

from __future__ import annotations

import difflib
import os
import queue
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg

__all__ = [
    "IsolationError",
    "LockWait",
    "awaited_locks",
    "AwaitedLock",
    "Result",
    "Spec",
    "Step",
    "StepResult",
    "StepTimeout",
    "blocking_pids",
    "check_expected",
    "update_requested",
    "wait_for_lock_wait",
]

POLL = 0.002  # seconds between two looks at pg_blocking_pids
APP_PREFIX = "isolation/"
_CANCEL_GRACE = 2.0  # seconds a cancelled / terminated step gets to return
_CLOSE_GRACE = 5.0  # seconds for a session thread to close its connection and for its backend to go

StepFn = Callable[[psycopg.Connection], Any]

UPDATE_ENV = "LOCKSTEP_UPDATE_EXPECTED"  # set to 1 (or pass pytest --update-expected) to rewrite files

_BLOCKERS_SQL = """
select p, pg_blocking_pids(p), pg_safe_snapshot_blocking_pids(p)
from unnest(%s::int[]) as p
"""


class IsolationError(AssertionError):
    """A permutation could not run as written (timeout, crash of a callable, teardown failure).

    ``result`` holds the partial ``Result`` (its ``trace`` is the trace so far).
    """

    def __init__(self, message: str, result: Result | None = None) -> None:
        super().__init__(message)
        self.result = result


class StepTimeout(IsolationError):
    """A step neither completed nor blocked on a lock within ``step_timeout``."""


# --------------------------------------------------------------------------------------------------
# lock-wait detection, usable on its own


@dataclass(frozen=True)
class LockWait:
    """A backend seen waiting for a lock: its pid and the pids holding or awaiting what it wants."""

    pid: int
    blockers: tuple[int, ...]
    detected_by: str  # "pg_blocking_pids" or "pg_safe_snapshot_blocking_pids"


def blocking_pids(observer: psycopg.Connection, pids: Sequence[int]) -> dict[int, LockWait]:
    """The backends of ``pids`` that are blocked right now (one query, from ``observer``)."""
    found: dict[int, LockWait] = {}
    for pid, heavy, safe in observer.execute(_BLOCKERS_SQL, [list(pids)]).fetchall():
        if heavy:
            found[pid] = LockWait(pid, tuple(heavy), "pg_blocking_pids")
        elif safe:
            found[pid] = LockWait(pid, tuple(safe), "pg_safe_snapshot_blocking_pids")
    return found


_AWAITED_SQL = """
select locktype, coalesce(classid::regclass::text, ''), coalesce(objid, 0),
       database is null or database = 0, mode
from pg_locks where pid = %s and not granted
"""


@dataclass(frozen=True)
class AwaitedLock:
    """A lock a backend is waiting for (a row of pg_locks with ``granted = false``)."""

    locktype: str
    classid: str  # regclass text ('' when not an object lock)
    objid: int
    shared: bool  # a cluster-wide lock (no database)
    mode: str

    @property
    def is_notify_queue(self) -> bool:
        """The lock every committing transaction that sent NOTIFY takes for a moment (PreCommit_Notify:
        AccessExclusiveLock on object pg_database/0 of no database); a wait for it is not an application
        lock wait but the commit of a concurrent notifier."""
        return self.locktype == "object" and self.classid == "pg_database" and self.objid == 0 and self.shared


def awaited_locks(observer: psycopg.Connection, pid: int) -> list[AwaitedLock]:
    """The locks backend ``pid`` is waiting for right now (empty when it waits for none)."""
    return [AwaitedLock(*row) for row in observer.execute(_AWAITED_SQL, [pid]).fetchall()]


def wait_for_lock_wait(
    observer: psycopg.Connection,
    pid: int | None = None,
    *,
    application_name: str | None = None,
    timeout: float = 10.0,
    poll: float = POLL,
    abort_if: Callable[[], bool] | None = None,
) -> LockWait:
    """Wait until a backend is blocked on a lock (``pg_blocking_pids`` non-empty) and return how.

    Give exactly one of ``pid`` or ``application_name`` (the first blocked backend with that name).
    ``observer`` must be an autocommit connection that is not the waiting one. ``abort_if`` is called at
    every poll (say ``lambda: proc.poll() is not None``); when it returns True the wait stops with
    ``RuntimeError``. Raises ``TimeoutError`` after ``timeout`` seconds.
    """
    if (pid is None) == (application_name is None):
        raise ValueError("give exactly one of pid or application_name")
    deadline = time.monotonic() + timeout
    while True:
        if pid is not None:
            pids = [pid]
        else:
            rows = observer.execute(
                "select pid from pg_stat_activity where application_name = %s order by pid",
                [application_name],
            ).fetchall()
            pids = [r[0] for r in rows]
        waits = blocking_pids(observer, pids) if pids else {}
        if waits:
            return waits[min(waits)]
        if abort_if is not None and abort_if():
            raise RuntimeError(f"stopped waiting for a lock wait of {pid or application_name}: abort_if()")
        if time.monotonic() > deadline:
            what = f"pid {pid}" if pid is not None else f"application_name {application_name!r}"
            raise TimeoutError(f"{what} was not seen waiting for a lock within {timeout} s")
        time.sleep(poll)


# --------------------------------------------------------------------------------------------------
# expected files


def update_requested() -> bool:
    """True when the environment asks to rewrite expected files (``LOCKSTEP_UPDATE_EXPECTED=1``)."""
    return os.environ.get(UPDATE_ENV, "").lower() in ("1", "true", "yes")


def check_expected(path: Path, actual: str, *, update: bool = False) -> None:
    """Compare ``actual`` with the contents of ``path``; on a difference raise ``AssertionError`` with a
    unified diff (expected -> actual). With ``update`` the file is (re)written instead and nothing fails.
    A missing file fails too, saying how to create it."""
    __tracebackhide__ = True  # pytest: show the diff, not this function
    if update:
        if not path.exists() or path.read_text() != actual:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(actual)
        return
    if not path.exists():
        raise AssertionError(
            f"no expected file {path}; create it with pytest --update-expected (or {UPDATE_ENV}=1), "
            f"then review it. Actual output:\n{actual}"
        )
    expected = path.read_text()
    if expected == actual:
        return
    diff = difflib.unified_diff(
        expected.splitlines(keepends=True),
        actual.splitlines(keepends=True),
        fromfile=f"{path} (expected)",
        tofile="actual",
    )
    raise AssertionError(
        f"output differs from {path} (rewrite with pytest --update-expected after checking):\n"
        + "".join(diff)
    )


# --------------------------------------------------------------------------------------------------
# spec, steps and results


@dataclass(frozen=True)
class Step:
    """One step of a spec: SQL text or a callable ``fn(conn)`` run in the session's thread."""

    name: str
    session: str
    action: str | StepFn
    label: str  # what the trace prints after "step NAME: "
    show_rows: bool = True


@dataclass(eq=False)
class StepResult:
    """What happened to one step of one permutation (``Result.steps``, in the order steps were sent)."""

    step: Step
    sent_at: float  # seconds since the start of the permutation
    sent_clock: float = field(default_factory=time.monotonic, repr=False)  # time.monotonic() at send
    duration: float | None = None  # seconds from send to completion
    tables: list[tuple[list[str], list[tuple[Any, ...]]]] = field(default_factory=list)
    value: Any = None  # callable: its return value; SQL: rows of the last result set with rows
    error: psycopg.Error | None = None
    crash: BaseException | None = None  # a non-database exception raised by a callable step
    notices: list[str] = field(default_factory=list)
    waited: bool = False
    detected_by: str | None = None
    blocked_by: list[str | int] = field(default_factory=list)  # session names, or pids of outsiders
    waited_at: float | None = None  # seconds after sending when the wait was detected
    done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def name(self) -> str:
        return self.step.name

    @property
    def finished_at(self) -> float | None:
        """Seconds since the start of the permutation when the step completed."""
        return None if self.duration is None else self.sent_at + self.duration

    @property
    def sqlstate(self) -> str | None:
        return None if self.error is None else self.error.sqlstate


class Result:
    """The outcome of ``Spec.run``. Accessors taking a step name describe its last execution."""

    def __init__(self, permutation: Sequence[str]) -> None:
        self.permutation = list(permutation)
        self.steps: list[StepResult] = []
        self.lines: list[str] = [f"starting permutation: {' '.join(permutation)}"]
        self.elapsed: float = 0.0  # seconds for the whole run, setup and teardown included

    @property
    def trace(self) -> str:
        return "\n".join(self.lines) + "\n"

    @property
    def timings(self) -> dict[str, float | None]:
        """Step name -> seconds from send to completion (last execution of each name)."""
        return {s.name: s.duration for s in self.steps}

    def __getitem__(self, name: str) -> StepResult:
        for s in reversed(self.steps):
            if s.name == name:
                return s
        raise KeyError(f"step {name!r} did not run in this permutation")

    def error(self, name: str) -> psycopg.Error | None:
        return self[name].error

    def sqlstate(self, name: str) -> str | None:
        return self[name].sqlstate

    def waited(self, name: str) -> bool:
        return self[name].waited

    def detected_by(self, name: str) -> str | None:
        return self[name].detected_by

    def blocked_by(self, name: str) -> list[str | int]:
        return self[name].blocked_by

    def rows(self, name: str) -> list[tuple[Any, ...]] | None:
        tables = self[name].tables
        return tables[-1][1] if tables else None

    def value(self, name: str) -> Any:
        return self[name].value

    def duration(self, name: str) -> float | None:
        return self[name].duration


class Spec:
    """Sessions (name -> setup statements), steps, and optional spec-level setup / teardown SQL.

    ``setup`` runs on the observer connection before the sessions connect, ``teardown`` after they are
    closed; both run for every permutation, like an isolation spec's ``setup`` / ``teardown`` blocks.
    """

    def __init__(
        self,
        dsn: str,
        sessions: dict[str, Sequence[str]],
        *,
        setup: Sequence[str] = (),
        teardown: Sequence[str] = (),
        poll: float = POLL,
    ) -> None:
        self.dsn = dsn
        self.sessions = {name: list(stmts) for name, stmts in sessions.items()}
        self.setup = list(setup)
        self.teardown = list(teardown)
        self.poll = poll
        self.steps: dict[str, Step] = {}

    def step(
        self,
        name: str,
        session: str,
        action: str | StepFn,
        *,
        label: str | None = None,
        show_rows: bool = True,
    ) -> None:
        """Add a step. ``action``: SQL text (one or more statements) or ``fn(conn) -> value``."""
        if name in self.steps:
            raise ValueError(f"duplicate step name {name!r}")
        if session not in self.sessions:
            raise ValueError(f"step {name!r}: unknown session {session!r}")
        if isinstance(action, str):
            shown = label if label is not None else textwrap.dedent(action).strip()
        else:
            shown = f"<python {label or getattr(action, '__name__', 'callable')}>"
        self.steps[name] = Step(name, session, action, shown, show_rows)

    def run(self, permutation: Sequence[str], step_timeout: float = 10.0) -> Result:
        """Run one permutation (list of step names) and return its ``Result``.

        Raises ``StepTimeout`` / ``IsolationError`` (carrying the partial result) when the permutation
        cannot run as written; sessions are cleaned up either way.
        """
        unknown = [n for n in permutation if n not in self.steps]
        if unknown:
            raise ValueError(f"unknown steps in permutation: {', '.join(unknown)}")
        return _Run(self, [self.steps[n] for n in permutation], step_timeout).execute()


# --------------------------------------------------------------------------------------------------
# the machinery


class _Session:
    """A connection driven by its own thread; the runner hands it one step at a time."""

    def __init__(self, name: str, dsn: str, setup: Sequence[str]) -> None:
        self.name = name
        self.conn = psycopg.connect(
            dsn, autocommit=True, prepare_threshold=None, application_name=APP_PREFIX + name
        )
        self.pid: int = self.conn.info.backend_pid
        self.active: StepResult | None = None  # set by the runner, cleared when the step is reported
        self._current: StepResult | None = None  # what the thread is executing (for notices)
        self._jobs: queue.Queue[StepResult | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=f"isolation-{name}", daemon=True)
        try:
            for stmt in setup:
                self.conn.execute(stmt)
        except BaseException:
            self.conn.close()
            raise
        self.conn.add_notice_handler(self._on_notice)
        self.thread.start()

    def send(self, sr: StepResult) -> None:
        self.active = sr
        self._jobs.put(sr)

    def stop(self) -> None:
        self._jobs.put(None)

    def _on_notice(self, diag: psycopg.errors.Diagnostic) -> None:
        if self._current is not None:
            self._current.notices.append(f"{diag.severity_nonlocalized}:  {diag.message_primary}")

    def _loop(self) -> None:
        try:
            while (sr := self._jobs.get()) is not None:
                self._current = sr
                try:
                    self._execute(sr)
                except psycopg.Error as e:
                    sr.error = e
                except BaseException as e:  # a bug in a callable step: reported by the runner
                    sr.crash = e
                finally:
                    self._current = None
                    sr.duration = time.monotonic() - sr.sent_clock
                    sr.done.set()
        finally:
            try:
                if not self.conn.closed and self.conn.info.transaction_status != 0:  # not IDLE
                    self.conn.execute("rollback")
            except psycopg.Error:
                pass
            finally:
                self.conn.close()

    def _execute(self, sr: StepResult) -> None:
        action = sr.step.action
        if not isinstance(action, str):
            sr.value = action(self.conn)
            return
        with self.conn.cursor() as cur:
            cur.execute(action)
            while True:
                if cur.description is not None:
                    sr.tables.append(([c.name for c in cur.description], cur.fetchall()))
                if not cur.nextset():
                    break
        sr.value = sr.tables[-1][1] if sr.tables else None


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "t" if v else "f"
    return str(v)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float | Decimal) and not isinstance(v, bool)


def format_table(columns: list[str], rows: list[tuple[Any, ...]]) -> list[str]:
    """A result set as the isolation tester prints it (PQprint, aligned, ``|`` separators)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    numeric = [
        bool(rows) and all(r[i] is None or _is_number(r[i]) for r in rows) for i in range(len(columns))
    ]
    out = ["|".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    out.append("+".join("-" * w for w in widths))
    for r in cells:
        out.append(
            "|".join(
                c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric, strict=True)
            ).rstrip()
        )
    out.append(f"({len(rows)} row{'' if len(rows) == 1 else 's'})")
    out.append("")
    return out


class _Run:
    """One permutation of a spec: connects, sends the steps, records the trace, cleans up."""

    def __init__(self, spec: Spec, steps: list[Step], step_timeout: float) -> None:
        self.spec = spec
        self.steps = steps
        self.timeout = step_timeout
        self.result = Result([s.name for s in steps])
        self.observer: psycopg.Connection | None = None
        self.sessions: dict[str, _Session] = {}
        self.waiting: list[StepResult] = []
        self.t0 = time.monotonic()

    # -- driver ------------------------------------------------------------------------------------

    def execute(self) -> Result:
        failure: BaseException | None = None
        try:
            self.observer = psycopg.connect(
                self.spec.dsn,
                autocommit=True,
                prepare_threshold=None,
                application_name=APP_PREFIX + "observer",
            )
            for stmt in self.spec.setup:
                self.observer.execute(stmt)
            for name, setup in self.spec.sessions.items():
                try:
                    self.sessions[name] = _Session(name, self.spec.dsn, setup)
                except psycopg.Error as e:
                    raise IsolationError(f"setup of session {name} failed: {e.sqlstate}: {e}") from e
            for step in self.steps:
                self._run_step(step)
            while self.waiting:
                self._finish(self.waiting[0], "at the end of the permutation")
        except BaseException as e:
            failure = e
        problems = self._teardown()
        self.result.elapsed = time.monotonic() - self.t0
        if failure is not None:
            if isinstance(failure, IsolationError):
                failure.result = self.result
                if problems:
                    failure.args = (failure.args[0] + "\nteardown: " + "; ".join(problems),)
            raise failure
        if problems:
            self._fail("teardown: " + "; ".join(problems))
        return self.result

    def _run_step(self, step: Step) -> None:
        session = self.sessions[step.session]
        if session.active is not None:  # like the isolation tester: wait for the session's last step
            self._finish(session.active, f"before step {step.name} of the same session")
        now = time.monotonic()
        sr = StepResult(step, sent_at=now - self.t0, sent_clock=now)
        self.result.steps.append(sr)
        session.send(sr)
        blocked = not self._settle(sr, now + self.timeout)
        if blocked:
            self.result.lines.append(f"step {step.name}: {step.label} <waiting ...>")
        else:
            self._report(sr, f"step {step.name}: {step.label}")
        for old in list(self.waiting):  # earlier blocked steps, in the order they were sent
            if self._settle(old, time.monotonic() + self.timeout):
                self._report(old, f"step {old.name}: <... completed>")
        if blocked:
            self.waiting.append(sr)

    def _settle(self, sr: StepResult, deadline: float) -> bool:
        """Wait until ``sr`` completes (True) or is seen blocked on a lock (False)."""
        pid = self.sessions[sr.step.session].pid
        while not sr.done.wait(self.spec.poll):
            assert self.observer is not None
            wait = blocking_pids(self.observer, [pid]).get(pid)
            if wait is not None:
                if not sr.waited:
                    sr.waited = True
                    sr.detected_by = wait.detected_by
                    sr.waited_at = time.monotonic() - sr.sent_clock
                    names = {s.pid: s.name for s in self.sessions.values()}
                    sr.blocked_by = [names.get(p, p) for p in wait.blockers]
                return False
            if time.monotonic() > deadline:
                raise StepTimeout(
                    f"step {sr.name} (session {sr.step.session}) neither completed nor blocked on a lock "
                    f"within {self.timeout} s ({self._activity(pid)})\n--- trace so far ---\n"
                    + self.result.trace
                )
        return True

    def _finish(self, sr: StepResult, why: str) -> None:
        """Wait for a pending step to complete (``why`` explains the wait in the failure message)."""
        if not sr.done.wait(self.timeout):
            pid = self.sessions[sr.step.session].pid
            assert self.observer is not None
            wait = blocking_pids(self.observer, [pid]).get(pid)
            names = {s.pid: s.name for s in self.sessions.values()}
            blockers = ", ".join(str(names.get(p, p)) for p in wait.blockers) if wait else "nothing"
            raise StepTimeout(
                f"step {sr.name} (session {sr.step.session}) did not complete within {self.timeout} s "
                f"{why}; blocked by: {blockers} ({self._activity(pid)})\n--- trace so far ---\n"
                + self.result.trace
            )
        self._report(sr, f"step {sr.name}: <... completed>")

    def _report(self, sr: StepResult, header: str) -> None:
        if sr in self.waiting:
            self.waiting.remove(sr)
        session = self.sessions[sr.step.session]
        if session.active is sr:
            session.active = None
        lines = self.result.lines
        lines.append(header)
        lines.extend(f"{sr.step.session}: {n}" for n in sr.notices)
        if sr.crash is not None:
            raise IsolationError(
                f"step {sr.name} raised {sr.crash!r}\n--- trace so far ---\n" + self.result.trace
            ) from sr.crash
        if sr.step.show_rows:
            for columns, rows in sr.tables:
                lines.extend(format_table(columns, rows))
        if sr.error is not None:
            lines.append(f"ERROR:  {sr.error.sqlstate}: {sr.error.diag.message_primary}")

    def _activity(self, pid: int) -> str:
        assert self.observer is not None
        row = self.observer.execute(
            "select state, wait_event_type, wait_event from pg_stat_activity where pid = %s", [pid]
        ).fetchone()
        if row is None:
            return "backend gone"
        return f"state={row[0]}, wait_event_type={row[1]}, wait_event={row[2]}"

    def _fail(self, message: str) -> None:
        raise IsolationError(message + "\n--- trace ---\n" + self.result.trace, self.result)

    # -- teardown ----------------------------------------------------------------------------------

    def _teardown(self) -> list[str]:
        """Cancel what still runs, roll back and close every session, run the spec's teardown."""
        problems: list[str] = []
        obs = self.observer
        sessions = list(self.sessions.values())
        running = [s for s in sessions if s.active is not None and not s.active.done.is_set()]
        for func in ("pg_cancel_backend", "pg_terminate_backend"):
            running = [s for s in running if s.active is not None and not s.active.done.is_set()]
            if not running or obs is None:
                break
            for s in running:
                obs.execute(f"select {func}(%s)", [s.pid])
            for s in running:
                assert s.active is not None
                s.active.done.wait(_CANCEL_GRACE)
        for s in sessions:
            if s.active is not None and not s.active.done.is_set():
                problems.append(f"step {s.active.name} still running after pg_terminate_backend")
            s.stop()
        for s in sessions:
            s.thread.join(_CLOSE_GRACE)
            if s.thread.is_alive():
                problems.append(f"thread of session {s.name} did not stop")
        if obs is None:
            return problems
        try:
            pids = [s.pid for s in sessions]
            deadline = time.monotonic() + _CLOSE_GRACE
            while pids:
                left = obs.execute(
                    "select count(*) from pg_stat_activity where pid = any(%s)", [pids]
                ).fetchone()
                if not left or left[0] == 0:
                    break
                if time.monotonic() > deadline:
                    problems.append(f"{left[0]} session backend(s) still present in pg_stat_activity")
                    break
                time.sleep(self.spec.poll)
            for stmt in self.spec.teardown:
                obs.execute(stmt)
        except psycopg.Error as e:
            problems.append(f"teardown SQL failed: {e.sqlstate}: {e}")
        finally:
            obs.close()
        return problems
