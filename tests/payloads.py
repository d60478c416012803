"""Reference outputs for the tests (payload generators live in model_store.samples)."""

from __future__ import annotations

import torch

from handlers.codecs import InputCodec, ModelInput, collate
from model_store.catalog import ModelSpec
from model_store.factory import build_model
from model_store.samples import image_tensor_json, jpeg_bytes, png_bytes, token_ids_json

__all__ = [
    "batched_jpeg_input",
    "image_tensor_json",
    "jpeg_bytes",
    "png_bytes",
    "reference_logits",
    "token_ids_json",
]

_MODELS: dict[tuple[str, int], torch.nn.Module] = {}


def batched_jpeg_input(spec: ModelSpec, raw: bytes) -> torch.Tensor:
    """A JPEG's model input as ``decode_threads: batched`` makes it on CPU: torchvision's decoder (libjpeg-turbo,
    as PIL's is), then the codec's own resize and normalisation of those pixels."""
    from torchvision.io import ImageReadMode, decode_jpeg

    pixels = decode_jpeg(torch.frombuffer(bytearray(raw), dtype=torch.uint8), ImageReadMode.RGB)
    return InputCodec(spec).image_from_pixels(pixels)


def reference_logits(spec: ModelSpec, rows: list[dict], batched_jpeg: bool = False) -> torch.Tensor:
    """The eager model's direct output for requests, decoded as the handler decodes them (``batched_jpeg``:
    JPEG bodies as the batched decoder decodes them, the rest by the codec)."""
    key = (spec.name, spec.seed)
    if key not in _MODELS:
        _MODELS[key] = build_model(spec)
    codec = InputCodec(spec)
    inputs = []
    for row in rows:
        raw = codec.jpeg_payload(row) if batched_jpeg else None  # what the batched decoder takes
        inputs.append(codec.decode(row) if raw is None else ModelInput((batched_jpeg_input(spec, raw),)))
    with torch.inference_mode():
        return _MODELS[key](*collate(inputs))
