"""README.md and docs/*.md, read as a newcomer reads them.

- Every relative link and image resolves to a file inside the repository, and every anchor (``page.md#x``
  or ``#x``) to a heading of that page, slugged as GitHub does.
- Every sentence of prose (code blocks, tables and HTML comments aside) has fewer than 40 words.
- Every docs page starts with its title, then a two-line summary of what it is for.
- No page tells the project's history: no session or issue numbers, no "found by" stories.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prose import MAX_WORDS, ROOT, pages, sentences, words

PAGES = pages()
IDS = [p.relative_to(ROOT).as_posix() for p in PAGES]
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HISTORY = re.compile(
    r"\bsession \d+|\bissue \d+|\bsession's end\b|\bfound by (a|an)\b|\((a|found by[ ]a) (probe|review)\b",
    re.IGNORECASE,
)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    for n, line in enumerate(text.splitlines(), start=1):
        m = FENCE.match(line)
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        out.append((n, re.sub(r"`[^`]*`", "``", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown page, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fence: str | None = None
    for line in path.read_text().splitlines():
        m = FENCE.match(line)
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        h = HEADING.match(line)
        if h:
            base = slug(h.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def link_problems(path: Path) -> list[str]:
    bad: list[str] = []
    for n, line in prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            where = f"{path.relative_to(ROOT)}:{n}: {target}"
            if not dest.is_relative_to(ROOT):
                bad.append(f"{where}: outside the repository")
            elif not dest.exists():
                bad.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
            elif anchor and dest.suffix != ".md":
                bad.append(f"{where}: an anchor into a file that is not Markdown")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_relative_link_and_anchor_resolves(page):
    assert not link_problems(page)


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_sentence_is_short(page):
    long = [
        f"{page.relative_to(ROOT)}:{n}: {words(s)} words: {s[:120]}"
        for n, s in sentences(page.read_text())
        if words(s) > MAX_WORDS
    ]
    assert not long, "\n".join(long)


@pytest.mark.parametrize("page", [p for p in PAGES if p.parent.name == "docs"], ids=lambda p: p.name)
def test_a_docs_page_starts_with_its_title_and_a_two_line_summary(page):
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# "), "the first line is the page's title"
    assert lines[1] == "", "a blank line after the title"
    summary = lines[2:4]
    assert all(s.strip() and not s.startswith(("#", "-", "*", "|", "```", "<")) for s in summary), summary
    assert len(lines) == 4 or lines[4] == "", "the summary is two lines, then a blank line"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_no_page_tells_the_projects_history(page):
    hits = [f"{page.relative_to(ROOT)}:{n}: {line.strip()}" for n, line in prose_lines(page.read_text())]
    hits = [h for h in hits if HISTORY.search(h)]
    assert not hits, "\n".join(hits)


def test_the_rules_live_in_design_md_only():
    """The nine rules have one home: other pages link to it instead of restating them."""
    marker = re.compile(r"^#+ .*\brules\b", re.IGNORECASE)
    homes = [p.name for p in PAGES if any(marker.match(line) for line in p.read_text().splitlines())]
    assert homes == ["design.md"], homes


# the checkers themselves, on small inputs


def test_slug_follows_github():
    assert slug("(b) From your application's own Alembic") == "b-from-your-applications-own-alembic"
    assert slug("`lockstep run` in production") == "lockstep-run-in-production"
    assert slug("Failures, backoff and retries") == "failures-backoff-and-retries"
    assert slug("define_derived") == "define_derived"


def test_link_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path, monkeypatch):
    docs = ROOT / "docs"
    page = docs / "x_link_checker_probe.md"
    page.write_text("# T\n\n[a](design.md#no-such-heading) [b](nope.md) [c](#t) [d](design.md#the-rules)\n")
    try:
        bad = link_problems(page)
    finally:
        page.unlink()
    assert len(bad) == 2 and "no heading #no-such-heading" in bad[0] and "no such file" in bad[1], bad


def test_sentences_split_and_count():
    text = (
        "# Title\n\nOne short sentence. Another one, e.g. this.\n\n```\nnot. prose. at all.\n```\n| a. b |\n"
    )
    assert [s for _, s in sentences(text)] == ["Title", "One short sentence.", "Another one, e.g. this."]
    assert words("A `code span` counts, and 3 numbers - dashes do not.") == 10


def test_every_chart_is_shown_with_the_command_that_drew_it():
    """docs/img holds the charts of `lockstep bench --plot`: each is a PNG, shown in benchmarks.md with its
    command written under it; the README shows the headline one."""
    page = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    charts = sorted((ROOT / "docs" / "img").glob("*.png"))
    assert {c.name for c in charts} >= {"locks.png", "oltp_tps.png", "queue_age.png"}
    for chart in charts:
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", chart.name
        shown = [i for i, line in enumerate(page) if f"](img/{chart.name})" in line]
        assert shown, f"{chart.name} is not shown in docs/benchmarks.md"
        under = " ".join(page[shown[0] + 1 : shown[0] + 4])
        assert "Command:" in under, f"no command under {chart.name}"
    assert "lockstep bench" in page[[i for i, ln in enumerate(page) if "](img/locks.png)" in ln][0] + 2]
    assert "](docs/img/locks.png)" in (ROOT / "README.md").read_text()
