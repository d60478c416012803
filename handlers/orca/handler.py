"""Orca as a TorchServe handler: async mode, every request its own ``handle`` call, tokens streamed.

TorchServe hands each request to the worker as it arrives
(``asyncCommunication: true``, batch 1), so requests reach the engine's pool
at once and join the next iteration; batching is the engine's, per
iteration, not the frontend's per request.

A request is JSON: ``{"input_ids": [ids...], "max_new_tokens": n,
"stream": false}`` (``max_new_tokens`` defaults to the archive's
``default_new_tokens``), with optional sampling settings ``temperature``
(0, the default: greedy), ``top_k``, ``top_p`` and ``seed``
(``sampling.py``), and ``stop_token_ids`` (up to 16: the request ends with
the first of them it makes).  The answer's ``finish_reason`` says which
ended it: ``"stop"`` or ``"length"``.  Without ``stream`` the answer is one JSON object,
``{"output_ids": [...]}``.  With ``"stream": true`` every generated token is
sent as it is made, one JSON line per chunk (``{"index": i, "token": t}``)
through TorchServe's streaming response (``send_intermediate_predict_response``,
the frontend writes each chunk to the HTTP response as it comes), and the
last chunk also carries ``output_ids`` and ``"finished": true``.  Bad input
is a 400 with the reason before anything is generated; a body over the
archive's limit a 413.

The same handler answers OpenAI's completions and chat completions
(``openai_api.py``) when the archive carries the checkpoint's tokenizer:
TorchServe sends ``/predictions/{model}/{version}/v1/...`` here with the
route in the ``url_path`` header, so the official ``openai`` client works
against it unchanged (docs/handlers/orca.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple

from handlers.codecs import DEFAULT_MAX_PAYLOAD_BYTES, json_payload
from handlers.errors import ResponseError, ServiceUnavailable, bad_request
from handlers.orca.config import OrcaConfig
from handlers.orca.engine import GenerationError, OrcaEngine
from handlers.orca.gpt2 import SelectiveGPT2
from handlers.orca.llama import SelectiveLlama
from handlers.orca.openai_api import MODELS, ROUTES, Answer, OpenAIAsk, OpenAIError, error_event, models_list
from handlers.orca.openai_api import parse_request as parse_openai_request
from handlers.orca.sampling import Sampling, SamplingError
from handlers.orca.text import TextCodec, TextStream, TokenizerError
from handlers.runtime.device import ExecutionDevice
from handlers.runtime.heap import freeze_startup_heap
from handlers.runtime.model_loading import load_model
from handlers.runtime.worker_pump import answered_as_streams
from model_store.catalog import ModelSpec

logger = logging.getLogger(__name__)

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")
FIELDS = ("input_ids", "max_new_tokens", "stream", "stop_token_ids", *SAMPLING_FIELDS)


class GenerationAsk(NamedTuple):
    """What one request asks for, parsed (the engine checks it against the model when it is submitted)."""

    input_ids: list
    max_new_tokens: int
    stream: bool
    sampling: Sampling
    stop_token_ids: list


def parse_generation_request(row: dict[str, Any], config: OrcaConfig, max_payload_bytes: int) -> GenerationAsk:
    """A request row's ask, or a ``RequestError`` naming the problem.  No sampling field: greedy decoding, as
    before sampling existed; no stop ids: ``max_new_tokens`` tokens."""
    value = json_payload(row, max_payload_bytes)
    if not isinstance(value, dict):
        raise bad_request(f"expected a JSON object with {', '.join(FIELDS)}; got {type(value).__name__}")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise bad_request(f"unknown fields {unknown}; a request takes {', '.join(FIELDS)}")
    ids = value.get("input_ids")
    if not isinstance(ids, list):
        raise bad_request("input_ids must be a list of token ids")
    new_tokens = value.get("max_new_tokens", config.default_new_tokens)
    stream = value.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be true or false, got {stream!r}")
    try:
        sampling = Sampling(**{k: value[k] for k in SAMPLING_FIELDS if k in value and value[k] is not None})
    except SamplingError as err:
        raise bad_request(str(err)) from None
    return GenerationAsk(ids, new_tokens, stream, sampling, value.get("stop_token_ids", []))


class OrcaHandler:
    """Serves the catalog's GPT-2 with Orca's engine (see the module doc)."""

    def __init__(self) -> None:
        self.initialized = False
        self.engine: OrcaEngine | None = None
        self.config = OrcaConfig()
        self.max_payload_bytes = DEFAULT_MAX_PAYLOAD_BYTES
        self.closing = False
        self.text: TextCodec | None = None  # the checkpoint's tokenizer, when archived: the OpenAI routes
        self.model_name = "orca"
        self.created = int(time.time())

    def initialize(self, context: Any) -> None:
        handler_cfg = (getattr(context, "model_yaml_config", None) or {}).get("handler") or {}
        if "spec" not in handler_cfg:
            raise RuntimeError("archive model-config.yaml lacks handler.spec; rebuild it with `packrat archive`")
        spec = ModelSpec.from_dict(handler_cfg["spec"])
        if spec.family not in ("gpt2", "llama") or spec.mode != "eager":
            raise RuntimeError(f"the orca handler serves GPT-2 and Llama-family models in eager mode; "
                               f"got {spec.name} ({spec.family}, {spec.mode})")  # fmt: skip
        given = handler_cfg.get("orca") or {}
        settings = OrcaConfig.from_dict(given)
        self.max_payload_bytes = int(handler_cfg.get("max_payload_bytes", DEFAULT_MAX_PAYLOAD_BYTES))
        device = ExecutionDevice.from_context(context)
        artefact = os.path.join(context.system_properties["model_dir"], context.manifest["model"]["serializedFile"])
        wrapped = load_model(spec, artefact, device.device)  # NextTokenLogits(GPT2LMHeadModel or ...ForCausalLM)
        model = SelectiveLlama(wrapped.model) if spec.family == "llama" else SelectiveGPT2(wrapped.model)
        model_dir = Path(context.system_properties["model_dir"])
        if TextCodec.present(model_dir):
            try:
                self.text = TextCodec.load(model_dir, model.vocab)
            except TokenizerError as err:
                raise RuntimeError(str(err)) from None
        self.model_name = getattr(context, "model_name", None) or spec.name
        # The checkpoint's context bounds the requests: defaults shrink to it, a setting past it is refused.
        self.config = c = settings.fitted_to(model.positions, given)
        self.engine = OrcaEngine(model, c.kv_slots, c.max_tokens, c.max_batch,
                                 c.max_new_tokens, device=device.device,
                                 iteration_level=c.policy == "orca", block_size=c.block_size,
                                 prefill_chunk=c.prefill_chunk, cuda_graphs=c.cuda_graphs)  # fmt: skip
        self.engine.submit([0], 1).result()  # warm-up: the first iteration pays lazy initialisation
        freeze_startup_heap()
        self.initialized = True
        logger.info("Orca serving %s on %s: %s", spec.name, device, c)

    async def handle(self, data: list[dict[str, Any]], context: Any) -> list[Any]:
        answers = list(await asyncio.gather(*(self._serve(i, row, context) for i, row in enumerate(data))))
        # TorchServe's pump serves Orca: an answer must end a stream for its frontend to forget the request.
        return answered_as_streams(answers, context)

    async def _serve(self, index: int, row: dict[str, Any], context: Any) -> Any:
        route = context.get_request_header(index, "url_path")
        try:
            if self.closing:
                raise ServiceUnavailable("worker is shutting down")
            if route:
                return await self._serve_openai(route, index, row, context)
            ask = parse_generation_request(row, self.config, self.max_payload_bytes)
            return await self._generate(ask, context)
        except GenerationError as err:
            answer: ResponseError = bad_request(str(err))
        except ResponseError as err:
            answer = err
        except Exception as exc:  # a bug or a device fault: this request fails, the worker serves on
            logger.exception("request %d failed", index)
            answer = ServiceUnavailable(f"generation failed: {type(exc).__name__}: {exc}")
        if route:
            answer = OpenAIError.from_error(answer)
        logger.info("request %d answered %d: %s", index, answer.status, answer.reason)
        return answer.answer(context, index)

    def _submit(self, ids: list[int], new_tokens: int, sampling: Sampling, stop_ids: list[int],
                report: bool) -> tuple[Future, asyncio.Future, asyncio.Queue | None]:  # fmt: skip
        """Queue a request on the engine: its future (the engine's, to cancel it, and this loop's, to await it)
        and, if ``report``, a queue of its tokens as they are made."""
        tokens: asyncio.Queue | None = None
        on_token = None
        if report:
            loop = asyncio.get_running_loop()
            tokens = queue = asyncio.Queue()

            def on_token(token: int, i: int, last: bool) -> None:  # the engine's thread
                loop.call_soon_threadsafe(queue.put_nowait, (token, i, last))

        source = self.engine.submit(ids, new_tokens, on_token, sampling, stop_ids)
        return source, asyncio.wrap_future(source), tokens

    @staticmethod
    async def _tokens(done: asyncio.Future, tokens: asyncio.Queue) -> AsyncIterator[tuple[int, int, bool]]:
        """A request's tokens as the engine makes them, until its last (or until it fails: then no last one).

        The engine reports tokens before it completes the request, and both reach this loop through
        ``call_soon_threadsafe`` in that order, so no token is left behind."""
        while True:
            next_token = asyncio.ensure_future(tokens.get())
            await asyncio.wait({next_token, done}, return_when=asyncio.FIRST_COMPLETED)
            if not next_token.done():
                next_token.cancel()
                return
            token, i, last = next_token.result()
            yield token, i, last
            if last:
                return

    # -- OpenAI's routes ------------------------------------------------------------------

    async def _serve_openai(self, route: str, index: int, row: dict[str, Any], context: Any) -> str:
        route = route.strip("/")
        if route not in ROUTES:
            raise OpenAIError(404, f"unknown route /{route}; this model serves " +
                              ", ".join(f"/{r}" for r in ROUTES), code="unknown_url")  # fmt: skip
        context.set_response_content_type(index, "application/json")
        if route == MODELS:
            return json.dumps(models_list(self.model_name, self.created))
        ask = parse_openai_request(route, json_payload(row, self.max_payload_bytes), self.text)
        new_tokens = self._fit_new_tokens(ask)
        answer = Answer(ask, self.model_name)
        text = TextStream(self.text, ask.stops)
        stop_ids = list(self.text.stop_ids)
        source, future, tokens = self._submit(ask.prompt_ids, new_tokens, ask.sampling, stop_ids,
                                              report=ask.stream or bool(ask.stops))  # fmt: skip
        if ask.stream:
            context.set_response_content_type(index, "text/event-stream")
            opening = answer.opening()
            if opening:
                self._send(opening, context)
        if tokens is not None:
            async for token, _, _ in self._tokens(future, tokens):
                piece = text.push(token)
                if text.stopped:
                    self.engine.cancel(source)  # the text is complete: free its KV slot now
                if piece and ask.stream:
                    self._send(answer.piece(piece), context)
                if text.stopped:
                    break
        try:
            output = await future
        except Exception as exc:
            if not ask.stream:
                raise
            logger.exception("streamed request %d failed", index)
            return error_event(ServiceUnavailable(f"generation failed: {type(exc).__name__}: {exc}"))
        if tokens is None:
            for token in output:
                text.push(token)
        rest = text.finish()
        # Every token made reached ``text`` unless a stop string ended it first.
        reason = "stop" if text.stopped or output[-1] in stop_ids else "length"
        made = len(text.ids)
        if ask.stream:
            return answer.closing(rest, reason, made)
        return json.dumps(answer.complete(text.text, reason, made))

    def _fit_new_tokens(self, ask: OpenAIAsk) -> int:
        """The request's ``max_tokens``, or the archive's default fitted to the room its prompt leaves; 400s
        name the limit a request goes past."""
        c, prompt = self.config, len(ask.prompt_ids)
        room = min(c.max_tokens - prompt, c.max_new_tokens)
        if room < 1:
            field = "messages" if ask.chat else "prompt"
            raise OpenAIError(400, f"the prompt has {prompt} tokens; this model's context holds {c.max_tokens}, "
                                   f"so it leaves no room to generate", field)  # fmt: skip
        if ask.max_tokens is None:
            return min(c.default_new_tokens, room)
        if ask.max_tokens > room:
            raise OpenAIError(400, f"max_tokens {ask.max_tokens} is more than this request can have: the prompt has "
                                   f"{prompt} tokens, the context holds {c.max_tokens}, and a request may generate "
                                   f"at most {c.max_new_tokens}", "max_tokens")  # fmt: skip
        return ask.max_tokens

    @staticmethod
    def _send(event: str, context: Any) -> None:
        from ts.handler_utils.utils import send_intermediate_predict_response

        send_intermediate_predict_response([event], context.request_ids, "Intermediate response", 200, context)

    async def _generate(self, ask: GenerationAsk, context: Any) -> str:
        _, done, tokens = self._submit(ask.input_ids, ask.max_new_tokens, ask.sampling, ask.stop_token_ids,
                                       report=ask.stream)  # fmt: skip
        if tokens is not None:
            async for token, i, last in self._tokens(done, tokens):
                if not last:  # the last token goes with the final answer
                    self._send(json.dumps({"index": i, "token": token}) + "\n", context)
        output = await done
        reason = "stop" if output and output[-1] in set(ask.stop_token_ids) else "length"
        if ask.stream:
            return json.dumps({"index": len(output) - 1, "token": output[-1], "output_ids": output,
                               "finished": True, "finish_reason": reason}) + "\n"  # fmt: skip
        return json.dumps({"output_ids": output, "finish_reason": reason})

    def close(self, timeout_s: float = 30.0) -> None:
        self.closing = True
        if self.engine is not None:
            self.engine.close(timeout_s)
