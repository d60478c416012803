"""Ebird against NO Wait batching with the handlers driven in-process, for machines without TorchServe.

    python -m bench.ebird_direct --device cuda
    python -m bench.ebird_direct --quick            # CPU, about two minutes

TorchServe's frontend is Java, so a GPU machine without Java cannot run
``bench/ebird.py``.  Here each system runs in its own process, as a
TorchServe worker would, and its handler object is called exactly as
TorchServe's Python worker calls it (``bench/direct.py``):

- ``ebird``: the Ebird handler in async mode.  Every request is its own
  ``handle`` call on the worker's event loop, as ``asyncCommunication: true``
  makes them.
- ``nowait``: the plain handler under the frontend's batching with
  ``batch_size`` 32 and ``max_batch_delay`` 0, emulated in a few lines:
  whenever the worker is free it gets every queued request, up to 32, as one
  ``handle`` call.  That is what TorchServe's batch aggregator does when it
  may not wait.

``--wait-ms 5,10`` adds the same plain handler behind a frontend that
waits up to that long for a fuller batch (``max_batch_delay``; ``waitN``),
the baselines a tuned TorchServe deployment would use (DelayBatch in the
DVABatch paper).

``--handler dvabatch`` drives DVABatch (``dvabatch``) in Ebird's place
against the same baselines; token models get requests of mixed lengths
(``bench/dvabatch.py``'s ``TOKEN_LENGTH_MIX``), which the baselines pad to
the sequence length and DVABatch to its length classes.  ``--handler reef``
drives REEF with the model as its one real-time member (``reef``): its
real-time path, request by request, against the same baselines (its
best-effort preemption is ``bench/reef_direct.py``'s).

``--base REV`` serves the handler a second time, as the code of commit REV
serves it (``ebird@REV``, from a git worktree made for the run): both
commits take turns on the same arrivals at the same rates, so a change's
before and after are read side by side in one run (two runs set their
loads from two capacity readings, 9 % apart on the 2-vCPU VM, and at
Ebird's knee two runs of the same code differed 2-3× in mean).  Its column ``Ebird ÷ Ebird at REV`` is
the change's effect; with ``--twin`` beside it, NO Wait's twin gives the
band within which it is none.

``--twin`` serves NO Wait a second time as a system of its own
(``nowait-twin``): its ratio to NO Wait, on the same arrivals, is the band
inside which this bench cannot tell two systems apart on this machine.

On CUDA, ``--graphs-compare`` (the default there) adds two systems, so the
table tells Ebird's scheduling apart from its execution:

- ``ebird-eager``: Ebird with ``cuda_graphs: false``, each batch launched
  kernel by kernel (Ebird before it replayed graphs);
- ``nowait-graphs``: NO Wait with the plain handler replaying captured
  graphs (``cuda_graphs: true``), the same execution Ebird's workers have.

``--same-execution`` adds ``nowait-graphs-batched``: NO Wait replaying
graphs and decoding each batch's JPEGs in one call (``decode_threads:
batched``), the execution of Ebird with batched decoding; that Ebird's
ratio column is then against it.

Left out: the HTTP hop and the Java frontend, which both systems pay alike.

Load is set from capacity, as the Ebird paper sets it from a QoS-bounded
load.  Each system's sustainable throughput is measured first (closed loop,
``--clients`` in flight).  Open-loop Poisson phases then run at fractions of
the better one (default 30% and 85%).  A fraction ≥ 1 is overload: it is
reported in its own labelled rows, since there every queue grows for the
whole phase.  At each fraction the two systems take turns (ABBA over
repeats) on identical arrival times.  The ratio Ebird ÷ NO Wait of mean
latency is reported per repeat, as median and spread.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.direct import model_dir_for
from bench.direct_systems import (
    BASELINE,
    DVABATCH,
    EBIRD_EAGER,
    GRAPH_BASELINE,
    NOWAIT_BATCH,
    REEF,
    SAME_EXECUTION,
    TWIN,
    SystemProcess,
    at_commit,
    ebird_system,
    execution_twin,
    is_baseline,
    label,
    python_us,
)
from bench.report import (
    add_output_arguments,
    markdown_table,
    new_figure,
    provenance_block,
    run_benchmark,
    save_figure,
)
from model_store.catalog import get_spec
from serving_harness.loadgen import LoadResult, arrival_times


def latency_stats(result: LoadResult) -> dict[str, Any]:
    return {
        "requests": len(result.samples),
        "failed": result.failed,
        "mean_ms": result.mean_latency_ms(),
        "p99_ms": result.percentile_ms(99),
    }


def mean_batch(runs: dict[int, int]) -> float:
    batches = sum(runs.values())
    return sum(size * n for size, n in runs.items()) / batches if batches else math.nan


REPOSITORY = Path(__file__).resolve().parent.parent


def resolve_commit(rev: str) -> str:
    """``rev``'s short hash in this repository; ValueError if it names no commit."""
    found = subprocess.run(
        ["git", "-C", str(REPOSITORY), "rev-parse", "--short=7", "--verify", "--quiet", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        raise ValueError(f"{rev!r} names no commit of {REPOSITORY}")
    return found.stdout.strip()


@contextlib.contextmanager
def checkout(commit: str | None, where: Path):
    """A detached worktree of ``commit`` at ``where`` for the run, removed after it (None: nothing)."""
    if commit is None:
        yield None
        return
    git = ["git", "-C", str(REPOSITORY), "worktree"]
    subprocess.run([*git, "add", "--detach", "--force", str(where), commit], check=True, capture_output=True)
    try:
        yield where
    finally:
        subprocess.run([*git, "remove", "--force", str(where)], capture_output=True)


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    spec = get_spec(args.model, args.mode)
    model_dir = model_dir_for(spec, workdir / "model")
    names = [*args.systems, BASELINE]
    systems: dict[str, SystemProcess] = {}
    with contextlib.ExitStack() as stack:
        tree = stack.enter_context(checkout(args.base, workdir / "base"))
        stack.callback(lambda: [proc.close() for proc in systems.values()])
        for name in names:
            systems[name] = SystemProcess(
                name, args.model, args.mode, model_dir, args.device, args.max_batch,
                tree=tree if at_commit(name)[1] else None,
            )  # fmt: skip
        for proc in systems.values():
            proc.wait_ready()
        for proc in systems.values():  # first kernels, allocator, lazy imports
            proc.run("closed", 300.0, clients=args.clients, seconds=args.warmup_seconds)
        capacity_runs: dict[str, list[float]] = {name: [] for name in systems}
        host_runs: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
        batch_runs: dict[str, list[float]] = {name: [] for name in systems}
        for r in range(args.capacity_repeats):  # rounds, each system once, the order reversed every other round
            for name in names if r % 2 == 0 else names[::-1]:
                closed, counters = systems[name].run(
                    "closed", 300.0, clients=args.clients, seconds=args.capacity_seconds
                )
                capacity_runs[name].append(closed["throughput"])
                host_runs[name].append(closed["cpu_us_per_request"])
                batch_runs[name].append(mean_batch(counters["batches"]))
        capacity = {name: statistics.median(runs) for name, runs in capacity_runs.items()}
        host_cpu = {name: median_by_role(runs) for name, runs in host_runs.items()}
        best = max(capacity.values())
        rows = []
        total = len(args.fractions) * args.repeats * len(names)
        with tqdm(total=total, desc=f"{args.handler} direct {args.model} on {args.device}", unit="run") as bar:
            for k, fraction in enumerate(args.fractions):
                rate = fraction * best
                for r in range(args.repeats):
                    times = arrival_times([(args.seconds, rate)], seed=1000 * k + r)
                    for name in names if r % 2 == 0 else names[::-1]:
                        results, counters = systems[name].run("open", 60.0 + 20 * args.seconds, times=times)
                        rows.append({"system": name, "fraction": fraction, "rate": rate, "repeat": r,
                                     "mean_batch": mean_batch(counters["batches"]),
                                     "stages_ms": counters["stages_ms"], **latency_stats(results)})  # fmt: skip
                        bar.update()
    return {
        "model": spec.name,
        "mode": spec.mode,
        "device": systems[BASELINE].device,
        "systems": names,
        "capacity": capacity,
        "capacity_runs": capacity_runs,
        # The mean batch of each capacity round: a system that batches less under the same closed loop pays its
        # per-batch host work over fewer requests.
        "capacity_mean_batch": batch_runs,
        "host_cpu_us": host_cpu,
        "max_batch": args.max_batch,
        "clients": args.clients,
        "seconds": args.seconds,
        "repeats": args.repeats,
        "rows": rows,
    }


def python_cores(requests_per_s: float, host_us: dict[str, float]) -> float:
    """How many cores' worth of CPU the Python threads used while serving ``requests_per_s``.

    Threads that take turns on one GIL use about one core between them,
    plus the torch work they run with the GIL released (all of a model's
    work on a lane of one thread, which has no OpenMP team to share it).
    So a reading near 1.0 says the system was bound by its Python time per
    request, and its capacity is then about one over it: a handler gains
    capacity by spending less Python per request, not by moving that work
    to another thread.
    """
    return requests_per_s * python_us(host_us) / 1e6


def median_by_role(runs: list[dict[str, float]]) -> dict[str, float]:
    """Host µs per request by thread role, the median over capacity rounds (a role a round lacks: 0)."""
    roles = dict.fromkeys(role for run in runs for role in run)
    return {role: statistics.median(run.get(role, 0.0) for run in runs) for role in roles}


def spread_text(values: list[float]) -> str:
    """``median (min–max)`` of a system's per-round readings."""
    return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"


def capacity_spread(capacity_runs: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Each system's closed-loop capacity over the rounds (median, min, max) and its ratio to NO Wait's
    round by round (median, min, max): rounds run back to back, so a ratio within a round is read on
    the same state of the machine, which drifts between rounds on a shared VM."""
    out = {}
    for name, runs in capacity_runs.items():
        ratios = [a / b for a, b in zip(runs, capacity_runs[BASELINE], strict=True)]
        out[name] = {"median": statistics.median(runs), "min": min(runs), "max": max(runs)}
        out[name].update(ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
    return out


def ratio_spread(runs: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict[str, float]:
    """Mean latency ÷ the baseline's, repeat by repeat (same arrivals): median, min, max."""
    ratios = [a["mean_ms"] / b["mean_ms"] for a, b in zip(runs, baseline, strict=True)]
    return {"ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def best_baseline(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per repeat, the stock baseline (NO Wait or a waiting one) with the lower mean latency."""
    baselines = [r for name, r in runs.items() if is_baseline(name)]
    return [min(repeat, key=lambda x: x["mean_ms"]) for repeat in zip(*baselines, strict=True)]


def base_of(system: str, systems: list[str] | dict[str, Any]) -> str | None:
    """The same system at the ``--base`` commit, where one is measured."""
    return next((n for n in systems if at_commit(n)[1] is not None and at_commit(n)[0] == system), None)


def summary(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per load: each system's median mean and p99 over repeats, and each Ebird ÷ NO Wait per repeat."""
    out = []
    for fraction in sorted({r["fraction"] for r in data["rows"]}):
        runs = {n: [r for r in data["rows"] if r["system"] == n and r["fraction"] == fraction] for n in data["systems"]}
        row: dict[str, Any] = {"fraction": fraction, "rate": runs[BASELINE][0]["rate"], "overload": fraction >= 1}
        for name, system_runs in runs.items():
            row[name] = {
                "mean_ms": statistics.median(x["mean_ms"] for x in system_runs),
                "p99_ms": statistics.median(x["p99_ms"] for x in system_runs),
                "mean_batch": statistics.median(x["mean_batch"] for x in system_runs),
                "stages_ms": {
                    stage: statistics.fmean(x["stages_ms"].get(stage, 0.0) for x in system_runs)
                    for stage in dict.fromkeys(s for x in system_runs for s in x["stages_ms"])
                },
                "requests": sum(x["requests"] for x in system_runs),
                "failed": sum(x["failed"] for x in system_runs),
            }
            if name != BASELINE:
                row[name].update(ratio_spread(system_runs, runs[BASELINE]))
            if (twin := execution_twin(name, runs)) is not None:
                row[name]["vs_graphs"] = ratio_spread(system_runs, runs[twin])
            if not is_baseline(name) and name not in (GRAPH_BASELINE, SAME_EXECUTION, TWIN):
                row[name]["vs_best"] = ratio_spread(system_runs, best_baseline(runs))
            if (base := base_of(name, runs)) is not None:
                row[name]["vs_base"] = ratio_spread(system_runs, runs[base])
        out.append(row)
    return out


def plot(data: dict[str, Any], path: Path) -> None:
    rows = data["summary"]
    fig, ax = new_figure((7, 4))
    rates = [r["rate"] for r in rows]
    for k, name in enumerate(data["systems"]):
        colour = f"C{k}"
        ax.plot(rates, [r[name]["mean_ms"] for r in rows], "o-", color=colour, label=f"{label(name)} mean")
        ax.plot(rates, [r[name]["p99_ms"] for r in rows], "s--", color=colour, alpha=0.5, label=f"{label(name)} p99")
    title = f"{data['model']} on {data['device']}: handlers driven in-process"
    save_figure(fig, ax, path, "offered load (requests/s)", "latency (ms)", title, log_y=True, legend={"fontsize": 7})


def render(data: dict[str, Any], stem: str) -> str:
    names = data["systems"]

    def cells(r: dict[str, Any]) -> list[str]:
        load = f"{r['fraction']:.0%} of capacity" + (" (overload)" if r["overload"] else "")
        out = [load, f"{r['rate']:.1f}"]
        for n in names:
            s = r[n]
            out.append(f"{s['mean_ms']:.1f} ({s['p99_ms']:.0f})")
            if n != BASELINE:
                out.append(f"**{s['ratio']:.2f}×** ({s['ratio_min']:.2f}–{s['ratio_max']:.2f})")
            for key in ("vs_graphs", "vs_best", "vs_base"):
                if key in s:
                    g = s[key]
                    out.append(f"**{g['ratio']:.2f}×** ({g['ratio_min']:.2f}–{g['ratio_max']:.2f})")
        out.append(" / ".join(f"{r[n]['mean_batch']:.2f}" for n in names))
        out.append(" / ".join(f"{r[n]['requests']} ({r[n]['failed']})" for n in names))
        return out

    header = ["load", "req/s"]
    for n in names:
        header.append(f"{label(n)} mean (p99) ms")
        if n != BASELINE:
            header.append(f"{label(n)} ÷ NO Wait (min–max)")
        if (twin := execution_twin(n, names)) is not None:
            header.append(f"{label(n)} ÷ {label(twin)}")
        if not is_baseline(n) and n not in (GRAPH_BASELINE, SAME_EXECUTION, TWIN):
            header.append(f"{label(n)} ÷ better stock baseline")
        if (base := base_of(n, names)) is not None:
            header.append(f"{label(n)} ÷ {label(base)}")
    header += ["mean batch (" + " / ".join(label(n) for n in names) + ")", "requests (failed)"]
    stable = [cells(r) for r in data["summary"] if not r["overload"]]
    overload = [cells(r) for r in data["summary"] if r["overload"]]
    capacity = ", ".join(f"{label(n)} {v:.1f} req/s" for n, v in data["capacity"].items())
    rounds = len(next(iter(data.get("capacity_runs", {}).values()), []))
    if rounds > 1:
        capacity += f" (medians of {rounds} rounds; spread and ratios below the table)"
    text = (
        f"# {label(data['systems'][0])} vs NO Wait, handlers driven in-process: {data['model']} ({data['mode']}) "
        f"on {data['device']}\n\n"
        f"Each system in its own process, its handler called as TorchServe's Python worker calls it; no HTTP, "
        f"no Java frontend (see the module docstring of `bench/ebird_direct.py`). NO Wait = the plain handler "
        f"with batch_size {data.get('max_batch') or NOWAIT_BATCH}, max_batch_delay 0"
        + (f"; every system's largest batch {data['max_batch']}" if data.get("max_batch") else "")
        + ". Sustainable throughput (closed loop, "
        f"{data['clients']} in flight): {capacity}. Open-loop Poisson at fractions of the best one, "
        f"{data['seconds']:g} s per run, {data['repeats']} repeats, the systems' order reversed every other "
        f"repeat, on identical arrivals. Ratio < 1: faster than the baseline; the better stock baseline is, per "
        f"repeat, whichever of NO Wait and the waiting ones had the lower mean.\n\n"
        f"{markdown_table(header, stable)}\n"
    )
    if rounds > 1:
        spread = capacity_spread(data["capacity_runs"])
        batches = data.get("capacity_mean_batch")  # runs before this column existed have none
        capacity_rows = [
            [label(n), f"{c['median']:.0f} ({c['min']:.0f}–{c['max']:.0f})",
             f"**{c['ratio']:.2f}×** ({c['ratio_min']:.2f}–{c['ratio_max']:.2f})",
             *([spread_text(batches[n])] if batches else [])]
            for n, c in spread.items()
        ]  # fmt: skip
        headers = ["system", "req/s median (min–max)", "÷ NO Wait, per round (min–max)"]
        headers += ["mean batch, median of rounds (min–max)"] if batches else []
        text += (
            f"\nCapacity (closed loop, {data['clients']} in flight), {rounds} rounds of every system back to back, "
            "the order reversed every other round; the ratio to NO Wait is taken within each round:\n\n"
            f"{markdown_table(headers, capacity_rows)}\n"
        )
    if "host_cpu_us" in data:  # runs before this column existed have none
        roles = list(dict.fromkeys(role for n in names for role in data["host_cpu_us"][n]))
        host_rows = [
            [label(n), f"{data['capacity'][n]:.0f}",
             *(f"{data['host_cpu_us'][n].get(role, 0.0):.0f}" for role in roles),
             f"{python_us(data['host_cpu_us'][n]):.0f}",
             f"{python_cores(data['capacity'][n], data['host_cpu_us'][n]):.2f}"]
            for n in names
        ]  # fmt: skip
        text += (
            "\nHost CPU per answered request while capacity was measured (µs, from each thread's CPU time in "
            f"/proc{', role by role the median of the rounds' if rounds > 1 else ''}; the event loop also runs "
            "the in-process load generator, alike for every system; OpenMP: the "
            "intra-op team's other threads, which spin while waiting; Python: every thread but those; Python "
            "cores: req/s × Python µs, the cores' worth of CPU the Python threads used, near 1.0 where they "
            "take turns on one GIL and capacity is about one over the Python time per request, above it by "
            "the torch work they run with the GIL released):\n\n"
            f"{markdown_table(['system', 'req/s', *roles, 'Python', 'Python cores'], host_rows)}\n"
        )
    stage_names = list(dict.fromkeys(s for r in data["summary"] for n in names for s in r[n]["stages_ms"]))
    stage_rows = [
        [
            f"{r['fraction']:.0%}",
            label(n),
            *(f"{r[n]['stages_ms'][s]:.1f}" if s in r[n]["stages_ms"] else "" for s in stage_names),
        ]
        for r in data["summary"]
        for n in names
    ]
    text += (
        "\nWhere the time goes inside each handler (its own stage counters, mean ms per answered request; "
        "the plain handler's stages are those of the batch a request was in, and its queue is the emulated "
        f"frontend's):\n\n{markdown_table(['load', 'system', *stage_names], stage_rows)}\n"
    )
    if overload:
        text += "\nOverload (queues grow for the whole run; this measures queue growth, not batching):\n\n"
        text += f"{markdown_table(header, overload)}\n"
    return text + f"\n![latency]({stem}.png)\n\n{provenance_block(data['provenance'])}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--mode", default="eager", choices=("eager", "script", "compile"))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--fractions", default="0.3,0.85", help="loads as fractions of capacity; ≥ 1 is overload")
    parser.add_argument("--seconds", type=float, default=20.0, help="one open-loop run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", type=int, default=64, help="in flight while capacity is measured")
    parser.add_argument("--capacity-seconds", type=float, default=8.0)
    parser.add_argument(
        "--capacity-repeats",
        type=int,
        default=1,
        help="rounds of the capacity step, every system once per round (order reversed every other round): "
        "the table then gives each capacity's spread and its ratio to NO Wait's round by round",
    )
    parser.add_argument("--warmup-seconds", type=float, default=3.0)
    parser.add_argument(
        "--ebird-decode-threads",
        default="auto",
        help="Ebird variants to run, by decode placement: e.g. 0,4,lane,batched (0 = inline on the event loop; "
        "lane = on the CPU lane between batches; batched = JPEGs in batches by torchvision's decoder, nvJPEG on "
        "CUDA; auto = the device's default)",
    )
    parser.add_argument(
        "--handler",
        default="ebird",
        choices=("ebird", "dvabatch", "reef"),
        help="the handler to measure (reef: its real-time path, the model its one RT member)",
    )
    parser.add_argument("--wait-ms", default="", help="waiting baselines: the frontend's max_batch_delay, e.g. 5,10")
    parser.add_argument(
        "--graphs-compare",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run Ebird without graphs and NO Wait replaying graphs (default: on CUDA; on a CPU, where "
        "neither has graphs, a dry run of the code)",
    )
    parser.add_argument(
        "--same-execution",
        action="store_true",
        help="also run NO Wait replaying graphs and decoding each batch's JPEGs in one call, the execution of "
        "Ebird with batched decoding",
    )
    parser.add_argument(
        "--twin", action="store_true", help="also serve NO Wait twice: the twin ÷ NO Wait is the A/A band"
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="every system's largest batch (Ebird's largest worker, DVABatch's max_batch, REEF's rt_max_batch, "
        f"NO Wait's batch_size); default: each one's own (Ebird 16, DVABatch 16, REEF 4, NO Wait {NOWAIT_BATCH})",
    )
    parser.add_argument(
        "--base",
        default=None,
        metavar="REV",
        help="also serve the handler as commit REV's code does (a worktree for the run), on the same arrivals: "
        "a change's before and after in one run",
    )
    parser.add_argument("--quick", action="store_true", help="8 s runs, 2 repeats, short capacity step")
    parser.add_argument("--suffix", default="", help="appended to the output files' name")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.repeats, args.capacity_seconds, args.warmup_seconds = 8.0, 2, 4.0, 2.0
    args.fractions = [float(x) for x in args.fractions.split(",")]
    try:
        args.systems = list(dict.fromkeys(ebird_system(v.strip()) for v in args.ebird_decode_threads.split(",")))
    except ValueError:
        parser.error(
            f"--ebird-decode-threads takes integers ≥ 0, lane, batched or auto, got {args.ebird_decode_threads!r}"
        )
    if args.max_batch is not None and (args.max_batch < 1 or args.max_batch & (args.max_batch - 1)):
        parser.error("--max-batch must be a power of two ≥ 1 (Ebird's worker sizes are)")
    if not args.fractions or min(args.fractions) <= 0:
        parser.error("--fractions must be positive numbers")
    if args.capacity_repeats < 1:
        parser.error("--capacity-repeats must be at least 1")
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine (use --device cpu)")
    if args.handler in (DVABATCH, REEF):
        args.systems = [args.handler]
    if args.graphs_compare is None:
        args.graphs_compare = args.device == "cuda" and args.handler == "ebird"
    if args.graphs_compare:  # on a CPU the graph settings are ignored: a dry run of the four systems' code
        args.systems = list(dict.fromkeys([*args.systems, EBIRD_EAGER, GRAPH_BASELINE]))

    try:
        waits = [float(x) for x in args.wait_ms.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--wait-ms takes milliseconds, e.g. 5,10; got {args.wait_ms!r}")
    if any(w <= 0 for w in waits):
        parser.error("--wait-ms values must be positive (0 is NO Wait, always run)")
    if args.same_execution:
        args.systems.append(SAME_EXECUTION)
    args.systems += [f"wait{w:g}" for w in waits]
    if args.base is not None:
        try:
            args.base = resolve_commit(args.base)
        except ValueError as exc:
            parser.error(f"--base: {exc}")
        args.systems.insert(1, f"{args.systems[0]}@{args.base}")
    if args.twin:
        args.systems.append(TWIN)

    def stem_of(data: dict[str, Any]) -> str:
        return f"{args.handler}_direct_{data['model']}_{args.device}{args.suffix}"

    return run_benchmark("bench.ebird_direct", args, measure, summary, stem_of, render, plot)


if __name__ == "__main__":
    raise SystemExit(main())
