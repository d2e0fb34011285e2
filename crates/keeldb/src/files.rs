//! Every file name in a store directory, in one place: the identity file, the lock, the poison
//! and install markers, the recovery log, the accounting totals, WAL segments and checkpoints (their naming
//! and parsing, and the `.tmp` / `.corrupt` suffixes).
//!
//! This module only names files; it never opens, reads or writes one. Formats live with their
//! readers and writers (`wal.rs`, `checkpoint.rs`, `accounting.rs`, `recovery.rs`, `db.rs`), and
//! `docs/design/format.md` lists the same names for readers of the directory.

/// The identity file that marks a directory as a KeelDB store.
pub(crate) const IDENTITY_FILE: &str = "KEELDB";
/// The magic bytes at the start of the identity file.
pub(crate) const IDENTITY_MAGIC: &[u8; 8] = b"KEELDB\0\0";
/// The empty file a handle holds `flock(LOCK_EX)` on.
pub(crate) const LOCK_FILE: &str = "LOCK";
/// Written (best effort, not synced) when a WAL write or fsync fails, holding the durable LSN
/// at that moment. Its presence at the next open means the page cache may hold WAL bytes that
/// never reached the disk (fsyncgate); see `recovery.rs`.
pub(crate) const POISON_MARKER: &str = "POISONED";
/// The append-only audit trail of recoveries: one JSON line per open.
pub(crate) const RECOVERY_LOG: &str = "recovery.log";
/// Per-tag CPU and latency totals (informational).
pub(crate) const ACCOUNTING_FILE: &str = "accounting.txt";
/// Present only while a checkpoint install is being completed: names the installed checkpoint
/// and the new WAL's first segment (`install.rs`). Written under [`TMP_SUFFIX`] first.
pub(crate) const INSTALL_MARKER: &str = "INSTALL";
/// Suffix of a file being written before its atomic rename into place.
pub(crate) const TMP_SUFFIX: &str = ".tmp";
/// Suffix recovery gives a checkpoint that failed verification.
pub(crate) const CORRUPT_SUFFIX: &str = ".corrupt";

const SEGMENT_PREFIX: &str = "wal-";
const SEGMENT_SUFFIX: &str = ".log";
const CHECKPOINT_PREFIX: &str = "checkpoint-";
const CHECKPOINT_SUFFIX: &str = ".kc";

/// File name of WAL segment `seq` (16 decimal digits).
pub(crate) fn segment_name(seq: u64) -> String {
    format!("{SEGMENT_PREFIX}{seq:016}{SEGMENT_SUFFIX}")
}

/// Parses a segment file name back to its sequence number.
pub(crate) fn parse_segment_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(SEGMENT_PREFIX)?.strip_suffix(SEGMENT_SUFFIX)?;
    if digits.len() != 16 {
        return None;
    }
    digits.parse().ok()
}

/// File name of the checkpoint at commit timestamp `ts` (20 decimal digits).
pub(crate) fn checkpoint_name(ts: u64) -> String {
    format!("{CHECKPOINT_PREFIX}{ts:020}{CHECKPOINT_SUFFIX}")
}

/// Parses a checkpoint file name back to its timestamp.
pub(crate) fn parse_checkpoint_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(CHECKPOINT_PREFIX)?.strip_suffix(CHECKPOINT_SUFFIX)?;
    if digits.len() != 20 {
        return None;
    }
    digits.parse().ok()
}

/// Whether `name` is a checkpoint still being written (left behind by a crash).
pub(crate) fn is_checkpoint_tmp(name: &str) -> bool {
    name.strip_suffix(TMP_SUFFIX).is_some_and(|n| n.starts_with(CHECKPOINT_PREFIX) && n.ends_with(CHECKPOINT_SUFFIX))
}

/// The temporary name `name` is written under before its rename.
pub(crate) fn tmp_name(name: &str) -> String {
    format!("{name}{TMP_SUFFIX}")
}

/// Whether a directory holding only files with these names is an unfinished creation (a crash
/// before the identity file was renamed into place), which `open` may create again.
pub(crate) fn is_creation_leftover(name: &str) -> bool {
    name == LOCK_FILE || name == POISON_MARKER || parse_segment_name(name).is_some() || name.ends_with(TMP_SUFFIX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        assert_eq!(parse_segment_name(&segment_name(42)), Some(42));
        assert_eq!(parse_segment_name("wal-12.log"), None);
        assert_eq!(parse_segment_name("checkpoint-1.kc"), None);
        assert_eq!(parse_checkpoint_name(&checkpoint_name(12345)), Some(12345));
        assert_eq!(parse_checkpoint_name("checkpoint-1.kc"), None);
        assert_eq!(parse_checkpoint_name("checkpoint-00000000000000000001.kc.tmp"), None);
        assert!(is_checkpoint_tmp(&tmp_name(&checkpoint_name(7))));
        assert!(!is_checkpoint_tmp(&checkpoint_name(7)));
        assert!(is_creation_leftover(&segment_name(1)) && is_creation_leftover(LOCK_FILE));
        assert!(!is_creation_leftover(IDENTITY_FILE) && !is_creation_leftover("notes.txt"));
    }
}
