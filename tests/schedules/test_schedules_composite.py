"""The write path's schedules for a parent keyed by several columns, (tenant_id, id): pins first, SKIP LOCKED.

Each schedule's whole trace is compared with tests/expected/schedules_composite/<test>.out
(``expected_trace``; rewrite with --update-expected). Session s1 is lockstep (deadlock_timeout 1s), s2 the
application (10s), s3 a gate that holds lockstep's compute phase open. Blocking is read from
pg_blocking_pids by the harness (tests/isolation.py), never from elapsed time.
"""

from __future__ import annotations

import psycopg
import pytest
from isolation import Spec

SESSIONS = {
    "s1": ["set deadlock_timeout = '1s'"],
    "s2": ["set deadlock_timeout = '10s'"],
    "s3": ["set deadlock_timeout = '10s'"],
}
GATE = 4343
SCHEMA = f"""
create schema mt;
create table mt.doc (tenant_id int not null, id bigint not null, body text not null,
                     primary key (tenant_id, id));
create table mt.doc_word (tenant_id int not null, doc_id bigint not null, word text not null,
                          primary key (tenant_id, doc_id, word),
                          foreign key (tenant_id, doc_id) references mt.doc (tenant_id, id)
                              on delete cascade on update cascade);
create type mt.doc_key as (tenant_id int, id bigint);
create function mt.words(keys mt.doc_key[]) returns table (tenant_id int, doc_id bigint, word text)
language plpgsql stable as $$
begin
    perform pg_catalog.pg_advisory_xact_lock_shared({GATE});   -- held open by s3 when a schedule needs it
    return query select distinct d.tenant_id, d.id, w
        from mt.doc d, pg_catalog.regexp_split_to_table(d.body, ' ') w
        where keys is null
           or (d.tenant_id, d.id) in (select k.tenant_id, k.id from pg_catalog.unnest(keys) k);
end $$;
insert into mt.doc select t, i, 'w' || i || ' common' from generate_series(1, 2) t, generate_series(1, 3) i;
select lockstep.define_derived('mtw', 'mt.doc_word', 'mt.words(mt.doc_key[])', 'mt.doc',
                               parent_columns => array['tenant_id', 'doc_id']::name[]);
select lockstep.recompute('mtw');
update lockstep.job_state set next_run_at = now() + interval '1 hour' where job = 'mtw';
"""
DIVERGENCE = """
select (select count(*) from (select * from mt.words(null) except select * from mt.doc_word) a),
       (select count(*) from (select * from mt.doc_word except select * from mt.words(null)) b)
"""


@pytest.fixture
def spec(conn: psycopg.Connection, dsn: str) -> Spec:
    conn.execute(SCHEMA)
    s = Spec(dsn, sessions=SESSIONS)
    for name in SESSIONS:
        s.step(f"{name}begin", name, "begin;")
        s.step(f"{name}c", name, "commit;")
    s.step("s1work", "s1", "select outcome, inserted, deleted, skipped from lockstep.work('mtw');")
    s.step("s3hold", "s3", f"select pg_advisory_lock({GATE});", show_rows=False)
    s.step("s3release", "s3", f"select pg_advisory_unlock({GATE});", show_rows=False)
    return s


def converge(conn: psycopg.Connection) -> tuple[int, int]:
    conn.execute("update lockstep.queue set ready_at = now()")  # a skipped key waits a second: not here
    for _ in range(10):
        if conn.execute("select (lockstep.work('mtw')).more").fetchone()[0] is False:
            break
    return conn.execute(DIVERGENCE).fetchone()


def test_a_parent_the_app_holds_is_skipped_without_waiting(spec, conn, expected_trace):
    conn.execute("update mt.doc set body = body || ' more' where id = 2")
    conn.execute("select lockstep.enqueue('mtw', array[row(1, 2), row(2, 2)]::mt.doc_key[])")
    spec.step("s2hold", "s2", "select id from mt.doc where tenant_id = 2 and id = 2 for update;")
    # property: the app holds parent (2,2) FOR UPDATE; lockstep pins parents FOR KEY SHARE SKIP LOCKED in key
    # order before any write, so it neither waits nor fails: (1,2) is written, (2,2) skipped and queued again.
    r = spec.run(["s2begin", "s2hold", "s1begin", "s1work", "s1c", "s2c"])
    expected_trace(r)
    assert not r.waited("s1work"), r.trace
    assert r.rows("s1work") == [("done", 1, 0, 1)], r.trace
    assert conn.execute("select key from lockstep.queue").fetchall() == [("(2,2)",)]
    assert converge(conn) == (0, 0)


def test_app_delete_waits_only_for_locksteps_write_phase(spec, conn, expected_trace):
    conn.execute("update mt.doc set body = 'fresh' where tenant_id = 1 and id = 3")
    conn.execute("select lockstep.enqueue('mtw', array[row(1, 3)]::mt.doc_key[])")
    spec.step("s2del", "s2", "delete from mt.doc where tenant_id = 1 and id = 3;")
    # property: lockstep wrote (1,3)'s rows and holds KEY SHARE on it until commit; the app's delete waits for
    # that commit only (lockstep itself waits for nothing, so no cycle can form), then succeeds.
    r = spec.run(["s1begin", "s1work", "s2begin", "s2del", "s1c", "s2c"])
    expected_trace(r)
    assert r.blocked_by("s2del") == ["s1"], r.trace
    assert r.error("s2del") is None
    assert converge(conn) == (0, 0)


def test_app_deletes_parents_in_descending_order_during_the_compute_phase(spec, conn, expected_trace):
    conn.execute("update mt.doc set body = body || ' again' where id in (1, 3)")
    conn.execute(
        "select lockstep.enqueue('mtw', array[row(1, 1), row(1, 3), row(2, 1), row(2, 3)]::mt.doc_key[])"
    )
    spec.step("s2delhigh", "s2", "delete from mt.doc where tenant_id = 2 and id = 3;")
    spec.step("s2dellow", "s2", "delete from mt.doc where tenant_id = 1 and id = 1;")
    # property: while lockstep computes (held at the gate), the app deletes a high then a low key and commits
    # without waiting; lockstep then finds them gone: no 23503, no 40P01, the others written.
    r = spec.run(
        ["s3hold", "s1begin", "s1work", "s2begin", "s2delhigh", "s2dellow", "s2c", "s3release", "s1c"]
    )
    expected_trace(r)
    assert r.blocked_by("s1work") == ["s3"], r.trace
    assert not r.waited("s2delhigh") and not r.waited("s2dellow"), r.trace
    assert r.error("s1work") is None
    assert converge(conn) == (0, 0)
