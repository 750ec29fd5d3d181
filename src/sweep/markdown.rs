//! report.md: the fit table, the recommendation with its reasons, and
//! prediction against measurement.

use std::fmt::Write as _;

use crate::plan::{name, usd};
use crate::report::sweep::{Outcome, SweepReport, TrialRecord};
use crate::units::fmt_bytes;

pub fn outcome_label(r: &TrialRecord) -> &'static str {
    match r.outcome {
        Outcome::Ran if r.fits => "fit",
        Outcome::Ran => "over headroom",
        o => outcome_words(o),
    }
}

/// An outcome in words (report.json spells it `skipped_predicted_oom`).
pub fn outcome_words(o: Outcome) -> &'static str {
    match o {
        Outcome::Ran => "ran",
        Outcome::Oom => "OOM",
        Outcome::Timeout => "timeout",
        Outcome::Crash => "crash",
        Outcome::SkippedPredictedOom => "skipped: predicted OOM",
        Outcome::SkippedByMonotonicity => "skipped: monotonicity",
        Outcome::Invalid => "invalid",
    }
}

fn pct(x: Option<f64>) -> String {
    x.map_or("-".into(), crate::units::fmt_signed_pct)
}

/// Measured / predicted, e.g. `1.32x`.
pub fn ratio(x: Option<f64>) -> String {
    x.map_or("-".into(), |x| format!("{x:.2}x"))
}

/// `median ±half-spread` of tokens/s, e.g. `64358 ±4%`.
pub fn tokens_cell(m: &crate::report::sweep::Measured) -> String {
    let [lo, hi] = m.tokens_per_s_ci;
    let spread = (hi - lo) / 2.0 / m.tokens_per_s * 100.0;
    if spread.is_finite() && spread > 0.0 {
        format!("{:.0} ±{:.0}%", m.tokens_per_s, spread.max(0.5))
    } else {
        format!("{:.0}", m.tokens_per_s)
    }
}

/// The cost column's heading: `$/Mtok` when priced, else `host s/Mtok`
/// (host seconds per million tokens: time, not money; the same order).
pub fn cost_heading(report: &SweepReport) -> &'static str {
    if report.pricing.usd_per_hour.is_some() {
        "$/Mtok"
    } else {
        "host s/Mtok"
    }
}

/// A trial's cost in words: `$0.0123 per Mtok`, or `13.8 s per Mtok (host
/// time)` on a host without a price.
pub fn cost_words(r: &TrialRecord) -> String {
    match (r.measured.as_ref(), super::driver::cost_of(r)) {
        (Some(m), Some((c, _))) if m.usd_per_mtok.is_some() => format!("${} per Mtok", usd(c)),
        (Some(_), Some((c, _))) => format!("{c:.1} s per Mtok (host time)"),
        _ => "-".into(),
    }
}

/// What one bout of a paired ranking timed: "3 steps" in reports from
/// before bouts had a budget, else "at least 3 steps and 0.5 s".
pub fn bout_words(rk: &crate::report::sweep::Ranking) -> String {
    match rk.bout_budget_s > 0.0 {
        true => format!(
            "at least {} steps and {} s",
            rk.bout_steps, rk.bout_budget_s
        ),
        false => format!("{} steps", rk.bout_steps),
    }
}

/// How the recommendation ranked the trials, in words, or `None` for a
/// report without a ranking (written before paired re-timing).
pub fn ranking_line(report: &SweepReport) -> Option<String> {
    let rk = report.recommendation.as_ref()?.ranking.as_ref()?;
    Some(match rk.method.as_str() {
        "paired" => format!(
            "Ranked on paired re-timing: the {} cheapest trials by their own measurement were timed again, interleaved, in {} rounds of one bout each of {} (the order rotated every round, so that they shared the host's load); each finalist's cost is its median ratio to the fastest's in the same round. Paired intervals are within ±{:.1}% (bound ±{:.0}%{}); finalists within {:.0}% of the fastest are tied.{}",
            rk.contenders.len(),
            rk.rounds,
            bout_words(rk),
            rk.widest_half_interval * 100.0,
            rk.noise_bound * 100.0,
            match rk.retries {
                0 => String::new(),
                n => format!(", {n} of {} re-timings used", rk.max_retries),
            },
            rk.tie_within * 100.0,
            rk.note
                .as_ref()
                .map_or(String::new(), |n| format!(" Note: {n}."))
        ),
        "predicted" => format!(
            "Ranked on predicted throughput: {}.",
            rk.note.as_deref().unwrap_or("nothing was timed")
        ),
        _ => format!(
            "Ranked on each trial's own measurement: {}.",
            rk.note.as_deref().unwrap_or("no re-timing")
        ),
    })
}

/// Said plainly when the host was too noisy to separate the fastest trials.
pub fn noise_line(report: &SweepReport) -> Option<String> {
    let rk = report.recommendation.as_ref()?.ranking.as_ref()?;
    rk.noisy.then(|| {
        format!(
            "The host was too noisy to separate the fastest configurations: after {} interleaved rounds their paired intervals were still up to ±{:.0}% (the bound is ±{:.0}%). The tie is widened to {:.0}%, to every fitting configuration whose paired or own measurement comes that near the fastest; the pick is only the fastest in paired timing, and another sweep may pick another of the tied. Sweep on a quieter host to rank them by speed.",
            rk.rounds,
            rk.widest_half_interval * 100.0,
            rk.noise_bound * 100.0,
            rk.tie_within * 100.0
        )
    })
}

/// One row per paired finalist: `#`, configuration, cost over the
/// fastest's, its interval, median tokens/s of its bouts, bouts.
pub fn paired_rows(report: &SweepReport) -> Vec<[String; 6]> {
    let Some(rec) = report.recommendation.as_ref() else {
        return Vec::new();
    };
    let Some(rk) = rec.ranking.as_ref() else {
        return Vec::new();
    };
    rk.paired
        .iter()
        .filter_map(|p| {
            let t = report.trials.get(p.trial)?;
            let mark = if p.trial == rec.trial {
                "*"
            } else if rec.tied.contains(&p.trial) {
                "="
            } else {
                ""
            };
            Some([
                format!("{}{mark}", p.trial),
                t.point.label(),
                format!("{:.3}x", p.cost_ratio),
                format!("{:.3}-{:.3}", p.cost_ratio_ci[0], p.cost_ratio_ci[1]),
                format!("{:.0}", p.tokens_per_s),
                match p.failed_bouts {
                    0 => p.bouts.to_string(),
                    f => format!("{} ({f} failed)", p.bouts),
                },
            ])
        })
        .collect()
}

pub fn cost_cell(r: &TrialRecord) -> String {
    match (r.measured.as_ref(), super::driver::cost_of(r)) {
        (Some(m), Some((c, _))) if m.usd_per_mtok.is_some() => usd(c),
        (Some(_), Some((c, _))) => format!("{c:.1}"),
        _ => "-".into(),
    }
}

/// What a row says when it did not run: the outcome and, for an invalid
/// or skipped point, why.
fn outcome_cell(r: &TrialRecord) -> String {
    match (r.outcome, &r.note) {
        (Outcome::Invalid, Some(n)) => format!("invalid: {n}"),
        _ => outcome_label(r).into(),
    }
}

/// The point's framework, fine-tuning and parallel layout as its label
/// words them (`hf-eager lora pp2 tp4 `), empty for the defaults.
fn layout_tags(p: &crate::plan::Point) -> String {
    let label = p.label();
    let at = label
        .find(&format!("mb{} x{}", p.micro_batch, p.gpus))
        .unwrap_or(0);
    label[..at].to_string()
}

/// One row per trial: knobs, outcome, predicted and measured peaks, speed.
pub fn rows(report: &SweepReport) -> Vec<[String; 13]> {
    report
        .trials
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let p = &r.point;
            let m = r.measured.as_ref();
            let mark = match &report.recommendation {
                Some(rec) if rec.trial == i => "*",
                Some(rec) if rec.tied.contains(&i) => "=",
                _ => "",
            };
            [
                format!("{i}{mark}"),
                format!(
                    "{}x{} {} {} {}{}",
                    layout_tags(p),
                    p.gpus,
                    name(p.sharding),
                    name(p.precision),
                    name(p.optimizer),
                    if r.numerics_changes.is_empty() {
                        ""
                    } else {
                        " (numerics)"
                    }
                ),
                format!("{} {}", name(p.checkpointing), name(p.attention)),
                p.micro_batch.to_string(),
                outcome_cell(r),
                r.predicted
                    .as_ref()
                    .map_or("-".into(), |x| fmt_bytes(x.peak_total_bytes)),
                m.map_or("-".into(), |m| {
                    fmt_bytes(m.peak_bytes.total + report.runtime_overhead_bytes)
                }),
                pct(r.memory_error_pct),
                m.map_or("-".into(), tokens_cell),
                ratio(r.time_ratio),
                cost_cell(r),
                r.target.as_ref().map_or("-".into(), |t| {
                    format!(
                        "{}{}",
                        fmt_bytes(t.peak_total_bytes),
                        if t.fits { "" } else { " (no fit)" }
                    )
                }),
                m.and_then(|m| m.rss_peak_bytes)
                    .map_or("-".into(), fmt_bytes),
            ]
        })
        .collect()
}

/// Column headings; the cost column's depends on the pricing (`cost_heading`).
pub fn headers(report: &SweepReport) -> [String; 13] {
    [
        "#",
        "knobs",
        "ckpt/attn",
        "mb",
        "outcome",
        "predicted",
        "tracked",
        "mem err",
        "tokens/s",
        "time x",
        cost_heading(report),
        "on target",
        "host RSS",
    ]
    .map(String::from)
}

/// The two roles, in words: where trials ran and what the plan is for.
pub fn devices_line(report: &SweepReport) -> String {
    format!(
        "Run device: {} (`{}`). Target: {} ({} per GPU, {} runtime overhead, ${}/GPU-hour).",
        report.run_device.description,
        report.run_device.spec,
        report.target.display_name,
        fmt_bytes(report.target.capacity_bytes),
        fmt_bytes(report.target.runtime_overhead_bytes),
        usd(report.target.usd_per_gpu_hour)
    )
}

/// How throughput was priced and timed, in words.
pub fn pricing_line(report: &SweepReport) -> String {
    let timing = &report.timing;
    let how = format!(
        "each trial times {}-{} steps after {} warm-up (until the median's 95% interval is within {:.0}% or {:.1} s are spent)",
        timing.min_steps,
        timing.max_steps,
        timing.warmup_steps,
        timing.target_rel_ci * 100.0,
        timing.budget_s
    );
    match (report.pricing.basis.as_str(), report.pricing.usd_per_hour) {
        ("host", Some(usd_h)) => format!(
            "Throughput is measured on this host and priced at its ${}/hour; {how}.",
            usd(usd_h)
        ),
        ("host", None) => format!(
            "Throughput is measured on this host, which has no price (set host_usd_per_hour), so trials are ranked by tokens/s and cost is host seconds per million tokens; {how}."
        ),
        _ => format!(
            "Throughput is priced at the target's ${}/GPU-hour; {how}.",
            usd(report.target.usd_per_gpu_hour)
        ),
    }
}

/// Text from a user's file (a model or hardware name, a note) as Markdown
/// shows it: no HTML (`<script>` is `&lt;script&gt;`) and no markup
/// (`*`, `_`, backticks, links, table pipes, headings are literal).
pub fn md_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in no_html(text).chars() {
        if matches!(c, '\\' | '`' | '*' | '_' | '[' | ']' | '|' | '#' | '~') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// `text` with `&`, `<` and `>` as entities: a line memfit wrote whose
/// Markdown (code spans) stays, but whose names cannot be HTML.
fn no_html(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

pub fn render(report: &SweepReport) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# memfit sweep: {}, run on {}, target {}\n",
        md_text(&report.model),
        md_text(&report.run_device.kind),
        md_text(&report.target.display_name)
    );
    let _ = writeln!(s, "{}\n", no_html(&devices_line(report)));
    let _ = writeln!(s, "{}\n", no_html(&pricing_line(report)));
    if let Some(c) = &report.calibration {
        let _ = writeln!(
            s,
            "Predicted step times use this host's calibrated roofline (`memfit calibrate`): {}.\n",
            c.summary()
        );
    }
    let _ = writeln!(
        s,
        "Capacity {} ({} usable after {:.0}% headroom), seq-len {}, global batch {}. {} of {} grid points ran as trials{}.\n",
        fmt_bytes(report.capacity_bytes),
        fmt_bytes(report.usable_bytes()),
        report.headroom * 100.0,
        report.seq_len,
        report.global_batch,
        report.trials_run,
        report.grid_size,
        if report.interrupted {
            " (interrupted: Ctrl-C)"
        } else {
            ""
        }
    );
    let _ = writeln!(s, "## Recommendation\n");
    match &report.recommendation {
        Some(rec) => {
            let r = &report.trials[rec.trial];
            let _ = writeln!(s, "**#{} {}**\n", rec.trial, r.point.label());
            for reason in &rec.reasons {
                let _ = writeln!(s, "- {}", no_html(reason));
            }
            if !report.pareto.is_empty() {
                let list: Vec<String> = report.pareto.iter().map(|i| format!("#{i}")).collect();
                let _ = writeln!(
                    s,
                    "- Pareto frontier (peak memory against tokens/s): {}",
                    list.join(", ")
                );
            }
            if let Some(noise) = noise_line(report) {
                let _ = writeln!(s, "\n**Too noisy to separate.** {}", no_html(&noise));
            }
            if let Some(line) = ranking_line(report) {
                let _ = writeln!(s, "\n{}", no_html(&line));
            }
            let paired = paired_rows(report);
            if !paired.is_empty() {
                let _ = writeln!(
                    s,
                    "\n| # | configuration | cost vs fastest | 95% interval | tokens/s (bouts) | bouts |\n|---|---|---:|---:|---:|---:|"
                );
                for row in &paired {
                    let cells: Vec<String> = row.iter().map(|c| md_text(c)).collect();
                    let _ = writeln!(s, "| {} |", cells.join(" | "));
                }
            }
        }
        None => {
            let _ = writeln!(s, "No trial fits.");
        }
    }
    let _ = writeln!(s, "\n## Trials (prediction against measurement)\n");
    let heads = headers(report);
    let _ = writeln!(s, "| {} |", heads.join(" | "));
    let _ = writeln!(
        s,
        "|{}|",
        heads
            .iter()
            .enumerate()
            .map(|(i, _)| if (5..13).contains(&i) || i == 3 {
                "---:"
            } else {
                "---"
            })
            .collect::<Vec<_>>()
            .join("|")
    );
    for (row, r) in rows(report).iter().zip(&report.trials) {
        let mut cells: Vec<String> = row.iter().map(|c| md_text(c)).collect();
        if let Some(n) = r.note.as_ref().filter(|_| r.outcome != Outcome::Invalid) {
            cells[4] = format!("{} ({})", cells[4], md_text(n));
        }
        let _ = writeln!(s, "| {} |", cells.join(" | "));
    }
    let _ = writeln!(
        s,
        "\n`*` marks the recommendation and `=` the configurations tied with it. *{}* is {}. *predicted* and *tracked* are the peak per device (engine plus runtime overhead) from the meta engine and as the trial's tracker measured it; *mem err* is their difference (0% is the meta == cpu invariant). *tokens/s* is the median with half its 95% interval. *time x* is measured / predicted step time on the run device. *on target* is the plan's peak per GPU on {}. *host RSS* is the trial process's resident-set high-water mark: host memory, including the process itself (about {} before the engine allocated), never compared with the device capacity.",
        cost_heading(report),
        if report.pricing.usd_per_hour.is_some() {
            "dollars per million tokens at the measured throughput"
        } else {
            "host seconds per million tokens at the measured throughput: time, not money (no host_usd_per_hour)"
        },
        md_text(&report.target.display_name),
        report
            .trials
            .iter()
            .find_map(|t| t.measured.as_ref().and_then(|m| m.rss_baseline_bytes))
            .map_or("-".into(), fmt_bytes)
    );
    s.push_str(&nvml_section(report));
    s
}

/// On a GPU run device: predicted, tracked and NVML peaks side by side (or
/// why NVML did not sample).
pub fn nvml_section(report: &SweepReport) -> String {
    let Some(state) = &report.nvml else {
        return String::new();
    };
    let mut s = format!(
        "
## GPU memory: predicted, tracked and NVML

{}.
",
        no_html(state)
    );
    let rows: Vec<(usize, &TrialRecord, u64)> = report
        .trials
        .iter()
        .enumerate()
        .filter_map(|(i, t)| Some((i, t, t.measured.as_ref()?.nvml_peak_bytes?)))
        .collect();
    if rows.is_empty() {
        return s;
    }
    let _ = writeln!(
        s,
        "
| # | configuration | predicted | tracked | NVML | tracked err | NVML err |\n|---|---|---:|---:|---:|---:|---:|"
    );
    for (i, t, nv) in rows {
        let m = t.measured.as_ref().expect("filtered");
        let _ = writeln!(
            s,
            "| {i} | {} | {} | {} | {} | {} | {} |",
            t.point.label(),
            t.predicted
                .as_ref()
                .map_or("-".into(), |p| fmt_bytes(p.peak_total_bytes)),
            fmt_bytes(m.peak_bytes.total + report.runtime_overhead_bytes),
            fmt_bytes(nv),
            pct(t.memory_error_pct),
            pct(t.nvml_error_pct)
        );
    }
    s.push_str(
        "
*predicted* and *tracked* include the start-up overhead measured on this GPU (context, kernels, cuBLAS); *NVML* is the trial process's device memory as the driver reports it, sampled during the trial, which also holds the caching allocator's reserve. Errors are relative to the measured figure.\n",
    );
    s
}

/// The terminal summary: the same rows, aligned.
impl crate::report::Report for SweepReport {
    fn table(&self) -> String {
        table(self)
    }
}

pub fn table(report: &SweepReport) -> String {
    let rows = rows(report);
    let heads = headers(report);
    let mut w = heads.clone().map(|h| h.chars().count());
    for r in &rows {
        for (w, c) in w.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    // Text left, numbers right.
    let line = |cells: Vec<&str>| {
        cells
            .iter()
            .zip(&w)
            .enumerate()
            .map(|(i, (c, w))| {
                if (1..=2).contains(&i) || i == 4 {
                    format!("{c:<w$}")
                } else {
                    format!("{c:>w$}")
                }
            })
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let mut s = String::new();
    let _ = writeln!(s, "{}", devices_line(report));
    let _ = writeln!(s, "{}\n", pricing_line(report));
    let _ = writeln!(s, "{}", line(heads.iter().map(String::as_str).collect()));
    for r in &rows {
        let _ = writeln!(s, "{}", line(r.iter().map(String::as_str).collect()));
    }
    match &report.recommendation {
        Some(rec) => {
            let _ = writeln!(
                s,
                "\nrecommended: #{} {}",
                rec.trial,
                report.trials[rec.trial].point.label()
            );
            for reason in &rec.reasons {
                let _ = writeln!(s, "  {reason}");
            }
            if let Some(noise) = noise_line(report) {
                let _ = writeln!(s, "warning: {noise}");
            }
            let paired = paired_rows(report);
            if !paired.is_empty() {
                let _ = writeln!(
                    s,
                    "paired re-timing (cost over the fastest's in the same round):"
                );
                for [i, label, ratio, ci, tps, bouts] in &paired {
                    let _ = writeln!(
                        s,
                        "  {i:>4} {ratio:>7} [{ci}]  {tps:>7} tok/s  {bouts:>3} bouts  {label}"
                    );
                }
            }
        }
        None => {
            let _ = writeln!(s, "\nno trial fits");
        }
    }
    let _ = writeln!(
        s,
        "{} of {} grid points ran as trials{}",
        report.trials_run,
        report.grid_size,
        if report.interrupted {
            " (interrupted)"
        } else {
            ""
        }
    );
    s
}
