"""Typed clients for TorchServe's inference, management and metrics APIs.

Thin on purpose: each method is one documented TorchServe call, returns plain
data, and raises ``TorchServeAPIError`` with TorchServe's own message when the
call fails, so a caller sees why (unknown model, bad parameter, timeout).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import requests


class TorchServeAPIError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def _raise_for(resp: requests.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        message = resp.json().get("message", resp.text)
    except ValueError:
        message = resp.text
    raise TorchServeAPIError(resp.status_code, message.strip())


@dataclass(frozen=True)
class Prediction:
    """One inference answer: the HTTP status and the decoded body."""

    status: int
    body: Any
    latency_s: float

    @property
    def ok(self) -> bool:
        return self.status == 200


class InferenceClient:
    def __init__(self, base_url: str, timeout_s: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.session = requests.Session()

    def ping(self) -> bool:
        try:
            return self.session.get(f"{self.base_url}/ping", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def predict(
        self,
        model: str,
        payload: bytes | dict | list | str,
        version: str | None = None,
        content_type: str | None = None,
    ) -> Prediction:
        """POST one request; never raises for an HTTP error status."""
        url = f"{self.base_url}/predictions/{model}" + (f"/{version}" if version else "")
        headers = {}
        if isinstance(payload, (dict, list)):
            data = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        elif isinstance(payload, str):
            data = payload.encode()
            headers["Content-Type"] = content_type or "application/json"
        else:
            data = payload
            headers["Content-Type"] = content_type or "application/octet-stream"
        start = time.perf_counter()
        resp = self.session.post(url, data=data, headers=headers, timeout=self.timeout_s)
        elapsed = time.perf_counter() - start
        try:
            body = resp.json()
        except ValueError:
            body = resp.text
        return Prediction(resp.status_code, body, elapsed)


class ManagementClient:
    def __init__(self, base_url: str, timeout_s: float = 900.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.session = requests.Session()

    def _call(self, method: str, path: str, **params: Any) -> Any:
        params = {k: v for k, v in params.items() if v is not None}
        resp = self.session.request(method, f"{self.base_url}{path}", params=params, timeout=self.timeout_s)
        _raise_for(resp)
        try:
            return resp.json()
        except ValueError:
            return resp.text

    def register(
        self,
        url: str,
        model_name: str | None = None,
        initial_workers: int = 1,
        batch_size: int | None = None,
        max_batch_delay_ms: int | None = None,
        response_timeout_s: int | None = None,
        synchronous: bool = True,
    ) -> Any:
        """Register an archive from the model store (``url`` is its file name)."""
        return self._call(
            "POST",
            "/models",
            url=url,
            model_name=model_name,
            initial_workers=initial_workers,
            batch_size=batch_size,
            max_batch_delay=max_batch_delay_ms,
            response_timeout=response_timeout_s,
            synchronous=str(synchronous).lower(),
        )

    def scale(self, model: str, workers: int, version: str | None = None, synchronous: bool = True) -> Any:
        path = f"/models/{model}" + (f"/{version}" if version else "")
        return self._call("PUT", path, min_worker=workers, max_worker=workers, synchronous=str(synchronous).lower())

    def unregister(self, model: str, version: str | None = None) -> Any:
        return self._call("DELETE", f"/models/{model}" + (f"/{version}" if version else ""))

    def set_default(self, model: str, version: str) -> Any:
        return self._call("PUT", f"/models/{model}/{version}/set-default")

    def describe(self, model: str, version: str | None = None) -> list[dict[str, Any]]:
        """One entry per version (``version="all"`` lists every version)."""
        return self._call("GET", f"/models/{model}" + (f"/{version}" if version else ""))

    def list_models(self) -> list[dict[str, Any]]:
        return self._call("GET", "/models").get("models", [])


class MetricsClient:
    def __init__(self, base_url: str, timeout_s: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def text(self) -> str:
        resp = requests.get(f"{self.base_url}/metrics", timeout=self.timeout_s)
        _raise_for(resp)
        return resp.text

    def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        """Parsed samples of one Prometheus metric family: (labels, value)."""
        out = []
        for line in self.text().splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            labels: dict[str, str] = {}
            if "{" in head:
                metric, _, rest = head.partition("{")
                if metric != name:
                    continue
                for part in rest.rstrip("}").split(","):
                    if "=" in part:
                        key, _, val = part.partition("=")
                        labels[key.strip()] = val.strip().strip('"')
            elif head != name:
                continue
            out.append((labels, float(value)))
        return out
