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

use crate::backend::{Backend, DType};
use crate::memory::{Category, OomError};

use super::device::{Device, Tensor};

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
    }
}

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
        Loss::Full => vec![n],
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
