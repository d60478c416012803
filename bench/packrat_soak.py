"""Packrat soaked: a diurnal load for half an hour, a worker killed every 2 minutes, the controller killed twice.

    python -m bench.packrat_soak --model resnet50                    # 30 min
    python -m bench.packrat_soak --model resnet50 --minutes 3 --out-dir /tmp/soak   # a smoke run

``packrat serve`` runs as a user runs it (a process of its own, with its
``--workdir``, its status port and the profile valid on this machine).  An
open-loop Poisson load follows a slow sine between ``--low`` and ``--high``
(fractions of the profile's largest level capacity) with a period of
``--period-minutes``, so the controller has rises and falls to act on.  Beside
it:

- every ``--worker-kill-s`` seconds one READY worker of the serving version
  gets SIGKILL (TorchServe respawns it; its slot lock frees its cores for the
  new process);
- ``--controller-kills`` times, evenly spaced, the controller gets SIGKILL
  and is started again with the same command 2 s later (it takes over the
  TorchServe it left serving);
- every 2 s the workers' threads are read from /proc against their versions'
  slots (``packrat_plugin.pin_check``): a worker off its slot, or two workers
  of one version on one slot, is a fault.

The report counts requests answered and failed, each failure attributed to a
worker kill when the killed worker could have been serving it (sent before the
kill, answered after it), the swaps each controller life made, how long each
restart took to answer ``/status``, and the pinning faults.  A failure not at a
worker kill, or any pinning fault, fails the run (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from tqdm import tqdm

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from archiver.build import build_archive
from bench.packrat_swap import diurnal_phases, largest_capacity
from bench.report import (
    add_model_arguments,
    add_output_arguments,
    markdown_table,
    new_figure,
    provenance,
    provenance_block,
    publish,
    save_figure,
)
from handlers.pinning.slots import PlanStore
from model_store import ARCHIVE_DIR
from model_store.catalog import get_spec
from model_store.samples import client_payload
from packrat_plugin.pin_check import pinning_faults
from packrat_plugin.profiler import profile_for_this_machine
from serving_harness.clients import ManagementClient, TorchServeAPIError
from serving_harness.loadgen import LoadResult, open_loop, run
from serving_harness.topology import CpuTopology
from serving_harness.torchserve import Ports

KILL_WINDOW_S = 1.0  # a failure answered this long after a worker kill still counts as that kill's


def status(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2) as resp:
            return json.load(resp)
    except OSError:
        return None


def wait_status(port: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = status(port)
        if answer is not None:
            return answer
        time.sleep(0.2)
    raise SystemExit(f"packrat serve did not answer /status on port {port} within {timeout_s:.0f} s")


class Soak:
    """The controller's process, the chaos beside the load, and what was seen."""

    def __init__(self, command: list[str], status_port: int, workdir: Path, model: str, log: Path) -> None:
        self.command, self.status_port, self.workdir, self.model, self.log = command, status_port, workdir, model, log
        self.proc: subprocess.Popen | None = None
        self.t0 = 0.0  # perf_counter at the load's start
        self.worker_kills: list[dict] = []
        self.controller_kills: list[dict] = []
        self.lives: list[dict] = []  # one per controller process: its swaps at the last reading
        self.pin_checks = 0
        self.pin_faults: list[str] = []
        self.management: ManagementClient | None = None

    def start_controller(self) -> float:
        """Start ``packrat serve``; seconds until it answered /status."""
        started = time.monotonic()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        answer = wait_status(self.status_port, 300)
        self.management = ManagementClient(answer["management_url"])
        self.lives.append({"swaps": 0})
        return time.monotonic() - started

    def read_swaps(self) -> None:
        answer = status(self.status_port)
        if answer is not None and self.lives:
            self.lives[-1]["swaps"] = int(answer["models"][self.model]["swaps"])

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def kill_worker(self) -> None:
        assert self.management is not None
        try:
            default = self.management.describe(self.model)[0]
        except TorchServeAPIError:
            return
        ready = [w for w in default.get("workers", []) if w.get("status") == "READY"]
        if not ready:
            return
        victim = int(ready[len(self.worker_kills) % len(ready)]["pid"])
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.worker_kills.append({"at": self.now(), "pid": victim, "version": default["modelVersion"]})

    def kill_controller(self) -> None:
        assert self.proc is not None
        self.read_swaps()
        at = self.now()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        time.sleep(2.0)
        attach_s = self.start_controller()
        self.controller_kills.append({"at": at, "attach_s": attach_s})

    def check_pins(self) -> None:
        if self.management is None:
            return
        try:
            faults = pinning_faults(self.management, PlanStore(self.workdir / "plans"), self.model)
        except (TorchServeAPIError, OSError):
            return
        self.pin_checks += 1
        self.pin_faults.extend(f"{self.now():.1f} s: {f}" for f in faults)

    def chaos(self, seconds: float, worker_kill_s: float, controller_kills: int, stop: threading.Event) -> None:
        """Worker kills, controller kills and pin checks on their schedules until ``stop`` or ``seconds``."""
        kill_at = [seconds * (i + 1) / (controller_kills + 1) for i in range(controller_kills)]
        next_worker, next_check = worker_kill_s, 2.0
        with tqdm(total=round(seconds), desc="soak", unit="s") as bar:
            while not stop.wait(0.2):
                t = self.now()
                bar.n = min(round(t), round(seconds))
                bar.set_postfix_str(f"worker kills {len(self.worker_kills)}, controller kills "
                                    f"{len(self.controller_kills)}")  # fmt: skip
                bar.refresh()
                if kill_at and t >= kill_at[0]:
                    kill_at.pop(0)
                    self.kill_controller()
                if t >= next_worker:
                    next_worker += worker_kill_s
                    self.kill_worker()
                if t >= next_check:
                    next_check = t + 2.0
                    self.check_pins()
                    self.read_swaps()


def attribute(result: LoadResult, worker_kills: list[dict]) -> tuple[int, int]:
    """Failed requests (at a worker kill, elsewhere): at a kill = sent before it, answered within
    ``KILL_WINDOW_S`` after it."""
    at_kill = other = 0
    for s in result.samples:
        if s.status == 200:
            continue
        done = s.sent + s.latency_s
        if any(s.sent <= k["at"] <= done + KILL_WINDOW_S for k in worker_kills):
            at_kill += 1
        else:
            other += 1
    return at_kill, other


def measure(args: argparse.Namespace, workdir: Path) -> dict:
    spec = get_spec(args.model, args.mode)
    profile, profile_path = profile_for_this_machine(spec.name, args.profile, args.force, args.mode)
    archive = build_archive(spec, ARCHIVE_DIR)
    threads = len(CpuTopology.from_system().cores)
    capacity = largest_capacity(profile, threads)
    seconds = args.minutes * 60.0
    period = args.period_minutes * 60.0
    phases = []
    while sum(p[0] for p in phases) < seconds:
        phases.extend(diurnal_phases(args.low * capacity, args.high * capacity, period))
    total, trimmed = 0.0, []
    for length, rate in phases:
        if total >= seconds:
            break
        trimmed.append((min(length, seconds - total), rate))
        total += trimmed[-1][0]
    status_port = Ports.free().inference
    command = [
        sys.executable, "-m", "packrat_plugin.cli", "serve", "--models", f"{spec.name}={archive}",
        "--profile", f"{spec.name}={profile_path}", "--force-profile", "--free-ports",
        "--status-port", str(status_port), "--workdir", str(workdir / "w"),
    ]  # fmt: skip
    soak = Soak(command, status_port, workdir / "w", spec.name, workdir / "serve.log")
    payloads = [client_payload(spec, seed=i) for i in range(32)]
    stop = threading.Event()
    chaos = threading.Thread(target=soak.chaos, args=(seconds, args.worker_kill_s, args.controller_kills, stop))
    try:  # from the first start on: an interrupt anywhere still stops the controller and its TorchServe
        first_start_s = soak.start_controller()
        url = f"{status(status_port)['inference_url']}/predictions/{spec.name}"
        soak.t0 = time.perf_counter()
        chaos.start()
        result = run(open_loop(url, lambda i: payloads[i % len(payloads)], trimmed, seed=7))
    finally:
        stop.set()
        if chaos.is_alive():
            chaos.join()
        soak.read_swaps()
        if soak.proc is not None and soak.proc.poll() is None:
            soak.proc.send_signal(signal.SIGTERM)
            try:
                soak.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(soak.proc.pid, signal.SIGKILL)
        subprocess.run([sys.executable, "-m", "packrat_plugin.cli", "stop", "--workdir", str(workdir / "w")],
                       capture_output=True, timeout=120)  # fmt: skip
    at_kill, other = attribute(result, soak.worker_kills)
    return {
        "model": spec.name, "mode": spec.mode, "threads": threads, "minutes": args.minutes,
        "low": args.low * capacity, "high": args.high * capacity, "capacity": capacity,
        "period_minutes": args.period_minutes, "worker_kill_s": args.worker_kill_s,
        "requests": len(result.samples), "answered": len(result.ok), "failed_at_worker_kills": at_kill,
        "failed_other": other, "mean_ms": result.mean_latency_ms(), "p99_ms": result.percentile_ms(99),
        "worker_kills": soak.worker_kills, "controller_kills": soak.controller_kills,
        "first_start_s": first_start_s, "swaps_per_life": [life["swaps"] for life in soak.lives],
        "pin_checks": soak.pin_checks, "pin_faults": soak.pin_faults, "profile_path": str(profile_path),
        "timeline": [(round(s.sent, 2), round(s.latency_s * 1e3, 1), s.status) for s in result.samples],
        "offered": trimmed,
    }  # fmt: skip


def plot(data: dict, path: Path) -> None:
    fig, ax = new_figure((9.0, 3.8))
    ok = [(t, ms) for t, ms, st in data["timeline"] if st == 200]
    bad = [(t, ms) for t, ms, st in data["timeline"] if st != 200]
    ax.scatter([t / 60 for t, _ in ok], [ms for _, ms in ok], s=2, alpha=0.4, label="answered")
    if bad:
        ax.scatter([t / 60 for t, _ in bad], [ms for _, ms in bad], s=12, color="tab:red", label="failed")
    for k in data["worker_kills"]:
        ax.axvline(k["at"] / 60, color="tab:gray", lw=0.5, alpha=0.6)
    for k in data["controller_kills"]:
        ax.axvline(k["at"] / 60, color="tab:red", lw=1.2, ls="--")
    save_figure(fig, ax, path, "minutes (grey: a worker killed; red dashed: the controller killed)", "latency (ms)",
                f"{data['model']}: {data['minutes']:g}-minute soak", log_y=True)  # fmt: skip


def render(data: dict, stem: str) -> str:
    rows = [[
        f"{data['minutes']:g} min", f"{data['requests']:,}", f"{data['answered']:,}",
        f"{data['failed_at_worker_kills']} / {data['failed_other']}", str(len(data["worker_kills"])),
        str(len(data["controller_kills"])),
        " ".join(f"{k['attach_s']:.1f}" for k in data["controller_kills"]) or "-",
        " + ".join(map(str, data["swaps_per_life"])), f"{data['pin_checks']} / {len(data['pin_faults'])}",
        f"{data['mean_ms']:.0f} / {data['p99_ms']:.0f}",
    ]]  # fmt: skip
    table = markdown_table(
        ["length", "requests", "answered", "failed: at a worker kill / other", "workers killed",
         "controller killed", "restart → /status (s)", "swaps per controller life", "pin checks / faults",
         "mean / p99 ms"], rows,
    )  # fmt: skip
    faults = "".join(f"\n- {f}" for f in data["pin_faults"][:20])
    return (
        f"# Packrat soak: {data['model']} ({data['mode']}), T={data['threads']}\n\n"
        f"`packrat serve` under an open-loop Poisson load following a sine between {data['low']:.1f} and "
        f"{data['high']:.1f} req/s (period {data['period_minutes']:g} min; fractions of the profile's largest "
        f"level capacity, {data['capacity']:.1f} req/s), one READY worker of the serving version killed "
        f"(SIGKILL) every {data['worker_kill_s']:g} s, the controller killed (SIGKILL) and started again with the "
        f"same command {len(data['controller_kills'])} times. A failure counts as a worker kill's when it was "
        f"sent before the kill and answered within {KILL_WINDOW_S:g} s after it. Pin checks read every READY "
        f"worker's threads from /proc every 2 s against its version's slots.\n\n{table}\n\n"
        + (f"Pinning faults:{faults}\n\n" if data["pin_faults"] else "")
        + f"![latency over the soak]({stem}.png)\n\nProfile: `{data['profile_path']}`.\n\n"
        f"{provenance_block(data['provenance'])}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the soak")
    parser.add_argument("--period-minutes", type=float, default=10.0, help="the diurnal sine's period")
    parser.add_argument("--low", type=float, default=0.1, help="low load, a fraction of the largest capacity")
    parser.add_argument("--high", type=float, default=0.6, help="high load, likewise")
    parser.add_argument("--worker-kill-s", type=float, default=120.0, help="seconds between worker kills")
    parser.add_argument("--controller-kills", type=int, default=2, help="controller kills, evenly spaced")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.worker_kill_s <= 0 or args.controller_kills < 0 or not 0 < args.low < args.high:
        parser.error("need --minutes > 0, --worker-kill-s > 0, --controller-kills ≥ 0, 0 < --low < --high")
    prov = provenance("bench.packrat_soak")
    with tempfile.TemporaryDirectory(prefix="packrat-soak-") as tmp:
        data = measure(args, Path(tmp))
    data["provenance"] = prov
    stem = f"packrat_soak_{data['model']}"
    print(publish(stem, data, lambda d: render(d, stem), plot, args.out_dir, args.json))
    return 0 if data["failed_other"] == 0 and not data["pin_faults"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
