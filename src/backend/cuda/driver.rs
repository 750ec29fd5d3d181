//! What the cuda backend needs from a GPU, as a trait with two implementations:
//! [`super::real::CudaDriver`] (the CUDA driver API, NVRTC and cuBLAS through
//! cudarc) and [`super::emu::EmuDriver`] (host memory, the kernels compiled for
//! the host under the SIMT emulation header, a reference GEMM). The backend's
//! host side (allocator, launch configuration, dtype dispatch, GEMM layout) is
//! the same code on both, so `cargo test` runs all of it without a GPU.

use crate::backend::DType;

/// A device address (`CUdeviceptr` on a GPU, a host address in the emulator);
/// host-mapped memory has one too ([`Driver::alloc_host`]).
pub type DevPtr = u64;

/// The kind of one kernel parameter, read from its signature by build.rs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgKind {
    Ptr,
    I64,
    I32,
    U32,
    F32,
}

/// One kernel: its name and parameter kinds.
#[derive(Debug)]
pub struct KernelSig {
    pub name: &'static str,
    pub args: &'static [ArgKind],
}

mod generated {
    use super::{ArgKind, KernelSig};
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}
pub use generated::{KERNELS, SOURCES};

/// A kernel, by its index in [`KERNELS`] (the emulator's table has the same order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernel(pub usize);

impl Kernel {
    /// The kernel named `name`; panics on a name no source defines (a bug).
    pub fn named(name: &str) -> Kernel {
        match KERNELS.iter().position(|k| k.name == name) {
            Some(i) => Kernel(i),
            None => panic!("no kernel named `{name}` in src/backend/cuda/kernels"),
        }
    }
    pub fn sig(self) -> &'static KernelSig {
        &KERNELS[self.0]
    }
}

/// One kernel argument, passed by value as `cuLaunchKernel` does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    Ptr(DevPtr),
    I64(i64),
    I32(i32),
    U32(u32),
    F32(f32),
}

impl Arg {
    pub fn kind(self) -> ArgKind {
        match self {
            Arg::Ptr(_) => ArgKind::Ptr,
            Arg::I64(_) => ArgKind::I64,
            Arg::I32(_) => ArgKind::I32,
            Arg::U32(_) => ArgKind::U32,
            Arg::F32(_) => ArgKind::F32,
        }
    }
    /// The argument's bytes in an 8-byte slot (little-endian, low bytes first).
    pub fn slot(self) -> u64 {
        match self {
            Arg::Ptr(p) => p,
            Arg::I64(v) => v as u64,
            Arg::I32(v) => v as u32 as u64,
            Arg::U32(v) => v as u64,
            Arg::F32(v) => v.to_bits() as u64,
        }
    }
}

/// Checks `args` against the kernel's signature; a mismatch is a bug in the
/// backend and would read garbage on the device, so it panics.
pub fn check_args(k: Kernel, args: &[Arg]) {
    let sig = k.sig();
    let got: Vec<ArgKind> = args.iter().map(|a| a.kind()).collect();
    assert!(
        got == sig.args,
        "kernel `{}` takes {:?}, launched with {:?}",
        sig.name,
        sig.args,
        got
    );
}

/// Grid and block of one launch, and its dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchCfg {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
}

impl LaunchCfg {
    /// `blocks` blocks of `threads` threads in x.
    pub fn linear(blocks: u32, threads: u32) -> Self {
        LaunchCfg {
            grid: [blocks.max(1), 1, 1],
            block: [threads, 1, 1],
            shared_bytes: 0,
        }
    }

    /// A grid-stride launch over `n` elements: 256 threads a block, at most
    /// [`MAX_STRIDE_BLOCKS`] blocks (enough to fill an H100/H200's 132 SMs at
    /// 2048 resident threads each; the kernels loop over the rest).
    pub fn elementwise(n: usize) -> Self {
        let blocks = n.div_ceil(256).clamp(1, MAX_STRIDE_BLOCKS as usize) as u32;
        Self::linear(blocks, 256)
    }

    pub fn with_shared(mut self, bytes: usize) -> Self {
        self.shared_bytes = u32::try_from(bytes).expect("shared memory fits u32");
        self
    }

    pub fn blocks(&self) -> u64 {
        self.grid.iter().map(|&g| g as u64).product()
    }
    pub fn threads(&self) -> u32 {
        self.block.iter().product()
    }
}

/// Most blocks of a grid-stride launch.
pub const MAX_STRIDE_BLOCKS: u32 = 1056;

/// A strided batched GEMM with cuBLAS's column-major semantics:
/// `C_i = alpha * op(A_i) @ op(B_i) + beta * C_i` for `i < batch`, with
/// `op(A)` `(m,k)`, `op(B)` `(k,n)`, `C` `(m,n)`, all column-major with the
/// given leading dimensions, products accumulated in fp32 and `C` rounded once
/// to its type. `A` and `B` have the same type.
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    pub transa: bool,
    pub transb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
    pub a: DevPtr,
    pub lda: usize,
    pub stride_a: i64,
    pub b: DevPtr,
    pub ldb: usize,
    pub stride_b: i64,
    pub ab_type: DType,
    pub beta: f32,
    pub c: DevPtr,
    pub ldc: usize,
    pub stride_c: i64,
    pub c_type: DType,
    pub batch: usize,
}

/// A GPU, real or emulated.
pub trait Driver {
    /// What runs the kernels, for reports ("NVIDIA H200, sm_90, 140 GiB").
    fn describe(&self) -> String;
    /// The GPU's model name as the driver reports it ("NVIDIA H100 80GB
    /// HBM3"), what calibrations are keyed on.
    fn gpu_name(&self) -> String;
    /// Total device memory in bytes.
    fn total_bytes(&self) -> u64;
    /// Bytes the driver, context, modules and library handles hold that are
    /// not the engine's: measured (free memory before and after start-up) on a
    /// GPU, 0 in the emulator.
    fn overhead_bytes(&self) -> u64;
    /// Uninitialised device memory, or `None` when the device has no room.
    fn alloc(&mut self, bytes: usize) -> Option<DevPtr>;
    /// Frees what [`Driver::alloc`] returned for the same `bytes`.
    fn free(&mut self, ptr: DevPtr, bytes: usize);
    /// Pinned host memory mapped into the device's address space (offload:
    /// `cuMemHostAlloc` with `CU_MEMHOSTALLOC_DEVICEMAP | PORTABLE`, then
    /// `cuMemHostGetDevicePointer`): the address returned is the one kernels,
    /// [`Driver::upload`], [`Driver::download`] and [`Driver::zero`] take,
    /// and reads and writes through it cross the host link ("zero-copy").
    /// It is not device memory: [`Driver::alloc`]'s room is unchanged.
    /// `None` when the host cannot pin that much.
    fn alloc_host(&mut self, bytes: usize) -> Option<DevPtr>;
    /// Frees what [`Driver::alloc_host`] returned for the same `bytes`.
    fn free_host(&mut self, ptr: DevPtr, bytes: usize);
    fn upload(&mut self, dst: DevPtr, src: &[u8]);
    fn download(&self, src: DevPtr, dst: &mut [u8]);
    fn zero(&mut self, dst: DevPtr, bytes: usize);
    fn launch(&mut self, k: Kernel, cfg: LaunchCfg, args: &[Arg]);
    fn gemm(&mut self, g: &Gemm);
    /// Waits for all queued work (timing, and before host reads).
    fn synchronize(&mut self);
    /// Host staging for collectives between ranks on this device.
    fn stager(&self) -> std::sync::Arc<dyn super::comm::Stager>;
}
