//! A small line chart drawn straight into a ratatui buffer: the live memory
//! and throughput panels of `memfit tui`, and `memfit watch`'s memory; the
//! memory charts draw their lines alike ([`Mark`]).
//!
//! ratatui's `Chart` spreads its y labels over the rows whatever their
//! values, draws each dataset over the last (so a reference line one row
//! from another vanishes under it), and lays its legend over the data.
//! Here instead:
//!
//! - y ticks are round (1, 2, 4 or 5 times a power of ten in the axis's
//!   unit: 0, 2, 4, 6 GiB) and the same number of rows apart, which the
//!   chart gets by leaving at most a few rows empty above the top tick;
//! - reference lines ([`Rule`]) are box-drawing rules, each with its own
//!   glyph (━ ─ ┄); rules that fall in one row share it cell by cell, so
//!   none hides another;
//! - points ([`Dot`]) are a glyph each over the rules, series ([`Curve`])
//!   Braille curves over both;
//! - the legend is a line under the plot, never on it.
//!
//! Glyphs tell the lines apart and colour only helps, so NO_COLOR loses
//! nothing.

use ratatui::buffer::Buffer;
use ratatui::layout::Rect;
use ratatui::style::{Color, Style};
use ratatui::text::Span;

use super::style::{dim, fg};
use super::text::{clip, clip_spans};

/// What the y axis counts, for its tick labels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum YAxis {
    /// IEC sizes: the ticks count in the largest unit under the top.
    Bytes,
    /// Plain numbers (tokens/s), with k and M.
    Count,
}

/// A horizontal reference line at `value`.
#[derive(Clone, Debug)]
pub struct Rule {
    pub value: f64,
    pub glyph: char,
    pub style: Style,
}

/// A series drawn as a Braille curve through its points, in order.
#[derive(Clone, Debug)]
pub struct Curve<'a> {
    pub points: &'a [(f64, f64)],
    pub style: Style,
}

/// One point drawn as a glyph in its cell.
#[derive(Clone, Debug)]
pub struct Dot {
    pub x: f64,
    pub y: f64,
    pub glyph: char,
    pub style: Style,
}

/// A legend entry: the glyph as drawn, the long and the short label.
#[derive(Clone, Debug)]
pub struct Key {
    pub sample: String,
    pub style: Style,
    pub label: String,
    pub short: String,
}

impl Key {
    pub fn new(sample: &str, style: Style, label: impl Into<String>, short: &str) -> Key {
        Key {
            sample: sample.into(),
            style,
            label: label.into(),
            short: short.into(),
        }
    }
}

/// The lines of a memory chart, drawn alike on every screen, each its own
/// glyph: the memory measured as a curve ⡠⠊ in cyan, the capacity ━ in
/// red, the level under it that warns (`memfit tui`'s usable memory,
/// `memfit watch`'s `--warn-at`) ─ in yellow, memfit's prediction ┄ in
/// blue.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mark {
    Measured,
    Capacity,
    Warn,
    Predicted,
}

impl Mark {
    /// Its glyph in the legend.
    pub fn sample(self) -> &'static str {
        match self {
            Mark::Measured => "⡠⠊",
            Mark::Capacity => "━",
            Mark::Warn => "─",
            Mark::Predicted => "┄",
        }
    }

    pub fn style(self, no_color: bool) -> Style {
        fg(
            no_color,
            match self {
                Mark::Measured => Color::Cyan,
                Mark::Capacity => Color::Red,
                Mark::Warn => Color::Yellow,
                Mark::Predicted => Color::Blue,
            },
        )
    }

    /// Its legend entry.
    pub fn key(self, no_color: bool, label: impl Into<String>, short: &str) -> Key {
        Key::new(self.sample(), self.style(no_color), label, short)
    }

    /// A reference line at `value` (not for [`Mark::Measured`], a curve).
    pub fn rule(self, value: f64, no_color: bool) -> Rule {
        Rule {
            value,
            glyph: self.sample().chars().next().unwrap_or('─'),
            style: self.style(no_color),
        }
    }
}

/// Everything one chart draws.
#[derive(Clone, Debug)]
pub struct Plot<'a> {
    pub x: [f64; 2],
    /// Under the plot's left and right ends.
    pub x_labels: [String; 2],
    pub y: YAxis,
    /// The highest value to show (the axis reaches the first tick at or
    /// above it).
    pub top: f64,
    pub rules: Vec<Rule>,
    pub curves: Vec<Curve<'a>>,
    /// Drawn over the rules and under the curves, later ones over earlier
    /// ones.
    pub dots: Vec<Dot>,
    pub legend: Vec<Key>,
}

/// The y axis's ticks: `n` intervals of `step`, `gap` rows apart, labelled
/// in `unit` (its size and name).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ticks {
    pub step: f64,
    pub n: usize,
    pub gap: usize,
    pub unit: (f64, &'static str),
}

impl Ticks {
    /// The axis's top: the last tick.
    pub fn max(&self) -> f64 {
        self.step * self.n as f64
    }

    /// Rows from the plot's bottom row to its top tick's.
    pub fn span(&self) -> usize {
        self.n * self.gap
    }
}

/// The unit a y axis up to `top` counts its ticks in (bytes: the largest
/// IEC unit under the top; counts: 1).
fn unit(y: YAxis, top: f64) -> (f64, &'static str) {
    match y {
        YAxis::Bytes => {
            let (name, size) = crate::units::iec_unit(top.max(0.0) as u64);
            (size as f64, name)
        }
        YAxis::Count => (1.0, ""),
    }
}

/// Round steps in an axis's unit, ascending, from `lo` up: 1, 2, 4 or 5
/// times a power of ten; for bytes also the powers of two (16, 32, 64
/// MiB), for counts also 2.5 times a power of ten (25k, 50k).
fn steps(y: YAxis, lo: f64) -> impl Iterator<Item = f64> {
    let start = lo.max(1e-9).log10().floor() as i32 - 1;
    (start..).flat_map(move |e| {
        let d = 10f64.powi(e);
        let mut v: Vec<f64> = [1.0, 2.0, 4.0, 5.0].iter().map(|m| m * d).collect();
        match y {
            YAxis::Count => v.push(2.5 * d),
            YAxis::Bytes => {
                // The powers of two in [d, 10d).
                let mut p = 2f64.powi(d.log2().ceil() as i32);
                while p < 10.0 * d {
                    v.push(p);
                    p *= 2.0;
                }
            }
        }
        v.sort_by(f64::total_cmp);
        v.dedup();
        v.into_iter().filter(move |&s| s >= lo)
    })
}

/// Round ticks for an axis up to `top` over `rows` rows: a round step (see
/// [`steps`], in the axis's unit) that needs at most 5 intervals of at
/// least 2 rows each, so that labels neither crowd nor land unevenly, and
/// wastes the least of the plot above the top. Fewer than 5 rows get one
/// interval.
pub fn ticks(y: YAxis, top: f64, rows: usize) -> Ticks {
    let top = if top.is_finite() && top > 0.0 {
        top
    } else {
        1.0
    };
    let unit = unit(y, top);
    let u = unit.0;
    let max_n = if rows >= 5 {
        ((rows - 1) / 2).min(5)
    } else {
        1
    };
    // Bytes: whole units (the unit is at most the top), so labels need
    // no decimals.
    let lo = match y {
        YAxis::Bytes => 1.0,
        YAxis::Count => top / u / 100.0,
    };
    // Of the steps that fit, the one whose last tick is nearest the top
    // (the least empty plot), the finer of two equal ones.
    let t = top / u;
    let mut best: Option<(f64, f64)> = None;
    for s in steps(y, lo) {
        let n = (t / s).ceil();
        if n as usize <= max_n && best.is_none_or(|(reach, _)| n * s < reach - 1e-9) {
            best = Some((n * s, s));
        }
        if s >= t {
            break;
        }
    }
    let step = best.map_or(t, |b| b.1) * u;
    let n = ((top / step).ceil() as usize).max(1);
    let gap = rows.saturating_sub(1) / n;
    Ticks { step, n, gap, unit }
}

/// A number without trailing zeros: 4, 1.5, 0.25.
fn trim(v: f64) -> String {
    let s = format!("{v:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

/// The label of tick value `v` on an axis whose ticks are `t`.
pub fn tick_label(y: YAxis, t: &Ticks, v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    match y {
        YAxis::Bytes => format!("{} {}", trim(v / t.unit.0), t.unit.1),
        YAxis::Count if t.max() >= 1e6 => format!("{}M", trim(v / 1e6)),
        YAxis::Count if t.max() >= 1e3 => format!("{}k", trim(v / 1e3)),
        YAxis::Count => trim(v),
    }
}

/// Braille dot bits by (column, row from the top) within a cell.
const BRAILLE: [[u8; 4]; 2] = [[0x01, 0x02, 0x04, 0x40], [0x08, 0x10, 0x20, 0x80]];

/// Where the parts of a chart go inside its panel.
struct Geom {
    plot: Rect,
    ticks: Ticks,
    /// Tick labels' width (0: none drawn).
    label_w: u16,
    x_labels: Option<u16>,
    legend: Option<u16>,
}

fn layout(p: &Plot, area: Rect) -> Option<Geom> {
    if area.width < 2 || area.height == 0 {
        return None;
    }
    let has_legend = !p.legend.is_empty();
    let (legend, x_labels, rows) = match area.height {
        h if h >= 4 => (has_legend, true, h - 1 - has_legend as u16),
        3 => (has_legend, false, 3 - has_legend as u16),
        h => (false, false, h),
    };
    let ticks = ticks(p.y, p.top, rows as usize);
    let label_w = (0..=ticks.n)
        .map(|k| {
            tick_label(p.y, &ticks, ticks.step * k as f64)
                .chars()
                .count()
        })
        .max()
        .unwrap_or(0) as u16;
    let label_w = if label_w + 1 + 4 <= area.width {
        label_w
    } else {
        0
    };
    let left = if label_w > 0 { label_w + 1 } else { 0 };
    Some(Geom {
        plot: Rect {
            x: area.x + left,
            y: area.y,
            width: area.width - left,
            height: rows,
        },
        ticks,
        label_w,
        x_labels: x_labels.then_some(area.y + rows),
        legend: legend.then_some(area.y + area.height - 1),
    })
}

impl Geom {
    /// Rows above the plot's bottom row for value `v` (fractional).
    fn y_rows(&self, v: f64) -> f64 {
        let max = self.ticks.max();
        if max <= 0.0 {
            return 0.0;
        }
        v / max * self.ticks.span() as f64
    }

    /// The screen row of a value, rounded to the nearest row.
    fn row_of(&self, v: f64) -> Option<u16> {
        let up = self.y_rows(v).round();
        if up < 0.0 || up >= self.plot.height as f64 {
            return None;
        }
        Some(self.plot.y + self.plot.height - 1 - up as u16)
    }

    /// The Braille dot row (0 = the bottom row's lowest dot) of a value:
    /// a tick's value sits between its row's middle dots, as a rule's
    /// glyph does.
    fn dot_of(&self, v: f64) -> i64 {
        (self.y_rows(v) * 4.0 + 1.5).round() as i64
    }

    fn x_frac(x: f64, range: [f64; 2]) -> f64 {
        let w = range[1] - range[0];
        if w <= 0.0 {
            0.0
        } else {
            ((x - range[0]) / w).clamp(0.0, 1.0)
        }
    }
}

/// Draws the chart inside `area` (a panel's inner area).
pub fn draw(p: &Plot, buf: &mut Buffer, area: Rect) {
    let Some(fr) = layout(p, area) else {
        return;
    };
    let plot = fr.plot;
    // The y axis: a tick label and ┤ at each tick, │ between them.
    if fr.label_w > 0 {
        let axis_x = plot.x - 1;
        let bottom = plot.y + plot.height - 1;
        let top_row = bottom.saturating_sub(fr.ticks.span() as u16).max(plot.y);
        for y in top_row..=bottom {
            buf[(axis_x, y)].set_char('│').set_style(dim());
        }
        for k in 0..=fr.ticks.n {
            let v = fr.ticks.step * k as f64;
            let Some(y) = fr.row_of(v) else { continue };
            let label = tick_label(p.y, &fr.ticks, v);
            let w = fr.label_w as usize;
            buf.set_string(area.x, y, format!("{label:>w$}"), dim());
            buf[(axis_x, y)].set_char('┤').set_style(dim());
        }
    }
    // Rules: those sharing a row take its cells in turn.
    let mut by_row: Vec<(u16, Vec<&Rule>)> = Vec::new();
    for r in &p.rules {
        let Some(y) = fr.row_of(r.value) else {
            continue;
        };
        match by_row.iter_mut().find(|(row, _)| *row == y) {
            Some((_, v)) => v.push(r),
            None => by_row.push((y, vec![r])),
        }
    }
    for (y, rules) in &by_row {
        for dx in 0..plot.width {
            let r = rules[dx as usize % rules.len()];
            buf[(plot.x + dx, *y)].set_char(r.glyph).set_style(r.style);
        }
    }
    // Dots, one glyph a cell, under the curves: a series drawn as dots
    // (NVML, GPU used) sits close to the curve it is compared with, and
    // the curve must not vanish under it.
    for d in &p.dots {
        let Some(y) = fr.row_of(d.y) else { continue };
        let x =
            plot.x + (Geom::x_frac(d.x, p.x) * plot.width.saturating_sub(1) as f64).round() as u16;
        buf[(x, y)].set_char(d.glyph).set_style(d.style);
    }
    // Curves: Braille dots, two columns and four rows a cell.
    let (w2, h4) = (plot.width as i64 * 2, plot.height as i64 * 4);
    let mut cells = vec![0u8; plot.width as usize * plot.height as usize];
    let mut styles: Vec<Option<Style>> = vec![None; cells.len()];
    for c in &p.curves {
        let dot = |&(x, y): &(f64, f64)| {
            (
                (Geom::x_frac(x, p.x) * (w2 - 1) as f64).round() as i64,
                fr.dot_of(y),
            )
        };
        let mut set = |x: i64, y: i64| {
            if !(0..w2).contains(&x) || !(0..h4).contains(&y) {
                return;
            }
            let (cx, cy) = (x / 2, (h4 - 1 - y) / 4);
            let i = cy as usize * plot.width as usize + cx as usize;
            cells[i] |= BRAILLE[(x % 2) as usize][((h4 - 1 - y) % 4) as usize];
            styles[i] = Some(c.style);
        };
        let pts: Vec<(i64, i64)> = c.points.iter().map(dot).collect();
        if let [only] = pts.as_slice() {
            set(only.0, only.1);
        }
        for w in pts.windows(2) {
            // Bresenham between neighbouring points.
            let ((mut x0, mut y0), (x1, y1)) = (w[0], w[1]);
            let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
            let (sx, sy) = ((x1 - x0).signum(), (y1 - y0).signum());
            let mut err = dx + dy;
            loop {
                set(x0, y0);
                if x0 == x1 && y0 == y1 {
                    break;
                }
                let e2 = 2 * err;
                if e2 >= dy {
                    err += dy;
                    x0 += sx;
                }
                if e2 <= dx {
                    err += dx;
                    y0 += sy;
                }
            }
        }
    }
    for (i, (&bits, style)) in cells.iter().zip(&styles).enumerate() {
        if bits == 0 {
            continue;
        }
        let (x, y) = (
            plot.x + (i % plot.width as usize) as u16,
            plot.y + (i / plot.width as usize) as u16,
        );
        let ch = char::from_u32(0x2800 + bits as u32).unwrap_or('⣿');
        buf[(x, y)]
            .set_char(ch)
            .set_style(style.unwrap_or_default());
    }
    // Under the plot: the x range, then the legend.
    if let Some(y) = fr.x_labels {
        let [l, r] = &p.x_labels;
        let w = plot.width as usize;
        buf.set_string(plot.x, y, clip(l, w), dim());
        let (ln, rn) = (l.chars().count(), r.chars().count());
        if ln + 1 + rn <= w {
            buf.set_string(plot.x + (w - rn) as u16, y, r, dim());
        }
    }
    if let Some(y) = fr.legend {
        let line = legend_line(&p.legend, area.width as usize);
        buf.set_line(area.x, y, &line, area.width);
    }
}

/// The legend in `width` columns: the long labels if they fit, else the
/// short ones, cut with "…" when even those do not.
fn legend_line(keys: &[Key], width: usize) -> ratatui::text::Line<'static> {
    let spans = |short: bool| -> Vec<Span<'static>> {
        let mut v = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            if i > 0 {
                v.push(Span::raw(if short { " " } else { "  " }));
            }
            v.push(Span::styled(k.sample.clone(), k.style));
            let label = if short { &k.short } else { &k.label };
            v.push(Span::styled(format!(" {label}"), dim()));
        }
        v
    };
    let long = spans(false);
    let n: usize = long.iter().map(|s| s.content.chars().count()).sum();
    if n <= width {
        return ratatui::text::Line::from(long);
    }
    clip_spans(spans(true), width)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: f64 = 1048576.0;
    const GIB: f64 = 1073741824.0;

    #[test]
    fn ticks_are_round_and_evenly_spaced() {
        // 5 rows: one label every other row, 0 4 8 MiB.
        let t = ticks(YAxis::Bytes, 8.0 * MIB, 5);
        assert_eq!((t.step, t.n, t.gap), (4.0 * MIB, 2, 2));
        // 9 rows: 0 2 4 6 8.
        let t = ticks(YAxis::Bytes, 7.6 * MIB, 9);
        assert_eq!((t.step, t.n, t.gap), (2.0 * MIB, 4, 2));
        let labels: Vec<String> = (0..=t.n)
            .map(|k| tick_label(YAxis::Bytes, &t, t.step * k as f64))
            .collect();
        assert_eq!(labels, ["0", "2 MiB", "4 MiB", "6 MiB", "8 MiB"]);
        // An H100's 79.65 GiB: 0 16 32 48 64 80 GiB.
        let t = ticks(YAxis::Bytes, 79.65 * GIB, 12);
        assert_eq!((t.step, t.n), (16.0 * GIB, 5));
        assert_eq!(tick_label(YAxis::Bytes, &t, 80.0 * GIB), "80 GiB");
        // Half a GiB counts in MiB.
        let t = ticks(YAxis::Bytes, 600.0 * MIB, 9);
        assert_eq!(t.step, 200.0 * MIB);
        assert_eq!(tick_label(YAxis::Bytes, &t, 400.0 * MIB), "400 MiB");
        // 64 MiB in 3 intervals: 0 32 64, not 0 40 80.
        let t = ticks(YAxis::Bytes, 64.0 * MIB, 7);
        assert_eq!((t.step, t.n), (32.0 * MIB, 2));
        let t = ticks(YAxis::Bytes, 64.0 * MIB, 11);
        assert_eq!((t.step, t.n), (16.0 * MIB, 4));
        // Tokens/s.
        let t = ticks(YAxis::Count, 40036.0, 7);
        assert_eq!((t.step, t.n), (25000.0, 2));
        assert_eq!(tick_label(YAxis::Count, &t, 50000.0), "50k");
        assert_eq!(tick_label(YAxis::Count, &t, 25000.0), "25k");
        let t = ticks(YAxis::Count, 3.2, 7);
        assert_eq!(tick_label(YAxis::Count, &t, t.step), "2");
        // Every count step is 1, 2, 2.5, 4 or 5 times a power of ten, and
        // the axis covers the top within the rows.
        for top in [1.0, 3.0, 7.5, 999.0, 1e5, 3.3e7] {
            for rows in 1..30 {
                let t = ticks(YAxis::Count, top, rows);
                assert!(t.max() >= top, "{top} {rows}: {t:?}");
                let m = t.step / 10f64.powi(t.step.log10().floor() as i32);
                assert!(
                    [1.0, 2.0, 2.5, 4.0, 5.0]
                        .iter()
                        .any(|x| (m - x).abs() < 1e-9),
                    "{t:?}"
                );
                assert!(t.span() < rows.max(1), "{top} {rows}: {t:?}");
            }
        }
        // Byte steps are whole in their unit: labels never need decimals.
        for top in [1.0, 1000.0, 5e6, 7.9e9, 8.5e10, 1.2e12] {
            for rows in 1..30 {
                let t = ticks(YAxis::Bytes, top, rows);
                assert!(t.max() >= top, "{top} {rows}: {t:?}");
                for k in 0..=t.n {
                    let l = tick_label(YAxis::Bytes, &t, t.step * k as f64);
                    assert!(!l.contains('.'), "{top} {rows}: {l}");
                }
            }
        }
        // Nothing to show still draws an axis.
        assert_eq!(ticks(YAxis::Bytes, 0.0, 5).n, 1);
    }

    fn draw_lines(p: &Plot, w: u16, h: u16) -> Vec<String> {
        let area = Rect::new(0, 0, w, h);
        let mut buf = Buffer::empty(area);
        draw(p, &mut buf, area);
        crate::ui::testing::rows(&buf)
    }

    fn plot(rules: Vec<Rule>) -> Plot<'static> {
        Plot {
            x: [0.0, 1.0],
            x_labels: ["0.0s".into(), "1.0s".into()],
            y: YAxis::Bytes,
            top: 8.0 * MIB,
            rules,
            curves: Vec::new(),
            dots: Vec::new(),
            legend: vec![Key {
                sample: "━".into(),
                style: Style::default(),
                label: "capacity 8 MiB".into(),
                short: "cap".into(),
            }],
        }
    }

    fn rule(value: f64, glyph: char) -> Rule {
        Rule {
            value,
            glyph,
            style: Style::default(),
        }
    }

    /// Capacity was drawn under the usable line and vanished; rules in one
    /// row now take its cells in turn, each with its own glyph.
    #[test]
    fn rules_in_one_row_both_show() {
        let p = plot(vec![rule(8.0 * MIB, '━'), rule(7.6 * MIB, '─')]);
        let l = draw_lines(&p, 30, 7);
        // 7 rows: legend, x labels, 5 plot rows; 0 4 8 MiB two rows apart.
        assert_eq!(l[0], "8 MiB┤━─━─━─━─━─━─━─━─━─━─━─━─");
        assert!(l[2].starts_with("4 MiB┤ "), "{l:?}");
        assert_eq!(l[4].trim_end(), "    0┤");
        assert_eq!(l[5].trim_end(), format!("{:6}0.0s{:16}1.0s", "", ""));
        assert_eq!(l[6].trim_end(), "━ capacity 8 MiB");
        // Apart, each is a whole rule.
        let p = plot(vec![rule(8.0 * MIB, '━'), rule(4.0 * MIB, '─')]);
        let l = draw_lines(&p, 30, 7);
        assert!(l[0].ends_with(&"━".repeat(24)), "{l:?}");
        assert!(l[2].ends_with(&"─".repeat(24)), "{l:?}");
    }

    #[test]
    fn curves_and_dots_draw_over_rules_and_curves_over_dots() {
        let pts = [(0.0, 0.0), (1.0, 8.0 * MIB)];
        let mut p = plot(vec![rule(4.0 * MIB, '─')]);
        p.curves.push(Curve {
            points: &pts,
            style: Style::default(),
        });
        p.dots.push(Dot {
            x: 1.0,
            y: 0.0,
            glyph: '◆',
            style: Style::default(),
        });
        let l = draw_lines(&p, 30, 7);
        // A diagonal: the bottom-left and top-right cells hold dots.
        assert_ne!(l[4].chars().nth(6), Some(' '), "{l:?}");
        assert_ne!(l[0].chars().last(), Some(' '), "{l:?}");
        let mid: String = l[2].chars().skip(6).collect();
        assert!(
            mid.chars().any(|c| ('\u{2801}'..='\u{28ff}').contains(&c)) && mid.contains('─'),
            "the curve crosses the rule: {mid:?}"
        );
        assert_eq!(l[4].chars().last(), Some('◆'), "{l:?}");
        // A dot where the curve passes gives way to it.
        p.dots.push(Dot {
            x: 0.0,
            y: 0.0,
            glyph: '•',
            style: Style::default(),
        });
        let l = draw_lines(&p, 30, 7);
        let first = l[4].chars().nth(6).unwrap();
        assert!(('\u{2801}'..='\u{28ff}').contains(&first), "{l:?}");
    }

    #[test]
    fn small_areas_do_not_panic() {
        let pts = [(0.0, MIB), (0.5, 9.0 * MIB)];
        for w in 0..12 {
            for h in 0..8 {
                let mut p = plot(vec![rule(8.0 * MIB, '━')]);
                p.curves.push(Curve {
                    points: &pts,
                    style: Style::default(),
                });
                let area = Rect::new(0, 0, w, h);
                let mut buf = Buffer::empty(area);
                draw(&p, &mut buf, area);
            }
        }
    }

    /// Every memory chart draws its lines with the same glyphs and
    /// colours, each line its own glyph.
    #[test]
    fn marks_draw_alike() {
        use ratatui::style::Color;
        let mut p = plot(vec![
            Mark::Capacity.rule(8.0 * MIB, false),
            Mark::Predicted.rule(4.0 * MIB, false),
        ]);
        p.legend = vec![
            Mark::Measured.key(false, "job", "job"),
            Mark::Capacity.key(false, "capacity 8 MiB", "cap"),
            Mark::Warn.key(true, "warn 90%", "warn"),
        ];
        let area = Rect::new(0, 0, 50, 7);
        let mut buf = Buffer::empty(area);
        draw(&p, &mut buf, area);
        let rows = crate::ui::testing::rows(&buf);
        assert!(rows[0].ends_with(&"━".repeat(44)), "{rows:?}");
        assert!(rows[2].ends_with(&"┄".repeat(44)), "{rows:?}");
        assert_eq!(buf[(10, 0)].fg, Color::Red);
        assert_eq!(buf[(10, 2)].fg, Color::Blue);
        assert_eq!(rows[6].trim_end(), "⡠⠊ job  ━ capacity 8 MiB  ─ warn 90%");
        assert_eq!(buf[(0, 6)].fg, Color::Cyan);
        // NO_COLOR: the glyph alone.
        assert_eq!(buf[(26, 6)].symbol(), "─");
        assert_eq!(buf[(26, 6)].fg, Color::Reset);
        assert_eq!(Mark::Warn.rule(1.0, false).glyph, '─');
        assert_eq!(Mark::Warn.style(false).fg, Some(Color::Yellow));
    }

    #[test]
    fn the_legend_shortens_before_it_is_cut() {
        let keys = vec![
            Key {
                sample: "━".into(),
                style: Style::default(),
                label: "capacity 8 MiB".into(),
                short: "cap".into(),
            },
            Key {
                sample: "─".into(),
                style: Style::default(),
                label: "usable 7.6 MiB".into(),
                short: "usable".into(),
            },
        ];
        let text = |w| legend_line(&keys, w).to_string();
        assert_eq!(text(40), "━ capacity 8 MiB  ─ usable 7.6 MiB");
        assert_eq!(text(20), "━ cap ─ usable");
        assert_eq!(text(8), "━ cap ─…");
    }
}
