"""What bench, storm and demo share: a database of their own on the admin DSN's server, and percentiles."""

from __future__ import annotations

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

CREATE_DB_SQL = "create database {}"
DROP_DB_SQL = "drop database if exists {} with (force)"
# The comment every database made here carries: only a database with it is ever dropped.
MARKER = "lockstep scratch database: made by lockstep demo or bench, dropped and recreated by them"
MARK_SQL = "comment on database {} is {}"
MARKED_SQL = "select shobj_description(oid, 'pg_database') from pg_database where datname = %s"


class NotOurs(RuntimeError):
    """The database exists and was not made here (no marker comment): it is never dropped."""


def create_database(admin_dsn: str, name: str) -> str:
    """Drop ``name`` if it exists and carries the marker, create it empty with the marker, and return its
    DSN (the admin DSN, another dbname). NotOurs, changing nothing, if it exists without the marker."""
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        _drop_if_ours(admin, name)
        admin.execute(sql.SQL(CREATE_DB_SQL).format(sql.Identifier(name)))
        admin.execute(sql.SQL(MARK_SQL).format(sql.Identifier(name), sql.Literal(MARKER)))
    return make_conninfo(admin_dsn, dbname=name)


def drop_database(admin_dsn: str, name: str) -> None:
    """Drop ``name`` if it carries the marker; NotOurs if it exists without it."""
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        _drop_if_ours(admin, name)


def _drop_if_ours(admin: psycopg.Connection, name: str) -> None:
    row = admin.execute(MARKED_SQL, [name]).fetchone()
    if row is None:
        return
    if row[0] != MARKER:
        raise NotOurs(
            f'database "{name}" exists and was not created by lockstep: it is left alone '
            "(hint: name another database with --database, or drop this one yourself)"
        )
    admin.execute(sql.SQL(DROP_DB_SQL).format(sql.Identifier(name)))


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of values by nearest rank, or None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def backend_cpu_ms(pid: int) -> float | None:
    """CPU time so far of a server backend of this host (ms, ``/proc/<pid>/schedstat``), or None when it is
    unreadable (the backend is gone, or the server runs elsewhere)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e6
    except OSError:
        return None
