//! TEMPORARY stand-in (not committed): replaced by the witness helper's module.
use super::CommandId;
use crate::types::RequestKind;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Footprint {
    All,
    Keys(Vec<Vec<u8>>),
}
pub fn footprint(kind: RequestKind, body: &[u8]) -> Result<Footprint, String> {
    use prost::Message;
    match kind {
        RequestKind::Put => {
            Ok(Footprint::Keys(vec![etcd_client::proto::PbPutRequest::decode(body).map_err(|e| e.to_string())?.key]))
        }
        _ => Ok(Footprint::All),
    }
}
pub fn conflicts(a: &Footprint, b: &Footprint) -> bool {
    match (a, b) {
        (Footprint::Keys(x), Footprint::Keys(y)) => x.iter().any(|k| y.contains(k)),
        _ => true,
    }
}
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Pooled {
    pub id: CommandId,
    pub term: u64,
    pub kind: RequestKind,
    pub body: Vec<u8>,
    pub footprint: Footprint,
    pub arrival: u64,
}
pub enum Refusal {
    Conflict,
    Fenced { fence: u64 },
    Full,
}
#[derive(Default)]
struct Pool {
    fence: u64,
    next: u64,
    entries: Vec<Pooled>,
}
#[derive(Default)]
pub struct Witness {
    pool: Mutex<Pool>,
}
impl Witness {
    pub fn new() -> Witness {
        Witness::default()
    }
    pub fn record(&self, id: CommandId, term: u64, kind: RequestKind, body: Vec<u8>) -> Result<(), Refusal> {
        let fp = footprint(kind, &body).unwrap_or(Footprint::All);
        let mut p = self.pool.lock();
        if term < p.fence {
            return Err(Refusal::Fenced { fence: p.fence });
        }
        if p.entries.iter().any(|e| e.id == id) {
            return Ok(());
        }
        if p.entries.iter().any(|e| conflicts(&e.footprint, &fp)) {
            return Err(Refusal::Conflict);
        }
        p.next += 1;
        let arrival = p.next;
        p.entries.push(Pooled { id, term, kind, body, footprint: fp, arrival });
        Ok(())
    }
    pub fn fence(&self, term: u64) -> Vec<Pooled> {
        let mut p = self.pool.lock();
        p.fence = p.fence.max(term);
        p.entries.clone()
    }
    pub fn fence_term(&self) -> u64 {
        self.pool.lock().fence
    }
    pub fn applied(&self, ids: &[CommandId]) {
        self.pool.lock().entries.retain(|e| !ids.contains(&e.id));
    }
    pub fn drop_below(&self, term: u64) {
        self.pool.lock().entries.retain(|e| e.term >= term);
    }
    pub fn discard(&self, id: CommandId) {
        self.pool.lock().entries.retain(|e| e.id != id);
    }
}
