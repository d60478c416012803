"""The DVABatch handler: the async runtime plus DVABatch's stage pipeline, configured from the archive."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from handlers.codecs import ModelInput
from handlers.dvabatch.engine import DvaBatchEngine
from handlers.dvabatch.merge import LengthClassMerger
from handlers.dvabatch.policy import DvaBatchConfig
from handlers.runtime.async_handler import AsyncModelHandler
from handlers.runtime.segment_profile import SegmentProfile, measure_classes, measure_segments
from handlers.runtime.segments import SegmentedModel, SegmentError, dynamic_dims_for, slice_model
from model_store.factory import outputs_close

logger = logging.getLogger(__name__)
# Each batch size of the start-up profile is timed at least this long in all (``measure_segments``): a
# steady median for stages of a millisecond, whose merge and split decisions read it, at most
# 0.1 s per size and length class.
PROFILE_MIN_MS = 100.0


class DvaBatchHandler(AsyncModelHandler):
    def __init__(self) -> None:
        super().__init__()
        self.config = DvaBatchConfig()
        self._sliced: SegmentedModel | None = None  # a token model's stages, shared by its length classes
        # Per length class: (length, engine, the shape of one output row), for merging classes.
        self._classes: list[tuple[int, DvaBatchEngine, tuple[int, ...]]] = []

    def configure(self, handler_config: dict[str, Any]) -> None:
        self.config = DvaBatchConfig.from_dict(handler_config.get("dvabatch"))

    def cpu_lane_count(self) -> int:
        """One lane per stage by default, so the stages run as a pipeline, each on its share of the cores.

        ``cpu_lanes: 1`` runs every stage on all the cores instead, one stage
        at a time (FIFO with the lane's decodes): on a CPU where intra-op
        threads scale as well as a pipeline would, a pipeline of narrower
        stages only adds latency (``docs/benchmarks/dvabatch_bert-base.md``).
        """
        return self.config.cpu_lanes or self.config.segments

    def _segments_for(self, example: tuple[torch.Tensor, ...]) -> SegmentedModel:
        """The model in stages, checked on ``example`` (the worker checks what the builder checked).

        A token model is sliced once, its sequence dimension left dynamic, and
        the same stages serve every declared length class (``token_lengths``,
        the input-diversity policy), each checked before its engine serves.
        Other models are sliced per input layout.
        """

        def check(got: torch.Tensor, expected: torch.Tensor) -> bool:
            return outputs_close(got, expected, 1e-4)

        if self.spec.input_kind != "tokens" or self._sliced is None:
            dims = dynamic_dims_for(self.spec.input_kind)
            sliced = slice_model(self.model, example, self.config.segments, dims, repeats=1, check=check)
            if self.spec.input_kind == "tokens":
                self._sliced = sliced
            return sliced
        with torch.no_grad():
            expected, got = self.model(*example), self._sliced(*example)
        if not check(got, expected):
            length = example[0].shape[1]
            raise SegmentError(f"the stages of {self.spec.name} do not reproduce the model at {length} tokens")
        return self._sliced

    def create_engine(self, layout_example: ModelInput) -> DvaBatchEngine:
        if self.spec.mode != "eager":
            raise RuntimeError(f"DVABatch slices the eager model; this archive is {self.spec.mode!r}: rebuild it eager")

        def rows(batch: int) -> tuple[torch.Tensor, ...]:
            return tuple(
                t.unsqueeze(0).expand(batch, *t.shape).clone().to(self.device.device) for t in layout_example.tensors
            )

        sliced = self._segments_for(rows(2))
        profile = None
        if self.config.split and not self._merges_classes():
            # Split decisions need this machine's segment times at the lanes' thread count:
            # a short profile at worker start, on a lane.  (Merged classes get theirs in ``initialize``.)
            sizes = sorted({1, max(1, self.config.max_batch // 2), self.config.max_batch})

            def measure() -> SegmentProfile:
                return measure_segments(
                    sliced,
                    rows,
                    sizes,
                    self.spec.name,
                    warmup=1,
                    iters=2,
                    command="worker start-up",
                    progress=False,
                    min_ms=PROFILE_MIN_MS,
                )

            profile = self.lanes.submit(measure).result() if self.lanes is not None else measure()
        nodes = [seg.nodes for seg in sliced]
        logger.info("DVABatch: %s in %d segments of %s graph nodes", self.spec.name, len(sliced), nodes)
        engine = DvaBatchEngine(sliced, layout_example, self.device, self.config, self.metrics, self.lanes, profile)
        if self._class_count() > 1:
            with torch.no_grad():
                out_row = tuple(self.model(*rows(1)).shape[1:])
            self._classes.append((layout_example.shapes[0][0], engine, out_row))
        return engine

    def _class_count(self) -> int:
        """Length classes the archive declares (token models; 1 for any other)."""
        return len(self.codec.token_lengths) if self.spec.input_kind == "tokens" else 1

    def _merges_classes(self) -> bool:
        """Whether length classes may merge: a token model with several, on CPU (the row line's)."""
        return self.config.merge_lengths and self._class_count() > 1 and not self.device.is_cuda

    def initialize(self, context: Any) -> None:
        super().initialize(context)
        if self._merges_classes() and self._classes:
            self._profile_classes_together()

    def _profile_classes_together(self) -> None:
        """Every length class's profile, measured round by round together and through the stages as they
        run (traced buckets): the merge compares classes with each other, and profiles measured one
        after another, before the traces, differed by the machine's drift (``measure_classes``)."""
        lengths = [length for length, _, _ in self._classes]
        sliced = self._classes[0][1].sliced  # one model in stages for every class
        sizes = sorted({1, max(1, self.config.max_batch // 2), self.config.max_batch})

        def inputs(length: int):
            return lambda batch: (
                torch.zeros(batch, length, dtype=torch.long),
                torch.ones(batch, length, dtype=torch.long),
            )

        def measure() -> list[SegmentProfile]:
            return measure_classes(
                sliced, [inputs(n) for n in lengths], sizes, self.spec.name, warmup=1, iters=2,
                command="worker start-up", progress=False, min_ms=PROFILE_MIN_MS,
                run_stages=[engine.timed_stage for _, engine, _ in self._classes],
            )  # fmt: skip

        started = time.perf_counter()
        profiles = self.lanes.submit(measure).result() if self.lanes is not None else measure()
        for (_, class_engine, _), profile in zip(self._classes, profiles, strict=True):
            class_engine.policy.profile = profile
        logger.info(
            "DVABatch: %s's %d length classes profiled together in %.1f s; one batch of %d through every stage "
            "(ms): %s",
            self.spec.name, len(lengths), time.perf_counter() - started, self.config.max_batch,
            {n: round(p.remaining_ms(0, self.config.max_batch), 3) for n, p in zip(lengths, profiles, strict=True)},
        )  # fmt: skip

    def regroup_rows(self) -> LengthClassMerger | None:
        """Length classes merged per hand-over where the profile says that costs less (``merge.py``).

        Only where every class answers with rows of one shape (a model
        whose output follows the length, per-token logits, would answer a
        widened request with more rows) and every class has a profile.
        """
        if not self.config.merge_lengths or len(self._classes) < 2:
            return None
        if len({out_row for _, _, out_row in self._classes}) > 1:
            logger.info("DVABatch: %s answers by length; its length classes are never merged", self.spec.name)
            return None
        if any(engine.policy.profile is None for _, engine, _ in self._classes):
            return None
        classes = [(length, engine) for length, engine, _ in self._classes]
        return LengthClassMerger(classes, self.config.max_batch, len(self._classes[0][1].sliced), self.metrics)
