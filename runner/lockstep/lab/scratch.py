"""What bench, storm and demo share: a database of their own on the admin DSN's server, and percentiles."""

from __future__ import annotations

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

CREATE_DB_SQL = "create database {}"
DROP_DB_SQL = "drop database if exists {} with (force)"


def create_database(admin_dsn: str, name: str) -> str:
    """Drop ``name`` if it exists, create it empty, and return its DSN (the admin DSN, another dbname)."""
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL(DROP_DB_SQL).format(sql.Identifier(name)))
        admin.execute(sql.SQL(CREATE_DB_SQL).format(sql.Identifier(name)))
    return make_conninfo(admin_dsn, dbname=name)


def drop_database(admin_dsn: str, name: str) -> None:
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
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
