"""CLI conventions (docs/cli.md): -h, --log-level / -v, LOCKSTEP_* environment variables,
one meaning for --json, migrate sub-actions that do what they say, --metrics-host, the start-up log line,
`lockstep retry` and `lockstep drop`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import psycopg
import pytest

from lockstep.cli import main
from lockstep.migrate import head

HEAD = head()


def lockstep(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    base = {
        k: v for k, v in os.environ.items() if k != "DATABASE_URL" and not k.startswith(("PG", "LOCKSTEP_"))
    }
    return subprocess.run(
        [sys.executable, "-m", "lockstep", *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -h ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", [[], *[[name] for name in sorted(main.commands)]])
def test_short_help_everywhere(cmd):
    p = lockstep(*cmd, "-h")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("Usage: lockstep"), p.stdout
    assert p.stdout == lockstep(*cmd, "--help").stdout


def test_help_shows_the_environment_variables():
    out = lockstep("run", "-h").stdout
    for var in (
        "LOCKSTEP_RUN_TICK",
        "LOCKSTEP_RUN_METRICS_HOST",
        "LOCKSTEP_RUN_CONNECTION_CHECK_INTERVAL",
        "LOCKSTEP_DSN",
        "DATABASE_URL",
        "LOCKSTEP_LOG_LEVEL",
    ):
        assert var in out, var


# logging -------------------------------------------------------------------------------------------------


def test_start_up_line_without_the_password(dsn):
    rest = dsn.split("://", 1)[1].split("@", 1)
    with_password = f"postgresql://{rest[0]}:s3cret@{rest[1]}"  # trust authentication ignores it
    p = lockstep("run", "--once", "--dsn", with_password)
    assert p.returncode == 0, p.stderr
    (line,) = [ln for ln in p.stderr.splitlines() if "run starting" in ln]
    assert " INFO lockstep 0.1.0 run starting: " in line and "password=***" in line, line
    assert "s3cret" not in p.stderr
    assert "jobs all; once;" in line and "metrics off" in line


def test_log_level_and_verbose(dsn):
    quiet = lockstep("--log-level", "warning", "run", "--once", "--dsn", dsn)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    assert lockstep("run", "--once", "--dsn", dsn, LOCKSTEP_LOG_LEVEL="warning").stderr == ""
    assert lockstep("run", "--once", "--dsn", dsn, "--log-level", "WARNING").stderr == ""

    default = lockstep("run", "--once", "--dsn", dsn).stderr
    assert "run starting" in default and "connected: backend pid" not in default
    for args in (["-v", "run", "--once"], ["run", "-v", "--once"], ["--log-level", "debug", "run", "--once"]):
        p = lockstep(*args, "--dsn", dsn)
        assert p.returncode == 0 and " DEBUG connected: backend pid " in p.stderr, (args, p.stderr)
    # --log-level wins over -v
    assert "DEBUG" not in lockstep("-v", "run", "--once", "--log-level", "info", "--dsn", dsn).stderr


def test_a_pass_whose_keys_failed_is_logged_as_a_warning(dsn):
    # it was logged as a plain "work done: +0 ~0 -0" at INFO: an operator reading the logs did not see the
    # poison key
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(
            "create table p (id bigint primary key); insert into p values (1), (2);"
            " create table d (p_id bigint primary key references p on delete cascade, n int);"
            " create function dc(ids bigint[]) returns table (p_id bigint, n int) language sql stable"
            " as $$ select id, 1 / (id - 2)::int from public.p where ids is null or id = any(ids) $$;"
            " select lockstep.define_derived('d', 'd', 'dc(bigint[])', 'p', every => '1 day');"
            " select lockstep.recompute('d');"  # fails as a whole: then the pass below is the worker's
            " select lockstep.enqueue('d', array[1, 2]);"
        )
    p = lockstep("run", "--once", "--dsn", dsn)
    warnings = [ln for ln in p.stderr.splitlines() if " WARNING " in ln and "d work" in ln]
    assert warnings and "key(s) failed" in warnings[0] and "division by zero" in warnings[0], p.stderr


# LOCKSTEP_* environment variables ------------------------------------------------------------------------


def test_options_from_lockstep_variables(dsn):
    p = lockstep("run", "--once", "--dsn", dsn, LOCKSTEP_RUN_JOB="no_such_job")
    assert p.returncode == 4 and "no job no_such_job (--job)" in p.stderr, p.stderr

    p = lockstep("run", "--once", "--dsn", dsn, LOCKSTEP_RUN_TICK="0")
    assert p.returncode == 2 and "Invalid value for '--tick'" in p.stderr, p.stderr  # from LOCKSTEP_RUN_TICK

    # the command line wins over the variable
    assert lockstep("run", "--once", "--tick", "1", "--dsn", dsn, LOCKSTEP_RUN_TICK="0").returncode == 0

    p = lockstep("status", "--json", LOCKSTEP_DSN=dsn, LOCKSTEP_STATUS_JSON="1")
    assert p.returncode == 0 and json.loads(p.stdout) == [], p.stdout + p.stderr


def test_connection_check_interval_reaches_the_session(dsn, tmp_path):
    """--connection-check-interval sets the setting through the startup options (nothing for a unit file
    or a shell to split); checked on the runner's own backend while it runs a job."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("create table public.seen (setting text)")
        c.execute(
            "create function public.record() returns void language sql as"
            " $$ insert into public.seen select current_setting('client_connection_check_interval') $$"
        )
        c.execute("select lockstep.define_job('rec', 'public.record()', every => '1 hour')")
    p = lockstep(
        "run", "--once", "--connection-check-interval", "1500ms", "--dsn", dsn, PGOPTIONS="-c work_mem=8MB"
    )
    assert p.returncode == 0, p.stderr
    with psycopg.connect(dsn) as c:
        assert c.execute("select setting from public.seen").fetchall() == [("1500ms",)]
    bad = lockstep("run", "--once", "--connection-check-interval", "1 s; drop", "--dsn", dsn)
    assert bad.returncode == 2 and "--connection-check-interval" in bad.stderr


def test_metrics_host_binds_that_address():
    code = (
        "import socket, psutil, sys\n"
        "from lockstep.loop import Metrics\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "Metrics(port, *sys.argv[1:])\n"
        "print([(c.laddr.ip, c.laddr.port == port) for c in psutil.Process().net_connections('tcp')"
        " if c.status == 'LISTEN'])\n"
    )
    local = subprocess.run(
        [sys.executable, "-c", code, "127.0.0.1"], capture_output=True, text=True, check=True
    )
    assert local.stdout.strip() == "[('127.0.0.1', True)]"
    default = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert default.stdout.strip() == "[('0.0.0.0', True)]"


def test_metrics_port_0_names_the_port_it_bound():
    """--metrics-port 0 (accepted: 0..65535) bound a free port, and the start-up line said
    http://127.0.0.1:0/metrics, so the endpoint could not be found from the log."""
    code = (
        "import psutil\n"
        "from lockstep.loop import Metrics\n"
        "m = Metrics(0, '127.0.0.1')\n"
        "ports = [c.laddr.port for c in psutil.Process().net_connections('tcp') if c.status == 'LISTEN']\n"
        "print(m.url, ports)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    url, ports = out.split(" ", 1)
    port = int(url.removeprefix("http://127.0.0.1:").removesuffix("/metrics"))
    assert port > 0 and f"[{port}]" == ports.strip(), out
    from lockstep.loop import Metrics

    assert Metrics(None).url is None  # no --metrics-port: the start-up line says "off"


def test_a_metrics_port_in_use_is_a_setup_error_that_says_so():
    """A taken --metrics-port printed only "Error: [Errno 98] Address already in use", exit 1 (a run
    failed), before any line said what it was for: exit 4, naming the metrics server."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = lockstep("run", "--once", "--metrics-port", str(port), "--metrics-host", "127.0.0.1",
                     "--dsn", "host=127.0.0.1 port=1 connect_timeout=1")  # fmt: skip
    assert p.returncode == 4, p.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port} (--metrics-port, --metrics-host)" in p.stderr, p.stderr


# --json --------------------------------------------------------------------------------------------------


def test_status_names_tables_with_their_schema_and_says_when_no_job_is_defined(conn, dsn):
    """status printed a target or parent on the search_path without its schema (public.d and other.d both
    as "d"), and "no jobs visible to role ..." where no job was defined at all."""
    p = lockstep("status", "--dsn", dsn)
    assert (p.returncode, p.stdout.strip()) == (0, "no jobs defined"), p.stderr
    conn.execute(
        "create table p (id int primary key);"
        " create table d (id int primary key references p on delete cascade, v int);"
        " create function dc(ids int[]) returns table (id int, v int) language sql"
        " as $$ select id, 1 from public.p where ids is null or id = any(ids) $$;"
        " select lockstep.define_derived('dj', 'd', 'dc(int[])', 'p')"
    )
    rows = json.loads(lockstep("status", "--json", "--dsn", dsn).stdout)
    assert (rows[0]["target"], rows[0]["parent"]) == ("public.d", "public.p"), rows


def test_json_means_json_on_stdout_everywhere(example_dsn):
    outputs = {
        "status": lockstep("status", "--json", "--dsn", example_dsn),
        "migrate current": lockstep("migrate", "current", "--json", "--dsn", example_dsn),
        "migrate check": lockstep("migrate", "check", "--json", "--dsn", example_dsn),
        "retry": lockstep("retry", "exam_keys", "--json", "--dsn", example_dsn),
        "drop": lockstep("drop", "exam_keys", "--json", "--dsn", example_dsn),
    }
    parsed = {}
    for name, p in outputs.items():
        assert p.returncode == 0, (name, p.stderr)
        parsed[name] = json.loads(p.stdout)
    assert [r["job"] for r in parsed["status"]] == ["exam_keys"]
    assert (
        parsed["migrate current"]
        == parsed["migrate check"]
        == {"current": [HEAD], "head": HEAD, "at_head": True}
    )
    assert parsed["retry"] == {"job": "exam_keys", "requeued": 0}
    assert parsed["drop"] == {"job": "exam_keys", "dropped": True}
    for cmd in ("demo", "bench"):  # the lab commands: the same flag, no file argument
        opt = next(o for o in main.commands[cmd].params if o.name == "json")
        assert opt.is_flag and opt.opts == ["--json"]


def test_docs_name_every_command_that_takes_json():
    """docs/cli.md lists the commands that take --json: diff, pause, resume and backfill were missing."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    line = next(ln for ln in text.splitlines() if ln.rstrip().endswith("take it."))
    named = {n.split()[0] for n in re.findall(r"`([^`]+)`", line)}
    takes = {name for name, cmd in main.commands.items() if any(p.name == "json" for p in cmd.params)}
    assert named == takes, (named, takes)


# migrate sub-actions -------------------------------------------------------------------------------------


def test_migrate_actions_do_what_they_say(empty_dsn):
    def schema() -> bool:
        with psycopg.connect(empty_dsn) as c:
            return c.execute("select to_regnamespace('lockstep') is not null").fetchone()[0]

    p = lockstep("migrate", "current", "--dsn", empty_dsn)
    assert (p.returncode, p.stdout.strip()) == (0, f"base (not installed) (head is {HEAD})")
    p = lockstep("migrate", "check", "--dsn", empty_dsn)
    assert p.returncode == 1 and "run `lockstep migrate`" in p.stdout
    assert not schema()  # current and check change nothing

    assert lockstep("migrate", "--dsn", empty_dsn).returncode == 0
    assert lockstep("migrate", "current", "--dsn", empty_dsn).stdout.strip() == f"{HEAD} (head)"
    assert lockstep("migrate", "check", "--dsn", empty_dsn).returncode == 0

    # an upgrade to base is not "already at": it is refused, and changes nothing
    p = lockstep("migrate", "--revision", "base", "--dsn", empty_dsn)
    assert p.returncode == 2 and "already at" not in p.stderr and "downgrade --revision base" in p.stderr
    assert schema()
    p = lockstep("migrate", "downgrade", "--dsn", empty_dsn)
    assert p.returncode == 2 and "needs --revision" in p.stderr
    assert schema()

    p = lockstep("migrate", "downgrade", "--revision", "base", "--dsn", empty_dsn)
    assert p.returncode == 0 and f"lockstep schema: {HEAD} -> base" in p.stderr, p.stderr
    assert not schema()
    assert lockstep("migrate", "current", "--dsn", empty_dsn).stdout.startswith("base (not installed)")


DOWNGRADE_OWNER_SQL = """
create table own.p (id bigint primary key);
create table own.d (id bigint primary key references own.p on delete cascade, n int not null);
create function own.dc(ids bigint[]) returns table (id bigint, n int) language sql stable
    as 'select id, 1 from own.p where ids is null or id = any(ids)';
select lockstep.define_derived('own_d', 'own.d', 'own.dc(bigint[])', 'own.p');
select lockstep.watch('own_d', 'own.p', 'id');
"""


@pytest.fixture
def installer(empty_dsn):
    """(admin connection, installer role, other role, dsn of a role): the database handed to a new
    installer role (its owner, not a superuser) that installed lockstep; a second role beside it; both
    dropped at the end."""
    from psycopg import sql
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    db = conninfo_to_dict(empty_dsn)["dbname"]
    inst, other = f"inst_{os.getpid()}", f"other_{os.getpid()}"
    admin = psycopg.connect(empty_dsn, autocommit=True)
    try:
        for r in (inst, other):
            admin.execute(sql.SQL("create role {} login").format(sql.Identifier(r)))
        admin.execute(
            sql.SQL("alter database {} owner to {}").format(sql.Identifier(db), sql.Identifier(inst))
        )
        assert lockstep("migrate", "--dsn", make_conninfo(empty_dsn, user=inst)).returncode == 0
        yield admin, inst, other, lambda role: make_conninfo(empty_dsn, user=role)
    finally:
        admin.execute(sql.SQL("alter database {} owner to current_user").format(sql.Identifier(db)))
        for r in (other, inst):
            admin.execute(sql.SQL("drop owned by {} cascade").format(sql.Identifier(r)))
            admin.execute(sql.SQL("drop role {}").format(sql.Identifier(r)))
        admin.close()


def test_a_downgrade_by_the_installer_says_which_owners_must_drop_their_jobs_first(installer, empty_dsn):
    """The installer (the database's owner, not a superuser) downgrading after a job owner of
    docs/security.md watched its own tables got "permission denied for schema blog" and the install hint
    (get CREATE on the database it owned): dropping watch()'s triggers needs each table's
    ownership. The downgrade now says so up front, naming the tables, their owners and what to do, and
    changes nothing; once the owner has dropped its job, the installer's downgrade goes through."""
    from psycopg import sql

    admin, inst, own, as_role = installer
    admin.execute(sql.SQL("create schema own authorization {}").format(sql.Identifier(own)))
    for g in [
        "grant usage on schema lockstep to {}",
        "grant select, insert, update, delete on lockstep.job to {}",
        "grant select, insert, update on lockstep.job_state to {}",
        "grant select, insert, delete on lockstep.queue, lockstep.recompute_flag to {}",
        "grant select, delete on lockstep.key_failure to {}",
    ]:
        admin.execute(sql.SQL(g).format(sql.Identifier(own)))
    with psycopg.connect(as_role(own), autocommit=True) as c:
        c.execute(DOWNGRADE_OWNER_SQL)
    p = lockstep("migrate", "downgrade", "--revision", "base", "--dsn", as_role(inst))
    assert p.returncode == 4, p.stderr
    assert f"own.p (owner {own})" in p.stderr and "lockstep drop JOB" in p.stderr, p.stderr
    assert "CREATE on the database" not in p.stderr, p.stderr
    triggers = "select count(*) from pg_trigger where tgrelid = 'own.p'::regclass and not tgisinternal"
    assert admin.execute(triggers).fetchone()[0] == 4
    assert lockstep("migrate", "current", "--dsn", empty_dsn).stdout.strip() == f"{HEAD} (head)"
    with psycopg.connect(as_role(own), autocommit=True) as c:
        c.execute("select lockstep.drop_job('own_d')")
    p = lockstep("migrate", "downgrade", "--revision", "base", "--dsn", as_role(inst))
    assert p.returncode == 0, p.stderr
    assert admin.execute("select to_regnamespace('lockstep') is null").fetchone()[0]


def test_a_downgrade_names_a_watched_table_whose_schema_the_installer_may_not_use(installer, empty_dsn):
    """The installer owning a watched table in a schema it lost USAGE on passed the downgrade's ownership
    check, then failed on the lock with the install hint: the check covers the schema."""
    from psycopg import sql

    admin, inst, other, as_role = installer
    admin.execute(sql.SQL("create schema own authorization {}").format(sql.Identifier(other)))
    admin.execute(sql.SQL("grant usage, create on schema own to {}").format(sql.Identifier(inst)))
    with psycopg.connect(as_role(inst), autocommit=True) as c:
        c.execute(DOWNGRADE_OWNER_SQL)
    admin.execute(sql.SQL("revoke usage on schema own from {}").format(sql.Identifier(inst)))
    p = lockstep("migrate", "downgrade", "--revision", "base", "--dsn", as_role(inst))
    assert p.returncode == 4 and "own.p (no USAGE on its schema)" in p.stderr, p.stderr
    assert lockstep("migrate", "current", "--dsn", empty_dsn).stdout.strip() == f"{HEAD} (head)"


def test_migrate_upgrade_never_goes_down_in_python(empty_dsn):
    from lockstep.migrate import MigrateError, migrate

    migrate(empty_dsn)
    with pytest.raises(MigrateError, match="downgrade"):
        migrate(empty_dsn, "base")


# retry / drop --------------------------------------------------------------------------------------------


def test_retry_of_char_n_keys_takes_them_whole(conn, dsn):
    # the CLI cast the keys to the regtype name of the key type: 'character', which is char(1), so
    # `lockstep retry bp AB1234` looked for 'A', put 0 keys back and exited 0
    conn.execute(
        "create table p (k char(6) primary key);"
        " create table d (k char(6) primary key references p on delete cascade, n int);"
        " create function dc(ks char(6)[]) returns table (k char(6), n int) language sql stable"
        " as $$ select k, 1 from public.p where ks is null or k = any(ks) $$;"
        " select lockstep.define_derived('d', 'd', 'dc(bpchar[])', 'p');"
        " insert into lockstep.key_failure (job, key, attempts, last_error, retry_at, parked)"
        " values ('d', 'AB1234', 5, 'boom', now(), true)"
    )
    p = lockstep("retry", "d", "AB1234", "--dsn", dsn)
    assert (p.returncode, p.stdout.strip()) == (
        0,
        "d: 1 key back in the queue; its failure backoff, if any, ended",
    )
    assert conn.execute("select key from lockstep.queue").fetchall() == [("AB1234",)]


def test_retry_and_drop(ex, example_dsn):
    ex.execute(
        "insert into lockstep.key_failure (job, key, attempts, last_error, retry_at, parked)"
        " values ('exam_keys', '5', 5, 'boom', now(), true), ('exam_keys', '6', 5, 'boom', now(), true)"
    )
    assert lockstep("status", "--dsn", example_dsn).returncode == 1  # parked keys: unhealthy

    p = lockstep("retry", "exam_keys", "5", "--dsn", example_dsn)
    assert (p.returncode, p.stdout.strip()) == (
        0,
        "exam_keys: 1 key back in the queue; its failure backoff, if any, ended",
    ), p.stderr
    assert ex.execute("select key from lockstep.queue where job = 'exam_keys'").fetchall() == [("5",)]
    assert ex.execute("select key from lockstep.parked_keys").fetchall() == [("6",)]

    p = lockstep("retry", "exam_keys", "not-a-number", "--dsn", example_dsn)
    assert p.returncode == 2 and p.stderr.startswith("Error: ") and "Traceback" not in p.stderr, p.stderr
    assert "without KEYS drops such keys" in p.stderr, p.stderr  # what to do about it

    p = lockstep("retry", "exam_keys", "--dsn", example_dsn)
    assert (p.returncode, p.stdout.strip()) == (
        0,
        "exam_keys: 1 key back in the queue; its failure backoff, if any, ended",
    )
    assert lockstep("status", "--dsn", example_dsn).returncode == 0

    p = lockstep("retry", "no_such_job", "--dsn", example_dsn)
    assert p.returncode == 1 and 'unknown job "no_such_job"' in p.stderr

    triggers = "select count(*) from pg_trigger where tgname ilike '%lockstep%'"
    assert ex.execute(triggers).fetchone()[0] > 0
    p = lockstep("drop", "exam_keys", "--dsn", example_dsn)
    assert (p.returncode, p.stdout.strip()) == (0, "exam_keys: dropped"), p.stderr
    assert ex.execute("select count(*) from lockstep.job").fetchone()[0] == 0
    assert ex.execute(triggers).fetchone()[0] == 0
    assert ex.execute("select count(*) from example.exam_key").fetchone()[0] > 0  # the table's rows stay
    assert lockstep("drop", "exam_keys", "--dsn", example_dsn).returncode == 1


def test_a_key_not_of_the_job_key_type_is_the_same_usage_error_for_retry_verify_and_diff(ex, example_dsn):
    """`diff --keys x` exited 1 without a hint, `verify --keys x` 2 with `[22P02] ...`, `retry JOB x` 1: one
    mistake, one answer. Exit 2, the SQLSTATE as every other error writes it, and a hint."""
    retry, verify, diff = (
        ["retry", "exam_keys", "x"],
        ["verify", "exam_keys", "--keys", "x"],
        ["diff", "exam_keys"],
    )
    for args in (retry, verify, [*diff, "--keys", "3,x"]):
        p = lockstep(*args, "--dsn", example_dsn)
        assert p.returncode == 2, (args, p.stderr)
        assert p.stderr.startswith('Error: 22P02: invalid input syntax for type bigint: "x" (hint: '), (
            p.stderr
        )
        assert "Traceback" not in p.stderr and "[22P02]" not in p.stderr
        j = lockstep(*args, "--json", "--dsn", example_dsn)
        assert j.returncode == 2 and json.loads(j.stdout)["exit_code"] == 2, j.stdout
