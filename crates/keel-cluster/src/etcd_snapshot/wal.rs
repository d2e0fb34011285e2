//! etcd's write-ahead log (`member/wal/<seq>-<index>.wal`), read once when `keel serve`
//! imports an etcd data directory: the member's and cluster's ids, the hard state, and which
//! Raft entries the log holds, so that the import can refuse a log with writes the backend
//! database has not applied yet.
//!
//! Framing (etcd's `wal/encoder.go`): a record is a little-endian u64 length word, then the
//! record's bytes, then padding to 8 bytes. The low 56 bits of the word are the record's
//! length; when the top bit is set, the top byte's low 3 bits are the padding's length. A word
//! of zero is the end of the log (etcd preallocates segments with zeros). Each record is a
//! `walpb.Record`; its CRC is CRC-32C (Castagnoli) over the data of every record so far, a
//! `CRC` record at the head of each segment carrying the previous segment's sum.
//!
//! What it must not do: panic or allocate by a length it read (every length is checked against
//! the bytes there are), or keep entries' data (only whether they have any).

use prost::Message;

/// `walpb.Record`'s types (etcd's `wal/wal.go`; checked against etcd 3.6.16's files, where a
/// segment opens with a type-4 CRC record and a restore's snapshot marker is type 5).
const METADATA: i64 = 1;
const ENTRY: i64 = 2;
const STATE: i64 = 3;
const CRC: i64 = 4;
const SNAPSHOT: i64 = 5;
/// raftpb.EntryType: a client's command (etcd's `InternalRaftRequest`), as opposed to a
/// configuration change (1, 2).
pub const ENTRY_NORMAL: i32 = 0;
const LENGTH_MASK: u64 = 0x00ff_ffff_ffff_ffff;

/// `walpb.Record`.
#[derive(Clone, PartialEq, Message)]
struct RecordPb {
    #[prost(int64, tag = "1")]
    r#type: i64,
    #[prost(uint32, tag = "2")]
    crc: u32,
    #[prost(bytes = "vec", tag = "3")]
    data: Vec<u8>,
}

/// `raftpb.Entry`.
#[derive(Clone, PartialEq, Message)]
struct EntryPb {
    #[prost(int32, tag = "1")]
    r#type: i32,
    #[prost(uint64, tag = "2")]
    term: u64,
    #[prost(uint64, tag = "3")]
    index: u64,
    #[prost(bytes = "vec", tag = "4")]
    data: Vec<u8>,
}

/// `raftpb.HardState`.
#[derive(Clone, Copy, PartialEq, Eq, Message)]
pub struct HardState {
    #[prost(uint64, tag = "1")]
    pub term: u64,
    #[prost(uint64, tag = "2")]
    pub vote: u64,
    #[prost(uint64, tag = "3")]
    pub commit: u64,
}

/// `etcdserverpb.Metadata`: who wrote the log.
#[derive(Clone, PartialEq, Message)]
struct MetadataPb {
    #[prost(uint64, tag = "1")]
    node_id: u64,
    #[prost(uint64, tag = "2")]
    cluster_id: u64,
}

/// `walpb.Snapshot`: the index a snapshot (and the log after it) starts from.
#[derive(Clone, PartialEq, Message)]
struct SnapshotPb {
    #[prost(uint64, tag = "1")]
    index: u64,
    #[prost(uint64, tag = "2")]
    term: u64,
}

/// Why a WAL cannot be read. `segment` is the segment's position in name order, `offset` the
/// record's byte offset in it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum WalError {
    #[error("no WAL segment (*.wal) in the wal directory")]
    NoSegments,
    #[error("WAL segment name {0:?} is not <seq>-<index>.wal in hex")]
    Name(String),
    #[error("WAL segments are not consecutive: {previous:?} is followed by {next:?}")]
    Gap { previous: String, next: String },
    #[error("WAL segment {segment} is truncated at byte {offset}: a record needs {need} bytes, {have} remain")]
    Truncated { segment: usize, offset: usize, need: u64, have: usize },
    #[error("WAL segment {segment}, byte {offset}: {why}")]
    Decode { segment: usize, offset: usize, why: String },
    #[error(
        "WAL segment {segment}, byte {offset}: CRC mismatch (record says {recorded:08x}, data gives {computed:08x})"
    )]
    Crc { segment: usize, offset: usize, recorded: u32, computed: u32 },
    #[error("WAL segment {segment}, byte {offset}: unknown record type {kind}")]
    UnknownType { segment: usize, offset: usize, kind: i64 },
    #[error("the WAL names two writers: member {first:x} and member {second:x}")]
    Metadata { first: u64, second: u64 },
}

/// A Raft entry the log holds (its data is not kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryInfo {
    pub index: u64,
    pub term: u64,
    /// raftpb.EntryType (0 normal, 1 configuration change, 2 configuration change v2).
    pub kind: i32,
    pub data_bytes: usize,
}

/// What a WAL says, once read whole.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Wal {
    /// The member and cluster that wrote it (`etcdserverpb.Metadata`), if a segment said.
    pub member_id: Option<u64>,
    pub cluster_id: Option<u64>,
    /// The newest hard state.
    pub hard_state: HardState,
    /// The newest snapshot marker's index.
    pub snapshot_index: u64,
    /// The entries in index order, each the last one written at its index (a later entry at
    /// an index replaces it and every entry after it, as Raft overwrites a follower's tail).
    pub entries: Vec<EntryInfo>,
    /// Whether the last segment ended in a torn record (dropped: it was never synced, so never
    /// acknowledged; etcd's repair drops it the same way).
    pub torn_tail: bool,
}

/// The segment's (sequence, index) from its name.
pub fn segment_name(name: &str) -> Option<(u64, u64)> {
    let stem = name.strip_suffix(".wal")?;
    let (seq, index) = stem.split_once('-')?;
    if seq.len() != 16 || index.len() != 16 {
        return None;
    }
    Some((u64::from_str_radix(seq, 16).ok()?, u64::from_str_radix(index, 16).ok()?))
}

/// The `.wal` names of a directory's listing, in sequence order, checked to be consecutive.
/// Other names (etcd's `0.tmp` preallocation, anything else) are not the log's.
pub fn segment_order(names: &[String]) -> Result<Vec<String>, WalError> {
    let mut segments = Vec::new();
    for name in names.iter().filter(|n| n.ends_with(".wal")) {
        let (seq, _) = segment_name(name).ok_or_else(|| WalError::Name(name.clone()))?;
        segments.push((seq, name.clone()));
    }
    segments.sort();
    for pair in segments.windows(2) {
        if let [(a, an), (b, bn)] = pair {
            if a.checked_add(1) != Some(*b) {
                return Err(WalError::Gap { previous: an.clone(), next: bn.clone() });
            }
        }
    }
    if segments.is_empty() {
        return Err(WalError::NoSegments);
    }
    Ok(segments.into_iter().map(|(_, n)| n).collect())
}

/// One framed record and the offset after it; `None` at the end of the segment.
fn next_frame(seg: &[u8], at: usize, segment: usize) -> Result<Option<(&[u8], usize)>, WalError> {
    let Some(word) = seg.get(at..at.saturating_add(8)) else {
        // Fewer than 8 bytes left: etcd pads to 8, so this is only the file's end.
        return Ok(None);
    };
    let word = u64::from_le_bytes(word.try_into().map_err(|_| WalError::Decode {
        segment,
        offset: at,
        why: "length word".into(),
    })?);
    if word == 0 {
        return Ok(None);
    }
    let len = word & LENGTH_MASK;
    let pad = if word >> 63 == 1 { (word >> 56) & 0x7 } else { 0 };
    let start = at + 8;
    let have = seg.len() - start;
    let need = len + pad;
    if need > have as u64 {
        return Err(WalError::Truncated { segment, offset: at, need, have });
    }
    // Both fit in `have`, a usize.
    let (len, need) = (len as usize, need as usize);
    Ok(seg.get(start..start + len).map(|rec| (rec, start + need)))
}

/// Reads a WAL's segments (their bytes, in [`segment_order`]) whole.
pub fn read(segments: &[Vec<u8>]) -> Result<Wal, WalError> {
    let mut reader = Reader::default();
    for (i, seg) in segments.iter().enumerate() {
        reader.segment(seg, i + 1 == segments.len())?;
    }
    Ok(reader.finish())
}

/// Reads a WAL one segment at a time (a segment is 64 MB; only one is held at once).
#[derive(Debug, Default)]
pub struct Reader {
    wal: Wal,
    crc: u32,
    segment: usize,
}

impl Reader {
    /// Reads the next segment; `last` says it is the newest (whose torn tail is dropped).
    pub fn segment(&mut self, seg: &[u8], last: bool) -> Result<(), WalError> {
        let segment = self.segment;
        self.segment += 1;
        let mut at = 0;
        loop {
            let (bytes, next) = match next_frame(seg, at, segment) {
                Ok(Some(frame)) => frame,
                Ok(None) => return Ok(()),
                // A record cut short at the very end of the log is one whose write never
                // finished, so was never synced nor acknowledged.
                Err(WalError::Truncated { .. }) if last => {
                    self.wal.torn_tail = true;
                    return Ok(());
                }
                Err(e) => return Err(e),
            };
            let rec = RecordPb::decode(bytes).map_err(|e| WalError::Decode {
                segment,
                offset: at,
                why: format!("record: {e}"),
            })?;
            let crc = self.crc;
            if rec.r#type == CRC {
                if crc != 0 && rec.crc != crc {
                    return Err(WalError::Crc { segment, offset: at, recorded: rec.crc, computed: crc });
                }
                self.crc = rec.crc;
            } else {
                self.crc = crc32c::crc32c_append(crc, &rec.data);
                if rec.crc != self.crc {
                    return Err(WalError::Crc { segment, offset: at, recorded: rec.crc, computed: self.crc });
                }
            }
            apply(&mut self.wal, &rec, segment, at)?;
            at = next;
        }
    }

    /// What the segments read so far say.
    pub fn finish(self) -> Wal {
        self.wal
    }
}

/// Folds one record into what the log says.
fn apply(wal: &mut Wal, rec: &RecordPb, segment: usize, offset: usize) -> Result<(), WalError> {
    let decode = |what: &str, e: prost::DecodeError| WalError::Decode { segment, offset, why: format!("{what}: {e}") };
    match rec.r#type {
        METADATA => {
            let m = MetadataPb::decode(rec.data.as_slice()).map_err(|e| decode("metadata", e))?;
            if let Some(first) = wal.member_id.filter(|&id| id != m.node_id) {
                return Err(WalError::Metadata { first, second: m.node_id });
            }
            wal.member_id = Some(m.node_id);
            wal.cluster_id = Some(m.cluster_id);
        }
        ENTRY => {
            let e = EntryPb::decode(rec.data.as_slice()).map_err(|e| decode("entry", e))?;
            let keep = wal.entries.partition_point(|x| x.index < e.index);
            wal.entries.truncate(keep);
            wal.entries.push(EntryInfo { index: e.index, term: e.term, kind: e.r#type, data_bytes: e.data.len() });
        }
        STATE => {
            // etcd writes an empty state record now and then; it changes nothing.
            let s = HardState::decode(rec.data.as_slice()).map_err(|e| decode("hard state", e))?;
            if s != HardState::default() {
                wal.hard_state = s;
            }
        }
        SNAPSHOT => {
            let s = SnapshotPb::decode(rec.data.as_slice()).map_err(|e| decode("snapshot", e))?;
            wal.snapshot_index = wal.snapshot_index.max(s.index);
        }
        CRC => {}
        kind => return Err(WalError::UnknownType { segment, offset, kind }),
    }
    Ok(())
}

/// Frames records as etcd's encoder does (for tests and fixtures): `(type, data)` pairs with
/// the running CRC, a CRC record first.
#[cfg(test)]
pub(crate) fn encode(records: &[(i64, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut crc = 0u32;
    let mut frame = |rec: RecordPb| {
        let bytes = rec.encode_to_vec();
        let pad = (8 - bytes.len() % 8) % 8;
        let mut word = bytes.len() as u64;
        if pad != 0 {
            word |= (0x80 | pad as u64) << 56;
        }
        out.extend_from_slice(&word.to_le_bytes());
        out.extend_from_slice(&bytes);
        out.extend(std::iter::repeat_n(0u8, pad));
    };
    frame(RecordPb { r#type: CRC, crc: 0, data: Vec::new() });
    for (kind, data) in records {
        crc = crc32c::crc32c_append(crc, data);
        frame(RecordPb { r#type: *kind, crc, data: data.clone() });
    }
    out
}

/// The bytes of a `raftpb.Entry` record (for tests).
#[cfg(test)]
pub(crate) fn entry(kind: i32, term: u64, index: u64, data: &[u8]) -> (i64, Vec<u8>) {
    (ENTRY, EntryPb { r#type: kind, term, index, data: data.to_vec() }.encode_to_vec())
}

/// The bytes of an `etcdserverpb.Metadata` record (for tests).
#[cfg(test)]
pub(crate) fn metadata(member_id: u64, cluster_id: u64) -> (i64, Vec<u8>) {
    (METADATA, MetadataPb { node_id: member_id, cluster_id }.encode_to_vec())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn sample() -> Vec<u8> {
        let state = (STATE, HardState { term: 2, vote: 1, commit: 3 }.encode_to_vec());
        encode(&[
            metadata(0xa, 0xc),
            entry(1, 1, 1, b"conf"),
            entry(ENTRY_NORMAL, 2, 2, b""),
            entry(ENTRY_NORMAL, 2, 3, b"put"),
            state,
        ])
    }

    #[test]
    fn reads_ids_entries_and_state() {
        let wal = read(&[sample()]).unwrap();
        assert_eq!((wal.member_id, wal.cluster_id), (Some(0xa), Some(0xc)));
        assert_eq!(wal.hard_state.commit, 3);
        let got: Vec<_> = wal.entries.iter().map(|e| (e.index, e.kind, e.data_bytes)).collect();
        assert_eq!(got, vec![(1, 1, 4), (2, 0, 0), (3, 0, 3)]);
        assert!(!wal.torn_tail);
    }

    #[test]
    fn a_rewritten_index_drops_the_tail_after_it() {
        let seg = encode(&[entry(0, 1, 1, b"a"), entry(0, 1, 2, b"b"), entry(0, 1, 3, b"c"), entry(0, 2, 2, b"")]);
        let wal = read(&[seg]).unwrap();
        let got: Vec<_> = wal.entries.iter().map(|e| (e.index, e.term)).collect();
        assert_eq!(got, vec![(1, 1), (2, 2)]);
    }

    #[test]
    fn trailing_zeros_end_the_log() {
        let mut seg = sample();
        seg.extend_from_slice(&[0; 4096]);
        assert_eq!(read(&[seg]).unwrap(), read(&[sample()]).unwrap());
    }

    #[test]
    fn every_cut_of_the_last_segment_is_a_torn_tail_or_a_prefix_never_a_panic() {
        let seg = sample();
        for cut in 0..seg.len() {
            let wal = read(&[seg[..cut].to_vec()]).unwrap();
            assert!(wal.entries.len() <= 3);
        }
        let wal = read(&[seg[..seg.len() - 3].to_vec()]).unwrap();
        assert!(wal.torn_tail);
        assert_eq!(wal.entries.len(), 3, "the cut record is the state record");
    }

    #[test]
    fn a_cut_in_an_earlier_segment_is_an_error() {
        let seg = sample();
        let err = read(&[seg[..seg.len() - 3].to_vec(), encode(&[])]).unwrap_err();
        assert!(matches!(err, WalError::Truncated { segment: 0, .. }), "{err}");
    }

    #[test]
    fn a_flipped_bit_is_a_typed_error_anywhere() {
        let seg = sample();
        for at in 0..seg.len() {
            for bit in [0x01u8, 0x80] {
                let mut bad = seg.clone();
                bad[at] ^= bit;
                // Either an error, or (a flip in padding or in a length word that still frames
                // the rest) a log read without a panic.
                let _ = read(&[bad]);
            }
        }
        // A flip inside an entry's data is caught by the CRC.
        let mut bad = seg.clone();
        let at = seg.windows(3).position(|w| w == b"put").unwrap();
        bad[at] ^= 1;
        assert!(matches!(read(&[bad]).unwrap_err(), WalError::Crc { .. }));
    }

    #[test]
    fn segments_are_ordered_and_gaps_refused() {
        let names: Vec<String> =
            ["0000000000000001-0000000000000009.wal", "0.tmp", "0000000000000000-0000000000000000.wal"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        assert_eq!(
            segment_order(&names).unwrap(),
            vec!["0000000000000000-0000000000000000.wal", "0000000000000001-0000000000000009.wal"]
        );
        let gap =
            vec!["0000000000000000-0000000000000000.wal".to_string(), "0000000000000002-0000000000000009.wal".into()];
        assert!(matches!(segment_order(&gap), Err(WalError::Gap { .. })));
        assert!(matches!(segment_order(&["x.wal".to_string()]), Err(WalError::Name(_))));
        assert_eq!(segment_order(&[]), Err(WalError::NoSegments));
    }
}
