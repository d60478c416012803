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
from typing import Any

import numpy as np
import torch

from handlers.errors import RequestError, bad_request
from model_store.catalog import ModelSpec
from serving_harness import oip

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


def json_payload(row: dict[str, Any], limit: int) -> Any:
    """A JSON request's body as Python values: raw bytes checked against ``limit`` (a 413) and parsed, a string
    parsed, a value TorchServe already parsed (an ``application/json`` body) as it is."""
    value = request_payload(row)
    if isinstance(value, (bytes, bytearray)):
        check_payload_size(value, limit)
        return parse_json(value)
    if isinstance(value, str):
        return parse_json(value)
    return value


def parse_json(raw: bytes | bytearray | str) -> Any:
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        return json.loads(text)
    except UnicodeDecodeError:
        raise RequestError(415, "payload is neither JSON nor a JPEG/PNG image") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None


class ModelInput:
    """One request's inputs, without the batch dimension; ``v2``: the Open Inference Protocol
    request it came in, which its answer then follows (None: the handler's own JSON).

    A token request keeps its ids and mask as Python lists (``rows``) until
    its batch is formed (``collate``): one tensor per input position per
    batch instead of two per request.  Each torch call releases the GIL and
    must take it back; where another thread of the worker runs Python (an
    async handler's event loop beside the lane that decodes and runs
    batches), each such hand-off waits for that thread, and on a tiny model
    (the host-bound regime of a fast GPU) those waits were most of a
    request's decode (``docs/benchmarks/host_path.md``).  ``tensors`` builds
    the tensors on first use, for code that wants them one by one.
    """

    __slots__ = ("_shapes", "_tensors", "rows", "v2")

    def __init__(
        self,
        tensors: tuple[torch.Tensor, ...] | None = None,
        v2: oip.InferRequest | None = None,
        *,
        rows: tuple[list[int], ...] | None = None,
    ) -> None:
        if (tensors is None) == (rows is None):
            raise ValueError("a ModelInput holds either tensors or token rows")
        self._tensors = None if tensors is None else tuple(tensors)
        self.rows = rows
        self.v2 = v2
        self._shapes: tuple[tuple[int, ...], ...] | None = None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        if self._tensors is None:
            self._tensors = tuple(torch.tensor(row, dtype=torch.long) for row in self.rows)
        return self._tensors

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Each input's shape, without building tensors."""
        if self._shapes is None:
            if self.rows is not None:
                self._shapes = tuple((len(row),) for row in self.rows)
            else:
                self._shapes = tuple(tuple(t.shape) for t in self._tensors)
        return self._shapes

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        if self.rows is not None:
            return (torch.long,) * len(self.rows)
        return tuple(t.dtype for t in self._tensors)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shapes={list(self.shapes)}, v2={self.v2 is not None})"


# The Open Inference Protocol's names for a catalog model's tensors (its metadata says so too).
V2_IMAGE = "image"
V2_TOKENS = ("input_ids", "attention_mask")
V2_OUTPUT = "logits"


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
            value = parse_json_or_v2(value)
        elif isinstance(value, str):
            value = parse_json(value)
        if oip.is_request(value) or isinstance(value, oip.InferRequest):
            return self._from_v2(value)
        if self.spec.input_kind == "image":
            return ModelInput((self._image_from_json(value),))
        return ModelInput(rows=self._tokens_from_json(value))

    def answer(self, item: ModelInput, row: torch.Tensor) -> bytes:
        """One request's answer from its output row, in the wire format it came in."""
        if item.v2 is None:
            return answer_bytes(encode_output(row))
        logits = row.detach().float().unsqueeze(0).cpu().numpy()
        return oip.response_body(self.spec.name, [(V2_OUTPUT, logits)], item.v2.id)

    # -- the Open Inference Protocol ----------------------------------------

    def v2_signature(self) -> dict[str, Any]:
        """The model's v2 metadata: its input and output tensors (-1: a free length)."""
        if self.spec.input_kind == "image":
            inputs = [{"name": V2_IMAGE, "datatype": "FP32", "shape": [1, *self.spec.image_shape]}]
        else:
            inputs = [{"name": n, "datatype": "INT64", "shape": [1, -1]} for n in V2_TOKENS]
        return {"name": self.spec.name, "platform": "pytorch", "inputs": inputs,
                "outputs": [{"name": V2_OUTPUT, "datatype": "FP32", "shape": [1, -1]}]}  # fmt: skip

    def _from_v2(self, value: Any) -> ModelInput:
        try:
            request = value if isinstance(value, oip.InferRequest) else oip.parse_request(value)
            if any(name != V2_OUTPUT for name in request.outputs):
                bad = next(name for name in request.outputs if name != V2_OUTPUT)
                raise oip.OipError(f"unknown output '{bad}' (the model answers ['{V2_OUTPUT}'])")
            expected = (V2_IMAGE,) if self.spec.input_kind == "image" else V2_TOKENS
            unknown = [name for name in request.inputs if name not in expected]
            if unknown:
                raise oip.OipError(f"unknown input '{unknown[0]}' (the model takes {list(expected)})")
            if self.spec.input_kind == "image":
                return ModelInput((self._image_from_v2(request.get(V2_IMAGE)),), request)
            return ModelInput(v2=request, rows=self._tokens_from_v2(request))
        except oip.OipError as exc:
            raise RequestError(exc.status, str(exc)) from None

    def _image_from_v2(self, tensor: oip.Tensor) -> torch.Tensor:
        if tensor.datatype == "BYTES":
            if tensor.array.size != 1:
                raise oip.OipError(f"input '{tensor.name}': BYTES carries one JPEG/PNG image, got shape "
                                   f"{list(tensor.shape)}")  # fmt: skip
            raw = bytes(tensor.array.ravel()[0])
            if not (raw.startswith(JPEG_MAGIC) or raw.startswith(PNG_MAGIC)):
                raise oip.OipError(f"input '{tensor.name}': BYTES is not a JPEG or PNG image", status=415)
            return self._decode_image(raw)
        if tensor.datatype not in oip.FLOATS:
            raise oip.OipError(f"input '{tensor.name}': datatype {tensor.datatype} not accepted; send FP32 "
                               f"(or FP16/FP64) of shape {[1, *self.spec.image_shape]}, or BYTES [1] holding a "
                               f"JPEG/PNG image")  # fmt: skip
        array = one_item(tensor, 3)
        if tuple(array.shape) not in self.image_shapes:
            expected = " or ".join(str([1, *s]) for s in self.image_shapes)
            raise oip.OipError(f"input '{tensor.name}': shape {list(tensor.shape)}, expected {expected}")
        out = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
        if not torch.isfinite(out).all():
            raise oip.OipError(f"input '{tensor.name}' contains NaN or infinite values")
        return out

    def _tokens_from_v2(self, request: oip.InferRequest) -> tuple[list[int], list[int]]:
        ids_tensor = request.get(V2_TOKENS[0])
        ids = one_item(int_tensor(ids_tensor), 1)
        if V2_TOKENS[1] in request.inputs:
            mask_tensor = int_tensor(request.inputs[V2_TOKENS[1]])
            mask = one_item(mask_tensor, 1)
            if mask.shape != ids.shape:
                raise oip.OipError(f"input '{mask_tensor.name}': shape {list(mask_tensor.shape)} differs from "
                                   f"'{ids_tensor.name}' {list(ids_tensor.shape)}")  # fmt: skip
            used = int(mask.sum())
            if not set(mask.tolist()) <= {0, 1} or mask[:used].min(initial=1) != 1:
                raise oip.OipError(f"input '{mask_tensor.name}' must be ones then zeros (right padding)")
            ids = ids[:used]
        try:
            return self._tokens_from_json([int(t) for t in ids.tolist()])
        except RequestError as err:
            raise oip.OipError(f"input '{ids_tensor.name}': {err.reason}", err.status) from None

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

    def jpeg_payload(self, row: dict[str, Any]) -> bytes | None:
        """The request's JPEG body where this is an image model and the body is one (within the payload
        limit), else None: the input a batched JPEG decoder takes; everything else goes through ``decode``."""
        if self.spec.input_kind != "image":
            return None
        value = request_payload(row)
        if not isinstance(value, (bytes, bytearray)) or not value.startswith(JPEG_MAGIC):
            return None
        check_payload_size(value, self.max_payload_bytes)
        return bytes(value)

    def image_from_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """A decoded uint8 ``[3, H, W]`` image (on any device) to the model's input there: the same steps
        as the PIL path (short side to 256/224 of the crop, centre crop, scale, normalise) as tensor ops.
        The antialiased bilinear resize differs from PIL's by under 0.02 in normalised units."""
        from torchvision.transforms.v2 import functional as F

        _, height, width = self.spec.image_shape
        image = F.resize(pixels, [round(min(height, width) * 256 / 224)], antialias=True)
        image = F.center_crop(image, [height, width]).to(torch.float32).div_(255.0)
        return F.normalize(image, IMAGENET_MEAN, IMAGENET_STD)

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

    def _tokens_from_json(self, value: Any) -> tuple[list[int], list[int]]:
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
        # Python lists, made into tensors once per batch (``collate``; ``ModelInput`` says why).
        pad = length - len(ids)
        return ids + [0] * pad, [1] * len(ids) + [0] * pad


def widen_tokens(item: ModelInput, length: int) -> ModelInput:
    """``item``'s token rows padded on the right to ``length`` (ids 0, mask 0), as the codec pads to a class.

    A request padded to a longer length class gives the same answer, its
    extra positions masked out, as the baselines' requests padded to the
    archive's whole sequence length do.  DVABatch runs a class's requests in
    a longer class's batch where that costs less (``dvabatch/merge.py``).
    """
    if item.rows is None:
        raise ValueError("only token rows are widened")
    extra = length - len(item.rows[0])
    if extra < 0:
        raise ValueError(f"cannot widen {len(item.rows[0])} tokens to {length}")
    if extra == 0:
        return item
    ids, mask = item.rows
    return ModelInput(rows=(ids + [0] * extra, mask + [0] * extra), v2=item.v2)


def is_describe(context: Any) -> bool:
    """Whether this call is TorchServe's describe (``GET /models/NAME?customized=true``): it reaches
    ``handle`` as one request with a ``describe`` header, and the answer becomes the model's
    ``customizedMetadata``, where a handler here puts its Open Inference Protocol signature."""
    try:
        return str(context.get_request_header(0, "describe")) == "True"
    except (AttributeError, IndexError, KeyError, TypeError):  # a context without request processors
        return False


def parse_json_or_v2(raw: bytes | bytearray) -> Any:
    """A JSON body, or a v2 request in the binary tensor extension (JSON followed by raw tensors)."""
    try:
        return parse_json(raw)
    except RequestError:
        split = oip.split_body(raw)
        if split is None or not oip.is_request(split[0]):
            raise
    try:
        return oip.parse_request(raw)
    except oip.OipError as exc:
        raise RequestError(exc.status, str(exc)) from None


def one_item(tensor: oip.Tensor, dims: int) -> np.ndarray:
    """A v2 tensor holding one item: its ``dims``-dimensional array, with or without a leading batch of 1."""
    array = tensor.array
    if array.ndim == dims + 1:
        if array.shape[0] != 1:
            raise oip.OipError(f"input '{tensor.name}': a batch of {array.shape[0]} in one request; send one item "
                               f"per request (the server batches requests)")  # fmt: skip
        array = array[0]
    if array.ndim != dims:
        raise oip.OipError(f"input '{tensor.name}': shape {list(tensor.shape)} has {tensor.array.ndim} dimensions, "
                           f"expected {dims} (or {dims + 1} with a batch of 1)")  # fmt: skip
    return array


def int_tensor(tensor: oip.Tensor) -> oip.Tensor:
    if tensor.datatype not in oip.INTEGERS:
        raise oip.OipError(f"input '{tensor.name}': datatype {tensor.datatype} not accepted; send INT64 or INT32")
    return tensor


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


def collate(inputs: Sequence[ModelInput]) -> tuple[torch.Tensor, ...]:
    """Per-request inputs as batch tensors, position by position: one tensor from the token rows
    when every input has them (one torch call per position), else the tensors stacked."""
    if inputs and all(i.rows is not None for i in inputs):
        return tuple(torch.tensor(parts, dtype=torch.long) for parts in zip(*(i.rows for i in inputs), strict=True))
    return tuple(torch.stack(parts) for parts in zip(*(i.tensors for i in inputs), strict=True))


def encode_output(row: torch.Tensor, max_full: int = 1000) -> dict[str, Any]:
    """One request's answer from its row of the model's output (``encode_outputs`` of one row)."""
    return encode_outputs(row.unsqueeze(0), max_full)[0]


def encode_outputs(outputs: torch.Tensor, max_full: int = 1000) -> list[dict[str, Any]]:
    """Each request's answer from its row of a batch's output.

    A classifier's row is a logit vector: the answer is its top-5, plus all
    logits when there are at most ``max_full`` (GPT-2's 50k next-token logits
    would be a megabyte of JSON per request, so only the top-k travels).  A
    segmentation model's row is ``[classes, H, W]`` per-pixel logits: the
    answer is the ``[H, W]`` mask of each pixel's most likely class, 16k small
    integers for the catalog's UNet instead of 2 × 16k floats.

    The torch work is done once for the batch (one top-k, one ``tolist``)
    and each answer is then built in plain Python: per-row torch calls
    would each hand the GIL to the worker's other threads and wait to get
    it back (``ModelInput`` says why that matters).
    """
    outputs = outputs.float()
    if outputs.dim() == 4:
        classes = int(outputs.shape[1])
        return [{"classes": classes, "mask": mask} for mask in outputs.argmax(dim=1).tolist()]
    if outputs.dim() != 2:
        raise ValueError(f"cannot answer with a model output row of shape {list(outputs.shape[1:])}")
    values, indices = torch.topk(outputs, min(5, outputs.shape[1]), dim=1)
    tops = [
        [{"index": i, "logit": finite_or_none(v)} for v, i in zip(vs, ids, strict=True)]
        for vs, ids in zip(values.tolist(), indices.tolist(), strict=True)
    ]
    if outputs.shape[1] > max_full:
        return [{"top5": top} for top in tops]
    return [
        {"top5": top, "logits": [x if math.isfinite(x) else None for x in row]}
        for top, row in zip(tops, outputs.tolist(), strict=True)
    ]


def answers_for(codec: InputCodec, inputs: Sequence[ModelInput], outputs: torch.Tensor) -> list[bytes]:
    """Each request's answer bytes in the wire format it came in: the handler's own JSON for the
    batch's rows at once (``encode_outputs``), the Open Inference Protocol's one by one."""
    own = [j for j, item in enumerate(inputs) if item.v2 is None]
    answers: list[bytes] = [b""] * len(inputs)
    if own:
        rows = outputs if len(own) == len(inputs) else outputs[own]
        for j, answer in zip(own, encode_outputs(rows), strict=True):
            answers[j] = answer_bytes(answer)
    for j, item in enumerate(inputs):
        if item.v2 is not None:
            answers[j] = codec.answer(item, outputs[j])
    return answers


def answer_bytes(answer: Any) -> bytes:
    """An answer as compact UTF-8 JSON, ready for TorchServe to send as is.

    Handed a dict, TorchServe's worker would ``json.dumps(indent=2)`` it on
    its own thread (the async worker's event loop, beside the running
    batch): a slower dump, and 25 KB for ResNet-50's 1000 logits against
    20 KB compact, which the socket, the frontend and the client each
    handle again.  The response's content type stays application/json.
    """
    return json.dumps(answer, separators=(",", ":"), allow_nan=False).encode()


def finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None
