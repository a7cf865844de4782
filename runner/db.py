"""Every SQL statement the runner sends. Each call is one statement in autocommit: one short transaction."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

APP_NAME = "lockstep-runner"
CHANNEL = "lockstep"
POOLER_PORTS = {"6432"}  # pgbouncer's usual port: no server-side prepared statements there


@dataclass(frozen=True)
class Result:
    """One row of lockstep.result."""

    outcome: str
    inserted: int
    updated: int
    deleted: int
    skipped: int
    compute_ms: float
    write_ms: float
    error: str | None
    job: str
    action: str
    more: bool


@dataclass(frozen=True)
class Due:
    job: str
    lock_group: str
    due_at: dt.datetime | None
    wait: float | None  # seconds from the server's now() until due_at (<= 0: due now; None: never)


def looks_like_pooler(dsn: str | None) -> bool:
    try:
        port = conninfo_to_dict(dsn or "").get("port")
    except psycopg.ProgrammingError:
        return False
    return str(port) in POOLER_PORTS if port is not None else False


def connect(
    dsn: str | None, *, prepare: bool | None = None, app_name: str = APP_NAME, connect_timeout: int = 10
) -> psycopg.Connection:
    """An autocommit connection named ``app_name``. prepare=None: off when the port looks like a pooler."""
    if prepare is None:
        prepare = not looks_like_pooler(dsn)
    kwargs: dict = {"autocommit": True, "application_name": app_name, "connect_timeout": connect_timeout}
    if not prepare:
        kwargs["prepare_threshold"] = None
    return psycopg.connect(dsn or "", **kwargs)


def listen(conn: psycopg.Connection) -> None:
    """LISTEN on lockstep's channel (payload: the job whose queue became non-empty)."""
    conn.execute(f"listen {CHANNEL}")


def wait_notify(conn: psycopg.Connection, timeout: float) -> str | None:
    """Wait up to ``timeout`` seconds for a notification; its payload (a job name), or None.

    psycopg >= 3.2 keeps notifications that arrived during other queries and yields them first.
    """
    for n in conn.notifies(timeout=timeout, stop_after=1):
        return n.payload
    return None


def backend_pid(conn: psycopg.Connection) -> int:
    return conn.info.backend_pid


def due(conn: psycopg.Connection, jobs: list[str] | None = None) -> list[Due]:
    rows = conn.execute(
        "select job, lock_group, due_at, extract(epoch from due_at - now())::float8"
        " from lockstep.due(%s::text[])",
        [jobs],
    ).fetchall()
    return [Due(*r) for r in rows]


RUN_SQL = (
    "set transaction isolation level read committed;"
    " select outcome, inserted, updated, deleted, skipped, compute_ms, write_ms, error, job, action, more"
    " from lockstep.run({job})"
)


def run_job(conn: psycopg.Connection, job: str) -> Result:
    # One simple-query message, so one implicit transaction: READ COMMITTED whatever
    # default_transaction_isolation says (lockstep.run refuses any other level), and, as for a single
    # autocommit statement, committed before the result is sent.
    with conn.cursor() as cur:
        cur.execute(sql.SQL(RUN_SQL).format(job=sql.Literal(job)))
        cur.nextset()
        row = cur.fetchone()
    return Result(*row)


def status(conn: psycopg.Connection) -> list[dict]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute("select * from lockstep.status order by job").fetchall()


def queue_depths(conn: psycopg.Connection) -> dict[str, tuple[int, int]]:
    """job -> (queue depth, parked keys)."""
    rows = conn.execute("select job, queue_depth, parked_keys from lockstep.status").fetchall()
    return {job: (depth, parked) for job, depth, parked in rows}


def cancel(conn: psycopg.Connection) -> None:
    """Cancel the statement running on ``conn`` with the protocol's cancel request (its own short connection).

    Not pg_cancel_backend(pid): behind a transaction pooler the pid a client sees is not the server's, but
    PgBouncer forwards a cancel request to the server connection running the client's statement.
    """
    safe = getattr(conn, "cancel_safe", None)  # psycopg >= 3.2: bounded by a timeout
    if safe is not None:
        safe(timeout=5.0)
    else:
        conn.cancel()
