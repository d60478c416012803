"""Packrat live reconfiguration under changing load, against static settings.

    python bench/packrat_swap.py --model resnet50            # or python -m bench.packrat_swap
    python bench/packrat_swap.py --model resnet50 --quick    # shorter loads

Uses the model's profile if it was measured on this machine, else profiles
briefly first (``profile_for_this_machine``).  Loads are open-loop Poisson,
set as fractions of the largest throughput a static setting carries through
TorchServe on this machine, measured closed-loop before the loads (so they
mean the same on any machine, and a "70 %" load is 70 % of what the machine
serves, not of what the profile's forward passes alone would allow;
``--capacity-from profile`` keeps the profile's figure):

- step: low, then high;
- spike: low, a 10 s burst at high, low again;
- diurnal: a slow sine between low and high over ``--diurnal-seconds``.

Each load is played against three systems, one after another on the same
machine: Packrat (the full controller, default knobs), TorchServe's default
(one worker with every core, batch 1) and the static multi-worker setting of
the CPU tuning guides (one pinned worker per core, batch 1).  The report gives
mean and p99 latency of each, failures, Packrat's swaps per load change with
each swap's phases (and, for a cold bring-up, where a worker's start-up time
went), and Packrat's p99 inside swap windows against outside them.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

if __package__ in (None, ""):  # `python bench/packrat_swap.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from archiver.build import build_archive
from bench.report import (
    add_model_arguments,
    add_output_arguments,
    markdown_table,
    provenance,
    provenance_block,
    publish,
)
from handlers.pinning.slots import PLAN_DIR_ENV, PlanStore
from model_store import ARCHIVE_DIR
from model_store.catalog import get_spec
from model_store.samples import client_payload
from packrat_plugin.batch_credit import credit_batches
from packrat_plugin.controller import PackratController
from packrat_plugin.levels import levels_for
from packrat_plugin.model_control import ControllerConfig, ModelTarget
from packrat_plugin.optimizer import KnapsackOptimizer, serving_costs
from packrat_plugin.plan_types import Plan, PlanItem, format_instances
from packrat_plugin.policy import UP_RULES, PolicyConfig
from packrat_plugin.profiler import profile_for_this_machine
from packrat_plugin.swapper import ActivePassiveSwapper, SwapperConfig
from serving_harness.loadgen import LoadResult, Sample, closed_loop, open_loop, run
from serving_harness.topology import CpuTopology
from serving_harness.torchserve import TorchServeProcess

SYSTEMS = ("packrat", "fat", "static")
TWIN = "static_twin"  # --twin: the static split again, as a system of its own: its ratio to static is the A/A band
# --narrow-ab: Packrat again, the same controller, with its old set narrowing to one core per worker through a drain
# and the freed cores serving at once (SwapperConfig.narrow_drains) instead of the new workers holding their batches.
NARROW = "packrat_narrow"
# --scheduled D,...: the same controller with its policy paused, moved by the bench itself D seconds after each
# change of the offered rate to the level the policy calls best at the new rate (``policy.best``): a detector
# that is never wrong and takes exactly D seconds.  At D = 0 the table shows what the swap mechanism and this
# machine cost on their own; the gap from there to Packrat is its detector's and rules'.
SCHEDULED = "scheduled_"
CONTROLLED = ("packrat", NARROW)


def scheduled_system(delay_s: float) -> str:
    return f"{SCHEDULED}{delay_s:g}s"


def scheduled_delay(system: str) -> float | None:
    """The delay of a ``--scheduled`` system, None for any other."""
    return float(system[len(SCHEDULED) : -1]) if system.startswith(SCHEDULED) else None


def controlled(system: str) -> bool:
    return system in CONTROLLED or scheduled_delay(system) is not None


def load_shapes(low: float, high: float, args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """Phases ``[(seconds, rate)]`` of each load; ``changes`` = load changes in it."""
    scale = 0.5 if args.quick else 1.0
    step = [(15 * scale, low), (30 * scale, high)]
    spike = [(15 * scale, low), (10.0, high), (20 * scale, low)]
    return {"step": step, "spike": spike, "diurnal": diurnal_phases(low, high, args.diurnal_seconds * scale)}


def diurnal_phases(low: float, high: float, period_s: float) -> list[tuple[float, float]]:
    """A slow sine from ``low`` up to ``high`` and back over ``period_s``, in ~5 s pieces."""
    pieces = max(8, int(period_s / 5))
    return [
        (period_s / pieces, low + (high - low) * 0.5 * (1 - math.cos(2 * math.pi * (i + 0.5) / pieces)))
        for i in range(pieces)
    ]


LOAD_CHANGES = {"step": 1, "spike": 2, "diurnal": 2}  # diurnal: up, then down


def static_plans(threads: int, twin: bool = False) -> dict[str, Plan]:
    plans = {
        "fat": Plan(threads, 1, math.nan, (PlanItem(1, threads, 1),)),
        "static": Plan(threads, threads, math.nan, (PlanItem(threads, 1, 1),)),
    }
    if twin:
        plans[TWIN] = plans["static"]
    return plans


def largest_capacity(profile, threads: int) -> float:
    """The largest throughput (req/s) any level the controller chooses among reaches on ``threads`` cores by
    the profile: loads are set as fractions of it, so they mean the same on any machine.  The levels are the
    controller's (the batch sizes that earn their place, ``batch_credit.py``): a capacity that only a batch
    size the controller never plans for reaches put the high load past every level it could serve (a 2-vCPU
    EPYC's brief profile: 70 % of it was more than the static split carried)."""
    profile, _ = credit_batches(profile)
    optimizer = KnapsackOptimizer(profile, serving_costs(profile))
    return max(lv.capacity for lv in levels_for(optimizer, threads, threads * max(profile.batches)))


def load_changes(phases: list[tuple[float, float]]) -> list[tuple[float, str]]:
    """(seconds since the load's start, "up" or "down") where the offered rate starts to move one way:
    a step is one change, and so is a diurnal sine's whole rise (its pieces all go up)."""
    out, at = [], 0.0
    for (seconds, rate), (_, following) in zip(phases, phases[1:], strict=False):
        at += seconds
        if following != rate:
            direction = "up" if following > rate else "down"
            if not out or out[-1][1] != direction:
                out.append((at, direction))
    return out


def decision_direction(decision: dict) -> str:
    """``down`` for the policy's shrinking rule, ``up`` for its growing ones (rate, backlog, requests in flight)."""
    return "down" if decision["reason"] == "load fell" else "up"


def reactions(phases, decisions: list[dict], swaps: list[dict], start_wall: float) -> list[dict]:
    """Per load change: the first decision after it in the same direction, how long after the change it came
    (reaction) and when its plan served (serving: reaction plus the swap's own time to serve)."""
    changes = load_changes(phases)
    ends = [at for at, _ in changes[1:]] + [math.inf]
    by_start = {round(s["started"], 6): s for s in swaps}
    out = []
    for (at, direction), end in zip(changes, ends, strict=True):
        first = next((d for d in decisions if at <= d["at"] - start_wall < end and decision_direction(d) == direction),
                     None)  # fmt: skip
        row = {"at_s": at, "direction": direction, "reaction_s": None, "serving_s": None}
        if first is not None:
            swap = by_start.get(round(first["at"], 6))
            row["reaction_s"] = first["at"] - start_wall - at
            row["serving_s"] = row["reaction_s"] + (swap["serving_after_s"] if swap else 0.0)
            row["reason"] = first["reason"]
        out.append(row)
    return out


def summarize(result: LoadResult) -> dict:
    return {
        "requests": len(result.samples),
        "failed": result.failed,
        "mean_ms": result.mean_latency_ms(),
        "p99_ms": result.percentile_ms(99),
    }


def median_run(runs: list[dict]) -> dict:
    """One row from a system's repeats: medians of the per-run statistics."""
    keys = ("mean_ms", "p99_ms")
    return {
        **{k: statistics.median(r[k] for r in runs) for k in keys},
        "requests": sum(r["requests"] for r in runs),
        "failed": sum(r["failed"] for r in runs),
        "runs": runs,
    }


def speedups(baseline: list[dict], packrat: list[dict]) -> dict:
    """Per repeat, baseline mean / Packrat mean (both ran back to back): median, min, max."""
    return spread([b["mean_ms"] / p["mean_ms"] for b, p in zip(baseline, packrat, strict=True)])


def served_capacity(url: str, payloads, clients: int, seconds: float = 6.0) -> float:
    """Answers per second a system gives ``clients`` closed-loop clients, after 2 s of the same to warm it."""
    payload = lambda i: payloads[i % len(payloads)]  # noqa: E731
    run(closed_loop(url, payload, clients, 2.0))
    return run(closed_loop(url, payload, clients, seconds)).throughput()


def run_all(spec, archive, profile, make_shapes, payloads, repeats: int, workdir: Path, policy: PolicyConfig,
            twin: bool = False, narrow: bool = False, scheduled: tuple[float, ...] = (),
            profile_capacity: float | None = None) -> dict:  # fmt: skip
    """Every load, ``repeats`` times, the three systems interleaved (P F S, then S F P, …).

    ``make_shapes(capacity)`` gives the loads; ``capacity`` is ``profile_capacity`` when given, else the
    larger of the two static settings' closed-loop throughput measured here first (``served_capacity``).

    All three stay up for the whole run (Packrat under its controller; fat and
    static as two models of a second TorchServe), so each load's runs of the
    three systems are minutes apart at most, not a whole benchmark apart;
    systems not under load sit idle.
    """
    topology = CpuTopology.from_system()
    plans = PlanStore(workdir / "plans")
    controller = PackratController(workdir / "packrat", [ModelTarget(spec.name, archive, profile)],
                                   ControllerConfig(policy=policy),
                                   status_port=None)  # fmt: skip
    static_server = TorchServeProcess(workdir / "ts", workdir / "store", env={PLAN_DIR_ENV: str(plans.root)})
    systems = (*SYSTEMS, *((NARROW,) if narrow else ()), *map(scheduled_system, scheduled), *((TWIN,) if twin else ()))
    with controller, static_server:
        management = static_server.management()
        urls = {system: f"{controller.server.inference_url}/predictions/{spec.name}" for system in systems
                if controlled(system)}  # fmt: skip
        for system, plan in static_plans(len(topology.cores), twin).items():
            ActivePassiveSwapper(management, plans, system, archive, workdir / "store", topology,
                                 SwapperConfig()).apply(plan)  # fmt: skip
            urls[system] = f"{static_server.inference_url}/predictions/{system}"
        clients = 2 * len(topology.cores)
        served = {} if profile_capacity is not None else {
            system: served_capacity(urls[system], payloads, clients) for system in ("fat", "static")
        }  # fmt: skip
        capacity = profile_capacity if profile_capacity is not None else max(served.values())
        shapes = make_shapes(capacity)
        runs: dict[str, dict[str, list[dict]]] = {system: {name: [] for name in shapes} for system in systems}
        model = controller.models[spec.name]
        levels = [{"batch": lv.batch, "plan": lv.plan.describe(), "capacity": lv.capacity} for lv in model.levels]
        uncredited = [u.describe() for u in model.uncredited]
        total = len(shapes) * repeats * len(systems)
        with tqdm(total=total, desc="loads × repeats × systems", unit="run") as bar:
            for name, phases in shapes.items():
                for r in range(repeats):
                    for system in systems if r % 2 == 0 else systems[::-1]:
                        bar.set_postfix_str(f"{name} #{r + 1} {system}")
                        model.swapper.config.narrow_drains = system == NARROW
                        runs[system][name].append(play(system, urls[system], phases, payloads, model))
                        bar.update()
    out: dict[str, Any] = {system: {} for system in systems}
    out["packrat_levels"], out["uncredited"], out["systems"] = levels, uncredited, list(systems)
    out["capacity"], out["served_capacity"], out["capacity_clients"] = capacity, served, clients
    out["loads"] = shapes
    for name in shapes:
        for system in systems:
            out[system][name] = median_run(runs[system][name])
        packrat_runs = runs["packrat"][name]
        out["packrat"][name]["vs"] = {b: speedups(runs[b][name], packrat_runs) for b in ("fat", "static")}
        # Packrat's mean over the better static setting's, per repeat (the bound: ≤ 1.25×).
        better = [min(f["mean_ms"], st["mean_ms"]) for f, st in zip(runs["fat"][name], runs["static"][name],
                                                                      strict=True)]  # fmt: skip
        over = [p["mean_ms"] / b for p, b in zip(packrat_runs, better, strict=True)]
        out["packrat"][name]["over_better_static"] = spread(over)
        if twin:
            out[TWIN][name]["vs_static"] = speedups(runs["static"][name], runs[TWIN][name])
        # The controller run another way (narrowed drains, scheduled moves): read as Packrat's runs are, and
        # each run's mean against the better static setting's and against Packrat's run beside it.
        for system in (s for s in systems if s != "packrat" and controlled(s)):
            other_runs = runs[system][name]
            out[system][name].update(controlled_summary(other_runs))
            other_over = [h["mean_ms"] / b for h, b in zip(other_runs, better, strict=True)]
            out[system][name]["over_better_static"] = spread(other_over)
            out[system][name]["vs_packrat"] = speedups(other_runs, packrat_runs)  # its mean / Packrat's
        out["packrat"][name].update(controlled_summary(packrat_runs))
    return out


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def controlled_summary(runs: list[dict]) -> dict:
    """A Packrat system's swaps, decisions and reactions over its repeats; the first run's timeline for the plot."""
    return {
        "swaps": [s for run_ in runs for s in run_["swaps"]],
        "swaps_per_run": [len(run_["swaps"]) for run_ in runs],
        "decisions": [d for run_ in runs for d in run_["decisions"]],
        "reactions": [r for run_ in runs for r in run_["reactions"]],
        "calibrations": [run_["calibration"] for run_ in runs],
        "timeline": runs[0]["timeline"],
        "swap_marks": runs[0]["swap_marks"],
        **windows_of(runs),
    }


def play(system: str, url: str, phases, payloads, model) -> dict:
    """One load against one system, after settling at its opening rate (Packrat: on the plan for it)."""
    delay = scheduled_delay(system)
    model.deciding = delay is None
    opening = model.policy.best(phases[0][1])
    if delay is not None and (model.level is None or opening.batch != model.level.batch):
        model.move_to(opening, phases[0][1], "scheduled start")
    run(open_loop(url, lambda i: payloads[i % len(payloads)], [(8.0, phases[0][1])], seed=99))
    seen, start_wall = len(model.swaps), time.time()
    mover = None
    if delay is not None:
        mover = threading.Thread(target=move_on_schedule, args=(model, phases, delay, time.monotonic()), daemon=True)
        mover.start()
    try:
        result = run(open_loop(url, lambda i: payloads[i % len(payloads)], phases, seed=1))
    finally:
        if mover is not None:
            mover.join()
        model.deciding = True
    out = summarize(result)
    if controlled(system):
        swaps = [s.to_dict() for s in model.swaps[seen:]]
        decisions = [d for d in model.decisions if d["at"] >= start_wall]
        out.update(
            swaps=swaps,
            decisions=decisions,
            reactions=reactions(phases, decisions, swaps, start_wall),
            calibration=model.calibrator.current.to_dict(),  # what the policy predicted with at the run's end
            timeline=[(round(s.sent, 3), round(s.latency_s * 1e3, 1), s.status) for s in result.samples],
            swap_marks=[(s["started"] - start_wall, s["seconds"]) for s in swaps],
            inside=[s.latency_s for s in in_swaps(result, swaps, start_wall, True)],
            outside=[s.latency_s for s in in_swaps(result, swaps, start_wall, False)],
        )
    time.sleep(2.0)
    return out


def move_on_schedule(model, phases, delay_s: float, started: float) -> None:
    """``delay_s`` after each phase of ``phases`` begins (from ``started``, monotonic), move ``model`` to the level
    its policy calls best at that phase's rate, if that is another level; reasons as the policy's own."""
    at = 0.0
    for (seconds, before), (_, rate) in zip(phases, phases[1:], strict=False):
        at += seconds
        time.sleep(max(0.0, started + at + delay_s - time.monotonic()))
        level = model.policy.best(rate)
        if model.level is None or level.batch != model.level.batch:
            model.move_to(level, rate, "load fell" if rate < before else "load rose (scheduled)")


def in_swaps(result: LoadResult, swaps: list[dict], load_start_wall: float, inside: bool) -> list:
    """Answered requests sent inside a swap (start → old set retired), or outside every swap."""
    windows = [(s["started"] - load_start_wall, s["started"] - load_start_wall + s["seconds"]) for s in swaps]
    return [s for s in result.ok if any(a <= s.sent <= b for a, b in windows) == inside]


def windows_of(runs: list[dict]) -> dict:
    """p99 of Packrat's requests sent inside swaps against outside them, over all its runs."""
    inside = [x for r in runs for x in r["inside"]]
    outside = [x for r in runs for x in r["outside"]]

    def p99(latencies: list[float]) -> float | None:
        return LoadResult([Sample(0.0, x, 200) for x in latencies], 1.0).percentile_ms(99) if latencies else None

    for r in runs:  # raw latencies are summarised; keep the JSON small
        del r["inside"], r["outside"]
    return {"p99_inside_ms": p99(inside), "p99_outside_ms": p99(outside), "requests_inside": len(inside)}


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = list(data["loads"])
    fig, axes = plt.subplots(len(loads), 1, figsize=(8, 2.6 * len(loads)), squeeze=False)
    for ax, name in zip(axes[:, 0], loads, strict=True):
        run_ = data["packrat"][name]
        ok = [(t, ms) for t, ms, st in run_["timeline"] if st == 200]
        bad = [(t, ms) for t, ms, st in run_["timeline"] if st != 200]
        ax.scatter([t for t, _ in ok], [ms for _, ms in ok], s=3, label="Packrat request latency")
        if bad:
            ax.scatter([t for t, _ in bad], [ms for _, ms in bad], s=12, c="red", marker="x", label="failed")
        for start, seconds in run_["swap_marks"]:
            ax.axvspan(start, start + seconds, color="orange", alpha=0.35)
        rate_ax = ax.twinx()
        edges, rates, at = [], [], 0.0
        for seconds, rate in data["loads"][name]:
            edges += [at, at + seconds]
            rates += [rate, rate]
            at += seconds
        rate_ax.plot(edges, rates, color="grey", lw=1, label="offered load")
        rate_ax.set_ylabel("req/s", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("latency (ms)", fontsize=8)
        ax.set_title(f"{name}: Packrat {run_['mean_ms']:.0f} ms mean, fat {data['fat'][name]['mean_ms']:.0f} ms, "
                     f"static {data['static'][name]['mean_ms']:.0f} ms (orange: swaps)", fontsize=9)  # fmt: skip
    axes[-1, 0].set_xlabel("time since load start (s)")
    axes[0, 0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(data: dict) -> str:
    rows = []
    for name in data["loads"]:
        p, f, s = data["packrat"][name], data["fat"][name], data["static"][name]
        per_change = len(p["swaps"]) / len(p["swaps_per_run"]) / LOAD_CHANGES[name]
        rows.append([
            name, f"{p['mean_ms']:.0f} / {p['p99_ms']:.0f}", f"{f['mean_ms']:.0f} / {f['p99_ms']:.0f}",
            f"{s['mean_ms']:.0f} / {s['p99_ms']:.0f}",
            " / ".join(f"{v['median']:.2f}× ({v['min']:.2f}-{v['max']:.2f})" for v in p["vs"].values()),
            f"{p['failed']} / {f['failed']} / {s['failed']}",
            f"{'+'.join(map(str, p['swaps_per_run']))} ({per_change:.1f})",
            "-" if p["p99_inside_ms"] is None else f"{p['p99_inside_ms']:.0f} / {p['p99_outside_ms']:.0f}",
        ])  # fmt: skip
    table = markdown_table(
        ["load", "Packrat mean / p99 (ms)", "fat mean / p99", "static mean / p99",
         "Packrat speedup vs fat / static (median, min-max)",
         "failed (P / F / S)", "swaps per run (per load change)", "Packrat p99 in / out of swaps"], rows,
    )  # fmt: skip
    swap_rows = []
    for name in data["loads"]:
        for s in data["packrat"][name]["swaps"]:
            ph = s["phases"]
            start = s.get("worker_startup") or {}
            swap_rows.append([
                name, f"{format_instances(s['before'])} → {format_instances(s['after'])}",
                "warm" if s["warm"] else "cold", f"{s['serving_after_s']:.2f}", f"{s['seconds']:.2f}",
                *(f"{ph.get(k, 0.0):.2f}" for k in ("bring_up", "switch", "drain", "settle", "retire")),
                " / ".join(f"{start[k]:.1f}" for k in ("spawn_s", "load_s", "warmup_s") if k in start) or "-",
            ])  # fmt: skip
    phase_table = markdown_table(
        ["load", "swap", "kind", "new plan serving (s)", "done (s)", "bring up", "switch", "drain (held)", "settle",
         "retire", "worker start-up: spawn+imports / load / warm-up (s)"], swap_rows,
    )  # fmt: skip
    reaction_rows = []
    for name in data["loads"]:
        p = data["packrat"][name]
        for direction in ("up", "down"):
            rows_ = [r for r in p.get("reactions", []) if r["direction"] == direction]
            if not rows_:
                continue
            seen = [r["reaction_s"] for r in rows_ if r["reaction_s"] is not None]
            serving = [r["serving_s"] for r in rows_ if r["serving_s"] is not None]
            reaction_rows.append([
                name, f"{'rise' if direction == 'up' else 'fall'}", f"{len(seen)} of {len(rows_)}",
                " ".join(f"{x:.2f}" for x in seen) or "-",
                f"{statistics.median(seen):.2f}" if seen else "-",
                f"{statistics.median(serving):.2f}" if serving else "-",
            ])  # fmt: skip
    reaction_table = markdown_table(
        ["load", "change", "acted on", "reaction per run (s)", "reaction, median (s)", "new plan serving, median (s)"],
        reaction_rows,
    )  # fmt: skip
    bound_rows = []
    for name in data["loads"]:
        p = data["packrat"][name]
        if "over_better_static" not in p:
            continue
        o = p["over_better_static"]
        twin = data.get(TWIN, {}).get(name, {}).get("vs_static")
        bound_rows.append([
            name, f"{o['median']:.2f}× ({o['min']:.2f}-{o['max']:.2f})",
            f"{twin['median']:.2f}× ({twin['min']:.2f}-{twin['max']:.2f})" if twin else "-",
        ])  # fmt: skip
    bound_table = markdown_table(
        ["load", "Packrat mean / better static mean (median, min-max)",
         "A/A: static mean / its twin's (median, min-max)"], bound_rows,
    )  # fmt: skip
    narrow_text = narrow_ab_text(data) + scheduled_text(data)
    decisions = [
        f"- {name}: {d['reason']} → B={d['target_batch']} at {d['rate']:.1f} req/s"
        for name in data["loads"] for d in data["packrat"][name]["decisions"]
    ]  # fmt: skip
    loads = "; ".join(
        f"{name}: " + ", ".join(f"{sec:.0f} s at {rate:.1f}/s" for sec, rate in phases[:4])
        + (" …" if len(phases) > 4 else "") for name, phases in data["loads"].items()
    )  # fmt: skip
    rule = f", growing rule `{data['up_rule']}`" if data.get("up_rule", "bound") != "bound" else ""
    return (
        f"# Packrat under changing load: {data['model']} ({data['mode']}), T={data['threads']}\n\n"
        f"Open-loop Poisson loads between {data['low']:.1f} and {data['high']:.1f} req/s "
        f"({data['low_fraction']:.0%} and {data['high_fraction']:.0%} of {capacity_text(data)}). {loads}.\n\n"
        f"Systems, all up for the whole run and loaded in turn, {data['repeats']} runs of each load per system "
        f"interleaved (P F S, S F P, …): Packrat (controller defaults{rule}, standby workers warm); "
        f"fat = TorchServe's default, one worker with all {data['threads']} cores ⟨1,{data['threads']},1⟩; "
        f"static = one pinned worker per core, batch 1 ⟨{data['threads']},1,1⟩ (the CPU tuning guides' even split). "
        f"Each run starts after 8 s at its opening rate. Latencies are medians over the runs; a speedup is "
        f"the baseline's mean over Packrat's, per pair of runs made back to back.\n\n{table}\n\n"
        f"Against the better static setting of each repeat (the A/A row: the static split against an identical "
        f"copy of itself in the same runs, where `--twin` was given):\n\n{bound_table}\n\n"
        f"How fast Packrat acted on each change of the offered load: reaction = from the change to the "
        f"controller's decision; serving = to the new plan serving (reaction plus the swap's own time).\n\n"
        f"{reaction_table}\n\n{narrow_text}"
        f"Profile: `{data['profile_path']}`.{levels_text(data)}\n\nEvery Packrat swap:\n\n{phase_table}\n\n"
        f"Decisions:\n\n" + "\n".join(decisions) + f"\n\n![latency over time, Packrat's first run of each load]"
        f"({data['stem']}.png)\n\n"
        f"{provenance_block(data['provenance'])}"
    )


def capacity_text(data: dict) -> str:
    """What the loads are fractions of, in words."""
    served = data.get("served_capacity") or {}
    if not served:
        return f"the profile's largest level capacity, {data['capacity']:.1f} req/s"
    each = ", ".join(f"{system} {value:.1f}" for system, value in served.items())
    profile = data.get("profile_capacity")
    return (
        f"the larger closed-loop throughput of the two static settings served here through TorchServe, "
        f"{data['capacity']:.1f} req/s ({each} req/s at {data['capacity_clients']} clients"
        + (f"; the profile's largest level capacity: {profile:.1f} req/s" if profile else "")
        + ")"
    )


def narrow_ab_text(data: dict) -> str:
    """With ``--narrow-ab``: Packrat with narrowed drains beside the default (held), run for run."""
    if NARROW not in data:
        return ""
    rows = []
    for name in data["loads"]:
        n, p = data[NARROW][name], data["packrat"][name]
        drains = {k: [s["phases"].get("drain", 0.0) for s in d["swaps"]] for k, d in (("hold", p), ("narrow", n))}
        ratio, over = n["vs_packrat"], n["over_better_static"]
        rows.append([
            name, f"{p['mean_ms']:.0f} / {n['mean_ms']:.0f}",
            f"{ratio['median']:.2f}× ({ratio['min']:.2f}-{ratio['max']:.2f})",
            f"{over['median']:.2f}× ({over['min']:.2f}-{over['max']:.2f})",
            " / ".join(" ".join(f"{x:.2f}" for x in drains[k]) or "-" for k in ("hold", "narrow")),
            f"{sum(n['swaps_per_run'])} / {n['failed']}",
        ])  # fmt: skip
    table = markdown_table(
        ["load", "Packrat mean, held / narrowed drains (ms)", "narrowed mean / held mean (median, min-max)",
         "narrowed: mean / better static", "drains (s): held / narrowed", "narrowed: swaps / failed"], rows,
    )  # fmt: skip
    return (
        "Drains, A/B (`--narrow-ab`): the same controller run again beside each Packrat run, its old set "
        "narrowing to one core per worker while it drains and the freed cores serving at once "
        "(`SwapperConfig(narrow_drains=True)`) instead of the new workers on its cores holding their batches "
        f"(the default):\n\n{table}\n\n"
    )


def scheduled_text(data: dict) -> str:
    """With ``--scheduled``: the same controller moved by the bench at known delays after each change."""
    systems = [k for k in data if scheduled_delay(k) is not None]
    if not systems:
        return ""
    rows = []
    for system in sorted(systems, key=scheduled_delay):
        for name in data["loads"]:
            d = data[system][name]
            ratio, over = d["vs_packrat"], d["over_better_static"]
            serving = [r["serving_s"] for r in d["reactions"] if r["serving_s"] is not None]
            rows.append([
                f"{scheduled_delay(system):g} s", name, f"{d['mean_ms']:.0f} / {d['p99_ms']:.0f}",
                f"{over['median']:.2f}× ({over['min']:.2f}-{over['max']:.2f})",
                f"{ratio['median']:.2f}× ({ratio['min']:.2f}-{ratio['max']:.2f})",
                " ".join(f"{x:.2f}" for x in serving) or "-",
                " ".join(f"{s['phases'].get('drain', 0.0):.2f}" for s in d["swaps"]) or "-",
                f"{sum(d['swaps_per_run'])} / {d['failed']}",
            ])  # fmt: skip
    table = markdown_table(
        ["moved after", "load", "mean / p99 (ms)", "mean / better static (median, min-max)",
         "mean / Packrat's mean", "new plan serving after the change (s)", "drains (s)", "swaps / failed"], rows,
    )  # fmt: skip
    return (
        "Scheduled moves (`--scheduled`): the same controller with its policy paused, moved by the benchmark a "
        "fixed time after each change of the offered rate to the level the policy calls best at the new rate: "
        "a detector that is never wrong and takes exactly that long. At 0 s this is what the swap itself and this "
        f"machine cost; the rest of Packrat's gap is its detection.\n\n{table}\n\n"
    )


def levels_text(data: dict) -> str:
    """The levels Packrat chose among (the profile's, less its uncredited batch sizes), when the run recorded them."""
    if "packrat_levels" not in data:
        return ""
    levels = "; ".join(f"B={lv['batch']}: {lv['plan']}" for lv in data["packrat_levels"])
    dropped = "".join(f"\n- {line}" for line in data["uncredited"])
    return f" Packrat's levels: {levels}." + (f" Left out of planning:\n{dropped}" if dropped else "")


def parse_delays(text: str) -> tuple[float, ...]:
    try:
        delays = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected seconds like 0,1, got {text!r}") from exc
    if not delays or any(not 0 <= d < 60 for d in delays) or len(set(delays)) != len(delays):
        raise argparse.ArgumentTypeError(f"expected distinct delays in [0, 60) s, got {text!r}")
    return delays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--low", type=float, default=0.1, help="low load, as a fraction of the largest capacity")
    parser.add_argument(
        "--capacity-from",
        choices=("served", "profile"),
        default="served",
        help="the capacity loads are fractions of: the better static setting's closed-loop throughput measured "
        "here through TorchServe first (default), or the profile's largest level capacity",
    )
    parser.add_argument("--high", type=float, default=0.7, help="high load, likewise")
    parser.add_argument("--diurnal-seconds", type=float, default=120.0)
    parser.add_argument("--loads", default="step,spike,diurnal")
    parser.add_argument("--quick", action="store_true", help="halve the phases (a smoke run)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each load per system, interleaved")
    parser.add_argument("--up-rule", choices=UP_RULES, default=PolicyConfig().up_rule, help="Packrat's growing rule")
    parser.add_argument("--stem", default=None, help="output file stem (default packrat_swap_MODEL)")
    parser.add_argument("--twin", action="store_true", help="also run the static split's twin: the A/A band")
    parser.add_argument(
        "--narrow-ab",
        action="store_true",
        help="also run Packrat with drains that narrow the old set instead of holding the new one",
    )
    parser.add_argument(
        "--scheduled",
        type=parse_delays,
        default=(),
        metavar="SECONDS,...",
        help="also run the controller moved by the bench this long after each load change (policy paused)",
    )
    add_output_arguments(parser)
    args = parser.parse_args(argv)

    spec = get_spec(args.model, args.mode)
    profile, profile_path = profile_for_this_machine(spec.name, args.profile, args.force, args.mode)
    archive = build_archive(spec, ARCHIVE_DIR)
    threads = len(CpuTopology.from_system().cores)
    profile_capacity = largest_capacity(profile, threads)

    def make_shapes(capacity: float) -> dict[str, list[tuple[float, float]]]:
        shapes = load_shapes(args.low * capacity, args.high * capacity, args)
        return {k: v for k, v in shapes.items() if k in args.loads.split(",")}

    payloads = [client_payload(spec, seed=i) for i in range(32)]
    prov = provenance("bench.packrat_swap")
    with tempfile.TemporaryDirectory(prefix="packrat-swap-") as tmp:
        policy = PolicyConfig(up_rule=args.up_rule)
        results = run_all(spec, archive, profile, make_shapes, payloads, args.repeats, Path(tmp), policy, args.twin,
                          args.narrow_ab, args.scheduled,
                          profile_capacity if args.capacity_from == "profile" else None)  # fmt: skip
    stem = args.stem or f"packrat_swap_{spec.name}"
    data = {
        "model": spec.name, "mode": spec.mode, "threads": threads, "profile_capacity": profile_capacity,
        "low": args.low * results["capacity"], "high": args.high * results["capacity"],
        "low_fraction": args.low, "high_fraction": args.high, "up_rule": args.up_rule,
        "capacity_from": args.capacity_from, "repeats": args.repeats, **results,
        "profile_path": str(profile_path), "stem": stem, "provenance": prov,
    }  # fmt: skip
    print(publish(stem, data, render, plot, args.out_dir, args.json))
    failed = sum(data[system][name]["failed"] for system in data["systems"] for name in data["loads"])
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
