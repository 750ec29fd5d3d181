//! A mixture-of-experts MLP: the router, the token dispatch into the
//! experts' permuted buffer, the experts as one grouped GEMM, and the
//! weighted combine back into the tokens, forward and backward by hand.
//!
//! It follows Megatron-Core's `MoELayer` with `GroupedMLP`: the router
//! scores every expert (softmax over the router's logits, top-k), the
//! tokens are permuted so that each expert's rows are contiguous, and
//! the experts' weights are stacked tensors (`(E, 2I, C)`, `(E, C, I)`)
//! multiplied group by group.
//!
//! Two dispatch modes, both with shapes fixed before routing, so the
//! memory a step takes does not depend on where the tokens go, and meta
//! plans it byte for byte (the engine's invariant):
//! - dropless (`capacity_factor` absent): the permuted buffer holds
//!   exactly `N·k` rows, however the tokens spread;
//! - a capacity factor `f`: every expert gets `⌈f·N·k/E⌉` rows, padded
//!   when fewer tokens chose it and the later tokens dropped when more
//!   did (by position, as GShard and Switch drop; Megatron drops the
//!   lowest-probability ones by default), as Megatron's
//!   `moe_pad_expert_input_to_capacity` does.
//!
//! The routing decision (softmax, top-k, the permutation) is made on the
//! host from the logits, as the grouped GEMM needs each expert's row count
//! there anyway (Megatron copies `tokens_per_expert` to the host for it).
//! The device holds every routing tensor a GPU would (the probabilities,
//! the row indices and weights), tracked as activations.
//!
//! The load-balancing loss is Megatron-Core's per-layer switch loss:
//! `coef · E · Σ_e f_e · P̄_e`, with `f_e` the share of the `N·k` choices
//! that went to expert `e` and `P̄_e` its mean probability (Fedus et al.,
//! Switch Transformers, eq. 4, with top-k). transformers'
//! `load_balancing_loss_func` computes one such loss over every layer's
//! logits at once and without the `1/k`, so its value differs.

use super::expert::{self, Ep};
use super::*;
use crate::config::model::{MoeConfig, MoeIndex};

/// A routed block's sizes for one micro-batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeShape {
    /// Tokens, width, experts, choices per token, expert inner width.
    pub n: usize,
    pub c: usize,
    pub e: usize,
    pub k: usize,
    pub i: usize,
    /// Each expert's rows under a capacity factor.
    pub cap: Option<usize>,
}

impl MoeShape {
    pub fn new(m: &MoeConfig, c: usize, n: usize, capacity_factor: Option<f32>) -> Self {
        let (e, k) = (m.n_experts, m.top_k);
        let cap = capacity_factor.map(|f| capacity(f, n, k, e));
        MoeShape {
            n,
            c,
            e,
            k,
            i: m.d_expert,
            cap,
        }
    }

    /// Rows of the permuted buffer.
    pub fn rows(&self) -> usize {
        match self.cap {
            Some(cap) => self.e * cap,
            None => self.n * self.k,
        }
    }

    /// Each expert's rows where the routing is not known (a plan): the
    /// capacity, or dropless an even spread of the `N·k` rows. Only the
    /// cost model reads it; the memory is the same however they spread.
    pub fn planned_counts(&self) -> Vec<usize> {
        match self.cap {
            Some(cap) => vec![cap; self.e],
            None => expert::split_even(self.rows(), self.e),
        }
    }
}

/// An expert's rows under capacity factor `f`: `⌈f·N·k/E⌉` (Megatron's
/// `get_capacity`, without its minimum).
pub fn capacity(f: f32, n: usize, k: usize, e: usize) -> usize {
    ((f as f64 * (n * k) as f64) / e as f64).ceil() as usize
}

/// One micro-batch's routing through one block, decided on the host.
#[derive(Clone, Debug)]
pub struct Routing {
    /// The router's softmax over all experts, `(N, E)`.
    pub probs: Vec<f32>,
    /// Each token's choices, best first: `(expert, weight)`, `N·k`.
    pub chosen: Vec<(usize, f32)>,
    /// Each permuted row's token (`n` for an empty slot) and weight.
    pub idx: Vec<u32>,
    pub weight: Vec<f32>,
    /// Each permuted row's choice (`t·k + s`), `None` for an empty slot.
    pub choice: Vec<Option<usize>>,
    /// Each expert's rows in the permuted buffer.
    pub counts: Vec<usize>,
    /// Each expert's choices before any were dropped.
    pub chose: Vec<usize>,
    /// The block's load-balancing loss (already times its coefficient).
    pub aux: f64,
}

/// Routes `logits (N, E)` as `shape` and the model's router say.
pub fn route(logits: &[f32], sh: &MoeShape, m: &MoeConfig) -> Routing {
    let (n, e, k) = (sh.n, sh.e, sh.k);
    let mut probs = vec![0f32; n * e];
    let mut chosen = Vec::with_capacity(n * k);
    let mut chose = vec![0usize; e];
    for t in 0..n {
        let (row, p) = (&logits[t * e..(t + 1) * e], &mut probs[t * e..(t + 1) * e]);
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = row.iter().map(|&x| ((x - max) as f64).exp()).sum();
        for (p, &x) in p.iter_mut().zip(row) {
            *p = (((x - max) as f64).exp() / sum) as f32;
        }
        // The k largest, ties to the lower index (torch.topk's order).
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let top = &order[..k];
        let z: f32 = top.iter().map(|&x| p[x]).sum();
        for &x in top {
            chosen.push((x, if m.norm_topk { p[x] / z } else { p[x] }));
            chose[x] += 1;
        }
    }
    // Each expert's rows, its tokens in order; beyond a capacity, dropped.
    let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); e];
    for (ci, &(x, _)) in chosen.iter().enumerate() {
        by_expert[x].push(ci);
    }
    let (mut idx, mut weight, mut choice, mut counts) = (vec![], vec![], vec![], vec![]);
    for list in &by_expert {
        let rows = sh.cap.unwrap_or(list.len());
        for r in 0..rows {
            let ci = list.get(r).copied();
            idx.push(ci.map_or(n as u32, |ci| (ci / k) as u32));
            weight.push(ci.map_or(0.0, |ci| chosen[ci].1));
            choice.push(ci);
        }
        counts.push(rows);
    }
    let mean_p = |x: usize| (0..n).map(|t| probs[t * e + x] as f64).sum::<f64>() / n as f64;
    let aux = (0..e)
        .map(|x| chose[x] as f64 / (n * k) as f64 * mean_p(x))
        .sum::<f64>()
        * e as f64
        * m.aux_loss_coef as f64;
    Routing {
        probs,
        chosen,
        idx,
        weight,
        choice,
        counts,
        chose,
        aux,
    }
}

/// The gradient of the router's logits `(N, E)`: from each permuted row's
/// combine-weight gradient `dweight` (through the top-k weights and their
/// renormalisation), plus the load-balancing loss's, scaled by `aux_scale`
/// (d loss / d this micro-batch's aux loss), both back through the softmax.
pub fn router_grad(r: &Routing, dweight: &[f32], m: &MoeConfig, aux_scale: f32) -> Vec<f32> {
    let (e, k) = (r.chose.len(), m.top_k);
    let n = r.probs.len() / e;
    // d loss / d (each choice's weight).
    let mut g = vec![0f64; n * k];
    for (j, c) in r.choice.iter().enumerate() {
        if let Some(ci) = c {
            g[*ci] = dweight[j] as f64;
        }
    }
    let aux = |x: usize| {
        (m.aux_loss_coef as f64) * e as f64 * (r.chose[x] as f64 / (n * k) as f64) / n as f64
    };
    let mut dlogits = vec![0f32; n * e];
    let mut dp = vec![0f64; e];
    for t in 0..n {
        let p = &r.probs[t * e..(t + 1) * e];
        for (x, d) in dp.iter_mut().enumerate() {
            *d = aux(x) * aux_scale as f64;
        }
        let picks = &r.chosen[t * k..(t + 1) * k];
        let gs = &g[t * k..(t + 1) * k];
        match m.norm_topk {
            // w_s = p_s / z: dL/dp_r = g_r / z - Σ_s g_s p_s / z².
            true => {
                let z: f64 = picks.iter().map(|&(x, _)| p[x] as f64).sum();
                let gp: f64 = (picks.iter().zip(gs))
                    .map(|(&(x, _), g)| g * p[x] as f64)
                    .sum();
                for (&(x, _), g) in picks.iter().zip(gs) {
                    dp[x] += g / z - gp / (z * z);
                }
            }
            false => {
                for (&(x, _), g) in picks.iter().zip(gs) {
                    dp[x] += g;
                }
            }
        }
        // Softmax: dlogit = p · (dp - Σ p dp).
        let dot: f64 = p.iter().zip(&dp).map(|(&p, d)| p as f64 * d).sum();
        for x in 0..e {
            dlogits[t * e + x] = (p[x] as f64 * (dp[x] - dot)) as f32;
        }
    }
    dlogits
}

/// What a routed block saves for its backward.
pub(super) struct MoeActs<X> {
    /// The router's probabilities `(N, E)`, f32.
    pub probs: X,
    /// Each permuted row's token (U32) and combine weight (F32), `M`.
    pub idx: X,
    pub weight: X,
    /// The permuted input `(M, C)`, the experts' gate|up `(M, 2I)`, their
    /// SwiGLU `(M, I)` and their output `(M, C)` (its combine weight's
    /// gradient needs it).
    pub xp: X,
    pub h: X,
    pub act: X,
    pub eo: X,
    /// hf-eager: what transformers saves beyond these
    /// (`HfRules::experts_saved`).
    pub extra: Vec<X>,
    /// The host's routing (`None` on a backend without data).
    pub routing: Option<Routing>,
    /// Each expert's rows (under expert parallelism, each local expert's,
    /// from every rank of the group).
    pub counts: Vec<usize>,
    /// Expert parallelism: the exchange and, for each row of `xp`, `h`
    /// and `act` (this rank's experts' rows, by expert), its row as it
    /// arrived (`expert::Exchange::sort_index`, U32). `eo` is then the
    /// outputs back on this rank, in its own permuted order.
    pub ep: Option<(expert::Exchange, X)>,
    /// LoRA on the experts: each adapter's `x_e A_eᵀ (rows, r)`, in the
    /// block's expert-adapter order (gate, up, down).
    pub lora_t: Vec<X>,
}

pub(super) fn free_moe<B: Backend>(dev: &mut Device<B>, a: MoeActs<T<B>>) {
    for x in [a.probs, a.idx, a.weight, a.xp, a.h, a.act, a.eo] {
        dev.free(x);
    }
    for x in a.extra {
        dev.free(x);
    }
    if let Some((_, sort)) = a.ep {
        dev.free(sort);
    }
    for x in a.lora_t {
        dev.free(x);
    }
}

/// LoRA on a routed block's experts: its adapters on them
/// (`lora::split_experts`; none without) and their scale `alpha / r`.
pub(super) type ExpertLora<'a> = (&'a [Adapter], f32);

/// The weights, and the rank's expert- and tensor-parallel groups.
type Groups<'a, B> = (&'a [T<B>], Option<&'a mut Ep<B>>, Option<&'a mut Tp<B>>);

/// The routed experts of one block: the router, dispatch and experts, all
/// saved; the combine is [`combine`], run when the block's output is
/// wanted. The experts' rows are in `edt`: the activations' dtype, except
/// hf-eager's autocast, where transformers' grouped_mm runs in the
/// weights' fp32 (`framework::Step::experts`; planned on meta only).
/// `hf_saved`: hf-eager's `HfRules::experts_saved`, saved beside.
pub(super) fn forward<B: Backend>(
    dev: &mut Device<B>,
    (p, ep, tp): Groups<'_, B>,
    (mi, lora): (MoeIndex, ExpertLora<'_>),
    m: &MoeConfig,
    (x, edt, hf_saved): (&T<B>, DType, &[(usize, DType)]),
    sh: MoeShape,
) -> Result<MoeActs<T<B>>, OomError> {
    let (n, c, e, i, rows) = (sh.n, sh.c, sh.e, sh.i, sh.rows());
    let (dt, act) = (x.dtype, Category::Activations);
    let mut logits = dev.alloc(n * e, dt, Category::Temporaries)?;
    dev.matmul_forward(&mut logits, x, &p[mi.router], None, n, c, e);
    let mut probs = dev.alloc_f32(n * e, act)?;
    let mut idx = dev.alloc(rows, DType::U32, act)?;
    let mut weight = dev.alloc_f32(rows, act)?;
    let routing = dev.be.download_f32(&logits.buf).map(|l| route(&l, &sh, m));
    if let Some(r) = &routing {
        dev.be.upload_f32(&mut probs.buf, &r.probs);
        dev.be.upload_u32(&mut idx.buf, &r.idx);
        dev.be.upload_f32(&mut weight.buf, &r.weight);
    }
    dev.free(logits);
    let counts = routing
        .as_ref()
        .map_or_else(|| sh.planned_counts(), |r| r.counts.clone());
    if let Some(ep) = ep {
        // hf-eager refuses expert parallelism (`validate`): no extras.
        assert!(
            hf_saved.is_empty() && edt == dt,
            "expert parallelism is memfit's own"
        );
        let r = (probs, idx, weight, routing);
        let mut a = experts_elsewhere(dev, (p, ep), (mi, lora), x, r, &counts, sh)?;
        reduce_rows(dev, tp, &mut a.eo);
        return Ok(a);
    }
    let mut xp = dev.alloc(rows * c, edt, act)?;
    dev.moe_gather(&mut xp, x, &idx, None, (rows, n, c));
    let ffn = (p, mi, lora);
    let (h, a, extra, mut eo, lora_t) =
        experts_ffn(dev, ffn, &xp, &counts, (i, c), (act, hf_saved))?;
    reduce_rows(dev, tp, &mut eo);
    Ok(MoeActs {
        extra,
        lora_t,
        probs,
        idx,
        weight,
        xp,
        h,
        act: a,
        eo,
        routing,
        counts,
        ep: None,
    })
}

/// Tensor parallelism: each rank's experts hold `I/T` of every expert's
/// width, so their outputs are partial sums, all-reduced over the group
/// row by row before the combine (as Megatron-Core reduces the experts'
/// output before un-permuting it), so that the combine weights' gradients
/// (`moe_row_dots`) and the router's read whole rows on every rank.
fn reduce_rows<B: Backend>(dev: &mut Device<B>, tp: Option<&mut Tp<B>>, eo: &mut T<B>) {
    if let Some(tp) = tp {
        tp.all_reduce(dev, eo);
    }
}

/// [`forward`]'s experts under expert parallelism: this rank's permuted
/// rows go to the ranks that hold their experts, this rank's experts run
/// on the rows that arrive, and their outputs come back (`expert.rs`).
fn experts_elsewhere<B: Backend>(
    dev: &mut Device<B>,
    (p, ep): (&[T<B>], &mut Ep<B>),
    (mi, lora): (MoeIndex, ExpertLora<'_>),
    x: &T<B>,
    (probs, idx, weight, routing): (T<B>, T<B>, T<B>, Option<Routing>),
    counts: &[usize],
    sh: MoeShape,
) -> Result<MoeActs<T<B>>, OomError> {
    let (n, c, i, rows) = (sh.n, sh.c, sh.i, sh.rows());
    let (dt, act, tmp) = (x.dtype, Category::Activations, Category::Temporaries);
    let mut xp = dev.alloc(rows * c, dt, tmp)?;
    dev.moe_gather(&mut xp, x, &idx, None, (rows, n, c));
    let ex = expert::exchange(dev, ep, counts, &sh)?;
    let xr = expert::all_to_all(dev, ep, &xp, &ex, (c, false, tmp))?;
    dev.free(xp);
    // Each local expert's rows together, from every rank.
    let (got, local) = (ex.received(), ex.local_counts());
    let sort = expert::upload_index(dev, &ex)?;
    let mut xs = dev.alloc(got * c, dt, act)?;
    dev.moe_gather(&mut xs, &xr, &sort, None, (got, got, c));
    dev.free(xr);
    // This rank's experts only: `local` has one count per local expert.
    let (h, a, _, eos, lora_t) = experts_ffn(dev, (p, mi, lora), &xs, &local, (i, c), (tmp, &[]))?;
    // Back in arrival order, and home.
    let mut eor = dev.alloc_zeroed(got * c, dt, tmp)?;
    dev.moe_scatter(&mut eor, &eos, &sort, None, (got, got, c));
    dev.free(eos);
    let eo = expert::all_to_all(dev, ep, &eor, &ex, (c, true, act))?;
    dev.free(eor);
    Ok(MoeActs {
        probs,
        idx,
        weight,
        xp: xs,
        h,
        act: a,
        eo,
        routing,
        counts: local,
        extra: Vec::new(),
        ep: Some((ex, sort)),
        lora_t,
    })
}

/// What [`experts_ffn`] leaves: `h`, `a`, the extras, the output and the
/// adapters' saved `x_e A_eᵀ`.
type Ffn<B> = (T<B>, T<B>, Vec<T<B>>, T<B>, Vec<T<B>>);

/// The experts' FFN on `xs (rows, C)`, rows grouped by expert as
/// `counts` says (one count per expert this rank holds): gate|up `h (rows,
/// 2I)` and SwiGLU `a (rows, I)`, saved, then `saved` (hf-eager's extras,
/// allocated where transformers saves them) and the output `(rows, C)` of
/// `out` category. The rows' dtype is `xs`'s; `(i, c)`: the experts' width
/// on this rank and the model's. LoRA on the experts adds each expert's
/// `s · (x_e A_eᵀ) B_eᵀ` to its rows of gate|up and of the output after
/// the frozen GEMM (and its dequantised stack) is done.
fn experts_ffn<B: Backend>(
    dev: &mut Device<B>,
    (p, mi, lora): (&[T<B>], MoeIndex, ExpertLora<'_>),
    xs: &T<B>,
    counts: &[usize],
    (i, c): (usize, usize),
    (out, saved): (Category, &[(usize, DType)]),
) -> Result<Ffn<B>, OomError> {
    let (rows, dt, act) = (xs.len / c, xs.dtype, Category::Activations);
    let el = counts.len();
    let mut h = dev.alloc(rows * 2 * i, dt, act)?;
    with_stacked(dev, &p[mi.up], el * 2 * i * c, dt, |dev, w| {
        dev.grouped_matmul_forward(&mut h, xs, w, counts, c, 2 * i)
    })?;
    let mut ts = Vec::new();
    let up = (Proj::ExpertUp, 2 * i);
    lora_experts_forward(dev, p, lora, up, xs, &mut h, counts, &mut ts)?;
    let mut a = dev.alloc(rows * i, dt, act)?;
    dev.swiglu_forward(&mut a, &h, rows, i);
    let extra = alloc_saved(dev, saved)?;
    let mut eo = dev.alloc(rows * c, dt, out)?;
    with_stacked(dev, &p[mi.down], el * c * i, dt, |dev, w| {
        dev.grouped_matmul_forward(&mut eo, &a, w, counts, i, c)
    })?;
    let down = (Proj::ExpertDown, c);
    lora_experts_forward(dev, p, lora, down, &a, &mut eo, counts, &mut ts)?;
    Ok((h, a, extra, eo, ts))
}

/// LoRA on one of the experts' grouped GEMMs, whose input is `xs (rows,
/// in)`, grouped by expert as `counts` says, and whose output is `out
/// (rows, cols)`: for each adapter on `proj`, per expert `t_e = x_e A_eᵀ
/// (rows_e, r)` (saved, pushed onto `saved`) and `s · t_e B_eᵀ` added into
/// the adapter's columns of `out`. Each is one grouped GEMM over the
/// same groups as the experts' own.
#[allow(clippy::too_many_arguments)]
fn lora_experts_forward<B: Backend>(
    dev: &mut Device<B>,
    p: &[T<B>],
    (ads, scale): ExpertLora<'_>,
    (proj, cols): (Proj, usize),
    xs: &T<B>,
    out: &mut T<B>,
    counts: &[usize],
    saved: &mut Vec<T<B>>,
) -> Result<(), OomError> {
    let (rows, el) = (out.len / cols, counts.len());
    for ad in ads.iter().filter(|a| a.proj == proj) {
        let r = p[ad.a].len / (el * ad.inp);
        let mut t = dev.alloc(rows * r, xs.dtype, Category::Activations)?;
        dev.grouped_matmul_forward(&mut t, xs, &p[ad.a], counts, ad.inp, r);
        let mut u = dev.alloc(rows * ad.width, xs.dtype, Category::Temporaries)?;
        dev.grouped_matmul_forward(&mut u, &t, &p[ad.b], counts, r, ad.width);
        dev.copy_cols(
            out, cols, ad.off, &u, ad.width, 0, rows, ad.width, scale, true,
        );
        dev.free(u);
        saved.push(t);
    }
    Ok(())
}

/// The backward of [`lora_experts_forward`] on `proj`: from the GEMM's
/// output gradient `dout (rows, cols)` and its saved input `xs`,
/// accumulates each expert's `dB_e` and `dA_e` and adds the adapters' part
/// of the input gradient into `dinp (rows, in)`; frees `ts`, the saved
/// `x_e A_eᵀ` of the adapters on `proj`, in their order.
#[allow(clippy::too_many_arguments)]
fn lora_experts_backward<B: Backend>(
    dev: &mut Device<B>,
    (p, g): (&[T<B>], &mut [T<B>]),
    (ads, scale): ExpertLora<'_>,
    ts: Vec<T<B>>,
    (proj, cols): (Proj, usize),
    (dout, xs): (&T<B>, &T<B>),
    dinp: &mut T<B>,
    counts: &[usize],
) -> Result<(), OomError> {
    let (rows, el, tmp) = (dout.len / cols, counts.len(), Category::Temporaries);
    for (ad, t) in ads.iter().filter(|a| a.proj == proj).zip(ts) {
        let r = p[ad.a].len / (el * ad.inp);
        // d(t_e B_eᵀ) = s · dout[:, slice]
        let mut du = dev.alloc(rows * ad.width, dout.dtype, tmp)?;
        dev.copy_cols(
            &mut du, ad.width, 0, dout, cols, ad.off, rows, ad.width, scale, false,
        );
        let mut dt = dev.alloc(rows * r, dout.dtype, tmp)?;
        let (pb, gb) = (&p[ad.b], Some(&mut g[ad.b]));
        dev.grouped_matmul_backward(&mut dt, gb, &du, &t, pb, counts, r, ad.width);
        dev.free(du);
        dev.free(t);
        let mut dx = dev.alloc(rows * ad.inp, dout.dtype, tmp)?;
        let (pa, ga) = (&p[ad.a], Some(&mut g[ad.a]));
        dev.grouped_matmul_backward(&mut dx, ga, &dt, xs, pa, counts, ad.inp, r);
        dev.free(dt);
        let len = rows * ad.inp;
        dev.copy_cols(dinp, len, 0, &dx, len, 0, 1, len, 1.0, true);
        dev.free(dx);
    }
    Ok(())
}

/// Runs `f` on a stacked expert weight as one grouped GEMM reads it:
/// under QLoRA a dequantised copy (`numel` values: every expert this rank
/// holds) in the rows' dtype `dt`, a tracked temporary freed right after;
/// the backward dequantises again rather than keeping it. A stacked
/// weight is NF4 exactly when its storage is bytes
/// (`init::alloc_nf4_params`). The whole stack at once, as bitsandbytes'
/// `Bnb4bitParametrization` dequantises a parameter
/// (`bitsandbytes/nn/parametrize.py`); bitsandbytes' `Experts4bit`
/// dequantises one expert at a time instead (docs/moe.md).
fn with_stacked<B: Backend, R>(
    dev: &mut Device<B>,
    w: &T<B>,
    numel: usize,
    dt: DType,
    f: impl FnOnce(&mut Device<B>, &T<B>) -> R,
) -> Result<R, OomError> {
    let wq = dequant(dev, w, numel, w.dtype == DType::U8, dt)?;
    let r = f(dev, wq.as_ref().unwrap_or(w));
    dev.free_opt(wq);
    Ok(r)
}

/// The experts' outputs weighted back into their tokens: added into the
/// shared expert's output `dense` when there is one, else into a new
/// `(N, C)` temporary.
pub(super) fn combine<B: Backend>(
    dev: &mut Device<B>,
    a: &MoeActs<T<B>>,
    dense: Option<T<B>>,
    sh: MoeShape,
) -> Result<T<B>, OomError> {
    let (n, c) = (sh.n, sh.c);
    let mut y = match dense {
        Some(y) => y,
        None => dev.alloc_zeroed(n * c, a.eo.dtype, Category::Temporaries)?,
    };
    dev.moe_scatter(&mut y, &a.eo, &a.idx, Some(&a.weight), (sh.rows(), n, c));
    Ok(y)
}

/// The weights, their gradients, and whether they are frozen.
type Weights<'a, B> = (&'a [T<B>], &'a mut [T<B>], bool);

/// The routed experts' backward from the block output's gradient `dy`:
/// the experts' and the router's weight gradients accumulated (none when
/// `frozen`), and the gradient of their input `x` added into `dx` (the
/// shared expert's) or returned new. `aux_scale` is d loss / d this
/// micro-batch's load-balancing loss. `fresh`: hf-eager's autograd, which
/// makes each stacked weight's gradient anew (`Some(set_to_none)`, see
/// [`fresh_grad`]). `router_dx`: whether the replicated router's input
/// gradient is added (under tensor parallelism, on the group's first rank
/// only: the experts' part is each rank's partial sum, which the caller
/// reduces). Frees what the block saved.
pub(super) fn backward<B: Backend>(
    dev: &mut Device<B>,
    ((p, g, frozen), ep, fresh, router_dx): (
        Weights<'_, B>,
        Option<&mut Ep<B>>,
        Option<bool>,
        bool,
    ),
    (mi, lora): (MoeIndex, ExpertLora<'_>),
    m: &MoeConfig,
    a: MoeActs<T<B>>,
    (dy, x): (&T<B>, &T<B>),
    dx: Option<T<B>>,
    sh: MoeShape,
    aux_scale: f32,
) -> Result<T<B>, OomError> {
    let (n, c, e, i, rows) = (sh.n, sh.c, sh.e, sh.i, sh.rows());
    let (dt, edt, tmp) = (dy.dtype, a.xp.dtype, Category::Temporaries);
    let fresh = fresh.filter(|_| !frozen);
    let dims = (rows, n, c);
    // The combine: each row's weight gradient, and the experts' output gradient.
    let mut dweight = dev.alloc_f32(rows, tmp)?;
    dev.moe_row_dots(&mut dweight, dy, &a.eo, &a.idx, dims);
    let mut deo = dev.alloc(rows * c, edt, tmp)?;
    dev.moe_gather(&mut deo, dy, &a.idx, Some(&a.weight), dims);
    // Each saved tensor is freed once the last op that reads it has run, as
    // autograd frees a node's saved tensors after the node.
    let MoeActs {
        probs,
        idx,
        weight,
        xp,
        h,
        act,
        eo,
        extra,
        routing,
        counts,
        ep: exchanged,
        lora_t,
    } = a;
    dev.free(eo);
    // Expert parallelism: the gradients go where the experts ran, in
    // their order there.
    let mut ep = ep.zip(exchanged);
    let got = ep.as_ref().map_or(rows, |(_, (ex, _))| ex.received());
    if let Some((ep, (ex, sort))) = ep.as_mut() {
        let der = expert::all_to_all(dev, ep, &deo, ex, (c, false, tmp))?;
        dev.free(deo);
        deo = dev.alloc(got * c, edt, tmp)?;
        dev.moe_gather(&mut deo, &der, sort, None, (got, got, c));
        dev.free(der);
    }
    // The experts, down then gate|up. (Each expert's rows: `counts` has
    // one per local expert.)
    let saved = (xp, h, act, extra, lora_t);
    let pg = ((p, &mut *g, frozen), fresh);
    let mut dxp = experts_backward(dev, pg, (mi, lora), saved, deo, &counts, (i, c))?;
    if let Some((ep, (ex, sort))) = ep.as_mut() {
        let mut dxr = dev.alloc_zeroed(got * c, edt, tmp)?;
        dev.moe_scatter(&mut dxr, &dxp, sort, None, (got, got, c));
        dev.free(dxp);
        dxp = expert::all_to_all(dev, ep, &dxr, ex, (c, true, tmp))?;
        dev.free(dxr);
    }
    if let Some((_, (_, sort))) = ep {
        dev.free(sort);
    }
    // The dispatch: each row's gradient back to its token.
    let mut dx = match dx {
        Some(dx) => dx,
        None => dev.alloc_zeroed(n * c, dt, tmp)?,
    };
    dev.moe_scatter(&mut dx, &dxp, &idx, None, dims);
    dev.free(dxp);
    dev.free(idx);
    dev.free(weight);
    // The router: its logits' gradient, made on the host from the routing.
    let mut dlogits = dev.alloc(n * e, dt, tmp)?;
    if let (Some(r), Some(dw)) = (&routing, dev.be.download_f32(&dweight.buf)) {
        let dl = router_grad(r, &dw, m, aux_scale);
        dev.be.upload_f32(&mut dlogits.buf, &dl);
    }
    dev.free(dweight);
    let mut dxr = dev.alloc(n * c, dt, tmp)?;
    let dw = (!frozen).then(|| &mut g[mi.router]);
    dev.matmul_backward(&mut dxr, dw, None, &dlogits, x, &p[mi.router], n, c, e);
    dev.free(dlogits);
    if router_dx {
        dev.copy_slice(&mut dx, 0, &dxr, 0, n * c, true);
    }
    dev.free(dxr);
    dev.free(probs);
    Ok(dx)
}

/// The saved `xp`, `h`, `act`, the extras and the adapters' `x_e A_eᵀ`.
type FfnSaved<B> = (T<B>, T<B>, T<B>, Vec<T<B>>, Vec<T<B>>);

/// The experts' FFN backward on the rows this rank's experts ran: from
/// their output gradient `deo (rows, C)` back through down, SwiGLU and
/// gate|up (each with its adapters) to the rows' input gradient, returned;
/// weight gradients as [`backward`] says. Frees `deo` and what
/// [`experts_ffn`] saved, each after the last op that reads it.
fn experts_backward<B: Backend>(
    dev: &mut Device<B>,
    ((p, g, frozen), fresh): (Weights<'_, B>, Option<bool>),
    (mi, lora): (MoeIndex, ExpertLora<'_>),
    (xp, h, act, extra, mut lora_t): FfnSaved<B>,
    deo: T<B>,
    counts: &[usize],
    (i, c): (usize, usize),
) -> Result<T<B>, OomError> {
    let (edt, tmp, el) = (xp.dtype, Category::Temporaries, counts.len());
    let got = xp.len / c;
    // The adapters' saved inputs: gate|up's first, as the forward made them.
    let ups = (lora.0.iter()).filter(|a| a.proj == Proj::ExpertUp).count();
    let down_t = lora_t.split_off(ups);
    let mut dact = dev.alloc(got * i, edt, tmp)?;
    let made = fresh_grad(dev, (p, g), mi.down, fresh)?;
    let dw = (!frozen).then(|| &mut g[mi.down]);
    with_stacked(dev, &p[mi.down], el * c * i, edt, |dev, w| {
        dev.grouped_matmul_backward(&mut dact, dw, &deo, &act, w, counts, i, c)
    })?;
    fresh_grad_handed(dev, g, mi.down, (fresh, made));
    let down = (Proj::ExpertDown, c);
    lora_experts_backward(
        dev,
        (p, g),
        lora,
        down_t,
        down,
        (&deo, &act),
        &mut dact,
        counts,
    )?;
    dev.free(deo);
    dev.free(act);
    let mut dh = dev.alloc(got * 2 * i, edt, tmp)?;
    dev.swiglu_backward(&mut dh, &dact, &h, got, i);
    dev.free(dact);
    dev.free(h);
    for x in extra {
        dev.free(x);
    }
    let mut dxp = dev.alloc(got * c, edt, tmp)?;
    let made = fresh_grad(dev, (p, g), mi.up, fresh)?;
    let dw = (!frozen).then(|| &mut g[mi.up]);
    with_stacked(dev, &p[mi.up], el * 2 * i * c, edt, |dev, w| {
        dev.grouped_matmul_backward(&mut dxp, dw, &dh, &xp, w, counts, c, 2 * i)
    })?;
    fresh_grad_handed(dev, g, mi.up, (fresh, made));
    let up = (Proj::ExpertUp, 2 * i);
    lora_experts_backward(dev, (p, g), lora, lora_t, up, (&dh, &xp), &mut dxp, counts)?;
    dev.free(dh);
    dev.free(xp);
    Ok(dxp)
}

/// A stacked expert weight's gradient as PyTorch's autograd makes it
/// (hf-eager; `fresh` is `Some(set_to_none)`): `grouped_mm`'s backward
/// returns a new weight-sized tensor (aten `_grouped_mm`'s derivative,
/// transformers' `_grouped_mm_fallback_backward` alike), which MemTracker
/// counts as a temporary until AccumulateGrad's hook hands it over. With
/// `set_to_none` it becomes `.grad` (the engine's gradient, made here
/// rather than with its block's); with resident gradients it is added
/// into `.grad` and freed: a gradient-sized stand-in, returned, while the
/// engine accumulates in place. These outweigh the loss's temporaries for
/// a mixture (Mixtral's gate|up: E x 2I x C), unlike any dense weight.
fn fresh_grad<B: Backend>(
    dev: &mut Device<B>,
    (p, g): (&[T<B>], &mut [T<B>]),
    w: usize,
    fresh: Option<bool>,
) -> Result<Option<T<B>>, OomError> {
    let (len, tmp) = (p[w].len, Category::Temporaries);
    match fresh {
        Some(true) if g[w].len == 0 => {
            let t = dev.alloc(len, g[w].dtype, tmp)?;
            let placeholder = std::mem::replace(&mut g[w], t);
            dev.drop_placeholder(placeholder);
            Ok(None)
        }
        Some(false) => Ok(Some(dev.alloc(len, g[w].dtype, tmp)?)),
        _ => Ok(None),
    }
}

/// After the op: AccumulateGrad's hook makes the fresh gradient a
/// gradient (the engine's own, or the stand-in, then freed).
fn fresh_grad_handed<B: Backend>(
    dev: &mut Device<B>,
    g: &mut [T<B>],
    w: usize,
    (fresh, made): (Option<bool>, Option<T<B>>),
) {
    if fresh == Some(true) && g[w].category == Category::Temporaries {
        dev.retag(&mut g[w], Category::Gradients);
    }
    if let Some(mut d) = made {
        dev.retag(&mut d, Category::Gradients);
        dev.free(d);
    }
}

/// Qwen2-MoE's gate on the shared expert: `σ(x gᵀ)` per token (f32), the
/// shared expert's output `ys (N, C)` it scales, kept for the backward,
/// and each token's own index (U32: the combine kernels' identity map).
pub(super) struct GateActs<X> {
    pub ident: X,
    pub sig: X,
    pub ys: X,
}

pub(super) fn free_gate<B: Backend>(dev: &mut Device<B>, g: GateActs<T<B>>) {
    for x in [g.ident, g.sig, g.ys] {
        dev.free(x);
    }
}

/// The gate over `x (N, C)` (the block's normed input), keeping the shared
/// expert's output `ys`.
pub(super) fn gate_forward<B: Backend>(
    dev: &mut Device<B>,
    w: &T<B>,
    x: &T<B>,
    ys: T<B>,
    (n, c): (usize, usize),
) -> Result<GateActs<T<B>>, OomError> {
    let act = Category::Activations;
    let mut s = dev.alloc(n, x.dtype, Category::Temporaries)?;
    dev.matmul_forward(&mut s, x, w, None, n, c, 1);
    let mut sig = dev.alloc_f32(n, act)?;
    let mut ident = dev.alloc(n, DType::U32, act)?;
    if let Some(s) = dev.be.download_f32(&s.buf) {
        let v: Vec<f32> = s.iter().map(|&z| 1.0 / (1.0 + (-z).exp())).collect();
        dev.be.upload_f32(&mut sig.buf, &v);
        dev.be
            .upload_u32(&mut ident.buf, &(0..n as u32).collect::<Vec<_>>());
    }
    dev.free(s);
    Ok(GateActs { ident, sig, ys })
}

/// The gated shared output `σ · ys` into a new `(N, C)` temporary.
pub(super) fn gated<B: Backend>(
    dev: &mut Device<B>,
    g: &GateActs<T<B>>,
    (n, c): (usize, usize),
) -> Result<T<B>, OomError> {
    let mut y = dev.alloc_zeroed(n * c, g.ys.dtype, Category::Temporaries)?;
    dev.moe_scatter(&mut y, &g.ys, &g.ident, Some(&g.sig), (n, n, c));
    Ok(y)
}

/// The gate's backward from the block output's gradient `dy`: the shared
/// expert's output gradient `σ · dy`, and the gate's input gradient (its
/// weight's accumulated into `dw` unless frozen).
pub(super) fn gate_backward<B: Backend>(
    dev: &mut Device<B>,
    (w, dw): (&T<B>, Option<&mut T<B>>),
    g: &GateActs<T<B>>,
    (dy, x): (&T<B>, &T<B>),
    (n, c): (usize, usize),
) -> Result<(T<B>, T<B>), OomError> {
    let (dt, tmp) = (dy.dtype, Category::Temporaries);
    let mut dys = dev.alloc(n * c, dt, tmp)?;
    dev.moe_gather(&mut dys, dy, &g.ident, Some(&g.sig), (n, n, c));
    let mut dsig = dev.alloc_f32(n, tmp)?;
    dev.moe_row_dots(&mut dsig, dy, &g.ys, &g.ident, (n, n, c));
    // dσ/ds = σ (1 - σ).
    let mut ds = dev.alloc(n, dt, tmp)?;
    if let (Some(d), Some(s)) = (
        dev.be.download_f32(&dsig.buf),
        dev.be.download_f32(&g.sig.buf),
    ) {
        let v: Vec<f32> = d.iter().zip(&s).map(|(d, s)| d * s * (1.0 - s)).collect();
        dev.be.upload_f32(&mut ds.buf, &v);
    }
    dev.free(dsig);
    let mut dx = dev.alloc(n * c, dt, tmp)?;
    dev.matmul_backward(&mut dx, dw, None, &ds, x, w, n, c, 1);
    dev.free(ds);
    Ok((dys, dx))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(e: usize, k: usize, norm: bool) -> MoeConfig {
        MoeConfig {
            n_experts: e,
            top_k: k,
            d_expert: 4,
            d_shared: 0,
            shared_gate: false,
            first_dense: 0,
            norm_topk: norm,
            aux_loss_coef: 0.01,
        }
    }

    #[test]
    fn dropless_routes_every_choice_once_in_expert_order() {
        let m = cfg(3, 2, true);
        let sh = MoeShape::new(&m, 2, 4, None);
        // Token t prefers expert t % 3, then (t + 1) % 3.
        let logits: Vec<f32> = (0..4)
            .flat_map(|t| (0..3).map(move |x| [3.0, 1.0, 0.0][(x + 3 - t % 3) % 3]))
            .collect();
        let r = route(&logits, &sh, &m);
        assert_eq!(r.idx.len(), 8);
        assert_eq!(r.counts.iter().sum::<usize>(), 8);
        assert_eq!(r.counts, r.chose);
        // Expert 0: tokens 0 and 3 (first choice), 2 (second choice).
        assert_eq!(&r.idx[..r.counts[0]], &[0, 2, 3]);
        // Renormalised: each token's weights sum to 1.
        for t in 0..4 {
            let s: f32 = r.chosen[2 * t..2 * t + 2].iter().map(|c| c.1).sum();
            assert!((s - 1.0).abs() < 1e-6);
        }
    }

    #[test]
    fn a_capacity_pads_and_drops_by_position() {
        let m = cfg(2, 1, false);
        // Every token prefers expert 0.
        let logits = [2.0, 0.0].repeat(5);
        let sh = MoeShape::new(&m, 2, 5, Some(1.0));
        assert_eq!(sh.cap, Some(3));
        let r = route(&logits, &sh, &m);
        assert_eq!(r.counts, vec![3, 3]);
        assert_eq!(r.idx, vec![0, 1, 2, 5, 5, 5]);
        assert_eq!(r.choice[3..], [None, None, None]);
        assert_eq!(r.chose, vec![5, 0]);
        assert!((r.weight[0] - 1.0 / (1.0 + (-2f32).exp())).abs() < 1e-6);
        // The load-balancing loss: coef · E · f_0 · P̄_0, all on expert 0.
        let p0 = 1.0 / (1.0 + (-2f64).exp());
        assert!((r.aux - 0.01 * 2.0 * p0).abs() < 1e-7, "{}", r.aux);
    }

    /// The router's gradient against central differences of the loss
    /// `Σ_j dweight_j · w_j + s · aux`, for both weightings.
    #[test]
    fn router_gradient_matches_finite_differences() {
        for norm in [false, true] {
            let m = cfg(4, 2, norm);
            let (n, e) = (3, 4);
            let sh = MoeShape::new(&m, 2, n, None);
            let logits: Vec<f32> = (0..n * e)
                .map(|x| ((x * 7 % 11) as f32) * 0.3 - 1.0)
                .collect();
            let r = route(&logits, &sh, &m);
            let dw: Vec<f32> = (0..r.idx.len()).map(|j| 0.5 - 0.13 * j as f32).collect();
            let s = 3.0;
            let got = router_grad(&r, &dw, &m, s);
            let loss = |l: &[f32]| {
                let q = route(l, &sh, &m);
                // The same routing (a small step keeps the top-k), weights moved.
                assert_eq!(q.idx, r.idx);
                (q.weight.iter().zip(&dw))
                    .map(|(w, d)| (w * d) as f64)
                    .sum::<f64>()
                    + s as f64 * q.aux_with_fixed_choice(&r)
            };
            for x in 0..n * e {
                let h = 1e-3;
                let (mut a, mut b) = (logits.clone(), logits.clone());
                a[x] += h;
                b[x] -= h;
                let want = (loss(&a) - loss(&b)) / (2.0 * h as f64);
                assert!(
                    (got[x] as f64 - want).abs() < 2e-3,
                    "norm {norm} logit {x}: {} vs {want}",
                    got[x]
                );
            }
        }
    }

    impl Routing {
        /// The aux loss with the choice counts held at `fixed`'s (they are
        /// not differentiable: f_e is a count).
        fn aux_with_fixed_choice(&self, fixed: &Routing) -> f64 {
            let e = self.chose.len();
            let n = self.probs.len() / e;
            let k = self.chosen.len() / n;
            let mean_p =
                |x: usize| (0..n).map(|t| self.probs[t * e + x] as f64).sum::<f64>() / n as f64;
            (0..e)
                .map(|x| fixed.chose[x] as f64 / (n * k) as f64 * mean_p(x))
                .sum::<f64>()
                * e as f64
                * 0.01
        }
    }
}
