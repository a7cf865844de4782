"""One place to read the current schema: sql/schema.sql is the dump of a fresh migrate, kept current.

``make schema`` regenerates it (tests/schema_dump.py); so does ``pytest --update-expected``.
"""

from __future__ import annotations

import pytest
from isolation import check_expected
from schema_dump import SCHEMA_SQL, dump, normalize, pg_dump_path


def test_normalize_drops_what_depends_on_the_dump_not_on_the_schema() -> None:
    raw = (
        "--\n-- PostgreSQL database dump\n--\n\n\\restrict AbC123\n\n"
        "-- Dumped from database version 15.20\n-- Dumped by pg_dump version 15.20\n\n"
        "SET statement_timeout = 0;\nSELECT pg_catalog.set_config('search_path', '', false);\n\n"
        "--\n-- Name: lockstep; Type: SCHEMA; Schema: -; Owner: -\n--\n\n"
        "CREATE SCHEMA lockstep;\n\n\n\nSET default_tablespace = '';\n\n"
        "CREATE FUNCTION lockstep.f() RETURNS void\n    LANGUAGE plpgsql\n"
        "    SET search_path TO 'pg_catalog', 'pg_temp'\n    AS $$\n"
        "-- a comment of our own, kept\nbegin\nend;\n$$;\n\n"
        "--\n-- PostgreSQL database dump complete\n--\n\n\\unrestrict AbC123\n"
    )
    body = normalize(raw).split("\n", 3)[3]  # after the three-line header
    assert body == (
        "\nCREATE SCHEMA lockstep;\n\n"
        "CREATE FUNCTION lockstep.f() RETURNS void\n    LANGUAGE plpgsql\n"
        "    SET search_path TO 'pg_catalog', 'pg_temp'\n    AS $$\n"
        "-- a comment of our own, kept\nbegin\nend;\n$$;\n"
    )


def test_schema_sql_is_the_dump_of_a_fresh_migrate(dsn: str, update_expected: bool) -> None:
    if pg_dump_path() is None:
        pytest.skip("pg_dump not found (pg_config --bindir, LOCKSTEP_PG_BIN or PATH)")
    check_expected(SCHEMA_SQL, dump(dsn), update=update_expected)
