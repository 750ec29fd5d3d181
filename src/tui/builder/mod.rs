//! The grid builder (`memfit tui --new`, and `memfit tui` without a
//! recipe): a form over every grid axis the planner has, re-planned on
//! every key, with the fit map, the recommendation, the selected point's
//! breakdown and what would make it fit. [`state`] is the pure state and
//! update, [`render`] draws it, [`compute`] is what it asks of the planner
//! and [`run`] is its terminal loop, which the sweep view hands back to.

pub mod axes;
pub mod compute;
pub mod render;
pub mod state;
#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::Duration;

use crossterm::event;
use ratatui::Terminal;
use ratatui::backend::Backend;

use crate::config::hardware::{builtin_hardware, builtin_networks, load_hardware};
use crate::config::profile::builtin_models;
use crate::error::{Error, Result};
use crate::plan::{PlanRecipe, Point};
use crate::units::fmt_bytes;
use compute::{Cache, Planned, complete_path, fixes, match_profile, replan_cached, write_recipe};
use state::{Action, Builder, Event, HwChoice, update};

/// The hardware list: the GPUs NVML sees on this machine first (as the
/// profile each one is, with its free memory), then every built-in profile.
pub fn hardware_choices(local: &[crate::telemetry::GpuSample]) -> Vec<HwChoice> {
    let mut out = Vec::new();
    for g in local {
        let total = g.memory_total_bytes;
        if let Some(profile) = match_profile(&g.name, total) {
            out.push(HwChoice {
                profile: profile.to_string(),
                label: format!(
                    "{profile}: this machine's GPU {} {}, {} free",
                    g.index,
                    g.name,
                    fmt_bytes(total.saturating_sub(g.memory_used_bytes))
                ),
            });
        }
    }
    for (name, _) in builtin_hardware() {
        if out.iter().any(|h: &HwChoice| h.profile == *name) {
            continue;
        }
        let label = match load_hardware(name) {
            Ok(hw) => format!("{name}: {} {}", hw.display_name, fmt_bytes(hw.memory)),
            Err(_) => name.to_string(),
        };
        out.push(HwChoice {
            profile: name.to_string(),
            label,
        });
    }
    out
}

/// A builder on `recipe`, with the built-in models, the local GPUs (where
/// NVML answers) and the built-in hardware and networks to choose from.
pub fn new_builder(recipe: PlanRecipe, out: PathBuf, no_color: bool) -> Builder {
    let local = crate::telemetry::Telemetry::open()
        .and_then(|t| t.sample(None))
        .map(|s| s.gpus)
        .unwrap_or_default();
    let mut b = Builder::new(
        recipe,
        builtin_models()
            .iter()
            .map(|(n, _)| n.to_string())
            .collect(),
        hardware_choices(&local),
        builtin_networks()
            .iter()
            .map(|(n, _)| n.to_string())
            .collect(),
        out,
    );
    b.no_color = no_color;
    b
}

/// How the builder was left.
pub enum Exit {
    Quit,
    /// Measure this recipe (written to this path) in the sweep view.
    Sweep(PathBuf),
}

enum Job {
    Plan(u64, Box<PlanRecipe>),
    Fixes(u64, Arc<Planned>, Point),
}

/// The planner's thread: the newest plan first (older ones are dropped
/// unplanned), then the newest fixes.
fn worker(jobs: Receiver<Job>, tx: Sender<Event>) {
    let mut cache = Cache::default();
    while let Ok(first) = jobs.recv() {
        let mut plan_job = None;
        let mut fix_job = None;
        for j in std::iter::once(first).chain(jobs.try_iter()) {
            match j {
                Job::Plan(g, r) => plan_job = Some((g, r)),
                Job::Fixes(g, p, pt) => fix_job = Some((g, p, pt)),
            }
        }
        if let Some((g, r)) = plan_job {
            let res = replan_cached(&r, &mut cache).map(Arc::new);
            if tx.send(Event::Planned(g, res)).is_err() {
                return;
            }
        }
        if let Some((g, p, pt)) = fix_job {
            let f = fixes(&p, &pt);
            if tx.send(Event::Fixes(g, pt, f)).is_err() {
                return;
            }
        }
    }
}

/// Runs the builder on `terminal` until the user quits or starts a sweep.
pub fn run<B: Backend>(terminal: &mut Terminal<B>, b: &mut Builder) -> Result<Exit> {
    let (job_tx, job_rx) = channel::<Job>();
    let (tx, rx) = channel::<Event>();
    std::thread::spawn(move || worker(job_rx, tx));
    let size = terminal
        .size()
        .map(|s| (s.width, s.height))
        .unwrap_or((80, 24));
    update(
        b,
        Event::Resize {
            width: size.0,
            height: size.1,
        },
    );
    let mut pending = state::start(b);
    // Drawn again only after something changed: a key, a resize, an answer.
    let mut dirty = true;
    loop {
        dirty |= !pending.is_empty();
        for action in std::mem::take(&mut pending) {
            match action {
                Action::Quit => return Ok(Exit::Quit),
                Action::Plan(g, r) => {
                    let _ = job_tx.send(Job::Plan(g, r));
                }
                Action::Fixes(g, pt) => {
                    if let Some(p) = b.planned.clone() {
                        let _ = job_tx.send(Job::Fixes(g, p, pt));
                    }
                }
                Action::Complete(prefix) => {
                    pending.extend(update(b, Event::Completed(complete_path(&prefix))));
                }
                Action::Write(r) => {
                    let res = write_recipe(&r, &b.out);
                    pending.extend(update(b, Event::Written(res)));
                }
                Action::Sweep(r) => match write_recipe(&r, &b.out) {
                    Ok(path) => return Ok(Exit::Sweep(path)),
                    Err(e) => pending.extend(update(b, Event::Written(Err(e)))),
                },
            }
        }
        for ev in rx.try_iter() {
            pending.extend(update(b, ev));
            dirty = true;
        }
        if dirty {
            terminal
                .draw(|f| render::render(b, f))
                .map_err(|e| Error::Unavailable(format!("cannot draw: {e}")))?;
            dirty = false;
        }
        if !pending.is_empty() {
            continue;
        }
        // Wake for a key, or soon for the planner's answer.
        let ready = event::poll(Duration::from_millis(30))
            .map_err(|_| Error::Unavailable("cannot read the terminal".into()))?;
        if !ready {
            continue;
        }
        match event::read() {
            Ok(crossterm::event::Event::Key(k)) => {
                if let Some(key) = super::term::key_of(k) {
                    pending.extend(update(b, Event::Key(key)));
                    dirty = true;
                }
            }
            Ok(crossterm::event::Event::Resize(width, height)) => {
                update(b, Event::Resize { width, height });
                dirty = true;
            }
            Ok(_) => {}
            Err(e) => return Err(Error::Unavailable(format!("cannot read the terminal: {e}"))),
        }
    }
}
