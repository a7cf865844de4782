"""Start ``lockstep run`` as real processes for the runner tests; stderr goes to a file the test reads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg


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


class Runner:
    def __init__(self, dsn: str, args: list[str], log: Path, env: dict | None = None):
        self.log = log
        self._f = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runner", "run", "--dsn", dsn, *args],
            stdout=subprocess.DEVNULL,
            stderr=self._f,
            env={**os.environ, **(env or {})},
        )

    @property
    def stderr(self) -> str:
        return self.log.read_text()

    def json_lines(self) -> list[dict]:
        return [json.loads(line) for line in self.stderr.splitlines() if line.startswith("{")]

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 10.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._f.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._f.close()


def runner_backends(conn: psycopg.Connection) -> list[int]:
    """Backend pids of lockstep runners connected to conn's database."""
    return [
        r[0]
        for r in conn.execute(
            "select pid from pg_stat_activity where application_name = 'lockstep-runner'"
            " and datname = current_database() order by pid"
        )
    ]
