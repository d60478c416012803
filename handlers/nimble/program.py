"""A model prepared ahead of time, Nimble's way, and the choice of program per bucket.

Preparation, once per worker:

1. trace the eager model to an fx graph and fold batch norms into the
   convolutions before them (``torch.fx.experimental.optimization.fuse``):
   the frozen graph every candidate below runs;
2. assign its operators to streams (``handlers/nimble/stream_assignment``);
3. build the candidates: ``eager`` (the model as loaded), ``single`` (the
   frozen graph on one stream; on CUDA captured into one CUDA graph per
   bucket), ``multi`` (the same graph on its assigned streams; on CPU its
   chains on threads; on CUDA captured with its streams and events), when
   the graph has more than one stream, and ``compiled`` (the frozen graph
   under torch.compile: on CPU generated code, the CPU's analogue of a
   captured graph; on CUDA inductor's fused kernels captured into one CUDA
   graph per bucket, which is what ``torch.compile(mode="reduce-overhead")``
   itself serves, so Nimble's choice is never behind it);
4. for each bucket, check every candidate's output against eager's and time
   it (median of a few runs), and keep the fastest.  Eager is a candidate,
   so a bucket is never served by something measured slower than eager:
   the issue's "never default to something slower", made a mechanism.

The choice is per machine and per bucket on purpose: on a 2-core VM the
threads of ``multi`` lose to one thread team (OpenMP teams of concurrent
chains spin against each other), while on a GPU concurrent streams fill
SMs a small batch leaves idle; neither is assumed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.fx.experimental.optimization import fuse

from handlers.nimble.config import COMPILED, EAGER, MULTI, SINGLE, NimbleConfig
from handlers.nimble.multistream import ChainRunner, assign_graph, rewrite_for_streams
from handlers.nimble.stream_assignment import StreamAssignment
from handlers.runtime.segments import batch_rows, trace
from handlers.runtime.timing import median_seconds

logger = logging.getLogger(__name__)

# Candidates must reproduce eager's output to this fraction of its largest
# value (batch-norm folding and thread counts change float summation order).
TOLERANCE = 1e-3
# ... and to this one where CUDA computes float32 through TF32 (PyTorch's
# default for cuDNN convolutions): there eager itself is 0.4-1.4e-3 of the
# scale away from a float64 reference on ResNet-50, Inception-v3 and
# EfficientNet-B0 (measured on an H200), and so is the folded graph, each
# with its own rounding, so the two differ by up to a few 1e-3.  A wrong
# program (a stale weight, a missing synchronisation) is off by the order of
# the output itself.
TF32_TOLERANCE = 1e-2
FALLBACK = "eager (above the largest bucket)"


def tolerance_for(device: torch.device) -> float:
    """The relative tolerance of ``reproduces`` for outputs computed on ``device``."""
    if device.type == "cuda" and (torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32):
        return TF32_TOLERANCE
    return TOLERANCE


def reproduces(got: torch.Tensor, expected: torch.Tensor, tol: float | None = None) -> bool:
    """Equal up to ``tol`` of the expected output's largest magnitude, however small that is.

    Relative to the output's own scale with no floor: an untrained
    EfficientNet answers logits near 1e-14, where an absolute floor would
    accept anything.  ``tol`` defaults to what the output's device computes
    to (``tolerance_for``).
    """
    if tol is None:
        tol = tolerance_for(expected.device)
    if got.shape != expected.shape:
        return False
    if expected.numel() == 0:
        return True
    got, expected = got.float(), expected.float()
    scale = float(expected.abs().max())
    return bool(torch.isfinite(got).all()) and float((got - expected).abs().max()) <= tol * scale


class NimbleError(RuntimeError):
    """The model cannot be prepared (untraceable, or no candidate reproduces it)."""


@dataclass(frozen=True)
class BucketChoice:
    """What runs a bucket, and the timings it was chosen from (milliseconds, median)."""

    batch: int
    chosen: str
    ms: dict[str, float]
    refused: tuple[str, ...] = ()  # candidates that failed or whose output differed from eager's

    def describe(self) -> str:
        timings = ", ".join(f"{name} {ms:.1f} ms" for name, ms in self.ms.items())
        refused = f"; refused (failed, or output differs): {', '.join(self.refused)}" if self.refused else ""
        return f"batch {self.batch}: {self.chosen} ({timings}{refused})"


def time_ms(program: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], runs: int) -> float:
    """Median milliseconds of ``runs`` calls, after one untimed call (on CUDA, each call's kernels included)."""
    device = inputs[0].device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    return 1e3 * median_seconds(lambda: program(*inputs), warm=1, repeats=runs, sync=sync)


@dataclass
class NimbleProgram:
    """Runs a batch with its bucket's chosen program; eager above the largest bucket."""

    eager: nn.Module
    candidates: dict[str, Callable[..., torch.Tensor]]
    choices: list[BucketChoice]
    assignment: StreamAssignment
    device: torch.device
    _closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def sizes(self) -> list[int]:
        return [c.batch for c in self.choices]

    def choice_for(self, rows: int) -> BucketChoice | None:
        return next((c for c in self.choices if c.batch >= rows), None)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, str]:
        """The model's output for ``inputs`` and the name of the program that made it."""
        choice = self.choice_for(inputs[0].shape[0])
        if choice is None:
            return self.eager(*inputs), FALLBACK
        return self.candidates[choice.chosen](*inputs), choice.chosen

    def describe(self) -> str:
        a = self.assignment
        head = (
            f"{a.streams} stream(s), {len(a.syncs)} synchronisation(s) "
            f"(|E'| {a.reduced_edges} − |M| {a.matching_size}) over {len(a.stream_of)} operators on {self.device}"
        )
        return "; ".join([head, *(c.describe() for c in self.choices)])

    def close(self) -> None:
        for close in self._closers:
            close()
        self._closers.clear()


def freeze(model: nn.Module, example: Sequence[torch.Tensor]) -> fx.GraphModule:
    """The model as an fx graph with batch norms folded into their convolutions."""
    try:
        gm = trace(model, tuple(example))
    except Exception as exc:
        raise NimbleError(f"cannot trace {type(model).__name__} to an fx graph: {exc}") from exc
    return fuse(gm, no_trace=True)


@dataclass
class Candidates:
    """The programs a bucket may be served by, built once per worker (see the module doc)."""

    programs: dict[str, Callable[..., torch.Tensor]]
    assignment: StreamAssignment
    closers: dict[str, Callable[[], None]] = field(default_factory=dict)

    def drop(self, name: str) -> None:
        self.programs.pop(name, None)
        close = self.closers.pop(name, None)
        if close is not None:
            close()

    def close(self, keep: Sequence[str] = ()) -> None:
        """Release what the programs hold (a chain runner's threads), except ``keep``'s."""
        for name in [n for n in self.closers if n not in keep]:
            self.closers.pop(name)()


def build_candidates(model: nn.Module, example: Sequence[torch.Tensor], config: NimbleConfig) -> Candidates:
    """Freeze the model, assign its streams and build the config's candidates on the example's device."""
    with torch.inference_mode():
        frozen = freeze(model, example)
    assignment = assign_graph(frozen)
    wanted = {"auto": (EAGER, SINGLE, MULTI), "multi": (MULTI,), "single": (SINGLE,), "eager": (EAGER,)}[config.streams]
    if MULTI in wanted and assignment.streams == 1:
        logger.info("Nimble: the graph is one chain (one stream); multi-stream is the same as single")
        wanted = tuple(w for w in wanted if w != MULTI) or (SINGLE,)
    cuda = example[0].device.type == "cuda"
    out = Candidates({}, assignment)
    if EAGER in wanted:
        out.programs[EAGER] = model
    if SINGLE in wanted:
        out.programs[SINGLE] = _captured(frozen, example, config) if cuda else frozen
    if MULTI in wanted:
        if cuda:
            # A second graph over the same submodules (no copy of the weights), rewritten for its streams.
            streamed = rewrite_for_streams(fx.GraphModule(frozen, _copy_graph(frozen)), assignment, example[0].device)
            out.programs[MULTI] = _captured(streamed, example, config)
        else:
            runner = ChainRunner(frozen, assignment, side_threads=config.side_threads)
            out.closers[MULTI] = runner.close
            out.programs[MULTI] = runner
    if config.streams == "auto" and config.cpu_compile and not cuda:
        out.programs[COMPILED] = torch.compile(frozen)  # compiled lazily, at its first call in ``choose``
    if config.streams == "auto" and config.cuda_compile and cuda:
        # Inductor's kernels under Nimble's own graphs (not inductor's CUDA-graph trees): compiled for
        # each bucket's static shape during the capture's warm-up runs, then replayed like SINGLE.
        out.programs[COMPILED] = _captured(torch.compile(frozen, dynamic=False), example, config)
    return out


def _copy_graph(gm: fx.GraphModule) -> fx.Graph:
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return graph


def _captured(program: fx.GraphModule, example: Sequence[torch.Tensor], config: NimbleConfig) -> Callable:
    from handlers.runtime.cuda_graphs import GraphBuckets

    return GraphBuckets(program, example, config.buckets)


def choose(
    model: nn.Module, candidates: Candidates, example: Sequence[torch.Tensor], config: NimbleConfig
) -> list[BucketChoice]:
    """Per bucket: every candidate checked against eager and timed; the fastest that reproduces it."""
    choices = []
    with torch.inference_mode():
        for batch in config.buckets:
            inputs = batch_rows(example, batch)
            expected = model(*inputs)
            ms: dict[str, float] = {}
            refused = []
            for name, program in list(candidates.programs.items()):
                try:
                    got = program(*inputs)
                except Exception as exc:
                    if name == EAGER:
                        raise
                    # e.g. inductor without a C compiler: that candidate is out, the worker still starts
                    logger.warning("Nimble: %s failed at batch %d and is dropped: %s", name, batch, exc)
                    candidates.drop(name)
                    refused.append(name)
                    continue
                if name != EAGER and not reproduces(got, expected):
                    refused.append(name)
                    continue
                ms[name] = time_ms(program, inputs, config.timing_runs)
            if not ms:  # only possible when eager was not a candidate
                raise NimbleError(f"no Nimble program reproduces the model at batch {batch}: {', '.join(refused)}")
            choices.append(BucketChoice(batch, fastest(ms, config.min_gain), ms, tuple(refused)))
    return choices


def fastest(ms: dict[str, float], min_gain: float) -> str:
    """The fastest candidate; eager unless the fastest beats it by ``min_gain`` (config)."""
    chosen = min(ms, key=ms.__getitem__)
    if EAGER in ms and chosen != EAGER and ms[chosen] > (1 - min_gain) * ms[EAGER]:
        return EAGER
    return chosen


def prepare(model: nn.Module, example: Sequence[torch.Tensor], config: NimbleConfig) -> NimbleProgram:
    """Prepare ``model`` (eval mode, on the example's device) for the config's buckets; see the module doc."""
    candidates = build_candidates(model, example, config)
    choices = choose(model, candidates, example, config)
    used = {c.chosen for c in choices}
    candidates.close(keep=used)  # e.g. a chain runner no bucket chose: its threads go now
    programs = {k: v for k, v in candidates.programs.items() if k in used}
    program = NimbleProgram(model, programs, choices, candidates.assignment, example[0].device)
    program._closers.extend(candidates.closers.values())
    return program
