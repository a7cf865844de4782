"""The ``lockstep`` command. Commands stay thin: they parse options and call one function.

Adding a command: define it with ``@main.command()`` (reuse ``dsn_option``); errors listed in
``_user_errors()`` are turned into a one-line ``Error: ...`` by ``_Group.invoke``, the only error boundary.
"""

from __future__ import annotations

import logging

import click

from runner import __version__


def _user_errors() -> tuple[type[BaseException], ...]:
    import psycopg
    from alembic.util import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    from runner.sqlfiles import SqlFilesError

    return (psycopg.Error, SQLAlchemyError, CommandError, SqlFilesError, OSError)


def _message(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)  # sqlalchemy.exc.DBAPIError wraps the psycopg error
    text = str(orig if orig is not None else exc).strip()
    return text or type(exc).__name__


class _Group(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.ClickException:
            raise
        except _user_errors() as exc:
            raise click.ClickException(_message(exc)) from exc


dsn_option = click.option(
    "--dsn",
    envvar="DATABASE_URL",
    metavar="URL",
    default=None,
    help="PostgreSQL connection string [env DATABASE_URL; default: libpq's PGHOST, PGDATABASE, ...].",
)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="lockstep")
def main() -> None:
    """lockstep: keep derived tables up to date from background jobs, without deadlocks."""


@main.command()
@dsn_option
@click.option("--sql", is_flag=True, help="Print the SQL script instead of connecting (for psql -f).")
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@click.option(
    "--downgrade",
    "downgrade_to",
    metavar="REV",
    default=None,
    hidden=True,
    help="Downgrade to REV instead (e.g. base); with --sql, REV must be FROM:TO.",
)
def migrate(dsn: str | None, sql: bool, revision: str, downgrade_to: str | None) -> None:
    """Install or upgrade the lockstep schema (Alembic, version table lockstep_alembic_version)."""
    from runner import migrate as migrations

    if not sql:
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        logging.getLogger("alembic.runtime.migration").setLevel(logging.INFO)
    if downgrade_to is not None:
        outcome = migrations.migrate(dsn, downgrade_to, sql=sql, downgrade=True)
    else:
        outcome = migrations.migrate(dsn, revision, sql=sql)
    if outcome is not None:
        now = ", ".join(outcome.after) or "base"
        if outcome.changed:
            click.echo(f"lockstep schema: {', '.join(outcome.before) or 'base'} -> {now}", err=True)
        else:
            click.echo(f"lockstep schema: already at {now}", err=True)
