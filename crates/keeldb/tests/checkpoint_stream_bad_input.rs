//! Bad checkpoint streams: truncated, bit-flipped, wrong magic, longer than declared or than
//! the limit, bytes after the footer, a digest or counts that disagree with the blocks, a key
//! or a table twice. Each is a typed error, and the installing store is left exactly as it was:
//! the same digest, the same contents, the same files with the same bytes, and it still commits.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::*;
use keeldb::{Database, Error, InstallOptions, StateDigest};

/// CRC32C (Castagnoli), bitwise: the tests craft streams whose checksums are right and whose
/// contents are wrong.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

fn valid_stream() -> Vec<u8> {
    let d = TestDir::new();
    let a = open(&d.path());
    for i in 0..2000u32 {
        put(&a, &format!("t{}", i % 3), &i.to_be_bytes(), &[i as u8; 300]);
    }
    let mut stream = Vec::new();
    a.export_checkpoint(&mut stream).unwrap();
    a.close().unwrap();
    stream
}

/// A stream of one block holding `records`, with a footer whose CRC is right.
fn crafted(records: &[u8], tables: u64, entries: u64, digest: u128) -> Vec<u8> {
    crafted_at(5, records, tables, entries, digest)
}

fn crafted_at(ts: u64, records: &[u8], tables: u64, entries: u64, digest: u128) -> Vec<u8> {
    let mut s = b"KEELCKP\0".to_vec();
    s.extend_from_slice(&1u32.to_le_bytes());
    s.extend_from_slice(&9u32.to_le_bytes());
    s.extend_from_slice(&ts.to_le_bytes());
    s.resize(60, 0);
    let crc = crc32c(&s);
    s.extend_from_slice(&crc.to_le_bytes());
    s.extend_from_slice(&(records.len() as u32).to_le_bytes());
    s.extend_from_slice(&crc32c(records).to_le_bytes());
    s.extend_from_slice(records);
    let mut f = b"KEELCKPF".to_vec();
    for v in [ts, tables, entries, 1] {
        f.extend_from_slice(&v.to_le_bytes());
    }
    f.extend_from_slice(&digest.to_le_bytes());
    f.resize(60, 0);
    let crc = crc32c(&f);
    f.extend_from_slice(&crc.to_le_bytes());
    s.extend_from_slice(&f);
    s
}

fn table_record(id: u32, name: &str) -> Vec<u8> {
    let mut r = vec![1];
    r.extend_from_slice(&id.to_le_bytes());
    r.extend_from_slice(&(name.len() as u32).to_le_bytes());
    r.extend_from_slice(name.as_bytes());
    r
}

fn entry_record(id: u32, key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut r = vec![2];
    r.extend_from_slice(&id.to_le_bytes());
    for b in [key, value] {
        r.extend_from_slice(&(b.len() as u32).to_le_bytes());
        r.extend_from_slice(b);
    }
    r
}

/// Everything an install could change: digest, contents, and every file's name and bytes.
type Fingerprint = (StateDigest, Vec<(Vec<u8>, Vec<u8>)>, BTreeMap<String, Vec<u8>>);

fn fingerprint(db: &Database, dir: &Path) -> Fingerprint {
    let files = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().into_string().unwrap(), std::fs::read(e.path()).unwrap())
        })
        .collect();
    (db.digest(), scan_all(db, "b"), files)
}

/// Installs `stream` into a store with state of its own (closed cleanly once, so it holds a
/// `CLOSED` marker); the install must fail with an error `check` accepts and leave the store
/// exactly as it was, and still able to commit.
fn refused(name: &str, stream: &[u8], options: InstallOptions, check: fn(&Error) -> bool) {
    let d = TestDir::new();
    let b = open(&d.path());
    for i in 0..50u32 {
        put(&b, "b", &i.to_be_bytes(), b"mine");
    }
    b.checkpoint().unwrap();
    put(&b, "b", b"after-checkpoint", b"x");
    // Closed cleanly and reopened: the fingerprint includes the `CLOSED` marker, which a
    // refused stream must leave in place.
    b.close().unwrap();
    let b = open(&d.path());
    let before = fingerprint(&b, &d.path());
    let err = b.install_checkpoint_with(&mut &stream[..], options).expect_err(name);
    assert!(check(&err), "{name}: unexpected error {err:?}");
    assert!(fingerprint(&b, &d.path()) == before, "{name}: the store changed");
    put(&b, "b", b"still", b"works");
    b.close().unwrap();
    let b = open(&d.path());
    assert_eq!(get(&b, "b", b"still").as_deref(), Some(&b"works"[..]), "{name}");
    assert_eq!(scan_all(&b, "b").len(), 52, "{name}");
}

fn corruption(e: &Error) -> bool {
    matches!(e, Error::Corruption { .. })
}
fn invalid(e: &Error) -> bool {
    matches!(e, Error::InvalidArgument(_))
}
fn either(e: &Error) -> bool {
    corruption(e) || invalid(e)
}

#[test]
fn truncated_streams_are_corruption() {
    let s = valid_stream();
    for cut in [0, 1, 63, 64, 70, 1000, s.len() / 2, s.len() - 64, s.len() - 1] {
        refused(&format!("cut at {cut}"), &s[..cut], InstallOptions::default(), corruption);
    }
}

#[test]
fn flipped_bits_anywhere_are_refused() {
    let s = valid_stream();
    let step = s.len() / 23;
    for offset in (0..s.len()).step_by(step).chain([8, 60, s.len() - 64, s.len() - 20, s.len() - 1]) {
        let mut bad = s.clone();
        bad[offset] ^= 0x10;
        refused(&format!("flip at {offset}"), &bad, InstallOptions::default(), either);
    }
}

#[test]
fn wrong_magic_and_trailing_bytes() {
    let s = valid_stream();
    let mut bad = s.clone();
    bad[..8].copy_from_slice(b"NOTKEEL\0");
    refused("wrong magic", &bad, InstallOptions::default(), corruption);
    refused(
        "not a checkpoint at all",
        b"hello, this is not a checkpoint stream",
        InstallOptions::default(),
        corruption,
    );
    let mut longer = s.clone();
    longer.extend_from_slice(b"more");
    refused("bytes after the footer", &longer, InstallOptions::default(), invalid);
}

#[test]
fn size_limits_and_declared_sizes() {
    let s = valid_stream();
    let n = s.len() as u64;
    let declared = |e: Option<u64>, max: u64| InstallOptions { expected_bytes: e, max_stream_bytes: max };
    refused("larger than declared", &s, declared(Some(n - 1), u64::MAX), invalid);
    refused("smaller than declared", &s, declared(Some(n + 1), u64::MAX), invalid);
    refused("larger than the limit", &s, declared(None, n / 2), invalid);
    refused("a tiny limit", &s, declared(None, 10), invalid);
    // A block length that claims far more than is ever sent fails at the end of the stream,
    // having allocated only what arrived.
    let mut lying = s[..64].to_vec();
    lying.extend_from_slice(&(60u32 << 20).to_le_bytes());
    lying.extend_from_slice(&[0; 4]);
    lying.extend_from_slice(&[7; 100]);
    refused("lying block length", &lying, InstallOptions::default(), corruption);
    let mut huge = s[..64].to_vec();
    huge.extend_from_slice(&u32::MAX.to_le_bytes());
    refused("block length above the maximum", &huge, InstallOptions::default(), corruption);
}

#[test]
fn checksummed_streams_with_wrong_contents_are_corruption() {
    let t = table_record(1, "t");
    let e1 = entry_record(1, b"k", b"v");
    let e2 = entry_record(1, b"k2", b"v2");
    let mut digest = StateDigest::default();
    digest.add("t", b"k", b"v");
    digest.add("t", b"k2", b"v2");
    let good = [t.clone(), e1.clone(), e2.clone()].concat();
    // The crafted stream itself is valid: it installs.
    let d = TestDir::new();
    let db = open(&d.path());
    let info = db.install_checkpoint(&mut &crafted(&good, 1, 2, digest.0)[..]).unwrap();
    assert_eq!((info.entries, db.digest()), (2, digest));
    db.close().unwrap();

    refused("timestamp out of range", &crafted_at(u64::MAX, &good, 1, 2, digest.0), InstallOptions::default(), invalid);
    // The largest timestamp a store uses is 2^63 - 2: a slot keeps a flag in the top bit.
    refused(
        "timestamp 2^63 - 1",
        &crafted_at((1 << 63) - 1, &good, 1, 2, digest.0),
        InstallOptions::default(),
        invalid,
    );
    refused("digest mismatch", &crafted(&good, 1, 2, digest.0 ^ 1), InstallOptions::default(), corruption);
    refused("count mismatch", &crafted(&good, 1, 3, digest.0), InstallOptions::default(), corruption);
    let mut twice = digest;
    twice.add("t", b"k", b"v");
    let dup_key = [t.clone(), e1.clone(), e1.clone(), e2.clone()].concat();
    refused("a key twice", &crafted(&dup_key, 1, 3, twice.0), InstallOptions::default(), corruption);
    let dup_table = [t.clone(), table_record(2, "t"), e1, e2].concat();
    refused("a table name twice", &crafted(&dup_table, 2, 2, digest.0), InstallOptions::default(), corruption);
    let orphan = [t, entry_record(3, b"k", b"v")].concat();
    refused("entry of an unknown table", &crafted(&orphan, 1, 1, 0), InstallOptions::default(), corruption);
}

/// Random damage (flips, cuts, insertions, repeated spans) through the public API: never a
/// panic, always a typed error, and the store unchanged after all of it.
#[test]
fn random_damage_is_always_refused_and_changes_nothing() {
    let s = valid_stream();
    let d = TestDir::new();
    let b = open(&d.path());
    put(&b, "b", b"k", b"v");
    let before = fingerprint(&b, &d.path());
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n as u64) as usize
    };
    for round in 0..300 {
        let mut bad = s.clone();
        match round % 4 {
            0 => {
                for _ in 0..1 + next(4) {
                    let at = next(bad.len());
                    bad[at] ^= 1 << next(8);
                }
            }
            1 => bad.truncate(next(bad.len())),
            2 => {
                let at = next(bad.len());
                let junk: Vec<u8> = (0..1 + next(64)).map(|_| next(256) as u8).collect();
                bad.splice(at..at, junk);
            }
            _ => {
                let (from, len) = (next(bad.len()), 1 + next(4096));
                let span = bad[from..(from + len).min(bad.len())].to_vec();
                let at = next(bad.len());
                bad.splice(at..at, span);
            }
        }
        let err = b.install_checkpoint(&mut bad.as_slice()).expect_err("damaged stream accepted");
        assert!(either(&err), "round {round}: {err:?}");
    }
    assert!(fingerprint(&b, &d.path()) == before);
    b.close().unwrap();
}

/// The fuzz entry point agrees with the real install on a valid stream and survives damage
/// (it runs the same reader; `fuzz/fuzz_targets/checkpoint_stream.rs` drives it).
#[test]
fn fuzz_entry_point_reads_valid_streams_and_refuses_damaged_ones() {
    let s = valid_stream();
    assert_eq!(keeldb::fuzz_api::checkpoint_stream(&s), Ok(2000));
    for cut in (0..s.len()).step_by(s.len() / 50) {
        assert!(keeldb::fuzz_api::checkpoint_stream(&s[..cut]).is_err());
    }
    for len in 0..200usize {
        let junk: Vec<u8> = (0..len).map(|i| (i * 31 + 7) as u8).collect();
        assert!(keeldb::fuzz_api::checkpoint_stream(&junk).is_err());
    }
}

/// A marker that fails its checksum is corruption at open, and `keel verify` refuses a store
/// with a marker (its files are half old, half new until an open finishes the install).
#[test]
fn a_damaged_install_marker_is_corruption_and_verify_refuses_a_pending_install() {
    let d = TestDir::new();
    let b = open(&d.path());
    put(&b, "b", b"k", b"v");
    b.close().unwrap();
    std::fs::write(d.path().join("INSTALL"), [0u8; 64]).unwrap();
    assert!(matches!(keeldb::verify(d.path()), Err(Error::InvalidArgument(_))));
    let err = Database::open(d.path(), opts(keeldb::Durability::Sync)).expect_err("opened with a bad marker");
    assert!(corruption(&err), "{err:?}");
    std::fs::remove_file(d.path().join("INSTALL")).unwrap();
    let b = open(&d.path());
    assert_eq!(get(&b, "b", b"k").as_deref(), Some(&b"v"[..]));
    b.close().unwrap();
}

/// Commits after an install count up from its timestamp, and none may pass the largest
/// timestamp a store uses (2^63 - 2; recovery refuses a log frame above it as corruption). So a
/// stream must leave room: one above 2^62 is refused, one at 2^62 installs, commits, reopens.
/// (A stream at 2^63 - 2 used to install, and its first commit wrote a frame no reopen took.)
#[test]
fn an_installed_timestamp_leaves_room_for_commits() {
    let good = [table_record(1, "t"), entry_record(1, b"k", b"v")].concat();
    let mut digest = StateDigest::default();
    digest.add("t", b"k", b"v");
    for ts in [(1u64 << 63) - 2, (1 << 62) + 1] {
        refused(&format!("timestamp {ts}"), &crafted_at(ts, &good, 1, 1, digest.0), InstallOptions::default(), invalid);
    }
    let d = TestDir::new();
    let db = open(&d.path());
    db.install_checkpoint(&mut &crafted_at(1 << 62, &good, 1, 1, digest.0)[..]).unwrap();
    let mut tx = db.begin_write().unwrap();
    tx.put("t", b"k2", b"v2").unwrap();
    assert_eq!(tx.commit().unwrap().ts, (1 << 62) + 1);
    db.close().unwrap();
    let db = open(&d.path());
    let rx = db.begin_read().unwrap();
    assert_eq!(rx.get("t", b"k").unwrap().as_deref(), Some(&b"v"[..]));
    assert_eq!(rx.get("t", b"k2").unwrap().as_deref(), Some(&b"v2"[..]));
    drop(rx);
    db.close().unwrap();
}
