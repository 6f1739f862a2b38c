"""The README and docs/ link only to what the repository holds: every relative link names a file
that exists, every #anchor a heading of that file, and no page points outside the checkout."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text().splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            out.add(text.replace(" ", "-"))
    return out


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.is_relative_to(ROOT):
                broken.append(f"{page.name}: {target} points outside the repository")
            elif not dest.exists():
                broken.append(f"{page.name}: {target} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target}: no such heading")
    assert not broken, "\n".join(broken)


def test_no_page_cites_the_folder_beside_the_checkout() -> None:
    for page in PAGES:
        assert "../shared" not in page.read_text(), f"{page.name} cites a path outside the repository"
