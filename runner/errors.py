"""Which database errors the runner survives (retry with backoff) and which need a new connection."""

from __future__ import annotations

import random

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


def describe(exc: BaseException) -> str:
    """One line: SQLSTATE (if any) and the first line of the message."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    state = getattr(exc, "sqlstate", None)
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
