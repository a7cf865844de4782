"""The example application (``sql/example/``): install, seed and check it. Used by tests, bench and demo."""

from __future__ import annotations

import psycopg

from lockstep.paths import sql_dir

JOB = "exam_keys"


def example_sql(name: str = "schema.sql") -> str:
    return (sql_dir() / "example" / name).read_text()


def install(conn: psycopg.Connection, parents: int = 0, job: str = JOB, every: str = "1 minute") -> None:
    """Create the example schema, seed ``parents`` exams, register ``job`` and watch the source tables."""
    conn.execute(example_sql())
    conn.execute(example_sql("naive.sql"))
    if parents:
        conn.execute("select example.seed(%s)", [parents])
    conn.execute("select example.install(%s, %s::interval)", [job, every])


def verify(conn: psycopg.Connection, job: str = JOB) -> tuple[int, int, int]:
    """(rows missing, extra, different) in the job's target: ``lockstep.verify``, as users check theirs."""
    from lockstep import db

    r = db.verify(conn, job)
    return r.missing, r.extra, r.different


def divergence(conn: psycopg.Connection) -> tuple[int, int]:
    """(rows missing from example.exam_key, rows that should not be there), both ways with EXCEPT ALL."""
    missing = conn.execute(
        "select count(*) from (select exam_id, key, weight from example.exam_key_compute(null)"
        " except all select exam_id, key, weight from example.exam_key) s"
    ).fetchone()[0]
    extra = conn.execute(
        "select count(*) from (select exam_id, key, weight from example.exam_key"
        " except all select exam_id, key, weight from example.exam_key_compute(null)) s"
    ).fetchone()[0]
    return int(missing), int(extra)
