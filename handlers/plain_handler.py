"""The plain handler: one catalog vision or text model, batched by TorchServe, on CPU or CUDA.

TorchServe's template (initialize / preprocess / inference / postprocess),
with one difference from its ``BaseHandler``: a bad request fails alone.
``preprocess`` decodes each request separately and records a 4xx for the
ones that fail; only the good ones are batched and run, and ``handle`` puts
results and errors back in request order.  TorchServe answers each request
with the status set for its index (``context.set_response_status``).

``decode_threads: batched`` (image models) decodes the JPEGs of each batch
the frontend hands over in one call of torchvision's decoder, nvJPEG on
CUDA (``handlers/runtime/batched_decode.py``), as Ebird's batched placement
does; other bodies, and any JPEG that call cannot read, go through the
codec one by one.  On a GPU this is the stock handler given Ebird's decode,
so that a comparison of the two shows scheduling alone.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from handlers.codecs import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    InputCodec,
    ModelInput,
    answer_bytes,
    answers_for,
    collate,
    encode_outputs,
    is_describe,
)
from handlers.errors import RequestError
from handlers.pinning.worker import PackratWorkerMixin, process_age_s, startup_priority
from handlers.runtime.batched_decode import JpegBatchDecode
from handlers.runtime.cuda_graphs import GraphBuckets
from handlers.runtime.decode import BATCHED
from handlers.runtime.device import ExecutionDevice
from handlers.runtime.heap import freeze_startup_heap
from handlers.runtime.metrics import HandlerMetrics
from handlers.runtime.model_loading import load_model
from model_store.catalog import ModelSpec

logger = logging.getLogger(__name__)


def cuda_graphs_wanted(handler_cfg: dict[str, Any]) -> bool:
    """The archive's ``handler.cuda_graphs`` (default false): replay captured graphs on CUDA."""
    value = handler_cfg.get("cuda_graphs", False)
    if not isinstance(value, bool):
        raise RuntimeError(f"handler.cuda_graphs must be true or false, got {value!r}")
    return value


def jpeg_batches_wanted(handler_cfg: dict[str, Any]) -> bool:
    """The archive's ``handler.decode_threads`` for the plain handler: absent, or ``batched`` (it decodes on
    the worker's thread, in its batch, so thread counts and lanes do not apply)."""
    value = handler_cfg.get("decode_threads")
    if value is not None and value != BATCHED:
        raise RuntimeError(
            f"the plain handler decodes in its batch: decode_threads may only be 'batched', got {value!r}"
        )
    return value == BATCHED


def on_device(item: ModelInput, device: torch.device) -> ModelInput:
    """``item`` with its tensors on ``device`` (those already there are not copied)."""
    return ModelInput(tuple(t.to(device, non_blocking=True) for t in item.tensors), item.v2)


@dataclass
class Preprocessed:
    """Decoded requests of one batch, and the ones that failed decoding."""

    indices: list[int] = field(default_factory=list)
    inputs: list[ModelInput] = field(default_factory=list)
    errors: dict[int, RequestError] = field(default_factory=dict)


class PlainModelHandler(PackratWorkerMixin):
    """Serves one catalog model; reads everything it needs from the archive.

    Under a Packrat controller, ``configure_runtime`` (from the mixin) claims a
    slot and pins the worker before the model loads, and the model runs on
    the slot's CPU cores.  Without one, the model runs where TorchServe's own
    ``BaseHandler`` would run it: on the GPU TorchServe assigned this worker
    (``gpu_id``), else on the CPU.  Decoding and encoding stay on the CPU.
    """

    def __init__(self) -> None:
        self.initialized = False
        self.model: torch.nn.Module | None = None
        self.spec: ModelSpec | None = None
        self.codec: InputCodec | None = None
        self.metrics = HandlerMetrics(None, "")  # TorchServe's cache once warm-up is done
        self.device = ExecutionDevice("cpu")
        self.jpeg_batches: JpegBatchDecode | None = None

    # -- template methods ----------------------------------------------------

    def initialize(self, context: Any) -> None:
        spawn_s = process_age_s()
        handler_cfg = (getattr(context, "model_yaml_config", None) or {}).get("handler") or {}
        if "spec" not in handler_cfg:
            raise RuntimeError("archive model-config.yaml lacks handler.spec; rebuild it with `packrat archive`")
        self.spec = ModelSpec.from_dict(handler_cfg["spec"])
        self.codec = InputCodec(self.spec, int(handler_cfg.get("max_payload_bytes", DEFAULT_MAX_PAYLOAD_BYTES)))
        self.configure_runtime(context)
        if self.packrat_claim is None:
            self.device = ExecutionDevice.from_context(context)
        if jpeg_batches_wanted(handler_cfg):
            if self.spec.input_kind == "image":  # the metrics object is replaced below: look it up per call
                self.jpeg_batches = JpegBatchDecode(
                    self.codec, self.device.device, lambda n: self.metrics.decode_batch(n)
                )
            else:
                logger.warning("%s takes tokens: decode_threads 'batched' decodes nothing in batches", self.spec.name)
        with startup_priority():
            started = time.perf_counter()
            model_dir = context.system_properties["model_dir"]
            artefact = os.path.join(model_dir, context.manifest["model"]["serializedFile"])
            self.model = load_model(self.spec, artefact, self.device.device)
            batch = self.slot_batch or int(context.system_properties.get("batch_size") or 1)
            if cuda_graphs_wanted(handler_cfg) and self.device.is_cuda:
                self.model = self.captured(self.model, batch)
            loaded = time.perf_counter()
            self.warm_up(batch)
            warmed = time.perf_counter()
        self.metrics = HandlerMetrics.for_worker(context, handler_cfg)
        self.record_startup({"spawn_s": spawn_s, "load_s": loaded - started, "warmup_s": warmed - loaded})
        freeze_startup_heap()
        self.initialized = True
        logger.info(
            "serving %s in %s mode on %s with %d intra-op threads (start-up: %.2f s spawn+imports, %.2f s load, "
            "%.2f s warm-up)", self.spec.name, self.spec.mode, self.device.device, torch.get_num_threads(), spawn_s,
            loaded - started, warmed - loaded,
        )  # fmt: skip

    def captured(self, model: torch.nn.Module, batch: int) -> GraphBuckets:
        """``model`` as CUDA graphs, one per power of two up to ``batch`` (the frontend's batch size).

        Nimble's buckets (``handlers/runtime/cuda_graphs.py``) without
        Nimble's graph rewriting: the same execution Ebird's workers replay,
        so a comparison of the two shows scheduling alone.
        """
        example = tuple(t.unsqueeze(0).to(self.device.device) for t in self.client_sample().tensors)
        sizes = sorted({1 << k for k in range(batch.bit_length()) if 1 << k <= batch} | {batch})
        buckets = GraphBuckets(model, example, sizes)
        logger.info("captured CUDA graphs at batch sizes %s", sizes)
        return buckets

    def client_sample(self) -> ModelInput:
        """A request as a typical client sends it (a JPEG, token ids), decoded by this archive's codec."""
        from model_store.samples import client_payload, request_body

        return self.codec.decode({"body": request_body(client_payload(self.spec, seed=0))})

    def warm_up(self, batch: int = 1) -> None:
        """Send a client-shaped sample through the whole request path before READY.

        TorchServe marks a worker READY when ``initialize`` returns, and after a
        Packrat swap the new workers' first requests are real clients'.  Those
        would otherwise pay what runs only once: the codec's lazy imports (PIL,
        torchvision transforms: ~1.5 s measured on a 2-core VM), TorchScript's
        profiling run, torch.compile's compilation.  Batch 1 runs twice (the
        profiling executor optimises on the second call); the slot's batch
        size runs once more, so the largest shape is not first seen live.
        """
        sample = self.client_sample()
        for size in (1, 1, batch) if batch > 1 else (1, 1):
            self.postprocess(self.inference(collate([sample] * size)))

    def preprocess(self, data: list[dict[str, Any]]) -> Preprocessed:
        decoded: dict[int, ModelInput | Exception] = {}
        jpegs: dict[int, bytes] = {}
        for index, row in enumerate(data):
            try:
                raw = self.codec.jpeg_payload(row) if self.jpeg_batches is not None else None
                if raw is None:
                    decoded[index] = self.codec.decode(row)
                else:
                    jpegs[index] = raw
            except RequestError as err:
                decoded[index] = err
        if jpegs:
            decoded.update(zip(jpegs, self.jpeg_batches(list(jpegs.values())), strict=True))
            if self.device.is_cuda:  # nvJPEG's images are on the GPU: the codec's (JSON, PNG) go there to join them
                for index, item in list(decoded.items()):
                    if isinstance(item, ModelInput):
                        decoded[index] = on_device(item, self.device.device)
        out = Preprocessed()
        for index in range(len(data)):
            item = decoded[index]
            if isinstance(item, RequestError):
                out.errors[index] = item
            elif isinstance(item, Exception):  # not the codec's refusal: a fault, as the per-request path raises it
                raise item
            else:
                out.inputs.append(item)
                out.indices.append(index)
        return out

    def inference(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        device = self.device.device
        with torch.inference_mode():
            return self.model(*(t.to(device, non_blocking=True) for t in batch)).to("cpu")

    def postprocess(self, logits: torch.Tensor, inputs: list[ModelInput] | None = None) -> list[bytes]:
        """Each request's answer, as JSON bytes (see ``answer_bytes``), in the wire format it came in."""
        if inputs is None:
            return [answer_bytes(answer) for answer in encode_outputs(logits)]
        return answers_for(self.codec, inputs, logits)

    # -- entry point ---------------------------------------------------------

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[Any]:
        if is_describe(context):
            return [answer_bytes(self.codec.v2_signature())]
        self.wait_for_drains()
        started = time.perf_counter_ns()
        pre = self.preprocess(data)
        logger.info("batch of %d requests, %d refused", len(data), len(pre.errors))
        responses: list[Any] = [None] * len(data)
        for index, err in pre.errors.items():
            responses[index] = err.answer(context, index)
            logger.info("request %d refused: %d %s", index, err.status, err.reason)
        if pre.inputs:
            decoded = time.perf_counter_ns()
            self.metrics.batch_started(len(pre.inputs), [])  # the frontend's queue is not the handler's to time
            with self.in_service(len(pre.inputs)):
                batch = collate(pre.inputs)
                model_started, cpu_started = time.perf_counter_ns(), time.process_time_ns()
                logits = self.inference(batch)
                model_ns = time.perf_counter_ns() - model_started
                model_cpu_ns = time.process_time_ns() - cpu_started
                encode_started = time.perf_counter_ns()
                outputs = self.postprocess(logits, pre.inputs)
            for index, result in zip(pre.indices, outputs, strict=True):
                responses[index] = result
            done = time.perf_counter_ns()
            self.metrics.batch_finished((encode_started - decoded) / 1e9)
            self.record_batch(len(pre.inputs), done - started, model_ns, model_cpu_ns)
            stages_ns = {"decode": decoded - started, "model": encode_started - decoded,
                         "encode": done - encode_started}  # fmt: skip
            self.metrics.stages({k: v / 1e9 for k, v in stages_ns.items()}, requests=len(pre.inputs))
        return responses
