//! The member's own small files (identity, snapshot file) and directories, over the engine's
//! file-system seam ([`keeldb::fs::FileSystem`]), so that every byte a member keeps goes
//! through one file system: the real one, or a simulated disk in the tests.
//!
//! It owns durable creation (a new directory's entry is synced into its parent; a file is
//! written under a temporary name, synced, renamed and its directory synced) and removal. It
//! must not know what the files hold.

use std::io;
use std::path::{Path, PathBuf};

use keeldb::fs::{read_all, write_all_at, FileSystem, OpenMode};

/// Reads a whole file; `None` if it does not exist.
pub fn read(fs: &dyn FileSystem, path: &Path) -> io::Result<Option<Vec<u8>>> {
    match fs.open(path, OpenMode::Read) {
        Ok(f) => read_all(f.as_ref()).map(Some),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Replaces `path` with `bytes` atomically and durably: written to `<path>.tmp`, synced,
/// renamed over `path`, directory synced. After a crash `path` holds the old or the new bytes
/// whole; once this returns, the new bytes survive a power loss.
pub fn write_durably(fs: &dyn FileSystem, path: &Path, bytes: &[u8]) -> io::Result<()> {
    let tmp = path.with_extension("tmp");
    // A temporary file left by a crash in an earlier write holds nothing anyone needs.
    if fs.exists(&tmp)? {
        fs.remove_file(&tmp)?;
    }
    let file = fs.open(&tmp, OpenMode::CreateNew)?;
    write_all_at(file.as_ref(), bytes, 0)?;
    file.sync_data()?;
    drop(file);
    fs.rename(&tmp, path)?;
    fs.sync_dir(&parent(path))
}

fn parent(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Creates `dir` and its missing parents, syncing each new directory's parent so a power loss
/// cannot take the new entries (and everything later written below them) away.
pub fn create_dir_durably(fs: &dyn FileSystem, dir: &Path) -> io::Result<()> {
    let mut missing = Vec::new();
    let mut cur = Some(dir);
    while let Some(p) = cur {
        if p.as_os_str().is_empty() || fs.exists(p)? {
            break;
        }
        missing.push(p.to_path_buf());
        cur = p.parent();
    }
    fs.create_dir_all(dir)?;
    for p in missing.iter().rev() {
        fs.sync_dir(&parent(p))?;
    }
    Ok(())
}

/// Removes `dir` and everything below it (not made durable: a crash may bring entries back,
/// which callers must tolerate).
pub fn remove_tree(fs: &dyn FileSystem, dir: &Path) -> io::Result<()> {
    for name in fs.list_dir(dir)? {
        let path = dir.join(name);
        // Only a directory can be listed.
        if fs.list_dir(&path).is_ok() {
            remove_tree(fs, &path)?;
        } else {
            fs.remove_file(&path)?;
        }
    }
    fs.remove_dir(dir)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use keeldb::fs::StdFs;

    #[test]
    fn durable_write_replaces_and_tree_removal_removes() {
        let tmp = tempfile::tempdir().unwrap();
        let fs = StdFs;
        let dir = tmp.path().join("a/b");
        create_dir_durably(&fs, &dir).unwrap();
        let file = dir.join("f");
        assert_eq!(read(&fs, &file).unwrap(), None);
        write_durably(&fs, &file, b"one").unwrap();
        // A temporary file left by an interrupted write does not block the next one.
        std::fs::write(file.with_extension("tmp"), b"junk").unwrap();
        write_durably(&fs, &file, b"two").unwrap();
        assert_eq!(read(&fs, &file).unwrap().as_deref(), Some(&b"two"[..]));
        assert!(!file.with_extension("tmp").exists());
        remove_tree(&fs, &tmp.path().join("a")).unwrap();
        assert!(!tmp.path().join("a").exists());
    }
}
