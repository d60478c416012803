"""Run an fx graph on several streams (CUDA) or threads (CPU) from a stream assignment.

``handlers/nimble/stream_assignment.py`` says which operator goes on which
stream and which edges need an event.  This module is the mechanism that
carries it out, two ways:

- **CUDA** (``rewrite_for_streams``): the graph itself is rewritten.  Before
  an operator, a call switches the current stream to its stream and waits
  for the events of its cross-stream inputs; after it, an event is recorded
  if another stream waits for it.  The program forks its side streams from
  the caller's stream at the start and joins them back before returning, so
  it can be captured into a CUDA graph as it stands (a capture must end on
  the stream it began on) and replayed with no Python at all.  A value read
  on a stream other than the one that made it is kept alive until the join:
  the caching allocator would otherwise hand its memory to the next
  allocation on the producer's stream while the reader may still run.
- **CPU** (``ChainRunner``): the same chains run on threads, one per chain
  (the caller's thread takes chain 0), with ``threading.Event`` in place of
  CUDA events.  ATen releases the GIL inside its kernels, so operators on
  different chains do overlap; whether that beats one thread running every
  operator with all the cores is the machine's to say, and the Nimble
  handler measures it rather than assuming.

Operators are the graph's ``call_module`` / ``call_function`` /
``call_method`` nodes; placeholders and constants are visible everywhere.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from torch import fx, nn

from handlers.nimble.stream_assignment import StreamAssignment, assign_streams
from handlers.runtime.intra_op import use_intra_op_threads

OPERATOR_OPS = frozenset({"call_module", "call_function", "call_method"})
CONTEXT_ATTR = "nimble_streams"


def operator_graph(gm: fx.GraphModule) -> nx.DiGraph:
    """The DAG of a graph's operators (node names), an edge for every data dependency."""
    dag = nx.DiGraph()
    for node in gm.graph.nodes:
        if node.op not in OPERATOR_OPS:
            continue
        dag.add_node(node.name)
        for source in node.all_input_nodes:
            if source.op in OPERATOR_OPS:
                dag.add_edge(source.name, node.name)
    return dag


def assign_graph(gm: fx.GraphModule) -> StreamAssignment:
    """Nimble's stream assignment of ``gm``'s operators, streams numbered in program order."""
    order = [n.name for n in gm.graph.nodes if n.op in OPERATOR_OPS]
    return assign_streams(operator_graph(gm), order)


def _cross_stream_values(gm: fx.GraphModule, assignment: StreamAssignment) -> list[fx.Node]:
    """Operator values some other stream reads (through any edge, reduced or not)."""
    values = []
    for node in gm.graph.nodes:
        if node.op not in OPERATOR_OPS:
            continue
        mine = assignment.stream_of[node.name]
        readers = [u for u in node.users if u.op in OPERATOR_OPS]
        if any(assignment.stream_of[u.name] != mine for u in readers):
            values.append(node)
    return values


# -- CUDA: the rewritten graph ---------------------------------------------------------


class StreamContext(nn.Module):
    """The streams and events one rewritten graph runs with.

    A module (with no parameters) only so that the graph can hold it as a
    submodule, which is what fx expects of a ``get_attr`` target.

    Stream 0 is whatever stream is current when the program starts (the
    capture stream during capture); streams 1.. are the program's own.  On
    a device without streams (``device.type != "cuda"``) every call only
    appends to ``trace`` when tracing is on: that is how the rewrite is
    checked on a machine without a GPU.
    """

    def __init__(self, streams: int, events: Iterable[str], device: torch.device, trace: bool = False) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.count = streams
        self.on_cuda = self.device.type == "cuda"
        self.trace: list[tuple[str, Any]] | None = [] if trace else None
        self._caller: Any = None
        if self.on_cuda:
            self.streams: list[Any] = [None] + [torch.cuda.Stream(self.device) for _ in range(streams - 1)]
            self.events = {name: torch.cuda.Event() for name in events}
            self._fork = torch.cuda.Event()
            self._tails = [torch.cuda.Event() for _ in range(streams)]

    def _log(self, what: str, arg: Any) -> None:
        if self.trace is not None:
            self.trace.append((what, arg))

    def fork(self) -> None:
        self._log("fork", None)
        if not self.on_cuda:
            return
        self._caller = torch.cuda.current_stream(self.device)
        self.streams[0] = self._caller
        self._fork.record(self._caller)
        for stream in self.streams[1:]:
            stream.wait_event(self._fork)

    def use(self, stream: int) -> None:
        self._log("use", stream)
        if self.on_cuda:
            torch.cuda.set_stream(self.streams[stream])

    def wait(self, stream: int, event: str) -> None:
        self._log("wait", (stream, event))
        if self.on_cuda:
            self.streams[stream].wait_event(self.events[event])

    def record(self, stream: int, event: str) -> None:
        self._log("record", (stream, event))
        if self.on_cuda:
            self.events[event].record(self.streams[stream])

    def join(self, *keep_alive: Any) -> None:
        """Back on the caller's stream, after every side stream's work (``keep_alive``: see the module doc)."""
        self._log("join", len(keep_alive))
        if not self.on_cuda:
            return
        torch.cuda.set_stream(self._caller)
        for tail, stream in zip(self._tails[1:], self.streams[1:], strict=True):
            tail.record(stream)
            self._caller.wait_event(tail)


def rewrite_for_streams(
    gm: fx.GraphModule, assignment: StreamAssignment | None = None, device: torch.device | str = "cuda",
    trace: bool = False,
) -> fx.GraphModule:  # fmt: skip
    """``gm`` rewritten in place to run its operators on their streams (see the module doc).

    The graph keeps its operators and their order; stream switches, waits,
    records, a fork and a join are added around them.  Returns ``gm``; its
    ``StreamContext`` is ``gm.nimble_streams``.
    """
    assignment = assignment or assign_graph(gm)
    waits = assignment.waits_for()
    recorded = assignment.recorded()
    context = StreamContext(assignment.streams, recorded, torch.device(device), trace=trace)
    setattr(gm, CONTEXT_ATTR, context)
    graph = gm.graph
    keep_alive = _cross_stream_values(gm, assignment)
    operators = [n for n in graph.nodes if n.op in OPERATOR_OPS]
    output = next(n for n in graph.nodes if n.op == "output")
    if not operators:
        return gm
    with graph.inserting_before(operators[0]):
        ctx = graph.get_attr(CONTEXT_ATTR)
        graph.call_method("fork", (ctx,))
    current = 0
    for node in operators:
        stream = assignment.stream_of[node.name]
        with graph.inserting_before(node):
            if stream != current:
                graph.call_method("use", (ctx, stream))
                current = stream
            for source in waits.get(node.name, ()):
                graph.call_method("wait", (ctx, stream, source))
        if node.name in recorded:
            with graph.inserting_after(node):
                graph.call_method("record", (ctx, stream, node.name))
    with graph.inserting_before(output):
        graph.call_method("join", (ctx, *keep_alive))
    graph.lint()
    gm.recompile()
    return gm


# -- CPU: chains on threads --------------------------------------------------------------


@dataclass
class _Step:
    """One operator, resolved once so that a run does no lookups by name."""

    node: fx.Node
    call: Callable[..., Any]
    frees: list[fx.Node] = field(default_factory=list)


class _Run:
    """One forward's shared state: values, events, the first error."""

    def __init__(self, recorded: Iterable[str], readers: dict[fx.Node, int]) -> None:
        self.env: dict[fx.Node, Any] = {}
        self.events = {name: threading.Event() for name in recorded}
        self.readers_left = dict(readers)
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        # Grad and inference mode are per thread: the chains run in the caller's.
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()

    def fail(self, err: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = err
        for event in self.events.values():  # nobody waits forever for a value that will not come
            event.set()


class ChainRunner:
    """Runs ``gm`` with its stream assignment's chains on threads (see the module doc).

    ``side_threads``: intra-op threads each side chain's thread uses (the
    caller's thread keeps its own setting).  Values are freed as soon as
    their last reader has run, as in the generated code.  One forward at a
    time (the chain threads serve one run): concurrent callers take turns.
    ``close`` stops the threads; a runner is also a context manager.
    """

    def __init__(self, gm: fx.GraphModule, assignment: StreamAssignment | None = None, side_threads: int = 1) -> None:
        self.gm = gm
        self.assignment = assignment or assign_graph(gm)
        self.side_threads = side_threads
        nodes = {n.name: n for n in gm.graph.nodes}
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in gm.graph.nodes if n.op == "output")
        self.waits = {nodes[v]: [nodes[u] for u in us] for v, us in self.assignment.waits_for().items()}
        self.recorded = self.assignment.recorded()
        self.readers = {n: sum(1 for u in n.users if u.op in OPERATOR_OPS) for n in gm.graph.nodes}
        self.output_values = frozenset(self.output.all_input_nodes)
        self.chains = [[self._step(nodes[name]) for name in chain] for chain in self.assignment.chains]
        self._work: list[tuple[threading.Event, list[Any]]] = []
        self._threads: list[threading.Thread] = []
        self._done = threading.Semaphore(0)
        self._turn = threading.Lock()  # one run at a time
        self._closed = False
        for k in range(1, len(self.chains)):
            start: tuple[threading.Event, list[Any]] = (threading.Event(), [None])
            self._work.append(start)
            thread = threading.Thread(target=self._serve, args=(k, start), name=f"nimble-chain-{k}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _step(self, node: fx.Node) -> _Step:
        if node.op == "call_module":
            call = self.gm.get_submodule(node.target)
        elif node.op == "call_function":
            call = node.target
        else:
            method = node.target

            def call(obj: Any, *args: Any, _m: str = method, **kwargs: Any) -> Any:
                return getattr(obj, _m)(*args, **kwargs)

        frees = [source for source in node.all_input_nodes if source.op in OPERATOR_OPS]
        return _Step(node, call, frees)

    def _load(self, run: _Run, node: fx.Node) -> Any:
        if node.op == "get_attr":
            obj: Any = self.gm
            for part in node.target.split("."):
                obj = getattr(obj, part)
            return obj
        return run.env[node]

    def _chain(self, k: int, run: _Run) -> None:
        for step in self.chains[k]:
            for source in self.waits.get(step.node, ()):
                run.events[source.name].wait()
            if run.error is not None:
                return
            args = fx.node.map_arg(step.node.args, lambda n: self._load(run, n))  # noqa: B023 - run is fixed
            kwargs = fx.node.map_arg(step.node.kwargs, lambda n: self._load(run, n))  # noqa: B023
            value = step.call(*args, **kwargs)
            with run.lock:
                run.env[step.node] = value
                for source in step.frees:
                    run.readers_left[source] -= 1
                    if run.readers_left[source] == 0 and source not in self.output_values:
                        del run.env[source]
            if step.node.name in run.events:
                run.events[step.node.name].set()

    def _serve(self, k: int, start: tuple[threading.Event, list[Any]]) -> None:
        use_intra_op_threads(self.side_threads)
        event, slot = start
        while True:
            event.wait()
            event.clear()
            run = slot[0]
            if run is None:  # close()
                return
            try:
                with torch.inference_mode(run.inference), torch.set_grad_enabled(run.grad):
                    self._chain(k, run)
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                run.fail(err)
            finally:
                self._done.release()

    def __call__(self, *inputs: torch.Tensor) -> Any:
        with self._turn:
            return self._run(*inputs)

    def _run(self, *inputs: torch.Tensor) -> Any:
        if self._closed:
            raise RuntimeError("the chain runner is closed")
        run = _Run(self.recorded, self.readers)
        for node, value in zip(self.placeholders, inputs, strict=True):
            run.env[node] = value
        for event, slot in self._work:
            slot[0] = run
            event.set()
        try:
            self._chain(0, run)
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the chains stopped
            run.fail(err)
        for _ in self._work:
            self._done.acquire()
        if run.error is not None:
            raise run.error
        return fx.node.map_arg(self.output.args[0], lambda n: self._load(run, n))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for event, slot in self._work:
            slot[0] = None
            event.set()
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> ChainRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
