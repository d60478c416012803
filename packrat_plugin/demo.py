"""``packrat demo``: build the model store, serve it, and answer real requests.

Builds one archive per catalog model, starts TorchServe with the repo's
``config.properties`` (loopback ports 8080-8082), registers every archive,
sends each a few real client payloads (JPEG images, token ids) and prints one
line per model: status codes and latency.  TorchServe is always stopped.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from model_store.build import ARCHIVE_DIR, build_many, select
from model_store.catalog import get_spec
from model_store.samples import client_payload
from packrat_plugin.torchserve import Ports, TorchServeProcess

DEMO_DIR = Path("logs/demo")


@dataclass
class ModelResult:
    model: str
    mode: str
    statuses: list[int]
    latencies_ms: list[float]
    top1: int | None

    def row(self) -> str:
        ok = sum(s == 200 for s in self.statuses)
        median = statistics.median(self.latencies_ms) if self.latencies_ms else float("nan")
        top1 = "-" if self.top1 is None else str(self.top1)
        return f"{self.model:<14} {self.mode:<8} {ok:>3}/{len(self.statuses):<3} {median:>10.1f} {top1:>6}"


def run_demo(models: list[str] | None, mode: str, requests: int, ports: Ports) -> list[ModelResult]:
    specs = select(models, [mode], ci=False)
    archives = build_many(specs, ARCHIVE_DIR)
    results = []
    with TorchServeProcess(DEMO_DIR, ARCHIVE_DIR, ports=ports) as server:
        print(f"TorchServe up: inference {server.inference_url}, management {server.management_url}")
        management, inference = server.management(), server.inference()
        for path in tqdm(archives, desc="serving", unit="model"):
            name = path.stem
            spec = get_spec(name.rsplit("_", 1)[0], mode)
            management.register(path.name, model_name=name, initial_workers=1)
            answers = [inference.predict(name, client_payload(spec, seed=i)) for i in range(requests)]
            top1 = answers[-1].body["top5"][0]["index"] if answers[-1].ok else None
            results.append(
                ModelResult(spec.name, mode, [a.status for a in answers], [a.latency_s * 1e3 for a in answers], top1)
            )
            management.unregister(name)  # keep memory flat on small machines
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", help="comma-separated catalog names (default: every model)")
    parser.add_argument("--mode", default="script", choices=("eager", "script", "compile"))
    parser.add_argument("--requests", type=int, default=5, help="requests per model")
    parser.add_argument("--free-ports", action="store_true", help="use free ports instead of 8080-8082")


def run(args: argparse.Namespace) -> int:
    models = [m.strip() for m in args.models.split(",")] if args.models else None
    ports = Ports.free() if args.free_ports else Ports.default()
    results = run_demo(models, args.mode, args.requests, ports)
    print(f"\n{'model':<14} {'mode':<8} {'ok':>7} {'median ms':>10} {'top-1':>6}")
    for result in results:
        print(result.row())
    failed = [r.model for r in results if any(s != 200 for s in r.statuses)]
    if failed:
        print(f"requests failed for: {', '.join(failed)}")
        return 1
    return 0
