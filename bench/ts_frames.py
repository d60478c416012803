"""The frontend's side of TorchServe's worker protocol, to drive a worker's message pump in-process.

TorchServe's Java frontend writes each inference message to the worker's
socket as ``b"I"``, then each request (id, headers, parameters, each list
closed by -1) and a closing -1; the worker answers with the frame that
``ts.protocol.otf_message_handler.create_predict_response`` builds.  The
worker side here is always TorchServe's own code (``retrieve_msg``,
``create_predict_response``); only the frontend is written out, so the
message pump (``handlers/runtime/worker_pump.py``) can be tested and timed
without Java, and the lent GPU machine, which has none, can run it too.
``torchserve_service`` builds the worker side's ``Service`` as TorchServe's
worker does.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Request:
    request_id: str
    body: bytes
    content_type: str = "application/octet-stream"
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Answer:
    request_id: str
    status: int
    phrase: str
    content_type: str
    headers: dict[str, str]
    body: bytes


def _sized(data: bytes) -> bytes:
    return struct.pack("!i", len(data)) + data


def inference_frame(requests: list[Request]) -> bytes:
    """One inference message as the frontend writes it."""
    out = bytearray(b"I")
    for request in requests:
        out += _sized(request.request_id.encode())
        for name, value in request.headers:
            out += _sized(name.encode()) + _sized(value.encode())
        out += struct.pack("!i", -1)
        out += _sized(b"body") + _sized(request.content_type.encode()) + _sized(request.body)
        out += struct.pack("!i", -1)
    out += struct.pack("!i", -1)
    return bytes(out)


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the worker closed the socket mid-frame")
        data += chunk
    return bytes(data)


def _int(sock: socket.socket) -> int:
    return struct.unpack("!i", _exactly(sock, 4))[0]


def _string(sock: socket.socket) -> bytes:
    return _exactly(sock, _int(sock))


def read_answer_frame(sock: socket.socket) -> tuple[int, str, list[Answer]]:
    """One answer frame: the message's code and text, and each request's answer."""
    code = _int(sock)
    message = _string(sock).decode()
    answers = []
    while (length := _int(sock)) != -1:
        request_id = _exactly(sock, length).decode()
        content_type = _string(sock).decode()
        status = _int(sock)
        phrase = _string(sock).decode()
        headers = {}
        for _ in range(_int(sock)):
            name = _string(sock).decode()
            headers[name] = _string(sock).decode()
        answers.append(Answer(request_id, status, phrase, content_type, headers, _string(sock)))
    return code, message, answers


STREAM_NEXT = "ts_stream_next"  # TorchServe's header: "true" on a streamed answer's parts, "false" on its end


def read_answers(sock: socket.socket, requests: int, error_ends: bool = True) -> list[tuple[int, Answer]]:
    """The next ``requests`` answers as TorchServe's frontend delivers them to clients, each with the
    code of the frame that began it: an answer sent whole in one frame, or as a stream
    (``ts_stream_next: true`` on its parts, ``false`` on its end) read to its end, its parts' bodies
    joined; an answer keeps its first part's status and headers, as the client's HTTP response does.

    ``error_ends`` (the lean pump's framing, ``worker_pump.framed_final``): a request's error sent
    whole in a frame that succeeded is followed by an empty end for its request, which the frontend
    takes as leave to forget the request and delivers nothing of; read and dropped here, the last too.
    """
    done: list[tuple[int, Answer]] = []
    streaming: dict[str, tuple[int, Answer]] = {}
    ending: set[str] = set()  # errors sent whole, their ends still to come
    while len(done) < requests or ending:
        code, _, answers = read_answer_frame(sock)
        for part in answers:
            if part.request_id in ending and part.headers.get(STREAM_NEXT) == "false":
                ending.discard(part.request_id)
                continue
            opened = streaming.pop(part.request_id, None)
            if opened is None:
                code_of, answer = code, part
            else:
                code_of, answer = opened[0], replace(opened[1], body=opened[1].body + part.body)
            if part.headers.get(STREAM_NEXT) == "true":
                streaming[part.request_id] = (code_of, answer)
            else:
                done.append((code_of, answer))
                if (
                    error_ends
                    and code == 200
                    and opened is None
                    and STREAM_NEXT not in part.headers
                    and part.status >= 400
                ):
                    ending.add(part.request_id)
    return done


def torchserve_service(entry_point: Any, cl_socket: socket.socket, model_dir: str, manifest: dict | None = None) -> Any:
    """TorchServe's own ``Service`` around ``entry_point``, with the metrics cache its worker builds.

    ``manifest`` may name a ``configFile`` in ``model_dir``: the context then
    carries that model-config.yaml, as a worker's does.
    """
    import ts
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
    from ts.service import Service

    metrics = MetricsCacheYamlImpl(config_file_path=str(Path(ts.__file__).parent / "configs" / "metrics.yaml"))
    metrics.initialize_cache()
    metrics.model_name = "pumped"
    service = Service("pumped", model_dir, manifest, entry_point, None, 1, True, metrics)
    service.set_cl_socket(cl_socket)
    return service
