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
