//! The state of `memfit tui` and its pure update function.
//!
//! Nothing here reads a clock, the environment or the terminal: the front end
//! turns terminal input and sweep progress into [`Event`]s, feeds them to
//! [`update`], carries out the [`Action`]s it returns, and draws with
//! [`crate::tui::render::render`]. Same events in, same state out.

use std::cmp::Ordering;
use std::path::PathBuf;

use crate::memory::PeakBytes;
use crate::plan::{Point, Prediction, Verdict};
use crate::report::sweep::{Outcome, SweepReport, TargetPrediction, TrialRecord};

/// Samples kept per trial for its chart. Past it, neighbouring samples are
/// merged pairwise (the higher one kept), so the chart still spans the
/// whole trial and never loses its peak.
pub const MAX_SAMPLES: usize = 2000;
/// Rows moved by PageUp / PageDown in the grid (and lines scrolled in a
/// page view before the front end has told the screen's size).
pub const PAGE: usize = 10;
/// How far a page view scrolls before the front end has told the screen's
/// size.
const MAX_SCROLL: u16 = 1000;

/// Where a grid point stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    Queued,
    Running,
    /// Ran, and its peak is within the usable capacity.
    Fit,
    /// Ran, but its peak is above the usable capacity (capacity less headroom).
    Over,
    Oom,
    Timeout,
    Crash,
    /// The plan predicts it does not fit, so the sweep will not run it
    /// (it becomes `SkippedPredicted` when the sweep records that).
    PlannedSkip,
    SkippedPredicted,
    SkippedMonotonic,
    Invalid,
}

impl Status {
    /// How the status reads in the grid.
    pub fn label(self) -> &'static str {
        match self {
            Status::Queued => "queued",
            Status::Running => "running",
            Status::Fit => "fit",
            Status::Over => "over",
            Status::Oom => "OOM",
            Status::Timeout => "timeout",
            Status::Crash => "crash",
            Status::PlannedSkip | Status::SkippedPredicted => "skip: pred OOM",
            Status::SkippedMonotonic => "skip: inferred",
            Status::Invalid => "invalid",
        }
    }

    /// The status a finished trial's record stands for.
    pub fn from_record(r: &TrialRecord) -> Status {
        match r.outcome {
            Outcome::Ran if r.fits => Status::Fit,
            Outcome::Ran => Status::Over,
            Outcome::Oom => Status::Oom,
            Outcome::Timeout => Status::Timeout,
            Outcome::Crash => Status::Crash,
            Outcome::SkippedPredictedOom => Status::SkippedPredicted,
            Outcome::SkippedByMonotonicity => Status::SkippedMonotonic,
            Outcome::Invalid => Status::Invalid,
        }
    }

    /// Settled: neither waiting nor running (a planned skip waits for the
    /// sweep to record it).
    pub fn is_done(self) -> bool {
        !matches!(self, Status::Queued | Status::Running | Status::PlannedSkip)
    }

    /// Whether the sweep runs (or ran) this trial: not one it skips or
    /// refuses.
    pub fn will_run(self) -> bool {
        !matches!(
            self,
            Status::PlannedSkip
                | Status::SkippedPredicted
                | Status::SkippedMonotonic
                | Status::Invalid
        )
    }

    /// Order of the status sort column: the interesting first.
    fn rank(self) -> u8 {
        match self {
            Status::Running => 0,
            Status::Fit => 1,
            Status::Over => 2,
            Status::Oom => 3,
            Status::Timeout => 4,
            Status::Crash => 5,
            Status::Queued => 6,
            Status::PlannedSkip | Status::SkippedPredicted => 7,
            Status::SkippedMonotonic => 8,
            Status::Invalid => 9,
        }
    }
}

/// One grid point.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The point's index in the planned grid (what the sweep's events name).
    pub index: usize,
    pub point: Point,
    /// The planner's peak per GPU, runtime overhead included.
    pub predicted_total_bytes: Option<u64>,
    pub predicted_tokens_per_s: Option<f64>,
    /// The planner's per-category peaks, for the breakdown before the trial runs.
    pub predicted_peak_bytes: Option<PeakBytes>,
    /// The hardware's runtime overhead on top of the engine's peak (0 on cpu).
    pub overhead_bytes: u64,
    /// The plan for this configuration on the target GPU, before the trial
    /// runs (the record carries it afterwards).
    pub planned_target: Option<TargetPrediction>,
    pub record: Option<TrialRecord>,
    pub status: Status,
    /// Its live memory while it ran in this session (a re-run starts over).
    pub samples: Vec<Sample>,
}

impl Row {
    /// A row from the grid index, the point, the predicted total peak and
    /// tokens/s, and the initial status (no per-category prediction, no
    /// overhead; set the public fields for those).
    pub fn new(
        index: usize,
        point: Point,
        predicted_total_bytes: Option<u64>,
        predicted_tokens_per_s: Option<f64>,
        status: Status,
    ) -> Row {
        Row {
            index,
            point,
            predicted_total_bytes,
            predicted_tokens_per_s,
            predicted_peak_bytes: None,
            overhead_bytes: 0,
            planned_target: None,
            record: None,
            status,
            samples: Vec::new(),
        }
    }

    /// A row from the planner's prediction for grid point `index`: queued,
    /// a planned skip when the plan says it does not fit (the sweep never
    /// runs those: `sweep::driver`'s selection starts at the largest
    /// micro-batch predicted to fit and only goes down), or invalid when
    /// the planner says so. (Set `planned_target` for the plan on the
    /// target GPU.)
    pub fn from_prediction(index: usize, p: &Prediction) -> Row {
        Row {
            index,
            point: p.point,
            predicted_total_bytes: p.peak_bytes.map(|_| p.total_bytes),
            predicted_tokens_per_s: p.peak_bytes.map(|_| p.tokens_per_s),
            predicted_peak_bytes: p.peak_bytes,
            overhead_bytes: p.runtime_overhead_bytes,
            planned_target: None,
            record: None,
            status: match p.verdict {
                Verdict::Invalid { .. } => Status::Invalid,
                Verdict::DoesNotFit => Status::PlannedSkip,
                Verdict::Fits => Status::Queued,
            },
            samples: Vec::new(),
        }
    }

    /// The label the filter matches: the point's label, its status and `#index`.
    pub fn search_text(&self) -> String {
        // What the grid shows of the row, and nothing it hides: the knobs
        // cell (`ckpt` only under checkpointing), `mb` and the status, so
        // `/ckpt` finds the checkpointed rows and no others.
        let extra = if self.status == Status::Fit {
            " fits"
        } else {
            ""
        };
        format!(
            "#{} {} mb{} {}{}",
            self.index,
            crate::tui::render::knobs(&self.point),
            self.point.micro_batch,
            self.status.label(),
            extra
        )
        .to_lowercase()
    }

    /// Predicted peak per GPU: the record's, else the plan's.
    pub fn predicted_total(&self) -> Option<u64> {
        self.record
            .as_ref()
            .and_then(|r| r.predicted.as_ref())
            .map(|p| p.peak_total_bytes)
            .or(self.predicted_total_bytes)
    }

    /// Predicted per-category peaks: the record's, else the plan's.
    pub fn predicted_peaks(&self) -> Option<PeakBytes> {
        self.record
            .as_ref()
            .and_then(|r| r.predicted.as_ref())
            .and_then(|p| p.peak_bytes)
            .or(self.predicted_peak_bytes)
    }

    /// The runtime overhead on top of the engine peak: what the record's
    /// prediction added, else the plan's.
    pub fn overhead(&self) -> u64 {
        self.record
            .as_ref()
            .and_then(|r| r.predicted.as_ref())
            .and_then(|p| {
                p.peak_bytes
                    .map(|b| p.peak_total_bytes.saturating_sub(b.total))
            })
            .unwrap_or(self.overhead_bytes)
    }

    /// The measured engine peak (the tracker's total), if it ran.
    pub fn measured_engine(&self) -> Option<u64> {
        self.record
            .as_ref()
            .and_then(|r| r.measured.as_ref())
            .map(|m| m.peak_bytes.total)
    }

    /// The measured peak per GPU against the capacity: engine peak plus overhead.
    pub fn measured_total(&self) -> Option<u64> {
        self.measured_engine().map(|b| b + self.overhead())
    }

    fn measured(&self) -> Option<&crate::report::sweep::Measured> {
        self.record.as_ref().and_then(|r| r.measured.as_ref())
    }

    /// Median measured tokens/s.
    pub fn tokens_per_s(&self) -> Option<f64> {
        self.measured().map(|m| m.tokens_per_s)
    }

    pub fn usd_per_mtok(&self) -> Option<f64> {
        self.measured().and_then(|m| m.usd_per_mtok)
    }

    /// What the recommendation ranks by: $ per million tokens when priced,
    /// else host seconds per million tokens (`sweep::driver::cost_of`).
    pub fn cost(&self) -> Option<f64> {
        self.record
            .as_ref()
            .and_then(crate::sweep::driver::cost_of)
            .map(|c| c.0)
    }

    /// Measured / predicted median step time.
    pub fn time_ratio(&self) -> Option<f64> {
        self.record.as_ref().and_then(|r| r.time_ratio)
    }

    /// The plan on the target GPU: the record's, else the one made before
    /// the trial.
    pub fn target(&self) -> Option<&TargetPrediction> {
        self.record
            .as_ref()
            .and_then(|r| r.target.as_ref())
            .or(self.planned_target.as_ref())
    }

    /// The margin: usable capacity (capacity x (1 - headroom)) less the
    /// peak per GPU, signed (negative: over), with whether the peak is the
    /// predicted one (the trial has not run). The one definition the grid,
    /// the detail and the recommendation share.
    pub fn margin(&self, usable: u64) -> Option<(i64, bool)> {
        match self.measured_total() {
            Some(m) => Some((usable as i64 - m as i64, false)),
            None => self
                .predicted_total()
                .map(|p| (usable as i64 - p as i64, true)),
        }
    }
}

/// One live-memory sample of the running trial.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// Seconds since the trial started.
    pub t_s: f64,
    /// Tracked bytes live.
    pub tracked: u64,
    /// The trial process's resident set size.
    pub rss: Option<u64>,
    /// The trial process's GPU memory per NVML (GPU sweeps with NVML).
    pub nvml: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum View {
    Grid,
    Detail,
    Help,
    /// The recommendation in full: its reasons, the tie, the frontier.
    Why,
}

/// What the chart panel shows where there is room for one chart only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChartKind {
    /// The selected trial's memory over its run, against the capacity.
    Memory,
    /// Tokens/s of each finished trial, in the order they finished.
    Throughput,
}

/// Trials by where they stand, for the progress counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Ran to an outcome (fit, over, OOM, timeout, crash).
    pub ran: usize,
    /// That the sweep runs: all but the skipped and invalid ones.
    pub to_run: usize,
    /// That it skips (predicted OOM, inferred) or refuses (invalid).
    pub skipped: usize,
}

/// The grid's sort column; `s` cycles through them in this order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SortColumn {
    Index,
    Knobs,
    MicroBatch,
    Status,
    Predicted,
    Measured,
    Margin,
    TokensPerS,
    TimeRatio,
    /// $/Mtok when priced, else host seconds per Mtok.
    Cost,
    /// The peak planned on the target GPU.
    Target,
}

impl SortColumn {
    /// In the grid's column order.
    pub const ALL: [SortColumn; 11] = [
        SortColumn::Index,
        SortColumn::Knobs,
        SortColumn::MicroBatch,
        SortColumn::Status,
        SortColumn::Predicted,
        SortColumn::Measured,
        SortColumn::Margin,
        SortColumn::TokensPerS,
        SortColumn::TimeRatio,
        SortColumn::Cost,
        SortColumn::Target,
    ];

    pub fn next(self) -> SortColumn {
        let i = Self::ALL.iter().position(|&c| c == self).unwrap_or(0);
        Self::ALL[(i + 1) % Self::ALL.len()]
    }

    pub fn prev(self) -> SortColumn {
        let i = Self::ALL.iter().position(|&c| c == self).unwrap_or(0);
        Self::ALL[(i + Self::ALL.len() - 1) % Self::ALL.len()]
    }

    /// The grid header this column sorts; the cost column's depends on the
    /// pricing (`sweep::markdown::cost_heading`).
    pub fn label(self, report: &SweepReport) -> &'static str {
        match self {
            SortColumn::Index => "#",
            SortColumn::Knobs => "knobs",
            SortColumn::MicroBatch => "mb",
            SortColumn::Status => "status",
            SortColumn::Predicted => "predicted",
            SortColumn::Measured => "measured",
            SortColumn::Margin => "margin",
            SortColumn::TokensPerS => "tok/s",
            SortColumn::TimeRatio => "time x",
            SortColumn::Cost => crate::sweep::markdown::cost_heading(report),
            SortColumn::Target => "on target",
        }
    }
}

/// What the front end knows before the first trial: the sweep's header.
#[derive(Clone, Debug, PartialEq)]
pub struct Header {
    pub model: String,
    /// The target GPU's display name: what the plan predicts for, not where
    /// trials run.
    pub hardware: String,
    /// Where trials run (`base.run_device.spec`).
    pub device: String,
    /// The run device's capacity, which trials are judged against (an
    /// emulated limit on cpu), and capacity x (1 - headroom).
    pub capacity: u64,
    pub usable: u64,
    pub headroom: f64,
    pub allow_numerics_change: bool,
    pub seq_len: usize,
    pub global_batch: usize,
    /// Where `e` exports to.
    pub export_dir: PathBuf,
    /// Draw without colours (NO_COLOR; the front end reads the environment).
    pub no_color: bool,
    /// How often the running trial is sampled, for display.
    pub sample_interval_ms: u64,
    /// The sweep's report before any trial: run device, target, pricing,
    /// calibration and timing policy, as the reports carry them.
    pub base: SweepReport,
}

/// The whole state of the TUI.
#[derive(Clone, Debug, PartialEq)]
pub struct App {
    /// The sweep's header, as the front end gave it.
    pub header: Header,
    /// One per grid point, in grid order.
    pub rows: Vec<Row>,
    /// Position in [`visible`] (the sorted, filtered list).
    pub selected: usize,
    pub sort: SortColumn,
    pub reverse: bool,
    /// Case-insensitive; every whitespace-separated word must be a substring
    /// of the row's [`Row::search_text`].
    pub filter: String,
    pub fits_only: bool,
    pub editing_filter: bool,
    pub view: View,
    /// Lines the page view (detail, help, recommendation) is scrolled down.
    pub scroll: u16,
    /// The terminal's size (columns, rows) as the front end last told it;
    /// (0, 0) before it has. Scrolling stops at the last page with it.
    pub viewport: (u16, u16),
    /// The chart panel's choice where only one chart fits (`t` switches).
    pub chart: ChartKind,
    pub paused: bool,
    /// Grid index of the running trial.
    pub running: Option<usize>,
    /// Grid index of the trial that started last: while the selection is on
    /// it, the selection follows the sweep to the next one.
    pub last_started: Option<usize>,
    /// Grid indices of the trials with a measured throughput, in the order
    /// they finished (a re-run moves to the end): the throughput chart's x.
    pub finish_order: Vec<usize>,
    pub elapsed_s: f64,
    pub finished: bool,
    pub message: Option<String>,
    /// Grid index of the recommended trial, its reasons and the runner-up.
    pub recommendation: Option<usize>,
    pub reasons: Vec<String>,
    pub runner_up: Option<usize>,
    /// Grid indices of the fitting trials the measurements cannot tell
    /// apart from the recommendation (the recommendation's `tied`).
    pub tied: Vec<usize>,
    /// Grid indices on the Pareto frontier (peak lower, tokens/s higher).
    pub pareto: Vec<usize>,
    /// The GPUs as NVML last saw them, or why there is nothing to show
    /// (set only on a GPU run device or where NVML answers).
    pub gpu: Option<GpuView>,
}

/// What the GPU panel shows.
#[derive(Clone, Debug, PartialEq)]
pub enum GpuView {
    Snapshot(crate::telemetry::Snapshot),
    /// "no NVML: <why>".
    Missing(String),
}

impl App {
    /// The state before any trial ran: `rows` one per grid point (see
    /// [`Row::new`], which takes (grid index, point, predicted total,
    /// predicted tokens/s, initial status), and [`Row::from_prediction`]).
    /// Rows that already carry records (a resumed sweep) count towards the
    /// recommendation.
    pub fn new(header: Header, rows: Vec<Row>) -> App {
        let mut app = App {
            header,
            rows,
            selected: 0,
            sort: SortColumn::Index,
            reverse: false,
            filter: String::new(),
            fits_only: false,
            editing_filter: false,
            view: View::Grid,
            scroll: 0,
            viewport: (0, 0),
            chart: ChartKind::Memory,
            paused: false,
            running: None,
            last_started: None,
            finish_order: Vec::new(),
            elapsed_s: 0.0,
            finished: false,
            message: None,
            recommendation: None,
            reasons: Vec::new(),
            runner_up: None,
            tied: Vec::new(),
            pareto: Vec::new(),
            gpu: None,
        };
        // A resumed sweep's trials finished before this session, in grid order.
        app.finish_order = app
            .rows
            .iter()
            .filter(|r| r.tokens_per_s().is_some())
            .map(|r| r.index)
            .collect();
        app.recompute_recommendation();
        app
    }

    /// Position in `rows` of grid point `index`.
    pub fn row_of(&self, index: usize) -> Option<usize> {
        self.rows.iter().position(|r| r.index == index)
    }

    /// The selected row, if any row is visible.
    pub fn selected_row(&self) -> Option<&Row> {
        visible(self).get(self.selected).map(|&i| &self.rows[i])
    }

    /// Trials run of those the sweep runs, and how many it skips: the
    /// counter counts only what will take time.
    pub fn progress(&self) -> Progress {
        let to_run = self.rows.iter().filter(|r| r.status.will_run()).count();
        Progress {
            ran: self
                .rows
                .iter()
                .filter(|r| r.status.will_run() && r.status.is_done())
                .count(),
            to_run,
            skipped: self.rows.len() - to_run,
        }
    }

    /// A sweep report of what the screen shows so far (for exports and the
    /// recommendation), recommended with the sweep's own rule.
    pub fn report(&self) -> SweepReport {
        let trials: Vec<TrialRecord> = self.rows.iter().filter_map(|r| r.record.clone()).collect();
        let trials_run = trials
            .iter()
            .filter(|t| t.measured.is_some() || t.exit.is_some())
            .count();
        let mut report = SweepReport {
            grid_size: self.rows.len(),
            trials_run,
            trials,
            recommendation: None,
            pareto: Vec::new(),
            interrupted: !self.finished,
            nvml: self.header.base.nvml.clone(),
            ..self.header.base.clone()
        };
        crate::sweep::driver::recommend(&mut report);
        report
    }

    /// Rebuilds the recommendation from the rows' records with the sweep's own rule.
    pub fn recompute_recommendation(&mut self) {
        // `report` keeps the rows that have records, in row order.
        let with: Vec<usize> = (0..self.rows.len())
            .filter(|&i| self.rows[i].record.is_some())
            .collect();
        let report = self.report();
        let grid = |t: usize| self.rows[with[t]].index;
        self.pareto = report.pareto.iter().map(|&t| grid(t)).collect();
        match report.recommendation {
            Some(rec) => {
                self.recommendation = Some(grid(rec.trial));
                self.runner_up = rec.runners_up.first().map(|&t| grid(t));
                self.tied = rec.tied.iter().map(|&t| grid(t)).collect();
                self.reasons = rec.reasons;
            }
            None => {
                self.recommendation = None;
                self.runner_up = None;
                self.tied.clear();
                self.reasons.clear();
            }
        }
    }
}

/// A key press, as the front end translates it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Key {
    Char(char),
    Up,
    Down,
    Left,
    Right,
    Enter,
    Esc,
    Backspace,
    Tab,
    PageUp,
    PageDown,
    Home,
    End,
    CtrlC,
}

/// Everything that changes the state. (A record travels once per trial, so
/// it is not boxed.)
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Key(Key),
    /// Seconds since the sweep started.
    Tick {
        elapsed_s: f64,
    },
    TrialStarted {
        index: usize,
    },
    Sample(Sample),
    TrialFinished {
        index: usize,
        record: TrialRecord,
    },
    SweepFinished,
    /// The sweep's final report: its recommendation, as report.json holds
    /// it, replaces the one the TUI kept as trials came in (the sweep adds
    /// how the trials were ranked).
    Ranked(Box<crate::report::sweep::SweepReport>),
    /// NVML's newest snapshot of the GPUs (or why there is none).
    Gpu(GpuView),
    /// The export started by [`Action::Export`] ended.
    Exported(Result<PathBuf, String>),
    /// The terminal's size, in columns and rows (at the start and on every
    /// change): where a page view's last page is.
    Resize {
        width: u16,
        height: u16,
    },
}

/// What the front end must do after an update.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    Quit,
    /// `paused` has flipped: stop (or resume) starting new trials.
    TogglePause,
    /// Run grid point `usize` again.
    Rerun(usize),
    /// Write the reports into this directory; answer with [`Event::Exported`].
    Export(PathBuf),
    /// Stop the sweep and go back to the grid builder, on this grid.
    Back,
}

/// The keys; the help view is generated from this table.
pub const KEYMAP: &[(&str, &str)] = &[
    (
        "q  Esc  Ctrl-C",
        "quit (Esc and q close help, detail, the recommendation or the filter first)",
    ),
    ("?", "this help"),
    (
        "↑ ↓  k j",
        "move the selection (help and recommendation: scroll a line)",
    ),
    (
        "PgUp PgDn",
        "move by a page (detail, help and recommendation: scroll a page)",
    ),
    (
        "Home End  g G",
        "first / last row (help and recommendation: top / end)",
    ),
    (
        "← →  h l",
        "previous / next sort column (detail: previous / next row)",
    ),
    ("Enter  Tab", "open / close the selected trial's detail"),
    (
        "w",
        "why: the recommendation with all its reasons, the tie and the frontier",
    ),
    (
        "t",
        "switch the chart between the selected trial's memory and tokens/s per finished trial (both show on a large screen)",
    ),
    ("s", "cycle the sort column"),
    ("S", "reverse the sort"),
    (
        "/",
        "edit the filter: words of the label, e.g. zero2 adamw8bit (Enter/Esc ends)",
    ),
    ("f", "show only the trials that fit"),
    (
        "Space",
        "pause / resume the sweep (the running trial finishes)",
    ),
    ("r", "re-run the selected trial"),
    ("e", "export the reports"),
    (
        "b",
        "back to the grid builder on this grid (the sweep stops; its journal is kept)",
    ),
];

/// `a` against `b` in the column's direction (`desc`: largest first), with
/// an empty cell after every value whichever the direction, as htop and
/// bottom sort.
fn cmp_opt<T: PartialOrd>(a: Option<T>, b: Option<T>, desc: bool) -> Ordering {
    match (a, b) {
        (Some(x), Some(y)) => {
            let o = x.partial_cmp(&y).unwrap_or(Ordering::Equal);
            if desc { o.reverse() } else { o }
        }
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => Ordering::Equal,
    }
}

/// Whether the sort column shows its largest values first: tokens/s and
/// margin do unless reversed (`S`), the others do when reversed. The
/// header's arrow says which: ▼ largest first, ▲ smallest first.
pub fn descending(app: &App) -> bool {
    matches!(app.sort, SortColumn::TokensPerS | SortColumn::Margin) != app.reverse
}

fn knobs_key(p: &Point) -> (usize, String, String, String, String, String, usize) {
    use crate::plan::name;
    (
        p.gpus,
        name(p.sharding),
        name(p.precision),
        name(p.optimizer),
        name(p.checkpointing),
        name(p.attention),
        p.micro_batch,
    )
}

fn compare(app: &App, a: &Row, b: &Row) -> Ordering {
    let d = descending(app);
    let c = match app.sort {
        SortColumn::Index => cmp_opt(Some(a.index), Some(b.index), d),
        SortColumn::Knobs => cmp_opt(Some(knobs_key(&a.point)), Some(knobs_key(&b.point)), d),
        SortColumn::MicroBatch => cmp_opt(Some(a.point.micro_batch), Some(b.point.micro_batch), d),
        SortColumn::Status => cmp_opt(Some(a.status.rank()), Some(b.status.rank()), d),
        SortColumn::Predicted => cmp_opt(a.predicted_total(), b.predicted_total(), d),
        SortColumn::Measured => cmp_opt(a.measured_total(), b.measured_total(), d),
        SortColumn::Margin => cmp_opt(
            a.margin(app.header.usable).map(|m| m.0),
            b.margin(app.header.usable).map(|m| m.0),
            d,
        ),
        SortColumn::TokensPerS => cmp_opt(a.tokens_per_s(), b.tokens_per_s(), d),
        SortColumn::TimeRatio => cmp_opt(a.time_ratio(), b.time_ratio(), d),
        SortColumn::Cost => cmp_opt(a.cost(), b.cost(), d),
        SortColumn::Target => cmp_opt(
            a.target().map(|t| t.peak_total_bytes),
            b.target().map(|t| t.peak_total_bytes),
            d,
        ),
    };
    c.then(a.index.cmp(&b.index))
}

/// Positions in `app.rows` in display order: filtered, then sorted (ties by
/// grid index). Tokens/s and margin sort the largest first, the rest the
/// smallest first, `reverse` flips that; empty cells sort last either way.
pub fn visible(app: &App) -> Vec<usize> {
    let words: Vec<String> = app
        .filter
        .split_whitespace()
        .map(|w| w.to_lowercase())
        .collect();
    let mut v: Vec<usize> = (0..app.rows.len())
        .filter(|&i| {
            let r = &app.rows[i];
            if app.fits_only && r.status != Status::Fit {
                return false;
            }
            if words.is_empty() {
                return true;
            }
            let text = r.search_text();
            words.iter().all(|w| text.contains(w.as_str()))
        })
        .collect();
    v.sort_by(|&a, &b| compare(app, &app.rows[a], &app.rows[b]));
    v
}

/// Grid index of the selected row.
fn selected_index(app: &App) -> Option<usize> {
    app.selected_row().map(|r| r.index)
}

/// Puts the selection back on grid point `keep` if it is still visible,
/// else clamps it to the list.
fn reselect(app: &mut App, keep: Option<usize>) {
    let vis = visible(app);
    if let Some(pos) = keep.and_then(|k| vis.iter().position(|&i| app.rows[i].index == k)) {
        app.selected = pos;
    } else {
        app.selected = app.selected.min(vis.len().saturating_sub(1));
    }
}

fn move_by(app: &mut App, delta: isize) {
    let n = visible(app).len();
    if n == 0 {
        app.selected = 0;
        return;
    }
    let cur = app.selected.min(n - 1) as isize;
    app.selected = (cur + delta).clamp(0, n as isize - 1) as usize;
}

/// Changes that reorder or refilter: keep the selection on the same row.
fn keeping_selection(app: &mut App, f: impl FnOnce(&mut App)) {
    let keep = selected_index(app);
    f(app);
    reselect(app, keep);
}

fn on_key(app: &mut App, key: Key) -> Vec<Action> {
    if key == Key::CtrlC {
        return vec![Action::Quit];
    }
    if app.editing_filter {
        match key {
            Key::Enter | Key::Esc => app.editing_filter = false,
            Key::Backspace => keeping_selection(app, |a| {
                a.filter.pop();
            }),
            Key::Char(c) => keeping_selection(app, |a| a.filter.push(c)),
            Key::Up => move_by(app, -1),
            Key::Down => move_by(app, 1),
            _ => {}
        }
        return Vec::new();
    }
    let (view, before) = (app.view, app.selected);
    let actions = if matches!(view, View::Help | View::Why) {
        on_page_key(app, key);
        Vec::new()
    } else {
        on_command(app, key, view == View::Detail)
    };
    // A page opens at its top; the detail of another trial too.
    if app.view != view || app.selected != before {
        app.scroll = 0;
    }
    actions
}

/// How far the page view may scroll: to its last page, once the front end
/// has told the screen's size.
fn scroll_limit(app: &App) -> u16 {
    if app.viewport == (0, 0) {
        MAX_SCROLL
    } else {
        crate::tui::render::scroll_max(app)
    }
}

fn scroll_by(app: &mut App, delta: i32) {
    let to = (app.scroll as i32 + delta).clamp(0, scroll_limit(app) as i32);
    app.scroll = to as u16;
}

/// Lines a PageUp / PageDown scrolls a page view.
fn page(app: &App) -> i32 {
    if app.viewport == (0, 0) {
        PAGE as i32
    } else {
        crate::tui::render::page_rows(app).max(1) as i32
    }
}

/// Keys in the help and the recommendation: they scroll; `?` and `w` go
/// from one to the other (or close their own).
fn on_page_key(app: &mut App, key: Key) {
    match key {
        Key::Char('?') if app.view == View::Help => app.view = View::Grid,
        Key::Char('w') if app.view == View::Why => app.view = View::Grid,
        Key::Char('?') => app.view = View::Help,
        Key::Char('w') => app.view = View::Why,
        Key::Char('q') | Key::Esc | Key::Enter | Key::Tab => app.view = View::Grid,
        Key::Up | Key::Char('k') => scroll_by(app, -1),
        Key::Down | Key::Char('j') => scroll_by(app, 1),
        Key::PageUp => scroll_by(app, -page(app)),
        Key::PageDown | Key::Char(' ') => scroll_by(app, page(app)),
        Key::Home | Key::Char('g') => app.scroll = 0,
        Key::End | Key::Char('G') => app.scroll = scroll_limit(app),
        _ => {}
    }
}

fn on_command(app: &mut App, key: Key, detail: bool) -> Vec<Action> {
    match key {
        Key::Char('q') | Key::Esc if detail => app.view = View::Grid,
        Key::Enter | Key::Tab if detail => app.view = View::Grid,
        Key::Char('q') | Key::Esc => return vec![Action::Quit],
        Key::Char('b') => return vec![Action::Back],
        Key::Enter | Key::Tab if app.selected_row().is_some() => app.view = View::Detail,
        Key::Char('?') => app.view = View::Help,
        Key::Char('w') => app.view = View::Why,
        Key::Char('t') => {
            app.chart = match app.chart {
                ChartKind::Memory => ChartKind::Throughput,
                ChartKind::Throughput => ChartKind::Memory,
            }
        }
        Key::Up | Key::Char('k') => move_by(app, -1),
        Key::Down | Key::Char('j') => move_by(app, 1),
        Key::PageUp if detail => scroll_by(app, -page(app)),
        Key::PageDown if detail => scroll_by(app, page(app)),
        Key::PageUp => move_by(app, -(PAGE as isize)),
        Key::PageDown => move_by(app, PAGE as isize),
        Key::Home | Key::Char('g') => move_by(app, isize::MIN / 2),
        Key::End | Key::Char('G') => move_by(app, isize::MAX / 2),
        Key::Left | Key::Char('h') if detail => move_by(app, -1),
        Key::Right | Key::Char('l') if detail => move_by(app, 1),
        Key::Left | Key::Char('h') => keeping_selection(app, |a| a.sort = a.sort.prev()),
        Key::Right | Key::Char('l') | Key::Char('s') => {
            keeping_selection(app, |a| a.sort = a.sort.next())
        }
        Key::Char('S') => keeping_selection(app, |a| a.reverse = !a.reverse),
        Key::Char('/') => app.editing_filter = true,
        Key::Char('f') => keeping_selection(app, |a| a.fits_only = !a.fits_only),
        Key::Char(' ') => {
            app.paused = !app.paused;
            return vec![Action::TogglePause];
        }
        Key::Char('r') => {
            let Some(pos) = visible(app).get(app.selected).copied() else {
                return Vec::new();
            };
            let row = &mut app.rows[pos];
            if row.status == Status::Running {
                app.message = Some(format!("#{} is running already", row.index));
                return Vec::new();
            }
            // The old record stays on show (and in the recommendation)
            // until the new one arrives.
            row.status = Status::Queued;
            let index = row.index;
            app.message = Some(format!("#{index} queued to run again"));
            return vec![Action::Rerun(index)];
        }
        Key::Char('e') => {
            app.message = Some(format!(
                "exporting to {} ...",
                app.header.export_dir.display()
            ));
            return vec![Action::Export(app.header.export_dir.clone())];
        }
        _ => {}
    }
    Vec::new()
}

/// Every pair of neighbouring samples merged into the one with more device
/// memory (and the higher RSS): half as many, spanning the same time, the
/// peak kept.
fn halve(samples: &[Sample]) -> Vec<Sample> {
    samples
        .chunks(2)
        .map(|pair| {
            let mut s = pair[1..]
                .iter()
                .fold(pair[0], |a, &b| if b.tracked > a.tracked { b } else { a });
            s.rss = pair.iter().filter_map(|s| s.rss).max();
            s
        })
        .collect()
}

/// Applies one event; returns what the front end must do.
pub fn update(app: &mut App, ev: Event) -> Vec<Action> {
    match ev {
        Event::Key(k) => return on_key(app, k),
        // The clock stops with the sweep: elapsed is how long it ran.
        Event::Tick { elapsed_s } if !app.finished => app.elapsed_s = elapsed_s,
        Event::Tick { .. } => {}
        Event::Gpu(v) => app.gpu = Some(v),
        Event::TrialStarted { index } => {
            // Watching the trial that ran last (or none has yet): keep
            // watching the sweep. Elsewhere the selection stays put.
            let follow = app.last_started.is_none() || selected_index(app) == app.last_started;
            keeping_selection(app, |a| {
                if let Some(i) = a.row_of(index) {
                    a.rows[i].status = Status::Running;
                    a.rows[i].samples.clear();
                }
                // A re-run after the end: the sweep runs again.
                a.finished = false;
                a.running = Some(index);
                a.last_started = Some(index);
            });
            if follow {
                reselect(app, Some(index));
            }
        }
        Event::Sample(s) => {
            if let Some(i) = app.running.and_then(|r| app.row_of(r)) {
                let samples = &mut app.rows[i].samples;
                samples.push(s);
                if samples.len() > MAX_SAMPLES {
                    *samples = halve(samples);
                }
            }
        }
        Event::TrialFinished { index, record } => keeping_selection(app, |a| {
            a.finish_order.retain(|&i| i != index);
            if record.measured.is_some() {
                a.finish_order.push(index);
            }
            if let Some(i) = a.row_of(index) {
                a.rows[i].status = Status::from_record(&record);
                a.rows[i].record = Some(record);
            }
            if a.running == Some(index) {
                a.running = None;
            }
            a.recompute_recommendation();
        }),
        Event::Resize { width, height } => {
            app.viewport = (width, height);
            app.scroll = app.scroll.min(scroll_limit(app));
        }

        Event::SweepFinished => {
            app.finished = true;
            app.running = None;
        }
        Event::Ranked(report) => {
            // Trials by their stable id: the report holds only those with
            // records, in its own order.
            let row = |t: usize| {
                let id = &report.trials.get(t)?.id;
                let at = app
                    .rows
                    .iter()
                    .position(|r| r.record.as_ref().is_some_and(|x| &x.id == id))?;
                Some(app.rows[at].index)
            };
            if let Some(rec) = &report.recommendation
                && let Some(pick) = row(rec.trial)
            {
                app.recommendation = Some(pick);
                app.runner_up = rec.runners_up.first().and_then(|&t| row(t));
                app.tied = rec.tied.iter().filter_map(|&t| row(t)).collect();
                app.pareto = report.pareto.iter().filter_map(|&t| row(t)).collect();
                app.reasons = rec.reasons.clone();
            }
        }
        Event::Exported(r) => {
            app.message = Some(match r {
                Ok(p) => format!("exported to {}", p.display()),
                Err(e) => format!("export failed: {e}"),
            })
        }
    }
    Vec::new()
}

/// Fixed data for the TUI's tests.
#[cfg(test)]
pub(crate) mod testdata {
    use super::*;
    use crate::engine::{Attention, Checkpointing, Optimizer, Precision, Sharding};
    use crate::report::sweep::{ExitInfo, Measured, Predicted};

    pub const MIB: u64 = 1 << 20;
    /// The target's runtime overhead in the plans below (the T4's).
    const TARGET_OVERHEAD: u64 = 768 * MIB;

    /// The plan on the target for an engine peak: over 100 MiB does not fit
    /// (small enough for the fixtures to show both).
    pub fn target_plan(engine_peak: u64) -> TargetPrediction {
        TargetPrediction {
            peak_total_bytes: engine_peak + TARGET_OVERHEAD,
            fits: engine_peak <= 100 * MIB,
            step_s: 0.02,
            tokens_per_s: 100_000.0,
            usd_per_mtok: 0.53 / 3600.0 / 100_000.0 * 1e6,
            framework: Default::default(),
        }
    }

    pub fn point(mb: usize, sharding: Sharding, optimizer: Optimizer) -> Point {
        Point {
            micro_batch: mb,
            precision: Precision::Bf16,
            checkpointing: Checkpointing::None,
            attention: Attention::Fused,
            optimizer,
            sharding,
            gpus: 1,
            grad_accum: 16 / mb,
            ..Point::default()
        }
    }

    fn peaks(total: u64) -> PeakBytes {
        PeakBytes {
            total,
            parameters: total / 4,
            gradients: total / 4,
            optimizer: total / 4,
            activations: total / 8,
            temporaries: total / 16,
            communication: 0,
            workspace: total / 32,
        }
    }

    /// A record of `outcome`; `measured` is (engine peak, median tokens/s)
    /// when it ran, with a 95% interval of ±3% around the median.
    pub fn record(
        p: Point,
        outcome: Outcome,
        predicted: u64,
        measured: Option<(u64, f64)>,
    ) -> TrialRecord {
        let usable = (64 * MIB) as f64 * 0.95;
        TrialRecord {
            id: crate::sweep::driver::trial_id(&p),
            point: p,
            outcome,
            fits: measured.is_some_and(|(b, _)| (b as f64) <= usable),
            predicted: Some(Predicted {
                peak_total_bytes: predicted,
                peak_bytes: Some(peaks(predicted)),
                step_s: 0.1,
                tokens_per_s: 1000.0,
            }),
            measured: measured.map(|(b, t)| Measured {
                usd_per_mtok: Some(2.0 / 3600.0 / t * 1e6),
                tokens_per_s_ci: [t * 0.97, t * 1.03],
                ..Measured::for_tests(peaks(b), t)
            }),
            memory_error_pct: measured
                .map(|(b, _)| (b as f64 - predicted as f64) / b as f64 * 100.0),
            time_ratio: measured.map(|_| 1.5),
            nvml_error_pct: None,
            target: Some(target_plan(predicted)),
            exit: (outcome == Outcome::Crash).then(|| ExitInfo {
                code: Some(101),
                signal: None,
                stderr_tail: "thread 'main' panicked at boom".into(),
            }),
            numerics_changes: p.numerics_changes().iter().map(|s| s.to_string()).collect(),
            note: (outcome == Outcome::Oom).then(|| "out of memory: 80.00 MiB requested".into()),
            elapsed_s: 3.0,
        }
    }

    pub fn header(no_color: bool) -> Header {
        Header {
            model: "gpt2-tiny".into(),
            hardware: "NVIDIA T4 16GB".into(),
            device: "cpu:limit=64MiB".into(),
            capacity: 64 * MIB,
            usable: (64.0 * MIB as f64 * 0.95) as u64,
            headroom: 0.05,
            allow_numerics_change: true,
            seq_len: 128,
            global_batch: 16,
            export_dir: PathBuf::from("/tmp/sweep-out"),
            no_color,
            sample_interval_ms: 100,
            base: SweepReport {
                pricing: crate::report::sweep::Pricing {
                    basis: "host".into(),
                    usd_per_hour: Some(2.0),
                },
                model: "gpt2-tiny".into(),
                ..SweepReport::empty_for_tests()
            },
        }
    }

    /// Six grid points, none run yet; #4, predicted far over the capacity,
    /// is a planned skip.
    pub fn fresh(no_color: bool) -> App {
        let pts = [
            point(1, Sharding::None, Optimizer::Adamw),
            point(2, Sharding::None, Optimizer::Adamw),
            point(4, Sharding::None, Optimizer::Adamw),
            point(2, Sharding::Zero2, Optimizer::Adamw8bit),
            point(8, Sharding::None, Optimizer::Adamw),
            point(1, Sharding::Zero2, Optimizer::Sgd),
        ];
        let pred = [20, 30, 80, 25, 150, 10];
        let rows = pts
            .iter()
            .zip(pred)
            .enumerate()
            .map(|(i, (&p, m))| {
                // Far over the capacity: the plan skips it. (#2's plan is
                // over too, but the fixture runs it, to show an OOM.)
                let status = if i == 4 {
                    Status::PlannedSkip
                } else {
                    Status::Queued
                };
                Row {
                    planned_target: Some(target_plan(m * MIB)),
                    ..Row::new(i, p, Some(m * MIB), Some(1000.0), status)
                }
            })
            .collect();
        App::new(header(no_color), rows)
    }

    /// `running`, then #3 (adamw8bit: a numerics change) finishes within
    /// #1's throughput interval: a tie, which #1 wins by changing no numerics.
    pub fn tied(no_color: bool) -> App {
        let mut app = running(no_color);
        let p = app.rows[3].point;
        let record = record(p, Outcome::Ran, 25 * MIB, Some((26 * MIB, 1750.0)));
        update(&mut app, Event::TrialFinished { index: 3, record });
        app
    }

    /// The records the events below deliver, by grid index.
    pub fn finished_records(app: &App) -> Vec<(usize, TrialRecord)> {
        let p = |i: usize| app.rows[i].point;
        vec![
            (
                0,
                record(p(0), Outcome::Ran, 20 * MIB, Some((21 * MIB, 1000.0))),
            ),
            (
                1,
                record(p(1), Outcome::Ran, 30 * MIB, Some((32 * MIB, 1800.0))),
            ),
            (2, record(p(2), Outcome::Oom, 80 * MIB, None)),
            (
                4,
                record(p(4), Outcome::SkippedPredictedOom, 150 * MIB, None),
            ),
            (5, record(p(5), Outcome::Crash, 10 * MIB, None)),
        ]
    }

    /// Ten samples of a trial rising to `peak` over a second.
    pub fn ramp(app: &mut App, peak: u64) {
        for k in 0..10u64 {
            update(
                app,
                Event::Sample(Sample {
                    t_s: k as f64 * 0.1,
                    tracked: peak * k / 9,
                    rss: Some(30 * MIB + peak * k / 9),
                    nvml: None,
                }),
            );
        }
    }

    /// Five trials settled (four ran, each with its samples; #4 skipped
    /// as planned), #3 running with a few samples, the selection following
    /// the sweep onto it.
    pub fn running(no_color: bool) -> App {
        let mut app = fresh(no_color);
        for (index, record) in finished_records(&app) {
            if record.outcome != Outcome::SkippedPredictedOom {
                update(&mut app, Event::TrialStarted { index });
                let peak = record
                    .measured
                    .as_ref()
                    .map_or(5 * MIB, |m| m.peak_bytes.total);
                ramp(&mut app, peak);
            }
            update(&mut app, Event::TrialFinished { index, record });
        }
        update(&mut app, Event::TrialStarted { index: 3 });
        for k in 0..40 {
            let t = k as f64 * 0.1;
            update(
                &mut app,
                Event::Sample(Sample {
                    t_s: t,
                    tracked: (k.min(25) as u64) * MIB,
                    rss: Some((30 + k.min(25) as u64) * MIB),
                    nvml: None,
                }),
            );
        }
        update(&mut app, Event::Tick { elapsed_s: 83.0 });
        app
    }
}

#[cfg(test)]
mod tests {
    use super::testdata::*;
    use super::*;

    fn key(app: &mut App, k: Key) -> Vec<Action> {
        update(app, Event::Key(k))
    }

    fn ch(app: &mut App, c: char) -> Vec<Action> {
        key(app, Key::Char(c))
    }

    fn sel(app: &App) -> usize {
        app.selected_row().unwrap().index
    }

    /// A fitting record for grid point `i`.
    fn record_for(app: &App, i: usize) -> (usize, TrialRecord) {
        let p = app.rows[i].point;
        (
            i,
            record(p, Outcome::Ran, 20 * MIB, Some((22 * MIB, 1200.0))),
        )
    }

    #[test]
    fn moves_and_clamps() {
        let mut app = fresh(false);
        key(&mut app, Key::Up);
        assert_eq!(app.selected, 0);
        ch(&mut app, 'j');
        key(&mut app, Key::Down);
        assert_eq!(sel(&app), 2);
        ch(&mut app, 'k');
        assert_eq!(sel(&app), 1);
        key(&mut app, Key::End);
        assert_eq!(sel(&app), 5);
        key(&mut app, Key::PageDown);
        assert_eq!(app.selected, 5);
        key(&mut app, Key::PageUp);
        assert_eq!(app.selected, 0);
        ch(&mut app, 'G');
        key(&mut app, Key::Home);
        assert_eq!(app.selected, 0);
    }

    #[test]
    fn sort_cycle_and_reverse_keep_the_selection() {
        let mut app = running(false);
        key(&mut app, Key::Home);
        ch(&mut app, 'j'); // #1
        assert_eq!(sel(&app), 1);
        let mut seen = vec![];
        for _ in 0..SortColumn::ALL.len() {
            ch(&mut app, 's');
            seen.push(app.sort);
            assert_eq!(sel(&app), 1, "under {:?}", app.sort);
        }
        assert_eq!(app.sort, SortColumn::Index);
        assert_eq!(seen[0], SortColumn::Knobs);
        // Measured: #0 (21 MiB) before #1 (32 MiB); unmeasured last.
        app.sort = SortColumn::Measured;
        let order: Vec<usize> = visible(&app).iter().map(|&i| app.rows[i].index).collect();
        assert_eq!(&order[..2], &[0, 1]);
        ch(&mut app, 'S');
        assert!(app.reverse);
        // Reversed: the measured largest first, and still unmeasured last.
        let rev: Vec<usize> = visible(&app).iter().map(|&i| app.rows[i].index).collect();
        let measured = |o: &[usize]| -> Vec<usize> {
            o.iter()
                .copied()
                .filter(|&i| {
                    app.rows
                        .iter()
                        .any(|r| r.index == i && r.measured_total().is_some())
                })
                .collect()
        };
        let (m, mr) = (measured(&order), measured(&rev));
        assert_eq!(mr, m.iter().rev().copied().collect::<Vec<_>>());
        assert_eq!(
            rev[mr.len()..],
            order[m.len()..],
            "unmeasured rows stay last, in grid order"
        );
        assert_eq!(sel(&app), 1);
        key(&mut app, Key::Left);
        assert_eq!(app.sort, SortColumn::Predicted);
        assert_eq!(sel(&app), 1);
    }

    /// tok/s sorted either way keeps the rows without a figure at the end
    /// (they came first under ▲), and the arrow is the direction: ▼ the
    /// fastest first, ▲ the slowest first, as htop and bottom draw it.
    #[test]
    fn unmeasured_rows_sort_last_both_ways_and_the_arrow_says_the_direction() {
        let mut app = running(false);
        app.sort = SortColumn::TokensPerS;
        let speeds = |app: &App| -> Vec<Option<f64>> {
            visible(app)
                .iter()
                .map(|&i| app.rows[i].tokens_per_s())
                .collect()
        };
        for reverse in [false, true] {
            app.reverse = reverse;
            let v = speeds(&app);
            let known = v.iter().take_while(|x| x.is_some()).count();
            assert!(known > 1, "{v:?}");
            assert!(v[known..].iter().all(Option::is_none), "{v:?}");
            let desc = descending(&app);
            assert_eq!(
                desc, !reverse,
                "tok/s shows the fastest first unless reversed"
            );
            for w in v[..known].windows(2) {
                let (a, b) = (w[0].unwrap(), w[1].unwrap());
                assert!(if desc { a >= b } else { a <= b }, "{v:?}");
            }
        }
        app.sort = SortColumn::Measured;
        app.reverse = false;
        assert!(!descending(&app), "sizes show the smallest first");
    }

    #[test]
    fn filter_editing() {
        let mut app = fresh(false);
        ch(&mut app, '/');
        assert!(app.editing_filter);
        for c in "zero2 adamw8bit".chars() {
            assert!(ch(&mut app, c).is_empty(), "typed keys are no commands");
        }
        assert_eq!(app.filter, "zero2 adamw8bit");
        assert_eq!(app.view, View::Grid);
        let vis: Vec<usize> = visible(&app).iter().map(|&i| app.rows[i].index).collect();
        assert_eq!(vis, vec![3]);
        assert_eq!(sel(&app), 3);
        for _ in 0.."adamw8bit".len() + 1 {
            key(&mut app, Key::Backspace);
        }
        assert_eq!(app.filter, "zero2");
        assert_eq!(visible(&app).len(), 2);
        // Esc ends editing (and does not quit); the filter stays.
        assert!(key(&mut app, Key::Esc).is_empty());
        assert!(!app.editing_filter);
        assert_eq!(app.filter, "zero2");
        // Now keys are commands again.
        assert_eq!(ch(&mut app, 'q'), vec![Action::Quit]);
        // A filter matching nothing clamps the selection.
        ch(&mut app, '/');
        ch(&mut app, 'x');
        key(&mut app, Key::Enter);
        assert!(visible(&app).is_empty());
        assert_eq!(app.selected, 0);
        assert!(app.selected_row().is_none());
        key(&mut app, Key::Enter); // no detail of nothing
        assert_eq!(app.view, View::Grid);
    }

    /// `/ckpt` matched every row when the filter read the hidden label
    /// (`ckpt:none`); it reads what the grid shows, so only checkpointed
    /// rows match, and a word the grid never shows matches nothing.
    #[test]
    fn the_filter_matches_what_the_grid_shows() {
        let mut app = fresh(false);
        let ckpt: Vec<usize> = app
            .rows
            .iter()
            .filter(|r| crate::plan::name(r.point.checkpointing) != "none")
            .map(|r| r.index)
            .collect();
        assert!(
            ckpt.len() < app.rows.len(),
            "the fixture has rows without checkpointing"
        );
        app.filter = "ckpt".into();
        let vis: Vec<usize> = visible(&app).iter().map(|&i| app.rows[i].index).collect();
        assert_eq!(vis, ckpt);
        app.filter = "none".into();
        assert!(visible(&app).is_empty(), "no cell shows `none`");
    }

    #[test]
    fn fits_only() {
        let mut app = running(false);
        ch(&mut app, 'f');
        assert!(app.fits_only);
        let vis: Vec<usize> = visible(&app).iter().map(|&i| app.rows[i].index).collect();
        assert_eq!(vis, vec![0, 1]);
        ch(&mut app, 'f');
        assert_eq!(visible(&app).len(), 6);
    }

    #[test]
    fn pause_rerun_export() {
        let mut app = running(false);
        assert_eq!(ch(&mut app, ' '), vec![Action::TogglePause]);
        assert!(app.paused);
        assert_eq!(ch(&mut app, ' '), vec![Action::TogglePause]);
        assert!(!app.paused);

        key(&mut app, Key::Home);
        ch(&mut app, 'j');
        ch(&mut app, 'j'); // #2, the OOM
        assert_eq!(ch(&mut app, 'r'), vec![Action::Rerun(2)]);
        assert_eq!(app.rows[2].status, Status::Queued);
        // The running one is not queued again.
        ch(&mut app, 'j');
        assert_eq!(sel(&app), 3);
        assert!(ch(&mut app, 'r').is_empty());
        assert_eq!(app.rows[3].status, Status::Running);

        assert_eq!(
            ch(&mut app, 'e'),
            vec![Action::Export(PathBuf::from("/tmp/sweep-out"))]
        );
        update(
            &mut app,
            Event::Exported(Ok(PathBuf::from("/tmp/sweep-out"))),
        );
        assert_eq!(app.message.as_deref(), Some("exported to /tmp/sweep-out"));
        update(&mut app, Event::Exported(Err("disk full".into())));
        assert_eq!(app.message.as_deref(), Some("export failed: disk full"));
    }

    #[test]
    fn trial_flow_and_recommendation() {
        let mut app = fresh(false);
        assert_eq!(app.recommendation, None);
        update(&mut app, Event::TrialStarted { index: 1 });
        assert_eq!(app.rows[1].status, Status::Running);
        assert_eq!(app.running, Some(1));
        let s = Sample {
            t_s: 0.5,
            tracked: 5 * MIB,
            rss: None,
            nvml: None,
        };
        update(&mut app, Event::Sample(s));
        assert_eq!(app.rows[1].samples, vec![s]);
        for _ in 0..MAX_SAMPLES + 5 {
            update(&mut app, Event::Sample(s));
        }
        assert!(app.rows[1].samples.len() <= MAX_SAMPLES);
        let recs = finished_records(&app);
        let (_, r1) = recs[1].clone();
        update(
            &mut app,
            Event::TrialFinished {
                index: 1,
                record: r1,
            },
        );
        assert_eq!(app.rows[1].status, Status::Fit);
        assert_eq!(app.running, None);
        assert!(!app.rows[1].samples.is_empty(), "a trial keeps its samples");
        assert_eq!(app.recommendation, Some(1));
        assert!(app.reasons[0].contains("lowest cost"));
        assert_eq!(app.runner_up, None);

        update(&mut app, Event::TrialStarted { index: 0 });
        assert!(app.rows[0].samples.is_empty());
        assert!(
            !app.rows[1].samples.is_empty(),
            "the next trial does not take the last one's samples away"
        );
        let (_, r0) = recs[0].clone();
        update(
            &mut app,
            Event::TrialFinished {
                index: 0,
                record: r0,
            },
        );
        // #1 is faster, so cheaper; #0 is the runner-up.
        assert_eq!(app.recommendation, Some(1));
        assert_eq!(app.runner_up, Some(0));
        for (index, record) in recs[2..].iter().cloned() {
            update(&mut app, Event::TrialFinished { index, record });
        }
        assert_eq!(app.rows[2].status, Status::Oom);
        assert_eq!(app.rows[4].status, Status::SkippedPredicted);
        assert_eq!(app.rows[5].status, Status::Crash);
        // #4 was a planned skip and is a recorded one now: the counter
        // counts the five that run, four of them done.
        assert_eq!(
            app.progress(),
            Progress {
                ran: 4,
                to_run: 5,
                skipped: 1
            }
        );
        update(&mut app, Event::Tick { elapsed_s: 12.5 });
        assert_eq!(app.elapsed_s, 12.5);
        // The sweep's final report says how it ranked: the TUI shows its
        // recommendation, mapped by trial id, not the one it kept.
        let mut last = app.report();
        let rec = last.recommendation.as_mut().expect("a trial fits");
        rec.reasons
            .push("ranked on each trial's own measurement: a note".into());
        let (pick, reasons) = (rec.trial, rec.reasons.clone());
        last.trials.swap(0, pick);
        last.recommendation.as_mut().unwrap().trial = 0;
        let id = last.trials[0].id.clone();
        update(&mut app, Event::Ranked(Box::new(last)));
        let shown = app.recommendation.expect("a pick");
        assert_eq!(app.rows[shown].record.as_ref().unwrap().id, id);
        assert_eq!(app.reasons, reasons);
        update(&mut app, Event::SweepFinished);
        assert!(app.finished);
    }

    #[test]
    fn a_long_trial_keeps_its_whole_span_and_its_peak() {
        let mut app = fresh(false);
        update(&mut app, Event::TrialStarted { index: 0 });
        let n = 3 * MAX_SAMPLES + 1;
        for k in 0..n {
            let tracked = if k == 4321 { 99 * MIB } else { MIB };
            let t_s = k as f64 * 0.02;
            update(
                &mut app,
                Event::Sample(Sample {
                    t_s,
                    tracked,
                    rss: Some(tracked + MIB),
                    nvml: None,
                }),
            );
        }
        let s = &app.rows[0].samples;
        assert!(
            s.len() <= MAX_SAMPLES && s.len() > MAX_SAMPLES / 2,
            "{}",
            s.len()
        );
        assert_eq!(s[0].t_s, 0.0, "the start stays");
        assert!(
            s.last().unwrap().t_s > (n - 10) as f64 * 0.02,
            "so does the end"
        );
        assert_eq!(s.iter().map(|s| s.tracked).max(), Some(99 * MIB));
        assert_eq!(s.iter().filter_map(|s| s.rss).max(), Some(100 * MIB));
        assert!(s.windows(2).all(|w| w[0].t_s < w[1].t_s));
    }

    #[test]
    fn elapsed_freezes_at_the_finish() {
        let mut app = running(false);
        update(&mut app, Event::Tick { elapsed_s: 90.0 });
        update(&mut app, Event::SweepFinished);
        update(&mut app, Event::Tick { elapsed_s: 95.0 });
        assert_eq!(app.elapsed_s, 90.0);
        assert!(app.finished);
    }

    #[test]
    fn over_headroom_is_over() {
        let mut app = fresh(false);
        let p = app.rows[2].point;
        let r = record(p, Outcome::Ran, 60 * MIB, Some((63 * MIB, 900.0)));
        assert!(!r.fits);
        update(
            &mut app,
            Event::TrialFinished {
                index: 2,
                record: r,
            },
        );
        assert_eq!(app.rows[2].status, Status::Over);
        assert_eq!(app.recommendation, None);
    }

    #[test]
    fn quit_keys_and_views() {
        let mut app = fresh(false);
        assert_eq!(key(&mut app, Key::CtrlC), vec![Action::Quit]);
        assert_eq!(ch(&mut app, 'q'), vec![Action::Quit]);
        assert_eq!(key(&mut app, Key::Esc), vec![Action::Quit]);
        // Esc closes help first.
        ch(&mut app, '?');
        assert_eq!(app.view, View::Help);
        assert!(key(&mut app, Key::Esc).is_empty());
        assert_eq!(app.view, View::Grid);
        ch(&mut app, '?');
        assert!(ch(&mut app, '?').is_empty());
        assert_eq!(app.view, View::Grid);
        ch(&mut app, '?');
        assert_eq!(key(&mut app, Key::CtrlC), vec![Action::Quit]);
        key(&mut app, Key::Esc);
        // Detail: Enter opens, Esc / Enter / q close.
        for close in [Key::Esc, Key::Enter, Key::Char('q')] {
            key(&mut app, Key::Enter);
            assert_eq!(app.view, View::Detail);
            assert!(key(&mut app, close).is_empty());
            assert_eq!(app.view, View::Grid);
        }
        // In detail, left/right walk the rows.
        key(&mut app, Key::Enter);
        key(&mut app, Key::Right);
        assert_eq!(sel(&app), 1);
        assert_eq!(app.sort, SortColumn::Index);
        // Filter editing: Esc ends it, the next Esc quits.
        key(&mut app, Key::Esc);
        ch(&mut app, '/');
        assert!(key(&mut app, Key::Esc).is_empty());
        assert_eq!(key(&mut app, Key::Esc), vec![Action::Quit]);
    }

    #[test]
    fn detail_scrolls_and_resets() {
        let mut app = running(false);
        key(&mut app, Key::Home);
        key(&mut app, Key::Enter);
        key(&mut app, Key::PageDown);
        assert_eq!(app.scroll, PAGE as u16);
        assert_eq!(app.selected, 0, "PageDown scrolls the detail, not the grid");
        key(&mut app, Key::PageUp);
        key(&mut app, Key::PageUp);
        assert_eq!(app.scroll, 0);
        key(&mut app, Key::PageDown);
        key(&mut app, Key::Down);
        assert_eq!((app.selected, app.scroll), (1, 0));
        key(&mut app, Key::PageDown);
        key(&mut app, Key::Esc);
        assert_eq!(app.scroll, 0);
    }

    /// Help was cut at 80x24 with no way to the rest; the help and the
    /// recommendation pages now scroll by line, page and to either end, and
    /// stop at their last page (the size comes as an event, so `update`
    /// stays pure).
    #[test]
    fn pages_scroll_to_their_last_page_and_no_further() {
        for (open, view) in [('?', View::Help), ('w', View::Why)] {
            let mut app = tied(false);
            update(
                &mut app,
                Event::Resize {
                    width: 80,
                    height: 24,
                },
            );
            ch(&mut app, open);
            assert_eq!(app.view, view);
            let max = crate::tui::render::scroll_max(&app);
            assert!(max > 0, "{view:?} is longer than 80x24");
            ch(&mut app, 'j');
            key(&mut app, Key::Down);
            assert_eq!(app.scroll, 2);
            ch(&mut app, 'k');
            assert_eq!(app.scroll, 1);
            key(&mut app, Key::PageDown);
            let page = crate::tui::render::page_rows(&app);
            assert_eq!(app.scroll, (1 + page).min(max));
            for _ in 0..50 {
                key(&mut app, Key::PageDown);
            }
            assert_eq!(app.scroll, max, "no further than the last page");
            key(&mut app, Key::Up);
            assert_eq!(app.scroll, max - 1, "and back at once");
            ch(&mut app, 'g');
            assert_eq!(app.scroll, 0);
            ch(&mut app, 'G');
            assert_eq!(app.scroll, max);
            // A taller screen has fewer lines to scroll: the scroll follows.
            update(
                &mut app,
                Event::Resize {
                    width: 200,
                    height: 80,
                },
            );
            assert_eq!(app.scroll, crate::tui::render::scroll_max(&app));
            // The other page opens at its top; Esc goes back to the grid.
            ch(&mut app, if open == '?' { 'w' } else { '?' });
            assert_ne!(app.view, view);
            assert_eq!(app.scroll, 0);
            key(&mut app, Key::Esc);
            assert_eq!(app.view, View::Grid);
        }
    }

    /// The chart showed the running trial while the side panel showed the
    /// selected one. Both follow the selection now, each trial keeps its
    /// samples, and the selection follows the sweep only while it is on
    /// the trial that ran last.
    #[test]
    fn the_selection_follows_the_sweep_until_moved() {
        let mut app = running(false);
        assert_eq!(sel(&app), 3, "followed onto the running trial");
        assert!(!app.rows[3].samples.is_empty());
        assert!(!app.rows[0].samples.is_empty(), "#0 keeps its samples");
        // Moved away: the next start leaves the selection alone.
        key(&mut app, Key::Home);
        let (_, r3) = record_for(&app, 3);
        update(
            &mut app,
            Event::TrialFinished {
                index: 3,
                record: r3,
            },
        );
        update(&mut app, Event::Key(Key::Char('r')));
        update(&mut app, Event::TrialStarted { index: 0 });
        assert_eq!(sel(&app), 0, "re-run where the selection is");
        key(&mut app, Key::End);
        update(&mut app, Event::TrialStarted { index: 2 });
        assert_eq!(sel(&app), 5, "moved off the running trial: stays put");
    }

    /// The chart key switches between the memory and the throughput chart;
    /// the throughput's x is the order trials finished, a re-run last.
    #[test]
    fn chart_key_and_finish_order() {
        let mut app = running(false);
        assert_eq!(app.chart, ChartKind::Memory);
        ch(&mut app, 't');
        assert_eq!(app.chart, ChartKind::Throughput);
        ch(&mut app, 't');
        assert_eq!(app.chart, ChartKind::Memory);
        assert_eq!(app.finish_order, vec![0, 1], "only measured trials");
        let (_, r0) = record_for(&app, 0);
        update(&mut app, Event::TrialStarted { index: 0 });
        update(
            &mut app,
            Event::TrialFinished {
                index: 0,
                record: r0,
            },
        );
        assert_eq!(app.finish_order, vec![1, 0]);
    }

    #[test]
    fn keymap_lists_every_command() {
        let keys: String = KEYMAP.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(" ");
        for k in [
            "q", "?", "j", "k", "Enter", "s", "S", "/", "f", "Space", "r", "e", "PgUp", "w", "t",
        ] {
            assert!(keys.contains(k), "{k} missing from KEYMAP");
        }
    }
}
