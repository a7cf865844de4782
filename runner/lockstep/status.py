"""``lockstep status``: the lockstep.status view as a table or JSON, and the exit code it implies."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import shlex

TABLE_COLUMNS = (
    "job",
    "kind",
    "queue_depth",
    "queue_lag",  # how long ago the oldest queue entry (a failing or parked key's too) was enqueued
    "parked_keys",
    "failing_keys",
    "last_outcome",
    "last_action",
    "last_finished_at",
    "last_duration_ms",
    "consecutive_failures",
    "next_run_at",
    "runs",
    "recompute",  # done/total parents of a recompute spread over several transactions
    "needs_recompute",
    "last_error",
    "recompute_error",  # the last full recompute's error, until one succeeds (a good worker pass keeps it)
    "paused_at",  # lockstep.pause: since when (by paused_by); its lag is shown, not alarmed
)


def jsonable(value):
    """Datetimes as ISO 8601, intervals as seconds, numerics as floats; the rest as is."""
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return float(value)
    return value


def to_json(rows: list[dict]) -> str:
    return json.dumps([{k: jsonable(v) for k, v in r.items()} for r in rows], indent=2)


MAX_LAG = 900.0  # seconds: a queued key older than this makes ``lockstep status`` unhealthy (--max-lag)
MAX_STALL = (
    120.0  # seconds: a key a worker pass should take, ready longer than this, is stalled (--max-stall)
)
MAX_STALL_PASSES = 10  # worker passes that left such a key in the queue (--max-stall-passes)


def _lagging(r: dict, max_lag: float | None) -> bool:
    lag = r.get("queue_lag")
    return bool(max_lag) and isinstance(lag, dt.timedelta) and lag.total_seconds() > max_lag


def _paused(r: dict) -> bool:
    """Paused by an operator (lockstep.pause): its queue waits on purpose, and resume flags its recompute."""
    return r.get("paused_at") is not None


def _flagged(r: dict) -> bool:
    return r.get("needs_recompute") is not None and not _paused(r)


def stalled(r: dict, max_stall: float | None, max_passes: int | None) -> str | None:
    """Why the job's oldest key a worker pass should take counts as stalled (lockstep.status stalled_for,
    stalled_passes), or None; a paused job's queue waits on purpose."""
    waited = r.get("stalled_for")
    passes = r.get("stalled_passes") or 0
    if _paused(r):
        return None
    if max_passes and passes >= max_passes:
        return f"a ready queued key was left by {passes} worker passes (--max-stall-passes {max_passes})"
    if max_stall and isinstance(waited, dt.timedelta) and waited.total_seconds() > max_stall:
        return (
            f"a ready queued key no worker pass took waits {waited.total_seconds():.0f} s"
            f" (--max-stall {max_stall:g})"
        )
    return None


def reasons(
    rows: list[dict],
    max_lag: float | None = MAX_LAG,
    max_stall: float | None = MAX_STALL,
    max_stall_passes: int | None = MAX_STALL_PASSES,
) -> list[str]:
    """Why each unhealthy job is (one line each, for ``lockstep status``'s stderr: an exit 1 with only the
    table left the reader to find the column that made it)."""
    out = []
    for r in rows:
        why = []
        if (r.get("consecutive_failures") or 0) > 0:
            why.append(f"{r['consecutive_failures']} consecutive failure(s)")
        if r.get("recompute_error") is not None:  # a generic job's call keeps its error there too
            why.append("its last call failed" if r.get("kind") == "job" else "its last full recompute failed")
        if (r.get("parked_keys") or 0) > 0:
            why.append(f"{r['parked_keys']} parked key(s) (lockstep.parked_keys; lockstep retry)")
        if _flagged(r) and r.get("recompute_held_since") is not None:
            why.append(
                "flagged for a full recompute, held since a recompute met poison parents"
                f" ({r['recompute_held_since']}; its error names one): once they are fixed,"
                f" `lockstep retry {shlex.quote(str(r.get('job')))}`"
            )
        elif _flagged(r):
            # the problem itself (a newly watched table is no trigger failure: the line said it was)
            why.append(f"flagged for a full recompute ({r.get('trigger_problem') or 'see trigger_problem'})")
        if _lagging(r, max_lag) and not _paused(r):
            why.append(
                f"oldest queued key waits {r['queue_lag'].total_seconds():.0f} s (--max-lag {max_lag:g})"
            )
        stall = stalled(r, max_stall, max_stall_passes)
        if stall:
            why.append(stall)
        if why:
            out.append(f"unhealthy: job {r.get('job')}: " + "; ".join(why))
    return out


def unhealthy(
    rows: list[dict],
    max_lag: float | None = MAX_LAG,
    max_stall: float | None = MAX_STALL,
    max_stall_passes: int | None = MAX_STALL_PASSES,
) -> bool:
    """Any job failing (consecutive_failures > 0, or its last full recompute: recompute_error), with parked
    keys, flagged for a full recompute
    (``needs_recompute`` set: a trigger could not enqueue), or whose oldest queued key waits longer than
    ``max_lag`` seconds (nothing drains its queue; None or 0: not checked), or whose oldest key a worker
    pass should take has stayed ready longer than ``max_stall`` seconds or through ``max_stall_passes``
    worker passes (a stall: lockstep.status stalled_for, stalled_passes; None or 0: not checked). A paused
    job's lag, flags and stalls are not alarmed (lockstep.pause): they wait on purpose."""
    return any(
        (r.get("consecutive_failures") or 0) > 0
        or r.get("recompute_error") is not None
        or (r.get("parked_keys") or 0) > 0
        or _flagged(r)
        or (_lagging(r, max_lag) and not _paused(r))
        or stalled(r, max_stall, max_stall_passes) is not None
        for r in rows
    )


def exit_code(
    rows: list[dict],
    max_lag: float | None = MAX_LAG,
    max_stall: float | None = MAX_STALL,
    max_stall_passes: int | None = MAX_STALL_PASSES,
) -> int:
    """``lockstep status``'s exit code for these rows: 0 healthy, 1 unhealthy (lockstep.errors.EXIT_*).

    The other codes come before any row is read: 2 usage error, 3 no server answered, 4 permanent
    setup error (database, role or lockstep schema missing...).
    """
    from lockstep.errors import EXIT_OK, EXIT_UNHEALTHY

    return EXIT_UNHEALTHY if unhealthy(rows, max_lag, max_stall, max_stall_passes) else EXIT_OK


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, dt.datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, float):
        return f"{value:.1f}"
    if isinstance(value, dt.timedelta):
        return f"{value.total_seconds():.1f} s"
    text = " ".join(str(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def _progress(r: dict) -> str | None:
    """'done/total' while a recompute is spread over several transactions (lockstep.status), else None."""
    if r.get("recompute_total") is None:
        return None
    return f"{r.get('recompute_done')}/{r['recompute_total']}"


def no_jobs(user: str) -> str:
    """What an empty status says: which role sees no job, and why that may be (a runner that is not a
    member of a job's owner role sees none of its jobs: its health check said "no jobs" and exited 0)."""
    return (
        f"no jobs visible to role {user} (a role sees the jobs of the owner roles it is a member of, and an"
        " admin sees all: docs/security.md)"
    )


# The default table: one line per job within WIDTH columns; every column is in --wide and --json.
WIDTH = 100
JOB_WIDTH = 24


def _short(seconds: float) -> str:
    """A duration in one short word: 45s, 12m, 3h, 2d."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{max(seconds, 0):.0f}s"


def _job_cell(job: str) -> str:
    """A job name within JOB_WIDTH: its start and its end around a ``~``, so that two long names that differ
    only at the end (``..._region_a``, ``..._region_b``) stay apart."""
    if len(job) <= JOB_WIDTH:
        return job
    tail = JOB_WIDTH // 2
    return job[: JOB_WIDTH - tail - 1] + "~" + job[-tail:]


def _compact(r: dict, now: dt.datetime) -> list[str]:
    job = str(r.get("job"))
    lag = r.get("queue_lag")
    finished = r.get("last_finished_at")
    last = " ".join(str(r[c]) for c in ("last_outcome", "last_action") if r.get(c) is not None) or "-"
    if _paused(r):
        last = f"paused, {last}"
    progress = _progress(r)
    return [
        _job_cell(job),
        str(r.get("kind") or "-")[:7],
        _cell(r.get("queue_depth")),
        _short(lag.total_seconds()) if isinstance(lag, dt.timedelta) else "-",
        _cell(r.get("parked_keys")),
        _cell(r.get("failing_keys")),
        (last if progress is None else f"{last} {progress}")[:24],
        _short((now - finished).total_seconds()) if isinstance(finished, dt.datetime) else "-",
    ]


def compact_table(rows: list[dict], empty: str = "no jobs", now: dt.datetime | None = None) -> str:
    """``lockstep status``: job, kind, queue depth, oldest queued key's age, parked and failing keys, the
    last run (outcome, action, a spread recompute's progress) and how long ago it finished; at most WIDTH
    columns. The errors and every other column: --wide, --json."""
    if not rows:
        return empty
    now = now or dt.datetime.now(dt.UTC)
    columns = ("job", "kind", "queue", "lag", "parked", "failing", "last", "ago")
    return _render(columns, [_compact(r, now) for r in rows])


def _render(columns: tuple[str, ...], cells: list[list[str]]) -> str:
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def to_table(rows: list[dict], columns: tuple[str, ...] = TABLE_COLUMNS, empty: str = "no jobs") -> str:
    if not rows:
        return empty
    rows = [{**r, "recompute": _progress(r)} for r in rows]
    return _render(columns, [[_cell(r.get(c)) for c in columns] for r in rows])


# `lockstep status --history`: rows of lockstep.run_log, oldest first
HISTORY_COLUMNS = (
    "finished_at",
    "job",
    "action",
    "outcome",
    "duration_ms",
    "inserted",
    "updated",
    "deleted",
    "skipped",
    "failed_keys",
    "error",
)


def _history_cells(r: dict) -> list[str]:
    job = str(r.get("job"))
    finished = r.get("finished_at")
    duration = r.get("duration_ms")
    written = [r.get(c) for c in ("inserted", "updated", "deleted")]
    return [
        finished.strftime("%m-%d %H:%M:%S") if isinstance(finished, dt.datetime) else "-",
        _job_cell(job),
        " ".join(str(r[c]) for c in ("outcome", "action") if r.get(c) is not None) or "-",
        f"{duration:.0f}" if isinstance(duration, int | float) else "-",
        "-" if None in written else "+{} ~{} -{}".format(*written),
        _cell(r.get("skipped")),
        _cell(r.get("failed_keys")),
    ]


def history_table(rows: list[dict], wide: bool = False) -> str:
    """``lockstep status --history``: one line per run within WIDTH columns; a run's error goes on the
    line below it, cut to WIDTH (``wide``: every column of HISTORY_COLUMNS, on one line)."""
    if wide or not rows:
        return to_table(rows, HISTORY_COLUMNS, empty="no runs in lockstep.run_log")
    columns = ("finished", "job", "run", "ms", "rows", "skipped", "failed")
    header, *lines = _render(columns, [_history_cells(r) for r in rows]).splitlines()
    out = [header]
    for r, line in zip(rows, lines, strict=True):
        out.append(line)
        if r.get("error"):
            error = "  error: " + " ".join(str(r["error"]).split())
            out.append(error if len(error) <= WIDTH else error[: WIDTH - 3] + "...")
    return "\n".join(out)
