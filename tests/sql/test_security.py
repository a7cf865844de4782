"""Security: SECURITY INVOKER functions with a pinned search_path, least-privilege roles, job ownership.

Roles are cluster-wide, so every role a test creates gets a unique name (``<recipe>_<hex>``) and is
dropped at teardown (``drop owned by`` in the test database first). Recipes are documented in
docs/security.md; the grant lists below are the same ones.
Behaviour that needs a SQL change is marked ``xfail(strict=True)`` with the proposed change.
"""

from __future__ import annotations

import logging
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from util import raises_sqlstate, result, snapshot

from lockstep.lab import example

log = logging.getLogger(__name__)

# The role recipes of docs/security.md, one privilege per line: test_recipe_grant_is_needed removes each
# line in turn and shows the role's work then fails; test_recipes_are_enough does the work with exactly these.
# {owner} is the job owner role, {lsowner} the role owning lockstep's tables. The tests revoke TEMP on the
# database from PUBLIC first, so the TEMP grant is shown needed too.

# the job owner: defines, watches, retries and drops its jobs; its jobs run with its rights. It owns the
# watched tables (watch and drop_job are DDL on them).
# No INSERT, UPDATE or DELETE on lockstep's tables: it writes through lockstep's security-definer functions
# (lockstep._put_job, _update_job, _flag_job, _append_keys, _delete, ...), each for a job it manages. So it
# may not lock them (LOCK TABLE beyond ACCESS SHARE needs UPDATE, DELETE or TRUNCATE).
JOB_STATE_UPDATE = (
    "next_run_at, retry_at, last_outcome, last_action, last_started_at, last_finished_at, last_duration_ms,"
    " last_inserted, last_updated, last_deleted, last_skipped, last_more, consecutive_failures, last_error,"
    " recompute_error, runs, recompute_total, recompute_queue_from, recompute_queue_to, deferred_until,"
    " recompute_rest, recompute_rest_session, recompute_rest_at, recompute_poisoned_at,"
    " recompute_poison_cured"
)
OWNER_GRANTS = [
    "grant usage on schema lockstep to {role}",
    "grant select on lockstep.job to {role}",
    "grant select on lockstep.job_state to {role}",
    "grant select on lockstep.queue to {role}",
    "grant select on lockstep.key_failure to {role}",
    "grant select on lockstep.recompute_flag to {role}",  # lockstep.status shows the flags
    "grant select on lockstep.status to {role}",
    "grant select on lockstep.failing_keys to {role}",
    "grant temp on database {db} to {role}",  # the compute/write work tables and its trampoline
    # define_* of a new job: the grant that marks a job owner (lockstep._check_may_define)
    "grant execute on function lockstep._put_job(lockstep.job) to {role}",
]
# ... and the example job's own tables (the owner owns example.exam and example.exam_item)
EXAMPLE_OWNER_GRANTS = [
    "grant usage on schema example to {role}",
    "grant select on example.exam_key to {role}",
    "grant insert on example.exam_key to {role}",
    "grant update on example.exam_key to {role}",
    "grant delete on example.exam_key to {role}",
]
# the runner (`lockstep run`): reads lockstep's bookkeeping, and is a member of each job owner role: it runs
# each job as its owner (SET ROLE), so it needs no right on the jobs' tables. NOINHERIT: the membership only
# lets it switch to the owner, it does not give the runner the owner's rights. It holds no INSERT, UPDATE
# or DELETE on lockstep's tables: its writes (status rows, failures, the queue, the run history) go through
# lockstep's security definer functions, each for a caller that manages the job (lockstep._check_manages).
RUNNER_GRANTS = [
    "grant usage on schema lockstep to {role}",
    "grant select on lockstep.job to {role}",
    "grant select on lockstep.job_state to {role}",
    "grant select on lockstep.queue to {role}",
    "grant select on lockstep.key_failure to {role}",
    "grant select on lockstep.recompute_flag to {role}",  # due() and run(): a flagged job's recompute is due
    "grant {owner} to {role}",
    "grant select on lockstep.status to {role}",  # `lockstep status`, metrics
]
# ... and to read the run history (`lockstep status --history`); its runs are logged without it
RUN_LOG_GRANTS = [
    "grant select on lockstep.run_log to {role}",
]
# an application role that writes the watched tables: its statement triggers enqueue as that role.
APP_GRANTS = [
    "grant usage on schema lockstep to {role}",
    "grant insert (job, key) on lockstep.queue to {role}",
]
EXAMPLE_APP_GRANTS = [
    "grant usage on schema example to {role}",
    "grant select on example.exam to {role}",
    "grant update on example.exam to {role}",
    "grant delete on example.exam to {role}",
    "grant insert on example.exam_item to {role}",
]
# the lockstep admin: sees and manages every job. A member of the role that owns lockstep's tables (the
# role `lockstep migrate` ran as), or a superuser.
ADMIN_GRANTS = [
    "grant {lsowner} to {role}",
]


def dbname(dsn: str) -> str:
    return conninfo_to_dict(dsn)["dbname"]


def as_role(dsn: str, role: str) -> str:
    return make_conninfo(dsn, user=role)


@pytest.fixture
def roles(example_dsn: str) -> Iterator[Callable[..., str]]:
    """``roles(recipe, *grant_lists, login=True, attrs="", **names) -> name``: a new role in the cluster with
    these grants; ``{role}`` is the new role, ``{db}`` the database, other ``{x}`` the role names given."""
    made: list[str] = []
    admin = psycopg.connect(example_dsn, autocommit=True)

    def _make(recipe: str, *grant_lists: list[str], login: bool = True, attrs: str = "", **names: str) -> str:
        name = f"{recipe}_{secrets.token_hex(4)}"
        admin.execute(
            sql.SQL("create role {} " + ("login" if login else "nologin") + " " + attrs).format(
                sql.Identifier(name)
            )
        )
        made.append(name)
        idents = {k: sql.Identifier(v) for k, v in names.items()}
        for grants in grant_lists:
            for g in grants:
                admin.execute(
                    sql.SQL(g).format(
                        role=sql.Identifier(name), db=sql.Identifier(dbname(example_dsn)), **idents
                    )
                )
        return name

    yield _make
    for name in reversed(made):
        admin.execute(sql.SQL("drop owned by {} cascade").format(sql.Identifier(name)))
    for name in reversed(made):
        admin.execute(sql.SQL("drop role {}").format(sql.Identifier(name)))
    admin.close()


def app_writes(ex: psycopg.Connection) -> None:
    """Some app changes of every kind: edit, new item, delete, new parent."""
    ex.execute("update example.exam set title = 'alpha beta gamma ' || id where id between 1 and 15")
    ex.execute(
        "insert into example.exam_item (exam_id, body) select id, 'delta epsilon' from example.exam"
        " where id between 16 and 25"
    )
    ex.execute("delete from example.exam where id between 26 and 30")
    ex.execute("select example.seed(5, 1001)")


def lockstep_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lockstep", *args], capture_output=True, text=True, timeout=60
    )


# functions ---------------------------------------------------------------------------------------------


def test_every_function_is_security_invoker_with_a_pinned_search_path(conn):
    rows = conn.execute(
        "select p.oid::regprocedure::text, p.prosecdef, p.proconfig from pg_proc p"
        " where p.pronamespace = 'lockstep'::regnamespace order by 1"
    ).fetchall()
    assert len(rows) > 20
    definer = [name for name, secdef, _ in rows if secdef]
    # the two that keep lockstep.through_entry out of every recipe: an application's trigger appends through
    # keys, a worker takes back only those of jobs it may manage (17_through.sql); both pinned, as below
    # and the deletions of lockstep's own rows, each for a caller that manages the job
    # (lockstep._check_manages): no recipe role holds DELETE or a table-wide UPDATE on lockstep's tables,
    # so none may lock them
    # and the runner's writes: status rows, failures, queue appends, the run history (no user code runs in
    # them: keys arrive as canonical text); the capture's, for a role that may read its slot
    # (lockstep._check_captures)
    # and the owner's writes (21_owner_writes.sql, lockstep._end_backoff, lockstep._save_parent_keys): the
    # owner recipe holds no INSERT, UPDATE or DELETE on lockstep's tables; and whether its job is watched
    # through the WAL (lockstep._watched_via_wal: it holds nothing on lockstep.wal_watch), its watch's row
    # there (lockstep._put_wal_watch), its unwatch's deletion (lockstep._delete_wal_watch) and the watched
    # tables the capture's cleanup keeps (lockstep._wal_sources)
    assert definer == [
        "lockstep._add_suspects(text,text[])",
        "lockstep._append_keys(text,text[])",
        "lockstep._append_through(text,oid,text[])",
        "lockstep._capture_done(pg_lsn,bigint)",
        "lockstep._capture_families()",
        "lockstep._capture_forget()",
        "lockstep._capture_queue(text[],text[],text[],text[])",
        "lockstep._capture_slot_made(name,text,boolean)",
        "lockstep._clear_flag(lockstep.job,pg_snapshot,timestamp with time zone)",
        "lockstep._delete(text,text,text[],text[])",
        "lockstep._delete_wal_watch(text,regclass)",
        "lockstep._due_by(text,timestamp with time zone,boolean)",
        "lockstep._end_backoff(lockstep.job,boolean)",
        "lockstep._failures_due(text,text[])",
        "lockstep._finish(lockstep.job,text,text,timestamp with time zone,lockstep._pass,text,boolean,"
        "boolean)",
        "lockstep._flag_job(text,text)",
        "lockstep._prune_run_log(text,bigint,interval,integer,text)",
        "lockstep._put_job(lockstep.job)",
        "lockstep._put_wal_watch(text,regclass,name[],boolean)",
        "lockstep._record_failures(lockstep.job,text[],bigint[],lockstep._pass,text[],text[],text[])",
        "lockstep._save_parent_keys(text,name[],name[])",
        "lockstep._settle_entries(lockstep.job,bigint[],tid[],text[],text[],text[],text[])",
        "lockstep._settle_failures(text,text[],text[],text[])",
        "lockstep._state_handoff(text,bigint,bigint,bigint)",
        "lockstep._state_make(text)",
        "lockstep._state_poisoned(text)",
        "lockstep._state_rest(text,bigint,bigint,text)",
        "lockstep._take_through(text)",
        "lockstep._update_job(text,integer,integer,interval,boolean,name)",
        "lockstep._wal_sources()",
        "lockstep._watched_via_wal(text,regclass)",
        "lockstep.add_viewer(regrole,regrole)",
        "lockstep.remove_viewer(regrole,regrole)",
    ], f"SECURITY DEFINER functions: {definer}"
    unpinned = [name for name, _, config in rows if "search_path=pg_catalog, pg_temp" not in (config or [])]
    # the one exception, by design: the trigger functions (lockstep.enqueue_trigger() and those watch()
    # generates, lockstep.enqueue_w_<hash>()) run in every watched application statement, and a SET clause
    # costs each call a GUC save and restore and two recomputations of the session's namespace search path;
    # their bodies qualify every name instead (08_enqueue.sql), which
    # test_the_trigger_is_safe_under_a_hostile_search_path checks.
    unpinned = [name for name in unpinned if not name.startswith("lockstep.enqueue_w_")]
    # and lockstep._pgo_int, a SQL expression the planner inlines into the WAL capture's statement (once per
    # change; a SET clause forbids inlining): it names only pg_catalog's functions, operators and types;
    # and the entry points that run jobs, with lockstep._settings: they read the caller's settings first and
    # put back those the job's code changed for the session (test_security_hostile.py)
    assert unpinned == [
        "lockstep._pgo_int(bytea,integer,integer)",
        "lockstep._settings()",
        "lockstep.enqueue_trigger()",
        "lockstep.recompute(text)",
        "lockstep.run(text)",
        "lockstep.verify(text)",
        "lockstep.verify(text,anyarray)",
        "lockstep.work(text,integer)",
    ], f"no SET search_path = pg_catalog, pg_temp: {unpinned}"


# an application search_path that shadows every operator, function and type the trigger function uses
HOSTILE_PATH_SQL = """
create schema hostile;
do $$
declare
    o text[];
    i integer := 0;
begin
    foreach o slice 1 in array array[
            ['=', 'text', 'text', 'boolean'], ['<>', 'text', 'text', 'boolean'],
            ['=', 'integer', 'integer', 'boolean'], ['>', 'integer', 'integer', 'boolean'],
            ['=', 'name', 'name', 'boolean'], ['=', 'oid', 'oid', 'boolean'],
            ['->', 'jsonb', 'text', 'jsonb'], ['#>>', 'jsonb', 'text[]', 'text']] loop
        i := i + 1;
        execute format('create function hostile.boom%s(%s, %s) returns %s language plpgsql'
                       ' as $b$ begin raise exception ''hostile operator''; end $b$', i, o[2], o[3], o[4]);
        execute format('create operator hostile.%s (leftarg = %s, rightarg = %s, function = hostile.boom%s)',
                       o[1], o[2], o[3], i);
    end loop;
end $$;
create function hostile.to_jsonb(anyelement) returns jsonb
language plpgsql as $$ begin raise exception 'hostile function'; end $$;
create function hostile.cardinality(anyarray) returns integer
language plpgsql as $$ begin raise exception 'hostile function'; end $$;
create function hostile.unnest(anyarray) returns setof text
language plpgsql as $$ begin raise exception 'hostile function'; end $$;
create domain hostile.text as integer check (value < 0);
create domain hostile.name as integer check (value < 0);
create table hostile.queue (job text, key text);
create table hostile.lockstep_new (aid integer);
"""


def test_the_trigger_is_safe_under_a_hostile_search_path(ex, exconnect):
    """lockstep.enqueue_trigger() has no SET search_path: under a search_path that puts shadowing operators,
    functions and types before pg_catalog, watched statements still succeed and enqueue exactly their keys,
    on the fast path (watch's triggers) and the general path (one's own transition-table names), and a
    trigger that cannot enqueue still only flags its job."""
    ex.execute(HOSTILE_PATH_SQL)
    ex.execute(
        "create table hostile.mine (aid bigint primary key);"
        "create trigger mine after insert on hostile.mine referencing new table as fresh"
        " for each statement execute function lockstep.enqueue_trigger('exam_keys', 'aid');"
        "create table hostile.day (d date primary key);"
        "create trigger day after insert on hostile.day referencing new table as lockstep_new"
        " for each statement execute function lockstep.enqueue_trigger('exam_keys', 'd');"
        "create table hostile.fast (aid bigint primary key);"
        "create trigger fast after insert on hostile.fast referencing new table as lockstep_new"
        " for each statement execute function lockstep.enqueue_trigger('exam_keys', 'aid', 'bigint');"
    )
    assert (
        ex.execute(
            "select tgfoid::regproc::text from pg_trigger where tgrelid = 'example.exam'::regclass"
            " and not tgisinternal limit 1"
        )
        .fetchone()[0]
        .startswith("lockstep.enqueue_w_")
    )  # watch()'s: generated for example.exam.id
    ex.execute("delete from lockstep.queue")
    app = exconnect()
    app.execute("set search_path = hostile, pg_catalog, public")
    app.execute("update example.exam set title = title where id in (3, 1)")  # watch's generated trigger
    app.execute("insert into hostile.fast values (4), (2)")  # the shared function's fast path
    app.execute("insert into hostile.mine values (7), (5)")  # own names: general path
    queued = [k for (k,) in ex.execute("select key from lockstep.queue order by id")]
    assert queued == ["1", "3", "2", "4", "5", "7"]
    assert ex.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0
    app.execute("insert into hostile.day values ('2024-02-01')")  # a date key for a bigint job: flagged
    assert ex.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 1


def test_lockstep_objects_have_default_acls_only(conn):
    """Nothing is granted to PUBLIC on lockstep's tables: access is whatever the DBA grants."""
    acl = conn.execute(
        "select relname, relacl::text from pg_class where relnamespace = 'lockstep'::regnamespace"
        " and relkind in ('r', 'v', 'S') and relacl is not null"
    ).fetchall()
    assert acl == []
    assert conn.execute("select nspacl from pg_namespace where nspname = 'lockstep'").fetchone()[0] is None


# the recipes, end to end -------------------------------------------------------------------------------

RECIPES = {
    "owner": OWNER_GRANTS + EXAMPLE_OWNER_GRANTS,
    "runner": RUNNER_GRANTS,
    "app": APP_GRANTS + EXAMPLE_APP_GRANTS,
    "admin": ADMIN_GRANTS,
}


class Refused(Exception):
    """A step of a role's work did not do what it should (a failed run, a row it should see missing)."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise Refused(what)


def _run(r: psycopg.Connection, job: str) -> dict:
    res = result(r, "lockstep.run(%s)", job)
    _check(res["outcome"] != "failed", f"run failed: {res['error']}")
    return res


def _drain(r: psycopg.Connection, job: str) -> None:
    """Worker passes until no ready key is left (bounded)."""
    for _ in range(20):
        res = _run(r, job)
        if not (res["outcome"] == "done" and res["more"]):
            return
    raise AssertionError("queue not drained in 20 passes")


def _lockstep_owned_by(ex: psycopg.Connection, role: str) -> None:
    """Give schema lockstep, its tables and views and its SECURITY DEFINER functions to role, as if
    `lockstep migrate` had run as it."""
    ex.execute(sql.SQL("alter schema lockstep owner to {}").format(sql.Identifier(role)))
    rels = ex.execute(
        "select c.relname from pg_class c"
        " where c.relnamespace = 'lockstep'::regnamespace and c.relkind in ('r', 'v')"
    ).fetchall()
    for (t,) in rels:
        ex.execute(
            sql.SQL("alter table {} owner to {}").format(sql.Identifier("lockstep", t), sql.Identifier(role))
        )
    for (f,) in ex.execute(
        "select p.oid::regprocedure::text from pg_proc p where p.pronamespace = 'lockstep'::regnamespace"
        " and p.prosecdef"
    ).fetchall():
        ex.execute(sql.SQL("alter function {} owner to {}").format(sql.SQL(f), sql.Identifier(role)))


def recipe_scenario(ex: psycopg.Connection, dsn: str, roles, without: tuple[str, int] | None = None) -> None:
    """Every role does its work with exactly its recipe (minus one grant: ``without = (recipe, index)``).

    The owner defines and watches exam_keys; the app writes; the runner recomputes (one parent held by
    another session, so it is skipped and re-queued) and drains the queue; a poison key fails, the app
    fixes it and the owner retries it; owner, runner and admin read the status; the admin changes the job,
    the owner drops it. Raises on the first step that fails (42501 or Refused).
    """

    def grants(recipe: str) -> list[str]:
        g = list(RECIPES[recipe])
        if without and without[0] == recipe:
            del g[without[1]]
        return g

    ex.execute(sql.SQL("revoke temp on database {} from public").format(sql.Identifier(dbname(dsn))))
    ex.execute("select lockstep.drop_job('exam_keys')")
    ex.execute("alter table example.exam_key add constraint no_poison check (key <> 'poison')")
    lsowner = roles("lockstep_owner", login=False)
    _lockstep_owned_by(ex, lsowner)
    owner = roles("exam_owner", grants("owner"))
    for t in ("exam", "exam_item"):
        ex.execute(
            sql.SQL("alter table {} owner to {}").format(sql.Identifier("example", t), sql.Identifier(owner))
        )
    runner = roles("lockstep_runner", grants("runner"), attrs="noinherit", owner=owner)
    app = roles("lockstep_app", grants("app"))
    admin = roles("lockstep_admin", grants("admin"), lsowner=lsowner)

    o = psycopg.connect(as_role(dsn, owner), autocommit=True)
    r = psycopg.connect(as_role(dsn, runner), autocommit=True)
    a = psycopg.connect(as_role(dsn, app), autocommit=True)
    ad = psycopg.connect(as_role(dsn, admin), autocommit=True)
    side = psycopg.connect(dsn)  # superuser, in a transaction: holds a parent the recompute must skip
    try:
        o.execute(
            "select lockstep.define_derived('exam_keys', 'example.exam_key',"
            " 'example.exam_key_compute(bigint[])',"
            " parent => 'example.exam', parent_column => 'exam_id', every => '1 day')"
        )
        o.execute("select lockstep.watch('exam_keys', 'example.exam', 'id')")
        o.execute("select lockstep.watch('exam_keys', 'example.exam_item', 'exam_id')")

        a.execute("update example.exam set title = 'alpha beta gamma ' || id where id between 1 and 5")
        a.execute("insert into example.exam_item (exam_id, body) values (8, 'delta epsilon')")
        a.execute("delete from example.exam where id = 9")
        # exam 3's change is not in the queue (as for a change made before watch()): the recompute finds
        # it, skips the parent held below and must queue it itself (an entry already queued it leaves)
        ex.execute("delete from lockstep.queue where key = '3'")
        side.execute("select 1 from example.exam where id = 3 for update")
        res = _run(r, "exam_keys")  # due since define: the recompute
        _check((res["action"], res["outcome"]) == ("recompute", "done"), f"recompute: {res}")
        assert res["skipped"] == 1, res
        side.rollback()
        _drain(r, "exam_keys")

        a.execute("update example.exam set title = 'poison pill' where id = 7")
        res = _run(r, "exam_keys")
        _check(res["error"] is not None and "no_poison" in res["error"], f"poison: {res}")
        failing = o.execute("select key from lockstep.failing_keys where job = 'exam_keys'").fetchall()
        _check(failing == [("7",)], f"owner sees failing keys {failing}")
        a.execute("update example.exam set title = 'cured' where id = 7")
        _check(o.execute("select lockstep.retry('exam_keys')").fetchone()[0] == 1, "retry")
        _drain(r, "exam_keys")
        assert example.divergence(ex) == (0, 0)
        # the owner writes its own watched table: a TRUNCATE flags the job (it failed with 42501 before
        # the recipe had INSERT on recompute_flag)
        o.execute("truncate example.exam_item")
        res = _run(r, "exam_keys")
        _check((res["action"], res["outcome"]) == ("recompute", "done"), f"flagged recompute: {res}")
        _drain(r, "exam_keys")
        assert example.divergence(ex) == (0, 0)

        # an admin deleted the job's status row (the job had vanished from status and
        # due(), and no runner ran it again): the runner makes it again, and the recompute is due
        ex.execute("delete from lockstep.job_state where job = 'exam_keys'")
        res = _run(r, "exam_keys")
        _check((res["action"], res["outcome"]) == ("recompute", "done"), f"status row made again: {res}")
        for c, who in ((o, "owner"), (r, "runner"), (ad, "admin")):
            rows = c.execute(
                "select last_outcome, last_error from lockstep.status"
                " where job = 'exam_keys' and needs_recompute is null"
            ).fetchall()
            _check(rows == [("done", None)], f"{who} reads status {rows}")
        ad.execute("select lockstep.set_max_attempts('exam_keys', 3)")  # another role's job
        o.execute("select lockstep.set_max_attempts('exam_keys', 4)")
        o.execute("select lockstep.drop_job('exam_keys')")
        assert ex.execute("select count(*) from lockstep.job").fetchone()[0] == 0
    finally:
        for c in (o, r, a, ad, side):
            c.close()


def test_recipes_are_enough(ex, example_dsn, roles):
    recipe_scenario(ex, example_dsn, roles)


@pytest.mark.parametrize(
    ("recipe", "index"),
    [(name, i) for name, grants in RECIPES.items() for i in range(len(grants))],
    ids=[
        f"{name}-{g.split(' to ')[0].removeprefix('grant ')}"
        for name, grants in RECIPES.items()
        for g in grants
    ],
)
def test_recipe_grant_is_needed(ex, example_dsn, roles, recipe, index):
    with pytest.raises((psycopg.errors.InsufficientPrivilege, Refused)) as info:
        recipe_scenario(ex, example_dsn, roles, without=(recipe, index))
    text = str(info.value)
    log.info("without %r: %s", RECIPES[recipe][index], text.splitlines()[0])
    assert isinstance(info.value, psycopg.errors.InsufficientPrivilege) or "permission denied" in text, text


def test_the_owner_recipe_holds_no_write_on_lockstep_tables(ex, roles):
    """The owner recipe held column INSERT and UPDATE on lockstep's tables: it writes through lockstep's
    security-definer functions now, and holds no INSERT, UPDATE, DELETE or TRUNCATE, at table or column
    level, on any of them."""
    owner = roles("exam_owner", OWNER_GRANTS)
    tables = [
        t
        for (t,) in ex.execute(
            "select c.oid::regclass::text from pg_class c where c.relnamespace = 'lockstep'::regnamespace"
            " and c.relkind in ('r', 'p', 'v') order by 1"
        ).fetchall()
    ]
    assert "lockstep.job" in tables and "lockstep.queue" in tables
    held = ex.execute(
        "select t, p from unnest(%s::text[]) t,"
        " unnest(array['INSERT', 'UPDATE', 'DELETE', 'TRUNCATE']) p"
        " where has_table_privilege(%s, t, p)"
        "    or (p in ('INSERT', 'UPDATE') and has_any_column_privilege(%s, t, p))",
        [tables, owner, owner],
    ).fetchall()
    assert held == []
    columns = ex.execute(
        "select table_name, column_name, privilege_type from information_schema.column_privileges"
        " where grantee = %s and table_schema = 'lockstep' and privilege_type <> 'SELECT'",
        [owner],
    ).fetchall()
    assert columns == []


def test_an_owner_writes_lockstep_rows_only_through_lockstep(ex, example_dsn, roles):
    """An owner of the recipe defines, redefines, pauses, resumes, enqueues, retries, watches, unwatches and
    drops its jobs; its own INSERT or UPDATE of lockstep's rows fails with 42501."""
    ex.execute("select lockstep.drop_job('exam_keys')")
    ex.execute("create function public.lockstep_tick() returns void language sql as 'select'")
    owner = roles("exam_owner", OWNER_GRANTS, EXAMPLE_OWNER_GRANTS)
    for t in ("exam", "exam_item"):
        ex.execute(
            sql.SQL("alter table {} owner to {}").format(sql.Identifier("example", t), sql.Identifier(owner))
        )
    with _as(example_dsn, owner) as o:
        o.execute("select lockstep.define_job('tick', 'public.lockstep_tick()')")
        o.execute("select lockstep.define_job('tick', 'public.lockstep_tick()', every => '1 hour')")
        o.execute(
            "select lockstep.define_derived('mine', 'example.exam_key', 'example.exam_key_compute(bigint[])',"
            " parent => 'example.exam', parent_column => 'exam_id')"
        )
        o.execute(
            "select lockstep.define_derived('mine', 'example.exam_key', 'example.exam_key_compute(bigint[])',"
            " parent => 'example.exam', parent_column => 'exam_id', every => '2 hours',"
            " timeout => '1 minute')"
        )
        o.execute("select lockstep.set_batch_parents('mine', 50)")
        o.execute("select lockstep.set_max_attempts('mine', 7)")
        assert o.execute("select lockstep.pause('mine')").fetchone()[0] is not None
        assert o.execute("select lockstep.resume('mine')").fetchone()[0] is True
        o.execute("select lockstep.watch('mine', 'example.exam', 'id')")
        o.execute("select lockstep.watch('mine', 'example.exam_item', 'exam_id')")
        assert o.execute("select lockstep.enqueue('mine', array[2, 1]::bigint[])").fetchone()[0] == 2
        ex.execute(
            "insert into lockstep.key_failure (job, key, attempts, last_error, retry_at)"
            " values ('mine', '3', 2, 'boom', now() + interval '1 hour')"
        )
        ex.execute("update lockstep.job_state set recompute_poisoned_at = now() where job = 'tick'")
        assert o.execute("select lockstep.retry('mine')").fetchone()[0] == 1
        assert o.execute("select lockstep.retry('tick')").fetchone()[0] == 0
        o.execute("truncate example.exam_item")  # its own TRUNCATE of a watched table flags the job
        job = ex.execute(
            "select every, timeout, batch_parents, max_attempts, paused_at from lockstep.job"
            " where job = 'mine'"
        ).fetchone()
        assert job == (timedelta(hours=2), timedelta(minutes=1), 50, 7, None)
        queued = ex.execute("select key from lockstep.queue where job = 'mine' order by id").fetchall()
        assert queued == [("1",), ("2",), ("3",)]
        flags = ex.execute(
            "select problem from lockstep.recompute_flag where job = 'mine' order by flagged_at"
        )
        problems = [p.split(" ")[0] for (p,) in flags.fetchall()]
        assert problems == ["resumed", "example.exam", "example.exam_item", "TRUNCATE"], problems
        poisoned = ex.execute("select recompute_poisoned_at from lockstep.job_state where job = 'tick'")
        assert poisoned.fetchone() == (None,)
        before = snapshot(ex)
        for stmt in [
            "insert into lockstep.job (job, kind, lock_group, call, every, backoff)"
            " values ('x', 'job', 'x', 'public.lockstep_tick()', '1 minute', '1 hour')",
            "update lockstep.job set every = '1 minute' where job = 'mine'",
            "update lockstep.job_state set next_run_at = now() where job = 'mine'",
            "insert into lockstep.job_state (job) values ('x')",
            "insert into lockstep.queue (job, key) values ('mine', '9')",
            "insert into lockstep.recompute_flag (job, problem) values ('mine', 'x')",
            "update lockstep.key_failure set attempts = 0 where job = 'mine'",
            "delete from lockstep.queue where job = 'mine'",
        ]:
            with raises_sqlstate("42501"):
                o.execute(stmt)
        assert snapshot(ex) == before
        o.execute("select lockstep.unwatch('mine', 'example.exam')")
        o.execute("select lockstep.unwatch('mine', 'example.exam_item')")
        o.execute("select lockstep.drop_job('mine')")
        o.execute("select lockstep.drop_job('tick')")
    assert ex.execute("select count(*) from lockstep.job").fetchone()[0] == 0


def test_an_owner_watches_unwatches_and_drops_while_the_database_captures_the_wal(ex, example_dsn, roles):
    """Once another job was watched through the WAL (the capture's publication exists), watch, unwatch and
    drop_job looked for the job's lockstep.wal_watch rows: an owner of the recipe, which holds nothing on
    that table, failed with 42501 in each."""
    ex.execute("select lockstep.drop_job('exam_keys')")
    ex.execute(sql.SQL("create publication {}").format(sql.Identifier(lockstep_capture_publication(ex))))
    owner = roles("exam_owner", OWNER_GRANTS, EXAMPLE_OWNER_GRANTS)
    for t in ("exam", "exam_item"):
        ex.execute(
            sql.SQL("alter table {} owner to {}").format(sql.Identifier("example", t), sql.Identifier(owner))
        )
    with _as(example_dsn, owner) as o:
        o.execute(
            "select lockstep.define_derived('mine', 'example.exam_key', 'example.exam_key_compute(bigint[])',"
            " parent => 'example.exam', parent_column => 'exam_id')"
        )
        o.execute("select lockstep.watch('mine', 'example.exam', 'id')")
        o.execute("select lockstep.unwatch('mine', 'example.exam')")
        o.execute("select lockstep.watch('mine', 'example.exam', 'id')")
        o.execute("select lockstep.drop_job('mine')")
    assert ex.execute("select count(*) from lockstep.job").fetchone()[0] == 0


def lockstep_capture_publication(ex: psycopg.Connection) -> str:
    return ex.execute("select lockstep._capture_publication()").fetchone()[0]


def _recipe_runner_of_exam_keys(ex: psycopg.Connection, roles) -> str:
    """exam_keys handed to a job owner of the recipe (with SELECT on the sources and UPDATE (id) on the
    parent), and a runner of the recipe serving it: the runner's name."""
    owner = roles(
        "exam_owner",
        OWNER_GRANTS,
        EXAMPLE_OWNER_GRANTS,
        [
            "grant select on example.exam, example.exam_item to {role}",
            "grant update (id) on example.exam to {role}",
        ],
    )
    ex.execute(
        sql.SQL("update lockstep.job set owner = {} where job = 'exam_keys'").format(sql.Literal(owner))
    )
    return roles("lockstep_runner", RUNNER_GRANTS, attrs="noinherit", owner=owner)


def test_a_failed_run_by_a_least_privilege_runner_blames_nothing_on_the_definition(ex, example_dsn, roles):
    """A failed run appends what no longer holds of the job's definition (lockstep._drift). Its first version
    ran define_derived's target check, which also checks the caller's privileges on the target: a runner
    of the recipe has none (it runs the job as its owner), so every failed run of its jobs would have been
    blamed on the definition."""
    runner = _recipe_runner_of_exam_keys(ex, roles)
    ex.execute(
        "create or replace function example.exam_key_compute(ids bigint[])"
        " returns table (exam_id bigint, key text, weight integer) language plpgsql stable"
        " as $$ begin raise exception 'the scoring service is down'; end $$"
    )
    ex.execute("update lockstep.job_state set next_run_at = now()")
    with psycopg.connect(as_role(example_dsn, runner), autocommit=True) as r:
        res = result(r, "lockstep.run(%s)", "exam_keys")
    assert res["outcome"] == "failed" and "the scoring service is down" in res["error"], res
    assert "definition" not in res["error"], res["error"]


def test_least_privilege_runner_as_a_cli_process(ex, example_dsn, roles):
    """`lockstep run --once` with the runner recipe: the job runs as its owner, the runner has no right on
    the job's tables."""
    runner = _recipe_runner_of_exam_keys(ex, roles)
    app_writes(ex)
    ex.execute("update lockstep.job_state set next_run_at = now()")  # the recompute is due as well
    p = lockstep_cli("run", "--once", "--dsn", as_role(example_dsn, runner))
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and "ERROR" not in p.stderr, p.stderr
    assert "exam_keys recompute done" in p.stderr, p.stderr
    with psycopg.connect(as_role(example_dsn, runner), autocommit=True) as r:
        _drain(r, "exam_keys")
        with raises_sqlstate("42501"):
            r.execute("select count(*) from example.exam_key")  # it never had the job's rights itself
    assert example.divergence(ex) == (0, 0)
    assert ex.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0


def test_the_runner_recipe_holds_no_write_privilege_on_lockstep_tables(ex, roles):
    """The runner recipe (and the run history's grant) holds no INSERT, UPDATE, DELETE or TRUNCATE on any
    lockstep table, at table or column level: it writes through lockstep's security definer functions."""
    owner = roles("exam_owner", login=False)
    runner = roles("lockstep_runner", RUNNER_GRANTS, RUN_LOG_GRANTS, attrs="noinherit", owner=owner)
    held = ex.execute(
        "select c.relname, p.p from pg_class c"
        " cross join unnest(array['INSERT', 'UPDATE', 'DELETE', 'TRUNCATE']) p(p)"
        " where c.relnamespace = 'lockstep'::regnamespace and c.relkind in ('r', 'p')"
        "   and (has_table_privilege(%(r)s, c.oid, p.p)"
        "        or (p.p in ('INSERT', 'UPDATE') and has_any_column_privilege(%(r)s, c.oid, p.p)))"
        " order by 1, 2",
        {"r": runner},
    ).fetchall()
    assert held == []


def test_a_recipe_runner_records_parks_cures_and_logs_as_a_cli_process(ex, example_dsn, roles):
    """`lockstep run --once` with the runner recipe, which holds no write on lockstep's tables: a recompute
    that meets a poison parent hands every parent to the worker; the worker parks the poison key and logs
    its runs; a recompute after the fix cures it."""
    runner = _recipe_runner_of_exam_keys(ex, roles)
    ex.execute("alter table example.exam_key add constraint no_poison check (key <> 'poison')")
    ex.execute("update lockstep.job set max_attempts = 1 where job = 'exam_keys'")
    app_writes(ex)
    ex.execute("update example.exam set title = 'poison pill' where id = 7")
    ex.execute("update lockstep.job_state set next_run_at = now()")  # the recompute is due
    p = lockstep_cli("run", "--once", "--dsn", as_role(example_dsn, runner))
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and "ERROR" not in p.stderr, p.stderr
    state = ex.execute(
        "select recompute_poisoned_at is not null, recompute_total > 0 from lockstep.job_state"
    ).fetchone()
    assert state == (True, True), p.stderr
    with psycopg.connect(as_role(example_dsn, runner), autocommit=True) as r:
        _drain(r, "exam_keys")
        assert ex.execute("select key, parked from lockstep.key_failure").fetchall() == [("7", True)]
        ex.execute("update example.exam set title = 'cured' where id = 7")
        assert result(r, "lockstep.recompute(%s)", "exam_keys")["outcome"] == "done"
        _drain(r, "exam_keys")
    assert ex.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0
    assert example.divergence(ex) == (0, 0)
    logged = ex.execute(
        "select role, bool_or(action = 'recompute'), bool_or(action = 'work'), bool_or(failed_keys > 0)"
        " from lockstep.run_log where job = 'exam_keys' and role = %s group by role",
        [runner],
    ).fetchall()
    assert logged == [(runner, True, True, True)]


def test_a_least_privilege_runner_compiles_nothing_with_jit(ex, example_dsn, roles):
    """Inside lockstep sequential scans are disabled (each costs 1e10 in an estimate), and for a role under
    row-level security the policies' subplans on lockstep.job are such scans: every statement of a runner
    of the recipe passed jit_above_cost and was JIT-compiled (a work() pass of one key 512 ms against 4-14
    ms for a superuser; due() 157-287 ms). The entry points run with JIT off."""
    owner = roles("exam_owner", OWNER_GRANTS, EXAMPLE_OWNER_GRANTS,
                  ["grant select on example.exam, example.exam_item to {role}",
                   "grant update (id) on example.exam to {role}"])  # fmt: skip
    ex.execute(
        sql.SQL("update lockstep.job set owner = {} where job = 'exam_keys'").format(sql.Literal(owner))
    )
    runner = roles("lockstep_runner", RUNNER_GRANTS, attrs="noinherit", owner=owner)
    app_writes(ex)
    plans: list[str] = []
    ex.add_notice_handler(lambda d: plans.append(d.message_primary or ""))
    for setting in ("log_min_duration = 0", "log_nested_statements = on", "log_level = warning"):
        ex.execute(f"set auto_explain.{setting}")
    ex.execute("load 'auto_explain'")
    ex.execute("set jit_above_cost = 100000")  # the defaults, whatever the server's settings
    ex.execute("set jit_inline_above_cost = 500000")
    ex.execute(sql.SQL("set role {}").format(sql.Identifier(runner)))
    assert ex.execute("select outcome from lockstep.work('exam_keys')").fetchone()[0] == "done"
    ex.execute("select count(*) from lockstep.due()")
    ex.execute("select count(*) from lockstep.status")
    ex.execute("reset role")
    ex.execute("set auto_explain.log_min_duration = -1")
    assert len(plans) > 10
    assert not [p for p in plans if "JIT:" in p], [p for p in plans if "JIT:" in p][:1]


def _poison_recompute_job(ex, example_dsn, roles) -> str:
    """exam_keys given to a recipe owner, computed by example.picky (fails for exam 13 and for the whole
    table); returns a recipe runner that serves the owner."""
    owner = roles("exam_owner", OWNER_GRANTS, EXAMPLE_OWNER_GRANTS,
                  ["grant select on example.exam, example.exam_item to {role}",
                   "grant update (id) on example.exam to {role}"])  # fmt: skip
    ex.execute(
        """create function example.picky(ids bigint[])
           returns table (exam_id bigint, key text, weight integer) language plpgsql stable as $$ begin
               if ids is null or 13 = any(ids) then raise exception 'cannot compute exam 13'; end if;
               return query select * from example.exam_key_compute(ids); end $$"""
    )
    ex.execute(
        sql.SQL("update lockstep.job set owner = {} where job = 'exam_keys'").format(sql.Literal(owner))
    )
    with _as(example_dsn, owner) as o:
        o.execute(
            "select lockstep.define_derived('exam_keys', 'example.exam_key', 'example.picky(bigint[])',"
            " 'example.exam')"
        )
    return roles("lockstep_runner", RUNNER_GRANTS, attrs="noinherit", owner=owner)


def test_a_least_privilege_runner_hands_a_poison_recompute_to_the_worker(ex, example_dsn, roles):
    """A whole-table pass that fails on a poison parent hands every parent to the worker. The parent keys
    were read with the caller's rights: a runner of the recipe (no right on the owner's tables) failed with
    42501 there, nothing was recorded and the job stalled. They are read as the owner now."""
    runner = _poison_recompute_job(ex, example_dsn, roles)
    app_writes(ex)
    with _as(example_dsn, runner) as r:
        res = result(r, "lockstep.recompute(%s)", "exam_keys")
        assert res["outcome"] == "done" and "handed to the worker" in res["error"], res
        for _ in range(20):
            if result(r, "lockstep.work(%s)", "exam_keys")["outcome"] == "idle":
                break
    failing = ex.execute("select key from lockstep.key_failure where job = 'exam_keys'").fetchall()
    assert failing == [("13",)]
    left = ex.execute("select distinct key from lockstep.queue where job = 'exam_keys'").fetchall()
    assert left in ([], [("13",)]), left  # only the poison key's entries may wait for its retry
    differ = ex.execute(  # every other exam is written
        "select count(*) from ((select exam_id, key, weight from example.exam_key where exam_id <> 13"
        "  except all select * from example.exam_key_compute(null) where exam_id <> 13)"
        " union all (select * from example.exam_key_compute(null) where exam_id <> 13"
        "  except all select exam_id, key, weight from example.exam_key where exam_id <> 13)) d"
    ).fetchone()[0]
    assert differ == 0


def test_the_parent_keys_of_a_poison_recompute_are_read_in_the_owners_sandbox(ex, example_dsn, roles):
    """The read of every parent key runs the owner's code where the parent has row security: a policy's
    function that resets the role must not get the runner's session (a first version read the keys under a
    plain SET ROLE, outside the SECURITY DEFINER trampoline compute runs in, and such a function became the
    runner)."""
    runner = _poison_recompute_job(ex, example_dsn, roles)
    ex.execute(
        """create table public.seen (who text);
           grant insert on public.seen to public;
           create function public.spy() returns boolean language plpgsql as $$ begin
               begin perform pg_catalog.set_config('role', 'none', true);
               exception when others then null; end;
               insert into public.seen values (current_user); return true; end $$;
           alter table example.exam enable row level security;
           create policy spy on example.exam using (public.spy())"""
    )
    with _as(example_dsn, runner) as r:
        res = result(r, "lockstep.recompute(%s)", "exam_keys")
    assert res["outcome"] == "done" and "handed to the worker" in res["error"], res
    owner = ex.execute("select owner from lockstep.job where job = 'exam_keys'").fetchone()[0]
    assert ex.execute("select distinct who from public.seen").fetchall() == [(owner,)]


def test_owner_without_update_on_the_parent_cannot_pin_it(ex, example_dsn, roles):
    """FOR KEY SHARE needs UPDATE on some column of the parent: define_derived refuses the job, and a job
    given to such an owner by hand fails as a whole at run time (class 42: the job's error, not its keys';
    the keys stay queued, none is counted as failing or parked)."""
    owner = roles(
        "exam_owner",
        OWNER_GRANTS,
        EXAMPLE_OWNER_GRANTS,
        ["grant select on example.exam, example.exam_item to {role}"],
    )
    with _as(example_dsn, owner) as o:
        with raises_sqlstate("42501", match="lacks UPDATE on parent"):
            o.execute(
                "select lockstep.define_derived('mine', 'example.exam_key',"
                " 'example.exam_key_compute(bigint[])', parent => 'example.exam')"
            )
    ex.execute(
        sql.SQL("update lockstep.job set owner = {} where job = 'exam_keys'").format(sql.Literal(owner))
    )
    ex.execute("update example.exam set title = 'iota kappa' where id between 1 and 3")
    outcome, error = ex.execute("select outcome, error from lockstep.work('exam_keys')").fetchone()
    assert outcome == "failed" and "permission denied for table exam" in error
    assert ex.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0
    queued = ex.execute("select distinct key from lockstep.queue order by 1").fetchall()
    assert queued == [("1",), ("2",), ("3",)]


def test_runner_cannot_touch_tables_it_was_not_granted(ex, example_dsn, roles):
    ex.execute("create table public.secret (v text)")
    ex.execute("insert into public.secret values ('s3cr3t')")
    owner = roles("exam_owner", OWNER_GRANTS, login=False)
    runner = roles("lockstep_runner", RUNNER_GRANTS, attrs="noinherit", owner=owner)
    with psycopg.connect(as_role(example_dsn, runner), autocommit=True) as r:
        for stmt in [
            "select * from public.secret",
            "insert into public.secret values ('x')",
            "delete from public.secret",
            "select * from example.exam",
            "insert into lockstep.job (job, kind, lock_group, call, every, backoff)"
            " values ('x', 'job', 'x', 'pg_catalog.now()', '1 minute', '1 hour')",
            "create table public.mine (v int)",
        ]:
            with raises_sqlstate("42501"):
                r.execute(stmt)
        with raises_sqlstate("42501"):
            r.execute("select lockstep.drop_job('exam_keys')")
        with raises_sqlstate("42501"):
            r.execute("select * from lockstep.failing_keys")  # not in its recipe
    assert ex.execute("select v from public.secret").fetchall() == [("s3cr3t",)]


def test_runner_reads_the_status_of_the_jobs_it_runs(ex, example_dsn, roles):
    owner = roles("exam_owner", OWNER_GRANTS, login=False)
    runner = roles("lockstep_runner", RUNNER_GRANTS, attrs="noinherit", owner=owner)
    p = lockstep_cli("status", "--dsn", as_role(example_dsn, runner))
    # owned by root, whom this runner does not serve: it sees no job, so nothing was checked: exit 4, not
    # 0: a viewer that lost a grant sees no job and must not report healthy while a job is failing
    assert p.returncode == 4 and "exam_keys" not in p.stdout, (p.stdout, p.stderr)
    assert p.stderr.startswith(f"Error: no jobs visible to role {runner}") and "nothing to check" in p.stderr
    ex.execute(
        sql.SQL("update lockstep.job set owner = {} where job = 'exam_keys'").format(sql.Literal(owner))
    )
    p = lockstep_cli("status", "--dsn", as_role(example_dsn, runner))
    assert p.returncode == 0, p.stderr
    assert "exam_keys" in p.stdout


# the application role ----------------------------------------------------------------------------------


def test_app_role_enqueues_through_triggers(ex, example_dsn, roles):
    app = roles(
        "lockstep_app",
        APP_GRANTS,
        EXAMPLE_APP_GRANTS,
        ["grant insert on example.exam to {role}", "grant select on lockstep.job to {role}"],  # enqueue()
    )
    with psycopg.connect(as_role(example_dsn, app), autocommit=True) as a:
        a.execute("update example.exam set title = 'lambda mu' where id = 7")
        a.execute("insert into example.exam_item (exam_id, body) values (8, 'nu xi omicron')")
        a.execute("delete from example.exam where id = 9")  # exam_key rows go by the FK cascade
        a.execute("insert into example.exam (id, title, body) values (5000, 'pi rho', 'sigma tau')")
        assert a.execute("select lockstep.enqueue('exam_keys', array[10::bigint])").fetchone()[0] == 1
        # it sees that the queue has rows, not which keys
        with raises_sqlstate("42501"):
            a.execute("select key from lockstep.queue")
        # and it is not a runner and cannot redefine the job
        with raises_sqlstate("42501"):
            a.execute("select lockstep.work('exam_keys')")
        with raises_sqlstate("42501"):
            a.execute("select lockstep.drop_job('exam_keys')")
        with raises_sqlstate("42501"):
            a.execute("delete from lockstep.queue")
    keys = {k for (k,) in ex.execute("select key from lockstep.queue")}
    assert keys == {"7", "8", "9", "10", "5000"}
    ex.execute("select lockstep.work('exam_keys')")
    assert example.divergence(ex) == (0, 0)


def test_app_writes_neither_notify_nor_read_the_queue(ex, example_dsn, roles, connect):
    """The app's triggers only append to the queue: no NOTIFY (runners poll the queue's sequence), and no
    read of the queue, so the app needs no SELECT on it."""
    app = roles("lockstep_app", APP_GRANTS, EXAMPLE_APP_GRANTS)
    listener = connect(example_dsn)
    listener.execute("listen lockstep")
    with psycopg.connect(as_role(example_dsn, app), autocommit=True) as a:
        a.execute("update example.exam set title = 'one' where id = 1")
        a.execute("update example.exam set title = 'two' where id = 2")
        with raises_sqlstate("42501"):
            a.execute("select count(*) from lockstep.queue")
    assert list(listener.notifies(timeout=0.2, stop_after=1)) == []
    assert sorted(k for (k,) in ex.execute("select key from lockstep.queue")) == ["1", "2"]


def test_app_role_without_queue_grant_cannot_write_watched_tables(ex, example_dsn, roles):
    """The enqueue trigger runs as the writer: without the app grants its write fails (and is undone)."""
    app = roles("lockstep_app", ["grant usage on schema lockstep to {role}"], EXAMPLE_APP_GRANTS)
    with psycopg.connect(as_role(example_dsn, app), autocommit=True) as a:
        with raises_sqlstate("42501"):
            a.execute("update example.exam set title = 'upsilon' where id = 7")
    assert ex.execute("select title from example.exam where id = 7").fetchone()[0] != "upsilon"


def test_an_app_role_granted_the_queue_columns_only_enqueues_and_cannot_forge_an_entry(
    ex, example_dsn, roles
):
    """With INSERT on the whole queue an application role could write `ready_at = 'infinity'`: an entry
    never taken, a queue_lag that grows for ever. docs/security.md offers the grant on
    (job, key) only: every insert lockstep's triggers and enqueue() make names only those columns, and
    watch() counts it as the grant its triggers need."""
    app = roles(
        "lockstep_app",
        [
            "grant usage on schema lockstep to {role}",
            "grant insert (job, key) on lockstep.queue to {role}",
            "grant insert on lockstep.recompute_flag to {role}",
            "grant select on lockstep.job to {role}",
        ],
        EXAMPLE_APP_GRANTS,
    )
    ex.execute("delete from lockstep.queue")
    notices: list[str] = []
    ex.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    ex.execute("select lockstep.watch('exam_keys', 'example.exam', 'id')")
    assert not any(app in n for n in notices), notices
    with psycopg.connect(as_role(example_dsn, app), autocommit=True) as a:
        a.execute("update example.exam set title = 'upsilon' where id = 7")  # the generated trigger
        a.execute("select lockstep.enqueue('exam_keys', array[8])")
        with raises_sqlstate("42501"):
            a.execute("insert into lockstep.queue (job, key, ready_at) values ('exam_keys', '9', 'infinity')")
    keys = ex.execute("select key from lockstep.queue order by id").fetchall()
    assert keys == [("7",), ("8",)]


# job ownership -----------------------------------------------------------------------------------------


def _define_noop(c: psycopg.Connection, job: str = "owned") -> None:
    c.execute("select lockstep.define_job(%s, 'public.lockstep_noop()', every => '1 hour')", [job])


@pytest.fixture
def owners(ex, roles):
    """(owner, other, member): job owner roles; member is a member of owner, other is not."""
    ex.execute("create function public.lockstep_noop() returns void language sql as 'select'")
    owner = roles("exam_owner", OWNER_GRANTS)
    other = roles("exam_owner", OWNER_GRANTS)
    member = roles("exam_owner", OWNER_GRANTS)
    ex.execute(sql.SQL("grant {} to {}").format(sql.Identifier(owner), sql.Identifier(member)))
    return owner, other, member


def test_a_job_cannot_be_retried_by_another_role(ex, example_dsn, owners):
    # retry() of another owner's job returned 0 and `lockstep retry` exited 0 ("0 keys back in the queue;
    # its failure backoff, if any, ended"), changing nothing: row-level security hid the key failures, and
    # only a job without a queue was checked for its owner. Now 42501, as drop_job.
    _, other, _ = owners
    ex.execute(
        "insert into lockstep.key_failure (job, key, attempts, last_error, retry_at, parked)"
        " values ('exam_keys', '5', 5, 'boom', now(), true)"
    )
    before = ex.execute("select * from lockstep.key_failure").fetchall()
    with psycopg.connect(as_role(example_dsn, other), autocommit=True) as x:
        for call in ("lockstep.retry('exam_keys')", "lockstep.retry('exam_keys', array[5])"):
            with raises_sqlstate("42501", match='job "exam_keys" is owned by role "root"'):
                x.execute(f"select {call}")
    assert ex.execute("select * from lockstep.key_failure").fetchall() == before


def test_job_cannot_be_redefined_or_dropped_by_another_role(ex, example_dsn, owners):
    owner, other, _ = owners
    with psycopg.connect(as_role(example_dsn, owner), autocommit=True) as o:
        _define_noop(o)
    assert ex.execute("select owner from lockstep.job where job = 'owned'").fetchone()[0] == owner
    before = ex.execute("select * from lockstep.job where job = 'owned'").fetchone()
    with psycopg.connect(as_role(example_dsn, other), autocommit=True) as x:
        with raises_sqlstate("42501", match=f'owned by role "{owner}"'):
            x.execute("select lockstep.define_job('owned', 'public.lockstep_noop()', every => '1 second')")
        with raises_sqlstate("42501", match=f'owned by role "{owner}"'):
            x.execute("select lockstep.drop_job('owned')")
    assert ex.execute("select * from lockstep.job where job = 'owned'").fetchone() == before
    # watch() too: another role's triggers on its own table fed the job, which its owner could then
    # neither unwatch nor drop
    ex.execute("create table public.feed (id bigint primary key)")
    ex.execute(sql.SQL("alter table public.feed owner to {}").format(sql.Identifier(other)))
    with psycopg.connect(as_role(example_dsn, other), autocommit=True) as x:
        with raises_sqlstate("42501", match='owned by role "root"'):
            x.execute("select lockstep.watch('exam_keys', 'public.feed', 'id')")
    assert (
        ex.execute("select count(*) from pg_trigger where tgrelid = 'public.feed'::regclass").fetchone()[0]
        == 0
    )
    # nor may it put a job in the owner's lock group: it would decide when the owner's jobs may run
    with psycopg.connect(as_role(example_dsn, other), autocommit=True) as x:
        with raises_sqlstate("42501", match='lock group "owned" is used by job "owned"'):
            x.execute(
                "select lockstep.define_job('hog', 'public.lockstep_noop()', lock_group => 'owned',"
                " every => '1 second')"
            )


def test_member_of_the_owner_role_can_redefine_and_drop(ex, example_dsn, owners):
    owner, _, member = owners
    with psycopg.connect(as_role(example_dsn, owner), autocommit=True) as o:
        _define_noop(o)
    with psycopg.connect(as_role(example_dsn, member), autocommit=True) as m:
        m.execute("select lockstep.define_job('owned', 'public.lockstep_noop()', every => '2 hours')")
        assert m.execute("select every from lockstep.job where job = 'owned'").fetchone()[0].days == 0
        m.execute("select lockstep.drop_job('owned')")
    assert ex.execute("select count(*) from lockstep.job where job = 'owned'").fetchone()[0] == 0


def test_ownership_cannot_be_taken_with_plain_dml(ex, example_dsn, owners):
    """The recipe grants no UPDATE of owner; a role granted it is held by row-level security."""
    owner, other, _ = owners
    with psycopg.connect(as_role(example_dsn, owner), autocommit=True) as o:
        _define_noop(o)
    with psycopg.connect(as_role(example_dsn, other), autocommit=True) as x:
        with raises_sqlstate("42501", match="permission denied for table job"):
            x.execute("update lockstep.job set owner = current_user where job = 'owned'")
        ex.execute(sql.SQL("grant update on lockstep.job to {}").format(sql.Identifier(other)))
        taken = x.execute(
            "update lockstep.job set owner = current_user where job = 'owned' returning job"
        ).fetchall()
    assert taken == []


def test_a_renamed_owner_keeps_its_jobs_and_a_new_role_of_the_old_name_gets_none(ex, example_dsn, owners):
    """Jobs stored their owner by name: after an admin renamed the role, a new role created with the old
    name saw the job's status, ran it with its own rights, redefined and dropped it."""
    owner, _, _ = owners
    with psycopg.connect(as_role(example_dsn, owner), autocommit=True) as o:
        _define_noop(o)
        assert result(o, "lockstep.run(%s)", "owned")["outcome"] == "done"
    renamed = owner + "_was"
    ident = sql.Identifier
    ex.execute(sql.SQL("alter role {} rename to {}").format(ident(owner), ident(renamed)))
    ex.execute(sql.SQL("create role {} login").format(ident(owner)))
    try:
        for g in OWNER_GRANTS:
            ex.execute(sql.SQL(g).format(role=ident(owner), db=ident(dbname(example_dsn))))
        with psycopg.connect(as_role(example_dsn, owner), autocommit=True) as x:
            assert x.execute("select * from lockstep.job_state where job = 'owned'").fetchall() == []
            for call in (
                "select lockstep.run('owned')",
                "select lockstep.define_job('owned', 'public.lockstep_noop()', every => '2 hours')",
                "select lockstep.drop_job('owned')",
            ):
                with raises_sqlstate("42501"):
                    x.execute(call)
        assert ex.execute(
            "select runs, every from lockstep.job_state join lockstep.job using (job) where job = 'owned'"
        ).fetchone() == (1, timedelta(hours=1))
        # the renamed role still owns it: sees, runs and redefines it
        with psycopg.connect(as_role(example_dsn, renamed), autocommit=True) as o:
            assert o.execute("select runs from lockstep.job_state where job = 'owned'").fetchone() == (1,)
            ex.execute("update lockstep.job_state set next_run_at = now() where job = 'owned'")
            assert result(o, "lockstep.run(%s)", "owned")["outcome"] == "done"
            o.execute("select lockstep.define_job('owned', 'public.lockstep_noop()', every => '2 hours')")
            o.execute("select lockstep.drop_job('owned')")
    finally:
        ex.execute(sql.SQL("drop owned by {} cascade").format(ident(owner)))
        ex.execute(sql.SQL("drop role {}").format(ident(owner)))
        ex.execute(sql.SQL("alter role {} rename to {}").format(ident(renamed), ident(owner)))


def test_a_renamed_owner_keeps_its_status_row_when_it_is_gone_and_a_new_role_of_the_old_name_does_not(
    ex, example_dsn, owners
):
    """lockstep.status shows a job whose status row is gone to the roles that manage it: it judged them by
    the owner's name, so after a rename a new role of the old name saw the job, and the renamed owner not."""
    owner, _, _ = owners
    with psycopg.connect(as_role(example_dsn, owner), autocommit=True) as o:
        _define_noop(o)
    ex.execute("delete from lockstep.job_state where job = 'owned'")
    renamed = owner + "_was"
    ident = sql.Identifier
    ex.execute(sql.SQL("alter role {} rename to {}").format(ident(owner), ident(renamed)))
    ex.execute(sql.SQL("create role {} login").format(ident(owner)))
    seen = "select job, last_outcome from lockstep.status where job = 'owned'"
    try:
        for g in OWNER_GRANTS:
            ex.execute(sql.SQL(g).format(role=ident(owner), db=ident(dbname(example_dsn))))
        with psycopg.connect(as_role(example_dsn, owner), autocommit=True) as x:
            assert x.execute(seen).fetchall() == []
        with psycopg.connect(as_role(example_dsn, renamed), autocommit=True) as o:
            assert o.execute(seen).fetchall() == [("owned", None)]
    finally:
        ex.execute(sql.SQL("drop owned by {} cascade").format(ident(owner)))
        ex.execute(sql.SQL("drop role {}").format(ident(owner)))
        ex.execute(sql.SQL("alter role {} rename to {}").format(ident(renamed), ident(owner)))


def test_a_renamed_viewer_keeps_its_view_and_a_new_role_of_the_old_name_gets_none(
    ex, example_dsn, owners, roles
):
    """lockstep.viewer named its roles by name: after a rename the viewer lost its view, and a new role of
    the old name read the owner's status rows."""
    owner, _, _ = owners
    with psycopg.connect(as_role(example_dsn, owner), autocommit=True) as o:
        _define_noop(o)
    reads = [
        "grant usage on schema lockstep to {role}",
        "grant select on lockstep.job, lockstep.job_state, lockstep.viewer to {role}",
    ]
    viewer = roles("viewer", reads)
    ex.execute("insert into lockstep.viewer values (%s, %s)", [viewer, owner])
    renamed = viewer + "_was"
    ident = sql.Identifier
    ex.execute(sql.SQL("alter role {} rename to {}").format(ident(viewer), ident(renamed)))
    ex.execute(sql.SQL("create role {} login").format(ident(viewer)))
    try:
        for g in reads:
            ex.execute(sql.SQL(g).format(role=ident(viewer)))
        seen = "select job from lockstep.job_state where job = 'owned'"
        with psycopg.connect(as_role(example_dsn, viewer), autocommit=True) as x:
            assert x.execute(seen).fetchall() == []
        with psycopg.connect(as_role(example_dsn, renamed), autocommit=True) as v:
            assert v.execute(seen).fetchall() == [("owned",)]
    finally:
        ex.execute(sql.SQL("drop owned by {} cascade").format(ident(viewer)))
        ex.execute(sql.SQL("drop role {}").format(ident(viewer)))
        ex.execute(sql.SQL("alter role {} rename to {}").format(ident(renamed), ident(viewer)))


def test_an_owner_of_the_recipe_names_its_viewers_and_another_owner_gets_42501(
    ex, example_dsn, owners, roles
):
    """The owner recipe holds nothing on lockstep.viewer: its owner names its viewers through
    lockstep.add_viewer and remove_viewer (security definer), and an owner of other jobs may not."""
    owner, other, member = owners
    with _as(example_dsn, owner) as o:
        _define_noop(o)
    viewer = roles(
        "viewer",
        [
            "grant usage on schema lockstep to {role}",
            "grant select on lockstep.job, lockstep.job_state, lockstep.viewer to {role}",
        ],
    )
    seen = "select job from lockstep.job_state where job = 'owned'"
    with _as(example_dsn, viewer) as v:
        assert v.execute(seen).fetchall() == []
        with _as(example_dsn, owner) as o:
            with raises_sqlstate("42501"):
                o.execute("insert into lockstep.viewer values (%s, %s)", [viewer, owner])
            assert o.execute("select lockstep.add_viewer(%s, %s)", [viewer, owner]).fetchone()[0] is True
            assert o.execute("select lockstep.add_viewer(%s, %s)", [viewer, owner]).fetchone()[0] is False
        assert v.execute(seen).fetchall() == [("owned",)]
        before = snapshot(ex, "lockstep.viewer")
        with _as(example_dsn, other) as x:
            for f in ("add_viewer", "remove_viewer"):
                with raises_sqlstate("42501"):
                    x.execute(f"select lockstep.{f}(%s, %s)", [other, owner])
                with raises_sqlstate("42501"):
                    x.execute(f"select lockstep.{f}(%s, %s)", [viewer, owner])
        with _as(example_dsn, owner) as o:
            with raises_sqlstate("42704"):  # the viewer must be a role
                o.execute("select lockstep.add_viewer('no_such_role_x', %s)", [owner])
        assert snapshot(ex, "lockstep.viewer") == before
        with _as(example_dsn, member) as m:  # a member of the owner role may, as for its jobs
            assert m.execute("select lockstep.remove_viewer(%s, %s)", [viewer, owner]).fetchone()[0] is True
            assert m.execute("select lockstep.remove_viewer(%s, %s)", [viewer, owner]).fetchone()[0] is False
        assert v.execute(seen).fetchall() == []


def test_own_job_cannot_be_given_to_another_role_or_to_no_role(ex, example_dsn, owners):
    """The recipe grants no UPDATE of owner; for a role granted it, RLS WITH CHECK: an owner may only name a
    role it is a member of (the job would run as that role)."""
    owner, other, _ = owners
    with psycopg.connect(as_role(example_dsn, owner), autocommit=True) as o:
        _define_noop(o)
        with raises_sqlstate("42501", match="permission denied for table job"):
            o.execute("update lockstep.job set owner = %s where job = 'owned'", [other])
        ex.execute(sql.SQL("grant update on lockstep.job to {}").format(sql.Identifier(owner)))
        for new_owner in (other, "root", "no_such_role_" + secrets.token_hex(4)):
            with raises_sqlstate("42501", match="row-level security"):
                o.execute("update lockstep.job set owner = %s where job = 'owned'", [new_owner])
    assert ex.execute("select owner from lockstep.job where job = 'owned'").fetchone()[0] == owner


def test_define_derived_refuses_a_target_the_caller_cannot_write(ex, example_dsn, roles):
    ex.execute(
        "create function public.no_keys(ids bigint[])"
        " returns table (exam_id bigint, key text, weight integer)"
        " language sql stable as 'select null::bigint, null::text, null::integer where false'"
    )
    admin = roles("exam_owner", OWNER_GRANTS, ["grant usage on schema example to {role}"])
    with psycopg.connect(as_role(example_dsn, admin), autocommit=True) as a:
        with raises_sqlstate("42501"):
            a.execute(
                "select lockstep.define_derived('wipe', 'example.exam_key', 'public.no_keys(bigint[])',"
                " parent => 'example.exam', parent_column => 'exam_id')"
            )


# attacks: each one worked while compute and call ran with the runner's rights and only lockstep.job had
# row-level security ------------------------------------------------------------------------------------

BANK = """
create schema bank;
create table bank.accounts (id bigint primary key, balance integer not null);
insert into bank.accounts select g, 100 from generate_series(1, 5) g;
create function bank.close_all() returns void language sql as 'delete from bank.accounts';
revoke execute on function bank.close_all() from public;
create table public.secret (v text);
insert into public.secret values ('s3cr3t');
"""
# every DML privilege on lockstep's tables (what the old admin recipe granted)
ALL_LOCKSTEP_DML = ["grant select, insert, update, delete on all tables in schema lockstep to {role}"]


def _as(dsn: str, role: str) -> psycopg.Connection:
    return psycopg.connect(as_role(dsn, role), autocommit=True)


def _bank(ex: psycopg.Connection) -> list[tuple]:
    return ex.execute("select id, balance from bank.accounts order by id").fetchall()


@pytest.fixture
def mallory(ex, example_dsn, roles) -> str:
    """A job owner with every DML privilege on lockstep's tables and a schema of its own, mal; no right on
    schema bank or on public.secret."""
    ex.execute(BANK)
    m = roles("mallory", OWNER_GRANTS, ALL_LOCKSTEP_DML)
    ex.execute(sql.SQL("create schema mal authorization {}").format(sql.Identifier(m)))
    with _as(example_dsn, m) as c:
        c.execute("create table mal.t (id bigint primary key, v text)")
        c.execute("create table mal.loot (v text)")
        c.execute(
            "create function mal.f(ids bigint[]) returns table (id bigint, v text) language plpgsql"
            " as $$ begin return query select 1::bigint, 'harmless'::text; end $$"
        )
        c.execute("select lockstep.define_derived('mine', 'mal.t', 'mal.f(bigint[])')")
    return m


def test_retarget_through_direct_dml_is_refused_at_run_time(ex, example_dsn, mallory):
    """mallory points its own job at bank.accounts by hand; the superuser runner runs it as mallory."""
    oid = ex.execute("select 'bank.accounts'::regclass::oid").fetchone()[0]
    with _as(example_dsn, mallory) as m:
        m.execute("drop function mal.f(bigint[])")  # same shape as bank.accounts
        m.execute(
            "create function mal.f(ids bigint[]) returns table (id bigint, balance integer)"
            " language sql as 'select 1::bigint, 0'"
        )
        m.execute(
            "update lockstep.job set target = %s::oid::regclass, columns = '{id,balance}' where job = 'mine'",
            [oid],
        )
    before = _bank(ex)
    res = result(ex, "lockstep.recompute(%s)", "mine")
    assert res["outcome"] == "failed" and "permission denied" in res["error"], res
    assert _bank(ex) == before
    assert (
        "permission denied"
        in ex.execute("select last_error from lockstep.job_state where job = 'mine'").fetchone()[0]
    )


def test_forged_job_calling_a_revoked_function_is_refused(ex, example_dsn, mallory):
    with _as(example_dsn, mallory) as m:
        m.execute(
            "insert into lockstep.job (job, kind, lock_group, call, every, backoff)"
            " values ('forged', 'job', 'forged', 'bank.close_all()', '1 minute', '1 hour')"
        )
        m.execute("insert into lockstep.job_state (job) values ('forged')")
    before = _bank(ex)
    res = result(ex, "lockstep.run(%s)", "forged")
    assert res["outcome"] == "failed" and "permission denied" in res["error"], res
    assert _bank(ex) == before


def test_another_owners_job_cannot_be_stalled_emptied_or_forged(ex, example_dsn, mallory):
    """exam_keys belongs to root; mallory holds every DML privilege on lockstep's tables."""
    ex.execute("update example.exam set title = 'x y z' where id between 1 and 3")
    ex.execute("update example.exam set title = 'poison' where id = 4")
    ex.execute(
        "insert into lockstep.key_failure (job, key, attempts, last_error, retry_at) values"
        " ('exam_keys', '4', 1, 'root''s private error', now())"
    )
    before = snapshot(ex)
    with _as(example_dsn, mallory) as m:
        stmts = [
            "update lockstep.job_state set next_run_at = 'infinity' where job = 'exam_keys' returning job",
            "update lockstep.queue set ready_at = 'infinity' where job = 'exam_keys' returning key",
            "delete from lockstep.queue where job = 'exam_keys' returning key",
            "update lockstep.key_failure set parked = true where job = 'exam_keys' returning key",
            "delete from lockstep.key_failure where job = 'exam_keys' returning key",
            "delete from lockstep.job where job = 'exam_keys' returning job",
            "select last_error from lockstep.job_state where job = 'exam_keys'",
            "select last_error from lockstep.key_failure where job = 'exam_keys'",
            "select key from lockstep.queue where job = 'exam_keys'",
            "select last_error from lockstep.status where job = 'exam_keys'",
            "select last_error from lockstep.failing_keys where job = 'exam_keys'",
        ]
        for stmt in stmts:
            assert m.execute(stmt).fetchall() == [], stmt
        with raises_sqlstate("42501", match="row-level security"):
            m.execute(
                "insert into lockstep.key_failure (job, key, attempts, retry_at, parked)"
                " values ('exam_keys', '1', 99, 'infinity', true)"
            )
    assert snapshot(ex) == before


@pytest.mark.parametrize(
    "body",
    [
        # reads the secret into the target
        "return query select 1::bigint, s.v from public.secret s;",
        # raises it
        "raise exception 'leak: %', (select string_agg(s.v, ',') from public.secret s);",
        # tries to get the runner's rights back first
        "reset role; return query select 1::bigint, s.v from public.secret s;",
        "execute format('set role %I', session_user);"
        " return query select 1::bigint, s.v from public.secret s;",
        "set session authorization default; return query select 1::bigint, s.v from public.secret s;",
        "perform set_config('role', session_user, false);"
        " return query select 1::bigint, s.v from public.secret s;",
        # leaves something that runs later, in the runner's session: a deferred trigger, a search_path,
        # a prepared statement, a WITH HOLD cursor
        "insert into mal.later values (1); return query select 1::bigint, 'x'::text;",
        "perform set_config('search_path', 'mal, pg_catalog', false);"
        " return query select 1::bigint, 'x'::text;",
        "deallocate victim; prepare victim as insert into mal.loot select v from public.secret;"
        " return query select 1::bigint, 'x'::text;",
        "execute 'declare c cursor with hold for select mal.steal()';"
        " return query select 1::bigint, 'x'::text;",
        # the same, in place of the session's own (same name)
        "execute 'close keep'; execute 'declare keep cursor with hold for select mal.steal()';"
        " return query select 1::bigint, 'x'::text;",
    ],
    ids=[
        "select",
        "raise",
        "reset-role",
        "set-role",
        "session-authorization",
        "set-config-role",
        "deferred-trigger",
        "search-path",
        "prepared-statement",
        "hold-cursor",
        "swapped-hold-cursor",
    ],
)
def test_compute_reading_a_secret_run_by_a_superuser_leaks_nothing(ex, example_dsn, mallory, body):
    with _as(example_dsn, mallory) as m:
        # what runs later, as whoever is current then: each copies the secret into mal.loot
        m.execute(
            "create function mal.steal() returns int language plpgsql"
            " as $$ begin insert into mal.loot select v from public.secret; return 1; end $$"
        )
        m.execute(
            "create function mal.now() returns timestamptz language plpgsql"
            " as $$ begin perform mal.steal(); return pg_catalog.now(); end $$"
        )
        m.execute(
            "create function mal.grab() returns trigger language plpgsql"
            " as $$ begin perform mal.steal(); return null; end $$"
        )
        m.execute("create table mal.later (v int)")
        m.execute(
            "create constraint trigger grab after insert on mal.later deferrable initially deferred"
            " for each row execute function mal.grab()"
        )
        m.execute(
            f"create or replace function mal.f(ids bigint[]) returns table (id bigint, v text)"
            f" language plpgsql as $$ begin {body} end $$"
        )
    ex.execute("prepare victim as select now()")
    ex.execute("declare keep cursor with hold for select 1")
    res = result(ex, "lockstep.recompute(%s)", "mine")
    log.info("%s: %s %s", body, res["outcome"], res["error"])
    # later, in the same (superuser) session
    assert ex.execute("select current_user, current_setting('role')").fetchone() == ("root", "none")
    ex.execute("select now()")
    try:
        ex.execute("execute victim")
    except psycopg.errors.InvalidSqlStatementName:
        pass  # dropped: the job's code had replaced it
    ex.execute("close all")
    if res["outcome"] == "failed":
        assert any(
            s in res["error"] for s in ("permission denied", "security-definer", "prepared", "WITH HOLD")
        ), res
    leaked = ex.execute(
        "select (select count(*) from mal.loot)"
        " + (select count(*) from mal.t where v like '%s3cr3t%')"
        " + (select count(*) from lockstep.status s where s::text like '%s3cr3t%')"
        " + (select count(*) from lockstep.job_state s where s::text like '%s3cr3t%')"
        " + (select count(*) from lockstep.failing_keys s where s::text like '%s3cr3t%')"
    ).fetchone()[0]
    assert leaked == 0, res


def test_compute_runs_as_its_owner_and_the_role_is_restored(ex, example_dsn, mallory):
    with _as(example_dsn, mallory) as m:
        m.execute(
            "create or replace function mal.f(ids bigint[]) returns table (id bigint, v text)"
            " language plpgsql as $$ begin return query select 1::bigint, current_user::text; end $$"
        )
    with psycopg.connect(example_dsn) as tx:  # in one transaction
        assert result(tx, "lockstep.recompute(%s)", "mine")["outcome"] == "done"
        assert tx.execute("select current_user, current_setting('role')").fetchone() == ("root", "none")
        assert tx.execute("select v from mal.t").fetchall() == [(mallory,)]
        tx.execute("set role " + sql.Identifier(mallory).as_string(tx))  # a caller's own SET ROLE is kept
        assert result(tx, "lockstep.recompute(%s)", "mine")["outcome"] == "done"
        assert tx.execute("select current_user").fetchone()[0] == mallory
        tx.rollback()
    # and after an error
    with _as(example_dsn, mallory) as m:
        m.execute(
            "create or replace function mal.f(ids bigint[]) returns table (id bigint, v text)"
            " language plpgsql as $$ begin raise exception 'mallory''s own error'; end $$"
        )
    res = result(ex, "lockstep.recompute(%s)", "mine")
    assert res["outcome"] == "failed" and "mallory's own error" in res["error"]
    assert ex.execute("select current_user, current_setting('role')").fetchone() == ("root", "none")


def test_last_error_is_readable_only_by_the_owner_and_the_admin(ex, example_dsn, mallory, roles):
    with _as(example_dsn, mallory) as m:
        m.execute(
            "create or replace function mal.f(ids bigint[]) returns table (id bigint, v text)"
            " language plpgsql as $$ begin raise exception 'mallory''s private error'; end $$"
        )
    assert result(ex, "lockstep.recompute(%s)", "mine")["outcome"] == "failed"
    other = roles("exam_owner", OWNER_GRANTS, ALL_LOCKSTEP_DML)
    lsowner = roles("lockstep_owner", login=False)
    _lockstep_owned_by(ex, lsowner)
    admin = roles("lockstep_admin", ADMIN_GRANTS, lsowner=lsowner)
    query = "select last_error from lockstep.status where job = 'mine'"
    for role, visible in ((mallory, True), (admin, True), (other, False)):
        with _as(example_dsn, role) as c:
            rows = c.execute(query).fetchall()
        assert (rows == [("mallory's private error",)]) if visible else (rows == []), (role, rows)


def test_runner_that_cannot_act_as_the_owner_refuses_the_job(ex, example_dsn, roles):
    """A runner that sees every job (a lockstep admin) and holds every right on the job's tables, but is not
    a member of the owner role: the job fails with the reason, with backoff, and nothing is written."""
    owner = roles("exam_owner", OWNER_GRANTS, login=False)
    ex.execute(
        sql.SQL("update lockstep.job set owner = {} where job = 'exam_keys'").format(sql.Literal(owner))
    )
    lsowner = roles("lockstep_owner", login=False)
    _lockstep_owned_by(ex, lsowner)
    runner = roles(
        "lockstep_runner",
        ADMIN_GRANTS,
        ["grant usage on schema example to {role}", "grant all on all tables in schema example to {role}"],
        lsowner=lsowner,
    )
    ex.execute("update example.exam set title = 'refused' where id = 1")
    with _as(example_dsn, runner) as r:
        res = result(r, "lockstep.work(%s)", "exam_keys")
        assert res["outcome"] == "failed" and f'may not act as role "{owner}"' in res["error"], res
        ex.execute("update lockstep.job_state set next_run_at = now()")
        res = result(r, "lockstep.run(%s)", "exam_keys")
        assert (res["action"], res["outcome"]) == ("recompute", "failed") and "may not act" in res["error"], (
            res
        )
    last_error, backoff, failures = ex.execute(
        "select last_error, next_run_at > now() + interval '30 minutes', consecutive_failures"
        " from lockstep.job_state where job = 'exam_keys'"
    ).fetchone()
    assert f"grant {owner} to {runner}" in last_error or "may not act" in last_error
    assert backoff and failures == 2
    assert ex.execute("select count(*) from example.exam_key where key = 'refused'").fetchone()[0] == 0
    assert ex.execute("select count(*) from lockstep.queue where key = '1'").fetchone()[0] == 1


def test_runner_that_does_not_serve_the_owner_is_refused_by_name(ex, example_dsn, roles):
    owner = roles("exam_owner", OWNER_GRANTS, login=False)
    runner = roles("lockstep_runner", RUNNER_GRANTS, attrs="noinherit", owner=owner)
    # exam_keys is root's: this runner does not see it in due(), and refuses it by name
    with _as(example_dsn, runner) as r:
        assert r.execute("select job from lockstep.due()").fetchall() == []
        with raises_sqlstate("42501", match="may not act as role"):
            r.execute("select lockstep.run('exam_keys')")


def test_job_of_a_dropped_role_is_not_run_even_by_a_superuser(ex):
    ex.execute("update lockstep.job set owner = 'no_such_role_h3' where job = 'exam_keys'")
    ex.execute("update example.exam set title = 'orphan' where id = 1")
    res = result(ex, "lockstep.work(%s)", "exam_keys")
    assert res["outcome"] == "failed" and "which does not exist" in res["error"], res
    assert ex.execute("select count(*) from example.exam_key where key = 'orphan'").fetchone()[0] == 0


def test_parent_key_of_a_domain_type_is_refused(ex, example_dsn, mallory):
    """Keys are cast to the parent key type outside the owner's sandbox: a domain's CHECK would run there."""
    ex.execute("create domain public.dkey as bigint check (value > 0)")
    ex.execute("create table public.dparent (id public.dkey primary key)")
    ex.execute("create table public.dchild (pid public.dkey references public.dparent, primary key (pid))")
    ex.execute(
        "create function public.dcompute(ids public.dkey[]) returns table (pid public.dkey)"
        " language sql as 'select id from public.dparent where ids is null or id = any(ids)'"
    )
    with raises_sqlstate("LSD04", match="domain"):
        ex.execute(
            "select lockstep.define_derived('d', 'public.dchild', 'public.dcompute(public.dkey[])',"
            " parent => 'public.dparent')"
        )
    with _as(example_dsn, mallory) as m:
        with raises_sqlstate("42501", match="row-level security"):
            m.execute("update lockstep.job set key_type = 'public.dkey'::regtype where job = 'mine'")
        # an array of a domain is typtype 'b' too: it passed, and the runner's cast of the queued keys ran the
        # domain's CHECK as the runner, outside the sandbox
        with raises_sqlstate("42501", match="row-level security"):
            m.execute("update lockstep.job set key_type = 'public.dkey[]'::regtype where job = 'mine'")
        with raises_sqlstate("42501", match="row-level security"):
            m.execute("update lockstep.job set key_type = 'bigint[]'::regtype where job = 'mine'")


def test_trampoline_is_executable_by_its_owner_only(ex, example_dsn, mallory, roles):
    assert result(ex, "lockstep.recompute(%s)", "mine")["outcome"] == "done"
    name, acl = ex.execute(
        "select proname, proacl::text from pg_proc where pronamespace = pg_my_temp_schema()"
        " and proname like 'lockstep\\_as\\_%'"
    ).fetchone()
    assert acl == "{" + f"{mallory}=X/{mallory}" + "}"
    other = roles("exam_owner", OWNER_GRANTS)
    ex.execute(sql.SQL("set role {}").format(sql.Identifier(other)))
    with raises_sqlstate("42501"):
        ex.execute(sql.SQL("select * from pg_temp.{}(null, null)").format(sql.Identifier(name)))
    ex.execute("reset role")


def test_owner_with_a_hostile_role_name(ex, example_dsn, roles):
    """The owner's name is a value (set_config, %I in hints), the trampoline's name is built from its oid."""
    owner = roles(
        "o\"w;ner' x",
        OWNER_GRANTS,
        EXAMPLE_OWNER_GRANTS,
        [
            "grant select on example.exam, example.exam_item to {role}",
            "grant update (id) on example.exam to {role}",
        ],
        login=False,
    )
    ex.execute("update lockstep.job set owner = %s where job = 'exam_keys'", [owner])
    ex.execute("update example.exam set title = 'hostile owner' where id = 1")
    assert result(ex, "lockstep.work(%s)", "exam_keys")["outcome"] == "done"
    assert example.divergence(ex) == (0, 0)
    runner = roles("lockstep_runner", RUNNER_GRANTS[:-2], login=True)  # serves nobody
    ex.execute("update example.exam set title = 'refused again' where id = 1")
    with _as(example_dsn, runner) as r:
        with raises_sqlstate("42501", match="may not act as role") as info:
            r.execute("select lockstep.run('exam_keys')")
    grant = ex.execute("select format('grant %%I to %%I', %s::text, %s::text)", [owner, runner]).fetchone()[0]
    assert (
        info.value.diag.message_hint
        == f"A job runs with its owner's rights only: {grant} (docs/security.md)."
    )


def test_job_code_may_not_replace_the_sessions_prepared_statements(ex, example_dsn, mallory):
    """Even re-prepared with the same name and text (it may resolve differently): refused, and dropped."""
    with _as(example_dsn, mallory) as m:
        m.execute(
            "create or replace function mal.f(ids bigint[]) returns table (id bigint, v text)"
            " language plpgsql as $$ begin deallocate victim; execute 'prepare victim as select 1';"
            " return query select 1::bigint, 'x'::text; end $$"
        )
    ex.execute("prepare victim as select 1")
    ex.execute("prepare bystander as select 2")
    res = result(ex, "lockstep.recompute(%s)", "mine")
    assert res["outcome"] == "failed" and "changed the session's prepared statements" in res["error"], res
    with raises_sqlstate("26000"):
        ex.execute("execute victim")
    assert ex.execute("execute bystander").fetchone() == (2,)


def test_work_tables_another_role_created_in_the_session_are_never_used(ex, exconnect, mallory):
    """The temp schema is the session's: another owner's code run by the same runner session could create
    tables with the predictable names of a job's work tables, grant them to PUBLIC and put a trigger on
    them; the job's next pass in that session wrote into them, and the trigger ran with that job's owner's
    rights (here a superuser's). A table of another role is never used now: the job gets
    its own tables under another name."""
    ex.execute(f"select lockstep.enqueue('{example.JOB}', array[1])")
    assert result(ex, f"lockstep.work('{example.JOB}')")["outcome"] == "done"
    names = [
        r[0]
        for r in ex.execute(
            "select relname from pg_class where relnamespace = pg_my_temp_schema()"
            " and relname ~ '^lockstep_(gone|put)_' order by 1"
        )
    ]
    assert len(names) == 2
    ex.execute("grant insert on mal.loot to public")
    s = exconnect()  # another runner session: mallory's job ran first in it
    s.execute(sql.SQL("set role {}").format(sql.Identifier(mallory)))
    s.execute(
        "create function mal.pwn() returns trigger language plpgsql as"
        " $$ begin insert into mal.loot values (current_user); return null; end $$"
    )
    cols = "exam_id bigint, key text, weight integer, lockstep_parent text"
    for name in names:
        extra = (
            ", lockstep_ctid tid"
            if "_gone_" in name
            else ", lockstep_old_parent text, lockstep_new boolean, lockstep_ctid tid"
        )
        s.execute(sql.SQL("create temp table {} (" + cols + extra + ")").format(sql.Identifier(name)))
        s.execute(sql.SQL("grant all on pg_temp.{} to public").format(sql.Identifier(name)))
        s.execute(
            sql.SQL("create trigger pwn before insert or delete on pg_temp.{}"
                    " for each statement execute function mal.pwn()").format(sql.Identifier(name))
        )  # fmt: skip
    s.execute("reset role")
    ex.execute(
        "update example.exam set body = body || ' planted' where id in (2, 3);"
        f" select lockstep.enqueue('{example.JOB}', array[2, 3])"
    )
    r = result(s, f"lockstep.work('{example.JOB}')")
    assert (r["outcome"], r["error"]) == ("done", None), r
    assert ex.execute("select count(*) from mal.loot").fetchone()[0] == 0
    assert example.divergence(ex) == (0, 0)


def test_keys_a_runner_cannot_read_are_parked_not_recursed_on(ex, example_dsn, roles):
    """An enum key type in a schema the runner may not use: every queued key failed its cast, and the
    retry of the keys left (none) recursed until the stack ran out (54001), raised out of run(): the
    runner backed off for every job it serves. Now the keys are isolated and parked,
    with the error, like any key that does not read back."""
    owner = roles("enum_owner", OWNER_GRANTS, login=False)
    runner = roles("lockstep_runner", RUNNER_GRANTS, attrs="noinherit", owner=owner)
    ex.execute(sql.SQL("create schema col authorization {}").format(sql.Identifier(owner)))
    ex.execute(sql.SQL("set role {}").format(sql.Identifier(owner)))
    ex.execute(
        "create type col.color as enum ('red', 'green');"
        " create table col.cp (c col.color primary key, n int);"
        " create table col.ct (c col.color primary key references col.cp on delete cascade, n2 int);"
        " create function col.cc(ks col.color[]) returns table (c col.color, n2 int) language sql stable"
        " as $$ select c, n * 2 from col.cp where ks is null or c = any(ks) $$;"
        " insert into col.cp values ('red', 1), ('green', 2);"
        " select lockstep.define_derived('colors', 'col.ct', 'col.cc(col.color[])', 'col.cp',"
        " every => '1 day');"
        " select lockstep.enqueue('colors', array['red', 'green']::col.color[]);"
    )
    ex.execute("reset role")
    with psycopg.connect(as_role(example_dsn, runner), autocommit=True) as r:
        ex.execute(
            "update lockstep.job_state set next_run_at = now() + interval '1 day' where job = 'colors'"
        )
        got = r.execute("select outcome, error from lockstep.work('colors', 10)").fetchone()
        assert got[0] == "done" and "permission denied for schema col" in (got[1] or ""), got
        failing = ex.execute(
            "select key from lockstep.failing_keys where job = 'colors' order by 1"
        ).fetchall()
        assert failing == [("green",), ("red",)]


PLANT_VIEW = (
    "  execute format('create temp view %I as select * from %s.steal()', {il}, {aq});"
    "  execute format('grant select on pg_temp.%I to public', {il});"
)
# a plain table granted by column: relacl stays NULL, so "granted to nobody" must look at column grants too
PLANT_TABLE = (
    "  execute format('create temp table %I (id int, n int)', {il});"
    "  execute format('insert into pg_temp.%I values (9, 9)', {il});"
    "  execute format('grant select (id, n) on pg_temp.%I to public', {il});"
)


@pytest.mark.parametrize(
    "item, plant",
    [("item", PLANT_VIEW), ("lockstep_rates", PLANT_VIEW), ("lockstep_rates", PLANT_TABLE)],
    ids=["view", "lockstep-view", "lockstep-table-column-grant"],
)
def test_another_owners_temp_view_never_stands_in_for_a_jobs_table(ex, example_dsn, roles, item, plant):
    """A compute with its own search_path that does not name pg_temp (the README's advice) looks there first
    for relations; the runner session serves several owners, so a temp view another owner's job left named
    like a table of this one ran that owner's code with this one's rights. A job's
    temporary objects are dropped at the end of its sandbox: lockstep_rates too (names starting lockstep_
    were all spared, for lockstep's own work tables: a view may be planted under such a name); only
    plain tables of lockstep's names, granted to nobody, with no trigger, rule or policy, are kept."""
    victim = roles("victim", OWNER_GRANTS, login=False)
    attacker = roles("attacker", OWNER_GRANTS, login=False)
    runner = roles("lockstep_runner", RUNNER_GRANTS, attrs="noinherit", owner=victim)
    ex.execute(sql.SQL("grant {} to {}").format(sql.Identifier(attacker), sql.Identifier(runner)))
    for who in (victim, attacker):
        ex.execute(
            sql.SQL("create schema {} authorization {}").format(sql.Identifier(who), sql.Identifier(who))
        )
    v, a = sql.Identifier(victim), sql.Identifier(attacker)
    ex.execute(sql.SQL("set role {}").format(v))
    ex.execute(
        sql.SQL(
            "create table {v}.secret (s text); insert into {v}.secret values ('victim secret');"
            " create table {v}.{i} (id int primary key, n int); insert into {v}.{i} values (1, 1), (2, 2);"
            " create table {v}.item_sum (id int primary key, n int);"
            " create function {v}.sums(ignored int[]) returns table (id int, n int) language sql stable"
            "  set search_path = {v}, pg_catalog as $$ select id, n from {i} $$;"
            " select lockstep.define_derived('sums', {vs}, {vf}, every => '1 day');"
        ).format(
            v=v,
            i=sql.Identifier(item),
            vs=sql.Literal(f'"{victim}".item_sum'),
            vf=sql.Literal(f'"{victim}".sums(int[])'),
        )
    )
    ex.execute(sql.SQL("set role {}").format(a))
    ex.execute(
        sql.SQL(
            "create table {a}.loot (who text, what text); grant insert on {a}.loot to public;"
            " grant usage on schema {a} to public;"
            " create function {a}.steal() returns table (id int, n int) language plpgsql as"
            "  $$ begin insert into {a}.loot select current_user, s from {v}.secret;"
            "  return query select 9, 9; end $$;"
            " grant execute on function {a}.steal() to public;"
            " create table {a}.t (bucket int primary key, total bigint);"
            " create function {a}.plant(ignored int[]) returns table (bucket int, total bigint)"
            "  language plpgsql"
            "  as $$ begin if to_regclass({tq}) is null then" + plant + " end if; return; end $$;"
            " select lockstep.define_derived('plant', {at}, {af}, every => '1 day');"
        ).format(
            a=a,
            v=v,
            aq=sql.Literal(sql.Identifier(attacker).as_string(ex)),
            tq=sql.Literal("pg_temp." + sql.Identifier(item).as_string(ex)),
            il=sql.Literal(item),
            at=sql.Literal(f'"{attacker}".t'),
            af=sql.Literal(f'"{attacker}".plant(int[])'),
        )
    )
    ex.execute("reset role")
    with psycopg.connect(as_role(example_dsn, runner), autocommit=True) as r:
        assert result(r, "lockstep.recompute('plant')")["outcome"] == "done"
        assert result(r, "lockstep.recompute('sums')")["inserted"] == 2
    assert ex.execute(sql.SQL("select count(*) from {}.loot").format(a)).fetchone()[0] == 0
    assert ex.execute(sql.SQL("select * from {}.item_sum order by 1").format(v)).fetchall() == [
        (1, 1),
        (2, 2),
    ]


def test_an_owners_default_privileges_neither_drop_nor_share_its_work_tables(ex, example_dsn, roles):
    """With `alter default privileges for role owner grant select on tables to x`, every table the owner
    creates, its temp work tables too, is granted to x: "granted to nobody" dropped them at the end of
    every sandbox (a job without a parent recomputed in full at every run). The grant is revoked
    instead, once, and the tables stay for the session's next run."""
    owner = roles("owner", OWNER_GRANTS, login=False)
    other = roles("other", [], login=False)
    runner = roles("lockstep_runner", RUNNER_GRANTS, attrs="noinherit", owner=owner)
    o = sql.Identifier(owner)
    ex.execute(sql.SQL("create schema {o} authorization {o}").format(o=o))
    ex.execute(
        sql.SQL("alter default privileges for role {} grant select on tables to {}").format(
            o, sql.Identifier(other)
        )
    )
    ex.execute(sql.SQL("set role {}").format(o))
    ex.execute(
        sql.SQL(
            "create table {o}.src (id int primary key, n int); insert into {o}.src select g, g from"
            " generate_series(1, 30) g;"
            " create table {o}.dst (id int primary key, n int);"
            " create function {o}.f(ignored int[]) returns table (id int, n int) language sql stable"
            "  as $$ select id, n from {o}.src $$;"
            " select lockstep.define_derived('dp', {t}, {f}, every => '1 day');"
            " select lockstep.set_batch_parents('dp', 10);"
        ).format(o=o, t=sql.Literal(f'"{owner}".dst'), f=sql.Literal(f'"{owner}".f(int[])'))
    )
    ex.execute("reset role")
    work_tables = (
        "select c.relname, c.relacl::text from pg_class c where c.relnamespace = pg_my_temp_schema()"
        " and c.relname ~ '^lockstep_(put|gone|rest)_' order by 1"
    )
    with psycopg.connect(as_role(example_dsn, runner), autocommit=True) as r:
        assert result(r, "lockstep.recompute('dp')")["inserted"] == 10
        kept = r.execute(work_tables).fetchall()
        assert [n.split("_")[1] for n, _ in kept] == ["gone", "put", "rest"], kept
        assert not any(acl and other in acl for _, acl in kept), kept  # no longer granted to `other`
        # the rest is written from the kept rest table: no second compute of every row
        second = result(r, "lockstep.run('dp')")
        assert second["inserted"] == 10 and r.execute(work_tables).fetchall() == kept
    assert ex.execute(sql.SQL("select count(*) from {}.dst").format(o)).fetchone()[0] == 20


def test_a_viewer_row_for_a_role_that_does_not_exist_breaks_nobody(ex, example_dsn, owners):
    # pg_has_role raised 42704 inside the read policies: another owner's runs and status failed
    owner, other, _ = owners
    ex.execute("grant select on lockstep.viewer to public")
    ex.execute("insert into lockstep.viewer values ('no_such_role_x', %s)", [owner])
    with psycopg.connect(as_role(example_dsn, other), autocommit=True) as x:
        _define_noop(x, "others")
        assert result(x, "lockstep.run('others')")["outcome"] == "done"
        assert [j for (j,) in x.execute("select job from lockstep.status")] == ["others"]
        x.execute("select * from lockstep.viewer")


def test_a_lock_group_cannot_be_taken_by_plain_dml(ex, example_dsn, owners):
    # define_* refused it, but UPDATE on lockstep.job (in the owner recipe then) put a job in another
    # owner's group all the same; the recipe holds no UPDATE now, and the policy still refuses a role that
    # does
    owner, other, _ = owners
    with psycopg.connect(as_role(example_dsn, owner), autocommit=True) as o:
        _define_noop(o)
    ex.execute(sql.SQL("grant update (lock_group) on lockstep.job to {}").format(sql.Identifier(other)))
    with psycopg.connect(as_role(example_dsn, other), autocommit=True) as x:
        _define_noop(x, "mine")
        with raises_sqlstate("42501", "row-level security"):
            x.execute("update lockstep.job set lock_group = 'owned' where job = 'mine'")
    assert ex.execute("select lock_group from lockstep.job where job = 'mine'").fetchone()[0] == "mine"


# a recipe runner's flags ---------------------------------------------------------------------------------

RUNNER_FLAG_SHOP = """
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
-- security definer: the owner's compute reads shop.orders whether or not the owner may
create function shop.customer_total_compute(ids bigint[])
returns table (customer_id bigint, total bigint, lines bigint) language sql stable security definer
set search_path = pg_catalog as $$
    select c.id, coalesce(sum(l.amount), 0)::bigint, count(l.id)
    from shop.customer c left join shop.orders o on o.customer_id = c.id
    left join shop.order_line l on l.order_id = o.id
    where ids is null or c.id = any(ids)
    group by c.id $$;
insert into shop.customer select g, 'c' || g from generate_series(1, 5) g;
insert into shop.orders select g, 1 + g % 5 from generate_series(1, 20) g;
insert into shop.order_line select g, 1 + g % 20, g from generate_series(1, 100) g;
select lockstep.define_derived('totals', 'shop.customer_total', 'shop.customer_total_compute(bigint[])',
                               parent => 'shop.customer', every => '1 day');
select lockstep.watch('totals', 'shop.order_line', 'order_id',
                      through => 'shop.orders', through_column => 'customer_id');
select lockstep.recompute('totals');
delete from lockstep.queue;
"""
RUNNER_FLAG_SHOP_DIVERGENCE = """
select count(*) from (
    (select * from shop.customer_total except select * from shop.customer_total_compute(null))
    union all
    (select * from shop.customer_total_compute(null) except select * from shop.customer_total)) d
"""


def _give_job(ex: psycopg.Connection, job: str, owner: str) -> None:
    ex.execute("update lockstep.job set owner = %s where job = %s", [owner, job])


def test_a_recipe_runner_flags_a_job_whose_through_mapping_fails(ex, example_dsn, roles):
    """The worker maps committed through keys to parents as the job's owner; a mapping that fails flags the
    job. The runner recipe holds no INSERT on the flags: the flag goes through lockstep's definer function,
    the run does not fail (42501), and once the owner may read the through table again the next run
    converges."""
    ex.execute(RUNNER_FLAG_SHOP)
    owner = roles(
        "shop_owner",
        OWNER_GRANTS,
        ["grant usage on schema shop to {role}",
         "grant select on shop.customer, shop.orders, shop.order_line to {role}",
         "grant select, insert, update, delete on shop.customer_total to {role}",
         "grant update (id) on shop.customer to {role}"],
    )  # fmt: skip
    _give_job(ex, "totals", owner)
    runner = roles("lockstep_runner", RUNNER_GRANTS, attrs="noinherit", owner=owner)
    ex.execute(sql.SQL("revoke select on shop.orders from {}").format(sql.Identifier(owner)))
    ex.execute("update shop.order_line set amount = amount + 1000 where order_id = 7")  # a through key
    with _as(example_dsn, runner) as r:
        res = result(r, "lockstep.run(%s)", "totals")
        assert res["outcome"] != "failed", res["error"]
        flags = ex.execute("select problem from lockstep.recompute_flag where job = 'totals'").fetchall()
        problems = [p for (p,) in flags]
        assert any("watch through shop.orders" in p for p in problems), problems
        ex.execute(sql.SQL("grant select on shop.orders to {}").format(sql.Identifier(owner)))
        res = result(r, "lockstep.run(%s)", "totals")
        assert (res["action"], res["outcome"]) == ("recompute", "done"), res
    assert ex.execute(RUNNER_FLAG_SHOP_DIVERGENCE).fetchone()[0] == 0
    assert ex.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0


def test_a_recipe_runner_flags_a_handed_off_key_too_long_for_the_queue(ex, example_dsn, roles):
    """A poisoned recompute hands every parent to the worker; a parent key too long for the queue flags the
    job instead. As a runner of the recipe (no INSERT on the flags) that flag goes through lockstep's
    definer function, `lockstep run --once` does not fail, and once the poison is cured the job converges."""
    ex.execute(
        """
        create table public.doc (id text primary key, bad boolean not null default false);
        create table public.doc_len (doc_id text primary key references public.doc on delete cascade,
                                     len int not null);
        create function public.doc_len_c(ids text[]) returns table (doc_id text, len int)
        language plpgsql stable as $$
        begin
            if exists (select from public.doc d where (ids is null or d.id = any(ids)) and d.bad) then
                raise exception 'bad doc';
            end if;
            return query select d.id, length(d.id) from public.doc d where ids is null or d.id = any(ids);
        end $$;
        insert into public.doc (id) select 'd' || g from generate_series(1, 10) g;
        insert into public.doc (id) values (repeat('L', 2700));
        select lockstep.define_derived('doclen', 'public.doc_len', 'public.doc_len_c(text[])',
                                       parent => 'public.doc', every => '1 day');
        select lockstep.set_max_attempts('doclen', 1);
        select lockstep.recompute('doclen');
        update public.doc set bad = true where id = 'd3';
        delete from lockstep.queue;
        delete from lockstep.recompute_flag;
        """
    )
    owner = roles(
        "doc_owner",
        OWNER_GRANTS,
        ["grant select on public.doc to {role}",
         "grant select, insert, update, delete on public.doc_len to {role}",
         "grant update (id) on public.doc to {role}"],
    )  # fmt: skip
    _give_job(ex, "doclen", owner)
    ex.execute("delete from lockstep.job where job = 'exam_keys'")  # `run --once` runs doclen alone
    runner = roles("lockstep_runner", RUNNER_GRANTS, attrs="noinherit", owner=owner)
    ex.execute("update lockstep.job_state set next_run_at = now() where job = 'doclen'")
    p = lockstep_cli("run", "--once", "--dsn", as_role(example_dsn, runner))
    assert p.returncode == 0, p.stderr
    assert "42501" not in p.stderr and "permission denied" not in p.stderr, p.stderr
    assert "handed to the worker" in p.stderr, p.stderr
    problems = [p for (p,) in ex.execute("select problem from lockstep.recompute_flag where job = 'doclen'")]
    assert any("too long for the queue" in p for p in problems), problems
    ex.execute("update public.doc set bad = false where id = 'd3'")
    with _as(example_dsn, runner) as r:
        for _ in range(6):
            ex.execute("update lockstep.job_state set next_run_at = now(), retry_at = null")
            res = result(r, "lockstep.run(%s)", "doclen")
            assert res["outcome"] != "failed", res
    assert ex.execute("select count(*) from lockstep.recompute_flag").fetchone()[0] == 0
    assert ex.execute("select count(*) from lockstep.parked_keys").fetchone()[0] == 0
    diff = ex.execute(
        "select count(*) from ((select * from public.doc_len except select * from public.doc_len_c(null))"
        " union all (select * from public.doc_len_c(null) except select * from public.doc_len)) d"
    ).fetchone()[0]
    assert diff == 0


def test_another_owners_runner_cannot_flag_a_job(ex, example_dsn, roles):
    """lockstep._flag_job, the flag writer of a role without INSERT on the flags (a runner or an owner of the
    recipe), flags only a job its caller manages: another owner's runner gets 42501 and writes nothing."""
    _recipe_runner_of_exam_keys(ex, roles)
    other = roles("other_owner", OWNER_GRANTS)
    other_runner = roles("lockstep_runner", RUNNER_GRANTS, attrs="noinherit", owner=other)
    flags = "select job, problem from lockstep.recompute_flag order by 1, 2"
    before = ex.execute(flags).fetchall()
    with _as(example_dsn, other_runner) as r, raises_sqlstate("42501"):
        r.execute("select lockstep._flag_job('exam_keys', 'forged')")
    with _as(example_dsn, other_runner) as r, raises_sqlstate("42501"):
        r.execute("select lockstep._flag('exam_keys', 'forged')")
    assert ex.execute(flags).fetchall() == before


def test_an_owner_of_the_recipe_watches_through_a_join_for_a_composite_key(ex, example_dsn, roles):
    """watch(..., key_columns, through, through_columns) flags the newly watched job for its full recompute:
    as an owner of the recipe (no INSERT on the flags) through lockstep._flag_job."""
    owner = roles("shop_owner", OWNER_GRANTS)
    ex.execute(sql.SQL("create schema shop authorization {}").format(sql.Identifier(owner)))
    with _as(example_dsn, owner) as o:
        o.execute(
            """
            create table shop.customer (tenant_id int not null, id bigint not null,
                                        primary key (tenant_id, id));
            create table shop.orders (tenant_id int not null, id bigint not null, customer_id bigint not null,
                                      primary key (tenant_id, id),
                                      foreign key (tenant_id, customer_id) references shop.customer
                                      on delete cascade);
            create table shop.order_line (id bigint primary key, tenant_id int not null,
                                          order_id bigint not null,
                                          amount integer not null,
                                          foreign key (tenant_id, order_id) references shop.orders
                                          on delete cascade);
            create table shop.customer_total (tenant_id int not null, customer_id bigint not null,
                                              total bigint not null, primary key (tenant_id, customer_id),
                                              foreign key (tenant_id, customer_id) references shop.customer
                                              on delete cascade);
            create type shop.customer_key as (tenant_id int, id bigint);
            create function shop.customer_total_compute(keys shop.customer_key[])
            returns table (tenant_id int, customer_id bigint, total bigint) language sql stable as $$
                select c.tenant_id, c.id, coalesce(sum(l.amount), 0)::bigint
                from shop.customer c
                left join shop.orders o on o.tenant_id = c.tenant_id and o.customer_id = c.id
                left join shop.order_line l on l.tenant_id = o.tenant_id and l.order_id = o.id
                where keys is null or (c.tenant_id, c.id) in (select k.tenant_id, k.id from unnest(keys) k)
                group by c.tenant_id, c.id $$;
            insert into shop.customer values (1, 1), (1, 2);
            insert into shop.orders values (1, 1, 1), (1, 2, 2);
            insert into shop.order_line values (1, 1, 1, 10), (2, 1, 2, 20);
            select lockstep.define_derived('ctotals', 'shop.customer_total',
                                           'shop.customer_total_compute(shop.customer_key[])',
                                           'shop.customer', every => '1 day');
            """
        )
        assert result(o, "lockstep.recompute(%s)", "ctotals")["outcome"] == "done"
        o.execute(
            "select lockstep.watch('ctotals', 'shop.order_line',"
            " key_columns => array['tenant_id', 'order_id']::name[],"
            " through => 'shop.orders', through_columns => array['tenant_id', 'customer_id']::name[])"
        )
        flagged = o.execute("select count(*) from lockstep.recompute_flag where job = 'ctotals'").fetchone()
        assert flagged[0] > 0
        assert result(o, "lockstep.recompute(%s)", "ctotals")["outcome"] == "done"
        assert o.execute("select count(*) from shop.customer_total").fetchone()[0] == 2
