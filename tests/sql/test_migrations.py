"""The packaged Alembic migrations: up, down, up again; offline script == online; concurrent installs;
the host application's ``alembic_version`` is never touched; the host's own Alembic can install us."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from util import pg_binary

from lockstep import paths
from lockstep.migrate import head, migrate

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


@pytest.mark.parametrize("revision", [f"{HEAD}:base", "base"])  # "base" alone was an Alembic error
def test_offline_downgrade_script_applies(empty_dsn, revision):
    migrate(empty_dsn)
    script = io.StringIO()
    migrate(None, revision, sql=True, downgrade=True, output=script)
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
            [sys.executable, "-m", "lockstep", "migrate", "--dsn", empty_dsn],
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


HOST_ENV_PY = """
from alembic import context
from sqlalchemy import create_engine, pool

engine = create_engine(context.config.get_main_option("sqlalchemy.url"), poolclass=pool.NullPool)
with engine.connect() as connection:
    context.configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()
"""

HOST_REVISION = """
from alembic import op
revision = {rev!r}
down_revision = None
branch_labels = ("app",)
depends_on = None
def upgrade():
    op.execute("create table app_thing (id int primary key)")
def downgrade():
    op.execute("drop table app_thing")
"""


def host_project(tmp_path: Path, dsn: str, lockstep_versions: str, host_rev: str = "h001") -> Path:
    """A host application's Alembic project (README way (b)): its own plain env.py and one revision
    (branch ``app``), lockstep's versions in version_locations; returns its alembic.ini."""
    host = tmp_path / "host"
    (host / "versions").mkdir(parents=True)
    (host / "env.py").write_text(HOST_ENV_PY)
    (host / "script.py.mako").write_text(
        "revision = ${repr(up_revision)}\ndown_revision = ${repr(down_revision)}\n"
        "def upgrade():\n    pass\ndef downgrade():\n    pass\n"
    )
    (host / "versions" / f"{host_rev}_app.py").write_text(HOST_REVISION.format(rev=host_rev))
    url = "postgresql+psycopg://" + dsn.split("://", 1)[1]
    ini = tmp_path / "alembic.ini"
    ini.write_text(
        textwrap.dedent(
            f"""
            [alembic]
            script_location = %(here)s/host
            path_separator = space
            version_locations = %(here)s/host/versions {lockstep_versions}
            sqlalchemy.url = {url.replace("%", "%%")}
            """
        )
    )
    return ini


def host_alembic(ini: Path, *args: str, python: str | Path = sys.executable, check: bool = True):
    done = subprocess.run(
        [str(python), "-m", "alembic", "-c", str(ini), *args],
        cwd=ini.parent,
        capture_output=True,
        text=True,
    )
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def host_versions(dsn: str) -> set[str]:
    with psycopg.connect(dsn) as c:
        return {r[0] for r in c.execute("select version_num from alembic_version")}


def test_revision_ids_are_namespaced():
    script_dir = paths.alembic_dir() / "versions"
    assert HEAD == "lockstep_0002"
    assert sorted(p.name for p in script_dir.glob("*.py")) == ["lockstep_0001_core.py", "lockstep_0002.py"]


def test_host_application_alembic_installs_lockstep_branch(empty_dsn, tmp_path: Path):
    """README way (b): the host's own Alembic, with lockstep's versions folder in version_locations."""
    ini = host_project(tmp_path, empty_dsn, str(paths.alembic_dir() / "versions"))
    host_alembic(ini, "upgrade", "lockstep@head")
    with psycopg.connect(empty_dsn) as c:
        assert c.execute("select version_num from alembic_version").fetchall() == [(HEAD,)]
        assert c.execute("select to_regnamespace('lockstep') is not null").fetchone()[0]
        assert c.execute("select to_regclass('lockstep_alembic_version')").fetchone()[0] is None
    host_alembic(ini, "upgrade", "heads")
    assert host_versions(empty_dsn) == {HEAD, "h001"}
    host_alembic(ini, "downgrade", "lockstep@base")
    with psycopg.connect(empty_dsn) as c:
        assert c.execute("select version_num from alembic_version").fetchall() == [("h001",)]
        assert c.execute(LEFTOVERS).fetchall() == []


def test_host_revision_named_0001_coexists_with_lockstep(empty_dsn, tmp_path: Path):
    """A host revision id '0001' (lockstep's old id): both revisions are kept and installed, no warning."""
    ini = host_project(tmp_path, empty_dsn, str(paths.alembic_dir() / "versions"), host_rev="0001")
    done = host_alembic(ini, "heads")
    assert "present more than once" not in done.stderr, done.stderr
    assert {line.split()[0] for line in done.stdout.splitlines()} == {"0001", HEAD}
    host_alembic(ini, "upgrade", "heads")
    assert host_versions(empty_dsn) == {"0001", HEAD}


def test_host_alembic_takes_the_migrate_lock(empty_dsn, tmp_path: Path, connect):
    """A host env.py that takes no lock: lockstep's revision takes it itself, so the host upgrade waits
    while another session holds the migrate lock (e.g. a `lockstep migrate` in progress)."""
    ini = host_project(tmp_path, empty_dsn, str(paths.alembic_dir() / "versions"))
    holder = connect(empty_dsn)
    holder.execute(f"select pg_advisory_lock({MIGRATE_LOCK_KEY})")
    proc = subprocess.Popen(
        [sys.executable, "-m", "alembic", "-c", str(ini), "upgrade", "lockstep@head"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "the host's upgrade ran while the migrate lock was held"
            assert time.monotonic() < deadline, "the host's upgrade never waited on the migrate lock"
            waiting = holder.execute(
                "select count(*) from pg_locks l join pg_database d on d.oid = l.database"
                " where l.locktype = 'advisory' and not l.granted and d.datname = current_database()"
            ).fetchone()[0]
            if waiting:
                break
            time.sleep(0.05)
        assert one(empty_dsn, "select to_regnamespace('lockstep')") is None
    finally:
        holder.execute(f"select pg_advisory_unlock({MIGRATE_LOCK_KEY})")
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, out + err
    assert host_versions(empty_dsn) == {HEAD}


def test_moving_from_lockstep_migrate_to_host_alembic(empty_dsn, tmp_path: Path):
    """README: without `stamp` the host's upgrade stops with one clear line and changes nothing; with the
    README's commands (stamp, drop lockstep_alembic_version, upgrade heads) it goes through."""
    migrate(empty_dsn)
    ini = host_project(tmp_path, empty_dsn, str(paths.alembic_dir() / "versions"))
    done = host_alembic(ini, "upgrade", "heads", check=False)
    said = done.stdout + done.stderr  # alembic prints "FAILED: ..." on stdout
    assert done.returncode != 0
    assert "Traceback" not in said and "DuplicateSchema" not in said, said
    # the first revision's advice (it is frozen): stamp it; the later revisions find their schema there
    assert "alembic stamp lockstep_0001" in said and "drop table lockstep_alembic_version" in said, said
    assert len([line for line in said.splitlines() if line.startswith("FAILED:")]) == 1, said
    assert one(empty_dsn, "select to_regclass('public.app_thing')") is None  # one transaction: rolled back

    before = schema_dump(empty_dsn, "--schema=lockstep")
    host_alembic(ini, "stamp", "lockstep_0001")
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        c.execute("drop table lockstep_alembic_version")
    host_alembic(ini, "upgrade", "heads")
    assert host_versions(empty_dsn) == {HEAD, "h001"}
    assert one(empty_dsn, "select to_regclass('public.app_thing') is not null")
    assert schema_dump(empty_dsn, "--schema=lockstep") == before  # recorded, not changed


def test_lockstep_migrate_on_a_host_installed_schema_says_so(empty_dsn, tmp_path: Path):
    ini = host_project(tmp_path, empty_dsn, str(paths.alembic_dir() / "versions"))
    host_alembic(ini, "upgrade", "lockstep@head")
    done = _cli("migrate", "--dsn", empty_dsn)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "alembic upgrade heads" in errors[0], done.stderr
    current = _cli("migrate", "current", "--dsn", empty_dsn)
    assert current.returncode == 0 and "managed by your application's Alembic" in current.stdout, current
    assert "base (not installed)" not in current.stdout


def shadow_runner(ini: Path, kind: str) -> None:
    """The host project has its own ``runner`` (a package or a module) first on Alembic's import path
    (``prepend_sys_path = .``, Alembic's template default)."""
    ini.write_text(ini.read_text() + "prepend_sys_path = .\n")
    if kind == "package":
        (ini.parent / "runner").mkdir()
        (ini.parent / "runner" / "__init__.py").write_text("HOST = True\n")
    else:
        (ini.parent / "runner.py").write_text("HOST = True\n")


@pytest.mark.parametrize("kind", ["package", "module"])
def test_host_alembic_with_its_own_runner_from_an_editable_install(empty_dsn, tmp_path: Path, kind: str):
    """The package form `lockstep:_alembic/versions` resolves in an editable install (this test's own
    environment, `make .venv/.installed`) to the checkout's alembic/versions, beside a host `runner`."""
    import lockstep

    root = Path(__file__).resolve().parents[2]
    assert Path(lockstep.__file__).resolve().is_relative_to(root / "runner"), "an editable install"
    ini = host_project(tmp_path, empty_dsn, "lockstep:_alembic/versions")
    shadow_runner(ini, kind)
    heads = host_alembic(ini, "heads")
    assert {line.split()[0] for line in heads.stdout.splitlines()} == {"h001", HEAD}, heads.stderr
    host_alembic(ini, "upgrade", "lockstep@head")
    assert host_versions(empty_dsn) == {HEAD}
    host_alembic(ini, "upgrade", "heads")
    assert host_versions(empty_dsn) == {HEAD, "h001"}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["package", "module"])
def test_host_alembic_package_form_from_the_wheel(installed_wheel, empty_dsn, tmp_path: Path, kind: str):
    """README way (b) as written: version_locations `lockstep:_alembic/versions` (package resource, no
    site-packages path), `upgrade heads`, `alembic revision --version-path` into the host's folder; the
    host has its own `runner` package or module first on the import path."""
    bin_dir, _ = installed_wheel
    ini = host_project(tmp_path, empty_dsn, "lockstep:_alembic/versions")
    shadow_runner(ini, kind)
    heads = host_alembic(ini, "heads", python=bin_dir / "python")
    assert {line.split()[0] for line in heads.stdout.splitlines()} == {"h001", HEAD}, heads.stderr
    python = bin_dir / "python"
    host_alembic(ini, "upgrade", "heads", python=python)
    assert host_versions(empty_dsn) == {HEAD, "h001"}
    assert one(empty_dsn, "select to_regclass('lockstep_alembic_version')") is None

    versions = tmp_path / "host" / "versions"
    host_alembic(ini, "revision", "-m", "next", "--head", "app@head", python=python)
    assert len(list(versions.glob("*_next.py"))) == 1  # next to the host's head, never in lockstep's folder
    without = host_alembic(ini, "revision", "-m", "first", "--head", "base", python=python, check=False)
    assert without.returncode != 0 and "--version-path" in without.stdout + without.stderr
    host_alembic(
        ini, "revision", "-m", "first", "--head", "base", "--version-path", str(versions), python=python
    )
    assert len(list(versions.glob("*_first.py"))) == 1


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
    return _cli_run([sys.executable, "-m", "lockstep", *args], **env)


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
    assert done.returncode == 3  # no server answered
    assert done.stderr.startswith("Error: ") and "Traceback" not in done.stderr, done.stderr


def test_checkout_alembic_ini(empty_dsn):
    """`alembic -x dsn=... upgrade head` from the checkout's alembic.ini, then `downgrade base`."""
    root = Path(__file__).resolve().parents[2]

    def alembic(*args: str) -> None:
        done = _cli_run([sys.executable, "-m", "alembic", *args], cwd=root)
        assert done.returncode == 0, done.stderr

    alembic("-x", f"dsn={empty_dsn}", "upgrade", "head")
    assert versions(empty_dsn) == [HEAD]
    alembic("-x", f"dsn={empty_dsn}", "downgrade", "base")
    assert versions(empty_dsn) == []


WATCHED = """
create table p (id bigint primary key);
create table d (p_id bigint primary key references p on delete cascade, n int);
create function dc(ids bigint[]) returns table (p_id bigint, n int) language sql stable
    as $$ select id, 1 from public.p where ids is null or id = any(ids) $$;
select lockstep.define_derived('d', 'd', 'dc(bigint[])', 'p');
select lockstep.watch('d', 'p', 'id');
insert into p values (1), (2);
"""


def test_a_downgrade_never_keeps_the_application_waiting(empty_dsn, connect):
    # A plain DROP SCHEMA lockstep CASCADE queued behind an open application transaction on a watched table
    # (its triggers go with the schema: ACCESS EXCLUSIVE on the table) while holding locks on lockstep's
    # own objects, so the application's next write waited behind it until that transaction ended (7 s
    # seen, or a deadlock). It now locks through lockstep._ddl: at most 100 ms at a time.
    migrate(empty_dsn)
    observer = connect(empty_dsn)
    observer.execute(WATCHED)
    holder = connect(empty_dsn)
    holder.execute("begin")
    holder.execute("update p set id = id where id = 1")  # fires the trigger: holds p and the queue
    app = connect(empty_dsn)
    app.execute("set statement_timeout = '5s'")
    known = [c.info.backend_pid for c in (observer, holder, app)]
    outcome: dict[str, object] = {}

    def downgrade() -> None:
        try:
            outcome["result"] = migrate(empty_dsn, "base", downgrade=True)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            outcome["error"] = exc

    thread = threading.Thread(target=downgrade)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not observer.execute(
            "select exists (select from pg_stat_activity where pid <> all(%s)"
            " and datname = current_database() and %s = any(pg_blocking_pids(pid)))",
            [known, holder.info.backend_pid],
        ).fetchone()[0]:
            assert time.monotonic() < deadline and thread.is_alive(), outcome
            time.sleep(0.01)
        app.execute("insert into p values (3)")  # did not wait for the holder (57014 after 5 s before)
        assert thread.is_alive()  # the downgrade is still waiting for the holder, giving way meanwhile
    finally:
        holder.execute("commit")
        thread.join(60)
    assert "error" not in outcome, outcome
    assert observer.execute("select to_regnamespace('lockstep') is null").fetchone()[0]
    assert observer.execute("select count(*) from p").fetchone()[0] == 3


@pytest.mark.parametrize("direction", ["up", "down"])
def test_a_revision_never_keeps_the_application_waiting(empty_dsn, connect, direction):
    """0002 replaces lockstep's policies (ACCESS EXCLUSIVE on its tables): queued behind an open application
    transaction that wrote the queue, a plain ALTER held every later write of a watched table behind it."""
    migrate(empty_dsn, "lockstep_0001" if direction == "up" else HEAD)
    observer = connect(empty_dsn)
    observer.execute(WATCHED)
    holder = connect(empty_dsn)
    holder.execute("begin")
    holder.execute("update p set id = id where id = 1")  # fires the trigger: holds the queue
    app = connect(empty_dsn)
    app.execute("set statement_timeout = '5s'")
    known = [c.info.backend_pid for c in (observer, holder, app)]
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            if direction == "up":
                outcome["result"] = migrate(empty_dsn, HEAD)
            else:
                outcome["result"] = migrate(empty_dsn, "lockstep_0001", downgrade=True)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not observer.execute(
            "select exists (select from pg_stat_activity where pid <> all(%s)"
            " and datname = current_database() and %s = any(pg_blocking_pids(pid)))",
            [known, holder.info.backend_pid],
        ).fetchone()[0]:
            assert time.monotonic() < deadline and thread.is_alive(), outcome
            time.sleep(0.01)
        app.execute("insert into p values (3)")  # does not wait for the migration's queued locks
        assert thread.is_alive()
    finally:
        holder.execute("commit")
        thread.join(60)
    assert "error" not in outcome, outcome
    assert versions(empty_dsn) == [HEAD if direction == "up" else "lockstep_0001"]
