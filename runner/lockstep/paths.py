"""Where the packaged SQL and Alembic environment live.

Both are inside the package, ``lockstep/_sql`` and ``lockstep/_alembic``: copies in a wheel, symbolic links
to the top-level ``sql/`` and ``alembic/`` in a checkout (and so in an editable install), which is what
lets a host Alembic name ``lockstep:_alembic/versions`` in either. A checkout made without symbolic links
falls back to the top-level folders beside ``runner/``.
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
