//! The emulated GPU: device memory is guarded host memory, kernels are the
//! same CUDA C sources compiled for the host under the SIMT emulation header
//! (`simt/simt.h`, built by build.rs), blocks of a launch spread over host
//! threads, and GEMMs run a plain fp32-accumulating reference with cuBLAS's
//! column-major argument conventions, so a transposition or leading-dimension
//! mistake in the backend shows up here exactly as it would under cuBLAS.
//! The launcher (with the hardware's launch limits) and the GEMM live in
//! `simt/simt.cpp`, shared with the C-level CUDA double
//! (`tests/cuda_double`), which runs the real cudarc driver path on them.
//!
//! It is slow (one fiber per CUDA thread) and meant for tests and
//! `memfit selftest --device cuda-emu`; it is not a device users run on.

use std::ffi::{CStr, c_char, c_void};

use super::driver::{Arg, DevPtr, Driver, Gemm, KERNELS, Kernel, LaunchCfg, check_args};
use crate::backend::DType;

unsafe extern "C" {
    fn memfit_simt_kernel_count() -> u32;
    fn memfit_simt_kernel_name(i: u32) -> *const c_char;
    fn memfit_simt_launch(
        k: u32,
        grid: *const u32,
        block: *const u32,
        shmem: usize,
        args: *mut *mut c_void,
        threads: u32,
        err: *mut c_char,
        errlen: usize,
    ) -> i32;
    fn memfit_simt_gemm(g: *const SimtGemm, threads: u32);
    fn memfit_simt_alloc(bytes: usize) -> *mut c_void;
    fn memfit_simt_free(p: *mut c_void, bytes: usize);
}

/// `MemfitGemm` in simt.cpp.
#[repr(C)]
struct SimtGemm {
    transa: i32,
    transb: i32,
    m: i64,
    n: i64,
    k: i64,
    alpha: f32,
    a: *const c_void,
    lda: i64,
    stride_a: i64,
    b: *const c_void,
    ldb: i64,
    stride_b: i64,
    ab_type: i32,
    beta: f32,
    c: *mut c_void,
    ldc: i64,
    stride_c: i64,
    c_type: i32,
    batch: i64,
}

/// The `DT_*` code of prelude.cuh for a GEMM operand.
fn gemm_type(t: DType) -> i32 {
    match t {
        DType::F32 => 0,
        DType::Bf16 => 1,
        DType::F16 => 2,
        other => panic!("gemm on a {other:?} operand"),
    }
}

/// The emulated device. `capacity` is what it reports as total memory;
/// `live` is the device memory allocated, `host_live` the host-mapped
/// memory ([`Driver::alloc_host`]), which the capacity does not cover.
pub struct EmuDriver {
    threads: u32,
    capacity: u64,
    live: u64,
    host_live: u64,
}

impl EmuDriver {
    pub fn new(capacity: u64, threads: usize) -> Self {
        // SAFETY: plain reads of the generated table.
        let count = unsafe { memfit_simt_kernel_count() } as usize;
        assert_eq!(
            count,
            KERNELS.len(),
            "host kernel table and kernels.rs disagree"
        );
        for (i, k) in KERNELS.iter().enumerate() {
            // SAFETY: i < count; the table holds static NUL-terminated names.
            let name = unsafe { CStr::from_ptr(memfit_simt_kernel_name(i as u32)) };
            assert_eq!(name.to_str().ok(), Some(k.name), "kernel table order");
        }
        EmuDriver {
            threads: threads.clamp(1, 256) as u32,
            capacity,
            live: 0,
            host_live: 0,
        }
    }

    /// Device memory allocated now (not host-mapped memory).
    pub fn live_bytes(&self) -> u64 {
        self.live
    }

    /// Host-mapped memory allocated now.
    pub fn host_live_bytes(&self) -> u64 {
        self.host_live
    }
}

impl Driver for EmuDriver {
    fn describe(&self) -> String {
        format!(
            "emulated GPU (kernels under SIMT emulation on {} host threads)",
            self.threads
        )
    }
    fn gpu_name(&self) -> String {
        "emulated GPU".into()
    }
    fn total_bytes(&self) -> u64 {
        self.capacity
    }
    fn overhead_bytes(&self) -> u64 {
        0
    }
    fn alloc(&mut self, bytes: usize) -> Option<DevPtr> {
        if self.live + bytes as u64 > self.capacity {
            return None;
        }
        // SAFETY: returns fresh zeroed pages or null.
        let p = unsafe { memfit_simt_alloc(bytes) };
        if p.is_null() {
            return None;
        }
        self.live += bytes as u64;
        Some(p as DevPtr)
    }
    fn free(&mut self, ptr: DevPtr, bytes: usize) {
        self.live -= bytes as u64;
        // SAFETY: ptr came from memfit_simt_alloc(bytes).
        unsafe { memfit_simt_free(ptr as *mut c_void, bytes) }
    }
    fn alloc_host(&mut self, bytes: usize) -> Option<DevPtr> {
        // Host memory the emulated kernels address as they address device
        // memory (it is all host memory here), between guard pages as device
        // buffers are, and counted apart: a GPU's host-mapped memory is
        // pinned host pages, not device memory.
        // SAFETY: returns fresh zeroed pages or null.
        let p = unsafe { memfit_simt_alloc(bytes) };
        if p.is_null() {
            return None;
        }
        self.host_live += bytes as u64;
        Some(p as DevPtr)
    }
    fn free_host(&mut self, ptr: DevPtr, bytes: usize) {
        self.host_live -= bytes as u64;
        // SAFETY: ptr came from memfit_simt_alloc(bytes) in alloc_host.
        unsafe { memfit_simt_free(ptr as *mut c_void, bytes) }
    }
    fn upload(&mut self, dst: DevPtr, src: &[u8]) {
        // SAFETY: dst is a live allocation of at least src.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) }
    }
    fn download(&self, src: DevPtr, dst: &mut [u8]) {
        // SAFETY: src is a live allocation of at least dst.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) }
    }
    fn zero(&mut self, dst: DevPtr, bytes: usize) {
        // SAFETY: as in upload.
        unsafe { std::ptr::write_bytes(dst as *mut u8, 0, bytes) }
    }

    fn launch(&mut self, k: Kernel, cfg: LaunchCfg, args: &[Arg]) {
        check_args(k, args);
        let mut slots: Vec<u64> = args.iter().map(|a| a.slot()).collect();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| s as *mut u64 as *mut c_void)
            .collect();
        let mut err = [0 as c_char; 512];
        // SAFETY: the parameters match the kernel's signature (checked), each
        // slot holds its value as cuLaunchKernel reads it, and every pointer
        // argument is device memory the backend owns for the launch.
        let rc = unsafe {
            memfit_simt_launch(
                k.0 as u32,
                cfg.grid.as_ptr(),
                cfg.block.as_ptr(),
                cfg.shared_bytes as usize,
                params.as_mut_ptr(),
                self.threads,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if rc != 0 {
            // SAFETY: the launcher NUL-terminates what it writes.
            let e = unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy();
            panic!("{e} ({cfg:?})");
        }
    }

    fn gemm(&mut self, g: &Gemm) {
        let s = SimtGemm {
            transa: g.transa as i32,
            transb: g.transb as i32,
            m: g.m as i64,
            n: g.n as i64,
            k: g.k as i64,
            alpha: g.alpha,
            a: g.a as *const c_void,
            lda: g.lda as i64,
            stride_a: g.stride_a,
            b: g.b as *const c_void,
            ldb: g.ldb as i64,
            stride_b: g.stride_b,
            ab_type: gemm_type(g.ab_type),
            beta: g.beta,
            c: g.c as *mut c_void,
            ldc: g.ldc as i64,
            stride_c: g.stride_c,
            c_type: gemm_type(g.c_type),
            batch: g.batch as i64,
        };
        // SAFETY: the operands are live emulated buffers of the shapes the
        // backend computed (the guard pages catch the rest).
        unsafe { memfit_simt_gemm(&s, self.threads) }
    }

    fn synchronize(&mut self) {}

    fn stager(&self) -> std::sync::Arc<dyn super::comm::Stager> {
        std::sync::Arc::new(HostStager)
    }
}

/// The emulator's memory is host memory and its work is synchronous.
struct HostStager;

impl super::comm::Stager for HostStager {
    fn download(&self, src: DevPtr, dst: &mut [u8]) {
        // SAFETY: src is a live emulated allocation of at least dst.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) }
    }
    fn upload(&self, dst: DevPtr, src: &[u8]) {
        // SAFETY: as above.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) }
    }
}
