"""A throw-away PostgreSQL cluster for the tests that need server settings of their own (a restart, prepared
transactions, a synchronous standby that never comes).

The PostgreSQL binaries of ``pg_config --bindir`` (or env LOCKSTEP_PG_BIN); trust auth, bootstrap superuser
``root``; in a directory under /tmp owned by ``postgres``: initdb and the server refuse to run as root, so
as root every server command goes through ``runuser -u postgres --``. ``destroy()`` stops it
(``-m immediate``) and removes it, even after a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from psycopg.conninfo import make_conninfo
from util import pg_bindir

BIN = pg_bindir() or Path("/nonexistent")
AVAILABLE = (BIN / "pg_ctl").exists()
MISSING = f"no PostgreSQL binaries in {BIN} (pg_config --bindir; or set LOCKSTEP_PG_BIN)"
# a test cluster's defaults: fast and small
DEFAULTS = {"fsync": "off", "full_page_writes": "off", "max_connections": "20", "shared_buffers": "16MB"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, prefix: str = "lockstep-pg-", **settings: str) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=prefix))
        self.data = self.root / "data"
        self.logfile = self.root / "server.log"
        self.port = free_port()
        self.settings = {**DEFAULTS, **settings}
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            shutil.chown(self.root, "postgres", "postgres")
        self.dsn = make_conninfo(host="127.0.0.1", port=self.port, dbname="postgres", user="root")

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = [str(BIN / args[0]), *args[1:]]
        if self.as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}\n{self.log}"
            )
        return p

    @property
    def log(self) -> str:
        try:
            return self.logfile.read_text()
        except OSError:
            return ""

    def start(self) -> None:
        """initdb, then start with the settings."""
        self._run("initdb", "-D", str(self.data), "-U", "root", "--auth=trust", "--no-sync", "-E", "UTF8")
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 " + " ".join(
            f"-c {k}={v}" for k, v in self.settings.items()
        )
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.logfile), "-w", "start")

    def pg_ctl(self, *args: str) -> None:
        # -l again: without it a restarted server writes to pg_ctl's stdout, a pipe that would never close
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.logfile), "-w", *args)

    def destroy(self) -> None:
        if (self.data / "postmaster.pid").exists():
            try:
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=30)
            except (AssertionError, subprocess.TimeoutExpired):
                pass
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def running(prefix: str = "lockstep-pg-", **settings: str) -> Iterator[Cluster]:
    """A started cluster with these settings, destroyed on exit (after a failure too)."""
    c = Cluster(prefix, **settings)
    try:
        c.start()
        yield c
    finally:
        c.destroy()
