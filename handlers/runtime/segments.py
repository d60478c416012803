"""A model cut into segments that run one after another on batch-first state.

DVABatch runs each *stage* of a model on its own executor and moves batches
between them (it merges newcomers into a batch that waits at a stage, splits a
batch into halves); REEF stops best-effort work at *segment* boundaries when a
real-time request arrives.  Both need the same thing: the model as a sequence
of callables whose state between two calls is a handful of tensors, each with
the batch in dimension 0, so that a state can be cut by rows or joined with
another.  This module makes that sequence from a traced fx graph; it knows
nothing of schedulers.

How a graph becomes segments:

- The model is traced to an fx graph: ``torch.fx.symbolic_trace`` where it
  works (torchvision models), otherwise ``torch.export`` with a dynamic batch
  dimension (and a dynamic sequence dimension for token models), whose graph
  is made of ATen ops.  Either way the graph runs any batch size.
- Values are classified by running the graph at two batch sizes and once
  more with the rows of the larger batch reordered: a *batch value* is a
  tensor whose dimension 0 is the batch in both sizes and whose rows follow
  the reorder (row i is request i's, whatever batch it ran in); every other
  value (parameters, shapes, sizes, position tables) is *batch-free*.  The
  reorder is what excludes a row *index* such as ``arange(batch)`` (BERT's
  mask lookup has one): batch-shaped, but cut by rows or joined by
  ``torch.cat`` it would point past its own rows.
- A cut may fall between any two batch nodes in topological order.  A
  batch-free value a segment needs is recomputed inside it from its own
  inputs (pure, and cheap for what occurs in practice: sizes, views of
  weights); the batch values it needs cross the cut in the state.  So every
  state is a dict of batch-first tensors, and ``split_state`` /
  ``merge_states`` are row slicing and ``torch.cat``.
- Cuts are placed to balance the segments' times (the paper's "time-even"
  stages): per-node times are measured on an example batch and the cut
  positions minimise the slowest segment (``balanced_cuts``, exact).
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn

State = dict[str, torch.Tensor]


class SegmentError(ValueError):
    """The model cannot be segmented as asked (untraceable, too few cut points, outputs differ)."""


# -- tracing ------------------------------------------------------------------------


def dynamic_dims_for(input_kind: str) -> tuple[int, ...]:
    """The input dimensions a sliced model must accept at any size: the batch,
    and for token models the sequence (length classes, ``InputCodec``).  The
    builder's check and the worker slice with the same ones."""
    return (0, 1) if input_kind == "tokens" else (0,)


def trace(
    model: nn.Module, example_inputs: tuple[torch.Tensor, ...], dynamic_dims: Sequence[int] = (0,)
) -> fx.GraphModule:
    """An fx graph of ``model`` that runs at any batch size.

    ``dynamic_dims``: the input dimensions that may vary between calls when
    ``torch.export`` has to be used (dimension 0, the batch, always; add 1 for
    token models whose sequence length varies).  A graph from
    ``symbolic_trace`` does not fix shapes at all.
    """
    try:
        return fx.symbolic_trace(model)
    except Exception:  # data-dependent Python control flow: fall back to export, below
        pass
    # DYNAMIC, not a Dim with a range: export derives the range the model
    # allows (BERT's positions stop at 512) instead of failing on ours.
    shapes = tuple({d: torch.export.Dim.DYNAMIC for d in dynamic_dims if d < x.dim()} for x in example_inputs)
    # Fresh tensors: export guards on a view's base, so a sliced example would
    # make the graph refuse inputs whose base differs.
    example_inputs = tuple(x.clone() for x in example_inputs)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning)
            exported = torch.export.export(model, example_inputs, dynamic_shapes=shapes, strict=False)
    except Exception as exc:
        raise SegmentError(f"cannot trace {type(model).__name__}: {exc}") from exc
    return exported.module()


# -- classifying values ---------------------------------------------------------------


class _Recorder(fx.Interpreter):
    """Runs the graph once, keeping whether each value is batch-first and each node's time; with
    ``row_sums``, also each batch-first value's sum per row (a cheap fingerprint of its rows)."""

    def __init__(self, gm: fx.GraphModule, batch: int, timed: bool, row_sums: bool = False) -> None:
        super().__init__(gm)
        self.batch = batch
        self.timed = timed
        self.keep_row_sums = row_sums
        self.batch_first: dict[str, bool] = {}
        self.row_sums: dict[str, torch.Tensor] = {}
        self.seconds: dict[str, float] = {}

    def run_node(self, n: fx.Node):  # noqa: ANN201 - any value
        started = time.perf_counter()
        value = super().run_node(n)
        if self.timed:
            self.seconds[n.name] = time.perf_counter() - started
        first = isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == self.batch
        self.batch_first[n.name] = first
        if first and self.keep_row_sums and not value.is_complex():
            self.row_sums[n.name] = value.detach().reshape(self.batch, -1).to(torch.float64).sum(dim=1).cpu()
        return value


def batch_rows(inputs: Sequence[torch.Tensor], rows: int) -> tuple[torch.Tensor, ...]:
    """The example's first ``rows`` rows, repeated when it has fewer: fresh tensors on the example's device."""
    return tuple(x[torch.arange(rows, device=x.device) % x.shape[0]] for x in inputs)


ROW_ORDER = (1, 2, 0)  # the batch of 3's rows, reordered, for ``classify``


def classify(gm: fx.GraphModule, example_inputs: tuple[torch.Tensor, ...]) -> dict[str, bool]:
    """Node name → whether its value is a batch value: batch-first at batch 2 and at batch 3, and with the
    batch of 3's rows reordered, its rows reordered alike (compared by their sums)."""
    runs = []
    for rows, order in ((2, None), (3, None), (3, ROW_ORDER)):
        inputs = batch_rows(example_inputs, rows)
        if order is not None:
            inputs = tuple(x[list(order)] for x in inputs)
        recorder = _Recorder(gm, rows, timed=False, row_sums=rows == 3)
        with torch.no_grad():
            recorder.run(*inputs)
        runs.append(recorder)
    two, three, reordered = runs

    def follows_its_rows(name: str) -> bool:
        plain, moved = three.row_sums.get(name), reordered.row_sums.get(name)
        if plain is None or moved is None:
            return False
        return torch.allclose(moved, plain[list(ROW_ORDER)], rtol=1e-4, atol=1e-6, equal_nan=True)

    return {
        name: first and three.batch_first.get(name, False) and follows_its_rows(name)
        for name, first in two.batch_first.items()
    }


def node_times(gm: fx.GraphModule, example_inputs: tuple[torch.Tensor, ...], repeats: int = 3) -> dict[str, float]:
    """Node name → median seconds of that node over ``repeats`` runs (after one warm-up)."""
    runs: list[dict[str, float]] = []
    batch = example_inputs[0].shape[0]
    for i in range(repeats + 1):
        recorder = _Recorder(gm, batch, timed=True)
        with torch.no_grad():
            recorder.run(*example_inputs)
        if i:
            runs.append(recorder.seconds)
    return {name: statistics.median(run[name] for run in runs) for name in runs[0]}


# -- placing cuts ---------------------------------------------------------------------


def balanced_cuts(times: Sequence[float], allowed: Sequence[int], segments: int) -> list[int]:
    """Cut positions that minimise the slowest segment.

    ``times[j]`` is item j's cost; a cut at position p splits items ``[..p)``
    from ``[p..)``; ``allowed`` lists the positions a cut may take (strictly
    inside ``0 < p < len(times)``).  Returns ``segments − 1`` increasing
    positions.  Exact: dynamic programming over the allowed positions.
    """
    if segments < 1:
        raise SegmentError(f"need at least one segment, got {segments}")
    positions = sorted({p for p in allowed if 0 < p < len(times)})
    if len(positions) < segments - 1:
        raise SegmentError(f"{segments} segments need {segments - 1} cut points; the graph has {len(positions)}")
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    bounds = [0, *positions, len(times)]  # candidate segment boundaries
    last = len(bounds) - 1
    inf = float("inf")
    # best[k][j]: the least possible slowest segment covering items [0..bounds[j]) in k segments.
    best = [[inf] * (last + 1) for _ in range(segments + 1)]
    back = [[0] * (last + 1) for _ in range(segments + 1)]
    best[0][0] = 0.0
    for k in range(1, segments + 1):
        for j in range(k, last + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf:
                    continue
                cost = max(best[k - 1][i], prefix[bounds[j]] - prefix[bounds[i]])
                if cost < best[k][j]:
                    best[k][j], back[k][j] = cost, i
    cuts, j = [], last
    for k in range(segments, 1, -1):
        j = back[k][j]
        cuts.append(bounds[j])
    return sorted(cuts)


# -- the segmented model --------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """One piece of the graph: takes the state ``inputs`` names, returns ``outputs`` (a state)."""

    index: int
    module: fx.GraphModule
    inputs: tuple[str, ...]  # state keys it reads
    outputs: tuple[str, ...]  # state keys it writes (its new values and those it passes on)
    nodes: int  # graph nodes of its own (not counting recomputed batch-free ones)

    def __call__(self, state: State) -> State:
        values = self.module(*(state[name] for name in self.inputs))
        return dict(zip(self.outputs, values, strict=True))


class SegmentedModel(nn.Module):
    """``model`` as ``len(segments)`` pieces; ``forward`` runs them all in order.

    ``start(*inputs)`` makes the first state, ``segment(state)`` advances one
    segment, ``finish(state)`` reads the output from the last state.
    """

    def __init__(self, segments: list[Segment], input_names: tuple[str, ...], output_names: tuple[str, ...]) -> None:
        super().__init__()
        self._segments = list(segments)
        self.stages = nn.ModuleList(seg.module for seg in segments)
        self.input_names = input_names
        self.output_names = output_names

    def __len__(self) -> int:
        return len(self._segments)

    def __getitem__(self, index: int) -> Segment:
        return self._segments[index]

    def __iter__(self) -> Iterator[Segment]:
        return iter(self._segments)

    def start(self, *inputs: torch.Tensor) -> State:
        if len(inputs) != len(self.input_names):
            raise SegmentError(f"expected {len(self.input_names)} inputs, got {len(inputs)}")
        return dict(zip(self.input_names, inputs, strict=True))

    def finish(self, state: State) -> torch.Tensor | tuple[torch.Tensor, ...]:
        outs = tuple(state[name] for name in self.output_names)
        return outs[0] if len(outs) == 1 else outs

    def forward(self, *inputs: torch.Tensor):  # noqa: ANN201 - the model's own output
        state = self.start(*inputs)
        for seg in self._segments:
            state = seg(state)
        return self.finish(state)


def split_state(state: State, sizes: Sequence[int]) -> list[State]:
    """Cut a state into consecutive row blocks of ``sizes`` (each request keeps its rows)."""
    total = state_rows(state)
    if sum(sizes) != total or any(s <= 0 for s in sizes):
        raise SegmentError(f"cannot split a batch of {total} into {list(sizes)}")
    parts: list[State] = [{} for _ in sizes]
    for name, value in state.items():
        for part, piece in zip(parts, torch.split(value, list(sizes)), strict=True):
            part[name] = piece
    return parts


def merge_states(states: Sequence[State]) -> State:
    """Join states that stand at the same segment, rows in the given order."""
    if not states:
        raise SegmentError("nothing to merge")
    keys = states[0].keys()
    if any(s.keys() != keys for s in states):
        raise SegmentError("states at different segments cannot merge")
    return {name: torch.cat([s[name] for s in states]) for name in keys}


def state_rows(state: State) -> int:
    return next(iter(state.values())).shape[0]


def _segment_module(
    gm: fx.GraphModule,
    own: list[fx.Node],
    needs: list[fx.Node],
    batch: dict[str, bool],
    keep: list[fx.Node],
) -> tuple[fx.GraphModule, tuple[str, ...]]:
    """A GraphModule computing ``keep`` from the batch values ``needs`` by the nodes ``own``,
    recomputing the batch-free values they use; returns it with its input names."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in needs:
        env[node] = graph.placeholder(node.name)

    def value(node: fx.Node) -> fx.Node:
        if node not in env:  # a batch-free value, recomputed here (its inputs first)
            if batch.get(node.name, False) or node.op == "placeholder":
                raise SegmentError(f"value {node.name} crosses a cut but is not part of the state")
            for arg in node.all_input_nodes:
                value(arg)
            env[node] = graph.node_copy(node, lambda n: env[n])
        return env[node]

    for node in own:
        for arg in node.all_input_nodes:
            value(arg)
        env[node] = graph.node_copy(node, lambda n: env[n])
    for node in keep:
        value(node)
    graph.output(tuple(env[n] for n in keep))
    module = fx.GraphModule(gm, graph)
    module.graph.eliminate_dead_code()
    module.delete_all_unused_submodules()
    module.recompile()
    return module, tuple(n.name for n in needs)


def _needed_batch_values(nodes: list[fx.Node], batch: dict[str, bool]) -> set[fx.Node]:
    """The batch values (placeholders included) that ``nodes`` read, through batch-free ones."""
    found: set[fx.Node] = set()
    own = set(nodes)
    stack = [arg for n in nodes for arg in n.all_input_nodes]
    visited: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in visited or node in own:
            continue
        visited.add(node)
        if node.op == "placeholder" or batch.get(node.name, False):
            found.add(node)
        else:
            stack.extend(node.all_input_nodes)
    return found


def cut(gm: fx.GraphModule, batch: dict[str, bool], positions: Sequence[int]) -> SegmentedModel:
    """Cut ``gm`` before the batch nodes at ``positions`` (indices into :func:`batch_nodes`)."""
    order = batch_nodes(gm, batch)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    flat_out = _flatten(output.args[0])
    bounds = [0, *positions, len(order)]
    groups = [order[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    if any(not g for g in groups):
        raise SegmentError(f"cut positions {list(positions)} leave an empty segment")
    # What each group needs from before it, and what must survive each cut.
    needs = [_needed_batch_values(g, batch) for g in groups]
    final = _needed_batch_values([output], batch)
    position = {n: i for i, n in enumerate(order)}
    segments: list[Segment] = []
    for s, group in enumerate(groups):
        later = set().union(*needs[s + 1 :], final)
        carried = sorted(
            later - set(groups[s]) - set().union(*groups[s + 1 :]), key=lambda n: _rank(n, position, placeholders)
        )
        made = [n for n in group if n in later]
        keep = sorted(set(carried) | set(made), key=lambda n: _rank(n, position, placeholders))
        inputs = sorted(needs[s] | set(carried), key=lambda n: _rank(n, position, placeholders))
        module, names = _segment_module(gm, group, inputs, batch, keep)
        segments.append(Segment(s, module, names, tuple(n.name for n in keep), len(group)))
    for node in flat_out:
        if not isinstance(node, fx.Node) or not (node.op == "placeholder" or batch.get(node.name, False)):
            raise SegmentError(f"model output {node} is not a batch-first tensor")
    return SegmentedModel(segments, tuple(n.name for n in placeholders), tuple(n.name for n in flat_out))


def _flatten(arg) -> list:  # noqa: ANN001 - fx argument structure
    if isinstance(arg, (tuple, list)):
        return [x for a in arg for x in _flatten(a)]
    if isinstance(arg, dict):
        return [x for a in arg.values() for x in _flatten(a)]
    return [arg]


def _rank(node: fx.Node, position: dict[fx.Node, int], placeholders: list[fx.Node]) -> tuple[int, int]:
    if node in position:
        return 1, position[node]
    return 0, placeholders.index(node)


def batch_nodes(gm: fx.GraphModule, batch: dict[str, bool]) -> list[fx.Node]:
    """The graph's computing nodes that produce batch values, in topological order: what segments own."""
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr") and batch.get(n.name)]


# -- putting it together --------------------------------------------------------------


def slice_model(
    model: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    segments: int,
    dynamic_dims: Sequence[int] = (0,),
    repeats: int = 3,
    check: Callable[[torch.Tensor, torch.Tensor], bool] | None = None,
) -> SegmentedModel:
    """``model`` cut into ``segments`` pieces of near-equal time on ``example_inputs``.

    The time of a batch-free node is charged to the next batch node (where it
    is recomputed in practice).  With ``check`` (``check(got, expected)``),
    the sliced model's output on the example must pass it against the
    model's own, or :class:`SegmentError` is raised: a build-time guarantee.
    """
    gm = trace(model, example_inputs, dynamic_dims)
    batch = classify(gm, example_inputs)
    seconds = node_times(gm, example_inputs, repeats)
    order = batch_nodes(gm, batch)
    cost, pending = [], 0.0
    owned = set(order)
    for node in gm.graph.nodes:
        if node in owned:
            cost.append(pending + seconds.get(node.name, 0.0))
            pending = 0.0
        else:
            pending += seconds.get(node.name, 0.0)
    if cost:
        cost[-1] += pending
    positions = balanced_cuts(cost, range(1, len(order)), segments)
    sliced = cut(gm, batch, positions)
    if check is not None:
        with torch.no_grad():
            expected, got = model(*example_inputs), sliced(*example_inputs)
        if not check(got, expected):
            raise SegmentError(f"the {segments}-segment {type(model).__name__} does not reproduce the model's output")
    return sliced


__all__ = [
    "Segment",
    "SegmentError",
    "SegmentedModel",
    "State",
    "balanced_cuts",
    "batch_nodes",
    "classify",
    "cut",
    "merge_states",
    "node_times",
    "slice_model",
    "split_state",
    "state_rows",
    "trace",
]
