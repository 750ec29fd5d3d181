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
//! [`sgemm_blocked`]); the 1-vs-2-thread test at the bottom checks all of it.
//!
//! Transcendentals: `exp` is a vectorisable range-reduced polynomial ([`exp_f32`])
//! instead of libm's scalar `expf`, because softmax, cross-entropy, GELU and SiLU
//! evaluate tens of millions of them per step; sigmoid (and through it the tanh
//! of GELU) is derived from it. Hot loops run under [`vectorized`], which picks
//! AVX-512 or AVX2 code at run time without changing a single result bit.

pub(crate) mod attention;
pub mod comm;
mod moe;
pub(crate) mod optim;
pub mod process;

use gemm::{Parallelism, gemm};
use std::borrow::Cow;
use std::collections::HashMap;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use rayon::prelude::*;

use crate::backend::{
    AdafactorHyper, AdafactorState, AdamHyper, AttnShape, Backend, DType, SgdHyper,
};

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

/// Elements per rayon task for elementwise kernels: large enough that task
/// overhead is noise, small enough that two threads stay balanced.
const ELEMS_PER_TASK: usize = 1 << 14;
/// Channels per task in the column-partitioned parameter-gradient reductions.
const COLS_PER_TASK: usize = 64;
/// Embedding-table rows per task in `embed_backward`.
const VOCAB_ROWS_PER_TASK: usize = 256;
/// Fixed chunk of `sum_squares`: partial sums are per chunk, in order, so the
/// result does not depend on the thread count.
const SUMSQ_CHUNK: usize = 1 << 16;
/// Accumulator lanes in the f32 reductions. Independent lanes let the compiler
/// vectorise a sum that strict IEEE ordering would otherwise keep scalar; the
/// lane layout is fixed, so the result is still deterministic.
pub(super) const LANES: usize = 16;

/// A host buffer: `f32` or 16-bit float data, `u32` token ids, `u8` codes.
#[derive(Clone, Debug, PartialEq)]
pub enum CpuBuf {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
    U32(Vec<u32>),
    U8(Vec<u8>),
}

/// A float buffer seen as `f32` for the length of one kernel. An `f32` buffer
/// is borrowed as it is; a 16-bit one is widened into a scratch copy, and the
/// scratch is rounded back (to nearest even) into the 16-bit storage when the
/// view drops, at the end of the kernel. That is where a GPU kernel rounds: it
/// loads 16-bit values, computes in fp32 registers, and stores 16-bit results
/// (cuBLAS with fp32 compute type, including `C = AB + C` accumulation).
pub enum WideMut<'a> {
    Direct(&'a mut [f32]),
    Staged { buf: &'a mut CpuBuf, tmp: Vec<f32> },
}

impl std::ops::Deref for WideMut<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            WideMut::Direct(s) => s,
            WideMut::Staged { tmp, .. } => tmp,
        }
    }
}

impl std::ops::DerefMut for WideMut<'_> {
    fn deref_mut(&mut self) -> &mut [f32] {
        match self {
            WideMut::Direct(s) => s,
            WideMut::Staged { tmp, .. } => tmp,
        }
    }
}

impl Drop for WideMut<'_> {
    fn drop(&mut self) {
        if let WideMut::Staged { buf, tmp } = self {
            match buf {
                CpuBuf::Bf16(v) => v.convert_from_f32_slice(tmp),
                CpuBuf::F16(v) => v.convert_from_f32_slice(tmp),
                _ => unreachable!("only 16-bit buffers are staged"),
            }
        }
    }
}

impl CpuBuf {
    pub fn dtype(&self) -> DType {
        match self {
            CpuBuf::F32(_) => DType::F32,
            CpuBuf::Bf16(_) => DType::Bf16,
            CpuBuf::F16(_) => DType::F16,
            CpuBuf::U32(_) => DType::U32,
            CpuBuf::U8(_) => DType::U8,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            CpuBuf::F32(v) => v.len(),
            CpuBuf::Bf16(v) => v.len(),
            CpuBuf::F16(v) => v.len(),
            CpuBuf::U32(v) => v.len(),
            CpuBuf::U8(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `f32` contents. Panics on another dtype: the engine passed the wrong buffer.
    pub fn as_f32(&self) -> &[f32] {
        match self {
            CpuBuf::F32(v) => v,
            other => dtype_mismatch(DType::F32, other.dtype()),
        }
    }

    /// The `f32` contents, mutable. Panics on another dtype.
    pub fn as_f32_mut(&mut self) -> &mut [f32] {
        match self {
            CpuBuf::F32(v) => v,
            other => dtype_mismatch(DType::F32, other.dtype()),
        }
    }

    /// A float buffer's values as `f32`: borrowed for `f32`, widened (exactly)
    /// for 16-bit. Panics on an integer buffer.
    pub fn wide(&self) -> Cow<'_, [f32]> {
        match self {
            CpuBuf::F32(v) => Cow::Borrowed(v),
            CpuBuf::Bf16(v) => Cow::Owned(v.to_f32_vec()),
            CpuBuf::F16(v) => Cow::Owned(v.to_f32_vec()),
            other => dtype_mismatch(DType::F32, other.dtype()),
        }
    }

    /// A float buffer as mutable `f32`; 16-bit results are rounded back when
    /// the view drops (see [`WideMut`]). Panics on an integer buffer.
    pub fn wide_mut(&mut self) -> WideMut<'_> {
        match self {
            CpuBuf::F32(v) => WideMut::Direct(v),
            CpuBuf::Bf16(v) => {
                let tmp = v.to_f32_vec();
                WideMut::Staged { buf: self, tmp }
            }
            CpuBuf::F16(v) => {
                let tmp = v.to_f32_vec();
                WideMut::Staged { buf: self, tmp }
            }
            other => dtype_mismatch(DType::F32, other.dtype()),
        }
    }

    /// Elements `off..off + n` of a float buffer as `f32` (only that range is widened).
    pub fn read_range(&self, off: usize, n: usize) -> Cow<'_, [f32]> {
        match self {
            CpuBuf::F32(v) => Cow::Borrowed(&v[off..off + n]),
            CpuBuf::Bf16(v) => Cow::Owned(v[off..off + n].to_f32_vec()),
            CpuBuf::F16(v) => Cow::Owned(v[off..off + n].to_f32_vec()),
            other => dtype_mismatch(DType::F32, other.dtype()),
        }
    }

    /// Stores `vals` at `off..` (rounded to nearest even into a 16-bit buffer),
    /// or adds them in f32 and stores the rounded sums when `accumulate`.
    pub fn write_range(&mut self, off: usize, vals: &[f32], accumulate: bool) {
        let n = vals.len();
        match self {
            CpuBuf::F32(v) if accumulate => add_assign(&mut v[off..off + n], vals),
            CpuBuf::F32(v) => v[off..off + n].copy_from_slice(vals),
            CpuBuf::Bf16(v) => store_rounded(&mut v[off..off + n], vals, accumulate),
            CpuBuf::F16(v) => store_rounded(&mut v[off..off + n], vals, accumulate),
            other => dtype_mismatch(DType::F32, other.dtype()),
        }
    }

    /// The `u32` contents. Panics on another dtype.
    pub fn as_u32(&self) -> &[u32] {
        match self {
            CpuBuf::U32(v) => v,
            other => dtype_mismatch(DType::U32, other.dtype()),
        }
    }

    /// The `u32` contents, mutable. Panics on another dtype.
    pub fn as_u32_mut(&mut self) -> &mut [u32] {
        match self {
            CpuBuf::U32(v) => v,
            other => dtype_mismatch(DType::U32, other.dtype()),
        }
    }

    /// The `u8` contents, mutable. Panics on another dtype.
    pub fn as_u8_mut(&mut self) -> &mut [u8] {
        match self {
            CpuBuf::U8(v) => v,
            other => dtype_mismatch(DType::U8, other.dtype()),
        }
    }
}

/// `dst = round(vals)` or `dst = round(dst + vals)`, the sum taken in f32.
fn store_rounded<H>(dst: &mut [H], vals: &[f32], accumulate: bool)
where
    [H]: HalfFloatSliceExt,
{
    if accumulate {
        let mut sum = dst.to_f32_vec();
        add_assign(&mut sum, vals);
        dst.convert_from_f32_slice(&sum);
    } else {
        dst.convert_from_f32_slice(vals);
    }
}

#[cold]
#[track_caller]
fn dtype_mismatch(want: DType, got: DType) -> ! {
    panic!(
        "cpu backend: expected a {want:?} buffer, got a {got:?} buffer (engine bug: wrong buffer passed to an op)"
    )
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

// ----------------------------------------------------------------------------
// GEMM

/// A strided matrix operand: element `(i, j)` is at `ptr + i*rs + j*cs`.
#[derive(Clone, Copy)]
struct Mat {
    ptr: *const f32,
    rs: isize,
    cs: isize,
}

impl Mat {
    /// Row-major with row stride `ld`.
    fn rows(ptr: *const f32, ld: usize) -> Self {
        Mat {
            ptr,
            rs: ld as isize,
            cs: 1,
        }
    }
    /// The transpose of a row-major matrix with row stride `ld`.
    fn trans(ptr: *const f32, ld: usize) -> Self {
        Mat {
            ptr,
            rs: 1,
            cs: ld as isize,
        }
    }
    /// The view starting at element `(i, j)`.
    fn offset(self, i: usize, j: usize) -> Mat {
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
unsafe fn sgemm(
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
enum Split {
    Rows,
    Cols,
}

/// Width of one GEMM task: two of gemm's 64-wide AVX-512 f32 micro-panels.
const GEMM_BLOCK: usize = 256;

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
unsafe fn sgemm_blocked(
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
struct SyncPtr(*mut f32);
// SAFETY: the call sites guarantee the regions written through it are disjoint.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// A method (not field access) so closures capture the whole `Sync` wrapper.
    fn get(self) -> *mut f32 {
        self.0
    }
}

// ----------------------------------------------------------------------------
// Scalar helpers. Small, inlined, written so the loops auto-vectorise.

/// `exp(x)` for f32, vectorisable: `x = n*ln2 + r` with `n = round(x/ln2)`,
/// `|r| <= ln2/2`, `exp(r)` by its degree-7 Taylor polynomial (truncation error
/// `< 0.35^8/8! ~ 5e-9`, below half an ulp), then scaled by `2^n` built in the
/// exponent bits. The input is clamped to [-87, 88] so `2^n` stays a normal
/// float: results below `exp(-87) ~ 1.6e-38` come out as that, not 0, which is
/// harmless for softmax weights and sigmoids. NaN propagates.
#[inline(always)]
pub(super) fn exp_f32(x: f32) -> f32 {
    // ln2 split in two so n*LN2_HI is exact (LN2_HI has 16 significant bits).
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding 1.5*2^23 rounds to an integer (ties to even) and leaves that
    // integer in the low mantissa bits.
    const SHIFTER: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let t = x * std::f32::consts::LOG2_E + SHIFTER;
    let n = t.to_bits() as i32 - SHIFTER.to_bits() as i32;
    let nf = t - SHIFTER;
    let r = (x - nf * LN2_HI) - nf * LN2_LO;
    let p = 1.0 / 5040.0;
    let p = p * r + 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    p * f32::from_bits(((n + 127) as u32) << 23)
}

/// Runs `f` inside a function compiled for AVX-512 or AVX2, whichever the CPU
/// has (checked at run time, cached by std), else as is.
///
/// The crate is built for baseline x86-64 (SSE2), which leaves the
/// transcendental-heavy loops (GELU, SiLU, cross-entropy) at 4 lanes; `f` is
/// inlined into the wider instantiation, so they vectorise 16 or 8 wide
/// (measured 2-3x faster on those kernels). Results are bit-identical on every
/// path: Rust never contracts `a*b + c` into an FMA, and every reduction's lane
/// layout is explicit, so the same IEEE operations run in the same order.
#[inline(always)]
pub(super) fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn avx512<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        #[target_feature(enable = "avx2")]
        fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            return unsafe { avx512(f) };
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { avx2(f) };
        }
    }
    f()
}

/// `1 / (1 + exp(-z))`.
#[inline(always)]
fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-z))
}

#[inline(always)]
pub(super) fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            acc[j] += c[j];
        }
    }
    acc.iter().sum::<f32>() + rest.iter().sum::<f32>()
}

#[inline(always)]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let rest: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for j in 0..LANES {
            acc[j] += x[j] * y[j];
        }
    }
    acc.iter().sum::<f32>() + rest
}

/// `sum((x - mean)^2)`.
#[inline(always)]
fn sum_sq_dev(x: &[f32], mean: f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest: f32 = chunks
        .remainder()
        .iter()
        .map(|v| (v - mean) * (v - mean))
        .sum();
    for c in chunks {
        for j in 0..LANES {
            let d = c[j] - mean;
            acc[j] += d * d;
        }
    }
    acc.iter().sum::<f32>() + rest
}

#[inline(always)]
fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for c in chunks {
        for j in 0..LANES {
            acc[j] = acc[j].max(c[j]);
        }
    }
    acc.iter().fold(rest, |a, &b| a.max(b))
}

/// `sum(exp(x - shift))` accumulated in f64 (8 fixed lanes): a 50k-wide vocab
/// row sums to a few thousand, and f64 keeps the log-sum-exp exact to f32.
#[inline(always)]
fn sum_exp_f64(x: &[f32], shift: f32) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = x.chunks_exact(8);
    let rest: f64 = chunks
        .remainder()
        .iter()
        .map(|&v| exp_f32(v - shift) as f64)
        .sum();
    for c in chunks {
        for j in 0..8 {
            acc[j] += exp_f32(c[j] - shift) as f64;
        }
    }
    acc.iter().sum::<f64>() + rest
}

/// In place `x := exp(x - shift)`, returns the f64 sum (same lanes as above).
#[inline(always)]
fn exp_inplace_sum_f64(x: &mut [f32], shift: f32) -> f64 {
    let mut acc = [0.0f64; 8];
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        for j in 0..8 {
            c[j] = exp_f32(c[j] - shift);
            acc[j] += c[j] as f64;
        }
    }
    let mut rest = 0.0f64;
    for v in chunks.into_remainder() {
        *v = exp_f32(*v - shift);
        rest += *v as f64;
    }
    acc.iter().sum::<f64>() + rest
}

/// Two lane-accumulated sums of `f(a_i, b_i, c_i)` over equal-length slices.
#[inline(always)]
fn sum2_zip3(
    a: &[f32],
    b: &[f32],
    c: &[f32],
    f: impl Fn(f32, f32, f32) -> (f32, f32),
) -> (f32, f32) {
    let (mut s0, mut s1) = ([0.0f32; LANES], [0.0f32; LANES]);
    let (ca, cb, cc) = (
        a.chunks_exact(LANES),
        b.chunks_exact(LANES),
        c.chunks_exact(LANES),
    );
    let (mut t0, mut t1) = (0.0f32, 0.0f32);
    for ((&a, &b), &c) in ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .zip(cc.remainder())
    {
        let (u, v) = f(a, b, c);
        t0 += u;
        t1 += v;
    }
    for ((a, b), c) in ca.zip(cb).zip(cc) {
        for j in 0..LANES {
            let (u, v) = f(a[j], b[j], c[j]);
            s0[j] += u;
            s1[j] += v;
        }
    }
    (s0.iter().sum::<f32>() + t0, s1.iter().sum::<f32>() + t1)
}

#[inline(always)]
fn add_assign(dst: &mut [f32], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d += s;
    }
}

/// Rows per rayon task for row-wise kernels over rows of `width` elements.
fn rows_per_task(width: usize) -> usize {
    (ELEMS_PER_TASK / width.max(1)).max(1)
}

/// Softmax in place over `x` (non-empty), max-subtracted, f32 sum.
#[inline(always)]
fn softmax_inplace(x: &mut [f32]) {
    let m = max(x);
    for v in x.iter_mut() {
        *v = exp_f32(*v - m);
    }
    let inv = 1.0 / sum(x);
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `dst (C) += sum over rows of src (N,C)`, partitioned over columns: each task
/// owns `COLS_PER_TASK` channels and adds all rows into them in row order.
fn col_sum_accumulate(dst: &mut [f32], src: &[f32], n: usize, c: usize) {
    dst[..c]
        .par_chunks_mut(COLS_PER_TASK)
        .enumerate()
        .for_each(|(ci, d)| {
            vectorized(
                #[inline(always)]
                || {
                    let c0 = ci * COLS_PER_TASK;
                    for r in 0..n {
                        add_assign(d, &src[r * c + c0..][..d.len()]);
                    }
                },
            )
        });
}

// GELU, tanh approximation (Hendrycks & Gimpel 2016):
// gelu(x) = 0.5*x*(1 + tanh(u)), u = sqrt(2/pi)*(x + 0.044715*x^3).
// Since 0.5*(1 + tanh(u)) = sigmoid(2u), this is x*sigmoid(2u), which needs one
// exp and has no cancellation near tanh = -1.
const GELU_SCALE: f32 = 0.797_884_6; // sqrt(2/pi)
const GELU_CUBE: f32 = 0.044_715;

// RoPE in place on one packed qkv buffer; `sign` = 1 rotates, -1 rotates back.
fn rope_apply(qkv: &mut [f32], s: AttnShape, theta: f32, sign: f32) {
    let hd = s.head_dim;
    let w = s.qkv_width();
    let n = s.b * s.t;
    if n == 0 || hd == 0 {
        return;
    }
    assert!(
        hd.is_multiple_of(2),
        "rope needs an even head_dim, got {hd}"
    );
    let half = hd / 2;
    // q heads then k heads are contiguous at the start of the row; v is untouched.
    let heads = s.n_head + s.n_kv_head;
    let rows = rows_per_task(w);
    qkv[..n * w]
        .par_chunks_mut(w * rows)
        .enumerate()
        .for_each(|(ci, blk)| {
            for (ri, row) in blk.chunks_exact_mut(w).enumerate() {
                let pos = ((ci * rows + ri) % s.t) as f64;
                for i in 0..half {
                    // angle = pos * theta^(-2i/hd), in f64 and rounded once.
                    let inv_freq = (theta as f64).powf(-2.0 * i as f64 / hd as f64);
                    let (sin, cos) = (pos * inv_freq).sin_cos();
                    let (sin, cos) = (sign * sin as f32, cos as f32);
                    // rotate_half pairs (i, i + hd/2):
                    // x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.
                    for h in 0..heads {
                        let x = &mut row[h * hd..(h + 1) * hd];
                        let (x1, x2) = (x[i], x[i + half]);
                        x[i] = x1 * cos - x2 * sin;
                        x[i + half] = x2 * cos + x1 * sin;
                    }
                }
            }
        });
}

impl Backend for CpuBackend {
    type Buf = CpuBuf;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn alloc(&mut self, len: usize, dtype: DType) -> CpuBuf {
        if let Some(mut buf) = self.cache.get_mut(&(dtype, len)).and_then(Vec::pop) {
            match &mut buf {
                CpuBuf::F32(v) => self
                    .pool
                    .install(|| v.par_chunks_mut(ELEMS_PER_TASK).for_each(|c| c.fill(0.0))),
                CpuBuf::Bf16(v) => v.fill(bf16::ZERO),
                CpuBuf::F16(v) => v.fill(f16::ZERO),
                CpuBuf::U32(v) => v.fill(0),
                CpuBuf::U8(v) => v.fill(0),
            }
            return buf;
        }
        match dtype {
            DType::F32 => CpuBuf::F32(vec![0.0; len]),
            DType::Bf16 => CpuBuf::Bf16(vec![bf16::ZERO; len]),
            DType::F16 => CpuBuf::F16(vec![f16::ZERO; len]),
            DType::U32 => CpuBuf::U32(vec![0; len]),
            DType::U8 => CpuBuf::U8(vec![0; len]),
        }
    }

    fn free(&mut self, buf: CpuBuf) {
        let key = (buf.dtype(), buf.len());
        self.cache.entry(key).or_default().push(buf);
    }

    fn workspace_bytes(&self, s: AttnShape, fused: bool, _dtype: DType) -> usize {
        workspace_bytes(s, fused)
    }

    /// Copies `src` into the start of `dst` (which must be at least as long),
    /// rounding to nearest even when `dst` is 16-bit.
    fn upload_f32(&mut self, dst: &mut CpuBuf, src: &[f32]) {
        assert!(
            src.len() <= dst.len(),
            "upload of {} f32 into a buffer of {}",
            src.len(),
            dst.len()
        );
        match dst {
            CpuBuf::F32(d) => d[..src.len()].copy_from_slice(src),
            CpuBuf::Bf16(d) => d[..src.len()].convert_from_f32_slice(src),
            CpuBuf::F16(d) => d[..src.len()].convert_from_f32_slice(src),
            other => dtype_mismatch(DType::F32, other.dtype()),
        }
    }

    fn reads_nf4(&self) -> bool {
        true
    }

    fn upload_u8(&mut self, dst: &mut CpuBuf, src: &[u8]) {
        match dst {
            CpuBuf::U8(d) => d[..src.len()].copy_from_slice(src),
            other => dtype_mismatch(DType::U8, other.dtype()),
        }
    }

    fn nf4_dequantize(&mut self, out: &mut CpuBuf, src: &CpuBuf, numel: usize) {
        let CpuBuf::U8(bytes) = src else {
            dtype_mismatch(DType::U8, src.dtype())
        };
        let mut wide = out.wide_mut();
        crate::nf4::dequantize_bytes(bytes, numel, &mut wide[..numel]);
    }

    fn upload_u32(&mut self, dst: &mut CpuBuf, src: &[u32]) {
        let dst = dst.as_u32_mut();
        assert!(
            src.len() <= dst.len(),
            "upload of {} u32 into a buffer of {}",
            src.len(),
            dst.len()
        );
        dst[..src.len()].copy_from_slice(src);
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
        if n > 0 {
            dst.write_range(dst_off, &src.read_range(src_off, n), accumulate);
        }
    }

    fn convert(&mut self, dst: &mut CpuBuf, src: &CpuBuf, n: usize) {
        let src = &src.wide()[..n];
        self.pool.install(|| match dst {
            CpuBuf::F32(d) => d[..n].copy_from_slice(src),
            CpuBuf::Bf16(d) => d[..n]
                .par_chunks_mut(ELEMS_PER_TASK)
                .zip(src.par_chunks(ELEMS_PER_TASK))
                .for_each(|(d, s)| d.convert_from_f32_slice(s)),
            CpuBuf::F16(d) => d[..n]
                .par_chunks_mut(ELEMS_PER_TASK)
                .zip(src.par_chunks(ELEMS_PER_TASK))
                .for_each(|(d, s)| d.convert_from_f32_slice(s)),
            other => dtype_mismatch(DType::F32, other.dtype()),
        });
    }

    fn fill(&mut self, buf: &mut CpuBuf, value: f32) {
        let mut buf = buf.wide_mut();
        self.pool.install(|| {
            buf.par_chunks_mut(ELEMS_PER_TASK)
                .for_each(|c| c.fill(value))
        });
    }

    // out (N,C), tokens (N), wte (V,C), wpe (maxT,C); row r is position r % t.
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
        if n == 0 || c == 0 {
            return;
        }
        let out = &mut out.wide_mut()[..n * c];
        let tokens = &tokens.as_u32()[..n];
        let wte = wte.wide();
        let vocab = wte.len() / c;
        let wpe = wpe.map(|p| p.wide());
        let wpe = wpe.as_deref().map(|p| &p[..t * c]);
        let rows = rows_per_task(c);
        self.pool.install(|| {
            out.par_chunks_mut(c * rows)
                .enumerate()
                .for_each(|(ci, blk)| {
                    for (ri, o) in blk.chunks_exact_mut(c).enumerate() {
                        let r = ci * rows + ri;
                        let tok = tokens[r] as usize;
                        let row = match part {
                            None => {
                                assert!(tok < vocab, "token id {tok} >= embedding rows {vocab}");
                                Some(tok)
                            }
                            Some(lo) => (lo..lo + vocab).contains(&tok).then(|| tok - lo),
                        };
                        match (row, wpe) {
                            (Some(row), Some(wpe)) => {
                                let e = &wte[row * c..][..c];
                                let p = &wpe[(r % t) * c..][..c];
                                for ((o, a), b) in o.iter_mut().zip(e).zip(p) {
                                    *o = a + b;
                                }
                            }
                            (Some(row), None) => o.copy_from_slice(&wte[row * c..][..c]),
                            (None, Some(wpe)) => o.copy_from_slice(&wpe[(r % t) * c..][..c]),
                            (None, None) => o.fill(0.0),
                        }
                    }
                })
        });
    }

    // dwte (V,C) += scatter of dout (N,C) by tokens (N); dwpe (maxT,C) += dout by position.
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
        if n == 0 || c == 0 {
            return;
        }
        let mut dwte = dwte.wide_mut();
        let vocab = dwte.len() / c;
        let dwte = &mut dwte[..vocab * c];
        let dout = &dout.wide()[..n * c];
        let tokens = &tokens.as_u32()[..n];
        if part.is_none()
            && let Some(&bad) = tokens.iter().find(|&&tok| tok as usize >= vocab)
        {
            panic!("token id {bad} >= embedding rows {vocab}");
        }
        let lo = part.unwrap_or(0);
        self.pool.install(|| {
            // Several rows may hit the same token, so the scatter is partitioned
            // over the output: each task owns a range of table rows and scans all
            // tokens in order, adding the ones that land in its range. Every
            // element is summed in row order whatever the thread count.
            dwte.par_chunks_mut(c * VOCAB_ROWS_PER_TASK)
                .enumerate()
                .for_each(|(ci, blk)| {
                    let v0 = ci * VOCAB_ROWS_PER_TASK;
                    let v1 = v0 + blk.len() / c;
                    for (r, &tok) in tokens.iter().enumerate() {
                        let Some(tok) = (tok as usize).checked_sub(lo) else {
                            continue;
                        };
                        if (v0..v1).contains(&tok) {
                            add_assign(&mut blk[(tok - v0) * c..][..c], &dout[r * c..][..c]);
                        }
                    }
                });
            if let Some(dwpe) = dwpe {
                assert!(
                    n.is_multiple_of(t),
                    "n = {n} rows is not a multiple of t = {t}"
                );
                // Each task owns a range of positions and sums the B sequences in order.
                let dwpe = &mut dwpe.wide_mut()[..t * c];
                let rows = rows_per_task(c);
                dwpe.par_chunks_mut(c * rows)
                    .enumerate()
                    .for_each(|(ci, blk)| {
                        for (pi, d) in blk.chunks_exact_mut(c).enumerate() {
                            let pos = ci * rows + pi;
                            for b in 0..n / t {
                                add_assign(d, &dout[(b * t + pos) * c..][..c]);
                            }
                        }
                    });
            }
        });
    }

    // out (N,C), mean (N), rstd (N), inp (N,C), w (C), b (C).
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
        if n == 0 || c == 0 {
            return;
        }
        let out = &mut out.wide_mut()[..n * c];
        let mean = &mut mean.wide_mut()[..n];
        let rstd = &mut rstd.wide_mut()[..n];
        let inp = &inp.wide()[..n * c];
        let w = &w.wide()[..c];
        let b = b.map(|b| b.wide());
        let b = b.as_deref().map(|b| &b[..c]);
        let rows = rows_per_task(c);
        self.pool.install(|| {
            out.par_chunks_mut(c * rows)
                .zip(mean.par_chunks_mut(rows))
                .zip(rstd.par_chunks_mut(rows))
                .zip(inp.par_chunks(c * rows))
                .for_each(|(((out, mean), rstd), inp)| {
                    vectorized(
                        #[inline(always)]
                        || {
                            for (((o, x), m_out), r_out) in out
                                .chunks_exact_mut(c)
                                .zip(inp.chunks_exact(c))
                                .zip(mean.iter_mut())
                                .zip(rstd.iter_mut())
                            {
                                // Two passes (mean, then squared deviations): no cancellation.
                                let m = sum(x) / c as f32;
                                let var = sum_sq_dev(x, m) / c as f32;
                                let r = 1.0 / (var + eps).sqrt();
                                match b {
                                    Some(b) => {
                                        for (((o, &x), &w), &b) in o.iter_mut().zip(x).zip(w).zip(b)
                                        {
                                            *o = (x - m) * r * w + b;
                                        }
                                    }
                                    None => {
                                        for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
                                            *o = (x - m) * r * w;
                                        }
                                    }
                                }
                                *m_out = m;
                                *r_out = r;
                            }
                        },
                    )
                })
        });
    }

    // dinp (N,C) +=, dw (C) +=, db (C) +=; dout, inp (N,C), w (C), mean, rstd (N).
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
        if n == 0 || c == 0 {
            return;
        }
        let dinp = &mut dinp.wide_mut()[..n * c];
        let dw = &mut dw.wide_mut()[..c];
        let dout = &dout.wide()[..n * c];
        let inp = &inp.wide()[..n * c];
        let w = &w.wide()[..c];
        let mean = &mean.wide()[..n];
        let rstd = &rstd.wide()[..n];
        let rows = rows_per_task(c);
        self.pool.install(|| {
            // dinp, row-parallel. With norm = (x - mean)*rstd and dnorm = dout*w:
            // dx = rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)).
            dinp.par_chunks_mut(c * rows)
                .enumerate()
                .for_each(|(ci, blk)| {
                    vectorized(
                        #[inline(always)]
                        || {
                            for (ri, dx) in blk.chunks_exact_mut(c).enumerate() {
                                let r = ci * rows + ri;
                                let (m, rs) = (mean[r], rstd[r]);
                                let x = &inp[r * c..][..c];
                                let dy = &dout[r * c..][..c];
                                let (sd, sdn) = sum2_zip3(x, dy, w, |x, dy, w| {
                                    let norm = (x - m) * rs;
                                    let dnorm = dy * w;
                                    (dnorm, dnorm * norm)
                                });
                                let dnorm_mean = sd / c as f32;
                                let dnorm_norm_mean = sdn / c as f32;
                                for (((dx, &x), &dy), &w) in dx.iter_mut().zip(x).zip(dy).zip(w) {
                                    let norm = (x - m) * rs;
                                    *dx += (dy * w - dnorm_mean - norm * dnorm_norm_mean) * rs;
                                }
                            }
                        },
                    )
                });
            // dw[c] += sum_r dout[r,c] * norm[r,c], column-partitioned, rows in order.
            dw.par_chunks_mut(COLS_PER_TASK)
                .enumerate()
                .for_each(|(ci, dw)| {
                    vectorized(
                        #[inline(always)]
                        || {
                            let c0 = ci * COLS_PER_TASK;
                            for r in 0..n {
                                let (m, rs) = (mean[r], rstd[r]);
                                let x = &inp[r * c + c0..][..dw.len()];
                                let dy = &dout[r * c + c0..][..dw.len()];
                                for ((d, &x), &dy) in dw.iter_mut().zip(x).zip(dy) {
                                    *d += dy * ((x - m) * rs);
                                }
                            }
                        },
                    )
                });
            if let Some(db) = db {
                col_sum_accumulate(&mut db.wide_mut(), dout, n, c);
            }
        });
    }

    // out (N,C) = inp * rstd * w, rstd (N) = 1/sqrt(mean(inp^2) + eps).
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
        if n == 0 || c == 0 {
            return;
        }
        let out = &mut out.wide_mut()[..n * c];
        let rstd = &mut rstd.wide_mut()[..n];
        let inp = &inp.wide()[..n * c];
        let w = &w.wide()[..c];
        let rows = rows_per_task(c);
        self.pool.install(|| {
            out.par_chunks_mut(c * rows)
                .zip(rstd.par_chunks_mut(rows))
                .zip(inp.par_chunks(c * rows))
                .for_each(|((out, rstd), inp)| {
                    vectorized(
                        #[inline(always)]
                        || {
                            for ((o, x), r_out) in out
                                .chunks_exact_mut(c)
                                .zip(inp.chunks_exact(c))
                                .zip(rstd.iter_mut())
                            {
                                let r = 1.0 / (dot(x, x) / c as f32 + eps).sqrt();
                                for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
                                    *o = x * r * w;
                                }
                                *r_out = r;
                            }
                        },
                    )
                })
        });
    }

    // dinp (N,C) +=, dw (C) +=; dout, inp (N,C), w (C), rstd (N).
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
        if n == 0 || c == 0 {
            return;
        }
        let dinp = &mut dinp.wide_mut()[..n * c];
        let dw = &mut dw.wide_mut()[..c];
        let dout = &dout.wide()[..n * c];
        let inp = &inp.wide()[..n * c];
        let w = &w.wide()[..c];
        let rstd = &rstd.wide()[..n];
        let rows = rows_per_task(c);
        self.pool.install(|| {
            // y_i = x_i r w_i with r = (mean(x^2) + eps)^(-1/2), dr/dx_j = -r^3 x_j / C:
            // dx_j = r w_j dy_j - x_j r^3 / C * sum_i dy_i w_i x_i.
            dinp.par_chunks_mut(c * rows)
                .enumerate()
                .for_each(|(ci, blk)| {
                    vectorized(
                        #[inline(always)]
                        || {
                            for (ri, dx) in blk.chunks_exact_mut(c).enumerate() {
                                let row = ci * rows + ri;
                                let r = rstd[row];
                                let x = &inp[row * c..][..c];
                                let dy = &dout[row * c..][..c];
                                let (sxw, _) = sum2_zip3(x, dy, w, |x, dy, w| (dy * w * x, 0.0));
                                let k = sxw * r * r * r / c as f32;
                                for (((dx, &x), &dy), &w) in dx.iter_mut().zip(x).zip(dy).zip(w) {
                                    *dx += r * w * dy - x * k;
                                }
                            }
                        },
                    )
                });
            // dw[c] += sum_r dout[r,c] * x[r,c] * rstd[r], column-partitioned.
            dw.par_chunks_mut(COLS_PER_TASK)
                .enumerate()
                .for_each(|(ci, dw)| {
                    vectorized(
                        #[inline(always)]
                        || {
                            let c0 = ci * COLS_PER_TASK;
                            for (row, &r) in rstd.iter().enumerate() {
                                let x = &inp[row * c + c0..][..dw.len()];
                                let dy = &dout[row * c + c0..][..dw.len()];
                                for ((d, &x), &dy) in dw.iter_mut().zip(x).zip(dy) {
                                    *d += dy * (x * r);
                                }
                            }
                        },
                    )
                });
        });
    }

    // out (N,OC) = inp (N,C) @ w (OC,C)^T + bias (OC).
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
        if n == 0 || oc == 0 {
            return;
        }
        let out = &mut out.wide_mut()[..n * oc];
        let inp = &inp.wide()[..n * c];
        let w = &w.wide()[..oc * c];
        let bias = bias.map(|b| b.wide());
        let bias = bias.as_deref().map(|b| &b[..oc]);
        self.pool.install(|| {
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
        let dinp = &mut dinp.wide_mut()[..n * c];
        let mut dw = dw.map(|dw| dw.wide_mut());
        let dout = &dout.wide()[..n * oc];
        let inp = &inp.wide()[..n * c];
        let w = &w.wide()[..oc * c];
        self.pool.install(|| {
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

    fn moe_gather(
        &mut self,
        out: &mut CpuBuf,
        x: &CpuBuf,
        idx: &CpuBuf,
        w: Option<&CpuBuf>,
        (m, n, c): (usize, usize, usize),
    ) {
        let (out, x) = (&mut out.wide_mut()[..m * c], &x.wide()[..n * c]);
        let (idx, w) = (&idx.as_u32()[..m], w.map(|w| &w.as_f32()[..m]));
        self.pool.install(|| moe::gather(out, x, idx, w, n, c));
    }

    fn moe_scatter(
        &mut self,
        out: &mut CpuBuf,
        y: &CpuBuf,
        idx: &CpuBuf,
        w: Option<&CpuBuf>,
        (m, n, c): (usize, usize, usize),
    ) {
        let (out, y) = (&mut out.wide_mut()[..n * c], &y.wide()[..m * c]);
        let (idx, w) = (&idx.as_u32()[..m], w.map(|w| &w.as_f32()[..m]));
        self.pool.install(|| moe::scatter(out, y, idx, w, n, c));
    }

    fn moe_row_dots(
        &mut self,
        out: &mut CpuBuf,
        a: &CpuBuf,
        b: &CpuBuf,
        idx: &CpuBuf,
        (m, n, c): (usize, usize, usize),
    ) {
        let (a, b) = (&a.wide()[..n * c], &b.wide()[..m * c]);
        let (out, idx) = (&mut out.as_f32_mut()[..m], &idx.as_u32()[..m]);
        self.pool.install(|| moe::row_dots(out, a, b, idx, n, c));
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
        let (m, e) = (counts.iter().sum::<usize>(), counts.len());
        let out = &mut out.wide_mut()[..m * oc];
        let (inp, w) = (&inp.wide()[..m * c], &w.wide()[..e * oc * c]);
        self.pool
            .install(|| moe::grouped_forward(out, inp, w, counts, c, oc));
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
        let (m, e) = (counts.iter().sum::<usize>(), counts.len());
        let dinp = &mut dinp.wide_mut()[..m * c];
        let mut dw = dw.map(|dw| dw.wide_mut());
        let dw = dw.as_deref_mut().map(|d| &mut d[..e * oc * c]);
        let (dout, inp) = (&dout.wide()[..m * oc], &inp.wide()[..m * c]);
        let w = &w.wide()[..e * oc * c];
        self.pool
            .install(|| moe::grouped_backward(dinp, dw, dout, inp, w, counts, c, oc));
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
        let s = src.wide();
        let mut d = dst.wide_mut();
        crate::backend::copy_cols_host(
            &mut d, dst_cols, dst_off, &s, src_cols, src_off, rows, width, scale, accumulate,
        );
    }

    // out (N) = gelu(inp (N)).
    fn gelu_forward(&mut self, out: &mut CpuBuf, inp: &CpuBuf, n: usize) {
        let out = &mut out.wide_mut()[..n];
        let inp = &inp.wide()[..n];
        self.pool.install(|| {
            out.par_chunks_mut(ELEMS_PER_TASK)
                .zip(inp.par_chunks(ELEMS_PER_TASK))
                .for_each(|(o, x)| {
                    vectorized(
                        #[inline(always)]
                        || {
                            for (o, &x) in o.iter_mut().zip(x) {
                                let u = GELU_SCALE * (x + GELU_CUBE * x * x * x);
                                *o = x * sigmoid(2.0 * u);
                            }
                        },
                    )
                })
        });
    }

    // dout (N) *= gelu'(inp (N)).
    fn gelu_backward(&mut self, dout: &mut CpuBuf, inp: &CpuBuf, n: usize) {
        let dout = &mut dout.wide_mut()[..n];
        let inp = &inp.wide()[..n];
        self.pool.install(|| {
            dout.par_chunks_mut(ELEMS_PER_TASK)
                .zip(inp.par_chunks(ELEMS_PER_TASK))
                .for_each(|(d, x)| {
                    vectorized(
                        #[inline(always)]
                        || {
                            for (d, &x) in d.iter_mut().zip(x) {
                                // d/dx [x s(2u)] = s + 2x s (1 - s) u', s = sigmoid(2u),
                                // u' = sqrt(2/pi) (1 + 3*0.044715 x^2).
                                let u = GELU_SCALE * (x + GELU_CUBE * x * x * x);
                                let du = GELU_SCALE * (1.0 + 3.0 * GELU_CUBE * x * x);
                                let s = sigmoid(2.0 * u);
                                *d *= s + 2.0 * x * s * (1.0 - s) * du;
                            }
                        },
                    )
                })
        });
    }

    // out (N,I) = silu(gate) * up, gu (N,2I) rows [gate (I) | up (I)].
    fn swiglu_forward(&mut self, out: &mut CpuBuf, gu: &CpuBuf, n: usize, i: usize) {
        if n == 0 || i == 0 {
            return;
        }
        let out = &mut out.wide_mut()[..n * i];
        let gu = &gu.wide()[..n * 2 * i];
        let rows = rows_per_task(2 * i);
        self.pool.install(|| {
            out.par_chunks_mut(i * rows)
                .zip(gu.par_chunks(2 * i * rows))
                .for_each(|(out, gu)| {
                    vectorized(
                        #[inline(always)]
                        || {
                            for (o, gu) in out.chunks_exact_mut(i).zip(gu.chunks_exact(2 * i)) {
                                let (g, u) = gu.split_at(i);
                                for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                                    *o = g * sigmoid(g) * u;
                                }
                            }
                        },
                    )
                })
        });
    }

    // dgu (N,2I) from dout (N,I) and gu (N,2I).
    fn swiglu_backward(
        &mut self,
        dgu: &mut CpuBuf,
        dout: &CpuBuf,
        gu: &CpuBuf,
        n: usize,
        i: usize,
    ) {
        if n == 0 || i == 0 {
            return;
        }
        let dgu = &mut dgu.wide_mut()[..n * 2 * i];
        let dout = &dout.wide()[..n * i];
        let gu = &gu.wide()[..n * 2 * i];
        let rows = rows_per_task(2 * i);
        self.pool.install(|| {
            dgu.par_chunks_mut(2 * i * rows)
                .zip(dout.par_chunks(i * rows))
                .zip(gu.par_chunks(2 * i * rows))
                .for_each(|((dgu, dout), gu)| {
                    vectorized(
                        #[inline(always)]
                        || {
                            for ((dgu, dy), gu) in dgu
                                .chunks_exact_mut(2 * i)
                                .zip(dout.chunks_exact(i))
                                .zip(gu.chunks_exact(2 * i))
                            {
                                let (dg, du) = dgu.split_at_mut(i);
                                let (g, u) = gu.split_at(i);
                                // silu'(g) = s (1 + g (1 - s)), s = sigmoid(g).
                                for ((((dg, du), &dy), &g), &u) in
                                    dg.iter_mut().zip(du.iter_mut()).zip(dy).zip(g).zip(u)
                                {
                                    let s = sigmoid(g);
                                    *dg = dy * u * s * (1.0 + g * (1.0 - s));
                                    *du = dy * g * s;
                                }
                            }
                        },
                    )
                })
        });
    }

    // out (N) = a + b.
    fn add(&mut self, out: &mut CpuBuf, a: &CpuBuf, b: &CpuBuf, n: usize) {
        let out = &mut out.wide_mut()[..n];
        let a = &a.wide()[..n];
        let b = &b.wide()[..n];
        self.pool.install(|| {
            out.par_chunks_mut(ELEMS_PER_TASK)
                .zip(a.par_chunks(ELEMS_PER_TASK))
                .zip(b.par_chunks(ELEMS_PER_TASK))
                .for_each(|((o, a), b)| {
                    for ((o, a), b) in o.iter_mut().zip(a).zip(b) {
                        *o = a + b;
                    }
                })
        });
    }

    // qkv (B,T,qkv_width), in place on q and k.
    fn rope_forward(&mut self, qkv: &mut CpuBuf, s: AttnShape, theta: f32) {
        let mut qkv = qkv.wide_mut();
        self.pool.install(|| rope_apply(&mut qkv, s, theta, 1.0));
    }

    // dqkv (B,T,qkv_width): the transpose of a rotation is the rotation by -angle.
    fn rope_backward(&mut self, dqkv: &mut CpuBuf, s: AttnShape, theta: f32) {
        let mut dqkv = dqkv.wide_mut();
        self.pool.install(|| rope_apply(&mut dqkv, s, theta, -1.0));
    }

    // out (B,T,H*hd), att (B,H,T,T), qkv (B,T,qkv_width).
    // One task per (b, h): scores = q k^T / sqrt(hd) by GEMM (the full T x T;
    // the masked half is overwritten), causal softmax per row, out_h = att @ v.
    fn attention_forward(
        &mut self,
        out: &mut CpuBuf,
        att: &mut CpuBuf,
        qkv: &CpuBuf,
        s: AttnShape,
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
        let scale = 1.0 / (hd as f32).sqrt();
        let out_ptr = SyncPtr(out.as_mut_ptr());
        self.pool.install(|| {
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
                vectorized(
                    #[inline(always)]
                    || {
                        for (ti, row) in a.chunks_exact_mut(t).enumerate() {
                            let (live, masked) = row.split_at_mut(ti + 1);
                            softmax_inplace(live);
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
    fn attention_backward(
        &mut self,
        dqkv: &mut CpuBuf,
        datt: &mut CpuBuf,
        dout: &CpuBuf,
        qkv: &CpuBuf,
        att: &CpuBuf,
        s: AttnShape,
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
        let scale = 1.0 / (hd as f32).sqrt();
        let dqkv_ptr = SyncPtr(dqkv.as_mut_ptr());
        self.pool.install(|| {
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

    // losses (N), logits (N,Vp), targets (N); only the first v columns count.
    fn crossentropy_forward(
        &mut self,
        losses: &mut CpuBuf,
        logits: &CpuBuf,
        targets: &CpuBuf,
        n: usize,
        v: usize,
        vp: usize,
    ) {
        if n == 0 {
            return;
        }
        assert!(
            v > 0 && v <= vp,
            "cross-entropy needs 0 < v <= vp, got v={v} vp={vp}"
        );
        let losses = &mut losses.wide_mut()[..n];
        let logits = &logits.wide()[..n * vp];
        let targets = &targets.as_u32()[..n];
        self.pool.install(|| {
            losses.par_iter_mut().enumerate().for_each(|(r, loss)| {
                vectorized(
                    #[inline(always)]
                    || {
                        let x = &logits[r * vp..][..v];
                        let tgt = targets[r] as usize;
                        assert!(tgt < v, "target {tgt} >= vocab {v}");
                        // logsumexp = max + ln(sum(exp(x - max))), the sum in f64.
                        let m = max(x);
                        let lse = m as f64 + sum_exp_f64(x, m).ln();
                        *loss = (lse - x[tgt] as f64) as f32;
                    },
                )
            })
        });
    }

    // logits (N,Vp) := dloss * (softmax - onehot(target)), columns [v, vp) := 0.
    fn crossentropy_backward(
        &mut self,
        logits: &mut CpuBuf,
        targets: &CpuBuf,
        dloss: f32,
        n: usize,
        v: usize,
        vp: usize,
    ) {
        if n == 0 {
            return;
        }
        assert!(
            v > 0 && v <= vp,
            "cross-entropy needs 0 < v <= vp, got v={v} vp={vp}"
        );
        let logits = &mut logits.wide_mut()[..n * vp];
        let targets = &targets.as_u32()[..n];
        self.pool.install(|| {
            logits
                .par_chunks_mut(vp)
                .zip(targets.par_iter())
                .for_each(|(row, &tgt)| {
                    vectorized(
                        #[inline(always)]
                        || {
                            let tgt = tgt as usize;
                            assert!(tgt < v, "target {tgt} >= vocab {v}");
                            let (x, pad) = row.split_at_mut(v);
                            // One exp per element: write exp(x - max) in place, then scale.
                            let m = max(x);
                            let total = exp_inplace_sum_f64(x, m);
                            let k = (dloss as f64 / total) as f32;
                            for e in x.iter_mut() {
                                *e *= k;
                            }
                            x[tgt] -= dloss;
                            pad.fill(0.0);
                        },
                    )
                })
        });
    }

    // stats (N,2) = [max, sum exp(x - max)] over the part's real columns,
    // tgt (N) = the target's logit when it falls in this part, else 0.
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
        if n == 0 {
            return;
        }
        assert!(
            v <= vp,
            "cross-entropy part needs v <= vp, got v={v} vp={vp}"
        );
        let stats = &mut stats.wide_mut()[..2 * n];
        let tgt = &mut tgt.wide_mut()[..n];
        let logits = &logits.wide()[..n * vp];
        let targets = &targets.as_u32()[..n];
        self.pool.install(|| {
            stats
                .par_chunks_mut(2)
                .zip(tgt.par_iter_mut())
                .enumerate()
                .for_each(|(r, (st, tg))| {
                    let x = &logits[r * vp..][..v];
                    let (m, sum) = match v {
                        0 => (f32::NEG_INFINITY, 0.0),
                        _ => {
                            let m = max(x);
                            (m, sum_exp_f64(x, m) as f32)
                        }
                    };
                    st[0] = m;
                    st[1] = sum;
                    let t = targets[r] as usize;
                    *tg = match t.checked_sub(lo) {
                        Some(j) if j < v => x[j],
                        _ => 0.0,
                    };
                })
        });
    }

    // lse = M + ln(sum_r s_r exp(m_r - M)) over the parts, losses = lse - tgt.
    fn crossentropy_combine(
        &mut self,
        losses: &mut CpuBuf,
        lse: &mut CpuBuf,
        stats: &CpuBuf,
        tgt: &CpuBuf,
        n: usize,
        parts: usize,
    ) {
        if n == 0 {
            return;
        }
        let losses = &mut losses.wide_mut()[..n];
        let lse = &mut lse.wide_mut()[..n];
        let stats = &stats.wide()[..2 * n * parts];
        let tgt = &tgt.wide()[..n];
        for r in 0..n {
            let part = |p: usize| (stats[(p * n + r) * 2], stats[(p * n + r) * 2 + 1]);
            let m = (0..parts)
                .map(|p| part(p).0)
                .fold(f32::NEG_INFINITY, f32::max);
            let sum: f64 = (0..parts)
                .map(|p| {
                    let (mp, sp) = part(p);
                    match sp {
                        0.0 => 0.0,
                        _ => sp as f64 * ((mp - m) as f64).exp(),
                    }
                })
                .sum();
            let l = m as f64 + sum.ln();
            lse[r] = l as f32;
            losses[r] = (l - tgt[r] as f64) as f32;
        }
    }

    // logits := dloss * exp(logits - lse) - dloss * onehot(target - lo), padding 0.
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
        if n == 0 {
            return;
        }
        let logits = &mut logits.wide_mut()[..n * vp];
        let lse = &lse.wide()[..n];
        let targets = &targets.as_u32()[..n];
        self.pool.install(|| {
            logits.par_chunks_mut(vp).enumerate().for_each(|(r, row)| {
                let (x, pad) = row.split_at_mut(v);
                for e in x.iter_mut() {
                    *e = dloss * (*e - lse[r]).exp();
                }
                if let Some(j) = (targets[r] as usize).checked_sub(lo)
                    && j < v
                {
                    x[j] -= dloss;
                }
                pad.fill(0.0);
            })
        });
    }

    // sum of buf[..n]^2 in f64: fixed chunks summed in order.
    fn sum_squares(&mut self, buf: &CpuBuf, n: usize) -> Option<f64> {
        let x = &buf.wide()[..n];
        let partial: Vec<f64> = self.pool.install(|| {
            x.par_chunks(SUMSQ_CHUNK)
                .map(|c| {
                    vectorized(
                        #[inline(always)]
                        || {
                            let mut acc = [0.0f64; 8];
                            let chunks = c.chunks_exact(8);
                            let rest: f64 = chunks
                                .remainder()
                                .iter()
                                .map(|&v| v as f64 * v as f64)
                                .sum();
                            for c in chunks {
                                for j in 0..8 {
                                    acc[j] += c[j] as f64 * c[j] as f64;
                                }
                            }
                            acc.iter().sum::<f64>() + rest
                        },
                    )
                })
                .collect()
        });
        Some(partial.iter().sum())
    }

    // param, grad, m, v (N).
    fn adamw_update(
        &mut self,
        param: &mut CpuBuf,
        grad: &CpuBuf,
        m: &mut CpuBuf,
        v: &mut CpuBuf,
        n: usize,
        h: AdamHyper,
    ) {
        let param = &mut param.wide_mut()[..n];
        let grad = &grad.wide()[..n];
        let m = &mut m.wide_mut()[..n];
        let v = &mut v.wide_mut()[..n];
        self.pool.install(|| {
            param
                .par_chunks_mut(ELEMS_PER_TASK)
                .zip(m.par_chunks_mut(ELEMS_PER_TASK))
                .zip(v.par_chunks_mut(ELEMS_PER_TASK))
                .zip(grad.par_chunks(ELEMS_PER_TASK))
                .for_each(|(((p, m), v), g)| {
                    vectorized(
                        #[inline(always)]
                        || {
                            for (((p, m), v), &g) in
                                p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g)
                            {
                                let g = g * h.grad_scale;
                                *m = h.beta1 * *m + (1.0 - h.beta1) * g;
                                *v = h.beta2 * *v + (1.0 - h.beta2) * g * g;
                                let m_hat = *m * h.m_corr;
                                let v_hat = *v * h.v_corr;
                                *p -= h.lr * (m_hat / (v_hat.sqrt() + h.eps) + h.weight_decay * *p);
                            }
                        },
                    )
                })
        });
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

#[cfg(test)]
mod tests {
    //! Each op against a naive f64 reference written here. Forward ops compare
    //! with `|got - want| <= 1e-5 + 1e-5*|want|`; backward ops compare against the
    //! analytic f64 gradient or central differences (h = 1e-5) of the f64 forward
    //! reference with `|got - want| <= 5e-5 + 1e-4*|want|` (f32 rounding of O(1)
    //! values plus the ~1e-10 finite-difference error).

    use super::*;

    const FWD: (f64, f64) = (1e-5, 1e-5);
    const BWD: (f64, f64) = (5e-5, 1e-4);

    /// xorshift64*: deterministic inputs without a dependency.
    struct Rng(u64);
    impl Rng {
        fn f32(&mut self) -> f32 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let bits = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
            (bits as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.f32()).collect()
        }
        fn tokens(&mut self, n: usize, v: usize) -> Vec<u32> {
            (0..n)
                .map(|_| (((self.f32() + 1.0) * 0.5 * v as f32) as usize).min(v - 1) as u32)
                .collect()
        }
    }

    fn be(threads: usize) -> CpuBackend {
        CpuBackend::new(threads).unwrap()
    }
    fn f(v: &[f32]) -> CpuBuf {
        CpuBuf::F32(v.to_vec())
    }
    fn u(v: &[u32]) -> CpuBuf {
        CpuBuf::U32(v.to_vec())
    }
    fn d(v: &[f32]) -> Vec<f64> {
        v.iter().map(|&x| x as f64).collect()
    }
    fn zeros(n: usize) -> CpuBuf {
        CpuBuf::F32(vec![0.0; n])
    }
    fn nans(n: usize) -> CpuBuf {
        CpuBuf::F32(vec![f32::NAN; n])
    }

    #[track_caller]
    fn close(got: &[f32], want: &[f64], (atol, rtol): (f64, f64), what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let err = (g as f64 - w).abs();
            assert!(
                err <= atol + rtol * w.abs(),
                "{what}[{i}]: got {g}, want {w} (err {err:e})"
            );
        }
    }

    /// `init + grad`, the expected value of an accumulating gradient.
    fn plus(init: &[f32], grad: &[f64]) -> Vec<f64> {
        init.iter().zip(grad).map(|(&a, &b)| a as f64 + b).collect()
    }

    /// Central differences of a scalar function of `x`.
    fn fd_grad(f: impl Fn(&[f64]) -> f64, x: &[f64]) -> Vec<f64> {
        let h = 1e-5;
        let mut x = x.to_vec();
        (0..x.len())
            .map(|i| {
                let x0 = x[i];
                x[i] = x0 + h;
                let fp = f(&x);
                x[i] = x0 - h;
                let fm = f(&x);
                x[i] = x0;
                (fp - fm) / (2.0 * h)
            })
            .collect()
    }

    fn proj(a: &[f64], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(x, &y)| x * y as f64).sum()
    }

    // ---- f64 references -------------------------------------------------

    fn ref_layernorm(
        x: &[f64],
        w: &[f64],
        b: Option<&[f64]>,
        n: usize,
        c: usize,
        eps: f64,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (mut out, mut mean, mut rstd) = (vec![0.0; n * c], vec![0.0; n], vec![0.0; n]);
        for r in 0..n {
            let row = &x[r * c..][..c];
            let m = row.iter().sum::<f64>() / c as f64;
            let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / c as f64;
            let rs = 1.0 / (var + eps).sqrt();
            for i in 0..c {
                out[r * c + i] = (row[i] - m) * rs * w[i] + b.map_or(0.0, |b| b[i]);
            }
            mean[r] = m;
            rstd[r] = rs;
        }
        (out, mean, rstd)
    }

    fn ref_rmsnorm(x: &[f64], w: &[f64], n: usize, c: usize, eps: f64) -> (Vec<f64>, Vec<f64>) {
        let (mut out, mut rstd) = (vec![0.0; n * c], vec![0.0; n]);
        for r in 0..n {
            let row = &x[r * c..][..c];
            let rs = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / c as f64 + eps).sqrt();
            for i in 0..c {
                out[r * c + i] = row[i] * rs * w[i];
            }
            rstd[r] = rs;
        }
        (out, rstd)
    }

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

    fn ref_gelu(x: f64) -> f64 {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
    }

    fn ref_silu(x: f64) -> f64 {
        x / (1.0 + (-x).exp())
    }

    fn ref_swiglu(gu: &[f64], n: usize, i: usize) -> Vec<f64> {
        let mut out = vec![0.0; n * i];
        for r in 0..n {
            for j in 0..i {
                out[r * i + j] = ref_silu(gu[r * 2 * i + j]) * gu[r * 2 * i + i + j];
            }
        }
        out
    }

    fn ref_rope(qkv: &[f64], s: AttnShape, theta: f64) -> Vec<f64> {
        let (w, hd) = (s.qkv_width(), s.head_dim);
        let mut out = qkv.to_vec();
        for r in 0..s.b * s.t {
            let pos = (r % s.t) as f64;
            for h in 0..s.n_head + s.n_kv_head {
                let base = r * w + h * hd;
                for i in 0..hd / 2 {
                    let ang = pos * theta.powf(-2.0 * i as f64 / hd as f64);
                    let (x1, x2) = (qkv[base + i], qkv[base + i + hd / 2]);
                    out[base + i] = x1 * ang.cos() - x2 * ang.sin();
                    out[base + i + hd / 2] = x2 * ang.cos() + x1 * ang.sin();
                }
            }
        }
        out
    }

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

    // ---- tests ----------------------------------------------------------

    #[test]
    fn buffers_alloc_fill_upload_download() {
        let mut be = be(2);
        let s = AttnShape {
            b: 2,
            t: 8,
            n_head: 4,
            n_kv_head: 2,
            head_dim: 4,
        };
        assert_eq!(be.workspace_bytes(s, false, DType::F32), 0);
        let mut a = be.alloc(5, DType::F32);
        assert_eq!(be.download_f32(&a).unwrap(), vec![0.0; 5]);
        be.fill(&mut a, 1.5);
        assert_eq!(be.download_f32(&a).unwrap(), vec![1.5; 5]);
        be.upload_f32(&mut a, &[1.0, 2.0]);
        assert_eq!(be.download_f32(&a).unwrap(), vec![1.0, 2.0, 1.5, 1.5, 1.5]);
        let mut t = be.alloc(3, DType::U32);
        assert_eq!(t.dtype(), DType::U32);
        be.upload_u32(&mut t, &[7, 8, 9]);
        assert_eq!(t.as_u32(), &[7, 8, 9]);
        be.free(a);
        assert!(CpuBackend::new(0).is_err());
    }

    #[test]
    #[should_panic(expected = "expected a F32 buffer, got a U32 buffer")]
    fn dtype_mismatch_panics() {
        let _ = CpuBuf::U32(vec![1]).as_f32();
    }

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0.0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 175.0 * i as f64 / 200_000.0;
            let got = exp_f32(x as f32) as f64;
            let want = (x as f32 as f64).exp();
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 2.5e-7, "worst relative error {worst:e}");
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(-1e30) < 1e-37);
    }

    /// `vectorized` must not change results: the same kernels run plainly
    /// (baseline SSE2 code) and inside it (AVX-512/AVX2 here) agree bit for bit.
    #[test]
    fn vectorized_matches_baseline_bits() {
        let x: Vec<f32> = Rng(14).vec(4099).iter().map(|v| v * 30.0).collect();
        #[inline(always)]
        fn kernel(x: &[f32]) -> (Vec<u32>, u64, u32, u32) {
            let mut e = x.to_vec();
            for v in e.iter_mut() {
                *v = sigmoid(*v);
            }
            let m = max(x);
            let mut sm = x[..1000].to_vec();
            softmax_inplace(&mut sm);
            let d = dot(&sm, &x[1000..2000]);
            let e = e.iter().map(|v| v.to_bits()).collect();
            (
                e,
                sum_exp_f64(x, m).to_bits(),
                d.to_bits(),
                sum_sq_dev(x, 0.5).to_bits(),
            )
        }
        let plain = kernel(&x);
        let wide = vectorized(
            #[inline(always)]
            || kernel(&x),
        );
        assert!(plain == wide, "vectorized code changed a result");
    }

    #[test]
    fn embed_forward_backward() {
        let (v, c, b, t) = (7, 8, 2, 3);
        let n = b * t;
        let mut rng = Rng(1);
        let (wte, wpe) = (rng.vec(v * c), rng.vec(t * c));
        let tokens = vec![3, 0, 3, 6, 3, 1];
        let mut be = be(2);
        let mut out = zeros(n * c);
        be.embed_forward(&mut out, &u(&tokens), &f(&wte), Some(&f(&wpe)), n, t, c);
        let mut want = vec![0.0; n * c];
        for r in 0..n {
            for i in 0..c {
                want[r * c + i] =
                    wte[tokens[r] as usize * c + i] as f64 + wpe[(r % t) * c + i] as f64;
            }
        }
        close(out.as_f32(), &want, FWD, "embed out");
        be.embed_forward(&mut out, &u(&tokens), &f(&wte), None, n, t, c);
        let want: Vec<f64> = (0..n * c)
            .map(|k| wte[tokens[k / c] as usize * c + k % c] as f64)
            .collect();
        close(out.as_f32(), &want, FWD, "embed out (no wpe)");

        let dout = rng.vec(n * c);
        let (dwte0, dwpe0) = (rng.vec(v * c), rng.vec(t * c));
        let (mut dwte, mut dwpe) = (f(&dwte0), f(&dwpe0));
        be.embed_backward(&mut dwte, Some(&mut dwpe), &f(&dout), &u(&tokens), n, t, c);
        let (mut gwte, mut gwpe) = (vec![0.0; v * c], vec![0.0; t * c]);
        for r in 0..n {
            for i in 0..c {
                gwte[tokens[r] as usize * c + i] += dout[r * c + i] as f64;
                gwpe[(r % t) * c + i] += dout[r * c + i] as f64;
            }
        }
        close(dwte.as_f32(), &plus(&dwte0, &gwte), BWD, "dwte");
        close(dwpe.as_f32(), &plus(&dwpe0, &gwpe), BWD, "dwpe");
    }

    #[test]
    fn layernorm_forward_backward() {
        let (n, c, eps) = (6, 8, 1e-5);
        let mut rng = Rng(2);
        let (x, w, b) = (rng.vec(n * c), rng.vec(c), rng.vec(c));
        let mut be = be(2);
        let (mut out, mut mean, mut rstd) = (zeros(n * c), zeros(n), zeros(n));
        be.layernorm_forward(
            &mut out,
            &mut mean,
            &mut rstd,
            &f(&x),
            &f(&w),
            Some(&f(&b)),
            n,
            c,
            eps,
        );
        let (wo, wm, wr) = ref_layernorm(&d(&x), &d(&w), Some(&d(&b)), n, c, eps as f64);
        close(out.as_f32(), &wo, FWD, "ln out");
        close(mean.as_f32(), &wm, FWD, "ln mean");
        close(rstd.as_f32(), &wr, FWD, "ln rstd");

        let dout = rng.vec(n * c);
        let (dx0, dw0, db0) = (rng.vec(n * c), rng.vec(c), rng.vec(c));
        let (mut dx, mut dw, mut db) = (f(&dx0), f(&dw0), f(&db0));
        be.layernorm_backward(
            &mut dx,
            &mut dw,
            Some(&mut db),
            &f(&dout),
            &f(&x),
            &f(&w),
            &mean,
            &rstd,
            n,
            c,
        );
        let (x64, w64, b64) = (d(&x), d(&w), d(&b));
        let gx = fd_grad(
            |x| {
                proj(
                    &ref_layernorm(x, &w64, Some(&b64), n, c, eps as f64).0,
                    &dout,
                )
            },
            &x64,
        );
        let gw = fd_grad(
            |w| {
                proj(
                    &ref_layernorm(&x64, w, Some(&b64), n, c, eps as f64).0,
                    &dout,
                )
            },
            &w64,
        );
        let gb = fd_grad(
            |b| {
                proj(
                    &ref_layernorm(&x64, &w64, Some(b), n, c, eps as f64).0,
                    &dout,
                )
            },
            &b64,
        );
        close(dx.as_f32(), &plus(&dx0, &gx), BWD, "ln dinp");
        close(dw.as_f32(), &plus(&dw0, &gw), BWD, "ln dw");
        close(db.as_f32(), &plus(&db0, &gb), BWD, "ln db");
    }

    #[test]
    fn rmsnorm_forward_backward() {
        // c = 20 exercises both the 16-lane body and the tail of the reductions.
        let (n, c, eps) = (6, 20, 1e-5);
        let mut rng = Rng(3);
        let (x, w) = (rng.vec(n * c), rng.vec(c));
        let mut be = be(2);
        let (mut out, mut rstd) = (zeros(n * c), zeros(n));
        be.rmsnorm_forward(&mut out, &mut rstd, &f(&x), &f(&w), n, c, eps);
        let (wo, wr) = ref_rmsnorm(&d(&x), &d(&w), n, c, eps as f64);
        close(out.as_f32(), &wo, FWD, "rms out");
        close(rstd.as_f32(), &wr, FWD, "rms rstd");

        let dout = rng.vec(n * c);
        let (dx0, dw0) = (rng.vec(n * c), rng.vec(c));
        let (mut dx, mut dw) = (f(&dx0), f(&dw0));
        be.rmsnorm_backward(&mut dx, &mut dw, &f(&dout), &f(&x), &f(&w), &rstd, n, c);
        let (x64, w64) = (d(&x), d(&w));
        let gx = fd_grad(
            |x| proj(&ref_rmsnorm(x, &w64, n, c, eps as f64).0, &dout),
            &x64,
        );
        let gw = fd_grad(
            |w| proj(&ref_rmsnorm(&x64, w, n, c, eps as f64).0, &dout),
            &w64,
        );
        close(dx.as_f32(), &plus(&dx0, &gx), BWD, "rms dinp");
        close(dw.as_f32(), &plus(&dw0, &gw), BWD, "rms dw");
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
    fn gelu_forward_backward() {
        let n = 1000;
        let mut rng = Rng(5);
        let x: Vec<f32> = rng.vec(n).iter().map(|v| v * 6.0).collect();
        let mut be = be(2);
        let mut out = zeros(n);
        be.gelu_forward(&mut out, &f(&x), n);
        let want: Vec<f64> = x.iter().map(|&v| ref_gelu(v as f64)).collect();
        close(out.as_f32(), &want, FWD, "gelu");
        let dout = rng.vec(n);
        let mut dx = f(&dout);
        be.gelu_backward(&mut dx, &f(&x), n);
        let h = 1e-5;
        let want: Vec<f64> = x
            .iter()
            .zip(&dout)
            .map(|(&v, &g)| {
                g as f64 * (ref_gelu(v as f64 + h) - ref_gelu(v as f64 - h)) / (2.0 * h)
            })
            .collect();
        close(dx.as_f32(), &want, BWD, "gelu backward");
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

    #[test]
    fn swiglu_forward_backward() {
        let (n, i) = (6, 5);
        let mut rng = Rng(6);
        let gu: Vec<f32> = rng.vec(n * 2 * i).iter().map(|v| v * 4.0).collect();
        let mut be = be(2);
        let mut out = zeros(n * i);
        be.swiglu_forward(&mut out, &f(&gu), n, i);
        close(out.as_f32(), &ref_swiglu(&d(&gu), n, i), FWD, "swiglu");
        let dout = rng.vec(n * i);
        let mut dgu = nans(n * 2 * i);
        be.swiglu_backward(&mut dgu, &f(&dout), &f(&gu), n, i);
        let want = fd_grad(|g| proj(&ref_swiglu(g, n, i), &dout), &d(&gu));
        close(dgu.as_f32(), &want, BWD, "swiglu backward");
    }

    #[test]
    fn add_elementwise() {
        let mut rng = Rng(7);
        let (a, b) = (rng.vec(50_000), rng.vec(50_000));
        let mut out = zeros(50_000);
        be(2).add(&mut out, &f(&a), &f(&b), 50_000);
        let want: Vec<f64> = a.iter().zip(&b).map(|(&x, &y)| (x + y) as f64).collect();
        close(out.as_f32(), &want, (0.0, 0.0), "add");
    }

    fn shape() -> AttnShape {
        AttnShape {
            b: 2,
            t: 4,
            n_head: 4,
            n_kv_head: 2,
            head_dim: 4,
        }
    }

    #[test]
    fn rope_forward_backward() {
        let s = shape();
        let theta = 10_000.0;
        let len = s.b * s.t * s.qkv_width();
        let mut rng = Rng(8);
        let x = rng.vec(len);
        let mut be = be(2);
        let mut buf = f(&x);
        be.rope_forward(&mut buf, s, theta);
        close(
            buf.as_f32(),
            &ref_rope(&d(&x), s, theta as f64),
            FWD,
            "rope",
        );
        let g = rng.vec(len);
        let mut dg = f(&g);
        be.rope_backward(&mut dg, s, theta);
        let want = fd_grad(|x| proj(&ref_rope(x, s, theta as f64), &g), &d(&x));
        close(dg.as_f32(), &want, BWD, "rope backward");
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

    #[test]
    fn crossentropy_forward_backward() {
        let (n, v, vp) = (6, 10, 12);
        let mut rng = Rng(10);
        let mut logits: Vec<f32> = rng.vec(n * vp).iter().map(|x| x * 8.0).collect();
        for r in 0..n {
            // Padding holds garbage that must be ignored.
            logits[r * vp + v] = 1e4;
            logits[r * vp + v + 1] = f32::NAN;
        }
        let targets = rng.tokens(n, v);
        let mut be = be(2);
        let mut losses = zeros(n);
        be.crossentropy_forward(&mut losses, &f(&logits), &u(&targets), n, v, vp);
        let mut want_loss = vec![0.0; n];
        let mut want_grad = vec![0.0; n * vp];
        let dloss = 1.0 / n as f32;
        for r in 0..n {
            let x = d(&logits[r * vp..][..v]);
            let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = x.iter().map(|v| (v - m).exp()).sum();
            let tgt = targets[r] as usize;
            want_loss[r] = m + z.ln() - x[tgt];
            for j in 0..v {
                let onehot = if j == tgt { 1.0 } else { 0.0 };
                want_grad[r * vp + j] = dloss as f64 * ((x[j] - m).exp() / z - onehot);
            }
        }
        close(losses.as_f32(), &want_loss, FWD, "ce loss");
        let mut g = f(&logits);
        be.crossentropy_backward(&mut g, &u(&targets), dloss, n, v, vp);
        close(g.as_f32(), &want_grad, (1e-6, 1e-5), "ce grad");
    }

    #[test]
    fn sum_squares_f64() {
        let n = 3 * SUMSQ_CHUNK + 1234;
        let x = Rng(11).vec(n);
        let got = be(2).sum_squares(&f(&x), n).unwrap();
        let want: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
        assert!((got - want).abs() <= 1e-12 * want, "{got} vs {want}");
    }

    #[test]
    fn adamw_matches_formula() {
        let n = 40_000;
        let mut rng = Rng(12);
        let (p0, g, m0) = (rng.vec(n), rng.vec(n), rng.vec(n));
        let v0: Vec<f32> = rng.vec(n).iter().map(|x| x.abs()).collect();
        let h = AdamHyper {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            m_corr: 1.0 / (1.0 - 0.9f32.powi(3)),
            v_corr: 1.0 / (1.0 - 0.95f32.powi(3)),
            grad_scale: 0.5,
        };
        let (mut p, mut m, mut v) = (f(&p0), f(&m0), f(&v0));
        be(2).adamw_update(&mut p, &f(&g), &mut m, &mut v, n, h);
        let (mut wp, mut wm, mut wv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        for i in 0..n {
            let gi = g[i] as f64 * h.grad_scale as f64;
            wm[i] = h.beta1 as f64 * m0[i] as f64 + (1.0 - h.beta1 as f64) * gi;
            wv[i] = h.beta2 as f64 * v0[i] as f64 + (1.0 - h.beta2 as f64) * gi * gi;
            let upd = wm[i] * h.m_corr as f64 / ((wv[i] * h.v_corr as f64).sqrt() + h.eps as f64);
            wp[i] = p0[i] as f64 - h.lr as f64 * (upd + h.weight_decay as f64 * p0[i] as f64);
        }
        close(m.as_f32(), &wm, FWD, "adam m");
        close(v.as_f32(), &wv, FWD, "adam v");
        close(p.as_f32(), &wp, FWD, "adam param");
    }

    fn bits(b: &CpuBuf) -> Vec<u32> {
        b.as_f32().iter().map(|x| x.to_bits()).collect()
    }

    /// Runs the reductions and GEMMs on 1 and 2 threads with shapes large enough
    /// that the 2-thread run really splits the work; results must match bit for bit.
    #[test]
    fn one_and_two_threads_bit_identical() {
        let run = |threads: usize| -> Vec<Vec<u32>> {
            let mut be = be(threads);
            let mut rng = Rng(13);
            let mut res = Vec::new();
            // layernorm: 200 channels = 4 column tasks, 64 rows.
            let (n, c) = (64, 200);
            let (x, w, b, dout) = (rng.vec(n * c), rng.vec(c), rng.vec(c), rng.vec(n * c));
            let (mut out, mut mean, mut rstd) = (zeros(n * c), zeros(n), zeros(n));
            be.layernorm_forward(
                &mut out,
                &mut mean,
                &mut rstd,
                &f(&x),
                &f(&w),
                Some(&f(&b)),
                n,
                c,
                1e-5,
            );
            let (mut dx, mut dw, mut db) = (zeros(n * c), zeros(c), zeros(c));
            be.layernorm_backward(
                &mut dx,
                &mut dw,
                Some(&mut db),
                &f(&dout),
                &f(&x),
                &f(&w),
                &mean,
                &rstd,
                n,
                c,
            );
            res.extend([bits(&out), bits(&dx), bits(&dw), bits(&db)]);
            let mut drw = zeros(c);
            be.rmsnorm_backward(&mut dx, &mut drw, &f(&dout), &f(&x), &f(&w), &rstd, n, c);
            res.extend([bits(&dx), bits(&drw)]);
            // matmul: above gemm's threading threshold in every product.
            let (n, c, oc) = (128, 192, 160);
            let (x, w, dout) = (rng.vec(n * c), rng.vec(oc * c), rng.vec(n * oc));
            let mut out = zeros(n * oc);
            be.matmul_forward(&mut out, &f(&x), &f(&w), Some(&f(&rng.vec(oc))), n, c, oc);
            let (mut dx, mut dw, mut db) = (zeros(n * c), f(&rng.vec(oc * c)), zeros(oc));
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
            res.extend([bits(&out), bits(&dx), bits(&dw), bits(&db)]);
            // embedding: 600 rows = 3 vocab tasks, many repeated tokens.
            let (v, c, t, n) = (600, 16, 8, 64);
            let mut tokens = rng.tokens(n, v);
            tokens[10] = tokens[3];
            tokens[40] = tokens[3];
            let (mut dwte, mut dwpe) = (f(&rng.vec(v * c)), zeros(t * c));
            be.embed_backward(
                &mut dwte,
                Some(&mut dwpe),
                &f(&rng.vec(n * c)),
                &u(&tokens),
                n,
                t,
                c,
            );
            res.extend([bits(&dwte), bits(&dwpe)]);
            // attention: 2 x 2 (b, kv head) tasks.
            let s = AttnShape {
                b: 2,
                t: 16,
                n_head: 4,
                n_kv_head: 2,
                head_dim: 8,
            };
            let (len, olen, alen) = (
                s.b * s.t * s.qkv_width(),
                s.b * s.t * s.out_width(),
                s.b * s.n_head * s.t * s.t,
            );
            let qkv = f(&rng.vec(len));
            let (mut out, mut att) = (zeros(olen), zeros(alen));
            be.attention_forward(&mut out, &mut att, &qkv, s);
            let (mut dqkv, mut datt) = (zeros(len), zeros(alen));
            be.attention_backward(&mut dqkv, &mut datt, &f(&rng.vec(olen)), &qkv, &att, s);
            res.extend([bits(&out), bits(&att), bits(&dqkv)]);
            let n = 3 * SUMSQ_CHUNK + 5;
            let ss = be.sum_squares(&f(&rng.vec(n)), n).unwrap().to_bits();
            res.push(vec![ss as u32, (ss >> 32) as u32]);
            res
        };
        let (one, two) = (run(1), run(2));
        for (i, (a, b)) in one.iter().zip(&two).enumerate() {
            assert!(a == b, "output {i} differs between 1 and 2 threads");
        }
    }

    /// 16-bit storage: a kernel reads 16-bit values, computes in f32 and rounds
    /// each stored result once (to nearest even), including when it accumulates.
    #[test]
    fn sixteen_bit_buffers_round_once_on_store() {
        let mut be = be(2);
        let mut r = Rng(0x5eed_1234);
        let (n, c, oc) = (5, 24, 7);
        let (x, w, dy) = (r.vec(n * c), r.vec(oc * c), r.vec(n * oc));
        for dt in [DType::Bf16, DType::F16] {
            let round = |v: &[f32]| -> Vec<f32> {
                let mut one = CpuBackend::new(1).unwrap();
                let mut b = one.alloc(v.len(), dt);
                one.upload_f32(&mut b, v);
                b.wide().into_owned()
            };
            // inputs as the 16-bit buffers hold them
            let (xr, wr, dyr) = (round(&x), round(&w), round(&dy));
            let mut x16 = be.alloc(n * c, dt);
            let mut w16 = be.alloc(oc * c, dt);
            let mut dy16 = be.alloc(n * oc, dt);
            be.upload_f32(&mut x16, &x);
            be.upload_f32(&mut w16, &w);
            be.upload_f32(&mut dy16, &dy);
            assert_eq!(x16.dtype(), dt);
            assert_eq!(x16.wide().as_ref(), xr.as_slice());

            // forward: the f32 result on the widened inputs, rounded once
            let mut out16 = be.alloc(n * oc, dt);
            be.matmul_forward(&mut out16, &x16, &w16, None, n, c, oc);
            let mut out32 = zeros(n * oc);
            be.matmul_forward(&mut out32, &f(&xr), &f(&wr), None, n, c, oc);
            assert_eq!(out16.wide().as_ref(), round(out32.as_f32()).as_slice());

            // backward accumulates dw twice: each add in f32 from the stored
            // 16-bit value, rounded when stored
            let mut dw16 = be.alloc(oc * c, dt);
            let mut dx16 = be.alloc(n * c, dt);
            let mut dw32 = zeros(oc * c);
            let mut dx32 = zeros(n * c);
            for _ in 0..2 {
                be.matmul_backward(
                    &mut dx16,
                    Some(&mut dw16),
                    None,
                    &dy16,
                    &x16,
                    &w16,
                    n,
                    c,
                    oc,
                );
                be.matmul_backward(
                    &mut dx32,
                    Some(&mut dw32),
                    None,
                    &f(&dyr),
                    &f(&xr),
                    &f(&wr),
                    n,
                    c,
                    oc,
                );
                let rounded = round(dw32.as_f32());
                assert_eq!(dw16.wide().as_ref(), rounded.as_slice());
                dw32 = f(&rounded);
            }
            assert_eq!(dx16.wide().as_ref(), round(dx32.as_f32()).as_slice());

            // master -> working weights
            let mut back = be.alloc(oc * c, dt);
            be.convert(&mut back, &f(&w), oc * c);
            assert_eq!(back, w16);
        }
        // fp16 overflows to inf past 65504; bf16 keeps fp32's range
        let mut h = be.alloc(2, DType::F16);
        be.upload_f32(&mut h, &[65504.0, 70000.0]);
        assert_eq!(h.wide().as_ref(), &[65504.0, f32::INFINITY]);
        let mut b = be.alloc(1, DType::Bf16);
        be.upload_f32(&mut b, &[1e30]);
        assert!(b.wide()[0].is_finite());
    }
}
