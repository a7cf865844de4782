"""Run the versioned SQL files of ``sql/NNNN/`` from an Alembic revision.

Every revision in ``alembic/versions`` is one call: ``apply(op, "NNNN", "up")`` / ``(..., "down")``.
The files are plain PostgreSQL scripts (``$$`` bodies, ``format('%I', ...)``, ``::type`` casts,
comments); they are handed over verbatim, never through a parameter or bind-parameter parser.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from runner.paths import sql_dir

_UP_FILE = re.compile(r"^\d{2}_[A-Za-z0-9_.-]*\.sql$")


class SqlFilesError(RuntimeError):
    """The SQL files of a version are missing or malformed (a packaging error, not a database one)."""


def files(version: str, direction: Literal["up", "down"]) -> list[Path]:
    """The files to run for ``version`` in ``direction``, in execution order."""
    folder = sql_dir() / version
    if not folder.is_dir():
        raise SqlFilesError(f"no SQL folder for version {version!r}: {folder}")
    if direction == "up":
        found = sorted(p for p in folder.iterdir() if p.is_file() and _UP_FILE.match(p.name))
        if not found:
            raise SqlFilesError(f"no NN_*.sql files in {folder}")
        return found
    if direction == "down":
        down = folder / "down.sql"
        if not down.is_file():
            raise SqlFilesError(f"missing {down}")
        return [down]
    raise ValueError(f"direction must be 'up' or 'down', not {direction!r}")


def apply(op: Any, version: str, direction: Literal["up", "down"]) -> None:
    """Execute the SQL of ``version`` in ``direction`` through Alembic's ``op``.

    Online, each file is sent as one simple-protocol query with no parameters, so several statements per
    file work and ``%``, ``:name`` and ``::type`` reach the server untouched. Offline (``--sql``) the
    text is written verbatim to Alembic's output, ready for ``psql -v ON_ERROR_STOP=1 -f``.
    """
    context = op.get_context()
    for path in files(version, direction):
        text = path.read_text(encoding="utf-8")
        if context.as_sql:
            context.impl.static_output(f"-- lockstep {version} {direction}: {path.name}\n{text.rstrip()}")
        else:
            # no_parameters: SQLAlchemy calls cursor.execute(text) with no parameter argument at all;
            # psycopg then neither parses placeholders nor uses the extended protocol.
            op.get_bind().exec_driver_sql(text, execution_options={"no_parameters": True})
