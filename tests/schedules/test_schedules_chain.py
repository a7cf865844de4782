"""A chain of derived jobs under application writes, as an isolation schedule (docs/controls.md, "Chains").

Job a writes a_t from p; job b writes b_t from a_t (it watches a's target). The application deletes and
updates parents while each job's pass is open. wa and wb are the workers (deadlock_timeout 1s: the victims
if a cycle formed), app and app2 the application (10s). The trace is compared with
tests/expected/schedules_chain/<test>.out (``expected_trace``; rewrite with --update-expected).
"""

from __future__ import annotations

from isolation import Spec

CHAIN_SQL = """
create table p (id int primary key, v int not null);
create table a_t (id int primary key references p on delete cascade, v int not null);
create table b_t (id int primary key references p on delete cascade, v int not null);
create function a_c(ids int[]) returns table (id int, v int) language sql
    as $$ select id, v * 2 from public.p where ids is null or id = any(ids) $$;
create function b_c(ids int[]) returns table (id int, v int) language sql
    as $$ select id, v + 1 from public.a_t where ids is null or id = any(ids) $$;
insert into p select g, g from generate_series(1, 20) g;
select lockstep.define_derived('a', 'a_t', 'a_c(int[])', 'p', every => '1 day');
select lockstep.watch('a', 'p', 'id');
select lockstep.define_derived('b', 'b_t', 'b_c(int[])', 'p', every => '1 day');
select lockstep.watch('b', 'a_t', 'id');
select lockstep.recompute('a');
select lockstep.recompute('b');
delete from lockstep.queue;
delete from lockstep.recompute_flag;
"""

SESSIONS = {
    "wa": ["set deadlock_timeout = '1s'"],
    "wb": ["set deadlock_timeout = '1s'"],
    "app": ["set deadlock_timeout = '10s'"],
    "app2": ["set deadlock_timeout = '10s'"],
}
PASS = "select outcome, inserted, updated, deleted, skipped from lockstep.work('{}');"


def converge(conn) -> None:
    """Each job's passes in the runner's order (lockstep.due), deferred keys made ready, until both idle."""
    for _ in range(20):
        conn.execute("update lockstep.queue set ready_at = now()")
        outcomes = [
            conn.execute("select outcome from lockstep.run(%s)", [job]).fetchone()[0]
            for (job,) in conn.execute("select job from lockstep.due()").fetchall()
        ]
        if all(o in ("idle", "not_due") for o in outcomes):
            return
    raise AssertionError("the chain did not converge in 20 ticks")


def test_a_two_level_chain_under_application_writes_converges_without_a_wait(conn, dsn, expected_trace):
    conn.execute(CHAIN_SQL)
    conn.execute("update p set v = v + 10 where id <= 6")  # committed: a's queue holds 1-6
    spec = Spec(dsn, sessions=SESSIONS)
    spec.step("appbegin", "app", "begin;")
    spec.step("appdel", "app", "delete from p where id = 3;")  # holds p 3, a_t 3 and b_t 3 (cascade)
    spec.step("wabegin", "wa", "begin;")
    spec.step("wawork", "wa", PASS.format("a"))  # a_t 3 held by app: parent 3 skipped, the others written
    spec.step("app2begin", "app2", "begin;")
    spec.step("app2up", "app2", "update p set v = v + 1 where id = 1;")  # beside a's open pass
    spec.step("wbwork", "wb", PASS.format("b"))  # a's writes are not committed: b sees no key yet
    spec.step("wacommit", "wa", "commit;")
    spec.step("wbbegin", "wb", "begin;")
    spec.step("wbwork2", "wb", PASS.format("b"))  # a's writes queued b's parents; b_t 3 held by app
    spec.step("app2c", "app2", "commit;")
    spec.step("wacatch", "wa", PASS.format("a"))  # app2's change of parent 1, beside b's open pass
    spec.step("wbcommit", "wb", "commit;")
    spec.step("appc", "app", "commit;")
    order = ["appbegin", "appdel", "wabegin", "wawork", "app2begin", "app2up", "wbwork", "wacommit",
             "wbbegin", "wbwork2", "app2c", "wacatch", "wbcommit", "appc"]  # fmt: skip
    r = spec.run(order)
    expected_trace(r)
    assert not any(r.waited(s) for s in order), r.trace
    assert not any(r.error(s) for s in order), r.trace
    converge(conn)
    wrong = "select count(*) from p full join {t} using (id) where {t}.v is distinct from p.v * 2 + {d}"
    assert conn.execute(wrong.format(t="a_t", d=0)).fetchone()[0] == 0
    assert conn.execute(wrong.format(t="b_t", d=1)).fetchone()[0] == 0
