"""Packrat end to end: the fat instance vs Packrat's plan, inside a real TorchServe.

    python -m bench.packrat_e2e --model resnet50 --batches 2,8,16 --json out.json

The measurement is the product's (``packrat_plugin.compare``, also ``packrat
bench``): one TorchServe, the same archive served as the fat instance
⟨1, T, B⟩ and as Packrat's uniform plan, interleaved (ABBA) under a closed
loop of B requests in flight with real client payloads.  This script adds the
markdown table, the plot and the provenance under docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import (
    PACKRAT_ROW_HEADER,
    add_output_arguments,
    markdown_table,
    packrat_row_cells,
    provenance,
    provenance_block,
    publish,
    speedup_bars,
)
from packrat_plugin.compare import run_from_args


def plot(data: dict, path: Path) -> None:
    speedup_bars(
        data["rows"],
        [
            ("latency (median, min-max)", "latency_speedup"),
            ("throughput", "throughput_speedup"),
            ("expected (profile)", "expected_speedup"),
        ],  # fmt: skip
        "requests in flight B",
        f"speedup over ⟨1,{data['threads']},B⟩",
        f"Packrat in TorchServe: {data['model']} ({data['mode']})",
        path,
    )


def render(data: dict, args: argparse.Namespace, stem: str) -> str:
    table = markdown_table(
        [*PACKRAT_ROW_HEADER, "requests (failed)"],
        [[*packrat_row_cells(r), f"{r['requests']} ({r['failed']})"] for r in data["rows"]],
    )
    return (
        f"# Packrat end to end in TorchServe: {data['model']} ({data['mode']}), T={data['threads']}\n\n"
        f"Fat instance ⟨1,{data['threads']},B⟩ vs Packrat's uniform plan, both served by one real TorchServe, "
        f"closed-loop load of B requests in flight, {args.repeats} interleaved {args.seconds:g} s windows each.\n\n"
        f"{table}\n\nMean latency speedup: **{data['mean_latency_speedup']:.2f}×**\n\n"
        f"![speedups]({stem}.png)\n\n{provenance_block(data['provenance'])}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="catalog name")
    parser.add_argument("--mode", default="script", choices=("eager", "script", "compile"))
    parser.add_argument("--profile", type=Path, help="default: profiles/<model>.json")
    parser.add_argument("--batches", default="2,4,8,16")
    parser.add_argument("--seconds", type=float, default=8.0, help="one load window")
    parser.add_argument("--warmup-seconds", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--max-batch-delay", type=int, default=5, help="TorchServe max_batch_delay (ms)")
    parser.add_argument("--force", action="store_true", help="use a profile from other hardware")
    add_output_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    prov = provenance("bench.packrat_e2e")
    data = run_from_args(args)
    data["provenance"] = prov
    stem = f"packrat_e2e_{data['model']}"
    print(publish(stem, data, lambda d: render(d, args, stem), plot, args.out_dir, args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
