"""Queue and worker: enqueue, triggers, work, dedup, poison keys, fairness, convergence."""

from __future__ import annotations

import random

import psycopg
import pytest
from util import advisory_locks, drain, flushed_stat, not_due, raises_sqlstate, result, snapshot

from lockstep import db
from lockstep.lab.example import JOB, divergence
from lockstep.status import exit_code


def status_exit_code(conn) -> int:
    """lockstep status's exit code for the rows of lockstep.status as they are now."""
    return exit_code(db.status(conn))


def queue_keys(conn) -> list[str]:
    return [k for (k,) in conn.execute("select key from lockstep.queue order by id")]


def test_triggers_enqueue_once_per_statement_sorted(ex):
    ex.execute("update example.exam set body = body || ' x' where id in (30, 10, 20)")
    assert queue_keys(ex) == ["10", "20", "30"]
    ex.execute("delete from lockstep.queue")
    ex.execute("update example.exam_item set exam_id = 2 where exam_id = 1")  # a move: old and new parent
    assert queue_keys(ex) == ["1", "2"]
    ex.execute("delete from lockstep.queue")
    ex.execute("delete from example.exam where id = 7")  # parent + cascaded items
    assert set(queue_keys(ex)) == {"7"}


@pytest.mark.parametrize(
    ("function", "before", "after"),
    [
        ("lockstep.enqueue_trigger()", "all (", "::pg_catalog.text[]"),
        ("lockstep._capture_read(name, pg_lsn, integer)", "v_pairs text[] := ", ";\n"),
    ],
)
def test_the_inline_fast_pairs_are_lockstep_fast_pairs(ex, function, before, after):
    """lockstep.enqueue_trigger() has no SET search_path and calls no lockstep function on its fast path, and
    lockstep._capture_read runs several times a second, so each writes the (column type, key type) pairs it
    takes inline: the same list as _fast_pairs()."""
    src = ex.execute("select prosrc from pg_proc where oid = %s::regprocedure", [function]).fetchone()[0]
    start = src.index(before + "'{") + len(before)
    inline = ex.execute(
        "select array_agg(x order by x) from unnest((" + src[start : src.index(after, start)] + ")::text[]) x"
    ).fetchone()[0]
    assert (
        inline
        == ex.execute("select array_agg(x order by x) from unnest(lockstep._fast_pairs()) x").fetchone()[0]
    )
    assert "20:bigint" in inline and "25:text" in inline and len(inline) == 15


def test_a_row_that_to_jsonb_cannot_convert_is_still_enqueued(ex):
    """A json column holding \\u0000 (valid json, no jsonb): the fast path's to_jsonb(row) raises, the trigger
    catches it and enqueues through the general path; the application's statement succeeds."""
    ex.execute("create table public.doc (exam_id bigint primary key, body json)")
    ex.execute(f"select lockstep.watch('{JOB}', 'public.doc', 'exam_id')")
    ex.execute("delete from lockstep.recompute_flag")  # watch()'s own: the table was not watched before
    ex.execute("""insert into public.doc values (3, '"\\u0000"'), (1, '{}')""")
    ex.execute("""update public.doc set body = '["\\u0000"]' where exam_id = 1""")
    assert queue_keys(ex) == ["1", "3", "1"]
    assert ex.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0


def test_a_table_watched_anew_flags_the_job_for_its_full_recompute(ex):
    # Changes made while a table is not watched (between unwatch() and watch(), say) reach no queue: four
    # rows of 500 stayed wrong, status healthy, until the periodic recompute. watch() of
    # a table not watched for the job flags it; watch() again over its own triggers loses nothing: no flag.
    flags = "select count(*) from lockstep.recompute_flag"
    ex.execute(f"select lockstep.unwatch('{JOB}', 'example.exam')")
    ex.execute("update example.exam set body = body || ' unseen' where id = 3")
    ex.execute(f"select lockstep.watch('{JOB}', 'example.exam', 'id')")
    assert ex.execute(flags).fetchone()[0] == 1
    st = ex.execute("select needs_recompute is not null, trigger_problem from lockstep.status").fetchone()
    assert st[0] and "example.exam newly watched" in st[1], st
    assert result(ex, f"lockstep.run('{JOB}')")["action"] == "recompute"  # the flag makes it due
    assert ex.execute(flags).fetchone()[0] == 0 and divergence(ex) == (0, 0)
    ex.execute(f"select lockstep.watch('{JOB}', 'example.exam', 'id')")
    assert ex.execute(flags).fetchone()[0] == 0


def test_a_table_watched_on_another_column_flags_the_job_for_its_full_recompute(ex):
    # watch() of a watched table on another column replaces its triggers; the changes made while the other
    # column was watched queued that column's values (or nothing), so they wait for the full recompute as
    # a newly watched table's do: the job is flagged, else rows stay wrong, status healthy, until the
    # periodic recompute (a wrong column watched, then the right one again).
    flags = "select count(*) from lockstep.recompute_flag"
    ex.execute("create table public.side (a bigint, b bigint)")
    ex.execute(f"select lockstep.watch('{JOB}', 'public.side', 'a')")
    ex.execute("delete from lockstep.recompute_flag")  # newly watched
    ex.execute(f"select lockstep.watch('{JOB}', 'public.side', 'b')")
    assert ex.execute("select problem from lockstep.recompute_flag").fetchall() == [
        ("public.side watched on column b now: its earlier changes wait for the full recompute",)
    ]
    ex.execute("delete from lockstep.recompute_flag")
    ex.execute(f"select lockstep.watch('{JOB}', 'public.side', 'b')")  # the same column again: nothing lost
    assert ex.execute(flags).fetchone()[0] == 0
    ex.execute(f"select lockstep.watch('{JOB}', 'public.side', 'a')")
    assert ex.execute(flags).fetchone()[0] == 1


def test_a_trigger_of_watchs_form_with_other_transition_tables_still_enqueues(ex):
    """The fast path's third argument (written by watch) with one's own transition-table names, or none:
    the fast path's read fails inside its block and the general path enqueues or flags: no statement fails."""
    ex.execute("create table public.mine (exam_id bigint primary key)")
    ex.execute(
        "create trigger mine_ins after insert on public.mine referencing new table as fresh"
        " for each statement"
        f" execute function lockstep.enqueue_trigger('{JOB}', 'exam_id', 'bigint')"
    )
    ex.execute(
        "create trigger mine_upd after update on public.mine for each statement"
        f" execute function lockstep.enqueue_trigger('{JOB}', 'exam_id', 'bigint')"
    )
    ex.execute("insert into public.mine values (4), (2)")
    assert queue_keys(ex) == ["2", "4"]
    ex.execute("update public.mine set exam_id = exam_id")
    assert queue_keys(ex) == ["2", "4"]
    assert ex.execute("select job from lockstep.recompute_flag").fetchall() == [(JOB,)]


def test_work_on_empty_queue_is_idle_and_takes_no_lock(ex, exconnect):
    ex.execute("begin")
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "idle"
    assert advisory_locks(exconnect(), ex.info.backend_pid) == []
    ex.execute("rollback")


def test_work_is_busy_at_once_when_the_group_is_taken(ex, exconnect):
    ex.execute(f"select lockstep.enqueue('{JOB}', array[1])")
    holder = exconnect()
    holder.execute("begin")
    holder.execute(f"select lockstep._try_lock('{JOB}')")
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "busy"
    holder.execute("rollback")
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "done"


def test_a_key_enqueued_many_times_is_computed_once(ex):
    for _ in range(1000):
        ex.execute(f"select lockstep.enqueue('{JOB}', array[42])")
    ex.execute(f"select lockstep.enqueue('{JOB}', array_fill(42, array[1000]))")
    assert ex.execute("select count(*) from lockstep.queue").fetchone()[0] == 1001
    # count compute calls through a wrapper that logs its arguments
    ex.execute(
        """
        create table calls (keys bigint[]);
        create function example.logged(ids bigint[]) returns table (exam_id bigint, key text, weight integer)
        language plpgsql as $$ begin insert into public.calls values (ids);
        return query select * from example.exam_key_compute(ids); end $$;
        """
    )
    ex.execute(
        f"select lockstep.define_derived('{JOB}', 'example.exam_key', 'example.logged(bigint[])',"
        " 'example.exam')"
    )
    not_due(ex, JOB)
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["outcome"] == "done" and not r["more"]
    assert ex.execute("select keys from calls").fetchall() == [([42],)]
    assert ex.execute("select count(*) from lockstep.queue").fetchone()[0] == 0


def test_work_applies_changes_and_removes_only_processed_entries(ex, exconnect):
    ex.execute("update example.exam set body = body || ' qqqnew' where id between 1 and 30")
    r = result(ex, f"lockstep.work('{JOB}', 10)")
    assert (r["outcome"], r["inserted"], r["more"]) == ("done", 10, True)
    assert len(queue_keys(ex)) == 20
    drain(ex, JOB, batch=10)
    assert queue_keys(ex) == []
    assert divergence(ex) == (0, 0)


def test_entries_appended_during_a_pass_stay_queued(ex, exconnect):
    ex.execute(f"select lockstep.enqueue('{JOB}', array[3])")
    ex.execute("begin")
    result(ex, f"lockstep.work('{JOB}')")
    # an app enqueues key 3 again while the pass is uncommitted: not lost
    exconnect().execute(f"select lockstep.enqueue('{JOB}', array[3])")
    ex.execute("commit")
    assert queue_keys(ex) == ["3"]


def test_poison_key_is_isolated_retried_parked_and_retried_on_demand(ex):
    ex.execute(
        """
        create function example.picky(ids bigint[]) returns table (exam_id bigint, key text, weight integer)
        language plpgsql as $$ begin
            if 13 = any(ids) then raise exception 'cannot compute exam 13'; end if;
            return query select * from example.exam_key_compute(ids); end $$;
        """
    )
    ex.execute(
        f"select lockstep.define_derived('{JOB}', 'example.exam_key', 'example.picky(bigint[])',"
        " 'example.exam')"
    )
    ex.execute(f"select lockstep.set_max_attempts('{JOB}', 2)")
    not_due(ex, JOB)
    ex.execute("update example.exam set body = body || ' poisonword' where id between 10 and 16")
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["outcome"] == "done"
    assert r["inserted"] == 6
    assert "cannot compute exam 13" in r["error"]
    assert queue_keys(ex) == ["13"]
    f = ex.execute("select attempts, parked, retry_at > now() from lockstep.failing_keys").fetchone()
    assert f == (1, False, True)
    # the key waits for its retry time: the queue does not stall behind it
    ex.execute("update example.exam set body = body || ' more' where id = 20")
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["inserted"] + r["updated"] >= 1
    ex.execute("update lockstep.key_failure set retry_at = now() - interval '1 s'")
    result(ex, f"lockstep.work('{JOB}')")
    assert ex.execute("select job, key, attempts from lockstep.parked_keys").fetchall() == [(JOB, "13", 2)]
    # its entries folded into one, counted: its change waits too
    assert ex.execute("select parked_keys, queue_depth from lockstep.status").fetchone() == (1, 1)
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "idle"
    # fixed: retry puts it back and it completes
    ex.execute(
        f"select lockstep.define_derived('{JOB}', 'example.exam_key',"
        " 'example.exam_key_compute(bigint[])', 'example.exam')"
    )
    not_due(ex, JOB)
    assert ex.execute(f"select lockstep.retry('{JOB}', array[13])").fetchone()[0] == 1
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "done"
    assert ex.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0
    assert divergence(ex) == (0, 0)


DUE_NOW = "update lockstep.key_failure set retry_at = now()"  # as if its retry time had come


def picky_job(ex: psycopg.Connection) -> None:
    """The example's job redefined with a compute that raises for an exam titled '...poison...', keys
    parked at their first failure, its periodic recompute not due."""
    ex.execute(
        """
        create function example.picky(ids bigint[]) returns table (exam_id bigint, key text, weight integer)
        language plpgsql as $$ begin
            if exists (select from example.exam e where e.id = any(ids) and e.title like '%poison%') then
                raise exception 'cannot compute a poisoned exam'; end if;
            return query select * from example.exam_key_compute(ids); end $$;
        """
    )
    ex.execute(
        f"select lockstep.define_derived('{JOB}', 'example.exam_key', 'example.picky(bigint[])',"
        " 'example.exam')"
    )
    ex.execute(f"select lockstep.set_max_attempts('{JOB}', 1)")
    not_due(ex, JOB)


def test_a_parked_key_queued_again_is_tried_again_once(ex):
    """A parked key's later changes were held until retry() or the next periodic recompute, the change that
    fixed its data included. A parked key queued again since it was parked is tried once
    more, alone, once its retry time has come: the fix of its data is written; a change that does not fix
    it parks it again, and the queue does not loop on it."""
    picky_job(ex)
    ex.execute("update example.exam set title = title || ' poison' where id = 13")
    ex.execute("update example.exam set body = body || ' fine' where id = 14")
    result(ex, f"lockstep.work('{JOB}')")
    assert ex.execute("select key from lockstep.parked_keys").fetchall() == [("13",)]
    assert ex.execute("select retry_at from lockstep.failing_keys").fetchall() == [(None,)]  # parked: none
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "idle"
    # changed again, still poisoned: tried once its retry time has come, parked again, then idle (no loop)
    ex.execute("update example.exam set body = body || ' again' where id = 13")
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "idle"  # not before its retry time
    ex.execute(DUE_NOW)
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["outcome"] == "done" and "poisoned" in r["error"]
    assert ex.execute("select key, parked from lockstep.failing_keys").fetchall() == [("13", True)]
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "idle"
    # the application fixes the data: the change is written, the key is no longer parked
    ex.execute("update example.exam set title = replace(title, ' poison', '') where id = 13")
    ex.execute(DUE_NOW)
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["outcome"] == "done" and r["error"] is None and r["inserted"] + r["updated"] + r["deleted"] > 0
    assert ex.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0
    assert queue_keys(ex) == [] and divergence(ex) == (0, 0)


def test_parked_keys_the_application_keeps_changing_do_not_starve_the_other_keys(ex):
    """Tried at once after any change, parked keys that the application changed between passes made every
    pass a retry pass of them alone, and the other keys' entries were never claimed. A parked key queued
    again waits for its retry time."""
    picky_job(ex)
    ex.execute("update example.exam set title = title || ' poison' where id = 13")
    result(ex, f"lockstep.work('{JOB}')")
    assert ex.execute("select key from lockstep.parked_keys").fetchall() == [("13",)]
    ex.execute(DUE_NOW)
    ex.execute("update example.exam set body = body || ' fine' where id = 14")
    for n in range(4):  # 13 changed before every pass
        ex.execute(f"update example.exam set body = body || ' again {n}' where id = 13")
        result(ex, f"lockstep.work('{JOB}')")
    assert "14" not in queue_keys(ex)  # before: still queued after every pass
    assert ex.execute("select key, attempts from lockstep.failing_keys").fetchall() == [
        ("13", 2)
    ]  # tried once
    # its change waits for retry_at, which failing_keys shows for a parked key too
    waiting = "select retry_at > now() from lockstep.failing_keys where key = '13'"
    assert ex.execute(waiting).fetchone()[0] is True


@pytest.mark.parametrize("budget", ["0", "1 hour"])
def test_a_retry_pass_ends_once_it_has_held_row_locks_for_its_budget(ex, budget):
    """A retry pass tried its keys one by one and held the row locks of each key it wrote through the
    computes of every later key (an application DELETE waited for them all). It now stops
    trying keys once it has held row locks for lockstep._retry_budget() (50 ms); the others stay queued,
    failing as they were, for the next pass, which comes at once (more). Not one key a pass: 300 fixed keys
    would hold every other change up for 300 passes."""
    ex.execute(
        "create or replace function lockstep._retry_budget() returns interval language sql immutable"
        f" as $$ select interval '{budget}' $$"
    )
    not_due(ex, JOB)
    ex.execute("update example.exam set body = body || ' changed' where id in (21, 22, 23)")
    ex.execute(f"select lockstep.enqueue('{JOB}', array[21, 22, 23])")
    ex.execute(
        "insert into lockstep.key_failure (job, key, attempts, last_error, retry_at, parked)"
        f" select '{JOB}', k::text, 1, 'x', now(), false from unnest(array[21, 22, 23]) k"
    )
    written = []
    for _ in range(3 if budget == "0" else 1):
        r = result(ex, f"lockstep.work('{JOB}')")
        assert r["outcome"] == "done" and r["inserted"] + r["updated"] + r["deleted"] > 0, r
        written.append((sorted(set(queue_keys(ex))), r["more"]))
    if budget == "0":  # one key a pass, each pass asking for the next
        assert written == [(["22", "23"], True), (["23"], True), ([], False)]
    else:
        assert written == [([], False)]
    assert ex.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0
    assert divergence(ex) == (0, 0)


def test_a_failing_key_whose_parent_an_application_holds_does_not_hold_up_the_queue(ex, exconnect):
    """A retry key skipped (its parent held) had its entry deferred a second, but the retry branch did not
    look at ready_at: it claimed the key again at every pass, `more` always true, and the other keys waited
    for the application's lock to go."""
    picky_job(ex)
    ex.execute("delete from example.exam_key where exam_id = 31")  # its rows are new: the write pins 31
    ex.execute(f"select lockstep.enqueue('{JOB}', array[31])")
    ex.execute(
        "insert into lockstep.key_failure (job, key, attempts, last_error, retry_at, parked)"
        f" values ('{JOB}', '31', 1, 'x', now(), false)"
    )
    app = exconnect()
    app.execute("begin")
    app.execute("select * from example.exam where id = 31 for update")
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["skipped"] == 1, r
    ex.execute("update example.exam set body = body || ' moved on' where id = 32")
    ex.execute(f"select lockstep.enqueue('{JOB}', array[32])")
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["outcome"] == "done" and r["updated"] + r["inserted"] > 0, r  # before: 31 again, skipped
    assert queue_keys(ex) == ["31"]
    app.execute("rollback")


def test_an_unreadable_key_does_not_rerun_a_recompute_while_a_parent_fails(ex):
    """An unreadable key makes the recompute due; with a poison parent that recompute failed too and
    handed every parent to the queue again, once per unreadable key."""
    picky_job(ex)
    ex.execute("update example.exam set title = title || ' poison' where id = 13")
    result(ex, f"lockstep.work('{JOB}')")
    assert ex.execute("select key from lockstep.parked_keys").fetchall() == [("13",)]
    ex.execute(f"insert into lockstep.queue (job, key) values ('{JOB}', 'x1')")
    r = result(ex, f"lockstep.work('{JOB}')")
    assert "cannot be read as bigint" in r["error"], r
    assert ex.execute("select next_run_at > now() from lockstep.status").fetchone()[0]
    # retry() drops it and makes the recompute due: the parent it stood for is not lost (without the
    # recompute, nothing would run until `every`)
    ex.execute("update example.exam set title = replace(title, ' poison', '') where id = 13")
    ex.execute(f"select lockstep.retry('{JOB}')")
    assert ex.execute("select next_run_at <= now() from lockstep.status").fetchone()[0]
    assert result(ex, f"lockstep.run('{JOB}')")["action"] == "recompute"
    assert divergence(ex) == (0, 0)


def test_a_fix_whose_transaction_began_before_the_key_was_parked_is_still_tried(ex, exconnect):
    """Queued again "since it was parked" was told by time: enqueued_at (its transaction's start) after
    last_failed_at. A fix whose transaction began before the try that parked the key, and committed after
    it, looked older: the key stayed parked on fixed data. It is told by queue id now:
    an entry above the highest one the failing pass had claimed."""
    picky_job(ex)
    ex.execute("update example.exam set title = title || ' poison' where id = 13")
    app = exconnect()
    app.execute("begin")
    app.execute("select 1")  # the application's transaction begins (now() is fixed from here)
    result(ex, f"lockstep.work('{JOB}')")  # the try that parks 13
    assert ex.execute("select key from lockstep.parked_keys").fetchall() == [("13",)]
    app.execute("update example.exam set title = replace(title, ' poison', '') where id = 13")
    app.execute("commit")
    ex.execute(DUE_NOW)
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["outcome"] == "done" and r["error"] is None, r  # before: idle, 13 parked on fixed data
    assert ex.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0
    assert queue_keys(ex) == [] and divergence(ex) == (0, 0)


def test_retry_drops_a_queued_key_that_names_no_parent_and_retries_the_others(ex):
    # A trigger on a column whose type changed since watch() can queue 'abc' for a bigint job: the worker
    # parks it (it cannot be read as bigint). retry() queued it again through the bigint cast, failed with
    # 22P02, and so retried none of the job's other parked keys; recompute cleared the failure, and the
    # still-queued entries parked it again. It names no parent: retry drops it.
    not_due(ex, JOB)
    ex.execute(f"insert into lockstep.queue (job, key) values ('{JOB}', 'abc')")
    ex.execute(f"select lockstep.enqueue('{JOB}', array[5])")
    ex.execute(  # parked after its entry was queued (failed_upto: the highest queue id it had seen)
        "insert into lockstep.key_failure (job, key, attempts, parked, retry_at, failed_upto)"
        f" values ('{JOB}', '5', 5, true, now(), (select max(id) from lockstep.queue))"
    )
    result(ex, f"lockstep.work('{JOB}')")
    parked = "select key from lockstep.parked_keys order by 1"
    assert ex.execute(parked).fetchall() == [("5",), ("abc",)]
    # 'abc' made the recompute due (test_worker_faults.py); this test is about retry()
    not_due(ex, JOB)
    warnings: list[str] = []
    ex.add_notice_handler(lambda d: warnings.append(d.message_primary or ""))
    assert ex.execute(f"select lockstep.retry('{JOB}')").fetchone()[0] == 1  # 5 only
    assert any("cannot be read as bigint" in w and "'abc'" in w for w in warnings), warnings
    assert set(queue_keys(ex)) == {"5"}  # its parked entry and the retry's
    # dropping 'abc' made the recompute due: its parent is the recompute's (tested in
    # test_an_unreadable_key_does_not_rerun_a_recompute_while_a_parent_fails); here the worker's part
    assert ex.execute("select next_run_at <= now() from lockstep.status").fetchone()[0]
    not_due(ex, JOB)
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "done"
    assert ex.execute(parked).fetchall() == [] and queue_keys(ex) == []
    assert divergence(ex) == (0, 0)


def test_a_failed_recompute_stays_reported_after_good_worker_passes_and_retry_ends_its_backoff(ex):
    # A worker pass that succeeded reset consecutive_failures and last_error: lockstep status turned healthy
    # while the failed recompute waited out its hour of backoff, and retry() (which looked at those) then
    # no longer ended it.
    ex.execute(
        """
        create function example.no_full(ids bigint[]) returns table (exam_id bigint, key text, weight integer)
        language plpgsql as $$ begin
            if ids is null then
                raise exception 'the full recompute may not read' using errcode = '42501';
            end if;
            return query select * from example.exam_key_compute(ids); end $$;
        """
    )
    ex.execute(
        f"select lockstep.define_derived('{JOB}', 'example.exam_key', 'example.no_full(bigint[])',"
        " 'example.exam')"
    )
    r = result(ex, f"lockstep.run('{JOB}')")
    assert (r["action"], r["outcome"]) == ("recompute", "failed"), r
    ex.execute("update example.exam set body = body || ' edited' where id = 3")
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["outcome"] == "done", r
    st = "select consecutive_failures, last_error, recompute_error, next_run_at > now() from lockstep.status"
    fails, last, rerr, later = ex.execute(st).fetchone()
    assert (fails, last, later) == (0, None, True) and "may not read" in rerr
    assert status_exit_code(ex) == 1
    assert result(ex, f"lockstep.run('{JOB}')")["outcome"] == "backoff"
    ex.execute(f"select lockstep.retry('{JOB}')")
    assert ex.execute(st).fetchone()[3] is False  # the recompute is due again
    ex.execute(
        f"select lockstep.define_derived('{JOB}', 'example.exam_key',"
        " 'example.exam_key_compute(bigint[])', 'example.exam')"
    )
    assert result(ex, f"lockstep.recompute('{JOB}')")["outcome"] == "done"
    assert ex.execute(st).fetchone()[2] is None and status_exit_code(ex) == 0


def test_a_privilege_only_the_write_needs_fails_the_job_not_key_after_key(ex):
    # INSERT on the target revoked from the job's role: an empty pass writes nothing and went through, so
    # the batch was bisected and key after key failed and was parked while the job looked healthy. An
    # error of class 42 is the job's wherever it is raised. (The revoked privilege is played
    # by a trigger raising 42501 on insert: the job's role here is the superuser.)
    ex.execute(
        """
        create function example.deny() returns trigger language plpgsql as $$ begin
            raise exception 'permission denied for table exam_key' using errcode = '42501'; end $$;
        create trigger deny before insert on example.exam_key for each row execute function example.deny();
        """
    )
    not_due(ex, JOB)
    ex.execute("update example.exam set body = body || ' newword' where id in (3, 4)")
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["outcome"] == "failed" and "permission denied" in r["error"], r
    assert ex.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0
    assert sorted(queue_keys(ex)) == ["3", "4"]


def test_a_broken_job_fails_as_a_whole_and_poisons_no_key(ex):
    ex.execute(f"select lockstep.enqueue('{JOB}', array[1, 2, 3])")
    ex.execute("alter table example.exam_key rename column weight to w2")
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["outcome"] == "failed"
    assert ex.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0
    assert len(queue_keys(ex)) == 3
    assert ex.execute("select retry_at > now() from lockstep.job_state").fetchone()[0]
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "backoff"


def test_a_lock_timeout_fails_the_pass_as_a_whole_and_parks_no_key(ex, exconnect):
    """A runner with lock_timeout whose pass meets an application's table lock on the target (55P03) is not
    a fault of its keys: the bisection blamed them one by one and parked them after max_attempts, so the
    changes waited for a manual retry after the lock was long gone. Like a deadlock or a
    serialization failure, it now fails the pass as a whole: keys stay queued, none is failing, and the
    pass after the backoff writes them."""
    ex.execute(f"select lockstep.set_max_attempts('{JOB}', 1)")
    ex.execute("update example.exam set body = body || ' locked out' where id in (1, 2, 3)")
    ex.execute("delete from lockstep.queue")
    ex.execute(f"select lockstep.enqueue('{JOB}', array[1, 2, 3])")
    app = exconnect()
    app.execute("begin")
    app.execute("lock table example.exam_key in exclusive mode")  # blocks row locks, not reads
    ex.execute("set lock_timeout = '100ms'")
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["outcome"] == "failed" and "lock timeout" in r["error"], r
    assert ex.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0
    assert sorted(queue_keys(ex)) == ["1", "2", "3"]
    app.execute("rollback")
    ex.execute("update lockstep.job_state set retry_at = now()")  # the backoff over
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["outcome"] == "done" and r["inserted"] + r["deleted"] > 0, r
    assert queue_keys(ex) == [] and divergence(ex) == (0, 0)


def test_a_parent_whose_compute_always_raises_a_transient_error_is_isolated_after_three_passes(ex):
    """A lock timeout, deadlock or serialization failure fails a pass as a whole (lockstep._transient), but a
    parent whose own compute raises 40001 every time then failed every pass and every recompute: nothing
    written, no key parked, the job stalled. After 3 failed passes in a row the pass
    bisects as for any error: the parent is isolated and the others are written."""
    ex.execute(
        "create function example.serial(ids bigint[])"
        " returns table (exam_id bigint, key text, weight integer) language plpgsql stable as $$ begin"
        " if 3 = any(ids) then raise exception 'compute serialization' using errcode = '40001'; end if;"
        " return query select * from example.exam_key_compute(ids); end $$"
    )
    ex.execute(
        f"select lockstep.define_derived('{JOB}', 'example.exam_key', 'example.serial(bigint[])',"
        " 'example.exam', every => '1 day')"
    )
    ex.execute("update lockstep.job_state set next_run_at = now() + interval '1 day'")
    ex.execute("update example.exam set body = body || ' serialword' where id between 1 and 5")
    ex.execute("delete from lockstep.queue")
    ex.execute(f"select lockstep.enqueue('{JOB}', array[1, 2, 3, 4, 5])")
    outcomes = []
    for _ in range(4):
        ex.execute("update lockstep.job_state set retry_at = now()")  # the backoff over
        outcomes.append(result(ex, f"lockstep.work('{JOB}')")["outcome"])
    assert outcomes == ["failed", "failed", "failed", "done"]
    assert queue_keys(ex) == ["3"]
    assert ex.execute("select key from lockstep.key_failure").fetchall() == [("3",)]
    written = ex.execute(
        "select array_agg(distinct exam_id order by exam_id) from example.exam_key where key = 'serialword'"
    ).fetchone()[0]
    assert written == [1, 2, 4, 5]


def test_a_table_lock_on_the_parent_is_waited_for_as_a_table_lock_not_retried_row_by_row(ex, exconnect):
    """The pin of parents cuts a row wait short (lockstep._pin_timeout) and retries a few rows at a time;
    a table lock an application holds on the parent ended the first statement the same way, and the
    retry then waited 10 ms on it for every row and skipped every key, pass after pass.
    The table lock is now waited for with the session's own lock_timeout, as before: with one
    set, the pass fails as a whole (lockstep._transient) and its keys stay queued, not deferred."""
    ex.execute("update example.exam set body = body || ' tablelockword' where id in (1, 2, 3)")
    ex.execute("delete from lockstep.queue")
    ex.execute(f"select lockstep.enqueue('{JOB}', array[1, 2, 3])")
    app = exconnect()
    app.execute("begin")
    app.execute("lock table example.exam in exclusive mode")  # reads pass, row locks wait
    ex.execute("set lock_timeout = '300ms'")
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["outcome"] == "failed" and "lock timeout" in r["error"], r  # before: done, 3 skipped
    assert ex.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0
    app.execute("rollback")
    ex.execute("update lockstep.job_state set retry_at = now()")
    r = result(ex, f"lockstep.work('{JOB}')")
    assert (r["outcome"], r["skipped"]) == ("done", 0) and r["inserted"] == 3, r


def test_a_lock_timeout_fails_a_recompute_as_a_whole_and_hands_nothing_off(ex, exconnect):
    """The same for a recompute: a lock timeout in its whole-table pass was taken for poison parents, and
    every parent was handed to the worker's bisection."""
    ex.execute("update example.exam set body = body || ' locked out' where id in (1, 2, 3)")
    ex.execute("delete from lockstep.queue")
    app = exconnect()
    app.execute("begin")
    app.execute("lock table example.exam_key in exclusive mode")
    ex.execute("set lock_timeout = '100ms'")
    r = result(ex, f"lockstep.recompute('{JOB}')")
    assert r["outcome"] == "failed" and "lock timeout" in r["error"], r
    assert queue_keys(ex) == [] and ex.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0
    # tried again within a minute, not after the job's hour of backoff
    soon = "select next_run_at <= now() + interval '1 minute' from lockstep.job_state where job = %s"
    assert ex.execute(soon, [JOB]).fetchone()[0]
    app.execute("rollback")
    assert result(ex, f"lockstep.recompute('{JOB}')")["outcome"] == "done"
    assert divergence(ex) == (0, 0)


def test_a_parent_key_widened_past_the_jobs_key_type_fails_the_run_and_says_what_to_do(conn):
    # after `alter column id type bigint` on the parent, a key beyond the old range made the recompute's
    # hand-off of every parent raise 22003 out of run() and recompute(): no failed run recorded, status
    # showing the last run done, the runner retrying for ever
    conn.execute(
        "create table p (id int primary key);"
        " create table d (p_id int primary key references p on delete cascade on update cascade,"
        " n int not null);"
        " create function dc(ids int[]) returns table (p_id int, n int) language sql stable"
        " as $$ select id, 1 from public.p where ids is null or id = any(ids) $$;"
        " insert into p values (1), (2);"
        " select lockstep.define_derived('d', 'd', 'dc(int[])', 'p');"
        " select lockstep.recompute('d');"
        " alter table p alter column id type bigint;"
        " insert into p values (3000000000);"
    )
    for call in ("lockstep.recompute('d')", "lockstep.run('d')"):
        conn.execute("update lockstep.job_state set next_run_at = now(), consecutive_failures = 0")
        r = result(conn, call)
        assert r["outcome"] == "failed", r
        assert "parent key public.p.id is bigint" in r["error"] and "define_derived" in r["error"], r
    s = conn.execute("select last_outcome, last_error is not null from lockstep.status").fetchone()
    assert s == ("failed", True)
    assert conn.execute("select count(*) from lockstep.queue").fetchone()[0] == 0


def test_a_flagged_job_whose_recompute_fails_waits_out_its_backoff_between_worker_passes(ex):
    """A job flagged for its full recompute (a TRUNCATE, a newly watched table) whose recompute failed ran
    it again after every worker pass: a good pass reset consecutive_failures, and the flag was read only
    while that was 0, so the hour of backoff was ignored and a 1.5 s recompute ran 20 times in 30 s.
    The failed recompute's error (recompute_error) now holds the flag back too."""
    ex.execute(
        "create function example.whole_fails(ids bigint[])"
        " returns table (exam_id bigint, key text, weight integer) language plpgsql stable as $$ begin"
        " if ids is null and current_setting('test.whole_fails', true) = 'on' then"
        "   raise exception 'the whole table is unavailable' using errcode = '42501'; end if;"
        " return query select * from example.exam_key_compute(ids); end $$"
    )
    ex.execute(
        f"select lockstep.define_derived('{JOB}', 'example.exam_key', 'example.whole_fails(bigint[])',"
        " 'example.exam', every => '1 day')"
    )
    ex.execute("update lockstep.job_state set next_run_at = now() + interval '1 day'")
    ex.execute("delete from lockstep.queue; delete from lockstep.run_log")
    ex.execute("set test.whole_fails = 'on'")
    ex.execute(f"insert into lockstep.recompute_flag (job, problem) values ('{JOB}', 'a test flag')")
    r = result(ex, f"lockstep.run('{JOB}')")
    assert (r["action"], r["outcome"]) == ("recompute", "failed"), r
    ex.execute(f"select lockstep.enqueue('{JOB}', array[1, 2])")
    assert result(ex, f"lockstep.run('{JOB}')")["action"] == "work"  # the worker goes on meanwhile
    for _ in range(3):
        r = result(ex, f"lockstep.run('{JOB}')")
        assert r["action"] != "recompute", r  # before: recompute, failed, after every pass
    due = ex.execute(f"select due_at > now() + interval '30 minutes' from lockstep.due(array['{JOB}'])")
    assert due.fetchone()[0]  # before: due now, so the runner called it at once
    recomputes = ex.execute(
        f"select count(*) from lockstep.run_log where job = '{JOB}' and action = 'recompute'"
    ).fetchone()[0]
    assert recomputes == 1
    # retry ends the backoff: the recompute runs at once, succeeds and clears the flag
    ex.execute("reset test.whole_fails")
    ex.execute(f"select lockstep.retry('{JOB}')")
    r = result(ex, f"lockstep.run('{JOB}')")
    assert (r["action"], r["outcome"]) == ("recompute", "done"), r
    assert ex.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0


def test_a_due_recompute_is_not_starved_by_the_worker(ex):
    """Rule 7: with keys always queued, a worker gives way once the group's periodic job is due."""
    ex.execute("update lockstep.job_state set next_run_at = now() - interval '1 second'")
    ex.execute(f"select lockstep.enqueue('{JOB}', array[1, 2])")
    r = result(ex, f"lockstep.work('{JOB}')")
    assert r["outcome"] == "busy"
    r = result(ex, f"lockstep.run('{JOB}')")
    assert r["action"] == "recompute" and r["outcome"] == "done"
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "done"


def test_convergence_with_random_changes_and_work_passes(ex):
    rnd = random.Random(11)
    for step in range(80):
        a = rnd.randint(1, 230)
        op = rnd.choice(["edit", "delete", "insert", "item", "work"])
        if op == "edit":
            ex.execute("update example.exam set body = example.words(5, %s) where id = %s", [step, a])
        elif op == "delete":
            ex.execute("delete from example.exam where id = %s", [a])
        elif op == "insert":
            ex.execute(
                "insert into example.exam (id, title, body) values (%s, 'new exam', 'fresh words')"
                " on conflict do nothing",
                [a],
            )
        elif op == "item":
            ex.execute(
                "insert into example.exam_item (exam_id, body) select id, 'item words' from example.exam"
                " where id = %s",
                [a],
            )
        else:
            result(ex, f"lockstep.work('{JOB}', 7)")
    drain(ex, JOB, batch=50)
    assert divergence(ex) == (0, 0)


@pytest.mark.parametrize(
    ("call", "sqlstate", "match"),
    [
        (f"lockstep.enqueue('{JOB}', null::bigint[])", "22004", "must not be NULL"),
        (f"lockstep.enqueue('{JOB}', array[1, null]::bigint[])", "22004", "must not contain NULL"),
        (f"lockstep.enqueue('{JOB}', array['a', 'b'])", "LSQ01", "parent key example.exam.id"),
        (f"lockstep.enqueue('{JOB}', array[array[1, 2], array[3, 4]]::bigint[])", "22023", "one-dimensional"),
        (f"lockstep.enqueue('{JOB}', array[1.5]::numeric[])", "LSQ01", "is numeric"),  # was 22P02
        (f"lockstep.enqueue('{JOB}', array[3]::numeric[])", "LSQ01", "is numeric"),  # was accepted, as 3
        (f"lockstep.enqueue('{JOB}', array[3.7]::float8[])", "LSQ01", "is double precision"),
        (f"lockstep.enqueue('{JOB}', array[1e30]::numeric[])", "LSQ01", "is numeric"),  # was 22003
        ("lockstep.enqueue('nope', array[1])", "LSJ01", "unknown job"),
        ("lockstep.enqueue(null, array[1])", "22004", "NULL"),
        (f"lockstep.work('{JOB}', 0)", "22023", "positive"),
        (f"lockstep.work('{JOB}', -1)", "22023", "positive"),
        ("lockstep.work('nope')", "LSJ01", "unknown job"),
        (f"lockstep.retry('{JOB}', null::bigint[])", "22004", "must not be NULL"),
        (f"lockstep.set_max_attempts('{JOB}', 0)", "22023", "positive"),
        (f"lockstep.set_max_attempts('{JOB}', null)", "22004", "got NULL"),  # was 22023 (README: 22004)
        (f"lockstep.set_batch_parents('{JOB}', null)", "22004", "got NULL"),
        (f"lockstep.set_batch_parents('{JOB}', 0)", "22023", "between 1 and 1000000"),
        (f"lockstep.watch('{JOB}', 'example.exam', 'nope')", "42703", "has no column"),
        (f"lockstep.watch('{JOB}', 'example.exam', 'title')", "LSQ01", "is text"),
        (f"lockstep.watch('{JOB}', null, 'id')", "22004", "NULL"),
        ("lockstep.unwatch('nope', 'example.exam')", "LSJ01", "unknown job"),  # it passed silently
    ],
)
def test_bad_queue_input_is_refused_and_changes_nothing(ex, call, sqlstate, match):
    ex.execute(f"select lockstep.enqueue('{JOB}', array[5])")
    before = snapshot(ex, "example.exam_key")
    with raises_sqlstate(sqlstate, match):
        ex.execute(f"select {call}")
    assert snapshot(ex, "example.exam_key") == before


def test_work_claims_the_jobs_batch_parents_unless_told_otherwise(ex):
    """work(job) claimed 500 keys whatever batch_parents said (the README promises no transaction writes more
    than batch_parents parents); now its default is the job's batch_parents, as run(); an explicit batch
    is the caller's choice."""
    ex.execute(f"select lockstep.set_batch_parents('{JOB}', 3)")
    ex.execute("update example.exam set body = body || ' w' where id <= 10")  # the trigger queues 1..10
    claimed = []
    for call in (f"lockstep.work('{JOB}')", f"lockstep.work('{JOB}', null)", f"lockstep.work('{JOB}', 4)"):
        before = len(queue_keys(ex))
        assert result(ex, call)["outcome"] == "done"
        claimed.append(before - len(queue_keys(ex)))
    assert claimed == [3, 3, 4]


def test_enqueue_accepts_same_category_types_and_counts_distinct_keys(ex):
    assert ex.execute(f"select lockstep.enqueue('{JOB}', array[3, 1, 3, 2]::int[])").fetchone()[0] == 3
    assert ex.execute(f"select lockstep.enqueue('{JOB}', '{{}}'::bigint[])").fetchone()[0] == 0
    assert queue_keys(ex) == ["1", "2", "3"]


def test_job_without_parent_has_no_queue(conn):
    conn.execute(
        """
        create table agg (b int primary key, n bigint);
        create function f(x int[]) returns table (b int, n bigint) language sql as $$ select 1, 1::bigint $$;
        select lockstep.define_derived('agg', 'agg', 'f(int[])');
        """
    )
    with raises_sqlstate("LSJ02", "has no parent"):
        conn.execute("select lockstep.enqueue('agg', array[1])")
    with raises_sqlstate("LSJ02", "has no parent"):
        conn.execute("select lockstep.work('agg')")


def test_drop_job_drops_its_triggers(ex):
    assert ex.execute("select count(*) from lockstep._trigger_fns() f(oid)").fetchone()[0] > 1
    ex.execute(f"select lockstep.drop_job('{JOB}')")
    left = "select count(*) from pg_trigger where tgfoid in (select lockstep._trigger_fns())"
    assert ex.execute(left).fetchone()[0] == 0
    # and the functions watch() generated for them: only the shared trigger functions are left
    listed = (
        "select array_agg(f::regprocedure::text order by f::regprocedure::text)"
        " from lockstep._trigger_fns() f"
    )
    fns = ex.execute(listed).fetchone()[0]
    assert fns == ["lockstep.enqueue_replica()", "lockstep.enqueue_through()", "lockstep.enqueue_trigger()"]
    ex.execute("update example.exam set body = 'x' where id = 1")  # no trigger left to fail


WIDE_SQL = """
create table wide (id int primary key, n int not null, body text not null);
create table wide_n (id int primary key references wide on delete cascade, n int not null);
create function wide_n_c(keys int[]) returns table (id int, n int) language sql stable
    as $$ select w.id, w.n from public.wide w where keys is null or w.id = any(keys) $$;
insert into wide select g, 0, (select string_agg(md5((g * 1000 + i)::text), ' ')
                               from generate_series(1, 3000) i)
from generate_series(1, 20) g;
select lockstep.define_derived('wide_n', 'wide_n', 'wide_n_c(int[])', 'wide');
select lockstep.recompute('wide_n');
"""


def toast_blocks(conn: psycopg.Connection) -> int:
    return flushed_stat(
        conn,
        "select coalesce(toast_blks_hit, 0) + coalesce(toast_blks_read, 0) from pg_statio_user_tables"
        " where relid = 'wide'::regclass",
    )


def test_watch_triggers_read_only_the_key_column_of_wide_rows(conn, connect):
    # The shared trigger function's fast path read the key through to_jsonb of the whole row, which detoasts
    # every column: ~500 us per single-row UPDATE of a row with a 200 KB text column (against ~5 us
    # unwatched). watch() now generates a function that names the key column, so no TOAST block is read.
    conn.execute(WIDE_SQL)
    conn.execute("select lockstep.watch('wide_n', 'wide', 'id')")
    conn.execute("delete from lockstep.queue")
    app = connect()
    before = toast_blocks(app)
    for i in range(1, 11):  # an UPDATE of another column reads no TOAST block itself
        app.execute("update wide set n = n + 1 where id = %s", [i])
    assert toast_blocks(app) - before == 0
    app.execute("delete from wide where id = 20")  # these write TOAST chunks themselves: not counted
    app.execute("insert into wide values (21, 0, repeat('x', 300000))")
    assert [k for (k,) in conn.execute("select key from lockstep.queue order by id")] == [
        str(i) for i in range(1, 11)
    ] + ["20", "21"]
    fn = conn.execute(  # the truncate trigger flags the job through the shared function
        "select distinct tgfoid::regproc::text from pg_trigger"
        " where tgrelid = 'wide'::regclass and not tgisinternal and tgtype & 32 = 0"
    ).fetchall()
    assert len(fn) == 1 and fn[0][0].startswith("lockstep.enqueue_w_"), fn
    assert result(conn, "lockstep.work('wide_n')")["outcome"] == "done"
    assert (
        conn.execute("select count(*) from wide_n w join wide_n_c(null) c using (id, n)").fetchone()[0] == 20
    )


PARTED_SQL = """
create table acct (id int primary key);
insert into acct select generate_series(1, 10);
create table tally (id int primary key references acct on delete cascade, n bigint not null);
create table ev (aid int not null, amount int not null) partition by range (amount);
create table ev_lo (junk int, aid int not null, amount int not null);
alter table ev_lo drop column junk;  -- aid is column 2 here, column 1 in ev
alter table ev attach partition ev_lo for values from (minvalue) to (100);
create table ev_hi partition of ev for values from (100) to (maxvalue);
create function tally_c(keys int[]) returns table (id int, n bigint) language sql stable
    as $$ select e.aid, count(*) from public.ev e where keys is null or e.aid = any(keys) group by e.aid $$;
select lockstep.define_derived('tally', 'tally', 'tally_c(int[])', 'acct');
select lockstep.watch('tally', 'ev', 'aid');
"""


def test_the_generated_trigger_follows_its_column_through_partitions_renames_and_drops(conn, connect):
    # The generated trigger runs its static statements without a subtransaction only where the key column
    # is still the one watch() found (its attribute number in each table of the family, written in); a
    # renamed, dropped or re-added column takes the guarded read. Each step must enqueue, and no
    # application statement may fail.
    conn.execute(PARTED_SQL)
    conn.execute("delete from lockstep.recompute_flag")
    app = connect()

    def queued() -> list[str]:
        keys = [k for (k,) in conn.execute("select key from lockstep.queue order by id")]
        conn.execute("delete from lockstep.queue")
        return keys

    app.execute("insert into ev values (1, 5), (2, 500)")  # through the parent
    app.execute("insert into ev_lo values (3, 6)")  # into the partition, whose aid is column 2
    app.execute("update ev_hi set amount = amount + 1 where aid = 2")
    app.execute("delete from ev_lo where aid = 3")
    assert queued() == ["1", "2", "3", "2", "3"]
    app.execute("alter table ev rename to ev_renamed")  # the table's name is not the column's
    app.execute("alter table ev_lo set schema lockstep")  # nor its schema
    app.execute("update ev_renamed set amount = amount + 1 where aid = 1")
    app.execute("update lockstep.ev_lo set amount = amount + 1 where aid = 1")
    assert queued() == ["1", "1"]
    app.execute("alter table ev_renamed rename column aid to acct_id")  # the static read would not plan
    app.execute("update ev_renamed set amount = amount + 1 where acct_id = 1")
    assert queued() == [] and conn.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 1
    app.execute("alter table ev_renamed rename column acct_id to aid")
    app.execute("alter table ev_renamed drop column aid")  # and added again: another attribute number
    app.execute("alter table ev_renamed add column aid int")
    app.execute("insert into ev_renamed values (7, 4)")  # (amount, aid)
    app.execute("update lockstep.ev_lo set aid = 5 where amount = 7")
    assert queued() == ["4", "4", "5"]
    fns = conn.execute(
        "select distinct tgfoid::regproc::text from pg_trigger t"
        " where tgrelid in ('ev_renamed'::regclass, 'lockstep.ev_lo'::regclass, 'ev_hi'::regclass)"
        " and not tgisinternal and tgtype & 32 = 0"
    ).fetchall()
    assert len(fns) == 1 and fns[0][0].startswith("lockstep.enqueue_w_"), fns


def test_unwatch_and_dropped_tables_leave_no_generated_function(conn):
    conn.execute(WIDE_SQL)
    conn.execute("create table wide2 (like wide including all)")

    def generated() -> int:
        sql = "select count(*) from lockstep._trigger_fns() f where f::regproc::text ~ '^lockstep.enqueue_w_'"
        return conn.execute(sql).fetchone()[0]

    conn.execute("select lockstep.watch('wide_n', 'wide', 'id'), lockstep.watch('wide_n', 'wide2', 'id')")
    assert generated() == 2
    conn.execute("select lockstep.watch('wide_n', 'wide', 'id')")  # again: replaced, not added
    assert generated() == 2
    conn.execute("select lockstep.unwatch('wide_n', 'wide')")
    assert generated() == 1
    conn.execute("drop table wide2")  # its triggers go with it; its function at the next watch or unwatch
    conn.execute("select lockstep.unwatch('wide_n', 'wide')")
    assert generated() == 0


def test_a_derived_row_moving_to_another_parent(conn):
    conn.execute(
        """
        create table p (id int primary key);
        create table d (name text primary key, p_id int not null references p on delete cascade, n int);
        create index on d (p_id);
        create table src (name text primary key, p_id int not null references p, n int);
        create function f(ids int[]) returns table (name text, p_id int, n int) language sql
            as $$ select name, p_id, n from public.src where ids is null or p_id = any(ids) $$;
        select lockstep.define_derived('mv', 'd', 'f(int[])', 'p');
        insert into p values (1), (2);
        insert into src values ('a', 1, 1), ('b', 1, 2);
        """
    )
    assert result(conn, "lockstep.recompute('mv')")["inserted"] == 2
    conn.execute("update src set p_id = 2 where name = 'a'")
    conn.execute("select lockstep.enqueue('mv', array[2])")  # only the new parent
    r = result(conn, "lockstep.work('mv')")
    assert (r["inserted"], r["updated"], r["deleted"]) == (0, 1, 0)
    assert conn.execute("select * from d order by name").fetchall() == [("a", 2, 1), ("b", 1, 2)]


def test_a_pass_runs_only_the_write_statements_it_has_rows_for(conn):
    """Each write step is a statement planned at every pass (~0.1-0.2 ms of a pass of 50 keys): a pass that
    only updates runs no DELETE and no INSERT on the target, one that only inserts no UPDATE and no DELETE.
    Seen through statement triggers on the target (they fire for a statement of zero rows too); before,
    every pass ran all three."""
    conn.execute(
        """
        create table p (id int primary key);
        create table d (id int primary key references p on delete cascade, n int);
        create table src (id int primary key references p, n int);
        create function f(ids int[]) returns table (id int, n int) language sql
            as $$ select id, n from public.src where ids is null or id = any(ids) $$;
        create table stmt_log (n serial, op text);
        create function log_op() returns trigger language plpgsql
            as $$ begin insert into public.stmt_log (op) values (tg_op); return null; end $$;
        create trigger d_ins before insert on d for each statement execute function log_op();
        create trigger d_upd before update on d for each statement execute function log_op();
        create trigger d_del before delete on d for each statement execute function log_op();
        select lockstep.define_derived('mv', 'd', 'f(int[])', 'p');
        insert into p select generate_series(1, 4);
        insert into src values (1, 10), (2, 20);
        """
    )

    def ops(call: str) -> list[str]:
        conn.execute("delete from stmt_log")
        result(conn, call)
        return [op for (op,) in conn.execute("select op from stmt_log order by n")]

    assert ops("lockstep.recompute('mv')") == ["INSERT", "UPDATE"]  # ON CONFLICT DO UPDATE fires both
    conn.execute("update src set n = n + 1")
    conn.execute("select lockstep.enqueue('mv', array[1, 2])")
    assert ops("lockstep.work('mv')") == ["UPDATE"]
    conn.execute("insert into src values (3, 30)")
    conn.execute("select lockstep.enqueue('mv', array[3])")
    assert ops("lockstep.work('mv')") == ["INSERT", "UPDATE"]
    conn.execute("delete from src where id = 1")
    conn.execute("select lockstep.enqueue('mv', array[1])")
    assert ops("lockstep.work('mv')") == ["DELETE"]
    conn.execute("select lockstep.enqueue('mv', array[2, 4])")  # nothing changed: no statement at all
    assert ops("lockstep.work('mv')") == []
    assert conn.execute("select id, n from d order by id").fetchall() == [(2, 21), (3, 30)]


def test_writes_made_directly_to_a_partition_of_a_watched_table_are_queued(conn):
    """watch() on a partitioned table put its statement triggers on the root only, and a statement trigger
    fires only for statements naming its table: an UPDATE of a partition itself was neither queued nor
    flagged, and the derived row stayed stale with status healthy. Now every partition
    (at every level) has the triggers too, and unwatch / drop_job remove them all."""
    conn.execute(
        """
        create table p (id bigint primary key);
        create table c (id bigint, region text, p_id bigint not null references p on delete cascade, v int,
                        primary key (id, region)) partition by list (region);
        create table c_eu partition of c for values in ('eu');
        create table c_us partition of c for values in ('us') partition by range (id);
        create table c_us1 partition of c_us for values from (0) to (1000);
        create table d (p_id bigint primary key references p on delete cascade, total int not null);
        create function f(ids bigint[]) returns table (p_id bigint, total int) language sql as $$
            select p.id, coalesce(sum(c.v), 0)::int from public.p left join public.c on c.p_id = p.id
            where ids is null or p.id = any(ids) group by p.id $$;
        insert into p values (1), (2), (3);
        insert into c values (1, 'eu', 1, 10), (2, 'eu', 2, 20), (3, 'us', 3, 30);
        select lockstep.define_derived('dj', 'd', 'f(bigint[])', 'p');
        select lockstep.recompute('dj');
        """
    )
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    conn.execute("select lockstep.watch('dj', 'c', 'p_id')")
    assert any("covers its 3 partition(s)" in n for n in notices), notices
    conn.execute("update c set v = 11 where id = 1")  # through the root
    conn.execute("update c_eu set v = 21 where id = 2")  # the partition itself: was lost
    conn.execute("insert into c_us1 values (4, 'us', 3, 1)")  # a partition two levels down
    assert sorted(queue_keys(conn)) == ["1", "2", "3"]
    assert result(conn, "lockstep.work('dj')")["outcome"] == "done"
    assert conn.execute("select p_id, total from d order by 1").fetchall() == [(1, 11), (2, 21), (3, 31)]
    conn.execute("truncate c_eu")  # flags the job
    assert conn.execute("select count(*) from lockstep.recompute_flag where job = 'dj'").fetchone()[0] >= 1

    def triggers() -> int:
        return conn.execute(
            "select count(*) from pg_trigger where tgname like 'lockstep%%' and not tgisinternal"
        ).fetchone()[0]

    assert triggers() == 4 * 4  # root, c_eu, c_us, c_us1
    conn.execute("select lockstep.unwatch('dj', 'c')")
    assert triggers() == 0
    conn.execute("select lockstep.watch('dj', 'c', 'p_id')")
    conn.execute("select lockstep.drop_job('dj')")
    assert triggers() == 0


def test_watch_flags_a_partition_attached_since_and_warns_about_what_it_cannot_see(conn):
    """Watch() again after attaching a partition that already held rows did not flag the
    job (it flagged only a source not watched before), so those rows stayed missing, status healthy, until
    the periodic recompute; watch() of one partition, which misses every write made through the
    partitioned table, and of a column that references another table than the job's parent (a grandchild's
    key: another table's keys read as the parent's) were accepted without a word; unwatch() of a table the
    job does not watch passed silently (a warning now: it stays safe to repeat)."""
    conn.execute(
        """
        create table p (id bigint primary key);
        create table mid (id bigint primary key, p_id bigint not null references p on delete cascade);
        create table c (id bigint, region text, p_id bigint not null references p on delete cascade,
                        mid_id bigint references mid, v int, primary key (id, region))
                        partition by list (region);
        create table c_eu partition of c for values in ('eu');
        create table d (p_id bigint primary key references p on delete cascade, total int not null);
        create function f(ids bigint[]) returns table (p_id bigint, total int) language sql as $$
            select p.id, coalesce(sum(c.v), 0)::int from public.p left join public.c on c.p_id = p.id
            where ids is null or p.id = any(ids) group by p.id $$;
        insert into p values (1), (2);
        insert into c values (1, 'eu', 1, null, 10);
        select lockstep.define_derived('dj', 'd', 'f(bigint[])', 'p');
        select lockstep.watch('dj', 'c', 'p_id');
        select lockstep.recompute('dj');
        create table c_us (like c);
        insert into c_us values (2, 'us', 2, null, 20);
        alter table c attach partition c_us for values in ('us');
        """
    )
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    flags = "select count(*) from lockstep.recompute_flag where job = 'dj'"
    assert conn.execute(flags).fetchone()[0] == 0
    conn.execute("select lockstep.watch('dj', 'c', 'p_id')")
    assert conn.execute(flags).fetchone()[0] == 1  # c_us is newly watched: its rows wait for the recompute
    assert result(conn, "lockstep.run('dj')")["action"] == "recompute"
    assert conn.execute("select p_id, total from d order by 1").fetchall() == [(1, 10), (2, 20)]
    assert not any("partition or child" in n or "references" in n for n in notices), notices
    conn.execute("select lockstep.watch('dj', 'c_eu', 'p_id')")
    assert any(
        "public.c_eu is a partition or child of public.c: a write made through public.c" in n for n in notices
    )
    with pytest.raises(psycopg.Error) as refused:  # its values are mid's keys: refused, not warned
        conn.execute("select lockstep.watch('dj', 'c', 'mid_id')")
    assert refused.value.sqlstate == "LSQ02"
    assert "public.c.mid_id references public.mid, not the parent public.p" in str(refused.value)
    assert "through => 'public.mid'" in (refused.value.diag.message_hint or "")
    conn.execute("select lockstep.unwatch('dj', 'c')")
    conn.execute("select lockstep.unwatch('dj', 'c')")  # again: safe to repeat, and says so
    assert notices[-1] == 'lockstep: job "dj" does not watch public.c: nothing to unwatch', notices


def test_watch_warns_about_another_tables_own_primary_key(conn):
    """watch() of authors.id for a job whose parent is posts queued author ids as post ids, silently:
    the column referenced nothing, so the warning about a column referencing another table did not
    apply. A key column that is another table's whole primary key and references nothing now warns; the
    parent's own key, a one-to-one table's key that references the parent, the key of a table the parent's
    key references (where that warning would be false) and a plain column do not."""
    conn.execute(
        """
        create table authors (id int primary key);
        create table posts (id bigint primary key,
                            author_id int not null references authors on delete cascade);
        create table post_body (post_id bigint primary key references posts on delete cascade, body text);
        create table post_log (id bigint primary key, post_id bigint not null, at timestamptz);
        create table entity (id bigint primary key, title text);  -- reverse one-to-one: posts.id -> entity
        alter table posts add foreign key (id) references entity on delete cascade;
        create table n (id bigint primary key references posts on delete cascade, n int);
        create function nc(ids bigint[]) returns table (id bigint, n int) language sql stable
            as 'select id, 1 from public.posts where ids is null or id = any(ids)';
        select lockstep.define_derived('nj', 'n', 'nc(bigint[])', 'posts');
        """
    )
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    for table, column in [
        ("posts", "id"),
        ("post_body", "post_id"),
        ("post_log", "post_id"),
        ("entity", "id"),
    ]:
        conn.execute("select lockstep.watch('nj', %s, %s)", [table, column])
    assert not any("primary key" in n for n in notices), notices
    conn.execute("select lockstep.watch('nj', 'authors', 'id')")
    assert notices[-1] == (
        "lockstep: public.authors.id is the primary key of public.authors, not a reference to the parent"
        ' public.posts of job "nj": its values are keys of public.authors itself'
    ), notices


def test_a_skipped_key_stays_queued_and_is_retried_a_second_later(ex, exconnect):
    ex.execute("update example.exam set body = body || ' lockedword' where id in (4, 6)")
    app = exconnect()
    app.execute("begin")
    app.execute("select 1 from example.exam where id = 4 for update")
    r = result(ex, f"lockstep.work('{JOB}')")
    assert (r["outcome"], r["skipped"], r["more"]) == ("done", 1, False)
    assert queue_keys(ex) == ["4"]
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "idle"  # deferred, not a hot loop
    due = ex.execute(f"select due_at - now() from lockstep.due(array['{JOB}'])").fetchone()[0]
    assert 0 < due.total_seconds() <= 1.5
    app.execute("rollback")
    ex.execute("update lockstep.queue set ready_at = now()")
    assert result(ex, f"lockstep.work('{JOB}')")["inserted"] >= 1
    assert divergence(ex) == (0, 0)


def test_due_is_the_next_run_when_nothing_is_queued(ex):
    ex.execute("update lockstep.job_state set next_run_at = now() + interval '1 hour'")
    due = ex.execute("select due_at - now() from lockstep.due()").fetchone()[0]
    assert due.total_seconds() == pytest.approx(3600, abs=1)
    ex.execute(f"select lockstep.enqueue('{JOB}', array[1])")
    assert ex.execute("select due_at <= now() from lockstep.due()").fetchone()[0]


def test_a_full_pass_opens_the_gather_window_unless_another_full_batch_is_ready(ex):
    # due(jobs, gather) opened no window after any full pass that left keys: under a steady load of more
    # keys per --batch-wait window than a batch, each full pass was followed at once by a small pass of the
    # rest (bench oltp: half of ~430 passes a minute), each paying a pass's whole fixed cost
    ex.execute(f"select lockstep.set_batch_parents('{JOB}', 2)")

    def due_in(gather: str) -> float:
        return ex.execute(
            f"select extract(epoch from due_at - now()) from lockstep.due(array['{JOB}'], '{gather}')"
        ).fetchone()[0]

    ex.execute(f"select lockstep.enqueue('{JOB}', array[1, 2, 3])")
    r = result(ex, f"lockstep.run('{JOB}')")
    assert r["outcome"] == "done" and r["more"] is True  # keys are left (the result says so, as before)
    assert due_in("1 hour") > 3500  # but less than a batch: the window is open
    assert due_in("0") <= 0  # without one, due now
    ex.execute(f"select lockstep.enqueue('{JOB}', array[4, 5, 6, 7])")  # 5 ready
    assert result(ex, f"lockstep.run('{JOB}')")["more"] is True  # 3 left: another full batch
    assert due_in("1 hour") <= 0  # a backlog: due now
    drain(ex, JOB)
    assert queue_keys(ex) == [] and divergence(ex) == (0, 0)


def test_due_reads_no_queue_entry_beyond_the_first_ready_one(ex, exconnect):
    # lockstep.due() (every runner tick) found the next deferred entry with min(ready_at) over all of the
    # job's entries: every entry read per tick (84-128 ms with a million handed-off keys queued; a sequential
    # scan of the whole queue heap with stale statistics). It now reads job_state.deferred_until.
    ex.execute(f"select lockstep.enqueue('{JOB}', array(select generate_series(1, 20000)))")
    ex.execute("analyze lockstep.queue")
    pages = (
        "select coalesce(heap_blks_hit, 0) + coalesce(heap_blks_read, 0) from pg_statio_all_tables"
        " where relid = 'lockstep.queue'::regclass"
    )
    before = flushed_stat(ex, pages)
    assert ex.execute(f"select due_at <= now() from lockstep.due(array['{JOB}'])").fetchone()[0]
    assert flushed_stat(ex, pages) - before <= 2  # the first ready entry (lockstep._has_ready)
    # a deferred key still wakes the runner when it is ready, not at the next periodic run
    ex.execute("delete from lockstep.queue")
    ex.execute("update lockstep.job_state set next_run_at = now() + interval '1 hour'")
    ex.execute("update example.exam set body = body || ' lockedword' where id = 4")
    app = exconnect()
    app.execute("begin")
    app.execute("select 1 from example.exam where id = 4 for update")
    assert result(ex, f"lockstep.work('{JOB}')")["skipped"] == 1
    app.execute("rollback")
    due = ex.execute(f"select due_at - now() from lockstep.due(array['{JOB}'])").fetchone()[0]
    assert 0 < due.total_seconds() <= 1


def test_settling_a_pass_is_linear_in_its_queue_entries(ex):
    # _settle_entries checked each entry's id with `id = any(ids)`: a linear search per entry, quadratic in
    # the entries of a pass, run while the pass holds its row locks (a key queued 100 times over 500 keys:
    # 50,000 entries, 4.9 s; an application's DELETE of a parent waited 4.2 s). Its plan now joins the
    # arrays unnested side by side, one TID scan per entry, and searches no array per row.
    for _ in range(20):
        ex.execute(f"select lockstep.enqueue('{JOB}', array(select generate_series(1, 50)))")
    plans: list[str] = []
    ex.add_notice_handler(lambda d: plans.append(d.message_primary or ""))
    ex.execute("load 'auto_explain'")
    ex.execute("set auto_explain.log_min_duration = 0")
    ex.execute("set auto_explain.log_nested_statements = on")
    ex.execute("set auto_explain.log_level = warning")  # through the functions' client_min_messages
    r = result(ex, f"lockstep.work('{JOB}')")
    ex.execute("set auto_explain.log_min_duration = -1")
    assert r["outcome"] == "done"
    assert queue_keys(ex) == []  # all 1,000 entries of the 50 keys settled
    settle = [p for p in plans if "Delete on queue" in p]
    assert len(settle) == 1, plans
    assert "Tid Scan on queue" in settle[0] and "ANY" not in settle[0], settle[0]


CITEXT = """
create extension citext;
create table tag (name citext primary key);
create table tagging (id int generated always as identity primary key,
                      tag citext not null references tag on update cascade on delete cascade);
create table tag_usage (tag citext primary key references tag on update cascade on delete cascade,
                        uses int not null);
create table tag_word (tag citext not null references tag on update cascade on delete cascade, word citext,
                       n int not null, primary key (tag, word));
create function tag_usage_compute(keys citext[]) returns table (tag citext, uses int)
language sql stable set search_path = public, pg_catalog as $$
    select t.name, (select count(*) from tagging g where g.tag = t.name)::int
    from tag t where keys is null or t.name = any(keys) $$;
create function tag_word_compute(keys citext[]) returns table (tag citext, word citext, n int)
language sql stable set search_path = public, pg_catalog as $$
    select g.tag, 'W' || g.id % 2, count(*)::int from tagging g
    where keys is null or g.tag = any(keys) group by 1, 2 $$;
insert into tag values ('Red'), ('Blue');
select lockstep.define_derived('usage', 'tag_usage', 'tag_usage_compute(citext[])', 'tag');
select lockstep.define_derived('words', 'tag_word', 'tag_word_compute(citext[])', 'tag');
select lockstep.watch('usage', 'tagging', 'tag');
select lockstep.watch('words', 'tagging', 'tag');
select lockstep.recompute('usage');
select lockstep.recompute('words');
"""


def test_keys_of_an_extension_type_compare_with_its_own_equality(conn):
    # A citext key queued as 'red' for the parent 'Red' (the child's foreign key accepts it): lockstep's
    # functions run with search_path = pg_catalog, where a bare = on citext resolves to text = text
    # (case-sensitive), so the pass found neither computed nor current rows for 'red', reported done and
    # deleted the entry: the change was lost until the next recompute. Keys now compare with the type's
    # own equality operator (that of its default btree operator class).
    conn.execute(CITEXT)
    conn.execute("insert into tagging (tag) values ('red'), ('RED'), ('blue')")
    assert "Red" not in queue_keys(conn) and {k.lower() for k in queue_keys(conn)} == {"red", "blue"}
    for job in ("usage", "words"):
        drain(conn, job)
    usage = "select tag::text, uses from tag_usage order by 1"
    words = "select tag::text, word::text, n from tag_word order by 1, 2"
    assert conn.execute(usage).fetchall() == [("Blue", 1), ("Red", 2)]
    want = conn.execute(words.replace("from tag_word", "from tag_word_compute(null)")).fetchall()
    assert conn.execute(words).fetchall() == want
    assert len(want) == 3
    conn.execute("delete from tagging where tag = 'RED'")  # the rows for 'Red' go, through key 'red'
    for job in ("usage", "words"):
        drain(conn, job)
    assert conn.execute(usage).fetchall() == [("Blue", 1), ("Red", 0)]
    assert conn.execute(words).fetchall() == [("blue", "W1", 1)]
    assert queue_keys(conn) == []


CITEXT_FKS = """
create extension citext;
create table color (name citext primary key);
create table item (id int primary key, color_name text not null);
create table item_color (item_id int primary key references item on delete cascade,
                         color citext not null references color on delete cascade);
create function item_color_compute(ids int[]) returns table (item_id int, color citext)
language sql stable set search_path = public, pg_catalog as $$
    select i.id, lower(i.color_name)::citext from item i where ids is null or i.id = any(ids) $$;
insert into color values ('Red'), ('Blue');
select lockstep.define_derived('colors', 'item_color', 'item_color_compute(int[])', 'item');
select lockstep.recompute('colors');
create table word (w citext primary key, hidden boolean not null default false);
create table word_stat (w citext primary key references word on delete cascade, n int not null);
create table word_note (id int primary key, w citext not null references word_stat on delete cascade);
create function word_stat_compute(ws citext[]) returns table (w citext, n int)
language sql stable set search_path = public, pg_catalog as $$
    select x.w, length(x.w) from word x where not x.hidden and (ws is null or x.w = any(ws)) $$;
insert into word values ('Red');
select lockstep.define_derived('words', 'word_stat', 'word_stat_compute(citext[])', 'word');
select lockstep.recompute('words');
"""


def test_other_foreign_keys_of_an_extension_type_match_as_their_own_check_does(conn, connect):
    # item_color references color by citext: 'red' names the color 'Red' (the key's own check says so).
    # _pin_refs matched with a bare =, text = text under lockstep's search_path: the row to insert found no
    # color to pin, was dropped and its parent skipped at every pass (never written).
    conn.execute(CITEXT_FKS)
    conn.execute("insert into item values (1, 'RED'), (2, 'Blue')")
    conn.execute("select lockstep.enqueue('colors', array[1, 2])")
    r = result(conn, "lockstep.work('colors')")
    assert (r["outcome"], r["inserted"], r["skipped"]) == ("done", 2, 0), r
    assert conn.execute("select item_id, color::text from item_color order by 1").fetchall() == [
        (1, "red"),
        (2, "blue"),
    ]
    # word_note references the target by citext ('RED' for its row 'Red'): _lock_level joined with a bare
    # = and did not see the application's note, so the cascaded delete waited for the application
    # (here: 55P03 after lock_timeout) instead of skipping the parent it holds.
    conn.execute("insert into word_note values (1, 'RED')")
    app = connect()
    app.execute("begin")
    app.execute("select 1 from word_note where id = 1 for update")
    conn.execute("update word set hidden = true")  # the stat row 'Red' must go, its note with it
    conn.execute("select lockstep.enqueue('words', array['Red']::citext[])")
    conn.execute("set lock_timeout = '2s'")
    r = result(conn, "lockstep.work('words')")
    assert (r["outcome"], r["deleted"], r["skipped"]) == ("done", 0, 1), r
    app.execute("rollback")
    conn.execute("update lockstep.queue set ready_at = now()")
    assert result(conn, "lockstep.work('words')")["deleted"] == 1
    assert conn.execute("select count(*) from word_stat").fetchone()[0] == 0
    assert conn.execute("select count(*) from word_note").fetchone()[0] == 0


@pytest.mark.parametrize(
    "typ, keys", [("char(5)", ["ab", "abcde", "xyz"]), ("bit(8)", ["10101010", "00000001"])]
)
def test_keys_of_a_type_whose_name_implies_a_length_are_kept_whole(conn, typ, keys):
    # The key type was cast by its regtype name: 'character' means char(1) and 'bit' bit(1), so the queue
    # held 'a' for 'abcde' and '1' for 10101010, compute(array['a']) found nothing, and every pass and every
    # recompute reported done with the derived rows gone. Casts now use format_type(t, -1).
    conn.execute(
        f"create table p (k {typ} primary key, v int not null default 1);"
        f" create table d (k {typ} primary key references p on delete cascade on update cascade,"
        " v int not null);"
        f" create function dc(ks {typ}[]) returns table (k {typ}, v int) language sql stable"
        " as $$ select k, v from public.p where ks is null or k = any(ks) $$;"
        f" select lockstep.define_derived('d', 'd', 'dc({typ}[])', 'p');"
        " select lockstep.watch('d', 'p', 'k');"
    )
    lit = "B'{}'" if typ.startswith("bit") else "'{}'"
    conn.execute("insert into p (k) values " + ", ".join("(" + lit.format(k) + ")" for k in keys))
    assert sorted(queue_keys(conn)) == sorted(keys)
    r = result(conn, "lockstep.recompute('d')")
    assert (r["outcome"], r["inserted"]) == ("done", len(keys)), r
    conn.execute("delete from lockstep.queue")  # the insert's entries: written by the recompute already
    conn.execute(f"update p set v = 2 where k = {lit.format(keys[0])}")
    conn.execute(f"select lockstep.enqueue('d', array[{lit.format(keys[1])}]::{typ}[])")
    assert sorted(queue_keys(conn)) == sorted(keys[:2])
    drain(conn, "d")
    got = conn.execute("select k::text, v from d order by 1").fetchall()
    assert got == conn.execute("select k::text, v from dc(null) order by 1").fetchall()
    assert (keys[0], 2) in got and len(got) == len(keys)


def test_a_partitioned_parent_converges(conn):
    # A foreign key to a partitioned table has a child constraint per partition (conparentid <> 0) on the
    # referencing table: _pin_refs took them for other foreign keys and pinned each parent in every
    # partition, which failed in all but its own, so every parent was skipped at every pass and every
    # recompute. A partitioned parent referenced by another table too (other FK).
    conn.execute(
        "create table pp (id int primary key, v int not null default 1) partition by range (id);"
        " create table pp1 partition of pp for values from (0) to (100);"
        " create table pp2 partition of pp for values from (100) to (200);"
        " create table tag (id int primary key, p int references pp on delete cascade)"
        " partition by range (id);"
        " create table tag1 partition of tag for values from (0) to (1000);"
        " create table pd (pid int primary key references pp on delete cascade on update cascade,"
        "                  t int references tag on delete cascade, v int not null);"
        " create function pc(ks int[]) returns table (pid int, t int, v int) language sql stable"
        " as $$ select id, case when id > 100 then 7 end, v from public.pp"
        "       where ks is null or id = any(ks) $$;"
        " insert into tag values (7, null);"
        " select lockstep.define_derived('pd', 'pd', 'pc(int[])', 'pp', parent_column => 'pid');"
        " select lockstep.watch('pd', 'pp', 'id');"
        " insert into pp (id) values (1), (150);"
    )
    r = result(conn, "lockstep.recompute('pd')")
    assert (r["outcome"], r["inserted"], r["skipped"]) == ("done", 2, 0), r
    conn.execute("update pp set v = 3; insert into pp (id) values (2), (151)")
    drain(conn, "pd")
    got = "select pid, t, v from pd order by 1"
    assert conn.execute(got).fetchall() == conn.execute(got.replace("from pd", "from pc(null)")).fetchall()
    assert conn.execute("select count(*) from pd").fetchone()[0] == 4


def test_a_parent_key_of_a_nondeterministic_collation_compares_under_it(conn):
    # 'abc' names the parent 'ABC' under a case-insensitive collation (the child's key accepts it, the
    # trigger queues 'abc'), but compute's rows carry the default collation: the pass compared their key
    # with the queued 'abc' as different, found no computed row and deleted the parent's.
    conn.execute(
        "create collation ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false);"
        " create table np (k text collate ci primary key);"
        " create table nc (id serial primary key,"
        "                  k text collate ci not null references np on delete cascade);"
        " create table nd (k text collate ci primary key references np on delete cascade, n int not null);"
        " create function ncomp(ks text[]) returns table (k text, n int) language sql stable as $$"
        "   select p.k, count(c.id)::int from public.np p left join public.nc c on c.k = p.k"
        "   where ks is null or p.k = any(ks) group by p.k $$;"
        " select lockstep.define_derived('nd', 'nd', 'ncomp(text[])', 'np');"
        " select lockstep.watch('nd', 'np', 'k');"
        " select lockstep.watch('nd', 'nc', 'k');"
        " insert into np values ('ABC'), ('Xy');"
    )
    assert result(conn, "lockstep.recompute('nd')")["inserted"] == 2
    conn.execute("delete from lockstep.queue")
    conn.execute("insert into nc (k) values ('abc'), ('ABC'), ('xY')")
    assert sorted(k.lower() for k in queue_keys(conn)) == ["abc", "xy"]  # one per parent, in any case
    r = result(conn, "lockstep.work('nd')")
    assert (r["outcome"], r["updated"], r["deleted"]) == ("done", 2, 0), r
    assert conn.execute("select k::text, n from nd order by 1").fetchall() == [("ABC", 2), ("Xy", 1)]
    assert queue_keys(conn) == []


def test_an_out_of_range_key_is_refused_naming_the_job_and_its_key_type(conn):
    # it failed with PostgreSQL's bare 22003 "value ... is out of range for type integer", no word of
    # lockstep or the job
    conn.execute(
        "create table p (id int primary key);"
        " create table d (p_id int primary key references p on delete cascade, n int);"
        " create function dc(ids int[]) returns table (p_id int, n int) language sql stable"
        " as $$ select id, 1 from public.p where ids is null or id = any(ids) $$;"
        " select lockstep.define_derived('d', 'd', 'dc(int[])', 'p');"
    )
    before = snapshot(conn)
    with raises_sqlstate("22003", 'does not fit the parent key type integer of job "d"'):
        conn.execute("select lockstep.enqueue('d', array[1, 3000000000]::bigint[])")
    assert snapshot(conn) == before
    assert conn.execute("select lockstep.enqueue('d', array[1, 2]::bigint[])").fetchone()[0] == 2


@pytest.mark.parametrize(
    "key, arg, setting",
    [
        ("timestamptz", "'2024-05-01 05:30'::timestamp", "set timezone = 'Asia/Kolkata'"),
        ("timestamptz", "'2024-05-01'::date", "set timezone = 'Asia/Kolkata'"),
        ("float8", "0.1::real", "set extra_float_digits = 0"),
    ],
)
def test_enqueue_names_the_parent_the_implicit_cast_names_in_the_callers_session(conn, key, arg, setting):
    # Keys went through text under lockstep's pinned settings (TimeZone UTC): a timestamp for a timestamptz
    # key, in a session at +05:30, named an instant 5.5 hours off, a real 0.1 for a float8 key named 0.1, not
    # 0.10000000149011612 (the parent's value); the pass found no such parent and the change was lost until
    # the periodic recompute. The cast is PostgreSQL's own, in the caller's settings.
    conn.execute(
        f"create table p (k {key} primary key, v int not null default 1);"
        f" create table d (k {key} primary key references p on delete cascade, v int not null);"
        f" create function dc(ks {key}[]) returns table (k {key}, v int) language sql stable"
        " as $$ select k, v from public.p where ks is null or k = any(ks) $$;"
        f" select lockstep.define_derived('d', 'd', 'dc({key}[])', 'p');"
    )
    conn.execute(setting)
    conn.execute(f"insert into p (k) values ({arg}::{key})")
    assert result(conn, "lockstep.recompute('d')")["inserted"] == 1
    conn.execute(f"update p set v = 2 where k = {arg}::{key}")
    assert conn.execute(f"select lockstep.enqueue('d', array[{arg}])").fetchone()[0] == 1
    assert (
        conn.execute(f"select count(*) from lockstep.queue q, p where q.key::{key} = p.k").fetchone()[0] == 1
    )
    drain(conn, "d")
    assert conn.execute("select v from d").fetchall() == [(2,)]
    # retry() reads its keys the same way
    conn.execute(
        "insert into lockstep.key_failure (job, key, attempts, last_error, retry_at, parked)"
        " select 'd', (lockstep._canon(array_agg(k)))[1], 5, 'x', now(), true from p"
    )
    assert conn.execute(f"select lockstep.retry('d', array[{arg}])").fetchone()[0] == 1


def test_result_times_are_rounded_to_the_microsecond(ex):
    # compute_ms showed float noise such as 37.818000000000005
    ex.execute(f"select lockstep.enqueue('{JOB}', array[1, 2, 3])")
    r = result(ex, f"lockstep.work('{JOB}')")
    for k in ("compute_ms", "write_ms"):
        assert r[k] == round(r[k], 3) and len(repr(r[k]).split(".")[-1]) <= 3, r


def test_a_recompute_that_cures_a_key_naming_no_parent_drops_its_entries(ex):
    """A queue row whose key cannot be read as the parent key type (written by hand) is parked at once; a
    recompute that computed every parent cleared its parked row but left its entry, which parked it again
    at the next pass, for ever. It names no parent: the cure drops its entries too."""
    not_due(ex, JOB)
    ex.execute(f"insert into lockstep.queue (job, key) values ('{JOB}', 'abc'), ('{JOB}', '5')")
    result(ex, f"lockstep.work('{JOB}')")
    assert ex.execute("select key from lockstep.parked_keys").fetchall() == [("abc",)]
    r = result(ex, f"lockstep.recompute('{JOB}')")
    assert (r["outcome"], r["error"]) == ("done", None), r
    assert queue_keys(ex) == [] and result(ex, f"lockstep.work('{JOB}')")["outcome"] == "idle"
    assert ex.execute("select parked_keys, failing_keys from lockstep.status").fetchone() == (0, 0)


def test_a_recompute_that_computes_every_parent_cures_the_parked_keys(ex):
    # a parked key whose data was fixed kept lockstep status unhealthy (parked_keys) until someone ran
    # retry, though the next recompute computed it without error
    ex.execute(
        """
        create table example.bad (id bigint primary key);
        insert into example.bad values (13);
        create function example.picky(ids bigint[]) returns table (exam_id bigint, key text, weight integer)
        language plpgsql stable as $$ begin
            if exists (select from example.bad b where ids is null or b.id = any(ids)) then
                raise exception 'cannot compute exam 13'; end if;
            return query select * from example.exam_key_compute(ids); end $$;
        """
    )
    ex.execute(
        f"select lockstep.define_derived('{JOB}', 'example.exam_key', 'example.picky(bigint[])',"
        " 'example.exam', every => '1 day')"
    )
    ex.execute(f"select lockstep.set_max_attempts('{JOB}', 1)")
    not_due(ex, JOB)
    ex.execute("update example.exam set body = body || ' poisonword' where id in (12, 13)")
    result(ex, f"lockstep.work('{JOB}')")
    assert ex.execute("select key from lockstep.parked_keys").fetchall() == [("13",)]
    ex.execute("delete from example.bad")  # the data is fixed; nobody runs retry
    r = result(ex, f"lockstep.recompute('{JOB}')")
    assert (r["outcome"], r["error"]) == ("done", None), r
    assert ex.execute("select parked_keys, failing_keys from lockstep.status").fetchone() == (0, 0)
    drain(ex, JOB)
    assert divergence(ex) == (0, 0)


def test_a_dropped_target_fails_the_job_with_a_message_that_names_it(conn):
    """After DROP TABLE of a job's target, work and recompute failed with 'syntax error at or near "43073"'
    (the table's old oid, all the job still had). They now fail the job, not its keys, with
    a message that says what is gone and what to do; nothing is parked and the keys stay queued."""
    conn.execute(
        """
        create table acct (id uuid primary key, owner text not null);
        create table acct_tag (acct_id uuid primary key references acct on delete cascade, tag text not null);
        create function acct_tags(ids uuid[]) returns table (acct_id uuid, tag text) language sql
            as $$ select id, upper(owner) from public.acct where ids is null or id = any(ids) $$;
        select lockstep.define_derived('tags', 'acct_tag', 'acct_tags(uuid[])', 'acct', every => '1 day');
        select lockstep.watch('tags', 'acct', 'id');
        insert into acct values (gen_random_uuid(), 'ann'), (gen_random_uuid(), 'bob');
        drop table acct_tag;
        """
    )
    r = result(conn, "lockstep.recompute('tags')")  # due: watch() flagged it
    assert r["outcome"] == "failed", r
    assert 'the target table of job "tags" no longer exists' in r["error"], r  # before: a syntax error
    conn.execute("delete from lockstep.recompute_flag")
    conn.execute("update lockstep.job_state set retry_at = null, next_run_at = now() + interval '1 day'")
    r = result(conn, "lockstep.work('tags')")
    assert r["outcome"] == "failed" and "target table" in r["error"], r
    assert conn.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0
    assert conn.execute("select count(*) from lockstep.queue where job = 'tags'").fetchone()[0] == 2
    conn.execute("select lockstep.drop_job('tags')")
