"""A TorchServe archive for a scikit-learn pipeline, served as its tensor program.

``packrat sklearn-archive PIPELINE.joblib`` writes ``NAME.mar`` with the
pipeline (``joblib``, the serialized file), optionally fine-tuned weights
(``torch.save(result.model.state_dict())``, loaded ``weights_only``), and a
model-config.yaml whose ``handler.windtunnel`` section names the input
columns, the tree mode and the request limits.  The worker translates the
pipeline when it starts (``windtunnel/handler.py``), so the
archive needs no pickled torch module.  A joblib file is a pickle: build
archives only from pipelines you trust, as with any TorchServe model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from archiver.entry import write_entry_module

ENTRY = "windtunnel_handler.py"  # the entry module's file name inside the archive
DEFAULT_MAX_ROWS = 4096  # rows per request
DEFAULT_MAX_PAYLOAD_BYTES = 4 * 1024 * 1024


def archive_config(columns: list[str] | None, soft: bool, max_rows: int, max_payload_bytes: int,
                   batch_size: int, max_batch_delay_ms: int) -> dict[str, Any]:  # fmt: skip
    if max_rows < 1 or max_payload_bytes < 1 or batch_size < 1 or max_batch_delay_ms < 0:
        raise ValueError("max_rows, max_payload_bytes and batch_size must be ≥ 1, max_batch_delay_ms ≥ 0")
    settings: dict[str, Any] = {"soft": soft, "max_rows": max_rows, "max_payload_bytes": max_payload_bytes}
    if columns:
        settings["columns"] = list(columns)
    return {
        "minWorkers": 1,
        "maxWorkers": 1,
        "batchSize": batch_size,
        "maxBatchDelay": max_batch_delay_ms,
        "responseTimeout": 120,
        "handler": {"windtunnel": settings},
    }


def build_sklearn_archive(
    pipeline_path: Path,
    out_dir: Path,
    name: str,
    columns: list[str] | None = None,
    weights: Path | None = None,
    soft: bool = False,
    max_rows: int = DEFAULT_MAX_ROWS,
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
    batch_size: int = 8,
    max_batch_delay_ms: int = 5,
) -> Path:
    """Check that the pipeline translates (refusing early, not in the worker), then archive it."""
    import joblib
    import torch

    from windtunnel.handler import WindTunnelModelHandler
    from windtunnel.translate import translate

    model = translate(joblib.load(pipeline_path), columns)
    if weights is not None:
        model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="windtunnel-archive-") as tmp:
        work = Path(tmp)
        serialized = work / "pipeline.joblib"
        shutil.copyfile(pipeline_path, serialized)
        extra = []
        if weights is not None:
            extra.append(work / "weights.pt")
            shutil.copyfile(weights, extra[0])
        config = work / "model-config.yaml"
        config.write_text(yaml.safe_dump(
            archive_config(columns, soft, max_rows, max_payload_bytes, batch_size, max_batch_delay_ms), sort_keys=False
        ))  # fmt: skip
        entry = write_entry_module(WindTunnelModelHandler, work, ENTRY)
        cmd = [
            str(Path(sys.executable).with_name("torch-model-archiver")), "--model-name", name, "--version", "1.0",
            "--serialized-file", str(serialized), "--handler", str(entry), "--config-file", str(config),
            "--export-path", str(work), "--archive-format", "zip-store", "--force",
        ]  # fmt: skip
        if extra:
            cmd += ["--extra-files", ",".join(str(e) for e in extra)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(work)})
        if proc.returncode != 0:
            raise RuntimeError(f"torch-model-archiver failed for {name}:\n{proc.stderr.strip()}")
        target = out_dir / f"{name}.mar"
        shutil.move(str(work / f"{name}.mar"), target)
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pipeline", type=Path, help="a fitted scikit-learn pipeline saved with joblib.dump")
    parser.add_argument("--name", required=True, help="the model's name in TorchServe")
    parser.add_argument("--out-dir", type=Path, default=Path("model_store/archives"))
    parser.add_argument("--columns", help="comma-separated input column names (default: the names it was fitted "
                                          "with, else x0, x1, …)")  # fmt: skip
    parser.add_argument("--weights", type=Path, help="fine-tuned weights (state_dict) of the translated pipeline")
    parser.add_argument("--soft", action="store_true", help="serve soft tree splits (as fine-tuned); default hard")
    parser.add_argument("--max-rows", type=int, default=DEFAULT_MAX_ROWS, help="rows per request")
    parser.add_argument("--batch-size", type=int, default=8, help="TorchServe batch size (requests)")


def run(args: argparse.Namespace) -> int:
    from windtunnel.translate import UntranslatableError

    columns = [c.strip() for c in args.columns.split(",")] if args.columns else None
    try:
        path = build_sklearn_archive(args.pipeline, args.out_dir, args.name, columns, args.weights, args.soft,
                                     args.max_rows, batch_size=args.batch_size)  # fmt: skip
    except UntranslatableError as exc:
        print(f"cannot serve {args.pipeline}: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
