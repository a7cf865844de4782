"""``lockstep web``: a read-only status page (jobs, queue, failing keys, recent runs), standard library only.

Why the standard library: the page is one HTML document rebuilt per request from five short queries, with
two inline SVG charts and a ``<meta http-equiv="refresh">``. ``http.server`` (threaded) plus ``html.escape``
covers it in a few hundred lines and adds no dependency; a framework (Flask, Starlette + a template engine)
would bring routing, templates and a server we would use one page of. There is no JavaScript at all, so no
build step and nothing to bundle: the Content-Security-Policy forbids scripts outright.

Read-only by construction: GET and HEAD only (any other method: 405), every request reads in one
``read only`` transaction (``db.web_page``), binds to 127.0.0.1 unless told otherwise, and refuses a Host
header that is not the address it serves (DNS rebinding). What the page shows is what the connecting role
may read: a view it may not select from becomes a line saying so, rows hidden by row security are simply
absent.
"""

from __future__ import annotations

import datetime as dt
import html
import ipaddress
import json
import logging
import signal
import socket
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from lockstep import db
from lockstep.status import MAX_STALL, MAX_STALL_PASSES, jsonable, stalled

log = logging.getLogger("lockstep.web")

ALLOWED_METHODS = "GET, HEAD"
CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none';"
    " frame-ancestors 'none'"
)


@dataclass(frozen=True)
class Options:
    dsn: str | None = None
    host: str = "127.0.0.1"
    port: int = 8765
    refresh: int = 5  # seconds between the page's own reloads
    runs: int = 200  # recent runs read for the charts (the table shows the newest RUNS_SHOWN)
    keys: int = 50  # failing keys listed
    connections: int = 3  # the pool's bound: requests beyond it wait pool_wait seconds, then get a 503
    pool_wait: float = 2.0


RUNS_SHOWN = 25
PARKED = '<span class="badge failed">parked</span>'


# --------------------------------------------------------------------------------------------------------
# data


class Sampler:
    """Queue depth per job, sampled when a page is built (at most one sample per ``min_gap`` seconds),
    kept in memory for the trend chart: the newest ``size`` samples."""

    def __init__(self, size: int = 720, min_gap: float = 1.0) -> None:
        self._samples: deque[tuple[dt.datetime, dict[str, int]]] = deque(maxlen=size)
        self._progress: dict[str, deque[tuple[dt.datetime, int, int]]] = {}  # job -> (at, done, total)
        self._min_gap = min_gap
        self._lock = threading.Lock()

    def add(self, at: dt.datetime, depths: dict[str, int]) -> None:
        with self._lock:
            if self._samples and (at - self._samples[-1][0]).total_seconds() < self._min_gap:
                self._samples[-1] = (self._samples[-1][0], depths)
            else:
                self._samples.append((at, depths))

    def series(self) -> list[dict]:
        with self._lock:
            return [{"at": at, "total": sum(d.values()), "jobs": dict(d)} for at, d in self._samples]

    def rate(self, job: str, at: dt.datetime, done: int, total: int, window: float = 60.0) -> float | None:
        """Parents a second of the job's recompute in progress (done of total), from the oldest sample of
        that same recompute (same total) within ``window`` seconds; None with no earlier sample."""
        with self._lock:
            seen = self._progress.setdefault(job, deque(maxlen=120))
            while seen and ((at - seen[0][0]).total_seconds() > window or seen[0][2] != total):
                seen.popleft()
            first = seen[0] if seen else None
            seen.append((at, done, total))
        if first is None or (at - first[0]).total_seconds() <= 0 or done < first[1]:
            return None
        return (done - first[1]) / (at - first[0]).total_seconds()


def _interval(value: Any) -> str:
    """A timedelta as '1 day', '2 h 30 min', '15 s'."""
    if not isinstance(value, dt.timedelta):
        return "-" if value is None else str(value)
    secs = int(value.total_seconds())
    parts = []
    for unit, size in (("day", 86400), ("h", 3600), ("min", 60), ("s", 1)):
        n, secs = divmod(secs, size)
        if n:
            parts.append(f"{n} {unit}{'s' if unit == 'day' and n > 1 else ''}")
    return " ".join(parts) or f"{value.total_seconds() * 1000:.0f} ms"


def schedule(row: dict) -> str:
    every = _interval(row.get("every"))
    if row.get("kind") == "job":
        return f"call every {every}"
    if row.get("parent") is None:
        return f"recompute every {every}"
    return f"recompute every {every}; worker on the queue"


def _job_view(row: dict, due: dict[str, Any]) -> dict:
    job = dict(row)
    job["schedule"] = schedule(row)
    job["next_run"] = due.get(row["job"], row.get("next_run_at"))
    done, total = row.get("recompute_done"), row.get("recompute_total")
    job["recompute_progress"] = (
        {"done": int(done), "total": int(total)} if done is not None and total is not None else None
    )
    return job


def collect(conn: psycopg.Connection, sampler: Sampler, runs: int = 200, keys: int = 50) -> dict:
    """What the page shows, as plain data (also served as /data.json)."""
    sections = db.web_page(conn, runs=runs, keys=keys)
    ctx = sections["context"].rows[0] if sections["context"].rows else {}
    now = ctx.get("now") or dt.datetime.now(dt.UTC)
    due = {r["job"]: r["due_at"] for r in sections["due"].rows}
    jobs = [_job_view(r, due) for r in sections["status"].rows]
    for j in jobs:  # a recompute in progress: its rate and time left, from the samples (lockstep backfill's)
        prog = j["recompute_progress"]
        if prog is not None:
            rate = sampler.rate(j["job"], now, prog["done"], prog["total"])
            prog["rate"] = rate
            prog["eta_s"] = (prog["total"] - prog["done"]) / rate if rate else None
    if sections["status"].error is None:
        sampler.add(now, {j["job"]: int(j.get("queue_depth") or 0) for j in jobs})
    key_rows = sections["keys"].rows
    return {
        "generated_at": now,
        "database": ctx.get("database"),
        "role": ctx.get("role"),
        "server_version": ctx.get("server_version"),
        "errors": {
            name: s.error
            for name, s in sections.items()
            if s.error is not None and not (name == "capture" and s.sqlstate == "42P01")  # an older revision
        },
        "totals": {
            "jobs": len(jobs),
            "failing_jobs": sum(1 for j in jobs if (j.get("consecutive_failures") or 0) > 0),
            "queue_depth": sum(int(j.get("queue_depth") or 0) for j in jobs),
            "parked_keys": sum(int(j.get("parked_keys") or 0) for j in jobs),
            "failing_keys": sum(int(j.get("failing_keys") or 0) for j in jobs),
        },
        "jobs": jobs,
        "queue_trend": sampler.series(),
        "keys": [{k: v for k, v in r.items() if k != "total"} for r in key_rows],
        "keys_total": int(key_rows[0]["total"]) if key_rows else 0,
        "runs": sections["runs"].rows,
        "capture": sections["capture"].rows[0] if sections["capture"].rows else None,
    }


def to_json(data: dict) -> str:
    def conv(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, list):
            return [conv(x) for x in v]
        return jsonable(v)

    return json.dumps(conv(data), indent=1, default=str)


# --------------------------------------------------------------------------------------------------------
# rendering (every value goes through esc(): job names, keys and errors are user data)


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _ms(value: Any) -> str:
    if value is None:
        return "-"
    v = float(value)
    if v < 1000:
        return f"{v:.1f} ms" if v < 10 else f"{v:.0f} ms"
    if v < 60_000:
        return f"{v / 1000:.1f} s"
    return f"{v / 60_000:.1f} min"


def _ago(ts: Any, now: dt.datetime) -> str:
    """'12 s ago', 'in 3 min', 'now'."""
    if not isinstance(ts, dt.datetime):
        return "-" if ts is None else str(ts)
    secs = (ts - now).total_seconds()
    if abs(secs) < 1:
        return "now"
    a = abs(secs)
    text = (
        f"{a:.0f} s"
        if a < 120
        else f"{a / 60:.0f} min"
        if a < 7200
        else f"{a / 3600:.0f} h"
        if a < 172800
        else f"{a / 86400:.0f} days"
    )
    return f"in {text}" if secs > 0 else f"{text} ago"


def _when(ts: Any, now: dt.datetime) -> str:
    if not isinstance(ts, dt.datetime):
        return "-"
    return f'<time datetime="{esc(ts.isoformat())}" title="{esc(ts.isoformat())}">{esc(_ago(ts, now))}</time>'


def _next_run(ts: Any, now: dt.datetime) -> str:
    if not isinstance(ts, dt.datetime):
        return '<span class="muted">nothing to do</span>'
    if ts <= now:
        return f'<time datetime="{esc(ts.isoformat())}" class="due">due now</time>'
    return _when(ts, now)


def _badge(outcome: Any) -> str:
    if outcome is None:
        return '<span class="badge none">never ran</span>'
    return f'<span class="badge {esc(outcome)}">{esc(outcome)}</span>'


def sparkline(values: list[int], width: int = 90, height: int = 18) -> str:
    if len(values) < 2:
        return ""
    top = max(values) or 1
    step = width / (len(values) - 1)
    pts = " ".join(f"{i * step:.1f},{height - 1 - v / top * (height - 2):.1f}" for i, v in enumerate(values))
    return (
        f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img"'
        f' aria-label="queue depth trend"><polyline points="{pts}" /></svg>'
    )


def line_chart(points: list[tuple[dt.datetime, int]], width: int = 900, height: int = 120) -> str:
    """Total queue depth over the samples."""
    if len(points) < 2:
        return '<p class="muted">collecting samples: the trend appears after the next refresh.</p>'
    t0, t1 = points[0][0], points[-1][0]
    span = max((t1 - t0).total_seconds(), 1e-6)
    top = max(v for _, v in points) or 1
    pad, ph = 40, height - 20
    xs = [pad + (t - t0).total_seconds() / span * (width - pad - 10) for t, _ in points]
    ys = [10 + (1 - v / top) * (ph - 10) for _, v in points]
    pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys, strict=True))
    area = f"{xs[0]:.1f},{ph} {pts} {xs[-1]:.1f},{ph}"
    return (
        f'<svg class="chart" width="100%" viewBox="0 0 {width} {height}" role="img"'
        f' aria-label="queue depth over time">'
        f'<line class="axis" x1="{pad}" y1="{ph}" x2="{width - 10}" y2="{ph}" />'
        f'<text x="{pad - 4}" y="14" text-anchor="end">{top}</text>'
        f'<text x="{pad - 4}" y="{ph}" text-anchor="end">0</text>'
        f'<polygon class="area" points="{area}" /><polyline class="line" points="{pts}" />'
        f'<text x="{pad}" y="{height - 4}">{esc(t0.strftime("%H:%M:%S"))}</text>'
        f'<text x="{width - 10}" y="{height - 4}" text-anchor="end">{esc(t1.strftime("%H:%M:%S"))}</text>'
        "</svg>"
    )


def bar_chart(
    bars: list[tuple[float, str, str]],
    label: str,
    fmt,
    span: tuple[str, str] = ("", ""),
    width: int = 900,
    height: int = 110,
) -> str:
    """Bars (value, css class, tooltip), one per run, oldest left; y axis from 0 to the largest value;
    span: the labels under the first and the last bar (their times)."""
    if not bars:
        return ""
    top = max(v for v, _, _ in bars) or 1
    pad, ph = 58, height - 16
    bw = (width - pad - 10) / len(bars)
    out = [
        f'<svg class="chart" width="100%" viewBox="0 0 {width} {height}" role="img"'
        f' aria-label="{esc(label)}">',
        f'<text x="{pad - 4}" y="12" text-anchor="end">{esc(fmt(top))}</text>',
        f'<text x="{pad - 4}" y="{ph}" text-anchor="end">0</text>',
        f'<line class="axis" x1="{pad}" y1="{ph}" x2="{width - 10}" y2="{ph}" />',
    ]
    for i, (v, cls, tip) in enumerate(bars):
        h = max(v / top * (ph - 8), 1 if v > 0 else 0)
        out.append(
            f'<rect class="{esc(cls)}" x="{pad + i * bw + bw * 0.1:.1f}" y="{ph - h:.1f}"'
            f' width="{max(bw * 0.8, 1):.1f}" height="{h:.1f}"><title>{esc(tip)}</title></rect>'
        )
    out.append(
        f'<text x="{pad}" y="{height - 2}">{esc(span[0])}</text>'
        f'<text x="{(pad + width - 10) / 2:.0f}" y="{height - 2}" text-anchor="middle">{esc(label)}</text>'
        f'<text x="{width - 10}" y="{height - 2}" text-anchor="end">{esc(span[1])}</text></svg>'
    )
    return "".join(out)


def _unreadable(what: str, data: dict, name: str) -> str:
    err = data["errors"].get(name)
    if err is None:
        return ""
    return (
        f'<p class="unreadable" data-section="{esc(name)}">{esc(what)} is not readable by role'
        f" {esc(data.get('role') or '?')}: {esc(err)}</p>"
    )


def _pace(prog: dict) -> str:
    """' · 812 parents/s, 60 s left' once two samples of a recompute in progress give its rate."""
    rate, eta = prog.get("rate"), prog.get("eta_s")
    if not rate:
        return ""
    left = f", {eta:.0f} s left" if eta is not None else ""
    return f' <span class="recompute-rate">· {rate:.0f} parents/s{left}</span>'


def _jobs_html(data: dict, now: dt.datetime) -> str:
    trend = data["queue_trend"]
    rows = []
    for j in data["jobs"]:
        spark = sparkline([s["jobs"].get(j["job"], 0) for s in trend][-60:])
        prog = j["recompute_progress"]
        progress = ""
        if prog is not None:
            pct = 100.0 * prog["done"] / prog["total"] if prog["total"] else 100.0
            progress = (
                f'<div class="progress" title="recompute in batches: {prog["done"]} of {prog["total"]}'
                f' parents">recompute <progress max="{prog["total"]}" value="{prog["done"]}"></progress>'
                f' <span class="recompute-progress">{prog["done"]} / {prog["total"]}</span>'
                f" ({pct:.0f}%){_pace(prog)}</div>"
            )
        flags = ""
        if j.get("needs_recompute") is not None:
            flags += (
                f'<div class="flag">needs a full recompute (since {_when(j["needs_recompute"], now)})'
                f"{': ' + esc(j['trigger_problem']) if j.get('trigger_problem') else ''}</div>"
            )
        if j.get("paused_at") is not None:  # lockstep.pause: its queue waits on purpose
            flags += (
                f'<div class="flag paused">paused since {_when(j["paused_at"], now)}'
                f" by {esc(j.get('paused_by'))}</div>"
            )
        if j.get("depends_on"):  # a chain: runs after the jobs whose targets it reads
            flags += f'<div class="depends-on muted">after {esc(", ".join(j["depends_on"]))}</div>'
        stall = stalled(j, MAX_STALL, MAX_STALL_PASSES)
        if stall:
            flags += f'<div class="flag stalled">stalled: {esc(stall)}</div>'
        failures = int(j.get("consecutive_failures") or 0)
        last = j.get("last_finished_at")
        rows.append(
            f'<tr data-job="{esc(j["job"])}" class="{"failing" if failures else ""}">'
            f'<td class="job"><strong>{esc(j["job"])}</strong>{progress}{flags}</td>'
            f'<td class="kind">{esc(j.get("kind"))}</td>'
            f'<td class="lock-group">{esc(j.get("lock_group"))}</td>'
            f'<td class="schedule">{esc(j["schedule"])}</td>'
            f'<td class="last-outcome">{_badge(j.get("last_outcome"))}'
            f' <span class="muted">{esc(j.get("last_action") or "")}</span><br>'
            f"{_when(last, now)} · {esc(_ms(j.get('last_duration_ms')))}</td>"
            f'<td class="next-run">{_next_run(j["next_run"], now)}</td>'
            f'<td class="num queue-depth">{int(j.get("queue_depth") or 0)}</td><td>{spark}</td>'
            f'<td class="num keys"><span class="parked">{int(j.get("parked_keys") or 0)}</span> /'
            f' <span class="failing-keys">{int(j.get("failing_keys") or 0)}</span></td>'
            f'<td class="num consecutive-failures">{failures}</td>'
            f'<td class="last-error">{esc(j.get("last_error") or "")}</td></tr>'
        )
    body = "".join(rows) or '<tr><td colspan="11" class="muted">no jobs visible to this role</td></tr>'
    return (
        '<section id="jobs"><h2>Jobs</h2>'
        + _unreadable("lockstep.status", data, "status")
        + "<table><thead><tr><th>job</th><th>kind</th><th>lock group</th><th>schedule</th>"
        "<th>last run</th><th>next run</th><th>queue</th><th>trend</th><th>parked / failing keys</th>"
        "<th>consecutive failures</th><th>last error</th></tr></thead><tbody>"
        + body
        + "</tbody></table></section>"
    )


def _bytes(n: Any) -> str:
    """1.5 MB, 512 kB, 12 B: a byte count as people read it."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if abs(value) < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GB"


def capture_health(c: dict) -> str | None:
    """Why the WAL capture is unhealthy (as ``lockstep status`` says it), or None when it is healthy."""
    if c.get("healthy"):
        return None
    if not c.get("slot_exists"):
        return f"slot {c.get('slot')} is missing: the next capture creates it and flags the jobs"
    return (
        f"slot {c.get('slot')} ({c.get('wal_status')}) holds {_bytes(c.get('retained_bytes'))} of WAL,"
        f" bound {_bytes(c.get('capture_unhealthy_bytes'))}: is a runner capturing?"
    )


def _capture_html(data: dict, now: dt.datetime) -> str:
    """The WAL capture (lockstep.capture_status): nothing when no table is watched through the WAL."""
    c = data["capture"]
    if c is None:
        return _unreadable("lockstep.capture_status", data, "capture")
    why = capture_health(c)
    health = (
        '<span class="badge done">healthy</span>'
        if why is None
        else f'<span class="badge failed">unhealthy</span> <span class="flag">{esc(why)}</span>'
    )
    cells = [
        ("slot", "slot", esc(c.get("slot"))),
        ("health", "healthy", health),
        ("WAL retained", "retained-bytes", esc(_bytes(c.get("retained_bytes")))),
        ("lag (WAL not yet queued)", "lag-bytes", esc(_bytes(c.get("lag_bytes")))),
        ("last changes captured", "last-capture-at", _when(c.get("last_capture_at"), now)),
        ("changes captured", "changes", esc(c.get("changes"))),
        ("tables watched", "watched", esc(c.get("watched"))),
        ("slot recreated", "recreated", esc(c.get("recreated"))),
        (
            "bounds",
            "bounds",
            f"unhealthy past {esc(_bytes(c.get('capture_unhealthy_bytes')))},"
            f" recreated past {esc(_bytes(c.get('capture_max_bytes')))}",
        ),
    ]
    rows = "".join(
        f'<tr><th>{esc(label)}</th><td class="{cls}">{value}</td></tr>' for label, cls, value in cells
    )
    return f'<section id="capture"><h2>WAL capture</h2><table class="capture">{rows}</table></section>'


def _keys_html(data: dict, now: dt.datetime) -> str:
    rows = "".join(
        f'<tr data-job="{esc(k["job"])}" data-key="{esc(k["key"])}"><td>{esc(k["job"])}</td>'
        f'<td class="key">{esc(k["key"])}</td>'
        f"<td>{PARKED if k['parked'] else 'failing'}</td>"
        f'<td class="num">{k["attempts"]}</td><td>{_when(k["last_failed_at"], now)}</td>'
        f"<td>{'-' if k['parked'] else _next_run(k['retry_at'], now)}</td>"
        f'<td class="last-error">{esc(k["last_error"])}</td></tr>'
        for k in data["keys"]
    )
    more = data["keys_total"] - len(data["keys"])
    note = f'<p class="muted">and {more} more (lockstep.failing_keys lists them all).</p>' if more > 0 else ""
    table = (
        "<table><thead><tr><th>job</th><th>key</th><th>state</th><th>attempts</th><th>last failed</th>"
        f"<th>next retry</th><th>error</th></tr></thead><tbody>{rows}</tbody></table>{note}"
        if rows
        else '<p class="muted">none</p>'
    )
    return (
        f'<section id="keys"><h2>Parked and failing keys <span class="count">{data["keys_total"]}</span>'
        "</h2>" + _unreadable("lockstep.failing_keys", data, "keys") + table + "</section>"
    )


def _runs_html(data: dict, now: dt.datetime) -> str:
    runs = list(reversed(data["runs"]))  # oldest first
    cls = {"done": "ok", "failed": "bad"}

    def tip(r: dict) -> str:
        return (
            f"{r['job']} {r['action']} {r['outcome']} at {r['finished_at']:%H:%M:%S}:"
            f" {_ms(r['duration_ms'])}, +{r['inserted']} ~{r['updated']} -{r['deleted']}"
        )

    charts = ""
    if runs:
        t0, t1 = runs[0]["finished_at"], runs[-1]["finished_at"]
        span = (f"{t0:%H:%M:%S}", f"{t1:%H:%M:%S}")
        charts = bar_chart(
            [(float(r["duration_ms"]), cls.get(r["outcome"], "ok"), tip(r)) for r in runs],
            "run duration (red: failed)",
            _ms,
            span,
        ) + bar_chart(
            [(float(r["inserted"] + r["updated"] + r["deleted"]), "rows", tip(r)) for r in runs],
            "rows written (inserted + updated + deleted)",
            lambda v: f"{v:.0f}",
            span,
        )
        charts += (
            f'<p class="muted">the last {len(runs)} runs visible to this role, from {_when(t0, now)}'
            f" to {_when(t1, now)}, one bar each</p>"
        )
    rows = "".join(
        f'<tr data-run="{r["id"]}" data-job="{esc(r["job"])}"><td>{_when(r["finished_at"], now)}</td>'
        f"<td>{esc(r['job'])}</td><td>{esc(r['action'])}</td><td>{_badge(r['outcome'])}</td>"
        f'<td class="num">{esc(_ms(r["duration_ms"]))}</td><td class="num">{r["inserted"]}</td>'
        f'<td class="num">{r["updated"]}</td><td class="num">{r["deleted"]}</td>'
        f'<td class="num">{r["skipped"]}</td><td class="last-error">{esc(r["error"] or "")}</td></tr>'
        for r in data["runs"][:RUNS_SHOWN]
    )
    table = (
        "<table><thead><tr><th>finished</th><th>job</th><th>action</th><th>outcome</th><th>duration</th>"
        "<th>inserted</th><th>updated</th><th>deleted</th><th>skipped</th><th>error</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
        if rows
        else '<p class="muted">no runs recorded yet (lockstep.run_log)</p>'
    )
    return (
        '<section id="runs"><h2>Recent runs</h2>'
        + _unreadable("lockstep.run_log", data, "runs")
        + charts
        + table
        + "</section>"
    )


STYLE = """
:root { --ok: #2f855a; --bad: #c53030; --warn: #b7791f; --muted: #718096; --line: #e2e8f0; }
* { box-sizing: border-box; }
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0; color: #1a202c;
       background: #f7fafc; }
header { background: #1a202c; color: #fff; padding: 10px 20px; display: flex; gap: 18px;
         align-items: baseline; flex-wrap: wrap; }
header h1 { font-size: 18px; margin: 0; }
header .meta { color: #cbd5e0; font-size: 13px; }
main { padding: 10px 20px 30px; }
section { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 10px 14px;
          margin: 12px 0; overflow-x: auto; }
h2 { font-size: 15px; margin: 2px 0 8px; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { font-weight: 600; font-size: 12px; color: #4a5568; white-space: nowrap; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.last-error { color: var(--bad); max-width: 420px; word-break: break-word;
                font-family: ui-monospace, monospace; font-size: 12px; }
tr.failing td.job strong { color: var(--bad); }
.muted { color: var(--muted); }
.badge { display: inline-block; padding: 0 6px; border-radius: 9px; font-size: 12px; background: #edf2f7; }
.badge.done { background: #c6f6d5; color: #22543d; }
.badge.failed { background: #fed7d7; color: #822727; }
.due { color: var(--warn); font-weight: 600; }
.tiles { display: flex; gap: 12px; flex-wrap: wrap; }
.tile { background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 8px 14px;
        min-width: 130px; }
.tile .n { font-size: 22px; font-weight: 600; font-variant-numeric: tabular-nums; }
.tile.bad .n { color: var(--bad); }
.tile .l { color: var(--muted); font-size: 12px; }
.count { color: var(--muted); font-weight: normal; }
.unreadable { background: #fffaf0; border-left: 3px solid var(--warn); padding: 4px 8px; }
.progress { font-size: 12px; color: #4a5568; }
.flag { font-size: 12px; color: var(--warn); }
svg.chart { max-width: 900px; display: block; margin: 4px 0; }
svg text { font-size: 11px; fill: var(--muted); }
svg .axis { stroke: #a0aec0; }
svg .line { fill: none; stroke: #3182ce; stroke-width: 2; }
svg .area { fill: #bee3f8; opacity: .6; }
svg rect.ok { fill: #68d391; } svg rect.bad { fill: #fc8181; } svg rect.rows { fill: #90cdf4; }
svg.spark polyline { fill: none; stroke: #3182ce; stroke-width: 1.5; }
"""


def render(data: dict, refresh: int) -> str:
    now = data["generated_at"]
    t = data["totals"]
    tiles = [
        ("jobs", t["jobs"], "jobs-total", False),
        ("failing jobs", t["failing_jobs"], "failing-jobs", t["failing_jobs"] > 0),
        ("queued keys", t["queue_depth"], "queue-total", False),
        ("parked keys", t["parked_keys"], "parked-total", t["parked_keys"] > 0),
        ("failing keys", t["failing_keys"], "failing-keys-total", t["failing_keys"] > 0),
    ]
    tiles_html = "".join(
        f'<div class="tile{" bad" if bad else ""}"><div class="n" id="{i}">{n}</div>'
        f'<div class="l">{esc(label)}</div></div>'
        for label, n, i, bad in tiles
    )
    trend = data["queue_trend"]
    queue = (
        '<section id="queue"><h2>Queue depth'
        ' <span class="count">all jobs, sampled at each refresh</span></h2>'
        + line_chart([(s["at"], s["total"]) for s in trend])
        + "</section>"
    )
    other_errors = _unreadable("lockstep.due()", data, "due") + _unreadable("the context", data, "context")
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{int(refresh)}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>lockstep · {esc(data.get('database'))}</title><style>{STYLE}</style></head><body>"
        f'<header><h1>lockstep</h1><span class="meta">database <b>{esc(data.get("database"))}</b> as role'
        f' <b id="role">{esc(data.get("role"))}</b></span>'
        f'<span class="meta">at <time id="generated-at" datetime="{esc(now.isoformat())}">'
        f"{esc(now.strftime('%Y-%m-%d %H:%M:%S %Z'))}</time> · refreshes every {int(refresh)} s · read-only"
        "</span></header><main>"
        f'<div class="tiles" id="summary">{tiles_html}</div>{other_errors}'
        + _jobs_html(data, now)
        + _capture_html(data, now)
        + queue
        + _keys_html(data, now)
        + _runs_html(data, now)
        + "</main></body></html>"
    )


def error_page(message: str, refresh: int) -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{int(refresh)}"><title>lockstep · unavailable</title>'
        f"<style>{STYLE}</style></head><body><header><h1>lockstep</h1></header><main>"
        f'<section><h2>Database unavailable</h2><p class="unreadable" id="error">{esc(message)}</p>'
        f'<p class="muted">retrying every {int(refresh)} s</p></section></main></body></html>'
    )


# --------------------------------------------------------------------------------------------------------
# the server


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_allowed(header: str | None, served: Iterable[str]) -> bool:
    """A request to a loopback server must name a loopback host (or the served one): DNS rebinding."""
    if not header:
        return False
    name = urlsplit(f"//{header}").hostname or ""
    return name in served or _is_loopback(name)


class _Handler(BaseHTTPRequestHandler):
    server_version = "lockstep-web"
    sys_version = ""
    options: Options
    sampler: Sampler
    pool: ConnectionPool
    probing: threading.Lock

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._serve(send_body=True)

    def do_HEAD(self) -> None:  # noqa: N802
        self._serve(send_body=False)

    def __getattr__(self, name: str):
        # every other method (POST, PUT, DELETE, PATCH, OPTIONS, ...): 405, not http.server's 501
        if name.startswith("do_"):
            return self._not_allowed
        raise AttributeError(name)

    def _not_allowed(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, "text/plain", b"read-only: GET and HEAD only\n", True)

    def _send(self, status: HTTPStatus, ctype: str, body: bytes, send_body: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", f"{ctype}; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        if status == HTTPStatus.METHOD_NOT_ALLOWED:
            self.send_header("Allow", ALLOWED_METHODS)
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _serve(self, send_body: bool) -> None:
        opts = self.options
        if _is_loopback(opts.host) and not _host_allowed(self.headers.get("Host"), {opts.host}):
            self._send(HTTPStatus.BAD_REQUEST, "text/plain", b"unexpected Host header\n", send_body)
            return
        path = urlsplit(self.path).path
        if path not in ("/", "/data.json"):
            self._send(HTTPStatus.NOT_FOUND, "text/plain", b"not found: try / or /data.json\n", send_body)
            return
        try:
            data = self._collect()
        except psycopg.Error as exc:
            log.warning("lockstep web: %s", str(exc).strip())
            message = str(exc).strip() or type(exc).__name__
            if path == "/data.json":
                body = json.dumps({"error": message}).encode()
                self._send(HTTPStatus.SERVICE_UNAVAILABLE, "application/json", body, send_body)
            else:
                body = error_page(message, opts.refresh).encode()
                self._send(HTTPStatus.SERVICE_UNAVAILABLE, "text/html", body, send_body)
            return
        if path == "/data.json":
            self._send(HTTPStatus.OK, "application/json", to_json(data).encode(), send_body)
        else:
            self._send(HTTPStatus.OK, "text/html", render(data, opts.refresh).encode(), send_body)

    def _collect(self) -> dict:
        """The page's data, read on a pooled connection. None within pool_wait: a PoolTimeout (a 503) saying
        the connections are busy, or, where one connection attempt of its own (one at a time) fails, that
        attempt's error (the database unreachable), for the page to show."""
        opts = self.options
        try:
            with self.pool.connection(timeout=opts.pool_wait) as conn:
                return collect(conn, self.sampler, runs=opts.runs, keys=opts.keys)
        except PoolTimeout:
            if self.probing.acquire(blocking=False):
                try:
                    with db.connect(opts.dsn, app_name="lockstep-web", connect_timeout=5):
                        pass
                finally:
                    self.probing.release()
            raise PoolTimeout(
                f"all {opts.connections} database connections of lockstep web are busy"
            ) from None

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        log.debug("web: %s " + format, self.address_string(), *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    pool: ConnectionPool

    def server_close(self) -> None:
        super().server_close()
        pool = getattr(self, "pool", None)  # absent when binding failed (make_server closes it then)
        if pool is not None:
            pool.close()


def make_server(opts: Options, sampler: Sampler | None = None) -> _Server:
    """A server bound to (opts.host, opts.port), not yet serving, with its pool of at most opts.connections
    database connections (closed by server_close)."""
    conn_pool = db.pool(opts.dsn, size=opts.connections, app_name="lockstep-web", connect_timeout=5)
    attrs = {"options": opts, "sampler": sampler or Sampler(), "pool": conn_pool, "probing": threading.Lock()}
    handler = type("Handler", (_Handler,), attrs)
    server_cls = _Server
    if ":" in opts.host:  # an IPv6 address such as ::1
        server_cls = type("Server6", (_Server,), {"address_family": socket.AF_INET6})
    try:
        server = server_cls((opts.host.strip("[]"), opts.port), handler)
    except BaseException:
        conn_pool.close()
        raise
    server.pool = conn_pool
    return server


def serve(opts: Options) -> int:
    """Serve until SIGTERM or Ctrl-C; exit code 0."""
    server = make_server(opts)
    host, port = server.server_address[:2]
    if not _is_loopback(opts.host):
        log.warning(
            "lockstep web: listening on %s, not a loopback address: anyone who can reach it sees"
            " the page (read-only)",
            opts.host,
        )
    shown = f"[{host}]" if ":" in str(host) else host
    log.info("lockstep web: serving http://%s:%s/ (read-only, refresh every %s s)", shown, port, opts.refresh)

    def _stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    log.info("lockstep web: stopped")
    return 0
