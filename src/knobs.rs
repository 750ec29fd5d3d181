//! The training knobs, declared once. `memfit run`'s flags (clap) and a run
//! recipe's keys (serde, `_` for the flags' `-`) are this one struct; every
//! knob is optional, so that a flag overrides the recipe's key and a knob
//! neither gives takes its default (`run::options::resolve`). What the
//! flags and keys share is generated from the one list below: the merge
//! ([`Knobs::or`]), which knobs a source gave ([`Knobs::has`]), reading one
//! key into its field ([`Knobs::read_key`], for a plan recipe's fixed
//! knobs) and, for the knobs marked `[train]`, setting the engine's
//! `TrainConfig` ([`Knobs::apply`]).
//!
//! It sits below `plan` and `balance_cmd`, so that `memfit plan`'s recipe
//! keys and `memfit balance`'s flags are these knobs too, not copies.

use std::path::PathBuf;

use serde::Deserialize;

use crate::backend::DeviceSpec;
use crate::config::hardware::{HardwareProfile, load_hardware};
use crate::engine::{
    Attention, Checkpointing, Finetune, Framework, LoraConfig, Loss, Offload, Optimizer,
    OptimizerImpl, ParamGroups, Precision, Schedule, Sharding, lora::Target,
};
use crate::units::Bytes;

/// Declares [`Knobs`] from one list of `name: Type` (each an `Option`),
/// with its flag attributes and help, and what is generated from it.
macro_rules! knobs {
    // A knob marked `[train]` is the `TrainConfig` field of the same name
    // and type, which `Knobs::apply` sets.
    (@marker train) => {};
    ($( $(#[$attr:meta])* $name:ident: $ty:ty $([$train:ident])?, )*) => {
        /// Knob flags have no clap default so that a recipe's key applies
        /// unless the flag is given; the defaults are stated in each help
        /// line.
        #[derive(Clone, Debug, Default, PartialEq, clap::Args, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct Knobs {
            $( $(#[$attr])* pub $name: Option<$ty>, )*
        }

        impl Knobs {
            /// Every knob, as a recipe's key (and, `_` as `-`, a flag).
            pub const NAMES: &[&str] = &[$(stringify!($name)),*];

            /// Each knob from `self` where it is set, else from `other`.
            pub fn or(&self, other: &Knobs) -> Knobs {
                Knobs {
                    $( $name: self.$name.clone().or_else(|| other.$name.clone()), )*
                }
            }

            /// Sets each knob marked `[train]` in the list that `self`
            /// sets into `train`'s field of the same name; the others
            /// (defaults that depend on other knobs, knobs outside
            /// `TrainConfig`) are `run::options`'s to resolve.
            pub fn apply(&self, train: &mut crate::engine::TrainConfig) {
                $( $(
                    knobs!(@marker $train);
                    if let Some(v) = &self.$name {
                        train.$name = v.clone();
                    }
                )? )*
            }

            /// Unsets every knob whose name `keep` refuses.
            pub fn retain(&mut self, mut keep: impl FnMut(&str) -> bool) {
                $(
                    if !keep(stringify!($name)) {
                        self.$name = None;
                    }
                )*
            }

            /// Whether knob `name` (a key, `seq_len`) is set.
            pub fn has(&self, name: &str) -> bool {
                match name {
                    $( stringify!($name) => self.$name.is_some(), )*
                    _ => false,
                }
            }

            /// Reads the value of key `name` from `map` into its knob, as
            /// a derived `Deserialize` reads a field (so a bad value keeps
            /// its file, line and column); `false`, reading nothing, when
            /// no knob is called `name`.
            pub fn read_key<'de, A: serde::de::MapAccess<'de>>(
                &mut self,
                name: &str,
                map: &mut A,
            ) -> Result<bool, A::Error> {
                match name {
                    $( stringify!($name) => self.$name = map.next_value()?, )*
                    _ => return Ok(false),
                }
                Ok(true)
            }
        }
    };
}

knobs! {
    /// A built-in profile name (see `memfit models`), a profile YAML or a
    /// Hugging Face config.json [default: gpt2-tiny].
    #[arg(long)]
    model: String,
    /// Tokens per sequence [default: 64].
    #[arg(long)]
    seq_len: usize [train],
    /// Sequences per micro-batch [default: 4].
    #[arg(long)]
    micro_batch: usize [train],
    /// Micro-batches per optimizer step [default: 1].
    #[arg(long)]
    grad_accum: usize,
    /// Optimizer steps; meta always plans exactly one [default: 20].
    #[arg(long)]
    steps: usize,
    /// cpu or meta, optionally with an emulated capacity (cpu:limit=512MiB),
    /// cuda[:N], or meta:GPU to predict a GPU profile (see `memfit
    /// profiles`): the cuda backend's allocations within the GPU's memory
    /// less its runtime overhead [default: cpu, whose capacity is the host's
    /// available memory].
    #[arg(long, value_name = "DEVICE")]
    device: RunDevice,
    /// Byte-level text to train on: a file, or a directory read recursively
    /// (in a recipe, relative to the recipe's folder). Without it, a seeded
    /// synthetic token stream.
    #[arg(long)]
    data: PathBuf,
    /// Seed for weights and data [default: 1337].
    #[arg(long)]
    seed: u64 [train],
    /// adamw, adamw8bit, paged-adamw, paged-adamw8bit, adafactor or sgd [default: adamw].
    #[arg(long, value_enum)]
    optimizer: Optimizer [train],
    /// Learning rate [default: 3e-4 for AdamW, 1e-2 for SGD, Adafactor's relative step].
    #[arg(long, allow_negative_numbers = true)]
    lr: f32,
    /// AdamW's beta1 [default: 0.9]; for Adafactor, turns on the first moment [default: off].
    #[arg(long)]
    beta1: f32,
    /// AdamW's and 8-bit AdamW's beta2, the second moment's decay (GPT-3
    /// and Llama pretrained with 0.95; Hugging Face's `adam_beta2`)
    /// [default: 0.999].
    #[arg(long)]
    beta2: f32 [train],
    /// Weight decay on matrices only: decoupled for AdamW and Adafactor, L2 for SGD [default: 0.1].
    #[arg(long, allow_negative_numbers = true)]
    weight_decay: f32 [train],
    /// SGD momentum, in (0, 1) [default: 0.9].
    #[arg(long)]
    momentum: f32 [train],
    /// Clip gradients to this global norm; 0 turns clipping off [default: 1.0].
    #[arg(long)]
    grad_clip: f32 [train],
    /// The optimizer step fused into the backward (torchtune's
    /// optimizer_in_bwd): each unit's parameters are stepped as soon as
    /// their gradients are complete, and the gradients freed; one rank, no
    /// accumulation, no clipping (--grad-clip 0) [default: false; the bare
    /// flag: true].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = switch())]
    optimizer_in_backward: bool [train],
    /// none; full: keep only each block's input and recompute the block in the
    /// backward pass; selective: torchtitan's per-op policy (keep the
    /// attention's and every other matmul's outputs, recompute the rest)
    /// [default: none].
    #[arg(long, value_enum)]
    checkpointing: Checkpointing [train],
    /// eager (materialises B*H*T*T probabilities) or fused (flash-style) [default: eager].
    #[arg(long, value_enum)]
    attention: Attention [train],
    /// fp32, or mixed precision: bf16, or fp16 with dynamic loss scaling;
    /// 16-bit weights, activations and gradients, fp32 master weights
    /// (hf-eager: autocast, fp32 weights and no master copy); or bf16-pure
    /// (torchtune's dtype: bf16, model.to(torch.bfloat16)): bf16 weights,
    /// gradients and AdamW state, no master copy [default: fp32].
    #[arg(long, value_enum)]
    precision: Precision [train],
    /// Whose allocations to hold: memfit (the engine's own) or hf-eager
    /// (what PyTorch + Hugging Face transformers allocate for the same
    /// step); hf-eager computes with memfit's kernels and, with bf16/fp16 or
    /// dropout, runs on meta only [default: memfit].
    #[arg(long, value_enum)]
    framework: Framework [train],
    /// hf-eager: the model's dropout probability; decides which masks are
    /// saved (meta only: the engine's kernels have no dropout) [default: 0].
    #[arg(long)]
    dropout: f32 [train],
    /// hf-eager: torch.optim.AdamW's implementation: foreach, single-tensor
    /// or fused [default: foreach].
    #[arg(long, value_enum)]
    optimizer_impl: OptimizerImpl [train],
    /// hf-eager: the optimizer's parameter groups: one (AdamW(model.parameters()),
    /// a plain loop) or trainer (transformers' Trainer: the decaying
    /// matrices, then biases and norms); torch.optim updates a group at a
    /// time [default: one].
    #[arg(long, value_enum)]
    param_groups: ParamGroups [train],
    /// hf-eager: optimizer.zero_grad(set_to_none=...) [default: true].
    #[arg(long, value_name = "BOOL", value_parser = set_to_none())]
    set_to_none: bool [train],
    /// How the loss meets the head: full (every token's logits at once),
    /// chunked (torchtune's LinearCrossEntropyLoss: the sequence in
    /// --loss-chunks parts; hf-eager), fused-linear (Liger's fused linear
    /// cross-entropy: no logits beyond a chunk of tokens) or
    /// megatron-unfused (Megatron-Core's default: the logits copied to fp32
    /// and the softmax formed in unfused passes; memfit) [default: full].
    #[arg(long, value_enum)]
    loss: Loss [train],
    /// --loss chunked: the parts the sequence is split into (torchtune's
    /// num_output_chunks) [default: 8].
    #[arg(long)]
    loss_chunks: usize [train],
    /// --loss chunked: each part's projection and cross-entropy compiled,
    /// as torchtune's `compile: True` compiles its loss; torch.compile's
    /// graph saves the part's logits in their own type and two fp32 per
    /// token instead of an fp32 log-softmax, and makes no fp32 copies
    /// (hf-eager) [default: false].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = switch())]
    compile_loss: bool [train],
    /// hf-eager: Liger's RMSNorm, SwiGLU and RoPE kernels in place of
    /// transformers' (liger_kernel's apply_liger_kernel_to_llama() and its
    /// siblings, or the Trainer's use_liger_kernel=True, whose fused linear
    /// cross-entropy is --loss fused-linear); Llama-family dense models
    /// [default: false].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = switch())]
    liger: bool [train],
    /// full (every weight trains) or lora (adapters on frozen weights; one
    /// rank, no pipeline) [default: full].
    #[arg(long, value_enum)]
    finetune: Finetune [train],
    /// LoRA rank r [default: 8].
    #[arg(long)]
    lora_rank: usize,
    /// LoRA alpha; the adapter's output is scaled by alpha / r [default: 8].
    #[arg(long)]
    lora_alpha: f32,
    /// hf-eager: PEFT's lora_dropout (its masks; meta only) [default: 0].
    #[arg(long)]
    lora_dropout: f32,
    /// Projections to adapt, comma-separated: q,k,v,o,gate,up,down, and on
    /// a mixture experts (every routed expert's gate, up and down; there
    /// gate, up and down adapt the shared expert and dense blocks) (GPT-2:
    /// q, k and v are one c_attn adapter; no gate) [default: every dense
    /// projection; a mixture names its targets].
    #[arg(long, value_enum, value_delimiter = ',')]
    lora_targets: Vec<Target>,
    /// Ranks (simulated GPUs), each with its own device and memory: pipeline
    /// stages x data-parallel replicas x tensor-parallel ranks; the global
    /// batch is micro-batch x grad-accum x replicas [default: stages x
    /// tensor-parallel ranks].
    #[arg(long)]
    ranks: usize,
    /// How state is spread over the ranks: none (one rank), ddp, zero1
    /// (optimizer state), zero2 (+ gradients), zero3 (+ parameters, FSDP) [default: none].
    #[arg(long, value_enum)]
    sharding: Sharding [train],
    /// ddp: gradients are views into the all-reduce buckets (PyTorch's
    /// gradient_as_bucket_view), so the buckets cost no extra memory
    /// [default: false; the bare flag: true].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = switch())]
    bucket_view: bool [train],
    /// With --tensor-parallel: Megatron's sequence parallelism; norms and
    /// the residual stream keep 1/T of the tokens on each rank, gathered
    /// before and reduce-scattered after each split projection [default:
    /// false; the bare flag: true].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = switch())]
    sequence_parallel: bool [train],
    /// ZeRO-Offload: optimizer (fp32 master, optimizer state and gradient
    /// shard in host memory, the update on the CPU; zero1-3) or
    /// optimizer+params (and the weight shard; zero3) [default: none].
    #[arg(long, value_enum)]
    offload: Offload [train],
    /// torchtune's activation offloading (enable_activation_offloading):
    /// each checkpointed block's input waits in host memory from its
    /// forward to its backward, crossing the host link twice; needs
    /// --checkpointing full [default: false; the bare flag: true].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true", value_parser = switch())]
    offload_activations: bool [train],
    /// With --checkpointing full: checkpoint only every N-th block (the
    /// N-th, 2N-th, ...), the others keeping what their backward reads:
    /// torchtitan's layer SAC (selective_ac_option = "N") [default: 1,
    /// every block].
    #[arg(long, value_name = "N")]
    checkpoint_every: usize [train],
    /// Hybrid sharding (FSDP's HYBRID_SHARD): ZeRO shards over groups of
    /// this many consecutive ranks (a node's GPUs) and replicates across
    /// the groups, all-reducing gradient shards between them; 0 is off
    /// [default: off, all ranks in one group].
    #[arg(long)]
    shard_group: usize,
    /// Tensor parallelism (Megatron-LM): groups of this many adjacent ranks
    /// split every block's attention heads and MLP width between them,
    /// all-reducing activations; --ranks is then stages x data-parallel
    /// replicas x this [default: 1].
    #[arg(long)]
    tensor_parallel: usize [train],
    /// ZeRO++ hpZ (zero3): each rank also keeps a secondary copy of the
    /// weights sharded over its group of this many consecutive ranks (a
    /// node's GPUs), so the backward's all-gathers stay within the group;
    /// costs 1/G of the weights per rank (DeepSpeed's
    /// zero_hpz_partition_size); 0 is off [default: off].
    #[arg(long)]
    hpz_group: usize,
    /// A mixture of experts' expert capacity: each expert takes at most
    /// this multiple of an even share of the tokens' choices
    /// (`⌈f·tokens·top_k/experts⌉`, padded to it), the rest dropped
    /// (Megatron's --moe-expert-capacity-factor with
    /// --moe-pad-expert-input-to-capacity) [default: dropless].
    #[arg(long)]
    capacity_factor: f32,
    /// Expert parallelism (Megatron-Core's --expert-model-parallel-size):
    /// groups of this many consecutive data-parallel ranks split a
    /// mixture's experts between them, exchanging tokens all-to-all; the
    /// experts' gradients and ZeRO state are shared within the ranks that
    /// hold the same experts [default: 1].
    #[arg(long)]
    expert_parallel: usize [train],
    /// Host memory offloaded tensors may take, per rank, e.g. 64GiB
    /// [default: this machine's available memory].
    #[arg(long, value_parser = host_bytes)]
    host_memory: Bytes,
    /// Pipeline stages: each a rank holding a contiguous run of blocks (the
    /// embedding with the first, the head with the last); --ranks is then
    /// stages x data-parallel replicas [default: 1; --ranks defaults to it].
    #[arg(long)]
    pipeline_stages: usize [train],
    /// Micro-batches each step pushes through the pipeline (the same as
    /// --grad-accum, which it sets).
    #[arg(long)]
    microbatches: usize,
    /// gpipe (all forwards, then all backwards) or 1f1b (stage s holds at
    /// most stages - s micro-batches) [default: 1f1b].
    #[arg(long, value_enum)]
    schedule: Schedule [train],
    /// Virtual pipeline stages (Megatron-LM's interleaved 1F1B): the model
    /// is cut into stages x V chunks, stage s holding chunks s, s + stages,
    /// ...; the bubble shrinks V-fold for V times the point-to-point
    /// messages. Needs --schedule 1f1b and --grad-accum a multiple of the
    /// stages [default: 1].
    #[arg(long)]
    virtual_stages: usize [train],
    /// Blocks per stage (per model chunk with --virtual-stages, in model
    /// order) as half-open ranges, e.g. 0:6,6:12 (what `memfit balance`
    /// prints) [default: an even split, the first stages taking the rest].
    #[arg(long)]
    partition: String,
    /// cpu worker threads [default: all cores].
    #[arg(long, value_parser = threads)]
    threads: usize,
}

/// `--threads`, checked as clap parses it (`memfit run`, `sweep`, `tui`,
/// `calibrate`).
pub(crate) fn threads(s: &str) -> Result<usize, String> {
    crate::config::limits::check_threads(s.parse().map_err(|e| format!("{e}"))?)
}

fn host_bytes(s: &str) -> Result<Bytes, String> {
    crate::units::parse_bytes(s)
        .and_then(crate::units::positive_bytes)
        .map(Bytes)
}

/// A knob that is on or off: `true` or `false` (a bare flag: `true`).
fn switch() -> impl clap::builder::TypedValueParser<Value = bool> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new([
        PossibleValue::new("true").help("on"),
        PossibleValue::new("false").help("off"),
    ])
    .map(|v| v == "true")
}

/// `optimizer.zero_grad(set_to_none=...)`.
fn set_to_none() -> impl clap::builder::TypedValueParser<Value = bool> {
    use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new([
        PossibleValue::new("true").help(
            "the gradients are freed after each step and made again by the next backward \
             (PyTorch's default since 2.0)",
        ),
        PossibleValue::new("false").help("the gradients stay resident between steps, zeroed"),
    ])
    .map(|v| v == "true")
}

impl Knobs {
    /// The LoRA knobs, PEFT's defaults where absent (`memfit run`'s and a
    /// plan recipe's).
    pub fn lora(&self) -> LoraConfig {
        let d = LoraConfig::default();
        LoraConfig {
            rank: self.lora_rank.unwrap_or(d.rank),
            alpha: self.lora_alpha.unwrap_or(d.alpha),
            dropout: self.lora_dropout.unwrap_or(d.dropout),
            targets: self.lora_targets.clone().unwrap_or(d.targets),
        }
    }

    /// The hf-eager and chunked-loss knobs, `memfit run`'s defaults
    /// (`TrainConfig`'s) where absent (a plan recipe's).
    pub fn hf(&self) -> crate::engine::framework::HfKnobs {
        let mut t = crate::engine::TrainConfig::default();
        self.apply(&mut t);
        crate::engine::framework::HfKnobs {
            dropout: t.dropout,
            optimizer_impl: t.optimizer_impl,
            set_to_none: t.set_to_none,
            param_groups: t.param_groups,
            loss_chunks: t.loss_chunks,
            compile_loss: t.compile_loss,
            optimizer_in_backward: t.optimizer_in_backward,
            liger: t.liger,
        }
    }
}

/// Where `memfit run` runs (`--device`, a run recipe's `device:`): a device
/// as [`DeviceSpec`] parses it, or `meta:GPU`, one step on meta predicting a
/// GPU profile: the engine's allocations as the cuda backend makes them,
/// within the profile's memory less its runtime overhead (as `memfit
/// balance --device meta:GPU` takes it).
#[derive(Clone, Debug, PartialEq)]
pub enum RunDevice {
    Device(DeviceSpec),
    Gpu(Box<HardwareProfile>),
}

impl std::str::FromStr for RunDevice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        // `meta:limit=1GiB` and `meta:1` are DeviceSpec's to parse (and
        // refuse); anything else after `meta:` names a GPU profile.
        if let Some(gpu) = s.trim().strip_prefix("meta:")
            && !gpu.contains('=')
            && !gpu.bytes().all(|b| b.is_ascii_digit())
        {
            return load_hardware(gpu.trim())
                .map(|hw| RunDevice::Gpu(Box::new(hw)))
                .map_err(|e| format!("`{s}`: {e}"));
        }
        s.parse().map(RunDevice::Device).map_err(|e: String| {
            format!("{e}; or meta:GPU to predict a GPU profile (see `memfit profiles`)")
        })
    }
}

impl std::fmt::Display for RunDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunDevice::Device(d) => write!(f, "{d}"),
            RunDevice::Gpu(hw) => write!(f, "meta:{}", hw.name),
        }
    }
}

impl<'de> Deserialize<'de> for RunDevice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = RunDevice;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a device such as cpu, cpu:limit=512MiB, meta or meta:t4")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RunDevice, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_str(Visitor)
    }
}

/// Parsed as the scalar is read, so that a bad value's error carries the
/// scalar's line and column (an error raised after it would be placed at
/// the start of the enclosing mapping).
impl<'de> Deserialize<'de> for DeviceSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = DeviceSpec;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a device such as cpu, cpu:limit=512MiB or meta")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<DeviceSpec, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_str(Visitor)
    }
}
