//! etcd's `Watch` service, served by every member from its own state machine (serializable,
//! as etcd): each gRPC stream is one task owning its watchers; the member's [`hub::Hub`] feeds
//! synced watchers, and a stream catches its other watchers up from the engine's change feed.
//!
//! Events come only from the in-memory change feed (`Database::changes_since`), never from the
//! WAL. A watcher gets every revision after its start exactly once, in order, or is canceled
//! with `compact_revision` when the feed no longer holds what it needs (compaction, a member
//! restart, a snapshot install); the argument is in `docs/design/replication.md` ("Watch").

mod event;
mod hub;
mod index;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::proto::{
    PbEvent, PbResponseHeader, PbWatchRequest, PbWatchRequestUnion, PbWatchResponse, PbWatchService,
};
use prost::Message;
use tokio::sync::mpsc;
use tonic::{Request as GrpcRequest, Response as GrpcResponse, Status};

pub use event::{decode, Batch, Commit, DecodeError, Event};
pub use hub::{victims_total, Delivery, Hub, Join, Victims};
pub use index::{Index, Span, Target};

use crate::node::Node;

/// Deliveries a stream's inbox holds before the hub makes its watchers victims.
const INBOX_DELIVERIES: usize = 64;
/// Deliveries merged into one response per watcher when they queue up.
const MERGE_DELIVERIES: usize = 32;
/// Event bytes merged that way (at least one delivery, whatever its size).
const MERGE_BYTES: usize = 256 << 10;
/// Responses queued for the client before the stream task waits for it.
const OUT_RESPONSES: usize = 16;
/// Changes a behind watcher reads from the feed per catch-up step.
const CATCH_UP_CHANGES: usize = 256;
/// Event bytes one catch-up step puts in a response (at least one revision, whatever its size).
const CATCH_UP_BYTES: usize = 1 << 20;
/// How long a behind watcher whose next revision is not in the feed yet waits to look again.
const CATCH_UP_RETRY: Duration = Duration::from_millis(2);

const ERR_COMPACTED: &str = "etcdserver: mvcc: required revision has been compacted";
const ERR_EMPTY_RANGE: &str = "mvcc: watcher range is empty";
const ERR_DUPLICATE_ID: &str = "mvcc: duplicate watch ID provided on the WatchStream";

type Out = Pin<Box<dyn tokio_stream::Stream<Item = Result<PbWatchResponse, Status>> + Send + 'static>>;

/// The Watch service of one member.
#[derive(Clone)]
pub struct WatchService {
    node: Arc<Node>,
    hub: Arc<Hub>,
}

impl WatchService {
    /// Starts the member's hub (it stops with the member).
    pub fn new(node: Arc<Node>) -> WatchService {
        let hub = Hub::start(Arc::clone(&node.sm), node.stopping.subscribe());
        WatchService { node, hub }
    }

    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }
}

#[tonic::async_trait]
impl PbWatchService for WatchService {
    type WatchStream = Out;

    async fn watch(
        &self,
        request: GrpcRequest<tonic::Streaming<PbWatchRequest>>,
    ) -> Result<GrpcResponse<Self::WatchStream>, Status> {
        // With auth on, the stream's token must name a user; each create is then checked for
        // read permission on its range (etcd checks at create, as here).
        let state = Arc::clone(&self.node.sm.auth.read());
        let (auth, user) = crate::auth_api::caller_in(state, request.metadata())?;
        // A require-leader stream (clientv3's `WithRequireLeader`) is refused without a leader
        // and ended with `no leader` when this member loses its leader, as etcd's are.
        crate::etcd_api::check_require_leader(&self.node, request.metadata())?;
        let require_leader = crate::etcd_api::requires_leader(request.metadata());
        let requests = request.into_inner();
        let Some((id, inbox, victims)) = self.hub.open_stream(INBOX_DELIVERIES) else {
            return Err(Status::unavailable("etcdserver: server stopped"));
        };
        let (out, out_rx) = mpsc::channel(OUT_RESPONSES);
        let session = Session {
            node: Arc::clone(&self.node),
            hub: Arc::clone(&self.hub),
            id,
            inbox,
            victims,
            out,
            watchers: HashMap::new(),
            by_id: HashMap::new(),
            next_token: 0,
            next_id: 0,
            progress_pending: false,
            seen_rev: 0,
            auth,
            user,
            require_leader,
        };
        tokio::spawn(session.run(requests));
        Ok(GrpcResponse::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(out_rx))))
    }
}

/// The client went away (or the member is stopping): the stream ends.
struct Gone;

struct Watcher {
    id: i64,
    span: Arc<Span>,
    no_put: bool,
    no_delete: bool,
    prev_kv: bool,
    progress_notify: bool,
    fragment: bool,
    /// The start revision asked for (0: from now); progress is reported only past it.
    start_rev: i64,
    /// Not synced: the first revision it still needs and, once known, the engine timestamp
    /// the feed is read after.
    behind: Option<(i64, Option<u64>)>,
    /// No event sent since the last progress tick.
    quiet: bool,
}

impl Watcher {
    fn target(&self, stream: u64, token: u64, next_rev: i64) -> Target {
        Target { stream, token, next_rev, no_put: self.no_put, no_delete: self.no_delete, span: Arc::clone(&self.span) }
    }
}

enum Step {
    Stop,
    Request(Box<PbWatchRequest>),
    Deliver(Delivery),
    Victims,
    Tick,
    CatchUp,
}

/// One gRPC watch stream.
struct Session {
    node: Arc<Node>,
    hub: Arc<Hub>,
    id: u64,
    inbox: mpsc::Receiver<Delivery>,
    victims: Arc<hub::Victims>,
    out: mpsc::Sender<Result<PbWatchResponse, Status>>,
    /// By token (unique per watcher for the stream's life).
    watchers: HashMap<u64, Watcher>,
    by_id: HashMap<i64, u64>,
    next_token: u64,
    next_id: i64,
    /// A progress request waits for every watcher to be synced.
    progress_pending: bool,
    /// The newest revision of any delivery handled.
    seen_rev: i64,
    /// The auth state when the stream opened and its user (`None` while auth is off).
    auth: Arc<crate::auth::AuthState>,
    user: Option<String>,
    /// The stream ends once this member has no live leader.
    require_leader: bool,
}

impl Session {
    async fn run(mut self, mut requests: tonic::Streaming<PbWatchRequest>) {
        let interval = self.node.config.watch_progress_notify_interval.max(Duration::from_millis(10));
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stopping = self.node.stopping.subscribe();
        // A require-leader stream ends when its member has lost its leader: watched by a task
        // of its own, so that the loop's other steps do not restart its clock.
        let (lost_tx, mut lost) = tokio::sync::oneshot::channel::<()>();
        if self.require_leader {
            let node = Arc::clone(&self.node);
            tokio::spawn(async move {
                let mut lost_tx = lost_tx;
                tokio::select! {
                    _ = node.leader_lost() => {
                        let _ = lost_tx.send(());
                    }
                    _ = lost_tx.closed() => {}
                }
            });
        }
        let mut waiting = false;
        loop {
            let behind = self.watchers.values().any(|w| w.behind.is_some());
            let step = tokio::select! {
                biased;
                _ = self.out.closed() => Step::Stop,
                _ = async { let _ = stopping.wait_for(|s| *s).await; } => {
                    // A status clients retry elsewhere (clientv3 resumes a watch on
                    // Unavailable); a bare end of stream reaches the application as EOF.
                    let _ = self.out.send(Err(Status::unavailable("etcdserver: server stopped"))).await;
                    Step::Stop
                }
                _ = &mut lost, if self.require_leader => {
                    let _ = self.out.send(Err(crate::etcd_api::no_leader())).await;
                    Step::Stop
                }
                r = requests.message() => match r {
                    Ok(Some(r)) => Step::Request(Box::new(r)),
                    _ => Step::Stop,
                },
                d = self.inbox.recv() => match d {
                    Some(d) => Step::Deliver(d),
                    None => {
                        let _ = self.out.send(Err(Status::unavailable("etcdserver: server stopped"))).await;
                        Step::Stop
                    }
                },
                _ = self.victims.notify.notified() => Step::Victims,
                _ = tick.tick() => Step::Tick,
                _ = tokio::time::sleep(CATCH_UP_RETRY), if behind && waiting => Step::CatchUp,
                _ = std::future::ready(()), if behind && !waiting => Step::CatchUp,
            };
            let done = match step {
                Step::Stop => Err(Gone),
                Step::Request(r) => self.request(*r).await,
                Step::Deliver(d) => self.deliver(d).await,
                Step::Victims => self.take_victims().await,
                Step::Tick => self.progress_tick().await,
                Step::CatchUp => match self.catch_up().await {
                    Ok(moved) => {
                        waiting = !moved;
                        Ok(())
                    }
                    Err(g) => Err(g),
                },
            };
            let done = match done {
                Ok(()) if self.progress_pending => self.progress_all().await,
                other => other,
            };
            if done.is_err() {
                break;
            }
        }
        self.hub.close_stream(self.id);
    }

    fn header(&self, revision: i64) -> Option<PbResponseHeader> {
        Some(PbResponseHeader {
            cluster_id: self.node.cluster_id,
            member_id: self.node.id,
            revision,
            raft_term: self.node.term(),
        })
    }

    fn current(&self) -> i64 {
        self.node.sm.visible_revision()
    }

    async fn send(&self, resp: PbWatchResponse) -> Result<(), Gone> {
        self.out.send(Ok(resp)).await.map_err(|_| Gone)
    }

    /// Sends `resp`, split into fragments under `--max-request-bytes` when the watcher asked for
    /// fragments, the response is that big and has more than one event (as etcd).
    async fn send_events(&self, resp: PbWatchResponse, fragment: bool) -> Result<(), Gone> {
        let max = self.node.config.max_request_bytes;
        if !fragment || resp.events.len() < 2 || resp.encoded_len() < max {
            return self.send(resp).await;
        }
        let mut rest = resp.events.into_iter().peekable();
        let base = PbWatchResponse { events: Vec::new(), fragment: true, ..resp };
        while rest.peek().is_some() {
            let mut part = base.clone();
            let mut size = part.encoded_len();
            while let Some(e) = rest.peek() {
                // Field tag, length prefix and the event.
                let len = e.encoded_len();
                let add = 1 + prost::length_delimiter_len(len) + len;
                if !part.events.is_empty() && size + add >= max {
                    break;
                }
                size += add;
                if let Some(e) = rest.next() {
                    part.events.push(e);
                }
            }
            part.fragment = rest.peek().is_some();
            self.send(part).await?;
        }
        Ok(())
    }

    async fn request(&mut self, req: PbWatchRequest) -> Result<(), Gone> {
        match req.request_union {
            Some(PbWatchRequestUnion::CreateRequest(c)) => {
                let filters = c.filters.clone();
                self.create(
                    Create {
                        key: c.key,
                        range_end: c.range_end,
                        start_revision: c.start_revision,
                        watch_id: c.watch_id,
                        prev_kv: c.prev_kv,
                        progress_notify: c.progress_notify,
                        fragment: c.fragment,
                    },
                    &filters,
                )
                .await
            }
            Some(PbWatchRequestUnion::CancelRequest(c)) => self.cancel(c.watch_id).await,
            Some(PbWatchRequestUnion::ProgressRequest(_)) => {
                self.progress_pending = true;
                Ok(())
            }
            // etcd ignores a request it does not know rather than end the stream.
            None => Ok(()),
        }
    }

    async fn refuse(&self, why: &str) -> Result<(), Gone> {
        let header = self.header(self.current());
        self.send(PbWatchResponse {
            header,
            watch_id: -1,
            created: true,
            canceled: true,
            cancel_reason: why.to_string(),
            ..Default::default()
        })
        .await
    }

    async fn create(&mut self, c: Create, filters: &[i32]) -> Result<(), Gone> {
        if c.start_revision < 0 {
            return self.refuse(ERR_COMPACTED).await;
        }
        let Some(span) = Span::new(&c.key, &c.range_end) else {
            return self.refuse(ERR_EMPTY_RANGE).await;
        };
        if let Err(denied) =
            crate::auth_api::check(&self.auth, self.user.as_deref(), &c.key, &c.range_end, crate::auth::Perm::Read)
        {
            // etcd cancels with the gRPC error's text, code included, so that clientv3 turns the
            // cancel reason back into the same typed error (ErrGRPCPermissionDenied, ...).
            return self.refuse(&crate::auth_api::grpc_error_text(&denied)).await;
        }
        let id = if c.watch_id != 0 {
            if self.by_id.contains_key(&c.watch_id) {
                return self.refuse(ERR_DUPLICATE_ID).await;
            }
            c.watch_id
        } else {
            while self.by_id.contains_key(&self.next_id) {
                self.next_id += 1;
            }
            self.next_id += 1;
            self.next_id - 1
        };
        let current = self.current();
        let next_rev = if c.start_revision == 0 { current + 1 } else { c.start_revision };
        let token = self.next_token;
        self.next_token += 1;
        self.by_id.insert(id, token);
        self.watchers.insert(
            token,
            Watcher {
                id,
                span: Arc::new(span),
                no_put: filters.contains(&0),
                no_delete: filters.contains(&1),
                prev_kv: c.prev_kv,
                progress_notify: c.progress_notify,
                fragment: c.fragment,
                start_rev: c.start_revision,
                behind: Some((next_rev, None)),
                quiet: true,
            },
        );
        // The created response goes first; the watcher's events follow it (it joins the hub,
        // or catches up, only after this).
        self.send(PbWatchResponse { header: self.header(current), watch_id: id, created: true, ..Default::default() })
            .await?;
        self.try_join(token);
        Ok(())
    }

    /// Joins a behind watcher to the hub when the hub has not passed its next revision.
    fn try_join(&mut self, token: u64) -> bool {
        let Some(w) = self.watchers.get_mut(&token) else { return false };
        let Some((next_rev, _)) = w.behind else { return true };
        match self.hub.join(w.target(self.id, token, next_rev)) {
            Join::Joined => {
                w.behind = None;
                true
            }
            Join::Behind(_) => false,
        }
    }

    async fn cancel(&mut self, watch_id: i64) -> Result<(), Gone> {
        let Some(token) = self.by_id.remove(&watch_id) else { return Ok(()) };
        if let Some(w) = self.watchers.remove(&token) {
            self.hub.leave(&w.span, self.id, token);
        }
        let header = self.header(self.current());
        self.send(PbWatchResponse { header, watch_id, canceled: true, ..Default::default() }).await
    }

    /// Cancels a watcher whose next revision the feed no longer holds (etcd's compacted
    /// cancel: the client learns the oldest revision it can watch from).
    async fn cancel_compacted(&mut self, token: u64, compact_revision: i64) -> Result<(), Gone> {
        let Some(w) = self.watchers.remove(&token) else { return Ok(()) };
        self.by_id.remove(&w.id);
        self.hub.leave(&w.span, self.id, token);
        let header = self.header(self.current());
        self.send(PbWatchResponse {
            header,
            watch_id: w.id,
            canceled: true,
            compact_revision,
            cancel_reason: ERR_COMPACTED.to_string(),
            ..Default::default()
        })
        .await
    }

    /// Sends a hub delivery's events to its watchers still on this stream, together with the
    /// deliveries queued behind it: one response per watcher for all of them (fewer, larger
    /// responses when the client or this task lags, as etcd's catch-up sends).
    async fn deliver(&mut self, first: Delivery) -> Result<(), Gone> {
        // Merged up to about 256 KiB of events: a response stays well under the 4 MiB a gRPC
        // client takes by default, and the 16 queued for a slow client hold a few MiB.
        let mut bytes = delivery_bytes(&first);
        let mut queue = vec![first];
        while queue.len() < MERGE_DELIVERIES && bytes < MERGE_BYTES {
            match self.inbox.try_recv() {
                Ok(d) => {
                    bytes += delivery_bytes(&d);
                    queue.push(d);
                }
                Err(_) => break,
            }
        }
        let revision = queue.iter().map(|d| d.revision).max().unwrap_or(0);
        self.seen_rev = self.seen_rev.max(revision);
        let db = &self.node.sm.db;
        let mut order: Vec<u64> = Vec::new();
        let mut per: HashMap<u64, Vec<PbEvent>> = HashMap::new();
        for d in &queue {
            for hit in &d.hits {
                let Some(w) = self.watchers.get_mut(&hit.token) else { continue };
                // Canceled and the token never reused; behind watchers are not in the index,
                // and deliveries queued before one fell behind are drained before it is marked.
                debug_assert!(w.behind.is_none());
                w.quiet = false;
                let events = per.entry(hit.token).or_insert_with(|| {
                    order.push(hit.token);
                    Vec::new()
                });
                for (b, e) in &hit.events {
                    let Some(batch) = d.batches.get(*b as usize) else { continue };
                    let prev = if w.prev_kv { Some(batch.prev_kvs(db)) } else { None };
                    events.extend(batch.to_pb(*e as usize, prev));
                }
            }
        }
        for token in order {
            let (Some(w), Some(events)) = (self.watchers.get(&token), per.remove(&token)) else { continue };
            let (id, fragment) = (w.id, w.fragment);
            let parts = split_at_revisions(events, MERGE_BYTES);
            let n = parts.len();
            for (i, events) in parts.into_iter().enumerate() {
                // A part that is not the last one covers this watcher up to its last event.
                let at = if i + 1 == n {
                    revision
                } else {
                    events.last().and_then(|e| e.kv.as_ref()).map_or(revision, |kv| kv.mod_revision)
                };
                let resp = PbWatchResponse { header: self.header(at), watch_id: id, events, ..Default::default() };
                self.send_events(resp, fragment).await?;
            }
        }
        Ok(())
    }

    /// Handles every delivery queued now.
    async fn drain(&mut self) -> Result<(), Gone> {
        while let Ok(d) = self.inbox.try_recv() {
            self.deliver(d).await?;
        }
        Ok(())
    }

    /// Watchers the hub dropped become behind, after the deliveries queued before they were
    /// dropped (which hold their earlier revisions) are sent.
    async fn take_victims(&mut self) -> Result<(), Gone> {
        let list = std::mem::take(&mut *self.victims.list.lock());
        self.drain().await?;
        for (token, next_rev) in list {
            if let Some(w) = self.watchers.get_mut(&token) {
                w.behind = Some((next_rev, None));
            }
        }
        Ok(())
    }

    /// One catch-up step for every behind watcher; whether any moved.
    async fn catch_up(&mut self) -> Result<bool, Gone> {
        let behind: Vec<u64> = self.watchers.iter().filter(|(_, w)| w.behind.is_some()).map(|(t, _)| *t).collect();
        let mut moved = false;
        for token in behind {
            moved |= self.catch_up_one(token).await?;
        }
        Ok(moved)
    }

    async fn catch_up_one(&mut self, token: u64) -> Result<bool, Gone> {
        if self.try_join(token) {
            return Ok(true);
        }
        let sm = Arc::clone(&self.node.sm);
        let limit = self.hub.dispatched();
        let Some(w) = self.watchers.get_mut(&token) else { return Ok(true) };
        let Some((mut next_rev, after)) = w.behind else { return Ok(true) };
        let after = match after {
            Some(ts) => ts,
            None => match sm.revision_ts(next_rev - 1) {
                Ok(ts) => ts,
                Err(first) => return self.cancel_compacted(token, first).await.map(|()| true),
            },
        };
        let commits = match event::read_commits(&sm.db, after, CATCH_UP_CHANGES) {
            Ok(changes) if changes.is_empty() => {
                w.behind = Some((next_rev, Some(after)));
                return Ok(false);
            }
            Ok(changes) => match decode(changes) {
                Ok(c) => c,
                Err(e) => {
                    let _ = self.out.send(Err(Status::internal(e.to_string()))).await;
                    return Err(Gone);
                }
            },
            Err(keeldb::Error::Compacted { .. }) | Err(keeldb::Error::FutureTimestamp { .. }) => {
                let first = sm.revision_ts(i64::MIN).err().unwrap_or(1);
                return self.cancel_compacted(token, first.max(next_rev + 1)).await.map(|()| true);
            }
            Err(e) => {
                let _ = self.out.send(Err(Status::unavailable(e.to_string()))).await;
                return Err(Gone);
            }
        };
        let mut events = Vec::new();
        let mut bytes = 0usize;
        let mut ts = after;
        let mut last_rev = next_rev - 1;
        for commit in &commits {
            let Some(batch) = &commit.batch else {
                ts = commit.ts;
                continue;
            };
            // Never ahead of the hub: a progress report covers every watcher of the stream,
            // and synced ones have nothing past the hub's revision yet.
            if batch.revision > limit || bytes >= CATCH_UP_BYTES {
                break;
            }
            ts = commit.ts;
            if batch.revision < next_rev {
                continue;
            }
            let prev = if w.prev_kv { Some(batch.prev_kvs(&sm.db)) } else { None };
            for (i, e) in batch.events.iter().enumerate() {
                if w.span.contains(&e.kv.key) && index::passes(w.no_put, w.no_delete, e.put) {
                    bytes += e.kv.key.len() + e.kv.value.len();
                    events.extend(batch.to_pb(i, prev));
                }
            }
            next_rev = batch.revision + 1;
            last_rev = batch.revision;
        }
        w.behind = Some((next_rev, Some(ts)));
        self.seen_rev = self.seen_rev.max(last_rev);
        if !events.is_empty() {
            w.quiet = false;
            let (id, fragment) = (w.id, w.fragment);
            let resp = PbWatchResponse { header: self.header(last_rev), watch_id: id, events, ..Default::default() };
            self.send_events(resp, fragment).await?;
        }
        self.try_join(token);
        Ok(true)
    }

    /// A revision every synced watcher of this stream has all its events up to, with every
    /// delivery up to it sent; `None` while a watcher is behind (or just became so).
    async fn synced_revision(&mut self) -> Result<Option<i64>, Gone> {
        // Read before draining: every delivery up to `dispatched` is in the inbox by then, and
        // every victim up to it in the list.
        let dispatched = self.hub.dispatched();
        self.drain().await?;
        if !self.victims.list.lock().is_empty() || self.watchers.values().any(|w| w.behind.is_some()) {
            return Ok(None);
        }
        Ok(Some(dispatched.max(self.seen_rev)))
    }

    /// Answers a progress request once every watcher is synced (watch id -1, as etcd).
    async fn progress_all(&mut self) -> Result<(), Gone> {
        let Some(rev) = self.synced_revision().await? else { return Ok(()) };
        if self.watchers.values().any(|w| rev < w.start_rev) {
            return Ok(());
        }
        self.progress_pending = false;
        self.send(PbWatchResponse { header: self.header(rev), watch_id: -1, ..Default::default() }).await
    }

    /// Periodic progress for `progress_notify` watchers that got no event since the last tick.
    async fn progress_tick(&mut self) -> Result<(), Gone> {
        if !self.watchers.values().any(|w| w.progress_notify) {
            return Ok(());
        }
        let Some(rev) = self.synced_revision().await? else { return Ok(()) };
        let due: Vec<i64> = self
            .watchers
            .values()
            .filter(|w| w.progress_notify && w.quiet && rev >= w.start_rev)
            .map(|w| w.id)
            .collect();
        for w in self.watchers.values_mut() {
            w.quiet = true;
        }
        for id in due {
            self.send(PbWatchResponse { header: self.header(rev), watch_id: id, ..Default::default() }).await?;
        }
        Ok(())
    }
}

/// Splits one watcher's events (in revision order) into parts of about `max` bytes, only
/// between revisions: a revision's events always travel in one response (unless the watcher
/// asked for fragments).
fn split_at_revisions(events: Vec<PbEvent>, max: usize) -> Vec<Vec<PbEvent>> {
    let mut parts = Vec::new();
    let mut part: Vec<PbEvent> = Vec::new();
    let mut bytes = 0usize;
    let rev = |e: &PbEvent| e.kv.as_ref().map_or(0, |kv| kv.mod_revision);
    for e in events {
        if bytes >= max && part.last().is_some_and(|last| rev(last) != rev(&e)) {
            parts.push(std::mem::take(&mut part));
            bytes = 0;
        }
        bytes += e.kv.as_ref().map_or(0, |kv| kv.key.len() + kv.value.len());
        part.push(e);
    }
    if !part.is_empty() || parts.is_empty() {
        parts.push(part);
    }
    parts
}

/// Key and value bytes a delivery carries to this stream's watchers.
fn delivery_bytes(d: &Delivery) -> usize {
    d.hits
        .iter()
        .flat_map(|h| h.events.iter())
        .filter_map(|(b, e)| d.batches.get(*b as usize).and_then(|b| b.events.get(*e as usize)))
        .map(|e| e.kv.key.len() + e.kv.value.len())
        .sum()
}

/// A create request's fields (the generated type is not re-exported by name).
struct Create {
    key: Vec<u8>,
    range_end: Vec<u8>,
    start_revision: i64,
    watch_id: i64,
    prev_kv: bool,
    progress_notify: bool,
    fragment: bool,
}
