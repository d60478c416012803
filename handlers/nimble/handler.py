"""Nimble as a TorchServe handler: TorchServe batches, Nimble's prepared programs run the batches.

Synchronous on purpose: Nimble changes how one batch executes, not how
requests are grouped, so TorchServe's own batcher (``batchSize``,
``maxBatchDelay``) forms the batches and everything else (per-request
decoding, 4xx for the bad ones, answers in request order, metrics) is the
CPU handler's.  What differs is ``inference``: a batch runs on its bucket's
program (``handlers/nimble/program.py``), chosen when the worker started;
a batch above the largest bucket runs the eager model and says so in the
log.  The buckets come from ``handler.nimble.buckets`` in the archive's
model-config.yaml; keep the largest at least TorchServe's ``batchSize`` or
full batches will all take the eager path (the worker warns at start-up).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from handlers.nimble.config import NimbleConfig
from handlers.nimble.program import FALLBACK, NimbleProgram, prepare
from handlers.plain_handler import PlainModelHandler
from model_store.factory import example_inputs

logger = logging.getLogger(__name__)


class NimbleHandler(PlainModelHandler):
    """The CPU handler with Nimble's ahead-of-time programs in ``inference``."""

    def __init__(self) -> None:
        super().__init__()
        self.program: NimbleProgram | None = None
        self.config = NimbleConfig()
        self.last_path: str | None = None

    def initialize(self, context: Any) -> None:
        handler_cfg = (getattr(context, "model_yaml_config", None) or {}).get("handler") or {}
        self.config = NimbleConfig.from_dict(handler_cfg.get("nimble"))
        super().initialize(context)  # loads the eager model and warms the request path up
        if self.spec.input_kind != "image":
            raise RuntimeError(f"the nimble handler serves image models; {self.spec.name} takes {self.spec.input_kind}")
        example = tuple(x.to(self.device.device) for x in example_inputs(self.spec, batch=1))
        self.program = prepare(self.model, example, self.config)
        logger.info("Nimble prepared %s: %s", self.spec.name, self.program.describe())
        batch_size = int(context.system_properties.get("batch_size") or 1)
        if batch_size > self.program.sizes[-1]:
            logger.warning(
                "TorchServe batch size %d is above Nimble's largest bucket %d: larger batches run eager",
                batch_size, self.program.sizes[-1],
            )  # fmt: skip

    def inference(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.program is None:  # warm-up inside initialize, before the program exists
            return super().inference(batch)
        device = self.device.device
        with torch.inference_mode():
            output, path = self.program(*(t.to(device, non_blocking=True) for t in batch))
            output = output.to("cpu")  # a copy: a CUDA graph's static output is overwritten by the next replay
        self.last_path = path
        if path == FALLBACK:
            logger.info(
                "Nimble fallback: batch of %d is above the largest bucket %d, ran eager",
                batch[0].shape[0], self.program.sizes[-1],
            )  # fmt: skip
        return output
