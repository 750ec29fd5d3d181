//! A real NVIDIA GPU through the CUDA driver API, NVRTC and cuBLAS (cudarc,
//! loaded dynamically, so the same binary runs on machines without CUDA).
//!
//! Start-up: check that libcuda can be loaded (cudarc panics otherwise),
//! retain the device's primary context, compile the kernel program with
//! NVRTC for the device's compute capability, load it, create a stream and a
//! cuBLAS handle with a fixed workspace of our own ([`CUBLAS_WORKSPACE`]), and
//! measure what all that left free: `total - free` is the overhead the plan
//! adds for this GPU (context, module, handles, and whatever other processes
//! hold on the device).

use std::ffi::{CString, c_void};

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{result as cu, sys as cu_sys};

use super::driver::{Arg, DevPtr, Driver, Gemm, KERNELS, Kernel, LaunchCfg, check_args};
use crate::backend::DType;

/// cuBLAS workspace we give the handle: NVIDIA recommends 32 MiB on Hopper
/// (cuBLAS documentation, `cublasSetWorkspace`); also plenty for Ampere.
pub const CUBLAS_WORKSPACE: usize = 32 << 20;

/// Whether libcuda can be loaded; cudarc panics on first use otherwise.
pub fn driver_present() -> bool {
    // SAFETY: only attempts to dlopen the library.
    unsafe { cu_sys::is_culib_present() }
}

pub struct CudaDriver {
    ordinal: usize,
    name: String,
    cc: (i32, i32),
    sms: i32,
    dev: cu_sys::CUdevice,
    ctx: cu_sys::CUcontext,
    stream: cu_sys::CUstream,
    module: cu_sys::CUmodule,
    funcs: Vec<cu_sys::CUfunction>,
    blas: blas_sys::cublasHandle_t,
    blas_ws: DevPtr,
    total: u64,
    overhead: u64,
    /// Host-mapped allocations: device address to host address and bytes
    /// (the addresses are the same under unified addressing; kept apart so
    /// that nothing assumes it).
    host_maps: std::collections::BTreeMap<DevPtr, (usize, usize)>,
}

// SAFETY: the handles are plain driver handles; every call makes the context
// current on the calling thread first (`bind`), and the driver is used by one
// thread at a time (`&mut self`).
unsafe impl Send for CudaDriver {}

fn err(what: &str, e: impl std::fmt::Debug) -> String {
    format!("cuda: {what} failed: {e:?}")
}

impl CudaDriver {
    /// Opens device `ordinal`. Every failure is a one-line reason.
    pub fn open(ordinal: usize) -> Result<Self, String> {
        if !driver_present() {
            return Err(
                "no CUDA driver on this machine (libcuda.so.1 could not be loaded): --device cuda needs an NVIDIA GPU with its driver (`memfit doctor` shows what was found); use --device cpu, or --device meta to predict".into(),
            );
        }
        cu::init().map_err(|e| err("cuInit", e))?;
        let count = cu::device::get_count().map_err(|e| err("counting devices", e))?;
        if ordinal >= count as usize {
            return Err(format!(
                "cuda:{ordinal}: this machine has {count} CUDA device(s) (cuda:0..cuda:{})",
                count.max(1) - 1
            ));
        }
        let dev = cu::device::get(ordinal as i32).map_err(|e| err("cuDeviceGet", e))?;
        // SAFETY: dev is a valid device handle.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }
            .map_err(|e| err("retaining the primary context", e))?;
        // SAFETY: ctx was just retained.
        unsafe { cu::ctx::set_current(ctx) }.map_err(|e| err("cuCtxSetCurrent", e))?;
        let name = cu::device::get_name(dev).unwrap_or_else(|_| "NVIDIA GPU".into());
        let attr = |a| {
            // SAFETY: dev is valid; a is a device attribute.
            unsafe { cu::device::get_attribute(dev, a) }.unwrap_or(0)
        };
        let cc = (
            attr(cu_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            attr(cu_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        );
        let sms = attr(cu_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
        if cc.0 < 8 {
            return Err(format!(
                "cuda:{ordinal} is {name} (sm_{}{}); memfit's kernels need sm_80 or newer (bf16)",
                cc.0, cc.1
            ));
        }
        // SAFETY: dev is valid.
        let total =
            unsafe { cu::device::total_mem(dev) }.map_err(|e| err("cuDeviceTotalMem", e))? as u64;

        // Machine code for this GPU where NVRTC knows it, so the driver
        // never JIT-compiles; PTX the driver accepts where it does not
        // (`nvrtc::choose_target`).
        let mut driver = 0;
        // SAFETY: writes one int.
        unsafe { cu_sys::cuDriverGetVersion(&mut driver) }
            .result()
            .map_err(|e| err("cuDriverGetVersion", e))?;
        let nvrtc_version =
            super::nvrtc::version().ok_or_else(|| super::libs::explain(super::libs::Lib::Nvrtc))?;
        let target = super::nvrtc::choose_target(
            cc.0 * 10 + cc.1,
            nvrtc_version,
            &super::nvrtc::supported_archs(),
            driver,
        )?;
        let image = super::nvrtc::compile_image(&target)?;
        // SAFETY: image is a complete CUBIN, or NUL-terminated PTX, that
        // NVRTC produced for this device.
        let module = unsafe { cu::module::load_data(image.as_ptr() as *const c_void) }
            .map_err(|e| err("loading the kernel module", e))?;
        let funcs = KERNELS
            .iter()
            .map(|k| {
                // SAFETY: module is loaded; names come from the same program.
                unsafe { cu::module::get_function(module, CString::new(k.name).unwrap()) }
                    .map_err(|e| err(&format!("finding kernel {}", k.name), e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(|e| err("creating a stream", e))?;

        // SAFETY: only attempts to dlopen the library.
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(format!(
                "cuda: cuBLAS could not be loaded: {}",
                super::libs::explain(super::libs::Lib::Cublas)
            ));
        }
        let handle = blas::create_handle().map_err(|e| err("cublasCreate", e))?;
        // SAFETY: handle and stream are live; the workspace is ours for the
        // handle's lifetime.
        let blas_ws = unsafe {
            blas::set_stream(handle, stream as blas_sys::cudaStream_t)
                .map_err(|e| err("cublasSetStream", e))?;
            let ws = cu::malloc_sync(CUBLAS_WORKSPACE)
                .map_err(|e| err("allocating the cuBLAS workspace", e))?;
            blas_sys::cublasSetWorkspace_v2(handle, ws as *mut c_void, CUBLAS_WORKSPACE)
                .result()
                .map_err(|e| err("cublasSetWorkspace", e))?;
            ws
        };
        let mut drv = CudaDriver {
            ordinal,
            name,
            cc,
            sms,
            dev,
            ctx,
            stream,
            module,
            funcs,
            blas: handle,
            blas_ws,
            total,
            overhead: 0,
            host_maps: std::collections::BTreeMap::new(),
        };
        // cuBLAS loads its kernels lazily (CUDA 12's lazy module loading):
        // run one tiny GEMM per type first, so the overhead measured below
        // holds them and later GEMMs add nothing the engine does not track.
        drv.warm_up()?;
        cu::ctx::synchronize().map_err(|e| err("synchronising", e))?;
        let (free, _) = cu::mem_get_info().map_err(|e| err("cuMemGetInfo", e))?;
        drv.overhead = total.saturating_sub(free as u64);
        Ok(drv)
    }

    /// One 16x16x16 GEMM in each type the engine uses.
    fn warm_up(&mut self) -> Result<(), String> {
        const N: usize = 16;
        let bytes = N * N * 4;
        let buf = self
            .alloc(3 * bytes)
            .ok_or_else(|| "cuda: no memory for the start-up GEMMs".to_string())?;
        self.zero(buf, 3 * bytes);
        for t in [DType::F32, DType::Bf16, DType::F16] {
            self.gemm(&Gemm {
                transa: false,
                transb: false,
                m: N,
                n: N,
                k: N,
                alpha: 1.0,
                a: buf,
                lda: N,
                stride_a: 0,
                b: buf + bytes as u64,
                ldb: N,
                stride_b: 0,
                ab_type: t,
                beta: 0.0,
                c: buf + 2 * bytes as u64,
                ldc: N,
                stride_c: 0,
                c_type: t,
                batch: 1,
            });
        }
        self.synchronize();
        self.free(buf, 3 * bytes);
        Ok(())
    }
}

impl CudaDriver {
    /// Compute capability, e.g. `(9, 0)`.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.cc
    }

    pub fn multiprocessors(&self) -> i32 {
        self.sms
    }

    fn bind(&self) {
        // SAFETY: ctx stays retained for our lifetime.
        unsafe { cu::ctx::set_current(self.ctx) }.expect("cuCtxSetCurrent");
    }

    /// The host address of `bytes` bytes at device address `ptr` when they
    /// lie in a host-mapped allocation ([`Driver::alloc_host`]).
    fn host_address(&self, ptr: DevPtr, bytes: usize) -> Option<usize> {
        let (&base, &(host, len)) = self.host_maps.range(..=ptr).next_back()?;
        let off = (ptr - base) as usize;
        (off + bytes <= len).then_some(host + off)
    }

    fn sync_or_die(&self, what: &str) {
        // SAFETY: stream is live.
        if let Err(e) = unsafe { cu::stream::synchronize(self.stream) } {
            panic!("cuda error after {what} on {}: {e:?}", self.name);
        }
    }
}

fn data_type(t: DType) -> blas_sys::cudaDataType {
    match t {
        DType::F32 => blas_sys::cudaDataType::CUDA_R_32F,
        DType::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
        DType::F16 => blas_sys::cudaDataType::CUDA_R_16F,
        other => panic!("gemm on {other:?}"),
    }
}

fn op(t: bool) -> blas_sys::cublasOperation_t {
    if t {
        blas_sys::cublasOperation_t::CUBLAS_OP_T
    } else {
        blas_sys::cublasOperation_t::CUBLAS_OP_N
    }
}

impl Driver for CudaDriver {
    fn describe(&self) -> String {
        format!(
            "{} (cuda:{}, sm_{}{}, {} SMs, {})",
            self.name,
            self.ordinal,
            self.cc.0,
            self.cc.1,
            self.sms,
            crate::units::fmt_bytes(self.total)
        )
    }
    fn gpu_name(&self) -> String {
        self.name.clone()
    }
    fn total_bytes(&self) -> u64 {
        self.total
    }
    fn overhead_bytes(&self) -> u64 {
        self.overhead
    }
    fn alloc(&mut self, bytes: usize) -> Option<DevPtr> {
        self.bind();
        // SAFETY: a plain allocation; contents are set by the caller.
        unsafe { cu::malloc_sync(bytes.max(1)) }.ok()
    }
    fn free(&mut self, ptr: DevPtr, _bytes: usize) {
        // Frees run in drops, also while a panic unwinds after a sticky GPU
        // fault, when every driver call fails: never panic here (a second
        // panic would abort the process instead of failing the run).
        // SAFETY: ptr came from alloc and is freed once; the context is
        // made current first, and cuMemFree waits for queued work.
        unsafe {
            let _ = cu::ctx::set_current(self.ctx);
            let _ = cu::stream::synchronize(self.stream);
            let _ = cu::free_sync(ptr);
        }
    }
    fn alloc_host(&mut self, bytes: usize) -> Option<DevPtr> {
        self.bind();
        let flags = cu_sys::CU_MEMHOSTALLOC_DEVICEMAP | cu_sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a plain pinned allocation, mapped into every context's
        // address space (PORTABLE, since the ranks' drivers share the device).
        let host = unsafe { cu::malloc_host(bytes.max(1), flags) }.ok()?;
        let mut dev: cu_sys::CUdeviceptr = 0;
        // SAFETY: host was just returned by cuMemHostAlloc with DEVICEMAP.
        let r = unsafe { cu_sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) }.result();
        if r.is_err() {
            // SAFETY: host came from malloc_host and is freed once.
            let _ = unsafe { cu::free_host(host) };
            return None;
        }
        // Fresh pages, no work queued on them: zero them from the host.
        // SAFETY: host holds `bytes` bytes.
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes) };
        self.host_maps.insert(dev, (host as usize, bytes));
        Some(dev)
    }
    fn free_host(&mut self, ptr: DevPtr, _bytes: usize) {
        // As `free`: never panic. Kernels queued on the stream may still
        // read or write the pages, so wait for them first.
        let Some((host, _)) = self.host_maps.remove(&ptr) else {
            return;
        };
        // SAFETY: host came from cuMemHostAlloc and is freed once.
        unsafe {
            let _ = cu::ctx::set_current(self.ctx);
            let _ = cu::stream::synchronize(self.stream);
            let _ = cu::free_host(host as *mut c_void);
        }
    }
    fn upload(&mut self, dst: DevPtr, src: &[u8]) {
        self.bind();
        if let Some(h) = self.host_address(dst, src.len()) {
            // Host-mapped: a plain memcpy once the queued kernels are done.
            self.sync_or_die("work before a host-mapped upload");
            // SAFETY: h..h+len lies inside a live host-mapped allocation.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), h as *mut u8, src.len()) };
            return;
        }
        // SAFETY: dst holds at least src.len() bytes; the sync keeps src alive
        // until the copy is done.
        unsafe { cu::memcpy_htod_async(dst, src, self.stream) }.expect("cuMemcpyHtoDAsync");
        self.sync_or_die("an upload");
    }
    fn download(&self, src: DevPtr, dst: &mut [u8]) {
        self.bind();
        if let Some(h) = self.host_address(src, dst.len()) {
            self.sync_or_die("work before a host-mapped download");
            // SAFETY: h..h+len lies inside a live host-mapped allocation.
            unsafe { std::ptr::copy_nonoverlapping(h as *const u8, dst.as_mut_ptr(), dst.len()) };
            return;
        }
        // SAFETY: src holds at least dst.len() bytes.
        unsafe { cu::memcpy_dtoh_async(dst, src, self.stream) }.expect("cuMemcpyDtoHAsync");
        self.sync_or_die("a download");
    }
    fn zero(&mut self, dst: DevPtr, bytes: usize) {
        self.bind();
        if let Some(h) = self.host_address(dst, bytes) {
            self.sync_or_die("work before zeroing host-mapped memory");
            // SAFETY: h..h+bytes lies inside a live host-mapped allocation.
            unsafe { std::ptr::write_bytes(h as *mut u8, 0, bytes) };
            return;
        }
        // SAFETY: dst holds `bytes` bytes.
        unsafe { cu::memset_d8_async(dst, 0, bytes, self.stream) }.expect("cuMemsetD8Async");
    }
    fn launch(&mut self, k: Kernel, cfg: LaunchCfg, args: &[Arg]) {
        check_args(k, args);
        self.bind();
        let mut slots: Vec<u64> = args.iter().map(|a| a.slot()).collect();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        // SAFETY: the parameters match the kernel's signature (checked); each
        // slot is 8 bytes holding a little-endian value of the parameter's
        // size at its start, which is how the driver reads it.
        let r = unsafe {
            cu::launch_kernel(
                self.funcs[k.0],
                (cfg.grid[0], cfg.grid[1], cfg.grid[2]),
                (cfg.block[0], cfg.block[1], cfg.block[2]),
                cfg.shared_bytes,
                self.stream,
                &mut params,
            )
        };
        if let Err(e) = r {
            panic!("cuda: launching {} {cfg:?} failed: {e:?}", k.sig().name);
        }
    }
    fn gemm(&mut self, g: &Gemm) {
        self.bind();
        let (alpha, beta) = (g.alpha, g.beta);
        let i = |x: usize| i32::try_from(x).expect("gemm dimension fits i32");
        // SAFETY: the operands are device buffers of the shapes the backend
        // computed; alpha and beta are host f32 (pointer mode host).
        let r = unsafe {
            blas::gemm_strided_batched_ex(
                self.blas,
                op(g.transa),
                op(g.transb),
                i(g.m),
                i(g.n),
                i(g.k),
                &alpha as *const f32 as *const c_void,
                g.a as *const c_void,
                data_type(g.ab_type),
                i(g.lda),
                g.stride_a,
                g.b as *const c_void,
                data_type(g.ab_type),
                i(g.ldb),
                g.stride_b,
                &beta as *const f32 as *const c_void,
                g.c as *mut c_void,
                data_type(g.c_type),
                i(g.ldc),
                g.stride_c,
                i(g.batch),
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        if let Err(e) = r {
            panic!("cuBLAS gemm {g:?} failed: {e:?}");
        }
    }
    fn synchronize(&mut self) {
        self.bind();
        self.sync_or_die("queued work");
    }

    fn stager(&self) -> std::sync::Arc<dyn super::comm::Stager> {
        std::sync::Arc::new(CtxStager { ctx: self.ctx })
    }
}

/// Copies ordered after everything queued in the context (every rank's
/// stream): synchronise the context, copy, synchronise again.
struct CtxStager {
    ctx: cu_sys::CUcontext,
}

// SAFETY: a context handle may be made current on any thread.
unsafe impl Send for CtxStager {}
unsafe impl Sync for CtxStager {}

impl CtxStager {
    fn sync(&self) {
        // SAFETY: the primary context outlives the run's ranks.
        unsafe { cu::ctx::set_current(self.ctx) }.expect("cuCtxSetCurrent");
        cu::ctx::synchronize().expect("cuCtxSynchronize");
    }
}

impl super::comm::Stager for CtxStager {
    fn download(&self, src: DevPtr, dst: &mut [u8]) {
        self.sync();
        // SAFETY: src holds at least dst.len() bytes.
        unsafe { cu::memcpy_dtoh_sync(dst, src) }.expect("cuMemcpyDtoH");
    }
    fn upload(&self, dst: DevPtr, src: &[u8]) {
        self.sync();
        // SAFETY: dst holds at least src.len() bytes.
        unsafe { cu::memcpy_htod_sync(dst, src) }.expect("cuMemcpyHtoD");
        self.sync();
    }
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        // SAFETY: each handle is released once, in reverse order of
        // creation; errors are ignored (see `free`).
        unsafe {
            let _ = cu::ctx::set_current(self.ctx);
            let _ = cu::stream::synchronize(self.stream);
            let _ = blas::destroy_handle(self.blas);
            let _ = cu::free_sync(self.blas_ws);
            let _ = cu::stream::destroy(self.stream);
            let _ = cu::module::unload(self.module);
            let _ = cu::primary_ctx::release(self.dev);
        }
    }
}
