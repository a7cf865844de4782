"""The built wheel, installed non-editable in a fresh venv, migrates a database from any directory."""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import zipfile
from pathlib import Path

import psycopg
import pytest

from lockstep.migrate import head

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def run(*cmd: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{cmd} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(installed_wheel: tuple[Path, Path]) -> Path:
    """bin/ folder of a fresh venv with the wheel built from this checkout (conftest, once per session)."""
    bin_dir, wheel = installed_wheel
    assert wheel.name.startswith("pg_lockstep-"), "distribution name pg-lockstep (lockstep is taken)"
    names = zipfile.ZipFile(wheel).namelist()
    assert "lockstep/_alembic/env.py" in names and "lockstep/_alembic/versions/lockstep_0001_core.py" in names
    assert any(n.startswith("lockstep/_sql/0001/") and n.endswith(".sql") for n in names)
    assert not [n for n in names if n.split("/")[0] in ("alembic", "sql")], "would shadow the alembic library"
    assert not [n for n in names if "__pycache__" in n]
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert "\nName: pg-lockstep\n" in zipfile.ZipFile(wheel).read(metadata).decode()
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "lockstep = lockstep.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    assert (bin_dir / "lockstep").exists(), "the console script is installed next to the venv's python"
    return bin_dir


def clean_env(**extra: str) -> dict[str, str]:
    drop = ("PYTHONPATH", "DATABASE_URL", "VIRTUAL_ENV", "PYTHONHOME")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PG")}
    return {**env, **extra}


def test_installed_package_uses_its_own_files(installed: Path, tmp_path: Path):
    out = run(
        installed / "python",
        "-c",
        "import lockstep.paths as p; print(p.sql_dir()); print(p.alembic_dir())",
        cwd=tmp_path,
        env=clean_env(),
    )
    sql_dir, alembic_dir = out.split()
    site = installed.parent
    assert Path(sql_dir).is_relative_to(site) and sql_dir.endswith("lockstep/_sql")
    assert Path(alembic_dir).is_relative_to(site) and alembic_dir.endswith("lockstep/_alembic")


def test_installed_cli_migrates_from_another_directory(installed: Path, tmp_path: Path, empty_dsn: str):
    run(installed / "lockstep", "migrate", "--dsn", empty_dsn, cwd=tmp_path, env=clean_env())
    with psycopg.connect(empty_dsn) as c:
        assert c.execute("select to_regnamespace('lockstep') is not null").fetchone()[0]
        assert c.execute("select version_num from lockstep_alembic_version").fetchall() == [(head(),)]
        assert c.execute("select to_regclass('public.alembic_version')").fetchone()[0] is None


def test_installed_cli_prints_sql_without_a_database(installed: Path, tmp_path: Path):
    # Any connection attempt would fail: libpq is pointed at a socket folder that does not exist.
    env = clean_env(PGHOST=str(tmp_path / "no-server"), PGCONNECT_TIMEOUT="1")
    script = run(installed / "lockstep", "migrate", "--sql", cwd=tmp_path, env=env)
    assert script.lstrip().startswith("BEGIN;") and script.rstrip().endswith("COMMIT;")
    assert "lockstep:migrate" in script
    assert "create schema lockstep" in script.lower()
    assert "INSERT INTO lockstep_alembic_version (version_num) VALUES ('lockstep_0001')" in script
    assert f"UPDATE lockstep_alembic_version SET version_num='{head()}'" in script  # through every revision
    assert run(installed / "lockstep", "--version", cwd=tmp_path, env=env).startswith("lockstep, version")


def test_wheel_carries_the_licence(installed_wheel: tuple[Path, Path]):
    """The PostgreSQL License: the LICENSE file in the checkout and in the wheel, and the SPDX metadata."""
    _, wheel = installed_wheel
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("PostgreSQL License") and "The lockstep developers" in text
    names = zipfile.ZipFile(wheel).namelist()
    licences = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert licences and zipfile.ZipFile(wheel).read(licences[0]).decode() == text
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    fields = zipfile.ZipFile(wheel).read(metadata).decode().split("\n\n", 1)[0].splitlines()
    assert "License-Expression: PostgreSQL" in fields
    assert "License-File: LICENSE" in fields
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog and "## [0.1.0]" in changelog


# What the wheel ships: the runner, `lockstep demo` and `lockstep bench`, the SQL and the Alembic scripts.
# The storm, the history cost and the test helpers stay in tests/lab/.
WHEEL_FILES = (
    "lockstep/*.py",  # the runner
    "lockstep/queries/*.sql",
    "lockstep/lab/__init__.py",
    "lockstep/lab/app.py",
    "lockstep/lab/bench.py",
    "lockstep/lab/bench_composite.py",  # the recompute section's composite-key run
    "lockstep/lab/bench_oltp.py",
    "lockstep/lab/demo.py",
    "lockstep/lab/example.py",
    "lockstep/lab/plot.py",  # lockstep bench --plot
    "lockstep/lab/procs.py",
    "lockstep/lab/scratch.py",
    "lockstep/_alembic/env.py",
    "lockstep/_alembic/script.py.mako",
    "lockstep/_alembic/versions/lockstep_[0-9][0-9][0-9][0-9]*.py",
    "lockstep/_sql/src/[0-9][0-9]_*.sql",
    "lockstep/_sql/[0-9][0-9][0-9][0-9]/*.sql",
    "lockstep/_sql/[0-9][0-9][0-9][0-9]/code/[0-9][0-9]_*.sql",
    "lockstep/_sql/example/*.sql",
    "pg_lockstep-*.dist-info/METADATA",
    "pg_lockstep-*.dist-info/RECORD",
    "pg_lockstep-*.dist-info/WHEEL",
    "pg_lockstep-*.dist-info/entry_points.txt",
    "pg_lockstep-*.dist-info/licenses/LICENSE",
)
OPTIONAL = {"lockstep/_sql/[0-9][0-9][0-9][0-9]/code/[0-9][0-9]_*.sql"}  # only once a revision is frozen


def test_the_wheel_holds_exactly_the_product(installed_wheel: tuple[Path, Path]):
    _, wheel = installed_wheel
    names = [n for n in zipfile.ZipFile(wheel).namelist() if not n.endswith("/")]

    def matches(name: str, pattern: str) -> bool:  # fnmatch's * crosses "/": a pattern names one folder
        return fnmatch.fnmatchcase(name, pattern) and name.count("/") == pattern.count("/")

    stray = [n for n in names if not any(matches(n, p) for p in WHEEL_FILES)]
    assert stray == [], f"files the wheel should not hold: {stray}"
    unused = [p for p in WHEEL_FILES if p not in OPTIONAL and not any(matches(n, p) for n in names)]
    assert unused == [], f"files the wheel lacks: {unused}"
    # every SQL and Alembic file of the checkout, and nothing of tests/
    sql_root = ROOT / "sql"
    want = {f"lockstep/_sql/{p.relative_to(sql_root).as_posix()}" for p in sql_root.rglob("*") if p.is_file()}
    assert want == {n for n in names if n.startswith("lockstep/_sql/")}
    runner = {f"lockstep/{p.name}" for p in (ROOT / "runner" / "lockstep").glob("*.py")}
    assert runner == {n for n in names if re.fullmatch(r"lockstep/[^/]+\.py", n)}
