//! Framework profiles: whose implementation of the same model the engine's
//! allocation schedule follows.
//!
//! `memfit` is the engine's own: hand-written backward passes that save the
//! least each layer needs. `hf-eager` holds what PyTorch autograd and the
//! Hugging Face transformers modules hold for the same step (transformers
//! 5.x `GPT2LMHeadModel` / `LlamaForCausalLM`, `torch.optim.AdamW`, the loop
//! `loss = model(x, labels=x).loss; loss.backward(); opt.step();
//! opt.zero_grad()`). The engine still computes with its own kernels; the
//! profile changes which tensors exist, when, and in which category, so the
//! timeline by phase is PyTorch's. Each rule below names the source it
//! models; `tests/reference/hf_memory.py` measures the same step with
//! PyTorch's `MemTracker`, and `tests/it/hf_reference.rs` holds the engine to
//! every configuration it wrote.
//!
//! Rules are stated as what PyTorch holds *beyond* the engine's own saved
//! tensors (`BlockActs`), which the engine already allocates with the same
//! sizes where the two agree (the layer norm outputs and statistics, the
//! packed q|k|v that stands for the three `bmm` operand copies, the
//! attention probabilities, the attention output, the residual stream).

use crate::backend::DType;
use crate::config::{Family, ModelConfig};

use super::{Attention, TrainConfig};

knob_enum! {
    /// Whose allocations the engine's schedule follows.
    #[serde(rename_all = "kebab-case")]
    pub enum Framework {
        /// memfit's own engine: what `memfit run` and `memfit sweep` train with.
        #[default]
        Memfit,
        /// PyTorch eager + Hugging Face transformers: what a `Trainer` or a
        /// plain training loop over `AutoModelForCausalLM` will allocate.
        HfEager,
    }
}

/// What of `model` hf-eager does not model yet, as a refusal says it ("has
/// a shared expert"); `None` when it models all of it. Its rules follow
/// transformers' GPT-2 and Llama modules, and the Llama-like ones the
/// fixtures measure: Phi-3, Qwen2, Qwen3 (q/k norms, heads of their own
/// width), Mixtral, Qwen3-MoE and OLMoE (every block routed, no shared
/// expert), and Gemma 2 and Gemma 3 text (`modeling_gemma2.py`,
/// `modeling_gemma3.py`: sandwich norms, GeGLU, soft caps, sliding
/// windows). Qwen2-MoE's and DeepSeek-MoE's shared experts, and dense
/// blocks before the routed ones, have no fixture yet.
pub fn hf_unmodelled(model: &crate::config::ModelConfig) -> Option<&'static str> {
    match &model.moe {
        Some(m) if m.d_shared > 0 => Some("has a shared expert"),
        Some(m) if m.first_dense > 0 => Some("has dense blocks before its routed ones"),
        _ => None,
    }
}

impl Framework {
    /// What a plan recipe that names no framework plans: hf-eager, what a
    /// PyTorch + transformers script allocates, where memfit models
    /// transformers' modules for `model`; memfit's own engine for the
    /// layers it does not ([`hf_unmodelled`]).
    pub fn plan_default(model: &crate::config::ModelConfig) -> Framework {
        match hf_unmodelled(model) {
            None => Framework::HfEager,
            Some(_) => Framework::Memfit,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Framework::Memfit => "memfit",
            Framework::HfEager => "hf-eager",
        }
    }

    /// The allocation profile in words, as reports name it beside a peak.
    pub fn profile_label(self) -> &'static str {
        match self {
            Framework::Memfit => "memfit engine",
            Framework::HfEager => "hf-eager (PyTorch eager + transformers)",
        }
    }
}

knob_enum! {
    /// `torch.optim.AdamW`'s implementation (its `foreach` / `fused` arguments).
    #[serde(rename_all = "kebab-case")]
    pub enum OptimizerImpl {
        /// `foreach=True`, PyTorch's default on GPUs and the fixtures' base:
        /// `_multi_tensor_adamw` builds `torch._foreach_sqrt(exp_avg_sqs)`, one
        /// fp32 list the size of all parameters, alive for the whole update
        /// (torch/optim/adamw.py, `_multi_tensor_adam`).
        #[default]
        Foreach,
        /// `foreach=False`: `_single_tensor_adam` makes `exp_avg_sq.sqrt()` and
        /// the division by the bias correction per parameter (two temporaries
        /// the size of that parameter); the denominator lives until the next
        /// parameter's is made.
        SingleTensor,
        /// `fused=True`: one kernel per parameter group, no temporaries.
        Fused,
    }
}

knob_enum! {
    /// How the optimizer's parameters are grouped (`torch.optim` runs its
    /// update once per group, so a group's temporaries are freed before the
    /// next group's are made).
    #[serde(rename_all = "kebab-case")]
    pub enum ParamGroups {
        /// `AdamW(model.parameters())`: one group, in the model's order (a
        /// plain training loop).
        #[default]
        One,
        /// transformers' `Trainer.create_optimizer`: the parameters that decay
        /// (`get_decay_parameter_names`: no bias, no norm), then those that do
        /// not, each in the model's order. memfit decays matrices only, the
        /// same split.
        Trainer,
    }
}

/// A plan recipe's hf-eager knobs (its keys of the same names), as a sweep
/// report keeps them: PyTorch's side of the user's stack.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HfKnobs {
    pub dropout: f32,
    pub optimizer_impl: OptimizerImpl,
    pub set_to_none: bool,
    /// Absent from reports of before it existed: one group.
    #[serde(default)]
    pub param_groups: ParamGroups,
    /// torchtune's chunked loss: the parts the sequence is split into.
    #[serde(default = "super::loss::default_chunks")]
    pub loss_chunks: usize,
    /// torchtune's `compile: True` on its chunked loss (absent from reports
    /// of before it existed: eager).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub compile_loss: bool,
    /// torchtune's `optimizer_in_bwd`, on every point of either framework
    /// (absent from reports of before it existed: off).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub optimizer_in_backward: bool,
    /// Liger's RMSNorm, SwiGLU and RoPE kernels ([`liger_unsupported`]);
    /// absent from reports of before it existed: off.
    #[serde(default)]
    pub liger: bool,
}

impl Default for HfKnobs {
    fn default() -> Self {
        let d = super::TrainConfig::default();
        HfKnobs {
            dropout: d.dropout,
            optimizer_impl: d.optimizer_impl,
            set_to_none: d.set_to_none,
            param_groups: d.param_groups,
            loss_chunks: d.loss_chunks,
            compile_loss: d.compile_loss,
            optimizer_in_backward: d.optimizer_in_backward,
            liger: d.liger,
        }
    }
}

/// What of `model` and `train` Liger's kernels (`--liger`) are not
/// modelled for, as a refusal says it; `None` when they are.
///
/// `apply_liger_kernel_to_llama()` (linkedin/Liger-Kernel @ ead96b61:
/// src/liger_kernel/transformers/monkey_patch.py), and its mistral, qwen2
/// and phi3 siblings, patch the same three pieces of a dense Llama-family
/// block the same way: `LigerRMSNorm` (casting_mode "llama", in_place
/// True), `LigerSwiGLUMLP` (`LigerPhi3SwiGLUMLP` for Phi-3: gate|up
/// chunked, then the same function) and `liger_rotary_pos_emb`. memfit
/// models those (`Step::liger_rules` says what each holds). Not modelled,
/// refused by name: GPT-2 (Liger has no GPT-2 patch), Gemma (GeGLU, the
/// "gemma" casting mode and `in_place=False`), experts (`LigerExperts`
/// over transformers' grouped experts) and q/k norms (Qwen3's
/// `Qwen3RMSNorm` class is swapped before a model is built, but an
/// instance patched by the Trainer's `use_liger_kernel` keeps
/// transformers' q/k norms: which one a run has is not in its config).
pub fn liger_unsupported(model: &ModelConfig, train: &TrainConfig) -> Option<String> {
    let name = &model.name;
    if train.framework != Framework::HfEager {
        return Some(
            "Liger's kernels replace transformers' modules, a PyTorch allocation profile: add --framework hf-eager (memfit's own engine already fuses its norms, SwiGLU and RoPE)"
                .into(),
        );
    }
    let why = match model.family {
        Family::Gpt2 => Some("Liger has no GPT-2 patch (LayerNorm, GELU, learned positions)"),
        Family::Gemma => Some(
            "Liger's Gemma patch (GeGLU, RMSNorm in its gemma casting mode, not in place) has no memfit rule yet",
        ),
        Family::Llama if model.moe.is_some() => {
            Some("Liger's expert patch (LigerExperts) has no memfit rule yet")
        }
        Family::Llama if model.qk_norm.is_some() => Some(
            "Liger swaps Qwen3's q/k norms only when patched before the model is built, not on an instance (the Trainer's use_liger_kernel), so which ones a run has is not in its config",
        ),
        Family::Llama => None,
    };
    why.map(|w| format!("{name}: {w}; leave --liger out"))
}

/// Kernels and bytes that transformers' eager ops launch and move beyond
/// one fused pass over the same tensors (Liger's kernel, or the engine's
/// own op, which the meter already charges): what running them unfused
/// adds to a step's time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Unfused {
    pub kernels: u64,
    pub bytes: u64,
}

impl std::ops::Add for Unfused {
    type Output = Unfused;
    fn add(self, o: Unfused) -> Unfused {
        Unfused {
            kernels: self.kernels + o.kernels,
            bytes: self.bytes + o.bytes,
        }
    }
}

impl Unfused {
    /// `hf` kernels moving `hf_bytes` where one fused kernel moves
    /// `fused_bytes`.
    fn beyond(hf: u64, hf_bytes: usize, fused_bytes: usize) -> Unfused {
        Unfused {
            kernels: hf.saturating_sub(1),
            bytes: hf_bytes.saturating_sub(fused_bytes) as u64,
        }
    }
}

/// Whether hf-eager's 16-bit precision is autocast (fp32 parameters, 16-bit
/// matmuls): without ZeRO (whose bf16/fp16 modes cast the module) and for
/// full training (LoRA users load the frozen base in the 16-bit type,
/// `torch_dtype=torch.bfloat16`, so its activations are a 16-bit module's
/// whatever autocast adds). The engine's kernels cannot compute autocast:
/// such a configuration is planned on meta only. Pure bf16 is a bf16
/// module (`model.to(torch.bfloat16)`), never autocast.
pub fn is_autocast(train: &TrainConfig) -> bool {
    train.framework == Framework::HfEager
        && train.precision.has_master()
        && !train.sharding.shards_optimizer()
        && train.finetune == crate::engine::Finetune::Full
}

/// Eager attention's mask: its elements and type, and whether torchtune's
/// activation offloading copies it to the host once per checkpointed block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EagerMask {
    pub len: usize,
    pub dtype: DType,
    pub offloaded: bool,
}

/// What `hf-eager` holds beyond the engine's own tensors, for one model and
/// one set of knobs. Sizes are elements with their dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct HfRules {
    /// Saved with the embedding until its backward: the embedding dropout's
    /// mask, Llama's rotary cos/sin.
    pub embed_saved: Vec<(usize, DType)>,
    /// Saved by every block until its backward.
    pub block_saved: Vec<(usize, DType)>,
    /// Saved by a routed block's experts with the engine's (`moe::MoeActs`),
    /// freed with its SwiGLU's.
    pub experts_saved: Vec<(usize, DType)>,
    /// Saved by a sliding-window block (Gemma) beyond `block_saved`, with
    /// them: sdpa's float mask and repeated k/v (`Step::sliding`).
    pub sliding_saved: Vec<(usize, DType)>,
    /// Autocast: where in `block_saved` the block's weight casts are. They
    /// live in autocast's cache until the forward leaves autocast, so a
    /// checkpointed block, which keeps only its input, still holds them to
    /// the end of the forward (and makes them again when recomputed).
    pub block_casts: Option<std::ops::Range<usize>>,
    /// Saved by the final norm and the head until the head's backward.
    pub head_saved: Vec<(usize, DType)>,
    /// How many of `head_saved`, first, the final norm saves (offloading
    /// sends them to the host); the rest the output projection saves
    /// (which torchtune's `NoOpManager` keeps on the device).
    pub head_norm_saved: usize,
    /// Under torchtune's activation offloading, what its pack hook copies
    /// to the host from the final norm beyond `head_saved`, whose norm part
    /// (`head_norm_saved`) then goes to the host too
    /// ([`Step::head_offloaded`]); empty otherwise.
    pub head_offloaded: Vec<(usize, DType)>,
    /// Eager attention's (B, 1, T, T) float mask, which transformers builds
    /// once per forward and hands every block ([`Step::eager_mask`]).
    pub eager_mask: Option<EagerMask>,
    /// Alive while the head's forward runs (a fused loss under autocast:
    /// the weight's cast).
    pub head_forward: Vec<(usize, DType)>,
    /// Per token (a row of the logits): what is saved with the
    /// log_softmax output, beyond the engine's logits buffer that stands for
    /// it (autocast: the output is fp32, the buffer 16-bit).
    pub loss_saved: Vec<(usize, DType)>,
    /// Per token: the logits the loss reads (V; autocast: the 16-bit matmul
    /// output and its fp32 copy, `logits.float()` in ForCausalLMLoss and in
    /// torchtune's loss). Full: alive from the head's matmul to the end of
    /// the forward, when the loop drops the model output; chunked: a
    /// chunk's, while its loss is computed.
    pub logits: Vec<(usize, DType)>,
    /// Per token: what the loss's backward allocates beside the engine's
    /// logits buffer, which becomes the logits' gradient: eager,
    /// `nll_loss_backward`'s and `_log_softmax_backward_data`'s outputs (V
    /// fp32 each), alive together at its start (a chunk's, chunked);
    /// compiled (`--compile-loss`), one fp32 per row (the gradient is
    /// written into the saved logits, `Step::compiled_loss`).
    pub loss_grads: Vec<(usize, DType)>,
    /// Gradients are created by the backward and freed by `zero_grad`
    /// (`set_to_none=True`, PyTorch's default since 2.0), instead of staying
    /// resident and zeroed.
    pub lazy_grads: bool,
    pub optimizer_impl: OptimizerImpl,
    pub param_groups: ParamGroups,
    /// 16-bit by autocast: fp32 parameters and gradients, no master copy.
    pub autocast: bool,
    /// Liger's kernels replace transformers' RMSNorm, SwiGLU and RoPE
    /// (`Step::liger`): among what the engine does, SwiGLU's backward
    /// writes gate|up's gradient into the saved gate|up.
    pub liger: bool,
    /// What transformers' eager ops move beyond one fused pass, per block
    /// (forward, backward) and for the final norm: charged to the meter
    /// beside the engine's own ops, none where Liger's kernels run.
    pub unfused_block: [Unfused; 2],
    pub unfused_head: [Unfused; 2],
    /// What PyTorch's eager cross-entropy moves and launches beyond the
    /// engine's fused loss kernels (forward, backward): bytes per row of
    /// the logits, launches per call ([`HfRules::loss_unfused`]).
    unfused_loss: [Unfused; 2],
    /// What a GPU flash kernel's backward allocates for itself and frees
    /// as it returns (each element count and type), on top of the
    /// gradients it writes ([`Step::attention_backward_scratch`]).
    pub attention_backward_scratch: Vec<(usize, DType)>,
}

impl HfRules {
    /// `cuda`: the run is (or emulates) a GPU, where dropout saves a bool
    /// mask (ATen's fused `native_dropout`) and sdpa keeps its flash kernel
    /// with dropout; on cpu dropout is the composite `input *
    /// bernoulli(noise)` that saves the noise in the input's dtype, and sdpa
    /// with dropout falls back to its math path.
    pub fn new(model: &ModelConfig, train: &TrainConfig, cuda: bool) -> Self {
        let x = Step::new(model, train, cuda);
        let mut block = x.norms_and_mlp();
        let casts = x.autocast_casts(&mut block);
        x.attention(&mut block);
        x.lora_dropout(&mut block);
        let mut embed = Vec::new();
        x.dropout(&mut block, &mut embed);
        x.rope(&mut embed);
        let (head, head_norm_saved, head_forward) = x.head();
        let (unfused_block, unfused_head) = x.unfused();
        let experts_saved = x.experts();
        let sliding_saved = x.sliding();
        let Step {
            dt,
            sixteen,
            autocast,
            v,
            ..
        } = x;
        let f32 = DType::F32;
        HfRules {
            block_casts: casts,
            head_forward,
            embed_saved: embed,
            block_saved: block,
            experts_saved,
            sliding_saved,
            head_saved: head,
            head_norm_saved,
            head_offloaded: x.head_offloaded(),
            eager_mask: x.eager_mask(),
            loss_saved: x.loss_saved(),
            logits: match (train.compile_loss, sixteen) {
                (true, _) => Vec::new(),
                (false, true) => vec![(v, dt), (v, f32)],
                (false, false) => vec![(v, f32)],
            },
            autocast,
            loss_grads: match train.compile_loss {
                true => vec![(1, f32)],
                false => vec![(v, f32), (v, f32)],
            },
            lazy_grads: train.set_to_none,
            optimizer_impl: train.optimizer_impl,
            param_groups: train.param_groups,
            liger: x.liger,
            unfused_block,
            unfused_head,
            unfused_loss: x.unfused_loss(),
            attention_backward_scratch: x.attention_backward_scratch(),
        }
    }
}

impl HfRules {
    /// What the eager loss over `rows` tokens' logits (the whole batch's,
    /// or a chunk's) adds to the step beyond the engine's loss kernels:
    /// `[forward, backward]`.
    pub fn loss_unfused(&self, rows: usize) -> [Unfused; 2] {
        self.unfused_loss.map(|u| Unfused {
            kernels: u.kernels,
            bytes: u.bytes * rows as u64,
        })
    }
}

/// Tensors saved or alive: each one's elements and type.
type Saved = Vec<(usize, DType)>;

/// What the rules are computed from: one step's shapes and dtypes.
#[derive(Clone, Copy)]
struct Step<'a> {
    model: &'a ModelConfig,
    train: &'a TrainConfig,
    cuda: bool,
    /// Tokens (B x T), the sequence (T) and the model width.
    n: usize,
    t: usize,
    c: usize,
    /// One layer's attention scores (B x heads x T x T).
    scores: usize,
    /// The widths of q, and of k or v.
    q: usize,
    kv: usize,
    dt: DType,
    sixteen: bool,
    autocast: bool,
    /// The dropout probability.
    p: f32,
    mask_dt: DType,
    gpt2: bool,
    v: usize,
    dff: usize,
    math: bool,
    /// RoPE's cos or sin (T x head_dim).
    rope: usize,
    /// Every block's routed experts (`hf_unmodelled` refuses a model
    /// whose blocks differ).
    moe: Option<&'a crate::config::model::MoeConfig>,
    /// Liger's RMSNorm, SwiGLU and RoPE ([`liger_unsupported`] refuses the
    /// models it is not for).
    liger: bool,
}

impl<'a> Step<'a> {
    fn new(model: &'a ModelConfig, train: &'a TrainConfig, cuda: bool) -> Self {
        let s = super::attn_shape(model, train);
        let (n, c) = (s.b * s.t, model.d_model);
        let scores = s.b * s.n_head * s.t * s.t;
        let (q, kv) = (s.n_head * s.head_dim, s.n_kv_head * s.head_dim);
        // 16-bit precision comes in two layouts. Autocast (a Trainer with
        // `bf16=True`, alone or under DDP): parameters, gradients and
        // optimizer state stay fp32; matmuls cast their inputs and weights
        // to the 16-bit type and return it; ops on autocast's fp32 list
        // (softmax, the loss) return fp32; the residual stream is fp32
        // (fp32 + 16-bit promotes). The engine's activations are in `dt`, so
        // where PyTorch's tensor is fp32 the rule adds the other half.
        // A 16-bit model (DeepSpeed ZeRO's bf16/fp16 modes and FSDP's mixed
        // precision cast the module; the fp32 master copy lives in the
        // optimizer's partitions, as the engine's mixed precision keeps it):
        // every activation is 16-bit, except where the modules upcast.
        let dt = train.precision.dtype();
        let sixteen = dt != DType::F32;
        let autocast = is_autocast(train);
        let p = train.dropout;
        // Dropout's input is the probabilities or a projection's output,
        // both in `dt`; cuda saves a bool mask instead.
        let mask_dt = if cuda { DType::U8 } else { dt };
        let gpt2 = model.family == Family::Gpt2;
        let (v, dff) = (model.vocab_size, model.d_ff());
        // sdpa with dropout has no cpu flash kernel: it runs the math path,
        // which saves what eager does (torch/nn/attention, `_fused_sdp_choice`
        // on cpu accepts dropout_p == 0 only).
        let math = train.attention == Attention::Eager || (p > 0.0 && !cuda);
        Step {
            model,
            train,
            cuda,
            n,
            t: s.t,
            c,
            scores,
            q,
            kv,
            dt,
            sixteen,
            autocast,
            p,
            mask_dt,
            gpt2,
            v,
            dff,
            math,
            rope: s.t * s.head_dim,
            moe: model.moe.as_ref(),
            liger: train.liger,
        }
    }

    /// The norms' and the MLP's saved tensors beyond the engine's.
    fn norms_and_mlp(&self) -> Vec<(usize, DType)> {
        let Step {
            n,
            c,
            dt,
            sixteen,
            autocast,
            gpt2,
            dff,
            ..
        } = *self;
        let f32 = DType::F32;
        let mut block = Vec::new();
        let liger = self.liger;
        if gpt2 {
            // NewGELUActivation (transformers/activations.py):
            // 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))) saves x, 0.5*x,
            // the tanh, 1+tanh and the product: five N x 4C tensors where the
            // engine's GELU keeps its input and output.
            block.extend([(n * dff, dt); 3]);
        } else {
            if autocast {
                // LlamaRMSNorm upcasts: x * rsqrt(var + eps) is saved fp32,
                // the output (weight * that) feeds the projections, each of
                // which casts it again: q, k and v after the first norm, gate
                // and up after the second (with experts, the router alone:
                // grouped_mm is not autocast, see `experts`); the engine
                // keeps one cast each.
                // Liger's RMSNorm saves its input (the residual stream,
                // which the engine keeps) and rstd: not the fp32 product.
                if !liger {
                    block.extend([(n * c, f32), (n * c, f32)]);
                }
                let after_ln2 = if self.moe.is_some() { 1 } else { 2 };
                block.extend(vec![(n * c, dt); 3 + after_ln2 - 2]);
            } else if sixteen {
                // A 16-bit model: the norm upcasts its input (the fp32 copy
                // is saved by x * rsqrt) and casts the product back, which
                // weight * that saves beside the output; the 16-bit input
                // itself is then saved by nothing (residual adds save
                // nothing), so the engine's residual tensor stands for that
                // cast and the fp32 copy is what is added. Liger's RMSNorm
                // reads the 16-bit input whole and casts in registers.
                if !liger {
                    block.extend([(n * c, f32); 2]);
                }
            } else {
                // LlamaRMSNorm (modeling_llama.py): x * rsqrt(var + eps) and
                // weight * that, both saved by the multiplies; the engine
                // keeps one output per norm (Liger's: see `liger_norm`).
                if !liger {
                    block.extend([(n * c, dt); 2]);
                }
            }
            // LlamaMLP: down(silu(gate(x)) * up(x)) keeps gate, silu(gate),
            // up and the product; the engine keeps gate|up and the product,
            // as Liger's LigerSiLUMulFunction saves gate and up alone.
            if self.moe.is_none() && !liger {
                block.push((n * dff, dt));
            }
        }
        self.gemma_norms(&mut block);
        self.qk_norms(&mut block);
        block
    }

    /// What transformers' eager RMSNorm, SwiGLU and RoPE launch and move
    /// beyond one fused pass, per block (forward, backward) and for the
    /// final norm; none for the pieces Liger's kernels replace, whose
    /// memory is this (linkedin/Liger-Kernel @ ead96b61, src/liger_kernel/
    /// ops/):
    /// - `LigerRMSNormFunction` (rms_norm.py): `Y = empty` in X's dtype,
    ///   `RSTD` fp32 (N) in the llama and gemma casting modes; saves X (a
    ///   view of the input: the residual stream the engine keeps), W and
    ///   RSTD. Its backward writes dX into dY (`in_place=True`, the llama
    ///   patch) and sums fp32 `(sm_count, C)` partials into dW. Against
    ///   `LlamaRMSNorm` no `x * rsqrt` product is saved (`norms_and_mlp`,
    ///   `head`): N·C fewer per norm, fp32 ones under autocast and in a
    ///   16-bit module.
    /// - `LigerSiLUMulFunction` (swiglu.py): `c = empty_like(a)`, saves a
    ///   and b (gate and up); its backward writes da and db into a and b.
    ///   Against `silu(gate) * up`, no silu(gate) is saved, and the
    ///   backward makes no gate|up gradient: the engine writes it into
    ///   the saved gate|up (`HfRules::liger`).
    /// - `LigerRopeFunction` (rope.py): rotates q and k in place (their
    ///   projections' outputs, contiguous once transposed back) and saves
    ///   cos and sin, the tensors transformers makes once per forward:
    ///   transformers' `q * cos + rotate_half(q) * sin` saves the same, so
    ///   only its forward and backward temporaries (below) go.
    ///
    /// Bytes count each kernel's reads and writes of the N-row tensors
    /// (`LlamaRMSNorm.forward`, `LlamaMLP.forward`, `apply_rotary_pos_emb`
    /// and `rotate_half` in modeling_llama.py, and autograd's backward of
    /// each op); the per-row statistics and the broadcast weight, cos and
    /// sin are left out, and so is the residual add both sides run. The
    /// experts' activation is not priced here, and Gemma's pre-norms are
    /// priced as Llama's (the same ops, its `1 + w` over C).
    fn unfused(&self) -> ([Unfused; 2], [Unfused; 2]) {
        let Step {
            train,
            n,
            c,
            q,
            kv,
            dt,
            sixteen,
            autocast,
            gpt2,
            dff,
            ..
        } = *self;
        let none = [Unfused::default(); 2];
        if gpt2 || self.liger {
            return (none, none);
        }
        let d = dt.size();
        // The norm's input: the fp32 residual stream under autocast, the
        // module's type otherwise; `x.to(float32)` and `.to(input_dtype)`
        // copy only a 16-bit input.
        let x = if autocast { 4 } else { d };
        let cast = (sixteen && !autocast) as usize;
        let s = n * c;
        // pow, mean, x * rsqrt, weight * that (+ the two casts) over N·C;
        // `+ eps` and rsqrt over N rows.
        let norm_fwd = Unfused::beyond(
            6 + 2 * cast as u64,
            s * (8 + 4 + 8 + 2 * x) + cast * s * (2 * x + 8),
            2 * s * x,
        );
        // weight * g (and g * h summed when the weight trains), g * rstd,
        // (g * x) summed for rstd's gradient, mean's and pow's backward and
        // the sum of x's two gradients (+ the two casts' backward).
        let trains = train.finetune == crate::engine::Finetune::Full;
        let norm_bwd = Unfused::beyond(
            9 + 2 * trains as u64 + 2 * cast as u64,
            s * (2 * x + 8 + 16 + 4 + 12 + 12)
                + trains as usize * 3 * s * x
                + cast * s * (2 * x + 8),
            3 * s * x,
        );
        // silu(gate) then the product: gate|up read, silu written and
        // read; the backward's two products and silu's backward.
        let (mlp_fwd, mlp_bwd) = match self.moe {
            None => {
                let i = n * dff * d;
                (
                    Unfused::beyond(2, 5 * i, 3 * i),
                    Unfused::beyond(3, 9 * i, 5 * i),
                )
            }
            Some(_) => (Unfused::default(), Unfused::default()),
        };
        // q * cos, -x2, cat, * sin and the sum for q and for k, whose
        // products with the fp32 cos and sin are fp32 under autocast
        // (`LlamaRotaryEmbedding` returns them in the hidden states' type);
        // the backward: two products, neg, the two halves' slice_backward
        // (a zeroed full tensor and a copy each) and the sums.
        let rot = n * (q + kv);
        let p = if autocast { 4 } else { d };
        let rope_fwd = Unfused::beyond(10, rot * (5 * d + 5 * p), 2 * rot * d);
        let rope_bwd = Unfused::beyond(18, 15 * rot * p, 2 * rot * d);
        let two = |u: Unfused| u + u;
        let block = [
            two(norm_fwd) + mlp_fwd + rope_fwd,
            two(norm_bwd) + mlp_bwd + rope_bwd,
        ];
        (block, [norm_fwd, norm_bwd])
    }

    /// PyTorch's eager cross-entropy over a row of the logits, beyond the
    /// engine's one fused forward and one fused backward kernel (which read
    /// the logits once, and read and write them once): per row, bytes;
    /// per call, launches. `ForCausalLMLoss` (transformers/loss/
    /// loss_utils.py) and torchtune's `compute_cross_entropy` (a chunk at a
    /// time) both call `F.cross_entropy(logits.float(), labels)`: a 16-bit
    /// model's logits copied to fp32 (2 B read, 4 written), `log_softmax`
    /// over a row too wide for shared memory (ATen's `cunn_SoftMaxForward`:
    /// the row read for its max, again for its sum of exponentials and
    /// again to write the output, 16 B), and `nll_loss`, which gathers a
    /// row's target; the backward: `nll_loss_backward`'s zero-filled
    /// gradient (4 B written, then a scatter), `_log_softmax_backward_data`
    /// (the incoming gradient read for its sum and again with the output,
    /// the result written: 16 B) and the cast back (4 read, 2 written).
    /// Liger's fused loss runs none of it, nor does a compiled loss, whose
    /// graph inductor fuses (`Step::compiled_loss`).
    fn unfused_loss(&self) -> [Unfused; 2] {
        let (train, v, d) = (self.train, self.v, self.dt.size());
        if train.compile_loss || train.loss == super::Loss::FusedLinear {
            return [Unfused::default(); 2];
        }
        let (cast, casts) = match self.sixteen {
            true => (d + 4, 1),
            false => (0, 0),
        };
        [
            Unfused::beyond(2 + casts, v * (cast + 16), v * d),
            Unfused::beyond(3 + casts, v * (4 + 16 + cast), v * 2 * d),
        ]
    }

    /// Gemma's RMSNorm (`Gemma2RMSNorm.forward`, modeling_gemma2.py, and
    /// Gemma3RMSNorm's same code): `_norm(x.float())` then `output * (1.0
    /// + weight.float())`, cast back by `type_as(x)` only after the
    /// multiply. `x.float()` (a copy of a 16-bit input) is saved by `pow`
    /// and by `x * rsqrt`, the fp32 normalised `x * rsqrt` by the multiply
    /// by `1 + w`; the fp32 output, or its 16-bit cast, is what the next op
    /// reads. The two post-norms (`post_attention_layernorm` and
    /// `post_feedforward_layernorm`, Gemma2DecoderLayer.forward) feed the
    /// residual add, which saves nothing; the engine keeps their input (the
    /// projection's output, in `dt`) and rstd. In fp32 the normalised
    /// product is the extra; a 16-bit input (the projections' outputs under
    /// autocast or in a 16-bit module) adds the fp32 copy's other half and
    /// the fp32 product. The pre-norms: in fp32 and under autocast (whose
    /// residual stream is fp32, `x.float()` no copy) they save what
    /// Llama's do (`norms_and_mlp`); in a 16-bit module the normalised
    /// product stays fp32 where Llama's `weight * hidden.to(input_dtype)`
    /// saves it 16-bit: a `dt` half more each.
    fn gemma_norms(&self, block: &mut Saved) {
        let Step {
            model,
            n,
            c,
            dt,
            sixteen,
            autocast,
            ..
        } = *self;
        if !model.offset_norms() {
            return;
        }
        let f32 = DType::F32;
        for _post in 0..2 {
            match sixteen {
                true => block.extend([(n * c, f32), (n * c, dt)]),
                false => block.push((n * c, dt)),
            }
        }
        if sixteen && !autocast {
            block.extend([(n * c, dt); 2]);
        }
    }

    /// Qwen3's per-head and OLMoE's full-width q and k norms
    /// (Qwen3RMSNorm, OlmoeRMSNorm: LlamaRMSNorm's code, on the q and k
    /// projections' outputs before RoPE, modeling_qwen3.py and
    /// modeling_olmoe.py `*Attention.forward`). `hidden.pow(2)` and
    /// `hidden * rsqrt(..)` save the fp32 input, `weight * hidden.to(dtype)`
    /// saves the normalised product in the input's dtype; the engine keeps
    /// the input in its dtype and the statistics. In fp32 the product is
    /// the extra; in 16 bits (autocast, where q and k are the projections'
    /// 16-bit outputs, or a 16-bit module) the upcast input's other half
    /// and the 16-bit product.
    fn qk_norms(&self, block: &mut Saved) {
        let Step {
            model,
            n,
            q,
            kv,
            dt,
            sixteen,
            ..
        } = *self;
        if model.qk_norm.is_some() {
            // Gemma 3's q_norm and k_norm (Gemma3Attention.forward) keep
            // the product fp32 (see `gemma_norms`): with a 16-bit q and k,
            // the fp32 copy's other half and the fp32 product.
            let copies = match (sixteen, model.offset_norms()) {
                (false, _) => 1,
                (true, false) => 2,
                (true, true) => 3,
            };
            block.extend(vec![(n * (q + kv), dt); copies]);
        }
    }

    /// A routed block as transformers 5.x runs it by default:
    /// `config._experts_implementation` "grouped_mm"
    /// (modeling_utils.py `get_correct_experts_implementation`), i.e.
    /// `grouped_mm_experts_forward` (integrations/moe.py) after the model's
    /// `*TopKRouter.forward` (modeling_mixtral.py, modeling_qwen3_moe.py,
    /// modeling_olmoe.py). Every shape is fixed by the N x top_k choices,
    /// whatever the routing. Beyond the engine's saved set (the
    /// probabilities, each row's token and weight, the permuted input,
    /// gate|up, the SwiGLU product, the experts' output, `moe::MoeActs`):
    /// - `act_fn(gate) * up` (`_default_apply_gate`) saves silu(gate) too;
    /// - `torch.topk`'s int64 indices; with `norm_topk_prob` (Mixtral
    ///   always) the in-place `/= sum` saves its divisor (N) and a copy of
    ///   the values it overwrites (N x k, fp32);
    /// - the indices are int64 where the engine's are u32: `perm // top_k`
    ///   (saved by `hidden_states[..]`), `perm` (by `sample_weights[perm]`)
    ///   and `inv_perm` (by `weighted_out[inv_perm]`), S rows each, and the
    ///   E int32 offsets `grouped_mm` saves.
    ///
    /// `grouped_mm` is not autocast-enabled and casts its input to the
    /// weight's dtype: under autocast the experts run in fp32, which the
    /// engine does too (`moe::forward`'s `edt`).
    fn experts(&self) -> Saved {
        let Step {
            n, dt, autocast, ..
        } = *self;
        let mut block = Vec::new();
        let Some(m) = self.moe else {
            return block;
        };
        let (k, rows) = (m.top_k, n * m.top_k);
        let edt = if autocast { DType::F32 } else { dt };
        block.push((rows * m.d_expert, edt));
        // int64 as two u32 each: topk's indices, and three S-row index
        // tensors where the engine keeps one u32 row index; the offsets.
        block.push((2 * n * k + 5 * rows + m.n_experts, DType::U32));
        if m.norm_topk {
            block.push((n * k + n, DType::F32));
        }
        block
    }

    /// Under autocast: the fp32 block input and residual, and the weight
    /// casts; returns where the casts sit in `block`.
    fn autocast_casts(&self, block: &mut Vec<(usize, DType)>) -> Option<std::ops::Range<usize>> {
        let Step {
            model,
            n,
            c,
            q,
            dt,
            autocast,
            dff,
            ..
        } = *self;
        let mut casts = None;
        if autocast {
            // The block input and the residual after attention are fp32.
            block.extend([(n * c, dt); 2]);
            // The weight-cast cache (torch/csrc/autograd/autocast_mode.cpp:
            // a leaf's cast is cached for the forward): every projection's
            // 16-bit weight copy is saved by its matmul until the backward.
            // With experts, the router's: the experts' grouped_mm is not
            // autocast (see `experts`).
            let mut w = vec![(c * model.qkv_width(), dt), (q * c, dt)];
            match self.moe {
                Some(m) => w.push((m.n_experts * c, dt)),
                None => w.extend([(c * model.up_width(), dt), (dff * c, dt)]),
            }
            casts = Some(block.len()..block.len() + w.len());
            block.extend(w);
        }
        casts
    }

    /// What the math attention path saves beyond the engine's.
    fn attention(&self, block: &mut Vec<(usize, DType)>) {
        let Step {
            train,
            n,
            scores,
            q,
            kv,
            dt,
            sixteen,
            autocast,
            gpt2,
            math,
            ..
        } = *self;
        let f32 = DType::F32;
        if train.attention == Attention::FlashAttention2 && self.cuda {
            // flash_attn's `mha_fwd` (Dao-AILab/flash-attention @ 0251105a:
            // csrc/flash_attn/flash_api.cpp) makes `rng_state`, two int64
            // on the GPU, whatever the dropout, and `FlashAttnFunc` saves
            // it with q, k, v, the output and the log-sum-exp (flash_attn/
            // flash_attn_interface.py); sdpa's flash kernel keeps its
            // philox seed and offset as host scalars without dropout.
            block.push((4, DType::U32));
        }
        if math {
            if !gpt2 && kv < q {
                // eager_attention_forward calls repeat_kv on k and v
                // (modeling_llama.py): the expanded copies are what the
                // matmuls save, n_head wide instead of n_kv_head.
                block.extend([(n * (q - kv), dt); 2]);
            }
            if train.attention.fused() {
                // The math path's probabilities, where flash keeps only the
                // log-sum-exp (the engine's fused saved set).
                block.push((scores, dt));
            }
            if autocast || (sixteen && !gpt2) {
                // softmax is on autocast's fp32 list, and Llama's eager
                // attention asks for `softmax(..., dtype=torch.float32)`: the
                // fp32 output is saved, and `.to(value.dtype)` makes the
                // 16-bit copy the value matmul saves (the engine's
                // probabilities). GPT-2's softmax in a 16-bit model stays
                // 16-bit.
                block.push((scores, f32));
            }
        }
    }

    fn lora_dropout(&self, block: &mut Vec<(usize, DType)>) {
        let Step {
            model,
            train,
            n,
            dt,
            mask_dt,
            ..
        } = *self;
        if train.finetune != crate::engine::Finetune::Full && train.lora.dropout > 0.0 {
            // PEFT's lora_dropout (peft/tuners/lora/layer.py:
            // `lora_B(lora_A(dropout(x)))`): each adapter drops its own
            // copy of the input, which lora_A saves, with its mask.
            let mut specs = Vec::new();
            let adapters = crate::engine::lora::layout(model, &train.lora, &mut specs);
            for ad in adapters.first().into_iter().flatten() {
                block.extend([(n * ad.inp, dt), (n * ad.inp, mask_dt)]);
            }
        }
    }

    /// Dropout's masks and dropped copies, in the blocks and on the
    /// embedding.
    fn dropout(&self, block: &mut Vec<(usize, DType)>, embed: &mut Vec<(usize, DType)>) {
        let Step {
            cuda,
            n,
            c,
            scores,
            dt,
            autocast,
            p,
            mask_dt,
            gpt2,
            math,
            ..
        } = *self;
        let f32 = DType::F32;
        if p > 0.0 {
            if math {
                // attn_dropout on the probabilities: the mask, and the dropped
                // probabilities the value matmul saves (the softmax output
                // stays saved for the softmax backward).
                block.extend([(scores, mask_dt), (scores, dt)]);
            }
            if gpt2 {
                // resid_dropout after the attention and after the MLP
                // projection (modeling_gpt2.py): each keeps its mask.
                block.extend([(n * c, mask_dt); 2]);
                // embd_pdrop on the embedding sum (fp32 under autocast: the
                // embedding is not autocast): its mask (the dropped output
                // replaces the sum as block 0's input).
                let emb_dt = if autocast { f32 } else { dt };
                embed.push((n * c, if cuda { DType::U8 } else { emb_dt }));
            }
        }
    }

    fn rope(&self, embed: &mut Vec<(usize, DType)>) {
        let Step {
            dt, autocast, gpt2, ..
        } = *self;
        let f32 = DType::F32;
        if !gpt2 {
            // LlamaRotaryEmbedding: cos and sin (1, T, head_dim), fp32 (cast
            // to the model's 16-bit type in a 16-bit model), made once per
            // forward and shared by every layer.
            let rope_dt = if autocast { f32 } else { dt };
            embed.extend([(self.rope, rope_dt); 2]);
            // Gemma3TextModel.forward makes a pair per layer type present
            // (`for layer_type in set(config.layer_types)`), each from its
            // own base (Gemma3RotaryEmbedding); Gemma 2 has one.
            let m = self.model;
            let local = m.gemma().is_some_and(|g| g.rope_local_theta.is_some());
            let sliding = (0..m.n_layer).filter(|&l| m.sliding_window(l).is_some());
            let sliding = sliding.count();
            if local && sliding > 0 && sliding < m.n_layer {
                embed.extend([(self.rope, rope_dt); 2]);
            }
        }
    }

    /// The flash backward's own buffers on a GPU: `mha_bwd`
    /// (Dao-AILab/flash-attention @ 0251105a: csrc/flash_attn/flash_api.cpp,
    /// which PyTorch's sdpa flash kernel vendors) makes `softmax_d`, fp32
    /// (B, H, T rounded up to 128), which the engine's attention workspace
    /// already stands for (B, H, T, fp32, held through the step), and, as
    /// its backward loops over key blocks, `dq_accum`, fp32 (B, T rounded
    /// up to 128, H, head_dim rounded up to 32); with fewer kv heads than
    /// heads it writes `dk_expanded` and `dv_expanded` (B, T, H, head_dim)
    /// in the inputs' type and sums them into dk and dv. transformers
    /// hands flash_attn its k and v unexpanded, and sdpa too where it
    /// passes `enable_gqa` (no mask: a model without an active sliding
    /// window, as [`Step::sliding`] says). Only the 16-bit flash kernel:
    /// on a cpu there is none, and fp32 sdpa on a GPU runs the
    /// memory-efficient kernel, whose scratch is not modelled.
    fn attention_backward_scratch(&self) -> Saved {
        let Step {
            model,
            train,
            cuda,
            math,
            sixteen,
            t,
            n,
            q,
            kv,
            dt,
            ..
        } = *self;
        if !cuda || math || !sixteen || !train.attention.fused() {
            return Vec::new();
        }
        let s = super::attn_shape(model, train);
        let round = |x: usize, m: usize| x.div_ceil(m) * m;
        let t_r = round(t, 128);
        let hd_r = round(s.head_dim, if s.head_dim <= 128 { 32 } else { 64 });
        let f32 = DType::F32;
        let mut out = vec![(s.b * t_r * s.n_head * hd_r, f32)];
        let masked = (0..model.n_layer).any(|l| model.sliding_window(l).is_some_and(|w| t >= w));
        let gqa = train.attention == Attention::FlashAttention2 || !masked;
        if kv < q && gqa {
            out.extend([(n * q, dt); 2]);
        }
        out
    }

    /// What a sliding-window layer saves beyond the others under sdpa.
    /// transformers builds its mask unless the window covers the sequence
    /// (masking_utils.py `_ignore_causal_mask_sdpa`: no skip when
    /// `kv_length >= local_attention_size`); with a mask,
    /// `sdpa_attention_forward` (integrations/sdpa_attention.py) gives up
    /// `enable_gqa` (`use_gqa_in_sdpa` wants no mask) and calls
    /// `repeat_kv`, which copies k and v unless there is one kv head (the
    /// expanded size-1 dimension then reshapes as a view); and SDPA turns
    /// the boolean mask into a float one in the query's dtype
    /// (`convert_boolean_attn_mask`, aten/src/ATen/native/transformers/
    /// attention.cpp), (B, 1, T, T), which the cpu flash kernel saves for
    /// its backward. The eager path builds its masks once per forward and
    /// saves none (`attn_weights + attention_mask`).
    fn sliding(&self) -> Saved {
        let Step {
            model,
            n,
            t,
            q,
            kv,
            dt,
            math,
            ..
        } = *self;
        let mut saved = Vec::new();
        let window = (0..model.n_layer).find_map(|l| model.sliding_window(l));
        if math || window.is_none_or(|w| t < w) {
            return saved;
        }
        saved.push((n * t, dt));
        if kv < q && model.n_kv_head() > 1 {
            saved.extend([(n * (q - kv), dt); 2]);
        }
        saved
    }

    /// Per token, what is saved with the log_softmax output until the
    /// loss's backward. The loss upcasts 16-bit logits (`logits.float()`,
    /// ForCausalLMLoss) either way. Gemma 2's final soft cap
    /// (Gemma2ForCausalLM.forward: `logits / cap`, `torch.tanh`, `* cap`)
    /// saves tanh's output, in the logits' dtype; the division and the
    /// multiplication by a number save nothing.
    fn loss_saved(&self) -> Saved {
        if self.train.compile_loss {
            return Self::compiled_loss();
        }
        let mut saved = Vec::new();
        if self.sixteen {
            saved.push((self.v, self.dt));
        }
        if self.model.final_softcap().is_some() {
            saved.push((self.v, self.dt));
        }
        saved
    }

    /// Per token, what torch.compile's graph of a chunk's projection and
    /// cross-entropy (torchtune's `compute_cross_entropy` under `compile:
    /// True`) saves beyond the projection's output, which the engine's
    /// logits buffer is: the row's max and log-sum-exp, fp32. Inductor's
    /// min-cut partitioner never recomputes the matmul, so its output is
    /// saved in its own dtype, and recomputes the upcast and the softmax
    /// from it in the backward instead of saving eager's fp32 log-softmax;
    /// the forward allocates nothing else a row's logits long, and the
    /// backward writes the logits' gradient into the saved output (its
    /// generated code reuses the buffer, `buf1 = mm; del mm  # reuse`),
    /// with one fp32 per row beside it (`HfRules::loss_grads`). Read from
    /// the graphs torch 2.15 generates (tests/reference/compiled_loss.py
    /// checks the saved tensors against memfit's).
    fn compiled_loss() -> Saved {
        vec![(1, DType::F32), (1, DType::F32)]
    }

    /// Under torchtune's activation offloading (`OffloadActivations`, whose
    /// pack hook copies every tensor an op saves, once per op that saves
    /// it), what transformers' final RMSNorm sends to the host beyond the
    /// engine's two: its fp32 input (the 16-bit model's upcast), saved by
    /// `pow` and again by the multiplication by `rsqrt`, and `rsqrt`, saved
    /// by itself and by that multiplication. The engine's offloaded input
    /// and `head_saved` (the normalised product, or in a 16-bit model the
    /// fp32 upcast) stand for the rest: 12 bytes an element in fp32, 10 in
    /// bf16, as tests/reference/offload_activations.py measures. Under
    /// autocast the input is the fp32 residual stream and the norm's ops
    /// run in fp32, as in an fp32 model; `head_saved`'s norm part then also
    /// holds the input's other half (its head part, the output projection's
    /// weight cast, stays on the device). GPT-2's LayerNorm is one op that
    /// saves its input once; Liger's norm is not modelled here.
    fn head_offloaded(&self) -> Saved {
        let Step {
            train,
            n,
            c,
            gpt2,
            liger,
            ..
        } = *self;
        if !train.offload_activations || gpt2 || liger {
            return Vec::new();
        }
        let f32 = DType::F32;
        vec![(n * c, f32), (n, f32), (n, f32)]
    }

    /// Eager attention's mask (masking_utils.py `create_causal_mask` with
    /// the eager interface; a model with sliding and full layers makes one
    /// of each): a dense (B, 1, T, T) tensor in the embeddings'
    /// type (fp32 under autocast, whose embeddings are fp32), 0 where a key
    /// is seen and the type's lowest value elsewhere, made as the blocks
    /// start and dropped as the base model's forward returns, after the
    /// final norm; `attn_weights + attention_mask` saves nothing. A
    /// checkpointed block holds it until its backward: non-reentrant
    /// checkpointing saves a block's positional tensor arguments
    /// (`_NoopSaveInputs`) and keeps its keyword ones in the recomputation's
    /// closure, so the mask lives until the lowest checkpointed block's
    /// backward. Under torchtune's offloading, saved means packed: GPT-2
    /// passes the mask positionally (`block(hidden_states,
    /// past_key_values, causal_mask, ...)`), so each block's pack hook
    /// copies it to the host, the checkpoints no longer hold the device's,
    /// and each block's recomputation brings its copy back; Llama passes it
    /// by keyword, which stays on the device as without offloading
    /// (tests/reference/offload_activations.py measures both).
    fn eager_mask(&self) -> Option<EagerMask> {
        // With both kinds of layer (Gemma), one mask of each kind
        // (`causal_mask_mapping`): both are made, whatever T.
        let windows: Vec<_> = (0..self.model.n_layer)
            .map(|l| self.model.sliding_window(l).is_some())
            .collect();
        let masks = 1 + (windows.contains(&true) && windows.contains(&false)) as usize;
        let train = self.train;
        (train.attention == Attention::Eager).then(|| EagerMask {
            len: self.n * self.t * masks,
            dtype: match self.sixteen && !self.autocast {
                true => self.dt,
                false => DType::F32,
            },
            offloaded: train.offload_activations && self.gpt2,
        })
    }

    /// What the final norm and the head save, and what is alive only
    /// while the head's forward runs.
    fn head(&self) -> (Saved, usize, Saved) {
        let Step {
            train,
            n,
            c,
            dt,
            sixteen,
            autocast,
            gpt2,
            v,
            ..
        } = *self;
        let f32 = DType::F32;
        let mut head = Vec::new();
        if !gpt2 {
            // The final LlamaRMSNorm's x * rsqrt (see the blocks'); none
            // with Liger's.
            match (autocast || sixteen, self.liger) {
                (_, true) => {}
                (true, false) => head.push((n * c, f32)),
                (false, false) => head.push((n * c, dt)),
            }
        }
        let fused = train.loss == super::Loss::FusedLinear;
        let mut head_forward = Vec::new();
        if autocast {
            // The last block's output is fp32, which the norm saves.
            head.push((n * c, dt));
        }
        let norm_saved = head.len();
        if autocast {
            // The head's weight cast.
            match fused {
                // Liger's function saves only its gradients: the cast lives
                // in autocast's cache until the forward leaves autocast.
                true => head_forward.push((v * c, dt)),
                false => head.push((v * c, dt)),
            }
            if fused {
                // Liger's input gradient is `zeros_like(_input)`: the final
                // norm's output, fp32 under autocast.
                head.push((n * c, dt));
            }
        }
        (head, norm_saved, head_forward)
    }
}
