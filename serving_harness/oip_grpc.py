"""An Open Inference Protocol gRPC endpoint in front of TorchServe's HTTP one.

Why it exists: TorchServe 0.12 registers its own OIP gRPC service under the
protobuf package ``org.pytorch.serve.grpc.openinference`` (the standard one is
``inference``), so a standard client's call (``/inference.GRPCInferenceService/
ModelInfer``: tritonclient's, KServe's) finds no method; and where a client does
reach it, it forwards only the typed ``contents`` of each input, dropping
``raw_input_contents`` (what tritonclient sends), and answers with typed
contents that tritonclient reads as empty.  This front speaks the standard
service and hands each call to TorchServe's HTTP side, where the handlers read
the v2 request themselves:

- ModelInfer → ``POST /v2/models/NAME/infer`` with the request's tensors in the
  binary tensor extension (raw contents as they came, typed contents packed);
  the handler's v2 answer comes back as ``raw_output_contents``.  A 4xx from the
  handler becomes INVALID_ARGUMENT (404: NOT_FOUND) with the handler's reason.
- ServerLive / ServerReady → ``GET /ping``; ModelReady → the management API's
  worker list; ModelMetadata → ``GET /models/NAME?customized=true``, whose
  ``customizedMetadata`` the handlers here fill with their v2 signature.

The messages are built from descriptors written here (the v2 protocol's field
numbers), so nothing is generated at build time.  One thread per call; each
thread keeps its own HTTP connections to TorchServe.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import threading
from concurrent import futures
from typing import Any

import grpc
import numpy as np
import requests
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from serving_harness import oip

logger = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "bool": _F.TYPE_BOOL, "string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES, "int32": _F.TYPE_INT32,
    "int64": _F.TYPE_INT64, "uint32": _F.TYPE_UINT32, "uint64": _F.TYPE_UINT64, "float": _F.TYPE_FLOAT,
    "double": _F.TYPE_DOUBLE,
}  # fmt: skip


def _message(parent: Any, name: str, fields: list[tuple], oneof: str | None = None) -> descriptor_pb2.DescriptorProto:
    """Add message ``name`` to ``parent`` (a file or a message); fields are ``(name, number, type[, repeated])``,
    a type being a scalar name, ``map:TYPE`` (string keys) or a message's full name."""
    msg = parent.message_type.add(name=name) if hasattr(parent, "message_type") else parent.nested_type.add(name=name)
    if oneof:
        msg.oneof_decl.add(name=oneof)
    for field_name, number, kind, *repeated in fields:
        field = msg.field.add(name=field_name, number=number)
        field.label = _F.LABEL_REPEATED if repeated or kind.startswith("map:") else _F.LABEL_OPTIONAL
        if kind.startswith("map:"):
            entry = msg.nested_type.add(name="".join(p.title() for p in field_name.split("_")) + "Entry")
            entry.options.map_entry = True
            entry.field.add(name="key", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
            entry.field.add(name="value", number=2, type=_F.TYPE_MESSAGE, type_name=kind[4:], label=_F.LABEL_OPTIONAL)
            field.type, field.type_name = _F.TYPE_MESSAGE, entry.name
        elif kind in _SCALARS:
            field.type = _SCALARS[kind]
        else:
            field.type, field.type_name = _F.TYPE_MESSAGE, kind
        if oneof:
            field.oneof_index = 0
    return msg


def _descriptor_file() -> descriptor_pb2.FileDescriptorProto:
    f = descriptor_pb2.FileDescriptorProto(name="packrat/oip_v2.proto", package="inference", syntax="proto3")
    params = "map:.inference.InferParameter"
    for name, field in (("ServerLive", "live"), ("ServerReady", "ready")):
        _message(f, f"{name}Request", [])
        _message(f, f"{name}Response", [(field, 1, "bool")])
    _message(f, "ModelReadyRequest", [("name", 1, "string"), ("version", 2, "string")])
    _message(f, "ModelReadyResponse", [("ready", 1, "bool")])
    _message(f, "ServerMetadataRequest", [])
    _message(f, "ServerMetadataResponse", [("name", 1, "string"), ("version", 2, "string"),
                                           ("extensions", 3, "string", True)])  # fmt: skip
    _message(f, "ModelMetadataRequest", [("name", 1, "string"), ("version", 2, "string")])
    meta = _message(f, "ModelMetadataResponse", [
        ("name", 1, "string"), ("versions", 2, "string", True), ("platform", 3, "string"),
        ("inputs", 4, ".inference.ModelMetadataResponse.TensorMetadata", True),
        ("outputs", 5, ".inference.ModelMetadataResponse.TensorMetadata", True)])  # fmt: skip
    _message(meta, "TensorMetadata", [("name", 1, "string"), ("datatype", 2, "string"), ("shape", 3, "int64", True)])
    request = _message(f, "ModelInferRequest", [
        ("model_name", 1, "string"), ("model_version", 2, "string"), ("id", 3, "string"), ("parameters", 4, params),
        ("inputs", 5, ".inference.ModelInferRequest.InferInputTensor", True),
        ("outputs", 6, ".inference.ModelInferRequest.InferRequestedOutputTensor", True),
        ("raw_input_contents", 7, "bytes", True)])  # fmt: skip
    _message(request, "InferInputTensor", [
        ("name", 1, "string"), ("datatype", 2, "string"), ("shape", 3, "int64", True), ("parameters", 4, params),
        ("contents", 5, ".inference.InferTensorContents")])  # fmt: skip
    _message(request, "InferRequestedOutputTensor", [("name", 1, "string"), ("parameters", 2, params)])
    response = _message(f, "ModelInferResponse", [
        ("model_name", 1, "string"), ("model_version", 2, "string"), ("id", 3, "string"), ("parameters", 4, params),
        ("outputs", 5, ".inference.ModelInferResponse.InferOutputTensor", True),
        ("raw_output_contents", 6, "bytes", True)])  # fmt: skip
    _message(response, "InferOutputTensor", [
        ("name", 1, "string"), ("datatype", 2, "string"), ("shape", 3, "int64", True), ("parameters", 4, params),
        ("contents", 5, ".inference.InferTensorContents")])  # fmt: skip
    _message(f, "InferParameter", [("bool_param", 1, "bool"), ("int64_param", 2, "int64"),
                                   ("string_param", 3, "string"), ("double_param", 4, "double"),
                                   ("uint64_param", 5, "uint64")], oneof="parameter_choice")  # fmt: skip
    _message(f, "InferTensorContents", [
        ("bool_contents", 1, "bool", True), ("int_contents", 2, "int32", True), ("int64_contents", 3, "int64", True),
        ("uint_contents", 4, "uint32", True), ("uint64_contents", 5, "uint64", True),
        ("fp32_contents", 6, "float", True), ("fp64_contents", 7, "double", True),
        ("bytes_contents", 8, "bytes", True)])  # fmt: skip
    _qualify(f)
    return f


def _qualify(f: descriptor_pb2.FileDescriptorProto) -> None:
    """Map-entry type names were left short while their message was built; make them full names."""

    def walk(msg: descriptor_pb2.DescriptorProto, prefix: str) -> None:
        for field in msg.field:
            if field.type == _F.TYPE_MESSAGE and not field.type_name.startswith("."):
                field.type_name = f"{prefix}.{msg.name}.{field.type_name}"
        for nested in msg.nested_type:
            walk(nested, f"{prefix}.{msg.name}")

    for msg in f.message_type:
        walk(msg, ".inference")


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_descriptor_file())


def message_class(name: str) -> type:
    """The protobuf class of message ``name`` of the v2 protocol (e.g. ``ModelInferRequest``)."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"inference.{name}"))


# Typed contents field of each datatype (the protocol's InferTensorContents).
_CONTENTS = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}  # fmt: skip
_STATUS_CODES = {404: grpc.StatusCode.NOT_FOUND, 408: grpc.StatusCode.DEADLINE_EXCEEDED,
                 413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                 503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}  # fmt: skip


def status_code(http_status: int) -> grpc.StatusCode:
    """The gRPC status for an HTTP one from TorchServe (other 4xx: the request's fault)."""
    if http_status in _STATUS_CODES:
        return _STATUS_CODES[http_status]
    return grpc.StatusCode.INVALID_ARGUMENT if 400 <= http_status < 500 else grpc.StatusCode.INTERNAL


def input_bytes(tensor: Any, raw: list[bytes], index: int) -> bytes:
    """One input's bytes in the binary extension's layout: its raw contents, or its typed ones packed."""
    if raw:
        if index >= len(raw):
            raise oip.OipError(f"input '{tensor.name}': raw_input_contents holds {len(raw)} tensors, fewer than "
                               f"the inputs; give raw contents for every input or none")  # fmt: skip
        return raw[index]
    field = _CONTENTS.get(tensor.datatype)
    if field is None:
        raise oip.OipError(f"input '{tensor.name}': datatype {tensor.datatype!r} has no typed contents in v2")
    values = list(getattr(tensor.contents, field))
    if tensor.datatype == "BYTES":
        array = np.empty(len(values), dtype=object)
        array[:] = values
    else:
        array = np.asarray(values, dtype=oip.DTYPES[tensor.datatype])
    return oip.binary_bytes(array, tensor.datatype)


def parameter_value(parameter: Any) -> Any:
    choice = parameter.WhichOneof("parameter_choice")
    return getattr(parameter, choice) if choice else None


class OipGrpcFront:
    """The standard v2 gRPC service on ``host:port``, answered by TorchServe at ``inference_url`` /
    ``management_url``.  ``start()`` returns the bound port (pass port 0 for a free one)."""

    def __init__(self, inference_url: str, management_url: str, port: int = 0, host: str = "127.0.0.1",
                 threads: int = 32, timeout_s: float = 300.0) -> None:  # fmt: skip
        self.inference_url = inference_url.rstrip("/")
        self.management_url = management_url.rstrip("/")
        self.address = f"{host}:{port}"
        self.timeout_s = timeout_s
        self.threads = threads
        self.port: int | None = None
        self._server: grpc.Server | None = None
        self._local = threading.local()

    # -- life cycle ----------------------------------------------------------

    def start(self) -> int:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="oip-grpc"),
                             options=[("grpc.max_receive_message_length", 256 * 1024 * 1024),
                                      ("grpc.max_send_message_length", 256 * 1024 * 1024)])  # fmt: skip
        handlers = {}
        for method, fn in (("ServerLive", self.server_live), ("ServerReady", self.server_ready),
                           ("ModelReady", self.model_ready), ("ServerMetadata", self.server_metadata),
                           ("ModelMetadata", self.model_metadata), ("ModelInfer", self.model_infer)):  # fmt: skip
            request_class = message_class(f"{method}Request")
            handlers[method] = grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=request_class.FromString, response_serializer=lambda m: m.SerializeToString()
            )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.port = server.add_insecure_port(self.address)
        if not self.port:
            raise OSError(f"cannot bind the OIP gRPC front to {self.address}")
        server.start()
        self._server = server
        logger.info("Open Inference Protocol gRPC on port %d, in front of %s", self.port, self.inference_url)
        return self.port

    def stop(self, grace_s: float = 2.0) -> None:
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None

    def __enter__(self) -> OipGrpcFront:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- HTTP to TorchServe --------------------------------------------------

    @property
    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _get(self, url: str, context: grpc.ServicerContext) -> requests.Response:
        try:
            return self._session.get(url, timeout=min(self.timeout_s, 30.0))
        except requests.RequestException as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"TorchServe unreachable: {exc}")
            raise  # abort raises; this line is for type checkers

    @staticmethod
    def _reason(response: requests.Response) -> str:
        try:
            return str(response.json().get("message", response.text)).strip()
        except ValueError:
            return response.text.strip() or response.reason

    def _model(self, name: str, version: str, context: grpc.ServicerContext, customized: bool = False) -> dict:
        """The management API's description of the model's version (the default one when none is named)."""
        if not name:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the model's name is required")
        url = f"{self.management_url}/models/{name}" + (f"/{version}" if version else "")
        response = self._get(url + ("?customized=true" if customized else ""), context)
        if response.status_code != 200:
            context.abort(status_code(response.status_code), self._reason(response))
        versions = response.json()
        default = next((v for v in versions if v.get("isDefault") or v.get("modelVersion") == version), versions[0])
        return {**default, "versions": [str(v.get("modelVersion", "")) for v in versions]}

    # -- the service ---------------------------------------------------------

    def server_live(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            live = self._session.get(f"{self.inference_url}/ping", timeout=5).status_code < 500
        except requests.RequestException:
            live = False
        return message_class("ServerLiveResponse")(live=live)

    def server_ready(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            response = self._session.get(f"{self.inference_url}/ping", timeout=5)
            ready = response.status_code == 200 and response.json().get("status") == "Healthy"
        except (requests.RequestException, ValueError):
            ready = False
        return message_class("ServerReadyResponse")(ready=ready)

    def model_ready(self, request: Any, context: grpc.ServicerContext) -> Any:
        model = self._model(request.name, request.version, context)
        ready = any(w.get("status") == "READY" for w in model.get("workers", []))
        return message_class("ModelReadyResponse")(ready=ready)

    def server_metadata(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            version = importlib.metadata.version("torchserve")
        except importlib.metadata.PackageNotFoundError:
            version = ""
        return message_class("ServerMetadataResponse")(name="torchserve", version=version,
                                                       extensions=["binary_tensor_data"])  # fmt: skip

    def model_metadata(self, request: Any, context: grpc.ServicerContext) -> Any:
        model = self._model(request.name, request.version, context, customized=True)
        signature: dict[str, Any] = {}
        raw = model.get("customizedMetadata")
        if raw:
            try:
                signature = json.loads(raw) if isinstance(raw, str) else dict(raw)
            except (ValueError, TypeError):
                signature = {}
        response = message_class("ModelMetadataResponse")(
            name=request.name, versions=model["versions"], platform=str(signature.get("platform", "pytorch"))
        )
        for kind in ("inputs", "outputs"):
            for tensor in signature.get(kind, []):
                getattr(response, kind).add(name=tensor["name"], datatype=tensor["datatype"],
                                            shape=[int(d) for d in tensor["shape"]])  # fmt: skip
        return response

    def model_infer(self, request: Any, context: grpc.ServicerContext) -> Any:
        raw = list(request.raw_input_contents)
        try:
            inputs = [(t.name, t.datatype, list(t.shape), input_bytes(t, raw, i)) for i, t in enumerate(request.inputs)]
        except oip.OipError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        parameters = {k: parameter_value(v) for k, v in request.parameters.items()}
        body, header_length = oip.binary_request(inputs, request.id or None, [o.name for o in request.outputs],
                                                 parameters)  # fmt: skip
        name, version = request.model_name, request.model_version
        if not name:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model_name is required")
        url = (f"{self.inference_url}/predictions/{name}/{version}" if version
               else f"{self.inference_url}/v2/models/{name}/infer")  # fmt: skip
        try:
            response = self._session.post(url, data=body, timeout=self.timeout_s,
                                          headers={oip.HEADER_LENGTH: str(header_length),
                                                   "Content-Type": "application/octet-stream"})  # fmt: skip
        except requests.RequestException as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"TorchServe unreachable: {exc}")
        if response.status_code != 200:
            context.abort(status_code(response.status_code), self._reason(response))
        try:
            header, tensors = oip.parse_response(
                response.content, _int_or_none(response.headers.get(oip.HEADER_LENGTH))
            )
        except oip.OipError as exc:
            context.abort(grpc.StatusCode.INTERNAL, f"the handler's answer is not a v2 response: {exc}")
        reply = message_class("ModelInferResponse")(model_name=str(header.get("model_name", name)),
                                                    model_version=str(header.get("model_version", version)),
                                                    id=str(header.get("id") or request.id))  # fmt: skip
        for tensor in tensors:
            reply.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=list(tensor.shape))
            reply.raw_output_contents.append(oip.binary_bytes(tensor.array, tensor.datatype))
        return reply


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
