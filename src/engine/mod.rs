//! The training engine: GPT-2 and Llama forward and backward, written by hand
//! per layer (llm.c-style), and AdamW. Generic over the backend, so the same
//! code (and therefore the same allocation schedule) runs on cpu and meta.
//!
//! Allocation schedule, which is what the tracker measures:
//! * init: parameters, gradients (always resident, zeroed each step, as with
//!   `zero_grad(set_to_none=False)`), fp32 master weights under mixed
//!   precision, optimizer state (fp32), workspace;
//! * forward: each block's saved tensors are `activations`; a projection output
//!   that is immediately added to the residual stream is a `temporaries`;
//! * backward: activation gradients are `temporaries`, freed as soon as the
//!   layer that needs them is done; each block's saved tensors are freed right
//!   after its backward, as PyTorch frees saved tensors when a node has run;
//!   the logits buffer is turned into its own gradient in place.

pub mod cluster;
pub mod device;
pub mod expert;
pub mod framework;
mod init;
pub mod lora;
pub mod loss;
pub mod moe;
pub mod ops;
pub mod optim;
pub mod pipeline;
pub mod shard;
mod step;
pub mod tensor;
pub mod validate;

use std::num::NonZeroUsize;

use crate::backend::{AttnShape, Backend, DType};
use crate::comm::Peer;
pub use crate::config::knobs::{Attention, Checkpointing, Precision};
use crate::config::model::{BlockIndex, Init, ParamIndex, ParamSpec};
use crate::config::{Family, ModelConfig};
use crate::data::Batch;
use crate::memory::{Category, OomError, Phase};
use crate::rng::Rng;

use cluster::Links;
pub use device::{Comm, CostCounter, Device, OpCost, Tensor};
pub use framework::{Framework, HfRules, OptimizerImpl, ParamGroups};
pub use lora::{Adapter, Finetune, LoraConfig, Proj};
pub use loss::Loss;
use optim::OptState;
pub use optim::{OptConfig, Optimizer};
pub use pipeline::{Pipe, Schedule};
use shard::{Dist, Stage};
pub use shard::{Offload, Sharding};
use tensor::Tp;

type T<B> = Tensor<<B as Backend>::Buf>;
/// A norm's output, LayerNorm mean (gpt2 only) and reciprocal std.
type NormOut<B> = (T<B>, Option<T<B>>, T<B>);
/// Frozen norms' weight and bias gradients, discarded (LoRA).
type NormScratch<B> = Option<(T<B>, T<B>)>;
/// A block's saved tensors and, unless recomputing, its output.
type BlockOut<B> = (BlockActs<T<B>>, Option<T<B>>);

/// The training knobs the engine implements.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainConfig {
    pub seq_len: usize,
    pub micro_batch: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    pub optimizer: Optimizer,
    /// `None`: the optimizer's default (Adafactor: relative step).
    pub lr: Option<f32>,
    /// `None`: 0.9 for AdamW; no first moment for Adafactor.
    pub beta1: Option<f32>,
    pub beta2: f32,
    pub eps: f32,
    /// Decoupled (AdamW, Adafactor) or L2 (SGD); matrices only.
    pub weight_decay: f32,
    /// SGD momentum.
    pub momentum: f32,
    /// Global-norm clipping threshold; 0 disables.
    pub grad_clip: f32,
    /// torchtune's `optimizer_in_bwd`: each unit's parameters are stepped
    /// in the backward as soon as their gradients are complete, and the
    /// gradients freed (`step.rs`, [`Engine::step_unit`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub optimizer_in_backward: bool,
    pub seed: u64,
    pub checkpointing: Checkpointing,
    pub attention: Attention,
    pub precision: Precision,
    /// fp16 only: the first loss scale (PyTorch `GradScaler` and DeepSpeed
    /// start at 2^16).
    pub initial_loss_scale: f32,
    /// fp16 only: steps without an overflow before the scale doubles
    /// (`GradScaler`'s growth_interval, 2000).
    pub loss_scale_window: u32,
    /// Ranks in all: pipeline stages x data-parallel replicas x tensor-parallel
    /// ranks (placed as [`TrainConfig::place`] says). The global
    /// batch is micro_batch x grad_accum x replicas.
    pub ranks: usize,
    pub sharding: Sharding,
    /// ddp: gradients are views into the all-reduce buckets
    /// (`gradient_as_bucket_view`), so the buckets cost no memory of their own.
    pub bucket_view: bool,
    /// Pipeline stages (1: no pipeline). `grad_accum` is then the number of
    /// micro-batches each step pushes through the pipeline.
    pub pipeline_stages: usize,
    /// Megatron's sequence parallelism (with `tensor_parallel` > 1): the
    /// norms and residual stream keep `1/T` of the tokens on each rank,
    /// all-gathered before each column-parallel projection and
    /// reduce-scattered after each row-parallel one.
    pub sequence_parallel: bool,
    pub schedule: Schedule,
    /// Virtual pipeline stages (Megatron-LM's interleaved 1F1B): model
    /// chunks per stage, the model being cut into `pipeline_stages x this`
    /// chunks (1: one contiguous run of blocks per stage).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub virtual_stages: usize,
    /// Blocks per model chunk (per stage without virtual stages), in model
    /// order; `None` splits them evenly.
    pub partition: Option<Vec<usize>>,
    /// Whose implementation's allocations the schedule follows (`framework.rs`).
    pub framework: Framework,
    /// hf-eager only: the dropout probability of the model's dropout layers
    /// (memory only: it decides which masks are saved; the engine's kernels
    /// have no dropout, so it is refused where they compute).
    pub dropout: f32,
    /// hf-eager only: `torch.optim.AdamW`'s implementation.
    pub optimizer_impl: OptimizerImpl,
    /// hf-eager only: `optimizer.zero_grad(set_to_none=...)`.
    pub set_to_none: bool,
    /// hf-eager only: the optimizer's parameter groups.
    #[serde(default)]
    pub param_groups: ParamGroups,
    /// How the loss meets the head (`loss.rs`); absent from reports of
    /// before it existed, which computed the full loss.
    #[serde(default)]
    pub loss: Loss,
    /// `chunked`: the parts the sequence is split into.
    #[serde(default = "loss::default_chunks")]
    pub loss_chunks: usize,
    /// `chunked`, hf-eager: each part's projection and cross-entropy
    /// compiled by torch.compile, as torchtune's `compile: True` compiles
    /// `LinearCrossEntropyLoss.compute_cross_entropy` (`loss.rs`); absent
    /// from reports of before it existed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub compile_loss: bool,
    /// hf-eager only: Liger's RMSNorm, SwiGLU and RoPE kernels in place of
    /// transformers' (`apply_liger_kernel_to_<family>()`, `framework.rs`);
    /// absent from reports of before it existed.
    #[serde(default)]
    pub liger: bool,
    /// Full training, or LoRA adapters on frozen weights (`lora.rs`).
    pub finetune: Finetune,
    pub lora: LoraConfig,
    /// ZeRO-Offload: what lives in host memory (`shard::Offload`).
    pub offload: Offload,
    /// torchtune's activation offloading under full checkpointing: each
    /// block's input, the one tensor a checkpointed block saves, waits in
    /// host memory from its forward to its backward (`step.rs`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub offload_activations: bool,
    /// Full checkpointing of every N-th block only (blocks N-1, 2N-1, ...),
    /// the others keeping everything: torchtitan's layer SAC,
    /// `selective_ac_option = "N"` (1: every block).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub checkpoint_every: usize,
    /// The host memory offloaded tensors may take, per rank (`None`: no
    /// limit).
    pub host_memory: Option<u64>,
    /// Hybrid sharding (PyTorch FSDP's HYBRID_SHARD, DeepSpeed's MiCS):
    /// ZeRO shards over groups of this many consecutive ranks (a node) and
    /// replicates across the groups, all-reducing the gradient shards
    /// between replicas at the step. `None`: one group of every rank.
    #[serde(with = "crate::config::knobs::group")]
    pub shard_group: Option<NonZeroUsize>,
    /// Tensor parallelism (`tensor.rs`): ranks that split every block's
    /// projections between them (1: none). `ranks` is then pipeline stages
    /// x data-parallel replicas x this.
    pub tensor_parallel: usize,
    /// ZeRO++ hpZ (zero3, `shard.rs`): backward gathers run within groups
    /// of this many consecutive data-parallel ranks (a node), from a
    /// secondary copy of the weights sharded over the group. `None`: off.
    #[serde(with = "crate::config::knobs::group")]
    pub hpz_group: Option<NonZeroUsize>,
    /// Mixture of experts (`moe.rs`): each expert's rows as a multiple of
    /// an even share of the tokens' choices, tokens beyond it dropped;
    /// `None`: dropless.
    #[serde(default)]
    pub capacity_factor: Option<f32>,
    /// Expert parallelism (`moe.rs`, `shard.rs`): consecutive data-parallel
    /// ranks that split a mixture's experts between them (1: none).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub expert_parallel: usize,
}

fn one() -> usize {
    1
}

fn is_one(x: &usize) -> bool {
    *x == 1
}

// `Precision` is declared with the knob enums the configuration reads
// (`config::knobs`); which backend type stores it is the engine's business.
impl Precision {
    /// Element type of the working weights, activations and gradients.
    pub fn dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 | Precision::Bf16Pure => DType::Bf16,
            Precision::Fp16 => DType::F16,
        }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            seq_len: 64,
            micro_batch: 4,
            grad_accum: 1,
            optimizer: Optimizer::Adamw,
            lr: None,
            beta1: None,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            momentum: 0.9,
            grad_clip: 1.0,
            optimizer_in_backward: false,
            seed: 1337,
            checkpointing: Checkpointing::None,
            attention: Attention::Eager,
            precision: Precision::Fp32,
            initial_loss_scale: 65536.0,
            loss_scale_window: 2000,
            ranks: 1,
            sharding: Sharding::None,
            bucket_view: false,
            pipeline_stages: 1,
            sequence_parallel: false,
            schedule: Schedule::OneFOneB,
            virtual_stages: 1,
            partition: None,
            framework: Framework::Memfit,
            dropout: 0.0,
            optimizer_impl: OptimizerImpl::Foreach,
            set_to_none: true,
            param_groups: ParamGroups::One,
            loss: Loss::Full,
            loss_chunks: loss::DEFAULT_CHUNKS,
            compile_loss: false,
            liger: false,
            finetune: Finetune::Full,
            lora: LoraConfig::default(),
            offload: Offload::None,
            offload_activations: false,
            checkpoint_every: 1,
            host_memory: None,
            shard_group: None,
            tensor_parallel: 1,
            hpz_group: None,
            capacity_factor: None,
            expert_parallel: 1,
        }
    }
}

impl TrainConfig {
    /// Whether anything lives in host memory: ZeRO-Offload's state or
    /// offloaded activations (then the device has a host tracker, and
    /// `host_memory` bounds it).
    pub fn uses_host(&self) -> bool {
        self.offload.optimizer() || self.offload_activations
    }

    /// These knobs with `other`'s batch shape: its micro-batch, accumulation,
    /// attention kernel and checkpointing. Of what an engine allocates, only
    /// the workspace reads them ([`Engine::unshaped`]); the step reads them
    /// all.
    pub fn with_batch_shape_of(&self, other: &TrainConfig) -> TrainConfig {
        TrainConfig {
            micro_batch: other.micro_batch,
            grad_accum: other.grad_accum,
            attention: other.attention,
            checkpointing: other.checkpointing,
            ..self.clone()
        }
    }

    /// Data-parallel replicas: ranks per pipeline stage and tensor-parallel
    /// position.
    pub fn data_ranks(&self) -> usize {
        self.ranks / (self.pipeline_stages.max(1) * self.tensor_parallel.max(1))
    }

    /// Where global rank `r` sits, Megatron's order (tensor-parallel ranks
    /// adjacent, then data-parallel replicas, then pipeline stages):
    /// `(stage, replica, tensor-parallel rank)`.
    pub fn place(&self, r: usize) -> (usize, usize, usize) {
        let t = self.tensor_parallel.max(1);
        let per_stage = self.data_ranks() * t;
        (r / per_stage, (r % per_stage) / t, r % t)
    }

    /// Ranks the ZeRO state is sharded over: the hybrid shard group, or
    /// every data-parallel rank.
    pub fn shard_ranks(&self) -> usize {
        match self.shard_group {
            None => self.data_ranks(),
            Some(g) => g.get().min(self.data_ranks()),
        }
    }

    /// Model chunks of a pipeline: a chunk per stage, or `V` per stage
    /// with virtual stages.
    pub fn chunks(&self) -> usize {
        self.pipeline_stages.max(1) * self.virtual_stages.max(1)
    }

    /// Blocks per model chunk (per pipeline stage without virtual stages):
    /// the partition given, or an even split.
    pub fn balance(&self, n_layer: usize) -> Vec<usize> {
        self.partition
            .clone()
            .unwrap_or_else(|| pipeline::uniform_balance(n_layer, self.chunks()))
    }

    /// The optimizer settings with defaults resolved: lr 3e-4 for the AdamW
    /// variants, 1e-2 for SGD, Hugging Face's relative step for Adafactor.
    pub fn opt(&self) -> OptConfig {
        let (lr, beta1) = match self.optimizer {
            Optimizer::Adamw
            | Optimizer::Adamw8bit
            | Optimizer::PagedAdamw
            | Optimizer::PagedAdamw8bit => (
                Some(self.lr.unwrap_or(3e-4)),
                Some(self.beta1.unwrap_or(0.9)),
            ),
            Optimizer::Sgd => (Some(self.lr.unwrap_or(1e-2)), None),
            Optimizer::Adafactor => (self.lr, self.beta1),
        };
        OptConfig {
            kind: self.optimizer,
            lr,
            beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            momentum: self.momentum,
            state_dtype: match self.precision.is_pure() {
                true => DType::Bf16,
                false => DType::F32,
            },
        }
    }
}

/// What one optimizer step reports. Values are `None` on a backend without data.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepReport {
    /// Mean loss over the step's micro-batches.
    pub loss: Option<f32>,
    /// Global gradient norm before clipping.
    pub grad_norm: Option<f32>,
    /// The update was skipped: the gradient was not finite.
    pub skipped: bool,
}

/// Tensors one block saves for its backward.
struct BlockActs<X> {
    ln1: X,
    /// LayerNorm only (gpt2).
    ln1_mean: Option<X>,
    ln1_rstd: X,
    /// Packed q|k|v, after RoPE on llama.
    qkv: X,
    /// Eager: the attention probabilities (B,H,T,T). Fused: the per-row
    /// log-sum-exp (B,H,T), all the backward pass needs to recompute them.
    att: X,
    /// Attention output before the output projection (N,C).
    atty: X,
    /// Residual stream after attention (N,C).
    res2: X,
    ln2: X,
    ln2_mean: Option<X>,
    ln2_rstd: X,
    /// gpt2: fc output before GELU (N,4C); llama: gate|up (N,2I). A
    /// routed block's shared expert's, or `None` without one.
    up: Option<X>,
    /// gpt2: GELU output (N,4C); llama: SwiGLU output (N,I).
    act: Option<X>,
    /// A routed block's experts, and its shared expert's gate.
    moe: Option<moe::MoeActs<X>>,
    gate: Option<moe::GateActs<X>>,
    /// The q and k norms' inputs and statistics (`ModelConfig::qk_norm`).
    qk: Option<[(X, X); 2]>,
    /// What the framework profile saves beyond these (`HfRules::block_saved`).
    extra: Vec<X>,
    /// LoRA: each adapter's `x A^T (N, r)`, in the block's adapter order.
    lora_t: Vec<X>,
    /// Eager attention under Gemma 2's soft cap: each score's `tanh(s /
    /// cap)` (B,H,T,T), which the cap's backward reads.
    tanh: Option<X>,
    /// Gemma's post-norms of the attention's and the MLP's outputs: each
    /// one's input (N,C) and rstd (N).
    post_attn: Option<(X, X)>,
    post_mlp: Option<(X, X)>,
    /// Selective checkpointing: the MLP's output (N,C), which torchtitan's
    /// policy saves (llama's down projection is the block's 7th matmul)
    /// though the backward never reads it; held as torchtitan holds it.
    down: Option<X>,
}

/// What a block's forward leaves for its backward, beside its input (in
/// `Acts::resid`). Unboxed as the `Option` it replaced was: a box would be
/// a heap allocation per block per micro-batch in the planner's meta runs.
#[allow(clippy::large_enum_variant)]
enum Saved<X> {
    /// Everything its backward reads (no checkpointing).
    All(BlockActs<X>),
    /// Nothing more (full checkpointing): the backward recomputes the
    /// block from its input, and hf-eager's rest of it ([`Input`]).
    Input(Input<X>),
    /// Selective checkpointing: the outputs of the ops torchtitan's policy
    /// saves; the backward recomputes the rest (`step/sac.rs`). With them,
    /// under autocast, the fp32 input's other half (as `Input::half`).
    Ops(Kept<X>, Option<X>),
}

/// What a fully checkpointed block keeps beyond the engine's input
/// (`resid`), under hf-eager: both on the host when activations are
/// offloaded, and back on the device for the block's backward.
struct Input<X> {
    /// Autocast: the input is PyTorch's fp32 residual stream, the engine's
    /// in 16 bits; this is its other half, until the recomputation remakes
    /// the block's saved tensors, among which hf-eager's own other half
    /// (`HfRules::block_saved`) stands for it (PyTorch's recomputed norm
    /// saves the same storage).
    half: Option<X>,
    /// GPT-2's eager mask, which the pack hook copied with the block's
    /// positional inputs (`HfRules::eager_mask`); the recomputation drops
    /// it as it returns.
    mask: Option<X>,
}

/// The ops' outputs a block keeps under selective checkpointing.
struct Kept<X> {
    /// The saved columns of q|k|v (q after RoPE, then v), packed: (N, q + v).
    qkv: X,
    /// Fused attention: its output (N,C) and log-sum-exp (B,H,T); eager
    /// attention is recomputed (PyTorch's eager attention is bmm and softmax,
    /// none of them on the save list).
    attn: Option<(X, X)>,
    /// The saved columns of the MLP's first projection: llama's gate (N,I),
    /// gpt2's whole fc output (N,4C).
    up: X,
    /// The MLP's output when the policy saves it (llama).
    down: Option<X>,
}

/// Everything a forward pass leaves for the backward pass (of this
/// pipeline stage's part of the model).
struct Acts<X> {
    /// First stage only.
    tokens: Option<X>,
    /// Last stage only.
    targets: Option<X>,
    /// The residual stream (N,C) into each of this stage's blocks:
    /// `resid[0]` is the embedding output (or, after the first stage, the
    /// activation received from the stage before), `resid[j + 1]` the output
    /// of the stage's block j. The last stage keeps its last block's output
    /// (it feeds the head); the others send it on and free it.
    resid: Vec<X>,
    /// Each block's saved tensors; `None` when checkpointed (recomputed in backward).
    blocks: Vec<Saved<X>>,
    /// Last stage only.
    head: Option<HeadActs<X>>,
    /// The framework profile's tensors saved with the embedding.
    extra: Vec<X>,
    /// hf-eager, eager attention: the mask, while checkpointed blocks hold
    /// it (`HfRules::eager_mask`).
    mask: Option<X>,
    /// This stage's routed blocks' load-balancing losses (`None` on a
    /// backend without data).
    aux: Option<f64>,
}

/// What the final norm, the head and the loss save.
struct HeadActs<X> {
    /// The final norm's output, which the full loss's head matmul saves
    /// (`None`: the chunked and fused losses keep their own rows).
    lnf: Option<X>,
    lnf_mean: Option<X>,
    lnf_rstd: X,
    loss: LossActs<X>,
    /// Every token's loss (f32).
    losses: X,
    /// The framework profile's tensors saved by the final norm and the head.
    extra: Vec<X>,
}

/// What the loss keeps for the backward (`loss.rs`).
enum LossActs<X> {
    /// The logits, whole (one part without its own rows) or chunk by chunk,
    /// each becoming its own gradient in the backward.
    Logits {
        parts: Vec<LogitsPart<X>>,
        /// Tensor parallelism: each token's logsumexp over the whole
        /// vocabulary, which the backward of this rank's columns needs.
        lse: Option<X>,
    },
    /// The fused loss's gradients, made in the forward.
    Fused(loss::Fused<X>),
}

struct LogitsPart<X> {
    /// Its first token, and how many.
    start: usize,
    rows: usize,
    /// (rows,Vp) (a tensor-parallel rank: its Vp/T columns).
    logits: X,
    /// A chunk's copy of its rows of the head's input, which its matmul
    /// saves, and of its targets, which its loss saves.
    input: Option<X>,
    targets: Option<X>,
    /// The framework profile's tensors saved with the log_softmax output.
    extra: Vec<X>,
    /// What its loss's backward launches and moves beyond the engine's
    /// kernels (Megatron's unfused loss, `loss::megatron_unfused`, or
    /// PyTorch's eager one, `HfRules::loss_unfused`).
    unfused: framework::Unfused,
}

#[cfg(test)]
thread_local! {
    /// Unit tests turn the planner's fast-forward off to check it against
    /// running every micro-batch.
    pub(crate) static RUN_EVERY_MICRO_BATCH: std::cell::Cell<bool> =
        const { std::cell::Cell::new(false) };
}

fn tests_run_every_micro_batch() -> bool {
    #[cfg(test)]
    return RUN_EVERY_MICRO_BATCH.with(|c| c.get());
    #[cfg(not(test))]
    false
}

pub struct Engine<B: Backend> {
    pub model: ModelConfig,
    pub train: TrainConfig,
    pub dev: Device<B>,
    specs: Vec<ParamSpec>,
    idx: ParamIndex,
    /// Working weights, in the precision's dtype.
    params: Vec<T<B>>,
    /// Same dtype as the weights.
    grads: Vec<T<B>>,
    /// fp32 master weights under mixed precision (tracked as optimizer state,
    /// as the ZeRO paper counts them); empty for fp32.
    master: Vec<T<B>>,
    opt: Vec<OptState<T<B>>>,
    workspace: T<B>,
    /// This rank's part in a data-parallel job; `None` for a single rank.
    dist: Option<Dist<B>>,
    /// This rank's pipeline stage; `None` without pipeline parallelism.
    pipe: Option<Pipe<B>>,
    /// The tensors this rank holds (all of them without a pipeline; the
    /// others are zero-length placeholders with no optimizer state).
    owned: Vec<bool>,
    /// Optimizer steps taken.
    step: u64,
    /// The most micro-batches (of one chunk each, with virtual stages)
    /// whose activations the last step held at once.
    held_most: usize,
    /// Steps skipped because the gradient was not finite.
    skipped_steps: u64,
    /// fp16: the current loss scale and the overflow-free steps since it last changed.
    loss_scale: f32,
    good_steps: u32,
    /// hf-eager: what PyTorch holds beyond the engine's own tensors.
    hf: Option<HfRules>,
    /// hf-eager with `set_to_none` on one rank: gradients exist from the
    /// backward that makes them to the end of the optimizer step. With
    /// the optimizer in the backward (either framework): from the
    /// backward of their unit to its step, right after it.
    lazy_grads: bool,
    /// Whether the running backward steps each unit as its gradients are
    /// complete (`optimizer_in_backward`, during [`Engine::step_from`]
    /// only: [`Engine::compute_grads`] leaves the weights alone).
    stepping: bool,
    /// LoRA: each block's adapters (empty for full training).
    adapters: Vec<Vec<Adapter>>,
    /// Which tensors train (LoRA freezes the base's).
    trainable: Vec<bool>,
    /// This rank's tensor-parallel group and slices (`None`: no tensor
    /// parallelism).
    tp: Option<Tp<B>>,
    /// This rank's place in its expert-parallel group (`expert.rs`).
    ep: Option<expert::Ep<B>>,
    /// This rank's widths of the split projections (the model's without
    /// tensor parallelism).
    widths: tensor::Widths,
}

impl Engine<crate::backend::meta::MetaBackend> {
    /// A copy of this unshaped planning engine ([`Engine::unshaped`]) for
    /// `train`, which may differ from its own knobs only in the batch's
    /// shape ([`TrainConfig::with_batch_shape_of`]), with its workspace:
    /// what [`Engine::new_linked`] builds for `train`, to the byte and the
    /// allocator block, without building it again (a plan's points share
    /// their parameters, gradients and optimizer states this way).
    /// `None` for a pipeline stage or a communicator that cannot be copied.
    pub fn reshaped(&self, train: TrainConfig) -> Option<Result<Self, OomError>> {
        assert_eq!(self.workspace.len, 0, "reshaped from an unshaped engine");
        assert_eq!(self.step, 0, "reshaped before any step");
        assert!(
            self.train.with_batch_shape_of(&train) == train,
            "only the batch's shape differs"
        );
        if self.pipe.is_some() {
            return None;
        }
        let dist = match &self.dist {
            Some(d) => Some(d.fork()?),
            None => None,
        };
        let tp = match &self.tp {
            Some(t) => Some(t.fork()?),
            None => None,
        };
        let ep = match &self.ep {
            Some(t) => Some(t.fork()?),
            None => None,
        };
        let hf =
            (self.hf.as_ref()).map(|_| HfRules::new(&self.model, &train, self.dev.be.is_gpu()));
        let mut e = Engine {
            model: self.model.clone(),
            train,
            dev: self.dev.clone(),
            specs: self.specs.clone(),
            idx: self.idx.clone(),
            params: self.params.clone(),
            grads: self.grads.clone(),
            master: self.master.clone(),
            opt: self.opt.clone(),
            workspace: self.workspace.clone(),
            dist,
            pipe: None,
            owned: self.owned.clone(),
            step: 0,
            held_most: 0,
            skipped_steps: 0,
            loss_scale: self.loss_scale,
            good_steps: 0,
            hf,
            lazy_grads: self.lazy_grads,
            stepping: false,
            adapters: self.adapters.clone(),
            trainable: self.trainable.clone(),
            tp,
            ep,
            widths: self.widths,
        };
        Some(e.alloc_workspace().map(|()| e))
    }
}

/// `&mut v[i]` and, when given, `&mut v[j]` (i != j).
fn pair_mut<X>(v: &mut [X], i: usize, j: Option<usize>) -> (&mut X, Option<&mut X>) {
    match j {
        None => (&mut v[i], None),
        Some(j) => {
            assert_ne!(i, j);
            if i < j {
                let (a, b) = v.split_at_mut(j);
                (&mut a[i], Some(&mut b[0]))
            } else {
                let (a, b) = v.split_at_mut(i);
                (&mut b[0], Some(&mut a[j]))
            }
        }
    }
}

impl<B: Backend> Engine<B> {
    /// Allocates and initialises the model on `be`, for one rank. Weights
    /// depend only on `train.seed` (one seeded stream per tensor), never on
    /// the backend or threads.
    pub fn new(
        model: ModelConfig,
        train: TrainConfig,
        be: B,
        capacity: Option<u64>,
    ) -> Result<Self, OomError> {
        Self::new_rank(model, train, be, capacity, None)
    }

    /// One rank of a data-parallel job of `train.ranks` ranks talking through
    /// `comm` (`None` for a single rank without sharding). Every rank starts
    /// from the weights a single-rank run starts from: each initialises them
    /// from the seed and keeps its shards; under ddp rank 0's weights are then
    /// broadcast, as PyTorch DDP does at construction.
    pub fn new_rank(
        model: ModelConfig,
        train: TrainConfig,
        be: B,
        capacity: Option<u64>,
        comm: Option<Comm<B>>,
    ) -> Result<Self, OomError> {
        Self::new_linked(model, train, be, capacity, Links::data(comm))
    }

    /// One rank of a job that may also be pipelined and tensor-parallel:
    /// `links.pipe` says which stage (`None` without a pipeline), `comm`
    /// links the rank to the other replicas of its stage, `tp` to the ranks
    /// it splits its blocks with (`tensor.rs`). A stage allocates only the
    /// tensors it holds, a tensor-parallel rank only its slices.
    pub fn new_linked(
        model: ModelConfig,
        train: TrainConfig,
        be: B,
        capacity: Option<u64>,
        links: Links<B>,
    ) -> Result<Self, OomError> {
        let mut e = Self::unshaped(model, train, be, capacity, links)?;
        e.alloc_workspace()?;
        Ok(e)
    }

    /// This rank's tensor- and expert-parallel groups, and its shapes in
    /// `specs`: tensor parallelism's slices, then expert parallelism's
    /// experts of those.
    #[allow(clippy::type_complexity)]
    fn split_groups(
        model: &ModelConfig,
        train: &TrainConfig,
        (specs, (idx, expert_ads)): (&mut [ParamSpec], (&ParamIndex, &[usize])),
        tp: Option<Comm<B>>,
        ep: Option<Comm<B>>,
    ) -> (Option<Tp<B>>, Option<expert::Ep<B>>) {
        let tp = tp.map(|comm| {
            assert_eq!(comm.world(), train.tensor_parallel, "one rank per split");
            let (size, rank) = (comm.world(), comm.rank());
            let splits = tensor::split_layout(model, specs, idx, size, rank);
            let sp = train.sequence_parallel;
            Tp { comm, splits, sp }
        });
        let ep = ep.map(|comm| {
            let (size, rank) = (comm.world(), comm.rank());
            let splits = expert::split_layout(specs, (idx, expert_ads), size, rank);
            let load = expert::ExpertLoad::default();
            expert::Ep { comm, splits, load }
        });
        (tp, ep)
    }

    /// [`Engine::new_linked`] but for the one tensor whose size depends on
    /// the batch's shape (micro-batch, attention kernel, checkpointing): the
    /// workspace, a placeholder until [`Engine::alloc_workspace`]. Nothing
    /// else it allocates reads those knobs, so a planner builds this once
    /// for the points that differ only there (`Engine::reshaped`).
    pub fn unshaped(
        model: ModelConfig,
        train: TrainConfig,
        be: B,
        capacity: Option<u64>,
        links: Links<B>,
    ) -> Result<Self, OomError> {
        let Links {
            comm,
            pipe,
            replicate,
            tp,
            hpz,
            ep,
        } = links;
        let (ep, mut edp) = match ep {
            Some([a, b]) => (Some(a), Some(b)),
            None => (None, None),
        };
        let mut model = model;
        let hf = (train.framework == Framework::HfEager).then(|| {
            // Hugging Face models do not pad the vocabulary.
            model.pad_vocab_to = 1;
            HfRules::new(&model, &train, be.is_gpu())
        });
        let lazy = hf.as_ref().is_some_and(|h| h.lazy_grads) || train.optimizer_in_backward;
        let lazy_grads = lazy && comm.is_none() && pipe.is_none();
        let (mut specs, idx) = model.param_layout();
        let base = specs.len();
        let adapters = Self::adapters(&model, &train, &be, pipe.is_some(), &mut specs);
        // Tensor parallelism: the full shapes seed the weights, each rank
        // keeps its slices.
        let full_specs = specs.clone();
        let expert_ads = lora::tensors(&adapters, true);
        let ids = (&idx, &expert_ads.concat()[..]);
        let (tp, ep) = Self::split_groups(&model, &train, (&mut specs, ids), tp, ep);
        let widths = tensor::widths(&model, tp.as_ref().map_or(1, Tp::size));
        let trainable: Vec<bool> = (0..specs.len())
            .map(|i| train.finetune == Finetune::Full || i >= base)
            .collect();
        let mut dev = Self::device(be, capacity, &train, hf.is_some());
        let owned = match &pipe {
            Some(p) => pipeline::owned_tensors(&idx, specs.len(), p.stage, p.stages, &p.chunks),
            None => vec![true; specs.len()],
        };
        let held = init::Holdings::new(&specs, owned, &trainable);
        let mut dist = comm.map(|c| {
            assert_eq!(
                c.world(),
                train.shard_ranks(),
                "one communicator rank per replica of the shard group"
            );
            let ads = lora::tensors(&adapters, false);
            let numel = held.numel.clone();
            let edp = edp.take();
            let ads = (&ads[..], &expert_ads[..]);
            let mut d = Dist::new(c, train.sharding, numel, &idx, (ads, &trainable), edp);
            d.grads_on_host = train.offload.optimizer();
            d
        });
        assert!(
            dist.is_some() || (train.data_ranks() == 1 && train.sharding == Sharding::None),
            "ranks > 1 or sharding need a communicator"
        );
        // hf-eager: autocast leaves the parameters fp32 (no master copy).
        let autocast = hf.as_ref().is_some_and(|h| h.autocast);
        let wdt = match autocast {
            true => DType::F32,
            false => train.precision.dtype(),
        };
        let lay = init::StateLayout {
            specs: &specs,
            idx: &idx,
            train: &train,
            wdt,
            autocast,
            lazy_grads,
        };
        let mut states = init::alloc_states(&mut dev, &held, dist.as_mut(), &lay)?;
        if let Some(d) = dist.as_mut().filter(|_| train.sharding == Sharding::Ddp) {
            d.alloc_buckets(&mut dev, wdt, train.bucket_view)?;
        }
        let workspace = dev.placeholder(DType::F32, Category::Workspace);
        if dev.be.holds_data() {
            let splits = init::layouts(tp.as_ref(), ep.as_ref());
            init::upload_weights(
                &mut dev,
                &full_specs,
                &train,
                &held,
                &splits,
                dist.as_mut(),
                &mut states,
            );
        }
        if let Some(d) = dist.as_mut().filter(|_| train.sharding == Sharding::Ddp) {
            // As PyTorch DDP does at construction.
            init::broadcast_weights(&mut dev, d, &held, &mut states.params);
        }
        let loss_scale = match train.precision {
            Precision::Fp16 => train.initial_loss_scale,
            _ => 1.0,
        };
        if let Some(rep) = replicate {
            dist.as_mut().expect("hybrid sharding shards").replicate = Some(rep);
        }
        if let Some(h) = hpz {
            dist.as_mut()
                .expect("hpZ partitions zero3's shards")
                .set_hpz(h);
        }
        if tp.is_some() {
            // Data-parallel groups are the ranks a tensor-parallel group apart.
            dev.meter.call_stride = train.tensor_parallel;
        }
        let init::States {
            params,
            grads,
            master,
            opt,
        } = states;
        Ok(Engine {
            model,
            train,
            dev,
            specs,
            idx,
            params,
            grads,
            master,
            opt,
            workspace,
            dist,
            pipe,
            owned: held.owned,
            step: 0,
            held_most: 0,
            skipped_steps: 0,
            loss_scale,
            good_steps: 0,
            hf,
            lazy_grads,
            stepping: false,
            adapters,
            trainable,
            tp,
            ep,
            widths,
        })
    }

    /// Dropless expert parallelism on meta: which routing to plan
    /// (`expert::ExpertLoad`); cpu routes for real.
    pub fn assume_expert_load(&mut self, load: expert::ExpertLoad) {
        if let Some(ep) = self.ep.as_mut() {
            ep.load = load;
        }
    }

    /// LoRA's adapters per block, their tensors appended to `specs` (none
    /// for full training).
    fn adapters(
        model: &ModelConfig,
        train: &TrainConfig,
        be: &B,
        pipelined: bool,
        specs: &mut Vec<ParamSpec>,
    ) -> Vec<Vec<Adapter>> {
        let qlora = train.finetune == Finetune::Qlora;
        assert!(
            !qlora || be.reads_nf4(),
            "this backend does not read NF4 weights (run::validate says so)"
        );
        match train.finetune {
            Finetune::Full => Vec::new(),
            Finetune::Lora | Finetune::Qlora => {
                assert!(!pipelined, "LoRA runs without a pipeline");
                assert!(
                    !(qlora && train.sharding.shards_parameters()),
                    "QLoRA's NF4 base is not partitioned by zero3 (run::validate says so)"
                );
                lora::layout(model, &train.lora, specs)
            }
        }
    }

    /// The rank's device: its host memory when the optimizer is offloaded,
    /// and (hf-eager on a GPU) PyTorch's caching allocator's model.
    fn device(be: B, capacity: Option<u64>, train: &TrainConfig, hf: bool) -> Device<B> {
        let gpu = be.is_gpu();
        let mut dev = Device::new(be, capacity);
        let offload = train.offload;
        assert!(
            offload.check(train.sharding).is_none(),
            "offload without the ZeRO stage it needs (run::validate says so)"
        );
        if train.uses_host() {
            assert!(
                dev.be.offloads(),
                "this backend cannot place tensors in host memory (run::validate says so)"
            );
            dev.add_host(train.host_memory);
        }
        if train.optimizer.is_paged() {
            dev.add_paged();
        }
        if hf && gpu {
            // What PyTorch's CUDA caching allocator reserves for these tensors.
            dev.caching = Some(crate::caching::CachingAllocator::new());
        }
        dev.tracker.set_phase(Phase::Init);
        dev
    }

    /// Allocates the workspace for this engine's batch shape (a placeholder
    /// until then: [`Engine::unshaped`]).
    pub fn alloc_workspace(&mut self) -> Result<(), OomError> {
        assert_eq!(self.workspace.len, 0, "the workspace is allocated once");
        // hf-eager's autocast keeps fp32 weights, and the workspace with them.
        let wdt = match self.hf.as_ref().is_some_and(|h| h.autocast) {
            true => DType::F32,
            false => self.train.precision.dtype(),
        };
        let shape = attn_shape(&self.model, &self.train);
        let fused = self.train.attention.fused();
        let bytes = self.dev.be.workspace_bytes(shape, fused, wdt);
        let ws = self.dev.alloc_f32(bytes.div_ceil(4), Category::Workspace)?;
        let placeholder = std::mem::replace(&mut self.workspace, ws);
        self.dev.drop_placeholder(placeholder);
        Ok(())
    }

    pub fn param_specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    pub fn tokens_per_step(&self) -> usize {
        self.train.micro_batch * self.train.seq_len * self.train.grad_accum
    }

    /// The parameters on the host, one vector per tensor (`None` on meta).
    pub fn params_host(&self) -> Option<Vec<Vec<f32>>> {
        self.params
            .iter()
            .map(|t| self.dev.be.download_f32(&t.buf))
            .collect()
    }

    pub fn grads_host(&self) -> Option<Vec<Vec<f32>>> {
        self.grads
            .iter()
            .map(|t| self.dev.be.download_f32(&t.buf))
            .collect()
    }

    /// The fp32 master weights under mixed precision (`None` on meta or for fp32).
    pub fn master_host(&self) -> Option<Vec<Vec<f32>>> {
        if self.master.is_empty() {
            return None;
        }
        self.master
            .iter()
            .map(|t| self.dev.be.download_f32(&t.buf))
            .collect()
    }

    /// Replaces the parameters (tests and checkpoints); shapes must match.
    /// Under mixed precision the master copy gets `host` exactly and the
    /// working copy its rounding.
    pub fn set_params_host(&mut self, host: &[Vec<f32>]) {
        assert_eq!(host.len(), self.params.len());
        for (t, h) in self.params.iter_mut().zip(host) {
            assert_eq!(t.len, h.len());
            self.dev.be.upload_f32(&mut t.buf, h);
        }
        for (t, h) in self.master.iter_mut().zip(host) {
            self.dev.be.upload_f32(&mut t.buf, h);
        }
    }

    /// fp16's current loss scale (`None` for fp32 and bf16, which need none).
    pub fn loss_scale(&self) -> Option<f32> {
        (self.train.precision == Precision::Fp16).then_some(self.loss_scale)
    }

    /// Sets fp16's loss scale (tests plant an overflow with a huge one).
    pub fn set_loss_scale(&mut self, scale: f32) {
        self.loss_scale = scale;
        self.good_steps = 0;
    }

    fn zero_grads(&mut self) {
        // optimizer.zero_grad(): once per step, priced with the optimizer phase.
        self.dev.tracker.set_phase(Phase::Optimizer);
        if self.lazy_grads {
            // set_to_none: the backward makes them again.
            release_grads(&mut self.dev, &mut self.grads);
            return;
        }
        let grads = match &mut self.dist {
            // The full gradients are allocated zeroed, unit by unit.
            Some(d) if d.sharding.shards_gradients() => &mut d.grad_shards,
            _ => &mut self.grads,
        };
        for (g, _) in grads.iter_mut().zip(&self.owned).filter(|(_, o)| **o) {
            self.dev.fill(g, 0.0);
        }
    }

    /// Data-parallel replicas in the job (1 without data parallelism).
    pub fn world(&self) -> usize {
        self.dist.as_ref().map_or(1, |d| {
            d.world * d.replicate.as_ref().map_or(1, |r| r.world())
        })
    }

    /// This rank's pipeline stage and its chunks' block ranges (one chunk
    /// without virtual stages; `None` without a pipeline).
    pub fn stage(&self) -> Option<pipeline::Place> {
        self.pipe.as_ref().map(|p| (p.stage, p.chunks.clone()))
    }

    /// How tensor parallelism split tensor `i` on this rank (`None`:
    /// replicated, or no tensor parallelism).
    pub fn tp_split(&self, i: usize) -> Option<&tensor::Split> {
        self.tp.as_ref().and_then(|tp| tp.splits[i].as_ref())
    }

    /// Whether this rank holds tensor `i` (pipeline stages hold their own layers').
    pub fn holds(&self, i: usize) -> bool {
        self.owned[i]
    }

    /// This rank's shard of every weight under zero3 (`None` otherwise or on meta).
    pub fn param_shards_host(&self) -> Option<Vec<Vec<f32>>> {
        let d = self
            .dist
            .as_ref()
            .filter(|d| d.sharding.shards_parameters())?;
        d.param_shards
            .iter()
            .map(|t| self.dev.be.download_f32(&t.buf))
            .collect()
    }

    /// Elements of tensor `i` rank `r` owns under sharding, from offset `r * shard`:
    /// `(shard, owned)`.
    pub fn shard_extent(&self, i: usize, r: usize) -> Option<(usize, usize)> {
        self.dist.as_ref().map(|d| (d.shard[i], d.valid(i, r)))
    }

    fn attn_shape(&self) -> AttnShape {
        attn_shape(&self.model, &self.train)
    }

    /// The most micro-batches whose activations the last step held at
    /// once (micro-batches of one chunk each, with virtual stages): what
    /// the schedule lets a stage hold ([`Schedule::in_flight`]).
    pub fn held_micro_batches(&self) -> usize {
        self.held_most
    }

    /// Optimizer steps skipped so far because the gradient was not finite.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped_steps
    }

    /// One optimizer step over `batches.len()` micro-batches (gradient accumulation).
    pub fn step(&mut self, batches: &[Batch]) -> Result<StepReport, OomError> {
        let mut it = batches.iter();
        self.step_from(batches.len(), || {
            it.next().expect("one batch per micro-batch").clone()
        })
    }

    /// One optimizer step over `k` micro-batches, each fetched from `next` only
    /// once its token buffers are allocated (so an oversized batch is a tracked
    /// OOM, not a host allocation failure) and never on a backend without data.
    pub fn step_from(
        &mut self,
        k: usize,
        mut next: impl FnMut() -> Batch,
    ) -> Result<StepReport, OomError> {
        self.zero_grads();
        if self.train.optimizer_in_backward {
            // The backward takes this step, unit by unit.
            self.step += 1;
            self.stepping = true;
        }
        let mut loss_sum = Some(0.0f64);
        // d(mean over k micro-batches of the mean over n tokens) / d(token
        // loss), times fp16's loss scale (1 otherwise) and summed over
        // replicas: every replica scales by 1/replicas, the collectives add
        let tokens = self.train.micro_batch * self.train.seq_len * k * self.world();
        let dloss = self.loss_scale / tokens as f32;
        // One stage: forward, backward, one micro-batch after another (not
        // a list: a planner's step may be 2^40 micro-batches, fast-forwarded).
        let ops: Box<dyn Iterator<Item = pipeline::Op>> = match &self.pipe {
            Some(p) => {
                let v = p.chunks.len();
                Box::new(p.schedule.ops(p.stage, p.stages, v, k).into_iter())
            }
            None => Box::new(
                (0..k).flat_map(|i| [pipeline::Op::Forward(i, 0), pipeline::Op::Backward(i, 0)]),
            ),
        };
        // Micro-batches forwarded and not yet backwarded, oldest first, per
        // chunk of this rank (each chunk runs its micro-batches in order).
        let chunks = self.pipe.as_ref().map_or(1, |p| p.chunks.len());
        let mut in_flight: Vec<std::collections::VecDeque<_>> =
            (0..chunks).map(|_| Default::default()).collect();
        // A planner's device fast-forwards: once a micro-batch ends in the
        // state it started from, every later one would repeat it exactly,
        // so their counts are added and they are not run (a step of 64
        // micro-batches plans as two or three). With a pipeline, stages
        // interleave micro-batches and each runs them all.
        //
        // Under the caching-allocator model the first micro-batch is not
        // compared with the step's start: a plan steps a new engine, whose
        // allocator holds no activation segments yet, so that state does
        // not come back, and its snapshot (a copy of the allocator's
        // arrays) cost a plan more than the rare micro-batch it could save.
        // Whether a micro-batch is fast-forwarded never changes what is
        // counted, only how fast.
        let fast = self.dev.be.planning() && self.pipe.is_none() && !tests_run_every_micro_batch();
        let mut before = (fast && self.dev.caching.is_none()).then(|| self.dev.between());
        let (mut done, mut skip) = (0, false);
        self.held_most = 0;
        for op in ops {
            if skip {
                break;
            }
            match op {
                pipeline::Op::Forward(_, c) => {
                    self.run_chunk(c);
                    let acts = self.forward(&mut next, dloss)?;
                    if self.pipe.as_ref().is_none_or(Pipe::last) {
                        let loss = self.read_loss(&acts);
                        loss_sum = loss_sum.zip(loss).map(|(s, l)| s + l as f64);
                    } else if let Some(aux) = acts.aux {
                        // An earlier chunk's routed blocks: their part of
                        // the loss, summed over the stages below.
                        loss_sum = loss_sum.map(|s| s + aux);
                    }
                    in_flight[c].push_back(acts);
                    let held = in_flight.iter().map(|q| q.len()).sum();
                    self.held_most = self.held_most.max(held);
                }
                pipeline::Op::Backward(_, c) => {
                    self.run_chunk(c);
                    let acts = in_flight[c]
                        .pop_front()
                        .expect("forwarded before backwarded");
                    self.backward(acts, dloss)?;
                    done += 1;
                    if fast && done < k {
                        let b = self.dev.between();
                        if let Some(a) = &before
                            && a.returns_to_itself(&b)
                        {
                            self.dev.repeat(a, &b, k - done);
                            skip = true;
                        }
                        before = Some(b);
                    }
                }
            }
        }
        if let Some(p) = &mut self.pipe {
            // Only the last stage computed the loss; every stage reports it.
            loss_sum = loss_sum.map(|s| p.group.all_reduce_scalar(s));
        }
        self.stepping = false;
        let (grad_norm, skipped) = match self.train.optimizer_in_backward {
            // Taken in the backward, with no global norm (torchtune's
            // recipe reports none either).
            true => (None, false),
            false => self.optimizer_step()?,
        };
        if self.lazy_grads {
            // zero_grad(set_to_none=True) after the update.
            release_grads(&mut self.dev, &mut self.grads);
        }
        // A GPU queues work: the step ends when its last kernel does, so
        // the caller's step time is the device's.
        self.dev.be.synchronize();
        Ok(StepReport {
            loss: loss_sum.map(|s| (s / k as f64) as f32),
            grad_norm,
            skipped,
        })
    }

    /// Points a pipeline stage at its chunk `c` for the next forward or
    /// backward (a rank without virtual stages has only chunk 0).
    fn run_chunk(&mut self, c: usize) {
        if let Some(p) = &mut self.pipe {
            p.chunk = c;
        }
    }

    /// Forward and backward without an optimizer step: fills the gradients and
    /// returns the loss (gradient checks).
    pub fn compute_grads(&mut self, batch: &Batch) -> Result<Option<f32>, OomError> {
        self.zero_grads();
        let dloss = 1.0 / (self.train.micro_batch * self.train.seq_len) as f32;
        let acts = self.forward(&mut || batch.clone(), dloss)?;
        let loss = self.read_loss(&acts);
        self.backward(acts, dloss)?;
        Ok(loss)
    }

    /// Forward only: the mean loss over the batch.
    pub fn eval_loss(&mut self, batch: &Batch) -> Result<Option<f32>, OomError> {
        // A fused loss makes gradients nobody reads: scaled by 0.
        let acts = self.forward(&mut || batch.clone(), 0.0)?;
        let loss = self.read_loss(&acts);
        self.free_acts(acts);
        Ok(loss)
    }

    /// The micro-batch's mean token loss, plus its routed blocks'
    /// load-balancing losses.
    fn read_loss(&self, acts: &Acts<T<B>>) -> Option<f32> {
        let losses = self.dev.be.download_f32(&acts.head.as_ref()?.losses.buf)?;
        let sum: f64 = losses.iter().map(|&l| l as f64).sum();
        Some((sum / losses.len() as f64 + acts.aux.unwrap_or(0.0)) as f32)
    }

    fn free_acts(&mut self, acts: Acts<T<B>>) {
        let dev = &mut self.dev;
        for a in acts.blocks.into_iter().rev() {
            free_saved(dev, a);
        }
        for x in acts.resid.into_iter().rev() {
            dev.free(x);
        }
        dev.free_opt(acts.tokens);
        dev.free_opt(acts.targets);
        for t in acts.extra {
            dev.free(t);
        }
        dev.free_opt(acts.mask);
        if let Some(h) = acts.head {
            let loss: Vec<T<B>> = match h.loss {
                LossActs::Logits { parts, lse } => parts
                    .into_iter()
                    .flat_map(|x| {
                        [Some(x.logits), x.input, x.targets]
                            .into_iter()
                            .flatten()
                            .chain(x.extra)
                    })
                    .chain(lse)
                    .collect(),
                LossActs::Fused(f) => std::iter::once(f.dx).chain(f.dw).collect(),
            };
            for t in [h.lnf_rstd, h.losses]
                .into_iter()
                .chain(h.lnf)
                .chain(h.extra)
                .chain(loss)
            {
                dev.free(t);
            }
            dev.free_opt(h.lnf_mean);
        }
    }

    /// Forward pass of one micro-batch (`step.rs`). `dloss` scales each
    /// token's loss gradient, for a fused loss that makes its gradients here.
    fn forward(
        &mut self,
        next: &mut dyn FnMut() -> Batch,
        dloss: f32,
    ) -> Result<Acts<T<B>>, OomError> {
        step::Pass::new(self).forward(next, dloss)
    }

    /// Backward pass (`step.rs`); gradients accumulate into `self.grads`.
    /// Frees `acts` as it goes.
    fn backward(&mut self, acts: Acts<T<B>>, dloss: f32) -> Result<(), OomError> {
        step::Pass::new(self).backward(acts, dloss)
    }

    /// Unscales (fp16), clips by global norm, then one optimizer update.
    /// Returns the norm before clipping, and whether the update was skipped (a
    /// non-finite gradient: the parameters and optimizer state stay as they
    /// were, and under fp16 the loss scale halves, as PyTorch's `GradScaler`
    /// and DeepSpeed's dynamic loss scaler do). Data parallelism first sums
    /// the gradients over ranks (ddp, zero1; zero2/3 did it during backward).
    fn optimizer_step(&mut self) -> Result<(Option<f32>, bool), OomError> {
        self.dev.tracker.set_phase(Phase::Optimizer);
        // LoRA: only the adapters train.
        let owned: Vec<bool> = (self.owned.iter().zip(&self.trainable))
            .map(|(&o, &t)| o && t)
            .collect();
        let fp16 = self.train.precision == Precision::Fp16;
        self.sum_grads(&owned)?;
        // The gradients carry the loss scale (1 except under fp16).
        let norm = self
            .grad_norm_sq(&owned)
            .map(|s| s.sqrt() / self.loss_scale as f64);
        if norm.is_some_and(|n| !n.is_finite()) {
            self.skipped_steps += 1;
            if fp16 {
                self.loss_scale *= 0.5;
                self.good_steps = 0;
            }
            if let Some(d) = self.dist.as_mut()
                && d.sharding == Sharding::Zero1
            {
                d.drop_grad_shards(&mut self.dev);
            }
            return Ok((norm.map(|n| n as f32), true));
        }
        // Same rule as torch.nn.utils.clip_grad_norm_: scale by clip / (norm + 1e-6) when norm > clip.
        let clip = self.train.grad_clip as f64;
        let clip = match norm {
            Some(norm) if clip > 0.0 && norm > clip => clip / (norm + 1e-6),
            _ => 1.0,
        };
        // Unscaling and clipping fold into one multiplier the update applies.
        let grad_scale = (clip / self.loss_scale as f64) as f32;
        self.step += 1;
        let Engine {
            dev,
            params,
            grads,
            master,
            opt,
            specs,
            train,
            dist,
            hf,
            ..
        } = self;
        let cfg = train.opt();
        match dist.as_mut() {
            Some(d) if d.sharding.shards_optimizer() => {
                let step = (self.step, grad_scale);
                sharded_update(dev, d, params, master, opt, specs, &owned, &cfg, step)?;
                if d.sharding == Sharding::Zero1 {
                    d.drop_grad_shards(dev);
                }
            }
            _ => {
                // hf-eager: torch.optim's order and temporaries.
                let torch = hf.as_ref().map(|h| (h.optimizer_impl, h.param_groups));
                let states = (&mut params[..], &mut master[..], &mut opt[..], &grads[..]);
                let step = (self.step, grad_scale);
                let ids: Vec<usize> = (0..specs.len()).filter(|&i| owned[i]).collect();
                local_update(dev, states, specs, &ids, &cfg, torch, step)?;
            }
        }
        if fp16 {
            self.good_steps += 1;
            if self.good_steps >= self.train.loss_scale_window {
                self.loss_scale *= 2.0;
                self.good_steps = 0;
            }
        }
        Ok((norm.map(|n| n as f32), false))
    }

    /// Every rank's gradients summed where the update needs them: a tied
    /// embedding's two stages, the replicas (ddp all-reduces, zero1
    /// reduce-scatters; zero2/3 did it during the backward), hybrid
    /// sharding's replicas, and sequence parallelism's norms.
    fn sum_grads(&mut self, owned: &[bool]) -> Result<(), OomError> {
        let Engine {
            dev,
            grads,
            train,
            dist,
            pipe,
            idx,
            tp,
            ..
        } = self;
        // A tied embedding: the first and the last stage each hold part of
        // its gradient (the embedding's, the head's).
        if let Some(e) = pipe.as_mut().and_then(|p| p.embed.as_mut()) {
            // The first and the last stage: (S-1) stages of D x T ranks apart.
            let apart = (train.pipeline_stages.max(1) - 1)
                * train.data_ranks()
                * train.tensor_parallel.max(1);
            dev.with_stride(apart.max(1), |dev| {
                dev.all_reduce(&mut **e, &mut grads[idx.wte])
            });
        }
        // DDP's and ZeRO-1's reductions, and hybrid sharding's between
        // replicas: the engine runs them after the last backward, the
        // frameworks bucket by bucket during it (what the planner prices).
        dev.after_backward(|dev| -> Result<(), OomError> {
            match dist.as_mut() {
                Some(d) if d.sharding == Sharding::Ddp => d.all_reduce_grads(dev, grads),
                Some(d) if d.sharding == Sharding::Zero1 => d.scatter_full_grads(dev, grads)?,
                _ => {}
            }
            if let Some(d) = dist.as_mut() {
                d.all_reduce_replicas(dev, owned);
            }
            Ok(())
        })?;
        let sharded = dist.as_ref().is_some_and(|d| d.sharding.shards_optimizer());
        // Sequence parallelism: each rank's norms saw only its tokens, so
        // their gradients (whole or sharded alike) are summed over the
        // group, as Megatron all-reduces them before the step. The per-head
        // q and k norms saw only this rank's heads, so theirs are summed
        // too, with or without it (Megatron-Core's `finalize_model_grads`
        // all-reduces `q_layernorm` and `k_layernorm` likewise).
        if let Some(tp) = tp.as_mut() {
            let sp = tp.sp;
            let norms: Vec<usize> = idx
                .blocks
                .iter()
                .flat_map(|b| {
                    let ln = [Some(b.ln1_w), b.ln1_b, Some(b.ln2_w), b.ln2_b];
                    ln.into_iter()
                        .filter(move |_| sp)
                        .chain([b.q_norm, b.k_norm])
                })
                .chain([Some(idx.lnf_w), idx.lnf_b].into_iter().filter(|_| sp))
                .flatten()
                .filter(|&i| owned[i])
                .collect();
            let local = match dist.as_mut() {
                Some(d) if sharded => &mut d.grad_shards,
                _ => &mut *grads,
            };
            for i in norms {
                tp.all_reduce(dev, &mut local[i]);
            }
        }
        Ok(())
    }

    /// The squared global gradient norm over every rank's gradients (or
    /// shards), still carrying the loss scale; `None` without data.
    fn grad_norm_sq(&mut self, owned: &[bool]) -> Option<f64> {
        let Engine {
            dev,
            grads,
            dist,
            pipe,
            idx,
            tp,
            ep,
            ..
        } = self;
        let sharded = dist.as_ref().is_some_and(|d| d.sharding.shards_optimizer());
        let mut norm_sq = Some(0.0f64);
        let local = match dist.as_ref() {
            Some(d) if sharded => &d.grad_shards,
            _ => &*grads,
        };
        // The last stage's copy of a tied embedding counts once, on the first.
        let counted =
            |i: usize| owned[i] && !(pipe.as_ref().is_some_and(|p| p.stage > 0) && i == idx.wte);
        // Tensor parallelism: the slices of a split tensor add up over the
        // group; a replicated one is the same on every rank and counts once.
        let mut split_sq = Some(0.0f64);
        // Expert parallelism, unsharded: each rank's experts are its own
        // (sharded, the all-reduce below already adds every rank's shards).
        // With both, an expert's slice is its own at each tensor-parallel
        // position and expert-parallel rank: summed over the one group,
        // then with the other split tensors over the other.
        let mut expert_sq = Some(0.0f64);
        for (i, g) in local.iter().enumerate() {
            if counted(i) {
                let sum = match () {
                    _ if !sharded && ep.as_ref().is_some_and(|e| e.splits[i].is_some()) => {
                        &mut expert_sq
                    }
                    _ if tp.as_ref().is_some_and(|tp| tp.splits[i].is_some()) => &mut split_sq,
                    _ => &mut norm_sq,
                };
                *sum = sum.zip(dev.sum_squares(g)).map(|(a, b)| a + b);
            }
        }
        if let Some(ep) = ep.as_mut() {
            expert_sq = expert_sq.map(|s| ep.comm.all_reduce_scalar(s));
        }
        match tp.as_mut() {
            // Under tensor parallelism every expert tensor is split too.
            Some(tp) => {
                split_sq = split_sq.zip(expert_sq).map(|(a, b)| a + b);
                split_sq = split_sq.map(|s| tp.comm.all_reduce_scalar(s));
            }
            None => split_sq = split_sq.zip(expert_sq).map(|(a, b)| a + b),
        }
        norm_sq = norm_sq.zip(split_sq).map(|(a, b)| a + b);
        if let Some(d) = dist.as_mut()
            && sharded
        {
            // Each rank holds a disjoint shard: the global norm needs them all.
            norm_sq = norm_sq.map(|s| d.comm.all_reduce_scalar(s));
        }
        if let Some(p) = pipe.as_mut() {
            // And each stage its own layers.
            norm_sq = norm_sq.map(|s| p.group.all_reduce_scalar(s));
        }
        norm_sq
    }

    /// Frees everything the engine holds; the tracker then shows zero live bytes.
    pub fn release(mut self) -> Device<B> {
        let mut dev = self.dev;
        for t in self
            .params
            .drain(..)
            .chain(self.grads.drain(..))
            .chain(self.master.drain(..))
        {
            dev.free(t);
        }
        optim::free_state(&mut dev, std::mem::take(&mut self.opt));
        dev.free(self.workspace);
        if let Some(d) = self.dist.take() {
            d.release_all(&mut dev);
        }
        dev
    }
}

/// The optimizer step when every rank holds whole states (one rank, or
/// ddp's replicas): mixed precision updates the fp32
/// master copy, then rounds it into the 16-bit weights the next forward
/// reads. hf-eager (`torch`): torch.optim updates one parameter group after
/// another, with AdamW's own temporaries (`OptimizerImpl`). `ids`: the
/// tensors to update, in order (every trainable one this rank holds, or
/// one unit's with the optimizer in the backward).
#[allow(clippy::type_complexity)]
fn local_update<B: Backend>(
    dev: &mut Device<B>,
    (params, master, opt, grads): (&mut [T<B>], &mut [T<B>], &mut [OptState<T<B>>], &[T<B>]),
    specs: &[ParamSpec],
    ids: &[usize],
    cfg: &optim::OptConfig,
    torch: Option<(OptimizerImpl, ParamGroups)>,
    (step, grad_scale): (u64, f32),
) -> Result<(), OomError> {
    let updated = if master.is_empty() {
        &mut *params
    } else {
        &mut *master
    };
    let torch_impl = torch
        .filter(|_| cfg.kind == Optimizer::Adamw)
        .map(|(i, _)| i);
    let groups: Vec<Vec<usize>> = match torch.map(|(_, g)| g) {
        Some(ParamGroups::Trainer) => {
            let (decay, rest) = ids.iter().partition(|&&i| specs[i].shape.len() >= 2);
            vec![decay, rest]
        }
        _ => vec![ids.to_vec()],
    };
    for group in groups {
        // The temporaries are in the state's dtype (torch's
        // `exp_avg_sq.sqrt()`): fp32, or bf16 under pure bf16, which
        // updates the bf16 weights themselves.
        let mut foreach = Vec::new();
        if torch_impl == Some(OptimizerImpl::Foreach) {
            for &i in &group {
                let t = &updated[i];
                foreach.push(dev.alloc(t.len, t.dtype, Category::Optimizer)?);
            }
        }
        let mut denom = None;
        for i in group {
            if torch_impl == Some(OptimizerImpl::SingleTensor) {
                let (len, dt) = (updated[i].len, updated[i].dtype);
                let sqrt = dev.alloc(len, dt, Category::Optimizer)?;
                let div = dev.alloc(len, dt, Category::Optimizer)?;
                dev.free(sqrt);
                dev.free_opt(denom.replace(div));
            }
            let (u, g, st) = (&mut updated[i], &grads[i], &mut opt[i]);
            optim::update_one(dev, u, g, st, &specs[i], cfg, step, grad_scale);
        }
        dev.free_opt(denom);
        for t in foreach {
            dev.free(t);
        }
    }
    if !master.is_empty() {
        for &i in ids {
            dev.convert(&mut params[i], &master[i]);
        }
    }
    Ok(())
}

/// The optimizer step when the state is sharded (zero1/2/3): each rank
/// updates its shard of every tensor, then zero1/2 all-gather the new weights
/// (the full weights stay resident), and zero3 keeps only its shard.
fn sharded_update<B: Backend>(
    dev: &mut Device<B>,
    d: &mut Dist<B>,
    params: &mut [T<B>],
    master: &mut [T<B>],
    opt: &mut [OptState<T<B>>],
    specs: &[ParamSpec],
    owned: &[bool],
    cfg: &optim::OptConfig,
    (step, grad_scale): (u64, f32),
) -> Result<(), OomError> {
    let tmp = Category::Temporaries;
    for (i, spec) in specs.iter().enumerate().filter(|(i, _)| owned[*i]) {
        let (s, own, off, world) = (d.shard[i], d.own(i), d.offset(i), d.world_of(i));
        let wdt = if d.sharding.shards_parameters() {
            d.param_shards[i].dtype
        } else {
            params[i].dtype
        };
        // What the update writes: the fp32 master shard, zero3's own weight
        // shard, or (fp32 zero1/2) the owned slice of the full weight.
        let mut slice = None;
        if master.is_empty() && !d.sharding.shards_parameters() {
            let mut t = dev.alloc(s, wdt, tmp)?;
            dev.copy_slice(&mut t, 0, &params[i], off, own, false);
            slice = Some(t);
        }
        {
            let g = &d.grad_shards[i];
            let target = match slice.as_mut() {
                Some(t) => t,
                None if !master.is_empty() => &mut master[i],
                None => &mut d.param_shards[i],
            };
            optim::update_one(dev, target, g, &mut opt[i], spec, cfg, step, grad_scale);
        }
        if d.sharding.shards_parameters() {
            if !master.is_empty() {
                dev.convert(&mut d.param_shards[i], &master[i]);
            }
            continue;
        }
        // zero1/2: every rank needs every weight back.
        let send = match slice {
            Some(t) => t,
            None => {
                let mut t = dev.alloc(s, wdt, tmp)?;
                dev.convert(&mut t, &master[i]);
                t
            }
        };
        let mut recv = dev.alloc(s * world, wdt, Category::Communication)?;
        d.all_gather_param(dev, i, &mut recv, &send);
        dev.free(send);
        dev.copy_pieces(&mut params[i], &recv, world, d.numel[i], false, |r| {
            (r * s, r * s, d.valid(i, r))
        });
        dev.free(recv);
    }
    Ok(())
}

/// A unit hook, as the backward pass gives it to [`head_backward`].
type HeadHook<'a, B> =
    dyn FnMut(&mut Device<B>, &mut Vec<T<B>>, &mut Vec<T<B>>, bool) -> Result<(), OomError> + 'a;

/// The loss, head and final norm backward, on the last stage: frees what the
/// head saved and returns the gradient of the residual stream `x` that fed it.
/// `dims` is `(n, c, vocab, padded vocab)`.
fn head_backward<B: Backend>(
    dev: &mut Device<B>,
    p: &mut Vec<T<B>>,
    g: &mut Vec<T<B>>,
    idx: &ParamIndex,
    h: HeadActs<T<B>>,
    targets: T<B>,
    x: &T<B>,
    dloss: f32,
    (n, c, v, vp): (usize, usize, usize, usize),
    (mut tp, vocab): (Option<&mut Tp<B>>, (usize, usize, usize)),
    mut hf: Option<HfHead<'_, B>>,
    (frozen, scratch): (bool, &mut NormScratch<B>),
    (offset, cap): (bool, Option<f32>),
    hook: &mut HeadHook<'_, B>,
) -> Result<T<B>, OomError> {
    let tmp = Category::Temporaries;
    let dt = x.dtype;
    let HeadActs {
        lnf,
        lnf_mean,
        lnf_rstd,
        loss,
        losses,
        mut extra,
    } = h;
    dev.tracker.set_phase(Phase::BackwardHead);
    hook(dev, p, g, false)?;
    dev.free(losses);
    let dlnf = match loss {
        LossActs::Fused(f) => {
            dev.free(targets);
            fused_head_grads(dev, g, idx, f.dw, hf.as_mut())?;
            let mut dx = f.dx;
            dev.retag(&mut dx, tmp);
            dx
        }
        LossActs::Logits { mut parts, lse } if parts.len() == 1 && parts[0].input.is_none() => {
            let part = parts.pop().expect("one part");
            let lnf = lnf.as_ref().expect("the full loss keeps the head's input");
            full_head_backward(
                dev,
                (p, g, idx),
                part,
                (lse, targets),
                lnf,
                dloss,
                (n, c, v, vp),
                (tp.as_deref_mut(), vocab),
                hf.as_mut(),
                (frozen, cap),
            )?
        }
        LossActs::Logits { parts, .. } => chunked_head_backward(
            dev,
            (p, g, idx),
            parts,
            targets,
            dloss,
            (n, c, v, vp, dt),
            hf.as_mut(),
            (frozen, cap),
        )?,
    };
    // Each rank's columns of the head saw the whole input: its gradient is
    // the sum over the group (this rank's tokens of it under sequence
    // parallelism).
    let nl = tp.as_ref().map_or(n, |tp| tp.rows(n));
    let dlnf = reduce(dev, tp, dlnf)?;
    let mut dres = dev.alloc(nl * c, dt, tmp)?;
    // What the norm saved to the host comes back for its backward.
    for t in extra.iter_mut() {
        move_tensor(dev, t, false)?;
    }
    let (dw, db) = norm_grads(g, scratch, idx.lnf_w, idx.lnf_b);
    dev.norm_backward(
        &mut dres,
        dw,
        db,
        &dlnf,
        x,
        &p[idx.lnf_w],
        lnf_mean.as_ref(),
        &lnf_rstd,
        nl,
        c,
        offset,
    );
    for x in [dlnf, lnf_rstd].into_iter().chain(lnf).chain(extra) {
        dev.free(x);
    }
    dev.free_opt(lnf_mean);
    hook(dev, p, g, true)?;
    Ok(dres)
}

/// The whole logits' loss and head backward (`--loss full`): the logits
/// buffer becomes its own gradient, then the head's input and weight
/// gradients. Returns the gradient of the head's input (this rank's part
/// of the sum under tensor parallelism).
fn full_head_backward<B: Backend>(
    dev: &mut Device<B>,
    (p, g, idx): (&mut [T<B>], &mut [T<B>], &ParamIndex),
    part: LogitsPart<T<B>>,
    (lse, targets): (Option<T<B>>, T<B>),
    lnf: &T<B>,
    dloss: f32,
    (n, c, v, vp): (usize, usize, usize, usize),
    (tp, (lo, vl, vpl)): (Option<&mut Tp<B>>, (usize, usize, usize)),
    mut hf: Option<&mut HfHead<'_, B>>,
    (frozen, cap): (bool, Option<f32>),
) -> Result<T<B>, OomError> {
    let tmp = Category::Temporaries;
    let dt = lnf.dtype;
    let (mut logits, loss_extra) = (part.logits, part.extra);
    dev.charge_unfused(loss::UNFUSED_OP, part.unfused);
    // hf-eager: nll_loss_backward's dense gradient, then
    // _log_softmax_backward_data's, both alive with the saved log_softmax
    // output; then the first and the saved output go and the engine's
    // buffer (now the logits' gradient) is a temporary.
    let loss_grads = match &hf {
        Some(h) => alloc_rows(dev, &h.rules.loss_grads, n, tmp)?,
        None => Vec::new(),
    };
    match lse {
        None => dev.crossentropy_backward_capped(&mut logits, &targets, dloss, (n, v, vp), cap),
        Some(lse) => {
            let part = (lo, vl, vpl);
            dev.crossentropy_part_backward(&mut logits, &lse, &targets, dloss, n, part);
            dev.free(lse);
        }
    }
    for t in loss_grads.into_iter().chain(loss_extra) {
        dev.free(t);
    }
    // Megatron's unfused loss: autograd casts the Function's fp32
    // gradient to the logits' type, a new tensor, before the copy goes.
    if logits.dtype != dt {
        let mut cast = dev.alloc(logits.len, dt, tmp)?;
        dev.convert(&mut cast, &logits);
        dev.free(std::mem::replace(&mut logits, cast));
    }
    if hf.is_some() {
        dev.retag(&mut logits, tmp);
    }
    dev.free(targets);
    let head = idx.lm_head.unwrap_or(idx.wte);
    let tied = idx.lm_head.is_none();
    // hf-eager: autograd makes the head's weight gradient (hf_head_grad).
    // Autocast: the matmul read the weight's 16-bit cast, so its weight
    // gradient is 16-bit, and the cast's backward (ToCopyBackward) makes
    // the fp32 one from it once the matmul's node has run and released the
    // logits' gradient (as the chunked loss's, below).
    let autocast = hf
        .as_ref()
        .is_some_and(|h| h.rules.autocast && h.trainable[head]);
    let (mut cast, mut incoming) = (None, None);
    if let Some(h) = hf.as_mut().filter(|h| h.lazy) {
        hf_norm_grads(dev, g, h, idx)?;
    }
    match hf.as_mut() {
        Some(h) if autocast => cast = Some(dev.alloc(h.specs[head].numel(), dt, tmp)?),
        Some(h) => incoming = hf_head_grad(dev, g, h, head, tied)?,
        None => {}
    }
    let mut dlnf = dev.alloc(n * c, dt, tmp)?;
    let gathered = gather(dev, tp, lnf)?;
    let inp = gathered.as_ref().unwrap_or(lnf);
    let dw = match frozen {
        true => None,
        false => Some(&mut g[head]),
    };
    dev.matmul_backward(&mut dlnf, dw, None, &logits, inp, &p[head], n, c, vpl);
    dev.free_opt(gathered);
    dev.free(logits);
    if let (Some(h), Some(cast)) = (hf.as_mut(), cast) {
        incoming = hf_head_grad(dev, g, h, head, tied)?;
        dev.free(cast);
    }
    if let Some(h) = hf.filter(|_| !tied) {
        if h.lazy && h.trainable[head] {
            dev.retag(&mut g[head], Category::Gradients);
        }
        if let Some(mut dw) = incoming {
            dev.retag(&mut dw, Category::Gradients);
            dev.free(dw);
        }
    }
    Ok(dlnf)
}

/// hf-eager: the head weight's gradient as autograd makes it, a temporary
/// until the matmul's node returns; then AccumulateGrad takes it as the
/// gradient (set_to_none) or adds it into the resident one, and MemTracker
/// counts it as a gradient from then on. Returns that incoming gradient
/// when untied and resident (handed over by the caller); tied, it waits
/// for the embedding's (see hf_embed_grads).
fn hf_head_grad<B: Backend>(
    dev: &mut Device<B>,
    g: &mut [T<B>],
    h: &mut HfHead<'_, B>,
    head: usize,
    tied: bool,
) -> Result<Option<T<B>>, OomError> {
    let tmp = Category::Temporaries;
    if h.lazy {
        make_grads(dev, g, h.specs, h.trainable, &[head], tmp)?;
        return Ok(None);
    }
    if !h.trainable[head] {
        return Ok(None);
    }
    let dw = dev.alloc(h.specs[head].numel(), g[head].dtype, tmp)?;
    match tied {
        true => {
            *h.dw = Some(dw);
            Ok(None)
        }
        false => Ok(Some(dw)),
    }
}

/// torchtune's chunked loss backward (`--loss chunked`, hf-eager): autograd
/// runs the chunks' losses last first, each through its log_softmax and the
/// head; the head weight's gradients are summed out of place in autograd's
/// buffer (the sum, the running total and the new chunk's gradient alive
/// at once), and each chunk's input gradient is scattered into a zeroed
/// copy (the backward of the row selection) and kept until the split's
/// backward concatenates them.
fn chunked_head_backward<B: Backend>(
    dev: &mut Device<B>,
    (p, g, idx): (&mut [T<B>], &mut [T<B>], &ParamIndex),
    parts: Vec<LogitsPart<T<B>>>,
    targets: T<B>,
    dloss: f32,
    (n, c, v, vp, dt): (usize, usize, usize, usize, DType),
    mut hf: Option<&mut HfHead<'_, B>>,
    (frozen, cap): (bool, Option<f32>),
) -> Result<T<B>, OomError> {
    let tmp = Category::Temporaries;
    let head = idx.lm_head.unwrap_or(idx.wte);
    let tied = idx.lm_head.is_none();
    let trained = !frozen && hf.as_ref().is_none_or(|h| h.trainable[head]);
    let wsize = p[head].len;
    // Autocast: the chunks' matmuls use the weight's cached 16-bit cast, so
    // their weight gradients are 16-bit and are summed so in the cast's
    // buffer; the cast's backward makes the fp32 gradient once, at the end.
    let gdt = g[head].dtype;
    let autocast = hf.as_ref().is_some_and(|h| h.rules.autocast);
    let wdt = if autocast { dt } else { gdt };
    if let Some(h) = hf.as_ref().filter(|h| h.lazy) {
        hf_norm_grads(dev, g, h, idx)?;
    }
    let last = parts.len() - 1;
    let mut buffer = None;
    let mut kept = Vec::with_capacity(parts.len());
    for (i, part) in parts.into_iter().enumerate().rev() {
        let LogitsPart {
            start,
            rows: r,
            mut logits,
            input,
            targets: tc,
            extra,
            unfused,
        } = part;
        dev.charge_unfused(loss::UNFUSED_OP, unfused);
        let (input, tc) = (
            input.expect("a chunk keeps its rows"),
            tc.expect("a chunk keeps its targets"),
        );
        let grads = match hf.as_ref() {
            Some(h) => alloc_rows(dev, &h.rules.loss_grads, r, tmp)?,
            None => Vec::new(),
        };
        dev.crossentropy_backward_capped(&mut logits, &tc, dloss, (r, v, vp), cap);
        for t in grads.into_iter().chain(extra).chain([tc]) {
            dev.free(t);
        }
        dev.retag(&mut logits, tmp);
        if trained && i == last {
            // The first chunk's weight gradient is autograd's buffer:
            // with set_to_none it becomes the gradient, else AccumulateGrad
            // adds it into the resident one.
            match hf.as_mut() {
                Some(h) if h.lazy && !autocast => {
                    make_grads(dev, g, h.specs, h.trainable, &[head], tmp)?
                }
                _ => buffer = Some(dev.alloc(wsize, wdt, tmp)?),
            }
        }
        let mut dxc = dev.alloc(r * c, dt, tmp)?;
        // After the first chunk, the matmul's weight gradient is a new
        // tensor; once the matmul's node returns (its incoming gradient,
        // the logits', released), autograd's buffer adds it out of place.
        let new = match trained && i != last {
            true => Some(dev.alloc(wsize, wdt, tmp)?),
            false => None,
        };
        let dw = trained.then(|| &mut g[head]);
        dev.matmul_backward(&mut dxc, dw, None, &logits, &input, &p[head], r, c, vp);
        dev.free(logits);
        dev.free(input);
        if let Some(new) = new {
            let sum = dev.alloc(wsize, new.dtype, tmp)?;
            dev.free(new);
            dev.free(sum);
        }
        let mut scattered = dev.alloc(r * c, dt, tmp)?;
        dev.copy_slice(&mut scattered, 0, &dxc, 0, r * c, false);
        dev.free(dxc);
        kept.push((start, scattered));
    }
    dev.free(targets);
    if trained {
        if autocast {
            // The cast's backward: the fp32 gradient from the 16-bit sum.
            let full = match hf.as_mut() {
                Some(h) if h.lazy => {
                    make_grads(dev, g, h.specs, h.trainable, &[head], tmp)?;
                    None
                }
                _ => Some(dev.alloc(wsize, gdt, tmp)?),
            };
            dev.free_opt(std::mem::replace(&mut buffer, full));
        }
        match hf {
            Some(h) if h.lazy && !tied => dev.retag(&mut g[head], Category::Gradients),
            Some(h) if h.lazy => {}
            Some(h) if tied => *h.dw = buffer.take(),
            _ => {}
        }
        dev.free_opt(buffer);
    }
    let mut dlnf = dev.alloc(n * c, dt, tmp)?;
    for (off, t) in kept.into_iter().rev() {
        let len = t.len;
        dev.copy_slice(&mut dlnf, off * c, &t, 0, len, false);
        dev.free(t);
    }
    Ok(dlnf)
}

/// The fused loss's weight gradient, made in the forward, handed to the
/// head's gradient (`--loss fused-linear`). hf-eager: Liger's backward
/// returns the saved buffer, which AccumulateGrad takes as the gradient
/// (set_to_none: no copy, autograd has released the saved tensors) or adds
/// in place into the resident one; tied, it waits for the embedding's.
fn fused_head_grads<B: Backend>(
    dev: &mut Device<B>,
    g: &mut [T<B>],
    idx: &ParamIndex,
    dw: Option<T<B>>,
    hf: Option<&mut HfHead<'_, B>>,
) -> Result<(), OomError> {
    let tmp = Category::Temporaries;
    let head = idx.lm_head.unwrap_or(idx.wte);
    let tied = idx.lm_head.is_none();
    if let Some(h) = hf.as_ref().filter(|h| h.lazy) {
        hf_norm_grads(dev, g, h, idx)?;
    }
    let Some(mut dw) = dw else {
        return Ok(());
    };
    let lazy = hf.as_ref().is_some_and(|h| h.lazy);
    if lazy && g[head].len == 0 {
        // The buffer becomes the gradient.
        dev.retag(&mut dw, if tied { tmp } else { Category::Gradients });
        let ph = std::mem::replace(&mut g[head], dw);
        dev.drop_placeholder(ph);
        return Ok(());
    }
    let len = dw.len;
    dev.copy_slice(&mut g[head], 0, &dw, 0, len, true);
    match hf {
        Some(h) if tied && !h.lazy => {
            dev.retag(&mut dw, tmp);
            *h.dw = Some(dw);
        }
        _ => dev.free(dw),
    }
    Ok(())
}

/// hf-eager's part in the head's backward.
struct HfHead<'a, B: Backend> {
    rules: &'a HfRules,
    lazy: bool,
    specs: &'a [ParamSpec],
    trainable: &'a [bool],
    /// Where a tied head's weight gradient waits for the embedding's.
    dw: &'a mut Option<T<B>>,
}

/// hf-eager, before the embedding's backward: the gradients it makes. A
/// tied embedding's two gradients are summed by autograd into a third
/// tensor (its `add` of the embedding's dense gradient and the head's),
/// which becomes the gradient (set_to_none) or is added in place into the
/// resident one, MemTracker counting it as a gradient once handed over.
/// Untied, the dense gradient is a temporary until the embedding's backward
/// has made it: what it returns is handed over then ([`hf_embed_handed`]).
fn hf_embed_grads<B: Backend>(
    dev: &mut Device<B>,
    g: &mut [T<B>],
    specs: &[ParamSpec],
    trainable: &[bool],
    idx: &ParamIndex,
    lazy: bool,
    head_dw: Option<T<B>>,
) -> Result<Option<T<B>>, OomError> {
    let tmp = Category::Temporaries;
    let tied = idx.lm_head.is_none();
    if lazy {
        let ids: Vec<usize> = idx.wpe.into_iter().collect();
        make_grads(dev, g, specs, trainable, &ids, Category::Gradients)?;
        if !tied {
            make_grads(dev, g, specs, trainable, &[idx.wte], tmp)?;
        }
    }
    let (numel, dt) = (specs[idx.wte].numel(), g[idx.wte].dtype);
    if tied {
        let dense = dev.alloc(numel, dt, tmp)?;
        let mut sum = dev.alloc(numel, dt, tmp)?;
        if lazy {
            // The sum becomes the gradient; the engine's buffer (the
            // head's gradient so far) stands for it.
            dev.free(dense);
            dev.free(sum);
            dev.retag(&mut g[idx.wte], Category::Gradients);
        } else {
            dev.retag(&mut sum, Category::Gradients);
            dev.free(dense);
            dev.free_opt(head_dw);
            dev.free(sum);
        }
    } else if !lazy {
        return Ok(Some(dev.alloc(numel, dt, tmp)?));
    }
    Ok(None)
}

/// hf-eager, after the embedding's backward: an untied embedding's dense
/// gradient becomes the gradient (set_to_none) or, resident gradients, is
/// handed to AccumulateGrad (`dense`) and added in place.
fn hf_embed_handed<B: Backend>(
    dev: &mut Device<B>,
    g: &mut [T<B>],
    idx: &ParamIndex,
    lazy: bool,
    dense: Option<T<B>>,
) {
    if idx.lm_head.is_none() {
        return;
    }
    if lazy && g[idx.wte].len > 0 {
        dev.retag(&mut g[idx.wte], Category::Gradients);
    }
    if let Some(mut d) = dense {
        dev.retag(&mut d, Category::Gradients);
        dev.free(d);
    }
}

/// A row-parallel output's partial sums summed over the tensor-parallel
/// group (`t` itself without one).
fn reduce<B: Backend>(
    dev: &mut Device<B>,
    tp: Option<&mut Tp<B>>,
    t: T<B>,
) -> Result<T<B>, OomError> {
    match tp {
        Some(tp) => tp.reduce(dev, t),
        None => Ok(t),
    }
}

/// Sequence parallelism: `local` gathered over the tensor-parallel group
/// (`None` without it: `local` already holds every token).
fn gather<B: Backend>(
    dev: &mut Device<B>,
    tp: Option<&mut Tp<B>>,
    local: &T<B>,
) -> Result<Option<T<B>>, OomError> {
    match tp {
        Some(tp) => tp.gather(dev, local),
        None => Ok(None),
    }
}

/// A norm's output and what its backward needs (`mean` for LayerNorm only),
/// saved as activations in that order.
fn norm_layer<B: Backend>(
    dev: &mut Device<B>,
    x: &T<B>,
    w: &T<B>,
    b: Option<&T<B>>,
    (layernorm, offset): (bool, bool),
    n: usize,
    c: usize,
    eps: f32,
) -> Result<NormOut<B>, OomError> {
    let act = Category::Activations;
    // The output takes the input's dtype; the statistics stay fp32.
    let dt = x.dtype;
    let mut out = dev.alloc(n * c, dt, act)?;
    let mut mean = if layernorm {
        Some(dev.alloc_f32(n, act)?)
    } else {
        None
    };
    let mut rstd = dev.alloc_f32(n, act)?;
    dev.norm_forward(
        &mut out,
        mean.as_mut(),
        &mut rstd,
        x,
        w,
        b,
        n,
        c,
        eps,
        offset,
    );
    Ok((out, mean, rstd))
}

/// The attention one rank computes: its own heads under tensor parallelism.
fn attn_shape(model: &ModelConfig, train: &TrainConfig) -> AttnShape {
    let tp = train.tensor_parallel.max(1);
    AttnShape {
        b: train.micro_batch,
        t: train.seq_len,
        n_head: model.n_head / tp,
        n_kv_head: model.n_kv_head() / tp,
        head_dim: model.head_dim(),
    }
}

fn free_saved<B: Backend>(dev: &mut Device<B>, s: Saved<T<B>>) {
    match s {
        Saved::All(a) => free_block(dev, a),
        Saved::Input(Input { half, mask }) => {
            dev.free_opt(half);
            dev.free_opt(mask);
        }
        Saved::Ops(k, half) => {
            dev.free_opt(half);
            dev.free(k.qkv);
            if let Some((atty, lse)) = k.attn {
                dev.free(atty);
                dev.free(lse);
            }
            dev.free(k.up);
            dev.free_opt(k.down);
        }
    }
}

fn free_block<B: Backend>(dev: &mut Device<B>, a: BlockActs<T<B>>) {
    for x in [
        a.ln1, a.ln1_rstd, a.qkv, a.att, a.atty, a.res2, a.ln2, a.ln2_rstd,
    ] {
        dev.free(x);
    }
    dev.free_opt(a.up);
    dev.free_opt(a.act);
    if let Some(m) = a.moe {
        moe::free_moe(dev, m);
    }
    if let Some(g) = a.gate {
        moe::free_gate(dev, g);
    }
    for (x, rstd) in (a.qk.into_iter().flatten())
        .chain(a.post_attn)
        .chain(a.post_mlp)
    {
        dev.free(x);
        dev.free(rstd);
    }
    dev.free_opt(a.tanh);
    dev.free_opt(a.down);
    dev.free_opt(a.ln1_mean);
    dev.free_opt(a.ln2_mean);
    for x in a.extra.into_iter().chain(a.lora_t) {
        dev.free(x);
    }
}

/// LoRA on one projection whose input is `x (N, in)`: for each of `lora`'s
/// adapters on `proj`, saves `t = x A^T (N, r)` (pushed onto `saved`) and,
/// given the projection's output `(out, its width)`, adds `scale t B^T`
/// into the adapter's columns of it.
fn lora_forward<B: Backend>(
    dev: &mut Device<B>,
    p: &[T<B>],
    (adapters, scale, _): (&[Adapter], f32, bool),
    proj: Proj,
    x: &T<B>,
    mut out: Option<(&mut T<B>, usize)>,
    n: usize,
    saved: &mut Vec<T<B>>,
) -> Result<(), OomError> {
    for ad in adapters.iter().filter(|a| a.proj == proj) {
        let r = p[ad.a].len / ad.inp;
        let mut t = dev.alloc(n * r, x.dtype, Category::Activations)?;
        dev.matmul_forward(&mut t, x, &p[ad.a], None, n, ad.inp, r);
        if let Some((out, cols)) = out.as_mut() {
            let mut u = dev.alloc(n * ad.width, x.dtype, Category::Temporaries)?;
            dev.matmul_forward(&mut u, &t, &p[ad.b], None, n, r, ad.width);
            dev.copy_cols(
                out, *cols, ad.off, &u, ad.width, 0, n, ad.width, scale, true,
            );
            dev.free(u);
        }
        saved.push(t);
    }
    Ok(())
}

/// The backward of [`lora_forward`] on `proj`: from the projection's output
/// gradient `dout (N, cols)`, accumulates the adapters' `dB` and `dA` and
/// adds their part of the input gradient into `dinp (N, in)`. `ts` are the
/// block's saved `x A^T`, in adapter order.
fn lora_backward<B: Backend>(
    dev: &mut Device<B>,
    p: &[T<B>],
    g: &mut [T<B>],
    (adapters, scale, _): (&[Adapter], f32, bool),
    ts: &[T<B>],
    proj: Proj,
    dout: &T<B>,
    cols: usize,
    x: &T<B>,
    dinp: &mut T<B>,
    n: usize,
) -> Result<(), OomError> {
    let tmp = Category::Temporaries;
    for (ad, t) in adapters.iter().zip(ts).filter(|(a, _)| a.proj == proj) {
        let r = p[ad.a].len / ad.inp;
        // d(t B^T) = scale * dout[:, slice]
        let mut du = dev.alloc(n * ad.width, dout.dtype, tmp)?;
        dev.copy_cols(
            &mut du, ad.width, 0, dout, cols, ad.off, n, ad.width, scale, false,
        );
        let mut dt = dev.alloc(n * r, dout.dtype, tmp)?;
        dev.matmul_backward(
            &mut dt,
            Some(&mut g[ad.b]),
            None,
            &du,
            t,
            &p[ad.b],
            n,
            r,
            ad.width,
        );
        dev.free(du);
        let mut dx = dev.alloc(n * ad.inp, dout.dtype, tmp)?;
        dev.matmul_backward(
            &mut dx,
            Some(&mut g[ad.a]),
            None,
            &dt,
            x,
            &p[ad.a],
            n,
            ad.inp,
            r,
        );
        dev.free(dt);
        let len = n * ad.inp;
        dev.copy_cols(dinp, len, 0, &dx, len, 0, 1, len, 1.0, true);
        dev.free(dx);
    }
    Ok(())
}

/// QLoRA: the 16-bit copy of an NF4 weight that one matmul reads,
/// dequantised per call as bitsandbytes' `Linear4bit` does (its
/// `MatMul4Bit` saves the 4-bit weight and dequantises again in the
/// backward), a tracked temporary freed after the matmul. `None` for a
/// weight stored as is.
fn dequant<B: Backend>(
    dev: &mut Device<B>,
    w: &T<B>,
    numel: usize,
    qlora: bool,
    dt: DType,
) -> Result<Option<T<B>>, OomError> {
    if !qlora {
        return Ok(None);
    }
    let mut out = dev.alloc(numel, dt, Category::Temporaries)?;
    dev.nf4_dequantize(&mut out, w);
    Ok(Some(out))
}

/// A projection's weight and bias gradients, or none when it is frozen.
fn wgrads<X>(
    g: &mut [X],
    frozen: bool,
    w: usize,
    b: Option<usize>,
) -> (Option<&mut X>, Option<&mut X>) {
    match frozen {
        true => (None, None),
        false => {
            let (dw, db) = pair_mut(g, w, b);
            (Some(dw), db)
        }
    }
}

/// A norm's weight and bias gradients: the scratch when the norm is frozen.
fn norm_grads<'a, X>(
    g: &'a mut [X],
    scratch: &'a mut Option<(X, X)>,
    w: usize,
    b: Option<usize>,
) -> (&'a mut X, Option<&'a mut X>) {
    match scratch {
        Some((sw, sb)) => (sw, b.map(|_| sb)),
        None => pair_mut(g, w, b),
    }
}

/// hf-eager's per-token tensors (`pick` of its rules) for `rows` tokens,
/// saved as activations; nothing without hf-eager.
fn alloc_per_token<B: Backend>(
    dev: &mut Device<B>,
    hf: Option<&HfRules>,
    pick: fn(&HfRules) -> &Vec<(usize, DType)>,
    rows: usize,
) -> Result<Vec<T<B>>, OomError> {
    match hf {
        Some(h) => alloc_rows(dev, pick(h), rows, Category::Activations),
        None => Ok(Vec::new()),
    }
}

/// hf-eager with set_to_none: the final norm's gradients, which the head's
/// backward makes first.
fn hf_norm_grads<B: Backend>(
    dev: &mut Device<B>,
    g: &mut [T<B>],
    h: &HfHead<'_, B>,
    idx: &ParamIndex,
) -> Result<(), OomError> {
    let norm: Vec<usize> = std::iter::once(idx.lnf_w).chain(idx.lnf_b).collect();
    make_grads(dev, g, h.specs, h.trainable, &norm, Category::Gradients)
}

/// The tensors of `saved` (a framework's extras), as activations.
fn alloc_saved<B: Backend>(
    dev: &mut Device<B>,
    saved: &[(usize, DType)],
) -> Result<Vec<T<B>>, OomError> {
    alloc_rows(dev, saved, 1, Category::Activations)
}

/// Moves `x` to host memory (`to_host`) or back to the device, over the
/// host link, as torchtune's pack and unpack hooks do: a new copy there,
/// the old one freed. A tensor already where it goes stays.
fn move_tensor<B: Backend>(
    dev: &mut Device<B>,
    x: &mut T<B>,
    to_host: bool,
) -> Result<(), OomError> {
    if x.host == to_host {
        return Ok(());
    }
    let moved = copy_tensor(dev, x, to_host)?;
    let left = std::mem::replace(x, moved);
    dev.free(left);
    Ok(())
}

/// A copy of `x` in host memory (`to_host`) or on the device, over the
/// host link when it crosses it; `x` stays.
fn copy_tensor<B: Backend>(dev: &mut Device<B>, x: &T<B>, to_host: bool) -> Result<T<B>, OomError> {
    let alloc = |d: &mut Device<B>| d.alloc(x.len, x.dtype, x.category);
    let mut copy = match to_host {
        true => dev.on_host(alloc)?,
        false => alloc(dev)?,
    };
    dev.copy_slice(&mut copy, 0, x, 0, x.len, false);
    Ok(copy)
}

/// A tensor of each `(elements per row, dtype)` of `list` for `rows` rows,
/// under `category`.
fn alloc_rows<B: Backend>(
    dev: &mut Device<B>,
    list: &[(usize, DType)],
    rows: usize,
    category: Category,
) -> Result<Vec<T<B>>, OomError> {
    list.iter()
        .map(|&(e, dt)| dev.alloc(e * rows, dt, category))
        .collect()
}

/// hf-eager `zero_grad(set_to_none=True)`: frees every gradient that
/// exists, leaving placeholders the next backward fills.
fn release_grads<B: Backend>(dev: &mut Device<B>, grads: &mut [T<B>]) {
    for g in grads.iter_mut().filter(|g| g.len > 0) {
        let ph = dev.placeholder(g.dtype, Category::Gradients);
        dev.free(std::mem::replace(g, ph));
    }
}

/// hf-eager with `set_to_none`: makes (zeroed) the gradients of `ids` the
/// backward is about to produce, as autograd's AccumulateGrad does the
/// first time it sees each one, tracked as `category`.
fn make_grads<B: Backend>(
    dev: &mut Device<B>,
    grads: &mut [T<B>],
    specs: &[ParamSpec],
    trainable: &[bool],
    ids: &[usize],
    category: Category,
) -> Result<(), OomError> {
    for &i in ids {
        if trainable[i] && grads[i].len == 0 && specs[i].numel() > 0 {
            let t = dev.alloc(specs[i].numel(), grads[i].dtype, category)?;
            let ph = std::mem::replace(&mut grads[i], t);
            dev.drop_placeholder(ph);
        }
    }
    Ok(())
}

/// Initial weights on the host: one seeded stream per tensor, so the result does
/// not depend on thread scheduling, and a sharded run can initialise any
/// tensor on its own.
pub fn init_weights(specs: &[ParamSpec], seed: u64) -> Vec<Vec<f32>> {
    use rayon::prelude::*;
    specs
        .par_iter()
        .enumerate()
        .map(|(i, spec)| {
            let n = spec.numel();
            match spec.init {
                Init::Zeros => vec![0.0; n],
                Init::Ones => vec![1.0; n],
                Init::Normal(std) => {
                    let mut rng =
                        Rng::new(seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                    (0..n).map(|_| (rng.normal() * std as f64) as f32).collect()
                }
            }
        })
        .collect()
}
