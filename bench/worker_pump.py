"""What TorchServe's async message pump costs per message, against the lean one, in-process.

    python -m bench.worker_pump --messages 2000 --rounds 3

Each pump serves a worker process of its own (forked), behind one end of a
socket pair, with TorchServe's own ``Service``, context, metrics cache and
protocol code, and stdout going to a pipe that this process drains, as
TorchServe's worker logs to the frontend.  This process plays the
frontend (``bench/ts_frames.py``): ``--in-flight`` messages outstanding,
one request per message, each the 72 KB JPEG a ResNet-50 client sends with
a few HTTP headers, each answered by an entry point that does no work and
returns a ~20 KB answer (the size of the handlers' 1000-class JSON); the
context carries an Ebird archive's model-config.yaml, as a worker's does.  The
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
from bench.ts_frames import Request, inference_frame, read_answer_frame, torchserve_service

PUMPS = ("torchserve", "lean")
HEADERS = (
    ("Host", "127.0.0.1:8080"),
    ("User-Agent", "Python/3.11 aiohttp/3.9"),
    ("Accept", "*/*"),
    ("Accept-Encoding", "gzip, deflate"),
    ("Content-Length", "71721"),
    ("Content-Type", "image/jpeg"),
)
ANSWER = json.dumps([(i - 500) / 997 * 3.14159 for i in range(1000)], separators=(",", ":")).encode()


def _worker(pump: str, conn: socket.socket, stdout_fd: int, model_dir: str) -> None:
    """The forked worker: TorchServe's service around a do-nothing entry point, served by ``pump``."""
    os.dup2(stdout_fd, 1)
    logging.basicConfig(stream=sys.stdout, format="%(message)s", level=logging.INFO, force=True)  # as ts's worker

    async def entry_point(data: list, context: Any) -> list:
        return [ANSWER for _ in data]

    manifest = {"model": {"modelName": "pumped", "configFile": "model-config.yaml"}}
    service = torchserve_service(entry_point, conn, model_dir, manifest)
    if pump == "torchserve":
        from ts.async_service import AsyncService

        AsyncService(service).run()
    else:
        from handlers.runtime.worker_pump import WorkerPump

        WorkerPump(service).run()


def _drain(fd: int) -> None:
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while pipe.read(65536):
            pass


def drive(pump: str, model_dir: Path, body: bytes, messages: int, in_flight: int, warmup: int) -> dict[str, Any]:
    """One pump's worker: ``warmup`` messages, then ``messages`` measured; CPU per message by thread."""
    frontend, conn = socket.socketpair()
    read_fd, write_fd = os.pipe()
    worker = multiprocessing.get_context("fork").Process(
        target=_worker, args=(pump, conn, write_fd, str(model_dir)), daemon=True
    )
    worker.start()
    conn.close()
    os.close(write_fd)
    threading.Thread(target=_drain, args=(read_fd,), daemon=True).start()
    failed = 0

    def exchange(count: int, first: int) -> None:
        nonlocal failed
        sent = answered = 0
        while answered < count:
            while sent < count and sent - answered < in_flight:
                frontend.sendall(inference_frame([Request(f"r{first + sent}", body, "image/jpeg", HEADERS)]))
                sent += 1
            code, _, answers = read_answer_frame(frontend)
            failed += code != 200 or any(a.status != 200 or a.body != ANSWER for a in answers)
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
    from model_store.catalog import get_spec
    from model_store.samples import client_payload

    spec = get_spec("resnet50", "eager")
    body = client_payload(spec, seed=0)
    # The worker's context carries the archive's model-config.yaml, as an Ebird worker's does.
    (workdir / "model-config.yaml").write_text(yaml.safe_dump(model_config(spec, ServingOptions(handler="ebird"))))
    rows = []
    with tqdm(total=args.rounds * len(PUMPS), desc="pumps", unit="run") as bar:
        for r in range(args.rounds):
            for pump in PUMPS if r % 2 == 0 else PUMPS[::-1]:
                rows.append({"round": r, **drive(pump, workdir, body, args.messages, args.in_flight, args.warmup)})
                bar.update()
    return {"rows": rows, "body_bytes": len(body), "answer_bytes": len(ANSWER), "messages": args.messages,
            "in_flight": args.in_flight}  # fmt: skip


def summary(data: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for pump in PUMPS:
        cpu = [r["cpu_ms"] for r in data["rows"] if r["pump"] == pump]
        out[pump] = {"cpu_ms": statistics.median(cpu), "cpu_min": min(cpu), "cpu_max": max(cpu)}
    ratios = [
        lean["cpu_ms"] / ts["cpu_ms"]
        for lean in data["rows"]
        for ts in data["rows"]
        if lean["pump"] == "lean" and ts["pump"] == "torchserve" and lean["round"] == ts["round"]
    ]
    out["lean_over_torchserve"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def render(data: dict[str, Any], stem: str) -> str:
    s = data["summary"]
    rows = []
    for pump in PUMPS:
        runs = [r for r in data["rows"] if r["pump"] == pump]
        threads = statistics.median(len(r["threads_ms"]) for r in runs)
        busiest = min(runs, key=lambda r: abs(r["cpu_ms"] - s[pump]["cpu_ms"]))["threads_ms"][:4]
        rows.append([
            {"torchserve": "TorchServe's (`ts/async_service.py`)", "lean": "lean (`worker_pump.py`)"}[pump],
            f"{s[pump]['cpu_ms']:.3f} ({s[pump]['cpu_min']:.3f}-{s[pump]['cpu_max']:.3f})",
            f"{statistics.median(r['messages_per_s'] for r in runs):.0f}",
            f"{threads:.0f}",
            ", ".join(f"{x:.3f}" for x in busiest),
        ])  # fmt: skip
    ratio = s["lean_over_torchserve"]
    return "\n".join([
        "# TorchServe's async message pump against the lean one, per message",
        "",
        f"Each pump serves a forked worker process with TorchServe's own Service, context, metrics cache and "
        f"protocol code, logging to a pipe; this process is the frontend, {data['in_flight']} messages in flight, "
        f"one request per message: a {data['body_bytes'] / 1000:.0f} KB JPEG with {len(HEADERS)} headers, answered "
        f"by an entry point that does no work with {data['answer_bytes'] / 1000:.0f} KB. {data['messages']} "
        f"messages per run, the pumps taking turns, {len(data['rows']) // len(PUMPS)} runs each: median (min-max). "
        "CPU is the worker's, all threads, from /proc (10 ms ticks).",
        "",
        markdown_table(
            ["pump", "worker CPU per message, ms", "messages/s", "threads with CPU", "busiest threads, ms/message"],
            rows,
        ),
        "",
        f"Lean ÷ TorchServe's CPU per message, per round: **{ratio['median']:.2f}** "
        f"({ratio['min']:.2f}-{ratio['max']:.2f}).",
        "",
        f"![CPU per message]({stem}.png)",
        "",
        provenance_block(data["provenance"]),
    ])  # fmt: skip


def plot(data: dict[str, Any], path: Path) -> None:
    fig, ax = new_figure((5.6, 3.4))
    for i, pump in enumerate(PUMPS):
        runs = [r["cpu_ms"] for r in data["rows"] if r["pump"] == pump]
        ax.bar(i, statistics.median(runs), color=f"C{i}", label=pump)
        ax.plot([i] * len(runs), runs, "k.", ms=4)
    ax.set_xticks(range(len(PUMPS)), PUMPS)
    save_figure(fig, ax, path, "message pump", "worker CPU per message (ms)", "Async message pump cost, no model")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=2000, help="messages measured per run")
    parser.add_argument("--warmup", type=int, default=200, help="messages before measuring, per run")
    parser.add_argument("--in-flight", type=int, default=4, help="messages outstanding at once")
    parser.add_argument("--rounds", type=int, default=3, help="runs per pump, interleaved")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    return run_benchmark("bench.worker_pump", args, measure, summary, lambda d: "worker_pump", render, plot)


if __name__ == "__main__":
    sys.exit(main())
