//! `memfit run`'s report: the JSON document (`docs/report-schema.md`) and
//! the table printed from it. `memfit launch`'s rank 0 and the selftest
//! build the same document.

use std::fmt::Write as _;

use serde::Serialize;

use crate::engine::{Finetune, Framework, TrainConfig};
use crate::memory::{ByCategory, Category, OomError, PeakBytes};
use crate::units::fmt_bytes;

#[derive(Clone, Debug, Serialize)]
pub struct StepRecord {
    pub step: usize,
    pub loss: f32,
    /// The gradient's global norm before clipping; absent with the
    /// optimizer in the backward, which steps each unit before the last
    /// gradient exists (torchtune's recipe reports none either).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_norm: Option<f32>,
    pub ms: f64,
    /// The update was skipped because the gradient was not finite.
    pub skipped: bool,
    /// fp16: the loss scale after this step (halved on a skip).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f32>,
}

/// The knobs of a run, as the JSON `config` object shows them.
#[derive(Clone, Debug, Serialize)]
pub struct RunConfigRecord {
    #[serde(flatten)]
    pub train: TrainConfig,
    pub steps: usize,
    pub data: String,
    pub threads: Option<usize>,
}

/// One rank's memory and traffic.
#[derive(Clone, Debug, Serialize)]
pub struct RankRecord {
    pub rank: usize,
    /// Its pipeline stage, and the blocks `[lo, hi)` it holds (pipelines
    /// only; with virtual stages, its first chunk's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stage: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layers: Option<[usize; 2]>,
    /// With virtual stages: the blocks `[lo, hi)` of each of its model
    /// chunks, in model order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<[usize; 2]>,
    pub peak_bytes: PeakBytes,
    pub peak_breakdown: ByCategory,
    /// Bytes this rank sent and received in collectives during the last step
    /// (ring algorithms; see `comm::wire_bytes`).
    pub sent_bytes_per_step: u64,
    pub received_bytes_per_step: u64,
    /// Offload: this rank's peaks in host memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_peak_bytes: Option<PeakBytes>,
    /// A paged optimizer: this rank's state in unified memory (outside
    /// `peak_bytes`, which is what the device's allocator holds).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paged_bytes: Option<u64>,
    /// What the meta backend predicts for this rank's peak (runs that
    /// compute only): the same engine, rank and step, computing nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub predicted_peak_bytes: Option<u64>,
    /// On a GPU, with NVML: the peak device memory NVML saw this rank's
    /// process use (a rank process of `memfit launch`, or a run of one
    /// rank), driver and library overhead included.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvml_peak_bytes: Option<u64>,
}

/// Offload: the host memory the ranks' offloaded tensors took, as
/// DeepSpeed's estimators give it per GPU and "per CPU" (the node).
#[derive(Clone, Debug, Serialize)]
pub struct HostRecord {
    /// Each rank's share of the node's host memory.
    pub capacity_bytes: Option<u64>,
    /// The highest of the ranks' host peaks.
    pub peak_bytes: PeakBytes,
    /// Every rank's host peak added up: the node's (all ranks of a run
    /// are on this node).
    pub node_bytes: u64,
    /// Bytes rank 0 moved between device and host in the last step.
    pub link_bytes_per_step: u64,
}

/// A paged optimizer (`paged-adamw`, `paged-adamw8bit`): the state
/// bitsandbytes allocates with `cudaMallocManaged`, which neither the
/// tracked device peak nor PyTorch's `max_memory_allocated`/`reserved`
/// counts. It sits in device memory while there is room and the driver
/// pages the rest to host memory.
#[derive(Clone, Debug, Serialize)]
pub struct PagedRecord {
    /// Where these bytes live, in words.
    pub memory: &'static str,
    /// The highest of the ranks' paged bytes (optimizer state only).
    pub peak_bytes: u64,
}

/// One pipeline stage: its blocks, and its peaks (the highest of its replicas').
#[derive(Clone, Debug, Serialize)]
pub struct StageRecord {
    pub stage: usize,
    /// Blocks `[lo, hi)`; the first stage also holds the embedding, the
    /// last the head (with virtual stages, its first chunk's).
    pub layers: [usize; 2],
    /// With virtual stages: each of its model chunks' blocks `[lo, hi)`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<[usize; 2]>,
    /// Micro-batches whose activations the schedule lets it hold at once
    /// (with virtual stages, micro-batches of one chunk each).
    pub in_flight: usize,
    pub peak_bytes: PeakBytes,
    pub peak_breakdown: ByCategory,
}

#[derive(Clone, Debug, Serialize)]
pub struct ErrorRecord {
    pub kind: &'static str,
    /// The rank that ran out of memory (`null` for a single rank).
    pub rank: Option<usize>,
    pub message: String,
    pub phase: String,
    pub category: Category,
    pub requested: u64,
    pub capacity: u64,
    pub live: ByCategory,
}

impl ErrorRecord {
    pub fn new(e: &OomError, world: usize, rank: usize) -> Self {
        ErrorRecord {
            kind: "oom",
            rank: (world > 1).then_some(rank),
            message: if world > 1 {
                format!("rank {rank}: {e}")
            } else {
                e.to_string()
            },
            phase: e.phase.to_string(),
            category: e.category,
            requested: e.requested,
            capacity: e.capacity,
            live: e.live,
        }
    }
}

/// The document `memfit run --format json` prints.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    pub model: String,
    pub family: crate::config::Family,
    /// Unpadded, comparable with published counts.
    pub num_parameters: u64,
    pub config: RunConfigRecord,
    pub device: String,
    /// `--device meta:GPU`: the GPU profile predicted for (its memory less
    /// its runtime overhead is `capacity_bytes`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<TargetRecord>,
    pub capacity_bytes: Option<u64>,
    /// Whose allocations the peaks are (`config.framework` in words):
    /// `memfit engine`, or `hf-eager (PyTorch eager + transformers)`.
    pub allocation_profile: String,
    pub steps: Vec<StepRecord>,
    /// Tokens per step over the median step time after the warm-up step;
    /// `None` on meta.
    pub tokens_per_s: Option<f64>,
    pub tokens_per_step: usize,
    pub flops_per_step: u128,
    pub bytes_moved_per_step: u128,
    /// Each category's own highest live bytes; `total` is the highest sum at any moment.
    pub peak_bytes: PeakBytes,
    /// The per-category split at the moment of the total peak.
    pub peak_breakdown: ByCategory,
    /// One entry per rank; the top-level peaks are the maximum over them.
    pub ranks: Vec<RankRecord>,
    /// Pipelines only: one entry per stage, the highest of its replicas.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<StageRecord>,
    /// Rank 0's highest live bytes per phase, when asked for.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub phase_peaks: Vec<crate::memory::PhasePeak>,
    /// Optimizer steps skipped because the gradient was not finite.
    pub skipped_steps: u64,
    /// fp16: the final dynamic loss scale; `null` for fp32 and bf16.
    pub loss_scale: Option<f32>,
    pub error: Option<ErrorRecord>,
    /// On a GPU: what it is, and the device memory its driver, context,
    /// kernels and libraries hold (measured at start-up, before any tensor).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuRecord>,
    /// hf-eager on (or predicting) a GPU: PyTorch's caching allocator over
    /// rank 0's tensors (`crate::caching`), as `torch.cuda` names its peaks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocator: Option<crate::plan::AllocatorPeaks>,
    /// Offload only: host memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<HostRecord>,
    /// A paged optimizer only: its unified memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paged: Option<PagedRecord>,
}

/// The GPU profile a `--device meta:GPU` run predicts.
#[derive(Clone, Debug, Serialize)]
pub struct TargetRecord {
    pub name: String,
    pub display_name: String,
    pub memory_bytes: u64,
    pub runtime_overhead_bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct GpuRecord {
    pub description: String,
    pub total_bytes: u64,
    pub overhead_bytes: u64,
}

/// The top-level peaks (the maximum over `report.ranks`; the breakdown is
/// the fullest rank's) and the per-stage records, from the rank records.
pub fn summarise_ranks(report: &mut RunReport) {
    let mut top = PeakBytes::default();
    for r in &report.ranks {
        for c in Category::ALL {
            top.set(c, top.get(c).max(r.peak_bytes.get(c)));
        }
        top.total = top.total.max(r.peak_bytes.total);
    }
    report.peak_bytes = top;
    if let Some(fullest) = report.ranks.iter().max_by_key(|r| r.peak_bytes.total) {
        report.peak_breakdown = fullest.peak_breakdown;
    }
    let t = &report.config.train;
    let mut per_stage: Vec<StageRecord> = Vec::new();
    for r in &report.ranks {
        let (Some(stage), Some(layers)) = (r.stage, r.layers) else {
            continue;
        };
        if per_stage.len() <= stage {
            per_stage.push(StageRecord {
                stage,
                layers,
                chunks: r.chunks.clone(),
                in_flight: t.schedule.in_flight(
                    stage,
                    t.pipeline_stages,
                    t.virtual_stages,
                    t.grad_accum,
                ),
                peak_bytes: r.peak_bytes,
                peak_breakdown: r.peak_breakdown,
            });
        } else if r.peak_bytes.total > per_stage[stage].peak_bytes.total {
            per_stage[stage].peak_bytes = r.peak_bytes;
            per_stage[stage].peak_breakdown = r.peak_breakdown;
        }
    }
    report.stages = per_stage;
}

/// The human-readable report.
impl super::Report for RunReport {
    fn table(&self) -> String {
        render_table(self)
    }
}

pub fn render_table(r: &RunReport) -> String {
    let mut s = String::new();
    write_setup(&mut s, r);
    write_knobs(&mut s, r);
    write_steps(&mut s, r);
    write_peaks(&mut s, r);
    write_host(&mut s, r);
    if let Some(p) = &r.paged {
        let _ = writeln!(
            s,
            "\n{}:\n  {:<12} {:>12} per rank (not in the peaks above)",
            p.memory,
            "optimizer",
            fmt_bytes(p.peak_bytes)
        );
    }
    write_ranks(&mut s, r);
    if let Some(e) = &r.error {
        let _ = writeln!(s, "\nerror: {}", e.message);
    }
    s
}

/// What ran where: the model, device and knobs, whose allocations, and the
/// target a meta run predicts.
fn write_setup(s: &mut String, r: &RunReport) {
    let c = &r.config;
    let t = &c.train;
    let _ = writeln!(
        s,
        "{} ({} parameters) on {}: micro-batch {} x seq-len {} x grad-accum {}, {}, {}, checkpointing {}, {} attention{}",
        r.model,
        r.num_parameters,
        match &r.target {
            Some(t) => format!("meta predicting {} ({})", t.name, t.display_name),
            None => r.device.clone(),
        },
        c.train.micro_batch,
        c.train.seq_len,
        c.train.grad_accum,
        crate::plan::name(c.train.precision),
        crate::plan::name(c.train.optimizer),
        match c.train.checkpoint_every {
            1 => crate::plan::name(c.train.checkpointing),
            n => format!(
                "{} every {n} blocks",
                crate::plan::name(c.train.checkpointing)
            ),
        },
        crate::plan::name(c.train.attention),
        c.threads
            .map_or(String::new(), |t| format!(", {t} threads")),
    );
    // Plans and `memfit watch` predict hf-eager by default, run the
    // engine's own schedule: say whose allocations these are, and how to
    // get the other.
    let _ = writeln!(
        s,
        "allocation profile: {}; {}",
        r.allocation_profile,
        match t.framework {
            Framework::Memfit =>
                "--framework hf-eager gives PyTorch eager + transformers, which plan and watch predict by default",
            Framework::HfEager => "--framework memfit gives memfit's engine",
        }
    );
    if let Some(tg) = &r.target {
        let _ = writeln!(
            s,
            "target: {}, {} of which {} runtime overhead (CUDA context, libraries), so {} for tensors; meta emulates the cuda backend",
            tg.display_name,
            fmt_bytes(tg.memory_bytes),
            fmt_bytes(tg.runtime_overhead_bytes),
            fmt_bytes(tg.memory_bytes.saturating_sub(tg.runtime_overhead_bytes))
        );
    }
}

/// The fine-tuning, loss and allocator lines, where they apply.
fn write_knobs(s: &mut String, r: &RunReport) {
    let t = &r.config.train;
    if t.finetune != Finetune::Full {
        let targets = match t.lora.targets.is_empty() {
            true => "every projection".to_string(),
            false => t
                .lora
                .targets
                .iter()
                .map(|x| crate::plan::name(*x))
                .collect::<Vec<_>>()
                .join(","),
        };
        let _ = writeln!(
            s,
            "{} r={} alpha={} on {targets}",
            crate::plan::name(t.finetune),
            t.lora.rank,
            t.lora.alpha
        );
    }
    match t.loss {
        crate::engine::Loss::Full => {}
        crate::engine::Loss::Chunked => {
            let _ = writeln!(
                s,
                "loss: chunked, the sequence in {} parts (torchtune's LinearCrossEntropyLoss{})",
                t.loss_chunks,
                match t.compile_loss {
                    true => ", each compiled by torch.compile",
                    false => "",
                }
            );
        }
        crate::engine::Loss::FusedLinear => {
            let _ = writeln!(
                s,
                "loss: fused-linear, the logits a chunk of tokens at a time (Liger's fused linear cross-entropy)"
            );
        }
        crate::engine::Loss::MegatronUnfused => {
            let _ = writeln!(
                s,
                "loss: megatron-unfused, the whole logits copied to fp32 and the softmax formed over the copy in unfused passes (Megatron-Core's vocab_parallel_cross_entropy, no --cross-entropy-loss-fusion)"
            );
        }
    }
    if let Some(a) = r.allocator {
        let _ = writeln!(
            s,
            "PyTorch's caching allocator over these tensors: max_memory_allocated {}, max_memory_reserved {}",
            fmt_bytes(a.max_memory_allocated),
            fmt_bytes(a.max_memory_reserved)
        );
    }
}

/// Each step's loss and speed, skipped steps, throughput, work and the GPU.
fn write_steps(s: &mut String, r: &RunReport) {
    if !r.steps.is_empty() {
        let _ = writeln!(
            s,
            "\n{:>5} {:>9} {:>9} {:>10} {:>10}",
            "step", "loss", "gnorm", "ms", "tokens/s"
        );
        for st in &r.steps {
            let tps = r.tokens_per_step as f64 / (st.ms / 1e3);
            let _ = writeln!(
                s,
                "{:>5} {:>9.4} {:>9} {:>10.1} {:>10.0}{}",
                st.step,
                st.loss,
                st.grad_norm.map_or("-".into(), |g| format!("{g:.4}")),
                st.ms,
                tps,
                if st.skipped { "  skipped" } else { "" }
            );
        }
    }
    if r.skipped_steps > 0 || r.loss_scale.is_some() {
        let _ = writeln!(
            s,
            "\nskipped steps (non-finite gradient): {}{}",
            r.skipped_steps,
            r.loss_scale
                .map_or(String::new(), |l| format!(", final loss scale {l}"))
        );
    }
    if let Some(tps) = r.tokens_per_s {
        let _ = writeln!(
            s,
            "\nthroughput: {tps:.0} tokens/s (mean after the first step)"
        );
    }
    let _ = writeln!(
        s,
        "work per step: {:.3} GFLOP, {} moved",
        r.flops_per_step as f64 / 1e9,
        fmt_bytes(u64::try_from(r.bytes_moved_per_step).unwrap_or(u64::MAX))
    );
    if let Some(g) = &r.gpu {
        let _ = writeln!(
            s,
            "gpu: {}; {} held before any tensor (driver, context, kernels, cuBLAS and its workspace)",
            g.description,
            fmt_bytes(g.overhead_bytes)
        );
    }
}

/// The peak per category, on the fullest rank.
fn write_peaks(s: &mut String, r: &RunReport) {
    let c = &r.config;
    let n = r.ranks.len();
    let _ = writeln!(
        s,
        "\npeak memory{}{}:",
        if n > 1 {
            let t = &c.train;
            let schedule = match t.virtual_stages {
                1 => t.schedule.name().to_string(),
                v => format!("interleaved {} of {v} chunks each", t.schedule.name()),
            };
            let layout = match (t.pipeline_stages > 1, t.data_ranks() > 1) {
                (false, _) => crate::plan::name(t.sharding),
                (true, false) => format!("{} pipeline stages, {schedule}", t.pipeline_stages),
                (true, true) => format!(
                    "{} pipeline stages, {schedule}, x {} {} replicas",
                    t.pipeline_stages,
                    t.data_ranks(),
                    crate::plan::name(t.sharding)
                ),
            };
            format!(" per rank, highest of {n} ranks ({layout})")
        } else {
            String::new()
        },
        r.capacity_bytes.map_or(String::new(), |c| format!(
            " (capacity {} each)",
            fmt_bytes(c)
        ))
    );
    let _ = writeln!(
        s,
        "  {:<12} {:>12} {:>14}",
        "category", "peak", "at total peak"
    );
    for cat in Category::ALL {
        let (own, at) = (r.peak_bytes.get(cat), r.peak_breakdown.get(cat));
        let _ = writeln!(
            s,
            "  {:<12} {:>12} {:>14}",
            cat.name(),
            fmt_bytes(own),
            fmt_bytes(at)
        );
    }
    let _ = writeln!(s, "  {:<12} {:>12}", "total", fmt_bytes(r.peak_bytes.total));
}

/// Offload: the host memory each rank and the node held.
fn write_host(s: &mut String, r: &RunReport) {
    let (c, n) = (&r.config, r.ranks.len());
    if let Some(h) = &r.host {
        let _ = writeln!(
            s,
            "\nhost memory (offload {}){}:",
            c.train.offload.host_label(c.train.offload_activations),
            h.capacity_bytes.map_or(String::new(), |c| format!(
                " (capacity {} per rank)",
                fmt_bytes(c)
            ))
        );
        for cat in Category::ALL
            .into_iter()
            .filter(|&c| h.peak_bytes.get(c) > 0)
        {
            let _ = writeln!(
                s,
                "  {:<12} {:>12}",
                cat.name(),
                fmt_bytes(h.peak_bytes.get(cat))
            );
        }
        let _ = writeln!(
            s,
            "  {:<12} {:>12} per rank, {} for the node's {n} rank(s) (DeepSpeed's \"per CPU\")",
            "total",
            fmt_bytes(h.peak_bytes.total),
            fmt_bytes(h.node_bytes)
        );
        let _ = writeln!(
            s,
            "  device <-> host: {} per step (rank 0)",
            fmt_bytes(h.link_bytes_per_step)
        );
    }
}

/// Per rank and per pipeline stage, where there are several or NVML saw them.
fn write_ranks(s: &mut String, r: &RunReport) {
    let n = r.ranks.len();
    // Per rank: beside the tracked peak, meta's prediction and NVML's
    // process peak when the run has them.
    let nvml = r.ranks.iter().any(|x| x.nvml_peak_bytes.is_some());
    if n > 1 || nvml {
        let opt = |b: Option<u64>| b.map_or("-".into(), fmt_bytes);
        let _ = writeln!(
            s,
            "\n  {:<6} {:>12} {:>12} {:>12} {:>14} {:>14}",
            "rank", "peak", "predicted", "nvml", "sent/step", "received/step"
        );
        for rr in &r.ranks {
            let _ = writeln!(
                s,
                "  {:<6} {:>12} {:>12} {:>12} {:>14} {:>14}",
                rr.rank,
                fmt_bytes(rr.peak_bytes.total),
                opt(rr.predicted_peak_bytes),
                opt(rr.nvml_peak_bytes),
                fmt_bytes(rr.sent_bytes_per_step),
                fmt_bytes(rr.received_bytes_per_step)
            );
        }
        let t = &r.config.train;
        if t.expert_parallel > 1 && t.capacity_factor.is_none() && !r.device.starts_with("meta") {
            let _ = writeln!(
                s,
                "  (dropless expert parallelism: each rank's peak follows the tokens it received; predicted assumes an even spread)"
            );
        }
    }
    if !r.stages.is_empty() {
        // With virtual stages a stage's blocks are its chunks', in order.
        let blocks = |st: &StageRecord| match st.chunks.is_empty() {
            true => format!("{}:{}", st.layers[0], st.layers[1]),
            false => (st.chunks.iter().map(|c| format!("{}:{}", c[0], c[1])))
                .collect::<Vec<_>>()
                .join(","),
        };
        let w = (r.stages.iter())
            .map(|st| blocks(st).len())
            .fold(8, usize::max);
        let _ = writeln!(
            s,
            "\n  {:<6} {:>w$} {:>10} {:>12} {:>12}",
            "stage", "blocks", "in flight", "peak", "activations"
        );
        for st in &r.stages {
            let _ = writeln!(
                s,
                "  {:<6} {:>w$} {:>10} {:>12} {:>12}",
                st.stage,
                blocks(st),
                st.in_flight,
                fmt_bytes(st.peak_bytes.total),
                fmt_bytes(st.peak_bytes.get(Category::Activations))
            );
        }
    }
}
