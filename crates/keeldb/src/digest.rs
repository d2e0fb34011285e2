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
    /// The hash of one entry.
    pub fn entry_hash(table: &str, key: &[u8], value: &[u8]) -> u128 {
        let len = 8 + table.len() + key.len() + value.len();
        let mut heap = Vec::new();
        let mut stack = [0u8; 384];
        // Small entries (most) are laid out on the stack: no allocation per entry hashed.
        let buf: &mut [u8] = match stack.get_mut(..len) {
            Some(b) => b,
            None => {
                heap.resize(len, 0);
                &mut heap
            }
        };
        let mut at = 0;
        for part in
            [&(table.len() as u32).to_le_bytes()[..], table.as_bytes(), &(key.len() as u32).to_le_bytes(), key, value]
        {
            if let Some(dst) = buf.get_mut(at..at + part.len()) {
                dst.copy_from_slice(part);
            }
            at += part.len();
        }
        xxh3_128_with_seed(buf, SEED)
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
    fn entries_hash_their_documented_layout_on_stack_or_heap() {
        // The digest is on disk (checkpoint footers, close markers): the layout is
        // len(table) table len(key) key value, little-endian u32 lengths, for any size.
        for value_len in [0, 100, 360, 376, 377, 1_000, 70_000] {
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
