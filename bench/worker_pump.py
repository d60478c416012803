"""What TorchServe's async message pump costs per message, against the lean one, in-process.

    python -m bench.worker_pump --messages 2000 --rounds 3
    python -m bench.worker_pump --payload tokens --in-flight 32 --messages 20000   # the host-bound regime

Each pump serves a worker process of its own (forked), behind one end of a
socket pair, with TorchServe's own ``Service``, context, metrics cache and
protocol code, and stdout going to a pipe that this process drains, as
TorchServe's worker logs to the frontend.  This process plays the
frontend (``bench/ts_frames.py``): ``--in-flight`` messages outstanding,
one request per message, each the 72 KB JPEG a ResNet-50 client sends with
a few HTTP headers, each answered by an entry point that does no work and
returns a ~20 KB answer (the size of the handlers' 1000-class JSON); with
``--payload tokens``, the one-layer BERT's token JSON and its two-logit
answer, the tiny-model regime of ``docs/benchmarks/host_path.md``.  The
context carries an Ebird archive's model-config.yaml, as a worker's does.
``lean-burst`` is the lean pump in front of an entry point with
``serve_burst``, as the async handlers have (``handlers/runtime/burst.py``):
the messages waiting together reach it in one call.  The
worker's CPU per message, all threads and per thread from ``/proc``, is the
pump's cost alone: on a 2-core machine it is taken from the cores a batch
runs on.  The pumps take turns, ``--rounds`` times.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.proc_cpu import thread_cpu_seconds
from bench.report import add_output_arguments, markdown_table, new_figure, provenance_block, run_benchmark, save_figure
from bench.ts_frames import Request, inference_frame, read_answers, torchserve_service

PUMPS = ("torchserve", "lean", "lean-burst")
LABELS = {
    "torchserve": "TorchServe's (`ts/async_service.py`)",
    "lean": "lean (`worker_pump.py`), an entry function",
    "lean-burst": "lean, an entry with `serve_burst`",
}
HEADERS = (
    ("Host", "127.0.0.1:8080"),
    ("User-Agent", "Python/3.11 aiohttp/3.9"),
    ("Accept", "*/*"),
    ("Accept-Encoding", "gzip, deflate"),
    ("Content-Length", "71721"),
    ("Content-Type", "image/jpeg"),
)
JPEG_ANSWER = json.dumps([(i - 500) / 997 * 3.14159 for i in range(1000)], separators=(",", ":")).encode()
TOKEN_HEADERS = (("Host", "127.0.0.1:8080"), ("Content-Type", "application/json"))
TOKEN_ANSWER = json.dumps({"top5": [{"index": 0, "logit": 0.1}, {"index": 1, "logit": -0.2}], "logits": [0.1, -0.2]})


class BurstEntry:
    """An entry point with ``serve_burst`` that does no work, as ``entry_point`` does."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer

    async def handle(self, data: list, context: Any) -> list:
        return [self.answer for _ in data]

    def serve_burst(self, calls: list, done: Any) -> None:
        for index, (data, _) in enumerate(calls):
            done(index, [self.answer for _ in data])


def _worker(pump: str, conn: socket.socket, stdout_fd: int, model_dir: str, answer: bytes) -> None:
    """The forked worker: TorchServe's service around a do-nothing entry point, served by ``pump``."""
    os.dup2(stdout_fd, 1)
    logging.basicConfig(stream=sys.stdout, format="%(message)s", level=logging.INFO, force=True)  # as ts's worker

    async def entry_point(data: list, context: Any) -> list:
        return [answer for _ in data]

    manifest = {"model": {"modelName": "pumped", "configFile": "model-config.yaml"}}
    entry = BurstEntry(answer).handle if pump == "lean-burst" else entry_point
    service = torchserve_service(entry, conn, model_dir, manifest)
    if pump == "torchserve":
        from ts.async_service import AsyncService

        AsyncService(service).run()
    else:
        from handlers.runtime.worker_pump import WorkerPump

        WorkerPump(service).run()


def answer_for(payload: str) -> bytes:
    return JPEG_ANSWER if payload == "jpeg" else TOKEN_ANSWER.encode()


def _drain(fd: int) -> None:
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while pipe.read(65536):
            pass


def drive(
    pump: str, model_dir: Path, body: bytes, messages: int, in_flight: int, warmup: int, payload: str = "jpeg"
) -> dict[str, Any]:
    """One pump's worker: ``warmup`` messages, then ``messages`` measured; CPU per message by thread."""
    frontend, conn = socket.socketpair()
    read_fd, write_fd = os.pipe()
    worker = multiprocessing.get_context("fork").Process(
        target=_worker, args=(pump, conn, write_fd, str(model_dir), answer_for(payload)), daemon=True
    )
    worker.start()
    conn.close()
    os.close(write_fd)
    threading.Thread(target=_drain, args=(read_fd,), daemon=True).start()
    failed = 0
    answer = answer_for(payload)
    content_type, headers = ("image/jpeg", HEADERS) if payload == "jpeg" else ("application/json", TOKEN_HEADERS)

    def exchange(count: int, first: int) -> None:
        nonlocal failed
        sent = answered = 0
        while answered < count:
            while sent < count and sent - answered < in_flight:
                frontend.sendall(inference_frame([Request(f"r{first + sent}", body, content_type, headers)]))
                sent += 1
            [(code, got)] = read_answers(frontend, 1)
            failed += code != 200 or got.status != 200 or got.body != answer
            answered += 1

    try:
        exchange(warmup, 0)
        before = thread_cpu_seconds(worker.pid)
        started = time.perf_counter()
        exchange(messages, warmup)
        wall = time.perf_counter() - started
        after = thread_cpu_seconds(worker.pid)
    finally:
        frontend.close()
        worker.join(timeout=10)
        if worker.is_alive():
            worker.kill()
    per_thread = sorted((1e3 * (after[t] - before.get(t, 0.0)) / messages for t in after), reverse=True)
    return {
        "pump": pump,
        "cpu_ms": sum(per_thread),
        "threads_ms": [round(x, 3) for x in per_thread if x > 0],
        "messages_per_s": messages / wall,
        "failed": failed,
    }


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import yaml

    from archiver.options import ServingOptions, model_config
    from bench.dvabatch import bench_payloads
    from model_store.catalog import get_spec
    from model_store.samples import client_payload, request_body

    if args.payload == "jpeg":
        spec = get_spec("resnet50", "eager")
        body = client_payload(spec, seed=0)
    else:
        spec = get_spec("bert-tiny1", "eager")
        body = request_body(bench_payloads(spec, count=1)[0][0])
    # The worker's context carries the archive's model-config.yaml, as an Ebird worker's does.
    (workdir / "model-config.yaml").write_text(yaml.safe_dump(model_config(spec, ServingOptions(handler="ebird"))))
    rows = []
    with tqdm(total=args.rounds * len(PUMPS), desc="pumps", unit="run") as bar:
        for r in range(args.rounds):
            for pump in PUMPS if r % 2 == 0 else PUMPS[::-1]:
                run = drive(pump, workdir, body, args.messages, args.in_flight, args.warmup, args.payload)
                rows.append({"round": r, **run})
                bar.update()
    answer_bytes = len(answer_for(args.payload))
    return {"rows": rows, "payload": args.payload, "body_bytes": len(body), "answer_bytes": answer_bytes,
            "messages": args.messages, "in_flight": args.in_flight}  # fmt: skip


def summary(data: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pumps = [pump for pump in PUMPS if any(r["pump"] == pump for r in data["rows"])]
    for pump in pumps:
        cpu = [r["cpu_ms"] for r in data["rows"] if r["pump"] == pump]
        out[pump] = {"cpu_ms": statistics.median(cpu), "cpu_min": min(cpu), "cpu_max": max(cpu)}
    for pump in pumps[1:]:
        ratios = [
            lean["cpu_ms"] / ts["cpu_ms"]
            for lean in data["rows"]
            for ts in data["rows"]
            if lean["pump"] == pump and ts["pump"] == "torchserve" and lean["round"] == ts["round"]
        ]
        out[f"{pump}_over_torchserve"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def render(data: dict[str, Any], stem: str) -> str:
    s = data["summary"]
    pumps = [pump for pump in PUMPS if pump in s]
    rows = []
    for pump in pumps:
        runs = [r for r in data["rows"] if r["pump"] == pump]
        threads = statistics.median(len(r["threads_ms"]) for r in runs)
        busiest = min(runs, key=lambda r: abs(r["cpu_ms"] - s[pump]["cpu_ms"]))["threads_ms"][:4]
        rows.append([
            LABELS[pump],
            f"{s[pump]['cpu_ms']:.3f} ({s[pump]['cpu_min']:.3f}-{s[pump]['cpu_max']:.3f})",
            f"{statistics.median(r['messages_per_s'] for r in runs):.0f}",
            f"{threads:.0f}",
            ", ".join(f"{x:.3f}" for x in busiest),
        ])  # fmt: skip
    payload = data.get("payload", "jpeg")
    request = (
        f"a {data['body_bytes'] / 1000:.0f} KB JPEG with {len(HEADERS)} headers"
        if payload == "jpeg"
        else f"the one-layer BERT's {data['body_bytes']} B token JSON with {len(TOKEN_HEADERS)} headers"
    )
    ratios = [
        f"{LABELS[pump]} ÷ TorchServe's CPU per message, per round: **{s[f'{pump}_over_torchserve']['median']:.2f}** "
        f"({s[f'{pump}_over_torchserve']['min']:.2f}-{s[f'{pump}_over_torchserve']['max']:.2f})."
        for pump in pumps[1:]
    ]
    return "\n".join([
        "# TorchServe's async message pump against the lean one, per message",
        "",
        f"Each pump serves a forked worker process with TorchServe's own Service, context, metrics cache and "
        f"protocol code, logging to a pipe; this process is the frontend, {data['in_flight']} messages in flight, "
        f"one request per message: {request}, answered by an entry point that does no work with "
        f"{data['answer_bytes']} B. {data['messages']} messages per run, the pumps taking turns, "
        f"{len(data['rows']) // len(pumps)} runs each: median (min-max). "
        "CPU is the worker's, all threads, from /proc (10 ms ticks).",
        "",
        markdown_table(
            ["pump", "worker CPU per message, ms", "messages/s", "threads with CPU", "busiest threads, ms/message"],
            rows,
        ),
        "",
        *[f"- {line}" for line in ratios],
        "",
        f"![CPU per message]({stem}.png)",
        "",
        provenance_block(data["provenance"]),
    ])  # fmt: skip


def plot(data: dict[str, Any], path: Path) -> None:
    pumps = [pump for pump in PUMPS if pump in data["summary"]]
    fig, ax = new_figure((5.6, 3.4))
    for i, pump in enumerate(pumps):
        runs = [r["cpu_ms"] for r in data["rows"] if r["pump"] == pump]
        ax.bar(i, statistics.median(runs), color=f"C{i}", label=pump)
        ax.plot([i] * len(runs), runs, "k.", ms=4)
    ax.set_xticks(range(len(pumps)), pumps)
    save_figure(fig, ax, path, "message pump", "worker CPU per message (ms)", "Async message pump cost, no model")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=2000, help="messages measured per run")
    parser.add_argument("--warmup", type=int, default=200, help="messages before measuring, per run")
    parser.add_argument("--in-flight", type=int, default=4, help="messages outstanding at once")
    parser.add_argument("--rounds", type=int, default=3, help="runs per pump, interleaved")
    parser.add_argument(
        "--payload", choices=("jpeg", "tokens"), default="jpeg", help="ResNet-50's JPEG or the one-layer BERT's tokens"
    )
    add_output_arguments(parser)
    args = parser.parse_args(argv)

    def stem(data: dict[str, Any]) -> str:
        return "worker_pump" if data.get("payload", "jpeg") == "jpeg" else "worker_pump_tokens"

    return run_benchmark("bench.worker_pump", args, measure, summary, stem, render, plot)


if __name__ == "__main__":
    sys.exit(main())
