"""``packrat profile``: measure a model's single-instance latency L[t][b].

Every (threads, batch) point runs in a fresh process pinned to ``t`` cores of
one socket, with ``torch.set_num_threads(t)``, in the archive's execution
mode, after warm-up.  A fresh process per point keeps one point's allocator
and thread-pool state from leaking into the next.  The profile is saved after
every point, so an interrupted run loses at most one point and ``--resume``
picks up where it stopped; ``--time-budget`` stops cleanly with a partial
(``"complete": false``) profile.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import yaml
from tqdm import tqdm

from model_store.build import catalog_name, write_artefact
from model_store.catalog import ModelSpec, get_spec
from packrat_plugin.measure import InstanceJob, InstanceProcess, WindowResult
from packrat_plugin.plan_types import Plan, PlanItem
from packrat_plugin.profile import Profile, ProfileError, ProfilePoint, hardware_fingerprint, load_profile
from packrat_plugin.topology import CpuTopology, allocate

PROFILE_DIR = Path("profiles")


@dataclass(frozen=True)
class PreparedModel:
    spec: ModelSpec
    artefact: Path


def prepare_model(source: str, mode: str, workdir: Path) -> PreparedModel:
    """A catalog name (built here in ``mode``) or a .mar (its own mode)."""
    if source.endswith(".mar"):
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"no archive at {path}")
        with zipfile.ZipFile(path) as mar:
            config = yaml.safe_load(mar.read("model-config.yaml"))
            manifest = json.loads(mar.read("MAR-INF/MANIFEST.json"))
            serialized = manifest["model"]["serializedFile"]
            mar.extract(serialized, workdir)
        spec = ModelSpec.from_dict(config["handler"]["spec"])
        return PreparedModel(spec, workdir / serialized)
    spec = get_spec(source, mode)
    return PreparedModel(spec, write_artefact(spec, workdir))


def parse_int_list(text: str) -> list[int]:
    """``"1-4"`` → [1, 2, 3, 4]; ``"1,2,8"`` → [1, 2, 8]; mixed allowed."""
    values: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-", 1))
            if lo > hi:
                raise ValueError(f"empty range {part!r}")
            values.update(range(lo, hi + 1))
        else:
            values.add(int(part))
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers, got {text!r}")
    return sorted(values)


def cores_for(threads: int, topology: CpuTopology) -> tuple[int, ...]:
    (slot,) = allocate(Plan(threads, 1, 0.0, (PlanItem(1, threads, 1),)), topology)
    return slot.cores


def measure_point(
    prepared: PreparedModel, threads: int, batch: int, warmup: int, iters: int, max_seconds: float, topology
) -> ProfilePoint:
    job = InstanceJob(
        prepared.spec.to_dict(), str(prepared.artefact), threads, batch, cores_for(threads, topology), warmup
    )
    with InstanceProcess(job) as inst:
        inst.wait_ready()
        # Run ``iters`` iterations, or fewer (but at least 3) when a point is
        # so slow that ``max_seconds`` would be exceeded: large batches on one
        # core dominate a profile's run time otherwise.
        inst.request(time.time(), duration_s=0.0, min_iters=1)
        first = inst.result(timeout_s=3600)
        if first.affinity != job.cores or first.threads_seen != threads:
            raise RuntimeError(
                f"instance ran on cores {first.affinity} with {first.threads_seen} threads, "
                f"expected cores {job.cores} with {threads}"
            )
        per_iter_s = first.latencies_ms[0] / 1e3
        remaining = max(min(iters, 3), min(iters, int(max_seconds / max(per_iter_s, 1e-6)))) - 1
        lat = list(first.latencies_ms)
        if remaining > 0:
            inst.request(time.time(), duration_s=0.0, min_iters=remaining)
            lat += inst.result(timeout_s=3600).latencies_ms
    stats = WindowResult(lat, first.started, time.time()).stats()
    # What the child reported about itself, not what it was asked for: a
    # profile's reader can check that a point really ran on its cores.
    latency_ms = stats.pop("latency_ms")
    extra = {**stats, "cores": list(first.affinity), "threads_seen": first.threads_seen}
    return ProfilePoint(threads, batch, latency_ms, extra)


def run_profile(
    source: str,
    threads: list[int],
    batches: list[int],
    out: Path,
    mode: str = "script",
    warmup: int = 2,
    iters: int = 10,
    max_seconds_per_point: float = 30.0,
    resume: bool = False,
    time_budget_s: float | None = None,
    command: str | None = None,
) -> Profile:
    topology = CpuTopology.from_system()
    usable = len(topology.cores)
    if max(threads) > usable:
        raise ValueError(f"cannot profile {max(threads)} threads: only {usable} cores are usable here")
    hardware = hardware_fingerprint()
    done: dict[tuple[int, int], ProfilePoint] = {}
    with tempfile.TemporaryDirectory(prefix="packrat-profile-") as tmp:
        prepared = prepare_model(source, mode, Path(tmp))
        spec = prepared.spec
        if resume and out.exists():
            previous = load_profile(out, check_machine=True, allow_incomplete=True)
            if previous.model != spec.name or previous.meta.get("mode") != spec.mode:
                raise ProfileError(f"{out} holds {previous.model} ({previous.meta.get('mode')}), not {spec.name}")
            done = {(p.threads, p.batch): p for p in previous.points}
        grid = [(t, b) for t in threads for b in batches]
        todo = [tb for tb in grid if tb not in done]
        meta = {
            "mode": spec.mode,
            "warmup": warmup,
            "iters": iters,
            "command": command or "",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

        def save(complete: bool) -> Profile:
            points = tuple(done[tb] for tb in grid if tb in done)
            profile = Profile(spec.name, points, hardware, {**meta, "complete": complete})
            profile.save(out, grid={"threads": threads, "batches": batches})
            return profile

        started = time.monotonic()
        with tqdm(todo, desc=f"profile {spec.name} ({spec.mode})", unit="point") as bar:
            for t, b in bar:
                if time_budget_s is not None and time.monotonic() - started > time_budget_s:
                    bar.write(f"time budget of {time_budget_s:.0f} s spent; resume with --resume")
                    return save(complete=False)
                bar.set_postfix_str(f"t={t} b={b}")
                done[(t, b)] = measure_point(prepared, t, b, warmup, iters, max_seconds_per_point, topology)
                save(complete=False)
        return save(complete=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="catalog name (built in --mode) or path to a .mar archive")
    parser.add_argument("--threads", default=None, help="e.g. 1-8 or 1,2,4 (default: 1 to all usable cores)")
    parser.add_argument("--batches", default="1,2,4,8,16", help="e.g. 1,2,4,8,16")
    parser.add_argument("--mode", default="script", choices=("eager", "script", "compile"))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--max-seconds-per-point", type=float, default=30.0,
                        help="cut a slow point's iterations (never below 3) to about this long")  # fmt: skip
    parser.add_argument("--out", type=Path, help="profile path (default: profiles/<model>.json)")
    parser.add_argument("--resume", action="store_true", help="keep points already in --out")
    parser.add_argument("--time-budget", type=float, help="seconds; stop with a partial profile after this")


def run(args: argparse.Namespace) -> int:
    threads = parse_int_list(args.threads) if args.threads else list(range(1, len(CpuTopology.from_system().cores) + 1))
    batches = parse_int_list(args.batches)
    name = catalog_name(args.model) if args.model.endswith(".mar") else args.model
    out = args.out or PROFILE_DIR / f"{name}.json"
    command = "packrat profile " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    profile = run_profile(
        args.model, threads, batches, out, args.mode, args.warmup, args.iters,
        args.max_seconds_per_point, args.resume, args.time_budget, command,
    )  # fmt: skip
    print(f"wrote {out}: {len(profile.points)} points" + ("" if profile.meta.get("complete") else " (partial)"))
    print(format_table(profile))
    return 0 if profile.meta.get("complete") else 3


def format_table(profile: Profile) -> str:
    """Latency (ms) with threads as rows and batch sizes as columns."""
    batches = profile.batches
    lines = ["threads \\ batch " + "".join(f"{b:>10}" for b in batches)]
    for t in profile.threads:
        cells = []
        for b in batches:
            try:
                cells.append(f"{profile.latency(t, b):>10.1f}")
            except KeyError:
                cells.append(f"{'-':>10}")
        lines.append(f"{t:>15} " + "".join(cells))
    return "\n".join(lines)


LOCAL_PROFILE_DIR = Path("logs/profiles")
BRIEF_BATCHES = [1, 2, 4, 8]


def profile_for_this_machine(
    model: str,
    path: Path | None = None,
    force: bool = False,
    mode: str = "script",
    batches: list[int] | None = None,
    local_dir: Path = LOCAL_PROFILE_DIR,
) -> tuple[Profile, Path]:
    """A profile of ``model`` that is valid on this machine, measuring one if need be.

    Tries ``path`` (default ``profiles/<model>.json``), then a profile this
    machine measured earlier under ``local_dir``; when neither fits this
    hardware, profiles briefly (every usable thread count, ``batches``, few
    iterations) into ``local_dir``, as ``packrat demo`` does, and says so.
    A longer, more exact profile is one ``packrat profile`` away.
    """
    candidates = [path or Path("profiles") / f"{model}.json", local_dir / f"{model}.json"]
    reasons = []
    for candidate in candidates:
        try:
            return load_profile(candidate, force=force), candidate
        except ProfileError as exc:
            reasons.append(str(exc))
    out = local_dir / f"{model}.json"
    cores = len(CpuTopology.from_system().cores)
    print(
        f"no profile of {model} for this machine ({'; '.join(reasons)}); profiling briefly into {out}. "
        f"For a thorough one: packrat profile {model} --out profiles/{model}.json",
        file=sys.stderr,
    )
    profile = run_profile(model, list(range(1, cores + 1)), batches or BRIEF_BATCHES, out, mode=mode, warmup=2, iters=5)
    return profile, out
