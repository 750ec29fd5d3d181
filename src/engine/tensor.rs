//! Tensor parallelism as Megatron-LM splits a transformer block (Shoeybi et
//! al., Megatron-LM: Training Multi-Billion Parameter Language Models Using
//! Model Parallelism, 2019, section 3).
//!
//! A group of `T` ranks holds one replica of the model between them:
//! - the q|k|v projection is split by heads (column-parallel: rank `r` holds
//!   query heads `r*H/T ..` and the matching key/value heads, `H/T` and
//!   `K/T` of them), so attention runs on local heads with no communication;
//! - the output projection is split by its input columns (row-parallel): each
//!   rank's product is a partial sum, all-reduced over the group before the
//!   residual add (Megatron's `g` operator), and its bias is added once;
//! - the MLP likewise: the up (or fused gate|up) projection column-parallel,
//!   the down projection row-parallel, one all-reduce;
//! - in the backward, the gradient flowing into each block's norm output is
//!   a partial sum over the column-parallel layers' inputs and is all-reduced
//!   (Megatron's `f` operator), so two all-reduces of `N x C` per block each
//!   way, four per block and step (six with the forward recomputed).
//!
//! The embedding and the head are vocabulary-parallel (Megatron's
//! `VocabParallelEmbedding` and `vocab_parallel_cross_entropy`): each rank
//! holds `V/T` rows of the padded table; the embedding looks up the tokens
//! in its rows (0 for the others) and the group all-reduces the parts; the
//! head computes its columns of the logits, and the loss combines every
//! rank's per-token max and sum of exponentials (all-gathered, `N x 2` floats
//! each) with the target's logit (all-reduced), so the full logits are never
//! built; the gradient of the head's input is all-reduced.
//!
//! Norms (and gpt2's position embedding) are replicated, as in Megatron
//! without sequence parallelism: their gradients come out identical on
//! every rank of the group, so they need no communication and the global
//! gradient norm counts them once.
//!
//! Every rank initialises the full seeded tensors and keeps its slice, so a
//! `T`-way job starts from the weights one rank starts from and trains as it
//! does, up to the order of the partial sums.

use super::device::{Comm, Device, Tensor};
use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::config::model::{ParamIndex, ParamSpec};
use crate::memory::{Category, OomError};

/// One rank's place in its tensor-parallel group.
pub struct Tp<B: Backend> {
    pub comm: Comm<B>,
    /// How each tensor is split (`None`: replicated).
    pub splits: Vec<Option<Split>>,
    /// Sequence parallelism: between the split projections, each rank keeps
    /// only its `1/T` of the tokens.
    pub sp: bool,
}

impl Tp<crate::backend::meta::MetaBackend> {
    /// A copy for a forked planning engine (`Engine::reshaped`).
    pub fn fork(&self) -> Option<Self> {
        Some(Tp {
            comm: self.comm.fork()?,
            splits: self.splits.clone(),
            sp: self.sp,
        })
    }
}

impl<B: Backend> Tp<B> {
    pub fn size(&self) -> usize {
        self.comm.world()
    }
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// `t = the sum of t over the group`, priced as a collective among
    /// adjacent ranks (the group is placed first, Megatron's order).
    pub fn all_reduce(&mut self, dev: &mut Device<B>, t: &mut Tensor<B::Buf>) {
        dev.critical(|dev| dev.all_reduce(&mut *self.comm, t));
    }

    /// `out` = every rank's `inp`, rank after rank, among adjacent ranks.
    pub fn all_gather(
        &mut self,
        dev: &mut Device<B>,
        out: &mut Tensor<B::Buf>,
        inp: &Tensor<B::Buf>,
    ) {
        dev.critical(|dev| dev.all_gather(&mut *self.comm, out, inp));
    }

    /// Tokens this rank keeps of a micro-batch's `n` between the split
    /// projections: `n / T` under sequence parallelism, else all.
    pub fn rows(&self, n: usize) -> usize {
        match self.sp {
            true => n / self.size(),
            false => n,
        }
    }

    /// Sequence parallelism: `local` (this rank's tokens) gathered into a
    /// new buffer of every rank's (Megatron's `g`), which the caller frees;
    /// `None` without it (every rank already has every token).
    pub fn gather(
        &mut self,
        dev: &mut Device<B>,
        local: &Tensor<B::Buf>,
    ) -> Result<Option<Tensor<B::Buf>>, OomError> {
        if !self.sp {
            return Ok(None);
        }
        let mut full = dev.alloc(
            local.len * self.size(),
            local.dtype,
            Category::Communication,
        )?;
        self.all_gather(dev, &mut full, local);
        Ok(Some(full))
    }

    /// A row-parallel output's partial sums over every token, summed over
    /// the group: all-reduced in place, or under sequence parallelism
    /// reduce-scattered into this rank's tokens (a new buffer of `t`'s
    /// category; `t` is freed).
    pub fn reduce(
        &mut self,
        dev: &mut Device<B>,
        mut t: Tensor<B::Buf>,
    ) -> Result<Tensor<B::Buf>, OomError> {
        if !self.sp {
            self.all_reduce(dev, &mut t);
            return Ok(t);
        }
        let mut out = dev.alloc(t.len / self.size(), t.dtype, t.category)?;
        dev.critical(|dev| dev.reduce_scatter(&mut *self.comm, &mut out, &t));
        dev.free(t);
        Ok(out)
    }

    /// This rank's part of the (padded) vocabulary: `(lo, real, padded)`,
    /// its first row, how many of its rows are real tokens (the last ranks
    /// may hold only padding) and how many it holds.
    pub fn vocab(&self, model: &ModelConfig) -> (usize, usize, usize) {
        let rows = model.padded_vocab() / self.size();
        let lo = self.rank() * rows;
        (lo, model.vocab_size.saturating_sub(lo).min(rows), rows)
    }
}

/// How one tensor is split over the group: the part rank `r` keeps, as
/// rows or columns of its row-major `(rows, cols)` shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Split {
    /// These row ranges `(start, len)`, concatenated (a 1-D tensor has
    /// `cols == 1`).
    Rows {
        cols: usize,
        parts: Vec<(usize, usize)>,
    },
    /// Columns `start .. start + len` of every one of `rows` rows.
    Cols {
        rows: usize,
        cols: usize,
        start: usize,
        len: usize,
    },
}

impl Split {
    /// Elements of the local part.
    pub fn numel(&self) -> usize {
        match self {
            Split::Rows { cols, parts } => parts.iter().map(|p| p.1 * cols).sum(),
            Split::Cols { rows, len, .. } => rows * len,
        }
    }

    /// The local part of the full tensor `full`.
    pub fn take(&self, full: &[f32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.numel());
        match self {
            Split::Rows { cols, parts } => {
                for &(s, n) in parts {
                    out.extend_from_slice(&full[s * cols..(s + n) * cols]);
                }
            }
            Split::Cols {
                rows,
                cols,
                start,
                len,
            } => {
                for r in 0..*rows {
                    out.extend_from_slice(&full[r * cols + start..][..*len]);
                }
            }
        }
        out
    }

    /// Writes the local part `part` back into its place in `full` (the
    /// inverse of [`Split::take`]).
    pub fn put(&self, full: &mut [f32], part: &[f32]) {
        assert_eq!(part.len(), self.numel(), "one rank's part");
        match self {
            Split::Rows { cols, parts } => {
                let mut at = 0;
                for &(s, n) in parts {
                    full[s * cols..(s + n) * cols].copy_from_slice(&part[at..at + n * cols]);
                    at += n * cols;
                }
            }
            Split::Cols {
                rows,
                cols,
                start,
                len,
            } => {
                for r in 0..*rows {
                    full[r * cols + start..][..*len].copy_from_slice(&part[r * len..][..*len]);
                }
            }
        }
    }
}

/// Rank `rank`'s rows of `n` stacked MLPs of inner width `dff` (the up,
/// or with `fused` the gate|up, projection): the same `dff / size` slice
/// of each (of each half).
fn mlp_rows(dff: usize, n: usize, fused: bool, size: usize, rank: usize) -> Vec<(usize, usize)> {
    let il = dff / size;
    let halves = if fused { 2 } else { 1 };
    (0..n * halves).map(|h| (h * dff + rank * il, il)).collect()
}

/// Rank `rank`'s columns of a down projection `(rows, dff)` (stacked
/// experts: `rows` is `E · C`).
fn mlp_cols(rows: usize, dff: usize, size: usize, rank: usize) -> Split {
    let il = dff / size;
    Split::Cols {
        rows,
        cols: dff,
        start: rank * il,
        len: il,
    }
}

/// One rank's widths of the split projections, per token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Widths {
    /// The q|k|v projection's output (its local heads').
    pub qkv: usize,
    /// The up (gpt2) or fused gate|up (llama) projection's output.
    pub up: usize,
    /// The MLP's hidden width (the down projection's input).
    pub dff: usize,
    /// The attention output (the o-projection's input): local heads x head_dim.
    pub attn: usize,
}

/// Widths on one rank of a `size`-way group (1: the whole model).
pub fn widths(model: &ModelConfig, size: usize) -> Widths {
    Widths {
        qkv: model.qkv_width() / size,
        up: model.up_width() / size,
        dff: model.d_ff() / size,
        attn: model.n_head / size * model.head_dim(),
    }
}

/// Why `model` cannot be split `size` ways, naming the dimension that does
/// not divide (`None`: it can).
pub fn check(model: &ModelConfig, size: usize) -> Option<String> {
    if size <= 1 {
        return None;
    }
    let moe = model.moe.as_ref();
    let dims = [
        ("attention heads (n_head)", model.n_head),
        ("key/value heads (n_kv_head)", model.n_kv_head()),
        ("MLP width (d_ff)", model.d_ff()),
        (
            "experts' width (moe.d_expert)",
            moe.map_or(0, |m| m.d_expert),
        ),
        (
            "shared expert's width (moe.d_shared)",
            moe.map_or(0, |m| m.d_shared),
        ),
        (
            "vocabulary rows (vocab_size padded to pad_vocab_to)",
            model.padded_vocab(),
        ),
    ];
    dims.iter().find(|(_, d)| d % size != 0).map(|(what, d)| {
        format!(
            "tensor parallelism splits the {what} over the ranks of a group, but {d} is not a multiple of {size}"
        )
    })
}

/// Turns `specs` into rank `rank`'s shapes of a `size`-way split and says
/// how each tensor was split (`None`: replicated).
pub fn split_layout(
    model: &ModelConfig,
    specs: &mut [ParamSpec],
    idx: &ParamIndex,
    size: usize,
    rank: usize,
) -> Vec<Option<Split>> {
    let mut splits = vec![None; specs.len()];
    if size <= 1 {
        return splits;
    }
    let (c, hd) = (model.d_model, model.head_dim());
    let (h, k) = (model.n_head, model.n_kv_head());
    let (hl, kl) = (h / size, k / size);
    // q|k|v rows: this rank's query heads, then its key and value heads.
    let qkv = [
        (rank * hl * hd, hl * hd),
        (h * hd + rank * kl * hd, kl * hd),
        ((h + k) * hd + rank * kl * hd, kl * hd),
    ];
    let rows = |cols: usize, parts: &[(usize, usize)]| Split::Rows {
        cols,
        parts: parts.to_vec(),
    };
    let fused = model.up_width() != model.d_ff();
    for (l, b) in idx.blocks.iter().enumerate() {
        splits[b.qkv_w] = Some(rows(c, &qkv));
        if let Some(i) = b.qkv_b {
            splits[i] = Some(rows(1, &qkv));
        }
        splits[b.o_w] = Some(Split::Cols {
            rows: c,
            cols: model.attn_width(),
            start: rank * hl * hd,
            len: hl * hd,
        });
        // The dense MLP, or a routed block's shared expert (if any).
        if let (Some(up_w), Some(down_w), Some(dff)) = (b.up_w, b.down_w, model.dense_ff(l)) {
            let up = mlp_rows(dff, 1, fused, size, rank);
            splits[up_w] = Some(rows(c, &up));
            if let Some(i) = b.up_b {
                splits[i] = Some(rows(1, &up));
            }
            splits[down_w] = Some(mlp_cols(c, dff, size, rank));
        }
        // Every routed expert split as the dense MLP is (Megatron-Core's
        // expert tensor parallelism at its default, the TP size): the
        // same slice of each expert's gate and up, its columns of down.
        if let (Some(mi), Some(m)) = (b.moe, model.moe_at(l)) {
            let (e, i) = (m.n_experts, m.d_expert);
            splits[mi.up] = Some(rows(c, &mlp_rows(i, e, true, size, rank)));
            splits[mi.down] = Some(mlp_cols(e * c, i, size, rank));
        }
    }
    // The vocabulary-parallel embedding and head: rows of the padded table.
    let vrows = model.padded_vocab() / size;
    for i in std::iter::once(idx.wte).chain(idx.lm_head) {
        splits[i] = Some(rows(c, &[(rank * vrows, vrows)]));
    }
    for (spec, split) in specs.iter_mut().zip(&splits) {
        if spec.shape.len() == 3 {
            // A stacked expert tensor stays `(E, rows, cols)`, its rows or
            // columns split (expert parallelism then takes whole experts).
            let [e, r, c] = [spec.shape[0], spec.shape[1], spec.shape[2]];
            spec.shape = match split {
                Some(Split::Rows { .. }) => vec![e, r / size, c],
                Some(Split::Cols { .. }) => vec![e, r, c / size],
                None => continue,
            };
            continue;
        }
        match split {
            Some(Split::Rows { cols, parts }) => {
                let n: usize = parts.iter().map(|p| p.1).sum();
                spec.shape = match *cols {
                    1 => vec![n],
                    _ => vec![n, *cols],
                };
            }
            Some(Split::Cols { rows, len, .. }) => spec.shape = vec![*rows, *len],
            None => {}
        }
    }
    splits
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::profile::load_model;

    #[test]
    fn parts_tile_every_tensor_once() {
        for name in ["gpt2-tiny", "llama-tiny", "moe-tiny"] {
            let model = load_model(name).unwrap();
            let (full, idx) = model.param_layout();
            let size = 2;
            let init: Vec<Vec<f32>> = full
                .iter()
                .map(|s| (0..s.numel()).map(|x| x as f32).collect())
                .collect();
            let mut back: Vec<Vec<f32>> = full.iter().map(|s| vec![-1.0; s.numel()]).collect();
            let mut local_total = 0;
            for rank in 0..size {
                let mut specs = full.clone();
                let splits = split_layout(&model, &mut specs, &idx, size, rank);
                for (i, split) in splits.iter().enumerate() {
                    let Some(s) = split else {
                        assert_eq!(specs[i].shape, full[i].shape);
                        continue;
                    };
                    assert_eq!(specs[i].numel(), s.numel(), "{}", specs[i].name);
                    assert_eq!(specs[i].numel() * size, full[i].numel());
                    local_total += s.numel();
                    s.put(&mut back[i], &s.take(&init[i]));
                }
            }
            for (i, s) in full.iter().enumerate() {
                assert_eq!(back[i].len(), s.numel());
                if back[i].iter().any(|&x| x < 0.0) {
                    // Replicated: never written back.
                    continue;
                }
                assert_eq!(back[i], init[i], "{} reassembles", s.name);
            }
            assert!(local_total > 0);
        }
    }

    #[test]
    fn widths_and_divisibility() {
        let model = load_model("llama-tiny").unwrap();
        let w = widths(&model, 1);
        assert_eq!(w.qkv, model.qkv_width());
        assert_eq!(w.attn, model.d_model);
        let h = model.n_head;
        let bad = (2..=h + 1).find(|t| !h.is_multiple_of(*t)).unwrap();
        let msg = check(&model, bad).expect("not a divisor");
        assert!(msg.contains("n_head"), "{msg}");
        assert!(check(&model, 1).is_none());
    }
}
