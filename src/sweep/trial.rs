//! `memfit trial`: one sweep trial in its own process. The sweep re-executes
//! memfit with a [`TrialSpec`]; the child trains the point for a few steps and
//! prints one JSON [`TrialOutput`] line. A crash, an abort or a kill then takes
//! down only the child, and the sweep records it and goes on.

use serde::{Deserialize, Serialize};

use crate::backend::DeviceSpec;
use crate::engine::TrainConfig;
use crate::error::{Error, Result};
use crate::memory::PeakBytes;
use crate::run::{RunOptions, run};

/// Everything one trial needs; passed to the child as JSON.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrialSpec {
    pub model: String,
    /// The point's knobs with the recipe's (`plan::Point::train_config_with`),
    /// the seed included: the child resolves nothing itself.
    pub train: TrainConfig,
    /// Optimizer steps; the first is warm-up (ignored when `timing` is set).
    pub steps: usize,
    /// Repeat timed steps until this rule says stop.
    #[serde(default)]
    pub timing: Option<crate::stats::Timing>,
    /// `cpu:limit=...` or `meta:limit=...`.
    pub device: String,
    pub threads: Option<usize>,
    /// Test hook (`test-hooks`): fail the trial on purpose.
    #[cfg(feature = "test-hooks")]
    #[serde(default)]
    pub fault: Option<crate::faults::Fault>,
    /// Report the tracked live bytes on stderr this often (the TUI's live chart).
    #[serde(default)]
    pub sample_ms: Option<u64>,
}

/// Prefix of a live-memory sample line on a trial's stderr.
pub const SAMPLE_PREFIX: &str = "memfit-sample ";

/// What the child prints: its measurements, or its out-of-memory error.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrialOutput {
    pub oom: Option<String>,
    pub peak_bytes: PeakBytes,
    /// The split at the moment of the total peak (the fullest rank).
    pub peak_split: PeakBytes,
    /// VmHWM of this process: host memory, not the emulated device's.
    pub rss_peak_bytes: Option<u64>,
    /// VmRSS before the engine allocated anything.
    pub rss_baseline_bytes: Option<u64>,
    pub step_ms: Vec<f64>,
    /// How many of `step_ms` are warm-up.
    pub warmup_steps: usize,
    pub losses: Vec<f32>,
    pub tokens_per_s: Option<f64>,
    pub tokens_per_step: usize,
    /// The highest live bytes in each phase (forward:i, backward:i, optimizer).
    #[serde(default)]
    pub phase_peaks: Vec<crate::memory::PhasePeak>,
}

/// Runs the trial in this process and returns what to print, or the error
/// that makes it exit 2.
pub fn run_trial(spec: &TrialSpec) -> Result<TrialOutput> {
    #[cfg(feature = "test-hooks")]
    if let Some(f) = spec.fault {
        f.strike();
    }
    if let Some(ms) = spec.sample_ms.filter(|&ms| ms > 0) {
        let start = std::time::Instant::now();
        std::thread::spawn(move || {
            loop {
                eprintln!(
                    "{SAMPLE_PREFIX}{:.3} {}",
                    start.elapsed().as_secs_f64(),
                    crate::memory::process_live_bytes()
                );
                std::thread::sleep(std::time::Duration::from_millis(ms));
            }
        });
    }
    let device: DeviceSpec = spec
        .device
        .parse()
        .map_err(|m: String| Error::invalid_arg("--device", m))?;
    let opts = RunOptions {
        model: spec.model.clone(),
        train: spec.train.clone(),
        steps: spec.steps,
        device,
        target: None,
        data: None,
        threads: spec.threads,
        timeline: None,
        phase_peaks: true,
        timing: spec.timing,
    };
    let rss_baseline_bytes = crate::sys::proc::self_rss();
    let (report, failure) = run(&opts)?;
    Ok(TrialOutput {
        oom: failure.map(|e| e.to_string()),
        peak_bytes: report.peak_bytes,
        peak_split: PeakBytes::from(report.peak_breakdown),
        rss_peak_bytes: rss_high_water_mark(),
        rss_baseline_bytes,
        step_ms: report.steps.iter().map(|s| s.ms).collect(),
        warmup_steps: spec.timing.map_or(1, |t| t.warmup_steps),
        losses: report.steps.iter().map(|s| s.loss).collect(),
        tokens_per_s: report.tokens_per_s,
        tokens_per_step: report.tokens_per_step,
        phase_peaks: report.phase_peaks,
    })
}

/// The process's resident-set high-water mark (`VmHWM` in /proc/self/status).
pub fn rss_high_water_mark() -> Option<u64> {
    crate::sys::proc::self_rss_peak()
}
