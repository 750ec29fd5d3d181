//! Which knob combinations the engine runs, checked before it is built:
//! each refusal names the flag at fault and says why, and the engine's own
//! asserts are the same rules (`run::validate`, `plan`'s invalid points and
//! `memfit balance` all come here).

use std::num::NonZeroUsize;

use super::{Finetune, Framework, Optimizer, Sharding, TrainConfig};
use crate::config::ModelConfig;
use crate::config::knobs::name;
use crate::config::model::MoeConfig;
use crate::error::{Error, Result};

/// Checks what a model's architecture adds to the llama family (q and k
/// norms, a head width of its own, experts) against the other knobs.
pub fn architecture(t: &TrainConfig, model: &ModelConfig) -> Result<()> {
    checkpointing(t, model)?;
    if t.tensor_parallel > 1 && model.family == crate::config::Family::Gemma {
        return not_yet(
            "--tensor-parallel",
            "tensor parallelism splits the heads and the vocabulary that Gemma's q/k norms and soft caps read whole",
            &format!("{} is a Gemma", model.name),
        );
    }
    // Per-head norms (Qwen3) read one head each, which a rank holds
    // whole; a norm over every head of a token (OLMoE) would need its sum
    // of squares all-reduced over the group, forward and backward.
    if t.tensor_parallel > 1 && model.qk_norm == Some(crate::config::model::QkNorm::Full) {
        return not_yet(
            "--tensor-parallel",
            "tensor parallelism splits the heads, and a q/k norm over all of a token's heads (qk_norm: full) would need its sum of squares all-reduced over the group",
            &format!("{} normalises the whole q and k", model.name),
        );
    }
    experts(t, model)?;
    match super::framework::hf_unmodelled(model) {
        Some(what) if t.framework != Framework::Memfit => not_yet(
            "--framework",
            "hf-eager follows the transformers modules its fixtures measure",
            &format!("{} {what}", model.name),
        ),
        _ => Ok(()),
    }
}

/// Checks `--checkpointing selective` (torchtitan's per-op policy,
/// `engine/step/sac.rs`): built for the dense blocks of torchtitan's
/// Llama and of GPT-2, trained whole.
fn checkpointing(t: &TrainConfig, model: &ModelConfig) -> Result<()> {
    if t.checkpointing != super::Checkpointing::Selective {
        return Ok(());
    }
    let refuse = |why: String| {
        Err(Error::invalid_arg(
            "--checkpointing",
            format!("selective (torchtitan's per-op policy) {why}; --checkpointing full covers it"),
        ))
    };
    if t.finetune != Finetune::Full {
        return refuse(format!(
            "is not built for --finetune {}: the adapters' inputs have no place in torchtitan's policy, which trains no adapters",
            name(t.finetune)
        ));
    }
    if t.attention == super::Attention::FlashAttention2 {
        return refuse(
            "is not built with --attention flash-attention-2: torchtitan's save list names sdpa's flash and efficient kernels, not flash_attn's op, which the policy would recompute; --attention fused is sdpa".into(),
        );
    }
    if t.tensor_parallel > 1 {
        return refuse(
            "is not built with --tensor-parallel: torchtitan's policy also saves the sequence-parallel reduce-scatters, and memfit's recomputation of a column slice would gather its input again".into(),
        );
    }
    let layer = match model {
        m if m.moe.is_some() => Some("has experts (torchtitan's Llama 3 has none)"),
        m if m.qk_norm.is_some() => {
            Some("normalises q and k, which the policy would keep unrotated")
        }
        m if m.family == crate::config::Family::Gemma => Some("is a Gemma (post-norms, soft caps)"),
        _ => None,
    };
    match layer {
        Some(what) => refuse(format!(
            "covers blocks shaped as torchtitan's Llama and GPT-2, and {} {what}",
            model.name
        )),
        None => Ok(()),
    }
}

/// A knob a model's layer does not combine with yet: `why`, then which
/// layer (`"<model> has experts"`).
fn not_yet(knob: &str, why: &str, layer: &str) -> Result<()> {
    Err(Error::invalid_arg(
        knob,
        format!("{why}; {layer}, and memfit does not combine the two yet"),
    ))
}

/// Checks a mixture of experts (`moe.rs`) and `--capacity-factor`
/// against the model and the other knobs.
fn experts(t: &TrainConfig, model: &ModelConfig) -> Result<()> {
    let flag = "--capacity-factor";
    let Some(m) = &model.moe else {
        if t.expert_parallel > 1 {
            return Err(Error::invalid_arg(
                "--expert-parallel",
                format!(
                    "splits a mixture's experts, and {} has no experts",
                    model.name
                ),
            ));
        }
        return match t.capacity_factor {
            Some(_) => Err(Error::invalid_arg(
                flag,
                format!(
                    "sizes a mixture of experts' buffers, and {} has no experts",
                    model.name
                ),
            )),
            None => Ok(()),
        };
    };
    if let Some(f) = t.capacity_factor {
        if t.framework == Framework::HfEager {
            // grouped_mm_experts_forward (transformers integrations/moe.py)
            // runs every one of the N x top_k choices.
            return Err(Error::invalid_arg(
                flag,
                "drops tokens, which transformers' experts never do (they are dropless); leave it out with --framework hf-eager",
            ));
        }
        if !(f.is_finite() && f > 0.0) {
            return Err(Error::invalid_arg(
                flag,
                format!("must be a positive number, got {f}"),
            ));
        }
        // Above E/k every token fits: more only pads.
        let most = m.n_experts as f32 / m.top_k as f32;
        if f > most {
            return Err(Error::invalid_arg(
                flag,
                format!(
                    "{f} is above {most} (experts / top-k), where every token already fits; leave it out for dropless routing"
                ),
            ));
        }
    }
    expert_parallel(t, model, m)?;
    let refuse = |knob: &str, why: &str| not_yet(knob, why, &format!("{} has experts", model.name));
    if t.tensor_parallel > 1 && t.sequence_parallel {
        return refuse(
            "--sequence-parallel",
            "it keeps 1/T of the tokens on each rank, which the experts would gather before routing and reduce-scatter after the combine",
        );
    }
    // QLoRA stores the stacked experts in NF4 (`BlockIndex::nf4`), which
    // transformers does not: its bitsandbytes integration converts
    // `nn.Linear` modules only (`replace_with_bnb_linear`,
    // `Bnb4BitHfQuantizer::param_needs_quantization`), and its experts
    // are stacked `nn.Parameter`s (docs/moe.md).
    if t.finetune == Finetune::Qlora && t.framework != Framework::Memfit {
        return Err(Error::invalid_arg(
            "--framework",
            format!(
                "hf-eager follows transformers, whose bitsandbytes 4-bit loading quantises nn.Linear modules only and leaves {}'s stacked experts in 16 bits, while memfit's QLoRA stores them in NF4; plan QLoRA on a mixture with --framework memfit",
                model.name
            ),
        ));
    }
    // LoRA on a mixture names its targets: `experts` adapts every routed
    // expert (`lora::layout`), gate, up and down the dense MLPs (the
    // shared expert's and the dense blocks'); no list would mean every
    // dense projection and leave the experts frozen.
    if t.finetune != Finetune::Full {
        use super::lora::Target;
        if t.lora.targets.is_empty() {
            return Err(Error::invalid_arg(
                "--lora-targets",
                format!(
                    "{} has experts: name what to adapt, e.g. q,k,v,o (the attention) or q,k,v,o,experts (and every routed expert's gate, up and down)",
                    model.name
                ),
            ));
        }
        if t.lora.targets.contains(&Target::Experts) && t.framework != Framework::Memfit {
            return Err(Error::invalid_arg(
                "--framework",
                "--lora-targets experts adapts the stacked experts in memfit's engine; transformers' experts are stacked nn.Parameters, which PEFT's target_modules cannot wrap, so hf-eager has no allocation profile to follow: use --framework memfit or adapt q,k,v,o",
            ));
        }
    }
    Ok(())
}

/// Checks `--expert-parallel` against the mixture and the layout: the
/// group is consecutive data-parallel ranks, each holding `E/P` experts.
fn expert_parallel(t: &TrainConfig, model: &ModelConfig, m: &MoeConfig) -> Result<()> {
    let p = t.expert_parallel;
    let bad = |why: String| Err(Error::invalid_arg("--expert-parallel", why));
    if p == 0 {
        return bad("must be 1 (off) or more".into());
    }
    if p == 1 {
        return Ok(());
    }
    let replicas = t.data_ranks();
    if !replicas.is_multiple_of(p) {
        return bad(format!(
            "groups of {p} must split the {replicas} data-parallel ranks evenly (--ranks {} over {} pipeline stages)",
            t.ranks,
            t.pipeline_stages.max(1)
        ));
    }
    if !m.n_experts.is_multiple_of(p) {
        return bad(format!(
            "{} has {} experts, which {p} ranks cannot hold evenly",
            model.name, m.n_experts
        ));
    }
    if t.framework != Framework::Memfit {
        return not_yet(
            "--framework",
            "hf-eager follows Hugging Face's experts, which transformers' Trainer runs whole on every rank",
            "--expert-parallel splits them as Megatron-Core does",
        );
    }
    let layout = [
        (t.shard_group.is_some(), "--shard-group"),
        (t.hpz_group.is_some(), "--hpz-group"),
        (t.offload != super::Offload::None, "--offload"),
    ];
    if let Some((_, flag)) = layout.iter().find(|(on, _)| *on) {
        return not_yet(
            flag,
            "it regroups the ranks that share a ZeRO state",
            "--expert-parallel shares the experts' state within their own group",
        );
    }
    Ok(())
}

/// Checks `--tensor-parallel` against the model and the other knobs.
pub fn tensor_parallel(t: &TrainConfig, model: &ModelConfig) -> Result<()> {
    let tp = t.tensor_parallel;
    let flag = "--tensor-parallel";
    if tp == 0 {
        return Err(Error::invalid_arg(flag, "must be at least 1"));
    }
    if t.sequence_parallel {
        let n = t.micro_batch * t.seq_len;
        if tp < 2 {
            return Err(Error::invalid_arg(
                "--sequence-parallel",
                "splits tokens over a tensor-parallel group; add --tensor-parallel 2 or more",
            ));
        }
        if !n.is_multiple_of(tp) {
            return Err(Error::invalid_arg(
                "--sequence-parallel",
                format!(
                    "a micro-batch's {n} tokens (--micro-batch x --seq-len) do not split evenly over {tp} ranks"
                ),
            ));
        }
    }
    if tp == 1 {
        return Ok(());
    }
    if let Some(why) = super::tensor::check(model, tp) {
        return Err(Error::invalid_arg(flag, format!("{why} ({})", model.name)));
    }
    if t.finetune != Finetune::Full {
        return Err(Error::invalid_arg(
            flag,
            "LoRA adapters are laid out over whole projections, which tensor parallelism splits; fine-tune with data parallelism (--sharding) instead",
        ));
    }
    if t.framework != Framework::Memfit {
        return Err(Error::invalid_arg(
            flag,
            "hf-eager models Hugging Face's single-GPU tensors; tensor parallelism is Megatron's layout, with --framework memfit",
        ));
    }
    if t.optimizer == Optimizer::Adafactor {
        return Err(Error::invalid_arg(
            flag,
            "adafactor factors each matrix's second moment over whole rows and columns, which tensor parallelism splits; use an elementwise optimizer (adamw, adamw8bit, sgd)",
        ));
    }
    Ok(())
}

/// The knobs of the user's training stack, each against the rest: the
/// loss, Liger, FlashAttention-2, activation offloading and paged
/// optimizers, in that order (`memfit run` and a plan's points check the
/// same, so a point is refused with the message a run would give).
pub fn stack(t: &TrainConfig, model: &ModelConfig) -> Result<()> {
    loss(t)?;
    if t.compile_loss && model.final_softcap().is_some() {
        return Err(Error::invalid_arg(
            "--compile-loss",
            format!(
                "{}'s final logit soft cap is not modelled compiled (what inductor saves of its tanh); leave --compile-loss out",
                model.name
            ),
        ));
    }
    liger(t, model)?;
    flash_attention_2(t)?;
    offload_activations(t)?;
    paged(t)
}

/// Checks `--loss` and `--loss-chunks` against the other knobs.
fn loss(t: &TrainConfig) -> Result<()> {
    use super::Loss;
    if t.compile_loss && t.loss != Loss::Chunked {
        return Err(Error::invalid_arg(
            "--compile-loss",
            "models torchtune's compiled LinearCrossEntropyLoss.compute_cross_entropy, one part of --loss chunked at a time: add --loss chunked",
        ));
    }
    match t.loss {
        Loss::Full => Ok(()),
        Loss::MegatronUnfused if t.framework == Framework::HfEager => Err(Error::invalid_arg(
            "--loss",
            "megatron-unfused is Megatron-Core's cross-entropy, which transformers does not run: hf-eager's --loss full already holds what ForCausalLMLoss holds (its fp32 copy of the logits and the log_softmax output); use --framework memfit for a Megatron-LM run",
        )),
        Loss::MegatronUnfused => Ok(()),
        Loss::Chunked if t.framework == Framework::Memfit => Err(Error::invalid_arg(
            "--loss",
            "chunked is torchtune's cross-entropy, a PyTorch allocation profile: add --framework hf-eager (memfit's engine already keeps one logits buffer, in the 16-bit type, and turns it into its gradient in place, which chunking would not change; --loss fused-linear builds no logits at all)",
        )),
        Loss::Chunked if t.loss_chunks == 0 => {
            Err(Error::invalid_arg("--loss-chunks", "must be at least 1"))
        }
        _ if t.tensor_parallel > 1 => Err(Error::invalid_arg(
            "--loss",
            format!(
                "{} needs the head's whole vocabulary on one rank; with --tensor-parallel the head is vocabulary-parallel and its cross-entropy already never gathers the logits (Megatron's vocab_parallel_cross_entropy): use --loss full, or megatron-unfused for Megatron's unfused one",
                name(t.loss)
            ),
        )),
        _ => Ok(()),
    }
}

/// Checks `--liger` against the framework and the model
/// (`framework::liger_unsupported`).
fn liger(t: &TrainConfig, model: &ModelConfig) -> Result<()> {
    match super::framework::liger_unsupported(model, t).filter(|_| t.liger) {
        Some(why) => Err(Error::invalid_arg("--liger", why)),
        None => Ok(()),
    }
}

/// Checks `--attention flash-attention-2`: transformers' FlashAttention-2
/// path, which flash_attn runs in fp16 and bf16 only (its `mha_fwd`
/// checks the type; transformers casts fp32 q, k and v to the autocast
/// type, or else to its linear layers' type, fp32 in an fp32 model:
/// integrations/flash_attention.py `get_target_dtype`).
fn flash_attention_2(t: &TrainConfig) -> Result<()> {
    if t.attention != super::Attention::FlashAttention2 {
        return Ok(());
    }
    if t.framework != Framework::HfEager {
        return Err(Error::invalid_arg(
            "--attention",
            "flash-attention-2 is transformers' attn_implementation, a PyTorch allocation profile: add --framework hf-eager (memfit's own engine runs its fused kernel: --attention fused)",
        ));
    }
    if t.precision == super::Precision::Fp32 {
        return Err(Error::invalid_arg(
            "--attention",
            "flash-attention-2 computes in fp16 or bf16 only (flash_attn refuses fp32 q, k and v); use --precision bf16, or --attention fused (sdpa) for fp32",
        ));
    }
    Ok(())
}

/// Checks `--offload-activations`: it moves what a checkpointed block
/// saves, its input, so it needs full checkpointing (torchtune pairs the
/// two; without checkpointing it would offload every saved tensor, which
/// memfit does not model).
fn offload_activations(t: &TrainConfig) -> Result<()> {
    if t.offload_activations && t.checkpointing != super::Checkpointing::Full {
        return Err(Error::invalid_arg(
            "--offload-activations",
            "offloads each checkpointed block's input; add --checkpointing full",
        ));
    }
    let flag = "--checkpoint-every";
    if t.checkpoint_every == 0 {
        return Err(Error::invalid_arg(
            flag,
            "0 checkpoints no block: use --checkpointing none, or N >= 1",
        ));
    }
    if t.checkpoint_every > 1 && t.checkpointing != super::Checkpointing::Full {
        return Err(Error::invalid_arg(
            flag,
            format!(
                "picks the blocks --checkpointing full recomputes (torchtitan's layer SAC), and checkpointing is {}",
                name(t.checkpointing)
            ),
        ));
    }
    if t.checkpoint_every > 1 && t.offload_activations {
        return Err(Error::invalid_arg(
            flag,
            "with --offload-activations is not built: the blocks left whole would offload only their input",
        ));
    }
    Ok(())
}

/// Checks a paged optimizer (`paged-adamw`, `paged-adamw8bit`) against
/// offload: `--offload optimizer` already keeps the state in host memory
/// (DeepSpeed's CPU optimizer updates it there), so there is nothing left
/// in device memory to page.
fn paged(t: &TrainConfig) -> Result<()> {
    if t.optimizer.is_paged() && t.offload.optimizer() {
        return Err(Error::invalid_arg(
            "--optimizer",
            format!(
                "{} pages its state between device and host memory; --offload {} keeps it in host memory already: choose one",
                name(t.optimizer),
                t.offload.name()
            ),
        ));
    }
    Ok(())
}

/// Checks `--pipeline-stages`, `--virtual-stages` and `--partition`
/// against the model and the schedule.
pub fn pipeline(t: &TrainConfig, model: &ModelConfig) -> Result<()> {
    let (stages, layers) = (t.pipeline_stages, model.n_layer);
    if stages == 0 || stages > layers + 2 {
        return Err(Error::invalid_arg(
            "--pipeline-stages",
            format!(
                "{stages} is outside 1..={}: {} has {layers} blocks, an embedding and a head, and every stage holds at least one of them",
                layers + 2,
                model.name
            ),
        ));
    }
    virtual_stages(t, model)?;
    let chunks = t.chunks();
    if let Some(p) = &t.partition {
        let what = match t.virtual_stages {
            1 => format!("{stages} pipeline stages"),
            v => format!("{chunks} model chunks ({stages} stages x {v} virtual stages)"),
        };
        if p.len() != chunks {
            return Err(Error::invalid_arg(
                "--partition",
                format!("{} ranges for {what}", p.len()),
            ));
        }
        // Only the first chunk (which holds the embedding) and the last
        // (the head) may hold no block.
        if let Some(c) =
            (0..chunks).find(|&c| p[c] == 0 && (chunks == 1 || (c > 0 && c + 1 < chunks)))
        {
            let what = match t.virtual_stages {
                1 => "stage",
                _ => "chunk",
            };
            return Err(Error::invalid_arg(
                "--partition",
                format!(
                    "{what} {c} holds no block; only the first and the last {what}, which hold the embedding and the head, may"
                ),
            ));
        }
        let sum: usize = p.iter().sum();
        if sum != layers {
            return Err(Error::invalid_arg(
                "--partition",
                format!(
                    "the ranges end at block {sum}, but {} has {layers} blocks",
                    model.name
                ),
            ));
        }
    }
    Ok(())
}

/// Checks `--virtual-stages` (Megatron-LM's interleaved 1F1B) against the
/// pipeline: it needs one, with the 1F1B schedule, enough layers for
/// `S x V` chunks, and micro-batches in whole groups of `S`.
fn virtual_stages(t: &TrainConfig, model: &ModelConfig) -> Result<()> {
    let (stages, v, k) = (t.pipeline_stages, t.virtual_stages, t.grad_accum);
    let bad = |why: String| Err(Error::invalid_arg("--virtual-stages", why));
    if v == 0 {
        return bad("must be at least 1 (1: no interleaving)".into());
    }
    if v == 1 {
        return Ok(());
    }
    if stages < 2 {
        return bad(format!(
            "interleaves each pipeline stage's {v} model chunks, and there is no pipeline; add --pipeline-stages 2 or more"
        ));
    }
    if t.schedule != super::Schedule::OneFOneB {
        return bad(format!(
            "interleaving is a 1F1B schedule (Megatron-LM's), and --schedule is {}; use --schedule 1f1b",
            t.schedule.name()
        ));
    }
    let layers = model.n_layer + 2;
    if stages * v > layers {
        return bad(format!(
            "{stages} stages x {v} virtual stages make {} model chunks, and {} has {} blocks, an embedding and a head ({layers} layers), so some chunk would hold nothing; use at most {} virtual stages",
            stages * v,
            model.name,
            model.n_layer,
            layers / stages
        ));
    }
    if !k.is_multiple_of(stages) {
        // Megatron-Core's schedule table runs groups of S micro-batches
        // through each chunk in turn and refuses a last group smaller
        // than S (`forward_backward_pipelining_with_interleaving`).
        return Err(Error::invalid_arg(
            "--grad-accum",
            format!(
                "{k} micro-batches per step do not make whole groups of {stages}, one per pipeline stage, which the interleaved schedule (--virtual-stages {v}) runs through each chunk in turn, as Megatron-LM requires; use a multiple of {stages}"
            ),
        ));
    }
    Ok(())
}

/// Checks `--ranks`, `--sharding`, `--bucket-view`, `--shard-group` and
/// `--hpz-group` together.
/// Checks the sharding knobs and that `t.ranks` is at most `max_ranks`
/// (`run::MAX_RANKS` for a run, which makes every rank; more for a plan).
pub fn sharding(t: &TrainConfig, max_ranks: usize) -> Result<()> {
    if let Some(g) = t.shard_group.map(NonZeroUsize::get) {
        let d = t.data_ranks();
        let why = if !t.sharding.shards_optimizer() {
            Some("hybrid sharding shards ZeRO state: use --sharding zero1, zero2 or zero3".into())
        } else if t.pipeline_stages > 1 {
            Some("hybrid sharding does not combine with pipeline stages here".into())
        } else if g >= d || !d.is_multiple_of(g) {
            Some(format!(
                "{g} must divide the {d} data-parallel ranks into two or more groups"
            ))
        } else {
            None
        };
        if let Some(why) = why {
            return Err(Error::invalid_arg("--shard-group", why));
        }
    }
    if !(1..=max_ranks).contains(&t.ranks) {
        return Err(Error::invalid_arg(
            "--ranks",
            format!("{} is outside 1..={max_ranks}", t.ranks),
        ));
    }
    let stages = t.pipeline_stages;
    if stages == 0 || !t.ranks.is_multiple_of(stages) {
        return Err(Error::invalid_arg(
            "--ranks",
            format!(
                "{} ranks cannot be split into {stages} pipeline stages; --ranks is stages x data-parallel replicas",
                t.ranks
            ),
        ));
    }
    let tp = t.tensor_parallel.max(1);
    if !t.ranks.is_multiple_of(stages * tp) {
        return Err(Error::invalid_arg(
            "--ranks",
            format!(
                "{} ranks cannot be split into {stages} pipeline stage(s) of tensor-parallel groups of {tp}; --ranks is stages x data-parallel replicas x --tensor-parallel",
                t.ranks
            ),
        ));
    }
    if let Some(why) = hpz_refusal(t) {
        return Err(Error::invalid_arg("--hpz-group", why));
    }
    if t.data_ranks() > 1 && t.sharding == Sharding::None {
        return Err(Error::invalid_arg(
            "--sharding",
            format!(
                "{} data-parallel replicas need a data-parallel scheme: {}",
                t.data_ranks(),
                if stages > 1 {
                    "ddp or zero1 (with a pipeline)"
                } else {
                    "ddp, zero1, zero2 or zero3"
                }
            ),
        ));
    }
    if stages > 1 && t.sharding.shards_gradients() {
        // DeepSpeed's PipelineEngine refuses the same combination: gradient
        // partitioning reduce-scatters every micro-batch's gradients.
        return Err(Error::invalid_arg(
            "--sharding",
            format!(
                "{} shards gradients, which pipeline parallelism does not combine with (as in DeepSpeed); use ddp or zero1 with --pipeline-stages",
                name(t.sharding)
            ),
        ));
    }
    // A single rank shards nothing, except that ZeRO with offload is how
    // DeepSpeed offloads on one GPU.
    if t.sharding.shards_optimizer() && t.data_ranks() < 2 && !t.offload.optimizer() {
        return Err(Error::invalid_arg(
            "--sharding",
            format!(
                "{} shards state over data-parallel replicas, so it needs 2 or more of them: --ranks of 2 or more per pipeline stage and tensor-parallel rank",
                name(t.sharding)
            ),
        ));
    }
    if t.bucket_view && t.sharding != Sharding::Ddp {
        return Err(Error::invalid_arg(
            "--bucket-view",
            "gradient buckets belong to ddp; use it with --sharding ddp",
        ));
    }
    if t.sharding.shards_optimizer() && t.optimizer == Optimizer::Adafactor {
        return Err(Error::invalid_arg(
            "--optimizer",
            format!(
                "adafactor factors each matrix's second moment over whole rows and columns, which {}'s flat shards split; use ddp, or an elementwise optimizer (adamw, adamw8bit, sgd)",
                name(t.sharding)
            ),
        ));
    }
    Ok(())
}

/// Why `--hpz-group` (ZeRO++ hpZ) cannot run with the other knobs of `t`,
/// if it cannot.
fn hpz_refusal(t: &TrainConfig) -> Option<String> {
    let (g, d) = (t.hpz_group?.get(), t.data_ranks());
    Some(if t.sharding != Sharding::Zero3 {
        "hpZ keeps a secondary copy of ZeRO-3's partitioned weights for the backward's gathers: use --sharding zero3".into()
    } else if t.pipeline_stages > 1 {
        "hpZ does not combine with pipeline stages (neither does zero3)".into()
    } else if t.shard_group.is_some() {
        "hybrid sharding (--shard-group) already gathers within its groups; hpZ is for ZeRO-3 over every rank, so use one or the other".into()
    } else if t.offload.params() {
        "with --offload optimizer+params DeepSpeed keeps hpZ's secondary copy in host memory beside the offloaded weights, which memfit does not model; use --offload optimizer, or no hpZ".into()
    } else if g == 1 || g >= d || !d.is_multiple_of(g) {
        format!(
            "{g} must divide the {d} data-parallel ranks into two or more groups of 2 or more (a node's GPUs each; 0 turns hpZ off)"
        )
    } else {
        return None;
    })
}

/// Checks `--precision bf16-pure` and `--optimizer-in-backward` against
/// the other knobs.
///
/// Pure bf16 (no master copy) is built for one rank, ddp, and zero3 as
/// FSDP2 runs it (`fully_shard` of a bf16 module: bf16 weight and state
/// shards, bf16 reduce-scatters). DeepSpeed's bf16 mode always keeps an
/// fp32 master copy in its ZeRO-1/2 partitions and its ZeRO-Offload and
/// ZeRO++ paths, so those are refused.
///
/// The optimizer step in the backward is torchtune's `optimizer_in_bwd`
/// (pytorch/torchtune @ bd2a0fc: recipes/full_finetune_single_device.py
/// refuses it with `gradient_accumulation_steps > 1` and with
/// `clip_grad_norm`; torchtune/modules/optim.py's `OptimizerInBackward`
/// steps one optimizer per parameter from its
/// `register_post_accumulate_grad_hook` and frees the gradient), built for
/// one rank: full training, LoRA and QLoRA (only adapters have
/// gradients), memfit and hf-eager.
pub fn step_knobs(t: &TrainConfig) -> Result<()> {
    if t.precision.is_pure() {
        let refused = match t.sharding {
            Sharding::Zero1 | Sharding::Zero2 => Some(format!(
                "{} is DeepSpeed's ZeRO, whose bf16 mode keeps an fp32 master copy in its partitions; pure bf16 shards as FSDP2's fully_shard of a bf16 module: use --sharding zero3, ddp or one rank",
                name(t.sharding)
            )),
            _ if t.hpz_group.is_some() => Some("ZeRO++ hpZ is DeepSpeed's, which keeps an fp32 master copy; pure bf16 shards as FSDP2 does: drop --hpz-group".into()),
            _ if t.offload.optimizer() => Some("ZeRO-Offload updates an fp32 master copy on the host; pure bf16 keeps none: drop --offload".into()),
            _ => None,
        };
        if let Some(why) = refused {
            return Err(Error::invalid_arg("--precision", why));
        }
    }
    if !t.optimizer_in_backward {
        return Ok(());
    }
    let flag = "--optimizer-in-backward";
    let refused = if t.grad_accum > 1 {
        Some("steps each parameter in the backward that completes its gradient, so gradients cannot accumulate over micro-batches (torchtune refuses gradient_accumulation_steps > 1 with optimizer_in_bwd): use --grad-accum 1".to_string())
    } else if t.grad_clip > 0.0 {
        Some("clipping needs the global norm of every gradient before any step, and the backward steps each unit as soon as its gradients are complete (torchtune refuses clip_grad_norm with optimizer_in_bwd): add --grad-clip 0".into())
    } else if t.precision == super::Precision::Fp16 {
        Some("fp16's loss scaler checks every gradient for overflow before the step, which the backward has already taken: use bf16, bf16-pure or fp32".into())
    } else if t.ranks > 1 || t.sharding != Sharding::None {
        Some("is built for one rank (torchtune's single-device recipes); data, tensor, pipeline and expert parallelism reduce or shard gradients across ranks before the step: use --ranks 1 and no --sharding".into())
    } else if t.framework == Framework::HfEager && !t.set_to_none {
        Some("torchtune's hooks free each gradient after its step (zero_grad's default set_to_none=True), so --set-to-none false changes nothing: drop it".into())
    } else if t.framework == Framework::HfEager && t.param_groups == super::ParamGroups::Trainer {
        Some("steps one optimizer per parameter (torchtune's OptimizerInBackward), so the Trainer's parameter groups change nothing: drop --param-groups".into())
    } else {
        None
    };
    match refused {
        Some(why) => Err(Error::invalid_arg(flag, why)),
        None => Ok(()),
    }
}
