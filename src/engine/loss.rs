//! How the loss meets the head: the whole logits at once, torchtune's
//! chunked cross-entropy, or a fused linear cross-entropy that never builds
//! them.
//!
//! - `full`: the head's matmul writes every token's logits (N x V) and the
//!   loss reads them (Hugging Face's `ForCausalLMLoss`; memfit's engine,
//!   which turns that one buffer into its own gradient in place).
//! - `chunked`: torchtune's `LinearCrossEntropyLoss`
//!   (torchtune/modules/loss/cross_entropy_loss.py, its recipes' default
//!   loss): the final hidden states are split along the sequence into
//!   `loss_chunks` parts (`tensor_split`), and each part is projected,
//!   upcast and reduced on its own, so the fp32 temporaries and the
//!   backward's gradients are a chunk's, not the whole batch's. autograd
//!   still saves every chunk's log-softmax output (fp32) to the backward.
//!   A PyTorch allocation profile: memfit's own engine already holds one
//!   16-bit logits buffer and no fp32 copy, which chunking would not change,
//!   so it is refused there (`validate`).
//! - `fused-linear`: Liger's `LigerFusedLinearCrossEntropyFunction`
//!   (liger_kernel/ops/fused_linear_cross_entropy.py): in the forward, for
//!   each chunk of tokens, the chunk's logits, its loss and their gradient
//!   in place, then the chunk's input gradient (into an N x C buffer) and the
//!   head's weight gradient (accumulated into a weight-sized buffer); both
//!   are saved to the backward, which only hands them on. The chunk is
//!   Liger's: `next_power_of_2(ceil(N / ceil(V / C)))` tokens, so a chunk's
//!   logits are about the size of the head's input. The engine computes
//!   exactly this, on every backend.
//! - `megatron-unfused`: Megatron-Core's cross-entropy without
//!   `--cross-entropy-loss-fusion` (`vocab_parallel_cross_entropy`,
//!   megatron/core/tensor_parallel/cross_entropy.py @ d98e8a6, what
//!   `compute_language_model_loss` calls unless the flag is given). The
//!   whole logits (this rank's vocabulary columns under tensor parallelism),
//!   then `logits.float()`: a 16-bit model's logits are copied to fp32 and
//!   live beside the copy until the loss returns; the max, the in-place
//!   subtraction, the in-place `exp`, the sum and the in-place division each
//!   pass over that fp32 tensor, which is saved as the softmax; the backward
//!   makes it the gradient in place, and autograd casts that fp32 gradient
//!   to the logits' type (the copy ran inside the `autograd.Function`, so
//!   no cast node of its own) before the saved softmax goes. The engine runs the copy, its own loss kernels on
//!   the fp32 tensor and the cast back; the passes its kernel fuses are
//!   charged beside it ([`megatron_unfused`]).

use crate::backend::{Backend, DType};
use crate::memory::{Category, OomError};

use super::device::{Device, Tensor};
use super::framework::Unfused;

type T<B> = Tensor<<B as Backend>::Buf>;

knob_enum! {
    /// How the cross-entropy loss is computed from the head.
    #[serde(rename_all = "kebab-case")]
    pub enum Loss {
        /// Every token's logits at once (Hugging Face's `ForCausalLMLoss`).
        #[default]
        Full,
        /// torchtune's `LinearCrossEntropyLoss`: the sequence in `loss_chunks`
        /// parts, each projected and reduced on its own (hf-eager only).
        Chunked,
        /// Liger's fused linear cross-entropy: logits a chunk of tokens at a
        /// time, the head's gradients made in the forward.
        FusedLinear,
        /// Megatron-Core's default cross-entropy (no
        /// `--cross-entropy-loss-fusion`): the whole logits, copied to fp32,
        /// and the softmax formed over that copy in unfused passes.
        MegatronUnfused,
    }
}

impl Loss {
    /// Whether the loss is computed over the whole logits at once.
    pub fn whole_logits(self) -> bool {
        matches!(self, Loss::Full | Loss::MegatronUnfused)
    }
}

/// What Megatron-Core's unfused cross-entropy launches and moves beyond the
/// kernels the engine runs for it (the fp32 copy, its own loss kernels on
/// that copy, the cast back), over `elems` logits (tokens x this rank's
/// vocabulary columns): `[forward, backward]`.
///
/// Forward (`_VocabParallelCrossEntropy.forward`): `max` reads the fp32
/// logits (4 B an element), `-=` and `exp(out=)` read and write them (8 and
/// 8), `sum` reads them (4) and `div_` reads and writes them (8): 32 B where
/// the engine's forward kernel reads them once (4), so 28 B more; 19 kernels
/// besides the cast (those five; two compares and an `|` for the target
/// mask; `clone` and `-` of the targets; a masked fill's `nonzero` and
/// `index_put`; `arange`; the gather and its `clone`; another masked fill's
/// two; `log` and `-`), where the engine launches one (two with
/// `vocab_parallel`: its statistics, then their combination). Backward
/// (`backward`, `calculate_gradients`): the target's `-=` through an index
/// (gather, subtract, scatter: rows only) and `mul_` by the incoming
/// gradient, which reads and writes them (8 B, as the engine's one backward
/// kernel does), with `arange`, the mask's `float` and `1 -`: 7 kernels
/// where the engine launches one. The three all-reduces
/// over the tensor-parallel group carry a token's worth each; the engine's
/// vocabulary-parallel loss exchanges the same statistics its own way.
pub(super) fn megatron_unfused(elems: usize, vocab_parallel: bool) -> [Unfused; 2] {
    [
        Unfused {
            kernels: 18 - u64::from(vocab_parallel),
            bytes: 28 * elems as u64,
        },
        Unfused {
            kernels: 6,
            bytes: 0,
        },
    ]
}

/// The meter's name for what an unfused loss runs beyond the engine's
/// kernels ([`megatron_unfused`], `HfRules::loss_unfused`).
pub const UNFUSED_OP: &str = "unfused_cross_entropy";

/// torchtune's default `num_output_chunks`.
pub const DEFAULT_CHUNKS: usize = 8;

pub(crate) fn default_chunks() -> usize {
    DEFAULT_CHUNKS
}

/// The rows (tokens) of each part the loss is computed in, in order, for
/// `b` sequences of `t` tokens, a vocabulary of `v` rows in the head's
/// weight and a model width `c`.
pub fn parts(loss: Loss, chunks: usize, b: usize, t: usize, v: usize, c: usize) -> Vec<usize> {
    let n = b * t;
    match loss {
        Loss::Full | Loss::MegatronUnfused => vec![n],
        // `tensor_split(k, dim=1)`: the first `t % k` parts take one more
        // position; empty parts hold nothing.
        Loss::Chunked => {
            let k = chunks.max(1);
            (0..k)
                .map(|i| b * (t / k + usize::from(i < t % k)))
                .filter(|&r| r > 0)
                .collect()
        }
        // Liger: inc_factor = ceil(V / H), chunk_size =
        // min(next_power_of_2(ceil(BT / inc_factor)), BT).
        Loss::FusedLinear => {
            let inc = v.div_ceil(c.max(1)).max(1);
            let size = n.div_ceil(inc).next_power_of_two().min(n).max(1);
            let mut out = vec![size; n / size];
            if !n.is_multiple_of(size) {
                out.push(n % size);
            }
            out
        }
    }
}

/// What the fused loss saves to the backward: the head input's gradient and
/// (unless the head is frozen) its weight's.
pub(super) struct Fused<X> {
    pub dx: X,
    pub dw: Option<X>,
}

/// The fused linear cross-entropy's forward on `x` (N x C, the final norm's
/// output) and the head's weight `w` (Vp x C): every token's loss into
/// `losses`, and the gradients of `x` and `w` for a loss scaled by `dloss`
/// per token. `targets` are the micro-batch's, on the host (`None` on a
/// backend without data); `dw_dtype` is the weight gradient's, `None` for a
/// frozen head; `cap` soft-caps the logits (Gemma 2).
pub(super) fn fused_forward<B: Backend>(
    dev: &mut Device<B>,
    x: &T<B>,
    w: &T<B>,
    targets: Option<&[u32]>,
    losses: &mut T<B>,
    dloss: f32,
    dw_dtype: Option<DType>,
    rows: &[usize],
    (c, v, vp, cap): (usize, usize, usize, Option<f32>),
) -> Result<Fused<T<B>>, OomError> {
    let (act, tmp) = (Category::Activations, Category::Temporaries);
    let dt = x.dtype;
    let n: usize = rows.iter().sum();
    let mut dx = dev.alloc(n * c, dt, act)?;
    let mut dw = match dw_dtype {
        Some(wdt) => Some(dev.alloc_zeroed(vp * c, wdt, act)?),
        None => None,
    };
    let mut off = 0;
    for &r in rows {
        let mut xc = dev.alloc(r * c, dt, tmp)?;
        dev.copy_slice(&mut xc, 0, x, off * c, r * c, false);
        let mut tc = dev.alloc(r, DType::U32, tmp)?;
        if let Some(tg) = targets {
            dev.be.upload_u32(&mut tc.buf, &tg[off..off + r]);
        }
        let mut logits = dev.alloc(r * vp, dt, tmp)?;
        dev.matmul_forward(&mut logits, &xc, w, None, r, c, vp);
        // Gemma 2's final soft cap (Liger's `softcap`), in place.
        if let Some(cap) = cap {
            dev.softcap_forward(&mut logits, r * vp, cap);
        }
        let mut lc = dev.alloc_f32(r, tmp)?;
        dev.crossentropy_forward(&mut lc, &logits, &tc, r, v, vp);
        dev.copy_slice(losses, off, &lc, 0, r, false);
        // Liger's kernel writes the logits' gradient over the logits.
        dev.crossentropy_backward_capped(&mut logits, &tc, dloss, (r, v, vp), cap);
        let mut dxc = dev.alloc(r * c, dt, tmp)?;
        dev.matmul_backward(&mut dxc, dw.as_mut(), None, &logits, &xc, w, r, c, vp);
        dev.copy_slice(&mut dx, off * c, &dxc, 0, r * c, false);
        for t in [xc, tc, logits, lc, dxc] {
            dev.free(t);
        }
        off += r;
    }
    Ok(Fused { dx, dw })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_parts_split_the_sequence_as_tensor_split_does() {
        // 10 positions in 4 parts: 3, 3, 2, 2 positions, times 2 sequences.
        assert_eq!(parts(Loss::Chunked, 4, 2, 10, 100, 8), vec![6, 6, 4, 4]);
        // More parts than positions: the empty ones hold nothing.
        assert_eq!(parts(Loss::Chunked, 8, 1, 3, 100, 8), vec![1, 1, 1]);
        assert_eq!(parts(Loss::Full, 8, 2, 10, 100, 8), vec![20]);
    }

    #[test]
    fn fused_parts_follow_ligers_chunk_size() {
        // Liger's own example: BT = 4096*4, V = 32000, H = 4096: inc_factor
        // 8, chunk_size 2048.
        let p = parts(Loss::FusedLinear, 0, 4, 4096, 32000, 4096);
        assert_eq!((p.len(), p[0]), (8, 2048));
        // Llama-3 (V 128256, H 4096) at 2 x 2048 tokens: inc 32, 128 rows.
        let p = parts(Loss::FusedLinear, 0, 2, 2048, 128256, 4096);
        assert_eq!((p.len(), p[0]), (32, 128));
        // A vocabulary narrower than the model: one chunk of every token.
        assert_eq!(parts(Loss::FusedLinear, 0, 3, 5, 16, 64), vec![15]);
        // Not a multiple: the last chunk holds the rest.
        assert_eq!(
            parts(Loss::FusedLinear, 0, 1, 100, 400, 100),
            vec![32, 32, 32, 4]
        );
    }
}
