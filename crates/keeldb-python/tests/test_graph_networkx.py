"""Random multigraphs (self-loops and parallel edges included) built in KeelDB and in
networkx side by side: successors, predecessors, neighbours in both directions, per-type
adjacency, degrees and reachability must agree, before and after random node and edge
deletions, and after reopening the store."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections import deque

import hypothesis.strategies as st
import networkx as nx
from hypothesis import HealthCheck, given, settings

import keeldb

TYPES = ["depends_on", "blocks"]


def reachable(rx, start):
    """Nodes reachable from `start` over out-edges, using KeelDB's adjacency only."""
    seen, queue = {start}, deque([start])
    while queue:
        for m in rx.neighbors(queue.popleft(), direction="out"):
            if m not in seen:
                seen.add(m)
                queue.append(m)
    seen.discard(start)
    return seen


def compare(rx, g: nx.MultiDiGraph):
    assert sorted(n.id for n in rx.nodes()) == sorted(g.nodes)
    assert len(list(rx.edges())) == g.number_of_edges()
    for n in g.nodes:
        assert sorted(rx.neighbors(n, direction="out")) == sorted(set(g.successors(n)))
        assert sorted(rx.neighbors(n, direction="in")) == sorted(set(g.predecessors(n)))
        both = set(g.successors(n)) | set(g.predecessors(n))
        assert sorted(rx.neighbors(n, direction="both")) == sorted(both)
        assert rx.degree(n, direction="out") == g.out_degree(n)
        assert rx.degree(n, direction="in") == g.in_degree(n)
        assert rx.degree(n) == g.degree(n)  # a self-loop counts twice in both
        for t in TYPES:
            typed_out = {v for _, v, d in g.out_edges(n, data="type") if d == t}
            assert set(rx.neighbors(n, direction="out", type=t)) == typed_out
            typed_in = sum(1 for _, _, d in g.in_edges(n, data="type") if d == t)
            assert rx.degree(n, direction="in", type=t) == typed_in
        assert reachable(rx, n) == nx.descendants(g, n)
    for e in rx.edges():
        assert g.has_edge(e.src, e.dst, key=e.id)
        assert g.edges[e.src, e.dst, e.id]["type"] == e.type


def build_and_check(seed, node_count, edge_count):
    rng = random.Random(seed)
    path = os.path.join(tempfile.mkdtemp(prefix="keeldb-nx-"), "store")
    try:
        g = nx.MultiDiGraph()
        db = keeldb.open(path, durability="relaxed")
        with db.write() as tx:
            nodes = [tx.add_node("n", {"i": i}) for i in range(node_count)]
            g.add_nodes_from(nodes)
            for _ in range(edge_count):
                s, d, t = rng.choice(nodes), rng.choice(nodes), rng.choice(TYPES)
                e = tx.add_edge(s, d, t)
                g.add_edge(s, d, key=e, type=t)
        with db.read() as rx:
            compare(rx, g)
        # Random deletions, in separate transactions, some rolled back.
        for _ in range(max(1, node_count // 4)):
            with db.write() as tx:
                if rng.random() < 0.5 and g.number_of_edges():
                    s, d, k = rng.choice(list(g.edges(keys=True)))
                    tx.delete_edge(k)
                    deleted = lambda: g.remove_edge(s, d, key=k)  # noqa: E731
                else:
                    n = rng.choice(list(g.nodes))
                    assert tx.delete_node(n) == len({k for *_, k in g.in_edges(n, keys=True)} | {k for *_, k in g.out_edges(n, keys=True)})
                    deleted = lambda: g.remove_node(n)  # noqa: E731
                if rng.random() < 0.2:
                    tx.rollback()
                else:
                    deleted()
            if not g.nodes:
                break
        with db.read() as rx:
            compare(rx, g)
        db.close()
        with keeldb.open(path, durability="relaxed") as db:
            with db.read() as rx:
                compare(rx, g)
    finally:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32), node_count=st.integers(1, 25), edge_count=st.integers(0, 80))
def test_random_multigraphs_match_networkx(seed, node_count, edge_count):
    build_and_check(seed, node_count, edge_count)


def test_a_larger_random_graph_matches_networkx():
    build_and_check(seed=2024, node_count=300, edge_count=1500)
