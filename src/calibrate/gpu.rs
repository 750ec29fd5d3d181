//! `memfit calibrate --device cuda[:N]`: a GPU's roofline, measured through
//! the cuda backend's own ops and stored beside the host's calibration, one
//! file per GPU model (`gpu-<name>.json` in [`super::cache_dir`]).
//!
//! Every figure is the best of repeated calls within a time budget, each
//! call timed from a `synchronize()` to the next (the peak is what a
//! roofline wants; a busy GPU only lowers it):
//! - GEMM curves, per dtype (fp32, bf16, fp16): `matmul_forward`'s FLOP/s
//!   (2·M·N·K a call, as `engine::ops::Work::matmul` counts) over squares
//!   from `max_dim/32` (at least 16) to `max_dim` in powers of two, then a
//!   transformer's MLP at `max_dim` tokens and hidden `max_dim/4` (up and
//!   down projections) and a LoRA rank-16 projection of that hidden.
//! - Fused attention's curve: `flash_attention_forward` and `_backward`
//!   (causal, head_dim 128, bf16) through `engine::device::Device`, so that
//!   the FLOPs are the engine's, at sequence lengths from `max_dim/16` (at
//!   least 32) to `max_dim`, `2·max_dim` tokens a call.
//! - Memory bandwidth: `add` of `max_dim²` f32 elements (3·n·4 bytes); and
//!   the per-kernel overhead, the median round of 100 queued 256-element
//!   `add`s, divided by 100.
//!
//! `--max-dim` (default [`DEFAULT_MAX_DIM`]) scales the whole ladder, and a
//! shape whose buffers would take more than a quarter of the GPU's memory
//! is left out: tests run it on the emulated GPU with `--max-dim 64`.

use std::path::PathBuf;
use std::time::Instant;

use super::Source;
use crate::backend::cuda::driver::Driver;
use crate::backend::cuda::{AnyDriver, CudaBackend};
use crate::backend::{AttnShape, Backend, DType};
use crate::config::gpu_calibration::{AttentionPoint, GemmPoint, GpuCalibration};
use crate::config::knobs::Precision;
use crate::engine::device::Device;
use crate::engine::ops::Work;
use crate::error::{Error, Result};
use crate::memory::Category;

/// Set (to anything but empty) to make plans ignore stored GPU calibrations:
/// for CI, and for tests that must not depend on what a machine measured.
pub const NO_GPU_CALIBRATION_ENV: &str = "MEMFIT_NO_GPU_CALIBRATION";

/// `--max-dim`'s default: GEMMs up to 8192² and sequences of 8192 tokens
/// (each point timed for about 0.15 s; not yet timed on a real GPU).
pub const DEFAULT_MAX_DIM: usize = 8192;

/// The smallest `--max-dim`: the ladder's smallest square and sequence.
pub const MIN_MAX_DIM: usize = 16;

/// Seconds of repeats per measured point.
const BUDGET_S: f64 = 0.15;

type Gpu = CudaBackend<AnyDriver>;

/// What `memfit calibrate --device cuda` is asked.
#[derive(Clone, Debug)]
pub struct Options {
    pub ordinal: usize,
    /// Host threads of the emulated GPU (`MEMFIT_CUDA_EMULATE`).
    pub threads: usize,
    /// The profile to bind to; `None`: the built-in one that matches.
    pub profile: Option<String>,
    pub max_dim: usize,
    pub force: bool,
}

/// `gpu-<name>.json`, the name lower-cased with every run of characters
/// other than letters and digits one `-`.
pub fn file_name(gpu: &str) -> String {
    let mut s = String::new();
    for c in gpu.chars() {
        if c.is_ascii_alphanumeric() {
            s.push(c.to_ascii_lowercase());
        } else if !s.ends_with('-') {
            s.push('-');
        }
    }
    format!("gpu-{}.json", s.trim_matches('-'))
}

/// The best seconds of `f` over repeats within [`BUDGET_S`] (at least
/// `min_runs`, after one warm-up call that is not counted: first calls
/// compile kernels and pick cuBLAS algorithms), each timed to a
/// `synchronize()`.
fn best_s(be: &mut Gpu, min_runs: usize, mut f: impl FnMut(&mut Gpu)) -> f64 {
    f(be);
    be.synchronize();
    let start = Instant::now();
    let (mut best, mut runs) = (f64::INFINITY, 0);
    while runs < min_runs || start.elapsed().as_secs_f64() < BUDGET_S {
        let t = Instant::now();
        f(be);
        be.synchronize();
        best = best.min(t.elapsed().as_secs_f64());
        runs += 1;
    }
    best
}

/// The GEMM shapes (m, n, k, what it is) measured at `max_dim`.
pub fn gemm_ladder(max_dim: usize) -> Vec<(usize, usize, usize, &'static str)> {
    let mut out = Vec::new();
    let mut s = (max_dim / 32).max(MIN_MAX_DIM).next_power_of_two();
    while s <= max_dim {
        out.push((s, s, s, "square"));
        s *= 2;
    }
    let (tokens, hidden) = (max_dim, (max_dim / 4).max(1));
    out.push((tokens, 4 * hidden, hidden, "mlp-up"));
    out.push((tokens, hidden, 4 * hidden, "mlp-down"));
    out.push((tokens, 16, hidden, "lora"));
    out
}

/// The attention shapes measured at `max_dim`: head_dim 128 with as many
/// heads as a `max_dim/4`-wide model has (1 to 16), and head_dim 64 with
/// twice as many (the two head dims hardware profiles publish rates at,
/// which a plan reads between), `2·max_dim` tokens a call.
pub fn attention_ladder(max_dim: usize) -> Vec<AttnShape> {
    let heads = (max_dim / 4 / 128).clamp(1, 16);
    let mut out = Vec::new();
    let mut t = (max_dim / 16).max(32).next_power_of_two();
    while t <= max_dim {
        for (head_dim, n_head) in [(128, heads), (64, 2 * heads)] {
            out.push(AttnShape {
                b: (2 * max_dim / t).max(1),
                t,
                n_head,
                n_kv_head: n_head,
                head_dim,
            });
        }
        t *= 2;
    }
    out
}

fn gemm_points(be: &mut Gpu, max_dim: usize, room: u64) -> Vec<GemmPoint> {
    let mut out = Vec::new();
    for (dtype, name) in [
        (DType::F32, "fp32"),
        (DType::Bf16, "bf16"),
        (DType::F16, "fp16"),
    ] {
        for (m, n, k, shape) in gemm_ladder(max_dim) {
            if ((m * k + n * k + m * n) * dtype.size()) as u64 > room {
                continue;
            }
            // out[m×n] = inp[m×k] · w[n×k]ᵀ, the backend's linear layer.
            let mut inp = be.alloc(m * k, dtype);
            let mut w = be.alloc(n * k, dtype);
            let mut res = be.alloc(m * n, dtype);
            be.fill(&mut inp, 0.25);
            be.fill(&mut w, 0.125);
            let seconds = best_s(be, 3, |be| {
                be.matmul_forward(&mut res, &inp, &w, None, m, k, n)
            });
            for b in [inp, w, res] {
                be.free(b);
            }
            let flops = Work::matmul(m, k, n, 0).flops;
            out.push(GemmPoint {
                dtype: name.into(),
                m,
                n,
                k,
                flops,
                seconds,
                flops_per_s: flops as f64 / seconds,
                shape: shape.into(),
            });
        }
    }
    out
}

/// One forward and backward of flash attention at `s`: (FLOPs as the
/// engine counts them, best seconds).
fn attention_point(dev: &mut Device<Gpu>, s: AttnShape) -> Result<(u64, f64)> {
    let dt = DType::Bf16;
    let n = s.b * s.t;
    // f32 words, as the engine allocates it (`Engine`'s workspace).
    let ws_len = dev.be.workspace_bytes(s, true, dt).div_ceil(4);
    let oom = |e: crate::memory::OomError| Error::Unavailable(format!("calibration: {e}"));
    let mut alloc = |len: usize, dt: DType| dev.alloc(len, dt, Category::Temporaries).map_err(oom);
    let (mut qkv, mut dqkv) = (alloc(n * s.qkv_width(), dt)?, alloc(n * s.qkv_width(), dt)?);
    let width = s.n_head * s.head_dim;
    let (mut out, mut dout) = (alloc(n * width, dt)?, alloc(n * width, dt)?);
    let mut lse = alloc(s.b * s.n_head * s.t, DType::F32)?;
    let mut ws = alloc(ws_len.max(1), DType::F32)?;
    dev.fill(&mut qkv, 0.05);
    dev.fill(&mut dout, 0.01);
    let mut round = |dev: &mut Device<Gpu>| {
        dev.flash_attention_forward(&mut out, &mut lse, &qkv, &mut ws, s);
        dev.flash_attention_backward(&mut dqkv, &dout, &out, &lse, &qkv, &mut ws, s);
    };
    round(dev);
    dev.be.synchronize();
    dev.meter.cost = Default::default();
    round(dev);
    let flops = dev.meter.cost.flops() as u64;
    let start = Instant::now();
    let (mut best, mut runs) = (f64::INFINITY, 0);
    while runs < 2 || start.elapsed().as_secs_f64() < BUDGET_S {
        dev.be.synchronize();
        let t = Instant::now();
        round(dev);
        dev.be.synchronize();
        best = best.min(t.elapsed().as_secs_f64());
        runs += 1;
    }
    for t in [qkv, dqkv, out, dout, lse, ws] {
        dev.free(t);
    }
    Ok((flops, best))
}

fn attention_points(
    dev: &mut Device<Gpu>,
    max_dim: usize,
    room: u64,
) -> Result<Vec<AttentionPoint>> {
    let mut out = Vec::new();
    for s in attention_ladder(max_dim) {
        let n = s.b * s.t;
        let bytes = 2 * (2 * n * s.qkv_width() + 2 * n * s.n_head * s.head_dim)
            + dev.be.workspace_bytes(s, true, DType::Bf16);
        if bytes as u64 > room {
            continue;
        }
        let (flops, seconds) = attention_point(dev, s)?;
        out.push(AttentionPoint {
            seq_len: s.t,
            batch: s.b,
            heads: s.n_head,
            head_dim: s.head_dim,
            flops,
            seconds,
            flops_per_s: flops as f64 / seconds,
        });
    }
    Ok(out)
}

/// (bytes/s of a large `add`, seconds per tiny kernel).
fn bandwidth_and_overhead(be: &mut Gpu, max_dim: usize, room: u64) -> (f64, f64) {
    let n = (max_dim * max_dim).min((room / 12) as usize).max(1 << 12);
    let [a, x, mut out] = super::add_operands(be, n);
    let seconds = best_s(be, 3, |be| be.add(&mut out, &a, &x, n));
    for b in [a, x, out] {
        be.free(b);
    }
    let small = 256;
    let [a, x, mut out] = super::add_operands(be, small);
    let mut rounds = Vec::new();
    let start = Instant::now();
    while rounds.len() < 5 || start.elapsed().as_secs_f64() < BUDGET_S {
        be.synchronize();
        let t = Instant::now();
        for _ in 0..100 {
            be.add(&mut out, &a, &x, small);
        }
        be.synchronize();
        rounds.push(t.elapsed().as_secs_f64() / 100.0);
    }
    for b in [a, x, out] {
        be.free(b);
    }
    rounds.sort_by(f64::total_cmp);
    ((3 * n * 4) as f64 / seconds, rounds[rounds.len() / 2])
}

/// Measures the GPU behind `be` (see the module's documentation).
pub fn measure(be: Gpu, max_dim: usize, profile: Option<String>) -> Result<GpuCalibration> {
    let start = Instant::now();
    let gpu = be.driver().gpu_name();
    let memory = be.driver().total_bytes();
    let room = memory / 4;
    let mut dev = Device::new(be, None);
    let gemm = gemm_points(&mut dev.be, max_dim, room);
    let attention = attention_points(&mut dev, max_dim, room)?;
    let (bytes_per_s, op_overhead_s) = bandwidth_and_overhead(&mut dev.be, max_dim, room);
    if gemm.is_empty() {
        return Err(Error::Unavailable(format!(
            "{gpu}: no GEMM of the ladder fits in a quarter of its {}",
            crate::units::fmt_bytes(memory)
        )));
    }
    Ok(GpuCalibration {
        gpu,
        memory,
        profile,
        memfit_version: env!("CARGO_PKG_VERSION").into(),
        measured_unix_s: crate::units::now_unix_s(),
        elapsed_s: start.elapsed().as_secs_f64(),
        max_dim,
        gemm,
        attention,
        bytes_per_s,
        op_overhead_s,
        file: None,
    })
}

fn read(path: &std::path::Path) -> Option<GpuCalibration> {
    let text = std::fs::read_to_string(path).ok()?;
    let c: GpuCalibration = serde_json::from_str(&text).ok()?;
    c.plausible().then_some(c)
}

/// The stored calibration of the GPU `opts` names, when it was measured by
/// this memfit version at the same `--max-dim` and bound to the same
/// profile, else a fresh one (written to the cache when there is one; a
/// cache that cannot be written is not an error, the figures are shown).
/// `profile` resolves the profile from the GPU's name and total memory when
/// `opts.profile` is `None`.
pub fn load_or_measure(
    opts: &Options,
    profile: impl Fn(&str, u64) -> Option<String>,
) -> Result<(GpuCalibration, Source)> {
    let be = crate::backend::cuda::open(opts.ordinal, opts.threads).map_err(Error::Unavailable)?;
    let (gpu, memory) = (be.driver().gpu_name(), be.driver().total_bytes());
    let bound = opts.profile.clone().or_else(|| profile(&gpu, memory));
    let path = super::cache_dir().map(|d| d.join(file_name(&gpu)));
    if !opts.force
        && let Some(p) = &path
        && let Some(c) = read(p)
        && c.gpu == gpu
        && c.memory == memory
        && c.profile == bound
        && c.max_dim == opts.max_dim
        && c.memfit_version == env!("CARGO_PKG_VERSION")
    {
        return Ok((c, Source::Cached(p.clone())));
    }
    let c = measure(be, opts.max_dim, bound)?;
    if let Some(p) = &path {
        super::write_atomically(p, &c);
    }
    Ok((c, Source::Measured))
}

/// The newest stored calibration bound to the hardware profile `profile`,
/// unless [`NO_GPU_CALIBRATION_ENV`] is set: what a plan on that profile
/// prices its steps with.
pub fn bound_to(profile: &str) -> Option<GpuCalibration> {
    if std::env::var_os(NO_GPU_CALIBRATION_ENV).is_some_and(|v| !v.is_empty()) {
        return None;
    }
    let dir = super::cache_dir()?;
    let mut found: Vec<(PathBuf, GpuCalibration)> = std::fs::read_dir(&dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("gpu-") && n.ends_with(".json"))
        })
        .filter_map(|p| read(&p).map(|c| (p, c)))
        .filter(|(_, c)| c.profile.as_deref() == Some(profile))
        .collect();
    found.sort_by_key(|(p, c)| (c.measured_unix_s, p.clone()));
    let (p, mut c) = found.pop()?;
    c.file = Some(p);
    Some(c)
}

/// `hw` priced with the calibration bound to its profile, where one is
/// stored: what `memfit plan`, the TUI's builder and a sweep's target GPU
/// plan with.
pub fn attach_bound(hw: &mut crate::config::hardware::HardwareProfile) {
    hw.measured = bound_to(&hw.name).map(Box::new);
}

/// What a plan's step line says of the roofline `m` measured, for a point
/// at `precision`: which GPU, when and by which memfit; and what it did not
/// measure, so a figure priced at the profile's rate is never called
/// measured. A calibration from another memfit version is still used (its
/// GEMMs are cuBLAS's), but the line says so: its attention and per-kernel
/// overhead are memfit's own kernels, which that version may have run
/// differently.
pub fn describe(m: &GpuCalibration, precision: Precision, profile_efficiency: f64) -> String {
    let mut s = format!(
        "roofline measured on {} by `memfit calibrate --device cuda` on {}",
        m.gpu,
        date(m.measured_unix_s)
    );
    let dtype = crate::config::gpu_calibration::precision_name(precision);
    if m.gemm_curve(precision).is_empty() {
        s += &format!(
            "; its {dtype} GEMMs were not measured and run at {:.0}% of the profile's peak",
            profile_efficiency * 100.0
        );
    }
    if precision != Precision::Fp32 && m.attention.is_empty() {
        s += "; fused attention was not measured and runs at the profile's rate";
    }
    let ours = env!("CARGO_PKG_VERSION");
    if m.memfit_version != ours {
        s += &format!(
            "; measured by memfit {}, this is {ours}: `memfit calibrate --device cuda --force` measures again",
            m.memfit_version
        );
    }
    s
}

/// `YYYY-MM-DD` (UTC) of `unix_s`.
pub fn date(unix_s: u64) -> String {
    let (y, m, d, ..) = crate::units::utc_civil(unix_s);
    format!("{y:04}-{m:02}-{d:02}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::device::{Curve, Roofline, Tiles};
    use crate::engine::ops::Gemm;

    fn curve() -> Curve {
        Curve::new(&[(1e9, 1e13), (1e6, 1e11), (1e12, 5e14), (1e15, 6e14)]).unwrap()
    }

    #[test]
    fn a_curve_is_exact_at_its_measured_points() {
        let c = curve();
        for (x, y) in [(1e6, 1e11), (1e9, 1e13), (1e12, 5e14), (1e15, 6e14)] {
            assert!((c.at(x) / y - 1.0).abs() < 1e-12, "{x}: {} != {y}", c.at(x));
        }
    }

    #[test]
    fn a_curve_is_monotone_and_log_linear_between_its_points() {
        let c = curve();
        let mut last = c.at(1e6);
        for i in 1..=900 {
            let x = 1e6 * 10f64.powf(i as f64 / 100.0);
            let y = c.at(x);
            assert!(y >= last, "falls at {x}: {y} < {last}");
            last = y;
        }
        // Halfway between 1e6 and 1e9 in log x is halfway in log y.
        assert!((c.at(10f64.powf(7.5)) / 1e12 - 1.0).abs() < 1e-9);
    }

    #[test]
    fn a_curve_is_clamped_outside_what_was_measured() {
        let c = curve();
        assert_eq!(c.at(1.0), 1e11);
        assert_eq!(c.at(0.0), 1e11);
        assert_eq!(c.at(f64::NAN), 1e11);
        assert_eq!(c.at(1e20), 6e14);
        assert_eq!(c.at(f64::INFINITY), 6e14);
    }

    #[test]
    fn a_curve_keeps_the_best_of_equal_sizes_and_refuses_nonsense() {
        let c = Curve::new(&[(10.0, 1.0), (10.0, 3.0), (-1.0, 5.0), (20.0, f64::NAN)]).unwrap();
        assert_eq!((c.at(10.0), c.first()), (3.0, (10.0, 3.0)));
        assert!(Curve::new(&[]).is_none());
        assert!(Curve::new(&[(0.0, 1.0)]).is_none());
        let many: Vec<(f64, f64)> = (1..=17).map(|i| (i as f64, 1.0)).collect();
        assert!(Curve::new(&many).is_none());
    }

    fn measured_roofline() -> Roofline {
        Roofline {
            flops_per_s: 1e15,
            kernel_flops_per_s: 1e14,
            bytes_per_s: 1e12,
            norm_share: 1.0,
            op_overhead_s: 0.0,
            tiles: Some(Tiles {
                sms: 132,
                m: 128,
                n: 128,
            }),
            attention_flops_per_s: Some(3e14),
            attention_table: crate::engine::device::AttentionTable::new(
                &serde_yaml_ng::from_str("128: {512: 100, 4096: 400}").unwrap(),
            ),
            gemm_curve: Some(curve()),
        }
    }

    #[test]
    fn a_measured_gemm_is_priced_at_the_curve_for_its_flops() {
        let r = measured_roofline();
        let g = Gemm::new(1000, 1000, 500); // 1e9 FLOPs
        assert!((r.gemm_seconds(&g) / (1e9 / 1e13) - 1.0).abs() < 1e-9);
        // Without the curve the tile model and the profile's peak price it.
        let profile = Roofline {
            gemm_curve: None,
            ..r
        };
        assert!((profile.gemm_seconds(&g) - r.gemm_seconds(&g)).abs() > 1e-6);
    }

    #[test]
    fn below_the_curve_the_tile_model_derates_the_smallest_measured_rate() {
        let r = measured_roofline();
        // 1e6 FLOPs is the smallest point, a square of side about 79.
        let square = Gemm::new(79, 79, 80);
        // 5.8e5 FLOPs in a 32×32 tile it fills to 28%, less than the
        // square fills its 128×128 one (38%).
        let skinny = Gemm::new(17, 17, 1000);
        let rate = |g: &Gemm| g.flops() as f64 / r.gemm_seconds(g);
        let want = 1e11 * (289.0 / 1024.0) / (6241.0 / 16384.0);
        assert!(
            (rate(&skinny) / want - 1.0).abs() < 1e-9,
            "{}",
            rate(&skinny)
        );
        assert!(rate(&square) <= 1e11 * (1.0 + 1e-9));
        // Without tiles (no SM count), it is the smallest point's rate.
        let flat = Roofline { tiles: None, ..r };
        assert!((skinny.flops() as f64 / flat.gemm_seconds(&skinny) / 1e11 - 1.0).abs() < 1e-9);
    }

    #[test]
    fn fused_attention_is_read_by_its_sequence_length() {
        use crate::backend::AttnShape;
        let r = measured_roofline();
        let at = |t: usize| {
            let s = AttnShape {
                b: 1,
                t,
                n_head: 8,
                n_kv_head: 8,
                head_dim: 128,
            };
            let w = Work::flash_attention(s, 0);
            w.flops as f64 / r.seconds(&w, 0)
        };
        assert!((at(512) / 1e14 - 1.0).abs() < 1e-9);
        assert!((at(4096) / 4e14 - 1.0).abs() < 1e-9);
        // Two thirds of the way in log t: two thirds of the way in log rate.
        let want = 1e14 * 4f64.powf(2.0 / 3.0);
        assert!((at(2048) / want - 1.0).abs() < 1e-9, "{}", at(2048));
        assert!((at(65536) / 4e14 - 1.0).abs() < 1e-9);
    }

    #[test]
    fn file_names_are_the_gpus_sanitised() {
        assert_eq!(
            file_name("NVIDIA H100 80GB HBM3"),
            "gpu-nvidia-h100-80gb-hbm3.json"
        );
        assert_eq!(file_name("../A100/(SXM4)"), "gpu-a100-sxm4.json");
    }

    #[test]
    fn the_ladders_scale_with_max_dim() {
        let full = gemm_ladder(DEFAULT_MAX_DIM);
        let squares: Vec<usize> = (full.iter())
            .filter(|g| g.3 == "square")
            .map(|g| g.0)
            .collect();
        assert_eq!(squares, [256, 512, 1024, 2048, 4096, 8192]);
        assert!(full.contains(&(8192, 8192, 2048, "mlp-up")));
        assert!(full.contains(&(8192, 16, 2048, "lora")));
        assert!(gemm_ladder(64).iter().all(|g| g.0.max(g.1).max(g.2) <= 64));
        let shapes: Vec<(usize, usize, usize)> = attention_ladder(DEFAULT_MAX_DIM)
            .iter()
            .map(|s| (s.t, s.head_dim, s.n_head))
            .collect();
        let want: Vec<(usize, usize, usize)> = [512, 1024, 2048, 4096, 8192]
            .into_iter()
            .flat_map(|t| [(t, 128, 16), (t, 64, 32)])
            .collect();
        assert_eq!(shapes, want);
        assert_eq!(attention_ladder(64).len(), 4);
        // Every point fits the shared Curve.
        assert!(full.len() <= crate::engine::device::CURVE_POINTS);
    }

    #[test]
    fn a_plan_on_the_bound_profile_takes_the_measured_figures() {
        use crate::config::gpu_calibration::*;
        let mut hw = crate::config::hardware::load_hardware("h100-sxm-80gb").unwrap();
        let before = crate::plan::roofline(&hw, crate::engine::Precision::Bf16);
        let point = |dtype: &str, s: usize, rate: f64| GemmPoint {
            dtype: dtype.into(),
            m: s,
            n: s,
            k: s,
            flops: 2 * (s * s * s) as u64,
            seconds: 2.0 * (s * s * s) as f64 / rate,
            flops_per_s: rate,
            shape: "square".into(),
        };
        hw.measured = Some(Box::new(GpuCalibration {
            gpu: "g".into(),
            memory: 80 << 30,
            profile: Some(hw.name.clone()),
            memfit_version: "0".into(),
            measured_unix_s: 0,
            elapsed_s: 0.0,
            max_dim: 1024,
            gemm: vec![
                point("bf16", 256, 1e14),
                point("bf16", 1024, 5e14),
                point("fp32", 1024, 4e13),
            ],
            attention: vec![],
            bytes_per_s: 2e12,
            op_overhead_s: 3e-6,
            file: None,
        }));
        let after = crate::plan::roofline(&hw, crate::engine::Precision::Bf16);
        assert_eq!((after.bytes_per_s, after.op_overhead_s), (2e12, 3e-6));
        assert_eq!(after.flops_per_s, 5e14);
        assert!(after.gemm_curve.is_some());
        // Attention was not measured: the profile's published rates stay.
        assert_eq!(after.attention_table, before.attention_table);
        assert_eq!(after.attention_flops_per_s, before.attention_flops_per_s);
        let fp32 = crate::plan::roofline(&hw, crate::engine::Precision::Fp32);
        assert_eq!(fp32.flops_per_s, 4e13);
        // fp16 was not measured: the profile's rate, with the measured bandwidth.
        let fp16 = crate::plan::roofline(&hw, crate::engine::Precision::Fp16);
        assert!(fp16.gemm_curve.is_none() && fp16.bytes_per_s == 2e12);
        // And the step line says what was not measured, and by whom it was.
        let m = hw.measured.as_deref().unwrap();
        let said = describe(m, Precision::Fp16, 0.7);
        assert!(
            said.contains("its fp16 GEMMs were not measured and run at 70% of the profile's peak"),
            "{said}"
        );
        assert!(said.contains("fused attention was not measured"), "{said}");
        assert!(said.contains("measured by memfit 0, this is"), "{said}");
        let bf16 = describe(m, Precision::Bf16, 0.7);
        assert!(!bf16.contains("GEMMs were not measured"), "{bf16}");
        let fp32 = describe(m, Precision::Fp32, 0.7);
        assert!(!fp32.contains("not measured"), "{fp32}");
        let current = GpuCalibration {
            memfit_version: env!("CARGO_PKG_VERSION").into(),
            ..m.clone()
        };
        assert!(!describe(&current, Precision::Fp32, 0.7).contains("this is"));
    }
}
