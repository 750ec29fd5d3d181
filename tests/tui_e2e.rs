//! `memfit tui` end to end: the real binary in a tmux pane runs a tiny sweep,
//! shows the recommendation, answers keys, quits cleanly and leaves the
//! terminal restored and the journal written.
//!
//! Needs tmux. `.ci/run` installs it and sets MEMFIT_REQUIRE_TMUX=1, which
//! turns a missing tmux into a failure; elsewhere the test says it skipped.

use std::process::Command;
use std::time::{Duration, Instant};

/// What tmux prints; the non-breaking spaces that keep a figure and its
/// unit together on screen read as spaces.
fn tmux(args: &[&str]) -> String {
    let out = Command::new("tmux").args(args).output().expect("tmux runs");
    String::from_utf8_lossy(&out.stdout).replace('\u{a0}', " ")
}

fn wait_for(session: &str, what: &[&str], secs: u64) -> String {
    let start = Instant::now();
    loop {
        let pane = tmux(&["capture-pane", "-p", "-t", session]);
        if what.iter().all(|w| pane.contains(w)) {
            return pane;
        }
        assert!(
            start.elapsed() < Duration::from_secs(secs),
            "waited {secs} s for {what:?}; the pane shows:\n{pane}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn tui_runs_a_sweep_in_tmux_and_quits_cleanly() {
    if Command::new("tmux").arg("-V").output().is_err() {
        assert!(
            std::env::var_os("MEMFIT_REQUIRE_TMUX").is_none(),
            "tmux is required (MEMFIT_REQUIRE_TMUX is set) but not installed"
        );
        eprintln!("SKIPPED: tmux is not installed (`apt-get install -y tmux`; .ci/run does)");
        return;
    }
    let session = format!("memfit-e2e-{}", std::process::id());
    let out = std::env::temp_dir().join(format!("memfit-tui-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let recipe = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/sweep/one-group.yaml"
    );
    let cmd = format!(
        "{} tui {recipe} --out {} --steps 2 --threads 1; echo MEMFIT-EXIT $?; sleep 120",
        env!("CARGO_BIN_EXE_memfit"),
        out.display()
    );
    tmux(&["kill-session", "-t", &session]);
    let started = Command::new("tmux")
        .args([
            "new-session",
            "-d",
            "-s",
            &session,
            "-x",
            "120",
            "-y",
            "40",
            &cmd,
        ])
        .status()
        .unwrap();
    assert!(started.success());
    let result = std::panic::catch_unwind(|| {
        // The sweep finishes and the recommendation shows.
        let pane = wait_for(&session, &["finished", "recommendation", "★ #"], 180);
        // The header leads with where trials ran; the GPU is the target.
        let first = pane.lines().next().unwrap_or_default();
        assert!(first.starts_with("run on cpu:limit=8"), "{pane}");
        assert!(first.contains("emulated capacity"), "{pane}");
        assert!(first.contains("target NVIDIA T4"), "{pane}");
        assert!(pane.contains("fit"), "{pane}");
        assert!(pane.contains("MiB"), "{pane}");
        // Elapsed stops with the sweep.
        let elapsed = |pane: &str| {
            pane.lines()
                .find_map(|l| l.split("elapsed ").nth(1))
                .and_then(|r| r.split_whitespace().next())
                .map(str::to_string)
        };
        let at_end = elapsed(&pane);
        assert!(at_end.is_some(), "{pane}");
        std::thread::sleep(Duration::from_millis(2100));
        let pane = tmux(&["capture-pane", "-p", "-t", &session]);
        assert_eq!(elapsed(&pane), at_end, "{pane}");
        // At 80x24 everything still fits, the recommendation included.
        tmux(&["resize-window", "-t", &session, "-x", "80", "-y", "24"]);
        let pane = wait_for(&session, &["(emulated)", "┌recommendation"], 10);
        assert!(pane.contains("│★ #"), "{pane}");
        assert!(pane.lines().any(|l| l.starts_with("? help")), "{pane}");
        tmux(&["resize-window", "-t", &session, "-x", "120", "-y", "40"]);
        assert_eq!(
            tmux(&["display", "-p", "-t", &session, "#{alternate_on}"]).trim(),
            "1"
        );
        // Help, then back; detail, then back.
        tmux(&["send-keys", "-t", &session, "?"]);
        wait_for(&session, &["help"], 10);
        tmux(&["send-keys", "-t", &session, "Escape"]);
        tmux(&["send-keys", "-t", &session, "Enter"]);
        wait_for(&session, &["detail"], 10);
        tmux(&["send-keys", "-t", &session, "Escape"]);
        std::thread::sleep(Duration::from_millis(300));
        tmux(&["send-keys", "-t", &session, "q"]);
        let pane = wait_for(&session, &["MEMFIT-EXIT 0"], 30);
        // The terminal is back: primary screen, and our last words on it.
        assert_eq!(
            tmux(&["display", "-p", "-t", &session, "#{alternate_on}"]).trim(),
            "0"
        );
        assert!(pane.contains("journal and exports in"), "{pane}");
    });
    tmux(&["kill-session", "-t", &session]);
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
    let journal = std::fs::read_to_string(out.join("trials.jsonl")).unwrap();
    assert!(journal.lines().count() >= 2, "{journal}");
    assert!(out.join("report.json").is_file());
}

/// `memfit tui | cat` drew escape codes into the pipe. Without a terminal
/// it says so in one line, points at `memfit sweep`, writes nothing to
/// stdout and exits 2, creating nothing.
#[test]
fn tui_without_a_terminal_refuses_in_one_line() {
    let out = std::env::temp_dir().join(format!("memfit-tui-notty-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let run = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(["tui", "--out"])
        .arg(&out)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(run.stdout.is_empty(), "{:?}", run.stdout);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("needs a terminal") && stderr.contains("memfit sweep RECIPE"),
        "{stderr}"
    );
    assert!(
        !stderr.contains('\x1b') && !stderr.contains("panicked"),
        "{stderr}"
    );
    assert!(!out.exists(), "nothing created");
}
