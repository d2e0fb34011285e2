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
        let mut buf = Vec::with_capacity(12 + table.len() + key.len() + value.len());
        buf.extend_from_slice(&(table.len() as u32).to_le_bytes());
        buf.extend_from_slice(table.as_bytes());
        buf.extend_from_slice(&(key.len() as u32).to_le_bytes());
        buf.extend_from_slice(key);
        buf.extend_from_slice(value);
        xxh3_128_with_seed(&buf, SEED)
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
    fn duplicates_do_not_cancel() {
        let mut a = StateDigest::default();
        a.add("t", b"k", b"v");
        a.add("t", b"k", b"v");
        assert_ne!(a, StateDigest::default());
    }
}
