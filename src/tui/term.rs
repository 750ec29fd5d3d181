//! The terminal side of `memfit tui`: raw mode and the alternate screen
//! (restored on exit, on error and on panic), crossterm keys into
//! [`Event`]s, the sweep on a background thread, and a ~10 fps render loop
//! that never waits on the sweep.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossterm::event::{self, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use ratatui::Terminal;

use super::app::{Action, App, Event, Key, update};
use super::builder::state::Builder;
use super::render::render;
use crate::backend::DeviceSpec;
use crate::error::{Error, Result};
use crate::report::sweep::SweepReport;
use crate::sweep::driver::{Hooks, SweepEvent, SweepOptions, sweep};

/// The grid `memfit tui` opens on without a recipe: the quickstart.
pub const DEFAULT_RECIPE: &str = include_str!("../../recipes/quickstart.yaml");

/// What `memfit tui` was asked to do.
#[derive(Clone, Debug)]
pub struct TuiOptions {
    pub recipe: Option<PathBuf>,
    /// Open the grid builder (on `recipe`, else on the quickstart's grid)
    /// rather than the recipe's sweep.
    pub new: bool,
    pub device: Option<DeviceSpec>,
    pub out: PathBuf,
    /// How often the running trial reports its memory.
    pub sample_ms: u64,
    pub timing: crate::stats::Timing,
    pub timeout: Duration,
    pub threads: Option<usize>,
}

pub(crate) fn key_of(k: KeyEvent) -> Option<Key> {
    if k.kind == KeyEventKind::Release {
        return None;
    }
    if k.modifiers.contains(KeyModifiers::CONTROL) && k.code == KeyCode::Char('c') {
        return Some(Key::CtrlC);
    }
    Some(match k.code {
        KeyCode::Char(c) => Key::Char(c),
        KeyCode::Up => Key::Up,
        KeyCode::Down => Key::Down,
        KeyCode::Left => Key::Left,
        KeyCode::Right => Key::Right,
        KeyCode::Enter => Key::Enter,
        KeyCode::Esc => Key::Esc,
        KeyCode::Backspace => Key::Backspace,
        KeyCode::Tab => Key::Tab,
        KeyCode::PageUp => Key::PageUp,
        KeyCode::PageDown => Key::PageDown,
        KeyCode::Home => Key::Home,
        KeyCode::End => Key::End,
        _ => return None,
    })
}

/// The sweep thread's handle.
struct Runner {
    stop: Arc<AtomicBool>,
    pause: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<SweepReport>>>,
}

/// Starts the sweep on its own thread. `start` is when the TUI's clock
/// started: the sweep's end is stamped with it, so elapsed stops there.
fn start_sweep(
    base: &SweepOptions,
    tx: &Sender<Event>,
    pause: Arc<AtomicBool>,
    sample_ms: u64,
    start: Instant,
) -> Runner {
    let stop = Arc::new(AtomicBool::new(false));
    let tx = Mutex::new(tx.clone());
    let hooks = Hooks {
        on_event: Arc::new(move |e| {
            let ev = match e {
                SweepEvent::Planned(_) => return,
                SweepEvent::TrialStarted { index } => Event::TrialStarted { index },
                SweepEvent::Sample {
                    t_s,
                    tracked,
                    rss,
                    nvml,
                } => Event::Sample(super::app::Sample {
                    t_s,
                    tracked,
                    rss,
                    nvml,
                }),
                SweepEvent::TrialFinished { index, record } => Event::TrialFinished {
                    index,
                    record: *record,
                },
                SweepEvent::Finished(report) => {
                    let tx = tx.lock().unwrap_or_else(|e| e.into_inner());
                    let elapsed_s = start.elapsed().as_secs_f64();
                    let _ = tx.send(Event::Tick { elapsed_s });
                    let _ = tx.send(Event::Ranked(report));
                    let _ = tx.send(Event::SweepFinished);
                    return;
                }
            };
            let _ = tx.lock().unwrap_or_else(|e| e.into_inner()).send(ev);
        }),
        stop: stop.clone(),
        pause: pause.clone(),
        sample_ms,
    };
    let opts = SweepOptions {
        hooks: Some(hooks),
        ..base.clone()
    };
    let thread = std::thread::spawn(move || sweep(&opts));
    Runner {
        stop,
        pause,
        thread: Some(thread),
    }
}

/// Why `memfit tui` will not start where its output is no terminal (a
/// pipe, a file, a CI log): one line, before anything is written.
pub const NOT_A_TERMINAL: &str = "memfit tui needs a terminal, and its output is not one (a pipe or a file); for a headless run use `memfit sweep RECIPE --out DIR`";

/// The sweep view's screen before its first frame: the recipe planned and
/// the journal looked at (done before the terminal is taken, so that a bad
/// recipe given on the command line is one line on stderr).
struct SweepSetup {
    recipe: PathBuf,
    base: SweepOptions,
    app: App,
    journal: PathBuf,
    finished_before: usize,
}

fn no_color() -> bool {
    std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty())
}

/// `device` is `--device` for a recipe from the command line, and `None`
/// for the builder's, which carries the run device chosen in it.
fn prepare_sweep(
    opts: &TuiOptions,
    recipe: &std::path::Path,
    device: Option<DeviceSpec>,
) -> Result<SweepSetup> {
    let journal = opts.out.join("trials.jsonl");
    let finished_before = std::fs::read_to_string(&journal)
        .map(|s| s.lines().filter(|l| !l.trim().is_empty()).count())
        .unwrap_or(0);
    let base = SweepOptions {
        recipe: recipe.to_path_buf(),
        device,
        out: opts.out.clone(),
        resume: true,
        exhaustive: false,
        break_lock: false,
        timing: opts.timing,
        timeout: opts.timeout,
        threads: opts.threads,
        #[cfg(feature = "test-hooks")]
        fault: None,
        progress: false,
        hooks: None,
        rerun: Vec::new(),
        executor: Default::default(),
        // The screen ranks trials as they come in, on their own measurements
        // (`driver::recommend`); re-timing afterwards would leave the report
        // files ranking otherwise than the screen does.
        retime: crate::sweep::retime::Retime::off(),
        lines: Default::default(),
    };
    let mut app = super::new_app(&base, opts.sample_ms)?;
    app.header.no_color = no_color();
    Ok(SweepSetup {
        recipe: recipe.to_path_buf(),
        base,
        app,
        journal,
        finished_before,
    })
}

/// The grid `memfit tui` builds on without a recipe: the quickstart's.
pub fn default_recipe() -> crate::plan::PlanRecipe {
    crate::config::profile::parse_yaml(DEFAULT_RECIPE, "recipes/quickstart.yaml")
        .expect("the built-in quickstart recipe parses")
}

/// A builder on a recipe file, as `memfit plan` reads it (its paths
/// relative to it), with `--device` in place of its device.
fn builder_on(opts: &TuiOptions, recipe: Option<&std::path::Path>) -> Result<Builder> {
    let mut r = match recipe {
        Some(path) => crate::plan::load_recipe(path)?.0,
        None => default_recipe(),
    };
    if let Some(d) = &opts.device {
        r.device = Some(d.clone());
    }
    Ok(super::builder::new_builder(r, opts.out.clone(), no_color()))
}

/// Runs the TUI until the user quits; returns the process exit code. It
/// opens on the grid builder (`--new`, or no recipe) or on the sweep of a
/// recipe, and goes back and forth between the two (Enter in the builder,
/// `b` in the sweep view).
pub fn run_tui(opts: &TuiOptions) -> Result<i32> {
    // Raw mode and the alternate screen would write escape codes into the
    // pipe; refuse before any of it (and before the output directory).
    if !std::io::stdout().is_terminal() {
        return Err(Error::Unavailable(NOT_A_TERMINAL.into()));
    }
    std::fs::create_dir_all(&opts.out).map_err(|source| Error::Write {
        path: opts.out.clone(),
        source,
    })?;
    let (mut builder, mut next_sweep) = match (&opts.recipe, opts.new) {
        (Some(recipe), false) => (
            None,
            Some(prepare_sweep(opts, recipe, opts.device.clone())?),
        ),
        (recipe, _) => (Some(builder_on(opts, recipe.as_deref())?), None),
    };

    // From here on the terminal is ours, given back however we leave. Only
    // this, the drawing thread, owns it: a panic on the sweep thread is
    // reported on screen by the loop instead.
    let mut screen = crate::ui::Screen::enter().map_err(Error::Unavailable)?;
    let terminal = &mut screen.terminal;
    let result = loop {
        if let Some(setup) = next_sweep.take() {
            let recipe = setup.recipe.clone();
            match sweep_view(terminal, opts, setup) {
                Ok(SweepExit::Quit) => break Ok(0),
                Ok(SweepExit::Back) => {
                    if builder.is_none() {
                        match builder_on(opts, Some(&recipe)) {
                            Ok(b) => builder = Some(b),
                            Err(e) => break Err(e),
                        }
                    }
                }
                Err(e) => break Err(e),
            }
        }
        let Some(b) = builder.as_mut() else {
            break Ok(0);
        };
        let _ = terminal.clear();
        match super::builder::run(terminal, b) {
            Ok(super::builder::Exit::Quit) => break Ok(0),
            Ok(super::builder::Exit::Sweep(path)) => match prepare_sweep(opts, &path, None) {
                Ok(setup) => {
                    let _ = terminal.clear();
                    next_sweep = Some(setup);
                }
                Err(e) => b.message = Some(format!("cannot start the sweep: {e}")),
            },
            Err(e) => break Err(e),
        }
    };
    drop(screen);
    result
}

/// How the sweep view was left.
enum SweepExit {
    Quit,
    /// `b`: back to the builder.
    Back,
}

/// The sweep view: runs the sweep of `setup` until the user quits or goes
/// back to the builder; the sweep is stopped either way (its journal kept).
fn sweep_view<B: ratatui::backend::Backend>(
    terminal: &mut Terminal<B>,
    opts: &TuiOptions,
    setup: SweepSetup,
) -> Result<SweepExit> {
    let mut view = SweepScreen::open(terminal, opts, setup);
    let frame = Duration::from_millis(100);
    let result = loop {
        // Sweep events first, then at most one frame's wait for a key.
        for ev in view.rx.try_iter() {
            update(&mut view.app, ev);
        }
        view.reap_finished_sweep();
        view.sample_gpu();
        update(
            &mut view.app,
            Event::Tick {
                elapsed_s: view.start.elapsed().as_secs_f64(),
            },
        );
        if let Err(e) = terminal.draw(|f| render(&view.app, f)) {
            break Err(Error::Unavailable(format!("cannot draw: {e}")));
        }
        let Ok(ready) = event::poll(frame) else {
            break Err(Error::Unavailable("cannot read the terminal".into()));
        };
        if !ready {
            continue;
        }
        let key = match event::read() {
            Ok(crossterm::event::Event::Key(k)) => key_of(k),
            Ok(crossterm::event::Event::Resize(width, height)) => {
                view.size = (width, height);
                update(&mut view.app, Event::Resize { width, height });
                None
            }
            Ok(_) => None,
            Err(e) => break Err(Error::Unavailable(format!("cannot read the terminal: {e}"))),
        };
        let Some(key) = key else { continue };
        let exit = if view.asking {
            view.answer_resume(key)
        } else {
            Ok(view.on_key(key))
        };
        match exit {
            Ok(None) => continue,
            Ok(Some(exit)) => break Ok(exit),
            Err(e) => break Err(e),
        }
    };
    view.stop();
    result
}

/// The sweep view's state around its [`App`]: the sweep's thread and its
/// channel, re-runs waiting for it, the resume question, and NVML.
struct SweepScreen<'o> {
    opts: &'o TuiOptions,
    base: SweepOptions,
    app: App,
    journal: PathBuf,
    tx: Sender<Event>,
    rx: Receiver<Event>,
    pause: Arc<AtomicBool>,
    runner: Option<Runner>,
    /// When the TUI's clock started.
    start: Instant,
    last_report: Option<SweepReport>,
    /// Re-runs asked for while a sweep runs: the next sweep's.
    queued_reruns: Vec<usize>,
    /// A journal from an earlier run: the view asks to resume it before
    /// anything runs.
    asking: bool,
    /// The screen's size, for where the page views end.
    size: (u16, u16),
    nvml: Option<crate::telemetry::Telemetry>,
    last_gpu: Instant,
}

impl<'o> SweepScreen<'o> {
    /// Opens NVML, asks about an earlier journal or starts the sweep.
    fn open<B: ratatui::backend::Backend>(
        terminal: &Terminal<B>,
        opts: &'o TuiOptions,
        setup: SweepSetup,
    ) -> Self {
        let SweepSetup {
            base,
            mut app,
            journal,
            finished_before,
            ..
        } = setup;
        // NVML where it answers; on a GPU run device without it, the panel says why.
        let on_gpu = app.header.base.run_device.kind == "cuda";
        let nvml = match crate::telemetry::Telemetry::open() {
            Ok(t) => Some(t),
            Err(why) => {
                if on_gpu {
                    app.gpu = Some(super::app::GpuView::Missing(format!("no NVML: {why}")));
                }
                None
            }
        };
        let last_gpu = Instant::now() - Duration::from_secs(1);
        let asking = finished_before > 0;
        if asking {
            app.message = Some(format!(
                "Resume? {} holds {finished_before} finished trials from an earlier run: y resumes them (they are not run again), n moves them aside and starts over, q quits.",
                journal.display()
            ));
        }
        // The screen's size, for where the page views end; again on each resize.
        let size = terminal
            .size()
            .map(|s| (s.width, s.height))
            .unwrap_or((80, 24));
        update(
            &mut app,
            Event::Resize {
                width: size.0,
                height: size.1,
            },
        );
        let (tx, rx): (Sender<Event>, Receiver<Event>) = channel();
        let mut view = SweepScreen {
            opts,
            base,
            app,
            journal,
            tx,
            rx,
            pause: Arc::new(AtomicBool::new(false)),
            runner: None,
            start: Instant::now(),
            last_report: None,
            queued_reruns: Vec::new(),
            asking,
            size,
            nvml,
            last_gpu,
        };
        if !asking {
            view.start_sweep();
        }
        view
    }

    fn start_sweep(&mut self) {
        self.runner = Some(start_sweep(
            &self.base,
            &self.tx,
            self.pause.clone(),
            self.opts.sample_ms,
            self.start,
        ));
    }

    /// A sweep that ended: its report, or why it failed; then the re-runs
    /// asked for while it ran.
    fn reap_finished_sweep(&mut self) {
        if !self
            .runner
            .as_ref()
            .is_some_and(|r| r.thread.as_ref().is_some_and(|t| t.is_finished()))
        {
            return;
        }
        let mut r = self.runner.take().expect("checked");
        match r.thread.take().expect("checked").join() {
            Ok(Ok(report)) => self.last_report = Some(report),
            Ok(Err(e)) => self.app.message = Some(format!("sweep failed: {e}")),
            Err(_) => self.app.message = Some("the sweep thread panicked".into()),
        }
        if !self.queued_reruns.is_empty() {
            self.base.rerun = std::mem::take(&mut self.queued_reruns);
            self.start_sweep();
        }
    }

    /// The GPU panel: NVML twice a second, on this thread (a sample is a
    /// few driver calls).
    fn sample_gpu(&mut self) {
        if let Some(t) = &self.nvml
            && self.last_gpu.elapsed() >= Duration::from_millis(500)
        {
            self.last_gpu = Instant::now();
            let view = match t.sample(None) {
                Ok(snap) => super::app::GpuView::Snapshot(snap),
                Err(e) => super::app::GpuView::Missing(format!("NVML: {e}")),
            };
            update(&mut self.app, Event::Gpu(view));
        }
    }

    /// A key while the view asks whether to resume: `y` resumes, `n` moves
    /// the earlier trials aside and starts over; either starts the sweep.
    fn answer_resume(&mut self, key: Key) -> Result<Option<SweepExit>> {
        match key {
            Key::Char('y') => self.app.message = None,
            Key::Char('n') => self.start_over()?,
            Key::Char('q') | Key::Esc | Key::CtrlC => return Ok(Some(SweepExit::Quit)),
            Key::Char('b') => return Ok(Some(SweepExit::Back)),
            _ => return Ok(None),
        }
        self.asking = false;
        self.start_sweep();
        Ok(None)
    }

    /// Moves the earlier run's journal and identity aside, and begins a
    /// fresh screen.
    fn start_over(&mut self) -> Result<()> {
        let opts = self.opts;
        let stamp = crate::units::now_unix_s();
        let aside = opts.out.join(format!("trials.{stamp}.jsonl"));
        let _ = std::fs::rename(&self.journal, &aside);
        // Starting over is a new sweep: the grid builder may
        // have changed the model or the device since.
        let _ = std::fs::rename(
            opts.out.join("sweep.json"),
            opts.out.join(format!("sweep.{stamp}.json")),
        );
        let gpu = self.app.gpu.take();
        self.app = super::new_app(&self.base, opts.sample_ms)?;
        self.app.gpu = gpu;
        self.app.header.no_color = no_color();
        update(
            &mut self.app,
            Event::Resize {
                width: self.size.0,
                height: self.size.1,
            },
        );
        self.app.message = Some(format!("earlier trials moved to {}", aside.display()));
        Ok(())
    }

    /// A key for the app, and what its actions ask of the sweep.
    fn on_key(&mut self, key: Key) -> Option<SweepExit> {
        let mut quit = None;
        for action in update(&mut self.app, Event::Key(key)) {
            match action {
                Action::Quit => quit = Some(SweepExit::Quit),
                Action::Back => quit = Some(SweepExit::Back),
                Action::TogglePause => {
                    self.pause.store(self.app.paused, Ordering::SeqCst);
                }
                Action::Rerun(index) => {
                    if self.runner.is_some() {
                        self.queued_reruns.push(index);
                    } else {
                        self.base.rerun = vec![index];
                        self.start_sweep();
                    }
                }
                Action::Export(dir) => {
                    let res = export(&self.app, self.last_report.as_ref(), &dir);
                    update(&mut self.app, Event::Exported(res));
                }
            }
        }
        quit
    }

    /// Stops the sweep (it kills its running trial and keeps the journal).
    fn stop(&mut self) {
        if let Some(mut r) = self.runner.take() {
            r.stop.store(true, Ordering::SeqCst);
            r.pause.store(false, Ordering::SeqCst);
            if let Some(t) = r.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// Writes the sweep's reports into `dir`: the finished sweep's, or one built
/// from what the screen shows so far.
fn export(
    app: &App,
    finished: Option<&SweepReport>,
    dir: &std::path::Path,
) -> std::result::Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let report = match finished {
        Some(r) => r.clone(),
        None => app.report(),
    };
    crate::sweep::driver::write_reports(&report, dir).map_err(|e| e.to_string())?;
    Ok(dir.to_path_buf())
}
