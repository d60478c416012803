"""Does ``torch.compile(mode="reduce-overhead")`` fault beside Nimble's captured graphs in one process?

    python -m bench.nimble_compile_fault --device cuda --model resnet50 --out-dir /tmp/fault

On the lent H200 (2026-11-26, torch 2.11) the two faulted when they shared
a process ("unspecified launch failure" at batch 32, after torch.compile had
compiled for batches 1 and 8), while each ran clean alone; ``bench/nimble.py``
has since timed torch.compile in a child process.  This script is the
reproduction attempt, kept small: Nimble's candidates built and captured,
the eager model compiled in reduce-overhead mode, then at each batch size
both run, compared with eager and synchronised after every call, so that a
fault is pinned to the call that raised it.  It stops at the first fault
(a faulted CUDA context answers nothing more) and writes what ran to
``nimble_compile_fault_<device>.json``: the same order clean is evidence the
fault is gone on that PyTorch; a fault here is the reproduction.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(model_name: str, device: str, batches: list[int]) -> dict:
    import torch

    from handlers.nimble.config import NimbleConfig
    from handlers.nimble.program import build_candidates, reproduces
    from handlers.runtime.segments import batch_rows
    from model_store.catalog import get_spec
    from model_store.factory import build_model, example_inputs

    spec = get_spec(model_name)
    model = build_model(spec).to(device)
    example = tuple(x.to(device) for x in example_inputs(spec, 1))
    candidates = build_candidates(model, example, NimbleConfig(buckets=tuple(batches), timing_runs=2))
    compiled = torch.compile(model, mode="reduce-overhead" if device == "cuda" else None)
    programs = {"torch.compile": compiled, **{k: v for k, v in candidates.programs.items() if v is not None}}
    calls: list[dict] = []
    fault = None
    try:
        for batch in batches:
            inputs = batch_rows(example, batch)
            with torch.inference_mode():
                expected = model(*inputs)
            for round_ in range(2):  # twice: the compiler's graph trees record, then replay
                for name, program in programs.items():
                    started = time.perf_counter()
                    try:
                        with torch.inference_mode():
                            out = program(*inputs)
                            if device == "cuda":
                                torch.cuda.synchronize()
                            ok = bool(reproduces(out, expected))
                    except Exception as exc:
                        fault = {"batch": batch, "round": round_, "program": name,
                                 "error": f"{type(exc).__name__}: {str(exc)[:400]}"}  # fmt: skip
                        return {"calls": calls, "fault": fault}
                    calls.append({"batch": batch, "round": round_, "program": name, "equal_to_eager": ok,
                                  "ms": round(1e3 * (time.perf_counter() - started), 2)})  # fmt: skip
    finally:
        if fault is None:
            candidates.close()
    return {"calls": calls, "fault": fault}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    result = run(args.model, args.device, [int(b) for b in args.batches.split(",")])
    result.update(model=args.model, device=args.device, torch=torch.__version__, python=platform.python_version(),
                  gpu=torch.cuda.get_device_name() if args.device == "cuda" else None)  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"nimble_compile_fault_{args.device}.json").write_text(json.dumps(result, indent=1))
    for call in result["calls"]:
        print(f"batch {call['batch']:>3} round {call['round']} {call['program']:<14} "
              f"equal={call['equal_to_eager']} {call['ms']} ms")  # fmt: skip
    print("FAULT:", result["fault"] if result["fault"] else "none: every call ran and was checked")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
