//! Pipeline parallelism: each stage is a rank holding a contiguous range of
//! transformer blocks; the embedding goes with the first stage, the final
//! norm and the head with the last. Activations travel forward and their
//! gradients backward as point-to-point messages ([`PointToPoint`]).
//!
//! With virtual stages (`V > 1`, Megatron-LM's virtual pipeline), the model
//! is cut into `S x V` chunks instead of `S`, and rank `s` holds chunks
//! `s, s + S, s + 2S, ...` (Megatron's model chunks): the embedding is in
//! chunk 0 (rank 0), the head in chunk `SV - 1` (rank `S - 1`), and chunk
//! `c`'s output on the last rank goes round to the first rank, for chunk
//! `c + 1` (the links are a ring).
//!
//! Schedules (both flush the pipeline every optimizer step, so the update is
//! the one plain gradient accumulation over the same micro-batches makes):
//! * GPipe (Huang et al., GPipe, NeurIPS 2019): all K forwards, then all K
//!   backwards; every stage holds the activations of all K micro-batches.
//! * 1F1B (Narayanan et al., PipeDream-Flush, "Memory-Efficient
//!   Pipeline-Parallel DNN Training", ICML 2021; Megatron-LM's default
//!   non-interleaved schedule): stage `s` of `S` runs `min(S - s - 1, K)`
//!   warm-up forwards, then alternates one forward and one backward, then
//!   drains the remaining backwards, so it never holds more than `S - s`
//!   micro-batches of activations.
//! * Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language
//!   Model Training on GPU Clusters Using Megatron-LM", SC 2021, section
//!   2.2.2; Megatron-Core's `forward_backward_pipelining_with_interleaving`
//!   and `get_schedule_table`): with `V` chunks per rank, the `K`
//!   micro-batches go in groups of `S`, each group through chunk 0, then
//!   chunk 1, ..., then the next group; the backwards go the same way
//!   through the chunks in reverse. Rank `s` runs `(S - s - 1) x 2 +
//!   (V - 1) x S` warm-up forwards (at most `V x K`), then alternates one
//!   forward and one backward, then drains. The bubble shrinks by `V`
//!   (`(S - 1) / (V x K)` of the step), at the price of `V` times the
//!   point-to-point messages and more chunk activations in flight on the
//!   early ranks. `K` must be a multiple of `S` (as Megatron requires with
//!   its default group of `S` micro-batches).
//!
//! A tied head (gpt2) reads the embedding matrix on the last stage: as in
//! Megatron-LM, the last stage keeps its own copy of the embedding weight
//! (with its gradient and optimizer state), and the first and last stages
//! all-reduce that weight's gradient before each update, so both copies take
//! the same step and stay equal.

use std::ops::Range;

use super::Comm;
use crate::backend::Backend;
use crate::comm::{AbortHandle, PointToPoint};
use crate::config::model::ParamIndex;

knob_enum! {
    /// The pipeline schedule.
    #[serde(rename_all = "lowercase")]
    pub enum Schedule {
        /// All K forwards, then all K backwards.
        Gpipe,
        /// Warm-up, one forward one backward, cool-down.
        #[default]
        #[value(name = "1f1b")]
        #[serde(rename = "1f1b")]
        OneFOneB,
    }
}

/// One unit of a rank's schedule: the forward or the backward of
/// micro-batch `m` (0-based) through the rank's chunk `c` (its `c`-th, the
/// model's chunk `stage + c x S`; always 0 without virtual stages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Forward(usize, usize),
    Backward(usize, usize),
}

impl Schedule {
    /// Forwards rank `s` of `stages` runs before its first backward, with
    /// `v` chunks per rank and `k` micro-batches; the interleaved count is
    /// Megatron-Core's (`get_pp_rank_microbatches`), in chunk-micro-batches.
    pub fn warmup(self, s: usize, stages: usize, v: usize, k: usize) -> usize {
        match self {
            _ if stages == 1 => 0,
            Schedule::Gpipe => k,
            Schedule::OneFOneB if v == 1 => (stages - s - 1).min(k),
            Schedule::OneFOneB => ((stages - s - 1) * 2 + (v - 1) * stages).min(v * k),
        }
    }

    /// Forwards (chunk-micro-batches with virtual stages) whose activations
    /// rank `s` of `stages` holds at its peak, with `v` chunks per rank and
    /// `k` micro-batches in all: the warm-up's and the first steady
    /// forward's.
    pub fn in_flight(self, s: usize, stages: usize, v: usize, k: usize) -> usize {
        match self {
            Schedule::Gpipe => k,
            Schedule::OneFOneB => (self.warmup(s, stages, v, k) + 1).min(v * k),
        }
    }

    /// Rank `s`'s forwards and backwards over `k` micro-batches and its `v`
    /// chunks, in order. Without a pipeline (`stages == 1`) both are plain
    /// gradient accumulation: forward then backward, micro-batch by
    /// micro-batch. With `v > 1` (1F1B only) `k` is a multiple of `stages`.
    pub fn ops(self, s: usize, stages: usize, v: usize, k: usize) -> Vec<Op> {
        assert!(
            v == 1 || (self == Schedule::OneFOneB && k.is_multiple_of(stages)),
            "validate::pipeline refuses {v} virtual stages with {self:?} and K = {k}"
        );
        let (total, warmup) = (v * k, self.warmup(s, stages, v, k));
        let forward = |i: usize| {
            let (m, c) = interleaved(i, stages, v);
            Op::Forward(m, c)
        };
        // The backwards take the chunks in reverse.
        let backward = |i: usize| {
            let (m, c) = interleaved(i, stages, v);
            Op::Backward(m, v - 1 - c)
        };
        let mut out: Vec<Op> = (0..warmup).map(forward).collect();
        for i in warmup..total {
            out.push(forward(i));
            out.push(backward(i - warmup));
        }
        out.extend((total - warmup..total).map(backward));
        out
    }

    pub fn name(self) -> &'static str {
        match self {
            Schedule::Gpipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
        }
    }
}

/// The `i`-th forward of a rank with `v` chunks, as (micro-batch, chunk):
/// groups of `stages` micro-batches, each group through every chunk in
/// turn (Megatron-Core's schedule table with its default group of
/// `pipeline_parallel_size`). With one chunk it is micro-batch `i`.
fn interleaved(i: usize, stages: usize, v: usize) -> (usize, usize) {
    let (group, at) = (i / (stages * v), i % (stages * v));
    (group * stages + at % stages, at / stages)
}

/// Blocks per stage for an even split of the model's `blocks + 2` pipeline
/// layers (the embedding, each block, the head), the first stages taking
/// the remainder: DeepSpeed's `partition_method="uniform"` over the layer
/// list. The first stage's count excludes the embedding and the last's the
/// head, so either may be 0 (a stage holding only the embedding, or only
/// the head). Needs `1 <= stages <= blocks + 2`.
pub fn uniform_balance(blocks: usize, stages: usize) -> Vec<usize> {
    let mut out = even_split(blocks + 2, stages);
    out[0] -= 1;
    out[stages - 1] -= 1;
    out
}

/// `n` items in `stages` runs as even as can be, the first runs taking the
/// remainder.
pub fn even_split(n: usize, stages: usize) -> Vec<usize> {
    (0..stages)
        .map(|s| n / stages + usize::from(s < n % stages))
        .collect()
}

/// Stage `s`'s block range under `balance` (layers per stage).
pub fn stage_layers(balance: &[usize], s: usize) -> Range<usize> {
    let lo: usize = balance[..s].iter().sum();
    lo..lo + balance[s]
}

/// A rank's stage and its chunks' block ranges ([`rank_chunks`]).
pub type Place = (usize, Vec<Range<usize>>);

/// Rank `s`'s chunks' block ranges under `balance` (blocks per model
/// chunk, `stages x v` of them): the model's chunks `s, s + stages, ...`.
pub fn rank_chunks(balance: &[usize], s: usize, stages: usize) -> Vec<Range<usize>> {
    (s..balance.len())
        .step_by(stages)
        .map(|c| stage_layers(balance, c))
        .collect()
}

/// Which tensors rank `s` of `stages` holds, given its chunks' block
/// ranges: their blocks', the embedding's on the first rank, the final
/// norm's and the head's on the last (which, for a tied head, is the
/// embedding matrix).
pub fn owned_tensors(
    idx: &ParamIndex,
    n: usize,
    s: usize,
    stages: usize,
    chunks: &[Range<usize>],
) -> Vec<bool> {
    let mut own = vec![false; n];
    let units = super::shard::units(idx);
    let (first, last) = (s == 0, s + 1 == stages);
    // units: [embedding, block 0, ..., block L-1, head]
    for (u, tensors) in units.iter().enumerate() {
        let mine = if u == 0 {
            first
        } else if u == units.len() - 1 {
            last
        } else {
            chunks.iter().any(|c| c.contains(&(u - 1)))
        };
        if mine {
            for &i in tensors {
                own[i] = true;
            }
        }
    }
    if last && idx.lm_head.is_none() {
        own[idx.wte] = true;
    }
    own
}

/// One stage's place in the pipeline and its links to the other stages of
/// its data-parallel replica.
pub struct Pipe<B: Backend> {
    pub stage: usize,
    pub stages: usize,
    /// The blocks of this rank's chunks, in model order: its `c`-th is the
    /// model's chunk `stage + c x stages` (one chunk without virtual stages).
    pub chunks: Vec<Range<usize>>,
    /// The chunk whose forward or backward runs now.
    pub chunk: usize,
    pub schedule: Schedule,
    pub p2p: Box<dyn PointToPoint<B::Buf>>,
    /// All stages of this replica: the gradient norm and the loss are sums over them.
    pub group: Comm<B>,
    /// The first and the last stage (rank 0 and 1), when the head is tied
    /// to the embedding: the embedding gradient is summed over both.
    pub embed: Option<Comm<B>>,
}

impl<B: Backend> Pipe<B> {
    /// Whether the running chunk is the model's first (it embeds).
    pub fn first(&self) -> bool {
        self.stage == 0 && self.chunk == 0
    }
    /// Whether the running chunk is the model's last (it holds the head).
    pub fn last(&self) -> bool {
        self.stage + 1 == self.stages && self.chunk + 1 == self.chunks.len()
    }
    /// The running chunk's blocks.
    pub fn layers(&self) -> Range<usize> {
        self.chunks[self.chunk].clone()
    }

    /// Aborts every link of this stage.
    pub fn abort_handles(&self) -> Vec<AbortHandle> {
        let mut out = vec![self.p2p.abort_handle(), self.group.abort_handle()];
        out.extend(self.embed.as_ref().map(|c| c.abort_handle()));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Op::{Backward as B, Forward as F};
    use std::collections::VecDeque;

    /// Plain 1F1B and GPipe, where each op is micro-batch `m` of chunk 0.
    fn plain(ops: &[Op]) -> Vec<(bool, usize)> {
        (ops.iter())
            .map(|&op| match op {
                F(m, 0) => (true, m),
                B(m, 0) => (false, m),
                other => panic!("{other:?} has a chunk"),
            })
            .collect()
    }

    #[test]
    fn schedules_order_forwards_and_backwards() {
        let (f, b) = (|m| (true, m), |m| (false, m));
        // Stage 0 of 4, 6 micro-batches: 3 warm-up forwards.
        let ops = Schedule::OneFOneB.ops(0, 4, 1, 6);
        assert_eq!(
            plain(&ops),
            [
                f(0),
                f(1),
                f(2),
                f(3),
                b(0),
                f(4),
                b(1),
                f(5),
                b(2),
                b(3),
                b(4),
                b(5)
            ]
        );
        let ops = |sched: Schedule, s, stages, k| plain(&sched.ops(s, stages, 1, k));
        assert_eq!(ops(Schedule::OneFOneB, 3, 4, 2), [f(0), b(0), f(1), b(1)]);
        assert_eq!(ops(Schedule::Gpipe, 1, 2, 2), [f(0), f(1), b(0), b(1)]);
        // No pipeline: plain accumulation whatever the schedule.
        assert_eq!(ops(Schedule::Gpipe, 0, 1, 2), [f(0), b(0), f(1), b(1)]);
        // Fewer micro-batches than warm-up slots.
        assert_eq!(ops(Schedule::OneFOneB, 0, 4, 2), [f(0), f(1), b(0), b(1)]);
        // The most micro-batches held at once is the in-flight count.
        for sched in [Schedule::Gpipe, Schedule::OneFOneB] {
            for (s, stages, k) in [(0, 4, 6), (1, 4, 6), (3, 4, 6), (0, 4, 2), (1, 2, 8)] {
                assert_eq!(
                    most_held(&sched.ops(s, stages, 1, k)),
                    sched.in_flight(s, stages, 1, k),
                    "{sched:?} {s} {stages} {k}"
                );
            }
        }
    }

    /// The most forwards a rank's ops hold before their backwards.
    fn most_held(ops: &[Op]) -> usize {
        let (mut live, mut most) = (0usize, 0);
        for op in ops {
            match op {
                F(..) => live += 1,
                B(..) => live -= 1,
            }
            most = most.max(live);
        }
        most
    }

    #[test]
    fn interleaved_1f1b_runs_megatrons_order() {
        // S = 2, V = 2, K = 4: groups of two micro-batches through chunk
        // 0, then chunk 1. Rank 0 warms up (2-0-1) x 2 + (2-1) x 2 = 4
        // forwards, rank 1 (0) x 2 + 2 = 2.
        let one = Schedule::OneFOneB;
        assert_eq!(
            one.ops(0, 2, 2, 4),
            [
                F(0, 0),
                F(1, 0),
                F(0, 1),
                F(1, 1),
                F(2, 0),
                B(0, 1),
                F(3, 0),
                B(1, 1),
                F(2, 1),
                B(0, 0),
                F(3, 1),
                B(1, 0),
                B(2, 1),
                B(3, 1),
                B(2, 0),
                B(3, 0)
            ]
        );
        assert_eq!(
            one.ops(1, 2, 2, 4),
            [
                F(0, 0),
                F(1, 0),
                F(0, 1),
                B(0, 1),
                F(1, 1),
                B(1, 1),
                F(2, 0),
                B(0, 0),
                F(3, 0),
                B(1, 0),
                F(2, 1),
                B(2, 1),
                F(3, 1),
                B(3, 1),
                B(2, 0),
                B(3, 0)
            ]
        );
        // S = 4, V = 2, K = 8, the paper's Figure 4: the first device runs
        // micro-batches 1-4 through its first chunk, 1-4 through its
        // second, 5 and 6 through its first (10 warm-up forwards), then
        // the 7th forward and the first backward, of micro-batch 1's
        // second chunk.
        let r0 = one.ops(0, 4, 2, 8);
        assert_eq!(
            r0[..12],
            [
                F(0, 0),
                F(1, 0),
                F(2, 0),
                F(3, 0),
                F(0, 1),
                F(1, 1),
                F(2, 1),
                F(3, 1),
                F(4, 0),
                F(5, 0),
                F(6, 0),
                B(0, 1)
            ]
        );
        // The last device warms up with one chunk's group, 4 forwards.
        let r3 = one.ops(3, 4, 2, 8);
        assert_eq!(
            r3[..6],
            [F(0, 0), F(1, 0), F(2, 0), F(3, 0), F(0, 1), B(0, 1)]
        );
        assert_eq!(r3[r3.len() - 2..], [B(6, 0), B(7, 0)]);
    }

    /// Megatron's warm-up count, capped at every chunk-micro-batch.
    fn megatron_warmup(s: usize, stages: usize, v: usize, k: usize) -> usize {
        ((stages - s - 1) * 2 + (v - 1) * stages).min(v * k)
    }

    /// Every (S, V, K) the interleaved tests walk: K a multiple of S, some
    /// below the warm-up (every forward first).
    fn shapes() -> Vec<(usize, usize, usize)> {
        let mut out = Vec::new();
        for stages in 2..=5 {
            for v in 1..=4 {
                for groups in 1..=4 {
                    out.push((stages, v, stages * groups));
                }
            }
        }
        out
    }

    #[test]
    fn every_chunk_of_every_micro_batch_runs_once_each_way_and_holds_megatrons_count() {
        let one = Schedule::OneFOneB;
        for (stages, v, k) in shapes() {
            for s in 0..stages {
                let ops = one.ops(s, stages, v, k);
                let label = format!("rank {s} of S={stages} V={v} K={k}");
                assert_eq!(ops.len(), 2 * v * k, "{label}");
                let mut fwd = vec![false; v * k];
                let mut bwd = vec![false; v * k];
                for op in &ops {
                    match *op {
                        F(m, c) => {
                            assert!(!std::mem::replace(&mut fwd[m * v + c], true), "{label}")
                        }
                        B(m, c) => {
                            assert!(fwd[m * v + c], "{label}: {op:?} before its forward");
                            assert!(!std::mem::replace(&mut bwd[m * v + c], true), "{label}");
                        }
                    }
                }
                assert!(fwd.iter().chain(&bwd).all(|&x| x), "{label}");
                // The warm-up's forwards, then the first steady one's
                // (none when the warm-up takes every forward).
                let leading = ops.iter().take_while(|op| matches!(op, F(..))).count();
                if v > 1 {
                    let warmup = megatron_warmup(s, stages, v, k);
                    assert_eq!(one.warmup(s, stages, v, k), warmup, "{label}");
                    assert_eq!(leading, (warmup + 1).min(v * k), "{label}");
                    assert_eq!(one.in_flight(s, stages, v, k), leading, "{label}");
                }
                assert_eq!(most_held(&ops), one.in_flight(s, stages, v, k), "{label}");
            }
        }
    }

    /// Every rank's ops run together, sends never waiting (`isend`): a
    /// forward of model chunk `g > 0` receives chunk `g - 1`'s output from
    /// the rank before (the last rank's goes round to the first), a
    /// backward of `g < SV - 1` receives chunk `g + 1`'s input gradient
    /// from the rank after. Each directed link is one FIFO, as
    /// [`PointToPoint`] is: the message a receive takes must be the one it
    /// needs. Returns whether every rank finished.
    fn run_together(stages: usize, v: usize, k: usize) -> bool {
        let last = stages * v - 1;
        let ops: Vec<Vec<Op>> = (0..stages)
            .map(|s| Schedule::OneFOneB.ops(s, stages, v, k))
            .collect();
        // fwd[r]: messages into rank r from the rank before; bwd[r]: from the rank after.
        let mut fwd: Vec<VecDeque<(usize, usize)>> = vec![VecDeque::new(); stages];
        let mut bwd: Vec<VecDeque<(usize, usize)>> = vec![VecDeque::new(); stages];
        let mut at = vec![0usize; stages];
        loop {
            let mut moved = false;
            for r in 0..stages {
                while let Some(&op) = ops[r].get(at[r]) {
                    let (next, prev) = ((r + 1) % stages, (r + stages - 1) % stages);
                    match op {
                        F(m, c) => {
                            let g = r + c * stages;
                            if g > 0 {
                                let Some(got) = fwd[r].pop_front() else { break };
                                assert_eq!(
                                    got,
                                    (m, g - 1),
                                    "rank {r} received the wrong activation"
                                );
                            }
                            if g < last {
                                fwd[next].push_back((m, g));
                            }
                        }
                        B(m, c) => {
                            let g = r + c * stages;
                            if g < last {
                                let Some(got) = bwd[r].pop_front() else { break };
                                assert_eq!(got, (m, g + 1), "rank {r} received the wrong gradient");
                            }
                            if g > 0 {
                                bwd[prev].push_back((m, g));
                            }
                        }
                    }
                    at[r] += 1;
                    moved = true;
                }
            }
            if !moved {
                return (0..stages).all(|r| at[r] == ops[r].len());
            }
        }
    }

    #[test]
    fn interleaved_ranks_never_wait_forever_and_receive_what_they_need() {
        for (stages, v, k) in shapes() {
            assert!(
                run_together(stages, v, k),
                "S={stages} V={v} K={k} deadlocks"
            );
        }
    }

    #[test]
    fn a_rank_holds_its_chunks_of_the_model() {
        // 4 blocks and the two ends in 2 x 2 chunks: the embedding and
        // block 0, blocks 1-2, block 3, the head.
        let b = uniform_balance(4, 4);
        assert_eq!(b, [1, 2, 1, 0]);
        assert_eq!(rank_chunks(&b, 0, 2), [0..1, 3..4]);
        assert_eq!(rank_chunks(&b, 1, 2), [1..3, 4..4]);
        // One chunk per rank: the stage's blocks.
        assert_eq!(
            rank_chunks(&[3, 3, 2, 2], 2, 4),
            vec![stage_layers(&[3, 3, 2, 2], 2)]
        );
        assert_eq!(stage_layers(&[3, 3, 2, 2], 2), 6..8);
    }

    #[test]
    fn uniform_balance_gives_the_remainder_to_the_first_stages() {
        // 12 layers, 3 per stage: the embedding and the head take a block's place.
        assert_eq!(uniform_balance(10, 4), [2, 3, 3, 2]);
        assert_eq!(uniform_balance(2, 4), [0, 1, 1, 0]);
        assert_eq!(uniform_balance(12, 1), [12]);
        assert_eq!(uniform_balance(3, 2), [2, 1]);
        assert_eq!(stage_layers(&[3, 3, 2, 2], 2), 6..8);
    }
}
