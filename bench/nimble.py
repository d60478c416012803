"""Nimble against eager PyTorch and torch.compile, side by side in one run.

    python -m bench.nimble                      # ResNet-50, Inception-v3, EfficientNet-B0 at batch 1..32
    python -m bench.nimble --quick              # batches 1 and 8, 2 repeats: a few minutes on 2 cores
    python -m bench.nimble --device cuda        # on a GPU: CUDA graphs, reduce-overhead compile

What runs, per model, in one process on one device:

- ``eager``: the catalog model in eval mode, as the plain handler runs it;
- ``compile``: ``torch.compile`` of it (``reduce-overhead``, i.e. with CUDA
  graphs, on CUDA; the default mode on CPU), compiled before timing; on
  CUDA it runs in a child process of its own (``CompiledElsewhere``);
- ``single``: Nimble's frozen graph (batch norms folded) on one stream;
  on CUDA replayed from a CUDA graph captured per batch size;
- ``multi``: the same graph on Nimble's assigned streams (CPU: its chains
  on threads), likewise captured on CUDA;
- ``compiled``: the frozen graph under torch.compile: on CPU Nimble's
  stand-in for a captured graph; on CUDA inductor's kernels captured into
  Nimble's own graph per batch size (``cuda_compile``);
- ``Nimble``: what the Nimble handler serves at that batch size: the
  candidate (eager, single or multi) its start-up timing chose, exactly as
  ``handlers/nimble/program.py`` chooses in a worker.  The choice is made
  from the start-up timings, before and apart from the timed rounds, so
  the column is not the best of the rounds after the fact.

Each batch size is timed in ``--repeats`` rounds, the systems' order
reversed every other round; a measurement is the median of ``--runs``
calls after one untimed call.  Ratios are taken within a round (same
machine state) and reported as median and min-max over rounds.  Every
program's output is checked against eager's before it is timed.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import add_output_arguments, markdown_table, provenance_block, run_benchmark

# "compile" is the baseline (torch.compile of the eager model); "compiled" is
# Nimble's CPU candidate (its frozen graph under torch.compile).
SYSTEMS = ("eager", "compile", "single", "multi", "compiled")
LABELS = {"compile": "torch.compile", "compiled": "frozen+compile"}
DEFAULT_MODELS = "resnet50,inception_v3,efficientnet_b0"


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this machine has no CUDA device; use --device cpu")
    return name


def _compiled(model: Any, device: str) -> Any:
    import torch

    return torch.compile(model, mode="reduce-overhead" if device == "cuda" else None)


def _compile_worker(name: str, device: str, conn: Any) -> None:
    """The torch.compile baseline's own process: builds the same seeded model, answers and times on request."""
    import torch

    from handlers.nimble.program import time_ms
    from model_store.catalog import get_spec
    from model_store.factory import build_model

    program = _compiled(build_model(get_spec(name)).to(device), device)
    inputs: dict[int, tuple[Any, ...]] = {}
    while True:
        request = conn.recv()
        if request is None:
            return
        try:
            with torch.inference_mode():
                if request[0] == "run":  # ("run", cpu inputs): the output, on the CPU
                    batch = tuple(x.to(device) for x in request[1])
                    inputs[batch[0].shape[0]] = batch
                    conn.send(("ok", program(*batch).cpu()))
                else:  # ("time", rows, runs), on the inputs of the last "run" of that many rows
                    conn.send(("ok", time_ms(program, inputs[request[1]], request[2])))
        except Exception as exc:  # reported as the parent's exception: a failed backend is a note
            conn.send(("error", f"{type(exc).__name__}: {str(exc)[:300]}"))


class CompiledElsewhere:
    """torch.compile of the model in a child process, for CUDA.

    Its CUDA-graph trees (mode reduce-overhead) and Nimble's own captured
    graphs faulted when they shared a process on the lent H200, while each
    ran fine alone: an illegal memory access at the first timing while the
    captured graphs read freed weights (fixed in ``GraphBuckets``), and
    after that fix an unspecified launch failure at batch 32, once
    torch.compile had compiled for each batch size (not diagnosed).  Apart,
    each has the GPU to itself while it is timed, and the rounds still
    interleave the systems.
    """

    def __init__(self, name: str, device: str) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_compile_worker, args=(name, device, child), daemon=True)
        self._process.start()
        child.close()

    def _ask(self, request: tuple[Any, ...]) -> Any:
        self._conn.send(request)
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def __call__(self, *inputs: Any) -> Any:
        return self._ask(("run", tuple(x.cpu() for x in inputs))).to(inputs[0].device)

    def time_ms(self, inputs: tuple[Any, ...], runs: int) -> float:
        return self._ask(("time", inputs[0].shape[0], runs))

    def close(self) -> None:
        with contextlib.suppress(OSError):  # the child already gone
            self._conn.send(None)
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()


def measure_model(name: str, args: argparse.Namespace, bar: tqdm) -> dict[str, Any]:
    """Every system at every batch size for one model; the rows and what Nimble chose."""
    import torch

    from handlers.nimble.config import NimbleConfig
    from handlers.nimble.program import build_candidates, choose, reproduces, time_ms
    from handlers.runtime.segments import batch_rows
    from model_store.catalog import get_spec
    from model_store.factory import build_model, example_inputs

    spec = get_spec(name)
    model = build_model(spec).to(args.device)
    example = tuple(x.to(args.device) for x in example_inputs(spec, 1))
    config = NimbleConfig(buckets=tuple(args.batches), timing_runs=args.runs)
    started = time.perf_counter()
    candidates = build_candidates(model, example, config)
    choices = choose(model, candidates, example, config)
    prepare_s = time.perf_counter() - started
    compiled: Any = None
    if args.compile:
        compiled = CompiledElsewhere(name, args.device) if args.device == "cuda" else _compiled(model, args.device)
    programs: dict[str, Any] = {"eager": model, "compile": compiled}
    programs["single"] = candidates.programs.get("single")
    programs["multi"] = candidates.programs.get("multi")  # absent when the graph is one chain
    programs["compiled"] = candidates.programs.get("compiled")  # on CUDA: inductor kernels in captured graphs
    notes: list[str] = []
    rows = []
    try:
        for batch, choice in zip(args.batches, choices, strict=True):
            inputs = batch_rows(example, batch)
            with torch.inference_mode():
                expected = model(*inputs)
            live = {}
            for system, program in programs.items():
                if program is None:
                    continue
                try:
                    with torch.inference_mode():
                        ok = reproduces(program(*inputs), expected)  # also compiles / captures this shape
                except Exception as exc:  # a backend that fails here is reported, not fatal
                    notes.append(f"{system} at batch {batch} failed: {type(exc).__name__}: {str(exc)[:160]}")
                    continue
                if not ok:
                    notes.append(f"{system} at batch {batch}: output differs from eager's; not timed")
                    continue
                live[system] = program
            for r in range(args.repeats):
                order = list(live) if r % 2 == 0 else list(reversed(live))
                ms = {}
                for system in order:
                    program = live[system]
                    with torch.inference_mode():
                        if isinstance(program, CompiledElsewhere):
                            ms[system] = program.time_ms(inputs, args.runs)
                        else:
                            ms[system] = time_ms(program, inputs, args.runs)
                    bar.update(1)
                ms["nimble"] = ms[choice.chosen]
                rows.append({"model": name, "batch": batch, "repeat": r, "chosen": choice.chosen, "ms": ms})
            bar.update((len(SYSTEMS) - len(live)) * args.repeats)
    finally:
        candidates.close()
        if isinstance(compiled, CompiledElsewhere):
            compiled.close()
    a = candidates.assignment
    return {
        "model": name,
        "operators": len(a.stream_of),
        "streams": a.streams,
        "syncs": len(a.syncs),
        "reduced_edges": a.reduced_edges,
        "matching": a.matching_size,
        "prepare_s": prepare_s,
        "choices": [{"batch": c.batch, "chosen": c.chosen, "ms": c.ms} for c in choices],
        "rows": rows,
        "notes": notes,
    }


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import torch

    total = len(args.models) * len(args.batches) * args.repeats * len(SYSTEMS)
    with tqdm(total=total, desc=f"nimble on {args.device}", unit="timing") as bar:
        models = [measure_model(name, args, bar) for name in args.models]
    return {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "batches": args.batches,
        "repeats": args.repeats,
        "runs": args.runs,
        "models": models,
        # run_benchmark's exit status: no request-level failures here; a failed backend is a note.
        "rows": [{"failed": 0}],
    }


def _ratio(rows: list[dict[str, Any]], num: str, den: str) -> dict[str, float] | None:
    values = [r["ms"][num] / r["ms"][den] for r in rows if num in r["ms"] and den in r["ms"]]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summary(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per model and batch: median ms per system, and the speedups (a ÷ b of times) per round."""
    out = []
    for m in data["models"]:
        for batch in data["batches"]:
            rows = [r for r in m["rows"] if r["batch"] == batch]
            if not rows:
                continue
            systems = [s for s in (*SYSTEMS, "nimble") if all(s in r["ms"] for r in rows)]
            out.append({
                "model": m["model"],
                "batch": batch,
                "chosen": rows[0]["chosen"],
                "ms": {s: statistics.median(r["ms"][s] for r in rows) for s in systems},
                "over_eager": {s: _ratio(rows, "eager", s) for s in systems if s != "eager"},
                "nimble_vs_eager": _ratio(rows, "eager", "nimble"),
                "nimble_vs_compile": _ratio(rows, "compile", "nimble"),
                "multi_vs_single": _ratio(rows, "single", "multi"),
            })  # fmt: skip
    return out


def _cell(ratio: dict[str, float] | None) -> str:
    return "-" if ratio is None else f"{ratio['median']:.2f}× ({ratio['min']:.2f}-{ratio['max']:.2f})"


def render(data: dict[str, Any], stem: str) -> str:
    lines = [
        f"# Nimble on {data['device_name']} ({data['threads']} threads)\n",
        f"![speedups]({stem}.png)\n",
        "Speedup = the other system's time ÷ Nimble's, per round (> 1: Nimble faster); median (min-max) over "
        f"{data['repeats']} rounds, each a median of {data['runs']} calls; the systems' order reversed every other "
        "round. *Nimble* is the candidate its start-up timing chose for that batch (column *chosen*); "
        "*multi ÷ single* is the gain of Nimble's stream assignment over the same graph on one stream; "
        "*frozen+compile* is Nimble's frozen graph under torch.compile (on CUDA captured per batch size), "
        "*torch.compile* the eager model's.\n",
    ]
    for m in data["models"]:
        lines.append(
            f"## {m['model']}\n\n{m['operators']} operators, "
            f"**{m['streams']} stream(s), {m['syncs']} synchronisation(s)** "
            f"(|E'| {m['reduced_edges']} − |M| {m['matching']}); preparing every bucket took {m['prepare_s']:.1f} s.\n"
        )
        header = ["batch", *(f"{LABELS.get(k, k)} ms" for k in SYSTEMS), "chosen", "Nimble ÷ eager",
                  "Nimble ÷ torch.compile", "multi ÷ single"]  # fmt: skip
        table = []
        for s in (s for s in data["summary"] if s["model"] == m["model"]):
            ms = s["ms"]
            table.append([s["batch"], *(f"{ms[k]:.1f}" if k in ms else "-" for k in SYSTEMS), s["chosen"],
                          _cell(s["nimble_vs_eager"]), _cell(s["nimble_vs_compile"]),
                          _cell(s["multi_vs_single"])])  # fmt: skip
        lines.append(markdown_table(header, table) + "\n")
        for note in m["notes"]:
            lines.append(f"- {note}")
        if m["notes"]:
            lines.append("")
    lines.append("## How this was measured\n")
    lines.append(provenance_block(data["provenance"]))
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    models = data["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, m in zip(axes[0], models, strict=True):
        rows = [s for s in data["summary"] if s["model"] == m["model"]]
        batches = [s["batch"] for s in rows]
        styles = (("compile", "s--"), ("single", "^:"), ("multi", "v:"), ("compiled", "d:"), ("nimble", "o-"))
        for system, style in styles:
            ratios = [s["over_eager"].get(system) for s in rows]  # per-round ratios' medians, as in the table
            ys = [r["median"] if r else float("nan") for r in ratios]
            label = "Nimble (chosen)" if system == "nimble" else LABELS.get(system, system)
            if any(y == y for y in ys):  # a system never timed (e.g. no multi) gets no legend entry
                ax.plot(batches, ys, style, label=label)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_title(f"{m['model']} ({m['streams']} stream{'s' if m['streams'] > 1 else ''})")
        ax.set_xlabel("batch size")
        ax.set_ylabel("speedup over eager (median of rounds)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated catalog image models")
    parser.add_argument("--batches", default="1,2,4,8,16,32", help="comma-separated batch sizes (Nimble's buckets)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=3, help="rounds per batch size")
    parser.add_argument("--runs", type=int, default=3, help="timed calls per measurement (median kept)")
    parser.add_argument(
        "--no-compile", dest="compile", action="store_false",
        help="leave out the torch.compile baseline (Nimble's own compiled candidate stays)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="batches 1 and 8, 2 rounds of 2 calls")
    parser.add_argument("--suffix", default="", help="appended to the output files' name (nimble_<device><suffix>.*)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.repeats, args.runs = "1,8", 2, 2
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
        args.models = [m.strip() for m in args.models.split(",") if m.strip()]
        from handlers.nimble.config import NimbleConfig
        from model_store.catalog import get_spec

        NimbleConfig(buckets=tuple(args.batches))
        for name in args.models:
            if get_spec(name).input_kind != "image":
                raise ValueError(f"{name} is not an image model; Nimble serves image models")
    except (ValueError, KeyError) as exc:
        parser.error(str(exc))
    if args.repeats < 1 or args.runs < 1:
        parser.error("--repeats and --runs must be ≥ 1")
    args.device = _device(args.device)

    def stem_of(data: dict[str, Any]) -> str:
        return f"nimble_{data['device']}{args.suffix}"

    return run_benchmark("bench.nimble", args, measure, summary, stem_of, render, plot)


if __name__ == "__main__":
    sys.exit(main())
