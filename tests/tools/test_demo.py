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
        [sys.executable, "-m", "lockstep", "demo", *small, "--json-file", str(out), *args],
        capture_output=True,  # bytes: text mode would turn a \r into \n
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
    assert ls["converged"] and ls["divergence"] == [0, 0, 0] and ls["drained"] and ls["key_failures"] == 0
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
    # stderr is a pipe, not a terminal: plain progress lines (no carriage return), the last of each phase too
    assert "\r" not in stderr
    lines = stderr.splitlines()
    assert any(ln.startswith("[lockstep ") and f"/{seconds:g} s]" in ln for ln in lines), stderr
    assert any(ln.startswith("[naive ") for ln in lines), stderr
    assert len([ln for ln in lines if ln.startswith("[lockstep ")]) <= seconds / 5 + 2  # one every 5 s


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


# --- which server: fall back to the embedded one only when nothing answers and nothing was configured ---


class _Said(list):
    def __call__(self, msg: str) -> None:
        self.append(msg)


@pytest.fixture
def no_libpq_env(monkeypatch):
    for var in ("PGHOST", "PGHOSTADDR", "PGPORT", "PGSERVICE", "DATABASE_URL"):
        monkeypatch.delenv(var, raising=False)


def _fake_embedded(monkeypatch, said: list[str]) -> list[str]:
    from lockstep.lab import demo

    started: list[str] = []

    class Srv:
        def get_uri(self) -> str:
            return "postgresql://embedded"

    def start(base):
        started.append(f"started after {len(said)} messages")
        return Srv()

    monkeypatch.setattr(demo, "start_embedded", start)
    return started


def test_fallback_only_when_nothing_answers_and_nothing_was_configured(monkeypatch, no_libpq_env):
    from lockstep.lab import demo

    said = _Said()
    started = _fake_embedded(monkeypatch, said)
    monkeypatch.setattr(demo, "_answers", lambda dsn: ("connection refused", False))
    server = demo.pick_server(demo.Options(dsn=None), said)
    assert server.admin_dsn == "postgresql://embedded"
    # it said what it will do before doing it: where the data goes, that it is stopped at the end
    assert started == ["started after 2 messages"]
    assert said[0].startswith("no PostgreSQL server answers at libpq defaults")
    assert "embedded PostgreSQL" in said[1] and ".lockstep-demo/pgdata" in said[1] and "stopped" in said[1]


@pytest.mark.parametrize(
    "dsn, env, answered",
    [
        ("postgresql://root@127.0.0.1:1/x", {}, False),  # an explicit --dsn that fails
        (None, {"PGHOST": "db.example"}, False),  # libpq configured to a server that is down
        (None, {}, True),  # a server answered, with an error (authentication, missing database)
    ],
    ids=["explicit dsn", "PGHOST", "server answered"],
)
def test_no_fallback_when_a_server_was_given_or_answered(monkeypatch, no_libpq_env, dsn, env, answered):
    from lockstep.lab import demo

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    said = _Said()
    started = _fake_embedded(monkeypatch, said)
    monkeypatch.setattr(
        demo, "_answers", lambda d: ('FATAL:  password authentication failed for user "x"', answered)
    )
    with pytest.raises(demo.NoServer, match="--embedded"):
        demo.pick_server(demo.Options(dsn=dsn), said)
    assert started == [] and said == []


def test_as_root_the_plan_says_pgserver_creates_a_user(monkeypatch):
    from lockstep.lab import demo

    monkeypatch.setattr(demo.os, "geteuid", lambda: 0)
    assert "system user 'pgserver'" in demo._embedded_plan()
    monkeypatch.setattr(demo.os, "geteuid", lambda: 1000)
    assert "pgserver'" not in demo._embedded_plan()


def test_demo_with_a_failing_dsn_exits_3_without_starting_anything(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lockstep", "demo", "--dsn", "postgresql://nobody@127.0.0.1:1/x"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.startswith("Error: cannot use the server at") and "Traceback" not in proc.stderr
    assert not (tmp_path / ".lockstep-demo").exists()


def test_demo_against_a_server_that_refuses_exits_without_fallback(admin_dsn, tmp_path):
    bad = admin_dsn.rsplit("/", 1)[0] + f"/{RUN_TAG}_no_such_db"
    proc = subprocess.run(
        [sys.executable, "-m", "lockstep", "demo", "--dsn", bad],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 4 and "does not exist" in proc.stderr, proc.stderr  # it answered: not transient
    assert not (tmp_path / ".lockstep-demo").exists()


def test_a_demo_larger_than_one_batch_fills_every_exam_before_it_measures(admin_dsn, tmp_path):
    """The first fill is a recompute of more than batch_parents (500) exams: it wrote 500 and handed the
    rest to the queue, which the demo then emptied, so a short demo did not converge. The demo
    fills every exam before it measures."""
    name = f"{RUN_TAG}_demo_fill"
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lockstep",
            "demo",
            "--parents",
            "1200",
            "--seconds",
            "2",
            "--naive-seconds",
            "0",
            "--clients",
            "0",
            "--json-file",
            str(out),
            "--dsn",
            admin_dsn,
            "--database",
            name,
        ],
        capture_output=True,
        timeout=120,
        cwd=tmp_path,
    )
    stdout = proc.stdout.decode()
    assert proc.returncode == 0, stdout + proc.stderr.decode()
    r = json.loads(out.read_text())
    assert r["lockstep"]["converged"] and r["lockstep"]["divergence"] == [0, 0, 0], stdout
    assert r["lockstep"]["rows_written"] == 0, stdout  # no application: nothing left to write after the fill


def test_the_demo_never_drops_a_database_it_did_not_create(admin_dsn, tmp_path):
    """An existing database without lockstep's marker comment is left alone: exit 4, one line naming it and
    --database; one the demo made (the marker) is dropped and made again."""
    from lockstep.lab import scratch

    name = f"{RUN_TAG}_demo_theirs"
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(f'create database "{name}"')
    try:
        with psycopg.connect(psycopg.conninfo.make_conninfo(admin_dsn, dbname=name), autocommit=True) as c:
            c.execute("create table precious (x int); insert into precious values (1)")
        proc = subprocess.run(
            [sys.executable, "-m", "lockstep", "demo", *SMALL, "--dsn", admin_dsn, "--database", name],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert proc.returncode == 4 and "Traceback" not in proc.stderr, proc.stderr
        assert f'database "{name}" exists and was not created by lockstep' in proc.stderr
        assert "--database" in proc.stderr
        with psycopg.connect(psycopg.conninfo.make_conninfo(admin_dsn, dbname=name)) as c:
            assert c.execute("select x from precious").fetchall() == [(1,)]
        with pytest.raises(scratch.NotOurs):
            scratch.drop_database(admin_dsn, name)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute(f'drop database if exists "{name}" with (force)')
    ours = f"{RUN_TAG}_demo_ours"
    dsn = scratch.create_database(admin_dsn, ours)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("create table leftover (x int)")
    dsn = scratch.create_database(admin_dsn, ours)  # marked: dropped and made again, empty
    with psycopg.connect(dsn) as c:
        assert c.execute("select to_regclass('leftover')").fetchone()[0] is None
    scratch.drop_database(admin_dsn, ours)
    with psycopg.connect(admin_dsn) as admin:
        assert admin.execute("select 1 from pg_database where datname = %s", [ours]).fetchone() is None
