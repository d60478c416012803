"""The controller's status endpoint: ``GET /status`` answers its state as JSON (``packrat status``), ``GET /metrics``
the same state as Prometheus metrics (``metrics_export.py``)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from packrat_plugin.metrics_export import CONTENT_TYPE, prometheus_text


class _StatusHandler(BaseHTTPRequestHandler):
    status: Callable[[], dict[str, Any]]

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0].rstrip("/")
        if path in ("/status", ""):
            body, content_type = json.dumps(type(self).status(), indent=2).encode(), "application/json"
        elif path == "/metrics":
            body, content_type = prometheus_text(type(self).status()).encode(), CONTENT_TYPE
        else:
            self.send_error(404, "try /status or /metrics")
            return
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:  # keep the console for the controller's own log
        pass


class StatusServer:
    """An HTTP server on its own thread that answers ``status()`` at ``/status`` (loopback unless
    ``host`` says otherwise: in a pod, Prometheus scrapes ``/metrics`` from outside it)."""

    def __init__(self, status: Callable[[], dict[str, Any]], port: int = 0, host: str = "127.0.0.1") -> None:
        handler = type("StatusHandler", (_StatusHandler,), {"status": staticmethod(status)})
        self._http = ThreadingHTTPServer((host, port), handler)
        threading.Thread(target=self._http.serve_forever, daemon=True, name="packrat-status").start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}/status"

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
