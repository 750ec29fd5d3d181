//! Optimizer steps on the GPU: AdamW, 8-bit AdamW, SGD, Adafactor
//! (`kernels/optim.cu`).

use super::driver::Driver;
use super::{CudaBackend, CudaBuf};
use crate::backend::{AdafactorHyper, AdafactorState, AdamHyper, SgdHyper};

pub(crate) fn adamw<D: Driver>(
    be: &mut CudaBackend<D>,
    param: &mut CudaBuf,
    grad: &CudaBuf,
    m: &mut CudaBuf,
    v: &mut CudaBuf,
    n: usize,
    h: AdamHyper,
) {
    unimplemented!()
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw8bit<D: Driver>(
    be: &mut CudaBackend<D>,
    param: &mut CudaBuf,
    grad: &CudaBuf,
    m: &mut CudaBuf,
    v: &mut CudaBuf,
    m_absmax: &mut CudaBuf,
    v_absmax: &mut CudaBuf,
    n: usize,
    h: AdamHyper,
) {
    unimplemented!()
}

pub(crate) fn sgd<D: Driver>(
    be: &mut CudaBackend<D>,
    param: &mut CudaBuf,
    grad: &CudaBuf,
    momentum_buf: &mut CudaBuf,
    n: usize,
    h: SgdHyper,
) {
    unimplemented!()
}

pub(crate) fn adafactor<D: Driver>(
    be: &mut CudaBackend<D>,
    param: &mut CudaBuf,
    grad: &CudaBuf,
    st: AdafactorState<'_, CudaBuf>,
    h: AdafactorHyper,
) {
    unimplemented!()
}

/// Cases for `memfit selftest` and `cargo test` (see `check.rs`).
pub(crate) fn check_cases<D: Driver>(h: &mut super::check::Harness<D>) {
    let _ = h;
}
