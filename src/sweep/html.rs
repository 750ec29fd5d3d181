//! DIR/report.html: the sweep report as one self-contained HTML5 page.
//!
//! Inline CSS and inline SVG charts only: no scripts, no external URLs, no web
//! fonts, so the file opens anywhere (offline, from an artifact store, as an
//! e-mail attachment) and shows the same thing. Every piece of text from the
//! report is escaped.

use std::fmt::Write as _;

use super::plots::svg_strings;
use super::report::{Outcome, SweepReport, TrialRecord};
use crate::plan::name;
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

fn fmt_rate(v: f64) -> String {
    if !v.is_finite() {
        NA.to_string()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

#[allow(dead_code)]
fn fmt_usd(v: f64) -> String {
    if !v.is_finite() {
        NA.to_string()
    } else if v == 0.0 || v.abs() >= 100.0 {
        format!("${v:.0}")
    } else if v.abs() >= 1.0 {
        format!("${v:.2}")
    } else {
        format!("${v:.4}")
    }
}

fn fmt_pct(v: Option<f64>) -> String {
    match v {
        Some(v) if v.is_finite() => format!("{v:+.1}%"),
        _ => NA.to_string(),
    }
}

const STYLE: &str = r#"
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 1400px; padding: 1.2rem 1.5rem 3rem;
  font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
  font-size: 15px; line-height: 1.45; color: #1d1d1f; background: #fff; }
h1 { font-size: 1.6rem; margin: 0 0 .4rem; }
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
figure { margin: 1rem 0 2rem; }
figcaption { font-weight: 600; margin-bottom: .3rem; }
.chart svg { width: 100%; max-width: 960px; height: auto; border: 1px solid #e4e4e4; }
.table-wrap { overflow-x: auto; }
table.trials { border-collapse: collapse; font-size: .88rem; white-space: nowrap; }
table.trials th, table.trials td { border: 1px solid #ddd; padding: .2rem .45rem; text-align: left; vertical-align: top; }
table.trials th { background: #f4f4f4; position: sticky; top: 0; }
table.trials td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.trials td.note { white-space: normal; min-width: 18rem; max-width: 36rem; }
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
td.outcome { font-weight: 600; }
details pre { white-space: pre-wrap; max-height: 12rem; overflow: auto; background: #fafafa; padding: .3rem; margin: .2rem 0 0; }
.legend span { display: inline-block; padding: 0 .5rem; margin: 0 .3rem .3rem 0; border: 1px solid #ddd; }
footer { margin-top: 2rem; color: #777; font-size: .85rem; }
"#;

/// Renders the whole report page.
pub fn render_html(report: &SweepReport) -> String {
    let mut h = String::with_capacity(256 * 1024);
    let r = report;
    let title = format!("memfit sweep: {} on {}", r.model, r.hardware);

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
        "<footer>Generated by memfit {} (report schema {}). Peaks are per GPU; \
         &ldquo;measured&rdquo; is the memory tracker&rsquo;s total, &ldquo;device&rdquo; \
         the device-level high-water mark.</footer>",
        escape(&r.memfit_version),
        r.schema_version
    );
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
    fact(h, "hardware", escape(&r.hardware));
    fact(h, "device", format!("<code>{}</code>", escape(&r.device)));
    fact(h, "capacity", escape(&fmt_bytes(r.capacity_bytes)));
    fact(
        h,
        "usable",
        format!(
            "{} (headroom {:.1}%)",
            escape(&fmt_bytes(r.usable_bytes())),
            r.headroom * 100.0
        ),
    );
    fact(
        h,
        "sequence length / global batch",
        format!("{} tokens / {} sequences", r.seq_len, r.global_batch),
    );
    fact(
        h,
        "run device / target",
        super::markdown::devices_line(r),
    );
    fact(
        h,
        "pricing and timing",
        super::markdown::pricing_line(r),
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
            let _ = write!(h, "<span>{}: <b>{n}</b></span>", outcome_name(o));
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
            " &mdash; peak {}, {} tokens/s, {} {}",
            escape(&fmt_bytes(m.peak_bytes.total)),
            escape(&super::markdown::tokens_cell(m)),
            escape(&super::markdown::cost_cell(t)),
            super::markdown::cost_heading(report)
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
    let _ = writeln!(h, "</p>");

    let _ = writeln!(h, "<dl class=\"facts\">");
    if let Some(m) = &t.measured {
        let spare = r.usable_bytes().saturating_sub(m.peak_bytes.total);
        let _ = writeln!(
            h,
            "<dt>measured peak</dt><dd>{} of {} usable ({} to spare)</dd>",
            escape(&fmt_bytes(m.peak_bytes.total)),
            escape(&fmt_bytes(r.usable_bytes())),
            escape(&fmt_bytes(spare))
        );
        let _ = writeln!(
            h,
            "<dt>host RSS peak (not device memory)</dt><dd>{}</dd>",
            opt_bytes(m.rss_peak_bytes)
        );
        let _ = writeln!(
            h,
            "<dt>throughput</dt><dd>{} tokens/s ({:.3} s per step)</dd>",
            fmt_rate(m.tokens_per_s),
            m.step_s
        );
        let _ = writeln!(
            h,
            "<dt>cost</dt><dd>{}</dd>",
            escape(&super::markdown::cost_cell(t))
        );
    }
    if let Some(p) = &t.predicted {
        let _ = writeln!(
            h,
            "<dt>predicted peak</dt><dd>{}</dd>",
            escape(&fmt_bytes(p.peak_total_bytes))
        );
    }
    let _ = writeln!(
        h,
        "<dt>gradient accumulation</dt><dd>{} micro-step(s) per optimizer step</dd>",
        t.point.grad_accum
    );
    let _ = writeln!(h, "</dl>");

    if !rec.reasons.is_empty() {
        let _ = writeln!(h, "<h3>Why</h3>\n<ul>");
        for reason in &rec.reasons {
            let _ = writeln!(h, "<li>{}</li>", escape(reason));
        }
        let _ = writeln!(h, "</ul>");
    }
    let runners: Vec<(usize, &TrialRecord)> = rec
        .runners_up
        .iter()
        .filter_map(|&i| Some((i, r.trials.get(i)?)))
        .collect();
    if !runners.is_empty() {
        let _ = writeln!(h, "<h3>Runners-up</h3>\n<ol>");
        for (i, t) in runners {
            let _ = writeln!(h, "<li>#{i} {}</li>", trial_summary(r, t));
        }
        let _ = writeln!(h, "</ol>");
    }
    let _ = writeln!(h, "</div>");
    let _ = writeln!(h, "</section>");
}

fn charts(h: &mut String, r: &SweepReport) {
    let _ = writeln!(h, "<section id=\"charts\">");
    let _ = writeln!(h, "<h2>Charts</h2>");
    for (title, svg) in svg_strings(r) {
        let _ = writeln!(h, "<figure>");
        let _ = writeln!(h, "<figcaption>{}</figcaption>", escape(&title));
        // The SVG comes from plotters, which escapes its text; it has no scripts.
        let _ = writeln!(h, "<div class=\"chart\">{}</div>", svg.trim());
        let _ = writeln!(h, "</figure>");
    }
    let _ = writeln!(h, "</section>");
}

/// A knob's cell, marked when the knob changes numerics.
fn knob_cell(value: String, changes: &[String]) -> String {
    if changes.contains(&value) {
        format!(
            "<td class=\"numerics\" title=\"changes numerics\">{} &dagger;</td>",
            escape(&value)
        )
    } else {
        format!("<td>{}</td>", escape(&value))
    }
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
         &#9733; recommended, &#9670; Pareto frontier, &dagger; changes numerics. \
         Errors are (measured &minus; predicted) / measured.</p>"
    );
    if r.trials.is_empty() {
        let _ = writeln!(h, "<p>No trials were recorded.</p>");
        let _ = writeln!(h, "</section>");
        return;
    }
    let _ = writeln!(h, "<div class=\"table-wrap\">");
    let _ = writeln!(h, "<table class=\"trials\">");
    let _ = writeln!(
        h,
        "<thead><tr><th>#</th><th>micro-batch</th><th>GPUs</th><th>sharding</th>\
         <th>precision</th><th>optimizer</th><th>checkpointing</th><th>attention</th>\
         <th>accum</th><th>outcome</th><th>fits</th><th>predicted peak</th>\
         <th>measured peak</th><th>device peak</th><th>tokens/s</th><th>$/Mtok</th>\
         <th>memory error</th><th>time error</th><th>note</th></tr></thead>"
    );
    let _ = writeln!(h, "<tbody>");
    let recommended = r.recommendation.as_ref().map(|rec| rec.trial);
    for (i, t) in r.trials.iter().enumerate() {
        let mut classes = row_classes(t);
        if recommended == Some(i) {
            classes.push_str(" recommended");
        }
        let mut marks = String::new();
        if recommended == Some(i) {
            marks.push_str(" <span title=\"recommended\">&#9733;</span>");
        }
        if r.pareto.contains(&i) {
            marks.push_str(" <span title=\"on the Pareto frontier\">&#9670;</span>");
        }
        let p = &t.point;
        let ch = &t.numerics_changes;
        let _ = write!(
            h,
            "<tr class=\"{classes}\" id=\"trial-{i}\" title=\"{}\"><td>{i}{marks}</td>\
             <td class=\"num\">{}</td><td class=\"num\">{}</td>{}{}{}{}{}<td class=\"num\">{}</td>",
            escape(&t.id),
            p.micro_batch,
            p.gpus,
            knob_cell(name(p.sharding), ch),
            knob_cell(name(p.precision), ch),
            knob_cell(name(p.optimizer), ch),
            knob_cell(name(p.checkpointing), ch),
            knob_cell(name(p.attention), ch),
            p.grad_accum,
        );
        let fits = match (t.outcome, t.fits) {
            (Outcome::Ran, true) => "yes",
            (Outcome::Ran, false) => "no",
            _ => "&ndash;",
        };
        let m = t.measured.as_ref();
        let _ = write!(
            h,
            "<td class=\"outcome\">{}</td><td>{fits}</td><td class=\"num\">{}</td>\
             <td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>\
             <td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>",
            outcome_name(t.outcome),
            opt_bytes(t.predicted.as_ref().map(|p| p.peak_total_bytes)),
            opt_bytes(m.map(|m| m.peak_bytes.total)),
            opt_bytes(m.and_then(|m| m.rss_peak_bytes)),
            m.map_or_else(|| NA.to_string(), |m| fmt_rate(m.tokens_per_s)),
            escape(&super::markdown::cost_cell(t)),
            fmt_pct(t.memory_error_pct),
            escape(&super::markdown::ratio(t.time_ratio)),
        );
        let _ = writeln!(h, "<td class=\"note\">{}</td></tr>", note_cell(t));
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
        assert!(
            !html.contains("<script"),
            "no scripts, planted or otherwise"
        );
        assert!(!html.contains("<link"));
        assert!(!html.contains("@import") && !html.contains("@font-face"));
        assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt; &amp; &quot;more&quot;"));
        assert!(html.contains("panicked at &lt;somewhere&gt;"));

        // Every trial has a row, classed by outcome.
        assert_eq!(html.matches("<tr class=\"outcome-").count(), r.trials.len());
        assert!(html.contains("class=\"outcome-ran fits recommended\""));
        assert!(html.contains("class=\"outcome-ran nofit\""));
        assert!(html.contains("class=\"outcome-oom\""));
        assert!(html.contains("class=\"outcome-crash\""));
        assert!(html.contains("class=\"outcome-skipped-predicted-oom\""));
        // The adamw8bit trials mark their optimizer cell.
        assert!(
            html.contains(
                "<td class=\"numerics\" title=\"changes numerics\">adamw8bit &dagger;</td>"
            )
        );
        assert_balanced(&html, VOID);
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
