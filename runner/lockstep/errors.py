"""Which database errors the runner survives (retry with backoff) and which need a new connection."""

from __future__ import annotations

import random
import re

import psycopg
from psycopg import errors as e

# Retried on the same connection (after a backoff pause): the transaction was rolled back, nothing is lost.
RETRY_SQLSTATES = {
    "40P01",  # deadlock_detected
    "40001",  # serialization_failure
    "55P03",  # lock_not_available (lock_timeout)
    "57014",  # query_canceled (an operator's pg_cancel_backend)
    "57P01",  # admin_shutdown (pg_terminate_backend, fast shutdown)
    "57P02",  # crash_shutdown
    "57P03",  # cannot_connect_now (starting up, shutting down)
    "53300",  # too_many_connections
}


def is_transient(exc: BaseException) -> bool:
    """True for errors a runner waits out: lost connections, restarts, deadlocks, lock timeouts..."""
    if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        return True
    if isinstance(exc, (e.DeadlockDetected, e.SerializationFailure, e.LockNotAvailable, e.QueryCanceled)):
        return True
    return isinstance(exc, psycopg.Error) and getattr(exc, "sqlstate", None) in RETRY_SQLSTATES


# prepared statements lost or doubled: the runner's session is shared behind a transaction pooler
POOLER_SQLSTATES = {"26000", "42P05"}  # invalid_sql_statement_name, duplicate_prepared_statement
POOLER_HINT = "behind a transaction-mode pooler (PgBouncer)? run the runner with --no-prepare"


READ_ONLY_HINT = (
    "a standby, or a read-only session (default_transaction_read_only): point the runner at the primary "
    "(target_session_attrs=read-write in its DSN)"
)
GONE_HINT = "lockstep's schema was dropped or replaced under this session: lockstep migrate, then it recovers"


def describe(exc: BaseException) -> str:
    """One line: SQLSTATE (if any) and the first line of the message, with what it means where the message
    does not say: a prepared statement lost or doubled (the pooler hint: the runner only said "retrying"),
    a read-only transaction, a relation gone under a cached plan ("could not open
    relation with OID" while the schema was downgraded under a runner)."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    state = getattr(exc, "sqlstate", None)
    if state in POOLER_SQLSTATES:
        text = f"{text} ({POOLER_HINT})"
    elif state == "25006":
        text = f"{text} ({READ_ONLY_HINT})"
    elif state == "XX000" and "could not open relation with OID" in text:
        text = f"{text} ({GONE_HINT})"
    return f"{type(exc).__name__}[{state}]: {text}" if state else f"{type(exc).__name__}: {text}"


class Backoff:
    """Full-jitter exponential backoff: a random pause in [0, min(cap, base * 2**attempt)]."""

    def __init__(self, base: float = 0.1, cap: float = 10.0, rng: random.Random | None = None):
        self.base, self.cap, self.attempt = base, cap, 0
        self._rng = rng or random.Random()

    def next(self) -> float:
        ceiling = min(self.cap, self.base * (2 ** min(self.attempt, 30)))
        self.attempt += 1
        return self._rng.uniform(0, ceiling)

    def reset(self) -> None:
        self.attempt = 0


# Exit codes of every ``lockstep`` command (docs/cli.md "Exit codes"; tests/test_cli_exit_codes.py).
EXIT_OK = 0  # healthy / done
EXIT_UNHEALTHY = 1  # status: a job failing, parked keys or flagged; run --once: a run failed; other errors
EXIT_USAGE = 2  # bad option or unparseable connection string (click's usage error)
EXIT_UNREACHABLE = 3  # no server answered (refused, timeout, no socket): may be transient
EXIT_SETUP = 4  # permanent start-up error: database, role or lockstep schema missing, refused login...

MIGRATE_HINT = "install or upgrade the lockstep schema with `lockstep migrate` (same --dsn)"

# Start-up failures that retrying cannot fix: (pattern in libpq's message or SQLSTATE, what it means, hint).
_PERMANENT_MESSAGES = (
    (
        # PostgreSQL's text, and PgBouncer's for a database missing from its [databases]
        re.compile(r'database "[^"]*" does not exist|no such database: '),
        "check the database name in --dsn / DATABASE_URL / PGDATABASE (createdb, or CREATE DATABASE)",
    ),
    (
        re.compile(r'role "[^"]*" does not exist|no such user: '),  # PostgreSQL's, PgBouncer's (auth_file)
        "check the user in --dsn / DATABASE_URL / PGUSER",
    ),
    (
        re.compile(r"is not permitted to log in|permission denied for database"),
        "grant the role LOGIN and CONNECT on the database (docs/security.md)",
    ),
    (
        re.compile(
            r"invalid command-line argument for server process|unrecognized configuration parameter"
            r"|invalid value for parameter"
        ),
        "fix the options / PGOPTIONS setting (use `--connection-check-interval 1s` instead of PGOPTIONS)",
    ),
)
_PERMANENT_MESSAGES += (
    (
        re.compile(r"unsupported startup parameter"),
        "a pooler (PgBouncer) refuses startup options: set client_connection_check_interval on the role "
        "(alter role ... set ...) instead of --connection-check-interval / PGOPTIONS",
    ),
)
PASSWORD_HINT = (
    "give this user's password in a password file, ~/.pgpass or the file PGPASSFILE names (mode 0600, "
    "readable by the user the command runs as), or in PGPASSWORD; check the server's pg_hba.conf"
)
# A refused login, by the server (FATAL) or by libpq before the server asked twice (fe_sendauth: it had no
# password to send): the same fix whoever says it, so it needs no FATAL in the text.
_LOGIN_REFUSED = re.compile(
    r"password authentication failed|authentication failed for user|no pg_hba\.conf entry"
    r"|pg_hba\.conf rejects connection|fe_sendauth: no password supplied|password retrieved from file"
)
# libpq's own refusals of a connection string (a value it cannot parse): retrying cannot fix them
_BAD_CONNINFO = re.compile(
    r"invalid (integer |sslmode |gssencmode |target_session_attrs |load_balance_hosts )?value"
    r"|invalid connection option|missing \"=\" after|unterminated quoted string|invalid URI"
    r"|invalid percent-encoded token|could not match \d+ port numbers to \d+ hosts"
)
_PERMANENT_SQLSTATES = {
    "3F000": MIGRATE_HINT,  # invalid_schema_name: schema "lockstep" does not exist
    "42P01": MIGRATE_HINT,  # undefined_table: relation "lockstep.status" does not exist
    "42883": MIGRATE_HINT,  # undefined_function: lockstep.due(...) missing (schema older than this runner)
    "42501": "grant the runner role its privileges on schema lockstep (docs/security.md)",
    "3D000": "check the database name",  # invalid_catalog_name
    "28000": PASSWORD_HINT,  # invalid_authorization_specification (pg_hba.conf)
    "28P01": PASSWORD_HINT,  # invalid_password
}


# 3F000 / 42P01 / 42883 name lockstep's own objects when its schema is missing or old; other names are a
# job's own (a dropped compute function or table), which `lockstep migrate` cannot bring back
_LOCKSTEP_OBJECT = re.compile(r'(^|[^\w])lockstep\.|schema "lockstep"')
GONE_OBJECT_HINT = (
    "a function or table this job uses is gone: create it again, or run lockstep.define_derived (or "
    "define_job) again"
)


def permanent_hint(exc: BaseException) -> str | None:
    """The hint for a start-up error that retrying cannot fix (missing database, role or lockstep schema,
    a missing or wrong password, a login pg_hba.conf refuses, bad server options), or None when the error
    may be transient (server down, restarting, network) or is not a database error."""
    if not isinstance(exc, psycopg.Error):
        return None
    state = getattr(exc, "sqlstate", None)
    primary = getattr(getattr(exc, "diag", None), "message_primary", None) or str(exc)
    if state in ("3F000", "42P01", "42883") and not _LOCKSTEP_OBJECT.search(primary):
        return None
    if state in _PERMANENT_SQLSTATES:
        return _PERMANENT_SQLSTATES[state]
    if isinstance(exc, psycopg.OperationalError) and state is None:
        # libpq reports connection failures without a SQLSTATE: only the server's FATAL text says why
        text = str(exc)
        if _LOGIN_REFUSED.search(text):
            return PASSWORD_HINT
        if _BAD_CONNINFO.search(text):  # refused by libpq itself, before any server is asked
            return "fix the connection string (--dsn / DATABASE_URL / the PG* variables)"
        if "FATAL" in text:
            for pattern, hint in _PERMANENT_MESSAGES:
                if pattern.search(text):
                    return hint
    return None
