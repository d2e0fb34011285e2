//! An allocator for the index's large arrays (the slot slab and the hash table): allocations of
//! 2 MiB and more get their own mapping, aligned to 2 MiB and advised for transparent huge
//! pages; smaller ones go to the global allocator.
//!
//! A point read in a large table misses the cache on the hash table and on the slot, and with
//! 4 KiB pages each miss also walks the page tables (twice over under nested paging). With
//! 2 MiB pages the TLB covers those arrays. Kernels that give no huge pages (THP `never`, or
//! no free 2 MiB frames) still back the mapping with small pages: nothing changes but speed.
//!
//! Invariant: whether an allocation is mapped here depends only on its layout's size
//! (`size >= HUGE`), so `deallocate` and `grow` always find the allocation where `allocate`
//! put it. The mapping's length is the size rounded up to 2 MiB, which the allocator reports
//! as the block's size.

#![allow(unsafe_code)]

use std::alloc::Layout;
use std::ptr::NonNull;

use allocator_api2::alloc::{AllocError, Allocator, Global};

/// The huge page size (x86-64 and aarch64 with 4 KiB base pages).
const HUGE: usize = 2 << 20;

#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct HugePages;

fn mapped(layout: Layout) -> bool {
    layout.size() >= HUGE && layout.align() <= HUGE
}

fn mapping_len(size: usize) -> Option<usize> {
    size.checked_add(HUGE - 1).map(|s| s & !(HUGE - 1))
}

/// Maps `len` (a multiple of `HUGE`) bytes aligned to `HUGE`, advised for huge pages.
fn map(len: usize) -> Option<NonNull<u8>> {
    let over = len.checked_add(HUGE)?;
    // SAFETY: an anonymous private mapping at an address the kernel chooses touches no
    // existing memory; the result is checked for MAP_FAILED.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            over,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    let start = p as usize;
    let aligned = (start + HUGE - 1) & !(HUGE - 1);
    let end = aligned + len;
    // SAFETY: both trimmed pieces lie inside the mapping just made and nothing refers to them.
    unsafe {
        if aligned > start {
            libc::munmap(p, aligned - start);
        }
        if start + over > end {
            libc::munmap(end as *mut libc::c_void, start + over - end);
        }
        // Advice only: a kernel without THP refuses it, and small pages serve as before.
        libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
    NonNull::new(aligned as *mut u8)
}

// SAFETY: blocks of the global allocator are returned to it; mapped blocks are `len` bytes of
// a private mapping owned by the block until `deallocate` unmaps exactly that range (the
// invariant in the module comment keeps the two kinds apart). Copies of `HugePages` are
// interchangeable: the allocator has no state.
unsafe impl Allocator for HugePages {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        if !mapped(layout) {
            return Global.allocate(layout);
        }
        let len = mapping_len(layout.size()).ok_or(AllocError)?;
        let p = map(len).ok_or(AllocError)?;
        Ok(NonNull::slice_from_raw_parts(p, len))
    }

    /// Moves a mapped block's pages to a larger mapping instead of copying them: a slab that
    /// doubles from 512 MiB to 1 GiB would otherwise copy 512 MiB and fault in as much fresh
    /// memory (inside whichever commit or recovery step pushed the slot that did not fit). The
    /// target is an aligned, advised mapping made first, so the moved range keeps its 2 MiB
    /// alignment and huge pages move as whole page-table entries. Falls back to a copy when the
    /// move is refused.
    unsafe fn grow(
        &self,
        ptr: NonNull<u8>,
        old_layout: Layout,
        new_layout: Layout,
    ) -> Result<NonNull<[u8]>, AllocError> {
        if !mapped(old_layout) && !mapped(new_layout) {
            // SAFETY: both layouts are the global allocator's (module invariant); the caller's
            // guarantees pass through unchanged.
            return unsafe { Global.grow(ptr, old_layout, new_layout) };
        }
        if mapped(old_layout) && mapped(new_layout) {
            let old_len = mapping_len(old_layout.size()).ok_or(AllocError)?;
            let new_len = mapping_len(new_layout.size()).ok_or(AllocError)?;
            if new_len <= old_len {
                return Ok(NonNull::slice_from_raw_parts(ptr, old_len));
            }
            if let Some(target) = map(new_len) {
                // SAFETY: `ptr` is a mapped block of exactly `old_len` bytes, owned by the
                // caller's allocation; `target` is a fresh mapping of `new_len` bytes that
                // nothing refers to. MREMAP_FIXED replaces `target` with the old pages (and
                // zero pages past them) and unmaps the old range, which the caller gives up
                // on success. On failure neither range changes.
                let moved = unsafe {
                    libc::mremap(
                        ptr.as_ptr().cast(),
                        old_len,
                        new_len,
                        libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                        target.as_ptr().cast::<libc::c_void>(),
                    )
                };
                if moved != libc::MAP_FAILED {
                    let moved = NonNull::new(moved.cast::<u8>()).ok_or(AllocError)?;
                    return Ok(NonNull::slice_from_raw_parts(moved, new_len));
                }
                // SAFETY: the move failed, so `target` is still the unused mapping made above.
                unsafe { libc::munmap(target.as_ptr().cast(), new_len) };
            }
        }
        let new = self.allocate(new_layout)?;
        // SAFETY: the caller guarantees `new_layout.size() >= old_layout.size()` and that `ptr`
        // holds `old_layout.size()` readable bytes; `new` is a distinct block at least that
        // large. The old block is released once, after the copy.
        unsafe {
            std::ptr::copy_nonoverlapping(ptr.as_ptr(), new.as_ptr().cast::<u8>(), old_layout.size());
            self.deallocate(ptr, old_layout);
        }
        Ok(new)
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if !mapped(layout) {
            // SAFETY: the caller passes a block this allocator returned for `layout`, which
            // (not mapped) came from the global allocator.
            unsafe { Global.deallocate(ptr, layout) };
            return;
        }
        if let Some(len) = mapping_len(layout.size()) {
            // SAFETY: a mapped block is exactly `len` bytes at `ptr`, unmapped once.
            unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn large_blocks_are_aligned_mappings_and_small_ones_are_not() {
        let big = Layout::from_size_align(3 * HUGE + 5, 8).unwrap();
        let block = HugePages.allocate(big).unwrap();
        assert_eq!(block.len(), 4 * HUGE, "the mapping's length is the size rounded up");
        assert_eq!(block.as_ptr().cast::<u8>() as usize % HUGE, 0, "aligned to 2 MiB");
        // Every byte of it is writable.
        unsafe {
            let p = block.as_ptr().cast::<u8>();
            p.write_bytes(0xab, block.len());
            assert_eq!(*p.add(block.len() - 1), 0xab);
            HugePages.deallocate(NonNull::new(p).unwrap(), big);
        }
        let small = Layout::from_size_align(100, 8).unwrap();
        let block = HugePages.allocate(small).unwrap();
        unsafe { HugePages.deallocate(block.cast(), small) };
    }

    #[test]
    fn a_mapped_block_grows_in_place_of_a_copy_keeping_bytes_and_alignment() {
        let small = Layout::from_size_align(3 * HUGE, 8).unwrap();
        let large = Layout::from_size_align(9 * HUGE + 1, 8).unwrap();
        let block = HugePages.allocate(small).unwrap();
        unsafe {
            let p = block.as_ptr().cast::<u8>();
            for i in 0..block.len() {
                *p.add(i) = (i % 251) as u8;
            }
            let grown = HugePages.grow(NonNull::new(p).unwrap(), small, large).unwrap();
            assert_eq!(grown.len(), 10 * HUGE);
            let q = grown.as_ptr().cast::<u8>();
            assert_eq!(q as usize % HUGE, 0, "the grown block keeps 2 MiB alignment");
            assert!((0..3 * HUGE).all(|i| *q.add(i) == (i % 251) as u8), "every old byte kept");
            assert!((3 * HUGE..10 * HUGE).all(|i| *q.add(i) == 0), "new space is fresh zeroed memory");
            q.write_bytes(7, grown.len());
            // Growing within the same mapping length hands back the same block.
            let same = Layout::from_size_align(10 * HUGE, 8).unwrap();
            let again = HugePages.grow(NonNull::new(q).unwrap(), large, same).unwrap();
            assert_eq!(again.as_ptr().cast::<u8>(), q);
            assert_eq!(*q.add(10 * HUGE - 1), 7);
            HugePages.deallocate(NonNull::new(q).unwrap(), same);
        }
        // A small block growing into a mapped one is copied.
        let tiny = Layout::from_size_align(64, 8).unwrap();
        let block = HugePages.allocate(tiny).unwrap();
        unsafe {
            let p = block.as_ptr().cast::<u8>();
            p.write_bytes(9, 64);
            let grown = HugePages.grow(NonNull::new(p).unwrap(), tiny, large).unwrap();
            let q = grown.as_ptr().cast::<u8>();
            assert_eq!(q as usize % HUGE, 0);
            assert!((0..64).all(|i| *q.add(i) == 9));
            HugePages.deallocate(NonNull::new(q).unwrap(), large);
        }
    }

    #[test]
    fn a_vector_grows_across_the_threshold_and_keeps_its_elements() {
        let mut v: allocator_api2::vec::Vec<u64, HugePages> = allocator_api2::vec::Vec::new_in(HugePages);
        let n = (3 * HUGE / 8) as u64;
        for i in 0..n {
            v.push(i);
        }
        assert!(v.iter().enumerate().all(|(i, x)| *x == i as u64));
        v.truncate(10);
        v.shrink_to_fit();
        assert_eq!(v.iter().sum::<u64>(), 45);
        let table: hashbrown::HashTable<u32, HugePages> = hashbrown::HashTable::with_capacity_in(1 << 20, HugePages);
        assert!(table.capacity() >= 1 << 20);
    }
}
