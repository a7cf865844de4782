"""Parents keyed by several columns: define_derived(..., parent_columns => ...), a composite key type, the
queue's canonical record text, the worker, the recompute, poison keys and the key-type security rules."""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy.exc
from util import drain, not_due, raises_sqlstate, result, snapshot

from lockstep import db as lockstep_db
from lockstep.migrate import migrate

SETUP = """
create table doc (tenant_id int not null, id bigint not null, body text not null default '',
                  primary key (tenant_id, id));
create table doc_word (tenant_id int not null, doc_id bigint not null, word text not null, n int not null,
                       primary key (tenant_id, doc_id, word),
                       foreign key (tenant_id, doc_id) references doc (tenant_id, id)
                           on delete cascade on update cascade);
create table doc_word_nofk (tenant_id int not null, doc_id bigint not null, word text not null,
                            n int not null, primary key (tenant_id, doc_id, word));
create type doc_key as (tenant_id int, id bigint);
create function doc_words(keys doc_key[]) returns table (tenant_id int, doc_id bigint, word text, n int)
language sql stable as $$
    select d.tenant_id, d.id, w, count(*)::int
    from public.doc d, pg_catalog.regexp_split_to_table(d.body, ' ') w
    where w <> '' and (keys is null or (d.tenant_id, d.id) in (select k.tenant_id, k.id from unnest(keys) k))
    group by 1, 2, 3 $$;
create function doc_words_nofk(keys doc_key[]) returns table (tenant_id int, doc_id bigint, word text, n int)
language sql stable as $$ select * from public.doc_words(keys) $$;
-- keys of the wrong shape
create type doc_key_swapped as (id bigint, tenant_id int);
create type doc_key_wide as (tenant_id bigint, id bigint);
create table doc_key_table (tenant_id int, id bigint);
create domain tenant_no as int check (value > 0);
create type doc_key_domain as (tenant_id tenant_no, id bigint);
create type doc_key_cast as (tenant_id int, id bigint);
create cast (doc_key_cast as text) with inout;
"""

# a compute of each shape: the same rows, another argument type
SHAPES = {
    "bigint": "bigint[]",
    "swapped": "doc_key_swapped[]",
    "wide": "doc_key_wide[]",
    "table": "doc_key_table[]",
    "domain": "doc_key_domain[]",
    "cast": "doc_key_cast[]",
}

JOB = "dw"
DOC = "'dw', 'doc_word', 'doc_words(doc_key[])', 'doc'"
COLS = "array['tenant_id', 'doc_id']::name[]"
DEFINE = (
    "select lockstep.define_derived('dw', 'doc_word', 'doc_words(doc_key[])', 'doc',"
    " parent_columns => array['tenant_id', 'doc_id']::name[])"
)


@pytest.fixture
def db(conn: psycopg.Connection) -> psycopg.Connection:
    conn.execute(SETUP)
    for name, arg in SHAPES.items():
        conn.execute(
            f"create function words_{name}(keys {arg}) returns table (tenant_id int, doc_id bigint,"
            " word text, n int) language sql stable as $$ select * from public.doc_words(null) where false $$"
        )
    return conn


@pytest.fixture
def dw(db: psycopg.Connection) -> psycopg.Connection:
    """db with job dw defined, 3 tenants of 4 documents each computed, its recompute not due."""
    db.execute(
        "insert into doc select t, i, 'w' || i || ' t' || t || ' common' from generate_series(1, 3) t,"
        " generate_series(1, 4) i"
    )
    db.execute(DEFINE)
    db.execute(f"select lockstep.recompute('{JOB}')")
    not_due(db, JOB)
    return db


def queue(conn: psycopg.Connection) -> list[str]:
    return [r[0] for r in conn.execute("select key from lockstep.queue order by id")]


def divergence(conn: psycopg.Connection) -> tuple[int, int]:
    """(rows missing or different, rows extra) of doc_word against what doc_words computes now."""
    missing = conn.execute(
        "select count(*) from (select * from doc_words(null) except select * from doc_word) x"
    ).fetchone()[0]
    extra = conn.execute(
        "select count(*) from (select * from doc_word except select * from doc_words(null)) x"
    ).fetchone()[0]
    return missing, extra


# -- define ------------------------------------------------------------------------------------------------


def test_define_records_the_key_columns_and_the_composite_type(db):
    db.execute(DEFINE)
    row = db.execute(
        "select parent_column, parent_key, key_type::text, parent_columns, parent_keys from lockstep.job"
    ).fetchone()
    assert row == (None, None, "doc_key", ["tenant_id", "doc_id"], ["tenant_id", "id"])


def test_define_infers_the_columns_from_the_one_foreign_key(db):
    db.execute("select lockstep.define_derived('dw', 'doc_word', 'doc_words(doc_key[])', 'doc')")
    assert db.execute("select parent_columns from lockstep.job").fetchone() == (["tenant_id", "doc_id"],)


def test_a_one_column_job_has_both_arrays_too(db):
    db.execute("create table p (id bigint primary key)")
    db.execute(
        "create table d (p_id bigint not null references p (id) on delete cascade, k text not null,"
        " primary key (p_id, k))"
    )
    db.execute(
        "create function f(ids bigint[]) returns table (p_id bigint, k text) language sql"
        " as $$ select id, 'k' from public.p where ids is null or id = any(ids) $$"
    )
    db.execute(
        "select lockstep.define_derived('one', 'd', 'f(bigint[])', 'p',"
        " parent_columns => array['p_id']::name[])"
    )
    row = db.execute(
        "select parent_column, parent_key, parent_columns, parent_keys from lockstep.job"
    ).fetchone()
    assert row == ("p_id", "id", ["p_id"], ["id"])


BAD = [
    # (call, sqlstate, message fragment)
    (
        "'dw', 'doc_word', 'doc_words(doc_key[])', 'doc', 'tenant_id',"
        " parent_columns => array['tenant_id', 'doc_id']::name[]",
        "LSD04",
        "together",
    ),
    (
        "'dw', 'doc_word', 'doc_words(doc_key[])', 'doc', parent_columns => array['tenant_id']::name[]",
        "LSD04",
        "must name 2",
    ),
    (
        DOC + ", parent_columns => array['tenant_id', 'nope']::name[]",
        "LSD04",
        "has no column nope",
    ),
    (
        DOC + ", parent_columns => array['doc_id', 'tenant_id']::name[]",
        "LSD04",
        "through a foreign key",
    ),
    ("'dw', 'doc_word', 'doc_words(doc_key[])', 'doc', parent_columns => '{}'::name[]", "LSD04", "empty"),
    # parent_column is the one-column form: for a parent keyed by two columns it was ignored, and recorded
    (DOC + ", parent_column => 'doc_id'", "LSD04", "several columns"),
    (
        "'dw', 'doc_word', parent => 'doc', parent_column => 'doc_id',"
        " query => 'select d.tenant_id, d.id as doc_id, ''w'' as word, 1 as n from public.doc d'",
        "LSD04",
        "several columns",
    ),
    (
        "'dw', 'doc_word', 'doc_words(doc_key[])', null, parent_columns => " + COLS,
        "LSD04",
        "without parent",
    ),
    ("'dw', 'doc_word_nofk', 'doc_words_nofk(doc_key[])', 'doc'", "LSD04", "cannot infer parent_columns"),
    (
        "'dw', 'doc_word_nofk', 'doc_words_nofk(doc_key[])', 'doc', parent_columns => " + COLS,
        "LSD04",
        "through a foreign key",
    ),
    ("'dw', 'doc_word', 'words_bigint(bigint[])', 'doc'", "LSD02", "composite type"),
    ("'dw', 'doc_word', 'words_swapped(doc_key_swapped[])', 'doc'", "LSD02", "composite type"),
    ("'dw', 'doc_word', 'words_wide(doc_key_wide[])', 'doc'", "LSD02", "composite type"),
    ("'dw', 'doc_word', 'words_table(doc_key_table[])', 'doc'", "LSD04", "row type"),
    ("'dw', 'doc_word', 'words_domain(doc_key_domain[])', 'doc'", "LSD02", "composite type"),
    ("'dw', 'doc_word', 'words_cast(doc_key_cast[])', 'doc'", "LSD04", "a cast from or to it"),
]


@pytest.mark.parametrize(
    ("args", "sqlstate", "match"), BAD, ids=[b[2] + "-" + str(i) for i, b in enumerate(BAD)]
)
def test_a_bad_definition_is_refused_and_changes_nothing(db, args, sqlstate, match):
    before = snapshot(db, "doc_word")
    with raises_sqlstate(sqlstate, match):
        db.execute(f"select lockstep.define_derived({args})")
    assert snapshot(db, "doc_word") == before


def test_the_refusal_of_a_wrong_key_type_shows_the_type_to_create(db):
    with raises_sqlstate("LSD02") as info:
        db.execute("select lockstep.define_derived('dw', 'doc_word', 'words_bigint(bigint[])', 'doc')")
    assert info.value.diag.message_hint.startswith("create type doc_key as (tenant_id integer, id bigint);")


def test_a_composite_field_of_a_refused_type_is_refused(db):
    """A domain field's CHECK would run the owner's code wherever lockstep reads a key; a nested composite
    brings its own fields' I/O. Both refused (LSD04), whatever the compute's shape."""
    db.execute("create type inner_key as (id bigint)")
    for field, why in [("tenant_no", "a domain"), ("inner_key", "a composite type")]:
        db.execute(f"create type k_{why[2:4]} as (tenant_id {field}, id bigint)")
        problem = db.execute(f"select lockstep._key_type_problem('k_{why[2:4]}')").fetchone()[0]
        assert problem == f"its field tenant_id is public.{field}, which is {why}"
    assert db.execute("select lockstep._key_type_problem('doc_key')").fetchone()[0] is None
    assert (
        db.execute("select lockstep._key_type_problem('doc_key_table')")
        .fetchone()[0]
        .startswith("a table's row type")
    )


def test_a_cast_created_after_define_stops_every_conversion(dw):
    """The key type is checked again where queued keys are converted: a cast created later fails enqueue
    (LSD04) and the worker's pass (failed, no key converted)."""
    dw.execute("select lockstep.enqueue('dw', array[row(1, 1)]::doc_key[])")
    dw.execute("create cast (doc_key as text) with inout")
    with raises_sqlstate("LSD04", "a cast from or to it"):
        dw.execute("select lockstep.enqueue('dw', array[row(1, 2)]::doc_key[])")
    r = result(dw, "lockstep.work('dw')")
    assert r["outcome"] == "failed" and "a cast from or to it" in r["error"], r
    dw.execute("drop cast (doc_key as text)")
    dw.execute("update lockstep.job_state set retry_at = null")
    assert result(dw, "lockstep.work('dw')")["outcome"] == "done"


# -- the queue -----------------------------------------------------------------------------------------------


def test_enqueue_stores_the_record_text_once_per_key_sorted_by_key(dw):
    n = dw.execute(
        "select lockstep.enqueue('dw', array[row(2, 1), row(1, 10), row(2, 1), row(1, 9)]::doc_key[])"
    )
    assert n.fetchone()[0] == 3
    assert queue(dw) == ["(1,9)", "(1,10)", "(2,1)"]  # record order: field by field, as integers


BAD_KEYS = [
    ("array[row(1, null)]::doc_key[]", "22004", "NULL field"),
    ("array[row(null, null)]::doc_key[]", "22004", "NULL field"),
    ("array[null]::doc_key[]", "22004", "must not contain NULL"),
    ("null::doc_key[]", "22004", "must not be NULL"),
    ("array[1, 2]::bigint[]", "LSQ01", r"public.doc\(tenant_id, id\)"),
    ("array[row(1, 2)]::doc_key_wide[]", "LSQ01", "doc_key"),
]


@pytest.mark.parametrize(("keys", "sqlstate", "match"), BAD_KEYS, ids=[k[0] for k in BAD_KEYS])
def test_bad_keys_are_refused_and_queue_nothing(dw, keys, sqlstate, match):
    with raises_sqlstate(sqlstate, match):
        dw.execute(f"select lockstep.enqueue('dw', {keys})")
    assert queue(dw) == []


def test_text_fields_that_need_quoting_fold_and_are_worked(db):
    """The record text quotes a field with a comma, a quote, a backslash, a space or parentheses; the same
    key enqueued twice, handed off by a recompute and read back by the worker is one text, one parent."""
    db.execute(
        """
        create table acct (org text, no int, label text not null, primary key (org, no));
        create table acct_label (org text not null, no int not null, label text not null,
                                 primary key (org, no),
                                 foreign key (org, no) references acct on delete cascade on update cascade);
        create type acct_key as (org text, no int);
        create function labels(keys acct_key[]) returns table (org text, no int, label text)
            language sql stable as $$ select a.org, a.no, a.label from public.acct a
                  where keys is null or (a.org, a.no) in (select k.org, k.no from unnest(keys) k) $$;
        """
    )
    orgs = ["a,b", 'q"x', "back\\slash", "two words", "(paren)", "", "plain"]
    for i, org in enumerate(orgs):
        db.execute("insert into acct values (%s, %s, %s)", [org, i, f"label {i}"])
    db.execute("select lockstep.define_derived('al', 'acct_label', 'labels(acct_key[])', 'acct')")
    db.execute("select lockstep.set_batch_parents('al', 2)")
    r = result(db, "lockstep.recompute('al')")
    assert r["inserted"] == 2  # the first two parents in key order; the rest handed to the queue
    handed = sorted(queue(db))
    expected = db.execute(
        "select array_agg(k::text order by k) from unnest(%s::text[], %s::int[]) a(o, n),"
        " lateral (select row(a.o, a.n)::acct_key k) x",
        [orgs, list(range(len(orgs)))],
    ).fetchone()[0]
    assert set(handed) < set(expected) and len(handed) == len(orgs) - 2
    assert '("a,b",0)' in expected and '("q""x",1)' in expected and '("",5)' in expected
    # the application enqueues the same keys: one text each, so a pass folds them
    db.execute("select lockstep.enqueue('al', (select array_agg(row(org, no)::acct_key) from acct))")
    folded = db.execute("select key, count(*) from lockstep.queue group by key order by key").fetchall()
    assert {k for k, _ in folded} == set(expected)
    assert all(c == 2 for k, c in folded if k in handed)
    not_due(db, "al")
    drain(db, "al")
    assert queue(db) == []
    assert db.execute("select count(*) from acct_label").fetchone()[0] == len(orgs)


def test_retry_puts_a_composite_key_back(dw):
    dw.execute(
        """
        create function picky(keys doc_key[]) returns table (tenant_id int, doc_id bigint, word text, n int)
        language plpgsql as $$ begin
            if row(2, 3)::public.doc_key = any(keys) then raise exception 'cannot compute (2,3)'; end if;
            return query select * from public.doc_words(keys); end $$;
        """
    )
    dw.execute(
        "select lockstep.define_derived('dw', 'doc_word', 'picky(doc_key[])', 'doc',"
        " parent_columns => array['tenant_id', 'doc_id']::name[])"
    )
    dw.execute("select lockstep.set_max_attempts('dw', 1)")
    not_due(dw, JOB)
    dw.execute("update doc set body = body || ' more' where id in (2, 3)")
    dw.execute(
        "select lockstep.enqueue('dw',"
        " (select array_agg(row(tenant_id, id)::doc_key) from doc where id in (2, 3)))"
    )
    r = result(dw, "lockstep.work('dw')")
    # poison isolation: the other five parents are written, (2,3) alone fails and is parked at once
    assert r["outcome"] == "done" and r["inserted"] == 5 and "cannot compute (2,3)" in r["error"], r
    assert dw.execute("select key, attempts, parked from lockstep.key_failure").fetchall() == [
        ("(2,3)", 1, True)
    ]
    assert result(dw, "lockstep.work('dw')")["outcome"] == "idle"
    dw.execute(DEFINE)  # fixed: the good compute again
    not_due(dw, JOB)
    assert dw.execute("select lockstep.retry('dw', array[row(2, 3)]::doc_key[])").fetchone()[0] == 1
    assert result(dw, "lockstep.work('dw')")["outcome"] == "done"
    assert dw.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0
    assert divergence(dw) == (0, 0)


# -- the worker and the recompute ----------------------------------------------------------------------------


def test_a_worker_pass_writes_updates_and_deletes_of_composite_parents(dw):
    dw.execute("update doc set body = 'fresh words' where tenant_id = 2 and id = 3")
    dw.execute("insert into doc values (3, 1000, 'new doc')")
    dw.execute("delete from doc where tenant_id = 1 and id = 1")
    dw.execute(
        "select lockstep.enqueue('dw', array[row(2, 3), row(3, 1000), row(1, 1), row(9, 9)]::doc_key[])"
    )
    dw.execute("delete from doc where tenant_id = 3 and id = 1000")  # gone before the pass: nothing to do
    dw.execute("insert into doc values (3, 1001, 'late')")
    dw.execute("select lockstep.enqueue('dw', array[row(3, 1001)]::doc_key[])")
    r = result(dw, "lockstep.work('dw')")
    assert (r["outcome"], r["inserted"], r["deleted"]) == ("done", 3, 3), r
    assert queue(dw) == []
    assert divergence(dw) == (0, 0)
    rows = dw.execute("select word from doc_word where tenant_id = 2 and doc_id = 3 order by 1").fetchall()
    assert rows == [("fresh",), ("words",)]


def test_bounded_recompute_batches_go_in_key_order_and_converge(dw):
    """A recompute writes the first batch_parents parents in the key type's order (tenant, then id, as
    numbers) and hands the rest to the queue; parents deleted meanwhile do not stop the worker."""
    dw.execute("truncate doc_word")
    dw.execute("insert into doc select 1, i, 'x' || i from generate_series(5, 12) i")
    dw.execute("select lockstep.set_batch_parents('dw', 5)")
    r = result(dw, "lockstep.recompute('dw')")
    assert r["outcome"] == "done" and r["more"] is True, r
    written = dw.execute(
        "select distinct row(tenant_id, doc_id)::doc_key::text from doc_word order by 1"
    ).fetchall()
    assert [w[0] for w in written] == ["(1,1)", "(1,2)", "(1,3)", "(1,4)", "(1,5)"]
    assert queue(dw)[:3] == ["(1,6)", "(1,7)", "(1,8)"]
    # parents of the hand-off deleted mid-run, one changed: the worker converges
    dw.execute("delete from doc where (tenant_id, id) in ((1, 7), (2, 2), (3, 4))")
    dw.execute("update doc set body = 'changed' where tenant_id = 1 and id = 12")
    drain(dw, JOB, batch=3)
    assert queue(dw) == []
    assert divergence(dw) == (0, 0)
    assert dw.execute("select * from lockstep.verify('dw')").fetchone()[:3] == (0, 0, 0)


def test_a_parent_the_application_holds_is_skipped_and_queued_again(dw, connect, dsn):
    """Pins first, SKIP LOCKED: a parent row the application holds FOR UPDATE (a new derived row needs its
    FK check) is left out of the pass at once and queued again; the other parents are written."""
    dw.execute("insert into doc values (1, 50, 'held'), (1, 51, 'free')")
    app = connect(dsn)
    app.execute("begin")
    app.execute("select from doc where tenant_id = 1 and id = 50 for update")
    dw.execute("select lockstep.enqueue('dw', array[row(1, 50), row(1, 51)]::doc_key[])")
    r = result(dw, "lockstep.work('dw')")
    assert (r["outcome"], r["inserted"], r["skipped"]) == ("done", 1, 1), r
    assert queue(dw) == ["(1,50)"]
    app.execute("rollback")
    dw.execute("update lockstep.queue set ready_at = now()")
    assert result(dw, "lockstep.work('dw')")["inserted"] == 1
    assert divergence(dw) == (0, 0)


def test_status_and_failing_keys_show_the_record_text(dw):
    dw.execute("select lockstep.enqueue('dw', array[row(1, 2)]::doc_key[])")
    assert dw.execute("select queue_depth from lockstep.status where job = 'dw'").fetchone() == (1,)
    dw.execute(
        "insert into lockstep.key_failure (job, key, attempts, retry_at, parked)"
        " values ('dw', '(1,2)', 3, now(), true)"
    )
    assert dw.execute("select key from lockstep.parked_keys").fetchall() == [("(1,2)",)]


def test_queued_texts_of_one_key_fold_and_an_unreadable_one_is_set_aside(dw):
    """Hand-written entries ('(1, 2)', '(01,2)') name the parent (1,2) as its canonical '(1,2)' does: one pass
    takes them all. The worker's fast paths for bigint, integer and text keys do not apply to a record text;
    a text that is no doc_key is set aside with its error, the others are written."""
    dw.execute("update doc set body = 'one two' where tenant_id = 1 and id = 2")
    dw.execute(
        "insert into lockstep.queue (job, key) values ('dw', '(1, 2)'), ('dw', '(01,2)'), ('dw', '(x,2)')"
    )
    dw.execute("select lockstep.enqueue('dw', array[row(1, 2)]::doc_key[])")
    r = result(dw, "lockstep.work('dw')")
    assert r["outcome"] == "done" and r["inserted"] == 2, r
    assert "cannot be read as" in r["error"], r
    assert [k for k in queue(dw) if k != "(x,2)"] == []
    assert divergence(dw) == (0, 0)


def test_the_cli_retry_takes_composite_keys_as_text(dw):
    dw.execute(
        "insert into lockstep.key_failure (job, key, attempts, retry_at, parked)"
        " values ('dw', '(1,2)', 3, now(), true)"
    )
    assert lockstep_db.retry(dw, "dw", ["(1,2)"]) == 1
    assert queue(dw) == ["(1,2)"]
    assert lockstep_db.preview(dw, "dw", ["(1, 2)"]) == []


def function_calls(conn: psycopg.Connection, name: str) -> int:
    """Calls of lockstep.<name> in this transaction (track_functions = all, set by the caller)."""
    return conn.execute(
        "select coalesce(sum(calls), 0) from pg_stat_xact_user_functions"
        " where schemaname = 'lockstep' and funcname = %s",
        [name],
    ).fetchone()[0]


def test_a_pass_converts_its_keys_together_not_one_by_one(dw):
    """Queued composite keys are not of the bigint/integer/text fast paths: their canonical texts were
    found one key at a time, each with its own key-type check (300 keys: 300 checks, seconds per pass). Now
    keys that are canonical already are read back once; _canon checks whether to trim numerics once."""
    dw.execute("insert into doc select 3, i, 'x' from generate_series(100, 399) i")
    dw.execute("select lockstep.enqueue('dw', (select array_agg(row(tenant_id, id)::doc_key) from doc))")
    dw.execute("begin")
    dw.execute("set local track_functions = 'all'")
    assert result(dw, "lockstep.work('dw', 1000)")["inserted"] == 300
    assert function_calls(dw, "_composite_key_problem") < 20
    assert function_calls(dw, "_trims_scale") == function_calls(dw, "_canon")
    dw.execute("commit")


def test_keys_in_canonical_text_are_sorted_by_their_fields_as_they_are(dw):
    """Composite keys of integer fields queued in canonical text (lockstep's own, from the parent) are
    sorted by their fields, and a pass's entries map to themselves: no lockstep._canon, which compares
    whole records and makes their text again; two key-type checks a pass."""
    dw.execute("insert into doc select 3, i, 'x' from generate_series(100, 399) i")
    dw.execute("select lockstep.enqueue('dw', (select array_agg(row(tenant_id, id)::doc_key) from doc))")
    dw.execute("begin")
    dw.execute("set local track_functions = 'all'")
    assert result(dw, "lockstep.work('dw', 1000)")["inserted"] == 300
    assert function_calls(dw, "_canon") == 0
    assert function_calls(dw, "_composite_key_problem") == 2
    dw.execute("commit")
    assert queue(dw) == [] and divergence(dw) == (0, 0)


# texts of keys: canonical (the fast path's), canonical but past its bounds, other texts of a key, no key
FAST_KEYS = {
    "k_small": (
        "(a smallint, b bigint)",
        ["(1,2)", "(-1,2)", "(0,0)", "(9999,999999999999999999)", "(-9999,-999999999999999999)", "(1,2)"],
        [
            "(10000,2)",
            "(-32768,-9223372036854775808)",
            "(01,2)",
            "(1, 2)",
            "( 1,2)",
            "(+1,2)",
            "(-0,2)",
            '("1",2)',
            "(1,2) ",
            "(,2)",
            "(1,)",
        ],
        ["(1,2)x", "(1,2),(3,4)", "(1,2);(3,4)", "(x,2)", "(40000,2)", "(1,2,3)", "1,2", ""],
    ),
    "k_uuid": (
        "(t int, u uuid)",
        ["(1,a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11)", "(-7,00000000-0000-0000-0000-000000000000)"],
        [
            "(1,A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11)",
            "(1,{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11})",
            "(1,a0eebc999c0b4ef8bb6d6bb9bd380a11)",
            "(1000000000,a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11)",
        ],
        ["(1,a0eebc99)", "(1,a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11;)"],
    ),
    "k_text": ("(t int, s text)", ["(1,a)", "(2,b)"], ['(1,"a")', "(1, a)"], ["(x,a)"]),
}


@pytest.mark.parametrize("name", list(FAST_KEYS))
def test_keys_in_canonical_text_read_back_as_the_record_text_does(dw, name):
    """The canonical texts lockstep._sorted_keys, ._readable and ._canon_each give are lockstep._canon's
    (the record text), for texts the fast path takes and those it leaves to _canon, alone and together."""
    fields, fast, other, bad = FAST_KEYS[name]
    dw.execute(f"create type {name} as {fields}")
    job = "jsonb_populate_record(j, jsonb_build_object('key_type', %s::regtype::text))"
    one = f"(select {job} from lockstep.job j where j.job = 'dw')"

    def canon(keys: list[str]) -> list[str]:
        return dw.execute(f"select lockstep._canon(%s::text[]::{name}[])", [keys]).fetchone()[0]

    def sql(call: str, keys: list[str]):
        return dw.execute(f"select {call}", [name, keys]).fetchone()[0]

    assert dw.execute("select lockstep._key_pattern(%s::regtype) is null", [name]).fetchone()[0] == (
        name == "k_text"
    )
    readable = fast + other
    assert sql(f"lockstep._sorted_keys({one}, %s)", fast) == canon(fast)
    assert sql(f"(lockstep._readable({one}, %s)).canon", fast) == canon(fast)
    assert sql(f"lockstep._canon_each({one}, %s)", fast) == fast
    assert sql(f"lockstep._sorted_keys({one}, %s)", readable) == canon(readable)
    assert sql(f"(lockstep._readable({one}, %s)).canon", readable + bad) == canon(readable)
    assert sql(f"(lockstep._readable({one}, %s)).bad", readable + bad) == bad
    each = [(canon([k]) or [None])[0] for k in readable] + [None] * len(bad)
    assert sql(f"lockstep._canon_each({one}, %s)", readable + bad) == each
    for k in readable:
        assert sql(f"(lockstep._readable({one}, %s)).canon", [k]) == canon([k])
        assert sql(f"lockstep._canon_each({one}, %s)", [k]) == [(canon([k]) or [None])[0]]


def test_keys_in_canonical_text_are_not_read_back_under_a_refused_key_type(dw):
    """The fast path converts keys too: a cast created after define refuses it (LSD04) as it does _canon."""
    dw.execute("create cast (doc_key as text) with inout")
    one = "(select j from lockstep.job j where j.job = 'dw')"
    for call in (f"lockstep._sorted_keys({one}, %s)", f"lockstep._readable({one}, %s)"):
        with raises_sqlstate("LSD04", "a cast from or to it"):
            dw.execute(f"select {call}", [["(1,2)", "(1,3)"]])


def test_compute_gets_a_composite_key_array_cast_once(dw):
    """Record input is not immutable: a cast of $1 inlined into compute's filter was evaluated per parent
    row (110 s for 500 keys over 200,000 parents). The array is cast in a scalar subquery."""
    sql = dw.execute("select lockstep._compute_sql(j) from lockstep.job j").fetchone()[0]
    assert sql == "(select * from public.doc_words((select $1::public.doc_key[])) offset 0)"


def test_a_target_that_also_references_the_tenant_pins_both(db, connect, dsn):
    """A multi-tenant target references its parent by (tenant_id, doc_id) and the tenant by tenant_id: the
    parent's foreign key is told apart (pinned in step 1), the tenant's is pinned as another reference
    (step 2). An application holding the tenant row leaves that tenant's new rows out, without a wait."""
    db.execute(
        """
        create table tenant (id int primary key);
        insert into tenant values (1), (2);
        create table doc_word_t (tenant_id int not null references tenant on delete cascade,
                                 doc_id bigint not null, word text not null, n int not null,
                                 primary key (tenant_id, doc_id, word),
                                 foreign key (tenant_id, doc_id) references doc
                                     on delete cascade on update cascade);
        create function words_t(keys doc_key[]) returns table (tenant_id int, doc_id bigint, word text, n int)
            language sql stable as $$ select * from public.doc_words(keys) $$;
        insert into doc values (1, 1, 'a b'), (2, 1, 'c d');
        """
    )
    db.execute("select lockstep.define_derived('dt', 'doc_word_t', 'words_t(doc_key[])', 'doc')")
    assert db.execute("select parent_columns from lockstep.job").fetchone() == (["tenant_id", "doc_id"],)
    not_due(db, "dt")
    app = connect(dsn)
    app.execute("begin")
    app.execute("select from tenant where id = 2 for update")
    db.execute("select lockstep.enqueue('dt', array[row(1, 1), row(2, 1)]::doc_key[])")
    r = result(db, "lockstep.work('dt')")
    assert (r["outcome"], r["inserted"], r["skipped"]) == ("done", 2, 1), r
    assert queue(db) == ["(2,1)"]
    app.execute("rollback")
    db.execute("update lockstep.queue set ready_at = now()")
    assert result(db, "lockstep.work('dt')")["inserted"] == 2


def test_the_upgrade_fills_the_arrays_and_the_downgrade_waits_for_composite_jobs(empty_dsn):
    """A one-column job of revision 0001 gets both arrays from the upgrade. Revision 0001 cannot run a job
    keyed by several columns: the downgrade is refused (55000) while one exists, then goes through."""
    migrate(empty_dsn, "lockstep_0001")
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        c.execute(SETUP)
        c.execute("create table p (id bigint primary key)")
        c.execute("create table d (p_id bigint not null references p on delete cascade, primary key (p_id))")
        c.execute(
            "create function f(ids bigint[]) returns table (p_id bigint) language sql"
            " as $$ select id from public.p where ids is null or id = any(ids) $$"
        )
        c.execute("select lockstep.define_derived('one', 'd', 'f(bigint[])', 'p')")
    migrate(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        row = c.execute("select parent_columns, parent_keys from lockstep.job where job = 'one'").fetchone()
        assert row == (["p_id"], ["id"])
        c.execute(DEFINE)
    with pytest.raises(sqlalchemy.exc.OperationalError, match="composite parent key") as info:
        migrate(empty_dsn, "lockstep_0001", downgrade=True)
    assert info.value.orig.sqlstate == "55000"  # sqlalchemy's error around psycopg's
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        assert c.execute("select count(*) from lockstep.job").fetchone()[0] == 2
        c.execute("select lockstep.drop_job('dw')")
    migrate(empty_dsn, "lockstep_0001", downgrade=True)
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        assert c.execute("select job from lockstep.job").fetchall() == [("one",)]


def test_composite_key_probes_use_the_indexes(dw):
    """The SQL the helpers write matches a composite key field by field: the target's rows of a few keys
    and the parents to pin are index scans, never a scan of the table (a row(...) = any(...) would be)."""
    dw.execute(
        "insert into doc select t, i, 'w' || i from generate_series(1, 20) t, generate_series(5, 500) i"
    )
    dw.execute("select lockstep.recompute('dw')")
    drain(dw, JOB)
    dw.execute("analyze doc, doc_word")
    keys = "array['(1,7)', '(2,9)']::text[]"
    probe_sql = "select t.* from %s, lateral (select t.word from doc_word t where %s offset 0) t"
    pin_sql = "select r.id from doc r where %s order by %s for key share of r skip locked"
    probe, pin = dw.execute(
        "select pg_catalog.format(%s, lockstep._key_unnest(j, %s), lockstep._key_match(j, 't', 'k.v')),"
        " pg_catalog.format(%s, lockstep._key_in(j, 'r', %s, j.parent_keys),"
        "                   lockstep._key_expr(j, 'r', j.parent_keys))"
        " from lockstep.job j",
        [probe_sql, keys, pin_sql, keys + "::doc_key[]"],
    ).fetchone()
    for stmt, table in [(probe, "doc_word"), (pin, "doc")]:
        plan = "\n".join(r[0] for r in dw.execute(f"explain {stmt}"))
        assert f"Seq Scan on {table}" not in plan and "Index" in plan, plan
    assert sorted(dw.execute(probe).fetchall()) == [("w7",), ("w9",)]


def test_a_key_field_named_like_locksteps_own_alias_is_read_as_a_field(conn):
    """A composite key's fields were matched as (lockstep_k).f over unnest(keys) lockstep_k: a field named
    lockstep_k is a column of that alias, which a bare lockstep_k reads first, so every pass over keys
    failed (42809: column notation applied to a bigint)."""
    conn.execute(
        "create table doc (tenant_id int not null, lockstep_k bigint not null, body text not null default '',"
        " primary key (tenant_id, lockstep_k));"
        " create table doc_len (tenant_id int not null, doc_id bigint not null, n int not null,"
        " primary key (tenant_id, doc_id), foreign key (tenant_id, doc_id) references doc on delete cascade);"
        " create type doc_key as (tenant_id int, lockstep_k bigint);"
        " create function doc_lens(keys doc_key[]) returns table (tenant_id int, doc_id bigint, n int)"
        " language sql stable as $$ select d.tenant_id, d.lockstep_k, length(d.body) from public.doc d"
        " where keys is null or (d.tenant_id, d.lockstep_k) in (select k.tenant_id, k.lockstep_k"
        " from unnest(keys) k) $$;"
        " insert into doc select t, i, 'x' from generate_series(1, 2) t, generate_series(1, 3) i"
    )
    conn.execute(
        "select lockstep.define_derived('dl', 'doc_len', 'doc_lens(doc_key[])', 'doc',"
        " parent_columns => array['tenant_id', 'doc_id']::name[])"
    )
    assert result(conn, "lockstep.recompute('dl')")["outcome"] == "done"
    conn.execute(
        "select lockstep.watch('dl', 'doc', key_columns => array['tenant_id', 'lockstep_k']::name[])"
    )
    conn.execute("update doc set body = 'yyy' where tenant_id = 2 and lockstep_k = 3")
    conn.execute("update lockstep.queue set ready_at = now()")
    r = result(conn, "lockstep.work('dl')")
    assert (r["outcome"], r["error"], r["updated"]) == ("done", None, 1), r
    assert conn.execute("select n from doc_len where tenant_id = 2 and doc_id = 3").fetchone()[0] == 3
    assert conn.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
