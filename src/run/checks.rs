//! The run's knobs checked against the model and the device, each refusal
//! naming its flag (the engine's own rules are `engine::validate`'s).

use super::*;

/// Checks the options against the model, with errors naming the flag.
/// The checks run in this order, so the first refusal is the one reported.
pub fn validate(opts: &RunOptions, model: &ModelConfig) -> Result<()> {
    let t = &opts.train;
    check_counts(opts, model)?;
    check_hyperparameters(t)?;
    check_step_size(t, model)?;
    check_sgd_knobs(t)?;
    if opts.threads == Some(0) {
        return Err(Error::invalid_arg("--threads", "must be at least 1"));
    }
    if !(0.0..1.0).contains(&t.dropout) {
        return Err(Error::invalid_arg(
            "--dropout",
            format!("{} is outside [0, 1)", t.dropout),
        ));
    }
    check_finetune(opts, model)?;
    check_framework(opts)?;
    if let Some(why) = t.offload.check(t.sharding) {
        return Err(Error::invalid_arg("--offload", why));
    }
    if !t.uses_host() && t.host_memory.is_some() {
        return Err(Error::invalid_arg(
            "--host-memory",
            "applies to offload only; add --offload optimizer or --offload-activations",
        ));
    }
    crate::engine::validate::pipeline(t, model)?;
    crate::engine::validate::architecture(t, model)?;
    if model.moe.is_some() && opts.device.kind == DeviceKind::Cuda {
        return Err(Error::invalid_arg(
            "--device",
            format!(
                "{} has experts, which run on cpu and plan on meta; the cuda backend has no expert kernels yet",
                model.name
            ),
        ));
    }
    if model.family == crate::config::Family::Gemma && opts.device.kind == DeviceKind::Cuda {
        return Err(Error::invalid_arg(
            "--device",
            format!(
                "{} is a Gemma, which trains on cpu and plans on meta (for GPUs too); the cuda backend has no kernels for Gemma's norms, GeGLU, soft caps and sliding windows yet",
                model.name
            ),
        ));
    }
    crate::engine::validate::tensor_parallel(t, model)?;
    crate::engine::validate::stack(t, model)?;
    if t.optimizer.is_paged() && opts.device.kind == DeviceKind::Cuda {
        return Err(Error::invalid_arg(
            "--optimizer",
            format!(
                "{} keeps its state in CUDA unified memory (cudaMallocManaged), which the cuda backend does not allocate yet; it trains on cpu and plans on meta",
                crate::plan::name(t.optimizer)
            ),
        ));
    }
    crate::engine::validate::sharding(t, MAX_RANKS)?;
    crate::engine::validate::step_knobs(t)
}

/// The sequence length, micro-batch, accumulation and step counts.
fn check_counts(opts: &RunOptions, model: &ModelConfig) -> Result<()> {
    let t = &opts.train;
    if t.seq_len == 0 || t.seq_len > model.max_seq_len {
        return Err(Error::invalid_arg(
            "--seq-len",
            format!(
                "{} is outside 1..={}, the maximum sequence length of {}",
                t.seq_len, model.max_seq_len, model.name
            ),
        ));
    }
    for (flag, v) in [
        ("--micro-batch", t.micro_batch),
        ("--grad-accum", t.grad_accum),
    ] {
        if v == 0 {
            return Err(Error::invalid_arg(flag, "must be at least 1"));
        }
    }
    if opts.steps == 0 && opts.device.kind != DeviceKind::Meta {
        return Err(Error::invalid_arg("--steps", "must be at least 1"));
    }
    Ok(())
}

/// The optimizer's numbers: each in its range.
fn check_hyperparameters(t: &TrainConfig) -> Result<()> {
    if let Some(lr) = t.lr
        && !(lr.is_finite() && lr >= 0.0)
    {
        return Err(Error::invalid_arg(
            "--lr",
            format!("{lr} is not a usable learning rate"),
        ));
    }
    if let Some(b1) = t.beta1
        && !(0.0..1.0).contains(&b1)
    {
        return Err(Error::invalid_arg(
            "--beta1",
            format!("{b1} is outside [0, 1)"),
        ));
    }
    if !(0.0..1.0).contains(&t.beta2) {
        return Err(Error::invalid_arg(
            "--beta2",
            format!("{} is outside [0, 1)", t.beta2),
        ));
    }
    let adam = matches!(
        t.optimizer.unpaged(),
        Optimizer::Adamw | Optimizer::Adamw8bit
    );
    if !adam && t.beta2 != TrainConfig::default().beta2 {
        return Err(Error::invalid_arg(
            "--beta2",
            "applies to adamw and adamw8bit: sgd keeps no second moment, and \
             adafactor's decays on its own schedule (1 - t^-0.8)",
        ));
    }
    if t.optimizer == Optimizer::Sgd && !(t.momentum > 0.0 && t.momentum < 1.0) {
        return Err(Error::invalid_arg(
            "--momentum",
            format!(
                "{} is outside (0, 1); memfit's sgd is SGD with momentum",
                t.momentum
            ),
        ));
    }
    if !(t.weight_decay.is_finite() && t.weight_decay >= 0.0) {
        return Err(Error::invalid_arg(
            "--weight-decay",
            "must be 0 or positive",
        ));
    }
    if !(t.grad_clip.is_finite() && t.grad_clip >= 0.0) {
        return Err(Error::invalid_arg(
            "--grad-clip",
            "must be 0 (off) or positive",
        ));
    }
    Ok(())
}

/// A step whose buffers no machine can address or hold is bad input.
fn check_step_size(t: &TrainConfig, model: &ModelConfig) -> Result<()> {
    if t.grad_accum > 1 << 20 {
        return Err(Error::invalid_arg(
            "--grad-accum",
            "more than 2^20 micro-batches per step: accumulation changes no memory, use a smaller value",
        ));
    }
    // Activation sizes in u128: a shape whose buffers cannot be addressed is bad input.
    let (b, tt) = (t.micro_batch as u128, t.seq_len as u128);
    // A mixture's permuted gate|up holds up to max(k, f·k) rows per token.
    let routed = model.moe.as_ref().map_or(0, |m| {
        let rows = (m.top_k as f64 * t.capacity_factor.unwrap_or(1.0).max(1.0) as f64).ceil();
        rows as usize * 2 * m.d_expert
    });
    let widest = [
        model.padded_vocab(),
        model.qkv_width(),
        model.up_width(),
        model.d_model,
        routed,
    ]
    .into_iter()
    .max()
    .unwrap_or(0) as u128;
    let biggest = (b * tt * widest).max(b * model.n_head as u128 * tt * tt) * 4;
    if biggest > 1 << 60 || b * tt * t.grad_accum as u128 > crate::plan::MAX_TOKENS_PER_STEP {
        return Err(Error::invalid_arg(
            "--micro-batch",
            format!(
                "{} sequences of {} tokens need buffers beyond 2^60 bytes; nothing can hold that",
                t.micro_batch, t.seq_len
            ),
        ));
    }
    // The whole step, not one buffer: every layer keeps a few activations of
    // each width, so many layers of large buffers pass 2^64 bytes together
    // (and meta's peaks wrapped around). A generous over-estimate: sixteen
    // of the widest per token, per layer and the head, plus eager
    // attention's two T x T tensors per layer; no machine holds 2^62 bytes.
    let layers = model.n_layer as u128 + 1;
    let step =
        b * tt * widest * 4 * 16 * layers + b * model.n_head as u128 * tt * tt * 4 * 2 * layers;
    if step > 1 << 62 {
        return Err(Error::invalid_arg(
            "--micro-batch",
            format!(
                "{} sequences of {} tokens through {} layers hold over 2^62 bytes of activations; nothing can hold that",
                t.micro_batch, t.seq_len, model.n_layer
            ),
        ));
    }
    Ok(())
}

/// Momentum is sgd's alone, and sgd has no beta1.
fn check_sgd_knobs(t: &TrainConfig) -> Result<()> {
    if t.optimizer != Optimizer::Sgd && t.momentum != TrainConfig::default().momentum {
        return Err(Error::invalid_arg("--momentum", "only sgd uses momentum"));
    }
    if t.optimizer == Optimizer::Sgd && t.beta1.is_some() {
        return Err(Error::invalid_arg(
            "--beta1",
            "sgd has no beta1; use --momentum",
        ));
    }
    Ok(())
}

/// LoRA and QLoRA: what the adapters need of the model and the parallelism.
fn check_finetune(opts: &RunOptions, model: &ModelConfig) -> Result<()> {
    let t = &opts.train;
    if t.finetune != Finetune::Full {
        // Data parallelism trains the adapters alone (DDP buckets, ZeRO's
        // gradient and optimizer partitions); pipelines and QLoRA under
        // zero3 do not run yet.
        if let Some((flag, why)) = crate::engine::lora::check_parallel(t) {
            return Err(Error::invalid_arg(flag, why));
        }
        crate::engine::lora::check(model, &t.lora)
            .map_err(|(knob, m)| Error::invalid_arg(&format!("--lora-{knob}"), m))?;
        if t.lora.dropout > 0.0
            && (t.framework != Framework::HfEager || opts.device.kind != DeviceKind::Meta)
        {
            return Err(Error::invalid_arg(
                "--lora-dropout",
                "the engine's kernels have no dropout: it is modelled for --framework hf-eager on --device meta only",
            ));
        }
    }
    Ok(())
}

/// hf-eager runs for real only where the engine's kernels compute what
/// PyTorch would.
fn check_framework(opts: &RunOptions) -> Result<()> {
    let t = &opts.train;
    // flash_attn has CUDA kernels only: a GPU, or meta predicting one.
    let gpu = opts.device.kind == DeviceKind::Cuda || opts.target.is_some();
    if t.attention == crate::engine::Attention::FlashAttention2 && !gpu {
        return Err(Error::invalid_arg(
            "--attention",
            "flash-attention-2 (flash_attn) runs on CUDA GPUs only: plan it with --device meta:GPU (e.g. meta:rtx-4090) or `memfit plan`, or use --attention fused (sdpa) here",
        ));
    }
    if t.framework == Framework::HfEager && opts.device.kind != DeviceKind::Meta {
        // hf-eager holds PyTorch's tensors but computes with the engine's
        // kernels, which are fp32 or fully 16-bit (not autocast's fp32
        // weights with 16-bit activations) and have no dropout.
        if crate::engine::framework::is_autocast(t) {
            return Err(Error::invalid_arg(
                "--framework",
                format!(
                    "hf-eager with {} is autocast (fp32 weights, 16-bit matmuls), which the engine's kernels do not compute; plan it with --device meta or `memfit plan`, or run --precision fp32",
                    crate::plan::name(t.precision)
                ),
            ));
        }
        if t.dropout > 0.0 {
            return Err(Error::invalid_arg(
                "--dropout",
                "the engine's kernels have no dropout: hf-eager models its masks on --device meta only",
            ));
        }
    }
    Ok(())
}

/// Offload: each rank's share of the node's host memory (`--host-memory`,
/// or this machine's available memory), which is what its host tracker
/// may hold. The ranks of a run are all on this node.
pub(super) fn host_share(t: &mut TrainConfig) {
    if t.offload.optimizer() {
        t.host_memory = t
            .host_memory
            .or_else(mem_available)
            .map(|h| h / t.ranks as u64);
    }
}
