//! Little-endian encoding helpers shared by the WAL and checkpoint formats. The [`Reader`]
//! never panics and never allocates more than the bytes it was given: every length it decodes
//! is checked against what remains before anything is sliced or copied.

/// Appends fixed-width little-endian integers and length-prefixed byte strings.
pub(crate) trait PutBytes {
    fn put_u8(&mut self, v: u8);
    fn put_u32(&mut self, v: u32);
    fn put_u64(&mut self, v: u64);
    /// A `u32` length followed by the bytes.
    fn put_bytes32(&mut self, v: &[u8]);
}

impl PutBytes for Vec<u8> {
    fn put_u8(&mut self, v: u8) {
        self.push(v);
    }
    fn put_u32(&mut self, v: u32) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_u64(&mut self, v: u64) {
        self.extend_from_slice(&v.to_le_bytes());
    }
    fn put_bytes32(&mut self, v: &[u8]) {
        // Callers bound every key, value and name far below 4 GiB before encoding.
        self.put_u32(v.len() as u32);
        self.extend_from_slice(v);
    }
}

/// A decoding failure: what was expected and at which offset inside the buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DecodeError {
    pub offset: usize,
    pub what: &'static str,
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (at byte {} of the record)", self.what, self.offset)
    }
}

/// A bounds-checked cursor over a byte slice.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    pub fn is_empty(&self) -> bool {
        self.remaining() == 0
    }

    fn fail<T>(&self, what: &'static str) -> Result<T, DecodeError> {
        Err(DecodeError { offset: self.pos, what })
    }

    pub fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        let end = match self.pos.checked_add(n) {
            Some(end) if end <= self.buf.len() => end,
            _ => return self.fail(what),
        };
        let out = self.buf.get(self.pos..end);
        match out {
            Some(s) => {
                self.pos = end;
                Ok(s)
            }
            None => self.fail(what),
        }
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], DecodeError> {
        let s = self.take(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    pub fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.array::<1>(what)?[0])
    }
    pub fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    pub fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    /// A `u32`-length-prefixed byte string no longer than `max`.
    pub fn bytes32(&mut self, max: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        let len = self.u32(what)? as usize;
        if len > max {
            return self.fail(what);
        }
        self.take(len, what)
    }
}

/// Reads a little-endian `u32` at `at` from a slice, if it is long enough.
pub(crate) fn le_u32(buf: &[u8], at: usize) -> Option<u32> {
    let s = buf.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(s.try_into().ok()?))
}

/// Reads a little-endian `u64` at `at` from a slice, if it is long enough.
pub(crate) fn le_u64(buf: &[u8], at: usize) -> Option<u64> {
    let s = buf.get(at..at.checked_add(8)?)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(s);
    Some(u64::from_le_bytes(a))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reader_rejects_lengths_past_the_end() {
        let mut buf = Vec::new();
        buf.put_u32(1_000_000);
        buf.extend_from_slice(b"short");
        let mut r = Reader::new(&buf);
        assert!(r.bytes32(usize::MAX, "value").is_err());
    }

    #[test]
    fn reader_enforces_the_caller_limit() {
        let mut buf = Vec::new();
        buf.put_bytes32(b"abcdef");
        assert!(Reader::new(&buf).bytes32(5, "key").is_err());
        assert_eq!(Reader::new(&buf).bytes32(6, "key").ok(), Some(&b"abcdef"[..]));
    }

    #[test]
    fn round_trip_integers() {
        let mut buf = Vec::new();
        buf.put_u8(7);
        buf.put_u32(70_000);
        buf.put_u64(u64::MAX - 3);
        let mut r = Reader::new(&buf);
        assert_eq!(r.u8("a"), Ok(7));
        assert_eq!(r.u32("c"), Ok(70_000));
        assert_eq!(r.u64("d"), Ok(u64::MAX - 3));
        assert!(r.is_empty());
        assert!(r.u8("e").is_err());
    }
}
