"""The ``lockstep`` command on bad input: an exit code and one clear line on stderr, never a traceback.

Each case runs the real console entry point (``python -m lockstep``) with a timeout. The exit codes
(docs/cli.md): 2 for a bad option or DSN, 3 when no server answered, 4 for a permanent setup
error (no lockstep schema...), always with one ``Error:`` / ERROR line; ``lockstep run``'s INFO start-up
line is not an error line.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

UNREACHABLE = "postgresql://nobody@127.0.0.1:1/x"


def lockstep(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lockstep", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PATH": "/usr/bin:/bin", "PGCONNECT_TIMEOUT": "5"},
    )


def error_lines(p: subprocess.CompletedProcess) -> list[str]:
    """Lines of stderr that say something (log lines or click's ``Error: ...``), minus libpq's hints."""
    return [
        line
        for line in p.stderr.splitlines()
        if line.strip()
        and not line.startswith(("\t", " ", "Usage:", "Try ", "LINE ", "HINT:"))
        and " INFO " not in line
    ]


def assert_clean(p: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert "Traceback" not in p.stderr, p.stderr
    lines = error_lines(p)
    assert p.returncode == code, (p.returncode, p.stderr)
    assert len(lines) == 1, p.stderr
    for needle in needles:
        assert needle in lines[0], (needle, p.stderr)
    return lines[0]


# run ---------------------------------------------------------------------------------------------------


def test_run_once_not_a_dsn_is_a_usage_error():
    p = lockstep("run", "--once", "--dsn", "not a dsn")
    assert_clean(p, 2, "connection info string")


def test_run_loop_not_a_dsn_exits_2_at_once():
    try:
        p = lockstep("run", "--dsn", "not a dsn", timeout=5)
    except subprocess.TimeoutExpired:
        pytest.fail("lockstep run retried an unparseable DSN for 5 s")
    assert_clean(p, 2, "dsn", "connection info string")


def test_run_once_unreachable_has_its_own_exit_code():
    p = lockstep("run", "--once", "--dsn", UNREACHABLE)
    assert_clean(p, 3, "Connection refused")


def test_run_tick_zero_is_a_usage_error():
    p = lockstep("run", "--tick", "0", "--dsn", UNREACHABLE)
    assert_clean(p, 2, "Error: Invalid value for '--tick'", "x>=0.01")


def test_run_tick_not_a_number_is_a_usage_error():
    p = lockstep("run", "--tick", "soon", "--dsn", UNREACHABLE)
    assert_clean(p, 2, "Error: Invalid value for '--tick'")


@pytest.mark.parametrize("mode", [[], ["--once"]], ids=["loop", "once"])
def test_run_unknown_job_exits_4_at_once_naming_the_jobs(dsn, mode):
    """A --job typo is permanent: exit 4 at start-up (the loop used to idle for ever), naming the jobs."""
    p = lockstep("run", *mode, "--dsn", dsn, "--job", "no such job")
    line = assert_clean(p, 4, "no such job", "cannot start", "hint:")
    assert "the jobs are:" in line or "no job is defined" in line, line


def test_run_once_without_the_schema_says_so(empty_dsn):
    p = lockstep("run", "--once", "--dsn", empty_dsn)
    assert_clean(p, 4, 'schema "lockstep" does not exist', "hint:", "lockstep migrate")


def test_unknown_option_is_a_usage_error():
    p = lockstep("run", "--bogus")
    assert_clean(p, 2, "No such option", "--bogus")


# status ------------------------------------------------------------------------------------------------


def test_status_unreachable_server_exits_3_with_one_error_line():
    p = lockstep("status", "--dsn", UNREACHABLE)
    line = assert_clean(p, 3, "Error: connection failed", "Connection refused")
    assert line.startswith("Error: ")


def test_status_not_a_dsn():
    p = lockstep("status", "--dsn", "not a dsn")
    assert_clean(p, 2, "Error: ", "--dsn", "connection info string")


def test_status_without_the_schema(empty_dsn):
    p = lockstep("status", "--dsn", empty_dsn)
    assert_clean(p, 4, "Error: ", "has no lockstep schema", "hint:", "lockstep migrate")
    assert 'relation "lockstep.status" does not exist' not in p.stderr


# migrate -----------------------------------------------------------------------------------------------


def test_migrate_unknown_revision_changes_nothing(empty_dsn):
    import psycopg

    p = lockstep("migrate", "--dsn", empty_dsn, "--revision", "nope")
    # alembic's own INFO lines ("Context impl ...") are logged before the error: only the Error line counts
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 1, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("Error:")]
    assert errors == ["Error: Can't locate revision identified by 'nope'"], p.stderr
    with psycopg.connect(empty_dsn) as c:
        assert c.execute("select to_regnamespace('lockstep')").fetchone()[0] is None


def test_migrate_unreachable_server():
    p = lockstep("migrate", "--dsn", UNREACHABLE)
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 3, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Connection refused" in errors[0], p.stderr


def test_drop_that_gives_up_on_a_busy_table_exits_1_with_the_sqlstate_and_hint(dsn, connect):
    # 55P03 (psycopg's OperationalError family) was reported as exit 3, "no server answered", without the
    # code or the server's hint: a deploy script took the database for down
    setup = connect(dsn)
    setup.execute(
        "create table p (id bigint primary key); create table d (p_id bigint primary key references p"
        " on delete cascade, n int); create function dc(ids bigint[]) returns table (p_id bigint, n int)"
        " language sql stable as $$ select id, 1 from public.p where ids is null or id = any(ids) $$;"
        " select lockstep.define_derived('d', 'd', 'dc(bigint[])', 'p');"
        " select lockstep.watch('d', 'p', 'id')"
    )
    holder = connect(dsn)
    holder.execute("begin")
    holder.execute("lock table p in row exclusive mode")  # an application transaction that stays open
    sep = "&" if "?" in dsn else "?"
    p = lockstep("drop", "d", "--dsn", f"{dsn}{sep}options=-c%20deadlock_timeout%3D20ms", timeout=60)
    holder.execute("rollback")
    line = assert_clean(p, 1, "55P03", "could not lock its tables", "hint:")
    assert "Nothing was changed" in line, line
    assert setup.execute("select count(*) from lockstep.job").fetchone()[0] == 1


def test_describe_says_what_a_read_only_session_and_a_schema_gone_under_a_runner_mean():
    """A runner on a standby logged only "cannot execute UPDATE in a read-only transaction", one whose
    schema was downgraded under it "could not open relation with OID ..."."""
    from psycopg import errors as pe

    from lockstep.errors import describe

    ro = describe(pe.ReadOnlySqlTransaction("cannot execute UPDATE in a read-only transaction"))
    assert ro.startswith("ReadOnlySqlTransaction[25006]: cannot execute UPDATE") and "primary" in ro, ro
    gone = describe(pe.InternalError_("could not open relation with OID 33798"))
    assert "[XX000]" in gone and "lockstep migrate" in gone, gone
    assert describe(pe.InternalError_("something else")) == "InternalError_[XX000]: something else"


def test_a_job_whose_compute_is_gone_is_not_sent_to_lockstep_migrate(ex, example_dsn):
    """verify and diff of a job whose compute function was dropped said "install or upgrade the lockstep
    schema with `lockstep migrate`" (exit 4): the missing object is the job's, not lockstep's."""
    ex.execute("drop function example.exam_key_compute(bigint[])")
    for cmd in ("verify", "diff"):
        p = lockstep(cmd, "exam_keys", "--dsn", example_dsn)
        line = assert_clean(p, 1, "42883", "example.exam_key_compute", "define_derived")
        assert "lockstep migrate" not in line, line
