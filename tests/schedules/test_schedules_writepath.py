"""Write-path edges: every target define_derived accepts is written without waiting on the
application, and what lockstep cannot write that way is refused up front.

One deterministic schedule per case (tests/isolation.py): the application holds a lock, and lockstep must
neither wait nor fail. Each schedule's whole trace is compared with
tests/expected/schedules_writepath/<test>.out (``expected_trace``; rewrite with --update-expected).
Session s1 is lockstep, s2 the application, s3 a gate that holds lockstep's compute
phase open. Bad-input tests: every refusal has a clear SQLSTATE and changes nothing (before/after snapshot).

The schema is unlike sql/example: text, uuid and composite keys, a list-partitioned target, several
foreign keys, a table referencing the target.
"""

from __future__ import annotations

import secrets

import psycopg
import pytest
import util
from isolation import Spec
from util import raises_sqlstate, result, snapshot

from lockstep import db

SESSIONS = {
    "s1": ["set deadlock_timeout = '1s'"],
    "s2": ["set deadlock_timeout = '10s'"],
    "s3": ["set deadlock_timeout = '10s'"],
}
GATE = 7331


def steps(spec: Spec) -> Spec:
    for s in SESSIONS:
        spec.step(f"{s}begin", s, "begin;")
        spec.step(f"{s}c", s, "commit;")
    return spec


def drain(conn: psycopg.Connection, job: str) -> None:
    conn.execute("update lockstep.queue set ready_at = now()")  # skipped keys wait a second: not here
    util.drain(conn, job, max_passes=20)


# -- partitioned target: ctids repeat across partitions --------------------------------------------------

PARTITIONED = """
create schema wp;
create table wp.account (code text primary key);
create table wp.entry (code text not null references wp.account on delete cascade, month int not null,
                       amount numeric not null);
create table wp.balance (code text not null references wp.account on delete cascade, month int not null,
                         total numeric not null, primary key (code, month)) partition by list (code);
create table wp.balance_a partition of wp.balance for values in ('alice');
create table wp.balance_b partition of wp.balance for values in ('bob');
create function wp.balances(codes text[]) returns table (code text, month int, total numeric)
language sql stable as $$
    select e.code, e.month, sum(e.amount) from wp.entry e
    where codes is null or e.code = any(codes) group by 1, 2
$$;
insert into wp.account values ('alice'), ('bob');
insert into wp.entry values ('alice', 1, 10), ('bob', 1, 20);
select lockstep.define_derived('bal', 'wp.balance', 'wp.balances(text[])', 'wp.account');
select lockstep.recompute('bal');
"""


def test_partitioned_target_locks_only_its_own_rows(conn, dsn, expected_trace):
    conn.execute(PARTITIONED)
    # both derived rows sit at ctid (0,1), one per partition
    where = conn.execute("select tableoid::regclass::text, ctid::text from wp.balance order by 1").fetchall()
    assert where == [("wp.balance_a", "(0,1)"), ("wp.balance_b", "(0,1)")]
    conn.execute("update wp.entry set amount = 11 where code = 'alice'")
    conn.execute("select lockstep.enqueue('bal', array['alice'])")
    spec = steps(Spec(dsn, sessions=SESSIONS))
    spec.step("s1work", "s1", "select outcome, updated, skipped from lockstep.work('bal');")
    spec.step("s2del", "s2", "delete from wp.account where code = 'bob';")
    # property: lockstep updates alice's row and holds it until commit; the app's delete of bob (whose
    # derived row is at the same ctid in the other partition) does not wait for lockstep.
    r = spec.run(["s1begin", "s1work", "s2begin", "s2del", "s1c", "s2c"])
    expected_trace(r)
    assert r.rows("s1work") == [("done", 1, 0)], r.trace
    assert not r.waited("s2del"), r.trace
    assert r.error("s2del") is None
    assert conn.execute("select code, total from wp.balance").fetchall() == [("alice", 11)]


# -- a table with a foreign key to the target -------------------------------------------------------------

REFERENCED = """
create schema wp;
create table wp.person (id uuid primary key);
create table wp.skill (person_id uuid not null references wp.person on delete cascade, name text not null);
create table wp.badge (person_id uuid not null references wp.person on delete cascade, name text not null,
                       level int not null, primary key (person_id, name));
create table wp.award (id int primary key, person_id uuid, badge text, note text,
                       foreign key (person_id, badge) references wp.badge on delete {action});
create index on wp.award (person_id, badge);
create function wp.badges(ids uuid[]) returns table (person_id uuid, name text, level int)
language sql stable as $$
    select s.person_id, s.name, count(*)::int from wp.skill s
    where ids is null or s.person_id = any(ids) group by 1, 2
$$;
insert into wp.person values ('00000000-0000-0000-0000-000000000001'),
                             ('00000000-0000-0000-0000-000000000002');
insert into wp.skill select id, n from wp.person, unnest(array['sql', 'go']) n;
select lockstep.define_derived('badges', 'wp.badge', 'wp.badges(uuid[])', 'wp.person');
select lockstep.recompute('badges');
insert into wp.award values (1, '00000000-0000-0000-0000-000000000001', 'go', null),
                            (2, '00000000-0000-0000-0000-000000000002', 'go', null);
"""
P1 = "00000000-0000-0000-0000-000000000001"
P2 = "00000000-0000-0000-0000-000000000002"


@pytest.mark.parametrize("action", ["cascade", "set null"])
def test_delete_of_a_referenced_row_skips_what_the_app_holds(conn, dsn, action, expected_trace):
    conn.execute(REFERENCED.format(action=action))
    conn.execute("delete from wp.skill where name = 'go'")  # both persons' 'go' badges must go
    conn.execute("select lockstep.enqueue('badges', array[%s, %s]::uuid[])", [P1, P2])
    spec = steps(Spec(dsn, sessions=SESSIONS))
    spec.step("s2hold", "s2", "update wp.award set note = 'editing' where id = 1;")
    spec.step("s1work", "s1", "select outcome, deleted, skipped from lockstep.work('badges');")
    # property: the app holds award 1, which references person 1's 'go' badge; lockstep deletes person 2's
    # badge (its award row locked first), skips person 1 (re-queued) and never waits for the app.
    r = spec.run(["s2begin", "s2hold", "s1begin", "s1work", "s2c", "s1c"])
    expected_trace(r)
    assert not r.waited("s1work"), r.trace
    assert r.rows("s1work") == [("done", 1, 1)], r.trace
    assert conn.execute("select key from lockstep.queue").fetchall() == [(P1,)]
    drain(conn, "badges")
    assert conn.execute("select count(*) from wp.badge where name = 'go'").fetchone()[0] == 0
    left = conn.execute("select id, person_id is null from wp.award order by id").fetchall()
    assert left == ([] if action == "cascade" else [(1, True), (2, True)])


def test_app_inserting_a_referencing_row_waits_only_for_the_write_phase(conn, dsn, expected_trace):
    conn.execute(REFERENCED.format(action="cascade"))
    conn.execute("delete from wp.skill where name = 'go'")
    conn.execute("select lockstep.enqueue('badges', array[%s]::uuid[])", [P1])
    spec = steps(Spec(dsn, sessions=SESSIONS))
    spec.step("s1work", "s1", "select outcome, deleted, skipped from lockstep.work('badges');")
    spec.step("s2ins", "s2", f"insert into wp.award values (3, '{P1}', 'go', 'new');")
    # property: once lockstep holds the badge it deletes, a new reference to it waits for lockstep's commit
    # (no referencing row can slip in between the lock and the delete) and then fails its FK check, like
    # any reference to a deleted row. lockstep itself waited for nothing.
    r = spec.run(["s1begin", "s1work", "s2begin", "s2ins", "s1c", "s2c"])
    expected_trace(r)
    assert r.rows("s1work") == [("done", 1, 0)], r.trace
    assert r.waited("s2ins") and r.blocked_by("s2ins") == ["s1"]
    assert r.sqlstate("s2ins") == "23503"


# -- REPEATABLE READ: the runner sets READ COMMITTED, direct calls are refused ----------------------------

RR_SCHEMA = f"""
create schema wp;
create table wp.team (name text primary key);
create table wp.member (team text not null references wp.team on delete cascade, who text not null);
create table wp.roster (team text not null references wp.team on delete cascade, who text not null,
                        primary key (team, who));
create function wp.rosters(names text[]) returns table (team text, who text)
language plpgsql stable as $$
begin
    perform pg_advisory_xact_lock_shared({GATE});   -- held open by s3
    return query select m.team, m.who from wp.member m where names is null or m.team = any(names);
end $$;
insert into wp.team values ('red'), ('blue');
insert into wp.member values ('red', 'ann'), ('blue', 'bo');
select lockstep.define_derived('roster', 'wp.roster', 'wp.rosters(text[])', 'wp.team', every => '1 day');
select lockstep.recompute('roster');
delete from lockstep.queue;
"""


def test_runner_runs_in_read_committed_whatever_the_database_default(conn, dsn, expected_trace):
    conn.execute(RR_SCHEMA)
    conn.execute(f"alter database {conn.info.dbname} set default_transaction_isolation = 'repeatable read'")
    conn.execute("insert into wp.member values ('red', 'cy'), ('blue', 'di')")
    conn.execute("select lockstep.enqueue('roster', array['red', 'blue'])")
    spec = steps(Spec(dsn, sessions=SESSIONS))
    spec.step("s3hold", "s3", f"select pg_advisory_lock({GATE});", show_rows=False)
    spec.step("s3release", "s3", f"select pg_advisory_unlock({GATE});", show_rows=False)
    spec.step("s1run", "s1", lambda c: db.run_job(c, "roster"), label="db.run_job(roster)")
    spec.step("s2del", "s2", "delete from wp.team where name = 'blue';")
    spec.step("s1iso", "s1", "show transaction_isolation;")
    # property: while the runner's pass computes (held at the gate) the app deletes a queued parent and
    # commits; the pass then skips it. Under the database's REPEATABLE READ the pin would raise 40001.
    r = spec.run(["s3hold", "s1run", "s2del", "s3release", "s1iso"])
    expected_trace(r)
    assert r.waited("s1run") and not r.waited("s2del"), r.trace
    assert r.rows("s1iso") == [("repeatable read",)]  # the database default, for a direct statement
    res = r.value("s1run")
    assert (res.outcome, res.error, res.inserted) == ("done", None, 1), res
    assert conn.execute("select * from wp.roster order by 1, 2").fetchall() == [("red", "ann"), ("red", "cy")]


@pytest.mark.parametrize("level", ["repeatable read", "serializable"])
@pytest.mark.parametrize("call", [f"lockstep.{f}('roster')" for f in ("work", "recompute", "run")])
def test_a_call_in_another_isolation_level_is_refused_before_any_work(conn, level, call):
    conn.execute(RR_SCHEMA.replace(f"perform pg_advisory_xact_lock_shared({GATE});", ""))
    conn.execute("insert into wp.member values ('red', 'cy')")
    conn.execute("select lockstep.enqueue('roster', array['red'])")
    if call.startswith("lockstep.run"):
        conn.execute("update lockstep.job_state set next_run_at = now()")  # its recompute is due
    before = snapshot(conn, "wp.roster")
    conn.execute(f"begin isolation level {level}")
    with raises_sqlstate("25000", "needs a READ COMMITTED transaction"):
        conn.execute(f"select * from {call}")
    conn.execute("rollback")
    assert snapshot(conn, "wp.roster") == before
    conn.execute("begin isolation level read committed")
    assert result(conn, call)["outcome"] == "done"
    conn.execute("commit")


# -- jobs without a parent count what they skip ----------------------------------------------------------


def test_parentless_job_counts_the_rows_it_skips(conn, dsn, expected_trace):
    conn.execute(
        """
        create schema wp;
        create table wp.sale (id int primary key, region text not null, amount int not null);
        create table wp.region_total (region text primary key, total bigint not null);
        create function wp.totals(ignored text[]) returns table (region text, total bigint)
        language sql stable as $$ select region, sum(amount) from wp.sale group by region $$;
        insert into wp.sale values (1, 'north', 5), (2, 'south', 7), (3, 'east', 1);
        select lockstep.define_derived('totals', 'wp.region_total', 'wp.totals(text[])');
        select lockstep.recompute('totals');
        update wp.sale set amount = amount + 1;
        """
    )
    spec = steps(Spec(dsn, sessions=SESSIONS))
    spec.step("s2hold", "s2", "select 1 from wp.region_total where region in ('north', 'east') for update;")
    spec.step("s1rec", "s1", "select outcome, updated, skipped from lockstep.recompute('totals');")
    # property: the app holds two derived rows; lockstep updates the third, skips two and says so.
    r = spec.run(["s2begin", "s2hold", "s1begin", "s1rec", "s2c", "s1c"])
    expected_trace(r)
    assert not r.waited("s1rec"), r.trace
    assert r.rows("s1rec") == [("done", 1, 2)], r.trace
    assert conn.execute("select last_skipped from lockstep.status").fetchone()[0] == 2
    assert result(conn, "lockstep.recompute('totals')")["updated"] == 2


# -- jobs are called by their regprocedure ---------------------------------------------------------------


def test_job_calls_survive_unrelated_overloads_and_name_an_ambiguous_one(conn):
    conn.execute(
        """
        create schema wp;
        create table wp.ticks (n int);
        create function wp.tick() returns void language sql as $$ insert into wp.ticks values (1) $$;
        select lockstep.define_job('tick', 'wp.tick()');
        create function wp.tick(n int) returns void language sql as $$ insert into wp.ticks values (n) $$;
        """
    )
    assert result(conn, "lockstep.run('tick')")["outcome"] == "done"
    assert conn.execute("select n from wp.ticks").fetchall() == [(1,)]
    # an overload that also takes a call without arguments: PostgreSQL has no call by oid, so the run
    # fails (recorded, backed off) and names the overload, never running the wrong function
    conn.execute(
        "create function wp.tick(n int default 2, m int default 3) returns void language sql"
        " as $$ insert into wp.ticks values (n + m) $$"
    )
    conn.execute("update lockstep.job_state set next_run_at = now()")
    r = result(conn, "lockstep.run('tick')")
    assert r["outcome"] == "failed"
    assert "ambiguous" in r["error"] and "wp.tick(integer,integer)" in r["error"], r["error"]
    assert conn.execute("select count(*) from wp.ticks").fetchone()[0] == 1


# -- refusals: clear SQLSTATE, hint, nothing changed -----------------------------------------------------

REFUSALS_SETUP = """
create schema wp;
create table wp.src (id int primary key);
create table wp.owner (id text primary key);
create table wp.kid (owner_id text not null references wp.owner on delete cascade, k int not null,
                     primary key (owner_id, k));
create function wp.kids(ids text[]) returns table (owner_id text, k int) language sql stable
    as $$ select o.id, 1 from wp.owner o where ids is null or o.id = any(ids) $$;
create function wp.kids_v(ids text[]) returns table (owner_id text, k int, v int) language sql stable
    as $$ select o.id, 1, 1 from wp.owner o where ids is null or o.id = any(ids) $$;
-- a target FK column compute does not return, with a default
create table wp.kid_dflt (owner_id text not null references wp.owner on delete cascade, k int not null,
                          src_id int default 1 references wp.src, primary key (owner_id, k));
-- the parent FK without ON DELETE CASCADE
create table wp.kid_noact (owner_id text not null references wp.owner, k int not null,
                           primary key (owner_id, k));
create table wp.kid_restrict (owner_id text not null references wp.owner on delete restrict, k int not null,
                              primary key (owner_id, k));
create table wp.kid_setnull (owner_id text not null references wp.owner on delete set null, k int not null,
                             primary key (owner_id, k));
-- tables referencing the target
create table wp.kid_ref_noact (owner_id text not null references wp.owner on delete cascade, k int not null,
                               primary key (owner_id, k));
create table wp.ref_noact (id int primary key, o text, k int, foreign key (o, k) references wp.kid_ref_noact);
create table wp.kid_ref_dflt (owner_id text not null references wp.owner on delete cascade, k int not null,
                              primary key (owner_id, k));
create table wp.ref_dflt (id int primary key, o text default 'x', k int default 1,
                          foreign key (o, k) references wp.kid_ref_dflt on delete set default);
create table wp.kid_deep (owner_id text not null references wp.owner on delete cascade, k int not null,
                          primary key (owner_id, k));
create table wp.ref_mid (id int primary key, o text, k int,
                         foreign key (o, k) references wp.kid_deep on delete cascade);
create table wp.ref_leaf (id int primary key, mid int references wp.ref_mid on delete cascade);
create table wp.kid_deep_setnull (owner_id text not null references wp.owner on delete cascade,
                                  k int not null, primary key (owner_id, k));
create table wp.ref_mid2 (id int primary key, o text, k int, unique (o, k),
                          foreign key (o, k) references wp.kid_deep_setnull on delete set null);
create table wp.ref_leaf2 (id int primary key, o text, k int,
                           foreign key (o, k) references wp.ref_mid2 (o, k));
create table wp.kid_deep_noact (owner_id text not null references wp.owner on delete cascade,
                                k int not null, primary key (owner_id, k));
create table wp.ref_mid3 (id int primary key, o text, k int,
                          foreign key (o, k) references wp.kid_deep_noact on delete cascade);
create table wp.ref_leaf3 (id int primary key, mid int references wp.ref_mid3);
create table wp.kid_self (owner_id text not null references wp.owner on delete cascade, k int not null,
                          up int, primary key (owner_id, k),
                          foreign key (owner_id, up) references wp.kid_self on delete cascade);
create table wp.kid_uniq (owner_id text not null references wp.owner on delete cascade, k int not null,
                          v int unique, primary key (owner_id, k));
create table wp.ref_uniq (id int primary key, v int references wp.kid_uniq (v) on delete cascade);
create function wp.kids_self(ids text[]) returns table (owner_id text, k int, up int) language sql stable
    as $$ select o.id, 1, null::int from wp.owner o where ids is null or o.id = any(ids) $$;
-- overloads that make the compute and job calls ambiguous
create function wp.kids(ids text[], extra int default 0) returns table (owner_id text, k int) language sql
    as $$ select null::text, null::int where false $$;
create table wp.kid2 (owner_id text not null references wp.owner on delete cascade, k int not null,
                      primary key (owner_id, k));
create function wp.tick() returns void language sql as $$ select $$;
create function wp.tick(n int default 0) returns void language sql as $$ select $$;
create function wp.kids2(ids text[]) returns table (owner_id text, k int) language sql stable
    as $$ select o.id, 1 from wp.owner o where ids is null or o.id = any(ids) $$;
"""


def dd(target: str, compute: str, more: str = "") -> str:
    return f"lockstep.define_derived('j', '{target}', '{compute}(text[])', 'wp.owner'{more})"


REFUSALS = [
    # (call, sqlstate, message fragment)
    (dd("wp.kid_dflt", "wp.kids2"), "LSD06", "src_id"),
    (dd("wp.kid_noact", "wp.kids2"), "LSD04", "ON DELETE NO ACTION"),
    (dd("wp.kid_restrict", "wp.kids2"), "LSD04", "RESTRICT"),
    (dd("wp.kid_setnull", "wp.kids2"), "LSD04", "SET NULL"),
    (dd("wp.kid_ref_noact", "wp.kids2"), "LSD06", "NO ACTION"),
    (dd("wp.kid_ref_dflt", "wp.kids2"), "LSD06", "SET DEFAULT"),
    (dd("wp.kid_deep_setnull", "wp.kids2"), "LSD06", "SET NULL on columns wp.ref_leaf2 references"),
    (dd("wp.kid_self", "wp.kids_self", ", 'owner_id'"), "LSD06", "references itself"),
    (dd("wp.kid_deep_noact", "wp.kids2"), "LSD06", "ref_leaf3 references wp.ref_mid3 ON DELETE NO ACTION"),
    (dd("wp.kid_uniq", "wp.kids_v"), "LSD06", "compute writes"),
    (dd("wp.kid2", "wp.kids"), "42725", "ambiguous"),
    ("lockstep.define_job('t', 'wp.tick()')", "42725", r"wp\.tick\(integer\)"),
]


@pytest.mark.parametrize(("call", "sqlstate", "match"), REFUSALS, ids=[c[0].split("'")[3] for c in REFUSALS])
def test_what_lockstep_cannot_write_without_waiting_is_refused(conn, call, sqlstate, match):
    conn.execute(REFUSALS_SETUP)
    before = snapshot(conn)
    with raises_sqlstate(sqlstate, match) as info:
        conn.execute(f"select {call}")
    assert info.value.diag.message_hint, "a refusal says what to do"
    assert snapshot(conn) == before


def test_parent_fk_set_null_on_a_nullable_column_is_accepted_with_a_warning(conn):
    conn.execute(REFUSALS_SETUP)
    conn.execute(
        "create table wp.kid_nullable (id int primary key,"
        " owner_id text references wp.owner on delete set null);"
        "create index on wp.kid_nullable (owner_id);"
        "create function wp.kn(ids text[]) returns table (id int, owner_id text) language sql stable"
        " as $$ select 1, o.id from wp.owner o where ids is null or o.id = any(ids) $$"
    )
    warnings: list[str] = []
    conn.add_notice_handler(lambda d: warnings.append(d.message_primary or ""))
    conn.execute("select lockstep.define_derived('kn', 'wp.kid_nullable', 'wp.kn(text[])', 'wp.owner')")
    assert any("ON DELETE SET NULL" in w and "next recompute" in w for w in warnings), warnings
    conn.execute("insert into wp.owner values ('a')")
    assert result(conn, "lockstep.recompute('kn')")["inserted"] == 1
    conn.execute("delete from wp.owner where id = 'a'")  # the app's delete succeeds
    assert result(conn, "lockstep.recompute('kn')")["deleted"] == 1


def test_a_referencing_key_added_after_define_fails_the_run_not_the_app(conn):
    conn.execute(REFUSALS_SETUP)
    conn.execute("insert into wp.owner values ('a'), ('b')")
    conn.execute("select lockstep.define_derived('k', 'wp.kid', 'wp.kids2(text[])', 'wp.owner')")
    assert result(conn, "lockstep.recompute('k')")["inserted"] == 2
    conn.execute(
        "create table wp.late (id int primary key, o text, k int, foreign key (o, k) references wp.kid)"
    )
    conn.execute("insert into wp.late values (1, 'a', 1)")
    conn.execute(
        "create or replace function wp.kids2(ids text[]) returns table (owner_id text, k int)"
        " language sql stable as $$ select null::text, null::int where false $$"
    )
    r = result(conn, "lockstep.recompute('k')")
    assert r["outcome"] == "failed" and "ON DELETE NO ACTION" in r["error"], r
    assert conn.execute("select count(*) from wp.kid").fetchone()[0] == 2


def test_other_no_action_foreign_keys_are_accepted_with_a_warning(conn):
    conn.execute(REFUSALS_SETUP)
    conn.execute(
        "create table wp.kid_tag (owner_id text not null references wp.owner on delete cascade,"
        " k int not null, src_id int references wp.src, primary key (owner_id, k));"
        "create function wp.kt(ids text[]) returns table (owner_id text, k int, src_id int)"
        " language sql stable as $$ select o.id, 1, null::int from wp.owner o"
        " where ids is null or o.id = any(ids) $$"
    )
    warnings: list[str] = []
    conn.add_notice_handler(lambda d: warnings.append(d.message_primary or ""))
    conn.execute("select lockstep.define_derived('kt', 'wp.kid_tag', 'wp.kt(text[])', 'wp.owner')")
    assert any("to wp.src is ON DELETE NO ACTION" in w for w in warnings), warnings


def test_a_referencing_table_the_role_cannot_lock_is_refused(conn):
    conn.execute(REFUSALS_SETUP)
    conn.execute(
        "create table wp.ref_priv (id int primary key, o text, k int,"
        " foreign key (o, k) references wp.kid on delete cascade)"
    )
    role = f"wp_definer_{secrets.token_hex(4)}"
    conn.execute(f"create role {role} nologin")
    try:
        conn.execute(
            f"grant usage on schema wp, lockstep to {role};"
            f"grant select, insert, update, delete on wp.kid to {role};"
            f"grant select on wp.owner, wp.ref_priv to {role};"
            # UPDATE on one parent column: pinning parents FOR KEY SHARE needs it (checked first)
            f"grant update (id) on wp.owner to {role}"
        )
        before = snapshot(conn)
        conn.execute(f"begin; set local role {role}")
        with raises_sqlstate("42501", "may not lock rows of wp.ref_priv"):
            conn.execute("select lockstep.define_derived('k', 'wp.kid', 'wp.kids2(text[])', 'wp.owner')")
        conn.execute("rollback")
        assert snapshot(conn) == before
    finally:
        conn.execute(f"drop owned by {role}; drop role {role}")


HOSTILE_PARTITIONED = """
create schema "w p";
create table "w p"."Acc;t" ("Id" text primary key);
create table "w p".src ("Id" text not null references "w p"."Acc;t" on delete cascade, n int not null);
create table "w p"."Tot""al" ("Id" text not null references "w p"."Acc;t" on delete cascade, n int not null,
                             primary key ("Id", n)) partition by hash ("Id");
create table "w p".t0 partition of "w p"."Tot""al" for values with (modulus 2, remainder 0);
create table "w p".t1 partition of "w p"."Tot""al" for values with (modulus 2, remainder 1);
create table "w p"."No;te" (id int primary key, "a'cc" text, "n n" int,
                           foreign key ("a'cc", "n n") references "w p"."Tot""al" on delete cascade)
                           partition by range (id);
create table "w p".note_lo partition of "w p"."No;te" for values from (0) to (100);
create table "w p".note_hi partition of "w p"."No;te" for values from (100) to (200);
create function "w p".f(ids text[]) returns table ("Id" text, n int) language sql stable
    as $$ select s."Id", s.n from "w p".src s where ids is null or s."Id" = any(ids) $$;
insert into "w p"."Acc;t" select 'a' || g from generate_series(1, 8) g;
insert into "w p".src select 'a' || g, 1 from generate_series(1, 8) g;
select lockstep.define_derived('tot', '"w p"."Tot""al"', '"w p".f(text[])', '"w p"."Acc;t"');
select lockstep.recompute('tot');
insert into "w p"."No;te" select g * 20, 'a' || g, 1 from generate_series(1, 8) g;
"""


def test_hostile_names_partitioned_target_and_partitioned_referencing_table(conn, dsn, expected_trace):
    conn.execute(HOSTILE_PARTITIONED)
    conn.execute("""update "w p".src set n = 2""")  # every derived row is deleted and re-inserted
    conn.execute("select lockstep.enqueue('tot', array(select 'a' || g from generate_series(1, 8) g))")
    spec = steps(Spec(dsn, sessions=SESSIONS))
    spec.step("s2hold", "s2", """update "w p"."No;te" set "n n" = "n n" where id in (20, 140);""")
    spec.step("s1work", "s1", "select outcome, inserted, deleted, skipped from lockstep.work('tot');")
    # property: the app holds the notes of a1 and a7 (one per partition); lockstep rewrites the six other
    # accounts' rows (their notes cascade away), skips a1 and a7, and waits for nothing.
    r = spec.run(["s2begin", "s2hold", "s1begin", "s1work", "s2c", "s1c"])
    expected_trace(r)
    assert not r.waited("s1work"), r.trace
    assert r.rows("s1work") == [("done", 6, 6, 2)], r.trace
    assert conn.execute("select array_agg(key order by key) from lockstep.queue").fetchone()[0] == [
        "a1",
        "a7",
    ]
    drain(conn, "tot")
    assert conn.execute("""select count(*) from "w p"."Tot""al" where n = 2""").fetchone()[0] == 8
    assert conn.execute("""select count(*) from "w p"."No;te" """).fetchone()[0] == 0


DEEP = """
create schema wp;
create table wp.team (id bigint primary key);
create table wp.player (team_id bigint not null references wp.team on delete cascade, name text not null);
create table wp.slot (team_id bigint not null references wp.team on delete cascade, name text not null,
                      primary key (team_id, name));
create table wp.booking (id int primary key, team_id bigint, name text,
                         foreign key (team_id, name) references wp.slot on delete cascade);
create index on wp.booking (team_id, name);
create table wp.booking_note (id int primary key,
                              booking_id int not null references wp.booking on delete cascade, body text);
create index on wp.booking_note (booking_id);
create function wp.slots(ids bigint[]) returns table (team_id bigint, name text) language sql stable
    as $$ select p.team_id, p.name from wp.player p where ids is null or p.team_id = any(ids) $$;
insert into wp.team select generate_series(1, 3);
insert into wp.player select t, n from generate_series(1, 3) t, unnest(array['x', 'y']) n;
select lockstep.define_derived('slots', 'wp.slot', 'wp.slots(bigint[])', 'wp.team');
select lockstep.recompute('slots');
insert into wp.booking select t, t, 'y' from generate_series(1, 3) t;
insert into wp.booking_note select t * 10 + g, t, 'n' from generate_series(1, 3) t, generate_series(1, 2) g;
"""


def test_a_cascade_two_levels_deep_skips_what_the_app_holds(conn, dsn, expected_trace):
    conn.execute(DEEP)
    conn.execute("delete from wp.player where name = 'y'")
    conn.execute("select lockstep.enqueue('slots', array[1, 2, 3])")
    spec = steps(Spec(dsn, sessions=SESSIONS))
    spec.step("s2hold", "s2", "update wp.booking_note set body = 'editing' where id = 22;")
    spec.step("s1work", "s1", "select outcome, deleted, skipped from lockstep.work('slots');")
    # property: the app edits a note of team 2's booking; lockstep deletes the 'y' slots of teams 1 and 3
    # (bookings and their notes cascade away, locked first, two levels down), skips team 2, never waits.
    r = spec.run(["s2begin", "s2hold", "s1begin", "s1work", "s2c", "s1c"])
    expected_trace(r)
    assert not r.waited("s1work"), r.trace
    assert r.rows("s1work") == [("done", 2, 1)], r.trace
    assert conn.execute("select array_agg(id order by id) from wp.booking").fetchone()[0] == [2]
    drain(conn, "slots")
    assert conn.execute("select count(*) from wp.booking_note").fetchone()[0] == 0
    assert conn.execute("select count(*) from wp.slot").fetchone()[0] == 3


# -- a row an application updated, then deleted or locked: SKIP LOCKED follows the update chain and waits --

# posts, their languages and their words: the target references both
WP_SCHEMA = """
create schema wp;
create table wp.lang (code text primary key, name text not null);
create table wp.post (id int primary key, title text not null, lang text not null references wp.lang);
create table wp.word (post_id int not null references wp.post on delete cascade, word text not null,
                      lang text not null references wp.lang, primary key (post_id, word));
create function wp.words(ids int[]) returns table (post_id int, word text, lang text)
language sql stable as $$
    select p.id, w, p.lang from wp.post p, regexp_split_to_table(p.title, ' ') w
    where ids is null or p.id = any(ids)
$$;
"""
UPDATED_THEN_HELD = (
    WP_SCHEMA
    + """
insert into wp.lang values ('en', 'English'), ('fr', 'French');
select lockstep.define_derived('words', 'wp.word', 'wp.words(int[])', 'wp.post', every => '1 day');
insert into wp.post values (1, 'one title', 'en'), (2, 'two title', 'fr');
select lockstep.enqueue('words', array[1, 2]);
update lockstep.job_state set next_run_at = now() + interval '1 day' where job = 'words';
"""
)


HELD_SESSIONS = {
    "s1": ["set deadlock_timeout = '1s'"],
    "s2": ["set deadlock_timeout = '100ms'"],  # the application detects the deadlock first: it is the victim
    "s3": ["set deadlock_timeout = '10s'"],
}
POST2_UPDATED = "update wp.post set title = title where id = 2;"
HOLD = {  # the application's hold, the row the naive pin holds that it then deletes, a row lockstep pins
    "parent-update-lock": (
        POST2_UPDATED + " select from wp.post where id = 2 for update;",
        "wp.post where id = 1",
        "wp.post set title = title where id = 1",
    ),
    "parent-update-delete": (
        POST2_UPDATED + " delete from wp.post where id = 2;",
        "wp.post where id = 1",
        "wp.post set title = title where id = 1",
    ),
    "other-fk-update-lock": (
        "update wp.lang set name = name where code = 'fr'; select from wp.lang where code = 'fr' for update;",
        "wp.lang where code = 'en'",
        "wp.lang set name = name where code = 'en'",
    ),
}


@pytest.mark.parametrize("case", list(HOLD))
def test_a_row_the_app_updated_then_holds_is_skipped_not_waited_for(dsn, case):
    """FOR KEY SHARE SKIP LOCKED does not skip a row whose visible version an application updated (a
    change of no key column, which KEY SHARE does not conflict with) and whose newer version it then deleted
    or locked: PostgreSQL locks the old version, follows the update chain and waits for the application
    there. The naive pin (s3, permutation 1) waits for the application, holding its pin of post 1, so the
    application's DELETE of post 1 deadlocks and fails with 40P01. lockstep pinned the same way and did the
    same; it now cuts that wait short and pins FOR SHARE SKIP LOCKED, which skips the row:
    post 1 is written, the held row's post re-queued, the application's DELETE does not wait. s1after is
    sent only once s1work completed (with s2 still open: the old code never did, a StepTimeout). No expected
    trace: whether the observer sees lockstep's 10 ms wait is a matter of timing."""
    held, victim, pinned = HOLD[case]
    ref = "wp.lang order by 1" if case.startswith("other") else "wp.post where id in (1, 2) order by 1"
    spec = Spec(
        dsn,
        setup=[UPDATED_THEN_HELD],
        teardown=["select lockstep.drop_job('words')", "drop schema wp cascade"],
        sessions=HELD_SESSIONS,
    )
    steps(spec)
    spec.step("s2hold", "s2", held, show_rows=False)
    spec.step("s2del", "s2", "delete from wp.post where id = 1;")
    spec.step("s2delnaive", "s2", f"delete from {victim};")
    spec.step("s2r", "s2", "rollback;")
    spec.step("s3naive", "s3", f"select 1 from {ref} for key share skip locked;", show_rows=False)
    spec.step("s1work", "s1", "select outcome, inserted, skipped from lockstep.work('words');")
    spec.step("s1after", "s1", "select key from lockstep.queue where job = 'words';")
    spec.step("s3up", "s3", f"update {pinned};")
    naive = spec.run(["s2begin", "s2hold", "s3begin", "s3naive", "s2delnaive", "s2r", "s3c"])
    assert naive.waited("s3naive") and naive.blocked_by("s3naive") == ["s2"], naive.trace
    assert naive.sqlstate("s2delnaive") == "40P01", naive.trace  # the application fails
    r = spec.run(["s2begin", "s2hold", "s1begin", "s1work", "s1after", "s3up", "s1c", "s2del", "s2c"])
    assert r.rows("s1work") == [("done", 2, 1)], r.trace  # post 1's two words; post 2 skipped
    assert r.rows("s1after") == [("2",)], r.trace  # re-queued
    # the rows it pinned are held FOR KEY SHARE, as always: an application's UPDATE of them does not wait
    # (pinned FOR SHARE, they made it wait for lockstep's whole transaction)
    assert r.error("s3up") is None and not r.waited("s3up"), r.trace
    assert r.error("s2del") is None and not r.waited("s2del"), r.trace


MANY_HELD = (
    WP_SCHEMA
    + """
insert into wp.lang values ('en', 'English');
insert into wp.lang select 'l' || lpad(g::text, 3, '0'), 'lang ' || g from generate_series(1, 150) g;
insert into wp.post values (1, 'one title', 'en');
insert into wp.post select g + 1, 'title ' || g, 'l' || lpad(g::text, 3, '0') from generate_series(1, 150) g;
select lockstep.define_derived('words', 'wp.word', 'wp.words(int[])', 'wp.post', every => '1 day');
select lockstep.enqueue('words', array(select id from wp.post order by id));
update lockstep.job_state set next_run_at = now() + interval '1 day' where job = 'words';
"""
)


def test_many_rows_the_app_updated_then_holds_cost_lockstep_a_bounded_wait_not_one_each(dsn):
    """The pin's short waits (lockstep._pin_timeout) are taken holding the pins before them. An application
    that updated and then locked 150 rows the pass must pin (here the target's other foreign key, wp.lang)
    and then deleted post 1, which lockstep had pinned in the step before, waited on lockstep while lockstep
    waited 10 ms on each of its 150 rows in turn: the application's deadlock check (1 s, the default) found
    the cycle and failed its DELETE with 40P01 (with 300 parents held). The waits are
    now bounded in all (lockstep._pin_waits): the rows not pinned by then are skipped untried, so lockstep
    stops waiting long before the application's check, which finds no cycle. Post 1 is written; the 150
    posts are re-queued."""
    spec = Spec(
        dsn,
        setup=[MANY_HELD],
        teardown=["select lockstep.drop_job('words')", "drop schema wp cascade"],
        sessions={"s1": ["set deadlock_timeout = '10s'"], "s2": ["set deadlock_timeout = '1s'"]},
    )
    spec.step("s1begin", "s1", "begin;")
    spec.step("s1c", "s1", "commit;")
    spec.step("s2begin", "s2", "begin;")
    spec.step("s2c", "s2", "commit;")
    spec.step(
        "s2hold",
        "s2",
        "update wp.lang set name = name where code like 'l%';"
        " select from wp.lang where code like 'l%' for update;",
        show_rows=False,
    )
    spec.step("s1work", "s1", "select outcome, inserted, skipped from lockstep.work('words');")
    spec.step("s2del", "s2", "delete from wp.post where id = 1;")
    spec.step("s1queued", "s1", "select count(*) from lockstep.queue where job = 'words';")
    r = spec.run(["s2begin", "s2hold", "s1begin", "s1work", "s2del", "s1queued", "s1c", "s2c"])
    assert r.error("s2del") is None, r.trace  # before: 40P01, the application failed
    assert r.rows("s1work") == [("done", 2, 150)], r.trace  # post 1's words; the held langs' posts skipped
    assert r.rows("s1queued") == [(150,)], r.trace  # re-queued
