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

import yaml

MANIFEST = "MAR-INF/MANIFEST.json"
MODEL_CONFIG = "model-config.yaml"
# The mixed-plan handler's entry file, added to a grouped copy (handlers/plan_handler.py).
PLAN_ENTRY = Path(__file__).resolve().parent.parent / "handlers" / "entry" / "packrat_plan_handler.py"


def archive_version(path: Path) -> str:
    with zipfile.ZipFile(path) as mar:
        return str(json.loads(mar.read(MANIFEST))["model"]["modelVersion"])


def versioned_copy(
    source: Path, target: Path, version: str, grouped: bool = False, max_batch_delay_ms: int = 5
) -> Path:
    """Write ``target``: ``source`` with ``modelVersion`` set to ``version``.

    ``grouped``: the copy serves a mixed plan in one worker: its handler
    becomes Packrat's plan handler (its entry file added) in TorchServe's
    async mode, one request at a time to the worker, which batches itself
    (each instance waits up to ``max_batch_delay_ms`` for a fuller batch).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED) as dst:
        names = src.namelist()
        if MANIFEST not in names:
            raise ValueError(f"{source} is not a TorchServe archive (no {MANIFEST})")
        if grouped and MODEL_CONFIG not in names:
            raise ValueError(f"{source} has no {MODEL_CONFIG}: build it with `packrat archive` to serve mixed plans")
        for info in src.infolist():
            data = src.read(info)
            if info.filename == MANIFEST:
                manifest = json.loads(data)
                manifest["model"]["modelVersion"] = version
                if grouped:
                    manifest["model"]["handler"] = PLAN_ENTRY.name
                data = json.dumps(manifest, indent=2).encode()
            elif grouped and info.filename == MODEL_CONFIG:
                config = yaml.safe_load(data) or {}
                config.update(asyncCommunication=True, batchSize=1, maxBatchDelay=0)
                config.setdefault("handler", {})["plan"] = {"max_batch_delay_ms": max_batch_delay_ms}
                data = yaml.safe_dump(config, sort_keys=False).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_STORED)
        if grouped:
            dst.write(PLAN_ENTRY, PLAN_ENTRY.name, compress_type=zipfile.ZIP_STORED)
    partial.replace(target)
    return target
