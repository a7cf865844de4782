"""README.md's code blocks run (doctest-style).

- Every fenced ```sql block is executed, in file order, in one fresh database made from the example
  template (lockstep + example app + job exam_keys), each block as one simple-query batch, autocommit.
  A later block sees what earlier blocks did. All failures are reported together, with line numbers.
- Every ```sh block line that starts with ``lockstep `` or ``make `` is checked, never executed:
  ``lockstep SUB ARGS`` is parsed by the real click command (options, types, choices) and
  ``lockstep SUB --help`` must exit 0; ``make TARGET VAR=...`` must pass ``make -n`` (dry run).
- Skip a block by putting this on the line right before its fence (a reason is required):
      <!-- readme-test: skip (why it cannot run) -->
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import psycopg
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
SKIP = re.compile(r"^\s*<!--\s*readme-test:\s*skip\s*(?:\((?P<reason>.*)\))?\s*-->\s*$")
SHELL_STOP = {"|", "||", "&&", ";", "&"}


@dataclass
class Block:
    lang: str
    line: int  # 1-based line number of the opening fence
    text: str
    skip: str | None  # the skip reason, if marked


def parse(text: str) -> list[Block]:
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(2), m.group(3).lower()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1  # closing fence
        skip = None
        if start > 0:
            s = SKIP.match(lines[start - 1])
            if s:
                skip = (s.group("reason") or "").strip()
                if not skip:
                    raise AssertionError(f"README.md:{start}: readme-test skip marker without a (reason)")
        blocks.append(Block(lang, start + 1, "\n".join(body), skip))
    return blocks


BLOCKS = parse(README.read_text())


def _commands(block: Block) -> list[tuple[int, list[str]]]:
    """(line number, argv) of each ``lockstep ...`` / ``make ...`` command of an sh block."""
    out: list[tuple[int, list[str]]] = []
    pending, first = "", 0
    for n, raw in enumerate(block.text.splitlines(), start=block.line + 1):
        if not pending:
            first = n
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line, pending = (pending + raw).strip(), ""
        if not (line.startswith("lockstep ") or line.startswith("make ") or line in ("lockstep", "make")):
            continue
        lex = shlex.shlex(line, posix=True, punctuation_chars="|&;<>")
        lex.whitespace_split = True
        lex.commenters = "#"
        argv: list[str] = []
        for tok in lex:
            if tok in SHELL_STOP or set(tok) <= set("<>") or tok.endswith(">"):
                break
            argv.append(tok)
        # "2>" style redirections leave a trailing fd number
        out.append((first, argv))
    return out


def test_readme_has_blocks():
    langs = {b.lang for b in BLOCKS}
    assert "sql" in langs and "sh" in langs


def _failed_results(cur: psycopg.Cursor) -> list[str]:
    """A statement of the block returned a lockstep.result with outcome 'failed' (it did not raise)."""
    out: list[str] = []
    while True:
        cols = [c.name for c in cur.description or []]
        if "outcome" in cols:
            i = cols.index("outcome")
            for row in cur.fetchall():
                if row[i] == "failed":
                    out.append(f"a statement returned outcome 'failed': {row}")
        if not cur.nextset():
            return out


def test_readme_sql_blocks_run(example_dsn):
    blocks = [b for b in BLOCKS if b.lang == "sql"]
    failures: list[str] = []
    ran = 0
    with psycopg.connect(example_dsn, autocommit=True) as conn:
        for b in blocks:
            if b.skip is not None:
                continue
            ran += 1
            try:
                cur = conn.execute(b.text)  # no parameters: simple query protocol, several statements
            except psycopg.Error as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                failures.append(f"README.md:{b.line}: ```sql block failed: [{exc.sqlstate}] {first}")
                continue
            failures += [f"README.md:{b.line}: ```sql block: {why}" for why in _failed_results(cur)]
    assert ran > 0
    assert not failures, "\n".join(failures)


def _check_lockstep(argv: list[str]) -> str | None:
    from runner.cli import main

    if len(argv) < 2 or argv[1].startswith("-"):
        args = argv[1:]
        try:
            main.make_context("lockstep", list(args), resilient_parsing=False)
        except click.exceptions.Exit:
            pass
        except click.ClickException as exc:
            return exc.format_message()
        return None
    sub = argv[1]
    cmd = main.commands.get(sub)
    if cmd is None:
        return f"no subcommand {sub!r} (have: {', '.join(sorted(main.commands))})"
    try:
        cmd.make_context(f"lockstep {sub}", list(argv[2:]), resilient_parsing=False)
    except click.exceptions.Exit:
        pass
    except click.ClickException as exc:
        return exc.format_message()
    proc = subprocess.run(
        [sys.executable, "-m", "runner", sub, "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    if proc.returncode != 0:
        return f"lockstep {sub} --help exited {proc.returncode}: {proc.stderr.strip()[-300:]}"
    return None


def _check_make(argv: list[str]) -> str | None:
    proc = subprocess.run(["make", "-n", *argv[1:]], capture_output=True, text=True, timeout=60, cwd=ROOT)
    if proc.returncode != 0:
        return f"make -n exited {proc.returncode}: {proc.stderr.strip()[-300:]}"
    return None


def test_readme_sh_commands_parse():
    failures: list[str] = []
    checked = 0
    for b in BLOCKS:
        if b.lang not in ("sh", "bash", "shell", "console") or b.skip is not None:
            continue
        for line, argv in _commands(b):
            checked += 1
            why = _check_lockstep(argv) if argv[0] == "lockstep" else _check_make(argv)
            if why:
                failures.append(f"README.md:{line}: {shlex.join(argv)}: {why}")
    assert checked > 0
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a\n```sql\nselect 1;\n```\n", [("sql", 2, "select 1;", None)]),
        (
            "<!-- readme-test: skip (needs a cluster) -->\n```sql\nx\n```",
            [("sql", 2, "x", "needs a cluster")],
        ),
        (
            "```sh\nlockstep run --once\n```\n```ini\nk = v\n```",
            [("sh", 1, "lockstep run --once", None), ("ini", 4, "k = v", None)],
        ),
    ],
)
def test_parse(text, expected):
    assert [(b.lang, b.line, b.text, b.skip) for b in parse(text)] == expected


def test_commands_split():
    b = Block(
        "sh",
        10,
        'lockstep migrate --sql > lockstep.sql\nmake test PYTEST_ARGS="-k m -x"  # c\n'
        "pip install x\nlockstep run \\\n  --once",
        None,
    )
    assert _commands(b) == [
        (11, ["lockstep", "migrate", "--sql"]),
        (12, ["make", "test", "PYTEST_ARGS=-k m -x"]),
        (14, ["lockstep", "run", "--once"]),
    ]
