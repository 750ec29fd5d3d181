//! The cuda backend against the cpu backend, op by op.
//!
//! Every case builds the same random inputs on both backends, runs one op on
//! each through a generic function (the same code for both), downloads the
//! outputs and compares them elementwise with a per-op tolerance
//! `|gpu - cpu| <= atol + rtol * |cpu|`. `memfit selftest --device cuda` runs
//! these on the GPU; `cargo test` runs them on the emulated GPU
//! ([`super::emu::EmuDriver`]), so a kernel's indexing, bounds and reductions
//! are checked on every machine.

use std::fmt::Write as _;

use super::CudaBackend;
use super::driver::Driver;
use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, DType};
use crate::rng::Rng;

/// Elementwise tolerance: `|got - want| <= atol + rtol * |want|`.
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub atol: f64,
    pub rtol: f64,
}

impl Tol {
    pub const fn new(atol: f64, rtol: f64) -> Self {
        Tol { atol, rtol }
    }

    /// `f32` outputs get `base`; 16-bit outputs also allow a few units in the
    /// last place of their type, since the two backends may round a slightly
    /// different fp32 value to neighbouring 16-bit numbers.
    pub fn for_dtype(base: Tol, dtype: DType) -> Tol {
        let ulp = match dtype {
            DType::Bf16 => 1.0 / 128.0,
            DType::F16 => 1.0 / 1024.0,
            _ => 0.0,
        };
        Tol {
            atol: base.atol.max(ulp * 0.05),
            rtol: base.rtol.max(2.0 * ulp),
        }
    }
}

/// One comparison: an op on one shape and type.
#[derive(Clone, Debug)]
pub struct Row {
    pub op: String,
    pub shape: String,
    pub dtype: DType,
    /// Largest `|gpu - cpu|` over all outputs.
    pub max_abs: f64,
    /// Largest error as a multiple of its allowance (`<= 1` passes).
    pub worst: f64,
    pub pass: bool,
    /// Where it failed, when it did.
    pub detail: String,
}

/// Both backends and the results so far.
pub struct Harness<D: Driver> {
    pub cpu: CpuBackend,
    pub gpu: CudaBackend<D>,
    pub rng: Rng,
    pub rows: Vec<Row>,
}

/// Host data onto a backend, as a buffer of `dtype` (rounded once).
pub fn up<B: Backend>(be: &mut B, data: &[f32], dtype: DType) -> B::Buf {
    let mut b = be.alloc(data.len(), dtype);
    be.upload_f32(&mut b, data);
    b
}

/// Token ids onto a backend.
pub fn up_u32<B: Backend>(be: &mut B, data: &[u32]) -> B::Buf {
    let mut b = be.alloc(data.len(), DType::U32);
    be.upload_u32(&mut b, data);
    b
}

/// A buffer's contents as `f32`.
pub fn down<B: Backend>(be: &B, b: &B::Buf) -> Vec<f32> {
    be.download_f32(b).expect("a backend that holds data")
}

/// Runs a generic function `f(be, args...)` on the cpu and the gpu backend of
/// a harness, giving `(cpu_result, gpu_result)`.
#[macro_export]
macro_rules! both {
    ($h:expr, $f:ident ( $($arg:expr),* $(,)? )) => {{
        let c = $f(&mut $h.cpu, $($arg),*);
        let g = $f(&mut $h.gpu, $($arg),*);
        (c, g)
    }};
}
pub use both;

impl<D: Driver> Harness<D> {
    pub fn new(gpu: CudaBackend<D>, seed: u64) -> Self {
        Harness {
            cpu: CpuBackend::new(2).expect("cpu backend"),
            gpu,
            rng: Rng::new(seed),
            rows: Vec::new(),
        }
    }

    /// `n` normal samples times `scale`.
    pub fn randn(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.rng.normal() as f32 * scale).collect()
    }

    /// `n` uniform samples in `[lo, hi)`.
    pub fn uniform(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n)
            .map(|_| lo + (hi - lo) * self.rng.uniform() as f32)
            .collect()
    }

    /// `n` token ids below `v`.
    pub fn tokens(&mut self, n: usize, v: usize) -> Vec<u32> {
        (0..n).map(|_| self.rng.below(v as u64) as u32).collect()
    }

    /// Compares named outputs (`cpu[i]` with `gpu[i]`) and records one row.
    pub fn compare(
        &mut self,
        op: &str,
        shape: String,
        dtype: DType,
        names: &[&str],
        cpu: &[Vec<f32>],
        gpu: &[Vec<f32>],
        tol: Tol,
    ) {
        let tol = Tol::for_dtype(tol, dtype);
        let (mut max_abs, mut worst) = (0.0f64, 0.0f64);
        let mut detail = String::new();
        for ((name, c), g) in names.iter().zip(cpu).zip(gpu) {
            if c.len() != g.len() {
                let _ = write!(detail, "{name}: {} vs {} elements; ", c.len(), g.len());
                worst = f64::INFINITY;
                continue;
            }
            for (i, (&c, &g)) in c.iter().zip(g).enumerate() {
                let (c, g) = (c as f64, g as f64);
                if c.is_nan() && g.is_nan() || c == g {
                    continue;
                }
                let err = (g - c).abs();
                let ratio = if err.is_nan() {
                    f64::INFINITY
                } else {
                    err / (tol.atol + tol.rtol * c.abs())
                };
                max_abs = max_abs.max(if err.is_nan() { f64::INFINITY } else { err });
                if ratio > worst {
                    worst = ratio;
                    if ratio > 1.0 {
                        detail = format!("{name}[{i}]: cpu {c:e}, gpu {g:e}");
                    }
                }
            }
        }
        self.rows.push(Row {
            op: op.to_string(),
            shape,
            dtype,
            max_abs,
            worst,
            pass: worst <= 1.0,
            detail,
        });
    }

    /// Compares named outputs bit for bit (`-0.0` differs from `0.0`, NaNs
    /// must have the same bits) and records one row: for ops that compute
    /// nothing the two backends could round differently. A 16-bit output
    /// widens to `f32` exactly, so equal bits here are equal bits there.
    pub fn compare_exact(
        &mut self,
        op: &str,
        shape: String,
        dtype: DType,
        names: &[&str],
        cpu: &[Vec<f32>],
        gpu: &[Vec<f32>],
    ) {
        let (mut max_abs, mut worst) = (0.0f64, 0.0f64);
        let mut detail = String::new();
        for ((name, c), g) in names.iter().zip(cpu).zip(gpu) {
            if c.len() != g.len() {
                let _ = write!(detail, "{name}: {} vs {} elements; ", c.len(), g.len());
                worst = f64::INFINITY;
                continue;
            }
            for (i, (&c, &g)) in c.iter().zip(g).enumerate() {
                if c.to_bits() == g.to_bits() {
                    continue;
                }
                let err = (g as f64 - c as f64).abs();
                max_abs = max_abs.max(if err.is_nan() { f64::INFINITY } else { err });
                if worst < f64::INFINITY {
                    detail = format!(
                        "{name}[{i}]: cpu {c:e} ({:#010x}), gpu {g:e} ({:#010x}), bit for bit",
                        c.to_bits(),
                        g.to_bits()
                    );
                }
                worst = f64::INFINITY;
            }
        }
        self.rows.push(Row {
            op: op.to_string(),
            shape,
            dtype,
            max_abs,
            worst,
            pass: worst == 0.0,
            detail,
        });
    }

    /// The rows that failed.
    pub fn failures(&self) -> Vec<&Row> {
        self.rows.iter().filter(|r| !r.pass).collect()
    }
}

/// The comparison table, one line per row.
pub fn table(rows: &[Row]) -> String {
    let mut s = format!(
        "{:<26} {:<28} {:<5} {:>10} {:>8}  result\n",
        "op", "shape", "type", "max |err|", "of tol"
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:<26} {:<28} {:<5} {:>10.2e} {:>7.0}%  {}{}",
            r.op,
            r.shape,
            format!("{:?}", r.dtype).to_lowercase(),
            r.max_abs,
            (r.worst * 100.0).min(99_999.0),
            if r.pass { "ok" } else { "FAIL " },
            r.detail
        );
    }
    s
}

/// Float types every op is checked in.
pub const FLOATS: [DType; 3] = [DType::F32, DType::Bf16, DType::F16];

// ----------------------------------------------------------------------------
// Elementwise ops and matmul (the other groups keep their cases next to
// their kernels' host code).

fn fill_copy<B: Backend>(be: &mut B, x: &[f32], dt: DType) -> Vec<Vec<f32>> {
    let n = x.len();
    let src = up(be, x, DType::F32);
    let mut a = be.alloc(n, dt);
    be.convert(&mut a, &src, n);
    let mut b = be.alloc(n + 7, dt);
    be.fill(&mut b, 0.25);
    be.copy_slice(&mut b, 3, &src, 1, n - 1, true);
    let mut c = be.alloc(n, DType::F32);
    be.copy_slice(&mut c, 0, &a, 0, n, false);
    vec![down(be, &a), down(be, &b), down(be, &c)]
}

fn add_gelu<B: Backend>(be: &mut B, x: &[f32], y: &[f32], dt: DType) -> Vec<Vec<f32>> {
    let n = x.len();
    let (xb, yb) = (up(be, x, dt), up(be, y, dt));
    let mut sum = be.alloc(n, dt);
    be.add(&mut sum, &xb, &yb, n);
    let mut g = be.alloc(n, dt);
    be.gelu_forward(&mut g, &xb, n);
    let mut dg = up(be, y, dt);
    be.gelu_backward(&mut dg, &xb, n);
    vec![down(be, &sum), down(be, &g), down(be, &dg)]
}

fn swiglu<B: Backend>(
    be: &mut B,
    gu: &[f32],
    dy: &[f32],
    n: usize,
    i: usize,
    dt: DType,
) -> Vec<Vec<f32>> {
    let gub = up(be, gu, dt);
    let dyb = up(be, dy, dt);
    let mut out = be.alloc(n * i, dt);
    be.swiglu_forward(&mut out, &gub, n, i);
    let mut dgu = be.alloc(n * 2 * i, dt);
    be.swiglu_backward(&mut dgu, &dyb, &gub, n, i);
    // Liger's: the gradient written into gate|up itself.
    let mut inplace = up(be, gu, dt);
    be.swiglu_backward_in_place(&mut inplace, &dyb, n, i);
    vec![down(be, &out), down(be, &dgu), down(be, &inplace)]
}

fn matmul<B: Backend>(
    be: &mut B,
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    dy: &[f32],
    dw0: &[f32],
    (n, c, oc): (usize, usize, usize),
    dt: DType,
) -> Vec<Vec<f32>> {
    let (xb, wb, dyb) = (up(be, x, dt), up(be, w, dt), up(be, dy, dt));
    let bb = bias.map(|b| up(be, b, dt));
    let mut out = be.alloc(n * oc, dt);
    be.matmul_forward(&mut out, &xb, &wb, bb.as_ref(), n, c, oc);
    let mut dinp = up(be, &vec![f32::NAN; n * c], dt);
    let mut dw = up(be, dw0, dt);
    let mut db = bias.map(|b| up(be, b, dt));
    be.matmul_backward(
        &mut dinp,
        Some(&mut dw),
        db.as_mut(),
        &dyb,
        &xb,
        &wb,
        n,
        c,
        oc,
    );
    let mut r = vec![down(be, &out), down(be, &dinp), down(be, &dw)];
    if let Some(db) = db {
        r.push(down(be, &db));
    }
    r
}

pub fn elementwise_cases<D: Driver>(h: &mut Harness<D>) {
    for &dt in &FLOATS {
        for n in [1usize, 257, 5000] {
            let x = h.randn(n, 2.0);
            let y = h.randn(n, 1.0);
            let (c, g) = both!(h, fill_copy(&x, dt));
            h.compare(
                "convert/fill/copy_slice",
                format!("n={n}"),
                dt,
                &["convert", "fill+copy_slice(acc)", "copy_slice"],
                &c,
                &g,
                Tol::new(0.0, 0.0),
            );
            let (c, g) = both!(h, add_gelu(&x, &y, dt));
            h.compare(
                "add/gelu fwd+bwd",
                format!("n={n}"),
                dt,
                &["add", "gelu", "dgelu"],
                &c,
                &g,
                Tol::new(1e-6, 1e-5),
            );
        }
        for (n, i) in [(1usize, 1usize), (7, 33), (64, 176)] {
            let gu = h.randn(n * 2 * i, 2.0);
            let dy = h.randn(n * i, 1.0);
            let (c, g) = both!(h, swiglu(&gu, &dy, n, i, dt));
            h.compare(
                "swiglu fwd+bwd",
                format!("n={n} i={i}"),
                dt,
                &["out", "dgu"],
                &c,
                &g,
                Tol::new(1e-6, 1e-5),
            );
        }
    }
}

pub fn matmul_cases<D: Driver>(h: &mut Harness<D>) {
    for &dt in &FLOATS {
        for (n, c, oc, bias) in [
            (1usize, 1usize, 1usize, true),
            (5, 7, 3, true),
            (33, 64, 48, false),
            (64, 96, 257, true),
        ] {
            let x = h.randn(n * c, 1.0);
            let w = h.randn(oc * c, 0.2);
            let b = h.randn(oc, 0.5);
            let dy = h.randn(n * oc, 1.0);
            let dw0 = h.randn(oc * c, 0.1);
            let bias = bias.then_some(b.as_slice());
            let (cr, gr) = both!(h, matmul(&x, &w, bias, &dy, &dw0, (n, c, oc), dt));
            let names: &[&str] = if bias.is_some() {
                &["out", "dinp", "dw", "dbias"]
            } else {
                &["out", "dinp", "dw"]
            };
            // Sums of up to 257 products: fp32 reordering error ~ k * 2^-24 * |terms|.
            h.compare(
                "matmul fwd+bwd",
                format!(
                    "n={n} c={c} oc={oc}{}",
                    if bias.is_some() { " +bias" } else { "" }
                ),
                dt,
                names,
                &cr,
                &gr,
                Tol::new(2e-5, 2e-5),
            );
        }
    }
}

/// Every op group, in the order the selftest prints them.
pub fn all_cases<D: Driver>(h: &mut Harness<D>) {
    elementwise_cases(h);
    matmul_cases(h);
    super::norm::check_cases(h);
    super::attention::check_cases(h);
    super::optim::check_cases(h);
    super::nf4::check_cases(h);
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::backend::cuda::emu::EmuDriver;

    pub(crate) fn harness(seed: u64) -> Harness<EmuDriver> {
        let gpu = CudaBackend::new(EmuDriver::new(1 << 30, 2)).unwrap();
        Harness::new(gpu, seed)
    }

    pub(crate) fn assert_all_pass<D: Driver>(h: &Harness<D>) {
        assert!(!h.rows.is_empty(), "no cases ran");
        assert!(h.failures().is_empty(), "\n{}", table(&h.rows));
    }

    #[test]
    fn elementwise_ops_match_cpu_on_the_emulated_gpu() {
        let mut h = harness(1);
        elementwise_cases(&mut h);
        assert_all_pass(&h);
    }

    #[test]
    fn matmul_matches_cpu_on_the_emulated_gpu() {
        let mut h = harness(2);
        matmul_cases(&mut h);
        assert_all_pass(&h);
    }

    /// The comparison itself can fail: a wrong result is reported.
    #[test]
    fn a_wrong_result_fails_its_row() {
        let mut h = harness(3);
        h.compare(
            "x",
            "n=2".into(),
            DType::F32,
            &["out"],
            &[vec![1.0, 2.0]],
            &[vec![1.0, 2.01]],
            Tol::new(1e-6, 1e-6),
        );
        h.compare(
            "nan",
            "n=1".into(),
            DType::F32,
            &["out"],
            &[vec![1.0]],
            &[vec![f32::NAN]],
            Tol::new(1.0, 1.0),
        );
        assert_eq!(h.failures().len(), 2, "{}", table(&h.rows));
        assert!(h.rows[0].detail.contains("out[1]"), "{}", h.rows[0].detail);
    }

    /// An exact row fails on one unit in the last place, and on the sign of
    /// a zero, which a tolerance would let through.
    #[test]
    fn an_exact_row_fails_on_any_bit() {
        let mut h = harness(3);
        let one_up = 1.0f32.next_up();
        for (c, g) in [(1.0f32, one_up), (0.0, -0.0), (2.0, 2.0)] {
            h.compare_exact(
                "x",
                "n=2".into(),
                DType::F32,
                &["out"],
                &[vec![5.0, c]],
                &[vec![5.0, g]],
            );
        }
        let pass: Vec<bool> = h.rows.iter().map(|r| r.pass).collect();
        assert_eq!(pass, [false, false, true], "{}", table(&h.rows));
        assert!(h.rows[0].detail.contains("out[1]"), "{}", h.rows[0].detail);
    }
}
