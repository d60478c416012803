"""Where an async handler decodes requests: inline on its event loop, or in a few threads.

Decoding an image request (PIL decode, resize, crop, normalise) costs a few
milliseconds of CPU.  Inline on the event loop, requests are decoded one at
a time, and that thread also competes for the GIL with the engine threads
launching kernels.  So requests reach the engine one by one, at the decode
rate.  On an H100 this capped Ebird at 70 ResNet-50 requests/s, mean batch
1.1 under overload; four decode threads raised it to 93/s, mean batch 2.7
(docs/benchmarks/ebird_direct_resnet50_cuda.md).  PIL's decoder and resampler
and torch's tensor ops release the GIL.  A few decode threads therefore work
in parallel, and several inputs are ready at once for the batch scheduler.

On a CPU the same cores run the batch, and a decode thread takes them from
it; there the default stays inline.  ``decode_threads`` in the archive's
``handler:`` section overrides the default (``packrat archive
--decode-threads N``).  Each decode thread runs torch single-threaded, so it
never starts a second full OpenMP team on the batch's cores.  One such team
made a batch 1.5× slower (``handlers/ebird/engine.py``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from handlers.codecs import ModelInput

CUDA_DECODE_THREADS = 4


def parse_decode_threads(value: Any) -> int | None:
    """An explicit thread count (0 = inline), or None for the device's default ("auto" or absent)."""
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"decode_threads must be an integer ≥ 0 or 'auto', got {value!r}")
    return value


def default_decode_threads(is_cuda: bool) -> int:
    return min(CUDA_DECODE_THREADS, os.cpu_count() or 1) if is_cuda else 0


class RequestDecoder:
    """Awaitable decoding, inline or on a pool; a decode error reaches the caller unchanged."""

    def __init__(self, decode: Callable[[dict[str, Any]], ModelInput], threads: int) -> None:
        self._decode = decode
        self.threads = threads
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="decode", initializer=torch.set_num_threads, initargs=(1,))
            if threads
            else None
        )

    async def __call__(self, row: dict[str, Any]) -> ModelInput:
        if self._pool is None:
            return self._decode(row)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._decode, row)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
