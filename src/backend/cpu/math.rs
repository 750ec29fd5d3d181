//! Scalar helpers shared by the kernels: small, inlined, written so the
//! loops auto-vectorise. And the sizes the kernels cut their work into.

use rayon::prelude::*;

/// Elements per rayon task for elementwise kernels: large enough that task
/// overhead is noise, small enough that two threads stay balanced.
pub(super) const ELEMS_PER_TASK: usize = 1 << 14;

/// Channels per task in the column-partitioned parameter-gradient reductions.
pub(super) const COLS_PER_TASK: usize = 64;

/// Accumulator lanes in the f32 reductions. Independent lanes let the compiler
/// vectorise a sum that strict IEEE ordering would otherwise keep scalar; the
/// lane layout is fixed, so the result is still deterministic.
pub(super) const LANES: usize = 16;

/// `exp(x)` for f32, vectorisable: `x = n*ln2 + r` with `n = round(x/ln2)`,
/// `|r| <= ln2/2`, `exp(r)` by its degree-7 Taylor polynomial (truncation error
/// `< 0.35^8/8! ~ 5e-9`, below half an ulp), then scaled by `2^n` built in the
/// exponent bits. The input is clamped to [-87, 88] so `2^n` stays a normal
/// float: results below `exp(-87) ~ 1.6e-38` come out as that, not 0, which is
/// harmless for softmax weights and sigmoids. NaN propagates.
#[inline(always)]
pub(super) fn exp_f32(x: f32) -> f32 {
    // ln2 split in two so n*LN2_HI is exact (LN2_HI has 16 significant bits).
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding 1.5*2^23 rounds to an integer (ties to even) and leaves that
    // integer in the low mantissa bits.
    const SHIFTER: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let t = x * std::f32::consts::LOG2_E + SHIFTER;
    let n = t.to_bits() as i32 - SHIFTER.to_bits() as i32;
    let nf = t - SHIFTER;
    let r = (x - nf * LN2_HI) - nf * LN2_LO;
    let p = 1.0 / 5040.0;
    let p = p * r + 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    p * f32::from_bits(((n + 127) as u32) << 23)
}

/// Runs `f` inside a function compiled for AVX-512 or AVX2, whichever the CPU
/// has (checked at run time, cached by std), else as is.
///
/// The crate is built for baseline x86-64 (SSE2), which leaves the
/// transcendental-heavy loops (GELU, SiLU, cross-entropy) at 4 lanes; `f` is
/// inlined into the wider instantiation, so they vectorise 16 or 8 wide
/// (measured 2-3x faster on those kernels). Results are bit-identical on every
/// path: Rust never contracts `a*b + c` into an FMA, and every reduction's lane
/// layout is explicit, so the same IEEE operations run in the same order.
#[inline(always)]
pub(super) fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn avx512<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        #[target_feature(enable = "avx2")]
        fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            return unsafe { avx512(f) };
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { avx2(f) };
        }
    }
    f()
}

/// `1 / (1 + exp(-z))`.
#[inline(always)]
pub(super) fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-z))
}

#[inline(always)]
pub(super) fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            acc[j] += c[j];
        }
    }
    acc.iter().sum::<f32>() + rest.iter().sum::<f32>()
}

#[inline(always)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let rest: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for j in 0..LANES {
            acc[j] += x[j] * y[j];
        }
    }
    acc.iter().sum::<f32>() + rest
}

/// `sum((x - mean)^2)`.
#[inline(always)]
pub(super) fn sum_sq_dev(x: &[f32], mean: f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest: f32 = chunks
        .remainder()
        .iter()
        .map(|v| (v - mean) * (v - mean))
        .sum();
    for c in chunks {
        for j in 0..LANES {
            let d = c[j] - mean;
            acc[j] += d * d;
        }
    }
    acc.iter().sum::<f32>() + rest
}

#[inline(always)]
pub(super) fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for c in chunks {
        for j in 0..LANES {
            acc[j] = acc[j].max(c[j]);
        }
    }
    acc.iter().fold(rest, |a, &b| a.max(b))
}

/// `sum(exp(x - shift))` accumulated in f64 (8 fixed lanes): a 50k-wide vocab
/// row sums to a few thousand, and f64 keeps the log-sum-exp exact to f32.
#[inline(always)]
pub(super) fn sum_exp_f64(x: &[f32], shift: f32) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = x.chunks_exact(8);
    let rest: f64 = chunks
        .remainder()
        .iter()
        .map(|&v| exp_f32(v - shift) as f64)
        .sum();
    for c in chunks {
        for j in 0..8 {
            acc[j] += exp_f32(c[j] - shift) as f64;
        }
    }
    acc.iter().sum::<f64>() + rest
}

/// In place `x := exp(x - shift)`, returns the f64 sum (same lanes as above).
#[inline(always)]
pub(super) fn exp_inplace_sum_f64(x: &mut [f32], shift: f32) -> f64 {
    let mut acc = [0.0f64; 8];
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        for j in 0..8 {
            c[j] = exp_f32(c[j] - shift);
            acc[j] += c[j] as f64;
        }
    }
    let mut rest = 0.0f64;
    for v in chunks.into_remainder() {
        *v = exp_f32(*v - shift);
        rest += *v as f64;
    }
    acc.iter().sum::<f64>() + rest
}

/// Two lane-accumulated sums of `f(a_i, b_i, c_i)` over equal-length slices.
#[inline(always)]
pub(super) fn sum2_zip3(
    a: &[f32],
    b: &[f32],
    c: &[f32],
    f: impl Fn(f32, f32, f32) -> (f32, f32),
) -> (f32, f32) {
    let (mut s0, mut s1) = ([0.0f32; LANES], [0.0f32; LANES]);
    let (ca, cb, cc) = (
        a.chunks_exact(LANES),
        b.chunks_exact(LANES),
        c.chunks_exact(LANES),
    );
    let (mut t0, mut t1) = (0.0f32, 0.0f32);
    for ((&a, &b), &c) in ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .zip(cc.remainder())
    {
        let (u, v) = f(a, b, c);
        t0 += u;
        t1 += v;
    }
    for ((a, b), c) in ca.zip(cb).zip(cc) {
        for j in 0..LANES {
            let (u, v) = f(a[j], b[j], c[j]);
            s0[j] += u;
            s1[j] += v;
        }
    }
    (s0.iter().sum::<f32>() + t0, s1.iter().sum::<f32>() + t1)
}

#[inline(always)]
pub(super) fn add_assign(dst: &mut [f32], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d += s;
    }
}

/// Rows per rayon task for row-wise kernels over rows of `width` elements.
pub(super) fn rows_per_task(width: usize) -> usize {
    (ELEMS_PER_TASK / width.max(1)).max(1)
}

/// Softmax in place over `x` (non-empty), max-subtracted, f32 sum.
#[inline(always)]
pub(super) fn softmax_inplace(x: &mut [f32]) {
    let m = max(x);
    for v in x.iter_mut() {
        *v = exp_f32(*v - m);
    }
    let inv = 1.0 / sum(x);
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `dst (C) += sum over rows of src (N,C)`, partitioned over columns: each task
/// owns `COLS_PER_TASK` channels and adds all rows into them in row order.
pub(super) fn col_sum_accumulate(dst: &mut [f32], src: &[f32], n: usize, c: usize) {
    dst[..c]
        .par_chunks_mut(COLS_PER_TASK)
        .enumerate()
        .for_each(|(ci, d)| {
            vectorized(
                #[inline(always)]
                || {
                    let c0 = ci * COLS_PER_TASK;
                    for r in 0..n {
                        add_assign(d, &src[r * c + c0..][..d.len()]);
                    }
                },
            )
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::*;

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0.0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 175.0 * i as f64 / 200_000.0;
            let got = exp_f32(x as f32) as f64;
            let want = (x as f32 as f64).exp();
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 2.5e-7, "worst relative error {worst:e}");
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(-1e30) < 1e-37);
    }

    /// `vectorized` must not change results: the same kernels run plainly
    /// (baseline SSE2 code) and inside it (AVX-512/AVX2 here) agree bit for bit.
    #[test]
    fn vectorized_matches_baseline_bits() {
        let x: Vec<f32> = Rng(14).vec(4099).iter().map(|v| v * 30.0).collect();
        #[inline(always)]
        fn kernel(x: &[f32]) -> (Vec<u32>, u64, u32, u32) {
            let mut e = x.to_vec();
            for v in e.iter_mut() {
                *v = sigmoid(*v);
            }
            let m = max(x);
            let mut sm = x[..1000].to_vec();
            softmax_inplace(&mut sm);
            let d = dot(&sm, &x[1000..2000]);
            let e = e.iter().map(|v| v.to_bits()).collect();
            (
                e,
                sum_exp_f64(x, m).to_bits(),
                d.to_bits(),
                sum_sq_dev(x, 0.5).to_bits(),
            )
        }
        let plain = kernel(&x);
        let wide = vectorized(
            #[inline(always)]
            || kernel(&x),
        );
        assert!(plain == wide, "vectorized code changed a result");
    }
}
