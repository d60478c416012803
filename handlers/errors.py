"""Client-facing request errors.

A ``RequestError`` carries an HTTP status and a one-line reason that names
the problem.  It subclasses TorchServe's ``PredictionException`` so that,
raised outside the per-request path, TorchServe still answers with its code;
inside a batch the handler catches it and fails only that request.
"""

from __future__ import annotations

import json

from ts.utils.util import PredictionException

_STATUS_TYPES = {
    400: "BadRequest",
    404: "NotFound",
    413: "PayloadTooLarge",
    415: "UnsupportedMediaType",
    422: "UnprocessableEntity",
}


class RequestError(PredictionException):
    """A request the server refuses; the server itself is fine."""

    def __init__(self, status: int, reason: str) -> None:
        if not 400 <= status < 500:
            raise ValueError(f"RequestError is for 4xx statuses, got {status}")
        # One line: reasons travel in HTTP reason phrases and log lines.
        reason = " ".join(reason.split())
        super().__init__(reason, status)
        self.status = status
        self.reason = reason

    def body(self) -> str:
        """JSON body in TorchServe's own error shape (code, type, message)."""
        return json.dumps(
            {"code": self.status, "type": _STATUS_TYPES.get(self.status, "ClientError"), "message": self.reason}
        )


def bad_request(reason: str) -> RequestError:
    return RequestError(400, reason)
