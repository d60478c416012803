"""The batched JPEG decoder on CUDA (nvJPEG), alone and behind Ebird; skipped without CUDA."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from handlers.runtime.batched_decode import BatchedJpegDecoder
from handlers.runtime.decode import RequestDecoder
from model_store.factory import outputs_close
from model_store.samples import jpeg_bytes
from tests.unit.test_batched_decode import CODEC, decode_all, pixels_reference, png_bytes
from tests.unit.test_ebird_handler import make_handler, model_dir, serve_all  # noqa: F401 (fixtures are used by name)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_on_cuda_jpegs_are_decoded_in_batches_on_the_device_near_the_cpu_decoders_pixels():
    decoder = BatchedJpegDecoder(CODEC, torch.device("cuda", 0), RequestDecoder(CODEC.decode, threads=2))
    try:
        raws = [jpeg_bytes(seed=i) for i in range(24)]
        cut = jpeg_bytes(seed=30)[:3000]  # nvJPEG alone decodes this without an error
        got = decode_all(decoder, [{"body": raw} for raw in raws] + [{"body": cut}, {"body": b"\xff\xd8\xff broken"}])
        for refused in got[-2:]:
            assert type(refused).__name__ == "RequestError" and refused.status == 415, refused
        assert max(decoder.batch_sizes) > 1, decoder.batch_sizes
        for item in got[:-2]:
            (image,) = item.tensors
            assert image.device.type == "cuda" and image.shape == (3, 224, 224)
        # nvJPEG's chroma upsampling is not libjpeg's: on these noise images, whose colour changes from pixel
        # to pixel, the mean difference was 0.15 normalised on the lent H200.  On images whose colour varies
        # as a photograph's does, the two decoders agree.
        smooth = [smooth_jpeg_bytes(seed=i) for i in range(8)]
        for raw, item in zip(smooth, decode_all(decoder, [{"body": raw} for raw in smooth]), strict=True):
            assert (item.tensors[0].cpu() - pixels_reference(raw)).abs().mean() < 0.05
    finally:
        decoder.close()


def smooth_jpeg_bytes(seed: int, size: tuple[int, int] = (320, 240)) -> bytes:
    """A JPEG whose colours vary smoothly: a random 6x6 image enlarged (bicubic) to ``size``."""
    gen = torch.Generator().manual_seed(seed)
    small = torch.randint(0, 256, (6, 6, 3), generator=gen, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(small).resize(size, Image.BICUBIC).save(buf, "JPEG", quality=90)
    return buf.getvalue()


@needs_cuda
def test_on_cuda_ebird_copies_device_decoded_inputs_into_its_pool_and_answers_them(make_handler):
    handler, ctx = make_handler("cuda", decode_threads="batched", worker_batches=[1, 1, 2, 4], pool_slots=8)
    assert isinstance(handler.decoder, BatchedJpegDecoder)
    rows = [{"body": jpeg_bytes(seed=i)} for i in range(12)] + [{"body": png_bytes(3)}]
    answers = serve_all(handler, ctx, rows)
    assert [status for status, _ in answers] == [200] * len(rows)
    decoded = [item.tensors[0] for item in decode_all(handler.decoder, rows[:12])]
    with torch.inference_mode():
        expected = handler.model(torch.stack(decoded)).cpu()
    for (_, body), row in zip(answers[:12], expected, strict=True):
        assert outputs_close(torch.tensor(body["logits"]), row, 1e-2)  # TF32 kernels
