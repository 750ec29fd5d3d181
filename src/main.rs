use std::process::ExitCode;

use clap::Parser;

use memfit::cli::{Cli, Command, Format, PlanFormat};
use memfit::run::{render_table, run};

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
        PlanFormat::Json => format!(
            "{}\n",
            serde_json::to_string_pretty(plan).expect("plan serialises")
        ),
        PlanFormat::Table => memfit::plan::render::table(
            plan,
            args.top,
            (!args.wide).then(memfit::plan::render::terminal_width),
        ),
        PlanFormat::Md => memfit::plan::render::markdown(plan),
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
    memfit::signals::on_stop(stop.clone());
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
            let text = match memfit::plan::plan_file(&args.recipe) {
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
    memfit::signals::stopped_exit_code()
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if may_use_cuda(&cli.command) {
        memfit::backend::cuda::libs::prepare();
    }
    let code = match cli.command {
        Command::Doctor(args) => memfit::doctor::doctor_main(args.format == Format::Json),
        Command::Run(args) if memfit::launch::is_rank() => memfit::launch::rank_main(&args),
        Command::Launch(args) => memfit::launch::launch_main(&args),
        Command::Run(args) => match args.options().and_then(|o| run(&o)) {
            Ok((report, failure)) => {
                match args.format {
                    Format::Json => println!(
                        "{}",
                        serde_json::to_string_pretty(&report).expect("report serialises")
                    ),
                    Format::Table => print!("{}", render_table(&report)),
                }
                match failure {
                    None => 0,
                    Some(e) => {
                        eprintln!("memfit: {e}");
                        e.exit_code()
                    }
                }
            }
            Err(e) => {
                eprintln!("memfit: {e}");
                e.exit_code()
            }
        },
        Command::Plan(args) if args.watch => plan_watch(&args),
        Command::Plan(args) => match memfit::plan::plan_file(&args.recipe) {
            Ok(plan) => {
                print!("{}", render_plan(&plan, &args));
                // Nothing to recommend is a failed plan, for scripts too.
                if plan.recommendation.is_none() {
                    if args.format == PlanFormat::Json {
                        eprintln!(
                            "memfit: no point of the grid fits; `--format table` says how far the nearest is"
                        );
                    }
                    1
                } else {
                    0
                }
            }
            Err(e) => {
                eprintln!("memfit: {e}");
                e.exit_code()
            }
        },
        Command::Sweep(args) => sweep_main(&args),
        Command::Balance(args) => balance_main(&args),
        Command::Check(args) => memfit::check::run_check(&args),
        Command::Tui(args) => tui_main(&args),
        Command::Trial { spec } => trial_main(&spec),
        Command::Calibrate(args) => calibrate_main(&args),
        Command::Selftest(args) => selftest_main(&args),
        Command::Watch(args) => memfit::watch::watch_main(&args),
        Command::Profiles(args) => list_main(true, args.format),
        Command::Models(args) => list_main(false, args.format),
        Command::Completions(args) => {
            memfit::cli::write_completions(args.shell, &mut std::io::stdout().lock());
            0
        }
        Command::Man(args) => man_main(&args),
    };
    ExitCode::from(code as u8)
}

/// `memfit models` (`all` false) and `memfit profiles`.
fn list_main(all: bool, format: Format) -> i32 {
    match memfit::profiles_cmd::catalog(all) {
        Ok(c) => {
            match format {
                Format::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(&c).expect("catalog serialises")
                ),
                Format::Table => print!("{}", memfit::profiles_cmd::render_table(&c)),
            }
            0
        }
        Err(e) => {
            eprintln!("memfit: {e}");
            e.exit_code()
        }
    }
}

/// `memfit man`: memfit.1 on stdout, or every page into `--out`.
fn man_main(args: &memfit::cli::ManArgs) -> i32 {
    use std::io::Write;
    match &args.out {
        None => {
            let mut out = std::io::stdout().lock();
            match memfit::cli::write_man(&mut out).and_then(|()| out.flush()) {
                Ok(()) => 0,
                // A closed pipe (`memfit man | head`) is not worth a message.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => 0,
                Err(e) => {
                    eprintln!("memfit: cannot write the man page: {e}");
                    2
                }
            }
        }
        Some(dir) => match memfit::cli::write_man_pages(dir) {
            Ok(pages) => {
                eprintln!(
                    "memfit: wrote {} man pages into {} (read one with `man -l {}`)",
                    pages.len(),
                    dir.display(),
                    pages
                        .last()
                        .map_or(String::new(), |p| p.display().to_string())
                );
                0
            }
            Err(e) => {
                eprintln!("memfit: {e}");
                e.exit_code()
            }
        },
    }
}

fn sweep_main(args: &memfit::cli::SweepArgs) -> i32 {
    use std::io::IsTerminal;
    if args.trial_timeout.is_nan() || args.trial_timeout <= 0.0 {
        eprintln!("memfit: --trial-timeout must be positive");
        return 2;
    }
    let timing = match args.timing.timing() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("memfit: {e}");
            return e.exit_code();
        }
    };
    let executor = match memfit::sweep::slurm::executor(args) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("memfit: {e}");
            return e.exit_code();
        }
    };
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
    match memfit::sweep::driver::sweep(&opts) {
        Ok(report) => {
            match args.format {
                Format::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(&report).expect("report serialises")
                ),
                Format::Table => {
                    print!("{}", memfit::sweep::markdown::table(&report));
                    println!("reports in {}", args.out.display());
                }
            }
            if report.interrupted {
                memfit::signals::stopped_exit_code()
            } else {
                0
            }
        }
        Err(e) => {
            eprintln!("memfit: {e}");
            e.exit_code()
        }
    }
}

/// The child side of a sweep trial: one JSON line on stdout; exit 0 ran,
/// 3 out of memory, 2 bad input.
fn trial_main(spec: &str) -> i32 {
    let spec: memfit::sweep::trial::TrialSpec = match serde_json::from_str(spec) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("memfit trial: bad --spec: {e}");
            return 2;
        }
    };
    match memfit::sweep::trial::run_trial(&spec) {
        Ok(out) => {
            println!(
                "{}",
                serde_json::to_string(&out).expect("output serialises")
            );
            if out.oom.is_some() { 3 } else { 0 }
        }
        Err(e) => {
            eprintln!("memfit trial: {e}");
            e.exit_code()
        }
    }
}

/// `memfit calibrate`: the host's roofline, from the cache or measured now.
fn selftest_main(args: &memfit::cli::SelftestArgs) -> i32 {
    match memfit::selftest::selftest(&args.device, args.steps as usize, args.seed) {
        Ok(report) => {
            match args.format {
                Format::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(&report).expect("selftest report serialises")
                ),
                Format::Table => print!("{}", memfit::selftest::render(&report)),
            }
            if report.pass { 0 } else { 1 }
        }
        Err(e) => {
            eprintln!("memfit: {e}");
            2
        }
    }
}

fn calibrate_main(args: &memfit::cli::CalibrateArgs) -> i32 {
    use memfit::calibrate::{Source, load_or_measure};
    if args.threads == Some(0) {
        eprintln!("memfit: invalid --threads: must be at least 1");
        return 2;
    }
    let threads = args
        .threads
        .unwrap_or_else(memfit::calibrate::default_threads);
    match load_or_measure(threads, args.force) {
        Ok((c, source)) => {
            match args.format {
                Format::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(&c).expect("calibration serialises")
                ),
                Format::Table => {
                    println!("host           {}", c.host);
                    println!("threads        {}", c.threads);
                    println!("GEMM fp32      {:.1} GFLOP/s", c.fp32_flops_per_s / 1e9);
                    println!("GEMM bf16      {:.1} GFLOP/s", c.bf16_flops_per_s / 1e9);
                    println!("GEMM fp16      {:.1} GFLOP/s", c.fp16_flops_per_s / 1e9);
                    println!(
                        "other kernels  {:.1} GFLOP/s fp32, {:.1} 16-bit (attention)",
                        c.fp32_kernel_flops_per_s / 1e9,
                        c.bf16_kernel_flops_per_s / 1e9
                    );
                    println!("memory         {:.1} GB/s", c.bytes_per_s / 1e9);
                    println!("per op         {:.1} µs", c.op_overhead_s * 1e6);
                    match source {
                        Source::Cached(p) => println!(
                            "cached in {} (memfit calibrate --force measures again)",
                            p.display()
                        ),
                        Source::Measured => println!("measured in {:.1} s", c.elapsed_s),
                    }
                }
            }
            0
        }
        Err(e) => {
            eprintln!("memfit: {e}");
            e.exit_code()
        }
    }
}

fn tui_main(args: &memfit::cli::TuiArgs) -> i32 {
    if args.trial_timeout.is_nan() || args.trial_timeout <= 0.0 || args.sample_ms == 0 {
        eprintln!("memfit: --trial-timeout and --sample-ms must be positive");
        return 2;
    }
    let timing = match args.timing.timing() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("memfit: {e}");
            return e.exit_code();
        }
    };
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
    match memfit::tui::term::run_tui(&opts) {
        Ok(code) => {
            println!("memfit tui: journal and exports in {}", args.out.display());
            code
        }
        Err(e) => {
            eprintln!("memfit: {e}");
            e.exit_code()
        }
    }
}

/// `memfit balance`: exit 0 with the partitions, 1 when --verify measures
/// other peaks than predicted, 2 on bad input, 3 when no split fits the
/// capacity (the best one is still printed) or --verify's run runs out of memory.
fn balance_main(args: &memfit::cli::BalanceArgs) -> i32 {
    let report = args
        .options()
        .and_then(|o| memfit::balance_cmd::balance(&o));
    match report {
        Ok(report) => {
            match args.format {
                Format::Json => println!(
                    "{}",
                    serde_json::to_string_pretty(&report).expect("report serialises")
                ),
                Format::Table => print!("{}", memfit::balance_cmd::render_table(&report)),
            }
            if report
                .verify
                .iter()
                .any(|v| v.predicted_bytes != v.measured_bytes)
            {
                eprintln!("memfit: a stage's measured peak differs from the prediction");
                return 1;
            }
            if report.optimal.stages.iter().any(|s| !s.fits) {
                eprintln!(
                    "memfit: no split into {} stages fits the capacity; add stages or lower --micro-batch",
                    report.stages
                );
                return 3;
            }
            0
        }
        Err(e) => {
            eprintln!("memfit: {e}");
            e.exit_code()
        }
    }
}

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
