"""Probes of an async handler's host path: is it the hand-off, or the bookkeeping, that costs?

    python -m bench.host_path_probe --handler ebird --model bert-tiny1 --rounds 3

On the one-layer BERT an async handler serves about 0.6× what the plain
handler behind the frontend's batching serves, and its Python threads use
one core between them (``docs/benchmarks/host_path.md``).  Two explanations
remained, and each probe changes one thing in a fresh process so that its
effect can be read beside the handler as it ships:

- ``as-is`` and ``as-is-twin``: the handler as it ships, twice: the A/A band.
- ``wake-keeps-gil``: a lane or engine thread that posts answers wakes the
  event loop without giving up the GIL (the wake-up byte is written with
  ``libc.write`` called through ``ctypes.PyDLL``, which keeps the GIL, where
  ``call_soon_threadsafe``'s socket write releases it and must take it back,
  so the lane waits there while the loop runs).  If waiting for the loop at
  each hand-off is what holds the lane back, this serves more.
- ``no-bookkeeping``: per-request bookkeeping switched off: stage metrics
  and their breakdown, the in-flight counts, the response-timeout watch and
  the unanswered count.  A ceiling, not a setting: what the runtime could
  gain by making all of it free.
- ``nowait`` and ``async-floor``, the same for every handler: two references
  that take the handler out.  ``nowait`` is the plain handler behind the
  frontend's batching, as ``bench.ebird_direct`` serves it (the issue's
  yardstick).  ``async-floor`` is the plain handler's own batch pipeline
  (decode, one forward, encode) behind the async path's burst driver: the
  event loop only queues each one-request message and replies to it, and
  one thread runs the batches, up to ``--max-batch`` of whatever is queued.
  No admission, tickets, deadlines or metrics per request: the least an
  async handler's worker can do per request in this bench, so its ratio to
  ``nowait`` is the price of async mode itself here.
- REEF only, whose one-model group here has a real-time member and no
  best-effort traffic: ``reef-no-best-effort`` starts no best-effort
  executor (each otherwise runs the member's segments once at start-up,
  which gives its thread an OpenMP team of its own beside the real-time
  executor's), and ``reef-best-effort-unwarmed`` starts them without that
  warm-up, so no second team exists until best-effort work comes.  A
  best-effort request would wait for ever under the first; the bench sends
  none.

Every probe is served in its own process, in turn, ``--rounds`` times (the
order rotating each round), with the same load: a closed loop of
``--clients`` for the capacity, then Poisson arrivals at each of ``--rates``
(absolute, so every probe sees the same arrivals).  Ratios are read within
each round against ``as-is`` of that round.  A diagnosis tool: the probes
patch the runtime inside the bench's own processes and never ship.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import add_output_arguments, markdown_table, provenance, provenance_block, write_outputs

MODULE = "bench.host_path_probe"
AS_IS = "as-is"
REEF_PROBES = ("reef-no-best-effort", "reef-best-effort-unwarmed")
REFERENCES = ("nowait", "async-floor")
PROBES = (AS_IS, "as-is-twin", "wake-keeps-gil", "no-bookkeeping", *REFERENCES, *REEF_PROBES)
DEFAULT_PROBES = (AS_IS, "as-is-twin", "wake-keeps-gil", "no-bookkeeping")
HANDLERS = ("ebird", "dvabatch", "reef")


# -- the probes (inside a probe's own process) --------------------------------


def wake_keeping_the_gil() -> None:
    """Make ``LoopMailbox`` wake its loop from other threads without releasing the GIL.

    It queues the drain as ``call_soon_threadsafe`` does and writes the
    wake-up byte to the loop's self-pipe itself, through the selector
    loop's private ``_call_soon`` and ``_csock`` (checked here first).
    """
    import asyncio

    from handlers.runtime.loop_mailbox import LoopMailbox

    loop = asyncio.new_event_loop()
    missing = [name for name in ("_call_soon", "_csock") if not hasattr(loop, name)]
    loop.close()
    if missing:
        raise RuntimeError(f"this asyncio's loop has no {', '.join(missing)}: the probe cannot wake it so")
    write = ctypes.PyDLL(None).write  # PyDLL: the call keeps the GIL
    write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]

    def post_all(self: LoopMailbox, callbacks: list[Any]) -> None:
        with self._lock:
            first = not self._posted
            self._posted.extend(callbacks)
            if not first:
                return
            self.wakeups += 1
        if self.loop.is_closed():
            return
        self.loop._call_soon(self._drain, (), None)
        write(self.loop._csock.fileno(), b"\0", 1)

    LoopMailbox._post_all = post_all


def without_bookkeeping(handler: Any) -> None:
    """Switch off the per-request bookkeeping of ``handler`` (and of every handler in this process)."""
    import handlers.runtime.burst as burst
    from handlers.runtime.metrics import HandlerMetrics

    class NoWatch:
        def watch(self, request: Any, deadline: float) -> None:
            pass

        def watch_many(self, requests: Any, deadline: float) -> None:
            pass

    HandlerMetrics.stages = lambda self, seconds, requests=1: None
    HandlerMetrics.request_admitted = lambda self: None
    HandlerMetrics.requests_admitted = lambda self, count: None  # requests taken undecoded (``row_intake.py``)
    HandlerMetrics.request_answered = lambda self: None
    HandlerMetrics.requests_answered = lambda self, count: None
    burst.StageTally.add = lambda self, *times: None
    burst.StageTally.add_taken = lambda self, *times: None
    handler.deadlines_on = lambda loop: NoWatch()
    handler.count_unanswered = lambda change: None


def reef_best_effort(probe: str) -> None:
    """REEF's best-effort executors not started (``reef-no-best-effort``) or not warmed
    (``reef-best-effort-unwarmed``), for every REEF engine built in this process after this call."""
    from handlers.reef.engine import ReefEngine

    if probe == "reef-no-best-effort":

        def best_effort_loop(self: ReefEngine, warm: Any, name: str) -> None:
            warm.set_result(None)  # the thread ends here: no team, and no best-effort request served

        ReefEngine._best_effort_loop = best_effort_loop
    elif probe == "reef-best-effort-unwarmed":
        ReefEngine._warm_units = lambda self, member: None


class AsyncFloor:
    """``async-floor``: the plain handler's batch pipeline behind the async burst path, and nothing else.

    ``serve_burst`` only queues each one-request message; one thread takes
    up to ``max_batch`` of what is queued, runs the plain handler's
    ``handle`` on it (decode, one forward, encode, as the sync worker does)
    and posts one callback per batch that gives each message its answer and
    status.  Every message is answered: a batch that raises answers 503.
    """

    def __init__(self, handler: Any, load: Any, max_batch: int) -> None:
        import collections
        import threading
        from concurrent.futures import Future

        self.handler, self.load, self.max_batch = handler, load, max_batch
        self._queue: collections.deque = collections.deque()
        self._ready = threading.Condition()
        # ``initialize`` on the thread that runs the batches (its OpenMP team), as NO Wait's driver does;
        # a daemon, so that the probe's process can end with it waiting.
        started: Future = Future()
        threading.Thread(target=self._serve_batches, args=(started,), name="lane-floor", daemon=True).start()
        started.result()

    def serve_burst(self, calls: Any, done: Any) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        with self._ready:
            self._queue.extend((data[0], context, index, done, loop) for index, (data, context) in enumerate(calls))
            self._ready.notify()

    def _serve_batches(self, started: Any) -> None:
        from bench.direct import with_requests

        try:
            self.handler.initialize(self.load)
        except Exception as exc:
            started.set_exception(exc)
            return
        started.set_result(None)
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                batch = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
            ctx = with_requests(self.load, len(batch))
            try:
                answers = self.handler.handle([row for row, *_ in batch], ctx)
                statuses = [ctx.get_response_status(i) for i in range(len(batch))]
            except Exception as exc:  # every request of the batch is answered, none lost
                answers, statuses = [str(exc).encode()] * len(batch), [(503, str(exc))] * len(batch)
            batch[0][4].call_soon_threadsafe(self._reply, batch, answers, statuses)

    @staticmethod
    def _reply(batch: list[tuple], answers: list[Any], statuses: list[tuple[int, str]]) -> None:
        for (_, context, index, done, _), answer, (code, phrase) in zip(batch, answers, statuses, strict=True):
            context.set_response_status(code, phrase or "", 0)
            done(index, [answer])


def make_probe_driver(args: argparse.Namespace, model_dir: str) -> tuple[Any, Any]:
    """(driver, handler) for ``args.child``: the handler, or for a reference probe the plain handler."""
    from bench.direct import load_context
    from bench.direct_systems import BASELINE, AsyncDriver, make_driver
    from handlers.plain_handler import PlainModelHandler
    from model_store.catalog import get_spec

    if args.child == "nowait":
        return make_driver(BASELINE, args.model, args.mode, model_dir, "cpu", args.max_batch)
    if args.child == "async-floor":
        from archiver.options import ServingOptions

        load = load_context(get_spec(args.model, args.mode), Path(model_dir), ServingOptions(batch_size=args.max_batch))
        floor = AsyncFloor(PlainModelHandler(), load, args.max_batch)
        return AsyncDriver(floor, load), floor.handler  # no lanes: every burst is handed over at once
    return make_driver(args.handler, args.model, args.mode, model_dir, "cpu", args.max_batch)


def run_probe(args: argparse.Namespace) -> dict[str, Any]:
    """One probe's readings, in this process: capacity and host CPU, then the open-loop rates."""
    import asyncio

    from bench.direct import model_dir_for
    from bench.direct_systems import closed_loop, open_loop, python_us
    from bench.dvabatch import bench_payloads
    from bench.ebird_direct import latency_stats
    from model_store.catalog import get_spec
    from model_store.samples import request_body
    from serving_harness.loadgen import arrival_times

    if args.child == "wake-keeps-gil":
        wake_keeping_the_gil()
    if args.child in REEF_PROBES:
        reef_best_effort(args.child)
    spec = get_spec(args.model, args.mode)
    model_dir = model_dir_for(spec, Path(args.workdir) / f"{args.model}-{args.mode}")
    driver, handler = make_probe_driver(args, str(model_dir))
    if args.child == "no-bookkeeping":
        without_bookkeeping(handler)
    payloads, _ = bench_payloads(spec, count=64)
    rows = [{"body": request_body(p)} for p in payloads]
    asyncio.run(closed_loop(driver, rows, args.clients, args.warmup))
    capacity = asyncio.run(closed_loop(driver, rows, args.clients, args.seconds))
    out: dict[str, Any] = {
        "capacity": capacity["throughput"],
        "cpu_us": capacity["cpu_us_per_request"],
        "python_us": python_us(capacity["cpu_us_per_request"]),
        "open": {},
    }
    for i, rate in enumerate(args.rates):  # the same seed per rate: every probe sees the same arrivals
        result = asyncio.run(open_loop(driver, rows, arrival_times([(args.open_seconds, rate)], seed=i)))
        out["open"][str(rate)] = latency_stats(result)
    return out


# -- the run (the parent process) ---------------------------------------------


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in args.probes}
    order = list(args.probes)
    with tqdm(total=args.rounds * len(order), desc="probes", unit="run") as bar:
        for r in range(args.rounds):
            for probe in order[r % len(order) :] + order[: r % len(order)]:
                bar.set_postfix_str(f"round {r + 1}: {probe}")
                runs[probe].append(child(args, probe, workdir))
                bar.update()
    return {"args": {k: v for k, v in vars(args).items() if k not in ("out_dir", "json")}, "runs": runs}


def child(args: argparse.Namespace, probe: str, workdir: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", MODULE, "--child", probe, "--workdir", str(workdir),
               "--handler", args.handler, "--model", args.model, "--mode", args.mode,
               "--max-batch", str(args.max_batch), "--clients", str(args.clients),
               "--warmup", str(args.warmup), "--seconds", str(args.seconds),
               "--open-seconds", str(args.open_seconds), "--rates", ",".join(str(r) for r in args.rates)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.child_timeout)
    if done.returncode != 0:
        raise RuntimeError(f"probe {probe} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def per_round(runs: list[dict[str, Any]], base: list[dict[str, Any]], read: Any) -> dict[str, float]:
    """``read(run) / read(base run)`` round by round: median, min and max."""
    ratios = [read(a) / read(b) for a, b in zip(runs, base, strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def spread_cell(values: dict[str, float], digits: int = 2, unit: str = "×") -> str:
    return f"{values['median']:.{digits}f}{unit} ({values['min']:.{digits}f}-{values['max']:.{digits}f})"


def failed_requests(runs: dict[str, list[dict[str, Any]]]) -> int:
    """Requests answered other than 200 in every probe's open-loop runs (a probe must lose none)."""
    return sum(rate["failed"] for probe_runs in runs.values() for run in probe_runs for rate in run["open"].values())


def render(data: dict[str, Any]) -> str:
    args, runs = data["args"], data["runs"]
    base = runs[AS_IS]
    nowait = runs.get("nowait")  # the plain handler's yardstick, where it was probed
    rates = [str(r) for r in args["rates"]]
    rows = []
    for probe, probe_runs in runs.items():
        capacity = [r["capacity"] for r in probe_runs]
        cells = [
            probe,
            f"{statistics.median(capacity):,.0f} ({min(capacity):,.0f}-{max(capacity):,.0f})",
            spread_cell(per_round(probe_runs, base, lambda r: r["capacity"])),
        ]
        if nowait is not None:
            cells.append(spread_cell(per_round(probe_runs, nowait, lambda r: r["capacity"])))
        cells += [
            f"{statistics.median(r['python_us'] for r in probe_runs):.0f}",
            f"{statistics.median(r['cpu_us'].get('event loop', 0.0) for r in probe_runs):.0f}",
        ]
        for rate in rates:
            mean = statistics.median(r["open"][rate]["mean_ms"] for r in probe_runs)
            ratio = per_round(probe_runs, base, lambda r, rate=rate: r["open"][rate]["mean_ms"])
            cells.append(f"{mean:.1f} ms, {spread_cell(ratio)}")
        rows.append(cells)
    header = ["probe", "capacity req/s, median (min-max)", f"÷ {AS_IS}, per round"]
    header += ["÷ nowait, per round"] if nowait is not None else []
    header += ["Python µs per request", "event loop µs"]
    header += [f"mean at {float(r):,.0f} req/s, ÷ {AS_IS} per round" for r in rates]
    failed = failed_requests(runs)
    return (
        f"# Host-path probes: {args['handler']} on {args['model']} ({args['mode']}), CPU\n\n"
        f"{provenance_block(data['provenance'])}\n"
        f"{args['rounds']} rounds, each probe in its own process once per round (order rotating); "
        f"capacity: {args['clients']} clients in a closed loop for {args['seconds']} s after {args['warmup']} s; "
        f"then Poisson arrivals for {args['open_seconds']} s at each rate. Largest batch {args['max_batch']}. "
        f"Requests failed: {failed}. `{AS_IS}-twin` against `{AS_IS}` is the A/A band. What each probe changes: "
        f"`bench/host_path_probe.py`.\n\n" + markdown_table(header, rows) + "\n"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--handler", default="ebird", choices=HANDLERS)
    parser.add_argument("--model", default="bert-tiny1")
    parser.add_argument("--mode", default="eager", choices=("eager", "script"))
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--warmup", type=float, default=2.0, help="closed-loop seconds before the capacity's")
    parser.add_argument("--seconds", type=float, default=4.0, help="closed-loop seconds measured")
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[2000.0, 3500.0],
                        help="open-loop Poisson rates, req/s, the same for every probe")  # fmt: skip
    parser.add_argument("--open-seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--probes", type=lambda s: s.split(","), default=list(DEFAULT_PROBES),
                        help=f"of {', '.join(PROBES)} (default: {', '.join(DEFAULT_PROBES)})")  # fmt: skip
    parser.add_argument("--child-timeout", type=float, default=300.0, help="seconds one probe's process may take")
    parser.add_argument("--suffix", default="", help="inserted before the date in the output files' name")
    parser.add_argument("--child", choices=PROBES, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    unknown = [p for p in args.probes if p not in PROBES]
    if unknown or AS_IS not in args.probes:
        parser.error(f"--probes: choose from {', '.join(PROBES)}, {AS_IS} among them (got {args.probes})")
    if args.handler != "reef" and set(args.probes) & set(REEF_PROBES):
        parser.error(f"{', '.join(REEF_PROBES)} probe REEF's executors: use them with --handler reef")
    if args.rounds < 1 or any(r <= 0 for r in args.rates):
        parser.error("--rounds must be ≥ 1 and every rate > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(run_probe(args)), flush=True)
        return 0
    import tempfile

    prov = provenance(MODULE)
    with tempfile.TemporaryDirectory(prefix="host_path_probe-") as tmp:
        data = measure(args, Path(tmp))
    data["provenance"] = prov
    stem = f"host_path_probe_{args.handler}_{args.model}_cpu{args.suffix}_{prov['date'][:10]}"
    markdown = render(data)
    write_outputs(stem, markdown, data, args.out_dir)
    print(markdown)
    return 1 if failed_requests(data["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
