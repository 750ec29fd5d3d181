//! The mixture-of-experts kernels on the host: token rows gathered into
//! the experts' permuted buffer and scattered back, the combine weights'
//! row dots, and the grouped GEMM over each expert's rows.

use rayon::prelude::*;

use super::matmul::{GEMM_BLOCK, Mat, Split, SyncPtr, sgemm_blocked};
use super::{CpuBackend, CpuBuf};

/// Row `j` of `out (M,C)`: `x[idx[j]]`, times `w[j]`; zero for an empty slot.
pub(super) fn gather(
    out: &mut [f32],
    x: &[f32],
    idx: &[u32],
    w: Option<&[f32]>,
    n: usize,
    c: usize,
) {
    out.par_chunks_mut(c).enumerate().for_each(|(j, o)| {
        let t = idx[j] as usize;
        if t >= n {
            o.fill(0.0);
            return;
        }
        let s = w.map_or(1.0, |w| w[j]);
        for (o, &v) in o.iter_mut().zip(&x[t * c..(t + 1) * c]) {
            *o = s * v;
        }
    });
}

/// `out[idx[j]] += w[j] · y[j]` for each routed row, in row order, so a
/// token's sum does not depend on the thread count: the columns are split
/// over the threads, the rows are not.
pub(super) fn scatter(
    out: &mut [f32],
    y: &[f32],
    idx: &[u32],
    w: Option<&[f32]>,
    n: usize,
    c: usize,
) {
    let cols = GEMM_BLOCK.min(c.max(1));
    let out = SyncPtr(out.as_mut_ptr());
    (0..c.div_ceil(cols)).into_par_iter().for_each(|b| {
        let (c0, c1) = (b * cols, ((b + 1) * cols).min(c));
        for (j, &t) in idx.iter().enumerate() {
            let t = t as usize;
            if t >= n {
                continue;
            }
            let s = w.map_or(1.0, |w| w[j]);
            for k in c0..c1 {
                // SAFETY: task b writes only columns [c0, c1) of the
                // (n, c) output, and t < n: in bounds, disjoint per task.
                unsafe { *out.get().add(t * c + k) += s * y[j * c + k] };
            }
        }
    });
}

/// `out[j] = a[idx[j]] · b[j]`, zero for an empty slot (fp32 sums).
pub(super) fn row_dots(out: &mut [f32], a: &[f32], b: &[f32], idx: &[u32], n: usize, c: usize) {
    out.par_iter_mut().enumerate().for_each(|(j, o)| {
        let t = idx[j] as usize;
        *o = match t < n {
            true => (a[t * c..(t + 1) * c].iter())
                .zip(&b[j * c..(j + 1) * c])
                .map(|(x, y)| x * y)
                .sum(),
            false => 0.0,
        };
    });
}

/// Each group's rows through its own weight `(OC,C)`.
pub(super) fn grouped_forward(
    out: &mut [f32],
    inp: &[f32],
    w: &[f32],
    counts: &[usize],
    c: usize,
    oc: usize,
) {
    let mut r0 = 0;
    for (e, &rows) in counts.iter().enumerate() {
        if rows > 0 && oc > 0 {
            let (o, x) = (
                &mut out[r0 * oc..(r0 + rows) * oc],
                &inp[r0 * c..(r0 + rows) * c],
            );
            let we = &w[e * oc * c..(e + 1) * oc * c];
            // SAFETY: o (rows,oc), x (rows,c) and we (oc,c) are row-major
            // slices of exactly those shapes; o overlaps neither.
            unsafe {
                sgemm_blocked(
                    Split::Cols,
                    rows,
                    oc,
                    c,
                    SyncPtr(o.as_mut_ptr()),
                    oc,
                    false,
                    Mat::rows(x.as_ptr(), c),
                    Mat::trans(we.as_ptr(), c),
                )
            }
        }
        r0 += rows;
    }
}

/// The backward of [`grouped_forward`]: `dinp` overwritten, `dw[e] +=`.
pub(super) fn grouped_backward(
    dinp: &mut [f32],
    mut dw: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    w: &[f32],
    counts: &[usize],
    c: usize,
    oc: usize,
) {
    let mut r0 = 0;
    for (e, &rows) in counts.iter().enumerate() {
        if rows > 0 {
            let dx = &mut dinp[r0 * c..(r0 + rows) * c];
            let (d, x) = (
                &dout[r0 * oc..(r0 + rows) * oc],
                &inp[r0 * c..(r0 + rows) * c],
            );
            let we = &w[e * oc * c..(e + 1) * oc * c];
            // SAFETY: as in `grouped_forward`: each operand is a row-major
            // slice of its stated shape, and the destinations overlap nothing.
            unsafe {
                sgemm_blocked(
                    Split::Cols,
                    rows,
                    c,
                    oc,
                    SyncPtr(dx.as_mut_ptr()),
                    c,
                    false,
                    Mat::rows(d.as_ptr(), oc),
                    Mat::rows(we.as_ptr(), c),
                );
                if let Some(dw) = dw.as_deref_mut() {
                    let dwe = &mut dw[e * oc * c..(e + 1) * oc * c];
                    sgemm_blocked(
                        Split::Rows,
                        oc,
                        c,
                        rows,
                        SyncPtr(dwe.as_mut_ptr()),
                        c,
                        true,
                        Mat::trans(d.as_ptr(), oc),
                        Mat::rows(x.as_ptr(), c),
                    );
                }
            }
        }
        r0 += rows;
    }
}

// ----------------------------------------------------------------------------
// The `Backend` methods: buffers cut to their shapes, the kernels above on the pool.

pub(super) fn moe_gather(
    be: &mut CpuBackend,
    out: &mut CpuBuf,
    x: &CpuBuf,
    idx: &CpuBuf,
    w: Option<&CpuBuf>,
    (m, n, c): (usize, usize, usize),
) {
    let (out, x) = (&mut out.wide_mut()[..m * c], &x.wide()[..n * c]);
    let (idx, w) = (&idx.as_u32()[..m], w.map(|w| &w.as_f32()[..m]));
    be.pool.install(|| gather(out, x, idx, w, n, c));
}

pub(super) fn moe_scatter(
    be: &mut CpuBackend,
    out: &mut CpuBuf,
    y: &CpuBuf,
    idx: &CpuBuf,
    w: Option<&CpuBuf>,
    (m, n, c): (usize, usize, usize),
) {
    let (out, y) = (&mut out.wide_mut()[..n * c], &y.wide()[..m * c]);
    let (idx, w) = (&idx.as_u32()[..m], w.map(|w| &w.as_f32()[..m]));
    be.pool.install(|| scatter(out, y, idx, w, n, c));
}

pub(super) fn moe_row_dots(
    be: &mut CpuBackend,
    out: &mut CpuBuf,
    a: &CpuBuf,
    b: &CpuBuf,
    idx: &CpuBuf,
    (m, n, c): (usize, usize, usize),
) {
    let (a, b) = (&a.wide()[..n * c], &b.wide()[..m * c]);
    let (out, idx) = (&mut out.as_f32_mut()[..m], &idx.as_u32()[..m]);
    be.pool.install(|| row_dots(out, a, b, idx, n, c));
}

pub(super) fn grouped_matmul_forward(
    be: &mut CpuBackend,
    out: &mut CpuBuf,
    inp: &CpuBuf,
    w: &CpuBuf,
    counts: &[usize],
    c: usize,
    oc: usize,
) {
    let (m, e) = (counts.iter().sum::<usize>(), counts.len());
    let out = &mut out.wide_mut()[..m * oc];
    let (inp, w) = (&inp.wide()[..m * c], &w.wide()[..e * oc * c]);
    be.pool
        .install(|| grouped_forward(out, inp, w, counts, c, oc));
}

pub(super) fn grouped_matmul_backward(
    be: &mut CpuBackend,
    dinp: &mut CpuBuf,
    dw: Option<&mut CpuBuf>,
    dout: &CpuBuf,
    inp: &CpuBuf,
    w: &CpuBuf,
    counts: &[usize],
    c: usize,
    oc: usize,
) {
    let (m, e) = (counts.iter().sum::<usize>(), counts.len());
    let dinp = &mut dinp.wide_mut()[..m * c];
    let mut dw = dw.map(|dw| dw.wide_mut());
    let dw = dw.as_deref_mut().map(|d| &mut d[..e * oc * c]);
    let (dout, inp) = (&dout.wide()[..m * oc], &inp.wide()[..m * c]);
    let w = &w.wide()[..e * oc * c];
    be.pool
        .install(|| grouped_backward(dinp, dw, dout, inp, w, counts, c, oc));
}
