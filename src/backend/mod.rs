//! The compute backends behind one trait.
//!
//! The engine owns the schedule: it decides what to allocate, in which category,
//! and which op runs when. A backend only stores buffers and runs ops on them.
//! That is why the engine's memory accounting is identical on every backend.
//!
//! * [`cpu::CpuBackend`] computes for real, multithreaded, GEMMs through the `gemm` crate.
//! * [`cuda::CudaBackend`] computes on an NVIDIA GPU: `Buf` is a device
//!   allocation, ops launch NVRTC-compiled kernels on the backend's stream,
//!   `gemm`-shaped ops map onto cuBLAS, and downloads (and `synchronize`)
//!   are the only host syncs. The same code runs on an emulated GPU in tests.
//! * [`meta::MetaBackend`] stores nothing and computes nothing; its buffers are
//!   `()`. It declares the workspace of the backend it predicts.
//!
//! Ops follow the llm.c convention: flat buffers, shapes passed explicitly, and
//! the shape of every argument in the doc comment. Linear weights use PyTorch's
//! `(out_features, in_features)` layout.

pub mod cpu;
pub mod cuda;
pub mod meta;

use std::fmt;

use serde::Serialize;

/// Element type of a device buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    /// bfloat16: fp32's exponent range, 8 bits of mantissa (mixed precision).
    Bf16,
    /// IEEE half: 5-bit exponent, max 65504 (mixed precision with loss scaling).
    F16,
    /// Token ids.
    U32,
    /// Quantised optimizer state (8-bit AdamW).
    U8,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::Bf16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }
}

/// [`Backend::copy_cols`] on host slices.
pub fn copy_cols_host(
    dst: &mut [f32],
    dst_cols: usize,
    dst_off: usize,
    src: &[f32],
    src_cols: usize,
    src_off: usize,
    rows: usize,
    width: usize,
    scale: f32,
    accumulate: bool,
) {
    for i in 0..rows {
        let d = &mut dst[i * dst_cols + dst_off..][..width];
        let s = &src[i * src_cols + src_off..][..width];
        for (d, &s) in d.iter_mut().zip(s) {
            *d = if accumulate {
                *d + scale * s
            } else {
                scale * s
            };
        }
    }
}

/// Shape of one attention call: `B` sequences of `T` tokens, `n_head` query heads,
/// `n_kv_head` key/value heads (grouped-query attention when fewer), `head_dim` each.
/// The packed `qkv` layout per token is `[q: n_head*hd | k: n_kv_head*hd | v: n_kv_head*hd]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub b: usize,
    pub t: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
}

impl AttnShape {
    /// Width of one token's packed q|k|v row.
    pub fn qkv_width(&self) -> usize {
        (self.n_head + 2 * self.n_kv_head) * self.head_dim
    }
    /// Width of the attention output row (all query heads).
    pub fn out_width(&self) -> usize {
        self.n_head * self.head_dim
    }
}

/// What Gemma changes in attention ([`Backend::attention_forward_with`]):
/// the scores' scale, a soft cap on them, and a sliding window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnOpts {
    /// The scores are `scale · q·k` (`head_dim ** -0.5` by default;
    /// Gemma: `query_pre_attn_scalar ** -0.5`).
    pub scale: f32,
    /// Scores become `cap · tanh(s / cap)` before the mask and the softmax.
    pub softcap: Option<f32>,
    /// Query `i` sees keys `i + 1 - window ..= i` only.
    pub window: Option<usize>,
}

impl AttnOpts {
    /// Plain causal attention scaled by `head_dim ** -0.5`.
    pub fn standard(s: AttnShape) -> Self {
        AttnOpts {
            scale: 1.0 / (s.head_dim as f32).sqrt(),
            softcap: None,
            window: None,
        }
    }

    /// Whether these are [`AttnOpts::standard`]'s (a window as long as the
    /// sequence masks nothing), so the plain kernels run.
    pub fn is_standard(&self, s: AttnShape) -> bool {
        self.scale == AttnOpts::standard(s).scale
            && self.softcap.is_none()
            && self.window.is_none_or(|w| w >= s.t)
    }
}

/// A backend without Gemma's kernels is never asked for them:
/// `run::validate` refuses Gemma on it first.
fn no_gemma_kernels(backend: &str) -> ! {
    unreachable!("{backend}: no Gemma kernels (run::validate refuses Gemma there)")
}

/// A backend without the mixture-of-experts kernels is never asked for
/// them: `engine::validate` refuses experts on it first.
fn no_expert_kernels(backend: &str) -> ! {
    unreachable!("{backend}: no expert kernels (engine::validate refuses experts)")
}

/// The kernel ops of [`Backend`]: every method that meta implements as
/// doing nothing, each signature (and doc) written once, here. The list is
/// handed to `$callback`, a macro that turns it into items: the trait
/// declares the ops through `declare_kernel_ops`, and meta's impl is
/// `noop_kernel_ops` (in `meta.rs`), so meta spells no kernel's parameters.
/// Why a callback: `macro_rules!` cannot name a trait's methods from outside,
/// so the one list has to be the macro that both uses expand. Methods with a
/// real answer on meta (`alloc`, `workspace_bytes`, `download_f32`,
/// `sum_squares`, ...) stay written out in the trait. An entry is `fn
/// name(&mut self, arg: Type, ...)` then `;` or a default body.
macro_rules! kernel_ops {
    ($callback:ident) => {
        $callback! {
            fn upload_f32(&mut self, dst: &mut Self::Buf, src: &[f32]);

            fn upload_u32(&mut self, dst: &mut Self::Buf, src: &[u32]);

            /// `dst (N) = src (N)` converted to `dst`'s element type (round to nearest
            /// even when narrowing): fp32 master weights to 16-bit working weights.
            fn convert(&mut self, dst: &mut Self::Buf, src: &Self::Buf, n: usize);

            /// `dst[dst_off..dst_off + n] = src[src_off..src_off + n]` (or `+=` when
            /// `accumulate`), converted to `dst`'s element type and rounded once:
            /// shard extraction, and the copy-in and copy-out around collectives.
            fn copy_slice(
                &mut self,
                dst: &mut Self::Buf,
                dst_off: usize,
                src: &Self::Buf,
                src_off: usize,
                n: usize,
                accumulate: bool,
            );

            /// A block of columns between row-major matrices of `rows` rows:
            /// `dst[i][dst_off..][..width] (+)= scale * src[i][src_off..][..width]`,
            /// rows `dst_cols` and `src_cols` wide (`+=` when `accumulate`), in
            /// `dst`'s dtype, computed in fp32 and rounded once. LoRA adds an
            /// adapter's output into its slice of a fused projection and reads its
            /// gradient back out. This default stages both through the host.
            fn copy_cols(
                &mut self,
                dst: &mut Self::Buf,
                dst_cols: usize,
                dst_off: usize,
                src: &Self::Buf,
                src_cols: usize,
                src_off: usize,
                rows: usize,
                width: usize,
                scale: f32,
                accumulate: bool,
            ) {
                let (Some(mut d), Some(s)) = (self.download_f32(dst), self.download_f32(src)) else {
                    return;
                };
                copy_cols_host(
                    &mut d, dst_cols, dst_off, &s, src_cols, src_off, rows, width, scale, accumulate,
                );
                self.upload_f32(dst, &d);
            }

            /// Raw bytes into a `U8` buffer (an NF4 weight in `nf4::Nf4::to_bytes`'s
            /// layout). Only called where [`Backend::reads_nf4`].
            fn upload_u8(&mut self, _dst: &mut Self::Buf, _src: &[u8]) {}
            /// `out (numel)` = the NF4 weight in `src` dequantised, in `out`'s dtype
            /// (rounded once). Only called where [`Backend::reads_nf4`].
            fn nf4_dequantize(&mut self, _out: &mut Self::Buf, _src: &Self::Buf, _numel: usize) {}
            fn fill(&mut self, buf: &mut Self::Buf, value: f32);

            /// [`Backend::embed_forward`], or with `part: Some(lo)` a
            /// vocabulary-parallel embedding's part (Megatron's
            /// `VocabParallelEmbedding`): `wte` holds the table's rows `lo ..
            /// lo + rows`; `out (N,C) = wte[tokens - lo]` for the tokens in that
            /// range, 0 for the others (the group's all-reduce adds the parts), plus
            /// `wpe[pos]` when given. Without a part every token must be in `wte`.
            fn embed_forward_rows(
                &mut self,
                out: &mut Self::Buf,
                tokens: &Self::Buf,
                wte: &Self::Buf,
                wpe: Option<&Self::Buf>,
                n: usize,
                t: usize,
                c: usize,
                part: Option<usize>,
            );

            /// [`Backend::embed_backward`], or a part's: `dwte[tokens - lo] +=
            /// dout` for the tokens in its rows (others skipped), `dwpe[pos] +=
            /// dout` when given.
            fn embed_backward_rows(
                &mut self,
                dwte: &mut Self::Buf,
                dwpe: Option<&mut Self::Buf>,
                dout: &Self::Buf,
                tokens: &Self::Buf,
                n: usize,
                t: usize,
                c: usize,
                part: Option<usize>,
            );

            /// LayerNorm over the last dim: `out (N,C)`, saves `mean (N)`, `rstd (N)`; `b` is optional.
            fn layernorm_forward(
                &mut self,
                out: &mut Self::Buf,
                mean: &mut Self::Buf,
                rstd: &mut Self::Buf,
                inp: &Self::Buf,
                w: &Self::Buf,
                b: Option<&Self::Buf>,
                n: usize,
                c: usize,
                eps: f32,
            );

            /// Accumulates `dinp += ...`, `dw += ...`, `db += ...`.
            fn layernorm_backward(
                &mut self,
                dinp: &mut Self::Buf,
                dw: &mut Self::Buf,
                db: Option<&mut Self::Buf>,
                dout: &Self::Buf,
                inp: &Self::Buf,
                w: &Self::Buf,
                mean: &Self::Buf,
                rstd: &Self::Buf,
                n: usize,
                c: usize,
            );

            /// RMSNorm: `out (N,C) = inp * rstd * w`, saves `rstd (N)`.
            fn rmsnorm_forward(
                &mut self,
                out: &mut Self::Buf,
                rstd: &mut Self::Buf,
                inp: &Self::Buf,
                w: &Self::Buf,
                n: usize,
                c: usize,
                eps: f32,
            );

            /// Accumulates `dinp += ...`, `dw += ...`.
            fn rmsnorm_backward(
                &mut self,
                dinp: &mut Self::Buf,
                dw: &mut Self::Buf,
                dout: &Self::Buf,
                inp: &Self::Buf,
                w: &Self::Buf,
                rstd: &Self::Buf,
                n: usize,
                c: usize,
            );

            /// `out (N,OC) = inp (N,C) @ w (OC,C)^T + bias (OC)`.
            fn matmul_forward(
                &mut self,
                out: &mut Self::Buf,
                inp: &Self::Buf,
                w: &Self::Buf,
                bias: Option<&Self::Buf>,
                n: usize,
                c: usize,
                oc: usize,
            );

            /// `dinp (N,C) = dout @ w` (overwrites), `dw (OC,C) += dout^T @ inp`, `dbias (OC) += sum_rows dout`.
            /// Without `dw` (a frozen weight) only `dinp` is computed, and `dbias` is ignored.
            fn matmul_backward(
                &mut self,
                dinp: &mut Self::Buf,
                dw: Option<&mut Self::Buf>,
                dbias: Option<&mut Self::Buf>,
                dout: &Self::Buf,
                inp: &Self::Buf,
                w: &Self::Buf,
                n: usize,
                c: usize,
                oc: usize,
            );

            /// tanh-approximated GELU, `out (N) = gelu(inp)`.
            fn gelu_forward(&mut self, out: &mut Self::Buf, inp: &Self::Buf, n: usize);

            /// In place: `dout := dout * gelu'(inp)`.
            fn gelu_backward(&mut self, dout: &mut Self::Buf, inp: &Self::Buf, n: usize);

            /// SwiGLU: `out (N,I) = silu(gu[:, :I]) * gu[:, I:]`, `gu (N,2I)`.
            fn swiglu_forward(&mut self, out: &mut Self::Buf, gu: &Self::Buf, n: usize, i: usize);

            /// `dgu (N,2I)` from `dout (N,I)` (overwrites).
            fn swiglu_backward(
                &mut self,
                dgu: &mut Self::Buf,
                dout: &Self::Buf,
                gu: &Self::Buf,
                n: usize,
                i: usize,
            );

            /// In place: `gu (N,2I)` becomes its own gradient from `dout
            /// (N,I)`, as Liger's SwiGLU backward writes d gate and d up
            /// into gate and up (each element is read before it is written).
            fn swiglu_backward_in_place(
                &mut self,
                gu: &mut Self::Buf,
                dout: &Self::Buf,
                n: usize,
                i: usize,
            );

            /// `out (N) = a + b`.
            fn add(&mut self, out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf, n: usize);

            /// Rotary embedding in place on the q and k parts of `qkv (B,T,qkv_width)`,
            /// HF "rotate_half" pairing (i, i + hd/2), frequencies `theta^(-2i/hd)`.
            fn rope_forward(&mut self, qkv: &mut Self::Buf, s: AttnShape, theta: f32);

            /// In place: rotates the q and k gradients back (the inverse rotation).
            fn rope_backward(&mut self, dqkv: &mut Self::Buf, s: AttnShape, theta: f32);

            /// Eager causal attention: saves the probabilities `att (B,H,T,T)`,
            /// writes `out (B,T,H*hd)` from `qkv (B,T,qkv_width)`.
            fn attention_forward(
                &mut self,
                out: &mut Self::Buf,
                att: &mut Self::Buf,
                qkv: &Self::Buf,
                s: AttnShape,
            );

            /// `dqkv (B,T,qkv_width)` (overwrites) from `dout (B,T,H*hd)`; `datt (B,H,T,T)` is scratch.
            fn attention_backward(
                &mut self,
                dqkv: &mut Self::Buf,
                datt: &mut Self::Buf,
                dout: &Self::Buf,
                qkv: &Self::Buf,
                att: &Self::Buf,
                s: AttnShape,
            );

            /// Flash-style causal attention (Dao et al., FlashAttention, 2022): keys and
            /// values in tiles with an online softmax, so nothing T x T is stored. Writes
            /// `out (B,T,H*hd)` and saves only the per-row log-sum-exp of the scaled
            /// scores, `lse (B,H,T)`. `ws` is the declared workspace (scratch for tiles).
            fn flash_attention_forward(
                &mut self,
                out: &mut Self::Buf,
                lse: &mut Self::Buf,
                qkv: &Self::Buf,
                ws: &mut Self::Buf,
                s: AttnShape,
            );

            /// Backward of [`Backend::flash_attention_forward`]: recomputes the
            /// probabilities tile by tile from `lse`; writes `dqkv` (overwrites).
            fn flash_attention_backward(
                &mut self,
                dqkv: &mut Self::Buf,
                dout: &Self::Buf,
                out: &Self::Buf,
                lse: &Self::Buf,
                qkv: &Self::Buf,
                ws: &mut Self::Buf,
                s: AttnShape,
            );

            /// Cross-entropy over the first `v` of `vp` columns of `logits (N,Vp)`:
            /// `losses (N) = logsumexp(logits) - logits[target]`.
            fn crossentropy_forward(
                &mut self,
                losses: &mut Self::Buf,
                logits: &Self::Buf,
                targets: &Self::Buf,
                n: usize,
                v: usize,
                vp: usize,
            );

            /// In place: `logits := dloss * (softmax(logits) - onehot(target))`, padded columns 0.
            fn crossentropy_backward(
                &mut self,
                logits: &mut Self::Buf,
                targets: &Self::Buf,
                dloss: f32,
                n: usize,
                v: usize,
                vp: usize,
            );

            /// Vocabulary-parallel cross-entropy (Megatron's
            /// `vocab_parallel_cross_entropy`), step 1 on one part: `logits (N,Vp)`
            /// are the columns `lo ..` of the vocabulary, the first `v` of them real
            /// (`v` may be 0). Per row: `stats (N,2) = [max, sum exp(x - max)]` over
            /// the real columns (`[-inf, 0]` without any), and `tgt (N)` = the
            /// target's logit when the target is in this part, else 0. All fp32.
            fn crossentropy_part_stats(
                &mut self,
                stats: &mut Self::Buf,
                tgt: &mut Self::Buf,
                logits: &Self::Buf,
                targets: &Self::Buf,
                n: usize,
                lo: usize,
                v: usize,
                vp: usize,
            );

            /// Step 2: from every part's stats, gathered rank after rank into
            /// `stats (parts,N,2)`, and the summed target logits `tgt (N)`:
            /// `lse (N) = M + ln(sum_r s_r exp(m_r - M))` with `M = max_r m_r`, and
            /// `losses (N) = lse - tgt` (the sum in f64).
            fn crossentropy_combine(
                &mut self,
                losses: &mut Self::Buf,
                lse: &mut Self::Buf,
                stats: &Self::Buf,
                tgt: &Self::Buf,
                n: usize,
                parts: usize,
            );

            /// Step 3, in place on the part: `logits := dloss * exp(logits - lse) -
            /// dloss * [lo + j == target]` over the real columns, padding 0.
            fn crossentropy_part_backward(
                &mut self,
                logits: &mut Self::Buf,
                lse: &Self::Buf,
                targets: &Self::Buf,
                dloss: f32,
                n: usize,
                lo: usize,
                v: usize,
                vp: usize,
            );


            // ---- Gemma 2 and 3 -----------------------------------------------------
            // Only cpu and meta have these; `run::validate` refuses Gemma on cuda.

            /// RMSNorm with weight `1 + w` (Gemma's): `out (N,C) = inp * rstd *
            /// (1 + w)`, saves `rstd (N)`.
            fn gemma_rmsnorm_forward(
                &mut self,
                _out: &mut Self::Buf,
                _rstd: &mut Self::Buf,
                _inp: &Self::Buf,
                _w: &Self::Buf,
                _n: usize,
                _c: usize,
                _eps: f32,
            ) {
                no_gemma_kernels(self.name())
            }

            /// Accumulates `dinp += ...`, `dw += ...` (as for `w` alone).
            fn gemma_rmsnorm_backward(
                &mut self,
                _dinp: &mut Self::Buf,
                _dw: &mut Self::Buf,
                _dout: &Self::Buf,
                _inp: &Self::Buf,
                _w: &Self::Buf,
                _rstd: &Self::Buf,
                _n: usize,
                _c: usize,
            ) {
                no_gemma_kernels(self.name())
            }

            /// GeGLU: `out (N,I) = gelu_tanh(gu[:, :I]) * gu[:, I:]`, `gu (N,2I)`.
            fn geglu_forward(&mut self, _out: &mut Self::Buf, _gu: &Self::Buf, _n: usize, _i: usize) {
                no_gemma_kernels(self.name())
            }

            /// `dgu (N,2I)` from `dout (N,I)` (overwrites).
            fn geglu_backward(
                &mut self,
                _dgu: &mut Self::Buf,
                _dout: &Self::Buf,
                _gu: &Self::Buf,
                _n: usize,
                _i: usize,
            ) {
                no_gemma_kernels(self.name())
            }

            /// In place: `x (N) *= factor`, rounded once to `x`'s type.
            fn scale(&mut self, _x: &mut Self::Buf, _n: usize, _factor: f32) {
                no_gemma_kernels(self.name())
            }

            /// In place: `x (N) = cap · tanh(x / cap)`.
            fn softcap_forward(&mut self, _x: &mut Self::Buf, _n: usize, _cap: f32) {
                no_gemma_kernels(self.name())
            }

            /// [`Backend::crossentropy_backward`] of logits soft-capped by `cap`:
            /// `logits` hold the capped `y`, and become the gradient of the
            /// logits before the cap, `dloss · (softmax(y) - onehot) · (1 - (y/cap)²)`.
            fn crossentropy_softcap_backward(
                &mut self,
                _logits: &mut Self::Buf,
                _targets: &Self::Buf,
                _dloss: f32,
                _n: usize,
                _v: usize,
                _vp: usize,
                _cap: f32,
            ) {
                no_gemma_kernels(self.name())
            }

            /// [`Backend::attention_forward`] with [`AttnOpts`]; with a soft cap it
            /// saves each score's `tanh(s / cap)` in `tanh (B,H,T,T)`.
            fn attention_forward_with(
                &mut self,
                _out: &mut Self::Buf,
                _att: &mut Self::Buf,
                _tanh: Option<&mut Self::Buf>,
                _qkv: &Self::Buf,
                _s: AttnShape,
                _o: AttnOpts,
            ) {
                no_gemma_kernels(self.name())
            }

            /// [`Backend::attention_backward`] with [`AttnOpts`] (and the saved `tanh`).
            fn attention_backward_with(
                &mut self,
                _dqkv: &mut Self::Buf,
                _datt: &mut Self::Buf,
                _dout: &Self::Buf,
                _qkv: &Self::Buf,
                _att: &Self::Buf,
                _tanh: Option<&Self::Buf>,
                _s: AttnShape,
                _o: AttnOpts,
            ) {
                no_gemma_kernels(self.name())
            }

            /// [`Backend::flash_attention_forward`] with [`AttnOpts`] (the soft cap
            /// as FlashAttention-2's `softcap`; nothing more is saved).
            fn flash_attention_forward_with(
                &mut self,
                _out: &mut Self::Buf,
                _lse: &mut Self::Buf,
                _qkv: &Self::Buf,
                _ws: &mut Self::Buf,
                _s: AttnShape,
                _o: AttnOpts,
            ) {
                no_gemma_kernels(self.name())
            }

            /// [`Backend::flash_attention_backward`] with [`AttnOpts`], the capped
            /// scores recomputed.
            fn flash_attention_backward_with(
                &mut self,
                _dqkv: &mut Self::Buf,
                _dout: &Self::Buf,
                _out: &Self::Buf,
                _lse: &Self::Buf,
                _qkv: &Self::Buf,
                _ws: &mut Self::Buf,
                _s: AttnShape,
                _o: AttnOpts,
            ) {
                no_gemma_kernels(self.name())
            }

            // ---- mixture of experts (`engine::moe`) ------------------------------
            // A routed row `j` of the permuted buffer holds token `idx[j]`; an
            // index of `n` or more marks an empty capacity slot. `idx` is `U32`,
            // `w` (the combine weights) `F32`. Only cpu and meta have these; the
            // engine refuses experts elsewhere (`engine::validate`).

            /// `out (M,C)`: row j is `x[idx[j]]`, times `w[j]` when given; empty
            /// slots are zero. `dims` is `(M, N, C)`.
            fn moe_gather(
                &mut self,
                _out: &mut Self::Buf,
                _x: &Self::Buf,
                _idx: &Self::Buf,
                _w: Option<&Self::Buf>,
                _dims: (usize, usize, usize),
            ) {
                no_expert_kernels(self.name())
            }

            /// `out (N,C) += w[j] · y[j]` into row `idx[j]` for each routed row
            /// (`w` = 1 when absent), in row order.
            fn moe_scatter(
                &mut self,
                _out: &mut Self::Buf,
                _y: &Self::Buf,
                _idx: &Self::Buf,
                _w: Option<&Self::Buf>,
                _dims: (usize, usize, usize),
            ) {
                no_expert_kernels(self.name())
            }

            /// `out (M) F32`: `a[idx[j]] · b[j]`, zero for an empty slot.
            fn moe_row_dots(
                &mut self,
                _out: &mut Self::Buf,
                _a: &Self::Buf,
                _b: &Self::Buf,
                _idx: &Self::Buf,
                _dims: (usize, usize, usize),
            ) {
                no_expert_kernels(self.name())
            }

            /// Each expert's rows: for `e` in order, the next `counts[e]` rows of
            /// `inp (M,C)` times expert `e`'s `w[e] (OC,C)ᵀ` into the same rows of
            /// `out (M,OC)` (a grouped GEMM, as Megatron's `GroupedMLP`).
            fn grouped_matmul_forward(
                &mut self,
                _out: &mut Self::Buf,
                _inp: &Self::Buf,
                _w: &Self::Buf,
                _counts: &[usize],
                _c: usize,
                _oc: usize,
            ) {
                no_expert_kernels(self.name())
            }

            /// Its backward, group by group as [`Backend::matmul_backward`]:
            /// `dinp` overwritten, `dw[e] += doutᵀ inp` unless frozen.
            fn grouped_matmul_backward(
                &mut self,
                _dinp: &mut Self::Buf,
                _dw: Option<&mut Self::Buf>,
                _dout: &Self::Buf,
                _inp: &Self::Buf,
                _w: &Self::Buf,
                _counts: &[usize],
                _c: usize,
                _oc: usize,
            ) {
                no_expert_kernels(self.name())
            }

            /// One AdamW step on `n` elements (Loshchilov & Hutter, decoupled weight decay):
            /// `g = grad*grad_scale; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
            /// param -= lr * (m*m_corr / (sqrt(v*v_corr) + eps) + weight_decay*param)`.
            fn adamw_update(
                &mut self,
                param: &mut Self::Buf,
                grad: &Self::Buf,
                m: &mut Self::Buf,
                v: &mut Self::Buf,
                n: usize,
                h: AdamHyper,
            );

            /// 8-bit AdamW (Dettmers et al., 8-bit Optimizers via Block-wise
            /// Quantization, 2022): `m` and `v` are `U8` codes into the signed and
            /// unsigned dynamic maps, one fp32 absmax per 256-element block in
            /// `m_absmax`, `v_absmax` (`ceil(n/256)` each). Dequantise, the AdamW update
            /// of [`Backend::adamw_update`], requantise.
            fn adamw8bit_update(
                &mut self,
                param: &mut Self::Buf,
                grad: &Self::Buf,
                m: &mut Self::Buf,
                v: &mut Self::Buf,
                m_absmax: &mut Self::Buf,
                v_absmax: &mut Self::Buf,
                n: usize,
                h: AdamHyper,
            );

            /// SGD with momentum, PyTorch semantics (L2 weight decay added to the
            /// gradient, no dampening): `g = grad*grad_scale + wd*param;
            /// buf = momentum*buf + g; param -= lr*buf`.
            fn sgd_update(
                &mut self,
                param: &mut Self::Buf,
                grad: &Self::Buf,
                momentum_buf: &mut Self::Buf,
                n: usize,
                h: SgdHyper,
            );

            /// Adafactor (Shazeer & Stern, 2018) as Hugging Face implements it; see
            /// [`AdafactorHyper`]. `st` holds the factored (or, for 1-D tensors, full)
            /// second moment and the optional first moment.
            fn adafactor_update(
                &mut self,
                param: &mut Self::Buf,
                grad: &Self::Buf,
                st: AdafactorState<'_, Self::Buf>,
                h: AdafactorHyper,
            );
        }
    };
}
pub(crate) use kernel_ops;

/// `kernel_ops!`'s entries as they are written: the trait's declarations
/// (and default bodies).
macro_rules! declare_kernel_ops {
    ($(
        $(#[$attr:meta])*
        fn $name:ident(&mut $self:ident $(, $arg:ident: $ty:ty)* $(,)?) $tail:tt
    )*) => {
        $(
            $(#[$attr])*
            fn $name(&mut $self $(, $arg: $ty)*) $tail
        )*
    };
}

/// One backend. `Buf` is its device buffer; ops take buffers and explicit shapes.
///
/// Conventions: `n` is the number of rows (tokens, `B*T`); arguments named `d*`
/// are gradients. Unless an op says "accumulates", it overwrites its outputs.
pub trait Backend {
    type Buf;

    fn name(&self) -> &'static str;

    /// Whether buffers hold data. `false` on meta, where the engine skips
    /// producing host data (initial weights, tokens) that would go nowhere.
    fn holds_data(&self) -> bool {
        true
    }

    /// Whether this device only answers a planner: peaks and priced
    /// seconds, no timeline or per-op table (a meta backend's choice).
    fn planning(&self) -> bool {
        false
    }

    /// Waits until every op issued so far has finished (a GPU queues its
    /// work; the cpu and meta backends finish each op before returning).
    fn synchronize(&mut self) {}

    /// Whether this backend is (or predicts) a GPU. Framework profiles
    /// differ there: PyTorch's dropout saves a bool mask on CUDA and its
    /// input-sized noise on cpu.
    fn is_gpu(&self) -> bool {
        false
    }

    /// A zero-filled buffer of `len` elements.
    fn alloc(&mut self, len: usize, dtype: DType) -> Self::Buf;
    fn free(&mut self, buf: Self::Buf);
    /// A buffer in host memory that this backend's ops can still read and
    /// write (offload: master weights, optimizer state, gradient shards).
    /// On cpu and meta host memory is where everything lives already.
    fn alloc_host(&mut self, len: usize, dtype: DType) -> Self::Buf {
        self.alloc(len, dtype)
    }
    /// Whether [`Backend::alloc_host`] gives host memory: a backend whose
    /// buffers live elsewhere and cannot place one on the host says no,
    /// and offload is refused on it.
    fn offloads(&self) -> bool {
        !self.is_gpu()
    }

    /// Bytes of backend-internal scratch this backend needs for attention of
    /// shape `s` (`fused` or eager) on activations of type `dtype`; the engine
    /// allocates them once as `workspace` and passes the buffer to the ops
    /// that use it.
    fn workspace_bytes(&self, s: AttnShape, fused: bool, dtype: DType) -> usize;

    /// Whether this backend stores and dequantises QLoRA's NF4 weights
    /// ([`Backend::upload_u8`], [`Backend::nf4_dequantize`]); the engine
    /// asks no other backend to.
    fn reads_nf4(&self) -> bool {
        false
    }
    /// The buffer's contents, or `None` on a backend that holds no data.
    fn download_f32(&self, src: &Self::Buf) -> Option<Vec<f32>>;

    /// `out (N,C) = wte[tokens] (+ wpe[pos])`, tokens `(B,T)` flattened to N, wte `(V,C)`, wpe `(maxT,C)`.
    fn embed_forward(
        &mut self,
        out: &mut Self::Buf,
        tokens: &Self::Buf,
        wte: &Self::Buf,
        wpe: Option<&Self::Buf>,
        n: usize,
        t: usize,
        c: usize,
    ) {
        self.embed_forward_rows(out, tokens, wte, wpe, n, t, c, None);
    }
    /// Accumulates `dwte[tokens] += dout` and `dwpe[pos] += dout`.
    fn embed_backward(
        &mut self,
        dwte: &mut Self::Buf,
        dwpe: Option<&mut Self::Buf>,
        dout: &Self::Buf,
        tokens: &Self::Buf,
        n: usize,
        t: usize,
        c: usize,
    ) {
        self.embed_backward_rows(dwte, dwpe, dout, tokens, n, t, c, None);
    }

    /// Sum of squares of `buf`, or `None` on a backend that holds no data.
    fn sum_squares(&mut self, buf: &Self::Buf, n: usize) -> Option<f64>;

    // The kernel ops: declared from the one list in `kernel_ops!` above.
    kernel_ops!(declare_kernel_ops);
}

/// SGD hyper-parameters for one step.
#[derive(Clone, Copy, Debug)]
pub struct SgdHyper {
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
    pub grad_scale: f32,
}

/// Adafactor's state for one tensor.
pub struct AdafactorState<'a, Buf> {
    pub second: AdafactorSecond<'a, Buf>,
    /// First moment, only when `beta1` is set.
    pub m: Option<&'a mut Buf>,
}

/// The second-moment estimate: factored for tensors with two or more dims
/// (viewed as `rows x cols`, the last dim being `cols`), full for 1-D ones.
pub enum AdafactorSecond<'a, Buf> {
    Factored {
        /// Running mean over columns, one per row: `(rows)`.
        row: &'a mut Buf,
        /// Running mean over rows, one per column: `(cols)`.
        col: &'a mut Buf,
        rows: usize,
        cols: usize,
    },
    Full {
        v: &'a mut Buf,
        n: usize,
    },
}

/// Adafactor hyper-parameters with the Hugging Face defaults
/// (`transformers.optimization.Adafactor`): `eps = (1e-30, 1e-3)`,
/// `clip_threshold = 1.0`, `decay_rate = -0.8`, `beta1 = None`,
/// `scale_parameter = True`, `relative_step = True` (when `lr` is `None`).
///
/// Per step t (1-based): `lr_t = lr` or `min(1e-2, 1/sqrt(t))`; with
/// `scale_parameter`, `lr_t *= max(eps2, RMS(param))`;
/// `beta2_t = 1 - t^decay_rate`; `u = g^2 + eps1`;
/// factored: `row = beta2_t*row + (1-beta2_t)*mean_cols(u)`,
/// `col = beta2_t*col + (1-beta2_t)*mean_rows(u)`,
/// `update = g / sqrt(row/mean(row) (x) col)`; full: `v = beta2_t*v + (1-beta2_t)*u`,
/// `update = g / sqrt(v)`; then `update /= max(1, RMS(update)/clip_threshold)`;
/// `update *= lr_t` (before the first moment, as Hugging Face does);
/// with beta1: `m = beta1*m + (1-beta1)*update; update = m`;
/// `param -= lr_t*weight_decay*param` (when non-zero); `param -= update`.
#[derive(Clone, Copy, Debug)]
pub struct AdafactorHyper {
    /// `None`: relative step.
    pub lr: Option<f32>,
    /// 1-based step.
    pub step: u64,
    pub beta1: Option<f32>,
    pub decay_rate: f32,
    pub eps1: f32,
    pub eps2: f32,
    pub clip_threshold: f32,
    pub weight_decay: f32,
    pub scale_parameter: bool,
    pub grad_scale: f32,
}

impl Default for AdafactorHyper {
    fn default() -> Self {
        AdafactorHyper {
            lr: None,
            step: 1,
            beta1: None,
            decay_rate: -0.8,
            eps1: 1e-30,
            eps2: 1e-3,
            clip_threshold: 1.0,
            weight_decay: 0.0,
            scale_parameter: true,
            grad_scale: 1.0,
        }
    }
}

/// Per-step AdamW hyper-parameters, already resolved for this step.
#[derive(Clone, Copy, Debug)]
pub struct AdamHyper {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Decoupled weight decay for this tensor (0 for 1-D tensors).
    pub weight_decay: f32,
    /// `1 / (1 - beta1^t)`.
    pub m_corr: f32,
    /// `1 / (1 - beta2^t)`.
    pub v_corr: f32,
    /// Multiplies the gradient first (global-norm clipping).
    pub grad_scale: f32,
}

/// Which device to run on, parsed from `--device`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceSpec {
    pub kind: DeviceKind,
    /// Emulated capacity in bytes (`cpu:limit=512MiB`).
    pub limit: Option<u64>,
    /// Which GPU (`cuda:1`); `None` is device 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ordinal: Option<usize>,
}

impl DeviceSpec {
    pub fn new(kind: DeviceKind, limit: Option<u64>) -> Self {
        DeviceSpec {
            kind,
            limit,
            ordinal: None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    Cpu,
    Meta,
    Cuda,
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Meta => "meta",
            DeviceKind::Cuda => "cuda",
        })
    }
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;

    /// `cpu`, `meta`, `cuda`, each optionally `:limit=SIZE`; `cuda:N` (or
    /// `cuda:N,limit=SIZE`) picks GPU `N`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, opts) = s.split_once(':').unwrap_or((s, ""));
        let kind = match kind.trim() {
            "cpu" => DeviceKind::Cpu,
            "meta" => DeviceKind::Meta,
            "cuda" => DeviceKind::Cuda,
            other => {
                return Err(format!(
                    "unknown device `{other}`: expected cpu, meta or cuda[:N], optionally with :limit=SIZE (e.g. cpu:limit=512MiB, cuda:1,limit=40GiB)"
                ));
            }
        };
        let mut limit = None;
        let mut ordinal = None;
        for opt in opts.split(',').filter(|o| !o.trim().is_empty()) {
            let opt = opt.trim();
            if opt.bytes().all(|b| b.is_ascii_digit()) {
                if kind != DeviceKind::Cuda {
                    return Err(format!(
                        "`{s}`: only cuda devices are numbered (cuda:{opt}); {kind} has one device"
                    ));
                }
                ordinal = Some(
                    opt.parse()
                        .map_err(|_| format!("`{s}`: device number {opt} is too large"))?,
                );
                continue;
            }
            match opt.split_once('=') {
                Some(("limit", v)) => limit = Some(crate::units::parse_bytes(v)?),
                _ => {
                    return Err(format!(
                        "unknown device option `{opt}` in `{s}`: the options are a GPU number (cuda:1) and limit=SIZE (e.g. {kind}:limit=512MiB)"
                    ));
                }
            }
        }
        Ok(DeviceSpec {
            kind,
            limit,
            ordinal,
        })
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.kind)?;
        let mut sep = ':';
        if let Some(o) = self.ordinal {
            write!(f, ":{o}")?;
            sep = ',';
        }
        if let Some(l) = self.limit {
            write!(
                f,
                "{sep}limit={}",
                crate::units::fmt_bytes(l).replace(' ', "")
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_specs() {
        let d: DeviceSpec = "cpu:limit=512MiB".parse().unwrap();
        assert_eq!(d.kind, DeviceKind::Cpu);
        assert_eq!(d.limit, Some(512 << 20));
        assert_eq!("meta".parse::<DeviceSpec>().unwrap().limit, None);
        assert!("tpu".parse::<DeviceSpec>().is_err());
        assert!("cpu:size=1GiB".parse::<DeviceSpec>().is_err());
        let g: DeviceSpec = "cuda:1,limit=40GiB".parse().unwrap();
        assert_eq!(
            (g.kind, g.ordinal, g.limit),
            (DeviceKind::Cuda, Some(1), Some(40 << 30))
        );
        assert_eq!(g.to_string(), "cuda:1,limit=40.00GiB");
        assert_eq!(g.to_string().parse::<DeviceSpec>().unwrap(), g);
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap().ordinal, None);
        assert!(
            "cpu:1"
                .parse::<DeviceSpec>()
                .unwrap_err()
                .contains("only cuda")
        );
    }
}
