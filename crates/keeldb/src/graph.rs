//! A property graph stored in ordinary tables, read and written inside the same transactions as
//! the key-value API: nodes with a label and a properties blob, typed directed edges with a
//! properties blob, out- and in-adjacency, nodes by label and edges by type.
//!
//! This module owns the key layouts of the graph tables and the invariants that tie them
//! together (every edge has an edge record, one out entry, one in entry and one type entry; every
//! node has a node record and one label entry; no edge names a node that does not exist). It
//! must not reach below the public transaction API: everything here goes through
//! `WriteTxn::{get, put, delete, scan}` and `ReadTxn::{get, scan}`, so graph writes are logged,
//! checksummed, validated, checkpointed and digested exactly like any other write.
//!
//! # Tables and keys
//!
//! A graph named `G` lives in seven tables under the engine's reserved prefix, hidden from
//! `tables()` because their cross-table invariants hold only if nothing but this module writes
//! them. Ids are 8-byte big-endian so byte order is numeric order; a label or type is stored
//! behind a one-byte length, so a prefix ending at the type selects exactly that type.
//!
//! | table | key | value |
//! |---|---|---|
//! | `__keeldb/graph/G/node`  | node id | `1`, label length, label, properties |
//! | `__keeldb/graph/G/edge`  | edge id | `1`, src, dst, type length, type, properties |
//! | `__keeldb/graph/G/out`   | src, type length, type, edge id | dst |
//! | `__keeldb/graph/G/in`    | dst, type length, type, edge id | src |
//! | `__keeldb/graph/G/label` | label length, label, node id | empty |
//! | `__keeldb/graph/G/type`  | type length, type, edge id | src, dst |
//! | `__keeldb/graph/G/guard` | node id | never holds a value (see below) |
//!
//! Neighbours of a node are one prefix scan of `out` or `in` (cost O(degree), never O(graph)),
//! and the adjacency entry carries the other endpoint, so no edge record is read.
//!
//! # Concurrency
//!
//! Node and edge ids come from [`Database::next_id`](crate::Database::next_id), so concurrent
//! transactions never conflict on an allocator. Under snapshot isolation a transaction that
//! deletes node N and a concurrent one that adds an edge at N write disjoint keys, so both could
//! commit and leave an edge to a deleted node. To rule that out, `delete_node` and `add_edge`
//! both write (delete) the key N of the `guard` table: of two such transactions the second to
//! commit fails with [`Error::Conflict`]. The price is that two
//! concurrent transactions adding edges at the same node also conflict (one retries).

use std::collections::HashSet;

use crate::error::{Error, Location, Result};
use crate::txn::{ReadTxn, ScanRange, WriteTxn};

/// A node id. Never zero; unique within a store.
pub type NodeId = u64;
/// An edge id. Never zero; unique within a store (node and edge ids share one sequence).
pub type EdgeId = u64;

/// Longest label or edge type, in bytes of UTF-8.
pub const MAX_LABEL_BYTES: usize = 255;
/// Longest graph name, in bytes of UTF-8.
pub const MAX_GRAPH_NAME_BYTES: usize = 128;

const FORMAT_BYTE: u8 = 1;
const ID_BYTES: usize = 8;

/// Errors of graph operations: the engine's errors, plus references to nodes or edges that do
/// not exist and graph records that do not decode.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GraphError {
    /// A node named by the operation does not exist in the transaction's view.
    #[error("node {0} does not exist")]
    NodeNotFound(NodeId),
    /// An edge named by the operation does not exist in the transaction's view.
    #[error("edge {0} does not exist")]
    EdgeNotFound(EdgeId),
    /// A graph table holds bytes this module did not write (for example a direct key-value
    /// write into a graph table). Nothing was changed.
    #[error("malformed graph record in {table}: {reason}")]
    Malformed {
        /// The graph table.
        table: String,
        /// What was wrong.
        reason: String,
    },
    /// An engine error (conflict, limits, closed database, I/O, ...).
    #[error(transparent)]
    Storage(#[from] Error),
}

impl GraphError {
    /// True for errors that a retry of the same transaction may cure.
    pub fn is_retryable(&self) -> bool {
        matches!(self, GraphError::Storage(e) if e.is_retryable())
    }
}

/// Lets graph calls use `?` inside [`Database::transact`](crate::Database::transact) closures.
/// Missing nodes and edges become [`Error::InvalidArgument`]; malformed records become
/// [`Error::Corruption`] located at the graph table.
impl From<GraphError> for Error {
    fn from(e: GraphError) -> Error {
        match e {
            GraphError::Storage(e) => e,
            GraphError::Malformed { table, reason } => {
                Error::Corruption { location: Location { path: table.into(), offset: 0 }, reason }
            }
            other => Error::InvalidArgument(other.to_string()),
        }
    }
}

/// Result of graph operations.
pub type GraphResult<T> = std::result::Result<T, GraphError>;

/// Which edges of a node to follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Edges leaving the node (the node is the source).
    Out,
    /// Edges entering the node (the node is the destination).
    In,
    /// Both; a self-loop appears once in each direction.
    Both,
}

/// A node as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// Its id.
    pub id: NodeId,
    /// Its label (0–255 bytes).
    pub label: String,
    /// Its properties, opaque to the engine (the Python package stores compact JSON; empty
    /// means none).
    pub props: Vec<u8>,
}

/// An edge as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edge {
    /// Its id.
    pub id: EdgeId,
    /// Source node.
    pub src: NodeId,
    /// Destination node.
    pub dst: NodeId,
    /// Its type (0–255 bytes).
    pub edge_type: String,
    /// Its properties, opaque to the engine.
    pub props: Vec<u8>,
}

/// One adjacency entry of a node, read from the adjacency table alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adjacent {
    /// The edge.
    pub edge: EdgeId,
    /// The node at the other end (the node itself for a self-loop).
    pub node: NodeId,
    /// The edge's type.
    pub edge_type: String,
    /// `Out` when the edge leaves the node asked about, `In` when it enters it.
    pub direction: Direction,
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for crate::ReadTxn {}
    impl Sealed for &crate::ReadTxn {}
    impl Sealed for crate::WriteTxn {}
}

/// A transaction graph reads can go through: [`ReadTxn`] (a snapshot), `&ReadTxn` (a snapshot
/// shared between threads: pass `&mut &rx`) or [`WriteTxn`] (its snapshot overlaid with its
/// own writes). Sealed.
pub trait GraphRead: sealed::Sealed {
    #[doc(hidden)]
    fn graph_get(&mut self, table: &str, key: &[u8]) -> Result<Option<Vec<u8>>>;
    #[doc(hidden)]
    fn graph_scan(&mut self, table: &str, range: ScanRange, limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>>;
}

impl GraphRead for ReadTxn {
    fn graph_get(&mut self, table: &str, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.get(table, key)
    }
    fn graph_scan(&mut self, table: &str, range: ScanRange, limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        self.scan(table, range)?.take(limit).collect()
    }
}

impl GraphRead for &ReadTxn {
    fn graph_get(&mut self, table: &str, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.get(table, key)
    }
    fn graph_scan(&mut self, table: &str, range: ScanRange, limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        self.scan(table, range)?.take(limit).collect()
    }
}

impl GraphRead for WriteTxn {
    fn graph_get(&mut self, table: &str, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.get(table, key)
    }
    fn graph_scan(&mut self, table: &str, range: ScanRange, limit: usize) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        self.scan(table, range)?.take(limit).collect()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Tables {
    node: String,
    edge: String,
    out: String,
    inn: String,
    label: String,
    etype: String,
    guard: String,
}

/// A handle on one named graph of a store. Cheap to clone; holds no state but its table names.
/// Every operation takes the transaction it runs in.
///
/// ```no_run
/// use keeldb::{Database, Options};
/// use keeldb::graph::{Direction, Graph};
/// let db = Database::open("/tmp/graph-example", Options::default())?;
/// let g = Graph::default();
/// let (a, b) = db.transact(|tx| {
///     let a = g.add_node(tx, "task", br#"{"title":"design"}"#)?;
///     let b = g.add_node(tx, "task", br#"{"title":"build"}"#)?;
///     g.add_edge(tx, b, a, "depends_on", b"")?;
///     Ok((a, b))
/// })?;
/// let mut rx = db.begin_read()?;
/// assert_eq!(g.neighbors(&mut rx, b, Direction::Out, Some("depends_on"))?, vec![a]);
/// # Ok::<(), keeldb::graph::GraphError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Graph {
    name: String,
    t: Tables,
}

impl Default for Graph {
    /// The graph named `default` (the one the Python package uses).
    fn default() -> Self {
        Graph::build("default")
    }
}

impl Graph {
    /// A handle on the graph `name` (1–128 bytes of UTF-8, no `/`). Graphs need no creation:
    /// their tables appear with the first write.
    pub fn new(name: &str) -> GraphResult<Graph> {
        if name.is_empty() || name.contains('/') {
            return Err(
                Error::InvalidArgument(format!("graph name {name:?} must be non-empty and contain no '/'")).into()
            );
        }
        if name.len() > MAX_GRAPH_NAME_BYTES {
            return Err(
                Error::LimitExceeded { what: "graph name", actual: name.len(), limit: MAX_GRAPH_NAME_BYTES }.into()
            );
        }
        Ok(Graph::build(name))
    }

    fn build(name: &str) -> Graph {
        let t = |suffix: &str| format!("{}graph/{name}/{suffix}", crate::RESERVED_TABLE_PREFIX);
        let t = Tables {
            node: t("node"),
            edge: t("edge"),
            out: t("out"),
            inn: t("in"),
            label: t("label"),
            etype: t("type"),
            guard: t("guard"),
        };
        Graph { name: name.to_owned(), t }
    }

    /// The graph's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The names of the graph's tables (hidden from `tables()`, listed for tools).
    pub fn table_names(&self) -> [&str; 7] {
        let t = &self.t;
        [&t.node, &t.edge, &t.out, &t.inn, &t.label, &t.etype, &t.guard]
    }

    // ---- writes -------------------------------------------------------------------------

    /// Adds a node and returns its new id.
    pub fn add_node(&self, tx: &mut WriteTxn, label: &str, props: &[u8]) -> GraphResult<NodeId> {
        check_name("label", label)?;
        let id = tx.database().next_id()?;
        tx.put_internal(&self.t.node, &id.to_be_bytes(), &encode_node(label, props))?;
        tx.put_internal(&self.t.label, &named_key(label, id), &[])?;
        Ok(id)
    }

    /// Replaces a node's properties.
    pub fn set_node_props(&self, tx: &mut WriteTxn, id: NodeId, props: &[u8]) -> GraphResult<()> {
        let node = self.node(tx, id)?.ok_or(GraphError::NodeNotFound(id))?;
        tx.put_internal(&self.t.node, &id.to_be_bytes(), &encode_node(&node.label, props))?;
        Ok(())
    }

    /// Changes a node's label (and its entry in the label index).
    pub fn set_node_label(&self, tx: &mut WriteTxn, id: NodeId, label: &str) -> GraphResult<()> {
        check_name("label", label)?;
        let node = self.node(tx, id)?.ok_or(GraphError::NodeNotFound(id))?;
        if node.label == label {
            return Ok(());
        }
        tx.delete_internal(&self.t.label, &named_key(&node.label, id))?;
        tx.put_internal(&self.t.label, &named_key(label, id), &[])?;
        tx.put_internal(&self.t.node, &id.to_be_bytes(), &encode_node(label, &node.props))?;
        Ok(())
    }

    /// Deletes a node and every edge at it, in this transaction. Returns how many edges were
    /// removed (a self-loop counts once).
    pub fn delete_node(&self, tx: &mut WriteTxn, id: NodeId) -> GraphResult<usize> {
        let node = self.node(tx, id)?.ok_or(GraphError::NodeNotFound(id))?;
        let mut removed = 0;
        for adj in self.adjacent_unchecked(tx, id, Direction::Both, None)? {
            let self_loop = adj.node == id;
            if self_loop && adj.direction == Direction::In {
                continue; // Already removed from the out side.
            }
            let (src, dst) = if adj.direction == Direction::Out { (id, adj.node) } else { (adj.node, id) };
            self.remove_edge_keys(tx, adj.edge, src, dst, &adj.edge_type)?;
            removed += 1;
        }
        tx.delete_internal(&self.t.label, &named_key(&node.label, id))?;
        tx.delete_internal(&self.t.node, &id.to_be_bytes())?;
        tx.delete_internal(&self.t.guard, &id.to_be_bytes())?;
        Ok(removed)
    }

    /// Adds an edge `src -> dst` of type `edge_type` and returns its new id. Both nodes must
    /// exist in the transaction's view ([`GraphError::NodeNotFound`] otherwise).
    pub fn add_edge(
        &self,
        tx: &mut WriteTxn,
        src: NodeId,
        dst: NodeId,
        edge_type: &str,
        props: &[u8],
    ) -> GraphResult<EdgeId> {
        check_name("edge type", edge_type)?;
        for n in [src, dst] {
            if tx.get(&self.t.node, &n.to_be_bytes())?.is_none() {
                return Err(GraphError::NodeNotFound(n));
            }
        }
        let id = tx.database().next_id()?;
        tx.put_internal(&self.t.edge, &id.to_be_bytes(), &encode_edge(src, dst, edge_type, props))?;
        tx.put_internal(&self.t.out, &adjacency_key(src, edge_type, id), &dst.to_be_bytes())?;
        tx.put_internal(&self.t.inn, &adjacency_key(dst, edge_type, id), &src.to_be_bytes())?;
        tx.put_internal(&self.t.etype, &named_key(edge_type, id), &endpoints(src, dst))?;
        // Conflict with a concurrent delete of either endpoint (see the module comment).
        tx.delete_internal(&self.t.guard, &src.to_be_bytes())?;
        tx.delete_internal(&self.t.guard, &dst.to_be_bytes())?;
        Ok(id)
    }

    /// Replaces an edge's properties.
    pub fn set_edge_props(&self, tx: &mut WriteTxn, id: EdgeId, props: &[u8]) -> GraphResult<()> {
        let e = self.edge(tx, id)?.ok_or(GraphError::EdgeNotFound(id))?;
        tx.put_internal(&self.t.edge, &id.to_be_bytes(), &encode_edge(e.src, e.dst, &e.edge_type, props))?;
        Ok(())
    }

    /// Deletes an edge.
    pub fn delete_edge(&self, tx: &mut WriteTxn, id: EdgeId) -> GraphResult<()> {
        let e = self.edge(tx, id)?.ok_or(GraphError::EdgeNotFound(id))?;
        self.remove_edge_keys(tx, id, e.src, e.dst, &e.edge_type)
    }

    fn remove_edge_keys(
        &self,
        tx: &mut WriteTxn,
        id: EdgeId,
        src: NodeId,
        dst: NodeId,
        edge_type: &str,
    ) -> GraphResult<()> {
        tx.delete_internal(&self.t.edge, &id.to_be_bytes())?;
        tx.delete_internal(&self.t.out, &adjacency_key(src, edge_type, id))?;
        tx.delete_internal(&self.t.inn, &adjacency_key(dst, edge_type, id))?;
        tx.delete_internal(&self.t.etype, &named_key(edge_type, id))?;
        Ok(())
    }

    // ---- reads --------------------------------------------------------------------------

    /// The node `id`, if it exists.
    pub fn node(&self, tx: &mut impl GraphRead, id: NodeId) -> GraphResult<Option<Node>> {
        match tx.graph_get(&self.t.node, &id.to_be_bytes())? {
            Some(bytes) => decode_node(id, &bytes).map(Some).ok_or_else(|| self.malformed(&self.t.node, id)),
            None => Ok(None),
        }
    }

    /// Whether node `id` exists.
    pub fn contains_node(&self, tx: &mut impl GraphRead, id: NodeId) -> GraphResult<bool> {
        Ok(tx.graph_get(&self.t.node, &id.to_be_bytes())?.is_some())
    }

    /// The edge `id`, if it exists.
    pub fn edge(&self, tx: &mut impl GraphRead, id: EdgeId) -> GraphResult<Option<Edge>> {
        match tx.graph_get(&self.t.edge, &id.to_be_bytes())? {
            Some(bytes) => decode_edge(id, &bytes).map(Some).ok_or_else(|| self.malformed(&self.t.edge, id)),
            None => Ok(None),
        }
    }

    /// The adjacency entries of node `id` in `direction`, optionally only of one edge type:
    /// out entries first; each side grouped by type (shorter type names first, then in byte
    /// order, as the length-prefixed keys sort) and by ascending edge id within a type.
    /// Costs O(degree).
    /// [`GraphError::NodeNotFound`] if the node does not exist.
    pub fn adjacent(
        &self,
        tx: &mut impl GraphRead,
        id: NodeId,
        direction: Direction,
        edge_type: Option<&str>,
    ) -> GraphResult<Vec<Adjacent>> {
        if !self.contains_node(tx, id)? {
            return Err(GraphError::NodeNotFound(id));
        }
        self.adjacent_unchecked(tx, id, direction, edge_type)
    }

    fn adjacent_unchecked(
        &self,
        tx: &mut impl GraphRead,
        id: NodeId,
        direction: Direction,
        edge_type: Option<&str>,
    ) -> GraphResult<Vec<Adjacent>> {
        let mut out = Vec::new();
        let prefix = match edge_type {
            Some(t) => {
                check_name("edge type", t)?;
                typed_prefix(id, t)
            }
            None => id.to_be_bytes().to_vec(),
        };
        for (dir, table) in [(Direction::Out, &self.t.out), (Direction::In, &self.t.inn)] {
            if direction != Direction::Both && direction != dir {
                continue;
            }
            for (key, value) in tx.graph_scan(table, ScanRange::prefix(prefix.clone()), usize::MAX)? {
                let (edge_type, edge) = decode_adjacency_key(&key).ok_or_else(|| self.malformed_key(table, &key))?;
                let node = be_u64(&value, 0).ok_or_else(|| self.malformed_key(table, &key))?;
                out.push(Adjacent { edge, node, edge_type, direction: dir });
            }
        }
        Ok(out)
    }

    /// The distinct nodes adjacent to `id` in `direction`, in the order of their first
    /// adjacency entry. [`GraphError::NodeNotFound`] if the node does not exist.
    pub fn neighbors(
        &self,
        tx: &mut impl GraphRead,
        id: NodeId,
        direction: Direction,
        edge_type: Option<&str>,
    ) -> GraphResult<Vec<NodeId>> {
        let mut seen = HashSet::new();
        let adjacent = self.adjacent(tx, id, direction, edge_type)?;
        Ok(adjacent.into_iter().map(|a| a.node).filter(|n| seen.insert(*n)).collect())
    }

    /// How many edge ends of `direction` (and type) node `id` has: `Both` is out plus in, so a
    /// self-loop counts twice (as in networkx). Costs O(degree).
    pub fn degree(
        &self,
        tx: &mut impl GraphRead,
        id: NodeId,
        direction: Direction,
        edge_type: Option<&str>,
    ) -> GraphResult<usize> {
        Ok(self.adjacent(tx, id, direction, edge_type)?.len())
    }

    /// Up to `limit` node ids in ascending order, after `after` if given, optionally only those
    /// with `label`. Page through all nodes by passing the last id returned as `after`.
    pub fn node_ids(
        &self,
        tx: &mut impl GraphRead,
        label: Option<&str>,
        after: Option<NodeId>,
        limit: usize,
    ) -> GraphResult<Vec<NodeId>> {
        match label {
            None => {
                let rows = scan_page(tx, &self.t.node, after_range(Vec::new(), after), limit)?;
                rows.iter().map(|(k, _)| be_u64(k, 0).ok_or_else(|| self.malformed_key(&self.t.node, k))).collect()
            }
            Some(label) => self.named_ids(tx, &self.t.label, label, after, limit),
        }
    }

    /// Up to `limit` nodes in ascending id order, after `after`, optionally only with `label`.
    pub fn nodes(
        &self,
        tx: &mut impl GraphRead,
        label: Option<&str>,
        after: Option<NodeId>,
        limit: usize,
    ) -> GraphResult<Vec<Node>> {
        if label.is_some() {
            let ids = self.node_ids(tx, label, after, limit)?;
            let mut nodes = Vec::with_capacity(ids.len());
            for id in ids {
                // Present: the label entry and the node record are written together.
                nodes.push(self.node(tx, id)?.ok_or_else(|| self.malformed(&self.t.label, id))?);
            }
            return Ok(nodes);
        }
        let rows = scan_page(tx, &self.t.node, after_range(Vec::new(), after), limit)?;
        rows.iter()
            .map(|(k, v)| {
                let id = be_u64(k, 0).ok_or_else(|| self.malformed_key(&self.t.node, k))?;
                decode_node(id, v).ok_or_else(|| self.malformed(&self.t.node, id))
            })
            .collect()
    }

    /// Up to `limit` edge ids in ascending order, after `after`, optionally only of `edge_type`.
    pub fn edge_ids(
        &self,
        tx: &mut impl GraphRead,
        edge_type: Option<&str>,
        after: Option<EdgeId>,
        limit: usize,
    ) -> GraphResult<Vec<EdgeId>> {
        match edge_type {
            None => {
                let rows = scan_page(tx, &self.t.edge, after_range(Vec::new(), after), limit)?;
                rows.iter().map(|(k, _)| be_u64(k, 0).ok_or_else(|| self.malformed_key(&self.t.edge, k))).collect()
            }
            Some(t) => self.named_ids(tx, &self.t.etype, t, after, limit),
        }
    }

    /// Up to `limit` edges in ascending id order, after `after`, optionally only of `edge_type`.
    pub fn edges(
        &self,
        tx: &mut impl GraphRead,
        edge_type: Option<&str>,
        after: Option<EdgeId>,
        limit: usize,
    ) -> GraphResult<Vec<Edge>> {
        if edge_type.is_some() {
            let ids = self.edge_ids(tx, edge_type, after, limit)?;
            let mut edges = Vec::with_capacity(ids.len());
            for id in ids {
                edges.push(self.edge(tx, id)?.ok_or_else(|| self.malformed(&self.t.etype, id))?);
            }
            return Ok(edges);
        }
        let rows = scan_page(tx, &self.t.edge, after_range(Vec::new(), after), limit)?;
        rows.iter()
            .map(|(k, v)| {
                let id = be_u64(k, 0).ok_or_else(|| self.malformed_key(&self.t.edge, k))?;
                decode_edge(id, v).ok_or_else(|| self.malformed(&self.t.edge, id))
            })
            .collect()
    }

    fn named_ids(
        &self,
        tx: &mut impl GraphRead,
        table: &str,
        name: &str,
        after: Option<u64>,
        limit: usize,
    ) -> GraphResult<Vec<u64>> {
        check_name("label or type", name)?;
        let prefix = named_prefix(name);
        let rows = scan_page(tx, table, after_range(prefix.clone(), after), limit)?;
        rows.iter().map(|(k, _)| be_u64(k, prefix.len()).ok_or_else(|| self.malformed_key(table, k))).collect()
    }

    fn malformed(&self, table: &str, id: u64) -> GraphError {
        GraphError::Malformed { table: table.to_owned(), reason: format!("record {id} does not decode") }
    }

    fn malformed_key(&self, table: &str, key: &[u8]) -> GraphError {
        GraphError::Malformed { table: table.to_owned(), reason: format!("key {key:02x?} does not decode") }
    }
}

// ---- encodings ---------------------------------------------------------------------------

fn check_name(what: &'static str, name: &str) -> GraphResult<()> {
    if name.len() > MAX_LABEL_BYTES {
        return Err(Error::LimitExceeded { what, actual: name.len(), limit: MAX_LABEL_BYTES }.into());
    }
    Ok(())
}

/// The range of keys with `prefix` whose trailing id is greater than `after`; `None` when no
/// id is (after `u64::MAX`).
fn after_range(prefix: Vec<u8>, after: Option<u64>) -> Option<ScanRange> {
    match after {
        None => Some(ScanRange::prefix(prefix)),
        Some(after) => {
            let mut start = prefix.clone();
            start.extend_from_slice(&after.checked_add(1)?.to_be_bytes());
            Some(ScanRange::prefix(prefix).start(start))
        }
    }
}

/// Scans `range` (none: nothing) for at most `limit` rows.
fn scan_page(
    tx: &mut impl GraphRead,
    table: &str,
    range: Option<ScanRange>,
    limit: usize,
) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
    match range {
        Some(range) => tx.graph_scan(table, range, limit),
        None => Ok(Vec::new()),
    }
}

fn push_name(buf: &mut Vec<u8>, name: &str) {
    // check_name bounds every name by MAX_LABEL_BYTES (255) before it gets here.
    buf.push(u8::try_from(name.len()).unwrap_or(u8::MAX));
    buf.extend_from_slice(name.as_bytes());
}

fn named_prefix(name: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(1 + name.len() + ID_BYTES);
    push_name(&mut k, name);
    k
}

fn named_key(name: &str, id: u64) -> Vec<u8> {
    let mut k = named_prefix(name);
    k.extend_from_slice(&id.to_be_bytes());
    k
}

fn typed_prefix(node: NodeId, edge_type: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(ID_BYTES * 2 + 1 + edge_type.len());
    k.extend_from_slice(&node.to_be_bytes());
    push_name(&mut k, edge_type);
    k
}

fn adjacency_key(node: NodeId, edge_type: &str, edge: EdgeId) -> Vec<u8> {
    let mut k = typed_prefix(node, edge_type);
    k.extend_from_slice(&edge.to_be_bytes());
    k
}

fn decode_adjacency_key(key: &[u8]) -> Option<(String, EdgeId)> {
    let (edge_type, rest) = read_name(key.get(ID_BYTES..)?)?;
    (rest.len() == ID_BYTES).then_some(())?;
    Some((edge_type, be_u64(rest, 0)?))
}

fn endpoints(src: NodeId, dst: NodeId) -> Vec<u8> {
    [src.to_be_bytes(), dst.to_be_bytes()].concat()
}

fn encode_node(label: &str, props: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(2 + label.len() + props.len());
    v.push(FORMAT_BYTE);
    push_name(&mut v, label);
    v.extend_from_slice(props);
    v
}

fn decode_node(id: NodeId, bytes: &[u8]) -> Option<Node> {
    let (&format, rest) = bytes.split_first()?;
    (format == FORMAT_BYTE).then_some(())?;
    let (label, props) = read_name(rest)?;
    Some(Node { id, label, props: props.to_vec() })
}

fn encode_edge(src: NodeId, dst: NodeId, edge_type: &str, props: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(2 + 2 * ID_BYTES + edge_type.len() + props.len());
    v.push(FORMAT_BYTE);
    v.extend_from_slice(&src.to_be_bytes());
    v.extend_from_slice(&dst.to_be_bytes());
    push_name(&mut v, edge_type);
    v.extend_from_slice(props);
    v
}

fn decode_edge(id: EdgeId, bytes: &[u8]) -> Option<Edge> {
    let (&format, rest) = bytes.split_first()?;
    (format == FORMAT_BYTE).then_some(())?;
    let src = be_u64(rest, 0)?;
    let dst = be_u64(rest, ID_BYTES)?;
    let (edge_type, props) = read_name(rest.get(2 * ID_BYTES..)?)?;
    Some(Edge { id, src, dst, edge_type, props: props.to_vec() })
}

/// Reads a one-byte-length-prefixed UTF-8 name; returns it and the bytes after it.
fn read_name(bytes: &[u8]) -> Option<(String, &[u8])> {
    let (&len, rest) = bytes.split_first()?;
    let name = rest.get(..usize::from(len))?;
    let name = std::str::from_utf8(name).ok()?.to_owned();
    Some((name, rest.get(usize::from(len)..)?))
}

fn be_u64(bytes: &[u8], at: usize) -> Option<u64> {
    let b: [u8; 8] = bytes.get(at..at.checked_add(ID_BYTES)?)?.try_into().ok()?;
    Some(u64::from_be_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let n = decode_node(7, &encode_node("task", b"{\"a\":1}")).unwrap_or_else(|| unreachable!());
        assert_eq!((n.label.as_str(), n.props.as_slice()), ("task", &b"{\"a\":1}"[..]));
        let e = decode_edge(9, &encode_edge(1, 2, "dep", b"")).unwrap_or_else(|| unreachable!());
        assert_eq!((e.src, e.dst, e.edge_type.as_str(), e.props.len()), (1, 2, "dep", 0));
        let k = adjacency_key(5, "dep", 9);
        assert_eq!(decode_adjacency_key(&k), Some(("dep".to_owned(), 9)));
        assert!(k.starts_with(&typed_prefix(5, "dep")));
        assert!(!adjacency_key(5, "depx", 9).starts_with(&typed_prefix(5, "dep")));
    }

    #[test]
    fn malformed_bytes_do_not_decode() {
        assert_eq!(decode_node(1, b""), None);
        assert_eq!(decode_node(1, &[2, 0]), None);
        assert_eq!(decode_node(1, &[1, 5, b'a']), None);
        assert_eq!(decode_edge(1, &[1, 0, 0]), None);
        assert_eq!(decode_adjacency_key(&[0; 9]), None);
        assert_eq!(be_u64(&[0; 7], 0), None);
        assert_eq!(be_u64(&[0; 8], usize::MAX), None);
    }

    #[test]
    fn after_range_excludes_the_cursor() {
        let r = after_range(vec![3, b'a', b'b', b'c'], Some(5)).unwrap_or_else(|| unreachable!()).resolve();
        assert!(!r.contains(&named_key("abc", 5)));
        assert!(r.contains(&named_key("abc", 6)));
        assert!(!r.contains(&named_key("abd", 6)));
        assert!(after_range(Vec::new(), Some(u64::MAX)).is_none());
    }
}
