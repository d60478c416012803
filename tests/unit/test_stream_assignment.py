"""Nimble's stream assignment: the theorem's counts, exact ordering, fewest streams."""

from __future__ import annotations

import itertools

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.nimble.stream_assignment import assign_streams, orders_equal


def dag(edges: list[tuple[str, str]], nodes: str = "") -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(nodes)
    g.add_edges_from(edges)
    return g


def check_theorem(g: nx.DiGraph) -> None:
    a = assign_streams(g)
    reduced = nx.transitive_reduction(g)
    assert a.reduced_edges == reduced.number_of_edges()
    assert a.streams == g.number_of_nodes() - a.matching_size
    assert len(a.syncs) == a.reduced_edges - a.matching_size
    assert sorted(n for chain in a.chains for n in chain) == sorted(g.nodes)  # every node on exactly one stream
    for chain in a.chains:  # a stream is a path of the reduced graph
        assert all(reduced.has_edge(u, v) for u, v in zip(chain, chain[1:], strict=False))
    for u, v in a.syncs:  # an event only where the ends are on different streams
        assert a.stream_of[u] != a.stream_of[v]
    assert orders_equal(g, a)  # every dependency enforced, and no order G does not have


def test_a_chain_is_one_stream_with_no_synchronisation():
    a = assign_streams(dag([("a", "b"), ("b", "c"), ("c", "d")]))
    assert a.chains == (("a", "b", "c", "d"),) and a.syncs == ()


def test_a_diamond_needs_two_streams_and_two_events():
    g = dag([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    a = assign_streams(g, order="abcd")
    assert a.streams == 2 and len(a.syncs) == 2
    assert a.chains[0][0] == "a"  # streams are numbered in program order
    check_theorem(g)


def test_an_edge_implied_by_a_path_gets_no_event():
    # a → c is implied by a → b → c (a residual connection around a block).
    a = assign_streams(dag([("a", "b"), ("b", "c"), ("a", "c")]))
    assert a.reduced_edges == 2 and a.streams == 1 and a.syncs == ()


def test_an_inception_block_runs_its_branches_on_their_own_streams():
    # One input, four branches of different lengths, one concatenation.
    edges = [("in", "b1")]
    edges += [("in", "b2a"), ("b2a", "b2b")]
    edges += [("in", "b3a"), ("b3a", "b3b"), ("b3b", "b3c")]
    edges += [("in", "pool"), ("pool", "b4")]
    edges += [(tail, "cat") for tail in ("b1", "b2b", "b3c", "b4")]
    g = dag(edges)
    a = assign_streams(g)
    assert a.streams == 4  # the width of the block
    # Matched: in→(one branch), each branch's inner edges, (one branch)→cat; 3 forks and 3 joins synchronised.
    assert len(a.syncs) == 6
    heads = {chain[0] for chain in a.chains}
    assert "in" in heads and len({a.stream_of[n] for n in ("b1", "b2a", "b3a", "pool")}) == 4
    check_theorem(g)


def test_independent_operators_each_get_a_stream():
    a = assign_streams(dag([], nodes="xyz"))
    assert a.streams == 3 and a.syncs == ()


def test_a_cycle_is_refused():
    with pytest.raises(ValueError, match="cycle"):
        assign_streams(dag([("a", "b"), ("b", "a")]))


def test_an_order_that_misses_nodes_is_refused():
    with pytest.raises(ValueError, match="every node"):
        assign_streams(dag([("a", "b")]), order=["a"])


@st.composite
def random_dags(draw: st.DrawFn, max_nodes: int = 14) -> nx.DiGraph:
    """Edges only from lower to higher numbers: every such graph is a DAG, and every DAG is one of these."""
    n = draw(st.integers(1, max_nodes))
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=len(pairs))) if pairs else []
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from(chosen)
    return g


@settings(max_examples=200, deadline=None)
@given(random_dags())
def test_random_dags_meet_the_theorem(g):
    check_theorem(g)


def fewest_paths(reduced: nx.DiGraph) -> int:
    """The smallest number of vertex-disjoint paths of ``reduced`` covering it, by brute force."""
    nodes = list(reduced.nodes)
    edges = list(reduced.edges)
    best = len(nodes)
    # Choose a set of edges in which every node has ≤ 1 chosen successor and predecessor.
    for k in range(len(edges), 0, -1):
        if len(nodes) - k >= best:
            break
        for subset in itertools.combinations(edges, k):
            outs = [u for u, _ in subset]
            ins = [v for _, v in subset]
            if len(set(outs)) == k and len(set(ins)) == k:
                best = len(nodes) - k
                break
    return best


@settings(max_examples=60, deadline=None)
@given(random_dags(max_nodes=7))
def test_no_assignment_uses_fewer_streams(g):
    a = assign_streams(g)
    assert a.streams == fewest_paths(nx.transitive_reduction(g))
