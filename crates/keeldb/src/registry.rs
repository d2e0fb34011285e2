//! The snapshot registry: which snapshot timestamps live transactions hold.
//!
//! It answers one question, the horizon: the oldest timestamp any current or future snapshot
//! may read at. Versions older than what is visible at the horizon can be freed, and conflict
//! records at or below it can be forgotten. Registration and the horizon both read the visible
//! timestamp under the registry's lock, so a snapshot can never start below a horizon that was
//! already handed out.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

#[derive(Debug, Default)]
pub(crate) struct Registry {
    held: Mutex<BTreeMap<u64, u32>>,
}

impl Registry {
    /// Takes a snapshot at the current visible timestamp and registers it.
    pub fn acquire(&self, visible: &AtomicU64) -> u64 {
        let mut held = self.held.lock();
        let ts = visible.load(Ordering::Acquire);
        *held.entry(ts).or_insert(0) += 1;
        ts
    }

    /// Registers one more holder of `ts`, which the caller already holds (so the horizon is at
    /// or below it and cannot move back). Released with [`Registry::release`].
    pub fn pin(&self, ts: u64) {
        *self.held.lock().entry(ts).or_insert(0) += 1;
    }

    /// Releases a snapshot taken by [`Registry::acquire`] or [`Registry::pin`].
    pub fn release(&self, ts: u64) {
        let mut held = self.held.lock();
        if let Some(count) = held.get_mut(&ts) {
            *count -= 1;
            if *count == 0 {
                held.remove(&ts);
            }
        }
    }

    /// The oldest timestamp any live or future snapshot can read at.
    pub fn horizon(&self, visible: &AtomicU64) -> u64 {
        let held = self.held.lock();
        let now = visible.load(Ordering::Acquire);
        held.keys().next().map_or(now, |&oldest| oldest.min(now))
    }

    /// Number of live snapshots.
    #[cfg(test)]
    pub fn live(&self) -> usize {
        self.held.lock().values().map(|&c| c as usize).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn horizon_is_the_oldest_held_snapshot() {
        let r = Registry::default();
        let visible = AtomicU64::new(5);
        let a = r.acquire(&visible);
        visible.store(9, Ordering::Release);
        let b = r.acquire(&visible);
        assert_eq!((a, b), (5, 9));
        assert_eq!(r.horizon(&visible), 5);
        r.release(a);
        assert_eq!(r.horizon(&visible), 9);
        r.release(b);
        visible.store(12, Ordering::Release);
        assert_eq!(r.horizon(&visible), 12);
        assert_eq!(r.live(), 0);
    }
}
