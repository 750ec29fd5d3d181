//! The GEMMs: strided operands ([`Mat`]), one single-threaded `gemm` call
//! ([`sgemm`]) and its split into fixed blocks over the pool
//! ([`sgemm_blocked`]); on them the linear layer's forward and backward, and
//! `copy_cols`.

use gemm::{Parallelism, gemm};
use rayon::prelude::*;

use super::math::{col_sum_accumulate, rows_per_task};
use super::{CpuBackend, CpuBuf};

/// A strided matrix operand: element `(i, j)` is at `ptr + i*rs + j*cs`.
#[derive(Clone, Copy)]
pub(super) struct Mat {
    ptr: *const f32,
    rs: isize,
    cs: isize,
}

impl Mat {
    /// Row-major with row stride `ld`.
    pub(super) fn rows(ptr: *const f32, ld: usize) -> Self {
        Mat {
            ptr,
            rs: ld as isize,
            cs: 1,
        }
    }
    /// The transpose of a row-major matrix with row stride `ld`.
    pub(super) fn trans(ptr: *const f32, ld: usize) -> Self {
        Mat {
            ptr,
            rs: 1,
            cs: ld as isize,
        }
    }
    /// The view starting at element `(i, j)`.
    pub(super) fn offset(self, i: usize, j: usize) -> Mat {
        Mat {
            ptr: self
                .ptr
                .wrapping_offset(i as isize * self.rs + j as isize * self.cs),
            ..self
        }
    }
}

// SAFETY: a read-only view of a buffer the op borrows for its whole duration.
unsafe impl Send for Mat {}
unsafe impl Sync for Mat {}

/// `dst (m,n) = scale * lhs (m,k) @ rhs (k,n)`, or `dst += ...` when `accumulate`.
/// `dst` is row-major with row stride `dst_ld`.
///
/// # Safety
/// Every element the shapes and strides address must be in bounds, `dst` must be
/// valid for writes there and overlap neither operand, and no other thread may
/// touch the `dst` elements during the call.
pub(super) unsafe fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_ld: usize,
    accumulate: bool,
    lhs: Mat,
    rhs: Mat,
    scale: f32,
) {
    // gemm computes dst = alpha*dst + beta*lhs@rhs (dst not read when !read_dst).
    // SAFETY: forwarded to the caller.
    unsafe {
        gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_ld as isize,
            accumulate,
            lhs.ptr,
            lhs.cs,
            lhs.rs,
            rhs.ptr,
            rhs.cs,
            rhs.rs,
            1.0,
            scale,
            false,
            false,
            false,
            Parallelism::None,
        )
    }
}

/// Which dimension of `dst` [`sgemm_blocked`] splits into tasks.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Split {
    Rows,
    Cols,
}

/// Width of one GEMM task: two of gemm's 64-wide AVX-512 f32 micro-panels.
pub(super) const GEMM_BLOCK: usize = 256;

/// [`sgemm`] over the pool: `dst` is cut along `split` into fixed blocks of
/// [`GEMM_BLOCK`] rows or columns, each one a single-threaded GEMM task.
///
/// Why not gemm's own `Parallelism::Rayon`: at this project's shapes (a few
/// hundred token rows against 768..50k outputs) its split left a core idle part
/// of the time; fixed blocks measured ~30% faster on 2 threads. The blocks do
/// not depend on the thread count, so neither does any output element's
/// arithmetic: results are bit-identical for every pool size.
///
/// # Safety
/// As [`sgemm`]; the whole of `dst` is written by the tasks, each its own block.
pub(super) unsafe fn sgemm_blocked(
    split: Split,
    m: usize,
    n: usize,
    k: usize,
    dst: SyncPtr,
    dst_ld: usize,
    accumulate: bool,
    lhs: Mat,
    rhs: Mat,
) {
    let len = if split == Split::Rows { m } else { n };
    (0..len.div_ceil(GEMM_BLOCK))
        .into_par_iter()
        .for_each(|bi| {
            let i0 = bi * GEMM_BLOCK;
            let w = GEMM_BLOCK.min(len - i0);
            // SAFETY: block bi covers rows (or columns) [i0, i0 + w) of dst and
            // the matching rows of lhs (columns of rhs): in bounds, disjoint.
            unsafe {
                match split {
                    Split::Rows => sgemm(
                        w,
                        n,
                        k,
                        dst.get().add(i0 * dst_ld),
                        dst_ld,
                        accumulate,
                        lhs.offset(i0, 0),
                        rhs,
                        1.0,
                    ),
                    Split::Cols => sgemm(
                        m,
                        w,
                        k,
                        dst.get().add(i0),
                        dst_ld,
                        accumulate,
                        lhs,
                        rhs.offset(0, i0),
                        1.0,
                    ),
                }
            }
        });
}

/// A raw pointer that rayon tasks may share. Used only where each task writes a
/// disjoint, strided region of one buffer that `par_chunks_mut` cannot express.
#[derive(Clone, Copy)]
pub(super) struct SyncPtr(pub(super) *mut f32);
// SAFETY: the call sites guarantee the regions written through it are disjoint.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// A method (not field access) so closures capture the whole `Sync` wrapper.
    pub(super) fn get(self) -> *mut f32 {
        self.0
    }
}

// out (N,OC) = inp (N,C) @ w (OC,C)^T + bias (OC).
pub(super) fn forward(
    be: &mut CpuBackend,
    out: &mut CpuBuf,
    inp: &CpuBuf,
    w: &CpuBuf,
    bias: Option<&CpuBuf>,
    n: usize,
    c: usize,
    oc: usize,
) {
    if n == 0 || oc == 0 {
        return;
    }
    let out = &mut out.wide_mut()[..n * oc];
    let inp = &inp.wide()[..n * c];
    let w = &w.wide()[..oc * c];
    let bias = bias.map(|b| b.wide());
    let bias = bias.as_deref().map(|b| &b[..oc]);
    be.pool.install(|| {
        // With a bias, seed every output row with it and let the GEMM accumulate.
        if let Some(bias) = bias {
            out.par_chunks_mut(oc * rows_per_task(oc)).for_each(|blk| {
                blk.chunks_exact_mut(oc)
                    .for_each(|o| o.copy_from_slice(bias))
            });
        }
        // SAFETY: out is (n,oc) row-major, inp (n,c) row-major, w (oc,c)
        // row-major read as its transpose (c,oc); all in bounds, no overlap.
        unsafe {
            sgemm_blocked(
                Split::Cols,
                n,
                oc,
                c,
                SyncPtr(out.as_mut_ptr()),
                oc,
                bias.is_some(),
                Mat::rows(inp.as_ptr(), c),
                Mat::trans(w.as_ptr(), c),
            )
        }
    });
}

// dinp (N,C) = dout (N,OC) @ w (OC,C); dw (OC,C) += dout^T @ inp (N,C);
// dbias (OC) += column sums of dout.
pub(super) fn backward(
    be: &mut CpuBackend,
    dinp: &mut CpuBuf,
    dw: Option<&mut CpuBuf>,
    dbias: Option<&mut CpuBuf>,
    dout: &CpuBuf,
    inp: &CpuBuf,
    w: &CpuBuf,
    n: usize,
    c: usize,
    oc: usize,
) {
    let dinp = &mut dinp.wide_mut()[..n * c];
    let mut dw = dw.map(|dw| dw.wide_mut());
    let dout = &dout.wide()[..n * oc];
    let inp = &inp.wide()[..n * c];
    let w = &w.wide()[..oc * c];
    be.pool.install(|| {
        // SAFETY (both calls): row-major buffers of exactly the stated shapes,
        // transposes as strides over the same memory, dst overlaps nothing.
        unsafe {
            // dinp (N,C) = dout (N,OC) @ w (OC,C), split over C.
            sgemm_blocked(
                Split::Cols,
                n,
                c,
                oc,
                SyncPtr(dinp.as_mut_ptr()),
                c,
                false,
                Mat::rows(dout.as_ptr(), oc),
                Mat::rows(w.as_ptr(), c),
            );
            // A frozen weight: no weight or bias gradient.
            let Some(dw) = dw.as_mut() else {
                return;
            };
            let dw = &mut dw[..oc * c];
            // dw (OC,C) += dout^T (OC,N) @ inp (N,C), split over OC.
            sgemm_blocked(
                Split::Rows,
                oc,
                c,
                n,
                SyncPtr(dw.as_mut_ptr()),
                c,
                true,
                Mat::trans(dout.as_ptr(), oc),
                Mat::rows(inp.as_ptr(), c),
            );
        }
        if let Some(dbias) = dbias {
            col_sum_accumulate(&mut dbias.wide_mut(), dout, n, oc);
        }
    });
}

pub(super) fn copy_cols(
    _: &mut CpuBackend,
    dst: &mut CpuBuf,
    dst_cols: usize,
    dst_off: usize,
    src: &CpuBuf,
    src_cols: usize,
    src_off: usize,
    rows: usize,
    width: usize,
    scale: f32,
    accumulate: bool,
) {
    let s = src.wide();
    let mut d = dst.wide_mut();
    crate::backend::copy_cols_host(
        &mut d, dst_cols, dst_off, &s, src_cols, src_off, rows, width, scale, accumulate,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::testutil::*;

    fn ref_matmul(
        x: &[f64],
        w: &[f64],
        bias: Option<&[f64]>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Vec<f64> {
        let mut out = vec![0.0; n * oc];
        for r in 0..n {
            for o in 0..oc {
                out[r * oc + o] = bias.map_or(0.0, |b| b[o])
                    + (0..c).map(|i| x[r * c + i] * w[o * c + i]).sum::<f64>();
            }
        }
        out
    }

    #[test]
    fn matmul_forward_backward() {
        let mut be = be(2);
        // A tiny shape and one big enough for gemm's packed, threaded path.
        for &(n, c, oc) in &[(6, 8, 5), (70, 96, 130)] {
            let mut rng = Rng(4 + n as u64);
            let (x, w, bias) = (rng.vec(n * c), rng.vec(oc * c), rng.vec(oc));
            let mut out = nans(n * oc);
            be.matmul_forward(&mut out, &f(&x), &f(&w), Some(&f(&bias)), n, c, oc);
            let (x64, w64) = (d(&x), d(&w));
            close(
                out.as_f32(),
                &ref_matmul(&x64, &w64, Some(&d(&bias)), n, c, oc),
                FWD,
                "mm out",
            );
            be.matmul_forward(&mut out, &f(&x), &f(&w), None, n, c, oc);
            close(
                out.as_f32(),
                &ref_matmul(&x64, &w64, None, n, c, oc),
                FWD,
                "mm out (no bias)",
            );

            let dout = rng.vec(n * oc);
            let (dw0, db0) = (rng.vec(oc * c), rng.vec(oc));
            // dinp starts as NaN: it must be overwritten, never read.
            let (mut dx, mut dw, mut db) = (nans(n * c), f(&dw0), f(&db0));
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
            let mut gx = vec![0.0; n * c];
            let mut gw = vec![0.0; oc * c];
            let mut gb = vec![0.0; oc];
            for r in 0..n {
                for o in 0..oc {
                    let g = dout[r * oc + o] as f64;
                    gb[o] += g;
                    for i in 0..c {
                        gx[r * c + i] += g * w64[o * c + i];
                        gw[o * c + i] += g * x64[r * c + i];
                    }
                }
            }
            close(dx.as_f32(), &gx, BWD, "mm dinp");
            close(dw.as_f32(), &plus(&dw0, &gw), BWD, "mm dw");
            close(db.as_f32(), &plus(&db0, &gb), BWD, "mm dbias");
        }
    }

    #[test]
    fn frozen_matmul_backward_gives_the_same_input_gradient_and_no_weight_gradient() {
        let mut be = CpuBackend::new(2).unwrap();
        let (n, c, oc) = (5, 7, 3);
        let mut rng = crate::rng::Rng::new(9);
        let mut v = |k: usize| (0..k).map(|_| rng.normal() as f32).collect::<Vec<f32>>();
        let (x, w, dy) = (v(n * c), v(oc * c), v(n * oc));
        let mut dx_full = CpuBuf::F32(vec![0.0; n * c]);
        let mut dw = CpuBuf::F32(vec![0.0; oc * c]);
        let mut db = CpuBuf::F32(vec![0.0; oc]);
        let (xb, wb, dyb) = (CpuBuf::F32(x), CpuBuf::F32(w), CpuBuf::F32(dy));
        be.matmul_backward(
            &mut dx_full,
            Some(&mut dw),
            Some(&mut db),
            &dyb,
            &xb,
            &wb,
            n,
            c,
            oc,
        );
        let mut dx = CpuBuf::F32(vec![f32::NAN; n * c]);
        let mut db2 = CpuBuf::F32(vec![0.0; oc]);
        be.matmul_backward(&mut dx, None, Some(&mut db2), &dyb, &xb, &wb, n, c, oc);
        assert_eq!(dx.wide(), dx_full.wide());
        assert!(
            db2.wide().iter().all(|&b| b == 0.0),
            "a frozen weight's bias is left alone"
        );
    }

    #[test]
    fn copy_cols_reads_and_adds_a_column_block() {
        let mut be = CpuBackend::new(1).unwrap();
        // dst (2 rows x 5), src (2 x 2) into columns 1..3, scaled.
        let mut dst = CpuBuf::F32((0..10).map(|i| i as f32).collect());
        let src = CpuBuf::F32(vec![1.0, 2.0, 3.0, 4.0]);
        be.copy_cols(&mut dst, 5, 1, &src, 2, 0, 2, 2, 0.5, true);
        assert_eq!(
            dst.wide().to_vec(),
            vec![0.0, 1.5, 3.0, 3.0, 4.0, 5.0, 7.5, 9.0, 8.0, 9.0]
        );
        let mut out = CpuBuf::F32(vec![9.0; 4]);
        be.copy_cols(&mut out, 2, 0, &dst, 5, 1, 2, 2, 1.0, false);
        assert_eq!(out.wide().to_vec(), vec![1.5, 3.0, 7.5, 9.0]);
    }
}
