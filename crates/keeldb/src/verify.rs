//! Offline integrity check behind `keel verify`: re-reads every checkpoint block and WAL frame,
//! recomputes the state digest and compares it with the digests recorded in checkpoints and in
//! the clean-close mark. Changes nothing on disk; holds the directory lock while it reads.

use std::path::{Path, PathBuf};

use crate::checkpoint::{parse_checkpoint_name, read_checkpoint_file, Discard, READ_WINDOW};
use crate::digest::StateDigest;
use crate::error::{Error, Result};
use crate::fs::{FileSystem, OpenMode, StdFs};
use crate::recovery::{analyze_keeping, HistoryMode, RecoveryReport, Scan};

/// The outcome of [`verify`].
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    /// Checkpoints that verified (path, timestamp, entries, state digest).
    pub checkpoints_ok: Vec<(PathBuf, u64, u64, StateDigest)>,
    /// Problems found: where and what. Empty when the store is intact.
    pub problems: Vec<String>,
    /// Notes that are not corruption (for example a torn tail that open would truncate).
    pub notes: Vec<String>,
    /// What a recovery would do, when the WAL could be read through.
    pub recovery: Option<RecoveryReport>,
    /// The recomputed digest of the state a recovery would produce.
    pub digest: Option<StateDigest>,
}

impl VerifyReport {
    /// True when no corruption was found.
    pub fn is_intact(&self) -> bool {
        self.problems.is_empty()
    }
}

impl std::fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (p, ts, n, d) in &self.checkpoints_ok {
            writeln!(f, "ok       checkpoint {} (ts {ts}, {n} entries, digest {d})", p.display())?;
        }
        if let Some(r) = &self.recovery {
            writeln!(
                f,
                "ok       WAL: {} segments, {} frames after the checkpoint, last ts {}",
                r.segments_scanned, r.frames_replayed, r.last_ts
            )?;
        }
        if let Some(d) = self.digest {
            writeln!(f, "digest   {d}")?;
        }
        for n in &self.notes {
            writeln!(f, "note     {n}")?;
        }
        for p in &self.problems {
            writeln!(f, "CORRUPT  {p}")?;
        }
        write!(f, "{}", if self.is_intact() { "intact" } else { "corruption found" })
    }
}

/// Verifies the store at `path`. Returns `Err` only when the path cannot be checked at all
/// (missing, not a store, locked by another handle, unreadable); corruption is reported in
/// the returned [`VerifyReport`].
pub fn verify(path: impl AsRef<Path>) -> Result<VerifyReport> {
    verify_with(&StdFs, path.as_ref())
}

pub(crate) fn verify_with(fs: &dyn FileSystem, dir: &Path) -> Result<VerifyReport> {
    if !fs.exists(&dir.join(crate::files::IDENTITY_FILE)).map_err(|e| Error::io(dir, e))? {
        return Err(Error::NotAStore { path: dir.to_owned(), reason: "no KEELDB identity file".into() });
    }
    let _lock = fs.lock_exclusive(&dir.join("LOCK")).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock => Error::Locked(dir.to_owned()),
        _ => Error::io(dir, e),
    })?;
    let mut report = VerifyReport::default();
    // The identity file is checked the way open checks it: a damaged one makes open fail, so
    // verify must not call the store intact.
    match crate::db::check_identity(fs, dir) {
        Ok(_) => {}
        Err(Error::Corruption { location, reason }) => report.problems.push(format!("{location}: {reason}")),
        Err(e) => return Err(e),
    }
    let mut names = fs.list_dir(dir).map_err(|e| Error::io(dir, e))?;
    names.sort();
    for name in &names {
        let Some(ts) = parse_checkpoint_name(name) else { continue };
        let p = dir.join(name);
        let file = fs.open(&p, OpenMode::Read).map_err(|e| Error::io(&p, e))?;
        let read = read_checkpoint_file(file.as_ref(), READ_WINDOW, &mut Discard).map_err(|e| Error::io(&p, e))?;
        match read {
            Ok(s) if s.ts == ts => report.checkpoints_ok.push((p, ts, s.entries, s.digest)),
            Ok(_) => report.problems.push(format!("{}: timestamp differs from the file name", p.display())),
            Err((off, why)) => report.problems.push(format!("{} at offset {off}: {why}", p.display())),
        }
    }
    // The newest checkpoint's history is rebuilt too: records that pass every CRC but do not
    // lead back to its state would refuse an open that keeps history.
    match analyze_keeping(fs, dir, Scan::Everything, HistoryMode::Check) {
        Ok(a) => {
            if let Some((p, off)) = &a.report.torn_tail {
                if a.report.discarded_frames > 0 {
                    // Whole, checksummed commits after bad bytes: open would drop commits that
                    // were written. That is either damage or a power loss that kept later
                    // unsynced writes and lost earlier ones; verify cannot tell which, and
                    // must not call a store intact when open would lose a commit.
                    report.problems.push(format!(
                        "{} at offset {off}: bad bytes followed by {} checksummed frames that open would discard \
                         (damage, or a power loss in relaxed/periodic mode that kept later unsynced writes)",
                        p.display(),
                        a.report.discarded_frames
                    ));
                } else {
                    report.notes.push(format!(
                        "torn tail in {} at offset {off} ({} bytes, no whole frame after it): open will truncate it",
                        p.display(),
                        a.report.bytes_truncated
                    ));
                }
            }
            if let Some(mark) = a.mark_digest {
                if a.tear.is_none() && mark != a.state.digest.0 {
                    report.problems.push(format!(
                        "state digest after replay {} differs from the digest recorded at close {}",
                        a.state.digest,
                        StateDigest(mark)
                    ));
                }
            }
            report.digest = Some(a.state.digest);
            report.recovery = Some(a.report);
        }
        Err(Error::Corruption { location, reason }) => report.problems.push(format!("{location}: {reason}")),
        Err(e) => return Err(e),
    }
    Ok(report)
}
