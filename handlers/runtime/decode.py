"""Where an async handler decodes requests: on its CPU lanes, inline on its event loop, or in a few threads.

Decoding an image request (PIL decode, resize, crop, normalise) costs a few
milliseconds of CPU.  Where it runs matters differently per device:

- **CUDA: a few decode threads** (default 4).  Inline on the event loop,
  requests are decoded one at a time, and that thread also competes for the
  GIL with the engine threads launching kernels, so requests reach the engine
  one by one, at the decode rate.  On an H100 this capped Ebird at 70
  ResNet-50 requests/s, mean batch 1.1 under overload; four decode threads
  raised it to 93/s, mean batch 2.7
  (docs/benchmarks/ebird_direct_resnet50_cuda.md).  PIL's decoder and
  resampler and torch's tensor ops release the GIL, so decode threads work
  in parallel.  Each runs torch single-threaded.
- **CPU: on the lanes** (``lane``, the default).  The batch's OpenMP team
  holds every core, and a decode that overlaps a batch stalls the whole team
  (``lanes.py``).  Queued on the lane behind the batches already waiting, a
  request is decoded between two batches with all the lane's threads, and
  is ready for the next one: the order TorchServe's sync worker has, without
  its batch window.  The next batch is formed once the decodes queued ahead
  of it are done (late binding, ``arrivals.py``), so a burst shares it.
- **Inline** (0): on the event loop, one at a time; for tests and comparison.
- **Batched** (``batched``): JPEG bodies decoded in batches by torchvision's
  decoder on one thread of their own, nvJPEG on CUDA
  (``batched_decode.py``); other payloads on the device's default threads.

``decode_threads`` in the archive's ``handler:`` section overrides the
default (``packrat archive --decode-threads N|lane``).  The time a request
waits for its decode slot counts as its ``decode`` stage.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from handlers.codecs import ModelInput
from handlers.runtime.intra_op import use_intra_op_threads
from handlers.runtime.loop_mailbox import LoopMailbox, mailbox_for, wait_for_future

CUDA_DECODE_THREADS = 4
LANE = "lane"
BATCHED = "batched"  # JPEGs in batches by torchvision's decoder (batched_decode.py), the rest on threads

DecodePlacement = int | str  # threads (0 = inline), LANE or BATCHED


def parse_decode_threads(value: Any) -> DecodePlacement | None:
    """An explicit placement (threads, 0 = inline, "lane" or "batched"), or None for the device's default
    ("auto" or absent)."""
    if value is None or value == "auto":
        return None
    if value in (LANE, BATCHED):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"decode_threads must be an integer ≥ 0, 'lane', 'batched' or 'auto', got {value!r}")
    return value


def default_decode_placement(is_cuda: bool) -> DecodePlacement:
    return min(CUDA_DECODE_THREADS, os.cpu_count() or 1) if is_cuda else LANE


Decoded = tuple[ModelInput | None, BaseException | None]  # a row's input, or why it has none
DecodeFn = Callable[[dict[str, Any]], ModelInput]


def _decode_one(decode: Callable[[dict[str, Any]], ModelInput], row: dict[str, Any]) -> Decoded:
    """A row's outcome: its input, or the error its decode raised (that request's 4xx or 503)."""
    try:
        return decode(row), None
    except Exception as exc:
        return None, exc


Submit = Callable[[Callable[[dict[str, Any]], ModelInput], dict[str, Any]], Future]


class RequestDecoder:
    """Awaitable decoding, inline or on other threads; a decode error reaches the caller unchanged.

    ``threads`` > 0 starts a pool of its own; ``submit`` runs decodes on
    someone else's threads (the handler's CPU lanes), which it does not close.
    """

    def __init__(
        self, decode: Callable[[dict[str, Any]], ModelInput], threads: int = 0, submit: Submit | None = None
    ) -> None:
        if threads and submit is not None:
            raise ValueError("decode either on its own threads or through a given submit, not both")
        self._decode = decode
        self.threads = threads
        self._own_pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="decode", initializer=use_intra_op_threads, initargs=(1,))
            if threads
            else None
        )
        self._submit = submit or (self._own_pool.submit if self._own_pool else None)
        # On the lanes, rows waiting for a decode job (``_decode_waiting``), with where their outcomes go.
        self._waiting: list[tuple[list[tuple[DecodeFn, dict[str, Any]]], Callable[[list[Decoded]], None]]] = []
        self._waiting_lock = threading.Lock()

    @property
    def decode(self) -> Callable[[dict[str, Any]], ModelInput]:
        """The function that decodes a row (an engine that takes rows undecoded calls it on its lane)."""
        return self._decode

    @property
    def on_lanes(self) -> bool:
        """Decoding through someone else's ``submit`` (the CPU lanes), ahead of the batches queued after it."""
        return self._own_pool is None and self._submit is not None

    @property
    def where(self) -> str:
        if self._own_pool is not None:
            return f"on {self.threads} decode threads"
        return "on the CPU lanes" if self.on_lanes else "on the event loop"

    async def __call__(
        self, row: dict[str, Any], decode: Callable[[dict[str, Any]], ModelInput] | None = None
    ) -> ModelInput:
        """``row`` decoded by the decoder's function, or by ``decode`` (one of several models' codecs)."""
        decode = decode or self._decode
        if self._submit is None:
            return decode(row)
        if not self.on_lanes:
            return await wait_for_future(self._submit(decode, row))
        decoded: asyncio.Future[ModelInput] = asyncio.get_running_loop().create_future()

        def deliver(outcomes: list[Decoded]) -> None:
            [(item, error)] = outcomes
            if decoded.cancelled():
                return
            if error is not None:
                decoded.set_exception(error)
            else:
                decoded.set_result(item)

        self._queue_on_lanes([(decode, row)], deliver)
        return await decoded

    def decode_burst(
        self,
        rows: list[dict[str, Any]],
        deliver: Callable[[int, list[Decoded]], None],
        decodes: list[DecodeFn | None] | None = None,
    ) -> None:
        """Decode ``rows`` without a coroutine or future per row: ``deliver(first, outcomes)`` runs on the
        event loop with ``(item, error)`` for ``rows[first:first + len(outcomes)]``, once per part.
        ``decodes``: each row's decode function (None: the decoder's own), for a handler serving
        several models.

        Inline, the one part is delivered before this returns.  On the lanes,
        the burst is one entry of the shared decode job (one lane job and one
        loop wake-up for everything waiting); on decode threads, it is split
        into one part per thread, each delivered when its thread is done.
        Called on the event loop.
        """
        pairs = [(decode or self._decode, row) for decode, row in zip(decodes or [None] * len(rows), rows, strict=True)]
        if self._submit is None:
            deliver(0, [_decode_one(decode, row) for decode, row in pairs])
            return
        if self.on_lanes:
            self._queue_on_lanes(pairs, lambda outcomes: deliver(0, outcomes))
            return
        mailbox = mailbox_for(asyncio.get_running_loop())
        step = -(-len(pairs) // max(1, min(self.threads, len(pairs))))
        for first in range(0, len(pairs), step):
            part = pairs[first : first + step]

            def job(part: list[tuple[DecodeFn, dict[str, Any]]] = part, first: int = first) -> None:
                outcomes = [_decode_one(decode, row) for decode, row in part]
                mailbox.post(lambda: deliver(first, outcomes))

            try:
                self._submit(job)
            except Exception as exc:  # the pool is shut down: this part fails now
                deliver(first, [(None, exc)] * len(part))

    def _queue_on_lanes(
        self, pairs: list[tuple[DecodeFn, dict[str, Any]]], deliver: Callable[[list[Decoded]], None]
    ) -> None:
        """Add ``pairs`` (decode function, row) to the decode job queued on the lanes, queueing one if none
        is (called on the loop)."""
        loop = asyncio.get_running_loop()
        with self._waiting_lock:
            self._waiting.append((pairs, deliver))
            first = len(self._waiting) == 1
        if not first:  # a decode job is queued on the lanes already, and takes these rows too
            return
        try:
            self._submit(self._decode_waiting, mailbox_for(loop))
        except Exception as exc:  # lanes closed: everything waiting for this job fails now
            with self._waiting_lock:
                waiting, self._waiting = self._waiting, []
            for pending_pairs, pending_deliver in waiting:
                pending_deliver([(None, exc)] * len(pending_pairs))

    def _decode_waiting(self, mailbox: LoopMailbox) -> None:
        """A lane job: decode every request waiting when it starts, and hand all of them to the loop at once.

        One lane job and one loop wake-up per burst of requests, not per
        request: on a model whose batch is short, the per-request hand-offs
        between the event loop and the lane were what the lane spent its
        time on (``docs/benchmarks/host_path.md``).
        """
        with self._waiting_lock:
            waiting, self._waiting = self._waiting, []
        done = [(deliver, [_decode_one(decode, row) for decode, row in pairs]) for pairs, deliver in waiting]

        def deliver_all() -> None:
            for deliver, outcomes in done:
                deliver(outcomes)

        mailbox.post(deliver_all)

    def close(self) -> None:
        if self._own_pool is not None:
            self._own_pool.shutdown(wait=True)
