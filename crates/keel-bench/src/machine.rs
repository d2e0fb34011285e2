//! Facts about the machine a benchmark ran on: CPU count, OS and kernel, the file system under
//! the benchmark directory (from `/proc/mounts`), and this process's resident memory.
//!
//! This module knows nothing about KeelDB; it must stay compilable without the engine. Every
//! probe degrades to "unknown" rather than failing the run.

use std::path::{Path, PathBuf};

/// Number of CPUs this process may run on.
pub fn cpus() -> u32 {
    std::thread::available_parallelism().map(|n| u32::try_from(n.get()).unwrap_or(u32::MAX)).unwrap_or(1)
}

/// The OS name and kernel release, for example `linux 6.8.0-45-generic`.
pub fn os() -> String {
    let release =
        std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|text| text.trim().to_string()).unwrap_or_default();
    if release.is_empty() {
        std::env::consts::OS.to_string()
    } else {
        format!("{} {release}", std::env::consts::OS)
    }
}

/// One line of `/proc/mounts`: where a file system is mounted and its type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// The device or source field.
    pub device: String,
    /// The mount point, with the kernel's octal escapes (`\040` for a space) decoded.
    pub mount_point: PathBuf,
    /// The file-system type, for example `ext4` or `tmpfs`.
    pub fs_type: String,
}

/// Parses the text of `/proc/mounts`, skipping malformed lines.
pub fn parse_mounts(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let device = fields.next()?;
            let mount_point = fields.next()?;
            let fs_type = fields.next()?;
            Some(Mount {
                device: unescape_mount_field(device),
                mount_point: PathBuf::from(unescape_mount_field(mount_point)),
                fs_type: fs_type.to_string(),
            })
        })
        .collect()
}

/// Decodes the `\ooo` octal escapes the kernel uses for space, tab, newline and backslash.
fn unescape_mount_field(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() {
            let digits = &bytes[i + 1..i + 4];
            if digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let value = digits.iter().fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                if let Ok(byte) = u8::try_from(value) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The mount whose mount point is the longest path prefix of `path` (component-wise, so
/// `/data` does not match `/database`). Later lines win ties, as later mounts shadow earlier
/// ones at the same point.
pub fn mount_for<'a>(mounts: &'a [Mount], path: &Path) -> Option<&'a Mount> {
    let mut best: Option<&Mount> = None;
    for mount in mounts {
        if !path.starts_with(&mount.mount_point) {
            continue;
        }
        let longer = match best {
            None => true,
            Some(b) => mount.mount_point.components().count() >= b.mount_point.components().count(),
        };
        if longer {
            best = Some(mount);
        }
    }
    best
}

/// The file-system type under `path` (for example `ext4`), or `unknown`.
pub fn filesystem_of(path: &Path) -> String {
    let resolved = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let Ok(text) = std::fs::read_to_string("/proc/mounts") else {
        return "unknown".to_string();
    };
    let mounts = parse_mounts(&text);
    mount_for(&mounts, &resolved).map_or_else(|| "unknown".to_string(), |m| m.fs_type.clone())
}

/// Parses the `VmRSS:` line of `/proc/self/status` text into bytes.
pub fn parse_vm_rss_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
    let mut fields = line.split_whitespace().skip(1);
    let amount: u64 = fields.next()?.parse().ok()?;
    let multiplier = match fields.next().unwrap_or("kB") {
        "kB" | "KB" | "kb" => 1024,
        "mB" | "MB" => 1024 * 1024,
        "B" => 1,
        _ => return None,
    };
    Some(amount * multiplier)
}

/// This process's resident set size in bytes, when `/proc/self/status` is readable.
pub fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_vm_rss_bytes(&status)
}

/// The short commit hash of the working directory's git checkout, when there is one, with
/// `+dirty` when tracked files have uncommitted changes (the figures then measured those too).
pub fn git_commit() -> Option<String> {
    let output = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    let hash = String::from_utf8(output.stdout).ok()?.trim().to_string();
    if hash.is_empty() {
        return None;
    }
    let dirty = std::process::Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .is_some_and(|o| !o.stdout.is_empty());
    Some(if dirty { format!("{hash}+dirty") } else { hash })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTS: &str = "\
proc /proc proc rw,relatime 0 0
/dev/vda / ext4 rw,relatime,discard 0 0
tmpfs /dev/shm tmpfs rw,relatime 0 0
/dev/vdb /data xfs rw,relatime 0 0
/dev/vdc /data/fast btrfs rw,relatime 0 0
tmpfs /tmp/with\\040space tmpfs rw 0 0
overlay /var/lib/docker overlay rw 0 0
garbage-line
";

    #[test]
    fn parses_fields_and_skips_malformed_lines() {
        let mounts = parse_mounts(MOUNTS);
        assert_eq!(mounts.len(), 7);
        assert_eq!(mounts[1].device, "/dev/vda");
        assert_eq!(mounts[1].mount_point, PathBuf::from("/"));
        assert_eq!(mounts[1].fs_type, "ext4");
    }

    #[test]
    fn decodes_octal_escapes() {
        let mounts = parse_mounts(MOUNTS);
        assert_eq!(mounts[5].mount_point, PathBuf::from("/tmp/with space"));
        assert_eq!(unescape_mount_field("a\\011b\\134c"), "a\tb\\c");
        assert_eq!(unescape_mount_field("trailing\\04"), "trailing\\04");
        assert_eq!(unescape_mount_field("\\999"), "\\999");
    }

    #[test]
    fn picks_longest_component_prefix() {
        let mounts = parse_mounts(MOUNTS);
        let fs = |p: &str| mount_for(&mounts, Path::new(p)).map(|m| m.fs_type.clone());
        assert_eq!(fs("/tmp/bench").as_deref(), Some("ext4"));
        assert_eq!(fs("/data/x").as_deref(), Some("xfs"));
        assert_eq!(fs("/data").as_deref(), Some("xfs"));
        assert_eq!(fs("/data/fast/run1").as_deref(), Some("btrfs"));
        assert_eq!(fs("/database/x").as_deref(), Some("ext4"), "not a string prefix match");
        assert_eq!(fs("/tmp/with space/db").as_deref(), Some("tmpfs"));
        assert_eq!(fs("relative/path"), None);
    }

    #[test]
    fn later_mount_at_same_point_wins() {
        let mounts = parse_mounts("a / ext4 rw 0 0\nb / overlay rw 0 0\n");
        assert_eq!(mount_for(&mounts, Path::new("/x")).map(|m| m.device.as_str()), Some("b"));
    }

    #[test]
    fn parses_vm_rss() {
        let status = "Name:\tkeel\nVmPeak:\t  100 kB\nVmRSS:\t    2048 kB\nThreads:\t1\n";
        assert_eq!(parse_vm_rss_bytes(status), Some(2048 * 1024));
        assert_eq!(parse_vm_rss_bytes("Name: x\n"), None);
        assert_eq!(parse_vm_rss_bytes("VmRSS: lots kB\n"), None);
    }

    #[test]
    fn live_probes_do_not_fail() {
        assert!(cpus() >= 1);
        assert!(!os().is_empty());
        assert!(!filesystem_of(&std::env::temp_dir()).is_empty());
        if cfg!(target_os = "linux") {
            assert!(resident_bytes().unwrap_or(0) > 0);
        }
    }
}
