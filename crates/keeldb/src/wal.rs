//! The write-ahead log: segment files of checksummed frames, and the writer that appends them.
//!
//! This module owns the WAL byte format (see `docs/design/format.md`), frame encoding and
//! decoding, and segment scanning; `wal_writer.rs` holds the [`WalWriter`] that appends
//! batches and rolls segments. Neither decides when to sync (that is the committer's job) nor
//! touches the in-memory index.
//!
//! LSNs (log sequence numbers) are logical byte offsets over the frames of all segments,
//! excluding segment headers. Every frame records its own LSN (so a frame found at the wrong
//! place is rejected) and a `durable_lsn` claim: every frame byte before that LSN had been
//! fdatasynced when this frame was written. Recovery uses the claims to tell a torn, unsynced
//! tail (legitimately lost) from corruption of bytes that had been made durable.

use crate::codec::{le_u32, le_u64, DecodeError, PutBytes, Reader};
use crate::error::Result;
use crate::fs::FileHandle;
use crate::options::{MAX_KEY_BYTES, MAX_TABLE_NAME_BYTES, MAX_VALUE_BYTES};
use crate::types::LogPosition;

pub(crate) const SEGMENT_MAGIC: &[u8; 8] = b"KEELWAL\0";
pub(crate) const SEGMENT_HEADER_BYTES: u64 = 64;
pub(crate) const FRAME_MAGIC: u32 = 0x3146_574b; // "KWF1" little-endian
pub(crate) const FRAME_HEADER_BYTES: usize = 40;

/// Record kinds (first payload byte).
pub(crate) const KIND_COMMIT: u8 = 1;
/// A marker written at clean close; carries the final durable claim and no operations.
pub(crate) const KIND_MARK: u8 = 2;

const OP_PUT: u8 = 1;
const OP_DELETE: u8 = 2;
const OP_CREATE_TABLE: u8 = 3;
const OP_DROP_TABLE: u8 = 4;

/// Optional fields after a commit's operations (first byte of each field).
const FIELD_APPLIED_POSITION: u8 = 1;

/// One logged operation, borrowed from a decoded payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Op<'a> {
    Put { table: u32, key: &'a [u8], value: &'a [u8] },
    Delete { table: u32, key: &'a [u8] },
    CreateTable { table: u32, name: &'a str },
    DropTable { table: u32 },
}

/// Builds a commit payload: `kind | op count | ops [fields]`, either on its own
/// ([`PayloadBuilder::new`], [`PayloadBuilder::finish`]) or in place inside a batch's frame
/// buffer ([`PayloadBuilder::in_frame`], [`PayloadBuilder::finish_frame`]), which saves the
/// commit path one allocation and one copy per commit.
pub(crate) struct PayloadBuilder {
    buf: Vec<u8>,
    /// Where the payload starts in `buf`.
    start: usize,
    ops: u32,
}

impl PayloadBuilder {
    /// A payload on its own (tests and decoders' fixtures; the commit path builds in place).
    #[cfg(test)]
    pub fn new(capacity: usize) -> Self {
        let mut buf = Vec::with_capacity(capacity + 5);
        buf.put_u8(KIND_COMMIT);
        buf.put_u32(0);
        PayloadBuilder { buf, start: 0, ops: 0 }
    }

    /// Starts a frame at the end of `frames` (header space first) and builds its payload in
    /// place; [`PayloadBuilder::finish_frame`] fills in the header and padding.
    pub fn in_frame(mut frames: Vec<u8>, capacity: usize) -> Self {
        frames.reserve(FRAME_HEADER_BYTES + capacity + 5 + 8);
        frames.resize(frames.len() + FRAME_HEADER_BYTES, 0);
        let start = frames.len();
        frames.put_u8(KIND_COMMIT);
        frames.put_u32(0);
        PayloadBuilder { buf: frames, start, ops: 0 }
    }

    /// Completes the frame begun by [`PayloadBuilder::in_frame`]: the same bytes
    /// [`encode_frame`] writes for this payload. Returns the buffer with the frame appended.
    pub fn finish_frame(mut self, lsn: u64, durable_lsn: u64, ts: u64) -> Vec<u8> {
        self.patch_count();
        let start = self.start;
        let payload = self.buf.get(start..).unwrap_or_default();
        let header = frame_header(payload.len(), lsn, durable_lsn, ts, crc32c::crc32c(payload));
        let frame_start = start.saturating_sub(FRAME_HEADER_BYTES);
        if let Some(slot) = self.buf.get_mut(frame_start..start) {
            slot.copy_from_slice(&header);
        }
        let payload_len = self.buf.len() - start;
        self.buf.resize(frame_start + frame_bytes(payload_len), 0);
        self.buf
    }

    fn patch_count(&mut self) {
        let at = self.start + 1;
        if let Some(slot) = self.buf.get_mut(at..at + 4) {
            slot.copy_from_slice(&self.ops.to_le_bytes());
        }
    }
    pub fn put(&mut self, table: u32, key: &[u8], value: &[u8]) {
        self.buf.put_u8(OP_PUT);
        self.buf.put_u32(table);
        self.buf.put_bytes32(key);
        self.buf.put_bytes32(value);
        self.ops += 1;
    }
    pub fn delete(&mut self, table: u32, key: &[u8]) {
        self.buf.put_u8(OP_DELETE);
        self.buf.put_u32(table);
        self.buf.put_bytes32(key);
        self.ops += 1;
    }
    pub fn create_table(&mut self, table: u32, name: &str) {
        self.buf.put_u8(OP_CREATE_TABLE);
        self.buf.put_u32(table);
        self.buf.put_bytes32(name.as_bytes());
        self.ops += 1;
    }
    pub fn drop_table(&mut self, table: u32) {
        self.buf.put_u8(OP_DROP_TABLE);
        self.buf.put_u32(table);
        self.ops += 1;
    }
    /// Appends the replicated-log position this commit applies. Called after every op.
    pub fn applied_position(&mut self, pos: LogPosition) {
        self.buf.put_u8(FIELD_APPLIED_POSITION);
        self.buf.put_u64(pos.index);
        self.buf.put_u64(pos.term);
    }
    #[cfg(test)]
    pub fn finish(mut self) -> Vec<u8> {
        self.patch_count();
        self.buf
    }
}

/// A mark payload (clean close): no operations, then the state digest at that point.
pub(crate) fn mark_payload(digest: u128) -> Vec<u8> {
    let mut p = vec![KIND_MARK, 0, 0, 0, 0];
    p.extend_from_slice(&digest.to_le_bytes());
    p
}

/// A decoded WAL record (tests; recovery decodes into a batch's list: [`decode_payload_into`]).
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct Record<'a> {
    pub kind: u8,
    pub ops: Vec<Op<'a>>,
    /// The state digest, carried by marks.
    pub digest: Option<u128>,
    /// The replicated-log position a commit applied, if it came from `apply_batch`.
    pub position: Option<LogPosition>,
}

/// A decoded record but its operations, which [`decode_payload_into`] appends to a list of
/// the caller's (`ops` is where they are in it).
#[derive(Debug)]
pub(crate) struct RecordHead {
    pub kind: u8,
    pub ops: std::ops::Range<usize>,
    pub digest: Option<u128>,
    pub position: Option<LogPosition>,
}

/// Decodes a payload (tests; see [`decode_payload_into`]).
#[cfg(test)]
pub(crate) fn decode_payload(payload: &[u8]) -> Result<Record<'_>, DecodeError> {
    let mut ops = Vec::new();
    let head = decode_payload_into(payload, &mut ops)?;
    Ok(Record { kind: head.kind, ops, digest: head.digest, position: head.position })
}

/// Decodes a payload, appending its operations to `ops` (a replay decodes a batch of frames
/// into one list instead of allocating one per frame). Never panics; lengths are bounded by
/// the limits and by the payload. On an error `ops` is left as it was.
pub(crate) fn decode_payload_into<'a>(payload: &'a [u8], ops: &mut Vec<Op<'a>>) -> Result<RecordHead, DecodeError> {
    let start = ops.len();
    let head = decode_ops(payload, ops);
    if head.is_err() {
        ops.truncate(start);
    }
    head
}

fn decode_ops<'a>(payload: &'a [u8], ops: &mut Vec<Op<'a>>) -> Result<RecordHead, DecodeError> {
    let start = ops.len();
    let mut r = Reader::new(payload);
    let kind = r.u8("record kind")?;
    if kind != KIND_COMMIT && kind != KIND_MARK {
        return Err(DecodeError { offset: 0, what: "unknown record kind" });
    }
    let count = r.u32("operation count")? as usize;
    if kind == KIND_MARK {
        let raw = r.take(16, "mark digest")?;
        let mut d = [0u8; 16];
        d.copy_from_slice(raw);
        if count != 0 || !r.is_empty() {
            return Err(DecodeError { offset: 1, what: "malformed mark record" });
        }
        return Ok(RecordHead { kind, ops: start..start, digest: Some(u128::from_le_bytes(d)), position: None });
    }
    // Each op takes at least 5 bytes, which bounds the allocation by the payload size.
    if count > r.remaining() / 5 {
        return Err(DecodeError { offset: 1, what: "operation count exceeds payload" });
    }
    ops.reserve(count);
    for _ in 0..count {
        let tag = r.u8("operation tag")?;
        let table = r.u32("table id")?;
        let op = match tag {
            OP_PUT => {
                Op::Put { table, key: r.bytes32(MAX_KEY_BYTES, "key")?, value: r.bytes32(MAX_VALUE_BYTES, "value")? }
            }
            OP_DELETE => Op::Delete { table, key: r.bytes32(MAX_KEY_BYTES, "key")? },
            OP_CREATE_TABLE => {
                let raw = r.bytes32(MAX_TABLE_NAME_BYTES, "table name")?;
                let name =
                    std::str::from_utf8(raw).map_err(|_| DecodeError { offset: 0, what: "table name is not UTF-8" })?;
                Op::CreateTable { table, name }
            }
            OP_DROP_TABLE => Op::DropTable { table },
            _ => return Err(DecodeError { offset: 0, what: "unknown operation tag" }),
        };
        ops.push(op);
    }
    // Optional fields follow the ops; a payload written before they existed simply ends here.
    let mut position = None;
    while !r.is_empty() {
        let offset = payload.len() - r.remaining();
        match r.u8("field tag")? {
            FIELD_APPLIED_POSITION if position.is_none() => {
                position = Some(LogPosition { index: r.u64("log index")?, term: r.u64("log term")? });
            }
            FIELD_APPLIED_POSITION => return Err(DecodeError { offset, what: "repeated log position" }),
            _ => return Err(DecodeError { offset, what: "unknown payload field" }),
        }
    }
    Ok(RecordHead { kind, ops: start..ops.len(), digest: None, position })
}

pub(crate) fn padded(len: usize) -> usize {
    (len + 7) & !7
}

/// Total bytes a frame with this payload occupies.
pub(crate) fn frame_bytes(payload_len: usize) -> usize {
    FRAME_HEADER_BYTES + padded(payload_len)
}

/// A frame header for a payload of `payload_len` bytes with CRC `payload_crc`.
fn frame_header(payload_len: usize, lsn: u64, durable_lsn: u64, ts: u64, payload_crc: u32) -> [u8; FRAME_HEADER_BYTES] {
    // Built in place (this runs once per commit): the fields, then the CRC of the fields.
    let mut out = [0u8; FRAME_HEADER_BYTES];
    let fields: [&[u8]; 6] = [
        &FRAME_MAGIC.to_le_bytes(),
        &(payload_len as u32).to_le_bytes(),
        &lsn.to_le_bytes(),
        &durable_lsn.to_le_bytes(),
        &ts.to_le_bytes(),
        &payload_crc.to_le_bytes(),
    ];
    let mut at = 0;
    for f in fields {
        if let Some(dst) = out.get_mut(at..at + f.len()) {
            dst.copy_from_slice(f);
        }
        at += f.len();
    }
    let header_crc = crc32c::crc32c(out.get(..at).unwrap_or_default());
    if let Some(dst) = out.get_mut(at..at + 4) {
        dst.copy_from_slice(&header_crc.to_le_bytes());
    }
    debug_assert_eq!(at + 4, FRAME_HEADER_BYTES);
    out
}

/// Appends a complete frame (header, payload, zero padding) to `out`.
pub(crate) fn encode_frame(out: &mut Vec<u8>, lsn: u64, durable_lsn: u64, ts: u64, payload: &[u8], payload_crc: u32) {
    debug_assert_eq!(payload_crc, crc32c::crc32c(payload));
    let start = out.len();
    out.extend_from_slice(&frame_header(payload.len(), lsn, durable_lsn, ts, payload_crc));
    out.extend_from_slice(payload);
    out.resize(start + frame_bytes(payload.len()), 0);
}

/// A frame header that passed its checksum.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FrameHeader {
    pub payload_len: usize,
    pub lsn: u64,
    pub durable_lsn: u64,
    pub ts: u64,
    pub payload_crc: u32,
}

/// Decodes and checks a frame header. `None` if the bytes are not a valid header.
pub(crate) fn decode_frame_header(buf: &[u8]) -> Option<FrameHeader> {
    let head = buf.get(..FRAME_HEADER_BYTES)?;
    if le_u32(head, 0)? != FRAME_MAGIC {
        return None;
    }
    if crc32c::crc32c(head.get(..36)?) != le_u32(head, 36)? {
        return None;
    }
    Some(FrameHeader {
        payload_len: le_u32(head, 4)? as usize,
        lsn: le_u64(head, 8)?,
        durable_lsn: le_u64(head, 16)?,
        ts: le_u64(head, 24)?,
        payload_crc: le_u32(head, 32)?,
    })
}

/// Segment header fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SegmentHeader {
    pub version: u32,
    pub seq: u64,
    pub start_lsn: u64,
    /// The commit timestamp the first frame of this segment carries (`last ts + 1`).
    pub first_ts: u64,
}

pub(crate) fn encode_segment_header(h: &SegmentHeader) -> Vec<u8> {
    let mut out = Vec::with_capacity(SEGMENT_HEADER_BYTES as usize);
    out.extend_from_slice(SEGMENT_MAGIC);
    out.put_u32(h.version);
    out.put_u32(0);
    out.put_u64(h.seq);
    out.put_u64(h.start_lsn);
    out.put_u64(h.first_ts);
    out.resize(60, 0);
    let crc = crc32c::crc32c(&out);
    out.put_u32(crc);
    out
}

/// Decodes a segment header; `Err` names what was wrong.
pub(crate) fn decode_segment_header(buf: &[u8]) -> std::result::Result<SegmentHeader, &'static str> {
    let head = buf.get(..SEGMENT_HEADER_BYTES as usize).ok_or("segment shorter than its header")?;
    if head.get(..8) != Some(&SEGMENT_MAGIC[..]) {
        return Err("bad segment magic");
    }
    if crc32c::crc32c(head.get(..60).unwrap_or_default()) != le_u32(head, 60).unwrap_or(0) {
        return Err("segment header checksum mismatch");
    }
    Ok(SegmentHeader {
        version: le_u32(head, 8).unwrap_or(0),
        seq: le_u64(head, 16).unwrap_or(0),
        start_lsn: le_u64(head, 24).unwrap_or(0),
        first_ts: le_u64(head, 32).unwrap_or(0),
    })
}

pub(crate) use crate::files::{parse_segment_name, segment_name};
pub(crate) use crate::wal_writer::{SegmentInfo, WalWriter};

/// A frame found valid by [`scan_segment`].
#[derive(Debug)]
pub(crate) struct ScannedFrame<'a> {
    pub header: FrameHeader,
    pub offset: u64,
    pub payload: &'a [u8],
}

/// Where and why a segment's valid prefix ends.
#[derive(Debug, Clone)]
pub(crate) struct BadFrame {
    pub offset: u64,
    pub lsn: u64,
    pub reason: &'static str,
}

/// The result of scanning one segment's bytes.
#[derive(Debug)]
pub(crate) struct SegmentScan<'a> {
    pub frames: Vec<ScannedFrame<'a>>,
    /// File offset just past the last valid frame of the prefix.
    pub valid_end: u64,
    /// The first invalid frame, if the segment does not end cleanly.
    pub bad: Option<BadFrame>,
    /// Valid frames found after `bad` (their number and the largest durable claim among them).
    pub later_valid_frames: u64,
    pub later_max_durable_lsn: u64,
    /// Zero bytes after the last valid frame when everything from there to the end of the file
    /// is zero: preallocated space, the clean end of the log (then `bad` is `None`).
    pub zero_tail: u64,
}

fn check_frame(bytes: &[u8], pos: usize, expect_lsn: u64) -> std::result::Result<(FrameHeader, &[u8]), &'static str> {
    let rest = bytes.get(pos..).unwrap_or_default();
    if rest.len() < FRAME_HEADER_BYTES {
        return Err("truncated frame header");
    }
    let header = decode_frame_header(rest).ok_or("bad frame header (magic or checksum)")?;
    if header.lsn != expect_lsn {
        return Err("frame LSN does not match its position");
    }
    let body = rest.get(FRAME_HEADER_BYTES..).unwrap_or_default();
    let payload = body.get(..header.payload_len).ok_or("frame payload runs past the end of the segment")?;
    if crc32c::crc32c(payload) != header.payload_crc {
        return Err("frame payload checksum mismatch");
    }
    Ok((header, payload))
}

/// Scans a segment's bytes (including its header) into its valid frame prefix, and looks past
/// the first bad frame for any later valid frames (8-byte aligned, LSN consistent with their
/// position), so recovery can tell a torn tail from corruption.
pub(crate) fn scan_segment(bytes: &[u8], start_lsn: u64) -> SegmentScan<'_> {
    let mut scanner = FrameScanner::new(bytes, start_lsn);
    let frames: Vec<ScannedFrame<'_>> = scanner.by_ref().collect();
    SegmentScan { frames, ..scanner.finish() }
}

/// [`scan_segment`] one frame at a time: the valid prefix, in order, each frame checked (header,
/// LSN, payload CRC) just before it is yielded, so a caller that uses the frame at once finds
/// its bytes still in the cache. (Recovery checked a whole 64 MiB segment first and then
/// decoded it from the start, from memory again: a cache miss per line of every payload.)
/// [`FrameScanner::finish`] then gives what follows the prefix.
pub(crate) struct FrameScanner<'a> {
    /// The segment's bytes from file offset `base` to its end.
    bytes: &'a [u8],
    base: u64,
    start_lsn: u64,
    /// File offset of the next frame (at or past `base`).
    pos: u64,
    bad: Option<BadFrame>,
    ended: bool,
}

impl<'a> FrameScanner<'a> {
    pub fn new(bytes: &'a [u8], start_lsn: u64) -> FrameScanner<'a> {
        FrameScanner::resume(bytes, 0, start_lsn, SEGMENT_HEADER_BYTES)
    }

    /// A scanner over the tail of a segment: `bytes` are the file's from offset `base` to its
    /// end, and the next frame is at file offset `pos` (`pos >= base`).
    fn resume(bytes: &'a [u8], base: u64, start_lsn: u64, pos: u64) -> FrameScanner<'a> {
        FrameScanner { bytes, base, start_lsn, pos, bad: None, ended: false }
    }

    fn lsn_at(&self, pos: u64) -> u64 {
        self.start_lsn + (pos - SEGMENT_HEADER_BYTES)
    }

    /// The file offset just past `bytes`.
    fn end(&self) -> u64 {
        self.base + self.bytes.len() as u64
    }

    fn rel(&self, pos: u64) -> usize {
        usize::try_from(pos - self.base).unwrap_or(usize::MAX)
    }

    /// Everything about the segment but its frames (`frames` is empty): where the valid prefix
    /// ends, the bad frame, the valid frames after it, the zero tail. Frames not yet yielded
    /// are skipped over (checked, not returned).
    pub fn finish(mut self) -> SegmentScan<'a> {
        while self.next().is_some() {}
        let (bytes, pos, end) = (self.bytes, self.pos, self.end());
        // Preallocated space (zeros written ahead of the log) ends the log cleanly; see
        // "Preallocated segment space" in docs/design/recovery.md for why only all zeros may.
        let zero_tail = if self.bad.is_none() { end.saturating_sub(pos) } else { 0 };
        let mut later_valid_frames = 0;
        let mut later_max_durable_lsn = 0;
        if let Some(b) = &self.bad {
            let mut p = b.offset + 8;
            while p + FRAME_HEADER_BYTES as u64 <= end {
                match check_frame(bytes, self.rel(p), self.lsn_at(p)) {
                    Ok((header, _)) => {
                        later_valid_frames += 1;
                        later_max_durable_lsn = later_max_durable_lsn.max(header.durable_lsn);
                        p += frame_bytes(header.payload_len) as u64;
                    }
                    Err(_) => p += 8,
                }
            }
        }
        // `pos` may lie past the end of the file when a tear cut only the last frame's zero
        // padding: that frame is whole, and the log continues at the aligned offset (recovery
        // extends the file to it), so frame positions and LSNs stay aligned.
        SegmentScan {
            frames: Vec::new(),
            valid_end: pos,
            bad: self.bad,
            later_valid_frames,
            later_max_durable_lsn,
            zero_tail,
        }
    }
}

impl<'a> Iterator for FrameScanner<'a> {
    type Item = ScannedFrame<'a>;

    fn next(&mut self) -> Option<ScannedFrame<'a>> {
        if self.ended || self.pos >= self.end() {
            self.ended = true;
            return None;
        }
        let pos = self.pos;
        let rel = self.rel(pos);
        match check_frame(self.bytes, rel, self.lsn_at(pos)) {
            Ok((header, payload)) => {
                self.pos += frame_bytes(header.payload_len) as u64;
                Some(ScannedFrame { header, offset: pos, payload })
            }
            Err(reason) => {
                if !is_all_zero(self.bytes.get(rel..).unwrap_or_default()) {
                    self.bad = Some(BadFrame { offset: pos, lsn: self.lsn_at(pos), reason });
                }
                self.ended = true;
                None
            }
        }
    }
}

/// How much of a segment [`SegmentFrames`] reads at a time: small enough that the bytes are
/// still in the cache when their frames are applied, and that an open touches little fresh
/// memory (a 64 MiB buffer's first touch cost more than reading into it).
pub(crate) const SEGMENT_WINDOW: usize = 1 << 20;

/// Windows a segment's reader thread may fill ahead of the replay, besides the one the replay
/// is applying.
const WINDOWS_AHEAD: usize = 2;

/// A frame checked in a window: its header, its file offset, where its payload starts in the
/// window.
type Found = (FrameHeader, u64, usize);

/// Bytes of a segment from some offset on, and the whole frames among them, checked.
#[derive(Default)]
pub(crate) struct Window {
    bytes: Vec<u8>,
    frames: Vec<Found>,
}

/// Windows kept for their memory from one segment to the next.
pub(crate) type WindowPool = Vec<Window>;

/// What a [`WindowReader`] reads next.
enum Read {
    Window(Window),
    /// The valid prefix ended: the judgement of the rest, and the windows left over.
    End(SegmentScan<'static>, Vec<Window>),
}

/// Reads `len` bytes from `offset` into `buf` (fewer at the end of the file), at least the
/// window size when the file has them. Only a longer read grows (and zeroes) the buffer.
fn read_window(
    file: &dyn FileHandle,
    buf: &mut Vec<u8>,
    offset: u64,
    need: u64,
    window: usize,
    len: u64,
) -> std::io::Result<()> {
    let want = need.max(window as u64).min(len.saturating_sub(offset));
    let want = usize::try_from(want).map_err(|_| std::io::Error::other("segment too large to read"))?;
    // `resize` zeroes only what it adds; bytes the buffer held are read over.
    buf.resize(want, 0);
    crate::fs::read_exact_at(file, buf, offset)
}

/// Reads a segment's frames from `pos` on, one window at a time, checking each as
/// [`FrameScanner`] does over the whole file: a frame is checked only once the window holds
/// all of it that the file holds, and where the valid prefix ends the window is extended to
/// the end of the file before the rest is judged (zeros, a bad frame, valid frames after it).
/// So every result, frames and errors alike, is the one a scan of the whole file gives.
#[derive(Clone)]
struct WindowReader {
    file: std::sync::Arc<dyn FileHandle>,
    len: u64,
    window: usize,
    start_lsn: u64,
    pos: u64,
}

impl WindowReader {
    /// Fills `w` from `pos` with the frames it holds whole (at least one, reading a longer
    /// window for a frame longer than the window), or judges the rest where the prefix ends.
    fn next(&mut self, mut w: Window) -> std::io::Result<Read> {
        w.frames.clear();
        let (file, len, window) = (self.file.as_ref(), self.len, self.window);
        let mut base = self.pos;
        read_window(file, &mut w.bytes, base, 0, window, len)?;
        'frames: while self.pos < len {
            // Read on while the frame at `pos` runs past the window and the file holds more:
            // first for its header, then for as long as the header says (an unreadable header
            // ends the prefix and is judged below). Only the window's first frame reads: the
            // others wait for the next window.
            while base + (w.bytes.len() as u64) < len {
                let rest = w.bytes.get(usize::try_from(self.pos - base).unwrap_or(usize::MAX)..).unwrap_or_default();
                let need = match rest.len() >= FRAME_HEADER_BYTES {
                    true => decode_frame_header(rest).map_or(0, |h| (FRAME_HEADER_BYTES + h.payload_len) as u64),
                    false => FRAME_HEADER_BYTES as u64,
                };
                if need <= rest.len() as u64 {
                    break;
                }
                if !w.frames.is_empty() {
                    break 'frames;
                }
                base = self.pos;
                read_window(file, &mut w.bytes, base, need, window, len)?;
            }
            let rel = usize::try_from(self.pos - base).unwrap_or(usize::MAX);
            match check_frame(&w.bytes, rel, self.start_lsn + (self.pos - SEGMENT_HEADER_BYTES)) {
                Ok((header, _)) => {
                    w.frames.push((header, self.pos, rel + FRAME_HEADER_BYTES));
                    self.pos += frame_bytes(header.payload_len) as u64;
                }
                Err(_) => break,
            }
        }
        if !w.frames.is_empty() {
            return Ok(Read::Window(w));
        }
        // The prefix ends at `pos`: the rest is judged over all of it, up to the end of the file.
        if self.pos < len && base + (w.bytes.len() as u64) < len {
            base = self.pos;
            read_window(file, &mut w.bytes, base, len - base, window, len)?;
        }
        let scan = FrameScanner::resume(&w.bytes, base, self.start_lsn, self.pos).finish().into_owned();
        Ok(Read::End(scan, vec![w]))
    }
}

impl SegmentScan<'_> {
    /// The scan without its frames, which borrow the segment's bytes.
    fn into_owned(self) -> SegmentScan<'static> {
        SegmentScan {
            frames: Vec::new(),
            valid_end: self.valid_end,
            bad: self.bad,
            later_valid_frames: self.later_valid_frames,
            later_max_durable_lsn: self.later_max_durable_lsn,
            zero_tail: self.zero_tail,
        }
    }
}

/// Where a [`SegmentFrames`] gets its windows.
enum Source {
    /// Read on the replay's thread (a segment of one window, or no thread to be had).
    Inline(WindowReader),
    /// Read ahead by a thread of their own; windows go back to it once applied.
    Thread {
        next: Option<std::sync::mpsc::Receiver<std::io::Result<Read>>>,
        back: Option<std::sync::mpsc::SyncSender<Window>>,
        thread: Option<std::thread::JoinHandle<()>>,
    },
}

/// A segment's frames, read a window at a time (see [`WindowReader`]) and handed out in
/// batches. A segment longer than one window is read ahead by a thread of its own, which also
/// checks the frames' checksums, while the caller applies the frames before them.
pub(crate) struct SegmentFrames<'a> {
    file: std::sync::Arc<dyn FileHandle>,
    /// The file's length when it was opened.
    len: u64,
    window: usize,
    /// The first window (for the header), or the whole file (see [`SegmentFrames::whole`]).
    head: &'a mut Vec<u8>,
    pool: &'a mut WindowPool,
    source: Option<Source>,
    /// The window being handed out, and how many of its frames have been.
    current: Option<Window>,
    handed: usize,
    end: Option<SegmentScan<'static>>,
}

impl<'a> SegmentFrames<'a> {
    /// Reads the first window (at least a segment header's length: it holds the header when
    /// the file does) into `head`. Windows for the frames come from `pool` and go back to it.
    pub fn open(
        file: std::sync::Arc<dyn FileHandle>,
        head: &'a mut Vec<u8>,
        pool: &'a mut WindowPool,
        window: usize,
    ) -> std::io::Result<SegmentFrames<'a>> {
        let len = file.len()?;
        let window = window.max(SEGMENT_HEADER_BYTES as usize);
        read_window(file.as_ref(), head, 0, 0, window, len)?;
        Ok(SegmentFrames { file, len, window, head, pool, source: None, current: None, handed: 0, end: None })
    }

    /// The file's length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// The bytes of the first window.
    pub fn window(&self) -> &[u8] {
        self.head
    }

    /// The whole file's bytes (for the rare judgements that need all of them at once).
    pub fn whole(&mut self) -> std::io::Result<&[u8]> {
        if (self.head.len() as u64) < self.len {
            read_window(self.file.as_ref(), self.head, 0, self.len, self.window, self.len)?;
        }
        Ok(self.head)
    }

    /// Starts reading the frames after the segment header, whose start LSN is `start_lsn`.
    pub fn start(&mut self, start_lsn: u64) {
        let mut reader = WindowReader {
            file: std::sync::Arc::clone(&self.file),
            len: self.len,
            window: self.window,
            start_lsn,
            pos: SEGMENT_HEADER_BYTES,
        };
        if self.len.saturating_sub(SEGMENT_HEADER_BYTES) <= self.window as u64 {
            self.source = Some(Source::Inline(reader));
            return;
        }
        let (to_replay, next) = std::sync::mpsc::sync_channel::<std::io::Result<Read>>(WINDOWS_AHEAD);
        let (back, free) = std::sync::mpsc::sync_channel::<Window>(WINDOWS_AHEAD + 1);
        for _ in 0..=WINDOWS_AHEAD {
            let _ = back.try_send(self.pool.pop().unwrap_or_default());
        }
        let inline = reader.clone();
        let spawned = std::thread::Builder::new().name("keeldb-wal-read".into()).spawn(move || {
            while let Ok(w) = free.recv() {
                let read = reader.next(w);
                let last = !matches!(read, Ok(Read::Window(_)));
                let read = match read {
                    Ok(Read::End(scan, mut left)) => {
                        left.extend(free.try_iter());
                        Ok(Read::End(scan, left))
                    }
                    other => other,
                };
                if to_replay.send(read).is_err() || last {
                    return;
                }
            }
        });
        self.source = Some(match spawned {
            Ok(thread) => Source::Thread { next: Some(next), back: Some(back), thread: Some(thread) },
            // No thread: read on this one (the windows queued for it are dropped with it).
            Err(_) => Source::Inline(inline),
        });
    }

    /// The next window, or the end, from the source.
    fn fetch(&mut self) -> std::io::Result<Read> {
        match &mut self.source {
            Some(Source::Inline(reader)) => reader.next(self.pool.pop().unwrap_or_default()),
            Some(Source::Thread { next: Some(next), .. }) => {
                next.recv().unwrap_or_else(|_| Err(std::io::Error::other("the WAL reader thread stopped")))
            }
            _ => Err(std::io::Error::other("segment frames read before `start`")),
        }
    }

    /// A window whose frames were all handed out goes back to be filled again.
    fn give_back(&mut self, w: Window) {
        match &self.source {
            Some(Source::Thread { back: Some(back), .. }) => {
                if let Err(std::sync::mpsc::TrySendError::Full(w) | std::sync::mpsc::TrySendError::Disconnected(w)) =
                    back.try_send(w)
                {
                    self.pool.push(w);
                }
            }
            _ => self.pool.push(w),
        }
    }

    /// The next frames of the valid prefix, at most `max`: none once the prefix has ended.
    pub fn next_batch(&mut self, max: usize) -> std::io::Result<Vec<ScannedFrame<'_>>> {
        loop {
            let pending = self.current.as_ref().is_some_and(|w| self.handed < w.frames.len());
            if pending || self.end.is_some() {
                break;
            }
            if let Some(w) = self.current.take() {
                self.give_back(w);
            }
            match self.fetch()? {
                Read::Window(w) => {
                    self.current = Some(w);
                    self.handed = 0;
                }
                Read::End(scan, left) => {
                    self.end = Some(scan);
                    self.pool.extend(left);
                }
            }
        }
        let Some(w) = &self.current else { return Ok(Vec::new()) };
        let from = self.handed.min(w.frames.len());
        let to = from.saturating_add(max).min(w.frames.len());
        self.handed = to;
        let frames = w.frames.get(from..to).unwrap_or_default();
        Ok(frames
            .iter()
            .map(|&(header, offset, start)| ScannedFrame {
                header,
                offset,
                payload: w.bytes.get(start..start + header.payload_len).unwrap_or_default(),
            })
            .collect())
    }

    /// What follows the valid prefix, as [`FrameScanner::finish`] gives it for the whole
    /// file. Frames not yet handed out are skipped over (checked, not returned).
    pub fn finish(mut self) -> std::io::Result<SegmentScan<'static>> {
        while !self.next_batch(usize::MAX)?.is_empty() {}
        if let Some(w) = self.current.take() {
            self.pool.push(w);
        }
        self.end.take().ok_or_else(|| std::io::Error::other("segment frames finished before `start`"))
    }
}

impl Drop for SegmentFrames<'_> {
    /// Stops a reader thread (its channels close) and waits for it: it never outlives the replay.
    fn drop(&mut self) {
        if let Some(Source::Thread { next, back, thread }) = &mut self.source {
            drop(next.take());
            drop(back.take());
            if let Some(t) = thread.take() {
                let _ = t.join();
            }
        }
    }
}

fn is_all_zero(bytes: &[u8]) -> bool {
    // Eight bytes at a time: a 1 MiB tail is read on every open.
    let words = bytes.chunks_exact(8);
    let rest = words.remainder();
    words.into_iter().all(|w| w == [0u8; 8]) && rest.iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment_with(frames: &[(u64, Vec<u8>)], start_lsn: u64) -> Vec<u8> {
        let mut bytes = encode_segment_header(&SegmentHeader { version: 1, seq: 1, start_lsn, first_ts: 1 });
        let mut lsn = start_lsn;
        for (ts, payload) in frames {
            let before = bytes.len();
            encode_frame(&mut bytes, lsn, 0, *ts, payload, crc32c::crc32c(payload));
            lsn += (bytes.len() - before) as u64;
        }
        bytes
    }

    fn payload(n: u8) -> Vec<u8> {
        let mut p = PayloadBuilder::new(16);
        p.put(1, &[n], b"value");
        p.finish()
    }

    #[test]
    fn frames_round_trip() {
        let bytes = segment_with(&[(1, payload(1)), (2, payload(2))], 100);
        let scan = scan_segment(&bytes, 100);
        assert!(scan.bad.is_none());
        assert_eq!(scan.frames.len(), 2);
        assert_eq!(scan.frames[1].header.ts, 2);
        let rec = decode_payload(scan.frames[1].payload).expect("decodes");
        assert_eq!(rec.kind, KIND_COMMIT);
        assert_eq!(rec.ops, vec![Op::Put { table: 1, key: &[2], value: b"value" }]);
        assert_eq!(rec.position, None, "a payload without the field decodes as before");
        let mut p = PayloadBuilder::new(16);
        p.put(1, b"k", b"v");
        p.applied_position(LogPosition::new(7, 2));
        let bytes = p.finish();
        let rec = decode_payload(&bytes).expect("decodes with a position");
        assert_eq!((rec.ops.len(), rec.position), (1, Some(LogPosition::new(7, 2))));
        let mut twice = bytes.clone();
        twice.extend_from_slice(&bytes[bytes.len() - 17..]);
        assert!(decode_payload(&twice).is_err(), "a repeated field is rejected");
        assert!(decode_payload(&bytes[..bytes.len() - 1]).is_err(), "a cut field is rejected");
        let mark_bytes = mark_payload(99);
        let mark = decode_payload(&mark_bytes).expect("mark decodes");
        assert_eq!((mark.kind, mark.digest), (KIND_MARK, Some(99)));
    }

    #[test]
    fn a_frame_built_in_place_equals_an_encoded_one() {
        let mut expected = vec![9u8; 16];
        let payload = payload(3);
        encode_frame(&mut expected, 64, 8, 5, &payload, crc32c::crc32c(&payload));
        let mut p = PayloadBuilder::in_frame(vec![9u8; 16], 0);
        p.put(1, &[3], b"value");
        assert_eq!(p.finish_frame(64, 8, 5), expected);
    }

    #[test]
    fn a_flipped_bit_ends_the_valid_prefix_and_later_frames_are_found() {
        let mut bytes = segment_with(&[(1, payload(1)), (2, payload(2)), (3, payload(3))], 0);
        let second = SEGMENT_HEADER_BYTES as usize + frame_bytes(payload(1).len());
        bytes[second + FRAME_HEADER_BYTES + 3] ^= 0x10;
        let scan = scan_segment(&bytes, 0);
        assert_eq!(scan.frames.len(), 1);
        assert_eq!(scan.bad.as_ref().map(|b| b.offset), Some(second as u64));
        assert_eq!(scan.later_valid_frames, 1);
    }

    #[test]
    fn zeros_after_the_last_frame_end_the_log_but_anything_else_is_a_bad_frame() {
        let mut bytes = segment_with(&[(1, payload(1)), (2, payload(2))], 0);
        let end = bytes.len();
        bytes.resize(end + 4096 + 3, 0);
        let scan = scan_segment(&bytes, 0);
        assert!(scan.bad.is_none());
        assert_eq!((scan.frames.len(), scan.valid_end, scan.zero_tail), (2, end as u64, 4099));
        // One nonzero byte anywhere in the zeros, even the last: a bad frame at the end.
        for at in [end, end + 40, bytes.len() - 1] {
            let mut b = bytes.clone();
            b[at] = 1;
            let scan = scan_segment(&b, 0);
            assert_eq!(scan.bad.as_ref().map(|b| b.offset), Some(end as u64), "nonzero byte at {at}");
            assert_eq!(scan.zero_tail, 0);
        }
        // A frame after zeros (a lost frame, a later one kept) is a bad frame, found later.
        let mut b = bytes.clone();
        let mut later = Vec::new();
        encode_frame(&mut later, 1000, 0, 9, &payload(9), crc32c::crc32c(&payload(9)));
        let at = SEGMENT_HEADER_BYTES as usize + 1000; // LSN 1000 at its position
        b[at..at + later.len()].copy_from_slice(&later);
        let scan = scan_segment(&b, 0);
        assert_eq!(scan.bad.as_ref().map(|b| b.offset), Some(end as u64));
        assert_eq!(scan.later_valid_frames, 1);
    }

    #[test]
    fn a_frame_moved_to_another_position_is_rejected() {
        let bytes = segment_with(&[(1, payload(1))], 0);
        // Same bytes presented as if the segment started at another LSN.
        let scan = scan_segment(&bytes, 4096);
        assert!(scan.frames.is_empty());
        assert!(scan.bad.is_some());
    }

    /// A segment file in memory. Its reads, but the first window's (at offset 0), fail from
    /// byte `.1` on (`u64::MAX`: never).
    #[derive(Debug)]
    struct MemFile(Vec<u8>, u64);

    impl FileHandle for MemFile {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
            if offset > 0 && offset.saturating_add(buf.len() as u64) > self.1 {
                return Err(std::io::Error::other("injected read error"));
            }
            let src = self.0.get(offset as usize..).unwrap_or_default();
            let n = src.len().min(buf.len());
            buf[..n].copy_from_slice(&src[..n]);
            Ok(n)
        }
        fn write_at(&self, _: &[u8], _: u64) -> std::io::Result<usize> {
            Err(std::io::Error::other("read only"))
        }
        fn sync_data(&self) -> std::io::Result<()> {
            Ok(())
        }
        fn len(&self) -> std::io::Result<u64> {
            Ok(self.0.len() as u64)
        }
        fn set_len(&self, _: u64) -> std::io::Result<()> {
            Err(std::io::Error::other("read only"))
        }
    }

    type Summary = (Vec<(u64, u64, Vec<u8>)>, u64, Option<(u64, u64, &'static str)>, u64, u64, u64);

    fn summary(frames: Vec<(u64, u64, Vec<u8>)>, scan: &SegmentScan<'_>) -> Summary {
        let bad = scan.bad.as_ref().map(|b| (b.offset, b.lsn, b.reason));
        (frames, scan.valid_end, bad, scan.later_valid_frames, scan.later_max_durable_lsn, scan.zero_tail)
    }

    fn windowed(
        bytes: &[u8],
        start_lsn: u64,
        window: usize,
        batch: usize,
        buf: &mut Vec<u8>,
        pool: &mut WindowPool,
    ) -> Summary {
        let file: std::sync::Arc<dyn FileHandle> = std::sync::Arc::new(MemFile(bytes.to_vec(), u64::MAX));
        let mut frames = SegmentFrames::open(file, buf, pool, window).expect("opens");
        frames.start(start_lsn);
        let mut found = Vec::new();
        loop {
            let got = frames.next_batch(batch).expect("reads");
            if got.is_empty() {
                break;
            }
            assert!(got.len() <= batch);
            found.extend(got.iter().map(|f| (f.offset, f.header.ts, f.payload.to_vec())));
        }
        let scan = frames.finish().expect("finishes");
        assert!(scan.frames.is_empty());
        summary(found, &scan)
    }

    #[test]
    fn a_segment_read_in_windows_scans_as_it_does_whole() {
        let start_lsn = 4096;
        // Payloads of many lengths, some longer than the smallest windows.
        let frames: Vec<(u64, Vec<u8>)> = (1..=40u64)
            .map(|ts| {
                let mut p = PayloadBuilder::new(16);
                p.put(1, &ts.to_le_bytes(), &vec![ts as u8; (ts as usize * 37) % 301]);
                (ts, p.finish())
            })
            .collect();
        let clean = segment_with(&frames, start_lsn);
        let header = SEGMENT_HEADER_BYTES as usize;
        let second = header + frame_bytes(frames[0].1.len());
        let mut cases: Vec<(&str, Vec<u8>)> = vec![("clean", clean.clone())];
        let mut zeros = clean.clone();
        zeros.resize(clean.len() + 5000, 0);
        cases.push(("zero tail", zeros.clone()));
        let mut nonzero = zeros.clone();
        nonzero[clean.len() + 4000] = 7;
        cases.push(("a nonzero byte in the zeros", nonzero));
        let mut flipped = clean.clone();
        flipped[second + FRAME_HEADER_BYTES + 2] ^= 1;
        cases.push(("a flipped payload bit, later frames kept", flipped));
        let mut bad_header = clean.clone();
        bad_header[second + 1] ^= 0x40;
        cases.push(("a damaged frame header", bad_header));
        cases.push(("a torn last payload", clean[..clean.len() - 30].to_vec()));
        let last_len = frames.last().map_or(0, |(_, p)| p.len());
        let unpadded = clean.len() - frame_bytes(last_len) + FRAME_HEADER_BYTES + last_len;
        assert!(unpadded < clean.len(), "the last frame has padding to cut");
        cases.push(("torn padding only", clean[..unpadded].to_vec()));
        cases.push(("a torn frame header", clean[..clean.len() - frame_bytes(last_len) + 20].to_vec()));
        cases.push(("no frames", clean[..header].to_vec()));
        let mut buf = vec![0xAA; 3];
        let mut pool = WindowPool::new();
        for (name, bytes) in &cases {
            let whole = scan_segment(bytes, start_lsn);
            let frames_whole = whole.frames.iter().map(|f| (f.offset, f.header.ts, f.payload.to_vec())).collect();
            let expected = summary(frames_whole, &whole);
            for window in [1, 40, 64, 100, 333, 1000, 4096, 1 << 20] {
                for batch in [1, 3, 16] {
                    // The buffer is reused across all cases: stale bytes must never be read.
                    let got = windowed(bytes, start_lsn, window, batch, &mut buf, &mut pool);
                    assert_eq!(got, expected, "{name}, window {window}, batch {batch}");
                }
            }
        }
    }

    #[test]
    fn a_read_error_anywhere_in_a_segment_is_returned_not_skipped() {
        let frames: Vec<(u64, Vec<u8>)> = (1..=200u64).map(|ts| (ts, payload(ts as u8))).collect();
        let bytes = segment_with(&frames, 0);
        let (mut buf, mut pool) = (Vec::new(), WindowPool::new());
        // Windows of 256 B (read ahead by the thread) and of the whole file (read inline).
        for window in [256, 1 << 20] {
            for fail_from in [300, 2_000, bytes.len() as u64 - 10] {
                let file: std::sync::Arc<dyn FileHandle> = std::sync::Arc::new(MemFile(bytes.clone(), fail_from));
                let mut frames = SegmentFrames::open(file, &mut buf, &mut pool, window).expect("the head reads");
                frames.start(0);
                let mut handed = 0;
                let failed = loop {
                    match frames.next_batch(7) {
                        Ok(b) if b.is_empty() => break false,
                        Ok(b) => handed += b.len(),
                        Err(_) => break true,
                    }
                };
                let finished = frames.finish();
                assert!(failed || finished.is_err(), "window {window}, failing from {fail_from}: no error");
                assert!(
                    handed < frames_len(&bytes),
                    "window {window}, failing from {fail_from}: every frame handed out"
                );
            }
        }
    }

    fn frames_len(bytes: &[u8]) -> usize {
        scan_segment(bytes, 0).frames.len()
    }

    #[test]
    fn a_replay_that_stops_early_stops_its_reader_thread() {
        let frames: Vec<(u64, Vec<u8>)> = (1..=200u64).map(|ts| (ts, payload(ts as u8))).collect();
        let bytes = segment_with(&frames, 0);
        let (mut buf, mut pool) = (Vec::new(), WindowPool::new());
        for taken in [0, 1, 5] {
            let file: std::sync::Arc<dyn FileHandle> = std::sync::Arc::new(MemFile(bytes.clone(), u64::MAX));
            let mut frames = SegmentFrames::open(file, &mut buf, &mut pool, 256).expect("opens");
            frames.start(0);
            for _ in 0..taken {
                assert_eq!(frames.next_batch(1).expect("reads").len(), 1);
            }
            // Dropped with windows still in flight: the drop joins the thread, or this hangs.
            drop(frames);
        }
    }

    #[test]
    fn decoder_rejects_garbage_without_panicking() {
        for len in 0..64 {
            let junk: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
            let _ = decode_payload(&junk);
            let _ = decode_frame_header(&junk);
            let _ = decode_segment_header(&junk);
            let _ = scan_segment(&junk, 0);
        }
        let mut huge_count = vec![KIND_COMMIT];
        huge_count.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_payload(&huge_count).is_err());
    }
}
