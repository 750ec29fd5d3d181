//! The `memfit watch` screen: a pure function of [`WatchState`] ([`render`]),
//! and the terminal loop around it ([`run`]).
//!
//! ```text
//! memfit watch │ python train.py │ pid 4242 │ running 1:05 │ every 100 ms │ warn at 90%
//! job peak 70.00 GiB on GPU 0 (87.9%) │ memfit predicts 66.50 GiB for hf-eager (+ context)
//! ⚠ GPU 0 memory at 93.4% (...): above --warn-at 90%            (while above)
//! ┌GPUs──────────────────────────────────────────────────────────────┐
//! │ 0 NVIDIA H100 80GB  [██████████░░░░] 74.40/79.65 GiB 93.4% ...   │
//! │   └ 4242 python      70.00 GiB  job                               │
//! └──────────────────────────────────────────────────────────────────┘
//! ┌job GPU memory────────────────────────────────────────────────────┐
//! │ the job's memory over time, capacity, --warn-at and prediction   │
//! └──────────────────────────────────────────────────────────────────┘
//! ┌output (memfit-watch.log)─────────────────────────────────────────┐
//! │ the command's last lines                                         │
//! └──────────────────────────────────────────────────────────────────┘
//! q quit: SIGTERM to the command, SIGKILL after the grace period
//! ```

use std::time::Duration;

use crossterm::event::{self, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;

use super::Session;
use super::state::{Phase, Target, WatchState, fmt_pct};
use crate::ui::chart::{self, Mark};
use crate::ui::gpu::{GpuRows, gpu_rows};
use crate::ui::style::{bold, dim, sep};
use crate::ui::text::{clip, clip_spans, fmt_elapsed};
use crate::ui::widgets::{hint, hints, panel};
use crate::units::fmt_bytes;

/// Draws the whole screen from the state alone.
pub fn render(st: &WatchState, f: &mut Frame) {
    let area = f.area();
    if area.width == 0 || area.height == 0 {
        return;
    }
    let w = area.width as usize;
    let banner = banner(st, w);
    let gpu_lines = gpu_lines(st, area.width.saturating_sub(2) as usize);
    let log_rows: u16 = if st.log_path.is_some() && area.height >= 24 {
        6
    } else {
        0
    };
    // The GPU panel takes what it needs, up to a third of the screen; the
    // chart the rest (at least 6 rows, when there are that many).
    let fixed = 2 + banner.is_some() as u16 + 1 + if log_rows > 0 { log_rows + 2 } else { 0 };
    let body = area.height.saturating_sub(fixed);
    let gpu_rows = (gpu_lines.len() as u16 + 2)
        .min((body / 3).max(3))
        .min(body.saturating_sub(6).max(3));
    let [header, banner_area, gpus, chart, log, keys] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Length(banner.is_some() as u16),
        Constraint::Length(gpu_rows),
        Constraint::Min(0),
        Constraint::Length(if log_rows > 0 { log_rows + 2 } else { 0 }),
        Constraint::Length(1),
    ])
    .areas(area);
    f.render_widget(
        Paragraph::new(vec![title_line(st, w), peak_line(st, w)]),
        header,
    );
    if let Some(b) = banner {
        f.render_widget(Paragraph::new(b), banner_area);
    }
    f.render_widget(
        Paragraph::new(gpu_lines).block(panel(&gpu_title(st), gpus)),
        gpus,
    );
    render_chart(st, f, chart);
    if log_rows > 0 {
        render_log(st, f, log);
    }
    f.render_widget(Paragraph::new(key_line(st, w)), keys);
}

fn fg(st: &WatchState, c: Color) -> Style {
    crate::ui::style::fg(st.no_color, c)
}

fn pct(b: u64, total: u64) -> f64 {
    crate::units::percent_of(b as f64, total)
}

fn title_line(st: &WatchState, w: usize) -> Line<'static> {
    let mut spans = vec![Span::styled("memfit watch", bold())];
    spans.push(sep());
    spans.push(Span::raw(st.target.label()));
    if let Target::Command { pid, .. } = &st.target {
        spans.push(sep());
        spans.push(Span::raw(format!("pid {pid}")));
    }
    spans.push(sep());
    let clock = fmt_elapsed(st.elapsed_s);
    spans.push(match &st.phase {
        Phase::Running => Span::raw(format!("running {clock}")),
        Phase::Stopping { killed: false, .. } => {
            Span::styled(format!("stopping {clock}"), fg(st, Color::Yellow))
        }
        Phase::Stopping { killed: true, .. } => {
            Span::styled(format!("killed {clock}"), fg(st, Color::Red))
        }
        Phase::Ended { code, .. } => Span::raw(match code {
            Some(c) => format!("exited {c} after {clock}"),
            None => format!("ended after {clock}"),
        }),
    });
    spans.push(sep());
    spans.push(Span::raw(format!("every {} ms", st.sample_ms)));
    spans.push(sep());
    spans.push(Span::raw(format!(
        "warn at {}%",
        fmt_pct(st.warn_at * 100.0)
    )));
    clip_spans(spans, w)
}

/// The second header line: the job's peak and memfit's prediction beside
/// it, or why GPU memory is not measured.
fn peak_line(st: &WatchState, w: usize) -> Line<'static> {
    let mut spans = Vec::new();
    match (&st.nvml, st.has_job()) {
        (Err(_), _) => {
            // The reason is in the GPU panel; here, the fact.
            spans.push(Span::styled(
                "no NVML".to_string(),
                fg(st, Color::Yellow).add_modifier(Modifier::BOLD),
            ));
            if let Some(b) = st.host_rss_peak {
                spans.push(sep());
                spans.push(Span::raw(format!(
                    "job host RSS peak {} (host memory, not GPU)",
                    fmt_bytes(b)
                )));
            }
        }
        (Ok(_), true) => match st.job_peak {
            Some((b, g, _)) => {
                let total = st
                    .gpus
                    .iter()
                    .find(|p| p.index == g)
                    .map_or(0, |p| p.total_bytes);
                spans.push(Span::styled(
                    format!(
                        "job peak {} ({:.1}% of GPU {g})",
                        fmt_bytes(b),
                        pct(b, total)
                    ),
                    bold(),
                ));
            }
            None => spans.push(Span::styled(
                "job holds no GPU memory yet".to_string(),
                dim(),
            )),
        },
        (Ok(driver), false) => spans.push(Span::raw(match driver {
            Some(d) => format!("NVIDIA driver {d}"),
            None => "NVML".into(),
        })),
    }
    if let Some(p) = &st.prediction {
        spans.push(sep());
        spans.push(Span::styled(
            format!(
                "memfit predicts {} for {} (+ context)",
                fmt_bytes(p.tracked_peak_bytes),
                p.framework.name()
            ),
            fg(st, Color::Blue),
        ));
        // The measured peak less the prediction: the context, the
        // framework's cache and workspaces make it positive, by design.
        if let Some((b, ..)) = st.job_peak {
            spans.push(Span::raw(format!(
                ": {}",
                crate::units::fmt_signed_bytes(b as i64 - p.tracked_peak_bytes as i64)
            )));
        }
    }
    clip_spans(spans, w)
}

/// A red line while a GPU is above `--warn-at`; the stop in progress, or a
/// sampling error, otherwise.
fn banner(st: &WatchState, w: usize) -> Option<Line<'static>> {
    if let Some(warn) = st.warning_now() {
        let style = if st.no_color {
            bold().add_modifier(Modifier::REVERSED)
        } else {
            bold().fg(Color::White).bg(Color::Red)
        };
        return Some(clip_spans(
            vec![Span::styled(format!("⚠ WARNING {warn}"), style)],
            w,
        ));
    }
    let text = st
        .message
        .clone()
        .or_else(|| st.sample_error.as_ref().map(|e| format!("NVML: {e}")))?;
    Some(clip_spans(
        vec![Span::styled(text, fg(st, Color::Yellow))],
        w,
    ))
}

fn gpu_title(st: &WatchState) -> String {
    match (&st.nvml, st.only_gpu) {
        (Err(_), _) => "GPUs".into(),
        (Ok(d), only) => {
            let mut t = match only {
                Some(i) => format!("GPU {i}"),
                None => "GPUs".into(),
            };
            if let Some(d) = d {
                t += &format!(" (driver {d})");
            }
            t
        }
    }
}

/// One row per GPU (memory bar, %, utilisation, power, temperature) and
/// one per process on it, the job's marked; or why there are none.
fn gpu_lines(st: &WatchState, w: usize) -> Vec<Line<'static>> {
    let snap = match (&st.nvml, &st.latest) {
        (Err(why), _) => {
            let mut v = vec![Line::from(Span::styled(
                clip(&format!("no NVML: {why}"), w),
                fg(st, Color::Yellow).add_modifier(Modifier::BOLD),
            ))];
            v.push(Line::from(Span::styled(
                clip(
                    "GPU memory is not measured; the chart shows the job's host memory (RSS)",
                    w,
                ),
                dim(),
            )));
            return v;
        }
        (Ok(_), None) => {
            return vec![Line::from(Span::styled("waiting for NVML ...", dim()))];
        }
        (Ok(_), Some(s)) => s,
    };
    let mut out = Vec::new();
    if snap.gpus.is_empty() {
        out.push(Line::from(Span::styled(
            match st.only_gpu {
                Some(i) => format!("NVML lists no GPU {i}"),
                None => "NVML lists no GPU".into(),
            },
            dim(),
        )));
    }
    out.extend(gpu_rows(
        &snap.gpus,
        w,
        GpuRows {
            warn_at: st.warn_at,
            job: &st.job_pids,
            no_color: st.no_color,
        },
    ));
    out
}

fn render_chart(st: &WatchState, f: &mut Frame, area: Rect) {
    if area.height < 3 {
        return;
    }
    let gpu = st.nvml.is_ok();
    let title = chart_title(st);
    let block = panel(&title, area);
    let pick = |p: &super::state::Point| -> Option<u64> {
        if !gpu {
            p.host_rss
        } else if st.has_job() {
            p.job
        } else {
            p.used
        }
    };
    let main: Vec<(f64, f64)> = st
        .series
        .iter()
        .filter_map(|p| pick(p).map(|b| (p.t_s, b as f64)))
        .collect();
    let used: Vec<(f64, f64)> = if gpu && st.has_job() {
        st.series
            .iter()
            .filter_map(|p| p.used.map(|b| (p.t_s, b as f64)))
            .collect()
    } else {
        Vec::new()
    };
    if main.is_empty() && used.is_empty() {
        let text = match st.phase {
            Phase::Ended { .. } => "no samples",
            _ => "waiting for samples ...",
        };
        f.render_widget(Paragraph::new(Span::styled(text, dim())).block(block), area);
        return;
    }
    let t0 = st.series.first().map_or(0.0, |p| p.t_s);
    let t1 = st.series.last().map_or(1.0, |p| p.t_s).max(t0 + 1.0);
    let capacity = if gpu { st.capacity() } else { None };
    let predicted = st
        .prediction
        .as_ref()
        .filter(|_| gpu)
        .map(|p| p.tracked_peak_bytes);
    let top = main
        .iter()
        .chain(&used)
        .map(|p| p.1)
        .chain([capacity.unwrap_or(0) as f64, predicted.unwrap_or(0) as f64])
        .fold(1.0f64, f64::max);
    // Each line its own glyph (NO_COLOR loses nothing), the legend a row
    // under the plot, never on it.
    let main_name = if !gpu {
        "host RSS"
    } else if st.has_job() {
        "job"
    } else {
        "used"
    };
    let nc = st.no_color;
    let mut legend = vec![Mark::Measured.key(nc, main_name, main_name)];
    let mut dots = Vec::new();
    if !used.is_empty() {
        legend.push(chart::Key::new(
            "·",
            fg(st, Color::Green),
            "GPU used",
            "used",
        ));
        dots = used
            .iter()
            .map(|&(x, y)| chart::Dot {
                x,
                y,
                glyph: '·',
                style: fg(st, Color::Green),
            })
            .collect();
    }
    let rules = reference_lines(st, capacity, predicted, &mut legend);
    let inner = block.inner(area);
    f.render_widget(block, area);
    let plot = chart::Plot {
        x: [t0, t1],
        x_labels: [format!("{t0:.0}s"), format!("{t1:.0}s")],
        y: chart::YAxis::Bytes,
        top,
        rules,
        // The job last, over the reference lines.
        curves: vec![chart::Curve {
            points: &main,
            style: Mark::Measured.style(nc),
        }],
        dots,
        legend,
    };
    chart::draw(&plot, f.buffer_mut(), inner);
}

/// The chart's title: what its main line is, with its latest and peak.
fn chart_title(st: &WatchState) -> String {
    if st.nvml.is_err() {
        match st.host_rss_peak {
            Some(p) => format!(
                "job host memory (RSS, not GPU memory), peak {}",
                fmt_bytes(p)
            ),
            None => "job host memory (RSS, not GPU memory)".into(),
        }
    } else if st.has_job() {
        let now = st.series.last().and_then(|p| p.job).unwrap_or(0);
        let mut t = format!("job GPU memory (NVML): now {}", fmt_bytes(now));
        if let Some((b, ..)) = st.job_peak {
            t += &format!(", peak {}", fmt_bytes(b));
        }
        t
    } else {
        "GPU memory used (fullest GPU)".into()
    }
}

/// The capacity and the warning level on it, and memfit's prediction, as
/// rules across the chart, each with its legend entry.
fn reference_lines(
    st: &WatchState,
    capacity: Option<u64>,
    predicted: Option<u64>,
    legend: &mut Vec<chart::Key>,
) -> Vec<chart::Rule> {
    let nc = st.no_color;
    let mut rules = Vec::new();
    if let Some(c) = capacity {
        legend.push(Mark::Capacity.key(nc, format!("capacity {}", fmt_bytes(c)), "cap"));
        rules.push(Mark::Capacity.rule(c as f64, nc));
        let warn = format!("warn {}%", fmt_pct(st.warn_at * 100.0));
        legend.push(Mark::Warn.key(nc, warn, "warn"));
        rules.push(Mark::Warn.rule(c as f64 * st.warn_at, nc));
    }
    if let Some(p) = predicted {
        let label = format!("memfit predicts {}", fmt_bytes(p));
        legend.push(Mark::Predicted.key(nc, label, "pred"));
        rules.push(Mark::Predicted.rule(p as f64, nc));
    }
    rules
}

fn render_log(st: &WatchState, f: &mut Frame, area: Rect) {
    let title = match &st.log_path {
        Some(p) => format!("output ({})", p.display()),
        None => "output".into(),
    };
    let rows = area.height.saturating_sub(2) as usize;
    let w = area.width.saturating_sub(2) as usize;
    let lines: Vec<Line> = st
        .log
        .iter()
        .skip(st.log.len().saturating_sub(rows))
        .map(|l| Line::from(clip(l, w)))
        .collect();
    f.render_widget(Paragraph::new(lines).block(panel(&title, area)), area);
}

/// The footer: what `q` does now, spelled out when it fits.
fn key_line(st: &WatchState, w: usize) -> Line<'static> {
    let (what, short) = match (&st.target, &st.phase) {
        (Target::Command { .. }, Phase::Stopping { .. }) => ("again: SIGKILL now", "kill"),
        (Target::Command { .. }, _) => (
            "quit: SIGTERM to the command, SIGKILL after the grace period",
            "quit",
        ),
        (Target::Pid { .. }, _) => ("stop watching (the process keeps running)", "stop"),
        (Target::Gpus, _) => ("quit", "quit"),
    };
    hints(&[hint("q", what, "q", short)], w)
}

/// The terminal loop: samples in, a frame every 100 ms, keys; returns when
/// the job ends (or the user quits and it has stopped).
pub fn run(s: &mut Session) -> Result<(), String> {
    let mut screen = crate::ui::Screen::enter()?;
    let terminal = &mut screen.terminal;
    loop {
        s.pump();
        if s.poll_end() {
            return Ok(());
        }
        terminal
            .draw(|f| render(&s.st, f))
            .map_err(|e| format!("cannot draw: {e}"))?;
        if !event::poll(Duration::from_millis(100))
            .map_err(|e| format!("cannot read the terminal: {e}"))?
        {
            continue;
        }
        let quit = match event::read().map_err(|e| format!("cannot read the terminal: {e}"))? {
            event::Event::Key(k) if k.kind != KeyEventKind::Release => {
                matches!(k.code, KeyCode::Char('q') | KeyCode::Esc)
                    || (k.modifiers.contains(KeyModifiers::CONTROL) && k.code == KeyCode::Char('c'))
            }
            _ => false,
        };
        if quit {
            s.request_stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::state::testdata::*;
    use super::super::state::*;
    use super::*;
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;

    fn screen(st: &WatchState, w: u16, h: u16) -> String {
        let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
        t.draw(|f| render(st, f)).unwrap();
        crate::ui::testing::rows(t.backend().buffer()).join("\n")
    }

    #[test]
    fn every_size_renders() {
        let mut st = WatchState::new(
            Target::Command {
                argv: vec!["python".into(), "train.py".into()],
                pid: 100,
            },
            Ok(None),
            100,
            0.9,
        );
        st.log_path = Some("memfit-watch.log".into());
        st.push_log("step 1".into());
        for i in 0..50 {
            let b = (i as u64 + 1) * GIB;
            st.on_tick(tick(
                i as f64 * 0.1,
                &[100],
                vec![gpu(0, b + GIB, 80 * GIB, &[(100, b)])],
            ));
        }
        for (w, h) in [(100, 30), (80, 24), (200, 60), (20, 5), (1, 1), (40, 10)] {
            screen(&st, w, h);
        }
        let no_nvml = WatchState::new(Target::Gpus, Err("x".into()), 100, 0.9);
        for (w, h) in [(100, 30), (10, 3)] {
            screen(&no_nvml, w, h);
        }
    }
}
