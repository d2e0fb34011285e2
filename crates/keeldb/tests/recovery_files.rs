//! Recovery from damaged files on the real file system: torn tails are truncated and
//! reported; corruption anywhere else is a typed error from `open` and from `verify`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod common;
use std::os::unix::fs::FileExt;
use std::path::Path;

use common::*;
use keeldb::{Database, Durability, Error, Options};

const FRAME_HEADER: usize = 40;
const SEGMENT_HEADER: usize = 64;

/// A store with `n` single-put sync commits, closed without the clean-close mark's help
/// (the mark is just another frame; tests below cut or damage frames explicitly).
fn store_with(path: &Path, n: u32) {
    let db = open(path);
    for i in 0..n {
        put(&db, "t", format!("k{i:04}").as_bytes(), format!("value-{i}").as_bytes());
    }
    db.close().unwrap();
    // These tests model damage after a crash, not after a clean close: without the CLOSED
    // marker nothing but the frames themselves claims the log (recovery_damage_everywhere.rs
    // covers cleanly closed stores).
    std::fs::remove_file(path.join("CLOSED")).unwrap();
}

/// Offsets of the frames in a segment file (walking the length fields, up to the zeros that
/// follow the last frame of the newest segment).
fn frame_offsets(bytes: &[u8]) -> Vec<usize> {
    let mut out = Vec::new();
    let mut pos = SEGMENT_HEADER;
    while pos + FRAME_HEADER <= bytes.len() && bytes[pos..pos + 4] != [0; 4] {
        let len = u32::from_le_bytes(bytes[pos + 4..pos + 8].try_into().unwrap()) as usize;
        out.push(pos);
        pos += FRAME_HEADER + ((len + 7) & !7);
    }
    out
}

fn newest_segment(dir: &Path) -> std::path::PathBuf {
    // The newest segment after close is empty (header only); pick the newest with frames.
    files(dir, "wal-").into_iter().rev().find(|p| std::fs::metadata(p).unwrap().len() > SEGMENT_HEADER as u64).unwrap()
}

fn remove_empty_segments_after(dir: &Path, seg: &Path) {
    for p in files(dir, "wal-") {
        if p.as_path() > seg {
            std::fs::remove_file(p).unwrap();
        }
    }
}

fn count(db: &Database) -> usize {
    scan_all(db, "t").len()
}

/// A copy of the store's files as they are now (not the lock file): what an open after a crash
/// at this moment would see.
fn copy_store(from: &Path) -> TestDir {
    let to = TestDir::new();
    std::fs::create_dir_all(to.path()).unwrap();
    for p in files(from, "") {
        if p.file_name().unwrap() != "LOCK" {
            std::fs::copy(&p, to.path().join(p.file_name().unwrap())).unwrap();
        }
    }
    to
}

#[test]
fn torn_tail_is_truncated_and_reported() {
    let t = TestDir::new();
    store_with(&t.path(), 10);
    let seg = newest_segment(&t.path());
    remove_empty_segments_after(&t.path(), &seg);
    let bytes = std::fs::read(&seg).unwrap();
    let frames = frame_offsets(&bytes);
    // Cut the file in the middle of the last frame (the close mark) and then of a commit.
    let last_commit = frames[frames.len() - 2];
    std::fs::OpenOptions::new().write(true).open(&seg).unwrap().set_len((last_commit + 20) as u64).unwrap();
    let db = open(&t.path());
    let r = db.recovery_report();
    assert_eq!(r.torn_tail.as_ref().map(|(_, off)| *off), Some(last_commit as u64), "{r}");
    assert_eq!(r.bytes_truncated, 20);
    assert!(!r.clean_shutdown);
    assert_eq!(count(&db), 9, "only the torn commit is lost");
    // The report is appended to the recovery log.
    let log = std::fs::read_to_string(t.path().join("recovery.log")).unwrap();
    assert!(log.lines().last().unwrap().contains("\"bytes_truncated\":20"), "{log}");
    db.close().unwrap();
    // And the store is clean afterwards.
    let db = open(&t.path());
    assert!(db.recovery_report().torn_tail.is_none());
    assert_eq!(count(&db), 9);
}

/// The file offset just past the last frame of a segment.
fn frames_end(bytes: &[u8]) -> usize {
    let frames = frame_offsets(bytes);
    let last = *frames.last().unwrap();
    let len = u32::from_le_bytes(bytes[last + 4..last + 8].try_into().unwrap()) as usize;
    last + FRAME_HEADER + ((len + 7) & !7)
}

#[test]
fn garbage_appended_after_the_last_frame_is_a_torn_tail() {
    let t = TestDir::new();
    store_with(&t.path(), 5);
    let seg = newest_segment(&t.path());
    remove_empty_segments_after(&t.path(), &seg);
    let len = std::fs::metadata(&seg).unwrap().len();
    let end = frames_end(&std::fs::read(&seg).unwrap());
    std::fs::OpenOptions::new().write(true).open(&seg).unwrap().write_all_at(&[0xAB; 100], end as u64).unwrap();
    let db = open(&t.path());
    // The garbage and the preallocated zeros after it are cut.
    assert_eq!(db.recovery_report().bytes_truncated, len.max(end as u64 + 100) - end as u64);
    assert_eq!(count(&db), 5);
}

#[test]
fn garbage_after_preallocated_zeros_is_a_torn_tail() {
    let t = TestDir::new();
    store_with(&t.path(), 5);
    let seg = newest_segment(&t.path());
    remove_empty_segments_after(&t.path(), &seg);
    let end = frames_end(&std::fs::read(&seg).unwrap()) as u64;
    let len = std::fs::metadata(&seg).unwrap().len();
    assert!(len > end + 4096, "the newest segment holds preallocated zeros ({len} bytes, frames end at {end})");
    // One nonzero byte at the very end: the tail is no longer all zeros.
    std::fs::OpenOptions::new().write(true).open(&seg).unwrap().write_all_at(&[1], len - 1).unwrap();
    let db = open(&t.path());
    let r = db.recovery_report();
    assert_eq!(r.torn_tail.as_ref().map(|(_, off)| *off), Some(end), "{r}");
    assert_eq!(r.bytes_truncated, len - end);
    assert_eq!(count(&db), 5);
    drop(db);
    assert!(std::fs::metadata(&seg).unwrap().len() >= end);
}

#[test]
fn preallocated_zeros_end_the_log_without_a_tear_and_are_kept() {
    let t = TestDir::new();
    store_with(&t.path(), 5);
    let seg = newest_segment(&t.path());
    remove_empty_segments_after(&t.path(), &seg);
    let len = std::fs::metadata(&seg).unwrap().len();
    let db = open(&t.path());
    let r = db.recovery_report();
    assert!(r.torn_tail.is_none() && r.bytes_truncated == 0, "{r}");
    assert_eq!(count(&db), 5);
    put(&db, "t", b"k-after", b"v");
    drop(db);
    assert_eq!(std::fs::metadata(&seg).unwrap().len(), len, "the zeros were kept and written into");
    assert!(keeldb::verify(t.path()).unwrap().is_intact());
}

#[test]
fn a_store_whose_segments_end_at_their_last_frame_opens_unchanged() {
    // The layout before preallocation (and what a roll leaves): no zeros after the frames.
    let t = TestDir::new();
    store_with(&t.path(), 7);
    for seg in files(&t.path(), "wal-") {
        let bytes = std::fs::read(&seg).unwrap();
        if bytes.len() > SEGMENT_HEADER && bytes[SEGMENT_HEADER..SEGMENT_HEADER + 4] != [0; 4] {
            std::fs::OpenOptions::new().write(true).open(&seg).unwrap().set_len(frames_end(&bytes) as u64).unwrap();
        } else {
            std::fs::OpenOptions::new().write(true).open(&seg).unwrap().set_len(SEGMENT_HEADER as u64).unwrap();
        }
    }
    let db = open(&t.path());
    let r = db.recovery_report();
    assert!(r.torn_tail.is_none() && r.bytes_truncated == 0 && r.clean_shutdown, "{r}");
    assert_eq!(count(&db), 7);
    put(&db, "t", b"k-after", b"v");
    db.close().unwrap();
    assert_eq!(count(&open(&t.path())), 8);
}

/// The guard this checks: recovery cuts a tail that is not all zeros before writing resumes.
/// A `relaxed` power loss can keep frame 5 and lose frame 4 (its bytes stay zero in the
/// preallocated space). Were that tail kept, a new frame of frame 4's size would end exactly
/// where the old frame 5 starts, and the next recovery would replay frame 5: a commit that is
/// not in the recovered history.
#[test]
fn a_stale_frame_after_a_gap_is_never_replayed() {
    let t = TestDir::new();
    let relaxed = Options { durability: Durability::Relaxed, background_threads: false, ..Options::default() };
    let db = Database::open(t.path(), relaxed.clone()).unwrap();
    for i in 1..=5u32 {
        put(&db, "t", format!("k{i}").as_bytes(), b"old-value");
    }
    db.close().unwrap();
    std::fs::remove_file(t.path().join("CLOSED")).unwrap();
    let seg = newest_segment(&t.path());
    remove_empty_segments_after(&t.path(), &seg);
    let mut bytes = std::fs::read(&seg).unwrap();
    let frames = frame_offsets(&bytes);
    // Frames: create table + put k1 (one commit), k2, k3, k4, k5, the close mark.
    assert_eq!(frames.len(), 6);
    let (f4, f5, mark) = (frames[3], frames[4], frames[5]);
    bytes[mark..].fill(0); // the close mark never reached the disk
    bytes[f4..f5].fill(0); // nor did frame 4; frame 5 did
    std::fs::write(&seg, &bytes).unwrap();

    let db = Database::open(t.path(), opts(Durability::Sync)).unwrap();
    let r = db.recovery_report();
    assert_eq!(r.torn_tail.as_ref().map(|(_, off)| *off), Some(f4 as u64), "{r}");
    assert_eq!(r.discarded_frames, 1, "{r}");
    assert_eq!(count(&db), 3);
    // Same key and value sizes as the lost frame 4: the new frame ends where frame 5 began.
    put(&db, "t", b"k4", b"new-value");
    // A process crash now: what the next open sees is exactly the files as they are.
    let crashed = copy_store(&t.path());
    drop(db);
    let db = Database::open(crashed.path(), opts(Durability::Sync)).unwrap();
    assert_eq!(get(&db, "t", b"k4").as_deref(), Some(&b"new-value"[..]));
    assert_eq!(get(&db, "t", b"k5"), None, "the stale frame 5 was replayed");
    assert_eq!(count(&db), 4);
}

#[test]
fn flipped_byte_mid_log_is_corruption_naming_file_and_offset() {
    let t = TestDir::new();
    store_with(&t.path(), 10);
    let seg = newest_segment(&t.path());
    let mut bytes = std::fs::read(&seg).unwrap();
    let frames = frame_offsets(&bytes);
    let victim = frames[3];
    bytes[victim + FRAME_HEADER + 6] ^= 0x01;
    std::fs::write(&seg, &bytes).unwrap();
    let before: Vec<_> = files(&t.path(), "").iter().map(|p| (p.clone(), std::fs::read(p).unwrap())).collect();
    let err = Database::open(t.path(), opts(Durability::Sync)).unwrap_err();
    match &err {
        Error::Corruption { location, .. } => {
            assert_eq!(location.path, seg);
            assert_eq!(location.offset, victim as u64);
        }
        other => panic!("expected corruption, got {other}"),
    }
    // The failed open changed nothing.
    for (p, content) in before {
        if p.file_name().unwrap() != "LOCK" {
            assert_eq!(std::fs::read(&p).unwrap(), content, "{} changed", p.display());
        }
    }
    let report = keeldb::verify(t.path()).unwrap();
    assert!(!report.is_intact());
    assert!(report.to_string().contains(&victim.to_string()), "{report}");
}

/// Recovery reads a segment 1 MiB at a time (`wal::SEGMENT_WINDOW`); frames that straddle a
/// window's end are replayed whole, and damage to one is found at its offset.
#[test]
fn a_log_longer_than_a_read_window_replays_whole_and_damage_across_a_window_end_is_found() {
    const WINDOW: usize = 1 << 20;
    let value = |i: u32| vec![(i % 251) as u8; 9_000 + (i as usize * 13) % 2_000];
    let t = TestDir::new();
    {
        let db = open(&t.path());
        for i in 0..400u32 {
            put(&db, "t", format!("k{i:04}").as_bytes(), &value(i));
        }
        db.close().unwrap();
        std::fs::remove_file(t.path().join("CLOSED")).unwrap();
    }
    let seg = newest_segment(&t.path());
    let clean = std::fs::read(&seg).unwrap();
    assert!(clean.len() > 3 * WINDOW, "the log spans several windows");
    {
        let db = Database::open(t.path(), opts(Durability::Sync)).unwrap();
        for i in 0..400u32 {
            assert_eq!(get(&db, "t", format!("k{i:04}").as_bytes()), Some(value(i)), "k{i:04}");
        }
        db.close().unwrap();
        std::fs::remove_file(t.path().join("CLOSED")).unwrap();
        remove_empty_segments_after(&t.path(), &seg);
    }
    let frames = frame_offsets(&clean);
    for boundary in [WINDOW, 2 * WINDOW] {
        // The frame that straddles the boundary, damaged on either side of it.
        let victim = *frames.iter().rev().find(|&&f| f < boundary).unwrap();
        for at in [boundary - 1, boundary + 1] {
            let mut bytes = clean.clone();
            bytes[at] ^= 0x01;
            std::fs::write(&seg, &bytes).unwrap();
            match Database::open(t.path(), opts(Durability::Sync)) {
                Err(Error::Corruption { location, .. }) => {
                    assert_eq!((location.path.as_path(), location.offset), (seg.as_path(), victim as u64), "byte {at}")
                }
                other => panic!("byte {at}: expected corruption, got {:?}", other.map(|_| ())),
            }
        }
    }
}

#[test]
fn zeroed_middle_of_the_log_is_corruption() {
    let t = TestDir::new();
    store_with(&t.path(), 10);
    let seg = newest_segment(&t.path());
    let mut bytes = std::fs::read(&seg).unwrap();
    let frames = frame_offsets(&bytes);
    for b in &mut bytes[frames[2]..frames[4]] {
        *b = 0;
    }
    std::fs::write(&seg, &bytes).unwrap();
    assert!(matches!(Database::open(t.path(), opts(Durability::Sync)), Err(Error::Corruption { .. })));
}

#[test]
fn a_deleted_segment_is_corruption() {
    let t = TestDir::new();
    let path = t.path();
    {
        let db =
            Database::open(&path, Options { wal_segment_bytes: 4096, background_threads: false, ..Options::default() })
                .unwrap();
        for i in 0..200u32 {
            put(&db, "t", &i.to_be_bytes(), &[7u8; 100]);
        }
        db.close().unwrap();
    }
    let segs = files(&path, "wal-");
    assert!(segs.len() > 3, "segments rolled");
    std::fs::remove_file(&segs[1]).unwrap();
    let err = Database::open(&path, opts(Durability::Sync)).unwrap_err();
    assert!(matches!(err, Error::Corruption { .. }), "{err}");
    assert!(err.to_string().contains("missing"), "{err}");
    // Deleting the oldest segment loses the start of history: also refused.
    let t2 = TestDir::new();
    let p2 = t2.path();
    {
        let db =
            Database::open(&p2, Options { wal_segment_bytes: 4096, background_threads: false, ..Options::default() })
                .unwrap();
        for i in 0..200u32 {
            put(&db, "t", &i.to_be_bytes(), &[7u8; 100]);
        }
        db.close().unwrap();
    }
    // Segment 1 is the empty one made at creation; remove it and the first holding commits.
    for p in files(&p2, "wal-").into_iter().take(2) {
        std::fs::remove_file(p).unwrap();
    }
    let err = Database::open(&p2, opts(Durability::Sync)).unwrap_err();
    assert!(err.to_string().contains("gone"), "{err}");
}

#[test]
fn corrupt_newest_checkpoint_falls_back_to_the_older_one_plus_wal() {
    let t = TestDir::new();
    let path = t.path();
    let db = open(&path);
    for i in 0..50u32 {
        put(&db, "t", &i.to_be_bytes(), b"a");
    }
    let c1 = db.checkpoint().unwrap();
    for i in 50..100u32 {
        put(&db, "t", &i.to_be_bytes(), b"b");
    }
    let c2 = db.checkpoint().unwrap();
    assert!(c2.ts > c1.ts);
    for i in 100..120u32 {
        put(&db, "t", &i.to_be_bytes(), b"c");
    }
    let digest = db.digest();
    db.close().unwrap();
    let mut bytes = std::fs::read(&c2.path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xFF;
    std::fs::write(&c2.path, &bytes).unwrap();
    assert!(!keeldb::verify(&path).unwrap().is_intact());
    let db = open(&path);
    let r = db.recovery_report();
    assert_eq!(r.checkpoint.as_ref().map(|(_, ts)| *ts), Some(c1.ts), "{r}");
    assert_eq!(r.corrupt_checkpoints.len(), 1);
    assert_eq!(count(&db), 120);
    assert_eq!(db.digest(), digest);
    // The corrupt file was set aside, not deleted.
    assert!(files(&path, "checkpoint-").iter().any(|p| p.to_string_lossy().ends_with(".corrupt")));
}

#[test]
fn corrupt_checkpoint_without_the_wal_it_needs_is_an_error() {
    let t = TestDir::new();
    let path = t.path();
    let db = open(&path);
    for round in 0..3u32 {
        for i in 0..30u32 {
            put(&db, "t", &(round * 100 + i).to_be_bytes(), b"v");
        }
        db.checkpoint().unwrap();
    }
    db.close().unwrap();
    // Only the newest two checkpoints are kept; corrupt both.
    let ckpts = files(&path, "checkpoint-");
    assert_eq!(ckpts.len(), 2);
    for c in &ckpts {
        let mut b = std::fs::read(c).unwrap();
        b[70] ^= 1;
        std::fs::write(c, &b).unwrap();
    }
    let err = Database::open(&path, opts(Durability::Sync)).unwrap_err();
    assert!(matches!(err, Error::Corruption { .. }), "{err}");
}

#[test]
fn checkpoint_then_reopen_replays_only_the_tail() {
    let t = TestDir::new();
    let path = t.path();
    let db = open(&path);
    for i in 0..100u32 {
        put(&db, "t", &i.to_be_bytes(), b"v");
    }
    let c = db.checkpoint().unwrap();
    assert_eq!(c.entries, 100);
    for i in 100..110u32 {
        put(&db, "t", &i.to_be_bytes(), b"v");
    }
    let digest = db.digest();
    db.close().unwrap();
    let db = open(&path);
    let r = db.recovery_report();
    assert_eq!(r.checkpoint.as_ref().map(|(_, ts)| *ts), Some(c.ts));
    assert_eq!(r.frames_replayed, 10);
    assert_eq!(count(&db), 110);
    assert_eq!(db.digest(), digest);
    assert!(keeldb::verify(&path).is_err(), "verify refuses a store that is open (locked)");
    db.close().unwrap();
    let v = keeldb::verify(&path).unwrap();
    assert!(v.is_intact(), "{v}");
    assert_eq!(v.digest, Some(digest));
}

/// A store of small segments, a checkpoint after 200 commits, 10 more after it, closed.
fn store_with_covered_segments(path: &Path) -> (u64, keeldb::StateDigest) {
    let db = Database::open(path, Options { wal_segment_bytes: 4096, background_threads: false, ..Options::default() })
        .unwrap();
    for i in 0..200u32 {
        put(&db, "t", &i.to_be_bytes(), &[7u8; 100]);
    }
    let c = db.checkpoint().unwrap();
    for i in 200..210u32 {
        put(&db, "t", &i.to_be_bytes(), &[8u8; 100]);
    }
    let digest = db.digest();
    db.close().unwrap();
    (c.ts, digest)
}

#[test]
fn open_reads_only_the_headers_of_segments_the_checkpoint_covers_and_verify_reads_them_whole() {
    let t = TestDir::new();
    let path = t.path();
    let (ckpt_ts, digest) = store_with_covered_segments(&path);
    let segs = files(&path, "wal-");
    assert!(segs.len() > 5, "segments rolled");
    // Damage a frame in the second segment (the first holding commits), long before the checkpoint.
    let victim = &segs[1];
    let mut bytes = std::fs::read(victim).unwrap();
    let frames = frame_offsets(&bytes);
    assert!(frames.len() > 2);
    bytes[frames[1] + FRAME_HEADER + 3] ^= 0x10;
    std::fs::write(victim, &bytes).unwrap();

    let db = open(&path);
    let r = db.recovery_report().clone();
    assert_eq!(r.checkpoint.as_ref().map(|(_, ts)| *ts), Some(ckpt_ts));
    assert!(r.segments_covered >= 3, "{r}");
    assert_eq!(r.segments_covered + r.segments_scanned, segs.len() as u64, "{r}");
    assert_eq!(r.frames_replayed, 10, "{r}");
    assert_eq!(count(&db), 210);
    assert_eq!(db.digest(), digest);
    db.close().unwrap();

    // Verify reads every frame and finds the damage open did not need to read.
    let v = keeldb::verify(&path).unwrap();
    assert!(!v.is_intact(), "{v}");
    assert!(v.to_string().contains(&victim.display().to_string()), "{v}");
}

#[test]
fn a_damaged_header_of_a_covered_segment_is_still_corruption_at_open() {
    let t = TestDir::new();
    let path = t.path();
    store_with_covered_segments(&path);
    let segs = files(&path, "wal-");
    // A flipped bit in the header's start LSN: its checksum no longer matches. Open cannot
    // tell what the segment before it covers, reads both whole, and reports the header.
    let victim = &segs[2];
    let mut bytes = std::fs::read(victim).unwrap();
    bytes[24] ^= 0x01;
    std::fs::write(victim, &bytes).unwrap();
    let err = Database::open(&path, opts(Durability::Sync)).unwrap_err();
    match &err {
        Error::Corruption { location, reason } => {
            assert_eq!(&location.path, victim);
            assert!(reason.contains("checksum"), "{err}");
        }
        other => panic!("expected corruption, got {other}"),
    }
}

#[test]
fn automatic_checkpoints_bound_the_wal() {
    let t = TestDir::new();
    let path = t.path();
    let db = Database::open(
        &path,
        Options {
            durability: Durability::Relaxed,
            wal_segment_bytes: 64 * 1024,
            checkpoint_wal_bytes: 256 * 1024,
            ..Options::default()
        },
    )
    .unwrap();
    for i in 0..20_000u32 {
        put(&db, "t", &(i % 1000).to_be_bytes(), &[1u8; 100]);
    }
    // Give the background worker a moment to catch up.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while db.stats().checkpoint_ts.is_none() {
        assert!(std::time::Instant::now() < deadline, "no automatic checkpoint");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let wal = db.stats().wal_bytes;
    assert!(wal < 2_000_000, "WAL grew to {wal} bytes despite checkpoints");
    let digest = db.digest();
    db.close().unwrap();
    let db = open(&path);
    assert_eq!(count(&db), 1000);
    assert_eq!(db.digest(), digest);
}

#[test]
fn crash_after_creating_the_directory_reopens_as_new() {
    let t = TestDir::new();
    std::fs::create_dir_all(t.path()).unwrap();
    // Leftovers of a creation that crashed before the identity file was renamed in.
    std::fs::write(t.path().join("wal-0000000000000001.log"), [1u8; 10]).unwrap();
    std::fs::write(t.path().join("KEELDB.tmp"), [1u8; 3]).unwrap();
    let db = open(&t.path());
    put(&db, "t", b"k", b"v");
    db.close().unwrap();
    let db = open(&t.path());
    assert_eq!(get(&db, "t", b"k").as_deref(), Some(&b"v"[..]));
}

#[test]
fn torn_header_of_the_newest_segment_is_dropped() {
    let t = TestDir::new();
    store_with(&t.path(), 5);
    let segs = files(&t.path(), "wal-");
    let last = segs.last().unwrap();
    // Simulate a crash while creating the next segment: a partial header.
    let next_name = format!("wal-{:016}.log", segs.len() + 1);
    let mut partial = std::fs::read(last).unwrap();
    partial.truncate(30);
    std::fs::write(t.path().join(next_name), &partial).unwrap();
    let db = open(&t.path());
    assert!(db.recovery_report().torn_tail.is_some());
    assert_eq!(count(&db), 5);
}

/// A store written before 189d312 could hold a checkpoint ahead of its log: a power loss kept a
/// checkpoint at C and lost the frames of its last commits, the open resumed the log at its end E
/// and the next commit's frame (C + 1) followed frame E. Such a store must open, with every
/// commit, as long as the checkpoint that holds the gap is the one loaded; with that checkpoint
/// corrupt (an older one loaded), the gap is lost commits and the open must refuse it.
#[test]
fn a_log_gap_the_loaded_checkpoint_holds_is_accepted_and_no_other() {
    let t = TestDir::new();
    let path = t.path();
    let db = open(&path);
    for i in 0..5u32 {
        put(&db, "t", format!("k{i}").as_bytes(), b"v");
    }
    db.checkpoint().unwrap();
    put(&db, "t", b"k5", b"v");
    let seg = newest_segment(&path);
    let first_lost = put(&db, "t", b"k6", b"v");
    let last_lost = put(&db, "t", b"k7", b"v");
    let c2 = db.checkpoint().unwrap();
    assert_eq!(c2.ts, last_lost);
    db.close().unwrap();
    std::fs::remove_file(path.join("CLOSED")).unwrap();
    // The old bug's power loss: the frames of k6 and k7 never reached the disk, nor anything
    // after them (the segment the checkpoint started, with the close mark); the checkpoint
    // holding them did.
    remove_empty_segments_after(&path, &seg);
    let mut bytes = std::fs::read(&seg).unwrap();
    let frames = frame_offsets(&bytes);
    assert_eq!(frames.len(), 3, "k5, k6, k7");
    bytes[frames[1]..].fill(0); // as the preallocated space was before they were written
    std::fs::write(&seg, &bytes).unwrap();
    // The open the old bug allowed, and the commit that made the gap: its frame follows k5's in
    // the same segment.
    let db = open(&path);
    assert_eq!(count(&db), 8);
    let after = put(&db, "t", b"k8", b"v");
    assert_eq!(after, c2.ts + 1);
    drop(db);
    assert_eq!(newest_segment(&path), seg, "the gap is inside one segment");

    let saved = copy_store(&path);
    assert!(keeldb::verify(&path).unwrap().is_intact(), "verify refuses the covered gap");
    let db = open(&path);
    let r = db.recovery_report();
    assert_eq!(r.gap_covered, Some((first_lost, last_lost)), "{r}");
    assert_eq!(count(&db), 9, "{r}");
    assert_eq!(get(&db, "t", b"k7").as_deref(), Some(&b"v"[..]));
    assert_eq!(get(&db, "t", b"k8").as_deref(), Some(&b"v"[..]));
    put(&db, "t", b"k9", b"v");
    db.close().unwrap();
    assert_eq!(count(&open(&path)), 10);

    // The same files with the checkpoint at k7 corrupt: the older checkpoint cannot hold the
    // gap, so the open refuses the store rather than lose k6 and k7.
    let newest = files(&saved.path(), "checkpoint-").into_iter().max().unwrap();
    let mut bytes = std::fs::read(&newest).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xFF;
    std::fs::write(&newest, &bytes).unwrap();
    let err = Database::open(saved.path(), opts(Durability::Sync)).unwrap_err();
    assert!(matches!(err, Error::Corruption { .. }), "{err}");
}
