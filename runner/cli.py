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


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        import json

        out = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _setup_logging(fmt: str, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("lockstep").setLevel(level)


@main.command()
@dsn_option
@click.option(
    "--job", "jobs", multiple=True, metavar="NAME", help="Run only this job (repeatable) [default: all]."
)
@click.option("--once", is_flag=True, help="Run what is due now, then exit (1 if any run failed).")
@click.option("--tick", type=click.FloatRange(min=0.01), default=1.0, show_default=True,
              help="Longest sleep between looks at the schedule, in seconds.")
@click.option("--no-listen", is_flag=True, help="Do not LISTEN for new queued keys (poll every tick only).")
@click.option("--no-prepare", is_flag=True,
              help="No server-side prepared statements (transaction poolers; automatic on port 6432).")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--metrics-port", type=int, default=None, metavar="N",
              help="Serve Prometheus metrics on this port (needs prometheus_client).")
def run(dsn: str | None, jobs: tuple[str, ...], once: bool, tick: float, no_listen: bool, no_prepare: bool,
        log_format: str, metrics_port: int | None) -> None:
    """Run due jobs in a loop (or --once). SIGTERM/SIGINT: finish the current call and exit 0."""
    from runner import loop

    if dsn is not None:
        import psycopg
        from psycopg.conninfo import conninfo_to_dict

        try:
            conninfo_to_dict(dsn)
        except psycopg.ProgrammingError as exc:
            raise click.BadParameter(str(exc), param_hint="--dsn") from exc
    _setup_logging(log_format)
    opts = loop.Options(dsn=dsn, jobs=list(jobs) or None, once=once, tick=tick, listen=not no_listen,
                        prepare=False if no_prepare else None)
    raise SystemExit(loop.run(opts, metrics_port))


@main.command()
@dsn_option
@click.option("--json", "as_json", is_flag=True, help="All columns of lockstep.status, as a JSON array.")
def status(dsn: str | None, as_json: bool) -> None:
    """Show lockstep.status. Exit code 1 when a job is failing or has parked keys, else 0."""
    from runner import db
    from runner import status as st

    with db.connect(dsn, app_name="lockstep-status") as conn:
        rows = db.status(conn)
    click.echo(st.to_json(rows) if as_json else st.to_table(rows))
    raise SystemExit(1 if st.unhealthy(rows) else 0)


@main.command()
@dsn_option
@click.option("--parents", default=50000, show_default=True, help="Exams in the example.")
@click.option("--seconds", default=60.0, show_default=True, help="Length of the lockstep phase.")
@click.option("--naive-seconds", default=15.0, show_default=True, help="Length of the naive phase (0: skip).")
@click.option("--embedded", is_flag=True,
              help="Use an embedded PostgreSQL (pgserver, data in .lockstep-demo/) even if a server answers.")
@click.option("--database", default="lockstep_demo", show_default=True, help="Database to (re)create.")
@click.option("--clients", default=4, show_default=True, help="Application client threads.")
@click.option("--keep", is_flag=True, help="Keep the demo database at the end.")
@click.option("--json", "json_out", metavar="FILE", default=None, help="Also write the result as JSON here.")
def demo(dsn: str | None, parents: int, seconds: float, naive_seconds: float, embedded: bool, database: str,
         clients: int, keep: bool, json_out: str | None) -> None:
    """See it work: runners and app clients on the example, then the naive jobs on the same workload.

    The DSN is the admin one (its database is not touched); without a server, an embedded one is started.
    Exit code 0 when lockstep had 0 deadlocks and converged.
    """
    from runner.lab import demo as demo_mod

    opts = demo_mod.Options(dsn=dsn, parents=parents, seconds=seconds, naive_seconds=naive_seconds,
                            embedded=embedded, database=database, clients=clients, keep=keep)
    try:
        result = demo_mod.run(opts)
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from exc
    if json_out is not None:
        with open(json_out, "w") as f:
            f.write(demo_mod.to_json(result) + "\n")
    click.echo(demo_mod.render(result))
    raise SystemExit(0 if result["ok"] else 1)


@main.command()
@dsn_option
@click.option("--parents", default=50000, show_default=True, help="Parents (exams) in the example.")
@click.option("--sections", default="recompute,queue", show_default=True, help="Comma-separated sections.")
@click.option(
    "--json",
    "json_out",
    is_flag=False,
    flag_value="-",
    default=None,
    metavar="[FILE]",
    help="Write the whole result as JSON: to stdout instead of the tables, or to FILE besides them.",
)
def bench(dsn: str | None, parents: int, sections: str, json_out: str | None) -> None:
    """Benchmark lockstep against the naive patterns in a database of its own (the DSN is the admin one)."""
    from runner.lab import bench as bench_mod

    result = bench_mod.run(dsn, parents, tuple(s.strip() for s in sections.split(",") if s.strip()))
    if json_out == "-":
        click.echo(bench_mod.to_json(result))
        return
    if json_out is not None:
        with open(json_out, "w") as f:
            f.write(bench_mod.to_json(result) + "\n")
    click.echo(bench_mod.render(result))


@main.command()
@dsn_option
@click.option("--seconds", default=60.0, show_default=True, help="How long the application clients run.")
@click.option("--parents", default=2000, show_default=True, help="Parents (exams) in the example.")
@click.option("--clients", default=4, show_default=True, help="Application client threads.")
@click.option("--runners", default=2, show_default=True, help="`lockstep run` processes.")
@click.option("--every", default="3 seconds", show_default=True, help="Full recompute interval.")
@click.option("--keep", is_flag=True, help="Keep the storm database (lockstep_storm_<pid>).")
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")
def storm(dsn: str | None, seconds: float, parents: int, clients: int, runners: int, every: str, keep: bool,
          as_json: bool) -> None:
    """App transactions and runners at once in a database of its own; exit 1 if an invariant fails."""
    from runner.lab import storm as storm_mod

    result = storm_mod.run(dsn, seconds, parents, clients, runners, every, keep)
    click.echo(storm_mod.to_json(result) if as_json else storm_mod.render(result))
    raise SystemExit(0 if result["ok"] else 1)
