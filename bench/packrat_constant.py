"""Packrat under a constant load: does it hold still, and how often does its change detector cry wolf?

    python -m bench.packrat_constant --model resnet50                        # 10 min at 20 %, 50 %, 80 %
    python -m bench.packrat_constant --model resnet50 --seconds 60 --out-dir /tmp/pc   # a smoke run

Each load is an open-loop Poisson stream at a constant rate, a fraction of the
largest capacity the profile predicts (as in ``bench.packrat_swap``), played
against Packrat alone, the loads one after another with no pause between them.
A load's first ``--start-s`` seconds are its start: the controller may move
once there (the previous load, or the empty server, ran at another rate).
After the start the offered rate does not change, so every alarm of the change
detector is a false alarm and every swap is one too many.  The report gives,
per load, the swaps and alarms at the start and after it, the measured false
alarm rate per direction against the one the detector is set to, and latency.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/packrat_constant.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm

from archiver.build import build_archive
from bench.packrat_swap import largest_capacity, summarize
from bench.report import (
    add_model_arguments,
    add_output_arguments,
    markdown_table,
    provenance,
    provenance_block,
    publish,
)
from model_store import ARCHIVE_DIR
from model_store.catalog import get_spec
from model_store.samples import client_payload
from packrat_plugin.controller import PackratController
from packrat_plugin.model_control import ControllerConfig, ModelTarget
from packrat_plugin.plan_types import format_instances
from packrat_plugin.profiler import profile_for_this_machine
from serving_harness.loadgen import open_loop, run
from serving_harness.topology import CpuTopology

DIRECTIONS = ("up", "down")


def poisson_upper(count: int, confidence: float = 0.95) -> float:
    """One-sided upper confidence bound on a Poisson mean after ``count`` events (Garwood)."""
    from scipy.stats import chi2

    return float(chi2.ppf(confidence, 2 * (count + 1)) / 2)


def play_constant(url: str, rate: float, seconds: float, start_s: float, payloads, model) -> dict:
    """One constant load against the controller's model; swaps and alarms split at ``start_s``."""
    swaps_seen, alarms_seen = len(model.swaps), dict(model.monitor.alarms)
    start_wall = time.time()
    result = run(open_loop(url, lambda i: payloads[i % len(payloads)], [(seconds, rate)], seed=7))
    swaps = [s.to_dict() for s in model.swaps[swaps_seen:]]
    alarm_counts = {d: model.monitor.alarms[d] - alarms_seen.get(d, 0) for d in DIRECTIONS}
    alarms = [(at - start_wall, c.direction, round(c.old_rate, 2), round(c.new_rate, 2))
              for at, c in model.monitor.changes if at >= start_wall]  # fmt: skip
    late_alarms = {d: sum(1 for at, di, *_ in alarms if di == d and at >= start_s) for d in DIRECTIONS}
    # The deque holds the last 32 alarms; more than that in one load would be counted in alarm_counts only.
    return {
        **summarize(result),
        "rate": rate,
        "seconds": seconds,
        "measured_rate": len(result.samples) / seconds,
        "swaps": swaps,
        "swap_times": [s["started"] - start_wall for s in swaps],
        "swaps_at_start": sum(1 for s in swaps if s["started"] - start_wall < start_s),
        "swaps_after_start": sum(1 for s in swaps if s["started"] - start_wall >= start_s),
        "alarms": alarms,
        "alarm_counts": alarm_counts,
        "late_alarms": late_alarms,
        "decisions": [{**d, "at_s": d["at"] - start_wall} for d in model.decisions if d["at"] >= start_wall],
        "timeline": [(round(s.sent, 2), round(s.latency_s * 1e3, 1), s.status) for s in result.samples],
        "plan_after": format_instances(model.level.plan.to_dict()["instances"]) if model.level else None,
    }


def measure(args: argparse.Namespace, workdir: Path) -> dict:
    spec = get_spec(args.model, args.mode)
    profile, profile_path = profile_for_this_machine(spec.name, args.profile, args.force, args.mode)
    archive = build_archive(spec, ARCHIVE_DIR)
    threads = len(CpuTopology.from_system().cores)
    capacity = largest_capacity(profile, threads)
    payloads = [client_payload(spec, seed=i) for i in range(32)]
    config = ControllerConfig()
    controller = PackratController(workdir / "packrat", [ModelTarget(spec.name, archive, profile)], config,
                                   status_port=None)  # fmt: skip
    loads = {}
    with controller, tqdm(total=len(args.fractions), desc="constant loads", unit="load") as bar:
        url = f"{controller.server.inference_url}/predictions/{spec.name}"
        model = controller.models[spec.name]
        for fraction in args.fractions:
            bar.set_postfix_str(f"{fraction:.0%} of capacity for {args.seconds:.0f} s")
            loads[f"{fraction:.0%}"] = {"fraction": fraction, **play_constant(
                url, fraction * capacity, args.seconds, args.start_s, payloads, model)}  # fmt: skip
            bar.update()
    late_s = sum(max(0.0, load["seconds"] - args.start_s) for load in loads.values())
    false_alarms = {d: sum(load["late_alarms"][d] for load in loads.values()) for d in DIRECTIONS}
    return {
        "model": spec.name, "mode": spec.mode, "threads": threads, "capacity": capacity,
        "start_s": args.start_s, "loads": loads, "profile_path": str(profile_path),
        "false_alarm_s_setting": config.monitor.change_false_alarm_s, "change_ratio": config.monitor.change_ratio,
        "uncertainty_z": config.monitor.change_uncertainty_z,
        "watched_s": late_s, "false_alarms": false_alarms,
        "false_alarm_upper_per_hour": {d: poisson_upper(n) / late_s * 3600 for d, n in false_alarms.items()},
    }  # fmt: skip


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = list(data["loads"].items())
    fig, axes = plt.subplots(len(loads), 1, figsize=(8, 2.3 * len(loads)), squeeze=False)
    for ax, (name, load) in zip(axes[:, 0], loads, strict=True):
        ok = [(t, ms) for t, ms, st in load["timeline"] if st == 200]
        ax.scatter([t for t, _ in ok], [ms for _, ms in ok], s=2, label="request latency")
        for at in load["swap_times"]:
            ax.axvline(at, color="orange", lw=2, label="swap")
        for at, direction, *_ in load["alarms"]:
            ax.axvline(at, color="red" if direction == "up" else "blue", ls="--", lw=1, label=f"alarm ({direction})")
        ax.axvspan(0, data["start_s"], color="grey", alpha=0.15)
        ax.set_yscale("log")
        ax.set_ylabel("latency (ms)", fontsize=8)
        ax.set_title(f"{name} of capacity ({load['rate']:.1f} req/s): {len(load['swaps'])} swaps, "
                     f"{sum(load['alarm_counts'].values())} detector alarms (grey: start)", fontsize=9)  # fmt: skip
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time since the load's start (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(data: dict) -> str:
    rows = []
    for name, load in data["loads"].items():
        rows.append([
            name, f"{load['rate']:.2f} ({load['measured_rate']:.2f})", f"{load['seconds']:.0f}",
            f"{load['requests']}", f"{load['failed']}", f"{load['mean_ms']:.0f} / {load['p99_ms']:.0f}",
            f"{load['swaps_at_start']} / {load['swaps_after_start']}",
            " / ".join(f"{load['alarm_counts'][d] - load['late_alarms'][d]}+{load['late_alarms'][d]}"
                       for d in DIRECTIONS),
            load["plan_after"] or "-",
        ])  # fmt: skip
    table = markdown_table(
        ["load (of capacity)", "offered (measured) req/s", "seconds", "requests", "failed", "mean / p99 (ms)",
         "swaps at start / after", "alarms up / down (at start + after)", "plan at the end"], rows,
    )  # fmt: skip
    setting_h = data["false_alarm_s_setting"] / 3600
    z = data.get("uncertainty_z", 0.0)  # absent from runs before 2026-11-28: the estimate itself
    bound = f", each learned rate tested at its {z:g}σ bound (detector_delays.md measures the rate)" if z else ""
    fa = data["false_alarms"]
    upper = data["false_alarm_upper_per_hour"]
    watched_h = data["watched_s"] / 3600
    rate_line = "; ".join(
        f"{d}: {fa[d]} in {watched_h:.2f} h ({fa[d] / watched_h:.2f} per hour, 95 % upper bound {upper[d]:.1f})"
        for d in DIRECTIONS
    )  # fmt: skip
    decisions = [
        f"- {name} at {d['at_s']:.1f} s: {d['reason']} → B={d['target_batch']} at {d['rate']:.1f} req/s"
        for name, load in data["loads"].items() for d in load["decisions"]
    ]  # fmt: skip
    return (
        f"# Packrat under constant load: {data['model']} ({data['mode']}), T={data['threads']}\n\n"
        f"Open-loop Poisson loads at a constant rate, as fractions of the profile's largest capacity "
        f"({data['capacity']:.1f} req/s), played one after another against Packrat alone (controller defaults). "
        f"The first {data['start_s']:.0f} s of each load are its start, where one move is expected (the previous "
        f"load ran at another rate); after it every detector alarm is a false alarm and every swap one too many.\n\n"
        f"{table}\n\n"
        f"False alarms of the change detector after the starts (designed for one per {setting_h:.1f} h per "
        f"direction against a known rate, tuned for a {data['change_ratio']:.0f}× change{bound}): {rate_line}.\n\n"
        f"Decisions:\n\n" + ("\n".join(decisions) or "- none") + "\n\n"
        f"![latency over time with swaps and detector alarms]({data['stem']}.png)\n\n"
        f"Profile: `{data['profile_path']}`.\n\n{provenance_block(data['provenance'])}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--fractions", type=lambda s: [float(x) for x in s.split(",")], default=[0.2, 0.5, 0.8],
                        help="loads as fractions of the largest capacity, comma-separated")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=600.0, help="length of each load")
    parser.add_argument("--start-s", type=float, default=30.0, help="a load's start, where one move is allowed")
    parser.add_argument("--stem", default=None, help="output file stem (default packrat_constant_MODEL)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if any(not 0 < f < 1 for f in args.fractions) or args.seconds <= args.start_s:
        parser.error("fractions must lie in (0, 1) and --seconds exceed --start-s")
    prov = provenance("bench.packrat_constant")
    with tempfile.TemporaryDirectory(prefix="packrat-constant-") as tmp:
        data = measure(args, Path(tmp))
    data.update(stem=args.stem or f"packrat_constant_{data['model']}", provenance=prov)
    print(publish(data["stem"], data, render, plot, args.out_dir, args.json))
    return 0 if all(load["failed"] == 0 for load in data["loads"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
