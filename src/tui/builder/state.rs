//! The grid builder's state and its pure update.
//!
//! The state is a [`PlanRecipe`] being edited plus where the cursor is.
//! Nothing here reads a file, a clock or the terminal: every change to the
//! recipe asks for a re-plan ([`Action::Plan`], tagged with a generation so
//! that a stale answer is dropped), and the terminal loop answers with
//! [`Event::Planned`]. Same events in, same state out.

use std::path::PathBuf;
use std::sync::Arc;

use super::axes::{AXES, Axis};
use super::compute::{Change, FitMap, Fix, Planned, fit_map};
use crate::backend::DeviceSpec;
use crate::config::attention_kernels::AttentionKernel;
use crate::engine::Sharding;
use crate::plan::{PlanRecipe, Point};
use crate::tui::app::Key;

/// A row of the form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    Model,
    Hardware,
    Network,
    Device,
    SeqLen,
    GlobalBatch,
    LoraRank,
    AttentionKernel,
    Axis(Axis),
}

impl Field {
    pub fn label(self) -> &'static str {
        match self {
            Field::Model => "model",
            Field::Hardware => "hardware",
            Field::Network => "network",
            Field::Device => "run device",
            Field::SeqLen => "seq_len",
            Field::GlobalBatch => "glob_batch",
            Field::LoraRank => "lora_rank",
            Field::AttentionKernel => "attn_kernel",
            Field::Axis(a) => a.label(),
        }
    }

    /// Whether `e` edits it as text.
    pub fn typed(self) -> bool {
        !matches!(self, Field::Axis(_))
    }
}

/// The form, top to bottom: the capacity factor and expert parallelism
/// only for a mixture of experts (the last model that planned has
/// experts), virtual stages only for a pipeline, tensor-parallel overlap
/// only while the grid lists tensor parallelism, the parameter-gather
/// overlap only while it lists zero1 or zero2, or while the grid lists
/// one of them, so that it can be taken out again.
pub fn fields(b: &Builder) -> Vec<Field> {
    let g = &b.recipe.grid;
    let experts = (b.planned.as_ref()).is_some_and(|p| p.model.moe.is_some())
        || (g.capacity_factor.iter()).any(|c| !c.is_dropless())
        || g.expert_parallel.iter().any(|&e| e > 1);
    let tp = g.tensor_parallel.iter().any(|&t| t > 1) || g.tp_comm_overlap.contains(&true);
    let zero12 = (g.sharding.iter()).any(|s| matches!(s, Sharding::Zero1 | Sharding::Zero2))
        || g.overlap_param_gather.contains(&true);
    let pipelines = (g.pipeline_stages.iter().chain(&g.virtual_stages)).any(|&s| s > 1);
    let shown = |a: Axis| match a {
        Axis::CapacityFactor | Axis::ExpertParallel => experts,
        Axis::TpCommOverlap => tp,
        Axis::OverlapParamGather => zero12,
        Axis::VirtualStages => pipelines,
        _ => true,
    };
    let mut v = vec![
        Field::Model,
        Field::Hardware,
        Field::Network,
        Field::Device,
        Field::SeqLen,
        Field::GlobalBatch,
    ];
    v.extend(
        (AXES.iter())
            .filter(|&&a| shown(a))
            .map(|&a| Field::Axis(a)),
    );
    v.push(Field::LoraRank);
    v.push(Field::AttentionKernel);
    v
}

/// A hardware profile offered, with how the list shows it (a local GPU
/// first, with its free memory, where NVML answers).
#[derive(Clone, Debug, PartialEq)]
pub struct HwChoice {
    pub profile: String,
    pub label: String,
}

/// Which half of the screen the arrows move in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Focus {
    Form,
    Map,
}

#[derive(Clone, Debug)]
pub struct Builder {
    /// The grid being edited.
    pub recipe: PlanRecipe,
    /// The latest plan of `recipe`, or of the last recipe that planned.
    pub planned: Option<Arc<Planned>>,
    /// `planned`'s fit map.
    pub map: FitMap,
    /// Why the latest edit does not plan (the plan shown is the last good one).
    pub error: Option<String>,
    /// A one-line note (written, added, completions).
    pub message: Option<String>,
    /// Bumped on every edit; a plan for an older one is dropped.
    pub generation: u64,
    /// The generation `planned` answers.
    pub plan_generation: u64,
    pub focus: Focus,
    /// The form's row, and the value under the cursor on an axis row.
    pub field: usize,
    pub value: usize,
    /// Text being typed into the field, when editing.
    pub edit: Option<String>,
    /// The fit map's selected row and column.
    pub map_row: usize,
    pub map_col: usize,
    /// The fixes for the selected point (its generation and knobs).
    pub fixes: Option<(u64, Point, Vec<Fix>)>,
    /// Lines the detail panel is scrolled by.
    pub scroll: u16,
    pub help: bool,
    pub help_scroll: u16,
    pub models: Vec<String>,
    pub hardware: Vec<HwChoice>,
    pub networks: Vec<String>,
    pub devices: Vec<Option<DeviceSpec>>,
    /// Where `w` writes `recipe.yaml` and the sweep keeps its journal.
    pub out: PathBuf,
    pub no_color: bool,
    pub size: (u16, u16),
}

/// What the terminal loop does after an update.
#[derive(Clone, Debug)]
pub enum Action {
    Quit,
    /// Plan this recipe; answer with [`Event::Planned`] of the same generation.
    Plan(u64, Box<PlanRecipe>),
    /// Find the fixes for this point of generation `u64`'s plan; answer
    /// with [`Event::Fixes`].
    Fixes(u64, Point),
    /// List completions of this path; answer with [`Event::Completed`].
    Complete(String),
    /// Write the recipe as `<out>/recipe.yaml`; answer with [`Event::Written`].
    Write(Box<PlanRecipe>),
    /// Write it, then run its sweep in the sweep view.
    Sweep(Box<PlanRecipe>),
}

#[derive(Clone, Debug)]
pub enum Event {
    Key(Key),
    Planned(u64, Result<Arc<Planned>, String>),
    Fixes(u64, Point, Vec<Fix>),
    Completed(Vec<String>),
    Written(Result<PathBuf, String>),
    Resize { width: u16, height: u16 },
}

/// The keys; the help page is drawn from this table.
pub const KEYMAP: &[(&str, &str)] = &[
    (
        "q  Esc  Ctrl-C",
        "quit (Esc and q close help or the edit first)",
    ),
    ("?", "this help"),
    ("Tab", "switch between the form and the fit map"),
    (
        "↑ ↓  k j",
        "form: previous / next row; fit map: previous / next knob combination",
    ),
    (
        "← →  h l",
        "form: the value under the cursor, or the previous / next model, hardware, network, device, or half / double a number; fit map: previous / next micro-batch",
    ),
    (
        "Space",
        "turn the value under the cursor on or off (one stays on per axis)",
    ),
    (
        "e",
        "type the field: a model or hardware name or path (a profile YAML or a Hugging Face config.json; Tab completes paths), a network, a device (cpu:limit=64MiB), a number; Enter takes it, Esc drops it",
    ),
    (
        "1-9",
        "add fix N of the selected point (\"what would make it fit\") to the grid",
    ),
    (
        "r",
        "select the recommended point (its detail gives every reason)",
    ),
    ("PgUp PgDn", "scroll the selected point's detail"),
    ("w", "write the grid as <out>/recipe.yaml"),
    (
        "Enter",
        "write it and measure it: the sweep of that grid on the run device (b there comes back here)",
    ),
];

impl Builder {
    pub fn new(
        recipe: PlanRecipe,
        models: Vec<String>,
        hardware: Vec<HwChoice>,
        networks: Vec<String>,
        out: PathBuf,
    ) -> Builder {
        let mut recipe = recipe;
        recipe.grid.frameworks_or(crate::engine::Framework::Memfit);
        let mut devices: Vec<Option<DeviceSpec>> = vec![None];
        for d in [
            recipe.device.clone(),
            Some(DeviceSpec::new(crate::backend::DeviceKind::Cpu, None)),
            Some(DeviceSpec::new(crate::backend::DeviceKind::Meta, None)),
        ] {
            if !devices.contains(&d) {
                devices.push(d);
            }
        }
        Builder {
            recipe,
            planned: None,
            map: FitMap::default(),
            error: None,
            message: None,
            generation: 0,
            plan_generation: 0,
            focus: Focus::Form,
            field: 0,
            value: 0,
            edit: None,
            map_row: 0,
            map_col: 0,
            fixes: None,
            scroll: 0,
            help: false,
            help_scroll: 0,
            models,
            hardware,
            networks,
            devices,
            out,
            no_color: false,
            size: (80, 24),
        }
    }

    pub fn current_field(&self) -> Field {
        let f = fields(self);
        f[self.field.min(f.len() - 1)]
    }

    /// The plan index of the fit map's selected cell, if it has a point.
    pub fn selected(&self) -> Option<usize> {
        let row = self.map.rows.get(self.map_row)?;
        *row.cells.get(self.map_col)?
    }

    /// The fixes of the selected point, when they are for it.
    pub fn current_fixes(&self) -> Option<&[Fix]> {
        let planned = self.planned.as_ref()?;
        let i = self.selected()?;
        match &self.fixes {
            Some((g, p, f)) if *g == self.plan_generation && *p == planned.plan.points[i].point => {
                Some(f)
            }
            _ => None,
        }
    }

    /// The text a typed field starts from.
    pub fn field_text(&self, f: Field) -> String {
        let r = &self.recipe;
        match f {
            Field::Model => r.model.clone(),
            Field::Hardware => r.hardware.clone(),
            Field::Network => r.network.clone().unwrap_or_default(),
            Field::Device => r
                .device
                .as_ref()
                .map_or_else(String::new, |d| d.to_string()),
            Field::SeqLen => r.seq_len.to_string(),
            Field::GlobalBatch => r.global_batch.to_string(),
            Field::LoraRank => r.lora().rank.to_string(),
            Field::AttentionKernel => r
                .attention_kernel
                .map_or_else(String::new, |k| k.to_string()),
            Field::Axis(a) => a.get(&r.grid).join(" "),
        }
    }
}

/// The first plan: call once, after [`Builder::new`].
pub fn start(b: &mut Builder) -> Vec<Action> {
    replan(b)
}

fn replan(b: &mut Builder) -> Vec<Action> {
    b.generation += 1;
    vec![Action::Plan(b.generation, Box::new(b.recipe.clone()))]
}

/// The knobs of the selected point, to find it again in the next plan.
fn selected_point(b: &Builder) -> Option<Point> {
    let i = b.selected()?;
    Some(b.planned.as_ref()?.plan.points.get(i)?.point)
}

/// Asks for the fixes of the selected point when it does not fit and they
/// are not there yet.
fn ask_fixes(b: &Builder) -> Vec<Action> {
    let (Some(planned), Some(i)) = (&b.planned, b.selected()) else {
        return Vec::new();
    };
    let p = &planned.plan.points[i];
    if p.verdict != crate::plan::Verdict::DoesNotFit || b.current_fixes().is_some() {
        return Vec::new();
    }
    vec![Action::Fixes(b.plan_generation, p.point)]
}

pub fn update(b: &mut Builder, ev: Event) -> Vec<Action> {
    match ev {
        Event::Resize { width, height } => {
            b.size = (width, height);
            Vec::new()
        }
        Event::Planned(g, _) if g != b.generation => Vec::new(),
        Event::Planned(_, Err(e)) => {
            b.error = Some(e);
            Vec::new()
        }
        Event::Planned(g, Ok(p)) => {
            let keep = selected_point(b);
            b.map = fit_map(&p);
            b.planned = Some(p);
            b.plan_generation = g;
            b.error = None;
            let found = keep.and_then(|k| {
                let planned = b.planned.clone()?;
                b.map
                    .cell_of(|i| super::axes::same_knobs(&planned.plan.points[i].point, &k))
            });
            match found {
                Some((r, c)) => (b.map_row, b.map_col) = (r, c),
                None => {
                    b.map_row = b.map_row.min(b.map.rows.len().saturating_sub(1));
                    b.map_col = b.map_col.min(b.map.cols.len().saturating_sub(1));
                }
            }
            ask_fixes(b)
        }
        Event::Fixes(g, p, f) => {
            if g == b.plan_generation {
                b.fixes = Some((g, p, f));
            }
            Vec::new()
        }
        Event::Completed(list) => {
            if let Some(text) = &mut b.edit {
                match list.len() {
                    0 => b.message = Some(format!("no path starts with {text}")),
                    1 => {
                        *text = list[0].clone();
                        b.message = None;
                    }
                    _ => {
                        *text = common_prefix(&list);
                        let names: Vec<&str> = list
                            .iter()
                            .map(|p| {
                                let t = p.trim_end_matches('/');
                                let cut = t.rfind('/').map_or(0, |i| i + 1);
                                &p[cut..]
                            })
                            .collect();
                        b.message = Some(names.join("  "));
                    }
                }
            }
            Vec::new()
        }
        Event::Written(r) => {
            b.message = Some(match r {
                Ok(p) => format!(
                    "wrote {} (`memfit plan` of it gives these figures)",
                    p.display()
                ),
                Err(e) => format!("could not write the recipe: {e}"),
            });
            Vec::new()
        }
        Event::Key(k) => on_key(b, k),
    }
}

fn common_prefix(list: &[String]) -> String {
    let first = &list[0];
    let mut n = first.len();
    for s in &list[1..] {
        n = n.min(
            first
                .char_indices()
                .zip(s.chars())
                .find(|((_, a), b)| a != b)
                .map_or(first.len().min(s.len()), |((i, _), _)| i),
        );
    }
    first[..n].to_string()
}

fn on_key(b: &mut Builder, k: Key) -> Vec<Action> {
    if k == Key::CtrlC {
        return vec![Action::Quit];
    }
    if b.edit.is_some() {
        return on_edit_key(b, k);
    }
    if b.help {
        match k {
            Key::Esc | Key::Char('q') | Key::Char('?') => b.help = false,
            Key::Up | Key::Char('k') => b.help_scroll = b.help_scroll.saturating_sub(1),
            Key::Down | Key::Char('j') => b.help_scroll = b.help_scroll.saturating_add(1),
            Key::PageUp => b.help_scroll = b.help_scroll.saturating_sub(page(b)),
            Key::PageDown => b.help_scroll = b.help_scroll.saturating_add(page(b)),
            Key::Home | Key::Char('g') => b.help_scroll = 0,
            _ => {}
        }
        return Vec::new();
    }
    b.message = None;
    let field = b.current_field();
    match k {
        Key::Char('q') | Key::Esc => return vec![Action::Quit],
        Key::Char('?') => {
            b.help = true;
            b.help_scroll = 0;
        }
        Key::Tab => {
            b.focus = match b.focus {
                Focus::Form => Focus::Map,
                Focus::Map => Focus::Form,
            }
        }
        Key::Up | Key::Char('k') => return move_by(b, -1),
        Key::Down | Key::Char('j') => return move_by(b, 1),
        Key::Home | Key::Char('g') if b.focus == Focus::Form => b.field = 0,
        Key::End | Key::Char('G') if b.focus == Focus::Form => b.field = fields(b).len() - 1,
        Key::Left | Key::Char('h') => return step(b, -1),
        Key::Right | Key::Char('l') => return step(b, 1),
        Key::PageUp => b.scroll = b.scroll.saturating_sub(page(b)),
        Key::PageDown => b.scroll = b.scroll.saturating_add(page(b)),
        Key::Char(' ') => match (b.focus, field) {
            (Focus::Form, Field::Axis(a)) => return toggle(b, a),
            _ => {
                b.message = Some(
                    "Space turns a grid value on or off: Tab to the form, then a grid row".into(),
                )
            }
        },
        Key::Char('e') => match field {
            f if f.typed() && b.focus == Focus::Form => b.edit = Some(b.field_text(f)),
            _ => {
                b.message = Some(
                    "e types a field: Tab to the form, then model, hardware, network, run device or a number"
                        .into(),
                )
            }
        },
        Key::Char(c @ '1'..='9') => return add_fix(b, c as usize - '0' as usize),
        Key::Char('r') => return select_recommended(b),
        Key::Char('w') | Key::Enter => {
            if let Some(why) = not_ready(b) {
                b.message = Some(why);
                return Vec::new();
            }
            let r = Box::new(b.recipe.clone());
            return vec![match k {
                Key::Enter => Action::Sweep(r),
                _ => Action::Write(r),
            }];
        }
        _ => {}
    }
    Vec::new()
}

/// Why the grid cannot be written or swept now, if it cannot.
fn not_ready(b: &Builder) -> Option<String> {
    if let Some(e) = &b.error {
        return Some(format!("the grid does not plan, so it is not written: {e}"));
    }
    if b.planned.is_none() || b.plan_generation != b.generation {
        return Some("still planning the last change; press it again in a moment".into());
    }
    None
}

fn page(b: &Builder) -> u16 {
    b.size.1.saturating_sub(6).max(1)
}

fn move_by(b: &mut Builder, d: isize) -> Vec<Action> {
    match b.focus {
        Focus::Form => {
            let n = fields(b).len() as isize;
            b.field = (b.field as isize + d).clamp(0, n - 1) as usize;
            if let Field::Axis(a) = b.current_field() {
                let n = a.options(&b.recipe.grid).len();
                b.value = b.value.min(n.saturating_sub(1));
            }
            Vec::new()
        }
        Focus::Map => {
            let n = b.map.rows.len() as isize;
            b.map_row = (b.map_row as isize + d).clamp(0, (n - 1).max(0)) as usize;
            b.scroll = 0;
            ask_fixes(b)
        }
    }
}

/// Left / right: along the fit map, along an axis's values, or to the
/// previous / next choice of a field.
fn step(b: &mut Builder, d: isize) -> Vec<Action> {
    if b.focus == Focus::Map {
        let n = b.map.cols.len() as isize;
        b.map_col = (b.map_col as isize + d).clamp(0, (n - 1).max(0)) as usize;
        b.scroll = 0;
        return ask_fixes(b);
    }
    let cycle = |len: usize, at: Option<usize>| -> usize {
        match at {
            Some(i) => (i as isize + d).rem_euclid(len as isize) as usize,
            None => 0,
        }
    };
    let field = b.current_field();
    let r = &mut b.recipe;
    match field {
        Field::Axis(a) => {
            let n = a.options(&r.grid).len() as isize;
            b.value = (b.value as isize + d).clamp(0, n - 1) as usize;
            return Vec::new();
        }
        Field::Model => {
            if b.models.is_empty() {
                return Vec::new();
            }
            let at = b.models.iter().position(|m| *m == r.model);
            r.model = b.models[cycle(b.models.len(), at)].clone();
        }
        Field::Hardware => {
            if b.hardware.is_empty() {
                return Vec::new();
            }
            let at = b.hardware.iter().position(|h| h.profile == r.hardware);
            r.hardware = b.hardware[cycle(b.hardware.len(), at)].profile.clone();
        }
        Field::Network => {
            let mut all: Vec<Option<String>> = vec![None];
            all.extend(b.networks.iter().cloned().map(Some));
            let at = all.iter().position(|n| *n == r.network);
            r.network = all[cycle(all.len(), at)].clone();
        }
        Field::Device => {
            let at = b.devices.iter().position(|x| *x == r.device);
            r.device = b.devices[cycle(b.devices.len(), at)].clone();
        }
        Field::SeqLen => r.seq_len = scale(r.seq_len, d),
        Field::GlobalBatch => r.global_batch = scale(r.global_batch, d),
        Field::LoraRank => r.knobs.lora_rank = Some(scale(r.lora().rank, d)),
        Field::AttentionKernel => {
            // None (the default, FlashAttention-2) first, then the others.
            let mut all = vec![None];
            all.extend(AttentionKernel::ALL[1..].iter().copied().map(Some));
            let at = all.iter().position(|k| *k == r.attention_kernel);
            r.attention_kernel = all[cycle(all.len(), at)];
        }
    }
    replan(b)
}

/// Halved (at least 1) or doubled.
fn scale(x: usize, d: isize) -> usize {
    match d < 0 {
        true => (x / 2).max(1),
        false => x.saturating_mul(2),
    }
}

/// Puts `v` on axis `a` of the grid, in the order the options list them.
fn turn_on(r: &mut PlanRecipe, a: Axis, v: &str) {
    let opts = a.options(&r.grid);
    let mut vals = a.get(&r.grid);
    if !vals.iter().any(|x| x == v) {
        vals.push(v.to_string());
    }
    vals.sort_by_key(|x| opts.iter().position(|o| o == x).unwrap_or(usize::MAX));
    a.set(&mut r.grid, &vals);
}

fn toggle(b: &mut Builder, a: Axis) -> Vec<Action> {
    let opts = a.options(&b.recipe.grid);
    let Some(v) = opts.get(b.value).cloned() else {
        return Vec::new();
    };
    let mut vals = a.get(&b.recipe.grid);
    if vals.contains(&v) {
        if vals.len() == 1 {
            b.message = Some(format!(
                "{} keeps at least one value: turn another on first",
                a.key()
            ));
            return Vec::new();
        }
        vals.retain(|x| *x != v);
        a.set(&mut b.recipe.grid, &vals);
    } else {
        turn_on(&mut b.recipe, a, &v);
    }
    replan(b)
}

/// Puts the fit map's selection on the recommended point.
fn select_recommended(b: &mut Builder) -> Vec<Action> {
    let Some(rec) = (b.planned.as_ref()).and_then(|p| p.plan.recommendation.as_ref()) else {
        b.message = Some("no point of this grid fits, so none is recommended".into());
        return Vec::new();
    };
    if let Some((r, c)) = b.map.cell_of(|i| i == rec.index) {
        (b.map_row, b.map_col) = (r, c);
        b.focus = Focus::Map;
        b.scroll = 0;
    }
    Vec::new()
}

fn add_fix(b: &mut Builder, n: usize) -> Vec<Action> {
    let Some(fix) = b.current_fixes().and_then(|f| f.get(n - 1)).cloned() else {
        b.message = Some(match b.current_fixes() {
            Some(f) => format!("the selected point has {} fixes listed, not {n}", f.len()),
            None => "fixes are listed for a selected point that does not fit".into(),
        });
        return Vec::new();
    };
    for c in &fix.changes {
        match c {
            Change::Axis(a, v) => turn_on(&mut b.recipe, *a, v),
            Change::Hardware(h) => b.recipe.hardware = h.clone(),
        }
    }
    let what: Vec<String> = fix.changes.iter().map(Change::label).collect();
    b.message = Some(format!("added to the grid: {}", what.join(" + ")));
    replan(b)
}

fn on_edit_key(b: &mut Builder, k: Key) -> Vec<Action> {
    let field = b.current_field();
    let Some(text) = b.edit.as_mut() else {
        return Vec::new();
    };
    match k {
        Key::Esc => {
            b.edit = None;
            b.message = None;
        }
        Key::Backspace => {
            text.pop();
        }
        Key::Char(c) => text.push(c),
        Key::Tab => {
            if matches!(field, Field::Model | Field::Hardware | Field::Network) {
                return vec![Action::Complete(text.clone())];
            }
        }
        Key::Enter => {
            let text = text.trim().to_string();
            match apply_text(&mut b.recipe, field, &text) {
                Ok(()) => {
                    b.edit = None;
                    b.message = None;
                    return replan(b);
                }
                Err(why) => b.message = Some(why),
            }
        }
        _ => {}
    }
    Vec::new()
}

/// Sets a typed field; the error is one line and the field stays open.
fn apply_text(r: &mut PlanRecipe, f: Field, text: &str) -> Result<(), String> {
    let whole = |what: &str| -> Result<usize, String> {
        match text.parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!(
                "{what}: `{text}` is not a whole number of 1 or more"
            )),
        }
    };
    match f {
        Field::Model | Field::Hardware if text.is_empty() => {
            return Err(format!("{}: type a name or a path", f.label()));
        }
        Field::Model => r.model = text.to_string(),
        Field::Hardware => r.hardware = text.to_string(),
        Field::Network => r.network = (!text.is_empty()).then(|| text.to_string()),
        Field::Device if text.is_empty() => r.device = None,
        Field::Device => r.device = Some(text.parse().map_err(|e| format!("run device: {e}"))?),
        Field::SeqLen => r.seq_len = whole("seq_len")?,
        Field::GlobalBatch => r.global_batch = whole("global_batch")?,
        Field::LoraRank => r.knobs.lora_rank = Some(whole("lora_rank")?),
        Field::AttentionKernel if text.is_empty() => r.attention_kernel = None,
        Field::AttentionKernel => {
            let k = <AttentionKernel as clap::ValueEnum>::from_str(text, true).map_err(|_| {
                let names: Vec<&str> = AttentionKernel::ALL.iter().map(|k| k.name()).collect();
                format!("attn_kernel: `{text}` is not one of {}", names.join(", "))
            })?;
            r.attention_kernel = (k != AttentionKernel::default()).then_some(k);
        }
        Field::Axis(_) => {}
    }
    Ok(())
}
