"""Drive a handler object directly, with TorchServe's own Context class.

For places without a TorchServe frontend (a GPU machine with PyTorch but no
Java, unit tests, ``bench/ebird_direct.py``): the handler is initialised and
called exactly as ``ts.model_loader`` and ``ts.service`` /
``ts.async_service`` do, minus the socket.  Never used while serving.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import ts
from ts.context import Context, RequestProcessor
from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

from archiver.build import write_artefact
from archiver.options import ServingOptions, group_model_config, model_config
from handlers.runtime.worker_pump import message_context
from model_store.catalog import ModelSpec


def model_dir_for(spec: ModelSpec, directory: Path) -> Path:
    """An unpacked archive's directory: the artefact, as the builder writes it (``off_this_thread``)."""
    directory.mkdir(parents=True, exist_ok=True)
    if not any(directory.glob("*.pt")):
        off_this_thread(write_artefact, spec, directory)
    return directory


def off_this_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a thread that ends with it.

    Building a model may run torch ops on every intra-op thread (a large
    model's initialisers do), and a thread that has run one keeps an OpenMP
    team for the rest of its life.  The
    process that builds an artefact here may then serve a handler whose
    engine threads hold teams of their own, and one team too many slows them
    all (``bench/openmp_teams.py``), which a TorchServe worker, whose main
    thread builds nothing, never sees.  The team goes with the thread.
    """
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def load_context(
    spec: ModelSpec, model_dir: Path, options: ServingOptions, gpu: int | None = None, **overrides: Any
) -> Context:
    """The context TorchServe passes to ``initialize`` for this archive."""
    yaml_config = model_config(spec, options)
    yaml_config.update(overrides)
    artefact = next(model_dir.glob("*.pt")).name
    manifest = {"model": {"modelName": spec.name, "serializedFile": artefact}}
    return worker_context(f"{spec.name}-direct", model_dir, manifest, yaml_config, gpu)


def worker_context(name: str, model_dir: Path, manifest: dict, yaml_config: dict, gpu: int | None) -> Context:
    """TorchServe's ``Context`` for an unpacked archive, with the metric definitions its worker loads."""
    metrics = MetricsCacheYamlImpl(str(Path(ts.__file__).parent / "configs" / "metrics.yaml"))
    metrics.initialize_cache()
    return Context(
        model_name=name,
        model_dir=str(model_dir),
        manifest=manifest,
        batch_size=int(yaml_config.get("batchSize", 1)),  # as the frontend passes the archive's batchSize
        gpu=gpu,
        mms_version="direct",
        metrics=metrics,
        model_yaml_config=yaml_config,
    )


def group_load_context(
    specs: list[ModelSpec], model_dir: Path, options: ServingOptions, gpu: int | None = None
) -> Context:
    """The context a group archive's worker (REEF) gets: every member's weights in ``model_dir``."""
    from model_store.factory import build_model

    model_dir.mkdir(parents=True, exist_ok=True)
    yaml_config = group_model_config(specs, options)
    for entry, spec in zip(yaml_config["handler"]["members"], specs, strict=True):
        if not (model_dir / entry["artefact"]).exists():
            off_this_thread(lambda spec=spec, entry=entry: torch.save(build_model(spec).state_dict(),
                                                                      model_dir / entry["artefact"]))  # fmt: skip
    return worker_context("group-direct", model_dir, {"model": {"modelName": "group"}}, yaml_config, gpu)


def request_context(load: Context, n_requests: int, headers: dict[str, str] | None = None) -> Context:
    """A message's own context, with one status slot per request: the shallow copy the async handlers'
    own message pump makes (``worker_pump.message_context``), which is what serves them inside
    TorchServe.  (A deep copy, as ``ts.async_service.predict`` makes, cost about 1 ms of the event
    loop's time per request in a cProfile of Ebird on bert-tiny1, which TorchServe never pays there.)"""
    return with_requests(message_context(load), n_requests, headers)


def with_requests(ctx: Context, n_requests: int, headers: dict[str, str] | None = None) -> Context:
    """``ctx`` with a message's request ids and one request processor (status slot) per request."""
    ctx.request_ids = {i: f"req-{i}" for i in range(n_requests)}
    ctx.request_processor = [RequestProcessor(dict(headers or {})) for _ in range(n_requests)]
    return ctx


def as_client_sees(answer: Any) -> Any:
    """An answer as a client would parse it: handlers hand TorchServe JSON bytes, sent as they are."""
    return json.loads(answer) if isinstance(answer, bytes | bytearray) else answer


async def call(handler: Any, load: Context, row: dict, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One request through an async handler's ``handle``, with the client's ``headers``: (status, answer)."""
    ctx = request_context(load, 1, headers)
    [answer] = await handler.handle([row], ctx)
    status, _ = ctx.get_response_status(0)
    return status, as_client_sees(answer)


class BurstCaller:
    """Requests to an async handler as its message pump hands them over: those that arrive while the
    event loop is busy go to ``serve_burst`` together on its next turn (``worker_pump.py`` reads every
    message waiting on the socket at once).  ``gate``, if given, is called before each hand-over with
    a callback that does it: it may hold the burst (the pump's read gate) and run it later."""

    def __init__(self, handler: Any, load: Context, gate: Any = None, parse: bool = True) -> None:
        """``parse``: answer each request as the client parses it (tests compare answers); False: its raw
        answer, as a timed load wants (a client's parse is not the server's work, and here it would run
        on the handler's event loop)."""
        self.handler, self.load, self.gate, self.parse = handler, load, gate, parse
        self._pending: list[tuple[dict, dict[str, str] | None, asyncio.Future]] = []

    async def request(self, row: dict, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """One request, answered as ``call`` answers: (status, answer as the client parses it)."""
        loop = asyncio.get_running_loop()
        answered: asyncio.Future[tuple[int, Any]] = loop.create_future()
        self._pending.append((row, headers, answered))
        if len(self._pending) == 1:
            loop.call_soon(self._flush)
        return await answered

    def _flush(self) -> None:
        if self.gate is None:
            self._hand_over()
        else:
            self.gate(self._hand_over)

    def _hand_over(self) -> None:
        burst, self._pending = self._pending, []
        calls = [([row], request_context(self.load, 1, headers)) for row, headers, _ in burst]

        parse = self.parse

        def done(index: int, answers: list[Any]) -> None:
            [answer] = answers
            status, _ = calls[index][1].get_response_status(0)
            burst[index][2].set_result((status, as_client_sees(answer) if parse else answer))

        self.handler.serve_burst(calls, done)


def call_batch(handler: Any, load: Context, rows: list[dict], parse: bool = True) -> list[tuple[int, Any]]:
    """One batch through a sync handler's ``handle``, as the frontend's batch arrives: (status, answer) each
    (``parse``: as the client parses it; False: raw, for a timed load, as ``BurstCaller`` has it).

    As TorchServe's sync worker does (``ts.service.Service.predict``), the
    worker's one context is reused: each batch sets its request ids and
    request processors on it, no copy (a deep copy is ~0.1 ms per batch
    that the sync worker never pays).  So batches must not overlap on one
    ``load``, which a sync worker's one thread guarantees.
    """
    ctx = with_requests(load, len(rows))
    answers = handler.handle(rows, ctx)
    return [
        (ctx.get_response_status(i)[0], as_client_sees(answer) if parse else answer) for i, answer in enumerate(answers)
    ]
