//! The sweep's charts: PNG and SVG files next to report.json, and SVG strings
//! for report.html.
//!
//! Three charts, each titled with the model, the run device and the target:
//! - `memory_vs_micro_batch`: peak memory per rank against micro-batch, one
//!   line per combination of the knobs that vary, on an axis scaled to the
//!   capacity (points above it sit on the top edge), with the capacity and
//!   the usable limit;
//! - `throughput_vs_memory`: measured tokens/s against measured peak for the
//!   trials that ran, coloured by one knob and shaped by another, with the
//!   Pareto frontier, the recommendation and the trials tied with it;
//! - `recommendation_breakdown`: the recommended trial's memory at the moment
//!   of its peak, split by category (the segments add up to the peak),
//!   against the capacity.
//!
//! Legends sit in a panel right of the plot, so nothing drawn on the plot
//! can run under them. In SVG, every point and segment carries a `<title>`
//! tooltip naming its configuration.
//!
//! Text is DejaVu Sans embedded in the binary (assets/fonts, see
//! LICENSE-DejaVu.txt there): PNG text is laid out and rasterised by
//! [`typeset`] (plotters' own ab_glyph drawing drops each glyph's side
//! bearing), SVG text is written as `<text>` in "DejaVu Sans, sans-serif".
//! Rendering needs no fontconfig and no system fonts.

pub mod typeset;

use std::fmt::Write as _;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::coord::Shift;
use plotters::coord::ranged1d::{AsRangedCoord, KeyPointHint, NoDefaultFormatting, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{FontStyle, FontTransform, register_font};

use self::typeset::Typeset;
use super::html::escape;
use crate::error::{Error, Result};
use crate::memory::Category;
use crate::plan::{Point, name};
use crate::report::sweep::{Outcome, SweepReport, TrialRecord};
use crate::units::fmt_bytes;

/// Pixel size of every chart (PNG) and its SVG viewBox.
pub const WIDTH: u32 = 960;
pub const HEIGHT: u32 = 600;

/// The charts' font family. SVG viewers with DejaVu Sans lay the text out
/// exactly as the PNG; others fall back to their sans-serif.
const FONT: &str = "DejaVu Sans, sans-serif";

/// DejaVu Sans, embedded.
pub static DEJAVU_SANS: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");

/// Registers the embedded DejaVu Sans with plotters under [`FONT`] (once per
/// process), for the size estimates plotters makes itself.
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

// Tableau 10, then its lighter companions (Tableau 20's second half): the
// first ten are distinguishable with the common colour-vision deficiencies.
const PALETTE: [RGBColor; 20] = [
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
    RGBColor(0xa0, 0xcb, 0xe8),
    RGBColor(0xff, 0xbe, 0x7d),
    RGBColor(0xff, 0x9d, 0x9a),
    RGBColor(0x86, 0xbc, 0xb6),
    RGBColor(0x8c, 0xd1, 0x7d),
    RGBColor(0xf1, 0xce, 0x63),
    RGBColor(0xd4, 0xa6, 0xc8),
    RGBColor(0xfa, 0xbf, 0xd2),
    RGBColor(0xd7, 0xb5, 0xa6),
    RGBColor(0x79, 0x70, 0x6e),
];
const CAPACITY: RGBColor = RGBColor(0xb2, 0x18, 0x2b);
const USABLE: RGBColor = RGBColor(0xd6, 0x60, 0x4d);
const FRONTIER: RGBColor = RGBColor(0x33, 0x33, 0x33);
const GREY: RGBColor = RGBColor(0x55, 0x55, 0x55);
const MESH: RGBColor = RGBColor(0xee, 0xee, 0xee);
/// The usable limit's (dash, gap) in pixels.
const USABLE_DASH: (i32, i32) = (8, 6);
/// The memory chart's line styles: solid, then (dash, gap) patterns.
const DASHES: [Option<(i32, i32)>; STYLES] = [None, Some((6, 4)), Some((2, 3)), Some((16, 5))];

/// A capacity more than this many times the largest value is left off the
/// axis (an unlimited host's memory against a few MiB), and said so.
const CAPACITY_OFF_SCALE: f64 = 10.0;

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
            Chart::RecommendationBreakdown => "Recommended configuration: memory at its peak",
        }
    }

    /// Draws the chart; returns the tooltips of what it drew (used in SVG).
    fn draw<DB: DrawingBackend>(
        self,
        root: &DrawingArea<DB, Shift>,
        r: &SweepReport,
    ) -> DrawResult<Vec<Tip>>
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
    let backend = BitMapBackend::new(path, (WIDTH, HEIGHT));
    let root = Typeset::raster(backend, &[DEJAVU_SANS]).into_drawing_area();
    chart.draw(&root, report)?;
    root.present()?;
    Ok(())
}

fn render_svg(chart: Chart, report: &SweepReport) -> DrawResult<String> {
    let mut buf = String::new();
    let tips = {
        let backend = SVGBackend::with_string(&mut buf, (WIDTH, HEIGHT));
        let root = Typeset::measure_only(backend, &[DEJAVU_SANS]).into_drawing_area();
        let tips = chart.draw(&root, report)?;
        root.present()?;
        tips
    };
    Ok(with_tips(buf, &tips))
}

fn error_svg(message: &str) -> String {
    format!(
        "<svg width=\"{WIDTH}\" height=\"{HEIGHT}\" viewBox=\"0 0 {WIDTH} {HEIGHT}\" \
         xmlns=\"http://www.w3.org/2000/svg\">\n<text x=\"20\" y=\"40\" \
         font-family=\"{FONT}\" font-size=\"16\">{}</text>\n</svg>\n",
        escape(message)
    )
}

// ---- tooltips ----

/// Where a tooltip applies, in pixels.
#[derive(Clone, Debug, PartialEq)]
enum Spot {
    Circle { x: i32, y: i32, r: i32 },
    Rect { x0: i32, y0: i32, x1: i32, y1: i32 },
}

/// A tooltip over something drawn: SVG has plotters draw the shapes and
/// adds an invisible shape with a `<title>` on top of each.
#[derive(Clone, Debug, PartialEq)]
struct Tip {
    spot: Spot,
    text: String,
}

/// `svg` with the tooltips' shapes appended last (on top), before `</svg>`.
fn with_tips(mut svg: String, tips: &[Tip]) -> String {
    if tips.is_empty() {
        return svg;
    }
    let Some(end) = svg.rfind("</svg>") else {
        return svg;
    };
    let mut g = String::from("<g class=\"tips\" fill=\"#000\" fill-opacity=\"0\">\n");
    for t in tips {
        let title = format!("<title>{}</title>", escape(&t.text));
        let _ = match t.spot {
            Spot::Circle { x, y, r } => {
                writeln!(
                    g,
                    "<circle cx=\"{x}\" cy=\"{y}\" r=\"{r}\">{title}</circle>"
                )
            }
            Spot::Rect { x0, y0, x1, y1 } => writeln!(
                g,
                "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\">{title}</rect>",
                x0.min(x1),
                y0.min(y1),
                (x1 - x0).abs().max(1),
                (y1 - y0).abs().max(1)
            ),
        };
    }
    g.push_str("</g>\n");
    svg.insert_str(end, &g);
    svg
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

/// The largest byte value a memory axis must show: the capacity when the
/// data come anywhere near it (points above it are then drawn on the top
/// edge, not stretching the axis), else the data alone; `true` when the
/// capacity is on the axis.
fn memory_axis(data_max: u64, capacity: u64) -> (u64, bool) {
    if capacity > 0 && data_max as f64 * CAPACITY_OFF_SCALE >= capacity as f64 {
        (capacity, true)
    } else {
        (data_max, false)
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

/// The two roles in one line: "gpt2-tiny — run on cpu:limit=24MiB
/// (emulated), target NVIDIA T4 16GB".
pub fn roles_line(r: &SweepReport) -> String {
    let spec = if r.run_device.spec.is_empty() {
        &r.device
    } else {
        &r.run_device.spec
    };
    let target = if r.target.display_name.is_empty() {
        &r.hardware
    } else {
        &r.target.display_name
    };
    format!(
        "{} \u{2014} run on {spec}{}, target {target}",
        r.model,
        if r.run_device.emulated {
            " (emulated)"
        } else {
            ""
        }
    )
}

/// What the throughput axis measured, in words.
fn throughput_desc(r: &SweepReport) -> String {
    match r.run_device.kind.as_str() {
        "cpu" => "tokens/s measured on this host's CPU (all ranks)".into(),
        "meta" => "tokens/s predicted (meta run device)".into(),
        _ => "tokens/s measured on the run device".into(),
    }
}

/// A knob a grid can vary, besides micro-batch and accumulation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Knob {
    Precision,
    Optimizer,
    Sharding,
    Gpus,
    Checkpointing,
    Attention,
}

impl Knob {
    /// In order of preference for colour, then shape.
    const ALL: [Knob; 6] = [
        Knob::Precision,
        Knob::Optimizer,
        Knob::Sharding,
        Knob::Gpus,
        Knob::Checkpointing,
        Knob::Attention,
    ];

    fn title(self) -> &'static str {
        match self {
            Knob::Precision => "precision",
            Knob::Optimizer => "optimizer",
            Knob::Sharding => "sharding",
            Knob::Gpus => "ranks",
            Knob::Checkpointing => "checkpointing",
            Knob::Attention => "attention",
        }
    }

    /// The value as the point's label spells it.
    fn value(self, p: &Point) -> String {
        match self {
            Knob::Precision => name(p.precision),
            Knob::Optimizer => name(p.optimizer),
            Knob::Sharding => name(p.sharding),
            Knob::Gpus => format!("x{}", p.gpus),
            Knob::Checkpointing => format!("ckpt:{}", name(p.checkpointing)),
            Knob::Attention => name(p.attention),
        }
    }
}

/// The knobs that take more than one value among `points`, in
/// [`Knob::ALL`]'s order, and the others with their one value.
fn split_knobs<'a>(
    points: impl Iterator<Item = &'a Point> + Clone,
) -> (Vec<Knob>, Vec<(Knob, String)>) {
    let mut varying = Vec::new();
    let mut constant = Vec::new();
    for k in Knob::ALL {
        let mut values = points.clone().map(|p| k.value(p));
        let Some(first) = values.next() else {
            continue;
        };
        if values.any(|v| v != first) {
            varying.push(k);
        } else {
            constant.push((k, first));
        }
    }
    (varying, constant)
}

/// The values of `knobs` at `p`, as one key: "fp32 adamw".
fn combo(knobs: &[Knob], p: &Point) -> String {
    knobs
        .iter()
        .map(|k| k.value(p))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Each distinct combination of `knobs` among `points`, in order of first appearance.
fn combos<'a>(knobs: &[Knob], points: impl Iterator<Item = &'a Point>) -> Vec<String> {
    let mut values: Vec<String> = Vec::new();
    for p in points {
        let v = combo(knobs, p);
        if !values.contains(&v) {
            values.push(v);
        }
    }
    values
}

/// Distinguishable colours ([`PALETTE`]'s first ten) and line or marker styles.
const COLOURS: usize = 10;
const STYLES: usize = 4;

/// How both charts tell configurations apart: colour for the combination
/// of the first one or two knobs that vary, a second channel (marker shape,
/// line dash) for the next one or two, so a colour means the same in both.
struct Encoding {
    colour: Vec<Knob>,
    colours: Vec<String>,
    style: Vec<Knob>,
    styles: Vec<String>,
    /// Varied, but neither colour nor style shows it (tooltips do).
    rest: Vec<Knob>,
    /// The knobs every point shares, with their value.
    constant: Vec<(Knob, String)>,
}

impl Encoding {
    fn new<'a>(points: impl Iterator<Item = &'a Point> + Clone) -> Encoding {
        let (varying, constant) = split_knobs(points.clone());
        // As many knobs (up to two) as keep the combinations within `max`.
        let take = |from: &[Knob], max: usize, at_least: usize| {
            let mut n = 0;
            while n < from.len().min(2) && combos(&from[..=n], points.clone()).len() <= max {
                n += 1;
            }
            n.max(at_least.min(from.len()))
        };
        let nc = take(&varying, COLOURS, 1);
        let ns = take(&varying[nc..], STYLES, 0);
        let colour = varying[..nc].to_vec();
        let style = varying[nc..nc + ns].to_vec();
        Encoding {
            colours: combos(&colour, points.clone()),
            styles: combos(&style, points),
            rest: varying[nc + ns..].to_vec(),
            colour,
            style,
            constant,
        }
    }

    fn colour_index(&self, p: &Point) -> usize {
        let key = combo(&self.colour, p);
        self.colours.iter().position(|c| *c == key).unwrap_or(0)
    }

    fn colour(&self, p: &Point) -> RGBColor {
        PALETTE[self.colour_index(p) % PALETTE.len()]
    }

    fn style(&self, p: &Point) -> usize {
        let key = combo(&self.style, p);
        self.styles.iter().position(|c| *c == key).unwrap_or(0) % STYLES
    }

    fn titles(knobs: &[Knob]) -> String {
        knobs
            .iter()
            .map(|k| k.title())
            .collect::<Vec<_>>()
            .join(" / ")
    }

    /// The legend's rows for the encoding; `style_key` draws a style's key.
    fn legend(&self, legend: &mut Legend, style_word: &str, style_key: impl Fn(usize) -> Key) {
        if !self.colour.is_empty() {
            legend.push(
                Key::Heading,
                format!("colour: {}", Self::titles(&self.colour)),
            );
            for (i, v) in self.colours.iter().enumerate() {
                legend.push(
                    Key::Marker(Shape::Circle, PALETTE[i % PALETTE.len()], true),
                    v.clone(),
                );
            }
        }
        if !self.style.is_empty() {
            legend.push(
                Key::Heading,
                format!("{style_word}: {}", Self::titles(&self.style)),
            );
            for (i, v) in self.styles.iter().enumerate() {
                legend.push(style_key(i % STYLES), v.clone());
            }
        }
        if !self.rest.is_empty() {
            legend.push(
                Key::Heading,
                format!("also varied: {}", Self::titles(&self.rest)),
            );
        }
        if !self.constant.is_empty() {
            legend.push(Key::Heading, "the same in every trial:");
            for (k, v) in &self.constant {
                legend.push(Key::Heading, format!("\u{a0}\u{a0}\u{a0}{} {v}", k.title()));
            }
        }
    }
}

/// The encoding both charts share: over every trial with a peak to plot.
fn encoding(r: &SweepReport) -> Encoding {
    Encoding::new(
        r.trials
            .iter()
            .filter(|t| plotted_peak(t).is_some())
            .map(|t| &t.point),
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

/// A trial that ran and measured a throughput.
struct Ran {
    index: usize,
    peak: u64,
    tokens_per_s: f64,
    ci: [f64; 2],
    fits: bool,
}

fn ran_points(r: &SweepReport) -> Vec<Ran> {
    let finite = |v: f64| if v.is_finite() && v >= 0.0 { v } else { 0.0 };
    r.trials
        .iter()
        .enumerate()
        .filter(|(_, t)| t.outcome == Outcome::Ran)
        .filter_map(|(i, t)| {
            let m = t.measured.as_ref()?;
            Some(Ran {
                index: i,
                peak: m.peak_bytes.total,
                tokens_per_s: finite(m.tokens_per_s),
                ci: m.tokens_per_s_ci.map(finite),
                fits: t.fits,
            })
        })
        .collect()
}

// ---- layout: title, legend panel ----

fn text_style(size: u32, color: &RGBColor, h: HPos, v: VPos) -> TextStyle<'_> {
    TextStyle::from((FONT, size).into_font())
        .color(color)
        .pos(Pos::new(h, v))
}

/// The title and the roles line across the top; returns the area below.
fn titled<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    r: &SweepReport,
) -> DrawResult<DrawingArea<DB, Shift>>
where
    DB::ErrorType: 'static,
{
    let mid = WIDTH as i32 / 2;
    root.draw_text(
        title,
        &text_style(24, &BLACK, HPos::Center, VPos::Top),
        (mid, 10),
    )?;
    root.draw_text(
        &roles_line(r),
        &text_style(16, &GREY, HPos::Center, VPos::Top),
        (mid, 40),
    )?;
    Ok(root.split_vertically(62).1)
}

/// A marker shape: the throughput chart's second knob.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    Circle,
    Square,
    Triangle,
    Diamond,
}

const SHAPES: [Shape; 4] = [
    Shape::Circle,
    Shape::Square,
    Shape::Triangle,
    Shape::Diamond,
];

/// Draws a marker centred on `(x, y)` in pixels; hollow ones are white inside.
fn draw_marker<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    shape: Shape,
    (x, y): (i32, i32),
    r: i32,
    color: RGBColor,
    filled: bool,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let outline: Vec<(i32, i32)> = match shape {
        Shape::Circle => {
            if filled {
                area.draw(&Circle::new((x, y), r, color.filled()))?;
            } else {
                area.draw(&Circle::new((x, y), r, WHITE.filled()))?;
                area.draw(&Circle::new((x, y), r, color.stroke_width(2)))?;
            }
            return Ok(());
        }
        Shape::Square => {
            let s = r * 9 / 10;
            vec![
                (x - s, y - s),
                (x + s, y - s),
                (x + s, y + s),
                (x - s, y + s),
            ]
        }
        Shape::Triangle => vec![
            (x, y - r - 1),
            (x + r + 1, y + r - 1),
            (x - r - 1, y + r - 1),
        ],
        Shape::Diamond => vec![
            (x, y - r - 1),
            (x + r + 1, y),
            (x, y + r + 1),
            (x - r - 1, y),
        ],
    };
    if filled {
        area.draw(&Polygon::new(outline, color.filled()))?;
    } else {
        area.draw(&Polygon::new(outline.clone(), WHITE.filled()))?;
        let mut closed = outline.clone();
        closed.push(outline[0]);
        area.draw(&PathElement::new(closed, color.stroke_width(2)))?;
    }
    Ok(())
}

/// What a legend row shows left of its text.
#[derive(Clone, Debug)]
enum Key {
    /// A group heading: text only, in grey.
    Heading,
    Line(RGBColor),
    /// A dashed line: (dash, gap) in pixels.
    Dash(RGBColor, (i32, i32)),
    Marker(Shape, RGBColor, bool),
    Cross(RGBColor),
    Ring(RGBColor, u32),
    Swatch(RGBColor),
}

struct Legend(Vec<(Key, String)>);

impl Legend {
    const ROW: i32 = 20;
    const KEY_W: i32 = 30;
    const FONT_SIZE: u32 = 14;

    fn push(&mut self, key: Key, text: impl Into<String>) {
        self.0.push((key, text.into()));
    }

    /// Pixel width the panel needs (text measured in the chart's font).
    fn width<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> u32 {
        let style = text_style(Self::FONT_SIZE, &BLACK, HPos::Left, VPos::Center);
        let text_w = self
            .0
            .iter()
            .filter_map(|(_, t)| area.estimate_text_size(t, &style).ok())
            .map(|(w, _)| w as i32)
            .max()
            .unwrap_or(0);
        (text_w + Self::KEY_W + 24).clamp(150, 360) as u32
    }

    /// Draws the rows top-down in `area`; rows that do not fit are counted
    /// in a last line instead.
    fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        if self.0.is_empty() {
            return Ok(());
        }
        let (w, h) = area.dim_in_pixel();
        let fit = ((h as i32 - 24) / Self::ROW).max(1) as usize;
        let (shown, hidden) = if self.0.len() > fit {
            (&self.0[..fit - 1], self.0.len() - (fit - 1))
        } else {
            (&self.0[..], 0)
        };
        let rows = shown.len() as i32 + i32::from(hidden > 0);
        let (x0, y0) = (4, 10);
        let right = w as i32 - 10;
        area.draw(&Rectangle::new(
            [(x0, y0), (right, y0 + 10 + rows * Self::ROW)],
            RGBColor(0xbb, 0xbb, 0xbb).stroke_width(1),
        ))?;
        let style = text_style(Self::FONT_SIZE, &BLACK, HPos::Left, VPos::Center);
        let heading = text_style(Self::FONT_SIZE, &GREY, HPos::Left, VPos::Center);
        for (i, (key, text)) in shown.iter().enumerate() {
            let y = y0 + 5 + Self::ROW / 2 + i as i32 * Self::ROW;
            let (kx, tx) = (x0 + 8, x0 + 8 + Self::KEY_W);
            match *key {
                Key::Heading => {
                    area.draw_text(text, &heading, (x0 + 8, y))?;
                    continue;
                }
                Key::Line(c) => {
                    area.draw(&PathElement::new(
                        vec![(kx, y), (kx + 22, y)],
                        c.stroke_width(2),
                    ))?;
                }
                Key::Dash(c, (on, off)) => {
                    let mut s = 0;
                    while s < 26 {
                        area.draw(&PathElement::new(
                            vec![(kx + s, y), (kx + (s + on).min(26), y)],
                            c.stroke_width(2),
                        ))?;
                        s += on + off;
                    }
                }
                Key::Marker(shape, c, filled) => {
                    draw_marker(area, shape, (kx + 11, y), 5, c, filled)?
                }
                Key::Cross(c) => {
                    area.draw(&Cross::new((kx + 11, y), 5, c.stroke_width(2)))?;
                }
                Key::Ring(c, width) => {
                    area.draw(&Circle::new((kx + 11, y), 7, c.stroke_width(width)))?;
                }
                Key::Swatch(c) => {
                    area.draw(&Rectangle::new(
                        [(kx + 3, y - 6), (kx + 19, y + 6)],
                        c.filled(),
                    ))?;
                }
            }
            area.draw_text(text, &style, (tx, y))?;
        }
        if hidden > 0 {
            let y = y0 + 5 + Self::ROW / 2 + shown.len() as i32 * Self::ROW;
            area.draw_text(&format!("\u{2026} {hidden} more"), &heading, (x0 + 8, y))?;
        }
        Ok(())
    }
}

/// Splits the area under the title into the plot (left) and the legend
/// panel (right), sized for `legend`.
fn with_legend<DB: DrawingBackend>(
    body: &DrawingArea<DB, Shift>,
    legend: &Legend,
) -> (DrawingArea<DB, Shift>, DrawingArea<DB, Shift>) {
    let w = legend.width(body);
    body.split_horizontally(WIDTH as i32 - w as i32)
}

/// Draws `text` on a white box centred vertically on `(x, y)` in pixels,
/// anchored on its left or right edge.
fn label_box<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    text: &str,
    (x, y): (i32, i32),
    h: HPos,
    size: u32,
    color: RGBColor,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let style = text_style(size, &color, h, VPos::Center);
    let (w, th) = root.estimate_text_size(text, &style)?;
    let (w, th) = (w as i32, th as i32);
    let x0 = match h {
        HPos::Left => x,
        HPos::Right => x - w,
        HPos::Center => x - w / 2,
    };
    root.draw(&Rectangle::new(
        [(x0 - 3, y - th / 2 - 3), (x0 + w + 3, y + th / 2 + 3)],
        WHITE.mix(0.85).filled(),
    ))?;
    root.draw_text(text, &style, (x, y))?;
    Ok(())
}

/// Horizontal reference lines (capacity, usable) across the plot, each
/// labelled on the plot at its left end: the first above its line, the
/// second below, so two close lines keep their labels apart.
fn label_hlines<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    x_left: i32,
    lines: &[(i32, String, RGBColor)],
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    for (i, (y, text, color)) in lines.iter().enumerate() {
        let dy = if i == 0 { -11 } else { 11 };
        label_box(root, text, (x_left + 8, y + dy), HPos::Left, 14, *color)?;
    }
    Ok(())
}

/// Vertical reference lines' labels, written along the lines from the top
/// of the plot: the first left of its line, the others right of theirs.
fn label_vlines<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    y_top: i32,
    lines: &[(i32, String, RGBColor)],
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    for (i, (x, text, color)) in lines.iter().enumerate() {
        let (v, dx) = if i == 0 {
            (VPos::Bottom, -4)
        } else {
            (VPos::Top, 4)
        };
        let style = text_style(14, color, HPos::Right, v).transform(FontTransform::Rotate270);
        root.draw_text(text, &style, (x + dx, y_top + 4))?;
    }
    Ok(())
}

/// The capacity and usable rows of a legend; the capacity alone, marked
/// off scale, when the axis leaves it out.
fn legend_limits(legend: &mut Legend, r: &SweepReport, on_axis: bool) {
    if r.capacity_bytes == 0 {
        return;
    }
    if on_axis {
        legend.push(
            Key::Line(CAPACITY),
            format!("capacity {}", fmt_bytes(r.capacity_bytes)),
        );
        legend.push(
            Key::Dash(USABLE, USABLE_DASH),
            format!(
                "usable {} ({:.0}% headroom)",
                fmt_bytes(r.usable_bytes()),
                r.headroom * 100.0
            ),
        );
    } else {
        legend.push(
            Key::Heading,
            format!(
                "capacity {} (far above the axis)",
                fmt_bytes(r.capacity_bytes)
            ),
        );
    }
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
    tip: String,
}

/// The pieces of a polyline that lie at or below `top`, each segment
/// crossing it cut where it crosses.
fn clip_below(points: &[(f64, f64)], top: f64) -> Vec<[(f64, f64); 2]> {
    let cut = |a: (f64, f64), b: (f64, f64)| {
        let t = (top - a.1) / (b.1 - a.1);
        (a.0 + t * (b.0 - a.0), top)
    };
    points
        .windows(2)
        .filter_map(|w| {
            let (a, b) = (w[0], w[1]);
            match (a.1 <= top, b.1 <= top) {
                (true, true) => Some([a, b]),
                (true, false) => Some([a, cut(a, b)]),
                (false, true) => Some([cut(a, b), b]),
                (false, false) => None,
            }
        })
        .collect()
}

/// The title across the top and the legend panel on the right, drawn;
/// returns the plot's area.
fn framed<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    caption: &str,
    r: &SweepReport,
    legend: &Legend,
) -> DrawResult<DrawingArea<DB, Shift>>
where
    DB::ErrorType: 'static,
{
    let body = titled(root, caption, r)?;
    let (plot, legend_area) = with_legend(&body, legend);
    legend.draw(&legend_area)?;
    Ok(plot)
}

/// The chart [`xy_chart`] builds over ranges `X` and `Y`.
type XyChart<'a, DB, X, Y> = ChartContext<
    'a,
    DB,
    Cartesian2d<<X as AsRangedCoord>::CoordDescType, <Y as AsRangedCoord>::CoordDescType>,
>;

/// An x-y chart on `plot`, with `y_label_width` pixels for the y labels.
fn xy_chart<'a, DB: DrawingBackend, X: AsRangedCoord, Y: AsRangedCoord>(
    plot: &'a DrawingArea<DB, Shift>,
    y_label_width: u32,
    x: X,
    y: Y,
) -> DrawResult<XyChart<'a, DB, X, Y>>
where
    DB::ErrorType: 'static,
{
    Ok(ChartBuilder::on(plot)
        .margin(10)
        .x_label_area_size(44)
        .y_label_area_size(y_label_width)
        .build_cartesian_2d(x, y)?)
}

/// An axis's description and how its labels are written.
type AxisText<'f> = (String, &'f dyn Fn(&f64) -> String);

/// The grid, the axes' labels and their descriptions.
fn draw_mesh<DB: DrawingBackend, X, Y>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<X, Y>>,
    (x_desc, x_fmt): AxisText,
    (y_desc, y_fmt): AxisText,
) -> DrawResult
where
    DB::ErrorType: 'static,
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(x_fmt)
        .y_label_formatter(y_fmt)
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 16))
        .light_line_style(MESH)
        .draw()?;
    Ok(())
}

/// The capacity, solid, and the usable limit, dashed, each from one end
/// of the plot to the other.
fn draw_limit_lines<DB: DrawingBackend, X, Y>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<X, Y>>,
    capacity: [(f64, f64); 2],
    usable: [(f64, f64); 2],
) -> DrawResult
where
    DB::ErrorType: 'static,
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    chart.draw_series(LineSeries::new(capacity, CAPACITY.stroke_width(2)))?;
    chart.draw_series(DashedLineSeries::new(
        usable,
        USABLE_DASH.0 as u32,
        USABLE_DASH.1 as u32,
        USABLE.stroke_width(2),
    ))?;
    Ok(())
}

/// One line of the memory chart: a combination of the knobs that vary.
struct MemLine {
    key: String,
    colour: RGBColor,
    /// Its dash, an index into [`DASHES`].
    style: usize,
    /// By micro-batch.
    points: Vec<MemPoint>,
}

/// One line per combination of the knobs that vary, in order of first
/// appearance; its colour and dash come from the encoding.
fn memory_lines(
    plotted: &[(&TrialRecord, u64, bool)],
    mbs: &[usize],
    enc: &Encoding,
) -> Vec<MemLine> {
    let all: Vec<Knob> = [&enc.colour[..], &enc.style[..], &enc.rest[..]].concat();
    let mut lines: Vec<MemLine> = Vec::new();
    for &(t, bytes, measured) in plotted {
        let key = combo(&all, &t.point);
        let failed = matches!(t.outcome, Outcome::Oom | Outcome::Timeout | Outcome::Crash);
        let how = match (measured, failed) {
            (true, _) if t.fits => "measured, fits".to_string(),
            (true, _) => "measured, over the usable limit".to_string(),
            (false, true) => format!(
                "predicted; the trial ended: {}",
                super::markdown::outcome_label(t)
            ),
            (false, false) => format!("predicted; {}", super::markdown::outcome_label(t)),
        };
        let point = MemPoint {
            x: mbs.binary_search(&t.point.micro_batch).unwrap_or(0),
            bytes,
            measured,
            failed,
            tip: format!("{}: peak {} ({how})", t.point.label(), fmt_bytes(bytes)),
        };
        match lines.iter_mut().find(|l| l.key == key) {
            Some(line) => line.points.push(point),
            None => lines.push(MemLine {
                key,
                colour: enc.colour(&t.point),
                style: enc.style(&t.point),
                points: vec![point],
            }),
        }
    }
    for line in &mut lines {
        line.points.sort_by_key(|p| p.x);
    }
    lines
}

fn memory_legend(
    r: &SweepReport,
    enc: &Encoding,
    lines: &[MemLine],
    cap_on_axis: bool,
    off_scale: bool,
) -> Legend {
    let mut legend = Legend(Vec::new());
    legend_limits(&mut legend, r, cap_on_axis);
    if lines.is_empty() {
        return legend;
    }
    enc.legend(&mut legend, "line", |i| match DASHES[i] {
        Some(d) => Key::Dash(GREY, d),
        None => Key::Line(GREY),
    });
    legend.push(Key::Heading, "points");
    legend.push(Key::Marker(Shape::Circle, GREY, true), "measured (ran)");
    legend.push(
        Key::Marker(Shape::Circle, GREY, false),
        "predicted (not run)",
    );
    if lines.iter().flat_map(|l| &l.points).any(|p| p.failed) {
        legend.push(Key::Cross(GREY), "predicted (oom / timeout / crash)");
    }
    if off_scale {
        legend.push(
            Key::Marker(Shape::Triangle, GREY, true),
            "above the axis (value in the tooltip)",
        );
    }
    legend
}

fn draw_memory_vs_micro_batch<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    r: &SweepReport,
) -> DrawResult<Vec<Tip>>
where
    DB::ErrorType: 'static,
{
    let plotted: Vec<(&TrialRecord, u64, bool)> = r
        .trials
        .iter()
        .filter_map(|t| plotted_peak(t).map(|(b, m)| (t, b, m)))
        .collect();
    // Micro-batches as categories (they need not be powers of two), in order.
    let mut mbs: Vec<usize> = plotted.iter().map(|t| t.0.point.micro_batch).collect();
    mbs.sort_unstable();
    mbs.dedup();
    let enc = encoding(r);
    let lines = memory_lines(&plotted, &mbs, &enc);

    let capacity = r.capacity_bytes;
    let usable = r.usable_bytes();
    let data_max = plotted.iter().map(|t| t.1).max().unwrap_or(0);
    let (axis_max, cap_on_axis) = memory_axis(data_max, capacity);
    let (div, unit) = byte_unit(axis_max);
    let y_top = axis_top(axis_max as f64 / div, if cap_on_axis { 1.12 } else { 1.1 });
    let off_scale = plotted.iter().any(|t| t.1 as f64 / div > y_top);
    let legend = memory_legend(r, &enc, &lines, cap_on_axis, off_scale);

    let caption = if lines.is_empty() {
        "Peak memory vs micro-batch: no trial has a measured or predicted peak"
    } else {
        Chart::MemoryVsMicroBatch.title()
    };
    let plot = framed(root, caption, r, &legend)?;
    let slots = Slots(mbs.len());
    let (x0, x1) = (slots.range().start, slots.range().end);
    let mut chart = xy_chart(&plot, 64, slots, 0f64..y_top)?;
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
    draw_mesh(
        &mut chart,
        ("micro-batch (sequences per rank per step)".into(), &x_fmt),
        (format!("peak memory per rank ({unit})"), &y_fmt),
    )?;

    let mut limits = Vec::new();
    if capacity > 0 && cap_on_axis {
        let (cap, use_y) = (capacity as f64 / div, usable as f64 / div);
        draw_limit_lines(
            &mut chart,
            [(x0, cap), (x1, cap)],
            [(x0, use_y), (x1, use_y)],
        )?;
        limits.push((
            chart.backend_coord(&(x0, cap)).1,
            format!("capacity {}", fmt_bytes(capacity)),
            CAPACITY,
        ));
        limits.push((
            chart.backend_coord(&(x0, use_y)).1,
            format!("usable {}", fmt_bytes(usable)),
            USABLE,
        ));
    }
    draw_memory_lines(&mut chart, &lines, div, y_top)?;
    let tips = draw_memory_points(root, &chart, &lines, div, y_top)?;
    label_hlines(root, chart.backend_coord(&(x0, 0.0)).0, &limits)?;
    Ok(tips)
}

/// Each line, dashed by its style, cut where it leaves the top of the axis.
fn draw_memory_lines<DB: DrawingBackend>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<Slots, RangedCoordf64>>,
    lines: &[MemLine],
    div: f64,
    y_top: f64,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    for line in lines {
        let c = line.colour;
        let coords: Vec<(f64, f64)> = (line.points.iter())
            .map(|p| (p.x as f64, p.bytes as f64 / div))
            .collect();
        for seg in clip_below(&coords, y_top) {
            match DASHES[line.style] {
                None => {
                    chart.draw_series(LineSeries::new(seg, c.stroke_width(2)))?;
                }
                Some((on, off)) => {
                    chart.draw_series(DashedLineSeries::new(
                        seg,
                        on as u32,
                        off as u32,
                        c.stroke_width(2),
                    ))?;
                }
            }
        }
    }
    Ok(())
}

/// Markers in pixels, on top of every line, with their tooltips: a cross
/// for a failed trial, a triangle on the top edge for one above the axis.
fn draw_memory_points<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    chart: &ChartContext<'_, DB, Cartesian2d<Slots, RangedCoordf64>>,
    lines: &[MemLine],
    div: f64,
    y_top: f64,
) -> DrawResult<Vec<Tip>>
where
    DB::ErrorType: 'static,
{
    let (_, y_px) = chart.plotting_area().get_pixel_range();
    let mut tips = Vec::new();
    for line in lines {
        let c = line.colour;
        for p in &line.points {
            let value = p.bytes as f64 / div;
            let (x, y) = chart.backend_coord(&(p.x as f64, value.min(y_top)));
            if value > y_top {
                let at = (x, y_px.start + 7);
                draw_marker(root, Shape::Triangle, at, 6, c, p.measured)?;
                tips.push(Tip {
                    spot: Spot::Circle {
                        x: at.0,
                        y: at.1,
                        r: 8,
                    },
                    text: format!("{} (above the axis)", p.tip),
                });
                continue;
            }
            if p.failed {
                root.draw(&Cross::new((x, y), 5, c.stroke_width(2)))?;
            } else {
                draw_marker(root, Shape::Circle, (x, y), 5, c, p.measured)?;
            }
            tips.push(Tip {
                spot: Spot::Circle { x, y, r: 7 },
                text: p.tip.clone(),
            });
        }
    }
    Ok(tips)
}

// ---- 2. throughput vs memory ----

/// Where the recommendation's label goes: beside its point on the side
/// with room, inside `[left, right]`; above it unless that leaves the plot.
fn place_label(
    (px, py): (i32, i32),
    w: i32,
    (left, right): (i32, i32),
    top: i32,
) -> ((i32, i32), HPos) {
    let y = if py - 26 - 10 >= top {
        py - 26
    } else {
        py + 26
    };
    if px + 14 + w <= right {
        ((px + 14, y), HPos::Left)
    } else if px - 14 - w >= left {
        ((px - 14, y), HPos::Right)
    } else {
        let lo = left + w / 2;
        let hi = (right - w / 2).max(lo);
        ((px.clamp(lo, hi), y), HPos::Center)
    }
}

fn throughput_legend(r: &SweepReport, ran: &[Ran], enc: &Encoding, cap_on_axis: bool) -> Legend {
    let rec = r.recommendation.as_ref();
    let tied: &[usize] = rec.map_or(&[], |rec| &rec.tied);
    let mut legend = Legend(Vec::new());
    if !ran.is_empty() {
        enc.legend(&mut legend, "shape", |i| Key::Marker(SHAPES[i], GREY, true));
        legend.push(Key::Heading, "marks");
        let fitting = ran.iter().filter(|p| p.fits).count();
        legend.push(
            Key::Marker(Shape::Circle, GREY, true),
            format!("fits ({fitting})"),
        );
        if fitting < ran.len() {
            legend.push(
                Key::Marker(Shape::Circle, GREY, false),
                format!("over the usable limit ({})", ran.len() - fitting),
            );
        }
        legend.push(
            Key::Line(RGBColor(0xaa, 0xaa, 0xaa)),
            "95% interval of tokens/s",
        );
    }
    if !r.pareto.is_empty() {
        legend.push(Key::Line(FRONTIER), "Pareto frontier (fitting)");
    }
    if rec.is_some_and(|rec| ran.iter().any(|p| p.index == rec.trial)) {
        legend.push(Key::Ring(BLACK, 3), "recommended");
    }
    if tied.iter().any(|i| ran.iter().any(|p| p.index == *i)) {
        legend.push(
            Key::Ring(GREY, 2),
            format!("tied with it ({}): intervals overlap", tied.len()),
        );
    }
    legend_limits(&mut legend, r, cap_on_axis);
    legend
}

/// A point's tooltip on the throughput chart.
fn throughput_tip(r: &SweepReport, p: &Ran) -> String {
    let t = &r.trials[p.index];
    let rec = r.recommendation.as_ref();
    let mut text = format!(
        "#{} {}: {} tokens/s (95% {:.0}-{:.0}), peak {}",
        p.index,
        t.point.label(),
        t.measured
            .as_ref()
            .map_or_else(|| "-".into(), super::markdown::tokens_cell),
        p.ci[0],
        p.ci[1],
        fmt_bytes(p.peak)
    );
    if !p.fits {
        text.push_str(", over the usable limit");
    }
    if rec.is_some_and(|rec| rec.trial == p.index) {
        text.push_str(", recommended");
    } else if rec.is_some_and(|rec| rec.tied.contains(&p.index)) {
        text.push_str(", tied with the recommendation");
    }
    text
}

fn draw_throughput_vs_memory<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    r: &SweepReport,
) -> DrawResult<Vec<Tip>>
where
    DB::ErrorType: 'static,
{
    let ran = ran_points(r);
    let enc = encoding(r);
    let capacity = r.capacity_bytes;
    let usable = r.usable_bytes();
    let peak_max = ran.iter().map(|p| p.peak).max().unwrap_or(0);
    // Every trial that ran is on the axis (each ran within the capacity,
    // but its peak plus a GPU's overhead need not).
    let (axis_max, cap_on_axis) = memory_axis(peak_max, capacity);
    let axis_max = axis_max.max(peak_max);
    let (div, unit) = byte_unit(axis_max);
    let x_top = axis_top(axis_max as f64 / div, 1.08);
    let tps_max = ran
        .iter()
        .map(|p| p.tokens_per_s.max(p.ci[1]))
        .fold(0.0, f64::max);
    let y_top = axis_top(tps_max, 1.12);
    let legend = throughput_legend(r, &ran, &enc, cap_on_axis);

    let caption = if ran.is_empty() {
        "Throughput vs measured peak memory: no trial ran"
    } else {
        Chart::ThroughputVsMemory.title()
    };
    let plot = framed(root, caption, r, &legend)?;
    let mut chart = xy_chart(&plot, 70, 0f64..x_top, 0f64..y_top)?;
    let x_fmt = |v: &f64| fmt_amount(*v, x_top);
    let y_fmt = |v: &f64| fmt_si(*v);
    draw_mesh(
        &mut chart,
        (
            format!("measured peak memory per rank ({unit}, tracked)"),
            &x_fmt,
        ),
        (throughput_desc(r), &y_fmt),
    )?;

    let (x_px, y_px) = chart.plotting_area().get_pixel_range();
    let mut label_right = x_px.end - 6;
    let mut limits = Vec::new();
    if capacity > 0 && cap_on_axis {
        let (cap, use_x) = (capacity as f64 / div, usable as f64 / div);
        draw_limit_lines(
            &mut chart,
            [(cap, 0.0), (cap, y_top)],
            [(use_x, 0.0), (use_x, y_top)],
        )?;
        let use_px = chart.backend_coord(&(use_x, 0.0)).0;
        label_right = label_right.min(use_px - 22);
        limits.push((use_px, format!("usable {}", fmt_bytes(usable)), USABLE));
        limits.push((
            chart.backend_coord(&(cap, 0.0)).0,
            format!("capacity {}", fmt_bytes(capacity)),
            CAPACITY,
        ));
    }

    let at = |p: &Ran| (p.peak as f64 / div, p.tokens_per_s);
    draw_intervals_and_frontier(&mut chart, r, &ran, &enc, div)?;
    // The points on top.
    let mut tips = Vec::new();
    for p in &ran {
        let point = &r.trials[p.index].point;
        let px = chart.backend_coord(&at(p));
        let shape = SHAPES[enc.style(point)];
        draw_marker(root, shape, px, 5, enc.colour(point), p.fits)?;
        tips.push(Tip {
            spot: Spot::Circle {
                x: px.0,
                y: px.1,
                r: 7,
            },
            text: throughput_tip(r, p),
        });
    }
    let rec = r.recommendation.as_ref();
    let tied: &[usize] = rec.map_or(&[], |rec| &rec.tied);
    for p in ran.iter().filter(|p| tied.contains(&p.index)) {
        root.draw(&Circle::new(
            chart.backend_coord(&at(p)),
            9,
            GREY.stroke_width(2),
        ))?;
    }
    if let Some(rec) = rec
        && let Some(p) = ran.iter().find(|p| p.index == rec.trial)
    {
        let plot_px = (x_px.start + 6, label_right, y_px.start);
        mark_recommended(
            root,
            r,
            &enc,
            rec.trial,
            chart.backend_coord(&at(p)),
            plot_px,
        )?;
    }
    label_vlines(root, y_px.start, &limits)?;
    Ok(tips)
}

/// Each ran trial's throughput interval, then the Pareto frontier.
fn draw_intervals_and_frontier<DB: DrawingBackend>(
    chart: &mut ChartContext<'_, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    r: &SweepReport,
    ran: &[Ran],
    enc: &Encoding,
    div: f64,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let at = |p: &Ran| (p.peak as f64 / div, p.tokens_per_s);
    for p in ran {
        let x = at(p).0;
        if p.ci[1] > p.ci[0] {
            let c = enc.colour(&r.trials[p.index].point);
            chart.draw_series(LineSeries::new(
                vec![(x, p.ci[0]), (x, p.ci[1])],
                c.mix(0.45).stroke_width(1),
            ))?;
        }
    }
    let mut frontier: Vec<(f64, f64)> = r
        .pareto
        .iter()
        .filter_map(|&i| ran.iter().find(|p| p.index == i))
        .map(at)
        .collect();
    frontier.sort_by(|a, b| a.0.total_cmp(&b.0));
    if !frontier.is_empty() {
        chart.draw_series(LineSeries::new(frontier, FRONTIER.stroke_width(1)))?;
    }
    Ok(())
}

/// Rings the recommended trial at `px` and labels it, inside the plot
/// (`left`, `right`, `top` in pixels) with a leader to the ring.
fn mark_recommended<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    r: &SweepReport,
    enc: &Encoding,
    trial: usize,
    px: (i32, i32),
    (left, right, top): (i32, i32, i32),
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    root.draw(&Circle::new(px, 11, BLACK.stroke_width(3)))?;
    // The knobs the legend does not already state as common to all,
    // shortened further if the plot is too narrow for them.
    let t = &r.trials[trial];
    let varied: Vec<Knob> = [&enc.colour[..], &enc.style[..], &enc.rest[..]].concat();
    let style = text_style(15, &BLACK, HPos::Left, VPos::Center);
    let room = right - left;
    let mut label = String::new();
    let mut w = 0;
    for candidate in [
        format!("recommended: {}", t.point.label()),
        format!(
            "recommended: mb{} {}",
            t.point.micro_batch,
            combo(&varied, &t.point)
        ),
        format!("recommended: #{trial}"),
    ] {
        label = candidate.trim_end().to_string();
        w = root.estimate_text_size(&label, &style)?.0 as i32;
        if w <= room {
            break;
        }
    }
    let (pos, h) = place_label(px, w, (left, right), top);
    // A leader from the ring to the label's nearest edge.
    let end = match h {
        HPos::Left => (pos.0 - 3, pos.1),
        HPos::Right => (pos.0 + 3, pos.1),
        HPos::Center => (pos.0, pos.1 + if pos.1 < px.1 { 11 } else { -11 }),
    };
    root.draw(&PathElement::new(vec![px, end], GREY.stroke_width(1)))?;
    root.draw(&Circle::new(px, 11, BLACK.stroke_width(3)))?;
    label_box(root, &label, pos, h, 15, BLACK)?;
    Ok(())
}

// ---- 3. recommendation breakdown ----

fn category_color(c: Category) -> RGBColor {
    PALETTE[Category::ALL.iter().position(|&x| x == c).unwrap_or(0) % PALETTE.len()]
}

/// One segment of the breakdown bar: label, bytes, colour.
type Segment = (String, u64, RGBColor);

/// The recommended trial's bar: its segments, and whether they are measured. Measured: the split at the moment of the
/// peak (it adds up to the peak) plus the runtime overhead the fit counts;
/// else the predicted total as one segment.
fn breakdown_segments(r: &SweepReport, t: &TrialRecord) -> Option<(Vec<Segment>, bool)> {
    let overhead = (
        "runtime overhead".to_string(),
        r.runtime_overhead_bytes,
        GREY,
    );
    if let Some(m) = &t.measured {
        let mut segs: Vec<_> = Category::ALL
            .iter()
            .map(|&c| (c.name().to_string(), m.peak_split.get(c), category_color(c)))
            .collect();
        segs.push(overhead);
        segs.retain(|s| s.1 > 0);
        return Some((segs, true));
    }
    let p = t.predicted.as_ref()?;
    let segs = vec![(
        "predicted total (no split)".to_string(),
        p.peak_total_bytes,
        PALETTE[9],
    )];
    Some((segs, false))
}

fn draw_recommendation_breakdown<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    r: &SweepReport,
) -> DrawResult<Vec<Tip>>
where
    DB::ErrorType: 'static,
{
    let rec = r
        .recommendation
        .as_ref()
        .and_then(|rec| r.trials.get(rec.trial));
    let bar = rec.and_then(|t| breakdown_segments(r, t));
    let caption = match (rec, &bar) {
        (Some(t), Some((_, true))) => format!("Recommended: {}", t.point.label()),
        (Some(t), Some((_, false))) => format!("Recommended (predicted): {}", t.point.label()),
        (Some(t), None) => format!("Recommended: {} (no peak recorded)", t.point.label()),
        (None, _) => "No fitting trial: nothing to break down".to_string(),
    };
    let segs = bar.as_ref().map_or(&[][..], |b| &b.0[..]);
    let total: u64 = segs.iter().map(|s| s.1).sum();
    let capacity = r.capacity_bytes;
    let usable = r.usable_bytes();
    let (axis_max, cap_on_axis) = memory_axis(total, capacity);
    let (div, unit) = byte_unit(axis_max.max(total));
    let x_top = axis_top(axis_max.max(total) as f64 / div, 1.06);
    let pct = |b: u64| {
        if total > 0 {
            100.0 * b as f64 / total as f64
        } else {
            0.0
        }
    };

    let mut legend = Legend(Vec::new());
    if !segs.is_empty() {
        legend.push(Key::Heading, "live at the moment of the peak");
        for (name, bytes, color) in segs {
            legend.push(
                Key::Swatch(*color),
                format!("{name} {} ({:.0}%)", fmt_bytes(*bytes), pct(*bytes)),
            );
        }
        legend.push(Key::Heading, format!("peak {}", fmt_bytes(total)));
    }
    legend_limits(&mut legend, r, cap_on_axis);

    let plot = framed(root, &caption, r, &legend)?;

    let mut chart = ChartBuilder::on(&plot)
        .margin(10)
        .margin_right(24)
        .x_label_area_size(64)
        .y_label_area_size(12)
        .build_cartesian_2d(0f64..x_top, 0f64..1f64)?;
    let x_fmt = |v: &f64| fmt_amount(*v, x_top);
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .x_desc(format!(
            "{unit} per rank; each segment is what its category held at the moment of the peak"
        ))
        .x_label_formatter(&x_fmt)
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 16))
        .light_line_style(MESH)
        .draw()?;

    let (bar_lo, bar_hi) = (0.32, 0.62);
    let mut tips = Vec::new();
    let mut left = 0u64;
    let inside = text_style(14, &WHITE, HPos::Center, VPos::Center);
    for (name, bytes, color) in segs {
        let (x0, x1) = (left as f64 / div, (left + bytes) as f64 / div);
        left += bytes;
        chart.draw_series(std::iter::once(Rectangle::new(
            [(x0, bar_lo), (x1, bar_hi)],
            color.filled(),
        )))?;
        let (p0, p1) = (
            chart.backend_coord(&(x0, bar_hi)),
            chart.backend_coord(&(x1, bar_lo)),
        );
        // The category's name on the segment when it fits there.
        let (tw, _) = root.estimate_text_size(name, &inside)?;
        if p1.0 - p0.0 >= tw as i32 + 10 {
            root.draw_text(name, &inside, ((p0.0 + p1.0) / 2, (p0.1 + p1.1) / 2))?;
        }
        tips.push(Tip {
            spot: Spot::Rect {
                x0: p0.0,
                y0: p0.1,
                x1: p1.0,
                y1: p1.1,
            },
            text: format!(
                "{name}: {} ({:.0}% of the {} peak)",
                fmt_bytes(*bytes),
                pct(*bytes),
                fmt_bytes(total)
            ),
        });
    }
    if total > 0 {
        let end = total as f64 / div;
        chart.draw_series(std::iter::once(Rectangle::new(
            [(0.0, bar_lo), (end, bar_hi)],
            BLACK.stroke_width(1),
        )))?;
        let (x, y) = chart.backend_coord(&(end, bar_lo));
        root.draw_text(
            &format!("peak {}", fmt_bytes(total)),
            &text_style(14, &BLACK, HPos::Left, VPos::Top),
            (x.max(chart.backend_coord(&(0.0, 0.0)).0) - 2, y + 8),
        )?;
    }
    let mut limits = Vec::new();
    if capacity > 0 && cap_on_axis {
        let (cap, use_x) = (capacity as f64 / div, usable as f64 / div);
        chart.draw_series(LineSeries::new(
            vec![(cap, 0.05), (cap, 0.95)],
            CAPACITY.stroke_width(3),
        ))?;
        chart.draw_series(DashedLineSeries::new(
            vec![(use_x, 0.05), (use_x, 0.95)],
            USABLE_DASH.0 as u32,
            USABLE_DASH.1 as u32,
            USABLE.stroke_width(2),
        ))?;
        let top = chart.backend_coord(&(0.0, 0.95)).1;
        limits.push((
            chart.backend_coord(&(use_x, 0.0)).0,
            format!("usable {}", fmt_bytes(usable)),
            USABLE,
        ));
        limits.push((
            chart.backend_coord(&(cap, 0.0)).0,
            format!("capacity {}", fmt_bytes(capacity)),
            CAPACITY,
        ));
        label_vlines(root, top, &limits)?;
    }
    Ok(tips)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::engine::{Attention, Checkpointing, Optimizer, Precision, Sharding};
    use crate::memory::PeakBytes;
    use crate::report::sweep::{
        ExitInfo, Measured, Predicted, Recommendation, SCHEMA_VERSION, TargetPrediction,
    };

    const MIB: u64 = 1024 * 1024;

    pub(crate) fn point(
        micro_batch: usize,
        checkpointing: Checkpointing,
        optimizer: Optimizer,
    ) -> Point {
        Point {
            micro_batch,
            precision: Precision::Bf16,
            checkpointing,
            attention: Attention::Fused,
            optimizer,
            sharding: Sharding::None,
            gpus: 1,
            grad_accum: 16 / micro_batch,
            ..Point::default()
        }
    }

    pub(crate) fn peaks(total_mib: u64) -> PeakBytes {
        let total = total_mib * MIB;
        PeakBytes {
            total,
            parameters: total / 8,
            gradients: total / 8,
            optimizer: total / 4,
            activations: total / 2,
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

    /// What was live at the moment of the peak: it adds up to the total,
    /// unlike the per-category maxima of [`peaks`].
    fn split(total_mib: u64) -> PeakBytes {
        let total = total_mib * MIB;
        let mut s = PeakBytes {
            total,
            parameters: total / 8,
            gradients: total / 8,
            optimizer: total / 4,
            activations: total / 3,
            ..Default::default()
        };
        s.temporaries = total - Category::ALL.iter().map(|&c| s.get(c)).sum::<u64>();
        s
    }

    fn measured(total_mib: u64, tokens_per_s: f64) -> Option<Measured> {
        let mut m = Measured::for_tests(peaks(total_mib), tokens_per_s);
        m.peak_split = split(total_mib);
        m.tokens_per_s_ci = [tokens_per_s * 0.9, tokens_per_s * 1.05];
        Some(m)
    }

    pub(crate) fn trial(p: Point, outcome: Outcome, fits: bool) -> TrialRecord {
        TrialRecord {
            id: format!("t-{}-{}", p.micro_batch, name(p.checkpointing)),
            numerics_changes: p.numerics_changes().iter().map(|s| s.to_string()).collect(),
            point: p,
            outcome,
            fits,
            predicted: None,
            measured: None,
            memory_error_pct: None,
            time_ratio: None,
            nvml_error_pct: None,
            target: None,
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
            t.time_ratio = Some(0.89);
            t.target = Some(TargetPrediction {
                peak_total_bytes: (mib + 768) * MIB,
                fits: mib < 40,
                step_s: 0.01,
                tokens_per_s: tps * 30.0,
                usd_per_mtok: 0.53 / 3600.0 / (tps * 30.0) * 1e6,
                framework: Default::default(),
            });
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
        t.time_ratio = Some(1.03);
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
            model_file: None,
            hardware: "cpu-test".into(),
            hardware_file: None,
            network: None,
            attention_kernel: None,
            host_memory: None,
            device: "cpu:limit=64MiB".into(),
            capacity_bytes: 64 * MIB,
            runtime_overhead_bytes: 0,
            headroom: 0.05,
            allow_numerics_change: true,
            lora: None,
            hf_knobs: None,
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
                tied: vec![4],
                ranking: None,
            }),
            pareto: vec![0, 1, 4, 2],
            interrupted: false,
            nvml: None,
            ..SweepReport::empty_for_tests()
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
        // Both roles in every chart, and the host is not called a GPU.
        for (_, svg) in &svgs {
            assert!(
                svg.contains(
                    "tiny-gpt \u{2014} run on cpu:limit=64MiB (emulated), target NVIDIA T4 16GB"
                ),
                "roles line missing"
            );
        }
        assert!(svgs[1].1.contains("tokens/s measured on this host"));
        assert!(!svgs[1].1.contains("GPU(s)"));
        // The SVG text names a family the browser can match to the PNG's font.
        assert!(
            svgs[0]
                .1
                .contains("font-family=\"DejaVu Sans, sans-serif\"")
        );
    }

    #[test]
    fn points_carry_tooltips_naming_their_configuration() {
        let report = synthetic_report();
        let svgs = svg_strings(&report);
        let rec = escape(&report.trials[2].point.label());
        let tp = &svgs[1].1;
        assert!(tp.contains("<g class=\"tips\""), "no tooltip layer");
        assert!(
            tp.contains(&format!("<title>#2 {rec}: 21000 ±")),
            "recommended point's tooltip"
        );
        assert!(tp.contains("peak 48.00 MiB, recommended</title>"));
        assert!(tp.contains("tied with the recommendation</title>"));
        assert!(tp.contains("over the usable limit</title>"));
        // One tooltip per ran trial.
        let ran = report
            .trials
            .iter()
            .filter(|t| t.outcome == Outcome::Ran)
            .count();
        assert_eq!(tp.matches("<title>").count(), ran);
        // The memory chart: the 400 MiB prediction sits on the top edge.
        assert!(svgs[0].1.contains(
            "peak 400.00 MiB (predicted; skipped: predicted OOM) (above the axis)</title>"
        ));
        // The breakdown: one per segment.
        assert!(
            svgs[2]
                .1
                .contains("<title>activations: 16.00 MiB (33% of the 48.00 MiB peak)</title>")
        );
    }

    #[test]
    fn points_are_coloured_and_shaped_by_the_knobs_that_vary() {
        // The quickstart grid: four knobs of two values each.
        let mut points = Vec::new();
        for precision in [Precision::Fp32, Precision::Bf16] {
            for optimizer in [Optimizer::Adamw, Optimizer::Adamw8bit] {
                for checkpointing in [Checkpointing::None, Checkpointing::Full] {
                    for attention in [Attention::Eager, Attention::Fused] {
                        points.push(Point {
                            precision,
                            optimizer,
                            checkpointing,
                            attention,
                            ..point(4, checkpointing, optimizer)
                        });
                    }
                }
            }
        }
        let enc = Encoding::new(points.iter());
        assert_eq!(enc.colour, [Knob::Precision, Knob::Optimizer]);
        assert_eq!(
            enc.colours,
            [
                "fp32 adamw",
                "fp32 adamw8bit",
                "bf16 adamw",
                "bf16 adamw8bit"
            ]
        );
        assert_eq!(enc.style, [Knob::Checkpointing, Knob::Attention]);
        assert!(enc.rest.is_empty());
        let constant: Vec<&str> = enc.constant.iter().map(|c| c.1.as_str()).collect();
        assert_eq!(constant, ["none", "x1"]);
        // Every configuration gets its own colour and shape pair.
        let mut pairs: Vec<(usize, usize)> = points
            .iter()
            .map(|p| (enc.colour_index(p), enc.style(p)))
            .collect();
        pairs.sort_unstable();
        pairs.dedup();
        assert_eq!(pairs.len(), 16);

        // The synthetic sweep varies optimizer with checkpointing (two
        // combinations): one colour channel, named in the legend.
        let report = synthetic_report();
        let svg = &svg_strings(&report)[1].1;
        // plotters writes each text on its own line.
        for want in [
            "\ncolour: optimizer / checkpointing\n",
            "\nadamw ckpt:none\n",
            "\nadamw8bit ckpt:full\n",
            "\nthe same in every trial:\n",
            "precision bf16\n",
            "\ntied with it (1): intervals overlap\n",
        ] {
            assert!(svg.contains(want), "legend lacks {want:?}");
        }
    }

    #[test]
    fn breakdown_stacks_the_split_at_the_peak() {
        let mut report = synthetic_report();
        let t = &report.trials[2];
        let m = t.measured.as_ref().unwrap();
        let (segs, measured) = breakdown_segments(&report, t).unwrap();
        assert!(measured);
        let sum: u64 = segs.iter().map(|s| s.1).sum();
        assert_eq!(sum, m.peak_bytes.total, "the bar is as long as the peak");
        // The per-category maxima would overshoot it.
        let maxima: u64 = Category::ALL.iter().map(|&c| m.peak_bytes.get(c)).sum();
        assert!(maxima > m.peak_bytes.total);
        let act = segs.iter().find(|s| s.0 == "activations").unwrap();
        assert_eq!(act.1, m.peak_split.activations);

        // On a GPU capacity the runtime overhead is part of the fit, so of the bar.
        report.runtime_overhead_bytes = 3 * MIB;
        let (segs, _) = breakdown_segments(&report, &report.trials[2]).unwrap();
        assert_eq!(segs.last().unwrap().0, "runtime overhead");
        assert_eq!(
            segs.iter().map(|s| s.1).sum::<u64>(),
            m.peak_bytes.total + 3 * MIB
        );
    }

    #[test]
    fn memory_axes_end_at_the_capacity() {
        // 63 MiB predicted on a 24 MiB device: the axis stops at the capacity.
        assert_eq!(memory_axis(63 * MIB, 24 * MIB), (24 * MIB, true));
        assert_eq!(memory_axis(10 * MIB, 24 * MIB), (24 * MIB, true));
        // An unlimited host: the capacity would flatten the data; it is named instead.
        assert_eq!(memory_axis(10 * MIB, 100 << 30), (10 * MIB, false));
        assert_eq!(memory_axis(10 * MIB, 0), (10 * MIB, false));

        // Lines into points above the axis stop at its top edge.
        let segs = clip_below(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0), (3.0, 1.0)], 2.0);
        assert_eq!(
            segs,
            vec![[(0.0, 1.0), (0.5, 2.0)], [(2.75, 2.0), (3.0, 1.0)]]
        );
    }

    /// A point past the capacity line still lands on the plot, not on the
    /// legend beside it.
    #[test]
    fn every_ran_trial_is_on_the_throughput_axis() {
        let mut report = synthetic_report();
        report.capacity_bytes = 40 * MIB;
        let svg = &svg_strings(&report)[1].1;
        let tips = &svg[svg.find("<g class=\"tips\"").unwrap()..];
        let xs: Vec<i32> = tips
            .split("<circle cx=\"")
            .skip(1)
            .map(|c| c[..c.find('"').unwrap()].parse().unwrap())
            .collect();
        assert_eq!(xs.len(), 5);
        let legend_left = WIDTH as i32 - 150;
        assert!(xs.iter().all(|&x| x < legend_left), "{xs:?}");
    }

    #[test]
    fn the_recommendation_label_stays_inside_the_plot() {
        let bounds = (100, 700);
        for px in [110, 400, 690] {
            let ((x, _), h) = place_label((px, 300), 380, bounds, 50);
            let (lo, hi) = match h {
                HPos::Left => (x, x + 380),
                HPos::Right => (x - 380, x),
                HPos::Center => (x - 190, x + 190),
            };
            assert!(lo >= bounds.0 && hi <= bounds.1, "{px}: {lo}..{hi}");
        }
        // Near the top edge it goes below the point.
        assert_eq!(place_label((400, 60), 100, bounds, 50).0.1, 86);
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
