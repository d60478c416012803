"""JPEG requests decoded in batches by torchvision's decoder (nvJPEG on CUDA), on one thread of their own.

Why: on a GPU, Ebird's capacity is set by its per-request host path, not by
the model.  On the lent H200 it served 130 ResNet-50 requests/s against 191
for stock batching, and its counters put the time in decoding (553 ms of
queueing per request at 85 % load) with the batch stage at 5 ms.  On the
lent H100 the ways to turn JPEGs into ResNet-50's input measured, from 512
JPEGs (``docs/benchmarks/jpeg_decode_cuda.md``): PIL on 4 threads (Ebird's
CUDA default) 800 images/s; torchvision's decoder on 8 CPU threads 1,673;
nvJPEG on batches of 32 from one thread 3,826, its answer already on the
device.  So this decoder takes what arrives while it is busy (up to
``max_batch``, no waiting window: the batch is whatever queued behind the
last one, as NO Wait batches) and decodes it with one call.

Placement ``decode_threads: batched`` in the archive's ``handler:`` section.
Only JPEG bodies of an image model take this path; PNG, JSON and Open
Inference Protocol requests go to the codec's own decode on ``fallback``.

What differs from the PIL path, and is said so: the resize is torchvision's
antialiased bilinear on tensors (under 0.02 in normalised units from PIL's),
and nvJPEG's chroma upsampling is not libjpeg's, so on CUDA single pixels
can differ much more (up to 1.59 normalised on noise images in that run).
An image the batch call cannot decode (corrupt, CMYK, over the pixel limit)
is answered through the codec's own decode, alone: a good image is never
refused because a batch-mate was bad, and a bad one gets the codec's 4xx.
"""

from __future__ import annotations

import asyncio
import collections
import io
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from handlers.codecs import MAX_IMAGE_PIXELS, InputCodec, ModelInput
from handlers.runtime.decode import RequestDecoder

DEFAULT_MAX_BATCH = 32


class BatchedJpegDecoder:
    """Awaitable decoding, as :class:`RequestDecoder`; JPEGs in batches on one thread, the rest on ``fallback``."""

    def __init__(
        self,
        codec: InputCodec,
        device: torch.device,
        fallback: RequestDecoder,
        max_batch: int = DEFAULT_MAX_BATCH,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        """``on_batch``: told the size of each decoder call (the handler's ``HandlerDecodeBatches`` metric)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be ≥ 1, got {max_batch}")
        self.codec, self.device, self.fallback, self.max_batch = codec, torch.device(device), fallback, max_batch
        self.on_batch = on_batch
        self.threads = fallback.threads
        self.batch_sizes: collections.Counter[int] = collections.Counter()  # images per decoder call
        self._pending: collections.deque[tuple[bytes, Future]] = collections.deque()
        self._wake = threading.Condition()
        self._closed = False
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, name="jpeg-batch", daemon=True)
        self._thread.start()

    @property
    def on_lanes(self) -> bool:
        return False

    @property
    def where(self) -> str:
        return (
            f"JPEGs in batches of up to {self.max_batch} by torchvision's decoder on {self.device}, "
            f"other payloads {self.fallback.where}"
        )

    async def __call__(self, row: dict[str, Any], decode: Any = None) -> ModelInput:
        if decode is not None:  # another model's codec (a handler serving several): not this codec's pipeline
            return await self.fallback(row, decode)
        raw = self.codec.jpeg_payload(row)
        if raw is None:
            return await self.fallback(row)
        done: Future = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the JPEG decoder is closed")
            self._pending.append((raw, done))
            self._wake.notify()
        return await asyncio.wrap_future(done)

    def _run(self) -> None:
        torch.set_num_threads(1)
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if not self._pending:
                    return
                batch = [self._pending.popleft() for _ in range(min(self.max_batch, len(self._pending)))]
            self._decode_batch(batch)

    def _decode_batch(self, batch: list[tuple[bytes, Future]]) -> None:
        fits: list[tuple[bytes, Future]] = []
        for raw, done in batch:
            if _within_pixel_limit(raw):
                fits.append((raw, done))
            else:
                self._decode_alone(raw, done)
        if fits:
            self._decode_halving(fits)

    def _decode_halving(self, fits: list[tuple[bytes, Future]]) -> None:
        """Decode ``fits`` in one call; if an image it cannot read fails the call, each half again, down to
        the image alone, which the codec answers (its 4xx says what is wrong).  A truncated JPEG among 32 costs
        about ten calls, and the good images keep the batch decoder's pixels and mostly its batches."""
        try:
            images = self._decode_many([raw for raw, _ in fits])
        except Exception:
            if len(fits) == 1:
                self._decode_alone(*fits[0])
                return
            half = len(fits) // 2
            self._decode_halving(fits[:half])
            self._decode_halving(fits[half:])
            return
        self.batch_sizes[len(fits)] += 1
        if self.on_batch is not None:
            self.on_batch(len(fits))
        for (_, done), image in zip(fits, images, strict=True):
            done.set_result(ModelInput((image,)))

    def _decode_many(self, raws: list[bytes]) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg

        data = [torch.frombuffer(bytearray(raw), dtype=torch.uint8) for raw in raws]
        if self._stream is None:
            return [self.codec.image_from_pixels(p) for p in decode_jpeg(data, mode=ImageReadMode.RGB)]
        with torch.cuda.stream(self._stream):
            pixels = decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
            images = [self.codec.image_from_pixels(p) for p in pixels]
        # The images are handed to other threads' streams (the input pool's copy stream): they must be
        # complete before anyone reads them, and this thread waits, not the event loop.
        self._stream.synchronize()
        return images

    def _decode_alone(self, raw: bytes, done: Future) -> None:
        """One image through the codec's own decode (PIL): its answer, or its 4xx."""
        try:
            done.set_result(self.codec.decode({"body": raw}))
        except Exception as exc:  # the codec's RequestError reaches the caller unchanged
            done.set_exception(exc)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout=30.0)
        self.fallback.close()


def _within_pixel_limit(raw: bytes) -> bool:
    """Whether the JPEG's header names a size the codec accepts (read without decoding); False when
    the header cannot be read, so that the codec's own decode answers it."""
    from PIL import Image

    try:
        width, height = Image.open(io.BytesIO(raw)).size
    except Exception:
        return False
    return width * height <= MAX_IMAGE_PIXELS
