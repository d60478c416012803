"""Orca against request-level and continuous batching: throughput and latency under Poisson arrivals, in one run.

    python -m bench.orca                       # GPT-2, max batch 8 and 16, six loads: about 30 minutes on 2 cores
    python -m bench.orca --quick               # two loads, shorter runs
    python -m bench.orca --quick --model gpt2-tiny1 --baselines generate,continuous,twin  # host-bound regime
    python -m bench.orca --device cuda         # on a GPU

The default request mix is the Orca paper's, scaled to a 2-core CPU: the
paper draws prompts of U(32, 512) tokens and U(1, 128) new tokens; here
both are divided by 4 (``--prompt 8-128 --output 1-32``), so a request's
output length varies as widely against its mean as in the paper.

These systems on the catalog GPT-2 (or its one-layer GPT-2, ``--model
gpt2-tiny1``, where a fast GPU's regime shows on a CPU: host work per
iteration, not compute, decides), driven in-process (no HTTP: all would pay
it alike):

- ``orca``: iteration-level scheduling with selective batching
  (``handlers/orca/engine.py``); a request joins at the next iteration and
  is answered when its last token is made;
- ``request``: request-level batching, the paper's baseline
  (FasterTransformer behind a batch window), on the same engine: a batch of
  up to ``max batch`` waiting requests runs until its longest request is
  done, nobody joins it midway, and its answers are held until then.  It
  starts as soon as the engine is free (no batching delay), its prompts are
  not padded and finished requests stop computing, all in the baseline's
  favour: it isolates scheduling;
- ``generate``: request-level batching as a TorchServe user writes it
  without Orca (``handlers/orca/batch_generate.py``): the same batch window,
  prompts left-padded to the longest, transformers' ``generate`` with its
  KV cache computing every row until the batch's longest request is done.
  ``--baselines request`` leaves it out.
- ``continuous``: transformers' own continuous batching
  (``bench/transformers_continuous.py``: ``init_continuous_batching``,
  iteration-level with a paged KV cache), the in-ecosystem baseline, given
  the same KV memory;
- ``twin`` (asked for in ``--baselines``): a second Orca engine with the
  same settings, so the run carries its own A/A band;
- ``eager`` (with ``--cuda-graphs``, on a GPU): Orca without its decode
  graphs, so the run shows what the graphs are worth.

``--cuda-graphs`` runs Orca (and its twin) with ``cuda_graphs: true``:
decode iterations replayed as CUDA graphs per (batch, context) bucket
(``handlers/orca/decode_programs.py``); a CPU ignores it.

The run also counts KV memory: the same requests with blocks for all of
them and for a third (preemption by recompute; the answers must not
change), and requests repeating one system prompt with and without prefix
sharing (blocks shared, peak blocks in use).

Load: Orca's sustainable throughput at the largest max batch is measured
first (closed loop, twice that many requests in flight); then each system
serves Poisson arrivals at fractions of it, identical arrivals for every
system at a given load (prompt and output lengths drawn uniformly), the
systems' order reversed at every other load.  Throughput is answers per
second from the first arrival to the last answer.  *At equal median
latency*: for each point of a baseline's curve, the most answers/s Orca
served at a load where its median latency was no higher (measured points
only, no interpolation).  Each system's closed-loop capacity is measured
too, and so is what one iteration costs at each batch size (decode steps,
and a prompt's initiation), since that decides how much a fuller batch is
worth.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import (
    add_output_arguments,
    markdown_table,
    new_figure,
    provenance_block,
    run_benchmark,
    save_figure,
)
from handlers.runtime.timing import median_seconds

BASELINES = {
    "request": "request-level batching on Orca's engine (no padding, finished requests stop computing)",
    "generate": "request-level batching through transformers' generate (padded, every row runs to the batch's end)",
    "continuous": "transformers' own continuous batching (init_continuous_batching: iteration-level, paged KV)",
    "twin": "a second Orca engine, the same settings: the A/A band of this run",
    "eager": "Orca without CUDA graphs (each decode iteration launched operator by operator)",
}
MODELS = ("gpt2", "gpt2-tiny1", "llama-tiny")


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    low_i, high_i = int(low), int(high or low)
    if not 1 <= low_i <= high_i:
        raise ValueError(f"bad range {text!r}: want LOW-HIGH with 1 ≤ LOW ≤ HIGH")
    return low_i, high_i


def workload(rate: float, seconds: float, prompt: tuple[int, int], output: tuple[int, int], seed: int,
             vocab: int) -> list[dict]:  # fmt: skip
    """Poisson arrivals over ``seconds``: (time, prompt ids of a ``vocab``-token vocabulary, max_new_tokens)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        ids = [rng.randrange(vocab) for _ in range(rng.randint(*prompt))]
        out.append({"at": t, "ids": ids, "new": rng.randint(*output)})


def drive(engine: Any, arrivals: list[dict]) -> dict[str, Any]:
    """Submit each arrival at its time; every request's latency, and the span to the last answer."""
    done_at: dict[int, float] = {}
    lock = threading.Lock()
    all_done = threading.Event()
    futures = []
    start = time.perf_counter()
    for i, a in enumerate(arrivals):
        delay = start + a["at"] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        submitted = time.perf_counter()
        future = engine.submit(a["ids"], a["new"])

        def finished(_f: Any, i: int = i) -> None:
            with lock:
                done_at[i] = time.perf_counter()
                if len(done_at) == len(arrivals):
                    all_done.set()

        a["submitted"] = submitted
        future.add_done_callback(finished)
        futures.append(future)
    if arrivals:
        all_done.wait()
    failed = sum(1 for f in futures if f.exception() is not None)
    latencies = [done_at[i] - a["submitted"] for i, a in enumerate(arrivals)]
    span = max(done_at.values()) - start if done_at else 0.0
    return {"latencies": latencies, "span": span, "failed": failed, "tokens": sum(a["new"] for a in arrivals)}


def capacity(engine: Any, clients: int, seconds: float, prompt: tuple[int, int], output: tuple[int, int],
             vocab: int) -> float:  # fmt: skip
    """Answers per second with ``clients`` requests always in flight."""
    rng = random.Random(1)
    stop = time.perf_counter() + seconds
    count = 0
    lock = threading.Lock()

    def client() -> None:
        nonlocal count
        while time.perf_counter() < stop:
            with lock:
                ids = [rng.randrange(vocab) for _ in range(rng.randint(*prompt))]
                new = rng.randint(*output)
            engine.submit(ids, new).result()
            with lock:
                count += 1

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return count / (time.perf_counter() - started)


def iteration_costs(
    model: Any, batches: list[int], context: int, prompt: int, device: str = "cpu", repeats: int = 15
) -> dict[str, Any]:
    """Median ms of one decode iteration at each batch size (``context`` positions cached each) and of one prompt."""
    import torch

    from handlers.orca.engine import DEFAULT_BLOCK_SIZE
    from handlers.orca.gpt2 import Step
    from handlers.orca.kv_cache import KVCache, blocks_for

    positions = max(context + 1, prompt)
    per_request = blocks_for(positions, DEFAULT_BLOCK_SIZE)
    kv = KVCache(model.kv_shape(max(batches) * per_request, DEFAULT_BLOCK_SIZE), device=device)
    tables = [kv.table_for(positions) for _ in range(max(batches))]
    rng = random.Random(2)

    def median_ms(steps: list) -> float:
        def iteration() -> None:
            model.iterate(steps, kv)
            if device == "cuda":  # a GPU runs it asynchronously: time it to its end
                torch.cuda.synchronize()

        return 1e3 * median_seconds(iteration, repeats=repeats, warm=3)

    decode = {b: median_ms([Step([rng.randrange(model.vocab)], context, tables[i]) for i in range(b)]) for b in batches}
    initiation = median_ms([Step([rng.randrange(model.vocab) for _ in range(prompt)], 0, tables[0])])
    return {"context": context, "prompt": prompt, "decode_ms": decode, "initiation_ms": initiation}


def kv_counts(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """KV memory, counted: the same requests with blocks for all of them and for a third of what they need
    (preemption by recompute), and requests repeating one system prompt with and without prefix sharing."""
    from handlers.orca.engine import DEFAULT_BLOCK_SIZE, OrcaEngine
    from handlers.orca.kv_cache import blocks_for

    rng = random.Random(5)
    size, new = DEFAULT_BLOCK_SIZE, args.output[1]
    max_tokens = args.prompt[1] + new
    asks = [[rng.randrange(model.vocab) for _ in range(rng.randint(*args.prompt))] for _ in range(12)]
    need = sum(blocks_for(len(a) + new - 1, size) for a in asks)

    def serve(asks: list[list[int]], kv_blocks: int | None, share: bool = True, first_alone: bool = False) -> dict:
        engine = OrcaEngine(model, slots=len(asks), max_tokens=max_tokens, max_batch=len(asks), max_new_tokens=new,
                            device=args.device, kv_blocks=kv_blocks)  # fmt: skip
        if not share:
            engine.kv.blocks.register = lambda *a: None
        try:
            answers = [engine.submit(asks[0], new).result()] if first_alone else []
            answers += [f.result() for f in [engine.submit(a, new) for a in asks[len(answers) :]]]
        finally:
            engine.close(timeout_s=60)
        return {"answers": answers, "preemptions": engine.scheduler.preemptions, "peak_blocks": engine.peak_blocks,
                "shared_blocks": engine.kv.blocks.shared, "blocks": engine.kv.shape.blocks}  # fmt: skip

    ample, scarce = serve(asks, None), serve(asks, max(need // 3, blocks_for(max_tokens, size)))
    system = [rng.randrange(model.vocab) for _ in range(4 * size)]
    chats = [system + [rng.randrange(model.vocab) for _ in range(8)] for _ in range(8)]
    shared, unshared = serve(chats, None, first_alone=True), serve(chats, None, share=False, first_alone=True)
    rows = {"ample": ample, "scarce": scarce, "prefix shared": shared, "prefix not shared": unshared}
    return {
        "blocks_needed": need, "block_size": size, "new_tokens": new, "system_prompt": len(system),
        "scarce_same_answers": scarce["answers"] == ample["answers"],
        "shared_same_answers": shared["answers"] == unshared["answers"],
        "rows": {k: {key: v for key, v in r.items() if key != "answers"} | {"requests": len(r["answers"])}
                 for k, r in rows.items()},
    }  # fmt: skip


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import torch

    from bench.transformers_continuous import TransformersContinuousEngine
    from handlers.orca.batch_generate import BatchGenerateEngine
    from handlers.orca.engine import OrcaEngine
    from handlers.orca.gpt2 import SelectiveGPT2
    from handlers.orca.llama import SelectiveLlama
    from model_store.catalog import get_spec
    from model_store.factory import build_model

    spec = get_spec(args.model)
    hf = build_model(spec).model.to(args.device)
    model = SelectiveLlama(hf) if spec.family == "llama" else SelectiveGPT2(hf)  # shares hf's weights
    max_tokens = args.prompt[1] + args.output[1]
    systems = [(policy, b) for b in args.max_batches for policy in ("orca", *args.baselines)]

    def engine_for(policy: str, b: int) -> Any:
        if policy == "generate":
            return BatchGenerateEngine(hf, max_batch=b, max_new_tokens=args.output[1], max_tokens=max_tokens)
        if policy == "continuous":
            return TransformersContinuousEngine(hf, max_batch=b, max_new_tokens=args.output[1], max_tokens=max_tokens,
                                                slots=max(args.max_batches))  # fmt: skip
        return OrcaEngine(model, slots=max(args.max_batches), max_tokens=max_tokens, max_batch=b,
                          max_new_tokens=args.output[1], device=args.device,
                          iteration_level=policy != "request",
                          cuda_graphs=args.cuda_graphs and policy in ("orca", "twin"))  # fmt: skip

    engines = {(policy, b): engine_for(policy, b) for policy, b in systems}
    rows = []
    try:
        for engine in engines.values():  # warm-up: the first iterations pay lazy initialisation
            engine.submit([0] * args.prompt[1], 2).result()
        biggest = max(args.max_batches)
        sizes = sorted({1, 2, 4, *args.max_batches})
        costs = iteration_costs(model, sizes, context=sum(args.prompt) // 2 + sum(args.output) // 4,
                                prompt=sum(args.prompt) // 2, device=args.device)  # fmt: skip
        # Each system's sustainable throughput, twice its max batch in flight; Orca's at the largest sets the loads.
        capacities = {f"{policy}-{b}": capacity(engines[(policy, b)], 2 * b, args.capacity_seconds, args.prompt,
                                                args.output, model.vocab) for policy, b in systems}  # fmt: skip
        cap = capacities[f"orca-{biggest}"]
        with tqdm(total=len(args.fractions) * len(systems), desc="orca vs request-level", unit="run") as bar:
            for k, fraction in enumerate(args.fractions):
                rate = fraction * cap
                arrivals = workload(rate, args.seconds, args.prompt, args.output, seed=args.seed + k, vocab=model.vocab)
                for policy, b in systems if k % 2 == 0 else list(reversed(systems)):
                    result = drive(engines[(policy, b)], [dict(a) for a in arrivals])
                    lat = sorted(result["latencies"])
                    rows.append({
                        "policy": policy, "max_batch": b, "fraction": fraction, "rate": rate,
                        "requests": len(lat), "failed": result["failed"],
                        "throughput": len(lat) / result["span"] if result["span"] else 0.0,
                        "tokens_per_s": result["tokens"] / result["span"] if result["span"] else 0.0,
                        "median_s": statistics.median(lat) if lat else None,
                        "mean_s": statistics.fmean(lat) if lat else None,
                        "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
                    })  # fmt: skip
                    bar.update(1)
    finally:
        for engine in engines.values():
            engine.close(timeout_s=60)
    return {
        "model": args.model,
        "kv": kv_counts(model, args),
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "capacity": cap,
        "capacities": capacities,
        "iteration_costs": costs,
        "prompt": list(args.prompt),
        "output": list(args.output),
        "seconds": args.seconds,
        "max_batches": args.max_batches,
        "baselines": list(args.baselines),
        "rows": rows,
    }


def _best_within(points: list[dict], median: float) -> float | None:
    """The most answers/s among a curve's loads whose median latency was at most ``median``; None if none."""
    within = [p["throughput"] for p in points if p["median_s"] <= median]
    return max(within) if within else None


def summary(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per baseline, max batch and load: the most Orca served at that median latency or better, ÷ the baseline's.

    No interpolation: a curve past its capacity is not monotone, and a
    measured point is what a claim can stand on.  None where Orca's median
    was above request-level's at every load.
    """
    out = []
    for baseline in data.get("baselines", ["request"]):
        for b in data["max_batches"]:
            orca = [r for r in data["rows"] if r["policy"] == "orca" and r["max_batch"] == b]
            for req in (r for r in data["rows"] if r["policy"] == baseline and r["max_batch"] == b):
                best = _best_within(orca, req["median_s"])
                out.append({"baseline": baseline, "max_batch": b, "fraction": req["fraction"],
                            "median_s": req["median_s"], "request_throughput": req["throughput"],
                            "orca_throughput": best,
                            "ratio": best / req["throughput"] if best and req["throughput"] else None})  # fmt: skip
    return out


def _cost_lines(costs: dict[str, Any] | None) -> list[str]:
    """The iteration-cost table: what one more request in a decode iteration costs."""
    if not costs:
        return []
    one = costs["decode_ms"].get("1") or costs["decode_ms"].get(1)
    rows = [[b, f"{ms:.1f}", f"{ms / int(b):.1f}", f"{ms / one:.2f}×" if one else "-"]
            for b, ms in costs["decode_ms"].items()]  # fmt: skip
    return [
        "## What an iteration costs\n",
        f"Median of 15 iterations, measured in the run: a decode iteration with every request at "
        f"{costs['context']} cached positions, and one request's initiation ({costs['prompt']} prompt tokens, alone): "
        f"{costs['initiation_ms']:.1f} ms.\n",
        markdown_table(["requests in the iteration", "ms", "ms per request", "÷ one request"], rows) + "\n",
    ]


def _kv_lines(kv: dict[str, Any] | None) -> list[str]:
    if not kv:
        return []
    rows = [[name, r["requests"], r["blocks"], r["peak_blocks"], r["preemptions"], r["shared_blocks"]]
            for name, r in kv["rows"].items()]  # fmt: skip
    return [
        "## KV memory, counted\n",
        f"Twelve requests of this run's prompt lengths, {kv['new_tokens']} new tokens each, greedy, all submitted "
        f"at once, needing {kv['blocks_needed']} blocks of {kv['block_size']} positions: once with memory for all "
        f"of them, once with a third of that (the newest running requests are preempted and compute their tokens "
        f"again). Then eight requests repeating one {kv['system_prompt']}-token system prompt (the first alone, "
        f"then seven together), with prefix sharing and with it turned off. Answers equal with scarce memory: "
        f"**{'yes' if kv['scarce_same_answers'] else 'NO'}**; with prefixes shared: "
        f"**{'yes' if kv['shared_same_answers'] else 'NO'}**.\n",
        markdown_table(["run", "requests", "blocks", "peak blocks in use", "preemptions", "blocks shared"], rows)
        + "\n",
    ]


def _where(data: dict[str, Any]) -> str:
    device = data.get("device", "cpu")
    return f"{data['threads']} CPU threads" if device == "cpu" else device


def render(data: dict[str, Any], stem: str) -> str:
    lines = [
        f"# Orca vs request-level and continuous batching, {data.get('model', 'gpt2')} on {_where(data)}\n",
        f"![throughput against median latency]({stem}.png)\n",
        f"Poisson arrivals for {data['seconds']:g} s per run; prompts of {data['prompt'][0]}-{data['prompt'][1]} "
        f"tokens, {data['output'][0]}-{data['output'][1]} new tokens each (uniform). Loads are fractions of Orca's "
        f"capacity at the largest max batch, measured first in the run: {data['capacity']:.2f} answers/s.\n",
        "## Sustainable throughput\n",
        "Answers/s with twice the max batch always in flight (closed loop), measured first in the run:\n",
        markdown_table(["system", "answers/s"], [[k, f"{v:.2f}"] for k, v in data["capacities"].items()]) + "\n",
        *_cost_lines(data.get("iteration_costs")),
        *_kv_lines(data.get("kv")),
        "## Throughput at equal median latency\n",
        "For each baseline point: the most answers/s Orca (same max batch) served at any load of this run with "
        "a median latency no higher, ÷ the baseline's answers/s. Measured points only; '-': Orca's median was "
        "higher at every load. Orca was not pushed past the loads listed, so where its median stayed below at "
        "every load the ratio is what this run shows, not the most it could serve. Baselines: "
        + "; ".join(f"`{b}`, {BASELINES[b]}" for b in data.get("baselines", ["request"]))
        + ".\n",
    ]

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    table = [[s.get("baseline", "request"), s["max_batch"], f"{s['fraction']:.2f}", f"{s['median_s'] * 1e3:.0f}",
              f"{s['request_throughput']:.2f}", num(s["orca_throughput"], ".2f"),
              num(s["ratio"], ".2f") + ("×" if s["ratio"] else "")] for s in data["summary"]]  # fmt: skip
    lines.append(markdown_table(["baseline", "max batch", "load", "baseline median ms", "baseline answers/s",
                                 "Orca answers/s at that median", "Orca ÷ baseline"], table) + "\n")  # fmt: skip
    lines.append("## Every run\n")
    runs = [[r["policy"], r["max_batch"], f"{r['fraction']:.2f}", f"{r['rate']:.2f}", r["requests"], r["failed"],
             f"{r['throughput']:.2f}", f"{r['tokens_per_s']:.1f}", f"{r['median_s'] * 1e3:.0f}",
             f"{r['mean_s'] * 1e3:.0f}", f"{r['p99_s'] * 1e3:.0f}"] for r in data["rows"]]  # fmt: skip
    lines.append(markdown_table(["policy", "max batch", "load", "rate/s", "requests", "failed", "answers/s",
                                 "tokens/s", "median ms", "mean ms", "p99 ms"], runs) + "\n")  # fmt: skip
    lines.append("## How this was measured\n")
    lines.append(provenance_block(data["provenance"]))
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], path: Path) -> None:
    fig, ax = new_figure((6.4, 4.0))
    names = {"orca": "Orca", "request": "request-level, same engine", "generate": "request-level, generate"}
    for b in data["max_batches"]:
        for policy, style in (("orca", "o-"), ("request", "s--"), ("generate", "^:")):
            pts = sorted((r for r in data["rows"] if r["policy"] == policy and r["max_batch"] == b),
                         key=lambda r: r["rate"])  # fmt: skip
            if pts:
                ax.plot([r["median_s"] for r in pts], [r["throughput"] for r in pts], style,
                        label=f"{names[policy]}, max batch {b}")  # fmt: skip
    ax.set_xscale("log")
    save_figure(fig, ax, path, "median latency (s, log)", "throughput (answers/s)",
                "GPT-2: throughput against median latency")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-batches", default="8,16", help="comma-separated max batch sizes")
    parser.add_argument("--fractions", default="0.15,0.3,0.45,0.6,0.75,0.9",
                        help="loads as fractions of Orca's capacity")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=30.0, help="arrivals per run")
    parser.add_argument("--prompt", default="8-128", help="prompt lengths, LOW-HIGH tokens (paper: 32-512)")
    parser.add_argument("--output", default="1-32", help="new tokens per request, LOW-HIGH (paper: 1-128)")
    parser.add_argument("--capacity-seconds", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", default="gpt2", choices=MODELS,
                        help="the catalog's GPT-2 small, its one-layer GPT-2 (the host-bound regime), or its small "
                             "Llama-family model (grouped-query attention)")  # fmt: skip
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="Orca's decode iterations as CUDA graphs (add the eager baseline to compare)",
    )
    parser.add_argument("--baselines", default="request,generate,continuous",
                        help=f"comma-separated, from {', '.join(BASELINES)}")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="loads 0.3 and 0.7, 8 s runs")
    parser.add_argument("--suffix", default="", help="appended to the output files' name (orca_MODEL<suffix>.*)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.fractions, args.seconds, args.capacity_seconds = "0.3,0.7", 8.0, 8.0
    try:
        args.max_batches = sorted({int(b) for b in args.max_batches.split(",")})
        args.fractions = [float(f) for f in args.fractions.split(",")]
        args.prompt, args.output = _range(args.prompt), _range(args.output)
        args.baselines = [b for b in args.baselines.split(",") if b]
        unknown = sorted(set(args.baselines) - set(BASELINES))
        if unknown or not args.baselines:
            raise ValueError(f"baselines must be some of {', '.join(BASELINES)}; got {unknown or 'none'}")
        if min(args.max_batches) < 1 or not all(f > 0 for f in args.fractions):
            raise ValueError("max batches must be ≥ 1 and fractions > 0")
        if args.prompt[1] + args.output[1] > 1024:
            raise ValueError("the longest prompt plus the most new tokens must fit the model's 1024 positions")
    except ValueError as exc:
        parser.error(str(exc))
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: CUDA is not available on this machine (use --device cpu)")
    stem = f"orca_{args.model}{'_cuda' if args.device == 'cuda' else ''}{args.suffix}"
    return run_benchmark("bench.orca", args, measure, summary, lambda d: stem, render, plot)


if __name__ == "__main__":
    sys.exit(main())
