//! Selective activation checkpointing as torchtitan runs it
//! (`--checkpointing selective`; torchtitan's `[activation_checkpoint]
//! mode = "selective"`, `selective_ac_option = "op"`).
//!
//! torchtitan wraps each transformer block in PyTorch's non-reentrant
//! checkpoint with `create_selective_checkpoint_contexts` and a policy
//! that, per block, counts the block's `aten.mm` calls and saves the
//! output of every op on its save list (`aten.mm`, the flash and
//! memory-efficient sdpa kernels, `_c10d_functional.reduce_scatter_tensor`,
//! `aten.max`, and `aten.abs` for float8) except every second mm; every
//! other op of the block is recomputed in the backward. Sources:
//! pytorch/torchtitan @ 9dec370 (2024-12-26, the version
//! benchmarks/llama3_h100_202412_torchtitan.md measured):
//! torchtitan/parallelisms/parallelize_llama.py, `_save_list` and
//! `_apply_ac_to_transformer_block`; the same policy @ b5bcd76 (2026):
//! torchtitan/distributed/activation_checkpoint.py, `_apply_op_sac`.
//!
//! torchtitan's Llama block calls its mms in this order: wq, wk, wv, wo,
//! w1 (the gate), w3 (up), w2 (down) (torchtitan/models/llama/model.py:
//! `Attention.forward`, `FeedForward.forward` = `w2(silu(w1(x)) * w3(x))`),
//! so it saves q, v, the attention's output and log-sum-exp, the gate and
//! the MLP's output, and recomputes the norms, k, RoPE, the output
//! projection, the residual adds, up and the SwiGLU. memfit's block runs
//! q|k|v and gate|up as one GEMM each: it keeps the saved pieces' columns
//! (copied out after the forward), and its recomputation runs a GEMM over
//! only the weight rows of each piece that was not saved (copied into a
//! temporary, as the backend's GEMM takes whole tensors), so it recomputes
//! what torchtitan recomputes and keeps what it keeps. RoPE rotates q in
//! place in memfit's buffer, so q is kept rotated (the same bytes) and
//! RoPE is recomputed on k. GPT-2's block, with the same counter, saves
//! q, v, the attention and fc, and recomputes k, the output projection,
//! GELU and the down projection.

use super::*;

/// A block's matmuls, as torchtitan's model calls them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mm {
    Q,
    K,
    V,
    O,
    /// Llama's w1, whose output goes through SiLU.
    Gate,
    /// Llama's w3; GPT-2's fc.
    Up,
    /// Llama's w2; GPT-2's output projection of the MLP.
    Down,
}

/// The block's matmuls in call order.
fn order(family: Family) -> &'static [Mm] {
    use Mm::*;
    match family {
        Family::Gpt2 => &[Q, K, V, O, Up, Down],
        Family::Llama | Family::Gemma => &[Q, K, V, O, Gate, Up, Down],
    }
}

/// Whether torchtitan's policy saves `mm`'s output: its counter goes up
/// at each mm of the block, and an mm whose count is even is recomputed.
pub(super) fn saved(family: Family, mm: Mm) -> bool {
    let i = order(family).iter().position(|&m| m == mm);
    let count = i.expect("every projection of a block is one of its matmuls") + 1;
    count % 2 != 0
}

/// A fused projection's output columns: (the matmul, offset, width).
type Pieces = Vec<(Mm, usize, usize)>;

impl<B: Backend> Pass<'_, B> {
    /// Whether selective checkpointing saves `mm`'s output.
    pub(super) fn saves(&self, mm: Mm) -> bool {
        self.train.checkpointing == Checkpointing::Selective && saved(self.model.family, mm)
    }

    /// q|k|v's columns on this rank.
    fn qkv_pieces(&self) -> Pieces {
        let (q, all) = (self.widths.attn, self.widths.qkv);
        let kv = (all - q) / 2;
        vec![(Mm::Q, 0, q), (Mm::K, q, kv), (Mm::V, q + kv, kv)]
    }

    /// The MLP's first projection's columns: gate|up, or GPT-2's fc.
    fn up_pieces(&self, ly: &BlockLayers) -> Pieces {
        let up = ly
            .up
            .expect("selective checkpointing: a dense MLP (validate)");
        match self.model.family {
            Family::Gpt2 => vec![(Mm::Up, 0, up.out)],
            _ => vec![(Mm::Gate, 0, up.out / 2), (Mm::Up, up.out / 2, up.out / 2)],
        }
    }

    /// After block `l`'s forward: the outputs the policy saves, the rest
    /// freed. Only the blocks `validate::checkpointing` admits come here
    /// (dense, no adapters, no framework extras).
    pub(super) fn keep_ops(
        &mut self,
        l: usize,
        a: BlockActs<T<B>>,
    ) -> Result<Kept<T<B>>, OomError> {
        let ly = BlockLayers::of(self, l);
        let BlockActs {
            ln1,
            ln1_mean,
            ln1_rstd,
            qkv,
            att,
            atty,
            res2,
            ln2,
            ln2_mean,
            ln2_rstd,
            up,
            act,
            moe,
            gate,
            qk,
            extra,
            lora_t,
            tanh,
            post_attn,
            post_mlp,
            down,
        } = a;
        debug_assert!(moe.is_none() && gate.is_none() && qk.is_none() && post_attn.is_none());
        debug_assert!(lora_t.is_empty() && post_mlp.is_none());
        let pieces = self.qkv_pieces();
        let qkv = self.pack(qkv, self.widths.qkv, &pieces)?;
        let up = up.expect("selective checkpointing: a dense MLP (validate)");
        let cols = up.len / self.n;
        let pieces = self.up_pieces(&ly);
        let up = self.pack(up, cols, &pieces)?;
        let attn = match self.train.attention {
            Attention::Fused => Some((atty, att)),
            // Refused with selective checkpointing (`validate`): torchtitan's
            // policy does not save flash_attn's op.
            Attention::Eager | Attention::FlashAttention2 => {
                self.dev.free(atty);
                self.dev.free(att);
                None
            }
        };
        // hf-eager: what autograd saved for the other ops, made again by
        // the recomputation.
        let rest = [ln1, ln1_rstd, res2, ln2, ln2_rstd].into_iter().chain(act);
        for x in rest.chain(extra) {
            self.dev.free(x);
        }
        for x in [ln1_mean, ln2_mean, tanh].into_iter().flatten() {
            self.dev.free(x);
        }
        Ok(Kept {
            qkv,
            attn,
            up,
            down,
        })
    }

    /// The saved pieces' columns of `y (N, cols)` packed into one
    /// activation (`y` freed), or `y` itself when every piece is saved.
    fn pack(&mut self, y: T<B>, cols: usize, pieces: &Pieces) -> Result<T<B>, OomError> {
        let fam = self.model.family;
        let kept: Vec<_> = pieces.iter().filter(|p| saved(fam, p.0)).collect();
        let width: usize = kept.iter().map(|p| p.2).sum();
        if width == cols {
            return Ok(y);
        }
        let n = self.n;
        let mut out = self.dev.alloc(n * width, y.dtype, Category::Activations)?;
        let mut at = 0;
        for &&(_, off, w) in &kept {
            (self.dev).copy_cols(&mut out, width, at, &y, cols, off, n, w, 1.0, false);
            at += w;
        }
        self.dev.free(y);
        Ok(out)
    }

    /// Block `l`'s saved tensors under selective checkpointing, from its
    /// input `x` and what its forward kept: what [`Pass::block_forward`]
    /// would save, with the kept ops' outputs taken rather than recomputed.
    pub(super) fn recompute_ops(
        &mut self,
        l: usize,
        x: &T<B>,
        kept: Kept<T<B>>,
    ) -> Result<BlockActs<T<B>>, OomError> {
        self.dev.tracker.set_phase(Phase::Recompute(l));
        let ly = BlockLayers::of(self, l);
        let Kept {
            qkv,
            attn,
            up,
            down,
        } = kept;
        let (ln1, ln1_mean, ln1_rstd) = self.norm(x, ly.ln1)?;
        let rope = (self.model.family != Family::Gpt2).then(|| self.model.rope_theta_at(l));
        let pieces = self.qkv_pieces();
        let qkv = self.unpack(&ly.qkv, &ln1, qkv, &pieces, rope)?;
        let (atty, att, tanh) = match attn {
            Some((atty, lse)) => (atty, lse, None),
            None => self.attention_forward(l, &qkv)?,
        };
        let proj = (ly.o).forward(self, l, &atty, Category::Temporaries, &mut Vec::new())?;
        let proj = self.reduce_gemm(proj)?;
        let res2 = self.residual(x, proj)?;
        let (ln2, ln2_mean, ln2_rstd) = self.norm(&res2, ly.ln2)?;
        let (lin, down_lin) = (ly.up, ly.down);
        let (lin, down_lin) = (lin.zip(down_lin)).expect("a dense MLP (validate)");
        let pieces = self.up_pieces(&ly);
        let up = self.unpack(&lin, &ln2, up, &pieces, None)?;
        let act = self.activation_forward(&up, down_lin.inp)?;
        // hf-eager: every op's saved tensors are made again, those of the
        // ops whose outputs were kept included (sdpa's inputs), as PyTorch's
        // recomputation reruns the block to rebuild its autograd graph.
        let extra = alloc_saved(self.dev, self.hf.map_or(&[][..], |h| &h.block_saved[..]))?;
        self.dev.tracker.set_phase(Phase::Backward(l));
        Ok(BlockActs {
            ln1,
            ln1_mean,
            ln1_rstd,
            qkv,
            att,
            atty,
            res2,
            ln2,
            ln2_mean,
            ln2_rstd,
            up: Some(up),
            act: Some(act),
            moe: None,
            gate: None,
            qk: None,
            extra,
            lora_t: Vec::new(),
            tanh,
            post_attn: None,
            post_mlp: None,
            down,
        })
    }

    /// `lin`'s output over `x` rebuilt: the saved pieces from `packed`
    /// (freed), the others recomputed, each a GEMM over its rows of the
    /// weight. With `rope` (llama's q|k|v), RoPE runs after the recomputed
    /// pieces are in and before the saved ones, kept rotated, are copied.
    fn unpack(
        &mut self,
        lin: &Linear,
        x: &T<B>,
        packed: T<B>,
        pieces: &Pieces,
        rope: Option<f32>,
    ) -> Result<T<B>, OomError> {
        let (fam, n, cols) = (self.model.family, self.n, lin.out);
        let width: usize = pieces.iter().filter(|p| saved(fam, p.0)).map(|p| p.2).sum();
        if width == cols {
            return Ok(packed);
        }
        let mut y = self.dev.alloc(n * cols, self.dt, Category::Activations)?;
        let mut packed = Some(packed);
        if rope.is_none() {
            self.unpack_saved(&mut y, cols, &mut packed, pieces);
        }
        for &(_, off, w) in pieces.iter().filter(|p| !saved(fam, p.0)) {
            let part = self.gemm_rows(lin, x, (off, w))?;
            (self.dev).copy_cols(&mut y, cols, off, &part, w, 0, n, w, 1.0, false);
            self.dev.free(part);
        }
        if let Some(theta) = rope {
            self.dev.rope_forward(&mut y, self.s, theta);
            self.unpack_saved(&mut y, cols, &mut packed, pieces);
        }
        Ok(y)
    }

    /// The saved pieces copied from `packed` into their columns of `y`;
    /// `packed` freed.
    fn unpack_saved(&mut self, y: &mut T<B>, cols: usize, packed: &mut Option<T<B>>, p: &Pieces) {
        let packed = packed.take().expect("unpacked once");
        let (fam, n) = (self.model.family, self.n);
        let width = packed.len / n;
        let mut at = 0;
        for &(_, off, w) in p.iter().filter(|p| saved(fam, p.0)) {
            (self.dev).copy_cols(y, cols, off, &packed, width, at, n, w, 1.0, false);
            at += w;
        }
        self.dev.free(packed);
    }

    /// `x (N, inp)` through rows `off..off + w` of `lin`'s weight (and
    /// bias) into a new temporary `(N, w)`.
    fn gemm_rows(
        &mut self,
        lin: &Linear,
        x: &T<B>,
        (off, w): (usize, usize),
    ) -> Result<T<B>, OomError> {
        let (n, inp, tmp) = (self.n, lin.inp, Category::Temporaries);
        let mut ws = self.dev.alloc(w * inp, self.p[lin.w].dtype, tmp)?;
        (self.dev).copy_slice(&mut ws, 0, &self.p[lin.w], off * inp, w * inp, false);
        let bias = match lin.b {
            Some(i) => {
                let mut b = self.dev.alloc(w, self.p[i].dtype, tmp)?;
                self.dev.copy_slice(&mut b, 0, &self.p[i], off, w, false);
                Some(b)
            }
            None => None,
        };
        let mut out = self.dev.alloc(n * w, x.dtype, tmp)?;
        (self.dev).matmul_forward(&mut out, x, &ws, bias.as_ref(), n, inp, w);
        self.dev.free(ws);
        self.dev.free_opt(bias);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torchtitans_counter_saves_every_other_matmul() {
        use Mm::*;
        let kept = |f| -> Vec<Mm> { order(f).iter().copied().filter(|&m| saved(f, m)).collect() };
        // torchtitan's Llama: wq, wv, w1 and w2 saved; wk, wo and w3 recomputed.
        assert_eq!(kept(Family::Llama), [Q, V, Gate, Down]);
        assert_eq!(kept(Family::Gpt2), [Q, V, Up]);
    }
}
