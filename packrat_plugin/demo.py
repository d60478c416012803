"""``packrat demo``: Packrat end to end, in a few minutes on a small machine.

Default (the README's ``make demo``): build the model's archive, take its
committed profile if it was measured on this hardware (else profile it
briefly), start TorchServe under the Packrat controller, drive a load step
(1 → 8 requests in flight), and print the plan before and after, the swap,
every request's outcome, and the measured speedup of the plan it ended on over the
plan it started on at the high load, measured side by side with an A/A
twin; it exits 0 when the controller ended on the plan that served the high
load better, or the two are within the A/A band.

``--catalog``: build one archive per catalog model, serve them all with the
repo's ``config.properties`` and send each a few real requests.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from archiver.build import build_many, select
from archiver.names import catalog_name
from model_store import ARCHIVE_DIR
from model_store.catalog import get_spec
from model_store.samples import client_payload
from packrat_plugin.compare import PairedRatio
from packrat_plugin.plan_types import Plan, format_instances
from serving_harness.torchserve import Ports, TorchServeProcess

DEMO_DIR = Path("logs/demo")


@dataclass
class ModelResult:
    model: str
    mode: str
    statuses: list[int]
    latencies_ms: list[float]
    top1: int | None

    def row(self) -> str:
        ok = sum(s == 200 for s in self.statuses)
        median = statistics.median(self.latencies_ms) if self.latencies_ms else float("nan")
        top1 = "-" if self.top1 is None else str(self.top1)
        return f"{self.model:<14} {self.mode:<8} {ok:>3}/{len(self.statuses):<3} {median:>10.1f} {top1:>6}"


def run_demo(models: list[str] | None, mode: str, requests: int, ports: Ports) -> list[ModelResult]:
    specs = select(models, [mode], ci=False)
    archives = build_many(specs, ARCHIVE_DIR)
    results = []
    with TorchServeProcess(DEMO_DIR, ARCHIVE_DIR, ports=ports) as server:
        print(f"TorchServe up: inference {server.inference_url}, management {server.management_url}")
        management, inference = server.management(), server.inference()
        for path in tqdm(archives, desc="serving", unit="model"):
            name = path.stem
            spec = get_spec(catalog_name(name), mode)
            management.register(path.name, model_name=name, initial_workers=1)
            answers = [inference.predict(name, client_payload(spec, seed=i)) for i in range(requests)]
            top1 = answers[-1].body["top5"][0]["index"] if answers[-1].ok else None
            results.append(
                ModelResult(spec.name, mode, [a.status for a in answers], [a.latency_s * 1e3 for a in answers], top1)
            )
            management.unregister(name)  # keep memory flat on small machines
    return results


def packrat_demo(args: argparse.Namespace) -> int:
    from packrat_plugin.controller import PackratController
    from packrat_plugin.model_control import ControllerConfig, ModelTarget
    from packrat_plugin.profiler import profile_for_this_machine
    from packrat_plugin.serve_admin import format_status
    from serving_harness.loadgen import closed_loop, run

    spec = get_spec(args.model, "script")
    (archive,) = build_many([spec], ARCHIVE_DIR)
    profile, profile_path = profile_for_this_machine(spec.name)
    print(f"using the profile {profile_path} (measured on this hardware)")
    payloads = [client_payload(spec, seed=i) for i in range(16)]
    ports = Ports.free() if args.free_ports else Ports.default()
    controller = PackratController(DEMO_DIR / "packrat", [ModelTarget(spec.name, archive, profile)], ControllerConfig(),
                                   ports=ports, status_port=None)  # fmt: skip
    with controller:
        model = controller.models[spec.name]
        start_level = model.level
        url = f"{controller.server.inference_url}/predictions/{spec.name}"
        print(f"\nPackrat is serving {spec.name} at {url}\n" + format_status(controller.status()))
        print(f"\nload step: 1 request in flight for {args.low_seconds:g} s, "
              f"then {args.high} for {args.high_seconds:g} s")  # fmt: skip
        low = run(closed_loop(url, lambda n: payloads[n % 16], 1, args.low_seconds))
        high = run(closed_loop(url, lambda n: payloads[n % 16], args.high, args.high_seconds))
        if not model.wait_for_swap():
            print("a swap was still under way 300 s after the load ended")
            return 1
        print(format_status(controller.status()))
        swaps = [s for s in model.swaps if s.kind != "initial"]
        decisions = list(model.decisions)
        end_level = model.level
        # Had it not moved: the level the controller's own model calls best for this many in flight.
        alternative = model.policy.best_closed_loop(args.high)
    assert start_level is not None and end_level is not None
    requests = len(low.samples) + len(high.samples)
    failed = low.failed + high.failed
    print(f"\nrequests: {requests}, failed: {failed}; mean latency {low.mean_latency_ms():.0f} ms at 1 in flight, "
          f"{high.mean_latency_ms():.0f} ms at {args.high}")  # fmt: skip
    for s in swaps:
        print(
            f"reconfiguration: {s.kind} {format_instances(s.before)} → {format_instances(s.after)}"
            f"{' (warm)' if s.warm else ''}: new plan serving after {s.serving_after_s:.2f} s, "
            f"old version retired after {s.seconds:.2f} s"
        )
    for d in decisions:  # why each move was made, in the policy's words
        print(f"  decided: {d['reason']} → B={d['target_batch']} at {d['rate']:.1f} req/s measured")
    moved = end_level.plan.instances != start_level.plan.instances
    other = end_level if moved else alternative
    if other.plan.instances == start_level.plan.instances:
        print(f"\nPackrat's model calls its starting plan the best at {args.high} in flight too: nothing to measure")
        return 0 if failed == 0 else 1
    a, b = (format_instances([i.to_dict() for i in lv.plan.instances]) for lv in (start_level, other))
    print(f"\nmeasuring {a} against {b} at {args.high} in flight (interleaved, one TorchServe, {a} twice for A/A)")
    with tempfile.TemporaryDirectory(prefix="packrat-demo-") as tmp:
        verdict = measure_the_move(archive, start_level.plan, other.plan, lambda n: payloads[n % 16], args.high,
                                   moved, Path(tmp))  # fmt: skip
    print(verdict.describe(args.high))
    return 0 if failed == 0 and verdict.ok else 1


@dataclass(frozen=True)
class MoveVerdict:
    """The starting plan against the one Packrat ended on (or would have moved to), measured side by side."""

    start: str
    end: str
    moved: bool
    ratio: PairedRatio  # start ÷ end mean latency per repeat: above 1, ``end`` served the load better
    twin: PairedRatio  # start ÷ start: the A/A band
    start_ms: float
    end_ms: float
    failed: int

    @property
    def within_band(self) -> bool:
        return self.twin.low <= self.ratio.median <= self.twin.high

    @property
    def better(self) -> str:
        return self.end if self.ratio.median > 1.0 else self.start

    @property
    def ok(self) -> bool:
        """Nothing failed, and Packrat ended on the plan that served the load better (or the two are level)."""
        return self.failed == 0 and (self.within_band or (self.ratio.median > 1.0) == self.moved)

    def describe(self, in_flight: int) -> str:
        a, b = self.start, self.end
        lines = [f"{a}: {self.start_ms:.0f} ms, {b}: {self.end_ms:.0f} ms mean latency; {a} ÷ {b} = "
                 f"{self.ratio.describe()}, A/A {a} ÷ {a} = {self.twin.describe()}; {self.failed} failed"]  # fmt: skip
        if self.within_band:
            lines.append("the two are within this run's A/A band: either plan is as good here")
        elif self.moved:
            lines.append(f"Packrat moved to {b}; {self.better} served {in_flight} in flight better "
                         f"({'as it predicted' if self.better == b else 'it moved to the worse one'})")  # fmt: skip
        else:
            lines.append(f"Packrat stayed on {a}; {self.better} served {in_flight} in flight better "
                         f"({'as it judged' if self.better == a else 'it should have moved'})")  # fmt: skip
        return "\n".join(lines)


def measure_the_move(archive: Path, start: Plan, end: Plan, payload: Callable[[int], Any], in_flight: int,
                     moved: bool, workdir: Path, seconds: float = 5.0,
                     warmup_seconds: float = 2.0) -> MoveVerdict:  # fmt: skip
    """Measure the starting plan against ``end`` (where Packrat moved, or where its model says it would
    have) at ``in_flight``: interleaved in one TorchServe, the starting plan served twice for the A/A band;
    three rounds of ``seconds`` per plan, after ``warmup_seconds`` each."""
    from packrat_plugin.compare import ComparisonConfig, compare_plans, paired_ratio

    a, b = (format_instances([i.to_dict() for i in plan.instances]) for plan in (start, end))
    config = ComparisonConfig(batches=(in_flight,), seconds=seconds, warmup_seconds=warmup_seconds, repeats=3)
    results = compare_plans(archive, {"start": start, "end": end, "start_twin": start}, payload, workdir, in_flight,
                            config)  # fmt: skip
    return MoveVerdict(
        a, b, moved,
        paired_ratio(results["start"], results["end"]), paired_ratio(results["start"], results["start_twin"]),
        statistics.median(r.mean_latency_ms() for r in results["start"]),
        statistics.median(r.mean_latency_ms() for r in results["end"]),
        sum(r.failed for rs in results.values() for r in rs),
    )  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--catalog", action="store_true", help="serve every catalog model instead")
    parser.add_argument("--model", default="resnet50", help="Packrat demo model")
    parser.add_argument("--high", type=int, default=8, help="requests in flight after the step")
    parser.add_argument("--low-seconds", type=float, default=8.0)
    parser.add_argument("--high-seconds", type=float, default=20.0)
    parser.add_argument("--models", help="--catalog: comma-separated catalog names (default: every model)")
    parser.add_argument("--mode", default="script", choices=("eager", "script", "compile"))
    parser.add_argument("--requests", type=int, default=5, help="requests per model")
    parser.add_argument("--free-ports", action="store_true", help="use free ports instead of 8080-8082")


def run(args: argparse.Namespace) -> int:
    if not args.catalog:
        return packrat_demo(args)
    models = [m.strip() for m in args.models.split(",")] if args.models else None
    ports = Ports.free() if args.free_ports else Ports.default()
    results = run_demo(models, args.mode, args.requests, ports)
    print(f"\n{'model':<14} {'mode':<8} {'ok':>7} {'median ms':>10} {'top-1':>6}")
    for result in results:
        print(result.row())
    failed = [r.model for r in results if any(s != 200 for s in r.statuses)]
    if failed:
        print(f"requests failed for: {', '.join(failed)}")
        return 1
    return 0
