//! The sweep's charts: PNG and SVG files next to report.json, and SVG strings
//! for report.html.
//!
//! Three charts:
//! - `memory_vs_micro_batch`: peak memory against micro-batch, one line per
//!   combination of the other knobs, with the capacity and the usable limit;
//! - `throughput_vs_memory`: tokens/s against measured peak for the trials that
//!   ran, with the Pareto frontier and the recommendation;
//! - `recommendation_breakdown`: the recommended trial's per-category peaks as
//!   one stacked bar, against the capacity.
//!
//! Text is drawn with DejaVu Sans embedded in the binary (assets/fonts, see
//! LICENSE-DejaVu.txt there) and registered with plotters' ab_glyph backend, so
//! rendering needs no fontconfig and no system fonts.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::coord::Shift;
use plotters::coord::ranged1d::{KeyPointHint, NoDefaultFormatting, ValueFormatter};
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{FontStyle, register_font};

use super::html::escape;
use super::report::{Outcome, SweepReport, TrialRecord};
use crate::error::{Error, Result};
use crate::memory::{Category, PeakBytes};
use crate::plan::{Point, name};
use crate::units::fmt_bytes;

/// Pixel size of every chart (PNG) and its SVG viewBox.
pub const WIDTH: u32 = 960;
pub const HEIGHT: u32 = 600;

/// The one font family the charts use; [`ensure_font`] registers DejaVu Sans under it.
const FONT: &str = "sans-serif";

static DEJAVU_SANS: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");

/// Registers the embedded DejaVu Sans as plotters' "sans-serif" (once per process).
pub fn ensure_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The embedded file is a valid TrueType font, so this cannot fail; if it
        // ever did, drawing text would report FontUnavailable, which surfaces as
        // a plot error rather than a panic.
        let _ = register_font(FONT, FontStyle::Normal, DEJAVU_SANS);
    });
}

type DrawResult<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

// Tableau 10: distinguishable, and readable for the common colour-vision deficiencies.
const PALETTE: [RGBColor; 10] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xed, 0xc9, 0x48),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0xff, 0x9d, 0xa7),
    RGBColor(0x9c, 0x75, 0x5f),
    RGBColor(0xba, 0xb0, 0xac),
];
const CAPACITY: RGBColor = RGBColor(0xb2, 0x18, 0x2b);
const USABLE: RGBColor = RGBColor(0xd6, 0x60, 0x4d);
const FITS: RGBColor = RGBColor(0x59, 0xa1, 0x4f);
const NO_FIT: RGBColor = RGBColor(0xe1, 0x57, 0x59);
const FRONTIER: RGBColor = RGBColor(0x4e, 0x79, 0xa7);
const GREY: RGBColor = RGBColor(0x55, 0x55, 0x55);

/// Most knob combinations named in the memory chart's legend; the rest are drawn unnamed.
const MAX_LEGEND_LINES: usize = 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Chart {
    MemoryVsMicroBatch,
    ThroughputVsMemory,
    RecommendationBreakdown,
}

impl Chart {
    const ALL: [Chart; 3] = [
        Chart::MemoryVsMicroBatch,
        Chart::ThroughputVsMemory,
        Chart::RecommendationBreakdown,
    ];

    fn file_stem(self) -> &'static str {
        match self {
            Chart::MemoryVsMicroBatch => "memory_vs_micro_batch",
            Chart::ThroughputVsMemory => "throughput_vs_memory",
            Chart::RecommendationBreakdown => "recommendation_breakdown",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Chart::MemoryVsMicroBatch => "Peak memory vs micro-batch",
            Chart::ThroughputVsMemory => "Throughput vs measured peak memory",
            Chart::RecommendationBreakdown => "Recommended configuration: peak by category",
        }
    }

    fn draw<DB: DrawingBackend>(self, root: &DrawingArea<DB, Shift>, r: &SweepReport) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        root.fill(&WHITE)?;
        match self {
            Chart::MemoryVsMicroBatch => draw_memory_vs_micro_batch(root, r),
            Chart::ThroughputVsMemory => draw_throughput_vs_memory(root, r),
            Chart::RecommendationBreakdown => draw_recommendation_breakdown(root, r),
        }
    }
}

/// Writes the three charts into `dir` (created if missing) as
/// `<chart>.png` and `<chart>.svg`; returns the paths written, PNG then SVG per chart.
pub fn write_plots(report: &SweepReport, dir: &Path) -> Result<Vec<PathBuf>> {
    ensure_font();
    std::fs::create_dir_all(dir).map_err(|source| Error::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut written = Vec::with_capacity(2 * Chart::ALL.len());
    for chart in Chart::ALL {
        let png = dir.join(format!("{}.png", chart.file_stem()));
        render_png(chart, report, &png).map_err(|e| plot_error(&png, e))?;
        written.push(png);

        let svg_path = dir.join(format!("{}.svg", chart.file_stem()));
        let svg = render_svg(chart, report).map_err(|e| plot_error(&svg_path, e))?;
        std::fs::write(&svg_path, svg).map_err(|source| Error::Write {
            path: svg_path.clone(),
            source,
        })?;
        written.push(svg_path);
    }
    Ok(written)
}

/// The three charts as standalone `<svg>` documents with their titles, for
/// inlining in report.html. A chart that fails to draw becomes a small SVG
/// saying so, so the page still renders.
pub fn svg_strings(report: &SweepReport) -> Vec<(String, String)> {
    ensure_font();
    Chart::ALL
        .iter()
        .map(|&chart| {
            let svg = render_svg(chart, report)
                .unwrap_or_else(|e| error_svg(&format!("{}: {e}", chart.title())));
            (chart.title().to_string(), svg)
        })
        .collect()
}

fn plot_error(path: &Path, e: Box<dyn std::error::Error>) -> Error {
    Error::Write {
        path: path.to_path_buf(),
        source: std::io::Error::other(format!("drawing the chart failed: {e}")),
    }
}

fn render_png(chart: Chart, report: &SweepReport, path: &Path) -> DrawResult {
    let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    chart.draw(&root, report)?;
    root.present()?;
    Ok(())
}

fn render_svg(chart: Chart, report: &SweepReport) -> DrawResult<String> {
    let mut buf = String::new();
    {
        let root = SVGBackend::with_string(&mut buf, (WIDTH, HEIGHT)).into_drawing_area();
        chart.draw(&root, report)?;
        root.present()?;
    }
    Ok(buf)
}

fn error_svg(message: &str) -> String {
    format!(
        "<svg width=\"{WIDTH}\" height=\"{HEIGHT}\" viewBox=\"0 0 {WIDTH} {HEIGHT}\" \
         xmlns=\"http://www.w3.org/2000/svg\">\n<text x=\"20\" y=\"40\" \
         font-family=\"{FONT}\" font-size=\"16\">{}</text>\n</svg>\n",
        escape(message)
    )
}

// ---- shared helpers ----

/// The IEC unit the largest value reads best in: (bytes per unit, name).
fn byte_unit(max_bytes: u64) -> (f64, &'static str) {
    const KI: f64 = 1024.0;
    let m = max_bytes as f64;
    if m >= KI * KI * KI {
        (KI * KI * KI, "GiB")
    } else if m >= KI * KI {
        (KI * KI, "MiB")
    } else if m >= KI {
        (KI, "KiB")
    } else {
        (1.0, "B")
    }
}

/// An axis's upper end: `v` with some air, or 1 when there is nothing to show.
fn axis_top(v: f64, air: f64) -> f64 {
    if v.is_finite() && v > 0.0 {
        v * air
    } else {
        1.0
    }
}

/// 1234567 -> "1.23M": compact tick labels for rates.
fn fmt_si(v: f64) -> String {
    let a = v.abs();
    if !v.is_finite() {
        String::new()
    } else if a >= 1e9 {
        format!("{:.2}G", v / 1e9)
    } else if a >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.1}k", v / 1e3)
    } else if a >= 100.0 || a == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// Tick labels in the axis unit, with the same number of decimals along an
/// axis whose upper end is `top`.
fn fmt_amount(v: f64, top: f64) -> String {
    if top >= 20.0 {
        format!("{v:.0}")
    } else if top >= 2.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// The knobs of a point other than micro-batch and gradient accumulation: one
/// line of the memory chart.
fn knob_combination(p: &Point) -> String {
    format!(
        "x{} {} {} {} ckpt:{} {}",
        p.gpus,
        name(p.sharding),
        name(p.precision),
        name(p.optimizer),
        name(p.checkpointing),
        name(p.attention),
    )
}

/// What the memory chart plots for a trial: the measured tracked total where
/// it ran, else the predicted total; `true` when measured.
fn plotted_peak(t: &TrialRecord) -> Option<(u64, bool)> {
    if t.outcome == Outcome::Ran
        && let Some(m) = &t.measured
    {
        return Some((m.peak_bytes.total, true));
    }
    t.predicted.as_ref().map(|p| (p.peak_total_bytes, false))
}

/// The trials that ran and measured a usable throughput: (index, peak bytes, tokens/s, fits).
fn ran_points(r: &SweepReport) -> Vec<(usize, u64, f64, bool)> {
    r.trials
        .iter()
        .enumerate()
        .filter(|(_, t)| t.outcome == Outcome::Ran)
        .filter_map(|(i, t)| {
            let m = t.measured.as_ref()?;
            let tps = if m.tokens_per_s.is_finite() && m.tokens_per_s >= 0.0 {
                m.tokens_per_s
            } else {
                0.0
            };
            Some((i, m.peak_bytes.total, tps, t.fits))
        })
        .collect()
}

fn hline(x0: f64, x1: f64, y: f64) -> Vec<(f64, f64)> {
    vec![(x0, y), (x1, y)]
}

fn vline(x: f64, y0: f64, y1: f64) -> Vec<(f64, f64)> {
    vec![(x, y0), (x, y1)]
}

fn legend_line(color: RGBColor) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
}

fn legend_dashed(
    color: RGBColor,
) -> impl Fn((i32, i32)) -> DashedPathElement<std::vec::IntoIter<(i32, i32)>, i32> {
    move |(x, y)| DashedPathElement::new(vec![(x, y), (x + 20, y)], 5, 3, color.stroke_width(2))
}

// ---- 1. memory vs micro-batch ----

/// A categorical axis of `n` slots: slot `i` is centred on the value `i as f64`,
/// so lines and markers use plain f64 coordinates and horizontal lines can run
/// from -0.5 to n - 0.5. (plotters' segmented integer axis misplaces a
/// one-value range, and its key-point wrapper has no formatter for f64.)
#[derive(Clone)]
struct Slots(usize);

impl Ranged for Slots {
    type FormatOption = NoDefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let n = self.0.max(1) as f64;
        let frac = (v + 0.5) / n;
        limit.0 + (frac * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        let step = self.0.div_ceil(hint.max_num_points().max(1)).max(1);
        (0..self.0).step_by(step).map(|i| i as f64).collect()
    }

    fn range(&self) -> Range<f64> {
        -0.5..(self.0.max(1) as f64 - 0.5)
    }
}

impl ValueFormatter<f64> for Slots {
    fn format(v: &f64) -> String {
        format!("{v}")
    }
}

struct MemPoint {
    /// Index into the micro-batch categories.
    x: usize,
    bytes: u64,
    measured: bool,
    /// OOM, timeout or crash: ran and failed, so only the prediction is drawn.
    failed: bool,
}

fn draw_memory_vs_micro_batch<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    r: &SweepReport,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    // Micro-batches as categories (they need not be powers of two), in order.
    let mut mbs: Vec<usize> = r
        .trials
        .iter()
        .filter(|t| plotted_peak(t).is_some())
        .map(|t| t.point.micro_batch)
        .collect();
    mbs.sort_unstable();
    mbs.dedup();

    // One line per knob combination, in order of first appearance.
    let mut lines: Vec<(String, Vec<MemPoint>)> = Vec::new();
    for t in &r.trials {
        let Some((bytes, measured)) = plotted_peak(t) else {
            continue;
        };
        let x = mbs.binary_search(&t.point.micro_batch).unwrap_or(0);
        let failed = matches!(t.outcome, Outcome::Oom | Outcome::Timeout | Outcome::Crash);
        let key = knob_combination(&t.point);
        let point = MemPoint {
            x,
            bytes,
            measured,
            failed,
        };
        match lines.iter_mut().find(|(k, _)| *k == key) {
            Some((_, points)) => points.push(point),
            None => lines.push((key, vec![point])),
        }
    }
    for (_, points) in &mut lines {
        points.sort_by_key(|p| p.x);
    }

    let capacity = r.capacity_bytes;
    let usable = r.usable_bytes();
    let data_max = lines
        .iter()
        .flat_map(|(_, ps)| ps.iter().map(|p| p.bytes))
        .max()
        .unwrap_or(0);
    let (div, unit) = byte_unit(data_max.max(capacity));
    // Predictions far past the capacity would flatten everything else: clip the
    // axis at 3x capacity and draw those points as triangles on the top edge.
    let shown_max = if capacity > 0 {
        data_max.min(capacity.saturating_mul(3)).max(capacity)
    } else {
        data_max
    };
    let y_top = axis_top(shown_max as f64 / div, 1.1);
    let slots = Slots(mbs.len());
    let x_range = slots.range();

    let caption = if lines.is_empty() {
        "Peak memory vs micro-batch: no trial has a measured or predicted peak".to_string()
    } else {
        Chart::MemoryVsMicroBatch.title().to_string()
    };
    let mut chart = ChartBuilder::on(root)
        .caption(caption, (FONT, 22))
        .margin(14)
        .x_label_area_size(48)
        .y_label_area_size(70)
        .build_cartesian_2d(slots, 0f64..y_top)?;

    let x_fmt = |v: &f64| {
        let i = v.round();
        if (v - i).abs() < 1e-6 && i >= 0.0 {
            mbs.get(i as usize)
                .map(|m| m.to_string())
                .unwrap_or_default()
        } else {
            String::new()
        }
    };
    let y_fmt = |v: &f64| fmt_amount(*v, y_top);
    chart
        .configure_mesh()
        .x_desc("micro-batch (sequences per GPU per step)")
        .y_desc(format!("peak memory per GPU ({unit})"))
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .light_line_style(RGBColor(0xee, 0xee, 0xee))
        .draw()?;

    let (x0, x1) = (x_range.start, x_range.end);
    if capacity > 0 {
        let cap = capacity as f64 / div;
        chart
            .draw_series(LineSeries::new(
                hline(x0, x1, cap),
                CAPACITY.stroke_width(2),
            ))?
            .label(format!("capacity {}", fmt_bytes(capacity)))
            .legend(legend_line(CAPACITY));
        let use_y = usable as f64 / div;
        chart
            .draw_series(DashedLineSeries::new(
                hline(x0, x1, use_y),
                8,
                6,
                USABLE.stroke_width(2),
            ))?
            .label(format!(
                "usable {} ({:.0}% headroom)",
                fmt_bytes(usable),
                r.headroom * 100.0
            ))
            .legend(legend_dashed(USABLE));
    }

    for (i, (key, points)) in lines.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let coords: Vec<(f64, f64)> = points
            .iter()
            .map(|p| (p.x as f64, (p.bytes as f64 / div).min(y_top)))
            .collect();
        let series = chart.draw_series(LineSeries::new(coords, color.stroke_width(2)))?;
        if i < MAX_LEGEND_LINES {
            series.label(key.clone()).legend(legend_line(color));
        } else if i == MAX_LEGEND_LINES {
            series
                .label(format!("... {} more combinations", lines.len() - i))
                .legend(legend_line(color));
        }
        for p in points {
            let value = p.bytes as f64 / div;
            let at = (p.x as f64, value.min(y_top));
            if value > y_top {
                chart.draw_series(std::iter::once(TriangleMarker::new(at, 7, color.filled())))?;
            } else if p.failed {
                chart.draw_series(std::iter::once(Cross::new(at, 6, color.stroke_width(2))))?;
            } else if p.measured {
                chart.draw_series(std::iter::once(Circle::new(at, 5, color.filled())))?;
            } else {
                chart.draw_series(std::iter::once(Circle::new(at, 5, WHITE.filled())))?;
                chart.draw_series(std::iter::once(Circle::new(at, 5, color.stroke_width(2))))?;
            }
        }
    }

    if !lines.is_empty() {
        // Marker key: how a point's shape says where its value comes from.
        chart
            .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?
            .label("measured (ran)")
            .legend(|(x, y)| Circle::new((x + 10, y), 5, GREY.filled()));
        chart
            .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?
            .label("predicted (not run)")
            .legend(|(x, y)| Circle::new((x + 10, y), 5, GREY.stroke_width(2)));
        chart
            .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?
            .label("predicted (oom / timeout / crash)")
            .legend(|(x, y)| Cross::new((x + 10, y), 6, GREY.stroke_width(2)));
        if data_max as f64 / div > y_top {
            chart
                .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?
                .label("off scale (> 3x capacity)")
                .legend(|(x, y)| TriangleMarker::new((x + 10, y), 7, GREY.filled()));
        }
    }

    if !lines.is_empty() || capacity > 0 {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font((FONT, 13))
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(0xbb, 0xbb, 0xbb))
            .draw()?;
    }
    Ok(())
}

// ---- 2. throughput vs memory ----

fn draw_throughput_vs_memory<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    r: &SweepReport,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let ran = ran_points(r);
    let capacity = r.capacity_bytes;
    let usable = r.usable_bytes();
    let peak_max = ran.iter().map(|p| p.1).max().unwrap_or(0);
    let (div, unit) = byte_unit(peak_max.max(capacity));
    let x_top = axis_top(peak_max.max(capacity) as f64 / div, 1.08);
    let tps_max = ran.iter().map(|p| p.2).fold(0.0, f64::max);
    let y_top = axis_top(tps_max, 1.15);

    let caption = if ran.is_empty() {
        "Throughput vs measured peak memory: no trial ran".to_string()
    } else {
        Chart::ThroughputVsMemory.title().to_string()
    };
    let mut chart = ChartBuilder::on(root)
        .caption(caption, (FONT, 22))
        .margin(14)
        .x_label_area_size(48)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..x_top, 0f64..y_top)?;
    let x_fmt = |v: &f64| fmt_amount(*v, x_top);
    let y_fmt = |v: &f64| fmt_si(*v);
    chart
        .configure_mesh()
        .x_desc(format!("measured peak memory per GPU ({unit}, tracked)"))
        .y_desc("throughput (tokens/s)")
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .light_line_style(RGBColor(0xee, 0xee, 0xee))
        .draw()?;

    if capacity > 0 {
        let cap = capacity as f64 / div;
        chart
            .draw_series(LineSeries::new(
                vline(cap, 0.0, y_top),
                CAPACITY.stroke_width(2),
            ))?
            .label(format!("capacity {}", fmt_bytes(capacity)))
            .legend(legend_line(CAPACITY));
        chart
            .draw_series(DashedLineSeries::new(
                vline(usable as f64 / div, 0.0, y_top),
                8,
                6,
                USABLE.stroke_width(2),
            ))?
            .label(format!("usable {}", fmt_bytes(usable)))
            .legend(legend_dashed(USABLE));
    }

    let at = |p: &(usize, u64, f64, bool)| (p.1 as f64 / div, p.2);

    // The frontier first, so the points sit on top of it.
    let mut frontier: Vec<(f64, f64)> = r
        .pareto
        .iter()
        .filter_map(|&i| ran.iter().find(|p| p.0 == i))
        .map(at)
        .collect();
    frontier.sort_by(|a, b| a.0.total_cmp(&b.0));
    if !frontier.is_empty() {
        chart
            .draw_series(LineSeries::new(frontier.clone(), FRONTIER.stroke_width(2)))?
            .label("Pareto frontier (fitting)")
            .legend(legend_line(FRONTIER));
        chart.draw_series(
            frontier
                .iter()
                .map(|&c| Circle::new(c, 8, FRONTIER.stroke_width(2))),
        )?;
    }

    let fitting: Vec<_> = ran.iter().filter(|p| p.3).map(at).collect();
    let over: Vec<_> = ran.iter().filter(|p| !p.3).map(at).collect();
    if !fitting.is_empty() {
        chart
            .draw_series(fitting.iter().map(|&c| Circle::new(c, 5, FITS.filled())))?
            .label(format!("fits ({})", fitting.len()))
            .legend(|(x, y)| Circle::new((x + 10, y), 5, FITS.filled()));
    }
    if !over.is_empty() {
        chart
            .draw_series(over.iter().map(|&c| Circle::new(c, 5, NO_FIT.filled())))?
            .label(format!("over the usable limit ({})", over.len()))
            .legend(|(x, y)| Circle::new((x + 10, y), 5, NO_FIT.filled()));
    }

    if let Some(rec) = &r.recommendation
        && let Some(p) = ran.iter().find(|p| p.0 == rec.trial)
    {
        let c = at(p);
        chart
            .draw_series(std::iter::once(Circle::new(c, 11, BLACK.stroke_width(3))))?
            .label("recommended")
            .legend(|(x, y)| Circle::new((x + 10, y), 6, BLACK.stroke_width(2)));
        // Label to the side with more room.
        let right_half = c.0 > x_top / 2.0;
        let (dx, h) = if right_half {
            (-16, HPos::Right)
        } else {
            (16, HPos::Left)
        };
        let style = TextStyle::from((FONT, 14).into_font())
            .color(&BLACK)
            .pos(Pos::new(h, VPos::Center));
        let label = format!("recommended: {}", r.trials[rec.trial].point.label());
        chart.draw_series(std::iter::once(
            EmptyElement::at(c) + Text::new(label, (dx, -14), style),
        ))?;
    }

    if !ran.is_empty() || capacity > 0 {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font((FONT, 13))
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(0xbb, 0xbb, 0xbb))
            .draw()?;
    }
    Ok(())
}

// ---- 3. recommendation breakdown ----

fn category_color(c: Category) -> RGBColor {
    PALETTE[Category::ALL.iter().position(|&x| x == c).unwrap_or(0) % PALETTE.len()]
}

fn draw_recommendation_breakdown<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    r: &SweepReport,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    // The measured peaks; the predicted ones if the recommended trial has none.
    let rec = r
        .recommendation
        .as_ref()
        .and_then(|rec| r.trials.get(rec.trial));
    let peaks: Option<(PeakBytes, bool)> = rec.and_then(|t| {
        t.measured
            .as_ref()
            .map(|m| (m.peak_bytes, true))
            .or_else(|| t.predicted.as_ref()?.peak_bytes.map(|p| (p, false)))
    });

    let caption = match (rec, peaks) {
        (Some(t), Some((_, true))) => format!("Recommended: {}", t.point.label()),
        (Some(t), Some((_, false))) => format!("Recommended (predicted): {}", t.point.label()),
        (Some(t), None) => format!("Recommended: {} (no per-category peaks)", t.point.label()),
        (None, _) => "No fitting trial: nothing to break down".to_string(),
    };
    let pb = peaks.map(|p| p.0).unwrap_or_default();
    let stacked: u64 = Category::ALL.iter().map(|&c| pb.get(c)).sum();
    let capacity = r.capacity_bytes;
    let usable = r.usable_bytes();
    let max = stacked.max(capacity).max(pb.total);
    let (div, unit) = byte_unit(max);
    let x_top = axis_top(max as f64 / div, 1.05);

    // The bar sits low; the legend takes the space above it.
    let (bar_lo, bar_hi) = (0.06, 0.44);
    let mut chart = ChartBuilder::on(root)
        .caption(caption, (FONT, 20))
        .margin(14)
        .x_label_area_size(64)
        .y_label_area_size(20)
        .build_cartesian_2d(0f64..x_top, 0f64..1f64)?;
    let x_fmt = |v: &f64| fmt_amount(*v, x_top);
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .x_desc(format!(
            "{unit}; each segment is its category's own peak, so the sum can exceed the peak live at once"
        ))
        .x_label_formatter(&x_fmt)
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 14))
        .light_line_style(RGBColor(0xee, 0xee, 0xee))
        .draw()?;

    let mut left = 0u64;
    for c in Category::ALL {
        let v = pb.get(c);
        if v == 0 {
            continue;
        }
        let color = category_color(c);
        let (x0, x1) = (left as f64 / div, (left + v) as f64 / div);
        left += v;
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(x0, bar_lo), (x1, bar_hi)],
                color.filled(),
            )))?
            .label(format!("{} {}", c.name(), fmt_bytes(v)))
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 16, y + 6)], color.filled()));
    }
    if stacked > 0 {
        chart.draw_series(std::iter::once(Rectangle::new(
            [(0.0, bar_lo), (stacked as f64 / div, bar_hi)],
            BLACK.stroke_width(1),
        )))?;
    }

    let (m_lo, m_hi) = (0.0, bar_hi + 0.1);
    if pb.total > 0 {
        chart
            .draw_series(DashedLineSeries::new(
                vline(pb.total as f64 / div, m_lo, m_hi),
                6,
                4,
                BLACK.stroke_width(2),
            ))?
            .label(format!("peak live at once {}", fmt_bytes(pb.total)))
            .legend(legend_dashed(BLACK));
    }
    if capacity > 0 {
        chart
            .draw_series(LineSeries::new(
                vline(capacity as f64 / div, m_lo, m_hi),
                CAPACITY.stroke_width(3),
            ))?
            .label(format!("capacity {}", fmt_bytes(capacity)))
            .legend(legend_line(CAPACITY));
        chart
            .draw_series(DashedLineSeries::new(
                vline(usable as f64 / div, m_lo, m_hi),
                8,
                6,
                USABLE.stroke_width(2),
            ))?
            .label(format!("usable {}", fmt_bytes(usable)))
            .legend(legend_dashed(USABLE));
    }

    if stacked > 0 || pb.total > 0 || capacity > 0 {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font((FONT, 13))
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(0xbb, 0xbb, 0xbb))
            .draw()?;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::engine::{Attention, Checkpointing, Optimizer, Precision, Sharding};
    use crate::sweep::report::{ExitInfo, Measured, Predicted, Recommendation, SCHEMA_VERSION};

    const MIB: u64 = 1024 * 1024;

    fn point(micro_batch: usize, checkpointing: Checkpointing, optimizer: Optimizer) -> Point {
        Point {
            micro_batch,
            precision: Precision::Bf16,
            checkpointing,
            attention: Attention::Fused,
            optimizer,
            sharding: Sharding::None,
            gpus: 1,
            grad_accum: 16 / micro_batch,
        }
    }

    fn peaks(total_mib: u64) -> PeakBytes {
        let total = total_mib * MIB;
        PeakBytes {
            total,
            parameters: total / 8,
            gradients: total / 8,
            optimizer: total / 4,
            activations: total / 3,
            temporaries: total / 10,
            communication: 0,
            workspace: MIB / 2,
        }
    }

    fn predicted(total_mib: u64) -> Option<Predicted> {
        Some(Predicted {
            peak_total_bytes: total_mib * MIB,
            peak_bytes: Some(peaks(total_mib)),
            step_s: 0.1 * total_mib as f64 / 10.0,
            tokens_per_s: 1000.0 * total_mib as f64,
        })
    }

    fn measured(total_mib: u64, tokens_per_s: f64) -> Option<Measured> {
        Some(Measured {
            peak_bytes: peaks(total_mib),
            device_peak_bytes: Some(total_mib * MIB + 40 * MIB),
            step_ms: vec![120.0, 100.0, 101.0],
            step_s: 0.1005,
            tokens_per_s,
            usd_per_mtok: 2.5 / 3600.0 / tokens_per_s * 1e6,
            losses: vec![10.8, 10.7],
            phase_peaks: Vec::new(),
        })
    }

    fn trial(p: Point, outcome: Outcome, fits: bool) -> TrialRecord {
        TrialRecord {
            id: format!("t-{}-{}", p.micro_batch, name(p.checkpointing)),
            numerics_changes: p.numerics_changes().iter().map(|s| s.to_string()).collect(),
            point: p,
            outcome,
            fits,
            predicted: None,
            measured: None,
            memory_error_pct: None,
            time_error_pct: None,
            exit: None,
            note: None,
            elapsed_s: 1.5,
        }
    }

    /// A small sweep: ran+fits, ran over the limit, oom, skipped, crash, with a
    /// recommendation and a Pareto frontier; a note carries a planted `<script>`.
    pub(crate) fn synthetic_report() -> SweepReport {
        let mut trials = Vec::new();
        for (mb, mib, tps) in [(1, 20, 9000.0), (2, 30, 15000.0), (4, 48, 21000.0)] {
            let mut t = trial(
                point(mb, Checkpointing::None, Optimizer::Adamw),
                Outcome::Ran,
                mib < 60,
            );
            t.predicted = predicted(mib - 1);
            t.measured = measured(mib, tps);
            t.memory_error_pct = Some(100.0 / mib as f64);
            t.time_error_pct = Some(-12.5);
            trials.push(t);
        }
        // Ran, but over the usable limit (60.8 MiB of 64 MiB).
        let mut t = trial(
            point(8, Checkpointing::Full, Optimizer::Adamw8bit),
            Outcome::Ran,
            false,
        );
        t.predicted = predicted(61);
        t.measured = measured(62, 26000.0);
        t.memory_error_pct = Some(1.6);
        t.time_error_pct = Some(3.0);
        trials.push(t);
        let mut t = trial(
            point(4, Checkpointing::Full, Optimizer::Adamw8bit),
            Outcome::Ran,
            true,
        );
        t.predicted = predicted(33);
        t.measured = measured(34, 18000.0);
        trials.push(t);
        // OOM.
        let mut t = trial(
            point(8, Checkpointing::None, Optimizer::Adamw),
            Outcome::Oom,
            false,
        );
        t.predicted = predicted(90);
        t.note = Some("out of memory in forward(3): 8.00 MiB requested".into());
        trials.push(t);
        // Skipped: predicted far past the capacity (drawn off scale).
        let mut t = trial(
            point(16, Checkpointing::None, Optimizer::Adamw),
            Outcome::SkippedPredictedOom,
            false,
        );
        t.predicted = predicted(400);
        t.note = Some("predicted 400 MiB > usable <script>alert(1)</script> & \"more\"".into());
        trials.push(t);
        // Crash.
        let mut t = trial(
            point(2, Checkpointing::Full, Optimizer::Adamw8bit),
            Outcome::Crash,
            false,
        );
        t.predicted = predicted(25);
        t.exit = Some(ExitInfo {
            code: None,
            signal: Some(9),
            stderr_tail: "thread 'main' panicked at <somewhere>".into(),
        });
        trials.push(t);
        // Invalid: nothing predicted, nothing measured.
        let mut t = trial(
            point(3, Checkpointing::None, Optimizer::Sgd),
            Outcome::Invalid,
            false,
        );
        t.note = Some("global_batch 16 is not a multiple of micro_batch 3".into());
        trials.push(t);

        SweepReport {
            schema_version: SCHEMA_VERSION,
            memfit_version: "0.1.0".into(),
            recipe: "recipes/tiny.yaml".into(),
            model: "tiny-gpt".into(),
            hardware: "cpu-test".into(),
            device: "cpu:limit=64MiB".into(),
            capacity_bytes: 64 * MIB,
            runtime_overhead_bytes: 0,
            headroom: 0.05,
            usd_per_gpu_hour: 2.5,
            allow_numerics_change: true,
            seq_len: 128,
            global_batch: 16,
            grid_size: 12,
            trials_run: 7,
            trials,
            recommendation: Some(Recommendation {
                trial: 2,
                reasons: vec![
                    "highest tokens/s among fitting trials".into(),
                    "fits with 12.0 MiB to spare".into(),
                ],
                runners_up: vec![4, 1],
            }),
            pareto: vec![0, 1, 4, 2],
            interrupted: false,
        }
    }

    pub(crate) fn empty_report() -> SweepReport {
        let mut r = synthetic_report();
        r.trials.clear();
        r.recommendation = None;
        r.pareto.clear();
        r.grid_size = 0;
        r.trials_run = 0;
        r.interrupted = true;
        r
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "memfit-plots-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// Tags open and close in order (enough XML for what plotters writes).
    pub(crate) fn assert_balanced(doc: &str, void: &[&str]) {
        let mut stack: Vec<String> = Vec::new();
        let mut rest = doc;
        while let Some(start) = rest.find('<') {
            let after = &rest[start + 1..];
            let end = after.find('>').expect("unterminated tag");
            let tag = &after[..end];
            rest = &after[end + 1..];
            if tag.starts_with('?') || tag.starts_with('!') {
                continue;
            }
            if let Some(closing) = tag.strip_prefix('/') {
                let open = stack.pop().unwrap_or_else(|| panic!("stray </{closing}>"));
                assert_eq!(open, closing.trim(), "mismatched tags");
                continue;
            }
            let tag_name: String = tag
                .chars()
                .take_while(|c| !c.is_whitespace() && *c != '/')
                .collect();
            assert!(!tag_name.is_empty(), "empty tag in document");
            if tag.ends_with('/') || void.contains(&tag_name.as_str()) {
                continue;
            }
            stack.push(tag_name);
        }
        assert!(stack.is_empty(), "unclosed tags: {stack:?}");
    }

    fn check_svg(svg: &str) {
        let head = svg.trim_start();
        assert!(head.starts_with("<svg") || head.starts_with("<?xml"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_balanced(svg, &[]);
        assert!(svg.contains("<text"), "no text rendered");
    }

    fn check_png(bytes: &[u8]) {
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
        assert_eq!(&bytes[12..16], b"IHDR");
        let w = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
        let h = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
        assert_eq!((w, h), (WIDTH, HEIGHT));
        assert!(
            bytes.len() > 5_000 && bytes.len() < 5_000_000,
            "implausible PNG size {}",
            bytes.len()
        );
    }

    #[test]
    fn writes_three_charts_as_png_and_svg() {
        let report = synthetic_report();
        let dir = temp_dir("full");
        let paths = write_plots(&report, &dir).unwrap();
        assert_eq!(paths.len(), 6);
        for path in &paths {
            let bytes = std::fs::read(path).unwrap();
            match path.extension().and_then(|e| e.to_str()) {
                Some("png") => check_png(&bytes),
                Some("svg") => {
                    let svg = String::from_utf8(bytes).unwrap();
                    check_svg(&svg);
                    assert!(!svg.contains("<script"), "unescaped text in {path:?}");
                }
                other => panic!("unexpected file {path:?} ({other:?})"),
            }
        }
        let names: Vec<_> = paths
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        for stem in [
            "memory_vs_micro_batch",
            "throughput_vs_memory",
            "recommendation_breakdown",
        ] {
            assert!(names.contains(&format!("{stem}.png")));
            assert!(names.contains(&format!("{stem}.svg")));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn svg_strings_render_text_and_the_recommendation() {
        let report = synthetic_report();
        let svgs = svg_strings(&report);
        assert_eq!(svgs.len(), 3);
        for (title, svg) in &svgs {
            assert!(!title.is_empty());
            check_svg(svg);
        }
        let label = escape(&report.trials[2].point.label());
        assert!(svgs[1].1.contains(&label), "recommendation not labelled");
        assert!(svgs[2].1.contains(&label), "breakdown not captioned");
        assert!(svgs[2].1.contains("activations"));
    }

    #[test]
    fn degenerate_reports_do_not_panic() {
        // No trials at all.
        let empty = empty_report();
        let dir = temp_dir("empty");
        let paths = write_plots(&empty, &dir).unwrap();
        assert_eq!(paths.len(), 6);
        let svgs = svg_strings(&empty);
        assert!(svgs[2].1.contains("no fitting trial") || svgs[2].1.contains("No fitting trial"));
        for (_, svg) in &svgs {
            check_svg(svg);
        }
        let _ = std::fs::remove_dir_all(&dir);

        // One trial, all zeros, no capacity, NaN throughput, no recommendation.
        let mut one = synthetic_report();
        one.trials.truncate(1);
        one.capacity_bytes = 0;
        one.recommendation = None;
        one.pareto = vec![0, 7];
        let m = one.trials[0].measured.as_mut().unwrap();
        m.peak_bytes = PeakBytes::default();
        m.tokens_per_s = f64::NAN;
        one.trials[0].predicted = None;
        for (_, svg) in svg_strings(&one) {
            check_svg(&svg);
        }

        // A recommendation pointing past the trials, and one that never measured.
        let mut odd = synthetic_report();
        odd.recommendation.as_mut().unwrap().trial = 99;
        odd.pareto = vec![99, 5];
        for (_, svg) in svg_strings(&odd) {
            check_svg(&svg);
        }
        let mut odd = synthetic_report();
        odd.recommendation.as_mut().unwrap().trial = 5;
        for (_, svg) in svg_strings(&odd) {
            check_svg(&svg);
        }
    }

    #[test]
    fn write_errors_name_the_path() {
        let file = temp_dir("not-a-dir");
        std::fs::write(&file, b"x").unwrap();
        let err = write_plots(&synthetic_report(), &file).unwrap_err();
        assert!(matches!(err, Error::Write { .. }), "{err}");
        let _ = std::fs::remove_file(&file);
    }

    #[test]
    fn units_and_labels() {
        assert_eq!(byte_unit(0).1, "B");
        assert_eq!(byte_unit(64 * MIB).1, "MiB");
        assert_eq!(byte_unit(3 << 30).1, "GiB");
        assert_eq!(fmt_si(21000.0), "21.0k");
        assert_eq!(fmt_si(f64::NAN), "");
        assert_eq!(fmt_amount(60.0, 211.0), "60");
        assert_eq!(fmt_amount(0.5, 1.2), "0.50");
        assert_eq!(axis_top(0.0, 1.1), 1.0);
        assert_eq!(axis_top(f64::INFINITY, 1.1), 1.0);
    }
}
