"""Build TorchServe archives (.mar) for catalog models.

    python -m model_store.build --models resnet50,bert-base --modes eager,script
    packrat archive --ci              # the CI-sized subset
    packrat archive --all             # every model in every mode

Each archive holds the model's serialized artefact (a state_dict for eager and
compile mode, a traced+frozen TorchScript module for script mode), the
project's CPU handler, and a model-config.yaml that carries the catalog spec
under ``handler.spec``, so the handler needs nothing outside the archive to
know its input format.  Archives are written with torch-model-archiver, the
tool TorchServe users already know, in ``zip-store`` format: the weights are
random floats, which deflate does not shrink, only slow down.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm import tqdm

from model_store.catalog import EXECUTION_MODES, ModelSpec, get_spec, load_catalog
from model_store.factory import build_model, example_inputs, outputs_close, script_model

ARCHIVE_DIR = Path(__file__).with_name("archives")
ENTRY_DIR = Path(__file__).resolve().parent.parent / "handlers" / "entry"
HANDLER_ENTRY = ENTRY_DIR / "packrat_handler.py"


@dataclass(frozen=True)
class HandlerKind:
    """A handler an archive can be built with."""

    entry: Path
    # Async handlers schedule requests themselves: TorchServe must hand them
    # each request as it arrives (asyncCommunication, batch 1, no delay).
    asynchronous: bool = False
    # "module:Class" whose ``from_dict`` validates the handler's own section of
    # model-config.yaml; imported only when an archive is built with it.
    settings_class: str | None = None
    # Serves several models from one archive (``build_group_archive``) instead of one archive per model.
    group: bool = False

    def check_settings(self, name: str, settings: dict[str, Any]) -> None:
        if self.settings_class is None:
            if settings:
                raise ValueError(f"the {name} handler takes no handler settings")
            return
        module, _, cls = self.settings_class.partition(":")
        getattr(importlib.import_module(module), cls).from_dict(settings)


HANDLERS = {
    "packrat": HandlerKind(HANDLER_ENTRY),
    "ebird": HandlerKind(ENTRY_DIR / "ebird_handler.py", True, "handlers.ebird.config:EbirdConfig"),
    "dvabatch": HandlerKind(ENTRY_DIR / "dvabatch_handler.py", True, "handlers.dvabatch.policy:DvaBatchConfig"),
    # One archive for a group of models served by one worker (``build_group_archive``).
    "reef": HandlerKind(ENTRY_DIR / "reef_handler.py", True, "handlers.reef.config:ReefConfig", group=True),
    # Synchronous: TorchServe's own batching, Nimble's ahead-of-time programs per batch-size bucket.
    "nimble": HandlerKind(ENTRY_DIR / "nimble_handler.py", False, "handlers.nimble.config:NimbleConfig"),
    # Async: every request joins the generation pool as it arrives; tokens streamed back.
    "orca": HandlerKind(ENTRY_DIR / "orca_handler.py", True, "handlers.orca.config:OrcaConfig"),
}
SLICING_HANDLERS = ("dvabatch", "reef")  # handlers that cut the eager model into segments
TRACING_HANDLERS = ("nimble",)  # handlers that trace the eager model to an fx graph in the worker
ARCHIVE_VERSION = "1.0"


@dataclass(frozen=True)
class ServingOptions:
    """TorchServe knobs written into model-config.yaml (overridable at register time)."""

    batch_size: int = 1
    max_batch_delay_ms: int = 5
    response_timeout_s: int = 120
    max_payload_bytes: int = 8 * 1024 * 1024
    handler: str = "packrat"
    # The handler's own section of model-config.yaml (``handler.<name>``),
    # e.g. Ebird's worker batch sizes; validated at build time.
    handler_settings: tuple[tuple[str, Any], ...] = ()
    # Async handlers: where requests are decoded (``handlers/runtime/decode.py``):
    # N threads, 0 inline, "lane"; None leaves it to the runtime's default.
    decode_threads: int | str | None = None
    # How often the handler hands its metrics to TorchServe, in seconds
    # (``handlers/runtime/metrics.py``; 0: at every event); None: the default.
    metrics_flush_interval_s: float | None = None
    # Async handlers, token models: the padded lengths requests are sorted
    # into (``handler.token_lengths``, DVABatch's input-diversity policy);
    # empty: every request padded to the sequence length.
    token_lengths: tuple[int, ...] = ()
    # Async handlers: which message pump runs TorchServe's async worker
    # (``handlers/runtime/worker_pump.py``): "lean" or "torchserve"; None: lean.
    worker_pump: str | None = None
    # Async handlers: where answers are encoded (``handlers/runtime/async_handler.py``):
    # "engine" (where each batch ends: the CPU lane) or "loop"; None: engine on CPU, loop on CUDA.
    encode_answers: str | None = None
    # The plain handler on CUDA: replay captured CUDA graphs, one per power-of-two
    # batch size up to ``batch_size`` (``handlers/cpu_handler.py``).
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if self.handler not in HANDLERS:
            raise ValueError(f"unknown handler {self.handler!r}; choose from {', '.join(HANDLERS)}")
        HANDLERS[self.handler].check_settings(self.handler, dict(self.handler_settings))
        if self.decode_threads is not None:
            if not HANDLERS[self.handler].asynchronous:
                raise ValueError(f"decode_threads applies to async handlers; {self.handler!r} decodes in its batch")
            from handlers.runtime.decode import parse_decode_threads

            parse_decode_threads(self.decode_threads)
        if self.token_lengths and not HANDLERS[self.handler].asynchronous:
            raise ValueError(f"token_lengths applies to async handlers; {self.handler!r} pads a batch to one length")
        if self.token_lengths and HANDLERS[self.handler].group:
            raise ValueError(
                f"token_lengths applies to one-model archives; {self.handler!r} pads to each model's length"
            )
        if self.handler == "orca" and (self.decode_threads is not None or self.token_lengths):
            raise ValueError("the orca handler parses requests on its event loop and does not pad: "
                             "decode_threads and token_lengths do not apply")  # fmt: skip
        if self.decode_threads == "lane" and HANDLERS[self.handler].group:
            raise ValueError(f"the {self.handler} handler has no CPU lanes to decode on; give decode_threads a count")
        if self.worker_pump is not None:
            if not HANDLERS[self.handler].asynchronous or self.handler == "orca":
                raise ValueError(f"worker_pump applies to the scheduling async handlers; {self.handler!r} has none")
            from handlers.runtime.worker_pump import parse_worker_pump

            parse_worker_pump(self.worker_pump)
        if self.encode_answers is not None:
            if not HANDLERS[self.handler].asynchronous or self.handler == "orca":
                raise ValueError(f"encode_answers applies to the scheduling async handlers; {self.handler!r} has none")
            from handlers.runtime.async_handler import parse_encode_answers

            parse_encode_answers(self.encode_answers)
        if self.cuda_graphs and self.handler != "packrat":
            raise ValueError(f"cuda_graphs applies to the plain handler; {self.handler!r} has its own settings")
        if self.metrics_flush_interval_s is not None:
            from handlers.runtime.metrics import parse_flush_interval

            parse_flush_interval(self.metrics_flush_interval_s)


def archive_name(model: str, mode: str, handler: str = "packrat") -> str:
    """TorchServe model name of an archive: one archive per (model, mode, handler)."""
    return f"{model}_{mode}" if handler == "packrat" else f"{model}_{mode}-{handler}"


def catalog_name(archive: str | Path) -> str:
    """Inverse of :func:`archive_name`: ``.../bert-base_script-ebird.mar`` → ``bert-base``."""
    stem = Path(archive).stem
    name, _, tail = stem.rpartition("_")
    mode = tail.split("-", 1)[0]
    return name if name and mode in EXECUTION_MODES else stem


def model_config(spec: ModelSpec, options: ServingOptions) -> dict:
    """The archive's model-config.yaml as a dict."""
    # torch.compile compiles inside initialize(); on a 2-core machine that
    # alone takes about a minute per model, past TorchServe's default 120 s
    # startup timeout once two workers start at once.
    # Nimble times every candidate at every bucket and may compile one.
    startup_timeout = 900 if spec.mode == "compile" or options.handler == "nimble" else 300
    # No minWorkers/maxWorkers: in an archive they override the register
    # API's initial_workers (TorchServe's ApiUtils.registerModel), which
    # would stop Packrat and users from choosing the worker count at
    # register time.
    config: dict[str, Any] = {
        "batchSize": options.batch_size,
        "maxBatchDelay": options.max_batch_delay_ms,
        "responseTimeout": options.response_timeout_s,
        "startupTimeout": startup_timeout,
        "handler": {
            "spec": spec.to_dict(),
            "max_payload_bytes": options.max_payload_bytes,
        },
    }
    if HANDLERS[options.handler].asynchronous:
        config.update(asyncCommunication=True, batchSize=1, maxBatchDelay=0)
    if HANDLERS[options.handler].settings_class is not None:
        config["handler"][options.handler] = dict(options.handler_settings)
        if options.decode_threads is not None:
            config["handler"]["decode_threads"] = options.decode_threads
        if options.worker_pump is not None:
            config["handler"]["worker_pump"] = options.worker_pump
        if options.encode_answers is not None:
            config["handler"]["encode_answers"] = options.encode_answers
    if options.cuda_graphs:
        config["handler"]["cuda_graphs"] = True
    if options.metrics_flush_interval_s is not None:
        config["handler"]["metrics_flush_interval_s"] = options.metrics_flush_interval_s
    if options.token_lengths:
        if spec.input_kind != "tokens":
            raise ValueError(f"{spec.name} takes images; token_lengths apply to token models")
        from handlers.codecs import parse_token_lengths

        config["handler"]["token_lengths"] = list(parse_token_lengths(list(options.token_lengths), spec.seq_len))
    return config


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


def _check_segments(spec: ModelSpec, options: ServingOptions, model: torch.nn.Module) -> None:
    """DVABatch runs the eager model cut into stages: refuse an archive whose cut would not reproduce it.

    ``model`` is the one the archive saves (tracing and slicing leave its weights as they are).
    """
    from handlers.dvabatch.policy import DvaBatchConfig

    _check_slices(spec, model, DvaBatchConfig.from_dict(dict(options.handler_settings)).segments)


def _check_nimble(spec: ModelSpec, model: torch.nn.Module) -> None:
    """Refuse a model the worker could not trace and freeze to the graph Nimble's programs run."""
    from handlers.nimble.program import freeze, reproduces

    example = example_inputs(spec, batch=2, seed=1)
    with torch.inference_mode():
        frozen = freeze(model, example)
        if not reproduces(frozen(*example), model(*example)):
            raise RuntimeError(f"{spec.name}: the frozen fx graph disagrees with the eager model")


def _check_slices(spec: ModelSpec, model: torch.nn.Module, segments: int) -> None:
    """Refuse a model whose cut into ``segments`` (as the worker makes it) would not reproduce it."""
    from handlers.runtime.segment_profile import slice_catalog_model

    slice_catalog_model(spec, model, segments)


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
    if target.exists() and not force:
        return target
    if HANDLERS[options.handler].group:
        return build_group_archive([spec], out_dir, options, force)
    if options.handler in SLICING_HANDLERS and spec.mode != "eager":
        raise ValueError(f"the {options.handler} handler slices the eager model; build {spec.name} in mode 'eager'")
    if options.handler == "orca" and (spec.family != "gpt2" or spec.mode != "eager"):
        raise ValueError(f"the orca handler serves GPT-2 in eager mode; {spec.name} is {spec.family}, {spec.mode!r}")
    if options.handler in TRACING_HANDLERS:
        if spec.mode != "eager":
            raise ValueError(f"the {options.handler} handler traces the eager model; build {spec.name} in mode 'eager'")
        if spec.input_kind != "image":
            raise ValueError(f"the {options.handler} handler serves image models; {spec.name} takes {spec.input_kind}")
    config = model_config(spec, options)  # refuses options that do not fit this model before any work
    model = build_model(spec)
    if options.handler == "dvabatch":
        _check_segments(spec, options, model)
    if options.handler == "nimble":
        _check_nimble(spec, model)
    with tempfile.TemporaryDirectory(prefix=f"mar-{name}-") as tmp:
        workdir = Path(tmp)
        artefact = write_artefact(spec, workdir, model)
        _archive(name, workdir, [artefact], config, options, out_dir, target)
    return target


def _archive(
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
        "--handler", str(HANDLERS[options.handler].entry),
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


def group_archive_name(models: list[str], handler: str) -> str:
    """TorchServe model name of a group archive: its models, in order, then the handler."""
    return f"{'-'.join(models)}_eager-{handler}"


def group_model_config(specs: list[ModelSpec], options: ServingOptions) -> dict:
    """A group archive's model-config.yaml: the first model's knobs, every model under ``handler.members``."""
    config = model_config(specs[0], options)
    del config["handler"]["spec"]
    config["handler"]["members"] = [{"spec": s.to_dict(), "artefact": f"weights-{s.name}.pt"} for s in specs]
    config["startupTimeout"] = 300 + 120 * (len(specs) - 1)  # every model is loaded and segmented at start
    return config


def build_group_archive(
    specs: list[ModelSpec], out_dir: Path = ARCHIVE_DIR, options: ServingOptions = ServingOptions(), force: bool = False
) -> Path:
    """One archive serving every model in ``specs`` from one worker (REEF); returns its path.

    Each model's weights travel as ``weights-<name>.pt``; each is checked to
    segment into the handler's units and reproduce itself before any is written.
    """
    kind = HANDLERS[options.handler]
    if not kind.group:
        raise ValueError(f"the {options.handler} handler serves one model per archive")
    names = [s.name for s in specs]
    if not specs or len(set(names)) != len(names):
        raise ValueError(f"a group archive needs distinct models, got {names}")
    for spec in specs:
        if spec.mode != "eager":
            raise ValueError(f"the {options.handler} handler slices eager models; {spec.name} is {spec.mode!r}")
    from handlers.reef.config import ReefConfig  # REEF's are the group archives

    parsed = ReefConfig.from_dict(dict(options.handler_settings))
    parsed.check_members(names)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = group_archive_name(names, options.handler)
    target = out_dir / f"{name}.mar"
    if target.exists() and not force:
        return target
    config = group_model_config(specs, options)
    with tempfile.TemporaryDirectory(prefix=f"mar-{name}-") as tmp:
        workdir = Path(tmp)
        artefacts = []
        for spec in tqdm(specs, desc=name, unit="model"):
            model = build_model(spec)
            _check_slices(spec, model, parsed.segments)
            artefacts.append(workdir / f"weights-{spec.name}.pt")
            torch.save(model.state_dict(), artefacts[-1])
        _archive(name, workdir, artefacts, config, options, out_dir, target)
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


def token_lengths_argument(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 16,32,64; got {text!r}") from None


def decode_threads_argument(text: str) -> int | str:
    """``--decode-threads``: a thread count, or a named placement (validated with the archive's options)."""
    try:
        return int(text)
    except ValueError:
        return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", help="comma-separated catalog names (default: all, or the CI set with --ci)")
    parser.add_argument("--modes", help=f"comma-separated modes from {','.join(EXECUTION_MODES)} (default: all)")
    parser.add_argument("--ci", action="store_true", help="only the catalog's CI-sized models")
    parser.add_argument("--all", action="store_true", help="every model in every mode")
    parser.add_argument("--out", type=Path, default=ARCHIVE_DIR, help="model store directory")
    parser.add_argument("--batch-size", type=int, default=ServingOptions.batch_size)
    parser.add_argument("--max-batch-delay", type=int, default=ServingOptions.max_batch_delay_ms)
    parser.add_argument("--handler", choices=sorted(HANDLERS), default="packrat", help="handler to build with")
    parser.add_argument(
        "--handler-config",
        type=json.loads,
        default={},
        help='the handler\'s settings as JSON, e.g. \'{"worker_batches": [1, 1, 2, 4], "max_inflight": 8}\'',
    )
    parser.add_argument(
        "--decode-threads",
        type=decode_threads_argument,
        help="async handlers: where requests are decoded: N threads, 0 inline on the event loop, or 'lane' "
        "(between batches on the CPU lanes) (default: 4 threads on CUDA, lane on CPU)",
    )
    parser.add_argument(
        "--token-lengths",
        type=token_lengths_argument,
        default=(),
        help="async handlers, token models: comma-separated padded lengths that requests are sorted into, "
        "e.g. 32,64 (the sequence length is always one); default: every request padded to the sequence length",
    )
    parser.add_argument(
        "--metrics-flush-interval",
        type=float,
        help="seconds between the handler's hand-overs of its metrics to TorchServe; 0: at every event (default: 1)",
    )
    parser.add_argument(
        "--worker-pump",
        choices=("lean", "torchserve"),
        help="async handlers: the project's lean message pump for TorchServe's async worker, or TorchServe's own "
        "(default: lean)",
    )
    parser.add_argument(
        "--encode-answers",
        choices=("engine", "loop"),
        help="async handlers: encode each answer where its batch ends (on CPU, the lane, before its next job) or "
        "on the event loop (default: engine on CPU, loop on CUDA)",
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="the plain handler on a GPU: replay captured CUDA graphs, one per power-of-two batch up to --batch-size",
    )
    parser.add_argument("--force", action="store_true", help="rebuild archives that already exist")


def run(args: argparse.Namespace) -> int:
    def split(value: str | None) -> list[str] | None:
        return [v.strip() for v in value.split(",") if v.strip()] if value else None

    specs = select(split(args.models), split(args.modes), ci=args.ci and not args.all)
    try:
        options = ServingOptions(
            batch_size=args.batch_size,
            max_batch_delay_ms=args.max_batch_delay,
            handler=args.handler,
            handler_settings=tuple(sorted(args.handler_config.items())),
            decode_threads=args.decode_threads,
            metrics_flush_interval_s=args.metrics_flush_interval,
            token_lengths=args.token_lengths,
            worker_pump=args.worker_pump,
            encode_answers=args.encode_answers,
            cuda_graphs=args.cuda_graphs,
        )
    except (ValueError, AttributeError) as exc:
        print(
            "error: bad --handler/--handler-config/--decode-threads/--metrics-flush-interval/--token-lengths/"
            f"--worker-pump/--encode-answers/--cuda-graphs: {exc}",
            file=sys.stderr,
        )
        return 2
    try:
        if HANDLERS[options.handler].group:  # one archive, every model: eager unless modes were named
            group = specs if args.modes else [s for s in specs if s.mode == "eager"]
            paths = [build_group_archive(group, args.out, options, args.force)]
        else:
            paths = build_many(specs, args.out, options, args.force)
        for path in paths:
            print(path)
    except ValueError as exc:  # an option that does not fit a model (token_lengths for an image model, ...)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model_store.build", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
