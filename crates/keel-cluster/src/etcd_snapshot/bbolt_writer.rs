//! Writes a fresh bbolt file (the layout is described in `bbolt.rs`) page by page: rows go
//! out as soon as a page is full, so a bucket of any size costs memory for one page and, per
//! leaf, its first key (the branch levels are built from those at the end).
//!
//! Page 0 and 1 are the metas, page 2 an empty freelist (every page of the file is in use), the
//! buckets' pages follow; the three first pages are written last, once the root is known, which
//! is why the output must be seekable. Pages are filled to the brim: bbolt reads any fill and
//! rebalances on its next write. One transaction id (1) in both metas.
//!
//! What it must not do: take rows out of order (the caller sorts; bbolt's search would miss
//! them), or hold a bucket's rows in memory.

use std::io::{self, Seek, SeekFrom, Write};

use super::bbolt::{
    fnv1a64, Rows, BRANCH, BUCKET_FLAG, ELEMENT, FREELIST, HEADER, LEAF, MAGIC, META, PAGE_SIZE, VERSION,
};

/// A page element to write: for a leaf its flags, for a branch its child page id; key; value.
type Item<'a> = (u64, &'a [u8], &'a [u8]);

/// A bbolt file being written to `out`.
pub struct FileWriter<W: Write + Seek> {
    out: W,
    /// The id the next page written gets.
    next: u64,
    /// The top-level buckets so far: name, bucket header (root page, sequence).
    top: Vec<(Vec<u8>, Vec<u8>)>,
}

impl<W: Write + Seek> FileWriter<W> {
    /// Starts a file at the current position of `out` (the first three pages are reserved).
    pub fn new(mut out: W) -> io::Result<FileWriter<W>> {
        out.write_all(&[0u8; 3 * PAGE_SIZE])?;
        Ok(FileWriter { out, next: 3, top: Vec::new() })
    }

    /// Adds the top-level bucket `name` (names in increasing order) holding `rows` (keys in
    /// increasing order). A row's error ends the file.
    pub fn bucket<E: From<io::Error>>(
        &mut self,
        name: &[u8],
        rows: impl IntoIterator<Item = Result<(Vec<u8>, Vec<u8>), E>>,
    ) -> Result<(), E> {
        let mut tree = Tree::default();
        for row in rows {
            let (key, value) = row?;
            tree.push(self, 0, key, value)?;
        }
        let root = tree.finish(self)?;
        self.add_top(name, root);
        Ok(())
    }

    fn add_top(&mut self, name: &[u8], root: u64) {
        let mut header = root.to_le_bytes().to_vec();
        header.extend_from_slice(&0u64.to_le_bytes());
        self.top.push((name.to_vec(), header));
    }

    /// Writes the root bucket, then the metas and the freelist; returns `out`, positioned at
    /// the end of the file, and the file's length.
    pub fn finish(mut self) -> io::Result<(W, u64)> {
        let top = std::mem::take(&mut self.top);
        let mut tree = Tree::default();
        for (name, header) in top {
            tree.push(&mut self, BUCKET_FLAG.into(), name, header)?;
        }
        let root = tree.finish(&mut self)?;
        let len = self.next * PAGE_SIZE as u64;
        let end = self.out.stream_position()?;
        self.out.seek(SeekFrom::Current(-(len as i64)))?;
        for id in 0..2u64 {
            let mut page = header(id, META, 0, 0);
            for v in [MAGIC, VERSION, PAGE_SIZE as u32, 0] {
                page.extend_from_slice(&v.to_le_bytes());
            }
            // Root bucket (page, sequence), freelist page, pages in use, transaction id.
            for v in [root, 0, 2, self.next, 1] {
                page.extend_from_slice(&v.to_le_bytes());
            }
            let sum = fnv1a64(page.get(HEADER..).unwrap_or_default());
            page.extend_from_slice(&sum.to_le_bytes());
            page.resize(PAGE_SIZE, 0);
            self.out.write_all(&page)?;
        }
        let mut freelist = header(2, FREELIST, 0, 0);
        freelist.resize(PAGE_SIZE, 0);
        self.out.write_all(&freelist)?;
        self.out.seek(SeekFrom::Start(end))?;
        Ok((self.out, len))
    }

    /// Appends one page (with overflow pages if its elements need them); returns its id.
    fn page(&mut self, flags: u16, elements: &[Item<'_>]) -> io::Result<u64> {
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
        self.out.write_all(&page)?;
        self.next += pages as u64;
        Ok(id)
    }
}

fn header(id: u64, flags: u16, count: u16, overflow: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(PAGE_SIZE);
    h.extend_from_slice(&id.to_le_bytes());
    h.extend_from_slice(&flags.to_le_bytes());
    h.extend_from_slice(&count.to_le_bytes());
    h.extend_from_slice(&overflow.to_le_bytes());
    h
}

/// One bucket's B+tree while it is written: the leaf being filled and the leaves written.
struct Tree {
    pending: Vec<(u64, Vec<u8>, Vec<u8>)>,
    used: usize,
    /// Each written leaf: its first key and page id.
    leaves: Vec<(Vec<u8>, u64)>,
}

impl Default for Tree {
    fn default() -> Tree {
        Tree { pending: Vec::new(), used: HEADER, leaves: Vec::new() }
    }
}

impl Tree {
    fn push<W: Write + Seek>(
        &mut self,
        w: &mut FileWriter<W>,
        flags: u64,
        key: Vec<u8>,
        value: Vec<u8>,
    ) -> io::Result<()> {
        let add = ELEMENT + key.len() + value.len();
        // An element too big for a page alone gets a page with overflow of its own; bbolt's
        // element count is a u16.
        if !self.pending.is_empty() && (self.used + add > PAGE_SIZE || self.pending.len() == u16::MAX as usize) {
            self.flush(w)?;
        }
        self.used += add;
        self.pending.push((flags, key, value));
        Ok(())
    }

    fn flush<W: Write + Seek>(&mut self, w: &mut FileWriter<W>) -> io::Result<()> {
        let items: Vec<Item<'_>> = self.pending.iter().map(|(f, k, v)| (*f, k.as_slice(), v.as_slice())).collect();
        let id = w.page(LEAF, &items)?;
        self.leaves.push((self.pending.first().map(|(_, k, _)| k.clone()).unwrap_or_default(), id));
        self.pending.clear();
        self.used = HEADER;
        Ok(())
    }

    /// Writes the last leaf (an empty tree is one empty leaf) and the branch levels; returns
    /// the root page.
    fn finish<W: Write + Seek>(mut self, w: &mut FileWriter<W>) -> io::Result<u64> {
        if !self.pending.is_empty() || self.leaves.is_empty() {
            self.flush(w)?;
        }
        let mut level = self.leaves;
        while level.len() > 1 {
            let mut up = Vec::new();
            let mut rest = level.as_slice();
            while !rest.is_empty() {
                let (chunk, after) = rest.split_at(branch_fill(rest));
                let elements: Vec<Item<'_>> = chunk.iter().map(|(k, child)| (*child, k.as_slice(), &[][..])).collect();
                let id = w.page(BRANCH, &elements)?;
                up.push((chunk.first().map(|(k, _)| k.clone()).unwrap_or_default(), id));
                rest = after;
            }
            level = up;
        }
        Ok(level.first().map_or(0, |(_, p)| *p))
    }
}

/// How many of `children` (at least one) the next branch page takes.
fn branch_fill(children: &[(Vec<u8>, u64)]) -> usize {
    let mut used = HEADER;
    let mut n = 0;
    for (key, _) in children {
        let add = ELEMENT + key.len();
        if n > 0 && (used + add > PAGE_SIZE || n == u16::MAX as usize) {
            break;
        }
        used += add;
        n += 1;
    }
    n
}

/// A whole bbolt file in memory holding `buckets` (names and keys sorted).
pub fn write(buckets: &[(&[u8], Rows)]) -> io::Result<Vec<u8>> {
    let mut w = FileWriter::new(io::Cursor::new(Vec::new()))?;
    for (name, rows) in buckets {
        w.bucket(name, rows.iter().map(|(k, v)| Ok::<_, io::Error>((k.clone(), v.clone()))))?;
    }
    Ok(w.finish()?.0.into_inner())
}

#[cfg(test)]
mod tests {
    use super::super::bbolt::Db;
    use super::super::Error;
    use super::*;

    fn rows(n: usize, value_len: usize) -> Rows {
        (0..n).map(|i| (format!("key-{i:06}").into_bytes(), vec![i as u8; value_len])).collect()
    }

    #[test]
    fn written_files_read_back_with_three_levels_overflow_and_empty_buckets() {
        let buckets: Vec<(&[u8], Rows)> = vec![
            (b"big", rows(3, 10_000)),
            (b"empty", Vec::new()),
            (b"many", rows(40_000, 20)),
            (b"small", rows(2, 3)),
        ];
        let file = write(&buckets).unwrap();
        assert!(super::super::bbolt::looks_like_bbolt(&file));
        let db = Db::open(&file).unwrap();
        assert_eq!(db.depth(b"many").unwrap(), 3, "branches over branches over leaves");
        assert_eq!(db.bucket_names().unwrap(), vec![&b"big"[..], b"empty", b"many", b"small"]);
        for (name, want) in &buckets {
            let got = db.bucket(name).unwrap().unwrap();
            let got: Rows = got.into_iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect();
            assert_eq!(&got, want);
        }
        assert!(db.bucket(b"absent").unwrap().is_none());
    }

    #[test]
    fn a_file_written_after_other_bytes_starts_where_it_was_begun() {
        let mut out = io::Cursor::new(b"prefix".to_vec());
        out.seek(SeekFrom::End(0)).unwrap();
        let mut w = FileWriter::new(out).unwrap();
        w.bucket(b"b", rows(500, 30).into_iter().map(Ok::<_, io::Error>)).unwrap();
        let (out, len) = w.finish().unwrap();
        let bytes = out.into_inner();
        assert_eq!(bytes.len() as u64, 6 + len);
        assert_eq!(bytes[6..], write(&[(b"b", rows(500, 30))]).unwrap()[..]);
    }

    #[test]
    fn a_bucket_inside_a_bucket_is_refused_by_the_reader() {
        // FileWriter::bucket writes plain rows only: build `outer` by hand with one row flagged
        // as a bucket (an empty inline one).
        let mut w = FileWriter::new(io::Cursor::new(Vec::new())).unwrap();
        let mut inner = [0u8; 16].to_vec();
        inner.extend_from_slice(&header(0, LEAF, 0, 0));
        let mut tree = Tree::default();
        tree.push(&mut w, BUCKET_FLAG.into(), b"inner".to_vec(), inner).unwrap();
        let root = tree.finish(&mut w).unwrap();
        w.add_top(b"outer", root);
        let file = w.finish().unwrap().0.into_inner();
        let db = Db::open(&file).unwrap();
        assert_eq!(db.bucket_names().unwrap(), vec![&b"outer"[..]]);
        assert!(matches!(db.bucket(b"outer"), Err(Error::NestedBucket)));
    }
}
