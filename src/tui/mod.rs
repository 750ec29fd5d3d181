//! `memfit tui`: the interactive profiler and advisor. [`app`] holds the one
//! state, the closed event set and the pure `update`; [`render`] draws it;
//! [`term`] owns the terminal and runs the sweep in the background.

pub mod app;
pub mod render;
pub mod term;
#[cfg(test)]
mod tests;

use crate::backend::{DeviceKind, DeviceSpec};
use crate::error::Result;
use crate::plan::{load_recipe, plan};
use crate::sweep::driver::SweepOptions;
use crate::sweep::report::{SCHEMA_VERSION, SweepReport};
use app::{App, Header, Row};

/// The screen before the first trial: the recipe planned, every row queued.
pub fn new_app(opts: &SweepOptions, sample_ms: u64) -> Result<App> {
    let (mut recipe, model, hw) = load_recipe(&opts.recipe)?;
    if let Some(d) = &opts.device {
        recipe.device = Some(d.clone());
    }
    let kind = recipe.device.as_ref().map_or(DeviceKind::Cpu, |d| d.kind);
    let (capacity, overhead) = recipe.capacity(&hw);
    let planned = plan(&recipe, &model, &hw);
    let rows = planned
        .points
        .iter()
        .enumerate()
        .map(|(i, p)| Row::from_prediction(i, p))
        .collect();
    let header = Header {
        model: model.name.clone(),
        hardware: hw.display_name.clone(),
        device: DeviceSpec {
            kind,
            limit: Some(capacity - overhead.min(capacity)),
        }
        .to_string(),
        capacity,
        usable: (capacity as f64 * (1.0 - recipe.headroom)) as u64,
        usd_per_gpu_hour: planned.usd_per_gpu_hour,
        headroom: recipe.headroom,
        allow_numerics_change: recipe.allow_numerics_change,
        seq_len: recipe.seq_len,
        global_batch: recipe.global_batch,
        export_dir: opts.out.join("export"),
        no_color: false,
        sample_interval_ms: sample_ms,
    };
    Ok(App::new(header, rows))
}

/// A report of what the screen shows so far (an export before the sweep ends).
pub fn report_from_app(app: &App) -> SweepReport {
    let trials: Vec<_> = app.rows.iter().filter_map(|r| r.record.clone()).collect();
    let mut report = SweepReport {
        schema_version: SCHEMA_VERSION,
        memfit_version: env!("CARGO_PKG_VERSION").into(),
        recipe: String::new(),
        model: app.model.clone(),
        hardware: app.hardware.clone(),
        device: app.device.clone(),
        capacity_bytes: app.capacity,
        runtime_overhead_bytes: app.rows.first().map_or(0, |r| r.overhead_bytes),
        headroom: app.headroom,
        usd_per_gpu_hour: app.usd_per_gpu_hour,
        allow_numerics_change: app.allow_numerics_change,
        seq_len: app.seq_len,
        global_batch: app.global_batch,
        grid_size: app.rows.len(),
        trials_run: trials
            .iter()
            .filter(|t| t.measured.is_some() || t.exit.is_some())
            .count(),
        trials,
        recommendation: None,
        pareto: Vec::new(),
        interrupted: !app.finished,
    };
    crate::sweep::driver::recommend(&mut report);
    report
}
