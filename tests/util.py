"""Small helpers shared by the tests."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

LOCKSTEP_TABLES = ("job", "job_state", "queue", "key_failure", "recompute_flag")


def snapshot(conn: psycopg.Connection, *extra_tables: str) -> dict[str, list[str]]:
    """Every row of lockstep's tables (and of extra_tables), to show that a failed call changed nothing."""
    out: dict[str, list[tuple]] = {}
    for t in [f"lockstep.{t}" for t in LOCKSTEP_TABLES] + list(extra_tables):
        out[t] = sorted(map(repr, conn.execute(f"select * from {t}").fetchall()))
    return out


@contextlib.contextmanager
def raises_sqlstate(sqlstate: str, match: str | None = None) -> Iterator[pytest.ExceptionInfo]:
    """Expect a psycopg error with this SQLSTATE (and a message matching ``match``)."""
    with pytest.raises(psycopg.Error, match=match) as info:
        yield info
    assert info.value.sqlstate == sqlstate, f"expected {sqlstate}, got {info.value.sqlstate}: {info.value}"


def result(conn: psycopg.Connection, call: str, *args) -> dict:
    """Run ``select * from <call>`` (a lockstep.result) and return it as a dict."""
    cur = conn.execute(f"select * from {call}", args)
    row = cur.fetchone()
    return dict(zip([d.name for d in cur.description], row, strict=True))


def flushed_stat(conn: psycopg.Connection, sql: str) -> int:
    """One number from the statistics views, with this session's pending counts flushed first (PostgreSQL
    15 flushes them only now and then) and a fresh statistics snapshot."""
    conn.execute("select pg_stat_force_next_flush()")
    conn.execute("select pg_stat_clear_snapshot()")
    return conn.execute(sql).fetchone()[0]


def advisory_locks(observer: psycopg.Connection, pid: int) -> list[tuple]:
    """Advisory locks held or awaited by backend ``pid``."""
    return observer.execute(
        "select classid, objid, granted from pg_locks where locktype = 'advisory' and pid = %s", [pid]
    ).fetchall()


def drain(conn: psycopg.Connection, job: str, batch: int | None = None, max_passes: int = 1000) -> int:
    """Call ``lockstep.work(job[, batch])`` until it reports no ``more`` ready keys; return the passes.

    Fails with a message (instead of hanging until the test timeout) after ``max_passes`` passes."""
    call = (
        "select outcome, more from lockstep.work(%s)"
        if batch is None
        else ("select outcome, more from lockstep.work(%s, %s)")
    )
    args: list[object] = [job] if batch is None else [job, batch]
    for n in range(1, max_passes + 1):
        outcome, more = conn.execute(call, args).fetchone()
        if not more:
            return n
    raise AssertionError(
        f"lockstep.work({job!r}) still reported more ready keys after {max_passes} passes"
        f" (last outcome {outcome!r}, queue depth"
        f" {conn.execute('select count(*) from lockstep.queue where job = %s', [job]).fetchone()[0]})"
    )


@functools.cache
def pg_bindir() -> Path | None:
    """Where the PostgreSQL server binaries are (initdb, pg_ctl, pg_dump): env ``LOCKSTEP_PG_BIN``, else
    ``pg_config --bindir`` (any version), else None."""
    if os.environ.get("LOCKSTEP_PG_BIN"):
        return Path(os.environ["LOCKSTEP_PG_BIN"])
    pg_config = shutil.which("pg_config")
    if pg_config is None:
        return None
    out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
    return Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


def pg_binary(name: str) -> Path | None:
    """Path of PostgreSQL binary ``name`` (see ``pg_bindir``), None if it is not there."""
    bindir = pg_bindir()
    return bindir / name if bindir is not None and (bindir / name).exists() else None


def not_due(conn: psycopg.Connection, job: str) -> None:
    """Put job's periodic recompute an hour away: a redefinition with another compute makes it due at once,
    and work() gives way to a due recompute (busy); tests of work() after a redefinition call this."""
    conn.execute(
        "update lockstep.job_state set next_run_at = now() + interval '1 hour' where job = %s", [job]
    )
