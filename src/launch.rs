//! `memfit launch`: a job of N `memfit run` processes, one rank each, on
//! this machine (a local torchrun); and the rank side of any such job.
//!
//! The launcher starts N copies of this binary's `memfit run` with the
//! environment torchrun sets (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR=127.0.0.1`, `MASTER_PORT`: given, or a
//! free port), waits for them, and when one fails gives the others
//! `--grace` seconds to finish (rank 0 prints the job's report) before
//! killing them; its exit code is the first failing rank's (128 + the
//! signal for a killed one), 0 when every rank succeeded.
//!
//! A `memfit run` started under those variables (by the launcher, torchrun
//! `--no-python`, or Slurm) is one rank ([`rank_main`]): it trains its one
//! engine in the process group (`run::run_process_rank`), then sends rank 0
//! its peaks (device and host), losses and errors; rank 0 merges them into
//! the one report a threaded `memfit run --ranks N` prints, prints it, and
//! only then releases the others, with the job's exit code. Other ranks
//! print nothing on stdout.

use std::process::{Child, Command, ExitStatus};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::cli::{Format, LaunchArgs, RunArgs};
use crate::comm::process::{DistEnv, EXIT_PEER_LOST};
use crate::error::Error;
use crate::memory::{ByCategory, Category, PeakBytes, Tracker};
use crate::run::{ErrorRecord, RankRecord, RunReport, render_table, run_process_rank};

/// Test hook: `RANK:KIND` makes that rank fail right after joining the
/// group: `sigkill` (as the kernel's OOM killer would), `exit` (exit 1
/// without a word), `hang` (alive, never answering).
pub const FAULT_ENV: &str = "MEMFIT_TEST_RANK_FAULT";

/// Applies [`FAULT_ENV`] to `rank`, if it names it.
pub(crate) fn test_fault(rank: usize) {
    let Ok(v) = std::env::var(FAULT_ENV) else {
        return;
    };
    let Some((r, kind)) = v.split_once(':') else {
        return;
    };
    if r.trim().parse::<usize>() != Ok(rank) {
        return;
    }
    match kind.trim() {
        "sigkill" => {
            let _ = Command::new("kill")
                .args(["-9", &std::process::id().to_string()])
                .status();
            std::thread::sleep(Duration::from_secs(60));
        }
        "exit" => std::process::exit(1),
        "hang" => loop {
            std::thread::sleep(Duration::from_secs(60));
        },
        _ => {}
    }
}

/// Whether this `memfit run` is a rank of a multi-process job (or was
/// given a rank's environment that needs an error).
pub fn is_rank() -> bool {
    !matches!(DistEnv::from_env(), Ok(None))
}

/// `memfit run` as one rank: trains, then rank 0 prints the job's report.
/// Returns the exit code.
pub fn rank_main(args: &RunArgs) -> i32 {
    let env = match DistEnv::from_env() {
        Ok(Some(e)) => e,
        Ok(None) => unreachable!("is_rank said this is a rank"),
        Err(e) => {
            eprintln!("memfit: {e}");
            return e.exit_code();
        }
    };
    let who = format!("rank {}", env.rank);
    let opts = match args.options() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("memfit: {who}: {e}");
            return e.exit_code();
        }
    };
    let (group, out) = match run_process_rank(&opts, &env) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("memfit: {who}: {e}");
            return e.exit_code();
        }
    };
    let (report, err) = match out {
        Ok((r, e)) => (Some(r), e),
        Err(e) => (None, Some(e)),
    };
    // This rank's failure stops the others' collectives at once.
    if let Some(e) = &err {
        group.abort(e.exit_code(), format!("{who}: {e}"));
    }
    let part = Part::new(env.rank, report.as_ref(), err.as_ref());
    let parts = group.gather_to_root(serde_json::to_vec(&part).expect("a rank's part serialises"));
    let Some(parts) = parts else {
        // Rank 0 reports the job; without it, say what this rank saw.
        return match group.release(0) {
            Some(code) => code,
            None => {
                let (code, why) = match (&err, group.failure()) {
                    (Some(e), _) => (e.exit_code(), e.to_string()),
                    (None, Some((code, why))) => (code, why),
                    (None, None) => (EXIT_PEER_LOST, "rank 0 is gone".to_string()),
                };
                match why.starts_with("rank ") {
                    true => eprintln!("memfit: {why}"),
                    false => eprintln!("memfit: {who}: {why}"),
                }
                code
            }
        };
    };
    let job = merge(&opts.train, report, parts, group.failure());
    if let Some(r) = &job.report {
        match args.format {
            Format::Json => println!(
                "{}",
                serde_json::to_string_pretty(r).expect("report serialises")
            ),
            Format::Table => print!("{}", render_table(r)),
        }
    }
    if let Some(why) = &job.message {
        eprintln!("memfit: {why}");
    }
    use std::io::Write as _;
    let _ = std::io::stdout().flush();
    group.release(job.code);
    job.code
}

/// What a rank sends rank 0 at the end.
#[derive(Debug, Serialize, Deserialize)]
struct Part {
    rank: usize,
    /// Its peaks, when it got as far as building an engine.
    record: Option<RecordPart>,
    /// Each recorded step's loss (its replica's), as bits.
    losses: Vec<u32>,
    /// FLOPs and bytes of its last step (u128 as decimal).
    flops: String,
    bytes_moved: String,
    /// It ran out of memory.
    oom: Option<OomPart>,
    /// It failed otherwise: exit code and message.
    error: Option<(i32, String)>,
}

#[derive(Debug, Serialize, Deserialize)]
struct RecordPart {
    stage: Option<usize>,
    layers: Option<[usize; 2]>,
    peak: PeakBytes,
    at_peak: PeakBytes,
    sent: u64,
    received: u64,
    host_peak: Option<PeakBytes>,
}

#[derive(Debug, Serialize, Deserialize)]
struct OomPart {
    message: String,
    phase: String,
    category: String,
    requested: u64,
    capacity: u64,
    live: PeakBytes,
}

/// A breakdown back from its per-category bytes.
fn by_category(p: &PeakBytes) -> ByCategory {
    let mut t = Tracker::new(None);
    for c in Category::ALL {
        if p.get(c) > 0 {
            t.alloc(c, p.get(c)).expect("no capacity");
        }
    }
    t.at_peak()
}

impl Part {
    fn new(rank: usize, report: Option<&RunReport>, err: Option<&Error>) -> Part {
        let record = report.and_then(|r| r.ranks.first()).map(|r| RecordPart {
            stage: r.stage,
            layers: r.layers,
            peak: r.peak_bytes,
            at_peak: r.peak_breakdown.into(),
            sent: r.sent_bytes_per_step,
            received: r.received_bytes_per_step,
            host_peak: r.host_peak_bytes,
        });
        let oom = report.and_then(|r| r.error.as_ref()).map(|e| OomPart {
            message: e.message.clone(),
            phase: e.phase.clone(),
            category: e.category.name().to_string(),
            requested: e.requested,
            capacity: e.capacity,
            live: e.live.into(),
        });
        Part {
            rank,
            record,
            losses: report.map_or(Vec::new(), |r| {
                r.steps.iter().map(|s| s.loss.to_bits()).collect()
            }),
            flops: report.map_or(0, |r| r.flops_per_step).to_string(),
            bytes_moved: report.map_or(0, |r| r.bytes_moved_per_step).to_string(),
            error: err
                .filter(|e| !matches!(e, Error::Oom(_)))
                .map(|e| (e.exit_code(), e.to_string())),
            oom,
        }
    }
}

/// The job's outcome, on rank 0.
struct Job {
    report: Option<RunReport>,
    message: Option<String>,
    code: i32,
}

/// Rank 0: every rank's part into the report a threaded run prints.
fn merge(
    train: &crate::engine::TrainConfig,
    mine: Option<RunReport>,
    parts: Vec<Result<Vec<u8>, String>>,
    failure: Option<(i32, String)>,
) -> Job {
    let world = parts.len();
    let mut got = Vec::with_capacity(world);
    let mut lost = Vec::new();
    for (r, p) in parts.into_iter().enumerate() {
        match p.and_then(|b| {
            serde_json::from_slice::<Part>(&b)
                .map_err(|e| format!("rank {r} sent an unreadable report: {e}"))
        }) {
            Ok(p) => got.push(p),
            Err(why) => lost.push(why),
        }
    }
    // The lowest rank that ran out of memory is the job's error, as in a
    // threaded run.
    if let Some(p) = got.iter().find(|p| p.oom.is_some()) {
        let oom = p.oom.as_ref().expect("found");
        let record = ErrorRecord {
            kind: "oom",
            rank: (world > 1).then_some(p.rank),
            message: match world > 1 {
                true => format!("rank {}: {}", p.rank, oom.message),
                false => oom.message.clone(),
            },
            phase: oom.phase.clone(),
            category: Category::ALL
                .into_iter()
                .find(|c| c.name() == oom.category)
                .unwrap_or(Category::Temporaries),
            requested: oom.requested,
            capacity: oom.capacity,
            live: by_category(&oom.live),
        };
        let message = Some(record.message.clone());
        // Refused while building the engines: the report shows the rank
        // that failed, as a threaded run does.
        let only = (oom.phase == "init").then_some(p.rank);
        let report = mine.map(|r| {
            let mut r = combine(r, &got, train, only);
            r.error = Some(record);
            r
        });
        return Job {
            report,
            message,
            code: 3,
        };
    }
    if let Some(p) = got.iter().find(|p| p.error.is_some()) {
        let (code, why) = p.error.clone().expect("found");
        return Job {
            report: None,
            message: Some(format!("rank {}: {why}", p.rank)),
            code,
        };
    }
    if let Some((code, why)) = failure {
        return Job {
            report: None,
            message: Some(why),
            code,
        };
    }
    if let Some(why) = lost.into_iter().next() {
        return Job {
            report: None,
            message: Some(why),
            code: EXIT_PEER_LOST,
        };
    }
    let Some(mine) = mine else {
        return Job {
            report: None,
            message: Some("rank 0 has no report".into()),
            code: 1,
        };
    };
    Job {
        report: Some(combine(mine, &got, train, None)),
        message: None,
        code: 0,
    }
}

/// Rank 0's report with every rank's peaks, the job's losses and one
/// replica's work, computed as `run::run_on` and `Cluster` compute them.
fn combine(
    mut report: RunReport,
    parts: &[Part],
    train: &crate::engine::TrainConfig,
    only: Option<usize>,
) -> RunReport {
    let world = parts.len();
    let stages = train.pipeline_stages.max(1);
    let replicas = train.data_ranks();
    report.ranks = parts
        .iter()
        .filter(|p| only.is_none_or(|r| r == p.rank))
        .filter_map(|p| {
            p.record.as_ref().map(|r| RankRecord {
                rank: p.rank,
                stage: r.stage,
                layers: r.layers,
                peak_bytes: r.peak,
                peak_breakdown: by_category(&r.at_peak),
                sent_bytes_per_step: r.sent,
                received_bytes_per_step: r.received,
                host_peak_bytes: r.host_peak,
            })
        })
        .collect();
    crate::run::summarise_ranks(&mut report);
    if let Some(h) = &mut report.host {
        let mut top = PeakBytes::default();
        let mut node = 0;
        for pk in report.ranks.iter().filter_map(|r| r.host_peak_bytes) {
            for c in Category::ALL {
                top.set(c, top.get(c).max(pk.get(c)));
            }
            top.total = top.total.max(pk.total);
            node += pk.total;
        }
        h.peak_bytes = top;
        h.node_bytes = node;
    }
    // One replica's work: every stage of replica 0.
    let sum = |f: fn(&Part) -> &String| -> u128 {
        parts
            .iter()
            .filter(|p| p.rank % replicas == 0)
            .map(|p| f(p).parse::<u128>().unwrap_or(0))
            .sum()
    };
    report.flops_per_step = sum(|p| &p.flops);
    report.bytes_moved_per_step = sum(|p| &p.bytes_moved);
    // The loss: the mean over the last stage's replicas (Cluster::step_from).
    let last: Vec<&Part> = parts
        .iter()
        .filter(|p| p.rank >= (stages - 1) * replicas)
        .collect();
    if world > 1
        && last.len() == replicas
        && last.iter().all(|p| p.losses.len() == report.steps.len())
    {
        for (i, st) in report.steps.iter_mut().enumerate() {
            let sum: f64 = last
                .iter()
                .map(|p| f32::from_bits(p.losses[i]) as f64)
                .sum();
            st.loss = sum as f32 / replicas as f32;
        }
    }
    report
}

/// `memfit launch`: returns the exit code.
pub fn launch_main(args: &LaunchArgs) -> i32 {
    match launch(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("memfit launch: {e}");
            e.exit_code()
        }
    }
}

/// How a rank ended, as a shell would put it.
fn describe(status: ExitStatus) -> (i32, String) {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => (c, format!("exited with code {c}")),
        (None, Some(s)) => {
            let name = match s {
                6 => " (SIGABRT)",
                9 => " (SIGKILL)",
                11 => " (SIGSEGV)",
                15 => " (SIGTERM)",
                _ => "",
            };
            (128 + s, format!("was killed by signal {s}{name}"))
        }
        (None, None) => (1, "ended".into()),
    }
}

fn launch(args: &LaunchArgs) -> crate::Result<i32> {
    use clap::Parser as _;
    let n = args.nproc;
    if !(1..=crate::run::MAX_RANKS).contains(&n) {
        return Err(Error::invalid_arg(
            "--nproc",
            format!("{n} is outside 1..={}", crate::run::MAX_RANKS),
        ));
    }
    if !(args.grace.is_finite() && args.grace >= 0.0) {
        return Err(Error::invalid_arg(
            "--grace",
            "must be 0 or positive seconds",
        ));
    }
    let mut run_args = args.run.clone();
    match run_args.first().map(String::as_str) {
        Some("run") => {}
        Some(a) if !a.starts_with('-') => {
            return Err(Error::invalid_arg(
                "--",
                format!(
                    "`{a}`: memfit launch starts `memfit run` ranks; give `run` and its flags after --"
                ),
            ));
        }
        _ => run_args.insert(0, "run".into()),
    }
    // Check the run's flags once here rather than N times in the ranks.
    let cli = crate::cli::Cli::try_parse_from(
        std::iter::once("memfit".to_string()).chain(run_args.iter().cloned()),
    )
    .map_err(|e| {
        Error::invalid_arg(
            "--",
            format!("the run's arguments: {}", e.to_string().trim()),
        )
    })?;
    let crate::cli::Command::Run(run) = cli.command else {
        unreachable!("the first argument is run");
    };
    let opts = run.options()?;
    if opts.train.ranks != n {
        return Err(Error::invalid_arg(
            "--ranks",
            format!(
                "the run has --ranks {} but --nproc is {n}: one process per rank; pass --ranks {n}",
                opts.train.ranks
            ),
        ));
    }
    let port = match args.master_port {
        Some(p) => p,
        None => std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| Error::Unavailable(format!("no free port for MASTER_PORT: {e}")))?
            .port(),
    };
    let exe = std::env::current_exe()
        .map_err(|e| Error::Unavailable(format!("cannot find the memfit binary: {e}")))?;
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = Arc::clone(&stop);
        // Ctrl-C reaches the ranks too (same process group); this makes
        // sure none is left behind.
        let _ = ctrlc::set_handler(move || stop.store(true, Ordering::SeqCst));
    }
    let mut children: Vec<Option<Child>> = Vec::with_capacity(n);
    for rank in 0..n {
        let child = Command::new(&exe)
            .args(&run_args)
            // This job's port is MASTER_PORT, whatever this shell says.
            .env_remove(crate::comm::process::PORT_ENV)
            .env_remove(crate::comm::process::AGENT_STORE_ENV)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .spawn();
        match child {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                kill_all(&mut children);
                return Err(Error::Unavailable(format!(
                    "starting rank {rank} failed: {e}"
                )));
            }
        }
    }
    let grace = Duration::from_secs_f64(args.grace);
    let mut first: Option<i32> = None;
    let mut deadline: Option<Instant> = None;
    loop {
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(c) = slot else { continue };
            let status = match c.try_wait() {
                Ok(Some(s)) => s,
                Ok(None) => continue,
                Err(e) => {
                    eprintln!("memfit launch: waiting for rank {rank}: {e}");
                    let _ = c.kill();
                    c.wait().unwrap_or_else(|_| ExitStatus::default())
                }
            };
            let pid = c.id();
            *slot = None;
            if !status.success() {
                let (code, how) = describe(status);
                eprintln!("memfit launch: rank {rank} (pid {pid}) {how}");
                // EXIT_PEER_LOST (a rank lost a peer) is the consequence of another
                // rank's failure: the job's code is the cause's when one is
                // seen, whichever exited first.
                if first.is_none() || (first == Some(EXIT_PEER_LOST) && code != EXIT_PEER_LOST) {
                    first = Some(code);
                }
                deadline.get_or_insert(Instant::now() + grace);
            }
        }
        if children.iter().all(Option::is_none) {
            return Ok(first.unwrap_or(0));
        }
        if stop.load(Ordering::SeqCst) {
            eprintln!("memfit launch: interrupted; stopping the ranks");
            kill_all(&mut children);
            return Ok(130);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            let left: Vec<String> = children
                .iter()
                .enumerate()
                .filter(|(_, c)| c.is_some())
                .map(|(r, _)| r.to_string())
                .collect();
            eprintln!(
                "memfit launch: stopping rank {} ({} s after the first failure)",
                left.join(", "),
                args.grace
            );
            kill_all(&mut children);
            return Ok(first.unwrap_or(1));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn kill_all(children: &mut [Option<Child>]) {
    for c in children.iter_mut().flatten() {
        let _ = c.kill();
    }
    for c in children.iter_mut().flatten() {
        let _ = c.wait();
    }
}
