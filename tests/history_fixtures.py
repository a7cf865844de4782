"""Shared by the run-history and web tests: cluster roles (unique names, dropped at teardown) and a small
workload on the example database."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo


def as_role(dsn: str, role: str) -> str:
    return make_conninfo(dsn, user=role)


@pytest.fixture(name="make_roles")
def make_roles_fixture(make_db) -> Iterator[Callable[..., str]]:
    """``make_roles(dsn, prefix, *grants, member_of=()) -> name``: a login role with these grants (``{role}``
    and ``{db}`` are filled in) in dsn's database; ``drop owned by`` and ``drop role`` at teardown (before
    ``make_db`` drops the databases: this fixture depends on it)."""
    made: list[tuple[str, str]] = []

    def _make(dsn: str, prefix: str, *grants: str, member_of: tuple[str, ...] = ()) -> str:
        name = f"{prefix}_{secrets.token_hex(4)}"
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(sql.SQL("create role {} login").format(sql.Identifier(name)))
            made.append((dsn, name))
            for g in grants:
                c.execute(
                    sql.SQL(g).format(
                        role=sql.Identifier(name), db=sql.Identifier(conninfo_to_dict(dsn)["dbname"])
                    )
                )
            for m in member_of:
                c.execute(sql.SQL("grant {} to {}").format(sql.Identifier(m), sql.Identifier(name)))
        return name

    yield _make
    for dsn, name in reversed(made):
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(sql.SQL("drop owned by {}").format(sql.Identifier(name)))
    for dsn, name in reversed(made):
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(sql.SQL("drop role {}").format(sql.Identifier(name)))


POISON = """
alter function example.exam_key_compute(bigint[]) rename to exam_key_compute_orig;
create function example.exam_key_compute(keys bigint[])
returns table (exam_id bigint, key text, weight integer) language plpgsql
set search_path = pg_catalog, pg_temp as $$
begin
    if keys && array[13, 42]::bigint[] then
        raise exception 'exam %: title is not valid text',
            (select min(k) from unnest(keys) k where k in (13, 42));
    end if;
    return query select * from example.exam_key_compute_orig(keys);
end $$;
"""

JOBS = """
create function public.ok() returns void language sql as $$ select $$;
create function public.boom() returns void language plpgsql
    as $$ begin raise exception 'boom: the disk is on fire'; end $$;
select lockstep.define_job('ok', 'public.ok()', every => '1 hour');
select lockstep.define_job('boom', 'public.boom()', lock_group => 'alarms', every => '10 minutes');
"""


def setup_workload(ex: psycopg.Connection) -> None:
    """Jobs ok (done), boom (failed); exam_keys with one parked key (42), one failing key (13) and 30
    queued keys; a few runs in the history."""
    ex.execute(JOBS)
    ex.execute(POISON)
    ex.execute("select lockstep.run('ok')")
    ex.execute("select lockstep.run('boom')")
    ex.execute("select lockstep.enqueue('exam_keys', array[13, 42, 7, 8]::bigint[])")
    ex.execute("select lockstep.work('exam_keys')")
    ex.execute("update lockstep.key_failure set parked = true where key = '42'")
    ex.execute("select lockstep.enqueue('exam_keys', array(select generate_series(100, 129))::bigint[])")
