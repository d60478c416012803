"""What a worker spends on each request besides the model, measured for the profile.

A profile point times the forward pass alone.  A TorchServe worker also
decodes every request of a batch (JPEG → tensor, JSON → token ids), stacks
them, and encodes every answer, one request after another on the worker's
main thread, before and after the model runs.  For a batch of ``b`` that is
``b · h`` on top of ``L[t][b]``: small beside the model at batch 1, but it
is exactly what separates the fat instance ⟨1, T, B⟩ (which pays ``B · h``
per round) from a plan of several smaller instances (each paying its own
``b · h`` in parallel), so leaving it out makes the optimizer under-predict
its own gain (docs/benchmarks/packrat_e2e_resnet50.md, before this).

``measure_handler_cost`` runs the serving handler's own ``preprocess`` and
``postprocess`` (``handlers.plain_handler.PlainModelHandler``) on real client
payloads, in a fresh process pinned to ``t`` cores with ``t`` intra-op
threads, like a profile point, and returns the mean per request.  The model
runs once, untimed, only to give ``postprocess`` real output rows.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from model_store.catalog import ModelSpec
from packrat_plugin.measure import receive


def _child(spec_dict: dict, artefact: str, threads: int, cores: tuple[int, ...], requests: int, batch: int,
           results: mp.Queue) -> None:  # fmt: skip
    try:
        os.sched_setaffinity(0, cores)
        import torch

        torch.set_num_threads(threads)
        from handlers.codecs import DEFAULT_MAX_PAYLOAD_BYTES, InputCodec, collate
        from handlers.plain_handler import PlainModelHandler
        from handlers.runtime.model_loading import load_model
        from model_store.samples import client_payload

        spec = ModelSpec.from_dict(spec_dict)
        handler = PlainModelHandler()
        handler.spec = spec
        handler.codec = InputCodec(spec, DEFAULT_MAX_PAYLOAD_BYTES)
        # TorchServe hands JSON bodies already parsed, anything else as bytes.
        rows = [{"body": client_payload(spec, seed=i)} for i in range(batch)]
        model = load_model(spec, artefact)
        with torch.inference_mode():
            logits = model(*collate(handler.preprocess(rows).inputs))
        # Warm up: lazy imports (PIL, transforms) and first-call allocations.
        for _ in range(2):
            handler.postprocess(logits)
            collate(handler.preprocess(rows).inputs)
        spent_s, done = 0.0, 0
        while done < requests:
            started = time.perf_counter()
            pre = handler.preprocess(rows)
            if len(pre.inputs) != batch:
                raise RuntimeError(f"client payloads were refused: {pre.errors}")
            collate(pre.inputs)
            handler.postprocess(logits)
            spent_s += time.perf_counter() - started
            done += batch
        results.put(("cost", spent_s * 1000.0 / done))
    except BaseException as exc:  # report, don't hang the parent
        results.put(("error", f"{type(exc).__name__}: {exc}"))


def measure_handler_cost(
    spec: ModelSpec, artefact: str, threads: int, cores: tuple[int, ...], requests: int = 32, batch: int = 4,
    timeout_s: float = 600.0,
) -> float:  # fmt: skip
    """Mean handler ms per request at ``threads`` on ``cores``, in a fresh pinned process."""
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(spec.to_dict(), artefact, threads, cores, requests, batch, results),
                       daemon=True)  # fmt: skip
    proc.start()
    try:
        return float(receive(results, proc, timeout_s, f"measuring the handler's cost on cores {cores}"))
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
