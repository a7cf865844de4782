"""The style rules of sql/src that a reader relies on, checked on the text of every file.

- A function fits on one screen: at most 80 lines from ``create or replace function`` to its closing ``$$;``.
- Every function that takes locks names them in its header (``-- locks: ...``). A function takes locks if
  its code (with its string literals where it EXECUTEs them, messages of ``raise`` left out; lower-case, as
  the project writes SQL) locks rows or tables, writes a table, or runs DDL, other than on the session's own
  temporary tables, or if it calls a lockstep function that does.
- State passes through arguments and results: no ``lockstep.*`` session setting is read or written
  (``set_config('lockstep.``, ``current_setting('lockstep.``, ``set lockstep.``) outside the two helpers
  named in SETTING_HELPERS (01_schema.sql documents what they keep, and why).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "sql" / "src"
MAX_LINES = 80
# the only functions that may touch a lockstep.* session setting (01_schema.sql says which and why)
SETTING_HELPERS = {"lockstep._session_get", "lockstep._session_set"}

CREATE = re.compile(r"^create\s+(?:or\s+replace\s+)?function\s+([\w.]+)\s*\(", re.I)
DOLLAR = re.compile(r"\$([A-Za-z_]\w*)?\$")
SETTING = re.compile(
    r"(?:set_config|current_setting)\s*\(\s*'lockstep\.|\bset\s+(?:local\s+|session\s+)?lockstep\.|\bshow\s+lockstep\.",
    re.I,
)
LOCKS = re.compile(r"^--\s*locks\b", re.I)
# a write of the session's own temporary tables (pg_temp, temp table) locks nothing another session uses
TAKES_LOCKS = re.compile(
    r"\bfor\s+(?:no\s+key\s+)?update\b|\bfor\s+(?:key\s+)?share\b|\block\s+table\b|pg_(?:try_)?advisory_\w*lock"
    r"|\binsert\s+into\s+(?!pg_temp\.)|\bupdate\s+(?!pg_temp\.)[\w.%$]+(?:\s+(?:as\s+)?\w+)?\s+set\b"
    r"|\bdelete\s+from\s+(?!pg_temp\.)|\btruncate\s+(?!pg_temp\.)|\bmerge\s+into\b"
    r"|\b(?:create|drop|alter)\s+(?:or\s+replace\s+)?(?:table|function|trigger|index|type|policy|view)\s+"
    r"(?:if\s+(?:not\s+)?exists\s+)?(?!pg_temp\.)"
)
RAISE = re.compile(r"\braise\b[^;]*;")
LITERAL = re.compile(r"'(?:[^']|'')*'|\$(\w*)\$.*?\$\1\$", re.S)
EXECUTE = re.compile(r"\bexecute\b")
CALL = re.compile(r"lockstep\.(\w+)\s*\(")


@dataclass
class Function:
    file: str
    line: int  # 1-based line of `create ... function`
    name: str
    lines: list[str]  # from `create` to the closing `$$;`
    header: list[str]  # the comment lines right above `create`

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line} {self.name}"


def functions(path: Path) -> list[Function]:
    """Every top-level function of a file: its text from `create` to the line closing its body."""
    text = path.read_text().split("\n")
    found = []
    i = 0
    while i < len(text):
        m = CREATE.match(text[i])
        if not m:
            i += 1
            continue
        # the body opens at the first dollar quote and closes at the same tag; nested tags are other quotes
        start, tag, j, pos = i, None, i, 0
        while tag is None:
            d = DOLLAR.search(text[j], pos)
            if d:
                tag, pos = d.group(0), d.end()
            else:
                j, pos = j + 1, 0
        while text[j].find(tag, pos) < 0:
            j, pos = j + 1, 0
        header = []
        k = start - 1
        while k >= 0 and text[k].startswith("--"):
            header.insert(0, text[k])
            k -= 1
        found.append(Function(path.name, start + 1, m.group(1).lower(), text[start : j + 1], header))
        i = j + 1
    return found


def all_functions(src: Path = SRC) -> list[Function]:
    return [f for path in sorted(src.glob("*.sql")) for f in functions(path)]


def too_long(src: Path = SRC) -> list[str]:
    return [f"{f.where}: {len(f.lines)} lines" for f in all_functions(src) if len(f.lines) > MAX_LINES]


def code(f: Function) -> str:
    """The function's body (inside its dollar quotes), comments left out."""
    text = "\n".join(f.lines)
    tag = DOLLAR.search(text)
    body = text[tag.end() : text.rindex(tag.group(0))]
    return "\n".join(line.split("--", 1)[0] for line in body.split("\n"))


def run_text(f: Function) -> str:
    """What the function runs: its code, and its string literals too where it EXECUTEs them."""
    text = code(f)
    bare = LITERAL.sub("''", text)
    return text if EXECUTE.search(bare) else bare


def lock_takers(fns: list[Function]) -> set[str]:
    """Functions that lock something themselves, or call a lockstep function that does."""
    taking = {f.name for f in fns if TAKES_LOCKS.search(RAISE.sub("", run_text(f)))}
    calls = {f.name: {"lockstep." + c.lower() for c in CALL.findall(LITERAL.sub("''", code(f)))} for f in fns}
    grown = True
    while grown:
        more = {n for n, called in calls.items() if n not in taking and called & taking}
        taking |= more
        grown = bool(more)
    return taking


def without_locks(src: Path = SRC) -> list[str]:
    fns = all_functions(src)
    taking = lock_takers(fns)
    return [f.where for f in fns if f.name in taking and not any(LOCKS.match(h) for h in f.header)]


def setting_uses(src: Path = SRC) -> list[str]:
    uses = []
    for path in sorted(src.glob("*.sql")):
        text = path.read_text().split("\n")
        inside = {n: f for f in functions(path) for n in range(f.line, f.line + len(f.lines))}
        for n, line in enumerate(text, 1):
            code = line.split("--", 1)[0]
            if SETTING.search(code) and (n not in inside or inside[n].name not in SETTING_HELPERS):
                uses.append(f"{path.name}:{n} {line.strip()}")
    return uses


def test_the_parser_finds_every_function_and_only_top_level_ones():
    fns = all_functions()
    names = {f.name for f in fns}
    assert {
        "lockstep._write",
        "lockstep._gen_trigger",
        "lockstep.enqueue_trigger",
        "lockstep._finish",
    } <= names
    # the function _gen_trigger writes is text inside its body, not a function of sql/src
    assert not any("%" in n for n in names)
    assert all(f.lines[-1].rstrip().endswith(";") for f in fns)
    raw = "\n".join(p.read_text() for p in SRC.glob("*.sql"))
    every = re.findall(r"^create\s+or\s+replace\s+function\s+([\w.%$]+)", raw, re.I | re.M)
    assert len(fns) == len([n for n in every if "%" not in n]) > 100


def test_every_function_fits_on_one_screen():
    long = too_long()
    assert not long, (
        f"functions over {MAX_LINES} lines (split them along the steps their header names):\n"
        + "\n".join(long)
    )


def test_lock_takers_are_found_through_calls_and_dynamic_sql():
    taking = lock_takers(all_functions())
    assert {
        "lockstep._try_lock",
        "lockstep._write",
        "lockstep._finish",
        "lockstep._work",
        "lockstep.run",
    } <= taking
    assert "lockstep._pin_parents" in taking  # its FOR KEY SHARE is in a format() string
    assert not {"lockstep._cols", "lockstep._result", "lockstep._job"} & taking


def test_every_lock_taking_function_names_its_locks():
    missing = without_locks()
    assert not missing, "functions without a `-- locks:` line in their header:\n" + "\n".join(missing)


def test_no_session_setting_carries_state_outside_the_two_helpers():
    uses = setting_uses()
    assert not uses, (
        "lockstep.* session settings outside " + ", ".join(sorted(SETTING_HELPERS)) + ":\n" + "\n".join(uses)
    )


BODY = "create or replace function lockstep.f() returns void language plpgsql as $$\nbegin\n{}\nend $$;\n"


@pytest.mark.parametrize(
    ("sql", "check"),
    [
        ("-- locks: nothing.\n" + BODY.format("perform 1;\n" * MAX_LINES), too_long),
        (BODY.format("perform 1 from t for update;"), without_locks),
        (
            BODY.format("perform lockstep.g();")
            + "-- locks: t.\n"
            + BODY.replace(".f()", ".g()").format("delete from t;"),
            without_locks,
        ),
        (
            "-- locks: nothing.\n" + BODY.format("perform pg_catalog.set_config('lockstep.x', 'on', true);"),
            setting_uses,
        ),
        ("-- locks: nothing.\n" + BODY.format("v := current_setting( 'lockstep.x', true);"), setting_uses),
    ],
)
def test_the_checks_catch_what_they_name(tmp_path, sql, check):
    (tmp_path / "02_x.sql").write_text(sql)
    assert len(check(tmp_path)) == 1
    (tmp_path / "02_x.sql").write_text(
        BODY.format("raise exception 'x' using hint = 'FOR UPDATE, create table';")
    )
    assert check(tmp_path) == []
