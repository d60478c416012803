"""The batched JPEG decoder (handlers/runtime/batched_decode.py) on its own, and behind Ebird.

On CPU torchvision's decoder is libjpeg-turbo, as PIL's is, so the only difference from the codec's PIL path is
the resize; on CUDA (tests/gpu) nvJPEG decodes."""

from __future__ import annotations

import asyncio
import io
import json
from concurrent.futures import Future

import pytest
import torch
from PIL import Image

from handlers.codecs import InputCodec
from handlers.errors import RequestError
from handlers.runtime.batched_decode import BatchedJpegDecoder
from handlers.runtime.decode import BATCHED, RequestDecoder, parse_decode_threads
from model_store.catalog import get_spec
from model_store.factory import outputs_close
from model_store.samples import image_tensor_json, jpeg_bytes
from tests.payloads import batched_jpeg_input, reference_logits
from tests.unit.test_ebird_handler import SPEC, make_handler, model_dir, serve_all  # noqa: F401 (fixtures)

CODEC = InputCodec(get_spec("resnet50", "eager"))


def png_bytes(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise((300, 260), 40 + seed).convert("RGB").save(buf, "PNG")
    return buf.getvalue()


def decode_all(decoder, rows):
    async def main():
        return await asyncio.gather(*(decoder(row) for row in rows), return_exceptions=True)

    return asyncio.run(main())


def pixels_reference(raw: bytes) -> torch.Tensor:
    return batched_jpeg_input(CODEC.spec, raw)


@pytest.fixture
def decoder():
    made = BatchedJpegDecoder(CODEC, torch.device("cpu"), RequestDecoder(CODEC.decode, threads=2))
    yield made
    made.close()


def test_batched_is_a_placement_an_archive_can_name():
    assert parse_decode_threads("batched") == BATCHED
    with pytest.raises(ValueError, match="'batched'"):
        parse_decode_threads("nvjpeg")


@pytest.mark.slow
def test_jpegs_that_arrive_together_are_decoded_in_one_call_and_match_the_pil_path(decoder):
    raws = [jpeg_bytes(seed=i) for i in range(24)]
    got = decode_all(decoder, [{"body": raw} for raw in raws])
    assert sum(decoder.batch_sizes.values()) < len(raws) and max(decoder.batch_sizes) > 1, decoder.batch_sizes
    assert sum(size * n for size, n in decoder.batch_sizes.items()) == len(raws)
    for raw, item in zip(raws, got, strict=True):
        (image,) = item.tensors
        assert torch.equal(image, pixels_reference(raw))
        # The same pipeline as PIL's up to the resampler.
        assert (image - CODEC.decode({"body": raw}).tensors[0]).abs().max() < 0.02


def test_other_payloads_and_bad_images_are_answered_alone_by_the_codec(decoder):
    big = io.BytesIO()
    Image.new("RGB", (8000, 6000)).save(big, "JPEG", quality=10)  # 48 MP: over the codec's pixel limit
    rows = [
        {"body": jpeg_bytes(seed=1)},
        {"body": b"\xff\xd8\xff\xe0 not a jpeg after its magic"},
        {"body": png_bytes(2)},
        {"body": image_tensor_json(CODEC.spec, seed=3)},
        {"body": big.getvalue()},
        {"body": jpeg_bytes(seed=4)},
        {"body": b"{not json"},
    ]
    got = decode_all(decoder, rows)
    assert [type(g).__name__ for g in got] == [
        "ModelInput", "RequestError", "ModelInput", "ModelInput", "RequestError", "ModelInput", "RequestError"
    ]  # fmt: skip
    assert [g.status for g in got if isinstance(g, RequestError)] == [415, 413, 400]
    assert torch.equal(got[0].tensors[0], pixels_reference(rows[0]["body"]))
    assert torch.equal(got[5].tensors[0], pixels_reference(rows[5]["body"]))
    for i in (2, 3):  # not JPEG: the codec's own decode, exactly
        assert torch.equal(got[i].tensors[0], CODEC.decode(rows[i]).tensors[0])


def bogus_huffman_jpeg(seed: int) -> bytes:
    """A JPEG whose header and end marker are whole but whose first Huffman table is nonsense: every decoder
    refuses it, and nothing in its bytes says so before decoding."""
    raw = bytearray(jpeg_bytes(seed=seed))
    table = raw.find(b"\xff\xc4")
    raw[table + 5 : table + 21] = b"\xff" * 16  # sixteen code counts of 255
    return bytes(raw)


def decode_queued_together(raws: list[bytes]) -> tuple[list, list[int]]:
    """Each body's answer from one BatchedJpegDecoder given them all at once, and its decoder calls' sizes."""
    sizes: list[int] = []
    made = BatchedJpegDecoder(
        CODEC, torch.device("cpu"), RequestDecoder(CODEC.decode, threads=2), on_batch=sizes.append
    )
    try:
        with made._wake:  # queued before the thread can take any: one batch
            futures = [Future() for _ in raws]
            made._pending.extend(zip(raws, futures, strict=True))
            made._wake.notify()
        return [f.exception(timeout=60) or f.result() for f in futures], sizes
    finally:
        made.close()


def test_an_undecodable_jpeg_in_a_batch_gets_its_4xx_and_the_rest_stay_in_batches():
    """A JPEG that fails only when decoded fails the decoder's batch call; the batch is decoded again in halves
    down to the bad image alone, which the codec answers (415, saying why), so the good ones keep the batch
    decoder's pixels and are still decoded several at a time."""
    raws = [jpeg_bytes(seed=i) for i in range(8)]
    raws[5] = bogus_huffman_jpeg(seed=5)
    got, sizes = decode_queued_together(raws)
    assert isinstance(got[5], RequestError) and got[5].status == 415 and "cannot decode" in str(got[5])
    for i in (0, 1, 2, 3, 4, 6, 7):
        assert torch.equal(got[i].tensors[0], pixels_reference(raws[i])), i
    assert sorted(sizes) == [1, 2, 4], sizes  # 8 fails, 4 + 4: the first half whole, 2 + 2, then 1 + 1


def test_a_jpeg_cut_short_never_enters_a_batch_and_gets_its_4xx():
    """A file that stops before its end-of-image marker is answered by the codec alone (415, truncated)
    without costing its batch-mates a call: nvJPEG decoded such a file without an error on the lent H200,
    so the batch decoder must not be the one to judge it."""
    raws = [jpeg_bytes(seed=i) for i in range(8)]
    raws[5] = raws[5][: len(raws[5]) // 2]
    got, sizes = decode_queued_together(raws)
    assert isinstance(got[5], RequestError) and got[5].status == 415 and "truncated" in str(got[5])
    for i in (0, 1, 2, 3, 4, 6, 7):
        assert torch.equal(got[i].tensors[0], pixels_reference(raws[i])), i
    assert sizes == [7], sizes


@pytest.mark.parametrize(
    ("cut", "whole"),
    [
        (lambda raw: raw, True),
        (lambda raw: raw + b"trailing bytes after the end marker", True),
        (lambda raw: raw[: len(raw) // 2], False),
        (lambda raw: raw[:-2], False),
        (lambda raw: raw[:2], False),
        (lambda raw: b"GIF89a" + raw[2:], False),
    ],
)
def test_the_end_of_image_check_reads_markers_not_just_the_tail(cut, whole):
    from handlers.runtime.batched_decode import _ends_its_image

    assert _ends_its_image(cut(jpeg_bytes(seed=3))) is whole


def test_an_exif_thumbnails_end_marker_does_not_make_a_cut_file_whole():
    """The thumbnail inside APP1 ends in FF D9 of its own; the check skips header segments by length."""
    from handlers.runtime.batched_decode import _ends_its_image

    thumbnail = io.BytesIO()
    Image.effect_noise((32, 32), 50).convert("RGB").save(thumbnail, "JPEG")
    exif = b"Exif\x00\x00" + thumbnail.getvalue()  # not a valid TIFF block, but a segment whose bytes hold FF D9
    app1 = b"\xff\xe1" + (len(exif) + 2).to_bytes(2, "big") + exif
    raw = jpeg_bytes(seed=4)
    with_thumbnail = raw[:2] + app1 + raw[2:]
    assert _ends_its_image(with_thumbnail)
    assert not _ends_its_image(with_thumbnail[: len(with_thumbnail) - 4000])


def test_a_closed_decoder_refuses_new_work_and_its_thread_ends(decoder):
    decoder.close()
    assert not decoder._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        raise decode_all(decoder, [{"body": jpeg_bytes(seed=0)}])[0]


@pytest.mark.slow
def test_ebird_with_batched_decoding_answers_the_model_on_its_decoded_inputs(make_handler):  # noqa: F811
    handler, ctx = make_handler(decode_threads="batched", worker_batches=[1, 1, 2, 4], pool_slots=8)
    assert isinstance(handler.decoder, BatchedJpegDecoder) and "in batches" in handler.decoder.where
    rows = [{"body": jpeg_bytes(seed=i)} for i in range(6)] + [{"body": b"{not json"}, {"body": png_bytes(7)}]
    answers = serve_all(handler, ctx, rows)
    assert [status for status, _ in answers] == [200] * 6 + [400, 200]
    assert "malformed JSON" in json.loads(answers[6][1])["message"]
    model = handler.model
    with torch.inference_mode():
        expected = model(torch.stack([pixels_reference(r["body"]) for r in rows[:6]]))
    for (_, body), row in zip(answers[:6], expected, strict=True):
        assert outputs_close(torch.tensor(body["logits"]), row, 1e-4)
    (png_expected,) = reference_logits(SPEC, rows[7:])
    assert outputs_close(torch.tensor(answers[7][1]["logits"]), png_expected, 1e-4)
