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
use ratatui::text::{Line, Span};
use ratatui::widgets::{Paragraph, Row as TRow, Table, TableState};

use super::app::{App, ChartKind, GpuView, KEYMAP, Row, SortColumn, Status, View, visible};
use crate::memory::Category;
use crate::plan::{Point, name, usd};
use crate::sweep::markdown::{cost_cell, cost_heading, ratio, tokens_cell};
use crate::ui::chart::{self, Mark};
use crate::ui::gpu::{GpuRows, gpu_rows};
use crate::ui::style::{bold, dim, sep};
use crate::ui::text::{clip, clip_spans, fmt_elapsed, spans_width, wrap_line};
use crate::ui::widgets::{Hint, bar_spans, hint, hints, panel};
use crate::units::fmt_bytes;

/// Draws the whole screen.
pub fn render(app: &App, f: &mut Frame) {
    let area = f.area();
    if area.width == 0 || area.height == 0 {
        return;
    }
    let w = area.width as usize;
    let [header, body, status] = screen_areas(app, area);
    f.render_widget(
        Paragraph::new(vec![setup_line(app, w), progress_line(app, w)]),
        header,
    );
    match app.view {
        View::Grid => render_grid_view(app, f, body),
        View::Detail => render_detail(app, f, body),
        View::Help => render_page(app, f, body, "help: memfit tui", help_lines),
        View::Why => render_page(app, f, body, &why_title(app), why_lines),
    }
    f.render_widget(Paragraph::new(status_lines(app, w)), status);
}

/// The header (2 rows), the body, and the status line: one row, or up to
/// three for a message (the resume question) so that it reads whole.
fn screen_areas(app: &App, area: Rect) -> [Rect; 3] {
    let status = status_lines(app, area.width as usize).len() as u16;
    Layout::vertical([
        Constraint::Length(2),
        Constraint::Min(0),
        Constraint::Length(status),
    ])
    .areas(area)
}

/// Wraps every line, a continuation indented by `hang(line)`.
fn wrap_all(
    lines: Vec<Line<'static>>,
    width: usize,
    hang: impl Fn(&Line) -> usize,
) -> Vec<Line<'static>> {
    lines
        .iter()
        .flat_map(|l| wrap_line(l, width, hang(l)))
        .collect()
}

/// A page view's content for `width` columns.
type PageLines = fn(&App, usize) -> Vec<Line<'static>>;

/// The page the current view shows: its area on screen (from the size the
/// front end told) and its lines; none on the grid.
fn page_of(app: &App) -> Option<(Rect, Vec<Line<'static>>)> {
    let (w, h) = app.viewport;
    let [_, body, _] = screen_areas(app, Rect::new(0, 0, w, h));
    let (area, lines): (Rect, PageLines) = match app.view {
        View::Grid => return None,
        View::Help => (body, help_lines),
        View::Why => (body, why_lines),
        View::Detail => (detail_text_area(body), detail_page),
    };
    let inner = panel("", area).inner(area);
    Some((inner, lines(app, inner.width as usize)))
}

/// Lines a page view scrolls by a page: its height less one, so that a
/// line of the last page stays in sight.
pub fn page_rows(app: &App) -> u16 {
    page_of(app).map_or(1, |(a, _)| a.height.saturating_sub(1).max(1))
}

/// The furthest a page view scrolls: its last line at the bottom.
pub fn scroll_max(app: &App) -> u16 {
    page_of(app).map_or(0, |(a, lines)| {
        (lines.len() as u16).saturating_sub(a.height)
    })
}

/// A bordered page of `lines` scrolled by `scroll` (clamped to the last
/// page), saying on its bottom border which lines show and how to see more.
fn draw_page(f: &mut Frame, area: Rect, title: &str, lines: Vec<Line<'static>>, scroll: u16) {
    let block = panel(title, area);
    let inner = block.inner(area);
    let total = lines.len();
    let rows = inner.height as usize;
    let top = (scroll as usize).min(total.saturating_sub(rows));
    let block = if total > rows && rows > 0 {
        let end = (top + rows).min(total);
        let hint = if end < total {
            "↓ more: j PgDn"
        } else {
            "end: k PgUp back"
        };
        let note = format!("lines {}-{end} of {total} · {hint}", top + 1);
        block.title_bottom(
            Line::from(clip(&note, area.width.saturating_sub(2) as usize)).right_aligned(),
        )
    } else {
        block
    };
    let shown: Vec<Line<'static>> = lines.into_iter().skip(top).take(rows).collect();
    f.render_widget(Paragraph::new(shown).block(block), area);
}

fn render_page(app: &App, f: &mut Frame, area: Rect, title: &str, lines: PageLines) {
    let inner = panel("", area).inner(area);
    draw_page(f, area, title, lines(app, inner.width as usize), app.scroll);
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

fn pct(b: f64, capacity: u64) -> f64 {
    crate::units::percent_of(b, capacity)
}

/// A margin ([`Row::margin`]) as every panel shows it: signed, `~` when
/// the peak is the predicted one.
fn fmt_margin((m, predicted): (i64, bool)) -> String {
    format!(
        "{}{}",
        if predicted { "~" } else { "" },
        crate::units::fmt_signed_bytes(m)
    )
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

/// A foreground colour, or none under NO_COLOR.
fn fg(app: &App, c: Color) -> Style {
    crate::ui::style::fg(app.header.no_color, c)
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
        Status::PlannedSkip
        | Status::SkippedPredicted
        | Status::SkippedMonotonic
        | Status::Invalid => fg(app, Color::DarkGray).add_modifier(Modifier::DIM),
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
    // Only what runs takes time: the count leaves the skipped out.
    let p = app.progress();
    let mut l = vec![Span::raw(format!("trials {}/{}", p.ran, p.to_run))];
    if app.finished {
        l.push(Span::styled(" finished", fg(app, Color::Green)));
    }
    if p.skipped > 0 {
        l.push(Span::raw(format!(" · {} skipped", p.skipped)));
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

/// The grid's keys, the most needed first: the compact footer keeps as
/// many as fit in this order, and `? help` (first) always shows; help
/// lists them all.
const GRID_HINTS: &[Hint] = &[
    hint("?", "help", "?", "help"),
    hint("q", "quit", "q", "quit"),
    hint("Enter", "detail", "⏎", "detail"),
    hint("w", "why", "w", "why"),
    hint("t", "chart", "t", "chart"),
    hint("/", "filter", "/", "filter"),
    hint("s/S", "sort", "s", "sort"),
    hint("f", "fits", "f", "fits"),
    hint("Space", "pause", "␣", "pause"),
    hint("r", "re-run", "r", "rerun"),
    hint("e", "export", "e", "export"),
    hint("↑↓", "move", "↑↓", "move"),
    hint("b", "builder", "b", "builder"),
];

const DETAIL_HINTS: &[Hint] = &[
    hint("?", "help", "?", "help"),
    hint("Esc", "back", "Esc", "back"),
    hint("PgUp/PgDn", "scroll", "PgUp/Dn", "scroll"),
    hint("↑↓ ←→", "other trials", "↑↓", "trials"),
    hint("w", "why", "w", "why"),
    hint("r", "re-run", "r", "rerun"),
    hint("e", "export", "e", "export"),
];

const PAGE_HINTS: &[Hint] = &[
    hint("Esc", "back", "Esc", "back"),
    hint("↑↓ j k", "scroll", "j/k", "scroll"),
    hint("PgUp/PgDn", "page", "PgUp/Dn", "page"),
    hint("g/G", "top / end", "g/G", "top/end"),
    hint("?", "help", "?", "help"),
    hint("w", "why", "w", "why"),
];

/// The status line: the filter being edited, a message (wrapped, up to
/// three rows, so that a question reads whole), or the key hints.
fn status_lines(app: &App, width: usize) -> Vec<Line<'static>> {
    if app.editing_filter {
        return vec![clip_spans(
            vec![
                Span::styled("filter: ", bold()),
                Span::raw(format!("{}▏", app.filter)),
                Span::styled("  (Enter/Esc to finish, Backspace deletes)", dim()),
            ],
            width,
        )];
    }
    if let Some(m) = &app.message {
        let mut lines = wrap_line(&Line::from(Span::styled(m.clone(), bold())), width, 0);
        if lines.len() > 3 {
            lines.truncate(3);
            let last = lines[2].to_string();
            lines[2] = Line::from(Span::styled(clip(&format!("{last} …"), width), bold()));
        }
        return lines;
    }
    vec![match app.view {
        View::Grid => hints(GRID_HINTS, width),
        View::Detail => hints(DETAIL_HINTS, width),
        View::Help | View::Why => hints(PAGE_HINTS, width),
    }]
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
    // The whole GPU's memory: red from 90% (no --warn-at here).
    let o = GpuRows {
        warn_at: 0.9,
        job: &[],
        no_color: app.header.no_color,
    };
    let mut lines = gpu_rows(&snap.gpus, width, o);
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
    // Wide: the charts, the breakdown and the recommendation side by side
    // under the grid; both charts from 160 columns (side by side) or 20
    // rows (one over the other), else the one `t` picks. Narrow: one chart
    // and the breakdown, with the recommendation as a panel of its own
    // (one line under 30 rows) between them and the grid. The breakdown
    // needs 11 lines to show every category. Rows the grid does not need
    // go to the recommendation (so that its reasons read whole), then to
    // the charts.
    let wide = area.width >= 120;
    let side_by_side = area.width >= 160;
    let h = area.height;
    // The header and a row a trial (or for the "no trial matches" note).
    let grid_need = visible(app).len().max(1) as u16 + 1;
    let mut rec_h = match h {
        _ if wide => 0,
        30.. => 6,
        8.. => 3,
        _ => 0,
    };
    let mut panels_h = match h - rec_h {
        15.. => ((h - rec_h) * 9 / 20).clamp(11, 18),
        13.. => 9,
        _ => 0,
    };
    let mut spare = h.saturating_sub(rec_h + panels_h + grid_need);
    let [charts_w, breakdown_w, rec_w] = if side_by_side {
        [48, 24, 28]
    } else {
        [36, 32, 32]
    };
    if rec_h > 0 {
        let inner = area.width.saturating_sub(2) as usize;
        let want = rec_lines(app, inner).len() as u16 + 2;
        let more = want.saturating_sub(rec_h).min(spare);
        rec_h += more;
        spare -= more;
    }
    if panels_h > 0 {
        let rec_inner = (area.width as usize * rec_w / 100).saturating_sub(2);
        let want = if wide {
            rec_lines(app, rec_inner).len() as u16 + 2
        } else {
            0
        };
        // The recommendation's lines, then up to 20 rows for the charts.
        let grow = want.max(20).saturating_sub(panels_h).min(spare);
        panels_h += grow;
    }
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
            Constraint::Percentage(charts_w as u16),
            Constraint::Percentage(breakdown_w as u16),
            Constraint::Percentage(rec_w as u16),
        ])
        .areas(panels);
        if side_by_side || panels_h >= 20 {
            let [m, t] = if side_by_side {
                Layout::horizontal([Constraint::Percentage(55), Constraint::Fill(1)]).areas(c)
            } else {
                Layout::vertical([Constraint::Percentage(55), Constraint::Fill(1)]).areas(c)
            };
            render_memory(app, selected, f, m);
            render_throughput(app, selected, f, t);
        } else {
            render_chart(app, selected, f, c);
        }
        render_breakdown(app, selected, f, b);
        render_recommendation(app, f, r);
    } else {
        let [c, b] = Layout::horizontal([Constraint::Percentage(45), Constraint::Percentage(55)])
            .areas(panels);
        render_chart(app, selected, f, c);
        render_breakdown(app, selected, f, b);
    }
}

/// The one chart there is room for: the one `t` picked.
fn render_chart(app: &App, r: Option<&Row>, f: &mut Frame, area: Rect) {
    match app.chart {
        ChartKind::Memory => render_memory(app, r, f, area),
        ChartKind::Throughput => render_throughput(app, r, f, area),
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

/// Why a trial has no memory samples to chart.
fn no_samples(app: &App, r: &Row) -> String {
    let note = r.record.as_ref().and_then(|rec| rec.note.clone());
    let pred = r.predicted_total().map_or("-".into(), fmt_bytes);
    match r.status {
        Status::Running => "waiting for samples ...".into(),
        Status::Queued => format!("#{} is queued: its memory shows here as it runs", r.index),
        Status::PlannedSkip | Status::SkippedPredicted => format!(
            "#{} is not run: the plan predicts {pred} against {} usable",
            r.index,
            fmt_bytes(app.header.usable)
        ),
        Status::SkippedMonotonic | Status::Invalid => format!(
            "#{} is not run: {}",
            r.index,
            note.unwrap_or_else(|| r.status.label().into())
        ),
        _ => format!(
            "#{} ran before this session (resumed): no samples; peak {}",
            r.index,
            r.measured_total().map_or("-".into(), fmt_bytes)
        ),
    }
}

/// The selected trial's memory over its run: tracked bytes (plus the
/// runtime's overhead: the peak per device the capacity is about) and,
/// on a GPU, NVML's reading, against the capacity, the usable capacity
/// and the predicted peak; each line its own glyph.
fn render_memory(app: &App, row: Option<&Row>, f: &mut Frame, area: Rect) {
    let Some(r) = row else {
        let msg = Paragraph::new(Span::styled("no trial selected", dim()));
        f.render_widget(msg.block(panel("memory", area)), area);
        return;
    };
    let title = match r.status {
        Status::Running => format!(
            "#{} memory (running, every {} ms)",
            r.index, app.header.sample_interval_ms
        ),
        _ if !r.samples.is_empty() => format!("#{} memory (as it ran)", r.index),
        _ => format!("#{} memory", r.index),
    };
    let mut block = panel(&title, area);
    // Host memory is not device memory: the trial's RSS is a note under
    // the chart, never a line against the device's capacity.
    if let Some(b) = r.samples.iter().filter_map(|s| s.rss).max() {
        let note = format!("host RSS {} (not device memory)", fmt_bytes(b));
        block = block.title_bottom(clip(&note, area.width.saturating_sub(2) as usize));
    }
    let inner = block.inner(area);
    if r.samples.is_empty() {
        let lines = wrap_line(
            &Line::from(Span::styled(no_samples(app, r), dim())),
            inner.width as usize,
            0,
        );
        f.render_widget(Paragraph::new(lines).block(block), area);
        return;
    }
    f.render_widget(block, area);
    let overhead = r.overhead() as f64;
    let device: Vec<(f64, f64)> = r
        .samples
        .iter()
        .map(|s| (s.t_s, s.tracked as f64 + overhead))
        .collect();
    let t0 = r.samples.first().map_or(0.0, |s| s.t_s);
    let t1 = r.samples.last().map_or(1.0, |s| s.t_s).max(t0 + 1e-3);
    let h = &app.header;
    let predicted = r.predicted_total();
    let top = device
        .iter()
        .map(|p| p.1)
        .chain(r.samples.iter().filter_map(|s| s.nvml.map(|b| b as f64)))
        .chain([h.capacity as f64, predicted.unwrap_or(0) as f64])
        .fold(1.0f64, f64::max);
    let nc = app.header.no_color;
    let mut rules = vec![
        Mark::Capacity.rule(h.capacity as f64, nc),
        Mark::Warn.rule(h.usable as f64, nc),
    ];
    let mut legend = vec![
        Mark::Capacity.key(nc, format!("capacity {}", fmt_bytes(h.capacity)), "cap"),
        Mark::Warn.key(nc, format!("usable {}", fmt_bytes(h.usable)), "usable"),
    ];
    if let Some(p) = predicted {
        rules.push(Mark::Predicted.rule(p as f64, nc));
        legend.push(Mark::Predicted.key(nc, format!("predicted {}", fmt_bytes(p)), "pred"));
    }
    legend.push(Mark::Measured.key(nc, "tracked", "tracked"));
    // On a GPU with NVML: the trial process's device memory as the driver
    // sees it (context, kernels, allocator reserve and tensors), a dot a
    // sample so that it reads apart from the tracked curve without colour.
    let dots: Vec<chart::Dot> = r
        .samples
        .iter()
        .filter_map(|s| {
            Some(chart::Dot {
                x: s.t_s,
                y: s.nvml? as f64,
                glyph: '•',
                style: fg(app, Color::Magenta),
            })
        })
        .collect();
    if !dots.is_empty() {
        legend.push(chart::Key::new(
            "•",
            fg(app, Color::Magenta),
            "NVML",
            "NVML",
        ));
    }
    let plot = chart::Plot {
        x: [t0, t1],
        x_labels: [format!("{t0:.1}s"), format!("{t1:.1}s")],
        y: chart::YAxis::Bytes,
        top,
        rules,
        curves: vec![chart::Curve {
            points: &device,
            style: Mark::Measured.style(nc),
        }],
        dots,
        legend,
    };
    chart::draw(&plot, f.buffer_mut(), inner);
}

/// Tokens/s of every finished trial, in the order they finished: where the
/// sweep has been, the recommended (★) and the selected trial (◆) marked.
fn render_throughput(app: &App, selected: Option<&Row>, f: &mut Frame, area: Rect) {
    let block = panel("tokens/s per finished trial", area);
    let inner = block.inner(area);
    let points: Vec<(usize, f64)> = app
        .finish_order
        .iter()
        .filter_map(|&i| {
            let r = &app.rows[app.row_of(i)?];
            Some((i, r.tokens_per_s()?))
        })
        .collect();
    if points.is_empty() {
        let lines = wrap_line(
            &Line::from(Span::styled(
                "no trial has finished with a measurement yet",
                dim(),
            )),
            inner.width as usize,
            0,
        );
        f.render_widget(Paragraph::new(lines).block(block), area);
        return;
    }
    f.render_widget(block, area);
    let n = points.len();
    let sel = selected.map(|r| r.index);
    let dot = |k: usize, y: f64, glyph: char, style: Style| chart::Dot {
        x: (k + 1) as f64,
        y,
        glyph,
        style,
    };
    let mut dots: Vec<chart::Dot> = points
        .iter()
        .enumerate()
        .map(|(k, &(_, y))| dot(k, y, '•', fg(app, Color::Cyan)))
        .collect();
    let mut legend = vec![chart::Key::new(
        "•",
        fg(app, Color::Cyan),
        "a trial",
        "trial",
    )];
    // The recommended, then the selected over it.
    for (want, glyph, color, what) in [
        (app.recommendation, '★', Color::Green, "recommended"),
        (sel, '◆', Color::Yellow, "selected"),
    ] {
        let Some((k, &(i, y))) = points.iter().enumerate().find(|(_, p)| Some(p.0) == want) else {
            continue;
        };
        let style = fg(app, color).add_modifier(Modifier::BOLD);
        dots.push(dot(k, y, glyph, style));
        legend.push(chart::Key::new(
            &glyph.to_string(),
            style,
            format!("#{i} {what}"),
            &format!("#{i}"),
        ));
    }
    let top = points.iter().map(|p| p.1).fold(0.0f64, f64::max);
    let plot = chart::Plot {
        x: [1.0, n.max(2) as f64],
        x_labels: ["1st".into(), format!("{n} finished")],
        y: chart::YAxis::Count,
        top,
        rules: Vec::new(),
        curves: Vec::new(),
        dots,
        legend,
    };
    chart::draw(&plot, f.buffer_mut(), inner);
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
        let why = if r.status == Status::Running {
            "running: its peaks show when it finishes"
        } else {
            "not run"
        };
        return vec![Line::from(Span::styled(why, dim()))];
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
            let style = if n == "total" {
                bold()
            } else {
                Style::default()
            };
            let mut spans = vec![Span::styled(format!("{n:<14}"), style)];
            if bar_w > 0 {
                spans.extend(bar_spans(p / 100.0, bar_w, fg(app, Color::Cyan)));
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

/// The summary with its parts kept whole when wrapped: a non-breaking
/// space inside each ("13.13 MiB" never splits).
fn summary_unbroken(app: &App, r: &Row) -> String {
    recommendation_summary(app, r, 4)
        .split(" · ")
        .map(|p| p.replace(' ', "\u{a0}"))
        .collect::<Vec<_>>()
        .join(" · ")
}

/// The recommendation as whole items, each wrapped to `width`: the
/// summary, the tie, then each reason; or why there is none.
fn rec_items(app: &App, width: usize) -> Vec<Vec<Line<'static>>> {
    let Some(i) = app.recommendation.and_then(|i| app.row_of(i)) else {
        let why = if app.finished {
            "no trial fits the usable capacity"
        } else {
            "no fitting trial yet"
        };
        return vec![wrap_line(&Line::from(Span::styled(why, dim())), width, 0)];
    };
    let r = &app.rows[i];
    let summary = Span::styled(
        summary_unbroken(app, r),
        fg(app, Color::Green).add_modifier(Modifier::BOLD),
    );
    let mut items = vec![wrap_line(&Line::from(summary), width, 2)];
    if let Some(t) = tie_note(app) {
        items.push(wrap_line(&Line::from(Span::styled(t, bold())), width, 2));
    }
    for s in &app.reasons {
        items.push(wrap_line(&Line::from(format!("• {s}")), width, 2));
    }
    items
}

/// Every line of the recommendation, wrapped to `width`.
fn rec_lines(app: &App, width: usize) -> Vec<Line<'static>> {
    rec_items(app, width).into_iter().flatten().collect()
}

/// What a recommendation panel of `rows` lines shows: all of it when it
/// fits; else the whole items that fit and a last line saying how many
/// more `w` shows, so that nothing ends mid-sentence. One row: the
/// summary, as much of it as fits.
fn rec_panel_lines(app: &App, width: usize, rows: usize) -> Vec<Line<'static>> {
    let items = rec_items(app, width);
    let total: usize = items.iter().map(Vec::len).sum();
    if total <= rows {
        return items.into_iter().flatten().collect();
    }
    let one_line = |app: &App| -> Line<'static> {
        match app.recommendation.and_then(|i| app.row_of(i)) {
            Some(i) => Line::from(Span::styled(
                recommendation_summary_in(app, &app.rows[i], width),
                fg(app, Color::Green).add_modifier(Modifier::BOLD),
            )),
            None => items[0][0].clone(),
        }
    };
    if rows <= 1 {
        return vec![one_line(app)];
    }
    let mut out: Vec<Line<'static>> = Vec::new();
    let mut shown = 0;
    for item in &items {
        if out.len() + item.len() > rows - 1 {
            break;
        }
        out.extend(item.iter().cloned());
        shown += 1;
    }
    if shown == 0 {
        out.push(one_line(app));
        shown = 1;
    }
    let left = items.len() - shown;
    let more = [
        format!("… {left} more: w shows the whole recommendation"),
        format!("… {left} more: w shows all"),
        format!("… {left} more (w)"),
    ]
    .into_iter()
    .find(|m| m.chars().count() <= width)
    .unwrap_or_else(|| clip(&format!("… {left} more (w)"), width));
    out.push(Line::from(Span::styled(more, dim())));
    out
}

/// The recommendation panel, labelled with the trial it recommends.
fn render_recommendation(app: &App, f: &mut Frame, area: Rect) {
    let mut title = match app.recommendation {
        Some(i) => format!("recommendation ★ #{i}"),
        None => "recommendation".to_string(),
    };
    if !app.tied.is_empty() {
        title += &format!(" (a tie of {})", app.tied.len() + 1);
    }
    if !app.reasons.is_empty() {
        title += " · w: why";
    }
    let block = panel(&title, area);
    let inner = block.inner(area);
    let lines = rec_panel_lines(app, inner.width as usize, inner.height as usize);
    f.render_widget(Paragraph::new(lines).block(block), area);
}

fn why_title(app: &App) -> String {
    match app.recommendation {
        Some(i) => format!("recommendation ★ #{i}: why"),
        None => "recommendation".into(),
    }
}

/// The recommendation page (`w`): the summary, the tie, every reason, the
/// runner-up and the Pareto frontier.
fn why_lines(app: &App, width: usize) -> Vec<Line<'static>> {
    let mut lines = rec_lines(app, width);
    let head = |s: &str| Line::from(Span::styled(s.to_string(), bold()));
    if let Some(r) = app.runner_up {
        lines.push(Line::default());
        lines.extend(wrap_line(
            &Line::from(vec![
                Span::styled("runner-up ", bold()),
                Span::raw(short_label(app, r)),
            ]),
            width,
            2,
        ));
    }
    if !app.pareto.is_empty() {
        lines.push(Line::default());
        lines.extend(wrap_line(
            &head("Pareto frontier (no other trial has both a lower peak and more tokens/s):"),
            width,
            2,
        ));
        for &i in &app.pareto {
            let Some(r) = app.row_of(i).map(|k| &app.rows[k]) else {
                continue;
            };
            let text = format!(
                "{} {} · peak {} · {} tok/s",
                mark(app, i),
                short_label(app, i),
                r.measured_total().map_or("-".into(), fmt_bytes),
                r.tokens_per_s().map_or("-".into(), |t| format!("{t:.0}")),
            );
            lines.extend(wrap_line(&Line::from(text), width, 4));
        }
    }
    lines.push(Line::default());
    lines.extend(wrap_line(
        &Line::from(Span::styled(
            format!(
                "e writes the reports and the DeepSpeed / HF configs for it to {}",
                app.header.export_dir.display()
            ),
            dim(),
        )),
        width,
        2,
    ));
    lines
}

fn kv(k: &str, v: String) -> Line<'static> {
    Line::from(vec![Span::styled(format!("{k:<12}"), bold()), Span::raw(v)])
}

fn detail_lines(app: &App, r: &Row) -> Vec<Line<'static>> {
    let mut v = identity_lines(app, r);
    if let Some(rec) = r.record.as_ref() {
        v.extend(outcome_lines(rec));
    }
    v.push(kv("predicted", predicted_words(app, r)));
    v.push(kv("measured", measured_words(app, r)));
    v.extend(comparison_lines(app, r));
    v.extend(phase_lines(app, r));
    v
}

/// The trial's configuration, what it does to the numerics, and its status.
fn identity_lines(app: &App, r: &Row) -> Vec<Line<'static>> {
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
    v
}

/// How the trial ended, and its exit and stderr when it failed.
fn outcome_lines(rec: &crate::report::sweep::TrialRecord) -> Vec<Line<'static>> {
    let mut v = vec![kv(
        "outcome",
        format!(
            "{} after {:.1} s",
            crate::sweep::markdown::outcome_label(rec),
            rec.elapsed_s
        ),
    )];
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
    v
}

fn predicted_words(app: &App, r: &Row) -> String {
    let pred = r.record.as_ref().and_then(|r| r.predicted.as_ref());
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
    }
}

fn measured_words(app: &App, r: &Row) -> String {
    let rec = r.record.as_ref();
    let meas = rec.and_then(|r| r.measured.as_ref());
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
    }
}

/// The margin, the prediction's error, the plan on the target and the
/// host's RSS, each when known.
fn comparison_lines(app: &App, r: &Row) -> Vec<Line<'static>> {
    let mut v = Vec::new();
    let rec = r.record.as_ref();
    let meas = rec.and_then(|r| r.measured.as_ref());
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
        let e = |x: Option<f64>| x.map_or("-".into(), crate::units::fmt_signed_pct);
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
    v
}

/// Per-phase peaks as bars, or where to find the timeline.
fn phase_lines(app: &App, r: &Row) -> Vec<Line<'static>> {
    let mut v = Vec::new();
    let rec = r.record.as_ref();
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

/// A detail line's continuation indent: under the value of a `key value`
/// line, else two columns.
fn detail_hang(l: &Line) -> usize {
    match l.spans.as_slice() {
        [k, _, ..] if k.content.chars().count() == 12 => 12,
        _ => 2,
    }
}

/// Where the detail's text goes: the left column from 100 columns (the
/// breakdown and the steps beside it), else the whole body.
fn detail_text_area(body: Rect) -> Rect {
    if body.width >= 100 {
        let [left, _] =
            Layout::horizontal([Constraint::Percentage(58), Constraint::Percentage(42)])
                .areas(body);
        left
    } else {
        body
    }
}

/// The detail's text, wrapped to `width`; in one column (under 100
/// columns) the breakdown and the steps follow it on the same page.
fn detail_text(app: &App, one_column: bool, width: usize) -> Vec<Line<'static>> {
    let Some(r) = app.selected_row() else {
        return vec![Line::from("no trial selected")];
    };
    let mut lines = detail_lines(app, r);
    if one_column {
        lines.push(Line::default());
        let what = peaks_of(r).map_or("not run", |p| p.1);
        lines.push(Line::from(Span::styled(
            format!("peaks by category ({what}) vs capacity"),
            bold(),
        )));
        lines.extend(breakdown_lines(app, r, width as u16));
        lines.push(Line::default());
        lines.extend(step_lines(r));
    }
    wrap_all(lines, width, detail_hang)
}

/// The detail page on the screen the front end told.
fn detail_page(app: &App, width: usize) -> Vec<Line<'static>> {
    detail_text(app, app.viewport.0 < 100, width)
}

fn render_detail(app: &App, f: &mut Frame, area: Rect) {
    let Some(r) = app.selected_row() else {
        f.render_widget(
            Paragraph::new("no trial selected").block(panel("detail", area)),
            area,
        );
        return;
    };
    let title = format!("detail #{}", r.index);
    let text = detail_text_area(area);
    let inner = panel("", text).inner(text);
    let lines = detail_text(app, area.width < 100, inner.width as usize);
    draw_page(f, text, &title, lines, app.scroll);
    if area.width >= 100 {
        let right = Rect {
            x: text.x + text.width,
            width: area.width - text.width,
            ..area
        };
        let [b, s] = Layout::vertical([Constraint::Length(11), Constraint::Min(0)]).areas(right);
        render_breakdown(app, Some(r), f, b);
        f.render_widget(Paragraph::new(step_lines(r)).block(panel("steps", s)), s);
    }
}

/// The help page: the keymap (each description wrapped under itself),
/// then what the grid's marks, statuses and columns and the charts' lines
/// mean.
fn help_lines(app: &App, width: usize) -> Vec<Line<'static>> {
    let kw = KEYMAP
        .iter()
        .map(|(k, _)| k.chars().count())
        .max()
        .unwrap_or(0)
        + 2;
    // Narrow: the description under its key, indented.
    let kw = if kw * 2 > width { 2 } else { kw };
    let mut lines: Vec<Line<'static>> = Vec::new();
    for (k, what) in KEYMAP {
        let key = Span::styled(format!("{k:<kw$}"), bold());
        if key.content.chars().count() > kw {
            lines.push(Line::from(Span::styled(k.to_string(), bold())));
            lines.extend(wrap_line(
                &Line::from(format!("{}{what}", " ".repeat(kw))),
                width,
                kw,
            ));
        } else {
            lines.extend(wrap_line(
                &Line::from(vec![key, Span::raw(*what)]),
                width,
                kw,
            ));
        }
    }
    let para = |spans: Vec<Span<'static>>| wrap_line(&Line::from(spans), width, 2);
    lines.push(Line::default());
    lines.extend(para(vec![
        Span::styled("status: ", bold()),
        Span::styled("fit", status_style(app, Status::Fit)),
        Span::raw(" within the usable capacity · "),
        Span::styled("over OOM timeout crash", status_style(app, Status::Oom)),
        Span::raw(" ran and did not fit or failed · "),
        Span::styled("running", status_style(app, Status::Running)),
        Span::raw(" · queued · "),
        Span::styled("skip: pred OOM", status_style(app, Status::PlannedSkip)),
        Span::raw(
            " the plan predicts it does not fit, so the sweep does not run it · ",
        ),
        Span::styled("skip: inferred", status_style(app, Status::SkippedMonotonic)),
        Span::raw(
            " a smaller micro-batch already failed, or a larger one fits, so memory rising with the micro-batch settles it · ",
        ),
        Span::styled("invalid", status_style(app, Status::Invalid)),
        Span::raw(" a configuration the engine refuses. The trial counter counts only the trials that run."),
    ]));
    for text in [
        "★ recommended · = tied with it (throughput intervals overlap) · sizes in IEC units (MiB = 2^20 bytes).",
        "margin = usable - peak, where usable = capacity x (1 - headroom); negative: over; ~ the peak is the predicted one.",
        "tok/s: the median ± half its 95% interval · time x: measured / predicted step time · on target: the planned peak per GPU on the target, ✓ fits, ✗ does not.",
        "Memory chart: the selected trial's memory as it ran (⡠⠊ tracked, plus the runtime overhead; • NVML on a GPU) against ━ capacity, ─ usable and ┄ the predicted peak; host RSS is noted under it, never drawn against the device.",
        "Throughput chart: tokens/s of each trial that finished, in the order they finished; ★ the recommended, ◆ the selected.",
    ] {
        lines.push(Line::default());
        lines.extend(para(vec![Span::raw(text)]));
    }
    lines
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
        crate::ui::testing::rows(&buffer(app, w, h))
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
        let mut app = running(false);
        // The selection followed the sweep onto #3; back to #0.
        update(&mut app, Event::Key(Key::Home));
        let l = lines(&app, 120, 40);
        let all = l.join("\n");
        assert_eq!(
            l[0].trim_end(),
            "run on cpu:limit=64MiB · emulated capacity 64.00 MiB · usable 60.80 MiB │ target NVIDIA T4 16GB │ gpt2-tiny",
            "{all}"
        );
        assert_eq!(
            l[1].trim_end(),
            "trials 4/5 · 1 skipped │ elapsed 1:23 │ host $2.000/h │ sort #▲ │ running #3 x1 zero2 bf16 adamw8bit fused mb2"
        );
        assert_eq!(
            l[2].trim_end(),
            "#▲ knobs                         mb status          predicted  measured      margin     tok/s time x $/Mtok    on target"
        );
        assert_eq!(
            l[4].trim_end(),
            "★1 x1 bf16 adamw fused            2 fit             30.00 MiB 32.00 MiB  +28.80 MiB  1800 ±3%  1.50x  0.309 798.00 MiB ✓"
        );
        assert!(
            l[5].contains("OOM") && l[5].contains("~-19.20 MiB"),
            "{all}"
        );
        assert!(l[6].contains("running"));
        assert!(l[7].contains("skip: pred OOM") && l[7].contains("✗"));
        assert!(l[8].contains("crash"));
        for s in [
            "#0 memory (as it ran)",
            "━ cap",
            "─ usable",
            "┄ pred",
            "⡠⠊ tracked",
            "host RSS 51.00 MiB (not device memory)",
            "#0 by category (measured)",
            "recommendation ★ #1",
            "★ #1 x1 bf16 adamw fused mb2 ·",
            "0.309 $/Mtok · margin +28.80 MiB ·",
            "lowest cost among 2 fitting",
            "runner-up",
            "tokens/s per finished trial",
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
            "? help q quit ⏎ detail w why t chart / filter s sort f fits ␣ pause r rerun e export ↑↓ move b builder"
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
    /// The inside of the panel whose top border starts with `title`: its
    /// rows, between its side borders.
    fn panel_rows(lines: &[String], title: &str) -> Vec<String> {
        let needle = format!("┌{title}");
        let (y, x) = lines
            .iter()
            .enumerate()
            .find_map(|(y, l)| {
                let at = l.find(&needle)?;
                Some((y, l[..at].chars().count()))
            })
            .unwrap_or_else(|| panic!("no panel {title:?} in\n{}", lines.join("\n")));
        let top: Vec<char> = lines[y].chars().collect();
        let right = (x + 1..top.len())
            .find(|&i| top[i] == '┐')
            .expect("a top-right corner");
        lines[y + 1..]
            .iter()
            .map(|l| l.chars().collect::<Vec<char>>())
            .take_while(|c| c.get(x) == Some(&'│'))
            .map(|c| c[x + 1..right].iter().collect())
            .collect()
    }

    /// A panel's text as one string: rows trimmed and joined by spaces.
    fn panel_text(lines: &[String], title: &str) -> String {
        let rows = panel_rows(lines, title);
        let text: Vec<&str> = rows.iter().map(|r| r.trim()).collect();
        text.join(" ")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The tick rows of a chart panel: (row, label) where the axis has ┤.
    fn tick_rows(rows: &[String]) -> Vec<(usize, String)> {
        rows.iter()
            .enumerate()
            .filter_map(|(y, r)| {
                let at = r.find('┤')?;
                Some((y, r[..at].trim().to_string()))
            })
            .collect()
    }

    /// The chart's y labels were uneven (16.00, 24.00 ... MiB at uneven
    /// rows), the capacity line hid under the usable one, predicted and
    /// tracked were both blue dots and the legend sat on the data. Now:
    /// round ticks the same number of rows apart, capacity ━ and usable ─
    /// both visible even in one row, predicted ┄ apart from the tracked
    /// Braille curve, and the legend on its own row under the x axis.
    #[test]
    fn the_chart_has_round_even_ticks_and_distinct_lines() {
        let app = running(true);
        for (w, h) in [(120, 40), (80, 24), (160, 50)] {
            let l = lines(&app, w, h);
            let rows = panel_rows(&l, "#3 memory (running, every 100 ms)");
            let ticks = tick_rows(&rows);
            assert!(ticks.len() >= 2, "{w}x{h}:\n{}", rows.join("\n"));
            let (ys, labels): (Vec<usize>, Vec<String>) = ticks.into_iter().unzip();
            assert!(
                ys.windows(3).all(|g| g[1] - g[0] == g[2] - g[1]),
                "ticks {ys:?} unevenly spaced:\n{}",
                rows.join("\n")
            );
            assert_eq!(labels.last().map(String::as_str), Some("0"));
            let values: Vec<f64> = labels
                .iter()
                .map(|l| l.trim_end_matches(" MiB").parse::<f64>().unwrap())
                .collect();
            let step = values[values.len() - 2];
            for (k, v) in values.iter().rev().enumerate() {
                assert_eq!(*v, step * k as f64, "{labels:?}");
            }
            assert!(values[0] >= 64.0, "the capacity is on the axis: {labels:?}");
            let plot = rows[..rows.len() - 2].join("\n");
            assert!(plot.contains('━'), "capacity drawn:\n{plot}");
            assert!(plot.contains('─'), "usable drawn:\n{plot}");
            assert!(plot.contains('┄'), "prediction drawn:\n{plot}");
            assert!(
                plot.chars().any(|c| ('\u{2801}'..='\u{28ff}').contains(&c)),
                "tracked drawn:\n{plot}"
            );
            // Under the plot: the time axis, then the legend, outside it.
            let xs = &rows[rows.len() - 2];
            assert!(xs.contains("0.0s") && xs.contains("3.9s"), "{xs}");
            let legend = rows[rows.len() - 1].trim();
            assert!(
                legend.starts_with("━ cap") && legend.contains("─ usable"),
                "{legend}"
            );
            assert!(
                legend.contains("┄ pred") && legend.contains("⡠⠊ tracked"),
                "{legend}"
            );
        }
        // Capacity and usable one row apart at most: they share the row
        // cell by cell, so neither hides the other.
        let l = lines(&app, 80, 24);
        let rows = panel_rows(&l, "#3 memory (running, every 100 ms)");
        let shared = rows
            .iter()
            .find(|r| r.contains('━'))
            .expect("a capacity row");
        assert!(shared.contains("━─━─"), "{shared}");
    }
    #[test]
    fn narrow_80x24_keeps_the_essentials() {
        let mut app = running(false);
        update(&mut app, Event::Key(Key::Home));
        let l = lines(&app, 80, 24);
        let all = l.join("\n");
        assert_eq!(
            l[0].trim_end(),
            "run on cpu:limit=64MiB (emulated) · usable 60.80 MiB │ target NVIDIA T4 16GB",
            "{all}"
        );
        assert!(l[1].starts_with(
            "trials 4/5 · 1 skipped │ elapsed 1:23 │ host $2.000/h │ sort #▲ │ running #3"
        ));
        assert!(l[1].trim_end().ends_with('…'), "{}", l[1]);
        assert_eq!(
            l[2].trim_end(),
            "#▲ knobs                         mb status          measured      margin $/Mtok"
        );
        for idx in [" 0 ", "★1 ", " 2 ", " 3 ", " 4 ", " 5 "] {
            assert!(l[3..10].iter().any(|x| x.starts_with(idx)), "{idx}\n{all}");
        }
        // The recommendation stays, in one line, and says where the rest is.
        let y = row_y(&l, "┌recommendation ★ #1 · w: why");
        assert!(
            l[y + 1]
                .starts_with("│★ #1 x1 bf16 adamw fused mb2 · 0.309 $/Mtok · margin +28.80 MiB "),
            "{all}"
        );
        assert!(all.contains("#0 memory (as it ran)"), "{all}");
        // Every breakdown line fits, with its size and share.
        let y = row_y(&l, "total    ");
        assert!(l[y].contains("21.00 MiB  32.8%"));
        assert!(l[y + 8].contains("overhead") && l[y + 8].contains("0 B   0.0%"));
        assert_eq!(
            l[23].trim_end(),
            "? help q quit ⏎ detail w why t chart / filter s sort f fits ␣ pause r rerun"
        );
    }

    /// The footer dropped keys silently at 80 columns. It spells every key
    /// out where that fits, else goes compact and keeps as many as fit in
    /// order of need, `? help` first, and never runs past the width.
    #[test]
    fn the_footer_fits_and_always_offers_help() {
        let app = running(false);
        for w in [200u16, 140, 120, 100, 80, 60, 40, 20, 8] {
            let l = lines(&app, w, 24);
            let foot = l[23].trim_end();
            assert!(foot.starts_with("? help"), "{w}: {foot}");
            assert!(foot.chars().count() <= w as usize);
            let words = |f: &str| f.split_whitespace().count();
            if w >= 140 {
                assert!(foot.contains(" · e export · ↑↓ move"), "{w}: {foot}");
            } else if w >= 40 {
                assert!(words(foot) >= 6, "{w}: {foot}");
            }
        }
        let shown = lines(&app, 80, 24)[23].clone();
        for k in [
            "q quit",
            "⏎ detail",
            "w why",
            "t chart",
            "/ filter",
            "␣ pause",
        ] {
            assert!(shown.contains(k), "{k}: {shown}");
        }
        // The detail and the pages have theirs.
        let mut d = app.clone();
        update(&mut d, Event::Key(Key::Enter));
        assert!(lines(&d, 80, 24)[23].starts_with("? help"), "detail");
        update(&mut d, Event::Key(Key::Char('w')));
        let foot = lines(&d, 80, 24)[23].clone();
        assert!(
            foot.contains("Esc back") && foot.contains("scroll"),
            "{foot}"
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
                .any(|x| x.contains("x8 zero3 bf16 adamw8bit ckpt …")),
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
                l[1].starts_with("trials 4/5 finished · 1 skipped │ elapsed 1:23 │"),
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
        update(&mut app, Event::Key(Key::Home));
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
        update(&mut app, Event::Key(Key::Home));
        assert_eq!(app.recommendation, Some(1));
        assert_eq!(app.tied, vec![3]);
        for (w, h) in [(120, 40), (80, 24)] {
            let l = lines(&app, w, h);
            let all = l.join("\n");
            assert!(l.iter().any(|x| x.starts_with("=3 ")), "{all}");
            assert!(l.iter().any(|x| x.starts_with("★1 ")), "{all}");
            assert!(all.contains("recommendation ★ #1 (a tie of 2)"), "{all}");
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
        update(&mut app, Event::Key(Key::Home));
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

    /// Every line of a page view, read by scrolling it to the end at
    /// `w`x`h`: the lines inside its border, one page after another.
    fn whole_page(app: &App, w: u16, h: u16) -> Vec<String> {
        let mut app = app.clone();
        update(
            &mut app,
            Event::Resize {
                width: w,
                height: h,
            },
        );
        app.scroll = 0;
        let mut seen: Vec<String> = Vec::new();
        loop {
            let l = lines(&app, w, h);
            let body: Vec<String> = l[3..l.len() - 2]
                .iter()
                .map(|r| {
                    let c: Vec<char> = r.chars().collect();
                    c[1..c.len() - 1].iter().collect::<String>()
                })
                .collect();
            // Lines already seen overlap the next page by one.
            let skip = if seen.is_empty() { 0 } else { 1 };
            let at = app.scroll as usize;
            let end = at + body.len();
            if seen.len() < end {
                seen.extend(body.into_iter().skip(seen.len() + skip - at - skip));
            }
            let before = app.scroll;
            update(&mut app, Event::Key(Key::PageDown));
            if app.scroll == before {
                return seen;
            }
        }
    }

    fn joined(rows: &[String]) -> String {
        rows.iter()
            .map(|r| r.trim())
            .collect::<Vec<_>>()
            .join(" ")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// At 80x24 the help was cut (the legend lost, no scrolling). It
    /// scrolls, says on its border that there is more, and every key and
    /// every legend sentence reads whole somewhere on the way down.
    #[test]
    fn help_scrolls_and_reads_whole_at_80x24() {
        let mut app = running(false);
        update(&mut app, Event::Key(Key::Char('?')));
        update(
            &mut app,
            Event::Resize {
                width: 80,
                height: 24,
            },
        );
        let first = lines(&app, 80, 24);
        let bottom = &first[22];
        assert!(
            bottom.contains("lines 1-19 of") && bottom.contains("↓ more: j PgDn"),
            "{bottom}"
        );
        let rows = whole_page(&app, 80, 24);
        let text = joined(&rows);
        for (k, what) in KEYMAP {
            let entry = format!("{} {}", joined(&[k.to_string()]), what);
            assert!(text.contains(&entry), "{entry:?} not whole in:\n{text}");
        }
        for s in [
            "margin = usable - peak, where usable = capacity x (1 - headroom); negative: over; ~ the peak is the predicted one.",
            "skip: pred OOM the plan predicts it does not fit, so the sweep does not run it",
            "The trial counter counts only the trials that run.",
            "against ━ capacity, ─ usable and ┄ the predicted peak;",
        ] {
            assert!(text.contains(s), "{s:?} not whole in:\n{text}");
        }
        // At the end the border says so.
        update(&mut app, Event::Key(Key::End));
        let l = lines(&app, 80, 24);
        assert!(l[22].contains("end: k PgUp back"), "{}", l[22]);
        assert!(
            l[21].contains("Throughput chart") || joined(&l[3..22]).contains("◆ the selected.")
        );
        // Wide enough, there is nothing to scroll and no note.
        let big = lines(&app, 200, 60);
        assert!(!big.join("\n").contains("lines 1-"), "{}", big.join("\n"));
    }

    /// The resume question was cut mid-sentence at 80 columns; a message
    /// wraps over up to three rows instead.
    #[test]
    fn a_long_message_wraps_whole() {
        let mut app = running(false);
        let q = "Resume? /tmp/memfit-out/trials.jsonl holds 8 finished trials from an earlier run: y resumes them (they are not run again), n moves them aside and starts over, q quits.";
        app.message = Some(q.into());
        let l = lines(&app, 80, 24);
        let foot = &l[21..24];
        assert_eq!(joined(foot), q, "{}", l.join("\n"));
        assert!(l[20].starts_with('└'), "the panels end above it");
        // Too long for three rows: the third ends in "…".
        app.message = Some("word ".repeat(100));
        let l = lines(&app, 40, 24);
        assert!(l[23].trim_end().ends_with('…'), "{}", l[23]);
        assert!(l[20].starts_with('└') || l[20].contains('─'));
    }

    /// The recommendation lost its reasons at 80x24 and ended mid-sentence
    /// at 140x45. A panel shows whole items only (the summary, the tie,
    /// each reason) and then how many more `w` shows; `w` shows them all.
    #[test]
    fn the_recommendation_never_ends_mid_sentence() {
        let mut app = tied(false);
        let summary =
            "★ #1 x1 bf16 adamw fused mb2 · 0.309 $/Mtok · margin +28.80 MiB · 1800 ±3% tok/s";
        for (w, h) in [(140u16, 45u16), (120, 40), (100, 40), (80, 34), (200, 60)] {
            let l = lines(&app, w, h);
            let title = "recommendation ★ #1 (a tie of 2)";
            let text = panel_text(&l, title);
            let rows = panel_rows(&l, title);
            let shown = app
                .reasons
                .iter()
                .filter(|r| text.contains(&format!("• {r}")))
                .count();
            assert!(shown >= 1, "{w}x{h}: no reason whole:\n{}", rows.join("\n"));
            assert!(text.contains(summary), "{w}x{h}: {text}");
            if shown < app.reasons.len() {
                let last = rows.iter().rev().find(|r| !r.trim().is_empty()).unwrap();
                assert!(last.trim().starts_with("… "), "{w}x{h}: {last}");
                assert!(last.contains("more"), "{w}x{h}: {last}");
            }
            // No reason starts without its end.
            for r in &app.reasons {
                let head: String = r.chars().take(20).collect();
                if text.contains(&format!("• {head}")) {
                    assert!(
                        text.contains(&format!("• {r}")),
                        "{w}x{h}: {r} cut:\n{text}"
                    );
                }
            }
        }
        // At 80x24: one line, and `w` has every reason, whole.
        let l = lines(&app, 80, 24);
        assert!(l.join("\n").contains("w: why"));
        update(&mut app, Event::Key(Key::Char('w')));
        let text = joined(&whole_page(&app, 80, 24));
        assert!(text.contains(summary), "{text}");
        assert!(
            text.contains("= tied with #3: throughput intervals overlap"),
            "{text}"
        );
        for r in &app.reasons {
            assert!(
                text.contains(&format!("• {r}")),
                "{r:?} not whole in:\n{text}"
            );
        }
        assert!(text.contains("Pareto frontier"), "{text}");
        assert!(text.contains("e writes the reports"), "{text}");
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
        app.message = Some("x".repeat(300));
        assert!(lines(&app, 80, 24)[23].ends_with("…"));
        app.message = None;
        app.filter = "nothing-matches".into();
        let all = screen(&app, 80, 24);
        assert!(all.contains("no trial matches the filter"), "{all}");
    }

    fn all_views(no_color: bool) -> Vec<App> {
        let base = running(no_color);
        let mut v = vec![base.clone(), fresh(no_color), tied(no_color)];
        for k in [Key::Enter, Key::Char('?'), Key::Char('w'), Key::Char('t')] {
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
        assert_eq!(crate::units::fmt_signed_bytes(-(1 << 20)), "-1.00 MiB");
        assert_eq!(fmt_margin((1 << 20, true)), "~+1.00 MiB");
        let p = point(
            4,
            crate::engine::Sharding::Zero2,
            crate::engine::Optimizer::Adamw8bit,
        );
        assert_eq!(knobs(&p), "x1 zero2 bf16 adamw8bit fused");
    }
}
