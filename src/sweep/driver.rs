//! The sweep loop: which grid points to measure, running each as a child
//! process with a timeout, the journal, resume and Ctrl-C, and the
//! recommendation over what was measured.

use std::collections::HashMap;
use std::io::{BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::trial::{TrialOutput, TrialSpec};
use crate::backend::{DeviceKind, DeviceSpec};
use crate::engine::Framework;
use crate::error::{Error, Result};
use crate::plan::{
    PlanTarget, Point, Prediction, Rates, Verdict, expand, load_recipe, name, predict,
};
use crate::report::sweep::{
    ExitInfo, Measured, Outcome, Predicted, Pricing, Ranking, Recommendation, RunDevice,
    SCHEMA_VERSION, SweepReport, Target, TargetPrediction, TimingPolicy, TrialRecord,
};
use rayon::prelude::*;

/// What `memfit sweep` was asked to do.
#[derive(Clone, Debug)]
pub struct SweepOptions {
    pub recipe: PathBuf,
    /// Overrides the recipe's `device`.
    pub device: Option<DeviceSpec>,
    pub out: PathBuf,
    pub resume: bool,
    /// Run every valid point instead of bisecting the fit boundary.
    pub exhaustive: bool,
    /// How each trial times its steps (warm-up, then repeats until the
    /// median's interval is tight or the budget is spent).
    pub timing: crate::stats::Timing,
    pub timeout: Duration,
    pub threads: Option<usize>,
    /// Test hook (`test-hooks`): make the trial at this position in run
    /// order fail.
    #[cfg(feature = "test-hooks")]
    pub fault: Option<(usize, crate::faults::Fault)>,
    /// Draw a progress bar on stderr (it hides itself when stderr is not a terminal).
    pub progress: bool,
    /// Live control and events for an interactive front end (the TUI).
    pub hooks: Option<Hooks>,
    /// Grid indices to measure again even when the journal has them (the
    /// TUI's re-run); their new records replace the old ones.
    pub rerun: Vec<usize>,
    /// Where trials run: child processes here, or a Slurm job array.
    pub executor: Executor,
    /// Take over `--out`'s lock even when it names a live-looking sweep
    /// on another host (`--break-lock`).
    pub break_lock: bool,
    /// How the cheapest trials are timed again, interleaved, before the
    /// recommendation ranks them ([`super::retime`]).
    pub retime: super::retime::Retime,
    /// Where a line per finished trial goes as the sweep runs.
    pub lines: Lines,
}

/// Where `memfit sweep` writes one line per finished trial as it finishes:
/// nowhere (a terminal, where the progress bar shows them), stdout (piped,
/// with the table to follow), or stderr (piped, with JSON on stdout).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Lines {
    #[default]
    Off,
    Stdout,
    Stderr,
}

/// Where a sweep's trials run. Both record, journal and classify a trial
/// the same way; they differ in how many trials one round hands them.
#[derive(Clone, Debug, Default)]
pub enum Executor {
    /// One child process at a time on this host (`memfit trial`).
    #[default]
    Local,
    /// Each round of the selection as one `sbatch` job array
    /// ([`super::slurm`]): every trial it can decide without the others'
    /// results, at once.
    Slurm(super::slurm::SlurmOptions),
}

/// What the sweep tells a front end as it goes.
#[derive(Clone, Debug)]
pub enum SweepEvent {
    /// The grid as planned, before any trial runs.
    Planned(Vec<Prediction>),
    TrialStarted {
        index: usize,
    },
    /// The running trial's tracked live bytes and its process's RSS.
    Sample {
        t_s: f64,
        tracked: u64,
        rss: Option<u64>,
        /// The trial process's GPU memory as NVML sees it, on a GPU with NVML.
        nvml: Option<u64>,
    },
    TrialFinished {
        index: usize,
        record: Box<TrialRecord>,
    },
    Finished(Box<SweepReport>),
}

/// A front end's handle on a running sweep.
#[derive(Clone)]
pub struct Hooks {
    pub on_event: Arc<dyn Fn(SweepEvent) + Send + Sync>,
    /// Set: stop after killing the running trial (like Ctrl-C).
    pub stop: Arc<AtomicBool>,
    /// Set: start no new trial until cleared.
    pub pause: Arc<AtomicBool>,
    /// How often a trial reports its live memory.
    pub sample_ms: u64,
}

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooks")
            .field("sample_ms", &self.sample_ms)
            .finish()
    }
}

/// A stable key for a configuration: what the journal, `--resume` and
/// `memfit check` match on.
pub fn trial_id(p: &Point) -> String {
    let fw = match p.framework {
        Framework::Memfit => "",
        Framework::HfEager => "hf_eager-",
    };
    let fw = match p.finetune {
        crate::engine::Finetune::Full => fw.to_string(),
        crate::engine::Finetune::Lora => format!("{fw}lora-"),
        crate::engine::Finetune::Qlora => format!("{fw}qlora-"),
    };
    let fw = match p.offload {
        crate::engine::Offload::None => fw,
        crate::engine::Offload::Optimizer => format!("{fw}offload_opt-"),
        crate::engine::Offload::OptimizerParams => format!("{fw}offload_opt_params-"),
    };
    let fw = match p.pipeline_stages {
        1 => fw,
        s => format!("{fw}pp{s}-"),
    };
    // Only when set, so that the ids of other points are as before.
    let fw = match p.virtual_stages {
        1 => fw,
        v => format!("{fw}vpp{v}-"),
    };
    let fw = match p.shard_group {
        None => fw,
        Some(g) => format!("{fw}hybrid{g}-"),
    };
    let fw = match p.tensor_parallel {
        1 => fw,
        t => format!("{fw}tp{t}-"),
    };
    let fw = match p.sequence_parallel {
        false => fw,
        true => format!("{fw}sp-"),
    };
    // Only when set, so that the ids of points without it are as before.
    let fw = match p.tp_comm_overlap {
        false => fw,
        true => format!("{fw}tpov-"),
    };
    // Only when set, so that the ids of points without it are as before.
    let fw = match p.overlap_param_gather {
        false => fw,
        true => format!("{fw}pgov-"),
    };
    // Only when set, so that the ids of points without it are as before.
    let fw = match p.offload_activations {
        false => fw,
        true => format!("{fw}actoff-"),
    };
    let fw = match p.loss {
        crate::engine::Loss::Full => fw,
        l => format!("{fw}{}-", crate::config::knobs::name(l)),
    };
    let fw = match p.hpz_group {
        None => fw,
        Some(g) => format!("{fw}hpz{g}-"),
    };
    // Only when set, so that the ids of dropless points are as before.
    let fw = match p.capacity_factor.is_dropless() {
        true => fw,
        false => format!("{fw}cf{}-", p.capacity_factor),
    };
    let fw = match p.expert_parallel {
        1 => fw,
        e => format!("{fw}ep{e}-"),
    };
    format!(
        "{fw}gpus{}-{}-{}-{}-ckpt_{}-{}-mb{}-accum{}",
        p.gpus,
        name(p.sharding),
        name(p.precision),
        name(p.optimizer),
        name(p.checkpointing),
        name(p.attention),
        p.micro_batch,
        p.grad_accum
    )
}

/// Points that differ only in micro-batch (and so in accumulation).
fn group_key(p: &Point) -> Point {
    Point {
        micro_batch: 0,
        grad_accum: 0,
        ..*p
    }
}

/// Where one group's search stands: the micro-batches that are measured
/// next, given what is measured so far.
struct Selection {
    /// Valid points, by increasing micro-batch.
    valid: Vec<usize>,
    invalid: Vec<usize>,
    stage: Stage,
}

/// Positions are into [`Selection::valid`].
#[derive(Clone, Copy, Debug)]
enum Stage {
    /// The largest micro-batch predicted to fit, measured first.
    First(usize),
    /// Bisecting for the first micro-batch that does not fit: `hi` is known
    /// not to fit; everything below `lo` fits.
    Bisect {
        lo: usize,
        hi: usize,
    },
    /// Every position below this one fits (memory is monotone in the
    /// micro-batch), but speed is not: each is measured for its tokens/s,
    /// so the cheapest is found as an exhaustive sweep would find it.
    Fill(usize),
    Done,
}

impl Selection {
    fn new(mut idx: Vec<usize>, preds: &[Prediction], exhaustive: bool) -> Self {
        idx.sort_by_key(|&i| preds[i].point.micro_batch);
        let (valid, invalid): (Vec<usize>, Vec<usize>) = idx
            .into_iter()
            .partition(|&i| !matches!(preds[i].verdict, Verdict::Invalid { .. }));
        let stage = if exhaustive {
            Stage::Fill(valid.len())
        } else {
            match valid
                .iter()
                .rposition(|&i| preds[i].verdict == Verdict::Fits)
            {
                Some(cand) => Stage::First(cand),
                None => Stage::Done,
            }
        };
        Selection {
            valid,
            invalid,
            stage,
        }
    }

    /// Moves past every step the records settle.
    fn advance(&mut self, records: &[Option<TrialRecord>]) {
        let fits = |pos: usize| records[self.valid[pos]].as_ref().map(|r| r.fits);
        loop {
            self.stage = match self.stage {
                Stage::First(cand) => match fits(cand) {
                    None => return,
                    Some(true) => Stage::Fill(cand + 1),
                    Some(false) => Stage::Bisect { lo: 0, hi: cand },
                },
                Stage::Bisect { lo, hi } if lo >= hi => Stage::Fill(hi),
                Stage::Bisect { lo, hi } => {
                    let mid = (lo + hi) / 2;
                    match fits(mid) {
                        None => return,
                        Some(true) => Stage::Bisect { lo: mid + 1, hi },
                        Some(false) => Stage::Bisect { lo, hi: mid },
                    }
                }
                Stage::Fill(b) if self.valid[..b].iter().all(|&i| records[i].is_some()) => {
                    Stage::Done
                }
                Stage::Fill(_) | Stage::Done => return,
            }
        }
    }

    /// The trials this group needs next, in the order a local sweep runs them.
    fn wanted(&self, records: &[Option<TrialRecord>]) -> Vec<usize> {
        match self.stage {
            Stage::First(cand) => vec![self.valid[cand]],
            Stage::Bisect { lo, hi } => vec![self.valid[(lo + hi) / 2]],
            Stage::Fill(b) => self.valid[..b]
                .iter()
                .copied()
                .filter(|&i| records[i].is_none())
                .collect(),
            Stage::Done => Vec::new(),
        }
    }
}

struct Ctx<'a> {
    opts: &'a SweepOptions,
    report: SweepReport,
    journal: std::fs::File,
    done: HashMap<String, TrialRecord>,
    model: String,
    device: DeviceSpec,
    /// Engine share of the capacity (the trial's device limit), and the overhead on top.
    overhead: u64,
    /// Prices measured throughput (the host's or the GPUs').
    rates: Rates,
    /// Each grid point's plan on the target GPU.
    targets: Vec<Option<TargetPrediction>>,
    runs: usize,
    /// Grid indices measured in this invocation (not from the journal).
    ran_now: std::collections::HashSet<usize>,
    stop: Arc<AtomicBool>,
    bar: indicatif::ProgressBar,
    /// Grid points settled so far (run, journaled or skipped), of `total`.
    settled: usize,
    total: usize,
    /// NVML on a GPU run device (the trials' GPU), when it loads.
    nvml: Option<crate::telemetry::Telemetry>,
}

/// A sweep before its first trial: the recipe, where trials run, the grid
/// planned on the run device and on the target, and the report's header.
pub struct Prepared {
    pub recipe: crate::plan::PlanRecipe,
    pub model: crate::config::ModelConfig,
    pub hw: crate::config::hardware::HardwareProfile,
    /// What trials receive: the kind, and the engine's share of the capacity as its limit.
    pub trial_device: DeviceSpec,
    /// The run device's runtime overhead on top of the engine's peak.
    pub overhead: u64,
    pub rates: Rates,
    /// Each point planned on the run device (memory exact, time by its roofline).
    pub preds: Vec<Prediction>,
    /// Each point planned on the target GPU.
    pub targets: Vec<Option<TargetPrediction>>,
    /// The report with no trials yet.
    pub report: SweepReport,
}

/// A recipe's model or hardware spec as an absolute path, when it names a
/// file rather than a built-in profile.
fn file_of(spec: &str) -> Option<String> {
    crate::config::profile::looks_like_path(spec).then(|| {
        std::path::absolute(spec).map_or_else(|_| spec.to_string(), |p| p.display().to_string())
    })
}

/// Loads the recipe, settles the run device (calibrating the host's
/// roofline on cpu, cached) and plans the grid twice: on the run device,
/// which trials are compared with, and on the target GPU.
///
/// hf-eager trials compute with the engine's kernels: autocast precisions
/// and dropout are predictions only, refused before any trial on a device
/// that computes.
fn check_measurable(recipe: &crate::plan::PlanRecipe, path: &std::path::Path) -> Result<()> {
    let computes = recipe
        .device
        .as_ref()
        .is_none_or(|d| d.kind != DeviceKind::Meta);
    if !computes {
        return Ok(());
    }
    let refuse = |why: String| {
        Err(Error::Config {
            location: path.display().to_string(),
            message: format!(
                "{why}. Plan such points with `memfit plan`, or sweep with --device meta"
            ),
        })
    };
    for p in expand(recipe) {
        let t = recipe.train_config(&p);
        for (on, key) in [
            (p.tp_comm_overlap, "tp_comm_overlap"),
            (p.overlap_param_gather, "overlap_param_gather"),
        ] {
            if on {
                return refuse(format!(
                    "point {}: `{key}` is priced, not run: the trials' ranks wait for every collective, and only a GPU plan runs one beside compute",
                    p.label()
                ));
            }
        }
        if t.finetune != crate::engine::Finetune::Full && t.lora.dropout > 0.0 {
            return refuse(
                "`lora_dropout` is modelled, not computed: the engine's kernels have no dropout"
                    .into(),
            );
        }
        if t.framework != Framework::HfEager {
            continue;
        }
        if crate::engine::framework::is_autocast(&t) {
            return refuse(format!(
                "point {}: {} is autocast under hf-eager (fp32 weights, 16-bit matmuls), which the engine's kernels do not compute",
                p.label(),
                crate::plan::name(t.precision)
            ));
        }
        if t.dropout > 0.0 {
            return refuse(
                "`dropout` is modelled, not computed: the engine's kernels have no dropout".into(),
            );
        }
    }
    Ok(())
}

pub fn prepare(opts: &SweepOptions) -> Result<Prepared> {
    let (mut recipe, model, mut hw) = load_recipe(&opts.recipe)?;
    // The target GPU priced as `memfit plan` prices it: with the
    // calibration `memfit calibrate --device cuda` bound to its profile.
    crate::calibrate::gpu::attach_bound(&mut hw);
    if let Some(d) = &opts.device {
        recipe.device = Some(d.clone());
    }
    // Trials are the engine's own runs; the target is what PyTorch will
    // hold for the exported configuration, unless the grid names frameworks.
    let target_framework = match recipe.grid.framework.is_empty() {
        true => Some(Framework::HfEager),
        false => None,
    };
    recipe.grid.frameworks_or(Framework::Memfit);
    check_measurable(&recipe, &opts.recipe)?;
    let device = recipe.device.clone().unwrap_or(DeviceSpec {
        kind: DeviceKind::Cpu,
        limit: None,
        ordinal: None,
    });
    let threads = opts
        .threads
        .unwrap_or_else(crate::calibrate::default_threads);
    // On cuda, open the GPU once here: no GPU is one clear error before any
    // trial, and the trials' limit is at most what the GPU has free.
    let gpu = open_gpu(&device, threads)?;
    let (capacity, overhead) = recipe.capacity(&hw);
    // On a GPU the run device's overhead is the one measured at start-up.
    let overhead = gpu.as_ref().map_or(overhead, |g| g.2);
    let usable = capacity - overhead.min(capacity);
    let trial_device = DeviceSpec {
        kind: device.kind,
        limit: Some(gpu.as_ref().map_or(usable, |g| usable.min(g.1))),
        ordinal: device.ordinal,
    };
    // On cpu, trials are timed on this host: predict them with its own
    // roofline and price them at the host's $/hour (it runs every rank).
    let calibration = match device.kind {
        DeviceKind::Cpu => Some(crate::calibrate::load_or_measure(threads, false)?.0),
        _ => None,
    };
    let target_usd = recipe.cost.unwrap_or(hw.usd_per_hour);
    let target_rates = Rates::gpu(&hw, target_usd);
    let (rates, pricing) = run_pricing(calibration.as_ref(), &recipe, &target_rates, target_usd);
    let points = expand(&recipe);
    let mut preds: Vec<Prediction> = points
        .par_iter()
        .map(|p| {
            let target = PlanTarget {
                recipe: &recipe,
                model: &model,
                rates: &rates,
                capacity,
                overhead,
            };
            predict(&target, p)
        })
        .collect();
    crate::plan::monotone_in_micro_batch(&mut preds);
    let target = plan_on_target(
        &recipe,
        &model,
        &hw,
        &points,
        target_framework,
        &target_rates,
    );
    let targets = target.predictions;
    let report = SweepReport {
        schema_version: SCHEMA_VERSION,
        memfit_version: env!("CARGO_PKG_VERSION").into(),
        recipe: opts.recipe.display().to_string(),
        model: model.name.clone(),
        model_file: file_of(&recipe.model),
        hardware: hw.name.clone(),
        hardware_file: file_of(&recipe.hardware),
        network: (recipe.network.as_ref()).map(|n| file_of(n).unwrap_or_else(|| n.clone())),
        attention_kernel: recipe.attention_kernel,
        host_memory: recipe.knobs.host_memory.map(|b| b.0),
        device: trial_device.to_string(),
        run_device: run_device(
            &device,
            threads,
            capacity,
            gpu.as_ref().map(|g| (g.0.clone(), g.1)).as_ref(),
        ),
        target: Target {
            name: hw.name.clone(),
            display_name: hw.display_name.clone(),
            capacity_bytes: target.capacity,
            runtime_overhead_bytes: target.overhead,
            usd_per_gpu_hour: target_usd,
        },
        pricing,
        calibration,
        timing: TimingPolicy {
            warmup_steps: opts.timing.warmup_steps,
            min_steps: opts.timing.min_steps,
            max_steps: opts.timing.max_steps,
            target_rel_ci: opts.timing.target_rel_ci,
            budget_s: opts.timing.budget_s,
        },
        capacity_bytes: capacity,
        runtime_overhead_bytes: overhead,
        headroom: recipe.headroom,
        allow_numerics_change: recipe.allow_numerics_change,
        lora: recipe
            .grid
            .finetune
            .iter()
            .any(|&f| f != crate::engine::Finetune::Full)
            .then(|| recipe.lora()),
        hf_knobs: Some(recipe.hf_knobs()),
        seq_len: recipe.seq_len,
        global_batch: recipe.global_batch,
        grid_size: preds.len(),
        trials_run: 0,
        trials: Vec::new(),
        recommendation: None,
        pareto: Vec::new(),
        interrupted: false,
        nvml: None,
    };
    Ok(Prepared {
        recipe,
        model,
        hw,
        trial_device,
        overhead,
        rates,
        preds,
        targets,
        report,
    })
}

/// On cuda, opens the GPU once: no GPU is one clear error before any
/// trial. Its description, the memory free after start-up, and the
/// runtime's overhead.
fn open_gpu(device: &DeviceSpec, threads: usize) -> Result<Option<(String, u64, u64)>> {
    Ok(match device.kind {
        DeviceKind::Cuda => {
            let probe = crate::backend::cuda::open(device.ordinal.unwrap_or(0), threads)
                .map_err(Error::Unavailable)?;
            use crate::backend::cuda::driver::Driver as _;
            let free = crate::run::device_free_after_startup(std::slice::from_ref(&probe));
            Some((probe.driver().describe(), free, probe.overhead_bytes()))
        }
        _ => None,
    })
}

/// What prices the trials: with a calibrated host (cpu), its roofline at
/// the host's $/hour; else the target GPU's rates.
fn run_pricing(
    calibration: Option<&crate::calibrate::Calibration>,
    recipe: &crate::plan::PlanRecipe,
    target_rates: &Rates,
    target_usd: f64,
) -> (Rates, Pricing) {
    match calibration {
        Some(c) => (
            Rates::host(c, recipe.host_usd_per_hour.unwrap_or(1.0)),
            Pricing {
                basis: "host".into(),
                usd_per_hour: recipe.host_usd_per_hour,
            },
        ),
        None => (
            target_rates.clone(),
            Pricing {
                basis: "target".into(),
                usd_per_hour: Some(target_usd),
            },
        ),
    }
}

/// The grid planned on the target GPU, and that GPU's capacity.
struct OnTarget {
    predictions: Vec<Option<TargetPrediction>>,
    capacity: u64,
    overhead: u64,
}

/// Plans each point on the target GPU (under `framework` when the grid
/// names none), as PyTorch will run the exported configuration.
fn plan_on_target(
    recipe: &crate::plan::PlanRecipe,
    model: &crate::config::ModelConfig,
    hw: &crate::config::hardware::HardwareProfile,
    points: &[Point],
    framework: Option<Framework>,
    target_rates: &Rates,
) -> OnTarget {
    let target_recipe = crate::plan::PlanRecipe {
        device: None,
        ..recipe.clone()
    };
    let (target_capacity, target_overhead) = target_recipe.capacity(hw);
    let target_usable = (target_capacity as f64 * (1.0 - recipe.headroom)) as u64;
    let mut targets: Vec<Prediction> = points
        .par_iter()
        .map(|p| {
            let p = &Point {
                framework: framework.unwrap_or(p.framework),
                ..*p
            };
            let target = PlanTarget {
                recipe: &target_recipe,
                model,
                rates: target_rates,
                capacity: target_capacity,
                overhead: target_overhead,
            };
            predict(&target, p)
        })
        .collect();
    crate::plan::monotone_in_micro_batch(&mut targets);
    let predictions = targets
        .into_iter()
        .map(|t| {
            t.peak_bytes.map(|_| TargetPrediction {
                peak_total_bytes: t.total_bytes,
                fits: t.total_bytes <= target_usable,
                step_s: t.step_s,
                tokens_per_s: t.tokens_per_s,
                usd_per_mtok: t.usd_per_mtok,
                framework: t.point.framework,
            })
        })
        .collect();
    OnTarget {
        predictions,
        capacity: target_capacity,
        overhead: target_overhead,
    }
}

/// Runs the sweep and writes the reports into `opts.out`.
pub fn sweep(opts: &SweepOptions) -> Result<SweepReport> {
    check_options(opts)?;
    let Prepared {
        recipe,
        model,
        hw,
        trial_device,
        overhead,
        rates,
        preds,
        targets,
        mut report,
    } = prepare(opts)?;
    let capacity = report.capacity_bytes;
    if let Executor::Slurm(_) = &opts.executor {
        super::slurm::check_grid(preds.len())?;
    }
    // Held until the sweep returns, however it returns (Ctrl-C included).
    let _lock = lock_out(opts)?;
    let journal_path = opts.out.join("trials.jsonl");
    let done = read_journal(&journal_path, opts.resume)?;
    check_identity(
        &opts.out,
        &SweepIdentity {
            model: model.name.clone(),
            hardware: hw.name.clone(),
            device: trial_device.to_string(),
            capacity_bytes: capacity,
            headroom: recipe.headroom,
            seq_len: recipe.seq_len,
            global_batch: recipe.global_batch,
            steps: opts.timing.min_steps,
        },
        opts.resume,
        done.len(),
    )?;
    // Jobs a killed sweep left in this directory (we hold its lock now).
    if let Executor::Slurm(_) = &opts.executor
        && let Some(note) = super::slurm::cancel_leftovers(&opts.out)
    {
        eprintln!("memfit: note: {note}");
    }
    let journal = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&journal_path)
        .map_err(|source| Error::Write {
            path: journal_path.clone(),
            source,
        })?;
    let stop = stop_flag(opts);
    if let Some(h) = &opts.hooks {
        (h.on_event)(SweepEvent::Planned(preds.clone()));
    }
    let bar = progress_bar(opts.progress, preds.len());
    let nvml = open_nvml(&mut report, &trial_device, &opts.executor);
    let mut ctx = Ctx {
        nvml,
        opts,
        report,
        journal,
        done,
        model: recipe.model.clone(),
        device: trial_device,
        overhead,
        rates,
        targets,
        runs: 0,
        ran_now: Default::default(),
        stop,
        bar,
        settled: 0,
        total: preds.len(),
    };
    let mut records = ctx.run_groups(&preds)?;
    ctx.rerun(&preds, &mut records)?;
    let interrupted = ctx.stop.load(Ordering::SeqCst);
    if !interrupted {
        ctx.record_unrun(&preds, &mut records);
    }
    ctx.report.trials = records.into_iter().flatten().collect();
    ctx.report.trials_run = ctx
        .report
        .trials
        .iter()
        .filter(|r| {
            matches!(
                r.outcome,
                Outcome::Ran | Outcome::Oom | Outcome::Timeout | Outcome::Crash
            )
        })
        .count();
    let ranking = ctx.ranking();
    ctx.bar.finish_and_clear();
    let mut report = ctx.report;
    // Ctrl-C while the contenders were re-timed stops the sweep too.
    report.interrupted = interrupted || ctx.stop.load(Ordering::SeqCst);
    recommend_with(&mut report, Some(ranking));
    write_reports(&report, &opts.out)?;
    if let Some(h) = &opts.hooks {
        (h.on_event)(SweepEvent::Finished(Box::new(report.clone())));
    }
    Ok(report)
}

/// Creates `--out` and takes its lock, noting a lock it broke.
fn lock_out(opts: &SweepOptions) -> Result<OutLock> {
    std::fs::create_dir_all(&opts.out).map_err(|source| Error::Write {
        path: opts.out.clone(),
        source,
    })?;
    let command = if opts.hooks.is_some() {
        "memfit tui"
    } else {
        "memfit sweep"
    };
    let (lock, note) = OutLock::take_or_break(&opts.out, command, opts.break_lock)?;
    if let Some(note) = note
        && opts.hooks.is_none()
    {
        eprintln!("memfit: note: {note}");
    }
    Ok(lock)
}

/// The flag that stops the sweep: the front end's, or one the signals set.
fn stop_flag(opts: &SweepOptions) -> Arc<AtomicBool> {
    match &opts.hooks {
        Some(h) => h.stop.clone(),
        None => {
            let stop = Arc::new(AtomicBool::new(false));
            let flag = stop.clone();
            // Ctrl-C, a scheduler's SIGTERM and a lost terminal's SIGHUP all
            // stop the sweep the same way: reports written, trial killed.
            crate::sys::signals::on_stop(flag);
            stop
        }
    }
}

fn progress_bar(shown: bool, len: usize) -> indicatif::ProgressBar {
    let bar = if shown {
        indicatif::ProgressBar::new(len as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar
}

/// On a GPU, NVML samples each trial process's device memory; without
/// it the sweep goes on with tracked peaks only, and the report says why.
fn open_nvml(
    report: &mut SweepReport,
    trial_device: &DeviceSpec,
    executor: &Executor,
) -> Option<crate::telemetry::Telemetry> {
    match trial_device.kind {
        DeviceKind::Cuda if !matches!(executor, Executor::Local) => {
            report.nvml = Some("no NVML: trials ran on other hosts (the sweep samples NVML only for its own child processes)".into());
            None
        }
        DeviceKind::Cuda => match crate::telemetry::Telemetry::open() {
            Ok(t) => {
                report.nvml = Some(match t.driver_version() {
                    Some(v) => format!("NVML, driver {v}"),
                    None => "NVML".into(),
                });
                Some(t)
            }
            Err(why) => {
                report.nvml = Some(if why.starts_with("no NVML") {
                    why
                } else {
                    format!("no NVML: {why}")
                });
                None
            }
        },
        _ => None,
    }
}

/// The grid's groups (points that differ only in micro-batch), in the
/// order their first point appears, each with its search.
fn selections(preds: &[Prediction], exhaustive: bool) -> Vec<Selection> {
    let mut groups: Vec<(Point, Vec<usize>)> = Vec::new();
    for (i, p) in preds.iter().enumerate() {
        let key = group_key(&p.point);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(i),
            None => groups.push((key, vec![i])),
        }
    }
    groups
        .into_iter()
        .map(|(_, idx)| Selection::new(idx, preds, exhaustive))
        .collect()
}

/// Per group (by [`trial_id`] of its [`group_key`]), the largest
/// micro-batch that fit.
fn largest_fit(records: &[Option<TrialRecord>]) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for r in records.iter().flatten().filter(|r| r.fits) {
        let e = m.entry(trial_id(&group_key(&r.point))).or_insert(0);
        *e = (*e).max(r.point.micro_batch);
    }
    m
}

/// Per group, the smallest micro-batch that ran (or failed running) and
/// did not fit.
fn smallest_misfit(records: &[Option<TrialRecord>]) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for r in records.iter().flatten().filter(|r| {
        !r.fits
            && matches!(
                r.outcome,
                Outcome::Ran | Outcome::Oom | Outcome::Crash | Outcome::Timeout
            )
    }) {
        let e = m
            .entry(trial_id(&group_key(&r.point)))
            .or_insert(usize::MAX);
        *e = (*e).min(r.point.micro_batch);
    }
    m
}

impl Ctx<'_> {
    /// Rounds: each asks every group for the trials it can decide without
    /// waiting for another result. The local executor takes the first one
    /// only (so groups run one after another, in order); Slurm takes them all
    /// as one job array.
    fn run_groups(&mut self, preds: &[Prediction]) -> Result<Vec<Option<TrialRecord>>> {
        let mut records: Vec<Option<TrialRecord>> = vec![None; preds.len()];
        let one_at_a_time = matches!(self.opts.executor, Executor::Local);
        let mut selections = selections(preds, self.opts.exhaustive);
        let mut opened = 0;
        loop {
            let mut batch = Vec::new();
            for (g, sel) in selections.iter_mut().enumerate() {
                if g == opened {
                    // A group's invalid points are recorded as it is reached.
                    opened += 1;
                    for &i in &sel.invalid {
                        let reason = match &preds[i].verdict {
                            Verdict::Invalid { reason } => reason.clone(),
                            _ => unreachable!(),
                        };
                        records[i] = Some(self.unrun(i, &preds[i], Outcome::Invalid, reason));
                    }
                }
                sel.advance(&records);
                batch.extend(sel.wanted(&records));
                if one_at_a_time && !batch.is_empty() {
                    break;
                }
            }
            if batch.is_empty() {
                break;
            }
            // A round stopped part-way still keeps the trials it finished: they
            // are journaled, so the report must hold them too.
            let (done, stopped) = self.round(&batch, preds)?;
            for (i, r) in done {
                records[i] = Some(r);
            }
            if stopped {
                break;
            }
        }
        Ok(records)
    }

    /// Re-runs asked for points the selection did not visit this time.
    fn rerun(&mut self, preds: &[Prediction], records: &mut [Option<TrialRecord>]) -> Result<()> {
        let opts = self.opts;
        for &i in &opts.rerun {
            if i < preds.len()
                && !self.ran_now.contains(&i)
                && !matches!(preds[i].verdict, Verdict::Invalid { .. })
                && let Some(r) = self.trial(i, &preds[i])?
            {
                records[i] = Some(r);
            }
        }
        Ok(())
    }

    /// What was not run, and why.
    fn record_unrun(&mut self, preds: &[Prediction], records: &mut [Option<TrialRecord>]) {
        let largest_fit = largest_fit(records);
        let smallest_misfit = smallest_misfit(records);
        for (i, slot) in records.iter_mut().enumerate() {
            if slot.is_some() {
                continue;
            }
            let p = &preds[i];
            // Measured earlier (a re-run of a point the selection skips): keep it.
            if let Some(r) = self.done.get(&trial_id(&p.point)) {
                *slot = Some(r.clone());
                continue;
            }
            let key = trial_id(&group_key(&p.point));
            let mb = p.point.micro_batch;
            *slot = Some(if p.verdict == Verdict::DoesNotFit {
                self.unrun(
                    i,
                    p,
                    Outcome::SkippedPredictedOom,
                    format!(
                        "predicted {} per GPU against {} usable",
                        crate::units::fmt_bytes(p.total_bytes),
                        crate::units::fmt_bytes(p.usable_bytes)
                    ),
                )
            } else if largest_fit.get(&key).is_some_and(|&m| mb < m) {
                self.unrun(
                    i,
                    p,
                    Outcome::SkippedByMonotonicity,
                    format!(
                        "micro-batch {} fits, so a smaller one does",
                        largest_fit[&key]
                    ),
                )
            } else {
                let note = match smallest_misfit.get(&key) {
                    Some(m) => {
                        format!("micro-batch {m} did not fit or failed, so a larger one is not run")
                    }
                    None => "not reached".into(),
                };
                self.unrun(i, p, Outcome::SkippedByMonotonicity, note)
            });
        }
    }
}

/// Reads the journal for `--resume`; without it, an existing journal is an
/// error rather than something to mix with or overwrite.
fn read_journal(path: &Path, resume: bool) -> Result<HashMap<String, TrialRecord>> {
    let mut done = HashMap::new();
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(_) => return Ok(done),
    };
    if !resume {
        if file.metadata().map(|m| m.len() > 0).unwrap_or(false) {
            return Err(Error::invalid_arg(
                "--out",
                format!(
                    "{} already holds a sweep's trials; pass --resume to finish it, or choose another --out",
                    path.display()
                ),
            ));
        }
        return Ok(done);
    }
    drop(file);
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let text = std::fs::read_to_string(path).map_err(io)?;
    // A sweep killed mid-write leaves a partial last line: cut it off, so the
    // next record starts on a line of its own (that trial runs again).
    let complete = text.rfind('\n').map_or(0, |i| i + 1);
    if complete < text.len() {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(io)?;
        f.set_len(complete as u64).map_err(io)?;
    }
    for (n, line) in text[..complete].lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<TrialRecord>(line) {
            Ok(r) => {
                done.insert(r.id.clone(), r);
            }
            Err(e) => {
                return Err(Error::Config {
                    location: format!("{}:{}:{}", path.display(), n + 1, e.column()),
                    message: format!("not a trial record: {e}"),
                });
            }
        }
    }
    Ok(done)
}

/// What makes journaled trials comparable: a journal is resumed only by the
/// same sweep (DIR/sweep.json holds this).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct SweepIdentity {
    model: String,
    hardware: String,
    device: String,
    capacity_bytes: u64,
    headroom: f64,
    seq_len: usize,
    global_batch: usize,
    steps: usize,
}

/// Writes DIR/sweep.json, or checks that a resumed journal (of `journaled`
/// trials) belongs to this sweep. A journal without its sweep.json cannot be
/// told apart from another sweep's, so it is not resumed.
fn check_identity(dir: &Path, id: &SweepIdentity, resume: bool, journaled: usize) -> Result<()> {
    let path = dir.join("sweep.json");
    if resume && journaled > 0 && !path.exists() {
        return Err(Error::invalid_arg(
            "--resume",
            format!(
                "{} holds {journaled} trials but {} is missing, and it is what says which sweep they belong to: they may be another sweep's (a journal copied from elsewhere, or sweep.json deleted), and resuming would mix them into this one. Put the sweep.json of that sweep back beside the journal, or start over: move trials.jsonl away or choose another --out",
                dir.join("trials.jsonl").display(),
                path.display()
            ),
        ));
    }
    if resume && let Ok(text) = std::fs::read_to_string(&path) {
        let old: SweepIdentity = serde_json::from_str(&text).map_err(|e| Error::Config {
            location: format!("{}:{}:{}", path.display(), e.line(), e.column()),
            message: format!("not a sweep identity: {e}"),
        })?;
        if old != *id {
            return Err(Error::invalid_arg(
                "--out",
                format!(
                    "{} holds the trials of another sweep ({} seq {} on {}, capacity {}, headroom {}, {} steps); this one is {} seq {} on {}, capacity {}, headroom {}, {} steps: choose another --out",
                    dir.display(),
                    old.model,
                    old.seq_len,
                    old.device,
                    old.capacity_bytes,
                    old.headroom,
                    old.steps,
                    id.model,
                    id.seq_len,
                    id.device,
                    id.capacity_bytes,
                    id.headroom,
                    id.steps
                ),
            ));
        }
        return Ok(());
    }
    write_atomic(
        &path,
        serde_json::to_string_pretty(id)
            .expect("serialises")
            .as_bytes(),
    )
}

/// Checks every option a trial receives before the first one starts: a bad
/// one would fail each trial in turn, and fill the journal with crashes.
/// `memfit sweep` and `memfit tui` check their flags as they parse them
/// (`cli`); this catches a library caller, and names the same flags.
fn check_options(opts: &SweepOptions) -> Result<()> {
    if let Some(n) = opts.threads {
        crate::config::limits::check_threads(n).map_err(|m| Error::invalid_arg("--threads", m))?;
    }
    crate::config::limits::check_seconds(opts.timeout.as_secs_f64())
        .map_err(|m| Error::invalid_arg("--trial-timeout", m))?;
    if let Some((flag, why)) = opts.timing.invalid() {
        return Err(Error::invalid_arg(flag, why));
    }
    if opts.timing.max_steps > MAX_TRIAL_STEPS {
        return Err(Error::invalid_arg(
            "--max-steps",
            format!("must be at most {MAX_TRIAL_STEPS}"),
        ));
    }
    super::retime::check_rounds(opts.retime.rounds)
        .map_err(|m| Error::invalid_arg("--paired-rounds", m))?;
    if opts.hooks.as_ref().is_some_and(|h| h.sample_ms == 0) {
        return Err(Error::invalid_arg("--sample-ms", "must be at least 1"));
    }
    if let Executor::Slurm(_) = &opts.executor {
        super::slurm::check_tools()?;
    }
    Ok(())
}

/// The most steps a trial may time (`--max-steps`).
const MAX_TRIAL_STEPS: usize = 1 << 20;

/// Writes `path` whole or not at all: a temporary file in the same
/// directory, synced, then renamed over it. A reader, or a sweep killed
/// mid-write, never sees half a file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map_err(|source| Error::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// The file that claims an output directory for one sweep.
pub const LOCK_FILE: &str = ".memfit.lock";

/// One sweep's exclusive claim on its output directory: `DIR/.memfit.lock`,
/// locked with `flock` (so the kernel releases it however the process ends)
/// and naming its holder for the error a second sweep gets. Dropping it
/// removes the file and releases the lock.
///
/// On a filesystem several hosts share (which the Slurm executor needs),
/// `flock` may not reach across them, and a pid means nothing on another
/// host; so the holder renews the file's modification time every
/// [`LOCK_RENEW`] as its lease, and a lock naming another host is taken
/// over only once the lease is [`LOCK_LEASE`] old, or with `--break-lock`.
#[derive(Debug)]
pub struct OutLock {
    path: PathBuf,
    // Held open: closing it releases the lock.
    _file: std::fs::File,
    /// Stops the lease's renewal thread.
    renew: Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)>,
}

/// How often a sweep renews its lock's lease (the file's mtime).
pub const LOCK_RENEW: Duration = Duration::from_secs(60);
/// How old a lease naming another host must be before a sweep takes the
/// lock over without `--break-lock`: five renewals, which leaves room for
/// clocks that differ between hosts.
pub const LOCK_LEASE: Duration = Duration::from_secs(300);

/// Who holds a lock, as its file says.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Holder {
    command: String,
    pid: u32,
    host: String,
    started_unix_s: u64,
}

impl Holder {
    fn describe(&self) -> String {
        let host = if self.host == hostname() {
            String::new()
        } else {
            format!(" on host {}", self.host)
        };
        format!(
            "{} pid {}{host} started {}",
            self.command,
            self.pid,
            utc_time(self.started_unix_s)
        )
    }
}

impl OutLock {
    /// Claims `dir` for `command`, or says who holds it (exit code 2). A lock
    /// file left by a process that no longer holds it (killed, or on a
    /// machine that went down) is taken over; the note says so.
    pub fn take(dir: &Path, command: &str) -> Result<(OutLock, Option<String>)> {
        Self::take_or_break(dir, command, false)
    }

    /// [`OutLock::take`]; with `break_lock`, a lock whose lease another
    /// host renewed recently is taken over too (the user says that host's
    /// sweep is gone).
    pub fn take_or_break(
        dir: &Path,
        command: &str,
        break_lock: bool,
    ) -> Result<(OutLock, Option<String>)> {
        use std::fs::TryLockError;
        use std::os::unix::fs::MetadataExt;
        let path = dir.join(LOCK_FILE);
        let io = |source| Error::Write {
            path: path.clone(),
            source,
        };
        // A holder that is just letting go removes the file after we opened
        // it: then the lock we got is on a file no one else will see.
        for _ in 0..8 {
            let mut file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(io)?;
            let previous = read_holder(&mut file);
            let locked = match file.try_lock() {
                Ok(()) => true,
                Err(TryLockError::WouldBlock) => {
                    return Err(Error::invalid_arg("--out", in_use(dir, previous.as_ref())));
                }
                // No flock here (some network filesystems): trust a live pid.
                Err(TryLockError::Error(_)) => {
                    if let Some(h) = &previous
                        && h.host == hostname()
                        && crate::sys::proc::exists(h.pid)
                    {
                        return Err(Error::invalid_arg("--out", in_use(dir, Some(h))));
                    }
                    false
                }
            };
            // Another host's sweep: our flock proves nothing (it may not
            // reach across hosts), its pid is not ours to check; its lease is.
            let mut lapsed = None;
            if let Some(h) = previous.as_ref().filter(|h| h.host != hostname()) {
                let age = file
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .unwrap_or_default();
                if age < LOCK_LEASE && !break_lock {
                    return Err(Error::invalid_arg(
                        "--out",
                        format!(
                            "{} is in use by {}, whose lease on it was renewed {} s ago (a running sweep renews it every {} s; it lapses after {} s). Wait for that sweep, choose another --out, or pass --break-lock if it is gone (its host went down)",
                            dir.display(),
                            h.describe(),
                            age.as_secs(),
                            LOCK_RENEW.as_secs(),
                            LOCK_LEASE.as_secs()
                        ),
                    ));
                }
                lapsed = Some(age);
            }
            let same = match (file.metadata(), std::fs::metadata(&path)) {
                (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
                _ => false,
            };
            if locked && !same {
                continue;
            }
            let note = previous.map(|h| {
                format!(
                    "{} was left by {}, which {}; taking it over",
                    path.display(),
                    h.describe(),
                    match lapsed {
                        Some(age) if age >= LOCK_LEASE => format!(
                            "last renewed its lease {} s ago (it lapses after {} s)",
                            age.as_secs(),
                            LOCK_LEASE.as_secs()
                        ),
                        Some(age) => format!(
                            "renewed its lease {} s ago, but --break-lock says it is gone",
                            age.as_secs()
                        ),
                        None if crate::sys::proc::exists(h.pid) => "no longer holds it".into(),
                        None => "is no longer running".into(),
                    }
                )
            });
            let me = Holder {
                command: command.into(),
                pid: std::process::id(),
                host: hostname(),
                started_unix_s: crate::units::now_unix_s(),
            };
            let text = serde_json::to_string(&me).expect("holder serialises") + "\n";
            file.set_len(0).map_err(io)?;
            std::io::Seek::rewind(&mut file).map_err(io)?;
            file.write_all(text.as_bytes()).map_err(io)?;
            file.sync_data().map_err(io)?;
            let renew = file.try_clone().ok().and_then(|f| {
                let stop = Arc::new(AtomicBool::new(false));
                let flag = stop.clone();
                std::thread::Builder::new()
                    .name("memfit-lock-lease".into())
                    .spawn(move || {
                        let mut last = Instant::now();
                        while !flag.load(Ordering::SeqCst) {
                            std::thread::sleep(Duration::from_millis(100));
                            if last.elapsed() >= LOCK_RENEW {
                                let _ = f.set_modified(std::time::SystemTime::now());
                                last = Instant::now();
                            }
                        }
                    })
                    .ok()
                    .map(|t| (stop, t))
            });
            return Ok((
                OutLock {
                    path,
                    _file: file,
                    renew,
                },
                note,
            ));
        }
        Err(Error::invalid_arg(
            "--out",
            format!(
                "{} keeps changing hands; another memfit is starting and stopping in it",
                dir.display()
            ),
        ))
    }
}

impl Drop for OutLock {
    fn drop(&mut self) {
        if let Some((stop, thread)) = self.renew.take() {
            stop.store(true, Ordering::SeqCst);
            let _ = thread.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn in_use(dir: &Path, holder: Option<&Holder>) -> String {
    let who = match holder {
        Some(h) => h.describe(),
        None => "another memfit (it is writing its lock file)".into(),
    };
    format!(
        "{} is in use by {who}; wait for it to finish, or choose another --out (two sweeps in one directory would run every trial twice)",
        dir.display()
    )
}

/// The holder a lock file names, if it names one.
fn read_holder(file: &mut std::fs::File) -> Option<Holder> {
    let mut text = String::new();
    file.take(4096).read_to_string(&mut text).ok()?;
    serde_json::from_str(text.trim()).ok()
}

fn hostname() -> String {
    crate::sys::hostname().unwrap_or_else(|| "localhost".into())
}

/// `2025-01-02 21:03:11 UTC` (civil date from days since 1970, after
/// Howard Hinnant's `civil_from_days`).
fn utc_time(unix_s: u64) -> String {
    let (days, secs) = ((unix_s / 86_400) as i64, unix_s % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

impl Ctx<'_> {
    fn emit(&self, e: SweepEvent) {
        if let Some(h) = &self.opts.hooks {
            (h.on_event)(e);
        }
    }

    fn usable(&self) -> u64 {
        self.report.usable_bytes()
    }

    /// NVML answered, but a trial's process never showed in its process
    /// list with memory: say why it can happen, once, in the report.
    fn nvml_missed_a_trial(&mut self) {
        const WHY: &str = "; a trial process never appeared in NVML's process list with its memory (in a container with its own pid namespace NVML reports host pids; a MIG instance reports no per-process memory; drivers before R510 lack the query)";
        if let Some(s) = self.report.nvml.as_mut()
            && !s.contains(WHY)
        {
            s.push_str(WHY);
        }
    }

    fn base_record(&self, index: usize, p: &Prediction, outcome: Outcome) -> TrialRecord {
        TrialRecord {
            id: trial_id(&p.point),
            point: p.point,
            outcome,
            fits: false,
            predicted: p.peak_bytes.map(|pk| Predicted {
                peak_total_bytes: pk.total + self.overhead,
                peak_bytes: Some(pk),
                step_s: p.step_s,
                tokens_per_s: p.tokens_per_s,
            }),
            measured: None,
            memory_error_pct: None,
            time_ratio: None,
            nvml_error_pct: None,
            target: self.targets.get(index).cloned().flatten(),
            exit: None,
            numerics_changes: p.numerics_changes.iter().map(|s| s.to_string()).collect(),
            note: None,
            elapsed_s: 0.0,
        }
    }

    fn unrun(
        &mut self,
        index: usize,
        p: &Prediction,
        outcome: Outcome,
        note: String,
    ) -> TrialRecord {
        self.settle();
        let r = TrialRecord {
            note: Some(note),
            ..self.base_record(index, p, outcome)
        };
        self.emit(SweepEvent::TrialFinished {
            index,
            record: Box::new(r.clone()),
        });
        r
    }

    /// One round's trials, by the executor: with the local one, each in
    /// turn in a child process; with Slurm, as one job array. Each record
    /// comes from the journal under `--resume`, else is measured now (and
    /// journaled as it ends), with whether the sweep was interrupted: the
    /// trials the round finished before that are returned all the same.
    fn round(
        &mut self,
        batch: &[usize],
        preds: &[Prediction],
    ) -> Result<(Vec<(usize, TrialRecord)>, bool)> {
        let opts = self.opts;
        let mut done = Vec::new();
        let Executor::Slurm(slurm) = &opts.executor else {
            for &i in batch {
                let Some(r) = self.trial(i, &preds[i])? else {
                    return Ok((done, true));
                };
                done.push((i, r));
            }
            return Ok((done, false));
        };
        let mut tasks = Vec::new();
        for &i in batch {
            match self.begin(i, &preds[i]) {
                Begin::Journaled(r) => done.push((i, *r)),
                Begin::Stopped => return Ok((done, true)),
                Begin::Run(spec) => tasks.push(super::slurm::Task {
                    index: i,
                    spec: *spec,
                }),
            }
        }
        if tasks.is_empty() {
            return Ok((done, false));
        }
        let stop = self.stop.clone();
        let threads = opts
            .threads
            .unwrap_or_else(crate::calibrate::default_threads);
        let gpu = self.device.kind == DeviceKind::Cuda;
        let bar = self.bar.clone();
        let say = move |line: String| match bar.is_hidden() {
            true => eprintln!("memfit: {line}"),
            false => bar.println(line),
        };
        let array = super::slurm::Array {
            options: slurm,
            out: &opts.out,
            threads,
            gpu,
            timeout: opts.timeout,
        };
        // Journaled as each task ends; after Ctrl-C the next round stops.
        array.run(&tasks, &stop, &say, &mut |f| {
            let r = self.finish(f.index, &preds[f.index], f.ended, f.elapsed_s, f.note)?;
            done.push((f.index, r));
            Ok(())
        })?;
        let stopped = self.stop.load(Ordering::SeqCst);
        Ok((done, stopped))
    }

    /// A trial up to where it runs: its journaled record, a stop, or its spec.
    fn begin(&mut self, index: usize, p: &Prediction) -> Begin {
        let id = trial_id(&p.point);
        if let Some(r) = self
            .done
            .get(&id)
            .filter(|_| !self.opts.rerun.contains(&index))
            .cloned()
        {
            self.settle();
            self.emit(SweepEvent::TrialFinished {
                index,
                record: Box::new(r.clone()),
            });
            return Begin::Journaled(Box::new(r));
        }
        if let Some(h) = &self.opts.hooks {
            while h.pause.load(Ordering::SeqCst) && !self.stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        if self.stop.load(Ordering::SeqCst) {
            return Begin::Stopped;
        }
        self.emit(SweepEvent::TrialStarted { index });
        self.ran_now.insert(index);
        self.bar.set_message(p.point.label());
        #[cfg(feature = "test-hooks")]
        let fault = (self.opts.fault).and_then(|(at, f)| (at == self.runs).then_some(f));
        self.runs += 1;
        let mut spec = self.spec(&p.point, self.opts.timing);
        #[cfg(feature = "test-hooks")]
        {
            spec.fault = fault;
        }
        spec.sample_ms = self.opts.hooks.as_ref().map(|h| h.sample_ms);
        Begin::Run(Box::new(spec))
    }

    /// What a child needs to train `point` under `timing`.
    fn spec(&self, point: &Point, timing: crate::stats::Timing) -> TrialSpec {
        // The recipe's knobs, as the report keeps them.
        let hf = self.report.hf_knobs.unwrap_or_default();
        let lora = self.report.lora.clone().unwrap_or_default();
        TrialSpec {
            model: self.model.clone(),
            train: crate::engine::TrainConfig {
                seed: 1337,
                ..point.train_config_with(self.report.seq_len, &hf, &lora)
            },
            steps: timing.step_cap(),
            timing: Some(timing),
            device: self.device.to_string(),
            threads: self.opts.threads,
            #[cfg(feature = "test-hooks")]
            fault: None,
            sample_ms: None,
        }
    }

    /// One more grid point settled (the progress bar and the trial lines' count).
    fn settle(&mut self) {
        self.settled += 1;
        self.bar.inc(1);
    }

    /// A progress line where `--format` leaves room for it (see [`Lines`]).
    fn say(&self, line: &str) {
        match self.opts.lines {
            Lines::Off => {}
            Lines::Stdout => println!("{line}"),
            Lines::Stderr if self.bar.is_hidden() => eprintln!("{line}"),
            Lines::Stderr => self.bar.println(line),
        }
    }

    /// How the recommendation ranks the fitting trials: on meta by
    /// prediction; else the contenders re-timed interleaved on this host
    /// (not under Slurm: its trials ran on other hosts, under other loads).
    fn ranking(&self) -> Ranking {
        let policy = self.opts.retime;
        if self.device.kind == DeviceKind::Meta {
            return super::retime::unranked(
                "predicted",
                "meta trials compute nothing: throughput is the run device's roofline prediction, which no load changes",
                &policy,
            );
        }
        if self.stop.load(Ordering::SeqCst) {
            return super::retime::unranked(
                "single",
                "the sweep was interrupted before its contenders were re-timed",
                &policy,
            );
        }
        if let Executor::Slurm(_) = self.opts.executor {
            return super::retime::unranked(
                "single",
                "not re-timed: the trials ran as Slurm jobs on other hosts, so no two shared one host's load",
                &policy,
            );
        }
        let costs: Vec<(usize, f64, f64)> = eligible(&self.report)
            .into_iter()
            .filter_map(|i| {
                let (c, [lo, _]) = cost_of(&self.report.trials[i])?;
                Some((i, c, lo))
            })
            .collect();
        let contenders = super::retime::contenders(&costs, &policy);
        let mut bench = ChildBench { ctx: self };
        super::retime::rank(&contenders, &mut bench, &policy)
    }

    /// The trial's record: from the journal under `--resume`, else measured
    /// now in a child process (and journaled). `None` when the sweep was
    /// interrupted.
    fn trial(&mut self, index: usize, p: &Prediction) -> Result<Option<TrialRecord>> {
        let spec = match self.begin(index, p) {
            Begin::Journaled(r) => return Ok(Some(*r)),
            Begin::Stopped => return Ok(None),
            Begin::Run(spec) => spec,
        };
        let start = Instant::now();
        let hooks = self.opts.hooks.clone();
        let on_sample = move |t_s, tracked, rss, nvml| {
            if let Some(h) = &hooks {
                (h.on_event)(SweepEvent::Sample {
                    t_s,
                    tracked,
                    rss,
                    nvml,
                });
            }
        };
        // NVML every --sample-ms (the TUI's), else every 100 ms.
        let sample_every =
            Duration::from_millis(self.opts.hooks.as_ref().map_or(100, |h| h.sample_ms).max(1));
        let nvml = self
            .nvml
            .as_ref()
            // NVML numbers GPUs by PCI bus, not as CUDA does (nor after
            // CUDA_VISIBLE_DEVICES): look the trial's pid up on every GPU.
            .map(|t| (t, None, sample_every));
        let ended = run_child(&spec, self.opts.timeout, &self.stop, &on_sample, nvml)?;
        if self.stop.load(Ordering::SeqCst) {
            // Killed by Ctrl-C (ours, or the terminal's SIGINT to the child):
            // not a result; `--resume` runs it again.
            return Ok(None);
        }
        let elapsed_s = start.elapsed().as_secs_f64();
        self.finish(index, p, ended, elapsed_s, None).map(Some)
    }

    /// Classifies how a trial ended, journals the record (flushed to disk)
    /// and shows it. `note`, from the executor, replaces the default one.
    fn finish(
        &mut self,
        index: usize,
        p: &Prediction,
        ended: Ended,
        elapsed_s: f64,
        note: Option<String>,
    ) -> Result<TrialRecord> {
        let mut r = self.base_record(index, p, Outcome::Crash);
        r.elapsed_s = elapsed_s;
        match ended {
            Ended::Exited {
                code,
                out,
                err,
                nvml_peak,
            } => match (code, out) {
                (Some(0), Some(o)) => {
                    r.outcome = Outcome::Ran;
                    self.measure(&mut r, p, &o, nvml_peak);
                    if self.nvml.is_some() && nvml_peak.is_none() {
                        self.nvml_missed_a_trial();
                    }
                }
                (Some(3), Some(o)) => {
                    r.outcome = Outcome::Oom;
                    r.note = o.oom.clone();
                }
                (code, _) => {
                    r.exit = Some(ExitInfo {
                        code,
                        signal: None,
                        stderr_tail: tail(&err),
                    });
                }
            },
            Ended::Signalled { signal, err } => {
                r.exit = Some(ExitInfo {
                    code: None,
                    signal: Some(signal),
                    stderr_tail: tail(&err),
                });
            }
            Ended::TimedOut { err } => {
                r.outcome = Outcome::Timeout;
                r.note = Some(format!(
                    "killed after {:.0} s",
                    self.opts.timeout.as_secs_f64()
                ));
                r.exit = Some(ExitInfo {
                    code: None,
                    signal: Some(9),
                    stderr_tail: tail(&err),
                });
            }
        }
        if note.is_some() {
            r.note = note;
        }
        // Journaled (and flushed to disk) before it is shown: one write of
        // the whole line, and on failure (a full disk) the file is cut
        // back to its last whole record, so no torn line remains.
        let line = serde_json::to_string(&r).expect("records serialise") + "\n";
        let before = self.journal.metadata().map(|m| m.len());
        let written = self
            .journal
            .write_all(line.as_bytes())
            .and_then(|()| self.journal.sync_data());
        if let Err(e) = written {
            let cut = before.and_then(|len| {
                self.journal.set_len(len)?;
                self.journal.sync_data()
            });
            let state = match cut {
                Ok(()) => "the journal is cut back to its last whole record".to_string(),
                Err(c) => format!(
                    "cutting the journal back failed too ({c}); --resume drops its torn last line"
                ),
            };
            return Err(Error::Write {
                path: self.opts.out.join("trials.jsonl"),
                source: std::io::Error::new(
                    e.kind(),
                    format!(
                        "{e}: trial `{}` ({}) ran but could not be journaled, so its result is lost; {state}, and `--resume` runs it again once the disk has room",
                        r.id,
                        p.point.label()
                    ),
                ),
            });
        }
        self.settle();
        self.emit(SweepEvent::TrialFinished {
            index,
            record: Box::new(r.clone()),
        });
        match self.opts.lines {
            Lines::Off => self.bar.println(format!(
                "{:>9} {}",
                match r.outcome {
                    Outcome::Ran if r.fits => "fit",
                    Outcome::Ran => "over",
                    Outcome::Oom => "oom",
                    Outcome::Timeout => "timeout",
                    _ => "crash",
                },
                p.point.label()
            )),
            _ => self.say(&trial_line(
                self.settled,
                self.total,
                &r,
                self.report.runtime_overhead_bytes,
                self.device.kind == DeviceKind::Meta,
            )),
        }
        Ok(r)
    }

    fn measure(
        &self,
        r: &mut TrialRecord,
        p: &Prediction,
        o: &TrialOutput,
        nvml_peak: Option<u64>,
    ) {
        let timed = o
            .step_ms
            .get(o.warmup_steps..)
            .filter(|t| !t.is_empty())
            .unwrap_or(&o.step_ms[..]);
        let secs: Vec<f64> = timed.iter().map(|ms| ms / 1e3).collect();
        // Meta measures no time: its step is the prediction's.
        let (step_s, lo, hi) = if o.tokens_per_s.is_some() && !secs.is_empty() {
            crate::stats::median_ci(&secs)
        } else {
            (p.step_s, p.step_s, p.step_s)
        };
        let tokens = o.tokens_per_step as f64;
        let tokens_per_s = tokens / step_s;
        let total = o.peak_bytes.total + self.overhead;
        r.fits = total <= self.usable();
        if let Some(pr) = &r.predicted {
            r.memory_error_pct =
                Some((total as f64 - pr.peak_total_bytes as f64) / total as f64 * 100.0);
            if o.tokens_per_s.is_some() && pr.step_s > 0.0 {
                r.time_ratio = Some(step_s / pr.step_s);
            }
            if let Some(nv) = nvml_peak.filter(|&b| b > 0) {
                r.nvml_error_pct =
                    Some((nv as f64 - pr.peak_total_bytes as f64) / nv as f64 * 100.0);
            }
        }
        r.measured = Some(Measured {
            peak_bytes: o.peak_bytes,
            peak_split: o.peak_split,
            rss_peak_bytes: o.rss_peak_bytes,
            rss_baseline_bytes: o.rss_baseline_bytes,
            step_ms: o.step_ms.clone(),
            warmup_steps: o.warmup_steps,
            step_s,
            step_s_ci: [lo, hi],
            tokens_per_s,
            tokens_per_s_ci: [tokens / hi, tokens / lo],
            usd_per_mtok: self
                .report
                .pricing
                .usd_per_hour
                .map(|_| self.rates.usd_per_mtok(p.point.gpus, tokens_per_s)),
            losses: o.losses.clone(),
            phase_peaks: o.phase_peaks.clone(),
            nvml_peak_bytes: nvml_peak,
        });
    }
}

/// Bouts of the contenders, each a child process timing a few steps of
/// its trial's configuration, one after another on this host.
struct ChildBench<'c, 'o> {
    ctx: &'c Ctx<'o>,
}

impl super::retime::Bench for ChildBench<'_, '_> {
    fn bout(&mut self, trial: usize) -> Option<super::retime::Bout> {
        let ctx = self.ctx;
        let r = ctx.report.trials.get(trial)?;
        let steps = ctx.opts.retime.bout_steps.max(1);
        let timing = crate::stats::Timing {
            warmup_steps: 1,
            min_steps: steps,
            max_steps: 10 * steps,
            // Never stop on the steps' spread: the budget ends a bout.
            target_rel_ci: 0.0,
            budget_s: ctx.opts.retime.bout_budget_s,
        };
        if let Some(h) = &ctx.opts.hooks {
            while h.pause.load(Ordering::SeqCst) && !ctx.stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let spec = ctx.spec(&r.point, timing);
        // A bout that fails (it cannot start, crashes, runs out of memory
        // or out of time) is one missing pair, never the sweep's end.
        let ended = run_child(&spec, ctx.opts.timeout, &ctx.stop, &|_, _, _, _| {}, None).ok()?;
        let Ended::Exited {
            code: Some(0),
            out: Some(o),
            ..
        } = ended
        else {
            return None;
        };
        o.tokens_per_s?;
        let timed = o.step_ms.get(o.warmup_steps..).filter(|t| !t.is_empty())?;
        let step_s = crate::stats::median(timed) / 1e3;
        let tokens_per_s = o.tokens_per_step as f64 / step_s;
        if !(tokens_per_s.is_finite() && tokens_per_s > 0.0) {
            return None;
        }
        let cost = match ctx.report.pricing.usd_per_hour {
            Some(_) => ctx.rates.usd_per_mtok(r.point.gpus, tokens_per_s),
            None => 1e6 / tokens_per_s,
        };
        Some(super::retime::Bout { cost, tokens_per_s })
    }

    fn stopped(&self) -> bool {
        self.ctx.stop.load(Ordering::SeqCst)
    }

    fn say(&mut self, line: &str) {
        self.ctx.bar.set_message(line.to_string());
        self.ctx.say(&format!("memfit: {line}"));
    }
}

/// One line about a finished trial, for a sweep whose output is piped:
/// `[3/12] mb4 x1 none bf16 adamw ckpt:full eager accum 8: fit, peak 5.10 MiB, 28,620 tok/s`.
pub fn trial_line(
    settled: usize,
    total: usize,
    r: &TrialRecord,
    overhead: u64,
    predicted: bool,
) -> String {
    let what = match (r.outcome, r.measured.as_ref()) {
        (Outcome::Ran, Some(m)) => format!(
            "{}, peak {}, {} tok/s{}",
            if r.fits {
                "fit"
            } else {
                "over the usable limit"
            },
            crate::units::fmt_bytes(m.peak_bytes.total + overhead),
            thousands(m.tokens_per_s),
            if predicted { " predicted" } else { "" }
        ),
        (Outcome::Oom, _) => "out of memory".into(),
        (Outcome::Timeout, _) => match &r.note {
            Some(n) => format!("timeout ({n})"),
            None => "timeout".into(),
        },
        _ => match r.exit.as_ref() {
            Some(ExitInfo {
                signal: Some(s), ..
            }) => format!("crash (signal {s})"),
            Some(ExitInfo { code: Some(c), .. }) => format!("crash (exit code {c})"),
            _ => "crash".into(),
        },
    };
    format!("[{settled}/{total}] {}: {what}", r.point.label())
}

/// `45000.4` as `45,000`.
pub fn thousands(x: f64) -> String {
    if !x.is_finite() {
        return "-".into();
    }
    let digits = format!("{:.0}", x.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if x < 0.0 && digits != "0" {
        out.insert(0, '-');
    }
    out
}

/// The run device in words.
fn run_device(
    asked: &DeviceSpec,
    threads: usize,
    capacity: u64,
    gpu: Option<&(String, u64)>,
) -> RunDevice {
    // On cpu the capacity is always emulated: the limit asked for, else the
    // target's; on a GPU when the target is smaller than what it has free.
    let emulated = match (asked.kind, gpu) {
        (DeviceKind::Cpu, _) => true,
        (DeviceKind::Cuda, Some((_, free))) => capacity < *free,
        _ => false,
    };
    let cap = crate::units::fmt_bytes(capacity);
    let description = match asked.kind {
        DeviceKind::Cpu if asked.limit.is_some() => {
            format!("this host's CPU ({threads} threads), emulating a {cap} device")
        }
        DeviceKind::Cpu => {
            format!("this host's CPU ({threads} threads), emulating the target's {cap}")
        }
        DeviceKind::Meta => format!("meta (computes nothing; peaks exact, times predicted), {cap}"),
        DeviceKind::Cuda => match gpu {
            Some((name, free)) if capacity < *free => {
                format!("{name}, limited to the target's {cap}")
            }
            Some((name, _)) => format!("{name}, {cap}"),
            None => format!("cuda, {cap}"),
        },
    };
    RunDevice {
        spec: asked.to_string(),
        kind: match asked.kind {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Meta => "meta",
            DeviceKind::Cuda => "cuda",
        }
        .into(),
        description,
        capacity_bytes: capacity,
        emulated,
    }
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    let t = lines[lines.len().saturating_sub(20)..].join("\n");
    let mut cut = t.len().saturating_sub(4000);
    while !t.is_char_boundary(cut) {
        cut += 1;
    }
    t[cut..].to_string()
}

/// How a trial ended, as either executor saw it.
pub(super) enum Ended {
    Exited {
        /// The trial process's NVML peak, when NVML sampled it.
        nvml_peak: Option<u64>,
        code: Option<i32>,
        out: Option<Box<TrialOutput>>,
        err: String,
    },
    Signalled {
        signal: i32,
        err: String,
    },
    TimedOut {
        err: String,
    },
}

/// What [`Ctx::begin`] found.
enum Begin {
    Journaled(Box<TrialRecord>),
    Stopped,
    Run(Box<TrialSpec>),
}

/// NVML for a trial: the library, the GPU (`None`: all), how often to sample.
type NvmlWatch<'a> = (&'a crate::telemetry::Telemetry, Option<u32>, Duration);

/// Runs `memfit trial` in a child process; kills it at the timeout or on
/// Ctrl-C. With NVML, samples the child's GPU memory and keeps its peak.
fn run_child(
    spec: &TrialSpec,
    timeout: Duration,
    stop: &AtomicBool,
    on_sample: &(dyn Fn(f64, u64, Option<u64>, Option<u64>) + Sync),
    nvml: Option<NvmlWatch<'_>>,
) -> Result<Ended> {
    let exe = std::env::current_exe().map_err(|e| {
        Error::Unavailable(format!(
            "cannot find the memfit executable to run trials: {e}"
        ))
    })?;
    let json = serde_json::to_string(spec).expect("spec serialises");
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(exe);
    // A sweep killed outright (kill -9, the OOM killer) runs no handler:
    // the kernel then kills the trial, which would otherwise run on.
    crate::sys::signals::die_with_parent(&mut cmd);
    let mut child = cmd
        .args(["trial", "--spec", &json])
        // Its own process group: the terminal's Ctrl-C reaches the sweep,
        // which kills the trial and does not mistake it for a crash.
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::Unavailable(format!("cannot start a trial process: {e}")))?;
    // Drain both pipes on threads, so a chatty child never blocks on a full pipe.
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("piped")));
    // stderr line by line: live-memory samples go to the front end (with the
    // child's RSS read now), the rest is kept for a crash's tail.
    let (tx, rx) = std::sync::mpsc::channel::<(f64, u64)>();
    let err_pipe = child.stderr.take().expect("piped");
    let err = std::thread::spawn(move || {
        let mut kept = String::new();
        for line in std::io::BufReader::new(err_pipe).lines() {
            let Ok(line) = line else { break };
            match line
                .strip_prefix(super::trial::SAMPLE_PREFIX)
                .and_then(|rest| {
                    let (t, b) = rest.split_once(' ')?;
                    Some((t.parse().ok()?, b.parse().ok()?))
                }) {
                Some(sample) => {
                    let _ = tx.send(sample);
                }
                None => {
                    kept.push_str(&line);
                    kept.push('\n');
                }
            }
        }
        kept
    });
    let pid = child.id();
    let start = Instant::now();
    let mut timed_out = false;
    let mut nvml_peak: Option<u64> = None;
    let mut nvml_now: Option<u64> = None;
    let mut next_nvml = start;
    let status = loop {
        if let Some((t, gpu, every)) = nvml
            && Instant::now() >= next_nvml
        {
            next_nvml += every;
            nvml_now = t.process_bytes(pid, gpu);
            if let Some(b) = nvml_now {
                nvml_peak = Some(nvml_peak.map_or(b, |p| p.max(b)));
            }
        }
        if let Some(status) = child
            .try_wait()
            .map_err(|e| Error::Unavailable(format!("cannot wait for a trial process: {e}")))?
        {
            break status;
        }
        for (t, tracked) in rx.try_iter() {
            on_sample(t, tracked, crate::sys::proc::rss(pid), nvml_now);
        }
        if start.elapsed() > timeout || stop.load(Ordering::SeqCst) {
            timed_out = !stop.load(Ordering::SeqCst);
            let _ = child.kill();
            break child.wait().map_err(|e| {
                Error::Unavailable(format!("cannot wait for a trial process: {e}"))
            })?;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = out.join().unwrap_or_default();
    let err = err.join().unwrap_or_default();
    if timed_out {
        return Ok(Ended::TimedOut { err });
    }
    use std::os::unix::process::ExitStatusExt;
    if let Some(signal) = status.signal() {
        return Ok(Ended::Signalled { signal, err });
    }
    let parsed = out
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .and_then(|l| serde_json::from_str::<TrialOutput>(l).ok())
        .map(Box::new);
    Ok(Ended::Exited {
        code: status.code(),
        out: parsed,
        err,
        nvml_peak,
    })
}

/// The cost a trial is ranked by, and its interval (from the throughput's):
/// $ per million tokens when priced, else seconds per million tokens (a
/// host without a price: the same order as tokens/s).
pub fn cost_of(r: &TrialRecord) -> Option<(f64, [f64; 2])> {
    let m = r.measured.as_ref()?;
    let [t_lo, t_hi] = m.tokens_per_s_ci;
    let per = |t: f64| 1e6 / t;
    Some(match m.usd_per_mtok {
        Some(usd) => {
            let k = usd / per(m.tokens_per_s);
            (usd, [k * per(t_hi), k * per(t_lo)])
        }
        None => (per(m.tokens_per_s), [per(t_hi), per(t_lo)]),
    })
}

/// The fitting trials a recommendation may pick: numerics-changing ones
/// only when the recipe allows them.
pub fn eligible(report: &SweepReport) -> Vec<usize> {
    (0..report.trials.len())
        .filter(|&i| {
            let r = &report.trials[i];
            r.fits && (report.allow_numerics_change || r.numerics_changes.is_empty())
        })
        .collect()
}

/// Picks the cheapest fitting trial from each trial's own measurement,
/// and the Pareto frontier ([`recommend_with`] without a paired ranking:
/// what the TUI shows while trials come in).
pub fn recommend(report: &mut SweepReport) {
    recommend_with(report, None);
}

/// Picks the cheapest fitting trial, and the Pareto frontier.
///
/// With a `paired` ranking ([`super::retime`]), the finalists rank first,
/// fastest first by their paired cost ratios, and the tie is every
/// finalist whose paired interval reaches within `tie_within` of the
/// fastest. Otherwise costs come from each trial's own throughput and its
/// interval, and every fitting trial whose cost interval overlaps the
/// cheapest one's is tied with it. Either way the pick is settled by what
/// does not depend on timing: no numerics change first, then more margin,
/// then fewer GPUs, then the lower cost; with a paired ranking, among the
/// tied trials timing cannot tell from the fastest at all (whose interval
/// reaches 1.0), so that another sweep's pick is within this one's tie.
pub fn recommend_with(report: &mut SweepReport, ranking: Option<Ranking>) {
    report.pareto = pareto_frontier(report);
    let fit = cheapest_first(report);
    if fit.is_empty() {
        report.recommendation = None;
        return;
    }
    let (trial, reasons, runners_up, tied, drift) = {
        let pick = Pick::new(report, fit, ranking.as_ref());
        let runners = pick.runners_up();
        let tied = pick.tie.iter().copied().filter(|&t| t != pick.i).collect();
        (pick.i, pick.reasons(&runners), runners, tied, pick.drift)
    };
    let mut ranking = ranking;
    if let Some(rk) = ranking.as_mut() {
        rk.drift = drift;
    }
    report.recommendation = Some(Recommendation {
        trial,
        reasons,
        runners_up,
        tied,
        ranking,
    });
}

/// How much of the usable memory a trial leaves (an unmeasured one sorts
/// as if it left a great deal).
fn margin(report: &SweepReport, r: &TrialRecord) -> i64 {
    report.usable_bytes() as i64
        - r.measured.as_ref().map_or(i64::MAX / 2, |m| {
            (m.peak_bytes.total + report.runtime_overhead_bytes) as i64
        })
}

/// [`cost_of`]'s cost, an unmeasured trial costing the most.
fn cost(r: &TrialRecord) -> f64 {
    cost_of(r).map_or(f64::INFINITY, |c| c.0)
}

/// [`cost_of`]'s interval, an unmeasured trial's lying beyond every other.
fn interval(r: &TrialRecord) -> [f64; 2] {
    cost_of(r).map_or([f64::INFINITY; 2], |c| c.1)
}

/// Pareto: by increasing peak, keep each fitting trial faster than every
/// smaller one.
fn pareto_frontier(report: &SweepReport) -> Vec<usize> {
    let mut by_peak: Vec<usize> = (0..report.trials.len())
        .filter(|&i| report.trials[i].fits)
        .collect();
    by_peak.sort_by_key(|&i| {
        report.trials[i]
            .measured
            .as_ref()
            .map_or(0, |m| m.peak_bytes.total)
    });
    let mut best = f64::NEG_INFINITY;
    by_peak
        .into_iter()
        .filter(|&i| {
            let t = report.trials[i]
                .measured
                .as_ref()
                .map_or(0.0, |m| m.tokens_per_s);
            let keep = t > best;
            best = best.max(t);
            keep
        })
        .collect()
}

/// The [`eligible`] trials, cheapest first (then fewer GPUs, then more
/// margin).
fn cheapest_first(report: &SweepReport) -> Vec<usize> {
    let mut fit = eligible(report);
    fit.sort_by(|&a, &b| {
        let (x, y) = (&report.trials[a], &report.trials[b]);
        cost(x)
            .total_cmp(&cost(y))
            .then(x.point.gpus.cmp(&y.point.gpus))
            .then(margin(report, y).cmp(&margin(report, x)))
    });
    fit
}

/// The paired ranking, when it ranked trials that fit.
fn paired_ranking<'a>(ranking: Option<&'a Ranking>, fit: &[usize]) -> Option<&'a Ranking> {
    ranking.filter(|rk| {
        rk.method == "paired"
            && !rk.paired.is_empty()
            && rk.paired.iter().all(|p| fit.contains(&p.trial))
    })
}

/// How far the load drifted between the trials: each finalist's
/// throughput in its paired bouts over that in its own trial, the
/// largest of these over the smallest (1.0: every trial ran under the
/// same load).
fn load_drift(report: &SweepReport, rk: &Ranking) -> Option<f64> {
    let k: Vec<f64> = rk
        .paired
        .iter()
        .filter_map(|p| {
            let own = report.trials[p.trial].measured.as_ref()?.tokens_per_s;
            Some(p.tokens_per_s / own).filter(|k| k.is_finite() && *k > 0.0)
        })
        .collect();
    let (lo, hi) = k.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &x| {
        (lo.min(x), hi.max(x))
    });
    // The load's swing during the re-timing says how much a trial
    // timed alone may have been slowed, too.
    let between = (k.len() >= 2).then(|| (hi / lo).max(1.0));
    match (between, rk.load_swing) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// A recommendation being made: the fitting trials in rank order, the
/// ranking they were ranked on, the tie, and the pick `i`.
struct Pick<'a> {
    report: &'a SweepReport,
    /// The ranking the sweep passed, paired or not.
    ranking: Option<&'a Ranking>,
    /// `ranking` when it is a paired ranking of fitting trials.
    paired: Option<&'a Ranking>,
    /// The fitting trials: the paired finalists first, in paired order,
    /// then the rest by their own cost.
    fit: Vec<usize>,
    drift: Option<f64>,
    /// The trials timing cannot separate from the fastest, settled.
    tie: Vec<usize>,
    /// Those the pick is made among, settled: the pick is the first.
    pool: Vec<usize>,
    i: usize,
}

impl<'a> Pick<'a> {
    /// `fit` comes cheapest first, and not empty.
    fn new(report: &'a SweepReport, mut fit: Vec<usize>, ranking: Option<&'a Ranking>) -> Self {
        let paired = paired_ranking(ranking, &fit);
        let drift = paired.and_then(|rk| load_drift(report, rk));
        let (mut tie, mut pool) = match paired {
            Some(rk) => paired_tie(report, &mut fit, rk, drift),
            None => {
                let band = interval(&report.trials[fit[0]]);
                let tie: Vec<usize> = fit
                    .iter()
                    .copied()
                    .filter(|&i| crate::stats::overlaps(interval(&report.trials[i]), band))
                    .collect();
                (tie.clone(), tie)
            }
        };
        let settle = |a: &usize, b: &usize| settle(report, &fit, *a, *b);
        pool.sort_by(settle);
        tie.sort_by(settle);
        Pick {
            report,
            ranking,
            paired,
            i: pool[0],
            fit,
            drift,
            tie,
            pool,
        }
    }

    fn trial(&self, i: usize) -> &'a TrialRecord {
        &self.report.trials[i]
    }

    fn picked(&self) -> &'a TrialRecord {
        self.trial(self.i)
    }

    fn measured(&self) -> &'a Measured {
        self.picked().measured.as_ref().expect("fitting trials ran")
    }

    fn pair_of(&self, i: usize) -> Option<&'a crate::report::sweep::PairedTrial> {
        self.paired
            .and_then(|rk| rk.paired.iter().find(|p| p.trial == i))
    }

    fn meta(&self) -> bool {
        self.report.device.starts_with("meta")
    }

    /// The next three fitting trials after the pick.
    fn runners_up(&self) -> Vec<usize> {
        (self.fit.iter().copied())
            .filter(|&j| j != self.i)
            .take(3)
            .collect()
    }

    /// Why this trial, in the order the reports list them.
    fn reasons(&self, runners: &[usize]) -> Vec<String> {
        let mut reasons = vec![self.headline()];
        match self.paired {
            Some(rk) => self.paired_reasons(rk, &mut reasons),
            None => self.own_timing_reasons(&mut reasons),
        }
        reasons.push(self.peak_reason());
        if let Some(&j) = runners.first() {
            reasons.push(self.runner_up_reason(j));
        }
        let r = self.picked();
        if r.numerics_changes.is_empty() {
            reasons.push("changes no numerics".into());
        } else {
            reasons.push(format!(
                "changes numerics: {}",
                r.numerics_changes.join(", ")
            ));
        }
        if !self.report.allow_numerics_change {
            reasons.push(
                "fp16, adamw8bit and adafactor were ruled out (allow_numerics_change: false)"
                    .into(),
            );
        }
        if let Some(t) = &r.target {
            reasons.push(format!(
                "on the target ({}), planned at {} per GPU ({}) and {:.0} tokens/s, ${} per million tokens",
                self.report.target.display_name,
                crate::units::fmt_bytes(t.peak_total_bytes),
                if t.fits { "fits" } else { "does not fit" },
                t.tokens_per_s,
                crate::plan::usd(t.usd_per_mtok)
            ));
        }
        reasons
    }

    /// The pick's throughput, and how it was had.
    fn speed(&self) -> String {
        let m = self.measured();
        if self.meta() {
            format!(
                "{:.0} tokens/s predicted (meta trials compute nothing, so nothing was timed: the throughput is the run device's roofline)",
                m.tokens_per_s
            )
        } else {
            format!(
                "{:.0} tokens/s measured{} (95% interval {:.0}-{:.0}, median of {} timed steps)",
                m.tokens_per_s,
                if self.paired.is_some() {
                    " in its own trial"
                } else {
                    ""
                },
                m.tokens_per_s_ci[0],
                m.tokens_per_s_ci[1],
                m.step_ms.len().saturating_sub(m.warmup_steps)
            )
        }
    }

    /// The first reason: what the pick was ranked on, and its cost.
    fn headline(&self) -> String {
        let speed = self.speed();
        let fit = self.fit.len();
        let how = match self.paired {
            Some(_) => "ranked on paired re-timing",
            None => "lowest cost",
        };
        let on_host = self.report.pricing.basis == "host";
        match (self.measured().usd_per_mtok, on_host) {
            (Some(usd), true) => format!(
                "{how} among {fit} fitting trials: ${} per million tokens on this host at {speed}",
                crate::plan::usd(usd)
            ),
            (Some(usd), false) => format!(
                "{how} among {fit} fitting trials: ${} per million tokens at {speed} on {} GPU(s)",
                crate::plan::usd(usd),
                self.picked().point.gpus
            ),
            (None, _) if self.paired.is_some() => format!(
                "fastest among {fit} fitting trials on this host, ranked on paired re-timing (no host_usd_per_hour, so by throughput): {speed}"
            ),
            (None, _) => format!(
                "fastest among {fit} fitting trials on this host (no host_usd_per_hour, so ranked by throughput): {speed}"
            ),
        }
    }

    /// What settled the tie between the pick and `x`.
    fn settled_by(&self, x: &TrialRecord) -> &'static str {
        let r = self.picked();
        if r.numerics_changes.is_empty() != x.numerics_changes.is_empty() {
            "it changes no numerics"
        } else if margin(self.report, r) != margin(self.report, x) {
            "it leaves the most memory to spare"
        } else if r.point.gpus != x.point.gpus {
            "it uses the fewest GPUs"
        } else {
            "its cost is lowest"
        }
    }

    /// How the finalists were re-timed, the tie among them, and the noise.
    fn paired_reasons(&self, rk: &Ranking, reasons: &mut Vec<String>) {
        let fastest = rk.paired[0].trial;
        reasons.push(format!(
            "the {} cheapest trials were timed again, interleaved ({} rounds of one bout each of {}, the order rotated every round), so that they shared the host's load; each is ranked on its cost over the fastest's in the same round (paired intervals within ±{:.1}%, bound ±{:.0}%{})",
            rk.contenders.len(),
            rk.rounds,
            super::markdown::bout_words(rk),
            rk.widest_half_interval * 100.0,
            rk.noise_bound * 100.0,
            match rk.retries {
                0 => String::new(),
                n => format!(", after {n} re-timing(s) of wider ones"),
            }
        ));
        if self.tie.len() > 1 {
            let within = format!(
                "a tie: {} fitting configurations have paired intervals reaching within {:.0}% of the fastest (#{fastest}), so timing cannot rank them",
                self.tie.len(),
                rk.tie_within * 100.0
            );
            reasons.push(if self.pool.len() > 1 {
                format!(
                    "{within}; chosen among the {} that timing cannot tell from the fastest at all because {}",
                    self.pool.len(),
                    self.settled_by(self.trial(self.pool[1]))
                )
            } else {
                format!("{within}; this one is the fastest")
            });
        }
        if self.i != fastest
            && let Some(p) = self.pair_of(self.i)
        {
            reasons.push(format!(
                "its cost is {:.3}x the fastest's in paired timing (95% interval {:.3}-{:.3})",
                p.cost_ratio, p.cost_ratio_ci[0], p.cost_ratio_ci[1]
            ));
        }
        if rk.noisy {
            reasons.push(format!(
                "the host was too noisy to separate them: after {} interleaved rounds the paired intervals were still up to ±{:.0}% (the bound is ±{:.0}%), so the tie is widened to {:.0}%, to every fitting trial whose paired measurement comes that near the fastest, or whose own does allowing for the {:.2}x the load swung (between trials, or while the finalists were re-timed; {} in all); the pick is the fastest in paired timing, or one timing cannot tell from it, and another sweep may well pick another of the tied",
                rk.rounds,
                rk.widest_half_interval * 100.0,
                rk.noise_bound * 100.0,
                rk.tie_within * 100.0,
                self.drift.unwrap_or(1.0),
                self.tie.len()
            ));
        }
    }

    /// Without a paired ranking: the tie on the trials' own intervals, why
    /// they were not re-timed, and whether one trial's timing was too noisy.
    fn own_timing_reasons(&self, reasons: &mut Vec<String>) {
        let rk = self.ranking;
        if self.tie.len() > 1 {
            reasons.push(format!(
                "a tie: {} fitting configurations have throughput intervals overlapping the fastest one's, so timing cannot separate them; chosen among them because {}",
                self.tie.len(),
                self.settled_by(self.trial(self.tie[1]))
            ));
        }
        if let Some(note) = rk.and_then(|rk| rk.note.as_ref()) {
            reasons.push(format!(
                "ranked on each trial's own {}: {note}",
                if self.meta() {
                    "prediction"
                } else {
                    "measurement"
                }
            ));
        }
        let m = self.measured();
        let [lo, hi] = m.tokens_per_s_ci;
        let half = (hi - lo) / 2.0 / m.tokens_per_s;
        let bound = rk.map_or(0.10, |rk| rk.noise_bound);
        if !self.meta() && half > bound && rk.is_none_or(|rk| rk.contenders.len() != 1) {
            reasons.push(format!(
                "its throughput interval is ±{:.0}%, wider than ±{:.0}%: this host was too noisy for one trial's timing to rank it",
                half * 100.0,
                bound * 100.0
            ));
        }
    }

    fn peak_reason(&self) -> String {
        let report = self.report;
        format!(
            "peak {} of {} usable ({} to spare; {} capacity, {:.0}% headroom)",
            crate::units::fmt_bytes(
                self.measured().peak_bytes.total + report.runtime_overhead_bytes
            ),
            crate::units::fmt_bytes(report.usable_bytes()),
            crate::units::fmt_bytes(margin(report, self.picked()).max(0) as u64),
            crate::units::fmt_bytes(report.capacity_bytes),
            report.headroom * 100.0
        )
    }

    /// How the first runner-up `j` compares: in paired timing when both
    /// were finalists, else on their own costs.
    fn runner_up_reason(&self, j: usize) -> String {
        let ru = self.trial(j);
        let what = if self.measured().usd_per_mtok.is_some() {
            "cost per token"
        } else {
            "time per token"
        };
        if let (Some(a), Some(b)) = (self.pair_of(self.i), self.pair_of(j)) {
            let ratio = b.cost_ratio / a.cost_ratio;
            return format!(
                "runner-up {} has {:.1}% {} {what} in paired timing (its interval over the fastest's: {:.3}-{:.3}){}",
                ru.point.label(),
                (ratio - 1.0).abs() * 100.0,
                if ratio >= 1.0 { "more" } else { "less" },
                b.cost_ratio_ci[0],
                b.cost_ratio_ci[1],
                if self.tie.contains(&j) {
                    ", within the tie"
                } else {
                    ""
                }
            );
        }
        let ratio = cost(ru) / cost(self.picked());
        if ratio >= 1.0 {
            format!(
                "runner-up {} has {:.1}% more {what}",
                ru.point.label(),
                (ratio - 1.0) * 100.0
            )
        } else {
            format!(
                "runner-up {} measured {:.1}% less {what}, within the tie",
                ru.point.label(),
                (1.0 - ratio) * 100.0
            )
        }
    }
}

/// The tie and the pool under a paired ranking: the finalists go first in
/// `fit`, in paired order; the rest keep their own cost order.
fn paired_tie(
    report: &SweepReport,
    fit: &mut [usize],
    rk: &Ranking,
    drift: Option<f64>,
) -> (Vec<usize>, Vec<usize>) {
    let cheapest = fit[0];
    let pos = |i: usize| rk.paired.iter().position(|p| p.trial == i);
    fit.sort_by_key(|&i| pos(i).unwrap_or(usize::MAX));
    let (mut tie, pool) = super::retime::tie_sets(rk);
    // Too noisy to separate even the finalists: which trials became
    // finalists, on their own measurements, is no surer. So the tie
    // also holds every fitting trial whose own measurement reaches
    // within it of the cheapest, allowing for the drift between
    // trials that the finalists show.
    if rk.noisy {
        let best = cost(&report.trials[cheapest]);
        let reach = best * (1.0 + rk.tie_within) * drift.unwrap_or(1.0);
        let more: Vec<usize> = (fit.iter().copied())
            .filter(|&i| pos(i).is_none() && !tie.contains(&i))
            .filter(|&i| interval(&report.trials[i])[0] <= reach)
            .collect();
        tie.extend(more);
    }
    (tie, pool)
}

/// The order that settles a tie, by what does not depend on timing: no
/// numerics change first, then more margin, then fewer GPUs, then the
/// rank in `fit`.
fn settle(report: &SweepReport, fit: &[usize], a: usize, b: usize) -> std::cmp::Ordering {
    let (x, y) = (&report.trials[a], &report.trials[b]);
    let rank = |i: usize| fit.iter().position(|&f| f == i);
    x.numerics_changes
        .is_empty()
        .cmp(&y.numerics_changes.is_empty())
        .reverse()
        .then(margin(report, y).cmp(&margin(report, x)))
        .then(x.point.gpus.cmp(&y.point.gpus))
        .then(rank(a).cmp(&rank(b)))
}

/// report.json, report.md, report.html, the plots and the exports. The
/// first three are written whole or not at all ([`write_atomic`]): a sweep
/// killed while writing leaves the previous report, never half of one.
pub fn write_reports(report: &SweepReport, dir: &Path) -> Result<Vec<PathBuf>> {
    let write = |name: &str, text: &str| -> Result<PathBuf> {
        let path = dir.join(name);
        write_atomic(&path, text.as_bytes())?;
        Ok(path)
    };
    let mut files = vec![
        write(
            "report.json",
            &serde_json::to_string_pretty(report).expect("report serialises"),
        )?,
        write("report.md", &super::markdown::render(report))?,
        write("report.html", &super::html::render_html(report))?,
    ];
    files.extend(super::plots::write_plots(report, dir)?);
    files.extend(super::export::write_exports(report, dir)?);
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Checkpointing, Optimizer};
    use crate::sweep::plots::tests::{peaks, point, trial};

    /// A pipeline's trial id names its virtual stages only when it
    /// interleaves, so that the ids of every other point (journals,
    /// `--resume`, `memfit check` baselines) are as before.
    #[test]
    fn virtual_stages_join_the_trial_id_only_when_set() {
        let pp = Point {
            pipeline_stages: 2,
            gpus: 2,
            grad_accum: 4,
            ..point(1, Checkpointing::None, Optimizer::Adamw)
        };
        let plain = trial_id(&pp);
        assert_eq!(
            plain,
            "pp2-gpus2-none-bf16-adamw-ckpt_none-fused-mb1-accum4"
        );
        let v2 = trial_id(&Point {
            virtual_stages: 2,
            ..pp
        });
        assert_eq!(v2, plain.replace("pp2-", "pp2-vpp2-"));
        assert!(
            Point {
                virtual_stages: 2,
                ..pp
            }
            .label()
            .contains("pp2 vpp2 ")
        );
    }

    #[test]
    fn thousands_are_grouped() {
        assert_eq!(thousands(45000.4), "45,000");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(thousands(1_234_567.0), "1,234,567");
        assert_eq!(thousands(0.2), "0");
        assert_eq!(thousands(f64::NAN), "-");
    }

    #[test]
    fn a_trial_line_says_what_became_of_it() {
        let mut t = trial(
            point(4, Checkpointing::Full, Optimizer::Adamw),
            Outcome::Ran,
            true,
        );
        t.measured = Some(Measured::for_tests(peaks(5), 45000.0));
        assert_eq!(
            trial_line(3, 12, &t, 0, false),
            "[3/12] mb4 x1 none bf16 adamw ckpt:full fused accum 4: fit, peak 5.00 MiB, 45,000 tok/s"
        );
        assert!(trial_line(3, 12, &t, 0, true).ends_with("45,000 tok/s predicted"));
        t.fits = false;
        assert!(trial_line(3, 12, &t, 0, false).contains(": over the usable limit, peak"));
        t.outcome = Outcome::Oom;
        assert!(trial_line(4, 12, &t, 0, false).ends_with(": out of memory"));
        t.outcome = Outcome::Crash;
        t.exit = Some(ExitInfo {
            code: None,
            signal: Some(6),
            stderr_tail: String::new(),
        });
        assert!(trial_line(5, 12, &t, 0, false).ends_with(": crash (signal 6)"));
    }
}
