//! The `cpu` backend: real compute on host memory, multithreaded with rayon.
//!
//! Kernels are flat llm.c-style loops over `f32` slices; every GEMM (the linear
//! layers and the per-head attention products) goes through the `gemm` crate,
//! with transposes expressed as strides, never as copies.
//!
//! Determinism: every op gives bit-identical results for any thread count.
//! Row-wise work is split over rows (rows are independent), and every reduction
//! over rows into a parameter gradient is split over the *output* (channels, or
//! rows of the embedding table): each task owns a contiguous range of outputs and
//! adds the rows into it in order. Nothing is ever summed across threads. GEMMs
//! are cut into fixed blocks of output rows or columns, each a single-threaded
//! `gemm` call whose `k` reduction order depends only on the shapes (see
//! [`sgemm_blocked`](matmul::sgemm_blocked)); the 1-vs-2-thread test in
//! `testutil.rs` checks all of it.
//!
//! Transcendentals: `exp` is a vectorisable range-reduced polynomial
//! ([`exp_f32`](math::exp_f32)) instead of libm's scalar `expf`, because
//! softmax, cross-entropy, GELU and SiLU evaluate tens of millions of them per
//! step; sigmoid (and through it the tanh of GELU) is derived from it. Hot
//! loops run under [`vectorized`](math::vectorized), which picks AVX-512 or
//! AVX2 code at run time without changing a single result bit.
//!
//! One file per op group, as in `cuda/`: `buf.rs` (buffers, uploads, copies),
//! `math.rs` (the shared scalar helpers), `matmul.rs`, `norm.rs`, `embed.rs`,
//! `elementwise.rs`, `rope.rs`, `eager_attention.rs` and `attention.rs` (fused),
//! `loss.rs`, `optim.rs`, `moe.rs`. The [`Backend`] impl below only forwards to
//! them.

pub(crate) mod attention;
mod buf;
pub mod comm;
mod eager_attention;
mod elementwise;
mod embed;
mod loss;
mod math;
mod matmul;
mod moe;
mod norm;
pub(crate) mod optim;
pub mod process;
mod rope;
#[cfg(test)]
mod testutil;

use std::collections::HashMap;

use crate::backend::{
    AdafactorHyper, AdafactorState, AdamHyper, AttnShape, Backend, DType, SgdHyper,
};

pub use buf::{CpuBuf, WideMut};

/// Backend-internal scratch the cpu backend asks the engine for: none.
///
/// No kernel needs a scratch buffer: reductions into parameter gradients are
/// partitioned over output columns (each task owns a range of channels and loops
/// over all rows itself), so there are no per-thread partial sums to park, and
/// attention's backward uses the engine-provided `datt`. The `gemm` crate packs
/// operand panels into its own host memory (a thread-local slab the size of the
/// L2 cache, plus per-call packing buffers); both are bounded by its cache
/// blocking, a few MiB at most, independent of the model's size, so they are
/// not tracked.
pub const CPU_WORKSPACE_BYTES: usize = 0;

/// The workspace the cpu backend declares for attention of shape `s`: none for
/// eager attention ([`CPU_WORKSPACE_BYTES`]); the fused kernels' tile scratch
/// otherwise. A pure function of the shape, so meta declares the same.
pub fn workspace_bytes(s: AttnShape, fused: bool) -> usize {
    if fused {
        attention::workspace_bytes(s)
    } else {
        CPU_WORKSPACE_BYTES
    }
}

/// The cpu backend: a private rayon pool of `threads` threads runs every op.
///
/// Freed buffers are kept by size and handed to the next allocation of the same
/// size and dtype, as PyTorch's CUDA caching allocator does: a training step
/// allocates the same shapes every time, so after the first step no allocation
/// reaches the OS (no page faults, no mmap/munmap churn). The tracker counts
/// what the engine holds (PyTorch's `memory_allocated`); this cache is the
/// backend's reserve on top (`memory_reserved`), never more than the largest
/// set of buffers of each size that was live at once.
pub struct CpuBackend {
    pub(super) pool: rayon::ThreadPool,
    threads: usize,
    cache: HashMap<(DType, usize), Vec<CpuBuf>>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("threads", &self.threads)
            .finish()
    }
}

impl CpuBackend {
    pub fn new(threads: usize) -> Result<Self, String> {
        if threads == 0 {
            return Err("the cpu backend needs at least 1 thread".to_string());
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("memfit-cpu-{i}"))
            .build()
            .map_err(|e| format!("cannot start the cpu backend's {threads} threads: {e}"))?;
        Ok(CpuBackend {
            pool,
            threads,
            cache: HashMap::new(),
        })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }
}

impl Backend for CpuBackend {
    type Buf = CpuBuf;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn alloc(&mut self, len: usize, dtype: DType) -> CpuBuf {
        buf::alloc(self, len, dtype)
    }

    fn free(&mut self, buf: CpuBuf) {
        buf::free(self, buf)
    }

    fn workspace_bytes(&self, s: AttnShape, fused: bool, _dtype: DType) -> usize {
        workspace_bytes(s, fused)
    }

    fn upload_f32(&mut self, dst: &mut CpuBuf, src: &[f32]) {
        buf::upload_f32(dst, src)
    }

    fn reads_nf4(&self) -> bool {
        true
    }

    fn upload_u8(&mut self, dst: &mut CpuBuf, src: &[u8]) {
        buf::upload_u8(dst, src)
    }

    fn nf4_dequantize(&mut self, out: &mut CpuBuf, src: &CpuBuf, numel: usize) {
        buf::nf4_dequantize(out, src, numel)
    }

    fn upload_u32(&mut self, dst: &mut CpuBuf, src: &[u32]) {
        buf::upload_u32(dst, src)
    }

    fn download_f32(&self, src: &CpuBuf) -> Option<Vec<f32>> {
        Some(src.wide().into_owned())
    }

    fn copy_slice(
        &mut self,
        dst: &mut CpuBuf,
        dst_off: usize,
        src: &CpuBuf,
        src_off: usize,
        n: usize,
        accumulate: bool,
    ) {
        buf::copy_slice(dst, dst_off, src, src_off, n, accumulate)
    }

    fn convert(&mut self, dst: &mut CpuBuf, src: &CpuBuf, n: usize) {
        buf::convert(self, dst, src, n)
    }

    fn fill(&mut self, buf: &mut CpuBuf, value: f32) {
        buf::fill(self, buf, value)
    }

    fn embed_forward_rows(
        &mut self,
        out: &mut CpuBuf,
        tokens: &CpuBuf,
        wte: &CpuBuf,
        wpe: Option<&CpuBuf>,
        n: usize,
        t: usize,
        c: usize,
        part: Option<usize>,
    ) {
        embed::forward_rows(self, out, tokens, wte, wpe, n, t, c, part)
    }

    fn embed_backward_rows(
        &mut self,
        dwte: &mut CpuBuf,
        dwpe: Option<&mut CpuBuf>,
        dout: &CpuBuf,
        tokens: &CpuBuf,
        n: usize,
        t: usize,
        c: usize,
        part: Option<usize>,
    ) {
        embed::backward_rows(self, dwte, dwpe, dout, tokens, n, t, c, part)
    }

    fn layernorm_forward(
        &mut self,
        out: &mut CpuBuf,
        mean: &mut CpuBuf,
        rstd: &mut CpuBuf,
        inp: &CpuBuf,
        w: &CpuBuf,
        b: Option<&CpuBuf>,
        n: usize,
        c: usize,
        eps: f32,
    ) {
        norm::layernorm_forward(self, out, mean, rstd, inp, w, b, n, c, eps)
    }

    fn layernorm_backward(
        &mut self,
        dinp: &mut CpuBuf,
        dw: &mut CpuBuf,
        db: Option<&mut CpuBuf>,
        dout: &CpuBuf,
        inp: &CpuBuf,
        w: &CpuBuf,
        mean: &CpuBuf,
        rstd: &CpuBuf,
        n: usize,
        c: usize,
    ) {
        norm::layernorm_backward(self, dinp, dw, db, dout, inp, w, mean, rstd, n, c)
    }

    fn rmsnorm_forward(
        &mut self,
        out: &mut CpuBuf,
        rstd: &mut CpuBuf,
        inp: &CpuBuf,
        w: &CpuBuf,
        n: usize,
        c: usize,
        eps: f32,
    ) {
        norm::rmsnorm_forward(self, out, rstd, inp, w, n, c, eps)
    }

    fn rmsnorm_backward(
        &mut self,
        dinp: &mut CpuBuf,
        dw: &mut CpuBuf,
        dout: &CpuBuf,
        inp: &CpuBuf,
        w: &CpuBuf,
        rstd: &CpuBuf,
        n: usize,
        c: usize,
    ) {
        norm::rmsnorm_backward(self, dinp, dw, dout, inp, w, rstd, n, c)
    }

    fn matmul_forward(
        &mut self,
        out: &mut CpuBuf,
        inp: &CpuBuf,
        w: &CpuBuf,
        bias: Option<&CpuBuf>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        matmul::forward(self, out, inp, w, bias, n, c, oc)
    }

    fn matmul_backward(
        &mut self,
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
        matmul::backward(self, dinp, dw, dbias, dout, inp, w, n, c, oc)
    }

    fn moe_gather(
        &mut self,
        out: &mut CpuBuf,
        x: &CpuBuf,
        idx: &CpuBuf,
        w: Option<&CpuBuf>,
        dims: (usize, usize, usize),
    ) {
        moe::moe_gather(self, out, x, idx, w, dims)
    }

    fn moe_scatter(
        &mut self,
        out: &mut CpuBuf,
        y: &CpuBuf,
        idx: &CpuBuf,
        w: Option<&CpuBuf>,
        dims: (usize, usize, usize),
    ) {
        moe::moe_scatter(self, out, y, idx, w, dims)
    }

    fn moe_row_dots(
        &mut self,
        out: &mut CpuBuf,
        a: &CpuBuf,
        b: &CpuBuf,
        idx: &CpuBuf,
        dims: (usize, usize, usize),
    ) {
        moe::moe_row_dots(self, out, a, b, idx, dims)
    }

    fn grouped_matmul_forward(
        &mut self,
        out: &mut CpuBuf,
        inp: &CpuBuf,
        w: &CpuBuf,
        counts: &[usize],
        c: usize,
        oc: usize,
    ) {
        moe::grouped_matmul_forward(self, out, inp, w, counts, c, oc)
    }

    fn grouped_matmul_backward(
        &mut self,
        dinp: &mut CpuBuf,
        dw: Option<&mut CpuBuf>,
        dout: &CpuBuf,
        inp: &CpuBuf,
        w: &CpuBuf,
        counts: &[usize],
        c: usize,
        oc: usize,
    ) {
        moe::grouped_matmul_backward(self, dinp, dw, dout, inp, w, counts, c, oc)
    }

    fn copy_cols(
        &mut self,
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
        matmul::copy_cols(
            dst, dst_cols, dst_off, src, src_cols, src_off, rows, width, scale, accumulate,
        )
    }

    fn gelu_forward(&mut self, out: &mut CpuBuf, inp: &CpuBuf, n: usize) {
        elementwise::gelu_forward(self, out, inp, n)
    }

    fn gelu_backward(&mut self, dout: &mut CpuBuf, inp: &CpuBuf, n: usize) {
        elementwise::gelu_backward(self, dout, inp, n)
    }

    fn swiglu_forward(&mut self, out: &mut CpuBuf, gu: &CpuBuf, n: usize, i: usize) {
        elementwise::swiglu_forward(self, out, gu, n, i)
    }

    fn swiglu_backward(
        &mut self,
        dgu: &mut CpuBuf,
        dout: &CpuBuf,
        gu: &CpuBuf,
        n: usize,
        i: usize,
    ) {
        elementwise::swiglu_backward(self, dgu, dout, gu, n, i)
    }

    fn add(&mut self, out: &mut CpuBuf, a: &CpuBuf, b: &CpuBuf, n: usize) {
        elementwise::add(self, out, a, b, n)
    }

    fn rope_forward(&mut self, qkv: &mut CpuBuf, s: AttnShape, theta: f32) {
        rope::forward(self, qkv, s, theta)
    }

    fn rope_backward(&mut self, dqkv: &mut CpuBuf, s: AttnShape, theta: f32) {
        rope::backward(self, dqkv, s, theta)
    }

    fn attention_forward(
        &mut self,
        out: &mut CpuBuf,
        att: &mut CpuBuf,
        qkv: &CpuBuf,
        s: AttnShape,
    ) {
        eager_attention::forward(self, out, att, qkv, s)
    }

    fn attention_backward(
        &mut self,
        dqkv: &mut CpuBuf,
        datt: &mut CpuBuf,
        dout: &CpuBuf,
        qkv: &CpuBuf,
        att: &CpuBuf,
        s: AttnShape,
    ) {
        eager_attention::backward(self, dqkv, datt, dout, qkv, att, s)
    }

    fn crossentropy_forward(
        &mut self,
        losses: &mut CpuBuf,
        logits: &CpuBuf,
        targets: &CpuBuf,
        n: usize,
        v: usize,
        vp: usize,
    ) {
        loss::crossentropy_forward(self, losses, logits, targets, n, v, vp)
    }

    fn crossentropy_backward(
        &mut self,
        logits: &mut CpuBuf,
        targets: &CpuBuf,
        dloss: f32,
        n: usize,
        v: usize,
        vp: usize,
    ) {
        loss::crossentropy_backward(self, logits, targets, dloss, n, v, vp)
    }

    fn crossentropy_part_stats(
        &mut self,
        stats: &mut CpuBuf,
        tgt: &mut CpuBuf,
        logits: &CpuBuf,
        targets: &CpuBuf,
        n: usize,
        lo: usize,
        v: usize,
        vp: usize,
    ) {
        loss::crossentropy_part_stats(self, stats, tgt, logits, targets, n, lo, v, vp)
    }

    fn crossentropy_combine(
        &mut self,
        losses: &mut CpuBuf,
        lse: &mut CpuBuf,
        stats: &CpuBuf,
        tgt: &CpuBuf,
        n: usize,
        parts: usize,
    ) {
        loss::crossentropy_combine(losses, lse, stats, tgt, n, parts)
    }

    fn crossentropy_part_backward(
        &mut self,
        logits: &mut CpuBuf,
        lse: &CpuBuf,
        targets: &CpuBuf,
        dloss: f32,
        n: usize,
        lo: usize,
        v: usize,
        vp: usize,
    ) {
        loss::crossentropy_part_backward(self, logits, lse, targets, dloss, n, lo, v, vp)
    }

    fn sum_squares(&mut self, buf: &CpuBuf, n: usize) -> Option<f64> {
        loss::sum_squares(self, buf, n)
    }

    fn adamw_update(
        &mut self,
        param: &mut CpuBuf,
        grad: &CpuBuf,
        m: &mut CpuBuf,
        v: &mut CpuBuf,
        n: usize,
        h: AdamHyper,
    ) {
        optim::adamw(self, param, grad, m, v, n, h)
    }

    fn flash_attention_forward(
        &mut self,
        out: &mut CpuBuf,
        lse: &mut CpuBuf,
        qkv: &CpuBuf,
        ws: &mut CpuBuf,
        s: AttnShape,
    ) {
        attention::forward(self, out, lse, qkv, ws, s)
    }

    fn flash_attention_backward(
        &mut self,
        dqkv: &mut CpuBuf,
        dout: &CpuBuf,
        out: &CpuBuf,
        lse: &CpuBuf,
        qkv: &CpuBuf,
        ws: &mut CpuBuf,
        s: AttnShape,
    ) {
        attention::backward(self, dqkv, dout, out, lse, qkv, ws, s)
    }

    fn adamw8bit_update(
        &mut self,
        param: &mut CpuBuf,
        grad: &CpuBuf,
        m: &mut CpuBuf,
        v: &mut CpuBuf,
        m_absmax: &mut CpuBuf,
        v_absmax: &mut CpuBuf,
        n: usize,
        h: AdamHyper,
    ) {
        optim::adamw8bit(self, param, grad, m, v, m_absmax, v_absmax, n, h)
    }

    fn sgd_update(
        &mut self,
        param: &mut CpuBuf,
        grad: &CpuBuf,
        momentum_buf: &mut CpuBuf,
        n: usize,
        h: SgdHyper,
    ) {
        optim::sgd(self, param, grad, momentum_buf, n, h)
    }

    fn adafactor_update(
        &mut self,
        param: &mut CpuBuf,
        grad: &CpuBuf,
        st: AdafactorState<'_, CpuBuf>,
        h: AdafactorHyper,
    ) {
        optim::adafactor(self, param, grad, st, h)
    }
}
