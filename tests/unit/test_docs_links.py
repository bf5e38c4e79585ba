"""Every relative link in the documentation resolves: README.md, CONTRIBUTING.md, every
page under docs/ and the examples' READMEs. A link to a file must name one that exists
(a directory too); a ``#anchor`` must name a heading of the page it points to, with
GitHub's rule for turning a heading into an anchor. Pages named in the text without a
link (``docs/entities.md``, ``operations.md``) must exist too; the one exception is the
project's shared contract ``spec/PROTOCOLS.md`` and ``spec/ARCHITECTURE.md``
(``../shared/spec/``), which live beside the repository, not in it."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "examples").rglob("*.md"),
    ]
)
# [text](target) and [text](target "title"), not images' data or code spans.
LINK = re.compile(r"\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
EXTERNAL = ("http://", "https://", "mailto:", "ftp://")
# A page named in the text: a path ending in .md, not part of a longer path or address.
PAGE_MENTION = re.compile(r"(?<![\w/.:-])((?:\.\./)*[\w.-]+(?:/[\w.-]+)*\.md)\b")
SHARED_SPEC = re.compile(r"(?:(?:\.\./)*shared/)?(?:spec/)?(?:PROTOCOLS|ARCHITECTURE)\.md")


def prose(page: Path) -> str:
    """The page without its code blocks and code spans (links there are not links)."""
    return CODE_SPAN.sub("", FENCE.sub("", page.read_text()))


def anchor_of(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed
    (``-`` and ``_`` kept), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: Counter[str] = Counter()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        anchor = anchor_of(match.group(1))
        found.add(anchor if not seen[anchor] else f"{anchor}-{seen[anchor]}")
        seen[anchor] += 1
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(page)):
        if target.startswith(EXTERNAL):
            continue
        path_part, _, fragment = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no heading #{fragment} in {resolved.name}")
    return broken


def missing_pages(page: Path) -> list[str]:
    """Pages named in the text (links aside) that are neither beside ``page``, nor at
    the repository's root, nor under docs/."""
    text = LINK.sub("", FENCE.sub("", page.read_text()))
    return [
        name
        for name in PAGE_MENTION.findall(text)
        if not SHARED_SPEC.fullmatch(name)
        and not any((base / name).exists() for base in (page.parent, ROOT, ROOT / "docs"))
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_named_in_the_text_exist(page: Path) -> None:
    assert missing_pages(page) == []


def test_the_checker_finds_a_broken_link_and_a_wrong_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## Backup and restore (live)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "## Here\n\n[ok](other.md#backup-and-restore-live) [self](#here)\n"
        "[gone](missing.md) [bad](other.md#backup) [web](https://example.com/x)\n"
        "`[not a link](nowhere.md)`\n```\n[nor this](nowhere.md)\n```\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#backup: no heading #backup in other.md",
    ]
    page.write_text("See `other.md`, docs/nowhere.md and spec/PROTOCOLS.md §1.\n")
    assert missing_pages(page) == ["docs/nowhere.md"]


def test_every_page_is_checked() -> None:
    names = {str(p.relative_to(ROOT)) for p in PAGES}
    assert {"README.md", "docs/operations.md", "docs/deployment.md", "docs/http-api.md"} <= names
