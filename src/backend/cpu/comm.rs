//! The cpu backend's collectives: ranks are threads of one process, and data
//! moves through shared memory.
//!
//! Every call runs the same three phases on every rank:
//!
//! 1. deposit: the rank widens its contribution to `f32` (only the elements
//!    the call names) into its own slot of the shared [`Exchange`];
//! 2. barrier, then each rank reads the slots it needs and writes its result;
//! 3. barrier again, so no rank deposits the next call's data into a slot
//!    another rank is still reading.
//!
//! Reductions add the contributions in rank order 0, 1, ..., N-1 in `f32` and
//! round once into the destination's dtype, so every rank computes the same
//! operations on the same values and gets a bit-identical result, whatever
//! the thread timing. Every rank sums the whole range itself (`N` times the
//! work of a ring), which is nothing next to the compute for the small models
//! the cpu backend trains.
//!
//! The barrier is hand-made (a generation counter under a `Mutex`, a
//! `Condvar`) because [`std::sync::Barrier`] cannot be aborted: after
//! [`Collective::abort`], or a rank's panic, waiting ranks wake up and every
//! later wait returns at once, so the healthy ranks finish instead of hanging.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard};
use std::time::Duration;

use super::CpuBuf;
use crate::backend::DType;
use crate::comm::{AbortHandle, Collective, Peer, PointToPoint};

/// One rank's deposit for the current call.
#[derive(Default)]
struct Slot {
    data: Vec<f32>,
    scalar: f64,
}

/// Barrier state. `generation` counts completed barriers, so a rank woken
/// late still knows its own barrier completed even if the others have
/// already arrived at the next one.
struct Gate {
    arrived: usize,
    generation: u64,
    poisoned: bool,
}

/// What the ranks of one group share.
struct Exchange {
    world: usize,
    gate: Mutex<Gate>,
    cv: Condvar,
    /// Slot `r` is written only by rank `r`, before the first barrier of a
    /// call, and read by everyone between the two barriers: readers never
    /// wait on each other, and a writer never waits at all.
    slots: Vec<RwLock<Slot>>,
}

impl Exchange {
    /// Locks the gate, ignoring poisoning: a rank that panicked elsewhere must
    /// not turn the others' waits into panics.
    fn gate(&self) -> MutexGuard<'_, Gate> {
        self.gate.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn poisoned(&self) -> bool {
        self.gate().poisoned
    }

    /// Waits until all ranks have arrived. `false` when the group was poisoned
    /// before this barrier completed: the caller must not rely on the others'
    /// slots.
    fn wait(&self) -> bool {
        let mut g = self.gate();
        if g.poisoned {
            return false;
        }
        g.arrived += 1;
        if g.arrived == self.world {
            g.arrived = 0;
            g.generation = g.generation.wrapping_add(1);
            self.cv.notify_all();
            return true;
        }
        let mine = g.generation;
        while g.generation == mine && !g.poisoned {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g.generation != mine
    }

    fn poison(&self) {
        self.gate().poisoned = true;
        self.cv.notify_all();
    }
}

/// One rank's handle on a cpu collective group; see [`cpu_group`].
pub struct CpuComm {
    rank: usize,
    world: usize,
    ex: Arc<Exchange>,
}

/// A group of `world` communicators sharing one exchange, rank `i` at index
/// `i`. Hand each to the thread that runs that rank.
pub fn cpu_group(world: usize) -> Vec<CpuComm> {
    assert!(world >= 1, "a collective group needs at least one rank");
    let ex = Arc::new(Exchange {
        world,
        gate: Mutex::new(Gate {
            arrived: 0,
            generation: 0,
            poisoned: false,
        }),
        cv: Condvar::new(),
        slots: (0..world).map(|_| RwLock::default()).collect(),
    });
    (0..world)
        .map(|rank| CpuComm {
            rank,
            world,
            ex: Arc::clone(&ex),
        })
        .collect()
}

/// Panics unless `buf` holds floats: collectives move gradients, weights and
/// optimizer state, never token ids or quantised codes.
fn check_float(buf: &CpuBuf, op: &str) {
    let dt = buf.dtype();
    assert!(
        matches!(dt, DType::F32 | DType::Bf16 | DType::F16),
        "engine bug: cpu {op} on a {dt:?} buffer (only F32, Bf16 and F16 are supported)"
    );
}

/// Panics unless `buf` holds at least `need` elements.
fn check_len(buf: &CpuBuf, need: usize, op: &str, what: &str) {
    assert!(
        buf.len() >= need,
        "engine bug: cpu {op}: {what} holds {} elements, the call needs {need}",
        buf.len()
    );
}

/// Rank `r`'s deposit, checked to have the `len` elements this rank expects:
/// a mismatch means the ranks did not make the same call.
fn part<'a>(slots: &'a [RwLockReadGuard<'_, Slot>], r: usize, len: usize, op: &str) -> &'a [f32] {
    let d = &slots[r].data;
    assert!(
        d.len() == len,
        "engine bug: cpu {op}: rank {r} contributed {} elements, expected {len}",
        d.len()
    );
    d
}

/// `dst = parts[0] + parts[1] + ...`, element by element, left to right.
fn sum_into<'a>(dst: &mut [f32], mut parts: impl Iterator<Item = &'a [f32]>) {
    dst.copy_from_slice(parts.next().expect("a group has at least one rank"));
    for p in parts {
        for (d, s) in dst.iter_mut().zip(p) {
            *d += *s;
        }
    }
}

impl CpuComm {
    /// Phases 1 and 2 of a call: `fill` writes this rank's slot, then waits
    /// until every rank has. `false` (skip the call) when the group is
    /// poisoned. Split from [`CpuComm::collect`] so the source borrow ends
    /// before an in-place call borrows the same buffer mutably.
    fn deposit(&self, fill: impl FnOnce(&mut Slot)) -> bool {
        let ex = &*self.ex;
        if ex.poisoned() {
            return false;
        }
        fill(
            &mut ex.slots[self.rank]
                .write()
                .unwrap_or_else(|e| e.into_inner()),
        );
        ex.wait()
    }

    /// Phase 3: `read` sees every slot in rank order, then waits until every
    /// rank is done reading, so the next call's deposits cannot overwrite a
    /// slot still in use.
    fn collect<R>(&self, read: impl FnOnce(&[RwLockReadGuard<'_, Slot>]) -> R) -> R {
        let ex = &*self.ex;
        let result = {
            let slots: Vec<_> = ex
                .slots
                .iter()
                .map(|s| s.read().unwrap_or_else(|e| e.into_inner()))
                .collect();
            read(&slots)
        };
        // Failing here only means the group was poisoned meanwhile; this
        // rank's result is complete either way.
        ex.wait();
        result
    }
}

/// Fills a slot's data with `src`, reusing its allocation.
fn put(slot: &mut Slot, src: &[f32]) {
    slot.data.clear();
    slot.data.extend_from_slice(src);
}

impl Collective<CpuBuf> for CpuComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&mut self, buf: &mut CpuBuf, n: usize) {
        const OP: &str = "all_reduce_sum";
        check_float(buf, OP);
        check_len(buf, n, OP, "buf");
        let world = self.world;
        if self.deposit(|s| put(s, &buf.wide()[..n])) {
            self.collect(|slots| {
                let mut dst = buf.wide_mut();
                sum_into(&mut dst[..n], (0..world).map(|r| part(slots, r, n, OP)));
            });
        }
    }

    fn reduce_scatter_sum(&mut self, out: &mut CpuBuf, inp: &CpuBuf, shard: usize) {
        const OP: &str = "reduce_scatter_sum";
        check_float(out, OP);
        check_float(inp, OP);
        let (world, rank) = (self.world, self.rank);
        let total = world * shard;
        check_len(inp, total, OP, "inp");
        check_len(out, shard, OP, "out");
        if self.deposit(|s| put(s, &inp.wide()[..total])) {
            let mine = rank * shard..(rank + 1) * shard;
            self.collect(|slots| {
                let mut dst = out.wide_mut();
                let parts = (0..world).map(|r| &part(slots, r, total, OP)[mine.clone()]);
                sum_into(&mut dst[..shard], parts);
            });
        }
    }

    fn all_gather(&mut self, out: &mut CpuBuf, inp: &CpuBuf, shard: usize) {
        const OP: &str = "all_gather";
        check_float(out, OP);
        check_float(inp, OP);
        let world = self.world;
        check_len(inp, shard, OP, "inp");
        check_len(out, world * shard, OP, "out");
        if self.deposit(|s| put(s, &inp.wide()[..shard])) {
            self.collect(|slots| {
                let mut dst = out.wide_mut();
                for r in 0..world {
                    dst[r * shard..(r + 1) * shard].copy_from_slice(part(slots, r, shard, OP));
                }
            });
        }
    }

    fn broadcast(&mut self, buf: &mut CpuBuf, n: usize, root: usize) {
        const OP: &str = "broadcast";
        check_float(buf, OP);
        check_len(buf, n, OP, "buf");
        assert!(
            root < self.world,
            "engine bug: cpu broadcast from root {root} in a group of {}",
            self.world
        );
        let is_root = self.rank == root;
        // Only the root deposits; the others' slots keep stale data nobody reads.
        let deposited = self.deposit(|s| {
            if is_root {
                put(s, &buf.wide()[..n])
            }
        });
        if deposited {
            self.collect(|slots| {
                if !is_root {
                    buf.wide_mut()[..n].copy_from_slice(part(slots, root, n, OP));
                }
            });
        }
    }

    fn all_to_all(&mut self, out: &mut CpuBuf, inp: &CpuBuf, counts: &[usize]) {
        const OP: &str = "all_to_all";
        check_float(out, OP);
        check_float(inp, OP);
        let (world, me) = (self.world, self.rank);
        assert_eq!(counts.len(), world * world, "engine bug: cpu {OP} counts");
        let row = |s: usize| counts[s * world..(s + 1) * world].iter().sum::<usize>();
        let recv: usize = (0..world).map(|s| counts[s * world + me]).sum();
        check_len(inp, row(me), OP, "inp");
        check_len(out, recv, OP, "out");
        if self.deposit(|s| put(s, &inp.wide()[..row(me)])) {
            self.collect(|slots| {
                let mut dst = out.wide_mut();
                for src in 0..world {
                    let n = counts[src * world + me];
                    let (from, to) = crate::comm::all_to_all_offsets(counts, world, src, me);
                    let p = part(slots, src, row(src), OP);
                    dst[to..to + n].copy_from_slice(&p[from..from + n]);
                }
            });
        }
    }

    fn all_reduce_scalar(&mut self, x: f64) -> f64 {
        if !self.deposit(|s| s.scalar = x) {
            return x;
        }
        // Start from rank 0's value rather than 0.0, so one rank returns `x`
        // itself (including -0.0).
        self.collect(|slots| {
            slots[1..]
                .iter()
                .fold(slots[0].scalar, |acc, s| acc + s.scalar)
        })
    }

    fn abort_handle(&self) -> crate::comm::AbortHandle {
        let ex = Arc::clone(&self.ex);
        Arc::new(move || ex.poison())
    }
}

impl Drop for CpuComm {
    /// A rank that panics (an engine bug, a failed assertion here) drops its
    /// communicator while unwinding; poisoning the group then lets the other
    /// ranks return instead of waiting forever for it.
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.ex.poison();
        }
    }
}

/// One pipeline stage's links to its neighbours on cpu: unbounded channels
/// (a send never waits, like `isend`), one per direction and neighbour, all
/// stages sharing one abort flag. Values travel as `f32`, which holds every
/// bf16 and fp16 value exactly, so a 16-bit activation arrives bit for bit.
pub struct CpuP2p {
    to_prev: Option<Sender<Vec<f32>>>,
    to_next: Option<Sender<Vec<f32>>>,
    from_prev: Option<Receiver<Vec<f32>>>,
    from_next: Option<Receiver<Vec<f32>>>,
    aborted: Arc<AtomicBool>,
}

/// The links of a chain of `stages` stages, stage `s` at index `s`; with
/// `ring` (virtual stages) the last stage links on to the first, over
/// channels of their own (two stages then have two links each way).
pub fn cpu_pipeline(stages: usize, ring: bool) -> Vec<CpuP2p> {
    let aborted = Arc::new(AtomicBool::new(false));
    let mut out: Vec<CpuP2p> = (0..stages)
        .map(|_| CpuP2p {
            to_prev: None,
            to_next: None,
            from_prev: None,
            from_next: None,
            aborted: Arc::clone(&aborted),
        })
        .collect();
    let links = if ring { stages } else { stages - 1 };
    for a in 0..links {
        let b = (a + 1) % stages;
        let (fwd_tx, fwd_rx) = channel();
        let (bwd_tx, bwd_rx) = channel();
        out[a].to_next = Some(fwd_tx);
        out[b].from_prev = Some(fwd_rx);
        out[b].to_prev = Some(bwd_tx);
        out[a].from_next = Some(bwd_rx);
    }
    out
}

impl PointToPoint<CpuBuf> for CpuP2p {
    fn send(&mut self, to: Peer, buf: &CpuBuf, n: usize) {
        let tx = match to {
            Peer::Prev => &self.to_prev,
            Peer::Next => &self.to_next,
        };
        let tx = tx.as_ref().expect("a send to a stage that exists");
        // A neighbour that stopped (after an abort) drops nothing we need.
        let _ = tx.send(buf.read_range(0, n).into_owned());
    }

    fn recv(&mut self, from: Peer, buf: &mut CpuBuf, n: usize) {
        let rx = match from {
            Peer::Prev => &self.from_prev,
            Peer::Next => &self.from_next,
        };
        let rx = rx.as_ref().expect("a receive from a stage that exists");
        loop {
            if self.aborted.load(Ordering::Acquire) {
                return;
            }
            match rx.recv_timeout(Duration::from_millis(5)) {
                Ok(v) => {
                    assert_eq!(v.len(), n, "point-to-point message size");
                    buf.write_range(0, &v, false);
                    return;
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn abort_handle(&self) -> AbortHandle {
        let a = Arc::clone(&self.aborted);
        Arc::new(move || a.store(true, Ordering::Release))
    }
}

impl Drop for CpuP2p {
    /// As [`CpuComm`]: a stage that panics releases its neighbours.
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.aborted.store(true, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;
    use std::time::{Duration, Instant};

    const WORLDS: [usize; 4] = [1, 2, 3, 4];

    fn assert_send<T: Send>() {}

    /// Runs `f(comm)` on one thread per rank; results in rank order.
    fn run<R: Send>(world: usize, f: impl Fn(&mut CpuComm) -> R + Sync) -> Vec<R> {
        let comms = cpu_group(world);
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|mut c| {
                    let f = &f;
                    s.spawn(move || f(&mut c))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Rank `r`'s test values: not exactly representable sums, different per rank.
    fn contribution(rank: usize, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (rank as f32 + 1.0) * 0.1 + (i as f32) * 1.37e-3 - 0.05 * (i % 7) as f32)
            .collect()
    }

    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn comm_is_send() {
        assert_send::<CpuComm>();
    }

    #[test]
    fn all_reduce_f32_is_rank_order_sum() {
        for world in WORLDS {
            let n = 37;
            let outs = run(world, |c| {
                // A tail beyond n that must stay untouched.
                let mut v = contribution(c.rank(), n);
                v.push(-7.0);
                let mut buf = CpuBuf::F32(v);
                c.all_reduce_sum(&mut buf, n);
                buf.as_f32().to_vec()
            });
            let mut want = contribution(0, n);
            for r in 1..world {
                for (w, x) in want.iter_mut().zip(contribution(r, n)) {
                    *w += x;
                }
            }
            for out in &outs {
                assert_eq!(out[n], -7.0);
                let bits: Vec<u32> = out[..n].iter().map(|x| x.to_bits()).collect();
                let want_bits: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
                assert_eq!(bits, want_bits, "world {world}");
            }
        }
    }

    #[test]
    fn all_reduce_bf16_rounds_once() {
        for world in WORLDS {
            let n = 29;
            let to_bf16 = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
            let outs = run(world, |c| {
                let mut buf = CpuBuf::Bf16(to_bf16(contribution(c.rank(), n)));
                c.all_reduce_sum(&mut buf, n);
                match buf {
                    CpuBuf::Bf16(v) => v,
                    _ => unreachable!(),
                }
            });
            // Widen the bf16 inputs, add in f32 in rank order, round once.
            let ins: Vec<Vec<f32>> = (0..world)
                .map(|r| {
                    to_bf16(contribution(r, n))
                        .iter()
                        .map(|x| x.to_f32())
                        .collect()
                })
                .collect();
            let want: Vec<bf16> = (0..n)
                .map(|i| bf16::from_f32((1..world).fold(ins[0][i], |a, r| a + ins[r][i])))
                .collect();
            for out in &outs {
                assert_eq!(
                    out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "world {world}"
                );
            }
        }
    }

    #[test]
    fn reduce_scatter_and_all_gather_exact() {
        for world in WORLDS {
            let shard = 5;
            let outs = run(world, |c| {
                let rank = c.rank();
                let val = |r: usize, i: usize| (r * 1000 + i) as f32;
                // reduce_scatter: rank r's input element i is r*1000 + i.
                let inp = CpuBuf::F32((0..world * shard).map(|i| val(rank, i)).collect());
                let mut rs = CpuBuf::F32(vec![f32::NAN; shard]);
                c.reduce_scatter_sum(&mut rs, &inp, shard);
                // all_gather: rank r's shard element i is r*1000 + i.
                let mine = CpuBuf::F32((0..shard).map(|i| val(rank, i)).collect());
                let mut ag = CpuBuf::F32(vec![f32::NAN; world * shard]);
                c.all_gather(&mut ag, &mine, shard);
                // Round trip: gather everyone's shard, then reduce-scatter it
                // back: each rank gets its own shard times `world`.
                let mut back = CpuBuf::F32(vec![0.0; shard]);
                c.reduce_scatter_sum(&mut back, &ag, shard);
                (
                    rank,
                    rs.as_f32().to_vec(),
                    ag.as_f32().to_vec(),
                    back.as_f32().to_vec(),
                )
            });
            for (rank, rs, ag, back) in outs {
                for i in 0..shard {
                    let idx = rank * shard + i;
                    let want: f32 = (0..world).map(|r| (r * 1000 + idx) as f32).sum();
                    assert_eq!(rs[i], want, "world {world} rank {rank}");
                    assert_eq!(back[i], world as f32 * (rank * 1000 + i) as f32);
                }
                for r in 0..world {
                    for i in 0..shard {
                        assert_eq!(ag[r * shard + i], (r * 1000 + i) as f32);
                    }
                }
            }
        }
    }

    #[test]
    fn all_to_all_delivers_each_pair_its_part() {
        // Rank s sends s * 3 + d + 1 elements to rank d, each valued
        // 100 s + d, so every element names its pair.
        let world = 3;
        let counts: Vec<usize> = (0..world * world).map(|x| x + 1).collect();
        let got = run(world, |c| {
            let me = c.rank();
            let send: Vec<f32> = (0..world)
                .flat_map(|d| vec![(100 * me + d) as f32; counts[me * world + d]])
                .collect();
            let n: usize = (0..world).map(|s| counts[s * world + me]).sum();
            let mut out = CpuBuf::F32(vec![-1.0; n]);
            c.all_to_all(&mut out, &CpuBuf::F32(send), &counts);
            out.wide().to_vec()
        });
        for (me, v) in got.iter().enumerate() {
            let want: Vec<f32> = (0..world)
                .flat_map(|s| vec![(100 * s + me) as f32; counts[s * world + me]])
                .collect();
            assert_eq!(v, &want, "rank {me}");
        }
    }

    #[test]
    fn broadcast_from_last_rank() {
        for world in WORLDS {
            let root = world - 1;
            let outs = run(world, |c| {
                let mut v = contribution(c.rank(), 9);
                v.push(c.rank() as f32);
                let mut buf = CpuBuf::F32(v);
                c.broadcast(&mut buf, 9, root);
                (c.rank(), buf.as_f32().to_vec())
            });
            for (rank, out) in outs {
                assert_eq!(&out[..9], &contribution(root, 9)[..]);
                assert_eq!(out[9], rank as f32, "the tail stays this rank's");
            }
        }
    }

    #[test]
    fn scalar_sum() {
        for world in WORLDS {
            let outs = run(world, |c| c.all_reduce_scalar(0.1 * (c.rank() + 1) as f64));
            let want = (1..world).fold(0.1, |a, r| a + 0.1 * (r + 1) as f64);
            for out in outs {
                assert_eq!(out.to_bits(), want.to_bits());
            }
        }
    }

    #[test]
    fn many_back_to_back_calls_with_jitter() {
        for world in WORLDS {
            run(world, |c| {
                let rank = c.rank();
                let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ ((rank as u64 + 1) * 0x1234_5678);
                let shard = 3;
                for step in 0..200 {
                    if xorshift(&mut rng).is_multiple_of(4) {
                        let us = xorshift(&mut rng) % 200;
                        std::thread::sleep(Duration::from_micros(us));
                    }
                    let tag = (step * 10) as f32;
                    match step % 4 {
                        0 => {
                            let mut b = CpuBuf::F32(vec![tag + rank as f32; 4]);
                            c.all_reduce_sum(&mut b, 4);
                            let want = (0..world).map(|r| tag + r as f32).sum::<f32>();
                            assert_eq!(b.as_f32(), &[want; 4], "step {step}");
                        }
                        1 => {
                            let inp = CpuBuf::F32(vec![tag + rank as f32; shard]);
                            let mut out = CpuBuf::F32(vec![0.0; world * shard]);
                            c.all_gather(&mut out, &inp, shard);
                            for r in 0..world {
                                let got = &out.as_f32()[r * shard..(r + 1) * shard];
                                assert_eq!(got, &[tag + r as f32; 3], "step {step}");
                            }
                        }
                        2 => {
                            let inp = CpuBuf::F32(
                                (0..world * shard)
                                    .map(|i| tag + (rank * 100 + i) as f32)
                                    .collect(),
                            );
                            let mut out = CpuBuf::F32(vec![0.0; shard]);
                            c.reduce_scatter_sum(&mut out, &inp, shard);
                            for i in 0..shard {
                                let idx = rank * shard + i;
                                let want: f32 =
                                    (0..world).map(|r| tag + (r * 100 + idx) as f32).sum();
                                assert_eq!(out.as_f32()[i], want, "step {step}");
                            }
                        }
                        _ => {
                            let root = step / 4 % world;
                            let mut b = CpuBuf::F32(vec![tag + rank as f32; 2]);
                            c.broadcast(&mut b, 2, root);
                            assert_eq!(b.as_f32(), &[tag + root as f32; 2], "step {step}");
                            let s = c.all_reduce_scalar(step as f64 + rank as f64);
                            let want = (0..world).map(|r| (step + r) as f64).sum::<f64>();
                            assert_eq!(s, want, "step {step}");
                        }
                    }
                }
            });
        }
    }

    #[test]
    fn abort_releases_waiting_ranks() {
        for world in WORLDS {
            let start = Instant::now();
            run(world, |c| {
                if c.rank() == 0 {
                    // Let the others reach the barrier first (usually).
                    std::thread::sleep(Duration::from_millis(20));
                    c.abort();
                } else {
                    let mut b = CpuBuf::F32(vec![1.0; 8]);
                    c.all_reduce_sum(&mut b, 8);
                    // Later calls return at once too.
                    c.all_gather(&mut CpuBuf::F32(vec![0.0; 8 * world]), &b, 8);
                    c.all_reduce_scalar(1.0);
                }
            });
            assert!(start.elapsed() < Duration::from_secs(5), "world {world}");
        }
    }

    #[test]
    fn a_panicking_rank_poisons_the_group() {
        let world = 3;
        let comms = cpu_group(world);
        let results: Vec<bool> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || {
                        if c.rank() == 1 {
                            // An engine bug: collectives never move token ids.
                            let mut ids = CpuBuf::U32(vec![0; 4]);
                            c.all_reduce_sum(&mut ids, 4);
                        } else {
                            let mut b = CpuBuf::F32(vec![1.0; 4]);
                            c.all_reduce_sum(&mut b, 4);
                        }
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().is_ok()).collect()
        });
        assert_eq!(results, vec![true, false, true]);
    }
}
