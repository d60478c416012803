"""The command lines README.md and docs/ give a reader, collected from their code blocks.

A reader who tries the commands the docs give is the project's first user;
``tests/unit/test_documented_commands.py`` parses every one with the real
parser of the entry point it names, and ``tests/serving/`` runs the
benchmarks among them for a few seconds each.  Collected, not listed by
hand, so a command added to the docs is checked without anyone remembering to.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The project's entry points as the docs write them (with or without .venv/bin/).
_PROJECT = re.compile(r"^(?:\.venv/bin/)?(packrat|python -m (?:bench|archiver|packrat_plugin|windtunnel)\S*|make)\s")
_BLOCK = re.compile(r"```(?:bash|sh|shell|console)?\n(.*?)```", re.S)


@dataclass(frozen=True)
class DocumentedCommand:
    source: str  # file:line
    line: str

    @property
    def argv(self) -> list[str]:
        words = shlex.split(self.line)
        if words[0].startswith(".venv/bin/"):
            words[0] = words[0].removeprefix(".venv/bin/")
        return words

    @property
    def entry_point(self) -> str:
        """``packrat <sub>``, ``python -m <module>`` or ``make <target>``."""
        argv = self.argv
        if argv[0] == "python":
            return f"python -m {argv[2]}"
        return f"{argv[0]} {argv[1]}" if len(argv) > 1 else argv[0]

    def __str__(self) -> str:
        return f"{self.source}: {self.line}"


def _logical_lines(block: str, first_line: int) -> list[tuple[int, str]]:
    """Lines of a code block with backslash continuations joined and comments and prompts removed."""
    out, pending, start = [], "", first_line
    for offset, raw in enumerate(block.split("\n")):
        if not pending:
            start = first_line + offset
        stripped = raw.rstrip()
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        line = (pending + stripped).strip()
        pending = ""
        line = re.sub(r"^\$\s*", "", line)
        # A trailing comment ("# what this does"); a '#' inside a word (a URL's fragment) stays.
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append((start, line))
    return out


def documented_commands(root: Path = REPO) -> list[DocumentedCommand]:
    """Every project command line in README.md and docs/**/*.md code blocks, in file order."""
    files = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    found = []
    for path in files:
        text = path.read_text()
        for match in _BLOCK.finditer(text):
            first = text.count("\n", 0, match.start(1)) + 1
            for number, line in _logical_lines(match.group(1), first):
                if _PROJECT.match(line + " "):
                    found.append(DocumentedCommand(f"{path.relative_to(root)}:{number}", line))
    return found
