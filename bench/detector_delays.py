"""How long the load monitor's change detector takes to flag a step of the arrival rate (a model, no TorchServe).

    python -m bench.detector_delays
    python -m bench.detector_delays --steps 1.2:8.4,8.4:1.2 --seeds 400 --out-dir /tmp/dd

Why: the load benchmarks (``bench/packrat_swap.py``) read one *decision* per
change, after the detector *and* the policy's rules, three times per run.
What the detector alone can do, and what a different tuning would buy, is a
question of its statistics: here each step of a Poisson rate is played
``--seeds`` times through :class:`RateChangeDetector`, sampled every 0.25 s as
the controller samples the frontend's request counter, after 30 s at the old
rate from which it learned that rate as the monitor starts it (its rate from
a 6 s window, refined as arrivals double).  Reported per step and tuning: the
delay's median, 90th percentile and share within 2 s, and how many streams
raised a false alarm in their 30 s before the change (those are left out).

A *rise* brings evidence with every arrival; a *fall* only with arrivals that
do not come, so a 7× fall is slower to see than a 7× rise at the same
false-alarm rate: per second the new regime yields
``λ1·ln(λ1/λ0) − λ1 + λ0`` nats of evidence (Kullback-Leibler), 9.2 for
1.2 → 8.4 req/s but 4.9 for 8.4 → 1.2, against a threshold of ~9-12 nats for
one false alarm in hours.  The tunings compared: the monitor's default (the
2× test alone, one false alarm per 1,800 s per direction against a known
rate, each learned rate tested at its 1σ bound), the tuning serving ran
before (the 2× test against the estimate itself, 7,200 s), the bank of a 2×
and a 5× test, and the 2× test at 1,800 s against the estimate.

A second table counts the false alarms of long streams at a constant rate,
the detector learning again after each one as it does live: a learned rate is
uncertain (±22 % from 20 arrivals, ±8 % from 160), and a test against an
estimate that is low alarms far sooner than its design says.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/detector_delays.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
from tqdm import tqdm

from bench.report import add_output_arguments, markdown_table, new_figure, provenance, provenance_block, publish
from packrat_plugin.change_detector import DetectorConfig, RateChangeDetector
from packrat_plugin.load_monitor import MonitorConfig

DEFAULT = MonitorConfig()
MONITORS = DetectorConfig(
    ratio=DEFAULT.change_ratio, large_ratio=DEFAULT.change_large_ratio,
    false_alarm_seconds=DEFAULT.change_false_alarm_s or 1800.0, uncertainty_z=DEFAULT.change_uncertainty_z,
)  # fmt: skip
# The rate a test compares against: the learned estimate (z = 0) or its bound z standard errors toward the
# test's side.  The tuning serving ran until 2026-11-28 was the 2× test at 7,200 s against the estimate.
TUNINGS: dict[str, DetectorConfig] = {
    "default: 2× test, 1,800 s, z = 1": MONITORS,
    "2× test, 7,200 s, z = 0 (until 2026-11-28)": DetectorConfig(large_ratio=None, false_alarm_seconds=7200.0),
    "2× + 5× tests, 7,200 s split, z = 0": DetectorConfig(large_ratio=5.0, false_alarm_seconds=7200.0),
    "2× test, 1,800 s, z = 0": DetectorConfig(large_ratio=None, false_alarm_seconds=1800.0),
}  # fmt: skip
WARM_S = 30.0  # seconds at the old rate before the change
LIMIT_S = 30.0  # a change not flagged within this long counts as not flagged


def evidence_per_second(old: float, new: float) -> float:
    """Kullback-Leibler divergence of the new Poisson regime from the old, per second (nats)."""
    return new * math.log(new / old) - new + old


def started(rate: float, config: DetectorConfig, rng: np.random.Generator) -> RateChangeDetector:
    """A detector started as the load monitor starts it: from its long window's rate, refined as arrivals double."""
    learn_s = DEFAULT.long_window_s
    learned = int(rng.poisson(rate * learn_s))
    detector = RateChangeDetector(learned / learn_s, config)
    detector.refine_from(learned, learn_s)
    return detector


def false_alarms(rate: float, config: DetectorConfig, period_s: float, seed: int, seconds: float) -> tuple[int, int]:
    """Alarms in the first ``WARM_S`` seconds and in the rest of ``seconds`` at a constant rate; the detector
    started as the monitor starts it and left to learn again after each alarm, as it does live."""
    rng = np.random.default_rng(seed)
    detector = started(rate, config, rng)
    early = late = 0
    for i, n in enumerate(rng.poisson(rate * period_s, size=int(seconds / period_s))):
        if detector.observe(int(n), period_s) is not None:
            if (i + 1) * period_s <= WARM_S:
                early += 1
            else:
                late += 1
    return early, late


def measure_constant(rates: list[float], seeds: int, seconds: float, period_s: float) -> list[dict[str, Any]]:
    rows = []
    with tqdm(total=len(rates) * len(TUNINGS) * seeds, desc="rates × tunings × streams", unit="stream") as bar:
        for rate in rates:
            for name, config in TUNINGS.items():
                early = late = 0
                for seed in range(seeds):
                    e, lt = false_alarms(rate, config, period_s, seed, seconds)
                    early, late = early + e, late + lt
                    bar.update()
                rows.append({
                    "rate": rate, "tuning": name, "early": early, "late": late, "streams": seeds,
                    "seconds": seconds, "design_per_hour": 2 * 3600.0 / config.false_alarm_seconds,
                })  # fmt: skip
    return rows


def per_hour(alarms: int, streams: int, seconds: float) -> float:
    return alarms / (streams * seconds / 3600.0)


def delay_s(old: float, new: float, config: DetectorConfig, period_s: float, seed: int) -> float | None:
    """Seconds from the change to the detector's first alarm in its direction; ``math.nan`` when it raised a
    false alarm before the change, None when it flagged nothing within ``LIMIT_S``."""
    rng = np.random.default_rng(seed)
    detector = started(old, config, rng)
    direction = "up" if new > old else "down"
    for i in range(int((WARM_S + LIMIT_S) / period_s)):
        before = i * period_s < WARM_S
        change = detector.observe(int(rng.poisson((old if before else new) * period_s)), period_s)
        if change is None:
            continue
        if before:
            return math.nan
        if change.direction == direction:
            return (i + 1) * period_s - WARM_S
    return None


def measure(steps: list[tuple[float, float]], seeds: int, period_s: float) -> list[dict[str, Any]]:
    rows = []
    with tqdm(total=len(steps) * len(TUNINGS) * seeds, desc="steps × tunings × streams", unit="stream") as bar:
        for old, new in steps:
            for name, config in TUNINGS.items():
                delays, early, missed = [], 0, 0
                for seed in range(seeds):
                    d = delay_s(old, new, config, period_s, seed)
                    if d is None:
                        missed += 1
                    elif math.isnan(d):
                        early += 1
                    else:
                        delays.append(d)
                    bar.update()
                rows.append({
                    "old": old, "new": new, "tuning": name, "delays": delays, "early_false_alarms": early,
                    "missed": missed, "streams": seeds, "evidence_per_s": evidence_per_second(old, new),
                })  # fmt: skip
    return rows


def render(data: dict[str, Any]) -> str:
    table_rows = []
    for row in data["rows"]:
        d = row["delays"]
        table_rows.append([
            f"{row['old']:g} → {row['new']:g}", row["tuning"], f"{row['evidence_per_s']:.1f}",
            f"{statistics.median(d):.2f}" if d else "-", f"{np.percentile(d, 90):.2f}" if d else "-",
            f"{sum(x <= 2.0 for x in d) / len(d):.0%}" if d else "-",
            f"{row['early_false_alarms']} / {row['missed']}",
        ])  # fmt: skip
    table = markdown_table(
        ["step (req/s)", "detector tuning (time between false alarms per direction)", "evidence (nats/s)",
         "delay median (s)", "delay p90 (s)", "flagged within 2 s", "false alarm before / not flagged"],
        table_rows,
    )  # fmt: skip
    constant_rows = [
        [f"{row['rate']:g}", row["tuning"], f"{row['design_per_hour']:g}",
         f"{per_hour(row['early'], row['streams'], WARM_S):.1f} ({row['early']})",
         f"{per_hour(row['late'], row['streams'], row['seconds'] - WARM_S):.1f} ({row['late']})"]
        for row in data.get("constant", [])
    ]  # fmt: skip
    constant = (
        f"## False alarms under a constant rate\n\n{data['constant_seeds']} seeded streams per rate and tuning, "
        f"{data['constant_seconds']:.0f} s each, the detector started as above and left to learn again after each "
        f"alarm. Alarms per hour, both directions together (count in brackets): in each stream's first "
        f"{WARM_S:.0f} s, while its rate is learned from few arrivals, and after.\n\n"
        + markdown_table(
            ["rate (req/s)", "detector tuning", "design (per h)", f"first {WARM_S:.0f} s (per h)", "after (per h)"],
            constant_rows,
        )
        + "\n\n"
        if constant_rows
        else ""
    )
    return (
        f"# The change detector's delay on steps of a Poisson rate (model)\n\n"
        f"{data['seeds']} seeded streams per step and tuning: {WARM_S:.0f} s at the old rate (the detector "
        f"started from a {MonitorConfig().long_window_s:.0f} s window's rate, as the load monitor starts it), "
        f"then the new rate; counts sampled every {data['period_s']} s. Delay = from the change to the first "
        f"alarm in its direction. Streams with a false alarm before the change are left out. The detector "
        f"alone: the load benchmarks' reactions add the policy's rules (a fall waits for a backlog to clear).\n\n"
        f"{table}\n\n![delay distributions]({data['stem']}.png)\n\n{constant}{provenance_block(data['provenance'])}"
    )


def plot(data: dict[str, Any], path: Path) -> None:
    fig, ax = new_figure((7.0, 3.8))
    for row in data["rows"]:
        d = sorted(row["delays"])
        if d:
            ax.step(d, [(i + 1) / len(d) for i in range(len(d))], where="post",
                    label=f"{row['old']:g}→{row['new']:g}, {row['tuning']}")  # fmt: skip
    ax.axvline(2.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("seconds from the change to the alarm")
    ax.set_ylabel("share of streams flagged")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_steps(text: str) -> list[tuple[float, float]]:
    try:
        steps = [tuple(float(x) for x in part.split(":")) for part in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected OLD:NEW,..., got {text!r}") from exc
    if any(len(s) != 2 or min(s) <= 0 or s[0] == s[1] for s in steps):
        raise argparse.ArgumentTypeError(f"expected positive OLD:NEW pairs that differ, got {text!r}")
    return steps  # type: ignore[return-value]  # pairs, checked above


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected RATE,..., got {text!r}") from exc
    if any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"expected positive rates, got {text!r}")
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=parse_steps, default=parse_steps("1.2:8.4,8.4:1.2,4:8,8:4"),
                        help="OLD:NEW rates (req/s); defaults: the 2-core step bench's 7x, and 2x")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=400)
    parser.add_argument("--rates", type=parse_rates, default=parse_rates("1.2,4,8.4"),
                        help="constant rates (req/s) whose false alarms are counted")  # fmt: skip
    parser.add_argument("--constant-seeds", type=int, default=200)
    parser.add_argument("--constant-seconds", type=float, default=600.0)
    parser.add_argument("--period-s", type=float, default=DEFAULT.period_s, help="how often counts are sampled")
    parser.add_argument("--stem", default="detector_delays")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.constant_seeds < 1 or args.period_s <= 0 or args.constant_seconds <= WARM_S:
        parser.error(f"--seeds and --constant-seeds must be ≥ 1, --period-s > 0, --constant-seconds > {WARM_S:g}")
    data = {
        "rows": measure(args.steps, args.seeds, args.period_s), "seeds": args.seeds, "period_s": args.period_s,
        "constant": measure_constant(args.rates, args.constant_seeds, args.constant_seconds, args.period_s),
        "constant_seeds": args.constant_seeds, "constant_seconds": args.constant_seconds,
        "stem": args.stem, "provenance": provenance("bench.detector_delays"),
    }  # fmt: skip
    print(publish(args.stem, data, render, plot, args.out_dir, args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
