"""README.md's code blocks run (doctest-style), and the README keeps its shape.

- The quickstart runs word for word, in order, from the wheel installed in a fresh venv (conftest
  ``installed_wheel``), in a scratch database: the "Install" section's ```sh block that creates the
  database and runs ``lockstep migrate``, then the first ```sql block through ``psql -v ON_ERROR_STOP=1``,
  then "The runner" section's ```sh block. The database name is the only substitution (so runs can
  overlap), and the results the SQL comments claim are checked in the output.
- Every fenced ```sql block is executed, in file order, in one fresh database with lockstep installed
  (the editable package), each block as one simple-query batch, autocommit.
  A later block sees what earlier blocks did. All failures are reported together, with line numbers.
- Every ```sh block line that starts with ``lockstep `` or ``make `` is checked, never executed:
  ``lockstep SUB ARGS`` is parsed by the real click command (options, types, choices) and
  ``lockstep SUB --help`` must exit 0; ``make TARGET VAR=...`` must pass ``make -n`` (dry run).
- Skip a block by putting this on the line right before its fence (a reason is required):
      <!-- readme-test: skip (why it cannot run) -->
- The shape a reader decides from: at most 250 lines, the first SQL example before line 60 and 15 to 20
  lines long, the two commands ``make demo`` and ``make test`` (the one ``.ci/run`` calls).
- Links and anchors: tests/docs/test_docs.py.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import psycopg
import pytest
from conftest import RUN_TAG, drop_database
from psycopg.conninfo import conninfo_to_dict

ROOT = Path(__file__).resolve().parents[2]
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


def test_readme_sql_blocks_run(dsn):
    blocks = [b for b in BLOCKS if b.lang == "sql"]
    failures: list[str] = []
    ran = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
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
    from lockstep.cli import main

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
        [sys.executable, "-m", "lockstep", sub, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
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


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _first(blocks: list[Block], lang: str, contains: str = "") -> Block:
    return next(b for b in blocks if b.lang == lang and b.skip is None and contains in b.text)


def quickstart_script(dbname: str) -> str:
    """What a newcomer runs, as one bash script: the database and schema (Install), the first SQL example
    through psql, then the runner once, the health check and the clean-up (The runner)."""
    install = _first(parse(_section("Install")), "sh", "lockstep migrate")
    example = _first(BLOCKS, "sql")
    runner = _first(parse(_section("The runner")), "sh", "lockstep run")
    parts = [
        "set -e",
        install.text,
        f"psql -X -v ON_ERROR_STOP=1 <<'README_SQL'\n{example.text}\nREADME_SQL",
        runner.text,
    ]
    script = "\n".join(parts)
    assert script.count("lockstep_try") == 1, "the database name must be given once (export PGDATABASE)"
    return script.replace("lockstep_try", dbname)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_readme_quickstart_runs_word_for_word_from_the_wheel(installed_wheel, admin_dsn, tmp_path):
    bin_dir, _ = installed_wheel
    dbname = f"{RUN_TAG}_readme"
    info = conninfo_to_dict(admin_dsn)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PG", "LOCKSTEP_")) and k not in ("DATABASE_URL", "VIRTUAL_ENV", "PYTHONPATH")
    }
    env.update(
        PATH=f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin",
        PGHOST=info.get("host", ""),
        PGPORT=str(info.get("port", 5432)),
        PGUSER=info.get("user", ""),
    )
    try:
        p = subprocess.run(
            ["bash", "-c", quickstart_script(dbname)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        drop_database(dbname)
    out, err = p.stdout, p.stderr
    assert p.returncode == 0, out + err
    assert "WARNING" not in err, err  # the example as written draws no warning
    # what the README's comments claim, in the order it claims it
    claims = [
        (r"^\s*done\s*\|\s*2\s*\|\s*0\s*$", "done 2 0: the first run recomputes all"),
        (r"^UPDATE 1$", "the update of order 2's line"),
        (r"^\s*done\s*\|\s*0\s*\|\s*1\s*$", "done 0 1: a worker pass"),
        (r"^\s*1\s*\|\s*2\s*\|\s*20\.00\s*$", "(1, 2, 20.00)"),
        (r"^\s*2\s*\|\s*1\s*\|\s*10\s*$", "(2, 1, 10)"),
        (r"^\s*order_totals\s*\|\s*0\s*\|\s*done\s*$", "order_totals 0 done"),
    ]
    pos = 0
    for pattern, claim in claims:
        m = re.compile(pattern, re.MULTILINE).search(out, pos)
        assert m, f"README claims {claim!r}; not found after offset {pos} in:\n{out[pos:]}"
        pos = m.end()
    status_rows = [ln.split() for ln in out[pos:].splitlines() if ln.startswith("order_totals ")]
    assert [(r[0], r[2], r[3], r[4], r[5], r[6]) for r in status_rows] == [
        ("order_totals", "0", "-", "0", "0", "done"),
    ], out  # lockstep status: queue drained (no lag), nothing parked or failing
    with psycopg.connect(admin_dsn) as c:  # the README's dropdb ran
        assert c.execute("select count(*) from pg_database where datname = %s", [dbname]).fetchone()[0] == 0


def test_readme_is_short_and_shows_sql_early():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines"
    first_sql = _first(BLOCKS, "sql")
    assert first_sql.line < 60, f"the first SQL example starts at line {first_sql.line}"
    assert 15 <= len(first_sql.text.splitlines()) <= 20, len(first_sql.text.splitlines())
    for call in ("lockstep.define_derived(", "lockstep.watch(", "lockstep.run(", "lockstep.status"):
        assert call in first_sql.text, f"the first SQL example shows {call}"


def test_readme_names_the_two_commands_and_ci_calls_make_test():
    commands = [argv for b in BLOCKS if b.lang == "sh" for _, argv in _commands(b)]
    assert ["make", "demo"] in commands and ["make", "test"] in commands
    assert re.search(r"^make test\b", (ROOT / ".ci" / "run").read_text(), re.MULTILINE), (
        ".ci/run calls make test"
    )
    assert "make test" in _section("The two commands") and ".ci/run" in _section("The two commands")
