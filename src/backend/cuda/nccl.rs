//! Collectives on cuda buffers across processes (one rank per process,
//! `memfit launch` or torchrun): NCCL on a real GPU, or the TCP process group
//! staged through the host.
//!
//! * [`NcclComm`]: `ncclAllReduce`, `ncclReduceScatter`, `ncclAllGather`,
//!   `ncclBroadcast`, and all-to-all as a group of `ncclSend`/`ncclRecv`,
//!   through cudarc's NCCL bindings, loaded at run time like
//!   the rest of cudarc here, so memfit builds and runs without libnccl; every
//!   entry point checks [`nccl_available`] first (cudarc panics when a library
//!   is missing) and says what is missing instead. The unique id travels in
//!   the rendezvous blob of [`ProcessGroup::connect`]. NCCL runs on a stream of
//!   its own in the device's primary context (the one the backend uses): a
//!   call first synchronises the context, so the backend's kernels that wrote
//!   the input have finished, then polls its stream until the collective is
//!   done, NCCL reports an error, the process group fails (a peer died) or
//!   the deadline passes; the last three abort the communicator, so a dead
//!   rank never hangs the others. Host scalars (losses, gradient norms) are
//!   summed over the TCP group in rank order, as on cpu. NCCL sums in its own
//!   order (rings, trees) and in the buffer's dtype, so results match the
//!   cpu collectives to rounding, not bit for bit.
//! * [`Staged`]: any cpu collective or pipeline link (the TCP
//!   [`crate::backend::cpu::process::ProcessComm`]) on cuda buffers, each call copying
//!   the buffer to the host and back, as `comm::Staged` does for ranks on
//!   one GPU: the emulated GPU (`MEMFIT_CUDA_EMULATE`), `MEMFIT_DIST_BACKEND=tcp`,
//!   and pipelines, whose point-to-point links and sub-groups NCCL is not
//!   wired for here. Its sums are the cpu's, bit for bit.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::CudaBuf;
use crate::backend::DType;
use crate::backend::cpu::process::ProcessComm;
use crate::comm::process::ProcessGroup;
use crate::comm::{AbortHandle, Collective};
use cudarc::driver::{result as cu, sys as cu_sys};
use cudarc::nccl::{result as nccl, sys as nccl_sys};

/// `nccl` (the default on a real GPU) or `tcp` (staged through the host).
pub const BACKEND_ENV: &str = "MEMFIT_DIST_BACKEND";

/// NCCL's bf16 reductions arrived in 2.10.
const MIN_VERSION: i32 = 21000;

/// Bytes of an NCCL unique id.
pub const ID_BYTES: usize = 128;

/// Whether this process can use NCCL: the CUDA driver, then libnccl, then
/// its version. Never panics.
pub fn nccl_available() -> Result<i32, String> {
    if !super::real::driver_present() {
        return Err(
            "NCCL needs the CUDA driver, and libcuda.so could not be loaded on this machine".into(),
        );
    }
    // SAFETY: only attempts to dlopen the library.
    if !unsafe { nccl_sys::is_culib_present() } {
        return Err(format!(
            "NCCL could not be loaded ({}), or set {BACKEND_ENV}=tcp to stage the collectives through the host",
            super::libs::explain(super::libs::Lib::Nccl)
        ));
    }
    let v = nccl::get_nccl_version().map_err(|e| format!("ncclGetVersion failed: {:?}", e.0))?;
    if v < MIN_VERSION {
        return Err(format!(
            "NCCL {} is too old: memfit's bf16 collectives need NCCL 2.10 or newer",
            version_name(v)
        ));
    }
    Ok(v)
}

/// `21903` as `2.19.3`.
fn version_name(v: i32) -> String {
    format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
}

/// A new NCCL unique id, for rank 0 to send in the rendezvous blob.
pub fn unique_id() -> Result<Vec<u8>, String> {
    nccl_available()?;
    let id =
        nccl::get_uniqueid().map_err(|e| format!("ncclGetUniqueId failed: {}", describe(&e)))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

fn describe(e: &nccl::NcclError) -> String {
    // SAFETY: ncclGetErrorString returns a static string for any result.
    let s = unsafe { nccl_sys::ncclGetErrorString(e.0) };
    let text = if s.is_null() {
        String::new()
    } else {
        // SAFETY: a NUL-terminated static string.
        unsafe { std::ffi::CStr::from_ptr(s) }
            .to_string_lossy()
            .into_owned()
    };
    format!("{:?} ({text})", e.0)
}

fn nccl_dtype(dt: DType, op: &str) -> nccl_sys::ncclDataType_t {
    match dt {
        DType::F32 => nccl_sys::ncclDataType_t::ncclFloat32,
        DType::Bf16 => nccl_sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => nccl_sys::ncclDataType_t::ncclFloat16,
        other => panic!("engine bug: NCCL {op} on a {other:?} buffer"),
    }
}

/// The communicator handle, shared with the abort handle.
struct Handle {
    comm: usize,
    /// Set once `ncclCommAbort` ran: the handle is gone.
    aborted: AtomicBool,
}

impl Handle {
    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::AcqRel) {
            // SAFETY: the communicator is live until the first abort or drop.
            let _ = unsafe { nccl::comm_abort(self.comm as nccl_sys::ncclComm_t) };
        }
    }
}

/// One rank's NCCL communicator over the whole job (data parallelism
/// without a pipeline), with the TCP group for host scalars and failures.
pub struct NcclComm {
    handle: Arc<Handle>,
    dev: cu_sys::CUdevice,
    ctx: cu_sys::CUcontext,
    stream: cu_sys::CUstream,
    host: ProcessComm,
    group: Arc<ProcessGroup>,
    timeout: Duration,
}

// SAFETY: the handles are plain driver/NCCL handles; each call makes the
// context current on the calling thread first, and the communicator is used
// by one thread at a time (`&mut self`); the abort handle only calls
// `ncclCommAbort`, which NCCL allows from another thread.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Joins the NCCL communicator of `group` (every rank of the job, in
    /// order) on device `ordinal`, with the id rank 0 sent in the rendezvous
    /// blob; `channel` carries the host scalars over `group`.
    pub fn new(
        ordinal: usize,
        group: &Arc<ProcessGroup>,
        channel: u32,
        id: &[u8],
        timeout: Duration,
    ) -> Result<Self, String> {
        let (rank, world) = (group.rank(), group.world());
        let mut host = ProcessComm::new(group, channel, (0..world).collect());
        let usable = nccl_available().and_then(|_| match id.len() {
            ID_BYTES => Ok(()),
            n => Err(format!(
                "rank {rank}: rank 0 sent no NCCL id ({n} bytes of rendezvous blob); every rank must use the same {BACKEND_ENV} and a real GPU"
            )),
        });
        // Every rank learns whether all can join, so none waits in
        // ncclCommInitRank for one that never comes.
        let ready = host.all_reduce_scalar(if usable.is_ok() { 1.0 } else { 0.0 });
        usable?;
        if ready != world as f64 || group.failure().is_some() {
            return Err(format!(
                "rank {rank}: another rank cannot use NCCL (its own message says why)"
            ));
        }
        let err = |what: &str, e: cu::DriverError| format!("cuda: {what} failed: {e:?}");
        cu::init().map_err(|e| err("cuInit", e))?;
        let dev = cu::device::get(ordinal as i32).map_err(|e| err("cuDeviceGet", e))?;
        // SAFETY: dev is a valid device handle; the primary context is the
        // one the backend retained.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }
            .map_err(|e| err("retaining the primary context", e))?;
        // SAFETY: ctx was just retained.
        unsafe { cu::ctx::set_current(ctx) }.map_err(|e| err("cuCtxSetCurrent", e))?;
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(|e| err("creating NCCL's stream", e))?;
        let mut uid = nccl_sys::ncclUniqueId {
            internal: [0; ID_BYTES],
        };
        for (d, &s) in uid.internal.iter_mut().zip(id) {
            *d = s as _;
        }
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: comm is written on success; every rank passes the same id
        // and world, and its own rank.
        let init =
            unsafe { nccl::comm_init_rank(comm.as_mut_ptr(), world as i32, uid, rank as i32) };
        if let Err(e) = init {
            // SAFETY: the stream and the context reference are ours.
            unsafe {
                let _ = cu::stream::destroy(stream);
                let _ = cu::primary_ctx::release(dev);
            }
            return Err(format!(
                "rank {rank}: ncclCommInitRank on cuda:{ordinal} failed: {}",
                describe(&e)
            ));
        }
        // SAFETY: initialised by the successful call.
        let comm = unsafe { comm.assume_init() };
        Ok(NcclComm {
            handle: Arc::new(Handle {
                comm: comm as usize,
                aborted: AtomicBool::new(false),
            }),
            dev,
            ctx,
            stream,
            host,
            group: Arc::clone(group),
            timeout,
        })
    }

    fn comm(&self) -> nccl_sys::ncclComm_t {
        self.handle.comm as nccl_sys::ncclComm_t
    }

    fn dead(&self) -> bool {
        self.handle.aborted.load(Ordering::Acquire) || self.group.failure().is_some()
    }

    /// Stops the job: every rank's collectives return, the communicator is
    /// aborted.
    fn fail(&self, why: String) {
        let rank = self.group.rank();
        self.group.abort(1, format!("rank {rank}: {why}"));
        self.handle.abort();
    }

    /// Runs one NCCL call on this communicator's stream, ordered after the
    /// backend's work, and waits for it.
    fn call(
        &mut self,
        what: &str,
        f: impl FnOnce(
            nccl_sys::ncclComm_t,
            nccl_sys::cudaStream_t,
        ) -> Result<nccl::NcclStatus, nccl::NcclError>,
    ) {
        if self.dead() {
            return;
        }
        // SAFETY: the primary context outlives this communicator.
        let ready = unsafe { cu::ctx::set_current(self.ctx) }.and_then(|()| cu::ctx::synchronize());
        if let Err(e) = ready {
            return self.fail(format!("synchronising before NCCL {what} failed: {e:?}"));
        }
        if let Err(e) = f(self.comm(), self.stream as nccl_sys::cudaStream_t) {
            return self.fail(format!("NCCL {what} failed: {}", describe(&e)));
        }
        self.wait(what);
    }

    /// Polls the stream until the call is done; an NCCL error, a failed
    /// group or the deadline aborts the communicator instead.
    fn wait(&self, what: &str) {
        let deadline = Instant::now() + self.timeout;
        let mut spins = 0u32;
        loop {
            // SAFETY: the stream is ours and live.
            match unsafe { cu_sys::cuStreamQuery(self.stream) } {
                cu_sys::CUresult::CUDA_SUCCESS => return,
                cu_sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return self.fail(format!("NCCL {what}: the stream failed: {e:?}")),
            }
            let mut async_err = nccl_sys::ncclResult_t::ncclSuccess;
            // SAFETY: the communicator is live (not aborted: checked below).
            let _ = unsafe { nccl_sys::ncclCommGetAsyncError(self.comm(), &mut async_err) };
            if !matches!(
                async_err,
                nccl_sys::ncclResult_t::ncclSuccess | nccl_sys::ncclResult_t::ncclInProgress
            ) {
                return self.fail(format!(
                    "NCCL {what} failed: {}",
                    describe(&nccl::NcclError(async_err))
                ));
            }
            if self.group.failure().is_some() {
                // A peer is gone: NCCL would wait for it forever.
                self.handle.abort();
                return;
            }
            if Instant::now() >= deadline {
                return self.fail(format!(
                    "NCCL {what} did not finish within {:.0} s ({})",
                    self.timeout.as_secs_f64(),
                    crate::comm::process::TIMEOUT_ENV
                ));
            }
            spins += 1;
            if spins < 1000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }
}

impl Collective<CudaBuf> for NcclComm {
    fn rank(&self) -> usize {
        self.group.rank()
    }

    fn world(&self) -> usize {
        self.group.world()
    }

    fn all_reduce_sum(&mut self, buf: &mut CudaBuf, n: usize) {
        assert!(
            buf.len >= n,
            "engine bug: NCCL all_reduce_sum past the buffer"
        );
        let (ptr, dt) = (buf.ptr, nccl_dtype(buf.dtype, "all_reduce_sum"));
        self.call("all-reduce", |c, s| {
            // SAFETY: ptr holds n elements of dt on this device; in place.
            unsafe {
                nccl::all_reduce(
                    ptr as *const _,
                    ptr as *mut _,
                    n,
                    dt,
                    nccl_sys::ncclRedOp_t::ncclSum,
                    c,
                    s,
                )
            }
        });
    }

    fn reduce_scatter_sum(&mut self, out: &mut CudaBuf, inp: &CudaBuf, shard: usize) {
        let world = self.world();
        assert!(
            inp.len >= world * shard && out.len >= shard,
            "engine bug: NCCL reduce_scatter_sum past a buffer"
        );
        assert_eq!(
            out.dtype, inp.dtype,
            "engine bug: NCCL reduce_scatter_sum dtypes"
        );
        let (src, dst, dt) = (
            inp.ptr,
            out.ptr,
            nccl_dtype(inp.dtype, "reduce_scatter_sum"),
        );
        self.call("reduce-scatter", |c, s| {
            // SAFETY: src holds world*shard elements, dst shard.
            unsafe {
                nccl::reduce_scatter(
                    src as *const _,
                    dst as *mut _,
                    shard,
                    dt,
                    nccl_sys::ncclRedOp_t::ncclSum,
                    c,
                    s,
                )
            }
        });
    }

    fn all_gather(&mut self, out: &mut CudaBuf, inp: &CudaBuf, shard: usize) {
        let world = self.world();
        assert!(
            inp.len >= shard && out.len >= world * shard,
            "engine bug: NCCL all_gather past a buffer"
        );
        assert_eq!(out.dtype, inp.dtype, "engine bug: NCCL all_gather dtypes");
        let (src, dst, dt) = (inp.ptr, out.ptr, nccl_dtype(inp.dtype, "all_gather"));
        self.call("all-gather", |c, s| {
            // SAFETY: src holds shard elements, dst world*shard.
            unsafe { nccl::all_gather(src as *const _, dst as *mut _, shard, dt, c, s) }
        });
    }

    fn broadcast(&mut self, buf: &mut CudaBuf, n: usize, root: usize) {
        assert!(buf.len >= n, "engine bug: NCCL broadcast past the buffer");
        let (ptr, dt) = (buf.ptr, nccl_dtype(buf.dtype, "broadcast"));
        self.call("broadcast", |c, s| {
            // SAFETY: ptr holds n elements; in place.
            unsafe { nccl::broadcast(ptr as *const _, ptr as *mut _, n, dt, root as i32, c, s) }
        });
    }

    /// NCCL has no all-to-all with per-pair counts; like PyTorch's
    /// `all_to_all_single` it is a group of one `ncclSend` and one
    /// `ncclRecv` per peer (NCCL's user guide, "Point-to-point
    /// communication": all-to-all). Tested against the C-level NCCL double
    /// (`tests/it/cuda_double.rs`), never on a GPU: `--device cuda` refuses
    /// experts, so no training run reaches it yet.
    fn all_to_all(&mut self, out: &mut CudaBuf, inp: &CudaBuf, counts: &[usize]) {
        let (world, me) = (self.world(), self.rank());
        assert_eq!(
            counts.len(),
            world * world,
            "engine bug: NCCL all_to_all counts"
        );
        assert_eq!(out.dtype, inp.dtype, "engine bug: NCCL all_to_all dtypes");
        let es = inp.dtype.size() as u64;
        let dt = nccl_dtype(inp.dtype, "all_to_all");
        let n = |s: usize, d: usize| counts[s * world + d];
        let at = |s: usize, d: usize| crate::comm::all_to_all_offsets(counts, world, s, d);
        let (sent, recv): (usize, usize) = (
            (0..world).map(|d| n(me, d)).sum(),
            (0..world).map(|s| n(s, me)).sum(),
        );
        assert!(
            inp.len >= sent && out.len >= recv,
            "engine bug: NCCL all_to_all past a buffer"
        );
        let (src, dst) = (inp.ptr, out.ptr);
        self.call("all-to-all", |c, s| {
            nccl::group_start()?;
            let mut posted = Ok(nccl::NcclStatus::Success);
            for p in 0..world {
                let (send_at, recv_at) = (at(me, p).0 as u64, at(p, me).1 as u64);
                // SAFETY: each part lies inside its buffer (checked above).
                posted = posted.and_then(|_| unsafe {
                    let from = (src + send_at * es) as *const _;
                    nccl::send(from, n(me, p), dt, p as i32, c, s)?;
                    let to = (dst + recv_at * es) as *mut _;
                    nccl::recv(to, n(p, me), dt, p as i32, c, s)
                });
            }
            // The group is closed even when a call in it failed: a thread
            // left inside one would have NCCL defer its every later call.
            let ended = nccl::group_end();
            posted.and(ended)
        });
    }

    fn all_reduce_scalar(&mut self, x: f64) -> f64 {
        self.host.all_reduce_scalar(x)
    }

    fn abort_handle(&self) -> AbortHandle {
        let (h, g) = (Arc::clone(&self.handle), Arc::clone(&self.group));
        Arc::new(move || {
            let rank = g.rank();
            g.abort(1, format!("rank {rank} aborted the job"));
            h.abort();
        })
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // SAFETY: each handle is released once; errors are ignored.
        unsafe {
            let _ = cu::ctx::set_current(self.ctx);
            if !self.handle.aborted.swap(true, Ordering::AcqRel) {
                let _ = cu::stream::synchronize(self.stream);
                let _ = nccl::comm_destroy(self.comm());
            }
            let _ = cu::stream::destroy(self.stream);
            let _ = cu::primary_ctx::release(self.dev);
        }
    }
}

pub use super::comm::Staged;

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a GPU or libnccl (CI), every NCCL entry point says what is
    /// missing instead of panicking; with them, an id is 128 bytes.
    #[test]
    fn nccl_refuses_cleanly_without_its_libraries() {
        match nccl_available() {
            Ok(v) => {
                assert!(v >= MIN_VERSION);
                assert_eq!(unique_id().unwrap().len(), ID_BYTES);
            }
            Err(why) => {
                assert!(why.contains("NCCL"), "{why}");
                let err = unique_id().unwrap_err();
                assert_eq!(err, why);
                // Joining a communicator is refused the same way, before
                // the id or the device is looked at.
                let env = crate::comm::process::DistEnv {
                    rank: 0,
                    world: 1,
                    local_rank: 0,
                    local_world: 1,
                    master_addr: "127.0.0.1".into(),
                    master_port: 0,
                    port_var: "MASTER_PORT",
                    port_source: String::new(),
                    timeout: Duration::from_secs(5),
                };
                let (g, _) = ProcessGroup::connect(&env, || Ok(Vec::new())).unwrap();
                let err = NcclComm::new(0, &g, 1, &[], Duration::from_secs(5))
                    .err()
                    .expect("refused");
                assert_eq!(err, why);
            }
        }
    }

    #[test]
    fn version_names() {
        assert_eq!(version_name(21903), "2.19.3");
        assert_eq!(version_name(22304), "2.23.4");
    }
}
