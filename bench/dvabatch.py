"""DVABatch vs TorchServe's own batching (ZeroBatch, DelayBatch) at three loads.

    python -m bench.dvabatch [--quick] [--model bert-base] --json PATH

One TorchServe serves one model three ways, one worker each, all eager:

- ``dvabatch``: the DVABatch archive (async mode; the model cut into
  stages, one CPU lane per stage, new / stretch / split over a batch table);
- ``dvabatch1``: the same with ``cpu_lanes: 1``: every stage on all the
  cores, one at a time (no pipeline across cores);
- ``zerobatch``: the plain handler under TorchServe batching with batch_size
  32 and max_batch_delay 0 (the paper's ZeroBatch: a worker takes whatever
  is queued, never waits);
- ``delaybatch``: the same with the max_batch_delay that gave the lowest mean
  latency over the medium and high loads in a sweep run first, inside this
  benchmark (the paper's DelayBatch).

Load: the peak throughput is measured first in the same run (the better of
DVABatch and ZeroBatch under ``--capacity-clients`` closed-loop clients);
then each system gets Poisson arrivals at 1/4, 3/5 and 9/10 of it (the
paper's low / medium / high), the same arrival schedule for every system, in
interleaved repeats (ABC, CBA, …).  A ratio is DVABatch's over the better
baseline's in the same repeat; the table gives its median (min-max).

Before TorchServe starts, the stages are timed in this process
(``stage_scaling``): the whole model on all the cores, each stage alone on
a one-thread lane, and every stage at once, one per lane.  That says what a
pipeline across cores can give on this CPU before any scheduling.

Payloads are what a client sends: JPEGs for vision models; for token models,
JSON token ids whose lengths follow ``TOKEN_LENGTH_MIX`` (read its comment).
The baselines pad every request to the archive's sequence length; DVABatch
pads it to its length class (``--token-lengths``, the input-diversity policy).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

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
from handlers.runtime.lanes import CpuLanes
from handlers.runtime.segments import slice_model
from handlers.runtime.timing import median_seconds
from model_store.catalog import ModelSpec, get_spec
from model_store.factory import build_model, example_inputs
from model_store.samples import client_payload, token_ids_json
from serving_harness.clients import MetricsClient
from serving_harness.loadgen import Payload, closed_loop, run
from serving_harness.torchserve import TorchServeProcess

SYSTEMS = ("dvabatch", "dvabatch1", "zerobatch", "delaybatch")
VARIANTS = ("dvabatch", "dvabatch1")
BASELINES = ("zerobatch", "delaybatch")
LABELS = {
    "dvabatch": "DVABatch (a lane per stage)",
    "dvabatch1": "DVABatch (one lane)",
    "zerobatch": "ZeroBatch",
    "delaybatch": "DelayBatch",
}
SHORT = {"dvabatch": "D", "dvabatch1": "D1", "zerobatch": "Z", "delaybatch": "Dl"}
LOADS = {"low": 0.25, "medium": 0.6, "high": 0.9}  # fractions of peak, the paper's three loads
CLAIM_LOADS = ("medium", "high")  # the bar: DVABatch's mean below the better baseline's here

# Token counts of the requests a token model is sent, as (upper bound of a
# bucket as a share of the archive's seq_len, share of requests), drawn
# uniformly inside each bucket.  A synthetic long-tailed mix of short and a
# few long sentences, chosen for this benchmark; it is NOT taken from a
# published GLUE histogram.  Today it changes no system's work: the codec
# pads every request to seq_len for the baselines; DVABatch pads it to its
# length class (``--token-lengths``, the input-diversity policy), by default
# the mix's bucket edges.
TOKEN_LENGTH_MIX = ((0.125, 0.30), (0.25, 0.35), (0.5, 0.25), (1.0, 0.10))


def dvabatch_token_lengths(spec: ModelSpec, text: str) -> tuple[int, ...]:
    """``--token-lengths``: 'auto' (the mix's bucket edges below seq_len), 'none', or a comma-separated list."""
    if spec.input_kind != "tokens" or text == "none":
        return ()
    if text == "auto":
        return tuple(max(1, round(edge * spec.seq_len)) for edge, _ in TOKEN_LENGTH_MIX[:-1])
    return tuple(int(x) for x in text.split(",") if x.strip())


def token_lengths(seq_len: int, count: int, seed: int) -> list[int]:
    """``count`` token counts in [1, seq_len] drawn from ``TOKEN_LENGTH_MIX``."""
    rng = random.Random(seed)
    edges = [max(1, round(edge * seq_len)) for edge, _ in TOKEN_LENGTH_MIX]
    ranges = list(zip([1] + [e + 1 for e in edges[:-1]], edges, strict=True))
    picks = rng.choices(ranges, weights=[share for _, share in TOKEN_LENGTH_MIX], k=count)
    return [rng.randint(low, high) for low, high in picks]


def bench_payloads(spec: ModelSpec, count: int = 64) -> tuple[list[Payload], list[int] | None]:
    if spec.input_kind == "image":
        return [client_payload(spec, seed=i) for i in range(count)], None
    lengths = token_lengths(spec.seq_len, count, seed=7)
    return [token_ids_json(spec, n, seed=i) for i, n in enumerate(lengths)], lengths


def stage_scaling(spec: ModelSpec, segments: int, repeats: int = 8) -> dict[str, float]:
    """Median ms per batch of one: the whole model on all the cores; each stage alone on a
    one-thread lane; all stages at once, one per lane (what a full pipeline's step costs)."""
    model = build_model(spec).eval()
    one = example_inputs(spec, batch=1)
    with torch.inference_mode():
        sliced = slice_model(model, example_inputs(spec, batch=2), segments, repeats=2)
        states = [sliced.start(*one)]
        for segment in list(sliced)[:-1]:
            states.append(segment(states[-1]))

        def median_ms(fn: Callable[[], object]) -> float:
            return 1e3 * median_seconds(fn, repeats=repeats)

        out = {"threads": torch.get_num_threads(), "whole_all_cores_ms": median_ms(lambda: model(*one))}
        lanes = CpuLanes(segments, 1)
        try:

            def on_lane(fn):  # noqa: ANN001, ANN202
                return lambda: lanes.submit(fn).result()

            def run_stage(s: int):  # noqa: ANN202
                def run() -> None:
                    with torch.inference_mode():  # per thread: the lane's is not this one's
                        sliced[s](states[s])

                return run

            for s in range(segments):
                out[f"stage{s}_one_thread_ms"] = median_ms(on_lane(run_stage(s)))

            def all_at_once() -> None:
                for done in [lanes.submit(run_stage(s)) for s in range(segments)]:
                    done.result()

            out["all_stages_at_once_ms"] = median_ms(all_at_once)
        finally:
            lanes.close()
    out["stages_in_turn_ms"] = sum(out[f"stage{s}_one_thread_ms"] for s in range(segments))
    out["pipeline_gain"] = out["whole_all_cores_ms"] / out["all_stages_at_once_ms"]  # throughput, > 1: pipeline wins
    return out


def handler_counts(metrics: MetricsClient, model: str) -> dict[str, Counter]:
    """The handler's batch sizes and scheduler operations so far (TorchServe's metrics endpoint)."""
    out: dict[str, Counter] = {"batches": batch_counts(metrics, model), "operations": Counter()}
    for labels, value in metrics.samples("HandlerOperations"):
        if labels.get("ModelName") == model:
            out["operations"][labels["Operation"]] += int(value)
    return out


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    spec = get_spec(args.model, "eager")
    store = workdir / "model_store"
    plain = build_archive(spec, store)
    settings = {
        "segments": args.segments,
        "max_batch": args.max_batch,
        "t_comp_wait_ms": args.t_comp_wait_ms,
        "max_inflight": args.max_inflight,
    }
    archives = {}
    classes = dvabatch_token_lengths(spec, args.token_lengths)
    for variant, lanes in (("dvabatch", None), ("dvabatch1", 1)):
        variant_settings = tuple(sorted({**settings, "cpu_lanes": lanes}.items()))
        options = ServingOptions(handler="dvabatch", handler_settings=variant_settings, token_lengths=classes)
        # Both archives get the same file name: each is built in a store of its own, then copied.
        built = build_archive(spec, workdir / variant, options)
        archives[variant] = f"{built.stem}-{variant}.mar"
        shutil.copy(built, store / archives[variant])
    scaling = stage_scaling(spec, args.segments)
    payloads, lengths = bench_payloads(spec)
    counts: dict[str, dict[str, list[dict[str, Counter]]]] = {p: {n: [] for n in SYSTEMS} for p in LOADS}
    with TorchServeProcess(workdir / "ts", store) as server:
        mgmt, metrics = server.management(), server.metrics()
        url = {name: f"{server.inference_url}/predictions/{name}" for name in (*SYSTEMS, "sweep")}
        for variant in VARIANTS:
            mgmt.register(archives[variant], model_name=variant, initial_workers=1)
        register_batching(mgmt, plain.name, "zerobatch", 0)
        for name in (*VARIANTS, "zerobatch"):
            warm(url[name], payloads, args.warmup_seconds)
        single = run(closed_loop(url["zerobatch"], payload_cycle(payloads), 1, args.calibrate_seconds))
        l1_ms = single.mean_latency_ms()

        peak_runs = sustained_capacity(
            {name: url[name] for name in (*VARIANTS, "zerobatch")},
            payloads,
            args.capacity_clients,
            args.capacity_seconds,
            args.capacity_repeats,
        )
        peak = {name: statistics.median(runs) for name, runs in peak_runs.items()}
        peak_rps = max(peak.values())
        patterns = {load: [(args.seconds, fraction * peak_rps)] for load, fraction in LOADS.items()}

        best_delay, sweep = sweep_batch_delay(
            mgmt,
            plain.name,
            url["sweep"],
            payloads,
            [[(args.seconds * args.sweep_fraction, patterns[load][0][1])] for load in CLAIM_LOADS],
            args.sweep_delays,
            args.warmup_seconds,
        )
        register_batching(mgmt, plain.name, "delaybatch", best_delay)
        warm(url["delaybatch"], payloads, args.warmup_seconds)

        around_run = recording_counts(lambda name: handler_counts(metrics, name), counts)
        results = interleaved(
            {n: url[n] for n in SYSTEMS}, payloads, patterns, args.repeats, "dvabatch vs baselines", around_run
        )

    qos_s = 10 * l1_ms / 1e3
    per_repeat = {
        name: [
            {load: phase_stats(results[load][name][r], 0.0, args.seconds, qos_s) for load in LOADS}
            for r in range(args.repeats)
        ]
        for name in SYSTEMS
    }
    loads_out = {}
    for load in LOADS:
        row = {}
        for name in SYSTEMS:
            batches = sum((c["batches"] for c in counts[load][name]), Counter())
            operations = sum((c["operations"] for c in counts[load][name]), Counter())
            row[name] = {
                "mean_ms": median_cell(per_repeat[name], load, "mean_ms"),
                "p99_ms": median_cell(per_repeat[name], load, "p99_ms"),
                "throughput_rps": median_cell(per_repeat[name], load, "throughput_rps"),
                "requests": sum(rep[load]["requests"] for rep in per_repeat[name]),
                "failed": sum(rep[load]["failed"] for rep in per_repeat[name]),
                "mean_batch": (sum(k * v for k, v in batches.items()) / sum(batches.values())) if batches else None,
                "operations": dict(operations),
            }
        loads_out[load] = row
    mean_ratio = {
        v: {load: ratio_spread(per_repeat, v, BASELINES, load, "mean_ms") for load in LOADS} for v in VARIANTS
    }
    p99_ratio = {v: {load: ratio_spread(per_repeat, v, BASELINES, load, "p99_ms") for load in LOADS} for v in VARIANTS}
    return {
        "model": spec.name,
        "mode": spec.mode,
        "loads": loads_out,
        "dvabatch_mean_vs_best_baseline": mean_ratio,
        "dvabatch_p99_vs_best_baseline": p99_ratio,
        "claim": {load: min(mean_ratio[v][load]["median"] for v in VARIANTS) < 1.0 for load in CLAIM_LOADS},
        "stage_scaling": scaling,
        "load": {
            "l1_ms": l1_ms,
            "peak_rps": peak,
            "capacity_clients": args.capacity_clients,
            "capacity_runs_rps": peak_runs,
            "rates_rps": {load: patterns[load][0][1] for load in LOADS},
            "fractions": LOADS,
            "seconds": args.seconds,
            "repeats": args.repeats,
        },
        "token_lengths": None
        if lengths is None
        else {
            "mix": TOKEN_LENGTH_MIX,
            "min": min(lengths),
            "max": max(lengths),
            "mean": sum(lengths) / len(lengths),
            "dvabatch_classes": list(classes),
        },  # fmt: skip
        "dvabatch_settings": settings,
        "delaybatch_delay_ms": best_delay,
        "sweep": sweep,
    }


def plot(data: dict[str, Any], path: Path) -> None:
    """Mean latency against the offered load, one line per system (log scale)."""
    fig, ax = new_figure((6.5, 3.8))
    rates = [data["load"]["rates_rps"][load] for load in LOADS]
    for name in SYSTEMS:
        means = [data["loads"][load][name]["mean_ms"] for load in LOADS]
        ax.plot(rates, means, marker="o", label=LABELS[name])
    title = f"{data['model']}: mean latency at 1/4, 3/5, 9/10 of peak"
    save_figure(fig, ax, path, "offered load (req/s)", "mean latency (ms)", title, log_y=True)


def _ops_cell(ops: dict[str, int]) -> str:
    order = ("new", "join", "stretch", "merge", "split")
    return ", ".join(f"{k} {ops[k]}" for k in order if ops.get(k)) or "-"


def render(data: dict[str, Any], stem: str) -> str:
    load = data["load"]
    rows = []

    def ratio(kind: str, variant: str, name: str) -> str:
        r = data[f"dvabatch_{kind}_vs_best_baseline"][variant][name]
        return f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"

    for name in LOADS:
        cell = data["loads"][name]
        claim = data["claim"].get(name)
        rows.append(
            [f"{name} ({LOADS[name]:g} of peak)", f"{load['rates_rps'][name]:.1f}"]
            + [f"{cell[n]['mean_ms']:.0f} / {cell[n]['p99_ms']:.0f}" for n in SYSTEMS]
            + [ratio("mean", v, name) for v in VARIANTS]
            + [ratio("p99", v, name) for v in VARIANTS]
            + ["-" if claim is None else ("yes" if claim else "**no**"),
               " / ".join(f"{cell[n]['throughput_rps']:.1f}" for n in SYSTEMS),
               " / ".join("-" if cell[n]["mean_batch"] is None else f"{cell[n]['mean_batch']:.2f}" for n in SYSTEMS),
               " / ".join(_ops_cell(cell[v]["operations"]) for v in VARIANTS),
               str(sum(cell[n]["failed"] for n in SYSTEMS))]
        )  # fmt: skip
    short = " / ".join(SHORT[n] for n in SYSTEMS)
    table = markdown_table(
        ["load", "rate (req/s)", *(f"{LABELS[n]} mean / p99 ms" for n in SYSTEMS),
         *(f"{SHORT[v]} mean ÷ better baseline (min-max)" for v in VARIANTS),
         *(f"{SHORT[v]} p99 ÷ better baseline" for v in VARIANTS), "a DVABatch mean below (bar)",
         f"throughput req/s ({short})", f"mean batch ({short})", "DVABatch operations (D / D1)", "failed"],
        rows,
    )  # fmt: skip
    sc = data["stage_scaling"]
    stages = len([k for k in sc if k.startswith("stage") and k.endswith("_one_thread_ms")])
    scaling = (
        f"Stage timing in-process before the run (batch 1, median ms): the whole model on all "
        f"{sc['threads']} threads {sc['whole_all_cores_ms']:.1f}; each stage alone on a one-thread lane "
        + ", ".join(f"{sc[f'stage{s}_one_thread_ms']:.1f}" for s in range(stages))
        + f" (in turn {sc['stages_in_turn_ms']:.1f}); all stages at once, one per lane, "
        f"{sc['all_stages_at_once_ms']:.1f}. A full pipeline's throughput ÷ the whole model's on all cores: "
        f"**{sc['pipeline_gain']:.2f}×**."
    )
    sweep = ", ".join(f"{row['max_batch_delay_ms']} ms → {row['mean_ms']:.0f} ms" for row in data["sweep"])
    peak = capacity_summary(load["peak_rps"], load.get("capacity_runs_rps"), LABELS)
    lengths = data["token_lengths"]
    length_note = (
        ""
        if lengths is None
        else f" Token requests carry {lengths['min']}-{lengths['max']} ids (mean {lengths['mean']:.0f}) from the "
        "synthetic mix in `bench/dvabatch.py` (`TOKEN_LENGTH_MIX`). The baselines pad every request to the archive's "
        "length; "
        + (
            f"DVABatch pads each to its length class ({', '.join(map(str, lengths['dvabatch_classes']))} or the "
            "archive's length; the input-diversity policy), which TorchServe's own batching cannot do."
            if lengths.get("dvabatch_classes")
            else "so does DVABatch (`--token-lengths none`)."
        )
    )
    return (
        f"# DVABatch vs TorchServe batching: {data['model']} ({data['mode']})\n\n"
        f"One TorchServe, one worker per system. Peak, measured first in the same run with "
        f"{load['capacity_clients']} closed-loop clients, the systems taking turns (median (min-max) of "
        f"{runs_per_system(load.get('capacity_runs_rps'))} run(s) each): {peak} req/s; "
        f"the better one sets the rates. "
        f"Poisson arrivals for {load['seconds']:g} s per load, {load['repeats']} interleaved repeat(s); a ratio is "
        f"DVABatch's over the better baseline's in the same repeat, median (min-max). "
        f"DVABatch settings: `{data['dvabatch_settings']}`. DelayBatch = batch 32 with max_batch_delay "
        f"**{data['delaybatch_delay_ms']} ms**, chosen by a sweep of mean latency over the medium and high loads "
        f"({sweep}); ZeroBatch = batch 32, delay 0. One request at a time takes L1 = {load['l1_ms']:.0f} ms."
        f"{length_note}\n\n{scaling}\n\n{table}\n\n![mean latency by load]({stem}.png)\n\n"
        f"{provenance_block(data['provenance'])}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bert-base", help="catalog name (built eager: DVABatch slices eager models)")
    parser.add_argument("--quick", action="store_true", help="short runs, one repeat, two sweep points (a smoke run)")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each load's run")
    parser.add_argument("--segments", type=int, default=2, help="DVABatch stages")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument(
        "--token-lengths",
        default="auto",
        help="token models: DVABatch's length classes, comma-separated, 'auto' (the mix's bucket edges) or 'none'",
    )
    parser.add_argument("--t-comp-wait-ms", type=float, default=20.0, help="how long a batch may be stretched")
    parser.add_argument("--max-inflight", type=int, default=64)
    parser.add_argument("--capacity-clients", type=int, default=8, help="closed-loop clients that measure the peak")
    parser.add_argument("--capacity-seconds", type=float, default=12.0)
    parser.add_argument("--capacity-repeats", type=int, default=3, help="interleaved closed-loop runs per system")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep-delays", default="5,10,25,50", help="DelayBatch candidates (ms)")
    parser.add_argument("--sweep-fraction", type=float, default=0.5, help="a sweep run lasts this share of --seconds")
    parser.add_argument("--warmup-seconds", type=float, default=5.0)
    parser.add_argument("--calibrate-seconds", type=float, default=6.0)
    add_output_arguments(parser)


def failed_requests(data: dict[str, Any]) -> int:
    return sum(row["failed"] for load in data["loads"].values() for row in load.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.repeats, args.capacity_seconds, args.capacity_repeats = 10.0, 1, 6.0, 1
        args.sweep_delays, args.warmup_seconds, args.calibrate_seconds = "10,50", 3.0, 4.0
    args.sweep_delays = [int(d) for d in str(args.sweep_delays).split(",") if d.strip()]
    return run_and_publish(args, "bench.dvabatch", measure, failed_requests, render, plot)


if __name__ == "__main__":
    raise SystemExit(main())
