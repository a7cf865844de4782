"""``lockstep run`` as a real process, for ``lockstep demo`` and the tests.

``RunnerProcess`` starts ``python -m lockstep run --dsn DSN ARGS...`` with its stderr (the log) in a file;
the log can be read at any time (``stderr``), its JSON lines parsed as they come (``records``, incremental).
Stopping is SIGTERM, then a wait, then SIGKILL if it did not exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any


class RunnerProcess:
    """One ``lockstep run`` process; stdout is discarded, stderr goes to ``log``."""

    def __init__(self, dsn: str, args: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = Path(log)
        self._f: IO[str] = open(self.log, "w")  # noqa: SIM115 - closed in wait() / kill()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lockstep", "run", "--dsn", dsn, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._f,
            env={**os.environ, **(env or {})},
        )
        self._offset = 0
        self._records: list[dict[str, Any]] = []

    @property
    def stderr(self) -> str:
        return self.log.read_text()

    def json_lines(self) -> list[dict[str, Any]]:
        """Every JSON log line so far (``--log-format json``), parsed; other lines are skipped."""
        return [json.loads(line) for line in self.stderr.splitlines() if line.startswith("{")]

    def records(self) -> list[dict[str, Any]]:
        """Like ``json_lines``, read incrementally (only what was appended since the last call is parsed);
        a line that is not valid JSON is kept as ``{"msg": line}``."""
        with open(self.log, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # only complete lines
        self._offset += end
        for raw in chunk[:end].decode(errors="replace").splitlines():
            line = raw.strip()
            if not line:
                continue
            try:
                rec = json.loads(line) if line.startswith("{") else {"msg": line}
            except ValueError:
                rec = {"msg": line}
            self._records.append(rec if isinstance(rec, dict) else {"msg": line})
        return self._records

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 10.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._f.close()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM and wait; SIGKILL after ``timeout``. The exit code, or None if it had to be killed."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        return self.reap(timeout)

    def reap(self, timeout: float = 15.0) -> int | None:
        """Wait for the exit (no signal: a second SIGTERM would cancel the runner's current call);
        SIGKILL after ``timeout``. The exit code, or None if it had to be killed."""
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self._f.close()
