//! The `cuda` backend: the engine's ops on an NVIDIA GPU.
//!
//! Matmuls go to cuBLAS (fp32 accumulation, `beta = 1` where an op
//! accumulates); every other op is a CUDA C kernel in `kernels/`, compiled at
//! run time by NVRTC (no toolkit headers needed). The backend talks to the
//! device through the [`driver::Driver`] trait, implemented for a real GPU
//! ([`real::CudaDriver`], cudarc with dynamic loading, so one binary runs with
//! or without CUDA) and for the host ([`emu::EmuDriver`], the same kernel
//! sources under a SIMT emulation header), so all of this file runs in
//! `cargo test` on machines without a GPU.
//!
//! Memory: buffers come from a size-keyed caching allocator (freed blocks are
//! kept for the next request of the same rounded size, as PyTorch's caching
//! allocator does), so the engine's alloc/free pattern does not turn into
//! `cuMemAlloc`/`cuMemFree` calls every step. Tracked bytes stay the engine's:
//! the only memory the backend holds for itself is a small fixed scratch (the
//! reduction partials and the 8-bit quantisation maps, [`SCRATCH_BYTES`]),
//! reported with the driver's own memory as [`CudaBackend::overhead_bytes`];
//! attention scratch is declared through `workspace_bytes` so the meta backend
//! predicts it byte for byte.
//!
//! Offload (ZeRO-Offload): [`Backend::alloc_host`] gives pinned host memory
//! mapped into the device's address space ([`Driver::alloc_host`]), so the
//! same kernels read and write the offloaded master weights, optimizer
//! state and gradient shards over PCIe ("zero-copy"); the optimizer step
//! runs on the GPU, where DeepSpeed runs its CPU Adam on the host, with the
//! same placement of memory, which is what memfit measures. Host-mapped
//! blocks are cached apart from device blocks and never count toward the
//! device's memory.

pub mod comm;
pub mod driver;
pub mod emu;
pub mod libs;
pub mod nccl;
pub mod nvrtc;
pub mod real;

mod attention;
pub mod check;
mod matmul;
mod nf4;
mod norm;
mod optim;

use std::collections::HashMap;

use driver::{Arg, DevPtr, Driver, Kernel, LaunchCfg};

use super::{AdafactorHyper, AdafactorState, AdamHyper, AttnShape, Backend, DType, SgdHyper};

/// The backend's own device scratch: 64 KiB for per-block partial sums and the
/// two 256-entry quantisation maps of 8-bit AdamW.
pub const SCRATCH_BYTES: usize = 64 << 10;
/// Offset of the signed and unsigned quantisation maps in the scratch.
pub(crate) const QMAP_OFFSET: usize = SCRATCH_BYTES - 2 * 256 * 4;
/// Partial sums of a reduction: at most this many blocks, f64 each.
pub(crate) const PARTIALS: usize = 1024;

/// Allocation granularity of the caching allocator for small blocks
/// (PyTorch rounds them to 512 bytes too).
const ROUND: usize = 512;
/// Large blocks (1 MiB and up) round to 2 MiB, the granularity `cuMemAlloc`
/// maps large allocations with anyway, so the cache's sizes are what the
/// driver holds and a freed block serves any request in its 2 MiB class.
const LARGE: usize = 1 << 20;
const LARGE_ROUND: usize = 2 << 20;

/// The bytes the allocator takes from the driver for a request of `bytes`.
pub fn rounded(bytes: usize) -> usize {
    if bytes >= LARGE {
        bytes.div_ceil(LARGE_ROUND) * LARGE_ROUND
    } else {
        bytes.div_ceil(ROUND).max(1) * ROUND
    }
}

/// A device buffer: `len` elements of `dtype` at `ptr` (a device address;
/// for a host-mapped buffer, the device's address of the host pages).
#[derive(Debug)]
pub struct CudaBuf {
    pub(crate) ptr: DevPtr,
    pub(crate) len: usize,
    pub(crate) dtype: DType,
    /// Pinned, device-mapped host memory ([`Backend::alloc_host`]).
    pub(crate) host: bool,
}

impl CudaBuf {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Whether the buffer is host-mapped memory rather than device memory.
    pub fn is_host(&self) -> bool {
        self.host
    }
    fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }
    /// The kernel argument for this buffer's address.
    pub(crate) fn arg(&self) -> Arg {
        Arg::Ptr(self.ptr)
    }
    /// The kernel's code for a float element type (prelude.cuh's `DT_*`).
    pub(crate) fn dt(&self) -> Arg {
        Arg::I32(float_code(self.dtype))
    }
}

pub(crate) fn float_code(t: DType) -> i32 {
    match t {
        DType::F32 => 0,
        DType::Bf16 => 1,
        DType::F16 => 2,
        other => panic!("a float op on a {other:?} buffer"),
    }
}

/// `n` as a kernel's `long long` argument.
pub(crate) fn n64(n: usize) -> Arg {
    Arg::I64(n as i64)
}

/// The cuda backend over a driver.
pub struct CudaBackend<D: Driver> {
    pub(crate) drv: D,
    cache: HashMap<usize, Vec<DevPtr>>,
    cached_bytes: usize,
    /// Freed host-mapped blocks, by rounded size: apart from `cache`, since
    /// they are no room on the device.
    host_cache: HashMap<usize, Vec<DevPtr>>,
    host_cached_bytes: usize,
    pub(crate) scratch: DevPtr,
}

impl<D: Driver> CudaBackend<D> {
    pub fn new(mut drv: D) -> Result<Self, String> {
        let scratch = drv.alloc(SCRATCH_BYTES).ok_or_else(|| {
            format!(
                "{}: no room for the backend's {SCRATCH_BYTES}-byte scratch",
                drv.describe()
            )
        })?;
        drv.zero(scratch, SCRATCH_BYTES);
        let mut maps = Vec::with_capacity(2 * 256 * 4);
        for v in crate::backend::cpu::optim::signed_map()
            .iter()
            .chain(crate::backend::cpu::optim::unsigned_map())
        {
            maps.extend_from_slice(&v.to_le_bytes());
        }
        drv.upload(scratch + QMAP_OFFSET as u64, &maps);
        Ok(CudaBackend {
            drv,
            cache: HashMap::new(),
            cached_bytes: 0,
            host_cache: HashMap::new(),
            host_cached_bytes: 0,
            scratch,
        })
    }

    pub fn driver(&self) -> &D {
        &self.drv
    }

    /// Device memory that is not the engine's: the driver's context, modules
    /// and handles, plus this backend's scratch.
    pub fn overhead_bytes(&self) -> u64 {
        self.drv.overhead_bytes() + SCRATCH_BYTES as u64
    }

    /// Device bytes parked in the caching allocator's free lists.
    pub fn cached_bytes(&self) -> usize {
        self.cached_bytes
    }

    /// Host-mapped bytes parked in the host cache's free lists.
    pub fn host_cached_bytes(&self) -> usize {
        self.host_cached_bytes
    }

    /// Returns every cached block, device and host-mapped, to the driver.
    pub fn empty_cache(&mut self) {
        self.empty_device_cache();
        for (bytes, ptrs) in self.host_cache.drain() {
            for p in ptrs {
                self.drv.free_host(p, bytes);
            }
        }
        self.host_cached_bytes = 0;
    }

    fn empty_device_cache(&mut self) {
        for (bytes, ptrs) in self.cache.drain() {
            for p in ptrs {
                self.drv.free(p, bytes);
            }
        }
        self.cached_bytes = 0;
    }

    pub(crate) fn launch(&mut self, name: &str, cfg: LaunchCfg, args: &[Arg]) {
        self.drv.launch(Kernel::named(name), cfg, args);
    }

    /// Downloads `n` f64 partial sums from the scratch and adds them in order.
    pub(crate) fn sum_partials(&mut self, n: usize) -> f64 {
        let mut raw = vec![0u8; n * 8];
        self.drv.download(self.scratch, &mut raw);
        raw.chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .sum()
    }

    fn raw_alloc(&mut self, bytes: usize) -> DevPtr {
        let rounded = rounded(bytes);
        if let Some(p) = self.cache.get_mut(&rounded).and_then(Vec::pop) {
            self.cached_bytes -= rounded;
            return p;
        }
        if let Some(p) = self.drv.alloc(rounded) {
            return p;
        }
        // Out of memory with blocks parked: give them back and retry once.
        self.empty_device_cache();
        self.drv.alloc(rounded).unwrap_or_else(|| {
            panic!(
                "cuda out of memory: could not allocate {} on {}",
                crate::units::fmt_bytes(rounded as u64),
                self.drv.describe()
            )
        })
    }

    fn raw_alloc_host(&mut self, bytes: usize) -> DevPtr {
        let rounded = rounded(bytes);
        if let Some(p) = self.host_cache.get_mut(&rounded).and_then(Vec::pop) {
            self.host_cached_bytes -= rounded;
            return p;
        }
        if let Some(p) = self.drv.alloc_host(rounded) {
            return p;
        }
        for (bytes, ptrs) in std::mem::take(&mut self.host_cache) {
            for p in ptrs {
                self.drv.free_host(p, bytes);
            }
        }
        self.host_cached_bytes = 0;
        self.drv.alloc_host(rounded).unwrap_or_else(|| {
            panic!(
                "cuda: could not allocate {} of pinned, device-mapped host memory for {}",
                crate::units::fmt_bytes(rounded as u64),
                self.drv.describe()
            )
        })
    }
}

impl<D: Driver> CudaBackend<D> {
    /// `swiglu_backward_kernel` writing into `dgu` (a buffer's pointer and
    /// dtype code: `gu`'s own for the in-place backward).
    fn launch_swiglu_backward(
        &mut self,
        dgu: [Arg; 2],
        dout: &CudaBuf,
        gu: &CudaBuf,
        n: usize,
        i: usize,
    ) {
        let [d, d_dt] = dgu;
        self.launch(
            "swiglu_backward_kernel",
            LaunchCfg::elementwise(n * i),
            &[
                d,
                d_dt,
                dout.arg(),
                dout.dt(),
                gu.arg(),
                gu.dt(),
                n64(n),
                n64(i),
            ],
        );
    }
}

impl<D: Driver> Drop for CudaBackend<D> {
    fn drop(&mut self) {
        self.empty_cache();
        self.drv.free(self.scratch, SCRATCH_BYTES);
    }
}

/// Either GPU: real, or emulated (for tests, with [`EMULATE_ENV`] set).
pub enum AnyDriver {
    Real(real::CudaDriver),
    Emu(emu::EmuDriver),
}

macro_rules! each {
    ($s:expr, $d:ident => $e:expr) => {
        match $s {
            AnyDriver::Real($d) => $e,
            AnyDriver::Emu($d) => $e,
        }
    };
}

impl Driver for AnyDriver {
    fn describe(&self) -> String {
        each!(self, d => d.describe())
    }
    fn gpu_name(&self) -> String {
        each!(self, d => d.gpu_name())
    }
    fn total_bytes(&self) -> u64 {
        each!(self, d => d.total_bytes())
    }
    fn overhead_bytes(&self) -> u64 {
        each!(self, d => d.overhead_bytes())
    }
    fn alloc(&mut self, bytes: usize) -> Option<DevPtr> {
        each!(self, d => d.alloc(bytes))
    }
    fn free(&mut self, ptr: DevPtr, bytes: usize) {
        each!(self, d => d.free(ptr, bytes))
    }
    fn alloc_host(&mut self, bytes: usize) -> Option<DevPtr> {
        each!(self, d => d.alloc_host(bytes))
    }
    fn free_host(&mut self, ptr: DevPtr, bytes: usize) {
        each!(self, d => d.free_host(ptr, bytes))
    }
    fn upload(&mut self, dst: DevPtr, src: &[u8]) {
        each!(self, d => d.upload(dst, src))
    }
    fn download(&self, src: DevPtr, dst: &mut [u8]) {
        each!(self, d => d.download(src, dst))
    }
    fn zero(&mut self, dst: DevPtr, bytes: usize) {
        each!(self, d => d.zero(dst, bytes))
    }
    fn launch(&mut self, k: Kernel, cfg: LaunchCfg, args: &[Arg]) {
        each!(self, d => d.launch(k, cfg, args))
    }
    fn gemm(&mut self, g: &driver::Gemm) {
        each!(self, d => d.gemm(g))
    }
    fn synchronize(&mut self) {
        each!(self, d => d.synchronize())
    }
    fn stager(&self) -> std::sync::Arc<dyn comm::Stager> {
        each!(self, d => d.stager())
    }
}

/// With this variable set (to a capacity such as `2GiB`, or `1` for 4 GiB),
/// `--device cuda` runs on the emulated GPU instead: the whole cuda path,
/// kernels included, on a machine without one. For tests; it is slow.
pub const EMULATE_ENV: &str = "MEMFIT_CUDA_EMULATE";

/// The cuda backend on device `ordinal` (or the emulated GPU, see
/// [`EMULATE_ENV`]); every failure is a one-line reason.
pub fn open(ordinal: usize, threads: usize) -> Result<CudaBackend<AnyDriver>, String> {
    let drv = match std::env::var(EMULATE_ENV) {
        Ok(v) if !v.is_empty() => {
            let cap = if v == "1" {
                4 << 30
            } else {
                crate::units::parse_bytes(&v).map_err(|e| format!("{EMULATE_ENV}={v}: {e}"))?
            };
            AnyDriver::Emu(emu::EmuDriver::new(cap, threads))
        }
        _ => AnyDriver::Real(real::CudaDriver::open(ordinal)?),
    };
    CudaBackend::new(drv)
}

/// Bytes of attention scratch the cuda backend declares for shape `s`; a pure
/// function of the shape (and the activations' type), so the meta backend
/// predicts it exactly. See `attention.rs`.
pub fn workspace_bytes(s: AttnShape, fused: bool, dtype: DType) -> usize {
    attention::workspace_bytes(s, fused, dtype)
}

impl<D: Driver> Backend for CudaBackend<D> {
    type Buf = CudaBuf;

    fn is_gpu(&self) -> bool {
        true
    }
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn alloc(&mut self, len: usize, dtype: DType) -> CudaBuf {
        let bytes = len * dtype.size();
        let ptr = self.raw_alloc(bytes);
        self.drv.zero(ptr, bytes);
        CudaBuf {
            ptr,
            len,
            dtype,
            host: false,
        }
    }

    fn free(&mut self, buf: CudaBuf) {
        let rounded = rounded(buf.bytes());
        if buf.host {
            self.host_cache.entry(rounded).or_default().push(buf.ptr);
            self.host_cached_bytes += rounded;
        } else {
            self.cache.entry(rounded).or_default().push(buf.ptr);
            self.cached_bytes += rounded;
        }
    }

    /// Pinned host memory the kernels address directly over PCIe (see the
    /// module's documentation): not device memory, so it neither takes the
    /// device's room nor enters the device blocks' cache.
    fn alloc_host(&mut self, len: usize, dtype: DType) -> CudaBuf {
        let bytes = len * dtype.size();
        let ptr = self.raw_alloc_host(bytes);
        self.drv.zero(ptr, bytes);
        CudaBuf {
            ptr,
            len,
            dtype,
            host: true,
        }
    }

    fn offloads(&self) -> bool {
        true
    }

    fn workspace_bytes(&self, s: AttnShape, fused: bool, dtype: DType) -> usize {
        workspace_bytes(s, fused, dtype)
    }

    fn synchronize(&mut self) {
        self.drv.synchronize();
    }

    fn upload_f32(&mut self, dst: &mut CudaBuf, src: &[f32]) {
        assert!(
            src.len() <= dst.len,
            "upload of {} f32 into a buffer of {}",
            src.len(),
            dst.len
        );
        let bytes: Vec<u8> = match dst.dtype {
            DType::F32 => src.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::Bf16 => src
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
            DType::F16 => src
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
            other => panic!("upload_f32 into a {other:?} buffer"),
        };
        self.drv.upload(dst.ptr, &bytes);
    }

    fn upload_u32(&mut self, dst: &mut CudaBuf, src: &[u32]) {
        assert_eq!(
            dst.dtype,
            DType::U32,
            "upload_u32 into a {:?} buffer",
            dst.dtype
        );
        assert!(
            src.len() <= dst.len,
            "upload of {} u32 into a buffer of {}",
            src.len(),
            dst.len
        );
        let bytes: Vec<u8> = src.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.drv.upload(dst.ptr, &bytes);
    }

    fn reads_nf4(&self) -> bool {
        true
    }

    fn upload_u8(&mut self, dst: &mut CudaBuf, src: &[u8]) {
        assert_eq!(
            dst.dtype,
            DType::U8,
            "upload_u8 into a {:?} buffer",
            dst.dtype
        );
        assert!(
            src.len() <= dst.len,
            "upload of {} bytes into a buffer of {}",
            src.len(),
            dst.len
        );
        self.drv.upload(dst.ptr, src);
    }

    fn nf4_dequantize(&mut self, out: &mut CudaBuf, src: &CudaBuf, numel: usize) {
        nf4::dequantize(self, out, src, numel)
    }

    fn convert(&mut self, dst: &mut CudaBuf, src: &CudaBuf, n: usize) {
        self.copy_slice(dst, 0, src, 0, n, false);
    }

    fn copy_slice(
        &mut self,
        dst: &mut CudaBuf,
        dst_off: usize,
        src: &CudaBuf,
        src_off: usize,
        n: usize,
        accumulate: bool,
    ) {
        if n == 0 {
            return;
        }
        assert!(
            dst_off + n <= dst.len && src_off + n <= src.len,
            "copy_slice out of bounds"
        );
        self.launch(
            "copy_slice_kernel",
            LaunchCfg::elementwise(n),
            &[
                dst.arg(),
                dst.dt(),
                n64(dst_off),
                src.arg(),
                src.dt(),
                n64(src_off),
                n64(n),
                Arg::I32(accumulate as i32),
            ],
        );
    }

    fn download_f32(&self, src: &CudaBuf) -> Option<Vec<f32>> {
        let mut raw = vec![0u8; src.bytes()];
        self.drv.download(src.ptr, &mut raw);
        Some(match src.dtype {
            DType::F32 => raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            DType::Bf16 => raw
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f32())
                .collect(),
            DType::F16 => raw
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f32())
                .collect(),
            DType::U32 => raw
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().unwrap()) as f32)
                .collect(),
            DType::U8 => raw.iter().map(|&b| b as f32).collect(),
        })
    }

    fn fill(&mut self, buf: &mut CudaBuf, value: f32) {
        if buf.len == 0 {
            return;
        }
        self.launch(
            "fill_kernel",
            LaunchCfg::elementwise(buf.len),
            &[buf.arg(), buf.dt(), n64(buf.len), Arg::F32(value)],
        );
    }

    fn embed_forward_rows(
        &mut self,
        out: &mut CudaBuf,
        tokens: &CudaBuf,
        wte: &CudaBuf,
        wpe: Option<&CudaBuf>,
        n: usize,
        t: usize,
        c: usize,
        part: Option<usize>,
    ) {
        norm::embed_forward(self, out, tokens, wte, wpe, n, t, c, part)
    }

    fn embed_backward_rows(
        &mut self,
        dwte: &mut CudaBuf,
        dwpe: Option<&mut CudaBuf>,
        dout: &CudaBuf,
        tokens: &CudaBuf,
        n: usize,
        t: usize,
        c: usize,
        part: Option<usize>,
    ) {
        norm::embed_backward(self, dwte, dwpe, dout, tokens, n, t, c, part.unwrap_or(0))
    }

    fn layernorm_forward(
        &mut self,
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
        norm::layernorm_forward(self, out, mean, rstd, inp, w, b, n, c, eps)
    }

    fn layernorm_backward(
        &mut self,
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
        norm::layernorm_backward(self, dinp, dw, db, dout, inp, w, mean, rstd, n, c)
    }

    fn rmsnorm_forward(
        &mut self,
        out: &mut CudaBuf,
        rstd: &mut CudaBuf,
        inp: &CudaBuf,
        w: &CudaBuf,
        n: usize,
        c: usize,
        eps: f32,
    ) {
        norm::rmsnorm_forward(self, out, rstd, inp, w, n, c, eps)
    }

    fn rmsnorm_backward(
        &mut self,
        dinp: &mut CudaBuf,
        dw: &mut CudaBuf,
        dout: &CudaBuf,
        inp: &CudaBuf,
        w: &CudaBuf,
        rstd: &CudaBuf,
        n: usize,
        c: usize,
    ) {
        norm::rmsnorm_backward(self, dinp, dw, dout, inp, w, rstd, n, c)
    }

    fn matmul_forward(
        &mut self,
        out: &mut CudaBuf,
        inp: &CudaBuf,
        w: &CudaBuf,
        bias: Option<&CudaBuf>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        matmul::forward(self, out, inp, w, bias, n, c, oc)
    }

    fn matmul_backward(
        &mut self,
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
        matmul::backward(self, dinp, dw, dbias, dout, inp, w, n, c, oc)
    }

    fn gelu_forward(&mut self, out: &mut CudaBuf, inp: &CudaBuf, n: usize) {
        if n == 0 {
            return;
        }
        self.launch(
            "gelu_forward_kernel",
            LaunchCfg::elementwise(n),
            &[out.arg(), out.dt(), inp.arg(), inp.dt(), n64(n)],
        );
    }

    fn gelu_backward(&mut self, dout: &mut CudaBuf, inp: &CudaBuf, n: usize) {
        if n == 0 {
            return;
        }
        self.launch(
            "gelu_backward_kernel",
            LaunchCfg::elementwise(n),
            &[dout.arg(), dout.dt(), inp.arg(), inp.dt(), n64(n)],
        );
    }

    fn swiglu_forward(&mut self, out: &mut CudaBuf, gu: &CudaBuf, n: usize, i: usize) {
        if n * i == 0 {
            return;
        }
        self.launch(
            "swiglu_forward_kernel",
            LaunchCfg::elementwise(n * i),
            &[out.arg(), out.dt(), gu.arg(), gu.dt(), n64(n), n64(i)],
        );
    }

    fn swiglu_backward_in_place(&mut self, gu: &mut CudaBuf, dout: &CudaBuf, n: usize, i: usize) {
        if n * i == 0 {
            return;
        }
        // swiglu_backward_kernel reads an element's gate and up before it
        // writes their gradients there, so dgu may be gu itself.
        self.launch_swiglu_backward([gu.arg(), gu.dt()], dout, gu, n, i);
    }

    fn swiglu_backward(
        &mut self,
        dgu: &mut CudaBuf,
        dout: &CudaBuf,
        gu: &CudaBuf,
        n: usize,
        i: usize,
    ) {
        if n * i == 0 {
            return;
        }
        self.launch_swiglu_backward([dgu.arg(), dgu.dt()], dout, gu, n, i);
    }

    fn add(&mut self, out: &mut CudaBuf, a: &CudaBuf, b: &CudaBuf, n: usize) {
        if n == 0 {
            return;
        }
        self.launch(
            "add_kernel",
            LaunchCfg::elementwise(n),
            &[
                out.arg(),
                out.dt(),
                a.arg(),
                a.dt(),
                b.arg(),
                b.dt(),
                n64(n),
            ],
        );
    }

    fn rope_forward(&mut self, qkv: &mut CudaBuf, s: AttnShape, theta: f32) {
        norm::rope(self, qkv, s, theta, 1.0)
    }

    fn rope_backward(&mut self, dqkv: &mut CudaBuf, s: AttnShape, theta: f32) {
        norm::rope(self, dqkv, s, theta, -1.0)
    }

    fn attention_forward(
        &mut self,
        out: &mut CudaBuf,
        att: &mut CudaBuf,
        qkv: &CudaBuf,
        s: AttnShape,
    ) {
        attention::eager_forward(self, out, att, qkv, s)
    }

    fn attention_backward(
        &mut self,
        dqkv: &mut CudaBuf,
        datt: &mut CudaBuf,
        dout: &CudaBuf,
        qkv: &CudaBuf,
        att: &CudaBuf,
        s: AttnShape,
    ) {
        attention::eager_backward(self, dqkv, datt, dout, qkv, att, s)
    }

    fn flash_attention_forward(
        &mut self,
        out: &mut CudaBuf,
        lse: &mut CudaBuf,
        qkv: &CudaBuf,
        ws: &mut CudaBuf,
        s: AttnShape,
    ) {
        attention::flash_forward(self, out, lse, qkv, ws, s)
    }

    fn flash_attention_backward(
        &mut self,
        dqkv: &mut CudaBuf,
        dout: &CudaBuf,
        out: &CudaBuf,
        lse: &CudaBuf,
        qkv: &CudaBuf,
        ws: &mut CudaBuf,
        s: AttnShape,
    ) {
        attention::flash_backward(self, dqkv, dout, out, lse, qkv, ws, s)
    }

    fn crossentropy_forward(
        &mut self,
        losses: &mut CudaBuf,
        logits: &CudaBuf,
        targets: &CudaBuf,
        n: usize,
        v: usize,
        vp: usize,
    ) {
        norm::crossentropy_forward(self, losses, logits, targets, n, v, vp)
    }

    fn crossentropy_backward(
        &mut self,
        logits: &mut CudaBuf,
        targets: &CudaBuf,
        dloss: f32,
        n: usize,
        v: usize,
        vp: usize,
    ) {
        norm::crossentropy_backward(self, logits, targets, dloss, n, v, vp)
    }

    fn crossentropy_part_stats(
        &mut self,
        stats: &mut CudaBuf,
        tgt: &mut CudaBuf,
        logits: &CudaBuf,
        targets: &CudaBuf,
        n: usize,
        lo: usize,
        v: usize,
        vp: usize,
    ) {
        norm::crossentropy_part_stats(self, stats, tgt, logits, targets, n, lo, v, vp)
    }

    fn crossentropy_combine(
        &mut self,
        losses: &mut CudaBuf,
        lse: &mut CudaBuf,
        stats: &CudaBuf,
        tgt: &CudaBuf,
        n: usize,
        parts: usize,
    ) {
        norm::crossentropy_combine(self, losses, lse, stats, tgt, n, parts)
    }

    fn crossentropy_part_backward(
        &mut self,
        logits: &mut CudaBuf,
        lse: &CudaBuf,
        targets: &CudaBuf,
        dloss: f32,
        n: usize,
        lo: usize,
        v: usize,
        vp: usize,
    ) {
        norm::crossentropy_part_backward(self, logits, lse, targets, dloss, n, lo, v, vp)
    }

    fn sum_squares(&mut self, buf: &CudaBuf, n: usize) -> Option<f64> {
        Some(norm::sum_squares(self, buf, n))
    }

    fn adamw_update(
        &mut self,
        param: &mut CudaBuf,
        grad: &CudaBuf,
        m: &mut CudaBuf,
        v: &mut CudaBuf,
        n: usize,
        h: AdamHyper,
    ) {
        optim::adamw(self, param, grad, m, v, n, h)
    }

    fn adamw8bit_update(
        &mut self,
        param: &mut CudaBuf,
        grad: &CudaBuf,
        m: &mut CudaBuf,
        v: &mut CudaBuf,
        m_absmax: &mut CudaBuf,
        v_absmax: &mut CudaBuf,
        n: usize,
        h: AdamHyper,
    ) {
        optim::adamw8bit(self, param, grad, m, v, m_absmax, v_absmax, n, h)
    }

    fn sgd_update(
        &mut self,
        param: &mut CudaBuf,
        grad: &CudaBuf,
        momentum_buf: &mut CudaBuf,
        n: usize,
        h: SgdHyper,
    ) {
        optim::sgd(self, param, grad, momentum_buf, n, h)
    }

    fn adafactor_update(
        &mut self,
        param: &mut CudaBuf,
        grad: &CudaBuf,
        st: AdafactorState<'_, CudaBuf>,
        h: AdafactorHyper,
    ) {
        optim::adafactor(self, param, grad, st, h)
    }
}

#[cfg(test)]
mod tests {
    use super::driver::{ArgKind, Gemm};
    use super::emu::EmuDriver;
    use super::*;

    fn emu(capacity: u64) -> CudaBackend<EmuDriver> {
        CudaBackend::new(EmuDriver::new(capacity, 2)).unwrap()
    }

    #[test]
    fn the_caching_allocator_reuses_rounded_blocks_zeroed() {
        let mut be = emu(1 << 20);
        let mut a = be.alloc(100, DType::F32);
        be.fill(&mut a, 3.0);
        let ptr = a.ptr;
        be.free(a);
        assert_eq!(be.cached_bytes(), 512);
        // 120 f32 round to the same 512 bytes: the same block, zeroed again.
        let b = be.alloc(120, DType::F32);
        assert_eq!(b.ptr, ptr);
        assert_eq!(be.cached_bytes(), 0);
        assert!(be.download_f32(&b).unwrap().iter().all(|&v| v == 0.0));
        // A different size is a new block.
        let c = be.alloc(200, DType::Bf16);
        assert_ne!(c.ptr, b.ptr);
        be.free(b);
        be.free(c);
        be.empty_cache();
        assert_eq!(be.cached_bytes(), 0);
    }

    /// Offload's buffers: host-mapped memory outside the device's room and
    /// its block cache, which uploads, downloads, kernels (copies and
    /// conversions both ways, accumulating too) and fills address as they
    /// address device buffers, in every dtype.
    #[test]
    fn host_mapped_buffers_stay_off_the_device_and_copy_both_ways() {
        // 64 KiB of the 192 KiB device is the scratch: 1 MiB of host buffers
        // fits only because it is not device memory.
        let mut be = emu(192 << 10);
        let live = be.drv.live_bytes();
        let big = be.alloc_host(1 << 18, DType::F32);
        assert!(big.is_host());
        assert_eq!(be.drv.live_bytes(), live);
        assert_eq!(be.drv.host_live_bytes(), 2 << 20);
        be.free(big);
        assert_eq!((be.cached_bytes(), be.host_cached_bytes()), (0, 2 << 20));

        let n = 100;
        let vals: Vec<f32> = (0..n).map(|i| (i as f32 - 40.0) * 0.25).collect();
        let floats = [DType::F32, DType::Bf16, DType::F16];
        for &ht in &floats {
            for &dt in &floats {
                let mut h = be.alloc_host(n, ht);
                assert!(h.is_host());
                assert!(be.download_f32(&h).unwrap().iter().all(|&v| v == 0.0));
                be.upload_f32(&mut h, &vals);
                assert_eq!(be.download_f32(&h).unwrap(), vals, "{ht:?}");
                // host -> device, converting, then device -> host accumulating.
                let mut d = be.alloc(n, dt);
                assert!(!d.is_host());
                be.convert(&mut d, &h, n);
                assert_eq!(be.download_f32(&d).unwrap(), vals, "{ht:?} -> {dt:?}");
                be.copy_slice(&mut h, 10, &d, 0, n - 10, true);
                let want: Vec<f32> = (0..n)
                    .map(|i| {
                        if i < 10 {
                            vals[i]
                        } else {
                            vals[i] + vals[i - 10]
                        }
                    })
                    .collect();
                assert_eq!(be.download_f32(&h).unwrap(), want, "{dt:?} += {ht:?}");
                // A kernel writing host memory.
                be.fill(&mut h, 1.5);
                assert!(be.download_f32(&h).unwrap().iter().all(|&v| v == 1.5));
                be.free(d);
                be.free(h);
            }
        }
        let mut t = be.alloc_host(7, DType::U32);
        be.upload_u32(&mut t, &[1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(
            be.download_f32(&t).unwrap(),
            vec![1., 2., 3., 4., 5., 6., 7.]
        );
        let mut b = be.alloc_host(5, DType::U8);
        be.upload_u8(&mut b, &[9, 8, 7, 6, 255]);
        assert_eq!(be.download_f32(&b).unwrap(), vec![9., 8., 7., 6., 255.]);

        // A freed host block is reused for its size, zeroed; the device
        // cache never sees it.
        let ptr = t.ptr;
        be.free(t);
        let again = be.alloc_host(7, DType::U32);
        assert_eq!(again.ptr, ptr);
        assert!(be.download_f32(&again).unwrap().iter().all(|&v| v == 0.0));
        be.free(again);
        be.free(b);
        assert_eq!(be.drv.live_bytes(), live + be.cached_bytes() as u64);
        be.empty_cache();
        assert_eq!(be.host_cached_bytes(), 0);
        assert_eq!(be.drv.host_live_bytes(), 0);
        assert!(be.offloads());
    }

    #[test]
    fn blocks_round_to_512_bytes_and_large_ones_to_2_mib() {
        assert_eq!(rounded(0), 512);
        assert_eq!(rounded(100), 512);
        assert_eq!(rounded(513), 1024);
        assert_eq!(rounded((1 << 20) - 1), 1 << 20);
        assert_eq!(rounded(1 << 20), 2 << 20);
        assert_eq!(rounded((2 << 20) + 1), 4 << 20);
    }

    #[test]
    fn out_of_memory_returns_the_cache_before_giving_up() {
        // 64 KiB scratch + 2 x 128 KiB fit in 330 KiB, a third block does not
        // until the cached one is returned.
        let mut be = emu(330 << 10);
        let a = be.alloc(32 << 10, DType::F32);
        let b = be.alloc(32 << 10, DType::F32);
        be.free(a);
        let c = be.alloc(30 << 10, DType::F32); // another size: the cache is emptied, then it fits
        assert_eq!(be.cached_bytes(), 0);
        be.free(b);
        be.free(c);
    }

    #[test]
    #[should_panic(expected = "cuda out of memory")]
    fn out_of_memory_past_the_cache_is_a_clear_panic() {
        let mut be = emu(128 << 10);
        let _a = be.alloc(64 << 10, DType::F32);
    }

    #[test]
    fn launches_are_checked_against_the_kernel_signature() {
        let k = Kernel::named("fill_kernel");
        assert_eq!(
            k.sig().args,
            &[ArgKind::Ptr, ArgKind::I32, ArgKind::I64, ArgKind::F32]
        );
        let bad = std::panic::catch_unwind(|| {
            driver::check_args(k, &[Arg::Ptr(0), Arg::I64(0), Arg::I64(1), Arg::F32(0.0)])
        });
        assert!(bad.is_err());
        assert!(std::panic::catch_unwind(|| Kernel::named("no_such_kernel")).is_err());
    }

    #[test]
    fn launch_configuration() {
        assert_eq!(LaunchCfg::elementwise(1).grid, [1, 1, 1]);
        assert_eq!(LaunchCfg::elementwise(257).grid, [2, 1, 1]);
        assert_eq!(
            LaunchCfg::elementwise(1 << 30).grid[0],
            driver::MAX_STRIDE_BLOCKS
        );
        assert_eq!(LaunchCfg::elementwise(5).block, [256, 1, 1]);
        assert_eq!(float_code(DType::Bf16), 1);
        assert!(std::panic::catch_unwind(|| float_code(DType::U8)).is_err());
    }

    /// Launches a GPU would refuse fail in the emulator too.
    #[test]
    fn the_emulator_enforces_launch_limits() {
        let mut be = emu(1 << 20);
        let buf = be.alloc(4, DType::F32);
        let args = [buf.arg(), buf.dt(), n64(4), Arg::F32(1.0)];
        for (cfg, want) in [
            (LaunchCfg::linear(1, 2048), "threads a block"),
            (
                LaunchCfg::linear(1, 32).with_shared(64 << 10),
                "dynamic shared memory",
            ),
            (
                LaunchCfg {
                    grid: [1, 70_000, 1],
                    block: [32, 1, 1],
                    shared_bytes: 0,
                },
                "at most 65535",
            ),
        ] {
            let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                be.launch("fill_kernel", cfg, &args)
            }))
            .unwrap_err();
            let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(msg.contains(want), "{msg}");
        }
    }

    /// The emulator's warp shuffles and barriers behave as CUDA's.
    #[test]
    fn emulated_warp_primitives_and_barriers() {
        let mut be = emu(1 << 20);
        let threads = 96u32;
        let out = be.alloc(3 * threads as usize, DType::U32);
        let total = be.alloc(2, DType::U32);
        be.launch(
            "selfcheck_warp_kernel",
            LaunchCfg::linear(2, threads),
            &[out.arg(), total.arg()],
        );
        let got = be.download_f32(&out).unwrap();
        for t in 0..threads as usize {
            let lane = t % 32;
            let down = if lane + 3 < 32 { lane + 3 } else { lane };
            assert_eq!(
                [got[3 * t], got[3 * t + 1], got[3 * t + 2]],
                [(lane ^ 1) as f32, down as f32, 5.0],
                "thread {t}"
            );
        }
        let sum = (0..threads).sum::<u32>() as f32;
        assert_eq!(be.download_f32(&total).unwrap(), vec![sum, sum]);

        let flag = be.alloc(64, DType::U32);
        let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            be.launch(
                "selfcheck_barrier_kernel",
                LaunchCfg::linear(1, 64),
                &[flag.arg(), Arg::I32(5)],
            )
        }))
        .unwrap_err();
        let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(
            msg.contains("never reach") || msg.contains("deadlock"),
            "{msg}"
        );
    }

    /// The reference GEMM follows cuBLAS's column-major conventions:
    /// `C (2x2) = A^T (2x3) B (3x2)` with A stored column-major 3x2.
    #[test]
    fn the_emulated_gemm_is_column_major() {
        let mut be = emu(1 << 20);
        let a = check::up(&mut be, &[1., 2., 3., 4., 5., 6.], DType::F32); // A (3x2): cols [1,2,3], [4,5,6]
        let b = check::up(&mut be, &[1., 0., 1., 0., 1., 0.], DType::F32); // B (3x2): cols [1,0,1], [0,1,0]
        let c = check::up(&mut be, &[10., 10., 10., 10.], DType::F32);
        be.drv.gemm(&Gemm {
            transa: true,
            transb: false,
            m: 2,
            n: 2,
            k: 3,
            alpha: 1.0,
            a: a.ptr,
            lda: 3,
            stride_a: 0,
            b: b.ptr,
            ldb: 3,
            stride_b: 0,
            ab_type: DType::F32,
            beta: 1.0,
            c: c.ptr,
            ldc: 2,
            stride_c: 0,
            c_type: DType::F32,
            batch: 1,
        });
        // C(i,j) = sum_p A(p,i) B(p,j) + 10: [[1+3, 2], [4+6, 5]] + 10, column-major.
        assert_eq!(be.download_f32(&c).unwrap(), vec![14., 20., 12., 15.]);
    }
}
