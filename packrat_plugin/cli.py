"""The ``packrat`` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import sys


def _archive(sub: argparse._SubParsersAction) -> None:
    from model_store import build

    p = sub.add_parser("archive", help="build TorchServe archives for catalog models")
    build.add_arguments(p)
    p.set_defaults(run=build.run)


def _demo(sub: argparse._SubParsersAction) -> None:
    from packrat_plugin import demo

    p = sub.add_parser("demo", help="build archives, serve them with TorchServe, send real requests")
    demo.add_arguments(p)
    p.set_defaults(run=demo.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="packrat", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _archive(sub)
    _demo(sub)
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
