//! Eager causal attention: the T x T probabilities are materialised and
//! saved, and every product is a GEMM (the fused kernels are in
//! `attention.rs`).

use rayon::prelude::*;

use super::math::{dot, softmax_inplace, vectorized};
use super::matmul::{Mat, SyncPtr, sgemm};
use super::{CpuBackend, CpuBuf};
use crate::backend::{AttnOpts, AttnShape};

// out (B,T,H*hd), att (B,H,T,T), qkv (B,T,qkv_width).
// One task per (b, h): scores = q k^T / sqrt(hd) by GEMM (the full T x T;
// the masked half is overwritten), causal softmax per row, out_h = att @ v.
pub(super) fn forward(
    be: &mut CpuBackend,
    out: &mut CpuBuf,
    att: &mut CpuBuf,
    qkv: &CpuBuf,
    s: AttnShape,
) {
    forward_with(be, out, att, None, qkv, s, AttnOpts::standard(s))
}

// With Gemma's options: the scores scaled by `o.scale`, soft-capped (each
// live score's `tanh(s / cap)` saved in `tanh (B,H,T,T)` for the backward,
// as autograd saves tanh's output in transformers' eager attention, the
// masked entries 0), and keys outside a sliding window masked.
pub(super) fn forward_with(
    be: &mut CpuBackend,
    out: &mut CpuBuf,
    att: &mut CpuBuf,
    tanh: Option<&mut CpuBuf>,
    qkv: &CpuBuf,
    s: AttnShape,
    o: AttnOpts,
) {
    let AttnShape {
        b,
        t,
        n_head: nh,
        n_kv_head: nkv,
        head_dim: hd,
    } = s;
    if b == 0 || t == 0 || nh == 0 {
        return;
    }
    assert!(
        nkv > 0 && nh.is_multiple_of(nkv),
        "n_head {nh} is not a multiple of n_kv_head {nkv}"
    );
    let rep = nh / nkv;
    let (w, ow) = (s.qkv_width(), s.out_width());
    let qkv = &qkv.wide()[..b * t * w];
    let out = &mut out.wide_mut()[..b * t * ow];
    let att = &mut att.wide_mut()[..b * nh * t * t];
    let scale = o.scale;
    let out_ptr = SyncPtr(out.as_mut_ptr());
    assert_eq!(
        tanh.is_some(),
        o.softcap.is_some(),
        "a soft cap saves its tanh"
    );
    let mut tanh = tanh.map(|x| x.wide_mut());
    let tanh_ptr = tanh
        .as_mut()
        .map(|x| SyncPtr(x[..b * nh * t * t].as_mut_ptr()));
    be.pool.install(|| {
        att.par_chunks_mut(t * t).enumerate().for_each(|(bh, a)| {
            let (bi, h) = (bh / nh, bh % nh);
            let g = h / rep;
            let row0 = &qkv[bi * t * w..];
            let q = row0[h * hd..].as_ptr();
            let k = row0[(nh + g) * hd..].as_ptr();
            let v = row0[(nh + nkv + g) * hd..].as_ptr();
            // SAFETY: q/k/v are (T,hd) views with row stride w inside qkv;
            // a is this task's own (T,T) chunk.
            unsafe {
                sgemm(
                    t,
                    t,
                    hd,
                    a.as_mut_ptr(),
                    t,
                    false,
                    Mat::rows(q, w),
                    Mat::trans(k, w),
                    scale,
                )
            };
            // SAFETY: this task's own (T,T) chunk of `tanh`.
            let mut th = tanh_ptr
                .map(|p| unsafe { std::slice::from_raw_parts_mut(p.get().add(bh * t * t), t * t) });
            vectorized(
                #[inline(always)]
                || {
                    for (ti, row) in a.chunks_exact_mut(t).enumerate() {
                        let lo = o.window.map_or(0, |w| (ti + 1).saturating_sub(w));
                        let (live, masked) = row.split_at_mut(ti + 1);
                        if let (Some(cap), Some(th)) = (o.softcap, th.as_deref_mut()) {
                            let th = &mut th[ti * t..][..t];
                            th.fill(0.0);
                            for (x, z) in live[lo..].iter_mut().zip(&mut th[lo..]) {
                                *z = (*x / cap).tanh();
                                *x = cap * *z;
                            }
                        }
                        softmax_inplace(&mut live[lo..]);
                        live[..lo].fill(0.0);
                        masked.fill(0.0);
                    }
                },
            );
            // SAFETY: out rows of batch bi, columns [h*hd, (h+1)*hd): a region
            // no other (b, h) task writes. The masked probabilities are exact
            // zeros, so for finite v the full-width product is the causal sum.
            unsafe {
                sgemm(
                    t,
                    hd,
                    t,
                    out_ptr.get().add(bi * t * ow + h * hd),
                    ow,
                    false,
                    Mat::rows(a.as_ptr(), t),
                    Mat::rows(v, w),
                    1.0,
                )
            };
        })
    });
}

// dqkv (B,T,qkv_width) overwritten, datt (B,H,T,T) scratch, dout (B,T,H*hd).
// One task per (b, kv head g): it owns dq of the group's query heads and dk_g,
// dv_g, so the accumulation over the group's heads never races, and it owns
// the contiguous datt slab of those heads.
pub(super) fn backward(
    be: &mut CpuBackend,
    dqkv: &mut CpuBuf,
    datt: &mut CpuBuf,
    dout: &CpuBuf,
    qkv: &CpuBuf,
    att: &CpuBuf,
    s: AttnShape,
) {
    backward_with(
        be,
        dqkv,
        datt,
        dout,
        qkv,
        att,
        None,
        s,
        AttnOpts::standard(s),
    )
}

// With Gemma's options ([`forward_with`]): the soft cap's derivative
// `1 - tanh²` read from the saved `tanh`; masked probabilities are 0, so
// the window needs nothing more.
pub(super) fn backward_with(
    be: &mut CpuBackend,
    dqkv: &mut CpuBuf,
    datt: &mut CpuBuf,
    dout: &CpuBuf,
    qkv: &CpuBuf,
    att: &CpuBuf,
    tanh: Option<&CpuBuf>,
    s: AttnShape,
    o: AttnOpts,
) {
    let AttnShape {
        b,
        t,
        n_head: nh,
        n_kv_head: nkv,
        head_dim: hd,
    } = s;
    if b == 0 || t == 0 || nh == 0 {
        return;
    }
    assert!(
        nkv > 0 && nh.is_multiple_of(nkv),
        "n_head {nh} is not a multiple of n_kv_head {nkv}"
    );
    let rep = nh / nkv;
    let (w, ow) = (s.qkv_width(), s.out_width());
    let dqkv = &mut dqkv.wide_mut()[..b * t * w];
    let datt = &mut datt.wide_mut()[..b * nh * t * t];
    let dout = &dout.wide()[..b * t * ow];
    let qkv = &qkv.wide()[..b * t * w];
    let att = &att.wide()[..b * nh * t * t];
    let scale = o.scale;
    assert_eq!(
        tanh.is_some(),
        o.softcap.is_some(),
        "a soft cap reads its tanh"
    );
    let tanh = tanh.map(|x| x.wide());
    let tanh = tanh.as_deref().map(|x| &x[..b * nh * t * t]);
    let dqkv_ptr = SyncPtr(dqkv.as_mut_ptr());
    be.pool.install(|| {
        datt.par_chunks_mut(rep * t * t)
            .enumerate()
            .for_each(|(bg, dslab)| {
                let (bi, g) = (bg / nkv, bg % nkv);
                let row0 = &qkv[bi * t * w..];
                let k = row0[(nh + g) * hd..].as_ptr();
                let v = row0[(nh + nkv + g) * hd..].as_ptr();
                // SAFETY: offsets inside dqkv; this task alone writes the
                // q columns of heads g*rep.. and the k, v columns of kv head g.
                let drow0 = unsafe { dqkv_ptr.get().add(bi * t * w) };
                let dk = unsafe { drow0.add((nh + g) * hd) };
                let dv = unsafe { drow0.add((nh + nkv + g) * hd) };
                for (j, da) in dslab.chunks_exact_mut(t * t).enumerate() {
                    let h = g * rep + j;
                    let a = &att[(bi * nh + h) * t * t..][..t * t];
                    let th = tanh.map(|x| &x[(bi * nh + h) * t * t..][..t * t]);
                    let q = row0[h * hd..].as_ptr();
                    let dq = unsafe { drow0.add(h * hd) };
                    let dy = dout[bi * t * ow + h * hd..].as_ptr();
                    // The first head of the group overwrites dk, dv; the rest add.
                    let acc = j > 0;
                    // SAFETY: all views are (T,hd) or (T,T) inside their buffers.
                    unsafe {
                        // dp (T,T) = dout_h (T,hd) @ v_g^T
                        sgemm(
                            t,
                            t,
                            hd,
                            da.as_mut_ptr(),
                            t,
                            false,
                            Mat::rows(dy, ow),
                            Mat::trans(v, w),
                            1.0,
                        );
                        // dv_g (T,hd) += att^T (T,T) @ dout_h
                        sgemm(
                            t,
                            hd,
                            t,
                            dv,
                            w,
                            acc,
                            Mat::trans(a.as_ptr(), t),
                            Mat::rows(dy, ow),
                            1.0,
                        );
                    }
                    // softmax backward per row: ds = p * (dp - sum(p * dp)).
                    vectorized(
                        #[inline(always)]
                        || {
                            for (ti, (drow, prow)) in
                                da.chunks_exact_mut(t).zip(a.chunks_exact(t)).enumerate()
                            {
                                let (live, masked) = drow.split_at_mut(ti + 1);
                                let p = &prow[..ti + 1];
                                let local = dot(p, live);
                                for (d, &p) in live.iter_mut().zip(p) {
                                    *d = p * (*d - local);
                                }
                                // The soft cap: d s = d y (1 - tanh²).
                                if let Some(th) = th {
                                    for (d, &z) in live.iter_mut().zip(&th[ti * t..]) {
                                        *d *= 1.0 - z * z;
                                    }
                                }
                                masked.fill(0.0);
                            }
                        },
                    );
                    unsafe {
                        // dq_h (T,hd) = scale * ds (T,T) @ k_g
                        sgemm(
                            t,
                            hd,
                            t,
                            dq,
                            w,
                            false,
                            Mat::rows(da.as_ptr(), t),
                            Mat::rows(k, w),
                            scale,
                        );
                        // dk_g (T,hd) += scale * ds^T @ q_h
                        sgemm(
                            t,
                            hd,
                            t,
                            dk,
                            w,
                            acc,
                            Mat::trans(da.as_ptr(), t),
                            Mat::rows(q, w),
                            scale,
                        );
                    }
                }
            })
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::*;

    fn ref_attention(qkv: &[f64], s: AttnShape) -> (Vec<f64>, Vec<f64>) {
        let (t, nh, nkv, hd) = (s.t, s.n_head, s.n_kv_head, s.head_dim);
        let (w, ow) = (s.qkv_width(), s.out_width());
        let mut out = vec![0.0; s.b * t * ow];
        let mut att = vec![0.0; s.b * nh * t * t];
        for b in 0..s.b {
            for h in 0..nh {
                let g = h / (nh / nkv);
                for i in 0..t {
                    let q = &qkv[(b * t + i) * w + h * hd..][..hd];
                    let scores: Vec<f64> = (0..=i)
                        .map(|j| {
                            let k = &qkv[(b * t + j) * w + (nh + g) * hd..][..hd];
                            q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|x| (x - m).exp()).sum();
                    for j in 0..=i {
                        let p = (scores[j] - m).exp() / z;
                        att[((b * nh + h) * t + i) * t + j] = p;
                        for e in 0..hd {
                            out[(b * t + i) * ow + h * hd + e] +=
                                p * qkv[(b * t + j) * w + (nh + nkv + g) * hd + e];
                        }
                    }
                }
            }
        }
        (out, att)
    }

    #[test]
    fn attention_forward_backward() {
        let odd = AttnShape {
            b: 1,
            t: 9,
            n_head: 3,
            n_kv_head: 1,
            head_dim: 6,
        };
        for s in [shape(), odd] {
            let (len, olen, alen) = (
                s.b * s.t * s.qkv_width(),
                s.b * s.t * s.out_width(),
                s.b * s.n_head * s.t * s.t,
            );
            let mut rng = Rng(9 + s.t as u64);
            let qkv: Vec<f32> = rng.vec(len).iter().map(|v| v * 2.0).collect();
            let mut be = be(2);
            let (mut out, mut att) = (nans(olen), nans(alen));
            be.attention_forward(&mut out, &mut att, &f(&qkv), s);
            let (wo, wa) = ref_attention(&d(&qkv), s);
            close(out.as_f32(), &wo, FWD, "attn out");
            close(att.as_f32(), &wa, FWD, "attn probabilities");

            let dout = rng.vec(olen);
            let (mut dqkv, mut datt) = (nans(len), nans(alen));
            be.attention_backward(&mut dqkv, &mut datt, &f(&dout), &f(&qkv), &att, s);
            let want = fd_grad(|x| proj(&ref_attention(x, s).0, &dout), &d(&qkv));
            close(dqkv.as_f32(), &want, BWD, "attn dqkv");
        }
    }
}
