"""Every relative link in the docs resolves: README.md, docs/**/*.md and benchmarks/results/*.md.

A link is ``[text](target)`` outside code (fenced blocks and inline code are skipped). Links with
a scheme (``https:``, ``mailto:``) are not followed. A relative target must name an existing file
or directory; a ``#fragment`` on a markdown target must be one of its headings' anchors, made as
GitHub makes them (lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2`` for repeats).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += sorted((ROOT / "benchmarks" / "results").glob("*.md"))
    return [f for f in files if f.is_file()]


def prose_lines(path: Path, keep_inline_code: bool = False) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks, inline code removed unless kept."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((number, line if keep_inline_code else INLINE_CODE.sub("", line)))
    return out


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file (a heading's inline code counts as text)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path, keep_inline_code=True):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    problems = []
    for number, line in prose_lines(path):
        for target in LINK.findall(line):
            if SCHEME.match(target):
                continue
            file_part, _, fragment = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}:{number}: {target}"
            if not dest.exists():
                problems.append(f"{where} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                problems.append(f"{where} (no heading #{fragment} in {dest.relative_to(ROOT)})")
    return problems


def test_the_docs_are_found():
    names = {f.relative_to(ROOT).as_posix() for f in markdown_files()}
    assert {"README.md", "docs/benchmarks.md", "benchmarks/results/README.md"} <= names, sorted(names)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(path):
    problems = broken_links(path)
    assert not problems, "\n".join(problems)
