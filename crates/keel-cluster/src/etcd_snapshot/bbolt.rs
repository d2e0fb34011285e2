//! bbolt's page format (the database etcd keeps its backend in and streams as a snapshot):
//! a reader over a file held in memory and a writer of a fresh file from sorted buckets.
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

const HEADER: usize = 16;
const ELEMENT: usize = 16;
const META_LEN: usize = 64;
const MAGIC: u32 = 0xED0C_DAED;
const VERSION: u32 = 2;
const BRANCH: u16 = 0x01;
const LEAF: u16 = 0x02;
const META: u16 = 0x04;
const FREELIST: u16 = 0x10;
const BUCKET_FLAG: u32 = 0x01;
const BUCKET_HEADER: usize = 16;
/// Deeper than any B+tree bbolt builds over 2^64 pages: a deeper walk is a corrupt file.
const DEPTH_MAX: usize = 64;
/// The page size of the files [`write`] makes (etcd's on x86-64 and arm64 Linux).
pub const PAGE_SIZE: usize = 4096;

/// A bucket's rows, as [`write`] takes them.
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

fn fnv1a64(bytes: &[u8]) -> u64 {
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

/// Builds a bbolt file (pages of [`PAGE_SIZE`]) holding `buckets`, each a top-level bucket
/// with its rows, which must be sorted by key without duplicates (bucket names too).
/// Pages are filled to the brim; bbolt reads and rebalances any fill.
pub fn write(buckets: &[(&[u8], Rows)]) -> Vec<u8> {
    // Pages 0 and 1 are the metas, page 2 an empty freelist (every page is in use); the trees
    // follow from page 3.
    let mut w = Writer { body: Vec::new(), next: 3 };
    let mut top = Vec::new();
    for (name, rows) in buckets {
        let items: Vec<Item<'_>> = rows.iter().map(|(k, v)| (0, k.as_slice(), v.as_slice())).collect();
        let root = w.tree(&items);
        let mut header = root.to_le_bytes().to_vec();
        header.extend_from_slice(&0u64.to_le_bytes());
        top.push((name.to_vec(), header));
    }
    let top_items: Vec<Item<'_>> = top.iter().map(|(k, v)| (BUCKET_FLAG.into(), k.as_slice(), v.as_slice())).collect();
    let root = w.tree(&top_items);
    let mut out = Vec::with_capacity(3 * PAGE_SIZE + w.body.len());
    for id in 0..2u64 {
        let mut page = header(id, META, 0, 0);
        let mut m = Vec::with_capacity(META_LEN);
        for v in [MAGIC, VERSION, PAGE_SIZE as u32, 0] {
            m.extend_from_slice(&v.to_le_bytes());
        }
        // Root bucket (page, sequence), freelist page, pages in use, transaction id.
        for v in [root, 0, 2, w.next, 1] {
            m.extend_from_slice(&v.to_le_bytes());
        }
        let sum = fnv1a64(&m);
        m.extend_from_slice(&sum.to_le_bytes());
        page.extend_from_slice(&m);
        page.resize(PAGE_SIZE, 0);
        out.extend_from_slice(&page);
    }
    let mut freelist = header(2, FREELIST, 0, 0);
    freelist.resize(PAGE_SIZE, 0);
    out.extend_from_slice(&freelist);
    out.extend_from_slice(&w.body);
    // The pages' ids run 0..next and the file holds exactly them (checked when read).
    assert_eq!(out.len() as u64, w.next * PAGE_SIZE as u64);
    out
}

/// A page element to write: for a leaf its flags, for a branch its child page id; key; value.
type Item<'a> = (u64, &'a [u8], &'a [u8]);

fn header(id: u64, flags: u16, count: u16, overflow: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(PAGE_SIZE);
    h.extend_from_slice(&id.to_le_bytes());
    h.extend_from_slice(&flags.to_le_bytes());
    h.extend_from_slice(&count.to_le_bytes());
    h.extend_from_slice(&overflow.to_le_bytes());
    h
}

struct Writer {
    /// Pages from 3 on.
    body: Vec<u8>,
    next: u64,
}

impl Writer {
    /// Writes the tree of `items` and returns its root page.
    fn tree(&mut self, items: &[Item<'_>]) -> u64 {
        // Leaves, then branch levels over them until one page remains. An empty tree is one
        // empty leaf.
        let mut level: Vec<(Vec<u8>, u64)> = Vec::new();
        let mut rest = items;
        loop {
            let (chunk, after) = rest.split_at(fill(rest, |(_, k, v)| k.len() + v.len()));
            let first = chunk.first().map(|(_, k, _)| k.to_vec()).unwrap_or_default();
            level.push((first, self.page(LEAF, chunk)));
            rest = after;
            if rest.is_empty() {
                break;
            }
        }
        while level.len() > 1 {
            let mut up = Vec::new();
            let mut rest = level.as_slice();
            while !rest.is_empty() {
                let (chunk, after) = rest.split_at(fill(rest, |(k, _)| k.len()));
                let elements: Vec<Item<'_>> = chunk.iter().map(|(k, child)| (*child, k.as_slice(), &[][..])).collect();
                let pgid = self.page(BRANCH, &elements);
                up.push((chunk.first().map(|(k, _)| k.clone()).unwrap_or_default(), pgid));
                rest = after;
            }
            level = up;
        }
        level.first().map_or(0, |(_, p)| *p)
    }

    /// Appends one page (with overflow pages if its elements need them).
    fn page(&mut self, flags: u16, elements: &[Item<'_>]) -> u64 {
        let id = self.next;
        let mut data_at = HEADER + elements.len() * ELEMENT;
        let len = data_at + elements.iter().map(|(_, k, v)| k.len() + v.len()).sum::<usize>();
        let pages = len.div_ceil(PAGE_SIZE).max(1);
        let mut page = header(id, flags, elements.len() as u16, (pages - 1) as u32);
        for (i, (first, key, value)) in elements.iter().enumerate() {
            // `pos` counts from the element's own start.
            let pos = (data_at - (HEADER + i * ELEMENT)) as u32;
            if flags == LEAF {
                for v in [*first as u32, pos, key.len() as u32, value.len() as u32] {
                    page.extend_from_slice(&v.to_le_bytes());
                }
            } else {
                page.extend_from_slice(&pos.to_le_bytes());
                page.extend_from_slice(&(key.len() as u32).to_le_bytes());
                page.extend_from_slice(&first.to_le_bytes());
            }
            data_at += key.len() + value.len();
        }
        for (_, key, value) in elements {
            page.extend_from_slice(key);
            page.extend_from_slice(value);
        }
        page.resize(pages * PAGE_SIZE, 0);
        self.body.extend_from_slice(&page);
        self.next += pages as u64;
        id
    }
}

/// How many of `items` (at least one, if any) go in the next page without overflowing it; an
/// item too big for a page alone gets a page with overflow of its own. bbolt's count is a u16.
fn fill<T>(items: &[T], size: impl Fn(&T) -> usize) -> usize {
    let mut used = HEADER;
    let mut n = 0;
    for item in items {
        let add = ELEMENT + size(item);
        if n > 0 && (used + add > PAGE_SIZE || n == u16::MAX as usize) {
            break;
        }
        used += add;
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, value_len: usize) -> Rows {
        (0..n).map(|i| (format!("key-{i:06}").into_bytes(), vec![i as u8; value_len])).collect()
    }

    #[test]
    fn written_files_read_back_with_three_levels_overflow_and_empty_buckets() {
        let buckets: Vec<(&[u8], Rows)> =
            vec![(b"big", rows(3, 10_000)), (b"empty", Vec::new()), (b"many", rows(40_000, 20)), (b"small", rows(2, 3))];
        let file = write(&buckets);
        assert!(looks_like_bbolt(&file));
        let db = Db::open(&file).unwrap();
        assert_eq!(db.bucket_names().unwrap(), vec![&b"big"[..], b"empty", b"many", b"small"]);
        for (name, want) in &buckets {
            let got = db.bucket(name).unwrap().unwrap();
            let got: Rows = got.into_iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect();
            assert_eq!(&got, want);
        }
        assert!(db.bucket(b"absent").unwrap().is_none());
    }

    #[test]
    fn a_bucket_inside_a_bucket_is_refused() {
        // write() makes only top-level buckets: take an empty file and append a tree whose
        // bucket `outer` holds a row flagged as a bucket (an inline one, empty), then point the
        // metas at it.
        let mut file = write(&[]);
        let mut w = Writer { body: Vec::new(), next: file.len() as u64 / PAGE_SIZE as u64 };
        let mut inner = [0u8; BUCKET_HEADER].to_vec();
        inner.extend_from_slice(&header(0, LEAF, 0, 0));
        let mut outer = w.tree(&[(BUCKET_FLAG.into(), b"inner", &inner)]).to_le_bytes().to_vec();
        outer.extend_from_slice(&[0u8; 8]);
        let root = w.tree(&[(BUCKET_FLAG.into(), b"outer", &outer)]);
        file.extend_from_slice(&w.body);
        for id in 0..2usize {
            let m = id * PAGE_SIZE + HEADER;
            file[m + 16..m + 24].copy_from_slice(&root.to_le_bytes());
            file[m + 40..m + 48].copy_from_slice(&w.next.to_le_bytes());
            let sum = fnv1a64(&file[m..m + 56]);
            file[m + 56..m + 64].copy_from_slice(&sum.to_le_bytes());
        }
        let db = Db::open(&file).unwrap();
        assert_eq!(db.bucket_names().unwrap(), vec![&b"outer"[..]]);
        assert!(matches!(db.bucket(b"outer"), Err(Error::NestedBucket)));
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
