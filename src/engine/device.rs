//! A backend plus its memory tracker and op-cost counter.
//!
//! Every allocation the engine makes goes through [`Device::alloc`], and every op
//! through a [`Device`] method that first counts the op's FLOPs and bytes moved,
//! then calls the backend. Because this layer is shared by all backends, the
//! tracked bytes and counted costs cannot differ between cpu and meta.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use serde::Serialize;

use super::ops::{Kind, Work};
use crate::backend::{
    AdafactorHyper, AdafactorSecond, AdafactorState, AdamHyper, AttnOpts, AttnShape, Backend,
    DType, SgdHyper,
};
use crate::comm::{Collective, Op, Peer, PointToPoint, wire_bytes};
use crate::config::attention_kernels::{KernelRates, MAX_HEAD_DIMS};
use crate::memory::{ByCategory, Category, OomError, Phase, Tracker};

/// A device buffer with its size, element type and memory category.
#[derive(Debug)]
pub struct Tensor<Buf> {
    pub buf: Buf,
    pub len: usize,
    pub dtype: DType,
    pub category: Category,
    /// Its block in the modelled caching allocator (0: none).
    pub block: u64,
    /// Offloaded: held in host memory (the host tracker), not on the device.
    pub host: bool,
    /// A paged optimizer's state: in unified memory (the paged tracker),
    /// outside the device's tracker and the caching allocator.
    pub paged: bool,
}

/// A meta tensor holds no data: a copy is its description, for a planning
/// engine forked from another (`Engine::reshaped`). Tensors with data are
/// not copied (each buffer is freed once).
impl Clone for Tensor<()> {
    fn clone(&self) -> Self {
        Tensor { ..*self }
    }
}

impl<Buf> Tensor<Buf> {
    pub fn bytes(&self) -> u64 {
        (self.len * self.dtype.size()) as u64
    }
}

/// FLOPs and bytes moved by one kind of op, summed over its calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OpCost {
    pub calls: u64,
    /// u128: a 70B model at long context passes 2^64 FLOPs per step.
    pub flops: u128,
    pub bytes: u128,
    /// Wall time spent in the backend (near zero on meta).
    pub ns: u64,
}

/// Costs by op name.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CostCounter {
    pub ops: BTreeMap<&'static str, OpCost>,
    /// Seconds the ops take by the roofline model, when the device has one.
    pub roofline_s: f64,
    /// Only `roofline_s` is kept (a planner's device, which reads nothing
    /// else): the per-op table's lookup was a tenth of a plan's time.
    #[serde(skip)]
    pub seconds_only: bool,
}

/// A per-op roofline: each op takes `max(flops / flops_per_s, bytes /
/// bytes_per_s)` (Williams, Waterman and Patterson, Roofline, CACM 2009),
/// plus a fixed `op_overhead_s` (a kernel launch), which is what bounds
/// tiny models. GEMMs (`matmul*`) run at `flops_per_s`; every other op's
/// arithmetic (attention kernels, norms, activations, the optimizer) at
/// `kernel_flops_per_s`, which on a GPU is the same peak and on a CPU host
/// is far below its GEMM rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Roofline {
    pub flops_per_s: f64,
    pub kernel_flops_per_s: f64,
    pub bytes_per_s: f64,
    /// The share of `bytes_per_s` a normalization kernel (`Kind::Norm`)
    /// reaches: 1 on a CPU host (its calibration times the engine's own
    /// kernels); on a GPU, PyTorch's LayerNorm's measured share
    /// (`plan::NORM_EFFICIENCY` over `plan::MEMORY_EFFICIENCY`).
    pub norm_share: f64,
    pub op_overhead_s: f64,
    /// A GPU's GEMMs by their shape: `flops_per_s` is then the rate of a
    /// large GEMM that fills every SM, and a GEMM whose M×N does not fill
    /// its tiles and waves runs at that share of it. `None` (a CPU host,
    /// measured): every GEMM at `flops_per_s`.
    pub tiles: Option<Tiles>,
    /// Fused (flash) attention kernels' rate; `None`: `kernel_flops_per_s`,
    /// as every kernel that is not a GEMM.
    pub attention_flops_per_s: Option<f64>,
    /// A GPU's GEMM rate measured by FLOPs per call (`memfit calibrate
    /// --device cuda`): replaces `flops_per_s` and, where it covers the
    /// GEMM, the tile and wave model (see [`Roofline::gemm_seconds`]).
    pub gemm_curve: Option<Curve>,
    /// Fused attention's rates by head dimension and sequence length:
    /// measured on this GPU (`memfit calibrate --device cuda`), else the
    /// hardware profile's published ones for the kernel the plan prices.
    /// Replaces `attention_flops_per_s`.
    pub attention_table: Option<AttentionTable>,
}

/// One attention kernel's published rates: a [`Curve`] by sequence length
/// at each head dimension listed, read between two head dimensions
/// linearly in log(head_dim) and at the nearest one outside them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionTable {
    len: usize,
    head_dims: [f64; MAX_HEAD_DIMS],
    curves: [Curve; MAX_HEAD_DIMS],
}

impl AttentionTable {
    /// The table of `rates` (TFLOP/s), in FLOP/s; `None` if it has no
    /// point or more than the fixed arrays hold (a profile's own check
    /// refuses both).
    pub fn new(rates: &KernelRates) -> Option<AttentionTable> {
        let mut curves = Vec::new();
        for (&head_dim, by_t) in rates {
            let points: Vec<(f64, f64)> = (by_t.iter())
                .map(|(&t, &tflops)| (t as f64, tflops * 1e12))
                .collect();
            curves.push((head_dim as f64, Curve::new(&points)?));
        }
        let first = curves.first()?.1;
        if curves.len() > MAX_HEAD_DIMS {
            return None;
        }
        let mut table = AttentionTable {
            len: curves.len(),
            head_dims: [0.0; MAX_HEAD_DIMS],
            curves: [first; MAX_HEAD_DIMS],
        };
        for (i, (d, c)) in curves.into_iter().enumerate() {
            (table.head_dims[i], table.curves[i]) = (d, c);
        }
        Some(table)
    }

    /// FLOP/s at sequences of `t` tokens and heads of `head_dim`.
    pub fn at(&self, t: usize, head_dim: usize) -> f64 {
        let (n, d, x) = (self.len, &self.head_dims, t as f64);
        let hd = head_dim as f64;
        if n == 1 || hd <= d[0] {
            return self.curves[0].at(x);
        }
        if hd >= d[n - 1] {
            return self.curves[n - 1].at(x);
        }
        let i = d[..n].partition_point(|&v| v <= hd);
        let f = (hd / d[i - 1]).ln() / (d[i] / d[i - 1]).ln();
        let (lo, hi) = (self.curves[i - 1].at(x), self.curves[i].at(x));
        lo + f * (hi - lo)
    }
}

/// Most points a [`Curve`] holds (a fixed array keeps [`Roofline`] `Copy`).
pub const CURVE_POINTS: usize = 16;

/// A rate measured at a few sizes, read between them on log-log axes
/// (piecewise power laws, which is how achieved FLOP/s grows with a
/// kernel's size until the GPU is full) and clamped to the end points
/// outside them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Curve {
    len: usize,
    x: [f64; CURVE_POINTS],
    y: [f64; CURVE_POINTS],
}

impl Curve {
    /// The curve through `points` (size, rate), in any order. Points that
    /// are not finite and positive are left out, and of points at the same
    /// size the best rate is kept (a roofline takes the peak). `None` when
    /// no point is left or more than [`CURVE_POINTS`] are.
    pub fn new(points: &[(f64, f64)]) -> Option<Curve> {
        let ok = |v: f64| v.is_finite() && v > 0.0;
        let mut p: Vec<(f64, f64)> = (points.iter().copied())
            .filter(|&(x, y)| ok(x) && ok(y))
            .collect();
        p.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.total_cmp(&a.1)));
        p.dedup_by(|later, kept| later.0 == kept.0);
        if p.is_empty() || p.len() > CURVE_POINTS {
            return None;
        }
        let mut c = Curve {
            len: p.len(),
            x: [0.0; CURVE_POINTS],
            y: [0.0; CURVE_POINTS],
        };
        for (i, (x, y)) in p.into_iter().enumerate() {
            (c.x[i], c.y[i]) = (x, y);
        }
        Some(c)
    }

    /// The smallest measured size and its rate.
    pub fn first(&self) -> (f64, f64) {
        (self.x[0], self.y[0])
    }

    /// The rate at `x`: exact at a measured size, log-log linear between
    /// two, the nearest end's outside them.
    pub fn at(&self, x: f64) -> f64 {
        let n = self.len;
        if x.is_nan() || x <= self.x[0] {
            return self.y[0];
        }
        if x >= self.x[n - 1] {
            return self.y[n - 1];
        }
        let i = self.x[..n].partition_point(|&v| v <= x);
        let (x0, x1, y0, y1) = (self.x[i - 1], self.x[i], self.y[i - 1], self.y[i]);
        let f = (x / x0).ln() / (x1 / x0).ln();
        (y0.ln() + f * (y1 / y0).ln()).exp()
    }
}

/// How a GPU's GEMM kernels split the output: tiles of at most `m`×`n`
/// elements, one thread block each, run `sms` at a time (one wave). A
/// GEMM of M×N takes ⌈M/m⌉·⌈N/n⌉ tiles in ⌈tiles/sms⌉ waves, and pays for
/// every element of the last, partial tile and wave: tile and wave
/// quantization (NVIDIA, "Matrix Multiplication Background User's Guide",
/// Deep Learning Performance documentation). A side shorter than a tile
/// gets a tile of its size rounded up to a power of two (at least 16, the
/// tensor cores' fragment), as cuBLAS's heuristics pick smaller tiles for
/// skinny GEMMs (a LoRA rank's); such a GEMM is bound by its bytes anyway.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tiles {
    pub sms: usize,
    pub m: usize,
    pub n: usize,
}

impl Tiles {
    /// The share of the time of `g`'s tiles and waves that does useful
    /// work, in (0, 1].
    pub fn utilisation(&self, g: &super::ops::Gemm) -> f64 {
        let side = |dim: usize, most: usize| dim.max(1).next_power_of_two().clamp(16, most.max(16));
        let (tile_m, tile_n) = (side(g.m, self.m), side(g.n, self.n));
        let count = g.count.max(1);
        let tiles = g.m.div_ceil(tile_m).max(1) * g.n.div_ceil(tile_n).max(1) * count;
        let waves = tiles.div_ceil(self.sms.max(1));
        let useful = (g.m * g.n * count) as f64;
        let paid = (waves * self.sms.max(1) * tile_m * tile_n) as f64;
        (useful / paid).clamp(f64::MIN_POSITIVE, 1.0)
    }
}

/// A device's priced seconds by what prices them: GEMMs, fused attention,
/// norms, every other kernel, and the launch overhead all of them pay
/// (`Roofline::seconds` is a kernel's own time plus its launches).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct KindSeconds {
    pub gemm_s: f64,
    pub attention_s: f64,
    pub norm_s: f64,
    pub other_s: f64,
    pub launch_s: f64,
}

impl KindSeconds {
    /// Adds a call of `kind` whose kernels take `kernel_s` and whose
    /// launches `launch_s`.
    fn add(&mut self, kind: Kind, kernel_s: f64, launch_s: f64) {
        let slot = match kind {
            Kind::Gemm(_) => &mut self.gemm_s,
            Kind::FusedAttention { .. } => &mut self.attention_s,
            Kind::Norm => &mut self.norm_s,
            Kind::Stream => &mut self.other_s,
        };
        *slot += kernel_s;
        self.launch_s += launch_s;
    }

    /// The five, in the order of the fields.
    pub fn values(&self) -> [f64; 5] {
        [
            self.gemm_s,
            self.attention_s,
            self.norm_s,
            self.other_s,
            self.launch_s,
        ]
    }

    fn fields(&mut self) -> [&mut f64; 5] {
        [
            &mut self.gemm_s,
            &mut self.attention_s,
            &mut self.norm_s,
            &mut self.other_s,
            &mut self.launch_s,
        ]
    }

    /// Adds `times` more of what went from `a` to `b`.
    fn repeat(&mut self, a: &KindSeconds, b: &KindSeconds, times: f64) {
        add_repeats(self.fields(), &a.values(), &b.values(), times);
    }

    /// Their sum.
    pub fn total(&self) -> f64 {
        self.values().iter().sum()
    }

    /// Each scaled by `f`.
    pub fn scaled(mut self, f: f64) -> KindSeconds {
        for s in self.fields() {
            *s *= f;
        }
        self
    }
}

/// Adds to each of `sums` `times` more of what went from `a` to `b`.
fn add_repeats<'a>(sums: impl IntoIterator<Item = &'a mut f64>, a: &[f64], b: &[f64], times: f64) {
    for (s, (a, b)) in sums.into_iter().zip(a.iter().zip(b)) {
        *s += (b - a) * times;
    }
}

impl Roofline {
    /// Seconds `calls` runs of `work` take: `max(FLOPs / rate, bytes /
    /// bandwidth)` plus a launch overhead each, where a GEMM's rate is
    /// derated by its tiles and waves and a fused attention kernel runs at
    /// its own rate.
    pub fn seconds(&self, work: &Work, calls: u64) -> f64 {
        self.kernel_seconds(work) + self.launch_seconds(calls)
    }

    /// The launch overhead `calls` kernel launches pay.
    pub fn launch_seconds(&self, calls: u64) -> f64 {
        calls as f64 * self.op_overhead_s
    }

    /// [`Roofline::seconds`] without the launch overhead: the kernels'
    /// own time.
    pub fn kernel_seconds(&self, work: &Work) -> f64 {
        let compute = match work.kind {
            Kind::Gemm(gemms) => {
                let s: f64 = gemms.iter().flatten().map(|g| self.gemm_seconds(g)).sum();
                let rest = work.flops.saturating_sub(work.gemm_flops());
                s + rest as f64 / self.kernel_flops_per_s
            }
            Kind::FusedAttention { t, head_dim } => {
                let rate = match &self.attention_table {
                    Some(table) => table.at(t, head_dim),
                    None => (self.attention_flops_per_s).unwrap_or(self.kernel_flops_per_s),
                };
                work.flops as f64 / rate
            }
            Kind::Norm | Kind::Stream => work.flops as f64 / self.kernel_flops_per_s,
        };
        let bytes_per_s = match work.kind {
            Kind::Norm => self.bytes_per_s * self.norm_share,
            _ => self.bytes_per_s,
        };
        compute.max(work.bytes as f64 / bytes_per_s)
    }

    /// Seconds one GEMM's arithmetic takes at its tiles' and waves' share
    /// of the GEMM rate; with a measured curve, at the curve's rate for its
    /// FLOPs (which already holds the tiles and waves of the shapes it
    /// measured). Below the smallest GEMM measured, that GEMM's rate is
    /// derated by the tiles and waves `g` leaves idle beyond what it did
    /// (taken as a square of its FLOPs): the measurement does not cover
    /// such a shape, and the tile model is what says how it falls.
    pub fn gemm_seconds(&self, g: &super::ops::Gemm) -> f64 {
        let flops = g.flops() as f64;
        let Some(curve) = &self.gemm_curve else {
            let share = self.tiles.map_or(1.0, |t| t.utilisation(g));
            return flops / (self.flops_per_s * share);
        };
        let (x0, y0) = curve.first();
        if flops >= x0 {
            return flops / curve.at(flops);
        }
        let side = (x0 / 2.0).cbrt().round().max(1.0) as usize;
        let square = super::ops::Gemm::new(side, side, side);
        let share = (self.tiles).map_or(1.0, |t| {
            (t.utilisation(g) / t.utilisation(&square)).min(1.0)
        });
        flops / (y0 * share)
    }
}

/// Where offloaded work runs (ZeRO-Offload): the host's own roofline for
/// the optimizer update on the CPU, and the host link (PCIe) every copy
/// between device and host memory crosses, with its per-transfer latency.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostRoofline {
    pub cpu: Roofline,
    pub link_bytes_per_s: f64,
    pub link_latency_s: f64,
}

/// Which memory an op touches, for its price.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum At {
    Device,
    Host,
    /// Between device and host: priced on the host link.
    Link,
}

impl CostCounter {
    /// Counts from zero again, keeping what it counts.
    pub fn reset(&mut self) {
        *self = CostCounter {
            seconds_only: self.seconds_only,
            ..Default::default()
        };
    }

    pub fn flops(&self) -> u128 {
        self.ops.values().map(|c| c.flops).sum()
    }
    pub fn bytes(&self) -> u128 {
        self.ops.values().map(|c| c.bytes).sum()
    }
    /// Kernel launches (and transfers) over every op.
    pub fn calls(&self) -> u64 {
        self.ops.values().map(|c| c.calls).sum()
    }
    fn add(
        &mut self,
        op: &'static str,
        calls: u64,
        flops: u64,
        bytes: u64,
        ns: u64,
        roofline_s: f64,
    ) {
        self.roofline_s += roofline_s;
        if self.seconds_only {
            return;
        }
        let c = self.ops.entry(op).or_default();
        c.calls += calls;
        c.flops += flops as u128;
        c.bytes += bytes as u128;
        c.ns += ns;
    }
}

/// What a device's ops and collectives cost: the counters the engine's
/// ops add to as they run (FLOPs, bytes, seconds, bytes on the wire and
/// the host link) and the models that price them, which the planner and
/// `memfit balance` configure (rooflines, per-phase seconds, the log of
/// collectives a cluster topology prices).
#[derive(Clone)]
pub struct Meter {
    pub cost: CostCounter,
    /// The part of `cost` spent in the optimizer phase (once per step, where
    /// the rest repeats per micro-batch), and the bytes sent there.
    pub optimizer_cost: CostCounter,
    pub optimizer_sent: u64,
    /// Prices each op on a modelled device (the planner sets it).
    pub roofline: Option<Roofline>,
    /// Bytes this rank sent and received in collectives (ring algorithms).
    pub sent: u64,
    pub received: u64,
    /// When set (`memfit balance` times each layer with it), seconds spent
    /// per phase: the roofline's price when there is one, else the measured
    /// time. Off by default: it costs a map update per op.
    pub phase_secs: Option<HashMap<Phase, f64>>,
    /// Prices host and host-link ops (the planner sets it with `roofline`).
    pub host_roofline: Option<HostRoofline>,
    /// Seconds of `cost` spent on the host and the host link, and the part
    /// of that in the optimizer phase.
    pub offload_s: f64,
    pub offload_optimizer_s: f64,
    /// Bytes moved over the host link, and the part of that in the
    /// optimizer phase.
    pub link_bytes: u64,
    pub link_optimizer_bytes: u64,
    /// When set (the planner), every collective this rank called, for
    /// pricing on a cluster topology (`comm::topology`).
    pub collectives: Option<Vec<Call>>,
    /// How far apart the ranks of the group the next collectives run in are
    /// (1: consecutive; hybrid sharding's replica groups: a shard group).
    pub call_stride: usize,
    /// Bytes and messages sent to neighbouring pipeline stages.
    pub p2p_sent: u64,
    pub p2p_sends: u64,
    /// Seconds of `cost` on the device in each stage of the step (forward,
    /// backward, optimizer): what collectives of that stage can hide behind.
    pub stage_s: [f64; 3],
    /// The same seconds by what prices them (`KindSeconds`).
    pub kind_s: KindSeconds,
    /// While set, collectives are on the critical path: the next op needs
    /// their result (a tensor-parallel group's).
    pub critical: bool,
    /// While set, collectives are the data-parallel gradient reduction
    /// that follows the last micro-batch's backward in the engine, which
    /// frameworks run bucket by bucket during that backward.
    pub after_backward: bool,
    /// While set, collectives gather the weights the optimizer step just
    /// updated (zero1/2), which the next step's forward reads first.
    pub updated_weights: bool,
    /// While set, collectives are a split projection's sequence-parallel
    /// gather or reduce-scatter, paired with the GEMM after or before it
    /// (`Call::gemm_s`).
    pub pair: Option<Pair>,
    /// While set, GEMM ops are a split projection's own (`Device::split_gemm`),
    /// the ones its collectives pair with: not a router's, an expert's or an
    /// adapter's.
    split_gemm: bool,
    /// Seconds of the first GEMM of the last split projection's GEMM op (a
    /// backward's input gradient, the GEMM a reduce-scatter of it runs
    /// beside).
    last_gemm_s: f64,
    /// Collectives (indices into `collectives`) waiting for the GEMM after
    /// them.
    awaiting_gemm: Vec<usize>,
}

/// Which GEMM a tensor-parallel collective is paired with, as Transformer
/// Engine's userbuffers overlap them: a gather with the GEMM that reads
/// what it gathers, a reduce-scatter with the GEMM that makes what it
/// reduces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pair {
    Next,
    Previous,
}

/// What compute a collective can run beside, on the framework's own
/// communication stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Beside {
    /// The forward of the micro-batch that called it (ZeRO-3's prefetched
    /// all-gathers).
    Forward,
    /// The backward of the micro-batch that called it (ZeRO-2/3's
    /// reduce-scatters, ZeRO-3's gathers).
    Backward,
    /// The last micro-batch's backward (DDP's and ZeRO-1's bucketed
    /// reductions, under `no_sync` until then).
    LastBackward,
    /// The next step's first forward: the optimizer's gathers of the
    /// weights it updated (zero1/2), which Megatron-LM's
    /// `--overlap-param-gather` runs bucket by bucket as that forward
    /// reaches them; without it, the step waits for them whole.
    NextForward,
    /// Nothing: the next op waits for it (a tensor-parallel group's).
    Nothing,
}

/// The three parts of a step, for what overlaps what.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Forward,
    /// The backward pass, with a checkpointed block's recomputation.
    Backward,
    Optimizer,
}

impl Stage {
    pub fn of(phase: Phase) -> Stage {
        match phase {
            Phase::Init | Phase::ForwardEmbed | Phase::Forward(_) | Phase::ForwardHead => {
                Stage::Forward
            }
            Phase::BackwardHead
            | Phase::Recompute(_)
            | Phase::Backward(_)
            | Phase::BackwardEmbed => Stage::Backward,
            Phase::Optimizer => Stage::Optimizer,
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

impl Meter {
    fn new(planning: bool) -> Self {
        let cost = CostCounter {
            seconds_only: planning,
            ..Default::default()
        };
        Meter {
            optimizer_cost: cost.clone(),
            cost,
            optimizer_sent: 0,
            roofline: None,
            sent: 0,
            received: 0,
            phase_secs: None,
            host_roofline: None,
            offload_s: 0.0,
            offload_optimizer_s: 0.0,
            link_bytes: 0,
            link_optimizer_bytes: 0,
            collectives: None,
            call_stride: 1,
            p2p_sent: 0,
            p2p_sends: 0,
            stage_s: [0.0; 3],
            kind_s: KindSeconds::default(),
            critical: false,
            after_backward: false,
            updated_weights: false,
            pair: None,
            split_gemm: false,
            last_gemm_s: 0.0,
            awaiting_gemm: Vec::new(),
        }
    }

    /// Counts and prices `calls` runs of `work`, with `ns` measured, in
    /// `phase`: the roofline's seconds (each call pays the launch
    /// overhead), the offload and link totals, the per-op table and the
    /// per-phase seconds.
    fn charge(&mut self, work: &Work, (ns, calls): (u64, u64), at: At, phase: Phase) {
        let (op, flops, bytes) = (work.name, work.flops, work.bytes);
        // A device op's kernel time and its launches, priced once: their
        // sum is its seconds, and the split goes to `kind_s`.
        let device = match at {
            At::Device => self
                .roofline
                .map(|r| (r.kernel_seconds(work), r.launch_seconds(calls))),
            _ => None,
        };
        let secs = match at {
            At::Device => device.map_or(0.0, |(kernel, launch)| kernel + launch),
            At::Host => self
                .host_roofline
                .map_or(0.0, |h| h.cpu.seconds(work, calls)),
            At::Link => self.host_roofline.map_or(0.0, |h| {
                bytes as f64 / h.link_bytes_per_s + calls as f64 * h.link_latency_s
            }),
        };
        let optimizer = phase == Phase::Optimizer;
        if at == At::Device {
            self.stage_s[Stage::of(phase).index()] += secs;
            if let Some((kernel, launch)) = device {
                self.kind_s.add(work.kind, kernel, launch);
            }
            self.paired_gemm(work);
        }
        if at != At::Device {
            if at == At::Link {
                self.link_bytes += bytes;
                if optimizer {
                    self.link_optimizer_bytes += bytes;
                }
            }
            self.offload_s += secs;
            if optimizer {
                self.offload_optimizer_s += secs;
            }
        }
        self.cost.add(op, calls, flops, bytes, ns, secs);
        if let Some(per_phase) = &mut self.phase_secs {
            let spent = match self.roofline {
                Some(_) => secs,
                None => ns as f64 * 1e-9,
            };
            *per_phase.entry(phase).or_default() += spent;
        }
        if optimizer {
            self.optimizer_cost.add(op, calls, flops, bytes, ns, secs);
        }
    }

    /// Notes a GEMM op's first GEMM's seconds for the collectives paired
    /// with it (`Pair`), when the planner records collectives.
    fn paired_gemm(&mut self, work: &Work) {
        let (Some(r), Kind::Gemm([Some(g), _])) = (self.roofline, work.kind) else {
            return;
        };
        if self.collectives.is_none() || !self.split_gemm {
            return;
        }
        self.last_gemm_s = r.gemm_seconds(&g);
        if let Some(calls) = &mut self.collectives {
            for i in self.awaiting_gemm.drain(..) {
                // A log replaced since the gather was recorded has no
                // such call left to pair.
                if let Some(c) = calls.get_mut(i) {
                    c.gemm_s = Some(self.last_gemm_s);
                }
            }
        }
    }

    /// One collective `op` of nccl-tests' `size` `bytes` over `world`
    /// ranks, of which this rank sent and received `(sent, received)`:
    /// the wire totals and, for a planner, the log its topology prices.
    fn wire(
        &mut self,
        op: Op,
        bytes: u64,
        world: usize,
        (sent, received): (u64, u64),
        stage: Stage,
    ) {
        if stage == Stage::Optimizer {
            self.optimizer_sent += sent;
        }
        let beside = match (self.critical, self.after_backward, stage) {
            (true, _, _) => Beside::Nothing,
            (false, true, _) => Beside::LastBackward,
            (false, false, Stage::Forward) => Beside::Forward,
            (false, false, Stage::Backward) => Beside::Backward,
            (false, false, Stage::Optimizer) if self.updated_weights => Beside::NextForward,
            (false, false, Stage::Optimizer) => Beside::Nothing,
        };
        if let Some(calls) = &mut self.collectives {
            let gemm_s = match self.pair {
                None => None,
                Some(Pair::Previous) => Some(self.last_gemm_s),
                Some(Pair::Next) => {
                    self.awaiting_gemm.push(calls.len());
                    Some(0.0)
                }
            };
            calls.push(Call {
                op,
                bytes,
                world,
                stride: self.call_stride,
                beside,
                times: 1,
                gemm_s,
            });
        }
        self.sent += sent;
        self.received += received;
    }
}

#[derive(Clone)]
pub struct Device<B: Backend> {
    pub be: B,
    pub tracker: Tracker,
    /// What the ops and collectives cost, and the models that price them.
    pub meter: Meter,
    /// hf-eager on a GPU: PyTorch's caching allocator, fed every allocation
    /// and free, for the bytes it would reserve.
    pub caching: Option<crate::caching::CachingAllocator>,
    /// Offload: host memory, tracked as the device is (categories, peak,
    /// capacity). `None` when nothing is offloaded.
    pub host: Option<Tracker>,
    /// While set, [`Device::alloc`] places tensors in host memory.
    to_host: bool,
    /// A paged optimizer: the unified memory its large states live in
    /// (`cudaMallocManaged`), tracked apart from the device's allocations:
    /// no capacity (the driver pages what does not fit to the host) and
    /// never in the caching allocator's counters. `None` otherwise.
    pub paged: Option<Tracker>,
    /// While set, [`Device::alloc`] places tensors in unified memory.
    to_paged: bool,
}

/// One collective as the planner prices it: nccl-tests' `size` (one rank's
/// full buffer), its group's size, and whether the optimizer phase (once
/// per step) called it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Call {
    pub op: Op,
    pub bytes: u64,
    pub world: usize,
    /// Ranks between two members of the group (`Device::call_stride`).
    pub stride: usize,
    /// What compute it can run beside.
    pub beside: Beside,
    /// How many times it ran (a fast-forwarded micro-batch's calls are
    /// kept once, with its repeats counted here).
    pub times: u64,
    /// A split projection's sequence-parallel collective: the seconds of
    /// the GEMM it is paired with (`Pair`), which Megatron's
    /// `--tp-comm-overlap` runs it beside.
    pub gemm_s: Option<f64>,
}

/// A rank's collectives, as the engine holds them.
pub type Comm<B> = Box<dyn Collective<<B as Backend>::Buf>>;

type T<B> = Tensor<<B as Backend>::Buf>;

fn b<Buf>(t: &Tensor<Buf>) -> u64 {
    t.bytes()
}

fn ob<Buf>(t: Option<&Tensor<Buf>>) -> u64 {
    t.map_or(0, |t| t.bytes())
}

/// A planning device between two micro-batches: the state that decides
/// what the next micro-batch does (live bytes, the caching allocator's
/// layout, where tensors go), and the counters a micro-batch adds to.
pub struct Between {
    live: ByCategory,
    host_live: Option<ByCategory>,
    paged_live: Option<ByCategory>,
    layout: Option<crate::caching::Layout>,
    to_host: bool,
    call_stride: usize,
    roofline_s: f64,
    stage_s: [f64; 3],
    kind_s: KindSeconds,
    offload_s: f64,
    sent: u64,
    received: u64,
    link_bytes: u64,
    p2p_sent: u64,
    p2p_sends: u64,
    calls: usize,
}

impl Between {
    /// Whether the micro-batch from `self` to `then` ended in the state it
    /// started from: then the next one, run from the same state by the same
    /// deterministic engine, does exactly what it did, and so does every one
    /// after it.
    pub fn returns_to_itself(&self, then: &Between) -> bool {
        self.live == then.live
            && self.host_live == then.host_live
            && self.paged_live == then.paged_live
            && self.to_host == then.to_host
            && self.call_stride == then.call_stride
            && self.layout == then.layout
    }
}

impl<B: Backend> Device<B> {
    /// Where a planning device stands between micro-batches.
    pub fn between(&self) -> Between {
        Between {
            live: self.tracker.live(),
            host_live: self.host.as_ref().map(Tracker::live),
            paged_live: self.paged.as_ref().map(Tracker::live),
            layout: self.caching.as_ref().map(|c| c.layout()),
            to_host: self.to_host,
            call_stride: self.meter.call_stride,
            roofline_s: self.meter.cost.roofline_s,
            stage_s: self.meter.stage_s,
            kind_s: self.meter.kind_s,
            offload_s: self.meter.offload_s,
            sent: self.meter.sent,
            received: self.meter.received,
            link_bytes: self.meter.link_bytes,
            p2p_sent: self.meter.p2p_sent,
            p2p_sends: self.meter.p2p_sends,
            calls: self.meter.collectives.as_ref().map_or(0, Vec::len),
        }
    }

    /// Counts `times` more repeats of the micro-batch that went from `a` to
    /// `b` and returned to itself (`Between::returns_to_itself`): its
    /// seconds, bytes and collectives, without running them. Peaks need
    /// nothing: each repeat reaches exactly the peaks it reached. Only a
    /// planning device does this (it keeps no timeline or per-op table
    /// that the repeats would have added to).
    pub fn repeat(&mut self, a: &Between, b: &Between, times: usize) {
        debug_assert!(self.be.planning() && a.returns_to_itself(b));
        let n = times as u64;
        self.meter.cost.roofline_s += (b.roofline_s - a.roofline_s) * times as f64;
        add_repeats(
            &mut self.meter.stage_s,
            &a.stage_s,
            &b.stage_s,
            times as f64,
        );
        self.meter.kind_s.repeat(&a.kind_s, &b.kind_s, times as f64);
        self.meter.offload_s += (b.offload_s - a.offload_s) * times as f64;
        // Saturating: a plan's step may be 2^40 micro-batches of gigabytes.
        let more = |x: &mut u64, a: u64, b: u64| *x = x.saturating_add((b - a).saturating_mul(n));
        more(&mut self.meter.sent, a.sent, b.sent);
        more(&mut self.meter.received, a.received, b.received);
        more(&mut self.meter.link_bytes, a.link_bytes, b.link_bytes);
        more(&mut self.meter.p2p_sent, a.p2p_sent, b.p2p_sent);
        more(&mut self.meter.p2p_sends, a.p2p_sends, b.p2p_sends);
        if let Some(calls) = &mut self.meter.collectives {
            let again: Vec<Call> = calls[a.calls..b.calls]
                .iter()
                .map(|c| Call {
                    times: c.times.saturating_mul(n),
                    ..*c
                })
                .collect();
            calls.extend(again);
        }
    }

    /// `t` as the backend keeps its books: a planner's (peaks only, no
    /// timeline), a run's with data (events timed), or a meta run's
    /// (events without a clock).
    fn tracker_for(be: &B, t: Tracker) -> Tracker {
        if be.planning() {
            t.for_planning()
        } else if be.holds_data() {
            t
        } else {
            t.without_clock()
        }
    }

    pub fn new(be: B, capacity: Option<u64>) -> Self {
        let tracker = Self::tracker_for(&be, Tracker::new(capacity));
        Device {
            meter: Meter::new(be.planning()),
            be,
            tracker,
            caching: None,
            host: None,
            to_host: false,
            paged: None,
            to_paged: false,
        }
    }

    /// Gives the device a unified memory for a paged optimizer's states.
    pub fn add_paged(&mut self) {
        self.paged = Some(Self::tracker_for(&self.be, Tracker::new(None)));
    }

    /// Runs `f` with every allocation it makes placed in unified memory
    /// (bitsandbytes' `get_paged`).
    pub fn paged<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        assert!(
            self.paged.is_some() && !self.to_host,
            "paging needs unified memory (Device::add_paged), never host memory"
        );
        let was = std::mem::replace(&mut self.to_paged, true);
        let r = f(self);
        self.to_paged = was;
        r
    }

    /// Gives the device a host memory to offload to, of `capacity` bytes.
    pub fn add_host(&mut self, capacity: Option<u64>) {
        let t = Tracker::new(capacity).for_host();
        self.host = Some(Self::tracker_for(&self.be, t));
    }

    /// Runs `f` with every allocation it makes placed in host memory.
    pub fn on_host<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        assert!(
            self.host.is_some(),
            "offload needs a host (Device::add_host)"
        );
        let was = std::mem::replace(&mut self.to_host, true);
        let r = f(self);
        self.to_host = was;
        r
    }

    /// Runs `f` with the collectives it calls recorded as a group whose
    /// members are `stride` ranks apart (`Call::stride`).
    pub fn with_stride<R>(&mut self, stride: usize, f: impl FnOnce(&mut Self) -> R) -> R {
        let was = std::mem::replace(&mut self.meter.call_stride, stride);
        let r = f(self);
        self.meter.call_stride = was;
        r
    }

    /// Runs `f` with its collectives among adjacent ranks (stride 1) and on
    /// the critical path: a tensor-parallel group's.
    pub fn critical<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let was = std::mem::replace(&mut self.meter.critical, true);
        let r = self.with_stride(1, f);
        self.meter.critical = was;
        r
    }

    /// Runs `f`, whose collectives are paired with the GEMM `pair` names
    /// (`Call::gemm_s`).
    pub fn beside_gemm<R>(&mut self, pair: Pair, f: impl FnOnce(&mut Self) -> R) -> R {
        let was = self.meter.pair.replace(pair);
        let r = f(self);
        self.meter.pair = was;
        r
    }

    /// Runs `f`, a split projection's own GEMM, which its sequence-parallel
    /// collectives pair with (`Pair`).
    pub fn split_gemm<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let was = std::mem::replace(&mut self.meter.split_gemm, true);
        let r = f(self);
        self.meter.split_gemm = was;
        r
    }

    /// Runs `f`, whose collectives reduce the gradients after the last
    /// micro-batch's backward (`Beside::LastBackward`).
    pub fn after_backward<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let was = std::mem::replace(&mut self.meter.after_backward, true);
        let r = f(self);
        self.meter.after_backward = was;
        r
    }

    /// Runs `f`, whose collectives gather the weights the optimizer step
    /// updated (`Beside::NextForward`).
    pub fn updated_weights<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let was = std::mem::replace(&mut self.meter.updated_weights, true);
        let r = f(self);
        self.meter.updated_weights = was;
        r
    }

    /// The tracker that holds the bytes of a tensor placed at `host` or `paged`.
    fn tracker_of(&mut self, host: bool, paged: bool) -> &mut Tracker {
        match (host, paged) {
            (true, _) => self.host.as_mut().expect("a host tensor needs a host"),
            (false, true) => (self.paged.as_mut()).expect("a paged tensor needs unified memory"),
            (false, false) => &mut self.tracker,
        }
    }

    /// Where an op on tensors placed at `host` runs: on the host when all
    /// are there, across the link when some are.
    fn at(host: &[bool]) -> At {
        match (host.iter().all(|&h| h), host.iter().any(|&h| h)) {
            (true, _) => At::Host,
            (false, true) => At::Link,
            (false, false) => At::Device,
        }
    }

    /// Runs one backend op, counting its cost and timing it.
    fn timed<R>(&mut self, work: Work, f: impl FnOnce(&mut B) -> R) -> R {
        self.timed_at(work, At::Device, f)
    }

    /// [`Device::timed`] for an op that may touch host memory: on the host
    /// it is priced on the host's roofline; across the link, `bytes` (what
    /// crosses it) at the link's bandwidth plus its latency.
    fn timed_at<R>(&mut self, work: Work, at: At, f: impl FnOnce(&mut B) -> R) -> R {
        // Meta runs nothing: skip the clock, whose reads would cost more
        // than the op itself.
        let start = self.be.holds_data().then(Instant::now);
        let r = f(&mut self.be);
        let ns = start.map_or(0, |s| s.elapsed().as_nanos() as u64);
        self.charge(&work, ns, at, 1);
        r
    }

    /// Charges work no backend op runs: a framework profile's kernels
    /// beyond the engine's own (hf-eager's unfused norms, SwiGLU and RoPE,
    /// `framework::Unfused`), priced as `kernels` launches of streaming
    /// work over `bytes`.
    pub fn charge_unfused(&mut self, name: &'static str, u: super::framework::Unfused) {
        if u.kernels == 0 && u.bytes == 0 {
            return;
        }
        self.charge(&Work::stream(name, 0u64, u.bytes), 0, At::Device, u.kernels);
    }

    fn charge(&mut self, work: &Work, ns: u64, at: At, calls: u64) {
        let phase = self.tracker.phase();
        self.meter.charge(work, (ns, calls), at, phase);
    }

    /// A zero-filled tensor, tracked under `category`; refused past the capacity.
    pub fn alloc(
        &mut self,
        len: usize,
        dtype: DType,
        category: Category,
    ) -> Result<T<B>, OomError> {
        let bytes = (len * dtype.size()) as u64;
        let (host, paged) = (self.to_host, self.to_paged);
        self.tracker_of(host, paged).alloc(category, bytes)?;
        // Unified memory is cudaMallocManaged's, not the caching allocator's.
        let block = match &mut self.caching {
            Some(c) if bytes > 0 && !host && !paged => c.malloc(bytes),
            _ => 0,
        };
        let buf = match host {
            true => self.be.alloc_host(len, dtype),
            false => self.be.alloc(len, dtype),
        };
        Ok(Tensor {
            buf,
            len,
            dtype,
            category,
            block,
            host,
            paged,
        })
    }

    /// [`Device::alloc`] then a `fill` kernel of zeros, for a tensor that
    /// kernels accumulate into (a GPU's allocation holds stale bytes).
    pub fn alloc_zeroed(
        &mut self,
        len: usize,
        dtype: DType,
        category: Category,
    ) -> Result<T<B>, OomError> {
        let mut t = self.alloc(len, dtype, category)?;
        self.fill(&mut t, 0.0);
        Ok(t)
    }

    pub fn alloc_f32(&mut self, len: usize, category: Category) -> Result<T<B>, OomError> {
        self.alloc(len, DType::F32, category)
    }

    pub fn free(&mut self, t: T<B>) {
        self.tracker_of(t.host, t.paged).free(t.category, t.bytes());
        if let Some(c) = &mut self.caching
            && t.block != 0
        {
            c.free(t.block);
        }
        self.be.free(t.buf);
    }

    pub fn free_opt(&mut self, t: Option<T<B>>) {
        if let Some(t) = t {
            self.free(t);
        }
    }

    /// `t` when `keep`, else freed.
    pub fn keep_if(&mut self, keep: bool, t: T<B>) -> Option<T<B>> {
        match keep {
            true => Some(t),
            false => {
                self.free(t);
                None
            }
        }
    }

    pub fn fill(&mut self, t: &mut T<B>, value: f32) {
        let at = Self::at(&[t.host]);
        self.timed_at(Work::stream("fill", 0, b(t)), at, |be| {
            be.fill(&mut t.buf, value)
        });
    }

    /// The embedding; `part: Some(lo)`: a vocabulary-parallel part whose
    /// `wte` holds rows `lo..` (`Backend::embed_forward_rows`).
    pub fn embed_forward(
        &mut self,
        out: &mut T<B>,
        tokens: &T<B>,
        wte: &T<B>,
        wpe: Option<&T<B>>,
        (n, t, c): (usize, usize, usize),
        part: Option<usize>,
    ) {
        let rows = (n * c * 4) as u64;
        self.timed(
            Work::stream(
                "embed",
                (n * c) as u64 * wpe.is_some() as u64,
                b(out) + b(tokens) + rows * (1 + wpe.is_some() as u64),
            ),
            |be| {
                let wpe = wpe.map(|w| &w.buf);
                be.embed_forward_rows(&mut out.buf, &tokens.buf, &wte.buf, wpe, n, t, c, part)
            },
        );
    }

    /// The embedding's backward (a part's: only the tokens in its rows
    /// reach `dwte`).
    pub fn embed_backward(
        &mut self,
        dwte: &mut T<B>,
        dwpe: Option<&mut T<B>>,
        dout: &T<B>,
        tokens: &T<B>,
        (n, t, c): (usize, usize, usize),
        part: Option<usize>,
    ) {
        let k = 1 + dwpe.is_some() as u64;
        self.timed(
            Work::stream(
                "embed_backward",
                (n * c) as u64 * k,
                b(dout) + b(tokens) + 2 * k * (n * c * 4) as u64,
            ),
            |be| {
                let dwpe = dwpe.map(|w| &mut w.buf);
                be.embed_backward_rows(&mut dwte.buf, dwpe, &dout.buf, &tokens.buf, n, t, c, part)
            },
        );
    }

    /// LayerNorm when `mean` is given (gpt2), RMSNorm otherwise (llama),
    /// with weight `1 + w` when `offset` (Gemma).
    pub fn norm_forward(
        &mut self,
        out: &mut T<B>,
        mean: Option<&mut T<B>>,
        rstd: &mut T<B>,
        inp: &T<B>,
        w: &T<B>,
        bias: Option<&T<B>>,
        n: usize,
        c: usize,
        eps: f32,
        offset: bool,
    ) {
        let bytes = b(out) + b(rstd) + ob(mean.as_deref()) + b(inp) + b(w) + ob(bias);
        match mean {
            Some(mean) => {
                self.timed(Work::norm("layernorm", (8 * n * c) as u64, bytes), |be| {
                    be.layernorm_forward(
                        &mut out.buf,
                        &mut mean.buf,
                        &mut rstd.buf,
                        &inp.buf,
                        &w.buf,
                        bias.map(|x| &x.buf),
                        n,
                        c,
                        eps,
                    )
                });
            }
            None if offset => {
                let work = Work::norm("gemma_rmsnorm", (5 * n * c) as u64, bytes);
                self.timed(work, |be| {
                    be.gemma_rmsnorm_forward(
                        &mut out.buf,
                        &mut rstd.buf,
                        &inp.buf,
                        &w.buf,
                        n,
                        c,
                        eps,
                    )
                });
            }
            None => {
                self.timed(Work::norm("rmsnorm", (4 * n * c) as u64, bytes), |be| {
                    be.rmsnorm_forward(&mut out.buf, &mut rstd.buf, &inp.buf, &w.buf, n, c, eps)
                });
            }
        }
    }

    /// Accumulates into `dinp`, `dw`, `db`.
    pub fn norm_backward(
        &mut self,
        dinp: &mut T<B>,
        dw: &mut T<B>,
        db: Option<&mut T<B>>,
        dout: &T<B>,
        inp: &T<B>,
        w: &T<B>,
        mean: Option<&T<B>>,
        rstd: &T<B>,
        n: usize,
        c: usize,
        offset: bool,
    ) {
        let bytes = 2 * b(dinp)
            + 2 * b(dw)
            + 2 * ob(db.as_deref())
            + b(dout)
            + b(inp)
            + b(w)
            + ob(mean)
            + b(rstd);
        match mean {
            Some(mean) => {
                self.timed(
                    Work::norm("layernorm_backward", (16 * n * c) as u64, bytes),
                    |be| {
                        be.layernorm_backward(
                            &mut dinp.buf,
                            &mut dw.buf,
                            db.map(|x| &mut x.buf),
                            &dout.buf,
                            &inp.buf,
                            &w.buf,
                            &mean.buf,
                            &rstd.buf,
                            n,
                            c,
                        )
                    },
                );
            }
            None if offset => {
                self.timed(
                    Work::norm("gemma_rmsnorm_backward", (11 * n * c) as u64, bytes),
                    |be| {
                        be.gemma_rmsnorm_backward(
                            &mut dinp.buf,
                            &mut dw.buf,
                            &dout.buf,
                            &inp.buf,
                            &w.buf,
                            &rstd.buf,
                            n,
                            c,
                        )
                    },
                );
            }
            None => {
                self.timed(
                    Work::norm("rmsnorm_backward", (10 * n * c) as u64, bytes),
                    |be| {
                        be.rmsnorm_backward(
                            &mut dinp.buf,
                            &mut dw.buf,
                            &dout.buf,
                            &inp.buf,
                            &w.buf,
                            &rstd.buf,
                            n,
                            c,
                        )
                    },
                );
            }
        }
    }

    pub fn matmul_forward(
        &mut self,
        out: &mut T<B>,
        inp: &T<B>,
        w: &T<B>,
        bias: Option<&T<B>>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        self.timed(
            Work::matmul(n, c, oc, b(out) + b(inp) + b(w) + ob(bias)),
            |be| {
                be.matmul_forward(
                    &mut out.buf,
                    &inp.buf,
                    &w.buf,
                    bias.map(|x| &x.buf),
                    n,
                    c,
                    oc,
                )
            },
        );
    }

    pub fn matmul_backward(
        &mut self,
        dinp: &mut T<B>,
        dw: Option<&mut T<B>>,
        dbias: Option<&mut T<B>>,
        dout: &T<B>,
        inp: &T<B>,
        w: &T<B>,
        n: usize,
        c: usize,
        oc: usize,
    ) {
        // A frozen weight (no `dw`) costs the input gradient only.
        let dbias = dbias.filter(|_| dw.is_some());
        let trained = dw.is_some() as usize;
        let bytes = b(dinp)
            + 2 * ob(dw.as_deref())
            + 2 * ob(dbias.as_deref())
            + (1 + trained as u64) * b(dout)
            + trained as u64 * b(inp)
            + b(w);
        let work = Work::matmul_backward(n, c, oc, trained == 1, dbias.is_some(), bytes);
        self.timed(work, |be| {
            be.matmul_backward(
                &mut dinp.buf,
                dw.map(|x| &mut x.buf),
                dbias.map(|x| &mut x.buf),
                &dout.buf,
                &inp.buf,
                &w.buf,
                n,
                c,
                oc,
            )
        });
    }

    /// QLoRA's dequantisation of an NF4 weight into `out` (a streaming op).
    pub fn nf4_dequantize(&mut self, out: &mut T<B>, w: &T<B>) {
        let n = out.len;
        self.timed(
            Work::stream("nf4_dequantize", 4 * n as u64, b(out) + b(w)),
            |be| be.nf4_dequantize(&mut out.buf, &w.buf, n),
        );
    }

    /// [`Backend::copy_cols`]: a column block between row-major matrices.
    pub fn copy_cols(
        &mut self,
        dst: &mut T<B>,
        dst_cols: usize,
        dst_off: usize,
        src: &T<B>,
        src_cols: usize,
        src_off: usize,
        rows: usize,
        width: usize,
        scale: f32,
        accumulate: bool,
    ) {
        let moved = (rows * width) as u64;
        let bytes =
            moved * (src.dtype.size() + (1 + accumulate as usize) * dst.dtype.size()) as u64;
        self.timed(Work::stream("copy_cols", 2 * moved, bytes), |be| {
            be.copy_cols(
                &mut dst.buf,
                dst_cols,
                dst_off,
                &src.buf,
                src_cols,
                src_off,
                rows,
                width,
                scale,
                accumulate,
            )
        });
    }

    pub fn gelu_forward(&mut self, out: &mut T<B>, inp: &T<B>, n: usize) {
        self.timed(
            Work::stream("gelu", (8 * n) as u64, b(out) + b(inp)),
            |be| be.gelu_forward(&mut out.buf, &inp.buf, n),
        );
    }

    pub fn gelu_backward(&mut self, dout: &mut T<B>, inp: &T<B>, n: usize) {
        self.timed(
            Work::stream("gelu_backward", (16 * n) as u64, 2 * b(dout) + b(inp)),
            |be| be.gelu_backward(&mut dout.buf, &inp.buf, n),
        );
    }

    /// Mixture of experts: token rows into the permuted buffer (`Backend::moe_gather`).
    pub fn moe_gather(
        &mut self,
        out: &mut T<B>,
        x: &T<B>,
        idx: &T<B>,
        w: Option<&T<B>>,
        (m, n, c): (usize, usize, usize),
    ) {
        self.timed(
            Work::stream("moe_gather", m * c, 2 * b(out) + b(idx) + ob(w)),
            |be| be.moe_gather(&mut out.buf, &x.buf, &idx.buf, w.map(|w| &w.buf), (m, n, c)),
        );
    }

    /// The permuted rows summed back into their tokens (`Backend::moe_scatter`).
    pub fn moe_scatter(
        &mut self,
        out: &mut T<B>,
        y: &T<B>,
        idx: &T<B>,
        w: Option<&T<B>>,
        (m, n, c): (usize, usize, usize),
    ) {
        self.timed(
            Work::stream("moe_scatter", 2 * m * c, 2 * b(out) + b(y) + b(idx) + ob(w)),
            |be| be.moe_scatter(&mut out.buf, &y.buf, &idx.buf, w.map(|w| &w.buf), (m, n, c)),
        );
    }

    /// Each routed row's dot product with its token's row (`Backend::moe_row_dots`).
    pub fn moe_row_dots(
        &mut self,
        out: &mut T<B>,
        a: &T<B>,
        y: &T<B>,
        idx: &T<B>,
        (m, n, c): (usize, usize, usize),
    ) {
        self.timed(
            Work::stream("moe_row_dots", 2 * m * c, b(out) + 2 * b(y) + b(idx)),
            |be| be.moe_row_dots(&mut out.buf, &a.buf, &y.buf, &idx.buf, (m, n, c)),
        );
    }

    /// The experts' grouped GEMM (`Backend::grouped_matmul_forward`).
    pub fn grouped_matmul_forward(
        &mut self,
        out: &mut T<B>,
        inp: &T<B>,
        w: &T<B>,
        counts: &[usize],
        c: usize,
        oc: usize,
    ) {
        let m: usize = counts.iter().sum();
        self.timed(
            Work::grouped(
                "grouped_matmul",
                (m, counts.len()),
                c,
                oc,
                1,
                b(out) + b(inp) + b(w),
            ),
            |be| be.grouped_matmul_forward(&mut out.buf, &inp.buf, &w.buf, counts, c, oc),
        );
    }

    /// Its backward (`Backend::grouped_matmul_backward`).
    pub fn grouped_matmul_backward(
        &mut self,
        dinp: &mut T<B>,
        dw: Option<&mut T<B>>,
        dout: &T<B>,
        inp: &T<B>,
        w: &T<B>,
        counts: &[usize],
        c: usize,
        oc: usize,
    ) {
        let m: usize = counts.iter().sum();
        let passes = 1 + dw.is_some() as usize;
        let bytes = b(dinp) + b(dout) + b(w) + (dw.is_some() as u64) * (b(inp) + 2 * b(w));
        self.timed(
            Work::grouped(
                "grouped_matmul_backward",
                (m, counts.len()),
                c,
                oc,
                passes,
                bytes,
            ),
            |be| {
                be.grouped_matmul_backward(
                    &mut dinp.buf,
                    dw.map(|d| &mut d.buf),
                    &dout.buf,
                    &inp.buf,
                    &w.buf,
                    counts,
                    c,
                    oc,
                )
            },
        );
    }

    pub fn swiglu_forward(&mut self, out: &mut T<B>, gu: &T<B>, n: usize, i: usize) {
        self.timed(
            Work::stream("swiglu", (6 * n * i) as u64, b(out) + b(gu)),
            |be| be.swiglu_forward(&mut out.buf, &gu.buf, n, i),
        );
    }

    pub fn swiglu_backward(&mut self, dgu: &mut T<B>, dout: &T<B>, gu: &T<B>, n: usize, i: usize) {
        self.timed(
            Work::stream(
                "swiglu_backward",
                (12 * n * i) as u64,
                b(dgu) + b(dout) + b(gu),
            ),
            |be| be.swiglu_backward(&mut dgu.buf, &dout.buf, &gu.buf, n, i),
        );
    }

    /// [`Device::swiglu_backward`] into `gu` itself (Liger's).
    pub fn swiglu_backward_in_place(&mut self, gu: &mut T<B>, dout: &T<B>, n: usize, i: usize) {
        self.timed(
            Work::stream("swiglu_backward", (12 * n * i) as u64, 2 * b(gu) + b(dout)),
            |be| be.swiglu_backward_in_place(&mut gu.buf, &dout.buf, n, i),
        );
    }

    pub fn geglu_forward(&mut self, out: &mut T<B>, gu: &T<B>, n: usize, i: usize) {
        self.timed(
            Work::stream("geglu", (10 * n * i) as u64, b(out) + b(gu)),
            |be| be.geglu_forward(&mut out.buf, &gu.buf, n, i),
        );
    }

    pub fn geglu_backward(&mut self, dgu: &mut T<B>, dout: &T<B>, gu: &T<B>, n: usize, i: usize) {
        self.timed(
            Work::stream(
                "geglu_backward",
                (20 * n * i) as u64,
                b(dgu) + b(dout) + b(gu),
            ),
            |be| be.geglu_backward(&mut dgu.buf, &dout.buf, &gu.buf, n, i),
        );
    }

    /// In place: `x *= factor` (Gemma's embedding scale and its backward).
    pub fn scale(&mut self, x: &mut T<B>, factor: f32) {
        let n = x.len;
        self.timed(Work::stream("scale", n as u64, 2 * b(x)), |be| {
            be.scale(&mut x.buf, n, factor)
        });
    }

    /// In place: `x = cap · tanh(x / cap)` over its first `n` elements.
    pub fn softcap_forward(&mut self, x: &mut T<B>, n: usize, cap: f32) {
        self.timed(Work::stream("softcap", (4 * n) as u64, 2 * b(x)), |be| {
            be.softcap_forward(&mut x.buf, n, cap)
        });
    }

    pub fn add(&mut self, out: &mut T<B>, a: &T<B>, x: &T<B>, n: usize) {
        self.timed(Work::stream("add", n as u64, b(out) + b(a) + b(x)), |be| {
            be.add(&mut out.buf, &a.buf, &x.buf, n)
        });
    }

    pub fn rope_forward(&mut self, qkv: &mut T<B>, s: AttnShape, theta: f32) {
        self.timed(Work::rope("rope", s, 2 * b(qkv)), |be| {
            be.rope_forward(&mut qkv.buf, s, theta)
        });
    }

    pub fn rope_backward(&mut self, dqkv: &mut T<B>, s: AttnShape, theta: f32) {
        self.timed(Work::rope("rope_backward", s, 2 * b(dqkv)), |be| {
            be.rope_backward(&mut dqkv.buf, s, theta)
        });
    }

    pub fn attention_forward(&mut self, out: &mut T<B>, att: &mut T<B>, qkv: &T<B>, s: AttnShape) {
        self.timed(Work::attention(s, b(out) + 2 * b(att) + b(qkv)), |be| {
            be.attention_forward(&mut out.buf, &mut att.buf, &qkv.buf, s)
        });
    }

    /// Eager attention with Gemma's options (`tanh`: the soft cap's saved
    /// values); the plain kernel where the options are the standard ones.
    pub fn attention_forward_with(
        &mut self,
        out: &mut T<B>,
        att: &mut T<B>,
        tanh: Option<&mut T<B>>,
        qkv: &T<B>,
        s: AttnShape,
        o: AttnOpts,
    ) {
        if o.is_standard(s) && tanh.is_none() {
            return self.attention_forward(out, att, qkv, s);
        }
        let bytes = b(out) + 2 * b(att) + b(qkv) + ob(tanh.as_deref());
        self.timed(Work::attention(s, bytes), |be| {
            be.attention_forward_with(
                &mut out.buf,
                &mut att.buf,
                tanh.map(|x| &mut x.buf),
                &qkv.buf,
                s,
                o,
            )
        });
    }

    /// The backward of [`Device::attention_forward_with`].
    pub fn attention_backward_with(
        &mut self,
        dqkv: &mut T<B>,
        datt: &mut T<B>,
        dout: &T<B>,
        (qkv, att, tanh): (&T<B>, &T<B>, Option<&T<B>>),
        s: AttnShape,
        o: AttnOpts,
    ) {
        if o.is_standard(s) && tanh.is_none() {
            return self.attention_backward(dqkv, datt, dout, qkv, att, s);
        }
        let bytes = b(dqkv) + 2 * b(datt) + b(dout) + b(qkv) + b(att) + ob(tanh);
        self.timed(Work::attention_backward(s, bytes), |be| {
            be.attention_backward_with(
                &mut dqkv.buf,
                &mut datt.buf,
                &dout.buf,
                &qkv.buf,
                &att.buf,
                tanh.map(|x| &x.buf),
                s,
                o,
            )
        });
    }

    pub fn attention_backward(
        &mut self,
        dqkv: &mut T<B>,
        datt: &mut T<B>,
        dout: &T<B>,
        qkv: &T<B>,
        att: &T<B>,
        s: AttnShape,
    ) {
        self.timed(
            Work::attention_backward(s, b(dqkv) + 2 * b(datt) + b(dout) + b(qkv) + b(att)),
            |be| {
                be.attention_backward(
                    &mut dqkv.buf,
                    &mut datt.buf,
                    &dout.buf,
                    &qkv.buf,
                    &att.buf,
                    s,
                )
            },
        );
    }

    pub fn crossentropy_forward(
        &mut self,
        losses: &mut T<B>,
        logits: &T<B>,
        targets: &T<B>,
        n: usize,
        v: usize,
        vp: usize,
    ) {
        self.timed(
            Work::stream(
                "crossentropy",
                (4 * n * v) as u64,
                b(losses) + b(logits) + b(targets),
            ),
            |be| be.crossentropy_forward(&mut losses.buf, &logits.buf, &targets.buf, n, v, vp),
        );
    }

    pub fn crossentropy_backward(
        &mut self,
        logits: &mut T<B>,
        targets: &T<B>,
        dloss: f32,
        n: usize,
        v: usize,
        vp: usize,
    ) {
        self.timed(
            Work::stream(
                "crossentropy_backward",
                (5 * n * v) as u64,
                2 * b(logits) + b(targets),
            ),
            |be| be.crossentropy_backward(&mut logits.buf, &targets.buf, dloss, n, v, vp),
        );
    }

    /// [`Device::crossentropy_backward`], of logits soft-capped by `cap` when given.
    pub fn crossentropy_backward_capped(
        &mut self,
        logits: &mut T<B>,
        targets: &T<B>,
        dloss: f32,
        (n, v, vp): (usize, usize, usize),
        cap: Option<f32>,
    ) {
        let Some(cap) = cap else {
            return self.crossentropy_backward(logits, targets, dloss, n, v, vp);
        };
        self.timed(
            Work::stream(
                "crossentropy_softcap_backward",
                (9 * n * v) as u64,
                2 * b(logits) + b(targets),
            ),
            |be| {
                be.crossentropy_softcap_backward(
                    &mut logits.buf,
                    &targets.buf,
                    dloss,
                    n,
                    v,
                    vp,
                    cap,
                )
            },
        );
    }

    /// Vocabulary-parallel cross-entropy, step 1 on this rank's columns.
    pub fn crossentropy_part_stats(
        &mut self,
        stats: &mut T<B>,
        tgt: &mut T<B>,
        logits: &T<B>,
        targets: &T<B>,
        n: usize,
        (lo, v, vp): (usize, usize, usize),
    ) {
        self.timed(
            Work::stream(
                "crossentropy",
                (3 * n * v) as u64,
                b(stats) + b(tgt) + b(logits) + b(targets),
            ),
            |be| {
                let (s, g) = (&mut stats.buf, &mut tgt.buf);
                be.crossentropy_part_stats(s, g, &logits.buf, &targets.buf, n, lo, v, vp)
            },
        );
    }

    /// Step 2: the loss from every rank's gathered statistics.
    pub fn crossentropy_combine(
        &mut self,
        losses: &mut T<B>,
        lse: &mut T<B>,
        stats: &T<B>,
        tgt: &T<B>,
        n: usize,
        parts: usize,
    ) {
        self.timed(
            Work::stream(
                "crossentropy",
                (4 * n * parts) as u64,
                b(losses) + b(lse) + b(stats) + b(tgt),
            ),
            |be| {
                let (l, s) = (&mut losses.buf, &mut lse.buf);
                be.crossentropy_combine(l, s, &stats.buf, &tgt.buf, n, parts)
            },
        );
    }

    /// Step 3: this rank's columns of the logits' gradient, in place.
    pub fn crossentropy_part_backward(
        &mut self,
        logits: &mut T<B>,
        lse: &T<B>,
        targets: &T<B>,
        dloss: f32,
        n: usize,
        (lo, v, vp): (usize, usize, usize),
    ) {
        self.timed(
            Work::stream(
                "crossentropy_backward",
                (3 * n * v) as u64,
                2 * b(logits) + b(lse) + b(targets),
            ),
            |be| {
                let (x, l, tg) = (&mut logits.buf, &lse.buf, &targets.buf);
                be.crossentropy_part_backward(x, l, tg, dloss, n, lo, v, vp)
            },
        );
    }

    /// Moves `t` to another category (the tracker's live bytes per category
    /// change, the total and the buffer do not): a tensor that changes role,
    /// as PyTorch's `MemTracker` reclassifies a temporary once autograd
    /// hands it over as a parameter's gradient.
    pub fn retag(&mut self, t: &mut T<B>, category: Category) {
        let tracker = self.tracker_of(t.host, t.paged);
        tracker.free(t.category, t.bytes());
        tracker
            .alloc(category, t.bytes())
            .expect("the same bytes were live a moment ago");
        t.category = category;
    }

    /// A zero-length stand-in for a tensor that is not resident (a zero3
    /// parameter between its all-gathers, a zero2 gradient between backward
    /// passes). Not tracked: it holds nothing.
    pub fn placeholder(&mut self, dtype: DType, category: Category) -> T<B> {
        Tensor {
            buf: self.be.alloc(0, dtype),
            len: 0,
            dtype,
            category,
            block: 0,
            host: false,
            paged: false,
        }
    }

    /// Drops a placeholder made by [`Device::placeholder`].
    pub fn drop_placeholder(&mut self, t: T<B>) {
        debug_assert_eq!(t.len, 0, "only placeholders are dropped untracked");
        self.be.free(t.buf);
    }

    /// `dst[dst_off..][..n] = src[src_off..][..n]` (or `+=`), in `dst`'s dtype.
    pub fn copy_slice(
        &mut self,
        dst: &mut T<B>,
        dst_off: usize,
        src: &T<B>,
        src_off: usize,
        n: usize,
        accumulate: bool,
    ) {
        assert!(
            dst_off + n <= dst.len && src_off + n <= src.len,
            "copy_slice out of range"
        );
        let (op, at, bytes) = Self::copy_kind(dst, src, n, accumulate);
        self.timed_at(Work::stream(op, n * accumulate as usize, bytes), at, |be| {
            be.copy_slice(&mut dst.buf, dst_off, &src.buf, src_off, n, accumulate)
        });
    }

    /// `count` copies as [`Device::copy_slice`], the `r`th given by
    /// `piece(r) = (dst_off, src_off, n)`, `total` elements in all: what a
    /// ZeRO gather or scatter does once per rank. Charged as one kernel,
    /// whatever the rank count: FSDP2 copies a unit's gathered shards out
    /// with one `split_with_sizes_copy` and its gradients in with one
    /// `_chunk_cat` (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py),
    /// not a launch per rank. A backend without data moves nothing and
    /// skips the walk over the ranks: a gather over 16,384 ranks would
    /// otherwise cost a plan 16,384 steps per tensor.
    pub fn copy_pieces(
        &mut self,
        dst: &mut T<B>,
        src: &T<B>,
        count: usize,
        total: usize,
        accumulate: bool,
        piece: impl Fn(usize) -> (usize, usize, usize),
    ) {
        let (op, at, bytes) = Self::copy_kind(dst, src, total, accumulate);
        let work = Work::stream(op, total * accumulate as usize, bytes);
        if !self.be.holds_data() {
            self.charge(&work, 0, at, 1);
            return;
        }
        self.timed_at(work, at, |be| {
            let mut moved = 0;
            for r in 0..count {
                let (dst_off, src_off, n) = piece(r);
                assert!(
                    dst_off + n <= dst.len && src_off + n <= src.len,
                    "copy_pieces out of range"
                );
                be.copy_slice(&mut dst.buf, dst_off, &src.buf, src_off, n, accumulate);
                moved += n;
            }
            debug_assert_eq!(moved, total, "copy_pieces' total");
        });
    }

    /// A copy of `n` elements from `src` to `dst`: its op name, where it
    /// runs, and the bytes it moves (across the link: the device side's).
    fn copy_kind(dst: &T<B>, src: &T<B>, n: usize, accumulate: bool) -> (&'static str, At, u64) {
        let (op, at, bytes) = match (src.host, dst.host) {
            (false, true) => ("d2h", At::Link, n * src.dtype.size()),
            (true, false) => ("h2d", At::Link, n * dst.dtype.size()),
            (h, _) => (
                if h { "host_copy" } else { "copy" },
                Self::at(&[h]),
                n * (dst.dtype.size() * (1 + accumulate as usize) + src.dtype.size()),
            ),
        };
        (op, at, bytes as u64)
    }

    fn count_wire(&mut self, comm: &dyn Collective<B::Buf>, op: Op, bytes: u64, root: usize) {
        let wire = wire_bytes(op, bytes, comm.world(), comm.rank(), root);
        let stage = Stage::of(self.tracker.phase());
        self.meter.wire(op, bytes, comm.world(), wire, stage);
    }

    /// In place: `t = sum over ranks of t`.
    pub fn all_reduce(&mut self, comm: &mut dyn Collective<B::Buf>, t: &mut T<B>) {
        self.count_wire(comm, Op::AllReduce, t.bytes(), 0);
        self.timed(Work::stream("all_reduce", t.len, b(t)), |_| {
            comm.all_reduce_sum(&mut t.buf, t.len)
        });
    }

    /// `out` (one shard) = this rank's shard of the sum of every rank's `inp`.
    pub fn reduce_scatter(
        &mut self,
        comm: &mut dyn Collective<B::Buf>,
        out: &mut T<B>,
        inp: &T<B>,
    ) {
        assert_eq!(inp.len, out.len * comm.world(), "reduce-scatter sizes");
        self.count_wire(comm, Op::ReduceScatter, inp.bytes(), 0);
        self.timed(
            Work::stream("reduce_scatter", inp.len, b(inp) + b(out)),
            |_| comm.reduce_scatter_sum(&mut out.buf, &inp.buf, out.len),
        );
    }

    /// `out` = every rank's `inp` (one shard each), in rank order.
    pub fn all_gather(&mut self, comm: &mut dyn Collective<B::Buf>, out: &mut T<B>, inp: &T<B>) {
        assert_eq!(out.len, inp.len * comm.world(), "all-gather sizes");
        self.count_wire(comm, Op::AllGather, out.bytes(), 0);
        self.timed(Work::stream("all_gather", 0, b(inp) + b(out)), |_| {
            comm.all_gather(&mut out.buf, &inp.buf, inp.len)
        });
    }

    /// In place: `t = root's t`.
    pub fn broadcast(&mut self, comm: &mut dyn Collective<B::Buf>, t: &mut T<B>, root: usize) {
        self.count_wire(comm, Op::Broadcast, t.bytes(), root);
        self.timed(Work::stream("broadcast", 0, b(t)), |_| {
            comm.broadcast(&mut t.buf, t.len, root)
        });
    }

    /// Expert parallelism's exchange: `counts[s * world + d]` elements of
    /// `inp` go from rank `s` to rank `d` ([`Collective::all_to_all`]);
    /// `out` holds what this rank receives. Priced as nccl-tests'
    /// `alltoall` of this rank's send buffer.
    pub fn all_to_all(
        &mut self,
        comm: &mut dyn Collective<B::Buf>,
        out: &mut T<B>,
        inp: &T<B>,
        counts: &[usize],
    ) {
        let (world, rank) = (comm.world(), comm.rank());
        let es = inp.dtype.size() as u64;
        let (sent, recv) = crate::comm::all_to_all_elems(counts, world, rank);
        let row: usize = counts[rank * world..(rank + 1) * world].iter().sum();
        let stage = Stage::of(self.tracker.phase());
        let wire = (sent as u64 * es, recv as u64 * es);
        self.meter
            .wire(Op::AllToAll, row as u64 * es, world, wire, stage);
        self.timed(Work::stream("all_to_all", 0, b(inp) + b(out)), |_| {
            comm.all_to_all(&mut out.buf, &inp.buf, counts)
        });
    }

    /// Sends `t` to a neighbouring pipeline stage.
    pub fn send(&mut self, link: &mut dyn PointToPoint<B::Buf>, to: Peer, t: &T<B>) {
        self.meter.sent += t.bytes();
        self.meter.p2p_sent += t.bytes();
        self.meter.p2p_sends += 1;
        self.timed(Work::stream("send", 0, b(t)), |_| {
            link.send(to, &t.buf, t.len)
        });
    }

    /// Fills `t` from a neighbouring pipeline stage.
    pub fn recv(&mut self, link: &mut dyn PointToPoint<B::Buf>, from: Peer, t: &mut T<B>) {
        self.meter.received += t.bytes();
        self.timed(Work::stream("recv", 0, b(t)), |_| {
            link.recv(from, &mut t.buf, t.len)
        });
    }

    /// `dst = src` in `dst`'s dtype (fp32 master weights into 16-bit working weights).
    pub fn convert(&mut self, dst: &mut T<B>, src: &T<B>) {
        assert_eq!(
            dst.len, src.len,
            "convert between tensors of different lengths"
        );
        let (op, at, bytes) = match (src.host, dst.host) {
            (false, true) => ("d2h", At::Link, b(src)),
            (true, false) => ("h2d", At::Link, b(dst)),
            (true, true) => ("host_convert", At::Host, b(dst) + b(src)),
            (false, false) => ("convert", At::Device, b(dst) + b(src)),
        };
        self.timed_at(Work::stream(op, 0, bytes), at, |be| {
            be.convert(&mut dst.buf, &src.buf, src.len)
        });
    }

    pub fn sum_squares(&mut self, t: &T<B>) -> Option<f64> {
        let at = Self::at(&[t.host]);
        self.timed_at(
            Work::stream("sum_squares", (2 * t.len) as u64, b(t)),
            at,
            |be| be.sum_squares(&t.buf, t.len),
        )
    }

    pub fn adamw_update(
        &mut self,
        param: &mut T<B>,
        grad: &T<B>,
        m: &mut T<B>,
        v: &mut T<B>,
        h: AdamHyper,
    ) {
        let bytes = 2 * b(param) + b(grad) + 2 * b(m) + 2 * b(v);
        let at = Self::at(&[param.host, grad.host, m.host]);
        self.timed_at(
            Work::stream("adamw", (12 * param.len) as u64, bytes),
            at,
            |be| {
                be.adamw_update(
                    &mut param.buf,
                    &grad.buf,
                    &mut m.buf,
                    &mut v.buf,
                    param.len,
                    h,
                )
            },
        );
    }

    pub fn flash_attention_forward(
        &mut self,
        out: &mut T<B>,
        lse: &mut T<B>,
        qkv: &T<B>,
        ws: &mut T<B>,
        s: AttnShape,
    ) {
        let bytes = b(out) + b(lse) + b(qkv);
        self.timed(Work::flash_attention(s, bytes), |be| {
            be.flash_attention_forward(&mut out.buf, &mut lse.buf, &qkv.buf, &mut ws.buf, s)
        });
    }

    /// Fused attention with Gemma's options; the plain kernel where they
    /// are the standard ones.
    pub fn flash_attention_forward_with(
        &mut self,
        out: &mut T<B>,
        lse: &mut T<B>,
        qkv: &T<B>,
        ws: &mut T<B>,
        s: AttnShape,
        o: AttnOpts,
    ) {
        if o.is_standard(s) {
            return self.flash_attention_forward(out, lse, qkv, ws, s);
        }
        let bytes = b(out) + b(lse) + b(qkv);
        self.timed(Work::flash_attention(s, bytes), |be| {
            be.flash_attention_forward_with(&mut out.buf, &mut lse.buf, &qkv.buf, &mut ws.buf, s, o)
        });
    }

    /// The backward of [`Device::flash_attention_forward_with`].
    pub fn flash_attention_backward_with(
        &mut self,
        dqkv: &mut T<B>,
        dout: &T<B>,
        (out, lse, qkv): (&T<B>, &T<B>, &T<B>),
        ws: &mut T<B>,
        s: AttnShape,
        o: AttnOpts,
    ) {
        if o.is_standard(s) {
            return self.flash_attention_backward(dqkv, dout, out, lse, qkv, ws, s);
        }
        let bytes = b(dqkv) + b(dout) + b(out) + b(lse) + b(qkv);
        self.timed(Work::flash_attention_backward(s, bytes), |be| {
            be.flash_attention_backward_with(
                &mut dqkv.buf,
                &dout.buf,
                &out.buf,
                &lse.buf,
                &qkv.buf,
                &mut ws.buf,
                s,
                o,
            )
        });
    }

    pub fn flash_attention_backward(
        &mut self,
        dqkv: &mut T<B>,
        dout: &T<B>,
        out: &T<B>,
        lse: &T<B>,
        qkv: &T<B>,
        ws: &mut T<B>,
        s: AttnShape,
    ) {
        let bytes = b(dqkv) + b(dout) + b(out) + b(lse) + b(qkv);
        self.timed(Work::flash_attention_backward(s, bytes), |be| {
            be.flash_attention_backward(
                &mut dqkv.buf,
                &dout.buf,
                &out.buf,
                &lse.buf,
                &qkv.buf,
                &mut ws.buf,
                s,
            )
        });
    }

    pub fn adamw8bit_update(
        &mut self,
        param: &mut T<B>,
        grad: &T<B>,
        m: &mut T<B>,
        v: &mut T<B>,
        m_absmax: &mut T<B>,
        v_absmax: &mut T<B>,
        h: AdamHyper,
    ) {
        let bytes = 2 * (b(param) + b(m) + b(v) + b(m_absmax) + b(v_absmax)) + b(grad);
        let n = param.len;
        // AdamW's 12 plus de- and requantisation (a map lookup and a binary search each).
        let at = Self::at(&[param.host, grad.host, m.host]);
        self.timed_at(
            Work::stream("adamw8bit", (28 * n) as u64, bytes),
            at,
            |be| {
                be.adamw8bit_update(
                    &mut param.buf,
                    &grad.buf,
                    &mut m.buf,
                    &mut v.buf,
                    &mut m_absmax.buf,
                    &mut v_absmax.buf,
                    n,
                    h,
                )
            },
        );
    }

    pub fn sgd_update(
        &mut self,
        param: &mut T<B>,
        grad: &T<B>,
        momentum_buf: &mut T<B>,
        h: SgdHyper,
    ) {
        let n = param.len;
        let bytes = 2 * b(param) + b(grad) + 2 * b(momentum_buf);
        let at = Self::at(&[param.host, grad.host, momentum_buf.host]);
        self.timed_at(Work::stream("sgd", (6 * n) as u64, bytes), at, |be| {
            be.sgd_update(&mut param.buf, &grad.buf, &mut momentum_buf.buf, n, h)
        });
    }

    pub fn adafactor_update(
        &mut self,
        param: &mut T<B>,
        grad: &T<B>,
        second: AdafactorSecond<'_, T<B>>,
        m: Option<&mut T<B>>,
        h: AdafactorHyper,
    ) {
        let n = param.len;
        let state_bytes = match &second {
            AdafactorSecond::Factored { row, col, .. } => b(row) + b(col),
            AdafactorSecond::Full { v, .. } => b(v),
        } + ob(m.as_deref());
        let bytes = 2 * b(param) + 2 * b(grad) + 2 * state_bytes;
        let at = Self::at(&[param.host, grad.host]);
        let second = match second {
            AdafactorSecond::Factored {
                row,
                col,
                rows,
                cols,
            } => AdafactorSecond::Factored {
                row: &mut row.buf,
                col: &mut col.buf,
                rows,
                cols,
            },
            AdafactorSecond::Full { v, n } => AdafactorSecond::Full { v: &mut v.buf, n },
        };
        let st = AdafactorState {
            second,
            m: m.map(|m| &mut m.buf),
        };
        self.timed_at(
            Work::stream("adafactor", (20 * n) as u64, bytes),
            at,
            |be| be.adafactor_update(&mut param.buf, &grad.buf, st, h),
        );
    }
}
