//! Row-wise ops on the GPU: embedding, LayerNorm, RMSNorm, RoPE,
//! cross-entropy, sum of squares (`kernels/norm.cu`).

use super::driver::Driver;
use super::{CudaBackend, CudaBuf};
use crate::backend::AttnShape;

#[allow(clippy::too_many_arguments)]
pub(crate) fn embed_forward<D: Driver>(
    be: &mut CudaBackend<D>,
    out: &mut CudaBuf,
    tokens: &CudaBuf,
    wte: &CudaBuf,
    wpe: Option<&CudaBuf>,
    n: usize,
    t: usize,
    c: usize,
) {
    unimplemented!()
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn embed_backward<D: Driver>(
    be: &mut CudaBackend<D>,
    dwte: &mut CudaBuf,
    dwpe: Option<&mut CudaBuf>,
    dout: &CudaBuf,
    tokens: &CudaBuf,
    n: usize,
    t: usize,
    c: usize,
) {
    unimplemented!()
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn layernorm_forward<D: Driver>(
    be: &mut CudaBackend<D>,
    out: &mut CudaBuf,
    mean: &mut CudaBuf,
    rstd: &mut CudaBuf,
    inp: &CudaBuf,
    w: &CudaBuf,
    b: Option<&CudaBuf>,
    n: usize,
    c: usize,
    eps: f32,
) {
    unimplemented!()
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn layernorm_backward<D: Driver>(
    be: &mut CudaBackend<D>,
    dinp: &mut CudaBuf,
    dw: &mut CudaBuf,
    db: Option<&mut CudaBuf>,
    dout: &CudaBuf,
    inp: &CudaBuf,
    w: &CudaBuf,
    mean: &CudaBuf,
    rstd: &CudaBuf,
    n: usize,
    c: usize,
) {
    unimplemented!()
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn rmsnorm_forward<D: Driver>(
    be: &mut CudaBackend<D>,
    out: &mut CudaBuf,
    rstd: &mut CudaBuf,
    inp: &CudaBuf,
    w: &CudaBuf,
    n: usize,
    c: usize,
    eps: f32,
) {
    unimplemented!()
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn rmsnorm_backward<D: Driver>(
    be: &mut CudaBackend<D>,
    dinp: &mut CudaBuf,
    dw: &mut CudaBuf,
    dout: &CudaBuf,
    inp: &CudaBuf,
    w: &CudaBuf,
    rstd: &CudaBuf,
    n: usize,
    c: usize,
) {
    unimplemented!()
}

/// RoPE in place; `sign` 1 rotates, -1 rotates back.
pub(crate) fn rope<D: Driver>(
    be: &mut CudaBackend<D>,
    qkv: &mut CudaBuf,
    s: AttnShape,
    theta: f32,
    sign: f32,
) {
    unimplemented!()
}

pub(crate) fn crossentropy_forward<D: Driver>(
    be: &mut CudaBackend<D>,
    losses: &mut CudaBuf,
    logits: &CudaBuf,
    targets: &CudaBuf,
    n: usize,
    v: usize,
    vp: usize,
) {
    unimplemented!()
}

pub(crate) fn crossentropy_backward<D: Driver>(
    be: &mut CudaBackend<D>,
    logits: &mut CudaBuf,
    targets: &CudaBuf,
    dloss: f32,
    n: usize,
    v: usize,
    vp: usize,
) {
    unimplemented!()
}

pub(crate) fn sum_squares<D: Driver>(be: &mut CudaBackend<D>, buf: &CudaBuf, n: usize) -> f64 {
    unimplemented!()
}

/// Cases for `memfit selftest` and `cargo test` (see `check.rs`).
pub(crate) fn check_cases<D: Driver>(h: &mut super::check::Harness<D>) {
    let _ = h;
}
