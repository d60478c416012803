"""Where one fat worker stops being the better setting: fat vs one worker per core at constant loads.

    python bench/packrat_crossover.py --model resnet50 --rates 4,8,10,12,13

One TorchServe serves the model twice: ``fat`` (one worker, every core,
batch 1) and ``static`` (one pinned 1-thread worker per core, batch 1), the
two settings Packrat chooses between on a small machine.  At each open-loop
Poisson rate the two take turns (same arrival sequence).  Beside each
measured mean latency stands what Packrat's policy predicts for that setting
(``levels.Level``: an M/D/i queue over the profiled round time), calibrated
with what the workers' own counters measured in that run (the model's time
and the handler's time outside it), so the table shows how good the
queueing model is once the service time is known.

Beside the model's slowdown over its profile stands the workers' CPU time
over their forward passes as a share of their threads' wall time: the test
of whether the fat worker slows with the load because other processes take
its cores (a team of two stalls when either core is taken; a one-thread
worker only when its own is), the model of a load-dependent slowdown per
worker class (``docs/benchmarks/reading/packrat.md``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from archiver.build import build_archive
from bench.packrat_swap import static_plans
from bench.report import (
    add_model_arguments,
    add_output_arguments,
    markdown_table,
    new_figure,
    provenance,
    provenance_block,
    publish,
    save_figure,
)
from handlers.pinning.slots import PLAN_DIR_ENV, PlanStore
from model_store import ARCHIVE_DIR
from model_store.catalog import get_spec
from model_store.samples import client_payload
from packrat_plugin.calibration import Calibration
from packrat_plugin.levels import Level
from packrat_plugin.profiler import profile_for_this_machine
from packrat_plugin.swapper import ActivePassiveSwapper, SwapperConfig, version_name
from serving_harness.loadgen import open_loop, run
from serving_harness.topology import CpuTopology
from serving_harness.torchserve import TorchServeProcess


def parse_rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or min(rates) <= 0:
        raise SystemExit(f"--rates must be positive numbers, got {text!r}")
    return rates


def measure(args: argparse.Namespace, workdir: Path) -> dict:
    spec = get_spec(args.model, args.mode)
    profile, profile_path = profile_for_this_machine(spec.name, args.profile, args.force, args.mode)
    archive = build_archive(spec, ARCHIVE_DIR)
    payloads = [client_payload(spec, seed=i) for i in range(32)]
    topology = CpuTopology.from_system()
    threads = len(topology.cores)
    plans = PlanStore(workdir / "plans")
    rows = []
    with TorchServeProcess(workdir / "ts", workdir / "store", env={PLAN_DIR_ENV: str(plans.root)}) as server:
        management = server.management()
        settings = static_plans(threads)
        versions = {}
        for system, plan in settings.items():
            ActivePassiveSwapper(management, plans, system, archive, workdir / "store", topology,
                                 SwapperConfig()).apply(plan)  # fmt: skip
            versions[system] = version_name(plan.instances[0])
            url = f"{server.inference_url}/predictions/{system}"
            run(open_loop(url, lambda i: payloads[i % 32], [(args.warmup_seconds, 4.0)], seed=9))
        rates = parse_rates(args.rates)
        for k, rate in enumerate(tqdm(rates, desc="rates", unit="rate")):
            for system in settings if k % 2 == 0 else list(settings)[::-1]:
                url = f"{server.inference_url}/predictions/{system}"
                before = plans.service_totals(system, versions[system])
                result = run(open_loop(url, lambda i: payloads[i % 32], [(args.seconds, rate)], seed=int(rate * 100)))
                window = plans.service_totals(system, versions[system]) - before
                item = settings[system].instances[0]
                profiled = profile.latency(item.threads, 1)
                model_ms = window.model_s * 1e3 / max(1, window.batches)
                overhead_ms = (window.handler_s - window.model_s) * 1e3 / max(1, window.requests)
                calibration = Calibration(model_ms / profiled, overhead_ms, 1)
                level = Level(item.count, settings[system], ((1, profiled),), calibration)
                rows.append({
                    "rate": rate, "system": system, "requests": len(result.samples), "failed": result.failed,
                    "mean_ms": result.mean_latency_ms(), "p99_ms": result.percentile_ms(99),
                    "throughput": result.throughput(), "model_ms": model_ms, "overhead_ms": overhead_ms,
                    "predicted_ms": level.predicted_latency_s(rate) * 1e3, "slowdown": model_ms / profiled,
                    # The workers' CPU time over their forward passes, as a share of their threads' wall time:
                    # under 1 by the time other processes held their cores (None: no forward measured).
                    "cpu_share": window.model_cpu_s / (item.threads * window.model_s) if window.model_s > 0 else None,
                })  # fmt: skip
                time.sleep(1.0)
    return {"model": spec.name, "mode": spec.mode, "threads": threads, "rows": rows, "profile_path": str(profile_path)}


def plot(data: dict, path: Path) -> None:
    fig, ax = new_figure()
    for system, color in (("fat", "tab:blue"), ("static", "tab:orange")):
        rows = [r for r in data["rows"] if r["system"] == system]
        ax.plot([r["rate"] for r in rows], [r["mean_ms"] for r in rows], "o-", color=color, label=f"{system} measured")
        finite = [r for r in rows if r["predicted_ms"] != float("inf")]
        ax.plot([r["rate"] for r in finite], [r["predicted_ms"] for r in finite], "x--", color=color,
                label=f"{system} predicted (M/D/i, calibrated)")  # fmt: skip
    title = f"{data['model']}: one fat worker vs one worker per core, T={data['threads']}"
    save_figure(fig, ax, path, "offered load (req/s, Poisson)", "mean latency (ms)", title)


def render(data: dict, stem: str) -> str:
    def ms(x: float) -> str:
        return "∞" if x == float("inf") else f"{x:.0f}"

    table = markdown_table(
        ["req/s", "setting", "mean ms (measured)", "mean ms (predicted)", "p99 ms", "throughput", "model ms / batch",
         "model ÷ profile", "CPU in the model ÷ threads × its time", "handler ms outside the model / request",
         "requests (failed)"],
        [[f"{r['rate']:g}", r["system"], ms(r["mean_ms"]), ms(r["predicted_ms"]), ms(r["p99_ms"]),
          f"{r['throughput']:.1f}", f"{r['model_ms']:.1f}", f"{r['slowdown']:.2f}",
          "-" if r.get("cpu_share") is None else f"{r['cpu_share']:.2f}", f"{r['overhead_ms']:.1f}",
          f"{r['requests']} ({r['failed']})"] for r in data["rows"]],
    )  # fmt: skip
    T = data["threads"]
    return (
        f"# One fat worker or one worker per core: {data['model']} ({data['mode']}), T={T}\n\n"
        f"fat = ⟨1,{T},1⟩, static = ⟨{T},1,1⟩, both in one TorchServe, taking turns at each open-loop Poisson rate "
        f"(same arrivals). Predicted = Packrat's queueing model (M/D/i over the profiled round, "
        f"`packrat_plugin/policy.py`) calibrated with that run's own counters. *CPU in the model*: the workers' "
        f"CPU time over their forward passes ÷ their threads × the passes' wall time, under 1 by the time other "
        f"processes held their cores. Profile: `{data['profile_path']}`.\n\n"
        f"{table}\n\n![crossover]({stem}.png)\n\n{provenance_block(data['provenance'])}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--rates", default="4,8,10,12,13", help="open-loop rates (req/s), comma-separated")
    parser.add_argument("--seconds", type=float, default=20.0, help="one run")
    parser.add_argument("--warmup-seconds", type=float, default=5.0)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    prov = provenance("bench.packrat_crossover")
    with tempfile.TemporaryDirectory(prefix="packrat-crossover-") as tmp:
        data = measure(args, Path(tmp))
    data["provenance"] = prov
    stem = f"packrat_crossover_{data['model']}"
    print(publish(stem, data, lambda d: render(d, stem), plot, args.out_dir, args.json))
    return 0 if all(r["failed"] == 0 for r in data["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
