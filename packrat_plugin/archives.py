"""Copies of an archive under another TorchServe version string.

TorchServe takes a model's version from its archive's MANIFEST.json, and the
register API has no version parameter.  Active/passive swapping needs two
versions of one model, so the controller writes two copies of the user's
archive whose manifests differ only in ``modelVersion``.

An archive the user built with ``torch-model-archiver`` (not by ``packrat
archive``) keeps its handler, wrapped: the copy's manifest names Packrat's
wrapping handler (``handlers/wrapped.py``, its entry module added) and its
model-config.yaml, written when the archive had none, keeps the user's
handler under ``packrat.handler``, less the batch size, batch delay and
worker counts Packrat plans.  Nothing else of the archive changes.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import yaml

from archiver.entry import entry_module_text
from packrat_plugin.foreign import read_archive

MANIFEST = "MAR-INF/MANIFEST.json"
MODEL_CONFIG = "model-config.yaml"
# The mixed-plan handler's entry module, added to a grouped copy (handlers/mixed_plan/handler.py).
PLAN_ENTRY = "packrat_plan_handler.py"
# The wrapping handler's entry module, added to a copy of a user's own archive (handlers/wrapped.py).
WRAP_ENTRY = "packrat_wrapped_handler.py"


def is_users_archive(path: Path) -> bool:
    """Built by the user, not by ``packrat archive``: its model-config.yaml carries no ``handler.spec``."""
    return not read_archive(path).ours


def archive_version(path: Path) -> str:
    with zipfile.ZipFile(path) as mar:
        return str(json.loads(mar.read(MANIFEST))["model"]["modelVersion"])


def versioned_copy(
    source: Path, target: Path, version: str, grouped: bool = False, max_batch_delay_ms: int = 5
) -> Path:
    """Write ``target``: ``source`` with ``modelVersion`` set to ``version``.

    ``grouped``: the copy serves a mixed plan in one worker: its handler
    becomes Packrat's plan handler (its entry module added) in TorchServe's
    async mode, one request at a time to the worker, which batches itself
    (each instance waits up to ``max_batch_delay_ms`` for a fuller batch).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    wrap = is_users_archive(source)
    if grouped and wrap:
        raise ValueError(f"{source} is your own archive: mixed plans need one built with `packrat archive`")
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(partial, "w", zipfile.ZIP_STORED) as dst:
        names = src.namelist()
        if grouped and MODEL_CONFIG not in names:
            raise ValueError(f"{source} has no {MODEL_CONFIG}: build it with `packrat archive` to serve mixed plans")
        manifest = json.loads(src.read(MANIFEST))
        config_file = manifest["model"].get("configFile") or (MODEL_CONFIG if MODEL_CONFIG in names else None)
        users_handler = str(manifest["model"].get("handler", ""))
        for info in src.infolist():
            data = src.read(info)
            if info.filename == MANIFEST:
                manifest["model"]["modelVersion"] = version
                if grouped:
                    manifest["model"]["handler"] = PLAN_ENTRY
                if wrap:
                    manifest["model"]["handler"] = WRAP_ENTRY
                    manifest["model"]["configFile"] = config_file or MODEL_CONFIG
                data = json.dumps(manifest, indent=2).encode()
            elif wrap and info.filename == config_file:
                data = _wrapped_config(yaml.safe_load(data) or {}, users_handler)
            elif grouped and info.filename == MODEL_CONFIG:
                config = yaml.safe_load(data) or {}
                config.update(asyncCommunication=True, batchSize=1, maxBatchDelay=0)
                config.setdefault("handler", {})["plan"] = {"max_batch_delay_ms": max_batch_delay_ms}
                data = yaml.safe_dump(config, sort_keys=False).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_STORED)
        if grouped:
            # Imported here: the handlers import torch (seconds), which the controller otherwise never needs.
            from handlers.mixed_plan.handler import PackratPlanHandler

            dst.writestr(PLAN_ENTRY, entry_module_text(PackratPlanHandler), compress_type=zipfile.ZIP_STORED)
        if wrap:
            from handlers.wrapped import PackratWrappedHandler

            if not config_file:
                dst.writestr(MODEL_CONFIG, _wrapped_config({}, users_handler))
            dst.writestr(WRAP_ENTRY, entry_module_text(PackratWrappedHandler), compress_type=zipfile.ZIP_STORED)
    partial.replace(target)
    return target


# What Packrat decides per version at register and scale time; an archive's own would override it.
PLANNED_KEYS = ("batchSize", "maxBatchDelay", "minWorkers", "maxWorkers")


def _wrapped_config(config: dict, handler: str) -> bytes:
    """The user's model-config.yaml with their handler kept for the wrapping one to load, and without the
    batching and worker counts Packrat plans (``PLANNED_KEYS``)."""
    config = {k: v for k, v in config.items() if k not in PLANNED_KEYS} if isinstance(config, dict) else {}
    config["packrat"] = {**(config.get("packrat") or {}), "handler": handler}
    return yaml.safe_dump(config, sort_keys=False).encode()
