"""One DSN parser (lockstep.dsn) for every command: libpq key=value, URLs, and SQLAlchemy's +driver URLs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from lockstep import dsn as dsns


@pytest.mark.parametrize(
    "given, expected",
    [
        (None, ""),
        ("", ""),
        ("  ", ""),
        ("host=db port=6432 dbname=app", "host=db port=6432 dbname=app"),
        ("postgresql://u@db:5432/app?sslmode=require", "postgresql://u@db:5432/app?sslmode=require"),
        ("postgres://u@db/app", "postgres://u@db/app"),
        ("postgresql+psycopg://u:p%40ss@db/app", "postgresql://u:p%40ss@db/app"),
        ("postgresql+psycopg2://u@db/app", "postgresql://u@db/app"),
        ("postgresql+asyncpg://u@db/app", "postgresql://u@db/app"),
        (
            "postgres+psycopg://u@/app?host=/var/run/postgresql",
            "postgresql://u@/app?host=/var/run/postgresql",
        ),
        ("POSTGRESQL+PSYCOPG://u@db/app", "postgresql://u@db/app"),
        ("postgresql://u@db1:5432,db2:5432/app", "postgresql://u@db1:5432,db2:5432/app"),
    ],
)
def test_normalize(given, expected):
    assert dsns.normalize(given) == expected


@pytest.mark.parametrize("bad", ["not a dsn", "host=db port", "postgresql+psycopg://u@db/app?nosuchparam=1"])
def test_unparseable_strings_raise_before_connecting(bad):
    with pytest.raises(dsns.DsnError):
        dsns.normalize(bad)


def test_describe_hides_secrets():
    text = dsns.describe("postgresql+psycopg://app:s3cret@db:5432/app_db")
    assert "s3cret" not in text and "password=***" in text and "host=db" in text and "dbname=app_db" in text
    assert "s3cret" not in dsns.describe("host=db password=s3cret")
    assert dsns.describe(None).startswith("libpq defaults")


def _lockstep(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {
        k: v for k, v in os.environ.items() if k != "DATABASE_URL" and not k.startswith(("PG", "LOCKSTEP_"))
    }
    return subprocess.run(
        [sys.executable, "-m", "lockstep", *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _spellings(dsn: str) -> list[str]:
    rest = dsn.split("://", 1)[1]
    return [f"postgresql+psycopg://{rest}", f"postgres://{rest}", make_conninfo(dsn), dsn]


def test_every_command_takes_every_spelling(dsn):
    """status, run --once and migrate, with --dsn and with DATABASE_URL, in each form (the +psycopg URL
    used to work for migrate only: `missing "=" after ...` for run and status)."""
    assert conninfo_to_dict(dsn)["dbname"]
    sqlalchemy_url = _spellings(dsn)[0]
    cases = [(("--dsn", s), {}) for s in _spellings(dsn)] + [((), {"DATABASE_URL": sqlalchemy_url})]
    for args, env in cases:
        for cmd in (("status",), ("run", "--once"), ("migrate", "current")):
            p = _lockstep(*cmd, *args, **env)
            assert p.returncode == 0, (cmd, args, env, p.stderr)
            assert "Traceback" not in p.stderr


def test_lockstep_dsn_wins_over_database_url(dsn):
    p = _lockstep("status", LOCKSTEP_DSN=dsn, DATABASE_URL="postgresql://nobody@127.0.0.1:1/x")
    assert p.returncode == 0, p.stderr


def test_dsn_before_the_command_name(dsn):
    """`lockstep --dsn X status`, as `--log-level` before the command: the command's own --dsn wins, and
    either wins over LOCKSTEP_DSN. An unparseable one is a usage error (exit 2) there too."""
    for cmd in (("status",), ("run", "--once"), ("migrate", "current")):
        p = _lockstep("--dsn", dsn, *cmd)
        assert p.returncode == 0, (cmd, p.stderr)
    nowhere = "postgresql://root@127.0.0.1:1/nowhere?connect_timeout=2"
    assert _lockstep("--dsn", dsn, "status", LOCKSTEP_DSN=nowhere).returncode == 0
    p = _lockstep("--dsn", nowhere, "status", "--dsn", dsn)
    assert p.returncode == 0, p.stderr
    p = _lockstep("--dsn", "not a dsn", "status")
    assert p.returncode == 2 and "--dsn" in p.stderr and "Traceback" not in p.stderr, p.stderr
