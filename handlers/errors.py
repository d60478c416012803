"""Errors a handler answers a single request with.

A ``ResponseError`` carries an HTTP status and a one-line reason that names
the problem.  It subclasses TorchServe's ``PredictionException`` so that,
raised outside the per-request path, TorchServe still answers with its code;
inside a batch the handler catches it and fails only that request.

``RequestError`` (4xx) means the request is at fault and the server is fine;
``ServiceUnavailable`` (503) means the request was fine but this worker
could not serve it (input pool full past the response timeout, shutting
down, inference failed), so a client may retry.
"""

from __future__ import annotations

import json
from typing import Any

from ts.utils.util import PredictionException

_STATUS_TYPES = {
    400: "BadRequest",
    404: "NotFound",
    413: "PayloadTooLarge",
    415: "UnsupportedMediaType",
    422: "UnprocessableEntity",
    503: "ServiceUnavailable",
}


class ResponseError(PredictionException):
    """One request's error answer: status, reason, TorchServe-shaped body."""

    def __init__(self, status: int, reason: str) -> None:
        # One line: reasons travel in HTTP reason phrases and log lines.
        reason = " ".join(reason.split())
        super().__init__(reason, status)
        self.status = status
        self.reason = reason

    def answer(self, context: Any, index: int) -> str:
        """Set request ``index``'s status and content type on TorchServe's
        context; the body to answer it with."""
        context.set_response_status(code=self.status, phrase=self.reason, idx=index)
        context.set_response_content_type(index, "application/json")
        return self.body()

    def body(self) -> str:
        """JSON body in TorchServe's own error shape (code, type, message), plus the Open Inference
        Protocol's (``error``), so that v2 clients (tritonclient, KServe's) read the reason too."""
        kind = _STATUS_TYPES.get(self.status, "ClientError" if self.status < 500 else "ServerError")
        return json.dumps({"code": self.status, "type": kind, "message": self.reason, "error": self.reason})


class RequestError(ResponseError):
    """A request the server refuses; the server itself is fine."""

    def __init__(self, status: int, reason: str) -> None:
        if not 400 <= status < 500:
            raise ValueError(f"RequestError is for 4xx statuses, got {status}")
        super().__init__(status, reason)


class ServiceUnavailable(ResponseError):
    """A good request this worker could not serve; retrying may succeed."""

    def __init__(self, reason: str) -> None:
        super().__init__(503, reason)


def bad_request(reason: str) -> RequestError:
    return RequestError(400, reason)


def inference_failed(error: BaseException) -> ServiceUnavailable:
    """The 503 for a request whose batch raised: the model's error, named, in one line."""
    return ServiceUnavailable(f"inference failed: {type(error).__name__}: {error}")


def encode_failed(error: BaseException) -> ServiceUnavailable:
    """The 503 for a request whose output could not be turned into its answer."""
    return ServiceUnavailable(f"could not encode the answer: {type(error).__name__}: {error}")


def shut_down() -> ServiceUnavailable:
    """The 503 for a request its worker closed before answering: the client may retry elsewhere."""
    return ServiceUnavailable("worker shut down before this request finished")
