//! Live GPU telemetry through NVML (nvml-wrapper): per GPU memory, utilisation,
//! power, SM clock and temperature, and per process GPU memory, sampled on a
//! thread of its own.
//!
//! NVML missing (no driver, no GPU) is a normal state, [`Telemetry::open`]
//! returns the reason and every caller says "no NVML: <reason>" and goes on.
//! `MEMFIT_NVML_LIB` names the library to load instead of the system's
//! `libnvidia-ml.so.1` (the tests load a scripted double of it).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;

/// Environment variable naming the NVML library to load.
pub const NVML_LIB_ENV: &str = "MEMFIT_NVML_LIB";

/// One process on one GPU.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ProcSample {
    pub pid: u32,
    /// `None` when NVML cannot say (e.g. under WDDM).
    pub used_bytes: Option<u64>,
    /// The process name from /proc, when it is readable.
    pub name: Option<String>,
}

/// One GPU at one moment. Figures NVML does not report are `None`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GpuSample {
    pub index: u32,
    pub name: String,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    pub utilization_pct: Option<u32>,
    pub memory_utilization_pct: Option<u32>,
    pub power_w: Option<f64>,
    pub power_limit_w: Option<f64>,
    pub sm_clock_mhz: Option<u32>,
    pub temperature_c: Option<u32>,
    pub processes: Vec<ProcSample>,
    /// Set when this GPU failed to answer (e.g. `NVML_ERROR_GPU_IS_LOST`);
    /// the other figures are then the last good ones.
    pub error: Option<String>,
}

/// All GPUs at one moment, `at_s` seconds after the sampler started.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Snapshot {
    pub at_s: f64,
    pub gpus: Vec<GpuSample>,
}

/// The NVML library, opened.
pub struct Telemetry {
    _private: (),
}

impl Telemetry {
    /// Loads NVML (or `$MEMFIT_NVML_LIB`) and initialises it; `Err` is the
    /// one-line reason there is nothing to sample.
    pub fn open() -> Result<Telemetry, String> {
        Err("NVML is not part of this build yet".into())
    }

    /// The driver version, for headers.
    pub fn driver_version(&self) -> Option<String> {
        None
    }

    /// One sample of every GPU (or only `only`), with their processes.
    pub fn sample(&self, only: Option<u32>) -> Result<Snapshot, String> {
        let _ = only;
        Err("NVML is not part of this build yet".into())
    }

    /// GPU memory of process `pid` summed over the GPUs it uses (or only
    /// GPU `only`), `None` when it holds none.
    pub fn process_bytes(&self, pid: u32, only: Option<u32>) -> Option<u64> {
        let _ = (pid, only);
        None
    }
}

/// What a running [`Sampler`] has seen so far.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Seen {
    /// The newest snapshot.
    pub latest: Option<Snapshot>,
    /// Every snapshot's per-GPU memory used: `(at_s, [used bytes per GPU])`.
    pub timeline: Vec<(f64, Vec<u64>)>,
    /// For each watched pid: `(at_s, bytes)` samples and the peak.
    pub watched: Vec<WatchedProc>,
    /// Sampling errors, newest last (kept short).
    pub errors: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct WatchedProc {
    pub pid: u32,
    pub samples: Vec<(f64, u64)>,
    pub peak_bytes: u64,
}

/// Samples on its own thread every `interval` until dropped or stopped.
pub struct Sampler {
    seen: Arc<Mutex<Seen>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    /// Starts sampling `t` every `interval` (GPU `only`, or all), tracking
    /// the GPU memory of the pids in `watch` (which the caller may extend
    /// while it runs, e.g. with a child's pid once spawned).
    pub fn start(
        t: Telemetry,
        interval: Duration,
        only: Option<u32>,
        watch: Arc<Mutex<Vec<u32>>>,
    ) -> Sampler {
        let _ = (t, interval, only, watch);
        Sampler {
            seen: Arc::new(Mutex::new(Seen::default())),
            stop: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            thread: None,
        }
    }

    /// A copy of what has been seen so far.
    pub fn seen(&self) -> Seen {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Stops the thread and returns everything seen.
    pub fn stop(mut self) -> Seen {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.seen()
    }
}
