"""Packrat end to end: the fat instance vs Packrat's plan, inside a real TorchServe.

    python -m bench.packrat_e2e --model resnet50 --batches 2,8,16 --json out.json

The measurement is the product's (``packrat_plugin.compare``, also ``packrat
bench``): one TorchServe, the same archive served as the fat instance
⟨1, T, B⟩ and as Packrat's uniform plan, interleaved (ABBA) under a closed
loop of B requests in flight with real client payloads.  This script adds the
markdown table, the plot and the provenance under docs/benchmarks/.

    python -m bench.packrat_e2e --model resnet50 --mixed --batches 3,5,7

compares the optimizer's exact plan where it is mixed (served by
``handlers/mixed_plan/handler.py``) with the fat instance and the best uniform plan
(``packrat_plugin.compare.compare_mixed_plans``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import (
    add_output_arguments,
    markdown_table,
    packrat_row_cells,
    provenance,
    provenance_block,
    publish,
    ratio_cell,
    speedup_bars,
)
from packrat_plugin.compare import run_from_args
from packrat_plugin.plan_types import format_instances


def plot(data: dict, path: Path) -> None:
    speedup_bars(
        data["rows"],
        [
            ("latency (median, min-max)", "latency_speedup"),
            ("throughput", "throughput_speedup"),
            ("predicted (model + handler)", "expected_speedup"),
            ("predicted (model only)", "expected_speedup_model_only"),
        ],  # fmt: skip
        "requests in flight B",
        f"speedup over ⟨1,{data['threads']},B⟩",
        f"Packrat in TorchServe: {data['model']} ({data['mode']})",
        path,
    )


def render(data: dict, args: argparse.Namespace, stem: str) -> str:
    T = data["threads"]
    header = ["B", "Packrat plan", "fat ms", "Packrat ms", "latency speedup (min-max)", "throughput speedup",
              "predicted (model + handler)", "predicted ÷ measured", "predicted (model only)",
              "requests (failed)"]  # fmt: skip
    rows = []
    for r in data["rows"]:
        predicted, measured = r["expected_speedup"], r["latency_speedup"]
        off = "-" if predicted is None else f"{predicted / measured:.2f}"
        rows.append([
            *packrat_row_cells(r)[:-1], ratio_cell(predicted), off, ratio_cell(r["expected_speedup_model_only"]),
            f"{r['requests']} ({r['failed']})",
        ])  # fmt: skip
    served_header = ["B", "system", "client mean ms", "worker round ms", "mean batch", "model ms per round",
                     "profiled ms (same batch)", "model ÷ profiled", "handler ms per request"]  # fmt: skip
    served_rows = []
    for r in data["rows"]:
        for name, label in (("fat", f"fat ⟨1,{T},{r['batch']}⟩"), ("packrat", format_instances(r["plan"]))):
            s = r["served"][name]
            if s is None:
                continue
            served_rows.append([
                r["batch"], label, f"{r[f'{name}_latency_ms']:.1f}", f"{s['round_ms']:.1f}", f"{s['mean_batch']:.2f}",
                f"{s['model_ms']:.1f}", f"{s['profiled_ms']:.1f}", f"{s['model_ms'] / s['profiled_ms']:.2f}",
                f"{s['handler_ms']:.1f}",
            ])  # fmt: skip
    handler = data["rows"][0]["handler_ms_per_request"] if data["rows"] else 0.0
    return (
        f"# Packrat end to end in TorchServe: {data['model']} ({data['mode']}), T={T}\n\n"
        f"Fat instance ⟨1,{T},B⟩ vs Packrat's uniform plan, both served by one real TorchServe, "
        f"closed-loop load of B requests in flight, {args.repeats} interleaved {args.seconds:g} s windows each. "
        f"Profile: `{data['profile']}`; the handler's per-request cost it measured (decode, collate, encode): "
        f"{handler:.1f} ms. Plans are chosen with it, and 'predicted (model + handler)' includes it; "
        f"'predicted (model only)' is the same plan on the forward-pass profile alone.\n\n"
        f"{markdown_table(header, rows)}\n\nMean latency speedup: **{data['mean_latency_speedup']:.2f}×**\n\n"
        f"Where the time went, from each worker's own counters over the timed windows (per round of a worker: "
        f"the whole `handle()` and the forward pass; 'profiled' is the profile's time at the mean batch the "
        f"worker formed; the client's mean minus the round is the frontend, the wait for a round and the "
        f"network):\n\n{markdown_table(served_header, served_rows)}\n\n"
        f"![speedups]({stem}.png)\n\n{provenance_block(data['provenance'])}"
    )


def run_mixed(args: argparse.Namespace) -> dict:
    from archiver.build import build_archive
    from model_store import ARCHIVE_DIR
    from model_store.catalog import get_spec
    from model_store.samples import client_payload
    from packrat_plugin.compare import ComparisonConfig, compare_mixed_plans
    from packrat_plugin.profiler import parse_int_list, profile_for_this_machine

    spec = get_spec(args.model, args.mode)
    profile, profile_path = profile_for_this_machine(spec.name, args.profile, args.force, args.mode)
    archive = build_archive(spec, ARCHIVE_DIR)
    payloads = [client_payload(spec, seed=i) for i in range(32)]
    config = ComparisonConfig(tuple(parse_int_list(args.batches)), args.seconds, args.warmup_seconds, args.repeats,
                              args.max_batch_delay)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="packrat-mixed-") as tmp:
        data = compare_mixed_plans(archive, profile, lambda n: payloads[n % len(payloads)], Path(tmp), config)
    return {**data, "mode": spec.mode, "profile": str(profile_path)}


def render_mixed(data: dict, args: argparse.Namespace, stem: str) -> str:
    T = data["threads"]
    header = ["B", "mixed plan", "best uniform", "fat ms", "uniform ms", "mixed ms", "fat ÷ mixed (min-max)",
              "uniform ÷ mixed (min-max)", "predicted ms (fat / uniform / mixed)", "requests (failed)"]  # fmt: skip

    def ratio(r: dict, name: str) -> str:
        if f"{name}_over_mixed" not in r:
            return "-"
        return f"{r[f'{name}_over_mixed']:.2f} ({r[f'{name}_over_mixed_min']:.2f}-{r[f'{name}_over_mixed_max']:.2f})"

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    rows = []
    for r in data["rows"]:
        if r["mixed_plan"] is None:
            rows.append([r["batch"], "-", "-", "-", "-", "-", "-", "-", r["note"], "-"])
            continue
        p = r["predicted_ms"]
        uniform = format_instances(r["uniform_plan"]) if r["uniform_plan"] else "the fat one (no other)"
        rows.append([
            r["batch"], format_instances(r["mixed_plan"]), uniform, ms(r["fat_latency_ms"]),
            ms(r.get("uniform_latency_ms")), ms(r["mixed_latency_ms"]), ratio(r, "fat"), ratio(r, "uniform"),
            f"{ms(p['fat'])} / {ms(p['uniform'])} / {ms(p['mixed'])}", f"{r['requests']} ({r['failed']})",
        ])  # fmt: skip
    return (
        f"# Packrat's mixed plans in TorchServe: {data['model']} ({data['mode']}), T={T}\n\n"
        f"At each B, the fat instance ⟨1,{T},B⟩, the best uniform plan (when the profile has one other than the fat "
        f"instance) and the optimizer's exact, mixed plan (one worker, one pinned lane per instance), served by one "
        f"real TorchServe, taking turns under a closed loop of B requests in flight, {args.repeats} interleaved "
        f"{args.seconds:g} s windows each; medians, ratios paired per window (above 1: mixed is faster). "
        f"Profile: `{data['profile']}`.\n\n{markdown_table(header, rows)}\n\n"
        f"![latency]({stem}.png)\n\n{provenance_block(data['provenance'])}"
    )


def plot_mixed(data: dict, path: Path) -> None:
    from bench.report import new_figure, save_figure

    rows = [r for r in data["rows"] if r["mixed_plan"] is not None]
    fig, ax = new_figure()
    xs = [str(r["batch"]) for r in rows]
    for i, (name, label) in enumerate((("fat", "fat"), ("uniform", "best uniform"), ("mixed", "mixed (exact)"))):
        values = [r.get(f"{name}_latency_ms") or 0.0 for r in rows]
        ax.bar([j + 0.27 * (i - 1) for j in range(len(rows))], values, 0.27, label=label)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(xs)
    save_figure(fig, ax, path, "requests in flight B", "mean latency (ms)", f"mixed plans: {data['model']}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="resnet50", help="catalog name")
    parser.add_argument("--archive", type=Path,
                        help="an archive instead of a catalog model: yours, from torch-model-archiver, or one that "
                             "`packrat archive` built (then --model and --mode do not apply)")  # fmt: skip
    parser.add_argument(
        "--sample",
        action="append",
        default=[],
        metavar="FILE",
        help="with --archive: a request body the archive's handler accepts (repeatable, or a folder)",
    )
    parser.add_argument("--mode", default="script", choices=("eager", "script", "compile"))
    parser.add_argument("--profile", type=Path, help="default: profiles/<model>.json")
    parser.add_argument("--batches", default="2,4,8,16")
    parser.add_argument("--seconds", type=float, default=8.0, help="one load window")
    parser.add_argument("--warmup-seconds", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--max-batch-delay", type=int, default=5, help="TorchServe max_batch_delay (ms)")
    parser.add_argument("--force", action="store_true", help="use a profile from other hardware")
    parser.add_argument("--mixed", action="store_true",
                        help="compare the optimizer's exact (mixed) plan against the fat instance and the best uniform "
                             "plan at each B instead (B where the exact plan is mixed: on 2 cores, odd B)")  # fmt: skip
    add_output_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    prov = provenance("bench.packrat_e2e")
    if args.mixed:
        data = run_mixed(args)
        data["provenance"] = prov
        stem = f"packrat_e2e_mixed_{data['model']}"
        print(publish(stem, data, lambda d: render_mixed(d, args, stem), plot_mixed, args.out_dir, args.json))
        return 0 if all(r.get("failed", 0) == 0 for r in data["rows"]) else 1
    data = run_from_args(args)
    data["provenance"] = prov
    stem = f"packrat_e2e_{data['model']}"
    print(publish(stem, data, lambda d: render(d, args, stem), plot, args.out_dir, args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
