//! Concurrent graph transactions: a node delete and an edge add at that node never both commit
//! (no dangling edges under snapshot isolation), while transactions that add nodes never
//! conflict with each other (ids come from `next_id`, not an allocator key).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod common;
use common::*;
use keeldb::graph::{Direction, Graph, GraphError};
use keeldb::{Error, Isolation, TxnOptions};

fn is_conflict(r: &Result<keeldb::CommitInfo, Error>) -> bool {
    matches!(r, Err(Error::Conflict { .. }))
}

#[test]
fn delete_node_and_concurrent_add_edge_do_not_both_commit() {
    for delete_first in [true, false] {
        for isolation in [Isolation::Snapshot, Isolation::Serializable] {
            let t = TestDir::new();
            let db = open(&t.path());
            let g = Graph::default();
            let opts = TxnOptions { isolation: Some(isolation), ..TxnOptions::default() };
            let (n, m) = db.transact(|tx| Ok((g.add_node(tx, "t", b"")?, g.add_node(tx, "t", b"")?))).unwrap();
            let mut deleter = db.begin_write_with(opts.clone()).unwrap();
            let mut adder = db.begin_write_with(opts).unwrap();
            g.delete_node(&mut deleter, n).unwrap();
            g.add_edge(&mut adder, m, n, "dep", b"").unwrap();
            let (first, second) = if delete_first { (deleter, adder) } else { (adder, deleter) };
            first.commit().unwrap();
            let r = second.commit();
            assert!(is_conflict(&r), "delete_first={delete_first} {isolation:?}: {r:?}");
            // Whatever committed, no edge names a node that does not exist.
            let mut rx = db.begin_read().unwrap();
            for e in g.edges(&mut rx, None, None, 100).unwrap() {
                assert!(g.contains_node(&mut rx, e.src).unwrap() && g.contains_node(&mut rx, e.dst).unwrap());
            }
            assert_eq!(g.contains_node(&mut rx, n).unwrap(), !delete_first);
        }
    }
}

#[test]
fn concurrent_node_creation_never_conflicts() {
    let t = TestDir::new();
    let db = open(&t.path());
    let g = Graph::default();
    let threads = 4;
    let per_thread = 200;
    let ids: Vec<Vec<u64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (db, g) = (db.clone(), g.clone());
                s.spawn(move || {
                    let mut mine = Vec::new();
                    for i in 0..per_thread {
                        let mut tx = db
                            .begin_write_with(TxnOptions {
                                durability: Some(keeldb::Durability::Relaxed),
                                ..TxnOptions::default()
                            })
                            .unwrap();
                        mine.push(g.add_node(&mut tx, "task", format!("{i}").as_bytes()).unwrap());
                        tx.commit().expect("node creation must never conflict");
                    }
                    mine
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut all: Vec<u64> = ids.into_iter().flatten().collect();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), threads * per_thread);
    let mut rx = db.begin_read().unwrap();
    assert_eq!(g.node_ids(&mut rx, Some("task"), None, usize::MAX).unwrap(), all);
}

#[test]
fn concurrent_edges_at_one_node_conflict_under_snapshot_but_transact_retries() {
    let t = TestDir::new();
    let db = open(&t.path());
    let g = Graph::default();
    let hub = db.transact(|tx| Ok(g.add_node(tx, "hub", b"")?)).unwrap();
    let threads = 4;
    let per_thread = 50;
    std::thread::scope(|s| {
        for _ in 0..threads {
            let (db, g) = (db.clone(), g.clone());
            s.spawn(move || {
                for _ in 0..per_thread {
                    let relaxed = TxnOptions { durability: Some(keeldb::Durability::Relaxed), ..TxnOptions::default() };
                    db.transact_with(relaxed, |tx| {
                        let leaf = g.add_node(tx, "leaf", b"")?;
                        g.add_edge(tx, leaf, hub, "to", b"")?;
                        Ok(())
                    })
                    .unwrap();
                }
            });
        }
    });
    let mut rx = db.begin_read().unwrap();
    assert_eq!(g.degree(&mut rx, hub, Direction::In, Some("to")).unwrap(), threads * per_thread);
    assert_eq!(g.node_ids(&mut rx, Some("leaf"), None, usize::MAX).unwrap().len(), threads * per_thread);
    // Two explicit transactions adding an edge at the hub: the second to commit conflicts.
    let mut a = db.begin_write().unwrap();
    let mut b = db.begin_write().unwrap();
    g.add_edge(&mut a, hub, hub, "self", b"").unwrap();
    g.add_edge(&mut b, hub, hub, "self", b"").unwrap();
    a.commit().unwrap();
    assert!(is_conflict(&b.commit()));
    // A graph error keeps its retryability.
    assert!(GraphError::from(Error::Conflict {
        table: "x".into(),
        key: None,
        reason: keeldb::ConflictReason::KeyWritten
    })
    .is_retryable());
    assert!(!GraphError::NodeNotFound(1).is_retryable());
}

#[test]
fn one_read_snapshot_serves_several_threads() {
    let t = TestDir::new();
    let db = open(&t.path());
    let g = Graph::default();
    let hub = db
        .transact(|tx| {
            let hub = g.add_node(tx, "hub", b"")?;
            for _ in 0..100 {
                let n = g.add_node(tx, "leaf", b"")?;
                g.add_edge(tx, hub, n, "has", b"")?;
            }
            Ok(hub)
        })
        .unwrap();
    let rx = db.begin_read().unwrap();
    db.transact(|tx| Ok(g.delete_node(tx, hub)?)).unwrap(); // after the snapshot: invisible to it
    std::thread::scope(|s| {
        for _ in 0..4 {
            let (rx, g) = (&rx, &g);
            s.spawn(move || assert_eq!(g.degree(&mut &*rx, hub, Direction::Out, Some("has")).unwrap(), 100));
        }
    });
}
