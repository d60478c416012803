"""``packrat profile``: measure a model's single-instance latency L[t][b].

Every (threads, batch) point runs in a fresh process pinned to ``t`` cores of
one socket, with ``torch.set_num_threads(t)``, in the archive's execution
mode, after warm-up.  A fresh process per point keeps one point's allocator
and thread-pool state from leaking into the next.  The profile is saved after
every point, so an interrupted run loses at most one point and ``--resume``
picks up where it stopped; ``--time-budget`` stops cleanly with a partial
(``"complete": false``) profile.  Last, the serving handler's own cost per
request (decode, collate, encode) is timed at each thread count
(``handler_cost.py``) and kept under the profile's ``"handler"`` key, so
that plans and their predicted speedups account for what TorchServe's
worker pays besides the model.

An archive the user built with ``torch-model-archiver`` (any handler, with
or without a model-config.yaml) is profiled whole instead: its own handler
on the user's ``--sample`` request bodies, each point one batch through
TorchServe's ``Service.predict`` in a pinned process (``foreign.py``).  Its
points then include the handler's cost, so no separate handler cost is kept.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import yaml
from tqdm import tqdm

from archiver.names import catalog_name
from model_store.catalog import ModelSpec, get_spec
from packrat_plugin.allocator import allocate
from packrat_plugin.foreign import ArchiveInfo, ForeignJob, ForeignProcess, Sample, read_archive, read_samples
from packrat_plugin.handler_cost import measure_handler_cost
from packrat_plugin.measure import InstanceJob, InstanceProcess, WindowResult
from packrat_plugin.plan_types import Plan, PlanItem
from packrat_plugin.profile import HANDLER_KEY, HandlerCost, Profile, ProfileError, ProfilePoint, load_profile
from serving_harness.machine import hardware_fingerprint
from serving_harness.topology import CpuTopology

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
    from archiver.build import write_artefact  # torch: only where a profile is measured

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


def measure_foreign_point(
    info: ArchiveInfo, samples: list[Sample], threads: int, batch: int, warmup: int, iters: int,
    max_seconds: float, topology: CpuTopology,
) -> ProfilePoint:  # fmt: skip
    """One point of a user's archive: its handler on ``batch`` sample requests, pinned to ``threads`` cores."""
    cores = cores_for(threads, topology)
    job = ForeignJob(str(info.path), info.model_name, info.handler, tuple(samples), threads, batch, cores, warmup)
    with ForeignProcess(job) as proc:
        affinity, seen = tuple(proc.seen["affinity"]), proc.seen["threads"]
        if affinity != cores or seen != threads:
            raise RuntimeError(f"the handler ran on cores {affinity} with {seen} threads, not {cores} with {threads}")
        started = time.time()
        lat = proc.time(iters, max_seconds)
    stats = WindowResult(lat, started, time.time()).stats()
    latency_ms = stats.pop("latency_ms")
    return ProfilePoint(threads, batch, latency_ms, {**stats, "cores": list(affinity), "threads_seen": seen})


def run_foreign_profile(
    info: ArchiveInfo, samples: list[Sample], threads: list[int], batches: list[int], out: Path,
    warmup: int = 2, iters: int = 10, max_seconds_per_point: float = 30.0, command: str | None = None,
) -> Profile:  # fmt: skip
    """Profile a user's archive whole (handler and model), saving after every point."""
    topology = CpuTopology.from_system()
    usable = len(topology.cores)
    if max(threads) > usable:
        raise ValueError(f"cannot profile {max(threads)} threads: only {usable} cores are usable here")
    meta = {
        "mode": "archive",
        "source": {"archive": info.path.name, "handler": info.handler, "samples": [s.name for s in samples]},
        "handler_included": True,  # each point is the whole handler: no separate handler cost
        "warmup": warmup,
        "iters": iters,
        "passes": 1,
        "command": command or "",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    points: list[ProfilePoint] = []
    hardware = hardware_fingerprint()

    def save(complete: bool) -> Profile:
        profile = Profile(info.model_name, tuple(points), hardware, {**meta, "complete": complete})
        profile.save(out, grid={"threads": threads, "batches": batches})
        return profile

    grid = [(t, b) for t in threads for b in batches]
    with tqdm(grid, desc=f"profile {info.model_name} (its archive's handler)", unit="point") as bar:
        for t, b in bar:
            bar.set_postfix_str(f"t={t} b={b}")
            points.append(measure_foreign_point(info, samples, t, b, warmup, iters, max_seconds_per_point, topology))
            save(complete=False)
    return save(complete=True)


def passes_of(point: ProfilePoint | None) -> list[float]:
    """The mean latency of each pass a point has had (a one-pass point: its latency)."""
    return [] if point is None else point.passes_ms


def with_pass(previous: ProfilePoint | None, new: ProfilePoint) -> ProfilePoint:
    """``previous`` with one more pass: the latency is the median of the passes'
    means; the other statistics (p50, p99, iterations, cores) are the last pass's."""
    means = [*passes_of(previous), new.latency_ms]
    if len(means) == 1:
        return new
    return ProfilePoint(new.threads, new.batch, statistics.median(means), {**new.extra, "pass_ms": means})


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
    handler_requests: int = 32,
    passes: int = 1,
) -> Profile:
    if passes < 1:
        raise ValueError(f"passes must be ≥ 1, got {passes}")
    topology = CpuTopology.from_system()
    usable = len(topology.cores)
    if max(threads) > usable:
        raise ValueError(f"cannot profile {max(threads)} threads: only {usable} cores are usable here")
    hardware = hardware_fingerprint()
    done: dict[tuple[int, int], ProfilePoint] = {}
    handler: HandlerCost | None = None
    with tempfile.TemporaryDirectory(prefix="packrat-profile-") as tmp:
        prepared = prepare_model(source, mode, Path(tmp))
        spec = prepared.spec
        if resume and out.exists():
            previous = load_profile(out, check_machine=True, allow_incomplete=True)
            if previous.model != spec.name or previous.meta.get("mode") != spec.mode:
                raise ProfileError(f"{out} holds {previous.model} ({previous.meta.get('mode')}), not {spec.name}")
            done = {(p.threads, p.batch): p for p in previous.points}
            handler = previous.handler
        grid = [(t, b) for t in threads for b in batches]

        # Pass-major: every pass sweeps the whole grid, so a slow phase of a
        # shared machine lands on one pass of many points rather than on all
        # passes of a few, and the median over passes leaves it out.  Within a
        # pass, batch-major with the thread counts taking turns (reversed every
        # other pass): what the policy weighs is the ratio between worker
        # classes at one batch, and measured a minute apart on a VM that drifts
        # it came out 1.47 where serving showed 1.86 (t = 1 against t = 2, b = 1;
        # docs/benchmarks/reading/packrat.md).
        def sweep(k: int) -> list[tuple[int, int]]:
            return [(t, b) for b in batches for t in (threads if k % 2 == 0 else threads[::-1])]

        todo = [(k, tb) for k in range(passes) for tb in sweep(k) if len(passes_of(done.get(tb))) <= k]
        meta = {
            "mode": spec.mode,
            "warmup": warmup,
            "iters": iters,
            "passes": passes,
            "command": command or "",
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

        def save(complete: bool) -> Profile:
            points = tuple(done[tb] for tb in grid if tb in done)
            extra = {HANDLER_KEY: handler.to_dict()} if handler is not None else {}
            profile = Profile(spec.name, points, hardware, {**meta, **extra, "complete": complete})
            profile.save(out, grid={"threads": threads, "batches": batches})
            return profile

        started = time.monotonic()
        with tqdm(todo, desc=f"profile {spec.name} ({spec.mode})", unit="point") as bar:
            for k, (t, b) in bar:
                if time_budget_s is not None and time.monotonic() - started > time_budget_s:
                    bar.write(f"time budget of {time_budget_s:.0f} s spent; resume with --resume")
                    return save(complete=False)
                bar.set_postfix_str(f"t={t} b={b}" + (f" pass {k + 1}/{passes}" if passes > 1 else ""))
                point = measure_point(prepared, t, b, warmup, iters, max_seconds_per_point, topology)
                done[(t, b)] = with_pass(done.get((t, b)), point)
                save(complete=False)
        if handler_requests > 0:
            missing = [t for t in threads if handler is None or t not in handler.per_request_ms]
            costs = dict(handler.per_request_ms) if handler is not None else {}
            for t in tqdm(missing, desc=f"handler cost {spec.name}", unit="threads"):
                costs[t] = measure_handler_cost(spec, str(prepared.artefact), t, cores_for(t, topology),
                                                requests=handler_requests)  # fmt: skip
            handler = HandlerCost(costs, handler_requests if missing else handler.requests)
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
    parser.add_argument("--passes", type=int, default=1,
                        help="sweep the grid this many times; each point's latency is the median of its passes "
                             "(on a shared VM whose speed drifts, 3 keeps one slow phase out of the plan)")  # fmt: skip
    parser.add_argument("--sample", action="append", default=[], metavar="FILE",
                        help="an archive you built yourself: a request body its handler accepts (a JPEG, a JSON file, "
                             "text); repeatable, or a folder of files")  # fmt: skip
    parser.add_argument("--handler-requests", type=int, default=32,
                        help="requests to time the serving handler's per-request cost with, at each thread count "
                             "(decode + collate + encode; plans account for it); 0: the model alone")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    threads = parse_int_list(args.threads) if args.threads else list(range(1, len(CpuTopology.from_system().cores) + 1))
    batches = parse_int_list(args.batches)
    command = "packrat profile " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    if args.model.endswith(".mar"):
        info = read_archive(args.model)
        if not info.ours:  # the user's own archive: its handler, on the user's samples
            if args.resume or args.passes != 1 or args.time_budget is not None:
                raise ValueError("--resume, --passes and --time-budget apply to catalog models and packrat archives")
            samples = read_samples(args.sample)
            out = args.out or PROFILE_DIR / f"{info.model_name}.json"
            profile = run_foreign_profile(info, samples, threads, batches, out, args.warmup, args.iters,
                                          args.max_seconds_per_point, command)  # fmt: skip
            print(f"wrote {out}: {len(profile.points)} points (the archive's handler {info.handler!r}, "
                  f"{len(samples)} sample(s))")  # fmt: skip
            print(format_table(profile))
            return 0
    if args.sample:
        raise ValueError("--sample is for archives you built yourself; this one's handler decodes the catalog's inputs")
    name = catalog_name(args.model) if args.model.endswith(".mar") else args.model
    out = args.out or PROFILE_DIR / f"{name}.json"
    profile = run_profile(
        args.model, threads, batches, out, args.mode, args.warmup, args.iters,
        args.max_seconds_per_point, args.resume, args.time_budget, command, args.handler_requests, args.passes,
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
# Three sweeps, each point the median of its three: one sweep's points on a shared VM are each one draw of
# a speed that drifts by up to 1.7x over seconds (about a minute for ResNet-50 on 2 cores per sweep).
BRIEF_PASSES = 3


def profile_for_this_machine(
    model: str,
    path: Path | None = None,
    force: bool = False,
    mode: str = "script",
    batches: list[int] | None = None,
    local_dir: Path = LOCAL_PROFILE_DIR,
    users_archive: Path | None = None,
) -> tuple[Profile, Path]:
    """A profile of ``model`` that is valid on this machine, measuring one if need be.

    ``users_archive``: the model is an archive the user built, whose handler
    only the user's samples can drive, so nothing is measured here: without
    a fitting profile this says in one line how to make one.

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
    if users_archive is not None:
        raise ValueError(
            f"no profile of {model} for this machine ({'; '.join(reasons)}): run `packrat profile {users_archive} "
            f"--sample FILE` first (a request body its handler accepts), or pass the path of one with --profile"
        )
    out = local_dir / f"{model}.json"
    cores = len(CpuTopology.from_system().cores)
    print(
        f"no profile of {model} for this machine ({'; '.join(reasons)}); profiling briefly into {out}. "
        f"For a thorough one: packrat profile {model} --out profiles/{model}.json",
        file=sys.stderr,
    )
    profile = run_profile(model, list(range(1, cores + 1)), batches or BRIEF_BATCHES, out, mode=mode, warmup=2, iters=5,
                          passes=BRIEF_PASSES)  # fmt: skip
    return profile, out
