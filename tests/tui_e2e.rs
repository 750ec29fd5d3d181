//! `memfit tui` end to end: the real binary in a tmux pane runs a tiny sweep,
//! shows the recommendation, answers keys, reads whole at 80x24 and at
//! 140x45, quits cleanly and leaves the terminal restored and the journal
//! written; started again on the same journal it asks to resume, in whole
//! sentences. Without a terminal it refuses in one line.
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

fn pane(session: &str) -> String {
    tmux(&["capture-pane", "-p", "-t", session])
}

fn wait_for(session: &str, what: &[&str], secs: u64) -> String {
    let start = Instant::now();
    loop {
        let pane = pane(session);
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

/// What the pane shows once `what` is all there and the screen is still:
/// two captures 200 ms apart the same (a capture taken while the terminal
/// redraws can hold part of a screen).
fn wait_still(session: &str, what: &[&str], secs: u64) -> String {
    let start = Instant::now();
    let mut last = wait_for(session, what, secs);
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = wait_for(session, what, secs);
        if now == last || start.elapsed() >= Duration::from_secs(secs) {
            return now;
        }
        last = now;
    }
}

/// The pane and the rows of panel `title` once the panel is whole and
/// still: a capture taken while the terminal redraws after a resize can
/// hold the title before the border's right corner, or the top rows of a
/// panel whose lower rows are not drawn yet. Whole means both top corners
/// and a bottom-left corner under the top-left one; still means two
/// captures 200 ms apart are the same.
fn settled_panel(session: &str, title: &str, secs: u64) -> (String, Vec<String>) {
    let start = Instant::now();
    let head = format!("┌{title}");
    loop {
        let pane = wait_still(session, &[&head], secs);
        if panel_closed(&pane, &head) || start.elapsed() >= Duration::from_secs(secs) {
            let rows = panel_rows(&pane, title);
            return (pane, rows);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Whether the panel whose top border starts with `head` has its top-right
/// corner and, below its rows, a bottom-left corner.
fn panel_closed(pane: &str, head: &str) -> bool {
    let lines: Vec<Vec<char>> = pane.lines().map(|l| l.chars().collect()).collect();
    let Some((y, x)) = find_head(&lines, head) else {
        return false;
    };
    if !lines[y][x + head.chars().count()..].contains(&'┐') {
        return false;
    }
    let below = lines[y + 1..].iter().find(|l| l.get(x) != Some(&'│'));
    below.is_some_and(|l| l.get(x) == Some(&'└'))
}

fn keys(session: &str, k: &str) {
    tmux(&["send-keys", "-t", session, k]);
    std::thread::sleep(Duration::from_millis(400));
}

/// Words joined by single spaces: text as a reader reads it across
/// wrapped lines.
fn words(rows: &[String]) -> String {
    rows.iter()
        .flat_map(|r| r.split_whitespace())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The inside of the panel whose top border starts with `title`.
fn panel_rows(pane: &str, title: &str) -> Vec<String> {
    let lines: Vec<Vec<char>> = pane.lines().map(|l| l.chars().collect()).collect();
    let (y, x) = find_head(&lines, &format!("┌{title}"))
        .unwrap_or_else(|| panic!("no panel {title:?} in\n{pane}"));
    let right = (x + 1..lines[y].len())
        .find(|&i| lines[y][i] == '┐')
        .expect("a top-right corner");
    lines[y + 1..]
        .iter()
        .take_while(|l| l.get(x) == Some(&'│'))
        .map(|l| l[x + 1..right.min(l.len())].iter().collect())
        .collect()
}

/// The row and column where `head` starts on screen.
fn find_head(lines: &[Vec<char>], head: &str) -> Option<(usize, usize)> {
    let needle: Vec<char> = head.chars().collect();
    lines.iter().enumerate().find_map(|(y, l)| {
        let x = l
            .windows(needle.len())
            .position(|w| w == needle.as_slice())?;
        Some((y, x))
    })
}

/// A full-screen page read to its end: PageDown until the border says
/// "end", each page's rows added once.
fn read_page(session: &str, title: &str) -> (Vec<String>, String) {
    let mut seen: Vec<String> = Vec::new();
    let mut first_border = String::new();
    for _ in 0..40 {
        let p = wait_still(session, &[&format!("┌{title}")], 10);
        let rows = panel_rows(&p, title);
        let border = p
            .lines()
            .find(|l| l.starts_with('└'))
            .unwrap_or_default()
            .to_string();
        if first_border.is_empty() {
            first_border = border.clone();
        }
        // "lines A-B of N": add the rows past what was seen.
        let from = border
            .split("lines ")
            .nth(1)
            .and_then(|r| r.split('-').next())
            .and_then(|a| a.parse::<usize>().ok())
            .unwrap_or(1);
        for (k, r) in rows.into_iter().enumerate() {
            if from + k > seen.len() {
                seen.push(r);
            }
        }
        if !border.contains("↓ more") {
            return (seen, first_border);
        }
        keys(session, "PageDown");
    }
    panic!("{title} never reached its end");
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
    // Twice on the same output: the second start finds the journal.
    let tui = format!(
        "{} tui {recipe} --out {} --steps 2 --threads 1",
        env!("CARGO_BIN_EXE_memfit"),
        out.display()
    );
    let cmd = format!("{tui}; echo MEMFIT-EXIT $?; {tui}; echo MEMFIT-AGAIN $?; sleep 120");
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
        let pane0 = wait_for(&session, &["finished", "recommendation ★ #", "★ #"], 180);
        // The header leads with where trials ran; the GPU is the target.
        let first = pane0.lines().next().unwrap_or_default();
        assert!(first.starts_with("run on cpu:limit=8"), "{pane0}");
        assert!(first.contains("emulated capacity"), "{pane0}");
        assert!(first.contains("target NVIDIA T4"), "{pane0}");
        assert!(pane0.contains("fit"), "{pane0}");
        assert!(pane0.contains("MiB"), "{pane0}");
        // Points the plan predicts over the capacity are skipped, say so,
        // and the counter counts only what ran.
        assert!(pane0.contains("skip: pred OOM"), "{pane0}");
        assert!(pane0.contains(" skipped │"), "{pane0}");
        // Elapsed stops with the sweep.
        let elapsed = |pane: &str| {
            pane.lines()
                .find_map(|l| l.split("elapsed ").nth(1))
                .and_then(|r| r.split_whitespace().next())
                .map(str::to_string)
        };
        let at_end = elapsed(&pane0);
        assert!(at_end.is_some(), "{pane0}");
        std::thread::sleep(Duration::from_millis(2100));
        assert_eq!(elapsed(&pane(&session)), at_end);

        // What the recommendation says, from the report the sweep wrote.
        let report: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("report.json")).expect("report.json"),
        )
        .unwrap();
        let reasons: Vec<String> = report["recommendation"]["reasons"]
            .as_array()
            .expect("reasons")
            .iter()
            .map(|r| r.as_str().unwrap().to_string())
            .collect();
        assert!(reasons.len() >= 3, "{reasons:?}");

        // 140x45: the recommendation panel never ends mid-sentence; what
        // it leaves out, it says `w` shows.
        tmux(&["resize-window", "-t", &session, "-x", "140", "-y", "45"]);
        let (p, rows) = settled_panel(&session, "recommendation ★ #", 10);
        let text = words(&rows);
        let whole = reasons
            .iter()
            .filter(|r| text.contains(&format!("• {r}")))
            .count();
        assert!(whole >= 1, "{text}");
        for r in &reasons {
            let head: String = r.split_whitespace().take(3).collect::<Vec<_>>().join(" ");
            if text.contains(&format!("• {head}")) {
                assert!(
                    text.contains(&format!("• {r}")),
                    "cut: {r}\n{}",
                    rows.join("\n")
                );
            }
        }
        if whole < reasons.len() {
            assert!(text.contains("more: w shows"), "{}", rows.join("\n"));
        }
        // The chart panels follow the selection and say whose they are.
        assert!(p.contains("memory"), "{p}");
        assert!(p.contains("tokens/s per finished trial"), "{p}");

        // 80x24: everything still reads; the footer keeps `? help`.
        tmux(&["resize-window", "-t", &session, "-x", "80", "-y", "24"]);
        wait_for(&session, &["(emulated)"], 10);
        let (p, _) = settled_panel(&session, "recommendation ★ #", 10);
        assert!(p.contains("│★ #"), "{p}");
        assert!(p.contains("w: why"), "{p}");
        let foot = p.lines().last().unwrap_or_default();
        assert!(foot.starts_with("? help q quit"), "{p}");
        // The chart: round ticks, capacity and usable both drawn, the
        // legend under the plot.
        assert!(p.contains("━ cap ─ usable"), "{p}");
        assert!(p.contains("8 MiB┤"), "{p}");
        assert_eq!(
            tmux(&["display", "-p", "-t", &session, "#{alternate_on}"]).trim(),
            "1"
        );
        // `w`: every reason, whole, scrolling to the end.
        keys(&session, "w");
        wait_for(&session, &["┌recommendation ★ #"], 10);
        let (rows, _) = read_page(&session, "recommendation ★ #");
        let text = words(&rows);
        for r in &reasons {
            assert!(
                text.contains(&format!("• {r}")),
                "{r:?} not whole in:\n{text}"
            );
        }
        keys(&session, "Escape");
        // Help: it scrolls, says there is more, and reads whole.
        keys(&session, "?");
        wait_for(&session, &["┌help: memfit tui"], 10);
        let (rows, border) = read_page(&session, "help: memfit tui");
        assert!(
            border.contains("lines 1-19 of") && border.contains("↓ more"),
            "{border}"
        );
        let text = words(&rows);
        for s in [
            "Space pause / resume the sweep (the running trial finishes)",
            "margin = usable - peak, where usable = capacity x (1 - headroom); negative: over; ~ the peak is the predicted one.",
            "skip: pred OOM the plan predicts it does not fit, so the sweep does not run it",
            "Throughput chart: tokens/s of each trial that finished, in the order they finished; ★ the recommended, ◆ the selected.",
        ] {
            assert!(text.contains(s), "{s:?} not whole in:\n{text}");
        }
        keys(&session, "Escape");
        // Detail, then back.
        keys(&session, "Enter");
        wait_for(&session, &["┌detail #"], 10);
        keys(&session, "Escape");
        keys(&session, "q");

        // Again on the same output (the shell starts it at once): the
        // question reads whole at 80x24.
        let p = wait_still(&session, &["Resume?"], 60);
        let at = p.lines().position(|l| l.starts_with("Resume?")).unwrap();
        let question = words(&p.lines().skip(at).map(str::to_string).collect::<Vec<_>>());
        let journal = out.join("trials.jsonl");
        let finished = std::fs::read_to_string(&journal)
            .unwrap()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .count();
        assert!(
            question.starts_with(&format!(
                "Resume? {} holds {finished} finished trials from an earlier run: y resumes them (they are not run again), n moves them aside and starts over, q quits.",
                journal.display()
            )),
            "{p}"
        );
        keys(&session, "q");
        // Both quit cleanly, each with its last words on the primary screen.
        let p = wait_for(&session, &["MEMFIT-EXIT 0", "MEMFIT-AGAIN 0"], 30);
        assert_eq!(p.matches("journal and exports in").count(), 2, "{p}");
        // The terminal is back: the primary screen.
        assert_eq!(
            tmux(&["display", "-p", "-t", &session, "#{alternate_on}"]).trim(),
            "0"
        );
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

/// The grid builder at 80x24 (issue 31): choose a model and a GPU, toggle
/// values down to a two-point grid, check a predicted figure on screen
/// against `memfit plan` of the recipe `w` wrote, measure it with Enter
/// (the sweep view runs it to the end), come back with `b` to the same
/// grid, and quit cleanly.
#[test]
fn the_grid_builder_plans_writes_and_measures_in_tmux() {
    if Command::new("tmux").arg("-V").output().is_err() {
        assert!(
            std::env::var_os("MEMFIT_REQUIRE_TMUX").is_none(),
            "tmux is required (MEMFIT_REQUIRE_TMUX is set) but not installed"
        );
        eprintln!("SKIPPED: tmux is not installed (`apt-get install -y tmux`; .ci/run does)");
        return;
    }
    let session = format!("memfit-e2e-builder-{}", std::process::id());
    let out = std::env::temp_dir().join(format!("memfit-tui-builder-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let cmd = format!(
        "{} tui --new --out {} --steps 2 --threads 1; echo MEMFIT-EXIT $?; sleep 120",
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
            "80",
            "-y",
            "24",
            &cmd,
        ])
        .status()
        .unwrap();
    assert!(started.success());
    let result = std::panic::catch_unwind(|| {
        // It opens on the quickstart's grid, planned.
        let p = wait_for(
            &session,
            &["builder │ gpt2-tiny on NVIDIA T4", "│ 80 points"],
            30,
        );
        assert!(p.contains("micro_batch ○1 ●2 ●4 ●8 ●16 ●32"), "{p}");
        assert!(
            p.lines()
                .last()
                .unwrap_or_default()
                .starts_with("? help q quit"),
            "{p}"
        );
        // The model: the next built-in one.
        keys(&session, "l");
        wait_for(&session, &["builder │ llama-tiny on"], 10);
        // The GPU: from t4, the list wraps to the first profile.
        keys(&session, "j");
        keys(&session, "l");
        wait_for(&session, &["on NVIDIA H100 SXM5 80GB"], 10);
        // micro_batch: 2, 8, 16 and 32 off, 4 stays.
        for k in ["j", "j", "j", "j", "j"] {
            keys(&session, k);
        }
        for k in ["l", "Space", "l", "l", "Space", "l", "Space", "l", "Space"] {
            keys(&session, k);
        }
        // precision: bf16 off (the cursor comes down on the row's last
        // value, bf16-pure); checkpointing: full off; attention: fused off.
        for k in ["j", "h", "h", "Space", "j", "Space", "j", "Space"] {
            keys(&session, k);
        }
        let p = wait_for(&session, &["│ 2 points"], 10);
        assert!(p.contains("micro_batch ○1 ○2 ●4 ○8"), "{p}");
        // The fit map's first point, and its predicted peak.
        keys(&session, "Tab");
        let p = wait_for(&session, &["▶ fit map", "per GPU"], 10);
        let peak = p
            .split("peak ")
            .nth(1)
            .and_then(|r| r.split(" per GPU").next())
            .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
            .unwrap_or_else(|| panic!("no peak in\n{p}"));
        // w writes the recipe; `memfit plan` of it gives the same figure.
        keys(&session, "w");
        wait_for(&session, &["wrote "], 10);
        let recipe = out.join("recipe.yaml");
        let plan = Command::new(env!("CARGO_BIN_EXE_memfit"))
            .args(["plan", "--format", "json"])
            .arg(&recipe)
            .output()
            .unwrap();
        assert!(
            plan.status.success(),
            "{}",
            String::from_utf8_lossy(&plan.stderr)
        );
        let plan: serde_json::Value = serde_json::from_slice(&plan.stdout).unwrap();
        assert_eq!(plan["model"], "llama-tiny");
        let points = plan["points"].as_array().unwrap();
        assert_eq!(points.len(), 2);
        let first = &points[0];
        assert_eq!(first["point"]["optimizer"], "adamw");
        assert_eq!(first["point"]["micro_batch"], 4);
        let total = first["total_bytes"].as_u64().unwrap();
        assert_eq!(peak, memfit::units::fmt_bytes(total), "{p}");
        // Enter measures it: the sweep view runs both points to the end.
        keys(&session, "Enter");
        let p = wait_for(&session, &["finished", "recommendation ★ #"], 180);
        assert!(p.contains("target NVIDIA H100 SXM5 80GB"), "{p}");
        assert!(p.contains("trials 2/2 finished"), "{p}");
        // b: back to the builder, the grid as it was.
        keys(&session, "b");
        let p = wait_for(
            &session,
            &[
                "builder │ llama-tiny on NVIDIA H100 SXM5 80GB",
                "│ 2 points",
            ],
            30,
        );
        assert!(p.contains("micro_batch ○1 ○2 ●4 ○8"), "{p}");
        keys(&session, "q");
        wait_for(&session, &["MEMFIT-EXIT 0"], 30);
        assert_eq!(
            tmux(&["display", "-p", "-t", &session, "#{alternate_on}"]).trim(),
            "0"
        );
    });
    tmux(&["kill-session", "-t", &session]);
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
    assert!(out.join("report.json").is_file());
    let journal = std::fs::read_to_string(out.join("trials.jsonl")).unwrap();
    assert_eq!(journal.lines().count(), 2, "{journal}");
}
