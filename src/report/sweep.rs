//! The sweep's report (DIR/report.json) and journal records (DIR/trials.jsonl).
//!
//! Schema version 2; documented in docs/report-schema.md. A change that
//! removes or renames a field bumps [`SCHEMA_VERSION`]; `memfit check` refuses
//! reports of another version.

use serde::{Deserialize, Serialize};

use crate::memory::PeakBytes;
use crate::plan::Point;

pub const SCHEMA_VERSION: u32 = 2;

/// How a trial ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Ran its steps; `fits` says whether the measured peak is within the usable capacity.
    Ran,
    /// The engine refused an allocation past the capacity.
    Oom,
    /// Killed after the trial timeout.
    Timeout,
    /// Exited otherwise (a signal, a panic, an unexpected code).
    Crash,
    /// Not run: the planner predicts it does not fit.
    SkippedPredictedOom,
    /// Not run: micro-batch monotonicity settles it (a smaller micro-batch of
    /// the same knobs did not fit, or a larger one fits).
    SkippedByMonotonicity,
    /// Not run: the grid point is invalid (reason in `note`).
    Invalid,
}

/// What the planner predicted for a trial on the run device: the engine's
/// peak (plus the device's runtime overhead), and the step time by the run
/// device's roofline (the host's calibrated one on cpu, the GPU's otherwise).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Predicted {
    /// Engine peak per rank plus the device's runtime overhead (0 on cpu).
    pub peak_total_bytes: u64,
    pub peak_bytes: Option<PeakBytes>,
    pub step_s: f64,
    pub tokens_per_s: f64,
}

/// What the plan predicts for the same configuration on the target GPU.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TargetPrediction {
    /// Engine peak per rank plus the target's runtime overhead.
    pub peak_total_bytes: u64,
    /// Within the target's capacity x (1 - headroom).
    pub fits: bool,
    pub step_s: f64,
    pub tokens_per_s: f64,
    /// GPUs x the target's $/GPU-hour / predicted tokens per second, per million tokens.
    pub usd_per_mtok: f64,
    /// Whose allocations: hf-eager unless the recipe's grid names
    /// frameworks (the exports are run in PyTorch), else the point's own.
    #[serde(default)]
    pub framework: crate::engine::Framework,
}

pub use crate::engine::framework::HfKnobs;

/// What a trial measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    /// The tracker's per-category peaks (the highest over ranks): deterministic.
    pub peak_bytes: PeakBytes,
    /// The split at the moment of the total peak (the fullest rank): each
    /// category's live bytes then; they add up to `peak_bytes.total`.
    pub peak_split: PeakBytes,
    /// Host memory, not device memory: the trial process's resident-set
    /// high-water mark (VmHWM). Never compared with an emulated capacity.
    pub rss_peak_bytes: Option<u64>,
    /// The process's resident set before the engine allocated anything (the
    /// binary, its libraries, thread stacks): what RSS holds besides the model.
    pub rss_baseline_bytes: Option<u64>,
    /// Wall time of every step, milliseconds; the first `warmup_steps` are warm-up.
    pub step_ms: Vec<f64>,
    pub warmup_steps: usize,
    /// Median step time of the timed steps, seconds (the prediction's on meta).
    pub step_s: f64,
    /// 95% confidence interval of that median (order statistics), seconds.
    pub step_s_ci: [f64; 2],
    /// Tokens per step / median step time.
    pub tokens_per_s: f64,
    /// Tokens per step over the interval's ends (lower, upper).
    pub tokens_per_s_ci: [f64; 2],
    /// $/hour of what ran / tokens per second, per million tokens; `None`
    /// on the host without a `host_usd_per_hour` (ranking is then by tokens/s).
    pub usd_per_mtok: Option<f64>,
    pub losses: Vec<f32>,
    /// The highest tracked live bytes in each phase of a step (rank 0):
    /// `forward:embed`, `forward:i`, `backward:i`, `optimizer`, ...
    #[serde(default)]
    pub phase_peaks: Vec<crate::memory::PhasePeak>,
    /// On a GPU with NVML: the trial process's GPU memory high-water mark as
    /// NVML saw it (context, kernels, cuBLAS, the caching allocator's reserve
    /// and the tracked tensors), sampled every `--sample-ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvml_peak_bytes: Option<u64>,
}

/// How a crashed trial ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExitInfo {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    /// The last lines of its stderr.
    pub stderr_tail: String,
}

/// One grid point's trial, as the journal and the report store it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrialRecord {
    /// Stable key of the configuration (what `--resume` and `memfit check` match on).
    pub id: String,
    pub point: Point,
    pub outcome: Outcome,
    /// Measured peak within capacity x (1 - headroom).
    pub fits: bool,
    pub predicted: Option<Predicted>,
    pub measured: Option<Measured>,
    /// (measured - predicted) / measured tracked peak, percent.
    pub memory_error_pct: Option<f64>,
    /// Measured / predicted median step time on the run device (1.0 is exact;
    /// 2.0 means the step took twice the prediction).
    pub time_ratio: Option<f64>,
    /// (NVML peak - predicted total with the measured start-up overhead) /
    /// NVML peak, percent; on a GPU with NVML only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvml_error_pct: Option<f64>,
    /// The plan for this configuration on the target GPU.
    #[serde(default)]
    pub target: Option<TargetPrediction>,
    pub exit: Option<ExitInfo>,
    pub numerics_changes: Vec<String>,
    /// Why it was skipped or invalid, or the OOM message.
    pub note: Option<String>,
    pub elapsed_s: f64,
}

/// The chosen configuration and why.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recommendation {
    /// Index into `trials`.
    pub trial: usize,
    pub reasons: Vec<String>,
    /// Indices of the next-best fitting trials, best first.
    pub runners_up: Vec<usize>,
    /// Fitting trials timing cannot separate from the fastest: with
    /// `ranking.method` `paired`, those whose paired cost ratio's interval
    /// reaches within `ranking.tie_within` of it; otherwise those whose
    /// throughput interval overlaps the fastest one's. Settled by numerics,
    /// then margin, then GPUs.
    pub tied: Vec<usize>,
    /// How the fitting trials were ranked (absent in reports written before
    /// memfit ranked on paired measurements).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranking: Option<Ranking>,
}

/// How a recommendation's trials were ranked.
///
/// A sweep times its trials one after another, over minutes; on a shared
/// host the load drifts between them, which no single trial's interval
/// covers. So the cheapest trials (the contenders) are timed again,
/// interleaved: round after round each runs one short bout, in an order
/// rotated every round, and the bouts of one round share the host's load.
/// The ranking then rests on ratios of bouts within a round.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Ranking {
    /// `paired` (re-timed interleaved, ranked on paired ratios), `single`
    /// (on each trial's own measurement; `note` says why) or `predicted`
    /// (meta: nothing is timed, throughput is the roofline's).
    pub method: String,
    /// Why the ranking is not paired, or what cut re-timing short.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Trials re-timed: the cheapest fitting ones by their own measurement.
    #[serde(default)]
    pub contenders: Vec<usize>,
    /// Interleaved rounds every finalist ran a bout in.
    #[serde(default)]
    pub rounds: usize,
    /// Timed steps per bout at least, after one warm-up step, and until
    /// they took `bout_budget_s` (0 in reports from before bouts had a
    /// time budget).
    #[serde(default)]
    pub bout_steps: usize,
    #[serde(default)]
    pub bout_budget_s: f64,
    /// The finalists, fastest first, with their paired figures.
    #[serde(default)]
    pub paired: Vec<PairedTrial>,
    /// The widest of the finalists' paired intervals: its half-width over
    /// its median (0.04 is ±4%).
    #[serde(default)]
    pub widest_half_interval: f64,
    /// Paired intervals wider than ±this are re-timed, up to
    /// `max_retries` more batches of rounds, before they are ranked on.
    #[serde(default)]
    pub noise_bound: f64,
    #[serde(default)]
    pub retries: usize,
    #[serde(default)]
    pub max_retries: usize,
    /// Finalists whose paired ratio's interval reaches within this fraction
    /// of the fastest are tied with it: the tie floor, or twice the widest
    /// half-interval when that is larger (another sweep's pick may differ
    /// from this one's by both sweeps' uncertainty).
    #[serde(default)]
    pub tie_within: f64,
    /// The least `tie_within`; the pick is made among the tied finalists
    /// whose interval reaches 1.0 and whose median is within this of it.
    #[serde(default)]
    pub tie_floor: f64,
    /// The host was too noisy to separate the contenders: their paired
    /// intervals stayed wider than ±`noise_bound` after every retry.
    #[serde(default)]
    pub noisy: bool,
    /// How far the load drifted between trials: each finalist's tokens/s
    /// in its paired bouts over that in its own trial, the largest of
    /// these over the smallest (1.0: all trials ran under one load). When
    /// `noisy`, the tie also holds the fitting trials whose own cost
    /// interval reaches within `tie_within` of the cheapest times this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drift: Option<f64>,
    /// How far the load swung while the finalists were re-timed: of each
    /// finalist's bouts, the 90th percentile of their costs over the 10th,
    /// the largest of these (1.0: a steady host). A trial timed alone may have been slowed
    /// as much, so when `noisy` the tie allows for the larger of this and
    /// `drift`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_swing: Option<f64>,
    /// The contenders screened out before the finalists' rounds, cheapest
    /// first, with their cost over the fastest finalist's in the screening
    /// rounds (a few, so wide intervals). Those whose interval reaches
    /// within `tie_within` of 1.0 are in the tie.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub screened: Vec<PairedTrial>,
}

/// One finalist's paired figures.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PairedTrial {
    /// Index into `trials`.
    pub trial: usize,
    /// Its cost per token over the fastest finalist's in the same round:
    /// the median over the rounds (1.0 for the fastest, 1.05 is 5% more).
    pub cost_ratio: f64,
    /// The ~95% interval of that median (sign-test order statistics).
    pub cost_ratio_ci: [f64; 2],
    /// Tokens/s of its bouts, median over the rounds (the load included).
    pub tokens_per_s: f64,
    /// Bouts that gave a time, and bouts that failed (crash, OOM, timeout).
    pub bouts: usize,
    pub failed_bouts: usize,
}

/// Where the trials ran.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunDevice {
    /// As asked for (recipe `device` or `--device`): `cpu`, `cpu:limit=24MiB`, `meta`.
    pub spec: String,
    /// `cpu` or `meta`.
    pub kind: String,
    /// In words, e.g. "this host's CPU (2 threads), emulating a 24.00 MiB device".
    pub description: String,
    /// The capacity the trials ran against.
    pub capacity_bytes: u64,
    /// The capacity is an emulated limit, not a device's own memory.
    pub emulated: bool,
}

/// The GPU the plan predicts for (`hardware` in the recipe).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Target {
    pub name: String,
    pub display_name: String,
    /// Its memory (or the recipe's `capacity`), and the runtime's share of it.
    pub capacity_bytes: u64,
    pub runtime_overhead_bytes: u64,
    pub usd_per_gpu_hour: f64,
}

/// What measured throughput is priced at.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pricing {
    /// `host` when trials ran on this machine's CPU (the host runs every
    /// rank, so cost per token is the host's $/hour over its tokens/s), or
    /// `target` when they ran on (or are predicted for) the target GPUs.
    pub basis: String,
    /// The host's or one GPU's $/hour; `None` for a host with no price
    /// given, when ranking is by tokens/s alone (the same order).
    pub usd_per_hour: Option<f64>,
}

/// How step times were measured (like hyperfine: repeat until the
/// confidence interval is tight or the budget is spent).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimingPolicy {
    pub warmup_steps: usize,
    pub min_steps: usize,
    pub max_steps: usize,
    /// Stop when the median's 95% interval is within this fraction of it.
    pub target_rel_ci: f64,
    /// Seconds of timed steps per trial, at most.
    pub budget_s: f64,
}

/// DIR/report.json.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SweepReport {
    pub schema_version: u32,
    pub memfit_version: String,
    pub recipe: String,
    pub model: String,
    /// The model's file, absolute, when the recipe named a file rather than
    /// a built-in profile (a profile YAML or a Hugging Face config.json);
    /// `recommended.yaml` names it relative to its own folder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_file: Option<String>,
    /// The target GPU's profile name (`target.name`).
    pub hardware: String,
    /// The hardware profile's file, as `model_file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware_file: Option<String>,
    /// The recipe's `network:`, a profile name or its file (absolute),
    /// which put the hardware's nodes on another fabric.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<String>,
    /// The recipe's `attention_kernel:`, whose published rates priced the
    /// target's fused attention.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_kernel: Option<crate::config::attention_kernels::AttentionKernel>,
    /// The recipe's `host_memory:` in bytes, each node's host memory for
    /// offloaded tensors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory: Option<u64>,
    /// The device the trials ran on, e.g. `cpu:limit=64MiB` (`run_device.spec`).
    pub device: String,
    pub run_device: RunDevice,
    pub target: Target,
    pub pricing: Pricing,
    /// The host's calibrated roofline, when trials ran on cpu.
    pub calibration: Option<crate::calibrate::Calibration>,
    pub timing: TimingPolicy,
    /// The capacity trials are judged against (the run device's).
    pub capacity_bytes: u64,
    /// Added to each trial's tracked peak when judging fit: the GPU's runtime
    /// overhead when the capacity is the GPU's, 0 under a device limit.
    #[serde(default)]
    pub runtime_overhead_bytes: u64,
    pub headroom: f64,
    pub allow_numerics_change: bool,
    /// The recipe's LoRA knobs, when its grid has LoRA or QLoRA points.
    #[serde(default)]
    pub lora: Option<crate::engine::LoraConfig>,
    /// The recipe's hf-eager knobs (dropout, AdamW implementation,
    /// set_to_none), for the pinned recipe.
    #[serde(default)]
    pub hf_knobs: Option<HfKnobs>,
    pub seq_len: usize,
    pub global_batch: usize,
    /// Grid points, and how many of them ran as trials.
    pub grid_size: usize,
    pub trials_run: usize,
    pub trials: Vec<TrialRecord>,
    pub recommendation: Option<Recommendation>,
    /// Indices of the fitting trials on the Pareto frontier of (peak memory
    /// lower, tokens/s higher), by increasing peak.
    pub pareto: Vec<usize>,
    /// The sweep stopped early (Ctrl-C); what ran is all here.
    pub interrupted: bool,
    /// On a GPU run device: NVML's state ("NVML, driver 550.54" or "no
    /// NVML: <why>"); absent on cpu and meta.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvml: Option<String>,
}

impl SweepReport {
    /// Capacity x (1 - headroom): what a fitting trial may peak at.
    pub fn usable_bytes(&self) -> u64 {
        (self.capacity_bytes as f64 * (1.0 - self.headroom)) as u64
    }
}

#[cfg(test)]
impl SweepReport {
    /// A report with no trials, run on an emulated 64 MiB cpu device with a
    /// $2.50/h host, for unit tests to fill in with struct update syntax.
    pub(crate) fn empty_for_tests() -> SweepReport {
        let mib = 1u64 << 20;
        SweepReport {
            schema_version: SCHEMA_VERSION,
            memfit_version: "0.1.0".into(),
            recipe: "recipes/tiny.yaml".into(),
            model: "tiny-gpt".into(),
            model_file: None,
            hardware: "t4".into(),
            hardware_file: None,
            network: None,
            attention_kernel: None,
            host_memory: None,
            device: "cpu:limit=64MiB".into(),
            run_device: RunDevice {
                spec: "cpu:limit=64MiB".into(),
                kind: "cpu".into(),
                description: "this host's CPU (2 threads), emulating a 64.00 MiB device".into(),
                capacity_bytes: 64 * mib,
                emulated: true,
            },
            target: Target {
                name: "t4".into(),
                display_name: "NVIDIA T4 16GB".into(),
                capacity_bytes: 15 << 30,
                runtime_overhead_bytes: 768 * mib,
                usd_per_gpu_hour: 0.53,
            },
            pricing: Pricing {
                basis: "host".into(),
                usd_per_hour: Some(2.5),
            },
            calibration: None,
            timing: TimingPolicy {
                warmup_steps: 1,
                min_steps: 5,
                max_steps: 60,
                target_rel_ci: 0.05,
                budget_s: 2.0,
            },
            capacity_bytes: 64 * mib,
            runtime_overhead_bytes: 0,
            headroom: 0.05,
            allow_numerics_change: true,
            lora: None,
            hf_knobs: None,
            seq_len: 128,
            global_batch: 16,
            grid_size: 0,
            trials_run: 0,
            trials: Vec::new(),
            recommendation: None,
            pareto: Vec::new(),
            interrupted: false,
            nvml: None,
        }
    }
}

#[cfg(test)]
impl Measured {
    /// A measurement with `tokens_per_s` over a 1024-token step, steady
    /// timing, priced at $2.50/h.
    pub(crate) fn for_tests(peak_bytes: PeakBytes, tokens_per_s: f64) -> Measured {
        let step_s = 1024.0 / tokens_per_s;
        Measured {
            peak_bytes,
            peak_split: peak_bytes,
            rss_peak_bytes: Some(peak_bytes.total + (40 << 20)),
            rss_baseline_bytes: Some(12 << 20),
            step_ms: vec![step_s * 1.2e3, step_s * 1e3, step_s * 1e3],
            warmup_steps: 1,
            step_s,
            step_s_ci: [step_s, step_s],
            tokens_per_s,
            tokens_per_s_ci: [tokens_per_s, tokens_per_s],
            usd_per_mtok: Some(2.5 / 3600.0 / tokens_per_s * 1e6),
            losses: vec![10.8, 10.7],
            phase_peaks: Vec::new(),
            nvml_peak_bytes: None,
        }
    }
}
