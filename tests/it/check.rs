//! `memfit check`: the CI gate on sweep reports. The baseline is a real sweep
//! of tests/fixtures/reports/tiny-sweep.yaml by this memfit (so it always
//! carries the current schema); the current reports are that report with a
//! change planted in code. Exit codes and messages come from the binary or
//! from `run_check`, which returns the code.

use crate::common;
use crate::common::{memfit, scratch};

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use memfit::check::{
    CheckOptions, CheckReport, CheckRequest, CheckVerdict, Metric, compare, gate, load_pair,
    load_report, run_check,
};
use memfit::report::DocFormat;
use memfit::report::sweep::{Outcome, SCHEMA_VERSION, SweepReport, TrialRecord};

/// The baseline's report.json, swept once per test run.
fn fixture() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let recipe = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/reports/tiny-sweep.yaml"
        );
        let dir = scratch("baseline");
        let o = memfit(&["sweep", recipe, "--out", dir.to_str().unwrap()]);
        assert!(
            o.status.success(),
            "the baseline sweep failed: {}",
            common::stderr(&o)
        );
        dir
    })
    .join("report.json")
}

fn baseline() -> SweepReport {
    load_report(&fixture()).expect("the baseline report loads")
}

/// The ids of the baseline's fitting, measured trials: the fixture has two.
fn fitting() -> (String, String) {
    let b = baseline();
    let ids: Vec<&TrialRecord> = b
        .trials
        .iter()
        .filter(|t| t.outcome == Outcome::Ran && t.fits && t.measured.is_some())
        .collect();
    assert_eq!(ids.len(), 2, "the fixture sweep changed: {:#?}", b.trials);
    (ids[0].id.clone(), ids[1].id.clone())
}

/// Writes `report` as DIR/report.json and returns that file.
fn write(report: &SweepReport, tag: &str) -> PathBuf {
    let file = scratch(tag).join("report.json");
    std::fs::write(&file, serde_json::to_string_pretty(report).unwrap()).unwrap();
    file
}

fn write_json(value: &serde_json::Value, tag: &str) -> PathBuf {
    let file = scratch(tag).join("report.json");
    std::fs::write(&file, value.to_string()).unwrap();
    file
}

fn baseline_json() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture()).unwrap()).unwrap()
}

fn args(current: &Path, baseline: &Path, tolerance: &str, format: DocFormat) -> CheckRequest {
    CheckRequest {
        current: current.to_path_buf(),
        baseline: baseline.to_path_buf(),
        tolerance: tolerance.into(),
        per_category: false,
        allow_missing: false,
        metric: Metric::Tracked,
        format,
    }
}

fn opts(tolerance: f64) -> CheckOptions {
    CheckOptions::with_tolerance(tolerance)
}

/// `memfit check CURRENT --baseline FIXTURE FLAGS`: exit code, stdout, stderr.
fn check(current: &Path, flags: &[&str]) -> (i32, String, String) {
    check_against(current, &fixture(), flags)
}

fn check_against(current: &Path, baseline: &Path, flags: &[&str]) -> (i32, String, String) {
    let mut a = vec![
        "check",
        current.to_str().unwrap(),
        "--baseline",
        baseline.to_str().unwrap(),
    ];
    a.extend(flags);
    let o = memfit(&a);
    (
        o.status.code().expect("memfit check exits with a code"),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        common::stderr(&o),
    )
}

/// What the gate refuses, as text, for `current` against the fixture.
fn refusal(current: &Path, allow_missing: bool) -> String {
    let (c, b) = load_pair(current, &fixture()).unwrap_or_else(|e| panic!("{e:?}"));
    let o = CheckOptions {
        allow_missing,
        ..opts(0.02)
    };
    let errors = gate(&c, &b, &o).expect_err("the gate refuses");
    errors
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("\n\n")
}

fn trial_mut<'a>(r: &'a mut SweepReport, id: &str) -> &'a mut TrialRecord {
    r.trials.iter_mut().find(|t| t.id == id).unwrap()
}

/// Scales one trial's total and activations peak by `factor`.
fn planted(factor: f64, id: &str) -> SweepReport {
    let mut r = baseline();
    let p = &mut trial_mut(&mut r, id).measured.as_mut().unwrap().peak_bytes;
    let extra = (p.total as f64 * factor).round() as i64 - p.total as i64;
    p.total = p.total.checked_add_signed(extra).unwrap();
    p.activations = p.activations.checked_add_signed(extra).unwrap();
    r
}

#[test]
fn identical_reports_pass() {
    let b = fixture();
    // A file path on one side, a directory on the other.
    let dir = write(&baseline(), "identical")
        .parent()
        .unwrap()
        .to_path_buf();
    assert_eq!(run_check(&args(&dir, &b, "2%", DocFormat::Table)), 0);
    assert_eq!(run_check(&args(&b, &b, "0", DocFormat::Md)), 0);
    let r = compare(&baseline(), &baseline(), &opts(0.0));
    assert!(r.passed);
    assert_eq!(r.compared.len(), 2, "{r:#?}");
    assert!(
        r.compared
            .iter()
            .all(|c| c.verdict == CheckVerdict::Ok && c.grown_categories.is_empty() && !c.fails)
    );
    assert!(r.regressions.is_empty() && r.improvements.is_empty());
    assert!(r.only_in_current.is_empty() && r.only_in_baseline.is_empty());
    // The two skipped trials have no measurement on either side.
    assert_eq!(r.not_compared.len(), 2);
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
}

/// check reads only the tracked peak: every other number a trial measured
/// (RSS, step times, cost, whatever the schema calls them) may move.
#[test]
fn nothing_but_the_tracked_peak_is_compared() {
    let mut v = baseline_json();
    let mut moved = 0;
    for t in v["trials"].as_array_mut().unwrap() {
        let Some(m) = t["measured"].as_object_mut() else {
            continue;
        };
        for (key, field) in m.iter_mut() {
            if key != "peak_bytes" && field.is_u64() {
                *field = (field.as_u64().unwrap() * 3 + 1).into();
                moved += 1;
            } else if key != "peak_bytes" && field.is_f64() {
                *field = (field.as_f64().unwrap() * 3.0 + 1.0).into();
                moved += 1;
            }
        }
    }
    assert!(moved >= 4, "nothing was moved in {v:#}");
    let file = write_json(&v, "rss");
    assert_eq!(check(&file, &["--tolerance", "0"]).0, 0);
}

#[test]
fn planted_regression_fails_and_names_the_config() {
    let (regressed, _) = fitting();
    let cur = planted(1.10, &regressed);
    let r = compare(&cur, &baseline(), &opts(0.02));
    assert!(!r.passed);
    assert_eq!(r.regressions.len(), 1);
    let row = &r.regressions[0];
    assert_eq!(row.id, regressed);
    assert_eq!(row.verdict, CheckVerdict::Regression);
    assert!(row.fails);
    assert!((row.delta_pct.unwrap() - 10.0).abs() < 1e-3, "{row:?}");
    let acts = row
        .categories
        .iter()
        .find(|c| c.category == "activations")
        .unwrap();
    assert!(acts.delta_bytes > 0 && acts.beyond_tolerance);

    let file = write(&cur, "regression");
    let (code, table, _) = check(&file, &["--tolerance", "2%"]);
    assert_eq!(code, 1);
    // The table names the config and Δ%.
    let line = table
        .lines()
        .find(|l| l.starts_with(&regressed))
        .unwrap_or_else(|| panic!("no row for {regressed} in\n{table}"));
    assert!(line.contains("+10.00%"), "{line}");
    assert!(line.contains("REGRESSION"), "{line}");
    assert!(table.contains("activations"), "{table}");
    assert!(table.contains("FAIL: 1 of 2"), "{table}");

    let (code, md, _) = check(&file, &["--format", "md"]);
    assert_eq!(code, 1);
    assert!(
        md.contains("| config | baseline | current | Δ% | verdict |"),
        "{md}"
    );
    assert!(md.contains(&format!("| `{regressed}` |")), "{md}");
    assert!(md.contains("+10.00%"), "{md}");
    assert!(md.starts_with("**memfit check: FAIL"), "{md}");

    let (code, json, _) = check(&file, &["--format", "json"]);
    assert_eq!(code, 1);
    let json: CheckReport = serde_json::from_str(&json).unwrap();
    assert!(!json.passed);
    assert_eq!(json.schema_version, SCHEMA_VERSION);
    assert_eq!(json.tolerance, 0.02);
    assert_eq!(json.regressions[0].id, regressed);
}

#[test]
fn within_tolerance_passes() {
    let (regressed, _) = fitting();
    let file = write(&planted(1.015, &regressed), "within");
    assert_eq!(
        run_check(&args(&file, &fixture(), "2%", DocFormat::Table)),
        0
    );
    // The same change fails a tighter gate; a bare number is percent.
    assert_eq!(
        run_check(&args(&file, &fixture(), "1", DocFormat::Table)),
        1
    );
    assert_eq!(
        run_check(&args(&file, &fixture(), "0.5%", DocFormat::Table)),
        1
    );
}

#[test]
fn improvements_are_listed_and_pass() {
    let (_, fits) = fitting();
    let cur = planted(0.8, &fits);
    let r = compare(&cur, &baseline(), &opts(0.02));
    assert!(r.passed);
    assert_eq!(r.improvements.len(), 1);
    assert_eq!(r.improvements[0].id, fits);
    assert_eq!(r.improvements[0].verdict, CheckVerdict::Improvement);
    assert_eq!(check(&write(&cur, "improved"), &[]).0, 0);
}

#[test]
fn fit_to_oom_is_a_regression() {
    let (_, fits) = fitting();
    let mut cur = baseline();
    let t = trial_mut(&mut cur, &fits);
    t.outcome = Outcome::Oom;
    t.fits = false;
    t.measured = None;
    t.note = Some("out of memory: activations requested 8.00 MiB".into());
    let r = compare(&cur, &baseline(), &opts(0.02));
    assert!(!r.passed);
    assert_eq!(r.regressions.len(), 1);
    let row = &r.regressions[0];
    assert_eq!(row.id, fits);
    assert_eq!(row.verdict, CheckVerdict::NoLongerFits);
    assert!(row.reason.contains("out of memory"), "{}", row.reason);
    let (code, table, _) = check(&write(&cur, "fit-to-oom"), &[]);
    assert_eq!(code, 1);
    let line = table.lines().find(|l| l.starts_with(&fits)).unwrap();
    assert!(
        line.contains("oom") && line.contains("no longer fits"),
        "{line}"
    );

    // Crashes and timeouts too; the reverse (oom -> fits) is an improvement.
    for outcome in [Outcome::Crash, Outcome::Timeout] {
        let mut cur = baseline();
        let t = trial_mut(&mut cur, &fits);
        t.outcome = outcome;
        t.fits = false;
        t.measured = None;
        assert!(
            !compare(&cur, &baseline(), &opts(0.02)).passed,
            "{outcome:?}"
        );
    }
    let r = compare(&baseline(), &cur, &opts(0.02));
    assert!(r.passed);
    assert_eq!(r.improvements[0].verdict, CheckVerdict::NowFits);
}

#[test]
fn empty_current_report_passed_the_gate() {
    let mut cur = baseline();
    cur.trials.clear();
    cur.trials_run = 0;
    let file = write(&cur, "empty");
    // --allow-missing does not make an empty report acceptable.
    for flags in [&[][..], &["--allow-missing"]] {
        let (code, out, err) = check(&file, flags);
        assert_eq!(code, 2, "{flags:?}: {out}{err}");
        assert!(out.is_empty(), "{out}");
        assert!(err.starts_with("memfit: "), "{err}");
    }
    let e = refusal(&file, true);
    assert!(e.contains("no trials (0 of 4 grid points)"), "{e}");
    assert!(e.contains(&file.display().to_string()), "{e}");
    assert!(e.contains(&fixture().display().to_string()), "{e}");

    // An empty baseline gates nothing either.
    assert_eq!(check_against(&fixture(), &file, &["--allow-missing"]).0, 2);
}

#[test]
fn interrupted_sweep_passed_the_gate() {
    // Stopped after the first two grid points: every trial it has matches
    // the baseline.
    let mut cur = baseline();
    cur.trials.truncate(2);
    cur.interrupted = true;
    let file = write(&cur, "interrupted");
    let (code, out, err) = check(&file, &[]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(out.is_empty(), "{out}");
    let e = refusal(&file, false);
    assert!(
        e.contains("interrupted sweep (2 of 4 grid points reached)"),
        "{e}"
    );
    assert!(
        e.contains("--resume") && e.contains("--allow-missing"),
        "{e}"
    );
    assert!(e.contains(&file.display().to_string()), "{e}");
    assert!(e.contains(&fixture().display().to_string()), "{e}");

    // Interrupted after its last trial: nothing is missing, but the report
    // says the sweep did not finish.
    let mut all = baseline();
    all.interrupted = true;
    assert_eq!(check(&write(&all, "interrupted-all"), &[]).0, 2);

    // An interrupted baseline leaves configs ungated as well.
    assert_eq!(check_against(&fixture(), &file, &[]).0, 2);

    let (code, out, _) = check(&file, &["--allow-missing"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("warning: ") && out.contains("interrupted"),
        "{out}"
    );
}

#[test]
fn missing_configs_passed_the_gate() {
    let (_, fits) = fitting();
    let mut cur = baseline();
    cur.trials.retain(|t| t.id != fits);
    let file = write(&cur, "missing");
    let (code, out, err) = check(&file, &[]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(out.is_empty(), "{out}");
    let e = refusal(&file, false);
    assert!(e.contains("lacks 1 config of baseline report"), "{e}");
    assert!(e.contains(&format!("`{fits}`")), "{e}");
    assert!(e.contains(&file.display().to_string()), "{e}");
    assert!(e.contains(&fixture().display().to_string()), "{e}");
    assert!(e.contains("--allow-missing"), "{e}");

    // --allow-missing lists it as a warning, in every format.
    let (code, table, _) = check(&file, &["--allow-missing"]);
    assert_eq!(code, 0, "{table}");
    let warning = table
        .lines()
        .find(|l| l.starts_with("warning: "))
        .unwrap_or_else(|| panic!("no warning in\n{table}"));
    assert!(
        warning.contains(&fits) && warning.contains("lacks"),
        "{warning}"
    );
    assert!(table.contains("only in baseline"), "{table}");
    let (code, md, _) = check(&file, &["--allow-missing", "--format", "md"]);
    assert_eq!(code, 0);
    assert!(md.contains("> warning: ") && md.contains(&fits), "{md}");
    let (code, json, _) = check(&file, &["--allow-missing", "--format", "json"]);
    assert_eq!(code, 0);
    let json: CheckReport = serde_json::from_str(&json).unwrap();
    assert_eq!(json.only_in_baseline[0].id, fits);
    assert!(json.warnings.iter().any(|w| w.contains(&fits)), "{json:?}");

    // A config the baseline lacks is not gated either.
    let mut extra = baseline();
    let mut new = extra.trials[0].clone();
    new.id.push_str("-new");
    extra.trials.push(new);
    let file = write(&extra, "extra");
    assert_eq!(check(&file, &[]).0, 2);
    let e = refusal(&file, false);
    assert!(e.contains("that baseline report"), "{e}");
    assert_eq!(check(&file, &["--allow-missing"]).0, 0);

    // No config in common: nothing was checked, whatever the flags say.
    let mut other = baseline();
    for t in &mut other.trials {
        t.id.push_str("-renamed");
    }
    let file = write(&other, "disjoint");
    assert_eq!(check(&file, &["--allow-missing"]).0, 2);
    let e = refusal(&file, true);
    assert!(e.contains("no config in common"), "{e}");
}

/// Issue 26: a current report whose trials carried `"measured": null`
/// printed `PASS: 0 config(s) compared` (exit 0), and with some of them
/// nulled it passed on the rest, listing the nulled ones as "not compared".
#[test]
fn unmeasured_current_trials_passed_the_gate() {
    let (fits, _) = fitting();
    let mut v = baseline_json();
    for t in v["trials"].as_array_mut().unwrap() {
        t["measured"] = serde_json::Value::Null;
    }
    let file = write_json(&v, "all-null");
    // Nothing compared: refused whatever the flags say.
    for flags in [&[][..], &["--allow-missing"]] {
        let (code, out, err) = check(&file, flags);
        assert_eq!(code, 2, "{flags:?}: {out}{err}");
        assert!(out.is_empty(), "{out}");
        assert!(err.contains("no config was compared"), "{err}");
    }

    let mut one = baseline();
    trial_mut(&mut one, &fits).measured = None;
    let file = write(&one, "one-null");
    let (code, out, err) = check(&file, &[]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(out.is_empty(), "{out}");
    let e = refusal(&file, false);
    assert!(
        e.contains("has no tracked peak for 1 config") && e.contains(&format!("`{fits}`")),
        "{e}"
    );
    assert!(e.contains("--allow-missing"), "{e}");
    // Accepted on request, and then said.
    let (code, out, _) = check(&file, &["--allow-missing"]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("warning: ") && l.contains(&fits)),
        "{out}"
    );
}

/// Issue 26: two trials with one id were accepted, and one of them silently
/// compared.
#[test]
fn duplicate_trial_ids_passed_the_gate() {
    let (fits, _) = fitting();
    let mut cur = planted(10.0, &fits);
    let copy = baseline()
        .trials
        .into_iter()
        .find(|t| t.id == fits)
        .unwrap();
    cur.trials.push(copy);
    let file = write(&cur, "duplicate");
    for flags in [&[][..], &["--allow-missing"]] {
        let (code, out, err) = check(&file, flags);
        assert_eq!(code, 2, "{flags:?}: {out}{err}");
        assert!(
            err.contains("more than once") && err.contains(&format!("`{fits}`")),
            "{err}"
        );
    }
    // In the baseline too.
    assert_eq!(check_against(&fixture(), &file, &[]).0, 2);
}

#[test]
fn mismatched_setup_passed_the_gate() {
    type Edit = fn(&mut SweepReport);
    let edits: [(&str, Edit); 5] = [
        ("model", |r| r.model = "gpt2-small".into()),
        ("device", |r| r.device = "meta:limit=8.00MiB".into()),
        ("seq_len", |r| r.seq_len *= 2),
        ("global_batch", |r| r.global_batch *= 2),
        ("hardware", |r| r.hardware = "a100-80gb".into()),
    ];
    for (what, edit) in edits {
        let mut cur = baseline();
        edit(&mut cur);
        let file = write(&cur, what);
        // Never a warning: --allow-missing does not make it comparable.
        for flags in [&[][..], &["--allow-missing"]] {
            let (code, out, err) = check(&file, flags);
            assert_eq!(code, 2, "{what} {flags:?}: {out}{err}");
            assert!(out.is_empty(), "{what}: {out}");
        }
        let e = refusal(&file, true);
        assert!(e.contains(&format!("differ in {what} (current ")), "{e}");
        assert!(e.contains(&file.display().to_string()), "{e}");
        assert!(e.contains(&fixture().display().to_string()), "{e}");
    }
}

/// Category peaks are each category's own highest, so one can grow while
/// the total does not; that went unreported.
#[test]
fn category_growth_behind_an_unchanged_total_went_unreported() {
    let (_, fits) = fitting();
    let mut cur = baseline();
    let p = &mut trial_mut(&mut cur, &fits)
        .measured
        .as_mut()
        .unwrap()
        .peak_bytes;
    p.activations += p.activations / 2;
    let file = write(&cur, "category");

    let r = compare(&cur, &baseline(), &opts(0.02));
    assert!(r.passed);
    let row = r.compared.iter().find(|c| c.id == fits).unwrap();
    assert_eq!(row.verdict, CheckVerdict::Ok);
    assert_eq!(row.grown_categories, ["activations"]);
    assert!(!row.fails);
    assert!(
        r.warnings
            .iter()
            .any(|w| w.contains(&fits) && w.contains("activations +50.00%")),
        "{:?}",
        r.warnings
    );

    // Reported in every format, and passing without --per-category.
    let (code, table, _) = check(&file, &[]);
    assert_eq!(code, 0, "{table}");
    let line = table.lines().find(|l| l.starts_with(&fits)).unwrap();
    assert!(line.contains("ok, activations grew"), "{line}");
    assert!(table.contains("beyond tolerance"), "{table}");
    assert!(table.contains("--per-category"), "{table}");
    let (code, md, _) = check(&file, &["--format", "md"]);
    assert_eq!(code, 0);
    let line = md.lines().find(|l| l.contains(&fits)).unwrap();
    assert!(line.contains("activations +50.00%"), "{line}");
    assert!(md.contains("> warning: "), "{md}");
    let (code, json, _) = check(&file, &["--format", "json"]);
    assert_eq!(code, 0);
    let json: CheckReport = serde_json::from_str(&json).unwrap();
    let row = json.compared.iter().find(|c| c.id == fits).unwrap();
    assert_eq!(row.grown_categories, ["activations"]);
    assert!(!json.warnings.is_empty());

    // --per-category fails the gate on it.
    let (code, table, _) = check(&file, &["--per-category"]);
    assert_eq!(code, 1, "{table}");
    let line = table.lines().find(|l| l.starts_with(&fits)).unwrap();
    assert!(line.contains("REGRESSION (activations grew)"), "{line}");
    assert!(table.contains("FAIL: 1 of 2"), "{table}");
    let (code, json, _) = check(&file, &["--per-category", "--format", "json"]);
    assert_eq!(code, 1);
    let json: CheckReport = serde_json::from_str(&json).unwrap();
    assert!(json.per_category && !json.passed);
    assert_eq!(json.regressions[0].id, fits);
    // The tolerance is the same one: 50% is within 60%.
    assert_eq!(check(&file, &["--per-category", "--tolerance", "60%"]).0, 0);
}

/// A category that grew by less than the 64 KiB floor does not count,
/// however large its growth in percent.
#[test]
fn small_category_growth_does_not_flap() {
    let (_, fits) = fitting();
    let mut cur = baseline();
    let p = &mut trial_mut(&mut cur, &fits)
        .measured
        .as_mut()
        .unwrap()
        .peak_bytes;
    let before = p.parameters;
    p.parameters += 60 * 1024;
    assert!(
        60.0 * 1024.0 > before as f64 * 0.02,
        "the growth must beat 2%"
    );
    let r = compare(&cur, &baseline(), &opts(0.02));
    assert!(r.compared.iter().all(|c| c.grown_categories.is_empty()));
    assert_eq!(check(&write(&cur, "floor"), &["--per-category"]).0, 0);
}

#[test]
fn other_schema_version_is_an_error_naming_both() {
    let future = SCHEMA_VERSION + 1;
    let mut v = baseline_json();
    v["schema_version"] = future.into();
    // Fields of another schema must not hide the version message.
    v["trials"] = serde_json::json!("renamed");
    let other = write_json(&v, "schema");
    let mut none = baseline_json();
    none.as_object_mut().unwrap().remove("schema_version");
    let unknown = write_json(&none, "no-schema");

    // The baseline of another version: regenerate it.
    let (code, out, err) = check_against(&fixture(), &other, &["--allow-missing"]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(out.is_empty(), "{out}");
    assert!(
        err.starts_with(&format!("memfit: {}: ", other.display())),
        "{err}"
    );
    assert!(err.contains(&format!("schema_version {future}")), "{err}");
    assert!(
        err.contains(&format!("schema_version {SCHEMA_VERSION}")),
        "{err}"
    );
    assert!(err.contains(&fixture().display().to_string()), "{err}");
    assert!(err.contains("regenerate the baseline"), "{err}");
    // The current one: rerun it.
    let (code, _, err) = check(&other, &[]);
    assert_eq!(code, 2);
    assert!(err.contains("rerun the sweep"), "{err}");
    // None at all.
    let (code, _, err) = check_against(&fixture(), &unknown, &[]);
    assert_eq!(code, 2);
    assert!(err.contains("no numeric schema_version"), "{err}");

    let e = load_report(&other).unwrap_err().to_string();
    assert!(e.starts_with(&other.display().to_string()), "{e}");
    assert!(e.contains(&format!("schema_version {future}")), "{e}");
}

#[test]
fn malformed_baseline_is_an_error_with_its_location() {
    let dir = scratch("malformed");
    let text = std::fs::read_to_string(fixture()).unwrap();
    let cut = &text[..text.len() / 2];
    let bad = dir.join("report.json");
    std::fs::write(&bad, cut).unwrap();
    assert_eq!(
        run_check(&args(&fixture(), &bad, "2%", DocFormat::Table)),
        2
    );
    let e = load_report(&dir).unwrap_err().to_string();
    // The parser stops at the end of the cut: the line after its last newline
    // (the fixture's timings vary, so the cut may fall right after one).
    let lines = cut.matches('\n').count() + 1;
    let prefix = format!("{}:{lines}:", bad.display());
    assert!(e.starts_with(&prefix), "{e} (wanted {prefix}COLUMN)");
    assert!(e.contains("malformed JSON"), "{e}");
}

#[test]
fn missing_file_and_bad_tolerance_are_errors() {
    let missing = scratch("missing").join("nope");
    assert_eq!(
        run_check(&args(&missing, &fixture(), "2%", DocFormat::Table)),
        2
    );
    assert_eq!(
        run_check(&args(&fixture(), &missing, "2%", DocFormat::Table)),
        2
    );
    // A directory without report.json names the file it looked for.
    let empty = scratch("empty");
    let e = load_report(&empty).unwrap_err().to_string();
    assert!(e.contains("report.json"), "{e}");
    assert_eq!(
        run_check(&args(&empty, &fixture(), "2%", DocFormat::Table)),
        2
    );
    for bad in ["two", "-1%", ""] {
        assert_eq!(
            run_check(&args(&fixture(), &fixture(), bad, DocFormat::Table)),
            2,
            "{bad}"
        );
    }
}

/// `check --help` showed "The [`CheckReport`] as JSON" for --format json.
#[test]
fn format_help_showed_rustdoc_link_text() {
    let o = memfit(&["check", "--help"]);
    assert!(o.status.success());
    let help = String::from_utf8_lossy(&o.stdout);
    assert!(!help.contains("[`"), "{help}");
    for value in ["table", "json", "md"] {
        let line = help
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("- {value}:")))
            .unwrap_or_else(|| panic!("no `{value}` value in\n{help}"));
        let (_, description) = line.split_once(':').unwrap();
        assert!(description.trim().len() > 10, "{line}");
    }
    for flag in ["--per-category", "--allow-missing", "--tolerance"] {
        assert!(help.contains(flag), "{flag} in\n{help}");
    }
    // --per-category's help and docs/plan-sweep-check.md state the floor in words.
    assert_eq!(memfit::check::CATEGORY_FLOOR_BYTES, 64 * 1024);
    assert!(help.contains("64 KiB"), "{help}");
}

/// `--metric nvml` gates on each trial's NVML peak: a grown NVML peak fails
/// with the tracked peak unchanged, and reports without NVML peaks (cpu
/// sweeps, or a GPU without NVML) are refused with the reason.
#[test]
fn metric_nvml_gates_on_nvml_peaks_and_refuses_reports_without_them() {
    let with_nvml = |grow: f64| {
        let mut r = baseline();
        r.nvml = Some("NVML, driver 550.54.15".into());
        for t in r.trials.iter_mut() {
            if let Some(m) = t.measured.as_mut() {
                m.nvml_peak_bytes = Some(((m.peak_bytes.total + (500 << 20)) as f64 * grow) as u64);
            }
        }
        r
    };
    let (b, c) = (with_nvml(1.0), with_nvml(1.10));
    let nvml = CheckOptions {
        metric: Metric::Nvml,
        ..opts(0.02)
    };
    let r = compare(&c, &b, &nvml);
    assert!(!r.passed, "{r:#?}");
    assert_eq!(r.metric, Metric::Nvml);
    assert!(
        r.regressions
            .iter()
            .all(|x| x.reason.contains("NVML peak grew")),
        "{r:#?}"
    );
    // The tracked peaks did not move: the default metric passes.
    assert!(compare(&c, &b, &opts(0.02)).passed);

    let (bf, cf) = (write(&b, "nvml-base"), write(&c, "nvml-cur"));
    let mut a = args(&cf, &bf, "2%", DocFormat::Table);
    a.metric = Metric::Nvml;
    assert_eq!(run_check(&a), 1);
    // The cpu fixture has no NVML peaks: refused, exit 2, saying why.
    let (cur, base) = load_pair(&fixture(), &bf).unwrap();
    let e = gate(&cur, &base, &nvml).expect_err("refused");
    let text = e
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        text.contains("--metric nvml") && text.contains("NVML peak"),
        "{text}"
    );
    let mut a = args(&fixture(), &bf, "2%", DocFormat::Table);
    a.metric = Metric::Nvml;
    assert_eq!(run_check(&a), 2);
}
