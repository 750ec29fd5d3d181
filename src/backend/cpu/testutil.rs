//! What the op files' tests share, and the one test that runs them all.
//!
//! Each op file's tests check its ops against a naive f64 reference written
//! there. Forward ops compare with `|got - want| <= 1e-5 + 1e-5*|want|`;
//! backward ops compare against the analytic f64 gradient or central
//! differences (h = 1e-5) of the f64 forward reference with
//! `|got - want| <= 5e-5 + 1e-4*|want|` (f32 rounding of O(1) values plus the
//! ~1e-10 finite-difference error).

pub(super) use super::{CpuBackend, CpuBuf};
pub(super) use crate::backend::{AttnShape, Backend};

use super::loss::SUMSQ_CHUNK;

pub(super) const FWD: (f64, f64) = (1e-5, 1e-5);
pub(super) const BWD: (f64, f64) = (5e-5, 1e-4);

/// xorshift64*: deterministic inputs without a dependency.
pub(super) struct Rng(pub(super) u64);
impl Rng {
    pub(super) fn f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
        (bits as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub(super) fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
    pub(super) fn tokens(&mut self, n: usize, v: usize) -> Vec<u32> {
        (0..n)
            .map(|_| (((self.f32() + 1.0) * 0.5 * v as f32) as usize).min(v - 1) as u32)
            .collect()
    }
}

pub(super) fn be(threads: usize) -> CpuBackend {
    CpuBackend::new(threads).unwrap()
}
pub(super) fn f(v: &[f32]) -> CpuBuf {
    CpuBuf::F32(v.to_vec())
}
pub(super) fn u(v: &[u32]) -> CpuBuf {
    CpuBuf::U32(v.to_vec())
}
pub(super) fn d(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}
pub(super) fn zeros(n: usize) -> CpuBuf {
    CpuBuf::F32(vec![0.0; n])
}
pub(super) fn nans(n: usize) -> CpuBuf {
    CpuBuf::F32(vec![f32::NAN; n])
}

#[track_caller]
pub(super) fn close(got: &[f32], want: &[f64], (atol, rtol): (f64, f64), what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= atol + rtol * w.abs(),
            "{what}[{i}]: got {g}, want {w} (err {err:e})"
        );
    }
}

/// `init + grad`, the expected value of an accumulating gradient.
pub(super) fn plus(init: &[f32], grad: &[f64]) -> Vec<f64> {
    init.iter().zip(grad).map(|(&a, &b)| a as f64 + b).collect()
}

/// Central differences of a scalar function of `x`.
pub(super) fn fd_grad(f: impl Fn(&[f64]) -> f64, x: &[f64]) -> Vec<f64> {
    let h = 1e-5;
    let mut x = x.to_vec();
    (0..x.len())
        .map(|i| {
            let x0 = x[i];
            x[i] = x0 + h;
            let fp = f(&x);
            x[i] = x0 - h;
            let fm = f(&x);
            x[i] = x0;
            (fp - fm) / (2.0 * h)
        })
        .collect()
}

pub(super) fn proj(a: &[f64], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, &y)| x * y as f64).sum()
}

pub(super) fn shape() -> AttnShape {
    AttnShape {
        b: 2,
        t: 4,
        n_head: 4,
        n_kv_head: 2,
        head_dim: 4,
    }
}

pub(super) fn bits(b: &CpuBuf) -> Vec<u32> {
    b.as_f32().iter().map(|x| x.to_bits()).collect()
}

/// Runs the reductions and GEMMs on 1 and 2 threads with shapes large enough
/// that the 2-thread run really splits the work; results must match bit for bit.
#[test]
fn one_and_two_threads_bit_identical() {
    let run = |threads: usize| -> Vec<Vec<u32>> {
        let mut be = be(threads);
        let mut rng = Rng(13);
        let mut res = Vec::new();
        // layernorm: 200 channels = 4 column tasks, 64 rows.
        let (n, c) = (64, 200);
        let (x, w, b, dout) = (rng.vec(n * c), rng.vec(c), rng.vec(c), rng.vec(n * c));
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
            1e-5,
        );
        let (mut dx, mut dw, mut db) = (zeros(n * c), zeros(c), zeros(c));
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
        res.extend([bits(&out), bits(&dx), bits(&dw), bits(&db)]);
        let mut drw = zeros(c);
        be.rmsnorm_backward(&mut dx, &mut drw, &f(&dout), &f(&x), &f(&w), &rstd, n, c);
        res.extend([bits(&dx), bits(&drw)]);
        // matmul: above gemm's threading threshold in every product.
        let (n, c, oc) = (128, 192, 160);
        let (x, w, dout) = (rng.vec(n * c), rng.vec(oc * c), rng.vec(n * oc));
        let mut out = zeros(n * oc);
        be.matmul_forward(&mut out, &f(&x), &f(&w), Some(&f(&rng.vec(oc))), n, c, oc);
        let (mut dx, mut dw, mut db) = (zeros(n * c), f(&rng.vec(oc * c)), zeros(oc));
        be.matmul_backward(
            &mut dx,
            Some(&mut dw),
            Some(&mut db),
            &f(&dout),
            &f(&x),
            &f(&w),
            n,
            c,
            oc,
        );
        res.extend([bits(&out), bits(&dx), bits(&dw), bits(&db)]);
        // embedding: 600 rows = 3 vocab tasks, many repeated tokens.
        let (v, c, t, n) = (600, 16, 8, 64);
        let mut tokens = rng.tokens(n, v);
        tokens[10] = tokens[3];
        tokens[40] = tokens[3];
        let (mut dwte, mut dwpe) = (f(&rng.vec(v * c)), zeros(t * c));
        be.embed_backward(
            &mut dwte,
            Some(&mut dwpe),
            &f(&rng.vec(n * c)),
            &u(&tokens),
            n,
            t,
            c,
        );
        res.extend([bits(&dwte), bits(&dwpe)]);
        // attention: 2 x 2 (b, kv head) tasks.
        let s = AttnShape {
            b: 2,
            t: 16,
            n_head: 4,
            n_kv_head: 2,
            head_dim: 8,
        };
        let (len, olen, alen) = (
            s.b * s.t * s.qkv_width(),
            s.b * s.t * s.out_width(),
            s.b * s.n_head * s.t * s.t,
        );
        let qkv = f(&rng.vec(len));
        let (mut out, mut att) = (zeros(olen), zeros(alen));
        be.attention_forward(&mut out, &mut att, &qkv, s);
        let (mut dqkv, mut datt) = (zeros(len), zeros(alen));
        be.attention_backward(&mut dqkv, &mut datt, &f(&rng.vec(olen)), &qkv, &att, s);
        res.extend([bits(&out), bits(&att), bits(&dqkv)]);
        let n = 3 * SUMSQ_CHUNK + 5;
        let ss = be.sum_squares(&f(&rng.vec(n)), n).unwrap().to_bits();
        res.push(vec![ss as u32, (ss >> 32) as u32]);
        res
    };
    let (one, two) = (run(1), run(2));
    for (i, (a, b)) in one.iter().zip(&two).enumerate() {
        assert!(a == b, "output {i} differs between 1 and 2 threads");
    }
}
