"""Packrat's policy against static settings and an oracle, in a queue model (no TorchServe).

    python bench/packrat_policy_sim.py --profile logs/profiles/resnet50_s12.json
    python -m bench.packrat_policy_sim --true-slowdown 1=1.0,2=1.1 --seeds 24

A *model*, not a measurement: what a policy could gain at best, and how
near a rule comes to it, before spending a 20-minute run of
``bench/packrat_swap.py`` on it.  The same open-loop Poisson arrivals (the
diurnal load of ``bench/packrat_swap.py``: a sine between 10 % and 70 % of
the profile's largest capacity over 120 s) go through a queue served the way
TorchServe serves one version: ``i`` workers take from one FIFO queue, each
up to its batch cap of what is queued, a round of ``k`` taking the profiled
``L[t][k]`` times a per-thread-count slowdown plus a per-request overhead.
Systems:

- **fat** and **static**: one worker with every core, one worker per core;
- **packrat (bound / expected)**: the real ``ReconfigurationPolicy`` and
  ``LoadMonitor`` with each growing rule, deciding every 0.25 s; a swap is
  warm (the new set takes the queue when the old set's batches end);
- **oracles**: the level the policy's own model calls best at the *true*
  rate, and the split of most capacity above a threshold of the true rate
  (the fat worker below it), at each threshold of a grid: no policy that
  reads arrivals can beat the best of them by much.

And, for each growing rule, how often a *constant* load moves Packrat after
its first 15 s: the price of reacting early to a rise.

Why per-thread slowdowns: a 2-thread worker loses more to the frontend and
the clients on a 2-core machine than a 1-thread one (its intra-op team waits
for its slowest thread).  ``--true-slowdown`` sets them; the policy itself
plans with one calibrated slowdown (that of the worker it serves on), as the
controller does.  The defaults were fitted by hand to the AMD VM's diurnal
run (``docs/benchmarks/packrat_swap_resnet50_diurnal120.md``: fat 291, static
164 ms), and are a guess for any other machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/packrat_policy_sim.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm

from bench.packrat_swap import diurnal_phases
from bench.report import add_output_arguments, markdown_table, new_figure, provenance, provenance_block, publish
from packrat_plugin.calibration import Calibration, profiled_round_ms
from packrat_plugin.levels import Level, levels_for
from packrat_plugin.load_monitor import LoadMonitor, MonitorConfig
from packrat_plugin.optimizer import KnapsackOptimizer
from packrat_plugin.plan_types import format_instances
from packrat_plugin.policy import Decision, PolicyConfig, ReconfigurationPolicy
from packrat_plugin.profile import Profile, load_profile
from serving_harness.loadgen import arrival_times

PERIOD_S = 0.25
LEAD_S = 8.0  # at the opening rate before the measured window, as bench/packrat_swap.py does
Setting = tuple[int, int, int]  # (instances, threads, batch cap)


@dataclasses.dataclass(frozen=True)
class Machine:
    """What a round costs on the simulated machine."""

    latency_ms: dict[tuple[int, int], float]  # (threads, batch) -> profiled ms
    slowdown: dict[int, float]  # threads -> true slowdown
    overhead_ms: float

    def round_s(self, threads: int, k: int) -> float:
        return (self.model_ms(threads, k) * self.slowdown.get(threads, 1.0) + k * self.overhead_ms) / 1000.0

    def model_ms(self, threads: int, k: int) -> float:
        """The profiled round of ``k``; between two profiled batch sizes (a profile of powers of
        two), on the straight line between them: a worker takes whatever is queued."""
        rounds = tuple((b, ms) for (t, b), ms in self.latency_ms.items() if t == threads)
        if not rounds or k > max(b for b, _ in rounds):
            raise KeyError(f"no profiled batch around {k} at {threads} thread(s): {sorted(b for b, _ in rounds)}")
        return profiled_round_ms(rounds, k)


def poisson_arrivals(phases: list[tuple[float, float]], rng_seed: int) -> list[float]:
    """Arrival times; the first phase's rate is also played for ``LEAD_S`` before it."""
    return arrival_times([(LEAD_S, phases[0][1]), *phases], seed=rng_seed)


class TrueRate:
    """The rate the load was drawn at, for the oracle."""

    def __init__(self, phases: list[tuple[float, float]]) -> None:
        self.edges, t = [], LEAD_S
        for seconds, rate in phases:
            self.edges.append((t + seconds, rate))
            t += seconds
        self.first = phases[0][1]

    def at(self, now: float) -> float:
        if now < LEAD_S:
            return self.first
        return next((rate for end, rate in self.edges if now < end), self.edges[-1][1])


class Oracle:
    """Serves at every tick the level ``choose`` picks for the true rate: no noise, no delay."""

    def __init__(self, choose: Callable[[float], Level], rate: TrueRate) -> None:
        self.choose, self.rate = choose, rate

    def observe(self, obs: Any, current: int, warm: Any) -> Decision | None:
        rate = self.rate.at(obs.now)
        want = self.choose(rate)
        return None if want.batch == current else Decision(want, rate, "oracle", 0.0, 0.0, True)

    def record_swap(self, *_: Any) -> None:
        pass


def simulate(arrivals: list[float], machine: Machine, setting: Setting | None = None, policy: Any = None,
             levels: dict[int, Level] | None = None) -> tuple[float, list[tuple[float, int, int]]]:  # fmt: skip
    """Mean latency (ms) of the requests after ``LEAD_S``, and the swaps ``(time, from B, to B)``.

    A static ``setting``, or a ``policy`` over ``levels`` starting at B=1.
    """

    def setting_of(batch: int) -> Setting:
        item = levels[batch].plan.instances[0]
        return item.count, item.threads, item.batch

    current = 1
    instances, threads, cap = setting or setting_of(current)
    free = [0.0] * instances  # when each worker is next idle
    queue: list[float] = []
    finishing: list[float] = []  # completion times of requests in service, for the depth
    latencies: list[tuple[float, float]] = []
    monitor = LoadMonitor(MonitorConfig(period_s=PERIOD_S)) if policy else None
    swaps: list[tuple[float, int, int]] = []
    n, i, tick = len(arrivals), 0, PERIOD_S

    def advance(until: float) -> None:
        nonlocal i
        while True:
            worker = min(range(len(free)), key=free.__getitem__)
            start = max(free[worker], queue[0]) if queue else math.inf
            arrival = arrivals[i] if i < n else math.inf
            if min(arrival, start) > until:
                return
            if arrival <= start:
                queue.append(arrival)
                i += 1
                continue
            k = 0
            while k < len(queue) and k < cap and queue[k] <= start:
                k += 1
            done = start + machine.round_s(threads, k)
            for a in queue[:k]:
                latencies.append((a, done - a))
                heapq.heappush(finishing, done)
            del queue[:k]
            free[worker] = done

    while i < n or queue:
        advance(tick)
        if policy is not None:
            while finishing and finishing[0] <= tick:
                heapq.heappop(finishing)
            monitor.record(tick, {"v": float(i)}, float(len(queue) + len(finishing)))
            if monitor.ready:
                decision = policy.observe(monitor.observation(tick, cap), current, set(levels))
                if decision is not None:
                    swaps.append((round(tick - LEAD_S, 2), current, decision.target.batch))
                    current = decision.target.batch
                    busy_until = max(free)
                    instances, threads, cap = setting_of(current)
                    free = [busy_until] * instances
                    policy.record_swap(tick, 0.01, True)
        tick += PERIOD_S
    return 1e3 * statistics.fmean(lat for a, lat in latencies if a >= LEAD_S), swaps


def run(args: argparse.Namespace, profile: Profile) -> dict[str, Any]:
    machine = Machine({(p.threads, p.batch): p.latency_ms for p in profile.points}, args.true_slowdown,
                      args.overhead_ms)  # fmt: skip
    cores = max(profile.threads)
    optimizer = KnapsackOptimizer(profile)
    bare = {lv.batch: lv for lv in levels_for(optimizer, cores, cores * max(profile.batches))}
    capacity = max(lv.capacity for lv in bare.values())
    # The controller plans with the slowdown measured on the set it serves on: the fat worker, at first.
    calibration = Calibration(slowdown=args.true_slowdown.get(cores, 1.0), overhead_ms=args.overhead_ms, updates=1)
    levels = {b: dataclasses.replace(lv, calibration=calibration) for b, lv in bare.items()}
    # The threshold oracles' split: the level of most capacity among those with fewer threads a worker.
    split = max((lv for lv in levels.values() if lv.plan.instances[0].threads < cores),
                key=lambda lv: (lv.capacity, -lv.batch))  # fmt: skip
    model = ReconfigurationPolicy(list(levels.values()))
    phases = diurnal_phases(args.low * capacity, args.high * capacity, args.diurnal_seconds)
    systems = ["fat", "static", "packrat (bound)", "packrat (expected)", "oracle best"]
    systems += [f"oracle {t:g}" for t in args.thresholds]
    means: dict[str, list[float]] = {s: [] for s in systems}
    moves: dict[str, list[int]] = {s: [] for s in systems}
    for seed in tqdm(range(args.seeds), desc="seeds", unit="seed"):
        arrivals = poisson_arrivals(phases, seed)
        for system in systems:
            if system == "fat":
                mean, swaps = simulate(arrivals, machine, (1, cores, 1))
            elif system == "static":
                mean, swaps = simulate(arrivals, machine, (cores, 1, 1))
            elif system.startswith("packrat"):
                rule = system.split("(")[1].rstrip(")")
                policy = ReconfigurationPolicy(list(levels.values()), PolicyConfig(up_rule=rule))
                mean, swaps = simulate(arrivals, machine, policy=policy, levels=levels)
            else:
                if system == "oracle best":
                    choose = model.best
                else:
                    threshold = float(system.split()[1])
                    choose = lambda rate, t=threshold: split if rate >= t else levels[1]  # noqa: E731
                oracle = Oracle(choose, TrueRate(phases))
                mean, swaps = simulate(arrivals, machine, policy=oracle, levels=levels)
            means[system].append(mean)
            moves[system].append(len(swaps))
    rows = [
        {"system": s, "mean_ms": statistics.median(means[s]), "min_ms": min(means[s]), "max_ms": max(means[s]),
         "vs_static": statistics.median(st / m for st, m in zip(means["static"], means[s], strict=True)),
         "swaps": statistics.median(moves[s])}
        for s in systems
    ]  # fmt: skip
    oracles = [r for r in rows if r["system"].startswith("oracle")]
    constant = {rule: [late_moves(rate, rule, args, machine, levels) for rate in args.constant_rates]
                for rule in ("bound", "expected")}  # fmt: skip
    return {
        "profile_path": str(args.profile), "cores": cores, "capacity": capacity, "seeds": args.seeds,
        "low": args.low * capacity, "high": args.high * capacity, "diurnal_seconds": args.diurnal_seconds,
        "true_slowdown": {str(t): s for t, s in args.true_slowdown.items()}, "overhead_ms": args.overhead_ms,
        "split": format_instances([dataclasses.asdict(i) for i in split.plan.instances]),
        "rows": rows, "best_oracle": min(oracles, key=lambda r: r["mean_ms"])["system"] if oracles else None,
        "per_seed": means, "provenance": provenance("bench.packrat_policy_sim"),
        "constant_rates": args.constant_rates, "constant_seconds": args.constant_seconds, "constant": constant,
    }  # fmt: skip


def late_moves(
    rate: float, rule: str, args: argparse.Namespace, machine: Machine, levels: dict[int, Level]
) -> tuple[int, int]:
    """Seeds, of ``args.seeds``, in which a constant load at ``rate`` moved Packrat after its first
    15 s (the integration test's allowance for leaving the initial B=1): ``(first, again)``, where
    the late move was the run's first (leaving B=1 slowly: the evidence was thin) or a second one
    (the policy moved back or on under a load that did not change)."""
    first = again = 0
    for seed in range(args.seeds):
        arrivals = poisson_arrivals([(args.constant_seconds, rate)], 1000 + seed)
        policy = ReconfigurationPolicy(list(levels.values()), PolicyConfig(up_rule=rule))
        _, swaps = simulate(arrivals, machine, policy=policy, levels=levels)
        if any(t > 15.0 - LEAD_S for t, _, _ in swaps):
            if len(swaps) == 1:
                first += 1
            else:
                again += 1
    return first, again


def render(data: dict[str, Any]) -> str:
    table = markdown_table(
        ["system", "mean ms (median over seeds)", "min-max", "static's mean ÷ this (median)", "swaps per run"],
        [[r["system"] + (" ← best oracle" if r["system"] == data["best_oracle"] else ""), f"{r['mean_ms']:.0f}",
          f"{r['min_ms']:.0f}-{r['max_ms']:.0f}", f"{r['vs_static']:.2f}×", f"{r['swaps']:g}"]
         for r in data["rows"]],
    )  # fmt: skip
    constant = markdown_table(
        ["growing rule", *(f"{r:g} req/s" for r in data["constant_rates"])],
        [
            [rule, *(f"{a + b} of {data['seeds']} ({a} first, {b} again)" for a, b in counts)]
            for rule, counts in data["constant"].items()
        ],  # fmt: skip
    )
    slow = ", ".join(f"{t} thread(s) {s:g}×" for t, s in data["true_slowdown"].items())
    return (
        f"# Packrat's policy in a queue model: diurnal load, T={data['cores']}\n\n"
        f"**A model, not a measurement** (`bench/packrat_policy_sim.py`): the profile's round times × a "
        f"slowdown per thread count ({slow}) + {data['overhead_ms']:g} ms per request, served as TorchServe "
        f"serves one version. Diurnal sine between {data['low']:.1f} and {data['high']:.1f} req/s over "
        f"{data['diurnal_seconds']:.0f} s, {data['seeds']} seeds of Poisson arrivals, the same arrivals for every "
        f"system. Oracle best: the level the policy's own (calibrated) model calls best at the true rate; oracle "
        f"t: {data['split']} above t req/s of the true rate, the fat worker below.\n\n{table}\n\n"
        f"Constant loads of {data['constant_seconds']:.0f} s from the fat worker (B=1): seeds in which Packrat "
        f"moved after the first 15 s: *first*, its first move came that late (it left B=1 on thin "
        f"evidence); *again*, it moved a second time under a load that did not change.\n\n{constant}\n\n"
        f"Profile: `{data['profile_path']}` (largest capacity {data['capacity']:.1f} req/s).\n\n"
        f"![mean latency per seed]({data['stem']}.png)\n\n{provenance_block(data['provenance'])}"
    )


def plot(data: dict[str, Any], path: Path) -> None:
    fig, ax = new_figure()
    systems = [r["system"] for r in data["rows"]]
    ax.boxplot([data["per_seed"][s] for s in systems], showfliers=False)
    ax.set_xticks(range(1, len(systems) + 1), systems, rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("mean latency per seed (ms)")
    values = [v for s in systems for v in data["per_seed"][s]]
    if max(values) > 10 * min(values):  # an overloaded setting would flatten the rest
        ax.set_yscale("log")
    ax.set_title("diurnal load in the queue model (not measured)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_slowdowns(text: str) -> dict[int, float]:
    try:
        pairs = [part.split("=") for part in text.split(",") if part]
        out = {int(t): float(s) for t, s in pairs}
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected THREADS=SLOWDOWN,..., got {text!r}") from exc
    if any(t < 1 or s <= 0 for t, s in out.items()):
        raise argparse.ArgumentTypeError(f"threads ≥ 1 and slowdowns > 0, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", type=Path, default=Path("profiles/resnet50.json"))
    parser.add_argument("--true-slowdown", type=parse_slowdowns, default=parse_slowdowns("1=1.0,2=1.1"))
    parser.add_argument("--overhead-ms", type=float, default=4.0, help="handler time per request outside the model")
    parser.add_argument("--low", type=float, default=0.1, help="as a fraction of the profile's largest capacity")
    parser.add_argument("--high", type=float, default=0.7)
    parser.add_argument("--diurnal-seconds", type=float, default=120.0)
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--thresholds", default="6,8,9,10,11,12,13", help="oracle thresholds, req/s")
    parser.add_argument("--constant-rates", default="6,7,8,9,10", help="constant loads to count late moves at, req/s")
    parser.add_argument("--constant-seconds", type=float, default=75.0)
    parser.add_argument("--stem", default=None, help="output file stem (default packrat_policy_sim_MODEL)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    args.thresholds = [float(t) for t in args.thresholds.split(",") if t]
    args.constant_rates = [float(r) for r in args.constant_rates.split(",") if r]
    if not args.profile.is_file():
        parser.error(f"no profile at {args.profile}: `packrat profile --model resnet50` measures one")
    profile = load_profile(args.profile, check_machine=False)  # a model of the machine the profile was taken on
    data = run(args, profile)
    data["stem"] = args.stem or f"packrat_policy_sim_{profile.model}"
    print(publish(data["stem"], data, render, plot, args.out_dir, args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
