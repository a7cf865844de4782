"""Alembic environment of lockstep's own migrations (version table ``lockstep_alembic_version``).

Connection, first match wins: ``Config.attributes["dsn"]`` (set by ``lockstep.migrate``), ``-x dsn=...``,
``$DATABASE_URL``, else libpq's own defaults (PGHOST, PGDATABASE, ...). Any libpq connection string works:
a URL (``postgresql://``, ``postgres://`` or SQLAlchemy's ``postgresql+DRIVER://``) or ``key=value``
(``lockstep.dsn``, the parser every ``lockstep`` command uses).

Online, the whole upgrade is one transaction that first takes
``pg_advisory_xact_lock(hashtextextended('lockstep:migrate', 0))``, before Alembic reads the current
version: a concurrent upgrader waits, then finds the schema at head and does nothing. Each revision takes
the same lock again (it stacks), which is what protects a host application's Alembic running our branch.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import create_engine, pool

VERSION_TABLE = "lockstep_alembic_version"
MIGRATE_LOCK = "select pg_advisory_xact_lock(hashtextextended('lockstep:migrate', 0))"

config = context.config
if config.config_file_name is not None:  # the `alembic` command with alembic.ini; not lockstep.migrate
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def libpq_conninfo() -> str:
    """The connection string to hand to libpq ('' means libpq's defaults), via lockstep.dsn's one parser."""
    from lockstep.dsn import normalize

    dsn = (
        config.attributes.get("dsn")
        or context.get_x_argument(as_dictionary=True).get("dsn")
        or os.environ.get("DATABASE_URL")
        or ""
    )
    return normalize(dsn)


def run_migrations_offline() -> None:
    context.configure(
        dialect_name="postgresql",
        literal_binds=True,
        version_table=VERSION_TABLE,
        transactional_ddl=True,
        transaction_per_migration=False,
    )
    with context.begin_transaction():
        context.execute(MIGRATE_LOCK)
        context.run_migrations()


def run_migrations_online() -> None:
    import psycopg

    conninfo = libpq_conninfo()
    # libpq parses the connection string itself (URL or key=value, empty for PG* defaults), so
    # SQLAlchemy's URL parser never sees passwords, socket paths or multi-host strings.
    engine = create_engine(
        "postgresql+psycopg://",
        creator=lambda: psycopg.connect(conninfo, application_name="lockstep migrate"),
        poolclass=pool.NullPool,
    )
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                version_table=VERSION_TABLE,
                transactional_ddl=True,
                transaction_per_migration=False,
            )
            with context.begin_transaction():
                connection.exec_driver_sql(MIGRATE_LOCK)
                migration = context.get_context()
                config.attributes["before"] = migration.get_current_heads()
                context.run_migrations()
                config.attributes["after"] = migration.get_current_heads()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
