"""docs/joined-sources.md works as written: its SQL blocks, run in order, define and watch a job that
converges under application writes through the join."""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
from util import drain

PAGE = Path(__file__).resolve().parents[2] / "docs" / "joined-sources.md"


def sql_blocks() -> list[str]:
    return re.findall(r"```sql\n(.*?)```", PAGE.read_text(), re.S)


def test_the_walk_through_runs_as_written(conn: psycopg.Connection) -> None:
    blocks = sql_blocks()
    assert len(blocks) == 3
    warnings: list[str] = []
    conn.add_notice_handler(lambda d: warnings.append(d.message_primary) if d.severity == "WARNING" else None)
    for block in blocks:
        conn.execute(block)
    assert warnings == []  # a reader who copies the page sees no warning
    conn.execute("insert into customer select g, 'c' || g from generate_series(1, 30) g")
    conn.execute("insert into orders select g, 1 + g % 30 from generate_series(1, 90) g")
    conn.execute("insert into order_line select g, 1 + g % 90, g % 11 from generate_series(1, 900) g")
    conn.execute("update order_line set order_id = 5 where id between 1 and 40")
    conn.execute("delete from orders where id = 7")
    conn.execute("select lockstep.recompute('customer_totals')")  # the flag of the newly watched tables
    drain(conn, "customer_totals")
    conn.execute("update order_line set amount = amount + 1 where order_id in (1, 2, 3)")
    conn.execute("update orders set customer_id = 1 where id = 12")
    conn.execute("insert into customer values (31, 'new')")  # no order yet: its row still comes
    drain(conn, "customer_totals")
    differ = conn.execute(
        "select count(*) from ((table customer_total"
        " except select * from customer_total_lockstep_compute(null))"
        " union all (select * from customer_total_lockstep_compute(null) except table customer_total)) d"
    ).fetchone()[0]
    assert differ == 0
    assert conn.execute("select count(*) from customer_total").fetchone()[0] == 31


VERIFY = "select missing, extra, different from lockstep.verify('customer_totals')"
OWN_TRIGGER = """
create function public.lines_enqueue() returns trigger language plpgsql as $$
begin
    perform lockstep.enqueue('customer_totals', array(
        select distinct o.customer_id from new_rows l join public.orders o on o.id = l.order_id));
    return null;
end $$;
create trigger lines_enqueue after insert on order_line referencing new table as new_rows
    for each statement execute function public.lines_enqueue();
"""


def moved_while_a_line_is_written(connect, conn: psycopg.Connection) -> tuple[int, int, int]:
    """Order 1 moves from customer 1 to customer 2 while a line is written to it: the move commits first
    and is worked, then the line commits and is worked. verify()'s counts after."""
    mover, writer = connect(autocommit=False), connect(autocommit=False)
    mover.execute("update orders set customer_id = 2 where id = 1")
    writer.execute("insert into order_line values (1000, 1, 5)")  # no wait: the move keeps the order's key
    mover.commit()
    drain(conn, "customer_totals")
    writer.commit()
    drain(conn, "customer_totals")
    return conn.execute(VERIFY).fetchone()


def walk_through_schema(conn: psycopg.Connection, watch_lines: str) -> None:
    schema, define, _ = sql_blocks()
    conn.execute(schema)
    conn.execute(define)
    conn.execute("select lockstep.watch('customer_totals', 'customer', 'id')")
    conn.execute("select lockstep.watch('customer_totals', 'orders', 'customer_id')")
    conn.execute(watch_lines)
    conn.execute("insert into customer select g, 'c' || g from generate_series(1, 3) g")
    conn.execute("insert into orders select g, g from generate_series(1, 3) g")
    conn.execute("select lockstep.recompute('customer_totals')")
    drain(conn, "customer_totals")


def test_a_watch_through_maps_a_line_again_after_its_commit(connect, conn: psycopg.Connection) -> None:
    walk_through_schema(
        conn,
        "select lockstep.watch('customer_totals', 'order_line', 'order_id',"
        " through => 'orders', through_column => 'customer_id')",
    )
    assert moved_while_a_line_is_written(connect, conn) == (0, 0, 0)


def test_a_trigger_of_your_own_maps_a_line_at_its_statement(connect, conn: psycopg.Connection) -> None:
    # docs: a row written while another transaction moves its middle row reaches the old parent only;
    # the new parent gets it at the next full recompute
    walk_through_schema(conn, OWN_TRIGGER)
    assert moved_while_a_line_is_written(connect, conn) == (0, 0, 1)
    assert conn.execute("select needs_recompute from lockstep.status").fetchone()[0] is None
    conn.execute("select lockstep.recompute('customer_totals')")
    assert conn.execute(
        "select missing, extra, different from lockstep.verify('customer_totals')"
    ).fetchone() == (
        0,
        0,
        0,
    )
