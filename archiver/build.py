"""Build TorchServe archives (.mar) for catalog models.

    python -m archiver --models resnet50,bert-base --modes eager,script
    packrat archive --ci              # the CI-sized subset
    packrat archive --all             # every model in every mode

Each archive holds the model's serialized artefact (a state_dict for eager and
compile mode, a traced+frozen TorchScript module for script mode), an entry
module naming the registered handler (``archiver/entry.py``), and a
model-config.yaml that carries the model's description under
``handler.spec``, so the handler needs nothing outside the archive to know its
input format.  Archives are written with torch-model-archiver, the tool
TorchServe users already know, in ``zip-store`` format: the weights are random
floats, which deflate does not shrink, only slow down.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path

import torch
import yaml
from tqdm import tqdm

from archiver.entry import entry_module_text, write_entry_module
from archiver.names import archive_name
from archiver.options import ServingOptions, group_model_config, model_config
from model_store import ARCHIVE_DIR
from model_store.catalog import ModelSpec, get_spec, load_catalog
from model_store.factory import build_model, example_inputs, outputs_close, script_model

ARCHIVE_VERSION = "1.0"


def is_current(target: Path, options: ServingOptions) -> bool:
    """``target`` exists and names the handler as this version of the project writes it.

    An archive built before a handler moved names a module that is gone, and
    TorchServe would fail to start its workers; such an archive is rebuilt, not reused.
    """
    if not target.exists():
        return False
    try:
        with zipfile.ZipFile(target) as mar:
            current = mar.read(options.kind.entry_file).decode() == entry_module_text(options.kind.handler)
    except (KeyError, zipfile.BadZipFile, OSError):
        current = False
    if not current:
        print(f"{target.name} was built by an earlier version of its handler's entry; rebuilding it", file=sys.stderr)
    return current


def group_archive_name(models: list[str], handler: str) -> str:
    """TorchServe model name of a group archive: its models, in order, then the handler."""
    return f"{'-'.join(models)}_eager-{handler}"


def _check_trace_batch_invariant(eager: torch.nn.Module, scripted, spec: ModelSpec) -> None:
    """Refuse an archive whose trace baked the batch size in.

    The trace is recorded at batch 1 and later served at any batch size; if an
    architecture's trace ever specialised on the batch dimension, serving would
    return wrong numbers silently.  Checking at build time makes it loud.
    """
    inputs = example_inputs(spec, batch=3, seed=1)
    if spec.input_kind == "tokens":
        # Rows of different real lengths: the trace was recorded with a full
        # mask, and attention-mask handling is where a trace could specialise.
        ids, mask = inputs
        for row, length in enumerate((1, spec.seq_len // 2, spec.seq_len)):
            mask[row, length:] = 0
            ids[row, length:] = 0
    with torch.no_grad():
        expected = eager(*inputs)
        got = scripted(*inputs)
    if not outputs_close(got, expected, tol=1e-4):
        raise RuntimeError(f"{spec.name}: traced model disagrees with eager at batch 3")


def write_artefact(spec: ModelSpec, workdir: Path, model: torch.nn.Module | None = None) -> Path:
    """The archive's serialized model in ``workdir``: ``model`` (built from the catalog when None)."""
    model = build_model(spec) if model is None else model
    if spec.mode == "script":
        scripted = script_model(model, example_inputs(spec, batch=1))
        _check_trace_batch_invariant(model, scripted, spec)
        path = workdir / "model.pt"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)
            torch.jit.save(scripted, str(path))
    else:
        path = workdir / "weights.pt"
        torch.save(model.state_dict(), path)
    return path


def build_archive(
    spec: ModelSpec,
    out_dir: Path = ARCHIVE_DIR,
    options: ServingOptions = ServingOptions(),
    force: bool = False,
) -> Path:
    """Write ``<out_dir>/<model>_<mode>.mar``; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = archive_name(spec.name, spec.mode, options.handler)
    target = out_dir / f"{name}.mar"
    if is_current(target, options) and not force:
        return target
    kind = options.kind
    if kind.group:
        return build_group_archive([spec], out_dir, options, force)
    if kind.check_spec is not None:
        kind.check_spec(kind.name, spec)
    config = model_config(spec, options)  # refuses options that do not fit this model before any work
    model = build_model(spec)
    if kind.check_model is not None:
        kind.check_model(spec, model, kind.parse_settings(dict(options.handler_settings)))
    with tempfile.TemporaryDirectory(prefix=f"mar-{name}-") as tmp:
        workdir = Path(tmp)
        artefact = write_artefact(spec, workdir, model)
        run_archiver(name, workdir, [artefact], config, options, out_dir, target)
    return target


def run_archiver(
    name: str, workdir: Path, artefacts: list[Path], config: dict, options: ServingOptions, out_dir: Path, target: Path
) -> None:
    """torch-model-archiver over ``artefacts`` (the first is the serialized file) and ``config``, into ``target``."""
    config_path = workdir / "model-config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [
        str(Path(sys.executable).with_name("torch-model-archiver")),
        "--model-name", name,
        "--version", ARCHIVE_VERSION,
        "--serialized-file", str(artefacts[0]),
        "--handler", str(write_entry_module(options.kind.handler, workdir, options.kind.entry_file)),
        "--config-file", str(config_path),
        "--export-path", str(workdir),
        "--archive-format", "zip-store",
        "--force",
    ]  # fmt: skip
    if artefacts[1:]:
        cmd += ["--extra-files", ",".join(str(a) for a in artefacts[1:])]
    # The archiver stages files in $TMPDIR/<model name>: two builds of one
    # name at once (two test sessions, a benchmark beside a test) would
    # share that folder, so each build stages inside its own directory.
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(workdir)})
    if proc.returncode != 0:
        raise RuntimeError(f"torch-model-archiver failed for {name}:\n{proc.stderr.strip()}")
    # Write-then-rename: a concurrent TorchServe never sees half an archive.
    partial = out_dir / f".{name}.mar.partial"
    shutil.move(str(workdir / f"{name}.mar"), partial)
    partial.replace(target)


def build_group_archive(
    specs: list[ModelSpec], out_dir: Path = ARCHIVE_DIR, options: ServingOptions = ServingOptions(), force: bool = False
) -> Path:
    """One archive serving every model in ``specs`` from one worker (REEF); returns its path.

    Each model's weights travel as ``weights-<name>.pt``; each is checked to
    segment into the handler's units and reproduce itself before any is written.
    """
    kind = options.kind
    if not kind.group:
        raise ValueError(f"the {options.handler} handler serves one model per archive")
    names = [s.name for s in specs]
    if not specs or len(set(names)) != len(names):
        raise ValueError(f"a group archive needs distinct models, got {names}")
    for spec in specs:
        if kind.check_spec is not None:
            kind.check_spec(kind.name, spec)
    parsed = kind.parse_settings(dict(options.handler_settings))
    parsed.check_members(names)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = group_archive_name(names, options.handler)
    target = out_dir / f"{name}.mar"
    if is_current(target, options) and not force:
        return target
    config = group_model_config(specs, options)
    with tempfile.TemporaryDirectory(prefix=f"mar-{name}-") as tmp:
        workdir = Path(tmp)
        artefacts = []
        for spec in tqdm(specs, desc=name, unit="model"):
            model = build_model(spec)
            if kind.check_model is not None:
                kind.check_model(spec, model, parsed)
            artefacts.append(workdir / f"weights-{spec.name}.pt")
            torch.save(model.state_dict(), artefacts[-1])
        run_archiver(name, workdir, artefacts, config, options, out_dir, target)
    return target


def select(models: list[str] | None, modes: list[str] | None, ci: bool) -> list[ModelSpec]:
    """The (model, mode) pairs to build, in catalog order."""
    catalog = load_catalog()
    names = models or [n for n, s in catalog.items() if s.ci or not ci]
    chosen: list[ModelSpec] = []
    for name in names:
        base = get_spec(name)
        for mode in modes or list(base.modes):
            chosen.append(base.with_mode(mode))
    return chosen


def build_many(
    specs: list[ModelSpec],
    out_dir: Path = ARCHIVE_DIR,
    options: ServingOptions = ServingOptions(),
    force: bool = False,
) -> list[Path]:
    paths = []
    with tqdm(specs, desc="archives", unit="mar") as bar:
        for spec in bar:
            bar.set_postfix_str(archive_name(spec.name, spec.mode, options.handler))
            paths.append(build_archive(spec, out_dir, options, force))
    return paths
