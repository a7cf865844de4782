"""Helpers of the runner tests. The runner process itself is ``lockstep.lab.procs.RunnerProcess`` (also
used by ``lockstep demo`` and the storm), re-exported here as ``Runner``; the ``runners`` fixture
(tests/conftest.py) starts them and kills any left at teardown."""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg

from lockstep.lab.procs import RunnerProcess as Runner

__all__ = ["SLOW_FN", "Runner", "in_slow_call", "runner_backends", "wait_for"]


def wait_for(
    pred: Callable[[], object], timeout: float = 10.0, interval: float = 0.05, what: str = ""
) -> object:
    """Poll ``pred`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or pred}")
        time.sleep(interval)


def runner_backends(conn: psycopg.Connection) -> list[int]:
    """Backend pids of lockstep runners connected to conn's database."""
    return [
        r[0]
        for r in conn.execute(
            "select pid from pg_stat_activity where application_name = 'lockstep-runner'"
            " and datname = current_database() order by pid"
        )
    ]


# a generic job whose first call sleeps 30 s (holding its group lock), then runs at once
SLOW_FN = """
create sequence public.calls;
create table public.ticks (id bigserial primary key, at timestamptz not null default clock_timestamp());
create function public.slow_fn() returns void language plpgsql as $$
begin
    if nextval('public.calls') = 1 then perform pg_sleep(30); end if;  -- only the first call is slow
    insert into public.ticks default values;
end $$;
select lockstep.define_job('slow', 'public.slow_fn()', every => '1 hour');
"""


def in_slow_call(conn: psycopg.Connection, runner_name: bool = True) -> int | None:
    """Pid of the backend sleeping inside slow_fn while holding an advisory (group) lock, if any.
    runner_name: also require application_name 'lockstep-runner' (not seen behind PgBouncer)."""
    row = conn.execute(
        "select a.pid from pg_stat_activity a join pg_locks l on l.pid = a.pid and l.locktype = 'advisory'"
        " and l.granted where a.wait_event = 'PgSleep' and a.datname = current_database()"
        " and (not %s or a.application_name = 'lockstep-runner')",
        [runner_name],
    ).fetchone()
    return row[0] if row else None
