//! The clean-close marker: a small file, written atomically at every clean close, that says
//! how far the WAL was durable and which commit was the last. It owns that file's format and
//! its atomic replacement; it decides nothing about recovery (recovery.rs reads it).
//!
//! Why a file and not only the mark frame at the end of the log: the frames of a `relaxed` or
//! `periodic` store are claimed durable only by later frames, and the newest frames by nothing.
//! A mark frame can claim them, but damage that covers the last commit frame and the mark frame
//! together would take the claim with it and look like a torn tail. The marker lives in another
//! file, so no single damaged range can remove both a commit and the claim that protects it.
//!
//! The claim never becomes false: WAL LSNs only grow, and recovery truncates only bytes past
//! every claim (this one included), so the bytes below `end_lsn` are never rewritten. The one
//! operation that replaces the log wholesale, a checkpoint install, retires the marker (removes
//! it and fsyncs the directory) before its commit point.

use std::path::Path;

use crate::codec::{le_u32, le_u64};
use crate::error::{Error, Result};
use crate::fs::{read_all, write_all_at, FileSystem, OpenMode};

/// File name of the marker.
pub(crate) const CLOSE_MARKER: &str = "CLOSED";
const MAGIC: &[u8; 8] = b"KEELCLS\0";
const BYTES: usize = 8 + 8 + 8 + 16 + 4;

/// What a clean close made durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CloseMarker {
    /// Every WAL byte before this LSN was fdatasynced before the marker was written.
    pub end_lsn: u64,
    /// The last commit timestamp at close.
    pub last_ts: u64,
    /// The state digest at close.
    pub digest: u128,
}

impl CloseMarker {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(BYTES);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.end_lsn.to_le_bytes());
        out.extend_from_slice(&self.last_ts.to_le_bytes());
        out.extend_from_slice(&self.digest.to_le_bytes());
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> std::result::Result<CloseMarker, &'static str> {
        if bytes.len() != BYTES {
            return Err("close marker has the wrong size");
        }
        let body = bytes.get(..BYTES - 4).ok_or("close marker has the wrong size")?;
        if le_u32(bytes, BYTES - 4) != Some(crc32c::crc32c(body)) {
            return Err("close marker checksum mismatch");
        }
        if bytes.get(..8) != Some(&MAGIC[..]) {
            return Err("bad close marker magic");
        }
        let digest = bytes.get(24..40).and_then(|d| <[u8; 16]>::try_from(d).ok()).ok_or("close marker digest")?;
        Ok(CloseMarker {
            end_lsn: le_u64(bytes, 8).ok_or("close marker LSN")?,
            last_ts: le_u64(bytes, 16).ok_or("close marker timestamp")?,
            digest: u128::from_le_bytes(digest),
        })
    }
}

/// Reads the marker. `Ok(None)` when there is none; a damaged marker is corruption (it was
/// written atomically, so a crash never leaves a partial one).
pub(crate) fn read(fs: &dyn FileSystem, dir: &Path) -> Result<Option<CloseMarker>> {
    let path = dir.join(CLOSE_MARKER);
    if !fs.exists(&path).map_err(|e| Error::io(&path, e))? {
        return Ok(None);
    }
    let bytes = fs.open(&path, OpenMode::Read).and_then(|f| read_all(f.as_ref())).map_err(|e| Error::io(&path, e))?;
    CloseMarker::decode(&bytes).map(Some).map_err(|why| Error::corruption(&path, 0, why))
}

/// Removes the marker, if there is one, and fsyncs the directory before returning: a checkpoint
/// install retires it before its commit point, because the new state starts a new WAL that the
/// old marker's claim (its LSN, timestamp and digest) does not describe. Returns whether there
/// was one.
pub(crate) fn retire(fs: &dyn FileSystem, dir: &Path) -> Result<bool> {
    let path = dir.join(CLOSE_MARKER);
    if !fs.exists(&path).map_err(|e| Error::io(&path, e))? {
        return Ok(false);
    }
    fs.remove_file(&path).map_err(|e| Error::io(&path, e))?;
    fs.sync_dir(dir).map_err(|e| Error::io(dir, e))?;
    Ok(true)
}

/// Replaces the marker atomically: temp file, fdatasync, rename, directory fsync.
pub(crate) fn write(fs: &dyn FileSystem, dir: &Path, marker: &CloseMarker) -> Result<()> {
    let tmp = dir.join(format!("{CLOSE_MARKER}.tmp"));
    let path = dir.join(CLOSE_MARKER);
    if fs.exists(&tmp).map_err(|e| Error::io(&tmp, e))? {
        fs.remove_file(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    let f = fs.open(&tmp, OpenMode::CreateNew).map_err(|e| Error::io(&tmp, e))?;
    write_all_at(f.as_ref(), &marker.encode(), 0).map_err(|e| Error::io(&tmp, e))?;
    f.sync_data().map_err(|e| Error::io(&tmp, e))?;
    drop(f);
    fs.rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
    fs.sync_dir(dir).map_err(|e| Error::io(dir, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_every_flipped_bit() {
        let m = CloseMarker { end_lsn: 4096, last_ts: 77, digest: 0x1234_5678_9abc_def0_1122_3344_5566_7788 };
        let bytes = m.encode();
        assert_eq!(CloseMarker::decode(&bytes), Ok(m));
        for bit in 0..bytes.len() * 8 {
            let mut bad = bytes.clone();
            if let Some(b) = bad.get_mut(bit / 8) {
                *b ^= 1 << (bit % 8);
            }
            assert!(CloseMarker::decode(&bad).is_err(), "bit {bit}");
        }
        assert!(CloseMarker::decode(&bytes[..10]).is_err());
    }
}
