"""Reference outputs for the tests (payload generators live in model_store.samples)."""

from __future__ import annotations

import torch

from handlers.codecs import InputCodec, collate
from model_store.catalog import ModelSpec
from model_store.factory import build_model
from model_store.samples import image_tensor_json, jpeg_bytes, png_bytes, token_ids_json

__all__ = ["image_tensor_json", "jpeg_bytes", "png_bytes", "reference_logits", "token_ids_json"]

_MODELS: dict[tuple[str, int], torch.nn.Module] = {}


def reference_logits(spec: ModelSpec, rows: list[dict]) -> torch.Tensor:
    """The eager model's direct output for requests, decoded as the handler decodes them."""
    key = (spec.name, spec.seed)
    if key not in _MODELS:
        _MODELS[key] = build_model(spec)
    codec = InputCodec(spec)
    batch = collate([codec.decode(row) for row in rows])
    with torch.inference_mode():
        return _MODELS[key](*batch)
