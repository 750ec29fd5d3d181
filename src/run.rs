//! `memfit run`: train a model for a few steps (or plan one step on meta) and
//! report losses, throughput, FLOPs and peak memory per category.

pub mod knobs;
pub mod options;
pub mod recipe;

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
    ErrorRecord, GpuRecord, HostRecord, RankRecord, RunConfigRecord, RunReport, StepRecord,
    TargetRecord, summarise_ranks,
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

/// Checks the options against the model, with errors naming the flag.
/// The checks run in this order, so the first refusal is the one reported.
pub fn validate(opts: &RunOptions, model: &ModelConfig) -> Result<()> {
    let t = &opts.train;
    check_counts(opts, model)?;
    check_hyperparameters(t)?;
    check_step_size(t, model)?;
    check_sgd_knobs(t)?;
    if opts.threads == Some(0) {
        return Err(Error::invalid_arg("--threads", "must be at least 1"));
    }
    if !(0.0..1.0).contains(&t.dropout) {
        return Err(Error::invalid_arg(
            "--dropout",
            format!("{} is outside [0, 1)", t.dropout),
        ));
    }
    check_finetune(opts, model)?;
    check_framework(opts)?;
    if let Some(why) = t.offload.check(t.sharding) {
        return Err(Error::invalid_arg("--offload", why));
    }
    if !t.offload.optimizer() && t.host_memory.is_some() {
        return Err(Error::invalid_arg(
            "--host-memory",
            "applies to offload only; add --offload optimizer",
        ));
    }
    crate::engine::validate::pipeline(t, model)?;
    crate::engine::validate::tensor_parallel(t, model)?;
    crate::engine::validate::loss(t)?;
    crate::engine::validate::sharding(t, MAX_RANKS)
}

/// The sequence length, micro-batch, accumulation and step counts.
fn check_counts(opts: &RunOptions, model: &ModelConfig) -> Result<()> {
    let t = &opts.train;
    if t.seq_len == 0 || t.seq_len > model.max_seq_len {
        return Err(Error::invalid_arg(
            "--seq-len",
            format!(
                "{} is outside 1..={}, the maximum sequence length of {}",
                t.seq_len, model.max_seq_len, model.name
            ),
        ));
    }
    for (flag, v) in [
        ("--micro-batch", t.micro_batch),
        ("--grad-accum", t.grad_accum),
    ] {
        if v == 0 {
            return Err(Error::invalid_arg(flag, "must be at least 1"));
        }
    }
    if opts.steps == 0 && opts.device.kind != DeviceKind::Meta {
        return Err(Error::invalid_arg("--steps", "must be at least 1"));
    }
    Ok(())
}

/// The optimizer's numbers: each in its range.
fn check_hyperparameters(t: &TrainConfig) -> Result<()> {
    if let Some(lr) = t.lr
        && !(lr.is_finite() && lr >= 0.0)
    {
        return Err(Error::invalid_arg(
            "--lr",
            format!("{lr} is not a usable learning rate"),
        ));
    }
    if let Some(b1) = t.beta1
        && !(0.0..1.0).contains(&b1)
    {
        return Err(Error::invalid_arg(
            "--beta1",
            format!("{b1} is outside [0, 1)"),
        ));
    }
    if !(0.0..1.0).contains(&t.beta2) {
        return Err(Error::invalid_arg(
            "--beta2",
            format!("{} is outside [0, 1)", t.beta2),
        ));
    }
    let adam = matches!(t.optimizer, Optimizer::Adamw | Optimizer::Adamw8bit);
    if !adam && t.beta2 != TrainConfig::default().beta2 {
        return Err(Error::invalid_arg(
            "--beta2",
            "applies to adamw and adamw8bit: sgd keeps no second moment, and \
             adafactor's decays on its own schedule (1 - t^-0.8)",
        ));
    }
    if t.optimizer == Optimizer::Sgd && !(t.momentum > 0.0 && t.momentum < 1.0) {
        return Err(Error::invalid_arg(
            "--momentum",
            format!(
                "{} is outside (0, 1); memfit's sgd is SGD with momentum",
                t.momentum
            ),
        ));
    }
    if !(t.weight_decay.is_finite() && t.weight_decay >= 0.0) {
        return Err(Error::invalid_arg(
            "--weight-decay",
            "must be 0 or positive",
        ));
    }
    if !(t.grad_clip.is_finite() && t.grad_clip >= 0.0) {
        return Err(Error::invalid_arg(
            "--grad-clip",
            "must be 0 (off) or positive",
        ));
    }
    Ok(())
}

/// A step whose buffers no machine can address or hold is bad input.
fn check_step_size(t: &TrainConfig, model: &ModelConfig) -> Result<()> {
    if t.grad_accum > 1 << 20 {
        return Err(Error::invalid_arg(
            "--grad-accum",
            "more than 2^20 micro-batches per step: accumulation changes no memory, use a smaller value",
        ));
    }
    // Activation sizes in u128: a shape whose buffers cannot be addressed is bad input.
    let (b, tt) = (t.micro_batch as u128, t.seq_len as u128);
    let widest = [
        model.padded_vocab(),
        model.qkv_width(),
        model.up_width(),
        model.d_model,
    ]
    .into_iter()
    .max()
    .unwrap_or(0) as u128;
    let biggest = (b * tt * widest).max(b * model.n_head as u128 * tt * tt) * 4;
    if biggest > 1 << 60 || b * tt * t.grad_accum as u128 > crate::plan::MAX_TOKENS_PER_STEP {
        return Err(Error::invalid_arg(
            "--micro-batch",
            format!(
                "{} sequences of {} tokens need buffers beyond 2^60 bytes; nothing can hold that",
                t.micro_batch, t.seq_len
            ),
        ));
    }
    // The whole step, not one buffer: every layer keeps a few activations of
    // each width, so many layers of large buffers pass 2^64 bytes together
    // (and meta's peaks wrapped around). A generous over-estimate: sixteen
    // of the widest per token, per layer and the head, plus eager
    // attention's two T x T tensors per layer; no machine holds 2^62 bytes.
    let layers = model.n_layer as u128 + 1;
    let step =
        b * tt * widest * 4 * 16 * layers + b * model.n_head as u128 * tt * tt * 4 * 2 * layers;
    if step > 1 << 62 {
        return Err(Error::invalid_arg(
            "--micro-batch",
            format!(
                "{} sequences of {} tokens through {} layers hold over 2^62 bytes of activations; nothing can hold that",
                t.micro_batch, t.seq_len, model.n_layer
            ),
        ));
    }
    Ok(())
}

/// Momentum is sgd's alone, and sgd has no beta1.
fn check_sgd_knobs(t: &TrainConfig) -> Result<()> {
    if t.optimizer != Optimizer::Sgd && t.momentum != TrainConfig::default().momentum {
        return Err(Error::invalid_arg("--momentum", "only sgd uses momentum"));
    }
    if t.optimizer == Optimizer::Sgd && t.beta1.is_some() {
        return Err(Error::invalid_arg(
            "--beta1",
            "sgd has no beta1; use --momentum",
        ));
    }
    Ok(())
}

/// LoRA and QLoRA: what the adapters need of the model and the parallelism.
fn check_finetune(opts: &RunOptions, model: &ModelConfig) -> Result<()> {
    let t = &opts.train;
    if t.finetune != Finetune::Full {
        // Data parallelism trains the adapters alone (DDP buckets, ZeRO's
        // gradient and optimizer partitions); pipelines and QLoRA under
        // zero3 do not run yet.
        if let Some((flag, why)) = crate::engine::lora::check_parallel(t) {
            return Err(Error::invalid_arg(flag, why));
        }
        crate::engine::lora::check(model, &t.lora)
            .map_err(|(knob, m)| Error::invalid_arg(&format!("--lora-{knob}"), m))?;
        if t.lora.dropout > 0.0
            && (t.framework != Framework::HfEager || opts.device.kind != DeviceKind::Meta)
        {
            return Err(Error::invalid_arg(
                "--lora-dropout",
                "the engine's kernels have no dropout: it is modelled for --framework hf-eager on --device meta only",
            ));
        }
    }
    Ok(())
}

/// hf-eager runs for real only where the engine's kernels compute what
/// PyTorch would.
fn check_framework(opts: &RunOptions) -> Result<()> {
    let t = &opts.train;
    if t.framework == Framework::HfEager && opts.device.kind != DeviceKind::Meta {
        // hf-eager holds PyTorch's tensors but computes with the engine's
        // kernels, which are fp32 or fully 16-bit (not autocast's fp32
        // weights with 16-bit activations) and have no dropout.
        if crate::engine::framework::is_autocast(t) {
            return Err(Error::invalid_arg(
                "--framework",
                format!(
                    "hf-eager with {} is autocast (fp32 weights, 16-bit matmuls), which the engine's kernels do not compute; plan it with --device meta or `memfit plan`, or run --precision fp32",
                    crate::plan::name(t.precision)
                ),
            ));
        }
        if t.dropout > 0.0 {
            return Err(Error::invalid_arg(
                "--dropout",
                "the engine's kernels have no dropout: hf-eager models its masks on --device meta only",
            ));
        }
    }
    Ok(())
}

/// Offload: each rank's share of the node's host memory (`--host-memory`,
/// or this machine's available memory), which is what its host tracker
/// may hold. The ranks of a run are all on this node.
fn host_share(t: &mut TrainConfig) {
    if t.offload.optimizer() {
        t.host_memory = t
            .host_memory
            .or_else(mem_available)
            .map(|h| h / t.ranks as u64);
    }
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
        |s| {
            CudaP2p::chain(s, stager.clone())
                .into_iter()
                .map(|p| Box::new(p) as _)
                .collect()
        },
    )
}

/// One rank of a multi-process job: its process group, and its own run.
pub type ProcessRun = (
    std::sync::Arc<crate::comm::process::ProcessGroup>,
    Result<(RunReport, Option<Error>)>,
);

/// `memfit run` as rank `env.rank` of a job of `env.world` processes
/// (`memfit launch`, torchrun): joins the process group, builds this rank's
/// one engine linked to the others over it (TCP on cpu; NCCL, or TCP staged
/// through the host, on cuda), and trains on its replica's share of each
/// global batch, so losses and peaks are those of `memfit run --ranks N` in
/// one process. The report is this rank's alone: `launch::rank_main`
/// gathers the ranks' reports on rank 0. An `Err` means this rank never
/// joined the job.
pub fn run_process_rank(
    opts: &RunOptions,
    env: &crate::comm::process::DistEnv,
) -> Result<ProcessRun> {
    let model = load_model(&opts.model)?;
    validate(opts, &model)?;
    check_process_rank(opts, env)?;
    let mut opts = opts.clone();
    let t = &mut opts.train;
    // Offload: this rank's share of its node's host memory.
    if t.offload.optimizer() {
        t.host_memory = t
            .host_memory
            .or_else(mem_available)
            .map(|h| h / env.local_world as u64);
    }
    // This node's cores, shared by its ranks.
    let threads = opts.threads.unwrap_or_else(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / env.local_world).max(1)
    });
    let data = host_data(&opts, &model)?;
    let me = ProcessRank {
        opts,
        model,
        env,
        threads,
        data,
    };
    match me.opts.device.kind {
        DeviceKind::Meta => unreachable!("refused above"),
        DeviceKind::Cpu => me.on_cpu(),
        DeviceKind::Cuda => me.on_cuda(),
    }
}

/// What a multi-process rank refuses beyond [`validate`].
fn check_process_rank(opts: &RunOptions, env: &crate::comm::process::DistEnv) -> Result<()> {
    if opts.train.ranks != env.world {
        return Err(Error::invalid_arg(
            "--ranks",
            format!(
                "{} but WORLD_SIZE is {}: a multi-process job runs one rank per process; pass --ranks {}",
                opts.train.ranks, env.world, env.world
            ),
        ));
    }
    if opts.device.kind == DeviceKind::Meta {
        return Err(Error::invalid_arg(
            "--device",
            "meta plans every rank in one process; run it without memfit launch (memfit run --ranks N)",
        ));
    }
    if opts.timeline.is_some() {
        return Err(Error::invalid_arg(
            "--timeline",
            "a multi-process run writes no timeline yet; run the ranks as threads (memfit run --ranks N, without launch) for one",
        ));
    }
    Ok(())
}

/// One rank of a multi-process job, checked and about to join: its
/// options (its share of the node's host memory and cores), model and data.
struct ProcessRank<'a> {
    opts: RunOptions,
    model: ModelConfig,
    env: &'a crate::comm::process::DistEnv,
    threads: usize,
    data: DataSource,
}

impl ProcessRank<'_> {
    /// On cpu: collectives and pipeline links over TCP.
    fn on_cpu(mut self) -> Result<ProcessRun> {
        use crate::backend::cpu::process::{ProcessComm, ProcessP2p};
        use crate::comm::process::ProcessGroup;
        let env = self.env;
        let backend = CpuBackend::new(self.threads).map_err(Error::Unavailable)?;
        let (group, _) = ProcessGroup::connect(env, || Ok(Vec::new()))?;
        let links = process_links(
            &self.model,
            &self.opts.train,
            env.rank,
            |ch, members| Box::new(ProcessComm::new(&group, ch, members)) as Comm<CpuBackend>,
            |ch, prev, next| Box::new(ProcessP2p::new(&group, ch, prev, next)) as _,
        )?;
        self.opts.device.limit = capped_by_host(self.opts.device.limit, env.local_world);
        let out = self.train(backend, links, &group);
        Ok((group, out))
    }

    /// On cuda: NCCL for the group of every rank where it can run, every
    /// other group and link staged through the host over TCP.
    fn on_cuda(mut self) -> Result<ProcessRun> {
        use crate::backend::cpu::process::{ProcessComm, ProcessP2p};
        use crate::backend::cuda::AnyDriver;
        use crate::backend::cuda::nccl::{NcclComm, Staged, unique_id};
        use crate::comm::process::ProcessGroup;
        let env = self.env;
        let ordinal = self.opts.device.ordinal.unwrap_or(env.local_rank);
        let backend =
            crate::backend::cuda::open(ordinal, self.threads).map_err(Error::Unavailable)?;
        let real = matches!(backend.driver(), AnyDriver::Real(_));
        let use_nccl = use_nccl(real, self.opts.train.pipeline_stages)?;
        let t = &self.opts.train;
        let distributed = t.data_ranks() > 1 || t.sharding != Sharding::None;
        let (group, blob) = ProcessGroup::connect(env, || match use_nccl && distributed {
            true => unique_id().map_err(Error::Unavailable),
            false => Ok(Vec::new()),
        })?;
        let stager = backend.driver().stager();
        // NCCL carries the group of every rank (made once, by all
        // ranks together); other groups stage through the host.
        let nccl_err = std::cell::RefCell::new(None);
        let links = process_links(
            &self.model,
            &self.opts.train,
            env.rank,
            |ch, members| {
                let staged = || {
                    Box::new(Staged::new(
                        ProcessComm::new(&group, ch, members.clone()),
                        stager.clone(),
                    ))
                };
                if !(use_nccl && members.len() == env.world) {
                    return staged() as Comm<crate::backend::cuda::CudaBackend<AnyDriver>>;
                }
                match NcclComm::new(ordinal, &group, ch, &blob, env.timeout) {
                    Ok(c) => Box::new(c),
                    Err(e) => {
                        nccl_err.borrow_mut().get_or_insert(e);
                        staged()
                    }
                }
            },
            |ch, prev, next| {
                Box::new(Staged::new(
                    ProcessP2p::new(&group, ch, prev, next),
                    stager.clone(),
                ))
            },
        )?;
        if let Some(e) = nccl_err.into_inner() {
            return Err(Error::Unavailable(e));
        }
        let backends = [backend];
        let free = device_free_after_startup(&backends);
        self.opts.device.limit = Some(self.opts.device.limit.map_or(free, |l| l.min(free)));
        let [backend] = backends;
        let gpu = GpuRecord {
            description: backend.driver().describe(),
            total_bytes: backend.driver().total_bytes(),
            overhead_bytes: backend.overhead_bytes(),
        };
        let nvml = NvmlWatch::start(ordinal);
        let out = self.train(backend, links, &group).map(|(mut report, err)| {
            report.gpu = Some(gpu);
            let peak = nvml.and_then(NvmlWatch::peak);
            for r in &mut report.ranks {
                r.nvml_peak_bytes = peak;
            }
            (report, err)
        });
        Ok((group, out))
    }

    /// This rank's training: its replica's share of every batch, until
    /// the group fails.
    fn train<B>(
        mut self,
        backend: B,
        links: Links<B>,
        group: &crate::comm::process::ProcessGroup,
    ) -> Result<(RunReport, Option<Error>)>
    where
        B: Backend + Send,
        B::Buf: Send,
    {
        let rank = self.env.rank;
        #[cfg(feature = "test-hooks")]
        crate::faults::rank_fault(rank);
        let failed = || group.failure().is_some();
        let share = Share {
            rank,
            replica: self.opts.train.place(rank).1,
            replicas: self.opts.train.data_ranks(),
            stopped: &failed,
        };
        run_part(
            &self.opts,
            self.model,
            vec![backend],
            vec![links],
            Some(&mut self.data),
            Some(&share),
        )
    }
}

/// Whether the group of every rank runs on NCCL (`MEMFIT_DIST_BACKEND`):
/// by default on a real GPU without pipeline stages; the emulated GPU,
/// `tcp` and pipelines (whose links NCCL is not wired for) stage through
/// the host.
fn use_nccl(real: bool, pipeline_stages: usize) -> Result<bool> {
    use crate::backend::cuda::nccl::BACKEND_ENV;
    Ok(
        match std::env::var(BACKEND_ENV).unwrap_or_default().as_str() {
            "" => real && pipeline_stages == 1,
            "tcp" => false,
            "nccl" if !real => {
                return Err(Error::invalid_arg(
                    BACKEND_ENV,
                    "nccl needs a real GPU; the emulated one (MEMFIT_CUDA_EMULATE) stages collectives through the host: unset it or use tcp",
                ));
            }
            "nccl" if pipeline_stages > 1 => {
                return Err(Error::invalid_arg(
                    BACKEND_ENV,
                    "nccl carries data parallelism only; pipelines stage through the host: unset it or use tcp",
                ));
            }
            "nccl" => true,
            other => {
                return Err(Error::invalid_arg(
                    BACKEND_ENV,
                    format!("`{other}` is not a backend: nccl or tcp"),
                ));
            }
        },
    )
}

/// NVML sampling this process's device memory on one GPU while it trains
/// (`None` without NVML: no driver, no GPU, the emulated one).
struct NvmlWatch(crate::telemetry::Sampler);

impl NvmlWatch {
    fn start(ordinal: usize) -> Option<NvmlWatch> {
        let t = crate::telemetry::Telemetry::open().ok()?;
        let pid = std::process::id();
        let watch = std::sync::Arc::new(std::sync::Mutex::new(vec![pid]));
        let every = std::time::Duration::from_millis(20);
        Some(NvmlWatch(crate::telemetry::Sampler::start(
            t,
            every,
            Some(ordinal as u32),
            watch,
        )))
    }

    /// The highest memory NVML reported for this process, if it ever did.
    fn peak(self) -> Option<u64> {
        let seen = self.0.stop();
        let pid = std::process::id();
        seen.watched
            .iter()
            .find(|w| w.pid == pid && !w.samples.is_empty())
            .map(|w| w.peak_bytes)
    }
}

/// What the meta backend predicts for global rank `rank`'s peak: its
/// links, engine and one step of `train`, on meta emulating this run's
/// device.
fn predicted_peak(model: &ModelConfig, train: &TrainConfig, rank: usize, gpu: bool) -> u64 {
    let meta = match gpu {
        true => MetaBackend::emulating_cuda(),
        false => MetaBackend::emulating_cpu(),
    };
    let link = meta_links(model, train).swap_remove(rank);
    let mut e = Engine::new_linked(model.clone(), train.clone(), meta, None, link)
        .unwrap_or_else(|oom| unreachable!("meta has no capacity: {oom}"));
    e.step_from(train.grad_accum, || unreachable!("meta reads no data"))
        .unwrap_or_else(|oom| unreachable!("meta has no capacity: {oom}"));
    e.dev.tracker.peak_bytes().total
}

/// A cpu rank's capacity: `limit`, capped at its share of the host's
/// available memory among `ranks` ranks (the whole share without a limit),
/// so a model too big for this machine is a typed out-of-memory.
fn capped_by_host(limit: Option<u64>, ranks: usize) -> Option<u64> {
    let host = mem_available().map(|h| h / ranks as u64);
    match (limit, host) {
        (Some(l), Some(h)) => Some(l.min(h)),
        (l, h) => l.or(h),
    }
}

/// A group (`false`) or chain (`true`) by its creation index, and a place in it.
type ProbeSeen = std::sync::Arc<std::sync::Mutex<Option<((bool, usize), usize)>>>;

/// Stands in for a group or chain in the first pass of [`process_links`]:
/// calling its abort handle tells which one it is and at which position.
struct Probe {
    id: (bool, usize),
    pos: usize,
    seen: ProbeSeen,
}

impl Probe {
    fn handle(&self) -> crate::comm::AbortHandle {
        let (seen, me) = (self.seen.clone(), (self.id, self.pos));
        std::sync::Arc::new(move || *seen.lock().unwrap_or_else(|e| e.into_inner()) = Some(me))
    }
}

impl<Buf> crate::comm::Collective<Buf> for Probe {
    fn rank(&self) -> usize {
        self.pos
    }
    fn world(&self) -> usize {
        unreachable!("a probe only tells where it is")
    }
    fn all_reduce_sum(&mut self, _: &mut Buf, _: usize) {}
    fn reduce_scatter_sum(&mut self, _: &mut Buf, _: &Buf, _: usize) {}
    fn all_gather(&mut self, _: &mut Buf, _: &Buf, _: usize) {}
    fn broadcast(&mut self, _: &mut Buf, _: usize, _: usize) {}
    fn all_reduce_scalar(&mut self, x: f64) -> f64 {
        x
    }
    fn abort_handle(&self) -> crate::comm::AbortHandle {
        self.handle()
    }
}

impl<Buf> crate::comm::PointToPoint<Buf> for Probe {
    fn send(&mut self, _: crate::comm::Peer, _: &Buf, _: usize) {}
    fn recv(&mut self, _: crate::comm::Peer, _: &mut Buf, _: usize) {}
    fn abort_handle(&self) -> crate::comm::AbortHandle {
        self.handle()
    }
}

/// Rank `rank`'s links, wired by [`links`] (the one place that decides who
/// talks to whom) with groups and chains over processes. A first pass with
/// [`Probe`]s learns which global ranks each group and chain `links` makes
/// joins, in its own order; the second makes this rank's: `comm(channel,
/// members)` its collective groups, `p2p(channel, prev, next)` its
/// pipeline links (global ranks), each on a channel of its own. The other
/// ranks' places get [`crate::comm::process::Elsewhere`] and are dropped.
fn process_links<B: Backend>(
    model: &ModelConfig,
    train: &TrainConfig,
    rank: usize,
    comm: impl Fn(u32, Vec<usize>) -> Comm<B>,
    p2p: impl Fn(u32, Option<usize>, Option<usize>) -> Box<dyn crate::comm::PointToPoint<B::Buf>>,
) -> Result<Links<B>> {
    use crate::comm::process::Elsewhere;
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;
    type Id = (bool, usize);
    let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (groups, chains) = (Cell::new(0), Cell::new(0));
    let next = |c: &Cell<usize>| c.replace(c.get() + 1);
    let probes = |id: Id, n: usize| -> Vec<Probe> {
        (0..n)
            .map(|pos| Probe {
                id,
                pos,
                seen: seen.clone(),
            })
            .collect()
    };
    let probed = links::<B>(
        model,
        train,
        |w| {
            let id = (false, next(&groups));
            probes(id, w)
                .into_iter()
                .map(|p| Box::new(p) as Comm<B>)
                .collect()
        },
        |s| {
            let id = (true, next(&chains));
            probes(id, s)
                .into_iter()
                .map(|p| Box::new(p) as _)
                .collect()
        },
    );
    let mut members: HashMap<Id, Vec<Option<usize>>> = HashMap::new();
    let mut place = |h: crate::comm::AbortHandle, r: usize| {
        h();
        let (id, pos) = seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .expect("a probe");
        let m = members.entry(id).or_default();
        if m.len() <= pos {
            m.resize(pos + 1, None);
        }
        m[pos] = Some(r);
    };
    for (r, l) in probed.iter().enumerate() {
        // Every field by name: a new kind of link must be placed here too.
        let Links {
            comm,
            pipe,
            replicate,
            tp,
            hpz,
        } = l;
        for c in comm.iter().chain(replicate).chain(tp).chain(hpz) {
            place(c.abort_handle(), r);
        }
        if let Some(p) = pipe {
            place(p.p2p.abort_handle(), r);
            place(p.group.abort_handle(), r);
            if let Some(e) = &p.embed {
                place(e.abort_handle(), r);
            }
        }
    }
    drop(probed);
    // Global ranks of group `id` of `n` places, if every place was found.
    let ranks_of = |id: Id, n: usize| -> Option<Vec<usize>> {
        let m = members.get(&id)?;
        (m.len() == n).then(|| m.iter().copied().collect::<Option<Vec<_>>>())?
    };
    let unknown = RefCell::new(false);
    // Channel 0 is unused; chains after every group.
    let channel = |id: Id| 1 + id.1 as u32 + if id.0 { 1 << 20 } else { 0 };
    let (groups, chains) = (Cell::new(0), Cell::new(0));
    let mut all = links(
        model,
        train,
        |w| {
            let id = (false, next(&groups));
            let Some(ranks) = ranks_of(id, w) else {
                *unknown.borrow_mut() = true;
                return (0..w).map(|_| Box::new(Elsewhere) as Comm<B>).collect();
            };
            ranks
                .iter()
                .map(|&r| match r == rank {
                    true => comm(channel(id), ranks.clone()),
                    false => Box::new(Elsewhere) as Comm<B>,
                })
                .collect()
        },
        |s| {
            let id = (true, next(&chains));
            let Some(ranks) = ranks_of(id, s) else {
                *unknown.borrow_mut() = true;
                return (0..s).map(|_| Box::new(Elsewhere) as _).collect();
            };
            (0..s)
                .map(|i| match ranks[i] == rank {
                    true => p2p(
                        channel(id),
                        i.checked_sub(1).map(|j| ranks[j]),
                        ranks.get(i + 1).copied(),
                    ),
                    false => Box::new(Elsewhere) as _,
                })
                .collect()
        },
    );
    if unknown.into_inner() {
        return Err(Error::invalid_arg(
            "--ranks",
            "this layout has groups a multi-process run cannot wire yet; run its ranks as threads (memfit run --ranks N, without launch)",
        ));
    }
    Ok(all.swap_remove(rank))
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
                    if let (Some(loss), Some(grad_norm)) = (r.loss, r.grad_norm) {
                        report.steps.push(StepRecord {
                            step,
                            loss,
                            grad_norm,
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

/// Per-rank peaks and traffic; the top level is the maximum over ranks (the
/// breakdown is the fullest rank's).
fn fill_peaks(
    report: &mut RunReport,
    trackers: &[Tracker],
    wire: &[(u64, u64)],
    stages: &[Option<(usize, std::ops::Range<usize>)>],
) {
    report.ranks = trackers
        .iter()
        .zip(wire)
        .zip(stages)
        .enumerate()
        .map(|(rank, ((t, &(sent, received)), st))| RankRecord {
            rank,
            stage: st.as_ref().map(|s| s.0),
            layers: st.as_ref().map(|s| [s.1.start, s.1.end]),
            peak_bytes: t.peak_bytes(),
            peak_breakdown: t.at_peak(),
            sent_bytes_per_step: sent,
            received_bytes_per_step: received,
            host_peak_bytes: None,
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
