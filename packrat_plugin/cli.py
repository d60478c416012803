"""The ``packrat`` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path


def _archive(sub: argparse._SubParsersAction) -> None:
    from archiver import cli as archive_cli

    p = sub.add_parser("archive", help="build TorchServe archives for catalog models")
    archive_cli.add_arguments(p)
    p.set_defaults(run=archive_cli.run)


def _sklearn_archive(sub: argparse._SubParsersAction) -> None:
    from windtunnel import archive

    p = sub.add_parser("sklearn-archive", help="build a TorchServe archive that serves a scikit-learn pipeline "
                                               "as a tensor program (WindTunnel)")  # fmt: skip
    archive.add_arguments(p)
    p.set_defaults(run=archive.run)


def _sklearn_finetune(sub: argparse._SubParsersAction) -> None:
    from windtunnel import tune_cli

    p = sub.add_parser("sklearn-finetune", help="fine-tune a scikit-learn pipeline's translation end to end on "
                                                "labelled CSV rows (WindTunnel)")  # fmt: skip
    tune_cli.add_arguments(p)
    p.set_defaults(run=tune_cli.run)


def _demo(sub: argparse._SubParsersAction) -> None:
    from packrat_plugin import demo

    p = sub.add_parser("demo", help="build archives, serve them with TorchServe, send real requests")
    demo.add_arguments(p)
    p.set_defaults(run=demo.run)


def _bench(sub: argparse._SubParsersAction) -> None:
    from packrat_plugin import compare

    p = sub.add_parser("bench", help="measure Packrat's plan against the fat instance inside a real TorchServe")
    compare.add_arguments(p)
    p.set_defaults(run=compare.run_cli)


def _profile(sub: argparse._SubParsersAction) -> None:
    from packrat_plugin import profiler

    p = sub.add_parser("profile", help="measure L[threads][batch] of a model into profiles/<model>.json")
    profiler.add_arguments(p)
    p.set_defaults(run=profiler.run)


def _segments(sub: argparse._SubParsersAction) -> None:
    from handlers.runtime import segment_profile

    p = sub.add_parser("segments", help="cut a model into time-balanced segments and time each (DVABatch, REEF)")
    segment_profile.add_arguments(p)
    p.set_defaults(run=segment_profile.run)


def _run_optimize(args: argparse.Namespace) -> int:
    from packrat_plugin.calibration import Calibration
    from packrat_plugin.optimizer import KnapsackOptimizer, serving_costs
    from packrat_plugin.profile import load_profile

    profile = load_profile(args.profile, force=args.force)
    costs = Calibration() if args.model_only else serving_costs(profile)
    plan = KnapsackOptimizer(profile, costs).plan(args.threads, args.batch, uniform=args.uniform)
    if args.json:
        print(json.dumps(plan.to_dict()))
    else:
        print(f"{profile.model}: T={args.threads}, B={args.batch}: {plan.describe()}")
    return 0


def _optimize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("optimize", help="latency-optimal instances/threads/batch for T cores and batch B")
    p.add_argument("--profile", required=True, type=Path, help="profile JSON from `packrat profile`")
    p.add_argument("--threads", "-T", required=True, type=int, help="cores to split")
    p.add_argument("--batch", "-B", required=True, type=int, help="batch size to serve")
    p.add_argument("--uniform", action="store_true", help="one (threads, batch) class, as one TorchServe version")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--force", action="store_true", help="use a profile measured on other hardware")
    p.add_argument("--model-only", action="store_true",
                   help="plan on the forward pass alone, without the handler's per-request cost the profile "
                        "measured (what a model runs outside TorchServe)")  # fmt: skip
    p.set_defaults(run=_run_optimize)


def _serve(sub: argparse._SubParsersAction) -> None:
    from packrat_plugin import serve

    p = sub.add_parser("serve", help="start TorchServe under the Packrat controller")
    serve.add_serve_arguments(p)
    p.set_defaults(run=serve.run_serve)
    g = sub.add_parser("oip-grpc", help="serve the Open Inference Protocol over gRPC in front of a running TorchServe")
    serve.add_oip_grpc_arguments(g)
    g.set_defaults(run=serve.run_oip_grpc)


def _serve_admin(sub: argparse._SubParsersAction) -> None:
    from packrat_plugin import serve_admin

    s = sub.add_parser("status", help="print a running controller's state")
    serve_admin.add_status_arguments(s)
    s.set_defaults(run=serve_admin.run_status)
    t = sub.add_parser("stop", help="stop the TorchServe `packrat serve` started (with or without its controller)")
    serve_admin.add_stop_arguments(t)
    t.set_defaults(run=serve_admin.run_stop)


# Every subcommand, by name, with the function that adds it (some add two).  A command line that names one
# builds only that one's parser: building them all imports every subcommand's module, torch among them,
# ~2.5 s before `packrat status` or `packrat stop` could run.
BUILDERS: dict[str, Callable[[argparse._SubParsersAction], None]] = {
    "archive": _archive,
    "sklearn-archive": _sklearn_archive,
    "sklearn-finetune": _sklearn_finetune,
    "demo": _demo,
    "bench": _bench,
    "profile": _profile,
    "segments": _segments,
    "optimize": _optimize,
    "serve": _serve,
    "oip-grpc": _serve,
    "status": _serve_admin,
    "stop": _serve_admin,
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or only of ``command``'s when it names one (see ``BUILDERS``)."""
    parser = argparse.ArgumentParser(prog="packrat", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    builders = [BUILDERS[command]] if command in BUILDERS else list(dict.fromkeys(BUILDERS.values()))
    for build in builders:
        build(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError) as exc:
        print(f"packrat {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
