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
    for block in blocks:
        conn.execute(block)
    conn.execute("insert into customer select g, 'c' || g from generate_series(1, 30) g")
    conn.execute("insert into orders select g, 1 + g % 30 from generate_series(1, 90) g")
    conn.execute("insert into order_line select g, 1 + g % 90, g % 11 from generate_series(1, 900) g")
    conn.execute("update order_line set order_id = 5 where id between 1 and 40")
    conn.execute("delete from orders where id = 7")
    conn.execute("select lockstep.recompute('customer_totals')")  # the flag of the newly watched tables
    drain(conn, "customer_totals")
    conn.execute("update order_line set amount = amount + 1 where order_id in (1, 2, 3)")
    conn.execute("update orders set customer_id = 1 where id = 12")
    drain(conn, "customer_totals")
    differ = conn.execute(
        "select count(*) from ((table customer_total"
        " except select * from customer_total_lockstep_compute(null))"
        " union all (select * from customer_total_lockstep_compute(null) except table customer_total)) d"
    ).fetchone()[0]
    assert differ == 0
    assert conn.execute("select count(*) from customer_total").fetchone()[0] == 30
