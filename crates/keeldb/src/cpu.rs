//! Per-transaction CPU and wall-clock accounting, CPU budgets and wall-clock timeouts.
//!
//! A [`Meter`] rides along with each transaction. Reading the thread CPU clock costs a system
//! call (about 0.4 µs on the machine we measure on), several times the whole cost of a short
//! relaxed transaction, so the meter reads it lazily:
//!
//! - it always reads the monotonic wall clock at begin and end (a vDSO call, ~25 ns);
//! - without a budget, CPU time never exceeds wall time, so until a check finds the transaction
//!   older than [`SAMPLE_AFTER`] its wall time stands in as an upper bound of its CPU time and no
//!   CPU clock read is needed; from that check on it counts CPU exactly, adding the wall time
//!   before it (an over-estimate when the transaction was idle before that check);
//! - with a budget, it reads the CPU clock at begin (exactness matters more than 0.4 µs when a
//!   caller asked for a limit), and after each CPU read at used CPU `u` the budget cannot be
//!   crossed before another `budget - u` of wall time passes, so the next read waits until then.
//!   Detection is exact up to one operation, with a handful of clock reads per transaction.
//!
//! Checks run at every transaction operation (get, put, delete, each scanned item) when a budget
//! or timeout is set, and every 32nd operation otherwise. Code the caller runs between
//! operations is counted (it runs on the transaction's thread) but can only be stopped at the
//! next operation. If a transaction moves to another thread, the wall time since the last CPU
//! read stands in for the first thread's CPU, and counting continues on the new thread.
//!
//! This module owns the crate's second `unsafe` use: one `clock_gettime` call.

use std::thread::ThreadId;
use std::time::{Duration, Instant};

use crate::error::Error;

/// Wall time after which a transaction starts reading the thread CPU clock.
pub const SAMPLE_AFTER: Duration = Duration::from_micros(50);
const UNWATCHED_CHECK_EVERY: u32 = 32;

/// CPU time of the calling thread, in nanoseconds, or `None` where unsupported.
pub fn thread_cpu_ns() -> Option<u64> {
    sys::thread_cpu_ns()
}

/// Whether this platform measures thread CPU time (otherwise wall time stands in for it).
pub fn thread_cpu_supported() -> bool {
    thread_cpu_ns().is_some()
}

#[cfg(unix)]
#[allow(unsafe_code)]
mod sys {
    pub fn thread_cpu_ns() -> Option<u64> {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: `clock_gettime` writes one `timespec` through the pointer, which points to a
        // live, properly aligned local; the clock id is a constant the kernel validates.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        if rc != 0 {
            return None;
        }
        Some((ts.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64))
    }
}

#[cfg(not(unix))]
mod sys {
    /// Unsupported: the meter falls back to wall time, an upper bound of CPU time.
    pub fn thread_cpu_ns() -> Option<u64> {
        None
    }
}

#[derive(Debug, Clone, Copy)]
struct Segment {
    thread: ThreadId,
    base_ns: u64,
    /// The last CPU reading on this thread and when it was taken.
    last_ns: u64,
    last_at: Instant,
}

/// Measures one transaction.
#[derive(Debug)]
pub(crate) struct Meter {
    started: Instant,
    budget: Option<Duration>,
    deadline: Option<Instant>,
    timeout: Option<Duration>,
    ops: u32,
    segment: Option<Segment>,
    /// CPU counted outside the open segment: the wall time before sampling started (an upper
    /// bound) plus closed segments.
    counted_ns: u64,
    /// Before this instant the budget cannot have been crossed.
    next_read_at: Option<Instant>,
    /// CPU fixed at the commit request: the log write and fsync wait are not charged.
    frozen_cpu: Option<Duration>,
}

impl Meter {
    pub fn start(budget: Option<Duration>, timeout: Option<Duration>) -> Meter {
        let started = Instant::now();
        // A budget needs exact CPU from the start: idle time before the first check must not
        // count, so a budgeted transaction pays one CPU clock read at begin.
        let segment = budget.and_then(|_| thread_cpu_ns()).map(|base_ns| Segment {
            thread: std::thread::current().id(),
            base_ns,
            last_ns: base_ns,
            last_at: started,
        });
        Meter {
            started,
            budget,
            deadline: timeout.and_then(|t| started.checked_add(t)),
            timeout,
            ops: 0,
            segment,
            counted_ns: 0,
            next_read_at: None,
            frozen_cpu: None,
        }
    }

    fn watched(&self) -> bool {
        self.budget.is_some() || self.deadline.is_some()
    }

    /// Called at every operation. Fails once the budget or the timeout is exceeded.
    pub fn check(&mut self) -> Result<(), Error> {
        self.ops = self.ops.wrapping_add(1);
        if !self.watched() && !self.ops.is_multiple_of(UNWATCHED_CHECK_EVERY) {
            return Ok(());
        }
        let now = Instant::now();
        if let (Some(deadline), Some(timeout)) = (self.deadline, self.timeout) {
            if now >= deadline {
                return Err(Error::Timeout { elapsed: now - self.started, timeout });
            }
        }
        self.maybe_start_sampling(now);
        let Some(budget) = self.budget else { return Ok(()) };
        if self.segment.is_none() || self.next_read_at.is_some_and(|t| now < t) {
            return Ok(());
        }
        let used = Duration::from_nanos(self.cpu_now_ns(now));
        if used >= budget {
            return Err(Error::CpuBudgetExceeded { used, budget });
        }
        self.next_read_at = now.checked_add(budget - used);
        Ok(())
    }

    fn sample_after(&self) -> Duration {
        self.budget.map_or(SAMPLE_AFTER, |b| b.min(SAMPLE_AFTER))
    }

    fn maybe_start_sampling(&mut self, now: Instant) {
        if self.segment.is_some() {
            return;
        }
        let wall = now - self.started;
        if wall < self.sample_after() {
            return;
        }
        if let Some(base_ns) = thread_cpu_ns() {
            self.counted_ns = wall.as_nanos() as u64;
            self.segment =
                Some(Segment { thread: std::thread::current().id(), base_ns, last_ns: base_ns, last_at: now });
        }
    }

    /// CPU used so far in nanoseconds (reads the thread CPU clock when sampling).
    fn cpu_now_ns(&mut self, now: Instant) -> u64 {
        let Some(seg) = self.segment else {
            // Not sampling (short so far, or no thread clock): wall time is the upper bound.
            return self.counted_ns + (now - self.started).as_nanos() as u64;
        };
        let Some(cpu) = thread_cpu_ns() else { return self.counted_ns + (now - seg.last_at).as_nanos() as u64 };
        let here = std::thread::current().id();
        if seg.thread != here {
            // Moved threads: the first thread's CPU since its last reading is bounded by wall time.
            self.counted_ns += seg.last_ns - seg.base_ns + (now - seg.last_at).as_nanos() as u64;
            self.segment = Some(Segment { thread: here, base_ns: cpu, last_ns: cpu, last_at: now });
            return self.counted_ns;
        }
        self.segment = Some(Segment { last_ns: cpu, last_at: now, ..seg });
        self.counted_ns + cpu.saturating_sub(seg.base_ns)
    }

    fn cpu_at(&mut self, now: Instant) -> Duration {
        if let Some(frozen) = self.frozen_cpu {
            return frozen;
        }
        match self.segment {
            Some(_) => Duration::from_nanos(self.cpu_now_ns(now)),
            // Never sampled: the transaction was short; its wall time bounds its CPU time.
            None => now - self.started,
        }
    }

    /// Fixes the CPU figure at the commit request, so that time spent waiting for the group's
    /// write and fdatasync (which uses no CPU of this transaction's) is not charged as CPU.
    pub fn freeze(&mut self) {
        let now = Instant::now();
        let cpu = self.cpu_at(now);
        self.frozen_cpu = Some(cpu);
    }

    /// Ends the measurement: (CPU time, wall time).
    pub fn finish(&mut self) -> (Duration, Duration) {
        let now = Instant::now();
        let cpu = self.cpu_at(now);
        (cpu, now - self.started)
    }
}

/// A transaction's meter behind a cheap gate: unwatched operations only bump a counter; the
/// lock is taken when a budget or timeout is set, or on every 32nd operation.
#[derive(Debug)]
pub(crate) struct MeterCell {
    /// Off: no budget, no timeout and accounting disabled; nothing is measured.
    enabled: bool,
    watched: bool,
    ops: std::sync::atomic::AtomicU32,
    meter: parking_lot::Mutex<Meter>,
    /// Set once the budget or timeout tripped; every later operation fails the same way.
    tripped: parking_lot::Mutex<Option<Tripped>>,
    has_tripped: std::sync::atomic::AtomicBool,
}

/// Why a transaction was stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tripped {
    Cpu { used: Duration, budget: Duration },
    Timeout { elapsed: Duration, timeout: Duration },
}

impl Tripped {
    pub fn error(self) -> Error {
        match self {
            Tripped::Cpu { used, budget } => Error::CpuBudgetExceeded { used, budget },
            Tripped::Timeout { elapsed, timeout } => Error::Timeout { elapsed, timeout },
        }
    }
}

impl MeterCell {
    pub fn new(budget: Option<Duration>, timeout: Option<Duration>, accounting: bool) -> MeterCell {
        let watched = budget.is_some() || timeout.is_some();
        MeterCell {
            enabled: watched || accounting,
            watched,
            ops: std::sync::atomic::AtomicU32::new(0),
            meter: parking_lot::Mutex::new(Meter::start(budget, timeout)),
            tripped: parking_lot::Mutex::new(None),
            has_tripped: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Called at every operation of the transaction.
    pub fn check(&self) -> Result<(), Error> {
        if !self.enabled {
            return Ok(());
        }
        if !self.watched {
            let n = self.ops.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if n % UNWATCHED_CHECK_EVERY != UNWATCHED_CHECK_EVERY - 1 {
                return Ok(());
            }
        }
        if let Some(t) = self.tripped() {
            return Err(t.error());
        }
        let result = self.meter.lock().check();
        if let Err(e) = &result {
            let t = match *e {
                Error::CpuBudgetExceeded { used, budget } => Some(Tripped::Cpu { used, budget }),
                Error::Timeout { elapsed, timeout } => Some(Tripped::Timeout { elapsed, timeout }),
                _ => None,
            };
            *self.tripped.lock() = t;
            self.has_tripped.store(true, std::sync::atomic::Ordering::Release);
        }
        result
    }

    pub fn tripped(&self) -> Option<Tripped> {
        if !self.has_tripped.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        *self.tripped.lock()
    }

    pub fn finish(&self) -> (Duration, Duration) {
        if !self.enabled {
            return (Duration::ZERO, Duration::ZERO);
        }
        self.meter.lock().finish()
    }

    pub fn freeze(&self) {
        if self.enabled {
            self.meter.lock().freeze();
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }
}

/// Number of log2 buckets in the histograms (1 µs .. ~1 h).
pub const HISTOGRAM_BUCKETS: usize = 32;

/// A log2 histogram of durations in microseconds: bucket `i` counts values in `[2^i, 2^(i+1))`
/// µs, bucket 0 also holds values under 1 µs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Histogram {
    /// Counts per bucket.
    pub buckets: [u64; HISTOGRAM_BUCKETS],
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { buckets: [0; HISTOGRAM_BUCKETS] }
    }
}

impl Histogram {
    /// Adds one value.
    pub fn record(&mut self, d: Duration) {
        self.record_ns(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    }

    /// Adds one value given in nanoseconds (u64 arithmetic only: this runs per transaction).
    pub fn record_ns(&mut self, ns: u64) {
        let us = (ns / 1000).max(1);
        let i = (63 - us.leading_zeros() as usize).min(HISTOGRAM_BUCKETS - 1);
        if let Some(b) = self.buckets.get_mut(i) {
            *b += 1;
        }
    }

    /// Total values recorded.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// Upper edge (exclusive) of the bucket holding the `q` quantile (0..=1), in microseconds.
    pub fn quantile_upper_us(&self, q: f64) -> u64 {
        let total = self.count();
        if total == 0 {
            return 0;
        }
        let want = ((total as f64) * q.clamp(0.0, 1.0)).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= want {
                return 1u64 << (i + 1);
            }
        }
        1u64 << HISTOGRAM_BUCKETS
    }
}

/// Totals for one transaction tag (or for untagged transactions).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TagStats {
    /// The tag, or `None` for untagged transactions.
    pub tag: Option<String>,
    /// Transactions finished (committed, rolled back or aborted).
    pub transactions: u64,
    /// Write transactions committed.
    pub commits: u64,
    /// Transactions aborted by a CPU budget.
    pub cpu_budget_aborts: u64,
    /// Transactions aborted by a wall-clock timeout.
    pub timeouts: u64,
    /// Total CPU time.
    pub cpu_time: Duration,
    /// Total wall time.
    pub wall_time: Duration,
    /// CPU time per transaction.
    pub cpu_histogram: Histogram,
    /// Wall time (latency) per transaction.
    pub latency_histogram: Histogram,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spin(d: Duration) {
        let start = thread_cpu_ns().unwrap_or(0);
        let t = Instant::now();
        let mut x = 0u64;
        loop {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            std::hint::black_box(x);
            let done = match thread_cpu_ns() {
                Some(now) => now - start >= d.as_nanos() as u64,
                None => t.elapsed() >= d,
            };
            if done {
                return;
            }
        }
    }

    #[test]
    fn thread_cpu_clock_advances_with_work_and_not_with_sleep() {
        let Some(a) = thread_cpu_ns() else { return };
        std::thread::sleep(Duration::from_millis(20));
        let b = thread_cpu_ns().unwrap_or(0);
        spin(Duration::from_millis(5));
        let c = thread_cpu_ns().unwrap_or(0);
        assert!(b - a < 5_000_000, "sleeping used {} ns of CPU", b - a);
        assert!(c - b >= 5_000_000);
    }

    #[test]
    fn budget_is_detected_after_it_is_crossed_not_before() {
        let mut m = Meter::start(Some(Duration::from_millis(3)), None);
        let mut checks = 0;
        loop {
            spin(Duration::from_micros(100));
            checks += 1;
            match m.check() {
                Ok(()) => assert!(checks < 1000, "never detected"),
                Err(Error::CpuBudgetExceeded { used, budget }) => {
                    assert!(used >= budget);
                    // The meter counts at most SAMPLE_AFTER of wall before sampling as CPU.
                    assert!(used < budget + Duration::from_millis(1), "detected late: {used:?}");
                    assert!(checks >= 25, "detected early after {checks} × 100 µs");
                    return;
                }
                Err(other) => panic!("{other}"),
            }
        }
    }

    #[test]
    fn sleeping_does_not_use_the_budget_but_trips_the_timeout() {
        let timeout = Duration::from_millis(300);
        let mut m = Meter::start(Some(Duration::from_millis(5)), Some(timeout));
        let started = Instant::now();
        for _ in 0..2 {
            std::thread::sleep(Duration::from_millis(10));
            match m.check() {
                Ok(()) => {}
                // Only a heavily loaded machine makes two 10 ms sleeps take 300 ms.
                Err(Error::Timeout { .. }) => assert!(started.elapsed() >= timeout),
                Err(other) => panic!("sleeping used CPU budget: {other}"),
            }
        }
        while started.elapsed() < timeout + Duration::from_millis(5) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(matches!(m.check(), Err(Error::Timeout { .. })));
    }

    #[test]
    fn short_transactions_report_wall_time_as_cpu_upper_bound() {
        let mut m = Meter::start(None, None);
        let (cpu, wall) = m.finish();
        assert_eq!(cpu, wall);
    }

    #[test]
    fn histogram_buckets_and_quantiles() {
        let mut h = Histogram::default();
        for us in [0u64, 1, 3, 900, 1500] {
            h.record(Duration::from_micros(us));
        }
        assert_eq!(h.count(), 5);
        assert_eq!(h.buckets[0], 2);
        assert_eq!(h.buckets[1], 1);
        assert_eq!(h.buckets[9], 1);
        assert_eq!(h.buckets[10], 1);
        assert_eq!(h.quantile_upper_us(0.5), 4);
        assert_eq!(h.quantile_upper_us(1.0), 2048);
    }
}
