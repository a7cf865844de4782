"""Shared fixtures: real PostgreSQL, one template database per kind, one cloned database per test.

Fixtures (all databases are dropped at the end, even on failure or Ctrl-C):
- ``admin_dsn`` (session) -> str: superuser DSN (env LOCKSTEP_TEST_ADMIN_DSN).
- ``make_db`` (function) -> ``make_db(template: str | None = None) -> dsn``: a fresh database, empty or
  cloned from a template database name; dropped after the test.
- ``template_db`` (session) -> str: name of a database migrated to head (built once per session).
- ``dsn`` (function) -> str: DSN of a fresh clone of ``template_db``.
- ``empty_dsn`` (function) -> str: DSN of a fresh database without lockstep (for migration tests).
- ``conn`` (function) -> psycopg.Connection to ``dsn``, autocommit.
- ``connect`` (function) -> ``connect(conninfo=None, **kwargs) -> psycopg.Connection``: more sessions
  (default: to ``dsn``, autocommit=True); all closed at teardown.

Expected files (schedule traces, the schema dump):
- ``update_expected`` (function) -> bool: True with ``pytest --update-expected`` or
  ``LOCKSTEP_UPDATE_EXPECTED=1``: comparisons rewrite their expected file instead of failing.
- ``expected_trace`` (function) -> ``expected_trace(*results)``: compares the traces of these
  ``isolation.Result``s (joined by a blank line) with ``tests/expected/<module>/<test>.out``.

Markers by kind (``KINDS``; pyproject.toml registers them, ``--strict-markers``): every test gets the marker
of its file, matched by name or by folder, so ``make test-fast`` (``-m "not runner and not packaging and not
tools and not slow"``) keeps working when files move into folders. A test file of no kind is an error.

More templates, one line each (``setup`` gets the new template's DSN; ``base`` names a template fixture to
start from, else the database starts empty):
    example_template = make_template("example", install_example, base="template_db")
"""

from __future__ import annotations

import fnmatch
import os
import re
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from isolation import Result, check_expected, update_requested
from psycopg import sql
from psycopg.conninfo import make_conninfo

from lockstep.migrate import migrate

ADMIN_DSN = os.environ.get("LOCKSTEP_TEST_ADMIN_DSN", "postgresql://root@127.0.0.1:5432/postgres")
PREFIX = "lockstep_t_"
RUN_TAG = f"{PREFIX}{os.getpid()}_{secrets.token_hex(3)}"

TESTS_DIR = Path(__file__).resolve().parent
EXPECTED_DIR = TESTS_DIR / "expected"

# kind -> patterns matched against a test file's path relative to tests/ and against its stem
KINDS: dict[str, tuple[str, ...]] = {
    "schedules": ("schedules/*", "test_schedules_*", "test_properties", "test_isolation_harness"),
    "runner": ("runner/*", "test_runner*", "test_cli_*", "test_faults", "test_web", "test_web_browser"),
    "packaging": ("packaging/*", "test_wheel", "test_readme"),
    "tools": ("tools/*", "test_demo", "test_bench", "test_bench_oltp", "test_storm"),
    "docs": ("docs/*",),
    "sql": (
        "sql/*",
        "regress/*",
        "test_app_safety",
        "test_define_derived",
        "test_history",
        "test_hostile_names",
        "test_jobs",
        "test_migrations",
        "test_queue",
        "test_recompute",
        "test_released_revisions",
        "test_schema",
        "test_security",
        "test_sqlfiles",
        "test_worker_faults",
    ),
}

_created: set[str] = set()  # every database this run created and has not dropped yet
_counter = 0


def dsn_for(dbname: str, admin_dsn: str = ADMIN_DSN) -> str:
    """The admin DSN with its database replaced (stays a URL when it was one)."""
    if "://" in admin_dsn:
        parts = urlsplit(admin_dsn)
        return urlunsplit(parts._replace(path="/" + dbname))
    return make_conninfo(admin_dsn, dbname=dbname)


def _admin() -> psycopg.Connection:
    return psycopg.connect(ADMIN_DSN, autocommit=True)


def create_database(suffix: str, template: str | None = None) -> str:
    """Create ``<run tag>_<suffix>`` (cloned from ``template`` if given) and return its name."""
    global _counter
    _counter += 1
    name = f"{RUN_TAG}_{_counter}_{suffix}"[:63]
    stmt = sql.SQL("create database {}").format(sql.Identifier(name))
    if template is not None:
        # PostgreSQL 15's default strategy (wal_log) measured ~40 ms per create+connect+drop of a small
        # template here, against ~90 ms for strategy file_copy (two checkpoints); keep the default.
        stmt += sql.SQL(" template {}").format(sql.Identifier(template))
    with _admin() as admin:
        _created.add(name)
        admin.execute(stmt)
    return name


def drop_database(name: str) -> None:
    with _admin() as admin:
        admin.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))
    _created.discard(name)


def _drop_stale_databases() -> None:
    """Drop test databases left by earlier runs whose process is gone (killed with SIGKILL...)."""
    with _admin() as admin:
        names = [
            r[0]
            for r in admin.execute(
                "select datname from pg_database where datname like %s", [PREFIX.replace("_", r"\_") + "%"]
            )
        ]
    for name in names:
        pid = name[len(PREFIX) :].split("_", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            drop_database(name)
        except PermissionError:
            pass


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-expected",
        action="store_true",
        help="rewrite tests/expected/* instead of failing on a difference",
    )


def kind_of(path: Path) -> str | None:
    """The kind (marker name) of a test file, from ``KINDS``."""
    try:
        rel = path.resolve().relative_to(TESTS_DIR).as_posix()
    except ValueError:
        rel = path.name
    for kind, patterns in KINDS.items():  # a folder (tests/<kind>/...) decides first
        if any("/" in p and fnmatch.fnmatch(rel, p) for p in patterns):
            return kind
    for kind, patterns in KINDS.items():
        if any("/" not in p and fnmatch.fnmatch(path.stem, p) for p in patterns):
            return kind
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unknown: set[str] = set()
    for item in items:
        kind = kind_of(item.path)
        if kind is None:
            unknown.add(str(item.path))
        else:
            item.add_marker(getattr(pytest.mark, kind))
    if unknown:
        raise pytest.UsageError(
            "test files of no kind (add a pattern to KINDS in tests/conftest.py): "
            + ", ".join(sorted(unknown))
        )


def pytest_sessionstart(session: pytest.Session) -> None:
    _drop_stale_databases()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for name in sorted(_created):
        drop_database(name)


def make_template(name_suffix: str, setup: Callable[[str], None], base: str | None = None):
    """A session fixture yielding the name of a template database built once by ``setup(dsn)``.

    ``base``: name of another template fixture to clone first (else the template starts empty).
    """

    @pytest.fixture(scope="session")
    def _template(request: pytest.FixtureRequest) -> Iterator[str]:
        base_name = request.getfixturevalue(base) if base else None
        name = create_database(f"{name_suffix}_tpl", template=base_name)
        try:
            setup(dsn_for(name))
            # A template must have no other session when it is cloned; setup closed its own.
            with _admin() as admin:
                admin.execute(
                    "select pg_terminate_backend(pid) from pg_stat_activity where datname = %s", [name]
                )
            yield name
        finally:
            drop_database(name)

    return _template


def _migrate_to_head(dsn: str) -> None:
    migrate(dsn)


template_db = make_template("lockstep", _migrate_to_head)


@pytest.fixture
def update_expected(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-expected")) or update_requested()


def expected_path(item: pytest.Item) -> Path:
    """tests/expected/<module without test_>/<test without test_, parameters as -id>.out"""
    module = item.path.stem.removeprefix("test_")
    name = item.name.removeprefix("test_")
    name = re.sub(r"\[(.*)\]$", r"-\1", name)
    return EXPECTED_DIR / module / (re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".out")


@pytest.fixture
def expected_trace(request: pytest.FixtureRequest, update_expected: bool) -> Callable[..., None]:
    path = expected_path(request.node)

    def _check(*results: Result) -> None:
        __tracebackhide__ = True
        check_expected(path, "\n".join(r.trace for r in results), update=update_expected)

    return _check


@pytest.fixture(scope="session")
def admin_dsn() -> str:
    return ADMIN_DSN


@pytest.fixture
def make_db() -> Iterator[Callable[..., str]]:
    names: list[str] = []

    def _make(template: str | None = None, suffix: str = "db") -> str:
        names.append(create_database(suffix, template=template))
        return dsn_for(names[-1])

    yield _make
    for name in reversed(names):
        drop_database(name)


@pytest.fixture
def dsn(make_db: Callable[..., str], template_db: str) -> str:
    return make_db(template_db)


@pytest.fixture
def empty_dsn(make_db: Callable[..., str]) -> str:
    return make_db(None, suffix="empty")


@pytest.fixture
def connect(request: pytest.FixtureRequest) -> Iterator[Callable[..., psycopg.Connection]]:
    opened: list[psycopg.Connection] = []

    def _connect(conninfo: str | None = None, **kwargs) -> psycopg.Connection:
        kwargs.setdefault("autocommit", True)
        # The lockstep clone (``dsn``) is only made when no other database is named.
        c = psycopg.connect(conninfo or request.getfixturevalue("dsn"), **kwargs)
        opened.append(c)
        return c

    yield _connect
    for c in reversed(opened):
        c.close()


@pytest.fixture
def conn(connect: Callable[..., psycopg.Connection]) -> psycopg.Connection:
    return connect()


def _install_example(dsn: str) -> None:
    from lockstep.lab import example

    with psycopg.connect(dsn, autocommit=True) as c:
        # every = 1 day: tests cloned minutes later must not find the periodic recompute due (a due
        # recompute makes work() give way); tests that want it due set next_run_at themselves.
        example.install(c, parents=200, every="1 day")
        c.execute("select lockstep.recompute(%s)", [example.JOB])
        c.execute("delete from lockstep.queue")
        c.execute("analyze")


example_template = make_template("example", _install_example, base="template_db")


@pytest.fixture
def example_dsn(make_db: Callable[..., str], example_template: str) -> str:
    """A fresh database with lockstep, the example app (200 exams), job exam_keys (every 1 day) recomputed,
    queue empty."""
    return make_db(example_template)


@pytest.fixture
def ex(connect: Callable[..., psycopg.Connection], example_dsn: str) -> psycopg.Connection:
    """Autocommit connection to ``example_dsn``."""
    return connect(example_dsn)


@pytest.fixture
def exconnect(
    connect: Callable[..., psycopg.Connection], example_dsn: str
) -> Callable[..., psycopg.Connection]:
    """More sessions to ``example_dsn`` (autocommit by default)."""
    return lambda **kwargs: connect(example_dsn, **kwargs)


@pytest.fixture
def runners(tmp_path):
    """Start ``lockstep run`` processes: ``runners(dsn, *args, env=None) -> runner_procs.Runner``; each
    logs to a file in tmp_path, and every one still running is killed at teardown."""
    from runner_procs import Runner

    started: list[Runner] = []

    def _start(dsn: str, *args: str, env: dict | None = None) -> Runner:
        r = Runner(dsn, list(args), tmp_path / f"runner{len(started)}.log", env=env)
        started.append(r)
        return r

    yield _start
    for r in started:
        r.kill()


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory):
    """``(bin_dir, wheel)``: the wheel built from this checkout (once per session), installed non-editable
    in a fresh venv. Used by tests/packaging/test_wheel.py, the README worked example and the host-Alembic
    tests."""
    import subprocess
    import sys
    import venv
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    tmp = tmp_path_factory.mktemp("wheel")

    def run(*cmd) -> None:
        done = subprocess.run([str(c) for c in cmd], cwd=tmp, capture_output=True, text=True)
        assert done.returncode == 0, f"{cmd} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"

    # README "Install": python3 -m pip wheel --no-deps --wheel-dir dist .   (here with absolute paths)
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", tmp / "dist", root)
    (wheel,) = (tmp / "dist").glob("pg_lockstep-*.whl")
    venv.EnvBuilder(with_pip=True).create(tmp / "venv")
    bin_dir = tmp / "venv" / "bin"
    run(bin_dir / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check", wheel)
    return bin_dir, wheel
