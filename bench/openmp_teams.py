"""Does an idle second OpenMP team slow the first?  One model's batch timed beside each kind of neighbour.

    python -m bench.openmp_teams --model bert-tiny1 --batch 32 --rounds 5

GNU OpenMP keeps a thread's team alive after its parallel region and, while
a process holds more team threads than it has CPUs, stops spinning between
parallel regions, so every region wakes its team through the kernel.  A
worker with several engine threads (REEF's executors, lanes, decode
threads) can hold such a team without meaning to: any thread that once ran
an op on more than one intra-op thread keeps one.  This bench times the
model's batch on the main thread's team (every core) in three settings,
taking turns each round, and reads each against ``alone`` within its round:

- ``alone``: no other thread;
- ``idle-team``: beside a thread that ran one op on every core and now waits;
- ``idle-one-thread``: beside a thread that ran the same op on one intra-op
  thread (no team) and now waits: the neighbour REEF's best-effort executors
  are on CPU (``handlers/reef/engine.py``).

Each neighbour thread ends before the next setting, and a team ended that
way is gone.  CPU only; a tool for the CPU runtime's thread layout, not a
serving benchmark.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import add_output_arguments, markdown_table, provenance, provenance_block, write_outputs

MODULE = "bench.openmp_teams"
SETTINGS = ("alone", "idle-team", "idle-one-thread")


def batch_ms(model: Any, inputs: tuple, runs: int) -> float:
    """Median ms of ``runs`` forwards, after a few unmeasured ones (this thread's team, its kernels)."""
    import torch

    times = []
    with torch.inference_mode():
        for _ in range(5):
            model(*inputs)
        for _ in range(runs):
            started = time.perf_counter()
            model(*inputs)
            times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times)


class Neighbour:
    """A thread that runs one op on ``threads`` intra-op threads, then waits until ``stop``."""

    def __init__(self, threads: int) -> None:
        self._stop = threading.Event()
        started = threading.Event()

        def run() -> None:
            import torch

            from handlers.runtime.intra_op import use_intra_op_threads

            use_intra_op_threads(threads)
            x = torch.randn(512, 512)
            x @ x  # a parallel region on ``threads`` threads: with more than one, a team that stays
            started.set()
            self._stop.wait()

        self._thread = threading.Thread(target=run, name=f"neighbour-{threads}", daemon=True)
        self._thread.start()
        started.wait()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from handlers.runtime.intra_op import use_intra_op_threads
    from model_store.catalog import get_spec
    from model_store.factory import build_model, example_inputs

    cores = torch.get_num_threads()
    use_intra_op_threads(cores)
    spec = get_spec(args.model, "eager")
    torch.manual_seed(0)
    model = build_model(spec).eval()
    inputs = example_inputs(spec, args.batch)
    runs: dict[str, list[float]] = {s: [] for s in SETTINGS}
    order = list(SETTINGS)
    with tqdm(total=args.rounds * len(order), desc="settings", unit="setting") as bar:
        for r in range(args.rounds):
            for setting in order[r % len(order) :] + order[: r % len(order)]:
                neighbour = {"alone": None, "idle-team": cores, "idle-one-thread": 1}[setting]
                other = Neighbour(neighbour) if neighbour is not None else None
                try:
                    runs[setting].append(batch_ms(model, inputs, args.runs))
                finally:
                    if other is not None:
                        other.stop()
                bar.update()
    return {"args": {k: v for k, v in vars(args).items() if k not in ("out_dir", "json")}, "cores": cores,
            "runs": runs}  # fmt: skip


def render(data: dict[str, Any]) -> str:
    args, runs = data["args"], data["runs"]
    rows = []
    for setting, times in runs.items():
        ratios = [t / a for t, a in zip(times, runs["alone"], strict=True)]
        rows.append([setting, f"{statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f})",
                     f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}-{max(ratios):.2f})"])  # fmt: skip
    header = ["setting", "ms per batch, median of rounds (min-max)", "÷ alone, per round (min-max)"]
    return (
        f"# An idle second OpenMP team beside a batch: {args['model']}, batch {args['batch']}, CPU\n\n"
        f"{provenance_block(data['provenance'])}\n"
        f"The batch runs on the main thread's team of {data['cores']} intra-op threads; each round times every "
        f"setting (order rotating) as the median of {args['runs']} forwards; {args['rounds']} rounds. "
        f"What each setting is: `bench/openmp_teams.py`.\n\n" + markdown_table(header, rows) + "\n"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bert-tiny1")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--runs", type=int, default=200, help="forwards timed per setting and round")
    parser.add_argument("--rounds", type=int, default=5)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.runs < 1 or args.batch < 1:
        parser.error("--rounds, --runs and --batch must be ≥ 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prov = provenance(MODULE)
    data = measure(args)
    data["provenance"] = prov
    markdown = render(data)
    write_outputs(f"openmp_teams_{args.model}_cpu_{prov['date'][:10]}", markdown, data, args.out_dir)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
