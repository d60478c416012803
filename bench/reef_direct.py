"""REEF against its baselines with the handler driven in-process, for machines without TorchServe (a GPU).

    python -m bench.reef_direct --device cuda --workload A
    python -m bench.reef_direct --device cpu --quick        # a dry run of the same code

``bench/reef.py`` measures REEF through a real TorchServe; a GPU machine
without Java cannot run it.  Here the same workloads (``WORKLOADS``), the same
systems and the same table come from ``ReefHandler`` objects in this process,
initialised and called as TorchServe's Python worker does
(``bench/direct.py``): each request is one ``handle`` call on the event
loop, with the ``X-Model`` and ``X-Priority`` headers a client would send.
Left out: HTTP and the Java frontend, which every system pays alike.

Each policy (``seq``, ``concurrent``, ``reef``) is its own handler, as it is
its own TorchServe worker there; all live in this one process and only the
one being driven has work (the others' threads sleep).  ``rt-only`` is the
REEF handler with the RT clients alone.  The RT clients' rates come from each
RT model's L1 (alone on the REEF handler, measured first in this run), as in
``bench/reef.py``.  Preemption latency is read from the engine itself (from
the RT admission until no BE unit was in flight).

``--padding`` adds ``reef-pad``: REEF with ``padding: true`` (best-effort
units keep running beside real-time work while the RT stream leaves the GPU
room; ``handlers/reef/config.py``), against plain priority streams.
``--green`` adds ``reef-green``: REEF with ``rt_sms: auto`` (real-time and
best-effort work on disjoint SMs, CUDA green contexts, no preemption gate;
``handlers/runtime/sm_partition.py``).  On a CPU the setting is ignored, so
there it is REEF again (a dry run of the script, not a measurement).
``--graphs`` adds ``reef-graphs``: REEF with ``be_graphs: true`` (each
best-effort unit a CUDA graph per batch bucket; ignored on a CPU too).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from archiver.options import ServingOptions
from bench.direct import BurstCaller, group_load_context
from bench.direct_systems import cpu_seconds_by_role, cpu_us_per_answer, play, python_us
from bench.reef import POLICIES, WORKLOADS, members_of, plot, render, run_row, summarise, workload_settings
from bench.report import add_output_arguments, markdown_table, run_benchmark
from handlers.reef.handler import ENGINE_KEY, ReefHandler
from model_store.catalog import ModelSpec, get_spec
from model_store.samples import client_payload, request_body
from serving_harness.loadgen import LoadResult, Sample

PADDED = "reef-pad"
GREEN = "reef-green"
GRAPHS = "reef-graphs"
VARIANTS = {PADDED: {"padding": True}, GREEN: {"rt_sms": "auto"}, GRAPHS: {"be_graphs": True}}  # one setting changed


_BODIES: dict[tuple[str, int], dict[str, Any]] = {}
BASE_POLICIES = tuple(p for p in POLICIES if p != "rt-only")  # ``--policies``: each a worker; RT-only is REEF's


def body(spec: ModelSpec, seed: int) -> dict[str, Any]:
    """A client's request for ``spec`` (one of a few per seed, made once: building a token payload makes a
    model config, ~1 ms of the event loop that the handler under test would be charged for)."""
    key = (spec.name, seed % 64)
    if key not in _BODIES:
        _BODIES[key] = {"body": request_body(client_payload(spec, key[1]))}
    return _BODIES[key]


class Worker:
    """One policy's handler, as its TorchServe worker would hold it."""

    def __init__(self, policy: str, specs: list[ModelSpec], settings: dict[str, Any], workdir: Path, gpu: int | None):
        reef_settings = {**settings, "policy": "reef" if policy in VARIANTS else policy, **VARIANTS.get(policy, {})}
        options = ServingOptions(handler="reef", handler_settings=tuple(reef_settings.items()))
        self.ctx = group_load_context(specs, workdir / "weights", options, gpu)
        self.handler = ReefHandler()
        self.handler.initialize(self.ctx)
        self._caller: BurstCaller | None = None
        self._caller_loop: asyncio.AbstractEventLoop | None = None

    @property
    def engine(self) -> Any:
        return self.handler.engines[ENGINE_KEY]

    async def request(self, row: dict[str, Any], model: str, priority: str) -> int:
        """One request, handed over with the others that arrive in the same turn of the loop, as the
        handlers' message pump hands over the messages waiting on its socket (``BurstCaller``)."""
        if self._caller is None or self._caller_loop is not asyncio.get_running_loop():
            self._caller = BurstCaller(self.handler, self.ctx, parse=False)  # only the status is read
            self._caller_loop = asyncio.get_running_loop()
        status, _ = await self._caller.request(row, {"X-Model": model, "X-Priority": priority})
        return status


async def closed_loop(worker: Worker, spec: ModelSpec, priority: str, seconds: float, seed: int) -> LoadResult:
    """One client, one request in flight, for ``seconds``."""
    samples: list[Sample] = []
    t0 = time.perf_counter()
    i = 0
    while (sent := time.perf_counter()) - t0 < seconds:
        status = await worker.request(body(spec, seed + i % 8), spec.name, priority)
        samples.append(Sample(sent - t0, time.perf_counter() - sent, status))
        i += 1
    return LoadResult(samples, time.perf_counter() - t0)


async def scheduled(worker: Worker, spec: ModelSpec, times: list[float], seed: int) -> LoadResult:
    """RT requests at ``times``; latency counts from the scheduled time (a late send is the loop's fault)."""
    return await play(times, lambda i: worker.request(body(spec, seed * 1000 + i), spec.name, "realtime"))


def rt_times(rate: float, seconds: float, poisson: bool, seed: int) -> list[float]:
    if not poisson:
        return [k / rate for k in range(int(seconds * rate))]
    rng, at, out = random.Random(seed), 0.0, []
    while (at := at + rng.expovariate(rate)) < seconds:
        out.append(at)
    return out


async def one_run(
    worker: Worker, rt_rates: dict[str, float], poisson: bool, be: list[str], seconds: float, seed: int,
    specs: dict[str, ModelSpec],
) -> tuple[LoadResult, list[LoadResult]]:  # fmt: skip
    rt = [
        scheduled(worker, specs[n], rt_times(rate, seconds, poisson, seed * 100 + k), seed)
        for k, (n, rate) in enumerate(rt_rates.items())
    ]
    be_loads = [closed_loop(worker, specs[n], "best-effort", seconds, 7) for n in be]
    results = await asyncio.gather(*rt, *be_loads)
    merged = LoadResult([x for r in results[: len(rt)] for x in r.samples], max(r.wall_s for r in results[: len(rt)]))
    return merged, list(results[len(rt) :])


def rt_capacity(worker: Worker, spec: ModelSpec, clients: int, seconds: float) -> dict[str, Any]:
    """REEF's RT path at capacity: ``clients`` RT clients in closed loop, answers/s and the host CPU each
    answer cost by thread role (the host-bound regime's measure, ``bench/ebird_direct.py``)."""

    async def run() -> list[LoadResult]:
        return await asyncio.gather(*(closed_loop(worker, spec, "realtime", seconds, k) for k in range(clients)))

    before = cpu_seconds_by_role()
    results = asyncio.run(run())
    after = cpu_seconds_by_role()
    answered = sum(len(r.ok) for r in results)
    return {
        "model": spec.name,
        "clients": clients,
        "throughput": answered / max(r.wall_s for r in results),
        "cpu_us_per_answer": cpu_us_per_answer(before, after, answered),
    }


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import torch

    workload = WORKLOADS[args.workload]
    names = members_of(workload)
    specs = {n: get_spec(n) for n in names}
    settings = workload_settings(args, workload)
    gpu = 0 if args.device == "cuda" else None
    policies = [
        *args.policies,
        *([PADDED] if args.padding else []),
        *([GREEN] if args.green else []),
        *([GRAPHS] if args.graphs else []),
    ]
    workers = {}
    for policy in tqdm(policies, desc="REEF workers", unit="worker"):
        workers[policy] = Worker(policy, list(specs.values()), settings, workdir, gpu)
    device = str(workers["reef"].handler.device.device)
    for worker in workers.values():  # every model through every worker once more, as clients would
        for name in names:
            asyncio.run(closed_loop(worker, specs[name], "best-effort", args.warmup_seconds, 0))
    l1_ms = {}
    for name in workload["rt"]:
        alone = asyncio.run(closed_loop(workers["reef"], specs[name], "realtime", args.calibrate_seconds, 0))
        l1_ms[name] = alone.mean_latency_ms()
    rt_rates = {n: args.rt_load / len(l1_ms) / (ms / 1e3) for n, ms in l1_ms.items()}
    host = rt_capacity(workers["reef"], specs[workload["rt"][0]], args.capacity_clients, args.calibrate_seconds)
    systems = ["rt-only", *policies]
    rows: dict[str, list[dict[str, Any]]] = {p: [] for p in systems}
    with tqdm(total=args.repeats * len(systems), desc=f"workload {args.workload} on {device}", unit="run") as bar:
        for repeat in range(args.repeats):
            for system in systems if repeat % 2 == 0 else systems[::-1]:
                worker = workers["reef" if system == "rt-only" else system]
                engine = worker.engine
                seen = set(map(id, engine.preemptions))
                preempted, padded = engine.counts["preempt"], engine.counts["pad"]
                be = [] if system == "rt-only" else workload["be"]
                started = time.monotonic()
                rt, be_results = asyncio.run(one_run(worker, rt_rates, workload["poisson"], be, args.seconds, repeat,
                                                     specs))  # fmt: skip
                wall = time.monotonic() - started
                latencies = [1e3 * p.latency_s for p in engine.preemptions if id(p) not in seen]
                row = run_row(rt, be_results, wall, latencies)
                row.update(preemptions=engine.counts["preempt"] - preempted, padded_units=engine.counts["pad"] - padded)
                rows[system].append(row)
                bar.update()
    split = workers[GREEN].engine if GREEN in workers else None
    if split is not None:
        data_split = repr(split.partition) if split.partition is not None else "not split (rt_sms is ignored off CUDA)"
        if split.sizing is not None:
            data_split += f"; sized at start-up: {split.sizing.describe()}"
    for worker in workers.values():
        worker.handler.close()
    if args.device == "cuda":
        torch.cuda.synchronize()
    data = summarise(args, workload, names, settings, rows, l1_ms, rt_rates, {}, systems=systems)
    reef = data["systems"]["reef"]
    data["claims"].update(
        rt_mean_within_5pct_of_rt_only=statistics.median(reef["rt_mean_vs_rt_only"]) <= 1.05,
        throughput_at_least_3x_rt_only=statistics.median(reef["throughput_vs_rt_only"]) >= 3.0,
    )
    data["rt_capacity"] = host
    data["where"] = f"handlers driven in-process on {device}, no TorchServe frontend (`bench/reef_direct.py`)"
    data["device"] = device
    if split is not None:
        data["green_split"] = data_split
    return data


def render_with_host(data: dict[str, Any], stem: str) -> str:
    """``bench.reef``'s table, and the RT path at capacity with its host CPU per answer by thread role."""
    text = render(data, stem)
    if "green_split" in data:
        text += f"\n\nREEF (split SMs): {data['green_split']}.\n"
    cap = data.get("rt_capacity")
    if cap is None:  # runs before the measure existed
        return text
    cpu = cap["cpu_us_per_answer"]
    roles = list(cpu)
    python = python_us(cpu)
    table = markdown_table(
        ["RT model", "clients", "answers/s", *roles, "Python"],
        [[cap["model"], str(cap["clients"]), f"{cap['throughput']:.0f}", *(f"{cpu[r]:.0f}" for r in roles),
          f"{python:.0f}"]],
    )  # fmt: skip
    return text + (
        "\n\nREEF's real-time path at capacity (RT clients alone in closed loop, before the runs above): answers/s "
        "and host CPU per answer, µs by thread role, from each thread's CPU time in /proc (the event loop also runs "
        "the load generator; executors: REEF's RT and BE executor threads; decode: its decode thread; Python: every "
        "thread but the OpenMP team's):\n\n"
        f"{table}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="A")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--quick", action="store_true", help="short runs, one repeat (a smoke run)")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rt-load", type=float, default=0.3, help="RT arrivals per L1 (the RT model alone)")
    parser.add_argument("--segments", type=int, default=16, help="units a BE batch is cut into (preemption points)")
    parser.add_argument("--rt-max-batch", type=int, default=4)
    parser.add_argument("--be-max-batch", type=int, default=1)
    parser.add_argument(
        "--policies",
        type=lambda v: [p.strip() for p in v.split(",") if p.strip()],
        default=list(BASE_POLICIES),
        help="the policies served, each by a worker of its own in this one process, reef among them (default: "
        "seq,concurrent,reef). On CPU each worker's RT executor holds an OpenMP team and more teams than cores "
        "throttle every one (bench/openmp_teams.py): --policies reef reads REEF against RT-only as one "
        "TorchServe worker would hold it",
    )
    parser.add_argument("--padding", action="store_true", help="also run REEF with padding on (reef-pad)")
    parser.add_argument(
        "--green", action="store_true", help="also run REEF on split SMs, rt_sms: auto (reef-green; CUDA)"
    )
    parser.add_argument(
        "--graphs", action="store_true", help="also run REEF with BE units as CUDA graphs (reef-graphs; CUDA)"
    )
    parser.add_argument("--warmup-seconds", type=float, default=2.0)
    parser.add_argument("--calibrate-seconds", type=float, default=4.0)
    parser.add_argument("--capacity-clients", type=int, default=32, help="RT clients in the capacity run")
    parser.add_argument("--suffix", default="", help="appended to the output files' name")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if "reef" not in args.policies or set(args.policies) - set(BASE_POLICIES):
        parser.error(f"--policies: some of {', '.join(BASE_POLICIES)}, reef among them (got {','.join(args.policies)})")
    if args.quick:
        args.seconds, args.repeats, args.warmup_seconds, args.calibrate_seconds = 6.0, 1, 1.0, 2.0
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine (use --device cpu)")

    def stem_of(data: dict[str, Any]) -> str:
        return f"reef_direct_workload{args.workload}_{args.device}{args.suffix}"

    return run_benchmark("bench.reef_direct", args, measure, lambda d: None, stem_of, render_with_host, plot)


if __name__ == "__main__":
    raise SystemExit(main())
