"""Every relative link and #anchor in docs/*.md and README.md resolves: the file exists and,
for a Markdown target, it has a heading whose GitHub slug is the anchor. A renamed heading
or a moved file otherwise leaves readers at the top of a page, or at a 404, without a word."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_LINK = re.compile(r"""<(?:a|img)\s[^>]*?(?:href|src)\s*=\s*["']([^"']*)["']""", re.IGNORECASE)
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text (links to their text, code spans to
    their content, emphasis marks gone), lowercased, punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = _CODE_SPAN.sub(lambda m: m.group(2), text)
    text = re.sub(r"<[^>]+>", "", text).lower()
    kept = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in "-_" or cat[0] in "LN" or cat == "Mn":
            kept.append(ch)
        elif ch == " ":
            kept.append("-")
        # everything else (punctuation, symbols: `*`, `.`, `/`, `×`, `≈`, ...) is dropped
    return "".join(kept)


def _outside_code(text: str) -> list[str]:
    """The page's lines with fenced blocks blanked and inline code spans removed."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else _CODE_SPAN.sub("", line))
    return lines


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page, with GitHub's -1, -2 ... for repeated headings."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else _HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link on the page outside code."""
    found = []
    for no, line in enumerate(_outside_code(page.read_text(encoding="utf-8")), 1):
        for pattern in (_LINK, _HTML_LINK, _REF_DEF):
            found += [(no, m.group(1)) for m in pattern.finditer(line)]
    return found


def broken(page: Path) -> list[str]:
    """What is wrong with the page's relative links, one line each (empty: all resolve)."""
    problems = []
    for no, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("//"):
            continue  # http:, https:, mailto: ... are not this test's business
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}:{no}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor:
            if dest.suffix != ".md":
                problems.append(f"{where}: an anchor into a file that is not Markdown")
            elif anchor not in anchors(dest):
                problems.append(f"{where}: {dest.name} has no heading with the anchor #{anchor}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    assert broken(page) == []


def test_the_pages_have_links_to_check():
    """The link pattern finds links at all (a pattern that matched nothing would pass everything)."""
    assert sum(len(links(p)) for p in PAGES) > 100


def test_slug_follows_githubs_rules():
    assert slug("Async tensor parallelism") == "async-tensor-parallelism"
    assert slug("Pipeline bubble (`bench/bench_pipeline.py`)") == "pipeline-bubble-benchbench_pipelinepy"
    assert slug("Time breakdown: where a step goes") == "time-breakdown-where-a-step-goes"
    assert slug("GEMM census (CPU) — issue 48") == "gemm-census-cpu--issue-48"
    assert slug("[`report.html`](report.md) and *more*") == "reporthtml-and-more"


def test_a_broken_link_or_anchor_is_reported(tmp_path, monkeypatch):
    """The checker fails on a missing file, a missing anchor and an anchor into a repeated
    heading that does not exist; and passes the ones that resolve."""
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Other\n\n## A B\n\n## A B\n\n```\n## not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Here, too\n\n"
        "[ok](other.md#a-b) [ok2](other.md#a-b-1) [self](#here-too) ![img](other.md)\n"
        "[gone](missing.md) [bad](other.md#a-b-2) [code](other.md#not-a-heading) [selfbad](#nowhere)\n"
        "`[in code](nowhere.md)` [web](https://example.com/x#y)\n"
        '<a href="missing.html">x</a>\n'
    )
    problems = broken(page)
    assert len(problems) == 5, problems
    assert "no such file missing.md" in problems[0]
    assert "#a-b-2" in problems[1] and "#not-a-heading" in problems[2] and "#nowhere" in problems[3]
    assert "missing.html" in problems[4]
