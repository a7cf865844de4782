"""Generic scheduled jobs: define_job and run under rules 1, 2, 6 and 7."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest
from isolation import Spec
from util import advisory_locks, raises_sqlstate, result, snapshot

SETUP = """
create table ticks (n int);
create function tick() returns void language sql as $$ insert into public.ticks values (1) $$;
create function boom() returns void language plpgsql as $$ begin raise exception 'boom: disk on fire'; end $$;
create function two(a int, b int) returns int language sql as $$ select a + b $$;
create procedure proc() language sql as $$ select 1 $$;
create function slow() returns void language sql as $$ select pg_sleep(0.5) $$;
"""


@pytest.fixture
def jobs(conn: psycopg.Connection) -> psycopg.Connection:
    conn.execute(SETUP)
    return conn


def test_run_calls_the_function_then_not_due(jobs):
    jobs.execute("select lockstep.define_job('t', 'tick()', every => '1 hour')")
    assert result(jobs, "lockstep.run('t')")["outcome"] == "done"
    assert jobs.execute("select count(*) from ticks").fetchone()[0] == 1
    assert result(jobs, "lockstep.run('t')")["outcome"] == "not_due"
    assert jobs.execute("select count(*) from ticks").fetchone()[0] == 1
    st = jobs.execute(
        "select last_outcome, runs, next_run_at - last_started_at, consecutive_failures"
        " from lockstep.status where job = 't'"
    ).fetchone()
    assert st[0] == "done" and st[1] == 1 and st[3] == 0
    assert st[2].total_seconds() == pytest.approx(3600, abs=1)


def test_a_status_row_deleted_by_hand_is_made_again_by_the_next_run(jobs):
    """An admin's `delete from lockstep.job_state` made the job vanish from lockstep.status and
    lockstep.due(): no runner ran it again, and every health check said healthy. The job
    stays shown and is due at once; its next run makes the row again and runs what is due."""
    jobs.execute("select lockstep.define_job('t', 'tick()', every => '1 hour')")
    assert result(jobs, "lockstep.run('t')")["outcome"] == "done"
    jobs.execute("delete from lockstep.job_state where job = 't'")
    assert jobs.execute("select job from lockstep.status").fetchall() == [("t",)]
    assert jobs.execute("select job, due_at <= now() from lockstep.due()").fetchall() == [("t", True)]
    assert result(jobs, "lockstep.run('t')")["outcome"] == "done"  # due: the row's defaults
    assert jobs.execute("select count(*) from ticks").fetchone()[0] == 2
    assert jobs.execute("select last_outcome, runs from lockstep.status").fetchone() == ("done", 1)
    assert result(jobs, "lockstep.run('t')")["outcome"] == "not_due"


def test_two_runners_restoring_a_deleted_status_row_do_not_wait_for_each_other(jobs, dsn):
    """The status row was made again before the group lock: a second runner's run() waited on the first
    one's uncommitted row (its unique index) until the first run's transaction ended, however long its
    job ran. It is made under the group lock now: the second runner is busy at once."""
    jobs.execute("select lockstep.define_job('t', 'tick()', every => '1 hour')")
    jobs.execute("delete from lockstep.job_state where job = 't'")
    spec = Spec(dsn, sessions={"r1": [], "r2": ["set lock_timeout = 0"]})
    spec.step("r1begin", "r1", "begin;")
    spec.step("r1run", "r1", "select outcome from lockstep.run('t');")
    spec.step("r2run", "r2", "select outcome from lockstep.run('t');")
    spec.step("r1commit", "r1", "commit;")
    spec.step("r2again", "r2", "select outcome from lockstep.run('t');")
    r = spec.run(["r1begin", "r1run", "r2run", "r1commit", "r2again"])
    assert r.rows("r1run") == [("done",)], r.trace
    assert not r.waited("r2run") and r.rows("r2run") == [("busy",)], r.trace
    assert r.rows("r2again") == [("not_due",)], r.trace
    assert jobs.execute("select count(*) from ticks").fetchone()[0] == 1


def test_busy_returns_at_once_while_the_group_lock_is_held(jobs, dsn):
    jobs.execute("select lockstep.define_job('t', 'tick()', lock_group => 'g')")
    # as a schedule: the harness would see any lock wait of ``run`` (pg_blocking_pids), however short;
    # lock_timeout 0 (wait forever), so that a waiting run could only end when the holder rolls back
    spec = Spec(dsn, sessions={"holder": [], "job": ["set lock_timeout = 0"]})
    spec.step("hbegin", "holder", "begin;")
    spec.step("hlock", "holder", "select lockstep._try_lock('g') as locked;")
    spec.step("run", "job", "select outcome from lockstep.run('t');")
    spec.step("ticks", "job", "select count(*) as ticks from public.ticks;")
    spec.step("hrollback", "holder", "rollback;")
    spec.step("rerun", "job", "select outcome from lockstep.run('t');")
    r = spec.run(["hbegin", "hlock", "run", "ticks", "hrollback", "rerun"])
    assert r.rows("hlock") == [(True,)]
    assert not r.waited("run") and r.rows("run") == [("busy",)], r.trace
    assert r.rows("ticks") == [(0,)]
    assert r.rows("rerun") == [("done",)], r.trace


def test_group_lock_key_is_the_documented_one(jobs, connect):
    jobs.execute("select lockstep.define_job('t', 'tick()', lock_group => 'g')")
    holder = connect()
    holder.execute("begin")
    holder.execute("select pg_try_advisory_xact_lock(hashtextextended('lockstep:' || 'g', 0))")
    assert result(jobs, "lockstep.run('t')")["outcome"] == "busy"


@pytest.mark.parametrize("state", ["not_due", "backoff"])
def test_not_due_and_backoff_take_no_lock(jobs, connect, state):
    fn = "tick()" if state == "not_due" else "boom()"
    jobs.execute(f"select lockstep.define_job('t', '{fn}')")
    first = result(jobs, "lockstep.run('t')")["outcome"]
    assert first == ("done" if state == "not_due" else "failed")
    jobs.execute("begin")
    assert result(jobs, "lockstep.run('t')")["outcome"] == state
    observer = connect()
    pid = jobs.info.backend_pid
    assert advisory_locks(observer, pid) == []
    # and no lock on any lockstep table row or relation beyond AccessShare
    modes = observer.execute(
        "select distinct mode from pg_locks where pid = %s and locktype = 'relation'", [pid]
    ).fetchall()
    assert {m for (m,) in modes} <= {"AccessShareLock"}
    jobs.execute("rollback")


def test_failure_is_recorded_with_backoff_then_backoff(jobs):
    jobs.execute("select lockstep.define_job('b', 'boom()', backoff => '10 minutes')")
    r = result(jobs, "lockstep.run('b')")
    assert r["outcome"] == "failed"
    assert "boom: disk on fire" in r["error"]
    st = jobs.execute(
        "select last_error, consecutive_failures, extract(epoch from next_run_at - now())"
        " from lockstep.status where job = 'b'"
    ).fetchone()
    assert "boom: disk on fire" in st[0]
    assert st[1] == 1
    assert st[2] == pytest.approx(600, abs=5)
    assert result(jobs, "lockstep.run('b')")["outcome"] == "backoff"
    # once the backoff is over it runs (and fails) again, counting failures
    jobs.execute("update lockstep.job_state set next_run_at = now() - interval '1 second' where job = 'b'")
    assert result(jobs, "lockstep.run('b')")["outcome"] == "failed"
    assert jobs.execute("select consecutive_failures from lockstep.status").fetchone()[0] == 2


def test_failure_record_commits_but_the_function_work_does_not(jobs):
    jobs.execute(
        "create function half() returns void language plpgsql as"
        " $$ begin insert into public.ticks values (1); raise exception 'after insert'; end $$"
    )
    jobs.execute("select lockstep.define_job('h', 'half()')")
    assert result(jobs, "lockstep.run('h')")["outcome"] == "failed"
    assert jobs.execute("select count(*) from ticks").fetchone()[0] == 0
    assert jobs.execute("select last_outcome from lockstep.status").fetchone()[0] == "failed"


def test_statement_timeout_is_a_failure_with_backoff(jobs):
    jobs.execute("select lockstep.define_job('s', 'slow()')")
    jobs.execute("set statement_timeout = '100ms'")
    r = result(jobs, "lockstep.run('s')")
    jobs.execute("reset statement_timeout")
    assert r["outcome"] == "failed"
    assert "statement timeout" in r["error"]


def test_two_jobs_of_one_group_never_run_at_once(jobs, connect):
    jobs.execute("select lockstep.define_job('a', 'tick()', lock_group => 'g')")
    jobs.execute("select lockstep.define_job('b', 'tick()', lock_group => 'g')")
    other = connect()
    jobs.execute("begin")
    assert result(jobs, "lockstep.run('a')")["outcome"] == "done"  # holds the group lock until commit
    assert result(other, "lockstep.run('b')")["outcome"] == "busy"
    jobs.execute("commit")
    assert result(other, "lockstep.run('b')")["outcome"] == "done"


def test_a_second_runner_does_not_run_a_job_twice(jobs, connect):
    """Both see it due; the first runs it; the second gets the lock after the commit and finds it not due."""
    jobs.execute("select lockstep.define_job('t', 'tick()')")
    other = connect()
    jobs.execute("begin")
    assert result(jobs, "lockstep.run('t')")["outcome"] == "done"
    assert result(other, "lockstep.run('t')")["outcome"] == "busy"
    jobs.execute("commit")
    assert result(other, "lockstep.run('t')")["outcome"] == "not_due"
    assert jobs.execute("select count(*) from ticks").fetchone()[0] == 1


def test_redefine_updates_schedule_and_keeps_state(jobs):
    jobs.execute("select lockstep.define_job('t', 'tick()')")
    result(jobs, "lockstep.run('t')")
    jobs.execute("select lockstep.define_job('t', 'tick()', every => '5 minutes', lock_group => 'other')")
    row = jobs.execute("select every, lock_group, runs from lockstep.status").fetchone()
    assert row[0].total_seconds() == 300 and row[1] == "other" and row[2] == 1


def test_a_redefinition_reschedules_as_define_derived_does(jobs):
    """define_job kept the old next_run_at: an hourly job redefined to run every second (or with another
    call) still waited the hour. Now a new every counts from the last run, another call
    is due at once, and the same definition leaves the schedule alone."""

    def next_in() -> float:
        return jobs.execute(
            "select extract(epoch from next_run_at - last_started_at) from lockstep.status where job = 't'"
        ).fetchone()[0]

    jobs.execute("select lockstep.define_job('t', 'tick()', every => '1 hour')")
    assert result(jobs, "lockstep.run('t')")["outcome"] == "done"
    jobs.execute("select lockstep.define_job('t', 'tick()', every => '1 hour')")
    assert next_in() == pytest.approx(3600, abs=1)  # unchanged
    jobs.execute("select lockstep.define_job('t', 'tick()', every => '1 second')")
    assert next_in() == pytest.approx(1, abs=0.5)  # before: still 3600
    jobs.execute("update lockstep.job_state set next_run_at = now() + interval '1 day' where job = 't'")
    jobs.execute("select lockstep.define_job('t', 'slow()', every => '1 day')")  # another call: due now
    assert jobs.execute("select next_run_at <= now() from lockstep.status where job = 't'").fetchone()[0]


@pytest.mark.parametrize(
    ("call", "sqlstate", "match"),
    [
        ("lockstep.define_job(null, 'tick()')", "22004", "must not be NULL"),
        ("lockstep.define_job('x', null)", "22004", "call must not be NULL"),
        ("lockstep.define_job('', 'tick()')", "22023", "empty"),
        ("lockstep.define_job('x', 'tick()', lock_group => '')", "22023", "empty"),
        ("lockstep.define_job('x', 'tick()', every => '0 s')", "22023", "positive"),
        ("lockstep.define_job('x', 'tick()', every => '-1 minute')", "22023", "positive"),
        # above zero as intervals compare, a minute in the past when added to a day of February
        (
            "lockstep.define_job('x', 'tick()', every => '1 month -29 days 00:01')",
            "22023",
            "no negative part",
        ),
        ("lockstep.define_job('x', 'tick()', backoff => '0 s')", "22023", "positive"),
        # refused: a next_run_at out of range (22008) would fail every run, unrecorded
        ("lockstep.define_job('x', 'tick()', every => '300000 years')", "22023", "at most 100 years"),
        ("lockstep.define_job('x', 'tick()', backoff => '300000 years')", "22023", "at most 100 years"),
        # under 100 years as intervals compare (a month is 30 days), past the range as a timestamp adds it
        ("lockstep.define_job('x', 'tick()', every => '293000 years -105479999 days')", "22023", "negative"),
        (
            "lockstep.define_job('x', 'tick()', backoff => '293000 years -105479999 days')",
            "22023",
            "negative",
        ),
        ("lockstep.define_job('x', 'tick()', every => '36525 days 1 hour')", "22023", "at most 100 years"),
        ("lockstep.define_job('x', 'tick()', every => null)", "22004", "NULL"),
        ("lockstep.define_job('x', 'no_such_function()')", "42883", "does not exist"),
        ("lockstep.define_job('x', 'two(int, int)')", "LSD02", "needs 2 argument"),
        ("lockstep.define_job('x', 'proc()')", "LSD02", "not a plain function"),
        ("lockstep.define_job('x', 'max(int)')", "LSD02", "not a plain function"),
        ("lockstep.run('nope')", "LSJ01", 'unknown job "nope"'),
        ("lockstep.run(null)", "22004", "must not be NULL"),
        ("lockstep.drop_job('nope')", "LSJ01", "unknown job"),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(jobs, call, sqlstate, match):
    jobs.execute("select lockstep.define_job('keep', 'tick()')")
    before = snapshot(jobs, "ticks")
    with raises_sqlstate(sqlstate, match):
        jobs.execute(f"select {call}")
    assert snapshot(jobs, "ticks") == before


def test_another_role_cannot_redefine_or_drop_a_job(jobs):
    jobs.execute("select lockstep.define_job('mine', 'tick()')")
    jobs.execute("create role lockstep_test_intruder")
    try:
        jobs.execute("grant usage on schema lockstep to lockstep_test_intruder")
        jobs.execute(
            "grant select, insert, update, delete on all tables in schema lockstep to lockstep_test_intruder"
        )
        before = snapshot(jobs)
        jobs.execute("set role lockstep_test_intruder")
        with raises_sqlstate("42501", "owned by role"):
            jobs.execute("select lockstep.define_job('mine', 'tick()', every => '1 second')")
        with raises_sqlstate("42501", "owned by role"):
            jobs.execute("select lockstep.drop_job('mine')")
        jobs.execute("reset role")
        assert snapshot(jobs) == before
    finally:
        jobs.execute("reset role")
        jobs.execute("drop owned by lockstep_test_intruder")
        jobs.execute("drop role lockstep_test_intruder")


def test_drop_job_removes_everything(jobs):
    jobs.execute("select lockstep.define_job('t', 'tick()')")
    jobs.execute("select lockstep.drop_job('t')")
    assert jobs.execute("select count(*) from lockstep.status").fetchone()[0] == 0
    assert jobs.execute("select count(*) from lockstep.job_state").fetchone()[0] == 0


def test_retry_ends_the_failure_backoff_of_a_job_without_a_queue(jobs):
    """README: retry(job) ends the job's failure backoff. For a generic job it raised LSJ02 ("a generic job,
    not a derived job"), so a fixed job waited out its whole backoff. It now ends the
    backoff (and returns 0: no key to put back); a job whose last run did not fail keeps its schedule."""
    jobs.execute(
        "create function flaky() returns void language plpgsql as $$ begin"
        " if current_setting('test.broken', true) = 'on' then raise exception 'not yet'; end if;"
        " insert into public.ticks values (2); end $$"
    )
    jobs.execute("select lockstep.define_job('f', 'flaky()', every => '1 day', backoff => '1 hour')")
    jobs.execute("set test.broken = 'on'")
    assert result(jobs, "lockstep.run('f')")["outcome"] == "failed"
    assert result(jobs, "lockstep.run('f')")["outcome"] == "backoff"
    jobs.execute("reset test.broken")
    assert jobs.execute("select lockstep.retry('f')").fetchone()[0] == 0  # before: LSJ02
    assert result(jobs, "lockstep.run('f')")["outcome"] == "done"
    assert jobs.execute("select count(*) from ticks where n = 2").fetchone()[0] == 1
    jobs.execute("select lockstep.retry('f')")  # not failing: its next run stays a day away
    assert result(jobs, "lockstep.run('f')")["outcome"] == "not_due"


def test_a_run_that_outlasts_its_every_leaves_its_lock_group_a_turn(jobs):
    """A periodic run that took longer than its every was due again at once (next_run_at = start + every, in
    the past): it ran back to back for ever, and rule 7 made every worker of its lock group give way all the
    while (a 1.5 s job every second; a change queued for its group waited 20 s). Such a
    run is next due min(every, 1 minute) after it ended; one ending within its every keeps start + every."""
    jobs.execute(
        "create table p (id int primary key);"
        " create table d (id int primary key references p on delete cascade);"
        " create function dc(ids int[]) returns table (id int) language sql stable"
        " as 'select id from public.p where ids is null or id = any(ids)';"
        " select lockstep.define_derived('d', 'd', 'dc(int[])', 'p', lock_group => 'g', every => '1 day');"
        " create function slower() returns void language sql as 'select pg_sleep(1.1)';"
        " select lockstep.define_job('slow', 'slower()', lock_group => 'g', every => '1 s');"
        " select lockstep.define_job('tick', 'tick()', every => '1 hour')"
    )
    assert result(jobs, "lockstep.run('d')")["action"] == "recompute"
    assert result(jobs, "lockstep.run('slow')")["outcome"] == "done"  # 1.1 s, its every 1 s
    gap = (
        "select next_run_at - last_finished_at, next_run_at - last_started_at"
        " from lockstep.job_state where job = %s"
    )
    after_end, after_start = jobs.execute(gap, ["slow"]).fetchone()
    assert after_end == timedelta(seconds=1) and after_start > timedelta(seconds=2)
    jobs.execute("select lockstep.enqueue('d', array[1])")
    jobs.execute("insert into p values (1)")
    assert result(jobs, "lockstep.work('d')")["outcome"] == "done"  # not busy: the slow job is not due yet
    jobs.execute("select lockstep.define_job('slow', 'slower()', lock_group => 'g', every => '1 s')")
    assert jobs.execute(gap, ["slow"]).fetchone()[0] == timedelta(seconds=1)  # the same definition: kept
    assert result(jobs, "lockstep.run('tick')")["outcome"] == "done"
    assert jobs.execute(gap, ["tick"]).fetchone()[1] == timedelta(hours=1)  # ended within its every
