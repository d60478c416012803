"""``packrat archive`` / ``python -m archiver``: catalog models into archives, from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from archiver.build import build_group_archive, build_many, select
from archiver.options import ServingOptions
from archiver.serialized import build_serialized_archive
from handlers.registry import ALIASES, HANDLERS
from model_store import ARCHIVE_DIR
from model_store.catalog import EXECUTION_MODES
from model_store.user_models import describe


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
    yours = parser.add_argument_group("your own model (instead of catalog models; archiver/serialized.py)")
    yours.add_argument(
        "--serialized-file",
        type=Path,
        help="a TorchScript file (torch.jit.save) or a torch.export program (torch.export.save)",
    )
    yours.add_argument("--name", help="the model's name (the archive is NAME.mar, or NAME-HANDLER.mar)")
    yours.add_argument("--input", help="what the model takes: image:CxHxW (e.g. image:3x224x224) or tokens:LENGTH")
    yours.add_argument("--vocab-size", type=int, help="token models: ids at or above it are refused with a 400")
    parser.add_argument("--modes", help=f"comma-separated modes from {','.join(EXECUTION_MODES)} (default: all)")
    parser.add_argument("--ci", action="store_true", help="only the catalog's CI-sized models")
    parser.add_argument("--all", action="store_true", help="every model in every mode")
    parser.add_argument("--out", type=Path, default=ARCHIVE_DIR, help="model store directory")
    parser.add_argument("--batch-size", type=int, default=ServingOptions.batch_size)
    parser.add_argument("--max-batch-delay", type=int, default=ServingOptions.max_batch_delay_ms)
    parser.add_argument(
        "--handler", choices=sorted([*HANDLERS, *ALIASES]), default="plain", help="handler to build with"
    )
    parser.add_argument(
        "--handler-config",
        type=json.loads,
        default={},
        help='the handler\'s settings as JSON, e.g. \'{"worker_batches": [1, 1, 2, 4], "max_inflight": 8}\'',
    )
    parser.add_argument(
        "--decode-threads",
        type=decode_threads_argument,
        help="async handlers: where requests are decoded: N threads, 0 inline on the event loop, 'lane' "
        "(between batches on the CPU lanes) or 'batched' (JPEGs in batches by torchvision's decoder, nvJPEG on "
        "CUDA) (default: 4 threads on CUDA, lane on CPU); the plain handler takes 'batched' alone (each batch's "
        "JPEGs in one decoder call)",
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

    yours = args.serialized_file is not None
    if yours and (args.models or args.modes or args.ci or args.all):
        print("error: --serialized-file archives your own model; --models/--modes/--ci/--all name catalog ones",
              file=sys.stderr)  # fmt: skip
        return 2
    if yours and not (args.name and args.input):
        print("error: --serialized-file needs --name NAME and --input image:CxHxW or tokens:LENGTH", file=sys.stderr)
        return 2
    specs = [] if yours else select(split(args.models), split(args.modes), ci=args.ci and not args.all)
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
        if yours:
            spec = describe(args.serialized_file, args.name, args.input, args.vocab_size)
            paths = [build_serialized_archive(args.serialized_file, spec, args.out, options, args.force)]
        elif options.kind.group:  # one archive, every model: eager unless modes were named
            group = specs if args.modes else [s for s in specs if s.mode == "eager"]
            paths = [build_group_archive(group, args.out, options, args.force)]
        else:
            paths = build_many(specs, args.out, options, args.force)
        for path in paths:
            print(path)
    except ValueError as exc:  # an option or a model that does not fit (token_lengths for an image model, ...)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m archiver", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
