"""OpenAI-compatible completions and chat completions for Orca: request parsing and response shapes.

TorchServe routes ``POST /predictions/{model}/{version}/v1/completions``
(and ``.../v1/chat/completions``, ``GET .../v1/models``) to the model's
handler with the rest of the path in the ``url_path`` request header, so an
OpenAI client pointed at ``base_url=.../predictions/{model}/{version}/v1``
reaches this module unchanged.  It is pure protocol: the handler
(``handler.py``) runs the engine and hands each piece of text to the
builders here.

What is served, as OpenAI's API defines it: a prompt (text, or token ids)
or chat messages; ``max_tokens`` (``max_completion_tokens`` for chat),
``temperature`` (default 1, as OpenAI's), ``top_p``, ``seed``, ``stop`` (up
to four strings), ``stream`` with ``stream_options.include_usage``; ``top_k``
as an extra field, as other open servers take it.  Settings this server does
not compute (``n`` > 1, ``logprobs``, penalties, ``logit_bias``, ``echo``,
``suffix``, tools) are refused by name with a 400 when given a value other
than the default, rather than silently ignored.  Errors use OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from handlers.errors import ResponseError
from handlers.orca.sampling import Sampling, SamplingError
from handlers.orca.text import TextCodec, TokenizerError

COMPLETIONS = "v1/completions"
CHAT = "v1/chat/completions"
MODELS = "v1/models"
ROUTES = (COMPLETIONS, CHAT, MODELS)
MAX_STOPS = 4  # as OpenAI's API
DONE = "data: [DONE]\n\n"

# Fields a request may carry; those in ``DEFAULT_ONLY`` only with the value that means "not used".
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "user",
          "n", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias"}  # fmt: skip
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                        "parallel_tool_calls", "response_format"}  # fmt: skip
DEFAULT_ONLY = {"n": (1,), "logprobs": (False, 0), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
                "logit_bias": ({},), "echo": (False,), "best_of": (1,), "suffix": ("",), "top_logprobs": (0,),
                "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (False, True),
                "response_format": ({"type": "text"},)}  # fmt: skip
CHAT_ROLES = ("system", "developer", "user", "assistant")


class OpenAIError(ResponseError):
    """An error answered in OpenAI's shape; ``param`` names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(status, message)
        self.param = param
        self.code = code

    def body(self) -> str:
        return json.dumps(error_object(self.status, self.reason, self.param, self.code))

    @classmethod
    def from_error(cls, err: ResponseError) -> OpenAIError:
        return err if isinstance(err, OpenAIError) else cls(err.status, err.reason)


def error_object(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def invalid(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


@dataclass(frozen=True)
class OpenAIAsk:
    """One OpenAI request, parsed: what to generate and how to answer."""

    route: str  # COMPLETIONS or CHAT
    prompt_ids: list[int]
    max_tokens: int | None  # None: the server's default, fitted to the context
    sampling: Sampling
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool

    @property
    def chat(self) -> bool:
        return self.route == CHAT


def parse_request(route: str, body: Any, codec: TextCodec | None) -> OpenAIAsk:
    """The request's ask, or an ``OpenAIError`` (400) naming the field at fault."""
    if codec is None:
        raise invalid("this model was archived without its tokenizer (tokenizer.json beside the checkpoint), so "
                      "the OpenAI routes cannot serve it; send token ids to /predictions/{model} instead")  # fmt: skip
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}")
    allowed = CHAT_FIELDS if route == CHAT else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise invalid(f"unrecognized request argument supplied: {unknown[0]}", unknown[0])
    for name, defaults in DEFAULT_ONLY.items():
        value = body.get(name)
        if value is not None and not any(value == d and type(value) is type(d) for d in defaults):
            raise invalid(f"{name}={value!r} is not supported by this server", name)
    model = body.get("model")
    if not isinstance(model, str):
        raise invalid("model is required (a string)", "model")
    if route == CHAT:
        ids = _chat_prompt(body.get("messages"), codec)
        max_tokens = _first_given(body, "max_completion_tokens", "max_tokens")
    else:
        ids = _completion_prompt(body.get("prompt"), codec)
        max_tokens = body.get("max_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise invalid(f"max_tokens must be an integer ≥ 1, got {max_tokens!r}", "max_tokens")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise invalid(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise invalid("stream_options takes only include_usage", "stream_options")
    if options and not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    return OpenAIAsk(route, ids, max_tokens, _sampling(body), _stops(body.get("stop")), stream,
                     bool(options.get("include_usage", False)))  # fmt: skip


def _first_given(body: dict[str, Any], *names: str) -> Any:
    return next((body[n] for n in names if body.get(n) is not None), None)


def _completion_prompt(prompt: Any, codec: TextCodec) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        ids = codec.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise invalid(f"one prompt per request, got {len(prompt)}; send them as separate requests (they share "
                      f"iterations on the server either way)", "prompt")  # fmt: skip
    else:
        raise invalid("prompt must be a string or a list of token ids", "prompt")
    if not ids:
        raise invalid("prompt is empty", "prompt")
    return ids


def _chat_prompt(messages: Any, codec: TextCodec) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    rendered = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise invalid(f"messages[{i}] must be an object with a role in {', '.join(CHAT_ROLES)}", "messages")
        rendered.append({"role": message["role"], "content": _message_text(message.get("content"), i)})
    try:
        return codec.chat_prompt(rendered)
    except TokenizerError as err:
        raise invalid(str(err), "messages") from None


def _message_text(content: Any, i: int) -> str:
    """A message's content as text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):  # fmt: skip
        return "".join(p["text"] for p in content)
    raise invalid(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _sampling(body: dict[str, Any]) -> Sampling:
    temperature = body.get("temperature")
    top_k = body.get("top_k")
    settings = {
        "temperature": 1.0 if temperature is None else temperature,
        "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
        "top_k": 0 if top_k in (None, -1) else top_k,  # -1 or absent: every token
        "seed": body.get("seed"),
    }
    t = settings["temperature"]
    if isinstance(t, int | float) and not isinstance(t, bool) and not 0 <= t <= 2:
        raise invalid(f"temperature must be in [0, 2], got {t}", "temperature")
    try:
        return Sampling(**settings)
    except SamplingError as err:
        param = str(err).split(" ", 1)[0]
        raise invalid(str(err), param if param in settings else None) from None


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise invalid(f"stop holds {len(stops)} strings; at most {MAX_STOPS}", "stop")
    return tuple(s for s in stops if s)


# -- answers ---------------------------------------------------------------------------------------


@dataclass
class Answer:
    """The shapes of one request's answer (its id and creation time fixed once)."""

    ask: OpenAIAsk
    model: str
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.ask.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = self.created or int(time.time())

    def complete(self, text: str, finish_reason: str, completion_tokens: int) -> dict[str, Any]:
        """The whole answer (no streaming)."""
        if self.ask.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}  # fmt: skip
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(stream=False), "choices": [choice], "usage": self.usage(completion_tokens)}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = len(self.ask.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}  # fmt: skip

    def opening(self) -> str | None:
        """The event a stream starts with: chat's assistant role (completions have none)."""
        return self._event({"role": "assistant", "content": ""}, None) if self.ask.chat else None

    def piece(self, text: str) -> str:
        """An event carrying new text."""
        return self._event({"content": text} if self.ask.chat else text, None)

    def closing(self, text: str, finish_reason: str, completion_tokens: int) -> str:
        """The stream's last events: the remaining text with the finish reason, usage when asked, ``[DONE]``."""
        events = [self._event({"content": text} if self.ask.chat else text, finish_reason)]
        if self.ask.include_usage:
            events.append(sse({**self._head(stream=True), "choices": [], "usage": self.usage(completion_tokens)}))
        return "".join(events) + DONE

    def _event(self, delta: Any, finish_reason: str | None) -> str:
        if self.ask.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**self._head(stream=True), "choices": [choice]}
        if self.ask.include_usage:
            chunk["usage"] = None  # OpenAI's chunks carry a null usage until the last
        return sse(chunk)

    def _head(self, stream: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.ask.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj)}\n\n"


def error_event(err: ResponseError) -> str:
    """A failure after a stream has begun (its status is already sent): the error as an event, then ``[DONE]``."""
    return sse(error_object(err.status, err.reason)) + DONE


def models_list(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "orca"}]}
