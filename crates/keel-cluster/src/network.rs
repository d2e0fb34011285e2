//! Peer traffic: Raft RPCs, forwarded writes and read-index requests over TCP, inside TLS
//! when the peer URL is https (`tls.rs` makes and accepts the connections).
//!
//! A connection begins with a hello naming the cluster id and both member ids; the listener
//! closes any connection whose hello names another cluster or another member (a node never
//! accepts a peer message from another cluster). Frames are `u32` length + bincode; a frame
//! longer than [`MAX_FRAME`] or one that does not decode ends the connection and nothing
//! else: garbage on the peer port cannot crash a node. A connection carries one request and
//! its answer at a time, except in stream mode.
//!
//! Appends (and heartbeats, which openraft sends as one-append streams) travel in stream mode
//! ([`PeerRequest::StreamAppend`]): the leader's writer task sends each append as openraft
//! produces it, up to [`STREAM_IN_FLIGHT`] unanswered, flushing when the next one is not
//! ready; the follower feeds them to `Raft::stream_append` and writes each answer once the
//! append is durable, in order, so its fdatasync of one batch overlaps the arrival of the
//! next. A stream that ends with the leader's `End` answered by the follower's `End` leaves
//! the connection reusable; any other end (a conflict, a partial success, a stopped Raft, a
//! bad or lost frame, no answer within the soft TTL while an append is outstanding) drops
//! it, so a half-used pipeline is never reused. `docs/design/replication.md` (P1) argues each
//! failure.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{FutureExt, Stream, StreamExt};
use openraft::base::{BoxFuture, BoxStream};
use openraft::entry::RaftEntry;
use openraft::errors::{NetworkError, RPCError, ReplicationClosed, StreamingError, Unreachable};
use openraft::network::{RPCOption, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, StreamAppendResult, TransferLeaderRequest,
    TransferLeaderResponse, VoteRequest, VoteResponse,
};
use openraft::RaftNetworkV2;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter, ReadHalf, WriteHalf};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;

use crate::snapshot_file::{SnapshotFile, IO_CHUNK};
use crate::tls::{PeerStream, PeerTls};
use crate::types::{LogId, Member, Request, Response, SnapshotMeta, TypeConfig, Vote};

/// Injected network faults for tests, per directed link between members: cut, a delay drawn
/// from a range for every message, and a probability of losing a message (a lost request is
/// never delivered; a lost answer leaves the request applied but the caller uninformed). Delays
/// differ per message and connections are independent, so messages on different connections
/// are reordered. Seeded: `seed` makes the draws repeatable for one interleaving. Outside
/// tests everything is empty and each check is one atomic load.
#[doc(hidden)]
pub mod faults {
    use std::collections::{HashMap, HashSet};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use parking_lot::Mutex;

    #[derive(Default)]
    struct Links {
        cut: HashSet<(u64, u64)>,
        delay_ms: HashMap<(u64, u64), (u64, u64)>,
        /// The delay of every link without one of its own (emulated distance, not a fault).
        default_delay: Option<Duration>,
        loss: HashMap<(u64, u64), f64>,
        rng: u64,
    }

    impl Links {
        fn any(&self) -> bool {
            !(self.cut.is_empty() && self.delay_ms.is_empty() && self.loss.is_empty() && self.default_delay.is_none())
        }

        /// xorshift64*: enough for fault draws, no dependency.
        fn next(&mut self) -> u64 {
            let mut x = self.rng.max(1);
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            self.rng = x;
            x.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
    }

    static ANY: AtomicBool = AtomicBool::new(false);
    static LINKS: Mutex<Option<Links>> = Mutex::new(None);

    fn with<T>(f: impl FnOnce(&mut Links) -> T) -> T {
        let mut g = LINKS.lock();
        let links = g.get_or_insert_with(Links::default);
        let out = f(links);
        ANY.store(links.any(), Ordering::Release);
        out
    }

    /// Seeds the draws of delays and losses.
    pub fn seed(seed: u64) {
        with(|l| l.rng = seed);
    }

    /// Cuts (or heals) the link from `a` to `b`.
    pub fn set_cut(a: u64, b: u64, cut: bool) {
        with(|l| {
            if cut {
                l.cut.insert((a, b));
            } else {
                l.cut.remove(&(a, b));
            }
        });
    }

    /// Delays every message from `a` to `b` by `lo..=hi` ms (`None` removes the delay).
    pub fn set_delay(a: u64, b: u64, range_ms: Option<(u64, u64)>) {
        with(|l| match range_ms {
            Some(r) => {
                l.delay_ms.insert((a, b), r);
            }
            None => {
                l.delay_ms.remove(&(a, b));
            }
        });
    }

    /// Delays every message on every link without a delay of its own by `d` (`None`: no
    /// delay): emulated distance between members for benchmarks (`keel serve` sets it from
    /// `KEEL_EMULATED_PEER_DELAY_MS`). The sender waits before each message and each answer, so
    /// one request and its answer take twice `d`.
    pub fn set_default_delay(d: Option<Duration>) {
        with(|l| l.default_delay = d);
    }

    /// Loses each message from `a` to `b` with probability `p` (0 removes the loss).
    pub fn set_loss(a: u64, b: u64, p: f64) {
        with(|l| {
            if p > 0.0 {
                l.loss.insert((a, b), p);
            } else {
                l.loss.remove(&(a, b));
            }
        });
    }

    /// Heals every link: no cuts, delays or losses.
    pub fn heal_all() {
        let mut g = LINKS.lock();
        let mut any = false;
        if let Some(l) = g.as_mut() {
            l.cut.clear();
            l.delay_ms.clear();
            l.loss.clear();
            // The emulated distance is not a fault: it stays.
            any = l.any();
        }
        ANY.store(any, Ordering::Release);
    }

    /// Whether the link from `a` to `b` is cut.
    pub fn is_cut(a: u64, b: u64) -> bool {
        ANY.load(Ordering::Acquire) && LINKS.lock().as_ref().is_some_and(|l| l.cut.contains(&(a, b)))
    }

    /// The delay for the next message from `a` to `b`, if that link has one.
    pub fn delay(a: u64, b: u64) -> Option<Duration> {
        if !ANY.load(Ordering::Acquire) {
            return None;
        }
        with(|l| {
            let Some((lo, hi)) = l.delay_ms.get(&(a, b)).copied() else {
                return l.default_delay;
            };
            let span = hi.saturating_sub(lo) + 1;
            Some(Duration::from_millis(lo + l.next() % span))
        })
    }

    /// Carries one message (`what`) from `a` to `b` through the link's injected delay and loss:
    /// waits the drawn delay, then fails if the message is lost.
    pub async fn pass(a: u64, b: u64, what: &str) -> std::io::Result<()> {
        if let Some(d) = delay(a, b) {
            tokio::time::sleep(d).await;
        }
        if lost(a, b) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                format!("{what} lost (test fault)"),
            ));
        }
        Ok(())
    }

    /// How a snapshot transfer is damaged on its way (see [`set_snapshot_fault`]).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum SnapshotFault {
        /// One byte of the second chunk flipped after the sender hashed it.
        FlipByte,
        /// The last chunk left out: the stream ends short of its declared length.
        Truncate,
        /// The connection dropped after the first chunk.
        Drop,
    }

    static SNAPSHOT_FAULT: Mutex<Option<SnapshotFault>> = Mutex::new(None);
    static SNAPSHOT_FAULTS_SENT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    static SNAPSHOT_REFUSED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

    /// Damages every snapshot transfer from now on in the way given (`None` stops it).
    pub fn set_snapshot_fault(fault: Option<SnapshotFault>) {
        *SNAPSHOT_FAULT.lock() = fault;
    }

    /// The fault to apply to the transfer starting now, counted.
    pub(crate) fn snapshot_fault() -> Option<SnapshotFault> {
        let f = *SNAPSHOT_FAULT.lock();
        if f.is_some() {
            SNAPSHOT_FAULTS_SENT.fetch_add(1, Ordering::AcqRel);
        }
        f
    }

    /// Transfers damaged so far (sender side).
    pub fn snapshot_faults_sent() -> u64 {
        SNAPSHOT_FAULTS_SENT.load(Ordering::Acquire)
    }

    /// Counts a transfer a receiver refused.
    pub(crate) fn count_snapshot_refused() {
        SNAPSHOT_REFUSED.fetch_add(1, Ordering::AcqRel);
    }

    /// Transfers receivers refused so far (checksum, length, offsets or layout).
    pub fn snapshot_refused() -> u64 {
        SNAPSHOT_REFUSED.load(Ordering::Acquire)
    }

    /// Whether the next message from `a` to `b` is lost.
    pub fn lost(a: u64, b: u64) -> bool {
        if !ANY.load(Ordering::Acquire) {
            return false;
        }
        with(|l| {
            let Some(&p) = l.loss.get(&(a, b)) else { return false };
            (l.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
        })
    }
}

/// Largest frame accepted.
pub const MAX_FRAME: usize = 1 << 30;
/// Largest snapshot chunk a sender puts in one frame (a receiver refuses larger ones).
pub const MAX_SNAPSHOT_CHUNK: usize = 16 << 20;
/// Smallest snapshot chunk a sender uses, whatever it is configured to.
const MIN_SNAPSHOT_CHUNK: usize = 4 << 10;
/// Largest snapshot a receiver accepts (the engine's default stream limit).
pub const MAX_SNAPSHOT_BYTES: u64 = 64 << 30;
const MAGIC: u64 = 0x4b45_454c_5045_4552; // "KEELPEER"

/// The first frame of every peer connection.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub magic: u64,
    pub cluster_id: u64,
    pub from: u64,
    pub to: u64,
}

/// A peer request.
#[derive(Serialize, Deserialize, Debug)]
pub enum PeerRequest {
    Append(AppendEntriesRequest<TypeConfig>),
    Vote(VoteRequest<TypeConfig>),
    PreVote(VoteRequest<TypeConfig>),
    /// One piece of a snapshot file, in order, on a connection of its own (see
    /// [`SnapshotChunk`]).
    SnapshotChunk(SnapshotChunk),
    TransferLeader(TransferLeaderRequest<TypeConfig>),
    /// A client write received by a follower, proposed by the leader on its behalf.
    Forward(Request),
    /// A follower's linearizable read: the leader confirms leadership and returns the log
    /// index the reader must have applied.
    ReadIndex,
    /// Membership changes and leadership transfer asked of a follower.
    Admin(AdminRequest),
    /// Switches the connection into stream mode: from here the leader sends [`StreamFrame`]s
    /// and the follower answers each append with a [`StreamReply`], in order, until
    /// [`StreamFrame::End`] has been answered with [`StreamReply::End`]; then the connection
    /// is back to one [`PeerRequest`] and one [`PeerResponse`] at a time.
    StreamAppend,
    /// Clients' keep-alives of leases, renewed by the leader (the only member holding
    /// deadlines, `lease.rs`); a member sends those that arrived together as one request.
    LeaseKeepAlive(Vec<i64>),
    /// A client's time-to-live question about a lease, answered by the leader.
    LeaseTimeToLive {
        id: i64,
        keys: bool,
    },
    /// A new leader's CURP recovery: refuse records of terms below `term` from now on and
    /// answer with every pooled command (`curp::witness`).
    CurpFence {
        term: u64,
    },
    /// The leader of `term` has re-proposed and applied what recovery found: forget the
    /// commands recorded in earlier terms.
    CurpDropBelow {
        term: u64,
    },
    /// Contact: answered with [`PeerResponse::Pong`]. Sent to a peer this member has not heard
    /// from lately (`membership::keep_contact`); it counts towards the strict reconfiguration
    /// check on both ends, and tells a removed member soon that it may be removed.
    Ping,
}

/// Most appends one stream has sent and not yet had answered. The follower answers an append
/// once it is durable and folds the appends that arrive during one fdatasync into the next,
/// so a few in flight are enough to keep its disk busy; more only add memory on both ends
/// and entries to send again after a broken connection. With openraft's batches of up to
/// `max_payload_entries` (300) entries that is at most a few MB per follower.
pub const STREAM_IN_FLIGHT: usize = 16;

/// A leader-to-follower frame on a connection in stream mode.
#[derive(Serialize, Deserialize, Debug)]
pub enum StreamFrame {
    Append(AppendEntriesRequest<TypeConfig>),
    /// The leader has nothing more for this stream: answer what is outstanding, then
    /// [`StreamReply::End`].
    End,
}

/// A follower-to-leader frame on a connection in stream mode, one per [`StreamFrame::Append`]
/// in the order they came, then [`StreamReply::End`] after [`StreamFrame::End`].
#[derive(Serialize, Deserialize, Debug)]
pub enum StreamReply {
    /// The append's outcome: the last log id now durable, or a conflict / a higher vote,
    /// which ends the stream (the follower closes the connection after it).
    Result(StreamAppendResult<TypeConfig>),
    /// The follower's Raft stopped; the stream ends and the connection closes.
    Error(String),
    /// Every append before [`StreamFrame::End`] was answered.
    End,
}

/// A piece of a snapshot transfer. The first carries `begin`; each one continues where the
/// last ended; the last carries `end`, the XXH3-128 of the whole file, and is answered by the
/// install's result. Every other piece is answered with [`PeerResponse::SnapshotReceived`].
#[derive(Serialize, Deserialize)]
pub struct SnapshotChunk {
    pub begin: Option<SnapshotBegin>,
    pub offset: u64,
    pub data: Vec<u8>,
    pub end: Option<u128>,
}

impl std::fmt::Debug for SnapshotChunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SnapshotChunk(begin {:?}, {} bytes at {}, end {:?})",
            self.begin,
            self.data.len(),
            self.offset,
            self.end
        )
    }
}

/// What a snapshot transfer is: the leader's vote, the snapshot's metadata (the file must
/// carry the same) and the file's length.
#[derive(Serialize, Deserialize, Debug)]
pub struct SnapshotBegin {
    pub vote: Vote,
    pub meta: SnapshotMeta,
    pub len: u64,
}

/// Asked by a member joining with `--initial-cluster-state existing` and no data yet, on a
/// connection whose hello has cluster id, from and to all zero: which cluster and member id
/// belong to these peer URLs (the member was added with `member add` first, as in etcd).
#[derive(Serialize, Deserialize, Debug)]
pub struct Discover {
    pub peer_urls: Vec<String>,
}

/// The answer to [`Discover`].
#[derive(Serialize, Deserialize, Debug)]
pub enum Discovered {
    Member {
        cluster_id: u64,
        member_id: u64,
    },
    /// No member has these peer URLs (the text says what to do).
    Unknown(String),
}

/// A discovery request is small; a larger first frame is not one.
const MAX_DISCOVER_FRAME: usize = 64 * 1024;

/// Asks the member at peer URL `url` (over TLS when it is https) which cluster and member id
/// `peer_urls` belong to.
pub async fn discover(tls: &PeerTls, url: &str, peer_urls: &[String], timeout: Duration) -> io::Result<Discovered> {
    let ask = async {
        let stream = tls.connect(url).await?;
        let (r, w) = tokio::io::split(stream);
        let (mut r, mut w) = (BufReader::new(r), BufWriter::new(w));
        write_frame(&mut w, &Hello { magic: MAGIC, cluster_id: 0, from: 0, to: 0 }).await?;
        write_frame(&mut w, &Discover { peer_urls: peer_urls.to_vec() }).await?;
        read_frame_limited(&mut r, MAX_DISCOVER_FRAME).await
    };
    tokio::time::timeout(timeout, ask).await.map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no answer"))?
}

/// Cluster administration that only the leader can carry out.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub enum AdminRequest {
    AddMember {
        id: u64,
        member: Member,
        learner: bool,
    },
    RemoveMember {
        id: u64,
    },
    PromoteMember {
        id: u64,
    },
    /// New peer URLs for a member (etcd's `member update`).
    UpdateMember {
        id: u64,
        peer_urls: Vec<String>,
    },
    /// The leader's membership, as it has appended it: asked by a member that hears from no
    /// leader, to learn whether it was removed.
    Members,
}

/// A peer response; errors travel as text (the caller retries or reports them).
#[derive(Serialize, Deserialize, Debug)]
pub enum PeerResponse {
    Append(AppendEntriesResponse<TypeConfig>),
    Vote(VoteResponse<TypeConfig>),
    Snapshot(SnapshotResponse<TypeConfig>),
    TransferLeader(TransferLeaderResponse<TypeConfig>),
    Forward(Response),
    ReadIndex(u64),
    Admin(Vec<(u64, Member, bool)>),
    /// Not the leader (forward/read index/admin): the leader known, if any.
    NotLeader(Option<u64>),
    Error(String),
    /// A snapshot chunk was written; the bytes received so far. (Last, so that the other
    /// variants keep their bincode tags.)
    SnapshotReceived(u64),
    /// Each lease's TTL after its keep-alive, in order; 0 for one unknown or expired.
    LeaseKeepAlive(Vec<i64>),
    /// A lease's standing on the leader; `None` for an unknown lease.
    LeaseTimeToLive(Option<crate::lease::LeaseStanding>),
    /// A witness's pool, in arrival order (the answer to `CurpFence`; empty for `CurpDropBelow`).
    CurpPool(Vec<crate::curp::witness::Pooled>),
    /// A membership change the leader refused, typed (etcd's errors, `reconfig`).
    AdminRefused(crate::reconfig::MemberError),
    /// The leader refused or failed a forwarded request, as the error the client gets.
    Refused(crate::node::NodeError),
    /// The answer to [`PeerRequest::Ping`]: whether the membership the answering member has
    /// appended lists the asking one (`false` may also be a member that has not yet appended
    /// the asker's addition; the asker confirms with the leader before it stops).
    Pong {
        listed: bool,
    },
    /// The receiver ended a snapshot transfer on a bad chunk (out of step, past its length, a
    /// checksum or layout that does not match); why, for the log. The sender starts over.
    SnapshotRefused(String),
}

/// Reads one frame of at most [`MAX_FRAME`] bytes.
pub async fn read_frame<T: serde::de::DeserializeOwned>(r: &mut (impl AsyncReadExt + Unpin)) -> io::Result<T> {
    read_frame_limited(r, MAX_FRAME).await
}

/// Reads one frame of at most `max` bytes. The buffer grows only as bytes arrive, so a
/// length prefix that lies costs no memory beyond what the sender really sends.
pub async fn read_frame_limited<T: serde::de::DeserializeOwned>(
    r: &mut (impl AsyncReadExt + Unpin),
    max: usize,
) -> io::Result<T> {
    let len = r.read_u32_le().await? as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("peer frame of {len} bytes is over the limit of {max}"),
        ));
    }
    let mut buf = Vec::with_capacity(len.min(64 * 1024));
    let got = (&mut *r).take(len as u64).read_to_end(&mut buf).await?;
    if got != len {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "peer frame cut short"));
    }
    bincode::deserialize(&buf)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("undecodable peer frame: {e}")))
}

/// Writes one frame and flushes.
pub async fn write_frame<T: Serialize>(w: &mut (impl AsyncWriteExt + Unpin), value: &T) -> io::Result<()> {
    write_frame_buffered(w, value).await?;
    w.flush().await
}

/// Writes one frame into `w`'s buffer without flushing, so that frames produced together
/// leave in one write.
async fn write_frame_buffered<T: Serialize>(w: &mut (impl AsyncWriteExt + Unpin), value: &T) -> io::Result<()> {
    let bytes = bincode::serialize(value).map_err(|e| io::Error::other(e.to_string()))?;
    if bytes.len() > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "peer frame over the limit"));
    }
    w.write_u32_le(bytes.len() as u32).await?;
    w.write_all(&bytes).await
}

/// The host:port a peer URL names (`http://127.0.0.1:2380` → `127.0.0.1:2380`).
pub fn url_addr(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    rest.trim_end_matches('/').to_string()
}

/// An open peer connection's buffered halves.
type Conn = (BufReader<ReadHalf<PeerStream>>, BufWriter<WriteHalf<PeerStream>>);

/// One connection to a peer, made lazily and remade after any error.
pub struct PeerClient {
    /// Each member's current first peer URL, when the member keeps one: a member's URL may
    /// change (`member update`) while this client lives.
    book: Option<AddressBook>,
    cluster_id: u64,
    from: u64,
    to: u64,
    /// The member's first peer URL; its scheme says whether the link uses TLS.
    url: String,
    tls: PeerTls,
    conn: Option<Conn>,
}

impl PeerClient {
    pub fn new(cluster_id: u64, from: u64, to: u64, member: &Member, tls: PeerTls) -> PeerClient {
        let url = member.peer_urls.first().cloned().unwrap_or_default();
        PeerClient { book: None, cluster_id, from, to, url, tls, conn: None }
    }

    /// This client, dialling the URL `book` holds for its member when it (re)connects.
    pub fn with_book(mut self, book: AddressBook) -> PeerClient {
        self.book = Some(book);
        self
    }

    /// Sends `req` and waits up to `timeout` for its answer.
    pub async fn call(&mut self, req: &PeerRequest, timeout: Duration) -> Result<PeerResponse, CallError> {
        match tokio::time::timeout(timeout, self.call_inner(req)).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => {
                self.conn = None;
                Err(e)
            }
            Err(_) => {
                self.conn = None;
                Err(CallError::Timeout)
            }
        }
    }

    /// The open connection, or a new one (after the hello) when there is none or the link
    /// is cut.
    async fn connect(&mut self) -> Result<&mut Conn, CallError> {
        if faults::is_cut(self.from, self.to) {
            self.conn = None;
            return Err(CallError::Unreachable(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                "link cut (test fault)",
            )));
        }
        if self.conn.is_none() {
            if let Some(url) = self.book.as_ref().and_then(|b| b.read().get(&self.to).cloned()) {
                self.url = url;
            }
            let stream = self.tls.connect(&self.url).await.map_err(CallError::Unreachable)?;
            let (r, w) = tokio::io::split(stream);
            let mut w = BufWriter::new(w);
            let hello = Hello { magic: MAGIC, cluster_id: self.cluster_id, from: self.from, to: self.to };
            write_frame(&mut w, &hello).await.map_err(CallError::Unreachable)?;
            self.conn = Some((BufReader::new(r), w));
        }
        self.conn.as_mut().ok_or(CallError::Timeout)
    }

    async fn call_inner(&mut self, req: &PeerRequest) -> Result<PeerResponse, CallError> {
        // An idle connection the peer has closed (it restarted, or stopped) reads end-of-file
        // at once: a request sent into it fails with an unknown outcome although the peer
        // never saw it. Such a connection is replaced before anything is sent.
        if let Some((r, _)) = self.conn.as_mut() {
            if let Some(Ok([]) | Err(_)) = tokio::io::AsyncBufReadExt::fill_buf(r).now_or_never() {
                self.conn = None;
            }
        }
        self.connect().await?;
        faults::pass(self.from, self.to, "request").await.map_err(CallError::Network)?;
        let Some((r, w)) = self.conn.as_mut() else { return Err(CallError::Timeout) };
        write_frame(w, req).await.map_err(CallError::Network)?;
        let resp = read_frame(r).await.map_err(CallError::Network)?;
        faults::pass(self.to, self.from, "answer").await.map_err(CallError::Network)?;
        Ok(resp)
    }
}

/// Why a peer call failed.
#[derive(Debug)]
pub enum CallError {
    Unreachable(io::Error),
    Network(io::Error),
    Timeout,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Unreachable(e) => write!(f, "peer unreachable: {e}"),
            CallError::Network(e) => write!(f, "peer connection failed: {e}"),
            CallError::Timeout => write!(f, "peer did not answer in time"),
        }
    }
}

impl CallError {
    fn rpc(self) -> RPCError<TypeConfig> {
        match self {
            CallError::Unreachable(e) => RPCError::Unreachable(Unreachable::new(&e)),
            other => RPCError::Network(NetworkError::from_string(other)),
        }
    }
}

fn unexpected(r: PeerResponse) -> RPCError<TypeConfig> {
    match r {
        PeerResponse::Error(e) => RPCError::Network(NetworkError::from_string(e)),
        other => RPCError::Network(NetworkError::from_string(format!("unexpected peer response {other:?}"))),
    }
}

/// The last log id an append covers (its `prev_log_id` when it has no entries): what an
/// answer of full success reports.
fn append_last(req: &AppendEntriesRequest<TypeConfig>) -> Option<LogId> {
    req.entries.last().map(|e| e.log_id()).or(req.prev_log_id)
}

/// The result items of an append stream, as openraft consumes them.
type StreamItem = Result<StreamAppendResult<TypeConfig>, RPCError<TypeConfig>>;

/// The write half of a connection in stream mode, held by [`write_appends`] while it runs.
type ConnWriter = BufWriter<WriteHalf<PeerStream>>;

/// The task feeding a stream's appends to the socket; aborted when the stream is dropped, so
/// a stream openraft abandons (conflict, leader change) stops sending at once.
struct WriterTask(JoinHandle<io::Result<ConnWriter>>);

impl Drop for WriterTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One append stream on one connection: the reading end, which yields the answers in order.
struct AppendPipe<'s> {
    client: &'s mut PeerClient,
    /// The read half (`None` once given back to `client` after a clean end).
    r: Option<BufReader<ReadHalf<PeerStream>>>,
    /// The last log ids of the appends sent and not yet answered, oldest first.
    sent: mpsc::UnboundedReceiver<Option<LogId>>,
    /// Free slots of the in-flight window; an answer gives its slot back.
    window: Arc<Semaphore>,
    writer: WriterTask,
    /// The write half, once the writer has sent [`StreamFrame::End`].
    done_writing: Option<ConnWriter>,
    /// Longest wait for the next answer while an append is outstanding.
    ttl: Duration,
}

impl AppendPipe<'_> {
    /// The next answer and whether the stream goes on after it, or `None` when the stream
    /// is over. The connection goes back to the client only after the follower's `End`; a
    /// stream that ends any other way drops it (its state is unknown: appends may be on the
    /// wire or half read).
    async fn next(&mut self) -> Option<(StreamItem, bool)> {
        let Some(last) = self.sent.recv().await else {
            // The writer has stopped: it sent `End`, or it failed.
            return match self.read_reply().await {
                Ok(StreamReply::End) => {
                    if let (Some(r), Some(w)) = (self.r.take(), self.done_writing.take()) {
                        self.client.conn = Some((r, w));
                    }
                    None
                }
                Ok(other) => Some((Err(protocol(&format!("stream reply {other:?} after the last answer"))), false)),
                Err(e) => Some((Err(e.rpc()), false)),
            };
        };
        let reply = match self.read_reply().await {
            Ok(reply) => reply,
            Err(e) => return Some((Err(e.rpc()), false)),
        };
        self.window.add_permits(1);
        match reply {
            // A partial success (less than was sent is durable) ends the stream: the appends
            // after it extend entries the follower does not have.
            StreamReply::Result(Ok(matched)) => {
                let whole = matched == last;
                Some((Ok(Ok(matched)), whole))
            }
            StreamReply::Result(Err(e)) => Some((Ok(Err(e)), false)),
            StreamReply::Error(e) => Some((Err(RPCError::Network(NetworkError::from_string(e))), false)),
            StreamReply::End => Some((Err(protocol("stream ended with appends unanswered")), false)),
        }
    }

    /// Reads the next reply: within `ttl` (no progress for that long fails the stream), and
    /// failing at once if the writer fails meanwhile (its append will never be answered).
    async fn read_reply(&mut self) -> Result<StreamReply, CallError> {
        let Some(r) = self.r.as_mut() else { return Err(CallError::Timeout) };
        let read = read_frame::<StreamReply>(r);
        tokio::pin!(read);
        let deadline = tokio::time::sleep(self.ttl);
        tokio::pin!(deadline);
        let reply = loop {
            tokio::select! {
                frame = &mut read => break frame.map_err(CallError::Network)?,
                () = &mut deadline => return Err(CallError::Timeout),
                written = &mut self.writer.0, if self.done_writing.is_none() => match written {
                    Ok(Ok(w)) => self.done_writing = Some(w),
                    Ok(Err(e)) => return Err(CallError::Network(e)),
                    Err(e) => return Err(CallError::Network(io::Error::other(e.to_string()))),
                },
            }
        };
        faults::pass(self.client.to, self.client.from, "answer").await.map_err(CallError::Network)?;
        Ok(reply)
    }
}

fn protocol(what: &str) -> RPCError<TypeConfig> {
    RPCError::Network(NetworkError::from_string(format!("peer protocol: {what}")))
}

/// Sends the appends of `input` on `w` as they come, at most [`STREAM_IN_FLIGHT`] unanswered
/// (a slot of `window` each), recording each one's last log id in `sent` before it leaves.
/// Buffered frames are flushed whenever the next append is not ready at once, so appends
/// produced together share one write. At the end of `input` it sends `End` and returns the
/// write half.
async fn write_appends<S>(
    mut w: ConnWriter,
    mut input: S,
    sent: mpsc::UnboundedSender<Option<LogId>>,
    window: Arc<Semaphore>,
    (from, to): (u64, u64),
) -> io::Result<ConnWriter>
where
    S: Stream<Item = AppendEntriesRequest<TypeConfig>> + Unpin,
{
    let closed = || io::Error::new(io::ErrorKind::BrokenPipe, "append stream dropped");
    loop {
        let slot = match Arc::clone(&window).try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                w.flush().await?;
                Arc::clone(&window).acquire_owned().await.map_err(|_| closed())?
            }
        };
        let next = match input.next().now_or_never() {
            Some(next) => next,
            None => {
                w.flush().await?;
                input.next().await
            }
        };
        let Some(req) = next else {
            write_frame(&mut w, &StreamFrame::End).await?;
            return Ok(w);
        };
        // The slot is given back by the reader when this append's answer arrives.
        slot.forget();
        if faults::is_cut(from, to) {
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "link cut (test fault)"));
        }
        faults::pass(from, to, "append").await?;
        sent.send(append_last(&req)).map_err(|_| closed())?;
        write_frame_buffered(&mut w, &StreamFrame::Append(req)).await?;
    }
}

impl PeerClient {
    /// Opens an append stream: the client's connection (or a new one) switched into stream
    /// mode, a task writing `input` to it and the stream of answers read from it.
    async fn open_stream<'s, S>(&'s mut self, input: S, ttl: Duration) -> Result<AppendPipe<'s>, CallError>
    where
        S: Stream<Item = AppendEntriesRequest<TypeConfig>> + Send + Unpin + 'static,
    {
        let opened = tokio::time::timeout(ttl, async {
            let (_, w) = self.connect().await?;
            write_frame_buffered(w, &PeerRequest::StreamAppend).await.map_err(CallError::Network)
        })
        .await;
        // From here the connection belongs to this stream; it comes back only after a clean end.
        let conn = self.conn.take();
        match opened {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(CallError::Timeout),
        }
        let Some((r, w)) = conn else { return Err(CallError::Timeout) };
        let (sent_tx, sent) = mpsc::unbounded_channel();
        let window = Arc::new(Semaphore::new(STREAM_IN_FLIGHT));
        let link = (self.from, self.to);
        let writer = WriterTask(tokio::spawn(write_appends(w, input, sent_tx, Arc::clone(&window), link)));
        Ok(AppendPipe { client: self, r: Some(r), sent, window, writer, done_writing: None, ttl })
    }
}

/// Each member's first peer URL as the membership last said, shared by a member's peer
/// clients (kept by `membership::follow`).
pub type AddressBook = Arc<parking_lot::RwLock<std::collections::BTreeMap<u64, String>>>;

/// openraft's factory: one [`PeerClient`] per replication target.
pub struct Network {
    pub cluster_id: u64,
    pub me: u64,
    pub tls: PeerTls,
    pub book: AddressBook,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = PeerClient;

    async fn new_client(&mut self, target: u64, node: &Member) -> PeerClient {
        PeerClient::new(self.cluster_id, self.me, target, node, self.tls.clone()).with_book(Arc::clone(&self.book))
    }
}

impl PeerClient {
    /// Sends a snapshot file in chunks of `chunk` bytes, each read from the file into one
    /// bounded buffer and answered before the next is read; each waits at most `timeout`, the
    /// last (which the receiver answers after installing) at most `install_timeout`.
    async fn send_snapshot(
        &mut self,
        vote: Vote,
        meta: SnapshotMeta,
        file: SnapshotFile,
        chunk: usize,
        (timeout, install_timeout): (Duration, Duration),
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        let fault = faults::snapshot_fault();
        let range = file.whole();
        let len = range.len();
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        let mut begin = Some(SnapshotBegin { vote, meta, len });
        let mut offset = 0u64;
        let mut n = 0u64;
        let net = |e: String| StreamingError::Network(NetworkError::from_string(e));
        loop {
            let part = range.clone();
            let mut data = tokio::task::spawn_blocking(move || part.read(offset, chunk))
                .await
                .map_err(|e| net(e.to_string()))?
                .map_err(|e| net(format!("reading the snapshot file: {e}")))?;
            hasher.update(&data);
            let last = offset + data.len() as u64 >= len;
            match fault {
                Some(faults::SnapshotFault::FlipByte) if n == 1 => data.iter_mut().take(1).for_each(|b| *b ^= 1),
                Some(faults::SnapshotFault::Drop) if n == 1 => {
                    self.conn = None;
                    return Err(net("connection dropped (test fault)".into()));
                }
                _ => {}
            }
            let truncate = last && fault == Some(faults::SnapshotFault::Truncate) && offset > 0;
            let sent = data.len() as u64;
            let piece = SnapshotChunk {
                begin: begin.take(),
                offset,
                data: if truncate { Vec::new() } else { data },
                end: last.then(|| hasher.digest128()),
            };
            let wait = if last { install_timeout } else { timeout };
            match self.call(&PeerRequest::SnapshotChunk(piece), wait).await {
                Ok(PeerResponse::SnapshotReceived(at)) if !last && at == offset + sent => {}
                Ok(PeerResponse::Snapshot(r)) if last => return Ok(r),
                Ok(other) => {
                    // Out of step: the next attempt starts over on a new connection.
                    self.conn = None;
                    return Err(net(format!("snapshot chunk at {offset}: unexpected peer response {other:?}")));
                }
                Err(CallError::Unreachable(e)) => return Err(StreamingError::Unreachable(Unreachable::new(&e))),
                Err(e) => return Err(net(e.to_string())),
            }
            offset += sent;
            n += 1;
        }
    }
}

/// A snapshot transfer being received on one connection. Dropping it (a refused chunk, a
/// new transfer, the connection closing) removes its partial file.
pub struct IncomingSnapshot {
    vote: Vote,
    meta: SnapshotMeta,
    len: u64,
    received: u64,
    hasher: xxhash_rust::xxh3::Xxh3,
    file: SnapshotFile,
}

/// Receives one chunk of a snapshot transfer into `slot`, this connection's transfer in
/// progress. Bytes from a peer are untrusted: a chunk out of order, past the declared length,
/// a stream that ends short, a checksum that does not match or a file whose layout or
/// metadata is not what `begin` said ends the transfer (its file removed) with an error, and
/// nothing is installed; the leader starts over. A complete, matching file is handed to Raft.
pub async fn receive_snapshot_chunk<H: PeerHandler>(
    handler: &H,
    slot: &mut Option<IncomingSnapshot>,
    chunk: SnapshotChunk,
) -> PeerResponse {
    match receive_chunk(handler, slot, chunk) {
        Err(e) => {
            *slot = None;
            faults::count_snapshot_refused();
            PeerResponse::SnapshotRefused(e.to_string())
        }
        Ok(None) => PeerResponse::SnapshotReceived(slot.as_ref().map_or(0, |s| s.received)),
        Ok(Some(done)) => handler.install_snapshot(done.0, done.1, done.2).await,
    }
}

type Received = (Vote, SnapshotMeta, SnapshotFile);

fn receive_chunk<H: PeerHandler>(
    handler: &H,
    slot: &mut Option<IncomingSnapshot>,
    chunk: SnapshotChunk,
) -> Result<Option<Received>, String> {
    if let Some(begin) = chunk.begin {
        // A new transfer replaces one in progress (whose file goes with it).
        *slot = None;
        if begin.len > MAX_SNAPSHOT_BYTES {
            return Err(format!("{} bytes is over the limit of {MAX_SNAPSHOT_BYTES}", begin.len));
        }
        let file = handler.snapshot_file().map_err(|e| format!("cannot make a file for it: {e}"))?;
        let hasher = xxhash_rust::xxh3::Xxh3::new();
        *slot =
            Some(IncomingSnapshot { vote: begin.vote, meta: begin.meta, len: begin.len, received: 0, hasher, file });
    }
    let Some(r) = slot.as_mut() else { return Err("a chunk without a transfer in progress".into()) };
    let n = chunk.data.len() as u64;
    if chunk.offset != r.received {
        return Err(format!("a chunk at {} where {} was expected", chunk.offset, r.received));
    }
    if chunk.data.len() > MAX_SNAPSHOT_CHUNK || r.received + n > r.len {
        return Err(format!("{n} bytes at {} is past the declared {} bytes", chunk.offset, r.len));
    }
    tokio::task::block_in_place(|| r.file.write_at(r.received, &chunk.data)).map_err(|e| format!("writing: {e}"))?;
    r.hasher.update(&chunk.data);
    r.received += n;
    let Some(sum) = chunk.end else { return Ok(None) };
    let Some(r) = slot.take() else { return Err("no transfer".into()) };
    if r.received != r.len {
        return Err(format!("the stream ended at {} of {} bytes", r.received, r.len));
    }
    if r.hasher.digest128() != sum {
        return Err("checksum mismatch: the stream was damaged on its way".into());
    }
    let (meta, file) = r.file.parse().map_err(|e| e.to_string())?;
    if meta != r.meta {
        return Err(format!("the file's metadata {meta:?} is not the announced {:?}", r.meta));
    }
    Ok(Some((r.vote, meta, file)))
}

impl RaftNetworkV2<TypeConfig> for PeerClient {
    type SnapshotData = SnapshotFile;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<TypeConfig>, RPCError<TypeConfig>> {
        match self.call(&PeerRequest::Append(rpc), option.hard_ttl()).await.map_err(CallError::rpc)? {
            PeerResponse::Append(r) => Ok(r),
            other => Err(unexpected(other)),
        }
    }

    /// Pipelined appends on one connection (see [`STREAM_IN_FLIGHT`] and the module comment).
    fn stream_append<'s, S>(
        &'s mut self,
        input: S,
        option: RPCOption,
    ) -> BoxFuture<'s, Result<BoxStream<'s, StreamItem>, RPCError<TypeConfig>>>
    where
        S: Stream<Item = AppendEntriesRequest<TypeConfig>> + openraft::OptionalSend + Unpin + 'static,
    {
        Box::pin(async move {
            let pipe = self.open_stream(input, option.soft_ttl()).await.map_err(CallError::rpc)?;
            let answers = futures_util::stream::unfold(Some(pipe), |pipe| async move {
                let mut pipe = pipe?;
                let (item, more) = pipe.next().await?;
                Some((item, more.then_some(pipe)))
            });
            Ok(Box::pin(answers) as BoxStream<'s, StreamItem>)
        })
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        match self.call(&PeerRequest::Vote(rpc), option.hard_ttl()).await.map_err(CallError::rpc)? {
            PeerResponse::Vote(r) => Ok(r),
            other => Err(unexpected(other)),
        }
    }

    async fn pre_vote(
        &mut self,
        rpc: VoteRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<VoteResponse<TypeConfig>, RPCError<TypeConfig>> {
        match self.call(&PeerRequest::PreVote(rpc), option.hard_ttl()).await.map_err(CallError::rpc)? {
            PeerResponse::Vote(r) => Ok(r),
            other => Err(unexpected(other)),
        }
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: openraft::alias::SnapshotOf<TypeConfig, SnapshotFile>,
        cancel: impl Future<Output = ReplicationClosed> + openraft::OptionalSend + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        let chunk = option.snapshot_chunk_size().unwrap_or(IO_CHUNK).clamp(MIN_SNAPSHOT_CHUNK, MAX_SNAPSHOT_CHUNK);
        // Installing a large snapshot takes longer than writing a chunk: the last chunk is
        // answered after the install, and gets ten times the per-chunk time (at least 10 min).
        let timeouts = (option.hard_ttl(), (option.hard_ttl() * 10).max(Duration::from_secs(600)));
        let send = self.send_snapshot(vote, snapshot.meta, snapshot.snapshot, chunk, timeouts);
        tokio::select! {
            closed = cancel => {
                // The receiver drops the half-sent file when the connection closes.
                self.conn = None;
                Err(StreamingError::Closed(closed))
            }
            r = send => r,
        }
    }

    async fn transfer_leader(
        &mut self,
        req: TransferLeaderRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<TransferLeaderResponse<TypeConfig>, RPCError<TypeConfig>> {
        match self.call(&PeerRequest::TransferLeader(req), option.hard_ttl()).await.map_err(CallError::rpc)? {
            PeerResponse::TransferLeader(r) => Ok(r),
            other => Err(unexpected(other)),
        }
    }
}

/// Serves one accepted peer connection (plain or TLS, see `tls::PeerTls::accept`) until it
/// closes or misbehaves.
pub async fn serve_peer<H, S>(stream: S, cluster_id: u64, me: u64, handler: Arc<H>) -> io::Result<()>
where
    H: PeerHandler,
    S: AsyncRead + AsyncWrite + Send,
{
    let (r, w) = tokio::io::split(stream);
    let (mut r, mut w) = (BufReader::new(r), BufWriter::new(w));
    // A hello is 32 bytes; anything longer is not a KeelDB peer.
    let hello: Hello = tokio::time::timeout(Duration::from_secs(10), read_frame_limited(&mut r, 64))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no hello"))??;
    if hello.magic == MAGIC && hello.cluster_id == 0 && hello.from == 0 && hello.to == 0 {
        let ask: Discover =
            tokio::time::timeout(Duration::from_secs(10), read_frame_limited(&mut r, MAX_DISCOVER_FRAME))
                .await
                .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no discovery request"))??;
        let answer = handler.discover(&ask.peer_urls);
        return write_frame(&mut w, &answer).await;
    }
    if hello.magic != MAGIC || hello.cluster_id != cluster_id || hello.to != me {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "refused peer {:x}: cluster id {:x} (ours {cluster_id:x}), addressed to {:x} (we are {me:x})",
                hello.from, hello.cluster_id, hello.to
            ),
        ));
    }
    // This connection's snapshot transfer in progress; its partial file goes with it.
    let mut snapshot_in: Option<IncomingSnapshot> = None;
    loop {
        let req: PeerRequest = match read_frame(&mut r).await {
            Ok(req) => req,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        if faults::is_cut(hello.from, me) {
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "link cut (test fault)"));
        }
        if let PeerRequest::StreamAppend = req {
            if serve_stream(&mut r, &mut w, hello.from, me, handler.as_ref()).await? {
                continue;
            }
            return Ok(());
        }
        let resp = match req {
            PeerRequest::SnapshotChunk(c) => receive_snapshot_chunk(&*handler, &mut snapshot_in, c).await,
            req => handler.handle(hello.from, req).await,
        };
        if faults::is_cut(me, hello.from) {
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "link cut (test fault)"));
        }
        write_frame(&mut w, &resp).await?;
    }
}

/// Serves one append stream on a connection (after [`PeerRequest::StreamAppend`]): feeds the
/// appends read into `handler.stream_append` and writes its answers back in order, flushing
/// when no further answer is ready. Returns whether the connection is back in request mode
/// (the leader's `End` was read and answered with `End`); `false` after a conflict, a higher
/// vote or a stopped Raft, where the connection is closed. A bad frame is an error, which closes the
/// connection and nothing else.
async fn serve_stream<H, R, W>(r: &mut R, w: &mut W, from: u64, me: u64, handler: &H) -> io::Result<bool>
where
    H: PeerHandler,
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let cut = || io::Error::new(io::ErrorKind::ConnectionAborted, "link cut (test fault)");
    // The leader keeps at most `STREAM_IN_FLIGHT` unanswered, so this never fills up.
    let (tx, rx) = mpsc::channel(STREAM_IN_FLIGHT);
    let mut answers = handler.stream_append(from, Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)));
    let feed = async move {
        loop {
            match read_frame::<StreamFrame>(r).await? {
                StreamFrame::Append(req) => {
                    if faults::is_cut(from, me) {
                        return Err(cut());
                    }
                    if tx.send(req).await.is_err() {
                        // Raft took no more (its answers say why). The leader may still be
                        // sending: the connection cannot go back to request mode.
                        return Ok(false);
                    }
                }
                // Dropping `tx` ends the input; the answers end after the last one.
                StreamFrame::End => return Ok(true),
            }
        }
    };
    let answer = async move {
        loop {
            let next = match answers.next().now_or_never() {
                Some(next) => next,
                None => {
                    w.flush().await?;
                    answers.next().await
                }
            };
            let Some(next) = next else { break };
            let reply = match next {
                Ok(result) => StreamReply::Result(result),
                Err(e) => StreamReply::Error(e),
            };
            if faults::is_cut(me, from) {
                return Err(cut());
            }
            write_frame_buffered(w, &reply).await?;
            if !matches!(reply, StreamReply::Result(Ok(_))) {
                w.flush().await?;
                return Ok(false);
            }
        }
        write_frame(w, &StreamReply::End).await?;
        Ok(true)
    };
    tokio::pin!(feed, answer);
    tokio::select! {
        fed = &mut feed => {
            let leader_ended = fed?;
            Ok(answer.await? && leader_ended)
        }
        // The answers ended before the leader's `End` (Raft stopped, a conflict): close.
        answered = &mut answer => answered.map(|_| false),
    }
}

/// What serves peer requests (the node).
pub trait PeerHandler: Send + Sync + 'static {
    fn handle(&self, from: u64, req: PeerRequest) -> impl Future<Output = PeerResponse> + Send;
    /// Appends from the leader `from` as a stream: answers in the order of the input, each
    /// once its entries are durable; the stream ends after the first error (`Err` when Raft
    /// has stopped).
    fn stream_append(
        &self,
        from: u64,
        input: BoxStream<'static, AppendEntriesRequest<TypeConfig>>,
    ) -> BoxStream<'static, Result<StreamAppendResult<TypeConfig>, String>>;
    /// Answers a joining member's [`Discover`] from this member's view of the membership.
    fn discover(&self, peer_urls: &[String]) -> Discovered;
    /// A new temporary file to receive a snapshot into.
    fn snapshot_file(&self) -> io::Result<SnapshotFile>;
    /// Hands a completely received and checked snapshot to Raft.
    fn install_snapshot(
        &self,
        vote: Vote,
        meta: SnapshotMeta,
        file: SnapshotFile,
    ) -> impl Future<Output = PeerResponse> + Send;
}

#[cfg(test)]
mod tests {
    use super::faults;
    use std::time::Duration;

    mod snapshot_receiver {
        #![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
        use std::sync::Arc;

        use super::super::*;
        use crate::snapshot_file::Snapshots;
        use crate::types::{LogId, StoredMembership};

        /// Receives into a `snap` directory of its own; "installing" answers the file's length.
        struct Receiver {
            snaps: Snapshots,
        }

        impl PeerHandler for Receiver {
            async fn handle(&self, _from: u64, _req: PeerRequest) -> PeerResponse {
                PeerResponse::Error("not in this test".into())
            }
            fn discover(&self, _peer_urls: &[String]) -> Discovered {
                Discovered::Unknown(String::new())
            }
            fn snapshot_file(&self) -> io::Result<SnapshotFile> {
                self.snaps.temp("recv")
            }
            fn stream_append(
                &self,
                _from: u64,
                _input: BoxStream<'static, AppendEntriesRequest<TypeConfig>>,
            ) -> BoxStream<'static, Result<StreamAppendResult<TypeConfig>, String>> {
                Box::pin(futures_util::stream::empty())
            }
            async fn install_snapshot(&self, _vote: Vote, meta: SnapshotMeta, file: SnapshotFile) -> PeerResponse {
                assert_eq!(meta, self::meta());
                PeerResponse::ReadIndex(file.len())
            }
        }

        fn meta() -> SnapshotMeta {
            let leader = openraft::impls::leader_id_adv::LeaderId { term: 1, node_id: 1 };
            SnapshotMeta { last_log_id: Some(LogId::new(leader, 7)), last_membership: StoredMembership::default() }
        }

        fn chunk(begin: Option<u64>, offset: u64, data: &[u8], end: Option<u128>) -> SnapshotChunk {
            let begin = begin.map(|len| SnapshotBegin { vote: Vote::new(1, 1), meta: meta(), len });
            SnapshotChunk { begin, offset, data: data.to_vec(), end }
        }

        fn partial_files(dir: &std::path::Path) -> usize {
            std::fs::read_dir(dir).unwrap().count()
        }

        /// A snapshot file of the current layout around `checkpoint`.
        fn file_bytes(checkpoint: &[u8]) -> Vec<u8> {
            file_bytes_with(checkpoint, &meta())
        }

        fn file_bytes_with(checkpoint: &[u8], meta: &SnapshotMeta) -> Vec<u8> {
            let meta = bincode::serialize(meta).unwrap();
            let mut out = b"KEELSNP2".to_vec();
            out.extend_from_slice(checkpoint);
            out.extend_from_slice(&meta);
            out.extend_from_slice(&(meta.len() as u64).to_le_bytes());
            out.extend_from_slice(&(checkpoint.len() as u64).to_le_bytes());
            out
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn chunks_out_of_step_are_refused_and_leave_no_file() {
            let tmp = tempfile::tempdir().unwrap();
            let dir = tmp.path().join("snap");
            let h = Receiver { snaps: Snapshots::open(Arc::new(keeldb::fs::StdFs), &dir).unwrap() };
            let bytes = file_bytes(&[5u8; 3000]);
            let len = bytes.len() as u64;
            let sum = xxhash_rust::xxh3::xxh3_128(&bytes);
            let refused = |r: PeerResponse| matches!(r, PeerResponse::SnapshotRefused(_));
            let mut slot = None;

            // No transfer begun.
            assert!(refused(receive_snapshot_chunk(&h, &mut slot, chunk(None, 0, &bytes[..10], None)).await));
            // Each of these ends the transfer begun just before it, and removes its file.
            let bad: Vec<(SnapshotChunk, &str)> = vec![
                (chunk(None, 1100, &bytes[1100..1200], None), "a gap"),
                (chunk(None, 500, &bytes[500..1000], None), "an overlap"),
                (chunk(None, 1000, &vec![0u8; len as usize], None), "past the announced length"),
                (chunk(None, 1000, &bytes[1000..2000], Some(sum)), "short"),
                (chunk(None, 1000, &bytes[1000..], Some(sum ^ 1)), "a checksum that does not match"),
            ];
            for (c, what) in bad {
                let first = chunk(Some(len), 0, &bytes[..1000], None);
                assert!(matches!(
                    receive_snapshot_chunk(&h, &mut slot, first).await,
                    PeerResponse::SnapshotReceived(1000)
                ));
                assert_eq!(partial_files(&dir), 1);
                assert!(refused(receive_snapshot_chunk(&h, &mut slot, c).await), "{what}");
                assert!(slot.is_none() && partial_files(&dir) == 0, "{what}: the partial file is removed");
            }
            // Over the size limit: refused before any file is made.
            assert!(refused(
                receive_snapshot_chunk(&h, &mut slot, chunk(Some(MAX_SNAPSHOT_BYTES + 1), 0, &[], None)).await
            ));
            assert_eq!(partial_files(&dir), 0);
            // A file whose metadata is not the announced one, with a matching checksum.
            let mut other_meta = meta();
            other_meta.last_log_id = other_meta.last_log_id.map(|mut l| {
                l.index = 8;
                l
            });
            let other = file_bytes_with(&[5u8; 3000], &other_meta);
            let c = chunk(Some(other.len() as u64), 0, &other, Some(xxhash_rust::xxh3::xxh3_128(&other)));
            assert!(refused(receive_snapshot_chunk(&h, &mut slot, c).await), "metadata not as announced");
            assert_eq!(partial_files(&dir), 0);
            // Garbage that is not a snapshot file, with a matching checksum.
            let junk = vec![9u8; 100];
            let c = chunk(Some(100), 0, &junk, Some(xxhash_rust::xxh3::xxh3_128(&junk)));
            assert!(refused(receive_snapshot_chunk(&h, &mut slot, c).await), "garbage");
            assert_eq!(partial_files(&dir), 0);
            // A new transfer replaces one in progress; the whole file in order is handed over.
            let first = chunk(Some(len), 0, &bytes[..1000], None);
            assert!(matches!(receive_snapshot_chunk(&h, &mut slot, first).await, PeerResponse::SnapshotReceived(1000)));
            let again = chunk(Some(len), 0, &bytes[..2000], None);
            assert!(matches!(receive_snapshot_chunk(&h, &mut slot, again).await, PeerResponse::SnapshotReceived(2000)));
            assert_eq!(partial_files(&dir), 1, "the replaced transfer's file is gone");
            let last = chunk(None, 2000, &bytes[2000..], Some(sum));
            assert!(
                matches!(receive_snapshot_chunk(&h, &mut slot, last).await, PeerResponse::ReadIndex(l) if l == len)
            );
            assert_eq!(partial_files(&dir), 0, "dropped after the (test) install");
        }
    }

    /// The only unit test touching the process-wide faults (the in-process cluster tests
    /// that use them are in binaries of their own).
    #[test]
    fn injected_faults_apply_to_their_link_only_and_heal() {
        faults::seed(7);
        faults::set_loss(1, 2, 1.0);
        faults::set_delay(1, 3, Some((5, 9)));
        faults::set_cut(2, 1, true);
        assert!(faults::lost(1, 2));
        assert!(!faults::lost(2, 1));
        assert!(faults::is_cut(2, 1) && !faults::is_cut(1, 2));
        for _ in 0..100 {
            let d = faults::delay(1, 3).unwrap_or_default();
            assert!((Duration::from_millis(5)..=Duration::from_millis(9)).contains(&d), "{d:?}");
        }
        assert_eq!(faults::delay(3, 1), None);
        faults::set_loss(1, 2, 0.25);
        let lost = (0..4000).filter(|_| faults::lost(1, 2)).count();
        assert!((700..1300).contains(&lost), "{lost} of 4000 lost at p = 0.25");
        faults::heal_all();
        assert!(!faults::lost(1, 2) && !faults::is_cut(2, 1) && faults::delay(1, 3).is_none());
        // The emulated distance applies to every link without a delay of its own and outlives
        // a heal.
        faults::set_default_delay(Some(Duration::from_millis(4)));
        faults::set_delay(1, 3, Some((1, 1)));
        assert_eq!(faults::delay(2, 1), Some(Duration::from_millis(4)));
        assert_eq!(faults::delay(1, 3), Some(Duration::from_millis(1)));
        faults::heal_all();
        assert_eq!(faults::delay(1, 3), Some(Duration::from_millis(4)));
        faults::set_default_delay(None);
        assert_eq!(faults::delay(1, 3), None);
    }
}
