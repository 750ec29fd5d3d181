//! `memfit tui`: the interactive profiler and advisor. [`app`] holds the one
//! state, the closed event set and the pure `update`; [`render`] draws it;
//! [`term`] owns the terminal and runs the sweep in the background.

pub mod app;
pub mod builder;
pub mod render;
pub mod term;
#[cfg(test)]
mod tests;

use crate::error::Result;
use crate::sweep::driver::{SweepOptions, prepare};
use app::{App, Header, Row};

/// The screen before the first trial: the recipe planned, every row queued.
pub fn new_app(opts: &SweepOptions, sample_ms: u64) -> Result<App> {
    let prepared = prepare(opts)?;
    let rows = prepared
        .preds
        .iter()
        .zip(&prepared.targets)
        .enumerate()
        .map(|(i, (p, target))| Row {
            planned_target: target.clone(),
            ..Row::from_prediction(i, p)
        })
        .collect();
    let base = prepared.report;
    let header = Header {
        model: base.model.clone(),
        hardware: base.target.display_name.clone(),
        device: base.device.clone(),
        capacity: base.capacity_bytes,
        usable: base.usable_bytes(),
        headroom: base.headroom,
        allow_numerics_change: base.allow_numerics_change,
        seq_len: base.seq_len,
        global_batch: base.global_batch,
        export_dir: opts.out.join("export"),
        no_color: false,
        sample_interval_ms: sample_ms,
        base,
    };
    Ok(App::new(header, rows))
}
