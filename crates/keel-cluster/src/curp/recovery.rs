//! TEMPORARY stand-in (not committed).
use super::witness::Pooled;
pub fn recover(pools: &[(u64, Vec<Pooled>)], n: usize) -> Vec<Pooled> {
    let f = (n - 1) / 2;
    let need = f.div_ceil(2) + 1;
    let mut out: Vec<Pooled> = Vec::new();
    for (_, pool) in pools {
        for c in pool {
            if out.iter().any(|o| o.id == c.id) {
                continue;
            }
            if pools.iter().filter(|(_, p)| p.iter().any(|x| x.id == c.id)).count() >= need {
                out.push(c.clone());
            }
        }
    }
    out
}
