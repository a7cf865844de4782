"""lockstep.verify(job, keys): the target compared with compute, for all parents or some, as the job's
owner, without a lock and without writing: rows missing, extra and different, with examples."""

from __future__ import annotations

import json

import psycopg
import pytest

from lockstep.lab.example import JOB


def verify(conn: psycopg.Connection, keys: list[int] | None = None) -> tuple[int, int, int, list[dict]]:
    if keys is None:
        return conn.execute("select * from lockstep.verify(%s)", [JOB]).fetchone()
    return conn.execute("select * from lockstep.verify(%s, %s::bigint[])", [JOB, keys]).fetchone()


def damage(ex: psycopg.Connection) -> dict[str, tuple]:
    """One row missing (exam 1), one extra (exam 2), one different (exam 3), written around lockstep."""
    missing = ex.execute(
        "delete from example.exam_key where (exam_id, key) = (select exam_id, key from example.exam_key"
        " where exam_id = 1 order by key limit 1) returning exam_id, key, weight"
    ).fetchone()
    extra = ex.execute(
        "insert into example.exam_key values (2, 'zzz_not_computed', 7) returning exam_id, key, weight"
    ).fetchone()
    different = ex.execute(
        "update example.exam_key set weight = weight + 100 where (exam_id, key) = (select exam_id, key"
        " from example.exam_key where exam_id = 3 order by key limit 1) returning exam_id, key, weight"
    ).fetchone()
    ex.execute("delete from lockstep.queue")  # the application's own writes enqueue: not what is tested
    return {"missing": missing, "extra": extra, "different": different}


def test_a_current_table_verifies_clean(ex):
    assert verify(ex) == (0, 0, 0, [])
    assert verify(ex, [1, 2, 3]) == (0, 0, 0, [])


def test_missing_extra_and_different_rows_are_counted_with_examples(ex):
    rows = damage(ex)
    missing, extra, different, examples = verify(ex)
    assert (missing, extra, different) == (1, 1, 1)
    by_kind = {e["kind"]: e for e in examples}
    assert sorted(by_kind) == ["different", "extra", "missing"] and len(examples) == 3
    as_row = lambda d: (d["exam_id"], d["key"], d["weight"])  # noqa: E731
    assert as_row(by_kind["missing"]["computed"]) == rows["missing"]
    assert "target" not in by_kind["missing"]
    assert as_row(by_kind["extra"]["target"]) == rows["extra"] and "computed" not in by_kind["extra"]
    assert as_row(by_kind["different"]["target"]) == rows["different"]
    exam, key, weight = rows["different"]
    assert as_row(by_kind["different"]["computed"]) == (exam, key, weight - 100)
    # some parents: only theirs
    assert verify(ex, [1])[:3] == (1, 0, 0)
    assert verify(ex, [2, 3])[:3] == (0, 1, 1)
    assert verify(ex, [4, 5]) == (0, 0, 0, [])
    # it changed nothing: the same answer again, and a recompute then repairs it
    assert verify(ex)[:3] == (1, 1, 1)
    ex.execute("select lockstep.recompute(%s)", [JOB])
    assert verify(ex) == (0, 0, 0, [])


def test_examples_are_at_most_three_of_each_kind_in_key_order(ex):
    ex.execute("update example.exam_key set weight = weight + 1 where exam_id <= 10")
    ex.execute("delete from lockstep.queue")
    n = ex.execute("select count(*) from example.exam_key where exam_id <= 10").fetchone()[0]
    missing, extra, different, examples = verify(ex)
    assert (missing, extra, different) == (0, 0, n)
    assert [e["kind"] for e in examples] == ["different"] * 3
    keys = [(e["target"]["exam_id"], e["target"]["key"]) for e in examples]
    assert keys == sorted(keys) and keys[0][0] == 1


def test_verify_takes_no_lock_and_writes_nothing(ex, exconnect):
    """In a READ ONLY transaction (no row lock, no write but to the session's temporary work tables, made
    by its first call), while another session holds the job's lock group and row locks on the target: no
    wait (lock_timeout 100ms)."""
    damage(ex)
    verify(ex)  # the session's work tables are created once (CREATE TABLE is refused in read-only)
    holder = exconnect(autocommit=False)
    holder.execute("select lockstep._try_lock(lock_group) from lockstep.job where job = %s", [JOB])
    holder.execute("select * from example.exam_key for update")
    before = ex.execute("select count(*), sum(weight) from example.exam_key").fetchone()
    with ex.transaction():
        ex.execute("set transaction read only")
        ex.execute("set local lock_timeout = '100ms'")
        assert verify(ex)[:3] == (1, 1, 1)
        assert verify(ex, [1, 2, 3])[:3] == (1, 1, 1)
        held = ex.execute(
            "select count(*) from pg_locks where pid = pg_backend_pid() and locktype in ('advisory', 'tuple')"
        ).fetchone()[0]
        assert held == 0
    assert ex.execute("select count(*), sum(weight) from example.exam_key").fetchone() == before
    holder.rollback()


def test_bad_requests_say_what_to_fix(ex):
    with pytest.raises(psycopg.Error) as err:
        ex.execute("select * from lockstep.verify('no_such_job')")
    assert "no_such_job" in str(err.value)
    with pytest.raises(psycopg.Error) as err:
        ex.execute("select * from lockstep.verify(%s, array['x'])", [JOB])
    assert "array of bigint" in (err.value.diag.message_hint or ""), err.value


def test_verify_runs_as_the_jobs_owner(ex, connect, example_dsn):
    """A role that may act as the owner verifies with the owner's rights; any other is refused (42501)."""
    ex.execute("create role lockstep_test_verifier login")
    try:
        other = connect(psycopg.conninfo.make_conninfo(example_dsn, user="lockstep_test_verifier"))
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            other.execute("select * from lockstep.verify(%s)", [JOB])
        other.close()
        owner = ex.execute("select owner from lockstep.job where job = %s", [JOB]).fetchone()[0]
        ex.execute(f'grant "{owner}" to lockstep_test_verifier')
        other = connect(psycopg.conninfo.make_conninfo(example_dsn, user="lockstep_test_verifier"))
        assert other.execute("select * from lockstep.verify(%s)", [JOB]).fetchone() == (0, 0, 0, [])
        assert (
            json.dumps(other.execute("select examples from lockstep.verify(%s)", [JOB]).fetchone()[0]) == "[]"
        )
        other.close()
    finally:
        ex.execute("drop owned by lockstep_test_verifier")
        ex.execute("drop role lockstep_test_verifier")
