"""Packrat end to end: the fat instance vs Packrat's plan, inside a real TorchServe.

    python -m bench.packrat_e2e --model resnet50 --batches 2,8,16 --json out.json

One TorchServe serves the same archive under two names: ``fat``, deployed as
the fat configuration ⟨1, T, B⟩ (one worker, T threads, batch_size B), and
``packrat``, deployed as the optimizer's uniform plan for B (what one
TorchServe version can hold).  Both are pinned by Packrat's worker mixin and
deployed by the same active/passive swapper the controller uses, so moving to
the next B is itself a live swap.  For each B the two names take turns
(ABBA) under the same closed-loop load of exactly B requests in flight, with
real client payloads: JPEG images, decoded, resized and normalised in the
handler, for vision models; token ids for text models.  Speedups are medians
over the repeats; the expected speedup is the profile's L[T][B] / plan latency.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import (
    PACKRAT_ROW_HEADER,
    add_output_arguments,
    markdown_table,
    median_and_spread,
    packrat_row_cells,
    provenance,
    provenance_block,
    publish,
    speedup_bars,
)
from model_store.build import ARCHIVE_DIR, build_archive
from model_store.catalog import get_spec
from model_store.samples import client_payload
from packrat_plugin.loadgen import closed_loop, run
from packrat_plugin.optimizer import KnapsackOptimizer, expected_speedup
from packrat_plugin.plan_types import Plan, PlanItem
from packrat_plugin.plans import PLAN_DIR_ENV, PlanStore
from packrat_plugin.profiler import parse_int_list, profile_for_this_machine
from packrat_plugin.swapper import ActivePassiveSwapper, SwapperConfig
from packrat_plugin.topology import CpuTopology
from packrat_plugin.torchserve import TorchServeProcess


def fat_plan(threads: int, batch: int) -> Plan:
    return Plan(threads, batch, float("nan"), (PlanItem(1, threads, batch),))


def run_e2e(args: argparse.Namespace, workdir: Path) -> dict:
    spec = get_spec(args.model, args.mode)
    profile, _ = profile_for_this_machine(args.model, args.profile, args.force, args.mode)
    topology = CpuTopology.from_system()
    T = len(topology.cores)
    optimizer = KnapsackOptimizer(profile)
    archive = build_archive(spec, ARCHIVE_DIR)
    store_dir, plans = workdir / "model_store", PlanStore(workdir / "plans")
    payloads = [client_payload(spec, seed=i) for i in range(32)]
    rows = []
    with TorchServeProcess(workdir / "ts", store_dir, env={PLAN_DIR_ENV: str(plans.root)}) as server:
        management = server.management()
        swappers = {}
        for name in ("fat", "packrat"):
            config = SwapperConfig(max_batch_delay_ms=args.max_batch_delay)
            swappers[name] = ActivePassiveSwapper(management, plans, name, archive, store_dir, topology, config)
        for B in tqdm(parse_int_list(args.batches), desc=f"e2e {args.model}", unit="B"):
            deployed = {"fat": fat_plan(T, B), "packrat": optimizer.plan(T, B, uniform=True)}
            for name, plan in deployed.items():
                swappers[name].apply(plan)
            urls = {name: f"{server.inference_url}/predictions/{name}" for name in deployed}

            def load(name: str, seconds: float, B=B, urls=urls):
                return run(closed_loop(urls[name], lambda n: payloads[n % len(payloads)], B, seconds))

            for name in deployed:  # warm both: first batches pay allocator and cache misses
                load(name, args.warmup_seconds)
            results: dict[str, list] = {"fat": [], "packrat": []}
            for r in range(args.repeats):
                for name in ("fat", "packrat") if r % 2 == 0 else ("packrat", "fat"):
                    results[name].append(load(name, args.seconds))
            failed = sum(res.failed for rs in results.values() for res in rs)
            lat = [
                f.mean_latency_ms() / p.mean_latency_ms()
                for f, p in zip(results["fat"], results["packrat"], strict=True)
            ]
            tput = [p.throughput() / f.throughput() for f, p in zip(results["fat"], results["packrat"], strict=True)]
            med, lo, hi = median_and_spread(lat)
            rows.append(
                {
                    "batch": B,
                    "plan": [i.to_dict() for i in deployed["packrat"].instances],
                    "fat_latency_ms": statistics.median(r.mean_latency_ms() for r in results["fat"]),
                    "packrat_latency_ms": statistics.median(r.mean_latency_ms() for r in results["packrat"]),
                    "latency_speedup": med,
                    "latency_speedup_min": lo,
                    "latency_speedup_max": hi,
                    "throughput_speedup": statistics.median(tput),
                    "expected_speedup": expected_speedup(profile, deployed["packrat"]),
                    "requests": sum(len(res.samples) for rs in results.values() for res in rs),
                    "failed": failed,
                }
            )
    return {
        "model": spec.name,
        "mode": spec.mode,
        "threads": T,
        "rows": rows,
        "mean_latency_speedup": statistics.fmean(r["latency_speedup"] for r in rows),
    }


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
    with tempfile.TemporaryDirectory(prefix="packrat-e2e-") as tmp:
        data = run_e2e(args, Path(tmp))
    data["provenance"] = prov
    stem = f"packrat_e2e_{data['model']}"
    print(publish(stem, data, lambda d: render(d, args, stem), plot, args.out_dir, args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
