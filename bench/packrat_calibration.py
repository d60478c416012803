"""Per worker class: the profile's round time, the controller's calibrated one, and what TorchServe served.

    python -m bench.packrat_calibration --model resnet50                 # loads at 30 % and 60 %
    python -m bench.packrat_calibration --model resnet50 --loads 0.2,0.7

The controller decides with one calibration (``calibration.py``): learned on
the class it serves, applied to every class, the ones it has not served yet
included.  Whether that is good enough is a question about this machine, so
this bench asks it here: every class of the controller's levels (the same
credited profile, the same optimizer) is served through one TorchServe, pinned
as Packrat pins it, at two open-loop loads (fractions of the class's own
capacity by the profile), the classes taking turns at each load.  From each
run's worker counters (``handlers/pinning/slots.py``):

- *served*: the worker's time per round (``handle()`` per batch, decode and
  encode included) at the mean batch size it formed;
- *profile*: the profiled forward pass at that batch size plus the profile's
  own per-request handler cost, what the controller plans with before any
  serving;
- *calibrated*: the profiled round under the calibration learned from the
  first class's run at the first load (the class the controller starts on, at
  the load it starts under), what the controller predicts for every class
  before it has served it, the prediction a rise is decided on.

The last column is calibrated ÷ served, the issue's bound: within 15 %.
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
from packrat_plugin.batch_credit import credit_batches
from packrat_plugin.calibration import Calibration, profiled_round_ms, window_calibration
from packrat_plugin.levels import Level, levels_for
from packrat_plugin.optimizer import KnapsackOptimizer, serving_costs
from packrat_plugin.profiler import profile_for_this_machine
from packrat_plugin.swapper import ActivePassiveSwapper, SwapperConfig, version_name
from serving_harness.loadgen import open_loop, run
from serving_harness.topology import CpuTopology
from serving_harness.torchserve import TorchServeProcess

BOUND = 0.15  # calibrated within 15 % of served


def parse_fractions(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(0.0 < v < 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"expected fractions in (0, 1), comma-separated, got {text!r}")
    return values


def class_name(level: Level) -> str:
    item = level.plan.instances[0]
    return f"c{item.count}x{version_name(item)}"


def measure(args: argparse.Namespace, workdir: Path) -> dict:
    spec = get_spec(args.model, args.mode)
    profile, profile_path = profile_for_this_machine(spec.name, args.profile, args.force, args.mode)
    credited, _ = credit_batches(profile)
    prior = serving_costs(credited)
    optimizer = KnapsackOptimizer(credited, prior)
    topology = CpuTopology.from_system()
    threads = len(topology.cores)
    levels = [lv for lv in levels_for(optimizer, threads, threads * max(credited.batches)) if lv.plan.uniform]
    archive = build_archive(spec, ARCHIVE_DIR)
    payloads = [client_payload(spec, seed=i) for i in range(32)]
    plans = PlanStore(workdir / "plans")
    runs = []
    reference: Calibration | None = None
    with TorchServeProcess(workdir / "ts", workdir / "store", env={PLAN_DIR_ENV: str(plans.root)}) as server:
        management = server.management()
        for level in levels:
            name = class_name(level)
            ActivePassiveSwapper(management, plans, name, archive, workdir / "store", topology,
                                 SwapperConfig(max_batch_delay_ms=args.max_batch_delay)).apply(level.plan)  # fmt: skip
            url = f"{server.inference_url}/predictions/{name}"
            run(open_loop(url, lambda i: payloads[i % 32], [(args.warmup_seconds, 3.0)], seed=9))
        steps = [(f, lv) for k, f in enumerate(args.loads) for lv in (levels if k % 2 == 0 else levels[::-1])]
        for fraction, level in tqdm(steps, desc="loads × classes", unit="run"):
            name, item = class_name(level), level.plan.instances[0]
            version = version_name(item)
            rate = fraction * Level(level.batch, level.plan, level.rounds_ms, prior).capacity
            url = f"{server.inference_url}/predictions/{name}"
            before = plans.service_totals(name, version)
            result = run(open_loop(url, lambda i: payloads[i % 32], [(args.seconds, rate)], seed=int(rate * 100)))
            window = plans.service_totals(name, version) - before
            if window.batches == 0:
                raise SystemExit(f"{name} served no batch at {rate:.1f} req/s: the counters did not move")
            mean_batch = window.requests / window.batches
            if reference is None:  # the start class at the first load: what the controller carries to the others
                reference = window_calibration(window, level.rounds_ms)
            profiled = profiled_round_ms(level.rounds_ms, mean_batch)
            runs.append({
                "class": item.to_dict(), "name": name, "fraction": fraction, "rate": rate,
                "requests": len(result.samples), "failed": result.failed,
                "mean_ms": result.mean_latency_ms(), "mean_batch": mean_batch,
                "served_round_ms": window.handler_s * 1e3 / window.batches,
                "profile_round_ms": prior.round_ms(mean_batch, profiled),
                "calibrated_round_ms": reference.round_ms(mean_batch, profiled),
                "own": window_calibration(window, level.rounds_ms).to_dict(),
                "predicted_mean_ms": Level(level.batch, level.plan, level.rounds_ms, reference)
                .predicted_latency_s(rate) * 1e3,
            })  # fmt: skip
            time.sleep(1.0)
    return {
        "model": spec.name, "mode": spec.mode, "threads": threads, "runs": runs, "profile_path": str(profile_path),
        "reference": reference.to_dict() if reference else None, "prior": prior.to_dict(),
        "levels": [lv.plan.describe() for lv in levels], "loads": args.loads,
    }  # fmt: skip


def within(run_: dict) -> bool:
    return abs(run_["calibrated_round_ms"] / run_["served_round_ms"] - 1.0) <= BOUND


def plot(data: dict, path: Path) -> None:
    fig, ax = new_figure()
    names = list(dict.fromkeys(r["name"] for r in data["runs"]))
    for i, name in enumerate(names):
        rows = [r for r in data["runs"] if r["name"] == name]
        x = [i + 0.25 * j for j in range(len(rows))]
        ax.plot(x, [r["served_round_ms"] for r in rows], "o", color="tab:blue", label="served" if i == 0 else None)
        ax.plot(x, [r["calibrated_round_ms"] for r in rows], "x", color="tab:orange",
                label="calibrated" if i == 0 else None)  # fmt: skip
        ax.plot(x, [r["profile_round_ms"] for r in rows], "+", color="tab:gray", label="profile" if i == 0 else None)
    ax.set_xticks(range(len(names)), names)
    save_figure(fig, ax, path, "class (count × t<threads>b<batch>), two loads each", "round time (ms)",
                f"{data['model']}: round time per class, T={data['threads']}")  # fmt: skip


def render(data: dict, stem: str) -> str:
    def ms(x: float) -> str:
        return "∞" if x == float("inf") else f"{x:.0f}"

    rows = [[
        f"{r['class']['count']}×⟨{r['class']['threads']},{r['class']['batch']}⟩", f"{r['fraction']:.0%}",
        f"{r['rate']:.1f}", f"{r['mean_batch']:.2f}", f"{r['profile_round_ms']:.1f}",
        f"{r['calibrated_round_ms']:.1f}", f"{r['served_round_ms']:.1f}",
        f"{r['calibrated_round_ms'] / r['served_round_ms']:.2f}" + ("" if within(r) else " ✗"),
        f"{r['own']['slowdown']:.2f} / {r['own']['overhead_ms']:.1f}", ms(r["mean_ms"]), ms(r["predicted_mean_ms"]),
        f"{r['requests']} ({r['failed']})",
    ] for r in data["runs"]]  # fmt: skip
    table = markdown_table(
        ["class", "load", "req/s", "mean batch", "profile round ms", "calibrated round ms", "served round ms",
         "calibrated ÷ served", "own slowdown / overhead ms", "mean latency ms", "predicted mean ms",
         "requests (failed)"], rows,
    )  # fmt: skip
    held = sum(within(r) for r in data["runs"])
    ref = data["reference"]
    return (
        f"# Calibration per class: {data['model']} ({data['mode']}), T={data['threads']}\n\n"
        f"The controller's levels ({'; '.join(data['levels'])}), each served through one TorchServe as Packrat pins "
        f"it, at open-loop Poisson loads of {', '.join(f'{f:.0%}' for f in data['loads'])} of the class's capacity "
        f"by the profile, the classes taking turns. A round = one batch in the worker's `handle()`, at the mean "
        f"batch it formed. *Profile* = profiled forward pass + the profile's handler cost "
        f"({data['prior']['overhead_ms']:.1f} ms/request); *calibrated* = the profiled pass under the one "
        f"calibration learned from the first run (slowdown {ref['slowdown']:.2f}, handler "
        f"{ref['overhead_ms']:.1f} ms/request), as the controller predicts a class it has not served; "
        f"*own* = what the class's own run would have taught. Predicted mean = the queueing model "
        f"(`levels.py`) under that calibration.\n\n{table}\n\n"
        f"Calibrated within {BOUND:.0%} of served in **{held} of {len(data['runs'])}** runs.\n\n"
        f"![round time per class]({stem}.png)\n\nProfile: `{data['profile_path']}`.\n\n"
        f"{provenance_block(data['provenance'])}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--loads", type=parse_fractions, default=[0.3, 0.6],
                        help="open-loop loads as fractions of each class's capacity by the profile")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=15.0, help="one run")
    parser.add_argument("--warmup-seconds", type=float, default=4.0)
    parser.add_argument(
        "--max-batch-delay",
        type=int,
        default=SwapperConfig().max_batch_delay_ms,
        help="TorchServe's max_batch_delay (ms) for classes with batch > 1, as the controller's",
    )
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    prov = provenance("bench.packrat_calibration")
    with tempfile.TemporaryDirectory(prefix="packrat-calibration-") as tmp:
        data = measure(args, Path(tmp))
    data["provenance"] = prov
    stem = f"packrat_calibration_{data['model']}"
    print(publish(stem, data, lambda d: render(d, stem), plot, args.out_dir, args.json))
    return 0 if all(r["failed"] == 0 for r in data["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
