"""``lockstep demo`` end to end, small: on the test server and on an embedded pgserver.

lockstep must end with 0 deadlocks, 0 FK errors, no application error and a converged exam_key; the naive
phase must have run (its failures are only reported). Its database is dropped at the end.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
import pytest
from conftest import RUN_TAG

SMALL = ["--parents", "300", "--seconds", "8", "--naive-seconds", "4"]
SHORTER = ["--parents", "300", "--seconds", "5", "--naive-seconds", "2"]  # the embedded run: same path


def _demo(args: list[str], tmp_path: Path, small: list[str] = SMALL, timeout: float = 90) -> tuple[dict, str]:
    out = tmp_path / "demo.json"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "demo", *small, "--json", str(out), *args],
        capture_output=True,  # bytes: text mode would turn the progress line's \r into \n
        timeout=timeout,
        cwd=tmp_path,
    )
    stdout, stderr = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, stdout + stderr
    assert time.monotonic() - started < 60
    assert "OK: lockstep had 0 deadlocks and exam_key converged." in stdout
    return json.loads(out.read_text()), stderr


def _check(r: dict, stderr: str, seconds: float = 8, naive_seconds: float = 4) -> None:
    ls, naive = r["lockstep"], r["naive"]
    assert r["ok"] and r["parents"] == 300
    assert ls["deadlocks"] == 0 and ls["fk_errors"] == 0 and not ls["job_errors"]
    assert ls["converged"] and ls["divergence"] == [0, 0] and ls["drained"] and ls["key_failures"] == 0
    assert ls["job_runs"].get("done", 0) > 0 and not ls["job_runs"].get("failed")
    assert ls["job_actions"].get("done work", 0) > 0
    if seconds >= 8:  # the periodic recompute (every 5 s) came due at least once
        assert ls["job_actions"].get("done recompute", 0) >= 1
    assert ls["rows_written"] > 0
    assert ls["app_transactions"] > 50 and not ls["app_errors"], ls["app_errors"]
    assert set(ls["app_ops"]) >= {"delete", "merge", "insert", "edit", "enqueue"}
    assert ls["app_delete_n"] > 0 and ls["app_delete_p99_ms"] >= ls["app_delete_p50_ms"] > 0
    assert not ls["notes"], ls["notes"]
    # the naive phase ran with the same clients; what it did wrong is reported, not asserted
    assert naive is not None and naive["app_transactions"] > 0 and naive["seconds"] >= naive_seconds
    assert sum(naive["job_runs"].values()) > 0
    # one refreshed progress line per phase on stderr
    assert "\r[lockstep " in stderr and "\r[naive " in stderr


def test_demo_test_server(admin_dsn, tmp_path):
    name = f"{RUN_TAG}_demo"
    r, err = _demo(["--dsn", admin_dsn, "--database", name], tmp_path)
    _check(r, err)
    assert "embedded" not in r["server"]
    with psycopg.connect(admin_dsn) as admin:  # its database is dropped
        assert admin.execute("select count(*) from pg_database where datname = %s", [name]).fetchone()[0] == 0


@pytest.mark.skipif(importlib.util.find_spec("pgserver") is None, reason="pgserver is not installed")
def test_demo_embedded():
    # Not under pytest's tmp_path: as root, pgserver runs PostgreSQL as user "pgserver", which must be able
    # to traverse the path, and every pytest session resets /tmp/pytest-of-<user> to mode 0700.
    work = Path(tempfile.mkdtemp(prefix="lockstep_demo_test_"))
    try:
        r, err = _demo(["--embedded"], work, SHORTER)
        _check(r, err, seconds=5, naive_seconds=2)
        assert r["server"] == "server: embedded pgserver, data in .lockstep-demo/pgdata"
        pgdata = work / ".lockstep-demo" / "pgdata"
        assert (pgdata / "PG_VERSION").exists()
        assert not (pgdata / "postmaster.pid").exists()  # stopped at the end
    finally:
        shutil.rmtree(work, ignore_errors=True)
