//! Attention on the GPU: eager (the T x T probabilities stored, as the engine
//! asks) and flash-style (`kernels/attention.cu`).

use super::driver::Driver;
use super::{CudaBackend, CudaBuf};
use crate::backend::{AttnShape, DType};

/// Bytes of scratch the cuda attention needs for shape `s`.
pub fn workspace_bytes(s: AttnShape, fused: bool, dtype: DType) -> usize {
    let _ = (s, fused, dtype);
    0
}

pub(crate) fn eager_forward<D: Driver>(
    be: &mut CudaBackend<D>,
    out: &mut CudaBuf,
    att: &mut CudaBuf,
    qkv: &CudaBuf,
    s: AttnShape,
) {
    unimplemented!()
}

pub(crate) fn eager_backward<D: Driver>(
    be: &mut CudaBackend<D>,
    dqkv: &mut CudaBuf,
    datt: &mut CudaBuf,
    dout: &CudaBuf,
    qkv: &CudaBuf,
    att: &CudaBuf,
    s: AttnShape,
) {
    unimplemented!()
}

pub(crate) fn flash_forward<D: Driver>(
    be: &mut CudaBackend<D>,
    out: &mut CudaBuf,
    lse: &mut CudaBuf,
    qkv: &CudaBuf,
    ws: &mut CudaBuf,
    s: AttnShape,
) {
    unimplemented!()
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_backward<D: Driver>(
    be: &mut CudaBackend<D>,
    dqkv: &mut CudaBuf,
    dout: &CudaBuf,
    out: &CudaBuf,
    lse: &CudaBuf,
    qkv: &CudaBuf,
    ws: &mut CudaBuf,
    s: AttnShape,
) {
    unimplemented!()
}

/// Cases for `memfit selftest` and `cargo test` (see `check.rs`).
pub(crate) fn check_cases<D: Driver>(h: &mut super::check::Harness<D>) {
    let _ = h;
}
