"""Every SQL statement the runner sends. Each call is one statement in autocommit: one short transaction."""

from __future__ import annotations

import datetime as dt
import importlib.resources
import logging
import os
import re
import weakref
from dataclasses import dataclass, field

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row
from psycopg.types.datetime import DateLoader, TimestampLoader, TimestamptzLoader
from psycopg_pool import ConnectionPool

from lockstep import dsn as dsns

log = logging.getLogger("lockstep.db")

APP_NAME = "lockstep-runner"
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
class Capture:
    """One row of lockstep.capture(): what a capture of the WAL read and queued."""

    outcome: str  # done | idle | busy | absent (no lockstep.capture in this database's schema)
    changes: int = 0
    keys: int = 0
    flagged: int = 0
    retained_bytes: int | None = None


@dataclass(frozen=True)
class Due:
    job: str
    lock_group: str
    due_at: dt.datetime | None
    wait: float | None  # seconds from the server's now() until due_at (<= 0: due now; None: never)


CHECK_INTERVAL = re.compile(r"^\d+(us|ms|s|min|h)?$")  # a PostgreSQL time value, e.g. 1s, 500ms, 0


def looks_like_pooler(dsn: str | None) -> bool:
    try:
        port = conninfo_to_dict(dsns.normalize(dsn)).get("port")
    except (psycopg.ProgrammingError, dsns.DsnError):
        return False
    return str(port) in POOLER_PORTS if port is not None else False


def _options(conninfo: str, check_interval: str) -> str:
    """The libpq ``options`` of ``conninfo`` (else $PGOPTIONS) plus client_connection_check_interval."""
    if not CHECK_INTERVAL.match(check_interval):
        raise ValueError(f"not a PostgreSQL time value: {check_interval!r} (e.g. 1s, 500ms)")
    given = conninfo_to_dict(conninfo).get("options") or os.environ.get("PGOPTIONS", "")
    return f"{given} -c client_connection_check_interval={check_interval}".strip()


def _infinite(base: type, pos: object, neg: object) -> type:
    """A loader like base that reads 'infinity' / '-infinity' as pos / neg: Python has no infinite date or
    datetime, and one job's next_run_at = 'infinity' (its owner may set it) made every read of
    lockstep.status fail."""

    class Loader(base):  # type: ignore[misc, valid-type]
        def load(self, data):  # type: ignore[override]
            if bytes(data) == b"infinity":
                return pos
            if bytes(data) == b"-infinity":
                return neg
            return super().load(data)

    return Loader


_LOADERS = {
    "timestamptz": _infinite(
        TimestamptzLoader, dt.datetime.max.replace(tzinfo=dt.UTC), dt.datetime.min.replace(tzinfo=dt.UTC)
    ),
    "timestamp": _infinite(TimestampLoader, dt.datetime.max, dt.datetime.min),
    "date": _infinite(DateLoader, dt.date.max, dt.date.min),
}


def _connect_args(
    dsn: str | None, prepare: bool | None, app_name: str, connect_timeout: int, check_interval: str | None
) -> tuple[str, dict]:
    """The conninfo and keyword arguments of :func:`connect` (and of :func:`pool`'s connections)."""
    conninfo = dsns.normalize(dsn)
    if prepare is None:
        prepare = not looks_like_pooler(conninfo)
    kwargs: dict = {"autocommit": True, "connect_timeout": connect_timeout}
    if not conninfo_to_dict(conninfo).get("application_name") and not os.environ.get("PGAPPNAME"):
        kwargs["application_name"] = app_name
    if not prepare:
        kwargs["prepare_threshold"] = None
    if check_interval is not None:
        kwargs["options"] = _options(conninfo, check_interval)
    return conninfo, kwargs


def _register_loaders(conn: psycopg.Connection) -> None:
    for name, loader in _LOADERS.items():
        conn.adapters.register_loader(name, loader)


def connect(
    dsn: str | None,
    *,
    prepare: bool | None = None,
    app_name: str = APP_NAME,
    connect_timeout: int = 10,
    check_interval: str | None = None,
) -> psycopg.Connection:
    """An autocommit connection named ``app_name``, unless the DSN or $PGAPPNAME names it (an operator's
    own name wins: it was replaced, while the start-up line showed the DSN's). prepare=None: off when the
    port looks like a pooler.

    ``dsn``: any form :func:`lockstep.dsn.normalize` accepts. ``check_interval`` (e.g. ``"1s"``): sets
    ``client_connection_check_interval`` for the session through the startup packet's ``options``
    (added to those of the DSN or $PGOPTIONS), so no shell or unit file has to quote ``-c ...``.
    """
    conninfo, kwargs = _connect_args(dsn, prepare, app_name, connect_timeout, check_interval)
    conn = psycopg.connect(conninfo, **kwargs)
    _register_loaders(conn)
    return conn


def pool(
    dsn: str | None, *, size: int, app_name: str = APP_NAME, connect_timeout: int = 10
) -> ConnectionPool:
    """At most ``size`` connections, each as :func:`connect` makes it, opened in the background (one at
    start). ``pool.connection(timeout=...)`` raises :class:`PoolTimeout` when all are in use that long."""
    conninfo, kwargs = _connect_args(dsn, None, app_name, connect_timeout, None)
    return ConnectionPool(
        conninfo,
        min_size=1,
        max_size=size,
        kwargs=kwargs,
        configure=_register_loaders,
        name=app_name,
        open=True,
    )


def job_count(conn: psycopg.Connection) -> int:
    """How many jobs lockstep.job holds (every role granted SELECT on it sees every row)."""
    return conn.execute("select count(*) from lockstep.job").fetchone()[0]


def job_names(conn: psycopg.Connection) -> list[str]:
    """The jobs lockstep.job holds, by name."""
    return [r[0] for r in conn.execute("select job from lockstep.job order by job")]


def queue_sequence(conn: psycopg.Connection) -> str | None:
    """The queue's identity sequence (its last_value moves with every enqueued key), or None."""
    row = conn.execute("select pg_get_serial_sequence('lockstep.queue', 'id')").fetchone()
    return row[0] if row else None


def queue_mark(conn: psycopg.Connection, sequence: str) -> int | None:
    """The sequence's last value: the runners' wake-up signal. Not transactional and no table read, so the
    application pays nothing for it (no NOTIFY, no lock), and it works through transaction poolers. None if
    no key was ever enqueued."""
    return conn.execute("select pg_sequence_last_value(%s::regclass)", [sequence]).fetchone()[0]


def may_vacuum_queue(conn: psycopg.Connection) -> bool:
    """The runner's role may VACUUM lockstep.queue (owner, member of the owner, database owner, superuser)."""
    row = conn.execute(
        "select pg_has_role(c.relowner, 'USAGE') or d.datdba = u.oid or u.rolsuper"
        " from pg_class c, pg_namespace n, pg_roles u, pg_database d"
        " where n.nspname = 'lockstep' and c.relnamespace = n.oid and c.relname = 'queue'"
        " and u.rolname = current_user"
        " and d.datname = current_database()"
    ).fetchone()
    return bool(row and row[0])


def vacuum_queue(conn: psycopg.Connection) -> None:
    """VACUUM the queue (its dead rows: every pass deletes what it processed). SKIP_LOCKED: never waits for
    another runner's vacuum; the queue's vacuum_truncate = false: never an ACCESS EXCLUSIVE lock, so an
    enqueuing application never waits for it."""
    conn.execute("vacuum (skip_locked) lockstep.queue")


def capture(conn: psycopg.Connection) -> Capture:
    """Queue the changes of the tables watched through the WAL (lockstep.capture()), in a transaction of its
    own (autocommit): its queue rows and the LSN it read up to commit together. ``absent`` where the schema
    has no capture (an older revision)."""
    try:
        row = conn.execute(
            "select outcome, changes, keys, flagged, retained_bytes from lockstep.capture()"
        ).fetchone()
    except psycopg.errors.UndefinedFunction:
        return Capture("absent")
    return Capture(*row)


def backend_pid(conn: psycopg.Connection) -> int:
    return conn.info.backend_pid


def due(conn: psycopg.Connection, jobs: list[str] | None = None, gather: float = 0.0) -> list[Due]:
    """What is due; ``gather`` (seconds, --batch-wait): a job's ready keys wait that long after its last
    worker pass, whichever runner made it."""
    rows = conn.execute(
        # an owner's next_run_at = 'infinity' (never) has no wait; '-infinity' is due now: due_at - now()
        # raised 22008 for either, and stopped every job of the runner
        "select job, lock_group, due_at,"
        " case when isfinite(due_at) then extract(epoch from due_at - now())::float8"
        " when due_at < now() then 0 end"
        " from lockstep.due(%s::text[], make_interval(secs => %s))",
        [jobs, gather],
    ).fetchall()
    return [Due(*r) for r in rows]


RUN_SQL = (
    "set transaction isolation level read committed;"
    # the job's time limit (its statement_timeout, armed when the next statement starts): a run over it is
    # cancelled and recorded as failed, with its backoff; RESET ALL below ends it ("select;" before
    # lockstep 0002, which has no time limits: see _has_time_limits)
    " {limit}"
    " select outcome, inserted, updated, deleted, skipped, compute_ms, write_ms, error, job, action, more"
    " from lockstep.run({job});"
    # a plain SET in a job's code outlived its call: a generic job's `set statement_timeout = '100ms'` made
    # the next jobs on this connection fail, its `set datestyle = 'SQL, DMY'` crashed the
    # runner's next due() (psycopg parses ISO only), and behind PgBouncer its search_path reached the
    # application clients given that server connection next. So every setting goes back to the
    # session's start values, role too (RESET ALL leaves it), in the same transaction (no extra round trip),
    # and then the parameters the server reports to the client as they were before the call: behind
    # PgBouncer RESET ALL also reset those the pooler had set for this client (its application_name, and
    # its TimeZone from PGTZ), and the pooler took the server's as the client's (reviews)
    " reset all; reset role; set application_name = {app}; set timezone = {tz}; set datestyle = {ds};"
    " set intervalstyle = {ist}; set client_encoding = {enc}; set standard_conforming_strings = {scs};"
    # the pass commits without waiting for its WAL to reach disk (or a synchronous standby) unless the
    # operator asks (--synchronous-commit on): a crash can lose only the last passes, each whole, its queue
    # entries with it, so the next pass redoes them (docs/design.md, "Durability"). SET LOCAL, last (after
    # RESET ALL): it ends with this transaction, so a pooled server connection keeps the client's setting.
    " set local synchronous_commit = {sc}"
)

# the parameters restored after a call (see RUN_SQL), with the value to use when the server reported none
REPORTED = {"app": ("application_name", ""), "tz": ("TimeZone", "UTC"), "ds": ("DateStyle", "ISO, MDY"),
            "ist": ("IntervalStyle", "postgres"), "enc": ("client_encoding", "UTF8"),
            "scs": ("standard_conforming_strings", "on")}  # fmt: skip


# per connection: whether its database has lockstep.set_time_limit (revision 0002 on)
_TIME_LIMITS: weakref.WeakKeyDictionary[psycopg.Connection, bool] = weakref.WeakKeyDictionary()


def _has_time_limits(conn: psycopg.Connection) -> bool:
    known = _TIME_LIMITS.get(conn)
    if known is None:
        row = conn.execute("select to_regprocedure('lockstep.set_time_limit(text)') is not null").fetchone()
        known = _TIME_LIMITS[conn] = bool(row and row[0])
    return known


def run_job(conn: psycopg.Connection, job: str, synchronous_commit: str = "off") -> Result:
    # One simple-query message, so one implicit transaction: READ COMMITTED whatever
    # default_transaction_isolation says (lockstep.run refuses any other level), and, as for a single
    # autocommit statement, committed before the result is sent.
    before = {
        k: sql.Literal(conn.info.parameter_status(name) or default) for k, (name, default) in REPORTED.items()
    }
    with conn.cursor() as cur:
        cur.execute(
            sql.SQL(RUN_SQL).format(
                job=sql.Literal(job),
                sc=sql.Literal(synchronous_commit),
                limit=sql.SQL("select lockstep.set_time_limit({});").format(sql.Literal(job))
                if _has_time_limits(conn)
                else sql.SQL("select;"),
                **before,
            )
        )
        cur.nextset()
        cur.nextset()
        try:
            row = cur.fetchone()
        except UnicodeDecodeError as exc:
            # the job's code changed client_encoding: the row came in it, and the reset in the same message
            # put it back before the server said so. The run is done; the runner goes on.
            raise psycopg.DataError(
                f"job {job}: its result could not be decoded ({exc}); does its code SET client_encoding?"
            ) from exc
    return Result(*row)


def status(conn: psycopg.Connection) -> list[dict]:
    """The rows of lockstep.status, tables named with their schema whatever the session's search_path (a
    table on it came out bare: public.d and other.d both as "d")."""
    with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
        cur.execute("set local search_path = pg_catalog, pg_temp")
        return cur.execute("select * from lockstep.status order by job").fetchall()


def capture_problem(conn: psycopg.Connection) -> str | None:
    """Why the WAL capture is unhealthy (lockstep.capture_status.healthy false), or None: healthy, nothing
    watched through the WAL, or a schema or role that cannot see it."""
    try:
        with conn.transaction():
            row = conn.execute(
                "select healthy, slot, wal_status, retained_bytes, capture_unhealthy_bytes"
                " from lockstep.capture_status"
            ).fetchone()
    except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege):
        return None
    if row is None or row[0]:
        return None
    healthy, slot, wal_status, held, bound = row
    return (
        f"capture: slot {slot} ({wal_status or 'missing'}) holds {held} bytes of WAL, bound {bound}"
        " (lockstep.capture_status; is a runner capturing?)"
    )


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


def lockstep_installed(conn: psycopg.Connection) -> bool:
    """Whether the lockstep schema exists in the connected database."""
    return conn.execute("select to_regnamespace('lockstep') is not null").fetchone()[0]


def retry(conn: psycopg.Connection, job: str, keys: list[str] | None) -> int:
    """``lockstep.retry(job [, keys])``: failing or parked keys back in the queue; how many were.

    ``keys`` come as text (from the command line) and are cast to the job's parent key type, which
    ``lockstep.retry`` checks; an unknown job raises lockstep's own LSJ01 error.
    """
    if keys is None:
        return conn.execute("select lockstep.retry(%s)", [job]).fetchone()[0]
    query = sql.SQL("select lockstep.retry(%s, {})").format(_typed_keys(conn, job))
    return conn.execute(query, [job, job, keys]).fetchone()[0]


@dataclass(frozen=True)
class Verified:
    """``lockstep.verify``: rows missing from the target, extra in it, different, and a few examples."""

    job: str
    keys: list[str] | None
    missing: int
    extra: int
    different: int
    examples: list[dict]

    @property
    def ok(self) -> bool:
        return self.missing == self.extra == self.different == 0


def verify(conn: psycopg.Connection, job: str, keys: list[str] | None = None) -> Verified:
    """``lockstep.verify(job [, keys])``: the target compared with its compute, without a lock or a write.

    ``keys`` come as text and are cast to the job's parent key type (as :func:`retry`)."""
    if keys is None:
        row = conn.execute("select * from lockstep.verify(%s)", [job]).fetchone()
    else:
        query = sql.SQL("select * from lockstep.verify(%s, {})").format(_typed_keys(conn, job))
        row = conn.execute(query, [job, job, keys]).fetchone()
    return Verified(job, keys, row[0], row[1], row[2], row[3])


def drop_job(conn: psycopg.Connection, job: str) -> None:
    """``lockstep.drop_job(job)``: the job, its state, queue, failures and triggers."""
    conn.execute("select lockstep.drop_job(%s)", [job])


# run history and the web page --------------------------------------------------------------------


def query(name: str) -> str:
    """The text of ``runner/lockstep/queries/<name>.sql`` (shipped in the package)."""
    return (importlib.resources.files("lockstep") / "queries" / f"{name}.sql").read_text(encoding="utf-8")


def history(conn: psycopg.Connection, job: str | None = None, limit: int = 50) -> list[dict]:
    """The newest ``limit`` rows of lockstep.run_log (of ``job``, or of every job), oldest first."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query("history"), {"job": job, "limit": limit}).fetchall()


@dataclass
class Section:
    """What one query of the web page returned, or why the current role could not read it."""

    rows: list[dict] = field(default_factory=list)
    error: str | None = None
    sqlstate: str | None = None


# name -> (SQL, parameters); each one read on its own (a savepoint), so one unreadable view or missing
# table leaves the others intact.
def _web_queries(runs: int, keys: int) -> dict[str, tuple[str, dict]]:
    return {
        "context": (
            "select current_database() as database, current_user as role, now() as now,"
            " current_setting('server_version') as server_version",
            {},
        ),
        "status": ("select * from lockstep.status order by job", {}),
        "due": ("select d.job, d.due_at from lockstep.due() d", {}),
        "keys": (query("web_keys"), {"limit": keys}),
        "runs": (query("web_runs"), {"limit": runs}),
        "capture": ("select * from lockstep.capture_status", {}),  # no row: nothing watched through the WAL
    }


def web_page(conn: psycopg.Connection, runs: int = 200, keys: int = 50) -> dict[str, Section]:
    """Everything the web page shows, read in one read-only transaction (one snapshot per section).

    A section the role may not read (42501), or that does not exist in this schema version (42P01,
    42703, 42883), or that is too slow (57014, the connection's statement_timeout) comes back with its
    error instead of rows; a broken connection raises.
    """
    out: dict[str, Section] = {}
    with conn.transaction():
        conn.execute("set transaction read only")
        conn.execute("set local statement_timeout = '5s'")  # a page never hangs on a slow section
        for name, (sql, params) in _web_queries(runs, keys).items():
            try:
                with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
                    out[name] = Section(cur.execute(sql, params).fetchall())
            except psycopg.DatabaseError as exc:
                if conn.broken:
                    raise
                log.info("web: section %s not readable: %s", name, exc)
                out[name] = Section(error=str(exc).strip().splitlines()[0], sqlstate=exc.sqlstate)
    return out


# operator controls: preview, pause and resume, backfill (docs/controls.md) ---------------------------------


def _key_type(conn: psycopg.Connection, job: str) -> str:
    """The job's parent key type as format_type prints it, with no modifier (a char(n) key's regtype name,
    'character', is char(1)), or text for an unknown job (whose call then raises lockstep's own LSJ01)."""
    row = conn.execute("select format_type(key_type, -1) from lockstep.job where job = %s", [job]).fetchone()
    return row[0] if row is not None and row[0] is not None else "text"


def _typed_keys(conn: psycopg.Connection, job: str) -> sql.Composable:
    """SQL for keys given as text (two parameters: job, keys) as an array of the job's key type. lockstep
    converts them after checking the key type: a cast that the type's owner made never runs as this role.
    The type name is format_type output (quoted by PostgreSQL), never user input."""
    return sql.SQL("lockstep._keys_from_text(%s, %s::text[], null::{}[])").format(
        sql.SQL(_key_type(conn, job))
    )


def preview(conn: psycopg.Connection, job: str, keys: list[str] | None = None) -> list[tuple[str, str, int]]:
    """``lockstep.preview(job [, keys])``: (key, action, rows) of what a recompute (or a pass over ``keys``,
    given as text and cast to the job's key type) would write. Writes nothing."""
    if keys is None:
        return conn.execute("select key, action, rows from lockstep.preview(%s)", [job]).fetchall()
    query = sql.SQL("select key, action, rows from lockstep.preview(%s, {})").format(_typed_keys(conn, job))
    return conn.execute(query, [job, job, keys]).fetchall()


def pause(conn: psycopg.Connection, job: str) -> dt.datetime:
    """``lockstep.pause(job)``: when the job was paused (the first pause's time if it already was)."""
    return conn.execute("select lockstep.pause(%s)", [job]).fetchone()[0]


def resume(conn: psycopg.Connection, job: str) -> bool:
    """``lockstep.resume(job)``: whether the job was paused."""
    return conn.execute("select lockstep.resume(%s)", [job]).fetchone()[0]


def kind(conn: psycopg.Connection, job: str) -> str | None:
    """The job's kind in ``lockstep.status`` (``derived`` or ``job``), None for a job it does not show."""
    row = conn.execute("select kind from lockstep.status where job = %s", [job]).fetchone()
    return row[0] if row else None


def recompute(conn: psycopg.Connection, job: str) -> Result:
    """``lockstep.recompute(job)`` in its own READ COMMITTED transaction (its first batch, the rest handed to
    the queue)."""
    with conn.transaction():
        conn.execute("set transaction isolation level read committed")
        row = conn.execute(
            "select outcome, inserted, updated, deleted, skipped, compute_ms, write_ms, error, job, action,"
            " more from lockstep.recompute(%s)",
            [job],
        ).fetchone()
    return Result(*row)


def progress(conn: psycopg.Connection, job: str) -> tuple[int | None, int | None, int, dt.datetime | None]:
    """(recompute_done, recompute_total, queue_depth, paused_at) of the job, from lockstep.status."""
    row = conn.execute(
        "select recompute_done, recompute_total, queue_depth, paused_at from lockstep.status where job = %s",
        [job],
    ).fetchone()
    if row is None:
        raise psycopg.errors.UndefinedObject(f'lockstep: no job "{job}" visible in lockstep.status')
    return row
