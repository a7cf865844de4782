"""Cluster roles for the run-history and web tests: unique names, dropped at teardown."""

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
