//! The cpu backend's collectives between processes: [`ProcessComm`] and
//! [`ProcessP2p`] run over a `comm::process::ProcessGroup` (its rendezvous,
//! TCP mesh and failure handling) on cpu buffers.
//!
//! They compute exactly what `CpuComm` computes: contributions travel as
//! `f32` (which holds every bf16 and fp16 value exactly), every rank adds
//! them in rank order 0, 1, ..., N-1 in `f32` and rounds once into the
//! buffer's dtype, so results are bit-identical to a threaded run with the
//! same inputs, on every rank. Each rank sends its contribution to every
//! other (N times a ring's traffic): correctness and determinism first, for
//! the model sizes the cpu backend trains.

use std::sync::Arc;

use super::CpuBuf;
use crate::backend::DType;
use crate::comm::process::ProcessGroup;
use crate::comm::{AbortHandle, Collective, Peer, PointToPoint};

/// `f32` values as little-endian bytes.
fn encode(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * 4);
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

fn decode(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

/// Panics unless `buf` holds floats (as `CpuComm`).
fn check_float(buf: &CpuBuf, op: &str) {
    let dt = buf.dtype();
    assert!(
        matches!(dt, DType::F32 | DType::Bf16 | DType::F16),
        "engine bug: process-group {op} on a {dt:?} buffer (only F32, Bf16 and F16 are supported)"
    );
}

fn check_len(buf: &CpuBuf, need: usize, op: &str, what: &str) {
    assert!(
        buf.len() >= need,
        "engine bug: process-group {op}: {what} holds {} elements, the call needs {need}",
        buf.len()
    );
}

/// `dst = parts[0] + parts[1] + ...`, element by element, left to right: the
/// order `CpuComm` adds in.
fn sum_into(dst: &mut [f32], parts: &[&[f32]]) {
    dst.copy_from_slice(parts[0]);
    for p in &parts[1..] {
        for (d, s) in dst.iter_mut().zip(p.iter()) {
            *d += *s;
        }
    }
}

/// One rank's collective group over processes; see the module docs.
pub struct ProcessComm {
    group: Arc<ProcessGroup>,
    channel: u32,
    /// Global ranks, in group order.
    members: Vec<usize>,
    /// This rank's index in `members`.
    me: usize,
}

impl ProcessComm {
    /// A collective group over `members` (global ranks, this one included),
    /// its messages on `channel`; every member must use the same channel.
    pub fn new(group: &Arc<ProcessGroup>, channel: u32, members: Vec<usize>) -> ProcessComm {
        ProcessGroup::check_channel(channel);
        let me = members
            .iter()
            .position(|&r| r == group.rank())
            .expect("engine bug: a process group without this rank");
        ProcessComm {
            group: Arc::clone(group),
            channel,
            members,
            me,
        }
    }

    /// Sends `payload(i)` to every other member `i`; `false` if the group failed.
    fn send_each(&self, payload: impl Fn(usize) -> Vec<u8>) -> bool {
        for (i, &peer) in self.members.iter().enumerate() {
            if i != self.me && !self.group.send_data(peer, self.channel, &payload(i)) {
                return false;
            }
        }
        true
    }

    /// One message from every other member, in group order (`None` at this
    /// rank's index), each `len` values; `None` if the group failed.
    fn recv_each(&self, len: usize, op: &str) -> Option<Vec<Option<Vec<f32>>>> {
        self.recv_sized(|_| len, op)
    }

    /// [`ProcessComm::recv_each`] with member `i`'s message `len(i)` long.
    fn recv_sized(&self, len: impl Fn(usize) -> usize, op: &str) -> Option<Vec<Option<Vec<f32>>>> {
        let mut out = Vec::with_capacity(self.members.len());
        for (i, &peer) in self.members.iter().enumerate() {
            if i == self.me {
                out.push(None);
                continue;
            }
            let v = decode(&self.group.recv(peer, self.channel)?);
            let len = len(i);
            if v.len() != len {
                self.group.wrong_size(format_args!(
                    "process-group {op}: rank {peer} contributed {} elements, expected {len}",
                    v.len()
                ));
                return None;
            }
            out.push(Some(v));
        }
        Some(out)
    }
}

impl Collective<CpuBuf> for ProcessComm {
    fn rank(&self) -> usize {
        self.me
    }

    fn world(&self) -> usize {
        self.members.len()
    }

    fn all_reduce_sum(&mut self, buf: &mut CpuBuf, n: usize) {
        const OP: &str = "all_reduce_sum";
        check_float(buf, OP);
        check_len(buf, n, OP, "buf");
        let mine = buf.wide()[..n].to_vec();
        let bytes = encode(&mine);
        if !self.send_each(|_| bytes.clone()) {
            return;
        }
        let Some(theirs) = self.recv_each(n, OP) else {
            return;
        };
        let parts: Vec<&[f32]> = theirs
            .iter()
            .map(|p| p.as_deref().unwrap_or(&mine))
            .collect();
        let mut dst = buf.wide_mut();
        sum_into(&mut dst[..n], &parts);
    }

    fn reduce_scatter_sum(&mut self, out: &mut CpuBuf, inp: &CpuBuf, shard: usize) {
        const OP: &str = "reduce_scatter_sum";
        check_float(out, OP);
        check_float(inp, OP);
        let world = self.members.len();
        check_len(inp, world * shard, OP, "inp");
        check_len(out, shard, OP, "out");
        let all = inp.wide()[..world * shard].to_vec();
        if !self.send_each(|i| encode(&all[i * shard..(i + 1) * shard])) {
            return;
        }
        let Some(theirs) = self.recv_each(shard, OP) else {
            return;
        };
        let mine = &all[self.me * shard..(self.me + 1) * shard];
        let parts: Vec<&[f32]> = theirs
            .iter()
            .map(|p| p.as_deref().unwrap_or(mine))
            .collect();
        let mut dst = out.wide_mut();
        sum_into(&mut dst[..shard], &parts);
    }

    fn all_gather(&mut self, out: &mut CpuBuf, inp: &CpuBuf, shard: usize) {
        const OP: &str = "all_gather";
        check_float(out, OP);
        check_float(inp, OP);
        let world = self.members.len();
        check_len(inp, shard, OP, "inp");
        check_len(out, world * shard, OP, "out");
        let mine = inp.wide()[..shard].to_vec();
        let bytes = encode(&mine);
        if !self.send_each(|_| bytes.clone()) {
            return;
        }
        let Some(theirs) = self.recv_each(shard, OP) else {
            return;
        };
        let mut dst = out.wide_mut();
        for (r, p) in theirs.iter().enumerate() {
            dst[r * shard..(r + 1) * shard].copy_from_slice(p.as_deref().unwrap_or(&mine));
        }
    }

    fn all_to_all(&mut self, out: &mut CpuBuf, inp: &CpuBuf, counts: &[usize]) {
        const OP: &str = "all_to_all";
        check_float(out, OP);
        check_float(inp, OP);
        let (world, me) = (self.members.len(), self.me);
        assert_eq!(counts.len(), world * world, "engine bug: {OP} counts");
        let at = |s: usize, d: usize| crate::comm::all_to_all_offsets(counts, world, s, d);
        let n = |s: usize, d: usize| counts[s * world + d];
        let recv: usize = (0..world).map(|s| n(s, me)).sum();
        let sent: usize = (0..world).map(|d| n(me, d)).sum();
        check_len(inp, sent, OP, "inp");
        check_len(out, recv, OP, "out");
        let all = inp.wide()[..sent].to_vec();
        if !self.send_each(|d| encode(&all[at(me, d).0..][..n(me, d)])) {
            return;
        }
        let Some(theirs) = self.recv_sized(|s| n(s, me), OP) else {
            return;
        };
        let mut dst = out.wide_mut();
        for (s, p) in theirs.iter().enumerate() {
            let mine = &all[at(me, me).0..][..n(me, me)];
            dst[at(s, me).1..][..n(s, me)].copy_from_slice(p.as_deref().unwrap_or(mine));
        }
    }

    fn broadcast(&mut self, buf: &mut CpuBuf, n: usize, root: usize) {
        const OP: &str = "broadcast";
        check_float(buf, OP);
        check_len(buf, n, OP, "buf");
        let world = self.members.len();
        assert!(
            root < world,
            "engine bug: process-group broadcast from root {root} in a group of {world}"
        );
        if self.me == root {
            let bytes = encode(&buf.wide()[..n]);
            self.send_each(|_| bytes.clone());
            return;
        }
        let Some(m) = self.group.recv(self.members[root], self.channel) else {
            return;
        };
        let v = decode(&m);
        if v.len() != n {
            self.group.wrong_size(format_args!(
                "process-group {OP}: the root sent {} elements, expected {n}",
                v.len()
            ));
            return;
        }
        buf.wide_mut()[..n].copy_from_slice(&v);
    }

    fn all_reduce_scalar(&mut self, x: f64) -> f64 {
        if !self.send_each(|_| x.to_le_bytes().to_vec()) {
            return x;
        }
        let mut acc: Option<f64> = None;
        for (i, &peer) in self.members.iter().enumerate() {
            let v = if i == self.me {
                x
            } else {
                let Some(m) = self.group.recv(peer, self.channel) else {
                    return x;
                };
                let Ok(b) = <[u8; 8]>::try_from(m.as_slice()) else {
                    self.group.wrong_size(format_args!(
                        "process-group all_reduce_scalar: rank {peer} sent {} bytes, not 8",
                        m.len()
                    ));
                    return x;
                };
                f64::from_le_bytes(b)
            };
            // From rank 0's value rather than 0.0, as CpuComm: one rank returns `x` itself.
            acc = Some(acc.map_or(v, |a| a + v));
        }
        acc.unwrap_or(x)
    }

    fn abort_handle(&self) -> AbortHandle {
        self.group.abort_handle()
    }
}

impl Drop for ProcessComm {
    /// A rank that panics releases the others at once (its process exiting
    /// would too, a little later).
    fn drop(&mut self) {
        if std::thread::panicking() {
            let me = self.group.rank();
            self.group.abort(101, format!("rank {me} panicked"));
        }
    }
}

/// One pipeline stage's links to its neighbours in other processes. A send
/// hands its data to the kernel and returns (the neighbour's reader thread
/// drains it), so it never waits for the matching receive, like `isend`.
/// Activations (towards `next`) and gradients (towards `prev`) travel on
/// channels of their own: in a ring of two stages (virtual stages) the
/// neighbour before and the one after are the same rank, which sends both.
pub struct ProcessP2p {
    group: Arc<ProcessGroup>,
    channel: u32,
    prev: Option<usize>,
    next: Option<usize>,
}

/// Set on the channel of the messages that travel towards the embedding.
const BACKWARD: u32 = 1 << 30;

impl ProcessP2p {
    /// This rank's pipeline links: `prev` and `next` are global ranks.
    pub fn new(
        group: &Arc<ProcessGroup>,
        channel: u32,
        prev: Option<usize>,
        next: Option<usize>,
    ) -> ProcessP2p {
        assert!(channel < BACKWARD, "engine bug: pipeline channel {channel}");
        ProcessGroup::check_channel(channel | BACKWARD);
        ProcessP2p {
            group: Arc::clone(group),
            channel,
            prev,
            next,
        }
    }

    /// The rank of neighbour `p`.
    fn peer(&self, p: Peer) -> usize {
        match p {
            Peer::Prev => self.prev,
            Peer::Next => self.next,
        }
        .expect("engine bug: a message to a stage that does not exist")
    }

    /// The channel of a message sent to `to` (or, with `recv`, received
    /// from it): a send to the next stage and a receive from the previous
    /// are activations, the others gradients.
    fn channel(&self, p: Peer, recv: bool) -> u32 {
        match (p, recv) {
            (Peer::Next, false) | (Peer::Prev, true) => self.channel,
            _ => self.channel | BACKWARD,
        }
    }
}

impl PointToPoint<CpuBuf> for ProcessP2p {
    fn send(&mut self, to: Peer, buf: &CpuBuf, n: usize) {
        let (peer, ch) = (self.peer(to), self.channel(to, false));
        self.group
            .send_data(peer, ch, &encode(&buf.read_range(0, n)));
    }

    fn recv(&mut self, from: Peer, buf: &mut CpuBuf, n: usize) {
        let (peer, ch) = (self.peer(from), self.channel(from, true));
        let Some(m) = self.group.recv(peer, ch) else {
            return;
        };
        let v = decode(&m);
        if v.len() != n {
            self.group.wrong_size(format_args!(
                "process-group point-to-point: rank {peer} sent {} elements, expected {n}",
                v.len()
            ));
            return;
        }
        buf.write_range(0, &v, false);
    }

    fn abort_handle(&self) -> AbortHandle {
        self.group.abort_handle()
    }
}

impl Drop for ProcessP2p {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let me = self.group.rank();
            self.group.abort(101, format!("rank {me} panicked"));
        }
    }
}
