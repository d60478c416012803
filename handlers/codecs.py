"""Request payload → model input tensors, validated.

TorchServe hands a handler one dict per request: ``{"body": value}`` for a
plain POST body, ``{"data": value, ...}`` for form fields.  ``value`` is
bytes, or already-decoded JSON when the client sent ``application/json``
and it parsed (TorchServe forwards the raw bytes when it did not, which is
how malformed JSON reaches us).  Everything that can be wrong with a request
becomes a :class:`RequestError` with a reason that names the problem; nothing
here may raise anything else for bad client input.
"""

from __future__ import annotations

import bisect
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from handlers.errors import RequestError, bad_request
from model_store.catalog import ModelSpec

JPEG_MAGIC = b"\xff\xd8\xff"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Decoding a huge image costs memory before any shape check can run.
MAX_IMAGE_PIXELS = 40_000_000
DEFAULT_MAX_PAYLOAD_BYTES = 8 * 1024 * 1024


def request_payload(row: dict[str, Any]) -> Any:
    """The one payload of a TorchServe request row."""
    if "body" in row:
        value = row["body"]
    elif "data" in row:
        value = row["data"]
    elif len(row) == 1:
        value = next(iter(row.values()))
    else:
        raise bad_request(f"expected one payload field ('data' or a plain body), got {sorted(row)}")
    if value is None or (isinstance(value, (bytes, bytearray, str)) and len(value) == 0):
        raise bad_request("empty request body")
    return value


def check_payload_size(value: bytes | bytearray, limit: int) -> None:
    """A 413 for a body over the archive's limit, before anything parses it."""
    if len(value) > limit:
        raise RequestError(413, f"payload of {len(value)} bytes exceeds the limit of {limit} bytes")


def parse_json(raw: bytes | bytearray | str) -> Any:
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        return json.loads(text)
    except UnicodeDecodeError:
        raise RequestError(415, "payload is neither JSON nor a JPEG/PNG image") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None


@dataclass(frozen=True)
class ModelInput:
    """One request's tensors, without the batch dimension."""

    tensors: tuple[torch.Tensor, ...]


class InputCodec:
    """Decodes payloads for one model spec.  Stateless and thread-safe.

    An image model accepts JSON tensors of the spec's shape, plus any extra
    ``image_shapes`` its archive declares (a handler that preallocates input
    memory per shape needs to know them up front); JPEG/PNG images are
    resized to the spec's shape.

    A token model pads ids to its sequence length, or, where the archive
    declares ``token_lengths`` (DVABatch's input-diversity policy), to the
    shortest declared length that holds them: requests of one length class
    batch together at that length, and a short sentence is not computed at
    the full length.  The sequence length is always one of the classes.
    """

    def __init__(
        self,
        spec: ModelSpec,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        image_shapes: Sequence[Sequence[int]] = (),
        token_lengths: Sequence[int] = (),
    ) -> None:
        self.spec = spec
        self.max_payload_bytes = max_payload_bytes
        self.image_shapes: tuple[tuple[int, ...], ...] = ()
        if spec.input_kind == "image":
            declared = [tuple(spec.image_shape)] + [tuple(int(d) for d in s) for s in image_shapes]
            for shape in declared:
                if len(shape) != 3 or shape[0] != spec.image_shape[0] or min(shape) < 1:
                    raise ValueError(f"declared image shape {list(shape)} must be [{spec.image_shape[0]}, H, W]")
            self.image_shapes = tuple(dict.fromkeys(declared))
        elif image_shapes:
            raise ValueError(f"{spec.name} takes tokens; image_shapes do not apply")
        self.token_lengths: tuple[int, ...] = ()
        if spec.input_kind == "tokens":
            from model_store.factory import vocab_size

            self.token_lengths = parse_token_lengths(token_lengths, spec.seq_len)
            self.vocab_size = vocab_size(spec)
        elif token_lengths:
            raise ValueError(f"{spec.name} takes images; token_lengths do not apply")

    def decode(self, row: dict[str, Any]) -> ModelInput:
        value = request_payload(row)
        if isinstance(value, (bytes, bytearray)):
            check_payload_size(value, self.max_payload_bytes)
            if self.spec.input_kind == "image" and (value.startswith(JPEG_MAGIC) or value.startswith(PNG_MAGIC)):
                return ModelInput((self._decode_image(bytes(value)),))
            value = parse_json(value)
        elif isinstance(value, str):
            value = parse_json(value)
        if self.spec.input_kind == "image":
            return ModelInput((self._image_from_json(value),))
        return ModelInput(self._tokens_from_json(value))

    # -- images --------------------------------------------------------------

    def _decode_image(self, raw: bytes) -> torch.Tensor:
        from PIL import Image, UnidentifiedImageError

        try:
            image = Image.open(io.BytesIO(raw))
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise RequestError(413, f"image of {width}x{height} pixels exceeds {MAX_IMAGE_PIXELS} pixels")
            image = image.convert("RGB")
        except RequestError:
            raise
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
            raise RequestError(415, f"cannot decode image: {exc}") from None
        return self._image_transform()(image)

    def _image_transform(self):
        # The classic ImageNet evaluation pipeline, as TorchServe's image
        # classifier applies it: resize the short side to 256/224 of the crop,
        # centre-crop, scale to [0, 1], normalise.
        from torchvision import transforms

        _, height, width = self.spec.image_shape
        return transforms.Compose(
            [
                transforms.Resize(round(min(height, width) * 256 / 224)),
                transforms.CenterCrop((height, width)),
                transforms.ToTensor(),
                transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        )

    def _image_from_json(self, value: Any) -> torch.Tensor:
        data = value.get("data") if isinstance(value, dict) else value
        if data is None:
            raise bad_request("JSON body needs a 'data' field holding a [3, H, W] tensor")
        tensor = _float_tensor(data)
        if tuple(tensor.shape) not in self.image_shapes:
            expected = " or ".join(str(list(s)) for s in self.image_shapes)
            raise bad_request(f"wrong tensor shape {list(tensor.shape)}, expected {expected}")
        return tensor

    # -- tokens --------------------------------------------------------------

    def _tokens_from_json(self, value: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(value, dict):
            ids = value.get("input_ids", value.get("data"))
            if ids is None:
                raise bad_request("JSON body needs an 'input_ids' list of token ids")
        else:
            ids = value
        if not isinstance(ids, list) or not ids:
            raise bad_request("input_ids must be a non-empty list of integers")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise bad_request("wrong dtype: input_ids must be integers")
        seq_len = self.spec.seq_len
        if len(ids) > seq_len:
            raise bad_request(f"wrong shape: {len(ids)} tokens exceed the model's sequence length {seq_len}")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} outside the vocabulary [0, {self.vocab_size})")
        length = self.token_lengths[bisect.bisect_left(self.token_lengths, len(ids))]
        padded = torch.zeros(length, dtype=torch.long)
        padded[: len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask = torch.zeros(length, dtype=torch.long)
        mask[: len(ids)] = 1
        return padded, mask


def parse_token_lengths(lengths: Any, seq_len: int) -> tuple[int, ...]:
    """``token_lengths`` from model-config.yaml: ascending, distinct, in [1, seq_len], with ``seq_len`` added."""
    if lengths is None:
        lengths = ()
    if isinstance(lengths, str | bytes) or not isinstance(lengths, Sequence):
        raise ValueError(f"token_lengths must be a list of integers, got {lengths!r}")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= seq_len:
            raise ValueError(f"token_lengths must be integers in [1, {seq_len}] (the sequence length), got {n!r}")
    return tuple(sorted({*lengths, seq_len}))


def _float_tensor(data: Any) -> torch.Tensor:
    if isinstance(data, (int, float)) or not isinstance(data, list):
        raise bad_request("'data' must be a nested list of numbers")
    try:
        tensor = torch.tensor(data, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as exc:
        # torch says "too many dimensions 'str'" or "expected sequence of
        # length 224 at dim 2 (got 3)"; both are dtype or ragged-shape faults.
        first = str(exc).splitlines()[0]
        raise bad_request(f"wrong dtype or ragged shape in 'data': {first}") from None
    if not torch.isfinite(tensor).all():
        raise bad_request("'data' contains NaN or infinite values")
    return tensor


def collate(inputs: list[ModelInput]) -> tuple[torch.Tensor, ...]:
    """Stack per-request tensors into batch tensors, position by position."""
    return tuple(torch.stack(parts) for parts in zip(*(i.tensors for i in inputs), strict=True))


def encode_output(row: torch.Tensor, max_full: int = 1000) -> dict[str, Any]:
    """One request's answer from its row of the model's output.

    A classifier's row is a logit vector: the answer is its top-5, plus all
    logits when there are at most ``max_full`` (GPT-2's 50k next-token logits
    would be a megabyte of JSON per request, so only the top-k travels).  A
    segmentation model's row is ``[classes, H, W]`` per-pixel logits: the
    answer is the ``[H, W]`` mask of each pixel's most likely class, 16k small
    integers for the catalog's UNet instead of 2 × 16k floats.
    """
    row = row.float()
    if row.dim() == 3:
        return {"classes": int(row.shape[0]), "mask": row.argmax(dim=0).tolist()}
    if row.dim() != 1:
        raise ValueError(f"cannot answer with a model output row of shape {list(row.shape)}")
    result: dict[str, Any] = {"top5": top_k(row)}
    if row.numel() <= max_full:
        result["logits"] = finite_list(row)
    return result


def answer_bytes(answer: Any) -> bytes:
    """An answer as compact UTF-8 JSON, ready for TorchServe to send as is.

    Handed a dict, TorchServe's worker would ``json.dumps(indent=2)`` it on
    its own thread (the async worker's event loop, beside the running
    batch): a slower dump, and 25 KB for ResNet-50's 1000 logits against
    20 KB compact, which the socket, the frontend and the client each
    handle again.  The response's content type stays application/json.
    """
    return json.dumps(answer, separators=(",", ":"), allow_nan=False).encode()


def top_k(logits: torch.Tensor, k: int = 5) -> list[dict[str, float]]:
    values, indices = torch.topk(logits, min(k, logits.numel()))
    return [{"index": int(i), "logit": finite_or_none(float(v))} for v, i in zip(values, indices, strict=True)]


def finite_list(tensor: torch.Tensor) -> list[float]:
    """JSON-safe floats (JSON has no NaN)."""
    return [x if math.isfinite(x) else None for x in tensor.tolist()]


def finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None
