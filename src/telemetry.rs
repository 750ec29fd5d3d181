//! Live GPU telemetry through NVML (nvml-wrapper): per GPU memory, utilisation,
//! power, SM clock and temperature, and per process GPU memory, sampled on a
//! thread of its own.
//!
//! NVML missing (no driver, no GPU) is a normal state, [`Telemetry::open`]
//! returns the reason and every caller says "no NVML: <reason>" and goes on.
//! `MEMFIT_NVML_LIB` names the library to load instead of the system's
//! `libnvidia-ml.so.1`; [`Telemetry::open_with`] takes it as an argument
//! instead. The tests load a scripted double of NVML
//! (`tests/nvml_double/nvml_double.c`, built by build.rs, its path in the
//! compile-time env `MEMFIT_NVML_DOUBLE`; the script format is at the top of
//! that file).

use std::ffi::{OsStr, OsString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use serde::Serialize;

/// Environment variable naming the NVML library to load.
pub const NVML_LIB_ENV: &str = "MEMFIT_NVML_LIB";

/// The library loaded when `MEMFIT_NVML_LIB` is not set.
pub const NVML_DEFAULT_LIB: &str = "libnvidia-ml.so.1";

/// How many `timeline` points (and samples per watched pid) a [`Sampler`]
/// keeps by default; older points are merged pairwise beyond that.
pub const TIMELINE_MAX_POINTS: usize = 10_000;

/// How many sampling errors a [`Sampler`] keeps (the newest).
pub const ERRORS_KEPT: usize = 20;

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
    /// the other figures are then the last good ones (zeros and "GPU <i>"
    /// when there were none).
    pub error: Option<String>,
}

/// All GPUs at one moment, `at_s` seconds after the [`Telemetry`] was opened.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Snapshot {
    pub at_s: f64,
    pub gpus: Vec<GpuSample>,
}

impl Snapshot {
    /// GPU memory of process `pid` summed over the GPUs in this snapshot,
    /// `None` when no GPU reports a figure for it.
    pub fn process_bytes(&self, pid: u32) -> Option<u64> {
        self.gpus
            .iter()
            .flat_map(|g| &g.processes)
            .filter(|p| p.pid == pid)
            .filter_map(|p| p.used_bytes)
            .reduce(|a, b| a + b)
    }
}

/// The NVML library, opened. `Send` and `Sync`: a [`Sampler`] thread owns it.
pub struct Telemetry {
    nvml: Nvml,
    opened: Instant,
    /// The last good sample of each GPU, by index, for rows of GPUs that
    /// stop answering.
    last_good: Mutex<Vec<Option<GpuSample>>>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry").finish_non_exhaustive()
    }
}

impl Telemetry {
    /// Loads NVML (or `$MEMFIT_NVML_LIB`) and initialises it; `Err` is the
    /// one-line reason there is nothing to sample (without a "no NVML:"
    /// prefix, which the caller adds).
    pub fn open() -> Result<Telemetry, String> {
        let lib = std::env::var_os(NVML_LIB_ENV).filter(|v| !v.is_empty());
        Telemetry::open_with(lib.as_deref())
    }

    /// [`Telemetry::open`] with the library named here rather than by the
    /// environment: `None` is the system's `libnvidia-ml.so.1`.
    pub fn open_with(lib: Option<&OsStr>) -> Result<Telemetry, String> {
        let mut builder = Nvml::builder();
        if let Some(path) = lib {
            builder.lib_path(path);
        }
        let nvml = builder.init().map_err(|e| open_error(lib, &e))?;
        Ok(Telemetry {
            nvml,
            opened: Instant::now(),
            last_good: Mutex::new(Vec::new()),
        })
    }

    /// The driver version, for headers.
    pub fn driver_version(&self) -> Option<String> {
        self.nvml.sys_driver_version().ok()
    }

    /// How many GPUs NVML sees.
    pub fn gpu_count(&self) -> Result<u32, String> {
        self.nvml
            .device_count()
            .map_err(|e| format!("NVML cannot count the GPUs: {}", describe(&e)))
    }

    /// Seconds since [`Telemetry::open`], the clock of every `at_s`.
    pub fn elapsed_s(&self) -> f64 {
        self.opened.elapsed().as_secs_f64()
    }

    /// One sample of every GPU (or only `only`), with their processes. A GPU
    /// that fails to answer keeps its row, with `error` set; only NVML
    /// failing as a whole (or `only` naming no GPU) is an `Err`.
    pub fn sample(&self, only: Option<u32>) -> Result<Snapshot, String> {
        let count = self.gpu_count()?;
        let indices: Vec<u32> = match only {
            Some(i) if i < count => vec![i],
            Some(i) => {
                return Err(format!(
                    "there is no GPU {i}: NVML sees {count} GPU{}",
                    if count == 1 { "" } else { "s" }
                ));
            }
            None => (0..count).collect(),
        };
        let at_s = self.elapsed_s();
        let gpus = indices.into_iter().map(|i| self.sample_gpu(i)).collect();
        Ok(Snapshot { at_s, gpus })
    }

    /// GPU memory of process `pid` summed over the GPUs it uses (or only
    /// GPU `only`), `None` when it holds none.
    pub fn process_bytes(&self, pid: u32, only: Option<u32>) -> Option<u64> {
        self.sample(only).ok()?.process_bytes(pid)
    }

    fn last_good(&self) -> MutexGuard<'_, Vec<Option<GpuSample>>> {
        self.last_good.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The row of a GPU that failed: its last good figures, or none.
    fn failed(&self, index: u32, err: &NvmlError) -> GpuSample {
        let last = self.last_good().get(index as usize).cloned().flatten();
        let mut row = last.unwrap_or_else(|| GpuSample {
            index,
            name: format!("GPU {index}"),
            memory_used_bytes: 0,
            memory_total_bytes: 0,
            utilization_pct: None,
            memory_utilization_pct: None,
            power_w: None,
            power_limit_w: None,
            sm_clock_mhz: None,
            temperature_c: None,
            processes: Vec::new(),
            error: None,
        });
        row.error = Some(describe(err));
        row
    }

    fn sample_gpu(&self, index: u32) -> GpuSample {
        let dev = match self.nvml.device_by_index(index) {
            Ok(d) => d,
            Err(e) => return self.failed(index, &e),
        };
        let mem = match dev.memory_info() {
            Ok(m) => m,
            Err(e) => return self.failed(index, &e),
        };
        // Optional figures: an error is `None`, unless it says the GPU is
        // gone, which fails the whole row.
        let mut lost: Option<NvmlError> = None;
        let name = optional(dev.name(), &mut lost);
        let util = optional(dev.utilization_rates(), &mut lost);
        let power_mw = optional(dev.power_usage(), &mut lost);
        let limit_mw = optional(dev.enforced_power_limit(), &mut lost);
        let sm_clock_mhz = optional(dev.clock_info(Clock::SM), &mut lost);
        let temperature_c = optional(dev.temperature(TemperatureSensor::Gpu), &mut lost);
        let procs = optional(dev.running_compute_processes(), &mut lost).unwrap_or_default();
        if let Some(e) = lost {
            return self.failed(index, &e);
        }
        let name = name.unwrap_or_else(|| {
            self.last_good()
                .get(index as usize)
                .and_then(|g| g.as_ref().map(|g| g.name.clone()))
                .unwrap_or_else(|| format!("GPU {index}"))
        });
        let row = GpuSample {
            index,
            name,
            memory_used_bytes: mem.used,
            memory_total_bytes: mem.total,
            utilization_pct: util.as_ref().map(|u| u.gpu),
            memory_utilization_pct: util.as_ref().map(|u| u.memory),
            power_w: power_mw.map(|mw| f64::from(mw) / 1000.0),
            power_limit_w: limit_mw.map(|mw| f64::from(mw) / 1000.0),
            sm_clock_mhz,
            temperature_c,
            processes: procs
                .into_iter()
                .map(|p| ProcSample {
                    pid: p.pid,
                    used_bytes: match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => Some(b),
                        UsedGpuMemory::Unavailable => None,
                    },
                    name: process_name(p.pid),
                })
                .collect(),
            error: None,
        };
        let mut last = self.last_good();
        if last.len() <= index as usize {
            last.resize(index as usize + 1, None);
        }
        last[index as usize] = Some(row.clone());
        row
    }
}

/// An optional figure: an error is `None`, unless it says the GPU is gone
/// (noted in `lost`, which fails the whole row).
fn optional<T>(r: Result<T, NvmlError>, lost: &mut Option<NvmlError>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(NvmlError::GpuLost) => {
            lost.get_or_insert(NvmlError::GpuLost);
            None
        }
        Err(_) => None,
    }
}

/// `/proc/PID/comm`, when it is readable.
fn process_name(pid: u32) -> Option<String> {
    crate::sys::proc::comm(pid).filter(|c| !c.is_empty())
}

/// The NVML name of an error, where it is one of NVML's return codes.
fn nvml_code(e: &NvmlError) -> Option<&'static str> {
    Some(match e {
        NvmlError::Uninitialized => "NVML_ERROR_UNINITIALIZED",
        NvmlError::InvalidArg => "NVML_ERROR_INVALID_ARGUMENT",
        NvmlError::NotSupported => "NVML_ERROR_NOT_SUPPORTED",
        NvmlError::NoPermission => "NVML_ERROR_NO_PERMISSION",
        NvmlError::NotFound => "NVML_ERROR_NOT_FOUND",
        NvmlError::InsufficientSize(_) => "NVML_ERROR_INSUFFICIENT_SIZE",
        NvmlError::InsufficientPower => "NVML_ERROR_INSUFFICIENT_POWER",
        NvmlError::DriverNotLoaded => "NVML_ERROR_DRIVER_NOT_LOADED",
        NvmlError::Timeout => "NVML_ERROR_TIMEOUT",
        NvmlError::IrqIssue => "NVML_ERROR_IRQ_ISSUE",
        NvmlError::LibraryNotFound => "NVML_ERROR_LIBRARY_NOT_FOUND",
        NvmlError::FunctionNotFound => "NVML_ERROR_FUNCTION_NOT_FOUND",
        NvmlError::CorruptedInfoROM => "NVML_ERROR_CORRUPTED_INFOROM",
        NvmlError::GpuLost => "NVML_ERROR_GPU_IS_LOST",
        NvmlError::ResetRequired => "NVML_ERROR_RESET_REQUIRED",
        NvmlError::OperatingSystem => "NVML_ERROR_OPERATING_SYSTEM",
        NvmlError::LibRmVersionMismatch => "NVML_ERROR_LIB_RM_VERSION_MISMATCH",
        NvmlError::InUse => "NVML_ERROR_IN_USE",
        NvmlError::InsufficientMemory => "NVML_ERROR_MEMORY",
        NvmlError::NoData => "NVML_ERROR_NO_DATA",
        NvmlError::Unknown => "NVML_ERROR_UNKNOWN",
        _ => return None,
    })
}

/// An NVML error on one line, with its NVML code name where it has one.
fn describe(e: &NvmlError) -> String {
    let text = one_line(&e.to_string());
    match nvml_code(e) {
        Some(code) => format!("{text} ({code})"),
        None => text,
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The one-line reason `open` failed.
fn open_error(lib: Option<&OsStr>, e: &NvmlError) -> String {
    let name: OsString = lib.map_or_else(|| NVML_DEFAULT_LIB.into(), OsStr::to_os_string);
    let name = name.to_string_lossy();
    match (e, lib) {
        (NvmlError::LibloadingError(_), None) => {
            format!("{name} could not be loaded (no NVIDIA driver)")
        }
        (NvmlError::LibloadingError(err), Some(_)) => {
            format!(
                "{name} (from ${NVML_LIB_ENV}) could not be loaded: {}",
                one_line(&err.to_string())
            )
        }
        (NvmlError::DriverNotLoaded, _) => {
            "the NVIDIA driver is not loaded (NVML_ERROR_DRIVER_NOT_LOADED)".into()
        }
        (NvmlError::NoPermission, _) => {
            "no permission to talk to the NVIDIA driver (NVML_ERROR_NO_PERMISSION)".into()
        }
        _ => format!("NVML ({name}) failed to initialise: {}", describe(e)),
    }
}

/// What a running [`Sampler`] has seen so far.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Seen {
    /// The newest snapshot.
    pub latest: Option<Snapshot>,
    /// Every snapshot's per-GPU memory used: `(at_s, [used bytes per GPU])`.
    /// Bounded: past the sampler's cap the older half is merged pairwise
    /// (the earlier time, the larger bytes per GPU), so peaks survive.
    pub timeline: Vec<(f64, Vec<u64>)>,
    /// For each watched pid: `(at_s, bytes)` samples and the peak.
    pub watched: Vec<WatchedProc>,
    /// Sampling errors, newest last (kept short).
    pub errors: Vec<String>,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct WatchedProc {
    pub pid: u32,
    /// Samples in which NVML reported memory for the pid; bounded like the
    /// timeline.
    pub samples: Vec<(f64, u64)>,
    /// The largest sample ever seen (exact, whatever was merged).
    pub peak_bytes: u64,
}

/// Keeps `v` at most `cap` long: when full, the older half is merged pairwise
/// with `merge`, so older history gets coarser and recent history stays fine.
fn thin<T>(v: &mut Vec<T>, cap: usize, merge: impl Fn(&T, &T) -> T) {
    let cap = cap.max(4);
    if v.len() < cap {
        return;
    }
    let old = v.len() / 2;
    let mut merged: Vec<T> = v[..old]
        .chunks(2)
        .map(|c| {
            if c.len() == 2 {
                merge(&c[0], &c[1])
            } else {
                merge(&c[0], &c[0])
            }
        })
        .collect();
    merged.extend(v.drain(old..));
    *v = merged;
}

fn merge_timeline(a: &(f64, Vec<u64>), b: &(f64, Vec<u64>)) -> (f64, Vec<u64>) {
    let n = a.1.len().max(b.1.len());
    let at = |v: &Vec<u64>, i: usize| v.get(i).copied().unwrap_or(0);
    (a.0, (0..n).map(|i| at(&a.1, i).max(at(&b.1, i))).collect())
}

fn merge_samples(a: &(f64, u64), b: &(f64, u64)) -> (f64, u64) {
    (a.0, a.1.max(b.1))
}

fn push_error(errors: &mut Vec<String>, e: String) {
    errors.push(e);
    if errors.len() > ERRORS_KEPT {
        let extra = errors.len() - ERRORS_KEPT;
        errors.drain(..extra);
    }
}

/// Samples on its own thread every `interval` until dropped or stopped.
pub struct Sampler {
    seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
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
        Sampler::start_capped(t, interval, only, watch, TIMELINE_MAX_POINTS)
    }

    /// [`Sampler::start`] keeping at most `max_points` timeline points and
    /// samples per watched pid (at least 4).
    pub fn start_capped(
        t: Telemetry,
        interval: Duration,
        only: Option<u32>,
        watch: Arc<Mutex<Vec<u32>>>,
        max_points: usize,
    ) -> Sampler {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let interval = interval.max(Duration::from_millis(1));
        let thread = {
            let seen = seen.clone();
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("memfit-telemetry".into())
                .spawn(move || run(t, interval, only, watch, max_points, &seen, &stop))
        };
        let thread = match thread {
            Ok(h) => Some(h),
            Err(e) => {
                let mut s = seen.lock().unwrap_or_else(|e| e.into_inner());
                push_error(
                    &mut s.errors,
                    format!("the sampling thread did not start: {e}"),
                );
                None
            }
        };
        Sampler { seen, stop, thread }
    }

    /// A copy of what has been seen so far.
    pub fn seen(&self) -> Seen {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Stops the thread and returns everything seen.
    pub fn stop(mut self) -> Seen {
        self.halt();
        self.seen()
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.halt();
    }
}

/// The sampling thread: a sample, then a nap of what is left of `interval`
/// (parked, so `stop` wakes it at once), until told to stop.
fn run(
    t: Telemetry,
    interval: Duration,
    only: Option<u32>,
    watch: Arc<Mutex<Vec<u32>>>,
    max_points: usize,
    seen: &Mutex<Seen>,
    stop: &AtomicBool,
) {
    // The error each GPU reported last tick, to log changes, not repeats.
    let mut gpu_errors: Vec<Option<String>> = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        let began = Instant::now();
        let sample = t.sample(only);
        let pids: Vec<u32> = watch
            .lock()
            .map(|w| w.clone())
            .unwrap_or_else(|e| e.into_inner().clone());
        {
            let mut s = seen.lock().unwrap_or_else(|e| e.into_inner());
            match sample {
                Ok(snap) => record(&mut s, snap, &pids, max_points, &mut gpu_errors),
                Err(e) => {
                    if s.errors.last() != Some(&e) {
                        push_error(&mut s.errors, e);
                    }
                }
            }
        }
        let until = began + interval;
        while !stop.load(Ordering::SeqCst) {
            let now = Instant::now();
            if now >= until {
                break;
            }
            std::thread::park_timeout(until - now);
        }
    }
}

fn record(
    s: &mut Seen,
    snap: Snapshot,
    pids: &[u32],
    max_points: usize,
    gpu_errors: &mut Vec<Option<String>>,
) {
    for g in &snap.gpus {
        let i = g.index as usize;
        if gpu_errors.len() <= i {
            gpu_errors.resize(i + 1, None);
        }
        if gpu_errors[i] != g.error {
            if let Some(e) = &g.error {
                push_error(&mut s.errors, format!("GPU {}: {e}", g.index));
            }
            gpu_errors[i] = g.error.clone();
        }
    }
    s.timeline.push((
        snap.at_s,
        snap.gpus.iter().map(|g| g.memory_used_bytes).collect(),
    ));
    thin(&mut s.timeline, max_points, merge_timeline);
    for &pid in pids {
        let at = match s.watched.iter().position(|w| w.pid == pid) {
            Some(at) => at,
            None => {
                s.watched.push(WatchedProc {
                    pid,
                    ..WatchedProc::default()
                });
                s.watched.len() - 1
            }
        };
        if let Some(bytes) = snap.process_bytes(pid) {
            let w = &mut s.watched[at];
            w.samples.push((snap.at_s, bytes));
            w.peak_bytes = w.peak_bytes.max(bytes);
            thin(&mut w.samples, max_points, merge_samples);
        }
    }
    s.latest = Some(snap);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proc(pid: u32, bytes: Option<u64>) -> ProcSample {
        ProcSample {
            pid,
            used_bytes: bytes,
            name: None,
        }
    }

    fn gpu(index: u32, used: u64, processes: Vec<ProcSample>) -> GpuSample {
        GpuSample {
            index,
            name: format!("GPU {index}"),
            memory_used_bytes: used,
            memory_total_bytes: 100,
            utilization_pct: None,
            memory_utilization_pct: None,
            power_w: None,
            power_limit_w: None,
            sm_clock_mhz: None,
            temperature_c: None,
            processes,
            error: None,
        }
    }

    #[test]
    fn thinning_bounds_and_keeps_peaks() {
        let mut v: Vec<(f64, u64)> = Vec::new();
        for i in 0..10_000u64 {
            v.push((i as f64, if i == 17 { 1_000_000 } else { i % 7 }));
            thin(&mut v, 64, merge_samples);
            assert!(v.len() < 64);
        }
        assert!(
            v.iter().any(|s| s.1 == 1_000_000),
            "the peak survives merging"
        );
        assert!(v.windows(2).all(|w| w[0].0 < w[1].0), "times stay in order");
        assert_eq!(
            v.last().unwrap().0,
            9_999.0,
            "the newest point is kept as is"
        );
        assert_eq!(v[0].0, 0.0, "the oldest time is kept");
    }

    #[test]
    fn merged_timeline_points_take_the_larger_bytes() {
        let m = merge_timeline(&(1.0, vec![5, 1]), &(2.0, vec![3, 9, 4]));
        assert_eq!(m, (1.0, vec![5, 9, 4]));
    }

    #[test]
    fn errors_are_kept_short() {
        let mut e = Vec::new();
        for i in 0..100 {
            push_error(&mut e, format!("e{i}"));
        }
        assert_eq!(e.len(), ERRORS_KEPT);
        assert_eq!(e.last().unwrap(), "e99");
    }

    #[test]
    fn process_bytes_sum_over_gpus() {
        let snap = Snapshot {
            at_s: 0.0,
            gpus: vec![
                gpu(0, 10, vec![proc(7, Some(3)), proc(8, Some(1))]),
                gpu(1, 10, vec![proc(7, Some(4)), proc(9, None)]),
            ],
        };
        assert_eq!(snap.process_bytes(7), Some(7));
        assert_eq!(snap.process_bytes(8), Some(1));
        assert_eq!(
            snap.process_bytes(9),
            None,
            "unavailable figures are no figure"
        );
        assert_eq!(snap.process_bytes(10), None);
    }

    #[test]
    fn record_tracks_watched_peaks_and_logs_gpu_errors_once() {
        let mut s = Seen::default();
        let mut errs = Vec::new();
        for (i, bytes) in [1u64, 3, 2].into_iter().enumerate() {
            let mut g1 = gpu(1, bytes, vec![]);
            g1.error = Some("gone".into());
            let snap = Snapshot {
                at_s: i as f64,
                gpus: vec![gpu(0, bytes, vec![proc(42, Some(bytes))]), g1],
            };
            record(&mut s, snap, &[42, 43], 100, &mut errs);
        }
        assert_eq!(s.timeline.len(), 3);
        assert_eq!(s.watched.len(), 2);
        assert_eq!(s.watched[0].peak_bytes, 3);
        assert_eq!(s.watched[0].samples, vec![(0.0, 1), (1.0, 3), (2.0, 2)]);
        assert!(s.watched[1].samples.is_empty());
        assert_eq!(s.errors, vec!["GPU 1: gone".to_string()]);
    }

    #[test]
    fn open_errors_are_one_line() {
        let e = open_error(None, &NvmlError::DriverNotLoaded);
        assert!(e.contains("NVML_ERROR_DRIVER_NOT_LOADED"), "{e}");
        assert!(!e.contains('\n'));
        let e = describe(&NvmlError::GpuLost);
        assert!(e.ends_with("(NVML_ERROR_GPU_IS_LOST)"), "{e}");
    }

    #[test]
    fn missing_library_is_an_error_not_a_panic() {
        let e =
            Telemetry::open_with(Some(OsStr::new("/nonexistent/libnvidia-ml.so.1"))).unwrap_err();
        assert!(e.contains("could not be loaded"), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }
}
