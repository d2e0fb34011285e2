//! The bench suites' 16-byte keys (`keel-bench`'s `key16`), for the profiling examples.

/// A 64-bit mixer (splitmix64's finaliser).
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Key `i`: a hashed prefix spreads keys over the key space, the index suffix keeps them unique.
pub fn key16(i: u64) -> [u8; 16] {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&mix64(i).to_be_bytes());
    key[8..].copy_from_slice(&i.to_be_bytes());
    key
}
