//! The memory tracker: every byte the engine holds on a device is allocated through it.
//!
//! It keeps live and peak bytes per category and in total, a timeline of events
//! stamped with the step phase, and an optional capacity. An allocation beyond the
//! capacity is a typed [`OomError`], never an abort.

use std::fmt;
use std::time::Instant;

use serde::Serialize;

use crate::units::fmt_bytes;

/// What an allocation is for. Every device allocation carries exactly one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// The model's weights in the dtype the forward pass reads.
    Parameters,
    /// Gradients of the parameters.
    Gradients,
    /// Optimizer state (AdamW m and v, ...).
    Optimizer,
    /// Tensors saved in the forward pass for the backward pass (incl. input tokens).
    Activations,
    /// Scratch made and freed by the engine within a layer or a phase.
    Temporaries,
    /// Buffers collectives read or write: DDP gradient buckets, the flat
    /// inputs and outputs of all-gathers and reduce-scatters.
    Communication,
    /// Backend-internal scratch the backend declares.
    Workspace,
}

impl Category {
    pub const ALL: [Category; 7] = [
        Category::Parameters,
        Category::Gradients,
        Category::Optimizer,
        Category::Activations,
        Category::Temporaries,
        Category::Communication,
        Category::Workspace,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Category::Parameters => "parameters",
            Category::Gradients => "gradients",
            Category::Optimizer => "optimizer",
            Category::Activations => "activations",
            Category::Temporaries => "temporaries",
            Category::Communication => "communication",
            Category::Workspace => "workspace",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Where in a training step the engine is; stamped on every timeline event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    Init,
    /// Token (and position) embedding.
    ForwardEmbed,
    /// Transformer block `i`.
    Forward(usize),
    /// Final norm, output head and loss.
    ForwardHead,
    BackwardHead,
    /// Block `i`'s forward again, under activation checkpointing.
    Recompute(usize),
    Backward(usize),
    BackwardEmbed,
    Optimizer,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Phase::Init => write!(f, "init"),
            Phase::ForwardEmbed => write!(f, "forward:embed"),
            Phase::Forward(i) => write!(f, "forward:{i}"),
            Phase::ForwardHead => write!(f, "forward:head"),
            Phase::BackwardHead => write!(f, "backward:head"),
            Phase::Recompute(i) => write!(f, "recompute:{i}"),
            Phase::Backward(i) => write!(f, "backward:{i}"),
            Phase::BackwardEmbed => write!(f, "backward:embed"),
            Phase::Optimizer => write!(f, "optimizer"),
        }
    }
}

impl Serialize for Phase {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Bytes per category, plus the total.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ByCategory([u64; 7]);

impl ByCategory {
    pub fn get(&self, c: Category) -> u64 {
        self.0[c.index()]
    }
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
    pub fn iter(&self) -> impl Iterator<Item = (Category, u64)> + '_ {
        Category::ALL.iter().map(|&c| (c, self.get(c)))
    }
}

impl Serialize for ByCategory {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(Category::ALL.len() + 1))?;
        m.serialize_entry("total", &self.total())?;
        for (c, b) in self.iter() {
            m.serialize_entry(c.name(), &b)?;
        }
        m.end()
    }
}

/// Peak bytes as reports show them: `total` is the highest sum live at any one
/// moment; each category is that category's own highest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct PeakBytes {
    pub total: u64,
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer: u64,
    pub activations: u64,
    pub temporaries: u64,
    pub communication: u64,
    pub workspace: u64,
}

/// The split at one moment, in the reports' shape (`total` is its sum).
impl From<ByCategory> for PeakBytes {
    fn from(b: ByCategory) -> PeakBytes {
        let mut p = PeakBytes {
            total: b.total(),
            ..PeakBytes::default()
        };
        for (c, v) in b.iter() {
            p.set(c, v);
        }
        p
    }
}

impl PeakBytes {
    pub fn set(&mut self, c: Category, v: u64) {
        *match c {
            Category::Parameters => &mut self.parameters,
            Category::Gradients => &mut self.gradients,
            Category::Optimizer => &mut self.optimizer,
            Category::Activations => &mut self.activations,
            Category::Temporaries => &mut self.temporaries,
            Category::Communication => &mut self.communication,
            Category::Workspace => &mut self.workspace,
        } = v;
    }

    pub fn get(&self, c: Category) -> u64 {
        match c {
            Category::Parameters => self.parameters,
            Category::Gradients => self.gradients,
            Category::Optimizer => self.optimizer,
            Category::Activations => self.activations,
            Category::Temporaries => self.temporaries,
            Category::Communication => self.communication,
            Category::Workspace => self.workspace,
        }
    }
}

/// Tracked bytes live in this process, over every tracker (every rank): what
/// a sweep trial reports while it runs, for the TUI's live chart.
static PROCESS_LIVE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The tracked bytes live in this process right now, summed over trackers.
pub fn process_live_bytes() -> u64 {
    PROCESS_LIVE.load(std::sync::atomic::Ordering::Relaxed)
}

/// The highest live total within one phase (`forward:3`, `backward:3`, `optimizer`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct PhasePeak {
    pub phase: String,
    pub peak_bytes: u64,
}

/// One allocation or free.
#[derive(Clone, Debug, Serialize)]
pub struct Event {
    /// Nanoseconds since the tracker was created (0 on meta, where nothing runs).
    pub t_ns: u64,
    pub phase: Phase,
    pub category: Category,
    /// Positive for an allocation, negative for a free.
    pub bytes: i64,
    /// Live bytes in all categories after this event.
    pub live_total: u64,
}

/// A refused allocation: what was asked for, and what was live at the time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OomError {
    pub category: Category,
    pub requested: u64,
    pub capacity: u64,
    pub live: ByCategory,
    pub phase: Phase,
    /// Refused by the host memory offloaded tensors live in, not the device.
    pub host: bool,
}

impl fmt::Display for OomError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "out of {}memory in {}: {} of {} requested with {} of {} capacity already live (",
            if self.host { "host " } else { "" },
            self.phase,
            fmt_bytes(self.requested),
            self.category.name(),
            fmt_bytes(self.live.total()),
            fmt_bytes(self.capacity),
        )?;
        let mut first = true;
        for (c, b) in self.live.iter().filter(|(_, b)| *b > 0) {
            if !first {
                write!(f, ", ")?;
            }
            first = false;
            write!(f, "{} {}", c.name(), fmt_bytes(b))?;
        }
        write!(f, ")")
    }
}

impl std::error::Error for OomError {}

/// Live and peak bytes per category, with a timeline and an optional capacity.
#[derive(Clone, Debug)]
pub struct Tracker {
    live: ByCategory,
    /// `live.total()`, kept as the bytes come and go (summing the
    /// categories on every allocation was a tenth of a plan's time).
    live_total: u64,
    /// The highest live bytes each category reached on its own.
    peak: ByCategory,
    /// The highest total, and the per-category split at that moment.
    peak_total: u64,
    at_peak: ByCategory,
    capacity: Option<u64>,
    phase: Phase,
    start: Instant,
    timeline: Vec<Event>,
    recording: bool,
    /// Whether events carry wall-clock times (off on meta, where nothing
    /// runs and reading the clock would dominate a plan's cost).
    clock: bool,
    /// Tracks host memory (offload), which its out-of-memory errors say.
    host: bool,
    /// Adds its bytes to the process's live count (the TUI's live chart);
    /// a planner's trackers do not, nor pay for the shared counter.
    counts_process: bool,
}

impl Tracker {
    pub fn new(capacity: Option<u64>) -> Self {
        Tracker {
            live: ByCategory::default(),
            live_total: 0,
            peak: ByCategory::default(),
            peak_total: 0,
            at_peak: ByCategory::default(),
            capacity,
            phase: Phase::Init,
            start: Instant::now(),
            timeline: Vec::new(),
            recording: true,
            clock: true,
            host: false,
            counts_process: true,
        }
    }

    /// A planner's tracker: peaks only, no timeline, outside the process's
    /// live count.
    pub fn for_planning(mut self) -> Self {
        self.recording = false;
        self.clock = false;
        self.counts_process = false;
        self
    }

    /// A tracker of host memory (offloaded tensors).
    pub fn for_host(mut self) -> Self {
        self.host = true;
        self
    }

    /// Stamps events with 0 instead of the time since creation.
    pub fn without_clock(mut self) -> Self {
        self.clock = false;
        self
    }

    /// Whether to keep the timeline (on by default). Peaks are kept either way.
    pub fn set_recording(&mut self, on: bool) {
        self.recording = on;
    }

    pub fn set_phase(&mut self, phase: Phase) {
        self.phase = phase;
    }
    pub fn phase(&self) -> Phase {
        self.phase
    }
    pub fn capacity(&self) -> Option<u64> {
        self.capacity
    }

    /// Records an allocation, or refuses it when it would exceed the capacity.
    ///
    /// Without a capacity, 2^64 bytes is one: live bytes past it would
    /// wrap around and report a smaller peak for a larger step.
    pub fn alloc(&mut self, category: Category, bytes: u64) -> Result<(), OomError> {
        let capacity = self.capacity.unwrap_or(u64::MAX);
        let Some(total) = (self.live_total.checked_add(bytes)).filter(|&t| t <= capacity) else {
            return Err(OomError {
                category,
                requested: bytes,
                capacity,
                live: self.live,
                phase: self.phase,
                host: self.host,
            });
        };
        let i = category.index();
        self.live.0[i] += bytes;
        self.live_total = total;
        if self.counts_process {
            PROCESS_LIVE.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        }
        self.peak.0[i] = self.peak.0[i].max(self.live.0[i]);
        if total > self.peak_total {
            self.peak_total = total;
            self.at_peak = self.live;
        }
        self.record(category, bytes as i64);
        Ok(())
    }

    pub fn free(&mut self, category: Category, bytes: u64) {
        let i = category.index();
        debug_assert!(
            self.live.0[i] >= bytes,
            "freeing more {category:?} than is live"
        );
        self.live.0[i] -= bytes;
        self.live_total -= bytes;
        if self.counts_process {
            PROCESS_LIVE.fetch_sub(bytes, std::sync::atomic::Ordering::Relaxed);
        }
        self.record(category, -(bytes as i64));
    }

    fn record(&mut self, category: Category, bytes: i64) {
        if !self.recording {
            return;
        }
        self.timeline.push(Event {
            t_ns: if self.clock {
                self.start.elapsed().as_nanos() as u64
            } else {
                0
            },
            phase: self.phase,
            category,
            bytes,
            live_total: self.live_total,
        });
    }

    pub fn live(&self) -> ByCategory {
        self.live
    }
    /// Per-category peaks, each the highest that category reached.
    pub fn peak(&self) -> ByCategory {
        self.peak
    }
    /// The highest total live bytes.
    pub fn peak_total(&self) -> u64 {
        self.peak_total
    }
    /// The per-category split at the moment of the total peak.
    pub fn at_peak(&self) -> ByCategory {
        self.at_peak
    }
    pub fn peak_bytes(&self) -> PeakBytes {
        let p = self.peak;
        PeakBytes {
            total: self.peak_total,
            parameters: p.get(Category::Parameters),
            gradients: p.get(Category::Gradients),
            optimizer: p.get(Category::Optimizer),
            activations: p.get(Category::Activations),
            temporaries: p.get(Category::Temporaries),
            communication: p.get(Category::Communication),
            workspace: p.get(Category::Workspace),
        }
    }
    pub fn timeline(&self) -> &[Event] {
        &self.timeline
    }

    /// The highest total live bytes within each phase, phases in the order
    /// they first ran (a phase that repeats, over micro-batches or steps,
    /// keeps its highest). Empty unless the timeline was recorded.
    pub fn phase_peaks(&self) -> Vec<PhasePeak> {
        let mut out: Vec<PhasePeak> = Vec::new();
        for e in &self.timeline {
            let phase = e.phase.to_string();
            match out.iter_mut().find(|p| p.phase == phase) {
                Some(p) => p.peak_bytes = p.peak_bytes.max(e.live_total),
                None => out.push(PhasePeak {
                    phase,
                    peak_bytes: e.live_total,
                }),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 26: live bytes past 2^64 wrapped, so a larger step reported a
    /// smaller peak.
    #[test]
    fn live_bytes_past_two_to_the_64_are_refused_not_wrapped() {
        let mut t = Tracker::new(None);
        t.alloc(Category::Activations, u64::MAX - 10).unwrap();
        let e = t.alloc(Category::Temporaries, 11).unwrap_err();
        assert_eq!(e.capacity, u64::MAX);
        assert_eq!(t.peak_bytes().total, u64::MAX - 10);
        t.alloc(Category::Temporaries, 10).unwrap();
        assert_eq!(t.peak_bytes().total, u64::MAX);
    }

    #[test]
    fn phase_peaks_keep_each_phase_highest_in_first_run_order() {
        let mut t = Tracker::new(None);
        t.set_phase(Phase::Forward(0));
        t.alloc(Category::Activations, 100).unwrap();
        t.set_phase(Phase::Backward(0));
        t.alloc(Category::Temporaries, 50).unwrap();
        t.free(Category::Temporaries, 50);
        t.free(Category::Activations, 100);
        // a second micro-batch peaks higher in forward:0
        t.set_phase(Phase::Forward(0));
        t.alloc(Category::Activations, 300).unwrap();
        t.free(Category::Activations, 300);
        let p = t.phase_peaks();
        let got: Vec<(&str, u64)> = p.iter().map(|p| (p.phase.as_str(), p.peak_bytes)).collect();
        assert_eq!(got, vec![("forward:0", 300), ("backward:0", 150)]);
        let mut quiet = Tracker::new(None);
        quiet.set_recording(false);
        quiet.alloc(Category::Activations, 1).unwrap();
        assert!(quiet.phase_peaks().is_empty());
    }

    #[test]
    fn tracks_live_and_peak_per_category() {
        let mut t = Tracker::new(None);
        t.alloc(Category::Parameters, 100).unwrap();
        t.set_phase(Phase::Forward(0));
        t.alloc(Category::Activations, 50).unwrap();
        t.alloc(Category::Temporaries, 30).unwrap();
        t.free(Category::Temporaries, 30);
        t.free(Category::Activations, 50);
        t.alloc(Category::Temporaries, 10).unwrap();
        assert_eq!(t.live().total(), 110);
        assert_eq!(t.peak_total(), 180);
        assert_eq!(t.peak().get(Category::Temporaries), 30);
        assert_eq!(t.at_peak().get(Category::Activations), 50);
        assert_eq!(t.timeline().len(), 6);
        assert_eq!(t.timeline()[1].phase, Phase::Forward(0));
    }

    #[test]
    fn capacity_refuses_with_typed_error() {
        let mut t = Tracker::new(Some(100));
        t.alloc(Category::Parameters, 60).unwrap();
        let e = t.alloc(Category::Activations, 41).unwrap_err();
        assert_eq!(e.category, Category::Activations);
        assert_eq!(e.requested, 41);
        assert_eq!(e.live.get(Category::Parameters), 60);
        // The refused request left nothing behind; a smaller one still fits.
        assert_eq!(t.live().total(), 60);
        t.alloc(Category::Activations, 40).unwrap();
        assert!(e.to_string().contains("parameters 60 B"));
    }
}
