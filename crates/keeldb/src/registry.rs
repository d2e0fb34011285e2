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
struct Held {
    /// Snapshot timestamp to the number of live snapshots at it.
    snapshots: BTreeMap<u64, u32>,
    /// The history floor: every version visible at this timestamp or later is kept, whether
    /// or not a snapshot holds it (`None`: no history is kept beyond live snapshots).
    floor: Option<u64>,
}

/// Why a snapshot at a past timestamp cannot be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AtError {
    /// Versions below `horizon` may already be freed.
    Compacted { horizon: u64 },
    /// The timestamp is not visible yet.
    Future { latest: u64 },
}

#[derive(Debug, Default)]
pub(crate) struct Registry {
    held: Mutex<Held>,
}

impl Registry {
    /// Takes a snapshot at the current visible timestamp and registers it.
    pub fn acquire(&self, visible: &AtomicU64) -> u64 {
        let mut held = self.held.lock();
        let ts = visible.load(Ordering::Acquire);
        *held.snapshots.entry(ts).or_insert(0) += 1;
        ts
    }

    /// Registers a snapshot at a past (or the current) timestamp. It is refused below the
    /// horizon: the horizon never decreases (every registration is at or above it, and the
    /// floor only rises), so every version a reader at or above it needs is still there.
    pub fn acquire_at(&self, ts: u64, visible: &AtomicU64) -> std::result::Result<u64, AtError> {
        let mut held = self.held.lock();
        Self::check_readable(&held, ts, visible)?;
        *held.snapshots.entry(ts).or_insert(0) += 1;
        Ok(ts)
    }

    /// Registers one more holder of `ts`, which the caller already holds (so the horizon is at
    /// or below it and cannot move back). Released with [`Registry::release`].
    pub fn pin(&self, ts: u64) {
        *self.held.lock().snapshots.entry(ts).or_insert(0) += 1;
    }

    /// Releases a snapshot taken by [`Registry::acquire`] or [`Registry::pin`] or [`Registry::acquire_at`].
    pub fn release(&self, ts: u64) {
        let mut held = self.held.lock();
        if let Some(count) = held.snapshots.get_mut(&ts) {
            *count -= 1;
            if *count == 0 {
                held.snapshots.remove(&ts);
            }
        }
    }

    /// Whether every version visible at `ts` is still kept (at or above the horizon) and `ts`
    /// is visible; called under the lock, so the answer holds until it is released.
    fn check_readable(held: &Held, ts: u64, visible: &AtomicU64) -> std::result::Result<(), AtError> {
        let now = visible.load(Ordering::Acquire);
        if ts > now {
            return Err(AtError::Future { latest: now });
        }
        let horizon = Self::horizon_locked(held, now);
        if ts < horizon {
            return Err(AtError::Compacted { horizon });
        }
        Ok(())
    }

    fn horizon_locked(held: &Held, now: u64) -> u64 {
        let oldest = held.snapshots.keys().next().map_or(now, |&oldest| oldest.min(now));
        held.floor.map_or(oldest, |f| f.min(oldest))
    }

    /// The oldest timestamp any live or future snapshot can read at (the history floor
    /// included): versions below what is visible here may be freed.
    pub fn horizon(&self, visible: &AtomicU64) -> u64 {
        let held = self.held.lock();
        Self::horizon_locked(&held, visible.load(Ordering::Acquire))
    }

    /// The oldest timestamp a live snapshot reads at, ignoring the history floor: conflict
    /// records at or below it can be forgotten (only live transactions can conflict).
    pub fn live_horizon(&self, visible: &AtomicU64) -> u64 {
        let held = self.held.lock();
        let now = visible.load(Ordering::Acquire);
        held.snapshots.keys().next().map_or(now, |&oldest| oldest.min(now))
    }

    /// Moves the history floor to `ts` (keeping history from there on). Returns the floor in
    /// force. Refused below the current horizon (that history is gone) or above `visible`.
    pub fn set_floor(&self, ts: u64, visible: &AtomicU64) -> std::result::Result<u64, AtError> {
        let mut held = self.held.lock();
        Self::check_readable(&held, ts, visible)?;
        held.floor = Some(ts);
        Ok(ts)
    }

    /// Sets the history floor recovery rebuilt history from, before anything can register a
    /// snapshot or read: every version at or above it is in the index.
    pub fn restore_floor(&self, ts: u64) {
        self.held.lock().floor = Some(ts);
    }

    /// Stops keeping history beyond live snapshots.
    pub fn clear_floor(&self) {
        self.held.lock().floor = None;
    }

    /// The history floor, if history is kept.
    pub fn floor(&self) -> Option<u64> {
        self.held.lock().floor
    }

    #[cfg(test)]
    pub fn live(&self) -> usize {
        self.held.lock().snapshots.values().map(|&c| c as usize).sum()
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
