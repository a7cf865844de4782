"""The SQL regression suite: each ``sql/*.sql`` runs in psql against a fresh database migrated to head,
and its output must equal ``expected/*.out``, as in PostgreSQL's own pg_regress.

psql runs with ``-X -a -q -v ON_ERROR_STOP=0``, ``VERBOSITY verbose`` (every error and warning shows its
SQLSTATE) and ``SHOW_CONTEXT never``. The only lines normalized are psql's ``LOCATION:`` lines, which name
PostgreSQL's own C source and change with its version. ``pytest --update-expected`` rewrites the expected
files: review the diff like code. Each file sets up its own small schema and selects only stable columns
(no timestamps, durations or oids).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from isolation import check_expected
from util import pg_binary

HERE = Path(__file__).resolve().parent
FILES = sorted((HERE / "sql").glob("*.sql"))


def psql() -> str:
    found = pg_binary("psql") or shutil.which("psql")
    if found is None:
        pytest.skip("psql not found (pg_config --bindir, PATH)")
    return str(found)


def run_file(dsn: str, path: Path) -> str:
    """psql's whole output (stdout and stderr interleaved, as pg_regress records it) for one file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(
        PGOPTIONS="-c client_min_messages=warning -c timezone=UTC -c datestyle=ISO,YMD -c lc_messages=C"
    )
    done = subprocess.run(
        [
            psql(),
            "-X",
            "-a",
            "-q",
            "-v",
            "ON_ERROR_STOP=0",
            "-v",
            "VERBOSITY=verbose",
            "-v",
            "SHOW_CONTEXT=never",
            "-d",
            dsn,
            "-f",
            path.name,
        ],
        cwd=path.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"psql exited {done.returncode}:\n{done.stdout}"
    return re.sub(r"(?m)^LOCATION:  .*\n", "", done.stdout)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_regress(path: Path, dsn: str, update_expected: bool):
    check_expected(HERE / "expected" / f"{path.stem}.out", run_file(dsn, path), update=update_expected)
