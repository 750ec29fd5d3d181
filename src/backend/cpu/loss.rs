//! Cross-entropy (whole, or vocabulary-parallel in three steps) and the sum
//! of squares behind gradient clipping.

use rayon::prelude::*;

use super::math::{exp_f32, exp_inplace_sum_f64, max, sum_exp_f64, vectorized};
use super::{CpuBackend, CpuBuf};

/// Fixed chunk of `sum_squares`: partial sums are per chunk, in order, so the
/// result does not depend on the thread count.
pub(super) const SUMSQ_CHUNK: usize = 1 << 16;

// losses (N), logits (N,Vp), targets (N); only the first v columns count.
pub(super) fn crossentropy_forward(
    be: &mut CpuBackend,
    losses: &mut CpuBuf,
    logits: &CpuBuf,
    targets: &CpuBuf,
    n: usize,
    v: usize,
    vp: usize,
) {
    if n == 0 {
        return;
    }
    assert!(
        v > 0 && v <= vp,
        "cross-entropy needs 0 < v <= vp, got v={v} vp={vp}"
    );
    let losses = &mut losses.wide_mut()[..n];
    let logits = &logits.wide()[..n * vp];
    let targets = &targets.as_u32()[..n];
    be.pool.install(|| {
        losses.par_iter_mut().enumerate().for_each(|(r, loss)| {
            vectorized(
                #[inline(always)]
                || {
                    let x = &logits[r * vp..][..v];
                    let tgt = targets[r] as usize;
                    assert!(tgt < v, "target {tgt} >= vocab {v}");
                    // logsumexp = max + ln(sum(exp(x - max))), the sum in f64.
                    let m = max(x);
                    let lse = m as f64 + sum_exp_f64(x, m).ln();
                    *loss = (lse - x[tgt] as f64) as f32;
                },
            )
        })
    });
}

// logits (N,Vp) := dloss * (softmax - onehot(target)), columns [v, vp) := 0.
pub(super) fn crossentropy_backward(
    be: &mut CpuBackend,
    logits: &mut CpuBuf,
    targets: &CpuBuf,
    dloss: f32,
    n: usize,
    v: usize,
    vp: usize,
) {
    each_row(be, (logits, targets), (n, v, vp), |x, tgt| {
        // One exp per element: write exp(x - max) in place, then scale.
        let m = max(x);
        let total = exp_inplace_sum_f64(x, m);
        let k = (dloss as f64 / total) as f32;
        for e in x.iter_mut() {
            *e *= k;
        }
        x[tgt] -= dloss;
    });
}

/// Runs `f(row, target)` on every row's first `v` columns of `logits
/// (N,Vp)` in parallel, then zeroes the padded columns `[v, vp)`: the
/// shape of the cross-entropy backwards.
fn each_row(
    be: &mut CpuBackend,
    (logits, targets): (&mut CpuBuf, &CpuBuf),
    (n, v, vp): (usize, usize, usize),
    f: impl Fn(&mut [f32], usize) + Sync,
) {
    if n == 0 {
        return;
    }
    assert!(
        v > 0 && v <= vp,
        "cross-entropy needs 0 < v <= vp, got v={v} vp={vp}"
    );
    let logits = &mut logits.wide_mut()[..n * vp];
    let targets = &targets.as_u32()[..n];
    be.pool.install(|| {
        logits
            .par_chunks_mut(vp)
            .zip(targets.par_iter())
            .for_each(|(row, &tgt)| {
                vectorized(
                    #[inline(always)]
                    || {
                        let tgt = tgt as usize;
                        assert!(tgt < v, "target {tgt} >= vocab {v}");
                        let (x, pad) = row.split_at_mut(v);
                        f(x, tgt);
                        pad.fill(0.0);
                    },
                )
            })
    });
}

// stats (N,2) = [max, sum exp(x - max)] over the part's real columns,
// tgt (N) = the target's logit when it falls in this part, else 0.
pub(super) fn crossentropy_part_stats(
    be: &mut CpuBackend,
    stats: &mut CpuBuf,
    tgt: &mut CpuBuf,
    logits: &CpuBuf,
    targets: &CpuBuf,
    n: usize,
    lo: usize,
    v: usize,
    vp: usize,
) {
    if n == 0 {
        return;
    }
    assert!(
        v <= vp,
        "cross-entropy part needs v <= vp, got v={v} vp={vp}"
    );
    let stats = &mut stats.wide_mut()[..2 * n];
    let tgt = &mut tgt.wide_mut()[..n];
    let logits = &logits.wide()[..n * vp];
    let targets = &targets.as_u32()[..n];
    be.pool.install(|| {
        stats
            .par_chunks_mut(2)
            .zip(tgt.par_iter_mut())
            .enumerate()
            .for_each(|(r, (st, tg))| {
                let x = &logits[r * vp..][..v];
                let (m, sum) = match v {
                    0 => (f32::NEG_INFINITY, 0.0),
                    _ => {
                        let m = max(x);
                        (m, sum_exp_f64(x, m) as f32)
                    }
                };
                st[0] = m;
                st[1] = sum;
                let t = targets[r] as usize;
                *tg = match t.checked_sub(lo) {
                    Some(j) if j < v => x[j],
                    _ => 0.0,
                };
            })
    });
}

// lse = M + ln(sum_r s_r exp(m_r - M)) over the parts, losses = lse - tgt.
pub(super) fn crossentropy_combine(
    _: &mut CpuBackend,
    losses: &mut CpuBuf,
    lse: &mut CpuBuf,
    stats: &CpuBuf,
    tgt: &CpuBuf,
    n: usize,
    parts: usize,
) {
    if n == 0 {
        return;
    }
    let losses = &mut losses.wide_mut()[..n];
    let lse = &mut lse.wide_mut()[..n];
    let stats = &stats.wide()[..2 * n * parts];
    let tgt = &tgt.wide()[..n];
    for r in 0..n {
        let part = |p: usize| (stats[(p * n + r) * 2], stats[(p * n + r) * 2 + 1]);
        let m = (0..parts)
            .map(|p| part(p).0)
            .fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = (0..parts)
            .map(|p| {
                let (mp, sp) = part(p);
                match sp {
                    0.0 => 0.0,
                    _ => sp as f64 * ((mp - m) as f64).exp(),
                }
            })
            .sum();
        let l = m as f64 + sum.ln();
        lse[r] = l as f32;
        losses[r] = (l - tgt[r] as f64) as f32;
    }
}

// logits := dloss * exp(logits - lse) - dloss * onehot(target - lo), padding 0.
pub(super) fn crossentropy_part_backward(
    be: &mut CpuBackend,
    logits: &mut CpuBuf,
    lse: &CpuBuf,
    targets: &CpuBuf,
    dloss: f32,
    n: usize,
    lo: usize,
    v: usize,
    vp: usize,
) {
    if n == 0 {
        return;
    }
    let logits = &mut logits.wide_mut()[..n * vp];
    let lse = &lse.wide()[..n];
    let targets = &targets.as_u32()[..n];
    be.pool.install(|| {
        logits.par_chunks_mut(vp).enumerate().for_each(|(r, row)| {
            let (x, pad) = row.split_at_mut(v);
            for e in x.iter_mut() {
                *e = dloss * (*e - lse[r]).exp();
            }
            if let Some(j) = (targets[r] as usize).checked_sub(lo)
                && j < v
            {
                x[j] -= dloss;
            }
            pad.fill(0.0);
        })
    });
}

// sum of buf[..n]^2 in f64: fixed chunks summed in order.
pub(super) fn sum_squares(be: &mut CpuBackend, buf: &CpuBuf, n: usize) -> Option<f64> {
    let x = &buf.wide()[..n];
    let partial: Vec<f64> = be.pool.install(|| {
        x.par_chunks(SUMSQ_CHUNK)
            .map(|c| {
                vectorized(
                    #[inline(always)]
                    || {
                        let mut acc = [0.0f64; 8];
                        let chunks = c.chunks_exact(8);
                        let rest: f64 = chunks
                            .remainder()
                            .iter()
                            .map(|&v| v as f64 * v as f64)
                            .sum();
                        for c in chunks {
                            for j in 0..8 {
                                acc[j] += c[j] as f64 * c[j] as f64;
                            }
                        }
                        acc.iter().sum::<f64>() + rest
                    },
                )
            })
            .collect()
    });
    Some(partial.iter().sum())
}

/// [`crossentropy_backward`] of soft-capped logits (Gemma 2's
/// `final_logit_softcapping`): `logits (N,Vp)` hold `y = cap · tanh(z /
/// cap)`, and become `dz = dloss · (softmax(y) - onehot) · (1 - (y /
/// cap)²)` in place, padded columns 0. Two passes over a row (the sum,
/// then each element from its own `y`), so nothing beside the row is kept.
pub(super) fn crossentropy_softcap_backward(
    be: &mut CpuBackend,
    logits: &mut CpuBuf,
    targets: &CpuBuf,
    dloss: f32,
    n: usize,
    v: usize,
    vp: usize,
    cap: f32,
) {
    each_row(be, (logits, targets), (n, v, vp), |y, tgt| {
        let m = max(y);
        let k = (dloss as f64 / sum_exp_f64(y, m)) as f32;
        for (j, e) in y.iter_mut().enumerate() {
            let t = *e / cap;
            let onehot = if j == tgt { dloss } else { 0.0 };
            *e = (exp_f32(*e - m) * k - onehot) * (1.0 - t * t);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::*;

    #[test]
    fn crossentropy_forward_backward() {
        let (n, v, vp) = (6, 10, 12);
        let mut rng = Rng(10);
        let mut logits: Vec<f32> = rng.vec(n * vp).iter().map(|x| x * 8.0).collect();
        for r in 0..n {
            // Padding holds garbage that must be ignored.
            logits[r * vp + v] = 1e4;
            logits[r * vp + v + 1] = f32::NAN;
        }
        let targets = rng.tokens(n, v);
        let mut be = be(2);
        let mut losses = zeros(n);
        be.crossentropy_forward(&mut losses, &f(&logits), &u(&targets), n, v, vp);
        let mut want_loss = vec![0.0; n];
        let mut want_grad = vec![0.0; n * vp];
        let dloss = 1.0 / n as f32;
        for r in 0..n {
            let x = d(&logits[r * vp..][..v]);
            let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = x.iter().map(|v| (v - m).exp()).sum();
            let tgt = targets[r] as usize;
            want_loss[r] = m + z.ln() - x[tgt];
            for j in 0..v {
                let onehot = if j == tgt { 1.0 } else { 0.0 };
                want_grad[r * vp + j] = dloss as f64 * ((x[j] - m).exp() / z - onehot);
            }
        }
        close(losses.as_f32(), &want_loss, FWD, "ce loss");
        let mut g = f(&logits);
        be.crossentropy_backward(&mut g, &u(&targets), dloss, n, v, vp);
        close(g.as_f32(), &want_grad, (1e-6, 1e-5), "ce grad");
    }

    #[test]
    fn sum_squares_f64() {
        let n = 3 * SUMSQ_CHUNK + 1234;
        let x = Rng(11).vec(n);
        let got = be(2).sum_squares(&f(&x), n).unwrap();
        let want: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
        assert!((got - want).abs() <= 1e-12 * want, "{got} vs {want}");
    }
}
