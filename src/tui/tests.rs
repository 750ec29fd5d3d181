//! The TUI end to end: events through `update`, then `render` on a test terminal.

use ratatui::Terminal;
use ratatui::backend::TestBackend;

use super::app::testdata::*;
use super::app::*;
use super::render::render;

fn draw(app: &App, w: u16, h: u16) -> Vec<String> {
    let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
    t.draw(|f| render(app, f)).unwrap();
    crate::ui::testing::rows(t.backend().buffer())
}

#[test]
fn a_whole_sweep_renders_at_every_step() {
    let mut app = fresh(false);
    let recs = finished_records(&app);
    for (index, record) in recs {
        update(&mut app, Event::TrialStarted { index });
        update(
            &mut app,
            Event::Sample(Sample {
                t_s: 0.0,
                tracked: MIB,
                rss: None,
                nvml: None,
            }),
        );
        for (w, h) in [(120, 40), (80, 24), (20, 5)] {
            draw(&app, w, h);
        }
        update(&mut app, Event::TrialFinished { index, record });
        update(
            &mut app,
            Event::Tick {
                elapsed_s: 10.0 * (index + 1) as f64,
            },
        );
    }
    update(&mut app, Event::SweepFinished);
    update(&mut app, Event::Tick { elapsed_s: 500.0 });
    let screen = draw(&app, 120, 40).join("\n");
    assert!(
        screen.contains("trials 4/5 finished · 1 skipped │ elapsed 1:00 │"),
        "{screen}"
    );
    assert!(screen.contains("★ #1"), "{screen}");
    let narrow = draw(&app, 80, 24).join("\n");
    assert!(narrow.contains("┌recommendation"), "{narrow}");
    assert!(narrow.contains("│★ #1"), "{narrow}");
}

/// The GPU panel, nvitop-style: a row per GPU (memory bar in IEC units and
/// percent, utilisation, power, temperature) and its processes; on a GPU run
/// device without NVML, the reason instead.
#[test]
fn the_gpu_panel_shows_nvml_or_why_not() {
    use crate::telemetry::{GpuSample, ProcSample, Snapshot};
    let mut app = running(false);
    let gib = 1u64 << 30;
    update(
        &mut app,
        Event::Gpu(GpuView::Snapshot(Snapshot {
            at_s: 1.0,
            gpus: vec![GpuSample {
                index: 0,
                name: "NVIDIA H200".into(),
                memory_used_bytes: 100 * gib,
                memory_total_bytes: 140 * gib,
                utilization_pct: Some(97),
                memory_utilization_pct: Some(40),
                power_w: Some(612.4),
                power_limit_w: Some(700.0),
                sm_clock_mhz: Some(1980),
                temperature_c: Some(61),
                processes: vec![ProcSample {
                    pid: 4242,
                    used_bytes: Some(99 * gib),
                    name: Some("memfit".into()),
                }],
                error: None,
            }],
        })),
    );
    let screen = draw(&app, 120, 40).join("\n");
    assert!(screen.contains("GPUs (NVML)"), "{screen}");
    let row = screen
        .lines()
        .find(|l| l.contains("NVIDIA H200"))
        .unwrap_or_else(|| panic!("{screen}"));
    for part in [
        "100.00 GiB/140.00 GiB",
        "71.4%",
        "util  97%",
        "612/700 W",
        "61°C",
        "█",
        "░",
    ] {
        assert!(row.contains(part), "{part}: {row}");
    }
    assert!(screen.contains("4242 memfit"), "{screen}");
    assert!(screen.contains("99.00 GiB"), "{screen}");
    // Small terminals drop the panel rather than the grid.
    let small = draw(&app, 80, 16).join("\n");
    assert!(!small.contains("GPUs (NVML)"), "{small}");

    update(
        &mut app,
        Event::Gpu(GpuView::Missing(
            "no NVML: libnvidia-ml.so.1 could not be loaded (no NVIDIA driver)".into(),
        )),
    );
    let screen = draw(&app, 120, 40).join("\n");
    assert!(screen.contains("no NVML: libnvidia-ml.so.1"), "{screen}");
    // Without NVML on a cpu sweep there is no panel at all.
    let plain = draw(&running(false), 120, 40).join("\n");
    assert!(!plain.contains("GPUs (NVML)"), "{plain}");
}

/// A GPU trial's NVML peak sits under its tracked total, with its error.
#[test]
fn the_breakdown_shows_a_trials_nvml_peak() {
    let mut app = fresh(false);
    let (index, mut record) = finished_records(&app).into_iter().next().unwrap();
    if let Some(m) = record.measured.as_mut() {
        m.nvml_peak_bytes = Some(900 << 20);
    }
    record.nvml_error_pct = Some(12.5);
    update(&mut app, Event::TrialStarted { index });
    update(&mut app, Event::TrialFinished { index, record });
    let screen = draw(&app, 120, 40).join("\n");
    let line = screen
        .lines()
        .find(|l| l.contains("NVML peak"))
        .unwrap_or_else(|| panic!("{screen}"));
    assert!(line.contains("900.00 MiB err +12.5%"), "{line}");
}

/// Rows the plan will skip read "queued" until the sweep's very end (the
/// sweep records them last); they say so from the first screen, and the
/// trial counter counts only the trials that will run.
#[test]
fn rows_the_plan_skips_say_so_from_the_start() {
    use crate::sweep::driver::SweepOptions;
    let opts = SweepOptions {
        recipe: concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/sweep/one-group.yaml"
        )
        .into(),
        // meta plans exactly what cpu would hold, without calibrating.
        device: Some("meta:limit=8MiB".parse().unwrap()),
        out: std::env::temp_dir().join("memfit-tui-plan-skip-unused"),
        resume: true,
        exhaustive: false,
        break_lock: false,
        timing: Default::default(),
        timeout: std::time::Duration::from_secs(60),
        threads: Some(1),
        #[cfg(feature = "test-hooks")]
        fault: None,
        progress: false,
        hooks: None,
        rerun: Vec::new(),
        executor: Default::default(),
        retime: crate::sweep::retime::Retime::off(),
        lines: Default::default(),
    };
    let app = super::new_app(&opts, 100).unwrap();
    let skipped: Vec<usize> = app
        .rows
        .iter()
        .filter(|r| r.status == Status::PlannedSkip)
        .map(|r| r.index)
        .collect();
    // fp32 without checkpointing fits at micro-batch 2 only (the fixture's
    // own comment): 4, 8, 16 and 32 are over.
    assert!(skipped.contains(&1) && skipped.contains(&4), "{skipped:?}");
    assert!(!skipped.contains(&0), "{skipped:?}");
    for r in &app.rows {
        let over = r.predicted_total().unwrap() > app.header.usable;
        assert_eq!(r.status == Status::PlannedSkip, over, "#{}", r.index);
    }
    let p = app.progress();
    assert_eq!(
        (p.ran, p.to_run, p.skipped),
        (0, 20 - skipped.len(), skipped.len())
    );
    let screen = draw(&app, 120, 40).join("\n");
    let row1 = screen
        .lines()
        .find(|l| l.starts_with("  1 "))
        .unwrap_or_else(|| panic!("{screen}"));
    assert!(row1.contains("skip: pred OOM"), "{row1}");
    assert!(
        screen.contains(&format!(
            "trials 0/{} · {} skipped │",
            20 - skipped.len(),
            skipped.len()
        )),
        "{screen}"
    );
    // Its chart says why there is nothing to draw.
    let mut app = app;
    update(&mut app, Event::Key(Key::Down));
    let screen = draw(&app, 80, 24).join("\n");
    assert!(screen.contains("#1 is not run: the plan"), "{screen}");
}

/// `b` in the sweep view asks the front end to go back to the grid builder.
#[test]
fn b_goes_back_to_the_builder() {
    let mut app = running(false);
    assert_eq!(
        update(&mut app, Event::Key(Key::Char('b'))),
        vec![Action::Back]
    );
}
