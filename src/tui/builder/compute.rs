//! What the builder asks of the planner: the recipe loaded and planned
//! (`crate::plan::plan`, the same function `memfit plan` calls), the fit
//! map drawn from that plan, a point's neighbours in the grid, the cheapest
//! single changes that make a point fit, and the recipe written back as
//! YAML. These read profiles and files, so the terminal loop runs them on a
//! worker thread; [`super::state::update`] only asks for them.

use std::path::{Path, PathBuf};

use rayon::prelude::*;

use super::axes::{AXES, Axis, same_knobs, with_accum};
use crate::config::ModelConfig;
use crate::config::hardware::{HardwareProfile, builtin_hardware, load_hardware, load_network};
use crate::config::profile::{load_model, looks_like_path};
use crate::engine::{Framework, Sharding};
use crate::plan::{
    Plan, PlanRecipe, PlanTarget, Point, Prediction, Rates, Verdict, name, plan_with, predict,
};

/// The most points the builder plans on each key: a few thousand plan in
/// well under a second on a small model; more is a recipe for `memfit plan`.
pub const MAX_BUILDER_POINTS: usize = 4096;

/// A recipe planned, with what it was planned against.
#[derive(Clone, Debug)]
pub struct Planned {
    pub recipe: PlanRecipe,
    pub model: ModelConfig,
    pub hw: HardwareProfile,
    pub plan: Plan,
}

/// The model and hardware (with the recipe's network) of `r`, checked as
/// `memfit plan` checks a recipe file; the error is one line.
pub fn load(r: &PlanRecipe) -> Result<(ModelConfig, HardwareProfile), String> {
    let one_line = |what: &str, e: crate::error::Error| {
        let s = e.to_string();
        format!("{what}: {}", s.lines().next().unwrap_or_default())
    };
    let model = load_model(&r.model).map_err(|e| one_line("model", e))?;
    let mut hw = load_hardware(&r.hardware).map_err(|e| one_line("hardware", e))?;
    if let Some(net) = &r.network {
        let net = load_network(net).map_err(|e| one_line("network", e))?;
        hw.use_network(&net);
    }
    // The recipe's kernel, while some point runs fused attention (a grid
    // toggled to eager only leaves it unused, and `to_yaml` unwritten).
    if let Some(k) = r
        .attention_kernel
        .filter(|_| r.grid.attention.iter().any(|a| a.fused()))
    {
        hw.use_attention_kernel(k)
            .map_err(|e| format!("attention_kernel: {e}"))?;
    }
    // Steps priced as `memfit plan` prices them: with the GPU calibration
    // bound to the profile, where `memfit calibrate --device cuda` stored one.
    crate::calibrate::gpu::attach_bound(&mut hw);
    Ok((model, hw))
}

/// Plans `r` as `memfit plan` would plan it written to a file.
pub fn replan(r: &PlanRecipe) -> Result<Planned, String> {
    replan_cached(r, &mut Cache::default())
}

/// The predictions of the last plans, for one recipe, model and hardware
/// (everything but the grid): a toggle then plans only the points it adds.
#[derive(Default)]
pub struct Cache {
    key: String,
    points: std::collections::HashMap<Point, Prediction>,
}

/// The most predictions the cache keeps before it starts over.
const CACHE_POINTS: usize = 65_536;

/// [`replan`], planning only the points `cache` does not hold.
pub fn replan_cached(r: &PlanRecipe, cache: &mut Cache) -> Result<Planned, String> {
    let n = r.grid.size().unwrap_or(usize::MAX);
    if n > MAX_BUILDER_POINTS {
        return Err(format!(
            "the grid has {n} points; the builder re-plans at most {MAX_BUILDER_POINTS} on each key: turn some values off (a recipe file for `memfit plan` takes up to {})",
            crate::plan::MAX_GRID_POINTS
        ));
    }
    let (model, hw) = load(r)?;
    crate::plan::check(r, &model)?;
    // Everything a point's prediction reads besides the point itself.
    let mut bare = r.clone();
    bare.grid = Default::default();
    let key = format!("{}{model:?}{hw:?}", to_yaml(&bare));
    if key != cache.key || cache.points.len() > CACHE_POINTS {
        cache.key = key;
        cache.points.clear();
    }
    let known = &cache.points;
    let plan = plan_with(r, &model, &hw, &|pt: &Point| known.get(pt).cloned());
    for x in &plan.points {
        cache
            .points
            .entry(x.point)
            .or_insert_with(|| crate::plan::unlifted(x));
    }
    Ok(Planned {
        recipe: r.clone(),
        model,
        hw,
        plan,
    })
}

/// How a point's margin reads on the fit map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fit {
    /// Fits with at least a tenth of the usable memory to spare.
    Fits,
    /// Fits, but with less than a tenth of the usable memory to spare, or
    /// less than the caching allocator's fragmentation (hf-eager).
    Tight,
    Over,
    Invalid,
}

impl Fit {
    /// The cell's glyph, which reads without colour too.
    pub fn glyph(self) -> &'static str {
        match self {
            Fit::Fits => "●",
            Fit::Tight => "◐",
            Fit::Over => "✗",
            Fit::Invalid => "·",
        }
    }
    pub fn word(self) -> &'static str {
        match self {
            Fit::Fits => "fits",
            Fit::Tight => "tight",
            Fit::Over => "over",
            Fit::Invalid => "invalid",
        }
    }
}

pub fn fit_of(p: &Prediction) -> Fit {
    match p.verdict {
        Verdict::Invalid { .. } => Fit::Invalid,
        Verdict::DoesNotFit => Fit::Over,
        Verdict::Fits => {
            let frag = p
                .allocator
                .map_or(0, |a| a.max_memory_reserved - a.max_memory_allocated);
            let tenth = p.usable_bytes / 10;
            match p.margin_bytes < tenth.max(frag) as i64 {
                true => Fit::Tight,
                false => Fit::Fits,
            }
        }
    }
}

/// The fit map: a row per knob combination (everything but the
/// micro-batch), a column per micro-batch; each cell a point's index in the
/// plan.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FitMap {
    pub cols: Vec<usize>,
    pub rows: Vec<MapRow>,
}

impl FitMap {
    /// The row and column of the first cell whose point `hit` picks.
    pub fn cell_of(&self, hit: impl Fn(usize) -> bool) -> Option<(usize, usize)> {
        self.rows.iter().enumerate().find_map(|(r, row)| {
            let c = row.cells.iter().position(|c| c.is_some_and(&hit))?;
            Some((r, c))
        })
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct MapRow {
    /// The knobs that vary in the grid (the others are said once).
    pub label: String,
    pub cells: Vec<Option<usize>>,
}

/// The axes with more than one value in the grid, micro-batch aside.
pub fn varying(r: &PlanRecipe) -> Vec<Axis> {
    AXES.iter()
        .copied()
        .filter(|&a| a != Axis::MicroBatch && a.get(&r.grid).len() > 1)
        .collect()
}

pub fn fit_map(p: &Planned) -> FitMap {
    let cols = p.recipe.grid.micro_batch.clone();
    let vary = varying(&p.recipe);
    let mut rows: Vec<(Point, MapRow)> = Vec::new();
    for (i, pred) in p.plan.points.iter().enumerate() {
        let mut key = pred.point;
        key.micro_batch = 0;
        key.grad_accum = 0;
        let col = cols.iter().position(|&m| m == pred.point.micro_batch);
        let at = match rows.iter().position(|(k, _)| *k == key) {
            Some(at) => at,
            None => {
                let label = match vary.is_empty() {
                    true => "every point".to_string(),
                    false => (vary.iter())
                        .map(|a| a.show(&a.of(&pred.point)))
                        .collect::<Vec<_>>()
                        .join(" "),
                };
                rows.push((
                    key,
                    MapRow {
                        label,
                        cells: vec![None; cols.len()],
                    },
                ));
                rows.len() - 1
            }
        };
        if let Some(c) = col {
            rows[at].1.cells[c] = Some(i);
        }
    }
    FitMap {
        cols,
        rows: rows.into_iter().map(|(_, r)| r).collect(),
    }
}

/// The same point with one knob changed, as the grid has it.
#[derive(Clone, Debug, PartialEq)]
pub struct Neighbour {
    pub axis: Axis,
    pub value: String,
    pub index: usize,
}

/// The points of the plan one knob away from point `i`.
pub fn neighbours(p: &Planned, i: usize) -> Vec<Neighbour> {
    let me = p.plan.points[i].point;
    let mut out = Vec::new();
    for axis in AXES {
        for v in axis.get(&p.recipe.grid) {
            if v == axis.of(&me) {
                continue;
            }
            let mut q = me;
            axis.put(&mut q, &v);
            if let Some(j) = (p.plan.points.iter()).position(|x| same_knobs(&x.point, &q)) {
                out.push(Neighbour {
                    axis,
                    value: v,
                    index: j,
                });
            }
        }
    }
    out
}

/// One change to the grid.
#[derive(Clone, Debug, PartialEq)]
pub enum Change {
    /// Turn this value on.
    Axis(Axis, String),
    /// Plan for this hardware profile instead.
    Hardware(String),
}

impl Change {
    pub fn label(&self) -> String {
        match self {
            Change::Axis(a, v) => format!("{} {v}", a.key()),
            Change::Hardware(h) => format!("hardware {h}"),
        }
    }
}

/// A change that makes a point fit, and what the point then costs.
#[derive(Clone, Debug)]
pub struct Fix {
    pub changes: Vec<Change>,
    pub pred: Prediction,
    /// The capacity it was planned against (another GPU's, for a bigger
    /// hardware profile).
    pub capacity: u64,
    /// Every change is already in the grid.
    pub in_grid: bool,
}

/// The single changes (one knob, or one knob and the sharding it needs)
/// that make `point` fit, cheapest first by the plan's $/Mtok: other values
/// of every axis, in the grid or not, and bigger hardware profiles.
pub fn fixes(p: &Planned, point: &Point) -> Vec<Fix> {
    let r = &p.recipe;
    let usd = r.cost.unwrap_or(p.hw.usd_per_hour);
    let rates = Rates::gpu(&p.hw, usd);
    let (cap, overhead) = r.capacity(&p.hw);
    let mut candidates: Vec<Vec<Change>> = Vec::new();
    for axis in AXES {
        for v in axis.options(&r.grid) {
            if v == axis.of(point) {
                continue;
            }
            let mut changes = vec![Change::Axis(axis, v.clone())];
            // More GPUs need a data-parallel scheme; offload needs ZeRO.
            let needs_zero3 = match axis {
                Axis::Gpus => point.sharding == Sharding::None && v != "1",
                Axis::Offload => match v.as_str() {
                    "optimizer" => !point.sharding.shards_optimizer(),
                    "optimizer+params" => !point.sharding.shards_parameters(),
                    _ => false,
                },
                _ => false,
            };
            if needs_zero3 {
                changes.push(Change::Axis(Axis::Sharding, name(Sharding::Zero3)));
            }
            candidates.push(changes);
        }
    }
    // Each candidate is one point of the planner, planned in parallel.
    let target = PlanTarget {
        recipe: r,
        model: &p.model,
        rates: &rates,
        capacity: cap,
        overhead,
    };
    let mut out: Vec<Fix> = candidates
        .into_par_iter()
        .filter_map(|changes| {
            let mut q = *point;
            let mut r2 = r.clone();
            for c in &changes {
                if let Change::Axis(a, v) = c {
                    a.put(&mut q, v);
                    let mut vals = a.get(&r2.grid);
                    if !vals.contains(v) {
                        vals.push(v.clone());
                        a.set(&mut r2.grid, &vals);
                    }
                }
            }
            if q.gpus > crate::plan::MAX_GPUS || crate::plan::check(&r2, &p.model).is_err() {
                return None;
            }
            let q = with_accum(q, r.global_batch);
            let pred = predict(&target, &q);
            (pred.verdict == Verdict::Fits).then(|| Fix {
                in_grid: changes.iter().all(|c| match c {
                    Change::Axis(a, v) => a.get(&r.grid).contains(v),
                    Change::Hardware(_) => false,
                }),
                changes,
                pred,
                capacity: cap,
            })
        })
        .collect();
    // A bigger GPU, where the capacity is the GPU's (not a device limit).
    if r.device.as_ref().and_then(|d| d.limit).is_none() {
        let q = with_accum(*point, r.global_batch);
        for (hw_name, _) in builtin_hardware() {
            let Ok(mut hw) = load_hardware(hw_name) else {
                continue;
            };
            if hw.memory <= p.hw.memory || hw.name == p.hw.name {
                continue;
            }
            if let Some(net) = r.network.as_deref().and_then(|n| load_network(n).ok()) {
                hw.use_network(&net);
            }
            // A GPU without the recipe's kernel's rates prices the default.
            if let Some(k) = r.attention_kernel {
                let _ = hw.use_attention_kernel(k);
            }
            let rates = Rates::gpu(&hw, r.cost.unwrap_or(hw.usd_per_hour));
            let (cap, overhead) = r.capacity(&hw);
            let target = PlanTarget {
                recipe: r,
                model: &p.model,
                rates: &rates,
                capacity: cap,
                overhead,
            };
            let pred = predict(&target, &q);
            if pred.verdict == Verdict::Fits {
                out.push(Fix {
                    changes: vec![Change::Hardware(hw_name.to_string())],
                    pred,
                    capacity: cap,
                    in_grid: false,
                });
            }
        }
    }
    out.sort_by(|a, b| {
        (a.pred.excluded.cmp(&b.pred.excluded))
            .then(a.pred.usd_per_mtok.total_cmp(&b.pred.usd_per_mtok))
            .then(b.pred.margin_bytes.cmp(&a.pred.margin_bytes))
    });
    out
}

pub use crate::config::hardware::match_profile;

/// A path spec made absolute, so that the written recipe finds it from its
/// own folder (`memfit plan` reads a recipe's paths relative to it).
pub fn absolute(spec: &str) -> String {
    match looks_like_path(spec) && Path::new(spec).is_relative() {
        true => {
            std::path::absolute(spec).map_or_else(|_| spec.to_string(), |p| p.display().to_string())
        }
        false => spec.to_string(),
    }
}

/// A YAML scalar: bare when YAML reads it back as the same string.
fn scalar(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./+".contains(c))
        && !matches!(
            s,
            "true" | "false" | "null" | "yes" | "no" | "on" | "off" | "~"
        )
        && s.parse::<f64>().is_err();
    match plain {
        true => s.to_string(),
        false => serde_json::to_string(s).expect("a string serialises"),
    }
}

/// The recipe in the schema `memfit plan` reads, every grid axis written
/// out (the framework too: absent, `plan` and `sweep` would default it
/// differently). Keys at their defaults are left out.
pub fn to_yaml(r: &PlanRecipe) -> String {
    use std::fmt::Write as _;
    let mut s = String::from(
        "# Written by the memfit tui grid builder; `memfit plan` of this file gives\n# the figures the builder showed.\n",
    );
    let _ = writeln!(s, "model: {}", scalar(&r.model));
    let _ = writeln!(s, "hardware: {}", scalar(&r.hardware));
    if let Some(n) = &r.network {
        let _ = writeln!(s, "network: {}", scalar(n));
    }
    // Only where a point runs fused attention: `memfit plan` refuses the
    // key on a grid that does not.
    if let Some(k) = r
        .attention_kernel
        .filter(|_| r.grid.attention.iter().any(|a| a.fused()))
    {
        let _ = writeln!(s, "attention_kernel: {k}");
    }
    if let Some(d) = &r.device {
        // Display rounds a limit to two decimals of its unit; bytes do not.
        let shown = d.to_string();
        let exact = shown.parse::<crate::backend::DeviceSpec>().ok().as_ref() == Some(d);
        let text = match (exact, d.limit) {
            (false, Some(l)) => {
                let mut bare = d.clone();
                bare.limit = None;
                let sep = if bare.ordinal.is_some() { ',' } else { ':' };
                format!("{bare}{sep}limit={l}")
            }
            _ => shown,
        };
        let _ = writeln!(s, "device: {}", scalar(&text));
    }
    let _ = writeln!(s, "seq_len: {}", r.seq_len);
    let _ = writeln!(s, "global_batch: {}", r.global_batch);
    let _ = writeln!(s, "headroom: {}", r.headroom);
    if let Some(c) = r.cost {
        let _ = writeln!(s, "cost: {c}");
    }
    if let Some(c) = r.host_usd_per_hour {
        let _ = writeln!(s, "host_usd_per_hour: {c}");
    }
    if !r.allow_numerics_change {
        s.push_str("allow_numerics_change: false\n");
    }
    // The fixed knobs, those set and off their defaults, and only those
    // some point of the grid uses (a plan recipe refuses the others).
    let mut written = r.grid.clone();
    written.frameworks_or(Framework::Memfit);
    let mut k = r.knobs.clone();
    k.retain(|name| crate::plan::unused_by(&written, name).is_none());
    let (hf, d) = (k.hf(), crate::engine::framework::HfKnobs::default());
    if hf.dropout != d.dropout {
        let _ = writeln!(s, "dropout: {}", hf.dropout);
    }
    if hf.optimizer_impl != d.optimizer_impl {
        let _ = writeln!(
            s,
            "optimizer_impl: {}",
            serde_json::to_string(&hf.optimizer_impl).expect("serialises")
        );
    }
    if hf.set_to_none != d.set_to_none {
        let _ = writeln!(s, "set_to_none: {}", hf.set_to_none);
    }
    if hf.param_groups != d.param_groups {
        let _ = writeln!(s, "param_groups: {}", crate::plan::name(hf.param_groups));
    }
    if hf.optimizer_in_backward {
        let _ = writeln!(s, "optimizer_in_backward: true");
    }
    if let Some(c) = k.loss_chunks {
        let _ = writeln!(s, "loss_chunks: {c}");
    }
    if hf.compile_loss {
        let _ = writeln!(s, "compile_loss: true");
    }
    if hf.liger != d.liger {
        let _ = writeln!(s, "liger: {}", hf.liger);
    }
    if let Some(n) = k.lora_rank {
        let _ = writeln!(s, "lora_rank: {n}");
    }
    if let Some(a) = k.lora_alpha {
        let _ = writeln!(s, "lora_alpha: {a}");
    }
    if let Some(d) = k.lora_dropout {
        let _ = writeln!(s, "lora_dropout: {d}");
    }
    if let Some(t) = &k.lora_targets {
        let _ = writeln!(
            s,
            "lora_targets: {}",
            serde_json::to_string(t).expect("serialises")
        );
    }
    if let Some(h) = k.host_memory {
        let _ = writeln!(s, "host_memory: {}", h.0);
    }
    s.push_str("grid:\n");
    let mut g = r.grid.clone();
    g.frameworks_or(Framework::Memfit);
    for axis in AXES {
        // Numbers, booleans and knob names: plain YAML scalars.
        let _ = writeln!(s, "  {}: [{}]", axis.key(), axis.get(&g).join(", "));
    }
    s
}

/// Writes `r` as `<dir>/recipe.yaml` (path specs made absolute); the path.
pub fn write_recipe(r: &PlanRecipe, dir: &Path) -> Result<PathBuf, String> {
    let mut r = r.clone();
    r.model = absolute(&r.model);
    r.hardware = absolute(&r.hardware);
    r.network = r.network.as_deref().map(absolute);
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join("recipe.yaml");
    std::fs::write(&path, to_yaml(&r)).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

/// Completions of a path being typed: the entries of its folder that start
/// with its last part (folders with a trailing `/`), sorted.
pub fn complete_path(prefix: &str) -> Vec<String> {
    let (dir, stem) = match prefix.rfind('/') {
        Some(i) => (&prefix[..=i], &prefix[i + 1..]),
        None => ("", prefix),
    };
    let read = match dir {
        "" => std::fs::read_dir("."),
        d => std::fs::read_dir(d),
    };
    let Ok(entries) = read else {
        return Vec::new();
    };
    let mut out: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().to_string();
            if !n.starts_with(stem) || (n.starts_with('.') && !stem.starts_with('.')) {
                return None;
            }
            let slash = match e.file_type().is_ok_and(|t| t.is_dir()) {
                true => "/",
                false => "",
            };
            Some(format!("{dir}{n}{slash}"))
        })
        .collect();
    out.sort();
    out
}
