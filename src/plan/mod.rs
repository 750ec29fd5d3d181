//! `memfit plan`: predicts memory, step time and cost for every point of a
//! recipe's grid by running the engine on the meta backend, and recommends
//! the cheapest configuration that fits.
//!
//! Memory is exact (the meta == cpu invariant): each point runs one optimizer
//! step of the real engine on rank 0 of its job; every rank allocates the same
//! sizes (tests/it/sharding.rs), so rank 0 speaks for all. The hardware's
//! runtime overhead (CUDA context, library workspaces) is added on top.
//!
//! Time is a model, not a measurement: each op the engine runs is priced on
//! the GPU's roofline from its FLOPs, bytes and shape (`engine::ops::Work`):
//! a GEMM at the efficiency factor below, derated by the tiles and waves its
//! M x N leaves idle on the GPU's SMs; fused attention at the rate
//! FlashAttention-2 reaches on that GPU (the hardware profile); the rest by
//! bytes at the memory efficiency below. Collectives are priced on the
//! cluster's links (`comm::topology`); data-parallel ones cost only what the
//! compute they run beside does not hide (`CommTime::exposed`), tensor-
//! parallel ones are waited for (beyond their GEMMs, with Megatron's
//! `--tp-comm-overlap`), and so are the optimizer's gathers of updated
//! weights (beside the next forward, with `--overlap-param-gather`). The calibration table
//! in the README (tests/it/calibration.rs) holds this against published runs.

use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use crate::backend::meta::MetaBackend;
use crate::comm::MetaComm;
use crate::config::ModelConfig;
use crate::config::attention_kernels::AttentionKernel;
use crate::config::hardware::{HardwareProfile, load_hardware};
use crate::config::profile::{load_model, looks_like_path, parse_yaml, value_location};
use crate::engine::cluster::Links;
use crate::engine::device::{AttentionTable, Beside, Curve, HostRoofline, Roofline, Tiles};
use crate::engine::{
    Attention, Checkpointing, Comm, Engine, Finetune, Framework, LoraConfig, Loss, Offload,
    Optimizer, Precision, Sharding, TrainConfig,
};
use crate::error::{Error, Result};
use crate::knobs::Knobs;
use crate::memory::{Category, PeakBytes};

/// Fraction of the dense peak FLOP/s that large training GEMMs sustain
/// inside a step, on a hardware profile without a `gemm_efficiency` of its
/// own. It holds the README's calibration table's A100 runs; the H100
/// profile fits its own to its runs there (62%, profiles/hardware/
/// h100-sxm-80gb.yaml). Alone, GEMMs reach more: XLA's measured H100
/// table (tests/reference/gemm/h100-sxm-xla.yaml) has 50-81% over training
/// shapes, 75-81% at K = 4,096 (tests/it/gemm_shapes.rs,
/// docs/plan-sweep-check.md).
pub const COMPUTE_EFFICIENCY: f64 = 0.7;
/// Fraction of the memory bandwidth that streaming kernels reach (STREAM-like
/// copies reach 80-90% of HBM peak; PyTorch's own elementwise kernels,
/// `relu` then `square` over 4,096 x 8,192 to 16,384 bf16, 82-86% of an
/// H100 SXM's: Liger-Kernel's benchmark data, tests/reference/memory_bound).
pub const MEMORY_EFFICIENCY: f64 = 0.8;
/// Fraction of the memory bandwidth that normalization kernels reach
/// (`Kind::Norm`): PyTorch's `torch.nn.LayerNorm` over 4,096 rows of 4,096
/// to 16,384 fp32 runs its forward at 52-61% and its backward at 45-50% of
/// an H100 SXM's bandwidth, and its forward at 51-54% of an A100 SXM4
/// 80GB's, by the bytes memfit counts for them (Liger-Kernel's benchmark
/// data, tests/reference/memory_bound/liger-h100-a100.yaml, which
/// tests/it/memory_bound.rs holds memfit's prices to).
pub const NORM_EFFICIENCY: f64 = 0.5;
/// The output tile of one thread block of a 16-bit GEMM, square: CUTLASS's
/// default threadblock shape for tensor-core GEMMs on Ampere and Hopper
/// is 128x128 (cuBLAS picks among 64 to 256 per side by shape).
pub const GEMM_TILE: usize = 128;
/// Fixed cost of one op: a CUDA kernel launch and its tail, about 5 us on
/// recent GPUs and drivers (one memfit op is one or a few kernels).
pub const OP_OVERHEAD_S: f64 = 5e-6;
/// Fraction of the per-direction link bandwidth that NCCL's ring collectives
/// reach as bus bandwidth (nccl-tests on NVLink report about 80%).
pub const COMM_EFFICIENCY: f64 = 0.8;
/// Fraction of the PCIe link's nominal per-direction rate a pinned-memory
/// copy reaches (Gen4/Gen5 x16 bandwidthTest results land near 80-85%:
/// about 26 of 32 GB/s, 53 of 64).
pub const HOST_LINK_EFFICIENCY: f64 = 0.8;
/// Fixed cost of one host<->device copy: a cudaMemcpyAsync's launch and
/// DMA set-up, about 10 us.
pub const HOST_LINK_LATENCY_S: f64 = 10e-6;

/// The most tokens one optimizer step may take (`memfit run` refuses more
/// too): beyond it a step's time and price overflow what a report can carry.
pub const MAX_TOKENS_PER_STEP: u128 = 1 << 50;

/// A planning recipe (recipes/*.yaml).
///
/// Its keys are its own (the model, the hardware, the grid, the batch) and
/// the knobs a plan holds fixed over its grid ([`RECIPE_KNOBS`]), read into
/// [`Knobs`] as `memfit run` reads them, so that their names, types and
/// defaults are the knobs' ([`PlanRecipe::hf_knobs`], [`PlanRecipe::lora`]).
/// A knob that is a grid axis, or that plans fix ([`FIXED_KNOBS`]), is
/// refused with the reason; any other key as unknown. Every error names
/// the file, line and column (a hand-written `Deserialize`, since serde's
/// `flatten` drops both the refusal of unknown keys and the locations).
#[derive(Clone, Debug)]
pub struct PlanRecipe {
    /// A profile name, a profile YAML path, or a Hugging Face config.json path.
    pub model: String,
    /// A hardware profile name or YAML path.
    pub hardware: String,
    pub seq_len: usize,
    /// Sequences per optimizer step, over all GPUs.
    pub global_batch: usize,
    pub grid: Grid,
    /// Fraction of the capacity to keep free.
    pub headroom: f64,
    /// Overrides the hardware's $/GPU-hour.
    pub cost: Option<f64>,
    /// What an hour of this host costs, for sweeps whose trials run on cpu:
    /// their measured throughput is priced at it (the host runs every rank).
    /// Without it, cpu trials are ranked by tokens/s, which is the same order.
    pub host_usd_per_hour: Option<f64>,
    /// Whether fp16, adamw8bit and adafactor may be recommended.
    pub allow_numerics_change: bool,
    /// Where `memfit sweep` runs its trials (`cpu`, `cpu:limit=64MiB`, `meta`).
    /// A limit is the capacity that decides what fits, in place of the
    /// hardware's memory and runtime overhead.
    pub device: Option<crate::backend::DeviceSpec>,
    /// The knobs of [`RECIPE_KNOBS`] the recipe sets, one value for every
    /// point: hf-eager's (dropout, optimizer_impl, set_to_none,
    /// param_groups), `loss: chunked`'s loss_chunks, LoRA's (absent keys
    /// take PEFT's defaults) and offload's host_memory (each node's host
    /// memory, shared by its GPUs' offloaded tensors; default: this
    /// machine's available memory). The other knobs stay unset.
    pub knobs: Knobs,
    /// The network between nodes, a network profile name or path
    /// (`profiles/networks/`), in place of the one the hardware profile's
    /// nodes have.
    pub network: Option<String>,
    /// The fused-attention kernel whose rates (the hardware profile's
    /// `attention_kernels`, published or fitted) price fused attention; absent:
    /// FlashAttention-2, or the profile's `fused_attention_efficiency`
    /// where it gives no rates.
    pub attention_kernel: Option<AttentionKernel>,
}

/// The knobs a plan recipe takes as keys of its own, one value for the
/// whole grid (the knobs `model`, `seq_len` and `device` are
/// [`PlanRecipe`]'s fields: a plan's device is no `meta:GPU`).
pub const RECIPE_KNOBS: &[&str] = &[
    "dropout",
    "optimizer_impl",
    "set_to_none",
    "param_groups",
    "loss_chunks",
    "compile_loss",
    "optimizer_in_backward",
    "liger",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "lora_targets",
    "host_memory",
];

/// The knobs plans hold at `memfit run`'s default, with the reason; a plan
/// recipe that sets one is refused with it.
pub const FIXED_KNOBS: &[(&str, &str)] = &[
    (
        "ranks",
        "plans take the rank count from the grid's `gpus` axis",
    ),
    (
        "grad_accum",
        "plans derive it from global_batch / (micro_batch x data-parallel ranks)",
    ),
    (
        "microbatches",
        "the same knob as grad_accum, which plans derive from global_batch / (micro_batch x data-parallel ranks)",
    ),
    ("steps", "a plan prices one step"),
    ("data", "a plan runs on meta, which reads no tokens"),
    ("seed", "a plan runs on meta, which holds no values"),
    ("threads", "cpu worker threads, and a plan runs on meta"),
    ("lr", "a value, not a byte or a second"),
    ("weight_decay", "a value, not a byte or a second"),
    ("beta2", "a value, not a byte or a second"),
    ("momentum", "SGD's, which plans do not offer"),
    (
        "grad_clip",
        "plans clip at the default norm, as Hugging Face's Trainer does (and not at all with optimizer_in_backward, which torchtune refuses with clipping)",
    ),
    (
        "beta1",
        "plans price Adafactor without its first moment (transformers' default)",
    ),
    (
        "bucket_view",
        "plans price DDP's buckets as their own buffers (PyTorch's default)",
    ),
    (
        "schedule",
        "plans price 1F1B, the default pipeline schedule",
    ),
    ("partition", "plans split the blocks evenly over the stages"),
    (
        "checkpoint_every",
        "plans checkpoint every block or none (grid.checkpointing); price layer SAC with `memfit run --device meta:GPU --checkpoint-every N`",
    ),
];

impl PlanRecipe {
    /// The engine's knobs for point `p`, with the recipe's framework knobs.
    pub fn train_config(&self, p: &Point) -> TrainConfig {
        p.train_config_with(self.seq_len, &self.hf_knobs(), &self.lora())
    }

    /// The recipe's hf-eager and chunked-loss knobs, `memfit run`'s
    /// defaults (`TrainConfig`'s) where absent.
    pub fn hf_knobs(&self) -> crate::engine::framework::HfKnobs {
        self.knobs.hf()
    }

    /// The chunked loss's parts, torchtune's default where absent.
    pub fn loss_chunks(&self) -> usize {
        self.hf_knobs().loss_chunks
    }

    /// The recipe's LoRA knobs, PEFT's defaults where absent.
    pub fn lora(&self) -> LoraConfig {
        self.knobs.lora()
    }

    /// The capacity that decides what fits, and the runtime overhead on top
    /// of the engine's peak: the device limit and 0 when the recipe (or the
    /// sweep's `--device`) sets one, else the GPU's memory and overhead.
    pub fn capacity(&self, hw: &HardwareProfile) -> (u64, u64) {
        match self.device.as_ref().and_then(|d| d.limit) {
            Some(limit) => (limit, 0),
            None => (hw.memory, hw.runtime_overhead),
        }
    }
}

mod recipe_keys;

mod axes;
pub use axes::{Axis, AxisValue, Grid, Point};

/// A grid point's mixture-of-experts capacity factor
/// (`TrainConfig::capacity_factor`) in hundredths, so that a [`Point`]
/// stays `Eq` and `Hash`: `Capacity(Some(125))` is 1.25, `None` dropless
/// routing. Recipes and reports spell it as the factor (`1.25`) or `null`;
/// a factor that is not a positive multiple of 0.01 is refused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Capacity(pub Option<u32>);

impl Capacity {
    /// Dropless routing: no capacity, no token dropped.
    pub const DROPLESS: Capacity = Capacity(None);

    pub fn is_dropless(&self) -> bool {
        self.0.is_none()
    }

    /// The factor the engine takes.
    pub fn factor(self) -> Option<f32> {
        self.0.map(|h| h as f32 / 100.0)
    }

    /// A factor as a capacity: a positive multiple of 0.01.
    pub fn from_factor(f: f64) -> std::result::Result<Capacity, String> {
        let h = (f * 100.0).round();
        // Decimal hundredths (0.07, 1.1) are a rounding error away in binary.
        let whole = (f * 100.0 - h).abs() <= 1e-6 * h.max(1.0);
        match f.is_finite() && f > 0.0 && whole && h >= 1.0 && h <= u32::MAX as f64 {
            true => Ok(Capacity(Some(h as u32))),
            false => Err(format!(
                "capacity_factor {f} is not a positive multiple of 0.01 (null: dropless routing)"
            )),
        }
    }

    /// As a recipe spells it: the factor, or `null`.
    pub fn spelled(self) -> String {
        match self.0 {
            None => "null".into(),
            Some(_) => self.to_string(),
        }
    }
}

/// The factor with at least one decimal (`1.0`, `1.25`), or `dropless`.
impl std::fmt::Display for Capacity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            None => f.write_str("dropless"),
            Some(h) => match h % 100 {
                c if c % 10 == 0 => write!(f, "{}.{}", h / 100, c / 10),
                c => write!(f, "{}.{c:02}", h / 100),
            },
        }
    }
}

/// A recipe's spelling: a factor, or `null` / `~` / `dropless`.
impl std::str::FromStr for Capacity {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "null" | "~" | "dropless" => Ok(Capacity::DROPLESS),
            t => match t.parse::<f64>() {
                Ok(f) => Capacity::from_factor(f),
                Err(_) => Err(format!(
                    "capacity_factor `{t}` is neither a number nor null"
                )),
            },
        }
    }
}

impl Serialize for Capacity {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self.0 {
            None => s.serialize_none(),
            Some(h) => s.serialize_f64(h as f64 / 100.0),
        }
    }
}

impl<'de> Deserialize<'de> for Capacity {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        match Option::<f64>::deserialize(d)? {
            None => Ok(Capacity::DROPLESS),
            Some(f) => Capacity::from_factor(f).map_err(serde::de::Error::custom),
        }
    }
}

impl Point {
    /// The knobs of this point that change numerics against fp32/bf16 AdamW.
    pub fn numerics_changes(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        match self.precision {
            Precision::Fp16 => v.push("fp16"),
            // No master copy: updates below a weight's bf16 resolution
            // are lost.
            Precision::Bf16Pure => v.push("bf16-pure"),
            _ => {}
        }
        // Against AdamW: quantized states, a factored second moment, or
        // another update rule altogether (SGD with momentum).
        // Paging moves the state, not its values: a paged optimizer
        // changes what its unpaged one changes.
        match self.optimizer.unpaged() {
            Optimizer::Adamw8bit => v.push("adamw8bit"),
            Optimizer::Adafactor => v.push("adafactor"),
            Optimizer::Sgd => v.push("sgd"),
            Optimizer::Adamw | Optimizer::PagedAdamw | Optimizer::PagedAdamw8bit => {}
        }
        // A capacity drops the tokens beyond it (dropless trains on all).
        if !self.capacity_factor.is_dropless() {
            v.push("capacity_factor");
        }
        v
    }

    /// The engine's knobs for this point at `seq_len` (an invalid point's
    /// accumulation of 0 becomes 1, so that it can still be checked).
    pub fn train_config(&self, seq_len: usize) -> TrainConfig {
        TrainConfig {
            seq_len,
            micro_batch: self.micro_batch,
            grad_accum: self.grad_accum.max(1),
            optimizer: self.optimizer,
            precision: self.precision,
            checkpointing: self.checkpointing,
            attention: self.attention,
            ranks: self.gpus,
            sharding: self.sharding,
            framework: self.framework,
            finetune: self.finetune,
            offload: self.offload,
            pipeline_stages: self.pipeline_stages,
            virtual_stages: self.virtual_stages,
            shard_group: self.shard_group,
            tensor_parallel: self.tensor_parallel,
            hpz_group: self.hpz_group,
            sequence_parallel: self.sequence_parallel,
            loss: self.loss,
            capacity_factor: self.capacity_factor.factor(),
            offload_activations: self.offload_activations,
            expert_parallel: self.expert_parallel,
            ..TrainConfig::default()
        }
    }

    /// This point with the batch's shape knobs cleared: the points with the
    /// same one build the same engine but for its workspace
    /// ([`TrainConfig::with_batch_shape_of`]).
    pub fn unshaped(&self) -> Point {
        Point {
            micro_batch: 0,
            grad_accum: 0,
            attention: Attention::Eager,
            checkpointing: Checkpointing::None,
            ..*self
        }
    }

    /// [`Point::train_config`] with a recipe's knobs of the user's stack:
    /// PyTorch's (`hf`) on hf-eager points, LoRA's on LoRA and QLoRA points.
    pub fn train_config_with(
        &self,
        seq_len: usize,
        hf: &crate::engine::framework::HfKnobs,
        lora: &LoraConfig,
    ) -> TrainConfig {
        let mut tc = self.train_config(seq_len);
        if hf.optimizer_in_backward {
            // torchtune refuses clipping with it (`validate::step_knobs`).
            tc.optimizer_in_backward = true;
            tc.grad_clip = 0.0;
        }
        if self.framework == Framework::HfEager {
            tc.dropout = hf.dropout;
            tc.optimizer_impl = hf.optimizer_impl;
            tc.set_to_none = hf.set_to_none;
            tc.param_groups = hf.param_groups;
            tc.loss_chunks = hf.loss_chunks;
            // The recipe's one value, on the points it applies to.
            tc.compile_loss = hf.compile_loss && self.loss == Loss::Chunked;
            tc.liger = hf.liger;
        }
        if self.finetune != Finetune::Full {
            tc.lora = lora.clone();
        }
        tc
    }

    pub fn label(&self) -> String {
        let fw = match self.framework {
            Framework::Memfit => "",
            Framework::HfEager => "hf-eager ",
        };
        let ft = match self.finetune {
            Finetune::Full => "",
            Finetune::Lora => "lora ",
            Finetune::Qlora => "qlora ",
        };
        let ft = match self.offload {
            Offload::None => ft.to_string(),
            o => format!("{ft}offload:{} ", o.name()),
        };
        let ft = match self.pipeline_stages {
            1 => ft,
            s => format!("{ft}pp{s} "),
        };
        let ft = match self.virtual_stages {
            1 => ft,
            v => format!("{ft}vpp{v} "),
        };
        let ft = match self.shard_group {
            None => ft,
            Some(g) => format!("{ft}hybrid{g} "),
        };
        let ft = match self.tensor_parallel {
            1 => ft,
            t => format!("{ft}tp{t} "),
        };
        let ft = match self.hpz_group {
            None => ft,
            Some(g) => format!("{ft}hpz{g} "),
        };
        let ft = match self.sequence_parallel {
            false => ft,
            true => format!("{ft}sp "),
        };
        let ft = match self.offload_activations {
            false => ft,
            true => format!("{ft}offload:activations "),
        };
        let ft = match self.tp_comm_overlap {
            false => ft,
            true => format!("{ft}tp-overlap "),
        };
        let ft = match self.overlap_param_gather {
            false => ft,
            true => format!("{ft}param-gather-overlap "),
        };
        let ft = match self.loss {
            Loss::Full => ft,
            l => format!("{ft}loss:{} ", name(l)),
        };
        let ft = match self.capacity_factor.is_dropless() {
            true => ft,
            false => format!("{ft}cf{} ", self.capacity_factor),
        };
        let ft = match self.expert_parallel {
            1 => ft,
            e => format!("{ft}ep{e} "),
        };
        format!(
            "{fw}{ft}mb{} x{} {} {} {} ckpt:{} {} {}",
            self.micro_batch,
            self.gpus,
            name(self.sharding),
            name(self.precision),
            name(self.optimizer),
            name(self.checkpointing),
            name(self.attention),
            format_args!("accum {}", self.grad_accum),
        )
    }
}

pub use crate::config::knobs::name;

/// Whether a point can run at all.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Verdict {
    Fits,
    DoesNotFit,
    Invalid { reason: String },
}

/// The closed-form bytes per parameter of the model states (weights,
/// gradients, optimizer state with master weights), as the ZeRO paper and
/// Megatron write them.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClosedForm {
    pub formula: String,
    pub bytes_per_param: f64,
}

/// What the planner predicts for one point.
#[derive(Clone, Debug, Serialize)]
pub struct Prediction {
    pub point: Point,
    #[serde(flatten)]
    pub verdict: Verdict,
    /// Per rank, from the engine (absent for invalid points): `total` is the
    /// highest sum live at once, each category its own highest.
    pub peak_bytes: Option<PeakBytes>,
    /// The split at the moment of that total peak: what was live, by
    /// category, when the total was highest (it adds up to `total`).
    pub peak_split: Option<PeakBytes>,
    pub runtime_overhead_bytes: u64,
    /// hf-eager on a GPU: PyTorch's caching allocator for the same tensors
    /// (`crate::caching`): its `max_memory_allocated` (blocks rounded to
    /// 512 B) and `max_memory_reserved` (segments).
    pub allocator: Option<AllocatorPeaks>,
    /// Engine peak plus runtime overhead (hf-eager on a GPU: the reserved
    /// peak plus runtime overhead, what the process holds).
    pub total_bytes: u64,
    /// Set when `total_bytes` holds the reserved peak of this micro-batch
    /// value, smaller than the point's own and otherwise the same point,
    /// because the caching allocator fragmented more there
    /// (`monotone_in_micro_batch`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved_from_micro_batch: Option<usize>,
    /// Capacity x (1 - headroom).
    pub usable_bytes: u64,
    /// usable - total; negative when it does not fit.
    pub margin_bytes: i64,
    pub compute_s: f64,
    /// `compute_s` by what prices it: GEMMs, fused attention, norms, other
    /// kernels and launches (absent where no engine ran). For a pipeline,
    /// the split of the stage whose micro-batches set the slot, scaled to
    /// `compute_s`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel_s: Option<crate::engine::device::KindSeconds>,
    /// Communication the step waits for: what compute does not hide.
    pub comm_s: f64,
    /// Communication that runs beside compute (DDP's and FSDP's gradient
    /// reductions behind the backward, ZeRO-3's prefetched gathers), not
    /// counted in `step_s`.
    #[serde(default)]
    pub comm_hidden_s: f64,
    /// Offload: seconds per step on the host link (gradients down, weights
    /// up) and in the CPU's optimizer update, not overlapped with compute.
    pub offload_s: f64,
    pub step_s: f64,
    pub tokens_per_s: f64,
    pub usd_per_mtok: f64,
    /// Offload points: host memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<HostPrediction>,
    /// Paged optimizers: the state in unified memory, outside `total_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paged: Option<PagedPrediction>,
    /// Dropless expert parallelism: what `total_bytes` would be if every
    /// token of the rank's expert-parallel group chose its experts first
    /// (`total_bytes` plans an even spread; routing decides between them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worst_routing_bytes: Option<u64>,
    /// ZeRO-2 and ZeRO-3 points: what DeepSpeed's own estimator
    /// (`estimate_zero2/3_model_states_mem_needs`) says the model states
    /// take, beside the engine's peak, since an exported `ds_config.json`
    /// is run by DeepSpeed (`plan::deepspeed`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deepspeed: Option<deepspeed::Estimate>,
    /// Which links the point's collectives cross (GPU plans): the
    /// intra-node link, the network between nodes, or both.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub links: Option<crate::comm::topology::Links>,
    /// The engine's (parameters + gradients + optimizer) peaks per parameter.
    pub engine_bytes_per_param: f64,
    pub closed_form: ClosedForm,
    pub numerics_changes: Vec<&'static str>,
    /// Excluded from the recommendation by `allow_numerics_change: false`.
    pub excluded: bool,
}

/// An offload point's host side: per rank, per node (DeepSpeed's "per
/// CPU"), what the node has, and DeepSpeed's own estimate beside it.
#[derive(Clone, Debug, Serialize)]
pub struct HostPrediction {
    /// One rank's host peaks (the engine's host tracker).
    pub peak_bytes: PeakBytes,
    /// GPUs (ranks) on one node.
    pub ranks_per_node: usize,
    /// `peak_bytes.total` x `ranks_per_node`.
    pub node_bytes: u64,
    /// The node's host memory (the recipe's `host_memory`, the hardware
    /// profile's, or this machine's available memory).
    pub capacity_bytes: u64,
    pub margin_bytes: i64,
    /// Bytes one rank moves between device and host per step.
    pub link_bytes_per_step: u64,
    /// DeepSpeed's estimator for the same stage and offload (ZeRO-2 or
    /// ZeRO-3; `None` for ZeRO-1, which it has none for), zero_init on.
    pub deepspeed: Option<deepspeed::Estimate>,
}

/// Where a paged optimizer's state lives, as reports say it.
pub const PAGED_MEMORY: &str = "paged optimizer state, unified memory, outside PyTorch's counters";

/// A paged optimizer's state on the target (`paged-adamw`,
/// `paged-adamw8bit`): bitsandbytes allocates it with `cudaMallocManaged`,
/// so neither the engine's device peak nor PyTorch's allocated and
/// reserved counters (`total_bytes`) hold it. It fits the GPU in what the
/// device peak and the runtime overhead leave under the usable limit
/// (`margin_bytes`); the driver evicts the rest to host memory
/// (oversubscription) and migrates it back when the update touches it.
///
/// The time: bitsandbytes prefetches each paged state to the device before
/// its update (`Optimizer8bit.step` -> `prefetch_state` ->
/// `cudaMemPrefetchAsync`; bitsandbytes @ 95f9af3:
/// bitsandbytes/optim/optimizer.py, csrc/pythonInterface.cpp `cprefetch`),
/// and the forward and backward's allocations push it out again, so every
/// step the overflow crosses the host link up and back down, not
/// overlapped, at the rate offload's copies run at (prefetched migration
/// streams at about a pinned copy's bandwidth: NVIDIA, "Maximizing Unified
/// Memory Performance in CUDA", 2017). It is a lower bound: a driver that
/// evicts the least recently used pages under this cyclic order can move
/// the whole paged state each way.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PagedPrediction {
    /// Where these bytes live, in words ([`PAGED_MEMORY`]).
    pub memory: String,
    /// One rank's paged optimizer state.
    pub bytes: u64,
    /// What of it stays in device memory.
    pub resident_bytes: u64,
    /// What pages out to host memory (one rank's).
    pub host_bytes: u64,
    /// GPUs (ranks) on one node, whose overflows share its host memory.
    pub ranks_per_node: usize,
    /// The node's host memory, less what offload holds there.
    pub host_capacity_bytes: u64,
    /// host capacity - `host_bytes` x `ranks_per_node`.
    pub host_margin_bytes: i64,
    /// The overflow up and down: 2 x `host_bytes` per step.
    pub link_bytes_per_step: u64,
    /// The host link's rate it moves at (bytes/s).
    pub link_bytes_per_s: f64,
    pub seconds_per_step: f64,
}

impl PagedPrediction {
    /// Places the state in the `room` a point's device peak leaves (its
    /// margin), and prices the overflow's round trip.
    fn place(&mut self, room: i64) {
        self.resident_bytes = self.bytes.min(room.max(0) as u64);
        self.host_bytes = self.bytes - self.resident_bytes;
        let node = self.host_bytes.saturating_mul(self.ranks_per_node as u64);
        self.host_margin_bytes = self.host_capacity_bytes as i64 - node as i64;
        self.link_bytes_per_step = 2 * self.host_bytes;
        self.seconds_per_step = self.link_bytes_per_step as f64 / self.link_bytes_per_s;
    }
}

/// Settles a paged point after its margin changed: the state's place, the
/// step's time and price, and the verdict.
fn settle_paged(p: &mut Prediction) {
    let Some(g) = &mut p.paged else {
        return;
    };
    g.place(p.margin_bytes);
    let tokens = p.tokens_per_s * p.step_s;
    let was = p.tokens_per_s;
    p.step_s = p.compute_s + p.comm_s + p.offload_s + g.seconds_per_step;
    p.tokens_per_s = tokens / p.step_s;
    p.usd_per_mtok *= was / p.tokens_per_s;
}

/// PyTorch's caching allocator's high-water marks, as `torch.cuda` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocatorPeaks {
    pub max_memory_allocated: u64,
    pub max_memory_reserved: u64,
}

/// The whole plan.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub schema_version: u32,
    pub recipe: PathBuf,
    pub model: String,
    pub num_parameters: u64,
    /// A mixture of experts: the parameters a token passes through.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub active_parameters: Option<u64>,
    pub hardware: HardwareProfile,
    pub usd_per_gpu_hour: f64,
    /// Per GPU: the hardware's memory, or the recipe's device limit.
    pub capacity_bytes: u64,
    pub seq_len: usize,
    pub global_batch: usize,
    pub headroom: f64,
    pub allow_numerics_change: bool,
    pub efficiency: BTreeMap<&'static str, f64>,
    pub points: Vec<Prediction>,
    /// Indices into `points` of the fitting, allowed points, cheapest first.
    pub ranking: Vec<usize>,
    pub recommendation: Option<Recommendation>,
    /// Milliseconds the planning took.
    pub elapsed_ms: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Recommendation {
    pub index: usize,
    pub reasons: Vec<String>,
}

/// Loads, validates and plans a recipe file, on its hardware profile's
/// figures alone.
pub fn plan_file(path: &Path) -> Result<Plan> {
    plan_file_with(path, false, |_| {})
}

/// [`plan_file`] on the recipe's hardware profile as `adjust` changes it:
/// e.g. [`HardwareProfile::at_tensor_rate`] for GPUs held to a lower clock
/// than their profile's datasheet rates.
pub fn plan_file_on(path: &Path, adjust: impl FnOnce(&mut HardwareProfile)) -> Result<Plan> {
    plan_file_with(path, false, adjust)
}

/// [`plan_file`], pricing steps with the GPU calibration stored for the
/// recipe's hardware profile when there is one (`memfit calibrate --device
/// cuda`; [`crate::calibrate::gpu::bound_to`]): what `memfit plan` runs.
pub fn plan_file_measured(path: &Path) -> Result<Plan> {
    plan_file_with(path, true, |_| {})
}

fn plan_file_with(
    path: &Path,
    measured: bool,
    adjust: impl FnOnce(&mut HardwareProfile),
) -> Result<Plan> {
    let (mut recipe, model, mut hw) = load_recipe(path)?;
    adjust(&mut hw);
    if measured {
        crate::calibrate::gpu::attach_bound(&mut hw);
    }
    // transformers runs every expert on every rank: a grid that splits
    // them plans memfit's engine throughout, so its points compare on one.
    let default = match recipe.grid.expert_parallel.iter().any(|&e| e > 1) {
        true => Framework::Memfit,
        false => Framework::plan_default(&model),
    };
    recipe.grid.frameworks_or(default);
    let mut plan = plan(&recipe, &model, &hw);
    plan.recipe = path.to_path_buf();
    Ok(plan)
}

/// Loads and validates a recipe file, with its model and hardware.
///
/// A value listed twice in a grid list is planned once (a warning on stderr
/// says so, once per file); a grid of more than [`MAX_GRID_POINTS`] is an error.
pub fn load_recipe(path: &Path) -> Result<(PlanRecipe, ModelConfig, HardwareProfile)> {
    let text = crate::config::input::read_text(path)?;
    let location = path.display().to_string();
    let mut recipe: PlanRecipe = parse_yaml(&text, &location)?;
    // Paths in a recipe are relative to the recipe, as run recipes' are.
    let base = path.parent().unwrap_or(Path::new("."));
    for spec in [&mut recipe.model, &mut recipe.hardware]
        .into_iter()
        .chain(recipe.network.as_mut())
    {
        if looks_like_path(spec) && Path::new(spec.as_str()).is_relative() {
            *spec = base.join(&*spec).display().to_string();
        }
    }
    let at = |key: &str, value: Option<&str>| value_location(&text, &location, key, value);
    let repeats = recipe.grid.dedup();
    if !repeats.is_empty() {
        warn_once(&location, || {
            repeats
                .iter()
                .map(|(key, value, n)| {
                    let others = match n - 1 {
                        0 => String::new(),
                        1 => " (and one other value)".into(),
                        k => format!(" (and {k} other values)"),
                    };
                    format!(
                        "memfit: warning: {}: `grid.{key}` lists {value}{others} more than once; each point is planned once",
                        at(key, Some(value))
                    )
                })
                .collect()
        });
    }
    let points = recipe.grid.size();
    if points.is_none_or(|n| n > MAX_GRID_POINTS) {
        // The lists that multiply, each axis's own.
        let factors: Vec<String> = (Axis::ALL.iter())
            .map(|&a| (a, a.len(&recipe.grid)))
            // No framework named is one: the command's.
            .filter(|&(a, n)| n != 1 && !(a == Axis::Framework && n == 0))
            .map(|(a, n)| format!("{n} {}", a.key()))
            .collect();
        return Err(Error::Config {
            location: at("grid", None),
            message: format!(
                "`grid` expands to {} points ({}), more than {MAX_GRID_POINTS}, the most memfit plans at once; split it over several recipes",
                points.map_or_else(|| "more than 2^64".to_string(), |n| n.to_string()),
                factors.join(" x "),
            ),
        });
    }
    let model = load_model(&recipe.model).map_err(|e| relocate(e, at("model", None)))?;
    let mut hw = load_hardware(&recipe.hardware).map_err(|e| relocate(e, at("hardware", None)))?;
    if let Some(spec) = &recipe.network {
        let net = crate::config::hardware::load_network(spec)
            .map_err(|e| relocate(e, at("network", None)))?;
        hw.use_network(&net);
    }
    if let Some(k) = recipe.attention_kernel {
        use_attention_kernel(&recipe.grid, k, &mut hw).map_err(|message| Error::Config {
            location: at("attention_kernel", Some(k.name())),
            message,
        })?;
    }
    check_recipe(&recipe, &model, &at)?;
    Ok((recipe, model, hw))
}

/// Prices `grid`'s fused attention on `hw` at kernel `k`'s published
/// rates; refused where the profile has none for it, or where no point of
/// the grid runs fused attention (the key would change nothing).
pub fn use_attention_kernel(
    grid: &Grid,
    k: AttentionKernel,
    hw: &mut HardwareProfile,
) -> std::result::Result<(), String> {
    if !grid.attention.iter().any(|a| a.fused()) {
        return Err(format!(
            "`attention_kernel: {k}` prices fused attention, and the grid's `attention` lists only eager: add fused (or flash-attention-2) to `grid.attention`, or drop the key"
        ));
    }
    hw.use_attention_kernel(k)
}

/// Prefixes an unknown-model or unknown-hardware error, or a file that
/// cannot be read, with the recipe line; an error inside the profile already
/// names its own file.
fn relocate(e: Error, at: String) -> Error {
    match e {
        Error::Config { .. } => e,
        other => Error::Config {
            location: at,
            message: other.to_string(),
        },
    }
}

/// The most points a recipe's grid may expand to. Planning costs a
/// millisecond or more per point, so this is minutes of work; a grid of
/// millions is a mistake, not a plan.
pub const MAX_GRID_POINTS: usize = 100_000;

/// Prints `lines` on stderr unless they were printed for `location` before
/// (the TUI and the sweep load one recipe several times).
fn warn_once(location: &str, lines: impl FnOnce() -> Vec<String>) {
    static WARNED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut warned = WARNED.lock().unwrap_or_else(|e| e.into_inner());
    if !warned.iter().any(|l| l == location) {
        warned.push(location.to_string());
        for line in lines() {
            eprintln!("{line}");
        }
    }
}

/// The checks [`load_recipe`] makes on a recipe built in memory (the TUI's
/// grid builder): the message alone, without a file location.
pub fn check(r: &PlanRecipe, model: &ModelConfig) -> std::result::Result<(), String> {
    check_recipe(r, model, &|key, _| format!("grid.{key}")).map_err(|e| match e {
        Error::Config { message, .. } => message,
        other => other.to_string(),
    })
}

/// Semantic checks the YAML types cannot express, located at the offending key.
/// What a recipe knob of [`RECIPE_KNOBS`] needs of the grid to apply to
/// any point, when `grid` lacks it: set, it would change nothing.
/// An empty `framework` list is the command's default, which may be
/// hf-eager.
pub fn unused_by(grid: &Grid, knob: &str) -> Option<&'static str> {
    let lora = grid.finetune.iter().any(|&f| f != Finetune::Full);
    let hf = grid.framework.is_empty() || grid.framework.contains(&Framework::HfEager);
    let (used, needs) = match knob {
        "lora_rank" | "lora_alpha" | "lora_dropout" | "lora_targets" => {
            (lora, "a `grid.finetune` of lora or qlora")
        }
        "loss_chunks" | "compile_loss" => (
            grid.loss.contains(&Loss::Chunked),
            "a `grid.loss` of chunked",
        ),
        "host_memory" => (
            grid.offload.iter().any(|o| o.optimizer()) || grid.offload_activations.contains(&true),
            "a `grid.offload` other than none or a `grid.offload_activations` of true",
        ),
        "dropout" | "optimizer_impl" | "set_to_none" | "param_groups" | "liger" => {
            (hf, "a `grid.framework` of hf-eager")
        }
        _ => (true, ""),
    };
    (!used).then_some(needs)
}

fn check_recipe(
    r: &PlanRecipe,
    model: &ModelConfig,
    at: &dyn Fn(&str, Option<&str>) -> String,
) -> Result<()> {
    let err = |key: &str, value: Option<&str>, message: String| Error::Config {
        location: at(key, value),
        message,
    };
    // As `memfit run` refuses a knob its other knobs leave without effect.
    for &name in RECIPE_KNOBS {
        if let Some(needs) = unused_by(&r.grid, name).filter(|_| r.knobs.has(name)) {
            return Err(err(
                name,
                None,
                format!(
                    "`{name}` applies to no point of the grid: it needs {needs}; add one, or leave `{name}` out"
                ),
            ));
        }
    }
    if r.knobs.liger == Some(true) {
        // What Liger's kernels are modelled for depends on the model alone
        // on an hf-eager point (tensor parallelism is refused per point).
        let hf = TrainConfig {
            framework: Framework::HfEager,
            liger: true,
            ..TrainConfig::default()
        };
        if let Some(why) = crate::engine::framework::liger_unsupported(model, &hf) {
            let why = why.replace("leave --liger out", "leave `liger` out");
            return Err(err("liger", None, why));
        }
    }
    if r.seq_len == 0 || r.seq_len > model.max_seq_len {
        return Err(err(
            "seq_len",
            None,
            format!(
                "`seq_len` {} is outside 1..={}, the maximum sequence length of {}",
                r.seq_len, model.max_seq_len, model.name
            ),
        ));
    }
    if r.global_batch == 0 {
        return Err(err(
            "global_batch",
            None,
            "`global_batch` must be at least 1".into(),
        ));
    }
    // `memfit run`'s bound on the tokens of one optimizer step: past it, a
    // step's time and price are not numbers a report can carry.
    if r.global_batch as u128 * r.seq_len as u128 > MAX_TOKENS_PER_STEP {
        return Err(err(
            "global_batch",
            None,
            format!(
                "`global_batch` {} x `seq_len` {} is more than 2^50 tokens per optimizer step, \
                 which no training run takes; use a smaller global batch",
                r.global_batch, r.seq_len
            ),
        ));
    }
    if !(0.0..1.0).contains(&r.headroom) {
        return Err(err(
            "headroom",
            None,
            format!("`headroom` {} is outside [0, 1)", r.headroom),
        ));
    }
    if let Some(c) = r.cost
        && !(c.is_finite() && c > 0.0)
    {
        return Err(err(
            "cost",
            None,
            format!("`cost` {c} must be a positive $/GPU-hour"),
        ));
    }
    let dropout = r.hf_knobs().dropout;
    if !(0.0..1.0).contains(&dropout) {
        return Err(err(
            "dropout",
            None,
            format!("`dropout` {dropout} is outside [0, 1)"),
        ));
    }
    if r.grid.finetune.iter().any(|&f| f != Finetune::Full) {
        crate::engine::lora::check(model, &r.lora()).map_err(|(knob, m)| {
            let key = format!("lora_{knob}");
            err(&key, None, format!("`{key}`: {m}"))
        })?;
    }
    let g = &r.grid;
    for (key, empty) in [
        ("micro_batch", g.micro_batch.is_empty()),
        ("precision", g.precision.is_empty()),
        ("checkpointing", g.checkpointing.is_empty()),
        ("attention", g.attention.is_empty()),
        ("optimizer", g.optimizer.is_empty()),
        ("sharding", g.sharding.is_empty()),
        ("gpus", g.gpus.is_empty()),
    ] {
        if empty {
            return Err(err(key, None, format!("`grid.{key}` is an empty list")));
        }
    }
    for (key, values) in [("micro_batch", &g.micro_batch), ("gpus", &g.gpus)] {
        if let Some(&v) = values.iter().find(|&&v| v == 0 || v > 1 << 20) {
            return Err(err(
                key,
                Some(&v.to_string()),
                format!("`grid.{key}` value {v} is outside 1..=2^20"),
            ));
        }
    }
    if let Some(&v) = g.gpus.iter().find(|&&v| v > MAX_GPUS) {
        return Err(err(
            "gpus",
            Some(&v.to_string()),
            format!(
                "`grid.gpus` value {v} is more than {MAX_GPUS}, the most a plan prices (Llama 3 405B's pre-training ran on 16,384 GPUs); split a bigger job into the layout of one of its replicas"
            ),
        ));
    }
    let most = *g.gpus.iter().max().expect("non-empty");
    for &s in &g.sharding {
        // One GPU shards nothing, unless it offloads (DeepSpeed's
        // single-GPU ZeRO-Offload).
        if s.shards_optimizer() && most < 2 && !g.offload.iter().any(|o| o.optimizer()) {
            return Err(err(
                "sharding",
                Some(&name(s)),
                format!(
                    "{} shards state over GPUs, but `grid.gpus` never exceeds 1; add a gpus value of 2 or more, or offload (`grid.offload`)",
                    name(s)
                ),
            ));
        }
    }
    Ok(())
}

/// The most GPUs a plan prices. A plan steps one engine per distinct
/// place in the layout (a pipeline stage's first tensor-parallel rank) and
/// prices the data-parallel replicas and collectives arithmetically, so its
/// cost does not grow with the data-parallel degree; 16,384 is the largest
/// published dense run (Llama 3 405B, The Llama 3 Herd of Models, §3.3).
pub const MAX_GPUS: usize = 16_384;

/// Every grid point in a stable order ([`Grid::points`]: the recipe's list
/// orders, micro-batch innermost). A value listed twice gives one point
/// (its first place), so that no two points share a trial id.
pub fn expand(r: &PlanRecipe) -> Vec<Point> {
    let mut g = r.grid.clone();
    g.dedup();
    let mut out = g.points();
    for p in &mut out {
        p.grad_accum = grad_accum(p, r.global_batch);
    }
    out
}

/// The accumulation steps point `p` takes for `global_batch` sequences per
/// optimizer step; 0 when that is not a whole number.
pub fn grad_accum(p: &Point, global_batch: usize) -> usize {
    // Each data-parallel replica (of every stage and tensor-parallel
    // group) takes a micro-batch.
    let replicas = (p.gpus / (p.pipeline_stages.max(1) * p.tensor_parallel.max(1))).max(1);
    let per_step = p.micro_batch * replicas;
    match global_batch.is_multiple_of(per_step) {
        true => global_batch / per_step,
        false => 0,
    }
}

/// Why a point cannot run, if it cannot.
fn invalid_reason(r: &PlanRecipe, model: &ModelConfig, p: &Point) -> Option<String> {
    if p.pipeline_stages == 0 || !p.gpus.is_multiple_of(p.pipeline_stages) {
        return Some(format!(
            "{} GPUs cannot be split into {} pipeline stages",
            p.gpus, p.pipeline_stages
        ));
    }
    // An engine refusal's message, without the flag a command line names.
    let why = |e: Error| match e {
        Error::InvalidArg { message, .. } => message,
        other => other.to_string(),
    };
    let tc = r.train_config(p);
    if let Err(e) = crate::engine::validate::tensor_parallel(&tc, model) {
        return Some(why(e));
    }
    if p.grad_accum > 0
        && let Err(e) = crate::engine::validate::pipeline(&tc, model)
    {
        return Some(why(e));
    }
    if let Err(e) = crate::engine::validate::architecture(&tc, model) {
        return Some(why(e));
    }
    if p.grad_accum == 0 {
        return Some(format!(
            "global_batch {} is not a whole multiple of micro_batch {} x {} GPUs",
            r.global_batch, p.micro_batch, p.gpus
        ));
    }
    if let Some((_, reason)) = crate::engine::lora::check_parallel(&tc) {
        return Some(reason);
    }
    if let Err(e) = crate::engine::validate::stack(&tc, model) {
        return Some(why(e));
    }
    if let Err(e) = crate::engine::validate::step_knobs(&tc) {
        return Some(why(e));
    }
    if p.tp_comm_overlap && !(p.tensor_parallel > 1 && p.sequence_parallel) {
        return Some(
            "tp_comm_overlap needs tensor_parallel above 1 with sequence_parallel (Megatron-LM's --tp-comm-overlap requires --sequence-parallel)".into(),
        );
    }
    if p.overlap_param_gather && p.framework == Framework::HfEager {
        return Some(
            "overlap_param_gather is Megatron-LM's; hf-eager's zero1 and zero2 stand for DeepSpeed's, which waits for the gathers of updated weights".into(),
        );
    }
    if p.overlap_param_gather
        && !(matches!(p.sharding, Sharding::Zero1 | Sharding::Zero2) && tc.data_ranks() > 1)
    {
        return Some(
            "overlap_param_gather overlaps the gathers of the weights zero1 and zero2 update on each data-parallel rank's shard (Megatron-LM's --overlap-param-gather, with its distributed optimizer); this point makes none".into(),
        );
    }
    if let Some(reason) = p.offload.check(p.sharding) {
        return Some(reason.into());
    }
    if p.sharding == Sharding::None && tc.data_ranks() > 1 {
        return Some(format!(
            "{} GPUs need a data-parallel scheme (ddp or zero1-3), not none",
            p.gpus
        ));
    }
    crate::engine::validate::sharding(&tc, MAX_GPUS)
        .err()
        .map(why)
}

/// A point's model-state bytes per trained parameter: weights `w`, and
/// `k` for the master weights and optimizer state (gradients are `w` too),
/// with the words the formulas name them by.
fn state_bytes(p: &Point) -> (f64, f64, String) {
    let sixteen = p.precision.is_16bit();
    let w = if sixteen { 2.0 } else { 4.0 };
    let master = if p.precision.has_master() { 4.0 } else { 0.0 };
    // Pure bf16: AdamW's moments and SGD's momentum in the weights' dtype
    // (torch.optim's `zeros_like(param)`); 8-bit AdamW's and Adafactor's
    // state are what they are in any precision (`optim::state_dtype`).
    let unit = if p.precision.is_pure() { 2.0 } else { 4.0 };
    let (state, state_name): (f64, &str) = match p.optimizer {
        Optimizer::Adamw => (2.0 * unit, "AdamW"),
        // bitsandbytes' 32-bit state is fp32 in any precision, wherever it lives.
        Optimizer::PagedAdamw => (8.0, "paged AdamW"),
        // Two 1-byte codes plus two fp32 absmax per 256-element block.
        Optimizer::Adamw8bit => (2.0 + 8.0 / 256.0, "8-bit AdamW"),
        Optimizer::PagedAdamw8bit => (2.0 + 8.0 / 256.0, "paged 8-bit AdamW"),
        // Factored: (rows + cols) / (rows * cols) per matrix, about 0.
        Optimizer::Adafactor => (0.0, "Adafactor"),
        Optimizer::Sgd => (unit, "SGD+momentum"),
    };
    let words = format!(
        "{state_name} {}",
        match p.precision {
            Precision::Fp32 => "fp32",
            Precision::Bf16Pure => "pure bf16",
            _ => "mixed precision",
        }
    );
    (w, master + state, words)
}

/// The ranks ZeRO shards over (a hybrid group's, or every data-parallel
/// rank), and whether the bytes are per parameter a GPU holds: 1/T of each
/// block under tensor parallelism, a stage's blocks under a pipeline.
fn zero_ranks(p: &Point) -> (usize, &'static str) {
    let split = p.pipeline_stages.max(1) * p.tensor_parallel.max(1);
    let d = match p.shard_group {
        None => (p.gpus / split).max(1),
        Some(g) => g.get(),
    };
    let held = match split {
        1 => "",
        _ => " held (the GPU's share of the split model)",
    };
    (d, held)
}

/// Bytes per parameter as a formula writes them: whole numbers bare.
fn fmt_bpp(x: f64) -> String {
    if x.fract() == 0.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.2}")
    }
}

/// The closed form for a point: `w + g + k` bytes per parameter, divided
/// over the data-parallel GPUs as the ZeRO stage shards them (ZeRO paper, Figure 1:
/// `(2 + 2 + K)Ψ`, `2Ψ + 2Ψ + KΨ/N`, `2Ψ + (2 + K)Ψ/N`, `(2 + 2 + K)Ψ/N`).
pub fn closed_form(p: &Point) -> ClosedForm {
    let (w, k, words) = state_bytes(p);
    let (d, held) = zero_ranks(p);
    let n = d as f64;
    let fmt = fmt_bpp;
    let head = format!("{words}: {}+{}+{} B/param", fmt(w), fmt(w), fmt(k));
    let (value, shard) = match p.sharding {
        Sharding::None | Sharding::Ddp => (w + w + k, String::new()),
        Sharding::Zero1 => (
            w + w + k / n,
            format!("; ZeRO-1 over {}: {} + {}/{}", d, fmt(2.0 * w), fmt(k), d),
        ),
        Sharding::Zero2 => (
            w + (w + k) / n,
            format!("; ZeRO-2 over {}: {} + {}/{}", d, fmt(w), fmt(w + k), d),
        ),
        Sharding::Zero3 => (
            (2.0 * w + k) / n,
            format!("; ZeRO-3 over {d}: {}/{d}", fmt(2.0 * w + k)),
        ),
    };
    ClosedForm {
        formula: format!("{head}{shard} = {} B/param{held}", fmt(value)),
        bytes_per_param: value,
    }
}

/// [`closed_form`] under expert parallelism, per parameter a GPU holds:
/// the dense parameters whole and ZeRO-sharded over its `D` data-parallel
/// GPUs, its `1/P` of the experts sharded over the `D/P` GPUs that hold
/// the same experts (DeepSpeed-MoE's and Megatron-Core's
/// expert-data-parallel group), weighted by how many of each it holds.
pub fn expert_closed_form(p: &Point, model: &ModelConfig) -> ClosedForm {
    let dense_form = closed_form(p);
    let (specs, idx) = model.param_layout();
    let experts: f64 = (idx.blocks.iter().filter_map(|b| b.moe))
        .flat_map(|m| [m.up, m.down])
        .map(|i| specs[i].numel() as f64)
        .sum();
    let total: f64 = specs.iter().map(|s| s.numel() as f64).sum();
    let ep = p.expert_parallel;
    let expert_form = closed_form(&Point {
        gpus: p.gpus / ep,
        ..*p
    });
    let (dense, held) = (total - experts, experts / ep as f64);
    let value =
        (dense * dense_form.bytes_per_param + held * expert_form.bytes_per_param) / (dense + held);
    ClosedForm {
        formula: format!(
            "dense {}; each GPU's 1/{ep} of the experts {}; by the parameters it holds: {} B/param held",
            dense_form.formula,
            expert_form.formula,
            fmt_bpp(value)
        ),
        bytes_per_param: value,
    }
}

/// The closed form for a LoRA or QLoRA point, in bytes per base parameter:
/// the frozen base holds its weights alone (16-bit, or fp32 under fp32; for
/// QLoRA the block projections and a mixture's stacked experts in NF4
/// (`BlockIndex::nf4`), as `nf4::storage_bytes` counts them),
/// and only the adapters, a fraction `a` of the base's size, carry full
/// training's `w + g + k`, sharded as the ZeRO stage shards them (ZeRO-3
/// partitions the frozen base too). [`closed_form`]'s `2+2+12` would price
/// every frozen weight as if it trained.
pub fn lora_closed_form(p: &Point, model: &ModelConfig, lora: &LoraConfig) -> ClosedForm {
    let (w, k, words) = state_bytes(p);
    let (d, held) = zero_ranks(p);
    let n = d as f64;
    let fmt = fmt_bpp;
    let (mut specs, idx) = model.param_layout();
    let base = specs.len();
    crate::engine::lora::layout(model, lora, &mut specs);
    let numel = |i: usize| specs[i].numel() as f64;
    let psi: f64 = (0..base).map(numel).sum();
    let a = (base..specs.len()).map(numel).sum::<f64>() / psi;
    let (wb, what) = match p.finetune {
        Finetune::Qlora => {
            let nf4: Vec<usize> = (idx.blocks.iter()).flat_map(|b| b.nf4()).collect();
            let quantised: f64 = nf4.iter().map(|&i| numel(i)).sum();
            let nf4_bytes: f64 = (nf4.iter())
                .map(|&i| crate::nf4::storage_bytes(specs[i].numel()) as f64)
                .sum();
            let what = match model.moe.is_some() {
                true => "QLoRA (block projections and experts in NF4)",
                false => "QLoRA (block projections in NF4)",
            };
            ((nf4_bytes + w * (psi - quantised)) / psi, what)
        }
        _ => (w, "LoRA"),
    };
    let fa = format!("{a:.4}");
    let (value, sum) = match p.sharding {
        Sharding::None | Sharding::Ddp => (
            wb + a * (2.0 * w + k),
            format!("{} + {fa} x {}", fmt(wb), fmt(2.0 * w + k)),
        ),
        Sharding::Zero1 => (
            wb + a * (2.0 * w + k / n),
            format!(
                "ZeRO-1 over {d}: {} + {fa} x ({} + {}/{d})",
                fmt(wb),
                fmt(2.0 * w),
                fmt(k)
            ),
        ),
        Sharding::Zero2 => (
            wb + a * (w + (w + k) / n),
            format!(
                "ZeRO-2 over {d}: {} + {fa} x ({} + {}/{d})",
                fmt(wb),
                fmt(w),
                fmt(w + k)
            ),
        ),
        Sharding::Zero3 => (
            (wb + a * (2.0 * w + k)) / n,
            format!(
                "ZeRO-3 over {d}: ({} + {fa} x {})/{d}",
                fmt(wb),
                fmt(2.0 * w + k)
            ),
        ),
    };
    ClosedForm {
        formula: format!(
            "{what}, {words}: frozen base {} B/param + adapters ({:.2}% as many parameters) {}+{}+{} B each; {sum} = {} B/param{held}",
            fmt(wb),
            a * 100.0,
            fmt(w),
            fmt(w),
            fmt(k),
            fmt(value)
        ),
        bytes_per_param: value,
    }
}

/// Plans every point of a validated recipe.
pub fn plan(r: &PlanRecipe, model: &ModelConfig, hw: &HardwareProfile) -> Plan {
    plan_with(r, model, hw, &|_| None)
}

/// [`plan`], taking a point's prediction from `known` where it has one
/// (the TUI's grid builder keeps the points it planned for the same recipe,
/// model and hardware: a point's prediction does not depend on the rest of
/// the grid).
pub fn plan_with(
    r: &PlanRecipe,
    model: &ModelConfig,
    hw: &HardwareProfile,
    known: &(dyn Fn(&Point) -> Option<Prediction> + Sync),
) -> Plan {
    let start = std::time::Instant::now();
    let usd = r.cost.unwrap_or(hw.usd_per_hour);
    let points = expand(r);
    let (capacity, overhead) = r.capacity(hw);
    let rates = Rates::gpu(hw, usd);
    let target = PlanTarget {
        recipe: r,
        model,
        rates: &rates,
        capacity,
        overhead,
    };
    // Points that differ only in the batch's shape build the same engine
    // but for its workspace: each such group builds it once and copies it
    // ([`Engine::reshaped`]), a sixth of a 70B point. The work goes group
    // by group, so that a group's engine is dropped soon after it is built.
    let mut group_of = std::collections::HashMap::new();
    let groups: Vec<usize> = (points.iter())
        .map(|p| {
            let n = group_of.len();
            *group_of.entry(p.unshaped()).or_insert(n)
        })
        .collect();
    let shared: Vec<std::sync::Mutex<Shared>> = (0..group_of.len())
        .map(|_| std::sync::Mutex::default())
        .collect();
    for &g in &groups {
        shared[g].lock().expect("not poisoned").left += 1;
    }
    let mut order: Vec<usize> = (0..points.len()).collect();
    order.sort_by_key(|&i| groups[i]);
    let mut planned: Vec<(usize, Prediction)> = order
        .par_iter()
        .map(|&i| {
            let (p, slot) = (&points[i], &shared[groups[i]]);
            let out = known(p).unwrap_or_else(|| predict_shared(&target, p, Some(slot)));
            let mut s = slot.lock().expect("not poisoned");
            s.left -= 1;
            if s.left == 0 {
                s.engine = None;
            }
            (i, out)
        })
        .collect();
    // Back in the grid's order.
    planned.sort_unstable_by_key(|&(i, _)| i);
    let mut predictions: Vec<Prediction> = planned.into_iter().map(|(_, x)| x).collect();
    monotone_in_micro_batch(&mut predictions);
    // A grid that plans the user's own stack beside memfit's engine
    // recommends from that stack: the engine's rows are there to compare,
    // as a layout PyTorch will not run (issue 27).
    let stack = predictions
        .iter()
        .any(|x| x.point.framework != Framework::Memfit);
    let mut ranking: Vec<usize> = (0..predictions.len())
        .filter(|&i| predictions[i].verdict == Verdict::Fits && !predictions[i].excluded)
        .filter(|&i| !stack || predictions[i].point.framework != Framework::Memfit)
        .collect();
    ranking.sort_by(|&a, &b| {
        let (x, y) = (&predictions[a], &predictions[b]);
        x.usd_per_mtok
            .total_cmp(&y.usd_per_mtok)
            .then(x.point.gpus.cmp(&y.point.gpus))
            .then(y.margin_bytes.cmp(&x.margin_bytes))
    });
    let recommendation = ranking.first().map(|&i| Recommendation {
        index: i,
        reasons: reasons(&predictions, &ranking, r),
    });
    Plan {
        schema_version: 1,
        recipe: PathBuf::new(),
        model: model.name.clone(),
        num_parameters: model.num_parameters(),
        active_parameters: model.moe.as_ref().map(|_| model.active_parameters()),
        hardware: hw.clone(),
        usd_per_gpu_hour: usd,
        capacity_bytes: r.capacity(hw).0,
        seq_len: r.seq_len,
        global_batch: r.global_batch,
        headroom: r.headroom,
        allow_numerics_change: r.allow_numerics_change,
        efficiency: BTreeMap::from([
            ("compute", gemm_share(hw)),
            ("memory", MEMORY_EFFICIENCY),
            ("norm", NORM_EFFICIENCY),
            ("communication", COMM_EFFICIENCY),
            ("op_overhead_s", OP_OVERHEAD_S),
        ]),
        points: predictions,
        ranking,
        recommendation,
        elapsed_ms: start.elapsed().as_secs_f64() * 1e3,
    }
}

/// How the planner prices each op on `hw` at `precision`: the efficiency
/// factors above applied to its dense peak and its memory bandwidth; or,
/// when `hw` carries a measured calibration (`memfit calibrate --device
/// cuda`), the measured GEMM curve for `precision`, fused attention's curve
/// (16 bits), bandwidth and per-kernel overhead. Other kernels' arithmetic
/// stays at the profile's derated peak: they are bound by their bytes.
pub fn roofline(hw: &HardwareProfile, precision: Precision) -> Roofline {
    let profile = profile_roofline(hw, precision);
    let Some(m) = &hw.measured else {
        return profile;
    };
    let gemm_curve = Curve::new(&m.gemm_curve(precision));
    Roofline {
        flops_per_s: gemm_curve.map_or(profile.flops_per_s, |c| c.at(f64::INFINITY)),
        bytes_per_s: m.bytes_per_s,
        op_overhead_s: m.op_overhead_s,
        gemm_curve,
        // Measured attention, where it was (16 bits: flash attention
        // runs on the tensor cores), replaces the profile's published rates.
        attention_table: (precision.is_16bit())
            .then(|| AttentionTable::new(&m.attention_rates()))
            .flatten()
            .or(profile.attention_table),
        ..profile
    }
}

/// The share of `hw`'s dense peak large GEMMs sustain inside a step: its
/// profile's own `gemm_efficiency`, else `COMPUTE_EFFICIENCY`.
fn gemm_share(hw: &HardwareProfile) -> f64 {
    hw.gemm_efficiency.unwrap_or(COMPUTE_EFFICIENCY)
}

fn profile_roofline(hw: &HardwareProfile, precision: Precision) -> Roofline {
    let tensor_cores = precision.is_16bit();
    let gemm_flops_per_s = hw.peak_flops(precision) * gemm_share(hw);
    Roofline {
        flops_per_s: gemm_flops_per_s,
        kernel_flops_per_s: gemm_flops_per_s,
        bytes_per_s: hw.memory_bandwidth_gbps * 1e9 * MEMORY_EFFICIENCY,
        norm_share: NORM_EFFICIENCY / MEMORY_EFFICIENCY,
        op_overhead_s: OP_OVERHEAD_S,
        tiles: hw.sm_count.map(|sms| Tiles {
            sms: sms as usize,
            m: GEMM_TILE,
            n: GEMM_TILE,
        }),
        // Flash attention runs on the tensor cores in 16 bits only.
        attention_flops_per_s: hw
            .fused_attention_efficiency
            .filter(|_| tensor_cores)
            .map(|f| hw.peak_flops(precision) * f),
        attention_table: (hw.attention_rates())
            .filter(|_| tensor_cores)
            .and_then(AttentionTable::new),
        gemm_curve: None,
    }
}

/// What a step is priced at: the rooflines per precision, the bandwidth
/// collectives move at, and what an hour costs.
#[derive(Clone, Debug, PartialEq)]
pub struct Rates {
    /// fp32, bf16, fp16.
    pub roofline: [Roofline; 3],
    pub link_bytes_per_s: f64,
    pub usd_per_hour: f64,
    /// `usd_per_hour` is per GPU (a GPU job), or for the whole job (the
    /// host, which runs every rank).
    pub per_gpu: bool,
    /// Where offloaded work runs: the node's CPU (its share per GPU) and
    /// the host link.
    pub host: HostRoofline,
    /// The node's host memory and its GPUs (offload's capacity check).
    pub host_memory: u64,
    pub gpus_per_node: usize,
    /// GPU plans: the nodes, whose links price each collective as NCCL
    /// runs it (`comm::topology`); `None` on the cpu host, whose ranks are
    /// threads copying through shared memory at `link_bytes_per_s`.
    pub nodes: Option<std::sync::Arc<HardwareProfile>>,
}

impl Rates {
    /// A GPU from its profile, derated by the efficiency factors above.
    pub fn gpu(hw: &HardwareProfile, usd_per_gpu_hour: f64) -> Rates {
        Rates {
            roofline: [Precision::Fp32, Precision::Bf16, Precision::Fp16].map(|p| roofline(hw, p)),
            link_bytes_per_s: hw.interconnect_gbps * 1e9 * COMM_EFFICIENCY,
            usd_per_hour: usd_per_gpu_hour,
            per_gpu: true,
            host: HostRoofline {
                // CPU Adam reads and writes about 30 bytes per 12 FLOPs:
                // memory-bound on any CPU, so priced by bytes alone, at
                // this GPU's share of the node's memory bandwidth.
                cpu: Roofline {
                    flops_per_s: f64::INFINITY,
                    kernel_flops_per_s: f64::INFINITY,
                    bytes_per_s: hw.host_memory_bandwidth_gbps * 1e9 * MEMORY_EFFICIENCY
                        / hw.gpus_per_node.max(1) as f64,
                    norm_share: 1.0,
                    op_overhead_s: OP_OVERHEAD_S,
                    tiles: None,
                    attention_flops_per_s: None,
                    attention_table: None,
                    gemm_curve: None,
                },
                link_bytes_per_s: hw.host_link_gbps * 1e9 * HOST_LINK_EFFICIENCY,
                link_latency_s: HOST_LINK_LATENCY_S,
            },
            host_memory: hw
                .host_memory
                .or_else(crate::sys::mem_available)
                .unwrap_or(u64::MAX),
            gpus_per_node: hw.gpus_per_node.max(1) as usize,
            nodes: Some(std::sync::Arc::new(hw.clone())),
        }
    }

    /// This host from its calibration (measured rates, no derating): ranks
    /// are threads, and collectives are copies through shared memory.
    pub fn host(c: &crate::calibrate::Calibration, usd_per_hour: f64) -> Rates {
        Rates {
            roofline: [Precision::Fp32, Precision::Bf16, Precision::Fp16].map(|p| c.roofline(p)),
            link_bytes_per_s: c.bytes_per_s,
            usd_per_hour,
            per_gpu: false,
            // The ranks are threads of this host: offloading copies within
            // its memory, and the update runs on its cores.
            host: HostRoofline {
                cpu: c.roofline(Precision::Fp32),
                link_bytes_per_s: c.bytes_per_s,
                link_latency_s: c.op_overhead_s,
            },
            host_memory: crate::sys::mem_available().unwrap_or(u64::MAX),
            gpus_per_node: usize::MAX,
            nodes: None,
        }
    }

    fn of(&self, precision: Precision) -> Roofline {
        self.roofline[match precision {
            Precision::Fp32 => 0,
            Precision::Bf16 | Precision::Bf16Pure => 1,
            Precision::Fp16 => 2,
        }]
    }

    /// $ per million tokens at `tokens_per_s` for a job on `gpus`.
    pub fn usd_per_mtok(&self, gpus: usize, tokens_per_s: f64) -> f64 {
        let per_hour = if self.per_gpu {
            gpus as f64 * self.usd_per_hour
        } else {
            self.usd_per_hour
        };
        per_hour / 3600.0 / tokens_per_s * 1e6
    }
}

/// One point: the meta engine's step on rank 0, then the roofline and the
/// price. `capacity` and `overhead` are the device's (`PlanRecipe::capacity`).
/// Makes what a point holds never fall as its micro-batch grows, among
/// points that differ only in micro-batch (and so in accumulation).
///
/// The engine's own peaks grow with the micro-batch, but the caching
/// allocator's fragmentation depends on the request sizes, not only their
/// sum: a bigger micro-batch can by chance reserve less. Llama-3.1-70B in
/// fp32 with ZeRO-1 and checkpointing on 8 GPUs reserves 680.9 GB at
/// micro-batch 1 and 680.1 GB at 2 with the same allocated peak. Bisection
/// over micro-batch (the sweep's, and a user's) assumes that a micro-batch
/// that does not fit rules out the bigger ones, so a point holds at least
/// the reserved peak of each smaller micro-batch of the grid, and says
/// which one it took (`reserved_from_micro_batch`); the allocator's own
/// figures stay as modelled.
pub fn monotone_in_micro_batch(preds: &mut [Prediction]) {
    let key = |p: &Point| Point {
        micro_batch: 0,
        grad_accum: 0,
        ..*p
    };
    let mut order: Vec<usize> = (0..preds.len())
        .filter(|&i| preds[i].allocator.is_some())
        .collect();
    order.sort_by_key(|&i| preds[i].point.micro_batch);
    // Each group's highest reserved figure so far, and its micro-batch.
    let mut seen: std::collections::HashMap<Point, (u64, usize)> = Default::default();
    for i in order {
        let p = &mut preds[i];
        let held = p.total_bytes - p.runtime_overhead_bytes;
        match seen.get_mut(&key(&p.point)) {
            None => {
                seen.insert(key(&p.point), (held, p.point.micro_batch));
            }
            Some(s) if held >= s.0 => *s = (held, p.point.micro_batch),
            Some(s) => {
                p.total_bytes = s.0 + p.runtime_overhead_bytes;
                p.margin_bytes = p.usable_bytes as i64 - p.total_bytes as i64;
                p.reserved_from_micro_batch = Some(s.1);
                settle_paged(p);
                p.verdict = fit_verdict(p);
            }
        }
    }
}

/// A prediction as `predict` made it, before `monotone_in_micro_batch`
/// lifted it to a smaller micro-batch's reserved peak (what a cache of
/// predictions keeps: the lift depends on the rest of the grid).
pub fn unlifted(p: &Prediction) -> Prediction {
    let mut out = p.clone();
    if let (Some(_), Some(a)) = (p.reserved_from_micro_batch, p.allocator) {
        out.reserved_from_micro_batch = None;
        out.total_bytes = a.max_memory_reserved + p.runtime_overhead_bytes;
        out.margin_bytes = p.usable_bytes as i64 - out.total_bytes as i64;
        settle_paged(&mut out);
        out.verdict = fit_verdict(&out);
    }
    out
}

/// Fits when the device's margin and the host's (offload, a paged
/// optimizer's overflow) are not negative. A paged state never makes the
/// device's margin negative: what does not fit pages out.
fn fit_verdict(p: &Prediction) -> Verdict {
    if p.margin_bytes >= 0
        && p.host.as_ref().is_none_or(|h| h.margin_bytes >= 0)
        && p.paged.as_ref().is_none_or(|g| g.host_margin_bytes >= 0)
    {
        Verdict::Fits
    } else {
        Verdict::DoesNotFit
    }
}

/// What the points of a plan are predicted against: the recipe (its
/// fixed knobs and headroom), the model, the target's rates, its capacity
/// and the runtime's overhead on top of the engine's peak.
#[derive(Clone, Copy)]
pub struct PlanTarget<'a> {
    pub recipe: &'a PlanRecipe,
    pub model: &'a ModelConfig,
    pub rates: &'a Rates,
    pub capacity: u64,
    pub overhead: u64,
}

/// Point `p`'s prediction on `t`.
pub fn predict(t: &PlanTarget<'_>, p: &Point) -> Prediction {
    predict_shared(t, p, None)
}

/// The engine that the points of one group (`Point::unshaped`) share, and
/// how many of them are still to plan.
#[derive(Default)]
struct Shared {
    engine: Option<Engine<MetaBackend>>,
    left: usize,
}

/// [`predict`], copying the engine of `p`'s group from `shared` where one
/// rank stands for the step (building it there first), instead of building
/// its own.
fn predict_shared(
    t: &PlanTarget<'_>,
    p: &Point,
    shared: Option<&std::sync::Mutex<Shared>>,
) -> Prediction {
    let (r, model, rates) = (t.recipe, t.model, t.rates);
    let (capacity, overhead) = (t.capacity, t.overhead);
    let usable = (capacity as f64 * (1.0 - r.headroom)) as u64;
    let mut out = unplanned(r, model, overhead, usable, p);
    if let Some(reason) = invalid_reason(r, model, p) {
        out.verdict = Verdict::Invalid { reason };
        return out;
    }
    let tc = r.train_config(p);
    // A plan for the cpu backend (a cpu sweep's run device) declares its
    // workspace; every other plan is for a GPU and declares the cuda one.
    let meta = match r.device.as_ref().map(|d| d.kind) {
        Some(crate::backend::DeviceKind::Cpu) => MetaBackend::emulating_cpu(),
        _ => MetaBackend::emulating_cuda(),
    }
    .for_planning();
    let topo = rates
        .nodes
        .as_deref()
        .and_then(|hw| crate::comm::topology::Topology::new(hw, None, p.gpus).ok());
    let plan = PointPlan {
        r,
        model,
        rates,
        p,
        tc,
        meta,
        topo,
    };
    let e = match plan.tc.pipeline_stages.max(1) {
        1 => plan.one_rank(&mut out, shared),
        _ => plan.pipeline(&mut out),
    };
    plan.read_engine(&mut out, &e, usable, overhead);
    out.worst_routing_bytes = plan.worst_routing_bytes(overhead);
    out
}

/// `p`'s prediction before any engine ran: what the point alone says.
fn unplanned(
    r: &PlanRecipe,
    model: &ModelConfig,
    overhead: u64,
    usable: u64,
    p: &Point,
) -> Prediction {
    let numerics_changes = p.numerics_changes();
    let excluded = !r.allow_numerics_change && !numerics_changes.is_empty();
    Prediction {
        point: *p,
        verdict: Verdict::Fits,
        peak_bytes: None,
        peak_split: None,
        runtime_overhead_bytes: overhead,
        allocator: None,
        total_bytes: 0,
        reserved_from_micro_batch: None,
        usable_bytes: usable,
        margin_bytes: 0,
        compute_s: 0.0,
        kernel_s: None,
        comm_s: 0.0,
        comm_hidden_s: 0.0,
        offload_s: 0.0,
        paged: None,
        step_s: 0.0,
        tokens_per_s: 0.0,
        usd_per_mtok: 0.0,
        host: None,
        worst_routing_bytes: None,
        deepspeed: None,
        links: None,
        engine_bytes_per_param: 0.0,
        closed_form: match p.finetune {
            Finetune::Full if p.expert_parallel > 1 => expert_closed_form(p, model),
            Finetune::Full => closed_form(p),
            Finetune::Lora | Finetune::Qlora => lora_closed_form(p, model, &r.lora()),
        },
        numerics_changes,
        excluded,
    }
}

/// A valid point being predicted: its engines' configuration, the meta
/// backend they run on, and the cluster that prices their collectives.
struct PointPlan<'a> {
    r: &'a PlanRecipe,
    model: &'a ModelConfig,
    rates: &'a Rates,
    p: &'a Point,
    tc: TrainConfig,
    meta: MetaBackend,
    topo: Option<crate::comm::topology::Topology>,
}

impl PointPlan<'_> {
    /// Without pipeline stages: one rank stands for the step (from
    /// `shared`'s engine where the point's group has one). Its times into
    /// `out`; the engine after its step.
    fn one_rank(
        &self,
        out: &mut Prediction,
        shared: Option<&std::sync::Mutex<Shared>>,
    ) -> Engine<MetaBackend> {
        // Every micro-batch of the step, as a GPU runs them: the second
        // one finds the first one's freed blocks cached, and the caching
        // allocator can reserve more there (hf-eager ZeRO-3 on Llama-3.1-8B
        // reserves up to 4.2 GB more at accumulation 2-4 than one
        // micro-batch alone does). The engine fast-forwards once a
        // micro-batch ends where it started (`Engine::step_from`), so a
        // step of 64 costs about what 2 or 3 do.
        let links = self.rank_links();
        let e = match shared {
            None => Engine::new_linked(
                self.model.clone(),
                self.tc.clone(),
                self.meta.clone(),
                None,
                links,
            ),
            Some(slot) => {
                let mut slot = slot.lock().expect("not poisoned");
                let proto = match &mut slot.engine {
                    Some(e) => e,
                    none => none.insert(
                        Engine::unshaped(
                            self.model.clone(),
                            self.tc.clone(),
                            self.meta.clone(),
                            None,
                            links,
                        )
                        .unwrap_or_else(|oom| unreachable!("meta has no capacity: {oom}")),
                    ),
                };
                proto
                    .reshaped(self.tc.clone())
                    .expect("one rank's meta engine copies")
            }
        };
        let e = e.unwrap_or_else(|oom| unreachable!("meta has no capacity: {oom}"));
        let s = step_meta(e, self.rates, self.p.precision);
        out.offload_s = s.offload_s;
        out.compute_s = s.all_s - out.offload_s;
        out.kernel_s = Some(s.kind_s);
        match (&self.topo, &s.calls) {
            (Some(t), Some(calls)) if !calls.is_empty() => {
                let priced = price_collectives(t, calls, self.p);
                out.comm_s = priced.exposed(s.stage_s, self.tc.grad_accum);
                out.comm_hidden_s = priced.total() - out.comm_s;
                out.links = priced.links;
            }
            _ => out.comm_s = s.sent / self.rates.link_bytes_per_s,
        }
        s.e
    }

    /// Rank 0's links, on meta, where one rank stands for the step.
    fn rank_links(&self) -> Links<MetaBackend> {
        let replicas = self.tc.data_ranks();
        let distributed = replicas > 1 || self.p.sharding != Sharding::None;
        let g = self.tc.shard_ranks();
        let comm = distributed.then(|| Box::new(MetaComm::new(0, g)) as Comm<MetaBackend>);
        let replicate =
            (g < replicas).then(|| Box::new(MetaComm::new(0, replicas / g)) as Comm<MetaBackend>);
        // ZeRO++ hpZ: the backward gathers' group, a node's GPUs.
        let hpz = (self.tc.hpz_group)
            .map(NonZeroUsize::get)
            .filter(|&g| g > 1)
            .map(|g| Box::new(MetaComm::new(0, g)) as Comm<MetaBackend>);
        Links {
            comm,
            pipe: None,
            replicate,
            tp: tp_comm(&self.tc),
            hpz,
            ep: ep_comms(&self.tc),
        }
    }

    /// Dropless expert parallelism: the rank's total if every token of its
    /// group chose its experts first (`ExpertLoad::Worst`); the point's
    /// own peak plans an even spread. With pipeline stages, the highest
    /// stage's. `None` elsewhere.
    fn worst_routing_bytes(&self, overhead: u64) -> Option<u64> {
        let tc = &self.tc;
        if tc.expert_parallel <= 1 || tc.capacity_factor.is_some() {
            return None;
        }
        let links = match tc.pipeline_stages > 1 {
            true => self.stage_links(),
            false => vec![self.rank_links()],
        };
        let worst = links.into_iter().map(|links| {
            let mut e = Engine::new_linked(
                self.model.clone(),
                tc.clone(),
                self.meta.clone(),
                None,
                links,
            )
            .unwrap_or_else(|oom| unreachable!("meta has no capacity: {oom}"));
            e.assume_expert_load(crate::engine::expert::ExpertLoad::Worst);
            e.step_from(tc.grad_accum, || unreachable!("meta reads no data"))
                .unwrap_or_else(|oom| unreachable!("meta has no capacity: {oom}"));
            let pk = e.dev.tracker.peak_bytes().total;
            e.dev.caching.as_ref().map_or(pk, |c| c.peak_reserved)
        });
        worst.max().map(|held| held + overhead)
    }

    /// With pipeline stages: each stage's first rank's links (its first
    /// tensor-parallel rank, ranks `s·T`), in stage order.
    fn stage_links(&self) -> Vec<Links<MetaBackend>> {
        let (stages, tps) = (
            self.tc.pipeline_stages.max(1),
            self.tc.tensor_parallel.max(1),
        );
        let replicas = self.tc.data_ranks();
        // One replica's stages and tensor-parallel groups; the data- and
        // expert-parallel groups are the stage's own (`MetaComm`s).
        let wiring = TrainConfig {
            ranks: stages * tps,
            sharding: Sharding::None,
            expert_parallel: 1,
            ..self.tc.clone()
        };
        let distributed = replicas > 1 || self.p.sharding != Sharding::None;
        (crate::engine::cluster::meta_links(self.model, &wiring).into_iter())
            .step_by(tps)
            .map(|link| Links {
                comm: distributed
                    .then(|| Box::new(MetaComm::new(0, replicas)) as Comm<MetaBackend>),
                pipe: link.pipe,
                replicate: None,
                tp: link.tp,
                hpz: None,
                ep: ep_comms(&self.tc),
            })
            .collect()
    }

    /// With pipeline stages: every stage's first rank stepped alone; the
    /// pipeline's times into `out`; the stage with the highest peak.
    fn pipeline(&self, out: &mut Prediction) -> Engine<MetaBackend> {
        let k = self.tc.grad_accum as f64;
        let stages = self.tc.pipeline_stages.max(1);
        let v = self.tc.virtual_stages.max(1);
        let replicas = self.tc.data_ranks();
        // Every stage alone (its allocations depend only on its place),
        // stepped through all K micro-batches, since its in-flight
        // activations depend on K. A slot is the slowest stage's time for
        // one micro-batch through all its chunks. The pipeline's step is
        // then (K + S - 1) slots (GPipe's and 1F1B's bubble), or with V
        // virtual stages K + (S - 1) / V slots (the interleaved bubble,
        // (S - 1) / (V K) of the ideal step: Narayanan et al., SC'21,
        // 2.2.2), plus the slowest optimizer step. The V-fold messages
        // are in each stage's own sends.
        let tps = self.tc.tensor_parallel.max(1);
        let mut worst: Option<(u64, Engine<MetaBackend>)> = None;
        let (mut slot, mut opt_s, mut off_s, mut comm_s) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
        let mut hidden_s = 0.0f64;
        // The slowest stage's micro-batch slot without its sends: the
        // pipeline's compute; the rest of the slot is communication.
        let mut compute_slot = 0.0f64;
        let mut slot_kinds = crate::engine::device::KindSeconds::default();
        let mut crossed = None;
        for (s, links) in self.stage_links().into_iter().enumerate() {
            let e = Engine::new_linked(
                self.model.clone(),
                self.tc.clone(),
                self.meta.clone(),
                None,
                links,
            )
            .unwrap_or_else(|oom| unreachable!("meta has no capacity: {oom}"));
            let st = step_meta(e, self.rates, self.p.precision);
            // Stage s's replicas are ranks (s*D + d)*T + t: they talk among
            // themselves, and each sends activations to its counterpart in
            // stage s+1 and gradients to the one in s-1 (with virtual
            // stages round the ring, so every stage has both); its sends
            // go at the pace of the slowest of those links.
            let (mut p2p_s, mut dp_s) = (0.0, 0.0);
            if let Some(t) = &self.topo {
                let gpn = t.gpus_per_node;
                let at = |s: usize, d: usize| (s * replicas + d) * tps / gpn;
                let peers: Vec<usize> = match v {
                    1 => (s.checked_sub(1).into_iter())
                        .chain((s + 1 < stages).then_some(s + 1))
                        .collect(),
                    _ => vec![(s + 1) % stages, (s + stages - 1) % stages],
                };
                let crosses = (peers.iter()).any(|&n| (0..replicas).any(|d| at(s, d) != at(n, d)));
                let link = match crosses {
                    true => &t.inter,
                    false => &t.intra,
                };
                if st.p2p_sends > 0 {
                    p2p_s = st.p2p_sent as f64 / link.effective_bandwidth()
                        + st.p2p_sends as f64 * link.latency;
                    crossed = union(
                        crossed,
                        Some(match crosses {
                            true => crate::comm::topology::Links::Inter,
                            false => crate::comm::topology::Links::Intra,
                        }),
                    );
                }
                if let Some(calls) = &st.calls {
                    let priced = price_collectives(t, calls, self.p);
                    dp_s = priced.exposed(st.stage_s, self.tc.grad_accum);
                    hidden_s = hidden_s.max(priced.total() - dp_s);
                    crossed = union(crossed, priced.links);
                }
            }
            let stage_slot = (st.all_s - st.opt_s) / k;
            slot = slot.max((st.all_s - st.opt_s + p2p_s) / k);
            if stage_slot >= compute_slot {
                (compute_slot, slot_kinds) = (stage_slot, st.kind_s);
            }
            opt_s = opt_s.max(st.opt_s);
            off_s = off_s.max(st.offload_s);
            comm_s = comm_s.max(dp_s);
            let peak = st.e.dev.tracker.peak_bytes().total;
            if worst.as_ref().is_none_or(|(w, _)| peak > *w) {
                worst = Some((peak, st.e));
            }
        }
        // Pipeline sends are communication: on a slow network they, not
        // the stages' compute, set the slot (issue 27: compute read 50.0 s
        // on 25 GbE and 25.6 s on InfiniBand for the same layout).
        let slots = k + (stages as f64 - 1.0) / v as f64;
        out.offload_s = off_s;
        out.compute_s = slots * compute_slot + opt_s - off_s;
        out.kernel_s = (slot_kinds.total() > 0.0)
            .then(|| slot_kinds.scaled(out.compute_s / slot_kinds.total()));
        out.comm_s = comm_s + slots * (slot - compute_slot);
        out.comm_hidden_s = hidden_s;
        out.links = crossed;
        worst.expect("a stage").1
    }

    /// The peaks, throughput, cost, allocator and host figures of `e`, the
    /// engine that stands for the point, into `out`, and its verdict.
    fn read_engine(
        &self,
        out: &mut Prediction,
        e: &Engine<MetaBackend>,
        usable: u64,
        overhead: u64,
    ) {
        let (r, rates, p) = (self.r, self.rates, self.p);
        out.step_s = out.compute_s + out.comm_s + out.offload_s;
        let tokens = (r.global_batch * r.seq_len) as f64;
        out.tokens_per_s = tokens / out.step_s;
        out.usd_per_mtok = rates.usd_per_mtok(p.gpus, out.tokens_per_s);
        let pk = e.dev.tracker.peak_bytes();
        out.peak_split = Some(PeakBytes::from(e.dev.tracker.at_peak()));
        // The parameters this GPU holds (its stage's, its tensor-parallel slices).
        let psi: u64 = (e.param_specs().iter().enumerate())
            .filter(|(i, _)| e.holds(*i))
            .map(|(_, s)| s.numel() as u64)
            .sum();
        out.engine_bytes_per_param = (pk.get(Category::Parameters)
            + pk.get(Category::Gradients)
            + pk.get(Category::Optimizer)) as f64
            / psi as f64;
        out.allocator = e.dev.caching.as_ref().map(|c| AllocatorPeaks {
            max_memory_allocated: c.peak_allocated,
            max_memory_reserved: c.peak_reserved,
        });
        let held = out.allocator.map_or(pk.total, |a| a.max_memory_reserved);
        out.total_bytes = held + overhead;
        out.margin_bytes = usable as i64 - out.total_bytes as i64;
        out.deepspeed = deepspeed_estimate(e, p, rates.gpus_per_node.min(p.gpus));
        out.host = e.dev.host.as_ref().map(|h| {
            let per_node = rates.gpus_per_node.min(p.gpus);
            let node_bytes = h.peak_bytes().total * per_node as u64;
            let capacity = r.knobs.host_memory.map_or(rates.host_memory, |b| b.0);
            HostPrediction {
                peak_bytes: h.peak_bytes(),
                ranks_per_node: per_node,
                node_bytes,
                capacity_bytes: capacity,
                margin_bytes: capacity as i64 - node_bytes as i64,
                // Every micro-batch of the step ran (or was counted).
                link_bytes_per_step: e.dev.meter.link_bytes,
                deepspeed: deepspeed_estimate(e, p, per_node),
            }
        });
        let host_capacity = r.knobs.host_memory.map_or(rates.host_memory, |b| b.0);
        out.paged = e.dev.paged.as_ref().map(|g| PagedPrediction {
            memory: PAGED_MEMORY.into(),
            bytes: g.peak_bytes().total,
            resident_bytes: 0,
            host_bytes: 0,
            ranks_per_node: rates.gpus_per_node.min(p.gpus),
            host_capacity_bytes: host_capacity
                .saturating_sub(out.host.as_ref().map_or(0, |h| h.node_bytes)),
            host_margin_bytes: 0,
            link_bytes_per_step: 0,
            link_bytes_per_s: rates.host.link_bytes_per_s,
            seconds_per_step: 0.0,
        });
        settle_paged(out);
        out.verdict = fit_verdict(out);
        out.peak_bytes = Some(pk);
    }
}

/// One meta engine's step with the planner's rates, and what it cost.
struct Stepped {
    e: Engine<MetaBackend>,
    all_s: f64,
    /// Device seconds per stage (`engine::device::Stage`).
    stage_s: [f64; 3],
    /// The same seconds by what prices them.
    kind_s: crate::engine::device::KindSeconds,
    opt_s: f64,
    offload_s: f64,
    sent: f64,
    calls: Option<Vec<crate::engine::device::Call>>,
    p2p_sent: u64,
    p2p_sends: u64,
}

/// Rank 0's tensor-parallel group, on meta (`None` without one).
fn tp_comm(tc: &TrainConfig) -> Option<Comm<MetaBackend>> {
    (tc.tensor_parallel > 1)
        .then(|| Box::new(MetaComm::new(0, tc.tensor_parallel)) as Comm<MetaBackend>)
}

/// Expert parallelism's two groups for one rank: the experts' split and
/// the replicas of its experts.
fn ep_comms(tc: &TrainConfig) -> Option<[Comm<MetaBackend>; 2]> {
    let p = tc.expert_parallel;
    (p > 1).then(|| {
        let edp = tc.data_ranks() / p;
        [
            Box::new(MetaComm::new(0, p)) as Comm<MetaBackend>,
            Box::new(MetaComm::new(0, edp)) as Comm<MetaBackend>,
        ]
    })
}

/// Runs one step of `train.grad_accum` micro-batches on a new meta rank
/// (or pipeline stage), priced with `rates`.
fn step_meta(mut e: Engine<MetaBackend>, rates: &Rates, precision: Precision) -> Stepped {
    let k = e.train.grad_accum;
    e.dev.meter.roofline = Some(rates.of(precision));
    e.dev.meter.host_roofline = Some(rates.host);
    e.dev.meter.cost.reset();
    e.dev.meter.optimizer_cost.reset();
    (e.dev.meter.offload_s, e.dev.meter.offload_optimizer_s) = (0.0, 0.0);
    (e.dev.meter.link_bytes, e.dev.meter.link_optimizer_bytes) = (0, 0);
    (e.dev.meter.p2p_sent, e.dev.meter.p2p_sends) = (0, 0);
    e.dev.meter.stage_s = [0.0; 3];
    e.dev.meter.kind_s = Default::default();
    e.dev.meter.collectives = Some(Vec::new());
    let sent0 = e.dev.meter.sent;
    if let Err(oom) = e.step_from(k, || unreachable!("meta reads no data")) {
        unreachable!("meta without capacity cannot run out of memory: {oom}");
    }
    Stepped {
        all_s: e.dev.meter.cost.roofline_s,
        stage_s: e.dev.meter.stage_s,
        kind_s: e.dev.meter.kind_s,
        opt_s: e.dev.meter.optimizer_cost.roofline_s,
        offload_s: e.dev.meter.offload_s,
        sent: (e.dev.meter.sent - sent0) as f64,
        calls: e.dev.meter.collectives.take(),
        p2p_sent: e.dev.meter.p2p_sent,
        p2p_sends: e.dev.meter.p2p_sends,
        e,
    }
}

/// The links two sets of collectives crossed together.
fn union(
    a: Option<crate::comm::topology::Links>,
    b: Option<crate::comm::topology::Links>,
) -> Option<crate::comm::topology::Links> {
    use crate::comm::topology::Links;
    match (a, b) {
        (None, x) | (x, None) => x,
        (Some(Links::None), x) | (x, Some(Links::None)) => x,
        (Some(x), Some(y)) if x == y => Some(x),
        _ => Some(Links::IntraInter),
    }
}

/// One step's collectives priced on a topology: the seconds of those that
/// run beside the forward, the backward and the last backward
/// (`engine::device::Beside`), the longest such call of each, the seconds
/// of those the next op waits for, and the widest set of links they
/// crossed.
struct CommTime {
    /// Beside the forward, the backward, the last backward and the next
    /// step's first forward (`Beside`'s order).
    beside: [f64; 4],
    longest: [f64; 4],
    waited: f64,
    /// What Transformer Engine's overlap hid of the tensor-parallel
    /// collectives behind their GEMMs.
    beside_gemms: f64,
    links: Option<crate::comm::topology::Links>,
}

impl CommTime {
    fn total(&self) -> f64 {
        self.beside.iter().sum::<f64>() + self.waited + self.beside_gemms
    }

    /// The seconds a step of `k` micro-batches waits for communication,
    /// given its device seconds per stage (`engine::device::Stage`).
    /// Frameworks run data-parallel collectives on a stream of their own:
    /// PyTorch DDP all-reduces gradient buckets as the last micro-batch's
    /// backward fills them; FSDP reduce-scatters them during every
    /// backward and prefetches the next unit's all-gather in the forward
    /// and the backward; DeepSpeed with `overlap_comm` and Megatron with
    /// `--overlap-grad-reduce` do the same, and Megatron's
    /// `--overlap-param-gather` gathers the updated weights bucket by
    /// bucket during the next step's first forward. So such collectives
    /// cost only what exceeds the compute they run beside, and at least
    /// their longest call (the last bucket, the first unit's gather, which
    /// nothing runs beside). Tensor-parallel collectives, and the
    /// optimizer's gathers of updated weights without that flag, are
    /// waited for whole.
    fn exposed(&self, stage_s: [f64; 3], k: usize) -> f64 {
        let k = k.max(1) as f64;
        let compute = [stage_s[0], stage_s[1], stage_s[1] / k, stage_s[0] / k];
        let mut secs = self.waited;
        for ((beside, compute), longest) in self.beside.iter().zip(compute).zip(self.longest) {
            secs += (beside - compute).max(longest).min(*beside);
        }
        secs
    }
}

/// Prices one step's collectives, each as NCCL would run it over its
/// group's placement in `topo` (its size, and how far apart its ranks
/// are: consecutive, or a hybrid shard group apart), each as many times
/// as it ran (`Call::times`). With the point's `tp_comm_overlap`, a split
/// projection's sequence-parallel collective runs beside its GEMM
/// ([`tp_overlap_exposed`]); with its `overlap_param_gather`, the gathers
/// of updated weights run beside the next step's first forward.
fn price_collectives(
    topo: &crate::comm::topology::Topology,
    calls: &[crate::engine::device::Call],
    p: &Point,
) -> CommTime {
    use crate::comm::topology::Links;
    let mut out = CommTime {
        beside: [0.0; 4],
        longest: [0.0; 4],
        waited: 0.0,
        beside_gemms: 0.0,
        links: Some(Links::None),
    };
    // A step repeats a few distinct calls once per block: price each
    // distinct one once (the sums still run in call order, so the totals
    // are the same to the bit).
    let mut priced: Vec<(
        (crate::comm::Op, u64, usize, usize),
        crate::comm::topology::Cost,
    )> = Vec::new();
    for c in calls {
        let key = (c.op, c.bytes, c.world, c.stride);
        let cost = match priced.iter().find(|(k, _)| *k == key) {
            Some((_, cost)) => *cost,
            None => {
                let Ok(group) = topo.strided_group(c.world, c.stride) else {
                    continue;
                };
                let cost = topo.price(c.op, c.bytes, &group);
                priced.push((key, cost));
                cost
            }
        };
        out.links = union(out.links, Some(cost.links)).or(Some(Links::None));
        let secs = c.times as f64 * cost.seconds;
        if let Some(gemm_s) = c.gemm_s.filter(|_| p.tp_comm_overlap) {
            let exposed = c.times as f64 * tp_overlap_exposed(cost.seconds, gemm_s, c.world);
            out.waited += exposed;
            out.beside_gemms += secs - exposed;
            continue;
        }
        let i = match c.beside {
            Beside::Forward => 0,
            Beside::Backward => 1,
            Beside::LastBackward => 2,
            Beside::NextForward if p.overlap_param_gather => 3,
            Beside::NextForward | Beside::Nothing => {
                out.waited += secs;
                continue;
            }
        };
        out.beside[i] += secs;
        out.longest[i] = out.longest[i].max(cost.seconds);
    }
    out
}

/// What a tensor-parallel collective of `comm` seconds still costs when
/// Transformer Engine's userbuffers overlap it with its GEMM of `gemm`
/// seconds over a group of `t` ranks (Megatron-LM's `--tp-comm-overlap`).
/// Its ring exchange splits both into `t` chunks: each step computes one
/// chunk's GEMM while the next chunk crosses the ring, and the last
/// chunk's GEMM has nothing beside it. The step takes
/// `(t-1)·max(gemm/t, comm/(t-1)) + gemm/t`, so beyond the GEMM the
/// collective costs `max(0, comm - gemm·(t-1)/t)`. The decomposition is
/// Wang et al.'s ("Overlap Communication with Dependent Computation via
/// Decomposition in Large Deep Learning Models", ASPLOS 2023); Transformer
/// Engine's `te.Linear` splits its GEMMs the same way under
/// `ub_overlap_ag` and `ub_overlap_rs`. memfit pairs each collective with
/// one GEMM (in the backward, the input gradient's); TE's bulk overlaps
/// beside the weight gradient's GEMM (`ub_bulk_wgrad`, `ub_bulk_dgrad`)
/// can hide more.
fn tp_overlap_exposed(comm: f64, gemm: f64, t: usize) -> f64 {
    let t = t.max(1) as f64;
    (comm - gemm * (t - 1.0) / t).max(0.0)
}

/// DeepSpeed's estimator for point `p`'s stage and offload, from the
/// engine's parameter list: its count (tied weights once) and its largest
/// tensor as the largest layer (DeepSpeed sums a module's own parameters;
/// a bias adds under 0.1% to the weight beside it).
fn deepspeed_estimate<B: crate::backend::Backend>(
    e: &Engine<B>,
    p: &Point,
    per_node: usize,
) -> Option<deepspeed::Estimate> {
    let specs = e.param_specs();
    let total: u64 = specs.iter().map(|s| s.numel() as u64).sum();
    let largest = specs.iter().map(|s| s.numel() as u64).max().unwrap_or(0);
    let nodes = p.gpus.div_ceil(per_node) as u64;
    if p.tensor_parallel > 1 {
        // DeepSpeed's estimators count one model over the data-parallel
        // ranks; a tensor-parallel rank's share is not what they take.
        return None;
    }
    match p.sharding {
        Sharding::Zero2 => Some(deepspeed::zero2(
            total,
            per_node as u64,
            nodes,
            p.offload.optimizer(),
        )),
        Sharding::Zero3 => Some(deepspeed::zero3(
            total,
            largest,
            per_node as u64,
            nodes,
            p.offload,
            true,
        )),
        _ => None,
    }
}

/// Dollars with three significant digits (tiny models cost fractions of a cent).
pub fn usd(x: f64) -> String {
    if x >= 0.1 || x == 0.0 {
        format!("{x:.3}")
    } else {
        let digits = (2 - x.log10().floor() as i32).max(0) as usize;
        format!("{x:.digits$}")
    }
}

fn reasons(preds: &[Prediction], ranking: &[usize], r: &PlanRecipe) -> Vec<String> {
    let best = &preds[ranking[0]];
    // In the unit that fits: a 24 MiB device is not "0.0 GiB of 0.0 GiB".
    let bytes = |b: i64| crate::units::fmt_bytes(b.unsigned_abs());
    let mut v = vec![format!(
        "cheapest fitting point: ${} per million tokens at {:.0} tokens/s on {} GPU(s), {} of {} usable per GPU ({} to spare)",
        usd(best.usd_per_mtok),
        best.tokens_per_s,
        best.point.gpus,
        bytes(best.total_bytes as i64),
        bytes(best.usable_bytes as i64),
        bytes(best.margin_bytes)
    )];
    if let Some(&j) = ranking.get(1) {
        let ru = &preds[j];
        let by = (ru.usd_per_mtok / best.usd_per_mtok - 1.0) * 100.0;
        v.push(if !by.is_finite() {
            format!(
                "runner-up: {} at ${} per million tokens",
                ru.point.label(),
                usd(ru.usd_per_mtok)
            )
        } else {
            format!(
                "beats the runner-up ({}) by {by:.1}%: ${} per million tokens",
                ru.point.label(),
                usd(ru.usd_per_mtok)
            )
        });
    }
    // The cheapest point that was not allowed, and why.
    let cheaper_misfit = preds
        .iter()
        .filter(|p| p.verdict == Verdict::DoesNotFit && p.usd_per_mtok < best.usd_per_mtok)
        .min_by(|a, b| a.usd_per_mtok.total_cmp(&b.usd_per_mtok));
    if let Some(m) = cheaper_misfit {
        v.push(format!(
            "cheaper but out of memory: {} would cost ${} per million tokens but needs {} per GPU, {} over",
            m.point.label(),
            usd(m.usd_per_mtok),
            bytes(m.total_bytes as i64),
            bytes(-m.margin_bytes)
        ));
    }
    if let Some(x) = preds
        .iter()
        .filter(|p| p.excluded && p.verdict == Verdict::Fits && p.usd_per_mtok < best.usd_per_mtok)
        .min_by(|a, b| a.usd_per_mtok.total_cmp(&b.usd_per_mtok))
    {
        v.push(format!(
            "not considered because allow_numerics_change is false: {} (${}/Mtok, changes numerics: {})",
            x.point.label(),
            usd(x.usd_per_mtok),
            x.numerics_changes.join(", ")
        ));
    }
    if best.point.framework != Framework::Memfit
        && let Some(x) = preds
            .iter()
            .filter(|p| p.point.framework == Framework::Memfit && p.verdict == Verdict::Fits)
            .min_by(|a, b| a.usd_per_mtok.total_cmp(&b.usd_per_mtok))
    {
        v.push(format!(
            "recommended from {}'s rows: memfit's own engine would run {} at ${}/Mtok, a layout of memfit's allocations that {} does not make",
            name(best.point.framework),
            x.point.label(),
            usd(x.usd_per_mtok),
            name(best.point.framework),
        ));
    }
    if best.numerics_changes.is_empty() {
        v.push("changes no numerics against bf16/fp32 AdamW".into());
    } else {
        v.push(format!(
            "changes numerics: {} (set allow_numerics_change: false to rule these out)",
            best.numerics_changes.join(", ")
        ));
    }
    if !r.allow_numerics_change {
        v.push(
            "fp16, bf16-pure, adamw8bit, adafactor, sgd and capacity factors were not considered (allow_numerics_change: false)"
                .into(),
        );
    }
    v
}

pub mod deepspeed;
pub mod render;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::hardware::load_hardware;
    use crate::config::profile::load_model;

    /// A recipe parsed from `yaml`, with its model and hardware profiles.
    fn recipe(
        yaml: &str,
    ) -> (
        PlanRecipe,
        ModelConfig,
        crate::config::hardware::HardwareProfile,
    ) {
        let r: PlanRecipe = serde_yaml_ng::from_str(yaml).unwrap();
        let model = load_model(&r.model).unwrap();
        let hw = load_hardware(&r.hardware).unwrap();
        (r, model, hw)
    }

    /// A profile's published attention rates, read as the profile gives
    /// them at its points, log-log between sequence lengths, linearly in
    /// log(head_dim) between head dimensions and at the nearest outside;
    /// 16-bit only, since flash attention runs on the tensor cores.
    #[test]
    fn attention_rates_are_read_between_the_published_points() {
        let mut hw = load_hardware("a100-80gb").unwrap();
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b;
        let table = roofline(&hw, Precision::Bf16).attention_table.unwrap();
        for (t, hd, expect) in [
            (2048, 128, 155e12),
            (512, 64, 88e12),
            (100_000, 128, 189e12),
            (2048, 256, 155e12),
            (2048, 32, 140e12),
        ] {
            assert!(
                close(table.at(t, hd), expect),
                "{t} {hd}: {}",
                table.at(t, hd)
            );
        }
        let between = table.at(2048, 96);
        let f = (96f64 / 64.0).ln() / 2f64.ln();
        assert!((between - (140e12 + f * 15e12)).abs() < 1e3, "{between}");
        let t = table.at(2896, 128);
        let g = (2896f64 / 2048.0).ln() / 2f64.ln();
        let expect = (155e12f64.ln() + g * (173f64 / 155.0).ln()).exp();
        assert!((t - expect).abs() < 1e3, "{t} vs {expect}");
        assert!(roofline(&hw, Precision::Fp32).attention_table.is_none());
        hw.use_attention_kernel(AttentionKernel::FlashAttentionTriton)
            .unwrap();
        let triton = roofline(&hw, Precision::Bf16).attention_table.unwrap();
        assert!(close(triton.at(2048, 128), 68e12));
        // A work item priced on it takes its FLOPs over that rate.
        let s = crate::backend::AttnShape {
            b: 1,
            t: 2048,
            n_head: 16,
            n_kv_head: 16,
            head_dim: 128,
        };
        let w = crate::engine::ops::Work::flash_attention(s, 0);
        let r = roofline(&hw, Precision::Bf16);
        let priced = r.kernel_seconds(&w);
        assert!(
            close(priced, w.flops as f64 / triton.at(2048, 128)),
            "{priced}"
        );
    }

    /// An overlap flag's point against the same point without it: the
    /// same bytes and the same communication, less of it waited for.
    fn overlap_hides(off: &Prediction, on: &Prediction, what: &str) {
        assert_eq!(off.peak_bytes, on.peak_bytes, "{what}");
        assert!(
            on.comm_s < off.comm_s,
            "{what}: {} vs {}",
            on.comm_s,
            off.comm_s
        );
        assert!(on.step_s < off.step_s, "{what}");
        let (all_off, all_on) = (off.comm_s + off.comm_hidden_s, on.comm_s + on.comm_hidden_s);
        assert!(
            (all_on - all_off).abs() <= 1e-9 * all_off,
            "{what}: {all_on} vs {all_off}"
        );
    }

    /// Megatron's `--tp-comm-overlap` moves the sequence-parallel
    /// collectives' seconds from waited for to hidden, each at most by
    /// its GEMM's `(T-1)/T`, and changes no byte; without sequence
    /// parallelism the point is invalid, as Megatron refuses the flag.
    #[test]
    fn tp_comm_overlap_hides_sequence_parallel_collectives_behind_their_gemms() {
        let yaml = "model: llama-3.1-8b\nhardware: h100-sxm-80gb\nseq_len: 4096\nglobal_batch: 32\ngrid:\n  framework: [memfit]\n  micro_batch: [1]\n  sharding: [zero1]\n  gpus: [16]\n  tensor_parallel: [2, 8]\n  sequence_parallel: [false, true]\n  tp_comm_overlap: [false, true]\n";
        let (r, model, hw) = recipe(yaml);
        let plan = plan(&r, &model, &hw);
        let find = |t: usize, sp: bool, ov: bool| {
            (plan.points.iter())
                .find(|p| {
                    let q = &p.point;
                    (q.tensor_parallel, q.sequence_parallel, q.tp_comm_overlap) == (t, sp, ov)
                })
                .unwrap()
        };
        for t in [2, 8] {
            let invalid = find(t, false, true);
            assert!(
                matches!(&invalid.verdict, Verdict::Invalid { reason } if reason.contains("--sequence-parallel")),
                "{:?}",
                invalid.verdict
            );
            overlap_hides(find(t, true, false), find(t, true, true), &format!("tp{t}"));
        }
        // The ring's split: what exceeds the GEMM's (T-1)/T stays exposed.
        assert_eq!(tp_overlap_exposed(1.0, 0.5, 2), 0.75);
        assert_eq!(tp_overlap_exposed(1.0, 4.0, 8), 0.0);
        assert_eq!(tp_overlap_exposed(1.0, 8.0, 1), 1.0);
    }

    /// Megatron's `--overlap-param-gather` moves zero1's and zero2's
    /// gathers of updated weights from waited for to beside the next
    /// step's first forward, and changes no byte; other sharding makes no
    /// such gathers, so the flag makes the point invalid there.
    #[test]
    fn overlap_param_gather_hides_the_updated_weights_gathers_behind_the_first_forward() {
        let yaml = "model: llama-3.1-8b\nhardware: h100-sxm-80gb\nseq_len: 4096\nglobal_batch: 64\ngrid:\n  framework: [memfit]\n  micro_batch: [1]\n  sharding: [ddp, zero1, zero2, zero3]\n  gpus: [16]\n  tensor_parallel: [8]\n  overlap_param_gather: [false, true]\n";
        let (r, model, hw) = recipe(yaml);
        let plan = plan(&r, &model, &hw);
        let find = |s: Sharding, ov: bool| {
            (plan.points.iter())
                .find(|p| (p.point.sharding, p.point.overlap_param_gather) == (s, ov))
                .unwrap()
        };
        for s in [Sharding::Ddp, Sharding::Zero3] {
            let invalid = find(s, true);
            assert!(
                matches!(&invalid.verdict, Verdict::Invalid { reason } if reason.contains("--overlap-param-gather")),
                "{:?}",
                invalid.verdict
            );
        }
        for s in [Sharding::Zero1, Sharding::Zero2] {
            overlap_hides(find(s, false), find(s, true), &format!("{s:?}"));
        }
        // One data-parallel rank gathers nothing; hf-eager's zero1/2 are
        // DeepSpeed's, which waits.
        let yaml = "model: llama-tiny\nhardware: h100-sxm-80gb\nseq_len: 64\nglobal_batch: 8\ngrid:\n  framework: [memfit, hf-eager]\n  micro_batch: [1]\n  sharding: [zero1]\n  gpus: [2]\n  tensor_parallel: [1, 2]\n  overlap_param_gather: [true]\n";
        let (r, model, hw) = recipe(yaml);
        let small = crate::plan::plan(&r, &model, &hw);
        for p in &small.points {
            let q = &p.point;
            let valid = q.framework == Framework::Memfit && q.tensor_parallel == 1;
            assert_eq!(
                !matches!(p.verdict, Verdict::Invalid { .. }),
                valid,
                "{}: {:?}",
                q.label(),
                p.verdict
            );
        }
        // Beside the first micro-batch's forward only (its pre-hooks wait
        // for each bucket), and never less than the longest gather.
        let t = CommTime {
            beside: [0.0, 0.0, 0.0, 1.0],
            longest: [0.0, 0.0, 0.0, 0.1],
            waited: 0.0,
            beside_gemms: 0.0,
            links: None,
        };
        assert!((t.exposed([0.8, 1.6, 0.1], 4) - 0.8).abs() < 1e-12);
        assert!((t.exposed([8.0, 16.0, 0.1], 4) - 0.1).abs() < 1e-12);
    }

    /// The planner fast-forwards over micro-batches that repeat one another
    /// (`Engine::step_from`). Over points that exercise every feature a
    /// micro-batch touches, it plans exactly what running every micro-batch
    /// does: the same peaks to the byte, the allocator's figures, the bytes
    /// on every link and, within summation order, the seconds.
    #[test]
    fn fast_forward_plans_what_running_every_micro_batch_does() {
        let yaml = "model: gpt2\nhardware: h100-sxm-80gb\nseq_len: 128\nglobal_batch: 64\nhost_memory: 1TiB\ngrid:\n  micro_batch: [1, 2]\n  precision: [bf16, fp16]\n  checkpointing: [none, full]\n  optimizer: [adamw, adamw8bit]\n  sharding: [ddp, zero1, zero2, zero3]\n  gpus: [4, 8]\n  framework: [memfit, hf-eager]\n  finetune: [full, lora]\n  offload: [none, optimizer]\n";
        let (r, model, hw) = recipe(yaml);
        let (capacity, overhead) = r.capacity(&hw);
        let rates = Rates::gpu(&hw, hw.usd_per_hour);
        let mut layouts = vec![];
        for extra in [
            "",
            "  hpz_group: [2]\n",
            "  shard_group: [2]\n",
            "  tensor_parallel: [2]\n  sequence_parallel: [true]\n",
            "  tensor_parallel: [2]\n  sequence_parallel: [true]\n  tp_comm_overlap: [true]\n",
            "  overlap_param_gather: [true]\n",
        ] {
            let r: PlanRecipe = serde_yaml_ng::from_str(&format!("{yaml}{extra}").replace(
                "  offload: [none, optimizer]\n",
                if extra.is_empty() {
                    "  offload: [none, optimizer]\n"
                } else {
                    ""
                },
            ))
            .unwrap();
            layouts.extend(expand(&r));
        }
        let mut compared = 0;
        let target = PlanTarget {
            recipe: &r,
            model: &model,
            rates: &rates,
            capacity,
            overhead,
        };
        for p in &layouts {
            let fast = predict(&target, p);
            crate::engine::RUN_EVERY_MICRO_BATCH.with(|c| c.set(true));
            let every = predict(&target, p);
            crate::engine::RUN_EVERY_MICRO_BATCH.with(|c| c.set(false));
            let Some(peaks) = every.peak_bytes else {
                continue;
            };
            compared += 1;
            let at = format!("{p:?}");
            assert_eq!(fast.peak_bytes, Some(peaks), "{at}");
            assert_eq!(fast.peak_split, every.peak_split, "{at}");
            assert_eq!(fast.allocator, every.allocator, "{at}");
            assert_eq!(fast.total_bytes, every.total_bytes, "{at}");
            assert_eq!(
                fast.host
                    .as_ref()
                    .map(|h| (h.peak_bytes, h.link_bytes_per_step)),
                every
                    .host
                    .as_ref()
                    .map(|h| (h.peak_bytes, h.link_bytes_per_step)),
                "{at}"
            );
            assert_eq!(fast.links, every.links, "{at}");
            for (x, y) in [
                (fast.compute_s, every.compute_s),
                (fast.comm_s, every.comm_s),
                (fast.offload_s, every.offload_s),
            ] {
                assert!(
                    (x - y).abs() <= 1e-9 * y.abs().max(1e-12),
                    "{at}: {x} vs {y}"
                );
            }
        }
        println!("{compared} points compared");
        assert!(compared > 300, "{compared} points compared");
    }

    /// Every `memfit run` knob is a plan's axis, a plan recipe's key, or
    /// fixed in plans for a reason given in `FIXED_KNOBS`: a knob added to
    /// `knobs` fails this test until the planner handles it (and a recipe
    /// setting it is refused as an unknown key until then). Each recipe key
    /// is read into the recipe's knobs, and each axis or fixed knob a
    /// recipe sets is refused with its reason.
    #[test]
    fn every_knob_is_an_axis_a_recipe_key_or_fixed_in_plans() {
        let head = "model: gpt2\nhardware: h100-sxm-80gb\nseq_len: 64\nglobal_batch: 8\n";
        let own: Vec<&str> = recipe_keys::own_keys().collect();
        for name in Knobs::NAMES {
            let ways = [
                Axis::ALL.iter().any(|a| a.key() == *name),
                own.contains(name) || RECIPE_KNOBS.contains(name),
                FIXED_KNOBS.iter().any(|(f, _)| f == name),
            ];
            assert_eq!(
                ways.iter().filter(|&&w| w).count(),
                1,
                "knob `{name}`: a plan axis ({}), a plan recipe key ({}) or fixed ({})",
                ways[0],
                ways[1],
                ways[2]
            );
            let value = match *name {
                "optimizer_in_backward" => "true",
                "optimizer_impl" => "fused",
                "param_groups" => "trainer",
                "set_to_none" | "liger" | "compile_loss" => "false",
                "lora_targets" => "[q]",
                "host_memory" => "1GiB",
                "dropout" | "lora_alpha" | "lora_dropout" => "0.5",
                _ => "2",
            };
            let read: Result<PlanRecipe> =
                parse_yaml(&format!("{head}{name}: {value}\n"), "r.yaml");
            match (ways, RECIPE_KNOBS.contains(name)) {
                (_, true) => assert!(read.unwrap().knobs.has(name), "{name}"),
                ([true, _, _], _) => {
                    let err = read.unwrap_err().to_string();
                    assert!(err.contains("r.yaml:5:1: "), "{err}");
                    assert!(err.contains("is a grid axis"), "{err}");
                }
                ([_, _, true], _) => {
                    let err = read.unwrap_err().to_string();
                    assert!(err.contains("r.yaml:5:1: "), "{err}");
                    assert!(err.contains("plans hold fixed"), "{err}");
                }
                // The recipe's own keys: `model`, `seq_len`, `device`.
                _ => assert!(own.contains(name), "{name}"),
            }
        }
        for f in RECIPE_KNOBS
            .iter()
            .chain(FIXED_KNOBS.iter().map(|(f, _)| f))
        {
            assert!(Knobs::NAMES.contains(f), "`{f}` is no knob");
        }
    }

    /// A plan copies one engine per group of points that differ only in the
    /// batch's shape (`Engine::reshaped`); every point comes out as
    /// planning it alone, building its own engine, does: the same JSON.
    #[test]
    fn points_sharing_an_engine_plan_what_building_their_own_does() {
        let yaml = "model: gpt2\nhardware: h100-sxm-80gb\nseq_len: 128\nglobal_batch: 64\nhost_memory: 1TiB\ngrid:\n  micro_batch: [1, 2, 4]\n  precision: [fp32, bf16, fp16]\n  checkpointing: [none, full]\n  attention: [eager, fused]\n  optimizer: [adamw, adafactor]\n  sharding: [ddp, zero2, zero3]\n  gpus: [1, 4]\n  framework: [memfit, hf-eager]\n  finetune: [full, qlora]\n  offload: [none, optimizer]\n";
        let (r, model, hw) = recipe(yaml);
        let (capacity, overhead) = r.capacity(&hw);
        let rates = Rates::gpu(&hw, hw.usd_per_hour);
        let mut compared = 0;
        for extra in [
            "",
            "  tensor_parallel: [2]\n  hpz_group: [2]\n  shard_group: [2]\n",
        ] {
            let r: PlanRecipe = serde_yaml_ng::from_str(&format!("{yaml}{extra}")).unwrap();
            let planned = plan(&r, &model, &hw);
            for x in &planned.points {
                let alone = predict(
                    &PlanTarget {
                        recipe: &r,
                        model: &model,
                        rates: &rates,
                        capacity,
                        overhead,
                    },
                    &x.point,
                );
                if alone.peak_bytes.is_some() {
                    compared += 1;
                }
                assert_eq!(
                    serde_json::to_value(unlifted(x)).unwrap(),
                    serde_json::to_value(&alone).unwrap(),
                    "{:?}",
                    x.point
                );
            }
        }
        println!("{compared} points compared");
        assert!(compared > 500, "{compared} points compared");
    }

    /// ZeRO-2 and ZeRO-3 points carry DeepSpeed's own estimate of their
    /// model states (what `ds_config.json`'s users compare with), computed
    /// from the model's parameters and the layout; other points none.
    #[test]
    fn zero_points_carry_deepspeeds_estimate() {
        let (r, model, hw) = recipe(
            "model: llama-3.1-8b\nhardware: h100-sxm-80gb\nseq_len: 4096\nglobal_batch: 64\ngrid:\n  precision: [bf16]\n  checkpointing: [full]\n  sharding: [ddp, zero2, zero3]\n  gpus: [8, 16]\n",
        );
        let planned = plan(&r, &model, &hw);
        let params = model.num_parameters();
        let mut seen = 0;
        for x in &planned.points {
            let nodes = x.point.gpus.div_ceil(8) as u64;
            let expect = match x.point.sharding {
                Sharding::Zero2 => Some(deepspeed::zero2(params, 8, nodes, false)),
                Sharding::Zero3 => {
                    let (specs, _) = model.param_layout();
                    let largest = specs.iter().map(|s| s.numel() as u64).max().unwrap();
                    let none = crate::engine::Offload::None;
                    Some(deepspeed::zero3(params, largest, 8, nodes, none, true))
                }
                _ => None,
            };
            assert_eq!(x.deepspeed, expect, "{:?}", x.point);
            seen += usize::from(expect.is_some());
        }
        assert_eq!(seen, 4);
        // For Llama-3.1-8B over 8 GPUs under ZeRO-2: 4 + 16/8 B/param.
        let z2 = planned
            .points
            .iter()
            .find(|x| x.point.sharding == Sharding::Zero2)
            .unwrap();
        assert_eq!(z2.deepspeed.unwrap().per_gpu, (params as f64 * 6.0) as u64);
    }

    /// A point lifted to a smaller micro-batch's reserved peak comes back
    /// to its own prediction, which is what planning it alone gives.
    #[test]
    fn unlifted_is_the_point_planned_alone() {
        let yaml = "model: llama-3.1-70b\nhardware: h100-sxm-80gb\nseq_len: 4096\nglobal_batch: 64\ngrid:\n  framework: [hf-eager]\n  precision: [fp32]\n  micro_batch: [1, 2]\n  checkpointing: [full]\n  sharding: [zero1]\n  gpus: [8]\n";
        let (r, model, hw) = recipe(yaml);
        let both = plan(&r, &model, &hw);
        let lifted = both
            .points
            .iter()
            .find(|p| p.reserved_from_micro_batch == Some(1))
            .expect("micro-batch 2 fragments less and is lifted");
        let alone = PlanRecipe {
            grid: Grid {
                micro_batch: vec![2],
                ..r.grid.clone()
            },
            ..r.clone()
        };
        let own = plan(&alone, &model, &hw);
        assert_eq!(
            serde_json::to_value(unlifted(lifted)).unwrap(),
            serde_json::to_value(&own.points[0]).unwrap()
        );
        assert!(lifted.total_bytes > own.points[0].total_bytes);
    }

    /// A capacity factor is hundredths inside and the factor outside: a
    /// number or `null` both ways, in JSON and in YAML; a value that is
    /// not a positive multiple of 0.01 is refused by name.
    #[test]
    fn a_capacity_factor_round_trips_as_a_number_or_null() {
        for (text, c) in [
            ("null", Capacity::DROPLESS),
            ("1.25", Capacity(Some(125))),
            ("1.0", Capacity(Some(100))),
            ("0.07", Capacity(Some(7))),
            ("1.1", Capacity(Some(110))),
            ("2.5", Capacity(Some(250))),
        ] {
            assert_eq!(serde_json::from_str::<Capacity>(text).unwrap(), c, "{text}");
            assert_eq!(serde_json::to_string(&c).unwrap(), text);
            assert_eq!(serde_yaml_ng::from_str::<Capacity>(text).unwrap(), c);
            assert_eq!(c.spelled(), text);
            assert_eq!(text.parse::<Capacity>().unwrap(), c);
        }
        // Integers are factors too; `~` is YAML's null.
        assert_eq!(
            serde_json::from_str::<Capacity>("2").unwrap(),
            Capacity(Some(200))
        );
        assert_eq!(
            serde_yaml_ng::from_str::<Capacity>("1").unwrap(),
            Capacity(Some(100))
        );
        assert_eq!(
            serde_yaml_ng::from_str::<Capacity>("~").unwrap(),
            Capacity::DROPLESS
        );
        assert_eq!(Capacity(Some(125)).factor(), Some(1.25));
        assert_eq!(Capacity(Some(110)).factor(), Some(1.1f32));
        assert_eq!(Capacity::DROPLESS.factor(), None);
        assert_eq!(Capacity(Some(150)).to_string(), "1.5");
        assert_eq!(Capacity(Some(5)).to_string(), "0.05");
        assert_eq!(Capacity::DROPLESS.to_string(), "dropless");
        for bad in ["0", "-1", "1.234", "0.001", "100000000"] {
            let e = serde_json::from_str::<Capacity>(bad)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("capacity_factor") && e.contains(bad) && e.contains("multiple of 0.01"),
                "{bad}: {e}"
            );
            let e = serde_yaml_ng::from_str::<Capacity>(bad)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains(bad) && e.contains("multiple of 0.01"),
                "{bad}: {e}"
            );
            assert!(bad.parse::<Capacity>().is_err(), "{bad}");
        }
        let e = serde_json::from_str::<Capacity>("\"1.25\"").unwrap_err();
        assert!(e.to_string().contains("invalid type"), "{e}");
        // In a recipe's grid, located; absent, one dropless value.
        let base = "model: moe-tiny\nhardware: t4\nseq_len: 32\nglobal_batch: 4\n";
        let e = parse_yaml::<PlanRecipe>(
            &format!("{base}grid:\n  capacity_factor: [null, 1.234]\n"),
            "r.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("r.yaml:6") && e.contains("capacity_factor 1.234"),
            "{e}"
        );
        let (r, _, _) = recipe(base);
        assert_eq!(r.grid.capacity_factor, vec![Capacity::DROPLESS]);
        let (r, _, _) = recipe(&format!(
            "{base}grid:\n  capacity_factor: [null, 1.0, 1.25]\n"
        ));
        assert_eq!(
            r.grid.capacity_factor,
            [None, Some(100), Some(125)].map(Capacity).to_vec()
        );
        // A dropless point serializes as before the axis, and a report
        // from before it reads back dropless.
        let points = expand(&r);
        assert_eq!(points.len(), 3);
        let json = serde_json::to_value(points[0]).unwrap();
        assert!(json.get("capacity_factor").is_none(), "{json}");
        let back: Point = serde_json::from_value(json).unwrap();
        assert_eq!(back, points[0]);
        let json = serde_json::to_value(points[2]).unwrap();
        assert_eq!(json["capacity_factor"], 1.25);
        assert_eq!(serde_json::from_value::<Point>(json).unwrap(), points[2]);
        assert_eq!(points[2].train_config(32).capacity_factor, Some(1.25));
        assert_eq!(points[0].train_config(32).capacity_factor, None);
        assert!(
            points[2].label().starts_with("cf1.25 "),
            "{}",
            points[2].label()
        );
        assert!(!points[0].label().contains("cf"), "{}", points[0].label());
    }

    /// A capacity factor on a model without experts is an invalid point,
    /// with the engine's reason; on one with experts, above experts/top-k
    /// too (moe-tiny routes to 2 of 4: at most 2.0).
    #[test]
    fn a_capacity_factor_without_experts_is_an_invalid_point() {
        for model in ["gpt2-tiny", "llama-tiny"] {
            let (r, model, hw) = recipe(&format!(
                "model: {model}\nhardware: t4\nseq_len: 32\nglobal_batch: 4\ngrid:\n  capacity_factor: [null, 1.0]\n"
            ));
            let planned = plan(&r, &model, &hw);
            assert_eq!(planned.points.len(), 2);
            assert!(!matches!(
                planned.points[0].verdict,
                Verdict::Invalid { .. }
            ));
            match &planned.points[1].verdict {
                Verdict::Invalid { reason } => {
                    assert!(reason.contains("no experts"), "{reason}")
                }
                v => panic!("{v:?}"),
            }
        }
        let (r, model, hw) = recipe(
            "model: moe-tiny\nhardware: t4\nseq_len: 32\nglobal_batch: 4\ngrid:\n  capacity_factor: [2.0, 2.01]\n",
        );
        let planned = plan(&r, &model, &hw);
        assert!(!matches!(
            planned.points[0].verdict,
            Verdict::Invalid { .. }
        ));
        match &planned.points[1].verdict {
            Verdict::Invalid { reason } => assert!(reason.contains("experts / top-k"), "{reason}"),
            v => panic!("{v:?}"),
        }
    }
}
