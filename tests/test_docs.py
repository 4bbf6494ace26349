"""The README and the guide pages in docs/: every relative link, image and #anchor resolves, and the README
stays short (issue 18: a README that fits on a few screens, the rest in docs/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

README_MAX_LINES = 150
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks (a ``# comment`` in a bash block is no heading, ``[x](y)`` no
    link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        lines.append("" if fenced else line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose(text):
        if m := HEADING.match(line):
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(text: str) -> list[str]:
    return [target for line in prose(text) for target in LINK.findall(line)]


def broken_links(text: str, where: Path) -> list[str]:
    """Every relative link or image of ``text`` (a page in folder ``where``) whose file or #anchor is
    missing."""
    broken = []
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check
            continue
        path, _, anchor = target.partition("#")
        file = (where / path).resolve() if path else None
        if file is not None and not file.exists():
            broken.append(f"{target}: no such file")
            continue
        markdown = file is None or file.suffix == ".md"  # an anchor into a figure or a script is not checked
        if anchor and markdown and anchor not in anchors(text if file is None else file.read_text()):
            broken.append(f"{target}: no such heading")
    return broken


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_image_resolves(page: Path) -> None:
    assert broken_links(page.read_text(), page.parent) == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[ok](docs/training.md) and ![fig](docs/figures/compare-loss.png)", []),
        ("[gone](docs/no-such-page.md)", ["docs/no-such-page.md: no such file"]),
        ("![gone](docs/figures/no-such.png)", ["docs/figures/no-such.png: no such file"]),
        ("## Here\n\n[up](#here) [nowhere](#there)", ["#there: no such heading"]),
        (
            "[anchor](docs/probe.md#reading-the-figures) [bad](docs/probe.md#no-such)",
            ["docs/probe.md#no-such: no such heading"],
        ),
        ("```bash\n[not a link](nowhere.md)\n```\n[web](https://example.org/x.md)", []),
    ],
)
def test_the_link_check_catches_broken_links(text: str, expected: list[str]) -> None:
    assert broken_links(text, ROOT) == expected


def test_slugs_follow_github() -> None:
    assert slug("Reproduce Table 1 / Figure 3") == "reproduce-table-1--figure-3"
    assert slug("Trainers (`trainer=`)") == "trainers-trainer"
    assert slug("The norm factorial, Pre-LN vs Post-LN, and the norm's output geometry") == (
        "the-norm-factorial-pre-ln-vs-post-ln-and-the-norms-output-geometry"
    )


def test_every_figure_a_page_shows_exists() -> None:
    shown = [
        (page, target)
        for page in pages()
        for target in links(page.read_text())
        if "figures/" in target and not target.startswith("http")
    ]
    assert shown, "no page shows a figure"
    assert [f"{page.name}: {t}" for page, t in shown if not (page.parent / t).resolve().is_file()] == []
    assert all((page.parent / t).resolve().parent == ROOT / "docs" / "figures" for page, t in shown)


def test_the_readme_guide_table_lists_existing_pages() -> None:
    readme = (ROOT / "README.md").read_text()
    guide = readme.split("\n## Guide", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| \[[^\]]+\]\((docs/[^)#]+\.md)\)", guide, flags=re.M)
    assert len(listed) >= 8, "the guide table lost its pages"
    assert [p for p in listed if not (ROOT / p).is_file()] == []
    # every hand-written guide page is listed (the generated number pages are listed too)
    assert {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} <= set(listed)


def test_the_readme_fits_on_a_few_screens() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into a docs/ page"
