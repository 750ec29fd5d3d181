//! `memfit sweep` end to end: trials in child processes, the bisection against
//! an exhaustive sweep, crashes and kills, resume, and the report files.

use crate::common::memfit;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use memfit::report::sweep::{Outcome, SweepReport};

fn recipe() -> &'static str {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/sweep/one-group.yaml"
    )
}

fn out_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("memfit-sweep-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Sweeps time their trials: one at a time, so that they do not measure each other.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn sweep(out: &Path, extra: &[&str]) -> (Output, SweepReport) {
    let mut args = vec![
        "sweep",
        recipe(),
        "--out",
        out.to_str().unwrap(),
        "--threads",
        "1",
    ];
    // Paired re-timing has its own tests; elsewhere it would only add
    // minutes of child processes to what a test checks.
    if !extra.contains(&"--paired-rounds") {
        args.extend(["--paired-rounds", "0"]);
    }
    args.extend(extra);
    let o = memfit(&args);
    let text = std::fs::read_to_string(out.join("report.json"))
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stderr)));
    (o, serde_json::from_str(&text).unwrap())
}

fn ids_in_journal(out: &Path) -> Vec<String> {
    std::fs::read_to_string(out.join("trials.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect()
}

#[test]
fn bisection_recommends_what_the_exhaustive_sweep_does() {
    let _one = serial();
    let smart_dir = out_dir("smart");
    let (o, smart) = sweep(&smart_dir, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let full_dir = out_dir("full");
    let (o, full) = sweep(&full_dir, &["--exhaustive"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    let count = |r: &SweepReport, o: Outcome| r.trials.iter().filter(|t| t.outcome == o).count();
    eprintln!(
        "smart: {} trials of {} (fits {}, skipped-oom {}); exhaustive: {} trials (fits {}, oom {})",
        smart.trials_run,
        smart.grid_size,
        smart.trials.iter().filter(|t| t.fits).count(),
        count(&smart, Outcome::SkippedPredictedOom),
        full.trials_run,
        full.trials.iter().filter(|t| t.fits).count(),
        count(&full, Outcome::Oom)
    );
    assert_eq!(full.trials_run, 20);
    assert_eq!(count(&full, Outcome::Oom), 12);
    assert_eq!(full.trials.iter().filter(|t| t.fits).count(), 8);
    // Every fitting point runs (for its speed), none of the predicted OOMs.
    assert_eq!(smart.trials_run, 8);
    assert_eq!(smart.trials.iter().filter(|t| t.fits).count(), 8);
    assert_eq!(count(&smart, Outcome::SkippedPredictedOom), 12);
    // meta == cpu: every measured peak is the prediction, to the byte.
    for t in full.trials.iter().filter(|t| t.outcome == Outcome::Ran) {
        assert_eq!(t.memory_error_pct, Some(0.0), "{}", t.id);
        let m = t.measured.as_ref().unwrap();
        assert!(
            m.rss_peak_bytes.unwrap() > m.peak_bytes.total,
            "RSS includes the tracked bytes"
        );
    }
    // Memory is deterministic: both sweeps classify every point they ran alike.
    for t in smart.trials.iter().filter(|t| t.measured.is_some()) {
        let f = full.trials.iter().find(|f| f.id == t.id).unwrap();
        assert_eq!(
            (t.fits, t.measured.as_ref().unwrap().peak_bytes),
            (f.fits, f.measured.as_ref().unwrap().peak_bytes),
            "{}",
            t.id
        );
    }
    // Speed is measured, so two sweeps can rank near-equal points apart by
    // timing noise. Given the same measurements (the exhaustive journal,
    // resumed), the bisecting sweep never drops a point that could be the
    // cheapest: its contenders are re-timed afresh, so it names the
    // exhaustive sweep's pick, or each names the other's in its tie.
    let pick = |r: &SweepReport| {
        r.trials[r.recommendation.as_ref().unwrap().trial]
            .id
            .clone()
    };
    let tied = |r: &SweepReport| -> Vec<String> {
        let rec = r.recommendation.as_ref().unwrap();
        rec.tied.iter().map(|&i| r.trials[i].id.clone()).collect()
    };
    let agree = |a: &SweepReport, b: &SweepReport| {
        pick(a) == pick(b) || (tied(a).contains(&pick(b)) && tied(b).contains(&pick(a)))
    };
    // Every cpu sweep says how it ranked: paired when two trials or more
    // came near the cheapest, else on the one trial's measurement.
    for r in [&smart, &full] {
        let rk = r.recommendation.as_ref().unwrap().ranking.as_ref().unwrap();
        assert!(rk.method == "paired" || rk.note.is_some(), "{rk:?}");
    }
    let replay_dir = out_dir("replay");
    std::fs::create_dir_all(&replay_dir).unwrap();
    // The journal with its identity: a journal alone is refused.
    for f in ["trials.jsonl", "sweep.json"] {
        std::fs::copy(full_dir.join(f), replay_dir.join(f)).unwrap();
    }
    let (o, replay) = sweep(&replay_dir, &["--resume"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        agree(&replay, &full),
        "replay {} (tied {:?}) against exhaustive {} (tied {:?})",
        pick(&replay),
        tied(&replay),
        pick(&full),
        tied(&full)
    );
    assert_eq!(
        replay.trials_run, full.trials_run,
        "every measured trial is kept"
    );
    eprintln!("recommended by both: {}", pick(&full));

    // The report files: JSON, Markdown, self-contained HTML with its charts, plots, exports.
    let html = std::fs::read_to_string(smart_dir.join("report.html")).unwrap();
    assert!(html.starts_with("<!DOCTYPE html>"));
    assert_eq!(html.matches("<svg").count(), 3, "three inline charts");
    // One inline script (the trial table's sort), nothing loaded from elsewhere.
    assert_eq!(html.matches("<script").count(), 1);
    assert!(!html.contains("<script src"));
    for png in [
        "memory_vs_micro_batch.png",
        "throughput_vs_memory.png",
        "recommendation_breakdown.png",
    ] {
        let bytes = std::fs::read(smart_dir.join(png)).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{png}");
        let (w, h) = (
            u32::from_be_bytes(bytes[16..20].try_into().unwrap()),
            u32::from_be_bytes(bytes[20..24].try_into().unwrap()),
        );
        assert!(w >= 640 && h >= 400, "{png}: {w}x{h}");
        assert!(
            (5_000..5_000_000).contains(&bytes.len()),
            "{png}: {} bytes",
            bytes.len()
        );
    }
    for f in [
        "report.md",
        "ds_config.json",
        "training_args.py",
        "recommended.yaml",
    ] {
        assert!(smart_dir.join(f).is_file(), "{f}");
    }
    // The pinned recipe plans, with one point: the recommendation.
    let o = memfit(&[
        "plan",
        smart_dir.join("recommended.yaml").to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // memfit check: the two sweeps agree on every tracked peak they share.
    let o = memfit(&[
        "check",
        smart_dir.to_str().unwrap(),
        "--baseline",
        full_dir.to_str().unwrap(),
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}

#[test]
fn crashes_kills_and_timeouts_are_recorded_and_the_sweep_goes_on() {
    let _one = serial();
    for (fault, want_signal, outcome) in [
        ("0:abort", 6, Outcome::Crash),
        ("0:sigkill", 9, Outcome::Crash),
        ("0:hang", 9, Outcome::Timeout),
    ] {
        let dir = out_dir(&fault.replace(':', "-"));
        let (o, r) = sweep(&dir, &["--test-fault", fault, "--trial-timeout", "3"]);
        assert!(
            o.status.success(),
            "{fault}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let failed: Vec<_> = r.trials.iter().filter(|t| t.outcome == outcome).collect();
        assert_eq!(failed.len(), 1, "{fault}");
        let exit = failed[0].exit.as_ref().unwrap();
        assert_eq!(exit.signal, Some(want_signal), "{fault}: {exit:?}");
        // The first trial (micro-batch 8) failed; bisection below it still
        // finds fitting micro-batches and recommends one.
        assert!(r.recommendation.is_some(), "{fault}");
        assert!(r.trials.iter().any(|t| t.fits));
    }
}

#[test]
fn resume_finishes_a_killed_sweep_without_rerunning_trials() {
    let _one = serial();
    let dir = out_dir("resume");
    std::fs::create_dir_all(&dir).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args([
            "sweep",
            recipe(),
            "--out",
            dir.to_str().unwrap(),
            "--exhaustive",
            "--threads",
            "1",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Kill it (SIGKILL: no chance to clean up) once two trials are journaled.
    let journal = dir.join("trials.jsonl");
    let start = std::time::Instant::now();
    loop {
        let n = std::fs::read_to_string(&journal).map_or(0, |s| s.lines().count());
        if n >= 2 || start.elapsed().as_secs() > 60 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let before = ids_in_journal(&dir);
    assert!((2..20).contains(&before.len()), "{before:?}");

    // Without --resume the journal is protected.
    let o = memfit(&[
        "sweep",
        recipe(),
        "--out",
        dir.to_str().unwrap(),
        "--exhaustive",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--resume"));

    let (o, r) = sweep(&dir, &["--exhaustive", "--resume"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let after = ids_in_journal(&dir);
    assert_eq!(&after[..before.len()], &before[..], "finished trials kept");
    let mut unique = after.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), after.len(), "no trial ran twice: {after:?}");
    assert_eq!(after.len(), 20);
    assert_eq!(r.trials_run, 20);
}

#[test]
fn a_partial_journal_line_is_cut_and_another_sweeps_journal_is_refused() {
    let _one = serial();
    let dir = out_dir("partial");
    let (o, _) = sweep(&dir, &[]);
    assert!(o.status.success());
    // Chop the last record in half, as a kill mid-write would.
    let journal = dir.join("trials.jsonl");
    let text = std::fs::read_to_string(&journal).unwrap();
    let keep = text.trim_end().rfind('\n').unwrap() + 1;
    let half = keep + (text.len() - keep) / 2;
    std::fs::write(&journal, &text[..half]).unwrap();
    for _ in 0..2 {
        let (o, r) = sweep(&dir, &["--resume"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(r.trials_run, 8);
    }
    let ids = ids_in_journal(&dir);
    let mut unique = ids.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), ids.len(), "{ids:?}");
    assert_eq!(ids.len(), 8);

    // Another capacity is another sweep: its trials are not reused.
    let o = memfit(&[
        "sweep",
        recipe(),
        "--out",
        dir.to_str().unwrap(),
        "--resume",
        "--device",
        "cpu:limit=64MiB",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("another sweep"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A sweep on meta: every trial runs, each in its own process, in moments.
fn meta_sweep(out: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "sweep",
        recipe(),
        "--out",
        out.to_str().unwrap(),
        "--device",
        "meta",
    ];
    args.extend(extra);
    memfit(&args)
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_second_sweep_into_a_locked_directory_exits_2_naming_the_holder() {
    // Two sweeps into one --out both ran, and each ran every trial.
    let _one = serial();
    let dir = out_dir("locked");
    std::fs::create_dir_all(&dir).unwrap();
    let (lock, note) = memfit::sweep::driver::OutLock::take(&dir, "memfit sweep").unwrap();
    assert_eq!(note, None);
    let o = meta_sweep(&dir, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", err(&o));
    let want = format!(
        "is in use by memfit sweep pid {} started ",
        std::process::id()
    );
    assert!(err(&o).contains(&want), "{}", err(&o));
    assert!(err(&o).contains("--out"), "{}", err(&o));
    assert!(!dir.join("trials.jsonl").exists(), "it ran nothing");
    drop(lock);
    assert!(!dir.join(".memfit.lock").exists(), "released on drop");
    let o = meta_sweep(&dir, &[]);
    assert!(o.status.success(), "{}", err(&o));
    assert!(!dir.join(".memfit.lock").exists(), "released when done");
}

#[test]
fn a_stale_lock_from_a_dead_process_is_taken_over_with_a_note() {
    let _one = serial();
    let dir = out_dir("stale-lock");
    std::fs::create_dir_all(&dir).unwrap();
    let mut gone = Command::new("true").spawn().unwrap();
    let pid = gone.id();
    gone.wait().unwrap();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    std::fs::write(
        dir.join(".memfit.lock"),
        format!(
            r#"{{"command":"memfit sweep","pid":{pid},"host":"{}","started_unix_s":1700000000}}"#,
            host.trim()
        ),
    )
    .unwrap();
    let o = meta_sweep(&dir, &[]);
    assert!(o.status.success(), "{}", err(&o));
    assert!(
        err(&o).contains(&format!("left by memfit sweep pid {pid} started 2023-11-14 22:13:20 UTC, which is no longer running; taking it over")),
        "{}",
        err(&o)
    );
    assert!(!dir.join(".memfit.lock").exists());
}

/// Issue 26: a lock naming another host was taken over unchecked, so on a
/// shared filesystem a live sweep on another node would be trampled. Now
/// its lease (the file's mtime, renewed every 60 s) must be 300 s old, or
/// the user must say --break-lock.
#[test]
fn a_lock_held_from_another_host_is_refused_until_its_lease_lapses() {
    let _one = serial();
    let dir = out_dir("foreign-lock");
    let lock = dir.join(".memfit.lock");
    let plant = |age_s: u64| {
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            &lock,
            r#"{"command":"memfit sweep","pid":4242,"host":"node-17","started_unix_s":1700000000}"#,
        )
        .unwrap();
        let f = std::fs::File::options().write(true).open(&lock).unwrap();
        let when = std::time::SystemTime::now() - std::time::Duration::from_secs(age_s);
        f.set_modified(when).unwrap();
    };
    plant(5);
    let o = meta_sweep(&dir, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", err(&o));
    let e = err(&o);
    assert!(
        e.contains("memfit sweep pid 4242 on host node-17")
            && e.contains("renewed 5 s ago")
            && e.contains("--break-lock"),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(!dir.join("trials.jsonl").exists(), "it ran nothing");
    assert!(lock.exists(), "the other host's lock is left alone");

    let o = meta_sweep(&dir, &["--break-lock"]);
    assert!(o.status.success(), "{}", err(&o));
    assert!(
        err(&o).contains("--break-lock says it is gone"),
        "{}",
        err(&o)
    );

    let _ = std::fs::remove_dir_all(&dir);
    plant(400);
    let o = meta_sweep(&dir, &[]);
    assert!(o.status.success(), "{}", err(&o));
    assert!(
        err(&o).contains("last renewed its lease 40")
            && err(&o).contains("s ago (it lapses after 300 s); taking it over"),
        "{}",
        err(&o)
    );
    assert!(!lock.exists(), "released when done");
}

/// Issue 26: a full disk left a torn line at the end of trials.jsonl
/// (resume dropped it, but the file stayed corrupt until then), and
/// nothing said which trial was lost.
#[test]
fn a_full_disk_leaves_no_torn_journal_line_and_names_the_lost_trial() {
    let _one = serial();
    let dir = out_dir("full-disk");
    // The shell's file-size limit stands in for a full disk: a write that
    // crosses 5 x 512 B is cut short, then fails (EFBIG), as one that
    // reaches a disk's end does (ENOSPC). The first record (about 2 KiB)
    // fits; the second is cut. SIGXFSZ is ignored so the write fails
    // instead of killing the sweep.
    let o = Command::new("sh")
        .arg("-c")
        .arg(r#"trap '' XFSZ; ulimit -f 5; exec "$0" "$@""#)
        .arg(env!("CARGO_BIN_EXE_memfit"))
        .args([
            "sweep",
            recipe(),
            "--out",
            dir.to_str().unwrap(),
            "--device",
            "meta",
        ])
        .output()
        .unwrap();
    let e = err(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains("could not be journaled") && e.contains("cut back to its last whole record"),
        "{e}"
    );
    let text = std::fs::read_to_string(dir.join("trials.jsonl")).unwrap();
    assert!(text.ends_with('\n'), "torn: {text}");
    let journaled = ids_in_journal(&dir);
    assert_eq!(journaled.len(), 1, "{journaled:?}");
    let lost = e.split('`').nth(1).expect("the lost trial's id, quoted");
    assert!(!journaled.iter().any(|id| id == lost), "{lost}");
    // With room again, --resume runs the lost trial.
    let o = meta_sweep(&dir, &["--resume"]);
    assert!(o.status.success(), "{}", err(&o));
    assert!(ids_in_journal(&dir).iter().any(|id| id == lost));
}

#[test]
fn ctrl_c_releases_the_lock() {
    let _one = serial();
    let dir = out_dir("ctrl-c");
    let mut child = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(["sweep", recipe(), "--out", dir.to_str().unwrap()])
        .args([
            "--device",
            "meta",
            "--test-fault",
            "0:hang",
            "--trial-timeout",
            "60",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let lock = dir.join(".memfit.lock");
    let start = std::time::Instant::now();
    while !lock.exists() && start.elapsed().as_secs() < 30 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(lock.exists());
    // Past the set-up: the Ctrl-C handler is in place, the hung trial runs.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let sent = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "interrupted");
    assert!(!lock.exists(), "released on Ctrl-C");
}

/// Starts a meta sweep of `recipe()` into `dir` whose trial run number
/// `hang` hangs, its output discarded.
fn hanging_sweep(dir: &Path, hang: usize, extra: &[&str]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(["sweep", recipe(), "--out", dir.to_str().unwrap()])
        .args(["--device", "meta", "--trial-timeout", "60", "--test-fault"])
        .arg(format!("{hang}:hang"))
        .args(extra)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

/// The pids whose parent is `pid` (from /proc), and live: not zombies.
fn children_of(pid: u32) -> Vec<u32> {
    let mut kids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: the comm may hold spaces and parentheses.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let mut f = rest.split(' ');
        let (state, ppid) = (f.next().unwrap(), f.next().unwrap());
        if ppid == pid.to_string() && state != "Z" {
            kids.push(p);
        }
    }
    kids
}

/// Whether `pid` runs (a zombie waiting for a reaper does not).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| !s[s.rfind(')').unwrap() + 2..].starts_with('Z'))
}

/// Polls `f` every 20 ms for up to `secs` seconds.
fn wait_for<T>(secs: u64, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let start = std::time::Instant::now();
    loop {
        if let Some(t) = f() {
            return Some(t);
        }
        if start.elapsed().as_secs() >= secs {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Issue 26: Ctrl-C in the middle of a round (here the exhaustive sweep's
/// first group, one round of five trials) dropped the trials the round had
/// finished from report.json, though trials.jsonl held them.
#[test]
fn an_interrupted_report_holds_every_journaled_trial() {
    let _one = serial();
    let dir = out_dir("interrupted-round");
    let mut child = hanging_sweep(&dir, 2, &["--exhaustive"]);
    let pid = child.id();
    // Two trials journaled, the third (hung) running.
    wait_for(30, || {
        let n = std::fs::read_to_string(dir.join("trials.jsonl")).map_or(0, |s| s.lines().count());
        (n == 2 && !children_of(pid).is_empty()).then_some(())
    })
    .expect("two trials journaled and the third running");
    let sent = Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    assert_eq!(child.wait().unwrap().code(), Some(130));
    let journaled = ids_in_journal(&dir);
    assert_eq!(journaled.len(), 2, "{journaled:?}");
    let r: SweepReport =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    assert!(r.interrupted);
    let reported: Vec<&str> = r.trials.iter().map(|t| t.id.as_str()).collect();
    for id in &journaled {
        assert!(reported.contains(&id.as_str()), "{id} not in {reported:?}");
    }
}

/// Issue 26: kill -9, SIGTERM or SIGHUP of the sweep left its `memfit
/// trial` running, reparented to init. SIGTERM and SIGHUP now stop the
/// sweep as Ctrl-C does (reports written, exit 128 + the signal), and a
/// sweep killed outright takes its trial along (PR_SET_PDEATHSIG).
#[test]
fn no_trial_outlives_its_sweep() {
    let _one = serial();
    for (sig, code) in [("TERM", Some(143)), ("HUP", Some(129)), ("KILL", None)] {
        let dir = out_dir(&format!("signal-{sig}"));
        let mut child = hanging_sweep(&dir, 0, &[]);
        let pid = child.id();
        let trial = wait_for(30, || children_of(pid).first().copied())
            .unwrap_or_else(|| panic!("SIG{sig}: no trial process started"));
        // Past the set-up: the handlers are in place before the first trial.
        let sent = Command::new("kill")
            .args([&format!("-{sig}"), &pid.to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        let status = child.wait().unwrap();
        assert_eq!(status.code(), code, "SIG{sig}: {status:?}");
        assert!(
            wait_for(10, || (!alive(trial)).then_some(())).is_some(),
            "SIG{sig}: trial {trial} outlived its sweep"
        );
        assert!(children_of(pid).is_empty(), "SIG{sig}");
        if code.is_some() {
            let r: SweepReport =
                serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap())
                    .unwrap();
            assert!(r.interrupted, "SIG{sig}");
            assert!(
                !dir.join(".memfit.lock").exists(),
                "SIG{sig}: lock released"
            );
        }
    }
}

/// Issue 26: `recommended.yaml` named a model read from a file by its
/// profile name (`model: small-gpt2`, or `model: config` for a config.json),
/// so it could not be swept again.
#[test]
fn recommended_yaml_names_the_model_file_it_was_swept_with() {
    let _one = serial();
    let root = out_dir("model-file");
    let recipes = root.join("recipes");
    std::fs::create_dir_all(recipes.join("models")).unwrap();
    let tiny = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/profiles/models/gpt2-tiny.yaml"
    );
    let profile = std::fs::read_to_string(tiny)
        .unwrap()
        .replace("name: gpt2-tiny", "name: small-gpt2");
    std::fs::write(recipes.join("models/small.yaml"), profile).unwrap();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf/gpt2.json");
    std::fs::copy(config, recipes.join("config.json")).unwrap();
    for (model, want) in [
        ("models/small.yaml", "model: ../recipes/models/small.yaml\n"),
        ("config.json", "model: ../recipes/config.json\n"),
    ] {
        let recipe = recipes.join("r.yaml");
        std::fs::write(
            &recipe,
            format!(
                "model: {model}\nhardware: t4\ndevice: meta\nseq_len: 64\nglobal_batch: 4\n\
                 grid:\n  micro_batch: [1, 2]\n  precision: [bf16]\n"
            ),
        )
        .unwrap();
        let out = root.join("out");
        let _ = std::fs::remove_dir_all(&out);
        let o = memfit(&[
            "sweep",
            recipe.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--paired-rounds",
            "0",
        ]);
        assert!(o.status.success(), "{model}: {}", err(&o));
        let pinned = std::fs::read_to_string(out.join("recommended.yaml")).unwrap();
        assert!(pinned.contains(want), "{model}: {pinned}");
        // Swept again, from another directory: it finds the same file.
        let again = root.join("again");
        let _ = std::fs::remove_dir_all(&again);
        let o = Command::new(env!("CARGO_BIN_EXE_memfit"))
            .args(["sweep", "out/recommended.yaml", "--out", "again"])
            .current_dir(&root)
            .output()
            .unwrap();
        assert!(o.status.success(), "{model}: {}", err(&o));
    }
}

#[test]
fn resume_without_sweep_json_does_not_adopt_the_journal() {
    // It adopted whatever trials.jsonl was there, another sweep's included.
    let _one = serial();
    let dir = out_dir("no-identity");
    let o = meta_sweep(&dir, &[]);
    assert!(o.status.success(), "{}", err(&o));
    std::fs::remove_file(dir.join("sweep.json")).unwrap();
    let journal = std::fs::read_to_string(dir.join("trials.jsonl")).unwrap();
    let o = meta_sweep(&dir, &["--resume"]);
    assert_eq!(o.status.code(), Some(2), "{}", err(&o));
    for want in ["--resume: ", "sweep.json", "is missing", "another --out"] {
        assert!(err(&o).contains(want), "{want}: {}", err(&o));
    }
    assert_eq!(
        std::fs::read_to_string(dir.join("trials.jsonl")).unwrap(),
        journal
    );
}

#[test]
fn threads_0_and_other_bad_trial_flags_stop_the_sweep_before_any_trial() {
    // --threads 0 was accepted, and every trial then crashed into the journal.
    let _one = serial();
    let dir = out_dir("bad-flags");
    for (flags, named) in [
        (&["--threads", "0"][..], "--threads"),
        (&["--threads", "100000"], "--threads"),
        (&["--trial-timeout", "0"], "--trial-timeout"),
        // Turned into a Duration, this panicked.
        (&["--trial-timeout", "inf"], "--trial-timeout"),
        (&["--trial-timeout", "nan"], "--trial-timeout"),
        (&["--steps", "0"], "--steps"),
        (&["--max-steps", "18446744073709551615"], "--max-steps"),
    ] {
        let o = meta_sweep(&dir, flags);
        assert_eq!(o.status.code(), Some(2), "{flags:?}: {}", err(&o));
        assert!(err(&o).contains(named), "{flags:?}: {}", err(&o));
        assert!(!dir.join("trials.jsonl").exists(), "{flags:?}");
    }
    // The TUI takes the same flags and checks them the same way, before it
    // takes the terminal.
    for (flags, named) in [
        (&["--threads", "0"][..], "--threads"),
        (&["--trial-timeout", "inf"], "--trial-timeout"),
        (&["--sample-ms", "0"], "--sample-ms"),
    ] {
        let mut args = vec!["tui", recipe(), "--out", dir.to_str().unwrap()];
        args.extend(flags);
        let o = memfit(&args);
        assert_eq!(o.status.code(), Some(2), "{flags:?}: {}", err(&o));
        assert!(err(&o).contains(named), "{flags:?}: {}", err(&o));
    }
}

#[test]
fn duplicate_grid_values_give_one_trial_each() {
    // `micro_batch: [2, 2, 4]` gave two trials with one id.
    let _one = serial();
    let dir = out_dir("duplicates");
    let o = memfit(&[
        "sweep",
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/sweep/duplicate-values.yaml"
        ),
        "--out",
        dir.to_str().unwrap(),
        "--exhaustive",
        "--paired-rounds",
        "0",
    ]);
    assert!(o.status.success(), "{}", err(&o));
    for want in [
        "duplicate-values.yaml:8:17: `grid.micro_batch` lists 2 more than once; each point is planned once",
        "duplicate-values.yaml:9:15: `grid.precision` lists bf16 more than once",
    ] {
        assert!(err(&o).contains(want), "{want}: {}", err(&o));
    }
    let report: SweepReport =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    let ids: Vec<&str> = report.trials.iter().map(|t| t.id.as_str()).collect();
    assert_eq!(report.grid_size, 4, "{ids:?}");
    let mut unique = ids.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), ids.len(), "{ids:?}");
    // In the recipe's order, first occurrences kept.
    let firsts: Vec<_> = report
        .trials
        .iter()
        .map(|t| (t.point.micro_batch, memfit::plan::name(t.point.precision)))
        .collect();
    assert_eq!(
        firsts,
        [(2, "bf16"), (4, "bf16"), (2, "fp32"), (4, "fp32")].map(|(m, p)| (m, p.to_string()))
    );
    assert_eq!(ids_in_journal(&dir).len(), 4);
}

#[test]
fn reports_are_replaced_whole_never_written_in_place() {
    // report.json was truncated and rewritten in place: a reader (or a kill)
    // mid-write saw half a report. A hard link to the old report shows the
    // difference: a rename leaves it as it was, an in-place write changes it.
    let _one = serial();
    let dir = out_dir("atomic");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["report.json", "report.md", "report.html"] {
        std::fs::write(dir.join(f), "old").unwrap();
        std::fs::hard_link(dir.join(f), dir.join(format!("{f}.old"))).unwrap();
    }
    let o = meta_sweep(&dir, &[]);
    assert!(o.status.success(), "{}", err(&o));
    for f in ["report.json", "report.md", "report.html"] {
        assert_eq!(
            std::fs::read_to_string(dir.join(format!("{f}.old"))).unwrap(),
            "old",
            "{f}"
        );
        assert_ne!(std::fs::read_to_string(dir.join(f)).unwrap(), "old", "{f}");
    }
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp") || n == ".memfit.lock")
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// Two configurations near in speed (fp32 at micro-batch 2 and 4, both
/// fitting a 24 MiB device): both are contenders for every sweep of them.
fn near_pair(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let recipe = dir.join("near-pair.yaml");
    std::fs::write(
        &recipe,
        "model: gpt2-tiny\nhardware: t4\ndevice: cpu:limit=24MiB\nseq_len: 128\nglobal_batch: 32\n\
         grid:\n  micro_batch: [2, 4]\n  precision: [fp32]\n  checkpointing: [none]\n  attention: [eager]\n  optimizer: [adamw]\n",
    )
    .unwrap();
    recipe
}

#[test]
fn contenders_are_re_timed_interleaved_and_ranked_on_paired_ratios() {
    let _one = serial();
    let dir = out_dir("paired");
    let recipe = near_pair(&dir.join("recipe"));
    let out = dir.join("out");
    let o = memfit(&[
        "sweep",
        recipe.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--threads",
        "1",
        "--paired-rounds",
        "3",
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", err(&o));
    let r: SweepReport = serde_json::from_slice(&o.stdout).unwrap();
    let rec = r.recommendation.as_ref().unwrap();
    let rk = rec.ranking.as_ref().unwrap();
    assert_eq!(rk.method, "paired", "{rk:?}");
    assert_eq!(rk.contenders.len(), 2, "{rk:?}");
    // 3 rounds, and 3 more per re-timing of an interval wider than ±10%.
    assert!([3, 6, 9].contains(&rk.rounds), "{rk:?}");
    assert_eq!(rk.rounds, 3 * (rk.retries + 1));
    assert_eq!(rk.paired.len(), 2, "{rk:?}");
    assert_eq!(rk.paired[0].cost_ratio, 1.0);
    assert!(rk.paired[1].cost_ratio >= 1.0, "{rk:?}");
    for p in &rk.paired {
        assert_eq!(p.bouts + p.failed_bouts, rk.rounds);
        assert!(p.tokens_per_s > 0.0);
    }
    assert!(rk.noisy == (rk.widest_half_interval > rk.noise_bound));
    assert!(rk.tie_within >= 0.05 && rk.tie_within >= 2.0 * rk.widest_half_interval - 1e-12);
    assert!(
        rec.reasons
            .iter()
            .any(|s| s.contains("timed again, interleaved")),
        "{:?}",
        rec.reasons
    );
    // The pick is the paired fastest or timing cannot tell it from it.
    let p = rk.paired.iter().find(|p| p.trial == rec.trial).unwrap();
    assert!(p.cost_ratio_ci[0] <= 1.0, "{rk:?}");
    // Each report says how it ranked.
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("Ranked on paired re-timing"), "{md}");
    assert!(md.contains("| cost vs fastest |"), "{md}");
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("<table class=\"paired\">"));
    assert_eq!(rk.noisy, html.contains("Too noisy to separate."));
    // The table too, and the JSON round-trips the new fields.
    let table = memfit::sweep::markdown::table(&r);
    assert!(
        table.contains("paired re-timing (cost over the fastest's"),
        "{table}"
    );
    let again: SweepReport =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(
        again.recommendation.unwrap().ranking.unwrap().rounds,
        rk.rounds
    );

    // --paired-rounds 0: each trial's own measurement, and the report says so.
    let out0 = dir.join("out0");
    let o = memfit(&[
        "sweep",
        recipe.to_str().unwrap(),
        "--out",
        out0.to_str().unwrap(),
        "--threads",
        "1",
        "--paired-rounds",
        "0",
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", err(&o));
    let r: SweepReport = serde_json::from_slice(&o.stdout).unwrap();
    let rk = r.recommendation.unwrap().ranking.unwrap();
    assert_eq!((rk.method.as_str(), rk.rounds), ("single", 0));
    assert!(rk.note.unwrap().contains("--paired-rounds 0"));
    let o = memfit(&["sweep", recipe.to_str().unwrap(), "--paired-rounds", "1001"]);
    assert_eq!(o.status.code(), Some(2), "{}", err(&o));
    assert!(err(&o).contains("--paired-rounds"), "{}", err(&o));
}

#[test]
fn a_piped_sweep_prints_a_line_per_trial_as_it_finishes() {
    use std::io::BufRead;
    let _one = serial();
    let dir = out_dir("lines");
    // Table: the lines go to stdout, ahead of the table, as trials finish.
    let mut child = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args([
            "sweep",
            recipe(),
            "--out",
            dir.to_str().unwrap(),
            "--threads",
            "1",
            "--paired-rounds",
            "0",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    stdout.read_line(&mut first).unwrap();
    // The first trial's line came while the sweep was still running.
    assert!(
        !dir.join("report.json").exists(),
        "a line only after the sweep: {first}"
    );
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    assert!(child.wait().unwrap().success());
    let report: SweepReport =
        serde_json::from_str(&std::fs::read_to_string(dir.join("report.json")).unwrap()).unwrap();
    let text = first.clone() + &rest;
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with('[')).collect();
    assert_eq!(lines.len(), report.trials_run, "{text}");
    // `[3/20] mb8 x1 none fp32 adamw ckpt:none eager accum 4: fit, peak 6.36 MiB, 45,000 tok/s`
    let first = lines[0];
    assert!(
        first.starts_with('[') && first.contains("/20] mb"),
        "{first}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains(": fit, peak ") && l.ends_with(" tok/s")),
        "{text}"
    );
    assert!(
        text.find(lines[lines.len() - 1]) < text.find("recommended:"),
        "{text}"
    );

    // JSON: stdout is the report alone, the lines go to stderr.
    let dir = out_dir("lines-json");
    let o = memfit(&[
        "sweep",
        recipe(),
        "--out",
        dir.to_str().unwrap(),
        "--threads",
        "1",
        "--paired-rounds",
        "0",
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "{}", err(&o));
    let r: SweepReport = serde_json::from_slice(&o.stdout).unwrap();
    let lines = err(&o).lines().filter(|l| l.starts_with('[')).count();
    assert_eq!(lines, r.trials_run, "{}", err(&o));
}

#[test]
fn a_meta_sweep_says_its_throughput_is_predicted_not_measured() {
    let dir = out_dir("meta-label");
    let o = meta_sweep(&dir, &["--format", "json"]);
    assert!(o.status.success(), "{}", err(&o));
    let r: SweepReport = serde_json::from_slice(&o.stdout).unwrap();
    let rec = r.recommendation.unwrap();
    let reasons = rec.reasons.join("\n");
    assert!(reasons.contains("tokens/s predicted"), "{reasons}");
    // It said "(95% interval 1751486-1751486, median of 0 timed steps)".
    assert!(!reasons.contains("95% interval"), "{reasons}");
    assert!(!reasons.contains("timed steps"), "{reasons}");
    assert_eq!(rec.ranking.unwrap().method, "predicted");
}

/// `tp_comm_overlap` and `overlap_param_gather` are a GPU plan's pricing:
/// a sweep whose trials compute would run the same trial twice, so it is
/// refused before any runs, naming the recipe and the key, with a way out.
#[test]
fn a_computing_sweep_refuses_megatrons_overlaps() {
    let dir = out_dir("tpov");
    std::fs::create_dir_all(&dir).unwrap();
    for (key, grid) in [
        (
            "tp_comm_overlap",
            "  sharding: [none]\n  gpus: [2]\n  tensor_parallel: [2]\n  sequence_parallel: [true]\n  tp_comm_overlap: [false, true]\n",
        ),
        (
            "overlap_param_gather",
            "  sharding: [zero1]\n  gpus: [2]\n  overlap_param_gather: [false, true]\n",
        ),
    ] {
        let recipe = dir.join(format!("{key}.yaml"));
        std::fs::write(
            &recipe,
            format!("model: llama-tiny\nhardware: h100-sxm-80gb\nseq_len: 32\nglobal_batch: 4\ngrid:\n  micro_batch: [2]\n  precision: [fp32]\n{grid}"),
        )
        .unwrap();
        let out = dir.join(format!("out-{key}"));
        let o = memfit(&[
            "sweep",
            recipe.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        let e = err(&o);
        assert_eq!(o.status.code(), Some(2), "{e}");
        assert!(
            e.contains(&format!("{key}.yaml"))
                && e.contains(&format!("`{key}` is priced, not run")),
            "{e}"
        );
        assert!(e.contains("--device meta"), "{e}");
        assert!(!out.join("trials.jsonl").exists());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
