"""Watches through a join: a source one hop below the parent (order lines of orders of customers) queues
the parent keys its changed rows map to, old and new, never fails the application, and a column that does
not lead to the parent is refused at watch() time."""

from __future__ import annotations

import psycopg
import pytest
from util import drain, raises_sqlstate

SHOP = """
create schema shop;
create table shop.customer (id bigint primary key, name text not null);
create table shop.orders (id bigint primary key,
                          customer_id bigint not null references shop.customer (id) on delete cascade);
create table shop.order_line (id bigint primary key,
                              order_id bigint not null references shop.orders (id) on delete cascade,
                              amount integer not null);
create table shop.customer_total (
    customer_id bigint primary key references shop.customer (id) on delete cascade,
    total bigint not null, lines bigint not null);
create function shop.customer_total_compute(ids bigint[])
returns table (customer_id bigint, total bigint, lines bigint) language sql stable as $$
    select c.id, coalesce(sum(l.amount), 0)::bigint, count(l.id)
    from shop.customer c left join shop.orders o on o.customer_id = c.id
    left join shop.order_line l on l.order_id = o.id
    where ids is null or c.id = any(ids)
    group by c.id $$;
insert into shop.customer select g, 'c' || g from generate_series(1, 5) g;
insert into shop.orders select g, 1 + g % 5 from generate_series(1, 20) g;
insert into shop.order_line select g, 1 + g % 20, g from generate_series(1, 100) g;
select lockstep.define_derived('totals', 'shop.customer_total', 'shop.customer_total_compute(bigint[])',
                               parent => 'shop.customer');
select lockstep.recompute('totals');
"""

DIVERGENCE = """
select count(*) from (
    (select * from shop.customer_total except select * from shop.customer_total_compute(null))
    union all
    (select * from shop.customer_total_compute(null) except select * from shop.customer_total)) d
"""


# the triggers of the watch of shop.order_line on the shared lockstep.enqueue_through(), with the same
# arguments: what a role that may not create in schema lockstep gets
SHARED = r"""
do $$
declare
    t record;
begin
    for t in select tgname, tgrelid::regclass rel, pg_get_triggerdef(oid) def from pg_trigger
             where tgrelid = 'shop.order_line'::regclass and tgnargs = 6 loop
        execute format('drop trigger %I on %s', t.tgname, t.rel);
        execute regexp_replace(t.def, 'lockstep\.enqueue_w_[0-9a-f]+', 'lockstep.enqueue_through');
    end loop;
end $$
"""
FUNCTIONS = (
    "select distinct tgfoid::regproc::text from pg_trigger"
    " where tgrelid = 'shop.order_line'::regclass and tgnargs = 6"
)


@pytest.fixture(params=["generated", "shared"])
def shop(conn: psycopg.Connection, request: pytest.FixtureRequest) -> psycopg.Connection:
    conn.execute(SHOP)
    conn.execute(
        "select lockstep.watch('totals', 'shop.order_line', 'order_id',"
        " through => 'shop.orders', through_column => 'customer_id')"
    )
    if request.param == "shared":
        conn.execute(SHARED)
        assert conn.execute(FUNCTIONS).fetchall() == [("lockstep.enqueue_through",)]
    else:
        assert conn.execute(FUNCTIONS).fetchone()[0].startswith("lockstep.enqueue_w_")
    conn.execute("select lockstep.recompute('totals')")  # the flag of the newly watched tables
    conn.execute("delete from lockstep.queue")
    return conn


def queued(conn: psycopg.Connection) -> list[str]:
    return [
        r[0] for r in conn.execute("select distinct key from lockstep.queue where job = 'totals' order by 1")
    ]


def test_a_changed_line_queues_its_customer_not_its_order(shop: psycopg.Connection) -> None:
    order_customer = shop.execute("select customer_id from shop.orders where id = 7").fetchone()[0]
    shop.execute("update shop.order_line set amount = amount + 1 where order_id = 7")
    assert queued(shop) == [str(order_customer)]
    drain(shop, "totals")
    assert shop.execute(DIVERGENCE).fetchone()[0] == 0


def test_a_line_moved_to_another_customers_order_queues_both(shop: psycopg.Connection) -> None:
    # order 1 belongs to customer 2, order 2 to customer 3
    shop.execute("update shop.order_line set order_id = 2 where id = 20")  # line 20 is on order 1
    assert queued(shop) == ["2", "3"]
    drain(shop, "totals")
    assert shop.execute(DIVERGENCE).fetchone()[0] == 0


def test_the_through_table_is_watched_too(shop: psycopg.Connection) -> None:
    shop.execute("update shop.orders set customer_id = 5 where id = 1")  # from customer 2 to 5
    assert queued(shop) == ["2", "5"]
    drain(shop, "totals")
    shop.execute("delete from shop.orders where id = 3")  # its lines go by cascade: customer 4
    assert "4" in queued(shop)
    drain(shop, "totals")
    assert shop.execute(DIVERGENCE).fetchone()[0] == 0


def test_inserts_and_deletes_of_lines_converge(shop: psycopg.Connection) -> None:
    shop.execute("insert into shop.order_line select 1000 + g, g, 5 from generate_series(1, 20) g")
    shop.execute("delete from shop.order_line where id % 3 = 0")
    assert set(queued(shop)) == {"1", "2", "3", "4", "5"}
    drain(shop, "totals")
    assert shop.execute(DIVERGENCE).fetchone()[0] == 0


def test_an_unreadable_through_table_flags_the_job_and_never_fails_the_app(shop, connect, make_db) -> None:
    role = "through_app_" + str(shop.info.backend_pid)
    shop.execute(f"create role {role}")
    shop.execute(f"grant usage on schema shop, lockstep to {role}")
    shop.execute(f"grant select, update on shop.order_line to {role}")  # not orders
    shop.execute(f"grant insert on lockstep.queue, lockstep.recompute_flag to {role}")
    try:
        with shop.transaction():
            shop.execute(f"set local role {role}")
            shop.execute("update shop.order_line set amount = 0 where id = 1")  # does not fail
        problems = shop.execute("select problem from lockstep.recompute_flag where job = 'totals'").fetchall()
        assert any("shop.orders" in p[0] for p in problems), problems
    finally:
        shop.execute(f"drop owned by {role}")
        shop.execute(f"drop role {role}")


def test_a_column_that_does_not_lead_to_the_parent_is_refused(conn: psycopg.Connection) -> None:
    conn.execute(SHOP)
    before = conn.execute(
        "select count(*) from pg_trigger where tgrelid = 'shop.order_line'::regclass"
    ).fetchone()
    with raises_sqlstate("LSQ02", "shop.order_line.order_id references shop.orders, not the parent"):
        conn.execute("select lockstep.watch('totals', 'shop.order_line', 'order_id')")
    with raises_sqlstate("LSQ02", "has no foreign key to shop.customer"):
        conn.execute(
            "select lockstep.watch('totals', 'shop.order_line', 'id',"
            " through => 'shop.customer', through_column => 'id')"
        )
    with raises_sqlstate("42703"):
        conn.execute(
            "select lockstep.watch('totals', 'shop.order_line', 'order_id',"
            " through => 'shop.orders', through_column => 'nope')"
        )
    with raises_sqlstate("22004"):
        conn.execute(
            "select lockstep.watch('totals', 'shop.order_line', 'order_id', through => 'shop.orders')"
        )
    after = conn.execute(
        "select count(*) from pg_trigger where tgrelid = 'shop.order_line'::regclass"
    ).fetchone()
    assert before == after  # nothing created


def test_unwatch_removes_the_through_triggers(shop: psycopg.Connection) -> None:
    shop.execute("select lockstep.unwatch('totals', 'shop.order_line')")
    shop.execute("update shop.order_line set amount = 1 where id = 1")
    assert queued(shop) == []


def test_a_line_committed_after_its_order_moved_reaches_the_new_customer(shop, connect) -> None:
    """The trigger maps with its own snapshot: a move of the order committed meanwhile is not in it. The
    through keys are mapped again by the worker once the line commits."""
    app = connect()
    customer = shop.execute("select customer_id from shop.orders where id = 7").fetchone()[0]
    app.execute("begin")
    app.execute("insert into shop.order_line values (9001, 7, 1000)")  # maps order 7 to its customer now
    shop.execute("update shop.orders set customer_id = %s where id = 7", [customer % 5 + 1])  # moves it
    drain(shop, "totals")  # the line is not visible yet
    app.execute("commit")
    drain(shop, "totals")
    assert shop.execute(DIVERGENCE).fetchone()[0] == 0


def test_a_line_written_while_its_order_moves_reaches_the_new_customer(shop, connect) -> None:
    mover, app = connect(), connect()
    customer = shop.execute("select customer_id from shop.orders where id = 8").fetchone()[0]
    mover.execute("begin")
    mover.execute("update shop.orders set customer_id = %s where id = 8", [customer % 5 + 1])
    app.execute("begin")
    app.execute("insert into shop.order_line values (9002, 8, 1000)")  # sees the old customer
    mover.execute("commit")
    drain(shop, "totals")
    app.execute("commit")
    drain(shop, "totals")
    assert shop.execute(DIVERGENCE).fetchone()[0] == 0
    assert shop.execute("select count(*) from lockstep.through_entry").fetchone()[0] == 0


def test_through_keys_of_no_job_are_not_kept(shop: psycopg.Connection) -> None:
    shop.execute(
        "select lockstep._append_through('no_such_job', 'shop.orders'::regclass::oid, array['1', '2'])"
    )
    assert shop.execute("select count(*) from lockstep.through_entry").fetchone()[0] == 0
    shop.execute("update shop.order_line set amount = amount where id = 1")
    assert shop.execute("select count(*) from lockstep.through_entry").fetchone()[0] == 1
    shop.execute("select lockstep.drop_job('totals')")  # takes its through keys with it
    assert shop.execute("select count(*) from lockstep.through_entry").fetchone()[0] == 0


UUID_SHOP = """
create schema uu;
create table uu.customer (id bigint primary key);
create table uu.orders (id uuid primary key,
                        customer_id bigint not null references uu.customer on delete cascade);
create table uu.order_line (id bigint primary key,
                            order_id uuid not null references uu.orders on delete cascade);
create table uu.customer_total (customer_id bigint primary key references uu.customer on delete cascade,
                                orders bigint not null);
create function uu.total(ids bigint[]) returns table (customer_id bigint, orders bigint)
language sql stable as $$
    select c.id, count(o.id) from uu.customer c left join uu.orders o on o.customer_id = c.id
    where ids is null or c.id = any(ids) group by c.id $$;
insert into uu.customer values (7);
insert into uu.orders values ('00000000-0000-0000-0000-000000000001', 7);
"""


def test_a_job_watched_through_a_key_of_another_type_may_be_redefined(conn: psycopg.Connection) -> None:
    """The source's column (order_line.order_id, uuid) holds the through table's key, not the parent's: a
    redefinition with the same parent checks the through table's column against the parent key type (it was
    refused, LSQ01: order_id is uuid, which does not always convert to bigint). A source column renamed
    since is still refused."""
    conn.execute(UUID_SHOP)
    define = (
        "select lockstep.define_derived('uu', 'uu.customer_total', 'uu.total(bigint[])',"
        " parent => 'uu.customer')"
    )
    conn.execute(define)
    conn.execute(
        "select lockstep.watch('uu', 'uu.order_line', 'order_id',"
        " through => 'uu.orders', through_column => 'customer_id')"
    )
    conn.execute(define)
    conn.execute("delete from lockstep.queue")
    conn.execute("insert into uu.order_line values (1, '00000000-0000-0000-0000-000000000001')")
    assert conn.execute("select distinct key from lockstep.queue where job = 'uu'").fetchall() == [("7",)]
    conn.execute("alter table uu.order_line rename column order_id to order_ref")
    with raises_sqlstate("LSQ01", "order_line: its column order_id is gone"):
        conn.execute(define)
