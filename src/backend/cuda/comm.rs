//! Collectives and pipeline links for ranks simulated on one GPU: the data
//! moves through the host. Each op copies the rank's device buffer to a host
//! buffer of the same element type, runs the cpu backend's collective (so
//! the sums are the cpu's, in rank order, rounded once), and copies the
//! result back. Slow, but memfit runs DDP, ZeRO and pipeline schedules on a
//! single GPU to measure their memory, and every byte the engine tracks is
//! the same as on a real multi-GPU run. NCCL over several GPUs is separate.

use std::sync::Arc;

use half::{bf16, f16};

use super::CudaBuf;
use super::driver::DevPtr;
use crate::backend::DType;
use crate::backend::cpu::CpuBuf;
use crate::backend::cpu::comm::{CpuComm, CpuP2p};
use crate::comm::{AbortHandle, Collective, Peer, PointToPoint};

/// Moves bytes between the host and any rank's device memory, ordered after
/// all work queued on the device (every rank's stream).
pub trait Stager: Send + Sync {
    fn download(&self, src: DevPtr, dst: &mut [u8]);
    fn upload(&self, dst: DevPtr, src: &[u8]);
}

fn to_host(st: &dyn Stager, b: &CudaBuf, n: usize) -> CpuBuf {
    let mut raw = vec![0u8; n * b.dtype.size()];
    st.download(b.ptr, &mut raw);
    match b.dtype {
        DType::F32 => CpuBuf::F32(
            raw.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ),
        DType::Bf16 => CpuBuf::Bf16(
            raw.chunks_exact(2)
                .map(|c| bf16::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ),
        DType::F16 => CpuBuf::F16(
            raw.chunks_exact(2)
                .map(|c| f16::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ),
        other => panic!("collective on a {other:?} buffer"),
    }
}

fn to_device(st: &dyn Stager, host: &CpuBuf, b: &CudaBuf) {
    let raw: Vec<u8> = match host {
        CpuBuf::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        CpuBuf::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        CpuBuf::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        _ => unreachable!("to_host makes float buffers only"),
    };
    st.upload(b.ptr, &raw);
}

/// Any cpu collective or pipeline link, run on cuda buffers by staging them
/// through the host: ranks simulated on one GPU (`CpuComm`, `CpuP2p`), or
/// ranks as processes without NCCL (`comm::process`).
pub struct Staged<C> {
    inner: C,
    st: Arc<dyn Stager>,
}

impl<C> Staged<C> {
    pub fn new(inner: C, st: Arc<dyn Stager>) -> Self {
        Staged { inner, st }
    }
}

/// One rank's collectives for ranks sharing one GPU.
pub type CudaComm = Staged<CpuComm>;
/// One stage's pipeline links for stages sharing one GPU.
pub type CudaP2p = Staged<CpuP2p>;

impl CudaComm {
    pub fn group(world: usize, st: Arc<dyn Stager>) -> Vec<CudaComm> {
        crate::backend::cpu::comm::cpu_group(world)
            .into_iter()
            .map(|inner| Staged::new(inner, st.clone()))
            .collect()
    }
}

impl CudaP2p {
    /// A chain of `stages` stages, a ring with `ring` (virtual stages).
    pub fn chain(stages: usize, ring: bool, st: Arc<dyn Stager>) -> Vec<CudaP2p> {
        crate::backend::cpu::comm::cpu_pipeline(stages, ring)
            .into_iter()
            .map(|inner| Staged::new(inner, st.clone()))
            .collect()
    }
}

impl<C: Collective<CpuBuf>> Collective<CudaBuf> for Staged<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn all_reduce_sum(&mut self, buf: &mut CudaBuf, n: usize) {
        let mut h = to_host(&*self.st, buf, n);
        self.inner.all_reduce_sum(&mut h, n);
        to_device(&*self.st, &h, buf);
    }
    fn reduce_scatter_sum(&mut self, out: &mut CudaBuf, inp: &CudaBuf, shard: usize) {
        let world = self.inner.world();
        let h_in = to_host(&*self.st, inp, world * shard);
        let mut h_out = to_host(&*self.st, out, shard);
        self.inner.reduce_scatter_sum(&mut h_out, &h_in, shard);
        to_device(&*self.st, &h_out, out);
    }
    fn all_gather(&mut self, out: &mut CudaBuf, inp: &CudaBuf, shard: usize) {
        let world = self.inner.world();
        let h_in = to_host(&*self.st, inp, shard);
        let mut h_out = to_host(&*self.st, out, world * shard);
        self.inner.all_gather(&mut h_out, &h_in, shard);
        to_device(&*self.st, &h_out, out);
    }
    fn broadcast(&mut self, buf: &mut CudaBuf, n: usize, root: usize) {
        let mut h = to_host(&*self.st, buf, n);
        self.inner.broadcast(&mut h, n, root);
        to_device(&*self.st, &h, buf);
    }
    fn all_to_all(&mut self, out: &mut CudaBuf, inp: &CudaBuf, counts: &[usize]) {
        let (world, rank) = (self.inner.world(), self.inner.rank());
        let sent: usize = counts[rank * world..(rank + 1) * world].iter().sum();
        let recv: usize = (0..world).map(|s| counts[s * world + rank]).sum();
        let h_in = to_host(&*self.st, inp, sent);
        let mut h_out = to_host(&*self.st, out, recv);
        self.inner.all_to_all(&mut h_out, &h_in, counts);
        to_device(&*self.st, &h_out, out);
    }
    fn all_reduce_scalar(&mut self, x: f64) -> f64 {
        self.inner.all_reduce_scalar(x)
    }
    fn abort_handle(&self) -> AbortHandle {
        self.inner.abort_handle()
    }
}

impl<P: PointToPoint<CpuBuf>> PointToPoint<CudaBuf> for Staged<P> {
    fn send(&mut self, to: Peer, buf: &CudaBuf, n: usize) {
        let h = to_host(&*self.st, buf, n);
        self.inner.send(to, &h, n);
    }
    fn recv(&mut self, from: Peer, buf: &mut CudaBuf, n: usize) {
        let mut h = to_host(&*self.st, buf, n);
        self.inner.recv(from, &mut h, n);
        to_device(&*self.st, &h, buf);
    }
    fn abort_handle(&self) -> AbortHandle {
        self.inner.abort_handle()
    }
}
