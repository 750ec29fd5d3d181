//! `memfit calibrate`: this host's roofline, measured through the cpu
//! backend's own ops in a few seconds and cached.
//!
//! A sweep on cpu predicts each trial's step time with this roofline (the
//! same per-op model the planner uses for GPUs, `engine::device::Roofline`),
//! so a trial's measured/predicted time ratio checks the time model on the
//! machine that ran it, instead of comparing the host with a GPU.
//!
//! Three figures, each the best of repeated runs (the peak is what a
//! roofline wants; a busy machine only lowers it):
//! - GEMM FLOP/s per precision: `matmul_forward` on square-ish shapes, 2·N·C·OC
//!   FLOPs per call, as `Device::matmul_forward` counts them. 16-bit buffers
//!   go through the backend's widening path, so their rate is the host's
//!   real one for bf16/fp16 training, not a hardware peak.
//! - Memory bandwidth: `add` over buffers far larger than the caches,
//!   3·n·4 bytes per call, as `Device::add` counts them.
//! - Per-op overhead: the median time of an `add` of 256 elements (thread
//!   pool dispatch and call overhead, what bounds tiny models).

pub mod gpu;

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, DType};
use crate::engine::Precision;
use crate::engine::device::Roofline;
use crate::error::{Error, Result};

/// The host's measured roofline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// The CPU's model name (`/proc/cpuinfo`), what the cache is keyed on.
    pub host: String,
    /// cpu backend threads it was measured with.
    pub threads: usize,
    pub fp32_flops_per_s: f64,
    pub bf16_flops_per_s: f64,
    pub fp16_flops_per_s: f64,
    /// The FLOP rate of the other kernels, from causal attention forward and
    /// backward (eager and flash-style) at a small shape, fp32 and 16-bit.
    pub fp32_kernel_flops_per_s: f64,
    pub bf16_kernel_flops_per_s: f64,
    pub bytes_per_s: f64,
    pub op_overhead_s: f64,
    pub memfit_version: String,
    /// Seconds since the Unix epoch when it was measured.
    pub measured_unix_s: u64,
    /// How long the measurement took.
    pub elapsed_s: f64,
}

/// Where a calibration came from.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    Cached(PathBuf),
    Measured,
}

impl Calibration {
    /// Whether every figure is one a host can have: finite, and within
    /// bounds no CPU leaves (1e6..1e17 FLOP/s, 1e6..1e15 B/s, an op
    /// overhead under a second). A cache file edited to `1e308` would
    /// otherwise make every predicted step time vanish.
    pub fn plausible(&self) -> bool {
        let within = |v: f64, lo: f64, hi: f64| v.is_finite() && (lo..=hi).contains(&v);
        [
            self.fp32_flops_per_s,
            self.bf16_flops_per_s,
            self.fp16_flops_per_s,
            self.fp32_kernel_flops_per_s,
            self.bf16_kernel_flops_per_s,
        ]
        .iter()
        .all(|&v| within(v, 1e6, 1e17))
            && within(self.bytes_per_s, 1e6, 1e15)
            && within(self.op_overhead_s, 0.0, 1.0)
    }

    /// The roofline a trial at `precision` runs at on this host.
    pub fn roofline(&self, precision: Precision) -> Roofline {
        Roofline {
            flops_per_s: match precision {
                Precision::Fp32 => self.fp32_flops_per_s,
                Precision::Bf16 | Precision::Bf16Pure => self.bf16_flops_per_s,
                Precision::Fp16 => self.fp16_flops_per_s,
            },
            kernel_flops_per_s: match precision {
                Precision::Fp32 => self.fp32_kernel_flops_per_s,
                Precision::Bf16 | Precision::Fp16 | Precision::Bf16Pure => {
                    self.bf16_kernel_flops_per_s
                }
            },
            bytes_per_s: self.bytes_per_s,
            // The host's norms are the engine's own kernels, which its
            // calibration times.
            norm_share: 1.0,
            op_overhead_s: self.op_overhead_s,
            // Measured on this host's GEMM kernel: no GPU tiles, and the
            // fused attention kernel is one of the kernels measured.
            tiles: None,
            attention_flops_per_s: None,
            attention_table: None,
            gemm_curve: None,
        }
    }

    /// One line for reports and the TUI.
    pub fn summary(&self) -> String {
        format!(
            "{} ({} threads): GEMM {:.1} GFLOP/s fp32, {:.1} bf16, {:.1} fp16; other kernels {:.1} fp32, {:.1} 16-bit; memory {:.1} GB/s; {:.1} µs per op",
            self.host,
            self.threads,
            self.fp32_flops_per_s / 1e9,
            self.bf16_flops_per_s / 1e9,
            self.fp16_flops_per_s / 1e9,
            self.fp32_kernel_flops_per_s / 1e9,
            self.bf16_kernel_flops_per_s / 1e9,
            self.bytes_per_s / 1e9,
            self.op_overhead_s * 1e6
        )
    }
}

/// The CPU's model name, or `unknown cpu`.
pub fn host_name() -> String {
    crate::sys::cpu_model().unwrap_or_else(|| "unknown cpu".into())
}

/// The threads a cpu trial uses when `--threads` is not given.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `$MEMFIT_CACHE_DIR`, else `$XDG_CACHE_HOME/memfit`, else `~/.cache/memfit`.
pub fn cache_dir() -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    env("MEMFIT_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("memfit")))
        .or_else(|| env("HOME").map(|d| d.join(".cache").join("memfit")))
}

fn cache_file(threads: usize) -> Option<PathBuf> {
    cache_dir().map(|d| d.join(format!("calibration-{threads}t.json")))
}

/// Writes `value` as JSON to `path` through a temporary file and a rename
/// (so that a reader never sees half a file); a cache that cannot be
/// written is not an error, the figures are still used.
fn write_atomically(path: &Path, value: &impl Serialize) {
    let _ = path
        .parent()
        .map(std::fs::create_dir_all)
        .transpose()
        .ok()
        .and_then(|_| {
            let tmp = path.with_extension(format!("json.{}", std::process::id()));
            std::fs::write(&tmp, serde_json::to_string_pretty(value).ok()?).ok()?;
            std::fs::rename(&tmp, path).ok()
        });
}

/// Runs `f` until `budget_s` is spent (at least `min_runs` times) and
/// returns every duration in seconds.
fn times(budget_s: f64, min_runs: usize, mut f: impl FnMut()) -> Vec<f64> {
    let start = Instant::now();
    let mut out = Vec::new();
    while out.len() < min_runs || start.elapsed().as_secs_f64() < budget_s {
        let t = Instant::now();
        f();
        out.push(t.elapsed().as_secs_f64());
    }
    out
}

fn best(t: &[f64]) -> f64 {
    t.iter().copied().fold(f64::INFINITY, f64::min)
}

fn gemm_rate(be: &mut CpuBackend, dtype: DType, budget_s: f64) -> f64 {
    let (n, c, oc) = (512, 512, 512);
    let mut inp = be.alloc(n * c, dtype);
    let mut w = be.alloc(oc * c, dtype);
    let mut out = be.alloc(n * oc, dtype);
    be.fill(&mut inp, 0.25);
    be.fill(&mut w, 0.125);
    let t = times(budget_s, 3, || {
        be.matmul_forward(&mut out, &inp, &w, None, n, c, oc)
    });
    for b in [inp, w, out] {
        be.free(b);
    }
    (2 * n * c * oc) as f64 / best(&t)
}

/// The FLOP rate of causal attention forward + backward, eager and
/// flash-style, through `Device` (so FLOPs are counted as the engine counts
/// them), best of repeated rounds.
fn kernel_rate(threads: usize, dtype: DType, budget_s: f64) -> Result<f64> {
    use crate::backend::AttnShape;
    use crate::engine::device::Device;
    use crate::memory::Category;
    let be = CpuBackend::new(threads).map_err(|m| Error::invalid_arg("--threads", m))?;
    let mut dev = Device::new(be, None);
    // A small model's attention: 4 sequences of 128 tokens, 4 heads of 16.
    let s = AttnShape {
        b: 4,
        t: 128,
        n_head: 4,
        n_kv_head: 4,
        head_dim: 16,
    };
    let n = s.b * s.t;
    let att_len = s.b * s.n_head * s.t * s.t;
    let ws_len = dev
        .be
        .workspace_bytes(s, true, dtype)
        .div_ceil(dtype.size());
    let oom = |e: crate::memory::OomError| Error::Unavailable(format!("calibration: {e}"));
    let mut alloc = |len: usize, dt: DType| dev.alloc(len, dt, Category::Temporaries).map_err(oom);
    let (mut qkv, mut dqkv) = (
        alloc(n * s.qkv_width(), dtype)?,
        alloc(n * s.qkv_width(), dtype)?,
    );
    let (mut out, mut dout) = (
        alloc(n * s.n_head * s.head_dim, dtype)?,
        alloc(n * s.n_head * s.head_dim, dtype)?,
    );
    let (mut att, mut datt) = (alloc(att_len, dtype)?, alloc(att_len, dtype)?);
    let mut lse = alloc(s.b * s.n_head * s.t, DType::F32)?;
    let mut ws = alloc(ws_len.max(1), dtype)?;
    dev.fill(&mut qkv, 0.05);
    dev.fill(&mut dout, 0.01);
    let mut best = 0.0f64;
    let start = Instant::now();
    let mut rounds = 0;
    while rounds < 3 || start.elapsed().as_secs_f64() < budget_s {
        dev.meter.cost = Default::default();
        dev.attention_forward(&mut out, &mut att, &qkv, s);
        dev.attention_backward(&mut dqkv, &mut datt, &dout, &qkv, &att, s);
        dev.flash_attention_forward(&mut out, &mut lse, &qkv, &mut ws, s);
        dev.flash_attention_backward(&mut dqkv, &dout, &out, &lse, &qkv, &mut ws, s);
        let ns: u64 = dev.meter.cost.ops.values().map(|c| c.ns).sum();
        best = best.max(dev.meter.cost.flops() as f64 / (ns.max(1) as f64 * 1e-9));
        rounds += 1;
    }
    Ok(best)
}

/// The operands of an `add` of `n` f32 elements, the bandwidth and
/// overhead measurements' kernel: `a` and `x` filled, `out` to write.
fn add_operands<B: Backend>(be: &mut B, n: usize) -> [B::Buf; 3] {
    let mut a = be.alloc(n, DType::F32);
    let mut x = be.alloc(n, DType::F32);
    let out = be.alloc(n, DType::F32);
    be.fill(&mut a, 1.0);
    be.fill(&mut x, 2.0);
    [a, x, out]
}

/// Measures this host's roofline with `threads` cpu threads (about 2 s).
pub fn measure(threads: usize) -> Result<Calibration> {
    let start = Instant::now();
    let mut be = CpuBackend::new(threads).map_err(|m| Error::invalid_arg("--threads", m))?;
    let fp32 = gemm_rate(&mut be, DType::F32, 0.5);
    let bf16 = gemm_rate(&mut be, DType::Bf16, 0.4);
    let fp16 = gemm_rate(&mut be, DType::F16, 0.4);
    let fp32_kernel = kernel_rate(threads, DType::F32, 0.3)?;
    let bf16_kernel = kernel_rate(threads, DType::Bf16, 0.3)?;
    // 3 x 64 MiB: far past any last-level cache.
    let n = 16 << 20;
    let [a, x, mut out] = add_operands(&mut be, n);
    let t = times(0.5, 3, || be.add(&mut out, &a, &x, n));
    let bytes_per_s = (3 * n * 4) as f64 / best(&t);
    for b in [a, x, out] {
        be.free(b);
    }
    let small = 256;
    let [a, x, mut out] = add_operands(&mut be, small);
    let mut t = times(0.2, 200, || be.add(&mut out, &a, &x, small));
    t.sort_by(f64::total_cmp);
    let op_overhead_s = t[t.len() / 2];
    Ok(Calibration {
        host: host_name(),
        threads,
        fp32_flops_per_s: fp32,
        bf16_flops_per_s: bf16,
        fp16_flops_per_s: fp16,
        fp32_kernel_flops_per_s: fp32_kernel,
        bf16_kernel_flops_per_s: bf16_kernel,
        bytes_per_s,
        op_overhead_s,
        memfit_version: env!("CARGO_PKG_VERSION").into(),
        measured_unix_s: crate::units::now_unix_s(),
        elapsed_s: start.elapsed().as_secs_f64(),
    })
}

/// The cached calibration for `threads` on this host and memfit version,
/// else a fresh one (written to the cache when there is one; a cache that
/// cannot be written is not an error, the figures are still used).
pub fn load_or_measure(threads: usize, force: bool) -> Result<(Calibration, Source)> {
    let path = cache_file(threads);
    if !force
        && let Some(p) = &path
        && let Ok(text) = std::fs::read_to_string(p)
        && let Ok(c) = serde_json::from_str::<Calibration>(&text)
        && c.host == host_name()
        && c.threads == threads
        && c.memfit_version == env!("CARGO_PKG_VERSION")
        && c.plausible()
    {
        return Ok((c, Source::Cached(p.clone())));
    }
    let c = measure(threads)?;
    if let Some(p) = &path {
        write_atomically(p, &c);
    }
    Ok((c, Source::Measured))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roofline_takes_the_precisions_rate() {
        let c = Calibration {
            host: "h".into(),
            threads: 2,
            fp32_flops_per_s: 1e10,
            bf16_flops_per_s: 5e9,
            fp16_flops_per_s: 4e9,
            fp32_kernel_flops_per_s: 1e9,
            bf16_kernel_flops_per_s: 5e8,
            bytes_per_s: 1e10,
            op_overhead_s: 2e-6,
            memfit_version: "0".into(),
            measured_unix_s: 0,
            elapsed_s: 0.0,
        };
        assert_eq!(c.roofline(Precision::Fp32).flops_per_s, 1e10);
        assert_eq!(c.roofline(Precision::Bf16).flops_per_s, 5e9);
        assert_eq!(c.roofline(Precision::Fp16).flops_per_s, 4e9);
        assert_eq!(c.roofline(Precision::Fp16).op_overhead_s, 2e-6);
    }
}
