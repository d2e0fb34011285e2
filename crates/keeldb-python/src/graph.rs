//! The graph API of Python transactions: `Node` and `Edge` values, graph reads on
//! `ReadTransaction` (so also on write transactions) and graph writes on `WriteTransaction`.
//! Everything runs on the engine's default graph (`keeldb::Graph::default()`); properties are
//! JSON-compatible dicts (see `props.rs`).

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};

use keeldb::graph::{Direction, Graph};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::graph_to_py;
use crate::props;
use crate::txn::{with_reader, ReadTransaction, Shared, WriteTransaction};

fn graph() -> &'static Graph {
    static GRAPH: OnceLock<Graph> = OnceLock::new();
    GRAPH.get_or_init(Graph::default)
}

fn direction(text: &str) -> PyResult<Direction> {
    match text {
        "out" => Ok(Direction::Out),
        "in" => Ok(Direction::In),
        "both" => Ok(Direction::Both),
        other => Err(PyValueError::new_err(format!("direction must be 'out', 'in' or 'both', not {other:?}"))),
    }
}

/// A node: id, label and a dict of properties (a fresh copy; changing it changes nothing
/// stored — use `update_node`).
#[pyclass(frozen, module = "keeldb")]
pub struct Node {
    #[pyo3(get)]
    id: u64,
    #[pyo3(get)]
    label: String,
    #[pyo3(get)]
    props: PyObject,
}

impl Node {
    fn from_graph(py: Python<'_>, n: keeldb::graph::Node) -> PyResult<Node> {
        Ok(Node { id: n.id, label: n.label, props: props::decode(py, &n.props)?.unbind() })
    }
}

#[pymethods]
impl Node {
    fn __getitem__<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        self.props.bind(py).get_item(key)
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let label = pyo3::types::PyString::new(py, &self.label).repr()?;
        Ok(format!("Node(id={}, label={label}, props={})", self.id, self.props.bind(py).repr()?))
    }
    fn __eq__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        let Ok(other) = other.downcast::<Node>() else { return Ok(false) };
        let o = other.get();
        Ok(self.id == o.id && self.label == o.label && self.props.bind(py).eq(o.props.bind(py))?)
    }
}

/// An edge: id, source, destination, type and a dict of properties.
#[pyclass(frozen, module = "keeldb")]
pub struct Edge {
    #[pyo3(get)]
    id: u64,
    #[pyo3(get)]
    src: u64,
    #[pyo3(get)]
    dst: u64,
    #[pyo3(get, name = "type")]
    edge_type: String,
    #[pyo3(get)]
    props: PyObject,
}

impl Edge {
    fn from_graph(py: Python<'_>, e: keeldb::graph::Edge) -> PyResult<Edge> {
        Ok(Edge {
            id: e.id,
            src: e.src,
            dst: e.dst,
            edge_type: e.edge_type,
            props: props::decode(py, &e.props)?.unbind(),
        })
    }
}

#[pymethods]
impl Edge {
    fn __getitem__<'py>(&self, py: Python<'py>, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        self.props.bind(py).get_item(key)
    }
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let edge_type = pyo3::types::PyString::new(py, &self.edge_type).repr()?;
        Ok(format!(
            "Edge(id={}, src={}, dst={}, type={edge_type}, props={})",
            self.id,
            self.src,
            self.dst,
            self.props.bind(py).repr()?
        ))
    }
    fn __eq__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        let Ok(other) = other.downcast::<Edge>() else { return Ok(false) };
        let o = other.get();
        Ok((self.id, self.src, self.dst, &self.edge_type) == (o.id, o.src, o.dst, &o.edge_type)
            && self.props.bind(py).eq(o.props.bind(py))?)
    }
}

#[pymethods]
impl ReadTransaction {
    /// The node `node`, or `None`.
    fn get_node(&self, py: Python<'_>, node: u64) -> PyResult<Option<Node>> {
        let n = with_reader!(&self.shared, |tx| graph().node(tx, node)).map_err(graph_to_py)?;
        n.map(|n| Node::from_graph(py, n)).transpose()
    }

    /// Whether node `node` exists.
    fn has_node(&self, node: u64) -> PyResult<bool> {
        with_reader!(&self.shared, |tx| graph().contains_node(tx, node)).map_err(graph_to_py)
    }

    /// The edge `edge`, or `None`.
    fn get_edge(&self, py: Python<'_>, edge: u64) -> PyResult<Option<Edge>> {
        let e = with_reader!(&self.shared, |tx| graph().edge(tx, edge)).map_err(graph_to_py)?;
        e.map(|e| Edge::from_graph(py, e)).transpose()
    }

    /// Distinct ids of the nodes adjacent to `node` ("out": successors, "in": predecessors,
    /// "both"), optionally over edges of one type. Raises `NotFoundError` for a missing node.
    #[pyo3(signature = (node, direction = "out", r#type = None))]
    fn neighbors(&self, node: u64, direction: &str, r#type: Option<&str>) -> PyResult<Vec<u64>> {
        let d = self::direction(direction)?;
        with_reader!(&self.shared, |tx| graph().neighbors(tx, node, d, r#type)).map_err(graph_to_py)
    }

    /// Number of edges at `node` in `direction` ("both" counts a self-loop twice).
    #[pyo3(signature = (node, direction = "both", r#type = None))]
    fn degree(&self, node: u64, direction: &str, r#type: Option<&str>) -> PyResult<usize> {
        let d = self::direction(direction)?;
        with_reader!(&self.shared, |tx| graph().degree(tx, node, d, r#type)).map_err(graph_to_py)
    }

    /// The edges at `node` in `direction` (with their properties), out-edges first.
    #[pyo3(signature = (node, direction = "out", r#type = None))]
    fn edges_of(&self, py: Python<'_>, node: u64, direction: &str, r#type: Option<&str>) -> PyResult<Vec<Edge>> {
        let d = self::direction(direction)?;
        let g = graph();
        let edges = with_reader!(&self.shared, |tx| {
            g.adjacent(tx, node, d, r#type).and_then(|adj| {
                adj.iter().filter_map(|a| g.edge(tx, a.edge).transpose()).collect::<Result<Vec<_>, _>>()
            })
        })
        .map_err(graph_to_py)?;
        edges.into_iter().map(|e| Edge::from_graph(py, e)).collect()
    }

    /// Iterates the nodes (all, or those with `label`) in ascending id order.
    #[pyo3(signature = (label = None))]
    fn nodes(&self, label: Option<String>) -> GraphIter {
        GraphIter::new(&self.shared, Kind::Nodes, label)
    }

    /// Iterates the edges (all, or those of `type`) in ascending id order.
    #[pyo3(signature = (r#type = None))]
    fn edges(&self, r#type: Option<String>) -> GraphIter {
        GraphIter::new(&self.shared, Kind::Edges, r#type)
    }
}

#[pymethods]
impl WriteTransaction {
    /// Adds a node and returns its id.
    #[pyo3(signature = (label, props = None))]
    fn add_node(&self, label: &str, props: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
        let props = props::encode(props)?;
        graph().add_node(self.shared.lock()?.writer()?, label, &props).map_err(graph_to_py)
    }

    /// Adds an edge `src -> dst` of type `type` and returns its id. Both nodes must exist
    /// (`NotFoundError` otherwise).
    #[pyo3(signature = (src, dst, r#type, props = None))]
    fn add_edge(&self, src: u64, dst: u64, r#type: &str, props: Option<&Bound<'_, PyAny>>) -> PyResult<u64> {
        let props = props::encode(props)?;
        graph().add_edge(self.shared.lock()?.writer()?, src, dst, r#type, &props).map_err(graph_to_py)
    }

    /// Replaces a node's properties (or, with `merge=True`, updates them key by key) and/or
    /// changes its label.
    #[pyo3(signature = (node, props = None, *, label = None, merge = false))]
    fn update_node(
        &self,
        py: Python<'_>,
        node: u64,
        props: Option<&Bound<'_, PyAny>>,
        label: Option<&str>,
        merge: bool,
    ) -> PyResult<()> {
        let mut st = self.shared.lock()?;
        let tx = st.writer()?;
        let g = graph();
        if let Some(props) = props {
            let bytes = if merge {
                let current = g
                    .node(tx, node)
                    .map_err(graph_to_py)?
                    .ok_or_else(|| graph_to_py(keeldb::GraphError::NodeNotFound(node)))?;
                merged(py, &current.props, props)?
            } else {
                props::encode(Some(props))?
            };
            g.set_node_props(tx, node, &bytes).map_err(graph_to_py)?;
        }
        match label {
            Some(label) => g.set_node_label(tx, node, label).map_err(graph_to_py),
            None if props.is_none() => g
                .node(tx, node)
                .map_err(graph_to_py)?
                .map(drop)
                .ok_or_else(|| graph_to_py(keeldb::GraphError::NodeNotFound(node))),
            None => Ok(()),
        }
    }

    /// Deletes a node and every edge at it; returns the number of edges removed.
    fn delete_node(&self, node: u64) -> PyResult<usize> {
        graph().delete_node(self.shared.lock()?.writer()?, node).map_err(graph_to_py)
    }

    /// Replaces an edge's properties (or merges them key by key with `merge=True`).
    #[pyo3(signature = (edge, props, *, merge = false))]
    fn update_edge(&self, py: Python<'_>, edge: u64, props: &Bound<'_, PyAny>, merge: bool) -> PyResult<()> {
        let mut st = self.shared.lock()?;
        let tx = st.writer()?;
        let g = graph();
        let bytes = if merge {
            let current = g
                .edge(tx, edge)
                .map_err(graph_to_py)?
                .ok_or_else(|| graph_to_py(keeldb::GraphError::EdgeNotFound(edge)))?;
            merged(py, &current.props, props)?
        } else {
            props::encode(Some(props))?
        };
        g.set_edge_props(tx, edge, &bytes).map_err(graph_to_py)
    }

    /// Deletes an edge (`NotFoundError` if it does not exist).
    fn delete_edge(&self, edge: u64) -> PyResult<()> {
        graph().delete_edge(self.shared.lock()?.writer()?, edge).map_err(graph_to_py)
    }
}

/// The stored properties `current` updated with the keys of `update`, encoded.
fn merged(py: Python<'_>, current: &[u8], update: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    let dict = props::decode(py, current)?;
    let dict = dict.downcast::<PyDict>()?;
    if !update.is_none() {
        dict.update(update.downcast::<PyDict>()?.as_mapping())?;
    }
    props::encode(Some(dict.as_any()))
}

#[derive(Clone, Copy)]
enum Kind {
    Nodes,
    Edges,
}

enum Item {
    Node(keeldb::graph::Node),
    Edge(keeldb::graph::Edge),
}

/// Iterator over nodes or edges in id order, paging by id so that it never holds the
/// transaction between items.
#[pyclass(module = "keeldb")]
pub struct GraphIter {
    shared: Arc<Shared>,
    kind: Kind,
    name: Option<String>,
    after: Option<u64>,
    buf: VecDeque<Item>,
    done: bool,
}

impl GraphIter {
    fn new(shared: &Arc<Shared>, kind: Kind, name: Option<String>) -> GraphIter {
        GraphIter { shared: Arc::clone(shared), kind, name, after: None, buf: VecDeque::new(), done: false }
    }

    fn fill(&mut self, py: Python<'_>) -> PyResult<()> {
        const PAGE: usize = 256;
        let (kind, name, after) = (self.kind, self.name.as_deref(), self.after);
        let items: Vec<Item> = with_reader!(&self.shared, |tx| {
            py.allow_threads(move || match kind {
                Kind::Nodes => graph().nodes(tx, name, after, PAGE).map(|v| v.into_iter().map(Item::Node).collect()),
                Kind::Edges => graph().edges(tx, name, after, PAGE).map(|v| v.into_iter().map(Item::Edge).collect()),
            })
        })
        .map_err(graph_to_py)?;
        self.done = items.len() < PAGE;
        self.after = items.last().map(|i| match i {
            Item::Node(n) => n.id,
            Item::Edge(e) => e.id,
        });
        self.buf.extend(items);
        Ok(())
    }
}

#[pymethods]
impl GraphIter {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(mut slf: PyRefMut<'_, Self>, py: Python<'_>) -> PyResult<Option<PyObject>> {
        if slf.buf.is_empty() && !slf.done {
            slf.fill(py)?;
        }
        match slf.buf.pop_front() {
            None => Ok(None),
            Some(Item::Node(n)) => Ok(Some(Py::new(py, Node::from_graph(py, n)?)?.into_any())),
            Some(Item::Edge(e)) => Ok(Some(Py::new(py, Edge::from_graph(py, e)?)?.into_any())),
        }
    }
}
