//! The TUI end to end: events through `update`, then `render` on a test terminal.

use ratatui::Terminal;
use ratatui::backend::TestBackend;

use super::app::testdata::*;
use super::app::*;
use super::render::render;

fn draw(app: &App, w: u16, h: u16) -> Vec<String> {
    let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
    t.draw(|f| render(app, f)).unwrap();
    let buf = t.backend().buffer().clone();
    (0..h)
        .map(|y| {
            (0..w)
                .map(|x| buf[(x, y)].symbol().replace('\u{a0}', " "))
                .collect()
        })
        .collect()
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
    assert!(screen.contains("finished │ elapsed 1:00 │"), "{screen}");
    assert!(screen.contains("★ #1"), "{screen}");
    let narrow = draw(&app, 80, 24).join("\n");
    assert!(narrow.contains("┌recommendation"), "{narrow}");
    assert!(narrow.contains("│★ #1"), "{narrow}");
}
