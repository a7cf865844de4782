"""define_derived validation: every bad input gets a clear error with a SQLSTATE and changes nothing."""

from __future__ import annotations

import secrets
import threading

import psycopg
import pytest
from isolation import wait_for_lock_wait
from util import raises_sqlstate, snapshot

SETUP = """
create table p (id bigint primary key, v int not null default 0);
create table p2 (a int, b int, primary key (a, b));
create table d (p_id bigint not null references p (id) on delete cascade, k text not null, w int,
                primary key (p_id, k));
create table nopk (p_id bigint references p (id), k text);
create table d_nofk (p_id bigint not null, k text not null, w int, primary key (p_id, k));
create table d_json (p_id bigint not null references p (id), k text not null, j json, primary key (p_id, k));
create table d_req (p_id bigint not null references p (id), k text not null, w int, must int not null,
                    primary key (p_id, k));
create view v as select * from d;
create table d_ident (p_id bigint not null references p (id) on delete cascade, k text not null,
                      w int generated always as identity, primary key (p_id, k));
create function good(ids bigint[]) returns table (p_id bigint, k text, w int) language sql
    as $$ select id, 'k' || v, v from public.p where ids is null or id = any(ids) $$;
create function wrong_arg(ids int[]) returns table (p_id bigint, k text, w int) language sql
    as $$ select null::bigint, null::text, null::int where false $$;
create function two_args(ids bigint[], x int) returns table (p_id bigint, k text, w int) language sql
    as $$ select null::bigint, null::text, null::int where false $$;
create function not_set(ids bigint[]) returns int language sql as $$ select 1 $$;
create function wrong_type(ids bigint[]) returns table (p_id bigint, k text, w bigint) language sql
    as $$ select null::bigint, null::text, null::bigint where false $$;
create function extra_col(ids bigint[]) returns table (p_id bigint, k text, w int, zz int) language sql
    as $$ select null::bigint, null::text, null::int, null::int where false $$;
create function no_pk_col(ids bigint[]) returns table (p_id bigint, w int) language sql
    as $$ select null::bigint, null::int where false $$;
create function unqualified(ids bigint[]) returns table (p_id bigint, k text, w int) language sql
    as $$ select id, 'k', v from p where id = any(ids) $$;
create function json_out(ids bigint[]) returns table (p_id bigint, k text, j json) language sql
    as $$ select null::bigint, null::text, null::json where false $$;
create function scalar_arg(ids bigint) returns table (p_id bigint, k text, w int) language sql
    as $$ select null::bigint, null::text, null::int where false $$;
"""


@pytest.fixture
def db(conn: psycopg.Connection) -> psycopg.Connection:
    conn.execute(SETUP)
    return conn


def test_good_definition_infers_the_parent_column(db):
    db.execute("select lockstep.define_derived('j', 'd', 'good(bigint[])', 'p')")
    row = db.execute(
        "select parent_column, parent_key, key_type::text, target_key, columns from lockstep.job"
    ).fetchone()
    assert row == ("p_id", "id", "bigint", ["p_id", "k"], ["p_id", "k", "w"])
    assert db.execute("select kind, lock_group, next_run_at <= now() from lockstep.status").fetchone() == (
        "derived",
        "j",
        True,
    )


def test_redefine_keeps_state_and_updates_definition(db):
    db.execute("select lockstep.define_derived('j', 'd', 'good(bigint[])', 'p')")
    db.execute("select lockstep.recompute('j')")
    db.execute("select lockstep.define_derived('j', 'd', 'good(bigint[])', 'p', every => '1 hour')")
    assert db.execute("select runs, every from lockstep.status").fetchone()[0] == 1


CASES = [
    # (call, sqlstate, message fragment)
    ("lockstep.define_derived(null, 'd', 'good(bigint[])', 'p')", "22004", "must not be NULL"),
    ("lockstep.define_derived('j', null, 'good(bigint[])', 'p')", "22004", "must not be NULL"),
    ("lockstep.define_derived('j', 'd', null, 'p')", "22004", "must not be NULL"),
    ("lockstep.define_derived('', 'd', 'good(bigint[])', 'p')", "22023", "empty"),
    ("lockstep.define_derived('  ', 'd', 'good(bigint[])', 'p')", "22023", "blank"),
    ("lockstep.define_derived('j', 'd', 'good(bigint[])', 'p', lock_group => E'\\t')", "22023", "blank"),
    ("lockstep.define_derived('j', 'd', 'good(bigint[])', 'p', every => '0 s')", "22023", "positive"),
    ("lockstep.define_derived('j', 'd', 'good(bigint[])', 'p', backoff => '-1 s')", "22023", "positive"),
    (
        "lockstep.define_derived('j', 'd', 'good(bigint[])', 'p', every => '300000 years')",
        "22023",
        "100 years",
    ),
    ("lockstep.define_derived('j', 'no_such_table', 'good(bigint[])', 'p')", "42P01", "does not exist"),
    ("lockstep.define_derived('j', 'd', 'no_such_fn(bigint[])', 'p')", "42883", "does not exist"),
    ("lockstep.define_derived('j', 'nopk', 'good(bigint[])', 'p')", "LSD01", "has no primary key"),
    ("lockstep.define_derived('j', 'v', 'good(bigint[])', 'p')", "42809", "is not a table"),
    ("lockstep.define_derived('j', 'd', 'wrong_arg(int[])', 'p')", "LSD02", "it must take bigint"),
    ("lockstep.define_derived('j', 'd', 'two_args(bigint[], int)', 'p')", "LSD02", "one array argument"),
    ("lockstep.define_derived('j', 'd', 'not_set(bigint[])', 'p')", "LSD02", "returning a set"),
    ("lockstep.define_derived('j', 'd', 'scalar_arg(bigint)', 'p')", "LSD02", "it must take bigint"),
    ("lockstep.define_derived('j', 'd', 'wrong_type(bigint[])', 'p')", "LSD03", "returns bigint, target"),
    ("lockstep.define_derived('j', 'd', 'extra_col(bigint[])', 'p')", "LSD03", "returns column zz"),
    ("lockstep.define_derived('j', 'd', 'no_pk_col(bigint[])', 'p')", "LSD03", "primary-key column"),
    ("lockstep.define_derived('j', 'd_req', 'good(bigint[])', 'p')", "LSD03", "NOT NULL column"),
    ("lockstep.define_derived('j', 'd_json', 'json_out(bigint[])', 'p')", "LSD03", "no equality operator"),
    # accepted, then every run failed with 428C9
    ("lockstep.define_derived('j', 'd_ident', 'good(bigint[])', 'p')", "LSD03", "ALWAYS AS IDENTITY"),
    ("lockstep.define_derived('j', 'd_nofk', 'good(bigint[])', 'p')", "LSD04", "cannot infer parent_column"),
    ("lockstep.define_derived('j', 'd_nofk', 'good(bigint[])', 'p', 'p_id')", "LSD04", "foreign key"),
    ("lockstep.define_derived('j', 'd', 'good(bigint[])', 'p', 'nope')", "LSD04", "has no column nope"),
    ("lockstep.define_derived('j', 'd', 'good(bigint[])', null, 'p_id')", "LSD04", "without parent"),
    ("lockstep.define_derived('j', 'd', 'good(bigint[])', 'p2')", "LSD04", "cannot infer parent_columns"),
    ("lockstep.define_derived('j', 'd', 'good(bigint[])', 'pg_namespace_no')", "42P01", "does not exist"),
    ("lockstep.define_derived('j', 'd', 'unqualified(bigint[])', 'p')", "LSD02", "search_path"),
    ("lockstep.define_derived('keep', 'd', 'good(bigint[])', 'p')", "LSJ02", "generic job"),
    ("lockstep.recompute('nope')", "LSJ01", "unknown job"),
    ("lockstep.recompute(null)", "22004", "NULL"),
    ("lockstep.recompute('keep')", "LSJ02", "not a derived job"),
]


@pytest.mark.parametrize(("call", "sqlstate", "match"), CASES, ids=[c[0][9:60] for c in CASES])
def test_bad_definition_is_refused_and_changes_nothing(db, call, sqlstate, match):
    db.execute("create function tick() returns void language sql as $$ select 1 $$")
    db.execute("select lockstep.define_job('keep', 'tick()')")
    before = snapshot(db, "d")
    with raises_sqlstate(sqlstate, match):
        db.execute(f"select {call}")
    assert snapshot(db, "d") == before


def test_a_second_job_on_the_same_target_is_refused(db):
    """Two jobs writing one table rewrite each other's rows at every run; the second was accepted silently.
    Redefining the job that owns it is still fine."""
    db.execute("select lockstep.define_derived('first', 'd', 'good(bigint[])', 'p')")
    with raises_sqlstate("LSD07", 'already written by job "first"'):
        db.execute("select lockstep.define_derived('second', 'd', 'good(bigint[])', 'p')")
    assert db.execute("select job from lockstep.job order by 1").fetchall() == [("first",)]
    db.execute("select lockstep.define_derived('first', 'd', 'good(bigint[])', 'p', every => '1 hour')")
    db.execute("select lockstep.drop_job('first')")
    db.execute("select lockstep.define_derived('second', 'd', 'good(bigint[])', 'p')")
    # a partitioned target and its partition hold the same rows: refused both ways
    db.execute(
        """
        create table dp (p_id bigint not null references p (id) on delete cascade, k text not null, w int,
                         primary key (p_id, k)) partition by hash (p_id);
        create table dp0 partition of dp for values with (modulus 2, remainder 0);
        create table dp1 partition of dp for values with (modulus 2, remainder 1);
        """
    )
    db.execute("select lockstep.define_derived('whole', 'dp', 'good(bigint[])', 'p')")
    with raises_sqlstate("LSD07", 'already written by job "whole" \\(through public.dp\\)'):
        db.execute("select lockstep.define_derived('part', 'dp0', 'good(bigint[])', 'p')")
    db.execute("select lockstep.drop_job('whole')")
    db.execute("select lockstep.define_derived('part', 'dp1', 'good(bigint[])', 'p')")
    with raises_sqlstate("LSD07", 'already written by job "part" \\(through public.dp1\\)'):
        db.execute("select lockstep.define_derived('whole', 'dp', 'good(bigint[])', 'p')")


def test_a_taken_target_is_refused_before_any_warning_about_it(db):
    """define_derived on another job's target printed the warnings of its later checks (the parent key's
    ON UPDATE NO ACTION) and ran the dry run, then refused the table as taken: the
    taken table is checked first, so the refusal comes alone."""
    db.execute("select lockstep.define_derived('first', 'd', 'good(bigint[])', 'p')")
    notices: list[str] = []
    db.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    with raises_sqlstate("LSD07", 'already written by job "first"'):
        db.execute("select lockstep.define_derived('second', 'd', 'good(bigint[])', 'p')")
    assert notices == []
    db.execute("select lockstep.drop_job('first')")
    db.execute("select lockstep.define_derived('second', 'd', 'good(bigint[])', 'p')")
    assert any("ON UPDATE NO ACTION" in n for n in notices)  # the same definition on a free table warns


def test_a_target_whose_row_level_security_applies_to_the_definer_is_refused(db):
    """A target whose row-level security hid some computed rows from the job's role was accepted, and every
    run of the job then failed as a whole with 42501, nothing written. lockstep must see
    and write all the target's rows: refused at define time, changing nothing."""
    role = f"rls_definer_{secrets.token_hex(4)}"
    db.execute(f"create role {role} nologin")
    try:
        db.execute(
            f"grant usage on schema public, lockstep to {role};"
            f"grant select, insert, update, delete on d, p to {role};"
            f"grant select on lockstep.job to {role};"
            "alter table d enable row level security;"
            "create policy d_some on d using (k <> 'hidden')"
        )
        before = snapshot(db, "d")
        db.execute(f"begin; set local role {role}")
        with raises_sqlstate("42501", "row-level security applies to public.d for role"):
            db.execute("select lockstep.define_derived('j', 'd', 'good(bigint[])', 'p')")
        db.execute("rollback")
        assert snapshot(db, "d") == before
        db.execute(
            "select lockstep.define_derived('j', 'd', 'good(bigint[])', 'p')"
        )  # the owner: not applied
    finally:
        db.execute(f"drop owned by {role}")
        db.execute(f"drop role {role}")


def test_a_redefinition_its_watchers_do_not_fit_says_why(db):
    """define_derived over a watched job whose watchers no longer fit said "(column warehouse_id, bigint)
    ... does not fit the new parent key type bigint" for a key type changed from integer to bigint, and
    "(column sku, missing) ... does not fit the new parent key type text" for a renamed column:
    each reason is now said as it is."""
    db.execute(
        """
        create table ip (id int primary key);
        create table iw (ip_id int not null, v int);
        create table idd (ip_id int primary key references ip on delete cascade on update cascade, v int);
        create function icomp(ids int[]) returns table (ip_id int, v int) language sql
            as $$ select ip_id, sum(v)::int from public.iw where ids is null or ip_id = any(ids)
                  group by 1 $$;
        select lockstep.define_derived('ij', 'idd', 'icomp(int[])', 'ip');
        select lockstep.watch('ij', 'iw', 'ip_id');
        select lockstep.watch('ij', 'ip', 'id');
        alter table ip alter column id type bigint;
        alter table idd alter column ip_id type bigint;
        alter table iw alter column ip_id type bigint;
        create function icomp(ids bigint[]) returns table (ip_id bigint, v int) language sql
            as $$ select ip_id, sum(v)::int from public.iw where ids is null or ip_id = any(ids)
                  group by 1 $$;
        """
    )
    with raises_sqlstate("LSQ01", "made for the parent key type integer, not the new bigint") as info:
        db.execute("select lockstep.define_derived('ij', 'idd', 'icomp(bigint[])', 'ip')")
    # every table that feeds the job, in one hint: one at a time, an admin met the next refusal after each
    # unwatch
    assert info.value.diag.message_hint == (
        "First select lockstep.unwatch('ij', 'public.ip'), lockstep.unwatch('ij', 'public.iw')"
        " (every table that feeds it), then watch() again after redefining."
    )
    db.execute("create table w2 (p_id bigint)")
    db.execute("select lockstep.define_derived('j', 'd', 'good(bigint[])', 'p')")
    db.execute("select lockstep.watch('j', 'w2', 'p_id')")
    db.execute("alter table w2 rename column p_id to p_ref")
    with raises_sqlstate("LSQ01", "its column p_id is gone \\(renamed or dropped\\)"):
        db.execute("select lockstep.define_derived('j', 'd', 'good(bigint[])', 'p', every => '1 hour')")


DRIFT = [
    ("alter table d rename column w to weight", "returns column w, which target public.d does not have"),
    ("alter table d drop constraint d_pkey", "no primary key"),
    (
        "drop function good(bigint[]);"
        " create function good(ids bigint[]) returns table (p_id bigint, k text, w text) language sql"
        " as $$ select id, 'k' || v, 'x' from public.p where ids is null or id = any(ids) $$",
        "w",
    ),
    ("alter table p rename column id to ident", "the parent key of public.p is now ident (bigint), not id"),
]


@pytest.mark.parametrize(
    ("ddl", "names"), DRIFT, ids=["target column", "target pk", "compute type", "parent key"]
)
def test_a_run_failing_after_ddl_on_its_tables_says_what_changed(db, ddl, names):
    """After DDL on the target, the compute or the parent, the job's runs failed with the raw error of
    lockstep's own statements ("column t.w does not exist", "no unique or exclusion constraint matching the
    ON CONFLICT specification"), naming neither the cause nor the fix. The failed run's
    error now says what no longer holds of the definition, and to run define_derived again."""
    db.execute("insert into p values (1, 1), (2, 2)")
    db.execute("select lockstep.define_derived('j', 'd', 'good(bigint[])', 'p')")
    db.execute("select lockstep.recompute('j')")
    db.execute(ddl)
    db.execute("update p set v = v + 10")
    db.execute("select lockstep.enqueue('j', array[1, 2]::bigint[])")
    r = db.execute("select outcome, error from lockstep.work('j')").fetchone()
    assert r[0] == "failed", r
    assert "define_derived again" in r[1] and names in r[1], r[1]
    assert db.execute("select last_error from lockstep.status").fetchone()[0] == r[1]
    if "parent key" in names:  # the fix: compute follows the rename, define_derived again; recomputed at once
        db.execute(
            "create or replace function good(ids bigint[]) returns table (p_id bigint, k text, w int)"
            " language sql as $$ select ident, 'k' || v, v from public.p"
            " where ids is null or ident = any(ids) $$"
        )
        # a new parent key was not a change of the definition: the recompute stayed in its backoff
        db.execute("select lockstep.define_derived('j', 'd', 'good(bigint[])', 'p')")
        r = db.execute("select outcome, action from lockstep.run('j')").fetchone()
        assert r == ("done", "recompute"), r


def test_moving_a_job_onto_another_jobs_target_is_refused_as_taken(db):
    """Redefining a watched job onto another job's target, with a parent of another key type, was refused
    with LSQ01 about its triggers' key type (the watchers were checked first), which sent the user to
    unwatch instead of saying that the table is taken: the taken target is LSD07."""
    db.execute(
        """
        create table tp (code text primary key, v int not null);
        create table td (code text primary key references tp on delete cascade, w int not null);
        create function tf(codes text[]) returns table (code text, w int) language sql
            as $$ select code, v from public.tp where codes is null or code = any(codes) $$;
        """
    )
    db.execute("select lockstep.define_derived('owner', 'd', 'good(bigint[])', 'p')")
    db.execute("select lockstep.define_derived('mover', 'td', 'tf(text[])', 'tp')")
    db.execute("select lockstep.watch('mover', 'tp', 'code')")
    before = snapshot(db, "d"), db.execute("select * from lockstep.job order by job").fetchall()
    with raises_sqlstate("LSD07", 'already written by job "owner"'):
        db.execute("select lockstep.define_derived('mover', 'd', 'good(bigint[])', 'p')")
    assert (snapshot(db, "d"), db.execute("select * from lockstep.job order by job").fetchall()) == before


def test_concurrent_definitions_on_one_target_are_serialized(db, connect):
    """Two define_derived on one target in concurrent transactions both passed the check and both committed:
    now the second waits for the first and is refused."""
    other = connect(db.info.dsn)
    observer = connect(db.info.dsn)
    db.execute("begin")
    db.execute("select lockstep.define_derived('ja', 'd', 'good(bigint[])', 'p')")
    done: list[str] = []

    def second() -> None:
        try:
            other.execute("select lockstep.define_derived('jb', 'd', 'good(bigint[])', 'p')")
            done.append("defined")
        except psycopg.Error as exc:
            done.append(exc.sqlstate or "")

    t = threading.Thread(target=second)
    t.start()
    wait_for_lock_wait(
        observer, pid=other.info.backend_pid
    )  # the second waits for the first (pg_blocking_pids)
    db.execute("commit")
    t.join(timeout=30)
    assert done == ["LSD07"]
    assert db.execute("select job from lockstep.job where target = 'd'::regclass").fetchall() == [("ja",)]


def test_a_compute_taking_a_wider_type_than_the_parent_key_is_accepted(db):
    """After `alter table ... type varchar(64)` of a text parent key the job kept working, but redefining it
    unchanged was refused: its compute takes text[], not character varying[]. A compute
    taking an array of a type every key converts to without loss (binary-coercible, or a wider integer)
    is accepted and called with it; a lossy one (numeric -> double precision) still is not."""
    db.execute(
        """
        create table tp (code varchar(64) primary key, v int not null);
        create table td (code varchar(64) primary key references tp on delete cascade, w int not null);
        create function tf(codes text[]) returns table (code varchar(64), w int) language sql
            as $$ select code, v * 2 from public.tp where codes is null or code = any(codes) $$;
        create table np (id numeric primary key);
        create table nd (id numeric primary key references np on delete cascade);
        create function nf(ids float8[]) returns table (id numeric) language sql
            as $$ select id from public.np where ids is null or id = any(ids::numeric[]) $$;
        insert into tp values ('a', 1), ('b', 2);
        """
    )
    db.execute("select lockstep.define_derived('tj', 'td', 'tf(text[])', 'tp')")
    db.execute("select lockstep.recompute('tj')")
    db.execute("update tp set v = 5 where code = 'b'")
    db.execute("select lockstep.enqueue('tj', array['b'])")
    assert db.execute("select outcome from lockstep.work('tj')").fetchone()[0] == "done"
    assert db.execute("select code, w from td order by 1").fetchall() == [("a", 2), ("b", 10)]
    with raises_sqlstate("LSD02", "it must take numeric"):
        db.execute("select lockstep.define_derived('nj', 'nd', 'nf(float8[])', 'np')")


def test_compute_returning_duplicate_keys_fails_the_pass_with_a_clear_error(db):
    db.execute("insert into p values (1, 1), (2, 2)")
    db.execute(
        "create function dup(ids bigint[]) returns table (p_id bigint, k text, w int) language sql"
        " as $$ select id, 'same', v from public.p, generate_series(1, 2)"
        " where ids is null or id = any(ids) $$"
    )
    db.execute("select lockstep.define_derived('j', 'd', 'dup(bigint[])', 'p')")
    r = db.execute("select outcome, error from lockstep.recompute('j')").fetchone()
    # LSD05 is a fault of some parents' rows: the whole-table pass fails, its parents go to the worker
    assert r[0] == "done"
    assert "more than one row for primary key" in r[1] and "handed to the worker" in r[1]
    assert db.execute("select count(*) from d").fetchone()[0] == 0
    r = db.execute("select outcome, error from lockstep.work('j')").fetchone()
    assert "more than one row for primary key" in r[1]
    assert db.execute("select count(*) from lockstep.failing_keys").fetchone()[0] == 2
    assert db.execute("select count(*) from d").fetchone()[0] == 0


@pytest.mark.parametrize("second", ["v", "v + 1"], ids=["identical", "different"])
def test_compute_duplicating_a_key_the_target_already_holds_fails_the_pass(db, second):
    """The whole-table diff finds a duplicate among rows that match a current row (from its counts), whether
    the two copies are identical to the current row or one differs, and names the key."""
    db.execute("insert into p values (1, 1), (2, 2)")
    db.execute(
        "create function dup(ids bigint[]) returns table (p_id bigint, k text, w int) language sql"
        " as $$ select id, 'same', v from public.p where ids is null or id = any(ids) $$"
    )
    db.execute("select lockstep.define_derived('j', 'd', 'dup(bigint[])', 'p')")
    assert db.execute("select outcome from lockstep.recompute('j')").fetchone()[0] == "done"
    before = db.execute("select * from d order by p_id").fetchall()
    db.execute(
        "create or replace function dup(ids bigint[]) returns table (p_id bigint, k text, w int) language sql"
        " as $$ select id, 'same', v from public.p where ids is null or id = any(ids)"
        f" union all select id, 'same', {second} from public.p"
        " where id = 2 and (ids is null or id = any(ids)) $$"
    )
    r = db.execute("select outcome, error from lockstep.recompute('j')").fetchone()
    assert r[0] == "done"
    assert "more than one row for primary key (2,same)" in r[1] and "handed to the worker" in r[1]
    assert db.execute("select * from d order by p_id").fetchall() == before


def test_a_redefinition_makes_the_recompute_due(ex):
    # define_derived again with another compute left next_run_at as it was: the derived table stayed a mix
    # of the two definitions until then (an hour here), and a shorter every waited for the old schedule too
    ex.execute(
        "select lockstep.define_derived('exam_keys', 'example.exam_key',"
        " 'example.exam_key_compute(bigint[])', 'example.exam', every => '1 hour')"
    )
    ex.execute("select lockstep.recompute('exam_keys')")
    due = "select extract(epoch from due_at - now()) from lockstep.due(array['exam_keys'])"
    assert ex.execute(due).fetchone()[0] > 3500
    ex.execute(
        "create function example.heavier(ids bigint[])"
        " returns table (exam_id bigint, key text, weight integer) language sql stable"
        " as $$ select exam_id, key, weight * 2 from example.exam_key_compute(ids) $$"
    )
    ex.execute(
        "select lockstep.define_derived('exam_keys', 'example.exam_key', 'example.heavier(bigint[])',"
        " 'example.exam', every => '1 hour')"
    )
    assert ex.execute(due).fetchone()[0] <= 0  # another compute: due now
    ex.execute("select lockstep.recompute('exam_keys')")
    ex.execute(
        "select lockstep.define_derived('exam_keys', 'example.exam_key', 'example.heavier(bigint[])',"
        " 'example.exam', every => '10 minutes')"
    )
    assert 500 < ex.execute(due).fetchone()[0] <= 600  # a shorter every: from the last run


DEFINE_D = "select lockstep.define_derived('d', 'public.d', 'public.dc(bigint[])', parent => 'public.p')"


def test_a_parent_key_on_update_no_action_is_warned_about_at_define(conn):
    # the target's foreign key to the parent ON UPDATE NO ACTION (the default): an application update of a
    # parent's key then fails with 23503 while derived rows reference it. define_derived says so.
    conn.execute(
        "create table p (id bigint primary key);"
        " create table d (p_id bigint primary key references p on delete cascade, n int);"
        " create function dc(ids bigint[]) returns table (p_id bigint, n int) language sql stable"
        " as $$ select id, 1 from public.p where ids is null or id = any(ids) $$;"
        " insert into p values (1)"
    )
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    conn.execute(DEFINE_D)
    assert any("ON UPDATE NO ACTION" in n for n in notices), notices
    conn.execute("select lockstep.recompute('d')")
    with pytest.raises(psycopg.errors.ForeignKeyViolation):
        conn.execute("update p set id = 2 where id = 1")  # what the warning says
    conn.execute("alter table d drop constraint d_p_id_fkey,"
                 " add foreign key (p_id) references p on delete cascade on update cascade")  # fmt: skip
    notices.clear()
    conn.execute(DEFINE_D)
    assert not any("ON UPDATE" in n for n in notices), notices
    conn.execute("update p set id = 2 where id = 1")


def test_a_unique_index_besides_the_primary_key_is_warned_about(conn):
    # accepted silently before: two parents swapping a unique value failed with 23505
    # at every try and were parked; the derived table never converged
    conn.execute(
        "create table p (id bigint primary key, r int not null);"
        " create table d (p_id bigint primary key references p on delete cascade, r int not null unique);"
        " create function rk(ids bigint[]) returns table (p_id bigint, r int) language sql stable"
        " as $$ select id, r from public.p where ids is null or id = any(ids) $$;"
        " insert into p values (1, 1), (2, 2)"
    )
    define = "select lockstep.define_derived('rank', 'd', 'rk(bigint[])', 'p')"
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    conn.execute(define)
    warned = "unique index public.d_r_key on public.d besides its primary key"
    assert any(warned in n for n in notices), notices
    conn.execute("select lockstep.recompute('rank')")
    conn.execute("update p set r = 3 - r")  # a swap
    conn.execute("select lockstep.enqueue('rank', array[1, 2])")
    r = conn.execute("select outcome, error from lockstep.work('rank')").fetchone()
    assert "duplicate key value violates unique constraint" in r[1]  # what the warning says
    conn.execute("alter table d drop constraint d_r_key, add unique (r) deferrable")  # what its hint says
    notices.clear()
    conn.execute(define)
    assert not any("unique index" in n for n in notices), notices
    conn.execute("delete from lockstep.key_failure")
    conn.execute("select lockstep.enqueue('rank', array[1, 2])")
    assert conn.execute("select outcome, updated from lockstep.work('rank')").fetchone() == ("done", 2)
    assert conn.execute("select * from d order by 1").fetchall() == [(1, 2), (2, 1)]
    # a job without a parent has no parent to park: the warning said so anyway
    conn.execute(
        "create table top (rank int primary key, p_id bigint not null unique);"
        " create function tops(ignored int[]) returns table (rank int, p_id bigint) language sql stable"
        " as $$ select r, id from public.p $$"
    )
    notices.clear()
    conn.execute("select lockstep.define_derived('top', 'top', 'tops(int[])')")
    assert [n for n in notices if "unique index" in n] == [
        "lockstep: unique index public.top_p_id_key on public.top besides its primary key: values that move"
        " between rows (a swap) fail the recompute with 23505 at every try"
    ], notices


def test_a_parent_column_referencing_a_unique_column_says_the_parent_key_must_be_the_primary_key(conn):
    # the foreign key exists: the error must not say it is missing nor hint "add the foreign key"
    conn.execute(
        "create table m (id bigint primary key, handle text not null unique);"
        " create table mp (handle text not null references m (handle) on delete cascade, post int,"
        " n int, primary key (handle, post));"
        " create function mpc(ids text[]) returns table (handle text, post int, n int) language sql stable"
        " as $$ select null::text, null::int, null::int where false $$;"
    )
    before = snapshot(conn)
    with raises_sqlstate("LSD04", r"mp.handle references public.m\(handle\), not the primary key") as info:
        conn.execute(
            "select lockstep.define_derived('mp', 'mp', 'mpc(text[])', 'm', parent_column => 'handle')"
        )
    assert "must be the parent's primary key" in (info.value.diag.message_hint or "")
    assert snapshot(conn) == before
