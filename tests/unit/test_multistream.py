"""Running an fx graph on its assigned streams: the CUDA rewrite (checked on CPU) and the CPU chain runner."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from torch import fx, nn

from handlers.nimble.multistream import OPERATOR_OPS, ChainRunner, assign_graph, operator_graph, rewrite_for_streams
from handlers.nimble.stream_assignment import orders_equal


class Branchy(nn.Module):
    """An inception-like block: four branches of different depth, joined, with a residual around them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.b1 = nn.Conv2d(8, 4, 1)
        self.b2 = nn.Sequential(nn.Conv2d(8, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        self.b3 = nn.Sequential(nn.Conv2d(8, 4, 1), nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1))
        self.b4 = nn.Conv2d(8, 4, 1)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        pooled = nn.functional.avg_pool2d(x, 3, stride=1, padding=1)
        y = torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(pooled)], dim=1)
        y = y + x.repeat(1, 2, 1, 1)  # the residual: x is read by a node far downstream
        return self.head(y.mean(dim=(2, 3)))


@pytest.fixture
def branchy() -> tuple[fx.GraphModule, torch.Tensor, torch.Tensor]:
    model = Branchy().eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        expected = model(x)
    return fx.symbolic_trace(model), x, expected


def test_the_operator_graph_of_a_branchy_model_gets_one_stream_per_branch(branchy):
    gm, _, _ = branchy
    a = assign_graph(gm)
    # Five things may run at once after the stem: four branches and the residual's repeat.
    assert a.streams == 5 and orders_equal(operator_graph(gm), a)
    branch_heads = ["b1", "b2_0", "b3_0", "avg_pool2d", "repeat"]
    assert len({a.stream_of[n] for n in branch_heads}) == 5


def test_the_rewritten_graph_switches_waits_and_records_as_assigned(branchy):
    gm, x, expected = branchy
    a = assign_graph(gm)
    rewrite_for_streams(gm, a, device="cpu", trace=True)
    with torch.no_grad():
        assert torch.equal(gm(x), expected)  # on CPU the stream calls are no-ops: same operators, same order
    calls = gm.nimble_streams.trace
    assert calls[0] == ("fork", None) and calls[-1][0] == "join"
    # Walk the program: every operator on its stream, every sync's event recorded before it is waited for.
    current, recorded, pending, waited = 0, set(), set(), set()
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.args and getattr(node.args[0], "target", None) == "nimble_streams":
            what = node.target
            if what == "use":
                current = node.args[1]
            elif what == "record":
                assert node.args[1] == current
                recorded.add(node.args[2])
            elif what == "wait":
                assert node.args[2] in recorded, f"wait for {node.args[2]} before it was recorded"
                assert node.args[1] == current
                pending.add(node.args[2])
            continue
        if node.op in OPERATOR_OPS:
            assert a.stream_of[node.name] == current, node.name
            waited |= {(u, node.name) for u in pending}
            pending = set()
    assert waited == set(a.syncs)  # each event waited for right before the operator that needs it
    join = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "join")
    kept = {n.name for n in join.args[1:]}
    assert "relu" in kept  # the stem's output, read by all four branches and the residual, outlives them


def test_every_cross_stream_edge_is_ordered_by_stream_order_or_an_event(branchy):
    gm, _, _ = branchy
    a = assign_graph(gm)
    order = nx.transitive_closure_dag(a.happens_before())
    for u, v in operator_graph(gm).edges:
        if a.stream_of[u] != a.stream_of[v]:
            assert order.has_edge(u, v), (u, v)


def test_chains_on_threads_give_the_graphs_answer(branchy):
    gm, x, expected = branchy
    with ChainRunner(gm) as runner, torch.inference_mode():
        for _ in range(3):  # threads are reused across calls
            torch.testing.assert_close(runner(x), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(runner(x[:1]), expected[:1], rtol=1e-5, atol=1e-6)


class FailsInABranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left = self.b(self.a(x))
        right = self.c(x)  # a shape error here when x has the wrong width
        return left + right


def test_an_error_on_a_side_chain_reaches_the_caller_and_the_runner_keeps_working():
    model = FailsInABranch().eval()
    gm = fx.symbolic_trace(model)
    assert assign_graph(gm).streams == 2
    with ChainRunner(gm) as runner, torch.no_grad():
        with pytest.raises(RuntimeError):
            runner(torch.randn(2, 3))
        x = torch.randn(2, 4)
        torch.testing.assert_close(runner(x), model(x))


def test_a_closed_runner_refuses_work(branchy):
    gm, x, _ = branchy
    runner = ChainRunner(gm)
    runner.close()
    with pytest.raises(RuntimeError, match="closed"):
        runner(x)
