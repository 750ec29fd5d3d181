//! `memfit balance`: the best contiguous split of a model's layers into
//! pipeline stages, from what each stage really costs on the engine.
//!
//! The model is a list of `blocks + 2` pipeline layers: the embedding, each
//! block, the head. A stage holding layers `i..j` as stage `s` is priced by
//! running it: one meta engine for that stage alone, with the schedule's
//! micro-batches, gives its peak byte for byte (meta equals cpu, and a
//! stage's allocations do not depend on the other stages). Time is the sum
//! of the layers' forward + backward times, measured on cpu or priced by the
//! roofline on meta. Both costs only grow when a stage takes one more layer
//! or moves earlier (an earlier stage holds at least as many micro-batches),
//! so a greedy fill under a bound is exact and a binary search on the bound
//! finds the optimum ([`crate::balance::min_bottleneck`]).

use std::cell::RefCell;
use std::collections::HashMap;
use std::ops::Range;

use serde::Serialize;

use crate::backend::meta::MetaBackend;
use crate::backend::{DeviceKind, DeviceSpec};
use crate::balance::{block_partition, min_bottleneck};
use crate::config::ModelConfig;
use crate::config::hardware::HardwareProfile;
use crate::config::profile::load_model;
use crate::data::DataSource;
use crate::engine::pipeline::uniform_balance;
use crate::engine::{Engine, Schedule, TrainConfig};
use crate::error::{Error, Result};
use crate::knobs::Knobs;
use crate::memory::{Category, PeakBytes, Phase};
use crate::run::{RunOptions, validate};
use crate::units::fmt_bytes;

/// What the partition minimises.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum By {
    /// The largest stage peak.
    #[default]
    Memory,
    /// The slowest stage, every stage within the capacity.
    Time,
}

/// Where the layers are timed.
#[derive(Clone, Debug)]
pub enum Target {
    /// Timed on this machine's cpu; `limit` is the capacity, if any.
    Cpu { limit: Option<u64> },
    /// Priced by the roofline of a GPU profile, whose memory (less the
    /// runtime overhead) is the capacity.
    Gpu(Box<HardwareProfile>),
    /// Timed on this machine's GPU `ordinal`; `limit` is the capacity, if any.
    Cuda {
        limit: Option<u64>,
        ordinal: Option<usize>,
    },
}

impl Target {
    /// The target of `--device` as `memfit run` resolves it: `cpu`,
    /// `cpu:limit=SIZE`, `cuda[:N]` or `meta:GPU` (a hardware profile);
    /// bare meta times nothing.
    fn of(run: &RunOptions) -> Result<Self> {
        if let Some(hw) = &run.target {
            return Ok(Target::Gpu(Box::new(hw.clone())));
        }
        let spec = &run.device;
        match spec.kind {
            DeviceKind::Cpu => Ok(Target::Cpu { limit: spec.limit }),
            DeviceKind::Cuda => Ok(Target::Cuda {
                limit: spec.limit,
                ordinal: spec.ordinal,
            }),
            DeviceKind::Meta => Err(Error::invalid_arg(
                "--device",
                format!(
                    "`{spec}`: balance runs on cpu or cuda[:N], or predicts for a GPU with meta:NAME (see `memfit profiles`)"
                ),
            )),
        }
    }

    /// The device the stages' knobs are checked against: the one the
    /// layers are timed on (a GPU profile is priced on meta).
    fn check_device(&self) -> DeviceSpec {
        match self {
            Target::Gpu(_) => DeviceSpec::new(DeviceKind::Meta, None),
            _ => self.run_device(),
        }
    }

    fn capacity(&self) -> Option<u64> {
        match self {
            Target::Cpu { limit } | Target::Cuda { limit, .. } => *limit,
            Target::Gpu(hw) => Some(hw.memory.saturating_sub(hw.runtime_overhead)),
        }
    }

    fn describe(&self) -> String {
        match self {
            Target::Cpu { .. } => "cpu".into(),
            Target::Gpu(hw) => format!("meta:{}", hw.name),
            Target::Cuda { ordinal, .. } => match ordinal {
                Some(o) => format!("cuda:{o}"),
                None => "cuda".into(),
            },
        }
    }

    /// The meta backend that predicts this target's backend, byte for byte.
    fn meta(&self) -> MetaBackend {
        match self {
            Target::Cpu { .. } => MetaBackend::emulating_cpu(),
            Target::Gpu(_) | Target::Cuda { .. } => MetaBackend::emulating_cuda(),
        }
    }

    /// Where `--verify` runs the split: this target's device (a GPU profile
    /// is verified on cpu).
    fn run_device(&self) -> DeviceSpec {
        match self {
            Target::Cuda { ordinal, .. } => DeviceSpec {
                kind: DeviceKind::Cuda,
                limit: None,
                ordinal: *ordinal,
            },
            _ => DeviceSpec::new(DeviceKind::Cpu, None),
        }
    }
}

/// The `memfit run` knobs balance cannot honour, and why: it prices one
/// rank per pipeline stage, one step, without data or tensor parallelism
/// or ZeRO, in bytes and seconds that no optimizer value changes.
/// `--ranks` equal to the stages, `--sharding none`, `--offload none`,
/// `--tensor-parallel 1`, `--shard-group 0`, `--hpz-group 0` and
/// `--bucket-view`/`--sequence-parallel false` say what balance does, and
/// pass.
pub const REFUSED: &[(&str, &str)] = &[
    (
        "seed",
        "weights' and tokens' values, and balance reports bytes and seconds, which no value changes",
    ),
    (
        "lr",
        "a value, not a byte or a second, and balance reports bytes and seconds",
    ),
    (
        "weight_decay",
        "a value, not a byte or a second, and balance reports bytes and seconds",
    ),
    (
        "beta2",
        "a value, not a byte or a second, and balance reports bytes and seconds",
    ),
    (
        "momentum",
        "a value, not a byte or a second (SGD's buffer is held either way), and balance reports bytes and seconds",
    ),
    (
        "grad_clip",
        "a value, not a byte or a second, and balance reports bytes and seconds",
    ),
    (
        "steps",
        "balance prices one step of each stage, and times each layer over --repeats steps",
    ),
    (
        "data",
        "balance prices stages on meta, which reads no tokens, and times layers on synthetic ones",
    ),
    ("threads", "balance times the layers on every core"),
    (
        "partition",
        "balance finds the partition, and prints it for `memfit run --partition`",
    ),
    (
        "ranks",
        "balance prices one rank per stage (--ranks equal to --stages), with no data-parallel replicas",
    ),
    (
        "sharding",
        "balance prices one rank per stage, with no data-parallel replicas to shard over",
    ),
    (
        "bucket_view",
        "DDP's, and balance prices one rank per stage, with no data-parallel replicas",
    ),
    (
        "offload",
        "ZeRO-Offload's, and balance prices stages without ZeRO",
    ),
    (
        "host_memory",
        "offloaded tensors', and balance prices stages without ZeRO-Offload",
    ),
    (
        "shard_group",
        "hybrid sharding's, and balance prices stages without ZeRO",
    ),
    (
        "hpz_group",
        "ZeRO++'s, and balance prices stages without ZeRO",
    ),
    (
        "tensor_parallel",
        "balance prices whole stages, with no tensor-parallel groups",
    ),
    (
        "expert_parallel",
        "balance prices one rank per stage, and expert parallelism splits the experts over data-parallel replicas",
    ),
    (
        "sequence_parallel",
        "tensor parallelism's, and balance prices whole stages, with no tensor-parallel groups",
    ),
    (
        "virtual_stages",
        "balance splits the layers into one contiguous run per stage, and interleaving gives each stage several model chunks (for those, run `memfit run --virtual-stages V --partition` with one range per chunk)",
    ),
];

/// balance's micro-batch unless `--micro-batch` is given (run's is 4).
pub const DEFAULT_MICRO_BATCH: usize = 1;

impl BalanceOptions {
    /// balance's options from its knobs, resolved as `memfit run` resolves
    /// them (`run::options::resolve`), with balance's own micro-batch
    /// default; a knob in [`REFUSED`] is refused, naming its flag.
    pub fn from_knobs(knobs: &Knobs, by: By, repeats: usize, verify: bool) -> Result<Self> {
        let mut k = knobs.clone();
        k.micro_batch.get_or_insert(DEFAULT_MICRO_BATCH);
        let stages = k.pipeline_stages.unwrap_or(1);
        // Spelling out what balance does anyway is no refusal.
        let says_what_balance_does = |name: &str| match name {
            "ranks" => k.ranks == Some(stages),
            "sharding" => k.sharding == Some(crate::engine::Sharding::None),
            "offload" => k.offload == Some(crate::engine::Offload::None),
            "tensor_parallel" => k.tensor_parallel == Some(1),
            "expert_parallel" => k.expert_parallel == Some(1),
            "shard_group" => k.shard_group == Some(0),
            "hpz_group" => k.hpz_group == Some(0),
            "bucket_view" => k.bucket_view == Some(false),
            "sequence_parallel" => k.sequence_parallel == Some(false),
            "virtual_stages" => k.virtual_stages == Some(1),
            _ => false,
        };
        if let Some((name, why)) =
            (REFUSED.iter()).find(|(name, _)| k.has(name) && !says_what_balance_does(name))
        {
            return Err(Error::invalid_arg(
                &format!("--{}", name.replace('_', "-")),
                format!(
                    "`memfit balance` cannot honour it: {why}; leave it out, or use `memfit run` or `memfit plan`"
                ),
            ));
        }
        let run = crate::run::options::resolve(None, &k, None).map_err(balance_flags)?;
        Ok(BalanceOptions {
            target: Target::of(&run)?,
            model: run.model,
            train: run.train,
            by,
            repeats,
            verify,
        })
    }
}

/// An error naming `memfit run`'s spelling of a flag, in balance's.
fn balance_flags(e: Error) -> Error {
    match e {
        Error::InvalidArg { flag, message } => Error::InvalidArg {
            flag: match flag.as_str() {
                "--pipeline-stages" => "--stages".into(),
                "--grad-accum" => "--microbatches".into(),
                _ => flag,
            },
            message,
        },
        e => e,
    }
}

pub struct BalanceOptions {
    pub model: String,
    /// Knobs; `pipeline_stages`, `grad_accum` (the micro-batches) and
    /// `schedule` describe the pipeline, `ranks` equals the stages.
    pub train: TrainConfig,
    pub by: By,
    pub target: Target,
    /// cpu timing: steps timed after one warm-up; each layer's median counts.
    pub repeats: usize,
    pub verify: bool,
}

/// One pipeline layer's costs, each measured with the layer alone.
#[derive(Clone, Debug, Serialize)]
pub struct LayerRecord {
    pub name: String,
    /// Weights, gradients and optimizer state (a tied head includes its
    /// copy of the embedding).
    pub weight_bytes: u64,
    /// Activations and receive buffers at their peak, one micro-batch.
    pub activation_bytes: u64,
    /// Forward + backward (+ recomputation) of one micro-batch.
    pub secs: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct StageRecord {
    pub stage: usize,
    /// Blocks `[lo, hi)`: the first stage also holds the embedding, the last the head.
    pub layers: [usize; 2],
    pub peak_bytes: PeakBytes,
    /// Forward + backward of one micro-batch through the stage.
    pub secs_per_micro_batch: f64,
    pub fits: bool,
}

/// A partition, in the forms a user pastes.
#[derive(Clone, Debug, Serialize)]
pub struct PartitionRecord {
    /// fairscale's `Pipe(balance=[...])` over `nn.Sequential(embedding, *blocks, head)`.
    pub balance: Vec<usize>,
    /// Stage boundaries over those layers.
    pub boundaries: Vec<usize>,
    /// Blocks per stage, as `memfit run --partition` takes them.
    pub partition: String,
    pub stages: Vec<StageRecord>,
    pub max_peak_bytes: u64,
    pub max_stage_secs: f64,
    /// `(K + S - 1) x` the slowest stage: a flushed pipeline's step, bubble included.
    pub step_secs: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct VerifyRecord {
    pub stage: usize,
    pub predicted_bytes: u64,
    pub measured_bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct BalanceReport {
    pub model: String,
    pub stages: usize,
    pub microbatches: usize,
    pub schedule: Schedule,
    pub micro_batch: usize,
    pub seq_len: usize,
    pub by: By,
    pub device: String,
    pub capacity_bytes: Option<u64>,
    /// The knobs the stages were priced with.
    pub config: TrainConfig,
    /// Whether the layer times were measured (on cpu, a model too big for
    /// the host is not timed; its times are 0).
    pub timed: bool,
    pub layers: Vec<LayerRecord>,
    pub optimal: PartitionRecord,
    pub uniform: PartitionRecord,
    /// fairscale's balance_by_size / balance_by_time heuristic (Bárány and
    /// Grinberg's block partition) over the layer sizes or times; `null`
    /// where the heuristic leaves a stage empty or never settles.
    pub fairscale: Option<PartitionRecord>,
    /// How much smaller the optimal bottleneck (peak or time) is, in percent.
    pub improvement_vs_uniform_pct: f64,
    pub improvement_vs_fairscale_pct: Option<f64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub verify: Vec<VerifyRecord>,
}

/// Blocks a stage holding pipeline layers `i..j` of `n` runs.
pub fn blocks_of(i: usize, j: usize, n: usize) -> Range<usize> {
    let blocks = n - 2;
    i.saturating_sub(1).min(blocks)..j.saturating_sub(1).min(blocks)
}

/// Stage `s` of `train.pipeline_stages`, holding `blocks`, alone on meta:
/// its peak over one step of the schedule.
pub fn stage_peak(
    model: &ModelConfig,
    train: &TrainConfig,
    s: usize,
    blocks: Range<usize>,
    meta: &MetaBackend,
) -> PeakBytes {
    let one = TrainConfig {
        ranks: train.pipeline_stages,
        partition: None,
        ..train.clone()
    };
    // Stage s as a pipeline run wires it, holding `blocks`.
    let mut link = crate::engine::cluster::meta_links(model, &one).swap_remove(s);
    if let Some(p) = &mut link.pipe {
        p.chunks = vec![blocks];
    }
    let mut e = Engine::new_linked(model.clone(), one, meta.clone(), None, link)
        .unwrap_or_else(|oom| unreachable!("meta has no capacity: {oom}"));
    e.step_from(train.grad_accum, || unreachable!("meta reads no data"))
        .unwrap_or_else(|oom| unreachable!("meta has no capacity: {oom}"));
    e.dev.tracker.peak_bytes()
}

/// Each pipeline layer's forward + backward time for one micro-batch.
fn layer_times(
    model: &ModelConfig,
    train: &TrainConfig,
    target: &Target,
    repeats: usize,
) -> Result<Vec<f64>> {
    let one = TrainConfig {
        grad_accum: 1,
        ranks: 1,
        pipeline_stages: 1,
        partition: None,
        ..train.clone()
    };
    let per_layer = |secs: &HashMap<Phase, f64>| -> Vec<f64> {
        let at = |p: Phase| secs.get(&p).copied().unwrap_or(0.0);
        let mut out = vec![at(Phase::ForwardEmbed) + at(Phase::BackwardEmbed)];
        out.extend(
            (0..model.n_layer)
                .map(|l| at(Phase::Forward(l)) + at(Phase::Recompute(l)) + at(Phase::Backward(l))),
        );
        out.push(at(Phase::ForwardHead) + at(Phase::BackwardHead));
        out
    };
    match target {
        Target::Gpu(hw) => {
            let mut e = Engine::new(model.clone(), one, target.meta(), None)
                .unwrap_or_else(|oom| unreachable!("meta has no capacity: {oom}"));
            e.dev.meter.roofline = Some(crate::plan::roofline(hw, train.precision));
            e.dev.meter.phase_secs = Some(HashMap::new());
            e.step_from(1, || unreachable!("meta reads no data"))
                .unwrap_or_else(|oom| unreachable!("meta has no capacity: {oom}"));
            Ok(per_layer(
                e.dev.meter.phase_secs.as_ref().expect("recorded"),
            ))
        }
        Target::Cpu { .. } => {
            let be = crate::backend::cpu::CpuBackend::new(
                std::thread::available_parallelism().map_or(1, |n| n.get()),
            )
            .map_err(Error::Unavailable)?;
            // Within the host's memory, as `memfit run` trains: a model too
            // big is a typed OOM, not an abort. (`cpu:limit` is a stage's
            // capacity; the whole model is timed here, so it does not apply.)
            time_layers(
                model,
                &one,
                be,
                crate::sys::mem_available(),
                repeats,
                per_layer,
            )
        }
        Target::Cuda { ordinal, .. } => {
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let be = crate::backend::cuda::open(ordinal.unwrap_or(0), threads)
                .map_err(Error::Unavailable)?;
            let free = crate::run::device_free_after_startup(std::slice::from_ref(&be));
            time_layers(model, &one, be, Some(free), repeats, per_layer)
        }
    }
}

/// Times each pipeline layer of `one` on backend `be`: one warm-up step, then
/// `repeats` timed ones, the median per layer.
fn time_layers<B: crate::backend::Backend>(
    model: &ModelConfig,
    one: &TrainConfig,
    be: B,
    limit: Option<u64>,
    repeats: usize,
    per_layer: impl Fn(&HashMap<Phase, f64>) -> Vec<f64>,
) -> Result<Vec<f64>> {
    let mut e = Engine::new(model.clone(), one.clone(), be, limit)?;
    let mut data = DataSource::synthetic(model.vocab_size, one.seed);
    let mut runs: Vec<Vec<f64>> = Vec::new();
    for r in 0..=repeats {
        e.dev.meter.phase_secs = Some(HashMap::new());
        e.step_from(1, || data.next_batch(one.micro_batch, one.seq_len))?;
        if r > 0 {
            runs.push(per_layer(
                e.dev.meter.phase_secs.as_ref().expect("recorded"),
            ));
        }
    }
    Ok((0..model.n_layer + 2)
        .map(|k| {
            let mut v: Vec<f64> = runs.iter().map(|r| r[k]).collect();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        })
        .collect())
}

/// The most micro-batches per step `memfit balance` prices (`--microbatches`).
pub const MAX_MICROBATCHES: usize = 4096;

/// Runs `memfit balance`.
pub fn balance(opts: &BalanceOptions) -> Result<BalanceReport> {
    let model = load_model(&opts.model)?;
    check_options(opts, &model)?;
    let t = &opts.train;
    let (stages, k) = (t.pipeline_stages, t.grad_accum);
    let n = model.n_layer + 2;
    let capacity = opts.target.capacity();
    // A model too big to train on this host cannot be timed here: by
    // memory, the split does not need the times; by time, it does.
    let (times, timed) = match layer_times(&model, t, &opts.target, opts.repeats) {
        Ok(times) => (times, true),
        Err(Error::Oom(_)) if opts.by == By::Memory => (vec![0.0; n], false),
        Err(e) => return Err(e),
    };
    let layers = layer_records(opts, &model, &times);
    let search = Search {
        model: &model,
        train: t,
        n,
        stages,
        k,
        capacity,
        meta: opts.target.meta(),
        memo: RefCell::new(HashMap::new()),
        // Time in picoseconds, so the search can bisect integers.
        prefix: std::iter::once(0.0)
            .chain(times.iter().scan(0.0, |acc, x| {
                *acc += x;
                Some(*acc)
            }))
            .collect(),
    };
    let uniform = search.record(search.to_bounds(&uniform_balance(model.n_layer, stages)));
    let sizes: Vec<f64> = match opts.by {
        By::Memory => layers
            .iter()
            .map(|l| (l.weight_bytes + l.activation_bytes) as f64)
            .collect(),
        By::Time => times.clone(),
    };
    let fairscale = block_partition(&sizes, stages).map(|b| search.record(b));
    let optimal = search.record(search.optimal(opts.by, uniform.max_peak_bytes));

    let gain = |base: f64, best: f64| {
        if base > 0.0 {
            100.0 * (base - best) / base
        } else {
            0.0
        }
    };
    let bottleneck = |p: &PartitionRecord| match opts.by {
        By::Memory => p.max_peak_bytes as f64,
        By::Time => p.max_stage_secs,
    };
    let mut report = BalanceReport {
        model: model.name.clone(),
        stages,
        microbatches: k,
        schedule: t.schedule,
        micro_batch: t.micro_batch,
        seq_len: t.seq_len,
        by: opts.by,
        device: opts.target.describe(),
        capacity_bytes: capacity,
        config: t.clone(),
        timed,
        improvement_vs_uniform_pct: gain(bottleneck(&uniform), bottleneck(&optimal)),
        improvement_vs_fairscale_pct: fairscale
            .as_ref()
            .map(|f| gain(bottleneck(f), bottleneck(&optimal))),
        layers,
        optimal,
        uniform,
        fairscale,
        verify: Vec::new(),
    };
    if opts.verify {
        report.verify = verify(opts, &report)?;
    }
    Ok(report)
}

/// balance's flags checked as `memfit run` checks them (named as balance
/// names them), and what only balance refuses.
fn check_options(opts: &BalanceOptions, model: &ModelConfig) -> Result<()> {
    let t = &opts.train;
    let (stages, k) = (t.pipeline_stages, t.grad_accum);
    validate(
        &RunOptions {
            model: opts.model.clone(),
            train: t.clone(),
            steps: 1,
            device: opts.target.check_device(),
            target: None,
            data: None,
            threads: None,
            timeline: None,
            phase_peaks: false,
            timing: None,
        },
        model,
    )
    .map_err(balance_flags)?;
    // Every stage is priced by a meta step of K micro-batches, many times
    // over in the search: K = 2^20 ran for minutes without a word.
    if k > MAX_MICROBATCHES {
        return Err(Error::invalid_arg(
            "--microbatches",
            format!(
                "{k} is more than {MAX_MICROBATCHES}, the most balance prices (each stage's peak is a meta step of every micro-batch); under 1F1B a stage's peak stops growing once K passes the stage count, so a smaller K gives the same partitions"
            ),
        ));
    }
    if stages < 2 {
        return Err(Error::invalid_arg(
            "--stages",
            "a pipeline needs 2 stages or more; one stage holds the whole model (see `memfit run`)",
        ));
    }
    if opts.repeats == 0 {
        return Err(Error::invalid_arg("--repeats", "must be at least 1"));
    }
    Ok(())
}

/// Each layer alone (one stage per layer, one micro-batch): what it holds,
/// and its time (`times`).
fn layer_records(opts: &BalanceOptions, model: &ModelConfig, times: &[f64]) -> Vec<LayerRecord> {
    let n = model.n_layer + 2;
    let alone = TrainConfig {
        pipeline_stages: n,
        ranks: n,
        grad_accum: 1,
        partition: None,
        ..opts.train.clone()
    };
    (0..n)
        .map(|i| {
            let p = stage_peak(
                model,
                &alone,
                i,
                blocks_of(i, i + 1, n),
                &opts.target.meta(),
            );
            let weights = [
                Category::Parameters,
                Category::Gradients,
                Category::Optimizer,
            ];
            LayerRecord {
                name: match i {
                    0 => "embedding".into(),
                    _ if i == n - 1 => "head".into(),
                    _ => format!("block {}", i - 1),
                },
                weight_bytes: weights.iter().map(|&c| p.get(c)).sum(),
                activation_bytes: p.get(Category::Activations) + p.get(Category::Communication),
                secs: times[i],
            }
        })
        .collect()
}

/// The partition search: each stage's exact peak (one meta engine for that
/// stage alone, memoised, since the search asks for some many times) and
/// its time from the layers' (`prefix`: their running sum).
struct Search<'a> {
    model: &'a ModelConfig,
    train: &'a TrainConfig,
    /// Layers: the embedding, the blocks, the head.
    n: usize,
    stages: usize,
    /// Micro-batches per step.
    k: usize,
    capacity: Option<u64>,
    meta: MetaBackend,
    memo: RefCell<HashMap<(usize, usize, usize), PeakBytes>>,
    prefix: Vec<f64>,
}

impl Search<'_> {
    /// Stage `s` holding layers `i..j`.
    fn peak(&self, s: usize, i: usize, j: usize) -> PeakBytes {
        *self.memo.borrow_mut().entry((s, i, j)).or_insert_with(|| {
            stage_peak(
                self.model,
                self.train,
                s,
                blocks_of(i, j, self.n),
                &self.meta,
            )
        })
    }

    /// Seconds per micro-batch of layers `i..j`.
    fn secs(&self, i: usize, j: usize) -> f64 {
        self.prefix[j] - self.prefix[i]
    }

    /// A partition by its layer boundaries, stage by stage.
    fn record(&self, bounds: Vec<usize>) -> PartitionRecord {
        let stages_rec: Vec<StageRecord> = (0..self.stages)
            .map(|s| {
                let (i, j) = (bounds[s], bounds[s + 1]);
                let b = blocks_of(i, j, self.n);
                let p = self.peak(s, i, j);
                StageRecord {
                    stage: s,
                    layers: [b.start, b.end],
                    fits: self.capacity.is_none_or(|c| p.total <= c),
                    peak_bytes: p,
                    secs_per_micro_batch: self.secs(i, j),
                }
            })
            .collect();
        let max_stage_secs = stages_rec
            .iter()
            .map(|s| s.secs_per_micro_batch)
            .fold(0.0, f64::max);
        PartitionRecord {
            balance: bounds.windows(2).map(|w| w[1] - w[0]).collect(),
            partition: stages_rec
                .iter()
                .map(|s| format!("{}:{}", s.layers[0], s.layers[1]))
                .collect::<Vec<_>>()
                .join(","),
            boundaries: bounds,
            max_peak_bytes: stages_rec
                .iter()
                .map(|s| s.peak_bytes.total)
                .max()
                .unwrap_or(0),
            max_stage_secs,
            step_secs: (self.k + self.stages - 1) as f64 * max_stage_secs,
            stages: stages_rec,
        }
    }

    /// Layer boundaries from blocks per stage (the first stage also holds
    /// the embedding, the last the head).
    fn to_bounds(&self, blocks: &[usize]) -> Vec<usize> {
        let mut b = vec![0];
        for (s, c) in blocks.iter().enumerate() {
            let extra = usize::from(s == 0) + usize::from(s + 1 == self.stages);
            b.push(b[s] + c + extra);
        }
        b
    }

    /// The boundaries of the best partition: the smallest largest peak, or
    /// (`By::Time`) the fastest whose stages fit, bounded by the uniform
    /// split's peak `uniform_peak`.
    fn optimal(&self, by: By, uniform_peak: u64) -> Vec<usize> {
        let ps = |x: f64| (x * 1e12).round() as u64;
        let by_memory = || {
            min_bottleneck(
                self.n,
                self.stages,
                uniform_peak,
                &mut |s, i, j| self.peak(s, i, j).total,
                &mut |_, _, _| true,
            )
        };
        let best = match by {
            By::Memory => by_memory(),
            // Where no split fits, the smallest largest peak is the best
            // answer there is; its stages are marked as not fitting.
            By::Time => min_bottleneck(
                self.n,
                self.stages,
                ps(self.prefix[self.n]),
                &mut |_, i, j| ps(self.secs(i, j)),
                &mut |s, i, j| self.capacity.is_none_or(|c| self.peak(s, i, j).total <= c),
            )
            .or_else(by_memory),
        };
        let (_, bounds) =
            best.expect("the uniform split bounds the search, so some split is found");
        bounds
    }
}

/// Runs the optimal partition for real (on the cuda target's GPU, else on
/// cpu), one step, and pairs each
/// stage's measured peak with the prediction.
fn verify(opts: &BalanceOptions, report: &BalanceReport) -> Result<Vec<VerifyRecord>> {
    let blocks: Vec<usize> = report
        .optimal
        .stages
        .iter()
        .map(|s| s.layers[1] - s.layers[0])
        .collect();
    let run_opts = RunOptions {
        model: opts.model.clone(),
        train: TrainConfig {
            partition: Some(blocks),
            ranks: report.stages,
            ..opts.train.clone()
        },
        steps: 1,
        device: opts.target.run_device(),
        target: None,
        data: None,
        threads: None,
        timeline: None,
        phase_peaks: false,
        timing: None,
    };
    let (run, failure) = crate::run::run(&run_opts)?;
    if let Some(e) = failure {
        return Err(e);
    }
    Ok(report
        .optimal
        .stages
        .iter()
        .zip(&run.stages)
        .map(|(p, m)| VerifyRecord {
            stage: p.stage,
            predicted_bytes: p.peak_bytes.total,
            measured_bytes: m.peak_bytes.total,
        })
        .collect())
}

fn secs_str(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.1} µs", s * 1e6)
    }
}

/// The report as a table.
impl crate::report::Report for BalanceReport {
    fn table(&self) -> String {
        render_table(self)
    }
}

pub fn render_table(r: &BalanceReport) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "{} on {} pipeline stages, {} micro-batches of {} x {} tokens, {} schedule; minimising the largest stage {} on {}{}",
        r.model,
        r.stages,
        r.microbatches,
        r.micro_batch,
        r.seq_len,
        r.schedule.name(),
        match r.by {
            By::Memory => "peak",
            By::Time => "time",
        },
        r.device,
        r.capacity_bytes.map_or(String::new(), |c| format!(
            " (capacity {} per stage)",
            fmt_bytes(c)
        )),
    );
    let _ = writeln!(o, "\nlayers (each alone, one micro-batch):");
    let _ = writeln!(
        o,
        "  {:<12} {:>16} {:>14} {:>12}",
        "layer", "weights+grads+opt", "activations", "fwd+bwd"
    );
    for l in &r.layers {
        let _ = writeln!(
            o,
            "  {:<12} {:>16} {:>14} {:>12}",
            l.name,
            fmt_bytes(l.weight_bytes),
            fmt_bytes(l.activation_bytes),
            secs_str(l.secs)
        );
    }
    for (name, p) in [
        ("optimal", Some(&r.optimal)),
        ("uniform", Some(&r.uniform)),
        ("fairscale", r.fairscale.as_ref()),
    ] {
        let Some(p) = p else {
            let _ = writeln!(
                o,
                "\n{name}: the heuristic leaves a stage empty or does not settle on this input"
            );
            continue;
        };
        let _ = writeln!(
            o,
            "\n{name}: balance={:?}  --partition {}",
            p.balance, p.partition
        );
        let _ = writeln!(
            o,
            "  {:<6} {:>8} {:>14} {:>14}",
            "stage", "blocks", "peak", "time/µbatch"
        );
        for s in &p.stages {
            let _ = writeln!(
                o,
                "  {:<6} {:>8} {:>14} {:>14}{}",
                s.stage,
                format!("{}:{}", s.layers[0], s.layers[1]),
                fmt_bytes(s.peak_bytes.total),
                secs_str(s.secs_per_micro_batch),
                if s.fits { "" } else { "  does not fit" }
            );
        }
        let _ = writeln!(
            o,
            "  largest peak {}, slowest stage {}, step {}",
            fmt_bytes(p.max_peak_bytes),
            secs_str(p.max_stage_secs),
            secs_str(p.step_secs)
        );
    }
    let fits = |p: &PartitionRecord| p.stages.iter().all(|s| s.fits);
    let versus = |name: &str, pct: f64, p: &PartitionRecord| {
        let note = if fits(p) { "" } else { " (which does not fit)" };
        format!("{pct:.1}% below {name}{note}")
    };
    let mut line = versus(
        "the uniform split's",
        r.improvement_vs_uniform_pct,
        &r.uniform,
    );
    if let (Some(pct), Some(f)) = (r.improvement_vs_fairscale_pct, &r.fairscale) {
        line = format!("{line} and {}", versus("fairscale's", pct, f));
    }
    let _ = writeln!(o, "\nthe optimal split's bottleneck is {line}");
    if !r.timed {
        let _ = writeln!(
            o,
            "(layer times not measured: the model does not fit this host's memory to be timed)"
        );
    }
    if !r.verify.is_empty() {
        let on = if r.device.starts_with("cuda") {
            r.device.as_str()
        } else {
            "cpu"
        };
        let _ = writeln!(o, "\nverified on {on} (one step of the optimal split):");
        for v in &r.verify {
            let _ = writeln!(
                o,
                "  stage {}: predicted {} B, measured {} B{}",
                v.stage,
                v.predicted_bytes,
                v.measured_bytes,
                if v.predicted_bytes == v.measured_bytes {
                    "  (equal)"
                } else {
                    "  DIFFERS"
                }
            );
        }
    }
    o
}
