//! `keel snapshot-restore` on snapshots saved from etcd (the checked-in fixtures of
//! `crates/keel-cluster/tests/data`): a good one makes a member's data directory at etcd's
//! revision; a damaged or cut one is a usage error naming what is wrong, and leaves nothing.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixture(version: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../keel-cluster/tests/data/etcd-{version}.snapshot"))
}

/// `keel snapshot-restore SNAPSHOT` for one member `m1` with its data in `data_dir`.
fn restore(snapshot: &Path, data_dir: &Path) -> Output {
    let peer = "http://127.0.0.1:2380";
    Command::new(env!("CARGO_BIN_EXE_keel"))
        .arg("snapshot-restore")
        .arg(snapshot)
        .args(["--name", "m1", "--initial-cluster", &format!("m1={peer}"), "--initial-advertise-peer-urls", peer])
        .arg("--data-dir")
        .arg(data_dir)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn etcd_snapshots_restore_at_etcds_revision() {
    for version in ["3.6.16", "3.4.23"] {
        let dir = tempfile::tempdir().unwrap();
        let out = restore(&fixture(version), &dir.path().join("d"));
        assert_eq!(out.status.code(), Some(0), "{version}: {}", text(&out));
        assert!(text(&out).contains("revision 131"), "{version}: {}", text(&out));
        assert!(dir.path().join("d/member").is_dir());
    }
}

#[test]
fn a_damaged_or_cut_etcd_snapshot_is_a_usage_error_that_says_why() {
    let good = std::fs::read(fixture("3.6.16")).unwrap();
    let mut flipped = good.clone();
    flipped[5000] ^= 0x10;
    let cases: [(&str, Vec<u8>, &str); 2] =
        [("flipped", flipped, "checksum mismatch"), ("cut", good[..20_480].to_vec(), "truncated")];
    for (what, bytes, says) in cases {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("snapshot");
        std::fs::write(&file, bytes).unwrap();
        let out = restore(&file, &dir.path().join("d"));
        assert_eq!(out.status.code(), Some(2), "{what}: {}", text(&out));
        assert!(text(&out).contains(says), "{what}: {}", text(&out));
        assert!(!dir.path().join("d").exists(), "{what}: nothing left behind");
    }
}
