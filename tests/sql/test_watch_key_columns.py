"""watch(job, source, key_columns => ...) for a job keyed by a composite parent key: the triggers queue the
canonical record text of the old and new rows' keys (the text enqueue() queues), never fail the application
(a column renamed: the job is flagged), and watch() refuses columns that do not match the key type or lead
to another table, changing nothing."""

from __future__ import annotations

import psycopg
import pytest
from util import drain, raises_sqlstate, snapshot

SETUP = """
create table doc (tenant_id int not null, id bigint not null, body text not null default '',
                  primary key (tenant_id, id));
create table other (tenant_id int not null, id bigint not null, primary key (tenant_id, id));
create table note (id bigint generated always as identity primary key, tenant_id int not null,
                   doc_id bigint not null, body text not null,
                   foreign key (tenant_id, doc_id) references doc (tenant_id, id) on delete cascade);
create table stray (id bigint generated always as identity primary key, tenant_id int not null,
                    other_id bigint not null,
                    foreign key (tenant_id, other_id) references other (tenant_id, id));
create table wide (id bigint generated always as identity primary key, tenant_id bigint not null,
                   doc_id bigint not null);
create table doc_stat (tenant_id int not null, doc_id bigint not null, notes bigint not null,
                       chars bigint not null,
                       primary key (tenant_id, doc_id),
                       foreign key (tenant_id, doc_id) references doc (tenant_id, id) on delete cascade);
create type doc_key as (tenant_id int, id bigint);
create function doc_stats(keys doc_key[])
returns table (tenant_id int, doc_id bigint, notes bigint, chars bigint)
language sql stable as $$
    select d.tenant_id, d.id, count(n.id), coalesce(sum(length(n.body)), 0) + length(d.body)
    from public.doc d left join public.note n on n.tenant_id = d.tenant_id and n.doc_id = d.id
    where keys is null or (d.tenant_id, d.id) in (select k.tenant_id, k.id from unnest(keys) k)
    group by d.tenant_id, d.id $$;
insert into doc select t, i, 'd' || i from generate_series(1, 3) t, generate_series(1, 5) i;
select lockstep.define_derived('ds', 'doc_stat', 'doc_stats(doc_key[])', 'doc', every => '1 day');
select lockstep.recompute('ds');
"""

WATCH_NOTE = "select lockstep.watch('ds', 'note', key_columns => array['tenant_id', 'doc_id']::name[])"
WATCH_DOC = "select lockstep.watch('ds', 'doc', key_columns => array['tenant_id', 'id']::name[])"
DIVERGENCE = (
    "select count(*) from ((select * from doc_stat except select * from doc_stats(null))"
    " union all (select * from doc_stats(null) except select * from doc_stat)) d"
)


@pytest.fixture
def db(conn: psycopg.Connection) -> psycopg.Connection:
    conn.execute(SETUP)
    return conn


def queue(conn: psycopg.Connection) -> list[str]:
    return [k for (k,) in conn.execute("select key from lockstep.queue where job = 'ds' order by id")]


def settle(conn: psycopg.Connection) -> None:
    conn.execute("delete from lockstep.queue")
    conn.execute("delete from lockstep.recompute_flag")


def trigger_fns(conn: psycopg.Connection, table: str) -> set[str]:
    return {
        f
        for (f,) in conn.execute(
            "select tgfoid::regproc::text from pg_trigger where tgrelid = %s::regclass and not tgisinternal",
            [table],
        )
    }


def test_the_triggers_queue_the_old_and_new_composite_keys_in_enqueues_text(db):
    db.execute(WATCH_NOTE)
    db.execute(WATCH_DOC)
    assert any(f.startswith("lockstep.enqueue_w_") for f in trigger_fns(db, "note"))  # the generated path
    settle(db)

    def step(sql: str) -> list[str]:
        last = db.execute("select coalesce(max(id), 0) from lockstep.queue").fetchone()[0]
        db.execute(sql)
        return [k for (k,) in db.execute("select key from lockstep.queue where id > %s order by id", [last])]

    assert step(
        "insert into note (tenant_id, doc_id, body) values (2, 3, 'a'), (2, 3, 'b'), (1, 4, 'c')"
    ) == [
        "(1,4)",
        "(2,3)",
    ]  # distinct, in key order
    assert step("update note set doc_id = 5 where tenant_id = 2") == ["(2,3)", "(2,5)"]  # moved: both parents
    assert step("delete from note where tenant_id = 1") == ["(1,4)"]
    assert step("update doc set body = body || '!' where tenant_id = 3 and id = 1") == ["(3,1)"]
    # enqueue() queues the same text: one key each
    assert step("select lockstep.enqueue('ds', array[row(1, 4), row(3, 1)]::doc_key[])") == ["(1,4)", "(3,1)"]
    drain(db, "ds")
    assert db.execute(DIVERGENCE).fetchone()[0] == 0


def test_the_shared_trigger_function_queues_the_same_keys(db):
    """watch() by a role that may not create functions in lockstep uses lockstep.enqueue_trigger: its
    general path builds the same row(...)::key_type and canonical text."""
    for op, ref in [
        ("insert", "new table as lockstep_new"),
        ("update", "old table as lockstep_old new table as lockstep_new"),
    ]:
        db.execute(
            f"create trigger note_{op} after {op} on note referencing {ref} for each statement"
            " execute function lockstep.enqueue_trigger('ds', '{tenant_id,doc_id}', 'doc_key')"
        )
    db.execute("insert into note (tenant_id, doc_id, body) values (2, 3, 'a'), (1, 4, 'c')")
    db.execute("update note set doc_id = 5 where tenant_id = 2")
    assert queue(db) == ["(1,4)", "(2,3)", "(2,3)", "(2,5)"]


@pytest.mark.parametrize("how", ["generated", "shared"])
def test_a_renamed_key_column_flags_the_job_and_the_write_commits(db, how):
    if how == "generated":
        db.execute(WATCH_NOTE)
    else:
        db.execute(
            "create trigger note_insert after insert on note referencing new table as lockstep_new"
            " for each statement"
            " execute function lockstep.enqueue_trigger('ds', '{tenant_id,doc_id}', 'doc_key')"
        )
    settle(db)
    db.execute("alter table note rename column doc_id to document_id")
    db.execute("insert into note (tenant_id, document_id, body) values (1, 1, 'x')")  # does not fail
    flagged, problem = db.execute(
        "select needs_recompute is not null, trigger_problem from lockstep.status where job = 'ds'"
    ).fetchone()
    assert flagged and "doc_id" in problem, problem
    assert queue(db) == []


def test_a_truncate_flags_the_job(db):
    db.execute(WATCH_NOTE)
    settle(db)
    db.execute("truncate note")
    assert db.execute("select needs_recompute is not null from lockstep.status").fetchone()[0]


def test_a_composite_key_under_row_security_off_and_every_isolation_level_enqueues(db, connect, dsn):
    db.execute(WATCH_NOTE)
    settle(db)
    for level in ["read committed", "repeatable read", "serializable"]:
        with connect(dsn, autocommit=True) as c:
            c.execute("set row_security = off")
            c.execute("set datestyle = 'SQL, DMY'")
            c.execute(f"begin isolation level {level}")
            c.execute("insert into note (tenant_id, doc_id, body) values (3, 2, 'x')")
            c.execute("commit")
    assert queue(db) == ["(3,2)"] * 3


BAD = [
    # (watch call arguments, sqlstate, message fragment)
    ("'note', key_columns => array['tenant_id']::name[]", "LSQ01", "1 key columns given, but the key type"),
    ("'note', key_columns => array['doc_id', 'tenant_id']::name[]", "LSQ01", "does not always convert"),
    ("'note', key_columns => array['tenant_id', 'nope']::name[]", "LSQ01", "nope does not exist"),
    ("'wide', key_columns => array['tenant_id', 'doc_id']::name[]", "LSQ01", "tenant_id is bigint"),
    ("'stray', key_columns => array['tenant_id', 'other_id']::name[]", "LSQ02", "references public.other"),
    ("'note', 'doc_id'", "22004", "composite parent key"),
    ("'note', 'doc_id', key_columns => array['tenant_id', 'doc_id']::name[]", "22023", "together"),
    # via => 'wal' on a server whose wal_level is not logical (test_capture_composite.py: one that is)
    (
        "'note', key_columns => array['tenant_id', 'doc_id']::name[], via => 'wal'",
        "55000",
        "wal_level = logical",
    ),
    ("'note', key_columns => array['tenant_id', 'doc_id']::name[], via => 'logical'", "22023", "not a way"),
    (
        "'note', key_columns => array['tenant_id', 'doc_id']::name[],"
        " through => 'doc', through_column => 'id'",
        "22023",
        "pass through_columns",
    ),
]


@pytest.mark.parametrize(("args", "sqlstate", "match"), BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_columns_that_do_not_fit_are_refused_and_change_nothing(db, args, sqlstate, match):
    before = snapshot(db)
    with raises_sqlstate(sqlstate, match):
        db.execute(f"select lockstep.watch('ds', {args})")
    assert snapshot(db) == before
    assert trigger_fns(db, "note") == set()


def test_watch_replica_refuses_a_composite_key_and_names_the_wal(db):
    # it takes one key column: "pass key_columns", as watch() says, was a fix it could not take
    before = snapshot(db)
    with raises_sqlstate("0A000", "one-column parent key") as info:
        db.execute("select lockstep.watch_replica('ds', 'note', 'doc_id')")
    assert "via => 'wal'" in info.value.diag.message_hint
    assert snapshot(db) == before
    assert trigger_fns(db, "note") == set()


def test_a_one_column_job_refuses_key_columns(db):
    db.execute("create table p (id bigint primary key)")
    db.execute("create table d (p_id bigint primary key references p on delete cascade)")
    db.execute(
        "create function f(ids bigint[]) returns table (p_id bigint) language sql stable"
        " as $$ select id from public.p where ids is null or id = any(ids) $$"
    )
    db.execute("select lockstep.define_derived('one', 'd', 'f(bigint[])', 'p')")
    with raises_sqlstate("LSQ01", "watch it with key_column"):
        db.execute("select lockstep.watch('one', 'p', key_columns => array['id']::name[])")


def test_unwatch_and_drop_job_remove_the_composite_triggers(db):
    db.execute(WATCH_NOTE)
    db.execute("select lockstep.unwatch('ds', 'note')")
    assert trigger_fns(db, "note") == set()
    db.execute(WATCH_NOTE)
    db.execute("select lockstep.drop_job('ds')")
    assert trigger_fns(db, "note") == set()
    assert (
        db.execute(
            "select count(*) from pg_proc where pronamespace = 'lockstep'::regnamespace"
            " and proname like 'enqueue\\_w\\_%'"
        ).fetchone()[0]
        == 0
    )


@pytest.mark.parametrize("composite", [True, False], ids=["key_columns", "key_column"])
def test_a_column_name_with_a_newline_stays_in_the_generated_comment(db, composite):
    """watch()'s generated trigger function names the key column(s) in a comment line: a newline in a column
    name ended the comment and made the rest of the name code, run by every writer of the table (a syntax
    error at watch() here; a crafted name would be valid code). The write queues its key."""
    name = "t\nraise exception 'INJECTED'; --"
    db.execute("create table one (id bigint primary key)")
    db.execute("create table one_stat (id bigint primary key references one on delete cascade)")
    db.execute(
        "create function one_f(keys bigint[]) returns table (id bigint) language sql stable"
        " as $$ select o.id from public.one o where keys is null or o.id = any(keys) $$"
    )
    db.execute("select lockstep.define_derived('o', 'one_stat', 'one_f(bigint[])', 'one', every => '1 day')")
    if composite:
        db.execute(f'create table src (id int, "{name}" int not null, doc_id bigint not null)')
        db.execute("select lockstep.watch('ds', 'src', key_columns => array[%s, 'doc_id']::name[])", [name])
        job = "ds"
    else:
        db.execute(f'create table src (id int, "{name}" bigint not null)')
        db.execute("select lockstep.watch('o', 'src', %s)", [name])
        job = "o"
    db.execute("insert into src values (1, 2, 3)" if composite else "insert into src values (1, 2)")
    expected = ["(2,3)"] if composite else ["2"]
    assert [k for (k,) in db.execute("select key from lockstep.queue where job = %s", [job])] == expected
