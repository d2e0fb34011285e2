//! Random graph operations checked against a simple in-memory model after every transaction
//! and across reopens: node and edge records, adjacency in both directions with and without a
//! type filter, labels, types, and the invariant that no edge names a missing node.
//! The seed is printed on failure; set `KEELDB_GRAPH_SEED` to replay one.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod common;
use std::collections::BTreeMap;

use common::*;
use keeldb::graph::{Direction, Graph, GraphError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Clone, Default, Debug)]
struct Model {
    nodes: BTreeMap<u64, (String, Vec<u8>)>,
    edges: BTreeMap<u64, (u64, u64, String, Vec<u8>)>,
}

const LABELS: [&str; 3] = ["task", "decision", ""];
const TYPES: [&str; 3] = ["depends_on", "blocks", "x"];

fn pick<'a, T>(rng: &mut StdRng, v: &'a [T]) -> Option<&'a T> {
    (!v.is_empty()).then(|| &v[rng.gen_range(0..v.len())])
}

/// One random operation against both the store (inside `tx`) and the model.
fn step(rng: &mut StdRng, g: &Graph, tx: &mut keeldb::WriteTxn, m: &mut Model) {
    let nodes: Vec<u64> = m.nodes.keys().copied().collect();
    let edges: Vec<u64> = m.edges.keys().copied().collect();
    let props = vec![rng.gen::<u8>(); rng.gen_range(0..4)];
    match rng.gen_range(0..100) {
        0..=29 => {
            let label = LABELS[rng.gen_range(0..3)];
            let id = g.add_node(tx, label, &props).unwrap();
            m.nodes.insert(id, (label.to_owned(), props));
        }
        30..=59 => {
            let (Some(&s), Some(&d)) = (pick(rng, &nodes), pick(rng, &nodes)) else { return };
            let t = TYPES[rng.gen_range(0..3)];
            let id = g.add_edge(tx, s, d, t, &props).unwrap();
            m.edges.insert(id, (s, d, t.to_owned(), props));
        }
        60..=69 => {
            let Some(&n) = pick(rng, &nodes) else { return };
            let removed = g.delete_node(tx, n).unwrap();
            let before = m.edges.len();
            m.edges.retain(|_, (s, d, _, _)| *s != n && *d != n);
            assert_eq!(removed, before - m.edges.len());
            m.nodes.remove(&n);
        }
        70..=79 => {
            let Some(&e) = pick(rng, &edges) else { return };
            g.delete_edge(tx, e).unwrap();
            m.edges.remove(&e);
        }
        80..=89 => {
            let Some(&n) = pick(rng, &nodes) else { return };
            let label = LABELS[rng.gen_range(0..3)];
            g.set_node_label(tx, n, label).unwrap();
            g.set_node_props(tx, n, &props).unwrap();
            m.nodes.insert(n, (label.to_owned(), props));
        }
        _ => {
            let missing = 1 << 60;
            assert!(matches!(g.add_edge(tx, missing, missing, "x", b""), Err(GraphError::NodeNotFound(_))));
            let Some(&e) = pick(rng, &edges) else { return };
            g.set_edge_props(tx, e, &props).unwrap();
            m.edges.get_mut(&e).unwrap().3 = props;
        }
    }
}

fn expected_adjacent(m: &Model, n: u64, dir: Direction, t: Option<&str>) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = m
        .edges
        .iter()
        .filter(|(_, (_, _, et, _))| t.is_none_or(|t| t == et))
        .flat_map(|(&id, &(s, d, _, _))| {
            let out = (s == n && dir != Direction::In).then_some((id, d));
            let inn = (d == n && dir != Direction::Out).then_some((id, s));
            out.into_iter().chain(inn)
        })
        .collect();
    v.sort_unstable();
    v
}

fn check(g: &Graph, rx: &mut impl keeldb::graph::GraphRead, m: &Model) {
    let nodes = g.nodes(rx, None, None, usize::MAX).unwrap();
    let got: BTreeMap<u64, (String, Vec<u8>)> = nodes.into_iter().map(|n| (n.id, (n.label, n.props))).collect();
    assert_eq!(got, m.nodes);
    let edges = g.edges(rx, None, None, usize::MAX).unwrap();
    let got: BTreeMap<_, _> = edges.into_iter().map(|e| (e.id, (e.src, e.dst, e.edge_type, e.props))).collect();
    assert_eq!(got, m.edges);
    for label in LABELS {
        let want: Vec<u64> = m.nodes.iter().filter(|(_, (l, _))| l == label).map(|(&id, _)| id).collect();
        assert_eq!(g.node_ids(rx, Some(label), None, usize::MAX).unwrap(), want);
    }
    for t in TYPES {
        let want: Vec<u64> = m.edges.iter().filter(|(_, e)| e.2 == t).map(|(&id, _)| id).collect();
        assert_eq!(g.edge_ids(rx, Some(t), None, usize::MAX).unwrap(), want);
    }
    for &n in m.nodes.keys() {
        for dir in [Direction::Out, Direction::In, Direction::Both] {
            for t in [None, Some("depends_on"), Some("x")] {
                let mut got: Vec<(u64, u64)> =
                    g.adjacent(rx, n, dir, t).unwrap().into_iter().map(|a| (a.edge, a.node)).collect();
                got.sort_unstable();
                assert_eq!(got, expected_adjacent(m, n, dir, t), "node {n} {dir:?} {t:?}");
            }
        }
    }
}

#[test]
fn random_graph_operations_match_the_model_across_reopens() {
    let seed: u64 = std::env::var("KEELDB_GRAPH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    println!("KEELDB_GRAPH_SEED={seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let t = TestDir::new();
    let g = Graph::default();
    let mut committed = Model::default();
    for _round in 0..4 {
        let db = open(&t.path());
        check(&g, &mut db.begin_read().unwrap(), &committed);
        for _txn in 0..25 {
            let mut tx = db.begin_write().unwrap();
            let mut m = committed.clone();
            for _ in 0..rng.gen_range(1..12) {
                step(&mut rng, &g, &mut tx, &mut m);
            }
            check(&g, &mut tx, &m); // read-your-own-writes
            if rng.gen_bool(0.15) {
                tx.rollback();
            } else {
                tx.commit().unwrap();
                committed = m;
            }
            check(&g, &mut db.begin_read().unwrap(), &committed);
        }
        db.close().unwrap();
    }
}
