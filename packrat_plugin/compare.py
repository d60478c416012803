"""The fat instance against Packrat's plan, both inside one real TorchServe.

This is the measurement behind ``packrat bench`` and ``packrat demo`` (and
``bench/packrat_e2e.py``, which adds tables and plots): one TorchServe serves
the same archive under two names, ``fat``, deployed as ⟨1, T, B⟩ (one worker,
T threads, batch_size B), and ``packrat``, deployed as the optimizer's
uniform plan for B (what one TorchServe version holds).  Both are pinned by
Packrat's worker mixin and deployed by the swapper the controller uses, so
moving to the next B is itself a live swap.  For each B the two names take
turns (ABBA) under the same closed-loop load of exactly B requests in flight,
with real client payloads (JPEG images for vision models, token ids for text
models).  Speedups are medians over the repeats, with their spread; the
expected speedup is the profile's L[T][B] / plan latency.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from handlers.pinning.slots import PLAN_DIR_ENV, PlanStore, ServiceTotals
from packrat_plugin.calibration import profiled_round_ms
from packrat_plugin.optimizer import InfeasibleError, KnapsackOptimizer, expected_speedup, serving_costs
from packrat_plugin.plan_types import Plan, PlanItem
from packrat_plugin.profile import Profile
from packrat_plugin.swapper import ActivePassiveSwapper, SwapperConfig
from serving_harness.loadgen import LoadResult, closed_loop, run
from serving_harness.topology import CpuTopology
from serving_harness.torchserve import Ports, TorchServeProcess


@dataclass(frozen=True)
class ComparisonConfig:
    batches: tuple[int, ...] = (2, 4, 8, 16)
    seconds: float = 8.0  # one load window
    warmup_seconds: float = 4.0
    repeats: int = 4  # windows per system, interleaved ABBA
    max_batch_delay_ms: int = 5

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batches must be positive integers, got {self.batches}")
        if self.seconds <= 0 or self.warmup_seconds < 0:
            raise ValueError("seconds must be > 0 and warmup_seconds ≥ 0")
        if self.repeats < 1:
            raise ValueError(f"repeats must be ≥ 1, got {self.repeats}")


def fat_plan(threads: int, batch: int) -> Plan:
    """TorchServe's default shape on T cores: one worker, every thread, batch B."""
    return Plan(threads, batch, float("nan"), (PlanItem(1, threads, batch),))


def median_and_spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def served_summary(served: ServiceTotals, plan: Plan, profile: Profile) -> dict[str, float] | None:
    """What the workers of a plan measured about themselves over some windows
    (their slot counters), beside what the profile says.

    ``model_ms``: the forward pass per round, against ``profiled_ms``, the
    profile's time for the mean batch a worker formed (interpolated over the
    profiled batch sizes of its thread count); ``handler_ms``: the rest of
    ``handle()`` per request (decode, collate, encode), which the profile's
    ``handler`` key predicts.  None when nothing was served.
    """
    if served.batches <= 0 or served.requests <= 0:
        return None
    item = max(plan.instances, key=lambda i: i.threads)  # the fat instance's, or a uniform plan's class
    mean_batch = served.requests / served.batches
    rounds = tuple((p.batch, p.latency_ms) for p in profile.points if p.threads == item.threads)
    return {
        "mean_batch": mean_batch,
        "model_ms": served.model_s * 1000.0 / served.batches,
        "profiled_ms": profiled_round_ms(rounds, mean_batch),
        "handler_ms": (served.handler_s - served.model_s) * 1000.0 / served.requests,
        "round_ms": served.handler_s * 1000.0 / served.batches,
    }


def _row(
    batch: int,
    plans: dict[str, Plan],
    optimizer: KnapsackOptimizer,
    results: dict[str, list[LoadResult]],
    served: dict[str, ServiceTotals],
) -> dict[str, Any]:
    """``optimizer``: the one the plan came from, with the profile's serving costs."""
    fat, packrat = results["fat"], results["packrat"]
    latency = [f.mean_latency_ms() / p.mean_latency_ms() for f, p in zip(fat, packrat, strict=True)]
    throughput = [p.throughput() / f.throughput() for f, p in zip(fat, packrat, strict=True)]
    med, lo, hi = median_and_spread(latency)
    plan, profile = plans["packrat"], optimizer.profile
    return {
        "batch": batch,
        "plan": [i.to_dict() for i in plan.instances],
        "fat_latency_ms": statistics.median(r.mean_latency_ms() for r in fat),
        "packrat_latency_ms": statistics.median(r.mean_latency_ms() for r in packrat),
        "latency_speedup": med,
        "latency_speedup_min": lo,
        "latency_speedup_max": hi,
        "throughput_speedup": statistics.median(throughput),
        # Predicted: with the handler's measured per-request cost (the plan was
        # chosen with it), and from the model's profile alone.
        "expected_speedup": expected_speedup(optimizer, plan),
        "expected_speedup_model_only": expected_speedup(KnapsackOptimizer(profile), plan),
        "handler_ms_per_request": optimizer.costs.overhead_ms,
        "served": {name: served_summary(served[name], plans[name], profile) for name in ("fat", "packrat")},
        "requests": sum(len(r.samples) for r in (*fat, *packrat)),
        "failed": sum(r.failed for r in (*fat, *packrat)),
    }


def compare_fat_and_plan(
    archive: Path,
    profile: Profile,
    payload: Callable[[int], Any],
    workdir: Path,
    config: ComparisonConfig = ComparisonConfig(),
    topology: CpuTopology | None = None,
    ports: Ports | None = None,
) -> dict[str, Any]:
    """Measure Packrat's uniform plan against the fat instance at each B.

    ``payload(n)`` is the body of the n-th request; ``workdir`` holds the
    TorchServe log, model store and plan files.  Returns plain data: one row
    per B (see ``_row``) and the mean latency speedup.
    """
    topology = topology or CpuTopology.from_system()
    T = len(topology.cores)
    optimizer = KnapsackOptimizer(profile, serving_costs(profile))
    plans = {B: {"fat": fat_plan(T, B), "packrat": optimizer.plan(T, B, uniform=True)} for B in config.batches}
    store_dir, plan_store = workdir / "model_store", PlanStore(workdir / "plans")
    rows = []
    env = {PLAN_DIR_ENV: str(plan_store.root)}
    with TorchServeProcess(workdir / "ts", store_dir, ports=ports, env=env) as server:
        management = server.management()
        swapper_config = SwapperConfig(max_batch_delay_ms=config.max_batch_delay_ms)
        swappers = {
            name: ActivePassiveSwapper(management, plan_store, name, archive, store_dir, topology, swapper_config)
            for name in ("fat", "packrat")
        }
        for B in tqdm(config.batches, desc=f"fat vs Packrat {profile.model}", unit="B"):
            for name, plan in plans[B].items():
                swappers[name].apply(plan)

            served = {"fat": ServiceTotals(), "packrat": ServiceTotals()}

            def load(name: str, seconds: float, B: int = B, count: bool = True, served: dict = served) -> LoadResult:
                url = f"{server.inference_url}/predictions/{name}"
                before = plan_store.service_totals(name, swappers[name].active)
                result = run(closed_loop(url, payload, B, seconds))
                if count:  # the workers' own counters over this window
                    served[name] += plan_store.service_totals(name, swappers[name].active) - before
                return result

            for name in ("fat", "packrat"):  # first batches pay allocator and cache misses
                load(name, config.warmup_seconds, count=False)
            results: dict[str, list[LoadResult]] = {"fat": [], "packrat": []}
            for r in range(config.repeats):
                for name in ("fat", "packrat") if r % 2 == 0 else ("packrat", "fat"):
                    results[name].append(load(name, config.seconds))
            rows.append(_row(B, plans[B], optimizer, results, served))
    return {
        "model": profile.model,
        "threads": T,
        "rows": rows,
        "mean_latency_speedup": statistics.fmean(r["latency_speedup"] for r in rows),
    }


@dataclass(frozen=True)
class PairedRatio:
    """``a``'s mean latency over ``b``'s, one ratio per interleaved repeat (above 1: ``b`` is faster)."""

    ratios: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def low(self) -> float:
        return min(self.ratios)

    @property
    def high(self) -> float:
        return max(self.ratios)

    def describe(self) -> str:
        return f"{self.median:.2f}× ({self.low:.2f}-{self.high:.2f})"


def paired_ratio(a: list[LoadResult], b: list[LoadResult]) -> PairedRatio:
    return PairedRatio(tuple(x.mean_latency_ms() / y.mean_latency_ms() for x, y in zip(a, b, strict=True)))


def compare_plans(
    archive: Path,
    plans: dict[str, Plan],
    payload: Callable[[int], Any],
    workdir: Path,
    in_flight: int,
    config: ComparisonConfig = ComparisonConfig(),
    topology: CpuTopology | None = None,
    ports: Ports | None = None,
) -> dict[str, list[LoadResult]]:
    """Serve each named plan as its own model in one TorchServe (pinned, deployed by the controller's
    swapper) and measure them in turn under a closed loop of ``in_flight`` requests: a warm-up window each,
    then ``config.repeats`` rounds, the order reversed every other round.  Name the same plan twice to get
    the A/A band the ratios are to be read against.  Returns each name's windows, in repeat order.
    """
    topology = topology or CpuTopology.from_system()
    store_dir, plan_store = workdir / "model_store", PlanStore(workdir / "plans")
    names = list(plans)
    results: dict[str, list[LoadResult]] = {name: [] for name in names}
    with TorchServeProcess(workdir / "ts", store_dir, ports=ports, env={PLAN_DIR_ENV: str(plan_store.root)}) as server:
        management = server.management()
        swapper_config = SwapperConfig(max_batch_delay_ms=config.max_batch_delay_ms)
        for name, plan in plans.items():
            ActivePassiveSwapper(management, plan_store, name, archive, store_dir, topology, swapper_config).apply(plan)

        def load(name: str, seconds: float) -> LoadResult:
            return run(closed_loop(f"{server.inference_url}/predictions/{name}", payload, in_flight, seconds))

        with tqdm(total=len(names) * (1 + config.repeats), desc=f"{in_flight} in flight", unit="window") as bar:
            for name in names:  # first batches pay allocator and cache misses
                load(name, config.warmup_seconds)
                bar.update()
            for r in range(config.repeats):
                for name in names if r % 2 == 0 else list(reversed(names)):
                    results[name].append(load(name, config.seconds))
                    bar.update()
    return results


def compare_mixed_plans(
    archive: Path,
    profile: Profile,
    payload: Callable[[int], Any],
    workdir: Path,
    config: ComparisonConfig = ComparisonConfig(),
    topology: CpuTopology | None = None,
    ports: Ports | None = None,
) -> dict[str, Any]:
    """At each B: the fat instance, the best uniform plan (if the profile has one) and the optimizer's
    exact plan when it is mixed, one TorchServe, taking turns under a closed loop of B in flight.

    A B whose exact plan is uniform has nothing to compare and gets a row
    saying so.  Ratios are paired per repeat (fat ÷ mixed, uniform ÷ mixed:
    above 1, the mixed plan is faster).
    """
    topology = topology or CpuTopology.from_system()
    T = len(topology.cores)
    optimizer = KnapsackOptimizer(profile, serving_costs(profile))
    store_dir, plan_store = workdir / "model_store", PlanStore(workdir / "plans")
    rows: list[dict[str, Any]] = []
    with TorchServeProcess(workdir / "ts", store_dir, ports=ports, env={PLAN_DIR_ENV: str(plan_store.root)}) as server:
        management = server.management()
        swapper_config = SwapperConfig(max_batch_delay_ms=config.max_batch_delay_ms)
        swappers: dict[str, ActivePassiveSwapper] = {}
        for B in tqdm(config.batches, desc=f"fat / uniform / mixed {profile.model}", unit="B"):
            try:
                exact = optimizer.plan(T, B)
            except InfeasibleError as exc:
                rows.append({"batch": B, "mixed_plan": None, "note": f"no plan: {exc}"})
                continue
            if exact.uniform:
                rows.append({"batch": B, "mixed_plan": None, "note": "the exact plan is uniform"})
                continue
            plans = {"fat": fat_plan(T, B), "mixed": exact}
            with contextlib.suppress(InfeasibleError):
                uniform = optimizer.plan(T, B, uniform=True)
                if uniform.instances != plans["fat"].instances:  # else the fat row is the best uniform
                    plans["uniform"] = uniform
            for name, plan in plans.items():
                if name not in swappers:
                    swappers[name] = ActivePassiveSwapper(management, plan_store, name, archive, store_dir, topology,
                                                          swapper_config)  # fmt: skip
                swappers[name].apply(plan)

            def load(name: str, seconds: float, B: int = B) -> LoadResult:
                return run(closed_loop(f"{server.inference_url}/predictions/{name}", payload, B, seconds))

            names = list(plans)
            for name in names:
                load(name, config.warmup_seconds)
            results: dict[str, list[LoadResult]] = {name: [] for name in names}
            for r in range(config.repeats):
                for name in names if r % 2 == 0 else reversed(names):
                    results[name].append(load(name, config.seconds))
            row: dict[str, Any] = {
                "batch": B,
                "mixed_plan": [i.to_dict() for i in exact.instances],
                "uniform_plan": [i.to_dict() for i in plans["uniform"].instances] if "uniform" in plans else None,
                "predicted_ms": {"mixed": exact.latency_ms, "uniform": plans["uniform"].latency_ms if "uniform" in plans
                                 else None, "fat": _predicted(optimizer, T, B)},
                "requests": sum(len(x.samples) for rs in results.values() for x in rs),
                "failed": sum(x.failed for rs in results.values() for x in rs),
            }  # fmt: skip
            for name in names:
                row[f"{name}_latency_ms"] = statistics.median(x.mean_latency_ms() for x in results[name])
                row[f"{name}_throughput"] = statistics.median(x.throughput() for x in results[name])
            for name in ("fat", "uniform"):
                if name in results:
                    ratios = [a.mean_latency_ms() / m.mean_latency_ms()
                              for a, m in zip(results[name], results["mixed"], strict=True)]  # fmt: skip
                    row[f"{name}_over_mixed"], row[f"{name}_over_mixed_min"], row[f"{name}_over_mixed_max"] = (
                        median_and_spread(ratios)
                    )
            rows.append(row)
    return {"model": profile.model, "threads": T, "rows": rows}


def _predicted(optimizer: KnapsackOptimizer, threads: int, batch: int) -> float | None:
    try:
        return optimizer.latency(threads, batch)
    except KeyError:
        return None


def format_rows(data: dict[str, Any]) -> str:
    """A plain-text table of ``compare_fat_and_plan``'s rows, for the terminal."""
    from packrat_plugin.plan_types import format_instances

    T = data["threads"]
    lines = [f"{'B':>3}  {'fat':<10} {'Packrat plan':<16} {'fat ms':>8} {'Packrat ms':>10} "
             f"{'latency ×':>16} {'throughput ×':>12} {'predicted ×':>11} {'failed':>6}"]  # fmt: skip
    for r in data["rows"]:
        spread = f"{r['latency_speedup']:.2f} ({r['latency_speedup_min']:.2f}-{r['latency_speedup_max']:.2f})"
        predicted = "-" if r["expected_speedup"] is None else f"{r['expected_speedup']:.2f}"
        fat = f"1×⟨{T},{r['batch']}⟩"
        lines.append(
            f"{r['batch']:>3}  {fat:<10} {format_instances(r['plan']):<16} "
            f"{r['fat_latency_ms']:>8.1f} {r['packrat_latency_ms']:>10.1f} {spread:>16} "
            f"{r['throughput_speedup']:>12.2f} {predicted:>11} {r['failed']:>6}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="resnet50", help="catalog name")
    parser.add_argument(
        "--archive",
        type=Path,
        help="an archive instead of a catalog model: yours, from torch-model-archiver, or one that "
        "`packrat archive` built (then --model and --mode do not apply)",
    )
    parser.add_argument(
        "--sample",
        action="append",
        default=[],
        metavar="FILE",
        help="with --archive: a request body the archive's handler accepts (repeatable, or a folder); sent in turn",
    )
    parser.add_argument("--mode", default="script", choices=("eager", "script", "compile"))
    parser.add_argument("--profile", type=Path, help="default: profiles/<model>.json, else a brief one")
    parser.add_argument("--batches", default="2,8", help="requests in flight, comma-separated")
    parser.add_argument("--seconds", type=float, default=6.0, help="one load window")
    parser.add_argument("--warmup-seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=2, help="windows per system, interleaved")
    parser.add_argument("--max-batch-delay", type=int, default=5, help="TorchServe max_batch_delay (ms)")
    parser.add_argument("--force", action="store_true", help="use a profile measured on other hardware")
    parser.add_argument("--json", type=Path, help="also write the result here")


def archive_payloads(archive: Path, samples: list[str]) -> tuple[str, list[Any]]:
    """The model name and the request bodies to send to ``archive``: the ``--sample`` files, or, for an
    archive `packrat archive` built, the client payloads its model description calls for."""
    from model_store.catalog import ModelSpec
    from model_store.samples import client_payload
    from packrat_plugin.foreign import read_archive, read_samples

    info = read_archive(archive)
    if samples:
        bodies = [json.loads(s.body) if s.content_type == "application/json" else s.body for s in read_samples(samples)]
        return info.model_name, bodies
    if not info.ours:
        raise ValueError(f"{archive} runs your own handler: pass --sample FILE, a request body it accepts")
    spec = ModelSpec.from_dict(info.config["handler"]["spec"])
    return info.model_name, [client_payload(spec, seed=i) for i in range(32)]


def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Build the archive (or take the one given), find a profile for this machine, compare; returns the data."""
    from archiver.build import build_archive
    from model_store import ARCHIVE_DIR
    from model_store.catalog import get_spec
    from model_store.samples import client_payload
    from packrat_plugin.profiler import parse_int_list, profile_for_this_machine

    if args.archive is not None:
        name, payloads = archive_payloads(args.archive, args.sample)
        profile, profile_path = profile_for_this_machine(name, args.profile, args.force, users_archive=args.archive)
        archive, mode = args.archive, "as archived"
    else:
        if args.sample:
            raise ValueError("--sample goes with --archive; a catalog model's requests are made for it")
        spec = get_spec(args.model, args.mode)
        profile, profile_path = profile_for_this_machine(spec.name, args.profile, args.force, args.mode)
        archive, mode = build_archive(spec, ARCHIVE_DIR), spec.mode
        payloads = [client_payload(spec, seed=i) for i in range(32)]
    config = ComparisonConfig(tuple(parse_int_list(args.batches)), args.seconds, args.warmup_seconds, args.repeats,
                              args.max_batch_delay)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="packrat-compare-") as tmp:
        data = compare_fat_and_plan(archive, profile, lambda n: payloads[n % len(payloads)], Path(tmp), config)
    return {**data, "mode": mode, "profile": str(profile_path)}


def run_cli(args: argparse.Namespace) -> int:
    try:
        data = run_from_args(args)
    except ValueError as exc:  # no archive, no sample, no profile for this machine: one line, no traceback
        print(f"packrat bench: error: {exc}", file=sys.stderr)
        return 2
    print(f"{data['model']} ({data['mode']}), T={data['threads']}, profile {data['profile']}\n" + format_rows(data))
    if args.json:
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0 if all(r["failed"] == 0 for r in data["rows"]) else 1
