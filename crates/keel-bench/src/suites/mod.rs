//! The benchmark suites. Each `run` opens stores (KeelDB and the selected peers, through
//! [`crate::peers`]) in fresh temporary directories from the [`crate::SuiteContext`],
//! measures, and returns flat rows; none prints Markdown or writes files outside its temporary
//! directories.

pub mod cluster;
pub mod cpu_accounting;
pub mod curp;
mod delay_proxy;
pub mod durability;
pub mod engine;
pub mod group_commit;
pub mod mvcc;
pub mod recovery;
pub mod scale;
pub mod sqlite_compare;

use std::path::Path;

use anyhow::Context;
use keeldb::{Database, Durability, Options};

/// Opens a store at `path` with `durability` and default options otherwise.
pub(crate) fn open(path: &Path, durability: Durability) -> anyhow::Result<Database> {
    Database::open(path, Options::with_durability(durability))
        .with_context(|| format!("opening a {} store at {}", durability.name(), path.display()))
}

/// A deterministic 64-bit mix (splitmix64), used for keys and pseudo-random read orders so runs
/// are repeatable without a random-number crate.
pub(crate) fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A 16-byte key for index `i`: a hashed prefix spreads keys over the key space, the index
/// suffix keeps them unique.
pub(crate) fn key16(i: u64) -> [u8; 16] {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&mix64(i).to_be_bytes());
    key[8..].copy_from_slice(&i.to_be_bytes());
    key
}

/// A value of exactly `len` bytes that varies with `seed`.
pub(crate) fn value_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut value = Vec::with_capacity(len);
    let mut state = seed;
    while value.len() < len {
        state = mix64(state);
        for byte in state.to_le_bytes() {
            if value.len() < len {
                // Printable ASCII keeps values readable in `keel scan` output.
                value.push(b'a' + byte % 26);
            }
        }
    }
    value
}

/// A JSON-like task record of 100–200 bytes, like the records seed 004 creates.
pub(crate) fn task_json(i: u64) -> Vec<u8> {
    format!(
        "{{\"id\":\"task-{i:010}\",\"title\":\"Benchmark task number {i}\",\"status\":\"pending\",\
         \"priority\":{},\"tags\":[\"bench\",\"keel\"],\"owner\":\"agent-{}\"}}",
        i % 5,
        i % 17
    )
    .into_bytes()
}

/// A pseudo-random sequence of indices below `n`, for read orders.
pub(crate) struct IndexStream {
    state: u64,
    n: u64,
}

impl IndexStream {
    pub(crate) fn new(seed: u64, n: u64) -> Self {
        IndexStream { state: seed, n: n.max(1) }
    }

    pub(crate) fn next_index(&mut self) -> u64 {
        self.state = self.state.wrapping_add(1);
        mix64(self.state) % self.n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_json_is_within_size_range() {
        for i in [0, 7, 123_456, u64::from(u32::MAX)] {
            let len = task_json(i).len();
            assert!((100..=200).contains(&len), "task {i} is {len} bytes");
        }
    }

    #[test]
    fn keys_are_unique_and_sixteen_bytes() {
        let keys: std::collections::HashSet<[u8; 16]> = (0..10_000).map(key16).collect();
        assert_eq!(keys.len(), 10_000);
    }

    #[test]
    fn values_have_requested_length() {
        assert_eq!(value_bytes(100, 1).len(), 100);
        assert_eq!(value_bytes(0, 1).len(), 0);
        assert_ne!(value_bytes(16, 1), value_bytes(16, 2));
    }

    #[test]
    fn index_stream_stays_in_range() {
        let mut stream = IndexStream::new(3, 10);
        assert!((0..1000).all(|_| stream.next_index() < 10));
    }
}
