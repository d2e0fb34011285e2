//! History survives a restart (issue 36, item 8): after a member restarts, a Range at every
//! revision it served before (above the compaction) gives the same answer, a Watch from an old
//! revision replays the same events, and a compacted revision still answers ErrCompacted. Once
//! for a follower of three in-process members, once for a whole one-member cluster.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::path::Path;
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, WatchOptions};
use keel_cluster::status_client::history_status;
use keel_cluster::{ServeConfig, Server};

mod common;

/// A key-value as a Range answers it: key, value, create, mod revision, version.
type Kv = (String, String, i64, i64, i64);
/// A watch event: put or delete, key, value, mod revision.
type Event = (bool, String, String, i64);

fn config(dir: &Path, ip: &str, ports: (u16, u16), names: &[&str], i: usize) -> ServeConfig {
    common::member_config(dir, "http", ip, ports, names, i, "history-restart")
}

/// Puts and deletes over keys `k0..k7`, then a compaction at a revision in the middle.
/// Returns (compacted revision, last revision).
async fn write_history(c: &mut Client) -> (i64, i64) {
    let mut compact = 0;
    let mut last = 0;
    for n in 0..90u32 {
        let key = format!("k{}", n % 8);
        last = if n % 7 == 3 {
            c.delete(key, None).await.unwrap().header().unwrap().revision()
        } else {
            c.put(key, format!("v{n}"), None).await.unwrap().header().unwrap().revision()
        };
        if n == 30 {
            compact = last;
            c.compact(compact, None).await.unwrap();
        }
    }
    (compact, last)
}

async fn range_at(c: &mut Client, revision: i64) -> Result<Vec<Kv>, String> {
    let opts = GetOptions::new().with_prefix().with_revision(revision);
    let r = c.get("k", Some(opts)).await.map_err(|e| e.to_string())?;
    Ok(r.kvs()
        .iter()
        .map(|kv| {
            let (k, v) = (kv.key_str().unwrap().to_owned(), kv.value_str().unwrap().to_owned());
            (k, v, kv.create_revision(), kv.mod_revision(), kv.version())
        })
        .collect())
}

/// Every event from `from` through `last`, as a watch on the prefix replays them.
async fn watch_from(c: &mut Client, from: i64, last: i64) -> Vec<Event> {
    let opts = WatchOptions::new().with_prefix().with_start_revision(from);
    let mut ws = c.watch("k", Some(opts)).await.unwrap();
    let mut out = Vec::new();
    while out.last().is_none_or(|e: &Event| e.3 < last) {
        let r = tokio::time::timeout(Duration::from_secs(20), ws.message())
            .await
            .expect("a watch response in time")
            .unwrap()
            .expect("the stream is open");
        assert!(!r.canceled(), "watch from {from} canceled: {}", r.cancel_reason());
        for e in r.events() {
            let kv = e.kv().unwrap();
            let value = kv.value_str().unwrap().to_owned();
            out.push((e.event_type() == EventType::Put, kv.key_str().unwrap().to_owned(), value, kv.mod_revision()));
        }
    }
    out
}

/// What one member answers about the history: every Range from `compact` to `last`, and the
/// watch replay from just above the compaction.
async fn history(url: &str, compact: i64, last: i64) -> (Vec<Vec<Kv>>, Vec<Event>) {
    let mut c = Client::connect([url], None).await.unwrap();
    let mut ranges = Vec::new();
    for rev in compact..=last {
        ranges.push(range_at(&mut c, rev).await.unwrap_or_else(|e| panic!("range at {rev}: {e}")));
    }
    // Below the compaction: ErrCompacted, before and after the restart alike.
    let err = range_at(&mut c, compact - 1).await.unwrap_err();
    assert!(err.contains("required revision has been compacted"), "{err}");
    (ranges, watch_from(&mut c, compact + 1, last).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_follower_serves_the_revisions_it_served_before() {
    let ip = common::loopback_ip(81);
    let dir = tempfile::tempdir().unwrap();
    let names = ["h1", "h2", "h3"];
    let ports = (26110, 26120);
    let mut servers = Vec::new();
    for i in 0..3 {
        servers.push(Some(common::start_retrying(config(dir.path(), &ip, ports, &names, i), 30).await));
    }
    let leader = common::wait_leader(&servers, 30).await;
    let urls: Vec<String> = (0..3).map(|i| format!("http://{ip}:{}", ports.0 + i)).collect();
    let mut c = Client::connect(urls.clone(), None).await.unwrap();
    let (compact, last) = write_history(&mut c).await;
    let follower = servers.iter().flatten().position(|s| s.node.id != leader).unwrap();
    let before = history(&urls[follower], compact, last).await;
    assert_eq!(before.0.len() as i64, last - compact + 1);
    assert!(before.1.len() > 50, "events replayed: {}", before.1.len());

    Server::stop(servers[follower].take().unwrap()).await;
    servers[follower] = Some(common::start_retrying(config(dir.path(), &ip, ports, &names, follower), 30).await);
    common::wait_leader(&servers, 30).await;
    let after = history(&urls[follower], compact, last).await;
    assert!(before.0 == after.0, "ranges differ after the restart");
    assert_eq!(before.1, after.1, "watch replay differs after the restart");
    for s in servers.into_iter().flatten() {
        Server::stop(s).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_single_member_cluster_serves_the_revisions_it_served_before() {
    let ip = common::loopback_ip(82);
    let dir = tempfile::tempdir().unwrap();
    let names = ["solo"];
    let ports = (26130, 26140);
    let server = common::start_retrying(config(dir.path(), &ip, ports, &names, 0), 30).await;
    let url = format!("http://{ip}:{}", ports.0);
    let mut c = Client::connect([url.clone()], None).await.unwrap();
    let (compact, last) = write_history(&mut c).await;
    let before = history(&url, compact, last).await;
    let held = history_status(&url, None, Duration::from_secs(3)).await.unwrap();
    drop(c);
    Server::stop(server).await;

    let servers = [Some(common::start_retrying(config(dir.path(), &ip, ports, &names, 0), 30).await)];
    common::wait_leader(&servers, 30).await;
    let after = history(&url, compact, last).await;
    assert!(before.0 == after.0, "ranges differ after the restart");
    assert_eq!(before.1, after.1, "watch replay differs after the restart");
    // The stored compaction frees what it freed before the restart: the same feed is held, plus
    // the few entries applied since (the new leader's blank entry). Without it the feed held
    // every change since the store began again (about 90 more here).
    let held_after = history_status(&url, None, Duration::from_secs(3)).await.unwrap();
    assert_eq!(held_after.compact_revision, held.compact_revision);
    let since = held_after.changes.checked_sub(held.changes);
    assert!(since.is_some_and(|n| n <= 5), "history held before the restart {held:?}, after {held_after:?}");
    // New writes continue the revisions; the old ones stay readable beside them.
    let mut c = Client::connect([url.clone()], None).await.unwrap();
    let next = c.put("k0", "new", None).await.unwrap().header().unwrap().revision();
    assert_eq!(next, last + 1);
    assert_eq!(range_at(&mut c, last).await.unwrap(), after.0[after.0.len() - 1]);
    for s in servers.into_iter().flatten() {
        Server::stop(s).await;
    }
}
