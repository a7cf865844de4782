"""Install, upgrade or remove the lockstep schema with the packaged Alembic revisions.

Works from any directory, in a checkout or from a wheel: the Alembic ``Config`` is built here, pointing
at :func:`lockstep.paths.alembic_dir`; no ``alembic.ini`` is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TextIO

from alembic import command
from alembic.config import Config
from alembic.runtime.environment import EnvironmentContext
from alembic.script import ScriptDirectory

from lockstep.paths import alembic_dir

VERSION_TABLE = "lockstep_alembic_version"


class MigrateError(RuntimeError):
    """A migrate request that would not do what it says (e.g. an upgrade to a lower revision)."""


@dataclass(frozen=True)
class Outcome:
    """Revisions recorded in ``lockstep_alembic_version`` before and after an online run."""

    before: tuple[str, ...]
    after: tuple[str, ...]

    @property
    def changed(self) -> bool:
        return self.before != self.after


def config(dsn: str | None = None, output: TextIO | None = None) -> Config:
    """An Alembic ``Config`` for lockstep's own migrations (``dsn``: None means DATABASE_URL / libpq)."""
    cfg = Config(output_buffer=output)
    location = str(alembic_dir()).replace("%", "%%")  # ConfigParser interpolation
    cfg.set_main_option("script_location", location)
    cfg.set_main_option("path_separator", "os")
    cfg.set_main_option("version_locations", str(alembic_dir() / "versions").replace("%", "%%"))
    # Passed as an attribute, not an option, so a URL-encoded password ('%40') is not interpolated.
    cfg.attributes["dsn"] = dsn
    return cfg


def head() -> str:
    """The newest lockstep revision shipped with this package."""
    heads = ScriptDirectory.from_config(config()).get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"lockstep migrations must have exactly one head, found {heads}")
    return heads[0]


def migrate(
    dsn: str | None,
    revision: str = "head",
    sql: bool = False,
    downgrade: bool = False,
    output: TextIO | None = None,
) -> Outcome | None:
    """Upgrade (or, with ``downgrade=True``, downgrade) the lockstep schema to ``revision``.

    With ``sql=True`` nothing connects: the SQL script is written to ``output`` (default stdout) and
    None is returned; an offline downgrade goes from ``from:to`` (Alembic's rule), from head when
    ``revision`` names only where to go.
    An upgrade never goes down: ``revision="base"``, or a revision below the current one, raises
    MigrateError (before changing anything) instead of reporting "already at".
    """
    if not downgrade and revision.strip().lower() == "base":
        raise MigrateError(
            "an upgrade to base would remove nothing: use `lockstep migrate downgrade --revision base`"
        )
    cfg = config(dsn, output)
    if downgrade and sql and ":" not in revision:
        revision = f"{head()}:{revision}"  # offline, nothing to read the current revision from: from head
    if downgrade:
        command.downgrade(cfg, revision, sql=sql)
    else:
        command.upgrade(cfg, revision, sql=sql)
    if sql:
        return None
    outcome = Outcome(tuple(cfg.attributes["before"]), tuple(cfg.attributes["after"]))
    if not downgrade and not outcome.changed:
        target = _resolve(revision)
        if target is not None and target not in outcome.after:
            now = ", ".join(outcome.after) or "base"
            raise MigrateError(
                f"the schema is at {now}, above {target}: an upgrade never goes down; "
                f"use `lockstep migrate downgrade --revision {revision}`"
            )
    return outcome


def _resolve(revision: str) -> str | None:
    """The revision id ``revision`` names (None for head/heads or relative forms)."""
    if revision in ("head", "heads") or revision.startswith(("+", "-")) or "@" in revision:
        return None
    script = ScriptDirectory.from_config(config())
    rev = script.get_revision(revision)
    return rev.revision if rev is not None else None


def current(dsn: str | None) -> tuple[str, ...]:
    """The revisions recorded in lockstep_alembic_version (empty: none). Changes nothing; waits for a
    migration in progress (it takes the migrate lock)."""
    cfg = config(dsn)
    script = ScriptDirectory.from_config(cfg)
    with EnvironmentContext(cfg, script, fn=lambda rev, context: [], dont_mutate=True):
        script.run_env()
    return tuple(cfg.attributes["before"])
