//! A member's witness pool (CURP): commands recorded by clients and not yet applied here.
//!
//! Invariants (replication.md, W1-W4):
//! - **W1. No two conflicting commands are pooled at once.** A record is refused if a pooled
//!   command conflicts with it (their footprints overlap and at least one writes), so whatever
//!   set of commands a new leader finds in enough pools, no two of them conflict and they may
//!   be applied in any order with the same key-level results.
//! - **W2. After `fence(t)`, nothing of a term below `t` enters.** The fence and the copy of the
//!   pool it returns are one step under the pool's lock: a command of an older term is either
//!   in the copy or refused for good.
//! - **W3. Arrival order is kept.** Each accepted command gets the pool's next arrival number;
//!   if a command completed before another was sent, every pool holding both received it first.
//! - **W4. Bounded.** Past [`MAX_COMMANDS`] commands or [`MAX_BYTES`] of bodies (by default) a
//!   record is refused (`Full`): a refusal only costs the client the fast path.
//! - **W5. Durable before acknowledged.** A member's witness keeps its pool and its fence in a
//!   store of its own (`super::journal`): a record is acknowledged (and the leader's
//!   speculative answer given) only once its row is on stable storage, and a fence only once
//!   it is. So a fast-path write survives every member losing power at once, and a restarted
//!   member keeps refusing the terms it fenced. ([`Witness::new`] is the in-memory pool of
//!   the unit tests.)

use std::io;
use std::path::Path;
use std::sync::Arc;

use keeldb::fs::FileSystem;
use parking_lot::Mutex;
use prost::Message;
use serde::{Deserialize, Serialize};

use super::journal::{self, Done, Journal};
use super::CommandId;
use crate::mvcc::KeySpan;
use crate::types::RequestKind;

/// Most commands a pool holds. A record is checked against every pooled command, so the bound
/// also bounds that work (a pool is normally a few commands: they leave when applied).
pub const MAX_COMMANDS: usize = 10_000;
/// Applied command ids a witness remembers (see `Pool::recent`).
pub const RECENT: usize = 65_536;
/// Most bytes of command bodies a pool holds.
pub const MAX_BYTES: usize = 64 << 20;

/// The keys a command reads and writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Footprint {
    /// Conflicts with every command that touches anything (leases, compaction, auth, and
    /// anything that does not decode).
    All,
    /// Spans it touches, each read (`false`) or written (`true`).
    Spans(Vec<(KeySpan, bool)>),
}

/// Whether two commands conflict: something one writes, the other reads or writes.
pub fn conflicts(a: &Footprint, b: &Footprint) -> bool {
    match (a, b) {
        (Footprint::All, Footprint::All) => true,
        (Footprint::All, Footprint::Spans(s)) | (Footprint::Spans(s), Footprint::All) => !s.is_empty(),
        (Footprint::Spans(x), Footprint::Spans(y)) => {
            x.iter().any(|(sx, wx)| y.iter().any(|(sy, wy)| (*wx || *wy) && sx.overlaps(sy)))
        }
    }
}

/// The footprint of a read of `[key, range_end)` (etcd's range conventions).
pub fn read_footprint(key: &[u8], range_end: &[u8]) -> Footprint {
    Footprint::Spans(vec![(KeySpan::new(key, range_end), false)])
}

fn txn_spans(t: &etcd_client::proto::PbTxnRequest, out: &mut Vec<(KeySpan, bool)>) -> Option<()> {
    use etcd_client::proto::PbTxnOpRequest as Op;
    for c in &t.compare {
        out.push((KeySpan::new(&c.key, &c.range_end), false));
    }
    for op in t.success.iter().chain(&t.failure) {
        match op.request.as_ref()? {
            Op::RequestRange(r) => out.push((KeySpan::new(&r.key, &r.range_end), false)),
            Op::RequestPut(p) => {
                if p.lease != 0 || p.ignore_lease {
                    return None;
                }
                out.push((KeySpan::One(p.key.clone()), true));
            }
            Op::RequestDeleteRange(d) => out.push((KeySpan::new(&d.key, &d.range_end), true)),
            Op::RequestTxn(inner) => txn_spans(inner, out)?,
        }
    }
    Some(())
}

/// The footprint of an etcd write request of `kind` (protobuf `body`). A put naming a lease
/// is `All` (a lease revoke, also `All`, deletes keys nobody can name in advance).
pub fn footprint(kind: RequestKind, body: &[u8]) -> Footprint {
    let spans = match kind {
        RequestKind::Put => etcd_client::proto::PbPutRequest::decode(body)
            .ok()
            .filter(|p| p.lease == 0 && !p.ignore_lease)
            .map(|p| vec![(KeySpan::One(p.key), true)]),
        RequestKind::DeleteRange => etcd_client::proto::PbDeleteRequest::decode(body)
            .ok()
            .map(|d| vec![(KeySpan::new(&d.key, &d.range_end), true)]),
        RequestKind::Txn => etcd_client::proto::PbTxnRequest::decode(body).ok().and_then(|t| {
            let mut out = Vec::new();
            txn_spans(&t, &mut out).map(|()| out)
        }),
        RequestKind::LeaseGrant | RequestKind::Publish => Some(Vec::new()),
        RequestKind::Curp => {
            return match bincode::deserialize::<super::Command>(body) {
                Ok(c) if c.kind != RequestKind::Curp => footprint(c.kind, &c.body),
                _ => Footprint::All,
            }
        }
        RequestKind::Compact | RequestKind::LeaseRevoke | RequestKind::Auth => None,
    };
    spans.map_or(Footprint::All, Footprint::Spans)
}

/// A pooled command as a new leader receives it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Pooled {
    pub id: CommandId,
    /// The term it was recorded in.
    pub term: u64,
    /// Put, DeleteRange or Txn.
    pub kind: RequestKind,
    /// The etcd request's protobuf encoding.
    pub body: Vec<u8>,
    /// Its place in this pool's arrival order.
    pub arrival: u64,
}

/// Why a record was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A pooled command conflicts with it.
    Conflict,
    /// Its term is below the pool's fence.
    Fenced { fence: u64 },
    /// The pool is at its bound.
    Full,
}

struct Pool {
    /// Commands this member applied lately: a record of one arriving after its apply (a retry,
    /// or a record slower than the log) is accepted without being pooled, since it is durable
    /// and nothing would ever remove it.
    recent: std::collections::HashSet<CommandId>,
    recent_order: std::collections::VecDeque<CommandId>,
    max_commands: usize,
    max_bytes: usize,
    fence: u64,
    next: u64,
    bytes: usize,
    entries: Vec<(Pooled, Footprint)>,
}

/// A member's witness.
pub struct Witness {
    pool: Mutex<Pool>,
    /// Where the pool is kept across a crash (`None`: in memory only, for tests).
    journal: Option<Journal>,
}

/// What to wait for before acknowledging a record or handing over a fenced pool (W5).
#[must_use = "a record or fence is acknowledged only once durable"]
pub struct Ticket(Option<Done>);

impl Ticket {
    /// Completes once what was recorded or fenced is on stable storage.
    pub async fn durable(self) -> io::Result<()> {
        match self.0 {
            None => Ok(()),
            Some(done) => journal::durable(done).await,
        }
    }
}

impl Default for Witness {
    fn default() -> Self {
        Witness::new()
    }
}

impl Witness {
    pub fn new() -> Witness {
        Witness::with_limits(MAX_COMMANDS, MAX_BYTES)
    }

    /// A witness with other bounds (tests).
    pub fn with_limits(max_commands: usize, max_bytes: usize) -> Witness {
        let pool = Pool {
            recent: std::collections::HashSet::new(),
            recent_order: std::collections::VecDeque::new(),
            max_commands,
            max_bytes,
            fence: 0,
            next: 0,
            bytes: 0,
            entries: Vec::new(),
        };
        Witness { pool: Mutex::new(pool), journal: None }
    }

    /// The witness kept in the store at `dir` (created if missing), with the pool and fence it
    /// held at its last stop. Commands `applied` says have applied on this member are dropped
    /// from the pool (their removal may not have reached the disk before a crash).
    ///
    /// The pool loaded is taken as it is, without W1's check: every command in it was
    /// accepted while its conflicting predecessors (if any) had left the pool by applying,
    /// and a command that applied and comes back is at worst proposed again by a recovery,
    /// which applies it once (the dedup table).
    pub fn open(dir: &Path, fs: Arc<dyn FileSystem>, applied: impl Fn(CommandId) -> bool) -> io::Result<Witness> {
        let (journal, loaded) = Journal::open(dir, fs)?;
        let w = Witness::new();
        {
            let mut p = w.pool.lock();
            p.fence = loaded.fence;
            p.next = loaded.last_arrival;
            let mut gone = Vec::new();
            for e in loaded.pooled {
                if applied(e.id) {
                    gone.push(e.arrival);
                    continue;
                }
                let fp = footprint(e.kind, &e.body);
                p.bytes += e.body.len();
                p.entries.push((e, fp));
            }
            journal.remove(gone);
        }
        Ok(Witness { journal: Some(journal), ..w })
    }

    /// Closes the pool's store (the member stops): later records fail, and the store's
    /// directory is unlocked when this returns.
    pub async fn close(&self) {
        if let Some(j) = &self.journal {
            j.close().await;
        }
    }

    /// Records command `id` of `term` unless refused (W1, W2, W4); the ticket says when the
    /// record is durable (W5). Recording an id that is pooled already succeeds without a
    /// second entry.
    pub fn record(&self, id: CommandId, term: u64, kind: RequestKind, body: Vec<u8>) -> Result<Ticket, Refusal> {
        let fp = footprint(kind, &body);
        let mut p = self.pool.lock();
        if p.recent.contains(&id) {
            return Ok(Ticket(None));
        }
        if term < p.fence {
            return Err(Refusal::Fenced { fence: p.fence });
        }
        if p.entries.iter().any(|(e, _)| e.id == id) {
            // Its first record may still be on its way to the disk: wait for what is queued.
            return Ok(Ticket(self.journal.as_ref().map(|j| j.fence(0))));
        }
        if p.entries.iter().any(|(_, f)| conflicts(f, &fp)) {
            return Err(Refusal::Conflict);
        }
        if p.entries.len() >= p.max_commands || p.bytes + body.len() > p.max_bytes {
            return Err(Refusal::Full);
        }
        p.next += 1;
        p.bytes += body.len();
        let arrival = p.next;
        let pooled = Pooled { id, term, kind, body, arrival };
        // Sent under the lock: the row is queued before any removal of it.
        let ticket = Ticket(self.journal.as_ref().map(|j| j.add(&pooled)));
        p.entries.push((pooled, fp));
        Ok(ticket)
    }

    /// Raises the fence to `term` (never lowers it) and returns the pool in arrival order,
    /// in one step (W2). The pool may be handed over only once the ticket is durable (W5).
    pub fn fence(&self, term: u64) -> (Vec<Pooled>, Ticket) {
        let mut p = self.pool.lock();
        p.fence = p.fence.max(term);
        let ticket = Ticket(self.journal.as_ref().map(|j| j.fence(term)));
        (p.entries.iter().map(|(e, _)| e.clone()).collect(), ticket)
    }

    /// The fence term.
    pub fn fence_term(&self) -> u64 {
        self.pool.lock().fence
    }

    /// Number of pooled commands.
    pub fn len(&self) -> usize {
        self.pool.lock().entries.len()
    }

    /// Whether nothing is pooled.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn retain(&self, keep: impl Fn(&Pooled) -> bool) {
        let mut p = self.pool.lock();
        self.retain_in(&mut p, keep);
    }

    /// Keeps the entries of `p` that `keep` accepts, and queues the others' removal from the
    /// store (under the pool's lock, so after their rows).
    fn retain_in(&self, p: &mut Pool, keep: impl Fn(&Pooled) -> bool) {
        let mut gone = Vec::new();
        p.entries.retain(|(e, _)| {
            let k = keep(e);
            if !k {
                gone.push(e.arrival);
            }
            k
        });
        p.bytes = p.entries.iter().map(|(e, _)| e.body.len()).sum();
        if let Some(j) = &self.journal {
            j.remove(gone);
        }
    }

    /// Forgets commands this member has applied, and remembers the last [`RECENT`] of them.
    pub fn applied(&self, ids: &[CommandId]) {
        if ids.is_empty() {
            return;
        }
        let set: std::collections::HashSet<&CommandId> = ids.iter().collect();
        let mut p = self.pool.lock();
        self.retain_in(&mut p, |e| !set.contains(&e.id));
        for id in ids {
            if p.recent.insert(*id) {
                p.recent_order.push_back(*id);
            }
        }
        while p.recent_order.len() > RECENT {
            if let Some(old) = p.recent_order.pop_front() {
                p.recent.remove(&old);
            }
        }
    }

    /// Forgets commands recorded in terms below `term` (their leader's successor has
    /// re-proposed and applied what it needed from them).
    pub fn drop_below(&self, term: u64) {
        self.retain(|e| e.term >= term);
    }

    /// Forgets one command (the leader refused it: it can never complete on the fast path).
    pub fn discard(&self, id: CommandId) {
        self.retain(|e| e.id != id);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use etcd_client::proto::{
        PbCompare, PbDeleteRequest, PbPutRequest, PbRangeRequest, PbTxnOpRequest, PbTxnRequest, PbTxnRequestOp,
    };

    use super::*;

    fn put(k: &str) -> Vec<u8> {
        PbPutRequest { key: k.into(), value: b"v".to_vec(), ..Default::default() }.encode_to_vec()
    }
    fn del(k: &str, end: &str) -> Vec<u8> {
        PbDeleteRequest { key: k.into(), range_end: end.into(), ..Default::default() }.encode_to_vec()
    }
    fn op(r: PbTxnOpRequest) -> PbTxnRequestOp {
        PbTxnRequestOp { request: Some(r) }
    }
    fn id(seq: u64) -> CommandId {
        CommandId { client: 1, seq }
    }
    fn fp(kind: RequestKind, body: &[u8]) -> Footprint {
        footprint(kind, body)
    }

    #[test]
    fn conflicts_need_an_overlap_and_a_write() {
        let (a, b) = (fp(RequestKind::Put, &put("a")), fp(RequestKind::Put, &put("b")));
        assert!(conflicts(&a, &a));
        assert!(!conflicts(&a, &b));
        // A range delete [a, c) covers b; a prefix delete ("\0" end = every key from "b" on).
        assert!(conflicts(&fp(RequestKind::DeleteRange, &del("a", "c")), &b));
        assert!(!conflicts(&fp(RequestKind::DeleteRange, &del("c", "d")), &b));
        assert!(conflicts(&fp(RequestKind::DeleteRange, &del("b", "\0")), &fp(RequestKind::Put, &put("zzz"))));
        // Reads conflict with writes only.
        assert!(conflicts(&read_footprint(b"a", b""), &a));
        assert!(!conflicts(&read_footprint(b"a", b""), &read_footprint(b"a", b"z")));
        assert!(!conflicts(&read_footprint(b"b", b"c"), &a));
        // A txn: its compare reads "x", its failure branch writes "y".
        let txn = PbTxnRequest {
            compare: vec![PbCompare { key: b"x".to_vec(), ..Default::default() }],
            success: vec![op(PbTxnOpRequest::RequestRange(PbRangeRequest {
                key: b"r".to_vec(),
                ..Default::default()
            }))],
            failure: vec![op(PbTxnOpRequest::RequestTxn(PbTxnRequest {
                success: vec![op(PbTxnOpRequest::RequestPut(PbPutRequest {
                    key: b"y".to_vec(),
                    ..Default::default()
                }))],
                ..Default::default()
            }))],
        }
        .encode_to_vec();
        let t = fp(RequestKind::Txn, &txn);
        assert!(conflicts(&t, &fp(RequestKind::Put, &put("x"))));
        assert!(conflicts(&t, &fp(RequestKind::Put, &put("y"))));
        assert!(conflicts(&t, &fp(RequestKind::Put, &put("r"))));
        assert!(conflicts(&t, &read_footprint(b"y", b"")));
        assert!(!conflicts(&t, &read_footprint(b"x", b"")));
        assert!(!conflicts(&t, &fp(RequestKind::Put, &put("q"))));
        // Leases and what cannot be decoded conflict with everything that touches a key.
        let leased = PbPutRequest { key: b"q".to_vec(), lease: 5, ..Default::default() }.encode_to_vec();
        assert_eq!(fp(RequestKind::Put, &leased), Footprint::All);
        assert_eq!(fp(RequestKind::Put, &[0xff, 0xff]), Footprint::All);
        assert!(conflicts(&Footprint::All, &b));
        assert!(conflicts(&Footprint::All, &Footprint::All));
        assert!(!conflicts(&Footprint::All, &fp(RequestKind::LeaseGrant, b"")));
        // A CURP command's footprint is its request's.
        let cmd = crate::curp::Command { id: id(1), first_incomplete: 1, kind: RequestKind::Put, body: put("a") };
        assert_eq!(fp(RequestKind::Curp, &bincode::serialize(&cmd).unwrap()), a);
    }

    /// Records without waiting (an in-memory pool has nothing to wait for).
    fn rec(w: &Witness, id: CommandId, term: u64, kind: RequestKind, body: Vec<u8>) -> Result<(), Refusal> {
        w.record(id, term, kind, body).map(|_| ())
    }

    #[test]
    fn a_pool_refuses_conflicts_and_lower_terms_and_keeps_arrival_order() {
        let w = Witness::new();
        rec(&w, id(1), 3, RequestKind::Put, put("a")).unwrap();
        rec(&w, id(2), 3, RequestKind::Put, put("b")).unwrap();
        assert_eq!(rec(&w, id(3), 3, RequestKind::Put, put("a")), Err(Refusal::Conflict));
        assert_eq!(rec(&w, id(3), 3, RequestKind::DeleteRange, del("a", "z")), Err(Refusal::Conflict));
        // Idempotent: the same id again is accepted and not pooled twice.
        rec(&w, id(1), 3, RequestKind::Put, put("a")).unwrap();
        assert_eq!(w.len(), 2);
        let pool = w.fence(4).0;
        assert_eq!(pool.iter().map(|p| (p.id.seq, p.arrival)).collect::<Vec<_>>(), [(1, 1), (2, 2)]);
        assert_eq!(rec(&w, id(4), 3, RequestKind::Put, put("c")), Err(Refusal::Fenced { fence: 4 }));
        rec(&w, id(4), 4, RequestKind::Put, put("c")).unwrap();
        // A fence never goes down.
        let _ = w.fence(2);
        assert_eq!(w.fence_term(), 4);
        // Applied commands go; so do older terms' once told; so does a discarded one.
        w.applied(&[id(1)]);
        rec(&w, id(5), 4, RequestKind::Put, put("a")).unwrap();
        w.drop_below(4);
        assert_eq!(w.fence(4).0.iter().map(|p| p.id.seq).collect::<Vec<_>>(), [4, 5]);
        w.discard(id(4));
        assert_eq!(w.fence(4).0.iter().map(|p| p.id.seq).collect::<Vec<_>>(), [5]);
        // A record arriving after its command applied here is accepted and not pooled (it
        // would never leave), even below the fence: it is durable already.
        w.applied(&[id(9)]);
        rec(&w, id(9), 1, RequestKind::Put, put("a")).unwrap();
        assert_eq!(w.len(), 1);
    }

    #[test]
    fn a_full_pool_refuses() {
        let w = Witness::with_limits(100, 4096);
        let big = PbPutRequest { key: b"k".to_vec(), value: vec![0; 4096], ..Default::default() }.encode_to_vec();
        assert_eq!(rec(&w, id(1), 1, RequestKind::Put, big), Err(Refusal::Full));
        for i in 0..100 {
            rec(&w, id(i + 10), 1, RequestKind::Put, put(&format!("k{i}"))).unwrap();
        }
        assert_eq!(rec(&w, id(1), 1, RequestKind::Put, put("other")), Err(Refusal::Full));
        w.applied(&[id(10)]);
        rec(&w, id(1), 1, RequestKind::Put, put("other")).unwrap();
    }

    fn open_on(disk: &keel_testkit::sim::SimFs, applied: &'static [u64]) -> Witness {
        Witness::open(Path::new("/m/witness"), Arc::new(disk.clone()), |id| applied.contains(&id.seq)).unwrap()
    }

    #[tokio::test]
    async fn a_kept_pool_and_fence_survive_power_loss() {
        for seed in 0..20 {
            let disk = keel_testkit::sim::SimFs::new(seed);
            let w = open_on(&disk, &[]);
            for (i, k) in ["a", "b", "c"].iter().enumerate() {
                w.record(id(i as u64 + 1), 3, RequestKind::Put, put(k)).unwrap().durable().await.unwrap();
            }
            let (_, fenced) = w.fence(5);
            fenced.durable().await.unwrap();
            // Removals are not synced: one may come back, and is dropped again if applied.
            w.applied(&[id(1)]);
            w.discard(id(2));
            drop(w);
            disk.crash();
            let w = open_on(&disk, &[1]);
            let seqs: Vec<u64> = w.fence(0).0.iter().map(|p| p.id.seq).collect();
            assert!(seqs == [3] || seqs == [2, 3], "seed {seed}: {seqs:?}");
            assert_eq!(w.fence_term(), 5, "seed {seed}");
            assert_eq!(rec(&w, id(7), 4, RequestKind::Put, put("d")), Err(Refusal::Fenced { fence: 5 }));
            // New arrivals come after every kept one, and a kept command still conflicts.
            assert_eq!(rec(&w, id(8), 5, RequestKind::Put, put("c")), Err(Refusal::Conflict));
            w.record(id(9), 5, RequestKind::Put, put("e")).unwrap().durable().await.unwrap();
            let pool = w.fence(0).0;
            assert_eq!(pool.last().map(|p| p.id.seq), Some(9));
            assert!(pool.windows(2).all(|p| p[0].arrival < p[1].arrival), "seed {seed}: {pool:?}");
        }
    }

    #[tokio::test]
    async fn a_witness_whose_sync_failed_acknowledges_nothing_more() {
        use keel_testkit::sim::{Fault, FaultOp};
        let disk = keel_testkit::sim::SimFs::new(7);
        let w = open_on(&disk, &[]);
        w.record(id(1), 1, RequestKind::Put, put("a")).unwrap().durable().await.unwrap();
        disk.inject(Fault::new(FaultOp::SyncData).on_path("witness"));
        assert!(w.record(id(2), 1, RequestKind::Put, put("b")).unwrap().durable().await.is_err());
        disk.clear_faults();
        // The failed sync may have dropped anything unsynced: nothing later is acknowledged,
        // fences included.
        assert!(w.record(id(3), 1, RequestKind::Put, put("c")).unwrap().durable().await.is_err());
        assert!(w.fence(2).1.durable().await.is_err());
    }
}
