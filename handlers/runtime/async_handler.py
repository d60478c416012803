"""Template for handlers that schedule requests themselves (TorchServe async mode).

With ``asyncCommunication: true`` in model-config.yaml, TorchServe's worker
awaits ``handle(data, context)`` once per incoming message, concurrently,
each with its own copy of the context, and sends each answer as soon as
that call returns.  So the handler sees requests as they arrive and answers
them independently; batching is the engine's business, not the frontend's.

``AsyncModelHandler`` does the shared part (TorchServe's template methods
stay recognisable):

- ``initialize``: read the archive's spec, load the model on the worker's
  device, build one engine per declared input layout (``create_engine``),
  warm it up.
- ``initialize`` also puts a leaner message pump in place of TorchServe's
  async worker loop (``worker_pump.py``) unless the archive says
  ``worker_pump: torchserve``.
- ``handle``: decode and validate each request on arrival (same codecs and
  4xx answers as the CPU handler; on the CPU lanes, inline or on a few
  threads, see ``decode.py``), admit it into the engine (waiting while
  the engine is full, at most the response timeout), await its future,
  ``postprocess`` the output row: on a CPU, on the lane that ran its batch,
  right after it (``encode_answers``, below).

``handle`` never raises.  In async mode a non-200 answer for a message makes
TorchServe's frontend fail *every* request it has in flight on this worker
(``AsyncBatchAggregator.sendResponse``), so each failure is reported as that
request's own status instead.
"""

from __future__ import annotations

import abc
import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from handlers.codecs import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    InputCodec,
    ModelInput,
    answer_bytes,
    encode_output,
    encode_outputs,
    is_describe,
)
from handlers.errors import ResponseError, ServiceUnavailable, bad_request, inference_failed
from handlers.pinning.worker import PackratWorkerMixin
from handlers.runtime import worker_pump
from handlers.runtime.admission import Admission
from handlers.runtime.arrivals import Arrivals
from handlers.runtime.batched_decode import BatchedJpegDecoder
from handlers.runtime.burst import BurstServer, Call, Done
from handlers.runtime.deadlines import Deadlines
from handlers.runtime.decode import (
    BATCHED,
    LANE,
    DecodeFn,
    RequestDecoder,
    default_decode_placement,
    parse_decode_threads,
)
from handlers.runtime.device import ExecutionDevice
from handlers.runtime.engine import Engine, RowsEncoder, StageTimes, input_key, stage_breakdown
from handlers.runtime.heap import freeze_startup_heap
from handlers.runtime.lanes import CpuLanes
from handlers.runtime.loop_mailbox import mailbox_for
from handlers.runtime.metrics import HandlerMetrics
from handlers.runtime.model_loading import load_model
from handlers.runtime.row_line import Regroup, RowLine
from model_store.catalog import ModelSpec

logger = logging.getLogger(__name__)

DEFAULT_RESPONSE_TIMEOUT_S = 120.0
Bind = Callable[[ModelInput], ModelInput]  # what a decoded input is bound with (``route_request``)

# Where answers are encoded (``encode_answers`` in the archive's ``handler:``).
ENGINE = "engine"  # on the thread that settles the request: the CPU lane, right after the batch
LOOP = "loop"  # on the event loop, when the request's coroutine wakes


def parse_encode_answers(value: Any) -> str | None:
    """An explicit place ("engine" or "loop"), or None for the device's default ("auto" or absent)."""
    if value is None or value == "auto":
        return None
    if value not in (ENGINE, LOOP):
        raise ValueError(f"encode_answers must be 'engine', 'loop' or 'auto', got {value!r}")
    return value


def declared_inputs(codec: InputCodec) -> list[ModelInput]:
    """One zero input per input layout the archive accepts (engines preallocate per layout)."""
    spec = codec.spec
    if spec.input_kind == "image":
        return [ModelInput((torch.zeros(shape),)) for shape in codec.image_shapes]
    return [
        ModelInput((torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.long))) for n in codec.token_lengths
    ]


class _ThroughHandle(BurstServer):
    """``serve_burst`` for a handler whose requests take ``handle``: a task per message."""

    def serve(self, calls: Sequence[Call], done: Done) -> None:
        for index, (data, context) in enumerate(calls):
            self._spawn(self._through_handle(index, data, context, done))


class AsyncModelHandler(PackratWorkerMixin, abc.ABC):
    """Base class; a subclass supplies ``configure`` and ``create_engine``."""

    def __init__(self) -> None:
        self.initialized = False
        self._streams_answers = False  # set by ``install_worker_pump``
        self.spec: ModelSpec | None = None
        self.codec: InputCodec | None = None
        self.model: torch.nn.Module | None = None
        self.device = ExecutionDevice("cpu")
        self.metrics = HandlerMetrics(None, "")
        self.engines: dict[Any, Engine] = {}  # by ``engine_key``
        self.response_timeout_s = DEFAULT_RESPONSE_TIMEOUT_S
        self.cpu_threads = torch.get_num_threads()
        self.lanes: CpuLanes | None = None  # CPU only
        self.decoder: RequestDecoder | BatchedJpegDecoder | None = None
        # Encode answers where the engine settles them (``TicketFuture.encode``):
        # the default on CPU lanes.  On the event loop, a batch's JSON answers
        # (~0.5 ms each for ResNet-50's 1000 logits) are encoded beside the
        # lane's next decode or batch, whose OpenMP team they stall on a
        # machine with few cores (lanes.py); on the lane they run between.
        self.encode_on_engine = False
        # Requests between receipt and admission, for engines that bind
        # batches late (``arrivals.py``); only when decoding on the lanes.
        self.arrivals: Arrivals | None = None
        self.closing = False
        self.unanswered = 0  # requests this worker has read and not yet answered
        # Per event loop: TorchServe runs one for the worker's life, but a
        # handler driven directly (tests) may see several.
        self._admissions: dict[tuple[int, Any], Admission] = {}
        self._rows_encoder = RowsEncoder(self.postprocess_rows)
        self._deadlines: dict[int, Deadlines] = {}  # per event loop, as ``_admissions``
        self._row_line: RowLine | None = None  # taken rows for several engines (``row_engine``)
        self._burst: BurstServer | _ThroughHandle | None = None  # ``serve_burst``'s path, chosen at its first call

    # -- hooks ---------------------------------------------------------------

    def configure(self, handler_config: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Read the subclass's own section of ``handler:`` in model-config.yaml."""

    @abc.abstractmethod
    def create_engine(self, layout_example: ModelInput) -> Engine:
        """An engine for inputs shaped like ``layout_example``."""

    def unanswered_changed(self, count: int) -> None:  # noqa: B027 - optional hook
        """Called on the event loop whenever ``unanswered`` changes (Packrat's drain reads it)."""

    def cpu_lane_count(self) -> int:
        """How many batches may run at once on a CPU, each with an equal share of the cores."""
        return 1

    def create_lanes(self) -> CpuLanes:
        """The CPU lanes: ``cpu_lane_count`` lanes sharing the worker's threads evenly."""
        return CpuLanes.splitting(self.cpu_threads, self.cpu_lane_count())

    def route_request(self, row: dict[str, Any], context: Any, index: int) -> tuple[DecodeFn | None, Bind | None]:
        """How request ``index`` is decoded: the function that decodes its row (None: the decoder's own)
        and what its decoded input is then bound with (None: nothing).

        A handler serving several models (REEF) reads the request's headers
        here to pick the model whose codec decodes it and to bind the input
        to that model; it raises ``ResponseError`` for a request it refuses.
        """
        return None, None

    async def decode_request(self, row: dict[str, Any], context: Any, index: int) -> ModelInput:
        """One request's input, decoded where the archive says (``decode.py``), as ``route_request`` says."""
        decode, bind = self.route_request(row, context, index)
        item = await self.decoder(row, decode)
        return item if bind is None else bind(item)

    def engine_key(self, item: ModelInput) -> Any:
        """Which engine takes ``item``: by default the one built for its input layout."""
        return input_key(item)

    def postprocess(self, output: torch.Tensor, item: ModelInput | None = None) -> Any:
        """One request's answer from its output row (JSON bytes: see ``answer_bytes``), in the wire
        format ``item`` came in (the Open Inference Protocol's, or the handler's own JSON)."""
        if item is not None and item.v2 is not None:
            return self.codec_for(item).answer(item, output)
        return answer_bytes(encode_output(output))

    def postprocess_rows(self, outputs: torch.Tensor) -> list[Any]:
        """The answers to several requests in the handler's own JSON, from their output rows at once
        (``codecs.encode_outputs``: the torch work once for the batch)."""
        return [answer_bytes(answer) for answer in encode_outputs(outputs)]

    def encoder_for(self, item: ModelInput) -> Any:
        """What turns ``item``'s output row into its answer: for the handler's own JSON, an encoder
        of whole batches (``RowsEncoder``, unless a subclass answers in its own ``postprocess``);
        for an Open Inference Protocol request, ``postprocess`` bound to it."""
        if item.v2 is not None:
            return functools.partial(self.postprocess, item=item)
        postprocess = self.postprocess  # a subclass's, or one set on this handler, answers row by row
        own = getattr(postprocess, "__func__", None) is AsyncModelHandler.postprocess
        return self._rows_encoder if own else postprocess

    def codec_for(self, item: ModelInput) -> InputCodec:
        """The codec that decoded ``item`` (a handler serving several models overrides this)."""
        return self.codec

    # -- template methods ----------------------------------------------------

    def initialize(self, context: Any) -> None:
        model_config = getattr(context, "model_yaml_config", None) or {}
        handler_config = model_config.get("handler") or {}
        if "spec" not in handler_config:
            raise RuntimeError("archive model-config.yaml lacks handler.spec; rebuild it with `packrat archive`")
        self.spec = ModelSpec.from_dict(handler_config["spec"])
        self.codec = InputCodec(
            self.spec,
            int(handler_config.get("max_payload_bytes", DEFAULT_MAX_PAYLOAD_BYTES)),
            image_shapes=handler_config.get("input_shapes") or (),
            token_lengths=handler_config.get("token_lengths") or (),
        )
        self.response_timeout_s = float(model_config.get("responseTimeout", DEFAULT_RESPONSE_TIMEOUT_S))
        decode_placement = parse_decode_threads(handler_config.get("decode_threads"))
        pump = worker_pump.parse_worker_pump(handler_config.get("worker_pump"))
        encode_answers = parse_encode_answers(handler_config.get("encode_answers"))
        self.configure(handler_config)
        self.configure_runtime(context)
        self.device = ExecutionDevice.from_context(context)
        # Intra-op threads (Packrat's slot count, or torch's default) belong
        # to the CPU lanes (``lanes.py``).  This thread runs the event loop,
        # which only copies inputs and hands work on: single-threaded, so it
        # never starts an OpenMP team that would compete with theirs.
        self.cpu_threads = torch.get_num_threads()
        if not self.device.is_cuda:
            torch.set_num_threads(1)
            self.lanes = self.create_lanes()
        model_dir = context.system_properties["model_dir"]
        artefact = os.path.join(model_dir, context.manifest["model"]["serializedFile"])
        self.model = load_model(self.spec, artefact, self.device.device)
        self.metrics = HandlerMetrics.for_worker(context, handler_config)
        self.decoder = self._make_decoder(decode_placement)
        self.encode_on_engine = self._encode_on_engine(encode_answers)
        if self.decoder.on_lanes:
            self.arrivals = Arrivals()
        for example in declared_inputs(self.codec):
            engine = self.create_engine(example)
            engine.warm_up()
            self.engines[self.engine_key(example)] = engine
        pump_in_use = self.install_worker_pump(pump)
        freeze_startup_heap()
        self.initialized = True
        logger.info(
            "%s serving %s (%s mode) on %s%s with %d input layout(s), decoding %s, encoding answers %s, "
            "%s message pump",
            type(self).__name__,
            self.spec.name,
            self.spec.mode,
            self.device,
            f" ({self.lanes})" if self.lanes else "",
            len(self.engines),
            self.decoder.where,
            "where each batch ends" if self.encode_on_engine else "on the event loop",
            pump_in_use,
        )

    def install_worker_pump(self, setting: Any) -> str:
        """Put the archive's message pump in place (``worker_pump.py``); says which runs, for the start-up log.

        Called last in ``initialize``: a handler that failed to start leaves
        TorchServe's worker as it was.  On CPU lanes the pump reads no message
        while every lane runs a quiet job (an engine's batch that a new
        request could not join: ``lanes.py``).
        """
        gate = self.lanes.wait_for_a_loud_lane if self.lanes is not None else None
        lean = worker_pump.install(setting, gate)
        self._streams_answers = not lean  # TorchServe's pump: ``handle`` ends each answer's stream itself
        return "the lean" if lean else "TorchServe's"

    def _encode_on_engine(self, setting: str | None) -> bool:
        """Where answers are encoded: by default on CPU lanes, where each batch ends (its answers in one
        ``settle_batch`` call, between two batches); elsewhere on the event loop.  REEF's CPU executors
        are not lanes: a best-effort batch's answers encoded on its executor (GPT-2's 50k logits a row)
        start an OpenMP team beside the real-time batch's, and on 2 vCPUs two teams stalled RT answers
        to a 350 ms p99 in two of three quick workload-T runs (``docs/benchmarks/host_path.md``); it
        decides per request instead (``ReefHandler.encodes_on_engine``)."""
        if setting is None:
            return self.lanes is not None
        if setting == ENGINE and self.lanes is None:
            logger.warning("no CPU lanes on %s: encode_answers 'engine' becomes 'loop'", self.device)
            return False
        return setting == ENGINE

    def encodes_on_engine(self, item: ModelInput) -> bool:
        """Whether ``item``'s answer is encoded on the thread that settles it (``encode_on_engine``); a
        handler whose engine threads differ by request (REEF's priorities) decides per request."""
        return self.encode_on_engine

    def _make_decoder(self, placement: int | str | None) -> RequestDecoder | BatchedJpegDecoder:
        if placement == BATCHED:
            fallback = self._make_decoder(None)  # the device's default, for PNG, JSON and v2 bodies
            if self.spec.input_kind == "image":
                return BatchedJpegDecoder(self.codec, self.device.device, fallback, on_batch=self.metrics.decode_batch)
            logger.warning("%s takes tokens: decode_threads 'batched' becomes %s", self.spec.name, fallback.where)
            return fallback
        if placement is None:
            placement = default_decode_placement(self.device.is_cuda)
        if placement == LANE:
            if self.lanes is not None:
                return RequestDecoder(self.codec.decode, submit=self.lanes.submit)
            placement = default_decode_placement(self.device.is_cuda)
            logger.warning("no CPU lanes on %s: decode_threads 'lane' becomes %s threads", self.device, placement)
        return RequestDecoder(self.codec.decode, threads=placement)

    def v2_signature(self) -> dict[str, Any]:
        """The Open Inference Protocol signature ``GET /models/NAME?customized=true`` answers with."""
        return self.codec.v2_signature()

    async def handle(self, data: list[dict[str, Any]], context: Any) -> list[Any]:
        if is_describe(context):
            return [answer_bytes(self.v2_signature())]
        # Counted from the moment the message is read, not from admission: a
        # request still decoding, or waiting for room in a full engine, is in
        # this worker, and a set being drained must not be stopped under it.
        self.count_unanswered(len(data))
        try:
            if len(data) == 1:  # async mode's usual message: no task and gather around one request
                answers = [await self._serve(0, data[0], context)]
            else:
                answers = await asyncio.gather(*(self._serve(i, row, context) for i, row in enumerate(data)))
        finally:
            self.count_unanswered(-len(data))
        if self._streams_answers:  # (the lean pump frames every answer so: ``worker_pump.framed_final``)
            return worker_pump.answered_as_streams(list(answers), context)
        return list(answers)

    def serve_burst(self, calls: Sequence[Call], done: Done) -> None:
        """Answer several messages that arrived together, each as ``handle(data, context)`` would, through
        ``done(index, answers)`` on the running loop (the lean message pump's entry: ``burst.py``).

        One-request messages take the callback path, without a coroutine
        each, when this handler decodes with the runtime's ``RequestDecoder``
        (``route_request`` says how); every other message, and every message
        of a handler that overrides ``decode_request`` or ``handle``, goes
        through ``handle`` in a task of its own.
        """
        if self._burst is None:
            routes = type(self).route_request is not AsyncModelHandler.route_request
            if self._takes_bursts():
                self._burst = BurstServer(self, routes, self.row_engine())
            else:
                self._burst = _ThroughHandle(self)
        self._burst.serve(calls, done)

    def row_engine(self) -> Engine | RowLine | None:
        """What takes bursts undecoded (``row_intake.py``), or None for decode, then admission.

        Only where decode and encode already run on the CPU lanes (decoding
        off them, on decode threads or nvJPEG, is a choice this keeps).  One
        engine that takes rows takes them itself; engines that each take
        decoded rows (several input layouts: the layout picks the engine after
        the decode) share a ``RowLine`` that decodes on a lane and hands each
        engine its rows (``row_line.py``).
        """
        if not isinstance(self.decoder, RequestDecoder) or not self.decoder.on_lanes or not self.encode_on_engine:
            return None
        engines = list(self.engines.values())
        if len(engines) == 1 and engines[0].takes_rows:
            return engines[0]
        if engines and self.lanes is not None and all(engine.takes_decoded_rows for engine in engines):
            if self._row_line is None:
                self._row_line = RowLine(self._engine_taking, self.lanes, self.regroup_rows())
            return self._row_line
        return None

    def regroup_rows(self) -> Regroup | None:
        """What moves a row line's decoded rows between engines before each hand-over (None: nothing)."""
        return None

    def _engine_taking(self, item: ModelInput) -> Engine | None:
        """The engine a decoded row goes to: its layout's, if that engine fits it."""
        engine = self.engines.get(self.engine_key(item))
        return engine if engine is not None and engine.fits(item) else None

    def _takes_bursts(self) -> bool:
        return (
            isinstance(self.decoder, RequestDecoder)
            and type(self).decode_request is AsyncModelHandler.decode_request
            and type(self).handle is AsyncModelHandler.handle
        )

    def count_unanswered(self, change: int) -> None:
        """Requests read and not yet answered, up or down by ``change`` (on the event loop)."""
        self.unanswered += change
        try:
            self.unanswered_changed(self.unanswered)
        except Exception:  # bookkeeping must not fail a request
            logger.exception("publishing the unanswered count failed")

    async def _serve(self, index: int, row: dict[str, Any], context: Any) -> Any:
        arrival = None
        try:
            received = time.monotonic()
            if self.closing:  # not worth decoding: no engine will take it
                raise ServiceUnavailable("worker is shutting down")
            # The response timeout counts from receipt, as TorchServe's does, and covers the decode.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.response_timeout_s
            if self.arrivals is not None:
                arrival = self.arrivals.enter()
            try:
                async with asyncio.timeout_at(deadline):
                    item = await self.decode_request(row, context, index)
            except TimeoutError:
                raise self.deadlines_on(loop).error() from None
            decoded = time.monotonic()
            output, times, admitted, woken, encoded = await self._infer_timed(item, deadline, arrival)
            arrival = None  # released at admission (``_infer_timed``)
            answer = output if encoded else self.encoder_for(item)(output)
            self.metrics.stages(stage_breakdown(received, decoded, admitted, times, woken, time.monotonic()))
            return answer
        except ResponseError as err:
            answer = err
        except Exception as exc:  # a bug or a device fault: this request fails, the worker serves on
            logger.exception("request %d failed", index)
            answer = inference_failed(exc)
        finally:
            if arrival is not None:
                self.arrivals.leave(arrival)  # refused before admission: a held batch need not wait for it
        logger.info("request %d answered %d: %s", index, answer.status, answer.reason)
        return answer.answer(context, index)

    async def _infer_timed(
        self, item: ModelInput, deadline: float, arrival: int | None = None
    ) -> tuple[Any, StageTimes | None, float, float, bool]:
        """One decoded input through its engine: its output row, or its answer when the engine
        encoded it (the last value says which); the engine's stage times; when admission ended
        and when this coroutine woke.

        ``deadline``: the request's response timeout (``loop.time()``), counted from its receipt.
        ``arrival``: the request's ``Arrivals`` token, released once it is admitted.
        """
        loop = asyncio.get_running_loop()
        admission = self.admission_of(loop, item)
        future = await admission.admit(item, deadline)
        admitted = time.monotonic()
        if self.encodes_on_engine(item) and hasattr(future, "encode"):  # a ``TicketFuture``
            future.encode = self.encoder_for(item)
        if arrival is not None:
            self.arrivals.leave(arrival)
        self.metrics.request_admitted()
        try:
            answer = mailbox_for(loop).wrap(future)
            self.deadlines_on(loop).watch(answer, deadline)
            output = await answer
            encoded = getattr(future, "encoded", False)
            return output, getattr(future, "times", None), admitted, time.monotonic(), encoded
        finally:
            self.metrics.request_answered()

    def admission_of(self, loop: asyncio.AbstractEventLoop, item: ModelInput) -> Admission:
        """The admission line ``item`` takes on ``loop``; a 400 for an input layout with no engine
        (one the archive does not declare)."""
        key = self.engine_key(item)
        if key not in self.engines:
            shapes = [list(shape) for shape in item.shapes]
            raise bad_request(f"input shape {shapes} is not one this archive declares")
        return self.admission_for(loop, key)

    def admission_for(self, loop: asyncio.AbstractEventLoop, key: Any) -> Admission:
        """The admission line into engine ``key`` on ``loop`` (one per loop and engine)."""
        admission = self._admissions.get((id(loop), key))
        if admission is None:
            admission = self._admissions[(id(loop), key)] = Admission(self.engines[key], self.metrics, loop)
        return admission

    def deadlines_on(self, loop: asyncio.AbstractEventLoop) -> Deadlines:
        """The response timeout's watch on ``loop`` (one timer for every request waiting there)."""
        deadlines = self._deadlines.get(id(loop))
        if deadlines is None or deadlines.loop is not loop:
            limit = self.response_timeout_s

            def timed_out() -> ServiceUnavailable:
                return ServiceUnavailable(f"no result within the response timeout of {limit:g} s")

            deadlines = self._deadlines[id(loop)] = Deadlines(loop, timed_out)
        return deadlines

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish admitted requests (up to ``timeout_s``), answer the rest with 503, stop engine threads."""
        started = time.monotonic()
        self.closing = True
        if self._row_line is not None:  # first: what it holds is handed to the engines, which finish it
            self._row_line.close(timeout_s)
        for engine in self.engines.values():
            engine.close(max(timeout_s - (time.monotonic() - started), 0.0))
        if self.decoder is not None:
            self.decoder.close()
        if self.lanes is not None:
            self.lanes.close(max(timeout_s - (time.monotonic() - started), 0.1))
        self.metrics.close()
