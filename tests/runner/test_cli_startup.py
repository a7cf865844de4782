"""Start-up errors of `lockstep run` (loop and --once) and `lockstep status`: permanent ones (database,
role or lockstep schema missing, bad server options) exit at once with code 4 and a hint; transient ones
(no server answering, trouble after a good start) keep the loop retrying."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from urllib.parse import urlsplit, urlunsplit

import pytest
from conftest import RUN_TAG

from lockstep.errors import EXIT_SETUP, EXIT_UNREACHABLE


def env(**extra: str) -> dict[str, str]:
    base = {
        k: v for k, v in os.environ.items() if k != "DATABASE_URL" and not k.startswith(("PG", "LOCKSTEP_"))
    }
    return {**base, **extra}


def lockstep(*args: str, timeout: float = 30, **extra: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, "-m", "lockstep", *args],
            env=env(**extra),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"lockstep {' '.join(args)} was still retrying after {timeout} s")


def with_parts(dsn: str, user: str | None = None, dbname: str | None = None) -> str:
    parts = urlsplit(dsn)
    netloc = parts.netloc if user is None else f"{user}@{parts.netloc.split('@', 1)[-1]}"
    return urlunsplit(parts._replace(netloc=netloc, path="/" + (dbname or parts.path.lstrip("/"))))


def error_line(p: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in p.stderr, p.stderr
    errors = [ln for ln in p.stderr.splitlines() if " ERROR " in ln or ln.startswith("Error: ")]
    assert len(errors) == 1, p.stderr
    return errors[0]


def permanent_cases(dsn: str) -> dict[str, tuple[list[str], dict[str, str], tuple[str, ...]]]:
    return {
        "missing database": (
            ["--dsn", with_parts(dsn, dbname=f"{RUN_TAG}_no_such_db")],
            {},
            ("does not exist", "database name"),
        ),
        "missing role": (
            ["--dsn", with_parts(dsn, user=f"{RUN_TAG}_nobody")],
            {},
            ("does not exist", "user"),
        ),
        "a connection option libpq refuses (sslmode=abc)": (
            ["--dsn", f"{dsn}{'&' if '?' in dsn else '?'}sslmode=abc"],
            {},
            ("sslmode", "connection string"),
        ),
        "bad PGOPTIONS (a systemd-split value)": (
            ["--dsn", dsn],
            {"PGOPTIONS": "-c"},
            ("invalid command-line argument", "--connection-check-interval"),
        ),
    }


@pytest.mark.parametrize("mode", [[], ["--once"]], ids=["loop", "once"])
def test_permanent_start_up_errors_exit_at_once_with_a_hint(dsn, mode):
    for name, (args, extra, needles) in permanent_cases(dsn).items():
        p = lockstep("run", *mode, *args, **extra)
        assert p.returncode == EXIT_SETUP, (name, p.returncode, p.stderr)
        line = error_line(p)
        assert "cannot start" in line and "hint:" in line, (name, line)
        for needle in needles:
            assert needle in line, (name, needle, line)


@pytest.mark.parametrize("mode", [[], ["--once"]], ids=["loop", "once"])
def test_missing_lockstep_schema_exits_at_once_pointing_to_migrate(empty_dsn, mode):
    p = lockstep("run", *mode, "--dsn", empty_dsn)
    assert p.returncode == EXIT_SETUP, p.stderr
    line = error_line(p)
    assert 'schema "lockstep" does not exist' in line and "lockstep migrate" in line
    assert "not the queue's owner" not in p.stderr, p.stderr  # it was logged first, misleading


def test_status_and_migrate_on_permanent_errors(dsn):
    for name, (args, extra, needles) in permanent_cases(dsn).items():
        for cmd in (["status"], ["migrate", "current"]):
            p = lockstep(*cmd, *args, **extra)
            assert p.returncode == EXIT_SETUP, (name, cmd, p.stderr)
            line = error_line(p)
            assert "hint:" in line and needles[0] in line, (name, cmd, line)


def test_unreachable_is_its_own_code_for_one_shot_commands():
    for cmd in (["status"], ["run", "--once"], ["migrate"]):
        p = lockstep(*cmd, "--dsn", "postgresql://nobody@127.0.0.1:1/x", PGCONNECT_TIMEOUT="5")
        assert p.returncode == EXIT_UNREACHABLE, (cmd, p.stderr)
        assert "Connection refused" in error_line(p)


def _until_line(proc: subprocess.Popen, needle: str, seen: list[str]) -> str:
    assert proc.stderr is not None
    for line in proc.stderr:
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"runner ended (rc {proc.wait()}) before logging {needle!r}:\n{''.join(seen)}")


def _stop(proc: subprocess.Popen, seen: list[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    seen.append(err)
    return proc.returncode


@pytest.mark.timeout(60)
def test_no_server_answering_keeps_the_loop_retrying():
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockstep", "run", "--dsn", "postgresql://nobody@127.0.0.1:1/x"],
        env=env(),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    seen: list[str] = []
    try:
        _until_line(proc, "retrying with backoff", seen)
        assert proc.poll() is None, "".join(seen)
    finally:
        rc = _stop(proc, seen)
    assert rc == 0, "".join(seen)


@pytest.mark.timeout(90)
def test_schema_gone_after_a_good_start_is_retried_not_fatal(dsn, connect):
    conn = connect(dsn)
    conn.execute(
        "create table public.ran (at timestamptz);"
        " create function public.mark() returns void language sql"
        " as $$ insert into public.ran values (now()) $$;"
        " select lockstep.define_job('mark', 'public.mark()', every => '1 hour');"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "lockstep", "run", "--tick", "0.1", "--dsn", dsn],
        env=env(),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    seen: list[str] = []
    try:
        _until_line(proc, "mark call done", seen)  # a tick went through
        conn.execute("drop schema lockstep cascade")
        line = _until_line(proc, "retrying with backoff", seen)
        # the schema is gone: 3F000 / "does not exist"; or, when the drop commits while a statement is
        # planned against it, XX000 "could not open relation with OID" (seen once in CI): retried the same
        assert "3F000" in line or "does not exist" in line or "could not open relation" in line, line
        assert proc.poll() is None, "".join(seen)
    finally:
        rc = _stop(proc, seen)
    assert rc == 0, "".join(seen)
    assert not [ln for ln in seen if "cannot start" in ln]


def test_migrate_as_a_role_that_may_not_create_its_tables_says_what_the_installer_needs(empty_dsn):
    """PostgreSQL 15 gives no one but the database owner CREATE on schema public, where Alembic's version
    table goes: migrate failed with 42501 and a hint about the runner role's grants on schema lockstep,
    the wrong role and the wrong schema."""
    import psycopg
    from psycopg import sql

    role = f"{RUN_TAG}_installer"
    with psycopg.connect(empty_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("create role {} login").format(sql.Identifier(role)))
        try:
            admin.execute(
                sql.SQL("grant create on database {} to {}").format(
                    sql.Identifier(urlsplit(empty_dsn).path.lstrip("/")), sql.Identifier(role)
                )
            )
            p = lockstep("migrate", "--dsn", with_parts(empty_dsn, user=role))
            assert p.returncode == EXIT_SETUP, p.stderr
            line = error_line(p)
            assert "permission denied for schema public" in line, line
            assert "CREATE on public" in line and "runner role" not in line, line
            assert admin.execute("select to_regnamespace('lockstep')").fetchone()[0] is None  # nothing left
        finally:
            admin.execute(sql.SQL("drop owned by {} cascade").format(sql.Identifier(role)))
            admin.execute(sql.SQL("drop role {}").format(sql.Identifier(role)))


def test_a_role_without_lockstep_grants_is_not_told_to_grant_the_runner(dsn, conn):
    """An application role's `lockstep status` and another owner's `lockstep drop` were told to "grant the
    runner role its privileges": the runner was not involved. They get the
    SQLSTATE and the server's hint, or where each role's grants are listed."""
    import psycopg
    from psycopg import sql

    conn.execute(
        "create function public.noop() returns void language sql as $$ select $$;"
        " select lockstep.define_job('mine', 'public.noop()')"
    )
    role = f"{RUN_TAG}_app"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("create role {} login").format(sql.Identifier(role)))
        try:
            p = lockstep("status", "--dsn", with_parts(dsn, user=role))
            assert p.returncode == EXIT_SETUP, p.stderr
            line = error_line(p)
            assert line.startswith("Error: 42501: permission denied for schema lockstep"), line
            assert "runner role" not in line and "docs/security.md lists the grants of each role" in line, (
                line
            )
            admin.execute(sql.SQL("grant usage on schema lockstep to {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("grant select on lockstep.job to {}").format(sql.Identifier(role)))
            p = lockstep("drop", "mine", "--dsn", with_parts(dsn, user=role))
            assert p.returncode == EXIT_SETUP, p.stderr
            line = error_line(p)
            assert line.startswith("Error: 42501: ") and "runner role" not in line, line
        finally:
            admin.execute(sql.SQL("drop owned by {} cascade").format(sql.Identifier(role)))
            admin.execute(sql.SQL("drop role {}").format(sql.Identifier(role)))
