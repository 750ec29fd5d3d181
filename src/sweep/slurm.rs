//! `memfit sweep --executor slurm`: each round of a sweep's trials as one
//! Slurm job array.
//!
//! The driver's selection hands over every trial it can decide without the
//! others' results (all of them under `--exhaustive`; else each group's
//! first candidate, then what is below each fit boundary). [`Array::run`]
//! writes one spec file per trial and a batch script into `OUT/slurm/`,
//! submits them with `sbatch --parsable --array=<grid indices>`, and polls
//! `scontrol show job` (then `sacct`, once slurmctld has forgotten the job)
//! until every task has ended. Array task `i` is grid point `i`: it runs
//! `memfit trial --spec "$(cat spec-i.json)"` with this very binary under
//! `timeout` (the trial timeout), its stdout in `out-i.json`, its stderr in
//! `err-i.txt`, and its exit code with its start and end in `status-i.txt`.
//! Each task that ends is classified as a local child's end would be (the
//! Slurm states that have no local equivalent, TIMEOUT, OUT_OF_MEMORY,
//! CANCELLED and the node failures, are mapped onto the nearest one with a
//! note) and handed back at once, so the driver journals it. Ctrl-C, an
//! error or a panic cancel the job (`scancel`); a sweep killed outright
//! leaves its job ids in `OUT/slurm/jobs.jsonl`, and the next sweep in that
//! directory cancels those still queued or running before it submits.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::driver::{Ended, Executor};
use super::trial::{SAMPLE_PREFIX, TrialOutput, TrialSpec};
use crate::error::{Error, Result};

/// `--executor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ExecutorKind {
    /// Child processes on this host, one trial at a time.
    Local,
    /// sbatch job arrays: every trial a round can run at once, on the cluster.
    Slurm,
}

/// The `--slurm-*` flags.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlurmOptions {
    /// `sbatch --partition`; the cluster's default partition when unset.
    pub partition: Option<String>,
    /// `sbatch --time`; the trial timeout rounded up to minutes, plus one, when unset.
    pub time: Option<String>,
    /// More sbatch options, passed as they are (after memfit's own, so they win).
    pub extra: Vec<String>,
}

/// The executor `memfit sweep`'s flags ask for (`--executor`, and the
/// `--slurm-*` flags as `options`); `--slurm-*` without `--executor slurm`
/// is refused rather than ignored.
pub fn executor(kind: ExecutorKind, options: SlurmOptions) -> Result<Executor> {
    match kind {
        ExecutorKind::Slurm => Ok(Executor::Slurm(options)),
        ExecutorKind::Local => {
            let set = [
                ("--slurm-partition", options.partition.is_some()),
                ("--slurm-time", options.time.is_some()),
                ("--slurm-extra", !options.extra.is_empty()),
            ];
            match set.iter().find(|(_, on)| *on) {
                Some((flag, _)) => Err(Error::invalid_arg(
                    flag,
                    "applies to --executor slurm only (trials run locally by default)",
                )),
                None => Ok(Executor::Local),
            }
        }
    }
}

/// `--slurm-partition`: a partition name, or a comma-separated list of them.
pub fn partition(s: &str) -> std::result::Result<String, String> {
    if s.is_empty() || s.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("expected a partition name (or names separated by commas)".into());
    }
    Ok(s.to_string())
}

/// `--slurm-time`: what `sbatch --time` takes (MINUTES, MINUTES:SECONDS,
/// HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES,
/// DAYS-HOURS:MINUTES:SECONDS, or UNLIMITED).
pub fn time_limit(s: &str) -> std::result::Result<String, String> {
    let bad = || {
        format!(
            "`{s}` is not a Slurm time limit: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES, DAYS-HOURS:MINUTES:SECONDS or UNLIMITED"
        )
    };
    if matches!(s, "UNLIMITED" | "INFINITE") {
        return Ok(s.to_string());
    }
    let number = |p: &str| !p.is_empty() && p.len() <= 9 && p.bytes().all(|b| b.is_ascii_digit());
    let clock = match s.split_once('-') {
        Some((days, rest)) if number(days) => rest,
        Some(_) => return Err(bad()),
        None => s,
    };
    let parts: Vec<&str> = clock.split(':').collect();
    if parts.len() > 3 || !parts.iter().all(|p| number(p)) {
        return Err(bad());
    }
    Ok(s.to_string())
}

/// `--slurm-extra`: one sbatch option (with its value, `--mem=8G`); the
/// ones memfit sets itself to find each trial's files are refused.
pub fn extra_arg(s: &str) -> std::result::Result<String, String> {
    if !s.starts_with('-') {
        return Err(format!(
            "`{s}` is not an sbatch option: give one option with its value per flag, as --slurm-extra=--mem=8G"
        ));
    }
    let long = |name: &str| s == name || s.starts_with(&format!("{name}="));
    let short = |c: char| !s.starts_with("--") && s[1..].starts_with(c);
    if long("--array") || short('a') {
        return Err("memfit chooses the array's tasks itself (one per trial)".into());
    }
    if long("--output") || short('o') || long("--error") || short('e') {
        return Err("memfit reads each task's output from OUT/slurm/ and sets it itself".into());
    }
    if long("--wrap") || long("--parsable") {
        return Err(format!("memfit sets {s} itself"));
    }
    Ok(s.to_string())
}

/// The commands the executor runs.
const TOOLS: [&str; 4] = ["sbatch", "squeue", "scontrol", "scancel"];

/// Whether `tool` is an executable file on `PATH`.
fn on_path(tool: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| {
            std::fs::metadata(dir.join(tool))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// The Slurm commands on `PATH`, checked before anything else runs.
pub fn check_tools() -> Result<()> {
    let missing: Vec<&str> = TOOLS.into_iter().filter(|t| !on_path(t)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(Error::invalid_arg(
        "--executor",
        format!(
            "slurm submits trials with sbatch and follows them with squeue, scontrol and scancel, but {} {} not on PATH; run the sweep where the Slurm client commands are installed (a login node, or after `module load slurm`), or use --executor local",
            missing.join(", "),
            if missing.len() == 1 { "is" } else { "are" }
        ),
    ))
}

/// The controller's `MaxArraySize` bounds the array task ids, which are
/// grid indices: checked (and the controller reached) before any trial.
pub fn check_grid(points: usize) -> Result<()> {
    let out = Command::new("scontrol")
        .args(["show", "config"])
        .output()
        .map_err(|e| Error::Unavailable(format!("cannot run scontrol: {e}")))?;
    if !out.status.success() {
        return Err(Error::Unavailable(format!(
            "the Slurm controller does not answer (`scontrol show config`: {}); nothing was submitted",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let max = text
        .lines()
        .filter_map(|l| l.split_once('='))
        .find(|(k, _)| k.trim() == "MaxArraySize")
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(1001);
    if points > max {
        return Err(Error::invalid_arg(
            "--executor",
            format!(
                "slurm runs grid point i as array task i, and this cluster's MaxArraySize is {max}, below the grid's {points} points; split the recipe's grid, or raise MaxArraySize in slurm.conf"
            ),
        ));
    }
    Ok(())
}

/// One submitted array, as `OUT/slurm/jobs.jsonl` records it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Job {
    pub job: String,
    /// The cluster `sbatch --parsable` named, on a federation.
    pub cluster: Option<String>,
    /// Array task ids, which are grid indices.
    pub tasks: Vec<usize>,
    pub submitted_unix_s: u64,
}

impl Job {
    /// `sbatch --parsable` prints `JOBID` or `JOBID;CLUSTER`.
    fn parse(stdout: &str, tasks: Vec<usize>) -> Option<Job> {
        let line = stdout.lines().map(str::trim).find(|l| !l.is_empty())?;
        let (job, cluster) = match line.split_once(';') {
            Some((j, c)) => (j, Some(c.to_string())),
            None => (line, None),
        };
        if job.is_empty() || !job.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        Some(Job {
            job: job.to_string(),
            cluster,
            tasks,
            submitted_unix_s: crate::units::now_unix_s(),
        })
    }

    /// A Slurm command aimed at this job's cluster.
    fn command(&self, tool: &str) -> Command {
        let mut c = Command::new(tool);
        if let Some(cluster) = &self.cluster {
            c.args(["--clusters", cluster]);
        }
        c
    }

    fn cancel(&self) {
        let _ = self.command("scancel").arg(&self.job).output();
    }
}

/// Cancels the jobs an earlier sweep in `out` left queued or running (it
/// was killed before it could): their results would land on top of this
/// sweep's. The caller holds the directory's lock, so no live sweep owns
/// them. Returns what it did, to print.
pub fn cancel_leftovers(out: &Path) -> Option<String> {
    let text = std::fs::read_to_string(out.join("slurm").join(JOBS)).ok()?;
    let jobs: Vec<Job> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let mut cancelled = Vec::new();
    for job in &jobs {
        let listed = job
            .command("squeue")
            .args(["-h", "-j", &job.job, "-o", "%i"])
            .output()
            .is_ok_and(|o| o.status.success() && !o.stdout.trim_ascii().is_empty());
        if listed {
            job.cancel();
            cancelled.push(job.job.clone());
        }
    }
    (!cancelled.is_empty()).then(|| {
        format!(
            "cancelled Slurm job(s) {} that an earlier sweep in {} left queued or running; their trials are submitted again",
            cancelled.join(", "),
            out.display()
        )
    })
}

/// The file listing every array this directory's sweeps submitted.
pub const JOBS: &str = "jobs.jsonl";

/// One trial to run.
pub struct Task {
    /// Its grid index, and its array task id.
    pub index: usize,
    pub spec: TrialSpec,
}

/// A task that ended, classified.
pub(super) struct Finished {
    pub(super) index: usize,
    pub(super) ended: Ended,
    pub(super) elapsed_s: f64,
    /// Replaces the record's default note (for the Slurm states a local
    /// child cannot end in).
    pub(super) note: Option<String>,
}

/// How one round's job array is submitted.
pub struct Array<'a> {
    pub options: &'a SlurmOptions,
    /// The sweep's `--out`.
    pub out: &'a Path,
    /// `--cpus-per-task`.
    pub threads: usize,
    /// Ask for one GPU per task (cuda trials).
    pub gpu: bool,
    /// The trial timeout, enforced inside each task with `timeout`.
    pub timeout: Duration,
}

/// Cancels the job unless disarmed: an error or a panic while following it
/// leaves nothing running.
struct CancelOnDrop<'a>(Option<&'a Job>);

impl Drop for CancelOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(job) = self.0 {
            job.cancel();
        }
    }
}

/// How long slurmctld may fail to answer before the sweep gives up.
const UNREACHABLE_FOR: Duration = Duration::from_secs(600);
/// How long a task that ended may take to show its files (a shared
/// filesystem's attribute cache).
const FILES_GRACE: Duration = Duration::from_secs(15);

impl Array<'_> {
    /// `sbatch --time`: the flag's, else the trial timeout in whole
    /// minutes plus one (start-up, and the kill's grace).
    pub fn time_limit(&self) -> String {
        if let Some(t) = &self.options.time {
            return t.clone();
        }
        let minutes = (self.timeout.as_secs_f64() / 60.0).ceil() as u64 + 1;
        format!(
            "{}-{:02}:{:02}:00",
            minutes / 1440,
            minutes / 60 % 24,
            minutes % 60
        )
    }

    /// The batch script for `indices`, in the directory `dir` (absolute),
    /// running `exe`. Output paths with characters sbatch would misread in
    /// a `#SBATCH` line are passed on its command line instead.
    pub fn script(&self, dir: &Path, exe: &Path, indices: &[usize]) -> String {
        let list: Vec<String> = indices.iter().map(|i| i.to_string()).collect();
        let mut s = String::from("#!/bin/bash\n");
        s.push_str(&format!(
            "# memfit sweep's trials for {} (written at each submission).\n\
             # Array task i runs grid point i, described by spec-i.json: its JSON\n\
             # result goes to out-i.json, its stderr to err-i.txt, and its exit\n\
             # code, start and end (Unix seconds) to status-i.txt.\n",
            dir.parent().unwrap_or(dir).display()
        ));
        let mut opt = |o: String| s.push_str(&format!("#SBATCH {o}\n"));
        opt("--job-name=memfit-sweep".into());
        opt(format!("--array={}", list.join(",")));
        opt("--nodes=1".into());
        opt("--ntasks=1".into());
        opt(format!("--cpus-per-task={}", self.threads));
        opt(format!("--time={}", self.time_limit()));
        if let Some(p) = &self.options.partition {
            opt(format!("--partition={p}"));
        }
        if self.gpu {
            opt("--gpus=1".into());
        }
        if plain(dir) {
            opt(format!("--output={}/out-%a.json", dir.display()));
            opt(format!("--error={}/err-%a.txt", dir.display()));
        }
        if !self.options.extra.is_empty() {
            s.push_str(&format!(
                "# submitted with: sbatch {}\n",
                self.options.extra.join(" ")
            ));
        }
        let exe = quote(&exe.to_string_lossy());
        let secs = format!("{:.3}", self.timeout.as_secs_f64());
        s.push_str(&format!(
            "dir={dir}\n\
             i=\"${{SLURM_ARRAY_TASK_ID:?submit this script with sbatch --array}}\"\n\
             start=\"$(date +%s.%N)\"\n\
             if ! spec=\"$(cat \"$dir/spec-$i.json\")\"; then\n    \
                 rc=2\n\
             elif command -v timeout >/dev/null 2>&1; then\n    \
                 timeout --kill-after=10 {secs}s {exe} trial --spec \"$spec\"\n    \
                 rc=$?\n\
             else\n    \
                 {exe} trial --spec \"$spec\"\n    \
                 rc=$?\n\
             fi\n\
             echo \"$rc $start $(date +%s.%N)\" >\"$dir/status-$i.txt\"\n\
             exit \"$rc\"\n",
            dir = quote(&dir.to_string_lossy()),
        ));
        s
    }

    /// Submits `tasks` as one array and follows it until every task has
    /// ended (each handed to `on_end` as it does) or `stop` is set (the job
    /// is cancelled; what ended before stays handed over).
    pub(super) fn run(
        &self,
        tasks: &[Task],
        stop: &AtomicBool,
        say: &dyn Fn(String),
        on_end: &mut dyn FnMut(Finished) -> Result<()>,
    ) -> Result<()> {
        let (dir, script, indices) = self.stage(tasks)?;
        let job = self.submit(&dir, &script, &indices)?;
        let mut guard = CancelOnDrop(Some(&job));
        append_line(
            &dir.join(JOBS),
            &serde_json::to_string(&job).expect("job serialises"),
        )?;
        say(format!(
            "submitted Slurm job {} ({} trial{}: array {}; {})",
            job.job,
            indices.len(),
            if indices.len() == 1 { "" } else { "s" },
            if indices.len() > 12 {
                format!("{}..{}", indices[0], indices.last().expect("not empty"))
            } else {
                indices
                    .iter()
                    .map(|i| i.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            },
            script.display()
        ));
        // An error leaves the guard to cancel the job.
        self.follow(&job, &dir, &indices, stop, say, on_end)?;
        guard.0 = None;
        Ok(())
    }

    /// Writes each task's spec and the array's script into OUT/slurm:
    /// that directory (absolute), the script, and the tasks' indices.
    fn stage(&self, tasks: &[Task]) -> Result<(PathBuf, PathBuf, Vec<usize>)> {
        let dir = std::path::absolute(self.out.join("slurm")).map_err(|source| Error::Write {
            path: self.out.join("slurm"),
            source,
        })?;
        std::fs::create_dir_all(&dir).map_err(|source| Error::Write {
            path: dir.clone(),
            source,
        })?;
        let exe = std::env::current_exe().map_err(|e| {
            Error::Unavailable(format!(
                "cannot find the memfit executable for the trials: {e}"
            ))
        })?;
        for t in tasks {
            // No file of an earlier run of this trial may pass for this one's.
            for name in ["out", "err", "status"] {
                let _ = std::fs::remove_file(dir.join(file(name, t.index)));
            }
            let json = serde_json::to_string(&t.spec).expect("spec serialises");
            super::driver::write_atomic(&dir.join(file("spec", t.index)), json.as_bytes())?;
        }
        let indices: Vec<usize> = tasks.iter().map(|t| t.index).collect();
        let script = dir.join("trials.sbatch");
        super::driver::write_atomic(&script, self.script(&dir, &exe, &indices).as_bytes())?;
        Ok((dir, script, indices))
    }

    /// Submits the script as a job array of `indices`.
    fn submit(&self, dir: &Path, script: &Path, indices: &[usize]) -> Result<Job> {
        let mut sbatch = Command::new("sbatch");
        sbatch.arg("--parsable");
        if !plain(dir) {
            let pattern = dir.to_string_lossy().replace('%', "%%");
            sbatch.arg(format!("--output={pattern}/out-%a.json"));
            sbatch.arg(format!("--error={pattern}/err-%a.txt"));
        }
        let out = sbatch
            .args(&self.options.extra)
            .arg(script)
            .output()
            .map_err(|e| Error::Unavailable(format!("cannot run sbatch: {e}")))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        match Job::parse(&stdout, indices.to_vec()) {
            Some(job) if out.status.success() => Ok(job),
            _ => Err(Error::Unavailable(format!(
                "sbatch refused the trials' job array ({}): {}{}",
                script.display(),
                String::from_utf8_lossy(&out.stderr).trim(),
                stdout.trim()
            ))),
        }
    }

    /// Polls the job until every task has ended, handing each to `on_end`
    /// as it does, or `stop` is set (the job is cancelled then).
    fn follow(
        &self,
        job: &Job,
        dir: &Path,
        indices: &[usize],
        stop: &AtomicBool,
        say: &dyn Fn(String),
        on_end: &mut dyn FnMut(Finished) -> Result<()>,
    ) -> Result<()> {
        let mut pending: BTreeSet<usize> = indices.iter().copied().collect();
        let mut ended_at: HashMap<usize, Instant> = HashMap::new();
        let mut unreachable_since: Option<Instant> = None;
        let mut wait = Duration::from_millis(200);
        while !pending.is_empty() {
            let until = Instant::now() + wait;
            while Instant::now() < until && !stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let stopping = stop.load(Ordering::SeqCst);
            let states = match query(job) {
                Ok(states) => {
                    unreachable_since = None;
                    states
                }
                Err(_) if stopping => None,
                Err(why) => {
                    let since = *unreachable_since.get_or_insert_with(Instant::now);
                    if since.elapsed() > UNREACHABLE_FOR {
                        return Err(Error::Unavailable(format!(
                            "lost track of Slurm job {} (cancelled): {why}",
                            job.job
                        )));
                    }
                    wait = (wait * 2).min(Duration::from_secs(10));
                    continue;
                }
            };
            let mut progressed = false;
            for index in pending.clone() {
                // Forgotten by slurmctld and absent from accounting: what
                // its files say.
                let st = match &states {
                    Some(states) => match states.get(&index) {
                        Some(st) if st.is_final() => st.clone(),
                        _ => continue,
                    },
                    None if stopping => continue,
                    None => TaskState::unknown(),
                };
                let first = *ended_at.entry(index).or_insert_with(Instant::now);
                let files = TaskFiles::read(dir, index);
                if !files.complete(&st) && first.elapsed() < FILES_GRACE && !stopping {
                    continue;
                }
                let (ended, note) = classify(&st, &files, &self.time_limit());
                let elapsed_s = files
                    .status
                    .and_then(|s| s.elapsed_s)
                    .or(st.run_s)
                    .unwrap_or(0.0);
                pending.remove(&index);
                progressed = true;
                on_end(Finished {
                    index,
                    ended,
                    elapsed_s,
                    note,
                })?;
            }
            if stopping {
                // What ended before Ctrl-C is kept; the rest is not a result.
                if !pending.is_empty() {
                    job.cancel();
                    say(format!("cancelled Slurm job {}", job.job));
                }
                return Ok(());
            }
            wait = match progressed {
                true => Duration::from_millis(200),
                false => (wait * 3 / 2).min(Duration::from_secs(5)),
            };
        }
        Ok(())
    }
}

/// `out-7.json` and its siblings.
fn file(kind: &str, index: usize) -> String {
    match kind {
        "out" | "spec" => format!("{kind}-{index}.json"),
        _ => format!("{kind}-{index}.txt"),
    }
}

/// A path sbatch reads whole in a `#SBATCH` line, and `%` would not expand.
fn plain(p: &Path) -> bool {
    p.to_string_lossy()
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"/._-+,=@:".contains(&b))
}

/// `s` quoted for bash.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn append_line(path: &Path, line: &str) -> Result<()> {
    use std::io::Write;
    let io = |source| Error::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io)?;
    f.write_all(format!("{line}\n").as_bytes()).map_err(io)?;
    f.sync_data().map_err(io)
}

/// One array task as Slurm reports it.
#[derive(Clone, Debug, PartialEq)]
struct TaskState {
    /// `COMPLETED`, `FAILED`, `TIMEOUT`, ... (`sacct`'s `CANCELLED by 0`
    /// cut to its first word); `UNKNOWN` when Slurm no longer knows it.
    state: String,
    /// `ExitCode=CODE:SIGNAL` of the batch script.
    exit: Option<(i32, i32)>,
    run_s: Option<f64>,
}

impl TaskState {
    fn unknown() -> Self {
        TaskState {
            state: "UNKNOWN".into(),
            exit: None,
            run_s: None,
        }
    }

    /// Whether the task is over (and not about to be requeued).
    fn is_final(&self) -> bool {
        !matches!(
            self.state.as_str(),
            "PENDING"
                | "RUNNING"
                | "CONFIGURING"
                | "COMPLETING"
                | "SUSPENDED"
                | "REQUEUED"
                | "REQUEUE_FED"
                | "REQUEUE_HOLD"
                | "RESIZING"
                | "RESV_DEL_HOLD"
                | "REVOKED"
                | "SIGNALING"
                | "SPECIAL_EXIT"
                | "STAGE_OUT"
                | "STOPPED"
        )
    }
}

/// Every started task of the array: from `scontrol show job` while
/// slurmctld holds the job (`MinJobAge` after it ends), else from `sacct`.
/// `Ok(None)`: neither knows the job any more. `Err`: no answer this time.
fn query(job: &Job) -> std::result::Result<Option<BTreeMap<usize, TaskState>>, String> {
    let out = job
        .command("scontrol")
        .args(["show", "job", "-o", &job.job])
        .output()
        .map_err(|e| format!("cannot run scontrol: {e}"))?;
    let err = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        return Ok(Some(parse_scontrol(&String::from_utf8_lossy(&out.stdout))));
    }
    if !err.contains("Invalid job id") {
        return Err(format!("scontrol show job {}: {}", job.job, err.trim()));
    }
    let acct = job
        .command("sacct")
        .args(["-n", "-P", "-X", "-j", &job.job])
        .args(["-o", "JobID,State,ExitCode,ElapsedRaw"])
        .output();
    match acct {
        Ok(o) if o.status.success() => {
            let states = parse_sacct(&String::from_utf8_lossy(&o.stdout));
            Ok((!states.is_empty()).then_some(states))
        }
        _ => Ok(None),
    }
}

/// `scontrol show job -o`: one line per record; a started array task has
/// its own (`ArrayTaskId=3`), pending ones share one (`ArrayTaskId=4-6`).
fn parse_scontrol(text: &str) -> BTreeMap<usize, TaskState> {
    let mut states = BTreeMap::new();
    for line in text.lines() {
        let mut fields: HashMap<&str, &str> = HashMap::new();
        for token in line.split_whitespace() {
            if let Some((k, v)) = token.split_once('=') {
                fields.entry(k).or_insert(v);
            }
        }
        let Some(index) = fields.get("ArrayTaskId").and_then(|t| t.parse().ok()) else {
            continue;
        };
        let Some(state) = fields.get("JobState") else {
            continue;
        };
        states.insert(
            index,
            TaskState {
                state: state.to_string(),
                exit: fields.get("ExitCode").and_then(|e| exit_code(e)),
                run_s: fields.get("RunTime").and_then(|t| duration_s(t)),
            },
        );
    }
    states
}

/// `sacct -n -P -X -o JobID,State,ExitCode,ElapsedRaw`: `12_3|COMPLETED|0:0|5`.
fn parse_sacct(text: &str) -> BTreeMap<usize, TaskState> {
    let mut states = BTreeMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split('|').collect();
        let [id, state, exit, elapsed, ..] = f[..] else {
            continue;
        };
        let Some(index) = id.split_once('_').and_then(|(_, t)| t.parse().ok()) else {
            continue;
        };
        states.insert(
            index,
            TaskState {
                state: state.split_whitespace().next().unwrap_or("").to_string(),
                exit: exit_code(exit),
                run_s: elapsed.parse().ok(),
            },
        );
    }
    states
}

/// `CODE:SIGNAL`.
fn exit_code(s: &str) -> Option<(i32, i32)> {
    let (c, sig) = s.split_once(':')?;
    Some((c.parse().ok()?, sig.parse().ok()?))
}

/// Slurm's `[DAYS-]HOURS:MINUTES:SECONDS` (or `MINUTES:SECONDS`).
fn duration_s(s: &str) -> Option<f64> {
    let (days, clock) = match s.split_once('-') {
        Some((d, c)) => (d.parse::<f64>().ok()?, c),
        None => (0.0, s),
    };
    let mut secs = 0.0;
    for part in clock.split(':') {
        secs = secs * 60.0 + part.parse::<f64>().ok()?;
    }
    Some(days * 86_400.0 + secs)
}

/// What the wrapper wrote when the trial returned.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Status {
    rc: i32,
    elapsed_s: Option<f64>,
}

/// A task's files in `OUT/slurm/`.
#[derive(Debug, Default)]
struct TaskFiles {
    out: Option<Box<TrialOutput>>,
    err: String,
    status: Option<Status>,
}

impl TaskFiles {
    fn read(dir: &Path, index: usize) -> TaskFiles {
        let text = |kind| std::fs::read_to_string(dir.join(file(kind, index))).unwrap_or_default();
        let out = text("out")
            .lines()
            .rev()
            .find(|l| l.trim_start().starts_with('{'))
            .and_then(|l| serde_json::from_str::<TrialOutput>(l).ok())
            .map(Box::new);
        // Live-memory samples (only a TUI asks for them) are not stderr.
        let err = text("err")
            .lines()
            .filter(|l| !l.starts_with(SAMPLE_PREFIX))
            .map(|l| format!("{l}\n"))
            .collect();
        TaskFiles {
            out,
            err,
            status: parse_status(&text("status")),
        }
    }

    /// Whether the files a task that ended this way leaves are all there.
    fn complete(&self, st: &TaskState) -> bool {
        if !matches!(st.state.as_str(), "COMPLETED" | "FAILED") {
            return true;
        }
        match self.status {
            None => false,
            Some(s) => self.out.is_some() || !matches!(s.rc, 0 | 3),
        }
    }
}

/// `RC START END`.
fn parse_status(text: &str) -> Option<Status> {
    let mut f = text.split_whitespace();
    let rc = f.next()?.parse().ok()?;
    let start: Option<f64> = f.next().and_then(|s| s.parse().ok());
    let end: Option<f64> = f.next().and_then(|s| s.parse().ok());
    Some(Status {
        rc,
        elapsed_s: start.zip(end).map(|(a, b)| (b - a).max(0.0)),
    })
}

/// The exit code `timeout` returns when it killed the trial.
const TIMED_OUT: i32 = 124;

/// How a task ended, as a local child's end would be read, and the note
/// for what only Slurm can do to a task. `limit` is the job's `--time`.
fn classify(st: &TaskState, files: &TaskFiles, limit: &str) -> (Ended, Option<String>) {
    let err = files.err.clone();
    let signal = |default: i32| {
        st.exit
            .map(|(_, s)| s)
            .filter(|&s| s > 0)
            .unwrap_or(default)
    };
    match st.state.as_str() {
        "TIMEOUT" => (
            Ended::TimedOut { err },
            Some(format!(
                "killed by Slurm at the job's time limit (sbatch --time={limit})"
            )),
        ),
        "OUT_OF_MEMORY" => (
            Ended::Signalled { signal: 9, err },
            Some(
                "killed by Slurm for going over the job's host memory (OUT_OF_MEMORY); ask for more with --slurm-extra=--mem=SIZE"
                    .into(),
            ),
        ),
        "CANCELLED" => (
            Ended::Signalled {
                signal: signal(15),
                err,
            },
            Some("cancelled outside this sweep (scancel, or an administrator)".into()),
        ),
        "COMPLETED" | "FAILED" => {
            let (rc, sig) = match (files.status, st.exit) {
                (Some(s), _) => (s.rc, 0),
                (None, Some(e)) => e,
                (None, None) => (-1, 0),
            };
            if sig > 0 {
                return (Ended::Signalled { signal: sig, err }, None);
            }
            match rc {
                TIMED_OUT => (Ended::TimedOut { err }, None),
                // What bash reports for a child killed by a signal.
                129..=192 => (
                    Ended::Signalled {
                        signal: rc - 128,
                        err,
                    },
                    None,
                ),
                126 | 127 => (
                    Ended::Exited {
                        nvml_peak: None,
                        code: Some(rc),
                        out: None,
                        err,
                    },
                    Some("the compute node could not run memfit: the sweep's binary and --out must be on a filesystem the nodes share".into()),
                ),
                rc => (
                    Ended::Exited {
                        nvml_peak: None,
                        code: (rc >= 0).then_some(rc),
                        out: files.out.clone(),
                        err,
                    },
                    None,
                ),
            }
        }
        other => match files.status {
            // Slurm forgot the task, but it returned: its own exit code.
            Some(s) if other == "UNKNOWN" => classify(
                &TaskState {
                    state: "COMPLETED".into(),
                    exit: Some((s.rc, 0)),
                    run_s: None,
                },
                files,
                limit,
            ),
            _ => (
                Ended::Exited {
                    nvml_peak: None,
                    code: None,
                    out: None,
                    err,
                },
                Some(match other {
                    "UNKNOWN" => "Slurm no longer knows this task (it left slurmctld's memory, and there is no accounting database) and it left no exit status".to_string(),
                    other => format!("Slurm ended the task: {other}"),
                }),
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ended(e: &Ended) -> String {
        match e {
            Ended::Exited { code, out, .. } => format!("exited {code:?} out={}", out.is_some()),
            Ended::Signalled { signal, .. } => format!("signal {signal}"),
            Ended::TimedOut { .. } => "timeout".into(),
        }
    }

    fn st(state: &str, exit: Option<(i32, i32)>) -> TaskState {
        TaskState {
            state: state.into(),
            exit,
            run_s: None,
        }
    }

    fn status(rc: i32) -> TaskFiles {
        TaskFiles {
            status: Some(Status {
                rc,
                elapsed_s: Some(1.0),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn slurm_states_map_onto_a_local_childs_ends() {
        let cases: [(TaskState, TaskFiles, &str, bool); 9] = [
            (
                st("COMPLETED", Some((0, 0))),
                status(0),
                "exited Some(0) out=false",
                false,
            ),
            (
                st("FAILED", Some((3, 0))),
                status(3),
                "exited Some(3) out=false",
                false,
            ),
            (st("FAILED", Some((134, 0))), status(134), "signal 6", false),
            (st("FAILED", Some((124, 0))), status(124), "timeout", false),
            (
                st("FAILED", Some((0, 9))),
                TaskFiles::default(),
                "signal 9",
                false,
            ),
            (
                st("TIMEOUT", Some((0, 15))),
                TaskFiles::default(),
                "timeout",
                true,
            ),
            (
                st("OUT_OF_MEMORY", Some((0, 125))),
                TaskFiles::default(),
                "signal 9",
                true,
            ),
            (
                st("NODE_FAIL", None),
                TaskFiles::default(),
                "exited None out=false",
                true,
            ),
            (
                TaskState::unknown(),
                status(0),
                "exited Some(0) out=false",
                false,
            ),
        ];
        for (s, f, want, noted) in cases {
            let (e, note) = classify(&s, &f, "0-00:06:00");
            assert_eq!(ended(&e), want, "{s:?}");
            assert_eq!(note.is_some(), noted, "{s:?}: {note:?}");
        }
    }

    #[test]
    fn scontrol_and_sacct_lines_are_read() {
        let text = "JobId=5 ArrayJobId=4 ArrayTaskId=2 JobName=memfit-sweep JobState=FAILED Reason=NonZeroExitCode ExitCode=3:0 RunTime=00:01:02\n\
                    JobId=4 ArrayJobId=4 ArrayTaskId=3-5 JobState=PENDING ExitCode=0:0 RunTime=00:00:00\n";
        let s = parse_scontrol(text);
        assert_eq!(s.len(), 1);
        assert_eq!(s[&2].state, "FAILED");
        assert_eq!(s[&2].exit, Some((3, 0)));
        assert_eq!(s[&2].run_s, Some(62.0));
        let s = parse_sacct("12_3|CANCELLED by 0|0:15|7\n12_[4-6]|PENDING|0:0|0\n");
        assert_eq!(s.len(), 1);
        assert_eq!(s[&3].state, "CANCELLED");
        assert_eq!(s[&3].exit, Some((0, 15)));
        assert_eq!(duration_s("1-00:00:01"), Some(86_401.0));
        assert_eq!(
            Job::parse("77;gpu\n", vec![1]).map(|j| (j.job, j.cluster)),
            Some(("77".into(), Some("gpu".into())))
        );
        assert!(Job::parse("sbatch: error", vec![]).is_none());
    }

    #[test]
    fn flag_values_are_checked() {
        for ok in [
            "30",
            "5:00",
            "1:00:00",
            "2-0",
            "2-12:30",
            "1-00:00:00",
            "UNLIMITED",
        ] {
            assert!(time_limit(ok).is_ok(), "{ok}");
        }
        for bad in ["", "1h", "1:2:3:4", "-5", "a-1", "1-", "5 "] {
            assert!(time_limit(bad).is_err(), "{bad}");
        }
        assert!(extra_arg("--mem=8G").is_ok());
        assert!(extra_arg("-A").is_ok());
        for bad in [
            "--array=1-3",
            "-a1",
            "--output=x",
            "-e",
            "mem=8G",
            "--wrap=x",
        ] {
            assert!(extra_arg(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_script_runs_each_task_s_spec_under_the_trial_timeout() {
        let opts = SlurmOptions {
            partition: Some("debug".into()),
            time: None,
            extra: vec!["--mem=1G".into()],
        };
        let a = Array {
            options: &opts,
            out: Path::new("/s/out"),
            threads: 3,
            gpu: false,
            timeout: Duration::from_secs(300),
        };
        assert_eq!(a.time_limit(), "0-00:06:00");
        let s = a.script(Path::new("/s/out/slurm"), Path::new("/bin/memfit"), &[0, 4]);
        for want in [
            "#SBATCH --array=0,4\n",
            "#SBATCH --cpus-per-task=3\n",
            "#SBATCH --partition=debug\n",
            "#SBATCH --time=0-00:06:00\n",
            "#SBATCH --output=/s/out/slurm/out-%a.json\n",
            "timeout --kill-after=10 300.000s '/bin/memfit' trial --spec \"$spec\"",
            "# submitted with: sbatch --mem=1G",
        ] {
            assert!(s.contains(want), "{want:?} missing from:\n{s}");
        }
        let spaced = a.script(Path::new("/s/my out/slurm"), Path::new("/bin/memfit"), &[1]);
        assert!(!spaced.contains("--output"), "{spaced}");
        assert!(spaced.contains("dir='/s/my out/slurm'"), "{spaced}");
        assert_eq!(quote("it's"), r"'it'\''s'");
    }
}
