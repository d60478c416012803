"""Archive names: one TorchServe model name per (model, mode, handler), and back.

Apart from ``build.py`` because the controller reads catalog names from
archive paths, and ``build.py`` imports torch (seconds at every start of
``packrat serve``, which otherwise never needs it).
"""

from __future__ import annotations

from pathlib import Path

from model_store.catalog import EXECUTION_MODES


def archive_name(model: str, mode: str, handler: str = "plain") -> str:
    """TorchServe model name of an archive: one archive per (model, mode, handler)."""
    return f"{model}_{mode}" if handler in ("plain", "packrat") else f"{model}_{mode}-{handler}"


def catalog_name(archive: str | Path) -> str:
    """Inverse of :func:`archive_name`: ``.../bert-base_script-ebird.mar`` → ``bert-base``."""
    stem = Path(archive).stem
    name, _, tail = stem.rpartition("_")
    mode = tail.split("-", 1)[0]
    return name if name and mode in EXECUTION_MODES else stem
