//! Pipelined appends between members (`network::PeerClient::stream_append` and the stream mode
//! of `network::serve_peer`) against a scripted follower on loopback: answers come back in
//! order with several appends in flight and never more than the window, the stream ends on a
//! conflict, a partial success, a stopped Raft, a lost message or no progress, and only a
//! cleanly ended stream's connection is reused; garbage in stream mode ends that connection
//! and nothing else.
//!
//! Its own test binary: one test injects a loss on a link (each test uses its own member ids).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{Stream, StreamExt};
use keel_cluster::network::{
    faults, serve_peer, Discovered, Hello, PeerClient, PeerHandler, PeerRequest, PeerResponse, STREAM_IN_FLIGHT,
};
use keel_cluster::tls::PeerTls;
use keel_cluster::types::{LogId, Member, TypeConfig, Vote};
use openraft::base::BoxStream;
use openraft::errors::RPCError;
use openraft::impls::leader_id_adv::LeaderId;
use openraft::network::RPCOption;
use openraft::raft::{AppendEntriesRequest, StreamAppendError, StreamAppendResult};
use openraft::RaftNetworkV2;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const CLUSTER: u64 = 0xc1;
/// Generous: these are bounds on a loaded machine, not expected durations.
const LONG: Duration = Duration::from_secs(60);

/// How the scripted follower answers the appends of a stream.
#[derive(Clone, Copy)]
enum Script {
    /// Holds answers until `STREAM_IN_FLIGHT` appends are waiting (and a moment more, to see
    /// whether the leader sends past its window), then answers the oldest; all at the end.
    Window,
    /// Answers every append at once.
    Echo,
    /// Answers append `n` (from 1) with a conflict.
    ConflictAt(usize),
    /// Answers append `n` as durable only up to its `prev_log_id`.
    PartialAt(usize),
    /// Answers append `n` as a stopped Raft.
    FatalAt(usize),
    /// Answers `n` appends, then ends its answers as if Raft stopped taking input.
    StopAfter(usize),
    /// Answers `n` appends, then takes no more input but ends its answers only a moment
    /// later (the follower's reader sees the refusal first).
    DropInputAfter(usize),
    /// Takes appends and never answers.
    Silent,
}

struct Follower {
    script: Script,
    max_in_flight: Arc<AtomicUsize>,
}

impl PeerHandler for Follower {
    async fn handle(&self, _from: u64, _req: PeerRequest) -> PeerResponse {
        PeerResponse::Error("scripted follower: appends only".into())
    }
    fn snapshot_file(&self) -> std::io::Result<keel_cluster::snapshot_file::SnapshotFile> {
        Err(std::io::Error::other("scripted follower: appends only"))
    }
    async fn install_snapshot(
        &self,
        _vote: keel_cluster::types::Vote,
        _meta: keel_cluster::types::SnapshotMeta,
        _file: keel_cluster::snapshot_file::SnapshotFile,
    ) -> PeerResponse {
        PeerResponse::Error("scripted follower: appends only".into())
    }

    fn discover(&self, _peer_urls: &[String]) -> Discovered {
        Discovered::Unknown(String::new())
    }

    fn stream_append(
        &self,
        _from: u64,
        mut input: BoxStream<'static, AppendEntriesRequest<TypeConfig>>,
    ) -> BoxStream<'static, Result<StreamAppendResult<TypeConfig>, String>> {
        let (tx, rx) = mpsc::unbounded_channel();
        let (script, max) = (self.script, Arc::clone(&self.max_in_flight));
        tokio::spawn(async move {
            let mut waiting = VecDeque::new();
            let mut n = 0;
            loop {
                if let Script::Window = script {
                    let next = if waiting.len() >= STREAM_IN_FLIGHT {
                        // Anything past the window would arrive in this moment.
                        tokio::time::timeout(Duration::from_millis(100), input.next()).await.ok()
                    } else {
                        Some(input.next().await)
                    };
                    match next {
                        Some(Some(req)) => {
                            waiting.push_back(req);
                            max.fetch_max(waiting.len(), Ordering::SeqCst);
                        }
                        Some(None) => {
                            for req in waiting.drain(..) {
                                let _ = tx.send(Ok(Ok(last(&req))));
                            }
                            return;
                        }
                        None => {
                            let req = waiting.pop_front().unwrap();
                            let _ = tx.send(Ok(Ok(last(&req))));
                        }
                    }
                    continue;
                }
                if let Script::DropInputAfter(k) = script {
                    if n == k {
                        drop(input);
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        return;
                    }
                }
                let Some(req) = input.next().await else { return };
                n += 1;
                let answer = match script {
                    Script::ConflictAt(k) if k == n => Ok(Err(StreamAppendError::Conflict(req.prev_log_id.unwrap()))),
                    Script::PartialAt(k) if k == n => Ok(Ok(req.prev_log_id)),
                    Script::FatalAt(k) if k == n => Err("raft stopped (scripted)".to_string()),
                    Script::StopAfter(k) if n > k => return,
                    Script::Silent => {
                        tx.closed().await;
                        return;
                    }
                    _ => Ok(Ok(last(&req))),
                };
                let ends = !matches!(answer, Ok(Ok(_)));
                let _ = tx.send(answer);
                if ends {
                    return;
                }
            }
        });
        Box::pin(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
    }
}

fn log_id(index: u64) -> LogId {
    LogId::new(LeaderId { term: 1, node_id: 1 }, index)
}

/// An append of `n` blank entries after index `prev`.
fn append(prev: u64, n: u64) -> AppendEntriesRequest<TypeConfig> {
    use openraft::entry::RaftEntry;
    AppendEntriesRequest {
        vote: Vote::new_committed(1, 1),
        prev_log_id: Some(log_id(prev)),
        leader_commit: None,
        entries: (prev + 1..=prev + n).map(|i| keel_cluster::types::Entry::new_blank(log_id(i))).collect(),
    }
}

fn last(req: &AppendEntriesRequest<TypeConfig>) -> Option<LogId> {
    use openraft::entry::RaftEntry;
    req.entries.last().map(|e| e.log_id()).or(req.prev_log_id)
}

/// Appends `0..count`, each of 3 entries after the previous one.
fn appends(first_prev: u64, count: u64) -> Vec<AppendEntriesRequest<TypeConfig>> {
    (0..count).map(|i| append(first_prev + 3 * i, 3)).collect()
}

/// A scripted follower `to` on a loopback port: how many connections it accepted, and how
/// each ended.
struct Served {
    url: String,
    conns: Arc<AtomicUsize>,
    ended: mpsc::UnboundedReceiver<io::Result<()>>,
    max_in_flight: Arc<AtomicUsize>,
}

async fn follower(to: u64, script: Script) -> Served {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let conns = Arc::new(AtomicUsize::new(0));
    let max_in_flight = Arc::new(AtomicUsize::new(0));
    let handler = Arc::new(Follower { script, max_in_flight: Arc::clone(&max_in_flight) });
    let (done, ended) = mpsc::unbounded_channel();
    let counted = Arc::clone(&conns);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            let (handler, done) = (Arc::clone(&handler), done.clone());
            tokio::spawn(async move {
                let _ = done.send(serve_peer(stream, CLUSTER, to, handler).await);
            });
        }
    });
    Served { url, conns, ended, max_in_flight }
}

fn client(from: u64, to: u64, url: &str) -> PeerClient {
    let member = Member { name: "f".into(), peer_urls: vec![url.to_string()], client_urls: vec![] };
    PeerClient::new(CLUSTER, from, to, &member, PeerTls::default())
}

type Item = Result<StreamAppendResult<TypeConfig>, RPCError<TypeConfig>>;

/// Runs one stream of `reqs` to its end; every item, in order.
async fn run<S>(c: &mut PeerClient, reqs: S, ttl: Duration) -> Result<Vec<Item>, RPCError<TypeConfig>>
where
    S: Stream<Item = AppendEntriesRequest<TypeConfig>> + Send + Unpin + 'static,
{
    let answers = c.stream_append(reqs, RPCOption::new(ttl)).await?;
    Ok(tokio::time::timeout(LONG, answers.collect::<Vec<_>>()).await.expect("the stream ended"))
}

fn ok_ids(items: &[Item]) -> Vec<Option<LogId>> {
    items.iter().map(|i| *i.as_ref().unwrap().as_ref().unwrap()).collect()
}

#[tokio::test]
async fn answers_come_in_order_with_a_full_window_in_flight_and_a_clean_end_keeps_the_connection() {
    let f = follower(2, Script::Window).await;
    let mut c = client(1, 2, &f.url);
    let reqs = appends(0, 3 * STREAM_IN_FLIGHT as u64 + 5);
    let want: Vec<_> = reqs.iter().map(last).collect();
    // A leader waiting for each answer before the next append would never fill the window
    // and this would hang until the timeout.
    let items = run(&mut c, futures_util::stream::iter(reqs), Duration::from_secs(20)).await.unwrap();
    assert_eq!(ok_ids(&items), want);
    assert_eq!(f.max_in_flight.load(Ordering::SeqCst), STREAM_IN_FLIGHT, "appends waiting at the follower at most");
    // Heartbeats are one-append streams: after a clean end the same connection carries the next.
    for i in 0..3 {
        let items =
            run(&mut c, futures_util::stream::iter(vec![append(500 + i, 0)]), Duration::from_secs(20)).await.unwrap();
        assert_eq!(ok_ids(&items), vec![Some(log_id(500 + i))]);
    }
    assert_eq!(f.conns.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_idle_stream_is_not_a_stalled_one() {
    let f = follower(4, Script::Echo).await;
    let mut c = client(3, 4, &f.url);
    let ttl = Duration::from_millis(400);
    let (tx, rx) = mpsc::unbounded_channel();
    let mut answers =
        c.stream_append(tokio_stream::wrappers::UnboundedReceiverStream::new(rx), RPCOption::new(ttl)).await.unwrap();
    for i in 0..3u64 {
        // The leader has nothing to send for twice the progress timeout while the answers
        // are awaited: nothing is outstanding, so that is no failure.
        let send = async {
            tokio::time::sleep(ttl * 2).await;
            tx.send(append(10 * i, 2)).unwrap();
        };
        let (got, ()) = tokio::join!(tokio::time::timeout(LONG, answers.next()), send);
        assert_eq!(got.unwrap().unwrap().unwrap().unwrap(), Some(log_id(10 * i + 2)));
    }
    drop(tx);
    assert!(tokio::time::timeout(LONG, answers.next()).await.unwrap().is_none());
}

#[tokio::test]
async fn a_conflict_ends_the_stream_and_the_next_one_uses_a_new_connection() {
    let mut f = follower(6, Script::ConflictAt(3)).await;
    let mut c = client(5, 6, &f.url);
    let reqs = appends(0, 10);
    let items = run(&mut c, futures_util::stream::iter(reqs.clone()), Duration::from_secs(20)).await.unwrap();
    assert_eq!(items.len(), 3, "{items:?}");
    assert_eq!(ok_ids(&items[..2]), vec![last(&reqs[0]), last(&reqs[1])]);
    match &items[2] {
        Ok(Err(StreamAppendError::Conflict(at))) => assert_eq!(Some(*at), reqs[2].prev_log_id),
        other => panic!("{other:?}"),
    }
    // The follower closed the connection after the conflict (not an error on its side).
    assert!(tokio::time::timeout(LONG, f.ended.recv()).await.unwrap().unwrap().is_ok());
    // Replication goes on from the conflict on a fresh connection.
    let items = run(&mut c, futures_util::stream::iter(appends(0, 2)), Duration::from_secs(20)).await.unwrap();
    assert_eq!(items.len(), 2);
    assert!(items.iter().all(|i| matches!(i, Ok(Ok(_)))));
    assert_eq!(f.conns.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_partial_success_ends_the_stream() {
    let f = follower(8, Script::PartialAt(2)).await;
    let mut c = client(7, 8, &f.url);
    let reqs = appends(0, 10);
    let items = run(&mut c, futures_util::stream::iter(reqs.clone()), Duration::from_secs(20)).await.unwrap();
    // The second append is durable only up to its prev: nothing after it can be claimed.
    assert_eq!(ok_ids(&items), vec![last(&reqs[0]), reqs[1].prev_log_id]);
    let items = run(&mut c, futures_util::stream::iter(appends(3, 1)), Duration::from_secs(20)).await.unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(f.conns.load(Ordering::SeqCst), 2, "the connection of a cut-short stream is not reused");
}

#[tokio::test]
async fn a_stopped_raft_or_answers_ending_early_fail_the_stream() {
    let f = follower(10, Script::FatalAt(2)).await;
    let mut c = client(9, 10, &f.url);
    let items = run(&mut c, futures_util::stream::iter(appends(0, 10)), Duration::from_secs(20)).await.unwrap();
    assert_eq!(items.len(), 2, "{items:?}");
    assert!(matches!(items[0], Ok(Ok(_))));
    assert!(matches!(&items[1], Err(RPCError::Network(e)) if e.to_string().contains("scripted")), "{items:?}");

    let f = follower(12, Script::StopAfter(2)).await;
    let mut c = client(11, 12, &f.url);
    let items = run(&mut c, futures_util::stream::iter(appends(0, 10)), Duration::from_secs(20)).await.unwrap();
    assert_eq!(items.len(), 3, "{items:?}");
    assert!(matches!(&items[2], Err(RPCError::Network(e)) if e.to_string().contains("unanswered")), "{items:?}");
}

#[tokio::test]
async fn no_answer_within_the_progress_timeout_fails_the_stream() {
    let f = follower(14, Script::Silent).await;
    let mut c = client(13, 14, &f.url);
    let ttl = Duration::from_millis(400);
    let started = Instant::now();
    let items = run(&mut c, futures_util::stream::iter(appends(0, 3)), ttl).await.unwrap();
    assert_eq!(items.len(), 1, "{items:?}");
    assert!(matches!(&items[0], Err(RPCError::Network(e)) if e.to_string().contains("in time")), "{items:?}");
    assert!(started.elapsed() < LONG / 2);
    // The next stream does not reuse the stalled connection.
    let _ = run(&mut c, futures_util::stream::iter(appends(0, 1)), ttl).await;
    assert_eq!(f.conns.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_lost_append_ends_the_stream_at_once() {
    let f = follower(16, Script::Echo).await;
    let mut c = client(15, 16, &f.url);
    faults::set_loss(15, 16, 1.0);
    let started = Instant::now();
    // The progress timeout is long: the loss must end the stream, not the wait for an answer.
    let items = run(&mut c, futures_util::stream::iter(appends(0, 3)), LONG).await.unwrap();
    faults::set_loss(15, 16, 0.0);
    assert_eq!(items.len(), 1, "{items:?}");
    assert!(matches!(&items[0], Err(RPCError::Network(e)) if e.to_string().contains("lost")), "{items:?}");
    assert!(started.elapsed() < LONG / 4, "{:?}", started.elapsed());
    let items = run(&mut c, futures_util::stream::iter(appends(0, 3)), LONG).await.unwrap();
    assert_eq!(items.len(), 3);
    assert!(items.iter().all(|i| matches!(i, Ok(Ok(_)))));
}

/// A raw connection in stream mode.
async fn raw_stream_mode(url: &str, from: u64, to: u64) -> TcpStream {
    let mut s = TcpStream::connect(url.trim_start_matches("http://")).await.unwrap();
    let hello = Hello { magic: 0x4b45_454c_5045_4552, cluster_id: CLUSTER, from, to };
    keel_cluster::network::write_frame(&mut s, &hello).await.unwrap();
    keel_cluster::network::write_frame(&mut s, &PeerRequest::StreamAppend).await.unwrap();
    s
}

#[tokio::test]
async fn a_stream_the_follower_stopped_taking_is_not_taken_for_requests_after_it() {
    use keel_cluster::network::{read_frame, write_frame, StreamFrame, StreamReply};
    let f = follower(20, Script::DropInputAfter(2)).await;
    let mut s = raw_stream_mode(&f.url, 19, 20).await;
    // The leader has not ended its stream: whatever it sent after the follower stopped taking
    // appends must not be read as requests on the same connection.
    let reqs = appends(0, 4);
    let mut replies = Vec::new();
    for req in &reqs[..2] {
        write_frame(&mut s, &StreamFrame::Append(req.clone())).await.unwrap();
    }
    for _ in 0..2 {
        let r = tokio::time::timeout(LONG, read_frame::<StreamReply>(&mut s)).await.unwrap().unwrap();
        replies.push(format!("{r:?}"));
    }
    // The follower has stopped taking appends by now; these two arrive after that.
    tokio::time::sleep(Duration::from_millis(50)).await;
    for req in &reqs[2..] {
        write_frame(&mut s, &StreamFrame::Append(req.clone())).await.unwrap();
    }
    let end = loop {
        match tokio::time::timeout(LONG, read_frame::<StreamReply>(&mut s)).await.unwrap() {
            Ok(r) => replies.push(format!("{r:?}")),
            Err(e) => break e,
        }
    };
    assert_eq!(replies.len(), 3, "{replies:?}");
    assert!(replies[2].starts_with("End"), "{replies:?}");
    assert_eq!(end.kind(), io::ErrorKind::UnexpectedEof, "the follower closed the connection: {end}");
}

#[tokio::test]
async fn garbage_or_an_oversized_frame_in_stream_mode_ends_only_that_connection() {
    let mut f = follower(18, Script::Echo).await;
    let mut s = raw_stream_mode(&f.url, 17, 18).await;
    s.write_all(&[5, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff]).await.unwrap();
    let e = tokio::time::timeout(LONG, f.ended.recv()).await.unwrap().unwrap().unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");

    let mut s = raw_stream_mode(&f.url, 17, 18).await;
    let too_long = (keel_cluster::network::MAX_FRAME as u32 + 1).to_le_bytes();
    s.write_all(&too_long).await.unwrap();
    let e = tokio::time::timeout(LONG, f.ended.recv()).await.unwrap().unwrap().unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
    assert!(e.to_string().contains("over the limit"), "{e}");

    // The follower still serves streams.
    let mut c = client(17, 18, &f.url);
    let items = run(&mut c, futures_util::stream::iter(appends(0, 4)), Duration::from_secs(20)).await.unwrap();
    assert_eq!(items.len(), 4);
    assert!(items.iter().all(|i| matches!(i, Ok(Ok(_)))));
}
