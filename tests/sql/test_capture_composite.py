"""watch(job, source, key_columns => ..., via => 'wal'): a composite parent key watched through the WAL, on
a throw-away wal_level = logical cluster (tests/wal_cluster.py). The capture queues the record text the
triggers of a watch() by key_columns queue (the same statements, run on a copy watched by triggers), for
inserts, updates that move a row to another key, deletes, a partitioned table and awkward text; watch()
refuses what the WAL could not follow, changing nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pg_cluster
import psycopg
import pytest
import sqlalchemy
import wal_cluster
from util import drain, raises_sqlstate, snapshot

from lockstep.migrate import migrate

pytestmark = pytest.mark.skipif(not pg_cluster.AVAILABLE, reason=pg_cluster.MISSING)

# one copy per schema: t watched by triggers (job ds_t), w through the WAL (job ds_w)
COPY = """
create schema {s};
create table {s}.doc (tenant text not null, id bigint not null, body text not null default '',
                      primary key (tenant, id));
create table {s}.note (id bigint generated always as identity primary key, tenant varchar(20) not null,
                       doc_id int, body text not null,
                       foreign key (tenant, doc_id) references {s}.doc (tenant, id)
                           on delete cascade on update cascade);
create table {s}.mark (tenant text not null, doc_id bigint not null, id int not null, body text,
                       primary key (tenant, doc_id, id)) partition by list (tenant);
create table {s}.mark_a partition of {s}.mark for values in ('a b', 'x,y');
create table {s}.mark_rest partition of {s}.mark default;
create table {s}.doc_stat (tenant text not null, doc_id bigint not null, notes bigint not null,
                           marks bigint not null, primary key (tenant, doc_id),
                           foreign key (tenant, doc_id) references {s}.doc (tenant, id) on delete cascade);
create function {s}.doc_stats(keys public.doc_key[])
returns table (tenant text, doc_id bigint, notes bigint, marks bigint)
language sql stable as $$
    select d.tenant, d.id,
           (select count(*) from {s}.note n where n.tenant = d.tenant and n.doc_id = d.id),
           (select count(*) from {s}.mark m where m.tenant = d.tenant and m.doc_id = d.id)
    from {s}.doc d
    where keys is null or (d.tenant, d.id) in (select k.tenant, k.id from unnest(keys) k) $$;
insert into {s}.doc select t, i, 'd' from unnest(array[{tenants}]) t, generate_series(1, 3) i;
select lockstep.define_derived('ds_{s}', '{s}.doc_stat', '{s}.doc_stats(public.doc_key[])', '{s}.doc',
                               every => '1 year');
"""
# tenants whose record text is quoted: a space, a comma, a quote, a backslash, parentheses, empty, an
# ideographic space (not a space to record_out), a tab
TENANTS = ["a b", "x,y", 'q"t', "b\\s", "(p)", "", "ü", "\u3000", "t\tt"]
NOTE = "array['tenant', 'doc_id']::name[]"
DOC = "array['tenant', 'id']::name[]"
MARK = "array['tenant', 'doc_id']::name[]"

CHANGES = [
    "insert into {s}.note (tenant, doc_id, body) values ('a b', 1, 'n'), ('x,y', 2, 'n'), ('', 1, 'n'),"
    " ('q\"t', null, 'n'), ('\u3000', 3, 'n'), ('t\tt', 2, 'n')",
    "update {s}.note set doc_id = 2 where tenant = 'a b'",  # moved: the old key and the new
    "update {s}.note set body = body || '!' where tenant = 'x,y'",  # the same key
    "insert into {s}.doc values ('(p)', 10), ('', 10)",
    "insert into {s}.note (tenant, doc_id, body) values ('', 10, 'n')",
    "update {s}.doc set id = 11 where tenant = '(p)' and id = 10",  # the parent's own key
    "update {s}.doc set id = 12 where tenant = '' and id = 10",  # cascades to its note
    "delete from {s}.note where tenant = '\u3000'",
    "delete from {s}.doc where tenant = 'b\\s' and id = 3",
    "update {s}.note set doc_id = null where tenant = 'x,y'",  # a NULL field: the old key only
    "update {s}.note set tenant = 'ü', doc_id = 1 where tenant = 't\tt'",
    "insert into {s}.mark values ('a b', 1, 1), ('x,y', 2, 1), ('ü', 3, 1), ('', 2, 1)",
    "update {s}.mark set tenant = 'ü' where tenant = 'a b'",  # to the other partition
    "update {s}.mark set doc_id = 3 where tenant = 'x,y'",  # within its partition
    "delete from {s}.mark where tenant = ''",
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[pg_cluster.Cluster]:
    with wal_cluster.running() as c:
        yield c


@pytest.fixture
def c(cluster: pg_cluster.Cluster) -> Iterator[psycopg.Connection]:
    """Both copies, converged; nothing watched yet."""
    with wal_cluster.database(cluster, watched=False) as dsn, wal_cluster.connect(dsn) as conn:
        conn.execute("create type public.doc_key as (tenant text, id bigint)")
        tenants = ", ".join(
            conn.execute("select quote_literal(%s::text)", [t]).fetchone()[0] for t in TENANTS
        )
        for s in ["t", "w"]:
            conn.execute(COPY.format(s=s, tenants=tenants))
            conn.execute("select lockstep.recompute(%s)", [f"ds_{s}"])
        yield conn


def watch(c: psycopg.Connection, s: str, table: str, cols: str, via: str) -> None:
    c.execute(f"select lockstep.watch('ds_{s}', '{s}.{table}', key_columns => {cols}, via => '{via}')")


def watch_both(c: psycopg.Connection) -> None:
    """t by triggers, w through the WAL; the slot made; nothing queued or flagged."""
    c.execute("alter table w.note replica identity full")  # its primary key is id alone
    for table, cols in [("note", NOTE), ("doc", DOC), ("mark", MARK)]:
        watch(c, "t", table, cols, "trigger")
        watch(c, "w", table, cols, "wal")
    c.execute("select lockstep.capture()")
    c.execute("delete from lockstep.queue")
    c.execute("delete from lockstep.recompute_flag")


def queued(c: psycopg.Connection, job: str) -> list[str]:
    return [
        k for (k,) in c.execute("select distinct key from lockstep.queue where job = %s order by 1", [job])
    ]


def flags(c: psycopg.Connection) -> list[str]:
    return [p for (p,) in c.execute("select problem from lockstep.recompute_flag order by flagged_at")]


def divergence(c: psycopg.Connection, s: str) -> int:
    return c.execute(
        f"select count(*) from ((select * from {s}.doc_stat except select * from {s}.doc_stats(null))"
        f" union all (select * from {s}.doc_stats(null) except select * from {s}.doc_stat)) d"
    ).fetchone()[0]


def test_the_capture_queues_the_keys_the_triggers_queue(c):
    watch_both(c)
    assert (
        c.execute(
            "select count(*) from pg_trigger where tgrelid = 'w.note'::regclass and not tgisinternal"
        ).fetchone()[0]
        == 0
    )
    for sql in CHANGES:
        for s in ["t", "w"]:
            c.execute(sql.format(s=s))
    assert queued(c, "ds_w") == []  # no trigger
    r = c.execute("select outcome, flagged from lockstep.capture()").fetchone()
    assert r == ("done", 0), flags(c)
    expected = queued(c, "ds_t")
    assert queued(c, "ds_w") == expected
    for key in ['("a b",1)', '("a b",2)', '("",10)', '("",12)', '("(p)",10)', '("(p)",11)', '("b\\\\s",3)']:
        assert key in expected, (key, expected)
    assert '("t\tt",2)' in expected and "(ü,1)" in expected
    assert not any(k.startswith('("q""t"') for k in expected)  # its doc_id is NULL: no key
    for s in ["t", "w"]:
        drain(c, f"ds_{s}")
        assert divergence(c, s) == 0
    assert c.execute("select outcome from lockstep.capture()").fetchone()[0] == "idle"


def test_a_replica_identity_without_every_key_column_is_refused_and_changes_nothing(c):
    before = snapshot(c)
    with raises_sqlstate(
        "55000", match=r"replica identity of w.note does not hold columns \(tenant, doc_id\)"
    ) as e:
        watch(c, "w", "note", NOTE, "wal")
    assert (
        "REPLICA IDENTITY FULL" in e.value.diag.message_hint and "tenant, doc_id" in e.value.diag.message_hint
    )
    # a unique index on them, made the replica identity, is enough
    c.execute("alter table w.note alter column doc_id set not null")
    c.execute("create unique index note_key on w.note (tenant, doc_id, id)")
    c.execute("alter table w.note replica identity using index note_key")
    # each partition's own: the root's does not reach them
    c.execute("alter table w.mark_rest replica identity using index mark_rest_pkey")
    c.execute("alter table w.mark_a replica identity nothing")
    with raises_sqlstate(
        "55000", match=r"replica identity of w.mark_a does not hold columns \(tenant, doc_id\)"
    ):
        watch(c, "w", "mark", MARK, "wal")
    assert snapshot(c) == before
    watch(c, "w", "note", NOTE, "wal")
    c.execute("select lockstep.capture()")
    c.execute("delete from lockstep.recompute_flag")
    c.execute("update w.note set doc_id = 2 where tenant = 'a b'")  # no note yet: insert, move, delete
    c.execute("insert into w.note (tenant, doc_id, body) values ('a b', 1, 'n')")
    c.execute("update w.note set doc_id = 3")
    c.execute("delete from w.note")
    assert c.execute("select flagged from lockstep.capture()").fetchone()[0] == 0
    assert queued(c, "ds_w") == ['("a b",1)', '("a b",3)']


def test_columns_whose_text_is_not_the_fields_are_refused_and_change_nothing(c):
    c.execute("create domain public.tenant_text as text")
    c.execute(
        "create table w.odd (id int primary key, tenant public.tenant_text not null, doc_id int not null)"
    )
    c.execute("alter table w.odd replica identity full")
    before = snapshot(c)
    with raises_sqlstate(
        "LSQ01",
        match="w.odd.tenant is public.tenant_text, and field tenant of the key type public.doc_key is text",
    ):
        watch(c, "w", "odd", MARK, "wal")
    c.execute(
        "create table w.gen (id int primary key, tenant text not null,"
        " doc_id bigint generated always as (id % 3 + 1) stored)"
    )
    c.execute("alter table w.gen replica identity full")
    with raises_sqlstate("55000", match="w.gen.doc_id is a generated column"):
        watch(c, "w", "gen", MARK, "wal")
    with raises_sqlstate("0A000", match="not through another"):
        c.execute(
            "select lockstep.watch('ds_w', 'w.note', key_columns => array['tenant', 'doc_id']::name[],"
            " through => 'w.doc', through_column => 'id', via => 'wal')"
        )
    with raises_sqlstate("22023", match="not a way to watch"):
        watch(c, "w", "doc", DOC, "logical")
    assert snapshot(c) == before
    assert c.execute("select count(*) from pg_publication").fetchone()[0] == 0


def test_a_renamed_key_column_flags_the_job_and_the_capture_goes_on(c):
    watch_both(c)
    c.execute("insert into w.note (tenant, doc_id, body) values ('a b', 1, 'n')")
    c.execute("alter table w.note rename column doc_id to document_id")
    c.execute("insert into w.note (tenant, document_id, body) values ('x,y', 1, 'n')")
    c.execute("update w.doc set body = 'y' where tenant = 'ü' and id = 2")
    r = c.execute("select flagged from lockstep.capture()").fetchone()
    assert r == (1,)
    assert flags(c) == ["column doc_id of w.note is not in its WAL records (renamed or dropped)"]
    assert queued(c, "ds_w") == ['("a b",1)', "(ü,2)"]


def test_switching_a_composite_watch_between_triggers_and_the_wal(c):
    watch(c, "w", "doc", DOC, "trigger")
    assert (
        c.execute(
            "select count(*) from pg_trigger where tgrelid = 'w.doc'::regclass and not tgisinternal"
        ).fetchone()[0]
        == 4
    )
    watch(c, "w", "doc", DOC, "wal")
    assert c.execute(
        "select key_column, key_columns from lockstep.wal_watch where source = 'w.doc'::regclass"
    ).fetchone() == ("tenant", ["tenant", "id"])
    # only the foreign keys' internal triggers are left
    assert (
        c.execute(
            "select count(*) from pg_trigger where tgrelid = 'w.doc'::regclass and not tgisinternal"
        ).fetchone()[0]
        == 0
    )
    c.execute("select lockstep.capture()")
    c.execute("delete from lockstep.recompute_flag")
    c.execute("update w.doc set body = 'z' where tenant = 'x,y' and id = 2")
    c.execute("select lockstep.capture()")
    assert queued(c, "ds_w") == ['("x,y",2)']
    watch(c, "w", "doc", DOC, "trigger")
    assert c.execute("select count(*) from lockstep.wal_watch").fetchone()[0] == 0
    assert c.execute("select count(*) from pg_publication").fetchone()[0] == 0


def test_a_partition_attached_with_its_columns_in_another_order_is_followed(c):
    watch_both(c)
    c.execute(
        "create table w.mark_z (body text, gone int, id int not null, doc_id bigint not null,"
        " tenant text not null, primary key (tenant, doc_id, id));"
        " alter table w.mark_z drop column gone;"
        " insert into w.doc values ('zz', 1), ('zz', 2);"
        " alter table w.mark attach partition w.mark_z for values in ('zz')"
    )
    assert c.execute("select flagged from lockstep.capture()").fetchone()[0] == 1  # its rows joined unseen
    c.execute("select lockstep.recompute('ds_w')")
    c.execute("delete from lockstep.queue")
    c.execute("insert into w.mark (tenant, doc_id, id, body) values ('zz', 1, 1, 'm')")
    c.execute("update w.mark set doc_id = 2 where tenant = 'zz'")  # the old key and the new
    c.execute("update w.mark set tenant = 'x,y' where tenant = 'zz'")  # to another partition
    assert c.execute("select flagged from lockstep.capture()").fetchone()[0] == 0
    assert queued(c, "ds_w") == ['("x,y",2)', "(zz,1)", "(zz,2)"]
    drain(c, "ds_w")
    assert divergence(c, "w") == 0


def test_the_downgrade_is_refused_while_a_composite_key_is_watched_and_changes_nothing(c):
    watch(c, "w", "doc", DOC, "wal")
    c.execute("select lockstep.capture()")
    before = snapshot(c)
    slots = "select count(*) from pg_replication_slots where database = current_database()"
    assert c.execute(slots).fetchone()[0] == 1
    with pytest.raises(sqlalchemy.exc.OperationalError, match="composite parent key") as info:
        migrate(c.info.dsn, "lockstep_0001", downgrade=True)
    assert info.value.orig.sqlstate == "55000"  # sqlalchemy's error around psycopg's
    assert snapshot(c) == before
    assert c.execute(slots).fetchone()[0] == 1
    assert c.execute("select count(*) from pg_publication_tables where tablename = 'doc'").fetchone()[0] == 1
