//! report.md: the fit table, the recommendation with its reasons, and
//! prediction against measurement.

use std::fmt::Write as _;

use super::report::{Outcome, SweepReport, TrialRecord};
use crate::plan::{name, usd};
use crate::units::fmt_bytes;

pub fn outcome_label(r: &TrialRecord) -> &'static str {
    match r.outcome {
        Outcome::Ran if r.fits => "fit",
        Outcome::Ran => "over headroom",
        Outcome::Oom => "OOM",
        Outcome::Timeout => "timeout",
        Outcome::Crash => "crash",
        Outcome::SkippedPredictedOom => "skipped: predicted OOM",
        Outcome::SkippedByMonotonicity => "skipped: monotonicity",
        Outcome::Invalid => "invalid",
    }
}

fn pct(x: Option<f64>) -> String {
    x.map_or("-".into(), |x| format!("{x:+.1}%"))
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
                _ => "",
            };
            [
                format!("{i}{mark}"),
                format!(
                    "x{} {} {} {}{}",
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
                outcome_label(r).into(),
                r.predicted
                    .as_ref()
                    .map_or("-".into(), |x| fmt_bytes(x.peak_total_bytes)),
                m.map_or("-".into(), |m| fmt_bytes(m.peak_bytes.total)),
                m.and_then(|m| m.device_peak_bytes)
                    .map_or("-".into(), fmt_bytes),
                m.map_or("-".into(), |m| format!("{:.0}", m.tokens_per_s)),
                m.map_or("-".into(), |m| usd(m.usd_per_mtok)),
                pct(r.memory_error_pct),
                pct(r.time_error_pct),
                r.note.clone().unwrap_or_default().replace('|', "/"),
            ]
        })
        .collect()
}

pub const HEADERS: [&str; 13] = [
    "#",
    "knobs",
    "ckpt/attn",
    "mb",
    "outcome",
    "predicted",
    "measured",
    "RSS peak",
    "tokens/s",
    "$/Mtok",
    "mem err",
    "time err",
    "note",
];

pub fn render(report: &SweepReport) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# memfit sweep: {} on {}\n",
        report.model, report.hardware
    );
    let _ = writeln!(
        s,
        "Device `{}`, capacity {} ({} usable after {:.0}% headroom), seq-len {}, global batch {}. {} of {} grid points ran as trials{}.\n",
        report.device,
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
                let _ = writeln!(s, "- {reason}");
            }
            if !report.pareto.is_empty() {
                let list: Vec<String> = report.pareto.iter().map(|i| format!("#{i}")).collect();
                let _ = writeln!(
                    s,
                    "- Pareto frontier (peak memory against tokens/s): {}",
                    list.join(", ")
                );
            }
        }
        None => {
            let _ = writeln!(s, "No trial fits.");
        }
    }
    let _ = writeln!(s, "\n## Trials (prediction against measurement)\n");
    let _ = writeln!(s, "| {} |", HEADERS.join(" | "));
    let _ = writeln!(s, "|{}|", HEADERS.map(|_| "---").join("|"));
    for row in rows(report) {
        let _ = writeln!(s, "| {} |", row.join(" | "));
    }
    let _ = writeln!(
        s,
        "\nMemory error compares the engine's tracked peak with the meta prediction (0% is the meta == cpu invariant). Time error compares the measured step with the roofline for the hardware profile, so on cpu it measures how far this machine is from that GPU."
    );
    s
}

/// The terminal summary: the same rows, aligned.
pub fn table(report: &SweepReport) -> String {
    let rows = rows(report);
    let mut w = HEADERS.map(str::len);
    for r in &rows {
        for (w, c) in w.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        cells
            .iter()
            .zip(&w)
            .take(12)
            .map(|(c, w)| format!("{c:>w$}"))
            .collect::<Vec<_>>()
            .join("  ")
    };
    let mut s = String::new();
    let _ = writeln!(s, "{}", line(HEADERS.to_vec()));
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
