use std::process::ExitCode;

use clap::Parser;

use memfit::cli::{Cli, Command, DocFormat, Format};
use memfit::report::Report;
use memfit::run::run;

/// Whether this command may open the cuda backend: then the NVIDIA
/// libraries are found and made loadable first (which may execute memfit
/// again, once). Commands that never touch CUDA skip the search; `watch`
/// does too, so the job it starts keeps the user's LD_LIBRARY_PATH.
fn may_use_cuda(cmd: &Command) -> bool {
    if matches!(cmd, Command::Doctor(_)) {
        return true;
    }
    // The emulated GPU loads no NVIDIA library.
    if std::env::var_os(memfit::backend::cuda::EMULATE_ENV).is_some_and(|v| !v.is_empty()) {
        return false;
    }
    let mentions_cuda = || std::env::args().skip(1).any(|a| a.contains("cuda"));
    match cmd {
        Command::Selftest(_) => true,
        // Without a recipe the device comes from the flags; a recipe is
        // read for its device only when it may name one.
        Command::Run(args) => {
            mentions_cuda()
                || (args.recipe.is_some()
                    && args
                        .options()
                        .is_ok_and(|o| o.device.to_string().starts_with("cuda")))
        }
        Command::Trial { .. }
        | Command::Calibrate(_)
        | Command::Balance(_)
        | Command::Launch(_) => mentions_cuda(),
        _ => false,
    }
}

fn render_plan(plan: &memfit::plan::Plan, args: &memfit::cli::PlanArgs) -> String {
    match args.format {
        DocFormat::Json => format!(
            "{}\n",
            serde_json::to_string_pretty(plan).expect("plan serialises")
        ),
        DocFormat::Table => memfit::plan::render::table(
            plan,
            args.top,
            (!args.wide).then(memfit::plan::render::terminal_width),
        ),
        DocFormat::Md => memfit::plan::render::markdown(plan),
    }
}

/// `memfit plan --watch`: plans, then plans again whenever the recipe
/// changes (its modification time or size, polled every 200 ms), until
/// Ctrl-C, SIGTERM or SIGHUP (exit 128 + the signal) or the file is gone
/// for good (exit 2).
fn plan_watch(args: &memfit::cli::PlanArgs) -> i32 {
    use std::io::{IsTerminal, Write};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = Arc::new(AtomicBool::new(false));
    memfit::sys::signals::on_stop(stop.clone());
    let tty = std::io::stdout().is_terminal();
    let stamp = |p: &std::path::Path| {
        std::fs::metadata(p)
            .ok()
            .map(|m| (m.modified().ok(), m.len()))
    };
    let mut seen = None;
    let mut missing_since: Option<std::time::Instant> = None;
    while !stop.load(Ordering::SeqCst) {
        let now = stamp(&args.recipe);
        if now.is_none() {
            // An editor may replace the file (write, rename): wait a moment.
            let since = *missing_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() > std::time::Duration::from_secs(5) {
                eprintln!("memfit: {}: the recipe is gone", args.recipe.display());
                return 2;
            }
        } else if now != seen {
            missing_since = None;
            seen = now;
            let text = match memfit::plan::plan_file_measured(&args.recipe) {
                Ok(plan) => render_plan(&plan, args),
                Err(e) => format!("memfit: {e}\n"),
            };
            let mut out = std::io::stdout().lock();
            if tty {
                // Clear the screen and home the cursor, then the new plan.
                let _ = write!(out, "\x1b[2J\x1b[H");
            }
            let _ = write!(out, "{text}");
            if tty {
                let _ = writeln!(out, "\nwatching {} (Ctrl-C to stop)", args.recipe.display());
            }
            let _ = out.flush();
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    memfit::sys::signals::stopped_exit_code()
}

/// How a command ends: the exit code it chose after printing its result,
/// or an error that [`main`] reports once, `memfit: <error>`, with the
/// error's exit code (2 bad input, 3 out of memory).
type Outcome = memfit::error::Result<i32>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if may_use_cuda(&cli.command) {
        memfit::backend::cuda::libs::prepare();
    }
    // A sweep's trial child speaks for itself to the parent that reads it.
    let who = match cli.command {
        Command::Trial { .. } => "memfit trial",
        _ => "memfit",
    };
    let outcome: Outcome = match cli.command {
        Command::Doctor(args) => Ok(memfit::doctor::doctor_main(args.format == Format::Json)),
        Command::Run(args) if memfit::launch::is_rank() => Ok(memfit::launch::rank_main(
            args.recipe.as_deref(),
            &args.knobs,
            args.timeline.clone(),
            args.format,
        )),
        Command::Launch(args) => Ok(memfit::launch::launch_main(
            &args.options(),
            &memfit::cli::parse_run,
        )),
        Command::Run(args) => run_main(&args),
        Command::Plan(args) if args.watch => Ok(plan_watch(&args)),
        Command::Plan(args) => plan_main(&args),
        Command::Sweep(args) => sweep_main(&args),
        Command::Balance(args) => balance_main(&args),
        Command::Check(args) => Ok(memfit::check::run_check(&args.request())),
        Command::Tui(args) => tui_main(&args),
        Command::Trial { spec } => trial_main(&spec),
        Command::Calibrate(args) => calibrate_main(&args),
        Command::Selftest(args) => selftest_main(&args),
        Command::Watch(args) => Ok(memfit::watch::watch_main(&args.options())),
        Command::Profiles(args) => list_main(true, args.format),
        Command::Models(args) => list_main(false, args.format),
        Command::Completions(args) => {
            memfit::cli::write_completions(args.shell, &mut std::io::stdout().lock());
            Ok(0)
        }
        Command::Man(args) => man_main(&args),
    };
    let code = outcome.unwrap_or_else(|e| {
        eprintln!("{who}: {e}");
        e.exit_code()
    });
    ExitCode::from(code as u8)
}

/// `memfit run`: the report, then the error a run may end with (a rank out
/// of memory, a lost rank) after what it measured.
fn run_main(args: &memfit::cli::RunArgs) -> Outcome {
    let (report, failure) = run(&args.options()?)?;
    report.print(args.format);
    failure.map_or(Ok(0), Err)
}

/// `memfit plan`: exit 1 when no point of the grid fits.
fn plan_main(args: &memfit::cli::PlanArgs) -> Outcome {
    let plan = memfit::plan::plan_file_measured(&args.recipe)?;
    print!("{}", render_plan(&plan, args));
    // Nothing to recommend is a failed plan, for scripts too.
    if plan.recommendation.is_some() {
        return Ok(0);
    }
    if args.format == DocFormat::Json {
        eprintln!(
            "memfit: no point of the grid fits; `--format table` says how far the nearest is"
        );
    }
    Ok(1)
}

/// `memfit models` (`all` false) and `memfit profiles`.
fn list_main(all: bool, format: Format) -> Outcome {
    let catalog = memfit::profiles_cmd::catalog(all)?;
    catalog.print(format);
    Ok(0)
}

/// `memfit man`: memfit.1 on stdout, or every page into `--out`.
fn man_main(args: &memfit::cli::ManArgs) -> Outcome {
    use std::io::Write;
    match &args.out {
        None => {
            let mut out = std::io::stdout().lock();
            match memfit::cli::write_man(&mut out).and_then(|()| out.flush()) {
                Ok(()) => Ok(0),
                // A closed pipe (`memfit man | head`) is not worth a message.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(0),
                Err(source) => Err(memfit::error::Error::Write {
                    path: "the man page (stdout)".into(),
                    source,
                }),
            }
        }
        Some(dir) => {
            let pages = memfit::cli::write_man_pages(dir)?;
            eprintln!(
                "memfit: wrote {} man pages into {} (read one with `man -l {}`)",
                pages.len(),
                dir.display(),
                pages
                    .last()
                    .map_or(String::new(), |p| p.display().to_string())
            );
            Ok(0)
        }
    }
}

fn sweep_main(args: &memfit::cli::SweepArgs) -> Outcome {
    use std::io::IsTerminal;
    if args.trial_timeout.is_nan() || args.trial_timeout <= 0.0 {
        return Err(invalid("--trial-timeout", "must be positive"));
    }
    let timing = args.timing.timing()?;
    let slurm = memfit::sweep::slurm::SlurmOptions {
        partition: args.slurm_partition.clone(),
        time: args.slurm_time.clone(),
        extra: args.slurm_extra.clone(),
    };
    let executor = memfit::sweep::slurm::executor(args.executor, slurm)?;
    let opts = memfit::sweep::driver::SweepOptions {
        recipe: args.recipe.clone(),
        device: args.device.clone(),
        out: args.out.clone(),
        resume: args.resume,
        exhaustive: args.exhaustive,
        break_lock: args.break_lock,
        timing,
        timeout: std::time::Duration::from_secs_f64(args.trial_timeout),
        threads: args.threads,
        #[cfg(feature = "test-hooks")]
        fault: args.test_fault,
        progress: std::io::stderr().is_terminal(),
        hooks: None,
        rerun: Vec::new(),
        executor,
        retime: memfit::sweep::retime::Retime {
            rounds: args.paired_rounds,
            ..Default::default()
        },
        // Piped, a line per finished trial as it finishes; JSON keeps stdout.
        lines: match (std::io::stdout().is_terminal(), args.format) {
            (true, _) => memfit::sweep::driver::Lines::Off,
            (false, Format::Json) => memfit::sweep::driver::Lines::Stderr,
            (false, Format::Table) => memfit::sweep::driver::Lines::Stdout,
        },
    };
    let report = memfit::sweep::driver::sweep(&opts)?;
    report.print(args.format);
    if args.format == Format::Table {
        println!("reports in {}", args.out.display());
    }
    match report.interrupted {
        true => Ok(memfit::sys::signals::stopped_exit_code()),
        false => Ok(0),
    }
}

/// A flag's value refused before the command starts (exit 2).
fn invalid(flag: &str, why: &str) -> memfit::error::Error {
    memfit::error::Error::invalid_arg(flag, why)
}

/// The child side of a sweep trial: one JSON line on stdout; exit 0 ran,
/// 3 out of memory, 2 bad input.
fn trial_main(spec: &str) -> Outcome {
    let spec: memfit::sweep::trial::TrialSpec =
        serde_json::from_str(spec).map_err(|e| invalid("--spec", &e.to_string()))?;
    let out = memfit::sweep::trial::run_trial(&spec)?;
    println!(
        "{}",
        serde_json::to_string(&out).expect("output serialises")
    );
    Ok(if out.oom.is_some() { 3 } else { 0 })
}

/// `memfit calibrate`: the host's roofline, from the cache or measured now.
fn selftest_main(args: &memfit::cli::SelftestArgs) -> Outcome {
    let report = memfit::selftest::selftest(&args.device, args.steps as usize, args.seed)?;
    report.print(args.format);
    Ok(if report.pass { 0 } else { 1 })
}

/// `memfit calibrate`: the host's roofline, or with `--device cuda[:N]`
/// the GPU's curves, from the cache or measured now.
fn calibrate_main(args: &memfit::cli::CalibrateArgs) -> Outcome {
    use memfit::backend::DeviceKind;
    use memfit::calibrate::{gpu, load_or_measure};
    if args.threads == Some(0) {
        return Err(invalid("--threads", "must be at least 1"));
    }
    let threads = args
        .threads
        .unwrap_or_else(memfit::calibrate::default_threads);
    let device = args.device.as_ref();
    if device.is_some_and(|d| d.limit.is_some()) {
        return Err(invalid(
            "--device",
            "a calibration measures the whole device: leave out `limit=`",
        ));
    }
    match device.map(|d| d.kind) {
        None | Some(DeviceKind::Cpu) => {
            if args.profile.is_some() {
                return Err(invalid(
                    "--profile",
                    "binds a GPU's calibration to a hardware profile: give it with --device cuda (the host's calibration prices cpu sweeps, not a profile's plans)",
                ));
            }
            let (c, source) = load_or_measure(threads, args.force)?;
            memfit::report::Calibrated {
                calibration: c,
                source,
            }
            .print(args.format);
        }
        Some(DeviceKind::Meta) => {
            return Err(invalid(
                "--device",
                "meta computes nothing, so there is nothing to time: calibrate measures this host (cpu, the default) or a GPU (cuda or cuda:N)",
            ));
        }
        Some(DeviceKind::Cuda) => {
            let profile = match &args.profile {
                Some(p) => Some(memfit::config::hardware::load_hardware(p)?.name),
                None => None,
            };
            let opts = gpu::Options {
                ordinal: device.and_then(|d| d.ordinal).unwrap_or(0),
                threads,
                profile,
                max_dim: args.max_dim as usize,
                force: args.force,
            };
            let (c, source) = gpu::load_or_measure(&opts, |name, memory| {
                memfit::config::hardware::match_profile(name, memory).map(String::from)
            })?;
            if c.profile.is_none() && args.format == Format::Json {
                eprintln!("memfit: {}", memfit::report::unbound(&c.gpu));
            }
            memfit::report::GpuCalibrated {
                calibration: c,
                source,
            }
            .print(args.format);
        }
    }
    Ok(0)
}

fn tui_main(args: &memfit::cli::TuiArgs) -> Outcome {
    if args.trial_timeout.is_nan() || args.trial_timeout <= 0.0 {
        return Err(invalid("--trial-timeout", "must be positive"));
    }
    if args.sample_ms == 0 {
        return Err(invalid("--sample-ms", "must be positive"));
    }
    let timing = args.timing.timing()?;
    let opts = memfit::tui::term::TuiOptions {
        recipe: args.recipe.clone(),
        new: args.new,
        device: args.device.clone(),
        out: args.out.clone(),
        sample_ms: args.sample_ms,
        timing,
        timeout: std::time::Duration::from_secs_f64(args.trial_timeout),
        threads: args.threads,
    };
    let code = memfit::tui::term::run_tui(&opts)?;
    println!("memfit tui: journal and exports in {}", args.out.display());
    Ok(code)
}

/// `memfit balance`: exit 0 with the partitions, 1 when --verify measures
/// other peaks than predicted, 2 on bad input, 3 when no split fits the
/// capacity (the best one is still printed) or --verify's run runs out of memory.
fn balance_main(args: &memfit::cli::BalanceArgs) -> Outcome {
    let report = memfit::balance_cmd::balance(&args.options()?)?;
    report.print(args.format);
    if report
        .verify
        .iter()
        .any(|v| v.predicted_bytes != v.measured_bytes)
    {
        eprintln!("memfit: a stage's measured peak differs from the prediction");
        return Ok(1);
    }
    if report.optimal.stages.iter().any(|s| !s.fits) {
        eprintln!(
            "memfit: no split into {} stages fits the capacity; add stages or lower --micro-batch",
            report.stages
        );
        return Ok(3);
    }
    Ok(0)
}

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
