//! Collective communication among the ranks of one data-parallel job.
//!
//! One trait, [`Collective`], covers all-reduce, reduce-scatter, all-gather and
//! broadcast on device buffers, shaped after NCCL: each call names a device
//! buffer and an element count, every rank of the group makes the same calls
//! in the same order, and results land in device memory. A NCCL
//! implementation maps each method onto `ncclAllReduce`, `ncclReduceScatter`,
//! `ncclAllGather` and `ncclBroadcast` on the backend's stream.
//!
//! * cpu (`backend::cpu::comm`): ranks are threads; data moves through
//!   shared memory, and every reduction adds the ranks' contributions in rank
//!   order 0, 1, ..., N-1 (in f32, rounded once into the buffer's dtype), so the
//!   result is deterministic and identical on every rank.
//! * meta ([`MetaComm`]): moves nothing. The engine still allocates and tracks
//!   the buffers the collectives use (category `communication`) and counts
//!   the bytes each rank sends and receives (see [`wire_bytes`]).

pub mod process;
pub mod topology;

/// Which collective, for byte counting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    /// Expert parallelism's token exchange: each rank sends a part of its
    /// buffer to every rank (NCCL: grouped `ncclSend`/`ncclRecv`).
    AllToAll,
}

/// Collective operations on device buffers of type `Buf`. Every rank calls the
/// same methods with the same sizes in the same order.
pub trait Collective<Buf>: Send {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;

    /// In place: `buf[..n] = sum over ranks of buf[..n]`.
    fn all_reduce_sum(&mut self, buf: &mut Buf, n: usize);

    /// `out[..shard] = sum over ranks r' of inp[rank*shard .. (rank+1)*shard]`
    /// from every rank r'; `inp` holds `world * shard` elements.
    fn reduce_scatter_sum(&mut self, out: &mut Buf, inp: &Buf, shard: usize);

    /// `out[r*shard .. (r+1)*shard] = inp[..shard]` of rank r, for every r;
    /// `out` holds `world * shard` elements.
    fn all_gather(&mut self, out: &mut Buf, inp: &Buf, shard: usize);

    /// In place: `buf[..n] = root's buf[..n]`.
    fn broadcast(&mut self, buf: &mut Buf, n: usize, root: usize);

    /// All-to-all with per-pair counts: `counts[s * world + d]` elements go
    /// from rank `s` to rank `d`. Each rank's `inp` holds its sends to rank
    /// 0, 1, ... one after another; `out` receives from rank 0, 1, ... one
    /// after another. Every rank passes the same `counts` (expert
    /// parallelism all-gathers them first, as Megatron-Core's dispatcher
    /// does).
    fn all_to_all(&mut self, out: &mut Buf, inp: &Buf, counts: &[usize]);

    /// A host scalar summed over ranks in rank order (gradient norms, losses).
    fn all_reduce_scalar(&mut self, x: f64) -> f64;

    /// Marks the group failed (a rank ran out of memory or panicked): every
    /// pending and later collective of every rank returns at once with
    /// unspecified contents, so the other ranks finish instead of waiting
    /// forever. The job's result is then the failing rank's error.
    fn abort(&self) {
        (self.abort_handle())()
    }

    /// [`Collective::abort`] as a handle that outlives borrows of the
    /// communicator (the thread that runs a rank holds it mutably).
    fn abort_handle(&self) -> AbortHandle;

    /// A second handle on the same rank of the same group, for a planning
    /// engine forked from another (`Engine::reshaped`). Only collectives
    /// that hold no connection can be copied: `None` for the rest.
    fn fork(&self) -> Option<Box<dyn Collective<Buf>>> {
        None
    }
}

/// Aborts a collective group; see [`Collective::abort`].
pub type AbortHandle = std::sync::Arc<dyn Fn() + Send + Sync>;

/// Bytes one rank sends and receives for one call, by the ring algorithms NCCL
/// uses (nccl-tests, doc/PERFORMANCE.md: all-reduce moves `2(N-1)/N` of the
/// buffer per rank, reduce-scatter and all-gather `(N-1)/N` of the full
/// buffer). `bytes` is the size of the full buffer: the all-reduce buffer, the
/// reduce-scatter input, the all-gather output, the broadcast buffer. A ring
/// broadcast from `root` is pipelined along `root, root+1, ...`: every rank but
/// the root receives the buffer once, every rank but the ring's last sends it.
/// Returns `(sent, received)`.
pub fn wire_bytes(op: Op, bytes: u64, world: usize, rank: usize, root: usize) -> (u64, u64) {
    let (b, n) = (bytes as u128, world as u128);
    if world <= 1 {
        return (0, 0);
    }
    let (sent, recv) = match op {
        Op::AllReduce => {
            let x = 2 * (n - 1) * b / n;
            (x, x)
        }
        Op::ReduceScatter | Op::AllGather => {
            let x = (n - 1) * b / n;
            (x, x)
        }
        Op::AllToAll => unreachable!("all-to-all's bytes come from its counts: all_to_all_bytes"),
        Op::Broadcast => {
            let pos = (rank + world - root) % world;
            let sent = if pos + 1 < world { b } else { 0 };
            let recv = if pos == 0 { 0 } else { b };
            (sent, recv)
        }
    };
    (sent as u64, recv as u64)
}

/// What `rank` sends and receives, in elements, in an all-to-all of
/// `counts` (as [`Collective::all_to_all`] takes them), its own part
/// excluded: `(sent, received)`.
pub fn all_to_all_elems(counts: &[usize], world: usize, rank: usize) -> (usize, usize) {
    let sent = (0..world)
        .filter(|&d| d != rank)
        .map(|d| counts[rank * world + d])
        .sum();
    let recv = (0..world)
        .filter(|&s| s != rank)
        .map(|s| counts[s * world + rank])
        .sum();
    (sent, recv)
}

/// Where rank `src`'s part for rank `dst` starts in `src`'s send buffer,
/// and where it lands in `dst`'s receive buffer.
pub fn all_to_all_offsets(
    counts: &[usize],
    world: usize,
    src: usize,
    dst: usize,
) -> (usize, usize) {
    let send = (0..dst).map(|d| counts[src * world + d]).sum();
    let recv = (0..src).map(|s| counts[s * world + dst]).sum();
    (send, recv)
}

/// A pipeline stage's neighbour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    /// The stage before (towards the embedding): activation gradients go there.
    Prev,
    /// The stage after (towards the head): activations go there.
    Next,
}

/// Point-to-point messages between adjacent pipeline stages, shaped like
/// NCCL's `ncclSend`/`ncclRecv` (or `torch.distributed.isend`/`irecv`): a send
/// returns once its data is handed over, so a stage never waits for its
/// neighbour to post the matching receive; a receive waits for the data.
/// Messages in one direction arrive in the order they were sent.
pub trait PointToPoint<Buf>: Send {
    /// Sends `buf[..n]` to `to`.
    fn send(&mut self, to: Peer, buf: &Buf, n: usize);
    /// Fills `buf[..n]` with the next message from `from`. After an abort it
    /// returns at once with unspecified contents, as the collectives do.
    fn recv(&mut self, from: Peer, buf: &mut Buf, n: usize);
    /// Makes every pending and later receive of the pipeline return at once.
    fn abort_handle(&self) -> AbortHandle;
}

/// The meta backend's point-to-point: no data, nothing to wait for.
#[derive(Clone, Copy, Debug, Default)]
pub struct MetaP2p;

impl PointToPoint<()> for MetaP2p {
    fn send(&mut self, _: Peer, _: &(), _: usize) {}
    fn recv(&mut self, _: Peer, _: &mut (), _: usize) {}
    fn abort_handle(&self) -> AbortHandle {
        std::sync::Arc::new(|| {})
    }
}

/// The meta backend's collectives: no data moves. Meta ranks run one after
/// another (nothing to wait for), each with its own `MetaComm`.
#[derive(Clone, Copy, Debug)]
pub struct MetaComm {
    rank: usize,
    world: usize,
}

impl MetaComm {
    pub fn new(rank: usize, world: usize) -> Self {
        assert!(rank < world, "rank {rank} of {world}");
        MetaComm { rank, world }
    }
}

impl Collective<()> for MetaComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_reduce_sum(&mut self, _: &mut (), _: usize) {}
    fn reduce_scatter_sum(&mut self, _: &mut (), _: &(), _: usize) {}
    fn all_gather(&mut self, _: &mut (), _: &(), _: usize) {}
    fn broadcast(&mut self, _: &mut (), _: usize, _: usize) {}
    fn all_to_all(&mut self, _: &mut (), _: &(), _: &[usize]) {}
    /// Meta has no values to add; the engine never asks it for one.
    fn all_reduce_scalar(&mut self, x: f64) -> f64 {
        x
    }
    fn abort_handle(&self) -> AbortHandle {
        std::sync::Arc::new(|| {})
    }
    fn fork(&self) -> Option<Box<dyn Collective<()>>> {
        Some(Box::new(*self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_byte_counts() {
        // 4 ranks, 1000 bytes: all-reduce 2*3/4, reduce-scatter and all-gather 3/4.
        assert_eq!(wire_bytes(Op::AllReduce, 1000, 4, 0, 0), (1500, 1500));
        assert_eq!(wire_bytes(Op::ReduceScatter, 1000, 4, 2, 0), (750, 750));
        assert_eq!(wire_bytes(Op::AllGather, 1000, 4, 3, 0), (750, 750));
        assert_eq!(wire_bytes(Op::Broadcast, 1000, 4, 0, 0), (1000, 0));
        assert_eq!(wire_bytes(Op::Broadcast, 1000, 4, 3, 0), (0, 1000));
        assert_eq!(wire_bytes(Op::Broadcast, 1000, 4, 0, 1), (0, 1000));
        assert_eq!(wire_bytes(Op::AllReduce, 1000, 1, 0, 0), (0, 0));
    }

    #[test]
    fn all_to_all_counts_and_offsets() {
        // 3 ranks; row s: what rank s sends to 0, 1, 2.
        let c = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        assert_eq!(all_to_all_elems(&c, 3, 0), (5, 11));
        assert_eq!(all_to_all_elems(&c, 3, 1), (10, 10));
        // Rank 2's part for rank 1 starts after its 7 for rank 0, and lands
        // after rank 0's 2 and rank 1's 5.
        assert_eq!(all_to_all_offsets(&c, 3, 2, 1), (7, 7));
        assert_eq!(all_to_all_offsets(&c, 3, 0, 0), (0, 0));
    }
}
