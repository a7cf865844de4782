"""A released revision never changes: for every git tag ``v*``, each file under ``sql/NNNN/`` and
``alembic/versions/`` that existed at that tag is byte-identical in the working tree now, but for the one
line of a revision file that imports ``sqlfiles`` (the import package was renamed ``runner`` -> ``lockstep``,
so that it cannot collide with a host application's ``runner``; what the revision runs is unchanged).

Skips cleanly without git, outside a git work tree, or before the first tag. The checker itself is tested
on a throw-away repository, so the rule is known to fail when a released file is edited or removed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RELEASED = re.compile(r"^(sql/\d{4}/|alembic/versions/)")
_IMPORT = re.compile(rb"(?m)^from (runner|lockstep) import sqlfiles$")


def _same(path: str, then: bytes, now: bytes) -> bool:
    if path.startswith("alembic/versions/"):
        return _IMPORT.sub(b"from lockstep import sqlfiles", then) == _IMPORT.sub(
            b"from lockstep import sqlfiles", now
        )
    return then == now


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=False)


def release_tags(repo: Path) -> list[str]:
    out = _git(repo, "tag", "--list", "v*")
    return out.stdout.decode().split() if out.returncode == 0 else []


def changed_released_files(repo: Path, tag: str) -> list[str]:
    """Files of revisions released at ``tag`` that differ from (or are missing in) the working tree."""
    listed = _git(repo, "ls-tree", "-r", "--name-only", tag, "--", "sql", "alembic/versions")
    assert listed.returncode == 0, listed.stderr.decode()
    changed = []
    for path in listed.stdout.decode().splitlines():
        if not RELEASED.match(path):
            continue
        then = _git(repo, "show", f"{tag}:{path}")
        assert then.returncode == 0, then.stderr.decode()
        now = repo / path
        if not now.is_file():
            changed.append(f"{path} (removed)")
        elif not _same(path, then.stdout, now.read_bytes()):
            changed.append(path)
    return changed


def _in_git_work_tree(repo: Path) -> bool:
    if shutil.which("git") is None:
        return False
    out = _git(repo, "rev-parse", "--is-inside-work-tree")
    return out.returncode == 0 and out.stdout.strip() == b"true"


def test_released_revision_files_are_unchanged() -> None:
    if not _in_git_work_tree(ROOT):
        pytest.skip("not a git work tree (or no git): nothing to compare with")
    tags = release_tags(ROOT)
    if not tags:
        pytest.skip("no release tag v* yet")
    problems = {tag: changed for tag in tags if (changed := changed_released_files(ROOT, tag))}
    assert problems == {}, (
        "released revision files changed (add a new revision sql/NNNN + alembic/versions instead): "
        f"{problems}"
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_checker_finds_an_edited_or_removed_released_file(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "sql" / "0001").mkdir(parents=True)
    (repo / "alembic" / "versions").mkdir(parents=True)
    (repo / "sql" / "0001" / "01_schema.sql").write_text("create schema lockstep;\n")
    (repo / "alembic" / "versions" / "0001_core.py").write_text("revision = '0001'\n")
    (repo / "sql" / "schema.sql").write_text("-- generated\n")  # not a revision file: may change
    for cmd in (
        ["init", "-q"],
        ["add", "-A"],
        ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "release"],
        ["tag", "v0.1.0"],
    ):
        assert _git(repo, *cmd).returncode == 0, cmd
    assert release_tags(repo) == ["v0.1.0"]
    assert changed_released_files(repo, "v0.1.0") == []
    (repo / "sql" / "schema.sql").write_text("-- regenerated\n")
    (repo / "sql" / "0002").mkdir()
    (repo / "sql" / "0002" / "01_more.sql").write_text("-- a new revision: fine\n")
    assert changed_released_files(repo, "v0.1.0") == []
    (repo / "sql" / "0001" / "01_schema.sql").write_text("create schema lockstep; -- edited\n")
    (repo / "alembic" / "versions" / "0001_core.py").unlink()
    assert changed_released_files(repo, "v0.1.0") == [
        "alembic/versions/0001_core.py (removed)",
        "sql/0001/01_schema.sql",
    ]
