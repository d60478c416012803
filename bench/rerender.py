"""Re-render every committed benchmark table from its JSON and say which come out byte for byte.

    python -m bench.rerender            # one line per table: same, differs, or why it cannot re-render

A table is written once, by the benchmark that measured it (``report.publish``);
its JSON keeps every number.  Re-rendering them all after a refactor shows that
the rendering code still says what it said: a table that differs names a change
in how results are presented, not in what was measured.  Tables whose renderer
needs the run's command-line arguments, or has none of its own, are listed as such.
A table written before its renderer last changed (a column added since) differs
for that reason alone; run this before and after a change and compare the two
listings (``--hashes`` prints a digest of each rendering for that).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import sys
from pathlib import Path

from bench.report import BENCH_DIR


def rerender(json_path: Path, hashes: bool = False) -> str:
    """``same``, ``differs``, or why the table cannot be re-rendered from its JSON alone."""
    data = json.loads(json_path.read_text())
    command = ((data.get("provenance") or {}).get("command") or "").split()
    if len(command) < 3 or command[1] != "-m":
        return "no command recorded"
    render = getattr(importlib.import_module(command[2]), "render", None)
    if render is None:
        return f"{command[2]} has no render(data)"
    stem = json_path.stem
    arity = len(inspect.signature(render).parameters)
    if arity not in (1, 2):
        return f"{command[2]}.render needs the run's arguments"
    try:
        markdown = render(data, stem) if arity == 2 else render(data)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        return f"written by an older schema ({type(exc).__name__}: {exc})"
    committed = json_path.with_suffix(".md")
    outcome = "same" if committed.exists() and committed.read_text() == markdown else "differs"
    return f"{outcome} {hashlib.sha1(markdown.encode()).hexdigest()[:12]}" if hashes else outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=BENCH_DIR, help="folder of committed tables")
    parser.add_argument("--hashes", action="store_true", help="print a digest of each rendering, to compare runs")
    args = parser.parse_args(argv)
    outcomes = {path.stem: rerender(path, args.hashes) for path in sorted(args.dir.glob("*.json"))}
    for stem, outcome in outcomes.items():
        print(f"{stem:50s} {outcome}")
    same = sum(o.startswith("same") for o in outcomes.values())
    differ = sum(o.startswith("differs") for o in outcomes.values())
    print(f"{same} of {len(outcomes)} re-render byte for byte; {differ} differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
