//! The state digest: an order-independent hash of every live `(table, key, value)`.
//!
//! Each entry hashes to 128 bits (XXH3-128 with a fixed seed over a length-prefixed encoding);
//! the digest is the wrapping sum of the entry hashes. Adding an entry adds its hash, removing
//! it subtracts it, so the engine maintains the digest incrementally on commit and `keel verify`
//! recomputes it from scratch in any order. The sum (not XOR) keeps duplicate entries from
//! cancelling out. The digest guards against bugs and media errors, not against an adversary.

use xxhash_rust::xxh3::xxh3_128_with_seed;

const SEED: u64 = 0x4b45_454c_4442_0001; // "KEELDB" + format 1

/// An order-independent digest of a set of `(table, key, value)` entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct StateDigest(pub u128);

impl StateDigest {
    /// The hash of one entry: its parts laid out in one buffer, hashed at once. The buffer is
    /// the thread's, reused: a zeroed 384-byte array per call (and a heap buffer for longer
    /// entries) cost a `memset` per entry hashed, which is every write applied.
    pub fn entry_hash(table: &str, key: &[u8], value: &[u8]) -> u128 {
        thread_local! {
            static LAYOUT: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        /// A buffer kept for the next entry at most this large; a longer one is given back.
        const KEEP: usize = 4096;
        let hash = |buf: &mut Vec<u8>| {
            buf.clear();
            buf.extend_from_slice(&(table.len() as u32).to_le_bytes());
            buf.extend_from_slice(table.as_bytes());
            buf.extend_from_slice(&(key.len() as u32).to_le_bytes());
            buf.extend_from_slice(key);
            buf.extend_from_slice(value);
            xxh3_128_with_seed(buf, SEED)
        };
        let reused = LAYOUT.try_with(|cell| {
            let mut buf = cell.try_borrow_mut().ok()?;
            let h = hash(&mut buf);
            if buf.capacity() > KEEP {
                *buf = Vec::new();
            }
            Some(h)
        });
        match reused {
            Ok(Some(h)) => h,
            // During thread teardown, or re-entered: a buffer of its own.
            _ => hash(&mut Vec::new()),
        }
    }

    /// Adds an entry.
    pub fn add(&mut self, table: &str, key: &[u8], value: &[u8]) {
        self.0 = self.0.wrapping_add(Self::entry_hash(table, key, value));
    }

    /// Removes an entry that was added before.
    pub fn remove(&mut self, table: &str, key: &[u8], value: &[u8]) {
        self.0 = self.0.wrapping_sub(Self::entry_hash(table, key, value));
    }

    /// Hex form for reports.
    pub fn to_hex(self) -> String {
        format!("{:032x}", self.0)
    }
}

impl std::fmt::Display for StateDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_does_not_matter_and_removal_restores() {
        let mut a = StateDigest::default();
        a.add("t", b"k1", b"v1");
        a.add("t", b"k2", b"v2");
        let mut b = StateDigest::default();
        b.add("t", b"k2", b"v2");
        b.add("t", b"k1", b"v1");
        assert_eq!(a, b);
        b.remove("t", b"k2", b"v2");
        let mut c = StateDigest::default();
        c.add("t", b"k1", b"v1");
        assert_eq!(b, c);
    }

    #[test]
    fn fields_do_not_run_together() {
        // ("ab", "c") and ("a", "bc") must not hash alike.
        assert_ne!(StateDigest::entry_hash("t", b"ab", b"c"), StateDigest::entry_hash("t", b"a", b"bc"));
        assert_ne!(StateDigest::entry_hash("tk", b"", b"v"), StateDigest::entry_hash("t", b"k", b"v"));
    }

    #[test]
    fn entries_hash_their_documented_layout_whatever_the_buffer_held_before() {
        // The digest is on disk (checkpoint footers, close markers): the layout is
        // len(table) table len(key) key value, little-endian u32 lengths, for any size.
        // A long entry (past the kept buffer's size) between short ones.
        for value_len in [0, 100, 360, 376, 377, 1_000, 70_000, 100, 0] {
            let value: Vec<u8> = (0..value_len).map(|i| (i * 7) as u8).collect();
            let mut layout = Vec::new();
            layout.extend_from_slice(&5u32.to_le_bytes());
            layout.extend_from_slice(b"table");
            layout.extend_from_slice(&3u32.to_le_bytes());
            layout.extend_from_slice(b"key");
            layout.extend_from_slice(&value);
            assert_eq!(
                StateDigest::entry_hash("table", b"key", &value),
                xxh3_128_with_seed(&layout, SEED),
                "{value_len}"
            );
        }
    }

    #[test]
    fn duplicates_do_not_cancel() {
        let mut a = StateDigest::default();
        a.add("t", b"k", b"v");
        a.add("t", b"k", b"v");
        assert_ne!(a, StateDigest::default());
    }
}
