"""Serves a scikit-learn pipeline as its translated tensor program (WindTunnel).

A request is JSON: one row (an object of named columns) or ``{"rows": [...]}``
with up to ``max_rows`` rows.  The answer is
``{"classes": [...], "probabilities": [[...], ...]}`` (``"decision"`` for a
LinearSVC), one list per row, in order; a regressor's is ``{"predictions":
[...]}``, one number per row.  Or an Open Inference Protocol (v2)
request with one input tensor per column, each of shape ``[N]`` or
``[N, 1]`` (numbers for a numeric column, BYTES or numbers for a
categorical one), answered with ``probabilities`` (or ``decision``) FP64
``[N, classes]`` and ``label`` BYTES ``[N]``, or a regressor's ``prediction``
FP64 ``[N]``.  Every request of TorchServe's batch
is validated alone: a malformed body, a missing column, a wrong type or an
unknown category fails that request with a 4xx naming the problem, and the
others' rows run together in one forward pass.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np
import torch

from handlers.codecs import (
    answer_bytes,
    check_payload_size,
    is_describe,
    parse_json,
    parse_json_or_v2,
    request_payload,
)
from handlers.errors import RequestError, bad_request
from serving_harness import oip
from windtunnel.translate import CATEGORICAL, RowError, translate

logger = logging.getLogger(__name__)


class WindTunnelModelHandler:
    def __init__(self) -> None:
        self.initialized = False
        self.model = None
        self.name = "windtunnel"
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
        self.name = context.manifest["model"].get("modelName", "windtunnel")
        self.max_rows = int(settings.get("max_rows", self.max_rows))
        self.max_payload_bytes = int(settings.get("max_payload_bytes", self.max_payload_bytes))
        self.initialized = True
        logger.info("serving a %s pipeline over %d columns (%s trees) in %.2f s", type(pipeline).__name__,
                    len(model.columns), "soft" if settings.get("soft") else "hard",
                    time.perf_counter() - started)  # fmt: skip

    def rows_of(self, request: dict[str, Any]) -> tuple[list[dict[str, Any]] | dict[str, Any], oip.InferRequest | None]:
        """One request's rows (JSON: a list of row objects; v2: the columns by name) and, for a v2 request,
        the request; or a RequestError saying what is wrong."""
        value = request_payload(request)
        if isinstance(value, (bytes, bytearray)):
            check_payload_size(value, self.max_payload_bytes)
            value = parse_json_or_v2(value)
        elif isinstance(value, str):
            value = parse_json(value)
        if isinstance(value, oip.InferRequest) or oip.is_request(value):
            try:
                v2 = value if isinstance(value, oip.InferRequest) else oip.parse_request(value)
                return self.columns_of_v2(v2), v2
            except oip.OipError as exc:
                raise RequestError(exc.status, str(exc)) from None
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
        return rows, None

    def columns_of_v2(self, request: oip.InferRequest) -> dict[str, Any]:
        """A v2 request's columns: one input tensor per column, ``[N]`` or ``[N, 1]``, all of one N; numbers
        stay arrays, for ``encode_columns`` to take whole."""
        names = [c.name for c in self.model.columns]
        unknown = [name for name in request.inputs if name not in names]
        if unknown:
            raise oip.OipError(f"unknown input '{unknown[0]}' (the pipeline's columns are {names})")
        outputs = (self.output_key, "label")
        bad = next((name for name in request.outputs if name not in outputs), None)
        if bad is not None:
            raise oip.OipError(f"unknown output '{bad}' (the pipeline answers {list(outputs)})")
        columns: dict[str, Any] = {}
        for col in self.model.columns:
            tensor = request.get(col.name)
            array = tensor.array
            if array.ndim == 2 and array.shape[1] == 1:
                array = array[:, 0]
            if array.ndim != 1:
                raise oip.OipError(f"input '{col.name}': shape {list(tensor.shape)}, expected [N] or [N, 1]")
            if tensor.datatype == "BYTES":
                if col.kind != CATEGORICAL:
                    raise oip.OipError(f"input '{col.name}': a numeric column, got BYTES")
                columns[col.name] = [v.decode("utf-8", "replace") for v in array]
            else:
                columns[col.name] = array
        counts = {len(v) for v in columns.values()}
        if len(counts) != 1:
            raise oip.OipError(f"inputs hold different numbers of rows: {sorted(counts)}")
        (count,) = counts
        if count == 0:
            raise oip.OipError("inputs hold no rows")
        if count > self.max_rows:
            raise oip.OipError(f"{count} rows exceed the limit of {self.max_rows} per request", status=413)
        return columns

    @property
    def output_key(self) -> str:
        return {"decision": "decision", "prediction": "prediction"}.get(self.model.output, "probabilities")

    def encode(self, request: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, oip.InferRequest | None]:
        """One request's rows as the model's tensors (and its v2 request, if it was one), or a
        RequestError naming what is wrong."""
        rows, v2 = self.rows_of(request)
        try:
            if isinstance(rows, dict):
                return (*self.model.encode_columns(rows), v2)
            return (*self.model.encode_rows(rows), v2)
        except RowError as exc:
            raise bad_request(str(exc)) from None

    def answer(self, out: list[list[float]], v2: oip.InferRequest | None) -> bytes:
        """One request's rows' outputs, in the wire format the request came in."""
        if self.model.output == "prediction":  # a regressor: one number per row, no classes
            if v2 is None:
                return answer_bytes({"predictions": out})
            outputs = oip.select_outputs(v2, [("prediction", np.asarray(out, dtype=np.float64))])
            return oip.response_body(self.name, outputs, v2.id)
        if v2 is None:
            return answer_bytes({"classes": self.model.classes, self.output_key: out})
        scores = np.asarray(out, dtype=np.float64)
        classes = np.asarray(self.model.classes, dtype=object)
        # A binary decision function gives one score per row, positive for the second class.
        labels = classes[(scores > 0).astype(int)] if scores.ndim == 1 else classes[scores.argmax(axis=1)]
        labels = np.asarray([str(c).encode() for c in labels], dtype=object)
        outputs = oip.select_outputs(v2, [(self.output_key, scores), ("label", labels)])
        return oip.response_body(self.name, outputs, v2.id)

    def v2_signature(self) -> dict[str, Any]:
        """The pipeline's Open Inference Protocol signature: a tensor per column, ``N`` rows (-1)."""
        inputs = [{"name": c.name, "datatype": "BYTES" if c.kind == CATEGORICAL else "FP64", "shape": [-1]}
                  for c in self.model.columns]  # fmt: skip
        width = -1 if self.output_key == "decision" else len(self.model.classes)
        outputs = [{"name": self.output_key, "datatype": "FP64", "shape": [-1, width]},
                   {"name": "label", "datatype": "BYTES", "shape": [-1]}]  # fmt: skip
        if self.model.output == "prediction":
            outputs = [{"name": "prediction", "datatype": "FP64", "shape": [-1]}]
        return {"name": self.name, "platform": "pytorch (WindTunnel)", "inputs": inputs, "outputs": outputs,
                "classes": [str(c) for c in self.model.classes]}  # fmt: skip

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[Any]:
        if is_describe(context):
            return [answer_bytes(self.v2_signature())]
        responses: list[Any] = [None] * len(data)
        numeric, codes, spans, v2s = [], [], [], []
        for index, request in enumerate(data):
            try:
                x, c, v2 = self.encode(request)
            except RequestError as err:
                responses[index] = err.answer(context, index)
                logger.info("request %d refused: %d %s", index, err.status, err.reason)
                continue
            spans.append((index, len(x)))
            v2s.append(v2)
            numeric.append(x)
            codes.append(c)
        if spans:
            with torch.inference_mode():
                out = self.model(torch.cat(numeric), torch.cat(codes)).tolist()
            start = 0
            for (index, count), v2 in zip(spans, v2s, strict=True):
                responses[index] = self.answer(out[start : start + count], v2)
                start += count
        return responses
