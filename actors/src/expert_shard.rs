//! Expert shards: `--ep N` actors, each on its own arbiter thread, each owning a
//! disjoint set of routed experts (a placement map).
//!
//! Per MoE layer, [`ShardedExperts`] (the model's [`ExpertDispatch`]) splits
//! the routed `(row, expert)` pairs by owner, sends each shard a
//! [`RunExperts`] with just the rows it needs, waits for all replies, and
//! combines the outputs in the router's order, so the result is bit-for-bit
//! the same for any N. Shards count how often each expert is chosen;
//! [`ShardedExperts::rebalance`] recomputes the placement from those counts.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use actix::{Actor, Addr, Arbiter, Context, Handler, MessageResult};

use crate::engine::{combine, run_groups, ExpertDispatch, ExpertFfn, ExpertGroups};
use crate::messages::{GetExpertCounts, RunExperts};

/// One shard: the experts it may run, and selection counts.
pub struct ExpertShard {
    /// Every routed expert of the model, by `[layer][expert]` (shared, read-only).
    experts: Arc<Vec<Vec<Arc<dyn ExpertFfn>>>>,
    /// Times each `(layer, expert)` ran here.
    counts: HashMap<(usize, usize), u64>,
}

impl ExpertShard {
    /// Runs the requested `(row, expert)` pairs as one grouped operation
    /// (the kernel local compute uses, [`run_groups`]); returns
    /// `[items, hidden]` outputs, one row per item in item order.
    pub fn run(&mut self, m: &RunExperts) -> Vec<f32> {
        let h = m.hidden;
        let groups = ExpertGroups::new(m.items.iter().copied());
        for (g, &e) in groups.experts.iter().enumerate() {
            let n = groups.offsets[g + 1] - groups.offsets[g];
            *self.counts.entry((m.layer, e)).or_default() += n as u64;
        }
        let xs = groups.gather(&m.rows, h);
        let mut ys = vec![0.0; xs.len()];
        let layer = &self.experts[m.layer];
        run_groups(&groups, |e| layer[e].as_ref(), &xs, h, &mut ys);
        let mut out = vec![0.0; ys.len()];
        for (o, &s) in out.chunks_exact_mut(h.max(1)).zip(&groups.pair_slot) {
            o.copy_from_slice(&ys[s * h..(s + 1) * h]);
        }
        out
    }
}

impl Actor for ExpertShard {
    type Context = Context<Self>;
}

impl Handler<RunExperts> for ExpertShard {
    type Result = ();
    fn handle(&mut self, m: RunExperts, _: &mut Context<Self>) {
        let out = self.run(&m);
        let _ = m.reply.send(out);
    }
}

impl Handler<GetExpertCounts> for ExpertShard {
    type Result = MessageResult<GetExpertCounts>;
    fn handle(&mut self, _: GetExpertCounts, _: &mut Context<Self>) -> Self::Result {
        MessageResult(self.counts.iter().map(|(&(l, e), &c)| (l, e, c)).collect())
    }
}

/// The dispatcher the model calls: owns the placement and the shard addresses.
pub struct ShardedExperts {
    /// Shard actors.
    shards: Vec<Addr<ExpertShard>>,
    /// The shards' threads (one arbiter each), stopped on drop.
    arbiters: Vec<Arbiter>,
    /// `placement[layer][expert]` = shard index.
    placement: RwLock<Vec<Vec<usize>>>,
}

/// Round-robin placement: expert `e` of every layer goes to shard `e % n`.
pub fn round_robin(experts_per_layer: &[usize], n: usize) -> Vec<Vec<usize>> {
    experts_per_layer
        .iter()
        .map(|&e| (0..e).map(|i| i % n).collect())
        .collect()
}

/// Greedy balanced placement: per layer, experts sorted by load (descending)
/// each go to the currently least-loaded shard.
pub fn balanced(loads: &[Vec<u64>], n: usize) -> Vec<Vec<usize>> {
    loads
        .iter()
        .map(|layer| {
            let mut order: Vec<usize> = (0..layer.len()).collect();
            order.sort_by_key(|&e| (std::cmp::Reverse(layer[e]), e));
            let mut shard_load = vec![0u64; n];
            let mut shard_count = vec![0usize; n];
            let mut place = vec![0; layer.len()];
            for e in order {
                let s = (0..n)
                    .min_by_key(|&s| (shard_load[s], shard_count[s], s))
                    .expect("n >= 1");
                place[e] = s;
                shard_load[s] += layer[e];
                shard_count[s] += 1;
            }
            place
        })
        .collect()
}

impl ShardedExperts {
    /// Starts `n` shard threads over `experts` (`[layer][expert]`), placed round-robin.
    /// Must be called inside a running actix `System`.
    pub fn start(experts: Vec<Vec<Arc<dyn ExpertFfn>>>, n: usize) -> ShardedExperts {
        let n = n.max(1);
        let per_layer: Vec<usize> = experts.iter().map(|l| l.len()).collect();
        let experts = Arc::new(experts);
        let arbiters: Vec<Arbiter> = (0..n).map(|_| Arbiter::new()).collect();
        let shards = arbiters
            .iter()
            .map(|arb| {
                let experts = experts.clone();
                ExpertShard::start_in_arbiter(&arb.handle(), move |_| ExpertShard {
                    experts,
                    counts: HashMap::new(),
                })
            })
            .collect();
        ShardedExperts {
            shards,
            arbiters,
            placement: RwLock::new(round_robin(&per_layer, n)),
        }
    }

    /// Number of shards.
    pub fn num_shards(&self) -> usize {
        self.shards.len()
    }

    /// The current placement map.
    pub fn placement(&self) -> Vec<Vec<usize>> {
        self.placement
            .read()
            .expect("placement lock is never poisoned")
            .clone()
    }

    /// Selection counts `[layer][expert]`, summed over shards.
    pub async fn counts(&self) -> Vec<Vec<u64>> {
        let mut out: Vec<Vec<u64>> = self.placement().iter().map(|l| vec![0; l.len()]).collect();
        for s in &self.shards {
            if let Ok(c) = s.send(GetExpertCounts).await {
                for (l, e, n) in c {
                    out[l][e] += n;
                }
            }
        }
        out
    }

    /// Recomputes the placement from selection counts so shards get equal load.
    pub async fn rebalance(&self) -> Vec<Vec<usize>> {
        let loads = self.counts().await;
        let place = balanced(&loads, self.shards.len());
        *self
            .placement
            .write()
            .expect("placement lock is never poisoned") = place.clone();
        place
    }
}

impl Drop for ShardedExperts {
    fn drop(&mut self) {
        for a in &self.arbiters {
            a.stop();
        }
    }
}

impl ExpertDispatch for ShardedExperts {
    fn run(
        &self,
        moe_layer: usize,
        x: &[f32],
        hidden: usize,
        choices: &[Vec<(usize, f32)>],
    ) -> Vec<f32> {
        let placement = self
            .placement
            .read()
            .expect("placement lock is never poisoned");
        let owner = &placement[moe_layer];
        let n = self.shards.len();
        // Per shard: the rows it needs (compacted, ascending) and its
        // (local row, expert) items; per pair: its shard and item index.
        let mut rows_of: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut last_row: Vec<usize> = vec![usize::MAX; n];
        let mut items: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n];
        let mut pair_at: Vec<(usize, usize)> = Vec::with_capacity(choices.len() * 16);
        for (r, c) in choices.iter().enumerate() {
            for &(e, _) in c {
                let s = owner[e];
                if last_row[s] != r {
                    last_row[s] = r;
                    rows_of[s].push(r);
                }
                pair_at.push((s, items[s].len()));
                items[s].push((rows_of[s].len() - 1, e));
            }
        }
        drop(placement);
        // Send every shard its rows first, then wait: shards run in parallel.
        let mut waiting = Vec::with_capacity(n);
        for s in 0..n {
            if items[s].is_empty() {
                continue;
            }
            let mut rows = Vec::with_capacity(rows_of[s].len() * hidden);
            for &r in &rows_of[s] {
                rows.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
            }
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            let msg = RunExperts {
                reply: tx,
                layer: moe_layer,
                hidden,
                rows,
                items: std::mem::take(&mut items[s]),
            };
            self.shards[s]
                .try_send(msg)
                .expect("a shard has at most one request in flight per forward");
            waiting.push((s, rx));
        }
        // Concatenate the replies; pair (s, i) reads row base[s] + i.
        let mut base = vec![0usize; n];
        let mut ys = Vec::new();
        for (s, rx) in waiting {
            let y = rx
                .recv()
                .expect("expert shard threads live as long as the engine");
            base[s] = ys.len() / hidden.max(1);
            ys.extend_from_slice(&y);
        }
        combine(
            &ys,
            |p| {
                let (s, i) = pair_at[p];
                base[s] + i
            },
            hidden,
            choices,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_placement_evens_out_load() {
        let loads = vec![vec![100, 1, 1, 1, 50, 50]];
        let p = balanced(&loads, 2);
        let load = |s| {
            p[0].iter()
                .zip(&loads[0])
                .filter(|(&o, _)| o == s)
                .map(|(_, &l)| l)
                .sum::<u64>()
        };
        assert_eq!(load(0) + load(1), 203);
        assert!(load(0).abs_diff(load(1)) <= 1, "{} vs {}", load(0), load(1));
    }

    #[test]
    fn round_robin_covers_every_shard() {
        assert_eq!(round_robin(&[5], 2), vec![vec![0, 1, 0, 1, 0]]);
    }
}
