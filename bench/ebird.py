"""Ebird vs TorchServe's own batching, at loads within and beyond capacity.

    python -m bench.ebird [--quick] [--model resnet50] --json PATH

One TorchServe serves one model three ways, each with one worker:

- ``ebird``: the Ebird archive (async mode; input pool, elastic scheduler);
- ``nowait``: the plain handler with TorchServe batching, batch_size 32 and
  max_batch_delay 0 ("NO Wait").  TorchServe 0.12's frontend then forms
  batches of at most two: ``Model.pollBatch`` takes the first queued job,
  polls once more with the delay left, and stops as soon as that delay is
  spent, which at 0 is after the second job.  The table's batch counts
  show it (only sizes 1 and 2);
- ``optwait``: the same with batch_size 32 and the max_batch_delay that gave
  the lowest mean latency in a sweep run first, inside this benchmark
  ("OPT Wait").

Load: Poisson arrivals, the same arrival schedule for every system, real
client payloads (JPEGs for vision models).  The rates are fractions of the
*capacity* measured first in the same run: the best throughput Ebird or NO
Wait sustains under a closed loop of ``--capacity-clients`` clients (the
median of ``--capacity-repeats`` runs each, the two taking turns).  The
main pattern is a low phase (30 % of capacity) then a high phase (85 %),
the paper's QoS-bounded setting: every system can keep up, so the mean
latency measures batching, not queue growth.  An overload run (130 % of
capacity, queues grow for its whole length) is a separate, labelled row and
no part of the claim.  The systems take turns (ABC, CBA, …); ratios are
medians over the repeats.  Each system's batch sizes over the whole
pattern (all repeats) come from its handler's ``HandlerBatches`` counter.

``throughput_at_qos`` is goodput in the high phase: answers within the QoS
target (default 10·L1, L1: one request at a time) per second of that phase.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from archiver.build import build_archive
from archiver.options import ServingOptions
from bench.batching_compare import (
    batch_counts,
    capacity_summary,
    interleaved,
    median_cell,
    payload_cycle,
    phase_stats,
    ratio_spread,
    recording_counts,
    register_batching,
    repeat_ratios,
    run_and_publish,
    runs_per_system,
    sustained_capacity,
    sweep_batch_delay,
    warm,
)
from bench.report import (
    add_output_arguments,
    markdown_table,
    new_figure,
    provenance_block,
    save_figure,
)
from model_store.catalog import get_spec
from model_store.samples import client_payload
from serving_harness.loadgen import LoadResult, closed_loop, run
from serving_harness.torchserve import TorchServeProcess

SYSTEMS = ("ebird", "nowait", "optwait")
TWIN = "nowait-twin"  # --twin: NO Wait again, as a system of its own: the bench's A/A check
LABELS = {
    "ebird": "Ebird",
    "nowait": "TorchServe NO Wait",
    "optwait": "TorchServe OPT Wait",
    TWIN: "NO Wait again (A/A)",
}
PATTERN_LABELS = {"pattern": "low then high", "overload": "overload"}
CLAIM_MARGIN = 1.0  # the bar: Ebird's mean no worse than the better baseline's, its p99 no worse than NO Wait's


def systems_in(data: dict[str, Any]) -> tuple[str, ...]:
    """The systems a result compares (results from before ``--twin``: the three)."""
    return tuple(data.get("systems", SYSTEMS))


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    spec = get_spec(args.model, args.mode)
    systems = (*SYSTEMS, TWIN) if args.twin else SYSTEMS
    store = workdir / "model_store"
    plain = build_archive(spec, store)
    ebird_settings = {
        "worker_batches": [1, 1, 2, 4, 8, 16],
        "max_inflight": 32,
        "pool_slots": 64,
        "cpu_lanes": 1,
        "cpu_rule": "lane",
        "cpu_batch_cap": "auto",
    } | args.ebird_settings
    ebird = build_archive(
        spec, store, ServingOptions(handler="ebird", handler_settings=tuple(sorted(ebird_settings.items())))
    )
    payloads = [client_payload(spec, seed=i) for i in range(64)]
    with TorchServeProcess(workdir / "ts", store) as server:
        mgmt = server.management()
        url = {name: f"{server.inference_url}/predictions/{name}" for name in (*systems, "sweep")}
        mgmt.register(ebird.name, model_name="ebird", initial_workers=1)
        for name in (n for n in systems if n in ("nowait", TWIN)):
            register_batching(mgmt, plain.name, name, 0)

        for name in (n for n in systems if n != "optwait"):  # OPT Wait is registered, and warmed, after its sweep
            warm(url[name], payloads, args.warmup_seconds)
        single = run(closed_loop(url["nowait"], payload_cycle(payloads), 1, args.calibrate_seconds))
        l1_s = single.mean_latency_ms() / 1e3

        # Capacity: what the better of the two sustains when clients never let it idle.
        capacity_runs = sustained_capacity(
            {name: url[name] for name in ("ebird", "nowait")},
            payloads,
            args.capacity_clients,
            args.capacity_seconds,
            args.capacity_repeats,
        )
        capacity = {name: statistics.median(runs) for name, runs in capacity_runs.items()}
        capacity_rps = max(capacity.values())
        low_rate = args.low_rate or args.low_fraction * capacity_rps
        high_rate = args.high_rate or args.high_fraction * capacity_rps
        overload_rate = args.overload_fraction * capacity_rps
        qos_s = (args.qos_ms / 1e3) if args.qos_ms else 10 * l1_s
        phases = [(args.low_seconds, low_rate), (args.high_seconds, high_rate)]
        bounds = {"low": (0.0, args.low_seconds), "high": (args.low_seconds, args.low_seconds + args.high_seconds)}
        if args.overload_seconds > 0:
            bounds["overload"] = (0.0, args.overload_seconds)

        # OPT Wait: the max_batch_delay with the lowest mean latency over the
        # low-then-high pattern.
        sweep_shape = [(s * args.sweep_fraction, r) for s, r in phases]
        best_delay, sweep = sweep_batch_delay(
            mgmt, plain.name, url["sweep"], payloads, [sweep_shape], args.sweep_delays, args.warmup_seconds
        )
        register_batching(mgmt, plain.name, "optwait", best_delay)
        warm(url["optwait"], payloads, args.warmup_seconds)

        patterns = {"pattern": phases}
        if args.overload_seconds > 0:
            patterns["overload"] = [(args.overload_seconds, overload_rate)]
        metrics = server.metrics()
        counts: dict[str, dict[str, list[dict[str, Counter]]]] = {p: {n: [] for n in systems} for p in patterns}
        around_run = recording_counts(lambda name: {"batches": batch_counts(metrics, name)}, counts)
        results = interleaved(
            {n: url[n] for n in systems}, payloads, patterns, args.repeats, "ebird vs baselines", around_run
        )

    def result_of(phase: str, name: str, r: int) -> LoadResult:
        return results["overload" if phase == "overload" else "pattern"][name][r]

    per_repeat = {
        name: [
            {ph: phase_stats(result_of(ph, name, r), *bounds[ph], qos_s) for ph in bounds} for r in range(args.repeats)
        ]
        for name in systems
    }

    def median(name: str, phase: str, key: str) -> float:
        return median_cell(per_repeat[name], phase, key)

    phases_out = {
        ph: {
            name: {
                "mean_ms": median(name, ph, "mean_ms"),
                "p99_ms": median(name, ph, "p99_ms"),
                "requests": sum(rep[ph]["requests"] for rep in per_repeat[name]),
                "failed": sum(rep[ph]["failed"] for rep in per_repeat[name]),
            }
            for name in systems
        }
        for ph in bounds
    }

    # Per repeat, Ebird over a baseline in the same repeat.
    mean_ratio = {ph: ratio_spread(per_repeat, "ebird", ("nowait", "optwait"), ph, "mean_ms") for ph in bounds}
    p99_ratio = {ph: ratio_spread(per_repeat, "ebird", ("nowait",), ph, "p99_ms") for ph in bounds}
    twin = {ph: ratio_spread(per_repeat, TWIN, ("nowait",), ph, "mean_ms") for ph in bounds} if TWIN in systems else {}
    return {
        "model": spec.name,
        "mode": spec.mode,
        "systems": list(systems),
        "phases": phases_out,
        "throughput_at_qos": {name: median(name, "high", "goodput_rps") for name in systems},
        "twin_vs_nowait": twin,
        "ebird_vs_best_baseline": mean_ratio,
        "ebird_p99_vs_nowait": p99_ratio,
        "claim": {
            ph: mean_ratio[ph]["median"] <= CLAIM_MARGIN and p99_ratio[ph]["median"] <= CLAIM_MARGIN
            for ph in ("low", "high")
        },
        "load": {
            "l1_ms": 1e3 * l1_s,
            "capacity_rps": capacity,
            "capacity_clients": args.capacity_clients,
            "capacity_runs_rps": capacity_runs,
            "low_rate_rps": low_rate,
            "high_rate_rps": high_rate,
            "overload_rate_rps": overload_rate,
            "low_seconds": args.low_seconds,
            "high_seconds": args.high_seconds,
            "overload_seconds": args.overload_seconds,
            "qos_ms": 1e3 * qos_s,
            "repeats": args.repeats,
        },
        "per_repeat": per_repeat,  # every repeat's phase statistics, for readings beyond the medians
        "batches": {pattern: {name: batch_totals(runs) for name, runs in by.items()} for pattern, by in counts.items()},
        "ebird_settings": ebird_settings,
        "optwait_delay_ms": best_delay,
        "sweep": sweep,
        "timeline": {
            name: sorted((s.sent, 1e3 * s.latency_s, s.status) for s in results["pattern"][name][-1].samples)
            for name in systems
        },
    }


def batch_totals(runs: list[dict[str, Counter]]) -> dict[int, int]:
    """Batches by size over a system's runs of one pattern."""
    return dict(sorted(sum((c["batches"] for c in runs), Counter()).items()))


def sizes_text(counts: dict[Any, int]) -> str:
    return ", ".join(f"{size}: {n}" for size, n in counts.items())


def plot(data: dict[str, Any], path: Path) -> None:
    """Latency of each request by arrival order (the paper's Figure 8), last repeat."""
    fig, ax = new_figure((7.5, 3.8))
    for name in systems_in(data):
        points = data["timeline"][name]
        ax.plot(range(len(points)), [p[1] for p in points], lw=0.9, label=LABELS[name])
    first_high = next((i for i, p in enumerate(data["timeline"]["ebird"]) if p[0] >= data["load"]["low_seconds"]), None)
    if first_high is not None:
        ax.axvline(first_high, color="grey", ls="--", lw=0.8)
        ax.text(first_high, ax.get_ylim()[1] * 0.95, " high load", fontsize=8, va="top")
    title = f"{data['model']}: latency by arrival, low → high load"
    save_figure(fig, ax, path, "request (arrival order)", "latency (ms)", title, log_y=True)


def repeat_lines(data: dict[str, Any]) -> str:
    """Each repeat's Ebird mean ÷ the better baseline's, per phase (results from before ``per_repeat``: none)."""
    runs = data.get("per_repeat")
    if not runs:
        return ""
    lines = []
    for ph in data["phases"]:
        ratios = repeat_ratios(runs, "ebird", ("nowait", "optwait"), ph, "mean_ms")
        lines.append(f"- {ph}: " + ", ".join(f"{x:.2f}" for x in ratios))
    text = "Ebird mean ÷ better baseline, repeat by repeat:\n\n" + "\n".join(lines) + "\n\n"
    if data.get("twin_vs_nowait"):
        twin = []
        for ph, cell in data["twin_vs_nowait"].items():
            ratios = ", ".join(f"{x:.2f}" for x in repeat_ratios(runs, TWIN, ("nowait",), ph, "mean_ms"))
            twin.append(f"- {ph}: {cell['median']:.2f} ({cell['min']:.2f}-{cell['max']:.2f}); by repeat {ratios}")
        text += (
            "A/A check: NO Wait served again as a model of its own, its mean ÷ NO Wait's in the same repeat "
            "(what the bench reads where there is no difference to find):\n\n" + "\n".join(twin) + "\n\n"
        )
    return text


def render(data: dict[str, Any], stem: str) -> str:
    load = data["load"]
    systems = systems_in(data)
    rows = []
    for ph in data["phases"]:
        cell = data["phases"][ph]
        mean, p99 = data["ebird_vs_best_baseline"][ph], data["ebird_p99_vs_nowait"][ph]
        claim = data["claim"].get(ph)
        rows.append(
            [ph if ph != "overload" else "overload (not in the claim)", f"{load[f'{ph}_rate_rps']:.1f}"]
            + [f"{cell[n]['mean_ms']:.0f} / {cell[n]['p99_ms']:.0f}" for n in systems]
            + [f"{mean['median']:.2f} ({mean['min']:.2f}-{mean['max']:.2f})",
               f"{p99['median']:.2f} ({p99['min']:.2f}-{p99['max']:.2f})",
               "-" if claim is None else ("yes" if claim else "**no**"),
               str(sum(cell[n]["failed"] for n in systems))]
        )  # fmt: skip
    table = markdown_table(
        ["phase", "rate (req/s)", *(f"{LABELS[n]} mean / p99 ms" for n in systems),
         "Ebird mean ÷ better baseline (min-max)", "Ebird p99 ÷ NO Wait (min-max)", "≤ 1.0 both", "failed"],
        rows,
    )  # fmt: skip
    qos = markdown_table(
        ["", *(LABELS[n] for n in systems)],
        [[f"goodput within {load['qos_ms']:.0f} ms (req/s, high phase)",
          *(f"{data['throughput_at_qos'][n]:.2f}" for n in systems)]],
    )  # fmt: skip
    sweep = ", ".join(f"{row['max_batch_delay_ms']} ms → {row['mean_ms']:.0f} ms" for row in data["sweep"])
    per_repeat = repeat_lines(data)
    capacity = capacity_summary(load["capacity_rps"], load.get("capacity_runs_rps"), LABELS)
    runs_each = runs_per_system(load.get("capacity_runs_rps"))
    batches = markdown_table(
        ["batches run, by size (all repeats)", *(LABELS[n] for n in systems)],
        [
            [PATTERN_LABELS.get(pattern, pattern), *(sizes_text(data["batches"][pattern][n]) for n in systems)]
            for pattern in data.get("batches", {})
        ],
    )
    overload = (
        f" The overload row is a run of its own: {load['overload_seconds']:g} s at "
        f"{load['overload_rate_rps']:.1f} req/s, beyond every system's capacity, so it measures how a backlog "
        "grows, not batching."
        if "overload" in data["phases"]
        else ""
    )
    return (
        f"# Ebird vs TorchServe batching: {data['model']} ({data['mode']})\n\n"
        f"One TorchServe, one worker per system. Capacity, measured first in the same run with "
        f"{load['capacity_clients']} closed-loop clients, the two taking turns (median (min-max) of {runs_each} "
        f"run(s) each): {capacity} req/s; the better one sets the rates. "
        f"Poisson arrivals: {load['low_seconds']:g} s at the low rate, then {load['high_seconds']:g} s at the high "
        f"rate, {load['repeats']} interleaved repeat(s); a ratio is Ebird's over the baseline's in the same repeat, "
        f"median (min-max).{overload} "
        f"Ebird settings: `{data['ebird_settings']}`. OPT Wait = batch 32 with max_batch_delay "
        f"**{data['optwait_delay_ms']} ms**, chosen by a sweep of mean latency ({sweep}). "
        f"One request at a time takes L1 = {load['l1_ms']:.0f} ms.\n\n"
        f"{table}\n\n{per_repeat}{qos}\n\n{batches}\n\n![latency by arrival order]({stem}.png)\n\n"
        f"{provenance_block(data['provenance'])}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="resnet50", help="catalog name")
    parser.add_argument("--mode", default="eager", choices=("eager", "script", "compile"))
    parser.add_argument("--quick", action="store_true", help="short phases, one repeat, two sweep points (a smoke run)")
    parser.add_argument("--low-seconds", type=float, default=40.0)
    parser.add_argument("--high-seconds", type=float, default=40.0)
    parser.add_argument("--low-fraction", type=float, default=0.3, help="low rate, as a share of capacity")
    parser.add_argument("--high-fraction", type=float, default=0.85, help="high rate, as a share of capacity")
    parser.add_argument("--overload-fraction", type=float, default=1.3, help="overload row's rate, likewise")
    parser.add_argument("--overload-seconds", type=float, default=20.0, help="0: no overload row")
    parser.add_argument("--low-rate", type=float, help="requests/s (overrides --low-fraction)")
    parser.add_argument("--high-rate", type=float, help="requests/s (overrides --high-fraction)")
    parser.add_argument("--capacity-clients", type=int, default=8, help="closed-loop clients that measure capacity")
    parser.add_argument("--capacity-seconds", type=float, default=10.0)
    parser.add_argument("--capacity-repeats", type=int, default=3, help="interleaved closed-loop runs per system")
    parser.add_argument("--qos-ms", type=float, help="QoS target for goodput (default 10·L1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--twin", action="store_true", help="serve NO Wait twice and report the second ÷ the first (an A/A check)"
    )
    parser.add_argument(
        "--ebird-settings",
        type=json.loads,
        default={},
        help="JSON merged into the Ebird archive's settings, e.g. '{\"cpu_rule\": \"plan\"}' for the paper's rule",
    )
    parser.add_argument("--sweep-delays", default="5,10,25,50,100", help="OPT Wait candidates (ms)")
    parser.add_argument("--sweep-fraction", type=float, default=0.5, help="sweep runs this share of each phase")
    parser.add_argument("--warmup-seconds", type=float, default=5.0)
    parser.add_argument("--calibrate-seconds", type=float, default=6.0)
    add_output_arguments(parser)


def failed_requests(data: dict[str, Any]) -> int:
    return sum(row["failed"] for phase in data["phases"].values() for row in phase.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.low_seconds, args.high_seconds, args.repeats = 15.0, 15.0, 1
        args.overload_seconds, args.capacity_seconds, args.capacity_repeats = 10.0, 6.0, 1
        args.sweep_delays, args.warmup_seconds, args.calibrate_seconds = "10,50", 3.0, 4.0
    args.sweep_delays = [int(d) for d in str(args.sweep_delays).split(",") if d.strip()]
    return run_and_publish(args, "bench.ebird", measure, failed_requests, render, plot)


if __name__ == "__main__":
    raise SystemExit(main())
