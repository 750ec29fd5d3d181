//! `memfit run`'s options from its knobs: each from its flag, else the
//! run recipe's key, else the default; knobs that would do nothing are
//! refused, and an error in a value the recipe gave names the recipe's
//! file, line and key (`memfit run`, `memfit launch`'s ranks and `memfit
//! watch`'s prediction all resolve them here).

use std::path::{Path, PathBuf};

use super::RunOptions;
use super::recipe::{RunRecipe, load_run_recipe};
use crate::backend::DeviceSpec;
use crate::config::knobs::group;
use crate::config::limits::check_threads;
use crate::config::profile::load_model;
use crate::engine::{Finetune, Framework, TrainConfig};
use crate::error::{Error, Result};
use crate::knobs::{Knobs, RunDevice};

/// The run's options: each knob from its flag, else the recipe, else the
/// default. With a recipe they are validated here, so that an error in a
/// value the recipe gave names the recipe's file, line and key.
pub fn resolve(
    recipe: Option<&Path>,
    flags: &Knobs,
    timeline: Option<PathBuf>,
) -> Result<RunOptions> {
    let Some(path) = recipe else {
        return merge(flags, &RunRecipe::default(), timeline);
    };
    let r = load_run_recipe(path)?;
    let blame = |e: Error| match e {
        Error::InvalidArg { flag, message } => match recipe_key(flags, &r, &flag) {
            Some(key) => r.error(key, message),
            None => Error::InvalidArg { flag, message },
        },
        other => other,
    };
    let opts = merge(flags, &r, timeline).map_err(blame)?;
    let model = match load_model(&opts.model) {
        Ok(model) => model,
        Err(e @ Error::Config { .. }) => return Err(e),
        // An unknown name or an unreadable file: run() says so for a flag.
        Err(e) if flags.model.is_none() => return Err(r.error("model", e)),
        Err(_) => return Ok(opts),
    };
    super::validate(&opts, &model).map_err(blame)?;
    Ok(opts)
}

/// The recipe key that gave the value `flag` complains about, when the
/// flag itself was not given.
fn recipe_key(flags: &Knobs, r: &RunRecipe, flag: &str) -> Option<&'static str> {
    let key = flag.trim_start_matches("--").replace('-', "_");
    // Two spellings of one knob: either flag overrides either key.
    let wanted: &[&str] = match key.as_str() {
        "grad_accum" | "microbatches" => &["grad_accum", "microbatches"],
        k => &[k],
    };
    let given = wanted.iter().any(|k| flags.has(k));
    (Knobs::NAMES.iter())
        .find(|k| wanted.contains(k) && !given && r.knobs.has(k))
        .copied()
}

fn merge(flags: &Knobs, r: &RunRecipe, timeline: Option<PathBuf>) -> Result<RunOptions> {
    let d = TrainConfig::default();
    let keys = &r.knobs;
    // Each knob from its flag, else the recipe's key.
    let k = flags.or(keys);
    let stages = k.pipeline_stages.unwrap_or(d.pipeline_stages);
    let tensor_parallel = k.tensor_parallel.unwrap_or(d.tensor_parallel);
    let framework = k.framework.unwrap_or(d.framework);
    let finetune = k.finetune.unwrap_or(d.finetune);
    // Knobs that would do nothing in this configuration are refused
    // (by the flag's name; a recipe's key is blamed in `options`).
    let refuse = |names: &[&str], why: &str| match names.iter().find(|n| k.has(n)) {
        Some(n) => Err(Error::invalid_arg(
            &format!("--{}", n.replace('_', "-")),
            why.to_string(),
        )),
        None => Ok(()),
    };
    if finetune == Finetune::Full {
        let lora = ["lora_rank", "lora_alpha", "lora_dropout", "lora_targets"];
        refuse(&lora, "applies to LoRA only; add --finetune lora")?;
    }
    if framework == Framework::Memfit {
        // The engine's own schedule has no dropout, keeps its gradients
        // resident and updates in place: these would do nothing there.
        refuse(
            &[
                "dropout",
                "optimizer_impl",
                "set_to_none",
                "param_groups",
                "liger",
            ],
            "describes PyTorch's implementation; add --framework hf-eager",
        )?;
    }
    if k.optimizer_impl == Some(crate::engine::OptimizerImpl::Fused) {
        refuse(
            &["param_groups"],
            "fused AdamW updates each group in one kernel with no temporaries, so the grouping changes no memory; it applies to --optimizer-impl foreach or single-tensor",
        )?;
    }
    let loss = k.loss.unwrap_or(d.loss);
    if loss != crate::engine::Loss::Chunked {
        refuse(
            &["loss_chunks", "compile_loss"],
            "applies to --loss chunked only",
        )?;
    }
    // Without a pipeline both schedules are plain accumulation: a
    // schedule or a partition given there would do nothing.
    if stages == 1 {
        refuse(
            &["schedule", "virtual_stages", "partition"],
            "applies to pipelines only; add --pipeline-stages 2 or more",
        )?;
    }
    let lora = k.lora();
    let (device, target) = match k.device.clone() {
        None => (DeviceSpec::new(crate::backend::DeviceKind::Cpu, None), None),
        Some(RunDevice::Device(d)) => (d, None),
        // As `memfit balance --device meta:GPU`: the tensors get what
        // the runtime leaves of the GPU's memory.
        Some(RunDevice::Gpu(hw)) => (
            DeviceSpec::new(crate::backend::DeviceKind::Meta, Some(hw.usable_memory())),
            Some(*hw),
        ),
    };
    // The knobs marked [train] in src/knobs.rs set their fields; these
    // need more than a copy.
    let mut train = TrainConfig {
        // A flag (either spelling) overrides the recipe's key (either).
        grad_accum: match microbatches(flags.grad_accum, flags.microbatches)? {
            Some(a) => a,
            None => microbatches(keys.grad_accum, keys.microbatches)?.unwrap_or(d.grad_accum),
        },
        lr: k.lr,
        beta1: k.beta1,
        capacity_factor: k.capacity_factor,
        ranks: k.ranks.unwrap_or(stages * tensor_parallel),
        partition: k.partition.as_deref().map(parse_partition).transpose()?,
        lora,
        host_memory: k.host_memory.map(|b| b.0).or(d.host_memory),
        // 0 spells off, as reports write it.
        shard_group: k.shard_group.and_then(group::from_size),
        hpz_group: k.hpz_group.and_then(group::from_size),
        ..d
    };
    k.apply(&mut train);
    Ok(RunOptions {
        model: k.model.clone().unwrap_or_else(|| "gpt2-tiny".into()),
        train,
        steps: k.steps.unwrap_or(20),
        device,
        target,
        data: k.data.clone(),
        // The recipe's key is checked as the flag is (clap): a pool of
        // 100,000 threads takes minutes to start.
        threads: (k.threads)
            .map(check_threads)
            .transpose()
            .map_err(|m| Error::invalid_arg("--threads", m))?,
        timeline,
        phase_peaks: false,
        timing: None,
    })
}

/// `--grad-accum` and `--microbatches` name one knob: either, or both when equal.
fn microbatches(accum: Option<usize>, micro: Option<usize>) -> Result<Option<usize>> {
    match (accum, micro) {
        (Some(a), Some(m)) if a != m => Err(Error::invalid_arg(
            "--microbatches",
            format!(
                "{m} differs from --grad-accum {a}; both count the micro-batches of one step, give one"
            ),
        )),
        (a, m) => Ok(a.or(m)),
    }
}

/// `--partition 0:6,6:12`: contiguous half-open block ranges from 0, as
/// blocks per stage (`0:0`: a first stage with the embedding only). Whether
/// they cover the model is checked against it later.
pub fn parse_partition(text: &str) -> Result<Vec<usize>> {
    let bad = |why: String| {
        Error::invalid_arg(
            "--partition",
            format!("`{text}`: {why}; write stage ranges such as 0:6,6:12"),
        )
    };
    let mut out = Vec::new();
    let mut at = 0usize;
    for part in text.split(',') {
        let (a, b) = part
            .trim()
            .split_once(':')
            .ok_or_else(|| bad(format!("`{part}` is not a range lo:hi")))?;
        let num = |x: &str| {
            x.trim()
                .parse::<usize>()
                .map_err(|_| bad(format!("`{x}` is not a layer index")))
        };
        let (a, b) = (num(a)?, num(b)?);
        if a != at {
            return Err(bad(format!(
                "stage {} starts at {a}, but the one before ends at {at}",
                out.len()
            )));
        }
        if b < a {
            return Err(bad(format!(
                "stage {} ({a}:{b}) ends before it starts",
                out.len()
            )));
        }
        out.push(b - a);
        at = b;
    }
    Ok(out)
}
