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

// The optimizer types are named by `kernel_ops!`'s signatures, which
// resolve here.
use crate::backend::{
    AdafactorHyper, AdafactorState, AdamHyper, AttnOpts, AttnShape, Backend, DType, SgdHyper,
    kernel_ops,
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

/// Every kernel op under the trait method's name, each taking the backend
/// then the method's arguments: what `forward_kernel_ops` calls.
mod ops {
    pub(super) use super::attention::{
        backward as flash_attention_backward, backward_with as flash_attention_backward_with,
        forward as flash_attention_forward, forward_with as flash_attention_forward_with,
    };
    pub(super) use super::buf::{
        convert, copy_slice, fill, nf4_dequantize, upload_f32, upload_u8, upload_u32,
    };
    pub(super) use super::eager_attention::{
        backward as attention_backward, backward_with as attention_backward_with,
        forward as attention_forward, forward_with as attention_forward_with,
    };
    pub(super) use super::elementwise::{
        add, geglu_backward, geglu_forward, gelu_backward, gelu_forward, scale, softcap_forward,
        swiglu_backward, swiglu_backward_in_place, swiglu_forward,
    };
    pub(super) use super::embed::{
        backward_rows as embed_backward_rows, forward_rows as embed_forward_rows,
    };
    pub(super) use super::loss::{
        crossentropy_backward, crossentropy_combine, crossentropy_forward,
        crossentropy_part_backward, crossentropy_part_stats, crossentropy_softcap_backward,
    };
    pub(super) use super::matmul::{
        backward as matmul_backward, copy_cols, forward as matmul_forward,
    };
    pub(super) use super::moe::{
        grouped_matmul_backward, grouped_matmul_forward, moe_gather, moe_row_dots, moe_scatter,
    };
    pub(super) use super::norm::{
        gemma_rmsnorm_backward, gemma_rmsnorm_forward, layernorm_backward, layernorm_forward,
        rmsnorm_backward, rmsnorm_forward,
    };
    pub(super) use super::optim::{
        adafactor as adafactor_update, adamw as adamw_update, adamw8bit as adamw8bit_update,
        sgd as sgd_update,
    };
    pub(super) use super::rope::{backward as rope_backward, forward as rope_forward};
}

/// `kernel_ops!`'s entries on cpu: each method passes the backend and its
/// arguments, in order, to the function of its name in [`ops`], so cpu
/// spells no kernel's parameters either (the functions themselves do).
macro_rules! forward_kernel_ops {
    ($(
        $(#[$attr:meta])*
        fn $name:ident(&mut $self:ident $(, $arg:ident: $ty:ty)* $(,)?) $tail:tt
    )*) => {
        $(fn $name(&mut $self $(, $arg: $ty)*) {
            ops::$name($self $(, $arg)*)
        })*
    };
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

    fn reads_nf4(&self) -> bool {
        true
    }

    fn download_f32(&self, src: &CpuBuf) -> Option<Vec<f32>> {
        Some(src.wide().into_owned())
    }

    fn sum_squares(&mut self, buf: &CpuBuf, n: usize) -> Option<f64> {
        loss::sum_squares(self, buf, n)
    }

    // The kernel ops: each forwards to its op group's function of the same
    // name (`ops`), generated from the trait's one list.
    kernel_ops!(forward_kernel_ops);
}
