"""Where the packaged SQL and Alembic environment live.

In a wheel they are shipped inside the package as ``lockstep/_sql`` and ``lockstep/_alembic``; in a checkout
(or an editable install) they are the top-level ``sql/`` and ``alembic/`` folders beside ``runner/``
(the package is ``runner/lockstep/``).
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _locate(packaged: str, checkout: str) -> Path:
    for candidate in (_PACKAGE / packaged, _PACKAGE.parent.parent / checkout):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"lockstep: neither {_PACKAGE / packaged} nor {_PACKAGE.parent.parent / checkout} exists; "
        "is the package installed correctly?"
    )


def sql_dir() -> Path:
    """The folder holding ``NNNN/`` SQL versions (and ``example/``)."""
    return _locate("_sql", "sql")


def alembic_dir() -> Path:
    """The Alembic script location; its ``versions/`` folder holds the lockstep revisions."""
    return _locate("_alembic", "alembic")
