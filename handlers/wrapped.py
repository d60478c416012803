"""A user's own handler under Packrat: claim the slot, pin, set threads, then delegate every call.

An archive the user built with ``torch-model-archiver`` names its handler: a
stock TorchServe one (``image_classifier``), a file inside the archive
(``my_handler.py``, optionally ``:function``), or an installed module.  When
Packrat serves such an archive, the swapper's copy of it names this handler
instead and keeps the user's under ``packrat.handler`` in model-config.yaml
(``packrat_plugin/archives.py``).  This handler's ``initialize`` claims a
Packrat slot, pins the worker to the slot's cores and sets the slot's thread
count before anything of the user's runs (so their model's thread pool starts
inside the slot), then loads the user's handler the way TorchServe's worker
does and hands it the same context.  The user's code is never edited or
copied.

How a handler string resolves follows TorchServe's documented contract: a
module with a ``handle(data, context)`` function (called with ``data=None``
once to initialise), or a module defining exactly one class with ``handle``
and ``initialize``.  A name that imports from nowhere else is one of
TorchServe's stock handlers (``ts.torch_handler.<name>``).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from handlers.pinning.worker import PackratWorkerMixin, process_age_s, startup_priority
from handlers.runtime.heap import freeze_startup_heap

logger = logging.getLogger(__name__)

# model-config.yaml key under which the swapper keeps the user's handler string.
CONFIG_KEY = "packrat"


class HandlerLoadError(RuntimeError):
    """The user's handler cannot be loaded as TorchServe would load it (the message says why)."""


def handler_module(handler: str) -> tuple[ModuleType, str | None]:
    """The module a TorchServe handler string names, and the function it names after ``:`` (if any)."""
    name, _, function = handler.partition(":")
    module_name = name.removesuffix(".py").split("/")[-1]
    try:
        return importlib.import_module(module_name), function or None
    except ImportError as first:
        try:
            return importlib.import_module(f".{name}", "ts.torch_handler"), function or None
        except ImportError:
            raise HandlerLoadError(f"cannot import the archive's handler {handler!r}: {first}") from None


def entry_points(module: ModuleType, function: str | None) -> tuple[Callable[..., Any], Callable[[Any], Any]]:
    """(handle, initialize) of a handler module, as TorchServe's worker finds them."""
    name = function or "handle"
    if hasattr(module, name):
        handle = getattr(module, name)
        return handle, lambda context: handle(None, context)
    classes = [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
    if len(classes) != 1:
        raise HandlerLoadError(
            f"handler module {module.__name__} needs a {name}() function or exactly one class; "
            f"it defines {len(classes)} classes"
        )
    service = classes[0]()
    if not hasattr(service, "handle") or not hasattr(service, "initialize"):
        raise HandlerLoadError(f"handler class {classes[0].__name__} needs handle() and initialize() methods")
    return service.handle, service.initialize


class PackratWrappedHandler(PackratWorkerMixin):
    """The user's handler, run inside this worker's Packrat slot."""

    def __init__(self) -> None:
        self.initialized = False
        self._handle: Callable[..., Any] | None = None

    def initialize(self, context: Any) -> None:
        spawn_s = process_age_s()
        config = (getattr(context, "model_yaml_config", None) or {}).get(CONFIG_KEY) or {}
        handler = config.get("handler")
        if not handler:
            raise HandlerLoadError(f"model-config.yaml lacks {CONFIG_KEY}.handler: the user's handler to wrap")
        self.configure_runtime(context)  # slot, pinning and threads first: the user's model starts inside them
        with startup_priority():
            started = time.perf_counter()
            self._handle, initialize = entry_points(*handler_module(str(handler)))
            initialize(context)
        self.record_startup({"spawn_s": spawn_s, "load_s": time.perf_counter() - started, "warmup_s": 0.0})
        self.keep_slot_threads()
        freeze_startup_heap()
        self.initialized = True
        claim = self.packrat_claim
        logger.info(
            "serving %s with the archive's handler %r in Packrat's slot: cores %s, %d intra-op threads",
            context.model_name, handler, list(claim.slot.cores) if claim else "unpinned", torch.get_num_threads(),
        )  # fmt: skip

    def keep_slot_threads(self) -> None:
        """A user's handler may set its own thread count in ``initialize``; inside a slot the slot's count holds
        (more threads than the slot's cores would contend with each other; fewer would leave cores idle)."""
        claim = self.packrat_claim
        if claim is not None and torch.get_num_threads() != claim.slot.threads:
            logger.warning("the archive's handler set %d intra-op threads; Packrat's slot runs %d",
                           torch.get_num_threads(), claim.slot.threads)  # fmt: skip
            torch.set_num_threads(claim.slot.threads)

    def handle(self, data: list[dict[str, Any]] | None, context: Any) -> Any:
        if data is None:  # TorchServe's initialise-by-handle convention, should anyone call it so
            return None
        self.wait_for_drains()
        started = time.perf_counter_ns()
        with self.in_service(len(data)):
            answers = self._handle(data, context)
        elapsed = time.perf_counter_ns() - started
        self.record_batch(len(data), elapsed, elapsed)  # the user's handler is one piece: its time is the model's
        return answers
