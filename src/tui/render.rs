//! Drawing `memfit tui`: a pure function of the [`App`] state.
//!
//! One main view (header, grid, live memory chart, breakdown of the selected
//! trial, recommendation, status line), a detail view and a help view. Every
//! size renders without panicking, and every line fits its width: at 80x24
//! the grid drops its lower-priority columns, the header and the key hints
//! take shorter forms, and the recommendation shrinks to a one-line panel.
//! Whatever must still be cut ends in "…".

use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::{
    Axis, Block, Chart, Dataset, GraphType, Paragraph, Row as TRow, Table, TableState, Wrap,
};

use super::app::{App, GpuView, KEYMAP, Row, SortColumn, Status, View, visible};
use crate::memory::Category;
use crate::plan::{Point, name, usd};
use crate::sweep::markdown::{cost_cell, cost_heading, ratio, tokens_cell};
use crate::units::fmt_bytes;

/// Draws the whole screen.
pub fn render(app: &App, f: &mut Frame) {
    let area = f.area();
    if area.width == 0 || area.height == 0 {
        return;
    }
    let [header, body, status] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Min(0),
        Constraint::Length(1),
    ])
    .areas(area);
    let w = area.width as usize;
    f.render_widget(
        Paragraph::new(vec![setup_line(app, w), progress_line(app, w)]),
        header,
    );
    match app.view {
        View::Grid => render_grid_view(app, f, body),
        View::Detail => render_detail(app, f, body),
        View::Help => render_help(app, f, body),
    }
    f.render_widget(Paragraph::new(status_line(app, w)), status);
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

/// A signed size: `+1.00 MiB`, `-1.00 MiB`.
fn fmt_signed(b: i64) -> String {
    if b < 0 {
        format!("-{}", fmt_bytes(b.unsigned_abs()))
    } else {
        format!("+{}", fmt_bytes(b as u64))
    }
}

/// A margin ([`Row::margin`]) as every panel shows it: signed, `~` when
/// the peak is the predicted one.
fn fmt_margin((m, predicted): (i64, bool)) -> String {
    format!("{}{}", if predicted { "~" } else { "" }, fmt_signed(m))
}

/// `s` in at most `w` columns, cut with "…" when longer.
pub(crate) fn clip(s: &str, w: usize) -> String {
    if s.chars().count() <= w {
        return s.to_string();
    }
    if w == 0 {
        return String::new();
    }
    let mut out: String = s.chars().take(w - 1).collect();
    out.push('…');
    out
}

/// Spans in at most `width` columns: those that fit, the first that does
/// not cut with "…", none after it.
pub(crate) fn clip_spans(spans: Vec<Span<'static>>, width: usize) -> Line<'static> {
    let mut left = width;
    let mut out = Vec::new();
    for s in spans {
        let n = s.content.chars().count();
        if n <= left {
            left -= n;
            out.push(s);
        } else {
            out.push(Span::styled(clip(&s.content, left), s.style));
            break;
        }
    }
    Line::from(out)
}

fn spans_width(spans: &[Span]) -> usize {
    spans.iter().map(|s| s.content.chars().count()).sum()
}

/// The first variant that fits in `width`; the last one, cut, when none does.
fn first_fitting(variants: Vec<Vec<Span<'static>>>, width: usize) -> Line<'static> {
    let n = variants.len();
    for (i, v) in variants.into_iter().enumerate() {
        if i + 1 == n || spans_width(&v) <= width {
            return clip_spans(v, width);
        }
    }
    Line::default()
}

/// A bordered block whose title is cut to the block's width.
pub(crate) fn panel(title: &str, area: Rect) -> Block<'static> {
    Block::bordered().title(clip(title, area.width.saturating_sub(2) as usize))
}

/// A foreground colour, or none under NO_COLOR.
fn fg(app: &App, c: Color) -> Style {
    if app.header.no_color {
        Style::default()
    } else {
        Style::default().fg(c)
    }
}

pub(crate) fn bold() -> Style {
    Style::default().add_modifier(Modifier::BOLD)
}

pub(crate) fn dim() -> Style {
    Style::default().add_modifier(Modifier::DIM)
}

pub(crate) fn sep() -> Span<'static> {
    Span::styled(" │ ", dim())
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

/// `#3 x1 zero2 bf16 adamw8bit fused mb2`: what a line has room for.
fn short_label(app: &App, index: usize) -> String {
    app.row_of(index).map_or(format!("#{index}"), |i| {
        let p = &app.rows[i].point;
        format!("#{index} {} mb{}", knobs(p), p.micro_batch)
    })
}

/// What measured throughput is priced at: the host's $/hour, "ranked by
/// host tokens/s" on a host without a price, or the target's $/GPU-hour.
fn price_label(app: &App) -> String {
    let p = &app.header.base.pricing;
    match (p.basis.as_str(), p.usd_per_hour) {
        ("host", Some(u)) => format!("host ${}/h", usd(u)),
        ("host", None) => "ranked by host tokens/s".into(),
        (_, u) => format!(
            "target ${}/GPU-h",
            usd(u.unwrap_or(app.header.base.target.usd_per_gpu_hour))
        ),
    }
}

/// Header line 1, the setup: where trials run and against what capacity
/// first, then the target the plan is for, then the model; shorter forms
/// at narrower widths.
fn setup_line(app: &App, width: usize) -> Line<'static> {
    let h = &app.header;
    let rd = &h.base.run_device;
    let run = || Span::styled(format!("run on {}", rd.spec), bold());
    let run_short = || {
        let emulated = if rd.emulated { " (emulated)" } else { "" };
        Span::styled(format!("run on {}{emulated}", rd.spec), bold())
    };
    let capacity = || {
        Span::raw(format!(
            " · {}capacity {}",
            if rd.emulated { "emulated " } else { "" },
            fmt_bytes(h.capacity)
        ))
    };
    let usable = || Span::raw(format!(" · usable {}", fmt_bytes(h.usable)));
    let target = || Span::raw(format!("target {}", h.hardware));
    first_fitting(
        vec![
            vec![
                run(),
                capacity(),
                usable(),
                Span::raw(format!(" ({:.0}% headroom)", h.headroom * 100.0)),
                sep(),
                target(),
                sep(),
                Span::raw(format!(
                    "{} · seq {} · batch {}",
                    h.model, h.seq_len, h.global_batch
                )),
            ],
            vec![
                run(),
                capacity(),
                usable(),
                sep(),
                target(),
                sep(),
                Span::raw(h.model.clone()),
            ],
            vec![run_short(), usable(), sep(), target()],
            vec![run_short(), sep(), target()],
        ],
        width,
    )
}

/// Header line 2, the progress: trials, elapsed (frozen at the end), the
/// pricing, pause, sort, filter, then the running trial (cut first).
fn progress_line(app: &App, width: usize) -> Line<'static> {
    let (done, total) = app.progress();
    let mut l = vec![Span::raw(format!("trials {done}/{total}"))];
    if app.finished {
        l.push(Span::styled(" finished", fg(app, Color::Green)));
    }
    l.push(sep());
    l.push(Span::raw(format!("elapsed {}", fmt_elapsed(app.elapsed_s))));
    if app.paused {
        l.push(sep());
        l.push(Span::styled(
            "PAUSED",
            fg(app, Color::Yellow).add_modifier(Modifier::BOLD),
        ));
    }
    l.push(sep());
    l.push(Span::raw(price_label(app)));
    l.push(sep());
    l.push(Span::raw(format!(
        "sort {}{}",
        app.sort.label(&app.header.base),
        if crate::tui::app::descending(app) {
            "▼"
        } else {
            "▲"
        }
    )));
    if !app.filter.is_empty() || app.editing_filter {
        l.push(sep());
        l.push(Span::raw(format!("filter \"{}\"", app.filter)));
    }
    if app.fits_only {
        l.push(sep());
        l.push(Span::raw("fits only"));
    }
    l.push(sep());
    l.push(match app.running {
        Some(i) => Span::styled(
            format!("running {}", short_label(app, i)),
            fg(app, Color::Yellow),
        ),
        None => Span::raw("idle"),
    });
    clip_spans(l, width)
}

/// As many key hints as fit, whole, in order.
fn hints(items: &[&str], width: usize) -> Line<'static> {
    let mut s = String::new();
    for (i, item) in items.iter().enumerate() {
        let more = if i == 0 {
            item.to_string()
        } else {
            format!(" · {item}")
        };
        if s.chars().count() + more.chars().count() > width {
            break;
        }
        s += &more;
    }
    Line::from(Span::styled(clip(&s, width), dim()))
}

fn status_line(app: &App, width: usize) -> Line<'static> {
    if app.editing_filter {
        return clip_spans(
            vec![
                Span::styled("filter: ", bold()),
                Span::raw(format!("{}▏", app.filter)),
                Span::styled("  (Enter/Esc to finish, Backspace deletes)", dim()),
            ],
            width,
        );
    }
    if let Some(m) = &app.message {
        return Line::from(Span::styled(clip(m, width), bold()));
    }
    match app.view {
        View::Grid => hints(
            &[
                "? help",
                "q quit",
                "↑↓ move",
                "Enter detail",
                "s/S sort",
                "/ filter",
                "f fits",
                "Space pause",
                "r re-run",
                "e export",
            ],
            width,
        ),
        View::Detail => hints(
            &[
                "Esc/Enter/q back",
                "↑↓ ←→ other trials",
                "PgUp/PgDn scroll",
                "r re-run",
                "e export",
                "? help",
            ],
            width,
        ),
        View::Help => hints(&["Esc/?/q back"], width),
    }
}

/// The grid's columns, in display order.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Col {
    Index,
    Knobs,
    Mb,
    Status,
    Predicted,
    Measured,
    Margin,
    TokS,
    Time,
    Cost,
    Target,
}

impl Col {
    const ALL: [Col; 11] = [
        Col::Index,
        Col::Knobs,
        Col::Mb,
        Col::Status,
        Col::Predicted,
        Col::Measured,
        Col::Margin,
        Col::TokS,
        Col::Time,
        Col::Cost,
        Col::Target,
    ];

    fn sort(self) -> SortColumn {
        match self {
            Col::Index => SortColumn::Index,
            Col::Knobs => SortColumn::Knobs,
            Col::Mb => SortColumn::MicroBatch,
            Col::Status => SortColumn::Status,
            Col::Predicted => SortColumn::Predicted,
            Col::Measured => SortColumn::Measured,
            Col::Margin => SortColumn::Margin,
            Col::TokS => SortColumn::TokensPerS,
            Col::Time => SortColumn::TimeRatio,
            Col::Cost => SortColumn::Cost,
            Col::Target => SortColumn::Target,
        }
    }

    /// Text reads left-aligned, numbers right-aligned.
    fn is_text(self) -> bool {
        matches!(self, Col::Knobs | Col::Status)
    }

    /// Room for a typical cell before any trial ran, so that columns do not
    /// come and go as results arrive.
    fn min_width(self) -> usize {
        match self {
            Col::Status => "running".len(),
            Col::Predicted | Col::Measured => "99.99 MiB".len(),
            Col::Margin => "+99.99 MiB".len(),
            Col::TokS => "9999 ±9%".len(),
            Col::Time => "9.99x".len(),
            Col::Cost => "99.9".len(),
            _ => 0,
        }
    }
}

/// The columns every width keeps.
const REQUIRED: [Col; 4] = [Col::Index, Col::Knobs, Col::Mb, Col::Status];

/// The other columns, the first kept longest: the measured peak and the
/// margin, then what the recommendation ranks by ($/Mtok when priced, else
/// tokens/s), then the other of the two, the time ratio, the prediction and
/// the target plan.
fn optional_columns(app: &App) -> [Col; 7] {
    let (rank, other) = if app.header.base.pricing.usd_per_hour.is_some() {
        (Col::Cost, Col::TokS)
    } else {
        (Col::TokS, Col::Cost)
    };
    [
        Col::Measured,
        Col::Margin,
        rank,
        other,
        Col::Time,
        Col::Predicted,
        Col::Target,
    ]
}

/// Knobs get at least this many columns (or their full width, if less)
/// before an optional column is added.
const KNOBS_FLOOR: usize = 24;

fn title(app: &App, c: Col) -> String {
    let mut t = c.sort().label(&app.header.base).to_string();
    if c.sort() == app.sort {
        t += if crate::tui::app::descending(app) {
            "▼"
        } else {
            "▲"
        };
    }
    t
}

/// The mark before a row's index: ★ recommended, = tied with it.
fn mark(app: &App, index: usize) -> char {
    if app.recommendation == Some(index) {
        '★'
    } else if app.tied.contains(&index) {
        '='
    } else {
        ' '
    }
}

/// A cell's whole text (before it is fitted to its column).
fn cell(app: &App, r: &Row, c: Col) -> String {
    let dash = || "-".to_string();
    let rec = r.record.as_ref();
    let measured = rec.and_then(|r| r.measured.as_ref());
    match c {
        Col::Index => format!("{}{}", mark(app, r.index), r.index),
        Col::Knobs => knobs(&r.point),
        Col::Mb => r.point.micro_batch.to_string(),
        Col::Status => r.status.label().to_string(),
        Col::Predicted => r.predicted_total().map_or_else(dash, fmt_bytes),
        Col::Measured => r.measured_total().map_or_else(dash, fmt_bytes),
        Col::Margin => r.margin(app.header.usable).map_or_else(dash, fmt_margin),
        Col::TokS => measured.map_or_else(dash, tokens_cell),
        Col::Time => ratio(r.time_ratio()),
        Col::Cost => rec.map_or_else(dash, cost_cell),
        Col::Target => r.target().map_or_else(dash, |t| {
            format!(
                "{} {}",
                fmt_bytes(t.peak_total_bytes),
                if t.fits { "✓" } else { "✗" }
            )
        }),
    }
}

/// A cell fitted to `w` columns: cut with "…", numbers right-aligned (the
/// index keeps its mark at the left).
fn fit_cell(c: Col, text: &str, w: usize) -> String {
    if c == Col::Index {
        let mut chars = text.chars();
        let mark = chars.next().unwrap_or(' ');
        let num = clip(chars.as_str(), w.saturating_sub(1));
        return clip(&format!("{mark}{num:>0$}", w.saturating_sub(1)), w);
    }
    let t = clip(text, w);
    if c.is_text() { t } else { format!("{t:>w$}") }
}

/// The columns that fit in `width`, with their widths, in display order:
/// each as wide as its widest cell (or title); the optional ones added in
/// priority order while the knobs keep [`KNOBS_FLOOR`], the knobs then
/// taking what is left (cut with "…" only when even that is short).
fn grid_columns(app: &App, cells: &[Vec<String>], width: usize) -> Vec<(Col, usize)> {
    let natural = |c: Col| {
        let i = Col::ALL.iter().position(|&x| x == c).expect("listed");
        cells
            .iter()
            .map(|r| r[i].chars().count())
            .chain([title(app, c).chars().count(), c.min_width()])
            .max()
            .unwrap_or(0)
    };
    let others = |set: &[Col]| -> usize {
        set.iter()
            .filter(|&&c| c != Col::Knobs)
            .map(|&c| natural(c))
            .sum::<usize>()
            + set.len().saturating_sub(1)
    };
    let knobs = natural(Col::Knobs);
    let floor = knobs.min(KNOBS_FLOOR);
    let mut chosen = REQUIRED.to_vec();
    for c in optional_columns(app) {
        let mut with = chosen.clone();
        with.push(c);
        if others(&with) + floor > width {
            break;
        }
        chosen = with;
    }
    let knobs_w = knobs.min(width.saturating_sub(others(&chosen)));
    Col::ALL
        .into_iter()
        .filter(|c| chosen.contains(c))
        .map(|c| {
            let w = if c == Col::Knobs { knobs_w } else { natural(c) };
            (c, w)
        })
        .collect()
}

/// A memory bar `████░░░░` of `width` cells for `share` in 0..=1.
pub(crate) fn bar(share: f64, width: usize) -> String {
    let full = ((share.clamp(0.0, 1.0) * width as f64).round() as usize).min(width);
    format!("{}{}", "█".repeat(full), "░".repeat(width - full))
}

/// The GPU panel's lines, nvitop-style: per GPU its memory (bar, IEC units,
/// percent), utilisation, power and temperature, then its processes.
fn gpu_lines(app: &App, width: usize, room: usize) -> Vec<Line<'static>> {
    let Some(view) = &app.gpu else {
        return Vec::new();
    };
    let snap = match view {
        GpuView::Missing(why) => return vec![Line::from(Span::styled(clip(why, width), dim()))],
        GpuView::Snapshot(s) => s,
    };
    if snap.gpus.is_empty() {
        return vec![Line::from(Span::styled("NVML sees no GPU", dim()))];
    }
    let mut lines = Vec::new();
    for g in &snap.gpus {
        let share = g.memory_used_bytes as f64 / g.memory_total_bytes.max(1) as f64;
        let mem = format!(
            "{}/{} {:>5.1}%",
            fmt_bytes(g.memory_used_bytes),
            fmt_bytes(g.memory_total_bytes),
            share * 100.0
        );
        let mut rest = Vec::new();
        if let Some(u) = g.utilization_pct {
            rest.push(format!("util {u:>3}%"));
        }
        match (g.power_w, g.power_limit_w) {
            (Some(p), Some(l)) => rest.push(format!("{p:.0}/{l:.0} W")),
            (Some(p), None) => rest.push(format!("{p:.0} W")),
            _ => {}
        }
        if let Some(t) = g.temperature_c {
            rest.push(format!("{t}°C"));
        }
        let head = format!("{} {}", g.index, g.name);
        let fixed =
            head.chars().count() + mem.chars().count() + rest.join("  ").chars().count() + 6;
        let bar_w = width.saturating_sub(fixed).clamp(0, 30);
        let color = if share >= 0.9 {
            Color::Red
        } else if share >= 0.7 {
            Color::Yellow
        } else {
            Color::Green
        };
        let mut spans = vec![Span::styled(head, bold()), Span::raw(" ")];
        if bar_w >= 4 {
            spans.push(Span::styled(
                format!("[{}]", bar(share, bar_w - 2)),
                fg(app, color),
            ));
            spans.push(Span::raw(" "));
        }
        spans.push(Span::raw(mem));
        if !rest.is_empty() {
            spans.push(Span::raw(format!("  {}", rest.join("  "))));
        }
        if let Some(e) = &g.error {
            spans.push(Span::styled(format!("  {e}"), fg(app, Color::Red)));
        }
        lines.push(clip_spans(spans, width));
        for p in &g.processes {
            lines.push(Line::from(Span::styled(
                clip(
                    &format!(
                        "  └ {:>7} {:<16} {}",
                        p.pid,
                        p.name.as_deref().unwrap_or("?"),
                        p.used_bytes.map_or("n/a".into(), fmt_bytes)
                    ),
                    width,
                ),
                dim(),
            )));
        }
    }
    lines.truncate(room.max(1));
    lines
}

fn render_gpu_panel(app: &App, f: &mut Frame, area: Rect) {
    let lines = gpu_lines(
        app,
        area.width.saturating_sub(2) as usize,
        area.height.saturating_sub(2) as usize,
    );
    f.render_widget(
        Paragraph::new(lines).block(panel("GPUs (NVML)", area)),
        area,
    );
}

fn render_grid_view(app: &App, f: &mut Frame, area: Rect) {
    // The GPU panel on top, as tall as its rows (at most 6), when there are
    // GPUs to show or a GPU run device without NVML.
    let area = if app.gpu.is_some() && area.height >= 20 {
        let rows = gpu_lines(app, area.width.saturating_sub(2) as usize, 6).len() as u16;
        let [gpu, rest] =
            Layout::vertical([Constraint::Length(rows + 2), Constraint::Min(0)]).areas(area);
        render_gpu_panel(app, f, gpu);
        rest
    } else {
        area
    };
    // Wide: chart, breakdown and recommendation side by side under the
    // grid. Narrow: chart and breakdown, with the recommendation as a
    // panel of its own (one line under 30 rows) between them and the grid.
    // The breakdown needs 11 lines to show every category.
    let wide = area.width >= 120;
    let h = area.height;
    let rec_h = match h {
        _ if wide => 0,
        30.. => 6,
        8.. => 3,
        _ => 0,
    };
    let panels_h = match h - rec_h {
        15.. => ((h - rec_h) * 9 / 20).clamp(11, 14),
        13.. => 9,
        _ => 0,
    };
    let [grid, rec, panels] = Layout::vertical([
        Constraint::Min(0),
        Constraint::Length(rec_h),
        Constraint::Length(panels_h),
    ])
    .areas(area);
    render_table(app, f, grid);
    if rec_h > 0 {
        render_recommendation(app, f, rec);
    }
    if panels_h == 0 {
        return;
    }
    let selected = app.selected_row();
    if wide {
        let [c, b, r] = Layout::horizontal([
            Constraint::Percentage(38),
            Constraint::Percentage(32),
            Constraint::Percentage(30),
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
    let vis = visible(app);
    let cells: Vec<Vec<String>> = vis
        .iter()
        .map(|&i| {
            Col::ALL
                .iter()
                .map(|&c| cell(app, &app.rows[i], c))
                .collect()
        })
        .collect();
    let cols = grid_columns(app, &cells, area.width as usize);
    let at = |c: Col| Col::ALL.iter().position(|&x| x == c).expect("listed");
    let header = TRow::new(cols.iter().map(|&(c, w)| {
        let t = clip(&title(app, c), w);
        if c.is_text() { t } else { format!("{t:>w$}") }
    }))
    .style(bold().add_modifier(Modifier::UNDERLINED));
    let rows: Vec<TRow> = vis
        .iter()
        .zip(&cells)
        .map(|(&i, text)| {
            let r = &app.rows[i];
            let mut style = status_style(app, r.status);
            if app.recommendation == Some(r.index) {
                style = style.add_modifier(Modifier::BOLD);
            }
            TRow::new(cols.iter().map(|&(c, w)| fit_cell(c, &text[at(c)], w))).style(style)
        })
        .collect();
    let empty = rows.is_empty();
    let widths: Vec<Constraint> = cols
        .iter()
        .map(|&(_, w)| Constraint::Length(w as u16))
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
            "device memory #{i} (running, every {} ms)",
            app.header.sample_interval_ms
        ),
        (None, Some(i)) => format!("device memory #{i} (last run)"),
        _ => "device memory".into(),
    }
}

/// A tick step for an axis up to `top` bytes in about `n` steps: 1 or 1.5
/// times a power of two, so the labels read as round IEC sizes.
pub(crate) fn tick_step(top: f64, n: u32) -> f64 {
    let raw = (top / n.max(1) as f64).max(1.0);
    let mut step = 1.0f64;
    loop {
        if step >= raw {
            return step;
        }
        if step * 1.5 >= raw {
            return step * 1.5;
        }
        step *= 2.0;
    }
}

fn render_chart(app: &App, f: &mut Frame, area: Rect) {
    let row = app
        .samples_of
        .and_then(|i| app.row_of(i))
        .map(|i| &app.rows[i]);
    // Host memory is not device memory: the trial's RSS is a note under
    // the chart, never a line against the device's capacity.
    let rss = app.samples.iter().filter_map(|s| s.rss).max();
    let mut block = panel(&chart_title(app), area);
    if let Some(b) = rss {
        let note = format!("host RSS {} (not device memory)", fmt_bytes(b));
        block = block.title_bottom(clip(&note, area.width.saturating_sub(2) as usize));
    }
    if app.samples.is_empty() {
        let text = if app.running.is_some() {
            "waiting for samples ..."
        } else {
            "no trial running"
        };
        f.render_widget(Paragraph::new(Span::styled(text, dim())).block(block), area);
        return;
    }
    // Tracked bytes plus the runtime's overhead (0 on cpu): the peak per
    // device that the capacity and the prediction are about.
    let overhead = row.map_or(0, |r| r.overhead()) as f64;
    let device: Vec<(f64, f64)> = app
        .samples
        .iter()
        .map(|s| (s.t_s, s.tracked as f64 + overhead))
        .collect();
    // On a GPU with NVML: the trial process's device memory as the driver
    // sees it (context, kernels, allocator reserve and tensors).
    let nvml: Vec<(f64, f64)> = app
        .samples
        .iter()
        .filter_map(|s| Some((s.t_s, s.nvml? as f64)))
        .collect();
    let t0 = app.samples.first().map_or(0.0, |s| s.t_s);
    let t1 = app.samples.last().map_or(1.0, |s| s.t_s).max(t0 + 1e-3);
    let predicted = row.and_then(|r| r.predicted_total());
    let flat = |y: u64| [(t0, y as f64), (t1, y as f64)];
    let capacity_line = flat(app.header.capacity);
    let usable_line = flat(app.header.usable);
    let predicted_line = predicted.map(flat);
    let top = device
        .iter()
        .chain(&nvml)
        .map(|p| p.1)
        .chain([app.header.capacity as f64, predicted.unwrap_or(0) as f64])
        .fold(1.0f64, f64::max);
    // Two rows a tick: inside the borders, less the x axis and its labels.
    let plot_rows = area.height.saturating_sub(4);
    let step = tick_step(top, (plot_rows / 2).clamp(1, 4) as u32);
    let ticks = (top / step).floor() as u64 + 1;
    let ymax = ticks as f64 * step;
    let line = |name: &'static str, marker: Marker, color: Color| {
        Dataset::default()
            .name(name)
            .marker(marker)
            .graph_type(GraphType::Line)
            .style(fg(app, color))
    };
    let mut sets = vec![
        line("capacity", Marker::Dot, Color::Red).data(&capacity_line),
        line("usable", Marker::Braille, Color::Yellow).data(&usable_line),
    ];
    if let Some(p) = &predicted_line {
        sets.push(line("predicted peak", Marker::Braille, Color::Blue).data(p));
    }
    sets.push(line("tracked", Marker::Braille, Color::Cyan).data(&device));
    if !nvml.is_empty() {
        sets.push(line("NVML", Marker::Braille, Color::Magenta).data(&nvml));
    }
    let axis_style = dim();
    let chart = Chart::new(sets)
        .block(block)
        .hidden_legend_constraints((Constraint::Percentage(50), Constraint::Percentage(60)))
        .x_axis(
            Axis::default()
                .style(axis_style)
                .bounds([t0, t1])
                .labels([format!("{t0:.1}s"), format!("{t1:.1}s")]),
        )
        .y_axis(
            Axis::default()
                .style(axis_style)
                .bounds([0.0, ymax])
                .labels((0..=ticks).map(|k| fmt_bytes((k as f64 * step) as u64))),
        );
    f.render_widget(chart, area);
}

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
    let mut lines: Vec<Line<'static>> = items
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
        .collect();
    if let Some(l) = nvml_line(r, width) {
        lines.insert(1, l);
    }
    lines
}

/// On a GPU with NVML: the trial process's NVML peak and its error against
/// the prediction, right under the tracked total (short panels keep it).
fn nvml_line(r: &Row, width: u16) -> Option<Line<'static>> {
    let rec = r.record.as_ref()?;
    let nv = rec.measured.as_ref()?.nvml_peak_bytes?;
    let err = rec
        .nvml_error_pct
        .map_or(String::new(), |e| format!(" err {e:+.1}%"));
    Some(clip_spans(
        vec![
            Span::styled(format!("{:<14}", "NVML peak"), bold()),
            Span::raw(format!("{}{err}", fmt_bytes(nv))),
        ],
        width as usize,
    ))
}

fn render_breakdown(app: &App, r: Option<&Row>, f: &mut Frame, area: Rect) {
    let (title, lines) = match r {
        Some(r) => {
            let what = peaks_of(r).map_or("not run", |p| p.1);
            (
                format!("#{} by category ({what})", r.index),
                breakdown_lines(app, r, area.width.saturating_sub(2)),
            )
        }
        None => (
            "breakdown".to_string(),
            vec![Line::from("no trial selected")],
        ),
    };
    f.render_widget(Paragraph::new(lines).block(panel(&title, area)), area);
}

/// The recommendation in a line, most important first: the label, what it
/// was ranked by ($/Mtok when priced, else tokens/s), its margin, then the
/// other of the two; `parts` of them.
fn recommendation_summary(app: &App, r: &Row, parts: usize) -> String {
    let mut items = vec![format!("★ {}", short_label(app, r.index))];
    let tokens = r
        .record
        .as_ref()
        .and_then(|r| r.measured.as_ref())
        .map(|m| format!("{} tok/s", tokens_cell(m)));
    let cost = r
        .record
        .as_ref()
        .filter(|_| r.cost().is_some())
        .map(|rec| format!("{} {}", cost_cell(rec), cost_heading(&app.header.base)));
    let margin = r
        .margin(app.header.usable)
        .map(|m| format!("margin {}", fmt_margin(m)));
    let (rank, other) = if app.header.base.pricing.usd_per_hour.is_some() {
        (cost, tokens)
    } else {
        (tokens, cost)
    };
    items.extend([rank, margin, other].into_iter().flatten());
    items.truncate(parts.max(1));
    items.join(" · ")
}

/// The summary with as many parts as fit in `width`.
fn recommendation_summary_in(app: &App, r: &Row, width: usize) -> String {
    (1..=4)
        .rev()
        .map(|n| recommendation_summary(app, r, n))
        .find(|s| s.chars().count() <= width)
        .unwrap_or_else(|| clip(&recommendation_summary(app, r, 1), width))
}

/// `= tied with #3 #7`: the configurations timing cannot separate from the
/// winner.
fn tie_note(app: &App) -> Option<String> {
    (!app.tied.is_empty()).then(|| {
        let list: Vec<String> = app.tied.iter().map(|i| format!("#{i}")).collect();
        format!(
            "= tied with {}: throughput intervals overlap",
            list.join(" ")
        )
    })
}

/// The recommendation's lines: the whole summary, to be wrapped, or with
/// `fit`, as much of it as fits in that many columns; or why there is none.
fn recommendation_lines(app: &App, fit: Option<usize>) -> Vec<Line<'static>> {
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
        match fit {
            Some(w) => recommendation_summary_in(app, r, w),
            // Wrapped between its parts, never inside one ("13.13 MiB").
            None => recommendation_summary(app, r, 4)
                .split(" · ")
                .map(|p| p.replace(' ', "\u{a0}"))
                .collect::<Vec<_>>()
                .join(" · "),
        },
        fg(app, Color::Green).add_modifier(Modifier::BOLD),
    ))];
    if let Some(t) = tie_note(app) {
        lines.push(Line::from(Span::styled(t, bold())));
    }
    lines.extend(app.reasons.iter().map(|s| Line::from(format!("• {s}"))));
    lines
}

/// The recommendation panel: the summary, the tie and the reasons, wrapped;
/// in 3 rows the summary alone, the tie in the title.
fn render_recommendation(app: &App, f: &mut Frame, area: Rect) {
    let mut title = "recommendation".to_string();
    if !app.tied.is_empty() {
        title += &format!(" (a tie of {})", app.tied.len() + 1);
    }
    let block = panel(&title, area);
    let lines = if area.height <= 3 {
        let inner = area.width.saturating_sub(2) as usize;
        let mut l = recommendation_lines(app, Some(inner));
        l.truncate(1);
        l
    } else {
        recommendation_lines(app, None)
    };
    f.render_widget(
        Paragraph::new(lines).wrap(Wrap { trim: true }).block(block),
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
    } else if app.tied.contains(&r.index) {
        st.content = format!("{} = tied with the recommendation", st.content).into();
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
        match (r.measured_total(), meas, rec) {
            (Some(t), Some(m), Some(rec)) => format!(
                "peak {} ({:.1}% of capacity) · {} tok/s · step {:.3} s (95% {:.3}-{:.3}) · {} {}",
                fmt_bytes(t),
                pct(t as f64, app.header.capacity),
                tokens_cell(m),
                m.step_s,
                m.step_s_ci[0],
                m.step_s_ci[1],
                cost_cell(rec),
                cost_heading(&app.header.base),
            ),
            _ => "not run".into(),
        },
    ));
    if let Some(m) = r.margin(app.header.usable) {
        let peak = r.measured_total().or(r.predicted_total()).unwrap_or(0);
        v.push(kv(
            "margin",
            format!(
                "{} = usable {} - {} peak {} (usable = capacity {} less {:.0}% headroom)",
                fmt_margin(m),
                fmt_bytes(app.header.usable),
                if m.1 { "predicted" } else { "measured" },
                fmt_bytes(peak),
                fmt_bytes(app.header.capacity),
                app.header.headroom * 100.0
            ),
        ));
    }
    if let Some(rec) = rec {
        let e = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:+.1}%"));
        v.push(kv(
            "error",
            format!(
                "memory {} ((measured - predicted) / measured) · time {} (measured / predicted)",
                e(rec.memory_error_pct),
                ratio(rec.time_ratio)
            ),
        ));
    }
    if let Some(t) = r.target() {
        let target = &app.header.base.target;
        let usable = (target.capacity_bytes as f64 * (1.0 - app.header.headroom)) as u64;
        v.push(kv(
            "on target",
            format!(
                "{}: planned peak {} per GPU, {} its usable {} · {:.0} tok/s · ${}/Mtok",
                app.header.hardware,
                fmt_bytes(t.peak_total_bytes),
                if t.fits { "fits" } else { "does not fit" },
                fmt_bytes(usable),
                t.tokens_per_s,
                usd(t.usd_per_mtok)
            ),
        ));
    }
    if let Some(m) = meas.filter(|m| m.rss_peak_bytes.is_some()) {
        v.push(kv(
            "host RSS",
            format!(
                "peak {}{}: host memory of the trial process, not device memory, never compared with the capacity",
                m.rss_peak_bytes.map_or("-".into(), fmt_bytes),
                m.rss_baseline_bytes
                    .map_or(String::new(), |b| format!(" ({} before the engine allocated)", fmt_bytes(b)))
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
                .block(panel(&title, left)),
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
                .block(panel(&title, area)),
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
        "★ recommended · = tied with it (throughput intervals overlap) · sizes in IEC units (MiB = 2^20 bytes)",
    ));
    lines.push(Line::from(
        "margin = usable - peak, usable = capacity x (1 - headroom); negative: over; ~ the peak is predicted",
    ));
    lines.push(Line::from(
        "tok/s: median ±half its 95% interval · time x: measured / predicted step time · on target: planned peak per GPU on the target, ✓ fits, ✗ does not",
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
            .map(|y| {
                (0..w)
                    .map(|x| buf[(x, y)].symbol().replace('\u{a0}', " "))
                    .collect()
            })
            .collect()
    }

    fn screen(app: &App, w: u16, h: u16) -> String {
        lines(app, w, h).join("\n")
    }

    fn row_y(lines: &[String], needle: &str) -> usize {
        lines
            .iter()
            .position(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?} in\n{}", lines.join("\n")))
    }

    /// The grid's columns as drawn at `width`, with where each starts.
    fn drawn_columns(app: &App, width: u16) -> Vec<(Col, usize, usize)> {
        let cells: Vec<Vec<String>> = visible(app)
            .iter()
            .map(|&i| {
                Col::ALL
                    .iter()
                    .map(|&c| cell(app, &app.rows[i], c))
                    .collect()
            })
            .collect();
        let mut x = 0;
        grid_columns(app, &cells, width as usize)
            .into_iter()
            .map(|(c, w)| {
                let at = x;
                x += w + 1;
                (c, at, w)
            })
            .collect()
    }

    /// Every grid cell on screen is its whole text or a prefix of it that
    /// ends in "…", and numbers are right-aligned in their column.
    fn assert_cells_whole_or_ellipsis(app: &App, w: u16, h: u16) -> Vec<Col> {
        let l = lines(app, w, h);
        let cols = drawn_columns(app, w);
        let header = 2;
        let vis = visible(app);
        let shown = (h as usize).min(vis.len());
        let mut cut = 0;
        for (k, &i) in vis.iter().enumerate().take(shown) {
            let y = header + 1 + k;
            if y >= l.len() || !l[y].starts_with([' ', '★', '=']) {
                break;
            }
            let chars: Vec<char> = l[y].chars().collect();
            for &(c, x, cw) in &cols {
                let seg: String = chars[x..(x + cw).min(chars.len())].iter().collect();
                let full = cell(app, &app.rows[i], c);
                let shown = seg.trim();
                let full_c = if c == Col::Index {
                    &full[full.char_indices().nth(1).map_or(0, |p| p.0)..]
                } else {
                    full.as_str()
                };
                if shown.trim_start_matches(['★', '=']).trim() != full_c {
                    cut += 1;
                    let stem = shown.strip_suffix('…').unwrap_or_else(|| {
                        panic!(
                            "{c:?} of #{} cut without …: {seg:?} of {full:?}\n{}",
                            app.rows[i].index,
                            l.join("\n")
                        )
                    });
                    assert!(full.starts_with(stem), "{seg:?} is no prefix of {full:?}");
                }
                if !c.is_text() {
                    assert!(
                        !seg.ends_with(' '),
                        "{c:?} not right-aligned: {seg:?}\n{}",
                        l.join("\n")
                    );
                }
            }
        }
        let _ = cut;
        cols.into_iter().map(|c| c.0).collect()
    }

    #[test]
    fn grid_while_running_120x40() {
        let app = running(false);
        let l = lines(&app, 120, 40);
        let all = l.join("\n");
        assert_eq!(
            l[0].trim_end(),
            "run on cpu:limit=64MiB · emulated capacity 64.00 MiB · usable 60.80 MiB │ target NVIDIA T4 16GB │ gpt2-tiny",
            "{all}"
        );
        assert_eq!(
            l[1].trim_end(),
            "trials 5/6 │ elapsed 1:23 │ host $2.000/h │ sort #▲ │ running #3 x1 zero2 bf16 adamw8bit fused mb2"
        );
        assert_eq!(
            l[2].trim_end(),
            "#▲ knobs                         mb status        predicted  measured      margin     tok/s time x $/Mtok    on target"
        );
        assert_eq!(
            l[4].trim_end(),
            "★1 x1 bf16 adamw fused            2 fit           30.00 MiB 32.00 MiB  +28.80 MiB  1800 ±3%  1.50x  0.309 798.00 MiB ✓"
        );
        assert!(
            l[5].contains("OOM") && l[5].contains("~-19.20 MiB"),
            "{all}"
        );
        assert!(l[6].contains("running"));
        assert!(l[7].contains("skipped:pred") && l[7].contains("✗"));
        assert!(l[8].contains("crash"));
        for s in [
            "device memory #3 (running, every 100 ms)",
            "capacity",
            "usable",
            "predicted peak",
            "tracked",
            "host RSS 55.00 MiB (not device memory)",
            "#0 by category (measured)",
            "recommendation",
            "★ #1 x1 bf16 adamw fused mb2 ·",
            "0.309 $/Mtok · margin +28.80 MiB ·",
            "lowest cost among 2 fitting",
            "runner-up",
        ] {
            assert!(all.contains(s), "{s} missing:\n{all}");
        }
        assert!(!all.contains(" RSS\n") && !all.contains("│RSS"), "{all}");
        for cat in crate::memory::Category::ALL {
            assert!(all.contains(cat.name()), "{}", cat.name());
        }
        let total = &l[row_y(&l, "total    ")];
        assert!(total.contains("21.00 MiB  32.8%"), "{total}");
        assert_eq!(
            l[39].trim_end(),
            "? help · q quit · ↑↓ move · Enter detail · s/S sort · / filter · f fits · Space pause · r re-run · e export"
        );

        // Colours: the selected row (#0) reversed, fit green, OOM red, running yellow.
        let buf = buffer(&app, 120, 40);
        let y0 = row_y(&l, " 0 x1") as u16;
        assert!(buf[(2, y0)].modifier.contains(Modifier::REVERSED));
        assert_eq!(buf[(2, y0)].fg, Color::Green);
        assert!(!buf[(2, 4)].modifier.contains(Modifier::REVERSED));
        assert!(
            buf[(2, 4)].modifier.contains(Modifier::BOLD),
            "recommended is bold"
        );
        assert_eq!(buf[(2, 5)].fg, Color::Red);
        assert_eq!(buf[(2, 6)].fg, Color::Yellow);
        assert!(buf[(2, 7)].modifier.contains(Modifier::DIM));
    }

    #[test]
    fn the_chart_has_iec_ticks_and_reference_lines() {
        let app = running(false);
        let l = lines(&app, 120, 40);
        let top = row_y(&l, "device memory #3");
        let chart: Vec<String> = l[top..]
            .iter()
            .map(|x| x.chars().take(48).collect())
            .collect();
        let chart = chart.join("\n");
        for tick in ["0 B", "16.00 MiB", "32.00 MiB", "48.00 MiB", "64.00 MiB"] {
            assert!(chart.contains(tick), "{tick} missing:\n{chart}");
        }
        assert!(chart.contains("0.0s") && chart.contains("3.9s"), "{chart}");
    }

    #[test]
    fn narrow_80x24_keeps_the_essentials() {
        let app = running(false);
        let l = lines(&app, 80, 24);
        let all = l.join("\n");
        assert_eq!(
            l[0].trim_end(),
            "run on cpu:limit=64MiB (emulated) · usable 60.80 MiB │ target NVIDIA T4 16GB",
            "{all}"
        );
        assert!(
            l[1].starts_with("trials 5/6 │ elapsed 1:23 │ host $2.000/h │ sort #▲ │ running #3")
        );
        assert!(l[1].trim_end().ends_with('…'), "{}", l[1]);
        assert_eq!(
            l[2].trim_end(),
            "#▲ knobs                         mb status        measured      margin $/Mtok"
        );
        for idx in [" 0 ", "★1 ", " 2 ", " 3 ", " 4 ", " 5 "] {
            assert!(l[3..10].iter().any(|x| x.starts_with(idx)), "{idx}\n{all}");
        }
        // The recommendation stays, in one line.
        let y = row_y(&l, "┌recommendation");
        assert!(
            l[y + 1]
                .starts_with("│★ #1 x1 bf16 adamw fused mb2 · 0.309 $/Mtok · margin +28.80 MiB "),
            "{all}"
        );
        assert!(all.contains("device memory #3"));
        // Every breakdown line fits, with its size and share.
        let y = row_y(&l, "total    ");
        assert!(l[y].contains("21.00 MiB  32.8%"));
        assert!(l[y + 8].contains("overhead") && l[y + 8].contains("0 B   0.0%"));
        assert_eq!(
            l[23].trim_end(),
            "? help · q quit · ↑↓ move · Enter detail · s/S sort · / filter · f fits"
        );
    }

    #[test]
    fn columns_drop_by_priority_and_cells_end_in_an_ellipsis_when_cut() {
        let mut app = tied(false);
        // A long label that must be cut at 80 columns.
        app.rows[4].point.sharding = crate::engine::Sharding::Zero3;
        app.rows[4].point.gpus = 8;
        app.rows[4].point.checkpointing = crate::engine::Checkpointing::Full;
        app.rows[4].point.optimizer = crate::engine::Optimizer::Adamw8bit;
        let mut seen = Vec::new();
        for (w, h) in [(160, 40), (120, 40), (100, 30), (80, 24), (60, 20)] {
            let cols = assert_cells_whole_or_ellipsis(&app, w, h);
            seen.push(cols);
        }
        // Wider keeps every column; narrower drops the target first, then
        // the prediction and the time ratio; never the essentials.
        assert_eq!(seen[0], Col::ALL.to_vec());
        assert!(seen[1].len() >= seen[2].len() && seen[2].len() >= seen[3].len());
        assert!(!seen[3].contains(&Col::Target) && !seen[3].contains(&Col::Predicted));
        for cols in &seen {
            for c in REQUIRED {
                assert!(cols.contains(&c), "{c:?} dropped: {cols:?}");
            }
        }
        let l = lines(&app, 80, 24);
        assert!(
            l.iter()
                .any(|x| x.contains("x8 zero3 bf16 adamw8bit ckpt fu…")),
            "{}",
            l.join("\n")
        );
        // Unpriced: ranked by tokens/s, so tokens/s outlives the cost column.
        app.header.base.pricing.usd_per_hour = None;
        for r in &mut app.rows {
            if let Some(m) = r.record.as_mut().and_then(|r| r.measured.as_mut()) {
                m.usd_per_mtok = None;
            }
        }
        let cols = assert_cells_whole_or_ellipsis(&app, 80, 24);
        assert!(
            cols.contains(&Col::TokS) && !cols.contains(&Col::Cost),
            "{cols:?}"
        );
        let all = screen(&app, 120, 40);
        assert!(
            all.contains("s/Mtok") && all.contains("ranked by host tokens/s"),
            "{all}"
        );
    }

    #[test]
    fn the_header_leads_with_the_run_device() {
        let mut app = running(false);
        for (w, h) in [(200, 50), (120, 40), (100, 30), (80, 24), (50, 20)] {
            let l = lines(&app, w, h);
            assert!(l[0].starts_with("run on cpu:limit=64MiB"), "{w}: {}", l[0]);
            assert!(l[0].contains("emulated"), "{w}: {}", l[0]);
            assert!(!l.join("\n").contains("NVIDIA T4 16GB ·"), "{w}");
        }
        let l = lines(&app, 200, 50);
        assert_eq!(
            l[0].trim_end(),
            "run on cpu:limit=64MiB · emulated capacity 64.00 MiB · usable 60.80 MiB (5% headroom) │ target NVIDIA T4 16GB │ gpt2-tiny · seq 128 · batch 16"
        );
        // A real device's capacity is not emulated; a target price says so.
        app.header.base.run_device.emulated = false;
        app.header.base.run_device.spec = "meta".into();
        app.header.base.pricing.basis = "target".into();
        app.header.base.pricing.usd_per_hour = Some(0.53);
        let l = lines(&app, 120, 40);
        assert!(
            l[0].starts_with("run on meta · capacity 64.00 MiB"),
            "{}",
            l[0]
        );
        assert!(!l[0].contains("emulated"));
        assert!(l[1].contains("target $0.530/GPU-h"), "{}", l[1]);
        // Narrow and tiny: still within the width, cut with "…".
        let l = lines(&running(false), 30, 12);
        assert!(l[0].starts_with("run on cpu:limit=64MiB (emula…"), "{l:?}");
    }

    #[test]
    fn elapsed_stops_when_the_sweep_finishes() {
        let mut app = running(false);
        update(&mut app, Event::SweepFinished);
        update(&mut app, Event::Tick { elapsed_s: 999.0 });
        assert_eq!(app.elapsed_s, 83.0);
        for (w, h) in [(120, 40), (80, 24)] {
            let l = lines(&app, w, h);
            assert!(
                l[1].starts_with("trials 5/6 finished │ elapsed 1:23 │"),
                "{}",
                l[1]
            );
        }
        // A re-run starts the clock again.
        update(&mut app, Event::TrialStarted { index: 2 });
        update(&mut app, Event::Tick { elapsed_s: 999.0 });
        assert!(lines(&app, 120, 40)[1].contains("elapsed 16:39"));
    }

    #[test]
    fn margin_means_one_thing_everywhere() {
        // #1: usable 60.80 MiB less its 32.00 MiB peak.
        let mut app = running(false);
        let all = screen(&app, 120, 40);
        let grid = &lines(&app, 120, 40)[4];
        assert!(grid.contains("+28.80 MiB"), "{grid}");
        assert!(all.contains("margin +28.80 MiB"), "{all}");
        update(&mut app, Event::Key(Key::Down));
        update(&mut app, Event::Key(Key::Enter));
        let detail = screen(&app, 120, 40);
        assert!(
            detail.contains("margin      +28.80 MiB = usable 60.80 MiB - measured peak 32.00 MiB"),
            "{detail}"
        );
    }

    #[test]
    fn ties_are_marked() {
        let mut app = tied(false);
        assert_eq!(app.recommendation, Some(1));
        assert_eq!(app.tied, vec![3]);
        for (w, h) in [(120, 40), (80, 24)] {
            let l = lines(&app, w, h);
            let all = l.join("\n");
            assert!(l.iter().any(|x| x.starts_with("=3 ")), "{all}");
            assert!(l.iter().any(|x| x.starts_with("★1 ")), "{all}");
            assert!(all.contains("recommendation (a tie of 2)"), "{all}");
        }
        let all = screen(&app, 120, 40);
        assert!(all.contains("= tied with #3:"), "{all}");
        assert!(all.contains("• a tie: 2 fitting configurations"), "{all}");
        for _ in 0..3 {
            update(&mut app, Event::Key(Key::Down));
        }
        update(&mut app, Event::Key(Key::Enter));
        let all = screen(&app, 120, 40);
        assert!(all.contains("fit = tied with the recommendation"), "{all}");
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
            "peak 21.00 MiB (32.8% of capacity) · 1000 ±3% tok/s",
            "0.556 $/Mtok",
            "memory +4.8% ((measured - predicted) / measured)",
            "1.50x (measured / predicted)",
            "NVIDIA T4 16GB: planned peak 788.00 MiB per GPU, fits",
            "host RSS    peak 61.00 MiB (12.00 MiB before the engine allocated)",
            "host memory of the trial process, not device memory",
            "by category (measured)",
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
        for _ in 0..3 {
            update(&mut app, Event::Key(Key::PageDown));
        }
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
        assert!(all.contains("margin = usable - peak"), "{all}");
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
            l[3].starts_with(" 3 ") && l[4].starts_with(" 5 "),
            "{}",
            l.join("\n")
        );
        update(&mut app, Event::Key(Key::Enter));
        update(&mut app, Event::Exported(Ok("/tmp/x".into())));
        assert!(lines(&app, 80, 24)[23].starts_with("exported to /tmp/x"));
        app.message = Some("x".repeat(100));
        assert!(lines(&app, 80, 24)[23].ends_with("x…"));
        app.message = None;
        app.filter = "nothing-matches".into();
        assert!(screen(&app, 80, 24).contains("no trial matches the filter"));
    }

    fn all_views(no_color: bool) -> Vec<App> {
        let base = running(no_color);
        let mut v = vec![base.clone(), fresh(no_color), tied(no_color)];
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
                (80, 16),
                (99, 20),
                (200, 60),
            ] {
                let l = lines(&app, w, h);
                assert_eq!(l.len(), h as usize);
            }
        }
        let l = lines(&running(false), 20, 5);
        assert!(l[0].starts_with("run on cpu:limit=64…"), "{l:?}");
    }

    #[test]
    fn helpers() {
        assert_eq!(fmt_elapsed(83.0), "1:23");
        assert_eq!(fmt_elapsed(3723.0), "1:02:03");
        assert_eq!(fmt_signed(-(1 << 20)), "-1.00 MiB");
        assert_eq!(fmt_margin((1 << 20, true)), "~+1.00 MiB");
        assert_eq!(clip("abcdef", 4), "abc…");
        assert_eq!(clip("abc", 3), "abc");
        assert_eq!(clip("abc", 0), "");
        assert_eq!(tick_step(64.0 * 1048576.0, 4), 16.0 * 1048576.0);
        assert_eq!(tick_step(24.0 * 1048576.0, 3), 8.0 * 1048576.0);
        assert_eq!(tick_step(64.0 * 1048576.0, 3), 24.0 * 1048576.0);
        let p = point(
            4,
            crate::engine::Sharding::Zero2,
            crate::engine::Optimizer::Adamw8bit,
        );
        assert_eq!(knobs(&p), "x1 zero2 bf16 adamw8bit fused");
    }
}
