"""The front door and the docs stay navigable: every relative link resolves inside the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = []
    for doc in documents():
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+://|mailto:|#", target):
                continue
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            if not path.exists() or ROOT not in path.parents:
                broken.append(f"{doc.relative_to(ROOT)} → {target}")
    assert not broken, broken


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "make demo" in text and "make test" in text  # the two commands a fresh machine runs
