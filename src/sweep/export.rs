//! Exports of a sweep's recommendation, to paste into a training stack:
//! a DeepSpeed config (`ds_config.json`), Hugging Face `TrainingArguments`
//! (`training_args.py`), and the recipe pinned to the one chosen point
//! (`recommended.yaml`, which `memfit plan` loads).
//!
//! The three agree with one another and with what memfit measured: the same
//! micro-batch, accumulation, precision, ZeRO stage, clipping and optimizer
//! hyper-parameters (memfit's defaults, [`TrainConfig::opt`]). The Hugging Face
//! Trainer refuses a DeepSpeed config whose concrete values disagree with its
//! `TrainingArguments`, so both carry the same numbers.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::config::knobs::group;
use crate::engine::{
    Attention, Checkpointing, Finetune, Optimizer, Precision, Sharding, TrainConfig,
};
use crate::error::{Error, Result};
use crate::plan::{Point, name};
use crate::report::sweep::{SweepReport, TrialRecord};
use crate::units::fmt_bytes;

/// An f32 hyper-parameter as the f64 its decimal spelling means (3e-4, not
/// 0.0003000000142492354).
fn clean(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// memfit's training settings for a point (what the trial ran with).
fn train_config(p: &Point) -> TrainConfig {
    TrainConfig {
        micro_batch: p.micro_batch,
        grad_accum: p.grad_accum.max(1),
        optimizer: p.optimizer,
        precision: p.precision,
        checkpointing: p.checkpointing,
        attention: p.attention,
        ranks: p.gpus,
        sharding: p.sharding,
        ..TrainConfig::default()
    }
}

/// Sequences per step: every data-parallel replica's (a pipeline's stages
/// and a tensor-parallel group's ranks share theirs).
fn global_batch(p: &Point) -> usize {
    let replicas = p.gpus / (p.pipeline_stages.max(1) * p.tensor_parallel.max(1));
    p.micro_batch * p.grad_accum.max(1) * replicas.max(1)
}

/// The ZeRO stage of a sharding: none and ddp are stage 0 (plain data
/// parallelism), zero1..3 are stages 1..3.
pub fn zero_stage(s: Sharding) -> u8 {
    match s {
        Sharding::None | Sharding::Ddp => 0,
        Sharding::Zero1 => 1,
        Sharding::Zero2 => 2,
        Sharding::Zero3 => 3,
    }
}

/// A DeepSpeed config for `trial` (JSON, no comments: DeepSpeed's parser
/// takes none).
///
/// - `train_batch_size` = micro_batch x gradient_accumulation_steps x GPUs,
///   `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps`.
/// - `zero_optimization.stage`: 0 for none and ddp, 1-3 for zero1-3, and
///   `offload_optimizer` / `offload_param` (`device: cpu`, pinned) when the
///   point offloads, `mics_shard_size` under hybrid sharding and
///   `zero_hpz_partition_size` under ZeRO++ hpZ; nothing else in that
///   section, so DeepSpeed's defaults (buckets, overlap) apply.
/// - `bf16.enabled` / `fp16.enabled`, both present. fp16 uses DeepSpeed's
///   dynamic scaler set up like memfit's: `loss_scale: 0` (dynamic),
///   `initial_scale_power: 16` (2^16), `loss_scale_window: 2000` (doubles
///   after 2000 clean steps), `hysteresis: 1` (halves at the first overflow,
///   as `torch.cuda.amp.GradScaler` and memfit do), `min_loss_scale: 1`.
/// - `gradient_clipping`: memfit's global-norm clip, 1.0.
/// - `activation_checkpointing` only when the point checkpoints, with
///   partitioning, contiguous buffers and CPU offload off (memfit measured
///   none of those). That section only configures DeepSpeed's
///   `deepspeed.checkpointing` API; with Hugging Face models what actually
///   recomputes is `gradient_checkpointing=True` in `TrainingArguments`
///   (or `model.gradient_checkpointing_enable()`). Selective checkpointing
///   (torchtitan's per-op policy) gets no section: DeepSpeed's API
///   recomputes whole blocks.
/// - `optimizer`: for adamw, DeepSpeed's `AdamW` with memfit's lr, betas, eps
///   and weight decay. DeepSpeed has no 8-bit AdamW, no Adafactor and no SGD
///   of its own, so for adamw8bit, adafactor and sgd the section is left out
///   and `zero_allow_untested_optimizer: true` is set: the client builds the
///   optimizer (the Hugging Face Trainer does, from `optim=`, when the
///   config has no optimizer section) and DeepSpeed wraps it. No `scheduler`
///   section either: the schedule is the client's choice.
/// - Nothing for a mixture's expert parallelism or capacity factor: in
///   DeepSpeed-MoE both are arguments of the model's `deepspeed.moe.layer.MoE`
///   (`ep_size`, `capacity_factor`), not config keys; the pinned recipe
///   records them.
pub fn deepspeed_config(_report: &SweepReport, trial: &TrialRecord) -> Value {
    let p = &trial.point;
    let tc = train_config(p);
    let opt = tc.opt();
    let mut cfg = json!({
        "train_batch_size": global_batch(p),
        "train_micro_batch_size_per_gpu": p.micro_batch,
        "gradient_accumulation_steps": p.grad_accum.max(1),
        "gradient_clipping": clean(tc.grad_clip),
        "zero_optimization": { "stage": zero_stage(p.sharding) },
        "bf16": { "enabled": p.precision == Precision::Bf16 },
    });
    // ZeRO-Offload to CPU memory, pinned as DeepSpeed recommends.
    if p.offload.optimizer() {
        cfg["zero_optimization"]["offload_optimizer"] =
            json!({ "device": "cpu", "pin_memory": true });
    }
    // Hybrid sharding is DeepSpeed's MiCS: ZeRO-3 within groups of this
    // size, replicated across them.
    if let Some(g) = p.shard_group {
        cfg["zero_optimization"]["mics_shard_size"] = json!(g);
    }
    // ZeRO++'s hierarchical partitioning: the secondary copy's group.
    if let Some(g) = p.hpz_group {
        cfg["zero_optimization"]["zero_hpz_partition_size"] = json!(g);
    }
    if p.offload.params() {
        cfg["zero_optimization"]["offload_param"] = json!({ "device": "cpu", "pin_memory": true });
    }
    cfg["fp16"] = if p.precision == Precision::Fp16 {
        json!({
            "enabled": true,
            "loss_scale": 0,
            "initial_scale_power": tc.initial_loss_scale.log2().round() as u32,
            "loss_scale_window": tc.loss_scale_window,
            "hysteresis": 1,
            "min_loss_scale": 1,
        })
    } else {
        json!({ "enabled": false })
    };
    if p.checkpointing == Checkpointing::Full {
        cfg["activation_checkpointing"] = json!({
            "partition_activations": false,
            "contiguous_memory_optimization": false,
            "cpu_checkpointing": false,
        });
    }
    match p.optimizer {
        Optimizer::Adamw => {
            cfg["optimizer"] = json!({
                "type": "AdamW",
                "params": {
                    "lr": clean(opt.lr.unwrap_or(3e-4)),
                    "betas": [clean(opt.beta1.unwrap_or(0.9)), clean(opt.beta2)],
                    "eps": clean(opt.eps),
                    "weight_decay": clean(opt.weight_decay),
                },
            });
        }
        Optimizer::Adamw8bit
        | Optimizer::PagedAdamw
        | Optimizer::PagedAdamw8bit
        | Optimizer::Adafactor
        | Optimizer::Sgd => {
            cfg["zero_allow_untested_optimizer"] = json!(true);
        }
    }
    cfg
}

fn py_bool(b: bool) -> &'static str {
    if b { "True" } else { "False" }
}

/// A float as Python spells it (always with a point or an exponent).
fn py_float(x: f64) -> String {
    let s = format!("{x:?}");
    if s.contains(['.', 'e', 'E']) {
        s
    } else {
        format!("{s}.0")
    }
}

/// A Python string literal.
fn py_str(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

fn optim_name(o: Optimizer) -> &'static str {
    match o {
        Optimizer::Adamw => "adamw_torch",
        Optimizer::Adamw8bit => "adamw_bnb_8bit",
        // transformers' OptimizerNames: bitsandbytes' AdamW with is_paged=True.
        Optimizer::PagedAdamw => "paged_adamw_32bit",
        Optimizer::PagedAdamw8bit => "paged_adamw_8bit",
        Optimizer::Adafactor => "adafactor",
        Optimizer::Sgd => "sgd",
    }
}

/// The header lines: the trial, where it was measured and what the plan
/// says for the target GPU.
fn provenance(report: &SweepReport, trial: &TrialRecord) -> Vec<String> {
    let mut v = vec![format!(
        "memfit recommendation `{}`: {}",
        trial.id,
        trial.point.label()
    )];
    let run = if report.run_device.spec.is_empty() {
        &report.device
    } else {
        &report.run_device.spec
    };
    let target = if report.target.display_name.is_empty() {
        &report.hardware
    } else {
        &report.target.display_name
    };
    v.push(format!(
        "model {}, global batch {} x seq_len {}; trials ran on {run}{}, target {target}",
        report.model,
        report.global_batch,
        report.seq_len,
        if report.run_device.emulated {
            " (emulated)"
        } else {
            ""
        }
    ));
    if let Some(m) = &trial.measured {
        v.push(format!(
            "measured there: peak {} per rank of {} usable, {:.0} tokens/s",
            fmt_bytes(m.peak_bytes.total + report.runtime_overhead_bytes),
            fmt_bytes(report.usable_bytes()),
            m.tokens_per_s
        ));
    }
    if let Some(t) = &trial.target {
        v.push(format!(
            "planned on {target}: {} per GPU ({}), {:.0} tokens/s",
            fmt_bytes(t.peak_total_bytes),
            if t.fits { "fits" } else { "does not fit" },
            t.tokens_per_s
        ));
    }
    v.into_iter()
        .map(|l| l.replace(['\n', '\r'], " "))
        .collect()
}

/// The training script's first lines: the global batch it makes, and how
/// to launch it on the point's GPUs.
fn launch_lines(p: &Point, stage: u8) -> String {
    let mut s = String::new();
    let pure = p.precision.is_pure();
    s.push_str(&format!(
        "# Global batch {} = {} per device x {} accumulation steps x {} GPU{}.\n",
        global_batch(p),
        p.micro_batch,
        p.grad_accum.max(1),
        p.gpus,
        if p.gpus == 1 { "" } else { "s" }
    ));
    match p.sharding {
        Sharding::Ddp => s.push_str(&format!(
            "# Launch on {n} GPUs with DDP: torchrun --nproc_per_node={n} train.py\n",
            n = p.gpus
        )),
        // Pure bf16 shards as FSDP2 does; DeepSpeed would keep a master.
        Sharding::Zero3 if pure => s.push_str(&format!(
            "# Launch on {n} GPUs with FSDP2 (full shard of the bf16 model): torchrun --nproc_per_node={n} train.py\n",
            n = p.gpus
        )),
        Sharding::Zero1 | Sharding::Zero2 | Sharding::Zero3 => s.push_str(&format!(
            "# Launch on {n} GPUs with DeepSpeed ZeRO-{stage}: deepspeed --num_gpus={n} train.py\n\
             # (or torchrun --nproc_per_node={n} train.py); ds_config.json sits next to this file.\n",
            n = p.gpus
        )),
        Sharding::None => {}
    }
    s
}

/// A Hugging Face snippet: `TrainingArguments(...)` for `trial`, with the
/// model-loading line and the launch command as comments where they matter.
/// For zero1-3 it points at `ds_config.json` ([`deepspeed_config`]); the
/// optimizer hyper-parameters equal that config's, as the Trainer requires.
pub fn hf_training_args(report: &SweepReport, trial: &TrialRecord) -> String {
    let p = &trial.point;
    let tc = train_config(p);
    let opt = tc.opt();
    let stage = zero_stage(p.sharding);
    let mut s = String::new();
    for line in provenance(report, trial) {
        s.push_str(&format!("# {line}\n"));
    }
    s.push_str(&launch_lines(p, stage));
    let pure = p.precision.is_pure();
    s.push_str("from transformers import AutoModelForCausalLM, TrainingArguments\n\n");
    s.push_str(&format!(
        "CHECKPOINT = \"path/or/hub-id\"  # a checkpoint of memfit's model {}\n",
        report.model.replace(['\n', '\r'], " ")
    ));
    // The attention kernel is part of what was measured: eager keeps the
    // B x H x T x T probabilities for the backward pass, fused does not.
    let (attn, why) = match p.attention {
        Attention::Fused => ("sdpa", "memfit measured fused attention"),
        Attention::FlashAttention2 => (
            "flash_attention_2",
            "memfit planned FlashAttention-2 (pip install flash-attn)",
        ),
        Attention::Eager => (
            "eager",
            "memfit measured eager attention (B x H x T x T probabilities kept)",
        ),
    };
    // Pure bf16: the model itself in bf16, so the optimizer's state is too.
    let dtype = match pure {
        true => {
            "    torch_dtype=torch.bfloat16,  # pure bf16: bf16 weights, gradients and AdamW state, no fp32 master\n"
        }
        false => "",
    };
    if pure {
        s.push_str("import torch\n");
    }
    s.push_str(&format!(
        "model = AutoModelForCausalLM.from_pretrained(\n    CHECKPOINT,\n    attn_implementation={},  # {why}\n{dtype})\n\n",
        py_str(attn)
    ));
    s.push_str("training_args = TrainingArguments(\n");
    let mut arg = |k: &str, v: String| s.push_str(&format!("    {k}={v},\n"));
    arg("output_dir", py_str("out"));
    arg("per_device_train_batch_size", p.micro_batch.to_string());
    arg(
        "gradient_accumulation_steps",
        p.grad_accum.max(1).to_string(),
    );
    let ckpt = p.checkpointing == Checkpointing::Full;
    if p.checkpointing == Checkpointing::Selective {
        arg(
            "# memfit planned torchtitan's selective (per-op) checkpointing, which\n    \
             # TrainingArguments cannot express: wrap each decoder layer in\n    \
             # torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)\n    \
             # with create_selective_checkpoint_contexts and torchtitan's policy\n    \
             # (torchtitan/distributed/activation_checkpoint.py)\n    \
             gradient_checkpointing",
            py_bool(false).into(),
        );
    } else {
        arg("gradient_checkpointing", py_bool(ckpt).into());
    }
    if ckpt {
        arg(
            "gradient_checkpointing_kwargs",
            "{\"use_reentrant\": False}".into(),
        );
    }
    arg("bf16", py_bool(p.precision == Precision::Bf16).into());
    arg("fp16", py_bool(p.precision == Precision::Fp16).into());
    arg("optim", py_str(optim_name(p.optimizer)));
    match p.optimizer.unpaged() {
        Optimizer::Adamw | Optimizer::Adamw8bit => {
            arg("learning_rate", py_float(clean(opt.lr.unwrap_or(3e-4))));
            arg("adam_beta1", py_float(clean(opt.beta1.unwrap_or(0.9))));
            arg("adam_beta2", py_float(clean(opt.beta2)));
            arg("adam_epsilon", py_float(clean(opt.eps)));
            arg("weight_decay", py_float(clean(opt.weight_decay)));
        }
        Optimizer::Sgd => {
            arg("learning_rate", py_float(clean(opt.lr.unwrap_or(1e-2))));
            arg("weight_decay", py_float(clean(opt.weight_decay)));
        }
        Optimizer::Adafactor | Optimizer::PagedAdamw | Optimizer::PagedAdamw8bit => {}
    }
    let in_bwd = report.hf_knobs.is_some_and(|h| h.optimizer_in_backward);
    let clip = if in_bwd { 0.0 } else { tc.grad_clip };
    arg("max_grad_norm", py_float(clean(clip)));
    // Liger's kernels (hf-eager's `liger`); the Trainer's default config
    // also fuses the head with the loss, which memfit's `loss` says.
    let liger = report.hf_knobs.is_some_and(|h| h.liger)
        && p.framework == crate::engine::Framework::HfEager;
    if liger {
        arg("use_liger_kernel", "True".into());
        if p.loss != crate::engine::Loss::FusedLinear {
            arg(
                "liger_kernel_config",
                "{\"fused_linear_cross_entropy\": False}".into(),
            );
        }
    }
    if pure && p.sharding == Sharding::Zero3 {
        arg("fsdp", py_str("full_shard"));
        arg("fsdp_config", "{\"fsdp_version\": 2}".into());
    } else if stage > 0 {
        arg("deepspeed", py_str("ds_config.json"));
    }
    s.push_str(")\n");
    if pure {
        s.push_str(
            "# bf16=False: the model is already bf16 (autocast would change nothing); DeepSpeed is not used,\n\
             # its bf16 mode always keeps an fp32 master copy, so no ds_config.json is written.\n",
        );
    }
    if in_bwd {
        s.push_str(
            "# memfit planned the optimizer step inside the backward (torchtune's optimizer_in_bwd: True,\n\
             # one optimizer per parameter stepped from register_post_accumulate_grad_hook, max_grad_norm 0);\n\
             # the Trainer has no such option: run torchtune's recipe, or register the hooks yourself.\n",
        );
    }
    match p.optimizer {
        Optimizer::Adamw8bit => s.push_str(
            "# adamw_bnb_8bit needs bitsandbytes (pip install bitsandbytes).\n",
        ),
        Optimizer::PagedAdamw | Optimizer::PagedAdamw8bit => s.push_str(
            "# Paged optimizers need bitsandbytes (pip install bitsandbytes) and CUDA: their state is\n\
             # in unified memory, which torch.cuda.max_memory_allocated/reserved do not count.\n",
        ),
        Optimizer::Adafactor => s.push_str(
            "# The Trainer's adafactor runs a fixed learning_rate (relative_step=False); memfit measured\n\
             # Hugging Face's relative step. The state, and so the memory, is the same.\n",
        ),
        Optimizer::Sgd => s.push_str(&format!(
            "# optim=\"sgd\" is torch.optim.SGD without momentum; memfit's SGD keeps a momentum buffer\n\
             # (4 bytes/param). To match it, pass to the Trainer:\n\
             #   optimizers=(torch.optim.SGD(model.parameters(), lr={}, momentum={}, weight_decay={}), None)\n",
            py_float(clean(opt.lr.unwrap_or(1e-2))),
            py_float(clean(opt.momentum)),
            py_float(clean(opt.weight_decay))
        )),
        Optimizer::Adamw => {}
    }
    s
}

/// The recipe's knobs of the user's stack for `p`, as plan-recipe lines:
/// the optimizer in the backward (either framework), and hf-eager's.
fn pinned_stack_knobs(h: &crate::report::sweep::HfKnobs, p: &Point) -> String {
    let mut s = String::new();
    if h.optimizer_in_backward {
        s.push_str("optimizer_in_backward: true\n");
    }
    if p.framework != crate::engine::Framework::HfEager {
        return s;
    }
    s.push_str(&format!(
        "dropout: {:?}\noptimizer_impl: {}\nset_to_none: {}\n",
        h.dropout,
        name(h.optimizer_impl),
        h.set_to_none
    ));
    if h.param_groups != Default::default() {
        s.push_str(&format!("param_groups: {}\n", name(h.param_groups)));
    }
    if p.loss == crate::engine::Loss::Chunked {
        s.push_str(&format!("loss_chunks: {}\n", h.loss_chunks));
        if h.compile_loss {
            s.push_str("compile_loss: true\n");
        }
    }
    if h.liger {
        s.push_str("liger: true\n");
    }
    s
}

/// A YAML scalar, quoted when plain would not round-trip.
fn yaml_str(s: &str) -> String {
    serde_yaml_ng::to_string(s)
        .map(|t| t.trim_end().to_string())
        .unwrap_or_else(|_| py_str(s))
}

/// A model or hardware file the sweep read, as a recipe in `dir` must name
/// it: relative to `dir` (a recipe's relative paths resolve against its own
/// folder), so the output directory and the recipes can move together; as
/// the report has it when either path cannot be resolved.
fn file_seen_from(dir: &Path, file: &str) -> String {
    let (Ok(target), Ok(base)) = (Path::new(file).canonicalize(), dir.canonicalize()) else {
        return file.to_string();
    };
    let (from, to): (Vec<_>, Vec<_>) = (base.components().collect(), target.components().collect());
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut rel = PathBuf::new();
    for _ in common..from.len() {
        rel.push("..");
    }
    rel.extend(&to[common..]);
    // A bare name would read as a built-in profile's.
    let rel = rel.display().to_string();
    match crate::config::profile::looks_like_path(&rel) {
        true => rel,
        false => format!("./{rel}"),
    }
}

/// The recipe pinned to `trial`'s point: the report's model, hardware,
/// seq_len, global_batch, headroom, price and numerics policy, and a grid of
/// one-value lists. `memfit plan recommended.yaml` replans exactly that point.
/// `dir` is where it is written: a model or hardware file the sweep read
/// is named from there.
pub fn pinned_recipe(report: &SweepReport, trial: &TrialRecord, dir: &Path) -> String {
    let p = &trial.point;
    let mut s = String::new();
    for line in provenance(report, trial) {
        s.push_str(&format!("# {line}\n"));
    }
    if !report.recipe.is_empty() {
        s.push_str(&format!(
            "# Pinned from {}; a relative model or hardware path resolves against this file's folder.\n",
            report.recipe.replace(['\n', '\r'], " ")
        ));
    }
    let model = match &report.model_file {
        Some(f) => file_seen_from(dir, f),
        None => report.model.clone(),
    };
    let hardware = match &report.hardware_file {
        Some(f) => file_seen_from(dir, f),
        None => report.hardware.clone(),
    };
    s.push_str(&format!("model: {}\n", yaml_str(&model)));
    s.push_str(&format!("hardware: {}\n", yaml_str(&hardware)));
    s.push_str(&format!("seq_len: {}\n", report.seq_len));
    s.push_str(&format!("global_batch: {}\n", report.global_batch));
    s.push_str("grid:\n");
    for (k, v) in [
        ("micro_batch", p.micro_batch.to_string()),
        ("precision", name(p.precision)),
        ("checkpointing", name(p.checkpointing)),
        ("attention", name(p.attention)),
        ("optimizer", name(p.optimizer)),
        ("sharding", name(p.sharding)),
        ("gpus", p.gpus.to_string()),
        ("finetune", name(p.finetune)),
    ] {
        s.push_str(&format!("  {k}: [{v}]\n"));
    }
    // The parallel layout and the routing, where they are not the default.
    for (k, v, default) in [
        ("offload", p.offload.name().to_string(), "none"),
        ("pipeline_stages", p.pipeline_stages.to_string(), "1"),
        ("virtual_stages", p.virtual_stages.to_string(), "1"),
        ("shard_group", group::spelled(p.shard_group), "0"),
        ("tensor_parallel", p.tensor_parallel.to_string(), "1"),
        ("hpz_group", group::spelled(p.hpz_group), "0"),
        (
            "sequence_parallel",
            p.sequence_parallel.to_string(),
            "false",
        ),
        ("loss", name(p.loss), "full"),
        ("capacity_factor", p.capacity_factor.spelled(), "null"),
        ("expert_parallel", p.expert_parallel.to_string(), "1"),
        (
            "offload_activations",
            p.offload_activations.to_string(),
            "false",
        ),
        ("tp_comm_overlap", p.tp_comm_overlap.to_string(), "false"),
        (
            "overlap_param_gather",
            p.overlap_param_gather.to_string(),
            "false",
        ),
    ] {
        if v != default {
            s.push_str(&format!("  {k}: [{v}]\n"));
        }
    }
    // A grid that named no framework measured memfit and planned the
    // target as hf-eager; pin the key only when the sweep's grid named it
    // (an hf-eager trial, or a target planned as memfit), or when the
    // device pinned below has a limit: that limit then decides what fits,
    // and it chose this point by the framework measured on it (planned as
    // hf-eager against it, a point that fitted could be out of memory).
    let limited = (report.run_device.spec.parse::<crate::backend::DeviceSpec>())
        .is_ok_and(|d| d.limit.is_some());
    let named = p.framework == crate::engine::Framework::HfEager
        || limited
        || trial
            .target
            .as_ref()
            .is_some_and(|t| t.framework == crate::engine::Framework::Memfit);
    if named {
        s.push_str(&format!("  framework: [{}]\n", name(p.framework)));
    }
    if let Some(h) = report.hf_knobs {
        s.push_str(&pinned_stack_knobs(&h, p));
    }
    if let Some(l) = report
        .lora
        .as_ref()
        .filter(|_| p.finetune != Finetune::Full)
    {
        s.push_str(&format!(
            "lora_rank: {}\nlora_alpha: {:?}\nlora_dropout: {:?}\n",
            l.rank, l.alpha, l.dropout
        ));
        if !l.targets.is_empty() {
            let t: Vec<String> = l.targets.iter().map(|t| name(*t)).collect();
            s.push_str(&format!("lora_targets: [{}]\n", t.join(", ")));
        }
    }
    // The nodes' fabric and host memory the sweep planned with.
    if let Some(net) = &report.network {
        let net = match crate::config::profile::looks_like_path(net) {
            true => file_seen_from(dir, net),
            false => net.clone(),
        };
        s.push_str(&format!("network: {}\n", yaml_str(&net)));
    }
    if let Some(k) = report.attention_kernel.filter(|_| p.attention.fused()) {
        s.push_str(&format!("attention_kernel: {k}\n"));
    }
    if let Some(bytes) = report.host_memory {
        s.push_str(&format!("host_memory: {bytes}B\n"));
    }
    s.push_str(&format!("headroom: {:?}\n", report.headroom));
    let usd = report.target.usd_per_gpu_hour;
    if usd.is_finite() && usd > 0.0 {
        s.push_str(&format!("cost: {usd:?}\n"));
    }
    if let Some(usd) = report
        .pricing
        .usd_per_hour
        .filter(|_| report.pricing.basis == "host")
    {
        s.push_str(&format!("host_usd_per_hour: {usd:?}\n"));
    }
    // Where the trials ran: without it, re-running this recipe would judge
    // fit against the target's memory instead of the capacity that chose it.
    if !report.run_device.spec.is_empty() {
        s.push_str(&format!("device: {}\n", yaml_str(&report.run_device.spec)));
    }
    s.push_str(&format!(
        "allow_numerics_change: {}\n",
        report.allow_numerics_change
    ));
    s
}

/// For a LoRA or QLoRA recommendation: PEFT's `LoraConfig` (and, for QLoRA,
/// transformers' `BitsAndBytesConfig` for 4-bit NF4 with double
/// quantisation, the QLoRA paper's setting) with the knobs it was chosen at.
pub fn peft_config(report: &SweepReport, trial: &TrialRecord) -> Option<String> {
    let p = &trial.point;
    if p.finetune == Finetune::Full {
        return None;
    }
    let l = report.lora.clone().unwrap_or_default();
    use crate::engine::lora::Target;
    let wants = |ts: &[Target]| l.targets.is_empty() || ts.iter().any(|t| l.targets.contains(t));
    // The module names of the model's family (GPT-2's fused c_attn).
    let gpt2 = crate::config::profile::load_model(&report.model)
        .map(|m| m.family == crate::config::Family::Gpt2)
        .unwrap_or_else(|_| report.model.contains("gpt2"));
    let modules: Vec<String> = match gpt2 {
        true => [
            ("c_attn", &[Target::Q, Target::K, Target::V][..]),
            ("attn.c_proj", &[Target::O][..]),
            ("c_fc", &[Target::Up][..]),
            ("mlp.c_proj", &[Target::Down][..]),
        ]
        .iter()
        .filter(|(_, ts)| wants(ts))
        .map(|(m, _)| py_str(m))
        .collect(),
        false => {
            let all = l.targets.is_empty();
            crate::engine::lora::Target::ALL
                .iter()
                .filter(|t| all || l.targets.contains(t))
                .map(|t| py_str(&format!("{}_proj", name(*t))))
                .collect()
        }
    };
    let mut s = String::new();
    for line in provenance(report, trial) {
        s.push_str(&format!("# {line}\n"));
    }
    s.push_str("from peft import LoraConfig\n");
    if p.finetune == Finetune::Qlora {
        s.push_str("import torch\nfrom transformers import BitsAndBytesConfig\n\n");
        s.push_str("bnb_config = BitsAndBytesConfig(\n    load_in_4bit=True,\n    bnb_4bit_quant_type=\"nf4\",\n    bnb_4bit_use_double_quant=True,\n    bnb_4bit_compute_dtype=torch.bfloat16,\n)\n");
    }
    s.push_str(&format!(
        "\nlora_config = LoraConfig(\n    r={},\n    lora_alpha={},\n    lora_dropout={},\n    target_modules=[{}],\n    bias=\"none\",\n    task_type=\"CAUSAL_LM\",\n)\n",
        l.rank,
        py_float(l.alpha as f64),
        py_float(l.dropout as f64),
        modules.join(", ")
    ));
    Some(s)
}

/// Writes `ds_config.json`, `training_args.py` and `recommended.yaml` for the
/// report's recommendation into `dir`; writes nothing (and returns no paths)
/// when there is none.
pub fn write_exports(report: &SweepReport, dir: &Path) -> Result<Vec<PathBuf>> {
    let Some(trial) = report
        .recommendation
        .as_ref()
        .and_then(|r| report.trials.get(r.trial))
    else {
        return Ok(Vec::new());
    };
    std::fs::create_dir_all(dir).map_err(|source| Error::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut files = Vec::new();
    // DeepSpeed's bf16 mode always keeps an fp32 master copy: pure bf16
    // has no DeepSpeed config (training_args.py says so).
    if !trial.point.precision.is_pure() {
        let ds = serde_json::to_string_pretty(&deepspeed_config(report, trial))
            .expect("a JSON value serializes");
        files.push(("ds_config.json", ds + "\n"));
    }
    files.push(("training_args.py", hf_training_args(report, trial)));
    files.push(("recommended.yaml", pinned_recipe(report, trial, dir)));
    if let Some(peft) = peft_config(report, trial) {
        files.push(("peft_config.py", peft));
    }
    let mut written = Vec::new();
    for (file, text) in files {
        let path = dir.join(file);
        std::fs::write(&path, text).map_err(|source| Error::Write {
            path: path.clone(),
            source,
        })?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::PeakBytes;
    use crate::plan::PlanRecipe;
    use crate::report::sweep::{Measured, Outcome, Recommendation, SCHEMA_VERSION};

    fn point(
        micro_batch: usize,
        precision: Precision,
        optimizer: Optimizer,
        sharding: Sharding,
        gpus: usize,
        grad_accum: usize,
    ) -> Point {
        Point {
            micro_batch,
            precision,
            checkpointing: Checkpointing::Full,
            attention: Attention::Fused,
            optimizer,
            sharding,
            gpus,
            grad_accum,
            ..Point::default()
        }
    }

    fn trial(p: Point) -> TrialRecord {
        TrialRecord {
            id: "mb2-x4-zero2-bf16-adamw-full-fused".into(),
            point: p,
            outcome: Outcome::Ran,
            fits: true,
            predicted: None,
            measured: Some(Measured::for_tests(
                PeakBytes {
                    total: 30 << 20,
                    ..Default::default()
                },
                1000.0,
            )),
            memory_error_pct: Some(0.0),
            time_ratio: None,
            nvml_error_pct: None,
            target: None,
            exit: None,
            numerics_changes: vec![],
            note: None,
            elapsed_s: 1.0,
        }
    }

    fn report(trials: Vec<TrialRecord>) -> SweepReport {
        SweepReport {
            schema_version: SCHEMA_VERSION,
            memfit_version: "0.1.0".into(),
            recipe: "recipes/tiny.yaml".into(),
            model: "gpt2-tiny".into(),
            model_file: None,
            hardware: "t4".into(),
            hardware_file: None,
            network: None,
            attention_kernel: None,
            host_memory: None,
            device: "cpu:limit=64MiB".into(),
            capacity_bytes: 64 << 20,
            runtime_overhead_bytes: 0,
            headroom: 0.05,
            allow_numerics_change: false,
            lora: None,
            hf_knobs: None,
            seq_len: 128,
            global_batch: 16,
            grid_size: trials.len(),
            trials_run: trials.len(),
            recommendation: Some(Recommendation {
                trial: 0,
                reasons: vec![],
                runners_up: vec![],
                tied: vec![],
                ranking: None,
            }),
            trials,
            pareto: vec![0],
            interrupted: false,
            nvml: None,
            ..SweepReport::empty_for_tests()
        }
    }

    fn zero2_bf16() -> (SweepReport, TrialRecord) {
        let t = trial(point(
            2,
            Precision::Bf16,
            Optimizer::Adamw,
            Sharding::Zero2,
            4,
            2,
        ));
        (report(vec![t.clone()]), t)
    }

    #[test]
    fn deepspeed_zero2_bf16() {
        let (r, t) = zero2_bf16();
        let ds = deepspeed_config(&r, &t);
        assert_eq!(ds["train_batch_size"], json!(16));
        assert_eq!(ds["train_micro_batch_size_per_gpu"], json!(2));
        assert_eq!(ds["gradient_accumulation_steps"], json!(2));
        assert_eq!(ds["zero_optimization"], json!({ "stage": 2 }));
        assert_eq!(ds["bf16"], json!({ "enabled": true }));
        assert_eq!(ds["fp16"], json!({ "enabled": false }));
        assert_eq!(ds["gradient_clipping"], json!(1.0));
        assert_eq!(
            ds["activation_checkpointing"],
            json!({
                "partition_activations": false,
                "contiguous_memory_optimization": false,
                "cpu_checkpointing": false,
            })
        );
        assert_eq!(
            ds["optimizer"],
            json!({
                "type": "AdamW",
                "params": { "lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1 },
            })
        );
        assert!(ds.get("zero_allow_untested_optimizer").is_none());
    }

    #[test]
    fn deepspeed_fp16_scaler_and_client_optimizers() {
        let mut p = point(
            4,
            Precision::Fp16,
            Optimizer::Adamw8bit,
            Sharding::Ddp,
            2,
            2,
        );
        p.checkpointing = Checkpointing::None;
        let t = trial(p);
        let ds = deepspeed_config(&report(vec![t.clone()]), &t);
        assert_eq!(ds["zero_optimization"]["stage"], json!(0));
        assert_eq!(ds["bf16"]["enabled"], json!(false));
        assert_eq!(
            ds["fp16"],
            json!({
                "enabled": true,
                "loss_scale": 0,
                "initial_scale_power": 16,
                "loss_scale_window": 2000,
                "hysteresis": 1,
                "min_loss_scale": 1,
            })
        );
        assert!(ds.get("activation_checkpointing").is_none());
        assert!(ds.get("optimizer").is_none());
        assert_eq!(ds["zero_allow_untested_optimizer"], json!(true));
        let stages: Vec<u8> = [
            Sharding::None,
            Sharding::Ddp,
            Sharding::Zero1,
            Sharding::Zero2,
            Sharding::Zero3,
        ]
        .map(zero_stage)
        .to_vec();
        assert_eq!(stages, [0, 0, 1, 2, 3]);
    }

    #[test]
    fn hf_snippet_zero2_bf16() {
        let (r, t) = zero2_bf16();
        let py = hf_training_args(&r, &t);
        for want in [
            "TrainingArguments(\n",
            "    per_device_train_batch_size=2,\n",
            "    gradient_accumulation_steps=2,\n",
            "    gradient_checkpointing=True,\n",
            "    bf16=True,\n",
            "    fp16=False,\n",
            "    optim=\"adamw_torch\",\n",
            "    learning_rate=0.0003,\n",
            "    weight_decay=0.1,\n",
            "    max_grad_norm=1.0,\n",
            "    deepspeed=\"ds_config.json\",\n",
            "deepspeed --num_gpus=4 train.py",
            "    gradient_checkpointing_kwargs={\"use_reentrant\": False},\n",
        ] {
            assert!(py.contains(want), "missing {want:?} in\n{py}");
        }
        // The attention kernel is passed where the model is loaded, in code.
        let load = &py[py
            .find("model = AutoModelForCausalLM.from_pretrained(")
            .unwrap()..];
        let load = &load[..load.find("\n)\n").unwrap()];
        let code: Vec<&str> = load.lines().map(|l| l.split('#').next().unwrap()).collect();
        assert!(
            code.contains(&"    attn_implementation=\"sdpa\",  "),
            "{load}"
        );
    }

    #[test]
    fn hf_snippet_names_paged_optimizers_as_transformers_does() {
        for (o, want) in [
            (Optimizer::PagedAdamw, "paged_adamw_32bit"),
            (Optimizer::PagedAdamw8bit, "paged_adamw_8bit"),
        ] {
            let t = trial(point(2, Precision::Bf16, o, Sharding::None, 1, 8));
            let py = hf_training_args(&report(vec![t.clone()]), &t);
            for line in [
                format!("    optim=\"{want}\",\n"),
                "    adam_beta2=0.999,\n".into(),
                "# Paged optimizers need bitsandbytes".into(),
            ] {
                assert!(py.contains(&line), "missing {line:?} in\n{py}");
            }
        }
    }

    /// Every export variant is Python that parses (with python3 when this
    /// host has it; skipped, saying so, when it does not).
    #[test]
    fn training_args_parse_as_python() {
        let dir = std::env::temp_dir().join(format!("memfit-export-py-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut files = Vec::new();
        for (i, (precision, optimizer, sharding, checkpointing, attention)) in [
            (
                Precision::Bf16,
                Optimizer::Adamw,
                Sharding::Zero2,
                Checkpointing::Full,
                Attention::Fused,
            ),
            (
                Precision::Fp16,
                Optimizer::Adamw8bit,
                Sharding::Ddp,
                Checkpointing::None,
                Attention::Eager,
            ),
            (
                Precision::Bf16,
                Optimizer::Adamw,
                Sharding::Zero3,
                Checkpointing::Selective,
                Attention::Fused,
            ),
            (
                Precision::Fp32,
                Optimizer::Sgd,
                Sharding::None,
                Checkpointing::Full,
                Attention::Eager,
            ),
            (
                Precision::Bf16,
                Optimizer::Adafactor,
                Sharding::Zero3,
                Checkpointing::None,
                Attention::Fused,
            ),
        ]
        .into_iter()
        .enumerate()
        {
            let mut p = point(2, precision, optimizer, sharding, 2, 4);
            p.checkpointing = checkpointing;
            p.attention = attention;
            let t = trial(p);
            let py = hf_training_args(&report(vec![t.clone()]), &t);
            let want = match attention {
                Attention::Fused => "    attn_implementation=\"sdpa\",",
                Attention::FlashAttention2 => "    attn_implementation=\"flash_attention_2\",",
                Attention::Eager => "    attn_implementation=\"eager\",",
            };
            assert!(py.contains(want), "{py}");
            let path = dir.join(format!("training_args_{i}.py"));
            std::fs::write(&path, py).unwrap();
            files.push(path);
        }
        let out = std::process::Command::new("python3")
            .arg("-c")
            .arg("import ast, sys\nfor f in sys.argv[1:]:\n    ast.parse(open(f).read(), f)")
            .args(&files)
            .output();
        let _ = std::fs::remove_dir_all(&dir);
        match out {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                eprintln!("python3 not found: training_args.py not parsed");
            }
            Err(e) => panic!("running python3: {e}"),
            Ok(out) => assert!(
                out.status.success(),
                "training_args.py does not parse:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ),
        }
    }

    /// TrainingArguments has no selective checkpointing: the snippet says
    /// how torchtitan builds it and leaves gradient_checkpointing off.
    #[test]
    fn hf_snippet_names_selective_checkpointing() {
        let mut p = point(2, Precision::Bf16, Optimizer::Adamw, Sharding::Zero3, 8, 1);
        p.checkpointing = Checkpointing::Selective;
        let t = trial(p);
        let py = hf_training_args(&report(vec![t.clone()]), &t);
        assert!(py.contains("create_selective_checkpoint_contexts"), "{py}");
        assert!(py.contains("\n    gradient_checkpointing=False,\n"), "{py}");
        let ds = deepspeed_config(&report(vec![t.clone()]), &t);
        assert!(ds.get("activation_checkpointing").is_none());
    }

    #[test]
    fn hf_snippet_ddp_and_single_gpu() {
        let mut p = point(4, Precision::Fp32, Optimizer::Sgd, Sharding::Ddp, 2, 2);
        p.checkpointing = Checkpointing::None;
        p.attention = Attention::Eager;
        let t = trial(p);
        let py = hf_training_args(&report(vec![t.clone()]), &t);
        assert!(py.contains("torchrun --nproc_per_node=2"), "{py}");
        assert!(!py.contains("deepspeed="), "{py}");
        assert!(py.contains("    gradient_checkpointing=False,\n"), "{py}");
        assert!(py.contains("    bf16=False,\n    fp16=False,\n"), "{py}");
        assert!(py.contains("    optim=\"sgd\",\n"), "{py}");
        assert!(py.contains("momentum=0.9"), "{py}");

        let mut p = point(
            16,
            Precision::Bf16,
            Optimizer::Adafactor,
            Sharding::None,
            1,
            1,
        );
        p.checkpointing = Checkpointing::None;
        let t = trial(p);
        let py = hf_training_args(&report(vec![t.clone()]), &t);
        assert!(py.contains("    optim=\"adafactor\",\n"), "{py}");
        assert!(
            !py.contains("torchrun") && !py.contains("deepspeed"),
            "{py}"
        );
        let p = point(
            8,
            Precision::Bf16,
            Optimizer::Adamw8bit,
            Sharding::Zero3,
            2,
            1,
        );
        let t = trial(p);
        let py = hf_training_args(&report(vec![t.clone()]), &t);
        assert!(py.contains("    optim=\"adamw_bnb_8bit\",\n"), "{py}");
        assert!(py.contains("ZeRO-3"), "{py}");
    }

    #[test]
    fn pinned_recipe_round_trips() {
        let (r, t) = zero2_bf16();
        let yaml = pinned_recipe(&r, &t, Path::new("."));
        let back: PlanRecipe = serde_yaml_ng::from_str(&yaml).expect(&yaml);
        assert_eq!(back.model, "gpt2-tiny");
        assert_eq!(back.hardware, "t4");
        assert_eq!(back.seq_len, 128);
        assert_eq!(back.global_batch, 16);
        assert_eq!(back.headroom, 0.05);
        assert_eq!(back.cost, Some(0.53));
        assert_eq!(back.host_usd_per_hour, Some(2.5));
        // The run device is pinned too: without it, re-running the recipe
        // would judge fit against the target's memory.
        assert_eq!(
            back.device.as_ref().and_then(|d| d.limit),
            Some(64 << 20),
            "{yaml}"
        );
        assert!(!back.allow_numerics_change);
        // That limit decides what fits, so the framework measured on it is
        // pinned too: planned as hf-eager (`memfit plan`'s default) against
        // it, the recommendation could come out of memory.
        assert_eq!(back.grid.framework, [crate::engine::Framework::Memfit]);
        let points = crate::plan::expand(&back);
        assert_eq!(points, vec![t.point]);
    }

    /// The fabric and the host memory the sweep planned with are pinned:
    /// without them the recipe would plan another network's collectives
    /// and another capacity for offloaded tensors.
    #[test]
    fn the_network_and_host_memory_are_pinned() {
        let (mut r, t) = zero2_bf16();
        assert!(!pinned_recipe(&r, &t, Path::new(".")).contains("network"));
        r.network = Some("ib-ndr-400".into());
        r.host_memory = Some(64 << 30);
        let yaml = pinned_recipe(&r, &t, Path::new("."));
        let back: PlanRecipe = serde_yaml_ng::from_str(&yaml).expect(&yaml);
        assert_eq!(back.network.as_deref(), Some("ib-ndr-400"), "{yaml}");
        assert_eq!(
            back.knobs.host_memory.map(|b| b.0),
            Some(64 << 30),
            "{yaml}"
        );
    }

    /// hf-eager's `liger` is pinned with the point and exported as the
    /// Trainer's `use_liger_kernel`; flash-attention-2 as transformers
    /// spells it.
    #[test]
    fn liger_and_flash_attention_2_are_pinned_and_exported() {
        let mut p = point(1, Precision::Bf16, Optimizer::Adamw, Sharding::None, 1, 16);
        p.framework = crate::engine::Framework::HfEager;
        p.attention = Attention::FlashAttention2;
        p.loss = crate::engine::Loss::FusedLinear;
        let t = trial(p);
        let mut r = report(vec![t.clone()]);
        r.hf_knobs = Some(crate::engine::framework::HfKnobs {
            liger: true,
            ..Default::default()
        });
        let yaml = pinned_recipe(&r, &t, Path::new("."));
        assert!(yaml.contains("liger: true\n"), "{yaml}");
        let back: PlanRecipe = serde_yaml_ng::from_str(&yaml).expect(&yaml);
        assert!(back.hf_knobs().liger, "{yaml}");
        assert_eq!(crate::plan::expand(&back), vec![t.point]);
        let py = hf_training_args(&r, &t);
        assert!(py.contains("    use_liger_kernel=True,\n"), "{py}");
        assert!(!py.contains("liger_kernel_config"), "{py}");
        assert!(
            py.contains("attn_implementation=\"flash_attention_2\""),
            "{py}"
        );
        // Liger's kernels with transformers' loss: FLCE turned off.
        let mut t2 = t.clone();
        t2.point.loss = crate::engine::Loss::Full;
        let py = hf_training_args(&r, &t2);
        assert!(
            py.contains("{\"fused_linear_cross_entropy\": False}"),
            "{py}"
        );
        // Without it, neither appears.
        r.hf_knobs = Some(Default::default());
        assert!(!pinned_recipe(&r, &t, Path::new(".")).contains("liger"));
        assert!(!hf_training_args(&r, &t).contains("liger"));
    }

    #[test]
    fn hpz_exports_deepspeeds_partition_size_and_pins_its_group() {
        let mut p = point(1, Precision::Bf16, Optimizer::Adamw, Sharding::Zero3, 16, 1);
        p.hpz_group = group::from_size(8);
        let t = trial(p);
        let r = report(vec![t.clone()]);
        let ds = deepspeed_config(&r, &t);
        assert_eq!(
            ds["zero_optimization"],
            json!({ "stage": 3, "zero_hpz_partition_size": 8 })
        );
        let yaml = pinned_recipe(&r, &t, Path::new("."));
        assert!(yaml.contains("  hpz_group: [8]\n"), "{yaml}");
        let back: PlanRecipe = serde_yaml_ng::from_str(&yaml).expect(&yaml);
        assert_eq!(crate::plan::expand(&back), vec![t.point]);
        let id = crate::sweep::driver::trial_id(&t.point);
        assert!(id.starts_with("hpz8-gpus16-zero3-"), "{id}");
        assert!(t.point.label().starts_with("hpz8 mb1 x16 zero3"));
        // Off, none of it appears.
        let (r, t) = zero2_bf16();
        assert!(!pinned_recipe(&r, &t, Path::new(".")).contains("hpz"));
        assert!(!crate::sweep::driver::trial_id(&t.point).contains("hpz"));
    }

    /// Virtual stages pin their grid key beside the pipeline's, so that
    /// `memfit plan recommended.yaml` replans the interleaved point; at 1
    /// neither appears.
    #[test]
    fn virtual_stages_are_pinned() {
        // 8 GPUs: 4 stages x 2 replicas, 16 sequences in 8 micro-batches each.
        let mut p = point(1, Precision::Bf16, Optimizer::Adamw, Sharding::Ddp, 8, 8);
        p.pipeline_stages = 4;
        p.virtual_stages = 2;
        let t = trial(p);
        let r = report(vec![t.clone()]);
        let yaml = pinned_recipe(&r, &t, Path::new("."));
        assert!(
            yaml.contains("  pipeline_stages: [4]\n  virtual_stages: [2]\n"),
            "{yaml}"
        );
        let back: PlanRecipe = serde_yaml_ng::from_str(&yaml).expect(&yaml);
        assert_eq!(crate::plan::expand(&back), vec![t.point]);
        let (r, t) = zero2_bf16();
        assert!(!pinned_recipe(&r, &t, Path::new(".")).contains("virtual"));
    }

    /// A capacity factor pins its grid key and names itself in the trial
    /// id and the label; dropless, none of it appears and the id is as
    /// before the axis.
    #[test]
    fn a_capacity_factor_is_pinned_and_in_the_trial_id() {
        let mut p = point(1, Precision::Bf16, Optimizer::Adamw, Sharding::Zero2, 4, 4);
        p.capacity_factor = crate::plan::Capacity(Some(125));
        let t = trial(p);
        let r = report(vec![t.clone()]);
        let yaml = pinned_recipe(&r, &t, Path::new("."));
        assert!(yaml.contains("  capacity_factor: [1.25]\n"), "{yaml}");
        let back: PlanRecipe = serde_yaml_ng::from_str(&yaml).expect(&yaml);
        assert_eq!(crate::plan::expand(&back), vec![t.point]);
        let id = crate::sweep::driver::trial_id(&t.point);
        assert!(id.starts_with("cf1.25-gpus4-zero2-"), "{id}");
        assert!(t.point.label().starts_with("cf1.25 mb1 x4 zero2"));
        let (r, t) = zero2_bf16();
        assert!(!pinned_recipe(&r, &t, Path::new(".")).contains("capacity"));
        let id = crate::sweep::driver::trial_id(&t.point);
        assert!(id.starts_with("gpus") && !id.contains("cf"), "{id}");
    }

    #[test]
    fn pinned_recipe_quotes_odd_names() {
        let (mut r, mut t) = zero2_bf16();
        r.model = "models/my: model.yaml".into();
        r.hardware = "yes".into();
        t.point.optimizer = Optimizer::Adamw8bit;
        let yaml = pinned_recipe(&r, &t, Path::new("."));
        let back: PlanRecipe = serde_yaml_ng::from_str(&yaml).expect(&yaml);
        assert_eq!(back.model, "models/my: model.yaml");
        assert_eq!(back.hardware, "yes");
        assert_eq!(back.grid.optimizer, vec![Optimizer::Adamw8bit]);
    }

    #[test]
    fn writes_exports_only_with_a_recommendation() {
        let dir = std::env::temp_dir().join(format!("memfit-export-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (mut r, _) = zero2_bf16();
        let paths = write_exports(&r, &dir).unwrap();
        let names: Vec<_> = paths
            .iter()
            .map(|p| p.file_name().unwrap().to_str().unwrap().to_string())
            .collect();
        assert_eq!(
            names,
            ["ds_config.json", "training_args.py", "recommended.yaml"]
        );
        let ds: Value = serde_json::from_str(&std::fs::read_to_string(&paths[0]).unwrap()).unwrap();
        assert_eq!(ds["zero_optimization"]["stage"], json!(2));
        let _ = std::fs::remove_dir_all(&dir);
        r.recommendation = None;
        assert!(write_exports(&r, &dir).unwrap().is_empty());
        assert!(!dir.exists());
    }

    /// Pure bf16 has no DeepSpeed layout (its bf16 mode always keeps an
    /// fp32 master): no ds_config.json, the model loaded in bf16 without
    /// autocast, FSDP2 for zero3; the optimizer in the backward turns
    /// clipping off and is pinned in the recipe.
    #[test]
    fn pure_bf16_exports_no_deepspeed_config_and_loads_the_model_in_bf16() {
        let dir = std::env::temp_dir().join(format!("memfit-export-pure-{}", std::process::id()));
        let write = |r: &SweepReport| {
            let _ = std::fs::remove_dir_all(&dir);
            let paths = write_exports(r, &dir).unwrap();
            let names: Vec<_> = paths
                .iter()
                .map(|p| p.file_name().unwrap().to_str().unwrap().to_string())
                .collect();
            assert_eq!(names, ["training_args.py", "recommended.yaml"]);
            let py = std::fs::read_to_string(&paths[0]).unwrap();
            let yaml = std::fs::read_to_string(&paths[1]).unwrap();
            (py, yaml)
        };
        let p = point(
            2,
            Precision::Bf16Pure,
            Optimizer::Adamw,
            Sharding::Zero3,
            4,
            2,
        );
        let (py, _) = write(&report(vec![trial(p)]));
        for needle in [
            "torch_dtype=torch.bfloat16",
            "bf16=False",
            "fsdp=\"full_shard\"",
            "FSDP2",
        ] {
            assert!(py.contains(needle), "{needle} missing from:\n{py}");
        }
        assert!(!py.contains("deepspeed="), "{py}");
        // One GPU, the optimizer in the backward: no clipping, said so.
        let p = point(
            2,
            Precision::Bf16Pure,
            Optimizer::Adamw,
            Sharding::None,
            1,
            1,
        );
        let mut r = report(vec![trial(p)]);
        r.hf_knobs = Some(crate::report::sweep::HfKnobs {
            optimizer_in_backward: true,
            ..Default::default()
        });
        let (py, yaml) = write(&r);
        for needle in ["max_grad_norm=0.0", "optimizer_in_bwd"] {
            assert!(py.contains(needle), "{needle} missing from:\n{py}");
        }
        let back: PlanRecipe = serde_yaml_ng::from_str(&yaml).expect(&yaml);
        assert_eq!(back.grid.precision, vec![Precision::Bf16Pure]);
        assert!(back.hf_knobs().optimizer_in_backward, "{yaml}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
