//! CPU accounting, budgets and timeouts: a runaway transaction is aborted within a bounded
//! overshoot, its writes are rolled back, and concurrent transactions are unaffected.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod common;
use std::time::{Duration, Instant};

use common::*;
use keeldb::{Error, ScanRange, TxnOptions};

/// Burns roughly `d` of this thread's CPU.
fn burn(d: Duration) {
    let start = keeldb::thread_cpu_ns().unwrap_or(0);
    let t = Instant::now();
    let mut x = 1u64;
    loop {
        for _ in 0..1000 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        }
        std::hint::black_box(x);
        let done = match keeldb::thread_cpu_ns() {
            Some(now) => now - start >= d.as_nanos() as u64,
            None => t.elapsed() >= d,
        };
        if done {
            return;
        }
    }
}

fn budget(ms: u64) -> TxnOptions {
    TxnOptions { cpu_budget: Some(Duration::from_millis(ms)), ..TxnOptions::default() }
}

#[test]
fn runaway_writer_is_aborted_and_rolled_back() {
    let t = TestDir::new();
    let db = open(&t.path());
    put(&db, "t", b"keep", b"1");
    let mut tx = db.begin_write_with(budget(5)).unwrap();
    tx.put("t", b"partial", b"x").unwrap();
    let mut aborted = None;
    for i in 0..10_000u32 {
        burn(Duration::from_micros(200));
        match tx.put("t", &i.to_be_bytes(), b"v") {
            Ok(()) => {}
            Err(e) => {
                aborted = Some(e);
                break;
            }
        }
    }
    match aborted {
        Some(Error::CpuBudgetExceeded { used, budget }) => {
            assert!(used >= budget);
            assert!(used < budget + Duration::from_millis(1), "overshoot {:?}", used - budget);
        }
        other => panic!("expected a budget abort, got {other:?}"),
    }
    // Every later operation and the commit fail the same way; nothing was written.
    assert!(matches!(tx.get("t", b"keep"), Err(Error::CpuBudgetExceeded { .. })));
    assert!(matches!(tx.commit(), Err(Error::CpuBudgetExceeded { .. })));
    assert_eq!(get(&db, "t", b"partial"), None);
    assert_eq!(get(&db, "t", b"keep").as_deref(), Some(&b"1"[..]));
    let stats = db.stats();
    let untagged = stats.accounting.iter().find(|s| s.tag.is_none()).unwrap();
    assert_eq!(untagged.cpu_budget_aborts, 1);
}

#[test]
fn long_scan_is_stopped_from_inside_the_iterator() {
    let t = TestDir::new();
    let db = open(&t.path());
    let mut tx = db.begin_write().unwrap();
    for i in 0..20_000u32 {
        tx.put("t", &i.to_be_bytes(), &[0u8; 64]).unwrap();
    }
    tx.commit().unwrap();
    let rx = db.begin_read_with(budget(3)).unwrap();
    let mut seen = 0u64;
    let mut err = None;
    for item in rx.scan("t", ScanRange::all()).unwrap() {
        match item {
            Ok(_) => {
                seen += 1;
                burn(Duration::from_micros(20));
            }
            Err(e) => {
                err = Some(e);
                break;
            }
        }
    }
    assert!(matches!(err, Some(Error::CpuBudgetExceeded { .. })), "{err:?} after {seen}");
    assert!(seen < 20_000);
    // The iterator ends after reporting the error once.
    let rx2 = db.begin_read_with(budget(1)).unwrap();
    let scan = rx2.scan("t", ScanRange::all()).unwrap();
    let mut errors = 0;
    let mut n = 0;
    for item in scan {
        n += 1;
        if item.is_err() {
            errors += 1;
        } else {
            burn(Duration::from_micros(50));
        }
        assert!(n < 30_000);
    }
    assert_eq!(errors, 1);
}

#[test]
fn concurrent_transactions_are_unaffected_by_an_abort() {
    let t = TestDir::new();
    let db = keeldb::Database::open(t.path(), opts(keeldb::Durability::Relaxed)).unwrap();
    std::thread::scope(|s| {
        let dbr = db.clone();
        let runaway = s.spawn(move || {
            let mut tx = dbr.begin_write_with(budget(20)).unwrap();
            loop {
                burn(Duration::from_millis(1));
                if let Err(e) = tx.put("runaway", b"k", b"v") {
                    return e;
                }
            }
        });
        let dbw = db.clone();
        let worker = s.spawn(move || {
            for i in 0..500u32 {
                dbw.transact(|tx| tx.put("good", &i.to_be_bytes(), b"v")).unwrap();
            }
        });
        assert!(matches!(runaway.join().unwrap(), Error::CpuBudgetExceeded { .. }));
        worker.join().unwrap();
    });
    assert_eq!(scan_all(&db, "good").len(), 500);
    assert!(scan_all(&db, "runaway").is_empty());
}

#[test]
fn transact_does_not_retry_a_budget_abort() {
    let t = TestDir::new();
    let db = open(&t.path());
    let mut attempts = 0;
    let r: keeldb::Result<()> = db.transact_with(budget(2), |tx| {
        attempts += 1;
        loop {
            burn(Duration::from_micros(500));
            tx.put("t", b"k", b"v")?;
        }
    });
    assert!(matches!(r, Err(Error::CpuBudgetExceeded { .. })));
    assert_eq!(attempts, 1);
    assert_eq!(get(&db, "t", b"k"), None);
}

#[test]
fn wall_clock_timeout_catches_slow_idle_transactions() {
    let t = TestDir::new();
    let db = open(&t.path());
    let o = TxnOptions {
        timeout: Some(Duration::from_millis(300)),
        cpu_budget: Some(Duration::from_millis(10)),
        ..Default::default()
    };
    let mut tx = db.begin_write_with(o).unwrap();
    tx.put("t", b"a", b"1").unwrap();
    std::thread::sleep(Duration::from_millis(320)); // uses no CPU, only wall time
    assert!(matches!(tx.put("t", b"b", b"2"), Err(Error::Timeout { .. })));
    assert!(matches!(tx.commit(), Err(Error::Timeout { .. })));
    assert_eq!(get(&db, "t", b"a"), None);
}

#[test]
fn database_default_budget_applies_and_per_transaction_overrides_it() {
    let t = TestDir::new();
    let db = keeldb::Database::open(
        t.path(),
        keeldb::Options { cpu_budget: Some(Duration::from_millis(2)), background_threads: false, ..Default::default() },
    )
    .unwrap();
    let mut tx = db.begin_write().unwrap();
    burn(Duration::from_millis(3));
    assert!(matches!(tx.put("t", b"k", b"v"), Err(Error::CpuBudgetExceeded { .. })));
    drop(tx);
    let mut tx = db.begin_write_with(budget(50)).unwrap();
    burn(Duration::from_millis(3));
    tx.put("t", b"k", b"v").unwrap();
    tx.commit().unwrap();
}

#[test]
fn commit_reports_cpu_time_and_tags_are_totalled() {
    let t = TestDir::new();
    let db = open(&t.path());
    let mut tx = db.begin_write_with(TxnOptions::tagged("tenant-a")).unwrap();
    for i in 0..64u32 {
        tx.put("t", &i.to_be_bytes(), b"v").unwrap();
        burn(Duration::from_micros(100));
    }
    let info = tx.commit().unwrap();
    assert!(info.cpu_time >= Duration::from_millis(6), "{:?}", info.cpu_time);
    assert!(info.cpu_time <= info.wall_time + Duration::from_millis(1));
    for _ in 0..3 {
        let mut tx = db.begin_write_with(TxnOptions::tagged("tenant-b")).unwrap();
        tx.put("t", b"x", b"y").unwrap();
        tx.commit().unwrap();
    }
    let stats = db.stats();
    let a = stats.accounting.iter().find(|s| s.tag.as_deref() == Some("tenant-a")).unwrap();
    let b = stats.accounting.iter().find(|s| s.tag.as_deref() == Some("tenant-b")).unwrap();
    assert_eq!((a.transactions, a.commits), (1, 1));
    assert_eq!((b.transactions, b.commits), (3, 3));
    assert!(a.cpu_time > b.cpu_time);
    assert_eq!(a.cpu_histogram.count(), 1);
    assert_eq!(b.latency_histogram.count(), 3);
    // Sorted by CPU: the heavy tenant first among tagged entries.
    let tagged: Vec<_> = stats.accounting.iter().filter_map(|s| s.tag.clone()).collect();
    assert_eq!(tagged[0], "tenant-a");
}

#[test]
fn per_tag_totals_survive_close_and_reopen() {
    let t = TestDir::new();
    let db = open(&t.path());
    for _ in 0..5 {
        let mut tx = db.begin_write_with(TxnOptions::tagged("ingest")).unwrap();
        tx.put("t", b"k", b"v").unwrap();
        tx.commit().unwrap();
    }
    db.close().unwrap();
    let db = open(&t.path());
    let mut tx = db.begin_write_with(TxnOptions::tagged("ingest")).unwrap();
    tx.put("t", b"k", b"w").unwrap();
    tx.commit().unwrap();
    let ingest = db.stats().accounting.into_iter().find(|s| s.tag.as_deref() == Some("ingest")).unwrap();
    assert_eq!(ingest.commits, 6, "totals are cumulative across opens");
}

#[test]
fn waiting_for_fdatasync_is_not_charged_as_cpu() {
    let t = TestDir::new();
    let db = open(&t.path());
    let mut charged = Vec::new();
    for i in 0..21u32 {
        let mut tx = db.begin_write().unwrap();
        tx.put("t", &i.to_be_bytes(), b"v").unwrap();
        let info = tx.commit().unwrap();
        assert!(info.cpu_time <= info.wall_time);
        charged.push((info.cpu_time, info.wall_time));
    }
    charged.sort();
    // The median commit is charged a few microseconds of CPU, not its fdatasync wait
    // (the median over 21 commits keeps a preempted outlier from failing the test).
    let (cpu, wall) = charged[10];
    assert!(cpu < Duration::from_micros(500), "charged {cpu:?} of {wall:?}");
}

#[test]
fn accounting_can_be_turned_off_but_budgets_still_work() {
    let t = TestDir::new();
    let db = keeldb::Database::open(
        t.path(),
        keeldb::Options { cpu_accounting: false, background_threads: false, ..Default::default() },
    )
    .unwrap();
    let mut tx = db.begin_write().unwrap();
    tx.put("t", b"k", b"v").unwrap();
    let info = tx.commit().unwrap();
    assert_eq!((info.cpu_time, info.wall_time), (Duration::ZERO, Duration::ZERO));
    assert!(db.stats().accounting.is_empty());
    // A budget turns the meter on for that transaction.
    let mut tx = db.begin_write_with(budget(2)).unwrap();
    burn(Duration::from_millis(3));
    assert!(matches!(tx.put("t", b"k2", b"v"), Err(Error::CpuBudgetExceeded { .. })));
}
