"""Run history: lockstep.run_log rows, bounded retention, row security, never failing a run."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys

import psycopg
import pytest
from history_fixtures import as_role, make_roles_fixture  # noqa: F401  (the make_roles fixture)
from isolation import Spec
from psycopg.rows import dict_row
from util import raises_sqlstate, result

from lockstep.lab import example
from lockstep.status import jsonable

JOBS = """
create function public.ok() returns void language sql as $$ select $$;
create function public.boom() returns void language plpgsql
    as $$ begin raise exception 'boom: disk on fire'; end $$;
select lockstep.define_job('ok', 'public.ok()', every => '1 hour');
select lockstep.define_job('boom', 'public.boom()', every => '1 hour');
"""


def logged(conn: psycopg.Connection, job: str | None = None) -> list[dict]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            "select * from lockstep.run_log where %(job)s::text is null or job = %(job)s order by id",
            {"job": job},
        ).fetchall()


@pytest.fixture
def ex(ex: psycopg.Connection) -> psycopg.Connection:
    """The example database, without the run its template logged (the first recompute)."""
    ex.execute("delete from lockstep.run_log")
    return ex


def run_due(conn: psycopg.Connection, job: str) -> dict:
    conn.execute("update lockstep.job_state set next_run_at = now() where job = %s", [job])
    return result(conn, "lockstep.run(%s)", job)


def test_every_run_is_logged_with_its_counts_timings_and_error(ex):
    ex.execute(JOBS)
    assert result(ex, "lockstep.run('ok')")["outcome"] == "done"
    assert result(ex, "lockstep.run('boom')")["outcome"] == "failed"
    assert result(ex, "lockstep.run('boom')")["outcome"] == "backoff"  # not a run: not logged
    ex.execute("update example.exam_item set body = body || ' more' where exam_id between 1 and 4")
    ex.execute("delete from example.exam where id = 5")
    work = result(ex, "lockstep.work('exam_keys')")
    assert work["outcome"] == "done" and work["inserted"] + work["deleted"] > 0
    assert result(ex, "lockstep.work('exam_keys')")["outcome"] == "idle"  # not logged either
    recompute = result(ex, "lockstep.recompute('exam_keys')")

    rows = logged(ex)
    assert [(r["job"], r["action"], r["outcome"]) for r in rows] == [
        ("ok", "call", "done"),
        ("boom", "call", "failed"),
        ("exam_keys", "work", "done"),
        ("exam_keys", "recompute", "done"),
    ]
    ok, boom, w, rc = rows
    assert boom["error"] == "boom: disk on fire" and ok["error"] is None
    assert (ok["kind"], ok["lock_group"], ok["owner"], ok["run_no"]) == ("job", "ok", "root", 1)
    for r, res in ((w, work), (rc, recompute)):
        assert (r["inserted"], r["updated"], r["deleted"], r["skipped"]) == (
            res["inserted"],
            res["updated"],
            res["deleted"],
            res["skipped"],
        )
        assert r["compute_ms"] == pytest.approx(res["compute_ms"])
        assert r["kind"] == "derived" and r["error"] is None
    # the same run as the status row says
    state = ex.execute(
        "select last_started_at, last_finished_at, last_duration_ms, runs from lockstep.job_state"
        " where job = 'exam_keys'"
    ).fetchone()
    assert (rc["started_at"], rc["finished_at"], rc["duration_ms"], rc["run_no"]) == state
    assert rc["finished_at"] >= rc["started_at"] and w["run_no"] == rc["run_no"] - 1


def test_a_worker_pass_with_failing_keys_logs_the_first_error(ex):
    # key 7 is poison: the worker isolates it (key_failure) and the pass is done, with an error
    ex.execute("alter function example.exam_key_compute(bigint[]) rename to exam_key_compute_orig")
    ex.execute(
        "create function example.exam_key_compute(keys bigint[])"
        " returns table (exam_id bigint, key text, weight integer) language plpgsql"
        " set search_path = pg_catalog, pg_temp as $$"
        " begin if 7 = any(keys) then raise exception 'poison 7'; end if;"
        " return query select * from example.exam_key_compute_orig(keys); end $$"
    )
    ex.execute("select lockstep.enqueue('exam_keys', array[6, 7, 8]::bigint[])")
    r = result(ex, "lockstep.work('exam_keys')")
    assert r["outcome"] == "done" and r["error"] == "1 key(s) failed, first 7: poison 7"
    (row,) = logged(ex, "exam_keys")
    assert (row["outcome"], row["failed_keys"], row["error"]) == ("done", 1, r["error"])


def test_max_per_job_keeps_the_newest_runs_of_each_job(ex):
    ex.execute(JOBS)
    ex.execute("select lockstep.set_run_log_retention(max_per_job => 3)")
    for _ in range(8):
        run_due(ex, "ok")
    run_due(ex, "boom")
    assert [r["run_no"] for r in logged(ex, "ok")] == [6, 7, 8]
    assert [r["run_no"] for r in logged(ex, "boom")] == [1]  # other jobs keep their own three
    # a lower limit applies to the rows already there at once
    ex.execute("select lockstep.set_run_log_retention(max_per_job => 2)")
    assert [r["run_no"] for r in logged(ex, "ok")] == [7, 8]
    run_due(ex, "ok")
    assert [r["run_no"] for r in logged(ex, "ok")] == [8, 9]
    ex.execute("select lockstep.set_run_log_retention(max_per_job => 0)")  # stop logging
    assert logged(ex) == []
    run_due(ex, "ok")
    assert logged(ex, "ok") == []


def test_the_jobs_last_recompute_outlives_max_per_job_until_the_next_one(ex):
    # during a backlog, 1000 worker passes pushed a failed recompute out of run_log in ~40 s while
    # lockstep status still showed its error: the newest recompute is kept
    ex.execute("select lockstep.set_run_log_retention(max_per_job => 3)")
    ex.execute("alter function example.exam_key_compute(bigint[]) rename to exam_key_compute_orig")
    ex.execute(
        "create function example.exam_key_compute(keys bigint[])"
        " returns table (exam_id bigint, key text, weight integer) language plpgsql"
        " set search_path = pg_catalog, pg_temp as $$"
        " begin if keys is null then raise exception 'the whole table: no access'"
        " using errcode = '42501'; end if;"
        " return query select * from example.exam_key_compute_orig(keys); end $$"
    )
    assert result(ex, "lockstep.recompute('exam_keys')")["outcome"] == "failed"

    def passes(n: int) -> None:
        for i in range(n):
            ex.execute("update example.exam_item set body = body || ' x' where exam_id = %s", [i + 1])
            assert result(ex, "lockstep.work('exam_keys')")["outcome"] == "done"

    passes(5)
    rows = [(r["action"], r["outcome"]) for r in logged(ex, "exam_keys")]
    assert rows == [("recompute", "failed"), ("work", "done"), ("work", "done"), ("work", "done")], rows
    status = ex.execute(
        "select last_error is null, recompute_error from lockstep.status where job = 'exam_keys'"
    )
    assert status.fetchone() == (True, "the whole table: no access")
    # set_run_log_retention applies the limit as the runs do (it had deleted the spared recompute)
    ex.execute("select lockstep.set_run_log_retention(keep => '7 days')")
    assert [r["action"] for r in logged(ex, "exam_keys")] == ["recompute", "work", "work", "work"]
    # the next recompute is the one kept; the earlier goes once it falls off
    ex.execute("alter function example.exam_key_compute(bigint[]) rename to exam_key_compute_poison")
    ex.execute("alter function example.exam_key_compute_orig(bigint[]) rename to exam_key_compute")
    assert result(ex, "lockstep.recompute('exam_keys')")["outcome"] == "done"
    passes(4)
    rows = [(r["action"], r["outcome"]) for r in logged(ex, "exam_keys")]
    assert rows == [("recompute", "done"), ("work", "done"), ("work", "done"), ("work", "done")], rows


def test_a_run_prunes_only_at_its_jobs_boundary(ex):
    """The per-job prune looks at the 10 run numbers just past the limit, never further down (there lie
    the dead index entries of earlier prunes); rows below that window go by age."""
    ex.execute(JOBS)
    ex.execute("select lockstep.set_run_log_retention(max_per_job => 5)")
    ex.execute("update lockstep.job_state set runs = 100 where job = 'ok'")
    ex.execute(
        "insert into lockstep.run_log (job, owner, lock_group, kind, action, outcome, started_at,"
        " finished_at, duration_ms, run_no) select 'ok', 'root', 'ok', 'job', 'call', 'done', now(), now(),"
        " 1, g from generate_series(81, 100) g"
    )
    run_due(ex, "ok")  # run 101: keeps 97..101, prunes 86..96 at most 10 of them, oldest first
    assert [r["run_no"] for r in logged(ex, "ok")] == [*range(81, 87), *range(97, 102)]


def test_expired_runs_are_pruned_a_bounded_number_per_run(ex):
    ex.execute(JOBS)
    ex.execute("select lockstep.set_run_log_retention(keep => '1 day')")
    # 25 runs of a job dropped long ago: only age prunes them, at most 10 per run
    ex.execute(
        "insert into lockstep.run_log (job, owner, lock_group, kind, action, outcome, started_at,"
        " finished_at, duration_ms, run_no)"
        " select 'gone', 'root', 'gone', 'job', 'call', 'done', now() - interval '2 days',"
        " now() - interval '2 days' + g * interval '1 second', 1, g from generate_series(1, 25) g"
    )
    remaining = []
    for _ in range(4):
        run_due(ex, "ok")
        remaining.append(len(logged(ex, "gone")))
    assert remaining == [15, 5, 0, 0]
    assert len(logged(ex, "ok")) == 4


def test_retention_settings_refuse_bad_values_and_change_nothing(ex):
    before = ex.execute("select * from lockstep.setting").fetchall()
    assert before[0][:3] == (True, dt.timedelta(days=14), 1000)  # the run log's (the capture's follow)
    with raises_sqlstate("22023", match="run_log_keep must be a positive interval") as info:
        ex.execute("select lockstep.set_run_log_retention(keep => '-1 day')")
    assert info.value.diag.message_hint
    with raises_sqlstate("22023", match="run_log_max_per_job must be >= 0"):
        ex.execute("select lockstep.set_run_log_retention(max_per_job => -1)")
    assert ex.execute("select * from lockstep.setting").fetchall() == before
    ex.execute("select lockstep.set_run_log_retention('2 hours')")
    assert ex.execute("select run_log_keep::text, run_log_max_per_job from lockstep.setting").fetchone() == (
        "02:00:00",
        1000,
    )


def test_a_missing_setting_row_means_the_defaults(ex):
    ex.execute(JOBS)
    ex.execute("delete from lockstep.setting")
    run_due(ex, "ok")
    assert len(logged(ex, "ok")) == 1


# row security -----------------------------------------------------------------------------------------

READER = [
    "grant usage on schema lockstep to {role}",
    "grant select, insert, update, delete on lockstep.run_log to {role}",
]


def test_each_role_sees_and_writes_only_the_runs_of_jobs_it_may_manage(ex, example_dsn, make_roles):
    alice = make_roles(example_dsn, "alice", *READER)
    bob = make_roles(example_dsn, "bob", *READER)
    alice_team = make_roles(example_dsn, "alice_team", *READER, member_of=(alice,))
    ex.execute(JOBS)
    ex.execute("update lockstep.job set owner = %s where job = 'ok'", [alice])
    ex.execute("update lockstep.job set owner = %s where job = 'boom'", [bob])
    run_due(ex, "ok")
    run_due(ex, "boom")
    run_due(ex, "exam_keys")  # owned by root

    def sees(role: str) -> list[str]:
        with psycopg.connect(as_role(example_dsn, role), autocommit=True) as c:
            return [r["job"] for r in logged(c)]

    assert sees(alice) == ["ok"]
    assert sees(bob) == ["boom"]
    assert sees(alice_team) == ["ok"]  # a member of the owner role
    assert sorted(r["job"] for r in logged(ex)) == ["boom", "exam_keys", "ok"]  # the admin sees all

    with psycopg.connect(as_role(example_dsn, bob), autocommit=True) as c:
        # no DML on another owner's runs: insert refused, update and delete touch nothing
        with raises_sqlstate("42501", match="row-level security"):
            c.execute(
                "insert into lockstep.run_log (job, owner, lock_group, kind, action, outcome, started_at,"
                " finished_at, duration_ms, run_no) values ('ok', %s, 'ok', 'job', 'call', 'done', now(),"
                " now(), 0, 99)",
                [alice],
            )
        assert c.execute("update lockstep.run_log set error = 'x'").rowcount == 0  # no update policy
        assert c.execute("delete from lockstep.run_log where job = 'ok'").rowcount == 0
    assert [r["error"] for r in logged(ex, "ok")] == [None]


def test_a_runner_without_privileges_on_run_log_logs_its_runs(ex, example_dsn, make_roles):
    """The run history is written by lockstep._finish, a security definer function, for a caller that
    manages the job: a runner with no grant on run_log or setting logs its runs, under its own role."""
    owner = make_roles(example_dsn, "owner", "grant usage on schema lockstep to {role}")  # jobs run as it
    runner = make_roles(
        example_dsn,
        "runner",
        "grant usage on schema lockstep to {role}",
        "grant select on lockstep.job, lockstep.job_state, lockstep.queue, lockstep.key_failure,"
        " lockstep.recompute_flag to {role}",
        member_of=(owner,),
    )
    ex.execute(JOBS)
    ex.execute("update lockstep.job set owner = %s", [owner])
    ex.execute("update lockstep.job_state set next_run_at = now() where job = 'ok'")
    notices: list[str] = []
    with psycopg.connect(as_role(example_dsn, runner), autocommit=True) as c:
        c.add_notice_handler(lambda d: notices.append(f"{d.severity}: {d.message_primary}"))
        r0 = result(c, "lockstep.run(%s)", "ok")
        assert r0["outcome"] == "done", r0["error"]
        assert notices == []
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute("select * from lockstep.run_log")  # reading it is another grant
    assert ex.execute("select runs from lockstep.job_state where job = 'ok'").fetchone() == (1,)
    assert [(r["job"], r["role"], r["owner"]) for r in logged(ex)] == [("ok", runner, owner)]


# concurrency --------------------------------------------------------------------------------------------

OLD_RUNS = (
    "insert into lockstep.run_log (job, owner, lock_group, kind, action, outcome, started_at, finished_at,"
    " duration_ms, run_no) select 'gone', 'root', 'gone', 'job', 'call', 'done', now() - interval '30 days',"
    " now() - interval '30 days', 1, g from generate_series(1, 30) g"
)
NAIVE_PRUNE = (
    "delete from lockstep.run_log where id in (select id from lockstep.run_log"
    " where finished_at < now() - interval '14 days' order by finished_at limit 10);"
)


def test_two_runners_pruning_at_once_never_wait_for_each_other(ex, example_dsn, expected_trace):
    """Two runs of jobs in different lock groups end at the same time, both with expired rows to prune.
    The naive prune (delete the 10 oldest expired rows) makes the second wait for the first's commit;
    lockstep's pruner takes a try lock and skips instead."""
    ex.execute(JOBS)
    ex.execute(OLD_RUNS)
    ex.execute("update lockstep.job_state set next_run_at = now()")
    spec = Spec(example_dsn, sessions={"s1": [], "s2": []})
    spec.step("s1begin", "s1", "begin;")
    spec.step("s1run", "s1", "select outcome from lockstep.run('ok');")
    spec.step("s1naive", "s1", NAIVE_PRUNE, label="naive prune", show_rows=False)
    spec.step("s1c", "s1", "commit;")
    spec.step("s2begin", "s2", "begin;")
    spec.step("s2run", "s2", "select outcome from lockstep.run('boom');")
    spec.step("s2naive", "s2", NAIVE_PRUNE, label="naive prune", show_rows=False)
    spec.step("s2c", "s2", "commit;")

    r = spec.run(["s1begin", "s2begin", "s1run", "s2run", "s1c", "s2c"])
    assert not r.waited("s2run"), r.trace
    assert [r.rows("s1run"), r.rows("s2run")] == [[("done",)], [("failed",)]]
    assert len(logged(ex, "gone")) == 20  # s1 pruned 10, s2 skipped: the next run prunes
    assert [x["job"] for x in logged(ex) if x["job"] != "gone"] == ["ok", "boom"]

    naive = spec.run(["s1begin", "s2begin", "s1naive", "s2naive", "s1c", "s2c"])
    assert naive.waited("s2naive") and naive.blocked_by("s2naive") == ["s1"], naive.trace
    expected_trace(r, naive)


def test_the_example_job_still_converges_with_history_on(ex):
    ex.execute("update example.exam_item set body = body || ' y' where exam_id <= 20")
    while result(ex, "lockstep.work('exam_keys')")["outcome"] == "done":
        pass
    assert example.divergence(ex) == (0, 0)
    assert {r["outcome"] for r in logged(ex)} == {"done"}


# lockstep status --history ------------------------------------------------------------------------------


def cli(dsn: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lockstep", "status", "--dsn", dsn, *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_status_history_shows_the_newest_runs_oldest_first(ex, example_dsn):
    ex.execute(JOBS)
    for _ in range(3):
        run_due(ex, "ok")
    run_due(ex, "boom")
    p = cli(example_dsn, "--history")
    assert p.returncode == 0, p.stderr  # a failed run in the history is not an unhealthy exit
    header, *lines = p.stdout.splitlines()
    assert header.split() == ["finished", "job", "run", "ms", "rows", "skipped", "failed"]
    runs = [ln.split()[2:5] for ln in lines[:4]]
    assert runs == [["ok", "done", "call"]] * 3 + [["boom", "failed", "call"]]
    assert lines[-1] == "  error: boom: disk on fire"

    p = cli(example_dsn, "--history", "--json", "--job", "ok", "--limit", "2")
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout)
    want = [{k: jsonable(v) for k, v in r.items()} for r in logged(ex, "ok")[-2:]]
    assert [r["id"] for r in got] == [r["id"] for r in want]
    assert all(g[k] == w[k] for g, w in zip(got, want, strict=True) for k in g)
    assert {"id", "job", "outcome", "duration_ms", "error", "owner", "role", "run_no"} <= set(got[0])

    assert cli(example_dsn, "--history", "--job", "nope").stdout.strip() == "no runs in lockstep.run_log"
    p = cli(example_dsn, "--job", "ok")
    assert p.returncode == 2 and "--job goes with --history" in p.stderr


def test_status_history_for_a_role_that_may_not_read_it_is_a_one_line_error(ex, example_dsn, make_roles):
    nobody = make_roles(example_dsn, "nobody", "grant usage on schema lockstep to {role}")
    p = cli(as_role(example_dsn, nobody), "--history")
    assert p.returncode == 4  # a setup error (privileges), with a hint
    assert p.stderr.startswith("Error: 42501: permission denied for table run_log"), p.stderr
    assert "Traceback" not in p.stderr


def test_passes_that_only_skip_a_held_parent_again_are_one_run(ex, exconnect):
    """An application holding a parent's derived rows for minutes made every worker pass (one a second:
    the skipped key's entry is deferred a second) a new run_log row and a new run, so the job's history of
    1000 runs was pushed out in 17 minutes. A pass that only skips, right after a pass
    that only skipped, updates the status row and is neither logged nor counted."""
    app = exconnect()
    ex.execute("update example.exam set body = 'held parent rewritten' where id = 3")
    ex.execute("delete from lockstep.queue")
    ex.execute("delete from lockstep.run_log")
    app.execute("begin")
    app.execute("select * from example.exam_key where exam_id = 3 for update")  # the app holds them
    ex.execute("select lockstep.enqueue('exam_keys', array[3]::bigint[])")
    runs0 = ex.execute("select runs from lockstep.job_state where job = 'exam_keys'").fetchone()[0]
    finished = []
    for _ in range(4):
        ex.execute("update lockstep.queue set ready_at = now() where job = 'exam_keys'")  # the deferral over
        r = result(ex, "lockstep.work('exam_keys')")
        assert (r["outcome"], r["skipped"], r["inserted"] + r["updated"] + r["deleted"]) == ("done", 1, 0)
        finished.append(
            ex.execute("select last_finished_at from lockstep.job_state where job = 'exam_keys'").fetchone()[
                0
            ]
        )
    rows = logged(ex, "exam_keys")
    assert [(r["action"], r["skipped"], r["run_no"]) for r in rows] == [("work", 1, runs0 + 1)]
    state = ex.execute("select runs, last_skipped from lockstep.job_state where job = 'exam_keys'").fetchone()
    assert state == (runs0 + 1, 1) and finished == sorted(finished) and finished[0] < finished[-1]
    # a pass that also takes another key (a change with no effect on derived rows) did something: a run
    # (it was hidden as one more skip)
    ex.execute("update lockstep.queue set ready_at = now() where job = 'exam_keys'")
    ex.execute("select lockstep.enqueue('exam_keys', array[4]::bigint[])")
    r = result(ex, "lockstep.work('exam_keys')")
    assert (r["outcome"], r["skipped"], r["inserted"] + r["updated"] + r["deleted"]) == ("done", 1, 0)
    assert [(r["skipped"], r["run_no"]) for r in logged(ex, "exam_keys")] == [(1, runs0 + 1), (1, runs0 + 2)]
    app.execute("rollback")  # the application lets go: the next pass writes, and is a run of its own
    ex.execute("update lockstep.queue set ready_at = now() where job = 'exam_keys'")
    r = result(ex, "lockstep.work('exam_keys')")
    assert r["outcome"] == "done" and r["skipped"] == 0 and r["inserted"] + r["deleted"] > 0
    assert [(r["skipped"], r["run_no"]) for r in logged(ex, "exam_keys")] == [
        (1, runs0 + 1),
        (1, runs0 + 2),
        (0, runs0 + 3),
    ]


def test_status_history_fits_100_columns_and_wide_shows_every_column(ex, example_dsn):
    """`lockstep status --history` printed up to 130 columns for short job names and short errors; it
    keeps within 100 as `lockstep status` does, the error cut to fit. --wide: every column, in full."""
    long_job = "nightly_customer_lifetime_value_rollup"
    ex.execute(JOBS)
    ex.execute(
        "create function public.slow_boom() returns void language plpgsql as $$ begin"
        " raise exception 'the warehouse feed returned an unexpected row count for region %',"
        " repeat('x', 80);"
        " end $$"
    )
    ex.execute(f"select lockstep.define_job('{long_job}', 'public.slow_boom()', every => '1 hour')")
    run_due(ex, "ok")
    run_due(ex, long_job)
    ex.execute("update example.exam_item set body = body || ' more' where exam_id between 1 and 4")
    assert result(ex, "lockstep.work('exam_keys')")["outcome"] == "done"

    p = cli(example_dsn, "--history")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 5 and max(map(len, lines)) <= 100, p.stdout
    assert lines[0].split() == ["finished", "job", "run", "ms", "rows", "skipped", "failed"]
    assert lines[2].split()[2:5] == ["nightly_cus~value_rollup", "failed", "call"], lines[2]
    assert lines[3].startswith("  error: the warehouse feed returned") and lines[3].endswith("..."), lines[3]
    assert lines[4].split()[2:5] == ["exam_keys", "done", "work"], lines[4]

    wide = cli(example_dsn, "--history", "--wide")
    assert wide.returncode == 0, wide.stderr
    header, *rows = wide.stdout.splitlines()
    assert header.split() == [
        "finished_at", "job", "action", "outcome", "duration_ms", "inserted", "updated", "deleted",
        "skipped", "failed_keys", "error",
    ]  # fmt: skip
    assert long_job in rows[1] and max(map(len, wide.stdout.splitlines())) > 100
