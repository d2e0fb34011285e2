//! etcd's key-value semantics over a KeelDB transaction: revisions, versions, ranges, txns.
//!
//! One table, `kv`, maps each live key to a record `create_revision | mod_revision | version |
//! lease | value` (four little-endian i64, then the value). A deleted key has no record: reads
//! at past revisions come from the engine's history (`begin_read_at`), never from tombstones.
//! The store revision lives in `meta/rev`; every request that writes anything takes exactly one
//! new revision, shared by all its keys (etcd's rule), and a request that writes nothing takes
//! none. A key put with a lease is also entered in the lease's key index (`lease.rs`), in the
//! same request, so a revoke finds its keys without a scan of `kv`.

use etcd_client::proto::PbRangeRequest;
use etcd_client::proto::{
    PbCompare, PbDeleteRequest, PbDeleteResponse, PbKeyValue, PbPutRequest, PbPutResponse, PbRangeResponse,
    PbResponseOp, PbTargetUnion, PbTxnOpRequest, PbTxnOpResponse, PbTxnRequest, PbTxnResponse,
};
use std::collections::BTreeMap;

use keeldb::{ReadTxn, ScanRange};

use crate::types::ApplyError;

/// The table of live keys.
pub const KV: &str = "kv";
/// Store metadata: revision, compaction point, applied log id, membership.
pub const META: &str = "meta";
/// `meta` key of the current revision.
pub const REV_KEY: &[u8] = b"rev";
/// `meta` key of the compacted revision.
pub const COMPACT_KEY: &[u8] = b"compact";

/// etcd's limit on operations in one txn (`--max-txn-ops` default).
pub const MAX_TXN_OPS: usize = 128;

const HEADER: usize = 32;

/// A key's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub create_revision: i64,
    pub mod_revision: i64,
    pub version: i64,
    pub lease: i64,
    pub value: Vec<u8>,
}

impl Record {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + self.value.len());
        for n in [self.create_revision, self.mod_revision, self.version, self.lease] {
            out.extend_from_slice(&n.to_le_bytes());
        }
        out.extend_from_slice(&self.value);
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Record, ApplyError> {
        let field = |i: usize| -> Result<i64, ApplyError> {
            let b = bytes.get(i * 8..i * 8 + 8).ok_or_else(|| ApplyError::Invalid("corrupt key record".into()))?;
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            Ok(i64::from_le_bytes(a))
        };
        Ok(Record {
            create_revision: field(0)?,
            mod_revision: field(1)?,
            version: field(2)?,
            lease: field(3)?,
            value: bytes.get(HEADER..).unwrap_or_default().to_vec(),
        })
    }

    fn to_kv(&self, key: &[u8], keys_only: bool) -> PbKeyValue {
        PbKeyValue {
            key: key.to_vec(),
            create_revision: self.create_revision,
            mod_revision: self.mod_revision,
            version: self.version,
            value: if keys_only { Vec::new() } else { self.value.clone() },
            lease: self.lease,
        }
    }
}

/// Key-value pairs as the engine returns them.
pub type Rows = Vec<(Vec<u8>, Vec<u8>)>;

/// Reads a store view: a read snapshot, or an [`Overlay`] that sees planned writes.
pub trait View {
    fn get_raw(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, ApplyError>;
    /// Every row with `start <= key < end` (`end` `None`: to the last key), in key order.
    fn scan_raw(&mut self, start: &[u8], end: Option<&[u8]>) -> Result<Rows, ApplyError>;
}

fn engine(e: keeldb::Error) -> ApplyError {
    ApplyError::Invalid(format!("storage: {e}"))
}

impl View for ReadTxn {
    fn get_raw(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, ApplyError> {
        self.get(KV, key).map_err(engine)
    }
    fn scan_raw(&mut self, start: &[u8], end: Option<&[u8]>) -> Result<Rows, ApplyError> {
        let mut range = ScanRange::all().start(start.to_vec());
        if let Some(e) = end {
            range = range.end(e.to_vec());
        }
        self.scan(KV, range).map_err(engine)?.collect::<Result<Vec<_>, _>>().map_err(engine)
    }
}

/// Planned writes to the `kv` table: key to new record bytes, `None` for a delete.
pub type Planned = BTreeMap<Vec<u8>, Option<Vec<u8>>>;

/// Planned writes to the other tables a request keeps its state in (the lease tables of
/// `lease.rs`): (table, key) to the new value, `None` for a delete.
pub type PlannedTables = BTreeMap<(&'static str, Vec<u8>), Option<Vec<u8>>>;

/// The `kv` table as a batch of log entries leaves it before any of them is committed: an
/// engine snapshot taken when the batch began, the writes planned by the batch's earlier
/// entries over it, and the current entry's own writes on top. Applying a batch plans every
/// entry against this view and then commits them all as one engine group (one WAL write, one
/// commit timestamp per entry), so each entry sees exactly the state its predecessors left.
pub struct Overlay<'a> {
    base: &'a mut ReadTxn,
    batch: Planned,
    entry: Planned,
    /// The same two layers for the other tables (see [`PlannedTables`]).
    tables_batch: PlannedTables,
    tables_entry: PlannedTables,
}

impl<'a> Overlay<'a> {
    pub fn new(base: &'a mut ReadTxn) -> Overlay<'a> {
        Overlay {
            base,
            batch: Planned::new(),
            entry: Planned::new(),
            tables_batch: PlannedTables::new(),
            tables_entry: PlannedTables::new(),
        }
    }

    /// Takes the current entry's writes to the other tables out (to commit them) and keeps
    /// them visible to the entries planned after it.
    pub fn keep_tables(&mut self) -> PlannedTables {
        let writes = std::mem::take(&mut self.tables_entry);
        self.tables_batch.extend(writes.iter().map(|(k, v)| (k.clone(), v.clone())));
        writes
    }

    /// `key` of `table` as the batch so far leaves it.
    pub fn get_in(&mut self, table: &'static str, key: &[u8]) -> Result<Option<Vec<u8>>, ApplyError> {
        let at = (table, key.to_vec());
        if let Some(v) = self.tables_entry.get(&at).or_else(|| self.tables_batch.get(&at)) {
            return Ok(v.clone());
        }
        self.base.get(table, key).map_err(engine)
    }

    /// Every row of `table` whose key starts with `prefix`, in key order.
    pub fn scan_prefix_in(&mut self, table: &'static str, prefix: &[u8]) -> Result<Rows, ApplyError> {
        let base = self.base.scan(table, ScanRange::all().start(prefix.to_vec())).map_err(engine)?;
        let mut merged: BTreeMap<Vec<u8>, Option<Vec<u8>>> = BTreeMap::new();
        for row in base {
            let (k, v) = row.map_err(engine)?;
            if !k.starts_with(prefix) {
                break;
            }
            merged.insert(k, Some(v));
        }
        for layer in [&self.tables_batch, &self.tables_entry] {
            let from = (table, prefix.to_vec());
            for ((t, k), v) in layer.range(from..) {
                if *t != table || !k.starts_with(prefix) {
                    break;
                }
                merged.insert(k.clone(), v.clone());
            }
        }
        Ok(merged.into_iter().filter_map(|(k, v)| v.map(|v| (k, v))).collect())
    }

    /// Plans `key` of `table` to become `value` (`None`: deleted).
    pub fn set_in(&mut self, table: &'static str, key: Vec<u8>, value: Option<Vec<u8>>) {
        self.tables_entry.insert((table, key), value);
    }

    /// Takes the current entry's writes out (to commit them) and keeps them visible to the
    /// entries planned after it.
    pub fn keep_entry(&mut self) -> Planned {
        let writes = std::mem::take(&mut self.entry);
        self.batch.extend(writes.iter().map(|(k, v)| (k.clone(), v.clone())));
        writes
    }

    /// Forgets the current entry's writes (a failed or read-only request writes nothing).
    pub fn discard_entry(&mut self) {
        self.entry.clear();
        self.tables_entry.clear();
    }

    fn put_raw(&mut self, key: &[u8], value: Vec<u8>) {
        self.entry.insert(key.to_vec(), Some(value));
    }

    fn delete_raw(&mut self, key: &[u8]) {
        self.entry.insert(key.to_vec(), None);
    }
}

impl View for Overlay<'_> {
    fn get_raw(&mut self, key: &[u8]) -> Result<Option<Vec<u8>>, ApplyError> {
        if let Some(v) = self.entry.get(key).or_else(|| self.batch.get(key)) {
            return Ok(v.clone());
        }
        self.base.get_raw(key)
    }

    fn scan_raw(&mut self, start: &[u8], end: Option<&[u8]>) -> Result<Rows, ApplyError> {
        let base = self.base.scan_raw(start, end)?;
        let bounds = (
            std::ops::Bound::Included(start.to_vec()),
            end.map_or(std::ops::Bound::Unbounded, |e| std::ops::Bound::Excluded(e.to_vec())),
        );
        if self.batch.range(bounds.clone()).next().is_none() && self.entry.range(bounds.clone()).next().is_none() {
            return Ok(base);
        }
        let mut merged: BTreeMap<Vec<u8>, Option<Vec<u8>>> = base.into_iter().map(|(k, v)| (k, Some(v))).collect();
        for layer in [&self.batch, &self.entry] {
            merged.extend(layer.range(bounds.clone()).map(|(k, v)| (k.clone(), v.clone())));
        }
        Ok(merged.into_iter().filter_map(|(k, v)| v.map(|v| (k, v))).collect())
    }
}

/// The keys a request names: one key, `[key, end)`, or every key from `key` on (`end` = "\0").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySpan {
    One(Vec<u8>),
    Range(Vec<u8>, Option<Vec<u8>>),
}

impl KeySpan {
    pub fn new(key: &[u8], range_end: &[u8]) -> KeySpan {
        if range_end.is_empty() {
            KeySpan::One(key.to_vec())
        } else if range_end == [0] {
            KeySpan::Range(key.to_vec(), None)
        } else {
            KeySpan::Range(key.to_vec(), Some(range_end.to_vec()))
        }
    }

    pub(crate) fn contains(&self, k: &[u8]) -> bool {
        match self {
            KeySpan::One(key) => key == k,
            KeySpan::Range(start, end) => k >= start.as_slice() && end.as_ref().is_none_or(|e| k < e.as_slice()),
        }
    }

    pub(crate) fn overlaps(&self, other: &KeySpan) -> bool {
        match (self, other) {
            (KeySpan::One(k), s) | (s, KeySpan::One(k)) => s.contains(k),
            (KeySpan::Range(a0, a1), KeySpan::Range(b0, b1)) => {
                a1.as_ref().is_none_or(|a1| b0 < a1) && b1.as_ref().is_none_or(|b1| a0 < b1)
            }
        }
    }

    /// Every record in the span, in key order.
    pub fn read(&self, view: &mut impl View) -> Result<Vec<(Vec<u8>, Record)>, ApplyError> {
        match self {
            KeySpan::One(k) => Ok(match view.get_raw(k)? {
                Some(v) => vec![(k.clone(), Record::decode(&v)?)],
                None => Vec::new(),
            }),
            KeySpan::Range(start, end) => {
                if end.as_ref().is_some_and(|e| e <= start) {
                    return Ok(Vec::new());
                }
                view.scan_raw(start, end.as_deref())?.into_iter().map(|(k, v)| Ok((k, Record::decode(&v)?))).collect()
            }
        }
    }
}

/// A range read with etcd's filters, sort and limit. `revision` is the header revision.
pub fn range(view: &mut impl View, req: &PbRangeRequest, revision: i64) -> Result<PbRangeResponse, ApplyError> {
    let span = KeySpan::new(&req.key, &req.range_end);
    let mut rows: Vec<(Vec<u8>, Record)> = span
        .read(view)?
        .into_iter()
        .filter(|(_, r)| {
            (req.min_mod_revision == 0 || r.mod_revision >= req.min_mod_revision)
                && (req.max_mod_revision == 0 || r.mod_revision <= req.max_mod_revision)
                && (req.min_create_revision == 0 || r.create_revision >= req.min_create_revision)
                && (req.max_create_revision == 0 || r.create_revision <= req.max_create_revision)
        })
        .collect();
    let count = rows.len() as i64;
    // etcd: a sort target other than the key with no order given sorts ascending.
    let order = match (req.sort_order, req.sort_target) {
        (0, 0) => 0,
        (0, _) => 1,
        (o, _) => o,
    };
    if order != 0 {
        match req.sort_target {
            1 => rows.sort_by_key(|r| r.1.version),
            2 => rows.sort_by_key(|r| r.1.create_revision),
            3 => rows.sort_by_key(|r| r.1.mod_revision),
            4 => rows.sort_by(|a, b| a.1.value.cmp(&b.1.value)),
            _ => {} // by key: already in key order
        }
        if order == 2 {
            rows.reverse();
        }
    }
    let mut more = false;
    if req.limit > 0 && rows.len() as i64 > req.limit {
        rows.truncate(req.limit as usize);
        more = true;
    }
    let kvs = if req.count_only { Vec::new() } else { rows.iter().map(|(k, r)| r.to_kv(k, req.keys_only)).collect() };
    Ok(PbRangeResponse { header: Some(header(revision)), kvs, more, count })
}

fn header(revision: i64) -> etcd_client::proto::PbResponseHeader {
    etcd_client::proto::PbResponseHeader { revision, ..Default::default() }
}

/// Checks a txn request the way etcd does before proposing it: op count and no key written
/// twice in one branch (nested txns included).
pub fn check_txn(req: &PbTxnRequest) -> Result<(), ApplyError> {
    if req.compare.len() > MAX_TXN_OPS || req.success.len() > MAX_TXN_OPS || req.failure.len() > MAX_TXN_OPS {
        return Err(ApplyError::Invalid("too many operations in txn request".into()));
    }
    for branch in [&req.success, &req.failure] {
        let mut puts = Vec::new();
        let mut dels = Vec::new();
        collect_writes(branch, &mut puts, &mut dels)?;
    }
    Ok(())
}

fn collect_writes(
    ops: &[etcd_client::proto::PbTxnRequestOp],
    puts: &mut Vec<Vec<u8>>,
    dels: &mut Vec<KeySpan>,
) -> Result<(), ApplyError> {
    let dup = || ApplyError::Invalid("duplicate key given in txn request".into());
    for op in ops {
        match &op.request {
            Some(PbTxnOpRequest::RequestPut(p)) => {
                let span = KeySpan::One(p.key.clone());
                if puts.contains(&p.key) || dels.iter().any(|d| d.overlaps(&span)) {
                    return Err(dup());
                }
                puts.push(p.key.clone());
            }
            Some(PbTxnOpRequest::RequestDeleteRange(d)) => {
                let span = KeySpan::new(&d.key, &d.range_end);
                if puts.iter().any(|k| span.contains(k)) {
                    return Err(dup());
                }
                dels.push(span);
            }
            Some(PbTxnOpRequest::RequestTxn(t)) => {
                check_txn(t)?;
                // Writes of either nested branch may run together with this branch's.
                for branch in [&t.success, &t.failure] {
                    let (mut p2, mut d2) = (puts.clone(), dels.clone());
                    collect_writes(branch, &mut p2, &mut d2)?;
                }
                let (mut all_p, mut all_d) = (Vec::new(), Vec::new());
                for branch in [&t.success, &t.failure] {
                    collect_writes(branch, &mut all_p, &mut all_d).ok();
                }
                puts.extend(all_p);
                dels.extend(all_d);
            }
            Some(PbTxnOpRequest::RequestRange(_)) | None => {}
        }
    }
    Ok(())
}

/// Applies writes within one request: every write takes `revision` (= store revision + 1).
pub struct Writer<'t, 'o> {
    pub txn: &'t mut Overlay<'o>,
    pub revision: i64,
    pub wrote: bool,
}

impl Writer<'_, '_> {
    fn put_record(&mut self, key: &[u8], rec: &Record) -> Result<(), ApplyError> {
        self.txn.put_raw(key, rec.encode());
        self.wrote = true;
        Ok(())
    }

    pub fn put(&mut self, req: &PbPutRequest) -> Result<PbPutResponse, ApplyError> {
        let prev = match self.txn.get_raw(&req.key)? {
            Some(v) => Some(Record::decode(&v)?),
            None => None,
        };
        if req.ignore_lease && req.lease != 0 {
            return Err(ApplyError::Invalid("lease is provided".into()));
        }
        if (req.ignore_value || req.ignore_lease) && prev.is_none() {
            return Err(ApplyError::KeyNotFound);
        }
        if req.lease != 0 && !crate::lease::exists(self.txn, req.lease)? {
            return Err(ApplyError::LeaseNotFound);
        }
        let value = match (&prev, req.ignore_value) {
            (Some(p), true) => p.value.clone(),
            _ => req.value.clone(),
        };
        let lease = match (&prev, req.ignore_lease) {
            (Some(p), true) => p.lease,
            _ => req.lease,
        };
        let rec = Record {
            create_revision: prev.as_ref().map_or(self.revision, |p| p.create_revision),
            mod_revision: self.revision,
            version: prev.as_ref().map_or(1, |p| p.version + 1),
            lease,
            value,
        };
        crate::lease::reattach(self.txn, &req.key, prev.as_ref().map_or(0, |p| p.lease), lease);
        self.put_record(&req.key, &rec)?;
        let prev_kv = if req.prev_kv { prev.map(|p| p.to_kv(&req.key, false)) } else { None };
        Ok(PbPutResponse { header: Some(header(self.revision)), prev_kv })
    }

    pub fn delete_range(&mut self, req: &PbDeleteRequest) -> Result<PbDeleteResponse, ApplyError> {
        let rows = KeySpan::new(&req.key, &req.range_end).read(self.txn)?;
        for (k, r) in &rows {
            crate::lease::reattach(self.txn, k, r.lease, 0);
            self.txn.delete_raw(k);
            self.wrote = true;
        }
        let prev_kvs = if req.prev_kv { rows.iter().map(|(k, r)| r.to_kv(k, false)).collect() } else { Vec::new() };
        Ok(PbDeleteResponse { header: Some(header(self.revision)), deleted: rows.len() as i64, prev_kvs })
    }

    pub fn txn(&mut self, req: &PbTxnRequest) -> Result<PbTxnResponse, ApplyError> {
        let mut succeeded = true;
        for c in &req.compare {
            if !compare(self.txn, c)? {
                succeeded = false;
                break;
            }
        }
        let ops = if succeeded { &req.success } else { &req.failure };
        let mut responses = Vec::with_capacity(ops.len());
        for op in ops {
            let response = match &op.request {
                Some(PbTxnOpRequest::RequestRange(r)) => {
                    if r.revision != 0 {
                        return Err(ApplyError::Invalid("a range inside a txn cannot name a revision".into()));
                    }
                    PbTxnOpResponse::ResponseRange(range(self.txn, r, self.revision)?)
                }
                Some(PbTxnOpRequest::RequestPut(p)) => PbTxnOpResponse::ResponsePut(self.put(p)?),
                Some(PbTxnOpRequest::RequestDeleteRange(d)) => {
                    PbTxnOpResponse::ResponseDeleteRange(self.delete_range(d)?)
                }
                Some(PbTxnOpRequest::RequestTxn(t)) => PbTxnOpResponse::ResponseTxn(self.txn(t)?),
                None => return Err(ApplyError::Invalid("txn op without a request".into())),
            };
            responses.push(PbResponseOp { response: Some(response) });
        }
        Ok(PbTxnResponse { header: Some(header(self.revision)), succeeded, responses })
    }
}

/// etcd's compare: every key in the span must satisfy it. A span with no key compares as one
/// missing key: version, revisions and lease 0, and any value compare fails.
fn compare(view: &mut impl View, c: &PbCompare) -> Result<bool, ApplyError> {
    let span = KeySpan::new(&c.key, &c.range_end);
    let rows = span.read(view)?;
    let check = |rec: Option<&Record>| -> Result<bool, ApplyError> {
        use std::cmp::Ordering;
        let ord = match (&c.target_union, rec) {
            (Some(PbTargetUnion::Version(v)), r) => r.map_or(0, |r| r.version).cmp(v),
            (Some(PbTargetUnion::CreateRevision(v)), r) => r.map_or(0, |r| r.create_revision).cmp(v),
            (Some(PbTargetUnion::ModRevision(v)), r) => r.map_or(0, |r| r.mod_revision).cmp(v),
            (Some(PbTargetUnion::Lease(v)), r) => r.map_or(0, |r| r.lease).cmp(v),
            (Some(PbTargetUnion::Value(v)), Some(r)) => r.value.as_slice().cmp(v.as_slice()),
            (Some(PbTargetUnion::Value(_)), None) => return Ok(false),
            (None, _) => return Err(ApplyError::Invalid("compare without a target value".into())),
        };
        Ok(match c.result {
            0 => ord == Ordering::Equal,
            1 => ord == Ordering::Greater,
            2 => ord == Ordering::Less,
            3 => ord != Ordering::Equal,
            _ => return Err(ApplyError::Invalid("unknown compare result".into())),
        })
    };
    if rows.is_empty() {
        return check(None);
    }
    for (_, r) in &rows {
        if !check(Some(r))? {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trips_and_short_records_are_errors() {
        let r = Record { create_revision: 3, mod_revision: 9, version: 4, lease: 0, value: b"v".to_vec() };
        assert_eq!(Record::decode(&r.encode()), Ok(r));
        assert!(Record::decode(&[1, 2, 3]).is_err());
    }

    #[test]
    fn spans_follow_etcds_range_end_rules() {
        assert_eq!(KeySpan::new(b"a", b""), KeySpan::One(b"a".to_vec()));
        assert_eq!(KeySpan::new(b"a", b"\0"), KeySpan::Range(b"a".to_vec(), None));
        let s = KeySpan::new(b"b", b"d");
        assert!(s.contains(b"b") && s.contains(b"c\xff") && !s.contains(b"d") && !s.contains(b"a"));
        assert!(s.overlaps(&KeySpan::new(b"c", b"z")) && !s.overlaps(&KeySpan::new(b"d", b"e")));
    }

    fn put_op(k: &[u8]) -> etcd_client::proto::PbTxnRequestOp {
        etcd_client::proto::PbTxnRequestOp {
            request: Some(PbTxnOpRequest::RequestPut(PbPutRequest { key: k.to_vec(), ..Default::default() })),
        }
    }

    #[test]
    fn a_txn_writing_one_key_twice_is_refused() {
        let ok = PbTxnRequest {
            success: vec![put_op(b"a"), put_op(b"b")],
            failure: vec![put_op(b"a")],
            ..Default::default()
        };
        assert!(check_txn(&ok).is_ok());
        let twice = PbTxnRequest { success: vec![put_op(b"a"), put_op(b"a")], ..Default::default() };
        assert!(check_txn(&twice).is_err());
        let del = etcd_client::proto::PbTxnRequestOp {
            request: Some(PbTxnOpRequest::RequestDeleteRange(PbDeleteRequest {
                key: b"a".to_vec(),
                range_end: b"c".to_vec(),
                ..Default::default()
            })),
        };
        let put_in_deleted = PbTxnRequest { success: vec![del, put_op(b"b")], ..Default::default() };
        assert!(check_txn(&put_in_deleted).is_err());
        let nested = PbTxnRequest {
            success: vec![
                put_op(b"x"),
                etcd_client::proto::PbTxnRequestOp {
                    request: Some(PbTxnOpRequest::RequestTxn(PbTxnRequest {
                        success: vec![put_op(b"x")],
                        ..Default::default()
                    })),
                },
            ],
            ..Default::default()
        };
        assert!(check_txn(&nested).is_err());
        let many = PbTxnRequest { success: (0..200u8).map(|i| put_op(&[i])).collect(), ..Default::default() };
        assert!(check_txn(&many).is_err());
    }
}
