"""Diff recompute on the example app: results, convergence, no-op, skipped parents."""

from __future__ import annotations

import random

import psycopg
import pytest
from psycopg import sql
from util import flushed_stat, result

from lockstep.lab.example import JOB, divergence


def tup_stats(conn: psycopg.Connection) -> tuple[int, int, int]:
    conn.execute("select pg_stat_clear_snapshot()")
    return conn.execute(
        "select n_tup_ins, n_tup_upd, n_tup_del from pg_stat_user_tables"
        " where relid = 'example.exam_key'::regclass"
    ).fetchone()


def run_now(conn: psycopg.Connection, job: str) -> dict:
    """lockstep.run(job) with every wait over: queued keys ready, the job's and its failing keys' retry times
    past (a test's stand-in for the runner's passes over time)."""
    conn.execute("update lockstep.queue set ready_at = now()")
    conn.execute("update lockstep.job_state set retry_at = null")
    conn.execute("update lockstep.key_failure set retry_at = now()")
    return result(conn, f"lockstep.run('{job}')")


BADGES_SQL = """
create table team (id text primary key, name text not null);
create table team_badge (team_id text primary key references team on delete cascade, badge text);
create function badges(ids text[]) returns table (team_id text, badge text) language sql as $$
    select id, case when name = 'bad' then (1 / (length(name) - 3))::text else upper(name) end
    from public.team where ids is null or id = any(ids) $$;
insert into team select 't' || g, 'n' || g from generate_series(1, 9) g;
insert into team select unnest({bad}::text[]), 'bad';
select lockstep.define_derived('badges', 'team_badge', 'badges(text[])', 'team', every => '1 day');
"""


def badges(conn: psycopg.Connection, bad: list[str]) -> None:
    """Teams t1-t9 and the poison ones (compute divides by zero for them), job badges (not watched yet)."""
    conn.execute(sql.SQL(BADGES_SQL).format(bad=sql.Literal(bad)))


def test_example_starts_converged(ex):
    assert divergence(ex) == (0, 0)
    assert ex.execute("select count(*) from example.exam_key").fetchone()[0] > 200 * 8


def test_noop_recompute_writes_nothing_and_locks_no_row(ex, exconnect):
    before = tup_stats(ex)
    ex.execute("begin")
    r = result(ex, f"lockstep.recompute('{JOB}')")
    observer = exconnect()
    # row locks live in the tuples: a locked or written row of exam/exam_key has our xid as xmax
    xid = ex.execute("select txid_current()").fetchone()[0]
    for table in ("example.exam", "example.exam_key"):
        n = observer.execute(f"select count(*) from {table} where xmax::text = %s", [str(xid)]).fetchone()[0]
        assert n == 0, table
    ex.execute("commit")
    assert (r["outcome"], r["inserted"], r["updated"], r["deleted"], r["skipped"]) == ("done", 0, 0, 0, 0)
    # pg_stat counters are flushed at transaction end; force a flush by reading in a new transaction
    ex.execute("select pg_stat_force_next_flush()")
    ex.execute("select 1")
    assert tup_stats(ex) == before


def test_recompute_applies_inserts_updates_deletes(ex):
    ex.execute("update example.exam set body = body || ' brandnewword' where id = 1")  # a key added
    ex.execute("update example.exam set title = title || ' ' || title where id = 2")  # weights change
    ex.execute("update example.exam set body = '', title = '' where id = 3")  # body keys vanish
    ex.execute("delete from lockstep.queue")
    r = result(ex, f"lockstep.recompute('{JOB}')")
    assert r["outcome"] == "done"
    assert r["inserted"] >= 1 and r["updated"] >= 1 and r["deleted"] >= 1
    assert divergence(ex) == (0, 0)
    st = ex.execute("select last_outcome, last_inserted, runs from lockstep.status").fetchone()
    assert st[0] == "done" and st[1] == r["inserted"]


def test_convergence_after_random_changes(ex):
    rnd = random.Random(7)
    ids = list(range(1, 201))
    for _ in range(60):
        op = rnd.choice(["edit", "delete", "insert", "item", "merge"])
        a, b = rnd.sample(ids, 2)
        if op == "edit":
            ex.execute(
                "update example.exam set body = example.words(6, %s) where id = %s",
                [rnd.randint(1, 10**6), a],
            )
        elif op == "delete":
            ex.execute("delete from example.exam where id = %s", [a])
        elif op == "insert":
            new = max(ids) + 1
            ids.append(new)
            ex.execute("select example.seed(1, %s)", [new])
        elif op == "item":
            ex.execute(
                "insert into example.exam_item (exam_id, body) select id, example.words(3, %s)"
                " from example.exam where id = %s",
                [rnd.randint(1, 10**6), a],
            )
        else:
            ex.execute(
                "update example.exam_item set exam_id = %s where exam_id = %s and exists"
                " (select from example.exam where id = %s)",
                [b, a, b],
            )
            ex.execute("delete from example.exam where id = %s", [a])
    assert divergence(ex) != (0, 0)
    r = result(ex, f"lockstep.recompute('{JOB}')")
    assert r["outcome"] == "done"
    assert divergence(ex) == (0, 0)
    r = result(ex, f"lockstep.recompute('{JOB}')")
    assert (r["inserted"], r["updated"], r["deleted"]) == (0, 0, 0)


def test_parent_locked_by_a_deleter_is_skipped_and_requeued(ex, exconnect):
    ex.execute("update example.exam set body = body || ' zzznew' where id in (5, 6)")
    ex.execute("delete from lockstep.queue")
    app = exconnect()
    app.execute("begin")
    app.execute("select 1 from example.exam where id = 5 for update")  # what a DELETE of 5 holds
    r = result(ex, f"lockstep.recompute('{JOB}')")
    assert r["outcome"] == "done"
    assert r["skipped"] == 1
    assert ex.execute("select array_agg(key) from lockstep.queue").fetchone()[0] == ["5"]
    assert (
        ex.execute("select count(*) from example.exam_key where exam_id = 6 and key = 'zzznew'").fetchone()[0]
        == 1
    )
    assert (
        ex.execute("select count(*) from example.exam_key where exam_id = 5 and key = 'zzznew'").fetchone()[0]
        == 0
    )
    app.execute("rollback")
    assert result(ex, f"lockstep.work('{JOB}')")["outcome"] == "done"
    assert divergence(ex) == (0, 0)


def test_run_recomputes_when_due_and_not_before(ex):
    ex.execute("update lockstep.job_state set next_run_at = now() - interval '1 second'")
    r = result(ex, f"lockstep.run('{JOB}')")
    assert (r["outcome"], r["action"]) == ("done", "recompute")
    r = result(ex, f"lockstep.run('{JOB}')")
    assert r["outcome"] == "idle"


def test_recompute_failure_is_recorded_with_backoff_and_writes_nothing(ex):
    # the job itself is broken (an empty pass fails too); a poison parent is isolated instead
    # (tests/schedules/test_schedules_bounded.py)
    ex.execute("update example.exam set body = body || ' fresh' where id = 9")
    ex.execute(
        """
        create function example.picky(ids bigint[]) returns table (exam_id bigint, key text, weight integer)
        language sql as $$ select * from example.exam_key_compute(ids) $$;
        """
    )
    ex.execute(
        f"select lockstep.define_derived('{JOB}', 'example.exam_key', 'example.picky(bigint[])',"
        " 'example.exam')"
    )
    ex.execute(
        "create or replace function example.picky(ids bigint[]) returns table (exam_id bigint, key text,"
        " weight integer) language plpgsql as $$ begin raise exception 'short_keys: broken'; end $$"
    )
    r = result(ex, f"lockstep.recompute('{JOB}')")
    assert r["outcome"] == "failed"
    assert "short_keys" in r["error"]
    st = ex.execute(
        "select last_outcome, consecutive_failures, next_run_at > now() + interval '59 minutes'"
        " from lockstep.status"
    ).fetchone()
    assert st == ("failed", 1, True)
    # not run again during its backoff: the worker's pass over the queued exam 9 fails the same way
    r = result(ex, f"lockstep.run('{JOB}')")
    assert (r["action"], r["outcome"]) == ("work", "failed")
    assert ex.execute("select count(*) from example.exam_key where key = 'fresh'").fetchone()[0] == 0


def test_other_foreign_keys_are_pinned_and_skipped_when_locked(conn, connect):
    conn.execute(
        """
        create table p (id int primary key, tag text not null);
        create table tag (name text primary key);
        create table d (p_id int not null references p on delete cascade, tag text not null references tag,
                        primary key (p_id));
        insert into tag values ('a'), ('b');
        insert into p values (1, 'a'), (2, 'b');
        create function f(ids int[]) returns table (p_id int, tag text) language sql
            as $$ select id, tag from public.p where ids is null or id = any(ids) $$;
        select lockstep.define_derived('j', 'd', 'f(int[])', 'p');
        """
    )
    app = connect()
    app.execute("begin")
    app.execute("select 1 from tag where name = 'b' for update")  # e.g. deleting tag b
    r = result(conn, "lockstep.recompute('j')")
    assert (r["outcome"], r["inserted"], r["skipped"]) == ("done", 1, 1)
    assert conn.execute("select array_agg(key) from lockstep.queue").fetchone()[0] == ["2"]
    app.execute("rollback")
    assert result(conn, "lockstep.work('j')")["inserted"] == 1
    assert conn.execute("select count(*) from d").fetchone()[0] == 2


def test_a_row_updated_in_place_does_not_pin_what_its_other_foreign_keys_reference(conn, connect):
    # its key columns do not change, so no FK check looks the referenced row up: it was pinned all the
    # same (FOR KEY SHARE: a row lock, a dirtied page and WAL per row; 10,000 rows of a top-20 table held a
    # write phase for 1.8 s), and skipped while an application held that row
    conn.execute(
        """
        create table p (id int primary key, tag text not null, n int not null);
        create table tag (name text primary key);
        create table d (p_id int not null references p on delete cascade, tag text not null references tag,
                        n int not null, primary key (p_id));
        insert into tag values ('a'), ('b');
        insert into p values (1, 'a', 1), (2, 'b', 1);
        create function f(ids int[]) returns table (p_id int, tag text, n int) language sql
            as $$ select id, tag, n from public.p where ids is null or id = any(ids) $$;
        select lockstep.define_derived('j', 'd', 'f(int[])', 'p');
        select lockstep.recompute('j');
        update p set n = 2;
        """
    )
    app = connect()
    app.execute("begin")
    app.execute("select 1 from tag where name = 'b' for update")  # e.g. deleting tag b
    r = result(conn, "lockstep.recompute('j')")
    assert (r["outcome"], r["updated"], r["skipped"]) == ("done", 2, 0), r
    app.execute("rollback")
    # a changed key column is still looked up, so still pinned: the row moving to the held tag waits
    conn.execute("update p set tag = 'b' where id = 1")
    app.execute("begin")
    app.execute("select 1 from tag where name = 'b' for update")
    r = result(conn, "lockstep.recompute('j')")
    assert (r["updated"], r["skipped"]) == (0, 1), r
    app.execute("rollback")


def test_a_row_updated_in_place_is_locked_for_no_key_update(conn, connect):
    # an application inserting a row that references a derived row takes FOR KEY SHARE on it (its FK
    # check); lockstep locked rows to update FOR UPDATE, which conflicts: the row was skipped (and an
    # application FK check arriving during the write phase waited for it)
    conn.execute(
        """
        create table p (id int primary key, n int not null);
        create table d (p_id int primary key references p on delete cascade, n int not null);
        create table pin (id int generated always as identity primary key,
                          p_id int not null references d on delete cascade);
        insert into p values (1, 1), (2, 1);
        create function f(ids int[]) returns table (p_id int, n int) language sql
            as $$ select id, n from public.p where ids is null or id = any(ids) $$;
        select lockstep.define_derived('j', 'd', 'f(int[])', 'p');
        select lockstep.recompute('j');
        update p set n = 2;
        """
    )
    app = connect()
    app.execute("begin")
    app.execute("insert into pin (p_id) values (2)")  # holds FOR KEY SHARE on d's row 2
    r = result(conn, "lockstep.recompute('j')")
    assert (r["outcome"], r["updated"], r["skipped"]) == ("done", 2, 0), r
    app.execute("commit")
    assert conn.execute("select * from d order by 1").fetchall() == [(1, 2), (2, 2)]


PIN_SCHEMA = """
create table acc (id int primary key, bal int not null);
create table band (id int primary key references acc on delete cascade, band text not null, bal int not null)
    with (fillfactor = 90);
create function bands(keys int[]) returns table (id int, band text, bal int) language sql stable
    as $$ select a.id, case when a.bal < 0 then 'neg' else 'pos' end, a.bal from public.acc a
          where keys is null or a.id = any(keys) $$;
insert into acc select g, g from generate_series(1, 4) g;
select lockstep.define_derived('band', 'band', 'bands(int[])', 'acc');
select lockstep.watch('band', 'acc', 'id');
select lockstep.recompute('band');
delete from lockstep.queue;
"""


def parent_xmax(c: psycopg.Connection, ids: list[int]) -> list[str]:
    """xmax of the parents' current versions: a row lock (FOR KEY SHARE) leaves the locker's xid there."""
    return [r[0] for r in c.execute("select xmax::text from acc where id = any(%s) order by id", [ids])]


def test_a_row_updated_in_place_does_not_lock_its_parent_and_a_new_row_does(conn):
    # No FK check runs for a referencing row whose key does not change, so pinning its parent only cost
    # every pass a locked, dirtied, WAL-logged parent row (and a concurrent UPDATE of it a multixact).
    conn.execute(PIN_SCHEMA)
    conn.execute("update acc set bal = bal + 10 where id in (1, 2)")  # new parent versions: xmax 0
    conn.execute("insert into acc values (5, -1)")
    assert parent_xmax(conn, [1, 2, 5]) == ["0", "0", "0"]
    r = result(conn, "lockstep.work('band')")
    assert (r["outcome"], r["updated"], r["inserted"]) == ("done", 2, 1)
    # 1 and 2: rows updated in place, parents untouched; 5: a new row, its parent pinned FOR KEY SHARE (by
    # the pass's subtransaction: xmax is its xid)
    xmax = parent_xmax(conn, [1, 2, 5])
    assert xmax[:2] == ["0", "0"] and xmax[2] != "0", xmax
    assert (
        conn.execute("select count(*) from band b join bands(null) c using (id, band, bal)").fetchone()[0]
        == 5
    )


def test_app_holding_a_parent_waits_only_for_the_write_phase_of_an_in_place_update(conn, connect):
    # The parent of a row updated in place is not pinned, so an application that has locked it (to delete
    # it) is not skipped: the worker writes the row, and the application's DELETE then cascades at once.
    conn.execute(PIN_SCHEMA)
    conn.execute("update acc set bal = bal + 10 where id = 1")
    app = connect()
    app.execute("begin")
    app.execute("select 1 from acc where id = 1 for update")
    r = result(conn, "lockstep.work('band')")
    assert (r["outcome"], r["updated"], r["skipped"]) == ("done", 1, 0)
    app.execute("delete from acc where id = 1")  # nothing of lockstep's is held any more: no wait
    app.execute("commit")
    assert conn.execute("select count(*) from band where id = 1").fetchone()[0] == 0
    assert result(conn, "lockstep.work('band')")["outcome"] in ("done", "idle")


# parent p, derived d whose primary key holds the parent column, n rows per parent
PARENT_IN_KEY_SCHEMA = """
create table p (id int primary key, n int not null);
create table d (p_id int not null references p on delete cascade, k int not null, primary key (p_id, k));
create function f(ids int[]) returns table (p_id int, k int) language sql stable
    as $$ select p.id, g from public.p, generate_series(1, p.n) g where ids is null or p.id = any(ids) $$;
"""


def test_new_rows_are_not_looked_up_again_when_the_primary_key_holds_the_parent(conn):
    # A computed row that no current row of its parents has may exist under another parent (it moves), so
    # the keyed diff probed the target's primary key once per new row; when that key holds the parent
    # column, such a row would be one of the parent's current rows, already read: no probe per new row.
    conn.execute(
        PARENT_IN_KEY_SCHEMA
        + """
        insert into p values (1, 1);
        select lockstep.define_derived('j', 'd', 'f(int[])', 'p');
        select lockstep.recompute('j');
        update p set n = 201 where id = 1;
        select lockstep.enqueue('j', array[1]);
        """
    )
    scans = "select idx_scan from pg_stat_user_indexes where indexrelid = 'd_pkey'::regclass"
    before = flushed_stat(conn, scans)
    r = result(conn, "lockstep.work('j')")
    assert (r["outcome"], r["inserted"]) == ("done", 200)
    # one probe for parent 1's current rows and one arbiter check per inserted row (ON CONFLICT); not
    # another probe of each new row's key
    probes = flushed_stat(conn, scans) - before
    assert probes <= 205, probes


def test_a_pass_deletes_rows_where_it_locked_them_without_scanning_the_target(conn):
    # The delete step joined the gone rows to the target by primary key, and the planner hashed the whole
    # target: a sequential scan of it in every pass that deletes, growing with the table (45 ms of a 120 ms
    # pass at 174,244 rows). The rows are deleted where _lock_rows locked them (a TID scan).
    conn.execute(
        PARENT_IN_KEY_SCHEMA
        + """
        insert into p select g, 20 from generate_series(1, 2000) g;
        select lockstep.define_derived('j', 'd', 'f(int[])', 'p');
        select lockstep.set_batch_parents('j', 100000);
        select lockstep.recompute('j');
        """
    )
    conn.execute("vacuum analyze d")
    conn.execute("update p set n = 1 where id <= 300")
    conn.execute("select lockstep.enqueue('j', array(select g from generate_series(1, 300) g))")

    seq_scans = "select seq_scan from pg_stat_user_tables where relid = 'd'::regclass"
    before = flushed_stat(conn, seq_scans)
    r = result(conn, "lockstep.work('j')")
    assert (r["outcome"], r["deleted"]) == ("done", 300 * 19)
    assert flushed_stat(conn, seq_scans) - before == 0
    assert conn.execute("select count(*) from d").fetchone()[0] == 1700 * 20 + 300


def test_parentless_job_diffs_the_whole_table(conn):
    conn.execute(
        """
        create table src (id int primary key, n int);
        create table agg (bucket int primary key, total bigint not null);
        insert into src select g, g % 7 from generate_series(1, 100) g;
        create function f(ignored int[]) returns table (bucket int, total bigint) language sql
            as $$ select n, sum(id) from public.src group by n $$;
        select lockstep.define_derived('agg', 'agg', 'f(int[])');
        """
    )
    assert result(conn, "lockstep.recompute('agg')")["inserted"] == 7
    conn.execute("delete from src where n = 3; update src set n = 1 where id = 2")
    r = result(conn, "lockstep.recompute('agg')")
    assert (r["inserted"], r["updated"], r["deleted"]) == (0, 2, 1)
    assert (
        conn.execute("select count(*) from (select * from agg except select * from f(null)) s").fetchone()[0]
        == 0
    )


TOP_TARGETS = {
    "unique": "create table top (rank int primary key, uid int not null unique deferrable)",
    # a deferrable constraint that is not an index PostgreSQL calls unique, and one on a partition only
    "exclude": "create table top (rank int primary key, uid int not null,"
    " exclude using btree (uid with =) deferrable initially deferred)",
    "partition": "create table top (rank int primary key, uid int not null) partition by range (rank);"
    " create table top_1 partition of top for values from (1) to (1000);"
    " alter table top_1 add unique (uid) deferrable",
}


@pytest.mark.parametrize("target", TOP_TARGETS)
def test_a_parentless_job_with_a_deferrable_unique_constraint_is_not_split_across_transactions(conn, target):
    # a top-N whose users swap ranks: written batch_parents rows at a time, the first batch held a uid the
    # rest still had, so every recompute failed with 23505 and the job never converged.
    # With a DEFERRABLE unique (or exclusion) constraint besides the primary key the difference is written
    # at once.
    conn.execute(
        TOP_TARGETS[target] + ";"
        """
        create table score (uid int primary key, pts int not null);
        insert into score select g, g * 10 from generate_series(1, 6) g;
        create function tops(ignored int[]) returns table (rank int, uid int) language sql stable
            as $$ select (row_number() over (order by pts desc, uid))::int, uid from public.score $$;
        select lockstep.define_derived('top', 'top', 'tops(int[])');
        select lockstep.set_batch_parents('top', 2);
        """
    )
    drain_recompute = "lockstep.recompute('top')"
    while result(conn, drain_recompute)["more"]:
        pass
    conn.execute("update score set pts = 100 - pts")  # the order reversed: every uid moves
    r = result(conn, drain_recompute)
    assert (r["outcome"], r["updated"], r["more"]) == ("done", 6, False), r
    diff = "select count(*) from (select * from top except select * from tops(null)) s"
    assert conn.execute(diff).fetchone()[0] == 0
    # a compute that really breaks the constraint fails the run, recorded: checked at COMMIT (the caller
    # was the owner, so no sandbox made the checks immediate), it failed after recompute() had returned
    # done, and the job looked healthy
    conn.execute("update score set uid = uid + 100 where uid = 1")
    conn.execute(
        "create or replace function tops(ignored int[]) returns table (rank int, uid int) language sql stable"
        " as $$ select (row_number() over (order by pts desc, uid))::int, 7 from public.score $$"
    )
    r = result(conn, drain_recompute)
    assert r["outcome"] == "failed" and "violates" in r["error"], r
    assert conn.execute("select last_outcome from lockstep.status").fetchone()[0] == "failed"


HAND_OFF_SCHEMA = """
create schema ho;
create table ho.acc (id int primary key, bal int not null);
create table ho.band (id int primary key references ho.acc on delete cascade, band text not null);
create function ho.bands(keys int[]) returns table (id int, band text) language sql stable
    as $$ select a.id, case when a.bal < 0 then 'neg' else 'pos' end from ho.acc a
          where keys is null or a.id = any(keys) $$;
insert into ho.acc select g, g % 7 - 3 from generate_series(1, 6000) g;
select lockstep.define_derived('ho', 'ho.band', 'ho.bands(int[])', 'ho.acc', every => '1 day');
select lockstep.set_batch_parents('ho', 10);
"""


def test_hand_off_reads_each_work_row_a_bounded_number_of_times(conn):
    # The batch limit once kept a row with `NOT EXISTS (... rest ...)` inside an OR: no anti-join, so every
    # row of the difference rescanned the list of handed-off parents (quadratic: a 1,000,000-account
    # recompute ran for more than 6 minutes). Counted, not timed: rows read from lockstep's temp tables.
    conn.execute(HAND_OFF_SCHEMA)
    conn.execute("begin")
    # the smallest work_mem: a list of 5,990 keys cannot be hashed in it (as 1,000,000 cannot in 4MB);
    # before the fix 18,038,995 rows were read here, after it 48,050
    conn.execute("set local work_mem = '64kB'")
    r = result(conn, "lockstep.recompute('ho')")
    read = conn.execute(
        "select coalesce(sum(seq_tup_read), 0) from pg_stat_xact_all_tables"
        " where schemaname like 'pg_temp%' and relname like 'lockstep%'"
    ).fetchone()[0]
    conn.execute("commit")
    assert (r["outcome"], r["inserted"]) == ("done", 10)
    assert conn.execute("select count(*) from lockstep.queue where job = 'ho'").fetchone()[0] == 5990
    assert read <= 40 * 6000, read  # a handful of scans of each work table, never one per row


def test_hand_off_starts_above_batch_parents_not_above_batch_rows(ex):
    """A difference of many rows but at most batch_parents parents is written in one transaction; one parent
    more and that parent (the last in key order) is handed to the queue."""
    ex.execute(f"select lockstep.set_batch_parents('{JOB}', 5)")
    ex.execute("update example.exam set body = example.words(8, 7000 + id) where id between 11 and 15")
    ex.execute("delete from lockstep.queue")
    r = result(ex, f"lockstep.recompute('{JOB}')")
    assert (r["outcome"], r["more"]) == ("done", False)
    assert r["inserted"] + r["updated"] > 5  # more rows than batch_parents: the bound counts parents
    assert ex.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
    assert divergence(ex) == (0, 0)
    ex.execute("update example.exam set body = example.words(8, 8000 + id) where id between 11 and 16")
    ex.execute("delete from lockstep.queue")
    r = result(ex, f"lockstep.recompute('{JOB}')")
    assert (r["outcome"], r["more"]) == ("done", True)
    assert [k for (k,) in ex.execute("select key from lockstep.queue")] == ["16"]
    while result(ex, f"lockstep.work('{JOB}')")["outcome"] != "idle":
        pass
    assert divergence(ex) == (0, 0)


def _counted_pass(conn: psycopg.Connection, batch: int) -> tuple[dict, int]:
    """One lockstep.work('ho', batch) in a transaction of its own: its result, and the queue tuples it read
    (sequential reads and index fetches)."""
    conn.execute("select pg_stat_force_next_flush()")  # PostgreSQL 15's pg_stat_xact_* show unflushed counts
    with conn.transaction():
        r = result(conn, f"lockstep.work('ho', {batch})")
        read = conn.execute(
            "select coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) from pg_stat_xact_all_tables"
            " where relid = 'lockstep.queue'::regclass"
        ).fetchone()[0]
    return r, read


def test_worker_pass_after_a_hand_off_reads_its_own_entries_only(conn):
    # A VACUUM of the empty queue leaves reltuples = 0, and the hand-off then refills the same pages: with
    # an estimate of one row, the worker's entry and settle statements once scanned every entry of the job
    # against the pass's keys (O(queue x batch): 517 ms a pass after a 49,500-key hand-off instead of 88;
    # under a pgbench load a cached generic plan took the primary key and filtered by key: 2.4 s a pass),
    # and _has_ready took a bitmap scan that reads every entry of the job (O(queue) a pass and a tick).
    # Counted, not timed: queue tuples one pass of 10 keys reads, with 5,990 entries queued.
    conn.execute(HAND_OFF_SCHEMA)
    conn.execute("vacuum (analyze) lockstep.queue")
    assert result(conn, "lockstep.recompute('ho')")["outcome"] == "done"
    assert conn.execute("select count(*) from lockstep.queue where job = 'ho'").fetchone()[0] == 5990
    r, read = _counted_pass(conn, 10)
    assert (r["outcome"], r["inserted"]) == ("done", 10)
    assert conn.execute("select count(*) from lockstep.queue where job = 'ho'").fetchone()[0] == 5980
    assert read <= 20 * 10, read  # a few probes per key of the pass, never a scan of the job's entries


def test_worker_pass_plans_cached_on_a_small_queue_stay_per_key_as_it_grows(conn):
    # Under a pgbench load the runners' sessions cached the worker's generic plans while the queue held a
    # few hundred entries (analyzed so); as it grew to 40,000, each entry lookup filtered every entry of the
    # job through the primary key (job, id) instead of probing by key: passes of 500 keys took 2.4 s and the
    # queue never drained. Counted, not timed: queue tuples one pass of 10 keys reads, with 5,990 queued.
    conn.execute(HAND_OFF_SCHEMA)
    conn.execute("select lockstep.set_batch_parents('ho', 1000000)")
    assert result(conn, "lockstep.recompute('ho')")["inserted"] == 6000  # filled in one transaction
    conn.execute("select lockstep.set_batch_parents('ho', 10)")
    conn.execute("select lockstep.enqueue('ho', array(select g from generate_series(1, 230) g))")
    conn.execute("analyze lockstep.queue")
    assert result(conn, "lockstep.work('ho', 10)")["outcome"] == "done"  # plans cached on 230 entries
    conn.execute("update ho.acc set bal = -bal - 1")  # every band changes: 10 written, the rest handed off
    assert result(conn, "lockstep.recompute('ho')")["more"] is True
    r, read = _counted_pass(conn, 10)
    assert r["outcome"] == "done"
    assert conn.execute("select count(*) from lockstep.queue where job = 'ho'").fetchone()[0] > 5000
    assert read <= 20 * 10, read  # a few probes per key of the pass, never a scan of the job's entries


def test_worker_pass_settles_by_row_id_not_by_a_scan_of_the_queue_index(conn):
    # The settle statement's id check once served as an index condition on the primary key's second column
    # (job, id): its cached generic plan then read the whole index, dead entries included (200 ms a pass
    # over 100,000 of them). Counted, not timed: index pages of the primary key one pass touches, with
    # 20,000 dead entries and 500 live ones.
    conn.execute(HAND_OFF_SCHEMA)
    conn.execute("select lockstep.set_batch_parents('ho', 1000000)")
    assert result(conn, "lockstep.recompute('ho')")["inserted"] == 6000
    conn.execute("select lockstep.enqueue('ho', array[1, 2, 3])")
    conn.execute("vacuum (analyze) lockstep.queue")
    assert result(conn, "lockstep.work('ho', 10)")["outcome"] == "done"  # plans cached on a tiny queue
    for _ in range(4):
        conn.execute("select lockstep.enqueue('ho', array(select g from generate_series(1, 5000) g))")
    conn.execute("delete from lockstep.queue where job = 'ho'")  # 20,000 dead entries
    conn.execute("select lockstep.enqueue('ho', array(select g from generate_series(1, 500) g))")

    pkey_pages = (
        "select idx_blks_hit + idx_blks_read from pg_statio_all_indexes"
        " where indexrelid = 'lockstep.queue_pkey'::regclass"
    )
    before = flushed_stat(conn, pkey_pages)
    assert result(conn, "lockstep.work('ho', 500)")["outcome"] == "done"
    touched = flushed_stat(conn, pkey_pages) - before
    assert conn.execute("select count(*) from lockstep.queue where job = 'ho'").fetchone()[0] == 0
    index_pages = conn.execute("select pg_relation_size('lockstep.queue_pkey') / 8192").fetchone()[0]
    assert touched <= 4 * index_pages, (touched, index_pages)  # a few walks (the claim), never one per key


def test_a_poison_parent_of_a_flagged_job_is_isolated_not_recomputed_forever(conn):
    """A job flagged for its full recompute (a TRUNCATE of a watched table, a newly watched table) with one
    parent whose compute raises: the whole-table pass failed, every parent was handed to the worker, and the
    run was done, leaving the flag. run() then took the flag again at once: recompute, fail, hand off,
    forever; the worker never ran and no parent was written (a runner looped ~120 recomputes a second). The
    flag now waits (job_state.recompute_poisoned_at) for the next periodic recompute
    or a retry: the next runs are worker passes, which isolate the poison parent and write the others."""
    badges(conn, ["t10"])
    conn.execute("select lockstep.watch('badges', 'team', 'id')")
    assert conn.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 1  # newly watched
    actions = [result(conn, "lockstep.run('badges')")["action"] for _ in range(8)]
    assert actions[0] == "recompute" and "work" in actions, actions  # before: recompute 8 times
    conn.execute("update lockstep.queue set ready_at = now()")
    for _ in range(20):
        conn.execute("update lockstep.job_state set retry_at = null")
        conn.execute("update lockstep.key_failure set retry_at = now()")
        result(conn, "lockstep.run('badges')")
    written = conn.execute("select count(*) from team_badge").fetchone()[0]
    assert written == 9  # every healthy parent
    assert conn.execute("select key from lockstep.key_failure").fetchall() == [("t10",)]
    assert conn.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 1  # still flagged
    # fixed and retried: the recompute runs at once, succeeds and clears the flag
    conn.execute("update team set name = 'good' where id = 't10'")
    conn.execute("select lockstep.retry('badges')")
    r = result(conn, "lockstep.run('badges')")
    assert (r["action"], r["outcome"]) == ("recompute", "done"), r
    assert conn.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0
    assert conn.execute("select count(*) from team_badge").fetchone()[0] == 10
    assert conn.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0
    conn.execute("select lockstep.drop_job('badges')")


def test_a_flag_raised_after_a_poisoned_recompute_runs_the_recompute_again(conn):
    """The flags of a job whose recompute was poisoned waited for the next periodic recompute, those
    raised later too: a TRUNCATE of a watched table after the poison parent was fixed by an ordinary UPDATE
    left every derived row of the truncated table in place for up to `every`. A flag raised since the
    poisoned recompute started counts, once."""
    conn.execute(
        """
        create table team (id text primary key, name text not null);
        create table member (id serial primary key, team_id text not null references team on delete cascade);
        create table team_size (team_id text primary key references team on delete cascade, n int not null,
                                badge text);
        create function sizes(ids text[]) returns table (team_id text, n int, badge text) language sql as $$
            select t.id, (select count(*) from public.member m where m.team_id = t.id)::int,
                   case when t.name = 'bad' then (1 / (length(t.name) - 3))::text else upper(t.name) end
            from public.team t where ids is null or t.id = any(ids) $$;
        insert into team select 't' || g, 'n' || g from generate_series(1, 9) g;
        insert into team values ('t10', 'bad');
        insert into member (team_id) select 't' || (g % 10 + 1) from generate_series(1, 30) g;
        select lockstep.define_derived('sizes', 'team_size', 'sizes(text[])', 'team', every => '1 day');
        select lockstep.set_max_attempts('sizes', 1);
        select lockstep.watch('sizes', 'team', 'id');
        select lockstep.watch('sizes', 'member', 'team_id');
        """
    )
    r = result(conn, "lockstep.run('sizes')")  # flagged (newly watched): the recompute, poisoned
    assert r["action"] == "recompute" and "handed to the worker" in (r["error"] or ""), r
    for _ in range(5):  # the worker writes the healthy teams and parks t10
        run_now(conn, "sizes")
    assert conn.execute("select count(*) from lockstep.parked_keys").fetchone()[0] == 1
    conn.execute("update team set name = 'good' where id = 't10'")  # the fix, by an ordinary update
    for _ in range(3):
        run_now(conn, "sizes")
    assert conn.execute("select count(*) from lockstep.parked_keys").fetchone()[0] == 0
    assert conn.execute("select count(*) from team_size").fetchone()[0] == 10
    conn.execute("truncate member")  # a new flag: no transition table names the teams
    r = result(conn, "lockstep.run('sizes')")
    assert (r["action"], r["outcome"]) == ("recompute", "done"), r  # before: work (idle), flag held
    assert conn.execute("select sum(n) from team_size").fetchone()[0] == 0
    assert conn.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0


@pytest.mark.parametrize("flagger", ["long_key", "trigger"])
def test_a_poisoned_recompute_is_not_rerun_by_flags_raised_after_it(conn, flagger):
    """A first version of "a flag raised after the poisoned recompute counts" looped:
    that recompute raises a flag itself for a key too long for the queue (342 recomputes in 4 s, the worker
    never ran), and a trigger that flags on every write re-ran it, handing every parent off, per write. The
    hold ends when the poison is cured, not when a flag is newer."""
    conn.execute(
        """
        create table doc (id text primary key, bad boolean not null default false,
                          n int not null default 0);
        create table doc_len (doc_id text primary key references doc on delete cascade, len int not null);
        create function doc_len_c(ids text[]) returns table (doc_id text, len int)
        language plpgsql stable as $$
        begin
            if exists (select from public.doc d where (ids is null or d.id = any(ids)) and d.bad) then
                raise exception 'bad doc';
            end if;
            return query select d.id, length(d.id) + d.n from public.doc d
                         where ids is null or d.id = any(ids);
        end $$;
        insert into doc (id) select 'd' || g from generate_series(1, 10) g;
        select lockstep.define_derived('doclen', 'doc_len', 'doc_len_c(text[])', parent => 'doc',
                                       every => '1 hour');
        select lockstep.watch('doclen', 'doc', 'id');
        select lockstep.set_max_attempts('doclen', 1);
        """
    )
    if flagger == "long_key":
        conn.execute("insert into doc (id) values (repeat('L', 2700))")  # too long for the queue: flags
    assert result(conn, "lockstep.run('doclen')")["outcome"] == "done"  # the recompute (newly watched)
    conn.execute("update doc set bad = true where id = 'd3'")
    conn.execute("delete from lockstep.queue")
    conn.execute("delete from lockstep.recompute_flag")
    r = result(conn, "lockstep.recompute('doclen')")
    assert "handed to the worker" in (r["error"] or ""), r
    if flagger == "trigger":  # one's own trigger without transition tables: it flags the job on each write
        conn.execute(
            "create trigger doc_note after update on doc for each statement"
            " execute function lockstep.enqueue_trigger('doclen', 'id')"
        )
    actions = []
    for i in range(8):
        if flagger == "trigger":
            conn.execute("update doc set n = n + 1 where id = %s", [f"d{i % 2 + 5}"])
        actions.append(run_now(conn, "doclen")["action"])
    assert "recompute" not in actions, actions  # the hold stands while d3 is poison
    assert conn.execute("select key from lockstep.parked_keys").fetchall() == [("d3",)]
    conn.execute("update doc set bad = false where id = 'd3'")  # cured by an ordinary update
    actions = []
    for _ in range(4):
        actions.append(run_now(conn, "doclen")["action"])
    assert actions[:2] == ["work", "recompute"], actions  # d3 written (cured), then the held flags
    assert conn.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0
    assert (
        conn.execute(
            "select count(*) from ((select * from doc_len except select * from doc_len_c(null))"
            " union all (select * from doc_len_c(null) except select * from doc_len)) x"
        ).fetchone()[0]
        == 0
    )


def test_a_poison_cured_while_the_hand_off_is_still_queued_ends_the_hold(conn, dsn):
    """The hold ended only if the pass that wrote the cured key also found the hand-off worked off; retries
    come first, so a key cured early (the common case) left the hold on for good, and a later TRUNCATE's
    flag waited for the periodic recompute, every derived row stale."""
    conn.execute(
        """
        create table p (id int primary key, v int not null, bad boolean not null default false);
        create table side (p_id int not null);
        create table d (p_id int primary key references p on delete cascade, v int not null);
        create function d_c(ids int[]) returns table (p_id int, v int) language plpgsql stable as $$
        begin
            if exists (select from public.p x where (ids is null or x.id = any(ids)) and x.bad) then
                raise exception 'bad parent';
            end if;
            return query select x.id, x.v + (select count(*) from public.side s where s.p_id = x.id)::int
                         from public.p x where ids is null or x.id = any(ids);
        end $$;
        insert into p select g, g from generate_series(1, 100) g;
        insert into side select g from generate_series(1, 100) g;
        select lockstep.define_derived('dj', 'd', 'd_c(int[])', parent => 'p', every => '1 day');
        select lockstep.set_batch_parents('dj', 10);
        select lockstep.watch('dj', 'p', 'id');
        select lockstep.watch('dj', 'side', 'p_id');
        """
    )

    for _ in range(15):  # the first fill (newly watched: the recompute, then its hand-off)
        run_now(conn, "dj")
    assert conn.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
    conn.execute("update p set bad = true where id = 1")
    conn.execute("truncate side")  # a flag: the recompute, poisoned by parent 1, hands all 100 off
    r = run_now(conn, "dj")
    assert "handed to the worker" in (r["error"] or ""), r
    r = run_now(conn, "dj")  # the first pass: parent 1 fails
    assert conn.execute("select count(*) from lockstep.key_failure where attempts > 0").fetchone()[0] == 1
    conn.execute("update p set bad = false where id = 1")  # the fix, with 90 parents still queued
    actions = [run_now(conn, "dj")["action"] for _ in range(20)]
    assert "recompute" in actions, actions  # before: all work, the hold on for good
    assert conn.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0
    assert (
        conn.execute(
            "select count(*) from ((select * from d except select * from d_c(null))"
            " union all (select * from d_c(null) except select * from d)) x"
        ).fetchone()[0]
        == 0
    )
    assert conn.execute("select recompute_held_since from lockstep.status").fetchone()[0] is None


def test_a_key_that_fails_once_then_goes_through_unchanged_cures_nothing(conn):
    """With a whole-table pass that always fails, a key that failed its first try and went through on its
    retry, its data unchanged (a timeout on a cold cache), counted as a cure: the hold ended after every
    hand-off and the recompute ran again, one full compute and hand-off per cycle, the worker never idle.
    A cure needs an application change since the key failed."""
    conn.execute(
        """
        create table p (id int primary key, v int not null);
        create table side (p_id int not null);
        create table d (p_id int primary key references p on delete cascade, v int not null);
        create function d_c(ids int[]) returns table (p_id int, v int) language plpgsql volatile as $$
        begin
            if ids is null and exists (select from public.p) then
                raise exception 'the whole-table pass always fails';
            end if;
            if 7 = any(ids) and not exists (select from lockstep.key_failure f where f.key = '7') then
                raise exception 'first try of 7';
            end if;
            return query select x.id, x.v from public.p x where ids is null or x.id = any(ids);
        end $$;
        insert into p select g, g from generate_series(1, 30) g;
        select lockstep.define_derived('dj', 'd', 'd_c(int[])', parent => 'p', every => '1 day');
        select lockstep.set_batch_parents('dj', 10);
        select lockstep.watch('dj', 'p', 'id');
        select lockstep.watch('dj', 'side', 'p_id');
        """
    )
    actions = []
    for _ in range(60):
        actions.append(run_now(conn, "dj")["action"])
    assert actions.count("recompute") == 1, actions  # before: one per hand-off
    assert conn.execute("select count(*) from d").fetchone()[0] == 30  # the worker wrote every parent
    assert conn.execute("select recompute_held_since is not null from lockstep.status").fetchone()[0]


def test_a_retry_of_some_keys_does_not_rerun_a_poisoned_recompute(conn):
    """lockstep retry JOB KEY after a poisoned recompute re-ran the whole-table recompute, which met the
    other poison parent again and handed every parent to the worker a second time. A
    retry of some keys queues those; a retry of the whole job makes the recompute due."""
    badges(conn, ["t10", "t11"])
    conn.execute(
        "select lockstep.set_max_attempts('badges', 1); select lockstep.watch('badges', 'team', 'id')"
    )
    r = result(conn, "lockstep.run('badges')")  # flagged: the recompute, poisoned, hands every parent off
    assert r["action"] == "recompute" and "handed to the worker" in (r["error"] or ""), r
    for _ in range(6):
        run_now(conn, "badges")
    assert conn.execute("select key from lockstep.parked_keys order by 1").fetchall() == [("t10",), ("t11",)]
    conn.execute("set session_replication_role = replica")  # fixed behind the triggers: only a retry sees it
    conn.execute("update team set name = 'good' where id = 't10'")
    conn.execute("reset session_replication_role")
    assert conn.execute("select lockstep.retry('badges', array['t10'])").fetchone()[0] == 1
    r = result(conn, "lockstep.run('badges')")
    assert (r["action"], r["outcome"]) == ("work", "done"), r  # before: the whole-table recompute again
    assert conn.execute("select badge from team_badge where team_id = 't10'").fetchone() == ("GOOD",)
    conn.execute("update team set name = 'fine' where id = 't11'")  # t11: queued again, tried once more
    conn.execute("select lockstep.retry('badges')")  # the whole job: the held flag counts, the recompute runs
    r = result(conn, "lockstep.run('badges')")
    assert (r["action"], r["outcome"]) == ("recompute", "done"), r
    assert conn.execute("select count(*) from team_badge").fetchone()[0] == 11
    assert conn.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0


def test_a_change_the_columns_equality_does_not_see_is_still_written(conn):
    """A box moved to a box of the same area, 'abc' -> 'ABC' under a case-insensitive collation, 1.0 ->
    1.000: each is equal by its type's = (box compares areas), so IS DISTINCT FROM found no difference and
    neither work() nor recompute() ever wrote them. Such columns
    (lockstep.job.image_columns) are compared by binary image; a no-op recompute still writes nothing."""
    conn.execute(
        """
        create extension if not exists citext;
        create collation ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false);
        create table shape (id int primary key, label text not null, amount numeric, b box, n int,
                            tag citext);
        create table shape_view (shape_id int primary key references shape on delete cascade,
                                 label text collate ci not null, amount numeric, b box, n int, tag citext);
        create function shape_rows(ids int[])
            returns table (shape_id int, label text, amount numeric, b box, n int, tag citext) language sql
            as $$ select id, label, amount, b, n, tag from public.shape where ids is null or id = any(ids) $$;
        insert into shape values (1, 'abc', 1.0, box '(1,1),(0,0)', 7, 'red'),
                                 (2, 'x', 2, box '(2,2),(0,0)', 8, 'x');
        select lockstep.define_derived('shapes', 'shape_view', 'shape_rows(int[])', 'shape',
                                       every => '1 day');
        select lockstep.watch('shapes', 'shape', 'id');
        """
    )
    image = conn.execute("select image_columns from lockstep.job where job = 'shapes'").fetchone()[0]
    assert image == ["label", "amount", "b", "tag"]  # not n (integer equality is identity), nor the key
    assert result(conn, "lockstep.recompute('shapes')")["outcome"] == "done"
    shown = "select label, amount::text, b::text, n, tag::text from shape_view where shape_id = 1"
    conn.execute(
        "update shape set label = 'ABC', amount = 1.000, b = box '(6,6),(5,5)', tag = 'RED' where id = 1"
    )
    r = result(conn, "lockstep.work('shapes')")
    assert (r["outcome"], r["updated"]) == ("done", 1), r  # before: done, 0 updated
    assert conn.execute(shown).fetchone() == ("ABC", "1.000", "(6,6),(5,5)", 7, "RED")
    other = "select label, amount::text, b::text, n, tag::text from shape_view where shape_id = 2"
    assert conn.execute(other).fetchone() == ("x", "2", "(2,2),(0,0)", 8, "x")  # untouched
    # the same through the recompute (nothing queued)
    conn.execute(
        "update shape set label = 'abc', amount = 1.0, b = box '(1,1),(0,0)', tag = 'red' where id = 1"
    )
    conn.execute("delete from lockstep.queue")
    r = result(conn, "lockstep.recompute('shapes')")
    assert (r["outcome"], r["updated"]) == ("done", 1), r
    assert conn.execute(shown).fetchone() == ("abc", "1.0", "(1,1),(0,0)", 7, "red")
    r = result(conn, "lockstep.recompute('shapes')")
    assert (r["outcome"], r["inserted"], r["updated"], r["deleted"]) == ("done", 0, 0, 0), r
    conn.execute("select lockstep.drop_job('shapes')")
