"""The docs a user reads: every relative link in README.md and docs/ leads to a file that
exists and, with ``#anchor``, to a heading of it (GitHub's anchors); and no user's page in
docs/ is over 400 lines (the results and study write-ups, and the lab notes, may be)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LONG_ALLOWED = {"results.md", "lab-notes.md"}  # and docs/study-*.md: write-ups of studies
MAX_LINES = 400

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of ``path``'s headings (lower case, punctuation dropped, spaces
    to hyphens, ``-1``, ``-2`` after repeats)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link's text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    out, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out += [(number, target) for target in LINK.findall(line)]
    return out


def broken_links(pages: list[Path]) -> list[str]:
    broken = []
    for page in pages:
        for number, target in links(page):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(REPO)}:{number}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no such heading in {dest.name})")
    return broken


def test_every_link_of_the_docs_leads_somewhere():
    assert broken_links(PAGES) == []


def test_a_broken_link_and_a_missing_heading_are_found(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n## The `x` part: 2 ways\n\n[b](b.md) [ok](#a-page)"
                                   " [ok2](#the-x-part-2-ways) [no](#nowhere)\n"
                                   "```\n[not a link](c.md)\n```\n")
    global REPO
    old, REPO = REPO, tmp_path
    try:
        assert broken_links([tmp_path / "a.md"]) == [
            "a.md:4: b.md (no such file)", "a.md:4: #nowhere (no such heading in a.md)"]
    finally:
        REPO = old


@pytest.mark.parametrize("page", [
    p for p in PAGES if p.parent.name == "docs"
    and p.name not in LONG_ALLOWED and not p.name.startswith("study-")], ids=lambda p: p.name)
def test_a_users_page_is_at_most_400_lines(page):
    lines = len(page.read_text().splitlines())
    assert lines <= MAX_LINES, f"docs/{page.name} has {lines} lines: split it by concept"
