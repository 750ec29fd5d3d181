//! The emulated GPU: device memory is guarded host memory, kernels are the
//! same CUDA C sources compiled for the host under the SIMT emulation header
//! (`simt/simt.h`, built by build.rs), blocks of a launch spread over a rayon
//! pool, and GEMMs run a plain fp32-accumulating reference with cuBLAS's
//! column-major argument conventions, so a transposition or leading-dimension
//! mistake in the backend shows up here exactly as it would under cuBLAS.
//!
//! It is slow (one fiber per CUDA thread) and meant for tests and
//! `memfit selftest --device cuda-emu`; it is not a device users run on.

use std::ffi::{CStr, c_char, c_void};

use rayon::prelude::*;

use super::driver::{Arg, DevPtr, Driver, Gemm, KERNELS, Kernel, LaunchCfg, check_args};
use crate::backend::DType;

unsafe extern "C" {
    fn memfit_simt_kernel_count() -> u32;
    fn memfit_simt_kernel_name(i: u32) -> *const c_char;
    fn memfit_simt_run(
        k: u32,
        grid: *const u32,
        block: *const u32,
        shmem: usize,
        args: *mut *mut c_void,
        begin: u64,
        end: u64,
        err: *mut c_char,
        errlen: usize,
    ) -> i32;
    fn memfit_simt_alloc(bytes: usize) -> *mut c_void;
    fn memfit_simt_free(p: *mut c_void, bytes: usize);
}

/// The emulated device. `capacity` is what it reports as total memory;
/// `live` is the device memory allocated, `host_live` the host-mapped
/// memory ([`Driver::alloc_host`]), which the capacity does not cover.
pub struct EmuDriver {
    pool: rayon::ThreadPool,
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
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("memfit-simt-{i}"))
            .build()
            .expect("emulator thread pool");
        EmuDriver {
            pool,
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

/// Raw launch state shared by the pool's threads for one launch.
struct Shared {
    args: Vec<*mut c_void>,
}
// SAFETY: the pointers address `slots`, which outlives the launch, and the
// kernels only read them.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

fn load(p: DevPtr, t: DType, i: usize) -> f32 {
    // SAFETY: callers index inside the GEMM's operands, which the backend
    // allocated with these shapes (the guard pages catch the rest).
    unsafe {
        match t {
            DType::F32 => *(p as *const f32).add(i),
            DType::Bf16 => half::bf16::from_bits(*(p as *const u16).add(i)).to_f32(),
            DType::F16 => half::f16::from_bits(*(p as *const u16).add(i)).to_f32(),
            _ => panic!("gemm on a {t:?} operand"),
        }
    }
}

fn store(p: DevPtr, t: DType, i: usize, v: f32) {
    // SAFETY: as in `load`.
    unsafe {
        match t {
            DType::F32 => *(p as *mut f32).add(i) = v,
            DType::Bf16 => *(p as *mut u16).add(i) = half::bf16::from_f32(v).to_bits(),
            DType::F16 => *(p as *mut u16).add(i) = half::f16::from_f32(v).to_bits(),
            _ => panic!("gemm into a {t:?} buffer"),
        }
    }
}

impl Driver for EmuDriver {
    fn describe(&self) -> String {
        format!(
            "emulated GPU (kernels under SIMT emulation on {} host threads)",
            self.pool.current_num_threads()
        )
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
        // The launch limits of every GPU memfit supports (sm_80 and newer),
        // checked here so a launch the hardware would refuse fails in tests.
        let name = k.sig().name;
        assert!(
            cfg.threads() <= 1024,
            "kernel `{name}`: {} threads a block (the limit is 1024)",
            cfg.threads()
        );
        assert!(
            cfg.block[2] <= 64,
            "kernel `{name}`: block z is {} (the limit is 64)",
            cfg.block[2]
        );
        assert!(
            cfg.grid[1] <= 65535 && cfg.grid[2] <= 65535,
            "kernel `{name}`: grid {:?} (y and z are at most 65535)",
            cfg.grid
        );
        assert!(
            cfg.shared_bytes <= 48 << 10,
            "kernel `{name}`: {} bytes of dynamic shared memory (over 48 KiB needs an opt-in the backend does not make)",
            cfg.shared_bytes
        );
        let mut slots: Vec<u64> = args.iter().map(|a| a.slot()).collect();
        let shared = Shared {
            args: slots
                .iter_mut()
                .map(|s| s as *mut u64 as *mut c_void)
                .collect(),
        };
        let blocks = cfg.blocks();
        let workers = self.pool.current_num_threads() as u64;
        let per = blocks.div_ceil(workers * 4).max(1);
        let chunks: Vec<(u64, u64)> = (0..blocks)
            .step_by(per as usize)
            .map(|b| (b, (b + per).min(blocks)))
            .collect();
        let errors: Vec<String> = self.pool.install(|| {
            chunks
                .par_iter()
                .filter_map(|&(b, e)| {
                    let shared = &shared;
                    let mut err = [0 as c_char; 512];
                    let mut args = shared.args.clone();
                    // SAFETY: the argument array matches the kernel's signature
                    // (checked above); every pointer argument is device memory
                    // the backend owns for the length of the launch.
                    let rc = unsafe {
                        memfit_simt_run(
                            k.0 as u32,
                            cfg.grid.as_ptr(),
                            cfg.block.as_ptr(),
                            cfg.shared_bytes as usize,
                            args.as_mut_ptr(),
                            b,
                            e,
                            err.as_mut_ptr(),
                            err.len(),
                        )
                    };
                    // SAFETY: the emulator NUL-terminates what it writes.
                    (rc != 0).then(|| {
                        unsafe { CStr::from_ptr(err.as_ptr()) }
                            .to_string_lossy()
                            .into()
                    })
                })
                .collect()
        });
        drop(slots);
        if let Some(e) = errors.first() {
            panic!("kernel `{}` {cfg:?}: {e}", k.sig().name);
        }
    }

    fn gemm(&mut self, g: &Gemm) {
        // Column-major: element (i, j) of X with leading dimension ld is X[i + j*ld];
        // op(A)(i, p) is A(p, i) when transposed.
        let g = *g;
        self.pool.install(|| {
            (0..g.batch * g.n).into_par_iter().for_each(|bj| {
                let (bi, j) = (bj / g.n, bj % g.n);
                let a =
                    g.a.wrapping_add_signed(bi as i64 * g.stride_a * g.ab_type.size() as i64);
                let b =
                    g.b.wrapping_add_signed(bi as i64 * g.stride_b * g.ab_type.size() as i64);
                let c =
                    g.c.wrapping_add_signed(bi as i64 * g.stride_c * g.c_type.size() as i64);
                for i in 0..g.m {
                    let mut acc = 0.0f32;
                    for p in 0..g.k {
                        let av = if g.transa {
                            load(a, g.ab_type, p + i * g.lda)
                        } else {
                            load(a, g.ab_type, i + p * g.lda)
                        };
                        let bv = if g.transb {
                            load(b, g.ab_type, j + p * g.ldb)
                        } else {
                            load(b, g.ab_type, p + j * g.ldb)
                        };
                        acc += av * bv;
                    }
                    let idx = i + j * g.ldc;
                    let mut v = g.alpha * acc;
                    if g.beta != 0.0 {
                        v += g.beta * load(c, g.c_type, idx);
                    }
                    store(c, g.c_type, idx, v);
                }
            })
        });
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
