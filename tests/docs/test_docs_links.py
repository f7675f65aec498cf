"""Every relative link in the markdown of the README, ``docs/``, ``benchmarks/`` and ``deploy/``
resolves: the file exists, and an anchor into a markdown file names one of its headings (GitHub's
slugs). Every page of ``docs/`` is reachable from its index, ``docs/README.md``."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _pages() -> list[Path]:
    pages = [ROOT / "README.md"]
    for folder in ("docs", "benchmarks", "deploy"):
        pages += sorted((ROOT / folder).rglob("*.md"))
    return pages


def _prose(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text lowercased, punctuation dropped (letters,
    digits, ``_``, ``-`` and spaces kept), spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").replace("*", "").lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in ("L", "N", "M"))
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (repeated ones numbered as GitHub does)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose(path.read_text()):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = _slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` that point nowhere, as ``page:line: link (why)``."""
    wrong = []
    for n, line in _prose(page.read_text()):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            shown = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page
            where = f"{shown}:{n}: {target}"
            if not dest.exists():
                wrong.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                wrong.append(f"{where} (no heading with that anchor in {dest.name})")
    return wrong


def test_slugs_follow_github() -> None:
    assert _slug('`every="auto"`: the snapshot interval') == "everyauto-the-snapshot-interval"
    assert _slug("Loop: time lost (`stall.py`, issue 14)") == "loop-time-lost-stallpy-issue-14"
    assert _slug("kill → round 2") == "kill--round-2"


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n\n[ok](#top) [gone](nowhere.md) [bad](#nothing)\n```\n[x](no.md)\n```\n"
    )
    found = broken_links(page)
    assert [f.split(": ", 1)[1] for f in found] == [
        "nowhere.md (no such file)",
        "#nothing (no heading with that anchor in page.md)",
    ]


def test_every_relative_link_resolves() -> None:
    wrong = [w for page in _pages() for w in broken_links(page)]
    assert not wrong, "broken links (fix the link or the heading it points to):\n" + "\n".join(
        wrong
    )


def _linked(page: Path) -> set[Path]:
    out = set()
    for _, line in _prose(page.read_text()):
        for target in _LINK.findall(line):
            path_part = target.partition("#")[0]
            if path_part and not re.match(r"^[a-z][a-z0-9+.-]*:", target):
                out.add((page.parent / path_part).resolve())
    return out


def test_every_docs_page_is_reachable_from_the_index() -> None:
    index = ROOT / "docs" / "README.md"
    seen, todo = {index.resolve()}, [index]
    while todo:
        for dest in _linked(todo.pop()):
            if dest.suffix == ".md" and dest.is_relative_to(ROOT / "docs") and dest not in seen:
                seen.add(dest)
                todo.append(dest)
    orphans = sorted(
        p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md") if p not in seen
    )
    assert not orphans, f"pages no link from docs/README.md leads to: {orphans}; link them there"
