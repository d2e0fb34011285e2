//! Automatic compaction (`--auto-compaction-*`): the leader compacts through the log, every
//! member reports the same compacted revision, reads below it fail with ErrCompacted, reads
//! inside the retention still work, and `Status` reports what history holds.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing, clippy::panic)]

use std::time::{Duration, Instant};

use etcd_client::{Client, GetOptions};
use keel_cluster::compactor::AutoCompaction;
use keel_cluster::status_client::history_status;
use keel_cluster::Server;

mod common;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_leader_compacts_to_keep_the_retained_revisions() {
    let ip = common::loopback_ip(62);
    let dir = tempfile::tempdir().unwrap();
    let names = ["c1", "c2", "c3"];
    let mut servers = Vec::new();
    for i in 0..3 {
        let mut cfg = common::member_config(dir.path(), "http", &ip, (24830, 24840), &names, i, "compaction");
        cfg.auto_compaction = AutoCompaction::Revisions(10);
        cfg.auto_compaction_interval = Some(Duration::from_millis(200));
        servers.push(Some(common::start_retrying(cfg, 30).await));
    }
    common::wait_leader(&servers, 30).await;
    let urls: Vec<String> = (0..3).map(|i| format!("http://{ip}:{}", 24830 + i)).collect();
    let mut c = Client::connect(urls.clone(), None).await.unwrap();
    let mut last = 0;
    for n in 0..60 {
        last = c.put("k", format!("v{n}"), None).await.unwrap().header().unwrap().revision();
    }
    // Every member applies the leader's compaction: wait until each reports `last - 10` (no
    // writes come after the puts, so that is where every later tick stops too).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut compacted = Vec::new();
        for url in &urls {
            compacted.push(history_status(url, None, Duration::from_secs(3)).await.unwrap().compact_revision);
        }
        if compacted.iter().all(|c| *c == last - 10) {
            break;
        }
        assert!(Instant::now() < deadline, "members compacted to {compacted:?}, want {}", last - 10);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Below the compacted revision: ErrCompacted; inside the retention: the old value.
    let err = c.get("k", Some(GetOptions::new().with_revision(last - 20))).await.unwrap_err();
    assert!(err.to_string().contains("required revision has been compacted"), "{err}");
    let old = c.get("k", Some(GetOptions::new().with_revision(last - 5))).await.unwrap();
    assert_eq!(old.kvs()[0].value_str().unwrap(), "v54");
    let h = history_status(&urls[0], None, Duration::from_secs(3)).await.unwrap();
    assert!(h.changes > 0 && h.bytes > 0, "history held: {h:?}");
    // No compaction past what the retention allows, however long the compactor runs.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(history_status(&urls[1], None, Duration::from_secs(3)).await.unwrap().compact_revision, last - 10);
    for s in servers.into_iter().flatten() {
        Server::stop(s).await;
    }
}
