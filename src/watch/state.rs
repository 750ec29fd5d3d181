//! What `memfit watch` knows at any moment: a pure state that samples are
//! folded into ([`WatchState::on_tick`]), which both the headless printer
//! and the TUI's drawing read. No I/O here, so it is tested with made-up
//! samples.

use std::collections::VecDeque;
use std::path::PathBuf;

use serde::Serialize;

use crate::telemetry::{GpuSample, Snapshot};

/// One round of sampling: the GPUs, and the job as /proc sees it.
#[derive(Clone, Debug, Default)]
pub struct Tick {
    /// Seconds since the watch started.
    pub at_s: f64,
    /// `None` without NVML; `Some(Err)` when one sample failed.
    pub gpus: Option<Result<Snapshot, String>>,
    /// The job's live pids: the process and its descendants.
    pub job: Vec<u32>,
    /// Their resident host memory, summed.
    pub host_rss: Option<u64>,
}

/// What is being watched.
#[derive(Clone, Debug, PartialEq)]
pub enum Target {
    /// GPUs only, no job.
    Gpus,
    /// A command memfit started.
    Command { argv: Vec<String>, pid: u32 },
    /// A process that was already running.
    Pid { pid: u32, name: Option<String> },
}

impl Target {
    pub fn pid(&self) -> Option<u32> {
        match self {
            Target::Gpus => None,
            Target::Command { pid, .. } | Target::Pid { pid, .. } => Some(*pid),
        }
    }

    /// The command line, or the process name, in a few words.
    pub fn label(&self) -> String {
        match self {
            Target::Gpus => "GPUs".into(),
            Target::Command { argv, .. } => shell_words(argv),
            Target::Pid { pid, name } => match name {
                Some(n) => format!("{n} (pid {pid})"),
                None => format!("pid {pid}"),
            },
        }
    }
}

/// `argv` as one would type it: words with spaces or quotes in single quotes.
pub fn shell_words(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Where the job is.
#[derive(Clone, Debug, PartialEq)]
pub enum Phase {
    Running,
    /// Asked to stop at `since_s`; `killed` once SIGKILL went out.
    Stopping {
        since_s: f64,
        killed: bool,
    },
    /// Ended at `at_s`; the exit code when memfit started it.
    Ended {
        code: Option<i32>,
        at_s: f64,
    },
}

/// memfit's prediction for the job's configuration.
#[derive(Clone, Debug, Serialize)]
pub struct Prediction {
    pub model: String,
    /// The knobs, in a few words.
    pub knobs: String,
    pub ranks: usize,
    /// The engine's tracked peak on one rank (the largest), as the cuda
    /// backend would hold it: tensors only, no CUDA context.
    pub tracked_peak_bytes: u64,
    /// Whose allocations `tracked_peak_bytes` is: `hf-eager` (watch's
    /// default, a PyTorch job) or `memfit` (memfit's own engine).
    pub framework: crate::engine::Framework,
    /// The same in words: `hf-eager (PyTorch eager + transformers)` or
    /// `memfit engine`.
    pub allocation_profile: String,
}

impl Prediction {
    /// The allocation profile, and how it relates to the other commands'
    /// defaults: the same configuration is 12.46 GiB from `memfit run
    /// --device meta` and 18.42 GiB here (gpt2, T=1024, micro-batch 8)
    /// because run holds the engine's allocations and watch PyTorch's.
    pub fn profile_note(&self) -> String {
        match self.framework {
            crate::engine::Framework::HfEager => format!(
                "{}, watch's default; `memfit run` holds memfit's engine unless given --framework hf-eager",
                self.allocation_profile
            ),
            crate::engine::Framework::Memfit => format!(
                "{}; without --framework memfit watch predicts hf-eager (PyTorch eager + transformers)",
                self.allocation_profile
            ),
        }
    }
}

/// A GPU crossing `--warn-at`.
#[derive(Clone, Debug, Serialize)]
pub struct Warning {
    pub at_s: f64,
    pub gpu: u32,
    pub used_bytes: u64,
    pub total_bytes: u64,
    /// The job's memory on that GPU, when a job is watched.
    pub job_bytes: Option<u64>,
    pub message: String,
}

/// One GPU over the whole watch.
#[derive(Clone, Debug, Serialize)]
pub struct GpuPeak {
    pub index: u32,
    pub name: String,
    pub total_bytes: u64,
    pub peak_used_bytes: u64,
    /// The job's highest memory on this GPU (NVML, per process, summed over
    /// the job's processes).
    pub job_peak_bytes: u64,
    pub job_peak_at_s: Option<f64>,
}

/// One point of the memory chart.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Point {
    pub t_s: f64,
    /// The job's memory on its fullest GPU.
    pub job: Option<u64>,
    /// Used memory of the fullest GPU that matters (the job's, or any).
    pub used: Option<u64>,
    pub host_rss: Option<u64>,
}

/// The chart keeps at most this many points, merging pairs (keeping their
/// highs) past it.
pub const MAX_POINTS: usize = 4000;

/// Lines of the command's output kept for the TUI's panel.
pub const LOG_LINES: usize = 200;

#[derive(Clone, Debug)]
pub struct WatchState {
    pub target: Target,
    /// `Ok(driver version)`, or why there is no NVML.
    pub nvml: Result<Option<String>, String>,
    pub only_gpu: Option<u32>,
    pub sample_ms: u64,
    /// `--warn-at` as a fraction.
    pub warn_at: f64,
    pub elapsed_s: f64,
    pub phase: Phase,
    pub latest: Option<Snapshot>,
    /// The newest sampling error, if the newest sample failed.
    pub sample_error: Option<String>,
    pub samples: usize,
    pub job_pids: Vec<u32>,
    pub gpus: Vec<GpuPeak>,
    /// The job's highest memory on one GPU: `(bytes, gpu, at_s)`.
    pub job_peak: Option<(u64, u32, f64)>,
    /// The job's highest memory over all its GPUs together.
    pub job_total_peak: u64,
    pub host_rss_peak: Option<u64>,
    pub series: Vec<Point>,
    pub warnings: Vec<Warning>,
    /// GPUs now above `--warn-at` (a warning is given once per crossing).
    above: Vec<u32>,
    pub prediction: Option<Prediction>,
    /// The command's output, newest last (TUI).
    pub log: VecDeque<String>,
    pub log_path: Option<PathBuf>,
    /// A transient line for the status bar.
    pub message: Option<String>,
    pub no_color: bool,
}

impl WatchState {
    pub fn new(
        target: Target,
        nvml: Result<Option<String>, String>,
        sample_ms: u64,
        warn_at: f64,
    ) -> WatchState {
        WatchState {
            target,
            nvml,
            only_gpu: None,
            sample_ms,
            warn_at,
            elapsed_s: 0.0,
            phase: Phase::Running,
            latest: None,
            sample_error: None,
            samples: 0,
            job_pids: Vec::new(),
            gpus: Vec::new(),
            job_peak: None,
            job_total_peak: 0,
            host_rss_peak: None,
            series: Vec::new(),
            warnings: Vec::new(),
            above: Vec::new(),
            prediction: None,
            log: VecDeque::new(),
            log_path: None,
            message: None,
            no_color: false,
        }
    }

    pub fn has_job(&self) -> bool {
        self.target != Target::Gpus
    }

    /// The job's memory on `g` (its processes' NVML figures summed).
    pub fn job_bytes_on(&self, g: &GpuSample) -> u64 {
        g.processes
            .iter()
            .filter(|p| self.job_pids.contains(&p.pid))
            .filter_map(|p| p.used_bytes)
            .sum()
    }

    /// The GPUs that matter now: those the job holds memory on, else (no
    /// job, or a job that holds none yet) every GPU sampled.
    pub fn relevant<'a>(&self, s: &'a Snapshot) -> Vec<&'a GpuSample> {
        if self.has_job() {
            let on: Vec<&GpuSample> = s.gpus.iter().filter(|g| self.job_bytes_on(g) > 0).collect();
            if !on.is_empty() {
                return on;
            }
        }
        s.gpus.iter().collect()
    }

    /// The capacity the chart and the summary measure against: the smallest
    /// total of the GPUs that matter.
    pub fn capacity(&self) -> Option<u64> {
        let s = self.latest.as_ref()?;
        self.relevant(s)
            .iter()
            .map(|g| g.memory_total_bytes)
            .filter(|&t| t > 0)
            .min()
    }

    /// Folds one sample in; returns the indices of warnings it raised.
    pub fn on_tick(&mut self, t: Tick) -> Vec<usize> {
        self.elapsed_s = self.elapsed_s.max(t.at_s);
        self.job_pids = t.job;
        if let Some(r) = t.host_rss {
            self.host_rss_peak = Some(self.host_rss_peak.map_or(r, |p| p.max(r)));
        }
        let mut raised = Vec::new();
        let mut point = Point {
            t_s: t.at_s,
            job: None,
            used: None,
            host_rss: t.host_rss,
        };
        match t.gpus {
            None => {}
            Some(Err(e)) => self.sample_error = Some(e),
            Some(Ok(snap)) => {
                self.sample_error = None;
                self.samples += 1;
                let mut total = 0u64;
                for g in &snap.gpus {
                    let job = self.job_bytes_on(g);
                    total += job;
                    let peak = match self.gpus.iter_mut().find(|p| p.index == g.index) {
                        Some(p) => p,
                        None => {
                            self.gpus.push(GpuPeak {
                                index: g.index,
                                name: g.name.clone(),
                                total_bytes: g.memory_total_bytes,
                                peak_used_bytes: 0,
                                job_peak_bytes: 0,
                                job_peak_at_s: None,
                            });
                            self.gpus.sort_by_key(|p| p.index);
                            self.gpus
                                .iter_mut()
                                .find(|p| p.index == g.index)
                                .expect("just pushed")
                        }
                    };
                    peak.total_bytes = g.memory_total_bytes;
                    peak.peak_used_bytes = peak.peak_used_bytes.max(g.memory_used_bytes);
                    if job > peak.job_peak_bytes {
                        peak.job_peak_bytes = job;
                        peak.job_peak_at_s = Some(t.at_s);
                    }
                    if job > self.job_peak.map_or(0, |p| p.0) {
                        self.job_peak = Some((job, g.index, t.at_s));
                    }
                }
                self.job_total_peak = self.job_total_peak.max(total);
                let relevant = self.relevant(&snap);
                // With a job, the chart follows its GPUs once it has any.
                if !self.has_job() || total > 0 {
                    point.used = relevant.iter().map(|g| g.memory_used_bytes).max();
                }
                if self.has_job() {
                    point.job = relevant.iter().map(|g| self.job_bytes_on(g)).max();
                }
                // Warnings: once per crossing of --warn-at, re-armed one
                // percent below it so noise at the line does not repeat it.
                let mut warn = Vec::new();
                for g in &relevant {
                    if g.memory_total_bytes == 0 {
                        continue;
                    }
                    // The GPU's used memory, or the job's where NVML says
                    // more for it (the two are read at different moments).
                    let held = g.memory_used_bytes.max(self.job_bytes_on(g));
                    let share = held as f64 / g.memory_total_bytes as f64;
                    let was = self.above.contains(&g.index);
                    if share >= self.warn_at && !was {
                        self.above.push(g.index);
                        let job = self.has_job().then(|| self.job_bytes_on(g));
                        warn.push(Warning {
                            at_s: t.at_s,
                            gpu: g.index,
                            used_bytes: held,
                            total_bytes: g.memory_total_bytes,
                            job_bytes: job,
                            message: warning_text(
                                g.index,
                                held,
                                g.memory_total_bytes,
                                job,
                                self.warn_at,
                            ),
                        });
                    } else if was && share < self.warn_at - 0.01 {
                        self.above.retain(|&i| i != g.index);
                    }
                }
                for w in warn {
                    raised.push(self.warnings.len());
                    self.warnings.push(w);
                }
                self.latest = Some(snap);
            }
        }
        if point.job.is_some() || point.used.is_some() || point.host_rss.is_some() {
            self.push_point(point);
        }
        raised
    }

    fn push_point(&mut self, p: Point) {
        self.series.push(p);
        if self.series.len() > MAX_POINTS {
            let max = |a: Option<u64>, b: Option<u64>| match (a, b) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
            self.series = self
                .series
                .chunks(2)
                .map(|c| match c {
                    [a, b] => Point {
                        t_s: a.t_s,
                        job: max(a.job, b.job),
                        used: max(a.used, b.used),
                        host_rss: max(a.host_rss, b.host_rss),
                    },
                    [a] => *a,
                    _ => unreachable!("chunks of two"),
                })
                .collect();
        }
    }

    /// A GPU that matters above `--warn-at` now, in the words of a
    /// warning, with its figures of the newest sample.
    pub fn warning_now(&self) -> Option<String> {
        let gpu = *self.above.last()?;
        let g = self.latest.as_ref()?.gpus.iter().find(|g| g.index == gpu)?;
        let job = self.has_job().then(|| self.job_bytes_on(g));
        let held = g.memory_used_bytes.max(job.unwrap_or(0));
        Some(warning_text(
            gpu,
            held,
            g.memory_total_bytes,
            job,
            self.warn_at,
        ))
    }

    /// The command's output, one line at a time (TUI).
    pub fn push_log(&mut self, line: String) {
        self.log.push_back(line);
        while self.log.len() > LOG_LINES {
            self.log.pop_front();
        }
    }
}

fn warning_text(gpu: u32, used: u64, total: u64, job: Option<u64>, warn_at: f64) -> String {
    use crate::units::fmt_bytes;
    let mut s = format!(
        "GPU {gpu} memory at {:.1}% ({} of {})",
        used as f64 / total as f64 * 100.0,
        fmt_bytes(used),
        fmt_bytes(total)
    );
    if let Some(j) = job {
        s.pop();
        s += &format!("; job {})", fmt_bytes(j));
    }
    s += &format!(": above --warn-at {}%", fmt_pct(warn_at * 100.0));
    s
}

/// A percentage without a needless fraction: `90`, `92.5`.
pub fn fmt_pct(p: f64) -> String {
    if (p - p.round()).abs() < 1e-9 {
        format!("{p:.0}")
    } else {
        format!("{p:.1}")
    }
}

/// Decimal units, as GPU vendors and PyTorch's `memory_allocated()/1e9`
/// readers quote them: `3.00 GB`.
pub fn fmt_si(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["kB", "MB", "GB", "TB", "PB"];
    if bytes < 1000 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1000.0;
    let mut u = 0;
    while v >= 1000.0 && u + 1 < UNITS.len() {
        v /= 1000.0;
        u += 1;
    }
    format!("{v:.2} {}", UNITS[u])
}

#[cfg(test)]
pub mod testdata {
    use super::*;
    use crate::telemetry::ProcSample;

    pub const GIB: u64 = 1 << 30;

    pub fn gpu(index: u32, used: u64, total: u64, procs: &[(u32, u64)]) -> GpuSample {
        GpuSample {
            index,
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_used_bytes: used,
            memory_total_bytes: total,
            utilization_pct: Some(97),
            memory_utilization_pct: Some(40),
            power_w: Some(312.5),
            power_limit_w: Some(700.0),
            sm_clock_mhz: Some(1980),
            temperature_c: Some(64),
            processes: procs
                .iter()
                .map(|&(pid, b)| ProcSample {
                    pid,
                    used_bytes: Some(b),
                    name: Some("python".into()),
                })
                .collect(),
            error: None,
        }
    }

    pub fn tick(at_s: f64, job: &[u32], gpus: Vec<GpuSample>) -> Tick {
        Tick {
            at_s,
            gpus: Some(Ok(Snapshot { at_s, gpus })),
            job: job.to_vec(),
            host_rss: Some(512 << 20),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testdata::*;
    use super::*;

    fn job_state() -> WatchState {
        WatchState::new(
            Target::Command {
                argv: vec!["python".into(), "train.py".into()],
                pid: 100,
            },
            Ok(Some("550.54".into())),
            100,
            0.9,
        )
    }

    #[test]
    fn peaks_per_gpu_and_over_the_job() {
        let mut s = job_state();
        let total = 80 * GIB;
        s.on_tick(tick(
            0.1,
            &[100, 101],
            vec![
                gpu(0, 20 * GIB, total, &[(100, 10 * GIB), (7, 9 * GIB)]),
                gpu(1, 12 * GIB, total, &[(101, 12 * GIB)]),
            ],
        ));
        s.on_tick(tick(
            0.2,
            &[100, 101],
            vec![
                gpu(0, 11 * GIB, total, &[(100, 2 * GIB), (7, 9 * GIB)]),
                gpu(1, 12 * GIB, total, &[(101, 11 * GIB)]),
            ],
        ));
        assert_eq!(s.job_peak, Some((12 * GIB, 1, 0.1)));
        assert_eq!(s.job_total_peak, 22 * GIB);
        assert_eq!(s.gpus[0].job_peak_bytes, 10 * GIB);
        assert_eq!(s.gpus[0].peak_used_bytes, 20 * GIB);
        assert_eq!(s.series.len(), 2);
        assert_eq!(s.series[1].job, Some(11 * GIB));
        assert_eq!(s.host_rss_peak, Some(512 << 20));
        assert!(s.warnings.is_empty());
    }

    #[test]
    fn a_warning_once_per_crossing() {
        let mut s = job_state();
        let total = 10 * GIB;
        let at = |s: &mut WatchState, t: f64, used: u64| {
            s.on_tick(tick(t, &[100], vec![gpu(0, used, total, &[(100, used)])]))
        };
        assert!(at(&mut s, 0.1, 5 * GIB).is_empty());
        assert_eq!(at(&mut s, 0.2, 95 * GIB / 10), vec![0]);
        assert!(at(&mut s, 0.3, 96 * GIB / 10).is_empty());
        assert!(s.warning_now().is_some());
        // Just below the line is noise, not a new crossing.
        assert!(at(&mut s, 0.4, 895 * GIB / 100).is_empty());
        assert!(at(&mut s, 0.5, 95 * GIB / 10).is_empty());
        assert!(at(&mut s, 0.6, 5 * GIB).is_empty());
        assert!(s.warning_now().is_none());
        assert_eq!(at(&mut s, 0.7, 92 * GIB / 10), vec![1]);
        assert!(
            s.warnings[0].message.contains(
                "GPU 0 memory at 95.0% (9.50 GiB of 10.00 GiB; job 9.50 GiB): above --warn-at 90%"
            ),
            "{}",
            s.warnings[0].message
        );
    }

    #[test]
    fn other_users_gpus_do_not_warn_once_the_job_is_placed() {
        let mut s = job_state();
        let total = 10 * GIB;
        s.on_tick(tick(
            0.1,
            &[100],
            vec![
                gpu(0, GIB, total, &[(100, GIB)]),
                gpu(1, 99 * GIB / 10, total, &[(7, 99 * GIB / 10)]),
            ],
        ));
        assert!(s.warnings.is_empty());
        assert_eq!(s.capacity(), Some(total));
    }

    #[test]
    fn the_chart_merges_pairs_keeping_highs() {
        let mut s = job_state();
        for i in 0..=MAX_POINTS {
            let b = if i == 3 { 5 * GIB } else { GIB };
            s.on_tick(tick(
                i as f64,
                &[100],
                vec![gpu(0, b, 80 * GIB, &[(100, b)])],
            ));
        }
        assert!(s.series.len() <= MAX_POINTS / 2 + 1);
        assert_eq!(s.series[1].job, Some(5 * GIB));
    }

    #[test]
    fn words_and_units() {
        assert_eq!(
            shell_words(&["sh".into(), "-c".into(), "echo 'hi'".into()]),
            r"sh -c 'echo '\''hi'\'''"
        );
        assert_eq!(fmt_si(3_000_000_000), "3.00 GB");
        assert_eq!(fmt_pct(90.0), "90");
        assert_eq!(fmt_pct(92.5), "92.5");
    }
}
