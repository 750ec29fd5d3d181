//! DIR/report.html: the sweep report as one self-contained HTML5 page.
//!
//! Inline CSS, inline SVG charts and one small inline script (sorting the
//! trial table by a clicked column): no external URLs, no web fonts, so the
//! file opens anywhere (offline, from an artifact store, as an e-mail
//! attachment) and shows the same thing. Every piece of text from the
//! report is escaped.

use std::fmt::Write as _;

use super::markdown::{
    cost_cell, cost_heading, cost_words, devices_line, noise_line, outcome_label, outcome_words,
    paired_rows, pricing_line, ranking_line, ratio, tokens_cell,
};
use super::plots::{roles_line, svg_strings};
use crate::plan::name;
use crate::report::sweep::{Outcome, Recommendation, SweepReport, TrialRecord};
use crate::units::fmt_bytes;

/// Escapes text for HTML and XML content and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A line written for Markdown (`markdown::devices_line`, ...) as HTML:
/// escaped, with its `code` spans as `<code>`.
fn md_inline(text: &str) -> String {
    let mut out = String::new();
    for (i, part) in text.split('`').enumerate() {
        if i % 2 == 1 {
            let _ = write!(out, "<code>{}</code>", escape(part));
        } else {
            out.push_str(&escape(part));
        }
    }
    out
}

/// An outcome as report.json spells it.
pub fn outcome_name(o: Outcome) -> &'static str {
    match o {
        Outcome::Ran => "ran",
        Outcome::Oom => "oom",
        Outcome::Timeout => "timeout",
        Outcome::Crash => "crash",
        Outcome::SkippedPredictedOom => "skipped_predicted_oom",
        Outcome::SkippedByMonotonicity => "skipped_by_monotonicity",
        Outcome::Invalid => "invalid",
    }
}

/// The table row's CSS classes for a trial: its outcome, and for trials that
/// ran, whether they fit.
fn row_classes(t: &TrialRecord) -> String {
    let mut c = format!("outcome-{}", outcome_name(t.outcome).replace('_', "-"));
    if t.outcome == Outcome::Ran {
        c.push_str(if t.fits { " fits" } else { " nofit" });
    }
    c
}

const NA: &str = "<span class=\"na\">–</span>";

fn opt_bytes(v: Option<u64>) -> String {
    v.map_or_else(|| NA.to_string(), fmt_bytes)
}

fn fmt_pct(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() => crate::units::fmt_signed_pct(v),
        _ => NA.to_string(),
    }
}

const STYLE: &str = r#"
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 1400px; padding: 1.2rem 1.5rem 3rem;
  font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
  font-size: 15px; line-height: 1.45; color: #1d1d1f; background: #fff; }
h1 { font-size: 1.5rem; margin: 0 0 .4rem; }
h2 { font-size: 1.25rem; margin: 2rem 0 .6rem; border-bottom: 1px solid #ddd; padding-bottom: .2rem; }
h3 { font-size: 1rem; margin: 1rem 0 .3rem; }
code, .mono { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: .92em; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: .15rem 1.2rem; margin: .6rem 0; }
dl.facts dt { color: #555; }
dl.facts dd { margin: 0; }
.badge { display: inline-block; padding: 0 .45rem; border-radius: .6rem; font-size: .85em; font-weight: 600; }
.badge.warn { background: #fde2b8; color: #7a4100; }
.badge.ok { background: #d9f0d3; color: #1b5e20; }
.badge.numerics { background: #e8defa; color: #4a2a7a; }
.rec { border-left: 4px solid #2e7d32; background: #f3faf2; padding: .6rem 1rem; border-radius: 0 .4rem .4rem 0; }
.rec.none { border-left-color: #c62828; background: #fdf1f1; }
.rec-label { font-size: 1.1rem; font-weight: 600; margin: .2rem 0 .5rem; }
.counts span { margin-right: 1rem; }
p.noisy { border-left: 4px solid #e65100; background: #fff4e0; padding: .4rem .8rem; }
table.paired { border-collapse: collapse; margin: .4rem 0; }
table.paired th, table.paired td { padding: .15rem .6rem; border-bottom: 1px solid #e4e4e4; text-align: left; }
table.paired .num { text-align: right; }
figure { margin: 1rem 0 2rem; }
figcaption { font-weight: 600; margin-bottom: .3rem; }
.chart svg { width: 100%; max-width: 960px; height: auto; border: 1px solid #e4e4e4; }
.table-wrap { overflow-x: auto; }
p.constant { margin: .3rem 0 .6rem; }
p.constant span { white-space: nowrap; margin-right: .9rem; }
table.trials { border-collapse: collapse; font-size: .85rem; white-space: nowrap; }
table.trials th, table.trials td { border: 1px solid #ddd; padding: .2rem .35rem; text-align: left; vertical-align: top; }
table.trials th { background: #f4f4f4; position: sticky; top: 0; cursor: pointer; user-select: none; white-space: normal; vertical-align: bottom; }
table.trials th:hover, table.trials th:focus { background: #e8eef7; }
table.trials th[aria-sort="ascending"]::after { content: " \25B2"; font-size: .7em; }
table.trials th[aria-sort="descending"]::after { content: " \25BC"; font-size: .7em; }
table.trials th.num, table.trials td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.trials td.note { white-space: normal; min-width: 9rem; max-width: 24rem; }
table.trials td.outcome { white-space: normal; min-width: 4rem; max-width: 8.5rem; }
td.numerics { background: #efe7fb; font-weight: 600; }
.na { color: #999; }
.outcome-ran.fits { background: #eef8ec; }
.outcome-ran.nofit { background: #fff4e0; }
.outcome-oom, .outcome-timeout { background: #fdecec; }
.outcome-crash { background: #f6e3f0; }
.outcome-skipped-predicted-oom, .outcome-skipped-by-monotonicity { background: #f5f5f5; color: #666; }
.outcome-invalid { background: #f5f5f5; color: #888; font-style: italic; }
tr.recommended td { font-weight: 700; }
tr.recommended td:first-child { box-shadow: inset 4px 0 0 #2e7d32; }
tr.tied td:first-child { box-shadow: inset 4px 0 0 #9e9e9e; }
td.outcome { font-weight: 600; }
details pre { white-space: pre-wrap; max-height: 12rem; overflow: auto; background: #fafafa; padding: .3rem; margin: .2rem 0 0; }
.legend span { display: inline-block; padding: 0 .5rem; margin: 0 .3rem .3rem 0; border: 1px solid #ddd; }
footer { margin-top: 2rem; color: #777; font-size: .85rem; }
"#;

/// Sorts a `table.sortable` by the clicked (or Enter-ed) header: numbers by
/// the cells' `data-v` (missing values last either way), text by its
/// content; a second click reverses. (No `<` in it, so it needs no CDATA
/// or escaping.)
const SCRIPT: &str = r#"
document.querySelectorAll("table.sortable").forEach(function (table) {
  var heads = table.tHead.rows[0].cells;
  Array.prototype.forEach.call(heads, function (th, col) {
    function sort() {
      var numeric = th.getAttribute("data-type") === "num";
      var dir = th.getAttribute("aria-sort") === "ascending" ? -1 : 1;
      Array.prototype.forEach.call(heads, function (h) { h.removeAttribute("aria-sort"); });
      th.setAttribute("aria-sort", dir > 0 ? "ascending" : "descending");
      var body = table.tBodies[0];
      var rows = Array.prototype.slice.call(body.rows);
      function key(row) {
        var cell = row.cells[col];
        var v = cell.hasAttribute("data-v") ? cell.getAttribute("data-v") : cell.textContent.trim();
        return numeric ? parseFloat(v) : v.toLowerCase();
      }
      rows.sort(function (a, b) {
        var x = key(a), y = key(b);
        if (numeric) {
          if (isNaN(x) || isNaN(y)) { return isNaN(x) - isNaN(y); }
          return (x - y) * dir;
        }
        return x === y ? 0 : (x > y ? dir : -dir);
      });
      rows.forEach(function (row) { body.appendChild(row); });
    }
    th.addEventListener("click", sort);
    th.addEventListener("keydown", function (e) {
      if (e.key === "Enter" || e.key === " ") { e.preventDefault(); sort(); }
    });
  });
});
"#;

/// Renders the whole report page.
pub fn render_html(report: &SweepReport) -> String {
    let mut h = String::with_capacity(256 * 1024);
    let r = report;
    let title = format!("memfit sweep: {}", roles_line(r));

    let _ = writeln!(h, "<!DOCTYPE html>");
    let _ = writeln!(h, "<html lang=\"en\">");
    let _ = writeln!(h, "<head>");
    let _ = writeln!(h, "<meta charset=\"utf-8\">");
    let _ = writeln!(
        h,
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
    );
    let _ = writeln!(
        h,
        "<meta name=\"generator\" content=\"memfit {}\">",
        escape(&r.memfit_version)
    );
    let _ = writeln!(h, "<title>{}</title>", escape(&title));
    let _ = writeln!(h, "<style>{STYLE}</style>");
    let _ = writeln!(h, "</head>");
    let _ = writeln!(h, "<body>");

    header(&mut h, r, &title);
    recommendation(&mut h, r);
    charts(&mut h, r);
    trial_table(&mut h, r);

    let _ = writeln!(
        h,
        "<footer>Generated by memfit {} (report schema {}). Peaks are per rank on the run \
         device: &ldquo;measured&rdquo; is the memory tracker&rsquo;s total plus the \
         runtime overhead the fit counts, &ldquo;predicted&rdquo; the meta engine&rsquo;s. \
         Host RSS is the trial process&rsquo;s resident set: host memory, never compared \
         with the capacity.</footer>",
        escape(&r.memfit_version),
        r.schema_version
    );
    let _ = writeln!(h, "<script>{SCRIPT}</script>");
    let _ = writeln!(h, "</body>");
    let _ = writeln!(h, "</html>");
    h
}

fn header(h: &mut String, r: &SweepReport, title: &str) {
    let _ = writeln!(h, "<header>");
    let _ = writeln!(h, "<h1>{}</h1>", escape(title));
    if r.interrupted {
        let _ = writeln!(
            h,
            "<p><span class=\"badge warn\">interrupted</span> The sweep was stopped early; \
             this report covers the trials that finished.</p>"
        );
    }
    let _ = writeln!(h, "<dl class=\"facts\">");
    let fact = |h: &mut String, k: &str, v: String| {
        let _ = writeln!(h, "<dt>{}</dt><dd>{v}</dd>", escape(k));
    };
    fact(h, "recipe", format!("<code>{}</code>", escape(&r.recipe)));
    fact(h, "model", escape(&r.model));
    fact(h, "run device / target", md_inline(&devices_line(r)));
    fact(
        h,
        "capacity (run device)",
        format!(
            "{}{}; usable {} after {:.1}% headroom",
            escape(&fmt_bytes(r.capacity_bytes)),
            if r.run_device.emulated {
                " (an emulated limit)"
            } else {
                ""
            },
            escape(&fmt_bytes(r.usable_bytes())),
            r.headroom * 100.0
        ),
    );
    fact(h, "pricing and timing", md_inline(&pricing_line(r)));
    fact(
        h,
        "calibration",
        match &r.calibration {
            Some(c) => format!(
                "predicted step times use this host&rsquo;s calibrated roofline \
                 (<code>memfit calibrate</code>): {}",
                escape(&c.summary())
            ),
            None => "none: predicted step times use the run device&rsquo;s profile".into(),
        },
    );
    fact(
        h,
        "sequence length / global batch",
        format!("{} tokens / {} sequences", r.seq_len, r.global_batch),
    );
    fact(
        h,
        "numerics changes",
        if r.allow_numerics_change {
            "allowed (fp16, adamw8bit, adafactor may be recommended)".to_string()
        } else {
            "not allowed".to_string()
        },
    );
    fact(
        h,
        "trials",
        format!(
            "{} run of {} grid points ({} recorded){}",
            r.trials_run,
            r.grid_size,
            r.trials.len(),
            if r.interrupted {
                " <span class=\"badge warn\">interrupted</span>"
            } else {
                " <span class=\"badge ok\">complete</span>"
            }
        ),
    );
    let _ = writeln!(h, "</dl>");

    // How the trials ended.
    let outcomes = [
        Outcome::Ran,
        Outcome::Oom,
        Outcome::Timeout,
        Outcome::Crash,
        Outcome::SkippedPredictedOom,
        Outcome::SkippedByMonotonicity,
        Outcome::Invalid,
    ];
    let fitting = r
        .trials
        .iter()
        .filter(|t| t.outcome == Outcome::Ran && t.fits)
        .count();
    let _ = write!(h, "<p class=\"counts\">");
    for o in outcomes {
        let n = r.trials.iter().filter(|t| t.outcome == o).count();
        if n > 0 {
            let _ = write!(
                h,
                "<span title=\"{}\">{}: <b>{n}</b></span>",
                outcome_name(o),
                escape(outcome_words(o))
            );
        }
    }
    let _ = writeln!(h, "<span>fitting: <b>{fitting}</b></span></p>");
    let _ = writeln!(h, "</header>");
}

/// One line about a trial: label, peak, throughput, cost.
fn trial_summary(report: &SweepReport, t: &TrialRecord) -> String {
    let mut s = format!("<code>{}</code>", escape(&t.point.label()));
    if let Some(m) = &t.measured {
        let _ = write!(
            s,
            " &mdash; peak {}, {} tokens/s, {}",
            escape(&fmt_bytes(
                m.peak_bytes.total + report.runtime_overhead_bytes
            )),
            escape(&tokens_cell(m)),
            escape(&cost_words(t)),
        );
    }
    if !t.numerics_changes.is_empty() {
        let _ = write!(
            s,
            " <span class=\"badge numerics\">changes numerics: {}</span>",
            escape(&t.numerics_changes.join(", "))
        );
    }
    s
}

/// The plan on the target GPU, in words.
fn target_plan(r: &SweepReport, t: &TrialRecord) -> Option<String> {
    let p = t.target.as_ref()?;
    Some(format!(
        "{} per GPU on {} ({}), {:.0} tokens/s, ${} per million tokens",
        fmt_bytes(p.peak_total_bytes),
        r.target.display_name,
        if p.fits { "fits" } else { "does not fit" },
        p.tokens_per_s,
        crate::plan::usd(p.usd_per_mtok)
    ))
}

fn recommendation(h: &mut String, r: &SweepReport) {
    let _ = writeln!(h, "<section id=\"recommendation\">");
    let _ = writeln!(h, "<h2>Recommendation</h2>");
    let chosen = r
        .recommendation
        .as_ref()
        .and_then(|rec| Some((rec, r.trials.get(rec.trial)?)));
    let Some((rec, t)) = chosen else {
        let _ = writeln!(
            h,
            "<div class=\"rec none\"><p class=\"rec-label\">No fitting trial.</p>\
             <p>No trial ran within the usable memory ({} of {}). Try a smaller micro-batch, \
             activation checkpointing, a sharded or lighter optimizer, or more GPUs.</p></div>",
            escape(&fmt_bytes(r.usable_bytes())),
            escape(&fmt_bytes(r.capacity_bytes))
        );
        let _ = writeln!(h, "</section>");
        return;
    };
    let _ = writeln!(h, "<div class=\"rec\">");
    recommendation_label(h, r, rec, t);
    recommendation_facts(h, r, t);
    recommendation_why(h, r, rec);
    paired_table(h, r);
    let listed = |h: &mut String, heading: &str, which: &[usize], ordered: bool| {
        let items: Vec<(usize, &TrialRecord)> = which
            .iter()
            .filter_map(|&i| Some((i, r.trials.get(i)?)))
            .collect();
        if items.is_empty() {
            return;
        }
        let tag = if ordered { "ol" } else { "ul" };
        let _ = writeln!(h, "<h3>{heading}</h3>\n<{tag}>");
        for (i, t) in items {
            let _ = writeln!(h, "<li>#{i} {}</li>", trial_summary(r, t));
        }
        let _ = writeln!(h, "</{tag}>");
    };
    let paired_tie = rec
        .ranking
        .as_ref()
        .filter(|rk| rk.method == "paired")
        .map(|rk| rk.tie_within);
    let tie_heading = match paired_tie {
        Some(within) => format!(
            "Tied with it (paired intervals within {:.0}% of the fastest; settled by numerics, then margin, then GPUs)",
            within * 100.0
        ),
        None => "Tied with it (throughput intervals overlap; settled by numerics, then margin, then GPUs)".into(),
    };
    listed(h, &tie_heading, &rec.tied, false);
    listed(h, "Runners-up", &rec.runners_up, true);
    let _ = writeln!(h, "</div>");
    let _ = writeln!(h, "</section>");
}

/// The recommended trial's index and configuration, with its badges.
fn recommendation_label(h: &mut String, r: &SweepReport, rec: &Recommendation, t: &TrialRecord) {
    let _ = write!(
        h,
        "<p class=\"rec-label\">#{} <code>{}</code>",
        rec.trial,
        escape(&t.point.label())
    );
    if !t.numerics_changes.is_empty() {
        let _ = write!(
            h,
            " <span class=\"badge numerics\">changes numerics: {}</span>",
            escape(&t.numerics_changes.join(", "))
        );
    }
    if noise_line(r).is_some() {
        let _ = write!(
            h,
            " <span class=\"badge warn\">host too noisy to separate</span>"
        );
    }
    if rec.tied.is_empty() {
        let _ = write!(h, " <span class=\"badge ok\">clear winner</span>");
    } else {
        let _ = write!(
            h,
            " <span class=\"badge warn\">tied with {}</span>",
            rec.tied.len()
        );
    }
    let _ = writeln!(h, "</p>");
}

/// The recommended trial's figures, as a definition list.
fn recommendation_facts(h: &mut String, r: &SweepReport, t: &TrialRecord) {
    let _ = writeln!(h, "<dl class=\"facts\">");
    let row = |h: &mut String, k: &str, v: String| {
        let _ = writeln!(h, "<dt>{}</dt><dd>{v}</dd>", escape(k));
    };
    if let Some(m) = &t.measured {
        let peak = m.peak_bytes.total + r.runtime_overhead_bytes;
        row(
            h,
            "measured peak",
            escape(&format!(
                "{} of {} usable ({} to spare)",
                fmt_bytes(peak),
                fmt_bytes(r.usable_bytes()),
                fmt_bytes(r.usable_bytes().saturating_sub(peak))
            )),
        );
        row(
            h,
            "throughput",
            escape(&format!(
                "{} tokens/s (median step {:.3} s, 95% interval {:.3}-{:.3} s)",
                tokens_cell(m),
                m.step_s,
                m.step_s_ci[0],
                m.step_s_ci[1]
            )),
        );
        row(
            h,
            if r.pricing.usd_per_hour.is_some() {
                "cost"
            } else {
                "time per million tokens"
            },
            escape(&cost_words(t)),
        );
        row(
            h,
            "host RSS peak (host memory, not the device's)",
            format!(
                "{}{}",
                opt_bytes(m.rss_peak_bytes),
                m.rss_baseline_bytes.map_or_else(String::new, |b| format!(
                    ", of which {} is the process before the engine allocated",
                    escape(&fmt_bytes(b))
                ))
            ),
        );
    }
    if let Some(p) = &t.predicted {
        row(h, "predicted peak", escape(&fmt_bytes(p.peak_total_bytes)));
    }
    if t.time_ratio.is_some() {
        row(
            h,
            "step time, measured / predicted",
            escape(&ratio(t.time_ratio)),
        );
    }
    if let Some(plan) = target_plan(r, t) {
        row(h, "planned on the target", escape(&plan));
    }
    row(
        h,
        "gradient accumulation",
        format!("{} micro-step(s) per optimizer step", t.point.grad_accum),
    );
    let _ = writeln!(h, "</dl>");
}

/// Why this trial: the reasons, the noise warning and how it was ranked.
fn recommendation_why(h: &mut String, r: &SweepReport, rec: &Recommendation) {
    if !rec.reasons.is_empty() {
        let _ = writeln!(h, "<h3>Why</h3>\n<ul>");
        for reason in &rec.reasons {
            let _ = writeln!(h, "<li>{}</li>", escape(reason));
        }
        let _ = writeln!(h, "</ul>");
    }
    if let Some(noise) = noise_line(r) {
        let _ = writeln!(
            h,
            "<p class=\"noisy\"><b>Too noisy to separate.</b> {}</p>",
            escape(&noise)
        );
    }
    if let Some(line) = ranking_line(r) {
        let _ = writeln!(h, "<h3>Ranking</h3>\n<p>{}</p>", escape(&line));
    }
}

/// The finalists' paired re-timing, when there was one.
fn paired_table(h: &mut String, r: &SweepReport) {
    let paired = paired_rows(r);
    if paired.is_empty() {
        return;
    }
    let _ = writeln!(
        h,
        "<table class=\"paired\"><thead><tr><th>#</th><th>configuration</th><th class=\"num\">cost vs fastest</th><th class=\"num\">95% interval</th><th class=\"num\">tokens/s (bouts)</th><th class=\"num\">bouts</th></tr></thead><tbody>"
    );
    for [i, label, ratio, ci, tps, bouts] in &paired {
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td><code>{}</code></td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
            escape(i),
            escape(label),
            escape(ratio),
            escape(ci),
            escape(tps),
            escape(bouts)
        );
    }
    let _ = writeln!(h, "</tbody></table>");
}

fn charts(h: &mut String, r: &SweepReport) {
    let _ = writeln!(h, "<section id=\"charts\">");
    let _ = writeln!(h, "<h2>Charts</h2>");
    let _ = writeln!(
        h,
        "<p>Hover over a point or a segment for its configuration and figures.</p>"
    );
    for (title, svg) in svg_strings(r) {
        let _ = writeln!(h, "<figure>");
        let _ = writeln!(h, "<figcaption>{}</figcaption>", escape(&title));
        // The SVG comes from plotters, which escapes its text; it has no scripts.
        let _ = writeln!(h, "<div class=\"chart\">{}</div>", svg.trim());
        let _ = writeln!(h, "</figure>");
    }
    let _ = writeln!(h, "</section>");
}

/// One cell of the trial table: its HTML, and for numeric columns the raw
/// value the sort uses (`None`: missing, sorted last).
struct Cell {
    html: String,
    value: Option<f64>,
    class: &'static str,
}

impl Cell {
    fn text(html: String) -> Cell {
        Cell {
            html,
            value: None,
            class: "",
        }
    }

    fn num(html: String, value: Option<f64>) -> Cell {
        Cell {
            html: if value.is_some() { html } else { NA.into() },
            value,
            class: "num",
        }
    }
}

struct Column {
    head: String,
    /// The header's tooltip: what the column means.
    help: String,
    numeric: bool,
    cells: Vec<Cell>,
}

impl Column {
    /// The one value every row shows, if so (rows without a value aside);
    /// `Some(None)` when no row has one.
    fn constant(&self) -> Option<Option<&str>> {
        let mut present = self
            .cells
            .iter()
            .filter(|c| c.html != NA && !c.html.is_empty())
            .map(|c| c.html.as_str());
        let Some(first) = present.next() else {
            return Some(None);
        };
        present.all(|v| v == first).then_some(Some(first))
    }
}

/// A knob's cell, marked when the knob changes numerics.
fn knob_cell(value: String, changes: &[String]) -> Cell {
    if changes.contains(&value) {
        Cell {
            html: format!(
                "<span title=\"changes numerics\">{} &dagger;</span>",
                escape(&value)
            ),
            value: None,
            class: "numerics",
        }
    } else {
        Cell::text(escape(&value))
    }
}

/// A column header's or help text's words: fixed, or from the report.
#[derive(Clone, Copy)]
enum Words {
    Fixed(&'static str),
    Of(fn(&SweepReport) -> String),
}

impl Words {
    fn text(self, r: &SweepReport) -> String {
        match self {
            Words::Fixed(s) => s.to_string(),
            Words::Of(f) => f(r),
        }
    }
}

/// A column of the trial table as data: its header, the header's help,
/// whether it sorts as numbers, and each trial's cell.
struct ColumnSpec {
    head: Words,
    help: Words,
    numeric: bool,
    /// Shown only when some trial has an NVML peak.
    nvml: bool,
    cell: fn(&SweepReport, usize, &TrialRecord) -> Cell,
}

/// A numeric knob's cell.
fn knob_num(v: f64) -> Cell {
    Cell::num(format!("{v}"), Some(v))
}

fn bytes_cell(b: Option<u64>) -> Cell {
    Cell::num(opt_bytes(b), b.map(|b| b as f64))
}

const fn spec(
    head: &'static str,
    help: &'static str,
    numeric: bool,
    cell: fn(&SweepReport, usize, &TrialRecord) -> Cell,
) -> ColumnSpec {
    ColumnSpec {
        head: Words::Fixed(head),
        help: Words::Fixed(help),
        numeric,
        nvml: false,
        cell,
    }
}

/// Every column of the trial table, in order.
const COLUMNS: &[ColumnSpec] = &[
    spec(
        "#",
        "trial index; ★ recommended, = tied with it, ◆ on the Pareto frontier",
        true,
        |r, i, _| {
            let rec = r.recommendation.as_ref();
            let mut marks = String::new();
            if rec.is_some_and(|rec| rec.trial == i) {
                marks.push_str(" <span title=\"recommended\">&#9733;</span>");
            }
            if rec.is_some_and(|rec| rec.tied.contains(&i)) {
                marks.push_str(" <span title=\"tied with the recommendation\">=</span>");
            }
            if r.pareto.contains(&i) {
                marks.push_str(" <span title=\"on the Pareto frontier\">&#9670;</span>");
            }
            Cell::num(format!("{i}{marks}"), Some(i as f64))
        },
    ),
    spec(
        "micro-batch",
        "sequences per rank per micro-step",
        true,
        |_, _, t| knob_num(t.point.micro_batch as f64),
    ),
    spec(
        "ranks",
        "data-parallel ranks (GPUs on the target)",
        true,
        |_, _, t| knob_num(t.point.gpus as f64),
    ),
    spec("sharding", "", false, |_, _, t| {
        knob_cell(name(t.point.sharding), &t.numerics_changes)
    }),
    spec("precision", "", false, |_, _, t| {
        knob_cell(name(t.point.precision), &t.numerics_changes)
    }),
    spec("optimizer", "", false, |_, _, t| {
        knob_cell(name(t.point.optimizer), &t.numerics_changes)
    }),
    spec("ckpt", "activation checkpointing", false, |_, _, t| {
        knob_cell(name(t.point.checkpointing), &t.numerics_changes)
    }),
    spec("attention", "", false, |_, _, t| {
        knob_cell(name(t.point.attention), &t.numerics_changes)
    }),
    spec("accum", "gradient accumulation steps", true, |_, _, t| {
        knob_num(t.point.grad_accum as f64)
    }),
    spec(
        "outcome",
        "how the trial ended; fit means its measured peak is within the usable memory",
        false,
        |_, _, t| Cell {
            html: escape(outcome_label(t)),
            value: None,
            class: "outcome",
        },
    ),
    spec(
        "predicted",
        "predicted peak per rank on the run device (meta engine plus runtime overhead)",
        true,
        |_, _, t| bytes_cell(t.predicted.as_ref().map(|p| p.peak_total_bytes)),
    ),
    spec(
        "measured",
        "measured peak per rank (the tracker's total plus runtime overhead)",
        true,
        |r, _, t| {
            bytes_cell(
                t.measured
                    .as_ref()
                    .map(|m| m.peak_bytes.total + r.runtime_overhead_bytes),
            )
        },
    ),
    spec(
        "mem err",
        "(measured - predicted) / measured tracked peak",
        true,
        |_, _, t| Cell::num(fmt_pct(t.memory_error_pct), t.memory_error_pct),
    ),
    spec(
        "tokens/s",
        "median tokens/s with half its 95% interval, measured on the run device",
        true,
        |_, _, t| {
            let m = t.measured.as_ref();
            Cell::num(
                m.map_or_else(String::new, |m| escape(&tokens_cell(m))),
                m.map(|m| m.tokens_per_s),
            )
        },
    ),
    spec(
        "time ×",
        "measured / predicted median step time on the run device (1.00x is exact)",
        true,
        |_, _, t| Cell::num(escape(&ratio(t.time_ratio)), t.time_ratio),
    ),
    ColumnSpec {
        head: Words::Of(|r| cost_heading(r).to_string()),
        help: Words::Of(|r| {
            if r.pricing.usd_per_hour.is_some() {
                "cost per million tokens at the measured throughput (see pricing above)"
            } else {
                "host seconds per million tokens at the measured throughput: time, not money (no host_usd_per_hour)"
            }
            .to_string()
        }),
        numeric: true,
        nvml: false,
        cell: |_, _, t| {
            let c = super::driver::cost_of(t).map(|c| c.0);
            Cell::num(escape(&cost_cell(t)), c)
        },
    },
    ColumnSpec {
        head: Words::Fixed("on target"),
        help: Words::Of(|r| {
            format!(
                "the plan for this configuration on the target ({}): peak per GPU",
                r.target.display_name
            )
        }),
        numeric: true,
        nvml: false,
        cell: |_, _, t| {
            let p = t.target.as_ref();
            let mut cell = bytes_cell(p.map(|p| p.peak_total_bytes));
            if p.is_some_and(|p| !p.fits) {
                cell.html.push_str(" (no fit)");
            }
            cell
        },
    },
    ColumnSpec {
        nvml: true,
        ..spec(
            "NVML",
            "the trial process's GPU memory high-water mark as NVML reported it (context, kernels, cuBLAS, allocator reserve and tensors)",
            true,
            |_, _, t| bytes_cell(t.measured.as_ref().and_then(|m| m.nvml_peak_bytes)),
        )
    },
    ColumnSpec {
        nvml: true,
        ..spec(
            "NVML err",
            "(NVML peak - predicted) / NVML peak",
            true,
            |_, _, t| Cell::num(fmt_pct(t.nvml_error_pct), t.nvml_error_pct),
        )
    },
    spec(
        "host RSS",
        "the trial process's resident-set high-water mark: host memory, never compared with the capacity",
        true,
        |_, _, t| bytes_cell(t.measured.as_ref().and_then(|m| m.rss_peak_bytes)),
    ),
    spec("note", "", false, |_, _, t| Cell {
        html: note_cell(t),
        value: None,
        class: "note",
    }),
];

/// The trial table's columns, every one of them (constant ones are hidden
/// when the table is written; the NVML ones are left out when no trial
/// has an NVML peak).
fn columns(r: &SweepReport) -> Vec<Column> {
    let nvml = r.trials.iter().any(|t| {
        t.measured
            .as_ref()
            .is_some_and(|m| m.nvml_peak_bytes.is_some())
    });
    COLUMNS
        .iter()
        .filter(|c| nvml || !c.nvml)
        .map(|c| Column {
            head: c.head.text(r),
            help: c.help.text(r),
            numeric: c.numeric,
            cells: (r.trials.iter().enumerate())
                .map(|(i, t)| (c.cell)(r, i, t))
                .collect(),
        })
        .collect()
}

fn trial_table(h: &mut String, r: &SweepReport) {
    let _ = writeln!(h, "<section id=\"trials\">");
    let _ = writeln!(h, "<h2>Trials</h2>");
    let _ = writeln!(
        h,
        "<p class=\"legend\"><span class=\"outcome-ran fits\">ran, fits</span>\
         <span class=\"outcome-ran nofit\">ran, over the usable limit</span>\
         <span class=\"outcome-oom\">oom / timeout</span>\
         <span class=\"outcome-crash\">crash</span>\
         <span class=\"outcome-skipped-predicted-oom\">skipped</span>\
         <span class=\"outcome-invalid\">invalid</span> \
         &#9733; recommended, = tied with it, &#9670; Pareto frontier, &dagger; changes numerics. \
         Click a column&rsquo;s header to sort by it; hover over it for what it means.</p>"
    );
    if r.trials.is_empty() {
        let _ = writeln!(h, "<p>No trials were recorded.</p>");
        let _ = writeln!(h, "</section>");
        return;
    }
    let cols = columns(r);
    // A column that says the same thing in every row is said once, above.
    let mut shown: Vec<&Column> = Vec::new();
    let mut same: Vec<String> = Vec::new();
    for c in &cols {
        let constant = if c.head == "#" || r.trials.len() < 2 {
            None
        } else {
            c.constant()
        };
        match constant {
            None => shown.push(c),
            Some(None) if c.head == "note" => {}
            Some(None) => same.push(format!("<span><b>{}</b> none</span>", escape(&c.head))),
            Some(Some(v)) => {
                let partial = c.cells.iter().any(|x| x.html == NA || x.html.is_empty());
                same.push(format!(
                    "<span><b>{}</b> {v}{}</span>",
                    escape(&c.head),
                    if partial { " (where there is one)" } else { "" }
                ));
            }
        }
    }
    if !same.is_empty() {
        let _ = writeln!(
            h,
            "<p class=\"constant\">The same in every trial (columns not shown): {}</p>",
            same.join(" ")
        );
    }
    let _ = writeln!(h, "<div class=\"table-wrap\">");
    let _ = writeln!(h, "<table class=\"trials sortable\">");
    let _ = write!(h, "<thead><tr>");
    for c in &shown {
        let _ = write!(
            h,
            "<th tabindex=\"0\" data-type=\"{}\"{}{}>{}</th>",
            if c.numeric { "num" } else { "text" },
            if c.numeric { " class=\"num\"" } else { "" },
            if c.help.is_empty() {
                String::new()
            } else {
                format!(" title=\"{}\"", escape(&c.help))
            },
            escape(&c.head)
        );
    }
    let _ = writeln!(h, "</tr></thead>");
    let _ = writeln!(h, "<tbody>");
    let rec = r.recommendation.as_ref();
    for (i, t) in r.trials.iter().enumerate() {
        let mut classes = row_classes(t);
        if rec.is_some_and(|rec| rec.trial == i) {
            classes.push_str(" recommended");
        } else if rec.is_some_and(|rec| rec.tied.contains(&i)) {
            classes.push_str(" tied");
        }
        let _ = write!(
            h,
            "<tr class=\"{classes}\" id=\"trial-{i}\" title=\"{}\">",
            escape(&t.id)
        );
        for c in &shown {
            let cell = &c.cells[i];
            let class = if cell.class.is_empty() {
                String::new()
            } else {
                format!(" class=\"{}\"", cell.class)
            };
            let value = match (c.numeric, cell.value) {
                (true, Some(v)) if v.is_finite() => format!(" data-v=\"{v}\""),
                (true, _) => " data-v=\"\"".to_string(),
                (false, _) => String::new(),
            };
            let _ = write!(h, "<td{class}{value}>{}</td>", cell.html);
        }
        let _ = writeln!(h, "</tr>");
    }
    let _ = writeln!(h, "</tbody>");
    let _ = writeln!(h, "</table>");
    let _ = writeln!(h, "</div>");
    let _ = writeln!(h, "</section>");
}

fn note_cell(t: &TrialRecord) -> String {
    let mut parts: Vec<String> = Vec::new();
    if let Some(note) = &t.note {
        parts.push(escape(note));
    }
    // Numerics changes no knob cell shows.
    let shown = [name(t.point.precision), name(t.point.optimizer)];
    let other: Vec<&str> = t
        .numerics_changes
        .iter()
        .filter(|c| !shown.contains(c))
        .map(String::as_str)
        .collect();
    if !other.is_empty() {
        parts.push(format!(
            "changes numerics: {} &dagger;",
            escape(&other.join(", "))
        ));
    }
    if let Some(exit) = &t.exit {
        let how = match (exit.code, exit.signal) {
            (_, Some(s)) => format!("killed by signal {s}"),
            (Some(c), None) => format!("exit code {c}"),
            (None, None) => "exited".to_string(),
        };
        if exit.stderr_tail.trim().is_empty() {
            parts.push(how);
        } else {
            parts.push(format!(
                "<details><summary>{how}: stderr</summary><pre>{}</pre></details>",
                escape(exit.stderr_tail.trim_end())
            ));
        }
    }
    if parts.is_empty() {
        String::new()
    } else {
        parts.join("<br>")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sweep::plots::tests::{assert_balanced, empty_report, synthetic_report};

    const VOID: &[&str] = &["meta", "br", "link", "img", "hr", "input"];

    #[test]
    fn escape_covers_markup_and_quotes() {
        assert_eq!(
            escape(r#"<a href="x">&'"#),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }

    #[test]
    fn page_is_self_contained_and_escaped() {
        let r = synthetic_report();
        let html = render_html(&r);
        assert!(html.starts_with("<!DOCTYPE html>"));
        assert_eq!(html.matches("<svg").count(), 3, "three inline charts");
        assert!(html.contains(&escape(&r.trials[2].point.label())));
        assert!(html.contains("highest tokens/s among fitting trials"));

        // No external references: the SVG namespace is the only URL.
        let stripped = html.replace("http://www.w3.org/2000/svg", "");
        assert!(!stripped.contains("http://"));
        assert!(!stripped.contains("https://"));
        assert!(!stripped.contains("src="), "nothing loaded from elsewhere");
        // One script, the table sort, inline; the planted one is text.
        assert_eq!(html.matches("<script").count(), 1);
        assert!(html.contains("<script>\ndocument.querySelectorAll(\"table.sortable\")"));
        assert!(!html.contains("<link"));
        assert!(!html.contains("@import") && !html.contains("@font-face"));
        assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt; &amp; &quot;more&quot;"));
        assert!(html.contains("panicked at &lt;somewhere&gt;"));

        // Every trial has a row, classed by outcome.
        assert_eq!(html.matches("<tr class=\"outcome-").count(), r.trials.len());
        assert!(html.contains("class=\"outcome-ran fits recommended\""));
        assert!(html.contains("class=\"outcome-ran fits tied\""));
        assert!(html.contains("class=\"outcome-ran nofit\""));
        assert!(html.contains("class=\"outcome-oom\""));
        assert!(html.contains("class=\"outcome-crash\""));
        assert!(html.contains("class=\"outcome-skipped-predicted-oom\""));
        // The adamw8bit trials mark their optimizer cell.
        assert!(html.contains(
            "<td class=\"numerics\"><span title=\"changes numerics\">adamw8bit &dagger;</span></td>"
        ));
        assert_balanced(&html, VOID);
    }

    #[test]
    fn page_names_both_roles_and_the_tie() {
        let r = synthetic_report();
        let html = render_html(&r);
        let title = "memfit sweep: tiny-gpt \u{2014} run on cpu:limit=64MiB (emulated), target NVIDIA T4 16GB";
        assert!(html.contains(&format!("<title>{title}</title>")));
        assert!(html.contains(&format!("<h1>{title}</h1>")));
        // devices_line and pricing_line, their code spans as <code>.
        assert!(html.contains("(<code>cpu:limit=64MiB</code>). Target: NVIDIA T4 16GB"));
        assert!(html.contains("Throughput is measured on this host and priced at its $2.500/hour"));
        assert!(html.contains("<dt>calibration</dt><dd>none"));
        // The winner is tied with #4, which is listed.
        assert!(html.contains("tied with 1</span>"));
        assert!(html.contains("<h3>Tied with it"));
        assert!(html.contains(&format!(
            "<li>#4 <code>{}</code>",
            escape(&r.trials[4].point.label())
        )));
        // RSS is host memory; time error is a ratio.
        assert!(html.contains("host RSS peak (host memory, not the device&#39;s)"));
        assert!(html.contains(">0.89x</td>"));
        assert!(!html.contains("time error"));
    }

    #[test]
    fn constant_columns_are_said_once_and_the_rest_sort() {
        let r = synthetic_report();
        let html = render_html(&r);
        // bf16, no sharding, one rank and fused attention in every trial.
        for (head, value) in [
            ("precision", "bf16"),
            ("sharding", "none"),
            ("ranks", "1"),
            ("attention", "fused"),
        ] {
            assert!(
                html.contains(&format!("<span><b>{head}</b> {value}</span>")),
                "{head}"
            );
            assert!(
                !html.contains(&format!(">{head}</th>")),
                "{head} still a column"
            );
        }
        for head in [
            "micro-batch",
            "optimizer",
            "ckpt",
            "outcome",
            "tokens/s",
            "time ×",
            "$/Mtok",
            "on target",
            "host RSS",
            "note",
        ] {
            assert!(
                html.contains(&format!(">{}</th>", escape(head))),
                "{head} hidden"
            );
        }
        // Numeric columns sort by a raw value and are right-aligned.
        assert!(html.contains(
            "<th tabindex=\"0\" data-type=\"num\" class=\"num\" title=\"median tokens/s"
        ));
        assert!(html.contains("<td class=\"num\" data-v=\"21000\">21000 ±"));
        assert!(
            html.contains("<td class=\"num\" data-v=\"\">"),
            "a missing value sorts last"
        );
        assert!(html.contains("data-type=\"text\""));
        // The target plan column names the target in its header's tooltip.
        assert!(html.contains("<td class=\"num\" data-v=\"855638016\">816.00 MiB (no fit)</td>"));
        assert!(html.contains("the plan for this configuration on the target (NVIDIA T4 16GB)"));

        // One trial: nothing is hidden.
        let mut one = synthetic_report();
        one.trials.truncate(1);
        one.recommendation = None;
        let html = render_html(&one);
        assert!(html.contains(">precision</th>"));
        assert!(!html.contains("The same in every trial"));
    }

    #[test]
    fn host_time_is_not_called_cost_and_outcomes_are_words() {
        // It showed "cost 13.8 s/Mtok" and the key skipped_predicted_oom.
        let mut r = synthetic_report();
        r.pricing.usd_per_hour = None;
        for t in &mut r.trials {
            if let Some(m) = t.measured.as_mut() {
                m.usd_per_mtok = None;
            }
        }
        let html = render_html(&r);
        assert!(
            html.contains("<dt>time per million tokens</dt><dd>"),
            "host time row"
        );
        assert!(!html.contains("<dt>cost</dt>"));
        assert!(html.contains(" s per Mtok (host time)"));
        assert!(!html.replace("host s/Mtok", "").contains("s/Mtok"));
        assert!(html.contains(">host s/Mtok</th>"));
        assert!(html.contains("time, not money"));
        assert!(
            html.contains(">skipped: predicted OOM: <b>1</b></span>"),
            "counts in words"
        );
        assert!(!html.contains(">skipped_predicted_oom: "));
        assert!(html.contains(">OOM: <b>1</b></span>"));
    }

    #[test]
    fn a_paired_ranking_is_shown_and_a_noisy_host_is_said_to_be() {
        use crate::report::sweep::{PairedTrial, Ranking};
        let mut r = synthetic_report();
        let rec = r.recommendation.as_mut().unwrap();
        let ranking = Ranking {
            method: "paired".into(),
            note: None,
            contenders: vec![2, 4, 1],
            rounds: 27,
            bout_steps: 3,
            bout_budget_s: 0.5,
            paired: vec![
                PairedTrial {
                    trial: 2,
                    cost_ratio: 1.0,
                    cost_ratio_ci: [1.0, 1.0],
                    tokens_per_s: 21000.0,
                    bouts: 27,
                    failed_bouts: 0,
                },
                PairedTrial {
                    trial: 4,
                    cost_ratio: 1.08,
                    cost_ratio_ci: [0.85, 1.31],
                    tokens_per_s: 19400.0,
                    bouts: 26,
                    failed_bouts: 1,
                },
            ],
            widest_half_interval: 0.21,
            noise_bound: 0.10,
            retries: 2,
            max_retries: 2,
            tie_within: 0.42,
            tie_floor: 0.05,
            drift: Some(1.3),
            load_swing: None,
            screened: Vec::new(),
            noisy: true,
        };
        rec.ranking = Some(ranking.clone());
        let html = render_html(&r);
        assert!(html.contains("host too noisy to separate</span>"));
        assert!(html.contains("<b>Too noisy to separate.</b> The host was too noisy"));
        assert!(html.contains("still up to ±21% (the bound is ±10%)"));
        assert!(html.contains("<h3>Ranking</h3>\n<p>Ranked on paired re-timing"));
        assert!(html.contains("<table class=\"paired\">"));
        assert!(html.contains("<td class=\"num\">1.080x</td><td class=\"num\">0.850-1.310</td>"));
        assert!(html.contains("26 (1 failed)"));
        assert!(html.contains("Tied with it (paired intervals within 42% of the fastest"));
        assert_balanced(&html, VOID);
        let md = crate::sweep::markdown::render(&r);
        assert!(md.contains("**Too noisy to separate.**"), "{md}");
        assert!(md.contains("| 4= | "), "{md}");
        let table = crate::sweep::markdown::table(&r);
        assert!(table.contains("warning: The host was too noisy"), "{table}");
        // A quiet host: no warning anywhere.
        let quiet = Ranking {
            noisy: false,
            widest_half_interval: 0.03,
            tie_within: 0.06,
            ..ranking
        };
        r.recommendation.as_mut().unwrap().ranking = Some(quiet);
        let html = render_html(&r);
        assert!(!html.contains("too noisy"));
        assert!(!crate::sweep::markdown::table(&r).contains("too noisy"));
    }

    #[test]
    fn empty_report_renders() {
        let html = render_html(&empty_report());
        assert!(html.starts_with("<!DOCTYPE html>"));
        assert_eq!(html.matches("<svg").count(), 3);
        assert!(html.contains("No fitting trial"));
        assert!(html.contains("interrupted"));
        assert_balanced(&html, VOID);
    }
}
