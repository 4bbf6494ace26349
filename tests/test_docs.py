"""The README and the guide pages in docs/: every relative link, image and #anchor resolves, and the README
stays a five-minute read (issue 76: at most 1,200 words, the rest in docs/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from models.norms import NORM_ARMS
from tests.conftest import ROOT

README_MAX_WORDS = 1200
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


def rendered_words(text: str) -> list[str]:
    """The words a reader of the rendered page reads, code blocks included, as ``wc -w`` counts them: a link
    or an image counts its text, not its address; an HTML comment and a token of markup alone (a table's
    ``|``, ``---``, a fence) count nothing."""
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    text = re.sub(r"!?\[((?:[^\]\\]|\\.)*)\]\([^)\s]+(?:\s+\"[^\"]*\")?\)", r"\1", text)
    return [word for word in text.split() if re.search(r"\w", word) and not FENCE.match(word)]


def test_the_word_count_reads_like_the_rendered_page() -> None:
    assert rendered_words("| a | [the guide](docs/training.md) |\n| --- | --- |\n```bash\nls -l\n```") == [
        "a", "the", "guide", "ls", "-l"]
    assert rendered_words("![a figure](docs/figures/x.png) <!-- a note -->") == ["a", "figure"]


def test_the_readme_is_a_five_minute_read() -> None:
    words = len(rendered_words((ROOT / "README.md").read_text()))
    assert words <= README_MAX_WORDS, f"README.md has {words} words; move detail into a docs/ page"


# A number as the answer table writes it: not part of a name (H200, 70m, SmolLM2), a Unicode minus allowed.
NUMBER = re.compile(r"(?<![\w.])[−+-]?\d(?:[\d,]*\d)?(?:\.\d+)?(?:e[−+-]?\d+)?(?![\w])")


def numbers(text: str) -> list[tuple[str, float]]:
    return [(token, float(token.replace("−", "-").replace(",", ""))) for token in NUMBER.findall(text)]


def unsourced_numbers(row: str, source: str) -> list[str]:
    """The numbers of an answer row that no number of ``source`` (the pages it links) gives to the row's
    digits, sign aside (the pages write a difference either way): 0.076 stands for a page's 0.0755, 7.2e-6 for
    7.2e-06; 0.077 for neither."""
    cells = re.sub(r"\]\([^)]*\)", "]", row)  # a link's address is not a number of the answer
    found = [value for _, value in numbers(source)]
    unsourced = []
    for token, value in numbers(cells):
        mantissa = re.split(r"e", token.replace(",", ""))[0]
        decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
        exponent = int(token.split("e")[1].replace("−", "-")) if "e" in token else 0
        half = 0.5 * 10.0 ** (exponent - decimals)
        if not any(abs(abs(value) - abs(page)) <= half * (1 + 1e-9) for page in found):
            unsourced.append(token)
    return unsourced


def answer_rows() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    table = readme.split("\n## The answer", 1)[1].split("\n## ", 1)[0]
    return [line for line in table.splitlines() if line.startswith("| ") and not line.startswith(
        ("| question", "| ---"))]


def test_every_number_of_the_answer_is_on_the_pages_its_row_links() -> None:
    rows = answer_rows()
    assert len(rows) >= 6, "the answer table lost its rows"
    unsourced = {}
    for row in rows:
        pages = [ROOT / target.partition("#")[0] for target in links(row)]
        assert pages, f"a row of the answer links no page: {row[:60]}"
        if missing := unsourced_numbers(row, " ".join(page.read_text() for page in pages)):
            unsourced[row[:60]] = missing
    assert unsourced == {}


def test_the_number_check_sees_a_number_no_page_gives() -> None:
    page = "changes the loss by 0.0755 [0.0618, 0.0896] nats (95%); 7.2e-06 max; 83.8% of E[μ²] on an H200"
    assert unsourced_numbers("| 0.076 nats, 95%: 0.062 to 0.090; 7.2e-6; 83.8%, 84% | H200 |", page) == []
    assert unsourced_numbers("| 0.077 nats, 7.3e-6, 85%, 200 |", page) == ["0.077", "7.3e-6", "85", "200"]


def norm_arm_table() -> list[str]:
    """docs/probe.md's table of the norm arms, as the registry (models/norms.py) states them."""
    rows = ["| `norm=` | centering | bias | module | what it varies |", "| --- | --- | --- | --- | --- |"]
    for arm in NORM_ARMS.values():
        module = arm.module_type
        name = f"nn.{module.__name__}" if module.__module__.startswith("torch.nn") else module.__name__
        centres, bias = ("yes" if arm.centres else "no"), ("yes" if arm.has_bias else "no")
        rows.append(f"| `{arm.name}` | {centres} | {bias} | `{name}` | {arm.isolates} |")
    return rows


def test_the_probe_pages_norm_arm_table_is_the_registrys() -> None:
    lines = (ROOT / "docs" / "probe.md").read_text().splitlines()
    expected = norm_arm_table()
    start = lines.index(expected[0])
    assert lines[start:start + len(expected)] == expected, (
        "docs/probe.md's norm table, from the registry:\n" + "\n".join(expected))
