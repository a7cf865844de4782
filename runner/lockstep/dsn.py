"""The one connection-string parser of every ``lockstep`` command, the migrations and the demo.

Accepted, as libpq accepts them (https://www.postgresql.org/docs/current/libpq-connect.html):

- libpq key/value strings: ``host=db port=5432 dbname=app user=runner``;
- URLs: ``postgresql://user@host:5432/db?sslmode=require`` and ``postgres://...``;
- SQLAlchemy-style URLs with a driver suffix, as many frameworks put them in ``DATABASE_URL``:
  ``postgresql+psycopg://``, ``postgresql+psycopg2://``, ``postgresql+asyncpg://``, ``postgres+...://``;
  the suffix is dropped, the rest goes to libpq unchanged (passwords, socket paths, multi-host lists);
- nothing (None or ``""``): libpq's own defaults (PGHOST, PGDATABASE, PGSERVICE, ...).

:func:`normalize` returns the string to hand to libpq, or raises :class:`DsnError` (a ``ValueError``)
when libpq cannot parse it, before anything connects.
"""

from __future__ import annotations

import re

_DRIVER_URL = re.compile(r"^(?P<scheme>postgres(?:ql)?)\+[A-Za-z0-9_]+://", re.IGNORECASE)
_SECRET_KEYS = ("password", "sslpassword", "oauth_client_secret")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class DsnError(ValueError):
    """A connection string libpq cannot parse (the message says why, without the password)."""


def strip_driver(dsn: str) -> str:
    """``postgresql+psycopg://...`` -> ``postgresql://...``; any other string unchanged."""
    m = _DRIVER_URL.match(dsn)
    if m is None:
        return dsn
    return "postgresql://" + dsn[m.end() :]


def normalize(dsn: str | None) -> str:
    """The libpq connection string for ``dsn`` ('' for libpq's defaults); DsnError if unparseable."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    text = strip_driver((dsn or "").strip())
    scheme = _SCHEME.match(text)
    if scheme is not None and scheme.group(1).lower() not in ("postgres", "postgresql"):
        raise DsnError(
            f"{scheme.group(1)}:// is not a PostgreSQL connection string: use "
            "postgresql://user@host:port/db, or libpq's key=value form"
        )
    try:
        given = conninfo_to_dict(text)
    except psycopg.ProgrammingError as exc:
        raise DsnError(_first_line(exc)) from None
    for port in str(given.get("port") or "").split(","):
        if port.strip() and not (port.strip().isdigit() and 0 < int(port) < 65536):
            raise DsnError(f"invalid port {port.strip()!r}: a number from 1 to 65535")
    return text


def parts(dsn: str | None) -> dict[str, str]:
    """The parameters given in ``dsn`` (not the environment's), e.g. {'host': 'db', 'port': '5432'}."""
    from psycopg.conninfo import conninfo_to_dict

    return {k: str(v) for k, v in conninfo_to_dict(normalize(dsn)).items() if v is not None}


def describe(dsn: str | None) -> str:
    """A one-line description safe to log: the given parameters without secrets."""
    text = (dsn or "").strip()
    if not text:
        return "libpq defaults (PGHOST, PGPORT, PGDATABASE, ...)"
    try:
        given = parts(text)
    except DsnError:
        return "an unparseable connection string"
    for key in _SECRET_KEYS:
        if key in given:
            given[key] = "***"
    return " ".join(f"{k}={v}" for k, v in given.items()) or describe(None)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
