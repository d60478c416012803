"""Serves a scikit-learn pipeline as its translated tensor program (WindTunnel).

A request is JSON: one row (an object of named columns) or ``{"rows": [...]}``
with up to ``max_rows`` rows.  The answer is
``{"classes": [...], "probabilities": [[...], ...]}`` (``"decision"`` for a
LinearSVC), one list per row, in order.  Every request of TorchServe's batch
is validated alone: a malformed body, a missing column, a wrong type or an
unknown category fails that request with a 4xx naming the problem, and the
others' rows run together in one forward pass.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from handlers.codecs import answer_bytes, check_payload_size, parse_json, request_payload
from handlers.errors import RequestError, bad_request
from windtunnel.translate import RowError, translate

logger = logging.getLogger(__name__)


class WindTunnelModelHandler:
    def __init__(self) -> None:
        self.initialized = False
        self.model = None
        self.max_rows = 4096
        self.max_payload_bytes = 4 * 1024 * 1024

    def initialize(self, context: Any) -> None:
        import joblib  # scikit-learn's pickles: only the worker that loads a pipeline needs it

        started = time.perf_counter()
        settings = ((getattr(context, "model_yaml_config", None) or {}).get("handler") or {}).get("windtunnel")
        if settings is None:
            raise RuntimeError("archive model-config.yaml lacks handler.windtunnel; build it with "
                               "`packrat sklearn-archive`")  # fmt: skip
        model_dir = context.system_properties["model_dir"]
        pipeline = joblib.load(os.path.join(model_dir, context.manifest["model"]["serializedFile"]))
        model = translate(pipeline, settings.get("columns"))
        weights = os.path.join(model_dir, "weights.pt")
        if os.path.exists(weights):
            model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
        model.set_soft(bool(settings.get("soft", False)))
        self.model = model.eval()
        self.max_rows = int(settings.get("max_rows", self.max_rows))
        self.max_payload_bytes = int(settings.get("max_payload_bytes", self.max_payload_bytes))
        self.initialized = True
        logger.info("serving a %s pipeline over %d columns (%s trees) in %.2f s", type(pipeline).__name__,
                    len(model.columns), "soft" if settings.get("soft") else "hard",
                    time.perf_counter() - started)  # fmt: skip

    def rows_of(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        """One request's rows, or a RequestError saying what is wrong with it."""
        value = request_payload(request)
        if isinstance(value, (bytes, bytearray)):
            check_payload_size(value, self.max_payload_bytes)
            value = parse_json(value)
        elif isinstance(value, str):
            value = parse_json(value)
        if isinstance(value, dict) and "rows" in value:
            rows = value["rows"]
            if not isinstance(rows, list) or not rows:
                raise bad_request("'rows' must be a non-empty list of objects")
        elif isinstance(value, dict):
            rows = [value]
        else:
            raise bad_request(f"expected a row object or {{'rows': [...]}}, got {type(value).__name__}")
        if len(rows) > self.max_rows:
            raise RequestError(413, f"{len(rows)} rows exceed the limit of {self.max_rows} per request")
        return rows

    def encode(self, request: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's rows as the model's tensors, or a RequestError naming what is wrong."""
        try:
            return self.model.encode_rows(self.rows_of(request))
        except RowError as exc:
            raise bad_request(str(exc)) from None

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[Any]:
        responses: list[Any] = [None] * len(data)
        numeric, codes, spans = [], [], []
        for index, request in enumerate(data):
            try:
                x, c = self.encode(request)
            except RequestError as err:
                responses[index] = err.answer(context, index)
                logger.info("request %d refused: %d %s", index, err.status, err.reason)
                continue
            spans.append((index, len(x)))
            numeric.append(x)
            codes.append(c)
        if spans:
            with torch.inference_mode():
                out = self.model(torch.cat(numeric), torch.cat(codes)).tolist()
            key = "decision" if self.model.output == "decision" else "probabilities"
            start = 0
            for index, count in spans:
                responses[index] = answer_bytes({"classes": self.model.classes, key: out[start : start + count]})
                start += count
        return responses
