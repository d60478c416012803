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
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any, NamedTuple

from handlers.codecs import DEFAULT_MAX_PAYLOAD_BYTES, check_payload_size, parse_json, request_payload
from handlers.errors import ResponseError, ServiceUnavailable, bad_request
from handlers.orca.config import OrcaConfig
from handlers.orca.engine import GenerationError, OrcaEngine
from handlers.orca.gpt2 import SelectiveGPT2
from handlers.orca.llama import SelectiveLlama
from handlers.orca.sampling import Sampling, SamplingError
from handlers.runtime.device import ExecutionDevice
from handlers.runtime.model_loading import load_model
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
    value = request_payload(row)
    if isinstance(value, bytes | bytearray):
        check_payload_size(value, max_payload_bytes)
        value = parse_json(value)
    elif isinstance(value, str):
        value = parse_json(value)
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
        # The checkpoint's context bounds the requests: defaults shrink to it, a setting past it is refused.
        self.config = c = settings.fitted_to(model.positions, given)
        self.engine = OrcaEngine(model, c.kv_slots, c.max_tokens, c.max_batch,
                                 c.max_new_tokens, device=device.device,
                                 iteration_level=c.policy == "orca")  # fmt: skip
        self.engine.submit([0], 1).result()  # warm-up: the first iteration pays lazy initialisation
        self.initialized = True
        logger.info("Orca serving %s on %s: %s", spec.name, device, c)

    async def handle(self, data: list[dict[str, Any]], context: Any) -> list[Any]:
        return list(await asyncio.gather(*(self._serve(i, row, context) for i, row in enumerate(data))))

    async def _serve(self, index: int, row: dict[str, Any], context: Any) -> Any:
        try:
            if self.closing:
                raise ServiceUnavailable("worker is shutting down")
            ask = parse_generation_request(row, self.config, self.max_payload_bytes)
            return await self._generate(ask, context)
        except GenerationError as err:
            answer: ResponseError = bad_request(str(err))
        except ResponseError as err:
            answer = err
        except Exception as exc:  # a bug or a device fault: this request fails, the worker serves on
            logger.exception("request %d failed", index)
            answer = ServiceUnavailable(f"generation failed: {type(exc).__name__}: {exc}")
        logger.info("request %d answered %d: %s", index, answer.status, answer.reason)
        return answer.answer(context, index)

    async def _generate(self, ask: GenerationAsk, context: Any) -> str:
        stream = ask.stream
        loop = asyncio.get_running_loop()
        tokens: asyncio.Queue = asyncio.Queue()

        def on_token(token: int, i: int, last: bool) -> None:  # the engine's thread
            loop.call_soon_threadsafe(tokens.put_nowait, (token, i, last))

        done = asyncio.wrap_future(self.engine.submit(ask.input_ids, ask.max_new_tokens, on_token if stream else None,
                                                      ask.sampling, ask.stop_token_ids))  # fmt: skip
        if stream:
            from ts.handler_utils.utils import send_intermediate_predict_response

            while True:
                # A token, or the end: a failed request sends no last token.  The engine
                # reports tokens before it completes the request, and both reach this loop
                # through call_soon_threadsafe in that order, so no token is left behind.
                next_token = asyncio.ensure_future(tokens.get())
                await asyncio.wait({next_token, done}, return_when=asyncio.FIRST_COMPLETED)
                if not next_token.done():
                    next_token.cancel()
                    break
                token, i, last = next_token.result()
                if last:
                    break
                chunk = json.dumps({"index": i, "token": token}) + "\n"
                send_intermediate_predict_response([chunk], context.request_ids, "Intermediate response", 200,
                                                   context)  # fmt: skip
        output = await done
        reason = "stop" if output and output[-1] in set(ask.stop_token_ids) else "length"
        if stream:
            return json.dumps({"index": len(output) - 1, "token": output[-1], "output_ids": output,
                               "finished": True, "finish_reason": reason}) + "\n"  # fmt: skip
        return json.dumps({"output_ids": output, "finish_reason": reason})

    def close(self, timeout_s: float = 30.0) -> None:
        self.closing = True
        if self.engine is not None:
            self.engine.close(timeout_s)
