//! `memfit watch`: runs (or attaches to) any training job and samples its
//! GPU memory and the GPUs' utilisation through NVML, live in a TUI or as
//! lines, records the timeline and the peak, warns near capacity and puts
//! memfit's prediction for the configuration beside the measured peak.
//!
//! - [`state`]: the pure state samples fold into (peaks, warnings, chart).
//! - [`tui`]: drawing that state (pure) and the terminal loop.
//! - `sys::proc`: the job through /proc (descendants, host RSS, signals).
//! - here: options, the child, the sampling thread, the headless printer,
//!   the timeline file and the summary.
//!
//! Without NVML (no driver) nothing fails: the command still runs to its
//! end, and the summary gives its exit code, duration and the host RSS
//! peak of its process tree, labelled host memory.

pub mod state;
pub mod tui;

use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::Result;
use crate::knobs::Knobs;
use crate::report::Format;
use crate::sys::{Signal, proc};
use crate::telemetry::{Snapshot, Telemetry};
use crate::units::fmt_bytes;
use state::{GpuPeak, Phase, Prediction, Target, Tick, Warning, WatchState, fmt_pct, fmt_si};

/// What `memfit watch` was asked (`cli::WatchArgs` fills it; the flags'
/// help says what each does).
#[derive(Clone, Debug)]
pub struct WatchOptions {
    pub gpu: Option<u32>,
    pub sample_ms: u64,
    pub pid: Option<u32>,
    pub timeline: Option<PathBuf>,
    pub warn_at: f64,
    pub no_tui: bool,
    pub format: Format,
    pub grace: f64,
    pub out: PathBuf,
    pub log: Option<PathBuf>,
    /// The prediction's run recipe and knobs (none: no prediction).
    pub recipe: Option<PathBuf>,
    pub knobs: Knobs,
    pub command: Vec<String>,
}

/// `memfit watch`; returns the exit code: the command's, 0 when watching a
/// pid or the GPUs ended, 2 on bad input, 127 when the command cannot start.
pub fn watch_main(args: &WatchOptions) -> i32 {
    let prediction = match predict(args.recipe.as_deref(), &args.knobs) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("memfit: {e}");
            return e.exit_code();
        }
    };
    if let Some(pid) = args.pid
        && !proc::alive(pid)
    {
        eprintln!("memfit: --pid {pid}: no such process (it may have ended)");
        return 2;
    }
    let mut timeline = match open_timeline(args) {
        Ok(t) => t,
        Err(code) => return code,
    };
    let use_tui = !args.no_tui && std::io::stdout().is_terminal();
    let (log_path, log_file) = match command_log(args, use_tui) {
        Ok(log) => log,
        Err(code) => return code,
    };

    let telemetry = Telemetry::open();
    let nvml = match &telemetry {
        Ok(t) => Ok(t.driver_version()),
        Err(e) => Err(e.clone()),
    };

    // The command, started before the clock so that its pid is known.
    let (lines_tx, lines_rx) = channel::<String>();
    let started = Instant::now();
    let (target, child) = match start_target(args, log_file, lines_tx) {
        Ok(started) => started,
        Err(code) => return code,
    };

    let mut st = WatchState::new(target, nvml, args.sample_ms, args.warn_at);
    st.only_gpu = args.gpu;
    st.prediction = prediction;
    st.no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    if use_tui && child.is_some() {
        st.log_path = Some(log_path.clone());
    }
    let sampler = SamplerThread::start(
        telemetry.ok(),
        Duration::from_millis(args.sample_ms),
        args.gpu,
        st.target.pid(),
        started,
    );
    let mut session = Session {
        st,
        child,
        ticks: sampler.rx,
        lines: lines_rx,
        started,
        grace: Duration::from_secs_f64(args.grace),
        stop_asked: None,
        exit_code: None,
        signal: None,
        timeline: timeline.as_mut(),
    };

    let outcome = if use_tui {
        tui::run(&mut session)
    } else {
        headless(&mut session);
        Ok(())
    };
    // Whatever ended the loop, the command does not outlive memfit.
    session.kill_now();
    sampler.stop.store(true, Ordering::SeqCst);
    if let Some(t) = sampler.thread {
        let _ = t.join();
    }
    session.pump();
    let duration_s = match session.st.phase {
        Phase::Ended { at_s, .. } => at_s,
        _ => started.elapsed().as_secs_f64(),
    };
    let exit_code = session.exit_code;
    let signal = session.signal;
    let mut st = session.st;
    st.elapsed_s = duration_s;
    let mut timeline_note = None;
    if let Some(t) = timeline.take() {
        match t.finish() {
            Ok(n) => timeline_note = Some((args.timeline.clone().expect("given"), n)),
            Err(e) => eprintln!("memfit: --timeline: {e}"),
        }
    }
    if let Err(e) = outcome {
        eprintln!("memfit: {e}");
    }
    let mut summary = summary(&st, exit_code, duration_s, timeline_note);
    summary.signal = signal;
    if use_tui && exit_code.is_some_and(|c| c != 0) && !st.log.is_empty() {
        eprintln!(
            "memfit watch: the command's last lines ({} has them all):",
            log_path.display()
        );
        for l in st.log.iter().skip(st.log.len().saturating_sub(20)) {
            eprintln!("  {l}");
        }
    }
    match args.format {
        Format::Json => println!(
            "{}",
            serde_json::to_string_pretty(&summary).expect("summary serialises")
        ),
        Format::Table => eprint!("{}", render_summary(&summary)),
    }
    match (&st.target, exit_code) {
        (Target::Command { .. }, Some(c)) => c,
        (Target::Command { .. }, None) => 1,
        _ => 0,
    }
}

/// `--timeline`'s file, created; `Err` is the exit code, the reason said.
fn open_timeline(args: &WatchOptions) -> std::result::Result<Option<TimelineFile>, i32> {
    match &args.timeline {
        Some(path) => match TimelineFile::create(path) {
            Ok(t) => Ok(Some(t)),
            Err(e) => {
                eprintln!("memfit: --timeline {}: {e}", path.display());
                Err(2)
            }
        },
        None => Ok(None),
    }
}

/// The command's output, with the full-screen view: `--log`, else a new
/// file in `--out` (made only then, so a headless watch writes nothing).
/// Its path, and the file when one is written; `Err` is the exit code.
fn command_log(
    args: &WatchOptions,
    use_tui: bool,
) -> std::result::Result<(PathBuf, Option<std::fs::File>), i32> {
    let log_path = args.log.clone().unwrap_or_else(|| {
        args.out.join(log_name(
            &args.command,
            std::time::SystemTime::now(),
            std::process::id(),
        ))
    });
    let log_file = match use_tui && !args.command.is_empty() {
        false => None,
        true => match open_log(&log_path, args.log.is_none()) {
            Ok(f) => Some(f),
            Err(e) => {
                let flag = if args.log.is_some() { "--log" } else { "--out" };
                eprintln!("memfit: {flag}: cannot write {}: {e}", log_path.display());
                return Err(2);
            }
        },
    };
    Ok((log_path, log_file))
}

/// What is watched: `--pid`'s process, the command (started here, its
/// output to `log_file` and `lines`), or the GPUs alone. `Err` is the exit
/// code when the command cannot start.
fn start_target(
    args: &WatchOptions,
    log_file: Option<std::fs::File>,
    lines: Sender<String>,
) -> std::result::Result<(Target, Option<Child>), i32> {
    Ok(match (&args.pid, args.command.is_empty()) {
        (Some(pid), _) => (
            Target::Pid {
                pid: *pid,
                name: proc::comm(*pid),
            },
            None,
        ),
        (None, true) => (Target::Gpus, None),
        (None, false) => match spawn(&args.command, log_file, lines) {
            Ok(c) => (
                Target::Command {
                    argv: args.command.clone(),
                    pid: c.id(),
                },
                Some(c),
            ),
            Err(e) => {
                eprintln!("memfit: cannot run `{}`: {e}", args.command[0]);
                return Err(127);
            }
        },
    })
}

/// memfit's prediction for the flags' configuration: one step on meta
/// emulating the cuda backend (the bytes memfit's own engine would hold on
/// a GPU, tensors and workspace, without the CUDA context).
pub fn predict(recipe: Option<&std::path::Path>, k: &Knobs) -> Result<Option<Prediction>> {
    if k.model.is_none() && recipe.is_none() {
        return Ok(None);
    }
    // What only a run of memfit's own engine reads does nothing here.
    for (flag, given) in [
        ("--steps", k.steps.is_some()),
        ("--device", k.device.is_some()),
        ("--data", k.data.is_some()),
        ("--seed", k.seed.is_some()),
        ("--threads", k.threads.is_some()),
    ] {
        if given {
            return Err(crate::error::Error::invalid_arg(
                flag,
                "is for `memfit run`; a watch predicts one step on meta for the watched GPU",
            ));
        }
    }
    let recipe_framework = match recipe {
        Some(path) => crate::run::recipe::load_run_recipe(path)?.knobs.framework,
        None => None,
    };
    let knobs = Knobs {
        // The watched job is a PyTorch process unless the flag or the
        // recipe says otherwise.
        framework: match recipe_framework {
            Some(_) => k.framework,
            None => k.framework.or(Some(crate::engine::Framework::HfEager)),
        },
        ..k.clone()
    };
    let mut opts = crate::run::options::resolve(recipe, &knobs, None)?;
    // The watched GPU is whatever NVML shows: no profile's capacity.
    opts.device = crate::backend::DeviceSpec::new(crate::backend::DeviceKind::Meta, None);
    opts.target = None;
    let model = crate::config::profile::load_model(&opts.model)?;
    crate::run::validate(&opts, &model)?;
    let (report, _) = crate::run::run_meta(
        &opts,
        model,
        crate::backend::meta::MetaBackend::emulating_cuda(),
    )?;
    let t = &opts.train;
    use crate::plan::name;
    let mut knobs = format!(
        "seq {} x micro-batch {}, {}, {}, {} attention",
        t.seq_len,
        t.micro_batch,
        name(t.precision),
        name(t.optimizer),
        name(t.attention)
    );
    if name(t.checkpointing) != "none" {
        knobs += &format!(", {} checkpointing", name(t.checkpointing));
    }
    if t.grad_accum > 1 {
        knobs += &format!(", {} micro-batches a step", t.grad_accum);
    }
    if t.finetune != crate::engine::Finetune::Full {
        knobs += &format!(", {} rank {}", name(t.finetune), t.lora.rank);
    }
    if t.ranks > 1 {
        knobs += &format!(", {} ranks {}", t.ranks, name(t.sharding));
    }
    if let Some(a) = report.allocator {
        knobs += &format!(
            "; PyTorch's allocator would reserve {}",
            crate::units::fmt_bytes(a.max_memory_reserved)
        );
    }
    Ok(Some(Prediction {
        model: opts.model.clone(),
        knobs,
        ranks: t.ranks,
        tracked_peak_bytes: report.peak_bytes.total,
        framework: t.framework,
        allocation_profile: report.allocation_profile,
    }))
}

/// Creates the log file; `make_dir`: its folder too (the default file in
/// `--out`; a `--log` file's folder must exist, as `--timeline`'s must).
fn open_log(path: &Path, make_dir: bool) -> std::io::Result<std::fs::File> {
    if make_dir && let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::File::create(path)
}

/// `20251205-143005-python-4242.log`: the UTC time the watch started, the
/// program's name (letters, digits, `.`, `_` and `-` only) and memfit's
/// pid, so that watches started in the same second do not share a file
/// and `ls` lists them oldest first.
pub fn log_name(argv: &[String], now: std::time::SystemTime, pid: u32) -> String {
    let program: String = argv
        .first()
        .and_then(|a| Path::new(a).file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        .take(32)
        .collect();
    let unix_s = now
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (y, mo, d, h, mi, s) = crate::units::utc_civil(unix_s);
    let program = if program.is_empty() {
        "command".to_string()
    } else {
        program
    };
    format!("{y:04}{mo:02}{d:02}-{h:02}{mi:02}{s:02}-{program}-{pid}.log")
}

/// Starts the command: stdio inherited when headless (no `log`); with the
/// TUI, no stdin and its output into `log` and, line by line, into `lines`.
fn spawn(
    argv: &[String],
    log: Option<std::fs::File>,
    lines: Sender<String>,
) -> std::io::Result<Child> {
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..]);
    let Some(file) = log else {
        return cmd.spawn();
    };
    let file = Arc::new(Mutex::new(file));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let out = child
        .stdout
        .take()
        .map(|s| Box::new(s) as Box<dyn Read + Send>);
    let err = child
        .stderr
        .take()
        .map(|s| Box::new(s) as Box<dyn Read + Send>);
    for stream in [out, err].into_iter().flatten() {
        let file = file.clone();
        let lines = lines.clone();
        std::thread::spawn(move || forward(stream, &file, &lines));
    }
    Ok(child)
}

/// Copies a stream into the log file as it comes, and its lines (a
/// progress bar's `\r` updates as lines, escape sequences dropped) to the
/// TUI's panel.
fn forward(stream: Box<dyn Read + Send>, file: &Mutex<std::fs::File>, lines: &Sender<String>) {
    let mut r = BufReader::new(stream);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match r.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if let Ok(mut f) = file.lock() {
            let _ = f.write_all(&buf);
            let _ = f.flush();
        }
        let text = String::from_utf8_lossy(&buf);
        if let Some(last) = text
            .trim_end_matches(['\n', '\r'])
            .split('\r')
            .rfind(|s| !s.trim().is_empty())
        {
            let _ = lines.send(printable(last));
        }
    }
}

/// `s` without terminal escape sequences or other control characters,
/// tabs as spaces: what the TUI may draw.
pub fn printable(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\x1b' => {
                // CSI: ESC [ params final-byte; OSC: ESC ] ... BEL or ESC \;
                // anything else: ESC and one character.
                match chars.next() {
                    Some('[') => {
                        for d in chars.by_ref() {
                            if ('@'..='~').contains(&d) {
                                break;
                            }
                        }
                    }
                    Some(']') => {
                        while let Some(d) = chars.next() {
                            if d == '\x07' {
                                break;
                            }
                            if d == '\x1b' {
                                chars.next();
                                break;
                            }
                        }
                    }
                    _ => {}
                }
            }
            '\t' => out.push_str("    "),
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

/// The sampling thread: every interval, the GPUs (when NVML is there) and
/// the job's process tree from /proc.
struct SamplerThread {
    rx: Receiver<Tick>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SamplerThread {
    fn start(
        telemetry: Option<Telemetry>,
        interval: Duration,
        only: Option<u32>,
        root: Option<u32>,
        started: Instant,
    ) -> SamplerThread {
        let (tx, rx) = channel();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::SeqCst) {
                let began = Instant::now();
                let job = root.map(proc::tree).unwrap_or_default();
                let rss: Vec<u64> = job.iter().filter_map(|&p| proc::rss(p)).collect();
                let tick = Tick {
                    at_s: started.elapsed().as_secs_f64(),
                    gpus: telemetry.as_ref().map(|t| t.sample(only)),
                    host_rss: (!rss.is_empty()).then(|| rss.iter().sum()),
                    job,
                };
                if tx.send(tick).is_err() {
                    return;
                }
                // Sleep the rest of the interval, a little at a time so
                // that stopping is prompt.
                while began.elapsed() < interval && !flag.load(Ordering::SeqCst) {
                    let left = interval.saturating_sub(began.elapsed());
                    std::thread::sleep(left.min(Duration::from_millis(20)));
                }
            }
        });
        SamplerThread {
            rx,
            stop,
            thread: Some(thread),
        }
    }
}

/// A running watch: the state, the child and its stopping, the samples
/// coming in. Both the headless loop and the TUI drive it.
pub struct Session<'a> {
    pub st: WatchState,
    child: Option<Child>,
    ticks: Receiver<Tick>,
    lines: Receiver<String>,
    started: Instant,
    grace: Duration,
    /// When the user asked to stop, and whether SIGKILL went out.
    stop_asked: Option<(Instant, bool)>,
    exit_code: Option<i32>,
    /// The signal that ended the command, if one did.
    signal: Option<i32>,
    timeline: Option<&'a mut TimelineFile>,
}

impl Session<'_> {
    /// Folds in what has arrived; returns the indices of new warnings.
    pub fn pump(&mut self) -> Vec<usize> {
        for line in self.lines.try_iter() {
            self.st.push_log(line);
        }
        let mut raised = Vec::new();
        while let Ok(tick) = self.ticks.try_recv() {
            if let Some(t) = self.timeline.as_deref_mut() {
                t.record(&tick);
            }
            raised.extend(self.st.on_tick(tick));
        }
        if let Some(e) = self.timeline.as_ref().and_then(|t| t.error.clone()) {
            self.st.message = Some(format!("--timeline: {e}"));
        }
        raised
    }

    /// Checks whether the job ended; true once it has (or there is no job
    /// and the user asked to stop).
    pub fn poll_end(&mut self) -> bool {
        if matches!(self.st.phase, Phase::Ended { .. }) {
            return true;
        }
        let now = self.started.elapsed().as_secs_f64();
        let ended = match (&self.st.target, self.child.as_mut()) {
            (Target::Command { .. }, Some(c)) => match c.try_wait() {
                Ok(Some(status)) => {
                    (self.exit_code, self.signal) = exit_code(status);
                    true
                }
                Ok(None) => false,
                Err(_) => true,
            },
            (Target::Pid { pid, .. }, _) => !proc::alive(*pid) || self.stop_asked.is_some(),
            _ => self.stop_asked.is_some(),
        };
        if ended {
            self.st.phase = Phase::Ended {
                code: self.exit_code,
                at_s: now,
            };
            return true;
        }
        // SIGKILL once the grace period after SIGTERM is over.
        if let Some((at, false)) = self.stop_asked
            && at.elapsed() >= self.grace
        {
            self.kill_now();
        }
        self.st.elapsed_s = now;
        false
    }

    /// q or Ctrl-C: SIGTERM to the command now and SIGKILL after the grace
    /// period; asked again, SIGKILL now. An attached process is only left.
    pub fn request_stop(&mut self) {
        let now = self.started.elapsed().as_secs_f64();
        match (self.stop_asked, self.child.as_ref()) {
            (None, Some(c)) => {
                proc::signal(c.id(), Signal::TERM);
                self.stop_asked = Some((Instant::now(), false));
                self.st.phase = Phase::Stopping {
                    since_s: now,
                    killed: false,
                };
                self.st.message = Some(format!(
                    "SIGTERM sent to pid {}; SIGKILL in {:.0} s (press q again to kill now)",
                    c.id(),
                    self.grace.as_secs_f64()
                ));
            }
            (Some(_), Some(_)) => self.kill_now(),
            (_, None) => self.stop_asked = Some((Instant::now(), false)),
        }
    }

    /// SIGKILL to the command and every descendant still there.
    fn kill_now(&mut self) {
        let Some(c) = self.child.as_mut() else {
            return;
        };
        if matches!(c.try_wait(), Ok(Some(_))) {
            return;
        }
        let pids = proc::tree(c.id());
        let _ = c.kill();
        for p in pids.into_iter().skip(1) {
            proc::signal(p, Signal::KILL);
        }
        let since = self.stop_asked.map_or(Instant::now(), |s| s.0);
        self.stop_asked = Some((since, true));
        if let Phase::Stopping { killed, .. } = &mut self.st.phase {
            *killed = true;
        }
        self.st.message = Some(format!("SIGKILL sent to pid {}", c.id()));
        // Reap it, so that its exit status is known.
        if let Ok(status) = c.wait() {
            (self.exit_code, self.signal) = exit_code(status);
        }
    }
}

/// The shell's convention: the code, or 128 + the signal that ended it
/// (and the signal).
fn exit_code(status: std::process::ExitStatus) -> (Option<i32>, Option<i32>) {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => (Some(c), None),
        (None, Some(s)) => (Some(128 + s), Some(s)),
        (None, None) => (Some(1), None),
    }
}

/// The loop without a TUI: a line when the job's peak grows (at most one a
/// second), one a second per GPU when only GPUs are watched, and a line for
/// each warning, all on stderr; stdout is the command's.
fn headless(s: &mut Session) {
    // Ctrl-C presses since the last look (headless; the TUI reads keys).
    let interrupted = Arc::new(AtomicBool::new(false));
    crate::sys::signals::on_interrupt(interrupted.clone());
    match &s.st.nvml {
        Err(why) => eprintln!("memfit watch: no NVML: {why}; GPU memory is not measured"),
        Ok(driver) => eprintln!(
            "memfit watch: NVML{}, sampling every {} ms, warning at {}% of a GPU's memory",
            driver
                .as_ref()
                .map(|d| format!(" (driver {d})"))
                .unwrap_or_default(),
            s.st.sample_ms,
            fmt_pct(s.st.warn_at * 100.0)
        ),
    }
    match &s.st.target {
        Target::Command { pid, .. } => {
            eprintln!(
                "memfit watch: started `{}` (pid {pid})",
                s.st.target.label()
            )
        }
        Target::Pid { .. } => eprintln!("memfit watch: watching {}", s.st.target.label()),
        Target::Gpus => eprintln!("memfit watch: watching the GPUs until Ctrl-C"),
    }
    if let Some(p) = &s.st.prediction {
        eprintln!(
            "memfit watch: memfit predicts {} tracked per GPU (+ CUDA context) for {} ({})",
            fmt_bytes(p.tracked_peak_bytes),
            p.model,
            p.knobs
        );
        eprintln!("memfit watch: allocation profile: {}", p.profile_note());
    }
    let mut printed_peak = 0u64;
    let mut last_line: Option<Instant> = None;
    let mut first_gpu_line = true;
    loop {
        for w in s.pump() {
            let w = &s.st.warnings[w];
            eprintln!("memfit watch: WARNING {:>7.1} s  {}", w.at_s, w.message);
        }
        let due = last_line.is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
        if due && let Some(line) = progress_line(&s.st, &mut printed_peak, &mut first_gpu_line) {
            eprintln!("memfit watch: {line}");
            last_line = Some(Instant::now());
        }
        if interrupted.swap(false, Ordering::SeqCst) {
            s.request_stop();
            if let Some(m) = s.st.message.take() {
                eprintln!("memfit watch: {m}");
            }
        }
        if s.poll_end() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A progress line, when there is news: the job's peak grew (by a MiB or
/// more), or, watching GPUs only, each second.
fn progress_line(st: &WatchState, printed: &mut u64, first: &mut bool) -> Option<String> {
    let t = st.elapsed_s;
    if !st.has_job() {
        let snap = st.latest.as_ref()?;
        *first = false;
        let gpus: Vec<String> = snap.gpus.iter().map(gpu_brief).collect();
        return Some(format!("{t:>7.1} s  {}", gpus.join("  |  ")));
    }
    if let Some((peak, gpu, _)) = st.job_peak {
        if peak < *printed + (1 << 20) {
            return None;
        }
        *printed = peak;
        let total = st
            .gpus
            .iter()
            .find(|g| g.index == gpu)
            .map_or(0, |g| g.total_bytes);
        let now = st.series.last().and_then(|p| p.job).unwrap_or(0);
        return Some(format!(
            "{t:>7.1} s  job peak {} on GPU {gpu} ({}% of {}), now {}",
            fmt_bytes(peak),
            fmt_pct_of(peak, total),
            fmt_bytes(total),
            fmt_bytes(now)
        ));
    }
    if st.nvml.is_err() {
        let peak = st.host_rss_peak?;
        if peak < *printed + (1 << 20) {
            return None;
        }
        *printed = peak;
        return Some(format!(
            "{t:>7.1} s  host RSS peak {} (host memory, not GPU)",
            fmt_bytes(peak)
        ));
    }
    None
}

fn fmt_pct_of(b: u64, total: u64) -> String {
    if total == 0 {
        "?".into()
    } else {
        format!("{:.1}", crate::units::percent_of(b as f64, total))
    }
}

/// `GPU 0 40.00/80.00 GiB (50.0%) util 97% 312 W 64°C`.
fn gpu_brief(g: &crate::telemetry::GpuSample) -> String {
    let mut s = format!(
        "GPU {} {}/{} ({}%)",
        g.index,
        fmt_bytes(g.memory_used_bytes),
        fmt_bytes(g.memory_total_bytes),
        fmt_pct_of(g.memory_used_bytes, g.memory_total_bytes)
    );
    if let Some(u) = g.utilization_pct {
        s += &format!(" util {u}%");
    }
    if let Some(p) = g.power_w {
        s += &format!(" {p:.0} W");
    }
    if let Some(c) = g.temperature_c {
        s += &format!(" {c}°C");
    }
    if let Some(e) = &g.error {
        s += &format!(" ({e})");
    }
    s
}

/// The timeline file: CSV written as samples arrive (one row per GPU per
/// sample, or one row without NVML), or JSON written at the end.
pub struct TimelineFile {
    path: PathBuf,
    json: bool,
    csv: Option<std::io::BufWriter<std::fs::File>>,
    rows: Vec<TimelineSample>,
    written: usize,
    error: Option<String>,
}

#[derive(Serialize)]
struct TimelineSample {
    t_s: f64,
    job_pids: Vec<u32>,
    host_rss_bytes: Option<u64>,
    gpus: Vec<TimelineGpu>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

#[derive(Serialize)]
struct TimelineGpu {
    index: u32,
    used_bytes: u64,
    total_bytes: u64,
    job_bytes: u64,
    utilization_pct: Option<u32>,
    power_w: Option<f64>,
    temperature_c: Option<u32>,
}

pub const TIMELINE_CSV_HEADER: &str =
    "t_s,gpu,used_bytes,total_bytes,job_bytes,utilization_pct,power_w,temperature_c,host_rss_bytes";

impl TimelineFile {
    fn create(path: &Path) -> std::io::Result<TimelineFile> {
        let json = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("json"));
        let file = std::fs::File::create(path)?;
        let csv = if json {
            None
        } else {
            let mut w = std::io::BufWriter::new(file);
            writeln!(w, "{TIMELINE_CSV_HEADER}")?;
            Some(w)
        };
        Ok(TimelineFile {
            path: path.to_path_buf(),
            json,
            csv,
            rows: Vec::new(),
            written: 0,
            error: None,
        })
    }

    fn record(&mut self, t: &Tick) {
        let (gpus, error) = match &t.gpus {
            Some(Ok(s)) => (timeline_gpus(s, &t.job), None),
            Some(Err(e)) => (Vec::new(), Some(e.clone())),
            None => (Vec::new(), None),
        };
        self.written += 1;
        if self.json {
            self.rows.push(TimelineSample {
                t_s: t.at_s,
                job_pids: t.job.clone(),
                host_rss_bytes: t.host_rss,
                gpus,
                error,
            });
            return;
        }
        let Some(w) = self.csv.as_mut() else { return };
        let opt = |v: Option<String>| v.unwrap_or_default();
        let rss = opt(t.host_rss.map(|b| b.to_string()));
        let res = if gpus.is_empty() {
            writeln!(w, "{:.3},,,,,,,,{rss}", t.at_s)
        } else {
            gpus.iter().try_for_each(|g| {
                writeln!(
                    w,
                    "{:.3},{},{},{},{},{},{},{},{rss}",
                    t.at_s,
                    g.index,
                    g.used_bytes,
                    g.total_bytes,
                    g.job_bytes,
                    opt(g.utilization_pct.map(|v| v.to_string())),
                    opt(g.power_w.map(|v| format!("{v:.1}"))),
                    opt(g.temperature_c.map(|v| v.to_string())),
                )
            })
        };
        // Flushed a second at a time by the buffer's size, and at the end.
        if let Err(e) = res {
            self.error.get_or_insert(e.to_string());
        }
    }

    /// Writes what is left; returns the samples written.
    fn finish(self) -> std::io::Result<usize> {
        if self.json {
            #[derive(Serialize)]
            struct Doc<'a> {
                samples: &'a [TimelineSample],
            }
            let text = serde_json::to_string_pretty(&Doc {
                samples: &self.rows,
            })
            .expect("timeline serialises");
            std::fs::write(&self.path, text + "\n")?;
        } else if let Some(mut w) = self.csv {
            w.flush()?;
        }
        if let Some(e) = self.error {
            return Err(std::io::Error::other(e));
        }
        Ok(self.written)
    }
}

fn timeline_gpus(s: &Snapshot, job: &[u32]) -> Vec<TimelineGpu> {
    s.gpus
        .iter()
        .map(|g| TimelineGpu {
            index: g.index,
            used_bytes: g.memory_used_bytes,
            total_bytes: g.memory_total_bytes,
            job_bytes: g
                .processes
                .iter()
                .filter(|p| job.contains(&p.pid))
                .filter_map(|p| p.used_bytes)
                .sum(),
            utilization_pct: g.utilization_pct,
            power_w: g.power_w,
            temperature_c: g.temperature_c,
        })
        .collect()
}

/// The summary `memfit watch` ends with (`--format json` prints this).
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// The command memfit started, or null.
    pub command: Option<Vec<String>>,
    pub pid: Option<u32>,
    /// The command's exit code (128 + N when signal N ended it); null for
    /// an attached process, whose code memfit cannot know.
    pub exit_code: Option<i32>,
    /// The signal that ended the command (`exit_code` is then 128 + it).
    pub signal: Option<i32>,
    pub duration_s: f64,
    pub sample_ms: u64,
    /// NVML samples taken.
    pub samples: usize,
    pub nvml: NvmlRecord,
    pub gpus: Vec<GpuPeak>,
    /// The job's highest GPU memory on one GPU (NVML, per process).
    pub job_peak_bytes: Option<u64>,
    pub job_peak_gpu: Option<u32>,
    pub job_peak_at_s: Option<f64>,
    /// That GPU's total memory, and the peak as a percentage of it.
    pub gpu_total_bytes: Option<u64>,
    pub job_peak_pct: Option<f64>,
    /// The job's highest GPU memory over all its GPUs together.
    pub job_all_gpus_peak_bytes: Option<u64>,
    /// Resident host memory of the process tree (sampled): host memory, not GPU.
    pub host_rss_peak_bytes: Option<u64>,
    pub warn_at_pct: f64,
    pub warnings: Vec<Warning>,
    pub prediction: Option<PredictionRecord>,
    pub timeline: Option<PathBuf>,
    pub log: Option<PathBuf>,
}

#[derive(Clone, Debug, Serialize)]
pub struct NvmlRecord {
    pub available: bool,
    pub error: Option<String>,
    pub driver_version: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct PredictionRecord {
    #[serde(flatten)]
    pub prediction: Prediction,
    /// The measured job peak less the prediction (NVML counts the CUDA
    /// context, the framework's allocator cache and its workspaces, which
    /// memfit's tracked bytes do not).
    pub measured_minus_predicted_bytes: Option<i64>,
}

/// What the CUDA context and libraries add on top of tracked bytes.
pub const CONTEXT_NOTE: &str = "+ CUDA context, ~0.5-1 GiB";

pub fn summary(
    st: &WatchState,
    exit_code: Option<i32>,
    duration_s: f64,
    timeline: Option<(PathBuf, usize)>,
) -> Summary {
    let peak = st.job_peak;
    let total =
        peak.and_then(|(_, g, _)| st.gpus.iter().find(|p| p.index == g).map(|p| p.total_bytes));
    Summary {
        command: match &st.target {
            Target::Command { argv, .. } => Some(argv.clone()),
            _ => None,
        },
        pid: st.target.pid(),
        exit_code,
        signal: None,
        duration_s,
        sample_ms: st.sample_ms,
        samples: st.samples,
        nvml: NvmlRecord {
            available: st.nvml.is_ok(),
            error: st.nvml.as_ref().err().cloned(),
            driver_version: st.nvml.as_ref().ok().cloned().flatten(),
        },
        gpus: st.gpus.clone(),
        job_peak_bytes: peak.map(|p| p.0),
        job_peak_gpu: peak.map(|p| p.1),
        job_peak_at_s: peak.map(|p| p.2),
        gpu_total_bytes: total,
        job_peak_pct: match (peak, total) {
            (Some((b, ..)), Some(t)) if t > 0 => Some(b as f64 / t as f64 * 100.0),
            _ => None,
        },
        job_all_gpus_peak_bytes: (st.job_total_peak > 0).then_some(st.job_total_peak),
        host_rss_peak_bytes: st.host_rss_peak,
        warn_at_pct: st.warn_at * 100.0,
        warnings: st.warnings.clone(),
        prediction: st.prediction.clone().map(|p| PredictionRecord {
            measured_minus_predicted_bytes: peak
                .map(|(b, ..)| b as i64 - p.tracked_peak_bytes as i64),
            prediction: p,
        }),
        timeline: timeline.map(|t| t.0),
        log: st.log_path.clone(),
    }
}

/// The summary as the aligned lines printed at the end.
pub fn render_summary(s: &Summary) -> String {
    let mut out = String::from("memfit watch summary\n");
    let mut kv = |k: &str, v: String| out.push_str(&format!("  {k:<16}{v}\n"));
    if let Some(argv) = &s.command {
        kv("command", state::shell_words(argv));
    }
    if let Some(pid) = s.pid {
        kv("pid", pid.to_string());
    }
    match (&s.command, s.exit_code) {
        (Some(_), Some(c)) if s.signal.is_some() => kv(
            "exit code",
            format!("{c} (ended by signal {})", s.signal.unwrap_or(0)),
        ),
        (Some(_), Some(c)) => kv("exit code", c.to_string()),
        (Some(_), None) => kv("exit code", "unknown".into()),
        (None, _) if s.pid.is_some() => kv("exit code", "unknown (not started by memfit)".into()),
        _ => {}
    }
    kv("duration", format!("{:.1} s", s.duration_s));
    match (&s.nvml.error, &s.nvml.driver_version) {
        (Some(e), _) => kv("GPU memory", format!("not measured: no NVML: {e}")),
        (None, d) => {
            kv(
                "samples",
                format!(
                    "{} (every {} ms{})",
                    s.samples,
                    s.sample_ms,
                    d.as_ref()
                        .map(|d| format!(", NVIDIA driver {d}"))
                        .unwrap_or_default()
                ),
            );
            for g in &s.gpus {
                kv(
                    &format!("GPU {}", g.index),
                    format!(
                        "{}, {} total, used peak {} ({}%)",
                        g.name,
                        fmt_bytes(g.total_bytes),
                        fmt_bytes(g.peak_used_bytes),
                        fmt_pct_of(g.peak_used_bytes, g.total_bytes)
                    ),
                );
            }
            match (s.job_peak_bytes, s.job_peak_gpu) {
                (Some(b), Some(g)) => {
                    kv(
                        "job GPU peak",
                        format!(
                            "{} ({}) on GPU {g} at {:.1} s: {}% of its {}",
                            fmt_bytes(b),
                            fmt_si(b),
                            s.job_peak_at_s.unwrap_or(0.0),
                            s.job_peak_pct.map_or("?".into(), |p| format!("{p:.1}")),
                            fmt_bytes(s.gpu_total_bytes.unwrap_or(0))
                        ),
                    );
                    if s.gpus.iter().filter(|g| g.job_peak_bytes > 0).count() > 1 {
                        kv(
                            "job, all GPUs",
                            fmt_bytes(s.job_all_gpus_peak_bytes.unwrap_or(0)),
                        );
                    }
                }
                _ if s.pid.is_some() => kv(
                    "job GPU peak",
                    "none seen: NVML listed none of the job's processes (in a container, NVML reports host pids)".into(),
                ),
                _ => {}
            }
        }
    }
    if let Some(b) = s.host_rss_peak_bytes {
        kv(
            "host RSS peak",
            format!(
                "{} (host memory of the process tree, sampled; not GPU memory)",
                fmt_bytes(b)
            ),
        );
    } else if s.pid.is_some() {
        kv(
            "host RSS peak",
            "none sampled (the process ended first)".into(),
        );
    }
    if let Some(p) = &s.prediction {
        kv(
            "prediction",
            format!(
                "memfit predicts {} tracked per GPU ({CONTEXT_NOTE}) for {}, {}",
                fmt_bytes(p.prediction.tracked_peak_bytes),
                p.prediction.model,
                p.prediction.knobs
            ),
        );
        kv(
            "",
            format!("allocation profile: {}", p.prediction.profile_note()),
        );
        match (p.measured_minus_predicted_bytes, s.job_peak_bytes) {
            (Some(d), Some(b)) => kv(
                "",
                format!(
                    "measured {}: {} beside the prediction (the CUDA context, the framework's allocator cache and workspaces are in NVML's figure, not in memfit's)",
                    fmt_bytes(b),
                    crate::units::fmt_signed_bytes(d)
                ),
            ),
            _ => kv("", "nothing measured to compare with".into()),
        }
    }
    if s.warnings.is_empty() {
        kv(
            "warnings",
            format!("none (--warn-at {}%)", fmt_pct(s.warn_at_pct)),
        );
    } else {
        kv("warnings", s.warnings.len().to_string());
        for w in &s.warnings {
            kv("", format!("{:.1} s  {}", w.at_s, w.message));
        }
    }
    if let Some(t) = &s.timeline {
        kv("timeline", t.display().to_string());
    }
    if let Some(l) = &s.log {
        kv("command output", l.display().to_string());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_names_sort_by_time_and_keep_only_safe_characters() {
        let at = |s: u64| std::time::UNIX_EPOCH + Duration::from_secs(s);
        let argv = |a: &str| vec![a.to_string(), "train.py".to_string()];
        // 2024-02-29 23:59:59 UTC, a leap day, then the next second.
        assert_eq!(
            log_name(&argv("/usr/bin/python3"), at(1_709_251_199), 42),
            "20240229-235959-python3-42.log"
        );
        assert_eq!(
            log_name(&argv("python3"), at(1_709_251_200), 42),
            "20240301-000000-python3-42.log"
        );
        assert_eq!(
            log_name(&argv("./my run;rm -rf"), at(0), 7),
            "19700101-000000-myrunrm-rf-7.log"
        );
        assert_eq!(log_name(&[], at(0), 7), "19700101-000000-command-7.log");
    }

    #[test]
    fn printable_drops_escapes_and_controls() {
        assert_eq!(printable("\x1b[31mred\x1b[0m ok"), "red ok");
        assert_eq!(printable("a\tb\x07"), "a    b");
        assert_eq!(printable("\x1b]0;title\x07x"), "x");
    }
}
