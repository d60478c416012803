"""Copies of an archive under another TorchServe version string.

TorchServe takes a model's version from its archive's MANIFEST.json, and the
register API has no version parameter.  Active/passive swapping needs two
versions of one model, so the controller writes two copies of the user's
archive whose manifests differ only in ``modelVersion``.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

MANIFEST = "MAR-INF/MANIFEST.json"


def archive_version(path: Path) -> str:
    with zipfile.ZipFile(path) as mar:
        return str(json.loads(mar.read(MANIFEST))["model"]["modelVersion"])


def versioned_copy(source: Path, target: Path, version: str) -> Path:
    """Write ``target``: ``source`` with ``modelVersion`` set to ``version``."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED) as dst:
        if MANIFEST not in src.namelist():
            raise ValueError(f"{source} is not a TorchServe archive (no {MANIFEST})")
        for info in src.infolist():
            data = src.read(info)
            if info.filename == MANIFEST:
                manifest = json.loads(data)
                manifest["model"]["modelVersion"] = version
                data = json.dumps(manifest, indent=2).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_STORED)
    partial.replace(target)
    return target
