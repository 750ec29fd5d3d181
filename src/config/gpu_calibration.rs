//! A GPU's measured roofline, as `memfit calibrate --device cuda` stores it
//! (one JSON file per GPU model in the cache) and as a hardware profile
//! carries it into plans (`HardwareProfile::measured`). Data only: the
//! measuring is `calibrate::gpu`'s, the pricing `plan::roofline`'s.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::knobs::Precision;

/// One GEMM measured: `matmul_forward` of `out[m×n] = inp[m×k] · w[k×n]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemmPoint {
    /// `fp32`, `bf16` or `fp16`.
    pub dtype: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// FLOPs of one call (2·m·n·k, as `engine::ops::Work::matmul` counts).
    pub flops: u64,
    /// Best time of one call.
    pub seconds: f64,
    pub flops_per_s: f64,
    /// What the shape stands for: `square`, `mlp-up`, `mlp-down`, `lora`.
    pub shape: String,
}

/// Fused attention's forward and backward measured together (causal, bf16).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttentionPoint {
    pub seq_len: usize,
    pub batch: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// FLOPs of one forward and backward, as the engine counts them.
    pub flops: u64,
    pub seconds: f64,
    pub flops_per_s: f64,
}

/// Everything one `memfit calibrate --device cuda` measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuCalibration {
    /// The GPU's name, as the driver reports it.
    pub gpu: String,
    /// Its total memory in bytes.
    pub memory: u64,
    /// The hardware profile whose plans use these figures (`--profile`, or
    /// the built-in one the GPU's name and memory match); `None`: no plan
    /// uses them until one is named.
    pub profile: Option<String>,
    pub memfit_version: String,
    /// Seconds since the Unix epoch when it was measured.
    pub measured_unix_s: u64,
    /// How long the measurement took.
    pub elapsed_s: f64,
    /// The largest side of a GEMM and the longest sequence measured
    /// (`--max-dim`, less where the GPU's memory is smaller).
    pub max_dim: usize,
    pub gemm: Vec<GemmPoint>,
    pub attention: Vec<AttentionPoint>,
    /// `add` over buffers far larger than the caches: 3·n·4 bytes a call.
    pub bytes_per_s: f64,
    /// Per kernel: the median over rounds of 100 tiny `add`s queued then
    /// waited for, divided by 100.
    pub op_overhead_s: f64,
    /// Where it was read from (not stored; set when a plan uses it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
}

impl GpuCalibration {
    /// The (FLOPs per call, FLOP/s) points of `precision`'s GEMM curve: the
    /// square and MLP shapes. The LoRA-rank shape is stored and shown but
    /// left out: its time is its bytes' (the roofline's other term), and a
    /// curve by FLOPs would give its rate to squares of the same FLOPs.
    pub fn gemm_curve(&self, precision: Precision) -> Vec<(f64, f64)> {
        let dtype = precision_name(precision);
        (self.gemm.iter())
            .filter(|p| p.dtype == dtype && p.shape != "lora")
            .map(|p| (p.flops as f64, p.flops_per_s))
            .collect()
    }

    /// Fused attention's measured rates as a hardware profile holds
    /// published ones: head dimension -> sequence length -> TFLOP/s (the
    /// best of points measured at the same shape).
    pub fn attention_rates(&self) -> super::attention_kernels::KernelRates {
        let mut rates = super::attention_kernels::KernelRates::new();
        for p in &self.attention {
            let (hd, t) = (p.head_dim as u32, p.seq_len as u32);
            let at = rates.entry(hd).or_default().entry(t).or_insert(0.0);
            *at = f64::max(*at, p.flops_per_s / 1e12);
        }
        rates
    }

    /// Whether every figure is one a GPU can have: finite and positive,
    /// under 1e17 FLOP/s and 1e15 B/s, an op under a second. A file edited
    /// to `1e308` would otherwise make every predicted step time vanish.
    pub fn plausible(&self) -> bool {
        let within = |v: f64, lo: f64, hi: f64| v.is_finite() && (lo..=hi).contains(&v);
        !self.gemm.is_empty()
            && (self.gemm.iter()).all(|p| within(p.flops_per_s, 1.0, 1e17))
            && (self.attention.iter()).all(|p| within(p.flops_per_s, 1.0, 1e17))
            && within(self.bytes_per_s, 1.0, 1e15)
            && within(self.op_overhead_s, 1e-9, 1.0)
    }
}

/// `fp32`, `bf16` or `fp16`: the names a calibration file uses.
pub fn precision_name(p: Precision) -> &'static str {
    match p {
        Precision::Fp32 => "fp32",
        // Pure bf16 runs the same bf16 GEMMs.
        Precision::Bf16 | Precision::Bf16Pure => "bf16",
        Precision::Fp16 => "fp16",
    }
}
