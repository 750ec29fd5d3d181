//! Linear layers on the GPU: the products through the driver's GEMM (cuBLAS
//! on a GPU), mapped from the engine's row-major layout onto cuBLAS's
//! column-major one, and the bias parts as kernels (`kernels/matmul.cu`).
//!
//! A row-major `(r, c)` matrix is a column-major `(c, r)` one with leading
//! dimension `c`, so each row-major product `X = A @ B` is issued as the
//! column-major `X^T = B^T @ A^T`, with transposes as flags (llm.c does the
//! same).

use super::driver::{Driver, Gemm, LaunchCfg};
use super::{CudaBackend, CudaBuf, n64};
use crate::backend::DType;

/// `c = alpha * op(a) op(b) + beta * c`, column-major, one matrix.
pub(crate) fn gemm<D: Driver>(
    be: &mut CudaBackend<D>,
    (transa, transb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    (a, lda): (&CudaBuf, usize),
    (b, ldb): (&CudaBuf, usize),
    beta: f32,
    (c, ldc): (&CudaBuf, usize),
) {
    assert_eq!(
        a.dtype, b.dtype,
        "gemm operands of different types ({:?}, {:?})",
        a.dtype, b.dtype
    );
    be.drv.gemm(&Gemm {
        transa,
        transb,
        m,
        n,
        k,
        alpha,
        a: a.ptr,
        lda,
        stride_a: 0,
        b: b.ptr,
        ldb,
        stride_b: 0,
        ab_type: a.dtype,
        beta,
        c: c.ptr,
        ldc,
        stride_c: 0,
        c_type: c.dtype,
        batch: 1,
    });
}

/// `out (N,OC) = inp (N,C) @ w (OC,C)^T + bias`.
pub(crate) fn forward<D: Driver>(
    be: &mut CudaBackend<D>,
    out: &mut CudaBuf,
    inp: &CudaBuf,
    w: &CudaBuf,
    bias: Option<&CudaBuf>,
    n: usize,
    c: usize,
    oc: usize,
) {
    if n == 0 || oc == 0 {
        return;
    }
    if let Some(bias) = bias {
        be.launch(
            "bias_seed_kernel",
            LaunchCfg::elementwise(n * oc),
            &[out.arg(), out.dt(), bias.arg(), bias.dt(), n64(n), n64(oc)],
        );
    }
    let beta = if bias.is_some() { 1.0 } else { 0.0 };
    // out^T (OC,N) = w (OC,C) [col-major (C,OC), transposed] @ inp^T (C,N).
    gemm(
        be,
        (true, false),
        (oc, n, c),
        1.0,
        (w, c),
        (inp, c),
        beta,
        (out, oc),
    );
}

/// `dinp = dout @ w` (overwrites), `dw += dout^T @ inp`, `dbias += colsum(dout)`.
pub(crate) fn backward<D: Driver>(
    be: &mut CudaBackend<D>,
    dinp: &mut CudaBuf,
    dw: Option<&mut CudaBuf>,
    dbias: Option<&mut CudaBuf>,
    dout: &CudaBuf,
    inp: &CudaBuf,
    w: &CudaBuf,
    n: usize,
    c: usize,
    oc: usize,
) {
    if n == 0 || c == 0 {
        return;
    }
    if oc == 0 {
        be.fill_prefix(dinp, n * c, 0.0);
        return;
    }
    // dinp^T (C,N) = w^T (C,OC) [w row-major (OC,C) = col-major (C,OC)] @ dout^T (OC,N).
    gemm(
        be,
        (false, false),
        (c, n, oc),
        1.0,
        (w, c),
        (dout, oc),
        0.0,
        (dinp, c),
    );
    // A frozen weight: no weight or bias gradient.
    let Some(dw) = dw else {
        return;
    };
    // dw^T (C,OC) += inp^T (C,N) @ dout (N,OC) [dout^T col-major (OC,N), transposed].
    gemm(
        be,
        (false, true),
        (c, oc, n),
        1.0,
        (inp, c),
        (dout, oc),
        1.0,
        (dw, c),
    );
    if let Some(dbias) = dbias {
        be.launch(
            "bias_grad_kernel",
            super::driver::LaunchCfg {
                grid: [oc.div_ceil(32) as u32, 1, 1],
                block: [32, 8, 1],
                shared_bytes: 0,
            },
            &[
                dbias.arg(),
                dbias.dt(),
                dout.arg(),
                dout.dt(),
                n64(n),
                n64(oc),
            ],
        );
    }
}

impl<D: Driver> CudaBackend<D> {
    /// Sets the first `n` elements of a float buffer to `value`.
    pub(crate) fn fill_prefix(&mut self, buf: &mut CudaBuf, n: usize, value: f32) {
        if n == 0 {
            return;
        }
        debug_assert!(buf.dtype != DType::U32 && buf.dtype != DType::U8);
        self.launch(
            "fill_kernel",
            LaunchCfg::elementwise(n),
            &[buf.arg(), buf.dt(), n64(n), super::driver::Arg::F32(value)],
        );
    }
}
