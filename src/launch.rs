//! `memfit launch`: a job of `memfit run` processes, one rank each, on this
//! machine or on several (a torchrun); and the rank side of any such job.
//!
//! The launcher starts `--nproc` copies of this binary's `memfit run` with
//! the environment torchrun sets (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `GROUP_WORLD_SIZE`, `MASTER_ADDR`:
//! `--master-addr` or 127.0.0.1, `MASTER_PORT`: given, or a free port),
//! waits for them, and when one fails gives the others `--grace` seconds to
//! finish (rank 0 prints the job's report) before killing them; its exit
//! code is the first failing rank's (128 + the signal for a killed one), 0
//! when every rank succeeded. A job of `--nnodes N` machines runs one
//! launcher on each, with the same flags but its own `--node-rank R`: it
//! starts ranks `R x nproc ..`, of a world of `N x nproc`, and every rank
//! meets rank 0 (on node 0) at `--master-addr:--master-port`. A launcher
//! sees only its own node's ranks: a failure elsewhere reaches it through
//! them (they lose a peer: exit 4). The ranks die with their launcher.
//! Each rank is handed the job's secret (`MEMFIT_LAUNCH_TOKEN`: the
//! launcher's own, required across nodes, or a random one on one node),
//! which it presents in its hello; a connection without it is dropped.
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

use crate::comm::process::{DistEnv, EXIT_PEER_LOST};
use crate::error::Error;
use crate::memory::{ByCategory, Category, PeakBytes, Tracker};
use crate::report::Format;
use crate::report::run::{ErrorRecord, RankRecord, RunReport, render_table};
use crate::run::RunOptions;
use crate::run::run_process_rank;

/// One line on stderr in one write: the ranks of a job share the
/// terminal, and `eprintln!` may write a line in pieces that another
/// process's line then splits.
fn say(line: String) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// Whether this `memfit run` is a rank of a multi-process job (or was
/// given a rank's environment that needs an error).
pub fn is_rank() -> bool {
    !matches!(DistEnv::from_env(), Ok(None))
}

/// `memfit run` as one rank: trains, then rank 0 prints the job's report.
/// Returns the exit code.
pub fn rank_main(
    recipe: Option<&std::path::Path>,
    knobs: &crate::knobs::Knobs,
    timeline: Option<std::path::PathBuf>,
    format: Format,
) -> i32 {
    let env = match DistEnv::from_env() {
        Ok(Some(e)) => e,
        Ok(None) => unreachable!("is_rank said this is a rank"),
        Err(e) => {
            say(format!("memfit: {e}"));
            return e.exit_code();
        }
    };
    let who = format!("rank {}", env.rank);
    let opts = match crate::run::options::resolve(recipe, knobs, timeline) {
        Ok(o) => o,
        Err(e) => {
            say(format!("memfit: {who}: {e}"));
            return e.exit_code();
        }
    };
    let (group, out) = match run_process_rank(&opts, &env) {
        Ok(x) => x,
        Err(e) => {
            say(format!("memfit: {who}: {e}"));
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
                    true => say(format!("memfit: {why}")),
                    false => say(format!("memfit: {who}: {why}")),
                }
                code
            }
        };
    };
    let job = merge(&opts.train, env.local_world, report, parts, group.failure());
    if let Some(r) = &job.report {
        match format {
            Format::Json => println!(
                "{}",
                serde_json::to_string_pretty(r).expect("report serialises")
            ),
            Format::Table => print!("{}", render_table(r)),
        }
    }
    if let Some(why) = &job.message {
        say(format!("memfit: {why}"));
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
    #[serde(default)]
    chunks: Vec<[usize; 2]>,
    peak: PeakBytes,
    at_peak: PeakBytes,
    sent: u64,
    received: u64,
    host_peak: Option<PeakBytes>,
    #[serde(default)]
    paged: Option<u64>,
    predicted: Option<u64>,
    nvml: Option<u64>,
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
            chunks: r.chunks.clone(),
            peak: r.peak_bytes,
            at_peak: r.peak_breakdown.into(),
            sent: r.sent_bytes_per_step,
            received: r.received_bytes_per_step,
            host_peak: r.host_peak_bytes,
            paged: r.paged_bytes,
            predicted: r.predicted_peak_bytes,
            nvml: r.nvml_peak_bytes,
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
    per_node: usize,
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
            let mut r = combine(r, &got, (train, per_node), only);
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
        report: Some(combine(mine, &got, (train, per_node), None)),
        message: None,
        code: 0,
    }
}

/// Rank 0's report with every rank's peaks, the job's losses and one
/// replica's work, computed as `run::run_on` and `Cluster` compute them.
/// `per_node` ranks share a node (LOCAL_WORLD_SIZE): the host record's
/// node figure is the fullest node's.
fn combine(
    mut report: RunReport,
    parts: &[Part],
    (train, per_node): (&crate::engine::TrainConfig, usize),
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
                chunks: r.chunks.clone(),
                peak_bytes: r.peak,
                peak_breakdown: by_category(&r.at_peak),
                sent_bytes_per_step: r.sent,
                received_bytes_per_step: r.received,
                host_peak_bytes: r.host_peak,
                paged_bytes: r.paged,
                predicted_peak_bytes: r.predicted,
                nvml_peak_bytes: r.nvml,
            })
        })
        .collect();
    crate::report::run::summarise_ranks(&mut report);
    if let Some(h) = &mut report.host {
        let mut top = PeakBytes::default();
        let mut nodes = std::collections::BTreeMap::<usize, u64>::new();
        for r in &report.ranks {
            let Some(pk) = r.host_peak_bytes else {
                continue;
            };
            for c in Category::ALL {
                top.set(c, top.get(c).max(pk.get(c)));
            }
            top.total = top.total.max(pk.total);
            *nodes.entry(r.rank / per_node.max(1)).or_default() += pk.total;
        }
        h.peak_bytes = top;
        h.node_bytes = nodes.values().copied().max().unwrap_or(0);
    }
    if let Some(p) = &mut report.paged {
        p.peak_bytes = (report.ranks.iter())
            .filter_map(|r| r.paged_bytes)
            .max()
            .unwrap_or(0);
    }
    // One replica's work: every stage and tensor-parallel rank of replica 0.
    let sum = |f: fn(&Part) -> &String| -> u128 {
        parts
            .iter()
            .filter(|p| train.place(p.rank).1 == 0)
            .map(|p| f(p).parse::<u128>().unwrap_or(0))
            .sum()
    };
    report.flops_per_step = sum(|p| &p.flops);
    report.bytes_moved_per_step = sum(|p| &p.bytes_moved);
    // The loss: the mean over the last stage's replicas, one rank of each
    // tensor-parallel group (Cluster::step_from).
    let last: Vec<&Part> = parts
        .iter()
        .filter(|p| {
            let (s, _, t) = train.place(p.rank);
            s == stages - 1 && t == 0
        })
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

/// What `memfit launch` was asked: the job's shape and the run's
/// arguments (`cli::LaunchArgs` fills it).
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    pub nproc: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: Option<String>,
    pub master_port: Option<u16>,
    pub grace: f64,
    /// `memfit run`'s arguments (`run` first).
    pub run: Vec<String>,
}

/// Reads `memfit run`'s arguments (`run` first) into its options, or the
/// error their parse gives: the command line's grammar is the binary's,
/// so its caller supplies it.
pub type RunParser<'a> = &'a dyn Fn(&[String]) -> crate::Result<RunOptions>;

/// `memfit launch`: returns the exit code.
pub fn launch_main(args: &LaunchOptions, parse_run: RunParser) -> i32 {
    match launch(args, parse_run) {
        Ok(code) => code,
        Err(e) => {
            say(format!("memfit launch: {e}"));
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

/// Where the job's rank 0 is, and which ranks this node runs.
struct Placement {
    /// This node's first global rank.
    base: usize,
    world: usize,
    master_addr: String,
    master_port: Option<u16>,
}

/// The job's shape from the launcher's flags, or the flag at fault.
fn placement(args: &LaunchOptions) -> crate::Result<Placement> {
    let (n, nnodes, node) = (args.nproc, args.nnodes, args.node_rank);
    let max = crate::run::MAX_RANKS;
    if !(1..=max).contains(&n) {
        return Err(Error::invalid_arg(
            "--nproc",
            format!("{n} is outside 1..={max}"),
        ));
    }
    if !(1..=max).contains(&nnodes) {
        return Err(Error::invalid_arg(
            "--nnodes",
            format!("{nnodes} is outside 1..={max}"),
        ));
    }
    let world = n * nnodes;
    if world > max {
        return Err(Error::invalid_arg(
            "--nnodes",
            format!(
                "{nnodes} nodes of --nproc {n} are {world} ranks, more than the {max} a run takes"
            ),
        ));
    }
    if node >= nnodes {
        return Err(Error::invalid_arg(
            "--node-rank",
            format!(
                "{node} is outside 0..{nnodes} (--nnodes is {nnodes}); nodes are numbered from 0, and node 0 runs rank 0"
            ),
        ));
    }
    let master_addr = match &args.master_addr {
        Some(a) if a.trim().is_empty() => {
            return Err(Error::invalid_arg(
                "--master-addr",
                "is empty; give node 0's address or host name",
            ));
        }
        Some(a) => a.trim().to_string(),
        None if nnodes > 1 => {
            return Err(Error::invalid_arg(
                "--master-addr",
                format!(
                    "required with --nnodes {nnodes}: node 0's address or host name, as every node reaches it (rank 0 listens there); give every node the same --master-addr and --master-port"
                ),
            ));
        }
        None => "127.0.0.1".to_string(),
    };
    match args.master_port {
        Some(0) => {
            return Err(Error::invalid_arg(
                "--master-port",
                "0 is not a port; give one in 1..=65535, or leave it out on one node for a free one",
            ));
        }
        None if nnodes > 1 => {
            return Err(Error::invalid_arg(
                "--master-port",
                format!(
                    "required with --nnodes {nnodes}: the port rank 0 listens on, free on node 0 and the same on every node"
                ),
            ));
        }
        _ => {}
    }
    // The ranks other than rank 0 connect to the address: say it once here
    // if it does not resolve, rather than once per rank.
    if world > 1 && (node > 0 || n > 1) {
        use std::net::ToSocketAddrs as _;
        let found = (master_addr.as_str(), args.master_port.unwrap_or(1))
            .to_socket_addrs()
            .map_err(|e| {
                Error::invalid_arg(
                    "--master-addr",
                    format!("cannot resolve `{master_addr}` on this node: {e}"),
                )
            })?;
        if found.count() == 0 {
            return Err(Error::invalid_arg(
                "--master-addr",
                format!("`{master_addr}` resolves to no address on this node"),
            ));
        }
    }
    Ok(Placement {
        base: node * n,
        world,
        master_addr,
        master_port: args.master_port,
    })
}

/// The ranks die with their launcher: one killed outright (SIGKILL, the
/// OOM killer, a lost node's cleanup) cannot stop them itself, and ranks
/// left behind would keep their peers on the other nodes waiting out the
/// timeout, and keep their cores.
fn die_with_launcher(c: &mut Command) {
    crate::sys::signals::die_with_parent(c);
}

/// The secret this job's ranks present to each other: the launcher's own
/// `MEMFIT_LAUNCH_TOKEN`, else, on one node, a fresh random one. Launchers
/// on several nodes cannot agree on a random one, so there it is required.
fn launch_token(nnodes: usize) -> crate::Result<String> {
    use crate::comm::process::TOKEN_ENV;
    if let Some(t) = std::env::var(TOKEN_ENV)
        .ok()
        .filter(|t| !t.trim().is_empty())
    {
        return Ok(t);
    }
    if nnodes > 1 {
        return Err(Error::invalid_arg(
            TOKEN_ENV,
            format!(
                "not set; with --nnodes {nnodes} every node's launcher needs the same secret, which its ranks present to each other so that no other process on the network can join the job: set it to one random string on every node, e.g. `export {TOKEN_ENV}=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n')`"
            ),
        ));
    }
    // 128 bits from the OS's randomness (std seeds each RandomState from it).
    use std::hash::{BuildHasher as _, Hasher as _};
    let part = || {
        std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
    };
    Ok(format!("{:016x}{:016x}", part(), part()))
}

fn launch(args: &LaunchOptions, parse_run: RunParser) -> crate::Result<i32> {
    let n = args.nproc;
    let Placement {
        base,
        world,
        master_addr,
        master_port,
    } = placement(args)?;
    if !(args.grace.is_finite() && args.grace >= 0.0) {
        return Err(Error::invalid_arg(
            "--grace",
            "must be 0 or positive seconds",
        ));
    }
    let run_args = run_command(&args.run)?;
    // Check the run's flags once here rather than N times in the ranks.
    let opts = parse_run(&run_args)?;
    if opts.train.ranks != world {
        let job = match args.nnodes {
            1 => format!("--nproc is {n}"),
            m => format!("the job has --nnodes {m} x --nproc {n} = {world} ranks"),
        };
        return Err(Error::invalid_arg(
            "--ranks",
            format!(
                "the run has --ranks {} but {job}: one process per rank; pass --ranks {world}",
                opts.train.ranks
            ),
        ));
    }
    let port = match master_port {
        Some(p) => p,
        // One node: a port free on every interface, where rank 0 listens.
        None => crate::comm::process::wildcard(0)
            .iter()
            .find_map(|a| std::net::TcpListener::bind(a).ok())
            .ok_or_else(|| std::io::Error::other("no address to bind"))
            .and_then(|l| l.local_addr())
            .map_err(|e| Error::Unavailable(format!("no free port for MASTER_PORT: {e}")))?
            .port(),
    };
    let token = launch_token(args.nnodes)?;
    let exe = std::env::current_exe()
        .map_err(|e| Error::Unavailable(format!("cannot find the memfit binary: {e}")))?;
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = Arc::clone(&stop);
        // Ctrl-C reaches the ranks too (same process group); this makes
        // sure none is left behind.
        crate::sys::signals::on_interrupt(stop);
    }
    let who = match args.nnodes {
        1 => "memfit launch".to_string(),
        m => format!("memfit launch (node {} of {m})", args.node_rank),
    };
    let node = NodeRanks {
        args,
        base,
        world,
        master_addr,
        port,
        token,
        exe,
        run_args,
        who,
    };
    let children = node.spawn()?;
    Ok(node.supervise(children, &stop))
}

/// The command line each rank runs: `run` and its flags (`run` is implied
/// when they start with a flag).
fn run_command(run: &[String]) -> crate::Result<Vec<String>> {
    let mut run_args = run.to_vec();
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
    Ok(run_args)
}

/// This node's ranks of a job: how each is started, and the launcher's
/// name in what it says about them.
struct NodeRanks<'a> {
    args: &'a LaunchOptions,
    /// This node's first global rank.
    base: usize,
    world: usize,
    master_addr: String,
    port: u16,
    token: String,
    exe: std::path::PathBuf,
    run_args: Vec<String>,
    who: String,
}

impl NodeRanks<'_> {
    /// Starts every rank of this node; none is left running on a failure.
    fn spawn(&self) -> crate::Result<Vec<Option<Child>>> {
        let (args, n) = (self.args, self.args.nproc);
        let mut children: Vec<Option<Child>> = Vec::with_capacity(n);
        for local in 0..n {
            let rank = self.base + local;
            let mut cmd = Command::new(&self.exe);
            cmd.args(&self.run_args)
                // This job's port is MASTER_PORT, whatever this shell says.
                .env_remove(crate::comm::process::PORT_ENV)
                .env_remove(crate::comm::process::AGENT_STORE_ENV)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", self.world.to_string())
                .env("LOCAL_RANK", local.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("GROUP_RANK", args.node_rank.to_string())
                .env("GROUP_WORLD_SIZE", args.nnodes.to_string())
                .env("MASTER_ADDR", &self.master_addr)
                .env(crate::comm::process::TOKEN_ENV, &self.token)
                .env("MASTER_PORT", self.port.to_string());
            die_with_launcher(&mut cmd);
            match cmd.spawn() {
                Ok(c) => children.push(Some(c)),
                Err(e) => {
                    kill_all(&mut children);
                    return Err(Error::Unavailable(format!(
                        "starting rank {rank} failed: {e}"
                    )));
                }
            }
        }
        Ok(children)
    }

    /// Waits for the ranks: the job's exit code once all have exited, the
    /// first failure's (the cause's rather than a lost peer's) when one
    /// fails, stopping the rest `--grace` seconds after it; 130 on Ctrl-C.
    fn supervise(&self, mut children: Vec<Option<Child>>, stop: &AtomicBool) -> i32 {
        let (args, base, who) = (self.args, self.base, &self.who);
        let grace = Duration::from_secs_f64(args.grace);
        let mut first: Option<i32> = None;
        let mut deadline: Option<Instant> = None;
        loop {
            for (local, slot) in children.iter_mut().enumerate() {
                let rank = base + local;
                let Some(c) = slot else { continue };
                let status = match c.try_wait() {
                    Ok(Some(s)) => s,
                    Ok(None) => continue,
                    Err(e) => {
                        say(format!("{who}: waiting for rank {rank}: {e}"));
                        let _ = c.kill();
                        c.wait().unwrap_or_else(|_| ExitStatus::default())
                    }
                };
                let pid = c.id();
                *slot = None;
                if !status.success() {
                    let (code, how) = describe(status);
                    say(format!("{who}: rank {rank} (pid {pid}) {how}"));
                    // EXIT_PEER_LOST (a rank lost a peer) is the consequence of another
                    // rank's failure: the job's code is the cause's when one is
                    // seen, whichever exited first.
                    if first.is_none() || (first == Some(EXIT_PEER_LOST) && code != EXIT_PEER_LOST)
                    {
                        first = Some(code);
                    }
                    deadline.get_or_insert(Instant::now() + grace);
                }
            }
            if children.iter().all(Option::is_none) {
                return first.unwrap_or(0);
            }
            if stop.load(Ordering::SeqCst) {
                say(format!("{who}: interrupted; stopping the ranks"));
                kill_all(&mut children);
                return 130;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                let left: Vec<String> = children
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| c.is_some())
                    .map(|(r, _)| (base + r).to_string())
                    .collect();
                say(format!(
                    "{who}: stopping rank {} ({} s after the first failure)",
                    left.join(", "),
                    args.grace
                ));
                kill_all(&mut children);
                return first.unwrap_or(1);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
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
