"""The contract of every public and every lock-taking function is stored as ``comment on function``."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "sql" / "src"
START = re.compile(r"^create or replace function lockstep\.(\w+)\(", re.M)


def lock_taking() -> set[str]:
    """Names of the functions in sql/src whose header has a ``-- locks:`` line that is not "nothing"."""
    names: set[str] = set()
    for path in sorted(SRC.glob("*.sql")):
        lines = path.read_text().split("\n")
        for i, line in enumerate(lines):
            m = START.match(line)
            if not m:
                continue
            header = []
            j = i - 1
            while j >= 0 and lines[j].startswith("--"):
                header.append(lines[j])
                j -= 1
            locks = [h for h in header if h.startswith("-- locks:")]
            if locks and not locks[0].startswith("-- locks: nothing"):
                names.add(m.group(1))
    return names


def test_public_and_lock_taking_functions_carry_their_contract(conn):
    rows = conn.execute(
        "select p.proname, p.oid::regprocedure::text, obj_description(p.oid, 'pg_proc')"
        " from pg_proc p where p.pronamespace = 'lockstep'::regnamespace"
        " and p.proname not like 'enqueue\\_w\\_%'"
    ).fetchall()
    wanted = lock_taking()
    assert wanted, "no lock-taking function found in sql/src: the header convention changed?"
    missing = sorted(
        sig for name, sig, text in rows if (not name.startswith("_") or name in wanted) and not text
    )
    assert missing == [], f"functions without comment on function: {missing}"
    locks = sorted(sig for name, sig, text in rows if name in wanted and "locks:" not in (text or "").lower())
    assert locks == [], f"lock-taking functions whose comment names no locks: {locks}"


def test_the_project_speaks_of_itself_only():
    """No session or issue numbers and no provenance notes ("found by" stories) in any file but
    the frozen first release (its files must stay as tagged) and the changelog: the history is in git."""
    root = SRC.parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    pattern = "|".join(
        [
            "session [0-9]+",
            "issue [0-9]+",
            "found by (a|an|the|this)\\b",
            "found by$",  # the story goes on at the next line
            "\\ba (probe|review)[:)]",
            "(newcomer|fault) probe",
            "a review[ ]found",
            "this session's[ ]commit",
        ]
    )
    done = subprocess.run(
        ["git", "grep", "-niE", pattern, "--", ".", ":!sql/0001", ":!CHANGELOG.md"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert done.returncode in (0, 1), done.stderr
    assert done.stdout == "", f"history belongs in git, not in the files:\n{done.stdout}"
