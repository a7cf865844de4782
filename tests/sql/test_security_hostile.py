# ruff: noqa: F811 (the fixtures imported from test_security are the tests' arguments)
"""A hostile job owner (mallory) against lockstep's own context, other owners and the application.

Each test is an attack: what it tries, and what must hold. The attacks that held before are in
tests/sql/test_security.py (named in docs/security.md's table); the ones here each succeeded on an earlier
revision. Fixtures (roles; mallory, an owner holding every DML privilege on lockstep's tables) come
from there.
"""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql
from test_security import (  # noqa: F401 (fixtures)
    APP_GRANTS,
    EXAMPLE_APP_GRANTS,
    EXAMPLE_OWNER_GRANTS,
    HOSTILE_PATH_SQL,
    OWNER_GRANTS,
    RUN_LOG_GRANTS,
    RUNNER_GRANTS,
    _as,
    as_role,
    mallory,
    roles,
)
from util import LOCKSTEP_TABLES, raises_sqlstate, result, snapshot

from lockstep import db

LOOT = "select count(*) from mal.loot where v = 's3cr3t'"


def _plant_steal(m: psycopg.Connection) -> None:
    """mal.steal(): copies public.secret into mal.loot when the current role can read it (mallory cannot)."""
    m.execute(
        "create function mal.steal() returns boolean language plpgsql as $$ begin"
        " if has_table_privilege('public.secret', 'select') then"
        "   insert into mal.loot select v from public.secret; end if;"
        " return true; end $$"
    )
    m.execute("grant usage on schema mal to public")
    m.execute("grant insert on mal.loot to public")


def _enum_job(m: psycopg.Connection) -> None:
    """mallory's derived job keyed by an enum of hers (accepted: an enum's I/O is built in)."""
    m.execute("create type mal.e as enum ('a', 'b')")
    m.execute("create table mal.p (id mal.e primary key)")
    m.execute("insert into mal.p values ('a'), ('b')")
    m.execute("create table mal.c (pid mal.e primary key references mal.p on delete cascade)")
    m.execute(
        "create function mal.fc(ids mal.e[]) returns table (pid mal.e) language sql"
        " as 'select id from mal.p where ids is null or id = any(ids)'"
    )
    m.execute("select lockstep.define_derived('ejob', 'mal.c', 'mal.fc(mal.e[])', parent => 'mal.p')")


def _plant_enum_casts(m: psycopg.Connection) -> None:
    """Casts of mallory's enum from and to text, each through mal.steal()."""
    m.execute(
        "create function mal.to_e(t text) returns mal.e language plpgsql as $$ begin"
        " perform mal.steal(); return 'a'::mal.e; end $$"
    )
    m.execute(
        "create function mal.from_e(e mal.e) returns text language plpgsql as $$ begin"
        " perform mal.steal(); return 'a'; end $$"
    )
    m.execute("create cast (text as mal.e) with function mal.to_e(text)")
    m.execute("create cast (mal.e as text) with function mal.from_e(mal.e)")


# 1. an enum key's cast ---------------------------------------------------------------------------------


def test_an_enum_key_whose_owner_added_a_cast_is_refused_not_cast(ex, example_dsn, mallory):
    """mallory defines a job keyed by her enum, then adds casts text <-> enum through her function: the
    superuser runner's worker pass, an admin's retry and enqueue() would run it with their rights."""
    with _as(example_dsn, mallory) as m:
        _plant_steal(m)
        _enum_job(m)
        _plant_enum_casts(m)
        m.execute("insert into lockstep.queue (job, key) values ('ejob', 'a'), ('ejob', 'b')")
    ex.execute("update lockstep.job_state set next_run_at = now() + interval '1 day' where job = 'ejob'")
    res = result(ex, "lockstep.work(%s)", "ejob")
    assert res["outcome"] == "failed" and "cast" in res["error"], res
    with raises_sqlstate("LSD04", match="cast"):
        ex.execute("select lockstep.retry('ejob', array['a']::mal.e[])")
    with raises_sqlstate("LSD04", match="cast"):
        ex.execute("select lockstep.enqueue('ejob', array['a']::mal.e[])")
    assert ex.execute(LOOT).fetchone()[0] == 0
    # and a job of that key type is refused when it is defined, by define_derived and by the registry's policy
    with _as(example_dsn, mallory) as m:
        with raises_sqlstate("LSD04", match="cast"):
            m.execute(
                "select lockstep.define_derived('ejob2', 'mal.c', 'mal.fc(mal.e[])', parent => 'mal.p')"
            )
        with raises_sqlstate("42501", match="row-level security"):
            m.execute("update lockstep.job set key_type = 'mal.e'::regtype where job = 'mine'")


@pytest.mark.parametrize("call", [db.retry, db.verify, db.preview])
def test_the_cli_never_casts_keys_of_an_unsafe_key_type(ex, example_dsn, mallory, call):
    """`lockstep retry / verify --keys / diff --keys` get keys as text: converted by the CLI's own cast, an
    admin ran mallory's text -> enum cast before lockstep saw the key type. lockstep converts them now,
    after refusing the type."""
    with _as(example_dsn, mallory) as m:
        _enum_job(m)
        # a sequence counts the cast's calls: nextval survives the statement's error
        m.execute("create sequence mal.calls; grant usage on sequence mal.calls to public")
        m.execute(
            "create function mal.to_e(t text) returns mal.e language plpgsql as $$ begin"
            " perform nextval('mal.calls'); return 'a'::mal.e; end $$"
        )
        m.execute("create cast (text as mal.e) with function mal.to_e(text)")
    with raises_sqlstate("LSD04", match="cast"):
        call(ex, "ejob", ["a"])
    assert ex.execute("select is_called from mal.calls").fetchone()[0] is False


def test_the_application_never_casts_an_unsafe_key_it_flags_the_job(ex, example_dsn, mallory):
    """The trigger on mallory's table runs as the writer: it flags the job instead of casting the key."""
    with _as(example_dsn, mallory) as m:
        _plant_steal(m)
        _enum_job(m)
        m.execute("select lockstep.watch('ejob', 'mal.p', 'id')")
        _plant_enum_casts(m)
    ex.execute("delete from lockstep.recompute_flag")
    ex.execute("insert into mal.p values ('b') on conflict do nothing")
    ex.execute("delete from mal.p where id = 'b'")
    assert ex.execute(LOOT).fetchone()[0] == 0
    flags = ex.execute("select problem from lockstep.recompute_flag where job = 'ejob'").fetchall()
    assert flags and all("cast" in p for (p,) in flags), flags


def test_an_admin_watch_never_casts_an_unsafe_key_as_the_writer(ex, example_dsn, mallory):
    """watch() run by a role that may create in schema lockstep (the admin here) may generate a trigger
    function that casts the key column to text itself: only for built-in key types, whose casts no owner
    may add. An enum key gets the general trigger, which flags the job: mallory's cast added after the
    watch never runs as the writer (the admin)."""
    with _as(example_dsn, mallory) as m:
        _plant_steal(m)
        _enum_job(m)
        m.execute(
            "create function mal.int_text(i bigint) returns text language sql as 'select mal.steal()::text'"
        )
        with raises_sqlstate("42501", match="must be owner of type"):
            m.execute("create cast (bigint as text) with function mal.int_text(bigint)")
    ex.execute("select lockstep.watch('ejob', 'mal.p', 'id')")
    fns = ex.execute(
        "select p.oid::regprocedure::text from pg_trigger t join pg_proc p on p.oid = t.tgfoid"
        " where t.tgrelid = 'mal.p'::regclass and not t.tgisinternal"
    ).fetchall()
    assert {f for (f,) in fns} == {"lockstep.enqueue_trigger()"}, fns
    with _as(example_dsn, mallory) as m:
        _plant_enum_casts(m)
    ex.execute("delete from lockstep.recompute_flag")
    ex.execute("insert into mal.p values ('b') on conflict do nothing")
    ex.execute("update mal.p set id = id where id = 'a'")
    ex.execute("delete from mal.p where id = 'b'")
    assert ex.execute(LOOT).fetchone()[0] == 0
    flags = ex.execute("select problem from lockstep.recompute_flag where job = 'ejob'").fetchall()
    assert flags and all("cast" in p for (p,) in flags), flags


def _owners_orders(example_dsn, mallory, cust_type: str = "bigint", partitioned: bool = False) -> None:
    """mallory's customers, her orders (mal.ord, cust_id of cust_type; partitioned: one partition mal.ord_1)
    and her job tot keyed by customer. An admin's public.lines references her orders."""
    with _as(example_dsn, mallory) as m:
        _plant_steal(m)
        if cust_type == "mal.d":
            m.execute("create domain mal.d as bigint")
        m.execute("create table mal.cust (id bigint primary key)")
        m.execute("insert into mal.cust values (1)")
        m.execute(
            f"create table mal.ord (id bigint primary key, cust_id {cust_type} references mal.cust)"
            + (" partition by range (id)" if partitioned else "")
        )
        if partitioned:
            m.execute("create table mal.ord_1 partition of mal.ord for values from (0) to (100)")
        m.execute("insert into mal.ord values (10, 1)")
        m.execute("grant select, references on mal.ord to public")
        m.execute(
            "create table mal.tot"
            " (cust_id bigint primary key references mal.cust on delete cascade, n bigint)"
        )
        m.execute(
            "create function mal.totf(ids bigint[]) returns table (cust_id bigint, n bigint) language sql"
            " stable as 'select c.id, 0::bigint from mal.cust c"
            " where ids is null or c.id = any(ids)'"
        )
        m.execute(
            "select lockstep.define_derived('tot', 'mal.tot', 'mal.totf(bigint[])', parent => 'mal.cust')"
        )


def _plant_policy(example_dsn, mallory, table: str) -> None:
    """mallory's row security on her table, its policy her mal.steal()."""
    with _as(example_dsn, mallory) as m:
        m.execute(f"alter table {table} enable row level security")
        m.execute(f"create policy p on {table} for select using (mal.steal())")


WATCH_THROUGH = (
    "select lockstep.watch('tot', 'public.lines', 'ord_id',"
    " through => 'mal.ord', through_column => 'cust_id')"
)


@pytest.mark.parametrize(
    ("cust_type", "fn"),
    [("bigint", "lockstep.enqueue_w_"), ("mal.d", "lockstep.enqueue_through()")],
)
def test_a_watch_through_the_owners_table_runs_none_of_its_code_as_the_writer(
    ex, example_dsn, mallory, roles, cust_type, fn
):
    """An admin watches the application's table through mallory's (her orders map its lines to her
    customers). She enables row security on her table after the watch. Neither the generated trigger
    (built-in types) nor the shared one (her domain) reads it as the writer: they flag the job."""
    _owners_orders(example_dsn, mallory, cust_type)
    ex.execute("create table public.lines (id bigint primary key, ord_id bigint references mal.ord)")
    ex.execute(WATCH_THROUGH)
    fns = ex.execute(
        "select p.oid::regprocedure::text from pg_trigger t join pg_proc p on p.oid = t.tgfoid"
        " where t.tgrelid = 'public.lines'::regclass and not t.tgisinternal"
    ).fetchall()
    assert {f for (f,) in fns if f != "lockstep.enqueue_trigger()"} and all(
        f.startswith(fn) for (f,) in fns if f != "lockstep.enqueue_trigger()"
    ), fns
    app = roles(
        "lockstep_app",
        APP_GRANTS,
        ["grant insert (job, problem) on lockstep.recompute_flag to {role}"],
        ["grant insert on public.lines to {role}", "grant select on public.secret to {role}"],
    )
    _plant_policy(example_dsn, mallory, "mal.ord")
    ex.execute("delete from lockstep.recompute_flag")
    with psycopg.connect(as_role(example_dsn, app), autocommit=True) as a:
        a.execute("insert into public.lines values (1, 10)")
    assert ex.execute(LOOT).fetchone()[0] == 0
    flags = ex.execute("select problem from lockstep.recompute_flag where job = 'tot'").fetchall()
    assert flags and all("row security" in p for (p,) in flags), flags


@pytest.mark.parametrize("where", ["table", "partition"])
def test_a_watch_through_a_table_with_another_owners_row_security_is_refused(ex, example_dsn, mallory, where):
    """mallory's orders (or their partition) have row security before the admin's watch through them:
    watch() refuses it (42501), saying what to do, and changes nothing."""
    _owners_orders(example_dsn, mallory, partitioned=where == "partition")
    _plant_policy(example_dsn, mallory, "mal.ord" if where == "table" else "mal.ord_1")
    ex.execute("create table public.lines (id bigint primary key, ord_id bigint references mal.ord)")
    before = snapshot(ex, "lockstep.through_entry")
    with raises_sqlstate("42501", match="row security") as info:
        ex.execute(WATCH_THROUGH)
    assert "own mal.ord" in (info.value.diag.message_hint or ""), info.value.diag.message_hint
    assert snapshot(ex, "lockstep.through_entry") == before
    assert ex.execute(
        "select count(*) from pg_trigger where tgrelid in ('public.lines'::regclass, 'mal.ord'::regclass)"
        " and not tgisinternal"
    ).fetchone() == (0,)
    assert ex.execute(LOOT).fetchone()[0] == 0


def test_a_through_column_that_converts_only_by_the_owners_cast_is_refused(ex, example_dsn, mallory):
    """mallory's orders hold the customer as her enum; after her job, she adds an implicit cast of it to
    bigint (the key type): the trigger would run her cast as the writer. watch() refuses the column
    (LSQ01) and changes nothing."""
    with _as(example_dsn, mallory) as m:
        _plant_steal(m)
        m.execute("create type mal.e as enum ('a')")
        m.execute(
            "create function mal.e_int(x mal.e) returns bigint language plpgsql as $$ begin"
            " perform mal.steal(); return 1; end $$"
        )
        m.execute("create table mal.cust (id bigint primary key)")
        m.execute("insert into mal.cust values (1)")
        m.execute("create table mal.ord (id bigint primary key, cust_id mal.e)")
        m.execute("insert into mal.ord values (10, 'a')")
        m.execute("grant select, references on mal.ord to public")
        m.execute("create table mal.tot (cust_id bigint primary key references mal.cust on delete cascade)")
        m.execute(
            "create function mal.totf(ids bigint[]) returns table (cust_id bigint) language sql"
            " stable as 'select c.id from mal.cust c where ids is null or c.id = any(ids)'"
        )
        m.execute(
            "select lockstep.define_derived('tot', 'mal.tot', 'mal.totf(bigint[])', parent => 'mal.cust')"
        )
        m.execute("create cast (mal.e as bigint) with function mal.e_int(mal.e) as implicit")
    ex.execute("create table public.lines (id bigint primary key, ord_id bigint references mal.ord)")
    before = snapshot(ex, "lockstep.through_entry")
    with raises_sqlstate("LSQ01", match="a cast a role added"):
        ex.execute(WATCH_THROUGH)
    assert snapshot(ex, "lockstep.through_entry") == before
    ex.execute("insert into public.lines values (1, 10)")
    assert ex.execute(LOOT).fetchone()[0] == 0


def _composite_job(m: psycopg.Connection) -> None:
    """mallory's derived job keyed by (mal.e, int), her composite type mal.ck of her enum and an int."""
    m.execute("create type mal.e as enum ('a', 'b')")
    m.execute("create type mal.ck as (e mal.e, n int)")
    m.execute("create table mal.p (e mal.e, n int, primary key (e, n))")
    m.execute("insert into mal.p values ('a', 1), ('b', 2)")
    m.execute(
        "create table mal.c (e mal.e, n int, primary key (e, n),"
        " foreign key (e, n) references mal.p on delete cascade)"
    )
    m.execute(
        "create function mal.fc(keys mal.ck[]) returns table (e mal.e, n int) language sql"
        " as 'select e, n from mal.p where keys is null or row(e, n)::mal.ck = any(keys)'"
    )
    m.execute("select lockstep.define_derived('cjob', 'mal.c', 'mal.fc(mal.ck[])', parent => 'mal.p')")
    m.execute("insert into lockstep.queue (job, key) values ('cjob', '(a,1)'), ('cjob', '(b,2)')")


@pytest.mark.parametrize("cast", ["enum field", "composite", "array"])
def test_a_composite_key_whose_owner_added_a_cast_is_refused_not_cast(ex, example_dsn, mallory, cast):
    """mallory keys a job by her composite type, then adds a cast through her function: of the enum field's
    type, of the composite type itself, or from text[] to the key type's array (the cast lockstep's
    canonical text would take from queued keys). No superuser's pass, retry or enqueue runs it."""
    with _as(example_dsn, mallory) as m:
        _plant_steal(m)
        _composite_job(m)
        if cast == "enum field":
            _plant_enum_casts(m)
        else:
            source, target = ("mal.ck", "text") if cast == "composite" else ("text[]", "mal.ck[]")
            m.execute(
                f"create function mal.conv(x {source}) returns {target} language plpgsql as $$ begin"
                f" perform mal.steal(); return null; end $$"
            )
            m.execute(f"create cast ({source} as {target}) with function mal.conv({source})")
    ex.execute("update lockstep.job_state set next_run_at = now() + interval '1 day' where job = 'cjob'")
    res = result(ex, "lockstep.work(%s)", "cjob")
    assert res["outcome"] == "failed" and "cast" in res["error"], res
    with raises_sqlstate("LSD04", match="cast"):
        ex.execute("select lockstep.retry('cjob', array[row('a', 1)]::mal.ck[])")
    with raises_sqlstate("LSD04", match="cast"):
        ex.execute("select lockstep.enqueue('cjob', array[row('a', 1)]::mal.ck[])")
    assert ex.execute(LOOT).fetchone()[0] == 0


@pytest.mark.parametrize("watcher", ["admin", "mallory"])
@pytest.mark.parametrize("fields", ["text", "enum"])
def test_a_composite_key_type_altered_after_the_watch_never_runs_the_owners_code_as_the_writer(
    ex, example_dsn, mallory, watcher, fields
):
    """The watch's trigger converts the source's key columns to the composite key type as the writer.
    After the watch, mallory changes a field of her type into her domain, whose CHECK runs her function:
    it would keep the writer's loot, or raise it into the job's flag, which mallory reads. The writer's
    statements run none of it: the trigger flags the job instead."""
    with _as(example_dsn, mallory) as m:
        _plant_steal(m)
        m.execute(
            "create function mal.leak() returns boolean language plpgsql as $$ begin perform mal.steal();"
            " if has_table_privilege('public.secret', 'select') then raise exception 'leak %',"
            " (select string_agg(v, ',') from public.secret); end if; return true; end $$"
        )
        ftype = "text" if fields == "text" else "mal.e"
        if fields == "enum":
            m.execute("create type mal.e as enum ('a', 'b')")
        m.execute(f"create type mal.ck as (e {ftype}, n int)")
        m.execute(f"create table mal.p (e {ftype}, n int, primary key (e, n))")
        m.execute(
            "create table mal.c (e text, n int, primary key (e, n),"
            " foreign key (e, n) references mal.p on delete cascade)".replace("e text", f"e {ftype}")
        )
        m.execute(
            f"create function mal.fc(keys mal.ck[]) returns table (e {ftype}, n int) language sql"
            " as 'select e, n from mal.p where keys is null or row(e, n)::mal.ck = any(keys)'"
        )
        m.execute("select lockstep.define_derived('cjob', 'mal.c', 'mal.fc(mal.ck[])', parent => 'mal.p')")
        m.execute("grant insert, update, delete on mal.p to public")
        if watcher == "mallory":
            m.execute("select lockstep.watch('cjob', 'mal.p', key_columns => array['e', 'n']::name[])")
    if watcher == "admin":
        ex.execute("select lockstep.watch('cjob', 'mal.p', key_columns => array['e', 'n']::name[])")
    with _as(example_dsn, mallory) as m:
        m.execute("create domain mal.dn as int check (mal.leak())")
        m.execute("alter type mal.ck alter attribute n type mal.dn")
    ex.execute("delete from lockstep.recompute_flag")
    ex.execute("insert into mal.p values ('b', 3)")
    ex.execute("update mal.p set n = 4 where n = 3")
    ex.execute("delete from mal.p where n = 4")
    assert ex.execute(LOOT).fetchone()[0] == 0
    flags = [p for (p,) in ex.execute("select problem from lockstep.recompute_flag where job = 'cjob'")]
    assert flags and not any("s3cr3t" in p for p in flags), flags


def test_an_enum_key_array_cast_is_refused(ex, example_dsn, mallory):
    """A cast from text[] to the key type's array, through the owner's function, would run where lockstep
    reads queued keys back ($1::key_type[]): refused for a one-column enum key too."""
    with _as(example_dsn, mallory) as m:
        _plant_steal(m)
        _enum_job(m)
        m.execute(
            "create function mal.to_ea(t text[]) returns mal.e[] language plpgsql as $$ begin"
            " perform mal.steal(); return array['a']::mal.e[]; end $$"
        )
        m.execute("create cast (text[] as mal.e[]) with function mal.to_ea(text[])")
        m.execute("insert into lockstep.queue (job, key) values ('ejob', 'a'), ('ejob', 'b')")
    ex.execute("update lockstep.job_state set next_run_at = now() + interval '1 day' where job = 'ejob'")
    res = result(ex, "lockstep.work(%s)", "ejob")
    assert res["outcome"] == "failed" and "cast" in res["error"], res
    assert ex.execute(LOOT).fetchone()[0] == 0


# 2. a domain's CHECK in _drift ---------------------------------------------------------------------------


def test_a_failed_run_never_evaluates_a_domain_check_of_the_target(ex, example_dsn, mallory):
    """A failed run looks for drift of the definition; it read each column's type by casting NULL to it,
    which evaluates a domain's CHECK: mallory's function, with the runner's rights."""
    with _as(example_dsn, mallory) as m:
        _plant_steal(m)
        m.execute("create domain mal.d as text check (mal.steal())")
        m.execute("create table mal.dt (id bigint primary key, v mal.d)")
        m.execute(
            "create function mal.df(ids bigint[]) returns table (id bigint, v mal.d) language plpgsql as $$"
            " begin if ids is null or cardinality(ids) > 0 then raise exception 'boom'; end if; end $$"
        )
        m.execute("select lockstep.define_derived('dj', 'mal.dt', 'mal.df(bigint[])')")
    res = result(ex, "lockstep.recompute(%s)", "dj")
    assert res["outcome"] == "failed" and "boom" in res["error"], res
    assert ex.execute(LOOT).fetchone()[0] == 0


# 3. a forged recompute flag ------------------------------------------------------------------------------


def test_a_flag_no_snapshot_will_see_is_cleared_by_the_recompute(ex):
    """A flag with an xid not yet assigned stayed for ever: every run recomputed in full, no worker pass."""
    ex.execute(
        "insert into lockstep.recompute_flag (job, problem, xid)"
        " values ('exam_keys', 'forged', '999999999999')"
    )
    assert result(ex, "lockstep.recompute(%s)", "exam_keys")["outcome"] == "done"
    assert (
        ex.execute("select count(*) from lockstep.recompute_flag where job = 'exam_keys'").fetchone()[0] == 0
    )
    res = result(ex, "lockstep.run(%s)", "exam_keys")
    assert res["action"] != "recompute", res


def test_the_app_recipe_adds_flags_and_queue_entries_but_sets_none_of_lockstep_columns(
    ex, example_dsn, roles
):
    app = roles(
        "lockstep_app",
        APP_GRANTS,
        ["grant insert (job, problem) on lockstep.recompute_flag to {role}"],
        EXAMPLE_APP_GRANTS,
    )
    with _as(example_dsn, app) as a:
        a.execute("insert into lockstep.recompute_flag (job, problem) values ('exam_keys', 'a flag')")
        a.execute("insert into lockstep.queue (job, key) values ('exam_keys', '1')")
        forged = [
            "insert into lockstep.recompute_flag (job, problem, xid)"
            " values ('exam_keys', 'x', '999999999999')",
            "insert into lockstep.recompute_flag (job, problem, flagged_at)"
            " values ('exam_keys', 'x', 'infinity')",
            "insert into lockstep.queue (job, key, ready_at) values ('exam_keys', '1', 'infinity')",
            "insert into lockstep.queue (job, key, enqueued_at) values ('exam_keys', '1', '-infinity')",
        ]
        for stmt in forged:
            with raises_sqlstate("42501"):
                a.execute(stmt)


# 4. a queue entry at -infinity ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stmt",
    [
        "insert into lockstep.queue (job, key, enqueued_at) values ('exam_keys', '1', '-infinity')",
        "insert into lockstep.queue (job, key, ready_at) values ('exam_keys', '1', 'infinity')",
        "insert into lockstep.recompute_flag (job, problem, flagged_at)"
        " values ('exam_keys', 'x', '-infinity')",
    ],
    ids=["enqueued-minus-infinity", "ready-infinity", "flagged-minus-infinity"],
)
def test_lockstep_timestamps_are_finite(ex, stmt):
    with raises_sqlstate("23514"):
        ex.execute(stmt)
    assert ex.execute("select count(*) from lockstep.status").fetchone()[0] >= 1


# 5. a per-job time limit -------------------------------------------------------------------------------


def test_a_job_over_its_time_limit_fails_with_backoff_and_the_runner_goes_on(ex):
    """A generic job sleeping 30 s held a shared runner (and its SIGTERM) for 30 s."""
    ex.execute("create function public.slow() returns void language sql as 'select pg_sleep(30)'")
    ex.execute("select lockstep.define_job('slow', 'public.slow()', timeout => '50 milliseconds')")
    assert (
        ex.execute("select timeout from lockstep.job where job = 'slow'").fetchone()[0].total_seconds()
        == 0.05
    )
    res = db.run_job(ex, "slow")
    assert res.outcome == "failed" and "statement timeout" in res.error, res
    state = ex.execute(
        "select consecutive_failures, next_run_at > now() + interval '30 minutes' from lockstep.job_state"
        " where job = 'slow'"
    ).fetchone()
    assert state == (1, True)  # the job's backoff (1 hour by default)
    assert ex.execute("show statement_timeout").fetchone()[0] == "0"
    ex.execute("update example.exam set title = 'x y' where id = 1")  # the runner's connection goes on
    assert db.run_job(ex, "exam_keys").outcome == "done"


def test_a_job_that_catches_the_timeout_still_fails_over_its_time_limit(ex, example_dsn, mallory):
    """mallory's job catches the statement timeout's cancel (PL/pgSQL may catch query_canceled) and goes on:
    the timer does not fire twice, so its run ended 'done', without the backoff."""
    with _as(example_dsn, mallory) as m:
        m.execute(
            "create function mal.slow() returns void language plpgsql as $$ begin"
            " begin perform pg_sleep(30); exception when query_canceled then null; end;"
            " insert into mal.loot values ('went on'); end $$"
        )
        m.execute("select lockstep.define_job('mslow', 'mal.slow()', timeout => '50 milliseconds')")
    res = db.run_job(ex, "mslow")
    assert res.outcome == "failed" and "time limit" in res.error, res
    state = ex.execute(
        "select consecutive_failures, next_run_at > now() + interval '30 minutes' from lockstep.job_state"
        " where job = 'mslow'"
    ).fetchone()
    assert state == (1, True)  # the job's backoff (1 hour by default)
    assert ex.execute("select count(*) from mal.loot").fetchone()[0] == 0  # its writes rolled back
    assert db.run_job(ex, "mine").outcome == "done"  # the runner's connection goes on


def test_a_derived_job_over_its_time_limit_fails(ex):
    ex.execute(
        "select lockstep.define_derived('exam_keys', 'example.exam_key',"
        " 'example.exam_key_compute(bigint[])', parent => 'example.exam', parent_column => 'exam_id',"
        " every => '1 day', timeout => '50 milliseconds')"
    )
    ex.execute(
        "create or replace function example.exam_key_compute(ids bigint[])"
        " returns table (exam_id bigint, key text, weight integer)"
        " language plpgsql as $$ begin perform pg_sleep(30); end $$"
    )
    ex.execute("update lockstep.job_state set next_run_at = now() where job = 'exam_keys'")
    res = db.run_job(ex, "exam_keys")
    assert (res.action, res.outcome) == ("recompute", "failed") and "statement timeout" in res.error, res


def test_the_time_limit_defaults_to_five_minutes_and_must_be_positive(ex):
    ex.execute("create function public.lockstep_noop() returns void language sql as 'select'")
    assert (
        ex.execute("select timeout from lockstep.job where job = 'exam_keys'").fetchone()[0].total_seconds()
        == 300
    )
    for bad in ("0", "-1 second", "30 days"):
        with raises_sqlstate("22023"):
            ex.execute("select lockstep.define_job('x', 'public.lockstep_noop()', timeout => %s)", [bad])
    ex.execute("set statement_timeout = '10ms'")  # a shorter limit of the session's own is kept
    ex.execute("select lockstep.set_time_limit('exam_keys')")
    assert ex.execute("show statement_timeout").fetchone()[0] == "10ms"


def test_definer_functions_refuse_a_time_limit_statement_timeout_cannot_hold(ex, example_dsn, mallory):
    """define_* check the timeout; the definer functions they write through, which every role may call, did
    not: mallory's job of 100 days failed every run in lockstep.set_time_limit (22023), logged by the runner
    as an error."""
    with _as(example_dsn, mallory) as m:
        with raises_sqlstate("22023"):
            m.execute("select lockstep._update_job('mine', timeout => '100 days')")
        with raises_sqlstate("22023"):
            m.execute(
                "do $$ declare j lockstep.job; begin"
                " select * into j from lockstep.job x where x.job = 'mine';"
                " j.timeout := '100 days'; perform lockstep._put_job(j); end $$"
            )
    timeout = ex.execute("select timeout from lockstep.job where job = 'mine'").fetchone()[0]
    assert timeout.total_seconds() == 300


# 6. the caller's session settings -----------------------------------------------------------------------


def test_running_another_owners_job_leaves_the_callers_search_path(ex, mallory):
    ex.execute("set search_path = example, public")
    assert result(ex, "lockstep.run(%s)", "mine")["outcome"] == "done"
    assert ex.execute("show search_path").fetchone()[0] == "example, public"
    assert result(ex, "lockstep.recompute(%s)", "mine")["outcome"] == "done"
    assert ex.execute("show search_path").fetchone()[0] == "example, public"
    ex.execute("select count(*) from exam")  # the caller's own names still resolve


def test_a_job_that_sets_the_sessions_settings_leaves_the_caller_its_own(ex, example_dsn, mallory):
    """A plain SET in a job's code outlives the SET clauses it runs under; run/recompute/work put back what
    the caller had."""
    with _as(example_dsn, mallory) as m:
        m.execute(
            "create or replace function mal.f(ids bigint[]) returns table (id bigint, v text)"
            " language plpgsql"
            " as $$ begin set search_path = mal; set datestyle = 'SQL, DMY'; set lock_timeout = '1ms';"
            " return query select 1::bigint, 'x'::text; end $$"
        )
    ex.execute("set search_path = example, public")
    before = ex.execute("select current_setting('DateStyle'), current_setting('lock_timeout')").fetchone()
    assert result(ex, "lockstep.recompute(%s)", "mine")["outcome"] == "done"
    assert ex.execute("show search_path").fetchone()[0] == "example, public"
    assert (
        ex.execute("select current_setting('DateStyle'), current_setting('lock_timeout')").fetchone()
        == before
    )


def test_the_entry_points_are_safe_under_a_hostile_search_path(ex):
    """run, recompute and work have no SET search_path (they read the caller's settings): every name in
    them is qualified."""
    ex.execute(HOSTILE_PATH_SQL)
    ex.execute("update example.exam set title = 'x y' where id = 1")
    ex.execute("set search_path = hostile, pg_catalog, public")
    assert result(ex, "lockstep.work(%s)", "exam_keys")["outcome"] == "done"
    assert result(ex, "lockstep.recompute(%s)", "exam_keys")["outcome"] == "done"
    assert result(ex, "lockstep.run(%s)", "exam_keys")["outcome"] in ("idle", "not_due")
    assert ex.execute("show search_path").fetchone()[0] == "hostile, pg_catalog, public"


# table locks ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["app", "owner", "runner"])
def test_no_recipe_role_can_lock_lockstep_tables(ex, example_dsn, roles, recipe):
    """An owner of the recipe held ACCESS EXCLUSIVE on lockstep.queue and lockstep.job: every application
    write of every watched table then waited. SHARE is the weakest mode that blocks an application's
    INSERT into the queue."""
    grants = {
        "app": (APP_GRANTS, ["grant insert (job, problem) on lockstep.recompute_flag to {role}"]),
        "owner": (OWNER_GRANTS, EXAMPLE_OWNER_GRANTS),
        # with the run history's grants (docs/security.md)
        "runner": (RUNNER_GRANTS, RUN_LOG_GRANTS),
    }[recipe]
    names = {"owner": roles("exam_owner", login=False)} if recipe == "runner" else {}
    role = roles(f"lockstep_{recipe}", *grants, **names)
    with psycopg.connect(as_role(example_dsn, role)) as c:
        for t in LOCKSTEP_TABLES + ("run_log", "setting", "viewer", "through_entry"):
            with raises_sqlstate("42501"):
                c.execute(f"lock table lockstep.{t} in share mode nowait")
            c.rollback()
        # nor lock another owner's rows (exam_keys is the superuser's): its column grants allow row locks,
        # which row security confines to the jobs it manages
        for t in ("job", "job_state", "key_failure", "queue"):
            try:
                rows = c.execute(f"select from lockstep.{t} where job = 'exam_keys' for key share").fetchall()
            except psycopg.errors.InsufficientPrivilege:
                rows = []
            c.rollback()
            assert rows == [], (t, rows)


@pytest.mark.parametrize(
    "call",
    ["select * from lockstep.verify('mine')", "select * from lockstep.preview('mine')"],
    ids=["verify", "preview"],
)
def test_verify_and_preview_leave_the_callers_search_path(ex, example_dsn, mallory, call):
    with _as(example_dsn, mallory) as m:
        m.execute(
            "create or replace function mal.f(ids bigint[]) returns table (id bigint, v text)"
            " language plpgsql as $$ begin set search_path = mal; set datestyle = 'SQL, DMY';"
            " return query select 1::bigint, 'x'::text; end $$"
        )
    ex.execute("set search_path = example, public")
    before = ex.execute("select current_setting('DateStyle')").fetchone()[0]
    ex.execute(call).fetchall()
    assert ex.execute("show search_path").fetchone()[0] == "example, public"
    assert ex.execute("select current_setting('DateStyle')").fetchone()[0] == before


def test_define_derived_of_a_query_leaves_the_callers_settings(ex):
    """define_derived(query => ...) plans the query with enable_seqscan and plan_cache_mode of its own:
    set for the rest of the caller's transaction (SET LOCAL), over the caller's own values."""
    ex.execute(
        "create table public.qt"
        " (exam_id bigint primary key references example.exam on delete cascade, n bigint)"
    )
    with ex.transaction():
        ex.execute("set local enable_seqscan = off")
        ex.execute("set local plan_cache_mode = force_custom_plan")
        ex.execute(
            "select lockstep.define_derived('qt', 'public.qt', parent => 'example.exam', query =>"
            " 'select e.id as exam_id, count(*) as n from example.exam e group by e.id')"
        )
        settings = "select current_setting('enable_seqscan'), current_setting('plan_cache_mode')"
        assert ex.execute(settings).fetchone() == ("off", "force_custom_plan")


def test_lockstep_definer_functions_change_only_the_jobs_the_caller_manages(ex, example_dsn, roles):
    """lockstep deletes its own rows in SECURITY DEFINER functions (no recipe role holds DELETE), which
    every role may call: each refuses a job its caller does not manage. _take_through, a definer function
    asking lockstep._may_manage (the definer's own rights there), handed another owner's through keys to
    anyone."""
    other = roles("exam_owner", OWNER_GRANTS)
    ex.execute("insert into lockstep.queue (job, key) values ('exam_keys', '1')")
    ex.execute("insert into lockstep.recompute_flag (job, problem) values ('exam_keys', 'x')")
    ex.execute(
        "insert into lockstep.key_failure (job, key, attempts, last_error, retry_at) values"
        " ('exam_keys', '1', 1, 'boom', now())"
    )
    ex.execute(
        "insert into lockstep.through_entry (job, through, key)"
        " values ('exam_keys', 'example.exam'::regclass::oid, '1')"
    )
    before = snapshot(ex, "lockstep.through_entry", "lockstep.run_log")
    # a runner of the recipe serving another owner: the same
    runner = roles("lockstep_runner", RUNNER_GRANTS, attrs="noinherit", owner=other)
    for role in (other, runner):
        with psycopg.connect(as_role(example_dsn, role), autocommit=True) as o:
            for call in DEFINER_CALLS:
                with raises_sqlstate("42501", match="may not change the rows of job"):
                    o.execute(f"select {call}")
            assert o.execute("select * from lockstep._take_through('exam_keys')").fetchall() == []
            # a new job owned by a role it may not act as (the registry's insert policy), or in another
            # owner's lock group
            for owner, group in ((ex.info.user, "fresh"), (other, "exam_keys")):
                with raises_sqlstate("42501"):
                    o.execute(
                        sql.SQL(
                            "do $$ declare j lockstep.job; begin"
                            " select * into j from lockstep.job x where x.job = 'exam_keys';"
                            " j.job := 'fresh'; j.owner := {}; j.lock_group := {};"
                            " perform lockstep._put_job(j); end $$"
                        ).format(sql.Literal(owner), sql.Literal(group))
                    )
    assert snapshot(ex, "lockstep.through_entry", "lockstep.run_log") == before


_JOB = "(select j from lockstep.job j where j.job = 'exam_keys')"
_PASS = "null::lockstep._pass"
# every security definer function of lockstep that writes a job's rows, called for exam_keys
DEFINER_CALLS = [
    *(f"lockstep._delete('{t}', 'exam_keys')" for t in LOCKSTEP_TABLES if t != "job_state"),
    "lockstep._delete('queue', 'exam_keys', array['1'])",
    "lockstep._settle_failures('exam_keys', array['1'], '{}', array['2'])",
    f"lockstep._settle_entries({_JOB}, array[1::bigint], array['(0,1)'::tid], array['1'], '{{}}',"
    " '{}', '{}')",
    f"lockstep._clear_flag({_JOB}, pg_current_snapshot(), now())",
    "lockstep._prune_run_log('exam_keys', 100, interval '1 second', 0)",
    # the runner's writes
    f"lockstep._finish({_JOB}, 'work', 'failed', now(), null, 'forged')",
    f"lockstep._record_failures({_JOB}, '{{}}', '{{}}', {_PASS}, '{{}}', array['2'], array['bad'])",
    "lockstep._add_suspects('exam_keys', array['1', '2'])",
    "lockstep._due_by('exam_keys', now())",
    "lockstep._failures_due('exam_keys', array['1'])",
    "lockstep._state_rest('exam_keys', 5, 10, 'x')",
    "lockstep._state_handoff('exam_keys', 5, 1, 2)",
    "lockstep._state_poisoned('exam_keys')",
    "lockstep._state_make('exam_keys')",
    "lockstep._append_keys('exam_keys', array['1'])",
    # the owner's writes (21_owner_writes.sql)
    f"lockstep._put_job({_JOB})",
    "lockstep._update_job('exam_keys', batch_parents => 1)",
    "lockstep._update_job('exam_keys', pause => true, paused_by => current_user)",
    "lockstep._flag_job('exam_keys', 'x')",
    f"lockstep._end_backoff({_JOB}, true)",
    "lockstep._save_parent_keys('exam_keys', array['exam_id']::name[], array['id']::name[])",
    "lockstep._watched_via_wal('exam_keys')",
]


def test_lockstep_definer_functions_write_nothing_for_a_job_that_does_not_exist(ex, example_dsn, roles):
    """A job that does not exist has no owner to check, and every role may call lockstep's definer
    functions: _append_keys queued keys of any job name for a role holding nothing but USAGE on schema
    lockstep, past the recipes' grants on the queue (a flood of the shared queue, or entries waiting for a
    job another owner defines later under that name), and _prune_run_log deleted every job's history."""
    nobody = roles("lockstep_nobody", ["grant usage on schema lockstep to {role}"])
    # the history of a job dropped since (history outlives its job), and exam_keys' run
    ex.execute(
        "insert into lockstep.run_log (job, owner, lock_group, kind, action, outcome, started_at,"
        " finished_at, duration_ms, run_no)"
        " values ('no_such_job', 'x', 'x', 'job', 'call', 'done', now(), now(), 1, 1)"
    )
    assert ex.execute("select count(*) from lockstep.run_log where job = 'exam_keys'").fetchone()[0] > 0
    before = snapshot(ex, "lockstep.through_entry", "lockstep.run_log")
    with psycopg.connect(as_role(example_dsn, nobody), autocommit=True) as o:
        # _prune_run_log pruned every job's rows older than the keep its caller passed, and job's own by the
        # run count its caller passed
        prune = "lockstep._prune_run_log('no_such_job', 1000000, interval '1 microsecond', 0, 'recompute')"
        for call in [*DEFINER_CALLS, prune]:
            call = call.replace("exam_keys", "no_such_job")
            try:
                o.execute(f"select {call}")
            except psycopg.Error:
                pass  # refused, or nothing to change
    assert snapshot(ex, "lockstep.through_entry", "lockstep.run_log") == before


def test_only_a_job_owner_recipe_defines_jobs(ex, example_dsn, roles):
    """docs/security.md's table: an application may not define a job. Since the owner writes through
    lockstep._put_job, a definer function every role may call, the application (and a role holding only
    USAGE on schema lockstep) defined jobs owned by itself, and so took job names and lock groups: a new
    job needs the owner recipe's grant of EXECUTE on lockstep._put_job (or INSERT on lockstep.job)."""
    ex.execute("create function public.lockstep_noop() returns void language sql as 'select'")
    app = roles("lockstep_app", APP_GRANTS, ["grant select on lockstep.job to {role}"])
    nobody = roles("lockstep_nobody", ["grant usage on schema lockstep to {role}"])
    for role in (app, nobody):
        with psycopg.connect(as_role(example_dsn, role), autocommit=True) as c:
            with raises_sqlstate("42501"):
                c.execute(
                    "select lockstep.define_job(%s, 'public.lockstep_noop()', lock_group => 'taken')", [role]
                )
    assert ex.execute("select count(*) from lockstep.job where lock_group = 'taken'").fetchone()[0] == 0


def test_a_composite_key_type_altered_after_define_runs_no_owner_code_as_the_runner(ex, example_dsn, mallory):
    """mallory makes a field of her composite key type her domain after define_derived: its CHECK would run
    where a superuser's recompute or pass, retry or enqueue converts keys. None of them runs it with the
    caller's rights."""
    with _as(example_dsn, mallory) as m:
        _plant_steal(m)
        _composite_job(m)
        m.execute("create domain mal.dn as int check (mal.steal())")
        m.execute("alter type mal.ck alter attribute n type mal.dn")
    ex.execute("update lockstep.job_state set next_run_at = now() + interval '1 day' where job = 'cjob'")
    res = result(ex, "lockstep.work(%s)", "cjob")
    assert res["outcome"] == "failed", res
    result(ex, "lockstep.recompute(%s)", "cjob")  # compute and write run as mallory: her CHECK may run there
    with raises_sqlstate("LSD04", match="domain"):
        ex.execute("select lockstep.enqueue('cjob', array[row('a', 1)]::mal.ck[])")
    with raises_sqlstate("LSD04", match="domain"):
        ex.execute("select lockstep.retry('cjob', array[row('a', 1)]::mal.ck[])")
    assert ex.execute(LOOT).fetchone()[0] == 0
