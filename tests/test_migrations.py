"""The packaged Alembic migrations: up, down, up again; offline script == online; concurrent installs;
the host application's ``alembic_version`` is never touched; the host's own Alembic can install us."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from util import pg_binary

from runner import paths
from runner.migrate import head, migrate

HEAD = head()
MIGRATE_LOCK_KEY = "hashtextextended('lockstep:migrate', 0)"

# Anything lockstep could leave behind, anywhere in the database (its version table aside).
LEFTOVERS = r"""
select 'schema ' || nspname from pg_namespace where nspname ilike '%lockstep%'
union all
select 'relation ' || oid::regclass from pg_class
 where relname ilike '%lockstep%' and relname not like 'lockstep\_alembic\_version%'
union all
select 'function ' || oid::regprocedure from pg_proc where proname ilike '%lockstep%'
union all
select 'type ' || oid::regtype from pg_type
 where typname ilike '%lockstep%' and typname not in ('lockstep_alembic_version', '_lockstep_alembic_version')
union all
select 'trigger ' || tgname from pg_trigger where tgname ilike '%lockstep%'
union all
select 'event trigger ' || evtname from pg_event_trigger where evtname ilike '%lockstep%'
"""

# pg_config --bindir (or env LOCKSTEP_PG_BIN), else PATH
PSQL = str(pg_binary("psql") or "psql")
PG_DUMP = str(pg_binary("pg_dump") or "pg_dump")


def one(dsn: str, query: str, params: object = None):
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(query, params).fetchone()
    return row[0] if row is not None else None


def versions(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as c:
        return [r[0] for r in c.execute("select version_num from lockstep_alembic_version")]


def schema_dump(dsn: str, *extra: str) -> str:
    """``pg_dump --schema-only`` without comments, blank lines and pg_dump's random \\restrict keys."""
    out = subprocess.run(
        [PG_DUMP, "--schema-only", "--no-owner", *extra, "-d", dsn],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    keep = [
        line
        for line in out.splitlines()
        if line.strip() and not line.startswith("--") and not re.match(r"\\(un)?restrict\b", line)
    ]
    return "\n".join(keep)


def test_upgrade_downgrade_upgrade(empty_dsn, make_db):
    pristine = make_db(None, suffix="pristine")

    assert migrate(empty_dsn).after == (HEAD,)
    assert versions(empty_dsn) == [HEAD]
    assert one(empty_dsn, "select to_regnamespace('lockstep') is not null")

    outcome = migrate(empty_dsn, "base", downgrade=True)
    assert (outcome.before, outcome.after) == ((HEAD,), ())
    assert versions(empty_dsn) == []
    with psycopg.connect(empty_dsn) as c:
        assert c.execute(LEFTOVERS).fetchall() == []
    # Exactly what an untouched database has, apart from the (empty) version table.
    assert schema_dump(empty_dsn, "--exclude-table=lockstep_alembic_version") == schema_dump(pristine)

    assert migrate(empty_dsn).after == (HEAD,)
    assert versions(empty_dsn) == [HEAD]
    assert one(empty_dsn, "select to_regclass('public.alembic_version')") is None


def test_migrate_again_is_a_no_op(empty_dsn):
    migrate(empty_dsn)
    outcome = migrate(empty_dsn)
    assert not outcome.changed and outcome.after == (HEAD,)


def test_offline_script_matches_online_upgrade(empty_dsn, make_db, tmp_path):
    offline = make_db(None, suffix="offline")
    script = io.StringIO()
    assert migrate(None, sql=True, output=script) is None
    path = tmp_path / "lockstep.sql"
    path.write_text(script.getvalue())
    assert "lockstep_alembic_version" in script.getvalue()

    subprocess.run(
        [PSQL, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-f", str(path), "-d", offline],
        check=True,
        capture_output=True,
        text=True,
    )
    migrate(empty_dsn)

    assert versions(offline) == versions(empty_dsn) == [HEAD]
    online_dump = schema_dump(empty_dsn)
    assert "CREATE SCHEMA lockstep;" in online_dump
    assert schema_dump(offline) == online_dump
    assert schema_dump(offline, "--schema=lockstep") == schema_dump(empty_dsn, "--schema=lockstep")


def test_offline_downgrade_script_applies(empty_dsn):
    migrate(empty_dsn)
    script = io.StringIO()
    migrate(None, f"{HEAD}:base", sql=True, downgrade=True, output=script)
    subprocess.run(
        ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", empty_dsn],
        input=script.getvalue(),
        check=True,
        capture_output=True,
        text=True,
    )
    assert versions(empty_dsn) == []
    assert one(empty_dsn, "select to_regnamespace('lockstep')") is None


def test_concurrent_upgrades_serialize(empty_dsn, connect):
    """Ten `lockstep migrate` processes start while the migration lock is held: all wait on it, then
    exactly one installs the schema and the nine others find it at head."""
    holder = connect(empty_dsn)
    holder.execute(f"select pg_advisory_lock({MIGRATE_LOCK_KEY})")
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "runner", "migrate", "--dsn", empty_dsn],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(10)
    ]
    try:
        deadline = time.monotonic() + 60
        waiting = 0
        while waiting < len(procs):
            assert time.monotonic() < deadline, f"only {waiting} upgraders waiting on the migration lock"
            assert all(p.poll() is None for p in procs), "an upgrader finished while the lock was held"
            time.sleep(0.05)
            waiting = holder.execute(
                "select count(*) from pg_locks l join pg_database d on d.oid = l.database"
                " where l.locktype = 'advisory' and not l.granted and d.datname = current_database()"
            ).fetchone()[0]
    finally:
        holder.execute(f"select pg_advisory_unlock({MIGRATE_LOCK_KEY})")
        results = [(p.wait(timeout=60), *p.communicate()) for p in procs]

    assert [rc for rc, _, _ in results] == [0] * len(procs), results
    reports = sorted(err.strip().splitlines()[-1] for _, _, err in results)
    assert reports == [f"lockstep schema: already at {HEAD}"] * 9 + [f"lockstep schema: base -> {HEAD}"]
    assert versions(empty_dsn) == [HEAD]


def test_host_alembic_version_is_never_touched(empty_dsn):
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        c.execute("create table alembic_version (version_num varchar(32) primary key)")
        c.execute("insert into alembic_version values ('host_rev_1')")
        before = c.execute("select xmin::text, version_num from alembic_version").fetchall()

    migrate(empty_dsn)
    migrate(empty_dsn, "base", downgrade=True)
    migrate(empty_dsn)

    with psycopg.connect(empty_dsn) as c:
        assert c.execute("select xmin::text, version_num from alembic_version").fetchall() == before
    assert versions(empty_dsn) == [HEAD]


def test_host_application_alembic_installs_lockstep_branch(empty_dsn, tmp_path: Path):
    """README way (b): the host's own Alembic, with lockstep's versions folder in version_locations."""
    host = tmp_path / "host"
    (host / "versions").mkdir(parents=True)
    (host / "env.py").write_text(
        textwrap.dedent(
            """
            from alembic import context
            from sqlalchemy import create_engine, pool

            engine = create_engine(context.config.get_main_option("sqlalchemy.url"), poolclass=pool.NullPool)
            with engine.connect() as connection:
                context.configure(connection=connection)
                with context.begin_transaction():
                    context.run_migrations()
            """
        )
    )
    (host / "script.py.mako").write_text("")
    (host / "versions" / "h001_app.py").write_text(
        textwrap.dedent(
            """
            from alembic import op
            revision = "h001"
            down_revision = None
            branch_labels = ("app",)
            depends_on = None
            def upgrade():
                op.execute("create table app_thing (id int primary key)")
            def downgrade():
                op.execute("drop table app_thing")
            """
        )
    )
    url = "postgresql+psycopg://" + empty_dsn.split("://", 1)[1]
    (tmp_path / "alembic.ini").write_text(
        textwrap.dedent(
            f"""
            [alembic]
            script_location = %(here)s/host
            path_separator = os
            version_locations = %(here)s/host/versions{os.pathsep}{paths.alembic_dir() / "versions"}
            sqlalchemy.url = {url.replace("%", "%%")}
            """
        )
    )

    def alembic(*args: str) -> None:
        subprocess.run(
            [sys.executable, "-m", "alembic", "-c", str(tmp_path / "alembic.ini"), *args],
            cwd=tmp_path,
            check=True,
            capture_output=True,
            text=True,
        )

    alembic("upgrade", "lockstep@head")
    with psycopg.connect(empty_dsn) as c:
        assert c.execute("select version_num from alembic_version").fetchall() == [(HEAD,)]
        assert c.execute("select to_regnamespace('lockstep') is not null").fetchone()[0]
        assert c.execute("select to_regclass('lockstep_alembic_version')").fetchone()[0] is None
    alembic("upgrade", "heads")
    alembic("downgrade", "lockstep@base")
    with psycopg.connect(empty_dsn) as c:
        assert c.execute("select version_num from alembic_version").fetchall() == [("h001",)]
        assert c.execute(LEFTOVERS).fetchall() == []


def test_connection_string_spellings(empty_dsn):
    """URLs in every spelling, and libpq key=value strings, all reach libpq."""
    rest = empty_dsn.split("://", 1)[1]
    assert migrate(f"postgres://{rest}").changed
    assert migrate(f"postgresql+psycopg://{rest}").after == (HEAD,)
    assert migrate(make_conninfo(empty_dsn)).after == (HEAD,)


def _cli_run(cmd: list[str], cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` with no DATABASE_URL nor PG* variable but those given."""
    base = {k: v for k, v in os.environ.items() if k != "DATABASE_URL" and not k.startswith("PG")}
    return subprocess.run(cmd, cwd=cwd, env={**base, **env}, capture_output=True, text=True)


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return _cli_run([sys.executable, "-m", "runner", *args], **env)


def test_cli_dsn_from_database_url_then_libpq_defaults(empty_dsn, make_db):
    done = _cli("migrate", DATABASE_URL=empty_dsn)
    assert done.returncode == 0, done.stderr
    assert versions(empty_dsn) == [HEAD]

    other = make_db(None, suffix="libpq")
    info = conninfo_to_dict(other)
    libpq_env = {"PGHOST": info["host"], "PGDATABASE": info["dbname"], "PGUSER": info.get("user", "")}
    if "port" in info:
        libpq_env["PGPORT"] = info["port"]
    done = _cli("migrate", **libpq_env)
    assert done.returncode == 0, done.stderr
    assert versions(other) == [HEAD]


def test_cli_reports_errors_in_one_line(tmp_path):
    done = _cli("migrate", "--dsn", f"postgresql://nobody@/nowhere?host={tmp_path}")
    assert done.returncode == 1
    assert done.stderr.startswith("Error: ") and "Traceback" not in done.stderr, done.stderr


def test_checkout_alembic_ini(empty_dsn):
    """`alembic -x dsn=... upgrade head` from the checkout's alembic.ini, then `downgrade base`."""
    root = Path(__file__).resolve().parent.parent

    def alembic(*args: str) -> None:
        done = _cli_run([sys.executable, "-m", "alembic", *args], cwd=root)
        assert done.returncode == 0, done.stderr

    alembic("-x", f"dsn={empty_dsn}", "upgrade", "head")
    assert versions(empty_dsn) == [HEAD]
    alembic("-x", f"dsn={empty_dsn}", "downgrade", "base")
    assert versions(empty_dsn) == []
