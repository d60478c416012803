"""Several models on one server: TorchServe's default vs each model planned alone vs Packrat's shared division.

    python -m bench.packrat_multi --models resnet50=0.3,distilbert=0.3 --json out.json

Each model gets open-loop Poisson arrivals at a fixed share of what the whole
machine could serve of it alone (its best uniform plan over all cores, from
its profile for this machine; measured first if there is none), all models at
once, the same arrival times for every system.  Three systems, each in a
fresh TorchServe, in turn (ABC, then CBA, ...):

- ``fat``: TorchServe's default, one unpinned worker per model with every
  core's worth of threads (torch's default) and ``--fat-batch``;
- ``alone``: the Packrat controller with ``--no-share-cores``: each model
  plans and pins over all cores as if it were alone (what Packrat did before
  it could share);
- ``shared``: the Packrat controller dividing the cores among the models
  (``division.py``, objective ``--objective``).

Both Packrat systems reconfigure as they would in production; a warm-up
window at the same rates lets them settle before the measured window.  The
headline is the worst model's mean latency, per repeat, as a ratio to
``shared``'s in the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm

from bench.report import (
    add_output_arguments,
    markdown_table,
    new_figure,
    provenance_block,
    run_benchmark,
    save_figure,
)
from packrat_plugin.controller import PackratController
from packrat_plugin.division import OBJECTIVES, DivisionConfig
from packrat_plugin.model_control import ControllerConfig, ModelTarget
from packrat_plugin.plan_types import format_instances
from packrat_plugin.profile import Profile
from packrat_plugin.swapper import SwapperConfig
from serving_harness.loadgen import LoadResult, open_loop
from serving_harness.topology import CpuTopology
from serving_harness.torchserve import Ports, TorchServeProcess

SYSTEMS = ("fat", "alone", "shared")


def machine_capacity(profile: Profile, cores: int) -> float:
    """Requests/s the whole machine serves of this model alone at best: i = T // t instances of ⟨t, b⟩."""
    return max((cores // p.threads) * p.batch / (p.latency_ms / 1000.0) for p in profile.points if p.threads <= cores)


def parse_models(text: str) -> list[tuple[str, float]]:
    out = []
    for part in text.split(","):
        name, sep, share = part.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"--models wants NAME=SHARE,..., got {part!r}")
        value = float(share)
        if not 0 < value < 1:
            raise argparse.ArgumentTypeError(f"{name}: a load share must be in (0, 1), got {value}")
        out.append((name, value))
    if len({n for n, _ in out}) != len(out):
        raise argparse.ArgumentTypeError("--models names must be unique")
    return out


async def drive(urls: dict[str, str], payloads: dict[str, Any], rates: dict[str, float], seconds: float,
                seed: int) -> dict[str, LoadResult]:  # fmt: skip
    names = list(urls)
    results = await asyncio.gather(*(
        open_loop(urls[n], payloads[n], [(seconds, rates[n])], seed=seed + i) for i, n in enumerate(names)
    ))  # fmt: skip
    return dict(zip(names, results, strict=True))


def summarise(result: LoadResult) -> dict[str, Any]:
    ok = result.ok
    return {
        "requests": len(result.samples),
        "failed": result.failed,
        "mean_ms": result.mean_latency_ms() if ok else None,
        "p50_ms": result.percentile_ms(50) if ok else None,
        "p99_ms": result.percentile_ms(99) if ok else None,
        "throughput": result.throughput(),
    }


class FatSystem:
    """TorchServe's default: one unpinned worker per model."""

    def __init__(self, workdir: Path, archives: dict[str, Path], batch: int, delay_ms: int) -> None:
        store = workdir / "model_store"
        store.mkdir(parents=True)
        for name, archive in archives.items():
            shutil.copy(archive, store / f"{name}.mar")
        self.server = TorchServeProcess(workdir / "ts", store, ports=Ports.free())
        self.archives, self.batch, self.delay_ms = archives, batch, delay_ms

    def __enter__(self) -> FatSystem:
        self.server.start()
        management = self.server.management()
        for name in self.archives:
            management.register(f"{name}.mar", model_name=name, initial_workers=1, batch_size=self.batch,
                                max_batch_delay_ms=self.delay_ms, synchronous=True)  # fmt: skip
            management.scale(name, 1, synchronous=True)
        return self

    def url(self, name: str) -> str:
        return f"{self.server.inference_url}/predictions/{name}"

    def describe(self) -> dict[str, Any]:
        return {name: {"plan": f"1×⟨unpinned,b={self.batch}⟩", "cores": None, "swaps": 0} for name in self.archives}

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


class PackratSystem:
    def __init__(self, workdir: Path, targets: list[ModelTarget], config: ControllerConfig) -> None:
        self.controller = PackratController(workdir, targets, config, ports=Ports.free(), status_port=None)

    def __enter__(self) -> PackratSystem:
        self.controller.start()
        return self

    def url(self, name: str) -> str:
        return f"{self.controller.server.inference_url}/predictions/{name}"

    def describe(self) -> dict[str, Any]:
        status = self.controller.status()
        out = {}
        for name, m in status["models"].items():
            plan = m["plan"]
            out[name] = {
                "plan": format_instances(plan["instances"] if plan else None),
                "cores": m["cores"],
                "swaps": m["swaps"],
            }
        return out

    def __exit__(self, *exc: object) -> None:
        self.controller.stop()


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from archiver.build import build_archive
    from model_store import ARCHIVE_DIR
    from model_store.catalog import get_spec
    from model_store.samples import client_payload
    from packrat_plugin.profiler import profile_for_this_machine

    topology = CpuTopology.from_system()
    cores = len(topology.cores)
    models = parse_models(args.models)
    specs = {name: get_spec(name, args.mode) for name, _ in models}
    archives = {name: build_archive(spec, ARCHIVE_DIR) for name, spec in specs.items()}
    profiles = {name: profile_for_this_machine(name, None, args.force, args.mode)[0] for name in specs}
    rates = {name: share * machine_capacity(profiles[name], cores) for name, share in models}
    bodies = {name: [client_payload(spec, seed=i) for i in range(32)] for name, spec in specs.items()}
    payloads = {name: (lambda i, b=bodies[name]: b[i % len(b)]) for name in specs}
    targets = [ModelTarget(name, archives[name], profiles[name]) for name in specs]

    def packrat_config(share: bool) -> ControllerConfig:
        return ControllerConfig(
            swapper=SwapperConfig(max_batch_delay_ms=args.max_batch_delay),
            standby_workers=args.standby_workers,
            share_cores=share,
            division=DivisionConfig(objective=args.objective, min_cores=1),
        )

    def system(kind: str, path: Path) -> Any:
        if kind == "fat":
            return FatSystem(path, archives, args.fat_batch, args.max_batch_delay)
        return PackratSystem(path, targets, packrat_config(kind == "shared"))

    runs: list[dict[str, Any]] = []
    order = [SYSTEMS if r % 2 == 0 else tuple(reversed(SYSTEMS)) for r in range(args.repeats)]
    bar = tqdm(total=args.repeats * len(SYSTEMS), desc="fat / alone / shared", unit="system")
    for r, systems in enumerate(order):
        for kind in systems:
            started = time.monotonic()
            with system(kind, workdir / f"{kind}-{r}") as sut:
                urls = {name: sut.url(name) for name in specs}
                asyncio.run(drive(urls, payloads, rates, args.warmup_seconds, seed=1000 * r + 500))
                results = asyncio.run(drive(urls, payloads, rates, args.seconds, seed=1000 * r))
                runs.append({
                    "repeat": r, "system": kind, "models": {n: summarise(res) for n, res in results.items()},
                    "config": sut.describe(), "wall_s": round(time.monotonic() - started, 1),
                })  # fmt: skip
            bar.update()
    bar.close()
    return {
        "cores": cores,
        "mode": args.mode,
        "objective": args.objective,
        "seconds": args.seconds,
        "warmup_seconds": args.warmup_seconds,
        "repeats": args.repeats,
        "fat_batch": args.fat_batch,
        "models": [
            {"name": n, "share": s, "rate": round(rates[n], 3), "capacity": round(rates[n] / s, 3)} for n, s in models
        ],
        "runs": runs,
        "rows": rows_of(runs, [n for n, _ in models]),
    }


def worst_mean(run: dict[str, Any]) -> float:
    means = [m["mean_ms"] for m in run["models"].values()]
    return float("inf") if None in means else max(means)


def rows_of(runs: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """One row per system: per-model medians over repeats, and the worst-model ratio to ``shared``."""
    rows = []
    for kind in SYSTEMS:
        mine = [r for r in runs if r["system"] == kind]
        row: dict[str, Any] = {"system": kind, "failed": sum(m["failed"] for r in mine for m in r["models"].values())}
        for n in names:
            for key in ("mean_ms", "p99_ms"):
                values = [r["models"][n][key] for r in mine if r["models"][n][key] is not None]
                row[f"{n}_{key}"] = statistics.median(values) if values else None
        row["worst_mean_ms"] = statistics.median(worst_mean(r) for r in mine)
        ratios = []
        for r in mine:
            shared = next(s for s in runs if s["system"] == "shared" and s["repeat"] == r["repeat"])
            ratios.append(worst_mean(r) / worst_mean(shared))
        row["worst_vs_shared"] = statistics.median(ratios)
        row["worst_vs_shared_min"], row["worst_vs_shared_max"] = min(ratios), max(ratios)
        row["config"] = mine[-1]["config"]
        rows.append(row)
    return rows


def summary(data: dict[str, Any]) -> dict[str, float]:
    by = {r["system"]: r for r in data["rows"]}
    return {f"{k}_worst_mean_over_shared": by[k]["worst_vs_shared"] for k in ("fat", "alone")}


def render(data: dict[str, Any], stem: str) -> str:
    names = [m["name"] for m in data["models"]]
    header = ["system", *[f"{n} mean / p99 ms" for n in names], "worst mean ms", "worst ÷ shared (min-max)",
              "plans (cores)", "failed"]  # fmt: skip
    rows = []
    for r in data["rows"]:
        cells = [r["system"]]
        for n in names:
            mean, p99 = r[f"{n}_mean_ms"], r[f"{n}_p99_ms"]
            cells.append("-" if mean is None else f"{mean:.0f} / {p99:.0f}")
        cells.append(f"{r['worst_mean_ms']:.0f}")
        cells.append(f"{r['worst_vs_shared']:.2f} ({r['worst_vs_shared_min']:.2f}-{r['worst_vs_shared_max']:.2f})")
        plans = "; ".join(
            f"{n}: {c['plan']}" + (f" on {c['cores']}" if c["cores"] is not None else "")
            for n, c in r["config"].items()
        )
        cells += [plans, r["failed"]]
        rows.append(cells)
    loads = ", ".join(
        f"{m['name']} {m['rate']:.1f}/s ({m['share']:.0%} of {m['capacity']:.1f}/s)" for m in data["models"]
    )
    s = data["summary"]
    return (
        f"# Several models on one {data['cores']}-core server: fat vs planned alone vs shared division\n\n"
        f"Open-loop Poisson load on every model at once: {loads} (share of what the whole machine serves of "
        f"that model alone, by its profile). Each system in a fresh TorchServe, {data['repeats']} interleaved "
        f"rounds of a {data['warmup_seconds']:g} s warm-up and a {data['seconds']:g} s measured window; "
        f"medians over rounds. Objective of the division: {data['objective']}. Fat: one unpinned worker per "
        f"model, batch {data['fat_batch']}. Plans are the last round's, after the controllers settled.\n\n"
        f"{markdown_table(header, rows)}\n\n"
        f"Worst model's mean latency: fat ÷ shared **{s['fat_worst_mean_over_shared']:.2f}×**, "
        f"alone ÷ shared **{s['alone_worst_mean_over_shared']:.2f}×**.\n\n"
        f"![worst-model latency]({stem}.png)\n\n{provenance_block(data['provenance'])}"
    )


def plot(data: dict[str, Any], path: Path) -> None:
    names = [m["name"] for m in data["models"]]
    fig, ax = new_figure()
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        values = [r[f"{n}_mean_ms"] or 0.0 for r in data["rows"]]
        xs = [j + i * width for j in range(len(data["rows"]))]
        ax.bar(xs, values, width, label=f"{n} mean")
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(data["rows"]))])
    ax.set_xticklabels([r["system"] for r in data["rows"]])
    save_figure(fig, ax, path, "system", "mean latency (ms)", f"{len(names)} models on {data['cores']} cores")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--models",
        default="resnet50=0.3,distilbert=0.3",
        help="catalog models and their load, as a share of the whole machine's capacity for each",
    )
    p.add_argument("--mode", default="script", choices=("eager", "script", "compile"))
    p.add_argument("--objective", choices=OBJECTIVES, default="worst")
    p.add_argument("--seconds", type=float, default=40.0, help="measured window per system and round")
    p.add_argument("--warmup-seconds", type=float, default=20.0, help="load before it, for the controllers to settle")
    p.add_argument("--repeats", type=int, default=2, help="rounds, interleaved ABC / CBA")
    p.add_argument("--fat-batch", type=int, default=4, help="batch_size of the fat workers")
    p.add_argument("--max-batch-delay", type=int, default=5, help="TorchServe max_batch_delay (ms)")
    p.add_argument("--standby-workers", type=int, default=2, help="Packrat's warm standby workers per model")
    p.add_argument("--force", action="store_true", help="use profiles measured on other hardware")
    p.add_argument("--quick", action="store_true", help="one short round (a smoke run, not a result)")
    p.add_argument("--suffix", default="", help="appended to the output files' name (another load, say)")
    add_output_arguments(p)
    args = p.parse_args(argv)
    if args.quick:
        args.seconds, args.warmup_seconds, args.repeats = 10.0, 5.0, 1
    parse_models(args.models)  # fail on a bad flag before building anything

    def stem_of(data: dict[str, Any]) -> str:
        names = "_".join(m["name"] for m in data["models"])
        return f"packrat_multi_{names}{args.suffix}" + ("_quick" if args.quick else "")

    return run_benchmark("bench.packrat_multi", args, measure, summary, stem_of, render, plot)


if __name__ == "__main__":
    raise SystemExit(main())
