//! Optimizer steps on the GPU: AdamW, 8-bit AdamW, SGD, Adafactor
//! (`kernels/optim.cu`).
//!
//! Every kernel does the cpu backend's fp32 operations in the cpu's order
//! (`cpu/optim.rs`), with the multiply-adds
//! kept out of FMA contraction, so elementwise results are bit-identical to the
//! cpu's and the 8-bit codes match exactly. Per-step scalars (Adafactor's
//! `lr_t`, `beta2_t`, the clip divisor) are computed here on the host with the
//! cpu's expressions. The reductions Adafactor needs (RMS of the param, mean
//! of the row factors, RMS of the update) are per-block f64 partial sums in
//! the backend's scratch, added in block order by [`CudaBackend::sum_partials`]:
//! deterministic, and equal to the cpu's f64 sums up to f64 rounding. Nothing
//! is allocated: Adafactor recomputes its update in a second pass rather than
//! storing it, as the cpu does.

use super::driver::{Arg, Driver, LaunchCfg, MAX_STRIDE_BLOCKS};
use super::{CudaBackend, CudaBuf, PARTIALS, QMAP_OFFSET, n64};
use crate::backend::{AdafactorHyper, AdafactorSecond, AdafactorState, AdamHyper, DType, SgdHyper};

/// Elements of one 8-bit quantisation block (the cpu's `QBLOCK`).
const QBLOCK: usize = 256;

/// The hyper-parameter arguments shared by both AdamW kernels.
fn adam_args(h: &AdamHyper) -> [Arg; 7] {
    [
        Arg::F32(h.lr),
        Arg::F32(h.beta1),
        Arg::F32(h.beta2),
        Arg::F32(h.eps),
        Arg::F32(h.weight_decay),
        Arg::F32(h.m_corr),
        Arg::F32(h.v_corr),
    ]
}

pub(crate) fn adamw<D: Driver>(
    be: &mut CudaBackend<D>,
    param: &mut CudaBuf,
    grad: &CudaBuf,
    m: &mut CudaBuf,
    v: &mut CudaBuf,
    n: usize,
    h: AdamHyper,
) {
    if n == 0 {
        return;
    }
    let mut args = vec![
        param.arg(),
        param.dt(),
        grad.arg(),
        grad.dt(),
        m.arg(),
        m.dt(),
        v.arg(),
        v.dt(),
        n64(n),
    ];
    args.extend(adam_args(&h));
    args.push(Arg::F32(h.grad_scale));
    be.launch("opt_adamw_kernel", LaunchCfg::elementwise(n), &args);
}

/// One block of 256 threads per quantisation block (at most
/// [`MAX_STRIDE_BLOCKS`] blocks, looping over the rest); the maps come from
/// the scratch, where [`CudaBackend::new`] uploaded them.
pub(crate) fn adamw8bit<D: Driver>(
    be: &mut CudaBackend<D>,
    param: &mut CudaBuf,
    grad: &CudaBuf,
    m: &mut CudaBuf,
    v: &mut CudaBuf,
    m_absmax: &mut CudaBuf,
    v_absmax: &mut CudaBuf,
    n: usize,
    h: AdamHyper,
) {
    if n == 0 {
        return;
    }
    let nb = n.div_ceil(QBLOCK);
    assert!(
        m.dtype == DType::U8 && v.dtype == DType::U8,
        "8-bit AdamW states must be U8 codes, got {:?} and {:?}",
        m.dtype,
        v.dtype
    );
    assert!(
        m.len >= n && v.len >= n && m_absmax.len >= nb && v_absmax.len >= nb,
        "8-bit AdamW state buffers too short for {n} elements"
    );
    let mut args = vec![
        param.arg(),
        param.dt(),
        grad.arg(),
        grad.dt(),
        m.arg(),
        v.arg(),
        m_absmax.arg(),
        m_absmax.dt(),
        v_absmax.arg(),
        v_absmax.dt(),
        Arg::Ptr(be.scratch + QMAP_OFFSET as u64),
        n64(n),
    ];
    args.extend(adam_args(&h));
    args.push(Arg::F32(h.grad_scale));
    let blocks = nb.min(MAX_STRIDE_BLOCKS as usize) as u32;
    be.launch(
        "opt_adamw8bit_kernel",
        LaunchCfg::linear(blocks, QBLOCK as u32),
        &args,
    );
}

pub(crate) fn sgd<D: Driver>(
    be: &mut CudaBackend<D>,
    param: &mut CudaBuf,
    grad: &CudaBuf,
    momentum_buf: &mut CudaBuf,
    n: usize,
    h: SgdHyper,
) {
    if n == 0 {
        return;
    }
    // momentum 0: plain SGD, the buffer is neither read nor written (it may be
    // empty, as PyTorch keeps none); the kernel still gets a valid address.
    let use_momentum = h.momentum != 0.0;
    let (buf, bdt) = if use_momentum {
        (momentum_buf.arg(), momentum_buf.dt())
    } else {
        (param.arg(), param.dt())
    };
    be.launch(
        "opt_sgd_kernel",
        LaunchCfg::elementwise(n),
        &[
            param.arg(),
            param.dt(),
            grad.arg(),
            grad.dt(),
            buf,
            bdt,
            n64(n),
            Arg::F32(h.lr),
            Arg::F32(h.momentum),
            Arg::F32(h.weight_decay),
            Arg::F32(h.grad_scale),
            Arg::I32(use_momentum as i32),
        ],
    );
}

/// Blocks of a partial-sum launch over `n` elements: one per 256 elements, at
/// most [`PARTIALS`] (each writes one f64 slot of the scratch).
fn partial_blocks(n: usize) -> usize {
    n.div_ceil(256).clamp(1, PARTIALS)
}

/// `sum(x)` or `sum(x^2)` over the first `n` elements of `x`, in f64.
fn sum_f64<D: Driver>(be: &mut CudaBackend<D>, x: &CudaBuf, n: usize, square: bool) -> f64 {
    let blocks = partial_blocks(n);
    be.launch(
        "opt_sum_kernel",
        LaunchCfg::linear(blocks as u32, 256),
        &[
            Arg::Ptr(be.scratch),
            x.arg(),
            x.dt(),
            n64(n),
            Arg::I32(square as i32),
        ],
    );
    be.sum_partials(blocks)
}

/// Adafactor as the cpu computes it (`cpu/optim.rs`, Hugging Face semantics).
/// Factored `(rows, cols)`: a row kernel (one block per row) and a column
/// kernel (32 columns a block, row lanes walking rows in order) update the
/// factors; the row factors' mean and `RMS(update)` are partial sums added on
/// the host; a last elementwise pass recomputes the update and applies it.
/// Full: one pass updates `v` and sums `update^2`, the last pass applies it.
/// Host syncs: `RMS(param)` (with `scale_parameter`), the row mean, the
/// update's RMS.
pub(crate) fn adafactor<D: Driver>(
    be: &mut CudaBackend<D>,
    param: &mut CudaBuf,
    grad: &CudaBuf,
    st: AdafactorState<'_, CudaBuf>,
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
    // the first moment only exists with beta1
    let m = match h.beta1 {
        Some(_) => st.m,
        None => None,
    };
    assert!(
        h.beta1.is_none() || m.is_some(),
        "adafactor: beta1 is set but there is no first-moment buffer"
    );

    // the cpu's per-step scalars, the same expressions
    let t = h.step as f64;
    let rel = match h.lr {
        Some(lr) => lr as f64,
        None => (1.0 / t.sqrt()).min(1e-2),
    };
    let scale = if h.scale_parameter {
        let rms = (sum_f64(be, param, n, true) / n as f64).sqrt();
        (h.eps2 as f64).max(rms)
    } else {
        1.0
    };
    let lr_t = (rel * scale) as f32;
    let beta2t = (1.0 - t.powf(h.decay_rate as f64)) as f32;
    let neg_wd_lr = if h.weight_decay != 0.0 {
        (-(h.weight_decay as f64) * lr_t as f64) as f32
    } else {
        0.0
    };
    let beta1 = h.beta1.unwrap_or(0.0);
    let sc = Scalars {
        n,
        gs: h.grad_scale,
        eps1: h.eps1,
        beta2t,
        clip_threshold: h.clip_threshold,
    };
    let blocks = partial_blocks(n);

    // (s1, s2, cols, factored, row_mean, clip_div) for the last pass
    let (s1, s2, cols, factored, row_mean, clip) = match st.second {
        AdafactorSecond::Factored {
            row,
            col,
            rows,
            cols,
        } => {
            let row_mean = factored_second_moment(be, grad, (&*row, &*col), (rows, cols), sc);
            let clip = sc.clip_div(be.sum_partials(blocks));
            (&*row, &*col, cols, true, row_mean, clip)
        }
        AdafactorSecond::Full { v, .. } => {
            full_second_moment(be, grad, &*v, sc);
            let clip = sc.clip_div(be.sum_partials(blocks));
            (&*v, &*v, 1, false, 1.0, clip)
        }
    };
    let gs = sc.gs;
    // without a first moment the kernel gets the param's address, unused
    let (m_ptr, m_dt) = match &m {
        Some(m) => (m.arg(), m.dt()),
        None => (param.arg(), param.dt()),
    };
    be.launch(
        "opt_adafactor_finish_kernel",
        LaunchCfg::elementwise(n),
        &[
            param.arg(),
            param.dt(),
            m_ptr,
            m_dt,
            grad.arg(),
            grad.dt(),
            s1.arg(),
            s1.dt(),
            s2.arg(),
            s2.dt(),
            n64(n),
            n64(cols),
            Arg::I32(factored as i32),
            Arg::I32(m.is_some() as i32),
            Arg::F32(gs),
            Arg::F32(row_mean),
            Arg::F32(clip),
            Arg::F32(lr_t),
            Arg::F32(beta1),
            Arg::F32(neg_wd_lr),
        ],
    );
}

/// The step's scalars the second-moment kernels take, as the cpu has them.
#[derive(Clone, Copy)]
struct Scalars {
    n: usize,
    /// The gradient's scale.
    gs: f32,
    eps1: f32,
    /// `1 - t^decay_rate`.
    beta2t: f32,
    clip_threshold: f32,
}

impl Scalars {
    /// `max(1, RMS(update)/clip_threshold)` from the sum of its squares.
    fn clip_div(self, sumsq: f64) -> f32 {
        ((sumsq / self.n as f64).sqrt() / self.clip_threshold as f64).max(1.0) as f32
    }
}

/// Updates the row and column factors, and leaves the update's squares'
/// partial sums in the scratch; returns the row factors' mean.
fn factored_second_moment<D: Driver>(
    be: &mut CudaBackend<D>,
    grad: &CudaBuf,
    (row, col): (&CudaBuf, &CudaBuf),
    (rows, cols): (usize, usize),
    sc: Scalars,
) -> f32 {
    let Scalars {
        n,
        gs,
        eps1,
        beta2t,
        ..
    } = sc;
    let blocks = partial_blocks(n);
    assert!(row.len >= rows && col.len >= cols, "adafactor factor sizes");
    let shape = [n64(rows), n64(cols), Arg::F32(gs), Arg::F32(eps1)];
    let threads = (cols.div_ceil(32) * 32).clamp(32, 256) as u32;
    let row_blocks = rows.min(1 << 20) as u32;
    let mut args = vec![row.arg(), row.dt(), grad.arg(), grad.dt()];
    args.extend(shape);
    args.push(Arg::F32(beta2t));
    be.launch(
        "opt_adafactor_row_kernel",
        LaunchCfg::linear(row_blocks, threads),
        &args,
    );
    args[0] = col.arg();
    args[1] = col.dt();
    be.launch(
        "opt_adafactor_col_kernel",
        LaunchCfg {
            grid: [cols.div_ceil(32) as u32, 1, 1],
            block: [32, 32, 1],
            shared_bytes: 0,
        },
        &args,
    );
    let row_mean = (sum_f64(be, row, rows, false) / rows as f64) as f32;
    be.launch(
        "opt_adafactor_rms_kernel",
        LaunchCfg::linear(blocks as u32, 256),
        &[
            Arg::Ptr(be.scratch),
            grad.arg(),
            grad.dt(),
            row.arg(),
            row.dt(),
            col.arg(),
            col.dt(),
            n64(n),
            n64(cols),
            Arg::F32(gs),
            Arg::F32(row_mean),
        ],
    );
    row_mean
}

/// Updates `v`, and leaves the update's squares' partial sums in the
/// scratch.
fn full_second_moment<D: Driver>(
    be: &mut CudaBackend<D>,
    grad: &CudaBuf,
    v: &CudaBuf,
    sc: Scalars,
) {
    let Scalars {
        n,
        gs,
        eps1,
        beta2t,
        ..
    } = sc;
    let blocks = partial_blocks(n);
    assert!(v.len >= n, "adafactor: v holds {} of {n}", v.len);
    be.launch(
        "opt_adafactor_full_kernel",
        LaunchCfg::linear(blocks as u32, 256),
        &[
            Arg::Ptr(be.scratch),
            v.arg(),
            v.dt(),
            grad.arg(),
            grad.dt(),
            n64(n),
            Arg::F32(gs),
            Arg::F32(eps1),
            Arg::F32(beta2t),
        ],
    );
}

// ----------------------------------------------------------------------------
// cpu comparison (see check.rs)

use super::check::{Harness, Tol, down, up};
use crate::backend::Backend;
use crate::backend::cpu::optim::{signed_map, unsigned_map};

/// AdamW hyper-parameters for step `t` (1-based): weight decay and a gradient
/// scale that is not 1, as global-norm clipping gives.
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

/// AdamW over `grads.len()` steps from zero states: `[param, m, v]`.
fn adamw_steps<B: Backend>(
    be: &mut B,
    p0: &[f32],
    grads: &[Vec<f32>],
    (pdt, gdt): (DType, DType),
) -> Vec<Vec<f32>> {
    let n = p0.len();
    let mut p = up(be, p0, pdt);
    let (mut m, mut v) = (be.alloc(n, DType::F32), be.alloc(n, DType::F32));
    for (t, g) in grads.iter().enumerate() {
        let g = up(be, g, gdt);
        be.adamw_update(&mut p, &g, &mut m, &mut v, n, adam_hyper(t as i32 + 1));
        be.free(g);
    }
    let r = vec![down(be, &p), down(be, &m), down(be, &v)];
    for b in [p, m, v] {
        be.free(b);
    }
    r
}

/// A `U8` buffer's codes as `f32`: the cuda backend's `download_f32` gives
/// them, the cpu backend's only takes float buffers.
trait Codes: Backend {
    fn codes(&self, b: &Self::Buf) -> Vec<f32>;
}

impl Codes for crate::backend::cpu::CpuBackend {
    fn codes(&self, b: &Self::Buf) -> Vec<f32> {
        match b {
            crate::backend::cpu::CpuBuf::U8(v) => v.iter().map(|&c| c as f32).collect(),
            _ => panic!("not a U8 buffer"),
        }
    }
}

impl<D: Driver> Codes for CudaBackend<D> {
    fn codes(&self, b: &CudaBuf) -> Vec<f32> {
        assert_eq!(b.dtype, DType::U8, "not a U8 buffer");
        down(self, b)
    }
}

/// 8-bit AdamW over `grads.len()` steps from a fresh state: `[param, m codes,
/// v codes, m absmax, v absmax, m dequantised, v dequantised]`.
fn adamw8bit_steps<B: Codes>(
    be: &mut B,
    p0: &[f32],
    grads: &[Vec<f32>],
    pdt: DType,
) -> Vec<Vec<f32>> {
    let n = p0.len();
    let nb = n.div_ceil(QBLOCK);
    let mut p = up(be, p0, pdt);
    let (mut m, mut v) = (be.alloc(n, DType::U8), be.alloc(n, DType::U8));
    let (mut ma, mut va) = (be.alloc(nb, DType::F32), be.alloc(nb, DType::F32));
    for (t, g) in grads.iter().enumerate() {
        let g = up(be, g, DType::F32);
        let h = adam_hyper(t as i32 + 1);
        be.adamw8bit_update(&mut p, &g, &mut m, &mut v, &mut ma, &mut va, n, h);
        be.free(g);
    }
    let (mc, vc) = (be.codes(&m), be.codes(&v));
    let (mabs, vabs) = (down(be, &ma), down(be, &va));
    let deq = |map: &[f32; 256], codes: &[f32], absmax: &[f32]| -> Vec<f32> {
        let q = codes.iter().enumerate();
        q.map(|(i, &c)| map[c as usize] * absmax[i / QBLOCK])
            .collect()
    };
    let md = deq(signed_map(), &mc, &mabs);
    let vd = deq(unsigned_map(), &vc, &vabs);
    let r = vec![down(be, &p), mc, vc, mabs, vabs, md, vd];
    for b in [p, m, v, ma, va] {
        be.free(b);
    }
    r
}

/// SGD over `grads.len()` steps: `[param]` with momentum 0 (the momentum
/// buffer is EMPTY: the op must not touch it), else `[param, buf]`.
fn sgd_steps<B: Backend>(
    be: &mut B,
    p0: &[f32],
    grads: &[Vec<f32>],
    pdt: DType,
    h: SgdHyper,
) -> Vec<Vec<f32>> {
    let n = p0.len();
    let mut p = up(be, p0, pdt);
    let mut buf = be.alloc(if h.momentum == 0.0 { 0 } else { n }, DType::F32);
    for g in grads {
        let g = up(be, g, pdt);
        be.sgd_update(&mut p, &g, &mut buf, n, h);
        be.free(g);
    }
    let mut r = vec![down(be, &p)];
    if h.momentum != 0.0 {
        r.push(down(be, &buf));
    }
    be.free(p);
    be.free(buf);
    r
}

/// Adafactor over `grads.len()` steps (`h.step` is set per step), factored
/// `(rows, cols)` when `cols` is `Some`, else full: `[param, row, col]` or
/// `[param, v]`, then `m` with `beta1`.
fn adafactor_steps<B: Backend>(
    be: &mut B,
    p0: &[f32],
    grads: &[Vec<f32>],
    cols: Option<usize>,
    pdt: DType,
    h: AdafactorHyper,
) -> Vec<Vec<f32>> {
    let n = p0.len();
    let mut p = up(be, p0, pdt);
    let mut m = be.alloc(n, DType::F32);
    let (mut s1, mut s2) = match cols {
        Some(c) => (be.alloc(n / c, DType::F32), be.alloc(c, DType::F32)),
        None => (be.alloc(n, DType::F32), be.alloc(0, DType::F32)),
    };
    for (t, g) in grads.iter().enumerate() {
        let g = up(be, g, pdt);
        let second = match cols {
            Some(cols) => AdafactorSecond::Factored {
                row: &mut s1,
                col: &mut s2,
                rows: n / cols,
                cols,
            },
            None => AdafactorSecond::Full { v: &mut s1, n },
        };
        let st = AdafactorState {
            second,
            m: h.beta1.is_some().then_some(&mut m),
        };
        let h = AdafactorHyper {
            step: t as u64 + 1,
            ..h
        };
        be.adafactor_update(&mut p, &g, st, h);
        be.free(g);
    }
    let mut r = vec![down(be, &p), down(be, &s1)];
    if cols.is_some() {
        r.push(down(be, &s2));
    }
    if h.beta1.is_some() {
        r.push(down(be, &m));
    }
    for b in [p, m, s1, s2] {
        be.free(b);
    }
    r
}

fn dt_name(t: DType) -> String {
    format!("{t:?}").to_lowercase()
}

/// Cases for `memfit selftest` and `cargo test` (see `check.rs`).
///
/// Tolerances: AdamW, 8-bit AdamW and SGD do the cpu's fp32 operations in the
/// cpu's order without FMA contraction, so they agree bit for bit; the
/// tolerance is exact for the 8-bit codes and absmax (an off-by-one code would
/// mean the fp32 state before quantisation differed, i.e. an operation-order
/// bug, not a legitimate tie: both backends run the same quantiser on the same
/// bits) and a hair above zero elsewhere. Adafactor's scalars (`RMS(param)`,
/// the row factors' mean, `RMS(update)`) are f64 sums in a different order
/// than the cpu's, which can move their f32 rounding by an ulp and so every
/// element by about 1e-7 relative.
pub(crate) fn check_cases<D: Driver>(h: &mut Harness<D>) {
    check_adamw(h);
    check_adamw8bit(h);
    check_sgd(h);
    check_adafactor(h);
}

/// Optimizer steps each optimizer case takes (8-bit AdamW's own count aside).
const STEPS: usize = 3;

/// AdamW: every param type (grad of the same type), and f32 param with a bf16 grad
fn check_adamw<D: Driver>(h: &mut Harness<D>) {
    let steps = STEPS;
    let mut types: Vec<(DType, DType)> = super::check::FLOATS.iter().map(|&t| (t, t)).collect();
    types.push((DType::F32, DType::Bf16));
    for &(pdt, gdt) in &types {
        for n in [1usize, 300, 1000] {
            let p0 = h.randn(n, 1.0);
            let grads: Vec<Vec<f32>> = (0..steps).map(|_| h.randn(n, 0.1)).collect();
            let (c, g) = super::check::both!(h, adamw_steps(&p0, &grads, (pdt, gdt)));
            h.compare(
                "adamw",
                format!("n={n} {steps} steps grad={}", dt_name(gdt)),
                pdt,
                &["param", "m", "v"],
                &c,
                &g,
                Tol::new(1e-7, 1e-6),
            );
        }
    }
}

/// 8-bit AdamW: sizes off the 256-block grid, gradients with a per-block
/// scale over 3 decades (blockwise absmax absorbs it), one all-zero block
/// (absmax 0 -> code of 0), several steps so later steps read quantised states.
/// (the last size has more blocks than the grid: the kernel's block loop)
fn check_adamw8bit<D: Driver>(h: &mut Harness<D>) {
    let big = MAX_STRIDE_BLOCKS as usize * QBLOCK + 300;
    for &pdt in &super::check::FLOATS {
        let sizes: &[usize] = if pdt == DType::F32 {
            &[1, 300, 1000, big]
        } else {
            &[1, 300, 1000]
        };
        for &n in sizes {
            let nb = n.div_ceil(QBLOCK);
            let scale: Vec<f32> = (0..nb)
                .map(|b| {
                    if nb > 2 && b == 1 {
                        0.0
                    } else {
                        10f32.powf(h.uniform(1, -3.0, 0.0)[0])
                    }
                })
                .collect();
            let p0 = h.randn(n, 1.0);
            // (2 steps for the large size, to keep the emulated run short)
            let nsteps = if n == big { 2 } else { 4 };
            let grads: Vec<Vec<f32>> = (0..nsteps)
                .map(|_| {
                    let g = h.uniform(n, -1.0, 1.0);
                    g.iter()
                        .enumerate()
                        .map(|(i, &x)| x * scale[i / QBLOCK])
                        .collect()
                })
                .collect();
            let (c, g) = super::check::both!(h, adamw8bit_steps(&p0, &grads, pdt));
            let shape = format!("n={n} {nsteps} steps");
            h.compare(
                "adamw8bit param",
                shape.clone(),
                pdt,
                &["param"],
                &c[..1],
                &g[..1],
                Tol::new(1e-7, 1e-6),
            );
            // codes, absmax and the dequantised states: exact (see above)
            h.compare(
                "adamw8bit codes/absmax",
                format!("{shape} param={}", dt_name(pdt)),
                DType::F32,
                &["m code", "v code", "m absmax", "v absmax", "m deq", "v deq"],
                &c[1..],
                &g[1..],
                Tol::new(0.0, 0.0),
            );
        }
    }
}

/// SGD: plain (momentum 0, empty buffer) and momentum 0.9 with weight decay
fn check_sgd<D: Driver>(h: &mut Harness<D>) {
    let steps = STEPS;
    for &pdt in &super::check::FLOATS {
        for (momentum, wd) in [(0.0f32, 0.0f32), (0.0, 0.01), (0.9, 0.01)] {
            let n = 1000;
            let p0 = h.randn(n, 1.0);
            let grads: Vec<Vec<f32>> = (0..steps).map(|_| h.randn(n, 1.0)).collect();
            let hyper = SgdHyper {
                lr: 0.1,
                momentum,
                weight_decay: wd,
                grad_scale: 0.7,
            };
            let (c, g) = super::check::both!(h, sgd_steps(&p0, &grads, pdt, hyper));
            let names: &[&str] = if momentum == 0.0 {
                &["param"]
            } else {
                &["param", "buf"]
            };
            h.compare(
                "sgd",
                format!("n={n} mom={momentum} wd={wd}"),
                pdt,
                names,
                &c,
                &g,
                Tol::new(1e-7, 1e-6),
            );
        }
    }
}

/// Adafactor: factored and full, relative step (scale_parameter) and a
/// fixed lr, with and without the first moment, weight decay, grad scale.
fn check_adafactor<D: Driver>(h: &mut Harness<D>) {
    let steps = STEPS;
    let shapes: [(usize, Option<usize>); 5] = [
        (7 * 33, Some(33)),
        (130 * 70, Some(70)),
        (1, None),
        (300, None),
        (3000, None),
    ];
    let variants: [(Option<f32>, Option<f32>, f32, bool); 3] = [
        (None, None, 0.0, true),
        (None, Some(0.9), 0.01, true),
        (Some(1e-2), Some(0.9), 0.01, false),
    ];
    for &pdt in &[DType::F32, DType::Bf16] {
        for &(n, cols) in &shapes {
            for &(lr, beta1, wd, scale_parameter) in &variants {
                let p0 = h.randn(n, 0.5);
                let grads: Vec<Vec<f32>> = (0..steps).map(|_| h.randn(n, 0.1)).collect();
                let hyper = AdafactorHyper {
                    lr,
                    beta1,
                    weight_decay: wd,
                    scale_parameter,
                    grad_scale: 0.7,
                    ..AdafactorHyper::default()
                };
                let (c, g) = super::check::both!(h, adafactor_steps(&p0, &grads, cols, pdt, hyper));
                let mut names = vec!["param"];
                names.extend(if cols.is_some() {
                    &["row", "col"][..]
                } else {
                    &["v"][..]
                });
                if beta1.is_some() {
                    names.push("m");
                }
                let shape = match cols {
                    Some(c) => format!("{}x{c}", n / c),
                    None => format!("n={n}"),
                };
                h.compare(
                    "adafactor",
                    format!(
                        "{shape} lr={} b1={} wd={wd}",
                        lr.map_or("rel".into(), |x| x.to_string()),
                        beta1.map_or("-".into(), |x| x.to_string())
                    ),
                    pdt,
                    &names,
                    &c,
                    &g,
                    Tol::new(1e-7, 2e-6),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::backend::cuda::check::{table, tests};

    #[test]
    fn optimizers_match_cpu_on_the_emulated_gpu() {
        let mut h = tests::harness(7);
        super::check_cases(&mut h);
        eprintln!("{}", table(&h.rows));
        tests::assert_all_pass(&h);
    }
}
