//! LayerNorm and RMSNorm, forward and backward: rows in parallel, the weight
//! gradients partitioned over channels (each task adds every row into its own
//! channels, in row order).

use rayon::prelude::*;

use super::math::{
    COLS_PER_TASK, col_sum_accumulate, dot, rows_per_task, sum, sum_sq_dev, sum2_zip3, vectorized,
};
use super::{CpuBackend, CpuBuf};

// out (N,C), mean (N), rstd (N), inp (N,C), w (C), b (C).
pub(super) fn layernorm_forward(
    be: &mut CpuBackend,
    out: &mut CpuBuf,
    mean: &mut CpuBuf,
    rstd: &mut CpuBuf,
    inp: &CpuBuf,
    w: &CpuBuf,
    b: Option<&CpuBuf>,
    n: usize,
    c: usize,
    eps: f32,
) {
    if n == 0 || c == 0 {
        return;
    }
    let out = &mut out.wide_mut()[..n * c];
    let mean = &mut mean.wide_mut()[..n];
    let rstd = &mut rstd.wide_mut()[..n];
    let inp = &inp.wide()[..n * c];
    let w = &w.wide()[..c];
    let b = b.map(|b| b.wide());
    let b = b.as_deref().map(|b| &b[..c]);
    let rows = rows_per_task(c);
    be.pool.install(|| {
        out.par_chunks_mut(c * rows)
            .zip(mean.par_chunks_mut(rows))
            .zip(rstd.par_chunks_mut(rows))
            .zip(inp.par_chunks(c * rows))
            .for_each(|(((out, mean), rstd), inp)| {
                vectorized(
                    #[inline(always)]
                    || {
                        for (((o, x), m_out), r_out) in out
                            .chunks_exact_mut(c)
                            .zip(inp.chunks_exact(c))
                            .zip(mean.iter_mut())
                            .zip(rstd.iter_mut())
                        {
                            // Two passes (mean, then squared deviations): no cancellation.
                            let m = sum(x) / c as f32;
                            let var = sum_sq_dev(x, m) / c as f32;
                            let r = 1.0 / (var + eps).sqrt();
                            match b {
                                Some(b) => {
                                    for (((o, &x), &w), &b) in o.iter_mut().zip(x).zip(w).zip(b) {
                                        *o = (x - m) * r * w + b;
                                    }
                                }
                                None => {
                                    for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
                                        *o = (x - m) * r * w;
                                    }
                                }
                            }
                            *m_out = m;
                            *r_out = r;
                        }
                    },
                )
            })
    });
}

// dinp (N,C) +=, dw (C) +=, db (C) +=; dout, inp (N,C), w (C), mean, rstd (N).
pub(super) fn layernorm_backward(
    be: &mut CpuBackend,
    dinp: &mut CpuBuf,
    dw: &mut CpuBuf,
    db: Option<&mut CpuBuf>,
    dout: &CpuBuf,
    inp: &CpuBuf,
    w: &CpuBuf,
    mean: &CpuBuf,
    rstd: &CpuBuf,
    n: usize,
    c: usize,
) {
    if n == 0 || c == 0 {
        return;
    }
    let dinp = &mut dinp.wide_mut()[..n * c];
    let dw = &mut dw.wide_mut()[..c];
    let dout = &dout.wide()[..n * c];
    let inp = &inp.wide()[..n * c];
    let w = &w.wide()[..c];
    let mean = &mean.wide()[..n];
    let rstd = &rstd.wide()[..n];
    let rows = rows_per_task(c);
    be.pool.install(|| {
        // dinp, row-parallel. With norm = (x - mean)*rstd and dnorm = dout*w:
        // dx = rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)).
        dinp.par_chunks_mut(c * rows)
            .enumerate()
            .for_each(|(ci, blk)| {
                vectorized(
                    #[inline(always)]
                    || {
                        for (ri, dx) in blk.chunks_exact_mut(c).enumerate() {
                            let r = ci * rows + ri;
                            let (m, rs) = (mean[r], rstd[r]);
                            let x = &inp[r * c..][..c];
                            let dy = &dout[r * c..][..c];
                            let (sd, sdn) = sum2_zip3(x, dy, w, |x, dy, w| {
                                let norm = (x - m) * rs;
                                let dnorm = dy * w;
                                (dnorm, dnorm * norm)
                            });
                            let dnorm_mean = sd / c as f32;
                            let dnorm_norm_mean = sdn / c as f32;
                            for (((dx, &x), &dy), &w) in dx.iter_mut().zip(x).zip(dy).zip(w) {
                                let norm = (x - m) * rs;
                                *dx += (dy * w - dnorm_mean - norm * dnorm_norm_mean) * rs;
                            }
                        }
                    },
                )
            });
        // dw[c] += sum_r dout[r,c] * norm[r,c], column-partitioned, rows in order.
        dw.par_chunks_mut(COLS_PER_TASK)
            .enumerate()
            .for_each(|(ci, dw)| {
                vectorized(
                    #[inline(always)]
                    || {
                        let c0 = ci * COLS_PER_TASK;
                        for r in 0..n {
                            let (m, rs) = (mean[r], rstd[r]);
                            let x = &inp[r * c + c0..][..dw.len()];
                            let dy = &dout[r * c + c0..][..dw.len()];
                            for ((d, &x), &dy) in dw.iter_mut().zip(x).zip(dy) {
                                *d += dy * ((x - m) * rs);
                            }
                        }
                    },
                )
            });
        if let Some(db) = db {
            col_sum_accumulate(&mut db.wide_mut(), dout, n, c);
        }
    });
}

// out (N,C) = inp * rstd * w, rstd (N) = 1/sqrt(mean(inp^2) + eps).
pub(super) fn rmsnorm_forward(
    be: &mut CpuBackend,
    out: &mut CpuBuf,
    rstd: &mut CpuBuf,
    inp: &CpuBuf,
    w: &CpuBuf,
    n: usize,
    c: usize,
    eps: f32,
) {
    rmsnorm_forward_with(be, out, rstd, inp, w, n, c, eps, 0.0)
}

/// Gemma's RMSNorm: the weight is `1 + w` (transformers' `Gemma2RMSNorm`,
/// computed in fp32 and rounded once, as here).
pub(super) fn gemma_rmsnorm_forward(
    be: &mut CpuBackend,
    out: &mut CpuBuf,
    rstd: &mut CpuBuf,
    inp: &CpuBuf,
    w: &CpuBuf,
    n: usize,
    c: usize,
    eps: f32,
) {
    rmsnorm_forward_with(be, out, rstd, inp, w, n, c, eps, 1.0)
}

/// The backward of [`gemma_rmsnorm_forward`]: `dw` is as for `w` alone
/// (the offset is a constant), `dinp` reads `1 + w`.
pub(super) fn gemma_rmsnorm_backward(
    be: &mut CpuBackend,
    dinp: &mut CpuBuf,
    dw: &mut CpuBuf,
    dout: &CpuBuf,
    inp: &CpuBuf,
    w: &CpuBuf,
    rstd: &CpuBuf,
    n: usize,
    c: usize,
) {
    rmsnorm_backward_with(be, dinp, dw, dout, inp, w, rstd, n, c, 1.0)
}

/// RMSNorm with weight `w + offset` (0: llama's; 1: Gemma's).
fn rmsnorm_forward_with(
    be: &mut CpuBackend,
    out: &mut CpuBuf,
    rstd: &mut CpuBuf,
    inp: &CpuBuf,
    w: &CpuBuf,
    n: usize,
    c: usize,
    eps: f32,
    offset: f32,
) {
    if n == 0 || c == 0 {
        return;
    }
    let out = &mut out.wide_mut()[..n * c];
    let rstd = &mut rstd.wide_mut()[..n];
    let inp = &inp.wide()[..n * c];
    let w = &w.wide()[..c];
    let rows = rows_per_task(c);
    be.pool.install(|| {
        out.par_chunks_mut(c * rows)
            .zip(rstd.par_chunks_mut(rows))
            .zip(inp.par_chunks(c * rows))
            .for_each(|((out, rstd), inp)| {
                vectorized(
                    #[inline(always)]
                    || {
                        for ((o, x), r_out) in out
                            .chunks_exact_mut(c)
                            .zip(inp.chunks_exact(c))
                            .zip(rstd.iter_mut())
                        {
                            let r = 1.0 / (dot(x, x) / c as f32 + eps).sqrt();
                            for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
                                *o = x * r * (w + offset);
                            }
                            *r_out = r;
                        }
                    },
                )
            })
    });
}

// dinp (N,C) +=, dw (C) +=; dout, inp (N,C), w (C), rstd (N).
pub(super) fn rmsnorm_backward(
    be: &mut CpuBackend,
    dinp: &mut CpuBuf,
    dw: &mut CpuBuf,
    dout: &CpuBuf,
    inp: &CpuBuf,
    w: &CpuBuf,
    rstd: &CpuBuf,
    n: usize,
    c: usize,
) {
    rmsnorm_backward_with(be, dinp, dw, dout, inp, w, rstd, n, c, 0.0)
}

fn rmsnorm_backward_with(
    be: &mut CpuBackend,
    dinp: &mut CpuBuf,
    dw: &mut CpuBuf,
    dout: &CpuBuf,
    inp: &CpuBuf,
    w: &CpuBuf,
    rstd: &CpuBuf,
    n: usize,
    c: usize,
    offset: f32,
) {
    if n == 0 || c == 0 {
        return;
    }
    let dinp = &mut dinp.wide_mut()[..n * c];
    let dw = &mut dw.wide_mut()[..c];
    let dout = &dout.wide()[..n * c];
    let inp = &inp.wide()[..n * c];
    let w = &w.wide()[..c];
    let rstd = &rstd.wide()[..n];
    let rows = rows_per_task(c);
    be.pool.install(|| {
        // y_i = x_i r w_i with r = (mean(x^2) + eps)^(-1/2), dr/dx_j = -r^3 x_j / C:
        // dx_j = r w_j dy_j - x_j r^3 / C * sum_i dy_i w_i x_i.
        dinp.par_chunks_mut(c * rows)
            .enumerate()
            .for_each(|(ci, blk)| {
                vectorized(
                    #[inline(always)]
                    || {
                        for (ri, dx) in blk.chunks_exact_mut(c).enumerate() {
                            let row = ci * rows + ri;
                            let r = rstd[row];
                            let x = &inp[row * c..][..c];
                            let dy = &dout[row * c..][..c];
                            let (sxw, _) =
                                sum2_zip3(x, dy, w, |x, dy, w| (dy * (w + offset) * x, 0.0));
                            let k = sxw * r * r * r / c as f32;
                            for (((dx, &x), &dy), &w) in dx.iter_mut().zip(x).zip(dy).zip(w) {
                                *dx += r * (w + offset) * dy - x * k;
                            }
                        }
                    },
                )
            });
        // dw[c] += sum_r dout[r,c] * x[r,c] * rstd[r], column-partitioned.
        dw.par_chunks_mut(COLS_PER_TASK)
            .enumerate()
            .for_each(|(ci, dw)| {
                vectorized(
                    #[inline(always)]
                    || {
                        let c0 = ci * COLS_PER_TASK;
                        for (row, &r) in rstd.iter().enumerate() {
                            let x = &inp[row * c + c0..][..dw.len()];
                            let dy = &dout[row * c + c0..][..dw.len()];
                            for ((d, &x), &dy) in dw.iter_mut().zip(x).zip(dy) {
                                *d += dy * (x * r);
                            }
                        }
                    },
                )
            });
    });
}

#[cfg(test)]
mod tests {
    use crate::backend::cpu::testutil::*;

    fn ref_layernorm(
        x: &[f64],
        w: &[f64],
        b: Option<&[f64]>,
        n: usize,
        c: usize,
        eps: f64,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        for r in 0..n {
            let row = &x[r * c..][..c];
            let m = row.iter().sum::<f64>() / c as f64;
            let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / c as f64;
            let rs = 1.0 / (var + eps).sqrt();
            for i in 0..c {
                out[r * c + i] = (row[i] - m) * rs * w[i] + b.map_or(0.0, |b| b[i]);
            }
            mean[r] = m;
            rstd[r] = rs;
        }
        (out, mean, rstd)
    }

    fn ref_rmsnorm(x: &[f64], w: &[f64], n: usize, c: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
        let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
        for r in 0..n {
            let row = &x[r * c..][..c];
            let rs = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / c as f64 + eps).sqrt();
            for i in 0..c {
                out[r * c + i] = row[i] * rs * w[i];
            }
            rstd[r] = rs;
        }
        (out, rstd)
    }

    #[test]
    fn layernorm_forward_backward() {
        let (n, c, eps) = (6, 8, 1e-5);
        let mut rng = Rng(2);
        let (x, w, b) = (rng.vec(n * c), rng.vec(c), rng.vec(c));
        let mut be = be(2);
        let (mut out, mut mean, mut rstd) = (zeros(n * c), zeros(n), zeros(n));
        be.layernorm_forward(
            &mut out,
            &mut mean,
            &mut rstd,
            &f(&x),
            &f(&w),
            Some(&f(&b)),
            n,
            c,
            eps,
        );
        let (wo, wm, wr) = ref_layernorm(&d(&x), &d(&w), Some(&d(&b)), n, c, eps as f64);
        close(out.as_f32(), &wo, FWD, "ln out");
        close(mean.as_f32(), &wm, FWD, "ln mean");
        close(rstd.as_f32(), &wr, FWD, "ln rstd");

        let dout = rng.vec(n * c);
        let (dx0, dw0, db0) = (rng.vec(n * c), rng.vec(c), rng.vec(c));
        let (mut dx, mut dw, mut db) = (f(&dx0), f(&dw0), f(&db0));
        be.layernorm_backward(
            &mut dx,
            &mut dw,
            Some(&mut db),
            &f(&dout),
            &f(&x),
            &f(&w),
            &mean,
            &rstd,
            n,
            c,
        );
        let (x64, w64, b64) = (d(&x), d(&w), d(&b));
        let gx = fd_grad(
            |x| {
                proj(
                    &ref_layernorm(x, &w64, Some(&b64), n, c, eps as f64).0,
                    &dout,
                )
            },
            &x64,
        );
        let gw = fd_grad(
            |w| {
                proj(
                    &ref_layernorm(&x64, w, Some(&b64), n, c, eps as f64).0,
                    &dout,
                )
            },
            &w64,
        );
        let gb = fd_grad(
            |b| {
                proj(
                    &ref_layernorm(&x64, &w64, Some(b), n, c, eps as f64).0,
                    &dout,
                )
            },
            &b64,
        );
        close(dx.as_f32(), &plus(&dx0, &gx), BWD, "ln dinp");
        close(dw.as_f32(), &plus(&dw0, &gw), BWD, "ln dw");
        close(db.as_f32(), &plus(&db0, &gb), BWD, "ln db");
    }

    #[test]
    fn rmsnorm_forward_backward() {
        // c = 20 exercises both the 16-lane body and the tail of the reductions.
        let (n, c, eps) = (6, 20, 1e-5);
        let mut rng = Rng(3);
        let (x, w) = (rng.vec(n * c), rng.vec(c));
        let mut be = be(2);
        let (mut out, mut rstd) = (zeros(n * c), zeros(n));
        be.rmsnorm_forward(&mut out, &mut rstd, &f(&x), &f(&w), n, c, eps);
        let (wo, wr) = ref_rmsnorm(&d(&x), &d(&w), n, c, eps as f64);
        close(out.as_f32(), &wo, FWD, "rms out");
        close(rstd.as_f32(), &wr, FWD, "rms rstd");

        let dout = rng.vec(n * c);
        let (dx0, dw0) = (rng.vec(n * c), rng.vec(c));
        let (mut dx, mut dw) = (f(&dx0), f(&dw0));
        be.rmsnorm_backward(&mut dx, &mut dw, &f(&dout), &f(&x), &f(&w), &rstd, n, c);
        let (x64, w64) = (d(&x), d(&w));
        let gx = fd_grad(
            |x| proj(&ref_rmsnorm(x, &w64, n, c, eps as f64).0, &dout),
            &x64,
        );
        let gw = fd_grad(
            |w| proj(&ref_rmsnorm(&x64, w, n, c, eps as f64).0, &dout),
            &w64,
        );
        close(dx.as_f32(), &plus(&dx0, &gx), BWD, "rms dinp");
        close(dw.as_f32(), &plus(&dw0, &gw), BWD, "rms dw");
    }
}
