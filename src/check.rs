//! `memfit check CURRENT --baseline BASELINE`: the CI gate on a sweep's
//! measured memory.
//!
//! Matches the two reports' trials by their stable `id` and compares the
//! tracker's peak (`measured.peak_bytes`), which is deterministic: the same
//! code on the same grid point allocates the same bytes on every machine.
//! Nothing else a trial measured (the process RSS, step times, cost) is read:
//! it moves with the allocator, the libc and the machine's load.
//!
//! A config regresses when its current total peak exceeds baseline x
//! (1 + tolerance), or when it fit in the baseline and now does not (out of
//! memory, crashed, timed out, predicted out of memory and skipped, or over
//! the usable capacity). A category (parameters, ..., workspace) that grew
//! beyond the same tolerance of its own baseline bytes, and by at least
//! [`CATEGORY_FLOOR_BYTES`], is always reported; it fails the check only
//! under `--per-category`, since category peaks are each category's own
//! highest and can move while the total does not. Improvements are listed
//! and never fail.
//!
//! The check refuses to give a verdict (exit 2) rather than pass by accident:
//! reports of another schema version, reports of different setups (model,
//! hardware, device, seq_len, global_batch), a report without trials or two
//! reports with no config in common, a report that lists a config twice, or
//! a check that compared no config at all. An interrupted sweep on either
//! side, configs present in one report only, or configs the baseline
//! measured and the current report did not, are refused too unless
//! `--allow-missing` turns them into warnings.
//!
//! Exit codes: 0 no regression, 1 at least one regression, 2 the check could
//! not run (and stdout is empty; each problem is a paragraph on stderr).

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::memory::{Category, PeakBytes};
use crate::report::DocFormat;
use crate::report::sweep::{Outcome, SCHEMA_VERSION, SweepReport, TrialRecord};
use crate::units::fmt_bytes;

/// A category must grow by at least this much to count as grown: the
/// tolerance alone would flag a 10 KiB category that gained 1 KiB, which no
/// one acts on. It also lets a category that was 0 in the baseline count.
pub const CATEGORY_FLOOR_BYTES: u64 = 64 * 1024;

/// How many config ids a message names before it says "and N more".
const IDS_SHOWN: usize = 5;

/// What `memfit check` is asked (`cli::CheckArgs` fills it).
#[derive(Clone, Debug)]
pub struct CheckRequest {
    /// The current sweep: its output directory, or its report.json.
    pub current: PathBuf,
    /// The baseline sweep: a directory or a report.json.
    pub baseline: PathBuf,
    /// `--tolerance` as given ("2%", "0.5%", "2").
    pub tolerance: String,
    pub per_category: bool,
    pub allow_missing: bool,
    pub metric: Metric,
    pub format: DocFormat,
}

/// The peak a check compares.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// The tracker's peak, total and per category (deterministic).
    #[default]
    Tracked,
    /// The trial process's NVML peak (total only).
    Nvml,
}

impl Metric {
    fn words(self) -> &'static str {
        match self {
            Metric::Tracked => "tracked peak",
            Metric::Nvml => "NVML peak",
        }
    }
}

/// What the flags ask of a check.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CheckOptions {
    /// Allowed growth as a fraction (0.02 is 2%).
    pub tolerance: f64,
    /// A category grown beyond the tolerance fails the check.
    pub per_category: bool,
    /// Configs on one side only and interrupted sweeps are warnings, not errors.
    pub allow_missing: bool,
    /// The peak compared.
    pub metric: Metric,
}

impl CheckOptions {
    /// Gates on the total only, refuses missing configs.
    pub fn with_tolerance(tolerance: f64) -> CheckOptions {
        CheckOptions {
            tolerance,
            per_category: false,
            allow_missing: false,
            metric: Metric::Tracked,
        }
    }

    pub fn from_request(args: &CheckRequest) -> Result<CheckOptions> {
        Ok(CheckOptions {
            tolerance: parse_tolerance(&args.tolerance)?,
            per_category: args.per_category,
            allow_missing: args.allow_missing,
            metric: args.metric,
        })
    }
}

/// How one config's total peak compares.
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
    /// Grew beyond the tolerance of its baseline bytes and by at least
    /// `category_floor_bytes`.
    pub beyond_tolerance: bool,
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
    /// The total's verdict.
    pub verdict: CheckVerdict,
    /// The categories beyond the tolerance (see `CategoryDelta`), whatever
    /// the total did.
    pub grown_categories: Vec<String>,
    /// This config fails the check: its verdict is a regression, or a
    /// category grew under `--per-category`.
    pub fails: bool,
    /// What happened, in a sentence.
    pub reason: String,
    /// Per-category peaks, when both sides measured.
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
    /// Allowed growth as a fraction (0.02 is 2%), of the total and of each category.
    pub tolerance: f64,
    /// The least growth that counts for a category, bytes.
    pub category_floor_bytes: u64,
    /// A grown category fails the check (`--per-category`).
    pub per_category: bool,
    /// The peak compared (`--metric`).
    #[serde(default)]
    pub metric: Metric,
    /// Configs on one side only were accepted as warnings (`--allow-missing`).
    pub allow_missing: bool,
    /// Every comparable config, in the baseline's order.
    pub compared: Vec<Comparison>,
    /// The compared configs that fail the check.
    pub regressions: Vec<Comparison>,
    /// The compared configs that got better beyond the tolerance (informational).
    pub improvements: Vec<Comparison>,
    pub only_in_current: Vec<OneSided>,
    pub only_in_baseline: Vec<OneSided>,
    pub not_compared: Vec<NotCompared>,
    /// What did not fail the check but should be read: categories grown
    /// while the total did not (without `--per-category`), configs on one
    /// side only and interrupted sweeps (under `--allow-missing`), another
    /// capacity or headroom, nothing measured on both sides.
    pub warnings: Vec<String>,
    pub passed: bool,
}

/// Runs the check and prints its result; returns the exit code (0 pass,
/// 1 regression, 2 error).
pub fn run_check(args: &CheckRequest) -> i32 {
    match check(args) {
        Ok((text, passed)) => {
            print!("{text}");
            if passed { 0 } else { 1 }
        }
        Err(problems) => {
            for (i, e) in problems.iter().enumerate() {
                if i > 0 {
                    eprintln!();
                }
                eprintln!("memfit: {e}");
            }
            2
        }
    }
}

fn check(args: &CheckRequest) -> std::result::Result<(String, bool), Vec<Error>> {
    let opts = CheckOptions::from_request(args).map_err(|e| vec![e])?;
    let (current, baseline) = load_pair(&args.current, &args.baseline)?;
    let report = gate(&current, &baseline, &opts)?;
    let text = render(&report, args.format, &args.current, &args.baseline);
    Ok((text, report.passed))
}

/// A report and the file it was read from.
#[derive(Clone, Debug)]
pub struct LoadedReport {
    pub file: PathBuf,
    pub report: SweepReport,
}

/// Checks that the two reports can be compared, then compares them. `Err`
/// holds every reason the check cannot give a verdict (exit 2), each naming
/// both files; configs on one side only and interrupted sweeps are among
/// them unless `opts.allow_missing`, which lists them as warnings instead.
pub fn gate(
    current: &LoadedReport,
    baseline: &LoadedReport,
    opts: &CheckOptions,
) -> std::result::Result<CheckReport, Vec<Error>> {
    let pair = Pair {
        cur: &current.report,
        base: &baseline.report,
        cur_file: current.file.display().to_string(),
        base_file: baseline.file.display().to_string(),
    };
    if let Some(e) = pair.setup_differs() {
        return Err(vec![e]);
    }
    let mut errors = pair.empty_reports();
    if opts.metric == Metric::Nvml {
        errors.extend(pair.missing_nvml());
    }
    errors.extend(pair.duplicates());
    if !errors.is_empty() {
        return Err(errors);
    }
    let base_ids: HashSet<&str> = pair.base.trials.iter().map(|t| t.id.as_str()).collect();
    if !pair
        .cur
        .trials
        .iter()
        .any(|t| base_ids.contains(t.id.as_str()))
    {
        return Err(vec![pair.nothing_in_common()]);
    }

    let mut report = compare(pair.cur, pair.base, opts);
    let incomplete = pair.incomplete(&report, opts.metric);
    // Whatever was accepted as missing, a check that compared nothing has
    // checked nothing: passing it would let any change through.
    if report.compared.is_empty() {
        return Err(vec![pair.nothing_compared(&base_ids, &incomplete)]);
    }
    if opts.allow_missing {
        // First: they qualify everything else the report says.
        let notes = incomplete
            .iter()
            .map(|(file, what, _)| format!("{file}: {what} (accepted: --allow-missing)"));
        report.warnings.splice(0..0, notes);
        Ok(report)
    } else if incomplete.is_empty() {
        Ok(report)
    } else {
        Err(incomplete
            .into_iter()
            .map(|(file, what, fix)| {
                problem(
                    file,
                    format!(
                        "{what}. {fix}, or pass --allow-missing to list such configs as warnings"
                    ),
                )
            })
            .collect())
    }
}

fn problem(file: &str, message: String) -> Error {
    Error::Config {
        location: file.to_string(),
        message,
    }
}

/// What a check cannot give a verdict on: in which file, what is wrong,
/// and how to fix it.
type Incomplete<'a> = (&'a str, String, String);

/// The two reports a check compares, and their files.
struct Pair<'a> {
    cur: &'a SweepReport,
    base: &'a SweepReport,
    cur_file: String,
    base_file: String,
}

impl Pair<'_> {
    /// Each report with its side's name and file, then the other side's.
    fn sides(&self) -> [(&'static str, &SweepReport, &str, &'static str, &str); 2] {
        [
            (
                "current",
                self.cur,
                &self.cur_file,
                "baseline",
                &self.base_file,
            ),
            (
                "baseline",
                self.base,
                &self.base_file,
                "current",
                &self.cur_file,
            ),
        ]
    }

    /// Reports of different setups: their peaks differ for more than the code.
    fn setup_differs(&self) -> Option<Error> {
        let differs = setup_differences(self.cur, self.base);
        (!differs.is_empty()).then(|| {
            problem(
                &self.cur_file,
                format!(
                    "the current report cannot be compared with baseline report {}: \
                     they differ in {}, so their peaks differ for reasons other than the code. \
                     Compare sweeps of the same recipe, or regenerate the baseline for the new setup",
                    self.base_file,
                    join_and(&differs)
                ),
            )
        })
    }

    fn empty_reports(&self) -> Vec<Error> {
        let mut errors = Vec::new();
        for (side, r, file, other_side, other) in self.sides() {
            if r.trials.is_empty() {
                errors.push(problem(
                    file,
                    format!(
                        "the {side} report has no trials (0 of {} grid points), so there is \
                         nothing to compare with {other_side} report {other}{}. Rerun the sweep",
                        r.grid_size,
                        if r.interrupted {
                            "; the sweep was interrupted before its first trial"
                        } else {
                            ""
                        }
                    ),
                ));
            }
        }
        errors
    }

    /// Under `--metric nvml`, a side whose measured trials lack NVML peaks.
    fn missing_nvml(&self) -> Vec<Error> {
        let mut errors = Vec::new();
        for (side, r, file, _, _) in self.sides() {
            let ran = r.trials.iter().filter(|t| t.measured.is_some()).count();
            let sampled = r
                .trials
                .iter()
                .filter(|t| {
                    t.measured
                        .as_ref()
                        .is_some_and(|m| m.nvml_peak_bytes.is_some())
                })
                .count();
            if ran > 0 && sampled < ran {
                errors.push(problem(
                    file,
                    format!(
                        "--metric nvml: {sampled} of the {side} report's {ran} measured trials have an NVML peak ({}); NVML peaks come from sweeps on a GPU (device: cuda) with NVML. Gate on the tracked peak (the default), or sweep on a GPU",
                        r.nvml.as_deref().unwrap_or("the sweep ran on no GPU")
                    ),
                ));
            }
        }
        errors
    }

    /// A report that lists one config twice was written by something other
    /// than a sweep (or two reports were spliced): which of the two copies
    /// would be compared is arbitrary, so neither is.
    fn duplicates(&self) -> Vec<Error> {
        let mut errors = Vec::new();
        for (side, r, file, _, _) in self.sides() {
            let mut seen = HashSet::new();
            let mut twice: Vec<&str> = Vec::new();
            for t in &r.trials {
                if !seen.insert(t.id.as_str()) && !twice.contains(&t.id.as_str()) {
                    twice.push(t.id.as_str());
                }
            }
            if !twice.is_empty() {
                errors.push(problem(
                    file,
                    format!(
                        "the {side} report lists {} more than once ({}), so which of the copies \
                         to compare is a guess. A sweep writes each grid point once: rerun it, \
                         or remove the duplicate trials",
                        configs(twice.len()),
                        id_list(twice.iter().copied())
                    ),
                ));
            }
        }
        errors
    }

    fn nothing_in_common(&self) -> Error {
        problem(
            &self.cur_file,
            format!(
                "the current report and baseline report {} have no config in common \
                 (no trial id matches, e.g. current `{}`, baseline `{}`), so nothing could be \
                 checked. Sweep the baseline's grid, or regenerate the baseline with this grid",
                self.base_file, self.cur.trials[0].id, self.base.trials[0].id
            ),
        )
    }

    /// What the comparison could not check: interrupted sweeps, configs on
    /// one side only, and configs the baseline measured but the current
    /// report did not.
    fn incomplete(&self, report: &CheckReport, metric: Metric) -> Vec<Incomplete<'_>> {
        let base_file = &self.base_file;
        let mut incomplete: Vec<Incomplete> = Vec::new();
        for (side, r, file, other_side, other) in self.sides() {
            if r.interrupted {
                incomplete.push((
                    file,
                    format!(
                        "the {side} report is an interrupted sweep ({} of {} grid points reached), \
                         so the configs it did not reach are not checked against {other_side} report {other}",
                        r.trials.len(),
                        r.grid_size,
                    ),
                    format!(
                        "Finish it with `{}`",
                        sweep_command(Some(&r.recipe), Path::new(file), " --resume")
                    ),
                ));
            }
        }
        if !report.only_in_baseline.is_empty() {
            incomplete.push((
                &self.cur_file,
                format!(
                    "the current report lacks {} of baseline report {base_file} ({}), so {} not checked",
                    configs(report.only_in_baseline.len()),
                    ids(&report.only_in_baseline),
                    it_is(report.only_in_baseline.len()),
                ),
                "Sweep the baseline's grid".into(),
            ));
        }
        let unmeasured = self.unmeasured(report, metric);
        if !unmeasured.is_empty() {
            incomplete.push((
                &self.cur_file,
                format!(
                    "the current report has no {} for {} that baseline report {base_file} measured ({}), \
                     so {} not checked",
                    metric.words(),
                    configs(unmeasured.len()),
                    id_list(unmeasured.iter().copied()),
                    it_is(unmeasured.len()),
                ),
                "Rerun the sweep so that every config the baseline measured is measured again"
                    .into(),
            ));
        }
        if !report.only_in_current.is_empty() {
            incomplete.push((
                &self.cur_file,
                format!(
                    "the current report has {} that baseline report {base_file} lacks ({}), so {} not checked",
                    configs(report.only_in_current.len()),
                    ids(&report.only_in_current),
                    it_is(report.only_in_current.len()),
                ),
                "Regenerate the baseline with this grid".into(),
            ));
        }
        incomplete
    }

    /// Measured in the baseline, not in the current report (a trial whose
    /// measurement was lost, or that ran without one): its peak is unknown,
    /// so it cannot count as checked.
    fn unmeasured<'r>(&self, report: &'r CheckReport, metric: Metric) -> Vec<&'r str> {
        report
            .not_compared
            .iter()
            .filter(|n| {
                let b = self.base.trials.iter().find(|t| t.id == n.id);
                let c = self.cur.trials.iter().find(|t| t.id == n.id);
                match (b, c) {
                    (Some(b), Some(c)) => {
                        !measured(c, metric) && (measured(b, metric) || c.outcome == Outcome::Ran)
                    }
                    _ => false,
                }
            })
            .map(|n| n.id.as_str())
            .collect()
    }

    fn nothing_compared(&self, base_ids: &HashSet<&str>, incomplete: &[Incomplete]) -> Error {
        problem(
            &self.cur_file,
            format!(
                "no config was compared: none of the {} the current report shares with baseline \
                 report {} was measured on both sides or changed fit, so nothing was \
                 checked{}. Rerun the sweep",
                configs(
                    self.cur
                        .trials
                        .iter()
                        .filter(|t| base_ids.contains(t.id.as_str()))
                        .count()
                ),
                self.base_file,
                if incomplete.is_empty() {
                    String::new()
                } else {
                    format!(
                        " ({})",
                        incomplete
                            .iter()
                            .map(|(_, what, _)| what.as_str())
                            .collect::<Vec<_>>()
                            .join("; ")
                    )
                }
            ),
        )
    }
}

/// The setup fields two comparable reports share, as "what (current, baseline)".
fn setup_differences(cur: &SweepReport, base: &SweepReport) -> Vec<String> {
    let mut d = Vec::new();
    for (what, c, b) in [
        ("model", &cur.model, &base.model),
        ("hardware", &cur.hardware, &base.hardware),
        ("device", &cur.device, &base.device),
    ] {
        if c != b {
            d.push(format!("{what} (current `{c}`, baseline `{b}`)"));
        }
    }
    for (what, c, b) in [
        ("seq_len", cur.seq_len, base.seq_len),
        ("global_batch", cur.global_batch, base.global_batch),
    ] {
        if c != b {
            d.push(format!("{what} (current {c}, baseline {b})"));
        }
    }
    d
}

/// "a", "a and b", "a, b and c".
fn join_and(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

fn configs(n: usize) -> String {
    format!("{n} config{}", if n == 1 { "" } else { "s" })
}

fn it_is(n: usize) -> &'static str {
    if n == 1 { "it is" } else { "they are" }
}

/// Up to `IDS_SHOWN` ids, then how many more.
fn ids(list: &[OneSided]) -> String {
    id_list(list.iter().map(|o| o.id.as_str()))
}

/// Up to `IDS_SHOWN` ids, quoted, then how many more.
fn id_list<'a>(list: impl ExactSizeIterator<Item = &'a str>) -> String {
    let n = list.len();
    let mut s: Vec<String> = list.take(IDS_SHOWN).map(|id| format!("`{id}`")).collect();
    if n > IDS_SHOWN {
        s.push(format!("{} more", n - IDS_SHOWN));
    }
    join_and(&s)
}

/// The sweep command that (re)writes the report in `file`.
fn sweep_command(recipe: Option<&str>, file: &Path, extra: &str) -> String {
    let dir = file
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    format!(
        "memfit sweep {} --out {}{extra}",
        recipe.unwrap_or("RECIPE"),
        dir.display()
    )
}

/// The text `run_check` prints for `report`; `current` and `baseline` are the
/// paths as the user gave them (the table's header names them).
pub fn render(report: &CheckReport, format: DocFormat, current: &Path, baseline: &Path) -> String {
    match format {
        DocFormat::Table => render_table(report, current, baseline),
        DocFormat::Json => {
            let mut s =
                serde_json::to_string_pretty(report).expect("a check report serializes to JSON");
            s.push('\n');
            s
        }
        DocFormat::Md => render_md(report),
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

/// A report file as text, before its schema is known.
struct RawReport {
    file: PathBuf,
    text: String,
    value: serde_json::Value,
}

impl RawReport {
    /// Reads a directory's report.json, or the file itself. Syntax errors
    /// are located as `file:line:column`.
    fn read(path: &Path) -> Result<RawReport> {
        let file = if path.is_dir() {
            path.join("report.json")
        } else {
            path.to_path_buf()
        };
        let bytes = crate::config::input::read_bounded(
            &file,
            crate::config::input::MAX_DATA_BYTES,
            "sweep reports",
        )?;
        let text = String::from_utf8(bytes).map_err(|e| Error::Config {
            location: file.display().to_string(),
            message: format!(
                "not UTF-8 text (at byte {}), so not a report memfit wrote",
                e.utf8_error().valid_up_to()
            ),
        })?;
        let value =
            serde_json::from_str(&text).map_err(|e| located(&file, &e, "malformed JSON"))?;
        Ok(RawReport { file, text, value })
    }

    fn version(&self) -> Option<u64> {
        self.value.get("schema_version").and_then(|v| v.as_u64())
    }

    fn version_words(&self) -> String {
        match self.version() {
            Some(v) => format!("schema_version {v}"),
            None => "no numeric schema_version".into(),
        }
    }

    fn parse(&self) -> Result<SweepReport> {
        serde_json::from_str(&self.text)
            .map_err(|e| located(&self.file, &e, "not a valid memfit sweep report"))
    }

    /// `memfit sweep` as this report was made, to regenerate it.
    fn regenerate(&self) -> String {
        let recipe = self.value.get("recipe").and_then(|v| v.as_str());
        sweep_command(recipe, &self.file, "")
    }
}

fn located(file: &Path, e: &serde_json::Error, what: &str) -> Error {
    let message = e.to_string();
    // serde_json appends " at line L column C"; the location says it already.
    let message = match message.rfind(" at line ") {
        Some(i) if e.line() > 0 => message[..i].to_string(),
        _ => message,
    };
    let shown = file.display();
    Error::Config {
        location: if e.line() > 0 {
            format!("{shown}:{}:{}", e.line(), e.column())
        } else {
            shown.to_string()
        },
        message: format!("{what}: {message}"),
    }
}

/// Reads one sweep report: a directory holding report.json, or the file
/// itself. A report of another schema version is refused, before any of
/// its fields are read.
pub fn load_report(path: &Path) -> Result<SweepReport> {
    let raw = RawReport::read(path)?;
    if raw.version() != Some(u64::from(SCHEMA_VERSION)) {
        return Err(Error::Config {
            location: raw.file.display().to_string(),
            message: format!(
                "the report has {}, but this memfit ({}) reads schema_version {SCHEMA_VERSION}; \
                 regenerate it with this memfit (`{}`)",
                raw.version_words(),
                env!("CARGO_PKG_VERSION"),
                raw.regenerate()
            ),
        });
    }
    raw.parse()
}

/// Reads both reports of a check. Every problem is in the `Err`: unreadable
/// or malformed files, and a schema version other than this memfit's on
/// either side, named against the other file.
pub fn load_pair(
    current: &Path,
    baseline: &Path,
) -> std::result::Result<(LoadedReport, LoadedReport), Vec<Error>> {
    let (cur, base) = match (RawReport::read(current), RawReport::read(baseline)) {
        (Ok(c), Ok(b)) => (c, b),
        (c, b) => return Err([c.err(), b.err()].into_iter().flatten().collect()),
    };
    let ours = Some(u64::from(SCHEMA_VERSION));
    let mut errors = Vec::new();
    for (side, raw, other_side, other, advice) in [
        ("current", &cur, "baseline", &base, "rerun the sweep"),
        (
            "baseline",
            &base,
            "current",
            &cur,
            "regenerate the baseline",
        ),
    ] {
        if raw.version() != ours {
            errors.push(Error::Config {
                location: raw.file.display().to_string(),
                message: format!(
                    "the {side} report has {} and {other_side} report {} has {}, but this memfit \
                     ({}) compares schema_version {SCHEMA_VERSION} reports only: {advice} with this \
                     memfit version (`{}`)",
                    raw.version_words(),
                    other.file.display(),
                    other.version_words(),
                    env!("CARGO_PKG_VERSION"),
                    raw.regenerate()
                ),
            });
        }
    }
    if !errors.is_empty() {
        return Err(errors);
    }
    match (cur.parse(), base.parse()) {
        (Ok(c), Ok(b)) => Ok((
            LoadedReport {
                file: cur.file,
                report: c,
            },
            LoadedReport {
                file: base.file,
                report: b,
            },
        )),
        (c, b) => Err([c.err(), b.err()].into_iter().flatten().collect()),
    }
}

/// Whether `t` carries the peak `metric` compares.
fn measured(t: &TrialRecord, metric: Metric) -> bool {
    match metric {
        Metric::Tracked => t.measured.is_some(),
        Metric::Nvml => nvml_of(t).is_some(),
    }
}

fn peak_of(t: &TrialRecord) -> Option<&PeakBytes> {
    t.measured.as_ref().map(|m| &m.peak_bytes)
}

/// A trial's NVML peak as a total without categories.
fn nvml_of(t: &TrialRecord) -> Option<PeakBytes> {
    t.measured.as_ref()?.nvml_peak_bytes.map(|total| PeakBytes {
        total,
        ..PeakBytes::default()
    })
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

/// Compares `current` against `baseline` config by config. It does not ask
/// whether the two may be compared at all: [`gate`] does, then calls this.
pub fn compare(current: &SweepReport, baseline: &SweepReport, opts: &CheckOptions) -> CheckReport {
    let cur: HashMap<&str, &TrialRecord> =
        current.trials.iter().map(|t| (t.id.as_str(), t)).collect();
    let base_ids: HashSet<&str> = baseline.trials.iter().map(|t| t.id.as_str()).collect();
    let mut compared = Vec::new();
    let mut not_compared = Vec::new();
    let mut only_in_baseline = Vec::new();
    let mut seen = HashSet::new();
    for b in &baseline.trials {
        if !seen.insert(b.id.as_str()) {
            continue;
        }
        let Some(&c) = cur.get(b.id.as_str()) else {
            only_in_baseline.push(one_sided(b));
            continue;
        };
        match compare_one(b, c, opts) {
            Some(row) => compared.push(row),
            None => not_compared.push(NotCompared {
                id: b.id.clone(),
                baseline_outcome: b.outcome,
                current_outcome: c.outcome,
            }),
        }
    }
    let mut seen_cur = HashSet::new();
    let only_in_current: Vec<OneSided> = current
        .trials
        .iter()
        .filter(|t| seen_cur.insert(t.id.as_str()) && !base_ids.contains(t.id.as_str()))
        .map(one_sided)
        .collect();
    let regressions: Vec<Comparison> = compared.iter().filter(|r| r.fails).cloned().collect();
    let improvements: Vec<Comparison> = compared
        .iter()
        .filter(|r| r.verdict.is_improvement())
        .cloned()
        .collect();

    let mut warnings = Vec::new();
    let grown: Vec<&Comparison> = compared
        .iter()
        .filter(|r| !r.fails && !r.grown_categories.is_empty())
        .collect();
    if !grown.is_empty() {
        let mut named: Vec<String> = grown
            .iter()
            .take(IDS_SHOWN)
            .map(|r| format!("`{}` with {}", r.id, grown_words(r)))
            .collect();
        if grown.len() > IDS_SHOWN {
            named.push(format!("{} more", grown.len() - IDS_SHOWN));
        }
        warnings.push(format!(
            "{} grew beyond the {} tolerance in a category while the total peak did not: {}; \
             only the total is gated, so pass --per-category to fail on this",
            configs(grown.len()),
            fmt_pct(opts.tolerance * 100.0),
            join_and(&named)
        ));
    }
    // Fit is judged against these, so a verdict that changed fit may be
    // theirs rather than the code's. (An unlimited cpu device's capacity is
    // the host's available memory, which differs from run to run.)
    if baseline.capacity_bytes != current.capacity_bytes {
        warnings.push(format!(
            "the reports differ in capacity: baseline {}, current {}; fit verdicts depend on it",
            fmt_bytes(baseline.capacity_bytes),
            fmt_bytes(current.capacity_bytes)
        ));
    }
    if baseline.headroom != current.headroom {
        warnings.push(format!(
            "the reports differ in headroom: baseline {}, current {}; fit verdicts depend on it",
            baseline.headroom, current.headroom
        ));
    }
    if compared.is_empty() {
        warnings.push(
            "no config was compared: no config shared by the reports was measured on both sides \
             or changed fit"
                .into(),
        );
    }
    CheckReport {
        schema_version: SCHEMA_VERSION,
        tolerance: opts.tolerance,
        category_floor_bytes: CATEGORY_FLOOR_BYTES,
        per_category: opts.per_category,
        metric: opts.metric,
        allow_missing: opts.allow_missing,
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

/// Every category's peak on both sides, each flagged when it grew beyond
/// `tolerance` of its baseline bytes and by at least `CATEGORY_FLOOR_BYTES`.
fn category_deltas(bp: &PeakBytes, cp: &PeakBytes, tolerance: f64) -> Vec<CategoryDelta> {
    Category::ALL
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
                beyond_tolerance: y as f64 > x as f64 * (1.0 + tolerance)
                    && y.saturating_sub(x) >= CATEGORY_FLOOR_BYTES,
            }
        })
        .collect()
}

/// "activations +50.00% (+618.50 KiB), workspace +64.00 KiB" for a row's
/// grown categories.
fn grown_words(row: &Comparison) -> String {
    let words: Vec<String> = row
        .categories
        .iter()
        .filter(|c| c.beyond_tolerance)
        .map(|c| match c.delta_pct {
            Some(p) => format!("{} {p:+.2}% ({})", c.category, signed_bytes(c.delta_bytes)),
            None => format!("{} {} from 0 B", c.category, signed_bytes(c.delta_bytes)),
        })
        .collect();
    join_and(&words)
}

fn compare_one(b: &TrialRecord, c: &TrialRecord, opts: &CheckOptions) -> Option<Comparison> {
    let tolerance = opts.tolerance;
    let (bn, cn) = (nvml_of(b), nvml_of(c));
    let (bp, cp) = match opts.metric {
        Metric::Tracked => (peak_of(b), peak_of(c)),
        Metric::Nvml => (bn.as_ref(), cn.as_ref()),
    };
    let what = opts.metric.words();
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
        grown_categories: Vec::new(),
        fails: false,
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
                "{what} grew {} ({pct_text}) to {}, beyond the {} tolerance",
                fmt_bytes(delta.unsigned_abs()),
                fmt_bytes(cp.total),
                fmt_pct(tolerance * 100.0)
            );
        } else if ct < bt * (1.0 - tolerance) {
            row.verdict = CheckVerdict::Improvement;
            row.reason = format!(
                "{what} fell {} ({pct_text}) to {}",
                fmt_bytes(delta.unsigned_abs()),
                fmt_bytes(cp.total)
            );
        } else {
            row.reason = format!("{what} {pct_text}, within the tolerance");
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
        row.categories = category_deltas(bp, cp, tolerance);
        row.grown_categories = row
            .categories
            .iter()
            .filter(|c| c.beyond_tolerance)
            .map(|c| c.category.clone())
            .collect();
        if !row.grown_categories.is_empty() && !row.verdict.is_regression() {
            let _ = write!(
                row.reason,
                "; a category grew beyond it: {}{}",
                grown_words(&row),
                if opts.per_category {
                    ", gated by --per-category"
                } else {
                    ", not gated without --per-category"
                }
            );
        }
        row.fails =
            row.verdict.is_regression() || (opts.per_category && !row.grown_categories.is_empty());
        return Some(row);
    }
    if fit(b) && failed(c) {
        row.verdict = CheckVerdict::NoLongerFits;
        row.fails = true;
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

/// The verdict column: the total's verdict, and any grown category.
fn verdict_label(row: &Comparison) -> String {
    let label = row.verdict.label();
    if row.grown_categories.is_empty() || row.verdict.is_regression() {
        label.to_string()
    } else if row.fails {
        format!("REGRESSION ({} grew)", row.grown_categories.join(", "))
    } else {
        format!("{label}, {} grew", row.grown_categories.join(", "))
    }
}

/// Rows that get their reason and categories spelled out.
fn detailed(row: &Comparison) -> bool {
    row.fails || !row.grown_categories.is_empty()
}

fn summary(r: &CheckReport) -> String {
    let tol = fmt_pct(r.tolerance * 100.0);
    let mut extra = Vec::new();
    let ungated = r
        .compared
        .iter()
        .filter(|c| !c.fails && !c.grown_categories.is_empty())
        .count();
    if ungated > 0 {
        extra.push(format!(
            "{ungated} grew in a category, not gated without --per-category"
        ));
    }
    extra.push(format!("{} improved", r.improvements.len()));
    extra.push(format!("{} only in current", r.only_in_current.len()));
    extra.push(format!("{} only in baseline", r.only_in_baseline.len()));
    let extra = extra.join(", ");
    let what = if r.per_category {
        "in total or in a category "
    } else {
        ""
    };
    if r.passed {
        format!(
            "PASS: {} config(s) compared, none regressed {what}beyond {tol} ({extra})",
            r.compared.len()
        )
    } else {
        format!(
            "FAIL: {} of {} compared config(s) regressed {what}beyond {tol} ({extra})",
            r.regressions.len(),
            r.compared.len()
        )
    }
}

/// The changed categories of a row, largest growth first.
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
            verdict_label(c),
        ]);
        let mut d = Vec::new();
        if detailed(c) {
            d.push(format!("    {}", c.reason));
            for cat in changed_categories(c) {
                d.push(
                    format!(
                        "    {:<14} {:>12} -> {:>12}  {:>12}  {:>8}  {}",
                        cat.category,
                        fmt_bytes(cat.baseline_bytes),
                        fmt_bytes(cat.current_bytes),
                        signed_bytes(cat.delta_bytes),
                        delta_cell(cat.delta_pct),
                        if cat.beyond_tolerance {
                            "beyond tolerance"
                        } else {
                            ""
                        }
                    )
                    .trim_end()
                    .to_string(),
                );
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
        let mut verdict = if c.fails {
            format!("**{}**", verdict_label(c))
        } else {
            verdict_label(c)
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
        } else if !c.grown_categories.is_empty() {
            verdict.push_str(&format!(": {}", grown_words(c)));
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

    #[test]
    fn lists_read_as_prose() {
        let s = |v: &[&str]| join_and(&v.iter().map(|x| x.to_string()).collect::<Vec<_>>());
        assert_eq!(s(&[]), "");
        assert_eq!(s(&["a"]), "a");
        assert_eq!(s(&["a", "b"]), "a and b");
        assert_eq!(s(&["a", "b", "c"]), "a, b and c");
    }

    /// A category that gained less than the floor, however large in percent,
    /// is not flagged; one that was 0 and gained more than the floor is.
    #[test]
    fn the_category_floor_keeps_small_categories_quiet() {
        let base = PeakBytes {
            total: 1 << 30,
            parameters: 1000,
            communication: 0,
            ..PeakBytes::default()
        };
        let cur = PeakBytes {
            parameters: 1000 + CATEGORY_FLOOR_BYTES - 1,
            communication: CATEGORY_FLOOR_BYTES,
            ..base
        };
        let d = category_deltas(&base, &cur, 0.02);
        let flagged: Vec<&str> = d
            .iter()
            .filter(|c| c.beyond_tolerance)
            .map(|c| c.category.as_str())
            .collect();
        assert_eq!(flagged, ["communication"]);
    }
}
