"""Prose of the Markdown pages for the docs tests: sentences outside code blocks, tables, HTML comments."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
# a sentence ends at . ! or ? followed by a space and a capital, a backquote, a digit or an opening mark,
# or at the end of its paragraph or list item
END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9`*(\"'\[])")
ABBREV = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "approx.")
MAX_WORDS = 39


def pages() -> list[Path]:
    """README.md and every docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each paragraph, list item and heading, code blocks, tables and HTML
    comments left out."""
    out: list[tuple[int, str]] = []
    cur: list[str] = []
    start = 0
    fence: str | None = None

    def flush() -> None:
        nonlocal cur
        if cur:
            out.append((start, " ".join(s.strip() for s in cur)))
        cur = []

    for n, line in enumerate(text.splitlines(), start=1):
        m = FENCE.match(line)
        if fence is not None:
            if m and m.group(1).startswith(fence[0]) and len(m.group(1)) >= len(fence):
                fence = None
            continue
        if m:
            flush()
            fence = m.group(1)
            continue
        s = line.strip()
        if not s or s.startswith("|") or s.startswith("<!--"):
            flush()
            continue
        if s.startswith("#") or re.match(r"^([-*+]|\d+\.)\s", s):
            flush()
            start = n
            cur = [re.sub(r"^(#+|[-*+]|\d+\.)\s+", "", s)]
            if s.startswith("#"):
                flush()
            continue
        if not cur:
            start = n
        cur.append(s)
    flush()
    return out


def sentences(text: str) -> list[tuple[int, str]]:
    """(line number of its block, sentence) of every sentence of the page's prose."""
    out: list[tuple[int, str]] = []
    for line, block in blocks(text):
        masked = block
        for a in ABBREV:
            masked = masked.replace(a, a.replace(".", "\x00"))
        for s in END.split(masked):
            s = s.replace("\x00", ".").strip()
            if s:
                out.append((line, s))
    return out


def words(sentence: str) -> int:
    """Words of a sentence: whitespace-separated tokens that contain a letter or a digit."""
    return sum(1 for t in sentence.split() if re.search(r"\w", t))
