//! The command line, defined once with clap; `main.rs` only dispatches.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

use crate::backend::DeviceSpec;
use crate::error::{Error, Result};
use crate::knobs::Knobs;
use crate::run::RunOptions;

#[derive(Debug, Parser)]
#[command(
    name = "memfit",
    version,
    about = "Memory-footprint profiler and advisor for training transformers"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a model for a few steps: loss, throughput, peak memory by category.
    ///
    /// On cpu the engine trains for real (within an emulated capacity with
    /// --device cpu:limit=SIZE); on meta it plans one step without allocating
    /// anything. Knobs come from flags, a run recipe (--recipe) or defaults.
    Run(Box<RunArgs>),
    /// List the built-in model profiles.
    Models(ListArgs),
    /// List the built-in model, hardware (GPU) and network profiles.
    Profiles(ListArgs),
    /// Predict memory, time and cost for a recipe's grid; pick the cheapest fit.
    ///
    /// Every grid point runs one step of the engine on the meta backend, so
    /// the peaks are the engine's own, byte for byte; step time comes from
    /// the target GPU's roofline and cost from its $/GPU-hour.
    Plan(PlanArgs),
    /// Measure a recipe's grid for real, one process per trial; recommend one.
    ///
    /// Each trial runs in its own process: fit or OOM, peaks by category,
    /// tokens/s with a 95% interval. The cheapest fitting trial is
    /// recommended, and the reports (json, md, html, plots, DeepSpeed and
    /// Hugging Face exports) are written into --out.
    Sweep(SweepArgs),
    /// CI gate: compare a sweep's tracked peaks with a baseline's.
    Check(CheckArgs),
    /// The interactive profiler: a sweep live in the terminal.
    ///
    /// The grid, the running trial's memory chart, the breakdown at its peak
    /// and the recommendation, as the sweep goes (without a recipe: the
    /// quickstart grid).
    Tui(TuiArgs),
    /// Split a model's layers into pipeline stages, balancing memory or time.
    ///
    /// The exact best contiguous split by the largest stage peak (or the
    /// slowest stage), with the uniform split and fairscale's heuristic
    /// beside it; --verify runs the split on cpu and compares.
    Balance(Box<BalanceArgs>),
    /// Measure this host's (or a GPU's) FLOP/s, bandwidth and per-op cost (cached).
    ///
    /// On the host (the default, or --device cpu): GEMM FLOP/s per precision,
    /// other kernels' FLOP/s, memory bandwidth and the fixed cost of an op,
    /// in a few seconds: the roofline that cpu sweeps predict step times
    /// with. Cached per host CPU.
    ///
    /// With --device cuda[:N]: the GPU's GEMM curve per dtype over a ladder
    /// of shapes, fused attention by sequence length at head dims 64 and 128, its memory
    /// bandwidth and per-kernel overhead, through the cuda backend's own
    /// ops (each point timed for about 0.15 s). Stored per GPU model
    /// beside the host's calibration and bound to a hardware profile
    /// (--profile, or the built-in one the GPU's name and memory match):
    /// `memfit plan` on that profile then prices steps with the measured
    /// curves and says so (MEMFIT_NO_GPU_CALIBRATION=1 turns that off).
    /// --force measures again.
    Calibrate(CalibrateArgs),
    /// Check the cuda backend against the cpu backend: the GPU acceptance test.
    ///
    /// Every op on random inputs of several shapes (cuda and cpu, per-op
    /// tolerances), then gpt2-tiny and llama-tiny trained on both with
    /// matching losses, then meta's predicted peaks equal to cuda's measured
    /// ones, byte for byte. Exits 1 on any mismatch.
    Selftest(SelftestArgs),
    /// What of the NVIDIA stack this machine has, as --device cuda sees it.
    ///
    /// The driver and the CUDA version it supports; each GPU's name, memory,
    /// compute capability and MIG mode; for NVRTC, cuBLAS, cuBLASLt, NCCL and
    /// NVML the file found (searched in MEMFIT_CUDA_LIBS, LD_LIBRARY_PATH,
    /// the ld.so cache, CUDA_HOME/CUDA_PATH, /usr/local/cuda*/lib64 and
    /// python3's nvidia wheels), its version, or why not and the fix; and
    /// PyTorch's CUDA. Exits 0 when --device cuda has what it needs, 1 when
    /// something is missing.
    Doctor(DoctorArgs),
    /// Watch a training job's GPU memory live (NVML): peak, warnings, timeline.
    ///
    /// Starts a command (after `--`) or attaches to a running process
    /// (--pid), samples the GPUs through NVML (memory, utilisation, power,
    /// temperature, per-process memory, the job's descendants included), and
    /// shows it full-screen, or as lines with --no-tui. It records the
    /// timeline and the job's peak, warns when a GPU passes --warn-at, and
    /// with --model or --recipe puts memfit's prediction beside the measured
    /// peak. Without NVML the command still runs; its host memory is reported
    /// instead. Exits with the command's exit code.
    Watch(Box<WatchArgs>),
    /// Run `memfit run` as N processes, one rank each, like torchrun.
    ///
    /// Starts N copies of `memfit run` (the arguments after `--`) with the
    /// variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
    /// LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT); the ranks talk
    /// over TCP (NCCL on GPUs) and rank 0 prints the job's report, as
    /// `memfit run --ranks N` does with threads. When a rank fails, the
    /// others are stopped and its exit code is this command's.
    Launch(LaunchArgs),
    /// Print a shell completion script for memfit's commands and flags.
    ///
    /// Generated from the same definitions as --help. Install it where the
    /// shell looks: bash, `memfit completions bash >
    /// ~/.local/share/bash-completion/completions/memfit`; zsh, as `_memfit`
    /// in a directory of $fpath; fish, `memfit completions fish >
    /// ~/.config/fish/completions/memfit.fish`.
    Completions(CompletionsArgs),
    /// Print memfit's man page (roff), or write one page per command with --out.
    ///
    /// Generated from the same definitions as --help: `memfit man | man -l -`
    /// reads it now; `memfit man --out DIR` writes memfit.1 and
    /// memfit-<command>.1 for each command into DIR (e.g.
    /// ~/.local/share/man/man1).
    Man(ManArgs),
    /// Runs one sweep trial (memfit re-executes itself; not for direct use).
    #[command(hide = true)]
    Trial {
        /// The trial as JSON.
        #[arg(long)]
        spec: String,
    },
}

#[derive(Debug, clap::Args)]
pub struct ListArgs {
    /// Output format (json: the fields are listed in docs/cli.md).
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

#[derive(Debug, clap::Args)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: Shell,
}

/// The shells `memfit completions` writes for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Shell {
    /// Bash 4 or later, with bash-completion.
    Bash,
    /// Zsh (the `_memfit` completion function).
    Zsh,
    /// The fish shell.
    Fish,
    /// Elvish.
    Elvish,
    /// PowerShell (Windows PowerShell or pwsh).
    Powershell,
}

impl From<Shell> for clap_complete::Shell {
    fn from(s: Shell) -> Self {
        match s {
            Shell::Bash => clap_complete::Shell::Bash,
            Shell::Zsh => clap_complete::Shell::Zsh,
            Shell::Fish => clap_complete::Shell::Fish,
            Shell::Elvish => clap_complete::Shell::Elvish,
            Shell::Powershell => clap_complete::Shell::PowerShell,
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct ManArgs {
    /// Write memfit.1 and one memfit-<command>.1 page per command into this
    /// directory (created if missing) instead of printing memfit.1.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

/// Writes the completion script for `shell` to `out`.
pub fn write_completions(shell: Shell, out: &mut dyn std::io::Write) {
    use clap::CommandFactory;
    // clap_complete offers hidden commands too (bash does): rebuilt
    // without them, so `memfit trial`, which memfit runs itself, is not
    // offered.
    let full = Cli::command();
    let mut cmd = clap::Command::new("memfit")
        .version(env!("CARGO_PKG_VERSION"))
        .about(full.get_about().cloned().unwrap_or_default())
        .args(full.get_arguments().cloned())
        .subcommands(full.get_subcommands().filter(|s| !s.is_hide_set()).cloned());
    clap_complete::generate(clap_complete::Shell::from(shell), &mut cmd, "memfit", out);
}

/// The command as the man pages describe it: built, without the `help`
/// subcommand (its page would say nothing `--help` does not).
fn man_command() -> clap::Command {
    use clap::CommandFactory;
    let mut cmd = Cli::command().disable_help_subcommand(true);
    cmd.build();
    cmd
}

/// Writes memfit.1, the page for memfit itself, to `out`.
pub fn write_man(out: &mut dyn std::io::Write) -> std::io::Result<()> {
    clap_mangen::Man::new(man_command()).render(out)
}

/// Writes memfit.1 and memfit-<command>.1 for every visible command into
/// `dir`, creating it; returns the files written.
pub fn write_man_pages(dir: &std::path::Path) -> Result<Vec<PathBuf>> {
    let write_err = |e: std::io::Error| Error::Write {
        path: dir.to_path_buf(),
        source: e,
    };
    std::fs::create_dir_all(dir).map_err(write_err)?;
    let cmd = man_command();
    let mut pages = Vec::new();
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let page = clap_mangen::Man::new(sub.clone());
        let path = dir.join(page.get_filename());
        page.generate_to(dir).map_err(|e| Error::Write {
            path: path.clone(),
            source: e,
        })?;
        pages.push(path);
    }
    let page = clap_mangen::Man::new(cmd);
    pages.push(page.generate_to(dir).map_err(write_err)?);
    Ok(pages)
}

#[derive(Debug, clap::Args)]
pub struct LaunchArgs {
    /// Processes to start on this node, one rank each; the run's --ranks
    /// must equal --nnodes x --nproc.
    #[arg(long, visible_alias = "nproc-per-node")]
    pub nproc: usize,
    /// Nodes (machines) in the job, each running this command with its own
    /// --node-rank and the same other flags.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's index, 0..nnodes: its ranks are node-rank x nproc and up;
    /// node 0 runs rank 0, which prints the report.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Node 0's address or host name, as every node reaches it [default:
    /// 127.0.0.1; required with --nnodes above 1].
    #[arg(long)]
    pub master_addr: Option<String>,
    /// The port rank 0 listens on [default: a free one; required with
    /// --nnodes above 1].
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Seconds the other ranks get to finish after one fails, before they are killed.
    #[arg(long, default_value_t = 5.0)]
    pub grace: f64,
    /// The `memfit run` arguments, after `--` (`run` itself may be left out).
    #[arg(last = true, required = true, value_name = "RUN_ARGS")]
    pub run: Vec<String>,
}

impl LaunchArgs {
    pub fn options(&self) -> crate::launch::LaunchOptions {
        crate::launch::LaunchOptions {
            nproc: self.nproc,
            nnodes: self.nnodes,
            node_rank: self.node_rank,
            master_addr: self.master_addr.clone(),
            master_port: self.master_port,
            grace: self.grace,
            run: self.run.clone(),
        }
    }
}

/// `memfit run`'s arguments (`run` first) as `memfit run` parses them, for
/// `memfit launch` to check once before it starts the ranks.
pub fn parse_run(args: &[String]) -> Result<RunOptions> {
    let cli =
        Cli::try_parse_from(std::iter::once("memfit".to_string()).chain(args.iter().cloned()))
            .map_err(|e| {
                Error::invalid_arg(
                    "--",
                    format!("the run's arguments: {}", e.to_string().trim()),
                )
            })?;
    match cli.command {
        Command::Run(run) => run.options(),
        _ => unreachable!("the first argument is run"),
    }
}

/// `memfit balance`: `memfit run`'s knobs (resolved as run resolves them)
/// with balance's spelling, defaults and help where they differ: `--model`,
/// `--stages` (run's `--pipeline-stages`, its alias) and `--microbatches` required, a
/// micro-batch of 1, `--device` as balance takes it. The knobs balance
/// refuses (`balance_cmd::REFUSED`) are left out of its help.
#[derive(Debug, clap::Args)]
#[command(
    mut_arg("model", |a| a.required(true).help(
        "A built-in profile name, a profile YAML or a Hugging Face config.json"
    )),
    mut_arg("pipeline_stages", |a| a.required(true).long("stages").value_name("STAGES")
        .visible_alias("pipeline-stages").help(
        "Pipeline stages, each a rank holding a contiguous run of blocks (the embedding with the first, the head with the last)"
    )),
    mut_arg("microbatches", |a| a.required(true).help(
        "Micro-batches each step pushes through the pipeline"
    )),
    mut_arg("micro_batch", |a| a.help("Sequences per micro-batch [default: 1]")),
    mut_arg("device", |a| a.help(
        "cpu (layers timed here; cpu:limit=SIZE sets a capacity), cuda[:N] (timed on the GPU) or meta:GPU (times from the GPU profile's roofline, capacity its memory) [default: cpu]"
    )),
    mut_args(|a| {
        let refused = crate::balance_cmd::REFUSED.iter().any(|(k, _)| a.get_id() == *k);
        // One knob with two flags: balance's is --microbatches.
        match refused || a.get_id() == "grad_accum" {
            true => a.hide(true),
            false => a,
        }
    }),
)]
pub struct BalanceArgs {
    #[command(flatten)]
    pub knobs: Knobs,
    /// memory: minimise the largest stage peak; time: minimise the slowest
    /// stage with every stage within the capacity.
    #[arg(long, value_enum, default_value_t = crate::balance_cmd::By::Memory)]
    pub by: crate::balance_cmd::By,
    /// cpu timing: steps timed per layer, after one warm-up (the median counts).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Run the optimal split on cpu for one step and compare each stage's
    /// measured peak with the prediction.
    #[arg(long)]
    pub verify: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

impl BalanceArgs {
    pub fn options(&self) -> Result<crate::balance_cmd::BalanceOptions> {
        crate::balance_cmd::BalanceOptions::from_knobs(
            &self.knobs,
            self.by,
            self.repeats,
            self.verify,
        )
    }
}

#[derive(Debug, clap::Args)]
pub struct CalibrateArgs {
    /// What to measure: cpu (this host, the default) or cuda / cuda:N (a GPU;
    /// with MEMFIT_CUDA_EMULATE set, the emulated one).
    #[arg(long)]
    pub device: Option<DeviceSpec>,
    /// With --device cuda: the hardware profile (built-in name or YAML path)
    /// this GPU is, whose plans use the measurement [default: the built-in
    /// profile matching the GPU's name and memory].
    #[arg(long, value_name = "NAME|PATH")]
    pub profile: Option<String>,
    /// With --device cuda: the largest GEMM side and sequence length
    /// measured; the whole ladder scales with it (squares from max-dim/32,
    /// sequences from max-dim/16). Small values are for the emulated GPU,
    /// which runs kernels on the host.
    #[arg(long, default_value_t = crate::calibrate::gpu::DEFAULT_MAX_DIM as u64,
          value_parser = clap::value_parser!(u64).range(crate::calibrate::gpu::MIN_MAX_DIM as u64..=65536))]
    pub max_dim: u64,
    /// cpu threads to calibrate with (the emulated GPU's, with --device
    /// cuda) [default: all cores].
    #[arg(long, value_parser = threads)]
    pub threads: Option<usize>,
    /// Measure again even when a cached calibration exists.
    #[arg(long)]
    pub force: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

#[derive(Debug, clap::Args)]
pub struct SelftestArgs {
    /// The GPU to test: cuda or cuda:N.
    #[arg(long, default_value = "cuda")]
    pub device: crate::backend::DeviceSpec,
    /// Training steps per comparison.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub steps: u64,
    /// Seed of the random op inputs.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// How trials time their steps (`memfit sweep` and `memfit tui`).
#[derive(Debug, Clone, clap::Args)]
pub struct TimingArgs {
    /// Timed steps per trial at least, after one warm-up step.
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Timed steps per trial at most.
    #[arg(long, default_value_t = 40)]
    pub max_steps: usize,
    /// Stop timing once the median step's 95% interval is within this
    /// fraction of it.
    #[arg(long, default_value_t = 0.05)]
    pub target_ci: f64,
    /// Stop timing once a trial's timed steps took this many seconds.
    #[arg(long, default_value_t = 1.0)]
    pub time_budget: f64,
}

impl TimingArgs {
    /// The policy, or the flag that makes it unusable.
    pub fn timing(&self) -> Result<crate::stats::Timing> {
        let t = crate::stats::Timing {
            warmup_steps: 1,
            min_steps: self.steps,
            max_steps: self.max_steps,
            target_rel_ci: self.target_ci,
            budget_s: self.time_budget,
        };
        match t.invalid() {
            Some((flag, why)) => Err(Error::invalid_arg(flag, why)),
            None => Ok(t),
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct SweepArgs {
    /// A plan recipe (YAML); see `memfit plan`.
    pub recipe: PathBuf,
    /// Where trials run: cpu (optionally cpu:limit=SIZE, the capacity that
    /// decides fit) or meta [default: the recipe's `device`, else cpu].
    #[arg(long)]
    pub device: Option<DeviceSpec>,
    /// Directory for trials.jsonl and the reports.
    #[arg(long, default_value = "memfit-sweep")]
    pub out: PathBuf,
    /// Continue a sweep whose journal is in --out, skipping finished trials.
    #[arg(long)]
    pub resume: bool,
    /// Run every valid grid point instead of bisecting each fit boundary.
    #[arg(long)]
    pub exhaustive: bool,
    /// Take over --out's lock even when it names a sweep on another host
    /// whose lease is fresh (renewed every 60 s, lapsing after 300 s): for
    /// when that host went down. Without it such a lock is refused.
    #[arg(long)]
    pub break_lock: bool,
    #[command(flatten)]
    pub timing: TimingArgs,
    /// Rounds in which the cheapest trials are timed again, interleaved (a
    /// short bout of each per round, the order rotated), so that they share
    /// the host's load before they are ranked; 0 ranks each trial on its
    /// own measurement.
    #[arg(long, default_value_t = 9, value_parser = paired_rounds)]
    pub paired_rounds: usize,
    /// Seconds before a trial is killed and recorded as a timeout.
    #[arg(long, default_value_t = 300.0, value_parser = seconds)]
    pub trial_timeout: f64,
    /// cpu threads per trial [default: all cores].
    #[arg(long, value_parser = threads)]
    pub threads: Option<usize>,
    /// Output format. Piped, the sweep prints a line per finished trial as
    /// it goes: on stdout before the table, on stderr with json.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Test hook: make the N-th trial run fail (abort, sigkill or hang).
    #[cfg(feature = "test-hooks")]
    #[arg(long, hide = true, value_parser = crate::faults::parse_trial_fault)]
    pub test_fault: Option<(usize, crate::faults::Fault)>,
    /// Where trials run. With slurm, each round of trials (every one that
    /// does not wait on another's result) is one sbatch job array, one task
    /// per trial; --out and this memfit binary must be on a filesystem the
    /// compute nodes share.
    #[arg(long, value_enum, default_value_t = crate::sweep::slurm::ExecutorKind::Local)]
    pub executor: crate::sweep::slurm::ExecutorKind,
    /// Slurm partition for the trials (sbatch --partition) [default: the
    /// cluster's default partition].
    #[arg(long, value_name = "NAME", value_parser = crate::sweep::slurm::partition)]
    pub slurm_partition: Option<String>,
    /// Slurm time limit per trial (sbatch --time: MINUTES, HOURS:MINUTES:SECONDS,
    /// DAYS-HOURS:MINUTES:SECONDS) [default: --trial-timeout in whole minutes,
    /// plus one].
    #[arg(long, value_name = "TIME", value_parser = crate::sweep::slurm::time_limit)]
    pub slurm_time: Option<String>,
    /// One more sbatch option for the trials' job array, with its value
    /// (--slurm-extra=--mem=16G --slurm-extra=--account=ml); repeatable,
    /// passed after memfit's own (--nodes=1 --ntasks=1 --cpus-per-task=the
    /// trial threads), so it wins.
    #[arg(
        long,
        value_name = "ARG",
        allow_hyphen_values = true,
        value_parser = crate::sweep::slurm::extra_arg
    )]
    pub slurm_extra: Vec<String>,
}

#[derive(Debug, clap::Args)]
pub struct TuiArgs {
    /// A plan recipe (YAML) to sweep; without one, the grid builder opens on
    /// the quickstart's grid (recipes/quickstart.yaml, built in).
    pub recipe: Option<PathBuf>,
    /// Open the grid builder (on RECIPE when given): choose the model,
    /// hardware and every grid axis with the plan redrawn on each key, then
    /// write the grid (w) or measure it (Enter).
    #[arg(long)]
    pub new: bool,
    /// Where trials run: cpu, cpu:limit=SIZE or meta [default: the recipe's device, else cpu].
    #[arg(long)]
    pub device: Option<DeviceSpec>,
    /// Directory for the journal (shared with `memfit sweep`) and exports.
    #[arg(long, default_value = "memfit-tui")]
    pub out: PathBuf,
    /// Milliseconds between live memory samples of the running trial.
    #[arg(long, default_value_t = 25, value_parser = sample_ms)]
    pub sample_ms: u64,
    #[command(flatten)]
    pub timing: TimingArgs,
    /// Seconds before a trial is killed and recorded as a timeout.
    #[arg(long, default_value_t = 300.0, value_parser = seconds)]
    pub trial_timeout: f64,
    /// cpu threads per trial [default: all cores].
    #[arg(long, value_parser = threads)]
    pub threads: Option<usize>,
}

pub use crate::config::limits::{MAX_THREADS, MAX_TRIAL_SECONDS, check_seconds, check_threads};

// Flag values checked as clap parses them: a bad one stops the command
// before anything runs, with clap's message naming the flag (exit code 2).
use crate::knobs::threads;

fn seconds(s: &str) -> std::result::Result<f64, String> {
    check_seconds(s.parse().map_err(|e| format!("{e}"))?)
}

fn paired_rounds(s: &str) -> std::result::Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("{e}"))?;
    crate::sweep::retime::check_rounds(n)?;
    Ok(n)
}

fn sample_ms(s: &str) -> std::result::Result<u64, String> {
    match s.parse().map_err(|e| format!("{e}"))? {
        0 => Err("must be at least 1".into()),
        n => Ok(n),
    }
}

/// `memfit watch`.
#[derive(Debug, clap::Args)]
#[command(after_help = "Examples:
  memfit watch -- torchrun --nproc-per-node 8 train.py --batch 16
  memfit watch --no-tui --timeline run.csv --warn-at 95% -- python train.py
  memfit watch --pid 4242
  memfit watch --model llama-3.1-8b --seq-len 4096 --micro-batch 1 --precision bf16 -- python train.py
  memfit watch                      # the GPUs only, like nvitop")]
#[command(mut_arg("framework", |a| a.help(
    "Whose allocations to predict: hf-eager (a PyTorch + transformers training script) \
     or memfit (memfit's own engine) [default: hf-eager, or the recipe's]"
)))]
pub struct WatchArgs {
    /// Only this GPU (NVML index) [default: every GPU].
    #[arg(long, value_name = "N")]
    pub gpu: Option<u32>,
    /// Milliseconds between samples.
    #[arg(long, default_value_t = 100, value_parser = sample_ms)]
    pub sample_ms: u64,
    /// Attach to this running process (and its descendants) instead of
    /// starting a command; q stops watching, the process keeps running.
    #[arg(long, conflicts_with = "command")]
    pub pid: Option<u32>,
    /// Write every sample to this file: CSV (one row per GPU per sample), or
    /// JSON when the name ends in .json.
    #[arg(long, value_name = "FILE")]
    pub timeline: Option<PathBuf>,
    /// Warn when a GPU the job uses passes this share of its memory
    /// (a percentage: 90% or 90).
    #[arg(long, default_value = "90%", value_parser = warn_at, value_name = "PCT")]
    pub warn_at: f64,
    /// Print lines instead of the full-screen view (the default when stdout
    /// is not a terminal): a line when the peak grows, warnings, a summary.
    #[arg(long)]
    pub no_tui: bool,
    /// Format of the summary at the end; table goes to stderr, json to
    /// stdout (after the command's own output).
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Seconds between SIGTERM and SIGKILL when q or Ctrl-C stops the command.
    #[arg(long, default_value_t = 10.0, value_parser = seconds, value_name = "SECS")]
    pub grace: f64,
    /// The folder watch writes into when not given a file: with the
    /// full-screen view, the command's output goes to
    /// DIR/<UTC date-time>-<program>-<memfit's pid>.log, one file per watch
    /// (created only when something is written).
    #[arg(long, default_value = "memfit-watch", value_name = "DIR")]
    pub out: PathBuf,
    /// With the full-screen view, the command's stdout and stderr go to this
    /// file instead (its last lines are shown in a panel) [default: a new
    /// file in --out].
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    #[command(flatten)]
    pub predict: PredictArgs,
    /// The command to start and watch, after `--`; without it (and --pid),
    /// the GPUs are watched until q or Ctrl-C.
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

impl WatchArgs {
    pub fn options(&self) -> crate::watch::WatchOptions {
        crate::watch::WatchOptions {
            gpu: self.gpu,
            sample_ms: self.sample_ms,
            pid: self.pid,
            timeline: self.timeline.clone(),
            warn_at: self.warn_at,
            no_tui: self.no_tui,
            format: self.format,
            grace: self.grace,
            out: self.out.clone(),
            log: self.log.clone(),
            recipe: self.predict.recipe.clone(),
            knobs: self.predict.knobs.clone(),
            command: self.command.clone(),
        }
    }
}

/// The `memfit run` knobs `memfit watch` predicts with (on meta, emulating
/// the cuda backend); a prediction is made when --model or --recipe is
/// given. The job is taken to be hf-eager (a PyTorch + transformers
/// script) unless --framework or the recipe says otherwise.
#[derive(Debug, clap::Args)]
#[command(next_help_heading = "Prediction (the engine on meta, beside the measured peak)")]
pub struct PredictArgs {
    /// A run recipe (YAML), as for `memfit run`; flags override it.
    #[arg(long)]
    pub recipe: Option<PathBuf>,
    #[command(flatten)]
    pub knobs: Knobs,
}

/// `--warn-at`: `90%` or `90`, a percentage in (0, 100], as a fraction.
fn warn_at(s: &str) -> std::result::Result<f64, String> {
    let t = s.trim();
    let had_pct = t.ends_with('%');
    let v: f64 = t
        .trim_end_matches('%')
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a percentage; write one like 90%"))?;
    if !v.is_finite() || v <= 0.0 || v > 100.0 {
        return Err(format!(
            "`{s}`: must be a percentage above 0 and at most 100"
        ));
    }
    if !had_pct && v < 1.0 {
        return Err(format!(
            "`{s}` reads as {v}% of the memory; write the percentage, like 90%"
        ));
    }
    Ok(v / 100.0)
}

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// A plan recipe (YAML): model, hardware, seq_len, global_batch, grid, headroom, cost.
    pub recipe: PathBuf,
    /// Output format.
    #[arg(long, value_enum, default_value_t = DocFormat::Table)]
    pub format: DocFormat,
    /// Rows the table shows (fitting points cheapest first).
    #[arg(long, default_value_t = 40)]
    pub top: usize,
    /// Every column and no wrapping (the table otherwise fits COLUMNS or the
    /// terminal's width, 100 when not a terminal, hiding the columns that
    /// matter least and naming them).
    #[arg(long)]
    pub wide: bool,
    /// Plan again each time the recipe file changes, until Ctrl-C: at a
    /// terminal the screen is redrawn; otherwise each plan follows the last
    /// (JSON: one document each). A recipe that does not parse is reported
    /// and watched until it does.
    #[arg(long)]
    pub watch: bool,
}

pub use crate::report::{DocFormat, Format};

/// `memfit check`.
#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// The current sweep: its output directory, or its report.json.
    pub current: PathBuf,
    /// The baseline sweep to compare against: a directory or a report.json.
    #[arg(long)]
    pub baseline: PathBuf,
    /// Allowed growth of a config's peak before it counts as a regression:
    /// "2%", "0.5%", or a bare number of percent ("2"). Categories get the same
    /// tolerance, relative to their own baseline bytes.
    #[arg(long, default_value = "2%")]
    pub tolerance: String,
    /// Also fail (exit 1) when a memory category grew beyond the tolerance and
    /// by at least 64 KiB while the total did not; without it that is a warning.
    #[arg(long)]
    pub per_category: bool,
    /// Accept configs present in one report only, configs the baseline
    /// measured and the current report did not, and an interrupted sweep:
    /// list them as warnings instead of refusing (exit 2). A report without
    /// trials, two reports with no config in common, duplicate trial ids, or
    /// a check that compared no config are refused anyway.
    #[arg(long)]
    pub allow_missing: bool,
    /// Which peak to gate on: `tracked` (the engine's tracker: deterministic,
    /// the default) or `nvml` (each trial process's GPU memory as NVML saw
    /// it; GPU sweeps with NVML only, and noisier).
    #[arg(long, value_enum, default_value_t = crate::check::Metric::Tracked)]
    pub metric: crate::check::Metric,
    /// Output format (JSON: every compared config, its verdict and
    /// per-category peaks, and the warnings).
    #[arg(long, value_enum, default_value_t = DocFormat::Table)]
    pub format: DocFormat,
}

impl CheckArgs {
    pub fn request(&self) -> crate::check::CheckRequest {
        crate::check::CheckRequest {
            current: self.current.clone(),
            baseline: self.baseline.clone(),
            tolerance: self.tolerance.clone(),
            per_category: self.per_category,
            allow_missing: self.allow_missing,
            metric: self.metric,
            format: self.format,
        }
    }
}

/// `memfit run`: a recipe, the knobs (flags override the recipe's keys)
/// and what to write.
#[derive(Clone, Debug, clap::Args)]
pub struct RunArgs {
    /// A run recipe (YAML, keys as the knob flags below with `_` for `-`); flags override it.
    #[arg(long)]
    pub recipe: Option<PathBuf>,
    #[command(flatten)]
    pub knobs: Knobs,
    /// Write the memory timeline (one CSV line per allocation and free) to this file.
    #[arg(long)]
    pub timeline: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

impl RunArgs {
    /// The run's options: each knob from its flag, else the recipe, else the
    /// default ([`crate::run::options::resolve`]).
    pub fn options(&self) -> Result<RunOptions> {
        crate::run::options::resolve(self.recipe.as_deref(), &self.knobs, self.timeline.clone())
    }
}
