"""Sample client payloads for catalog models: what a real client would send.

Vision models get encoded JPEG/PNG images (decoded, resized and normalised by
the handler) or a JSON tensor; text models get JSON token ids.  Used by the
tests, the demo and the benchmarks, so every one of them sends the same kinds
of request.
"""

from __future__ import annotations

import io
import json

import numpy as np
import torch
from PIL import Image

from model_store.catalog import ModelSpec
from model_store.factory import vocab_size


def _noise_image(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8"))


def jpeg_bytes(seed: int = 0, size: tuple[int, int] = (320, 240)) -> bytes:
    buf = io.BytesIO()
    _noise_image(seed, size).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def png_bytes(seed: int = 0, size: tuple[int, int] = (256, 256)) -> bytes:
    buf = io.BytesIO()
    _noise_image(seed, size).save(buf, "PNG")
    return buf.getvalue()


def image_tensor_json(spec: ModelSpec, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"data": torch.randn(spec.image_shape, generator=gen).tolist()}


def token_ids_json(spec: ModelSpec, length: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, vocab_size(spec), (length,), generator=gen).tolist()}


def request_body(payload: bytes | dict) -> bytes:
    """A payload as the bytes of a POST body: a JPEG as it is, JSON encoded."""
    return payload if isinstance(payload, bytes) else json.dumps(payload).encode()


def client_payload(spec: ModelSpec, seed: int = 0) -> bytes | dict:
    """The payload a typical client sends: a JPEG for vision, token ids for text."""
    if spec.input_kind == "image":
        _, height, width = spec.image_shape
        return jpeg_bytes(seed, size=(width + width // 4, height + height // 4))
    return token_ids_json(spec, length=max(1, spec.seq_len * 3 // 4), seed=seed)
