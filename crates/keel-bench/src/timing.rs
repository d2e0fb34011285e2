//! Timing helpers: latency samples with percentiles, and iteration budgets that bound a loop by
//! both a count and a wall-clock time so `--quick` stays quick on a slow disk.
//!
//! This module knows nothing about KeelDB; it must stay compilable without the engine.

use std::time::{Duration, Instant};

/// A set of latency samples in nanoseconds. Percentiles come from sorting, which is exact and
/// cheap at the sample counts the suites collect (at most a few million).
#[derive(Debug, Clone, Default)]
pub struct Samples {
    ns: Vec<u64>,
    sorted: bool,
}

impl Samples {
    /// An empty set with room for `capacity` samples.
    pub fn with_capacity(capacity: usize) -> Self {
        Samples { ns: Vec::with_capacity(capacity), sorted: true }
    }

    /// Adds one sample.
    pub fn push(&mut self, sample: Duration) {
        self.push_ns(u64::try_from(sample.as_nanos()).unwrap_or(u64::MAX));
    }

    /// Adds one sample given in nanoseconds.
    pub fn push_ns(&mut self, ns: u64) {
        self.ns.push(ns);
        self.sorted = false;
    }

    /// Moves every sample of `other` into this set.
    pub fn merge(&mut self, other: Samples) {
        self.ns.extend(other.ns);
        self.sorted = false;
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.ns.len()
    }

    /// Whether there are no samples.
    pub fn is_empty(&self) -> bool {
        self.ns.is_empty()
    }

    fn sort(&mut self) {
        if !self.sorted {
            self.ns.sort_unstable();
            self.sorted = true;
        }
    }

    /// The `p`-th percentile (0 ≤ p ≤ 100) in nanoseconds, nearest-rank method: the smallest
    /// sample such that at least `p` percent of the samples are ≤ it. Zero when empty.
    pub fn percentile_ns(&mut self, p: f64) -> f64 {
        self.sort();
        let count = self.ns.len();
        if count == 0 {
            return 0.0;
        }
        let p = p.clamp(0.0, 100.0);
        // Nearest rank: ceil(p/100 * n), at least 1, as a 1-based index.
        let rank = ((p / 100.0) * count as f64).ceil() as usize;
        let index = rank.clamp(1, count) - 1;
        self.ns[index] as f64
    }

    /// Mean in nanoseconds; zero when empty.
    pub fn mean_ns(&self) -> f64 {
        if self.ns.is_empty() {
            return 0.0;
        }
        let total: u128 = self.ns.iter().map(|&ns| u128::from(ns)).sum();
        total as f64 / self.ns.len() as f64
    }

    /// Smallest sample in nanoseconds; zero when empty.
    pub fn min_ns(&self) -> f64 {
        self.ns.iter().copied().min().unwrap_or(0) as f64
    }

    /// Largest sample in nanoseconds; zero when empty.
    pub fn max_ns(&self) -> f64 {
        self.ns.iter().copied().max().unwrap_or(0) as f64
    }
}

/// Bounds a measurement loop: run at least `min_iters`, then stop at `max_iters` or once
/// `max_time` has passed, whichever comes first.
#[derive(Debug, Clone, Copy)]
pub struct Budget {
    /// Iterations always run, even past `max_time`.
    pub min_iters: u64,
    /// Iterations never exceeded.
    pub max_iters: u64,
    /// Wall-clock limit checked after `min_iters`.
    pub max_time: Duration,
}

impl Budget {
    /// A budget of at most `max_iters` iterations and `max_time`, at least `min_iters`.
    pub fn new(min_iters: u64, max_iters: u64, max_time: Duration) -> Self {
        Budget { min_iters, max_iters: max_iters.max(min_iters), max_time }
    }

    /// Starts a run under this budget.
    pub fn start(self) -> BudgetRun {
        BudgetRun { budget: self, started: Instant::now(), done: 0 }
    }
}

/// A loop in progress under a [`Budget`].
#[derive(Debug)]
pub struct BudgetRun {
    budget: Budget,
    started: Instant,
    done: u64,
}

impl BudgetRun {
    /// Whether another iteration should run; counts it if so. Reading the clock every
    /// iteration costs ~20 ns, small next to the operations measured with a budget.
    pub fn keep_going(&mut self) -> bool {
        let more = self.done < self.budget.min_iters
            || (self.done < self.budget.max_iters && self.started.elapsed() < self.budget.max_time);
        if more {
            self.done += 1;
        }
        more
    }

    /// Iterations run so far.
    pub fn iterations(&self) -> u64 {
        self.done
    }

    /// Time since the run started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

/// Operations per second for `count` operations over `elapsed`.
pub fn per_second(count: u64, elapsed: Duration) -> f64 {
    let seconds = elapsed.as_secs_f64();
    if seconds <= 0.0 {
        return 0.0;
    }
    count as f64 / seconds
}

/// Nanoseconds as microseconds.
pub fn ns_to_us(ns: f64) -> f64 {
    ns / 1_000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(values: &[u64]) -> Samples {
        let mut s = Samples::default();
        for &v in values {
            s.push_ns(v);
        }
        s
    }

    #[test]
    fn percentile_of_empty_is_zero() {
        let mut s = Samples::default();
        assert_eq!(s.percentile_ns(50.0), 0.0);
        assert_eq!(s.mean_ns(), 0.0);
        assert_eq!(s.min_ns(), 0.0);
        assert_eq!(s.max_ns(), 0.0);
    }

    #[test]
    fn percentile_nearest_rank_on_one_to_hundred() {
        // Inserted in reverse so the sort is exercised.
        let values: Vec<u64> = (1..=100).rev().collect();
        let mut s = samples(&values);
        assert_eq!(s.percentile_ns(0.0), 1.0);
        assert_eq!(s.percentile_ns(1.0), 1.0);
        assert_eq!(s.percentile_ns(50.0), 50.0);
        assert_eq!(s.percentile_ns(99.0), 99.0);
        assert_eq!(s.percentile_ns(99.9), 100.0);
        assert_eq!(s.percentile_ns(100.0), 100.0);
        assert_eq!(s.mean_ns(), 50.5);
    }

    #[test]
    fn percentile_small_sets() {
        let mut one = samples(&[7]);
        assert_eq!(one.percentile_ns(50.0), 7.0);
        assert_eq!(one.percentile_ns(99.0), 7.0);
        let mut two = samples(&[10, 20]);
        assert_eq!(two.percentile_ns(50.0), 10.0);
        assert_eq!(two.percentile_ns(51.0), 20.0);
        let mut four = samples(&[4, 1, 3, 2]);
        assert_eq!(four.percentile_ns(25.0), 1.0);
        assert_eq!(four.percentile_ns(75.0), 3.0);
        assert_eq!(four.percentile_ns(76.0), 4.0);
    }

    #[test]
    fn percentile_clamps_out_of_range() {
        let mut s = samples(&[5, 1, 9]);
        assert_eq!(s.percentile_ns(-3.0), 1.0);
        assert_eq!(s.percentile_ns(250.0), 9.0);
    }

    #[test]
    fn push_after_percentile_resorts() {
        let mut s = samples(&[10, 20, 30]);
        assert_eq!(s.percentile_ns(100.0), 30.0);
        s.push_ns(5);
        s.push(Duration::from_nanos(40));
        assert_eq!(s.percentile_ns(0.0), 5.0);
        assert_eq!(s.percentile_ns(100.0), 40.0);
        assert_eq!(s.len(), 5);
    }

    #[test]
    fn merge_combines_sets() {
        let mut a = samples(&[1, 2]);
        a.merge(samples(&[3, 4]));
        assert_eq!(a.len(), 4);
        assert_eq!(a.max_ns(), 4.0);
        assert_eq!(a.percentile_ns(50.0), 2.0);
    }

    #[test]
    fn budget_respects_min_and_max_iterations() {
        let mut run = Budget::new(3, 5, Duration::ZERO).start();
        while run.keep_going() {}
        assert_eq!(run.iterations(), 3, "zero time budget still runs the minimum");
        let mut run = Budget::new(1, 5, Duration::from_secs(60)).start();
        while run.keep_going() {}
        assert_eq!(run.iterations(), 5);
    }

    #[test]
    fn per_second_handles_zero_elapsed() {
        assert_eq!(per_second(10, Duration::ZERO), 0.0);
        assert_eq!(per_second(10, Duration::from_millis(500)), 20.0);
    }
}
