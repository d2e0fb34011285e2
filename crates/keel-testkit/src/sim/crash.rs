//! Crash resolution: what a power loss leaves on the simulated disk.
//!
//! For every directory, a crash keeps either none or a random prefix of the entry operations
//! since its last `sync_dir` (journaling file systems commit metadata in order, and may commit
//! any of it before a sync). For every file, it keeps none, all, a random prefix or a random
//! subset of the changes since its last successful `sync_data` (the page cache writes back
//! dirty pages in any order); tears the last kept write at 512-byte sector granularity (its
//! missing sectors keep their old bytes or read as zeros); and may flip bits inside the kept
//! unsynced bytes. Durable bytes are never touched. The rules are written down with their
//! reasons in `docs/RELIABILITY.md`.

use std::collections::BTreeSet;

use super::state::{write_into, Change, Dir, DirId, Inode, Node, State, ROOT};
use super::CrashReport;
use crate::rng::SimRng;

/// Sector size: the unit a torn write is cut at.
pub const SECTOR_BYTES: u64 = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FileLoss {
    DropAll,
    KeepAll,
    KeepPrefix,
    KeepSubset,
}

impl FileLoss {
    fn name(self) -> &'static str {
        match self {
            FileLoss::DropAll => "drop-all",
            FileLoss::KeepAll => "keep-all",
            FileLoss::KeepPrefix => "keep-prefix",
            FileLoss::KeepSubset => "keep-subset",
        }
    }
}

/// Resolves a power loss in place and returns what was done.
pub(crate) fn power_loss(st: &mut State) -> CrashReport {
    let mut report = CrashReport::default();
    let loss = match st.rng.below(4) {
        0 => FileLoss::DropAll,
        1 => FileLoss::KeepAll,
        2 => FileLoss::KeepPrefix,
        _ => FileLoss::KeepSubset,
    };
    report.file_loss = loss.name();
    let keep_dir_prefix = st.rng.chance(st.model.dir_prefix_probability);
    report.dir_prefix = keep_dir_prefix;

    let dir_ids: Vec<DirId> = st.dirs.keys().copied().collect();
    for id in dir_ids {
        let Some(dir) = st.dirs.get_mut(&id) else { continue };
        resolve_dir(dir, keep_dir_prefix, &mut st.rng, &mut report);
    }
    collect_unreachable(st);

    let model = st.model.clone();
    let inode_ids: Vec<u64> = st.inodes.keys().copied().collect();
    for id in inode_ids {
        let Some(inode) = st.inodes.get_mut(&id) else { continue };
        resolve_file(inode, loss, &model, &mut report);
    }
    st.stats.crashes += 1;
    st.stats.writes_kept += report.writes_kept;
    st.stats.writes_dropped += report.writes_dropped;
    st.stats.torn_writes += report.torn_writes;
    st.stats.bit_flips += report.bit_flips;
    st.stats.dir_ops_kept += report.dir_ops_kept;
    st.stats.dir_ops_forgotten += report.dir_ops_forgotten;
    report
}

fn resolve_dir(dir: &mut Dir, keep_prefix: bool, rng: &mut SimRng, report: &mut CrashReport) {
    let total = dir.log.len() as u64;
    let keep = if keep_prefix { rng.below(total + 1) } else { 0 };
    for op in dir.log.iter().take(keep as usize) {
        op.apply(&mut dir.durable);
    }
    report.dir_ops_kept += keep;
    report.dir_ops_forgotten += total - keep;
    dir.log.clear();
    dir.current = dir.durable.clone();
}

/// Drops directories and files no durable entry reaches any more.
fn collect_unreachable(st: &mut State) {
    let mut dirs = BTreeSet::new();
    let mut files = BTreeSet::new();
    let mut stack = vec![ROOT];
    while let Some(d) = stack.pop() {
        if !dirs.insert(d) {
            continue;
        }
        if let Some(dir) = st.dirs.get(&d) {
            for node in dir.current.values() {
                match node {
                    Node::Dir(child) => stack.push(*child),
                    Node::File(f) => {
                        files.insert(*f);
                    }
                }
            }
        }
    }
    st.dirs.retain(|id, _| dirs.contains(id));
    st.inodes.retain(|id, _| files.contains(id));
}

/// The byte range of one kept write after tearing.
type Range = (u64, u64);

fn resolve_file(inode: &mut Inode, loss: FileLoss, model: &super::FaultModel, report: &mut CrashReport) {
    let mut file_rng = inode.rng.clone();
    let rng = &mut file_rng;
    let candidates: Vec<&Change> = inode.pending.iter().filter(|p| !p.lost).map(|p| &p.change).collect();
    let lost = inode.pending.len() - candidates.len();
    report.writes_dropped += lost as u64;
    if candidates.is_empty() {
        inode.pending.clear();
        inode.visible = inode.durable.clone();
        return;
    }
    let n = candidates.len();
    let kept: Vec<bool> = match loss {
        FileLoss::DropAll => vec![false; n],
        FileLoss::KeepAll => vec![true; n],
        FileLoss::KeepPrefix => {
            let k = rng.index(n + 1);
            (0..n).map(|i| i < k).collect()
        }
        FileLoss::KeepSubset => (0..n).map(|_| rng.chance(0.5)).collect(),
    };
    let last_write =
        (0..n).rev().find(|&i| kept.get(i) == Some(&true) && matches!(candidates.get(i), Some(Change::Write { .. })));
    let mut content = inode.durable.clone();
    let mut ranges: Vec<Range> = Vec::new();
    for (i, change) in candidates.iter().enumerate() {
        if kept.get(i) != Some(&true) {
            report.writes_dropped += 1;
            continue;
        }
        report.writes_kept += 1;
        match change {
            Change::Write { offset, data } if Some(i) == last_write && rng.chance(model.tear_probability) => {
                report.torn_writes += 1;
                tear(&mut content, *offset, data, rng, &mut ranges);
            }
            Change::Write { offset, data } => {
                write_into(&mut content, *offset, data);
                ranges.push((*offset, *offset + data.len() as u64));
            }
            Change::SetLen(_) => change.apply(&mut content),
        }
    }
    if !ranges.is_empty() && rng.chance(model.bit_flip_probability) {
        for _ in 0..rng.range(1, 3) {
            if flip_bit(&mut content, &ranges, rng) {
                report.bit_flips += 1;
            }
        }
    }
    report.files_affected += 1;
    inode.rng = file_rng;
    inode.pending.clear();
    inode.durable = content;
    inode.visible = inode.durable.clone();
}

/// Writes only some 512-byte sectors of a write: a prefix of them (the classic torn write) or
/// a scattered subset (sectors reaching the platter out of order). Missing sectors keep their
/// old bytes; past the old end of file they may read as zeros (the size reached the disk
/// before the data did).
fn tear(content: &mut Vec<u8>, offset: u64, data: &[u8], rng: &mut SimRng, ranges: &mut Vec<Range>) {
    let end = offset + data.len() as u64;
    let first_sector = offset / SECTOR_BYTES;
    let last_sector = (end.saturating_sub(1)) / SECTOR_BYTES;
    let sectors = last_sector - first_sector + 1;
    let prefix_only = rng.chance(0.6);
    let cut = rng.below(sectors); // Sectors kept by a prefix tear: always fewer than all.
    let zero_missing = rng.chance(0.3);
    let old_len = content.len() as u64;
    for s in 0..sectors {
        let keep = if prefix_only { s < cut } else { rng.chance(0.5) };
        let lo = ((first_sector + s) * SECTOR_BYTES).max(offset);
        let hi = ((first_sector + s + 1) * SECTOR_BYTES).min(end);
        let piece = data.get((lo - offset) as usize..(hi - offset) as usize).unwrap_or_default();
        if keep {
            write_into(content, lo, piece);
            ranges.push((lo, hi));
        } else if zero_missing && hi > old_len {
            // Sectors are atomic: an overwritten sector keeps its old bytes, but a sector past
            // the old end of file can read as zeros when the size reached the disk first.
            let from = lo.max(old_len);
            write_into(content, from, &vec![0u8; (hi - from) as usize]);
        }
    }
}

/// Flips one random bit inside the kept unsynced ranges. Returns false if none is in the file.
fn flip_bit(content: &mut [u8], ranges: &[Range], rng: &mut SimRng) -> bool {
    let Some(&(lo, hi)) = rng.pick(ranges) else { return false };
    let hi = hi.min(content.len() as u64);
    if hi <= lo {
        return false;
    }
    let at = rng.range(lo, hi - 1) as usize;
    let bit = rng.below(8) as u32;
    match content.get_mut(at) {
        Some(byte) => {
            *byte ^= 1u8 << bit;
            true
        }
        None => false,
    }
}
