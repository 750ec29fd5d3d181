//! The elementwise ops: GELU, SwiGLU and the residual add.

use rayon::prelude::*;

use super::math::{ELEMS_PER_TASK, rows_per_task, sigmoid, vectorized};
use super::{CpuBackend, CpuBuf};

// GELU, tanh approximation (Hendrycks & Gimpel 2016):
// gelu(x) = 0.5*x*(1 + tanh(u)), u = sqrt(2/pi)*(x + 0.044715*x^3).
// Since 0.5*(1 + tanh(u)) = sigmoid(2u), this is x*sigmoid(2u), which needs one
// exp and has no cancellation near tanh = -1.
const GELU_SCALE: f32 = 0.797_884_6; // sqrt(2/pi)
const GELU_CUBE: f32 = 0.044_715;

// out (N) = gelu(inp (N)).
pub(super) fn gelu_forward(be: &mut CpuBackend, out: &mut CpuBuf, inp: &CpuBuf, n: usize) {
    let out = &mut out.wide_mut()[..n];
    let inp = &inp.wide()[..n];
    be.pool.install(|| {
        out.par_chunks_mut(ELEMS_PER_TASK)
            .zip(inp.par_chunks(ELEMS_PER_TASK))
            .for_each(|(o, x)| {
                vectorized(
                    #[inline(always)]
                    || {
                        for (o, &x) in o.iter_mut().zip(x) {
                            let u = GELU_SCALE * (x + GELU_CUBE * x * x * x);
                            *o = x * sigmoid(2.0 * u);
                        }
                    },
                )
            })
    });
}

// dout (N) *= gelu'(inp (N)).
pub(super) fn gelu_backward(be: &mut CpuBackend, dout: &mut CpuBuf, inp: &CpuBuf, n: usize) {
    let dout = &mut dout.wide_mut()[..n];
    let inp = &inp.wide()[..n];
    be.pool.install(|| {
        dout.par_chunks_mut(ELEMS_PER_TASK)
            .zip(inp.par_chunks(ELEMS_PER_TASK))
            .for_each(|(d, x)| {
                vectorized(
                    #[inline(always)]
                    || {
                        for (d, &x) in d.iter_mut().zip(x) {
                            // d/dx [x s(2u)] = s + 2x s (1 - s) u', s = sigmoid(2u),
                            // u' = sqrt(2/pi) (1 + 3*0.044715 x^2).
                            let u = GELU_SCALE * (x + GELU_CUBE * x * x * x);
                            let du = GELU_SCALE * (1.0 + 3.0 * GELU_CUBE * x * x);
                            let s = sigmoid(2.0 * u);
                            *d *= s + 2.0 * x * s * (1.0 - s) * du;
                        }
                    },
                )
            })
    });
}

// out (N,I) = silu(gate) * up, gu (N,2I) rows [gate (I) | up (I)].
pub(super) fn swiglu_forward(
    be: &mut CpuBackend,
    out: &mut CpuBuf,
    gu: &CpuBuf,
    n: usize,
    i: usize,
) {
    gated_forward(be, out, gu, (n, i), |g, u| g * sigmoid(g) * u);
}

// dgu (N,2I) from dout (N,I) and gu (N,2I).
pub(super) fn swiglu_backward(
    be: &mut CpuBackend,
    dgu: &mut CpuBuf,
    dout: &CpuBuf,
    gu: &CpuBuf,
    n: usize,
    i: usize,
) {
    gated_backward(be, dgu, (dout, gu), (n, i), swiglu_grad);
}

/// SwiGLU's (d gate, d up) at one element: silu'(g) = s (1 + g (1 - s)),
/// s = sigmoid(g).
#[inline(always)]
fn swiglu_grad(dy: f32, g: f32, u: f32) -> (f32, f32) {
    let s = sigmoid(g);
    (dy * u * s * (1.0 + g * (1.0 - s)), dy * g * s)
}

// gu (N,2I) := its gradient from dout (N,I), in place.
pub(super) fn swiglu_backward_in_place(
    be: &mut CpuBackend,
    gu: &mut CpuBuf,
    dout: &CpuBuf,
    n: usize,
    i: usize,
) {
    if n == 0 || i == 0 {
        return;
    }
    let gu = &mut gu.wide_mut()[..n * 2 * i];
    let dout = &dout.wide()[..n * i];
    let rows = rows_per_task(2 * i);
    be.pool.install(|| {
        gu.par_chunks_mut(2 * i * rows)
            .zip(dout.par_chunks(i * rows))
            .for_each(|(gu, dout)| {
                vectorized(
                    #[inline(always)]
                    || {
                        for (gu, dy) in gu.chunks_exact_mut(2 * i).zip(dout.chunks_exact(i)) {
                            let (g, u) = gu.split_at_mut(i);
                            for ((g, u), &dy) in g.iter_mut().zip(u.iter_mut()).zip(dy) {
                                (*g, *u) = swiglu_grad(dy, *g, *u);
                            }
                        }
                    },
                )
            })
    });
}

/// A gated unit's forward: out (N,I) = f(gate, up) element by element, gu
/// (N,2I) rows [gate (I) | up (I)] (SwiGLU, GeGLU).
fn gated_forward(
    be: &mut CpuBackend,
    out: &mut CpuBuf,
    gu: &CpuBuf,
    (n, i): (usize, usize),
    f: impl Fn(f32, f32) -> f32 + Sync,
) {
    if n == 0 || i == 0 {
        return;
    }
    let out = &mut out.wide_mut()[..n * i];
    let gu = &gu.wide()[..n * 2 * i];
    let rows = rows_per_task(2 * i);
    be.pool.install(|| {
        out.par_chunks_mut(i * rows)
            .zip(gu.par_chunks(2 * i * rows))
            .for_each(|(out, gu)| {
                vectorized(
                    #[inline(always)]
                    || {
                        for (o, gu) in out.chunks_exact_mut(i).zip(gu.chunks_exact(2 * i)) {
                            let (g, u) = gu.split_at(i);
                            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                                *o = f(g, u);
                            }
                        }
                    },
                )
            })
    });
}

/// A gated unit's backward: dgu (N,2I) from dout (N,I) and gu (N,2I),
/// `f(dy, gate, up)` giving (d gate, d up).
fn gated_backward(
    be: &mut CpuBackend,
    dgu: &mut CpuBuf,
    (dout, gu): (&CpuBuf, &CpuBuf),
    (n, i): (usize, usize),
    f: impl Fn(f32, f32, f32) -> (f32, f32) + Sync,
) {
    if n == 0 || i == 0 {
        return;
    }
    let dgu = &mut dgu.wide_mut()[..n * 2 * i];
    let dout = &dout.wide()[..n * i];
    let gu = &gu.wide()[..n * 2 * i];
    let rows = rows_per_task(2 * i);
    be.pool.install(|| {
        dgu.par_chunks_mut(2 * i * rows)
            .zip(dout.par_chunks(i * rows))
            .zip(gu.par_chunks(2 * i * rows))
            .for_each(|((dgu, dout), gu)| {
                vectorized(
                    #[inline(always)]
                    || {
                        for ((dgu, dy), gu) in dgu
                            .chunks_exact_mut(2 * i)
                            .zip(dout.chunks_exact(i))
                            .zip(gu.chunks_exact(2 * i))
                        {
                            let (dg, du) = dgu.split_at_mut(i);
                            let (g, u) = gu.split_at(i);
                            for ((((dg, du), &dy), &g), &u) in
                                dg.iter_mut().zip(du.iter_mut()).zip(dy).zip(g).zip(u)
                            {
                                (*dg, *du) = f(dy, g, u);
                            }
                        }
                    },
                )
            })
    });
}

// out (N) = a + b.
pub(super) fn add(be: &mut CpuBackend, out: &mut CpuBuf, a: &CpuBuf, b: &CpuBuf, n: usize) {
    let out = &mut out.wide_mut()[..n];
    let a = &a.wide()[..n];
    let b = &b.wide()[..n];
    be.pool.install(|| {
        out.par_chunks_mut(ELEMS_PER_TASK)
            .zip(a.par_chunks(ELEMS_PER_TASK))
            .zip(b.par_chunks(ELEMS_PER_TASK))
            .for_each(|((o, a), b)| {
                for ((o, a), b) in o.iter_mut().zip(a).zip(b) {
                    *o = a + b;
                }
            })
    });
}

/// `gelu(x)` and its derivative (the tanh approximation above).
#[inline(always)]
fn gelu_and_grad(x: f32) -> (f32, f32) {
    let u = GELU_SCALE * (x + GELU_CUBE * x * x * x);
    let du = GELU_SCALE * (1.0 + 3.0 * GELU_CUBE * x * x);
    let s = sigmoid(2.0 * u);
    (x * s, s + 2.0 * x * s * (1.0 - s) * du)
}

// GeGLU (Shazeer, GLU Variants Improve Transformer, 2020; Gemma's MLP,
// `gelu_pytorch_tanh(gate) * up`): out (N,I) from gu (N,2I) rows
// [gate (I) | up (I)].
pub(super) fn geglu_forward(
    be: &mut CpuBackend,
    out: &mut CpuBuf,
    gu: &CpuBuf,
    n: usize,
    i: usize,
) {
    gated_forward(be, out, gu, (n, i), |g, u| gelu_and_grad(g).0 * u);
}

// dgu (N,2I) from dout (N,I) and gu (N,2I): d gate = dy u gelu'(g),
// d up = dy gelu(g).
pub(super) fn geglu_backward(
    be: &mut CpuBackend,
    dgu: &mut CpuBuf,
    dout: &CpuBuf,
    gu: &CpuBuf,
    n: usize,
    i: usize,
) {
    gated_backward(be, dgu, (dout, gu), (n, i), |dy, g, u| {
        let (a, da) = gelu_and_grad(g);
        (dy * u * da, dy * a)
    });
}

// In place: x (N) *= factor (Gemma's embedding times √C, and its backward).
pub(super) fn scale(be: &mut CpuBackend, x: &mut CpuBuf, n: usize, factor: f32) {
    let x = &mut x.wide_mut()[..n];
    be.pool.install(|| {
        x.par_chunks_mut(ELEMS_PER_TASK).for_each(|x| {
            for v in x.iter_mut() {
                *v *= factor;
            }
        })
    });
}

// In place: x (N) = cap · tanh(x / cap), Gemma 2's logit soft-capping.
pub(super) fn softcap_forward(be: &mut CpuBackend, x: &mut CpuBuf, n: usize, cap: f32) {
    let x = &mut x.wide_mut()[..n];
    be.pool.install(|| {
        x.par_chunks_mut(ELEMS_PER_TASK).for_each(|x| {
            for v in x.iter_mut() {
                *v = softcap(*v, cap);
            }
        })
    });
}

/// `cap · tanh(x / cap)`.
#[inline(always)]
pub(super) fn softcap(x: f32, cap: f32) -> f32 {
    cap * (x / cap).tanh()
}

#[cfg(test)]
mod tests {
    use crate::backend::cpu::testutil::*;

    fn ref_gelu(x: f64) -> f64 {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
    }

    fn ref_silu(x: f64) -> f64 {
        x / (1.0 + (-x).exp())
    }

    fn ref_swiglu(gu: &[f64], n: usize, i: usize) -> Vec<f64> {
        let mut out = vec![0.0; n * i];
        for r in 0..n {
            for j in 0..i {
                out[r * i + j] = ref_silu(gu[r * 2 * i + j]) * gu[r * 2 * i + i + j];
            }
        }
        out
    }

    #[test]
    fn gelu_forward_backward() {
        let n = 1000;
        let mut rng = Rng(5);
        let x: Vec<f32> = rng.vec(n).iter().map(|v| v * 6.0).collect();
        let mut be = be(2);
        let mut out = zeros(n);
        be.gelu_forward(&mut out, &f(&x), n);
        let want: Vec<f64> = x.iter().map(|&v| ref_gelu(v as f64)).collect();
        close(out.as_f32(), &want, FWD, "gelu");
        let dout = rng.vec(n);
        let mut dx = f(&dout);
        be.gelu_backward(&mut dx, &f(&x), n);
        let h = 1e-5;
        let want: Vec<f64> = x
            .iter()
            .zip(&dout)
            .map(|(&v, &g)| {
                g as f64 * (ref_gelu(v as f64 + h) - ref_gelu(v as f64 - h)) / (2.0 * h)
            })
            .collect();
        close(dx.as_f32(), &want, BWD, "gelu backward");
    }

    #[test]
    fn swiglu_forward_backward() {
        let (n, i) = (6, 5);
        let mut rng = Rng(6);
        let gu: Vec<f32> = rng.vec(n * 2 * i).iter().map(|v| v * 4.0).collect();
        let mut be = be(2);
        let mut out = zeros(n * i);
        be.swiglu_forward(&mut out, &f(&gu), n, i);
        close(out.as_f32(), &ref_swiglu(&d(&gu), n, i), FWD, "swiglu");
        let dout = rng.vec(n * i);
        let mut dgu = nans(n * 2 * i);
        be.swiglu_backward(&mut dgu, &f(&dout), &f(&gu), n, i);
        let want = fd_grad(|g| proj(&ref_swiglu(g, n, i), &dout), &d(&gu));
        close(dgu.as_f32(), &want, BWD, "swiglu backward");
    }

    #[test]
    fn add_elementwise() {
        let mut rng = Rng(7);
        let (a, b) = (rng.vec(50_000), rng.vec(50_000));
        let mut out = zeros(50_000);
        be(2).add(&mut out, &f(&a), &f(&b), 50_000);
        let want: Vec<f64> = a.iter().zip(&b).map(|(&x, &y)| (x + y) as f64).collect();
        close(out.as_f32(), &want, (0.0, 0.0), "add");
    }
}
