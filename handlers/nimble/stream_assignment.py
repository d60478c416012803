"""Nimble's automatic multi-stream assignment, on any DAG of operators.

Two operators that no path connects may run at the same time; the question
is how to place operators on streams (CUDA streams, or threads on CPU) so
that every such pair *can* overlap while the number of synchronisations
between streams stays small.  The Nimble paper (Kwon et al., NeurIPS 2020,
Algorithm 1) answers it, and proves the answer optimal:

1. Take the *minimum equivalent graph* G' of the operator DAG G: its
   transitive reduction.  An edge implied by a longer path orders nothing
   new, so it never needs an event of its own.
2. Build the bipartite graph with a left copy and a right copy of every
   node and an edge (u_left, v_right) for every edge u → v of G'.
3. A *maximum matching* M of it pairs each node with at most one successor
   and one predecessor; following matched edges cuts G' into |V| − |M|
   vertex-disjoint chains, the fewest possible (König / Dilworth for path
   covers).  Each chain is a stream.
4. Every edge of G' that M did not match joins two streams and becomes one
   synchronisation (an event recorded after u, waited for before v):
   |E'| − |M| of them.  Stream order plus those events order exactly the
   pairs G orders, no more (maximum logical concurrency), no fewer
   (correctness).

This module is pure graph work (networkx) and knows nothing of streams or
threads; ``handlers/nimble/multistream.py`` runs a model on the result.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import networkx as nx
from networkx.algorithms import bipartite

Node = Hashable


@dataclass(frozen=True)
class StreamAssignment:
    """Where each operator runs and which cross-stream edges need an event.

    ``chains[k]`` lists stream k's operators in execution order (a path of
    the reduced graph); ``stream_of`` inverts it; ``syncs`` are the edges
    (u, v) of the reduced graph whose ends lie on different streams: v's
    stream waits for an event recorded after u.
    """

    chains: tuple[tuple[Node, ...], ...]
    stream_of: dict[Node, int]
    syncs: tuple[tuple[Node, Node], ...]
    reduced_edges: int  # |E'|
    matching_size: int  # |M|

    @property
    def streams(self) -> int:
        return len(self.chains)

    def happens_before(self) -> nx.DiGraph:
        """The order the schedule enforces: each stream's order plus its events."""
        order = nx.DiGraph()
        order.add_nodes_from(self.stream_of)
        for chain in self.chains:
            order.add_edges_from(zip(chain, chain[1:], strict=False))
        order.add_edges_from(self.syncs)
        return order

    def waits_for(self) -> dict[Node, tuple[Node, ...]]:
        """Node → the nodes on other streams whose events it waits for."""
        waits: dict[Node, list[Node]] = {}
        for u, v in self.syncs:
            waits.setdefault(v, []).append(u)
        return {v: tuple(us) for v, us in waits.items()}

    def recorded(self) -> frozenset[Node]:
        """Nodes after which an event is recorded (some other stream waits for it)."""
        return frozenset(u for u, _ in self.syncs)


def assign_streams(graph: nx.DiGraph, order: Iterable[Node] | None = None) -> StreamAssignment:
    """Nimble's stream assignment of a DAG (see the module docstring).

    ``order``: a topological order to list chains by (stream 0 holds the
    earliest operator, and so on); by default networkx's own.  Raises
    ``ValueError`` when ``graph`` has a cycle.
    """
    if not nx.is_directed_acyclic_graph(graph):
        raise ValueError("stream assignment needs a DAG; the operator graph has a cycle")
    topo = list(order) if order is not None else list(nx.topological_sort(graph))
    if set(topo) != set(graph.nodes) or len(topo) != graph.number_of_nodes():
        raise ValueError("order must list every node of the graph once")
    position = {node: i for i, node in enumerate(topo)}
    reduced = nx.transitive_reduction(graph)

    # Bipartite copies: ("out", u) on the left, ("in", v) on the right.
    halves = nx.Graph()
    left = [("out", u) for u in topo]
    halves.add_nodes_from(left, bipartite=0)
    halves.add_nodes_from((("in", v) for v in topo), bipartite=1)
    halves.add_edges_from((("out", u), ("in", v)) for u, v in reduced.edges)
    matching = bipartite.hopcroft_karp_matching(halves, top_nodes=left)
    successor = {u: v for (side, u), (_, v) in matching.items() if side == "out"}
    matched_size = len(successor)

    has_predecessor = set(successor.values())
    chains: list[tuple[Node, ...]] = []
    for head in topo:  # heads in topological order, so stream numbers follow the program
        if head in has_predecessor:
            continue
        chain = [head]
        while chain[-1] in successor:
            chain.append(successor[chain[-1]])
        chains.append(tuple(chain))
    stream_of = {node: k for k, chain in enumerate(chains) for node in chain}
    syncs = tuple(
        sorted(
            ((u, v) for u, v in reduced.edges if successor.get(u) != v),
            key=lambda e: (position[e[1]], position[e[0]]),
        )
    )
    return StreamAssignment(tuple(chains), stream_of, syncs, reduced.number_of_edges(), matched_size)


def orders_equal(graph: nx.DiGraph, assignment: StreamAssignment) -> bool:
    """Whether the schedule orders exactly the pairs ``graph`` orders.

    Fewer would be a race (an operator reading a value not yet written); more
    would be concurrency thrown away.  Both closures are compared, so this is
    for tests and checks on models, not for the serving path.
    """
    wanted = nx.transitive_closure_dag(graph)
    enforced = nx.transitive_closure_dag(assignment.happens_before())
    return set(wanted.edges) == set(enforced.edges)
