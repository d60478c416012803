"""The ``packrat`` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import json
import sys
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
    s = sub.add_parser("status", help="print a running controller's state")
    serve.add_status_arguments(s)
    s.set_defaults(run=serve.run_status)
    t = sub.add_parser("stop", help="stop the TorchServe `packrat serve` started (with or without its controller)")
    serve.add_stop_arguments(t)
    t.set_defaults(run=serve.run_stop)
    g = sub.add_parser("oip-grpc", help="serve the Open Inference Protocol over gRPC in front of a running TorchServe")
    serve.add_oip_grpc_arguments(g)
    g.set_defaults(run=serve.run_oip_grpc)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="packrat", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _archive(sub)
    _sklearn_archive(sub)
    _sklearn_finetune(sub)
    _demo(sub)
    _bench(sub)
    _profile(sub)
    _segments(sub)
    _optimize(sub)
    _serve(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError) as exc:
        print(f"packrat {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
