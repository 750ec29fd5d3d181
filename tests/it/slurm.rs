//! `memfit sweep --executor slurm` against a real Slurm cluster: the trials
//! of a four-point sweep as job arrays, their journal against a local
//! sweep's, a crashing array task, `--resume` resubmitting only what is
//! missing, and the refusals that need no cluster.
//!
//! Needs a Slurm cluster whose nodes see this machine's /tmp (a single-node
//! one: `scripts/slurm-up.sh` starts it from Debian's slurmctld, slurmd and
//! munge). `.ci/run` starts one and sets MEMFIT_REQUIRE_SLURM=1, which turns
//! a missing cluster into a failure; elsewhere these tests run when `sinfo`
//! shows a usable node, and say they skipped otherwise.

use crate::common::{memfit, refused, scratch};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use memfit::report::sweep::{Outcome, SweepReport};
use serde_json::Value;

/// Four trials (micro-batch 1 and 2, with and without checkpointing), each
/// a couple of steps of gpt2-tiny on cpu, all fitting.
const RECIPE: &str = "\
model: gpt2-tiny
hardware: t4
device: cpu:limit=64MiB
seq_len: 32
global_batch: 4
grid:
  micro_batch: [1, 2]
  precision: [fp32]
  checkpointing: [none, full]
  attention: [eager]
  optimizer: [adamw]
";

/// Whether a cluster is there to submit to; with MEMFIT_REQUIRE_SLURM=1 a
/// missing one fails the test (with why) instead of skipping it.
fn cluster() -> bool {
    let why = match Command::new("sinfo").args(["-h", "-o", "%t"]).output() {
        Err(e) => format!("sinfo does not run ({e})"),
        Ok(o) if !o.status.success() => {
            format!("sinfo fails: {}", String::from_utf8_lossy(&o.stderr).trim())
        }
        Ok(o) => {
            let states = String::from_utf8_lossy(&o.stdout).to_string();
            let usable = states.split_whitespace().any(|s| {
                ["idle", "mix", "alloc", "comp"].contains(&s.trim_end_matches(['*', '~', '#']))
            });
            if usable {
                return true;
            }
            format!("no node is up (sinfo: {})", states.trim())
        }
    };
    let required = std::env::var("MEMFIT_REQUIRE_SLURM").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "MEMFIT_REQUIRE_SLURM=1 but there is no Slurm cluster to submit to: {why}; start one with scripts/slurm-up.sh (as root, after apt-get install slurmctld slurmd slurm-client munge)"
    );
    eprintln!("SKIPPED: no Slurm cluster: {why} (scripts/slurm-up.sh starts one; .ci/run does)");
    false
}

/// Runs memfit, killed if it takes longer than `secs` (a cluster that
/// stops scheduling must fail the test, not hang it).
fn memfit_within(args: &[String], secs: u64) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("memfit runs");
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > Duration::from_secs(secs) {
            // SIGINT: the sweep cancels its job before it exits.
            let _ = Command::new("kill")
                .args(["-INT", &child.id().to_string()])
                .status();
            std::thread::sleep(Duration::from_secs(3));
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "memfit {args:?} still running after {secs} s\nstderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("output")
}

fn sweep(dir: &Path, extra: &[&str]) -> (Output, SweepReport) {
    let recipe = dir.join("recipe.yaml");
    std::fs::write(&recipe, RECIPE).unwrap();
    let out = dir.join("out");
    let mut args: Vec<String> = [
        "sweep",
        recipe.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--exhaustive",
        "--threads",
        "1",
        "--steps",
        "1",
        "--max-steps",
        "2",
    ]
    .map(String::from)
    .to_vec();
    args.extend(extra.iter().map(|s| s.to_string()));
    let o = memfit_within(&args, 300);
    let text = std::fs::read_to_string(out.join("report.json")).unwrap_or_else(|e| {
        panic!(
            "{args:?}: no report ({e}); stderr: {}",
            String::from_utf8_lossy(&o.stderr)
        )
    });
    (o, serde_json::from_str(&text).unwrap())
}

/// The journal's records by trial id, and its lines in order.
fn journal(dir: &Path) -> (BTreeMap<String, Value>, Vec<String>) {
    let lines: Vec<String> = std::fs::read_to_string(dir.join("out/trials.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(String::from)
        .collect();
    let by_id = lines
        .iter()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (v["id"].as_str().unwrap().to_string(), v)
        })
        .collect();
    (by_id, lines)
}

/// The job arrays the sweeps in `dir` submitted, as OUT/slurm/jobs.jsonl lists them.
fn jobs(dir: &Path) -> Vec<Value> {
    std::fs::read_to_string(dir.join("out/slurm/jobs.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_slurm_sweep_measures_what_a_local_one_does_and_resume_resubmits_only_the_missing_trial() {
    if !cluster() {
        return;
    }
    let local = scratch("slurm-vs-local");
    let slurm = scratch("slurm-sweep");
    let (lo, lr) = sweep(&local, &[]);
    assert!(lo.status.success(), "local: {}", stderr(&lo));
    let (so, sr) = sweep(&slurm, &["--executor", "slurm"]);
    assert!(so.status.success(), "slurm: {}", stderr(&so));
    assert_eq!(lr.trials_run, 4);
    assert_eq!(sr.trials_run, 4);

    // The same trials, and the same tracked peaks: they are deterministic.
    let (local_j, _) = journal(&local);
    let (slurm_j, lines) = journal(&slurm);
    assert_eq!(
        local_j.keys().collect::<Vec<_>>(),
        slurm_j.keys().collect::<Vec<_>>()
    );
    for (id, l) in &local_j {
        let s = &slurm_j[id];
        assert_eq!(s["outcome"], "ran", "{id}: {s}");
        assert_eq!(
            l["measured"]["peak_bytes"], s["measured"]["peak_bytes"],
            "{id}"
        );
        assert_eq!(
            l["measured"]["peak_split"], s["measured"]["peak_split"],
            "{id}"
        );
    }
    // One array of four tasks, from the batch script the sweep left.
    let submitted = jobs(&slurm);
    assert_eq!(submitted.len(), 1, "{submitted:?}");
    assert_eq!(submitted[0]["tasks"], serde_json::json!([0, 1, 2, 3]));
    let script = std::fs::read_to_string(slurm.join("out/slurm/trials.sbatch")).unwrap();
    assert!(script.contains("#SBATCH --array=0,1,2,3\n"), "{script}");
    assert!(script.contains("#SBATCH --cpus-per-task=1\n"), "{script}");
    assert!(
        stderr(&so).contains(&format!(
            "submitted Slurm job {}",
            submitted[0]["job"].as_str().unwrap()
        )),
        "{}",
        stderr(&so)
    );

    // Lose one journal line: --resume submits exactly that trial.
    let dropped: Value = serde_json::from_str(&lines[1]).unwrap();
    let kept: Vec<&String> = lines
        .iter()
        .enumerate()
        .filter(|(n, _)| *n != 1)
        .map(|(_, l)| l)
        .collect();
    let text: String = kept.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(slurm.join("out/trials.jsonl"), text).unwrap();
    let (ro, rr) = sweep(&slurm, &["--executor", "slurm", "--resume"]);
    assert!(ro.status.success(), "resume: {}", stderr(&ro));
    let submitted = jobs(&slurm);
    assert_eq!(submitted.len(), 2, "{submitted:?}");
    let index = rr
        .trials
        .iter()
        .position(|t| t.id == dropped["id"].as_str().unwrap())
        .unwrap();
    assert_eq!(submitted[1]["tasks"], serde_json::json!([index]));
    let (after, after_lines) = journal(&slurm);
    assert_eq!(after_lines.len(), 4);
    assert_eq!(
        after.keys().collect::<Vec<_>>(),
        local_j.keys().collect::<Vec<_>>()
    );
    let id = dropped["id"].as_str().unwrap();
    assert_eq!(
        after[id]["measured"]["peak_bytes"],
        local_j[id]["measured"]["peak_bytes"]
    );
    assert_eq!(rr.trials_run, 4);
    let _ = std::fs::remove_dir_all(&local);
    let _ = std::fs::remove_dir_all(&slurm);
}

#[test]
fn a_crashing_array_task_is_recorded_as_a_crash_and_the_others_finish() {
    if !cluster() {
        return;
    }
    let dir = scratch("slurm-crash");
    let (o, r) = sweep(&dir, &["--executor", "slurm", "--test-fault", "1:abort"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let crashed: Vec<_> = r
        .trials
        .iter()
        .filter(|t| t.outcome == Outcome::Crash)
        .collect();
    assert_eq!(crashed.len(), 1, "{:?}", r.trials);
    let exit = crashed[0].exit.as_ref().unwrap();
    assert_eq!(exit.signal, Some(6), "{exit:?}");
    assert_eq!(
        r.trials
            .iter()
            .filter(|t| t.outcome == Outcome::Ran)
            .count(),
        3
    );
    assert!(r.recommendation.is_some());
    let (j, _) = journal(&dir);
    assert_eq!(j.len(), 4);
    assert_eq!(j[&crashed[0].id]["outcome"], "crash");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_sbatch_on_path_the_sweep_exits_2_naming_executor_before_submitting() {
    let dir = scratch("slurm-no-sbatch");
    let recipe = dir.join("recipe.yaml");
    std::fs::write(&recipe, RECIPE).unwrap();
    let out: PathBuf = dir.join("out");
    let o = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(["sweep", recipe.to_str().unwrap(), "--out"])
        .arg(&out)
        .args(["--executor", "slurm"])
        .env("PATH", dir.join("empty"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("--executor"), "{err}");
    assert!(err.contains("sbatch"), "{err}");
    assert!(!out.exists(), "nothing is written before the check");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn slurm_flags_are_described_and_checked() {
    let help = String::from_utf8_lossy(&memfit(&["sweep", "--help"]).stdout).to_string();
    for flag in [
        "--executor <EXECUTOR>",
        "--slurm-partition <NAME>",
        "--slurm-time <TIME>",
        "--slurm-extra <ARG>",
        "[default: local]",
        "sbatch job array",
    ] {
        assert!(help.contains(flag), "{flag} missing from:\n{help}");
    }
    let dir = scratch("slurm-flags");
    let recipe = dir.join("recipe.yaml");
    std::fs::write(&recipe, RECIPE).unwrap();
    let r = recipe.to_str().unwrap();
    refused(
        &["sweep", r, "--slurm-partition", "gpu"],
        "--slurm-partition: applies to --executor slurm only",
    );
    refused(
        &["sweep", r, "--executor", "slurm", "--slurm-time", "1h"],
        "not a Slurm time limit",
    );
    refused(
        &[
            "sweep",
            r,
            "--executor",
            "slurm",
            "--slurm-extra",
            "--array=1-4",
        ],
        "one per trial",
    );
    let _ = std::fs::remove_dir_all(&dir);
}
