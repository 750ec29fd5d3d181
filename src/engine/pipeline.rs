//! Pipeline parallelism: each stage is a rank holding a contiguous range of
//! transformer blocks; the embedding goes with the first stage, the final
//! norm and the head with the last. Activations travel forward and their
//! gradients backward as point-to-point messages ([`PointToPoint`]).
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

/// One unit of a stage's schedule: the forward or the backward of micro-batch `m`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Forward(usize),
    Backward(usize),
}

impl Schedule {
    /// Micro-batches stage `s` (0-based) of `stages` holds at its peak, with `k` in all.
    pub fn in_flight(self, s: usize, stages: usize, k: usize) -> usize {
        match self {
            Schedule::Gpipe => k,
            Schedule::OneFOneB => (stages - s).min(k),
        }
    }

    /// Stage `s`'s forwards and backwards over `k` micro-batches, in order.
    /// Without a pipeline (`stages == 1`) both are plain gradient
    /// accumulation: forward then backward, micro-batch by micro-batch.
    pub fn ops(self, s: usize, stages: usize, k: usize) -> Vec<Op> {
        let warmup = match self {
            _ if stages == 1 => 0,
            Schedule::Gpipe => k,
            Schedule::OneFOneB => (stages - s - 1).min(k),
        };
        let mut out: Vec<Op> = (0..warmup).map(Op::Forward).collect();
        for m in warmup..k {
            out.push(Op::Forward(m));
            out.push(Op::Backward(m - warmup));
        }
        out.extend((k - warmup..k).map(Op::Backward));
        out
    }

    pub fn name(self) -> &'static str {
        match self {
            Schedule::Gpipe => "gpipe",
            Schedule::OneFOneB => "1f1b",
        }
    }
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

/// Which tensors stage `s` of `stages` holds, given its block range: its
/// blocks', the embedding's on the first stage, the final norm's and the
/// head's on the last (which, for a tied head, is the embedding matrix).
pub fn owned_tensors(
    idx: &ParamIndex,
    n: usize,
    s: usize,
    stages: usize,
    layers: Range<usize>,
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
            layers.contains(&(u - 1))
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
    pub layers: Range<usize>,
    pub schedule: Schedule,
    pub p2p: Box<dyn PointToPoint<B::Buf>>,
    /// All stages of this replica: the gradient norm and the loss are sums over them.
    pub group: Comm<B>,
    /// The first and the last stage (rank 0 and 1), when the head is tied
    /// to the embedding: the embedding gradient is summed over both.
    pub embed: Option<Comm<B>>,
}

impl<B: Backend> Pipe<B> {
    pub fn first(&self) -> bool {
        self.stage == 0
    }
    pub fn last(&self) -> bool {
        self.stage + 1 == self.stages
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

    #[test]
    fn schedules_order_forwards_and_backwards() {
        use Op::{Backward as B, Forward as F};
        // Stage 0 of 4, 6 micro-batches: 3 warm-up forwards.
        let ops = Schedule::OneFOneB.ops(0, 4, 6);
        assert_eq!(
            ops,
            [
                F(0),
                F(1),
                F(2),
                F(3),
                B(0),
                F(4),
                B(1),
                F(5),
                B(2),
                B(3),
                B(4),
                B(5)
            ]
        );
        assert_eq!(Schedule::OneFOneB.ops(3, 4, 2), [F(0), B(0), F(1), B(1)]);
        assert_eq!(Schedule::Gpipe.ops(1, 2, 2), [F(0), F(1), B(0), B(1)]);
        // No pipeline: plain accumulation whatever the schedule.
        assert_eq!(Schedule::Gpipe.ops(0, 1, 2), [F(0), B(0), F(1), B(1)]);
        // Fewer micro-batches than warm-up slots.
        assert_eq!(Schedule::OneFOneB.ops(0, 4, 2), [F(0), F(1), B(0), B(1)]);
        // The most micro-batches held at once is the in-flight count.
        for sched in [Schedule::Gpipe, Schedule::OneFOneB] {
            for (s, stages, k) in [(0, 4, 6), (1, 4, 6), (3, 4, 6), (0, 4, 2), (1, 2, 8)] {
                let mut live: usize = 0;
                let mut most = 0;
                for op in sched.ops(s, stages, k) {
                    match op {
                        Op::Forward(_) => live += 1,
                        Op::Backward(_) => live -= 1,
                    }
                    most = most.max(live);
                }
                assert_eq!(
                    most,
                    sched.in_flight(s, stages, k),
                    "{sched:?} {s} {stages} {k}"
                );
            }
        }
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
