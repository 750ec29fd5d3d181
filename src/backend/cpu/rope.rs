//! Rotary position embedding (RoPE) in place on the packed qkv buffer.

use rayon::prelude::*;

use super::math::rows_per_task;
use super::{CpuBackend, CpuBuf};
use crate::backend::AttnShape;

// RoPE in place on one packed qkv buffer; `sign` = 1 rotates, -1 rotates back.
fn rope_apply(qkv: &mut [f32], s: AttnShape, theta: f32, sign: f32) {
    let hd = s.head_dim;
    let w = s.qkv_width();
    let n = s.b * s.t;
    if n == 0 || hd == 0 {
        return;
    }
    assert!(
        hd.is_multiple_of(2),
        "rope needs an even head_dim, got {hd}"
    );
    let half = hd / 2;
    // q heads then k heads are contiguous at the start of the row; v is untouched.
    let heads = s.n_head + s.n_kv_head;
    let rows = rows_per_task(w);
    qkv[..n * w]
        .par_chunks_mut(w * rows)
        .enumerate()
        .for_each(|(ci, blk)| {
            for (ri, row) in blk.chunks_exact_mut(w).enumerate() {
                let pos = ((ci * rows + ri) % s.t) as f64;
                for i in 0..half {
                    // angle = pos * theta^(-2i/hd), in f64 and rounded once.
                    let inv_freq = (theta as f64).powf(-2.0 * i as f64 / hd as f64);
                    let (sin, cos) = (pos * inv_freq).sin_cos();
                    let (sin, cos) = (sign * sin as f32, cos as f32);
                    // rotate_half pairs (i, i + hd/2):
                    // x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.
                    for h in 0..heads {
                        let x = &mut row[h * hd..(h + 1) * hd];
                        let (x1, x2) = (x[i], x[i + half]);
                        x[i] = x1 * cos - x2 * sin;
                        x[i + half] = x2 * cos + x1 * sin;
                    }
                }
            }
        });
}

// qkv (B,T,qkv_width), in place on q and k.
pub(super) fn forward(be: &mut CpuBackend, qkv: &mut CpuBuf, s: AttnShape, theta: f32) {
    let mut qkv = qkv.wide_mut();
    be.pool.install(|| rope_apply(&mut qkv, s, theta, 1.0));
}

// dqkv (B,T,qkv_width): the transpose of a rotation is the rotation by -angle.
pub(super) fn backward(be: &mut CpuBackend, dqkv: &mut CpuBuf, s: AttnShape, theta: f32) {
    let mut dqkv = dqkv.wide_mut();
    be.pool.install(|| rope_apply(&mut dqkv, s, theta, -1.0));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::*;

    fn ref_rope(qkv: &[f64], s: AttnShape, theta: f64) -> Vec<f64> {
        let (w, hd) = (s.qkv_width(), s.head_dim);
        let mut out = qkv.to_vec();
        for r in 0..s.b * s.t {
            let pos = (r % s.t) as f64;
            for h in 0..s.n_head + s.n_kv_head {
                let base = r * w + h * hd;
                for i in 0..hd / 2 {
                    let ang = pos * theta.powf(-2.0 * i as f64 / hd as f64);
                    let (x1, x2) = (qkv[base + i], qkv[base + i + hd / 2]);
                    out[base + i] = x1 * ang.cos() - x2 * ang.sin();
                    out[base + i + hd / 2] = x2 * ang.cos() + x1 * ang.sin();
                }
            }
        }
        out
    }

    #[test]
    fn rope_forward_backward() {
        let s = shape();
        let theta = 10_000.0;
        let len = s.b * s.t * s.qkv_width();
        let mut rng = Rng(8);
        let x = rng.vec(len);
        let mut be = be(2);
        let mut buf = f(&x);
        be.rope_forward(&mut buf, s, theta);
        close(
            buf.as_f32(),
            &ref_rope(&d(&x), s, theta as f64),
            FWD,
            "rope",
        );
        let g = rng.vec(len);
        let mut dg = f(&g);
        be.rope_backward(&mut dg, s, theta);
        let want = fd_grad(|x| proj(&ref_rope(x, s, theta as f64), &g), &d(&x));
        close(dg.as_f32(), &want, BWD, "rope backward");
    }
}
