//! The graph layer through its public API: adjacency in both directions, type filters, labels,
//! deletes that cascade, typed errors, isolation from the key-value namespace, reopen.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod common;
use common::*;
use keeldb::graph::{Direction, Graph, GraphError, NodeId};
use keeldb::{Database, Error};

/// Runs `f` in one committed write transaction on the default graph.
fn write<T>(db: &Database, f: impl FnOnce(&Graph, &mut keeldb::WriteTxn) -> Result<T, GraphError>) -> T {
    let mut tx = db.begin_write().unwrap();
    let out = f(&Graph::default(), &mut tx).unwrap();
    tx.commit().unwrap();
    out
}

fn neighbors(db: &Database, n: NodeId, d: Direction, t: Option<&str>) -> Vec<NodeId> {
    Graph::default().neighbors(&mut db.begin_read().unwrap(), n, d, t).unwrap()
}

#[test]
fn adjacency_in_both_directions_with_type_filter() {
    let t = TestDir::new();
    let db = open(&t.path());
    let (a, b, c) = write(&db, |g, tx| {
        let a = g.add_node(tx, "task", b"{\"t\":\"a\"}")?;
        let b = g.add_node(tx, "task", b"")?;
        let c = g.add_node(tx, "decision", b"")?;
        g.add_edge(tx, a, b, "depends_on", b"")?;
        g.add_edge(tx, a, c, "decided_by", b"{\"w\":1}")?;
        g.add_edge(tx, c, a, "depends_on", b"")?;
        Ok((a, b, c))
    });
    assert_eq!(neighbors(&db, a, Direction::Out, None), vec![c, b]); // "decided_by" < "depends_on"
    assert_eq!(neighbors(&db, a, Direction::Out, Some("depends_on")), vec![b]);
    assert_eq!(neighbors(&db, a, Direction::In, None), vec![c]);
    assert_eq!(neighbors(&db, a, Direction::Both, None), vec![c, b]);
    assert_eq!(neighbors(&db, b, Direction::Out, None), Vec::<NodeId>::new());
    assert_eq!(neighbors(&db, b, Direction::In, Some("depends_on")), vec![a]);
    assert_eq!(neighbors(&db, a, Direction::Out, Some("nope")), Vec::<NodeId>::new());
    let g = Graph::default();
    let mut rx = db.begin_read().unwrap();
    assert_eq!(g.degree(&mut rx, a, Direction::Both, None).unwrap(), 3);
    let adj = g.adjacent(&mut rx, c, Direction::Both, None).unwrap();
    assert_eq!(adj.len(), 2);
    assert_eq!((adj[0].node, adj[0].direction, adj[0].edge_type.as_str()), (a, Direction::Out, "depends_on"));
    assert_eq!((adj[1].node, adj[1].direction, adj[1].edge_type.as_str()), (a, Direction::In, "decided_by"));
    let e = g.edge(&mut rx, adj[1].edge).unwrap().unwrap();
    assert_eq!((e.src, e.dst, e.props.as_slice()), (a, c, &b"{\"w\":1}"[..]));
    let n = g.node(&mut rx, a).unwrap().unwrap();
    assert_eq!((n.label.as_str(), n.props.as_slice()), ("task", &b"{\"t\":\"a\"}"[..]));
}

#[test]
fn self_loops_and_parallel_edges() {
    let t = TestDir::new();
    let db = open(&t.path());
    let (a, b) = write(&db, |g, tx| {
        let a = g.add_node(tx, "n", b"")?;
        let b = g.add_node(tx, "n", b"")?;
        g.add_edge(tx, a, a, "loop", b"")?;
        g.add_edge(tx, a, b, "x", b"")?;
        g.add_edge(tx, a, b, "x", b"")?;
        Ok((a, b))
    });
    let g = Graph::default();
    let mut rx = db.begin_read().unwrap();
    assert_eq!(g.degree(&mut rx, a, Direction::Both, None).unwrap(), 4); // the loop counts twice
    assert_eq!(g.degree(&mut rx, b, Direction::In, Some("x")).unwrap(), 2);
    // Grouped by type, shorter type names first: "x" before "loop".
    assert_eq!(g.neighbors(&mut rx, a, Direction::Both, None).unwrap(), vec![b, a]);
    drop(rx);
    let removed = write(&db, |g, tx| g.delete_node(tx, a));
    assert_eq!(removed, 3);
    let mut rx = db.begin_read().unwrap();
    assert_eq!(g.degree(&mut rx, b, Direction::Both, None).unwrap(), 0);
    assert!(g.edge_ids(&mut rx, None, None, 100).unwrap().is_empty());
}

#[test]
fn delete_node_removes_its_edges_in_the_same_transaction() {
    let t = TestDir::new();
    let db = open(&t.path());
    let (a, b, c) = write(&db, |g, tx| {
        let [a, b, c] = [g.add_node(tx, "t", b"")?, g.add_node(tx, "t", b"")?, g.add_node(tx, "t", b"")?];
        g.add_edge(tx, a, b, "dep", b"")?;
        g.add_edge(tx, c, b, "dep", b"")?;
        g.add_edge(tx, b, c, "other", b"")?;
        Ok((a, b, c))
    });
    let g = Graph::default();
    let mut tx = db.begin_write().unwrap();
    assert_eq!(g.delete_node(&mut tx, b).unwrap(), 3);
    // Read-your-own-writes: the transaction already sees the cascade.
    assert_eq!(g.neighbors(&mut tx, a, Direction::Both, None).unwrap(), Vec::<NodeId>::new());
    assert!(matches!(g.neighbors(&mut tx, b, Direction::Both, None), Err(GraphError::NodeNotFound(n)) if n == b));
    // Another snapshot does not, until the commit.
    assert_eq!(neighbors(&db, a, Direction::Out, None), vec![b]);
    tx.commit().unwrap();
    let mut rx = db.begin_read().unwrap();
    assert!(g.node(&mut rx, b).unwrap().is_none());
    assert_eq!(g.edge_ids(&mut rx, Some("dep"), None, 10).unwrap(), Vec::<u64>::new());
    assert_eq!(g.edge_ids(&mut rx, None, None, 10).unwrap(), Vec::<u64>::new());
    assert_eq!(g.degree(&mut rx, c, Direction::Both, None).unwrap(), 0);
    assert_eq!(g.node_ids(&mut rx, Some("t"), None, 10).unwrap(), vec![a, c]);
}

#[test]
fn unknown_nodes_and_edges_are_typed_errors_and_write_nothing() {
    let t = TestDir::new();
    let db = open(&t.path());
    let a = write(&db, |g, tx| g.add_node(tx, "t", b""));
    let g = Graph::default();
    let mut tx = db.begin_write().unwrap();
    assert!(matches!(g.add_edge(&mut tx, a, 999_999, "x", b""), Err(GraphError::NodeNotFound(999_999))));
    assert!(matches!(g.add_edge(&mut tx, 999_998, a, "x", b""), Err(GraphError::NodeNotFound(999_998))));
    assert!(matches!(g.delete_node(&mut tx, 999_999), Err(GraphError::NodeNotFound(_))));
    assert!(matches!(g.set_node_props(&mut tx, 999_999, b""), Err(GraphError::NodeNotFound(_))));
    assert!(matches!(g.delete_edge(&mut tx, 12345), Err(GraphError::EdgeNotFound(12345))));
    assert!(matches!(g.set_edge_props(&mut tx, 12345, b""), Err(GraphError::EdgeNotFound(12345))));
    assert!(matches!(g.degree(&mut tx, 999_999, Direction::Out, None), Err(GraphError::NodeNotFound(_))));
    assert!(!tx.is_dirty(), "a failed graph operation must not leave writes behind");
    let long = "x".repeat(256);
    assert!(matches!(g.add_node(&mut tx, &long, b""), Err(GraphError::Storage(Error::LimitExceeded { .. }))));
    assert!(matches!(g.add_edge(&mut tx, a, a, &long, b""), Err(GraphError::Storage(Error::LimitExceeded { .. }))));
    // Inside transact, `?` turns graph errors into engine errors.
    let err = db.transact(|tx| g.add_edge(tx, a, 424_242, "x", b"").map_err(Error::from)).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(m) if m.contains("424242")));
}

#[test]
fn labels_props_and_paging() {
    let t = TestDir::new();
    let db = open(&t.path());
    let ids: Vec<NodeId> =
        write(&db, |g, tx| (0..10).map(|i| g.add_node(tx, if i % 2 == 0 { "even" } else { "odd" }, &[i])).collect());
    let g = Graph::default();
    write(&db, |g, tx| {
        g.set_node_label(tx, ids[0], "odd")?;
        g.set_node_props(tx, ids[1], b"new")
    });
    let mut rx = db.begin_read().unwrap();
    let odd = g.node_ids(&mut rx, Some("odd"), None, 100).unwrap();
    assert_eq!(odd, vec![ids[0], ids[1], ids[3], ids[5], ids[7], ids[9]]);
    assert_eq!(g.node_ids(&mut rx, Some("even"), None, 100).unwrap().len(), 4);
    let n = g.node(&mut rx, ids[0]).unwrap().unwrap();
    assert_eq!((n.label.as_str(), n.props.as_slice()), ("odd", &[0u8][..]));
    assert_eq!(g.node(&mut rx, ids[1]).unwrap().unwrap().props, b"new");
    // Paging: after the last id returned, in ascending order, in pages of 3.
    let mut all = Vec::new();
    let mut after = None;
    loop {
        let page = g.nodes(&mut rx, None, after, 3).unwrap();
        let Some(last) = page.last() else { break };
        after = Some(last.id);
        all.extend(page.into_iter().map(|n| n.id));
    }
    assert_eq!(all, ids);
    let page = g.nodes(&mut rx, Some("odd"), Some(ids[1]), 2).unwrap();
    assert_eq!(page.iter().map(|n| n.id).collect::<Vec<_>>(), vec![ids[3], ids[5]]);
    assert!(g.node_ids(&mut rx, None, Some(u64::MAX), 10).unwrap().is_empty());
}

#[test]
fn graph_tables_are_hidden_named_graphs_are_separate_and_rollback_discards() {
    let t = TestDir::new();
    let db = open(&t.path());
    put(&db, "users", b"k", b"v");
    let other = Graph::new("other").unwrap();
    let a = write(&db, |g, tx| g.add_node(tx, "t", b""));
    let mut tx = db.begin_write().unwrap();
    let b = other.add_node(&mut tx, "t", b"").unwrap();
    tx.commit().unwrap();
    let mut rx = db.begin_read().unwrap();
    assert_eq!(rx.tables(), vec!["users".to_owned()]);
    assert!(Graph::default().node(&mut rx, b).unwrap().is_none());
    assert!(other.node(&mut rx, a).unwrap().is_none());
    assert!(matches!(Graph::new("a/b"), Err(GraphError::Storage(Error::InvalidArgument(_)))));
    assert!(Graph::new("").is_err());
    drop(rx);
    let mut tx = db.begin_write().unwrap();
    let c = Graph::default().add_node(&mut tx, "t", b"").unwrap();
    tx.rollback();
    assert!(Graph::default().node(&mut db.begin_read().unwrap(), c).unwrap().is_none());
}

#[test]
fn graph_survives_reopen_and_verifies() {
    let t = TestDir::new();
    let db = open(&t.path());
    let (a, b) = write(&db, |g, tx| {
        let a = g.add_node(tx, "t", b"{}")?;
        let b = g.add_node(tx, "t", b"{}")?;
        g.add_edge(tx, a, b, "dep", b"")?;
        Ok((a, b))
    });
    db.close().unwrap();
    let db = open(&t.path());
    assert_eq!(neighbors(&db, b, Direction::In, None), vec![a]);
    // New ids never repeat old ones, across reopen.
    let c = write(&db, |g, tx| g.add_node(tx, "t", b""));
    assert!(c != a && c != b);
    db.checkpoint().unwrap();
    db.close().unwrap();
    let report = keeldb::verify(t.path()).unwrap();
    assert!(report.is_intact(), "{report}");
    let db = open(&t.path());
    assert_eq!(neighbors(&db, a, Direction::Out, Some("dep")), vec![b]);
}

#[test]
fn writes_around_the_graph_layer_are_refused_and_change_nothing() {
    let t = TestDir::new();
    let db = open(&t.path());
    let g = Graph::default();
    let id = db.transact(|tx| Ok(g.add_node(tx, "task", b"{}")?)).unwrap();
    let digest = db.digest();
    for table in g.table_names() {
        let mut tx = db.begin_write().unwrap();
        assert!(matches!(tx.put(table, &id.to_be_bytes(), b"\x09garbage"), Err(Error::ReservedTable(_))), "{table}");
        assert!(matches!(tx.delete(table, &id.to_be_bytes()), Err(Error::ReservedTable(_))), "{table}");
        assert!(matches!(tx.drop_table(table), Err(Error::ReservedTable(_))), "{table}");
        tx.commit().unwrap();
    }
    assert_eq!(db.digest(), digest);
    let mut rx = db.begin_read().unwrap();
    assert_eq!(g.node(&mut rx, id).unwrap().map(|n| n.label), Some("task".to_owned()));
}
