"""The Open Inference Protocol's (KServe v2) HTTP wire format: requests in, responses out.

A v2 inference request is JSON ``{"id"?, "parameters"?, "inputs": [{"name",
"datatype", "shape", "data" | "parameters": {"binary_data_size": n}}],
"outputs"?}``.  With the binary tensor extension (what ``tritonclient``
sends by default) the JSON is followed, in the same body, by the raw bytes of
every input that names a ``binary_data_size``, in input order, and the
``Inference-Header-Content-Length`` header says where the JSON ends.

TorchServe passes a handler the body but not that header, so the parser here
needs neither: a JSON value delimits itself, and whatever follows it is the
binary part.  Every fault is an :class:`OipError` that names the input and
what is wrong with it, for a 400 (a fault the caller could not have caught
before sending, such as an unknown datatype, is a 400 too: the request is
malformed for this server).

Pure (numpy and json), shared by the handlers (decoding what a client sent)
and by the gRPC front (re-encoding a gRPC request as the HTTP one TorchServe
forwards, and the handler's answer back).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

HEADER_LENGTH = "Inference-Header-Content-Length"
# v2 datatypes and their little-endian numpy dtypes; BYTES holds Python bytes objects.
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}
FLOATS = ("FP16", "FP32", "FP64")
INTEGERS = ("INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64")
MAX_ELEMENTS = 64 * 1024 * 1024  # a declared shape past this is refused before anything is allocated


class OipError(ValueError):
    """A v2 request (or response) this side cannot read; the message names the tensor."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str
    array: np.ndarray  # shaped as declared; BYTES: an object array of bytes

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)


@dataclass(frozen=True)
class InferRequest:
    inputs: dict[str, Tensor]  # in the request's order
    id: str | None = None
    outputs: tuple[str, ...] = ()  # the outputs asked for by name; empty: all
    binary_output: bool = False  # the client asked for outputs in binary (answered as JSON data here)
    parameters: Mapping[str, Any] = field(default_factory=dict)

    def get(self, name: str) -> Tensor:
        """The input ``name``, or an error that says which inputs the request has."""
        if name not in self.inputs:
            raise OipError(f"missing input '{name}' (the request has {sorted(self.inputs) or 'no inputs'})")
        return self.inputs[name]


def is_request(value: Any) -> bool:
    """Whether a decoded JSON body is a v2 inference request (an object with an ``inputs`` list)."""
    return isinstance(value, dict) and isinstance(value.get("inputs"), list)


def split_body(body: bytes | bytearray) -> tuple[Any, bytes] | None:
    """``(JSON header, binary rest)`` of a body that starts with a JSON object, else None.

    The JSON's extent is found by parsing it (a latin-1 view maps each byte to
    one character, so the character offset where the object ends is its byte
    length); the header is then decoded again as UTF-8, its real encoding.
    """
    raw = bytes(body)
    start = len(raw) - len(raw.lstrip())
    if raw[start : start + 1] != b"{":
        return None
    try:
        _, end = json.JSONDecoder().raw_decode(raw.decode("latin-1"), start)
        header = json.loads(raw[start:end].decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return header, raw[end:]


def parse_request(value: Any) -> InferRequest:
    """A v2 request from what TorchServe hands the handler: the decoded JSON, or the raw body."""
    if isinstance(value, (bytes, bytearray)):
        split = split_body(value)
        if split is None:
            raise OipError("body is not a v2 inference request (JSON, optionally followed by binary tensors)")
        header, binary = split
    else:
        header, binary = value, b""
    if not is_request(header):
        raise OipError("a v2 inference request needs an 'inputs' list")
    inputs: dict[str, Tensor] = {}
    offset = 0
    for position, spec in enumerate(header["inputs"]):
        tensor, used = _input_tensor(spec, position, binary[offset:])
        if tensor.name in inputs:
            raise OipError(f"input '{tensor.name}' is given twice")
        inputs[tensor.name] = tensor
        offset += used
    if offset != len(binary):
        raise OipError(f"{len(binary) - offset} bytes of binary data follow the inputs that no input claims")
    params = header.get("parameters") or {}
    if not isinstance(params, dict):
        raise OipError("'parameters' must be an object")
    outputs = header.get("outputs") or []
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                for o in outputs):  # fmt: skip
        raise OipError("'outputs' must be a list of objects with a 'name'")
    binary_output = bool(params.get("binary_data_output")) or any(
        (o.get("parameters") or {}).get("binary_data") for o in outputs
    )
    request_id = header.get("id")
    return InferRequest(inputs, None if request_id is None else str(request_id),
                        tuple(o["name"] for o in outputs), binary_output, params)  # fmt: skip


def _input_tensor(spec: Any, position: int, binary: bytes) -> tuple[Tensor, int]:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise OipError(f"input #{position} needs a 'name'")
    name = spec["name"]
    datatype = spec.get("datatype")
    if datatype not in DTYPES:
        raise OipError(f"input '{name}': datatype {datatype!r} is not a v2 datatype ({', '.join(DTYPES)})")
    shape = spec.get("shape")
    if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise OipError(f"input '{name}': 'shape' must be a list of non-negative integers, got {shape!r}")
    count = math.prod(shape)
    if count > MAX_ELEMENTS:
        raise OipError(f"input '{name}': shape {shape} holds {count} elements, over the limit of {MAX_ELEMENTS}",
                       status=413)  # fmt: skip
    size = (spec.get("parameters") or {}).get("binary_data_size")
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or size > len(binary):
            raise OipError(f"input '{name}': binary_data_size {size!r} but {len(binary)} bytes of binary data left")
        array = _from_binary(name, datatype, binary[:size], count)
        used = size
    else:
        if "data" not in spec:
            raise OipError(f"input '{name}' carries no data (neither 'data' nor a binary_data_size)")
        array = _from_json(name, datatype, spec["data"], count)
        used = 0
    return Tensor(name, datatype, array.reshape(shape)), used


def _from_binary(name: str, datatype: str, raw: bytes, count: int) -> np.ndarray:
    if datatype == "BYTES":
        items, at = [], 0
        while at < len(raw):
            if at + 4 > len(raw):
                raise OipError(f"input '{name}': a BYTES element's 4-byte length is cut short")
            (n,) = struct.unpack_from("<I", raw, at)
            if at + 4 + n > len(raw):
                raise OipError(f"input '{name}': a BYTES element claims {n} bytes past the end of its data")
            items.append(raw[at + 4 : at + 4 + n])
            at += 4 + n
        if len(items) != count:
            raise OipError(f"input '{name}': {len(items)} BYTES elements for a shape of {count}")
        out = np.empty(count, dtype=object)
        out[:] = items
        return out
    dtype = DTYPES[datatype]
    if len(raw) != count * dtype.itemsize:
        raise OipError(f"input '{name}': {len(raw)} bytes of {datatype} data for a shape of {count} elements "
                       f"({count * dtype.itemsize} bytes)")  # fmt: skip
    return np.frombuffer(raw, dtype=dtype).copy()


def _from_json(name: str, datatype: str, data: Any, count: int) -> np.ndarray:
    flat = _flatten(data)
    if len(flat) != count:
        raise OipError(f"input '{name}': {len(flat)} values for a shape of {count} elements")
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise OipError(f"input '{name}': BYTES data must be strings")
        out = np.empty(count, dtype=object)
        out[:] = [v.encode("utf-8") for v in flat]
        return out
    if datatype == "BOOL":
        if not all(isinstance(v, bool) for v in flat):
            raise OipError(f"input '{name}': BOOL data must be true or false")
    elif datatype in INTEGERS:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
            raise OipError(f"input '{name}': {datatype} data must be integers")
        info = np.iinfo(DTYPES[datatype])
        bad = next((v for v in flat if not info.min <= v <= info.max), None)
        if bad is not None:
            raise OipError(f"input '{name}': {bad} does not fit {datatype}")
    elif not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat):
        raise OipError(f"input '{name}': {datatype} data must be numbers")
    return np.asarray(flat, dtype=DTYPES[datatype])


def _flatten(data: Any) -> list[Any]:
    """v2 JSON data may be flat (row-major) or nested; either way, its values in order."""
    if not isinstance(data, list):
        return [data]
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            out.append(value)
        else:
            stack.pop()
    return out


def datatype_of(array: np.ndarray) -> str:
    """The v2 datatype of a numpy array (object arrays are BYTES)."""
    if array.dtype == object or array.dtype.kind in "SU":
        return "BYTES"
    for name, dtype in DTYPES.items():
        if name != "BYTES" and (array.dtype.kind, array.dtype.itemsize) == (dtype.kind, dtype.itemsize):
            return name
    raise OipError(f"no v2 datatype for numpy dtype {array.dtype}")


def tensor_json(name: str, array: np.ndarray) -> dict[str, Any]:
    """One output (or input) tensor as v2 JSON, data flattened row-major; NaN and infinities become null."""
    datatype = datatype_of(array)
    if datatype == "BYTES":
        data: list[Any] = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in array.ravel()]
    else:
        data = array.ravel().tolist()
        if datatype in FLOATS:
            data = [v if math.isfinite(v) else None for v in data]
    return {"name": name, "datatype": datatype, "shape": list(array.shape), "data": data}


def response_body(model_name: str, outputs: Sequence[tuple[str, np.ndarray]], request_id: str | None = None,
                  version: str | None = None) -> bytes:  # fmt: skip
    """A v2 inference response, JSON data (readable by every v2 client, tritonclient included)."""
    body: dict[str, Any] = {"model_name": model_name}
    if version:
        body["model_version"] = version
    if request_id is not None:
        body["id"] = request_id
    body["outputs"] = [tensor_json(name, array) for name, array in outputs]
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def select_outputs(request: InferRequest, outputs: Sequence[tuple[str, np.ndarray]]) -> list[tuple[str, np.ndarray]]:
    """The outputs the request asked for (all when it named none); an unknown name is an error."""
    if not request.outputs:
        return list(outputs)
    known = dict(outputs)
    unknown = [name for name in request.outputs if name not in known]
    if unknown:
        raise OipError(f"unknown output '{unknown[0]}' (the model answers {sorted(known)})")
    return [(name, known[name]) for name in request.outputs]


# -- the binary form, for the gRPC front (it re-sends a gRPC request's raw tensors as they came) -----


def binary_bytes(array: np.ndarray, datatype: str) -> bytes:
    """A tensor's raw bytes as the binary extension lays them out (BYTES: 4-byte length before each)."""
    if datatype == "BYTES":
        parts = []
        for v in array.ravel():
            b = v if isinstance(v, bytes) else str(v).encode("utf-8")
            parts.append(struct.pack("<I", len(b)) + b)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=DTYPES[datatype]).tobytes()


def binary_request(
    inputs: Sequence[tuple[str, str, Sequence[int], bytes]],
    request_id: str | None = None,
    outputs: Sequence[str] = (),
    parameters: Mapping[str, Any] | None = None,
) -> tuple[bytes, int]:
    """A v2 request body from ``(name, datatype, shape, raw bytes)`` inputs, and its JSON header's length."""
    header: dict[str, Any] = {}
    if request_id:
        header["id"] = request_id
    if parameters:
        header["parameters"] = dict(parameters)
    header["inputs"] = [{"name": n, "datatype": d, "shape": list(s), "parameters": {"binary_data_size": len(raw)}}
                        for n, d, s, raw in inputs]  # fmt: skip
    if outputs:
        header["outputs"] = [{"name": n} for n in outputs]
    head = json.dumps(header, separators=(",", ":")).encode()
    return head + b"".join(raw for *_, raw in inputs), len(head)


def parse_response(body: bytes, header_length: int | None = None) -> tuple[dict[str, Any], list[Tensor]]:
    """A v2 response's JSON and its output tensors (JSON data or binary), for a client of the HTTP side."""
    raw = bytes(body)
    head, binary = (raw[:header_length], raw[header_length:]) if header_length else (raw, b"")
    try:
        header = json.loads(head.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OipError(f"response is not v2 JSON: {exc}", status=502) from None
    if not isinstance(header, dict) or not isinstance(header.get("outputs"), list):
        raise OipError("response has no 'outputs' list", status=502)
    tensors, offset = [], 0
    for spec in header["outputs"]:
        values = dict(spec)
        if "data" in values and values.get("datatype") in FLOATS:  # null stands for a non-finite float
            values["data"] = [math.nan if v is None else v for v in _flatten(values["data"])]
        tensor, used = _input_tensor(values, len(tensors), binary[offset:])
        tensors.append(tensor)
        offset += used
    return header, tensors
