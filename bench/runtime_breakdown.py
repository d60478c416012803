"""Where a request's time goes: the async runtime (Ebird) against the sync CPU handler, inside TorchServe.

    python bench/runtime_breakdown.py --model resnet50 --rates 0.3,0.85

One TorchServe serves the model once per system (``--systems``), one
worker each: ``ebird`` (the async runtime as it ships: decode, admission,
the engine's queue and batch, the hand-back to the event loop, encode),
``ebird-plan`` (the same with ``cpu_rule: plan``: the paper's plan over
every idle worker instead of one batch per free lane),
``ebird-small`` (the same with worker batches 1, 1, 2, 4, 8: no batch of
16), ``ebird-ts-pump`` (the same on TorchServe's own async message pump,
``worker_pump: torchserve``, the runtime before ``worker_pump.py``),
``ebird-per-event`` (the same with ``metrics_flush_interval_s: 0``: a
metrics log line at every event, the runtime before its flush thread),
``ebird-loop`` (``decode_threads: 0``: decoded on the event loop while a
batch runs, the runtime before the lanes), ``ebird-loop-answers``
(``encode_answers: loop``: answers encoded on the event loop, beside the
lane's next job, the runtime before it encoded them on the lane),
``ebird-loud-batches`` (``cpu_quiet_batches: false``: the worker reads
requests while a batch runs, the runtime before it held them) and ``nowait`` (the plain handler
under TorchServe's own batching, batch_size 32, max_batch_delay 0).  So
"before" and "after" are measured side by side in one run.  At each open-loop Poisson
rate, a fraction of 1/L1 (L1: one request at a time through ``nowait``), the
systems take turns on the same arrivals; the handlers' stage
counters (``HandlerStageSeconds`` / ``HandlerStageCount`` on TorchServe's
metrics endpoint, see ``handlers/runtime/metrics.py``) are read before and
after, so each stage's mean is per answered request.  What the client saw
beyond the handler's stages is the frontend's share (HTTP, the frontend's
queue and batch aggregation, the socket to the worker, the worker's message
loop).  The CPU that the frontend and the worker's threads spent per
answered request comes from ``/proc`` (``bench/proc_cpu.py``), and so does
the time the worker's threads were runnable but had no core (schedstat's
run-queue wait): on a 2-core machine, what the worker's side threads cost
the batch's OpenMP team.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from archiver.build import build_archive
from archiver.options import ServingOptions
from bench.batching_compare import batch_counts
from bench.proc_cpu import CpuMeter, java_in_group
from bench.report import (
    add_output_arguments,
    markdown_table,
    new_figure,
    provenance_block,
    run_benchmark,
    save_figure,
)
from handlers.runtime.metrics import DEFAULT_FLUSH_INTERVAL_S
from model_store.catalog import get_spec
from model_store.samples import client_payload
from serving_harness.loadgen import closed_loop, open_loop, run
from serving_harness.torchserve import TorchServeProcess

ALL_SYSTEMS = (
    "ebird",
    "ebird-plan",
    "ebird-small",
    "ebird-ts-pump",
    "ebird-per-event",
    "ebird-loop",
    "ebird-loop-answers",
    "ebird-loud-batches",
    "nowait",
    "nowait-twin",
)
PLAIN = ("nowait", "nowait-twin")  # served by the plain handler under TorchServe's NO Wait batching
DEFAULT_SYSTEMS = "ebird,ebird-per-event,nowait"
ASYNC_STAGES = ("decode", "admission", "queue", "batch", "release", "wakeup", "encode")
STAGES = {name: ASYNC_STAGES for name in ALL_SYSTEMS} | {name: ("decode", "model", "encode") for name in PLAIN}
DESCRIPTIONS = {
    "ebird": "the async runtime as it ships: requests decoded and answers encoded on the CPU lane between "
    "batches, metrics handed to TorchServe once a second",
    "ebird-plan": "the same with `cpu_rule: plan`: the paper's plan over every idle worker, its batches back to "
    "back on the lane, as the runtime batched on CPU before the lane rule",
    "ebird-small": "the same with `worker_batches: [1, 1, 2, 4, 8]` (no batch of 16)",
    "ebird-ts-pump": "the same with `worker_pump: torchserve`: TorchServe's own async message pump, as the runtime "
    "ran before `handlers/runtime/worker_pump.py`",
    "ebird-per-event": "the same with `metrics_flush_interval_s: 0`: a metrics log line at every event "
    "(~17 per request), as the runtime did before the flush thread",
    "ebird-loop": "the same with `decode_threads: 0`: decoded on the event loop while batches run, as before the lanes",
    "ebird-loop-answers": "the same with `encode_answers: loop`: answers encoded on the event loop, beside the "
    "lane's next decode or batch, as before the runtime encoded them on the lane",
    "ebird-loud-batches": "the same with `cpu_quiet_batches: false`: the worker reads and starts requests while "
    "the lane runs a batch, as before batches held the message reader",
    "nowait": "the plain handler under TorchServe's NO Wait batching (batch_size 32, max_batch_delay 0)",
    "nowait-twin": "a second model served exactly as `nowait`: its ratio to `nowait` is what this bench reads "
    "when there is no difference to find (an A/A check of its noise)",
}
# Systems that are the runtime before one change, and what ``ebird`` ÷ that system measures.
BEFORE_AFTER = {
    "ebird-per-event": "Metrics once a second against a line per event",
    "ebird-loop-answers": "Answers encoded on the lane against on the event loop",
    "ebird-loud-batches": "No requests read during a batch against read as they arrive",
}
EBIRD_SETTINGS = {"worker_batches": [1, 1, 2, 4, 8, 16], "max_inflight": 32, "pool_slots": 64, "cpu_lanes": 1}


def stage_totals(server: TorchServeProcess, model: str) -> dict[str, tuple[float, float]]:
    """Per stage: (seconds, requests) so far, from the metrics endpoint; plus
    ``"batches"``: (requests batched, batches run)."""
    metrics = server.metrics()
    seconds = {k["Stage"]: v for k, v in metrics.samples("HandlerStageSeconds") if k.get("ModelName") == model}
    counts = {k["Stage"]: v for k, v in metrics.samples("HandlerStageCount") if k.get("ModelName") == model}
    out = {stage: (seconds.get(stage, 0.0), counts.get(stage, 0.0)) for stage in counts}
    sizes = batch_counts(metrics, model)
    out["batches"] = (sum(b * n for b, n in sizes.items()), sum(sizes.values()))
    return out


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    spec = get_spec(args.model, args.mode)
    systems = args.systems
    store = workdir / "model_store"
    settings = tuple(sorted(EBIRD_SETTINGS.items()))
    small = tuple(sorted((EBIRD_SETTINGS | {"worker_batches": [1, 1, 2, 4, 8]}).items()))
    plan = tuple(sorted((EBIRD_SETTINGS | {"cpu_rule": "plan"}).items()))
    loud = tuple(sorted((EBIRD_SETTINGS | {"cpu_quiet_batches": False}).items()))
    options = {
        "ebird": ServingOptions(handler="ebird", handler_settings=settings),
        "ebird-small": ServingOptions(handler="ebird", handler_settings=small),
        "ebird-plan": ServingOptions(handler="ebird", handler_settings=plan),
        "ebird-ts-pump": ServingOptions(handler="ebird", handler_settings=settings, worker_pump="torchserve"),
        "ebird-per-event": ServingOptions(handler="ebird", handler_settings=settings, metrics_flush_interval_s=0),
        "ebird-loop": ServingOptions(handler="ebird", handler_settings=settings, decode_threads=0),
        "ebird-loop-answers": ServingOptions(handler="ebird", handler_settings=settings, encode_answers="loop"),
        "ebird-loud-batches": ServingOptions(handler="ebird", handler_settings=loud),
        "nowait": ServingOptions(),
        "nowait-twin": ServingOptions(),
    }
    archives = {}
    store.mkdir(parents=True, exist_ok=True)
    for name in systems:  # archives of one model share a file name: each is built apart, then renamed
        built = build_archive(spec, workdir / "build" / name, options[name])
        archives[name] = built.rename(store / f"{built.stem}-{name}.mar")
    payloads = [client_payload(spec, seed=i) for i in range(64)]
    rows = []
    with TorchServeProcess(workdir / "ts", store) as server:
        mgmt = server.management()
        for name in systems:
            batching = {"batch_size": 32, "max_batch_delay_ms": 0} if name in PLAIN else {}
            mgmt.register(archives[name].name, model_name=name, initial_workers=1, **batching)
        frontend = java_in_group(server.proc.pid)
        meters = {name: CpuMeter(frontend, int(mgmt.describe(name)[0]["workers"][0]["pid"])) for name in systems}
        url = {name: f"{server.inference_url}/predictions/{name}" for name in systems}
        for name in systems:
            run(closed_loop(url[name], lambda i: payloads[i % 64], 4, args.warmup_seconds))
        single = run(closed_loop(url["nowait"], lambda i: payloads[i % 64], 1, args.calibrate_seconds))
        l1_s = single.mean_latency_ms() / 1e3
        fractions = [float(x) for x in args.rates.split(",")]
        with tqdm(total=len(fractions) * args.repeats * len(systems), desc="breakdown", unit="run") as bar:
            for fraction in fractions:
                rate = fraction / l1_s
                for r in range(args.repeats):
                    for name in systems if r % 2 == 0 else systems[::-1]:  # ABC, CBA, …
                        before = stage_totals(server, name)
                        meters[name].start()
                        result = run(open_loop(url[name], lambda i: payloads[i % 64], [(args.seconds, rate)], seed=r))
                        spent = meters[name].stop()  # before the wait below: CPU of this run only
                        # The handler's next metrics flush, then the frontend's parse of it.
                        time.sleep(DEFAULT_FLUSH_INTERVAL_S + 0.5)
                        after = stage_totals(server, name)
                        stages_ms = {}
                        for stage in STAGES[name]:
                            s1, n1 = after.get(stage, (0.0, 0.0))
                            s0, n0 = before.get(stage, (0.0, 0.0))
                            stages_ms[stage] = 1e3 * (s1 - s0) / max(1.0, n1 - n0)
                        (q1, b1), (q0, b0) = after["batches"], before["batches"]
                        mean_batch = (q1 - q0) / max(1.0, b1 - b0)
                        rows.append({"system": name, "fraction": fraction, "rate": rate, "repeat": r,
                                     "mean_batch": mean_batch,
                                     "requests": len(result.samples), "failed": result.failed,
                                     "client_ms": result.mean_latency_ms(), "stages_ms": stages_ms,
                                     "cpu_ms": {part: 1e3 * seconds / max(1, len(result.samples))
                                                for part, seconds in asdict(spent.cpu).items()},
                                     "wait_ms": None if spent.worker_waiting is None
                                     else 1e3 * spent.worker_waiting / max(1, len(result.samples))})  # fmt: skip
                        bar.update()
    return {"model": spec.name, "mode": spec.mode, "l1_ms": 1e3 * l1_s, "rows": rows, "repeats": args.repeats,
            "systems": list(systems)}  # fmt: skip


def parse_systems(text: str) -> tuple[str, ...]:
    systems = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = [s for s in systems if s not in ALL_SYSTEMS]
    if unknown or "nowait" not in systems:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(ALL_SYSTEMS)}, nowait included; got {text!r}")
    return systems


def per_repeat_ratios(data: dict[str, Any], name: str, over: str, fraction: float) -> list[float]:
    """``name``'s client mean over ``over``'s, repeat by repeat (same arrivals, run back to back)."""
    by = {(r["system"], r["repeat"]): r["client_ms"] for r in data["rows"] if r["fraction"] == fraction}
    return [by[(name, k)] / by[(over, k)] for k in range(data["repeats"]) if (name, k) in by and (over, k) in by]


def summary(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Mean over repeats per (system, load): client latency, each stage, the rest (frontend), CPU per request."""
    out = []
    for fraction in sorted({r["fraction"] for r in data["rows"]}):
        for name in data["systems"]:
            runs = [r for r in data["rows"] if r["system"] == name and r["fraction"] == fraction]
            client = sum(r["client_ms"] for r in runs) / len(runs)
            stages = {s: sum(r["stages_ms"][s] for r in runs) / len(runs) for s in STAGES[name]}
            requests, failed = sum(r["requests"] for r in runs), sum(r["failed"] for r in runs)
            mean_batch = sum(r["mean_batch"] for r in runs) / len(runs)
            cpu = {part: sum(r["cpu_ms"][part] for r in runs) / len(runs) for part in runs[0]["cpu_ms"]}
            waits = [r["wait_ms"] for r in runs if r.get("wait_ms") is not None]
            out.append({"system": name, "fraction": fraction, "rate": runs[0]["rate"], "client_ms": client,
                        "stages_ms": stages, "outside_ms": client - sum(stages.values()), "cpu_ms": cpu,
                        "wait_ms": sum(waits) / len(waits) if waits else None,
                        "vs_nowait": per_repeat_ratios(data, name, "nowait", fraction),
                        "requests": requests, "failed": failed, "mean_batch": mean_batch})  # fmt: skip
    return out


def spread(ratios: list[float]) -> str:
    if not ratios:
        return ""
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def plot(data: dict[str, Any], path: Path) -> None:
    rows = data["summary"]
    fig, ax = new_figure((7.5, 3.8))
    labels = [f"{r['system']}\n{r['rate']:.1f}/s" for r in rows]
    names = list(dict.fromkeys(s for r in rows for s in r["stages_ms"])) + ["frontend and the rest"]
    bottoms = [0.0] * len(rows)
    for stage in names:
        values = [r["outside_ms"] if stage == names[-1] else r["stages_ms"].get(stage, 0.0) for r in rows]
        ax.bar(labels, values, bottom=bottoms, label=stage)
        bottoms = [b + max(0.0, v) for b, v in zip(bottoms, values, strict=True)]
    title = f"{data['model']}: where a request's time goes (client mean = bar height)"
    save_figure(fig, ax, path, "", "mean ms per request", title, legend={"fontsize": 7, "ncol": 2})


def render(data: dict[str, Any], stem: str) -> str:
    systems = data["systems"]
    all_stages = list(dict.fromkeys(s for name in systems for s in STAGES[name]))
    table = markdown_table(
        ["system", "load (req/s)", "client mean ms", "÷ nowait, per repeat: median (min-max)", "mean batch",
         *all_stages, "frontend and the rest", "requests (failed)"],
        [[r["system"], f"{r['rate']:.1f} ({r['fraction']:.0%} of 1/L1)", f"{r['client_ms']:.1f}",
          spread(r["vs_nowait"]), f"{r['mean_batch']:.2f}",
          *(f"{r['stages_ms'][s]:.1f}" if s in r["stages_ms"] else "" for s in all_stages),
          f"{r['outside_ms']:.1f}", f"{r['requests']} ({r['failed']})"] for r in data["summary"]],
    )  # fmt: skip
    cpu_table = markdown_table(
        ["system", "load (req/s)", "frontend (Java)", "worker main thread", "worker other threads", "all",
         "worker threads' run-queue wait"],
        [[r["system"], f"{r['rate']:.1f}", *(f"{r['cpu_ms'][p]:.1f}" for p in ("frontend", "worker_main",
          "worker_others")), f"{sum(r['cpu_ms'].values()):.1f}",
          "-" if r.get("wait_ms") is None else f"{r['wait_ms']:.1f}"] for r in data["summary"]],
    )  # fmt: skip
    before_after = ""
    for before, what in BEFORE_AFTER.items():
        if before not in systems or "ebird" not in systems:
            continue
        lines = [
            f"- {fraction:.0%} of 1/L1: {spread(per_repeat_ratios(data, 'ebird', before, fraction))}"
            for fraction in sorted({r["fraction"] for r in data["rows"]})
        ]
        before_after += (
            f"{what} (`ebird` ÷ `{before}`, client mean, per repeat: median (min-max)):\n\n" + "\n".join(lines) + "\n\n"
        )
    described = "\n".join(f"- `{name}`: {DESCRIPTIONS[name]}" for name in systems)
    return (
        f"# Where a request's time goes: {data['model']} ({data['mode']})\n\n"
        f"{described}\n\n"
        f"One worker each, one TorchServe, open-loop Poisson at fractions of 1/L1 "
        f"(L1 = {data['l1_ms']:.0f} ms), {data['repeats']} interleaved runs each, every system on the same arrivals "
        f"in a repeat. Stages are the handlers' own counters (mean ms per answered request); the plain handler's "
        f"are those of the batch a request was in. 'Frontend and the rest' = client mean minus the stages.\n\n"
        f"{table}\n\n{before_after}"
        f"CPU per answered request (ms, mean over repeats, from /proc; in TorchServe's worker the main thread "
        f"runs the handler (sync) or the event loop (async); the other threads are the batch's OpenMP team, "
        f"the CPU lane and, in async mode, TorchServe's socket threads; the run-queue wait is the time the worker's "
        f"threads were runnable but had no core, from /proc/…/schedstat: a batch's OpenMP team waits at its "
        f"barrier for a member that was preempted):\n\n{cpu_table}\n\n"
        f"![breakdown]({stem}.png)\n\n"
        f"{provenance_block(data['provenance'])}"
    )


def stem_of(data: dict[str, Any]) -> str:
    return f"runtime_breakdown_{data['model']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--mode", default="script", choices=("eager", "script", "compile"))
    parser.add_argument("--rates", default="0.3,0.85", help="loads as fractions of 1/L1, comma-separated")
    parser.add_argument("--seconds", type=float, default=20.0, help="one run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup-seconds", type=float, default=5.0)
    parser.add_argument("--calibrate-seconds", type=float, default=5.0)
    parser.add_argument(
        "--systems",
        type=parse_systems,
        default=DEFAULT_SYSTEMS,
        help=f"comma-separated, from {', '.join(ALL_SYSTEMS)} (nowait required)",
    )
    parser.add_argument("--suffix", default="", help="appended to the output stem, e.g. _lane_rule")
    add_output_arguments(parser)
    args = parser.parse_args(argv)

    def stem(data: dict[str, Any]) -> str:
        return stem_of(data) + args.suffix

    return run_benchmark("bench.runtime_breakdown", args, measure, summary, stem, render, plot)


if __name__ == "__main__":
    raise SystemExit(main())
