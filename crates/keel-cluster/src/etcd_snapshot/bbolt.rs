//! bbolt's page format (the database etcd keeps its backend in and streams as a snapshot),
//! and a reader over a file held in memory (`bbolt_writer.rs` writes one).
//!
//! Layout (every number little-endian, pages of `page_size` bytes, page `n` at `n * page_size`):
//! - page header, 16 bytes: `id u64 | flags u16 | count u16 | overflow u32`; flags branch 0x01,
//!   leaf 0x02, meta 0x04, freelist 0x10. A page with `overflow = n` spans `n + 1` pages.
//! - meta (pages 0 and 1, after the header): `magic u32 (0xED0CDAED) | version u32 (2) |
//!   page_size u32 | flags u32 | root bucket (root pgid u64, sequence u64) | freelist pgid u64 |
//!   pgid u64 (pages in use) | txid u64 | checksum u64`, the checksum FNV-1a 64 of the 56 bytes
//!   before it. The valid meta with the higher txid is current.
//! - branch element, 16 bytes: `pos u32 | ksize u32 | pgid u64`; leaf element, 16 bytes:
//!   `flags u32 | pos u32 | ksize u32 | vsize u32`. `pos` counts from the element's own start.
//! - a leaf element with flag 0x01 is a bucket: its value is `root pgid u64 | sequence u64`,
//!   and with root 0 the rest of the value is the bucket's one leaf page, inline.
//!
//! What it must not do: trust any offset or count in the file. Every slice is bounds-checked,
//! each page is walked at most once per bucket (a cycle or a shared page is corruption), and
//! the depth is bounded, so no file can make it panic, loop or recurse without end.

use std::collections::HashSet;

use super::Error;

pub(super) const HEADER: usize = 16;
pub(super) const ELEMENT: usize = 16;
const META_LEN: usize = 64;
pub(super) const MAGIC: u32 = 0xED0C_DAED;
pub(super) const VERSION: u32 = 2;
pub(super) const BRANCH: u16 = 0x01;
pub(super) const LEAF: u16 = 0x02;
pub(super) const META: u16 = 0x04;
pub(super) const FREELIST: u16 = 0x10;
pub(super) const BUCKET_FLAG: u32 = 0x01;
const BUCKET_HEADER: usize = 16;
/// Deeper than any B+tree bbolt builds over 2^64 pages: a deeper walk is a corrupt file.
const DEPTH_MAX: usize = 64;
/// The page size of the files `bbolt_writer` makes (etcd's on x86-64 and arm64 Linux).
pub const PAGE_SIZE: usize = 4096;

/// A bucket's rows, as `bbolt_writer::write` takes them.
pub type Rows = Vec<(Vec<u8>, Vec<u8>)>;
/// Rows borrowed from the file, as [`Db::bucket`] gives them.
pub type Entries<'a> = Vec<(&'a [u8], &'a [u8])>;
/// What a walk calls for each leaf element: key, value, whether it is a bucket.
type Visit<'v, 'a> = dyn FnMut(&'a [u8], &'a [u8], bool) -> Result<(), Error> + 'v;

/// Where a bucket's tree starts.
#[derive(Clone, Copy, Debug)]
enum Root<'a> {
    Page(u64),
    /// An inline bucket's single leaf page (header and elements, inside the parent's value).
    Inline(&'a [u8]),
}

/// An open bbolt file: the current meta and the bytes.
pub struct Db<'a> {
    file: &'a [u8],
    page_size: usize,
    root: u64,
    /// Pages in use by the current meta (`pgid`).
    pub pages: u64,
    pub txid: u64,
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at.checked_add(2)?)?.try_into().ok()?))
}
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at.checked_add(4)?)?.try_into().ok()?))
}
fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at.checked_add(8)?)?.try_into().ok()?))
}

pub(super) fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

struct Meta {
    page_size: u32,
    root: u64,
    pgid: u64,
    txid: u64,
}

/// The meta stored in the page starting at `page`, if it is whole and its checksum holds.
fn meta_at(file: &[u8], page: usize) -> Option<Meta> {
    let flags = u16_at(file, page.checked_add(8)?)?;
    let m = file.get(page.checked_add(HEADER)?..page.checked_add(HEADER + META_LEN)?)?;
    let sum = u64_at(m, 56)?;
    if flags != META || u32_at(m, 0)? != MAGIC || u32_at(m, 4)? != VERSION || fnv1a64(m.get(..56)?) != sum {
        return None;
    }
    Some(Meta { page_size: u32_at(m, 8)?, root: u64_at(m, 16)?, pgid: u64_at(m, 40)?, txid: u64_at(m, 48)? })
}

/// Whether `file` starts like a bbolt file (the magic of meta page 0), damaged or not.
pub fn looks_like_bbolt(file: &[u8]) -> bool {
    u32_at(file, HEADER) == Some(MAGIC)
}

impl<'a> Db<'a> {
    /// Opens `file` (a whole bbolt database): picks the current meta and checks that the file
    /// holds every page it names.
    pub fn open(file: &'a [u8]) -> Result<Db<'a>, Error> {
        let first = meta_at(file, 0);
        // Page 1 sits one page in: at meta 0's page size if that meta is sound, otherwise at
        // any of the sizes bbolt is built with (meta 0 may be the damaged one).
        let sizes = match &first {
            Some(m) => vec![m.page_size as usize],
            None => vec![4096, 8192, 16384, 32768, 65536],
        };
        let second = sizes.into_iter().find_map(|s| meta_at(file, s).filter(|m| m.page_size as usize == s));
        let meta = match (first, second) {
            (Some(a), Some(b)) => {
                if b.txid > a.txid {
                    b
                } else {
                    a
                }
            }
            (Some(m), None) | (None, Some(m)) => m,
            (None, None) => return Err(Error::NotBbolt("neither meta page is valid (magic, version or checksum)")),
        };
        let page_size = meta.page_size as usize;
        if !(512..=1 << 20).contains(&page_size) || !page_size.is_power_of_two() {
            return Err(Error::NotBbolt("the meta page's page size is not a power of two in 512..=1 MiB"));
        }
        let need = meta.pgid.checked_mul(page_size as u64).ok_or(Error::NotBbolt("page count out of range"))?;
        if need > file.len() as u64 {
            return Err(Error::Truncated { need, have: file.len() as u64 });
        }
        if meta.root < 2 || meta.root >= meta.pgid {
            return Err(Error::Page { pgid: meta.root, why: "the root bucket's page is outside the file's pages" });
        }
        Ok(Db { file, page_size, root: meta.root, pages: meta.pgid, txid: meta.txid })
    }

    /// The bytes of page `pgid` with its overflow pages.
    fn page(&self, pgid: u64) -> Result<&'a [u8], Error> {
        let bad = |why| Error::Page { pgid, why };
        if pgid < 2 || pgid >= self.pages {
            return Err(bad("a page reference points outside the file's pages"));
        }
        let start = pgid as usize * self.page_size;
        let overflow = u32_at(self.file, start + 12).ok_or(bad("page header past the end"))?;
        if u64::from(overflow) >= self.pages - pgid {
            return Err(bad("overflow runs past the file's pages"));
        }
        let len = (overflow as usize + 1) * self.page_size;
        let page = self.file.get(start..start + len).ok_or(bad("page past the end of the file"))?;
        if u64_at(page, 0) != Some(pgid) {
            return Err(bad("the page header names another page id"));
        }
        Ok(page)
    }

    /// Every entry of the top-level bucket `name`, in key order: `(key, value)` for values;
    /// nested buckets are refused (etcd's schema has none). `None` if there is no such bucket.
    pub fn bucket(&self, name: &[u8]) -> Result<Option<Entries<'a>>, Error> {
        let mut found = None;
        self.walk(Root::Page(self.root), &mut |key, value, is_bucket| {
            if is_bucket && key == name {
                found = Some(value);
            }
            Ok(())
        })?;
        let Some(value) = found else { return Ok(None) };
        let root = bucket_root(value)?;
        let mut rows = Vec::new();
        self.walk(root, &mut |key, value, is_bucket| {
            if is_bucket {
                return Err(Error::NestedBucket);
            }
            rows.push((key, value));
            Ok(())
        })?;
        Ok(Some(rows))
    }

    /// How many pages deep the tree of top-level bucket `name` is (1: a single leaf), along
    /// its first children.
    #[cfg(test)]
    pub(super) fn depth(&self, name: &[u8]) -> Result<usize, Error> {
        let mut found = None;
        self.walk(Root::Page(self.root), &mut |key, value, _| {
            if key == name {
                found = Some(value);
            }
            Ok(())
        })?;
        let Some(Root::Page(mut pgid)) = found.map(bucket_root).transpose()? else { return Ok(1) };
        let mut depth = 1;
        while u16_at(self.page(pgid)?, 8) == Some(BRANCH) {
            pgid = u64_at(self.page(pgid)?, HEADER + 8).ok_or(Error::NestedBucket)?;
            depth += 1;
        }
        Ok(depth)
    }

    /// The names of the top-level buckets.
    pub fn bucket_names(&self) -> Result<Vec<&'a [u8]>, Error> {
        let mut names = Vec::new();
        self.walk(Root::Page(self.root), &mut |key, _, is_bucket| {
            if is_bucket {
                names.push(key);
            }
            Ok(())
        })?;
        Ok(names)
    }

    fn walk(&self, root: Root<'a>, visit: &mut Visit<'_, 'a>) -> Result<(), Error> {
        let mut seen = HashSet::new();
        match root {
            Root::Inline(page) => leaf(0, page, visit),
            Root::Page(pgid) => self.walk_page(pgid, 0, &mut seen, visit),
        }
    }

    fn walk_page(
        &self,
        pgid: u64,
        depth: usize,
        seen: &mut HashSet<u64>,
        visit: &mut Visit<'_, 'a>,
    ) -> Result<(), Error> {
        if depth > DEPTH_MAX || !seen.insert(pgid) {
            return Err(Error::Page { pgid, why: "the bucket's tree loops or reaches a page twice" });
        }
        let page = self.page(pgid)?;
        match u16_at(page, 8) {
            Some(LEAF) => leaf(pgid, page, visit),
            Some(BRANCH) => {
                let count = u16_at(page, 10).unwrap_or(0) as usize;
                for i in 0..count {
                    let child = u64_at(page, HEADER + i * ELEMENT + 8)
                        .ok_or(Error::Page { pgid, why: "branch element past the page's end" })?;
                    self.walk_page(child, depth + 1, seen, visit)?;
                }
                Ok(())
            }
            _ => Err(Error::Page { pgid, why: "a bucket's tree reaches a page that is neither branch nor leaf" }),
        }
    }
}

/// Visits the elements of one leaf page.
fn leaf<'a>(pgid: u64, page: &'a [u8], visit: &mut Visit<'_, 'a>) -> Result<(), Error> {
    let bad = |why| Error::Page { pgid, why };
    if u16_at(page, 8) != Some(LEAF) {
        return Err(bad("an inline bucket's page is not a leaf"));
    }
    let count = u16_at(page, 10).unwrap_or(0) as usize;
    let mut previous: Option<&[u8]> = None;
    for i in 0..count {
        let at = HEADER + i * ELEMENT;
        let field = |o: usize| u32_at(page, at + o).map(|v| v as usize).ok_or(bad("leaf element past the page's end"));
        let (flags, pos, ksize, vsize) = (field(0)?, field(4)?, field(8)?, field(12)?);
        let key_at = at.checked_add(pos).ok_or(bad("leaf element offset out of range"))?;
        let key =
            key_at.checked_add(ksize).and_then(|end| page.get(key_at..end)).ok_or(bad("key past the page's end"))?;
        let value_at = key_at + ksize;
        let value = value_at
            .checked_add(vsize)
            .and_then(|end| page.get(value_at..end))
            .ok_or(bad("value past the page's end"))?;
        if previous.is_some_and(|p| p >= key) {
            return Err(bad("leaf keys out of order"));
        }
        previous = Some(key);
        visit(key, value, flags as u32 & BUCKET_FLAG != 0)?;
    }
    Ok(())
}

fn bucket_root(value: &[u8]) -> Result<Root<'_>, Error> {
    let root = u64_at(value, 0).ok_or(Error::Page { pgid: 0, why: "a bucket's header is short" })?;
    if root != 0 {
        return Ok(Root::Page(root));
    }
    value
        .get(BUCKET_HEADER..)
        .filter(|p| p.len() >= HEADER)
        .map(Root::Inline)
        .ok_or(Error::Page { pgid: 0, why: "an inline bucket has no page" })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, value_len: usize) -> Rows {
        (0..n).map(|i| (format!("key-{i:06}").into_bytes(), vec![i as u8; value_len])).collect()
    }

    fn write(buckets: &[(&[u8], Rows)]) -> Vec<u8> {
        super::super::bbolt_writer::write(buckets).unwrap()
    }

    #[test]
    fn a_page_that_points_at_itself_is_refused_not_followed() {
        let mut file = write(&[(b"b", rows(2000, 20))]);
        let db = Db::open(&file).unwrap();
        // The bucket's root is a branch (2000 rows need many leaves): point its first child
        // back at itself.
        let root_value = db.bucket_names().map(|_| ()).and_then(|()| {
            let mut v = None;
            db.walk(Root::Page(db.root), &mut |_, value, _| {
                v = Some(u64_at(value, 0).unwrap());
                Ok(())
            })?;
            Ok(v.unwrap())
        });
        let branch = root_value.unwrap() as usize;
        assert_eq!(u16_at(&file, branch * PAGE_SIZE + 8), Some(BRANCH));
        let child = branch * PAGE_SIZE + HEADER + 8;
        file[child..child + 8].copy_from_slice(&(branch as u64).to_le_bytes());
        let db = Db::open(&file).unwrap();
        assert!(matches!(db.bucket(b"b"), Err(Error::Page { .. })));
    }
}
