//! The mixture-of-experts kernels on the host: token rows gathered into
//! the experts' permuted buffer and scattered back, the combine weights'
//! row dots, and the grouped GEMM over each expert's rows.

use rayon::prelude::*;

use super::{GEMM_BLOCK, Mat, Split, SyncPtr, sgemm_blocked};

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
#[allow(clippy::too_many_arguments)]
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
