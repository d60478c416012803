"""The REEF handler: several models in one worker, real-time requests first.

A REEF archive (``packrat archive --handler reef --models a,b``) holds every
model of a group; TorchServe registers it as one model with one worker,
which loads them all and runs them through one ``ReefEngine``.  A request
names its model with the ``X-Model`` header (optional when the archive has
one model) and may name its priority with ``X-Priority`` (``config.py``
says which wins).  Bad routing is the request's own 4xx: an unknown model
404, an unknown priority 400, before its body is decoded.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from handlers.codecs import DEFAULT_MAX_PAYLOAD_BYTES, InputCodec, ModelInput
from handlers.errors import RequestError, bad_request
from handlers.reef.config import MODEL_HEADER, PRIORITY_HEADER, REALTIME, ReefConfig
from handlers.reef.engine import Member, ReefEngine, Route
from handlers.runtime.async_handler import (
    DEFAULT_RESPONSE_TIMEOUT_S,
    AsyncModelHandler,
    Bind,
    declared_inputs,
    parse_encode_answers,
)
from handlers.runtime.decode import LANE, DecodeFn, RequestDecoder, default_decode_placement, parse_decode_threads
from handlers.runtime.device import ExecutionDevice
from handlers.runtime.heap import freeze_startup_heap
from handlers.runtime.metrics import HandlerMetrics
from handlers.runtime.model_loading import load_model
from handlers.runtime.segments import dynamic_dims_for, slice_model
from model_store.catalog import ModelSpec
from model_store.factory import outputs_close

logger = logging.getLogger(__name__)

ENGINE_KEY = "reef"
# CPU: decoding beside the running batch on one thread; REEF has no lanes to queue decodes on.
CPU_DECODE_THREADS = 1


def request_headers(context: Any, index: int) -> dict[str, str]:
    """A request's headers by lower-case name (HTTP names are case-insensitive; TorchServe keeps the client's)."""
    try:
        headers = context.get_all_request_header(index) or {}
    except (AttributeError, IndexError, TypeError):  # a context without request processors (driven directly)
        return {}
    return {str(k).lower(): str(v) for k, v in headers.items()}


class ReefHandler(AsyncModelHandler):
    def __init__(self) -> None:
        super().__init__()
        self.config = ReefConfig()
        self.codecs: dict[str, InputCodec] = {}
        self.encode_setting: str | None = None  # the archive's encode_answers (None: by priority)

    def create_engine(self, layout_example: ModelInput) -> ReefEngine:
        raise NotImplementedError("REEF builds one engine for all of its models in initialize")

    def initialize(self, context: Any) -> None:
        model_config = getattr(context, "model_yaml_config", None) or {}
        handler_config = model_config.get("handler") or {}
        entries = handler_config.get("members")
        if not entries:
            raise RuntimeError("archive model-config.yaml lacks handler.members; rebuild it with --handler reef")
        self.config = ReefConfig.from_dict(handler_config.get("reef"))
        specs = [ModelSpec.from_dict(entry["spec"]) for entry in entries]
        self.config.check_members([spec.name for spec in specs])
        self.response_timeout_s = float(model_config.get("responseTimeout", DEFAULT_RESPONSE_TIMEOUT_S))
        max_payload = int(handler_config.get("max_payload_bytes", DEFAULT_MAX_PAYLOAD_BYTES))
        self.configure_runtime(context)
        self.device = ExecutionDevice.from_context(context)
        self.cpu_threads = torch.get_num_threads()
        if not self.device.is_cuda:
            # This thread runs the event loop; the RT executor's team owns the cores.  Set before the
            # models load and are sliced: a team formed here stays, and a second team in the process
            # slows the RT executor's (``engine.py``'s docstring).
            torch.set_num_threads(1)
        model_dir = context.system_properties["model_dir"]
        members = []
        for spec, entry in zip(specs, entries, strict=True):
            if spec.mode != "eager":
                raise RuntimeError(f"REEF segments eager models; {spec.name} is {spec.mode!r}: rebuild it eager")
            codec = self.codecs[spec.name] = InputCodec(spec, max_payload)
            model = load_model(spec, os.path.join(model_dir, entry["artefact"]), self.device.device)
            example = declared_inputs(codec)[0]
            rows = tuple(t.unsqueeze(0).expand(2, *t.shape).clone().to(self.device.device) for t in example.tensors)
            sliced = slice_model(
                model, rows, self.config.segments, dynamic_dims_for(spec.input_kind), repeats=1,
                check=lambda got, expected: outputs_close(got, expected, 1e-4),
            )  # fmt: skip
            members.append(Member(spec.name, model, sliced, example))
            logger.info("REEF: %s in %d segments of %s graph nodes", spec.name, len(sliced), [s.nodes for s in sliced])
        self.spec, self.codec = specs[0], self.codecs[specs[0].name]
        self.decoder = self._reef_decoder(handler_config.get("decode_threads"))
        self.encode_setting = parse_encode_answers(handler_config.get("encode_answers"))
        self.encode_on_engine = self._encode_on_engine(self.encode_setting)
        self.metrics = HandlerMetrics.for_worker(context, handler_config)
        engine = ReefEngine(members, self.device, self.config, self.metrics, self.cpu_threads)
        engine.warm_up()
        self.engines = {ENGINE_KEY: engine}
        pump = self.install_worker_pump(handler_config.get("worker_pump"))
        freeze_startup_heap()
        self.initialized = True
        logger.info(
            "ReefHandler serving %s on %s (%s; real-time by default: %s), decoding %s, %s message pump",
            ", ".join(self.codecs),
            self.device,
            engine,
            ", ".join(self.config.realtime) or "none",
            self.decoder.where,
            pump,
        )

    def encodes_on_engine(self, item: ModelInput) -> bool:
        """By default a real-time batch's answers are encoded on the RT executor, in one call as the batch
        ends: it runs alone (best-effort units wait at the gate until it is done), so its encoding
        starts no OpenMP team beside another, and the event loop is spared the torch and JSON work per
        request (~40 µs each on a one-layer BERT: ``docs/benchmarks/host_path.md``).  Best-effort answers
        stay on the loop (see ``_encode_on_engine``).  ``encode_answers`` set in the archive decides
        for both."""
        if self.encode_setting is None:
            return getattr(item, "priority", None) == REALTIME
        return self.encode_on_engine

    def row_engine(self) -> ReefEngine | None:
        """On CPU, real-time requests are taken undecoded (``ReefEngine.take_rows``): the RT executor
        decodes, runs and encodes each batch, where their answers are encoded anyway (unless the
        archive's ``encode_answers: loop`` says otherwise).  Best-effort requests are admitted as before."""
        engine = self.engines.get(ENGINE_KEY)
        if engine is None or not engine.takes_rows:
            return None
        return engine if self.encode_setting is None or self.encode_on_engine else None

    def _reef_decoder(self, setting: Any) -> RequestDecoder:
        placement = parse_decode_threads(setting)
        if placement == LANE:
            raise RuntimeError("REEF has no CPU lanes to decode on; set decode_threads to a thread count")
        if placement is None:
            placement = default_decode_placement(True) if self.device.is_cuda else CPU_DECODE_THREADS
        return RequestDecoder(self.codec.decode, threads=placement)

    def route_request(self, row: dict[str, Any], context: Any, index: int) -> tuple[DecodeFn, Bind]:
        """The member the request names (``X-Model``) decodes it, at the priority it asks for."""
        headers = request_headers(context, index)
        name = headers.get(MODEL_HEADER)
        if name is None:
            if len(self.codecs) > 1:
                raise bad_request(f"name the model with an X-Model header: one of {', '.join(self.codecs)}")
            name = self.spec.name
        if name not in self.codecs:
            raise RequestError(404, f"unknown model {name!r} (X-Model); this archive serves {', '.join(self.codecs)}")
        priority = self.config.priority(name, headers.get(PRIORITY_HEADER))
        return self.codecs[name].decode, Route(name, priority)

    def v2_signature(self) -> dict[str, Any]:
        """One signature per member model (a request names its member with the X-Model header)."""
        return {"name": self.spec.name, "members": [codec.v2_signature() for codec in self.codecs.values()]}

    def codec_for(self, item: ModelInput) -> InputCodec:
        return self.codecs[getattr(item, "model", "") or self.spec.name]

    def engine_key(self, item: ModelInput) -> Any:
        return ENGINE_KEY
