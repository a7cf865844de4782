"""Groups of ``lockstep run`` processes, for the storm and the tests (one process: ``lockstep.lab.procs``)."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lockstep.lab.procs import RunnerProcess


class Runners:
    """``n`` runner processes with the same arguments, logs ``log_dir/runner-<i>.log``."""

    def __init__(
        self,
        dsn: str,
        n: int,
        log_dir: Path,
        args: Sequence[str] = ("--tick", "0.2", "--log-format", "json"),
        envs: Sequence[dict[str, str] | None] = (),
    ) -> None:
        """``envs``: extra environment of the first runners, one each (a runner in another TimeZone)."""
        self.procs = [
            RunnerProcess(
                dsn, list(args), Path(log_dir) / f"runner-{i}.log", envs[i] if i < len(envs) else None
            )
            for i in range(n)
        ]

    def alive(self) -> bool:
        return all(p.alive() for p in self.procs)

    def stop(self, timeout: float = 30.0) -> list[int | None]:
        """SIGTERM to all, then wait for each; None for one that had to be killed."""
        for p in self.procs:
            if p.alive():
                p.signal(signal.SIGTERM)
        return [p.reap(timeout) for p in self.procs]

    def records(self) -> list[dict[str, Any]]:
        return [rec for p in self.procs for rec in p.records()]
