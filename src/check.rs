//! `memfit check CURRENT --baseline BASELINE`: the CI gate on a sweep's
//! measured memory.
//!
//! Matches the two reports' trials by their stable `id` and compares the
//! tracker's peak (`measured.peak_bytes.total`), which is deterministic: the
//! same code on the same grid point allocates the same bytes on every machine.
//! The process RSS (`device_peak_bytes`) is not compared: it moves with the
//! allocator, the libc and the machine's load.
//!
//! A config regresses when its current peak exceeds baseline x (1 + tolerance),
//! or when it fit in the baseline and now does not (out of memory, crashed,
//! timed out, predicted out of memory and skipped, or over the usable
//! capacity). Improvements (below baseline x (1 - tolerance), or a config that
//! now fits) are listed but never fail; so are configs present on one side only.
//!
//! Exit codes: 0 no regression, 1 at least one regression, 2 the check could
//! not run (a missing or unreadable report, malformed JSON, another schema
//! version, a bad `--tolerance`).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::memory::{Category, PeakBytes};
use crate::sweep::report::{Outcome, SCHEMA_VERSION, SweepReport, TrialRecord};
use crate::units::fmt_bytes;

#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// The current sweep: its output directory, or its report.json.
    pub current: PathBuf,
    /// The baseline sweep to compare against: a directory or a report.json.
    #[arg(long)]
    pub baseline: PathBuf,
    /// Allowed growth of a config's peak before it counts as a regression:
    /// "2%", "0.5%", or a bare number of percent ("2").
    #[arg(long, default_value = "2%")]
    pub tolerance: String,
    #[arg(long, value_enum, default_value_t = CheckFormat::Table)]
    pub format: CheckFormat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CheckFormat {
    /// Aligned columns for a terminal.
    Table,
    /// The [`CheckReport`] as JSON.
    Json,
    /// A Markdown table and a summary line, for `$GITHUB_STEP_SUMMARY`.
    Md,
}

/// How one config compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckVerdict {
    /// Within the tolerance either way.
    Ok,
    /// The peak grew beyond the tolerance.
    Regression,
    /// Fit in the baseline; out of memory, crashed, timed out, skipped as a
    /// predicted OOM or over the usable capacity now. Fails the check.
    NoLongerFits,
    /// The peak fell beyond the tolerance.
    Improvement,
    /// Did not fit in the baseline; fits now.
    NowFits,
}

impl CheckVerdict {
    pub fn is_regression(self) -> bool {
        matches!(self, CheckVerdict::Regression | CheckVerdict::NoLongerFits)
    }

    pub fn is_improvement(self) -> bool {
        matches!(self, CheckVerdict::Improvement | CheckVerdict::NowFits)
    }

    fn label(self) -> &'static str {
        match self {
            CheckVerdict::Ok => "ok",
            CheckVerdict::Regression => "REGRESSION",
            CheckVerdict::NoLongerFits => "REGRESSION (no longer fits)",
            CheckVerdict::Improvement => "improved",
            CheckVerdict::NowFits => "improved (now fits)",
        }
    }
}

/// One category's peak on both sides (each category's own highest, so they
/// do not add up to the total).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CategoryDelta {
    pub category: String,
    pub baseline_bytes: u64,
    pub current_bytes: u64,
    pub delta_bytes: i64,
    /// Percent of the baseline; absent when the baseline is 0.
    pub delta_pct: Option<f64>,
}

/// One config present in both reports and comparable.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    pub id: String,
    /// The knobs in words (`Point::label`).
    pub label: String,
    pub baseline_outcome: Outcome,
    pub current_outcome: Outcome,
    pub baseline_fits: bool,
    pub current_fits: bool,
    /// The tracked peak total; absent on a side that measured nothing.
    pub baseline_bytes: Option<u64>,
    pub current_bytes: Option<u64>,
    pub delta_bytes: Option<i64>,
    /// (current - baseline) / baseline, percent.
    pub delta_pct: Option<f64>,
    pub verdict: CheckVerdict,
    /// What happened, in a sentence.
    pub reason: String,
    /// Per-category peaks, for regressions measured on both sides.
    pub categories: Vec<CategoryDelta>,
}

/// A config present in one report only.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OneSided {
    pub id: String,
    pub label: String,
    pub outcome: Outcome,
    pub peak_bytes: Option<u64>,
}

/// A config in both reports that neither measured nor changed fit (both
/// skipped, both OOM, invalid, ...).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NotCompared {
    pub id: String,
    pub baseline_outcome: Outcome,
    pub current_outcome: Outcome,
}

/// The check's result (what `--format json` prints).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckReport {
    /// The sweep report schema both reports carry.
    pub schema_version: u32,
    /// Allowed growth as a fraction (0.02 is 2%).
    pub tolerance: f64,
    /// Every comparable config, in the baseline's order.
    pub compared: Vec<Comparison>,
    /// The compared configs that fail the check.
    pub regressions: Vec<Comparison>,
    /// The compared configs that got better beyond the tolerance (informational).
    pub improvements: Vec<Comparison>,
    pub only_in_current: Vec<OneSided>,
    pub only_in_baseline: Vec<OneSided>,
    pub not_compared: Vec<NotCompared>,
    /// Things that make the comparison doubtful (another model, another
    /// device, an interrupted sweep, nothing compared); they do not fail it.
    pub warnings: Vec<String>,
    pub passed: bool,
}

/// Runs the check and prints its result; returns the exit code (0 pass,
/// 1 regression, 2 error).
pub fn run_check(args: &CheckArgs) -> i32 {
    match check(args) {
        Ok((text, passed)) => {
            print!("{text}");
            if passed { 0 } else { 1 }
        }
        Err(e) => {
            eprintln!("memfit: {e}");
            2
        }
    }
}

fn check(args: &CheckArgs) -> Result<(String, bool)> {
    let tolerance = parse_tolerance(&args.tolerance)?;
    let baseline = load_report(&args.baseline)?;
    let current = load_report(&args.current)?;
    let report = compare(&current, &baseline, tolerance);
    let text = render(&report, args.format, &args.current, &args.baseline);
    Ok((text, report.passed))
}

/// The text `run_check` prints for `report`; `current` and `baseline` are the
/// paths as the user gave them (the table's header names them).
pub fn render(
    report: &CheckReport,
    format: CheckFormat,
    current: &Path,
    baseline: &Path,
) -> String {
    match format {
        CheckFormat::Table => render_table(report, current, baseline),
        CheckFormat::Json => {
            let mut s =
                serde_json::to_string_pretty(report).expect("a check report serializes to JSON");
            s.push('\n');
            s
        }
        CheckFormat::Md => render_md(report),
    }
}

/// Parses `--tolerance`: "2%", "0.5%", or "2" (a bare number is percent).
/// Returns a fraction.
pub fn parse_tolerance(text: &str) -> Result<f64> {
    let t = text.trim();
    let num = t.strip_suffix('%').unwrap_or(t).trim();
    let bad = |why: &str| {
        Error::invalid_arg(
            "--tolerance",
            format!("`{text}` {why}: expected a percentage like 2%, 0.5% or 2"),
        )
    };
    let pct: f64 = num.parse().map_err(|_| bad("is not a number"))?;
    if !pct.is_finite() || pct < 0.0 {
        return Err(bad("must be a finite, non-negative percentage"));
    }
    Ok(pct / 100.0)
}

/// Reads a sweep report: a directory holding report.json, or the file itself.
/// Syntax errors are located as `file:line:column`; a report of another
/// schema version is refused, naming both versions.
pub fn load_report(path: &Path) -> Result<SweepReport> {
    let file = if path.is_dir() {
        path.join("report.json")
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read_to_string(&file).map_err(|source| Error::Io {
        path: file.clone(),
        source,
    })?;
    let shown = file.display().to_string();
    let located = |e: &serde_json::Error, what: &str| {
        let message = e.to_string();
        // serde_json appends " at line L column C"; the location says it already.
        let message = match message.rfind(" at line ") {
            Some(i) if e.line() > 0 => message[..i].to_string(),
            _ => message,
        };
        Error::Config {
            location: if e.line() > 0 {
                format!("{shown}:{}:{}", e.line(), e.column())
            } else {
                shown.clone()
            },
            message: format!("{what}: {message}"),
        }
    };
    // The version first, so that a report of another schema gets that
    // message rather than a complaint about some field.
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| located(&e, "malformed JSON"))?;
    let version = value.get("schema_version").and_then(|v| v.as_u64());
    match version {
        Some(v) if v == u64::from(SCHEMA_VERSION) => {}
        Some(v) => {
            return Err(Error::Config {
                location: shown,
                message: format!(
                    "report has schema_version {v}, but this memfit ({}) reads schema_version {SCHEMA_VERSION}; \
                     compare reports written by the same memfit schema (rerun `memfit sweep` for one of them)",
                    env!("CARGO_PKG_VERSION")
                ),
            });
        }
        None => {
            return Err(Error::Config {
                location: shown,
                message: format!(
                    "not a memfit sweep report: no numeric `schema_version` (expected {SCHEMA_VERSION})"
                ),
            });
        }
    }
    serde_json::from_str(&text).map_err(|e| located(&e, "not a valid memfit sweep report"))
}

fn peak_of(t: &TrialRecord) -> Option<&PeakBytes> {
    t.measured.as_ref().map(|m| &m.peak_bytes)
}

/// Whether a trial's outcome says it does not fit (so a baseline fit turning
/// into it is a regression).
fn failed(t: &TrialRecord) -> bool {
    match t.outcome {
        Outcome::Oom | Outcome::Crash | Outcome::Timeout | Outcome::SkippedPredictedOom => true,
        Outcome::Ran => !t.fits,
        Outcome::SkippedByMonotonicity | Outcome::Invalid => false,
    }
}

fn fit(t: &TrialRecord) -> bool {
    t.outcome == Outcome::Ran && t.fits
}

fn outcome_words(t: &TrialRecord) -> &'static str {
    match t.outcome {
        Outcome::Ran if t.fits => "fits",
        Outcome::Ran => "ran over the usable capacity",
        Outcome::Oom => "out of memory",
        Outcome::Timeout => "timed out",
        Outcome::Crash => "crashed",
        Outcome::SkippedPredictedOom => "skipped as a predicted OOM",
        Outcome::SkippedByMonotonicity => "skipped by micro-batch monotonicity",
        Outcome::Invalid => "invalid",
    }
}

fn pct(delta: i64, base: u64) -> Option<f64> {
    (base > 0).then(|| delta as f64 / base as f64 * 100.0)
}

fn one_sided(t: &TrialRecord) -> OneSided {
    OneSided {
        id: t.id.clone(),
        label: t.point.label(),
        outcome: t.outcome,
        peak_bytes: peak_of(t).map(|p| p.total),
    }
}

/// Compares `current` against `baseline` with `tolerance` as a fraction.
pub fn compare(current: &SweepReport, baseline: &SweepReport, tolerance: f64) -> CheckReport {
    let cur: HashMap<&str, &TrialRecord> =
        current.trials.iter().map(|t| (t.id.as_str(), t)).collect();
    let base_ids: HashMap<&str, &TrialRecord> =
        baseline.trials.iter().map(|t| (t.id.as_str(), t)).collect();
    let mut compared = Vec::new();
    let mut not_compared = Vec::new();
    let mut only_in_baseline = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for b in &baseline.trials {
        if !seen.insert(b.id.as_str()) {
            continue;
        }
        let Some(&c) = cur.get(b.id.as_str()) else {
            only_in_baseline.push(one_sided(b));
            continue;
        };
        match compare_one(b, c, tolerance) {
            Some(row) => compared.push(row),
            None => not_compared.push(NotCompared {
                id: b.id.clone(),
                baseline_outcome: b.outcome,
                current_outcome: c.outcome,
            }),
        }
    }
    let mut seen_cur = std::collections::HashSet::new();
    let only_in_current: Vec<OneSided> = current
        .trials
        .iter()
        .filter(|t| seen_cur.insert(t.id.as_str()) && !base_ids.contains_key(t.id.as_str()))
        .map(one_sided)
        .collect();
    let regressions: Vec<Comparison> = compared
        .iter()
        .filter(|r| r.verdict.is_regression())
        .cloned()
        .collect();
    let improvements: Vec<Comparison> = compared
        .iter()
        .filter(|r| r.verdict.is_improvement())
        .cloned()
        .collect();
    let mut warnings = Vec::new();
    let differs = [
        ("model", &baseline.model, &current.model),
        ("hardware", &baseline.hardware, &current.hardware),
        ("device", &baseline.device, &current.device),
    ];
    for (what, b, c) in differs {
        if b != c {
            warnings.push(format!(
                "the reports differ in {what}: baseline `{b}`, current `{c}`"
            ));
        }
    }
    for (what, b, c) in [
        ("seq_len", baseline.seq_len as u64, current.seq_len as u64),
        (
            "global_batch",
            baseline.global_batch as u64,
            current.global_batch as u64,
        ),
        (
            "capacity_bytes",
            baseline.capacity_bytes,
            current.capacity_bytes,
        ),
    ] {
        if b != c {
            warnings.push(format!(
                "the reports differ in {what}: baseline {b}, current {c}"
            ));
        }
    }
    for (side, r) in [("baseline", baseline), ("current", current)] {
        if r.interrupted {
            warnings.push(format!(
                "the {side} sweep was interrupted; configs it did not reach are missing"
            ));
        }
    }
    if compared.is_empty() {
        warnings.push(
            "no config was compared: the reports share no trial measured on both sides".into(),
        );
    }
    CheckReport {
        schema_version: SCHEMA_VERSION,
        tolerance,
        passed: regressions.is_empty(),
        compared,
        regressions,
        improvements,
        only_in_current,
        only_in_baseline,
        not_compared,
        warnings,
    }
}

fn compare_one(b: &TrialRecord, c: &TrialRecord, tolerance: f64) -> Option<Comparison> {
    let (bp, cp) = (peak_of(b), peak_of(c));
    let mut row = Comparison {
        id: b.id.clone(),
        label: b.point.label(),
        baseline_outcome: b.outcome,
        current_outcome: c.outcome,
        baseline_fits: b.fits,
        current_fits: c.fits,
        baseline_bytes: bp.map(|p| p.total),
        current_bytes: cp.map(|p| p.total),
        delta_bytes: None,
        delta_pct: None,
        verdict: CheckVerdict::Ok,
        reason: String::new(),
        categories: Vec::new(),
    };
    if let (Some(bp), Some(cp)) = (bp, cp) {
        let delta = cp.total as i64 - bp.total as i64;
        row.delta_bytes = Some(delta);
        row.delta_pct = pct(delta, bp.total);
        let (bt, ct) = (bp.total as f64, cp.total as f64);
        let pct_text = row
            .delta_pct
            .map_or_else(|| "from 0 B".to_string(), |p| format!("{p:+.2}%"));
        if ct > bt * (1.0 + tolerance) {
            row.verdict = CheckVerdict::Regression;
            row.reason = format!(
                "tracked peak grew {} ({pct_text}) to {}, beyond the {} tolerance",
                fmt_bytes(delta.unsigned_abs()),
                fmt_bytes(cp.total),
                fmt_pct(tolerance * 100.0)
            );
        } else if ct < bt * (1.0 - tolerance) {
            row.verdict = CheckVerdict::Improvement;
            row.reason = format!(
                "tracked peak fell {} ({pct_text}) to {}",
                fmt_bytes(delta.unsigned_abs()),
                fmt_bytes(cp.total)
            );
        } else {
            row.reason = format!("tracked peak {pct_text}, within the tolerance");
        }
        // A fit lost within the tolerance (a peak just under the line) is
        // still lost.
        if fit(b) && failed(c) {
            row.verdict = CheckVerdict::NoLongerFits;
            row.reason = format!(
                "fit in the baseline, {} now; {}",
                outcome_words(c),
                row.reason
            );
        } else if failed(b) && fit(c) && !row.verdict.is_regression() {
            row.verdict = CheckVerdict::NowFits;
            row.reason = format!(
                "{} in the baseline, fits now; {}",
                outcome_words(b),
                row.reason
            );
        }
        if row.verdict.is_regression() {
            row.categories = Category::ALL
                .iter()
                .map(|&cat| {
                    let (x, y) = (bp.get(cat), cp.get(cat));
                    let d = y as i64 - x as i64;
                    CategoryDelta {
                        category: cat.name().to_string(),
                        baseline_bytes: x,
                        current_bytes: y,
                        delta_bytes: d,
                        delta_pct: pct(d, x),
                    }
                })
                .collect();
        }
        return Some(row);
    }
    if fit(b) && failed(c) {
        row.verdict = CheckVerdict::NoLongerFits;
        row.reason = format!("fit in the baseline, {} now", outcome_words(c));
        if let Some(note) = c.note.as_deref().filter(|n| !n.is_empty()) {
            row.reason.push_str(&format!(" ({note})"));
        }
        return Some(row);
    }
    if failed(b) && fit(c) {
        row.verdict = CheckVerdict::NowFits;
        row.reason = format!("{} in the baseline, fits now", outcome_words(b));
        return Some(row);
    }
    None
}

/// A percentage without trailing noise: 2 -> "2%", 0.5 -> "0.5%".
fn fmt_pct(p: f64) -> String {
    let r = (p * 1e6).round() / 1e6;
    format!("{r}%")
}

fn side_cell(bytes: Option<u64>, outcome: Outcome, fits: bool) -> String {
    match bytes {
        Some(b) if outcome == Outcome::Ran && !fits => format!("{} (over)", fmt_bytes(b)),
        Some(b) => fmt_bytes(b),
        None => outcome_name(outcome),
    }
}

fn outcome_name(o: Outcome) -> String {
    serde_json::to_value(o)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{o:?}"))
}

fn delta_cell(p: Option<f64>) -> String {
    p.map_or_else(|| "-".to_string(), |p| format!("{p:+.2}%"))
}

fn summary(r: &CheckReport) -> String {
    let tol = fmt_pct(r.tolerance * 100.0);
    let extra = format!(
        "{} improved, {} only in current, {} only in baseline",
        r.improvements.len(),
        r.only_in_current.len(),
        r.only_in_baseline.len()
    );
    if r.passed {
        format!(
            "PASS: {} config(s) compared, none regressed beyond {tol} ({extra})",
            r.compared.len()
        )
    } else {
        format!(
            "FAIL: {} of {} compared config(s) regressed beyond {tol} ({extra})",
            r.regressions.len(),
            r.compared.len()
        )
    }
}

/// The changed categories of a regressed row, largest growth first.
fn changed_categories(row: &Comparison) -> Vec<&CategoryDelta> {
    let mut v: Vec<&CategoryDelta> = row
        .categories
        .iter()
        .filter(|c| c.delta_bytes != 0)
        .collect();
    v.sort_by_key(|c| std::cmp::Reverse(c.delta_bytes));
    v
}

fn signed_bytes(d: i64) -> String {
    format!(
        "{}{}",
        if d < 0 { "-" } else { "+" },
        fmt_bytes(d.unsigned_abs())
    )
}

fn render_table(r: &CheckReport, current: &Path, baseline: &Path) -> String {
    let mut rows: Vec<[String; 5]> = Vec::new();
    let mut details: Vec<Vec<String>> = Vec::new();
    for c in &r.compared {
        rows.push([
            c.id.clone(),
            side_cell(c.baseline_bytes, c.baseline_outcome, c.baseline_fits),
            side_cell(c.current_bytes, c.current_outcome, c.current_fits),
            delta_cell(c.delta_pct),
            c.verdict.label().to_string(),
        ]);
        let mut d = Vec::new();
        if c.verdict.is_regression() {
            d.push(format!("    {}", c.reason));
            for cat in changed_categories(c) {
                d.push(format!(
                    "    {:<14} {:>12} -> {:>12}  {:>12}  {}",
                    cat.category,
                    fmt_bytes(cat.baseline_bytes),
                    fmt_bytes(cat.current_bytes),
                    signed_bytes(cat.delta_bytes),
                    delta_cell(cat.delta_pct)
                ));
            }
        }
        details.push(d);
    }
    for (side, list) in [
        ("only in current", &r.only_in_current),
        ("only in baseline", &r.only_in_baseline),
    ] {
        for o in list {
            let cell = side_cell(o.peak_bytes, o.outcome, true);
            let (b, c) = if side == "only in current" {
                ("-".to_string(), cell)
            } else {
                (cell, "-".to_string())
            };
            rows.push([o.id.clone(), b, c, "-".into(), side.into()]);
            details.push(Vec::new());
        }
    }
    let header = ["config", "baseline", "current", "Δ%", "verdict"];
    let mut w = header.map(|h| h.chars().count());
    for row in &rows {
        for (i, cell) in row.iter().enumerate() {
            w[i] = w[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "memfit check: {} against baseline {} (tracked peak, tolerance {})",
        current.display(),
        baseline.display(),
        fmt_pct(r.tolerance * 100.0)
    );
    let line = |cells: &[String; 5]| {
        format!(
            "{:<w0$}  {:>w1$}  {:>w2$}  {:>w3$}  {}",
            cells[0],
            cells[1],
            cells[2],
            cells[3],
            cells[4],
            w0 = w[0],
            w1 = w[1],
            w2 = w[2],
            w3 = w[3]
        )
        .trim_end()
        .to_string()
    };
    let _ = writeln!(out, "{}", line(&header.map(String::from)));
    for (row, d) in rows.iter().zip(&details) {
        let _ = writeln!(out, "{}", line(row));
        for l in d {
            let _ = writeln!(out, "{l}");
        }
    }
    if !r.not_compared.is_empty() {
        let ids: Vec<&str> = r.not_compared.iter().map(|n| n.id.as_str()).collect();
        let _ = writeln!(
            out,
            "not compared (not measured on both sides, fit unchanged): {}",
            ids.join(", ")
        );
    }
    for warning in &r.warnings {
        let _ = writeln!(out, "warning: {warning}");
    }
    let _ = writeln!(out, "{}", summary(r));
    out
}

fn md_escape(s: &str) -> String {
    s.replace('|', "\\|")
}

fn render_md(r: &CheckReport) -> String {
    let mut out = String::new();
    let s = summary(r);
    let (status, rest) = s.split_once(": ").unwrap_or((&s, ""));
    let _ = writeln!(
        out,
        "**memfit check: {status}** {} (tracked peak per config, baseline → current)\n",
        md_escape(rest)
    );
    let _ = writeln!(out, "| config | baseline | current | Δ% | verdict |");
    let _ = writeln!(out, "|:--|--:|--:|--:|:--|");
    for c in &r.compared {
        let mut verdict = if c.verdict.is_regression() {
            format!("**{}**", c.verdict.label())
        } else {
            c.verdict.label().to_string()
        };
        if c.verdict.is_regression() {
            let cats: Vec<String> = changed_categories(c)
                .iter()
                .map(|cat| {
                    format!(
                        "{} {} ({})",
                        cat.category,
                        signed_bytes(cat.delta_bytes),
                        delta_cell(cat.delta_pct)
                    )
                })
                .collect();
            if cats.is_empty() {
                verdict.push_str(&format!(": {}", c.reason));
            } else {
                verdict.push_str(&format!(": {}", cats.join(", ")));
            }
        }
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} | {} |",
            md_escape(&c.id),
            side_cell(c.baseline_bytes, c.baseline_outcome, c.baseline_fits),
            side_cell(c.current_bytes, c.current_outcome, c.current_fits),
            delta_cell(c.delta_pct),
            md_escape(&verdict)
        );
    }
    for o in &r.only_in_current {
        let _ = writeln!(
            out,
            "| `{}` | - | {} | - | only in current |",
            md_escape(&o.id),
            side_cell(o.peak_bytes, o.outcome, true)
        );
    }
    for o in &r.only_in_baseline {
        let _ = writeln!(
            out,
            "| `{}` | {} | - | - | only in baseline |",
            md_escape(&o.id),
            side_cell(o.peak_bytes, o.outcome, true)
        );
    }
    for warning in &r.warnings {
        let _ = writeln!(out, "\n> warning: {}", md_escape(warning));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tolerances_parse_as_percent() {
        assert_eq!(parse_tolerance("2%").unwrap(), 0.02);
        assert_eq!(parse_tolerance("2").unwrap(), 0.02);
        assert!((parse_tolerance("0.5%").unwrap() - 0.005).abs() < 1e-15);
        assert_eq!(parse_tolerance(" 0 % ").unwrap(), 0.0);
        for bad in ["", "%", "two", "-1%", "nan", "inf%"] {
            let e = parse_tolerance(bad).unwrap_err().to_string();
            assert!(e.starts_with("--tolerance: "), "{bad}: {e}");
        }
        assert_eq!(fmt_pct(parse_tolerance("0.5%").unwrap() * 100.0), "0.5%");
    }
}
