"""REEF against its baselines on one TorchServe worker, with DISB-style workloads scaled to this machine.

    python -m bench.reef [--workload A] [--quick] [--json PATH]

Workloads (REEF's DISB, with the paper's models):

- **A**: real-time (RT) VGG-19 at uniform arrivals, plus one closed-loop
  best-effort (BE) client on ResNet-152;
- **C**: the same RT client, plus five closed-loop BE clients: ResNet-152,
  DenseNet-201, VGG-19, Inception-v3, DistilBERT;
- **D**: five RT clients at uniform arrivals, one on each of those five
  models, plus the five BE clients;
- **E**: D with Poisson arrivals.

Each RT client's rate is ``--rt-load`` ÷ (RT clients × L1), where L1 is its
model's mean latency alone on this worker (measured first, in the same
run): together the RT clients would keep the worker busy ``--rt-load`` of
the time.  That is the scaling factor to this hardware, stated in the
results.

Systems, one worker each, every one from the same group archive (the same
models, segments, threads and batching), differing only in ``policy``
(``handlers/reef/config.py``), side by side in interleaved repeats:

- ``rt-only``: the REEF archive with the RT client alone: the latency REEF
  tries to keep, and the throughput REEF is asked to double;
- ``seq``: one batch at a time, RT first, never interrupting one (SEQ);
- ``concurrent``: every queue at once, no priority (plain concurrent execution);
- ``reef``: RT preempts BE at segment boundaries.

Each run plays the RT schedule and the BE clients together for ``--seconds``.
Reported per system: RT mean and p99 latency, RT mean ÷ RT-only's, BE and
overall throughput (answers per second), overall ÷ RT-only's, and for REEF
its preemptions and their latency (the worker logs each one), against the
longest BE segment, timed in this process before TorchServe starts
(``measure_segments`` at the BE batch size, on a BE executor's threads).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from archiver.build import build_group_archive
from archiver.options import ServingOptions
from bench.batching_compare import run_and_publish
from bench.report import markdown_table, new_figure, provenance_block, save_figure
from handlers.reef.engine import PREEMPTION_LOG
from handlers.runtime.segment_profile import measure_segments, slice_catalog_model
from model_store.catalog import ModelSpec, get_spec
from model_store.factory import build_model, example_inputs
from model_store.samples import client_payload
from serving_harness.loadgen import LoadResult, closed_loop, open_loop
from serving_harness.torchserve import TorchServeProcess

FIVE = ["resnet152", "densenet201", "vgg19", "inception_v3", "distilbert"]
WORKLOADS: dict[str, dict[str, Any]] = {
    "A": {"rt": ["vgg19"], "be": ["resnet152"], "poisson": False},
    "C": {"rt": ["vgg19"], "be": FIVE, "poisson": False},
    "D": {"rt": FIVE, "be": FIVE, "poisson": False},
    "E": {"rt": FIVE, "be": FIVE, "poisson": True},
    # Host-bound (docs/benchmarks/host_path.md): one-layer models whose batch is short, so the handler's
    # host work per request, not compute, sets what REEF sustains; a CPU shows what a fast GPU would.
    "T": {"rt": ["bert-tiny1"], "be": ["gpt2-tiny1"], "poisson": False},
}
POLICIES = ("rt-only", "seq", "concurrent", "reef")
LABELS = {
    "rt-only": "RT only",
    "seq": "SEQ",
    "concurrent": "concurrent",
    "reef": "REEF",
    "reef-pad": "REEF (padding)",
    "reef-green": "REEF (split SMs)",
    "reef-graphs": "REEF (BE units as graphs)",
}
CLAIMS = {
    "rt_mean_within_10pct_of_rt_only": "REEF's RT mean within 10 % of RT-only (bar)",
    "throughput_at_least_2x_rt_only": "overall throughput ≥ 2× RT-only (bar)",
    "rt_mean_within_5pct_of_rt_only": "REEF's RT mean within 5 % of RT-only (GPU bar)",
    "throughput_at_least_3x_rt_only": "overall throughput ≥ 3× RT-only (GPU bar)",
}


def members_of(workload: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys([*workload["rt"], *workload["be"]]))


def workload_settings(args: argparse.Namespace, workload: dict[str, Any]) -> dict[str, Any]:
    """A REEF archive's settings for a workload: its RT models real-time by default; the run's segments, batches."""
    return {
        "realtime": list(workload["rt"]),
        "segments": args.segments,
        "rt_max_batch": args.rt_max_batch,
        "be_max_batch": args.be_max_batch,
    }


def longest_segment_ms(names: list[str], segments: int, batch: int) -> dict[str, float]:
    """Each BE model's slowest segment at the BE batch size on one thread (a BE executor's share on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // len(names)))
    out = {}
    try:
        for name in names:
            spec = get_spec(name)
            model = build_model(spec)
            sliced = slice_catalog_model(spec, model, segments)
            prof = measure_segments(
                sliced, lambda b, s=spec: example_inputs(s, b), [batch], name, warmup=1, iters=3, progress=False
            )
            out[name] = max(prof.ms(s, batch) for s in range(prof.segments))
    finally:
        torch.set_num_threads(threads)
    return out


async def one_run(
    url: str,
    rt_rates: dict[str, float],
    poisson: bool,
    be: list[str],
    seconds: float,
    seed: int,
    specs: dict[str, ModelSpec],
) -> tuple[LoadResult, list[LoadResult]]:
    """Every RT client's schedule and every BE client, together; the RT clients' answers as one result."""
    rt_loads = [
        open_loop(
            url,
            lambda i, n=name: client_payload(specs[n], seed * 1000 + i),
            [(seconds, rate)],
            poisson=poisson,
            seed=seed * 100 + k,
            headers={"X-Model": name, "X-Priority": "realtime"},
        )  # fmt: skip
        for k, (name, rate) in enumerate(rt_rates.items())
    ]
    be_loads = [
        closed_loop(
            url,
            lambda i, n=name: client_payload(specs[n], 7 + i % 8),
            1,
            seconds,
            headers={"X-Model": name, "X-Priority": "best-effort"},
        )  # fmt: skip
        for name in be
    ]
    results = await asyncio.gather(*rt_loads, *be_loads)
    rt = results[: len(rt_loads)]
    merged = LoadResult([x for r in rt for x in r.samples], max(r.wall_s for r in rt))
    return merged, list(results[len(rt_loads) :])


def preemption_latencies(log_text: str) -> list[float]:
    """Preemption latencies (ms) in the worker's log lines (``PREEMPTION_LOG``)."""
    pattern = re.compile(
        re.escape(PREEMPTION_LOG) + r" \d+ best-effort unit\(s\) in flight; real-time waited ([0-9.]+) ms"
    )
    return [float(m.group(1)) for m in pattern.finditer(log_text)]


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    workload = WORKLOADS[args.workload]
    names = members_of(workload)
    specs = {n: get_spec(n) for n in names}
    settings = workload_settings(args, workload)
    bound_ms = longest_segment_ms(workload["be"], args.segments, args.be_max_batch)
    store = workdir / "model_store"
    store.mkdir(parents=True)
    archives = {}
    for policy in ("seq", "concurrent", "reef"):
        options = ServingOptions(handler="reef", handler_settings=tuple({**settings, "policy": policy}.items()))
        built = build_group_archive([specs[n] for n in names], workdir / policy, options)
        archives[policy] = f"{built.stem}-{policy}.mar"
        shutil.copy(built, store / archives[policy])
    rows: dict[str, list[dict[str, Any]]] = {p: [] for p in POLICIES}
    with TorchServeProcess(workdir / "ts", store) as server:
        mgmt = server.management()
        url = {p: f"{server.inference_url}/predictions/reef-{p}" for p in POLICIES}
        for policy in ("seq", "concurrent", "reef"):
            mgmt.register(archives[policy], model_name=f"reef-{policy}", initial_workers=1)
        url["rt-only"] = url["reef"]
        for policy in ("seq", "concurrent", "reef"):  # warm every worker with every model
            for name in names:
                asyncio.run(
                    closed_loop(url[policy], lambda i, n=name: client_payload(specs[n], i), 1, args.warmup_seconds,
                                headers={"X-Model": name})
                )  # fmt: skip
        l1_ms = {}
        for name in workload["rt"]:  # each RT model alone: the scale of this machine
            single = asyncio.run(
                closed_loop(url["reef"], lambda i, n=name: client_payload(specs[n], i), 1, args.calibrate_seconds,
                            headers={"X-Model": name, "X-Priority": "realtime"})
            )  # fmt: skip
            l1_ms[name] = single.mean_latency_ms()
        # RT clients share --rt-load: each keeps the worker busy rt_load / (number of RT clients) of the time.
        rt_rates = {n: args.rt_load / len(l1_ms) / (ms / 1e3) for n, ms in l1_ms.items()}
        offset = server.model_log_size()
        order = list(POLICIES)
        for repeat in range(args.repeats):
            for policy in order if repeat % 2 == 0 else order[::-1]:
                be = [] if policy == "rt-only" else workload["be"]
                started = time.monotonic()
                rt, be_results = asyncio.run(
                    one_run(url[policy], rt_rates, workload["poisson"], be, args.seconds, repeat, specs)
                )
                wall = time.monotonic() - started
                time.sleep(0.5)  # the worker's log line of the last preemption
                text, offset = server.model_log_read(offset)
                latencies = preemption_latencies(text)
                rows[policy].append(run_row(rt, be_results, wall, latencies if policy in ("reef", "rt-only") else []))
                print(f"repeat {repeat + 1}/{args.repeats} {policy}: {summary_line(rows[policy][-1])}", flush=True)
    return summarise(args, workload, names, settings, rows, l1_ms, rt_rates, bound_ms)


def run_row(rt: LoadResult, be: list[LoadResult], wall_s: float, preemption_ms: list[float]) -> dict[str, Any]:
    """One system's run: the RT clients' latencies, every client's answers and failures, its preemptions."""
    return {
        "rt_mean_ms": rt.mean_latency_ms(),
        "rt_p99_ms": rt.percentile_ms(99),
        "rt_answered": len(rt.ok),
        "be_answered": sum(len(r.ok) for r in be),
        "failed": rt.failed + sum(r.failed for r in be),
        "wall_s": wall_s,
        "preemption_ms": preemption_ms,
    }


def summary_line(row: dict[str, Any]) -> str:
    return (
        f"RT mean {row['rt_mean_ms']:.0f} ms, p99 {row['rt_p99_ms']:.0f} ms; "
        f"{(row['rt_answered'] + row['be_answered']) / row['wall_s']:.2f} answers/s; "
        f"{len(row['preemption_ms'])} preemptions; {row['failed']} failed"
    )


def summarise(args, workload, names, settings, rows, l1_ms, rt_rates, bound_ms, systems=POLICIES) -> dict[str, Any]:  # noqa: ANN001
    """The table's numbers per system (``systems``: RT-only first, then the policies run, REEF among them)."""
    policies = systems

    def throughput(row: dict[str, Any]) -> float:
        return (row["rt_answered"] + row["be_answered"]) / row["wall_s"]

    systems = {}
    for policy in policies:
        reps = rows[policy]
        preempting = policy.startswith("reef")
        base = rows["rt-only"]
        latencies = [x for r in reps for x in r["preemption_ms"]]
        systems[policy] = {
            "rt_mean_ms": statistics.median(r["rt_mean_ms"] for r in reps),
            "rt_p99_ms": statistics.median(r["rt_p99_ms"] for r in reps),
            "rt_mean_vs_rt_only": [r["rt_mean_ms"] / b["rt_mean_ms"] for r, b in zip(reps, base, strict=True)],
            "throughput": statistics.median(throughput(r) for r in reps),
            "be_throughput": statistics.median(r["be_answered"] / r["wall_s"] for r in reps),
            "throughput_vs_rt_only": [throughput(r) / throughput(b) for r, b in zip(reps, base, strict=True)],
            "preemptions": (sum(r.get("preemptions", len(r["preemption_ms"])) for r in reps) if preempting else None),
            "preemption_ms": (
                {
                    "mean": statistics.mean(latencies),
                    "p99": sorted(latencies)[round(0.99 * (len(latencies) - 1))],
                    "max": max(latencies),
                }
                if preempting and latencies
                else None
            ),  # fmt: skip
            "failed": sum(r["failed"] for r in reps),
            "repeats": reps,
        }
    reef = systems["reef"]
    return {
        "model": f"workload{args.workload}",
        "workload": {"name": args.workload, **workload, "members": names},
        "settings": settings,
        "l1_ms": l1_ms,
        "rt_rate_rps": rt_rates,
        "rt_load": args.rt_load,
        "seconds": args.seconds,
        "repeats": args.repeats,
        "longest_be_segment_ms": bound_ms,
        "systems": systems,
        "claims": {
            "rt_mean_within_10pct_of_rt_only": statistics.median(reef["rt_mean_vs_rt_only"]) <= 1.10,
            "throughput_at_least_2x_rt_only": statistics.median(reef["throughput_vs_rt_only"]) >= 2.0,
        },
        "rows": [{"failed": s["failed"]} for s in systems.values()],
    }


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def render(data: dict[str, Any], stem: str) -> str:
    w = data["workload"]
    header = [
        "system", "RT mean ms", "RT p99 ms", "RT mean ÷ RT-only", "answers/s (all)", "BE answers/s",
        "answers/s ÷ RT-only", "preemptions", "preemption ms mean / p99 / max", "failed",
    ]  # fmt: skip
    body = []
    for policy in data["systems"]:
        s = data["systems"][policy]
        pre = s["preemption_ms"]
        body.append(
            [
                LABELS.get(policy, policy),
                f"{s['rt_mean_ms']:.0f}",
                f"{s['rt_p99_ms']:.0f}",
                spread(s["rt_mean_vs_rt_only"]),
                f"{s['throughput']:.2f}",
                f"{s['be_throughput']:.2f}",
                spread(s["throughput_vs_rt_only"]),
                "-" if s["preemptions"] is None else s["preemptions"],
                "-" if pre is None else f"{pre['mean']:.1f} / {pre['p99']:.1f} / {pre['max']:.1f}",
                s["failed"],
            ]  # fmt: skip
        )
    bound = ", ".join(f"{n} {ms:.0f} ms" for n, ms in data["longest_be_segment_ms"].items())
    claims = {k: "yes" if v else "no" for k, v in data["claims"].items()}
    rates = ", ".join(f"{n} {r:.2f} req/s" for n, r in data["rt_rate_rps"].items())
    l1 = ", ".join(f"{n} {ms:.0f} ms" for n, ms in data["l1_ms"].items())
    return (
        f"# REEF on workload {w['name']} ({data.get('where', 'one TorchServe worker, CPU')})\n\n"
        f"RT: one client each on {', '.join(w['rt'])} at {'Poisson' if w['poisson'] else 'uniform'} arrivals; "
        f"BE: one closed-loop client each on {', '.join(w['be'])}. RT rates: {rates}, together {data['rt_load']} of "
        f"the worker's time by each RT model's L1 ({l1}; the model alone on this worker, measured in this run): "
        "the scaling to this machine. "
        f"{data['seconds']:.0f} s per run, {data['repeats']} interleaved repeat(s); a ratio is the system's over "
        f"RT-only's in the same repeat, median (min-max). Settings: `{data['settings']}`.\n\n"
        + markdown_table(header, body)
        + f"\n\n![RT latency and throughput]({stem}.png)\n\n"
        + "".join(f"- {CLAIMS[k]}: **{v}**\n" for k, v in claims.items())
        + "- Preemption latency: from the RT admission until no BE segment was in flight, one log line per "
        "preemption."
        + (
            f" The bound is one BE segment at the BE batch size on a BE executor's share of the cores, "
            f"measured before the run: {bound}."
            if bound
            else ""
        )
        + "\n\n"
        + provenance_block(data["provenance"])
    )


def plot(data: dict[str, Any], path: Path) -> None:
    fig, ax = new_figure((6.5, 3.6))
    policies = list(data["systems"])
    xs = list(range(len(policies)))
    means = [data["systems"][p]["rt_mean_ms"] for p in policies]
    colours = ["#999999", "#d62728", "#ff7f0e", "#1f77b4", "#2ca02c"]
    ax.bar(xs, means, color=colours[: len(policies)], label="RT mean latency")
    for x, p in zip(xs, policies, strict=True):
        ax.annotate(f"{data['systems'][p]['throughput']:.2f}/s", (x, means[x]), ha="center", va="bottom")
    ax.set_xticks(xs, [LABELS.get(p, p) for p in policies])
    title = f"workload {data['workload']['name']}: RT mean latency (bars), all answers/s (labels)"
    save_figure(fig, ax, path, "system", "RT mean latency (ms)", title)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="A")
    parser.add_argument("--quick", action="store_true", help="short runs, one repeat (a smoke run)")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rt-load", type=float, default=0.3, help="RT arrivals per L1 (the RT model alone)")
    parser.add_argument(
        "--segments",
        type=int,
        default=16,
        help="units a BE batch is cut into (preemption points: docs/handlers/reef.md)",
    )
    parser.add_argument("--rt-max-batch", type=int, default=4)
    parser.add_argument("--be-max-batch", type=int, default=1)
    parser.add_argument("--warmup-seconds", type=float, default=3.0)
    parser.add_argument("--calibrate-seconds", type=float, default=6.0)
    parser.add_argument("--out-dir", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.repeats, args.warmup_seconds, args.calibrate_seconds = 8.0, 1, 1.0, 2.0
    return run_and_publish(args, "bench.reef", measure, lambda d: sum(r["failed"] for r in d["rows"]), render, plot)


if __name__ == "__main__":
    sys.exit(main())
