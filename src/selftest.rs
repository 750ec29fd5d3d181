//! `memfit selftest --device cuda`: the GPU acceptance test.
//!
//! 1. Every op of the cuda backend against the cpu backend on random inputs
//!    of several shapes (odd sizes included), per-op tolerances
//!    (`backend::cuda::check`).
//! 2. gpt2-tiny and llama-tiny trained on cpu and on cuda, with several knob
//!    combinations (QLoRA's NF4 base among them); every step's loss must
//!    match.
//! 3. The same runs on meta, emulating the cuda backend: the tracked peaks
//!    (total and each category) must equal the cuda run's, byte for byte.
//!
//! It prints a table per part and fails (exit 1) on any mismatch.

use std::fmt::Write as _;

use serde::Serialize;

use crate::backend::cuda::check::{self, Harness, Row};
use crate::backend::cuda::driver::Driver as _;
use crate::backend::meta::MetaBackend;
use crate::backend::{DeviceKind, DeviceSpec};
use crate::engine::{
    Attention, Checkpointing, Finetune, LoraConfig, Offload, Optimizer, Precision, Sharding,
    TrainConfig,
};
use crate::error::{Error, Result};
use crate::report::run::RunReport;
use crate::run::RunOptions;

/// One training comparison.
#[derive(Clone, Debug, Serialize)]
pub struct TrainRow {
    pub model: String,
    pub knobs: String,
    pub steps: usize,
    pub cpu_losses: Vec<f32>,
    pub cuda_losses: Vec<f32>,
    /// Largest `|cuda - cpu|` over the steps, relative to the cpu loss.
    pub max_rel_diff: f64,
    pub tolerance: f64,
    pub pass: bool,
}

/// One meta-vs-cuda peak comparison.
#[derive(Clone, Debug, Serialize)]
pub struct PeakRow {
    pub model: String,
    pub knobs: String,
    pub meta: crate::memory::PeakBytes,
    pub cuda: crate::memory::PeakBytes,
    pub pass: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct OpRow {
    pub op: String,
    pub shape: String,
    pub dtype: String,
    pub max_abs_err: f64,
    pub of_tolerance: f64,
    pub pass: bool,
    pub detail: String,
}

impl From<&Row> for OpRow {
    fn from(r: &Row) -> Self {
        OpRow {
            op: r.op.clone(),
            shape: r.shape.clone(),
            dtype: format!("{:?}", r.dtype).to_lowercase(),
            max_abs_err: r.max_abs,
            of_tolerance: r.worst,
            pass: r.pass,
            detail: r.detail.clone(),
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct SelftestReport {
    pub device: String,
    /// Device memory held by the driver, context, module and handles.
    pub overhead_bytes: u64,
    pub ops: Vec<OpRow>,
    pub training: Vec<TrainRow>,
    pub peaks: Vec<PeakRow>,
    pub pass: bool,
}

/// The knob combinations trained on both backends.
fn trainings() -> Vec<(&'static str, TrainConfig, f64)> {
    let base = TrainConfig {
        seq_len: 32,
        micro_batch: 2,
        seed: 7,
        ..TrainConfig::default()
    };
    vec![
        ("gpt2-tiny", base.clone(), 2e-3),
        (
            "gpt2-tiny",
            TrainConfig {
                precision: Precision::Bf16,
                attention: Attention::Fused,
                optimizer: Optimizer::Adamw8bit,
                ..base.clone()
            },
            3e-2,
        ),
        (
            "llama-tiny",
            TrainConfig {
                attention: Attention::Fused,
                optimizer: Optimizer::Adafactor,
                checkpointing: Checkpointing::Full,
                ..base.clone()
            },
            2e-3,
        ),
        (
            "llama-tiny",
            TrainConfig {
                precision: Precision::Fp16,
                optimizer: Optimizer::Sgd,
                momentum: 0.9,
                grad_accum: 2,
                ..base.clone()
            },
            3e-2,
        ),
        // QLoRA: the NF4 base dequantised on the GPU before every matmul.
        (
            "llama-tiny",
            TrainConfig {
                precision: Precision::Bf16,
                attention: Attention::Fused,
                finetune: Finetune::Qlora,
                lora: LoraConfig {
                    rank: 4,
                    alpha: 8.0,
                    ..LoraConfig::default()
                },
                ..base.clone()
            },
            3e-2,
        ),
        // ZeRO-Offload: master weights, optimizer state and the fp32
        // gradient shards in pinned host memory the kernels address.
        (
            "llama-tiny",
            TrainConfig {
                precision: Precision::Bf16,
                ranks: 2,
                sharding: Sharding::Zero2,
                offload: Offload::Optimizer,
                ..base
            },
            3e-2,
        ),
    ]
}

fn knobs(t: &TrainConfig) -> String {
    let mut k = format!(
        "{:?} {:?} {:?} ckpt={:?} mb={} ga={}",
        t.precision, t.attention, t.optimizer, t.checkpointing, t.micro_batch, t.grad_accum
    );
    if t.finetune != Finetune::Full {
        k += &format!(" {:?}", t.finetune);
    }
    if t.ranks > 1 {
        k += &format!(" ranks={} {:?}", t.ranks, t.sharding);
    }
    if t.offload != Offload::None {
        k += &format!(" offload={}", t.offload.name());
    }
    k.to_lowercase()
}

fn run_opts(model: &str, train: &TrainConfig, steps: usize, device: DeviceSpec) -> RunOptions {
    RunOptions {
        model: model.into(),
        train: train.clone(),
        steps,
        device,
        target: None,
        data: None,
        threads: None,
        timeline: None,
        phase_peaks: false,
        timing: None,
    }
}

fn host_peaks(r: &RunReport) -> Vec<Option<crate::memory::PeakBytes>> {
    r.ranks.iter().map(|k| k.host_peak_bytes).collect()
}

fn finished(what: &str, r: Result<(RunReport, Option<Error>)>) -> Result<RunReport> {
    match r? {
        (report, None) => Ok(report),
        (_, Some(e)) => Err(Error::Unavailable(format!(
            "selftest: the {what} run failed: {e}"
        ))),
    }
}

/// Runs all three parts on `device` (a cuda device), `steps` training steps.
pub fn selftest(device: &DeviceSpec, steps: usize, seed: u64) -> Result<SelftestReport> {
    if device.kind != DeviceKind::Cuda {
        return Err(Error::invalid_arg(
            "--device",
            format!(
                "selftest checks a GPU against the cpu backend; `{device}` is not one (use cuda or cuda:N)"
            ),
        ));
    }
    let ordinal = device.ordinal.unwrap_or(0);
    let threads = crate::calibrate::default_threads();
    let gpu = crate::backend::cuda::open(ordinal, threads).map_err(Error::Unavailable)?;
    let description = gpu.driver().describe();
    let overhead_bytes = gpu.overhead_bytes();
    let mut h = Harness::new(gpu, seed);
    check::all_cases(&mut h);
    let ops: Vec<OpRow> = h.rows.iter().map(OpRow::from).collect();
    drop(h);

    let mut training = Vec::new();
    let mut peaks = Vec::new();
    for (model, train, tol) in trainings() {
        let cpu = finished(
            "cpu",
            crate::run::run(&run_opts(
                model,
                &train,
                steps,
                DeviceSpec::new(DeviceKind::Cpu, None),
            )),
        )?;
        let cuda_opts = run_opts(model, &train, steps, device.clone());
        let cuda = finished("cuda", crate::run::run(&cuda_opts))?;
        let model_cfg = crate::config::profile::load_model(model)?;
        let meta = finished(
            "meta",
            crate::run::run_meta(
                &RunOptions {
                    device: DeviceSpec::new(DeviceKind::Meta, None),
                    target: None,
                    ..cuda_opts.clone()
                },
                model_cfg,
                MetaBackend::emulating_cuda(),
            ),
        )?;
        let cpu_losses: Vec<f32> = cpu.steps.iter().map(|s| s.loss).collect();
        let cuda_losses: Vec<f32> = cuda.steps.iter().map(|s| s.loss).collect();
        let max_rel_diff = if cpu_losses.len() != cuda_losses.len() {
            f64::INFINITY
        } else {
            cpu_losses
                .iter()
                .zip(&cuda_losses)
                .map(|(&c, &g)| {
                    let d = ((g - c) as f64).abs() / (c as f64).abs().max(1e-6);
                    if d.is_nan() { f64::INFINITY } else { d }
                })
                .fold(0.0, f64::max)
        };
        training.push(TrainRow {
            model: model.into(),
            knobs: knobs(&train),
            steps,
            pass: max_rel_diff <= tol && !cpu_losses.is_empty(),
            cpu_losses,
            cuda_losses,
            max_rel_diff,
            tolerance: tol,
        });
        peaks.push(PeakRow {
            model: model.into(),
            knobs: knobs(&train),
            // Offload: each rank's host peaks too.
            pass: meta.peak_bytes == cuda.peak_bytes
                && meta.peak_breakdown == cuda.peak_breakdown
                && host_peaks(&meta) == host_peaks(&cuda),
            meta: meta.peak_bytes,
            cuda: cuda.peak_bytes,
        });
    }
    let pass = ops.iter().all(|r| r.pass)
        && training.iter().all(|r| r.pass)
        && peaks.iter().all(|r| r.pass);
    Ok(SelftestReport {
        device: description,
        overhead_bytes,
        ops,
        training,
        peaks,
        pass,
    })
}

/// The report as tables.
impl crate::report::Report for SelftestReport {
    fn table(&self) -> String {
        render(self)
    }
}

pub fn render(r: &SelftestReport) -> String {
    use crate::units::fmt_bytes;
    let mut s = String::new();
    let _ = writeln!(s, "device    {}", r.device);
    let _ = writeln!(
        s,
        "overhead  {} (driver, context, kernels, cuBLAS handle and workspace, backend scratch)\n",
        fmt_bytes(r.overhead_bytes)
    );
    let rows: Vec<Row> = r
        .ops
        .iter()
        .map(|o| Row {
            op: o.op.clone(),
            shape: o.shape.clone(),
            dtype: match o.dtype.as_str() {
                "bf16" => crate::backend::DType::Bf16,
                "f16" => crate::backend::DType::F16,
                _ => crate::backend::DType::F32,
            },
            max_abs: o.max_abs_err,
            worst: o.of_tolerance,
            pass: o.pass,
            detail: o.detail.clone(),
        })
        .collect();
    s.push_str("ops: cuda against cpu\n");
    s.push_str(&check::table(&rows));
    let _ = writeln!(
        s,
        "\ntraining: cpu and cuda, loss per step\n{:<11} {:<44} {:>5} {:>10} {:>10} {:>10} {:>8}  result",
        "model", "knobs", "steps", "cpu last", "cuda last", "max rel", "tol"
    );
    for t in &r.training {
        let _ = writeln!(
            s,
            "{:<11} {:<44} {:>5} {:>10.5} {:>10.5} {:>10.2e} {:>8.0e}  {}",
            t.model,
            t.knobs,
            t.steps,
            t.cpu_losses.last().copied().unwrap_or(f32::NAN),
            t.cuda_losses.last().copied().unwrap_or(f32::NAN),
            t.max_rel_diff,
            t.tolerance,
            if t.pass { "ok" } else { "FAIL" }
        );
    }
    let _ = writeln!(
        s,
        "\npeaks: meta (emulating cuda) against cuda, tracked bytes\n{:<11} {:<44} {:>14} {:>14}  result",
        "model", "knobs", "meta total", "cuda total"
    );
    for p in &r.peaks {
        let _ = writeln!(
            s,
            "{:<11} {:<44} {:>14} {:>14}  {}",
            p.model,
            p.knobs,
            p.meta.total,
            p.cuda.total,
            if p.pass { "equal" } else { "DIFFER" }
        );
    }
    let failed = r.ops.iter().filter(|o| !o.pass).count()
        + r.training.iter().filter(|t| !t.pass).count()
        + r.peaks.iter().filter(|p| !p.pass).count();
    let _ = writeln!(
        s,
        "\n{}",
        if r.pass {
            format!(
                "selftest passed: {} op cases, {} trainings, {} peak comparisons",
                r.ops.len(),
                r.training.len(),
                r.peaks.len()
            )
        } else {
            format!("selftest FAILED: {failed} mismatches")
        }
    );
    s
}
