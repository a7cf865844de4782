"""docs/multi-tenant.md works as written: its SQL blocks, run in order, define and watch a job keyed by
(tenant_id, id), and its `lockstep run --once` leaves the derived table equal to the query, again after
application writes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import psycopg

PAGE = Path(__file__).resolve().parents[2] / "docs" / "multi-tenant.md"
DIFFER = (
    "select count(*) from ((table customer_total except select * from customer_total_lockstep_compute(null))"
    " union all (select * from customer_total_lockstep_compute(null) except table customer_total)) d"
)


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE.read_text(), re.S)


def run_once(dsn: str, command: str) -> None:
    args = command.split()
    assert args[:3] == ["lockstep", "run", "--once"], command
    p = subprocess.run(
        [sys.executable, "-m", "lockstep", *args[1:], "--dsn", dsn],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr


def test_the_walk_through_runs_as_written(conn: psycopg.Connection, dsn: str) -> None:
    sql = blocks("sql")
    (command,) = [b.strip() for b in blocks("sh")]
    assert len(sql) == 5
    warnings: list[str] = []
    conn.add_notice_handler(lambda d: warnings.append(d.message_primary) if d.severity == "WARNING" else None)
    for block in sql:
        conn.execute(block)
    assert warnings == []  # a reader who copies the page sees no warning
    run_once(dsn, command)
    assert conn.execute(DIFFER).fetchone()[0] == 0
    assert conn.execute("select count(*) from customer_total").fetchone()[0] == 60
    # order lines, watched through orders: a line moved to another customer's order queues both
    conn.execute("insert into order_line select tenant_id, id, id, 5 from orders")
    conn.execute("delete from lockstep.queue")
    conn.execute("update order_line set order_id = 6 where tenant_id = 1 and order_id = 3")  # customer 4 to 7
    queued = conn.execute("select array_agg(distinct key order by key) from lockstep.queue").fetchone()[0]
    assert queued == ["(1,4)", "(1,7)"]
    # the application writes; the next runs write the customers its changes named
    conn.execute("update orders set amount = amount + 1 where tenant_id = 2 and customer_id in (3, 4)")
    conn.execute("update orders set customer_id = 9 where tenant_id = 1 and id = 3")  # moved: both customers
    conn.execute("delete from customer where tenant_id = 3 and id = 5")
    conn.execute("insert into customer values (3, 21, 'new')")
    assert conn.execute("select count(*) from lockstep.queue").fetchone()[0] > 0
    run_once(dsn, command)
    assert conn.execute("select count(*) from lockstep.queue").fetchone()[0] == 0
    assert conn.execute(DIFFER).fetchone()[0] == 0
    assert conn.execute("select count(*) from customer_total").fetchone()[0] == 60
    verify = "select missing, extra, different from lockstep.verify('customer_totals')"
    assert conn.execute(verify).fetchone() == (0, 0, 0)
