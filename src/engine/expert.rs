//! Expert parallelism, as Megatron-Core's `MoEAlltoAllTokenDispatcher`
//! runs it: a group of `P` consecutive data-parallel ranks splits a
//! mixture's `E` experts, rank `q` holding experts `q·E/P ..` of every
//! routed block (their rows of the stacked `(E, 2I, C)` and `(E, C, I)`
//! tensors). The router, attention and every dense tensor stay replicated.
//!
//! A routed block's forward on each rank:
//! 1. routes its own tokens and permutes them by expert, as without
//!    expert parallelism (`moe::route`); the rows for rank `d`'s experts
//!    are then one contiguous run of the permuted buffer;
//! 2. all-gathers every rank's per-expert row counts over the group (the
//!    dispatcher's `num_global_tokens_per_expert`), so that every rank
//!    knows what it will receive;
//! 3. exchanges the rows all-to-all; what arrives is ordered by source
//!    rank, then by local expert, and a second permutation (Megatron's
//!    `sort_chunks_by_idxs`) makes each local expert's rows contiguous for
//!    the grouped GEMM;
//! 4. runs its local experts on those rows, un-permutes their outputs and
//!    sends them back all-to-all, where the combine weights them into
//!    their tokens as before.
//!
//! The backward runs the same exchanges in reverse for the gradients. The
//! experts' weight gradients are each rank's own (from every rank's rows);
//! they are summed, and under ZeRO sharded, over the expert-data-parallel
//! group, the ranks that hold the same experts (`shard::Dist`).
//!
//! Memory: with a capacity factor every (rank, expert) pair exchanges
//! exactly `cap` rows, so each rank receives `E·cap` rows, as many as it
//! sends, and meta plans cpu byte for byte. Dropless, what a rank receives
//! depends on every rank's routing: cpu allocates what arrives; meta,
//! which knows no routing, plans `ExpertLoad::Balanced` (each expert gets
//! an even share of every rank's `N·k` rows) or `ExpertLoad::Worst`
//! (every token of every rank of the group chooses this rank's experts
//! first: `P·N·min(k, E/P)` rows).

use super::device::{Comm, Device};
use super::moe::MoeShape;
use super::tensor::Split;
use super::{DType, T};
use crate::backend::Backend;
use crate::config::model::{ParamIndex, ParamSpec};
use crate::memory::{Category, OomError};

/// Which routing a planner assumes for dropless expert parallelism (cpu
/// routes for real and ignores it).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum ExpertLoad {
    /// Every expert receives an even share of every rank's rows.
    #[default]
    Balanced,
    /// This rank's experts are every token's first choices.
    Worst,
}

/// One rank's place in its expert-parallel group.
pub struct Ep<B: Backend> {
    pub comm: Comm<B>,
    /// Each tensor's rows this rank holds (`None`: replicated).
    pub splits: Vec<Option<Split>>,
    /// The routing a planner assumes (meta only).
    pub load: ExpertLoad,
}

impl Ep<crate::backend::meta::MetaBackend> {
    /// A copy for a forked planning engine (`Engine::reshaped`).
    pub fn fork(&self) -> Option<Self> {
        Some(Ep {
            comm: self.comm.fork()?,
            splits: self.splits.clone(),
            load: self.load,
        })
    }
}

impl<B: Backend> Ep<B> {
    pub fn size(&self) -> usize {
        self.comm.world()
    }
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
}

/// The experts rank `rank` of `size` holds: its rows of each routed
/// block's stacked experts, and of `adapters` (LoRA's on the experts,
/// stacked alike), whose shapes in `specs` become `(E/P, ..)`.
pub fn split_layout(
    specs: &mut [ParamSpec],
    (idx, adapters): (&ParamIndex, &[usize]),
    size: usize,
    rank: usize,
) -> Vec<Option<Split>> {
    let mut splits = vec![None; specs.len()];
    let experts = (idx.blocks.iter().filter_map(|b| b.moe)).flat_map(|m| [m.up, m.down]);
    for i in experts.chain(adapters.iter().copied()) {
        let shape = specs[i].shape.clone();
        let (e, rows, cols) = (shape[0], shape[1], shape[2]);
        let local = e / size;
        splits[i] = Some(Split::Rows {
            cols,
            parts: vec![(rank * local * rows, local * rows)],
        });
        specs[i].shape = vec![local, rows, cols];
    }
    splits
}

/// The exchange of one routed block's rows, as every rank of the group
/// agreed on it: `counts[s][x]` rows of rank `s` for expert `x`.
#[derive(Clone, Debug)]
pub struct Exchange {
    /// `P × E`, row-major.
    counts: Vec<usize>,
    p: usize,
    e: usize,
    me: usize,
}

impl Exchange {
    /// Experts per rank.
    fn local(&self) -> usize {
        self.e / self.p
    }
    fn count(&self, s: usize, x: usize) -> usize {
        self.counts[s * self.e + x]
    }

    /// Rows, by source and destination rank, for `Collective::all_to_all`
    /// (times `width`: elements). `back`: the return trip.
    pub fn pairs(&self, width: usize, back: bool) -> Vec<usize> {
        let (p, l) = (self.p, self.local());
        let mut out = vec![0; p * p];
        for s in 0..p {
            for d in 0..p {
                let rows: usize = (d * l..(d + 1) * l).map(|x| self.count(s, x)).sum();
                let at = match back {
                    false => s * p + d,
                    true => d * p + s,
                };
                out[at] = rows * width;
            }
        }
        out
    }

    /// Rows this rank receives.
    pub fn received(&self) -> usize {
        let l = self.local();
        (0..self.p)
            .map(|s| {
                (self.me * l..(self.me + 1) * l)
                    .map(|x| self.count(s, x))
                    .sum::<usize>()
            })
            .sum()
    }

    /// Each local expert's rows, from every rank: the grouped GEMM's groups.
    pub fn local_counts(&self) -> Vec<usize> {
        let l = self.local();
        (0..l)
            .map(|j| (0..self.p).map(|s| self.count(s, self.me * l + j)).sum())
            .collect()
    }

    /// For each row in local-expert order (expert, then source rank), its
    /// row in the received buffer (source rank, then expert).
    pub fn sort_index(&self) -> Vec<u32> {
        let l = self.local();
        // Where source s's rows for local expert j start in the received buffer.
        let mut start = vec![0usize; self.p * l];
        let mut at = 0;
        for s in 0..self.p {
            for j in 0..l {
                start[s * l + j] = at;
                at += self.count(s, self.me * l + j);
            }
        }
        let mut out = Vec::with_capacity(at);
        for j in 0..l {
            for s in 0..self.p {
                let n = self.count(s, self.me * l + j);
                out.extend((start[s * l + j]..start[s * l + j] + n).map(|r| r as u32));
            }
        }
        out
    }
}

/// What a planner assumes every rank sends each expert: the capacity, or
/// dropless an even share (`Balanced`), or every token's choices on this
/// rank's experts first (`Worst`: each of `P` ranks sends `N·min(k, E/P)`
/// rows here, the rest of its `N·k` to the first experts elsewhere).
fn planned(sh: &MoeShape, p: usize, me: usize, load: ExpertLoad) -> Vec<usize> {
    let (e, l) = (sh.e, sh.e / p);
    // What each rank sends: the same from every rank of the group.
    let row = match (sh.cap, load) {
        (None, ExpertLoad::Worst) => {
            let mine = sh.n * sh.k.min(l);
            let mut row = vec![0; e];
            // Spread over the local experts, then the rest over the others.
            for (j, c) in split_even(mine, l).into_iter().enumerate() {
                row[me * l + j] = c;
            }
            let others: Vec<usize> = (0..e).filter(|x| x / l != me).collect();
            for (x, c) in others
                .iter()
                .zip(split_even(sh.n * sh.k - mine, others.len()))
            {
                row[*x] = c;
            }
            row
        }
        _ => sh.planned_counts(),
    };
    row.repeat(p)
}

/// `n` split into `parts` counts as even as can be (the first ones larger).
pub(super) fn split_even(n: usize, parts: usize) -> Vec<usize> {
    if parts == 0 {
        return Vec::new();
    }
    (0..parts)
        .map(|x| n / parts + (x < n % parts) as usize)
        .collect()
}

/// Step 2: every rank's per-expert counts (`own`, this rank's routing; on
/// meta the plan's), all-gathered over the group in an f32 buffer
/// (Megatron gathers them as a device tensor too).
pub fn exchange<B: Backend>(
    dev: &mut Device<B>,
    ep: &mut Ep<B>,
    own: &[usize],
    sh: &MoeShape,
) -> Result<Exchange, OomError> {
    let (p, me, e) = (ep.size(), ep.rank(), sh.e);
    let tmp = Category::Temporaries;
    let mut send = dev.alloc_f32(e, tmp)?;
    let mut recv = dev.alloc_f32(p * e, tmp)?;
    // f32 holds counts exactly below 2^24 rows: a micro-batch a cpu could
    // never hold (meta exchanges no values).
    let exact = (own.iter().sum::<usize>() as u64) < 1 << 24;
    assert!(
        exact || !dev.be.holds_data(),
        "row counts beyond 2^24 lose precision in f32"
    );
    let mine: Vec<f32> = own.iter().map(|&c| c as f32).collect();
    dev.be.upload_f32(&mut send.buf, &mine);
    dev.critical(|dev| dev.all_gather(&mut *ep.comm, &mut recv, &send));
    let counts = match dev.be.download_f32(&recv.buf) {
        Some(v) => v.iter().map(|&c| c as usize).collect(),
        None => planned(sh, p, me, ep.load),
    };
    dev.free(send);
    dev.free(recv);
    Ok(Exchange { counts, p, e, me })
}

/// Sends `rows × width` of `x` (this rank's rows, by destination) and
/// returns what arrives (`back`: the return trip), a new tensor of
/// `category`.
pub fn all_to_all<B: Backend>(
    dev: &mut Device<B>,
    ep: &mut Ep<B>,
    x: &T<B>,
    ex: &Exchange,
    (width, back, category): (usize, bool, Category),
) -> Result<T<B>, OomError> {
    let pairs = ex.pairs(width, back);
    let p = ex.p;
    let me = ex.me;
    let rows: usize = (0..p).map(|s| pairs[s * p + me]).sum();
    let mut out = dev.alloc(rows, x.dtype, category)?;
    dev.critical(|dev| dev.all_to_all(&mut *ep.comm, &mut out, x, &pairs));
    Ok(out)
}

/// The sort index as a device tensor (u32, an activation: the backward
/// permutes with it again).
pub fn upload_index<B: Backend>(dev: &mut Device<B>, ex: &Exchange) -> Result<T<B>, OomError> {
    let rows = ex.received();
    let mut t = dev.alloc(rows, DType::U32, Category::Activations)?;
    if dev.be.holds_data() {
        dev.be.upload_u32(&mut t.buf, &ex.sort_index());
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(counts: Vec<usize>, p: usize, e: usize, me: usize) -> Exchange {
        Exchange { counts, p, e, me }
    }

    #[test]
    fn pairs_received_and_the_sort_follow_the_counts() {
        // 2 ranks, 4 experts (2 each). Rank 0 sends [1,2,3,4] rows to
        // experts 0..4, rank 1 [5,6,7,8].
        let x = ex(vec![1, 2, 3, 4, 5, 6, 7, 8], 2, 4, 1);
        // Rows from s to d: experts of d.
        assert_eq!(x.pairs(1, false), vec![3, 7, 11, 15]);
        assert_eq!(x.pairs(10, true), vec![30, 110, 70, 150]);
        // Rank 1 holds experts 2 and 3: 3 + 4 + 7 + 8 rows.
        assert_eq!(x.received(), 22);
        assert_eq!(x.local_counts(), vec![10, 12]);
        // Received: [s0 e2 (3), s0 e3 (4), s1 e2 (7), s1 e3 (8)]; sorted by
        // expert: s0 e2, s1 e2, s0 e3, s1 e3.
        let want: Vec<u32> = (0..3).chain(7..14).chain(3..7).chain(14..22).collect();
        assert_eq!(x.sort_index(), want);
    }

    #[test]
    fn planned_loads() {
        let m = crate::config::model::MoeConfig {
            n_experts: 4,
            top_k: 2,
            d_expert: 8,
            d_shared: 0,
            shared_gate: false,
            first_dense: 0,
            norm_topk: true,
            aux_loss_coef: 0.0,
        };
        let sh = MoeShape::new(&m, 16, 6, None);
        // Balanced: 12 rows over 4 experts, from each of 2 ranks.
        let b = ex(planned(&sh, 2, 1, ExpertLoad::Balanced), 2, 4, 1);
        assert_eq!(b.received(), 12);
        // Worst: each rank sends all 6·min(2, 2) = 12 of its rows here.
        let w = ex(planned(&sh, 2, 1, ExpertLoad::Worst), 2, 4, 1);
        assert_eq!(w.received(), 24);
        assert_eq!(w.pairs(1, false).iter().sum::<usize>(), 24);
        // With a capacity, both are the capacity.
        let sh = MoeShape::new(&m, 16, 6, Some(1.0));
        let c = ex(planned(&sh, 2, 0, ExpertLoad::Worst), 2, 4, 0);
        assert_eq!(c.received(), 2 * 2 * 3);
    }
}
