"""Which of DVABatch's length classes merge by their stage times alone, measured on this machine.

    python -m bench.dvabatch_merge --models bert-tiny1,bert-base --rounds 3

DVABatch pads length classes to a longer class where, for one full batch of
the recent mix of lengths, one padded batch costs less than the classes'
own (``handlers/dvabatch/merge.py``).  A batch's cost there has two parts:
its stages' times, from the profile the worker measures at start, and what
a run costs its lane besides the stage, learnt in service
(``handlers/dvabatch/overhead.py``).  This bench shows the first part and
the decision it alone makes, the one a worker takes before its first
batches: for each model it slices the model into the handler's two stages,
measures every class's profile together as the worker does
(``measure_classes``, ``PROFILE_MIN_MS``, one intra-op thread, a lane's
share of a 2-core machine; 1, half and all of ``--max-batch`` rows; here
through the eager stages, where the worker times its traced ones), and for
a set of mixes (rows per class in one batch, shortest class first) prints
where each class's rows run and the profile's time for the mix decided so
against each class in its own batch.  Each round measures the profiles
again, so a decision that flips between rounds is one the noise decides.
The classes are ``bench/dvabatch.py``'s (an eighth, a quarter and half of
the sequence length, and all of it); the last mix is that bench's.

A tool for reading the decision, not a serving benchmark: what merging does
to capacity and latency is ``bench.ebird_direct --handler dvabatch``'s.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.dvabatch import dvabatch_token_lengths
from bench.report import add_output_arguments, markdown_table, provenance, provenance_block, write_outputs
from handlers.dvabatch.handler import PROFILE_MIN_MS
from handlers.dvabatch.merge import batches_ms, merge_classes
from handlers.runtime.segment_profile import measure_classes
from handlers.runtime.segments import dynamic_dims_for, slice_model
from model_store.catalog import get_spec
from model_store.factory import build_model

MODULE = "bench.dvabatch_merge"
# Rows per class in one batch, shortest class first: lone rows, light mixes, and bench/dvabatch.py's mix
# (30/35/25/10 %) at 32 rows.
HAND_OVERS = ((1, 0, 1, 0), (1, 1, 1, 1), (3, 3, 2, 1), (10, 11, 8, 3))


def rows_for(length: int) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """A batch of ``rows`` token inputs of ``length``, as the profile measures them."""
    return lambda rows: (torch.zeros(rows, length, dtype=torch.long), torch.ones(rows, length, dtype=torch.long))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    results: dict[str, Any] = {"max_batch": args.max_batch, "models": {}}
    for name in args.models.split(","):
        spec = get_spec(name, "eager")
        if spec.input_kind != "tokens":
            raise SystemExit(f"{name} takes images: length classes are for token models")
        model = build_model(spec).eval()
        lengths = [*dvabatch_token_lengths(spec, "auto"), spec.seq_len]

        sliced = slice_model(model, rows_for(spec.seq_len)(2), 2, dynamic_dims_for("tokens"), repeats=1)
        sizes = sorted({1, max(1, args.max_batch // 2), args.max_batch})
        rounds = []
        for _ in tqdm(range(args.rounds), desc=name, unit="round"):
            profiles = measure_classes(
                sliced, [rows_for(n) for n in lengths], sizes, name, warmup=1, iters=2, command=MODULE,
                progress=False, min_ms=PROFILE_MIN_MS,
            )  # fmt: skip

            def rows_ms(j: int, rows: int, profiles=profiles) -> float:
                return batches_ms(functools.partial(profiles[j].remaining_ms, 0), rows, args.max_batch)

            decisions = []
            for counts in HAND_OVERS:
                target = merge_classes(counts, rows_ms)
                merged: dict[int, int] = {}
                for i, n in enumerate(counts):
                    if n:
                        merged[target[i]] = merged.get(target[i], 0) + n
                decisions.append(
                    {
                        "counts": list(counts),
                        "runs_in": [lengths[t] for t in target],
                        "merged_ms": sum(rows_ms(j, n) for j, n in merged.items()),
                        "apart_ms": sum(rows_ms(j, n) for j, n in enumerate(counts) if n),
                    }
                )
            batch_ms = {
                str(length): [round(p.remaining_ms(0, size), 3) for size in sizes]
                for length, p in zip(lengths, profiles, strict=True)
            }
            rounds.append({"batch_ms": batch_ms, "decisions": decisions})
        results["models"][name] = {"lengths": lengths, "sizes": sizes, "rounds": rounds}
    return results


def render(data: dict[str, Any]) -> str:
    parts = [
        f"# Where DVABatch's length classes run, by measured stage times\n\n{provenance_block(data['provenance'])}\n"
        "Each row one batch's mix (rows per length class, shortest first): the class each class's rows run in, "
        "and the profile's time for the mix as decided against every class in its own batch, round by "
        "round (each round measures the profiles again). What is measured and why: `bench/dvabatch_merge.py`.\n"
    ]
    for name, model in data["models"].items():
        lengths, sizes = model["lengths"], model["sizes"]
        header = ["round", *(f"{n} tokens: ms at {', '.join(map(str, sizes))} rows" for n in lengths)]
        profile_rows = [
            [i + 1, *(", ".join(f"{t:.2f}" for t in r["batch_ms"][str(n)]) for n in lengths)]
            for i, r in enumerate(model["rounds"])
        ]
        rows = []
        for k, first in enumerate(model["rounds"][0]["decisions"]):
            for i, r in enumerate(model["rounds"]):
                d = r["decisions"][k]
                rows.append(
                    [
                        " / ".join(map(str, first["counts"])) if i == 0 else "",
                        i + 1,
                        " / ".join(str(t) if c else "–" for t, c in zip(d["runs_in"], d["counts"], strict=True)),
                        f"{d['merged_ms']:.2f}",
                        f"{d['apart_ms']:.2f}",
                    ]
                )
        parts.append(
            f"## {name} (classes {', '.join(map(str, lengths))} tokens; largest batch {data['max_batch']})\n\n"
            "Each class's batch through both stages (ms):\n\n"
            + markdown_table(header, profile_rows)
            + "\n\n"
            + markdown_table(["rows per class", "round", "runs in (tokens)", "decided, ms", "apart, ms"], rows)
            + "\n"
        )
    return "\n".join(parts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert-tiny1,bert-base", help="comma-separated token models")
    parser.add_argument("--rounds", type=int, default=3, help="profiles measured again each round")
    parser.add_argument("--max-batch", type=int, default=16, help="DVABatch's max_batch (its default 16)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.max_batch < 2:
        parser.error("--rounds must be ≥ 1 and --max-batch ≥ 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prov = provenance(MODULE)
    data = measure(args)
    data["provenance"] = prov
    markdown = render(data)
    path = write_outputs(f"dvabatch_merge_{prov['date'][:10]}", markdown, data, args.out_dir)
    if args.json:
        args.json.write_text((path.with_suffix(".json")).read_text())
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
