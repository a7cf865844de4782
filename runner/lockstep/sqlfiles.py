"""The SQL an Alembic revision runs, and the current source a fresh install runs.

Layout (docs/design.md, "Where the SQL lives"):

- ``sql/src/01_schema.sql``: the state (schema, types, tables, indexes). ``sql/src/NN_*.sql`` (02 on): the
  code (functions, views, policies, comments), every statement replaceable. A fresh install runs them all.
- ``sql/0001/``: the first release, frozen: ``NN_*.sql`` up, ``down.sql`` down.
- ``sql/NNNN/`` (0002 on): ``up.sql`` (the state's change from the previous revision), then the revision's
  code, then ``up_after.sql`` if present; down: ``down.sql``, the previous revision's code,
  ``down_after.sql`` if present. A revision's code is ``sql/NNNN/code/`` once frozen at its release, and
  ``sql/src`` while it is the newest revision.

Files are sent verbatim, never through a parameter or bind-parameter parser.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from lockstep.paths import sql_dir

_UP_FILE = re.compile(r"^\d{2}_[A-Za-z0-9_.-]*\.sql$")
_REVISION = re.compile(r"^\d{4}$")
_DOLLAR = re.compile(r"\$([A-Za-z_][A-Za-z_0-9]*)?\$")
STATE_FILE = "01_schema.sql"

Script = tuple[str, str]  # (name shown in --sql output, text)


class SqlFilesError(RuntimeError):
    """The SQL files of a version are missing or malformed (a packaging error, not a database one)."""


def revisions() -> list[str]:
    """Every revision folder ``NNNN`` under sql/, oldest first."""
    return sorted(p.name for p in sql_dir().iterdir() if p.is_dir() and _REVISION.match(p.name))


def _numbered(folder: Path) -> list[Path]:
    found = sorted(p for p in folder.iterdir() if p.is_file() and _UP_FILE.match(p.name))
    if not found:
        raise SqlFilesError(f"no NN_*.sql files in {folder}")
    return found


def source_files() -> list[Path]:
    """The current source, in install order: the state file, then the code files."""
    return _numbered(sql_dir() / "src")


def code_files(version: str) -> list[Path]:
    """The code a delta revision installs: frozen ``sql/NNNN/code/``, or ``sql/src`` for the newest."""
    frozen = sql_dir() / version / "code"
    if frozen.is_dir():
        return _numbered(frozen)
    if revisions()[-1] != version:
        raise SqlFilesError(f"revision {version} is not the newest, and its code was not frozen in {frozen}")
    return [p for p in source_files() if p.name != STATE_FILE]


def _is_delta(version: str) -> bool:
    return (sql_dir() / version / "up.sql").is_file()


def files(version: str, direction: Literal["up", "down"]) -> list[Path]:
    """The files of a first-release revision (``NN_*.sql`` up, ``down.sql``), in execution order."""
    folder = sql_dir() / version
    if not folder.is_dir():
        raise SqlFilesError(f"no SQL folder for version {version!r}: {folder}")
    if direction == "up":
        return _numbered(folder)
    if direction == "down":
        down = folder / "down.sql"
        if not down.is_file():
            raise SqlFilesError(f"missing {down}")
        return [down]
    raise ValueError(f"direction must be 'up' or 'down', not {direction!r}")


def split_statements(text: str) -> list[str]:
    """A script cut into statements, each with the comment lines before it; joined, they give ``text``.

    Knows '...' strings, "..." identifiers, -- and /* */ comments and $tag$ quotes.
    """
    out: list[str] = []
    start = i = 0
    n = len(text)
    while i < n:
        c = text[i]
        if text.startswith("--", i):
            j = text.find("\n", i)
            i = n if j < 0 else j + 1
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
        elif c in "'\"":
            j = i + 1
            while (j := text.find(c, j)) >= 0 and text.startswith(c + c, j):
                j += 2
            i = n if j < 0 else j + 1
        elif (
            c == "$"
            and (m := _DOLLAR.match(text, i))
            and not (i and (text[i - 1].isalnum() or text[i - 1] == "_"))
        ):
            j = text.find(m.group(0), m.end())
            i = n if j < 0 else j + len(m.group(0))
        elif c == ";":
            i += 1
            j = text.find("\n", i)
            if j >= 0 and not text[i:j].strip():
                i = j + 1
            out.append(text[start:i])
            start = i
        else:
            i += 1
    if text[start:].strip():
        out.append(text[start:])
    return out


def _replaceable(statement: str) -> str | None:
    """A first-release statement as it is run again over a later revision's schema: functions and views
    replaced, policies dropped and created; the state (tables, indexes, rows) skipped."""
    body = re.sub(r"(?m)^\s*--.*\n?", "", statement).lstrip()
    if body.startswith("create function ") or body.startswith("create view "):
        return re.sub(r"(?m)^create (function|view) ", r"create or replace \1 ", statement, count=1)
    if m := re.match(r"create policy (\w+) on (lockstep\.\w+)", body):
        return f"drop policy if exists {m.group(1)} on {m.group(2)};\n{statement}"
    return None


def code_scripts(version: str) -> list[Script]:
    """What re-installs ``version``'s code over a later schema (a downgrade to it)."""
    if _is_delta(version):
        return [(f"{version}/code/{p.name}", p.read_text(encoding="utf-8")) for p in code_files(version)]
    scripts = []
    for path in files(version, "up")[1:]:  # the first file is the state
        kept = [s for s in map(_replaceable, split_statements(path.read_text(encoding="utf-8"))) if s]
        if kept:
            scripts.append((f"{version}/{path.name} (code)", "".join(kept)))
    return scripts


def scripts(version: str, direction: Literal["up", "down"]) -> list[Script]:
    """Every script revision ``version`` runs in ``direction``, in order."""
    if not _is_delta(version):
        return [(f"{version}/{p.name}", p.read_text(encoding="utf-8")) for p in files(version, direction)]
    folder = sql_dir() / version

    def own(name: str) -> list[Script]:
        path = folder / name
        return [(f"{version}/{name}", path.read_text(encoding="utf-8"))] if path.is_file() else []

    if direction == "up":
        code = [(f"src/{p.name}", p.read_text(encoding="utf-8")) for p in code_files(version)]
        return own("up.sql") + code + own("up_after.sql")
    previous = revisions()[revisions().index(version) - 1]
    if not (folder / "down.sql").is_file():
        raise SqlFilesError(f"missing {folder / 'down.sql'}")
    return own("down.sql") + code_scripts(previous) + own("down_after.sql")


def current_scripts() -> list[Script]:
    """A fresh install of the current source (what upgrading through every revision must equal)."""
    return [(f"src/{p.name}", p.read_text(encoding="utf-8")) for p in source_files()]


def schema_revision(op: Any) -> str | None:
    """The revision the installed schema says it is at (its comment's "(revision NNNN)"); None offline."""
    if op.get_context().as_sql:
        return None
    comment = (
        op.get_bind()
        .exec_driver_sql(
            "select pg_catalog.obj_description(pg_catalog.to_regnamespace('lockstep'), 'pg_namespace')"
        )
        .scalar()
    )
    found = re.search(r"\(revision (\d{4})\)$", comment or "")
    return found.group(1) if found else None


def apply(op: Any, version: str, direction: Literal["up", "down"]) -> None:
    """Execute revision ``version``'s SQL in ``direction`` through Alembic's ``op``.

    Online, each script is one simple-protocol query with no parameters, so several statements per script
    work and ``%``, ``:name`` and ``::type`` reach the server untouched. Offline (``--sql``) the text is
    written verbatim to Alembic's output, ready for ``psql -v ON_ERROR_STOP=1 -f``.
    """
    context = op.get_context()
    for name, text in scripts(version, direction):
        if context.as_sql:
            context.impl.static_output(f"-- lockstep {version} {direction}: {name}\n{text.rstrip()}")
        else:
            # no_parameters: SQLAlchemy calls cursor.execute(text) with no parameter argument at all;
            # psycopg then neither parses placeholders nor uses the extended protocol.
            op.get_bind().exec_driver_sql(text, execution_options={"no_parameters": True})
