//! The simulated file system keeps its own fault model: what survives a crash, what is lost,
//! torn or flipped, how locks, stale handles, stops and injected faults behave. These tests
//! check the tester, so a passing crash test means what it claims.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::io::ErrorKind;
use std::path::Path;

use keel_testkit::sim::{Fault, FaultError, FaultModel, FaultOp, SimFs, SECTOR_BYTES};
use keeldb::fs::{read_all, write_all_at, FileSystem, OpenMode};

fn p(s: &str) -> &Path {
    Path::new(s)
}

/// A disk with `/d` durable.
fn disk(seed: u64, model: FaultModel) -> SimFs {
    let fs = SimFs::with_model(seed, model);
    fs.create_dir_durable(p("/d")).unwrap();
    fs
}

fn no_tears() -> FaultModel {
    FaultModel {
        tear_probability: 0.0,
        bit_flip_probability: 0.0,
        dir_prefix_probability: 0.0,
        ..FaultModel::default()
    }
}

#[test]
fn synced_data_and_entries_survive_every_crash() {
    for seed in 0..200 {
        let fs = disk(seed, FaultModel::default());
        let f = fs.open(p("/d/a"), OpenMode::CreateNew).unwrap();
        write_all_at(f.as_ref(), b"durable bytes", 0).unwrap();
        f.sync_data().unwrap();
        fs.sync_dir(p("/d")).unwrap();
        write_all_at(f.as_ref(), &[7u8; 3000], 13).unwrap(); // unsynced tail
        fs.crash();
        let bytes = fs.read_file(p("/d/a")).expect("synced file exists");
        assert_eq!(&bytes[..13], b"durable bytes", "seed {seed}");
        assert!(bytes.len() <= 3013);
    }
}

#[test]
fn unsynced_directory_operations_are_forgotten_without_dir_prefix() {
    let fs = disk(1, no_tears());
    let g = fs.open(p("/d/old"), OpenMode::CreateNew).unwrap();
    g.sync_data().unwrap();
    fs.sync_dir(p("/d")).unwrap();
    let f = fs.open(p("/d/new"), OpenMode::CreateNew).unwrap();
    write_all_at(f.as_ref(), b"data", 0).unwrap();
    f.sync_data().unwrap(); // data durable, entry not
    fs.rename(p("/d/old"), p("/d/renamed")).unwrap();
    fs.crash();
    assert!(!fs.exists(p("/d/new")).unwrap(), "a create without a directory fsync must vanish");
    assert!(fs.exists(p("/d/old")).unwrap(), "a rename without a directory fsync must revert");
    assert!(!fs.exists(p("/d/renamed")).unwrap());
}

#[test]
fn removes_revert_and_keep_their_bytes_until_the_directory_is_synced() {
    let fs = disk(2, no_tears());
    let f = fs.open(p("/d/x"), OpenMode::CreateNew).unwrap();
    write_all_at(f.as_ref(), b"keep me", 0).unwrap();
    f.sync_data().unwrap();
    fs.sync_dir(p("/d")).unwrap();
    fs.remove_file(p("/d/x")).unwrap();
    assert!(!fs.exists(p("/d/x")).unwrap());
    fs.crash();
    assert_eq!(fs.read_file(p("/d/x")).unwrap(), b"keep me");
    fs.remove_file(p("/d/x")).unwrap();
    fs.sync_dir(p("/d")).unwrap();
    fs.crash();
    assert!(!fs.exists(p("/d/x")).unwrap());
}

#[test]
fn remove_dir_refuses_a_non_empty_directory_and_reverts_until_the_parent_is_synced() {
    let fs = disk(4, no_tears());
    fs.create_dir_durable(p("/d/sub")).unwrap();
    let f = fs.open(p("/d/sub/f"), OpenMode::CreateNew).unwrap();
    f.sync_data().unwrap();
    fs.sync_dir(p("/d/sub")).unwrap();
    assert_eq!(fs.remove_dir(p("/d/sub")).unwrap_err().kind(), ErrorKind::DirectoryNotEmpty);
    assert_eq!(fs.remove_dir(p("/d/sub/f")).unwrap_err().kind(), ErrorKind::NotADirectory);
    fs.remove_file(p("/d/sub/f")).unwrap();
    fs.remove_dir(p("/d/sub")).unwrap();
    assert!(!fs.exists(p("/d/sub")).unwrap());
    fs.crash();
    // Neither removal was synced: both come back.
    assert!(fs.exists(p("/d/sub/f")).unwrap());
    fs.remove_file(p("/d/sub/f")).unwrap();
    fs.sync_dir(p("/d/sub")).unwrap();
    fs.remove_dir(p("/d/sub")).unwrap();
    fs.sync_dir(p("/d")).unwrap();
    fs.crash();
    assert!(!fs.exists(p("/d/sub")).unwrap());
}

#[test]
fn a_directory_created_without_syncing_its_parent_can_vanish() {
    let fs = SimFs::with_model(3, no_tears());
    fs.create_dir_all(p("/a/b")).unwrap();
    fs.sync_dir(p("/a/b")).unwrap(); // syncing the directory itself is not enough
    fs.crash();
    assert!(!fs.exists(p("/a")).unwrap());
}

#[test]
fn directory_prefix_mode_keeps_operations_in_order() {
    // With a prefix kept, a later operation never survives without the earlier ones.
    let model = FaultModel { dir_prefix_probability: 1.0, ..no_tears() };
    let mut seen = std::collections::BTreeSet::new();
    for seed in 0..100 {
        let fs = disk(seed, model.clone());
        for name in ["1", "2", "3", "4"] {
            fs.open(&Path::new("/d").join(name), OpenMode::CreateNew).unwrap();
        }
        fs.crash();
        let mut names = fs.list_dir(p("/d")).unwrap();
        names.sort();
        let want: Vec<String> = ["1", "2", "3", "4"].iter().take(names.len()).map(|s| s.to_string()).collect();
        assert_eq!(names, want, "seed {seed}");
        seen.insert(names.len());
    }
    assert_eq!(seen.len(), 5, "every prefix length occurs: {seen:?}");
}

#[test]
fn crashes_lose_keep_and_tear_unsynced_writes_at_sector_granularity() {
    let model = FaultModel { tear_probability: 1.0, bit_flip_probability: 0.0, ..FaultModel::default() };
    let (mut lost, mut whole, mut torn) = (0, 0, 0);
    for seed in 0..300 {
        let fs = disk(seed, model.clone());
        let f = fs.open(p("/d/f"), OpenMode::CreateNew).unwrap();
        f.sync_data().unwrap();
        fs.sync_dir(p("/d")).unwrap();
        let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8 + 1).collect();
        write_all_at(f.as_ref(), &data, 0).unwrap();
        fs.crash();
        let got = fs.read_file(p("/d/f")).unwrap();
        if got.is_empty() {
            lost += 1;
        } else if got == data {
            whole += 1;
        } else {
            torn += 1;
            // Each sector is the new data, or missing/zero: never a mix within a sector.
            for (i, sector) in got.chunks(SECTOR_BYTES as usize).enumerate() {
                let want = &data[i * 512..(i * 512 + sector.len())];
                assert!(sector == want || sector.iter().all(|&b| b == 0), "seed {seed}: sector {i} is a mix");
            }
        }
    }
    assert!(lost > 0 && torn > 0, "lost {lost}, whole {whole}, torn {torn}");
}

#[test]
fn bit_flips_land_only_in_unsynced_bytes() {
    let model = FaultModel { tear_probability: 0.0, bit_flip_probability: 1.0, ..FaultModel::default() };
    let mut flipped = 0;
    for seed in 0..200 {
        let fs = disk(seed, model.clone());
        let f = fs.open(p("/d/f"), OpenMode::CreateNew).unwrap();
        write_all_at(f.as_ref(), &[0xAA; 1024], 0).unwrap();
        f.sync_data().unwrap();
        fs.sync_dir(p("/d")).unwrap();
        write_all_at(f.as_ref(), &[0x55; 1024], 1024).unwrap();
        let report = fs.crash();
        let got = fs.read_file(p("/d/f")).unwrap();
        assert_eq!(&got[..1024], &[0xAA; 1024][..], "seed {seed}: durable bytes changed");
        if got.len() > 1024 && got[1024..].iter().any(|&b| b != 0x55) {
            assert!(report.bit_flips > 0);
            flipped += 1;
        }
    }
    assert!(flipped > 20, "flips happened {flipped} times");
}

#[test]
fn same_seed_same_crash() {
    let run = |seed| {
        let fs = disk(seed, FaultModel::default());
        let f = fs.open(p("/d/f"), OpenMode::CreateNew).unwrap();
        for i in 0..20u64 {
            write_all_at(f.as_ref(), &[i as u8; 700], i * 700).unwrap();
        }
        let g = fs.open(p("/d/g"), OpenMode::CreateNew).unwrap();
        write_all_at(g.as_ref(), b"g", 0).unwrap();
        let report = fs.crash();
        (report, fs.read_file(p("/d/f")), fs.read_file(p("/d/g")), fs.stats())
    };
    for seed in [0, 1, 99, 12345] {
        assert_eq!(run(seed), run(seed));
    }
}

#[test]
fn process_kill_keeps_the_page_cache_but_a_later_power_loss_may_not() {
    let fs = disk(5, FaultModel { tear_probability: 0.0, ..no_tears() });
    let f = fs.open(p("/d/f"), OpenMode::CreateNew).unwrap();
    f.sync_data().unwrap();
    fs.sync_dir(p("/d")).unwrap();
    write_all_at(f.as_ref(), b"unsynced", 0).unwrap();
    fs.kill_process();
    assert_eq!(fs.read_file(p("/d/f")).unwrap(), b"unsynced");
    assert!(f.read_at(&mut [0u8; 4], 0).is_err(), "a handle from before the kill is dead");
    let mut seen_loss = false;
    for seed in 0..40 {
        let fs = disk(seed, no_tears());
        let f = fs.open(p("/d/f"), OpenMode::CreateNew).unwrap();
        f.sync_data().unwrap();
        fs.sync_dir(p("/d")).unwrap();
        write_all_at(f.as_ref(), b"unsynced", 0).unwrap();
        fs.kill_process();
        fs.crash();
        seen_loss |= fs.read_file(p("/d/f")).unwrap().is_empty();
    }
    assert!(seen_loss, "a power loss after a kill can still lose what was never synced");
}

#[test]
fn handles_and_locks_from_before_a_crash_are_dead() {
    let fs = disk(6, FaultModel::default());
    let f = fs.open(p("/d/f"), OpenMode::CreateNew).unwrap();
    let lock = fs.lock_exclusive(p("/d/LOCK")).unwrap();
    let err = fs.lock_exclusive(p("/d/LOCK")).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::WouldBlock);
    fs.crash();
    assert!(f.write_at(b"x", 0).is_err());
    assert!(f.sync_data().is_err());
    let again = fs.lock_exclusive(p("/d/LOCK")).expect("the crash released the lock");
    drop(lock); // The dead lock's drop must not release the new holder's lock.
    assert_eq!(fs.lock_exclusive(p("/d/LOCK")).unwrap_err().kind(), ErrorKind::WouldBlock);
    drop(again);
    fs.lock_exclusive(p("/d/LOCK")).expect("released on drop");
}

#[test]
fn stop_after_ops_fails_every_later_call_until_the_crash() {
    let fs = disk(7, FaultModel::default());
    let f = fs.open(p("/d/f"), OpenMode::CreateNew).unwrap();
    let start = fs.ops();
    fs.stop_after_ops(2);
    f.write_at(b"a", 0).unwrap();
    f.write_at(b"b", 1).unwrap();
    assert!(f.write_at(b"c", 2).is_err());
    assert!(fs.is_stopped());
    assert!(f.read_at(&mut [0u8; 1], 0).is_err(), "reads fail too once stopped");
    assert!(fs.list_dir(p("/d")).is_err());
    assert_eq!(fs.ops(), start + 3);
    fs.crash();
    assert!(!fs.is_stopped());
    assert!(fs.list_dir(p("/d")).is_ok());
}

#[test]
fn injected_faults_fire_on_the_chosen_call() {
    let fs = disk(8, FaultModel::default());
    let f = fs.open(p("/d/wal-1"), OpenMode::CreateNew).unwrap();
    let g = fs.open(p("/d/other"), OpenMode::CreateNew).unwrap();
    fs.inject(Fault::new(FaultOp::SyncData).after(2).on_path("wal-"));
    g.sync_data().unwrap();
    f.sync_data().unwrap();
    f.sync_data().unwrap();
    let err = f.sync_data().unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EIO));
    f.sync_data().unwrap();
    fs.inject(Fault::new(FaultOp::Write).forever().error(FaultError::NoSpace));
    for _ in 0..3 {
        assert_eq!(f.write_at(b"x", 0).unwrap_err().raw_os_error(), Some(libc::ENOSPC));
    }
    fs.clear_faults();
    assert_eq!(f.write_at(b"x", 0).unwrap(), 1);
    assert!(fs.stats().faults_injected >= 4);
}

#[test]
fn partial_writes_leave_a_prefix_and_report_an_error() {
    let fs = disk(9, FaultModel::default());
    let f = fs.open(p("/d/f"), OpenMode::CreateNew).unwrap();
    fs.inject(Fault::new(FaultOp::Write).error(FaultError::PartialWrite));
    assert!(f.write_at(&[1u8; 1000], 0).is_err());
    let len = f.len().unwrap();
    assert!(len > 0 && len < 1000, "partial write left {len} bytes");
}

#[test]
fn short_writes_return_fewer_bytes_and_write_all_at_still_writes_everything() {
    let fs = disk(10, FaultModel::default());
    fs.set_short_writes(1.0);
    let f = fs.open(p("/d/f"), OpenMode::CreateNew).unwrap();
    let n = f.write_at(&[3u8; 100], 0).unwrap();
    assert!(n < 100 && n > 0);
    let data: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
    write_all_at(f.as_ref(), &data, 0).unwrap();
    assert_eq!(read_all(f.as_ref()).unwrap(), data);
    assert!(fs.stats().short_writes > 2);
}

#[test]
fn failed_fsync_loses_the_dirty_pages_but_reads_still_see_them() {
    let fs = disk(11, FaultModel { lose_on_failed_sync: true, ..no_tears() });
    let f = fs.open(p("/d/f"), OpenMode::CreateNew).unwrap();
    f.sync_data().unwrap();
    fs.sync_dir(p("/d")).unwrap();
    write_all_at(f.as_ref(), b"doomed", 0).unwrap();
    fs.inject(Fault::new(FaultOp::SyncData));
    assert!(f.sync_data().is_err());
    assert_eq!(read_all(f.as_ref()).unwrap(), b"doomed", "the page cache still has it");
    f.sync_data().expect("a retried fsync reports success"); // ... and writes nothing
    fs.crash();
    assert!(fs.read_file(p("/d/f")).unwrap().is_empty(), "the data never reached the disk");
}

#[test]
fn open_modes_follow_posix() {
    let fs = disk(12, FaultModel::default());
    assert_eq!(fs.open(p("/d/none"), OpenMode::Read).unwrap_err().kind(), ErrorKind::NotFound);
    let f = fs.open(p("/d/f"), OpenMode::CreateNew).unwrap();
    assert_eq!(fs.open(p("/d/f"), OpenMode::CreateNew).unwrap_err().kind(), ErrorKind::AlreadyExists);
    write_all_at(f.as_ref(), b"abc", 0).unwrap();
    let r = fs.open(p("/d/f"), OpenMode::Read).unwrap();
    assert!(r.write_at(b"x", 0).is_err());
    assert_eq!(read_all(r.as_ref()).unwrap(), b"abc");
    assert_eq!(fs.open(p("/nodir/f"), OpenMode::CreateNew).unwrap_err().kind(), ErrorKind::NotFound);
    f.set_len(1).unwrap();
    assert_eq!(read_all(r.as_ref()).unwrap(), b"a");
    let mut names = fs.list_dir(p("/d")).unwrap();
    names.sort();
    assert_eq!(names, ["f"]);
}
