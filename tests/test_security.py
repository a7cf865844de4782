"""Security: SECURITY INVOKER functions with a pinned search_path, least-privilege roles, job ownership.

Roles are cluster-wide, so every role a test creates gets a unique name (``<recipe>_<hex>``) and is
dropped at teardown (``drop owned by`` in the test database first). Recipes are documented in
docs/security.md; the grant lists below are the same ones.
Behaviour that needs a SQL change is marked ``xfail(strict=True)`` with the proposed change.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from runner.lab import example
from tests.util import raises_sqlstate

# what `lockstep run` needs, besides the job's own tables (see runner_grants)
RUNNER_LOCKSTEP_GRANTS = [
    "grant usage on schema lockstep to {role}",
    "grant execute on all functions in schema lockstep to {role}",
    "grant select, insert, update, delete on lockstep.job_state, lockstep.queue, lockstep.key_failure"
    " to {role}",
    "grant select on lockstep.job to {role}",
    "grant temp on database {db} to {role}",
]
# what the example job exam_keys needs: read its sources, write its target, and UPDATE on one column of
# the parent because the write phase pins parents with SELECT ... FOR KEY SHARE (row-locking clauses need
# UPDATE on at least one column of the table; a column grant is enough).
EXAMPLE_RUNNER_GRANTS = [
    "grant usage on schema example to {role}",
    "grant select on example.exam, example.exam_item to {role}",
    "grant update (id) on example.exam to {role}",
    "grant select, insert, update, delete on example.exam_key to {role}",
]
# an application role that writes the watched tables: its statement triggers enqueue as that role
# (enqueue looks for the job and checks whether the queue was empty before it inserts).
APP_GRANTS = [
    "grant usage on schema lockstep to {role}",
    "grant select on lockstep.job to {role}",
    "grant select, insert on lockstep.queue to {role}",
]
EXAMPLE_APP_GRANTS = [
    "grant usage on schema example to {role}",
    "grant select, insert, update, delete on example.exam, example.exam_item to {role}",
]
# a role that defines and drops jobs (its own), and may run them by hand
ADMIN_GRANTS = [
    "grant usage on schema lockstep to {role}",
    "grant select, insert, update, delete on all tables in schema lockstep to {role}",
    "grant temp on database {db} to {role}",
]


def dbname(dsn: str) -> str:
    return conninfo_to_dict(dsn)["dbname"]


def as_role(dsn: str, role: str) -> str:
    return make_conninfo(dsn, user=role)


@pytest.fixture
def roles(example_dsn: str) -> Iterator[Callable[..., str]]:
    """``roles(recipe, *grant_lists, login=True) -> name``: a new role in the cluster with these grants."""
    made: list[str] = []
    admin = psycopg.connect(example_dsn, autocommit=True)

    def _make(recipe: str, *grant_lists: list[str], login: bool = True) -> str:
        name = f"{recipe}_{secrets.token_hex(4)}"
        admin.execute(
            sql.SQL("create role {} " + ("login" if login else "nologin")).format(sql.Identifier(name))
        )
        made.append(name)
        for grants in grant_lists:
            for g in grants:
                admin.execute(
                    sql.SQL(g).format(role=sql.Identifier(name), db=sql.Identifier(dbname(example_dsn)))
                )
        return name

    yield _make
    for name in reversed(made):
        admin.execute(sql.SQL("drop owned by {}").format(sql.Identifier(name)))
    for name in reversed(made):
        admin.execute(sql.SQL("drop role {}").format(sql.Identifier(name)))
    admin.close()


def app_writes(ex: psycopg.Connection) -> None:
    """Some app changes of every kind: edit, new item, delete, new parent."""
    ex.execute("update example.exam set title = 'alpha beta gamma ' || id where id between 1 and 15")
    ex.execute("insert into example.exam_item (exam_id, body) select id, 'delta epsilon' from example.exam"
               " where id between 16 and 25")
    ex.execute("delete from example.exam where id between 26 and 30")
    ex.execute("select example.seed(5, 1001)")


def lockstep_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, timeout=60)


# functions ---------------------------------------------------------------------------------------------


def test_every_function_is_security_invoker_with_a_pinned_search_path(conn):
    rows = conn.execute(
        "select p.oid::regprocedure::text, p.prosecdef, p.proconfig from pg_proc p"
        " where p.pronamespace = 'lockstep'::regnamespace order by 1"
    ).fetchall()
    assert len(rows) > 20
    definer = [name for name, secdef, _ in rows if secdef]
    assert definer == [], f"SECURITY DEFINER functions: {definer}"
    unpinned = [
        name for name, _, config in rows if "search_path=pg_catalog, pg_temp" not in (config or [])
    ]
    assert unpinned == [], f"functions without SET search_path = pg_catalog, pg_temp: {unpinned}"


def test_lockstep_objects_have_default_acls_only(conn):
    """Nothing is granted to PUBLIC on lockstep's tables: access is whatever the DBA grants."""
    acl = conn.execute(
        "select relname, relacl::text from pg_class where relnamespace = 'lockstep'::regnamespace"
        " and relkind in ('r', 'v', 'S') and relacl is not null"
    ).fetchall()
    assert acl == []
    assert conn.execute("select nspacl from pg_namespace where nspname = 'lockstep'").fetchone()[0] is None


# the runner role ---------------------------------------------------------------------------------------


def test_least_privilege_runner_completes_a_workload(ex, example_dsn, roles):
    runner = roles("lockstep_runner", RUNNER_LOCKSTEP_GRANTS, EXAMPLE_RUNNER_GRANTS)
    app_writes(ex)
    ex.execute("update lockstep.job_state set next_run_at = now()")  # the recompute is due as well
    assert ex.execute("select count(*) from lockstep.queue").fetchone()[0] > 0
    p = lockstep_cli("run", "--once", "--dsn", as_role(example_dsn, runner))
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and "ERROR" not in p.stderr, p.stderr
    assert "exam_keys recompute done" in p.stderr, p.stderr
    assert example.divergence(ex) == (0, 0)
    assert ex.execute("select count(*) from lockstep.key_failure").fetchone()[0] == 0
    # the worker pass too, as that role, from SQL
    app_writes_again = "update example.exam set body = 'zeta eta theta' where id between 40 and 45"
    ex.execute(app_writes_again)
    with psycopg.connect(as_role(example_dsn, runner), autocommit=True) as r:
        assert r.execute("select current_user").fetchone()[0] == runner
        row = r.execute("select outcome, error from lockstep.work('exam_keys')").fetchone()
    assert row == ("done", None)
    assert example.divergence(ex) == (0, 0)


def test_runner_without_update_on_the_parent_cannot_pin_it(ex, example_dsn, roles):
    """FOR KEY SHARE needs UPDATE on some column of the parent: without it the keys fail (and are kept)."""
    no_update = [g for g in EXAMPLE_RUNNER_GRANTS if "update (id)" not in g]
    runner = roles("lockstep_runner", RUNNER_LOCKSTEP_GRANTS, no_update)
    ex.execute("update example.exam set title = 'iota kappa' where id between 1 and 3")
    with psycopg.connect(as_role(example_dsn, runner), autocommit=True) as r:
        outcome, error = r.execute("select outcome, error from lockstep.work('exam_keys')").fetchone()
    assert "permission denied for table exam" in error
    failed = ex.execute("select key, last_error from lockstep.key_failure order by key::int").fetchall()
    assert [k for k, _ in failed] == ["1", "2", "3"]
    assert all("permission denied for table exam" in e for _, e in failed)


def test_runner_cannot_touch_tables_it_was_not_granted(ex, example_dsn, roles):
    ex.execute("create table public.secret (v text)")
    ex.execute("insert into public.secret values ('s3cr3t')")
    runner = roles("lockstep_runner", RUNNER_LOCKSTEP_GRANTS, EXAMPLE_RUNNER_GRANTS)
    with psycopg.connect(as_role(example_dsn, runner), autocommit=True) as r:
        for stmt in [
            "select * from public.secret",
            "insert into public.secret values ('x')",
            "delete from public.secret",
            "update example.exam set title = 'x'",  # only column id is granted
            "delete from example.exam",
            "insert into lockstep.job (job, kind, lock_group, call, every, backoff)"
            " values ('x', 'job', 'x', 'pg_catalog.now()', '1 minute', '1 hour')",
            "create table public.mine (v int)",
        ]:
            with raises_sqlstate("42501"):
                r.execute(stmt)
        with raises_sqlstate("42501"):
            r.execute("select lockstep.drop_job('exam_keys')")
        with raises_sqlstate("42501"):
            r.execute("select * from lockstep.status")  # `lockstep status` needs: grant select on the views
    assert ex.execute("select v from public.secret").fetchall() == [("s3cr3t",)]


def test_runner_with_status_grant_can_read_status(ex, example_dsn, roles):
    runner = roles(
        "lockstep_runner",
        RUNNER_LOCKSTEP_GRANTS,
        ["grant select on lockstep.status, lockstep.parked_keys, lockstep.failing_keys to {role}"],
    )
    p = lockstep_cli("status", "--dsn", as_role(example_dsn, runner))
    assert p.returncode == 0, p.stderr
    assert "exam_keys" in p.stdout


# the application role ----------------------------------------------------------------------------------


def test_app_role_enqueues_through_triggers(ex, example_dsn, roles):
    app = roles("lockstep_app", APP_GRANTS, EXAMPLE_APP_GRANTS)
    with psycopg.connect(as_role(example_dsn, app), autocommit=True) as a:
        a.execute("update example.exam set title = 'lambda mu' where id = 7")
        a.execute("insert into example.exam_item (exam_id, body) values (8, 'nu xi omicron')")
        a.execute("delete from example.exam where id = 9")  # exam_key rows go by the FK cascade
        a.execute("insert into example.exam (id, title, body) values (5000, 'pi rho', 'sigma tau')")
        assert a.execute("select lockstep.enqueue('exam_keys', array[10::bigint])").fetchone()[0] == 1
        # but it is not a runner and cannot redefine the job
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


def test_app_role_without_queue_grant_cannot_write_watched_tables(ex, example_dsn, roles):
    """The enqueue trigger runs as the writer: without the app grants its write fails (and is undone)."""
    app = roles("lockstep_app", ["grant usage on schema lockstep to {role}"], EXAMPLE_APP_GRANTS)
    with psycopg.connect(as_role(example_dsn, app), autocommit=True) as a:
        with raises_sqlstate("42501"):
            a.execute("update example.exam set title = 'upsilon' where id = 7")
    assert ex.execute("select title from example.exam where id = 7").fetchone()[0] != "upsilon"


# job ownership -----------------------------------------------------------------------------------------


def _define_noop(c: psycopg.Connection, job: str = "owned") -> None:
    c.execute("select lockstep.define_job(%s, 'public.lockstep_noop()', every => '1 hour')", [job])


@pytest.fixture
def owners(ex, roles):
    """(owner, other, member): admin roles; member is a member of owner, other is not."""
    ex.execute("create function public.lockstep_noop() returns void language sql as 'select'")
    owner = roles("lockstep_admin", ADMIN_GRANTS)
    other = roles("lockstep_admin", ADMIN_GRANTS)
    member = roles("lockstep_admin", ADMIN_GRANTS)
    ex.execute(sql.SQL("grant {} to {}").format(sql.Identifier(owner), sql.Identifier(member)))
    return owner, other, member


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
    owner, other, _ = owners
    with psycopg.connect(as_role(example_dsn, owner), autocommit=True) as o:
        _define_noop(o)
    with psycopg.connect(as_role(example_dsn, other), autocommit=True) as x:
        taken = x.execute(
            "update lockstep.job set owner = current_user where job = 'owned' returning job"
        ).fetchall()
    assert taken == []


def test_define_derived_refuses_a_target_the_caller_cannot_write(ex, example_dsn, roles):
    ex.execute(
        "create function public.no_keys(ids bigint[])"
        " returns table (exam_id bigint, key text, weight integer)"
        " language sql stable as 'select null::bigint, null::text, null::integer where false'"
    )
    admin = roles("lockstep_admin", ADMIN_GRANTS, ["grant usage on schema example to {role}"])
    with psycopg.connect(as_role(example_dsn, admin), autocommit=True) as a:
        with raises_sqlstate("42501"):
            a.execute(
                "select lockstep.define_derived('wipe', 'example.exam_key', 'public.no_keys(bigint[])',"
                " parent => 'example.exam', parent_column => 'exam_id')"
            )
