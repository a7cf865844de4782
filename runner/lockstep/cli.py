"""The ``lockstep`` command. Commands stay thin: they parse options and call one function.

Conventions (docs/cli.md), the same for every command:

- ``-h`` / ``--help``; ``--log-level LEVEL`` and ``-v`` (repeatable), before or after the command name;
- every option can also come from the environment: ``LOCKSTEP_<COMMAND>_<OPTION>`` (click's
  ``auto_envvar_prefix``, e.g. ``LOCKSTEP_RUN_TICK=0.5``), ``LOCKSTEP_LOG_LEVEL`` for the log level, and
  ``--dsn`` from ``LOCKSTEP_DSN``, else ``DATABASE_URL``, else libpq's own defaults (PGHOST, ...);
- ``--dsn`` takes every form :mod:`lockstep.dsn` accepts (libpq key=value, URL, ``postgresql+driver://``);
- ``--json`` always means: print the command's result as JSON on stdout instead of text;
- exit codes (:mod:`lockstep.errors`): 0 ok/healthy, 1 unhealthy or failed, 2 usage error, 3 no server
  answered, 4 permanent setup error (database, role or lockstep schema missing, login refused, bad
  server options), with a hint.

Adding a command: define it with ``@main.command()`` (reuse ``dsn_option`` and ``log_options``); errors
listed in ``_user_errors()`` are turned into a one-line ``Error: ...`` by ``_Group.invoke``, the only
error boundary.
"""

from __future__ import annotations

import functools
import importlib
import json as jsonlib
import logging
import shlex
import sys
from datetime import UTC, datetime
from typing import Any

import click

from lockstep import __version__
from lockstep import errors as codes

log = logging.getLogger("lockstep.cli")

CONTEXT = {"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "LOCKSTEP", "max_content_width": 110}
LEVELS = ("debug", "info", "warning", "error")


def _user_errors() -> tuple[type[BaseException], ...]:
    import psycopg
    from alembic.util import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    from lockstep.migrate import MigrateError
    from lockstep.sqlfiles import SqlFilesError

    return (psycopg.Error, SQLAlchemyError, CommandError, SqlFilesError, MigrateError, OSError)


class Failure(click.ClickException):
    """``Error: <message>`` on stderr, and this exit code."""

    def __init__(self, message: str, exit_code: int = codes.EXIT_UNHEALTHY) -> None:
        super().__init__(message)
        self.exit_code = exit_code


MIGRATE_PRIVILEGE_HINT = (
    "`lockstep migrate` needs a role that may create schema lockstep (CREATE on the database) and its "
    "version table lockstep_alembic_version in the first schema of its search_path (CREATE on public: "
    "PostgreSQL 15 grants it only to the database owner): run it as the database owner or an admin"
)


OTHER_PRIVILEGE_HINT = (
    "this role lacks a privilege this command needs: docs/security.md lists the grants of each role "
    "(owner, application, runner, viewer)"
)


def _failure(exc: BaseException, command: str | None = None) -> Failure:
    """One line for any user-facing error, with the exit code and hint its kind calls for."""
    import psycopg

    orig = getattr(exc, "orig", None)  # sqlalchemy.exc.DBAPIError wraps the psycopg error
    err = orig if isinstance(orig, BaseException) else exc
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else type(err).__name__
    hint = codes.permanent_hint(err)
    state = getattr(err, "sqlstate", None)
    if command == "migrate" and state == "42501" and "lockstep_alembic_version" in text:
        # `migrate current` / `check` by a role that may not read the version table: not a CREATE problem
        hint = (
            "this role may not read lockstep's version table: grant select on lockstep_alembic_version, "
            "or run it as the installer"
        )
    elif command == "migrate" and state == "42501":
        # the installer's grants, not the runner's; a downgrade refused for other owners' watched tables
        # says what to do itself (it was told to get CREATE on the database it owned)
        hint = getattr(getattr(err, "diag", None), "message_hint", None) or MIGRATE_PRIVILEGE_HINT
    elif command not in (None, "run") and state == "42501":
        # not the runner: an application role's `lockstep status`, another owner's `lockstep drop`... were
        # told to grant the runner its privileges. The server's own hint first.
        diag = getattr(err, "diag", None)
        hint = getattr(diag, "message_hint", None) or OTHER_PRIVILEGE_HINT
        return Failure(f"{state}: {text} (hint: {hint})", codes.EXIT_SETUP)
    if hint is not None:
        return Failure(f"{text} (hint: {hint})", codes.EXIT_SETUP)
    if isinstance(err, psycopg.OperationalError) and (state is None or state[:2] in ("08", "57", "53")):
        return Failure(text, codes.EXIT_UNREACHABLE)  # no server answered, or it went away
    # the server answered with an error (55P03: a lock the command gave up on): say which, and its hint
    diag = getattr(err, "diag", None)
    server_hint = getattr(diag, "message_hint", None) if diag is not None else None
    if state in ("42P01", "42883") and command not in (None, "migrate"):
        server_hint = server_hint or codes.GONE_OBJECT_HINT  # not lockstep's object: permanent_hint said so
    if state:
        text = f"{state}: {text}"
    return Failure(f"{text} (hint: {server_hint})" if server_hint else text)


class _Group(click.Group):
    def resolve_command(self, ctx: click.Context, args: list[str]):
        """An unknown command is a usage error that lists the commands (exit 2)."""
        if args and not args[0].startswith("-") and self.get_command(ctx, args[0]) is None:
            raise click.UsageError(
                f"No such command {args[0]!r}. Commands: {', '.join(self.list_commands(ctx))}.", ctx
            )
        return super().resolve_command(ctx, args)

    def invoke(self, ctx: click.Context):
        try:
            try:
                return super().invoke(ctx)
            except BrokenPipeError:
                raise
            except click.UsageError:
                raise
            except click.ClickException as exc:
                _json_error(ctx, exc.format_message(), exc.exit_code)
                raise
            except _user_errors() as exc:
                failure = _failure(exc, ctx.invoked_subcommand)
                _json_error(ctx, failure.format_message(), failure.exit_code)
                raise failure from exc
        except BrokenPipeError:
            _quiet_broken_pipe()


def _json_error(ctx: click.Context, message: str, exit_code: int) -> None:
    """With --json, an error is JSON on stdout too (``{"error": ..., "exit_code": ...}``), so a script
    reading stdout gets an object whatever happened; the one-line ``Error:`` still goes to stderr."""
    if ctx.find_root().meta.get("lockstep.json"):
        click.echo(jsonlib.dumps({"error": message, "exit_code": exit_code}))


def _quiet_broken_pipe() -> None:
    """The reader of stdout went away (``lockstep migrate --sql | head``): nothing left to say, exit 0."""
    import os
    import sys

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush of stdout must not fail again
    raise SystemExit(codes.EXIT_OK)


class _Option(click.Option):
    """Options show their environment variable in --help; ``--json`` is remembered for the error boundary."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("show_envvar", True)
        if args and "--json" in args[0]:
            kwargs.setdefault("callback", _remember_json)
        super().__init__(*args, **kwargs)


def _remember_json(ctx: click.Context, param: click.Parameter, value):
    if value:
        ctx.find_root().meta["lockstep.json"] = True
    return value


class SectionsType(click.ParamType):
    """A comma-separated list of names from ``choices`` (each one checked: exit 2 with the valid ones)."""

    name = "sections"

    def __init__(self, choices: tuple[str, ...]) -> None:
        self.choices = choices

    def get_metavar(self, param, ctx=None) -> str:
        return "[" + "|".join(self.choices) + "],..."

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        names = tuple(s.strip() for s in str(value).split(",") if s.strip())
        unknown = [n for n in names if n not in self.choices]
        if unknown or not names:
            named = ", ".join(map(repr, unknown)) or "no section"
            self.fail(
                f"{named}: not a section; choose from {', '.join(self.choices)} (comma-separated)",
                param,
                ctx,
            )
        return names


option = functools.partial(click.option, cls=_Option)


class DsnType(click.ParamType):
    """A connection string, normalized by lockstep.dsn (``+driver`` dropped); unparseable: exit 2."""

    name = "dsn"

    def convert(self, value, param, ctx):
        from lockstep.dsn import DsnError, normalize

        if value is None:
            return None
        try:
            return normalize(value)
        except DsnError as exc:
            self.fail(str(exc), param, ctx)


def _remember_dsn(ctx: click.Context, param: click.Parameter, value):
    """``lockstep --dsn X COMMAND``: the group's --dsn, kept for the command; the command's own wins."""
    if value is not None:
        ctx.find_root().meta["lockstep.dsn"] = value
    return value


def _dsn_or_group(ctx: click.Context, param: click.Parameter, value):
    """The command's --dsn if given on its command line, else the one before the command name, else the
    environment's (LOCKSTEP_DSN, DATABASE_URL), else libpq's defaults."""
    source = ctx.get_parameter_source(param.name)
    given = ctx.find_root().meta.get("lockstep.dsn")
    if given is not None and source != click.core.ParameterSource.COMMANDLINE:
        return given
    return value


dsn_option = option(
    "--dsn",
    envvar=["LOCKSTEP_DSN", "DATABASE_URL"],
    type=DsnType(),
    metavar="DSN",
    default=None,
    callback=_dsn_or_group,
    help="PostgreSQL connection string: libpq key=value, postgresql:// URL or postgresql+driver:// "
    "[default: libpq's PGHOST, PGDATABASE, ...].",
)


# -- logging -----------------------------------------------------------------------------------------------


def _remember_level(ctx: click.Context, param: click.Parameter, value):
    meta = ctx.find_root().meta
    if param.name == "log_level" and value is not None:
        from_env = ctx.get_parameter_source("log_level") == click.core.ParameterSource.ENVIRONMENT
        if not (from_env and "lockstep.log_level" in meta):  # `lockstep --log-level X run` wins over the env
            meta["lockstep.log_level"] = value
    elif param.name == "verbose" and value:
        meta["lockstep.verbose"] = meta.get("lockstep.verbose", 0) + value
    return value


def log_options(f):
    """``--log-level`` and ``-v``; accepted before the command name too (``lockstep -v run``)."""
    f = option(
        "-v",
        "--verbose",
        count=True,
        expose_value=False,
        callback=_remember_level,
        allow_from_autoenv=False,
        show_envvar=False,
        help="More log output (repeatable); --log-level wins.",
    )(f)
    f = option(
        "--log-level",
        type=click.Choice(LEVELS, case_sensitive=False),
        default=None,
        expose_value=False,
        callback=_remember_level,
        envvar="LOCKSTEP_LOG_LEVEL",
        help="Log level of lockstep's own messages [default: info for run, warning otherwise].",
    )(f)
    return f


def log_level(default: int) -> int:
    """The level asked for on the command line (or LOCKSTEP_LOG_LEVEL), else ``default`` lowered per -v."""
    meta = click.get_current_context().find_root().meta
    named = meta.get("lockstep.log_level")
    if named is not None:
        return getattr(logging, named.upper())
    return max(logging.DEBUG, default - 10 * meta.get("lockstep.verbose", 0))


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            # UTC with its offset, so the line means one instant wherever it is read (it was local time
            # without an offset)
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return jsonlib.dumps(out, default=str)


def _setup_logging(fmt: str = "text", level: int = logging.INFO) -> None:
    """lockstep's loggers at ``level``, everything else (alembic, psycopg...) at WARNING.

    ``fmt``: ``text`` (time, level, message), ``json`` (one object per line) or ``plain`` (message only).
    """
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    elif fmt == "plain":
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("lockstep").setLevel(level)


def _echo_json(value) -> None:
    click.echo(jsonlib.dumps(value, indent=2, default=str))


# -- commands ------------------------------------------------------------------------------------------------


@click.group(cls=_Group, context_settings=CONTEXT)
@click.version_option(__version__, "-V", "--version", prog_name="lockstep")
@option(
    "--dsn",
    type=DsnType(),
    metavar="DSN",
    default=None,
    expose_value=False,
    is_eager=True,
    callback=_remember_dsn,
    allow_from_autoenv=False,
    show_envvar=False,
    help="PostgreSQL connection string for the command; the command's own --dsn wins.",
)
@log_options
def main() -> None:
    """lockstep: keep derived tables up to date from background jobs, without deadlocks.

    Exit codes: 0 ok, 1 unhealthy or failed, 2 usage error, 3 no server answered, 4 permanent setup
    error (database, role or lockstep schema missing...; the message has a hint).
    """


MIGRATE_ACTIONS = ("upgrade", "downgrade", "current", "check")
BENCH_SECTIONS = ("recompute", "queue", "scaling", "oltp")  # lockstep.lab.bench.SECTIONS (a test checks)


@main.command()
@click.argument("action", required=False, default="upgrade", type=click.Choice(MIGRATE_ACTIONS))
@dsn_option
@option(
    "--revision",
    default=None,
    metavar="REV",
    help="Target revision [upgrade: head; downgrade: required, e.g. base or lockstep_0001].",
)
@option("--sql", is_flag=True, help="upgrade/downgrade: print the SQL script, do not connect (psql -f).")
@option("--json", is_flag=True, help="current/check: print the result as JSON.")
@log_options
def migrate(action: str, dsn: str | None, revision: str | None, sql: bool, json: bool) -> None:
    """Install, upgrade, downgrade or inspect the lockstep schema (version table lockstep_alembic_version).

    \b
    lockstep migrate                         upgrade to the newest revision (head)
    lockstep migrate downgrade --revision base   remove lockstep entirely
    lockstep migrate current                 the revision installed (nothing is changed)
    lockstep migrate check                   exit 0 at head, 1 when an upgrade is due
    """
    from lockstep import migrate as migrations

    _setup_logging("plain", log_level(logging.WARNING))
    if action in ("current", "check"):
        if sql or revision is not None:
            raise click.UsageError(f"migrate {action} takes no --sql / --revision")
        current = migrations.current(dsn)
        elsewhere = not current and _schema_exists(dsn)
        _migrate_report(action, current, migrations.head(), json, elsewhere)
        return
    if json:
        raise click.UsageError("--json is for migrate current / check")
    if action == "upgrade" and (revision or "").strip().lower() == "base":
        raise click.UsageError("an upgrade never goes down: `lockstep migrate downgrade --revision base`")
    if action == "downgrade" and revision is None:
        raise click.UsageError("migrate downgrade needs --revision (e.g. base: remove lockstep)")
    if not sql:
        steps = logging.getLogger("alembic.runtime.migration")
        steps.setLevel(log_level(logging.INFO))
        steps.addFilter(_alembic_chatter)
    outcome = migrations.migrate(dsn, revision or "head", sql=sql, downgrade=action == "downgrade")
    if outcome is not None:
        now = ", ".join(outcome.after) or "base"
        if outcome.changed:
            click.echo(f"lockstep schema: {', '.join(outcome.before) or 'base'} -> {now}", err=True)
        else:
            click.echo(f"lockstep schema: already at {now}", err=True)


def _alembic_chatter(record: logging.LogRecord) -> bool:
    """Alembic's "Context impl PostgresqlImpl." and "Will assume transactional DDL." only at debug: at the
    default level `lockstep migrate` logs the migration steps alone."""
    if record.msg in ("Context impl %s.", "Will assume %s DDL."):
        return logging.getLogger("alembic.runtime.migration").isEnabledFor(logging.DEBUG)
    return True


def _schema_exists(dsn: str | None) -> bool:
    from lockstep import db

    with db.connect(dsn, app_name="lockstep-migrate") as conn:
        return db.lockstep_installed(conn)


def _migrate_report(action: str, current: tuple[str, ...], head: str, json: bool, elsewhere: bool) -> None:
    """``elsewhere``: no revision in lockstep_alembic_version, yet the schema exists (a host's Alembic)."""
    at_head = current == (head,)
    if json:
        out = {"current": list(current), "head": head, "at_head": at_head}
        if elsewhere:
            out["schema_without_lockstep_alembic_version"] = True
        _echo_json(out)
    elif elsewhere:
        click.echo(
            "the lockstep schema exists, but lockstep_alembic_version records no revision: it is managed by "
            "your application's Alembic (see `alembic current`; docs/operations.md: moving to your"
            " application's Alembic)"
        )
    elif action == "current" or at_head:
        state = "head" if at_head else f"head is {head}"
        click.echo(f"{', '.join(current) or 'base (not installed)'} ({state})")
    else:
        click.echo(f"lockstep schema: {', '.join(current) or 'base'}, head is {head}: run `lockstep migrate`")
    if action == "check" and not at_head:
        raise SystemExit(codes.EXIT_UNHEALTHY)


@main.command()
@dsn_option
@option("--job", multiple=True, metavar="NAME", help="Run only this job (repeatable) [default: all].")
@option("--once", is_flag=True, help="Run what is due now, then exit (1 if any run failed).")
@option(
    "--tick",
    type=click.FloatRange(min=0.01),
    default=1.0,
    show_default=True,
    help="Longest sleep between looks at the schedule, in seconds.",
)
@option("--no-listen", is_flag=True, help="Do not wake early when keys are enqueued; look every tick only.")
@option(
    "--batch-wait",
    type=click.FloatRange(min=0),
    default=0.2,  # lockstep.loop.BATCH_WAIT (loop is imported when the command runs)
    show_default=True,
    help="After a worker pass that left less than a full batch ready (by any runner), let keys gather "
    "this many seconds before the job's next pass: fewer, larger passes under a steady write load (cheaper "
    "per key), "
    "at the cost of up to this much more lag. 0: pass again as soon as keys arrive. A backlog is drained "
    "without waiting.",
)
@option(
    "--no-prepare",
    is_flag=True,
    help="No server-side prepared statements (transaction poolers; automatic on port 6432).",
)
@option(
    "--connection-check-interval",
    metavar="TIME",
    default=None,
    help="Set client_connection_check_interval (e.g. 1s) on the runner's sessions, so a killed "
    "runner's backend stops at once (direct connections; behind PgBouncer set it on the role).",
)
@option(
    "--synchronous-commit",
    type=click.Choice(["off", "local", "remote_write", "on", "remote_apply"]),
    default="off",
    show_default=True,
    help="How each pass commits. off: without waiting for the WAL flush or a synchronous standby; a crash "
    "may lose the last passes, each whole with its queue entries, which the next pass redoes. on (or the "
    "others): PostgreSQL's synchronous_commit for the pass's transaction.",
)
@option(
    "--capture-every",
    type=click.FloatRange(min=0),
    default=0.2,  # lockstep.loop.CAPTURE_EVERY
    show_default=True,
    help="Seconds between two reads of the WAL (lockstep.capture()) while tables are watched through it "
    "(watch(..., via => 'wal')). Each read decodes the WAL since the slot's restart point: less often costs "
    "the server less and adds up to this much lag.",
)
@option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True)
@option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    metavar="N",
    help="Serve Prometheus metrics on this port (needs prometheus_client).",
)
@option(
    "--metrics-host",
    default="0.0.0.0",
    show_default=True,
    metavar="ADDR",
    help="Address the metrics server binds to (e.g. 127.0.0.1).",
)
@log_options
def run(
    dsn: str | None,
    job: tuple[str, ...],
    once: bool,
    tick: float,
    no_listen: bool,
    batch_wait: float,
    no_prepare: bool,
    connection_check_interval: str | None,
    synchronous_commit: str,
    capture_every: float,
    log_format: str,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Run due jobs in a loop (or --once). SIGTERM/SIGINT: finish the current call and exit 0.

    Exits at once with code 4 (and a hint) when the database, the role or the lockstep schema does not
    exist; connection losses and server restarts are retried with backoff. --once: 1 if a run failed,
    3 if no server answered.
    """
    from lockstep import db, loop
    from lockstep.dsn import describe

    if connection_check_interval is not None and not db.CHECK_INTERVAL.match(connection_check_interval):
        raise click.BadParameter(
            "expected a PostgreSQL time such as 1s or 500ms", param_hint="--connection-check-interval"
        )
    if metrics_port is not None and not _importable("prometheus_client"):
        raise click.UsageError(
            "--metrics-port needs prometheus_client: pip install 'pg-lockstep[metrics]' "
            "(or pip install prometheus-client)"
        )
    _setup_logging(log_format, log_level(logging.INFO))
    opts = loop.Options(
        dsn=dsn,
        jobs=list(job) or None,
        once=once,
        tick=tick,
        listen=not no_listen,
        batch_wait=batch_wait,
        prepare=False if no_prepare else None,
        check_interval=connection_check_interval,
        synchronous_commit=synchronous_commit,
        capture_every=capture_every,
    )
    try:
        server = loop.Metrics(metrics_port, metrics_host)  # bound before the start-up line names its port
    except OSError as exc:  # a port in use, an unknown host: said as such, a setup error
        raise Failure(
            f"cannot serve metrics on {metrics_host}:{metrics_port} (--metrics-port, --metrics-host): {exc}",
            codes.EXIT_SETUP,
        ) from exc
    metrics = server.url or "off"
    log.info(
        "lockstep %s run starting: %s; jobs %s; %s; tick %gs; listen %s; batch wait %gs; "
        "prepared statements %s; connection check %s; synchronous commit %s; metrics %s",
        __version__,
        describe(dsn),
        ", ".join(job) or "all",
        "once" if once else "loop",
        tick,
        "off" if no_listen else "on",
        batch_wait,
        "off" if no_prepare else "auto",
        connection_check_interval or "server's",
        synchronous_commit,
        metrics,
        extra={
            "fields": {"version": __version__, "jobs": list(job) or None, "once": once, "metrics": metrics}
        },
    )
    raise SystemExit(loop.run(opts, server))


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _server_warning(diag: Any) -> None:  # psycopg.errors.Diagnostic
    if diag.severity_nonlocalized == "WARNING":
        logging.getLogger("lockstep").warning("%s", diag.message_primary)


def _connect(dsn: str | None, app_name: str):
    """A short connection for the one-shot commands; a missing lockstep schema is exit 4 with a hint."""
    from lockstep import db

    conn = db.connect(dsn, app_name=app_name)
    # the server's warnings reach the user (retry() dropping a queued key that names no parent said so only
    # to the server log: "0 keys back in the queue", silently)
    conn.add_notice_handler(_server_warning)
    if not db.lockstep_installed(conn):
        name = conn.info.dbname
        conn.close()
        message = f'database "{name}" has no lockstep schema (hint: {codes.MIGRATE_HINT})'
        raise Failure(message, codes.EXIT_SETUP)
    return conn


@main.command()
@dsn_option
@option("--json", is_flag=True, help="Print all columns of lockstep.status as a JSON array.")
@option("--wide", is_flag=True, help="Every column, the errors too (wider than 100 columns).")
@option("--history", is_flag=True, help="Show the newest runs from lockstep.run_log instead (exit 0).")
@option("--job", default=None, metavar="NAME", help="With --history: only this job's runs.")
@option(
    "--limit",
    type=click.IntRange(min=1),
    default=50,
    show_default=True,
    help="With --history: how many runs.",
)
@option(
    "--max-lag",
    type=click.FloatRange(min=0),
    default=900.0,
    show_default=True,
    metavar="SECONDS",
    help="Unhealthy when a job's oldest queue entry (a failing or parked key's too) waits longer (0: not "
    "checked).",
)
@option(
    "--max-stall",
    type=click.FloatRange(min=0),
    default=120.0,
    show_default=True,
    metavar="SECONDS",
    help="Unhealthy when a key a worker pass should take now has been ready longer (0: not checked).",
)
@option(
    "--max-stall-passes",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    metavar="N",
    help="Unhealthy when such a key was left by N worker passes (0: not checked).",
)
@log_options
def status(
    dsn: str | None,
    json: bool,
    wide: bool,
    history: bool,
    job: str | None,
    limit: int,
    max_lag: float,
    max_stall: float,
    max_stall_passes: int,
) -> None:
    """Show lockstep.status, one line per job within 100 columns (--wide, --json: every column).

    Exit 0 healthy; 1 when a job is failing, has parked keys, is flagged for a full recompute, has a key
    queued longer than --max-lag, or a key a worker pass should take stays ready past --max-stall or
    --max-stall-passes, or the WAL capture's slot holds more WAL than its bound
    (lockstep.capture_status); 3 no server answered; 4 no lockstep schema (or database, role).
    --history: the newest runs of lockstep.run_log, oldest first (exit 0)."""
    from lockstep import db
    from lockstep import status as st

    _setup_logging(level=log_level(logging.WARNING))
    if history:
        _status_history(dsn, json, job, limit, wide)
        return
    if job is not None:
        raise click.UsageError("--job goes with --history")
    with _connect(dsn, "lockstep-status") as conn:
        rows = db.status(conn)
        capture = db.capture_problem(conn)
        # none at all is not a visibility problem (that message sent a user after grants)
        hidden = not rows and db.job_count(conn) > 0
        empty = st.no_jobs(conn.info.user) if hidden else "no jobs defined"
    if json:
        click.echo(st.to_json(rows))
    else:
        click.echo(st.to_table(rows, empty=empty) if wide else st.compact_table(rows, empty=empty))
    if hidden:
        # jobs exist and this role sees none: nothing was checked, so not healthy (a viewer that lost one
        # grant, SELECT on lockstep.viewer, saw none and exited 0 while a job was failing)
        click.echo(f"Error: {empty}: nothing to check", err=True)
        raise SystemExit(codes.EXIT_SETUP)
    for line in st.reasons(rows, max_lag, max_stall, max_stall_passes) + ([capture] if capture else []):
        click.echo(line, err=True)
    raise SystemExit(max(st.exit_code(rows, max_lag, max_stall, max_stall_passes), 1 if capture else 0))


@main.command()
@click.argument("job")
@click.argument("keys", nargs=-1)
@dsn_option
@option("--json", is_flag=True, help="Print the result as JSON.")
@log_options
def retry(job: str, keys: tuple[str, ...], dsn: str | None, json: bool) -> None:
    """Put failing or parked keys of JOB back in its queue (all of them when no KEYS are given).

    Calls lockstep.retry(job [, keys]); KEYS are cast to the job's parent key type.
    """
    import psycopg

    from lockstep import db

    _setup_logging(level=log_level(logging.WARNING))
    with _connect(dsn, "lockstep-retry") as conn:
        try:
            n = db.retry(conn, job, list(keys) or None)
        except psycopg.DataError as exc:  # a KEY not of the job's key type (22P02, 22003...)
            raise _bad_keys(
                exc,
                "KEYS are parent keys of the job's key type; a queued key not of that type names no parent:"
                f" `lockstep retry {shlex.quote(job)}` without KEYS drops such keys",
            ) from exc
    if json:
        _echo_json({"job": job, "requeued": n})
    else:
        # and the job's failure backoff ended (lockstep.retry): "0 keys back" after a whole-job failure read
        # as nothing done
        click.echo(
            f"{job}: {n} key{'' if n == 1 else 's'} back in the queue; its failure backoff, if any, ended"
        )


@main.command()
@click.argument("job")
@dsn_option
@option("--json", is_flag=True, help="Print the result as JSON.")
@log_options
def drop(job: str, dsn: str | None, json: bool) -> None:
    """Remove JOB: its definition, state, queue, key failures and enqueue triggers (lockstep.drop_job).

    The derived table and its rows stay.
    """
    from lockstep import db

    _setup_logging(level=log_level(logging.WARNING))
    with _connect(dsn, "lockstep-drop") as conn:
        db.drop_job(conn, job)
    if json:
        _echo_json({"job": job, "dropped": True})
    else:
        click.echo(f"{job}: dropped")


def _bad_keys(exc: BaseException, hint: str) -> Failure:
    """A key the job's key type does not read (22P02, 22003...): a usage error (exit 2), written as every
    other error (``SQLSTATE: message (hint: ...)``), the same for retry, verify and diff."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return Failure(f"{getattr(exc, 'sqlstate', None)}: {first} (hint: {hint})", codes.EXIT_USAGE)


KEYS_HINT = (
    "--keys takes parent keys of the job's key type, comma-separated (\\, for a comma in a key;"
    " a composite key as its record text, e.g. (1,42))"
)


def _split_value(value: str) -> list[str]:
    """One ``--keys`` value split at its commas. ``\\,`` is a comma inside a key (``Lyon\\, Est``). A key
    that starts with ``(`` is a composite key's record text: it is kept whole up to its closing parenthesis,
    commas, double quotes and backslashes included (``("Lyon, Est",1)``)."""
    keys: list[str] = []
    key, depth, quoted, i = "", 0, False, 0
    while i < len(value):
        c = value[i]
        if depth == 0 and c == "\\" and value[i + 1 : i + 2] == ",":
            key, i = key + ",", i + 2
            continue
        if depth == 0 and c == ",":
            keys.append(key)
            key, i = "", i + 1
            continue
        if depth == 0 and c == "(" and not key.strip():
            depth = 1
        elif depth and c == "\\":
            key, i = key + value[i : i + 2], i + 2
            continue
        elif depth and c == '"':
            quoted = not quoted
        elif depth and not quoted:
            depth += {"(": 1, ")": -1}.get(c, 0)
        key, i = key + c, i + 1
    return [*keys, key]


def _split_keys(values: tuple[str, ...]) -> list[str] | None:
    """``--keys`` values, each comma-separated (``_split_value``)."""
    keys = [k.strip() for v in values for k in _split_value(v)]
    return [k for k in keys if k] or None


@main.command()
@click.argument("job")
@option(
    "--keys",
    multiple=True,
    metavar="K1,K2,...",
    help="Only these parents (comma-separated, repeatable; \\, for a comma in a key; a composite key as its "
    "record text, e.g. (1,42); cast to the job's key type) [default: all].",
)
@dsn_option
@option("--json", is_flag=True, help="Print the result as JSON.")
@log_options
def verify(job: str, keys: tuple[str, ...], dsn: str | None, json: bool) -> None:
    """Compare JOB's derived table with what its compute returns now (lockstep.verify), without locks and
    without writing: rows missing, extra and different, with up to 3 examples of each.

    Exit 0 when they match, 1 on any difference. Keys still queued may differ until the runner has run:
    verify when the queue is empty, or run it again.
    """
    import psycopg

    from lockstep import db

    _setup_logging(level=log_level(logging.WARNING))
    with _connect(dsn, "lockstep-verify") as conn:
        try:
            result = db.verify(conn, job, _split_keys(keys))
        except psycopg.DataError as exc:  # a key not of the job's key type (22P02, 22003...)
            raise _bad_keys(exc, KEYS_HINT) from exc
    if json:
        out = {
            "job": job,
            "keys": result.keys,
            "ok": result.ok,
            "missing": result.missing,
            "extra": result.extra,
            "different": result.different,
            "examples": result.examples,
        }
        _echo_json(out)
    else:
        click.echo(_verify_text(result))
    raise SystemExit(codes.EXIT_OK if result.ok else codes.EXIT_UNHEALTHY)


def _verify_text(r) -> str:  # lockstep.db.Verified
    scope = "all parents" if r.keys is None else f"{len(r.keys)} parent{'' if len(r.keys) == 1 else 's'}"
    if r.ok:
        return f"{r.job}: matches its compute ({scope})"
    lines = [f"{r.job}: {r.missing} missing, {r.extra} extra, {r.different} different ({scope})"]

    def row(value) -> str:  # as the database holds it: "Zürich", not "Z\u00fcrich"
        return jsonlib.dumps(value, default=str, ensure_ascii=False)

    for e in r.examples:
        if e["kind"] == "missing":
            lines.append(f"  missing    {row(e['computed'])}")
        elif e["kind"] == "extra":
            lines.append(f"  extra      {row(e['target'])}")
        else:
            lines.append(f"  different  target   {row(e['target'])}")
            lines.append(f"             computed {row(e['computed'])}")
    return "\n".join(lines)


@main.command()
@click.argument("job")
@dsn_option
@option(
    "--keys",
    multiple=True,
    metavar="K1,K2,...",
    help="Only these parents (comma-separated, repeatable; \\, for a comma in a key; a composite key as its "
    "record text, e.g. (1,42); cast to the job's key type) [default: all].",
)
@option(
    "--limit", type=click.IntRange(min=0), default=5, show_default=True, help="Example parents per action."
)
@option("--json", is_flag=True, help="Print the totals and examples as JSON (--limit examples per action).")
@log_options
def diff(job: str, dsn: str | None, keys: tuple[str, ...], limit: int, json: bool) -> None:
    """Show what a recompute of JOB would change now, without changing it (lockstep.preview).

    Totals per action (insert, update, delete) and a few example parents each. Writes nothing and takes
    no row lock. --keys: what a worker pass over those parents would change.
    """
    import psycopg

    from lockstep import controls, db

    _setup_logging(level=log_level(logging.WARNING))
    with _connect(dsn, "lockstep-diff") as conn:
        try:
            rows = db.preview(conn, job, _split_keys(keys))
        except psycopg.DataError as exc:  # a key not of the job's key type (22P02, 22003...)
            raise _bad_keys(exc, KEYS_HINT) from exc
    s = controls.summary(rows, limit)
    if json:
        _echo_json({"job": job, **s})
    else:
        click.echo(controls.summary_text(job, s, _split_keys(keys)))


@main.command()
@click.argument("job")
@dsn_option
@option("--json", is_flag=True, help="Print the result as JSON.")
@log_options
def pause(job: str, dsn: str | None, json: bool) -> None:
    """Pause JOB (lockstep.pause): runs write nothing and return paused; the triggers keep queueing."""
    from lockstep import db

    _setup_logging(level=log_level(logging.WARNING))
    with _connect(dsn, "lockstep-pause") as conn:
        at = db.pause(conn, job)
    if json:
        _echo_json({"job": job, "paused_at": at.isoformat()})
    else:
        click.echo(f"{job}: paused since {at.isoformat()}; `lockstep resume {shlex.quote(job)}` to go on")


@main.command()
@click.argument("job")
@dsn_option
@option("--json", is_flag=True, help="Print the result as JSON.")
@log_options
def resume(job: str, dsn: str | None, json: bool) -> None:
    """Resume JOB (lockstep.resume): its queue is worked, and a full recompute runs first."""
    from lockstep import db

    _setup_logging(level=log_level(logging.WARNING))
    with _connect(dsn, "lockstep-resume") as conn:
        was = db.resume(conn, job)
        derived = db.kind(conn, job) == "derived"  # a generic job has no recompute to flag
    if json:
        _echo_json({"job": job, "resumed": was})
    elif not was:
        click.echo(f"{job}: was not paused")
    else:
        click.echo(f"{job}: resumed; its full recompute is due" if derived else f"{job}: resumed")


@main.command()
@click.argument("job")
@dsn_option
@option("--json", is_flag=True, help="Print the end result as JSON (the progress goes to stderr then).")
@log_options
def backfill(job: str, dsn: str | None, json: bool) -> None:
    """Recompute JOB now and work its hand-off to the end, showing progress (a bar on a terminal, else a
    line a second: parents done / to do, rate, ETA). Ctrl-C stops between batches (exit 1); what is left
    stays queued for the runner. Exit 0 once converged."""
    from lockstep import controls

    _setup_logging(level=log_level(logging.WARNING))
    with _connect(dsn, "lockstep-backfill") as conn:
        out = controls.run_backfill(conn, job, sys.stderr if json else sys.stdout)
    p = out.progress
    if json:
        _echo_json({"job": job, "state": out.state, "done": p.done, "total": p.total, "passes": p.passes,
                    "error": out.error})  # fmt: skip
    elif out.state == "done":
        click.echo(f"{job}: backfill done: {p.summary()}")
    else:
        why = f": {out.error}" if out.error else ""
        rest = "; the rest stays queued for the runner" if out.state == "interrupted" else ""
        click.echo(f"{job}: backfill {out.state} at {p.done}/{p.total} parents{why}{rest}")
    if out.state != "done":
        raise SystemExit(codes.EXIT_UNHEALTHY)


@main.command()
@dsn_option
@option(
    "--parents", type=click.IntRange(min=1), default=50000, show_default=True, help="Exams in the example."
)
@option(
    "--seconds",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Length of the lockstep phase.",
)
@option(
    "--naive-seconds",
    type=click.FloatRange(min=0),
    default=15.0,
    show_default=True,
    help="Length of the naive phase (0: skip).",
)
@option(
    "--embedded",
    is_flag=True,
    help="Use an embedded PostgreSQL (pgserver, data in .lockstep-demo/) even if a server answers.",
)
@option(
    "--database",
    default="lockstep_demo",
    show_default=True,
    help="Database of its own to create (and drop at the end); an existing one is dropped only if lockstep "
    "made it, else the demo stops.",
)
@option(
    "--clients", type=click.IntRange(min=0), default=4, show_default=True, help="Application client threads."
)
@option("--keep", is_flag=True, help="Keep the demo database at the end.")
@option("--json", is_flag=True, help="Print the result as JSON instead of the report.")
@option("--json-file", metavar="FILE", default=None, help="Also write the result as JSON to FILE.")
@log_options
def demo(
    dsn: str | None,
    parents: int,
    seconds: float,
    naive_seconds: float,
    embedded: bool,
    database: str,
    clients: int,
    keep: bool,
    json: bool,
    json_file: str | None,
) -> None:
    """See it work: runners and app clients on the example, then the naive jobs on the same workload.

    The DSN is the admin one (its database is not touched). Without --dsn, DATABASE_URL nor PG*
    settings and with no server answering, an embedded one is started (it says so first); an explicit
    DSN that fails is an error. Exit code 0 when lockstep had 0 deadlocks and converged.
    """
    from lockstep.lab import demo as demo_mod
    from lockstep.lab import scratch

    _setup_logging(level=log_level(logging.WARNING))
    opts = demo_mod.Options(
        dsn=dsn,
        parents=parents,
        seconds=seconds,
        naive_seconds=naive_seconds,
        embedded=embedded,
        database=database,
        clients=clients,
        keep=keep,
    )
    try:
        result = demo_mod.run(opts)
    except demo_mod.NoServer as exc:
        raise Failure(str(exc), codes.EXIT_SETUP if exc.answered else codes.EXIT_UNREACHABLE) from exc
    except scratch.NotOurs as exc:
        raise Failure(str(exc), codes.EXIT_SETUP) from exc
    except RuntimeError as exc:
        raise Failure(str(exc)) from exc
    if json_file is not None:
        with open(json_file, "w") as f:
            f.write(demo_mod.to_json(result) + "\n")
    click.echo(demo_mod.to_json(result) if json else demo_mod.render(result))
    raise SystemExit(0 if result["ok"] else 1)


@main.command()
@dsn_option
@option(
    "--parents",
    type=click.IntRange(min=1),
    default=50000,
    show_default=True,
    help="Parents (exams) in the example.",
)
@option(
    "--sections",
    type=SectionsType(BENCH_SECTIONS),
    default="recompute,queue",
    show_default=True,
    help=f"Comma-separated sections, from: {', '.join(BENCH_SECTIONS)}.",
)
@option("--json", is_flag=True, help="Print the whole result as JSON instead of the tables.")
@option("--json-file", metavar="FILE", default=None, help="Also write the result as JSON to FILE.")
@option(
    "--plot",
    "plot_dir",
    metavar="DIR",
    default=None,
    help="Also draw the figures as PNG charts in DIR, from the same run (needs the extra plot: matplotlib).",
)
@log_options
def bench(
    dsn: str | None,
    parents: int,
    sections: tuple[str, ...],
    json: bool,
    json_file: str | None,
    plot_dir: str | None,
) -> None:
    """Benchmark lockstep against the naive patterns in a database of its own (the DSN is the admin one)."""
    from lockstep.lab import bench as bench_mod
    from lockstep.lab import plot

    _setup_logging(level=log_level(logging.WARNING))
    if plot_dir is not None:
        try:
            plot.require()  # before the bench runs, not after
        except ImportError as exc:
            raise click.UsageError(str(exc)) from None
    result = bench_mod.run(dsn, parents, sections)
    if json_file is not None:
        with open(json_file, "w") as f:
            f.write(bench_mod.to_json(result) + "\n")
    if plot_dir is not None:
        for path in plot.write_charts(result, plot_dir):
            click.echo(f"wrote {path}", err=True)
    click.echo(bench_mod.to_json(result) if json else bench_mod.render(result))


# ---- run history and the web page -------------------------------------------------------------------


def _status_history(dsn: str | None, as_json: bool, job: str | None, limit: int, wide: bool) -> None:
    """`lockstep status --history`: the newest runs, oldest first (rows hidden by row security are absent);
    within 100 columns, or every column with --wide."""
    from lockstep import db
    from lockstep import status as st

    with _connect(dsn, "lockstep-status") as conn:
        rows = db.history(conn, job, limit)
    click.echo(st.to_json(rows) if as_json else st.history_table(rows, wide))


@main.command()
@dsn_option
@option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (anything but a loopback address exposes the page).",
)
@option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8765,
    show_default=True,
    help="Port to listen on (0: any free port, printed at start).",
)
@option(
    "--refresh",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Seconds between the page's own reloads.",
)
@log_options
def web(dsn: str | None, host: str, port: int, refresh: int) -> None:
    """Serve a read-only status page: jobs, queue, failing keys, recent runs. Ctrl-C or SIGTERM stops it."""
    import errno

    import psycopg

    from lockstep import web as web_mod

    _setup_logging("text", log_level(logging.INFO))
    try:  # a permanent error (database, role or lockstep schema missing, login refused) stops it here: exit 4
        with _connect(dsn, "lockstep-web") as conn:
            info = conn.info
            log.info(
                "lockstep web: database %s on host %s port %s as user %s",
                info.dbname,
                info.host,
                info.port,
                info.user,
            )
    except psycopg.OperationalError as exc:
        if codes.permanent_hint(exc) is not None:
            raise
        # no server answered: the page serves 503 until it does, as it would after a restart
        log.warning("lockstep web: %s; serving anyway, the page says so until the database answers", exc)
    try:
        raise SystemExit(web_mod.serve(web_mod.Options(dsn=dsn, host=host, port=port, refresh=refresh)))
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        raise Failure(
            f"cannot listen on {host}:{port} (--host, --port): {exc.strerror}", codes.EXIT_SETUP
        ) from exc
