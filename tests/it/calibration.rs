//! The step-time model against published, measured throughput
//! (tests/reference/calibration/table.yaml): each row's recipe states the
//! published run's setup, `memfit plan` predicts it, and the README's table
//! is exactly what this computes. Every row's run must fit in memfit's
//! plan (it ran). Rows without `not_held` must be within the table's
//! tolerance; the others say what of their setup memfit does not model,
//! and their error is shown, not hidden.

use std::path::{Path, PathBuf};

use memfit::config::hardware::HardwareProfile;
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    tolerance: f64,
    /// For the rows whose source gives the run's peak memory.
    memory_tolerance: f64,
    rows: Vec<Row>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Row {
    id: String,
    source: String,
    setup: String,
    published: String,
    tokens_per_s_per_gpu: f64,
    derived: String,
    recipe: PathBuf,
    /// The source bounds the GPU's tensor rate below its profile's: the row
    /// is planned at both ends, and held if the figure is within the
    /// tolerance of the range they span.
    #[serde(default)]
    lower_clock: Option<LowerClock>,
    #[serde(default)]
    not_held: Option<String>,
    /// The profile constant this row is one of the fitted rows of
    /// (`gemm_efficiency`, or a kernel's rates in `attention_kernels`):
    /// the constant is the best fit of its rows
    /// (`the_fitted_constants_are_the_best_fit_of_their_rows`).
    #[serde(default)]
    fitted: Option<String>,
    /// The run's peak memory per GPU, where the source gives it.
    #[serde(default)]
    memory: Option<Memory>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Memory {
    gib: f64,
    /// Which of PyTorch's counters the figure is: `max_reserved`
    /// (`reserved_bytes.all.peak`) or `max_allocated`.
    metric: String,
    /// Where the source says which counter it logs.
    source: String,
    #[serde(default)]
    not_held: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LowerClock {
    bf16_tflops: f64,
    source: String,
}

/// memfit's tokens/s per GPU for a row: one figure, or the range a stated
/// bound on the GPU's clock spans (lowest first).
#[derive(Clone, Copy)]
struct Predicted {
    low: f64,
    high: f64,
    /// The profile's bf16 TFLOPS, where a bound replaced it at `low`.
    profile_tflops: f64,
    /// PyTorch's caching allocator as memfit models it (hf-eager on a
    /// GPU): `max_memory_allocated` and `max_memory_reserved`, bytes.
    allocated: Option<u64>,
    reserved: Option<u64>,
}

impl Predicted {
    /// The relative error to the nearest end of the range: zero inside it.
    fn error(self, published: f64) -> f64 {
        if published < self.low {
            self.low / published - 1.0
        } else if published > self.high {
            self.high / published - 1.0
        } else {
            0.0
        }
    }
}

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/calibration")
}

/// Each row with memfit's tokens/s per GPU for its recipe, and its
/// caching allocator's peaks.
fn predicted(table: &Table) -> Vec<Predicted> {
    predicted_on(table.rows.iter(), &|_| {})
}

/// [`predicted`] for `rows`, with `adjust` applied to each row's hardware
/// profile first.
fn predicted_on<'a>(
    rows: impl Iterator<Item = &'a Row>,
    adjust: &dyn Fn(&mut HardwareProfile),
) -> Vec<Predicted> {
    rows.map(|r| {
        let path = dir().join(&r.recipe);
        let per_gpu = |plan: memfit::plan::Plan| {
            assert_eq!(plan.points.len(), 1, "{}: one point a recipe", r.id);
            let p = &plan.points[0];
            // The published run ran: a plan that says it does not fit
            // is wrong about memory, whatever it says of time.
            assert!(
                matches!(p.verdict, memfit::plan::Verdict::Fits),
                "{}: the published run fits, memfit says {:?} ({:.2} GiB)",
                r.id,
                p.verdict,
                p.total_bytes as f64 / (1u64 << 30) as f64
            );
            assert!(p.tokens_per_s > 0.0, "{}: {:?}", r.id, p.verdict);
            (p.tokens_per_s / p.point.gpus as f64, p.allocator)
        };
        let (at_profile, allocator) = per_gpu(
            memfit::plan::plan_file_on(&path, adjust).unwrap_or_else(|e| panic!("{}: {e}", r.id)),
        );
        let mut p = Predicted {
            low: at_profile,
            high: at_profile,
            profile_tflops: 0.0,
            allocated: allocator.map(|a| a.max_memory_allocated),
            reserved: allocator.map(|a| a.max_memory_reserved),
        };
        let Some(lower) = &r.lower_clock else {
            return p;
        };
        assert!(!lower.source.is_empty(), "{}: the bound's source", r.id);
        let (at_bound, _) = per_gpu(
            memfit::plan::plan_file_on(&path, |hw| {
                adjust(hw);
                p.profile_tflops = hw.bf16_tflops;
                *hw = hw.at_tensor_rate(lower.bf16_tflops)
            })
            .unwrap_or_else(|e| panic!("{}: {e}", r.id)),
        );
        assert!(
            at_bound < at_profile,
            "{}: a lower clock plans slower",
            r.id
        );
        p.low = at_bound;
        p
    })
    .collect()
}

/// memfit's figure for a row's published peak memory, GiB.
fn memfit_memory(r: &Row, m: &Memory, p: Predicted) -> f64 {
    let bytes = match m.metric.as_str() {
        "max_reserved" => p.reserved,
        "max_allocated" => p.allocated,
        other => panic!(
            "{}: `{other}` is no metric (max_reserved, max_allocated)",
            r.id
        ),
    };
    let bytes = bytes.unwrap_or_else(|| panic!("{}: no caching allocator in the plan", r.id));
    bytes as f64 / (1u64 << 30) as f64
}

/// The README's memory table: the rows whose source gives the peak.
fn memory_markdown(table: &Table, predicted: &[Predicted]) -> String {
    let mut out = String::from(
        "| Published run | counter | published GiB | memfit GiB | error | held |\n\
         |---|---|---:|---:|---:|---|\n",
    );
    for (r, &p) in table.rows.iter().zip(predicted) {
        let Some(m) = &r.memory else { continue };
        let ours = memfit_memory(r, m, p);
        let held = match &m.not_held {
            None => "yes".to_string(),
            Some(why) => format!("no: {why}"),
        };
        out.push_str(&format!(
            "| {} | {} ({}) | {:.1} | {:.2} | {:+.1}% | {} |\n",
            r.setup,
            m.metric,
            m.source,
            m.gib,
            ours,
            (ours / m.gib - 1.0) * 100.0,
            held
        ));
    }
    out
}

/// The README's table: one line a row.
fn markdown(table: &Table, predicted: &[Predicted]) -> String {
    let mut out = String::from(
        "| Published run (source) | Published | tokens/s/GPU | memfit | error | held |\n\
         |---|---|---:|---:|---:|---|\n",
    );
    for (r, &p) in table.rows.iter().zip(predicted) {
        let held = match (&r.not_held, &r.fitted) {
            (None, None) => "yes".to_string(),
            (None, Some(fit)) => format!("yes (a row `{fit}` is fitted to)"),
            (Some(why), None) => format!("no: {why}"),
            (Some(why), Some(fit)) => format!("no (a row `{fit}` is fitted to): {why}"),
        };
        let (memfit, error) = match &r.lower_clock {
            None => (
                format!("{:.0}", p.high),
                format!("{:+.1}%", p.error(r.tokens_per_s_per_gpu) * 100.0),
            ),
            Some(lower) => (
                format!("{:.0} to {:.0}", p.low, p.high),
                format!(
                    "{:+.1}% to {:+.1}% (at {} to {} bf16 TFLOPS: {})",
                    (p.low / r.tokens_per_s_per_gpu - 1.0) * 100.0,
                    (p.high / r.tokens_per_s_per_gpu - 1.0) * 100.0,
                    lower.bf16_tflops,
                    p.profile_tflops,
                    lower.source
                ),
            ),
        };
        out.push_str(&format!(
            "| {} ([{}](tests/reference/calibration/{})) | {} | {:.0} | {} | {} | {} |\n",
            r.setup,
            r.source,
            r.recipe.display(),
            r.published,
            r.tokens_per_s_per_gpu,
            memfit,
            error,
            held
        ));
    }
    out
}

const BEGIN: &str = "<!-- calibration:begin (tests/it/calibration.rs writes this) -->\n";
const END: &str = "<!-- calibration:end -->";

#[test]
fn the_readme_table_holds() {
    let text = std::fs::read_to_string(dir().join("table.yaml")).unwrap();
    let table: Table = serde_yaml_ng::from_str(&text).unwrap();
    let predicted = predicted(&table);
    for (r, p) in table.rows.iter().zip(&predicted) {
        assert!(
            r.tokens_per_s_per_gpu > 0.0 && !r.derived.is_empty(),
            "{}: a figure and how it was derived",
            r.id
        );
        let err = p.error(r.tokens_per_s_per_gpu);
        if r.not_held.is_none() {
            assert!(
                err.abs() <= table.tolerance,
                "{}: memfit predicts {:.0} to {:.0} tokens/s/GPU, {:+.1}% from the published {:.0} \
                 (tolerance {:.0}%)",
                r.id,
                p.low,
                p.high,
                err * 100.0,
                r.tokens_per_s_per_gpu,
                table.tolerance * 100.0
            );
        }
    }
    for (r, &p) in table.rows.iter().zip(&predicted) {
        let Some(m) = r.memory.as_ref().filter(|m| m.not_held.is_none()) else {
            continue;
        };
        let err = memfit_memory(r, m, p) / m.gib - 1.0;
        assert!(
            err.abs() <= table.memory_tolerance,
            "{}: memfit's {} is {:+.2}% from the published {} GiB",
            r.id,
            m.metric,
            err * 100.0,
            m.gib
        );
    }
    let want = format!(
        "{}\nPeak memory per GPU, where the run's source gives it, against \
         memfit's model of PyTorch's caching allocator for the same plan:\n\n{}",
        markdown(&table, &predicted),
        memory_markdown(&table, &predicted)
    );
    let readme_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let readme = std::fs::read_to_string(&readme_path).unwrap();
    let (Some(b), Some(e)) = (readme.find(BEGIN), readme.find(END)) else {
        panic!("README.md has no calibration block ({BEGIN:?} ... {END:?})");
    };
    let have = &readme[b + BEGIN.len()..e];
    if have != want {
        if std::env::var_os("MEMFIT_WRITE_README").is_some() {
            let new = format!("{}{BEGIN}{want}{}", &readme[..b], &readme[e..]);
            std::fs::write(&readme_path, new).unwrap();
        } else {
            panic!(
                "README.md's calibration table is not what memfit predicts now; \
                 MEMFIT_WRITE_README=1 cargo test --release --test it calibration rewrites it.\n\
                 want:\n{want}\nhave:\n{have}"
            );
        }
    }
}

#[test]
fn every_held_row_has_a_recipe_of_one_point_and_every_recipe_a_row() {
    let text = std::fs::read_to_string(dir().join("table.yaml")).unwrap();
    let table: Table = serde_yaml_ng::from_str(&text).unwrap();
    let mut listed: Vec<PathBuf> = table.rows.iter().map(|r| dir().join(&r.recipe)).collect();
    listed.sort();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir().join("recipes"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert_eq!(listed, files, "table.yaml names every recipe once");
}

/// The profile the fitted constants belong to.
const FITTED_GPU: &str = "h100-sxm-80gb";

/// How far a fit's rows are from their published figures: the sum of the
/// squared logs of memfit's figure over the published one (to the nearest
/// end of a range), with `adjust` applied to their hardware.
fn misfit(table: &Table, fit: &str, adjust: &dyn Fn(&mut HardwareProfile)) -> f64 {
    let rows: Vec<&Row> = (table.rows.iter())
        .filter(|r| r.fitted.as_deref() == Some(fit))
        .collect();
    assert!(rows.len() >= 5, "`{fit}` is fitted to {} rows", rows.len());
    let predicted = predicted_on(rows.iter().copied(), adjust);
    (rows.iter().zip(predicted))
        .map(|(r, p)| (1.0 + p.error(r.tokens_per_s_per_gpu)).ln().powi(2))
        .sum()
}

/// The two constants the H100 profile takes from this table, each the best
/// fit of the rows marked for it, a step either side fitting them worse:
/// its GEMMs' sustained share of the peak (`gemm_efficiency`), fitted to
/// the H100 SXM runs that do not run flash-attn's Triton kernel, and that
/// kernel's H100 rates, fitted to MosaicML's MPT 1b runs from 512 to 65,536
/// tokens. Every other row is held out of both fits.
/// MEMFIT_PRINT_FIT=1 prints each misfit around the profile's values.
#[test]
fn the_fitted_constants_are_the_best_fit_of_their_rows() {
    let text = std::fs::read_to_string(dir().join("table.yaml")).unwrap();
    let table: Table = serde_yaml_ng::from_str(&text).unwrap();
    let print = std::env::var_os("MEMFIT_PRINT_FIT").is_some();
    for r in &table.rows {
        let fit = r.fitted.as_deref();
        assert!(
            matches!(
                fit,
                None | Some("gemm_efficiency" | "flash-attention-triton")
            ),
            "{}: `fitted: {fit:?}` names no fitted constant",
            r.id
        );
    }
    let hw = memfit::config::hardware::load_hardware(FITTED_GPU).unwrap();
    let share = hw
        .gemm_efficiency
        .expect("the H100 profile's gemm_efficiency");
    let gemm = |s: f64| {
        misfit(&table, "gemm_efficiency", &|hw| {
            if hw.name == FITTED_GPU {
                hw.gemm_efficiency = Some(s)
            }
        })
    };
    let kernel = memfit::config::attention_kernels::AttentionKernel::FlashAttentionTriton;
    let triton = |f: f64| {
        misfit(&table, "flash-attention-triton", &|hw| {
            if hw.name != FITTED_GPU {
                return;
            }
            let rates = hw.attention_kernels.get_mut(&kernel).expect("Triton rates");
            for by_len in rates.values_mut() {
                by_len.values_mut().for_each(|r| *r *= f);
            }
        })
    };
    if print {
        for i in -6..=6 {
            let s = share + 0.01 * i as f64;
            eprintln!("gemm_efficiency {s:.2}: misfit {:.5}", gemm(s));
        }
        for i in -6..=6 {
            let f = 1.0 + 0.025 * i as f64;
            eprintln!("Triton rates x{f:.3}: misfit {:.5}", triton(f));
        }
    }
    best_of_its_steps(
        &format!("gemm_efficiency {share}"),
        gemm(share),
        [
            (format!("{:.2}", share - 0.01), gemm(share - 0.01)),
            (format!("{:.2}", share + 0.01), gemm(share + 0.01)),
        ],
    );
    best_of_its_steps(
        "the Triton kernel's rates",
        triton(1.0),
        [
            ("scaled by 0.975".into(), triton(0.975)),
            ("scaled by 1.025".into(), triton(1.025)),
        ],
    );
}

/// A fitted constant's misfit `at` beats each step's beside it.
fn best_of_its_steps(what: &str, at: f64, steps: [(String, f64); 2]) {
    for (step, misfit) in steps {
        assert!(
            at < misfit,
            "{what} fits its rows no better than {step} ({at:.5} vs {misfit:.5})"
        );
    }
}
