"""``packrat status`` and ``packrat stop``: the commands that talk to a ``packrat serve`` already running.

They live apart from ``serve.py`` so that they start in a fraction of a
second: ``serve.py`` imports the controller, the archive builder and torch
(about 2 s on a 2-vCPU VM before a line of the command runs), and an
operator checking or stopping a server should not wait for that, nor should
a test that stops one in its teardown.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from pathlib import Path

from packrat_plugin.plan_types import format_instances
from serving_harness.torchserve import TorchServeProcess

DEFAULT_STATUS_PORT = 8083
DEFAULT_WORKDIR = Path("logs/packrat")


def format_status(status: dict) -> str:
    lines = [f"{status.get('threads', '?')} cores: {status.get('cores_source', 'the affinity mask')}"]
    division = status.get("division")
    if division:
        shares = ", ".join(f"{name}: {count}" for name, count in (division["cores"] or {}).items())
        lines.append(f"cores divided ({division['objective']} latency, ≥{division['min_cores']} each): {shares}; "
                     f"{division['moves']} re-division(s)")  # fmt: skip
    lines.append(f"{'model':<14} {'ver':<10} {'plan':<26} {'B est':>6} {'queued':>7} {'busy':>5}  last swap")
    for name, m in status["models"].items():
        plan = m["plan"]
        desc = format_instances(plan["instances"] if plan else None, labels=True)
        last = m["last_swap"]
        swap = (
            f"{last['kind']}: serving after {last['serving_after_s']:.2f} s, done in {last['seconds']:.2f} s"
            if last
            else "-"
        )
        if m.get("mode") == "mixed":
            desc += " (mixed)"
        lines.append(
            f"{name:<14} {m['active_version'] or '-':<10} {desc:<26} {m['estimated_batch']:>6} "
            f"{m['pending_requests']:>7} {m['in_service']:>5}  {swap}"
        )
        if m["slots"]:
            lines.append("    slots→cores: " + ", ".join(f"{i}:{s['cores']}" for i, s in enumerate(m["slots"])))
        prepared = m.get("prepared") or {}
        if prepared:
            lines.append("    prepared for: " + ", ".join(
                f"a {change} → B={p['batch']} ({p['version']}, {'warm' if p['warm'] else 'starting'})"
                for change, p in prepared.items()))  # fmt: skip
        if m["last_error"]:
            lines.append(f"    last error: {m['last_error']}")
    return "\n".join(lines)


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_STATUS_PORT}/status")
    p.add_argument("--json", action="store_true")
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="`packrat serve`'s --workdir")


def add_stop_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="`packrat serve`'s --workdir")


def run_stop(args: argparse.Namespace) -> int:
    """Stop the TorchServe ``packrat serve`` started from this workdir (and its workers), with or without a
    controller still attached to it."""
    server = TorchServeProcess(args.workdir / "torchserve", args.workdir / "model_store")
    if not server.attach():
        print(f"packrat stop: no TorchServe started from {args.workdir} is running")
        return 1
    url = server.inference_url
    server.stop()
    print(f"packrat stop: stopped the TorchServe at {url} started from {args.workdir}, and its workers")
    return 0


def run_status(args: argparse.Namespace) -> int:
    try:
        with urllib.request.urlopen(args.url, timeout=5) as resp:
            status = json.load(resp)
    except OSError as exc:
        server = TorchServeProcess(args.workdir / "torchserve", args.workdir / "model_store")
        orphan = (f"; the TorchServe it started is still serving at {server.inference_url} with no controller "
                  f"attached: `packrat serve` with the same arguments takes it over, `packrat stop` stops it"
                  if server.attach() else "")  # fmt: skip
        raise RuntimeError(f"no Packrat controller answers at {args.url}: {exc}{orphan}") from None
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0
