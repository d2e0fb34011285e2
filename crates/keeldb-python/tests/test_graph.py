"""The graph API: nodes, edges, properties, adjacency, cascading deletes, iteration, errors."""

from __future__ import annotations

import pytest

import keeldb


@pytest.fixture
def chain(db):
    """design <- build <- ship (each depends on the one before), and a decision on build."""
    with db.write() as tx:
        design = tx.add_node("task", {"title": "design", "status": "done"})
        build = tx.add_node("task", {"title": "build", "status": "todo"})
        ship = tx.add_node("task", {"title": "ship", "status": "todo"})
        decision = tx.add_node("decision", {"text": "use keeldb"})
        tx.add_edge(build, design, "depends_on")
        tx.add_edge(ship, build, "depends_on", {"hard": True})
        tx.add_edge(build, decision, "decided_by")
    return design, build, ship, decision


def test_nodes_and_edges_round_trip(db, chain):
    design, build, ship, decision = chain
    with db.read() as rx:
        node = rx.get_node(build)
        assert (node.id, node.label, node.props) == (build, "task", {"title": "build", "status": "todo"})
        assert node["title"] == "build"
        assert rx.get_node(10**12) is None
        assert rx.has_node(design) and not rx.has_node(10**12)
        [edge] = rx.edges_of(ship)
        assert (edge.src, edge.dst, edge.type, edge.props) == (ship, build, "depends_on", {"hard": True})
        assert rx.get_edge(edge.id) == edge
        assert rx.get_edge(10**12) is None
        assert "depends_on" in repr(edge) and "build" in repr(node)


def test_neighbors_directions_types_and_degree(db, chain):
    design, build, ship, decision = chain
    with db.read() as rx:
        assert sorted(rx.neighbors(build)) == sorted([design, decision])
        assert rx.neighbors(build, type="depends_on") == [design]
        assert rx.neighbors(build, direction="in") == [ship]
        assert sorted(rx.neighbors(build, direction="both")) == sorted([design, decision, ship])
        assert rx.neighbors(design, direction="out") == []
        assert rx.degree(build) == 3
        assert rx.degree(build, direction="out") == 2
        assert rx.degree(build, direction="in", type="decided_by") == 0
        assert [e.dst for e in rx.edges_of(build, type="decided_by")] == [decision]
        assert [e.src for e in rx.edges_of(design, direction="in")] == [build]
        with pytest.raises(ValueError):
            rx.neighbors(build, direction="sideways")
        with pytest.raises(keeldb.NotFoundError):
            rx.neighbors(10**12)


def test_nodes_and_edges_iterate_by_label_and_type(db, chain):
    design, build, ship, decision = chain
    with db.read() as rx:
        assert [n.id for n in rx.nodes(label="task")] == [design, build, ship]
        assert [n.id for n in rx.nodes(label="decision")] == [decision]
        assert [n.id for n in rx.nodes()] == [design, build, ship, decision]
        assert list(rx.nodes(label="nothing")) == []
        assert [(e.src, e.dst) for e in rx.edges(type="depends_on")] == [(build, design), (ship, build)]
        assert len(list(rx.edges())) == 3


def test_iteration_pages_through_many_nodes(db):
    with db.write() as tx:
        ids = [tx.add_node("bulk", {"i": i}) for i in range(1000)]
        hub = tx.add_node("hub")
        for n in ids[:700]:
            tx.add_edge(hub, n, "has")
    with db.read() as rx:
        got = list(rx.nodes(label="bulk"))
        assert [n.id for n in got] == ids
        assert [n["i"] for n in got] == list(range(1000))
        assert rx.degree(hub, direction="out") == 700
        assert rx.neighbors(hub) == ids[:700]
        assert len(list(rx.edges(type="has"))) == 700


def test_update_node_replace_merge_and_relabel(db, chain):
    design, build, ship, decision = chain
    with db.write() as tx:
        tx.update_node(build, {"status": "doing"}, merge=True)
        tx.update_node(ship, {"title": "ship it"})
        tx.update_node(decision, label="adr")
    with db.read() as rx:
        assert rx.get_node(build).props == {"title": "build", "status": "doing"}
        assert rx.get_node(ship).props == {"title": "ship it"}
        assert rx.get_node(decision).label == "adr"
        assert [n.id for n in rx.nodes(label="adr")] == [decision]
        assert list(rx.nodes(label="decision")) == []
    with db.write() as tx:
        with pytest.raises(keeldb.NotFoundError):
            tx.update_node(10**12, {"a": 1})
        with pytest.raises(keeldb.NotFoundError):
            tx.update_node(10**12, label="x")


def test_update_and_delete_edges(db, chain):
    design, build, ship, decision = chain
    with db.read() as rx:
        [edge] = rx.edges_of(ship)
    with db.write() as tx:
        tx.update_edge(edge.id, {"reason": "needs binary"}, merge=True)
    with db.read() as rx:
        assert rx.get_edge(edge.id).props == {"hard": True, "reason": "needs binary"}
    with db.write() as tx:
        tx.delete_edge(edge.id)
        with pytest.raises(keeldb.NotFoundError):
            tx.delete_edge(edge.id)
    with db.read() as rx:
        assert rx.neighbors(ship) == []
        assert rx.neighbors(build, direction="in") == []


def test_delete_node_removes_its_edges_atomically(db, chain):
    design, build, ship, decision = chain
    with db.write() as tx:
        assert tx.delete_node(build) == 3
        assert tx.neighbors(ship) == []  # read-your-own-writes
        with pytest.raises(keeldb.NotFoundError):
            tx.delete_node(build)
    with db.read() as rx:
        assert rx.get_node(build) is None
        assert rx.neighbors(ship) == []
        assert rx.neighbors(design, direction="in") == []
        assert rx.neighbors(decision, direction="in") == []
        assert list(rx.edges()) == []


def test_add_edge_to_a_missing_node_is_not_found_and_rolls_back(db, chain):
    design = chain[0]
    with pytest.raises(keeldb.NotFoundError):
        with db.write() as tx:
            tx.add_node("orphan")
            tx.add_edge(design, 10**12, "depends_on")
    with db.read() as rx:
        assert list(rx.nodes(label="orphan")) == []


def test_graph_and_kv_writes_share_one_transaction(db):
    with pytest.raises(RuntimeError):
        with db.write() as tx:
            n = tx.add_node("task", {"title": "t"})
            tx.put("index", b"by-title/t", str(n).encode())
            raise RuntimeError("abort both")
    with db.read() as rx:
        assert rx.get("index", b"by-title/t") is None
        assert list(rx.nodes()) == []


PROPS = {
    "none": None,
    "t": True,
    "f": False,
    "int": -(2**63),
    "big": 2**64 - 1,
    "float": 0.1,
    "neg": -1.5e300,
    "str": "naïve \"quoted\" \n line ✓",
    "list": [1, "two", [3.0], {"four": 4}],
    "tuple": (1, 2),
    "nested": {"a": {"b": {"c": []}}},
    "": "empty key",
}


def test_properties_round_trip_json_types(db):
    with db.write() as tx:
        n = tx.add_node("p", PROPS)
    with db.read() as rx:
        got = rx.get_node(n).props
    expected = dict(PROPS, tuple=[1, 2])
    assert got == expected
    assert list(got) == list(PROPS)  # key order is kept
    assert isinstance(got["float"], float) and isinstance(got["int"], int) and got["t"] is True


@pytest.mark.parametrize(
    "props, error",
    [
        ("not a dict", TypeError),
        ({1: "int key"}, TypeError),
        ({"set": {1, 2}}, TypeError),
        ({"bytes": b"x"}, TypeError),
        ({"obj": object()}, TypeError),
        ({"nan": float("nan")}, ValueError),
        ({"inf": float("inf")}, ValueError),
        ({"huge": 2**64}, ValueError),
        ({"tiny": -(2**63) - 1}, ValueError),
    ],
)
def test_properties_that_are_not_json_are_rejected(db, props, error):
    with db.write() as tx:
        with pytest.raises(error):
            tx.add_node("p", props)
        assert list(tx.nodes()) == []


def test_self_referencing_properties_are_rejected(db):
    loop: list = []
    loop.append(loop)
    with db.write() as tx:
        with pytest.raises(ValueError):
            tx.add_node("p", {"loop": loop})


def test_labels_and_types_are_limited(db):
    with db.write() as tx:
        with pytest.raises(keeldb.LimitError):
            tx.add_node("x" * 256)
        a = tx.add_node("")  # an empty label is allowed
        with pytest.raises(keeldb.LimitError):
            tx.add_edge(a, a, "t" * 256)


def test_graph_survives_reopen(path):
    with keeldb.open(path) as db:
        with db.write() as tx:
            a = tx.add_node("task", {"k": 1})
            b = tx.add_node("task")
            tx.add_edge(a, b, "depends_on")
    with keeldb.open(path) as db:
        with db.read() as rx:
            assert rx.neighbors(a) == [b]
            assert rx.get_node(a).props == {"k": 1}
        with db.write() as tx:
            c = tx.add_node("task")
        assert c not in (a, b)
