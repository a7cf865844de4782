"""Operator controls: lockstep.preview, lockstep.pause / lockstep.resume (docs/controls.md)."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql
from util import raises_sqlstate, result, snapshot

from lockstep.lab.example import JOB, divergence

LOCKSTEP_TABLES = ("job", "job_state", "queue", "key_failure", "recompute_flag", "run_log")


def write_counts(conn: psycopg.Connection) -> dict[str, tuple[int, int, int]]:
    """This transaction's inserted, updated and deleted tuples of the target, the parent and lockstep's
    tables (pg_stat_xact_user_tables: the counts of the open transaction, no flush needed)."""
    rels = ["example.exam_key", "example.exam"] + [f"lockstep.{t}" for t in LOCKSTEP_TABLES]
    rows = conn.execute(
        "select r::text, coalesce(s.n_tup_ins, 0), coalesce(s.n_tup_upd, 0), coalesce(s.n_tup_del, 0)"
        " from unnest(%s::regclass[]) r left join pg_stat_xact_user_tables s on s.relid = r",
        [rels],
    ).fetchall()
    return {r[0]: r[1:] for r in rows}


def temp_relations(conn: psycopg.Connection) -> list[str]:
    return [
        r[0]
        for r in conn.execute(
            "select relname from pg_class where relnamespace = pg_my_temp_schema() order by 1"
        ).fetchall()
    ]


def change_exams(conn: psycopg.Connection, ids: range) -> None:
    """Change the keys of these exams: one gains a word, so its keys are inserted or updated."""
    conn.execute(
        "update example.exam set body = body || ' zebrafish' || id::text || ' quokka' where id = any(%s)",
        [list(ids)],
    )


# preview ------------------------------------------------------------------------------------------------


def test_preview_shows_exactly_the_changed_parents_and_writes_nothing(ex, exconnect):
    change_exams(ex, range(1, 51))
    ex.execute("delete from example.exam_key where exam_id = 60")  # rows to insert for a 51st parent
    ex.execute("update example.exam_key set weight = weight + 1 where exam_id = 61")  # rows to update
    before = snapshot(ex, "example.exam_key")
    temps = temp_relations(ex)
    ex.execute("begin")
    counts = write_counts(ex)
    rows = ex.execute("select key, action, rows from lockstep.preview(%s)", [JOB]).fetchall()
    assert write_counts(ex) == counts
    # no row lock: a row lockstep had locked or written would carry this transaction's xid as xmax, and
    # another session can lock every row of both tables at once
    xid = ex.execute("select txid_current()").fetchone()[0]
    observer = exconnect()
    observer.execute("begin")
    for table in ("example.exam", "example.exam_key"):
        n = observer.execute(f"select count(*) from {table} where xmax::text = %s", [str(xid)]).fetchone()[0]
        assert n == 0, table
        observer.execute(f"select count(*) from (select from {table} for update nowait) s")
    observer.execute("rollback")
    # no lock at all is left on the parent or the target, and no tuple lock: the preview's subtransaction,
    # rolled back, released even its reads' AccessShareLock
    modes = observer.execute(
        "select distinct locktype, mode from pg_locks where pid = %s"
        " and (locktype = 'tuple' or relation in ('example.exam'::regclass, 'example.exam_key'::regclass))",
        [ex.info.backend_pid],
    ).fetchall()
    assert modes == []
    ex.execute("commit")
    assert snapshot(ex, "example.exam_key") == before
    assert temp_relations(ex) == temps
    keys = {int(k) for k, _, _ in rows}
    assert keys == set(range(1, 51)) | {60, 61}
    assert {a for k, a, _ in rows if k == "60"} == {"insert"}
    assert {a for k, a, _ in rows if k == "61"} == {"update"}
    assert [int(k) for k, _, _ in rows] == sorted(int(k) for k, _, _ in rows)  # in key order
    # exactly what the recompute then writes
    total = {a: sum(n for _, x, n in rows if x == a) for a in ("insert", "update", "delete")}
    ex.execute("select lockstep.set_batch_parents(%s, 1000)", [JOB])
    r = result(ex, f"lockstep.recompute('{JOB}')")
    assert (r["inserted"], r["updated"], r["deleted"]) == (total["insert"], total["update"], total["delete"])
    assert divergence(ex) == (0, 0)
    assert ex.execute("select count(*) from lockstep.preview(%s)", [JOB]).fetchone()[0] == 0


def test_preview_of_keys_shows_those_parents_only(ex):
    change_exams(ex, range(1, 11))
    ex.execute("update example.exam set title = '', body = '' where id = 3")  # its keys go: deletes
    rows = ex.execute(
        "select key, action, rows from lockstep.preview(%s, array[3, 4, 150]::bigint[])", [JOB]
    ).fetchall()
    assert {k for k, _, _ in rows} == {"3", "4"}
    assert {a for k, a, _ in rows if k == "3"} == {"delete"}
    r = result(ex, f"lockstep.work('{JOB}')")  # the worker writes what the preview showed for its keys
    assert r["deleted"] >= next(n for k, a, n in rows if k == "3" and a == "delete")


def test_preview_refuses_bad_input_and_changes_nothing(ex):
    ex.execute("create function tick() returns void language sql as 'select 1'")
    ex.execute("select lockstep.define_job('g', 'tick()')")
    before = snapshot(ex)
    with raises_sqlstate("LSJ01"):
        ex.execute("select * from lockstep.preview('nope')")
    with raises_sqlstate("LSJ02"):
        ex.execute("select * from lockstep.preview('g')")
    with raises_sqlstate("LSQ01"):
        ex.execute("select * from lockstep.preview(%s, array['a']::text[])", [JOB])
    assert snapshot(ex) == before


def test_preview_runs_the_compute_as_the_owner(ex):
    """The compute runs with the owner's rights, as a run's: here it returns the current rows only when run as
    the owner (as anyone else it returns none, and the preview would show every row deleted)."""
    owner = "ls_prev_owner"
    ex.execute(f"drop role if exists {owner}")
    ex.execute(f"create role {owner} nologin")
    try:
        ex.execute(
            "create function example.owner_keys(ids bigint[])"
            " returns table (exam_id bigint, key text, weight integer) language sql"
            " as $$ select k.exam_id, k.key, k.weight from example.exam_key k"
            f" where (ids is null or k.exam_id = any(ids)) and current_user = '{owner}' $$"
        )
        grants = (
            "grant usage on schema example, lockstep to {o}",
            "grant select on example.exam, example.exam_key to {o}",
            "grant temp on database {db} to {o}",
        )
        for g in grants:
            ex.execute(sql.SQL(g).format(o=sql.Identifier(owner), db=sql.Identifier(ex.info.dbname)))
        ex.execute(
            "update lockstep.job set owner = %s, compute = 'example.owner_keys(bigint[])' where job = %s",
            [owner, JOB],
        )
        assert ex.execute("select count(*) from lockstep.preview(%s)", [JOB]).fetchone()[0] == 0
        assert ex.execute("select current_user").fetchone()[0] == ex.info.user  # the role is back
        ex.execute("update lockstep.job set owner = current_user where job = %s", [JOB])
        rows = ex.execute("select distinct action from lockstep.preview(%s)", [JOB]).fetchall()
        assert rows == [("delete",)]  # as another owner, the same compute returns nothing
    finally:
        ex.execute("update lockstep.job set owner = current_user where job = %s", [JOB])
        ex.execute(f"drop owned by {owner} cascade")
        ex.execute(f"drop role {owner}")


# pause and resume -------------------------------------------------------------------------------------------


def test_pause_app_writes_three_runs_paused_then_resume_converges(ex):
    paused_at = ex.execute("select lockstep.pause(%s)", [JOB]).fetchone()[0]
    assert paused_at is not None
    change_exams(ex, range(1, 21))  # the application's writes: the triggers keep queueing
    ex.execute("delete from example.exam where id = 30")
    queued = ex.execute("select count(*) from lockstep.queue where job = %s", [JOB]).fetchone()[0]
    assert queued > 0
    target = snapshot(ex, "example.exam_key")
    for _ in range(3):
        r = result(ex, f"lockstep.run('{JOB}')")
        assert r["outcome"] == "paused" and r["inserted"] == r["updated"] == r["deleted"] == 0
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "paused"
    assert result(ex, f"lockstep.recompute('{JOB}')")["outcome"] == "paused"
    assert snapshot(ex, "example.exam_key") == target  # nothing written, the status row untouched too
    st = ex.execute(
        "select paused_at, paused_by, queue_depth from lockstep.status where job = %s", [JOB]
    ).fetchone()
    assert st[0] == paused_at and st[1] == ex.info.user and st[2] > 0
    assert ex.execute("select not isfinite(due_at) from lockstep.due() where job = %s", [JOB]).fetchone()[0]
    # a second pause keeps the first one's time
    assert ex.execute("select lockstep.pause(%s)", [JOB]).fetchone()[0] == paused_at
    assert ex.execute("select lockstep.resume(%s)", [JOB]).fetchone()[0] is True
    assert ex.execute("select lockstep.resume(%s)", [JOB]).fetchone()[0] is False
    assert ex.execute("select paused_at from lockstep.status where job = %s", [JOB]).fetchone()[0] is None
    assert ex.execute("select due_at <= now() from lockstep.due() where job = %s", [JOB]).fetchone()[0]
    first = result(ex, f"lockstep.run('{JOB}')")
    assert (first["outcome"], first["action"]) == ("done", "recompute")  # the flagged recompute
    for _ in range(20):
        if result(ex, f"lockstep.run('{JOB}')")["outcome"] != "done":
            break
    assert divergence(ex) == (0, 0)
    assert ex.execute(
        "select queue_depth, needs_recompute from lockstep.status where job = %s", [JOB]
    ).fetchone() == (
        0,
        None,
    )


def test_a_generic_job_pauses_too(ex):
    ex.execute("create table ticks (n int)")
    ex.execute("create function tick() returns void language sql as 'insert into public.ticks values (1)'")
    ex.execute("select lockstep.define_job('t', 'tick()')")
    ex.execute("select lockstep.pause('t')")
    assert result(ex, "lockstep.run('t')")["outcome"] == "paused"
    assert ex.execute("select count(*) from ticks").fetchone()[0] == 0
    ex.execute("select lockstep.resume('t')")
    assert result(ex, "lockstep.run('t')")["outcome"] == "done"
    assert ex.execute("select count(*) from lockstep.recompute_flag where job = 't'").fetchone()[0] == 0


def test_only_who_manages_the_job_may_pause_or_resume_it(ex):
    other = "ls_ctl_other"
    ex.execute(f"drop role if exists {other}")
    ex.execute(f"create role {other} nologin")
    try:
        ex.execute(
            sql.SQL(
                "grant usage on schema lockstep to {r}; grant select, update on lockstep.job to {r}"
            ).format(r=sql.Identifier(other))
        )
        before = snapshot(ex)
        ex.execute(f"set role {other}")
        for call in ("pause", "resume"):
            with raises_sqlstate("42501", match="may not") as info:
                ex.execute(f"select lockstep.{call}(%s)", [JOB])
            assert "owner" in (info.value.diag.message_hint or "")
        ex.execute("reset role")
        assert snapshot(ex) == before
        ex.execute(
            sql.SQL("grant {o} to {r}").format(o=sql.Identifier(ex.info.user), r=sql.Identifier(other))
        )
        ex.execute(f"set role {other}")
        ex.execute("select lockstep.pause(%s)", [JOB])  # a member of the owner role may
        ex.execute("reset role")
        assert ex.execute("select paused_by from lockstep.job where job = %s", [JOB]).fetchone()[0] == other
    finally:
        ex.execute("reset role")
        ex.execute(f"drop owned by {other} cascade")
        ex.execute(f"drop role {other}")


def test_pause_refuses_an_unknown_job(ex):
    with raises_sqlstate("LSJ01"):
        ex.execute("select lockstep.pause('nope')")
    with raises_sqlstate("22004"):
        ex.execute("select lockstep.resume(null)")


@pytest.mark.parametrize("call", ["pause", "resume"])
def test_pause_and_resume_keep_the_definition(ex, call):
    before = ex.execute("select compute, target, every from lockstep.job where job = %s", [JOB]).fetchone()
    ex.execute(f"select lockstep.{call}(%s)", [JOB])
    assert (
        ex.execute("select compute, target, every from lockstep.job where job = %s", [JOB]).fetchone()
        == before
    )


# chains of derived jobs -----------------------------------------------------------------------------------

CHAIN_SQL = """
create table p (id int primary key, v int not null);
create table a_t (id int primary key references p on delete cascade, v int not null);
create table b_t (id int primary key references p on delete cascade, v int not null);
create table q (id int primary key references p on delete cascade, v int not null);
create function a_c(ids int[]) returns table (id int, v int) language sql
    as $$ select id, v * 2 from public.p where ids is null or id = any(ids) $$;
create function b_c(ids int[]) returns table (id int, v int) language sql
    as $$ select id, v + 1 from public.a_t where ids is null or id = any(ids) $$;
insert into p select g, g from generate_series(1, 20) g;
select lockstep.define_derived('a', 'a_t', 'a_c(int[])', 'p', every => '1 day');
select lockstep.watch('a', 'p', 'id');
select lockstep.define_derived('b', 'b_t', 'b_c(int[])', 'p', every => '1 day');
select lockstep.watch('b', 'a_t', 'id');
"""


@pytest.fixture
def chain(conn: psycopg.Connection) -> psycopg.Connection:
    """Job a writes a_t from p; job b writes b_t from a_t (it watches a's target)."""
    conn.execute(CHAIN_SQL)
    return conn


def test_a_job_that_reads_another_jobs_target_depends_on_it_and_comes_after_it(chain):
    assert chain.execute("select job, depends_on from lockstep.status order by job").fetchall() == [
        ("a", []),
        ("b", ["a"]),
    ]
    chain.execute("update lockstep.job_state set next_run_at = now() - interval '1 minute' where job = 'a'")
    chain.execute("update lockstep.job_state set next_run_at = now() - interval '2 minutes' where job = 'b'")
    # b is due earlier, but it reads a's target: a comes first in the runner's order
    assert [r[0] for r in chain.execute("select job from lockstep.due()").fetchall()] == ["a", "b"]


def test_a_chain_converges_in_two_ticks(chain):
    """A tick runs a's pass; a's writes queue b's parents (b's triggers on a_t); the next tick, which the
    runner starts at once after a tick that did work, runs b's."""
    for job in ("a", "b"):
        chain.execute(f"select lockstep.recompute('{job}')")
    chain.execute("delete from lockstep.queue")
    chain.execute("update p set v = v + 100 where id <= 5")
    ran = []
    for _tick in range(2):
        for (job,) in chain.execute("select job from lockstep.due() where due_at <= now()").fetchall():
            assert result(chain, f"lockstep.run('{job}')")["outcome"] == "done"
            ran.append(job)
    assert ran == ["a", "b"]
    assert (
        chain.execute("select count(*) from b_t join p using (id) where b_t.v <> p.v * 2 + 1").fetchone()[0]
        == 0
    )


def test_a_cycle_is_refused_at_watch_time_with_its_path(chain):
    before = snapshot(chain)
    with raises_sqlstate("LSD09", match=r"a -> b -> a") as info:
        chain.execute("select lockstep.watch('a', 'b_t', 'id')")
    assert "unwatch" in (info.value.diag.message_hint or "")
    assert snapshot(chain) == before
    assert (
        chain.execute(
            "select count(*) from pg_trigger where tgrelid = 'b_t'::regclass and not tgisinternal"
        ).fetchone()[0]
        == 0
    )


def test_a_cycle_is_refused_at_define_time_with_its_path(conn):
    conn.execute(CHAIN_SQL)
    conn.execute("select lockstep.unwatch('b', 'a_t')")
    conn.execute("select lockstep.watch('b', 'p', 'id')")
    conn.execute("select lockstep.watch('a', 'b_t', 'id')")  # a reads b's target
    conn.execute("select lockstep.watch('b', 'q', 'id')")  # q is nobody's target yet
    before = snapshot(conn)
    with raises_sqlstate("LSD09", match=r"a -> b -> a"):  # a writing q, which b reads
        conn.execute("select lockstep.define_derived('a', 'q', 'a_c(int[])', 'p', every => '1 day')")
    assert snapshot(conn) == before


def test_a_redefinition_keeps_the_pause_so_a_new_compute_can_be_previewed_first(ex):
    """Pause, deploy a new compute, preview what it would change, then resume: nothing is written before."""
    ex.execute("select lockstep.pause(%s)", [JOB])
    ex.execute(
        "create function example.upper_keys(ids bigint[])"
        " returns table (exam_id bigint, key text, weight integer) language sql"
        " as $$ select k.exam_id, upper(k.key), k.weight from example.exam_key_compute(ids) k $$"
    )
    ex.execute(
        "select lockstep.define_derived(%s, 'example.exam_key', 'example.upper_keys(bigint[])',"
        " parent => 'example.exam', parent_column => 'exam_id', every => '1 day')",
        [JOB],
    )
    assert ex.execute("select paused_at is not null from lockstep.status where job = %s", [JOB]).fetchone()[0]
    actions = dict(
        ex.execute("select action, count(*) from lockstep.preview(%s) group by 1", [JOB]).fetchall()
    )
    assert actions["insert"] == actions["delete"] == 200  # every key changes case: new rows, old ones go
    assert result(ex, f"lockstep.run('{JOB}')")["outcome"] == "paused"
    assert ex.execute("select count(*) from example.exam_key where key <> lower(key)").fetchone()[0] == 0
    ex.execute("select lockstep.resume(%s)", [JOB])
    ex.execute("select lockstep.set_batch_parents(%s, 1000)", [JOB])
    r = result(ex, f"lockstep.run('{JOB}')")
    assert (r["outcome"], r["action"]) == ("done", "recompute")
    assert ex.execute("select count(*) from lockstep.preview(%s)", [JOB]).fetchone()[0] == 0
