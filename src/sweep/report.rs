//! The sweep's report (DIR/report.json) and journal records (DIR/trials.jsonl).
//!
//! Schema version 1; documented in docs/report-schema.md. A change that
//! removes or renames a field bumps [`SCHEMA_VERSION`]; `memfit check` refuses
//! reports of another version.

use serde::{Deserialize, Serialize};

use crate::memory::PeakBytes;
use crate::plan::Point;

pub const SCHEMA_VERSION: u32 = 1;

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

/// What the planner predicted for a trial.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Predicted {
    /// Engine peak per rank plus the device's runtime overhead (0 on cpu).
    pub peak_total_bytes: u64,
    pub peak_bytes: Option<PeakBytes>,
    pub step_s: f64,
    pub tokens_per_s: f64,
}

/// What a trial measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    /// The tracker's per-category peaks (the highest over ranks): deterministic.
    pub peak_bytes: PeakBytes,
    /// The device-level peak: the trial process's RSS high-water mark (VmHWM) on cpu.
    pub device_peak_bytes: Option<u64>,
    /// Wall time of every step, milliseconds (the first is warm-up).
    pub step_ms: Vec<f64>,
    /// Mean step time after warm-up, seconds.
    pub step_s: f64,
    pub tokens_per_s: f64,
    /// GPUs x $/GPU-hour / tokens per second, per million tokens.
    pub usd_per_mtok: f64,
    pub losses: Vec<f32>,
    /// The highest tracked live bytes in each phase of a step (rank 0):
    /// `forward:embed`, `forward:i`, `backward:i`, `optimizer`, ...
    #[serde(default)]
    pub phase_peaks: Vec<crate::memory::PhasePeak>,
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
    /// (measured - predicted) / measured, percent, for memory and step time.
    pub memory_error_pct: Option<f64>,
    pub time_error_pct: Option<f64>,
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
}

/// DIR/report.json.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SweepReport {
    pub schema_version: u32,
    pub memfit_version: String,
    pub recipe: String,
    pub model: String,
    pub hardware: String,
    /// The device the trials ran on, e.g. `cpu:limit=64MiB`.
    pub device: String,
    pub capacity_bytes: u64,
    /// Added to each trial's tracked peak when judging fit: the GPU's runtime
    /// overhead when the capacity is the GPU's, 0 under a device limit.
    #[serde(default)]
    pub runtime_overhead_bytes: u64,
    pub headroom: f64,
    pub usd_per_gpu_hour: f64,
    pub allow_numerics_change: bool,
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
}

impl SweepReport {
    /// Capacity x (1 - headroom): what a fitting trial may peak at.
    pub fn usable_bytes(&self) -> u64 {
        (self.capacity_bytes as f64 * (1.0 - self.headroom)) as u64
    }
}
