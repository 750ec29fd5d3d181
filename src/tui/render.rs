//! Drawing `memfit tui`: a pure function of the [`App`] state.
//!
//! One main view (header, grid, live memory chart, breakdown of the selected
//! trial, recommendation, status line), a detail view and a help view. Every
//! size renders without panicking; 80x24 keeps the grid, chart and breakdown.

use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::{
    Axis, Block, Chart, Dataset, GraphType, Paragraph, Row as TRow, Table, TableState, Wrap,
};

use super::app::{App, KEYMAP, Row, SortColumn, Status, View, visible};
use crate::memory::Category;
use crate::plan::{Point, name, usd};
use crate::units::fmt_bytes;

/// Draws the whole screen.
pub fn render(app: &App, f: &mut Frame) {
    let area = f.area();
    if area.width == 0 || area.height == 0 {
        return;
    }
    let [header, body, status] = Layout::vertical([
        Constraint::Length(3),
        Constraint::Min(0),
        Constraint::Length(1),
    ])
    .areas(area);
    f.render_widget(Paragraph::new(header_lines(app)), header);
    match app.view {
        View::Grid => render_grid_view(app, f, body),
        View::Detail => render_detail(app, f, body),
        View::Help => render_help(app, f, body),
    }
    f.render_widget(Paragraph::new(status_line(app)), status);
}

/// The knobs of a point in a few words: GPUs, sharding (unless none),
/// precision, optimizer, `ckpt` under checkpointing, attention.
pub fn knobs(p: &Point) -> String {
    let mut s = format!("x{}", p.gpus);
    let sharding = name(p.sharding);
    if sharding != "none" {
        s += &format!(" {sharding}");
    }
    s += &format!(" {} {}", name(p.precision), name(p.optimizer));
    if name(p.checkpointing) != "none" {
        s += " ckpt";
    }
    s += &format!(" {}", name(p.attention));
    s
}

/// `h:mm:ss`, or `m:ss` under an hour.
pub fn fmt_elapsed(s: f64) -> String {
    let t = s.max(0.0) as u64;
    let (h, m, s) = (t / 3600, t / 60 % 60, t % 60);
    if h > 0 {
        format!("{h}:{m:02}:{s:02}")
    } else {
        format!("{m}:{s:02}")
    }
}

fn pct(b: f64, capacity: u64) -> f64 {
    if capacity == 0 {
        0.0
    } else {
        b / capacity as f64 * 100.0
    }
}

fn fmt_signed(b: i64) -> String {
    if b < 0 {
        format!("-{}", fmt_bytes(b.unsigned_abs()))
    } else {
        fmt_bytes(b as u64)
    }
}

/// A foreground colour, or none under NO_COLOR.
fn fg(app: &App, c: Color) -> Style {
    if app.header.no_color {
        Style::default()
    } else {
        Style::default().fg(c)
    }
}

fn bold() -> Style {
    Style::default().add_modifier(Modifier::BOLD)
}

fn dim() -> Style {
    Style::default().add_modifier(Modifier::DIM)
}

/// How a status is drawn: green fit, red failures, yellow running, dim skips;
/// bold and dim only under NO_COLOR.
fn status_style(app: &App, s: Status) -> Style {
    match s {
        Status::Fit => fg(app, Color::Green),
        Status::Over | Status::Oom | Status::Timeout | Status::Crash => fg(app, Color::Red)
            .add_modifier(if app.header.no_color {
                Modifier::BOLD
            } else {
                Modifier::empty()
            }),
        Status::Running => fg(app, Color::Yellow).add_modifier(Modifier::BOLD),
        Status::SkippedPredicted | Status::SkippedMonotonic | Status::Invalid => {
            fg(app, Color::DarkGray).add_modifier(Modifier::DIM)
        }
        Status::Queued => Style::default(),
    }
}

fn row_label(app: &App, index: usize) -> String {
    app.row_of(index).map_or(format!("#{index}"), |i| {
        format!("#{index} {}", app.rows[i].point.label())
    })
}

/// `#3 x1 zero2 bf16 adamw8bit fused mb2`: what a header line has room for.
fn short_label(app: &App, index: usize) -> String {
    app.row_of(index).map_or(format!("#{index}"), |i| {
        let p = &app.rows[i].point;
        format!("#{index} {} mb{}", knobs(p), p.micro_batch)
    })
}

fn header_lines(app: &App) -> Vec<Line<'static>> {
    let sep = || Span::styled(" │ ", dim());
    let l1 = vec![
        Span::styled(
            format!(
                "{} · {} · {}",
                app.header.model, app.header.hardware, app.header.device
            ),
            bold(),
        ),
        sep(),
        Span::raw(format!(
            "capacity {} · usable {} ({:.0}% headroom)",
            fmt_bytes(app.header.capacity),
            fmt_bytes(app.header.usable),
            app.header.headroom * 100.0
        )),
        sep(),
        Span::raw(format!(
            "seq {} · batch {} · ${}/GPU-h",
            app.header.seq_len,
            app.header.global_batch,
            usd(app.header.usd_per_gpu_hour)
        )),
    ];
    let (done, total) = app.progress();
    let mut l2 = vec![Span::raw(format!("trials {done}/{total}"))];
    if app.finished {
        l2.push(Span::styled(" finished", fg(app, Color::Green)));
    }
    l2.push(sep());
    l2.push(Span::raw(format!("elapsed {}", fmt_elapsed(app.elapsed_s))));
    if app.paused {
        l2.push(sep());
        l2.push(Span::styled(
            "PAUSED",
            fg(app, Color::Yellow).add_modifier(Modifier::BOLD),
        ));
    }
    l2.push(sep());
    l2.push(Span::raw(format!(
        "sort {}{}",
        app.sort.label(),
        if app.reverse { "▼" } else { "▲" }
    )));
    if !app.filter.is_empty() || app.editing_filter {
        l2.push(sep());
        l2.push(Span::raw(format!("filter \"{}\"", app.filter)));
    }
    if app.fits_only {
        l2.push(sep());
        l2.push(Span::raw("fits only"));
    }
    l2.push(sep());
    match app.running {
        Some(i) => l2.push(Span::styled(
            format!("running {}", short_label(app, i)),
            fg(app, Color::Yellow),
        )),
        None => l2.push(Span::raw("idle")),
    }
    let l3 = match app.recommendation.and_then(|i| app.row_of(i)) {
        Some(i) => {
            let r = &app.rows[i];
            let mut s = vec![
                Span::styled(
                    "★ recommended ",
                    fg(app, Color::Green).add_modifier(Modifier::BOLD),
                ),
                Span::raw(short_label(app, r.index)),
            ];
            if let (Some(u), Some(t)) = (r.usd_per_mtok(), r.tokens_per_s()) {
                s.push(Span::raw(format!(" · ${}/Mtok · {t:.0} tok/s", usd(u))));
            }
            if let Some(ru) = app.runner_up {
                s.push(sep());
                s.push(Span::raw(format!("runner-up {}", short_label(app, ru))));
            }
            s
        }
        None => vec![Span::styled("★ no fitting trial yet", dim())],
    };
    vec![Line::from(l1), Line::from(l2), Line::from(l3)]
}

fn status_line(app: &App) -> Line<'static> {
    if app.editing_filter {
        return Line::from(vec![
            Span::styled("filter: ", bold()),
            Span::raw(format!("{}▏", app.filter)),
            Span::styled("  (Enter/Esc to finish, Backspace deletes)", dim()),
        ]);
    }
    if let Some(m) = &app.message {
        return Line::from(Span::styled(m.clone(), bold()));
    }
    let hint = match app.view {
        View::Grid => {
            "? help · q quit · ↑↓ move · Enter detail · s/S sort · / filter · f fits · Space pause · r re-run · e export"
        }
        View::Detail => "Esc/Enter/q back · ↑↓ ←→ other trials · r re-run · e export · ? help",
        View::Help => "Esc/?/q back",
    };
    Line::from(Span::styled(hint, dim()))
}

#[derive(Clone, Copy, PartialEq)]
enum Col {
    Index,
    Knobs,
    Mb,
    Status,
    Predicted,
    Measured,
    TokS,
    Usd,
    Margin,
}

impl Col {
    fn width(self) -> u16 {
        match self {
            Col::Index => 5,
            Col::Knobs => 18,
            Col::Mb => 3,
            Col::Status => 12,
            Col::Predicted | Col::Measured => 10,
            Col::TokS => 9,
            Col::Usd => 8,
            Col::Margin => 17,
        }
    }

    fn title(self) -> &'static str {
        self.sort().label()
    }

    fn sort(self) -> SortColumn {
        match self {
            Col::Index => SortColumn::Index,
            Col::Knobs => SortColumn::Knobs,
            Col::Mb => SortColumn::MicroBatch,
            Col::Status => SortColumn::Status,
            Col::Predicted => SortColumn::Predicted,
            Col::Measured => SortColumn::Measured,
            Col::TokS => SortColumn::TokensPerS,
            Col::Usd => SortColumn::UsdPerMtok,
            Col::Margin => SortColumn::Margin,
        }
    }
}

/// The grid's columns that fit in `width`, in display order: the optional
/// ones ($/Mtok, predicted, tok/s) go first when it is narrow.
fn columns(width: u16) -> Vec<Col> {
    let mut cols = vec![
        Col::Index,
        Col::Knobs,
        Col::Mb,
        Col::Status,
        Col::Measured,
        Col::Margin,
    ];
    let used = |c: &[Col]| c.iter().map(|c| c.width() + 1).sum::<u16>();
    for extra in [Col::Usd, Col::Predicted, Col::TokS] {
        if used(&cols) + extra.width() < width {
            cols.push(extra);
        }
    }
    let order = [
        Col::Index,
        Col::Knobs,
        Col::Mb,
        Col::Status,
        Col::Predicted,
        Col::Measured,
        Col::TokS,
        Col::Usd,
        Col::Margin,
    ];
    order.into_iter().filter(|c| cols.contains(c)).collect()
}

fn cell(app: &App, r: &Row, c: Col) -> String {
    let dash = || "-".to_string();
    match c {
        Col::Index => {
            let mark = if app.recommendation == Some(r.index) {
                "★"
            } else {
                " "
            };
            format!("{mark}{}", r.index)
        }
        Col::Knobs => knobs(&r.point),
        Col::Mb => r.point.micro_batch.to_string(),
        Col::Status => r.status.label().to_string(),
        Col::Predicted => r.predicted_total().map_or_else(dash, fmt_bytes),
        Col::Measured => r.measured_total().map_or_else(dash, fmt_bytes),
        Col::TokS => r.tokens_per_s().map_or_else(dash, |t| format!("{t:.0}")),
        Col::Usd => r.usd_per_mtok().map_or_else(dash, usd),
        Col::Margin => match r.margin(app.header.capacity) {
            Some((m, predicted)) => format!(
                "{}{} {:.0}%",
                if predicted { "~" } else { "" },
                fmt_signed(m),
                pct(m as f64, app.header.capacity)
            ),
            None => dash(),
        },
    }
}

fn render_grid_view(app: &App, f: &mut Frame, area: Rect) {
    // The breakdown needs 11 lines to show every category; below 13 the
    // grid has it all.
    let panels_h = match area.height {
        18.. => (area.height * 9 / 20).clamp(11, 14),
        13.. => 9,
        _ => 0,
    };
    let [grid, panels] =
        Layout::vertical([Constraint::Min(0), Constraint::Length(panels_h)]).areas(area);
    render_table(app, f, grid);
    if panels_h == 0 {
        return;
    }
    let selected = app.selected_row();
    if area.width >= 120 {
        let [c, b, r] = Layout::horizontal([
            Constraint::Percentage(40),
            Constraint::Percentage(33),
            Constraint::Percentage(27),
        ])
        .areas(panels);
        render_chart(app, f, c);
        render_breakdown(app, selected, f, b);
        render_recommendation(app, f, r);
    } else {
        let [c, b] = Layout::horizontal([Constraint::Percentage(45), Constraint::Percentage(55)])
            .areas(panels);
        render_chart(app, f, c);
        render_breakdown(app, selected, f, b);
    }
}

fn render_table(app: &App, f: &mut Frame, area: Rect) {
    if area.height == 0 {
        return;
    }
    let cols = columns(area.width);
    let header = TRow::new(cols.iter().map(|&c| {
        let mut t = c.title().to_string();
        if c.sort() == app.sort {
            t += if app.reverse { "▼" } else { "▲" };
        }
        t
    }))
    .style(bold().add_modifier(Modifier::UNDERLINED));
    let vis = visible(app);
    let rows: Vec<TRow> = vis
        .iter()
        .map(|&i| {
            let r = &app.rows[i];
            let mut style = status_style(app, r.status);
            if app.recommendation == Some(r.index) {
                style = style.add_modifier(Modifier::BOLD);
            }
            TRow::new(cols.iter().map(|&c| cell(app, r, c))).style(style)
        })
        .collect();
    let empty = rows.is_empty();
    let widths: Vec<Constraint> = cols
        .iter()
        .map(|&c| match c {
            Col::Knobs => Constraint::Min(c.width()),
            _ => Constraint::Length(c.width()),
        })
        .collect();
    let table = Table::new(rows, widths)
        .header(header)
        .column_spacing(1)
        .row_highlight_style(Style::default().add_modifier(Modifier::REVERSED));
    let mut state = TableState::default().with_selected((!empty).then_some(app.selected));
    f.render_stateful_widget(table, area, &mut state);
    if empty && area.height > 1 {
        let msg = if app.rows.is_empty() {
            "no grid points"
        } else {
            "no trial matches the filter"
        };
        let a = Rect {
            y: area.y + 1,
            height: 1,
            ..area
        };
        f.render_widget(Paragraph::new(Span::styled(msg, dim())), a);
    }
}

/// The samples to chart, and whose they are.
fn chart_title(app: &App) -> String {
    match (app.running, app.samples_of) {
        (Some(i), _) => format!(
            "memory #{i} (running, every {} ms)",
            app.header.sample_interval_ms
        ),
        (None, Some(i)) => format!("memory #{i} (last run)"),
        _ => "memory".into(),
    }
}

fn render_chart(app: &App, f: &mut Frame, area: Rect) {
    let block = Block::bordered().title(chart_title(app));
    if app.samples.is_empty() {
        let text = if app.running.is_some() {
            "waiting for samples ..."
        } else {
            "no trial running"
        };
        f.render_widget(Paragraph::new(Span::styled(text, dim())).block(block), area);
        return;
    }
    let tracked: Vec<(f64, f64)> = app
        .samples
        .iter()
        .map(|s| (s.t_s, s.tracked as f64))
        .collect();
    let rss: Vec<(f64, f64)> = app
        .samples
        .iter()
        .filter_map(|s| s.rss.map(|r| (s.t_s, r as f64)))
        .collect();
    let t0 = app.samples.first().map_or(0.0, |s| s.t_s);
    let t1 = app.samples.last().map_or(1.0, |s| s.t_s).max(t0 + 1e-3);
    let predicted = app
        .samples_of
        .and_then(|i| app.row_of(i))
        .and_then(|i| app.rows[i].predicted_total());
    let capacity_line = [
        (t0, app.header.capacity as f64),
        (t1, app.header.capacity as f64),
    ];
    let predicted_line = predicted.map(|p| [(t0, p as f64), (t1, p as f64)]);
    let ymax = tracked
        .iter()
        .chain(&rss)
        .map(|p| p.1)
        .chain([app.header.capacity as f64, predicted.unwrap_or(0) as f64])
        .fold(1.0f64, f64::max)
        * 1.05;
    let mut sets = vec![
        Dataset::default()
            .name("capacity")
            .marker(Marker::Dot)
            .graph_type(GraphType::Line)
            .style(fg(app, Color::Red))
            .data(&capacity_line),
    ];
    if let Some(p) = &predicted_line {
        sets.push(
            Dataset::default()
                .name("predicted")
                .marker(Marker::Dot)
                .graph_type(GraphType::Line)
                .style(fg(app, Color::Blue))
                .data(p),
        );
    }
    if !rss.is_empty() {
        sets.push(
            Dataset::default()
                .name("RSS")
                .marker(Marker::Braille)
                .graph_type(GraphType::Line)
                .style(fg(app, Color::Magenta))
                .data(&rss),
        );
    }
    sets.push(
        Dataset::default()
            .name("tracked")
            .marker(Marker::Braille)
            .graph_type(GraphType::Line)
            .style(fg(app, Color::Cyan))
            .data(&tracked),
    );
    let axis_style = dim();
    let chart = Chart::new(sets)
        .block(block)
        .hidden_legend_constraints((Constraint::Percentage(50), Constraint::Percentage(60)))
        .x_axis(
            Axis::default()
                .style(axis_style)
                .bounds([t0, t1])
                .labels([format!("{t0:.0}s"), format!("{t1:.1}s")]),
        )
        .y_axis(
            Axis::default()
                .style(axis_style)
                .bounds([0.0, ymax])
                .labels(["0".to_string(), fmt_bytes(ymax as u64)]),
        );
    f.render_widget(chart, area);
}

/// Per-category peaks of a row: measured, else predicted; with the label.
fn peaks_of(r: &Row) -> Option<(crate::memory::PeakBytes, &'static str)> {
    if let Some(m) = r.record.as_ref().and_then(|r| r.measured.as_ref()) {
        return Some((m.peak_bytes, "measured"));
    }
    r.predicted_peaks().map(|p| (p, "predicted"))
}

/// One bar per category against the capacity, with its size and share.
fn breakdown_lines(app: &App, r: &Row, width: u16) -> Vec<Line<'static>> {
    let Some((peaks, _)) = peaks_of(r) else {
        return vec![Line::from(Span::styled("not run", dim()))];
    };
    let overhead = r.overhead();
    let mut items: Vec<(&str, u64)> = Category::ALL
        .iter()
        .map(|&c| (c.name(), peaks.get(c)))
        .collect();
    items.push(("overhead", overhead));
    // The total first: it survives a short panel.
    items.insert(0, ("total", peaks.total + overhead));
    // name(14) bar size(10) pct(7)
    let bar_w = width.saturating_sub(14 + 1 + 10 + 7) as usize;
    items
        .into_iter()
        .map(|(n, b)| {
            let p = pct(b as f64, app.header.capacity);
            let filled = ((p / 100.0) * bar_w as f64)
                .round()
                .clamp(0.0, bar_w as f64) as usize;
            let style = if n == "total" {
                bold()
            } else {
                Style::default()
            };
            let mut spans = vec![Span::styled(format!("{n:<14}"), style)];
            if bar_w > 0 {
                spans.push(Span::styled("█".repeat(filled), fg(app, Color::Cyan)));
                spans.push(Span::styled("░".repeat(bar_w - filled), dim()));
                spans.push(Span::raw(" "));
            }
            spans.push(Span::styled(format!("{:>10}", fmt_bytes(b)), style));
            spans.push(Span::raw(format!(" {p:>5.1}%")));
            Line::from(spans)
        })
        .collect()
}

fn render_breakdown(app: &App, r: Option<&Row>, f: &mut Frame, area: Rect) {
    let (title, lines) = match r {
        Some(r) => {
            let what = peaks_of(r).map_or("not run", |p| p.1);
            (
                format!("#{} by category ({what}) vs capacity", r.index),
                breakdown_lines(app, r, area.width.saturating_sub(2)),
            )
        }
        None => (
            "breakdown".to_string(),
            vec![Line::from("no trial selected")],
        ),
    };
    f.render_widget(
        Paragraph::new(lines).block(Block::bordered().title(title)),
        area,
    );
}

fn recommendation_lines(app: &App) -> Vec<Line<'static>> {
    let Some(i) = app.recommendation.and_then(|i| app.row_of(i)) else {
        let why = if app.finished {
            "no trial fits the usable capacity"
        } else {
            "no fitting trial yet"
        };
        return vec![Line::from(Span::styled(why, dim()))];
    };
    let r = &app.rows[i];
    let mut lines = vec![Line::from(Span::styled(
        format!("★ #{} {}", r.index, r.point.label()),
        fg(app, Color::Green).add_modifier(Modifier::BOLD),
    ))];
    lines.extend(app.reasons.iter().map(|s| Line::from(format!("• {s}"))));
    if let Some(ru) = app.runner_up {
        lines.push(Line::from(format!("runner-up: {}", row_label(app, ru))));
    }
    lines
}

fn render_recommendation(app: &App, f: &mut Frame, area: Rect) {
    f.render_widget(
        Paragraph::new(recommendation_lines(app))
            .wrap(Wrap { trim: true })
            .block(Block::bordered().title("recommendation")),
        area,
    );
}

fn kv(k: &str, v: String) -> Line<'static> {
    Line::from(vec![Span::styled(format!("{k:<12}"), bold()), Span::raw(v)])
}

fn detail_lines(app: &App, r: &Row) -> Vec<Line<'static>> {
    let p = &r.point;
    let mut v = vec![
        Line::from(Span::styled(
            format!("trial #{}  {}", r.index, p.label()),
            bold(),
        )),
        kv("id", crate::sweep::driver::trial_id(p)),
        kv(
            "config",
            format!(
                "gpus {} · sharding {} · precision {} · optimizer {} · checkpointing {} · attention {}",
                p.gpus,
                name(p.sharding),
                name(p.precision),
                name(p.optimizer),
                name(p.checkpointing),
                name(p.attention)
            ),
        ),
        kv(
            "batch",
            format!(
                "micro-batch {} · grad_accum {} · global batch {} · seq_len {}",
                p.micro_batch, p.grad_accum, app.header.global_batch, app.header.seq_len
            ),
        ),
    ];
    let changes = p.numerics_changes();
    v.push(kv(
        "numerics",
        if changes.is_empty() {
            "unchanged".into()
        } else {
            format!(
                "changes: {}{}",
                changes.join(", "),
                if app.header.allow_numerics_change {
                    ""
                } else {
                    " (not recommended: allow_numerics_change false)"
                }
            )
        },
    ));
    let mut st = Span::styled(r.status.label().to_string(), status_style(app, r.status));
    if app.recommendation == Some(r.index) {
        st.content = format!("{} ★ recommended", st.content).into();
    }
    v.push(Line::from(vec![
        Span::styled(format!("{:<12}", "status"), bold()),
        st,
    ]));
    let rec = r.record.as_ref();
    if let Some(rec) = rec {
        v.push(kv(
            "outcome",
            format!(
                "{} after {:.1} s",
                crate::sweep::markdown::outcome_label(rec),
                rec.elapsed_s
            ),
        ));
        if let Some(n) = &rec.note {
            v.push(kv("note", n.clone()));
        }
        if let Some(e) = &rec.exit {
            v.push(kv(
                "exit",
                format!(
                    "code {} · signal {}",
                    e.code.map_or("-".into(), |c| c.to_string()),
                    e.signal.map_or("-".into(), |s| s.to_string())
                ),
            ));
            if !e.stderr_tail.trim().is_empty() {
                v.push(Line::from(Span::styled("stderr tail:", bold())));
                v.extend(
                    e.stderr_tail
                        .lines()
                        .map(|l| Line::from(Span::styled(format!("  {l}"), dim()))),
                );
            }
        }
    }
    let pred = rec.and_then(|r| r.predicted.as_ref());
    v.push(kv(
        "predicted",
        match (r.predicted_total(), pred) {
            (Some(t), Some(pr)) => format!(
                "peak {} ({:.1}% of capacity) · {:.0} tok/s · step {:.3} s",
                fmt_bytes(t),
                pct(t as f64, app.header.capacity),
                pr.tokens_per_s,
                pr.step_s
            ),
            (Some(t), None) => format!(
                "peak {} ({:.1}% of capacity){}",
                fmt_bytes(t),
                pct(t as f64, app.header.capacity),
                r.predicted_tokens_per_s
                    .map_or(String::new(), |x| format!(" · {x:.0} tok/s"))
            ),
            _ => "-".into(),
        },
    ));
    let meas = rec.and_then(|r| r.measured.as_ref());
    v.push(kv(
        "measured",
        match (r.measured_total(), meas) {
            (Some(t), Some(m)) => format!(
                "peak {} ({:.1}% of capacity){} · {:.0} tok/s · step {:.3} s · ${}/Mtok",
                fmt_bytes(t),
                pct(t as f64, app.header.capacity),
                m.device_peak_bytes
                    .map_or(String::new(), |d| format!(" · RSS {}", fmt_bytes(d))),
                m.tokens_per_s,
                m.step_s,
                usd(m.usd_per_mtok)
            ),
            _ => "not run".into(),
        },
    ));
    if let Some((m, predicted)) = r.margin(app.header.capacity) {
        v.push(kv(
            "margin",
            format!(
                "{} ({:.1}% of capacity){}; usable {}",
                fmt_signed(m),
                pct(m as f64, app.header.capacity),
                if predicted { ", predicted" } else { "" },
                fmt_bytes(app.header.usable)
            ),
        ));
    }
    if let Some(rec) = rec {
        let e = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:+.1}%"));
        v.push(kv(
            "error",
            format!(
                "memory {} · time {} ((measured - predicted) / measured)",
                e(rec.memory_error_pct),
                e(rec.time_error_pct)
            ),
        ));
    }
    let phases = rec
        .and_then(|r| r.measured.as_ref())
        .map(|m| m.phase_peaks.as_slice())
        .unwrap_or_default();
    if phases.is_empty() {
        v.push(kv(
            "timeline",
            "no per-phase peaks (not run); `memfit run --timeline FILE` writes the full timeline CSV".into(),
        ));
    } else {
        v.push(Line::from(Span::styled(
            "memory by phase (highest live bytes, rank 0)",
            bold(),
        )));
        let top = phases
            .iter()
            .map(|p| p.peak_bytes)
            .max()
            .unwrap_or(1)
            .max(1);
        for ph in phases {
            let bar = (ph.peak_bytes as f64 / top as f64 * 20.0).round() as usize;
            v.push(Line::from(format!(
                "  {:<16} {:>11} {:>5.1}% {}",
                ph.phase,
                fmt_bytes(ph.peak_bytes),
                pct(ph.peak_bytes as f64, app.header.capacity),
                "█".repeat(bar)
            )));
        }
    }
    v
}

fn step_lines(r: &Row) -> Vec<Line<'static>> {
    let Some(m) = r.record.as_ref().and_then(|r| r.measured.as_ref()) else {
        return vec![Line::from(Span::styled("no steps measured", dim()))];
    };
    let mut v = vec![Line::from(Span::styled(
        format!("{:>5} {:>10} {:>10}", "step", "time ms", "loss"),
        bold(),
    ))];
    let n = m.step_ms.len().max(m.losses.len());
    for i in 0..n {
        v.push(Line::from(format!(
            "{:>5} {:>10} {:>10}{}",
            i + 1,
            m.step_ms.get(i).map_or("-".into(), |t| format!("{t:.1}")),
            m.losses.get(i).map_or("-".into(), |l| format!("{l:.4}")),
            if i == 0 { "  warm-up" } else { "" }
        )));
    }
    v
}

fn render_detail(app: &App, f: &mut Frame, area: Rect) {
    let Some(r) = app.selected_row() else {
        f.render_widget(
            Paragraph::new("no trial selected").block(Block::bordered().title("detail")),
            area,
        );
        return;
    };
    let title = format!("detail #{} (PgUp/PgDn scroll)", r.index);
    let scroll = (app.detail_scroll, 0);
    if area.width >= 100 {
        let [left, right] =
            Layout::horizontal([Constraint::Percentage(58), Constraint::Percentage(42)])
                .areas(area);
        f.render_widget(
            Paragraph::new(detail_lines(app, r))
                .wrap(Wrap { trim: false })
                .scroll(scroll)
                .block(Block::bordered().title(title)),
            left,
        );
        let [b, s] = Layout::vertical([Constraint::Length(11), Constraint::Min(0)]).areas(right);
        render_breakdown(app, Some(r), f, b);
        f.render_widget(
            Paragraph::new(step_lines(r)).block(Block::bordered().title("steps")),
            s,
        );
    } else {
        // One column: everything in one scrolling page.
        let mut lines = detail_lines(app, r);
        lines.push(Line::default());
        let what = peaks_of(r).map_or("not run", |p| p.1);
        lines.push(Line::from(Span::styled(
            format!("peaks by category ({what}) vs capacity"),
            bold(),
        )));
        lines.extend(breakdown_lines(app, r, area.width.saturating_sub(2)));
        lines.push(Line::default());
        lines.extend(step_lines(r));
        f.render_widget(
            Paragraph::new(lines)
                .wrap(Wrap { trim: false })
                .scroll(scroll)
                .block(Block::bordered().title(title)),
            area,
        );
    }
}

fn render_help(app: &App, f: &mut Frame, area: Rect) {
    let w = KEYMAP
        .iter()
        .map(|(k, _)| k.chars().count())
        .max()
        .unwrap_or(0)
        + 2;
    let mut lines: Vec<Line> = KEYMAP
        .iter()
        .map(|(k, what)| {
            Line::from(vec![
                Span::styled(format!("{k:<w$}"), bold()),
                Span::raw(*what),
            ])
        })
        .collect();
    lines.push(Line::default());
    lines.push(Line::from(vec![
        Span::styled("status ", bold()),
        Span::styled("fit", status_style(app, Status::Fit)),
        Span::raw(" · "),
        Span::styled("over OOM timeout crash", status_style(app, Status::Oom)),
        Span::raw(" · "),
        Span::styled("running", status_style(app, Status::Running)),
        Span::raw(" · queued · "),
        Span::styled(
            "skipped:pred skipped:mono invalid",
            status_style(app, Status::Invalid),
        ),
    ]));
    lines.push(Line::from(
        "★ recommended · margin = capacity - peak (~ predicted) · sizes in IEC units (MiB = 2^20 bytes)",
    ));
    f.render_widget(
        Paragraph::new(lines)
            .wrap(Wrap { trim: false })
            .block(Block::bordered().title("help: memfit tui")),
        area,
    );
}

#[cfg(test)]
mod tests {
    use ratatui::Terminal;
    use ratatui::backend::TestBackend;
    use ratatui::buffer::Buffer;

    use super::*;
    use crate::tui::app::testdata::*;
    use crate::tui::app::{Event, Key, update};

    fn buffer(app: &App, w: u16, h: u16) -> Buffer {
        let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
        t.draw(|f| render(app, f)).unwrap();
        t.backend().buffer().clone()
    }

    fn lines(app: &App, w: u16, h: u16) -> Vec<String> {
        let buf = buffer(app, w, h);
        (0..h)
            .map(|y| (0..w).map(|x| buf[(x, y)].symbol().to_string()).collect())
            .collect()
    }

    fn screen(app: &App, w: u16, h: u16) -> String {
        lines(app, w, h).join("\n")
    }

    fn row_y(lines: &[String], needle: &str) -> u16 {
        lines
            .iter()
            .position(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?} in\n{}", lines.join("\n")))
            as u16
    }

    #[test]
    fn grid_while_running_120x40() {
        let app = running(false);
        let l = lines(&app, 120, 40);
        let all = l.join("\n");
        assert!(
            l[0].contains("gpt2-tiny · a100-80gb · cpu:limit=64MiB"),
            "{all}"
        );
        assert!(l[0].contains("capacity 64.00 MiB · usable 60.80 MiB (5% headroom)"));
        assert!(l[1].starts_with(
            "trials 5/6 │ elapsed 1:23 │ sort #▲ │ running #3 x1 zero2 bf16 adamw8bit fused mb2"
        ));
        assert!(l[2].starts_with(
            "★ recommended #1 x1 bf16 adamw fused mb2 · $0.309/Mtok · 1800 tok/s │ runner-up #0"
        ));
        assert_eq!(
            l[3].trim_end(),
            "#▲    knobs                                  mb  status       predicted  measured   tok/s     $/Mtok   margin"
        );
        assert_eq!(
            l[5].trim_end(),
            "★1    x1 bf16 adamw fused                    2   fit          30.00 MiB  32.00 MiB  1800      0.309    32.00 MiB 50%"
        );
        assert!(l[6].contains("OOM") && l[6].contains("~-16.00 MiB -25%"));
        assert!(l[7].contains("running"));
        assert!(l[8].contains("skipped:pred"));
        assert!(l[9].contains("crash"));
        for s in [
            "memory #3 (running, every 100 ms)",
            "capacity",
            "predicted",
            "tracked",
            "#0 by category (measured) vs capacity",
            "recommendation",
            "lowest cost among 2 fitting",
            "runner-up",
        ] {
            assert!(all.contains(s), "{s} missing:\n{all}");
        }
        for cat in crate::memory::Category::ALL {
            assert!(all.contains(cat.name()), "{}", cat.name());
        }
        let total = &l[row_y(&l, "total    ") as usize];
        assert!(total.contains("21.00 MiB  32.8%"), "{total}");
        assert!(l[39].starts_with("? help · q quit"));

        // Colours: the selected row (#0) reversed, fit green, OOM red, running yellow.
        let buf = buffer(&app, 120, 40);
        let y0 = row_y(&l, " 0    x1");
        assert!(buf[(2, y0)].modifier.contains(Modifier::REVERSED));
        assert_eq!(buf[(2, y0)].fg, Color::Green);
        assert!(!buf[(2, 5)].modifier.contains(Modifier::REVERSED));
        assert!(
            buf[(2, 5)].modifier.contains(Modifier::BOLD),
            "recommended is bold"
        );
        assert_eq!(buf[(2, 6)].fg, Color::Red);
        assert_eq!(buf[(2, 7)].fg, Color::Yellow);
        assert!(buf[(2, 8)].modifier.contains(Modifier::DIM));
    }

    #[test]
    fn narrow_80x24_keeps_the_essentials() {
        let app = running(false);
        let l = lines(&app, 80, 24);
        let all = l.join("\n");
        assert!(l[0].contains("capacity 64.00 MiB"), "{all}");
        assert_eq!(
            l[3].trim_end(),
            "#▲    knobs               mb  status       measured   $/Mtok   margin"
        );
        for idx in [" 0 ", "★1 ", " 2 ", " 3 ", " 4 ", " 5 "] {
            assert!(l[4..10].iter().any(|x| x.starts_with(idx)), "{idx}\n{all}");
        }
        assert!(all.contains("OOM") && all.contains("skipped:pred"));
        assert!(all.contains("memory #3"));
        // Every breakdown line fits, with its size and share.
        let y = row_y(&l, "total    ") as usize;
        assert!(l[y].contains("21.00 MiB  32.8%"));
        assert!(l[y + 8].contains("overhead") && l[y + 8].contains("0 B   0.0%"));
        assert!(l[23].starts_with("? help"));
    }

    #[test]
    fn detail_view() {
        let mut app = running(false);
        update(&mut app, Event::Key(Key::Enter));
        let all = screen(&app, 120, 40);
        for s in [
            "detail #0",
            "gpus1-none-bf16-adamw-ckpt_none-fused-mb1-accum16",
            "sharding none",
            "optimizer",
            "grad_accum 16",
            "fit after 3.0 s",
            "peak 20.00 MiB (31.2% of capacity)",
            "peak 21.00 MiB (32.8% of capacity) · RSS 61.00 MiB",
            "memory +4.8% · time +1.5%",
            "by category (measured)",
            "150.0    10.8300  warm-up",
            "99.0    10.2000",
        ] {
            assert!(all.contains(s), "{s} missing:\n{all}");
        }
        // A crash shows its exit and stderr.
        update(&mut app, Event::Key(Key::End));
        let all = screen(&app, 120, 40);
        for s in [
            "detail #5",
            "crash",
            "code 101",
            "stderr tail",
            "panicked at boom",
            "not run",
        ] {
            assert!(all.contains(s), "{s} missing:\n{all}");
        }
        // Narrow: one page that scrolls to the steps.
        update(&mut app, Event::Key(Key::Home));
        let top = screen(&app, 80, 24);
        assert!(
            top.contains("grad_accum 16") && !top.contains("warm-up"),
            "{top}"
        );
        update(&mut app, Event::Key(Key::PageDown));
        update(&mut app, Event::Key(Key::PageDown));
        let down = screen(&app, 80, 24);
        assert!(
            down.contains("warm-up") && down.contains("workspace"),
            "{down}"
        );
    }

    #[test]
    fn help_lists_the_keymap() {
        let mut app = running(false);
        update(&mut app, Event::Key(Key::Char('?')));
        let all = screen(&app, 100, 30);
        assert!(all.contains("help: memfit tui"));
        for (k, what) in KEYMAP {
            assert!(all.contains(k) && all.contains(what), "{k} {what}:\n{all}");
        }
    }

    #[test]
    fn status_line_shows_the_filter_and_messages() {
        let mut app = running(false);
        for k in [
            Key::Char('/'),
            Key::Char('z'),
            Key::Char('e'),
            Key::Char('r'),
            Key::Char('o'),
        ] {
            update(&mut app, Event::Key(k));
        }
        let l = lines(&app, 80, 24);
        assert!(l[23].starts_with("filter: zero▏"), "{}", l[23]);
        assert!(l[1].contains("filter \"zero\""));
        assert!(
            l[4].starts_with(" 3 ") && l[5].starts_with(" 5 "),
            "{}",
            l.join("\n")
        );
        update(&mut app, Event::Key(Key::Enter));
        update(&mut app, Event::Exported(Ok("/tmp/x".into())));
        assert!(lines(&app, 80, 24)[23].starts_with("exported to /tmp/x"));
        app.filter = "nothing-matches".into();
        assert!(screen(&app, 80, 24).contains("no trial matches the filter"));
    }

    fn all_views(no_color: bool) -> Vec<App> {
        let base = running(no_color);
        let mut v = vec![base.clone(), fresh(no_color)];
        for k in [Key::Enter, Key::Char('?')] {
            let mut a = base.clone();
            update(&mut a, Event::Key(k));
            v.push(a);
        }
        let mut crash = base.clone();
        update(&mut crash, Event::Key(Key::End));
        update(&mut crash, Event::Key(Key::Enter));
        v.push(crash);
        let mut paused = base;
        update(&mut paused, Event::Key(Key::Char(' ')));
        update(&mut paused, Event::Key(Key::Char('/')));
        v.push(paused);
        v
    }

    #[test]
    fn no_color_draws_no_colours() {
        for app in all_views(true) {
            for (w, h) in [(120, 40), (80, 24)] {
                let buf = buffer(&app, w, h);
                for c in buf.content() {
                    assert_eq!(c.fg, Color::Reset, "{:?} at {w}x{h} in {:?}", c, app.view);
                    assert_eq!(c.bg, Color::Reset);
                }
                // The selection still shows, by reverse video.
                if app.view == View::Grid {
                    assert!(
                        buf.content()
                            .iter()
                            .any(|c| c.modifier.contains(Modifier::REVERSED))
                    );
                }
            }
        }
        // And with colours there are some.
        let buf = buffer(&running(false), 120, 40);
        assert!(buf.content().iter().any(|c| c.fg == Color::Green));
    }

    #[test]
    fn tiny_sizes_do_not_panic() {
        for app in all_views(false) {
            for (w, h) in [
                (1, 1),
                (2, 2),
                (10, 3),
                (20, 5),
                (30, 12),
                (40, 13),
                (60, 18),
                (99, 20),
                (200, 60),
            ] {
                let l = lines(&app, w, h);
                assert_eq!(l.len(), h as usize);
            }
        }
        let l = lines(&running(false), 20, 5);
        assert!(l[0].starts_with("gpt2-tiny"), "{l:?}");
    }

    #[test]
    fn helpers() {
        assert_eq!(fmt_elapsed(83.0), "1:23");
        assert_eq!(fmt_elapsed(3723.0), "1:02:03");
        assert_eq!(fmt_signed(-(1 << 20)), "-1.00 MiB");
        let p = point(
            4,
            crate::engine::Sharding::Zero2,
            crate::engine::Optimizer::Adamw8bit,
        );
        assert_eq!(knobs(&p), "x1 zero2 bf16 adamw8bit fused");
    }
}
