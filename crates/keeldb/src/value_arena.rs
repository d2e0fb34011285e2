//! The values of one table, packed into 2 MiB chunks instead of one heap allocation each.
//!
//! Why: a point read in a large table misses the cache three times (hash group, slot, value).
//! The hash table and the slot slab sit in huge pages (`huge.rs`), but a value allocated on
//! its own sits in the allocator's 4 KiB pages, so its miss also walks the page tables. And
//! the allocator rounds a 100-byte value up to a 112-byte chunk (its header included); here
//! it takes 100 bytes, its length rounded up to 4.
//!
//! How: values of at most [`SMALL_MAX`] bytes take a block of their length rounded up to 4,
//! and at least 8 bytes (their *class*). Blocks are cut front to back from the newest chunk; a
//! freed block goes on its class's free list (the next block's address written into its
//! first 8 bytes, which is why no block is shorter) and is
//! the first one the next value of that class takes. A longer value gets a chunk of its own,
//! freed with it. Chunks double from 4 KiB to 2 MiB. A 2 MiB chunk is a huge-page mapping
//! (`huge.rs`) when the process-wide pool has one ready: a thread of its own faults those in,
//! because a huge page's first touch can stall for milliseconds while the kernel compacts
//! memory, and that touch would otherwise fall inside a commit. With none ready the chunk is
//! ordinary heap memory, faulted in page by page as blocks are cut.
//!
//! Invariants:
//! - A [`ValueRef`] handed out by [`ValueArena::alloc`] names bytes that nothing else names
//!   until it is passed to [`ValueArena::free`], which the owner does exactly once.
//! - Blocks are cut from a small chunk front to back and never overlap; a small chunk is
//!   never freed while the arena lives.
//! - Every block on a class's free list is a freed block of that class.
//!
//! All indexing is checked: a wrong reference reads an empty value, never another
//! allocation's bytes beyond its chunk, and never panics.
//!
//! Weakness: freed blocks serve only values of their own class, and small chunks go back to
//! the system only when the table is dropped. A table whose values change size over time
//! keeps the blocks of the old sizes for reuse by values of those sizes. Once any table has
//! reached 2 MiB chunks, the pool holds at least [`POOL_READY`] and at most [`POOL_MAX`]
//! chunks (2 MiB each, counting those dropped tables returned) for the process's life.

use std::num::NonZeroU32;
use std::sync::{Condvar, Mutex, OnceLock};

use allocator_api2::vec::Vec as AllocVec;

use crate::huge::HugePages;

/// The largest chunk that small values are cut from: one huge page. The first is
/// [`FIRST_CHUNK`] bytes, and each next one as large as all before it together, so a table
/// with a few values holds a few KiB, not a huge page.
const CHUNK: usize = 2 << 20;
const FIRST_CHUNK: usize = 4 << 10;

/// Values up to this many bytes are cut from shared chunks; longer ones get a chunk each.
pub(crate) const SMALL_MAX: usize = 1024;

/// Block sizes are multiples of this. Values are byte strings, read and written with byte
/// copies, so a block needs no alignment; with 8, a 100-byte value took 104 bytes (4 bytes a
/// key of the large-table benchmark's 206, measured at 1M keys).
const GRAIN: usize = 4;

/// The shortest block: the room a free block needs for its link.
const MIN_BLOCK: usize = 8;

const CLASSES: usize = SMALL_MAX / GRAIN;

/// No block: the end of a free list.
const NIL: u64 = u64::MAX;

/// The chunk number of empty values, which take no block.
const EMPTY: u32 = u32::MAX - 1;

/// Where a value's bytes are, in 8 bytes: its chunk, and within it the value's offset and
/// length. The chunk number is kept plus one, in a `NonZeroU32`, so that `Option<ValueRef>` (a
/// version's value or tombstone) needs no tag. A small value's offset (below 2 MiB, 21 bits)
/// and length (at most [`SMALL_MAX`], 11 bits) share the second word; a long value has its
/// chunk to itself, so that word only says so ([`LONG`]) and the chunk's length is the
/// value's. At 12 bytes (a word each) a key's slot was 56 bytes; at 8 it is 48 (`index.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ValueRef {
    chunk_id: NonZeroU32,
    place: u32,
}

/// Bits of [`ValueRef::place`] that hold a small value's length.
const LEN_BITS: u32 = 11;
/// The `place` of a long value. No small value has it: offsets are multiples of [`GRAIN`].
const LONG: u32 = u32::MAX;

const _: () = assert!(SMALL_MAX < 1 << LEN_BITS && CHUNK <= 1 << (32 - LEN_BITS));

impl ValueRef {
    /// A small value: `len` (at most [`SMALL_MAX`]) bytes at `offset` (below [`CHUNK`]) in
    /// chunk `chunk`, a chunk number or [`EMPTY`] (chunk numbers stay far below it: each
    /// chunk holds over 1 KiB of memory).
    fn at(chunk: u32, offset: u32, len: u32) -> ValueRef {
        ValueRef::new(chunk, offset << LEN_BITS | len)
    }

    /// The long value that fills chunk `chunk`.
    fn long(chunk: u32) -> ValueRef {
        ValueRef::new(chunk, LONG)
    }

    fn new(chunk: u32, place: u32) -> ValueRef {
        ValueRef { chunk_id: NonZeroU32::new(chunk.wrapping_add(1)).unwrap_or(NonZeroU32::MAX), place }
    }

    fn chunk(self) -> u32 {
        self.chunk_id.get() - 1
    }

    #[cfg(test)]
    fn offset(self) -> u32 {
        self.small().map_or(0, |(offset, _)| offset as u32)
    }

    /// A small value's offset and length; `None` for a long value.
    fn small(self) -> Option<(usize, usize)> {
        (self.place != LONG)
            .then_some(((self.place >> LEN_BITS) as usize, (self.place & ((1 << LEN_BITS) - 1)) as usize))
    }
}

/// A chunk's memory: a huge-page mapping that the pool's thread has already faulted in and
/// zeroed, or ordinary heap memory whose pages fault in as blocks are cut (`len` grows with
/// the blocks; `with_capacity` reserves the rest).
#[derive(Debug)]
enum Chunk {
    Huge(AllocVec<u8, HugePages>),
    Plain(Vec<u8>),
}

impl Chunk {
    fn empty() -> Chunk {
        Chunk::Plain(Vec::new())
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Chunk::Huge(v) => v,
            Chunk::Plain(v) => v,
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Chunk::Huge(v) => v,
            Chunk::Plain(v) => v,
        }
    }

    fn capacity(&self) -> usize {
        match self {
            Chunk::Huge(v) => v.capacity(),
            Chunk::Plain(v) => v.capacity(),
        }
    }

    /// `len` bytes from `offset` on, made part of the chunk first if they are not yet.
    fn block_mut(&mut self, offset: usize, len: usize) -> Option<&mut [u8]> {
        if let Chunk::Plain(v) = self {
            if v.len() < offset + len && offset + len <= v.capacity() {
                v.resize(offset + len, 0);
            }
        }
        self.bytes_mut().get_mut(offset..offset + len)
    }
}

/// Huge chunks, faulted in by a thread of their own. A huge page's first touch can stall
/// for milliseconds while the kernel compacts memory (THP `defrag` at `madvise`, the
/// default), and the first touch of a chunk is inside a commit; so commits only take chunks
/// this pool has touched already, and fall back to ordinary heap memory when it has none
/// ready. Chunks of dropped tables come back here (up to [`POOL_MAX`]).
struct Pool {
    ready: Mutex<Vec<AllocVec<u8, HugePages>>>,
    wanted: Condvar,
}

/// Chunks the pool's thread keeps ready. One: the thread faults a chunk in within about a
/// millisecond, while a table loading values at 100 MB/s fills one in 20; a second ready chunk
/// was 2 MiB resident for nothing (2 bytes a key at 1M keys).
const POOL_READY: usize = 1;
/// Chunks the pool holds at most, ready ones and returned ones together.
const POOL_MAX: usize = 8;

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        // Without the thread the pool stays empty and every chunk is ordinary memory.
        let _ = std::thread::Builder::new().name("keeldb-chunks".into()).spawn(fill_pool);
        Pool { ready: Mutex::new(Vec::new()), wanted: Condvar::new() }
    })
}

/// The pool's thread: keeps [`POOL_READY`] chunks mapped, faulted in and zeroed.
fn fill_pool() {
    let pool = pool();
    loop {
        let Ok(mut ready) = pool.ready.lock() else { return };
        while ready.len() >= POOL_READY {
            ready = match pool.wanted.wait(ready) {
                Ok(r) => r,
                Err(_) => return,
            };
        }
        drop(ready);
        let mut chunk = AllocVec::with_capacity_in(CHUNK, HugePages);
        chunk.resize(CHUNK, 0);
        match pool.ready.lock() {
            Ok(mut ready) => ready.push(chunk),
            Err(_) => return,
        }
    }
}

/// A ready huge chunk, if the pool has one; asks its thread for another.
fn take_huge() -> Option<AllocVec<u8, HugePages>> {
    let pool = pool();
    let chunk = pool.ready.lock().ok()?.pop();
    pool.wanted.notify_one();
    chunk
}

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct ValueArena {
    chunks: Vec<Chunk>,
    /// The small chunk blocks are cut from (`EMPTY` before the first).
    current: u32,
    /// How much of `current` blocks have been cut from (a huge chunk comes zeroed whole, a
    /// plain one grows block by block: see [`Chunk::block_mut`]).
    used: usize,
    /// Head of each class's free list, as `chunk << 32 | offset`, or `NIL` (empty until the
    /// first free, so that a table that never frees a value holds no list heads).
    free: Vec<u64>,
    /// Numbers of chunks whose long value was freed, for the next long value.
    spare: Vec<u32>,
    /// Bytes of all small chunks together.
    small_reserved: usize,
}

impl Drop for ValueArena {
    /// Gives the huge chunks back to the pool (what it has room for). Not zeroed: nothing
    /// reads a block's bytes before a value is copied over them.
    fn drop(&mut self) {
        let mut huge = self.chunks.drain(..).filter_map(|c| match c {
            Chunk::Huge(v) if v.len() == CHUNK => Some(v),
            _ => None,
        });
        let Some(first) = huge.next() else { return };
        if let Ok(mut ready) = pool().ready.lock() {
            for v in std::iter::once(first).chain(huge) {
                if ready.len() >= POOL_MAX {
                    break;
                }
                ready.push(v);
            }
        }
    }
}

impl Default for ValueArena {
    fn default() -> Self {
        ValueArena {
            chunks: Vec::new(),
            current: EMPTY,
            used: 0,
            free: Vec::new(),
            spare: Vec::new(),
            small_reserved: 0,
        }
    }
}

/// The block size and size class of a small value of `len` bytes (`len >= 1`). Class 0 (a
/// 4-byte block) is never used: values of up to 8 bytes take [`MIN_BLOCK`].
fn block_of(len: usize) -> (usize, usize) {
    let block = (len.div_ceil(GRAIN) * GRAIN).max(MIN_BLOCK);
    (block, block / GRAIN - 1)
}

fn link(chunk: u32, offset: u32) -> u64 {
    (u64::from(chunk) << 32) | u64::from(offset)
}

impl ValueArena {
    /// Copies `value` in; the reference stays valid until [`ValueArena::free`].
    /// Values longer than `u32::MAX` bytes are not accepted by the engine (`MAX_VALUE_BYTES`).
    pub fn alloc(&mut self, value: &[u8]) -> ValueRef {
        let len = value.len();
        if len == 0 {
            return ValueRef::at(EMPTY, 0, 0);
        }
        if len > SMALL_MAX {
            let chunk = Chunk::Plain(value.to_vec());
            let n = match self.spare.pop() {
                Some(n) if (n as usize) < self.chunks.len() => {
                    if let Some(c) = self.chunks.get_mut(n as usize) {
                        *c = chunk;
                    }
                    n
                }
                _ => {
                    self.chunks.push(chunk);
                    (self.chunks.len() - 1) as u32
                }
            };
            return ValueRef::long(n);
        }
        let (block, class) = block_of(len);
        let len32 = len as u32; // at most SMALL_MAX
        if let Some(r) = self.take_free(class, value, len32) {
            return r;
        }
        let room = self.chunks.get(self.current as usize).map_or(0, |c| c.capacity().saturating_sub(self.used));
        if room < block {
            let size = self.small_reserved.clamp(FIRST_CHUNK, CHUNK);
            self.small_reserved += size;
            let chunk = match (size == CHUNK).then(take_huge).flatten() {
                Some(huge) => Chunk::Huge(huge),
                None => Chunk::Plain(Vec::with_capacity(size)),
            };
            self.chunks.push(chunk);
            self.current = (self.chunks.len() - 1) as u32;
            self.used = 0;
        }
        let offset = self.used;
        // The whole block becomes part of the chunk: a free list links it through its first
        // 8 bytes, which may lie past the value's end.
        let dst = self
            .chunks
            .get_mut(self.current as usize)
            .and_then(|c| c.block_mut(offset, block))
            .and_then(|b| b.get_mut(..len));
        debug_assert!(dst.is_some(), "the chunk has room for the block");
        let Some(dst) = dst else {
            return ValueRef::at(EMPTY, 0, 0); // unreachable: room was checked
        };
        dst.copy_from_slice(value);
        self.used += block;
        ValueRef::at(self.current, offset as u32, len32)
    }

    /// A block from `class`'s free list, filled with `value`.
    fn take_free(&mut self, class: usize, value: &[u8], len: u32) -> Option<ValueRef> {
        let head = *self.free.get(class)?;
        if head == NIL {
            return None;
        }
        let (chunk, offset) = ((head >> 32) as u32, head as u32);
        let start = offset as usize;
        let block = self.chunks.get_mut(chunk as usize)?.bytes_mut().get_mut(start..start + (class + 1) * GRAIN)?;
        let next = block.first_chunk::<8>().map_or(NIL, |b| u64::from_le_bytes(*b));
        block.get_mut(..value.len())?.copy_from_slice(value);
        if let Some(h) = self.free.get_mut(class) {
            *h = next;
        }
        Some(ValueRef::at(chunk, offset, len))
    }

    /// The bytes of `r` (empty if `r` names nothing here, which is a bug of the caller).
    #[inline]
    pub fn get(&self, r: ValueRef) -> &[u8] {
        let Some(chunk) = self.chunks.get(r.chunk() as usize) else { return &[] };
        match r.small() {
            Some((start, len)) => chunk.bytes().get(start..start + len).unwrap_or_default(),
            None => chunk.bytes(),
        }
    }

    /// Gives `r`'s bytes back. Each reference must be freed at most once.
    pub fn free(&mut self, r: ValueRef) {
        if r.chunk() == EMPTY {
            return;
        }
        let Some((start, len)) = r.small() else {
            if let Some(c) = self.chunks.get_mut(r.chunk() as usize) {
                *c = Chunk::empty();
                self.spare.push(r.chunk());
            }
            return;
        };
        if len == 0 {
            return;
        }
        let (block, class) = block_of(len);
        if self.free.is_empty() {
            self.free = vec![NIL; CLASSES];
        }
        let Some(head) = self.free.get_mut(class) else { return };
        let Some(bytes) =
            self.chunks.get_mut(r.chunk() as usize).and_then(|c| c.bytes_mut().get_mut(start..start + block))
        else {
            return;
        };
        if let Some(first) = bytes.first_chunk_mut::<8>() {
            *first = head.to_le_bytes();
            *head = link(r.chunk(), start as u32);
        }
    }

    /// Bytes reserved from the system: every chunk's capacity (zeroed when made).
    #[cfg(test)]
    pub fn reserved(&self) -> usize {
        self.chunks.iter().map(|c| c.capacity()).sum()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn value(seed: u64, len: usize) -> Vec<u8> {
        (0..len).map(|i| (seed.wrapping_mul(31).wrapping_add(i as u64 * 7) % 251) as u8).collect()
    }

    #[test]
    fn values_read_back_and_freed_blocks_are_reused_by_their_class() {
        let mut a = ValueArena::default();
        let r1 = a.alloc(&value(1, 100));
        let r2 = a.alloc(&value(2, 100));
        let empty = a.alloc(&[]);
        assert_eq!(a.get(r1), &value(1, 100)[..]);
        assert_eq!(a.get(r2), &value(2, 100)[..]);
        assert_eq!(a.get(empty), b"");
        assert_eq!(a.reserved(), FIRST_CHUNK, "one small chunk holds both");
        a.free(r1);
        a.free(empty);
        assert_eq!(a.get(r2), &value(2, 100)[..], "freeing one block leaves its neighbour alone");
        // 97..=100 bytes share r1's class: the next such value takes its block.
        let r3 = a.alloc(&value(3, 97));
        assert_eq!((r3.chunk(), r3.offset()), (r1.chunk(), r1.offset()));
        assert_eq!(a.get(r3), &value(3, 97)[..]);
        // Another class does not.
        let r4 = a.alloc(&value(4, 40));
        assert_ne!((r4.chunk(), r4.offset()), (r1.chunk(), r1.offset()));
        assert_eq!(a.get(r2), &value(2, 100)[..]);
        // The newest block, whose value ends short of the block's end, is reused too.
        let last = a.alloc(&value(5, 97));
        a.free(last);
        let again = a.alloc(&value(6, 99));
        assert_eq!((again.chunk(), again.offset()), (last.chunk(), last.offset()));
        assert_eq!(a.get(again), &value(6, 99)[..]);
        // 101 bytes is the next class: a block of 104.
        let next_class = a.alloc(&value(7, 101));
        a.free(next_class);
        let r5 = a.alloc(&value(8, 100));
        assert_ne!((r5.chunk(), r5.offset()), (next_class.chunk(), next_class.offset()));
        assert_eq!(a.get(r5), &value(8, 100)[..]);
    }

    #[test]
    fn blocks_are_lengths_rounded_up_to_four_and_at_least_eight() {
        assert_eq!(block_of(1), (8, 1));
        assert_eq!(block_of(8), (8, 1));
        assert_eq!(block_of(9), (12, 2));
        assert_eq!(block_of(100), (100, 24));
        assert_eq!(block_of(SMALL_MAX), (SMALL_MAX, CLASSES - 1));
        // Two 100-byte values sit 100 bytes apart; a 1-byte value's freed block holds a link.
        let mut a = ValueArena::default();
        let r1 = a.alloc(&value(1, 100));
        let r2 = a.alloc(&value(2, 100));
        assert_eq!(r2.offset() - r1.offset(), 100);
        let tiny = a.alloc(&value(3, 1));
        let other = a.alloc(&value(4, 5));
        a.free(tiny);
        a.free(other);
        let back = a.alloc(&value(5, 7));
        assert_eq!((back.chunk(), back.offset()), (other.chunk(), other.offset()), "last freed, first reused");
        let back2 = a.alloc(&value(6, 2));
        assert_eq!((back2.chunk(), back2.offset()), (tiny.chunk(), tiny.offset()));
        assert_eq!(a.get(back), &value(5, 7)[..]);
        assert_eq!(a.get(back2), &value(6, 2)[..]);
        assert_eq!(a.get(r1), &value(1, 100)[..]);
        assert_eq!(a.get(r2), &value(2, 100)[..]);
    }

    #[test]
    fn long_values_get_their_own_chunk_freed_with_them() {
        let mut a = ValueArena::default();
        let long = value(9, SMALL_MAX + 1);
        let r = a.alloc(&long);
        assert_eq!(a.get(r), &long[..]);
        let small = a.alloc(&value(1, 8));
        a.free(r);
        assert_eq!(a.get(r), b"", "a freed long value's chunk is gone");
        let huge = value(10, 3 << 20);
        let r2 = a.alloc(&huge);
        assert_eq!(r2.chunk(), r.chunk(), "its number is reused");
        assert_eq!(a.get(r2), &huge[..]);
        assert_eq!(a.get(small), &value(1, 8)[..]);
    }

    #[test]
    fn chunks_double_up_to_a_huge_page() {
        let mut a = ValueArena::default();
        let first = FIRST_CHUNK / 1024;
        let refs: Vec<ValueRef> = (0..20_000u64).map(|i| a.alloc(&value(i, 1020))).collect();
        assert_eq!(refs[first - 1].chunk(), refs[0].chunk());
        assert_ne!(refs[first].chunk(), refs[0].chunk(), "a full chunk starts another");
        let sizes: Vec<usize> = a.chunks.iter().map(|c| c.capacity()).collect();
        assert_eq!(sizes[..3], [FIRST_CHUNK, FIRST_CHUNK, 2 * FIRST_CHUNK]);
        assert!(sizes.iter().all(|&s| s <= CHUNK));
        assert_eq!(sizes.last(), Some(&CHUNK), "{sizes:?}");
        for (i, r) in refs.iter().enumerate() {
            assert_eq!(a.get(*r), &value(i as u64, 1020)[..]);
        }
    }

    /// Random allocations and frees of every size class against a model.
    #[test]
    fn random_allocs_and_frees_match_a_model() {
        let mut a = ValueArena::default();
        let mut live: Vec<(ValueRef, Vec<u8>)> = Vec::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if live.is_empty() || !x.is_multiple_of(3) {
                let len = match x % 10 {
                    0 => 0,
                    1 => SMALL_MAX + (x >> 8) as usize % 3000,
                    _ => 1 + (x >> 8) as usize % SMALL_MAX,
                };
                let v = value(step, len);
                let r = a.alloc(&v);
                live.push((r, v));
            } else {
                let (r, _) = live.swap_remove((x >> 8) as usize % live.len());
                a.free(r);
            }
            if step % 1000 == 0 {
                for (r, v) in &live {
                    assert_eq!(a.get(*r), &v[..], "step {step}");
                }
            }
        }
        for (r, v) in &live {
            assert_eq!(a.get(*r), &v[..]);
        }
    }
}
