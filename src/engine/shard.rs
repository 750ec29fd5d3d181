//! Data parallelism and ZeRO sharding: what each rank holds, and the
//! collectives that move gradients and parameters between ranks.
//!
//! Levels follow the ZeRO paper (Rajbhandari et al., ZeRO: Memory Optimizations
//! Toward Training Trillion Parameter Models, 2020) and PyTorch FSDP:
//!
//! | level | parameters | gradients | master + optimizer state |
//! |---|---|---|---|
//! | ddp   | full | full, all-reduced at the end of backward | full |
//! | zero1 | full | full, accumulated locally, reduce-scattered into 1/N shards for the step | 1/N shard |
//! | zero2 | full | unit by unit: full while the unit's backward runs, then reduce-scattered into a 1/N shard | 1/N shard |
//! | zero3 | 1/N shard, all-gathered per unit just before its forward and its backward, freed after | as zero2 | 1/N shard |
//!
//! Shards are per tensor, as DeepSpeed ZeRO-3 partitions each parameter: a
//! tensor of `n` elements has shards of `ceil(n/N)` elements on every rank;
//! rank `r` owns elements `r*s ..` and the last ranks carry zero padding, which
//! is allocated and counted. Padding stays zero through every update (zero
//! gradient, zero state, zero weight).
//!
//! zero3's units are FSDP units: the embedding, each transformer block, and
//! the head (final norm and output projection). A tied head reads the
//! embedding's weight, so the head's forward and backward also gather the
//! embedding unit, and the embedding's gradient lives from the head's backward
//! to the embedding's. A unit's all-gather is FSDP2's: the rank's shards are
//! copied into one flat send buffer, all-gathered into a flat `N x` buffer,
//! then copied out into the unit's full tensors (both flat buffers count as
//! `communication`). The next unit's all-gather is issued before the current
//! unit runs (prefetch), so two units are resident at the peak.
//!
//! LoRA (PEFT on PyTorch DDP or DeepSpeed): only trainable tensors (the
//! adapters, which belong to their block's unit) have gradients, master
//! weights and optimizer state, so DDP's buckets and the ZeRO gradient
//! layout cover them alone (DDP registers hooks only for parameters that
//! require grad; DeepSpeed's ZeRO-1/2 partition the optimizer's parameter
//! groups, to which the HF Trainer gives the trainable parameters only). The
//! frozen base is replicated under ddp and zero1/2 and, as every parameter,
//! partitioned and all-gathered per unit under zero3.
//!
//! ## ZeRO++ hierarchical weight partitioning (hpZ)
//!
//! Wang et al., ZeRO++: Extremely Efficient Collective Communication for
//! Giant Model Training, 2023, section 3.2; DeepSpeed's
//! `zero_optimization.zero_hpz_partition_size`. Under zero3 with
//! `hpz_group = G` (G divides the N data-parallel ranks, 1 < G < N; G is a
//! node's GPUs), the primary shards stay `ceil(n/N)` per tensor over all N
//! ranks, the forward gathers over all N as above, and gradients are
//! reduce-scattered over all N. What changes is the backward: when a unit's
//! gathered weights are released, the rank first copies its *secondary*
//! shard out of them, the unit sharded over its group of G consecutive
//! ranks (`Dist::hpz`), and the unit's backward all-gather then runs within
//! that group (world G, intra-node) from those secondary shards. The same
//! weights are gathered, so training is bit for bit zero3's.
//!
//! Layout and lifetime are DeepSpeed's (deepspeed/runtime/zero/
//! partition_parameters.py): `Init._partition` calls `_partition_param_sec`
//! before freeing a gathered parameter; it allocates `ds_secondary_tensor`
//! once, `aligned_numel / G` elements in the working dtype (here
//! `ceil(n/N) * N/G`: group rank j holds the primary shards of ranks
//! `j*N/G ..`), and copies the full weight's slice into it at every release,
//! forward or backward; backward gathers (`all_gather_coalesced` with
//! `forward=False`) read it over the intra-node group. The copies persist
//! until `DeepSpeedZeroOptimizer_Stage3._post_step` drops them
//! (`invalidate_secondary_tensor`) after the update. So memfit allocates a
//! unit's secondary shard (category `parameters`) at its first release in a
//! step (the embedding and the blocks after their forward, the head, which
//! stays gathered into its backward, after that), keeps it across the
//! step's micro-batches and through the update, and frees it before the
//! next step gathers anything: the step marks them stale
//! (`all_reduce_replicas`, the call every optimizer step makes), the next
//! `before` frees them. Every phase thus holds what DeepSpeed holds: by the
//! head's backward, the secondary shards of every unit, `sum ceil(n/N) *
//! N/G` elements per rank (1/G of the model, as the paper's memory
//! overhead). A backward gather needs no send buffer (the secondary shard
//! is one flat buffer per unit, gathered in place of FSDP's copy-in);
//! activation checkpointing's recompute runs inside the block's backward,
//! on the weights that gather brought. Values written again at later
//! releases are the same weights, so memfit writes each copy once.

use super::T;
use super::device::{Comm, Device};
use crate::backend::{Backend, DType};
use crate::comm::Collective;
use crate::config::model::ParamIndex;
use crate::memory::{Category, OomError};

knob_enum! {
    /// How the training state is spread over the ranks.
    #[serde(rename_all = "lowercase")]
    pub enum Sharding {
        /// One rank, nothing to share.
        #[default]
        None,
        /// Replicated everything; gradients all-reduced in buckets.
        Ddp,
        /// ZeRO stage 1: optimizer state and master weights sharded.
        Zero1,
        /// ZeRO stage 2: and gradients.
        Zero2,
        /// ZeRO stage 3 / FSDP full sharding: and parameters.
        Zero3,
    }
}

impl Sharding {
    pub fn shards_optimizer(self) -> bool {
        matches!(self, Sharding::Zero1 | Sharding::Zero2 | Sharding::Zero3)
    }
    pub fn shards_gradients(self) -> bool {
        matches!(self, Sharding::Zero2 | Sharding::Zero3)
    }
    pub fn shards_parameters(self) -> bool {
        self == Sharding::Zero3
    }
}

knob_enum! {
    /// ZeRO-Offload (Ren et al., ZeRO-Offload: Democratizing Billion-Scale
    /// Model Training, 2021) and ZeRO-Infinity's parameter offload, as
    /// DeepSpeed's `offload_optimizer` / `offload_param` with `device: cpu` run
    /// them. With the optimizer offloaded, each rank's fp32 master shard, its
    /// optimizer state and an fp32 gradient shard live in host memory: gradients
    /// are reduce-scattered on the device and copied to the host shard (where
    /// micro-batches accumulate), the update runs on the CPU, and the new
    /// weights are copied back in the working dtype. With the parameters
    /// offloaded too (ZeRO-3 only), the weight shard lives on the host and each
    /// unit's all-gather first copies it up.
    // Ordered: none < optimizer < optimizer+params (what moves off the device).
    #[derive(PartialOrd, Ord)]
    pub enum Offload {
        /// Everything on the device.
        #[default]
        #[serde(rename = "none")]
        #[value(name = "none")]
        None,
        /// Master weights, optimizer state and the gradient shard on the host.
        #[serde(rename = "optimizer")]
        #[value(name = "optimizer")]
        Optimizer,
        /// And the weight shard (ZeRO-3).
        #[serde(rename = "optimizer+params")]
        #[value(name = "optimizer+params")]
        OptimizerParams,
    }
}

impl Offload {
    pub fn optimizer(self) -> bool {
        self != Offload::None
    }
    pub fn params(self) -> bool {
        self == Offload::OptimizerParams
    }
    pub fn name(self) -> &'static str {
        match self {
            Offload::None => "none",
            Offload::Optimizer => "optimizer",
            Offload::OptimizerParams => "optimizer+params",
        }
    }
    /// What lives in host memory, for a label: this offload's state, and
    /// with `activations` (`--offload-activations`) the block inputs.
    pub fn host_label(self, activations: bool) -> String {
        match (self, activations) {
            (Offload::None, true) => "activations".into(),
            (o, true) => format!("{} and activations", o.name()),
            (o, false) => o.name().into(),
        }
    }

    /// Why `self` cannot run with `sharding`, if it cannot.
    pub fn check(self, sharding: Sharding) -> Option<&'static str> {
        match self {
            Offload::Optimizer if !sharding.shards_optimizer() => Some(
                "offloading the optimizer needs ZeRO (sharding zero1, zero2 or zero3), as DeepSpeed's offload_optimizer does",
            ),
            Offload::OptimizerParams if !sharding.shards_parameters() => Some(
                "offloading the parameters needs ZeRO-3 (sharding zero3), as DeepSpeed's offload_param does",
            ),
            _ => None,
        }
    }
}

/// PyTorch DDP's bucket sizes: the first bucket is capped at 1 MiB
/// (`dist._DEFAULT_FIRST_BUCKET_BYTES`) so that communication starts early,
/// the others at `bucket_cap_mb = 25`.
pub const FIRST_BUCKET_BYTES: usize = 1 << 20;
pub const BUCKET_BYTES: usize = 25 << 20;

/// DDP's gradient buckets: parameter indices in reverse order (the order
/// backward produces gradients), greedily packed up to the caps; a tensor
/// larger than a cap gets a bucket of its own. Empty tensors (the ones
/// another pipeline stage holds) are left out.
pub fn buckets(bytes: &[usize]) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    let (mut cur, mut fill) = (Vec::new(), 0);
    for i in (0..bytes.len()).rev().filter(|&i| bytes[i] > 0) {
        let cap = if out.is_empty() {
            FIRST_BUCKET_BYTES
        } else {
            BUCKET_BYTES
        };
        if !cur.is_empty() && fill + bytes[i] > cap {
            out.push(std::mem::take(&mut cur));
            fill = 0;
        }
        cur.push(i);
        fill += bytes[i];
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// One DDP bucket: its tensors and, unless gradients are views into it
/// (`--bucket-view`), its own flat buffer.
#[derive(Clone)]
pub struct Bucket<X> {
    pub params: Vec<usize>,
    pub buf: Option<X>,
    /// Expert parallelism: a bucket of expert tensors, all-reduced over
    /// the ranks that hold the same experts (Megatron-Core buckets them
    /// apart for that reason).
    pub experts: bool,
}

/// The FSDP units of a model with LoRA adapters: each block's adapters
/// (`adapters[l]`: their tensor indices) join block `l`'s unit, as PEFT
/// wraps them inside the block's modules.
pub fn units_with(idx: &ParamIndex, adapters: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let mut out = units(idx);
    for (l, ids) in adapters.iter().enumerate() {
        out[1 + l].extend_from_slice(ids);
    }
    out
}

/// The FSDP units of a model: `[embedding, block 0, ..., block L-1, head]`.
pub fn units(idx: &ParamIndex) -> Vec<Vec<usize>> {
    let mut out = vec![std::iter::once(idx.wte).chain(idx.wpe).collect()];
    for b in &idx.blocks {
        out.push(b.tensors().collect());
    }
    out.push(
        std::iter::once(idx.lnf_w)
            .chain(idx.lnf_b)
            .chain(idx.lm_head)
            .collect(),
    );
    out
}

/// LoRA's tensors per block: all of them, and those on its experts.
pub type BlockAdapters<'a> = (&'a [Vec<usize>], &'a [Vec<usize>]);

/// One rank's view of a data-parallel job.
pub struct Dist<B: Backend> {
    pub comm: Comm<B>,
    pub sharding: Sharding,
    pub rank: usize,
    pub world: usize,
    /// Elements of each tensor, and of each tensor's shard (`ceil(n / N)`).
    pub numel: Vec<usize>,
    pub shard: Vec<usize>,
    pub units: Vec<Vec<usize>>,
    /// Where tensor `i`'s shard starts in its unit's flat shard, and each
    /// unit's flat shard length.
    unit_off: Vec<usize>,
    unit_len: Vec<usize>,
    /// The gradients' part of all that: only trainable tensors have
    /// gradients (LoRA freezes the base), so a frozen tensor's gradient
    /// numel and shard are 0 and the gradient flat buffers of a unit lay out
    /// its trainable tensors alone.
    pub grad_numel: Vec<usize>,
    pub grad_shard: Vec<usize>,
    grad_off: Vec<usize>,
    grad_len: Vec<usize>,
    tied: bool,
    /// zero3: this rank's shard of every weight (the working dtype).
    pub param_shards: Vec<T<B>>,
    /// zero2/3: this rank's shard of every gradient.
    pub grad_shards: Vec<T<B>>,
    /// ddp: gradient buckets.
    pub buckets: Vec<Bucket<T<B>>>,
    /// Offload: gradient shards live on the host, in fp32.
    pub grads_on_host: bool,
    /// Hybrid sharding: the same shard's ranks in the other shard groups.
    pub replicate: Option<Comm<B>>,
    /// ZeRO++ hpZ: this rank's group of consecutive data-parallel ranks,
    /// in which the backward gathers run (set by [`Dist::set_hpz`]).
    hpz: Option<Comm<B>>,
    /// Expert parallelism: the ranks that hold this rank's experts (the
    /// expert-data-parallel group), over which the expert units are
    /// sharded and reduced; `None` without it.
    edp: Option<Comm<B>>,
    /// Each block's expert unit, if split off (the units after the head's;
    /// sharded over `edp`).
    block_experts: Vec<Option<usize>>,
    /// Each tensor's unit.
    unit_of: Vec<usize>,
    /// Transformer blocks (units `1 ..= blocks`; the head is next).
    blocks: usize,
    /// hpZ: each unit's secondary shard once written this step (tensor
    /// `i`'s part at `unit_off[i] * N/G`, `shard[i] * N/G` long).
    secondary: Vec<Option<T<B>>>,
    /// hpZ: an update has begun since the secondary shards were written.
    secondary_stale: bool,
    gathered: Vec<bool>,
    grads_live: Vec<bool>,
}

/// The data-parallel group `comm` (of `world` ranks, `stride` apart), or
/// for `experts` the expert-data-parallel group `edp`, whose members are
/// an expert-parallel group apart.
fn pick<'a, B: Backend>(
    comm: &'a mut Comm<B>,
    edp: Option<&'a mut Comm<B>>,
    world: usize,
    (experts, stride): (bool, usize),
) -> (&'a mut dyn Collective<B::Buf>, usize) {
    match (experts, edp) {
        (true, Some(e)) => {
            let p = world / e.world();
            (&mut **e, stride * p)
        }
        _ => (&mut **comm, stride),
    }
}

/// A step of the forward or backward schedule, for the unit hooks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Embed,
    Block(usize),
    Head,
}

/// Each tensor's offset in its unit's flat buffer of `len` (per tensor),
/// and each unit's length.
fn flat_layout(units: &[Vec<usize>], len: &[usize]) -> (Vec<usize>, Vec<usize>) {
    let mut at = vec![0; len.len()];
    let mut total = Vec::with_capacity(units.len());
    for u in units {
        let mut off = 0;
        for &i in u {
            at[i] = off;
            off += len[i];
        }
        total.push(off);
    }
    (at, total)
}

impl Dist<crate::backend::meta::MetaBackend> {
    /// A copy for a forked planning engine (`Engine::reshaped`); `None`
    /// when one of its communicators cannot be copied.
    pub fn fork(&self) -> Option<Self> {
        let fork = |c: &Option<Comm<crate::backend::meta::MetaBackend>>| match c {
            Some(c) => c.fork().map(Some),
            None => Some(None),
        };
        Some(Dist {
            comm: self.comm.fork()?,
            replicate: fork(&self.replicate)?,
            hpz: fork(&self.hpz)?,
            edp: fork(&self.edp)?,
            block_experts: self.block_experts.clone(),
            unit_of: self.unit_of.clone(),
            blocks: self.blocks,
            sharding: self.sharding,
            rank: self.rank,
            world: self.world,
            numel: self.numel.clone(),
            shard: self.shard.clone(),
            units: self.units.clone(),
            unit_off: self.unit_off.clone(),
            unit_len: self.unit_len.clone(),
            grad_numel: self.grad_numel.clone(),
            grad_shard: self.grad_shard.clone(),
            grad_off: self.grad_off.clone(),
            grad_len: self.grad_len.clone(),
            tied: self.tied,
            param_shards: self.param_shards.clone(),
            grad_shards: self.grad_shards.clone(),
            buckets: self.buckets.clone(),
            grads_on_host: self.grads_on_host,
            secondary: self.secondary.clone(),
            secondary_stale: self.secondary_stale,
            gathered: self.gathered.clone(),
            grads_live: self.grads_live.clone(),
        })
    }
}

impl<B: Backend> Dist<B> {
    /// `numel`: what this rank holds of each tensor before sharding;
    /// `adapters[l]`: block `l`'s LoRA tensors (none for full training),
    /// which join its unit ([`units_with`]), except that under expert
    /// parallelism those on its experts (`on_experts[l]`) join the
    /// experts' unit, held and reduced as the experts are; `trainable`: which tensors
    /// have gradients; `edp`: under expert parallelism, the ranks that
    /// hold this rank's experts. Each routed block's experts are then a
    /// unit of their own, after the head, sharded and reduced over `edp`
    /// (DeepSpeed-MoE's and Megatron-Core's expert-data-parallel group).
    pub fn new(
        comm: Comm<B>,
        sharding: Sharding,
        numel: Vec<usize>,
        idx: &ParamIndex,
        ((adapters, on_experts), trainable): (BlockAdapters<'_>, &[bool]),
        edp: Option<Comm<B>>,
    ) -> Self {
        let (rank, world) = (comm.rank(), comm.world());
        let mut units = units_with(idx, adapters);
        let blocks = idx.blocks.len();
        let mut block_experts = vec![None; blocks];
        if edp.is_some() {
            for (l, b) in idx.blocks.iter().enumerate() {
                if let Some(m) = b.moe {
                    let ads = on_experts.get(l).map_or(&[][..], |v| &v[..]);
                    units[1 + l].retain(|&i| i != m.up && i != m.down && !ads.contains(&i));
                    block_experts[l] = Some(units.len());
                    units.push([&[m.up, m.down][..], ads].concat());
                }
            }
        }
        let expert_unit = |u: usize| u > blocks + 1;
        let mut unit_of = vec![0; numel.len()];
        for (u, list) in units.iter().enumerate() {
            for &i in list {
                unit_of[i] = u;
            }
        }
        assert_eq!(
            units.iter().map(Vec::len).sum::<usize>(),
            numel.len(),
            "every tensor in exactly one unit"
        );
        let edp_world = edp.as_ref().map_or(1, |c| c.world());
        let shard: Vec<usize> = (numel.iter().enumerate())
            .map(|(i, n)| {
                n.div_ceil(if expert_unit(unit_of[i]) {
                    edp_world
                } else {
                    world
                })
            })
            .collect();
        let (unit_off, unit_len) = flat_layout(&units, &shard);
        let masked = |v: &[usize]| -> Vec<usize> {
            v.iter()
                .zip(trainable)
                .map(|(&n, &t)| if t { n } else { 0 })
                .collect()
        };
        let (grad_numel, grad_shard) = (masked(&numel), masked(&shard));
        let (grad_off, grad_len) = flat_layout(&units, &grad_shard);
        let n_units = units.len();
        Dist {
            comm,
            sharding,
            rank,
            world,
            numel,
            shard,
            units,
            unit_off,
            unit_len,
            grad_numel,
            grad_shard,
            grad_off,
            grad_len,
            tied: idx.lm_head.is_none(),
            param_shards: Vec::new(),
            grad_shards: Vec::new(),
            buckets: Vec::new(),
            grads_on_host: false,
            replicate: None,
            hpz: None,
            edp,
            block_experts,
            unit_of,
            blocks,
            secondary: Vec::new(),
            secondary_stale: false,
            gathered: vec![false; n_units],
            grads_live: vec![false; n_units],
        }
    }

    /// Elements of tensor `i` that rank `r` owns (the rest of its shard is padding).
    pub fn valid(&self, i: usize, r: usize) -> usize {
        self.numel[i]
            .saturating_sub(r * self.shard[i])
            .min(self.shard[i])
    }

    /// The first element of tensor `i` this rank owns.
    pub fn offset(&self, i: usize) -> usize {
        self.rank_of(i) * self.shard[i]
    }

    /// Elements of tensor `i` this rank owns.
    pub fn own(&self, i: usize) -> usize {
        self.valid(i, self.rank_of(i))
    }

    /// Tensor `i`'s group: this rank's place in it, and its size (the
    /// expert-data-parallel group for an expert tensor).
    pub fn rank_of(&self, i: usize) -> usize {
        self.place(self.unit_of[i]).0
    }
    pub fn world_of(&self, i: usize) -> usize {
        self.place(self.unit_of[i]).1
    }

    /// Whether unit `u` holds experts (the units after the head's).
    fn expert_unit(&self, u: usize) -> bool {
        u > self.blocks + 1
    }

    /// Unit `u`'s group: `(rank, world)`.
    fn place(&self, u: usize) -> (usize, usize) {
        match (self.expert_unit(u), &self.edp) {
            (true, Some(e)) => (e.rank(), e.world()),
            _ => (self.rank, self.world),
        }
    }

    /// Unit `u`'s group, and the ranks between two of its members.
    fn group_of(&mut self, stride: usize, u: usize) -> (&mut dyn Collective<B::Buf>, usize) {
        let experts = self.expert_unit(u);
        pick::<B>(
            &mut self.comm,
            self.edp.as_mut(),
            self.world,
            (experts, stride),
        )
    }

    /// Whether tensor `i` is an expert sharded over its own group.
    pub fn is_expert(&self, i: usize) -> bool {
        self.expert_unit(self.unit_of[i])
    }

    /// ddp: tensor `i`'s weights from rank 0 of its group, as DDP's
    /// constructor broadcasts them.
    pub fn broadcast_param(&mut self, dev: &mut Device<B>, i: usize, t: &mut T<B>) {
        let stride = dev.meter.call_stride;
        let (comm, stride) = self.group_of(stride, self.unit_of[i]);
        dev.with_stride(stride, |dev| dev.broadcast(comm, t, 0));
    }

    /// zero1/2: every rank's updated shard of tensor `i` (`send`) gathered
    /// into `recv`, over the tensor's group.
    pub fn all_gather_param(
        &mut self,
        dev: &mut Device<B>,
        i: usize,
        recv: &mut T<B>,
        send: &T<B>,
    ) {
        let stride = dev.meter.call_stride;
        let (comm, stride) = self.group_of(stride, self.unit_of[i]);
        dev.updated_weights(|dev| dev.with_stride(stride, |dev| dev.all_gather(comm, recv, send)));
    }

    /// ZeRO++ hpZ: backward gathers run in `group`, this rank's group of
    /// consecutive data-parallel ranks, from secondary shards.
    pub fn set_hpz(&mut self, group: Comm<B>) {
        let g = group.world();
        assert!(
            self.sharding.shards_parameters(),
            "hpZ partitions zero3's weights (engine::validate says so)"
        );
        assert!(
            g > 1 && g < self.world && self.world.is_multiple_of(g),
            "hpZ groups of {g} must split {} ranks into two or more",
            self.world
        );
        self.secondary = (0..self.units.len()).map(|_| None).collect();
        self.hpz = Some(group);
    }

    /// hpZ: primary shards per secondary shard (`N / G`), and this rank's
    /// place in its group.
    fn hpz_place(&self) -> Option<(usize, usize)> {
        let h = self.hpz.as_ref()?;
        Some((self.world / h.world(), h.rank()))
    }

    /// hpZ: elements of tensor `i` that group rank `j`'s secondary shard
    /// holds (the rest of it is padding), from `j * shard * k`.
    fn secondary_valid(&self, i: usize, j: usize, k: usize) -> usize {
        let s = self.shard[i] * k;
        self.numel[i].saturating_sub(j * s).min(s)
    }

    fn embed(&self) -> usize {
        0
    }
    fn head(&self) -> usize {
        self.blocks + 1
    }

    /// Units whose weights a stage's forward (and backward) reads.
    fn param_units(&self, s: Stage, backward: bool) -> Vec<usize> {
        match s {
            // The embedding's backward is a scatter-add: it reads no weights.
            Stage::Embed if backward => vec![],
            Stage::Embed => vec![self.embed()],
            Stage::Block(l) => std::iter::once(1 + l)
                .chain(self.block_experts[l])
                .collect(),
            Stage::Head if self.tied => vec![self.head(), self.embed()],
            Stage::Head => vec![self.head()],
        }
    }

    fn next(&self, s: Stage, backward: bool) -> Option<Stage> {
        let blocks = self.blocks;
        match (s, backward) {
            (Stage::Embed, false) if blocks > 0 => Some(Stage::Block(0)),
            (Stage::Embed, false) => Some(Stage::Head),
            (Stage::Block(l), false) if l + 1 < blocks => Some(Stage::Block(l + 1)),
            (Stage::Block(_), false) => Some(Stage::Head),
            (Stage::Head, false) => None,
            (Stage::Head, true) if blocks > 0 => Some(Stage::Block(blocks - 1)),
            (Stage::Head, true) => Some(Stage::Embed),
            (Stage::Block(0), true) => Some(Stage::Embed),
            (Stage::Block(l), true) => Some(Stage::Block(l - 1)),
            (Stage::Embed, true) => None,
        }
    }

    /// Before a stage runs: its units' weights gathered (zero3), the next
    /// stage's prefetched, and in backward its gradients allocated (zero2/3).
    pub fn before(
        &mut self,
        dev: &mut Device<B>,
        p: &mut [T<B>],
        g: &mut [T<B>],
        s: Stage,
        backward: bool,
    ) -> Result<(), OomError> {
        if self.secondary_stale {
            // hpZ: the last update rewrote the weights these were copied
            // from; DeepSpeed drops them after it (`_post_step`).
            for t in self.secondary.iter_mut().filter_map(Option::take) {
                dev.free(t);
            }
            self.secondary_stale = false;
        }
        for u in self.param_units(s, backward) {
            self.gather(dev, p, u, backward)?;
        }
        if let Some(n) = self.next(s, backward) {
            for u in self.param_units(n, backward) {
                self.gather(dev, p, u, backward)?;
            }
        }
        if backward {
            let mut us = self.param_units(s, false);
            if s == Stage::Embed {
                us = vec![self.embed()];
            }
            for u in us {
                self.ensure_grads(dev, g, u)?;
            }
        }
        Ok(())
    }

    /// After a stage: in backward its own unit's gradients are reduce-scattered
    /// (zero2/3); weights the next stage does not read are freed (zero3),
    /// except after the head's forward, which the backward pass needs next.
    pub fn after(
        &mut self,
        dev: &mut Device<B>,
        p: &mut [T<B>],
        g: &mut [T<B>],
        s: Stage,
        backward: bool,
    ) -> Result<(), OomError> {
        if backward {
            let own = match s {
                Stage::Embed => vec![self.embed()],
                Stage::Block(l) => std::iter::once(1 + l)
                    .chain(self.block_experts[l])
                    .collect(),
                Stage::Head => vec![self.head()],
            };
            for u in own {
                self.reduce_grads(dev, g, u)?;
            }
        } else if s == Stage::Head {
            return Ok(());
        }
        let keep = self
            .next(s, backward)
            .map(|n| self.param_units(n, backward))
            .unwrap_or_default();
        for u in self.param_units(s, backward) {
            if !keep.contains(&u) {
                self.release(dev, p, u)?;
            }
        }
        Ok(())
    }

    /// zero3: all-gathers unit `u`'s weights into full tensors: over every
    /// rank from the primary shards, or, for a backward under hpZ, within
    /// the group from the secondary shards.
    fn gather(
        &mut self,
        dev: &mut Device<B>,
        p: &mut [T<B>],
        u: usize,
        backward: bool,
    ) -> Result<(), OomError> {
        if !self.sharding.shards_parameters() || self.gathered[u] {
            return Ok(());
        }
        if backward && self.secondary.get(u).is_some_and(Option::is_some) {
            return self.gather_secondary(dev, p, u);
        }
        let (su, world) = (self.unit_len[u], self.place(u).1);
        let dt = self.param_shards[self.units[u][0]].dtype;
        let comm = Category::Communication;
        let mut send = dev.alloc(su, dt, comm)?;
        for &i in &self.units[u] {
            dev.copy_slice(
                &mut send,
                self.unit_off[i],
                &self.param_shards[i],
                0,
                self.shard[i],
                false,
            );
        }
        let mut recv = dev.alloc(world * su, dt, comm)?;
        let (group, stride) = self.group_of(dev.meter.call_stride, u);
        dev.with_stride(stride, |dev| dev.all_gather(group, &mut recv, &send));
        dev.free(send);
        for &i in &self.units[u] {
            let mut full = dev.alloc(self.numel[i], dt, Category::Parameters)?;
            let (shard, off) = (self.shard[i], self.unit_off[i]);
            dev.copy_pieces(&mut full, &recv, world, self.numel[i], false, |r| {
                (r * shard, r * su + off, self.valid(i, r))
            });
            let old = std::mem::replace(&mut p[i], full);
            dev.drop_placeholder(old);
        }
        dev.free(recv);
        self.gathered[u] = true;
        Ok(())
    }

    /// hpZ: all-gathers unit `u`'s weights within the group, each rank
    /// sending its secondary shard as it is (no copy-in buffer).
    fn gather_secondary(
        &mut self,
        dev: &mut Device<B>,
        p: &mut [T<B>],
        u: usize,
    ) -> Result<(), OomError> {
        let (k, _) = self.hpz_place().expect("hpZ");
        let group = self.hpz.as_mut().expect("hpZ");
        let sec = self.secondary[u].as_ref().expect("written at the release");
        let (g, len, dt) = (group.world(), sec.len, sec.dtype);
        let mut recv = dev.alloc(g * len, dt, Category::Communication)?;
        // Consecutive data-parallel ranks: `call_stride` already says how
        // far apart they are (a tensor-parallel group).
        dev.all_gather(&mut **group, &mut recv, sec);
        for &i in &self.units[u] {
            let mut full = dev.alloc(self.numel[i], dt, Category::Parameters)?;
            let (s, off) = (self.shard[i] * k, self.unit_off[i] * k);
            dev.copy_pieces(&mut full, &recv, g, self.numel[i], false, |j| {
                (j * s, j * len + off, self.secondary_valid(i, j, k))
            });
            let old = std::mem::replace(&mut p[i], full);
            dev.drop_placeholder(old);
        }
        dev.free(recv);
        self.gathered[u] = true;
        Ok(())
    }

    /// zero3: frees unit `u`'s full weights; under hpZ, the first release
    /// in a step first copies the unit's secondary shard out of them.
    fn release(&mut self, dev: &mut Device<B>, p: &mut [T<B>], u: usize) -> Result<(), OomError> {
        if !self.sharding.shards_parameters() || !self.gathered[u] {
            return Ok(());
        }
        if let Some((k, j)) = self.hpz_place()
            && self.secondary[u].is_none()
        {
            let dt = p[self.units[u][0]].dtype;
            let mut sec = dev.alloc(self.unit_len[u] * k, dt, Category::Parameters)?;
            for &i in &self.units[u] {
                let v = self.secondary_valid(i, j, k);
                let from = j * self.shard[i] * k;
                dev.copy_slice(&mut sec, self.unit_off[i] * k, &p[i], from, v, false);
            }
            self.secondary[u] = Some(sec);
        }
        for &i in &self.units[u] {
            let ph = dev.placeholder(p[i].dtype, Category::Parameters);
            dev.free(std::mem::replace(&mut p[i], ph));
        }
        self.gathered[u] = false;
        Ok(())
    }

    /// zero2/3: allocates unit `u`'s full gradients (zero-filled) for its backward.
    fn ensure_grads(
        &mut self,
        dev: &mut Device<B>,
        g: &mut [T<B>],
        u: usize,
    ) -> Result<(), OomError> {
        if !self.sharding.shards_gradients() || self.grads_live[u] {
            return Ok(());
        }
        for &i in self.units[u].iter().filter(|&&i| self.grad_numel[i] > 0) {
            let full = dev.alloc(self.grad_numel[i], g[i].dtype, Category::Gradients)?;
            let old = std::mem::replace(&mut g[i], full);
            dev.drop_placeholder(old);
        }
        self.grads_live[u] = true;
        Ok(())
    }

    /// zero2/3: reduce-scatters unit `u`'s full gradients and adds this
    /// rank's part to its gradient shards, then frees the full gradients.
    fn reduce_grads(
        &mut self,
        dev: &mut Device<B>,
        g: &mut [T<B>],
        u: usize,
    ) -> Result<(), OomError> {
        if !self.sharding.shards_gradients() || !self.grads_live[u] {
            return Ok(());
        }
        self.reduce_scatter_unit(dev, g, u, true)?;
        self.grads_live[u] = false;
        Ok(())
    }

    /// zero1: the gradients stay whole and accumulate locally over the
    /// micro-batches; at the step they are reduce-scattered, unit by unit,
    /// into gradient shards that live for the optimizer step (the ZeRO
    /// paper's `P_os`: a reduce-scatter and an all-gather, as much traffic as
    /// DDP's all-reduce).
    pub fn scatter_full_grads(
        &mut self,
        dev: &mut Device<B>,
        g: &mut [T<B>],
    ) -> Result<(), OomError> {
        self.grad_shards = Vec::with_capacity(self.numel.len());
        for (i, &s) in self.grad_shard.iter().enumerate() {
            let t = match self.grads_on_host {
                true => dev.on_host(|dev| dev.alloc(s, DType::F32, Category::Gradients))?,
                false => dev.alloc(s, g[i].dtype, Category::Gradients)?,
            };
            self.grad_shards.push(t);
        }
        for u in 0..self.units.len() {
            self.reduce_scatter_unit(dev, g, u, false)?;
        }
        Ok(())
    }

    /// Hybrid sharding: sums each gradient shard over the replicas (the same
    /// shard in every shard group), so that every group updates with the
    /// whole job's gradient. The network sees shards, not whole gradients.
    ///
    /// Every optimizer step makes this call before its update, so it also
    /// marks hpZ's secondary shards stale: the update rewrites the weights
    /// they copy, and the next gather frees them (module comment).
    pub fn all_reduce_replicas(&mut self, dev: &mut Device<B>, owned: &[bool]) {
        self.secondary_stale = self.hpz.is_some();
        let Some(rep) = self.replicate.as_mut() else {
            return;
        };
        // These ranks are a shard group apart: priced on that placement.
        let grads = self.grad_shards.iter_mut().zip(owned).filter(|(_, o)| **o);
        dev.with_stride(dev.meter.call_stride * self.world, |dev| {
            for (g, _) in grads {
                dev.all_reduce(&mut **rep, g);
            }
        });
    }

    /// zero1: frees the step's gradient shards.
    pub fn drop_grad_shards(&mut self, dev: &mut Device<B>) {
        for t in self.grad_shards.drain(..) {
            dev.free(t);
        }
    }

    /// Copies unit `u`'s full gradients into one flat buffer laid out rank by
    /// rank (each trainable tensor's shard padded), reduce-scatters it, and
    /// adds this rank's part to the gradient shards. `free_full` frees the
    /// full gradients as soon as they are copied (zero2/3). A unit without
    /// a gradient (another pipeline stage's, or a frozen one) sends nothing.
    fn reduce_scatter_unit(
        &mut self,
        dev: &mut Device<B>,
        g: &mut [T<B>],
        u: usize,
        free_full: bool,
    ) -> Result<(), OomError> {
        let (su, world) = (self.grad_len[u], self.place(u).1);
        if su == 0 {
            return Ok(());
        }
        let with_grads: Vec<usize> = self.units[u]
            .iter()
            .copied()
            .filter(|&i| self.grad_numel[i] > 0)
            .collect();
        let dt = g[with_grads[0]].dtype;
        let comm = Category::Communication;
        let mut send = dev.alloc(world * su, dt, comm)?;
        for &i in &with_grads {
            let (shard, off) = (self.shard[i], self.grad_off[i]);
            dev.copy_pieces(&mut send, &g[i], world, self.numel[i], false, |r| {
                (r * su + off, r * shard, self.valid(i, r))
            });
            if free_full {
                let ph = dev.placeholder(dt, Category::Gradients);
                dev.free(std::mem::replace(&mut g[i], ph));
            }
        }
        let mut recv = dev.alloc(su, dt, comm)?;
        let (group, stride) = self.group_of(dev.meter.call_stride, u);
        dev.with_stride(stride, |dev| dev.reduce_scatter(group, &mut recv, &send));
        dev.free(send);
        for &i in &with_grads {
            let (off, s) = (self.grad_off[i], self.grad_shard[i]);
            dev.copy_slice(&mut self.grad_shards[i], 0, &recv, off, s, true);
        }
        dev.free(recv);
        Ok(())
    }

    /// ddp: sums the full gradients over ranks, bucket by bucket (through
    /// each bucket's own buffer unless gradients are its views).
    pub fn all_reduce_grads(&mut self, dev: &mut Device<B>, g: &mut [T<B>]) {
        let stride = dev.meter.call_stride;
        for b in &mut self.buckets {
            let (comm, stride) = pick::<B>(
                &mut self.comm,
                self.edp.as_mut(),
                self.world,
                (b.experts, stride),
            );
            let was = std::mem::replace(&mut dev.meter.call_stride, stride);
            match &mut b.buf {
                None => {
                    for &i in &b.params {
                        dev.all_reduce(comm, &mut g[i]);
                    }
                }
                Some(buf) => {
                    let mut off = 0;
                    for &i in &b.params {
                        dev.copy_slice(buf, off, &g[i], 0, g[i].len, false);
                        off += g[i].len;
                    }
                    dev.all_reduce(comm, buf);
                    let mut off = 0;
                    for &i in &b.params {
                        let n = g[i].len;
                        dev.copy_slice(&mut g[i], 0, buf, off, n, false);
                        off += n;
                    }
                }
            }
            dev.meter.call_stride = was;
        }
    }

    /// ddp: allocates the bucket buffers (none with `bucket_view`). Only
    /// tensors with gradients are bucketed, as DDP hooks only parameters
    /// that require grad.
    pub fn alloc_buckets(
        &mut self,
        dev: &mut Device<B>,
        dt: DType,
        bucket_view: bool,
    ) -> Result<(), OomError> {
        // Expert tensors in buckets of their own, after the others.
        for experts in [false, true] {
            let bytes: Vec<usize> = (self.grad_numel.iter().enumerate())
                .map(|(i, n)| match self.is_expert(i) == experts {
                    true => n * dt.size(),
                    false => 0,
                })
                .collect();
            for params in buckets(&bytes) {
                let buf = if bucket_view {
                    None
                } else {
                    let n = params.iter().map(|&i| self.grad_numel[i]).sum();
                    Some(dev.alloc(n, dt, Category::Communication)?)
                };
                self.buckets.push(Bucket {
                    params,
                    buf,
                    experts,
                });
            }
        }
        Ok(())
    }

    /// Frees everything this rank's sharding holds.
    pub fn release_all(self, dev: &mut Device<B>) {
        let secondary = self.secondary.into_iter().flatten();
        for t in self
            .param_shards
            .into_iter()
            .chain(self.grad_shards)
            .chain(secondary)
        {
            dev.free(t);
        }
        for b in self.buckets {
            dev.free_opt(b.buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ddp_buckets_follow_pytorch_caps() {
        // 3 MiB, 0.5, 0.5, 20, 20 MiB tensors, packed from the last one.
        let mib = 1 << 20;
        let b = buckets(&[3 * mib, mib / 2, mib / 2, 20 * mib, 20 * mib]);
        assert_eq!(b, vec![vec![4], vec![3, 2, 1, 0]]);
        // The first bucket closes at 1 MiB, the next ones at 25 MiB.
        let b = buckets(&[mib / 2; 4]);
        assert_eq!(b, vec![vec![3, 2], vec![1, 0]]);
        let small = buckets(&[100, 200, 300]);
        assert_eq!(small, vec![vec![2, 1, 0]]);
    }
}
