//! The cpu backend's optimizers: AdamW, 8-bit AdamW, SGD, Adafactor.
//!
//! Same rules as the rest of the cpu backend: flat loops over slices, work cut
//! into fixed pieces that depend only on the shapes, and every reduction done as
//! per-piece `f64` partial sums added in piece order, so results are
//! bit-identical for every thread count (the tests check 1 vs 2 threads).
//!
//! Scratch: none that grows with the tensor. 8-bit AdamW dequantises one
//! 256-element block at a time into stack arrays; Adafactor keeps its
//! `(rows)` and `(cols)` factor vectors (the size of its own state) and
//! recomputes the update in a second pass rather than storing it, because an
//! `n`-element update buffer would be memory the engine does not account for.
//! The only other memory is the two 256-entry dynamic quantisation maps
//! (2 KiB in all, built once per process, see [`signed_map`]).

use std::sync::OnceLock;

use rayon::prelude::*;

use super::math::vectorized;
use super::{CpuBackend, CpuBuf};
use crate::backend::{AdafactorHyper, AdafactorSecond, AdafactorState, AdamHyper, SgdHyper};

/// Elements per rayon task for the elementwise passes (as in `math.rs`).
const ELEMS_PER_TASK: usize = 1 << 14;
/// Elements per quantisation block of 8-bit AdamW (bitsandbytes' blockwise
/// optimizers use 256 on the cpu path and in Dettmers et al. 2022).
pub(super) const QBLOCK: usize = 256;
/// Blocks per rayon task: one task covers `ELEMS_PER_TASK` elements.
const BLOCKS_PER_TASK: usize = ELEMS_PER_TASK / QBLOCK;
/// Columns per task in Adafactor's column means (each task owns its columns
/// and walks all rows, so nothing is summed across threads).
const COLS_PER_TASK: usize = 64;

// ----------------------------------------------------------------------------
// AdamW

// param, grad, m, v (N).
pub fn adamw(
    be: &mut CpuBackend,
    param: &mut CpuBuf,
    grad: &CpuBuf,
    m: &mut CpuBuf,
    v: &mut CpuBuf,
    n: usize,
    h: AdamHyper,
) {
    let param = &mut param.wide_mut()[..n];
    let grad = &grad.wide()[..n];
    let m = &mut m.wide_mut()[..n];
    let v = &mut v.wide_mut()[..n];
    be.pool.install(|| {
        param
            .par_chunks_mut(ELEMS_PER_TASK)
            .zip(m.par_chunks_mut(ELEMS_PER_TASK))
            .zip(v.par_chunks_mut(ELEMS_PER_TASK))
            .zip(grad.par_chunks(ELEMS_PER_TASK))
            .for_each(|(((p, m), v), g)| {
                vectorized(
                    #[inline(always)]
                    || {
                        for (((p, m), v), &g) in
                            p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g)
                        {
                            let g = g * h.grad_scale;
                            *m = h.beta1 * *m + (1.0 - h.beta1) * g;
                            *v = h.beta2 * *v + (1.0 - h.beta2) * g * g;
                            let m_hat = *m * h.m_corr;
                            let v_hat = *v * h.v_corr;
                            *p -= h.lr * (m_hat / (v_hat.sqrt() + h.eps) + h.weight_decay * *p);
                        }
                    },
                )
            })
    });
}

// ----------------------------------------------------------------------------
// dynamic quantisation maps (8-bit AdamW)

/// bitsandbytes' dynamic data type, `create_dynamic_map(signed,
/// max_exponent_bits=7, total_bits=8)` (Dettmers et al., 8-bit Optimizers via
/// Block-wise Quantization, 2022, sec. 2.2; after Dettmers, 8-Bit
/// Approximations for Parallelism in Deep Learning, 2016), rebuilt from its
/// definition: for each decade `i = 0..7` the interval `[0.1, 1]` is cut into
/// `k` equal pieces by `linspace(0.1, 1, k+1)` and the piece midpoints are
/// scaled by `10^(i-6)`; `k = 2^i` signed (each value also negated), `k =
/// 2^(i+1)` unsigned; then `0` and `1` are added and the list is sorted.
/// Signed: 2*127 + 2 = 256 entries, unsigned: 254 + 2 = 256.
///
/// Computed in `f64` and rounded once to `f32`; bitsandbytes builds its table
/// with `f32` torch ops, so an entry may differ from it in the last ulp.
fn build_dynamic_map(signed: bool) -> [f32; 256] {
    const MAX_EXPONENT_BITS: i32 = 7;
    // total_bits - 1 for both signs: bitsandbytes keeps the sign bit's slot in
    // the unsigned map and spends it on doubling the fraction items instead.
    const NON_SIGN_BITS: i32 = 7;
    let mut data: Vec<f64> = Vec::with_capacity(256);
    for i in 0..MAX_EXPONENT_BITS {
        let extra = if signed { 0 } else { 1 };
        let pieces = 1usize << (i + NON_SIGN_BITS - MAX_EXPONENT_BITS + extra);
        let scale = 10f64.powi(i - (MAX_EXPONENT_BITS - 1));
        // boundaries b_k = 0.1 + 0.9*k/pieces, k = 0..=pieces; means of neighbours
        let b = |k: usize| 0.1 + 0.9 * k as f64 / pieces as f64;
        for k in 0..pieces {
            let mean = (b(k) + b(k + 1)) / 2.0;
            data.push(scale * mean);
            if signed {
                data.push(-scale * mean);
            }
        }
    }
    data.push(0.0);
    data.push(1.0);
    assert_eq!(data.len(), 256, "dynamic map must have 2^8 entries");
    data.sort_by(f64::total_cmp);
    let mut out = [0.0f32; 256];
    for (o, &d) in out.iter_mut().zip(&data) {
        *o = d as f32;
    }
    out
}

/// The signed dynamic map (first moment), ascending, `[-0.99296875, 1]`:
/// 127 negative entries, 0 at index 127, 128 positive ones ending at 1.0.
/// A backend constant of 1 KiB, built once per process.
pub(crate) fn signed_map() -> &'static [f32; 256] {
    static MAP: OnceLock<[f32; 256]> = OnceLock::new();
    MAP.get_or_init(|| build_dynamic_map(true))
}

/// The unsigned dynamic map (second moment), ascending, `[0, 1]`, 0 at index 0.
/// A backend constant of 1 KiB, built once per process.
pub(crate) fn unsigned_map() -> &'static [f32; 256] {
    static MAP: OnceLock<[f32; 256]> = OnceLock::new();
    MAP.get_or_init(|| build_dynamic_map(false))
}

/// Index of the entry of `map` (ascending) nearest to `x`; ties go to the
/// lower index; values outside the map's range clamp to its ends. A NaN gets
/// `zero`, the code of 0.0, so no code ever stands for NaN.
#[inline(always)]
fn quantize(map: &[f32; 256], x: f32, zero: u8) -> u8 {
    if x.is_nan() {
        return zero;
    }
    // c = number of entries < x, found by binary lifting over the sorted map:
    // map[i + s - 1] < x  <=>  c >= i + s. The steps sum to 255, so a last
    // check decides between 255 and 256.
    let mut c = 0usize;
    let mut s = 128;
    while s > 0 {
        if map[c + s - 1] < x {
            c += s;
        }
        s >>= 1;
    }
    if map[c] < x {
        c += 1;
    }
    if c == 0 {
        return 0;
    }
    if c == 256 {
        return 255;
    }
    // map[c-1] < x <= map[c]: the nearer of the two (distances in f64, where
    // the difference of two f32 in this range is exact).
    let (lo, hi) = (map[c - 1] as f64, map[c] as f64);
    let x = x as f64;
    if hi - x < x - lo {
        c as u8
    } else {
        (c - 1) as u8
    }
}

/// One 256-block (or the shorter last block) of 8-bit AdamW. `p, g, mc, vc`
/// `(len <= 256)`; `ma, va` the block's absmax. Dequantise, AdamW in fp32
/// (the param update uses the fp32 states, as bitsandbytes' blockwise kernel
/// does), then requantise against the new absmax of each state.
#[inline(always)]
fn adamw8bit_block(
    p: &mut [f32],
    g: &[f32],
    mc: &mut [u8],
    vc: &mut [u8],
    ma: &mut f32,
    va: &mut f32,
    h: &AdamHyper,
) {
    let (smap, umap) = (signed_map(), unsigned_map());
    let len = p.len();
    let mut mf = [0.0f32; QBLOCK];
    let mut vf = [0.0f32; QBLOCK];
    let (m_scale, v_scale) = (*ma, *va);
    let (mut m_max, mut v_max) = (0.0f32, 0.0f32);
    for j in 0..len {
        // a fresh state (all codes 0, absmax 0) dequantises to zeros: any
        // code times absmax 0 is 0.
        let m = smap[mc[j] as usize] * m_scale;
        let v = umap[vc[j] as usize] * v_scale;
        // exactly `adamw` above
        let g = g[j] * h.grad_scale;
        let m = h.beta1 * m + (1.0 - h.beta1) * g;
        let v = h.beta2 * v + (1.0 - h.beta2) * g * g;
        let m_hat = m * h.m_corr;
        let v_hat = v * h.v_corr;
        p[j] -= h.lr * (m_hat / (v_hat.sqrt() + h.eps) + h.weight_decay * p[j]);
        mf[j] = m;
        vf[j] = v;
        // f32::max ignores a NaN operand, so one NaN cannot poison the block's scale
        m_max = m_max.max(m.abs());
        v_max = v_max.max(v);
    }
    *ma = m_max;
    *va = v_max;
    let (m_zero, v_zero) = (127u8, 0u8); // indices of 0.0 in the maps
    for j in 0..len {
        // absmax 0 -> 0/0 = NaN -> the code of 0; so is a NaN state value.
        mc[j] = quantize(smap, mf[j] / m_max, m_zero);
        vc[j] = quantize(umap, vf[j] / v_max, v_zero);
    }
}

/// 8-bit AdamW on `n` elements: `param, grad (n)` f32, `m, v (n)` u8 codes,
/// `m_absmax, v_absmax (ceil(n/256))` f32. Blocks are independent, so tasks
/// take fixed groups of 64 blocks and the result does not depend on threads.
/// A non-finite gradient never reaches here (the engine skips the step); a NaN
/// state would be stored as the code of 0.
pub fn adamw8bit(
    be: &mut CpuBackend,
    param: &mut CpuBuf,
    grad: &CpuBuf,
    m: &mut CpuBuf,
    v: &mut CpuBuf,
    m_absmax: &mut CpuBuf,
    v_absmax: &mut CpuBuf,
    n: usize,
    h: AdamHyper,
) {
    let nb = n.div_ceil(QBLOCK);
    let param = &mut param.wide_mut()[..n];
    let grad = &grad.wide()[..n];
    let m = &mut m.as_u8_mut()[..n];
    let v = &mut v.as_u8_mut()[..n];
    let ma = &mut m_absmax.wide_mut()[..nb];
    let va = &mut v_absmax.wide_mut()[..nb];
    be.pool.install(|| {
        param
            .par_chunks_mut(ELEMS_PER_TASK)
            .zip(grad.par_chunks(ELEMS_PER_TASK))
            .zip(m.par_chunks_mut(ELEMS_PER_TASK))
            .zip(v.par_chunks_mut(ELEMS_PER_TASK))
            .zip(ma.par_chunks_mut(BLOCKS_PER_TASK))
            .zip(va.par_chunks_mut(BLOCKS_PER_TASK))
            .for_each(|(((((p, g), mc), vc), ma), va)| {
                for (((((p, g), mc), vc), ma), va) in p
                    .chunks_mut(QBLOCK)
                    .zip(g.chunks(QBLOCK))
                    .zip(mc.chunks_mut(QBLOCK))
                    .zip(vc.chunks_mut(QBLOCK))
                    .zip(ma.iter_mut())
                    .zip(va.iter_mut())
                {
                    adamw8bit_block(p, g, mc, vc, ma, va, &h);
                }
            })
    });
}

// ----------------------------------------------------------------------------
// SGD

/// SGD with momentum on `param, grad, momentum_buf (n)`, PyTorch's
/// `torch.optim.SGD` (dampening 0, no Nesterov): `g = grad*grad_scale +
/// wd*param; buf = momentum*buf + g; param -= lr*buf`. PyTorch's first step
/// sets `buf = g`, which is what `momentum*0 + g` gives on the zeroed buffer.
/// With `momentum == 0` PyTorch keeps no buffer, and neither do we:
/// `momentum_buf` is not touched (it may be empty).
pub fn sgd(
    be: &mut CpuBackend,
    param: &mut CpuBuf,
    grad: &CpuBuf,
    momentum_buf: &mut CpuBuf,
    n: usize,
    h: SgdHyper,
) {
    let param = &mut param.wide_mut()[..n];
    let grad = &grad.wide()[..n];
    if h.momentum == 0.0 {
        be.pool.install(|| {
            param
                .par_chunks_mut(ELEMS_PER_TASK)
                .zip(grad.par_chunks(ELEMS_PER_TASK))
                .for_each(|(p, g)| {
                    for (p, &g) in p.iter_mut().zip(g) {
                        let g = g * h.grad_scale + h.weight_decay * *p;
                        *p -= h.lr * g;
                    }
                })
        });
        return;
    }
    let buf = &mut momentum_buf.wide_mut()[..n];
    be.pool.install(|| {
        param
            .par_chunks_mut(ELEMS_PER_TASK)
            .zip(buf.par_chunks_mut(ELEMS_PER_TASK))
            .zip(grad.par_chunks(ELEMS_PER_TASK))
            .for_each(|((p, b), g)| {
                for ((p, b), &g) in p.iter_mut().zip(b.iter_mut()).zip(g) {
                    let g = g * h.grad_scale + h.weight_decay * *p;
                    *b = h.momentum * *b + g;
                    *p -= h.lr * *b;
                }
            })
    });
}

// ----------------------------------------------------------------------------
// Adafactor

/// Sum of `f(x)` over `x` in `f64` with 8 fixed accumulator lanes: the lanes
/// let the loop vectorise and their layout is fixed, so the result depends
/// only on `x`.
#[inline(always)]
fn sum_f64(x: &[f32], f: impl Fn(f32) -> f64) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = x.chunks_exact(8);
    let rest: f64 = chunks.remainder().iter().map(|&v| f(v)).sum();
    for c in chunks {
        for j in 0..8 {
            acc[j] += f(c[j]);
        }
    }
    acc.iter().sum::<f64>() + rest
}

/// Sum of squares of `x` (n): per-task partial sums over fixed chunks, added
/// in chunk order (as `sum_squares` in `loss.rs`).
fn sum_squares(be: &CpuBackend, x: &[f32]) -> f64 {
    let partial: Vec<f64> = be.pool.install(|| {
        x.par_chunks(ELEMS_PER_TASK)
            .map(|c| sum_f64(c, |v| v as f64 * v as f64))
            .collect()
    });
    partial.iter().sum()
}

/// Per-step scalars of the final Adafactor pass.
#[derive(Clone, Copy)]
struct Finish {
    /// `max(1, RMS(update)/clip_threshold)`.
    clip_div: f32,
    lr: f32,
    beta1: f32,
    /// `-weight_decay*lr`, 0 when there is no weight decay.
    neg_wd_lr: f32,
}

/// The end of an Adafactor step for one element, given its raw update `u`.
/// Hugging Face scales the update by `lr` *before* the first moment, so `m`
/// holds lr-scaled updates; weight decay then updates `p` from its own value.
#[inline(always)]
fn finish(p: &mut f32, m: Option<&mut f32>, u: f32, k: Finish) {
    let u = u / k.clip_div * k.lr;
    let u = match m {
        Some(m) => {
            *m = k.beta1 * *m + (1.0 - k.beta1) * u;
            *m
        }
        None => u,
    };
    if k.neg_wd_lr != 0.0 {
        *p += k.neg_wd_lr * *p;
    }
    *p -= u;
}

/// Adafactor (Shazeer & Stern, Adafactor: Adaptive Learning Rates with
/// Sublinear Memory Cost, 2018) as `transformers.optimization.Adafactor`
/// implements it, with the step described at [`AdafactorHyper`]. `param, grad
/// (n)`; factored: `row (rows)`, `col (cols)`, param row-major `(rows, cols)`;
/// full: `v (n)`; `m (n)` with `beta1`.
///
/// Differences from a literal reading of the [`AdafactorHyper`] doc, all of
/// them Hugging Face's behaviour: `lr_t` scales the update before the first
/// moment (`m = beta1*m + (1-beta1)*lr_t*update; param -= m`), `RMS(param)`
/// is taken before the update, and `scale_parameter` applies with an explicit
/// `lr` too.
pub fn adafactor(
    be: &mut CpuBackend,
    param: &mut CpuBuf,
    grad: &CpuBuf,
    st: AdafactorState<'_, CpuBuf>,
    h: AdafactorHyper,
) {
    assert!(h.step >= 1, "adafactor: the step is 1-based");
    let n = match &st.second {
        AdafactorSecond::Factored { rows, cols, .. } => rows * cols,
        AdafactorSecond::Full { n, .. } => *n,
    };
    if n == 0 {
        return;
    }
    let param = &mut param.wide_mut()[..n];
    let grad = &grad.wide()[..n];
    // the first moment only exists with beta1
    let mut m = match h.beta1 {
        Some(_) => st.m.map(|m| m.wide_mut()),
        None => None,
    };
    let m = m.as_deref_mut().map(|m| &mut m[..n]);

    // HF `_get_lr`: relative step min(1e-2, 1/sqrt(t)) unless lr is given, times
    // max(eps2, RMS(param)) with scale_parameter, RMS of the param before this step.
    let t = h.step as f64;
    let rel = match h.lr {
        Some(lr) => lr as f64,
        None => (1.0 / t.sqrt()).min(1e-2),
    };
    let scale = if h.scale_parameter {
        let rms = (sum_squares(be, param) / n as f64).sqrt();
        (h.eps2 as f64).max(rms)
    } else {
        1.0
    };
    let lr_t = (rel * scale) as f32;
    // beta2_t = 1 - t^decay_rate (0 at t = 1: the first step takes u as is)
    let beta2t = (1.0 - t.powf(h.decay_rate as f64)) as f32;
    let (gs, eps1) = (h.grad_scale, h.eps1);
    let neg_wd_lr = if h.weight_decay != 0.0 {
        (-(h.weight_decay as f64) * lr_t as f64) as f32
    } else {
        0.0
    };
    let beta1 = h.beta1.unwrap_or(0.0);
    assert!(
        h.beta1.is_none() || m.is_some(),
        "adafactor: beta1 is set but there is no first-moment buffer"
    );
    let s = AdafactorStep {
        n,
        beta2t,
        gs,
        eps1,
        lr_t,
        beta1,
        neg_wd_lr,
        clip_threshold: h.clip_threshold,
    };
    match st.second {
        AdafactorSecond::Factored {
            row,
            col,
            rows,
            cols,
        } => {
            let row = &mut row.wide_mut()[..rows];
            let col = &mut col.wide_mut()[..cols];
            adafactor_factored(be, param, grad, m, (row, col), cols, s);
        }
        AdafactorSecond::Full { v, .. } => {
            adafactor_full(be, param, grad, m, &mut v.wide_mut()[..n], s)
        }
    }
}

/// One Adafactor step's scalars, from the hyper-parameters and the step.
#[derive(Clone, Copy)]
struct AdafactorStep {
    n: usize,
    /// `1 - t^decay_rate`.
    beta2t: f32,
    /// The gradient's scale.
    gs: f32,
    eps1: f32,
    lr_t: f32,
    beta1: f32,
    neg_wd_lr: f32,
    clip_threshold: f32,
}

impl AdafactorStep {
    /// u = g^2 + eps1 with g = grad*grad_scale, in f32 as HF does, summed in f64
    fn u(self, x: f32) -> f64 {
        let g = x * self.gs;
        (g * g + self.eps1) as f64
    }

    /// The finishing constants, given the sum of the update's squares.
    fn finish(self, sumsq: f64) -> Finish {
        Finish {
            clip_div: ((sumsq / self.n as f64).sqrt() / self.clip_threshold as f64).max(1.0) as f32,
            lr: self.lr_t,
            beta1: self.beta1,
            neg_wd_lr: self.neg_wd_lr,
        }
    }
}

/// The factored second moment: `row (rows)`, `col (cols)`, param and grad
/// row-major `(rows, cols)`.
fn adafactor_factored(
    be: &mut CpuBackend,
    param: &mut [f32],
    grad: &[f32],
    m: Option<&mut [f32]>,
    (row, col): (&mut [f32], &mut [f32]),
    cols: usize,
    s: AdafactorStep,
) {
    let rows = row.len();
    let (beta2t, gs) = (s.beta2t, s.gs);
    let u = move |x: f32| s.u(x);
    // whole rows per task, so every row's sum stays in one task
    let rpt = (ELEMS_PER_TASK / cols).max(1);
    be.pool.install(|| {
        // row (rows) = beta2t*row + (1-beta2t)*mean over cols of u
        row.par_chunks_mut(rpt)
            .zip(grad.par_chunks(rpt * cols))
            .for_each(|(r, g)| {
                for (r, g) in r.iter_mut().zip(g.chunks(cols)) {
                    let mean = (sum_f64(g, u) / cols as f64) as f32;
                    *r = beta2t * *r + (1.0 - beta2t) * mean;
                }
            });
        // col (cols) = beta2t*col + (1-beta2t)*mean over rows of u;
        // each task owns COLS_PER_TASK columns and walks all rows in order.
        col.par_chunks_mut(COLS_PER_TASK)
            .enumerate()
            .for_each(|(ci, c)| {
                let j0 = ci * COLS_PER_TASK;
                let mut acc = [0.0f64; COLS_PER_TASK];
                for r in 0..rows {
                    let g = &grad[r * cols + j0..r * cols + j0 + c.len()];
                    for (a, &x) in acc.iter_mut().zip(g) {
                        *a += u(x);
                    }
                }
                for (c, a) in c.iter_mut().zip(acc) {
                    let mean = (a / rows as f64) as f32;
                    *c = beta2t * *c + (1.0 - beta2t) * mean;
                }
            });
    });
    // HF `_approx_sq_grad` on the NEW row/col:
    // r_factor (rows) = rsqrt(row / mean(row)), c_factor (cols) = rsqrt(col)
    let row_mean = (sum_f64(row, |x| x as f64) / rows as f64) as f32;
    let rf: Vec<f32> = row.iter().map(|&r| 1.0 / (r / row_mean).sqrt()).collect();
    let cf: Vec<f32> = col.iter().map(|&c| 1.0 / c.sqrt()).collect();
    let (rf, cf) = (&rf[..], &cf[..]);
    // update(i,j) = (r_factor[i]*c_factor[j]) * g(i,j), computed the same way
    // in both passes below so the RMS matches the applied update bit for bit
    let upd = move |i: usize, j: usize, x: f32| (rf[i] * cf[j]) * (x * gs);
    // pass 1: RMS(update), partial sums per row group, added in order
    let partial: Vec<f64> = be.pool.install(|| {
        grad.par_chunks(rpt * cols)
            .enumerate()
            .map(|(ti, g)| {
                let mut s = 0.0f64;
                for (ri, g) in g.chunks(cols).enumerate() {
                    let i = ti * rpt + ri;
                    s += g
                        .iter()
                        .enumerate()
                        .map(|(j, &x)| {
                            let v = upd(i, j, x) as f64;
                            v * v
                        })
                        .sum::<f64>();
                }
                s
            })
            .collect()
    });
    let k = s.finish(partial.iter().sum());
    // pass 2: clip, lr, first moment, weight decay, param update
    be.pool.install(|| match m {
        Some(m) => param
            .par_chunks_mut(rpt * cols)
            .zip(m.par_chunks_mut(rpt * cols))
            .zip(grad.par_chunks(rpt * cols))
            .enumerate()
            .for_each(|(ti, ((p, m), g))| {
                let rows_here = p
                    .chunks_mut(cols)
                    .zip(m.chunks_mut(cols))
                    .zip(g.chunks(cols));
                for (ri, ((p, m), g)) in rows_here.enumerate() {
                    let i = ti * rpt + ri;
                    for (j, ((p, m), &x)) in p.iter_mut().zip(m.iter_mut()).zip(g).enumerate() {
                        finish(p, Some(m), upd(i, j, x), k);
                    }
                }
            }),
        None => param
            .par_chunks_mut(rpt * cols)
            .zip(grad.par_chunks(rpt * cols))
            .enumerate()
            .for_each(|(ti, (p, g))| {
                for (ri, (p, g)) in p.chunks_mut(cols).zip(g.chunks(cols)).enumerate() {
                    let i = ti * rpt + ri;
                    for (j, (p, &x)) in p.iter_mut().zip(g).enumerate() {
                        finish(p, None, upd(i, j, x), k);
                    }
                }
            }),
    });
}

/// The full second moment `v (n)`.
fn adafactor_full(
    be: &mut CpuBackend,
    param: &mut [f32],
    grad: &[f32],
    m: Option<&mut [f32]>,
    v: &mut [f32],
    s: AdafactorStep,
) {
    let (beta2t, gs) = (s.beta2t, s.gs);
    let u = move |x: f32| s.u(x);
    // pass 1: v (n) = beta2t*v + (1-beta2t)*u, and RMS(update) with
    // update = rsqrt(v)*g, partial sums per fixed chunk added in order
    let partial: Vec<f64> = be.pool.install(|| {
        v.par_chunks_mut(ELEMS_PER_TASK)
            .zip(grad.par_chunks(ELEMS_PER_TASK))
            .map(|(v, g)| {
                let mut s = 0.0f64;
                for (v, &x) in v.iter_mut().zip(g) {
                    *v = beta2t * *v + (1.0 - beta2t) * u(x) as f32;
                    let w = ((1.0 / v.sqrt()) * (x * gs)) as f64;
                    s += w * w;
                }
                s
            })
            .collect()
    });
    let k = s.finish(partial.iter().sum());
    let v = &*v;
    // pass 2: recompute the update from the stored v, then finish
    be.pool.install(|| match m {
        Some(m) => param
            .par_chunks_mut(ELEMS_PER_TASK)
            .zip(m.par_chunks_mut(ELEMS_PER_TASK))
            .zip(v.par_chunks(ELEMS_PER_TASK))
            .zip(grad.par_chunks(ELEMS_PER_TASK))
            .for_each(|(((p, m), v), g)| {
                for (((p, m), &v), &x) in p.iter_mut().zip(m.iter_mut()).zip(v).zip(g) {
                    finish(p, Some(m), (1.0 / v.sqrt()) * (x * gs), k);
                }
            }),
        None => param
            .par_chunks_mut(ELEMS_PER_TASK)
            .zip(v.par_chunks(ELEMS_PER_TASK))
            .zip(grad.par_chunks(ELEMS_PER_TASK))
            .for_each(|((p, v), g)| {
                for ((p, &v), &x) in p.iter_mut().zip(v).zip(g) {
                    finish(p, None, (1.0 / v.sqrt()) * (x * gs), k);
                }
            }),
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;
    use crate::backend::cpu::testutil::{FWD, close};

    /// xorshift64*: deterministic inputs without a dependency; uniform in [-1, 1).
    struct Rng(u64);
    impl Rng {
        fn f32(&mut self) -> f32 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let bits = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
            (bits as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.f32()).collect()
        }
        /// Values spread over 4 decades, the range optimizer states live in.
        fn wide(&mut self, n: usize) -> Vec<f32> {
            (0..n)
                .map(|_| self.f32() * 10f32.powf(-2.0 + 2.0 * self.f32()))
                .collect()
        }
    }

    fn be(threads: usize) -> CpuBackend {
        CpuBackend::new(threads).unwrap()
    }
    fn f(v: &[f32]) -> CpuBuf {
        CpuBuf::F32(v.to_vec())
    }
    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }
    fn u8s(b: &CpuBuf) -> &[u8] {
        match b {
            CpuBuf::U8(v) => v,
            _ => panic!("not a u8 buffer"),
        }
    }

    fn adam_hyper(t: i32) -> AdamHyper {
        let (b1, b2) = (0.9f32, 0.999f32);
        AdamHyper {
            lr: 1e-3,
            beta1: b1,
            beta2: b2,
            eps: 1e-8,
            weight_decay: 0.1,
            m_corr: 1.0 / (1.0 - b1.powi(t)),
            v_corr: 1.0 / (1.0 - b2.powi(t)),
            grad_scale: 0.5,
        }
    }

    #[test]
    fn adamw_matches_formula() {
        let n = 40_000;
        let mut rng = Rng(12);
        let (p0, g, m0) = (rng.vec(n), rng.vec(n), rng.vec(n));
        let v0: Vec<f32> = rng.vec(n).iter().map(|x| x.abs()).collect();
        let h = AdamHyper {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            m_corr: 1.0 / (1.0 - 0.9f32.powi(3)),
            v_corr: 1.0 / (1.0 - 0.95f32.powi(3)),
            grad_scale: 0.5,
        };
        let (mut p, mut m, mut v) = (f(&p0), f(&m0), f(&v0));
        be(2).adamw_update(&mut p, &f(&g), &mut m, &mut v, n, h);
        let (mut wp, mut wm, mut wv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        for i in 0..n {
            let gi = g[i] as f64 * h.grad_scale as f64;
            wm[i] = h.beta1 as f64 * m0[i] as f64 + (1.0 - h.beta1 as f64) * gi;
            wv[i] = h.beta2 as f64 * v0[i] as f64 + (1.0 - h.beta2 as f64) * gi * gi;
            let upd = wm[i] * h.m_corr as f64 / ((wv[i] * h.v_corr as f64).sqrt() + h.eps as f64);
            wp[i] = p0[i] as f64 - h.lr as f64 * (upd + h.weight_decay as f64 * p0[i] as f64);
        }
        close(m.as_f32(), &wm, FWD, "adam m");
        close(v.as_f32(), &wv, FWD, "adam v");
        close(p.as_f32(), &wp, FWD, "adam param");
    }

    // (a) The formula gives a signed map from -0.99296875 (= -(1 - 0.9/128), the
    // last midpoint of the top decade) to +1.0: the appended 1.0 has no negative
    // twin, so -1 is NOT in the map. 0 is at index 127. The unsigned map runs
    // from 0 (index 0) to 1.0 with twice the fraction items per decade.
    #[test]
    fn dynamic_maps() {
        for (map, signed) in [(signed_map(), true), (unsigned_map(), false)] {
            assert_eq!(map.len(), 256);
            assert!(map.windows(2).all(|w| w[0] < w[1]), "strictly ascending");
            assert_eq!(map[255], 1.0);
            // the smallest non-zero magnitude: 1e-6 * midpoint of the first piece
            let first = if signed { 0.55 } else { 0.325 };
            let smallest = map.iter().map(|x| x.abs()).filter(|&x| x > 0.0);
            let smallest = smallest.fold(f32::INFINITY, f32::min);
            assert!((smallest as f64 - 1e-6 * first).abs() < 1e-12, "{smallest}");
            if signed {
                assert_eq!(map[127], 0.0);
                assert_eq!(map[0], -0.992_968_75);
                assert!(!map.contains(&-1.0));
                assert_eq!(map.iter().filter(|&&x| x < 0.0).count(), 127);
                assert_eq!(map[254], 0.992_968_75);
            } else {
                assert_eq!(map[0], 0.0);
                assert!(map.iter().all(|&x| (0.0..=1.0).contains(&x)));
                assert_eq!(map[254], (1.0 - 0.9 / 256.0) as f32);
            }
        }
    }

    // (b) quantise -> dequantise: |x - absmax*map[q(x/absmax)]| is at most half
    // the gap between the two map entries around x/absmax (times absmax), map
    // entries round-trip exactly, and NaN / absmax 0 give the code of 0.
    #[test]
    fn quantize_round_trip() {
        let mut rng = Rng(1);
        for (map, zero, signed) in [(signed_map(), 127u8, true), (unsigned_map(), 0u8, false)] {
            for (i, &e) in map.iter().enumerate() {
                assert_eq!(quantize(map, e, zero) as usize, i);
            }
            assert_eq!(quantize(map, f32::NAN, zero), zero);
            assert_eq!(map[zero as usize], 0.0);
            let absmax = 3.5f32;
            let mut x = rng.wide(20_000);
            if !signed {
                x.iter_mut().for_each(|v| *v = v.abs());
            }
            let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            for &xv in &x {
                let y = xv / amax; // in [-1, 1], as value/absmax in the kernel
                let q = quantize(map, y, zero) as usize;
                let deq = map[q] as f64 * absmax as f64;
                let y = y as f64;
                // neighbours of y in the map
                let c = map.partition_point(|&e| (e as f64) < y);
                let gap = if c == 0 || c == 256 {
                    // outside the map (only y < -0.99296875 in the signed map):
                    // the error is the distance to the end entry
                    2.0 * (y - map[c.min(255)] as f64).abs()
                } else {
                    (map[c] - map[c - 1]) as f64
                };
                let err = (deq - y * absmax as f64).abs();
                assert!(
                    err <= 0.5 * gap * absmax as f64 * (1.0 + 1e-6),
                    "y {y} q {q} err {err}"
                );
            }
        }
    }

    /// f64 AdamW with the same hyper-parameters, the reference for 8-bit.
    fn adamw_ref(p: &mut [f64], m: &mut [f64], v: &mut [f64], g: &[f32], h: &AdamHyper) {
        let (b1, b2) = (h.beta1 as f64, h.beta2 as f64);
        for i in 0..p.len() {
            let g = g[i] as f64 * h.grad_scale as f64;
            m[i] = b1 * m[i] + (1.0 - b1) * g;
            v[i] = b2 * v[i] + (1.0 - b2) * g * g;
            let upd = m[i] * h.m_corr as f64 / ((v[i] * h.v_corr as f64).sqrt() + h.eps as f64);
            p[i] -= h.lr as f64 * (upd + h.weight_decay as f64 * p[i]);
        }
    }

    // (c) 8-bit AdamW on 10_000 elements (39 full blocks and a 16-element last
    // one) over 3 steps against f64 AdamW. Step 1 uses the fp32 states, so it
    // only differs by f32 rounding; steps 2-3 read states quantised with the
    // dynamic map (about 1% relative error per value in the top decades, more
    // for values far below the block's absmax). Tolerance: relative error of
    // the whole update vector (param_3 - param_0) under 2%, and each element's
    // update within 25% of its size or 2% of the RMS update.
    #[test]
    fn adamw8bit_tracks_fp32_adamw() {
        let n: usize = 10_000;
        let nb = n.div_ceil(QBLOCK);
        let mut rng = Rng(7);
        let p0 = rng.vec(n);
        let mut b = be(4);
        let mut param = f(&p0);
        let (mut m, mut v) = (
            b.alloc(n, crate::backend::DType::U8),
            b.alloc(n, crate::backend::DType::U8),
        );
        let (mut ma, mut va) = (CpuBuf::F32(vec![0.0; nb]), CpuBuf::F32(vec![0.0; nb]));
        let mut pr: Vec<f64> = p0.iter().map(|&x| x as f64).collect();
        let (mut mr, mut vr) = (vec![0.0f64; n], vec![0.0f64; n]);
        // gradients: uniform in [-1, 1] times a per-block scale spread over 3
        // decades, the same scale every step (a layer's gradient magnitude is
        // roughly stable, and blockwise absmax is what absorbs the spread)
        let scale: Vec<f32> = (0..nb)
            .map(|_| 10f32.powf(-1.5 + 1.5 * rng.f32()))
            .collect();
        for t in 1..=3 {
            let g: Vec<f32> = (0..n).map(|i| rng.f32() * scale[i / QBLOCK]).collect();
            let h = adam_hyper(t);
            b.adamw8bit_update(&mut param, &f(&g), &mut m, &mut v, &mut ma, &mut va, n, h);
            adamw_ref(&mut pr, &mut mr, &mut vr, &g, &h);
        }
        // state bytes: 2 codes per element + 2 f32 absmax per 256-block
        let state_bytes =
            u8s(&m).len() + u8s(&v).len() + 4 * (ma.as_f32().len() + va.as_f32().len());
        assert_eq!(nb, 40);
        assert_eq!(state_bytes, 2 * n + 2 * 4 * nb);
        let got = param.as_f32();
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for i in 0..n {
            let (du, dr) = (got[i] as f64 - p0[i] as f64, pr[i] - p0[i] as f64);
            num += (du - dr) * (du - dr);
            den += dr * dr;
        }
        let rel = (num / den).sqrt();
        eprintln!("8-bit vs f64 AdamW: relative error of the update vector {rel:e}");
        assert!(rel < 0.02, "relative error of the update vector {rel}");
        let rms = (den / n as f64).sqrt();
        for i in 0..n {
            let (du, dr) = (got[i] as f64 - p0[i] as f64, pr[i] - p0[i] as f64);
            assert!(
                (du - dr).abs() <= 0.25 * dr.abs() + 0.02 * rms,
                "[{i}] got {du} want {dr}"
            );
        }
        // the states dequantise to the f64 reference states within the map resolution
        let (smap, umap) = (signed_map(), unsigned_map());
        for i in 0..n {
            let blk = i / QBLOCK;
            let mq = smap[u8s(&m)[i] as usize] as f64 * ma.as_f32()[blk] as f64;
            let vq = umap[u8s(&v)[i] as usize] as f64 * va.as_f32()[blk] as f64;
            let (mmax, vmax) = (ma.as_f32()[blk] as f64, va.as_f32()[blk] as f64);
            assert!(
                (mq - mr[i]).abs() <= 0.03 * mr[i].abs() + 0.01 * mmax,
                "m[{i}] {mq} vs {}",
                mr[i]
            );
            assert!(
                (vq - vr[i]).abs() <= 0.03 * vr[i].abs() + 0.01 * vmax,
                "v[{i}] {vq} vs {}",
                vr[i]
            );
        }
    }

    // absmax 0 (a block whose states are all zero) quantises to the code of 0,
    // and a fresh state dequantises to 0.
    #[test]
    fn adamw8bit_zero_block() {
        let n = 300; // one full block and a partial one
        let mut b = be(1);
        let mut param = f(&vec![1.0; n]);
        let (mut m, mut v) = (CpuBuf::U8(vec![0; n]), CpuBuf::U8(vec![0; n]));
        let (mut ma, mut va) = (CpuBuf::F32(vec![0.0; 2]), CpuBuf::F32(vec![0.0; 2]));
        let mut h = adam_hyper(1);
        h.weight_decay = 0.0;
        b.adamw8bit_update(
            &mut param,
            &f(&vec![0.0; n]),
            &mut m,
            &mut v,
            &mut ma,
            &mut va,
            n,
            h,
        );
        assert!(u8s(&m).iter().all(|&c| c == 127));
        assert!(u8s(&v).iter().all(|&c| c == 0));
        assert_eq!(ma.as_f32(), &[0.0, 0.0]);
        assert!(param.as_f32().iter().all(|&p| p == 1.0));
    }

    // (d) SGD against a hand computation. lr 0.5, momentum 0.5, wd 0.25,
    // grad_scale 2, dyadic inputs: every intermediate is exact in f32.
    // element 0, p = 1, raw grads 0.25, -0.5, 0.125:
    //   t1: g = 0.5 + 0.25*1 = 0.75;                  buf = 0.75;      p = 1 - 0.375 = 0.625
    //   t2: g = -1 + 0.25*0.625 = -0.84375;           buf = 0.375 - 0.84375 = -0.46875;
    //       p = 0.625 + 0.234375 = 0.859375
    //   t3: g = 0.25 + 0.25*0.859375 = 0.46484375;    buf = -0.234375 + 0.46484375 = 0.23046875;
    //       p = 0.859375 - 0.115234375 = 0.744140625
    // element 1, p = -2, raw grads 1, 0, -0.25:
    //   t1: g = 2 - 0.5 = 1.5;                        buf = 1.5;       p = -2 - 0.75 = -2.75
    //   t2: g = 0 - 0.6875 = -0.6875;                 buf = 0.75 - 0.6875 = 0.0625;
    //       p = -2.75 - 0.03125 = -2.78125
    //   t3: g = -0.5 - 0.6953125 = -1.1953125;        buf = 0.03125 - 1.1953125 = -1.1640625;
    //       p = -2.78125 + 0.58203125 = -2.19921875
    // momentum 0 (plain SGD, no buffer), element 0: p = 1 - 0.375 = 0.625,
    //   then 0.625 - 0.5*(-0.84375) = 1.046875, then 1.046875 - 0.5*(0.25 + 0.26171875) = 0.791015625
    #[test]
    fn sgd_hand_computed() {
        let mut b = be(1);
        let grads = [[0.25f32, 1.0], [-0.5, 0.0], [0.125, -0.25]];
        let mut h = SgdHyper {
            lr: 0.5,
            momentum: 0.5,
            weight_decay: 0.25,
            grad_scale: 2.0,
        };
        let mut param = f(&[1.0, -2.0]);
        let mut buf = f(&[0.0, 0.0]);
        let want_p = [
            [0.625f64, -2.75],
            [0.859375, -2.78125],
            [0.744140625, -2.19921875],
        ];
        let want_b = [[0.75f64, 1.5], [-0.46875, 0.0625], [0.23046875, -1.1640625]];
        // f64 literals (clippy's excessive_precision counts digits, but every
        // value here is a short dyadic fraction, exact in f32): compare exactly
        let f64s = |b: &CpuBuf| b.as_f32().iter().map(|&x| x as f64).collect::<Vec<_>>();
        for t in 0..3 {
            b.sgd_update(&mut param, &f(&grads[t]), &mut buf, 2, h);
            assert_eq!(f64s(&param), want_p[t], "param after step {}", t + 1);
            assert_eq!(f64s(&buf), want_b[t], "buf after step {}", t + 1);
        }
        h.momentum = 0.0;
        let mut param = f(&[1.0]);
        let mut empty = f(&[]);
        for (t, want) in [0.625f64, 1.046875, 0.791015625].into_iter().enumerate() {
            b.sgd_update(&mut param, &f(&grads[t][..1]), &mut empty, 1, h);
            assert_eq!(f64s(&param), [want]);
        }
    }

    #[derive(serde::Deserialize)]
    struct Case {
        name: String,
        shape: Vec<usize>,
        lr: Option<f64>,
        beta1: Option<f64>,
        decay_rate: f64,
        eps1: f64,
        eps2: f64,
        clip_threshold: f64,
        weight_decay: f64,
        scale_parameter: bool,
        grad_scale: f64,
        param0: Vec<f64>,
        grads: Vec<Vec<f64>>,
        expected: Vec<std::collections::HashMap<String, Vec<f64>>>,
    }

    fn f32s(v: &[f64]) -> Vec<f32> {
        v.iter().map(|&x| x as f32).collect()
    }

    // (e) Adafactor against tests/reference/adafactor_reference.py (f64 Python,
    // written from the algorithm's description). Every value, param and state,
    // after every step, within 1e-5 relative; states get an absolute floor of
    // 1e-6 of the vector's largest entry, for entries that nearly cancel.
    #[test]
    fn adafactor_matches_reference() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/optim/adafactor.json"
        );
        let text =
            std::fs::read_to_string(path).expect("run tests/reference/adafactor_reference.py");
        let root: serde_json::Value = serde_json::from_str(&text).unwrap();
        let cases: Vec<Case> = serde_json::from_value(root["cases"].clone()).unwrap();
        assert_eq!(cases.len(), 10);
        let mut covered = [false; 4]; // factored/full x beta1/none
        let mut worst = 0.0f64; // largest relative error outside m, for the log
        for c in &cases {
            let n: usize = c.shape.iter().product();
            let mut b = be(2);
            let mut param = f(&f32s(&c.param0));
            let mut m = f(&vec![0.0; n]);
            let factored = c.shape.len() == 2;
            let (mut s1, mut s2) = if factored {
                (f(&vec![0.0; c.shape[0]]), f(&vec![0.0; c.shape[1]]))
            } else {
                (f(&vec![0.0; n]), f(&[]))
            };
            covered[2 * factored as usize + c.beta1.is_some() as usize] = true;
            for (t, g) in c.grads.iter().enumerate() {
                let h = AdafactorHyper {
                    lr: c.lr.map(|x| x as f32),
                    step: t as u64 + 1,
                    beta1: c.beta1.map(|x| x as f32),
                    decay_rate: c.decay_rate as f32,
                    eps1: c.eps1 as f32,
                    eps2: c.eps2 as f32,
                    clip_threshold: c.clip_threshold as f32,
                    weight_decay: c.weight_decay as f32,
                    scale_parameter: c.scale_parameter,
                    grad_scale: c.grad_scale as f32,
                };
                let second = if factored {
                    AdafactorSecond::Factored {
                        row: &mut s1,
                        col: &mut s2,
                        rows: c.shape[0],
                        cols: c.shape[1],
                    }
                } else {
                    AdafactorSecond::Full { v: &mut s1, n }
                };
                let mo = c.beta1.is_some().then_some(&mut m);
                b.adafactor_update(
                    &mut param,
                    &f(&f32s(g)),
                    AdafactorState { second, m: mo },
                    h,
                );
                let want = &c.expected[t];
                let mut check = |what: &str, got: &[f32], floor: bool| {
                    let w = &want[what];
                    assert_eq!(got.len(), w.len());
                    let wmax = w.iter().fold(0.0f64, |a, x| a.max(x.abs()));
                    for (i, (&g, &w)) in got.iter().zip(w).enumerate() {
                        let tol = 1e-5 * w.abs() + if floor { 1e-6 * wmax } else { 0.0 };
                        if !floor && w != 0.0 {
                            worst = worst.max((g as f64 - w).abs() / w.abs());
                        }
                        assert!(
                            (g as f64 - w).abs() <= tol,
                            "{} step {}: {what}[{i}] got {g} want {w}",
                            c.name,
                            t + 1
                        );
                    }
                };
                check("param", param.as_f32(), false);
                if factored {
                    check("row", s1.as_f32(), false);
                    check("col", s2.as_f32(), false);
                } else {
                    check("v", s1.as_f32(), false);
                }
                if c.beta1.is_some() {
                    check("m", m.as_f32(), true);
                }
            }
        }
        assert!(covered.iter().all(|&x| x));
        eprintln!("adafactor vs reference: largest relative error (param, row, col, v) {worst:e}");
    }

    // (f) 1 thread vs 2 threads, bit for bit, on sizes that split into several tasks.
    #[test]
    fn one_vs_two_threads_bit_identical() {
        // 8-bit AdamW: 3 tasks of 64 blocks and a partial last block, 2 steps
        let n = 3 * ELEMS_PER_TASK + 300;
        let nb = n.div_ceil(QBLOCK);
        let (rows, cols) = (300, 250); // Adafactor's factored shape below
        let len = n.max(rows * cols);
        let mut rng = Rng(11);
        let p0 = rng.vec(len);
        let gs = [rng.wide(len), rng.wide(len)];
        let run8 = |threads: usize| {
            let mut b = be(threads);
            let mut p = f(&p0[..n]);
            let (mut m, mut v) = (CpuBuf::U8(vec![0; n]), CpuBuf::U8(vec![0; n]));
            let (mut ma, mut va) = (f(&vec![0.0; nb]), f(&vec![0.0; nb]));
            for (t, g) in gs.iter().enumerate() {
                let h = adam_hyper(t as i32 + 1);
                let g = f(&g[..n]);
                b.adamw8bit_update(&mut p, &g, &mut m, &mut v, &mut ma, &mut va, n, h);
            }
            (
                bits(p.as_f32()),
                u8s(&m).to_vec(),
                u8s(&v).to_vec(),
                bits(ma.as_f32()),
                bits(va.as_f32()),
            )
        };
        assert!(
            run8(1) == run8(2),
            "adamw8bit differs between 1 and 2 threads"
        );

        // SGD
        let runs = |threads: usize| {
            let mut b = be(threads);
            let (mut p, mut buf) = (f(&p0[..n]), f(&vec![0.0; n]));
            let h = SgdHyper {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.01,
                grad_scale: 0.7,
            };
            for g in &gs {
                b.sgd_update(&mut p, &f(&g[..n]), &mut buf, n, h);
            }
            (bits(p.as_f32()), bits(buf.as_f32()))
        };
        assert!(runs(1) == runs(2), "sgd differs between 1 and 2 threads");

        // Adafactor, factored 300 x 250 (65 rows and 4 column groups per task) and
        // full on n, with beta1 and weight decay, relative step
        let runa = |threads: usize, factored: bool| {
            let len = if factored { rows * cols } else { n };
            let mut b = be(threads);
            let mut p = f(&p0[..len]);
            let mut m = f(&vec![0.0; len]);
            let (mut s1, mut s2) = if factored {
                (f(&vec![0.0; rows]), f(&vec![0.0; cols]))
            } else {
                (f(&vec![0.0; len]), f(&[]))
            };
            for (t, g) in gs.iter().enumerate() {
                let h = AdafactorHyper {
                    step: t as u64 + 1,
                    beta1: Some(0.9),
                    weight_decay: 0.01,
                    grad_scale: 0.7,
                    ..AdafactorHyper::default()
                };
                let second = if factored {
                    AdafactorSecond::Factored {
                        row: &mut s1,
                        col: &mut s2,
                        rows,
                        cols,
                    }
                } else {
                    AdafactorSecond::Full { v: &mut s1, n: len }
                };
                let st = AdafactorState {
                    second,
                    m: Some(&mut m),
                };
                b.adafactor_update(&mut p, &f(&g[..len]), st, h);
            }
            (
                bits(p.as_f32()),
                bits(m.as_f32()),
                bits(s1.as_f32()),
                bits(s2.as_f32()),
            )
        };
        assert!(
            runa(1, true) == runa(2, true),
            "factored adafactor differs between 1 and 2 threads"
        );
        assert!(
            runa(1, false) == runa(2, false),
            "full adafactor differs between 1 and 2 threads"
        );
    }
}
