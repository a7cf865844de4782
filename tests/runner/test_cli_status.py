"""``lockstep status``: the view as a table or JSON, exit code 1 when a job fails."""

from __future__ import annotations

import json
import subprocess
import sys

from psycopg.rows import dict_row

from lockstep.status import jsonable


def status(dsn: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lockstep", "status", "--dsn", dsn, *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def view(conn) -> list[dict]:
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute("select * from lockstep.status order by job").fetchall()
    return [{k: jsonable(v) for k, v in r.items()} for r in rows]


def test_status_json_matches_the_view_and_exit_code_flips_on_failure(conn, dsn):
    conn.execute(
        "create function public.ok() returns void language sql as $$ select $$;"
        " create function public.boom() returns void language plpgsql"
        " as $$ begin raise exception 'boom'; end $$;"
        " select lockstep.define_job('ok', 'public.ok()', every => '1 minute');"
        " select lockstep.define_job('boom', 'public.boom()', every => '1 minute');"
    )
    conn.execute("select lockstep.run('ok')")
    p = status(dsn, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == view(conn)

    p = status(dsn)
    assert p.returncode == 0, p.stderr
    header, *lines = p.stdout.splitlines()
    assert header.split()[:3] == ["job", "kind", "queue"]
    assert [ln.split()[0] for ln in lines] == ["boom", "ok"]

    assert conn.execute("select outcome from lockstep.run('boom')").fetchone()[0] == "failed"
    p = status(dsn, "--json")
    assert p.returncode == 1, p.stderr
    got = json.loads(p.stdout)
    assert got == view(conn)
    assert {r["job"]: r["consecutive_failures"] for r in got} == {"boom": 1, "ok": 0}
    assert next(r for r in got if r["job"] == "boom")["last_error"] == "boom"
    assert status(dsn).returncode == 1


def test_status_without_the_schema_is_a_setup_error_with_a_hint(empty_dsn):
    p = status(empty_dsn)
    assert p.returncode == 4
    assert p.stderr.startswith("Error: ") and "Traceback" not in p.stderr, p.stderr
    assert "lockstep migrate" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_queue_nothing_drains_makes_status_unhealthy(conn, dsn):
    # A runner that cannot write (a read-only session: 25006) cannot record its own failures, so status
    # said healthy while the queue only grew. The age of the oldest queued key, parked
    # ones aside, is in the view (queue_lag) and, past --max-lag, makes status exit 1.
    conn.execute(
        "create table p (id bigint primary key); insert into p values (1), (2);"
        " create table d (p_id bigint primary key references p on delete cascade, n int);"
        " create function dc(ids bigint[]) returns table (p_id bigint, n int) language sql stable"
        " as $$ select id, 1 from public.p where ids is null or id = any(ids) $$;"
        " select lockstep.define_derived('d', 'd', 'dc(bigint[])', 'p', every => '1 day');"
        " select lockstep.recompute('d');"
    )
    assert conn.execute("select queue_lag from lockstep.status").fetchone()[0] is None
    conn.execute("select lockstep.enqueue('d', array[1, 2])")
    assert status(dsn).returncode == 0  # just queued
    conn.execute("update lockstep.queue set enqueued_at = now() - interval '20 minutes' where key = '1'")
    lag = conn.execute("select extract(epoch from queue_lag) from lockstep.status").fetchone()[0]
    assert 1199 < lag < 1300
    p = status(dsn)
    assert p.returncode == 1 and "lag" in p.stdout.splitlines()[0].split(), p.stdout
    # and says why on stderr: the table alone would leave the reader to find the column
    assert "unhealthy: job d: oldest queued key waits 12" in p.stderr and "(--max-lag 900)" in p.stderr, (
        p.stderr
    )
    assert status(dsn, "--max-lag", "3600").returncode == 0
    assert status(dsn, "--max-lag", "0").returncode == 0
    # a parked key's change waits too: its entry counts as lag, beside the parked key
    conn.execute(  # parked after its entries were queued (failed_upto: the entry it folded them into)
        "insert into lockstep.key_failure (job, key, attempts, parked, last_error, retry_at, failed_upto)"
        " values ('d', '1', 5, true, 'x', now(), (select id from lockstep.queue where key = '1'))"
    )
    p = status(dsn)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert lines[0].startswith(
        "unhealthy: job d: 1 parked key(s) (lockstep.parked_keys; lockstep retry); oldest queued key waits 12"
    ), p.stderr
    conn.execute("select lockstep.work('d')")  # key 2 written; key 1 stays queued (parked)
    assert conn.execute(
        "select queue_depth, queue_lag > interval '19 minutes' from lockstep.status"
    ).fetchone() == (
        1,
        True,
    )


def test_an_infinite_next_run_does_not_break_status(conn, dsn):
    # an owner may set its own job's next_run_at = 'infinity': Python has no infinite datetime, and every
    # read of lockstep.status by lockstep status (and the web page) failed for every role that saw that job
    #
    conn.execute(
        "create function public.ok() returns void language sql as $$ select $$;"
        " select lockstep.define_job('ok', 'public.ok()', every => '1 minute');"
        " update lockstep.job_state set next_run_at = 'infinity' where job = 'ok'"
    )
    p = status(dsn)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr
    p = status(dsn, "--json")
    assert p.returncode == 0 and json.loads(p.stdout)[0]["next_run_at"].startswith("9999-12-31"), p.stdout


def test_a_flag_held_since_a_poisoned_recompute_says_what_to_do():
    """'flagged' alone, with no failing key shown and an empty queue, left an operator nothing to act on
    while the hold lasted."""
    import datetime as dt

    from lockstep.status import reasons

    held = dt.datetime(2026, 12, 3, 15, 0, tzinfo=dt.UTC)
    rows = [{"job": "dj", "needs_recompute": held, "recompute_held_since": held, "consecutive_failures": 0}]
    (line,) = reasons(rows)
    assert "held since a recompute met poison parents" in line and "fixed, `lockstep retry dj`" in line, line
    rows[0]["recompute_held_since"] = None
    rows[0]["trigger_problem"] = "public.c newly watched: rows written before are not queued"
    assert reasons(rows) == [
        "unhealthy: job dj: flagged for a full recompute (public.c newly watched: rows written before are"
        " not queued)"
    ]
    # a name a shell splits is quoted, so the command pastes as is
    rows[0].update(job="billing totals", recompute_held_since=held)
    assert "`lockstep retry 'billing totals'`" in reasons(rows)[0]


def test_a_failing_generic_job_is_said_to_have_failed_its_call(conn, dsn):
    """A generic job whose call failed was reported as "its last full recompute failed": it has no
    recompute."""
    conn.execute(
        "create function boom() returns void language plpgsql as $$ begin raise exception 'boom'; end $$;"
        " select lockstep.define_job('nightly', 'boom()')"
    )
    conn.execute("select lockstep.run('nightly')")
    p = status(dsn)
    assert (
        p.returncode == 1
        and "unhealthy: job nightly: 1 consecutive failure(s); its last call failed" in p.stderr
    ), p.stderr


def test_status_fits_100_columns_and_wide_shows_every_column(conn, dsn):
    """Long job names, a long error, a spread recompute: the default table stays within 100 columns; --wide
    has every column of the table and the errors; --json every column of the view."""
    from lockstep.status import TABLE_COLUMNS

    long = "a_job_with_a_long_name_" + "x" * 40
    conn.execute(
        "create function public.boom() returns void language plpgsql"
        " as $$ begin raise exception '%', repeat('a long error ', 20); end $$;"
        f" select lockstep.define_job('{long}', 'public.boom()', every => '1 minute');"
        " select lockstep.define_job('short', 'public.boom()', every => '1 minute');"
    )
    conn.execute(f"select lockstep.run('{long}')")
    p = status(dsn)
    assert p.returncode == 1, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 1 + len(view(conn)) and max(map(len, lines)) <= 100, p.stdout
    assert lines[0].split() == ["job", "kind", "queue", "lag", "parked", "failing", "last", "ago"]
    row = next(ln for ln in lines if ln.startswith("a_job_with"))
    assert row.split()[0] == long[:11] + "~" + long[-12:] and "failed call" in row, row
    assert "a long error" not in p.stdout  # the error is in --wide, --json and the reason on stderr
    wide = status(dsn, "--wide")
    assert wide.returncode == 1
    assert wide.stdout.splitlines()[0].split() == list(TABLE_COLUMNS), wide.stdout
    assert long[:57] in wide.stdout and "a long error" in wide.stdout
    assert max(map(len, wide.stdout.splitlines())) > 100


def test_a_paused_job_says_so_in_the_default_table(conn, dsn):
    conn.execute(
        "create function public.ok() returns void language sql as 'select'; "
        "select lockstep.define_job('napping', 'public.ok()', every => '1 minute'); "
        "select lockstep.pause('napping')"
    )
    p = status(dsn)
    assert p.returncode == 0, p.stderr  # paused on purpose: not unhealthy
    row = next(ln for ln in p.stdout.splitlines() if ln.startswith("napping"))
    assert "paused" in row, p.stdout


def test_an_unknown_command_lists_the_commands():
    p = subprocess.run([sys.executable, "-m", "lockstep", "frobnicate"], capture_output=True, text=True)
    assert p.returncode == 2
    assert "No such command 'frobnicate'" in p.stderr and "status" in p.stderr and "verify" in p.stderr, (
        p.stderr
    )


def test_two_long_job_names_that_differ_at_the_end_stay_apart(conn, dsn):
    """The default table cut long names to their first 23 characters: `..._region_a` and `..._region_b`
    printed as the same job."""
    conn.execute("create function public.ok() returns void language sql as 'select'")
    for region in ("a", "b"):
        job = f"warehouse_statistics_for_the_quarterly_dashboard_region_{region}"
        conn.execute(f"select lockstep.define_job('{job}', 'public.ok()')")
    p = status(dsn)
    assert p.returncode == 0, p.stderr
    names = [ln.split()[0] for ln in p.stdout.splitlines()[1:]]
    assert names == ["warehouse_s~ard_region_a", "warehouse_s~ard_region_b"], names
