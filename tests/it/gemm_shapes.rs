//! memfit's GEMM model (a large GEMM at the profile's `gemm_efficiency`
//! of the dense peak, or `COMPUTE_EFFICIENCY` without one, derated by the
//! tiles and waves its M×N leaves idle) against the bf16 GEMM rates XLA
//! measured on an H100 at the shapes a training step's GEMMs have
//! (tests/reference/gemm/h100-sxm-xla.yaml, which says how they were
//! measured).
//!
//! Two things are held apart. The shape law: how a GEMM's rate falls from
//! the largest one's as its sides shrink, which the tile model alone says.
//! And the level: memfit's rates against the measured ones, which are a
//! kernel alone, while memfit prices a GEMM inside a training step.
//!
//! memfit's time for a GEMM is its op's whole price: the arithmetic at the
//! tiles' share of the rate, or its bytes if longer, and the 5 us every op
//! pays. The measured time is the kernel's alone, without its launch. That
//! fixed cost is what carries a short GEMM's ramp: the tile model alone
//! (`Roofline::gemm_seconds`) prices 4,096 x 1,024 x 1,024 at 1.35x its
//! measured rate, and with the 5 us at 3% below it.

use memfit::config::hardware::load_hardware;
use memfit::engine::Precision;
use memfit::engine::ops::{Gemm, Work};
use memfit::plan::{COMPUTE_EFFICIENCY, roofline};
use serde::Deserialize;

#[derive(Deserialize)]
struct Measured {
    gpu: String,
    dtype: String,
    /// [b, m, n, k, TFLOP/s]
    rows: Vec<[f64; 5]>,
}

struct Shape {
    gemm: Gemm,
    measured: f64,
    memfit: f64,
}

/// Each measured shape with memfit's rate for it: at the profile's
/// `gemm_efficiency`, or at memfit's default share where `default_share`.
fn shapes(default_share: bool) -> Vec<Shape> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/reference/gemm/h100-sxm-xla.yaml"
    );
    let m: Measured = serde_yaml_ng::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(m.dtype, "bf16");
    let mut hw = load_hardware(&m.gpu).unwrap();
    if default_share {
        hw.gemm_efficiency = None;
    }
    let r = roofline(&hw, Precision::Bf16);
    (m.rows.iter())
        .map(|&[b, m, n, k, tflops]| {
            let gemm = Gemm {
                m: m as usize,
                n: n as usize,
                k: k as usize,
                count: b as usize,
            };
            // A's, B's and C's bf16 bytes, as the engine counts a matmul's.
            let bytes = 2 * gemm.count * (gemm.m * gemm.k + gemm.k * gemm.n + gemm.m * gemm.n);
            let work = Work::gemm("matmul", [Some(gemm), None], 0, bytes as u64);
            let memfit = gemm.flops() as f64 / r.seconds(&work, 1);
            Shape {
                gemm,
                measured: tflops * 1e12,
                memfit,
            }
        })
        .collect()
}

/// Relative to the largest GEMM measured, memfit's rate at every other
/// training shape is within 15% of the measured one: the tile and wave
/// model, which has no term for K, says most of how the rate falls with M,
/// N and K there. Its largest miss is at K = 1,024, the shortest K kept,
/// where memfit is faster than measured. The law is held at memfit's
/// default share of the peak (70%), near the level these kernels reach
/// alone; the H100 profile's fitted in-step share (62%) slows every GEMM's
/// arithmetic alike, which leaves the fixed 5 us a smaller part of a short
/// GEMM's price: there 4,096 x 1,024 x 1,024 comes out at 1.18x.
#[test]
fn the_tile_model_follows_measured_h100_gemms_across_training_shapes() {
    let shapes = shapes(true);
    let largest = (shapes.iter())
        .max_by_key(|s| s.gemm.flops())
        .expect("rows");
    let mut worst: (f64, &Gemm) = (1.0, &largest.gemm);
    for s in &shapes {
        let ratio = (s.memfit / largest.memfit) / (s.measured / largest.measured);
        assert!(
            (ratio - 1.0).abs() <= 0.15,
            "{:?}: memfit's rate relative to the largest GEMM's is {:.2}x the measured one",
            s.gemm,
            ratio
        );
        if (ratio - 1.0).abs() > (worst.0 - 1.0).abs() {
            worst = (ratio, &s.gemm);
        }
    }
    assert!(worst.1.k <= 1024, "{worst:?}");
}

/// memfit never prices a GEMM faster than the kernel runs alone, and its
/// largest GEMM runs at 70-80% of the measured rate (75% now): XLA's
/// kernels reach 50-81% of the H100's 989.4 dense TFLOP/s at these shapes,
/// the largest 80%, memfit's H100 profile 62% (`gemm_efficiency`).
/// That is a fit, not an oversight: 62% is the share that fits the H100
/// runs of the README's calibration table marked for it best
/// (calibration::the_fitted_constants_are_the_best_fit_of_their_rows), so
/// it stands for a GEMM inside a step at the GPU's power limit, not alone.
#[test]
fn memfit_prices_h100_gemms_below_their_isolated_rate() {
    assert_eq!(COMPUTE_EFFICIENCY, 0.7);
    let h100 = load_hardware("h100-sxm-80gb").unwrap();
    assert_eq!(
        h100.gemm_efficiency,
        Some(0.62),
        "the level this test holds"
    );
    let shapes = shapes(false);
    for s in &shapes {
        assert!(
            s.memfit <= s.measured,
            "{:?}: memfit {:.0} TFLOP/s, measured {:.0}",
            s.gemm,
            s.memfit / 1e12,
            s.measured / 1e12
        );
    }
    let largest = (shapes.iter())
        .max_by_key(|s| s.gemm.flops())
        .expect("rows");
    let level = largest.memfit / largest.measured;
    assert!((0.70..=0.80).contains(&level), "{level}");
}
