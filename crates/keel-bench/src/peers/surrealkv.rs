//! SurrealKV: an LSM-tree with a WAL and an asynchronous commit pipeline. Commits are futures;
//! the adapter owns a small tokio runtime and blocks on each commit from the calling thread, so
//! concurrent writers still reach the pipeline together. `sync` = `Durability::Immediate`;
//! `periodic` = `Durability::Eventual` plus `Tree::flush_wal(true)` every 100 ms (bench
//! thread); `relaxed` = `Durability::Eventual` (the default).

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use surrealkv::{CompactRangeOptions, Durability, Mode as TxnMode, Transaction, Tree, TreeBuilder};
use tokio::runtime::Runtime;

use super::{Mode, Reader, Store, System, Ticker};

/// SurrealKV.
pub struct SurrealKv;

impl System for SurrealKv {
    fn name(&self) -> &'static str {
        "surrealkv"
    }

    fn describe(&self, mode: Mode) -> String {
        match mode {
            Mode::Sync => "Durability::Immediate".to_string(),
            Mode::Periodic => "Durability::Eventual + Tree::flush_wal(true) every 100 ms (bench thread)".to_string(),
            Mode::Relaxed => "Durability::Eventual (default)".to_string(),
        }
    }

    fn describe_checkpoint(&self) -> &'static str {
        "flush_wal(true), then compact_range with flush_memtable"
    }

    fn open(&self, dir: &Path, mode: Mode) -> anyhow::Result<Box<dyn Store>> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("bench-surrealkv")
            .enable_all()
            .build()
            .context("starting a tokio runtime for surrealkv")?;
        let tree = runtime
            .block_on(TreeBuilder::new().with_path(dir.to_path_buf()).build_async())
            .with_context(|| format!("opening surrealkv {}", dir.display()))?;
        let tree = Arc::new(tree);
        let ticker = match mode {
            Mode::Periodic => {
                let tree = Arc::clone(&tree);
                Some(Ticker::start("surrealkv", move || {
                    let _ = tree.flush_wal(true);
                })?)
            }
            _ => None,
        };
        let durability = match mode {
            Mode::Sync => Durability::Immediate,
            Mode::Periodic | Mode::Relaxed => Durability::Eventual,
        };
        Ok(Box::new(SurrealStore { runtime, tree, durability, ticker }))
    }
}

struct SurrealStore {
    runtime: Runtime,
    tree: Arc<Tree>,
    durability: Durability,
    ticker: Option<Ticker>,
}

impl Store for SurrealStore {
    fn write(&self, update: Option<&[u8]>, puts: &[(&[u8], &[u8])]) -> anyhow::Result<()> {
        let mut tx = self.tree.begin()?;
        tx.set_durability(self.durability);
        if let Some(key) = update {
            let mut value = tx.get(key)?.context("update of a missing key")?.to_vec();
            value.push(b' ');
            tx.set(key, value)?;
        }
        for (key, value) in puts {
            tx.set(*key, *value)?;
        }
        self.runtime.block_on(tx.commit())?;
        Ok(())
    }

    fn reader(&self) -> anyhow::Result<Box<dyn Reader + '_>> {
        Ok(Box::new(SurrealReader(self.tree.begin_with_mode(TxnMode::ReadOnly)?)))
    }

    fn checkpoint(&self) -> anyhow::Result<()> {
        self.tree.flush_wal(true)?;
        let _guard = self.runtime.enter();
        self.tree.compact_range(None, None, &CompactRangeOptions::default())?;
        Ok(())
    }

    fn close(mut self: Box<Self>) -> anyhow::Result<()> {
        if let Some(mut ticker) = self.ticker.take() {
            ticker.stop();
        }
        self.runtime.block_on(self.tree.close())?;
        Ok(())
    }
}

struct SurrealReader(Transaction);

impl Reader for SurrealReader {
    fn get_into(&mut self, key: &[u8], out: &mut Vec<u8>) -> anyhow::Result<bool> {
        let value = self.0.get(key)?;
        Ok(super::copy_into(value.as_deref(), out))
    }
}
