//! `memfit check`: the CI gate on sweep reports. Drives `run_check` (which
//! returns the exit code) on the fixture report and planted variants of it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use memfit::check::{
    CheckArgs, CheckFormat, CheckReport, CheckVerdict, compare, load_report, run_check,
};
use memfit::sweep::report::{Outcome, SweepReport};

const REGRESSED: &str = "mb2-x1-none-bf16-adamw-ckpt_none-fused";
const FITTING: &str = "mb4-x1-none-bf16-adamw-ckpt_none-fused";

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reports/baseline.json")
}

fn baseline() -> SweepReport {
    load_report(&fixture()).expect("the fixture report loads")
}

/// A fresh directory under the system temp dir.
fn scratch(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "memfit-check-{}-{}-{tag}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes `report` as DIR/report.json and returns DIR.
fn write_dir(report: &SweepReport, tag: &str) -> PathBuf {
    let dir = scratch(tag);
    std::fs::write(
        dir.join("report.json"),
        serde_json::to_string_pretty(report).unwrap(),
    )
    .unwrap();
    dir
}

fn args(current: &Path, baseline: &Path, tolerance: &str, format: CheckFormat) -> CheckArgs {
    CheckArgs {
        current: current.to_path_buf(),
        baseline: baseline.to_path_buf(),
        tolerance: tolerance.into(),
        format,
    }
}

fn trial_mut<'a>(r: &'a mut SweepReport, id: &str) -> &'a mut memfit::sweep::report::TrialRecord {
    r.trials.iter_mut().find(|t| t.id == id).unwrap()
}

/// Scales one trial's total and activations peak by `factor`.
fn planted(factor: f64, id: &str) -> SweepReport {
    let mut r = baseline();
    let m = trial_mut(&mut r, id).measured.as_mut().unwrap();
    let grow = |x: u64| (x as f64 * factor).round() as u64;
    let extra = grow(m.peak_bytes.total) - m.peak_bytes.total;
    m.peak_bytes.total += extra;
    m.peak_bytes.activations += extra;
    // RSS is never compared: moving it alone must not matter.
    m.device_peak_bytes = Some(1 << 40);
    r
}

#[test]
fn identical_reports_pass() {
    let b = fixture();
    // A file path on one side, a directory on the other.
    let dir = write_dir(&baseline(), "identical");
    assert_eq!(run_check(&args(&dir, &b, "2%", CheckFormat::Table)), 0);
    assert_eq!(run_check(&args(&b, &b, "0", CheckFormat::Md)), 0);
    let r = compare(&baseline(), &baseline(), 0.0);
    assert!(r.passed);
    assert_eq!(r.compared.len(), 2, "{r:#?}");
    assert!(r.compared.iter().all(|c| c.verdict == CheckVerdict::Ok));
    assert!(r.regressions.is_empty() && r.improvements.is_empty());
    assert!(r.only_in_current.is_empty() && r.only_in_baseline.is_empty());
    // The oom and the skipped trial have no measurement on either side.
    assert_eq!(r.not_compared.len(), 2);
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
}

#[test]
fn device_peak_is_not_compared() {
    let mut cur = baseline();
    for t in &mut cur.trials {
        if let Some(m) = &mut t.measured {
            m.device_peak_bytes = Some(m.device_peak_bytes.unwrap_or(0) * 3);
        }
    }
    assert!(compare(&cur, &baseline(), 0.0).passed);
}

#[test]
fn planted_regression_fails_and_names_the_config() {
    let cur = planted(1.10, REGRESSED);
    let r = compare(&cur, &baseline(), 0.02);
    assert!(!r.passed);
    assert_eq!(r.regressions.len(), 1);
    let row = &r.regressions[0];
    assert_eq!(row.id, REGRESSED);
    assert_eq!(row.verdict, CheckVerdict::Regression);
    assert!((row.delta_pct.unwrap() - 10.0).abs() < 1e-3, "{row:?}");
    let acts = row
        .categories
        .iter()
        .find(|c| c.category == "activations")
        .unwrap();
    assert!(acts.delta_bytes > 0);

    let dir = write_dir(&cur, "regression");
    assert_eq!(
        run_check(&args(&dir, &fixture(), "2%", CheckFormat::Table)),
        1
    );
    // The rendered table (what run_check prints) names the config and Δ%.
    let table = render(&dir, "2%", CheckFormat::Table);
    let line = table
        .lines()
        .find(|l| l.starts_with(REGRESSED))
        .unwrap_or_else(|| panic!("no row for {REGRESSED} in\n{table}"));
    assert!(line.contains("+10.00%"), "{line}");
    assert!(line.contains("REGRESSION"), "{line}");
    assert!(table.contains("activations"), "{table}");
    assert!(table.contains("FAIL: 1 of 2"), "{table}");

    let md = render(&dir, "2%", CheckFormat::Md);
    assert!(
        md.contains("| config | baseline | current | Δ% | verdict |"),
        "{md}"
    );
    assert!(md.contains(&format!("| `{REGRESSED}` |")), "{md}");
    assert!(md.contains("+10.00%"), "{md}");
    assert!(md.starts_with("**memfit check: FAIL"), "{md}");

    let json: CheckReport = serde_json::from_str(&render(&dir, "2%", CheckFormat::Json)).unwrap();
    assert!(!json.passed);
    assert_eq!(json.schema_version, 1);
    assert_eq!(json.tolerance, 0.02);
    assert_eq!(json.regressions[0].id, REGRESSED);
    assert_eq!(
        run_check(&args(&dir, &fixture(), "2%", CheckFormat::Json)),
        1
    );
    assert_eq!(run_check(&args(&dir, &fixture(), "2%", CheckFormat::Md)), 1);
}

/// The text `run_check` prints for these arguments.
fn render(current: &Path, tolerance: &str, format: CheckFormat) -> String {
    let tol = memfit::check::parse_tolerance(tolerance).unwrap();
    let report = compare(&load_report(current).unwrap(), &baseline(), tol);
    memfit::check::render(&report, format, current, &fixture())
}

#[test]
fn within_tolerance_passes() {
    let cur = planted(1.015, REGRESSED);
    let dir = write_dir(&cur, "within");
    assert_eq!(
        run_check(&args(&dir, &fixture(), "2%", CheckFormat::Table)),
        0
    );
    // The same change fails a tighter gate; a bare number is percent.
    assert_eq!(
        run_check(&args(&dir, &fixture(), "1", CheckFormat::Table)),
        1
    );
    assert_eq!(
        run_check(&args(&dir, &fixture(), "0.5%", CheckFormat::Table)),
        1
    );
}

#[test]
fn improvements_are_listed_and_pass() {
    let cur = planted(0.8, FITTING);
    let r = compare(&cur, &baseline(), 0.02);
    assert!(r.passed);
    assert_eq!(r.improvements.len(), 1);
    assert_eq!(r.improvements[0].id, FITTING);
    assert_eq!(r.improvements[0].verdict, CheckVerdict::Improvement);
    let dir = write_dir(&cur, "improved");
    assert_eq!(
        run_check(&args(&dir, &fixture(), "2%", CheckFormat::Table)),
        0
    );
}

#[test]
fn fit_to_oom_is_a_regression() {
    let mut cur = baseline();
    let t = trial_mut(&mut cur, FITTING);
    t.outcome = Outcome::Oom;
    t.fits = false;
    t.measured = None;
    t.note = Some("out of memory: activations requested 8.00 MiB".into());
    let r = compare(&cur, &baseline(), 0.02);
    assert!(!r.passed);
    assert_eq!(r.regressions.len(), 1);
    let row = &r.regressions[0];
    assert_eq!(row.id, FITTING);
    assert_eq!(row.verdict, CheckVerdict::NoLongerFits);
    assert!(row.reason.contains("out of memory"), "{}", row.reason);
    let dir = write_dir(&cur, "fit-to-oom");
    assert_eq!(
        run_check(&args(&dir, &fixture(), "2%", CheckFormat::Table)),
        1
    );
    let table = render(&dir, "2%", CheckFormat::Table);
    let line = table.lines().find(|l| l.starts_with(FITTING)).unwrap();
    assert!(
        line.contains("oom") && line.contains("no longer fits"),
        "{line}"
    );

    // Crashes and timeouts too; the reverse (oom -> fits) is an improvement.
    for outcome in [Outcome::Crash, Outcome::Timeout] {
        let mut cur = baseline();
        let t = trial_mut(&mut cur, FITTING);
        t.outcome = outcome;
        t.fits = false;
        t.measured = None;
        assert!(!compare(&cur, &baseline(), 0.02).passed, "{outcome:?}");
    }
    let r = compare(&baseline(), &cur, 0.02);
    assert!(r.passed);
    assert_eq!(r.improvements[0].verdict, CheckVerdict::NowFits);
}

#[test]
fn one_sided_configs_are_listed_and_do_not_fail() {
    let mut cur = baseline();
    let gone = cur.trials.remove(0);
    let mut new = cur.trials[0].clone();
    new.id = "mb4-x1-none-fp32-adamw-ckpt_none-fused".into();
    cur.trials.push(new);
    let r = compare(&cur, &baseline(), 0.02);
    assert!(r.passed);
    assert_eq!(r.only_in_baseline.len(), 1);
    assert_eq!(r.only_in_baseline[0].id, gone.id);
    assert_eq!(r.only_in_current.len(), 1);
    assert_eq!(
        r.only_in_current[0].id,
        "mb4-x1-none-fp32-adamw-ckpt_none-fused"
    );
    let dir = write_dir(&cur, "one-sided");
    assert_eq!(
        run_check(&args(&dir, &fixture(), "2%", CheckFormat::Table)),
        0
    );
    let table = render(&dir, "2%", CheckFormat::Table);
    assert!(table.contains("only in current"), "{table}");
    assert!(table.contains("only in baseline"), "{table}");
    assert!(table.contains(&gone.id), "{table}");
}

#[test]
fn malformed_baseline_is_an_error_with_its_location() {
    let dir = scratch("malformed");
    let text = std::fs::read_to_string(fixture()).unwrap();
    let cut = &text[..text.len() / 2];
    let bad = dir.join("report.json");
    std::fs::write(&bad, cut).unwrap();
    assert_eq!(
        run_check(&args(&fixture(), &bad, "2%", CheckFormat::Table)),
        2
    );
    let e = load_report(&dir).unwrap_err().to_string();
    let lines = cut.lines().count();
    let prefix = format!("{}:{lines}:", bad.display());
    assert!(e.starts_with(&prefix), "{e} (wanted {prefix}COLUMN)");
    assert!(e.contains("malformed JSON"), "{e}");
}

#[test]
fn other_schema_version_is_an_error_naming_both() {
    let mut text: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture()).unwrap()).unwrap();
    text["schema_version"] = 999.into();
    // Fields of a future schema must not hide the version message.
    text["trials"] = serde_json::json!("renamed");
    let dir = scratch("schema");
    let file = dir.join("report.json");
    std::fs::write(&file, text.to_string()).unwrap();
    assert_eq!(
        run_check(&args(&file, &fixture(), "2%", CheckFormat::Table)),
        2
    );
    let e = load_report(&file).unwrap_err().to_string();
    assert!(e.contains("schema_version 999"), "{e}");
    assert!(e.contains("schema_version 1"), "{e}");
    assert!(e.starts_with(&file.display().to_string()), "{e}");
}

#[test]
fn missing_file_and_bad_tolerance_are_errors() {
    let missing = scratch("missing").join("nope");
    assert_eq!(
        run_check(&args(&missing, &fixture(), "2%", CheckFormat::Table)),
        2
    );
    assert_eq!(
        run_check(&args(&fixture(), &missing, "2%", CheckFormat::Table)),
        2
    );
    // A directory without report.json names the file it looked for.
    let empty = scratch("empty");
    let e = load_report(&empty).unwrap_err().to_string();
    assert!(e.contains("report.json"), "{e}");
    assert_eq!(
        run_check(&args(&empty, &fixture(), "2%", CheckFormat::Table)),
        2
    );
    for bad in ["two", "-1%", ""] {
        assert_eq!(
            run_check(&args(&fixture(), &fixture(), bad, CheckFormat::Table)),
            2,
            "{bad}"
        );
    }
}
