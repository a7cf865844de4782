"""lockstep.sqlfiles hands SQL over verbatim, online and offline, whatever the SQL files contain."""

from __future__ import annotations

import io
import subprocess

import psycopg
import pytest
from alembic.migration import MigrationContext
from alembic.operations import Operations
from sqlalchemy import create_engine, pool

from lockstep import sqlfiles

# Multi-statement, '%' in format(), %s / %(name)s, :name and ::casts, psql variable names (:DBNAME is
# set by psql) inside dollar quotes and string literals, comments, a DO block with a notice.
TRICKY_UP = {
    "01_schema.sql": "-- first\ncreate schema tricky;\ncreate table tricky.t (k text primary key);\n",
    "02_funcs.sql": """\
create function tricky.q(tab text) returns text language plpgsql as $$
declare
    v text := format('select %I from %I.%I where x = %L', 'c', 'tricky', tab, '50%');
begin
    -- :DBNAME :'DBNAME' %s %(name)s
    return v || ' :DBNAME ' || 1::int::text;
end
$$;
do $$ begin raise notice 'hello %', 'world'; end $$;
insert into tricky.t values ('%s and %% and :DBNAME and %(name)s');
-- trailing comment without newline""",
    "notes.txt": "not sql",
    "1_wrong_name.sql": "select error;",
}
EXPECTED_Q = "select c from tricky.t where x = '50%' :DBNAME 1"
EXPECTED_ROW = "%s and %% and :DBNAME and %(name)s"


@pytest.fixture
def sql_root(tmp_path, monkeypatch):
    folder = tmp_path / "sql" / "9999"
    folder.mkdir(parents=True)
    for name, text in TRICKY_UP.items():
        (folder / name).write_text(text)
    (folder / "down.sql").write_text("drop schema if exists tricky cascade;\n")
    monkeypatch.setattr(sqlfiles, "sql_dir", lambda: tmp_path / "sql")
    return tmp_path / "sql"


def check(dsn: str) -> None:
    with psycopg.connect(dsn) as c:
        assert c.execute("select tricky.q('t')").fetchone()[0] == EXPECTED_Q
        assert c.execute("select k from tricky.t").fetchall() == [(EXPECTED_ROW,)]


def test_files_order_and_errors(sql_root):
    assert [p.name for p in sqlfiles.files("9999", "up")] == ["01_schema.sql", "02_funcs.sql"]
    assert [p.name for p in sqlfiles.files("9999", "down")] == ["down.sql"]
    with pytest.raises(sqlfiles.SqlFilesError, match="no SQL folder"):
        sqlfiles.files("0000", "up")
    (sql_root / "empty").mkdir()
    with pytest.raises(sqlfiles.SqlFilesError, match="no NN_"):
        sqlfiles.files("empty", "up")
    with pytest.raises(sqlfiles.SqlFilesError, match="down.sql"):
        sqlfiles.files("empty", "down")


def test_online_verbatim(sql_root, empty_dsn):
    engine = create_engine(
        "postgresql+psycopg://", creator=lambda: psycopg.connect(empty_dsn), poolclass=pool.NullPool
    )
    with engine.begin() as connection:
        sqlfiles.apply(Operations(MigrationContext.configure(connection)), "9999", "up")
    check(empty_dsn)
    with engine.begin() as connection:
        sqlfiles.apply(Operations(MigrationContext.configure(connection)), "9999", "down")
    engine.dispose()
    with psycopg.connect(empty_dsn) as c:
        assert c.execute("select to_regnamespace('tricky')").fetchone()[0] is None


def test_offline_verbatim_through_psql(sql_root, empty_dsn):
    out = io.StringIO()
    context = MigrationContext.configure(
        dialect_name="postgresql", opts={"as_sql": True, "output_buffer": out}
    )
    sqlfiles.apply(Operations(context), "9999", "up")
    context.impl.static_output("select 'after the last file';")
    subprocess.run(
        ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", empty_dsn],
        input=out.getvalue(),
        check=True,
        capture_output=True,
        text=True,
    )
    check(empty_dsn)
