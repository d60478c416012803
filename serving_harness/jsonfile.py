"""Atomic JSON files: profiles, plans and results are read while they are written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, data: Any) -> None:
    """Write-then-rename: a reader (a starting worker, a resumed profiler) never
    sees half a file, and an interrupted write leaves the old file intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
