"""The lockstep schema as ``pg_dump`` sees it, to compare two installs (tests/sql/test_revisions.py).

The dump is ``pg_dump --schema-only --schema=lockstep --no-owner`` of a database, normalized so that it
depends only on the SQL that built it:

- none of pg_dump's comment lines (its version banner, its per-object ``Name: ...; Owner: ...`` headers;
  comments inside function bodies stay);
- no pg_dump session settings (``SET x = ...;``, ``set_config``) and no ``\\restrict`` /
  ``\\unrestrict`` lines (random per dump);
- no owner lines (``--no-owner``), so the dump does not depend on who ran the migration;
- one blank line between statements, a trailing newline.

pg_dump orders objects by kind, then name, after dependencies: the order is stable for the same schema.
``pg_dump`` is found with ``pg_config --bindir`` (or env LOCKSTEP_PG_BIN), else on PATH; it must be at least
the server's major version.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

HEADER = "-- lockstep schema (pg_dump, normalized)\n"

# what pg_dump adds around the objects (not function bodies: their own comments are kept)
_PG_DUMP_LINE = re.compile(
    r"^(--|-- Name: .*; Type: .*|-- PostgreSQL database dump( complete)?"
    r"|-- Dumped (from database|by pg_dump) version .*|\\(un)?restrict .*)$"
)
_PREAMBLE_LINE = re.compile(r"^SELECT pg_catalog\.set_config\(.*\);$")
_SET_LINE = re.compile(r"^SET \w+ = .*;$")  # pg_dump's session settings (ours are lower case)


def pg_dump_path() -> str | None:
    """pg_dump of ``pg_config --bindir`` (or LOCKSTEP_PG_BIN), else the one on PATH."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from util import pg_binary

    found = pg_binary("pg_dump")
    return str(found) if found is not None else shutil.which("pg_dump")


def normalize(dump: str) -> str:
    """Drop pg_dump's comments, the session preamble and random lines; collapse blank lines."""
    lines: list[str] = []
    in_preamble = True
    for ln in dump.splitlines():
        ln = ln.rstrip()
        if in_preamble and ln.startswith("CREATE "):
            in_preamble = False
        if _PG_DUMP_LINE.match(ln) or _SET_LINE.match(ln) or (in_preamble and _PREAMBLE_LINE.match(ln)):
            continue
        lines.append(ln)
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")
    return HEADER + "\n" + text + "\n"


def dump(dsn: str, pg_dump: str | None = None) -> str:
    """The normalized schema-only dump of schema lockstep in database ``dsn``."""
    pg_dump = pg_dump or pg_dump_path()
    if pg_dump is None:
        raise RuntimeError("pg_dump not found (pg_config --bindir, LOCKSTEP_PG_BIN or PATH)")
    out = subprocess.run(
        [pg_dump, "--schema-only", "--schema=lockstep", "--no-owner", "--dbname", dsn],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"pg_dump failed ({out.returncode}): {out.stderr.strip()}")
    return normalize(out.stdout)
