//! The file `Maintenance.Snapshot` streams, shaped the way etcd's tools check it: `etcdctl
//! snapshot save` refuses a stream whose length is not 32 more than a multiple of 512 and
//! whose last 32 bytes are not the SHA-256 of the rest (etcd's are a bbolt file plus that hash).
//!
//! Layout: the KeelDB checkpoint stream, zero padding, the stream's length (u64, little-endian)
//! in the last 8 bytes before the hash, then SHA-256 of everything before it.
//!
//! etcd's own snapshot format (a bbolt database plus its SHA-256), which `keel snapshot-restore`
//! also reads and `etcdutl` can read back, is `etcd_snapshot`'s; a file is keel's exactly when it
//! starts with the checkpoint's magic (`KEELCKP`).

use sha2::{Digest, Sha256};

const ALIGN: usize = 512;
const HASH: usize = 32;

/// The length of the snapshot file around a checkpoint stream of `len` bytes.
pub fn encoded_len(len: u64) -> u64 {
    (len + 8).div_ceil(ALIGN as u64) * ALIGN as u64 + HASH as u64
}

/// Writes the snapshot file while the checkpoint streams through: hash each piece as it
/// passes, then [`Encoder::finish`] gives the bytes after the checkpoint (padding, length,
/// hash). Nothing but the hash state is kept.
#[derive(Default)]
pub struct Encoder {
    hash: Sha256,
    len: u64,
}

impl Encoder {
    /// Takes the next piece of the checkpoint stream (sent on as it is).
    pub fn update(&mut self, piece: &[u8]) {
        self.hash.update(piece);
        self.len += piece.len() as u64;
    }

    /// The bytes that end the file: zero padding, the stream's length, the SHA-256.
    pub fn finish(mut self) -> Vec<u8> {
        let pad = encoded_len(self.len) - HASH as u64 - 8 - self.len;
        let mut tail = vec![0u8; pad as usize];
        tail.extend_from_slice(&self.len.to_le_bytes());
        self.hash.update(&tail);
        let hash = self.hash.finalize();
        tail.extend_from_slice(&hash);
        tail
    }
}

/// Wraps a checkpoint stream into a snapshot file.
pub fn encode(checkpoint: &[u8]) -> Vec<u8> {
    let mut e = Encoder::default();
    e.update(checkpoint);
    let mut out = checkpoint.to_vec();
    out.extend_from_slice(&e.finish());
    out
}

/// The checkpoint stream inside a snapshot file, after checking its shape and hash.
pub fn decode(file: &[u8]) -> Result<&[u8], String> {
    if file.len() < ALIGN + HASH || file.len() % ALIGN != HASH {
        return Err(format!("not a keel snapshot: {} bytes is not a multiple of {ALIGN} plus {HASH}", file.len()));
    }
    let (body, hash) = file.split_at(file.len() - HASH);
    if Sha256::digest(body).as_slice() != hash {
        return Err("snapshot checksum mismatch: the file is damaged or not a keel snapshot".into());
    }
    let len_at = body.len() - 8;
    let mut len = [0u8; 8];
    len.copy_from_slice(body.get(len_at..).unwrap_or_default());
    let len = usize::try_from(u64::from_le_bytes(len)).map_err(|_| "snapshot length out of range".to_string())?;
    body.get(..len).filter(|_| len <= len_at).ok_or_else(|| "snapshot length past its end".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_with_etcds_shape_and_refuses_damage() {
        for n in [0usize, 1, 503, 504, 505, 512, 5000] {
            let data: Vec<u8> = (0..n).map(|i| i as u8).collect();
            let file = encode(&data);
            assert_eq!(file.len() % ALIGN, HASH, "etcdctl's check");
            assert_eq!(file.len() as u64, encoded_len(n as u64));
            // Streamed in uneven pieces, the same bytes.
            let mut e = Encoder::default();
            let mut streamed = Vec::new();
            for piece in data.chunks(7) {
                e.update(piece);
                streamed.extend_from_slice(piece);
            }
            streamed.extend_from_slice(&e.finish());
            assert_eq!(streamed, file);
            assert_eq!(decode(&file).map(<[u8]>::to_vec), Ok(data));
        }
        let mut file = encode(b"checkpoint");
        file[3] ^= 1;
        assert!(decode(&file).is_err());
        assert!(decode(b"short").is_err());
        assert!(decode(&[0u8; 544]).is_err());
    }
}
