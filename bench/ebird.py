"""Ebird vs TorchServe's own batching, under the paper's low-then-high load.

    python -m bench.ebird [--quick] [--model resnet50] --json PATH

One TorchServe serves one model three ways, each with one worker:

- ``ebird``: the Ebird archive (async mode; input pool, elastic scheduler);
- ``nowait``: the plain handler with TorchServe batching, batch_size 32 and
  max_batch_delay 0 ("NO Wait": a worker takes whatever is queued);
- ``optwait``: the same with batch_size 32 and the max_batch_delay that gave
  the lowest mean latency in a sweep run first, inside this benchmark
  ("OPT Wait").

Load: Poisson arrivals, a low-rate phase then a high-rate phase, the same
arrival schedule for every system, real client payloads (JPEGs for vision
models).  Rates default to fractions of the measured single-request capacity
1/L1 (L1: mean latency of one request at a time): low 0.3/L1, high 1.3/L1,
so the high phase cannot be served without batching.  The systems take turns
(ABC, CBA, …) and the ratios are medians over the repeats.

``throughput_at_qos`` is goodput in the high phase: answers within the QoS
target (default 10·L1) per second of that phase.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import (
    add_output_arguments,
    markdown_table,
    new_figure,
    provenance,
    provenance_block,
    publish,
    save_figure,
)
from model_store.build import ServingOptions, build_archive
from model_store.catalog import get_spec
from model_store.samples import client_payload
from packrat_plugin.loadgen import LoadResult, closed_loop, open_loop, run
from packrat_plugin.torchserve import TorchServeProcess

SYSTEMS = ("ebird", "nowait", "optwait")
LABELS = {"ebird": "Ebird", "nowait": "TorchServe NO Wait", "optwait": "TorchServe OPT Wait"}
TS_MAX_BATCH = 32
CLAIM_MARGIN = 1.05  # the bar: Ebird within 5% of the better baseline


def phase_stats(result: LoadResult, start: float, end: float, qos_s: float) -> dict[str, Any]:
    phase = LoadResult([s for s in result.samples if start <= s.sent < end], end - start)
    return {
        "mean_ms": phase.mean_latency_ms(),
        "p99_ms": phase.percentile_ms(99),
        "requests": len(phase.samples),
        "failed": phase.failed,
        "goodput_rps": sum(s.latency_s <= qos_s for s in phase.ok) / (end - start),
    }


def run_pattern(url: str, payloads: list, phases: list[tuple[float, float]], seed: int) -> LoadResult:
    return run(open_loop(url, lambda i: payloads[i % len(payloads)], phases, poisson=True, seed=seed))


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    spec = get_spec(args.model, args.mode)
    store = workdir / "model_store"
    plain = build_archive(spec, store)
    ebird_settings = {"worker_batches": [1, 1, 2, 4, 8, 16], "max_inflight": 32, "pool_slots": 64, "cpu_lanes": 1}
    ebird = build_archive(
        spec, store, ServingOptions(handler="ebird", handler_settings=tuple(sorted(ebird_settings.items())))
    )
    payloads = [client_payload(spec, seed=i) for i in range(64)]
    with TorchServeProcess(workdir / "ts", store) as server:
        mgmt = server.management()
        url = {name: f"{server.inference_url}/predictions/{name}" for name in (*SYSTEMS, "sweep")}
        mgmt.register(ebird.name, model_name="ebird", initial_workers=1)
        mgmt.register(plain.name, model_name="nowait", initial_workers=1, batch_size=TS_MAX_BATCH, max_batch_delay_ms=0)

        def warm(name: str) -> None:
            run(closed_loop(url[name], lambda i: payloads[i % len(payloads)], 4, args.warmup_seconds))

        for name in ("ebird", "nowait"):
            warm(name)
        single = run(closed_loop(url["nowait"], lambda i: payloads[i % len(payloads)], 1, args.calibrate_seconds))
        l1_s = single.mean_latency_ms() / 1e3
        low_rate = args.low_rate or 0.3 / l1_s
        high_rate = args.high_rate or 1.3 / l1_s
        qos_s = (args.qos_ms / 1e3) if args.qos_ms else 10 * l1_s
        phases = [(args.low_seconds, low_rate), (args.high_seconds, high_rate)]
        bounds = {"low": (0.0, args.low_seconds), "high": (args.low_seconds, args.low_seconds + args.high_seconds)}

        # OPT Wait: the max_batch_delay with the lowest mean latency over the
        # whole pattern, each candidate registered fresh under one name.
        sweep = []
        for delay in tqdm(args.sweep_delays, desc="OPT Wait sweep", unit="delay"):
            mgmt.register(
                plain.name, model_name="sweep", initial_workers=1, batch_size=TS_MAX_BATCH, max_batch_delay_ms=delay
            )
            warm("sweep")
            result = run_pattern(url["sweep"], payloads, [(s * args.sweep_fraction, r) for s, r in phases], seed=99)
            sweep.append({"max_batch_delay_ms": delay, "mean_ms": result.mean_latency_ms(), "failed": result.failed})
            mgmt.unregister("sweep")
        best_delay = min(sweep, key=lambda row: row["mean_ms"])["max_batch_delay_ms"]
        mgmt.register(
            plain.name, model_name="optwait", initial_workers=1, batch_size=TS_MAX_BATCH, max_batch_delay_ms=best_delay
        )
        warm("optwait")

        results: dict[str, list[LoadResult]] = {name: [] for name in SYSTEMS}
        orders = [SYSTEMS, tuple(reversed(SYSTEMS))]
        with tqdm(total=args.repeats * len(SYSTEMS), desc="ebird vs baselines", unit="run") as bar:
            for r in range(args.repeats):
                for name in orders[r % 2]:
                    bar.set_postfix_str(name)
                    results[name].append(run_pattern(url[name], payloads, phases, seed=r))
                    bar.update()

    per_repeat = {
        name: [{ph: phase_stats(res, *bounds[ph], qos_s) for ph in bounds} for res in results[name]] for name in SYSTEMS
    }

    def median(name: str, phase: str, key: str) -> float:
        return statistics.median(rep[phase][key] for rep in per_repeat[name])

    phases_out = {
        ph: {
            name: {
                "mean_ms": median(name, ph, "mean_ms"),
                "p99_ms": median(name, ph, "p99_ms"),
                "requests": sum(rep[ph]["requests"] for rep in per_repeat[name]),
                "failed": sum(rep[ph]["failed"] for rep in per_repeat[name]),
            }
            for name in SYSTEMS
        }
        for ph in bounds
    }
    # Per repeat: Ebird's mean latency over the better baseline's, same repeat.
    ratios = {
        ph: [
            per_repeat["ebird"][r][ph]["mean_ms"]
            / min(per_repeat["nowait"][r][ph]["mean_ms"], per_repeat["optwait"][r][ph]["mean_ms"])
            for r in range(args.repeats)
        ]
        for ph in bounds
    }
    return {
        "model": spec.name,
        "mode": spec.mode,
        "phases": phases_out,
        "throughput_at_qos": {name: median(name, "high", "goodput_rps") for name in SYSTEMS},
        "ebird_vs_best_baseline": {
            ph: {"median": statistics.median(v), "min": min(v), "max": max(v)} for ph, v in ratios.items()
        },
        "claim_within_5pct": {ph: statistics.median(v) <= CLAIM_MARGIN for ph, v in ratios.items()},
        "load": {
            "l1_ms": 1e3 * l1_s,
            "low_rate_rps": low_rate,
            "high_rate_rps": high_rate,
            "low_seconds": args.low_seconds,
            "high_seconds": args.high_seconds,
            "qos_ms": 1e3 * qos_s,
            "repeats": args.repeats,
        },
        "ebird_settings": ebird_settings,
        "optwait_delay_ms": best_delay,
        "sweep": sweep,
        "timeline": {
            name: sorted((s.sent, 1e3 * s.latency_s, s.status) for s in results[name][-1].samples) for name in SYSTEMS
        },
    }


def plot(data: dict[str, Any], path: Path) -> None:
    """Latency of each request by arrival order (the paper's Figure 8), last repeat."""
    fig, ax = new_figure((7.5, 3.8))
    for name in SYSTEMS:
        points = data["timeline"][name]
        ax.plot(range(len(points)), [p[1] for p in points], lw=0.9, label=LABELS[name])
    first_high = next((i for i, p in enumerate(data["timeline"]["ebird"]) if p[0] >= data["load"]["low_seconds"]), None)
    if first_high is not None:
        ax.axvline(first_high, color="grey", ls="--", lw=0.8)
        ax.text(first_high, ax.get_ylim()[1] * 0.95, " high load", fontsize=8, va="top")
    title = f"{data['model']}: latency by arrival, low → high load"
    save_figure(fig, ax, path, "request (arrival order)", "latency (ms)", title, log_y=True)


def render(data: dict[str, Any], stem: str) -> str:
    load = data["load"]
    rows = []
    for ph in ("low", "high"):
        cell = data["phases"][ph]
        ratio = data["ebird_vs_best_baseline"][ph]
        rows.append(
            [ph, f"{load[f'{ph}_rate_rps']:.1f}"]
            + [f"{cell[n]['mean_ms']:.0f} / {cell[n]['p99_ms']:.0f}" for n in SYSTEMS]
            + [f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})",
               "yes" if data["claim_within_5pct"][ph] else "**no**",
               str(sum(cell[n]["failed"] for n in SYSTEMS))]
        )  # fmt: skip
    table = markdown_table(
        ["phase", "rate (req/s)", *(f"{LABELS[n]} mean / p99 ms" for n in SYSTEMS),
         "Ebird ÷ better baseline (min-max)", "within 5%", "failed"],
        rows,
    )  # fmt: skip
    qos = markdown_table(
        ["", *(LABELS[n] for n in SYSTEMS)],
        [[f"goodput within {load['qos_ms']:.0f} ms (req/s, high phase)",
          *(f"{data['throughput_at_qos'][n]:.2f}" for n in SYSTEMS)]],
    )  # fmt: skip
    sweep = ", ".join(f"{row['max_batch_delay_ms']} ms → {row['mean_ms']:.0f} ms" for row in data["sweep"])
    return (
        f"# Ebird vs TorchServe batching: {data['model']} ({data['mode']})\n\n"
        f"One TorchServe, one worker per system, Poisson arrivals: {load['low_seconds']:g} s at the low rate, then "
        f"{load['high_seconds']:g} s at the high rate (rates from the measured one-at-a-time latency "
        f"L1 = {load['l1_ms']:.0f} ms), {load['repeats']} interleaved repeat(s). "
        f"Ebird settings: `{data['ebird_settings']}`. OPT Wait = batch 32 with max_batch_delay "
        f"**{data['optwait_delay_ms']} ms**, chosen by a sweep of mean latency ({sweep}).\n\n"
        f"{table}\n\n{qos}\n\n![latency by arrival order]({stem}.png)\n\n{provenance_block(data['provenance'])}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="resnet50", help="catalog name")
    parser.add_argument("--mode", default="eager", choices=("eager", "script", "compile"))
    parser.add_argument("--quick", action="store_true", help="short phases, one repeat, two sweep points")
    parser.add_argument("--low-seconds", type=float, default=40.0)
    parser.add_argument("--high-seconds", type=float, default=40.0)
    parser.add_argument("--low-rate", type=float, help="requests/s (default 0.3/L1)")
    parser.add_argument("--high-rate", type=float, help="requests/s (default 1.3/L1)")
    parser.add_argument("--qos-ms", type=float, help="QoS target for goodput (default 10·L1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep-delays", default="5,10,25,50,100", help="OPT Wait candidates (ms)")
    parser.add_argument("--sweep-fraction", type=float, default=0.5, help="sweep runs this share of each phase")
    parser.add_argument("--warmup-seconds", type=float, default=5.0)
    parser.add_argument("--calibrate-seconds", type=float, default=6.0)
    add_output_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.low_seconds, args.high_seconds, args.repeats = 15.0, 15.0, 1
        args.sweep_delays, args.warmup_seconds, args.calibrate_seconds = "10,50", 3.0, 4.0
    args.sweep_delays = [int(d) for d in str(args.sweep_delays).split(",") if d.strip()]
    prov = provenance("bench.ebird")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ebird-bench-") as tmp:
        data = measure(args, Path(tmp))
    data["provenance"] = prov
    data["wall_s"] = time.monotonic() - started
    stem = f"ebird_{data['model']}"
    print(publish(stem, data, lambda d: render(d, stem), plot, args.out_dir, args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
