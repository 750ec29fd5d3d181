//! `memfit run`: train a model for a few steps (or plan one step on meta) and
//! report losses, throughput, FLOPs and peak memory per category.

mod checks;
pub mod options;
mod process;
pub mod recipe;

use checks::host_share;
pub use checks::validate;
use process::{NvmlWatch, capped_by_host, predicted_peak};
pub use process::{ProcessRun, run_process_rank};

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::driver::Driver as _;
use crate::backend::meta::MetaBackend;
use crate::backend::{Backend, DeviceKind, DeviceSpec};
use crate::config::ModelConfig;
use crate::config::profile::load_model;
use crate::data::DataSource;
use crate::engine::cluster::{Cluster, Links, cpu_links, links, meta_links};
use crate::engine::{
    Comm, CostCounter, Engine, Finetune, Framework, Optimizer, Sharding, TrainConfig,
};
use crate::error::{Error, Result};
use crate::memory::{ByCategory, Category, OomError, PeakBytes, Tracker};
use crate::report::run::{
    ErrorRecord, GpuRecord, HostRecord, PagedRecord, RankRecord, RunConfigRecord, RunReport,
    StepRecord, TargetRecord, summarise_ranks,
};
use crate::sys::mem_available;

/// Everything `memfit run` needs; the CLI fills it from flags.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub model: String,
    pub train: TrainConfig,
    pub steps: usize,
    pub device: DeviceSpec,
    /// `--device meta:GPU`: the GPU profile a meta run predicts. meta then
    /// emulates the cuda backend, and `device.limit` is the profile's
    /// memory less its runtime overhead.
    pub target: Option<crate::config::hardware::HardwareProfile>,
    pub data: Option<PathBuf>,
    /// cpu worker threads; `None` uses every core.
    pub threads: Option<usize>,
    /// Write the memory timeline (CSV) here.
    pub timeline: Option<PathBuf>,
    /// Record the timeline to report each phase's peak (`phase_peaks`).
    pub phase_peaks: bool,
    /// Repeat timed steps until this rule says stop (then `steps` is
    /// ignored); `None` runs exactly `steps`.
    pub timing: Option<crate::stats::Timing>,
}

/// Ranks one run may simulate (threads on cpu, or processes): each is a
/// real engine with its own memory. A plan steps one rank per distinct
/// place and prices the rest, so it goes further ([`crate::plan::MAX_GPUS`]).
pub const MAX_RANKS: usize = 256;

/// Runs `memfit run`. An out-of-memory run still returns its report (with
/// `error` set) alongside the error, so the caller can print both.
pub fn run(opts: &RunOptions) -> Result<(RunReport, Option<Error>)> {
    let model = load_model(&opts.model)?;
    validate(opts, &model)?;
    let mut shared = opts.clone();
    host_share(&mut shared.train);
    let opts = &shared;
    let n = opts.train.ranks;
    match opts.device.kind {
        // `meta` predicts this host's cpu backend; `meta:GPU` the cuda one.
        DeviceKind::Meta if opts.target.is_some() => {
            run_meta(opts, model, MetaBackend::emulating_cuda())
        }
        DeviceKind::Meta => run_meta(opts, model, MetaBackend::emulating_cpu()),
        DeviceKind::Cpu => {
            let threads = opts
                .threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
            let mut data = host_data(opts, &model)?;
            // Ranks are threads sharing the cores.
            let per_rank = (threads / n).max(1);
            let backends = (0..n)
                .map(|_| CpuBackend::new(per_rank).map_err(Error::Unavailable))
                .collect::<Result<Vec<_>>>()?;
            let links = cpu_links(&model, &opts.train);
            let mut opts = opts.clone();
            // Without a limit, each rank's capacity is its share of the host's
            // available memory, so a model too big for this machine is a typed
            // out-of-memory, not an abort; a larger limit is capped there too.
            opts.device.limit = capped_by_host(opts.device.limit, n);
            run_on(&opts, model, backends, links, Some(&mut data))
        }
        DeviceKind::Cuda => {
            let threads = opts
                .threads
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
            let mut data = host_data(opts, &model)?;
            // Ranks simulated on one GPU each open the device (a stream, the
            // kernel module and a cuBLAS handle of their own) and share it.
            let ordinal = opts.device.ordinal.unwrap_or(0);
            let backends = (0..n)
                .map(|_| crate::backend::cuda::open(ordinal, threads).map_err(Error::Unavailable))
                .collect::<Result<Vec<_>>>()?;
            let links = cuda_links(&model, &opts.train, backends[0].driver().stager());
            let mut opts = opts.clone();
            // Capacity: what start-up left free, shared by the ranks; a
            // smaller limit emulates a smaller GPU.
            let free = device_free_after_startup(&backends) / n as u64;
            opts.device.limit = Some(opts.device.limit.map_or(free, |l| l.min(free)));
            let gpu = GpuRecord {
                description: backends[0].driver().describe(),
                total_bytes: backends[0].driver().total_bytes(),
                overhead_bytes: backends
                    .iter()
                    .map(|b| b.overhead_bytes())
                    .max()
                    .unwrap_or(0),
            };
            let nvml = NvmlWatch::start(ordinal);
            let (mut report, err) = run_on(&opts, model, backends, links, Some(&mut data))?;
            report.gpu = Some(gpu);
            // The process is every rank's: its NVML peak is one rank's only
            // when it runs one.
            let peak = nvml.and_then(NvmlWatch::peak);
            if let [r] = &mut report.ranks[..] {
                r.nvml_peak_bytes = peak;
            }
            Ok((report, err))
        }
    }
}

/// `opts` on meta, declaring the workspace of the backend `meta` emulates
/// (`memfit run --device meta` predicts the cpu backend; the cuda selftest
/// predicts the cuda one, byte for byte).
pub fn run_meta(
    opts: &RunOptions,
    model: ModelConfig,
    meta: MetaBackend,
) -> Result<(RunReport, Option<Error>)> {
    let n = opts.train.ranks;
    let backends = (0..n).map(|_| meta.clone()).collect();
    let links = meta_links(&model, &opts.train);
    run_on(opts, model, backends, links, None)
}

/// Bytes of a GPU the engine may use once every rank's backend is open:
/// total memory, less the largest overhead a rank measured (each measures
/// what the ranks opened before it hold too), less each rank's own scratch,
/// less 5% for what the driver holds beyond the tracked bytes (allocations
/// rounded to 512 B and 2 MiB, blocks parked in the cache), so that a run
/// near the edge is the tracker's typed out-of-memory, not a failed
/// `cuMemAlloc`.
pub fn device_free_after_startup<D: crate::backend::cuda::driver::Driver>(
    backends: &[crate::backend::cuda::CudaBackend<D>],
) -> u64 {
    let total = backends[0].driver().total_bytes();
    let measured = backends
        .iter()
        .map(|b| b.driver().overhead_bytes())
        .max()
        .unwrap_or(0);
    let scratch = backends.len() as u64 * crate::backend::cuda::SCRATCH_BYTES as u64;
    let free = total.saturating_sub(measured + scratch);
    free - free / 20
}

/// The training text (or synthetic tokens) for a run that computes.
fn host_data(opts: &RunOptions, model: &ModelConfig) -> Result<DataSource> {
    let data = match &opts.data {
        Some(path) => DataSource::text(path, opts.train.seed)?,
        None => DataSource::synthetic(model.vocab_size, opts.train.seed),
    };
    if data.min_vocab() > model.vocab_size {
        return Err(Error::invalid_arg(
            "--data",
            format!(
                "byte-level text needs a vocabulary of at least {}, but {} has {}; use a byte-vocab profile such as gpt2-tiny or llama-tiny",
                data.min_vocab(),
                model.name,
                model.vocab_size
            ),
        ));
    }
    data.check_seq_len(opts.train.seq_len)?;
    Ok(data)
}

/// Every rank's links on one GPU: collectives and point-to-point staged
/// through the host (see `backend::cuda::comm`).
pub fn cuda_links(
    model: &ModelConfig,
    train: &TrainConfig,
    stager: std::sync::Arc<dyn crate::backend::cuda::comm::Stager>,
) -> Vec<Links<crate::backend::cuda::CudaBackend<crate::backend::cuda::AnyDriver>>> {
    use crate::backend::cuda::comm::{CudaComm, CudaP2p};
    links(
        model,
        train,
        |w| {
            CudaComm::group(w, stager.clone())
                .into_iter()
                .map(|c| Box::new(c) as _)
                .collect()
        },
        |s, ring| {
            CudaP2p::chain(s, ring, stager.clone())
                .into_iter()
                .map(|p| Box::new(p) as _)
                .collect()
        },
    )
}

fn run_on<B>(
    opts: &RunOptions,
    model: ModelConfig,
    backends: Vec<B>,
    links: Vec<Links<B>>,
    data: Option<&mut DataSource>,
) -> Result<(RunReport, Option<Error>)>
where
    B: Backend + Send,
    B::Buf: Send,
{
    run_part(opts, model, backends, links, data, None)
}

/// What [`run_part`] needs when its one engine is one rank of a job whose
/// other ranks run in other processes (see [`run_process_rank`]).
struct Share<'a> {
    /// The data-parallel replica this rank belongs to, of `replicas`: it
    /// trains on micro-batches `replica*k .. (replica+1)*k` of each step's
    /// global batch, as `Cluster::step_from` hands them out.
    replica: usize,
    replicas: usize,
    /// This process's rank in the job.
    rank: usize,
    /// Whether the job has failed elsewhere: stop stepping.
    stopped: &'a (dyn Fn() -> bool + Sync),
}

/// [`run_on`], or with `share` one rank of a multi-process job.
fn run_part<B>(
    opts: &RunOptions,
    model: ModelConfig,
    backends: Vec<B>,
    links: Vec<Links<B>>,
    data: Option<&mut DataSource>,
    share: Option<&Share<'_>>,
) -> Result<(RunReport, Option<Error>)>
where
    B: Backend + Send,
    B::Buf: Send,
{
    let part = Part {
        opts,
        meta: !backends[0].holds_data(),
        share,
    };
    let n = backends.len();
    let mut report = part.report(&model, data.as_deref());
    // Open the timeline file first, so a bad path fails before any training.
    let mut timeline_file = match &opts.timeline {
        Some(path) => Some(crate::config::input::create_output(path)?),
        None => None,
    };
    let capacity = report.capacity_bytes;
    let mut cluster = match Cluster::new(&model, &opts.train, backends, links, capacity) {
        Ok(c) => c,
        Err((rank, oom)) => return Ok(refused_at_init(report, oom, n, rank)),
    };
    for e in &mut cluster.ranks {
        // The timeline grows with every step: keep it only when asked for.
        e.dev
            .tracker
            .set_recording(opts.timeline.is_some() || opts.phase_peaks);
    }
    let stepped = part.steps(&mut cluster, data, &mut report);
    let trackers = part.summarise(&mut report, &cluster, &model, &stepped);
    if opts.phase_peaks {
        report.phase_peaks = trackers[0].phase_peaks();
    }
    if let Some(path) = &opts.timeline {
        write_timeline(path, timeline_file.take().expect("opened"), &trackers)?;
    }
    Ok((report, stepped.failure))
}

/// The report of a run whose engines could not be built: what was live
/// when rank `rank` (of `n`) ran out of memory.
fn refused_at_init(
    mut report: RunReport,
    oom: OomError,
    n: usize,
    rank: usize,
) -> (RunReport, Option<Error>) {
    // Nothing beyond the refused allocation was recorded; rebuild the tracker's view.
    report.error = Some(ErrorRecord::new(&oom, n, rank));
    let mut t = Tracker::new(None);
    for (c, b) in oom.live.iter() {
        if b > 0 {
            t.alloc(c, b).expect("no capacity");
        }
    }
    // The device's view is lost with the engine when the host
    // refused: only the host's is known then.
    let empty = Tracker::new(None);
    let device = if oom.host { &empty } else { &t };
    fill_peaks(
        &mut report,
        std::slice::from_ref(device),
        &[(0, 0)],
        &[None],
    );
    // The one entry is the rank that failed.
    report.ranks[0].rank = rank;
    if oom.host {
        report.ranks[0].host_peak_bytes = Some(t.peak_bytes());
        report.host = Some(HostRecord {
            capacity_bytes: Some(oom.capacity),
            peak_bytes: t.peak_bytes(),
            node_bytes: t.peak_bytes().total,
            link_bytes_per_step: 0,
        });
    }
    (report, Some(Error::Oom(oom)))
}

/// What one run (or one process rank of a job) reads as it steps and reports.
struct Part<'a> {
    opts: &'a RunOptions,
    /// On meta: one step, nothing timed, no data.
    meta: bool,
    share: Option<&'a Share<'a>>,
}

/// What the steps left to report: each step's seconds, the failure that
/// stopped them, and each rank's (sent, received) bytes in the last step.
struct Stepped {
    times: Vec<f64>,
    failure: Option<Error>,
    wire: Vec<(u64, u64)>,
}

impl Part<'_> {
    /// The report before any step: the configuration as resolved.
    fn report(&self, model: &ModelConfig, data: Option<&DataSource>) -> RunReport {
        RunReport {
            model: model.name.clone(),
            family: model.family,
            num_parameters: model.num_parameters(),
            config: RunConfigRecord {
                // Resolved, so the document says which lr and beta1 were used
                // (lr null: Adafactor's relative step).
                train: TrainConfig {
                    lr: self.opts.train.opt().lr,
                    beta1: self.opts.train.opt().beta1,
                    ..self.opts.train.clone()
                },
                steps: if self.meta { 0 } else { self.opts.steps },
                data: data.map_or("none".into(), |d| d.describe()),
                threads: if self.meta {
                    None
                } else {
                    self.opts
                        .threads
                        .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
                },
            },
            device: self.opts.device.kind.to_string(),
            target: self.opts.target.as_ref().map(|hw| TargetRecord {
                name: hw.name.clone(),
                display_name: hw.display_name.clone(),
                memory_bytes: hw.memory,
                runtime_overhead_bytes: hw.runtime_overhead,
            }),
            capacity_bytes: self.opts.device.limit,
            allocation_profile: self.opts.train.framework.profile_label().to_string(),
            steps: Vec::new(),
            tokens_per_s: None,
            tokens_per_step: self.opts.train.micro_batch
                * self.opts.train.seq_len
                * self.opts.train.grad_accum
                * self.opts.train.data_ranks(),
            flops_per_step: 0,
            bytes_moved_per_step: 0,
            peak_bytes: PeakBytes::default(),
            peak_breakdown: ByCategory::default(),
            ranks: Vec::new(),
            stages: Vec::new(),
            phase_peaks: Vec::new(),
            skipped_steps: 0,
            loss_scale: None,
            error: None,
            gpu: None,
            allocator: None,
            host: None,
            paged: None,
        }
    }

    /// Steps `cluster` (`opts.steps` times, or as `opts.timing` says; once
    /// on meta), recording each finished step in `report`.
    fn steps<B>(
        &self,
        cluster: &mut Cluster<B>,
        data: Option<&mut DataSource>,
        report: &mut RunReport,
    ) -> Stepped
    where
        B: Backend + Send,
        B::Buf: Send,
    {
        let n = cluster.ranks.len();
        let steps = match (self.meta, self.opts.timing) {
            (true, _) => 1,
            (false, Some(t)) => t.step_cap(),
            (false, None) => self.opts.steps,
        };
        let mut data = data;
        let mut times = Vec::new();
        let mut failure = None;
        let mut wire = vec![(0, 0); n];
        let (b, t) = (self.opts.train.micro_batch, self.opts.train.seq_len);
        let k = self.opts.train.grad_accum;
        // The other replicas' micro-batches, before and after this rank's.
        let (skip_before, skip_after) = self.share.map_or((0, 0), |s| {
            (s.replica * k, (s.replicas - 1 - s.replica) * k)
        });
        let stopped = || self.share.is_some_and(|s| (s.stopped)());
        for step in 0..steps {
            let before: Vec<(u64, u64)> = cluster
                .ranks
                .iter_mut()
                .map(|e| {
                    e.dev.meter.cost = CostCounter::default();
                    e.dev.meter.link_bytes = 0;
                    (e.dev.meter.sent, e.dev.meter.received)
                })
                .collect();
            let start = Instant::now();
            // Batches are made one micro-batch at a time, after their device buffers
            // were granted, and never on meta.
            let mut fed = 0;
            let next = || match data.as_deref_mut() {
                Some(d) => {
                    if fed == 0 {
                        (0..skip_before).for_each(|_| drop(d.next_batch(b, t)));
                    }
                    fed += 1;
                    d.next_batch(b, t)
                }
                None => crate::data::Batch {
                    inputs: Vec::new(),
                    targets: Vec::new(),
                },
            };
            let result = cluster.step_from(k, next);
            if let (true, Some(d)) = (fed > 0, data.as_deref_mut()) {
                (0..skip_after).for_each(|_| drop(d.next_batch(b, t)));
            }
            if result.is_ok() && stopped() {
                // Another rank failed: this step's collectives returned early
                // (and, as on threads, this rank ran on to its own end of step).
                break;
            }
            // One replica's work: every stage and tensor-parallel rank of
            // replica 0 (rank 0 alone without either; replicas repeat the same
            // work).
            let t = &self.opts.train;
            let replica0 = (cluster.ranks.iter().enumerate())
                .filter(|(r, _)| cluster.ranks.len() == 1 || t.place(*r).1 == 0)
                .map(|(_, e)| e);
            report.flops_per_step = replica0.clone().map(|e| e.dev.meter.cost.flops()).sum();
            report.bytes_moved_per_step = replica0.map(|e| e.dev.meter.cost.bytes()).sum();
            let e0 = &cluster.ranks[0];
            for ((w, e), (s0, r0)) in wire.iter_mut().zip(&cluster.ranks).zip(before) {
                *w = (e.dev.meter.sent - s0, e.dev.meter.received - r0);
            }
            match result {
                Ok(r) => {
                    let secs = start.elapsed().as_secs_f64();
                    times.push(secs);
                    let enough = self.opts.timing.is_some_and(|t| t.done(&times));
                    // A norm is measured wherever the loss is, except with
                    // the optimizer in the backward.
                    if let Some(loss) = r.loss {
                        report.steps.push(StepRecord {
                            step,
                            loss,
                            grad_norm: r.grad_norm,
                            ms: secs * 1e3,
                            skipped: r.skipped,
                            loss_scale: e0.loss_scale(),
                        });
                    }
                    if enough {
                        break;
                    }
                }
                Err((rank, oom)) => {
                    report.error = Some(ErrorRecord::new(&oom, n, rank));
                    failure = Some(Error::Oom(oom));
                    break;
                }
            }
        }
        Stepped {
            times,
            failure,
            wire,
        }
    }

    /// Throughput, peaks, traffic and predictions into `report`; the
    /// ranks' trackers, for the phase peaks and the timeline.
    fn summarise<B: Backend>(
        &self,
        report: &mut RunReport,
        cluster: &Cluster<B>,
        model: &ModelConfig,
        stepped: &Stepped,
    ) -> Vec<Tracker> {
        let (times, wire) = (&stepped.times, &stepped.wire);
        if !self.meta && !times.is_empty() {
            let warmup = self.opts.timing.map_or(1, |t| t.warmup_steps);
            let timed = times
                .get(warmup..)
                .filter(|t| !t.is_empty())
                .unwrap_or(&times[..]);
            // The median: one stalled step on a busy machine does not move it.
            report.tokens_per_s = Some(report.tokens_per_step as f64 / crate::stats::median(timed));
        }
        let e0 = &cluster.ranks[0];
        report.allocator = e0
            .dev
            .caching
            .as_ref()
            .map(|c| crate::plan::AllocatorPeaks {
                max_memory_allocated: c.peak_allocated,
                max_memory_reserved: c.peak_reserved,
            });
        report.skipped_steps = e0.skipped_steps();
        report.loss_scale = e0.loss_scale();
        let trackers: Vec<Tracker> = cluster
            .ranks
            .iter()
            .map(|e| e.dev.tracker.clone())
            .collect();
        let stages: Vec<_> = cluster.ranks.iter().map(Engine::stage).collect();
        fill_peaks(report, &trackers, wire, &stages);
        if !self.meta {
            // Beside what each rank tracked, what meta predicts for it.
            let gpu = cluster.ranks[0].dev.be.is_gpu();
            for (i, r) in report.ranks.iter_mut().enumerate() {
                let rank = self.share.map_or(i, |s| s.rank);
                r.predicted_peak_bytes = Some(predicted_peak(model, &self.opts.train, rank, gpu));
            }
        }
        report.host = host_record(&mut report.ranks, &cluster.ranks);
        report.paged = paged_record(&mut report.ranks, &cluster.ranks);
        trackers
    }
}

/// Offload: each rank's host peaks, and the node's.
fn host_record<B: Backend>(ranks: &mut [RankRecord], engines: &[Engine<B>]) -> Option<HostRecord> {
    let first = engines.first()?.dev.host.as_ref()?;
    let mut top = PeakBytes::default();
    let mut node = 0;
    for (r, e) in ranks.iter_mut().zip(engines) {
        let pk = e.dev.host.as_ref().map(Tracker::peak_bytes)?;
        for c in Category::ALL {
            top.set(c, top.get(c).max(pk.get(c)));
        }
        top.total = top.total.max(pk.total);
        node += pk.total;
        r.host_peak_bytes = Some(pk);
    }
    Some(HostRecord {
        capacity_bytes: first.capacity(),
        peak_bytes: top,
        node_bytes: node,
        link_bytes_per_step: engines[0].dev.meter.link_bytes,
    })
}

/// A paged optimizer: each rank's state in unified memory, and the highest.
fn paged_record<B: Backend>(
    ranks: &mut [RankRecord],
    engines: &[Engine<B>],
) -> Option<PagedRecord> {
    engines.first()?.dev.paged.as_ref()?;
    let mut top = 0;
    for (r, e) in ranks.iter_mut().zip(engines) {
        let bytes = e.dev.paged.as_ref().map(|t| t.peak_bytes().total)?;
        top = top.max(bytes);
        r.paged_bytes = Some(bytes);
    }
    Some(PagedRecord {
        memory: crate::plan::PAGED_MEMORY,
        peak_bytes: top,
    })
}

/// Per-rank peaks and traffic; the top level is the maximum over ranks (the
/// breakdown is the fullest rank's).
fn fill_peaks(
    report: &mut RunReport,
    trackers: &[Tracker],
    wire: &[(u64, u64)],
    stages: &[Option<crate::engine::pipeline::Place>],
) {
    report.ranks = trackers
        .iter()
        .zip(wire)
        .zip(stages)
        .enumerate()
        .map(|(rank, ((t, &(sent, received)), st))| RankRecord {
            rank,
            stage: st.as_ref().map(|s| s.0),
            layers: st.as_ref().map(|s| [s.1[0].start, s.1[0].end]),
            chunks: match st {
                Some((_, c)) if c.len() > 1 => c.iter().map(|r| [r.start, r.end]).collect(),
                _ => Vec::new(),
            },
            peak_bytes: t.peak_bytes(),
            peak_breakdown: t.at_peak(),
            sent_bytes_per_step: sent,
            received_bytes_per_step: received,
            host_peak_bytes: None,
            paged_bytes: None,
            predicted_peak_bytes: None,
            nvml_peak_bytes: None,
        })
        .collect();
    summarise_ranks(report);
}

/// The timeline as CSV: one line per allocation or free, every rank's.
pub fn write_timeline(
    path: &std::path::Path,
    file: std::fs::File,
    trackers: &[Tracker],
) -> Result<()> {
    let io = |source| Error::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut w = std::io::BufWriter::new(file);
    writeln!(w, "rank,t_ns,phase,category,bytes,live_total").map_err(io)?;
    for (rank, t) in trackers.iter().enumerate() {
        for e in t.timeline() {
            writeln!(
                w,
                "{rank},{},{},{},{},{}",
                e.t_ns,
                e.phase,
                e.category.name(),
                e.bytes,
                e.live_total
            )
            .map_err(io)?;
        }
    }
    w.flush().map_err(io)
}
