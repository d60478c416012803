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
A JPEG whose data stops before its end-of-image marker never enters a
batch: on the lent H200 nvJPEG decoded such a truncated file without an
error (the missing rows filled in) where libjpeg refuses it, so the check
is made here, from the bytes, the same on either device.
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
from handlers.runtime.intra_op import use_intra_op_threads

DEFAULT_MAX_BATCH = 32


class JpegBatchDecode:
    """JPEG bodies decoded together, synchronously: one decoder call for the lot, halved down to the images it
    cannot read, which the codec answers alone.  The work of :class:`BatchedJpegDecoder`'s thread, and of the
    plain handler's ``preprocess`` with ``decode_threads: batched`` (its frontend batch decoded in one call)."""

    def __init__(self, codec: InputCodec, device: torch.device, on_batch: Callable[[int], None] | None = None) -> None:
        """``on_batch``: told the size of each decoder call (the handler's ``HandlerDecodeBatches`` metric)."""
        self.codec, self.device, self.on_batch = codec, torch.device(device), on_batch
        self.batch_sizes: collections.Counter[int] = collections.Counter()  # images per decoder call
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def __call__(self, raws: list[bytes]) -> list[ModelInput | Exception]:
        """Each body's input, or the exception the codec raised for it (its ``RequestError``: a 4xx)."""
        answers: list[ModelInput | Exception | None] = [None] * len(raws)
        fits = []
        for index, raw in enumerate(raws):
            if _within_pixel_limit(raw) and _ends_its_image(raw):
                fits.append(index)
            else:
                answers[index] = self._decode_alone(raw)
        if fits:
            self._decode_halving(raws, fits, answers)
        return answers  # type: ignore[return-value]  # every slot is filled above

    def _decode_halving(self, raws: list[bytes], fits: list[int], answers: list) -> None:
        """Decode ``fits`` in one call; if an image it cannot read fails the call, each half again, down to
        the image alone, which the codec answers (its 4xx says what is wrong).  An unreadable JPEG among 32 costs
        about ten calls, and the good images keep the batch decoder's pixels and mostly its batches."""
        try:
            images = self._decode_many([raws[i] for i in fits])
        except Exception:
            if len(fits) == 1:
                answers[fits[0]] = self._decode_alone(raws[fits[0]])
                return
            half = len(fits) // 2
            self._decode_halving(raws, fits[:half], answers)
            self._decode_halving(raws, fits[half:], answers)
            return
        self.batch_sizes[len(fits)] += 1
        if self.on_batch is not None:
            self.on_batch(len(fits))
        for index, image in zip(fits, images, strict=True):
            answers[index] = ModelInput((image,))

    def _decode_many(self, raws: list[bytes]) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg

        data = [torch.frombuffer(bytearray(raw), dtype=torch.uint8) for raw in raws]
        if self._stream is None:
            return [self.codec.image_from_pixels(p) for p in decode_jpeg(data, mode=ImageReadMode.RGB)]
        with torch.cuda.stream(self._stream):
            pixels = decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
            images = [self.codec.image_from_pixels(p) for p in pixels]
        # The images are handed to other threads' streams (the input pool's copy stream, the model's): they
        # must be complete before anyone reads them, and the decoding thread waits, not the event loop.
        self._stream.synchronize()
        return images

    def _decode_alone(self, raw: bytes) -> ModelInput | Exception:
        """One image through the codec's own decode (PIL): its answer, or its 4xx."""
        try:
            return self.codec.decode({"body": raw})
        except Exception as exc:  # the codec's RequestError reaches the caller unchanged
            return exc


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
        self.decode = JpegBatchDecode(codec, self.device, on_batch)
        self.threads = fallback.threads
        self._pending: collections.deque[tuple[bytes, Future]] = collections.deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="jpeg-batch", daemon=True)
        self._thread.start()

    @property
    def batch_sizes(self) -> collections.Counter[int]:
        """Images per decoder call so far."""
        return self.decode.batch_sizes

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
        use_intra_op_threads(1)
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if not self._pending:
                    return
                batch = [self._pending.popleft() for _ in range(min(self.max_batch, len(self._pending)))]
            for (_, done), answer in zip(batch, self.decode([raw for raw, _ in batch]), strict=True):
                if isinstance(answer, Exception):
                    done.set_exception(answer)
                else:
                    done.set_result(answer)

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


_SOI, _EOI, _SOS = b"\xff\xd8", b"\xff\xd9", 0xDA
_STANDALONE = {0x01, *range(0xD0, 0xD8)}  # TEM and the restart markers carry no length


def _ends_its_image(raw: bytes) -> bool:
    """Whether the JPEG's scan data is followed by an end-of-image marker: the header's segments are skipped
    by their lengths (an EXIF thumbnail's own end marker sits inside one), and inside entropy-coded data a
    0xFF byte is always stuffed or a restart marker, so ``FF D9`` after the first scan can only be the end.
    False for a file cut short, which then goes to the codec alone and gets its 4xx."""
    if not raw.startswith(_SOI):
        return False
    at = len(_SOI)
    while at + 4 <= len(raw):
        if raw[at] != 0xFF:
            return False
        marker = raw[at + 1]
        if marker == 0xFF:  # fill byte before a marker
            at += 1
        elif marker in _STANDALONE:
            at += 2
        elif marker == _SOS:
            return raw.find(_EOI, at) != -1
        else:
            at += 2 + int.from_bytes(raw[at + 2 : at + 4], "big")
    return False
