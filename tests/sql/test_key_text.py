"""One canonical queue text per parent key, whatever queued it: a generated trigger, the shared trigger's
fast and general paths, enqueue(), the CLI's conversion, a watch through a join and a recompute's hand-off."""

from __future__ import annotations

import psycopg
import pytest

# parent key column type, a parent key below the one followed, the one followed, and (column type, that
# key spelled otherwise) of the other tables that feed the job
CASES = {
    "smallint": ("smallint", "1", "7", [("smallint", "7")]),
    "integer": ("integer", "1", "7", [("smallint", "7"), ("integer", "007")]),
    "bigint": ("bigint", "1", "7", [("integer", "7"), ("bigint", "+7")]),
    "numeric": (
        "numeric(10,2)",
        "0.5",
        "1.00",
        [("numeric", "1.000"), ("integer", "1"), ("numeric(10,2)", "1")],
    ),
    "text": ("text", "a", "k 1", [("character varying", "k 1")]),
    "uuid": (
        "uuid",
        "00000000-0000-0000-0000-000000000001",
        "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        [("uuid", "A0EEBC999C0B4EF8BB6D6BB9BD380A11")],
    ),
    "date": ("date", "2000-01-01", "2024-02-03", [("date", "3 Feb 2024")]),
    "timestamptz": (
        "timestamptz",
        "2000-01-01 00:00:00+00",
        "2024-02-03 04:05:06.5+00",
        [("timestamptz", "2024-02-03 06:05:06.500+02")],
    ),
    "enum": ("hue", "red", "green", [("hue", "green")]),
}


def _setup(conn: psycopg.Connection, ktype: str, others: list[tuple[str, str]]) -> None:
    conn.execute("create type hue as enum ('red', 'green')")
    conn.execute(f"create table p (id {ktype} primary key, body text not null default '')")
    conn.execute(
        f"create table t (p_id {ktype} primary key references p on delete cascade on update cascade,"
        " n int not null)"
    )
    arg = ktype.split("(")[0]
    conn.execute(
        f"create function t_compute(keys {arg}[]) returns table (p_id {arg}, n int) language sql stable as $$"
        " select p.id, length(p.body) from public.p where keys is null or p.id = any(keys) $$"
    )
    conn.execute(f"create table m (id int primary key, p_id {ktype} not null)")  # a join to the parent
    conn.execute("create table s_thr (id int primary key, m_id int not null references m)")
    for i, (ctype, _) in enumerate(others):
        conn.execute(f"create table s{i} (id int primary key, p_id {ctype})")


@pytest.mark.parametrize("case", list(CASES))
def test_every_path_queues_one_text_per_key(conn: psycopg.Connection, case: str) -> None:
    ktype, first, value, others = CASES[case]
    conn.execute("set datestyle = 'SQL, DMY'; set timezone = 'Asia/Tokyo'; set extra_float_digits = 0")
    _setup(conn, ktype, others)
    key = ktype.split("(")[0]
    conn.execute("insert into p values (%s), (%s)", [first, value])
    conn.execute("insert into m values (1, %s)", [value])
    conn.execute(f"select lockstep.define_derived('kt', 't', 't_compute({key}[])', 'p')")
    conn.execute("select lockstep.recompute('kt')")
    conn.execute("select lockstep.watch('kt', 's_thr', 'm_id', through => 'm', through_column => 'p_id')")
    for i in range(len(others)):
        conn.execute(f"select lockstep.watch('kt', 's{i}', 'p_id')")  # a generated trigger where it can
        # the shared trigger: its fast path (a third argument) where the types allow, and its general path
        conn.execute(f"alter table s{i} rename to s{i}_w; create table s{i} (like s{i}_w)")
        conn.execute(
            f"create trigger f after insert on s{i} referencing new table as lockstep_new for each statement"
            f" execute function lockstep.enqueue_trigger('kt', 'p_id', '{key}')"
        )
        conn.execute(
            f"create trigger g after insert on s{i} referencing new table as other for each statement"
            " execute function lockstep.enqueue_trigger('kt', 'p_id')"
        )
    generated = conn.execute(
        "select count(*) from pg_trigger where tgfoid::regproc::text like 'lockstep.enqueue\\_w\\_%'"
        " and tgrelid <> 's_thr'::regclass"  # a direct watch's; a watch through a join has its own generator
    ).fetchone()[0]
    assert (generated > 0) == (key in ("smallint", "integer", "bigint", "numeric", "text", "uuid")), generated
    conn.execute("delete from lockstep.queue; delete from lockstep.recompute_flag")

    canon = conn.execute(f"select (lockstep._canon(array[%s::{key}]))[1]", [value]).fetchone()[0]
    for i, (_, spelled) in enumerate(others):
        conn.execute(f"insert into s{i} values (1, %s)", [spelled])
        conn.execute(f"insert into s{i}_w values (1, %s)", [spelled])
    conn.execute("insert into s_thr values (1, 1)")
    spelled = others[-1][1]
    conn.execute(f"select lockstep.enqueue('kt', array[%s::{key}])", [spelled])
    cli = f"lockstep._keys_from_text('kt', array[%s], null::{key}[])"  # the CLI's conversion (db._typed_keys)
    conn.execute(f"select lockstep.enqueue('kt', {cli})", [spelled])
    assert conn.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0
    queued = conn.execute("select array_agg(distinct key) from lockstep.queue").fetchone()[0]
    assert queued == [canon]

    # a recompute hands the parents past its batch to the queue
    conn.execute("delete from lockstep.queue")
    conn.execute("select lockstep.set_batch_parents('kt', 1)")
    conn.execute("update p set body = body || 'changed'")
    conn.execute("delete from lockstep.queue")
    conn.execute("select lockstep.recompute('kt')")
    handed = conn.execute("select array_agg(distinct key) from lockstep.queue").fetchone()[0]
    assert handed == [canon]


def test_a_composite_keys_numeric_field_has_one_text(conn: psycopg.Connection) -> None:
    """A composite key's numeric field kept its trailing zeros: enqueue() of (1,1) and (1.000,1) and a watch
    of numeric(10,2) columns queued three texts for one parent."""
    conn.execute(
        "create table p (a numeric(10,2) not null, b int not null, body text not null default '',"
        " primary key (a, b));"
        " create table t (a numeric(10,2) not null, b int not null, n int not null, primary key (a, b),"
        " foreign key (a, b) references p on delete cascade);"
        " create type pk as (a numeric, b int);"
        " create function t_c(keys pk[]) returns table (a numeric, b int, n int) language sql stable as $$"
        " select p.a, p.b, length(p.body) from public.p"
        " where keys is null or (p.a, p.b) in (select k.a, k.b from unnest(keys) k) $$;"
        " create table s (id int primary key, a numeric(10,2), b int);"
        " insert into p values (0.5, 1), (1, 1)"
    )
    conn.execute(
        "select lockstep.define_derived('kc', 't', 't_c(pk[])', 'p',"
        " parent_columns => array['a', 'b']::name[])"
    )
    conn.execute("select lockstep.recompute('kc')")
    conn.execute("select lockstep.watch('kc', 's', key_columns => array['a', 'b']::name[])")
    conn.execute("delete from lockstep.queue; delete from lockstep.recompute_flag")
    conn.execute("insert into s values (1, 1, 1)")
    conn.execute("select lockstep.enqueue('kc', array[row(1, 1), row(1.000, 1)]::pk[])")
    conn.execute("select lockstep.enqueue('kc', array[row(1.0, 1)]::pk[])")
    assert conn.execute("select array_agg(distinct key) from lockstep.queue").fetchone()[0] == ["(1,1)"]
    conn.execute("delete from lockstep.queue")
    conn.execute("select lockstep.set_batch_parents('kc', 1)")
    conn.execute("update p set body = 'changed'")
    conn.execute("delete from lockstep.queue")
    conn.execute("select lockstep.recompute('kc')")  # (1.00,1) handed off
    assert conn.execute("select array_agg(distinct key) from lockstep.queue").fetchone()[0] == ["(1,1)"]
    conn.execute("update lockstep.queue set ready_at = now()")
    assert conn.execute("select (lockstep.work('kc')).outcome").fetchone()[0] == "done"
    assert conn.execute("select n from t where a = 1 and b = 1").fetchone()[0] == len("changed")
