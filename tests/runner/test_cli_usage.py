"""Usage errors exit 2 with the valid choices, permanent start-up errors exit at once, and nothing a user
can get wrong prints a traceback: bench sections, DSN ports and schemes, a closed pipe, Alembic's chatter,
--json errors, a busy port, `lockstep web` on a missing database, --metrics-port without its library, and
the runner's start-up names the server it really reached."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import RUN_TAG
from psycopg.conninfo import conninfo_to_dict

from lockstep.errors import EXIT_SETUP, EXIT_USAGE


def env(**extra: str) -> dict[str, str]:
    base = {
        k: v for k, v in os.environ.items() if k != "DATABASE_URL" and not k.startswith(("PG", "LOCKSTEP_"))
    }
    return {**base, "PGCONNECT_TIMEOUT": "5", **extra}


def lockstep(*args: str, timeout: float = 60, **extra: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, "-m", "lockstep", *args],
            env=env(**extra),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"lockstep {' '.join(args)} did not stop within {timeout} s")


def one_error(p: subprocess.CompletedProcess, code: int) -> str:
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == code, (p.returncode, p.stderr)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("Error:") or " ERROR " in ln]
    assert len(errors) == 1, p.stderr
    return errors[0]


def test_bench_sections_are_a_choice():
    from lockstep.cli import BENCH_SECTIONS
    from lockstep.lab.bench import SECTIONS

    assert BENCH_SECTIONS == SECTIONS
    line = one_error(lockstep("bench", "--sections", "recompute,nope"), EXIT_USAGE)
    assert "'nope'" in line and all(s in line for s in SECTIONS), line
    helped = lockstep("bench", "--help")
    assert helped.returncode == 0 and all(s in helped.stdout for s in SECTIONS), helped.stdout


@pytest.mark.parametrize(
    "dsn, needle",
    [
        ("postgresql://u@h:notaport/db", "invalid port 'notaport'"),
        ("host=h port=70000", "invalid port '70000'"),
        ("mysql://u@h/x", "mysql:// is not a PostgreSQL connection string"),
    ],
)
def test_a_bad_dsn_is_a_usage_error_saying_why(dsn, needle):
    for cmd in (["status"], ["run", "--once"], ["migrate"]):
        line = one_error(lockstep(*cmd, "--dsn", dsn), EXIT_USAGE)
        assert needle in line, line


def test_migrate_sql_into_a_closed_pipe_is_quiet():
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockstep", "migrate", "--sql"],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().strip() == b"BEGIN;"
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=60) == 0, err
    assert err == "", err


def test_migrate_logs_the_steps_not_alembics_chatter(empty_dsn):
    p = lockstep("migrate", "--dsn", empty_dsn)
    assert p.returncode == 0, p.stderr
    assert "Running upgrade" in p.stderr, p.stderr
    assert "Context impl" not in p.stderr and "Will assume" not in p.stderr, p.stderr
    p = lockstep("migrate", "current", "--dsn", empty_dsn, "--log-level", "debug")
    assert p.returncode == 0, p.stderr
    p = lockstep("migrate", "downgrade", "--revision", "base", "--dsn", empty_dsn, "--log-level", "debug")
    assert p.returncode == 0 and "Context impl PostgresqlImpl" in p.stderr, p.stderr


def test_json_commands_report_errors_as_json(dsn):
    for cmd in (["retry", "no_such_job"], ["drop", "no_such_job"], ["verify", "no_such_job"]):
        p = lockstep(*cmd, "--json", "--dsn", dsn)
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
        out = json.loads(p.stdout)
        assert "no_such_job" in out["error"] and out["exit_code"] == 1, out
    p = lockstep("status", "--json", "--dsn", "postgresql://nobody@127.0.0.1:1/x")
    out = json.loads(p.stdout)
    assert p.returncode == out["exit_code"] == 3 and "refused" in out["error"], (p.stdout, p.stderr)


def busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_busy_port_names_the_address(dsn):
    with busy_port() as s:
        port = s.getsockname()[1]
        line = one_error(lockstep("web", "--dsn", dsn, "--port", str(port)), EXIT_SETUP)
        assert f"127.0.0.1:{port}" in line and "--port" in line, line
        line = one_error(
            lockstep("run", "--dsn", dsn, "--metrics-port", str(port), "--metrics-host", "127.0.0.1"), 4
        )
        assert f"127.0.0.1:{port}" in line, line


def test_web_on_a_missing_database_stops_at_once(dsn, empty_dsn):
    info = conninfo_to_dict(dsn)
    missing = " ".join(f"{k}={v}" for k, v in {**info, "dbname": "lockstep_no_such_db"}.items())
    line = one_error(lockstep("web", "--dsn", missing, "--port", "0", timeout=30), EXIT_SETUP)
    assert "does not exist" in line and "hint:" in line, line
    line = one_error(lockstep("web", "--dsn", empty_dsn, "--port", "0", timeout=30), EXIT_SETUP)
    assert "no lockstep schema" in line and "lockstep migrate" in line, line


def test_metrics_without_prometheus_client_is_a_usage_error(dsn, tmp_path: Path):
    hidden = tmp_path / "prometheus_client"
    hidden.mkdir()
    (hidden / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    p = lockstep("run", "--once", "--dsn", dsn, "--metrics-port", "0", PYTHONPATH=str(tmp_path))
    line = one_error(p, EXIT_USAGE)
    assert "pip install 'pg-lockstep[metrics]'" in line and "--metrics-port" in line, line
    assert "run starting" not in p.stderr


def test_the_start_up_names_the_server_it_reached(dsn):
    """Only PG* variables: the runner says which host, port, database and user libpq chose."""
    info = conninfo_to_dict(dsn)
    pg = {"PGHOST": info["host"], "PGDATABASE": info["dbname"], "PGUSER": info.get("user") or "root"}
    port = info.get("port") or "5432"
    pg["PGPORT"] = port
    p = lockstep("run", "--once", **pg)
    assert p.returncode == 0, p.stderr
    wanted = f"connected to host {info['host']} port {port} database {info['dbname']} as user {pg['PGUSER']}"
    assert wanted in p.stderr, p.stderr


def test_demo_and_bench_sizes_are_checked():
    for args in (
        ["demo", "--parents", "-5"],
        ["demo", "--clients", "-1"],
        ["demo", "--seconds", "-1"],
        ["bench", "--parents", "0"],
    ):
        # were the check gone, nothing would run: no server answers there, and the database is this run's
        extra = ["--dsn", "postgresql://nobody@127.0.0.1:1/x"]
        if args[0] == "demo":
            extra += ["--database", f"{RUN_TAG}_sizes", "--naive-seconds", "0"]
        line = one_error(lockstep(*args, *extra), EXIT_USAGE)
        assert "Invalid value for" in line and args[1] in line, line
