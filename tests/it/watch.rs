//! `memfit watch` end to end, on a machine without a GPU: the no-NVML path
//! (the command still runs, its exit code and host memory reported), the
//! scripted NVML double (tests/nvml_double: a GPU whose processes the
//! watched command publishes itself), the stop on Ctrl-C, the prediction,
//! and the TUI's drawing on a test terminal.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use memfit::telemetry::{GpuSample, ProcSample, Snapshot};
use memfit::watch::state::{Phase, Prediction, Target, Tick, WatchState};
use ratatui::Terminal;
use ratatui::backend::TestBackend;

use crate::common::scratch;

const GIB: u64 = 1 << 30;

fn memfit() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_memfit"));
    // Deterministic on any machine: no real NVML unless a test loads the double.
    c.env("MEMFIT_NVML_LIB", "/nonexistent/libnvidia-ml.so.1");
    c.env_remove("NVML_DOUBLE_SCRIPT");
    c.stdin(Stdio::null());
    c
}

fn run(c: &mut Command) -> (Output, String, String) {
    let out = c.output().expect("memfit runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

/// The NVML double built by build.rs, or `None` (the test then says it
/// skipped) where it could not be built.
fn nvml_double() -> Option<&'static str> {
    match option_env!("MEMFIT_NVML_DOUBLE") {
        Some(p) if !p.is_empty() && Path::new(p).exists() => Some(p),
        _ => {
            eprintln!("SKIPPED: the NVML double was not built (MEMFIT_NVML_DOUBLE)");
            None
        }
    }
}

/// memfit watching the double's GPU 0 (total 4 GB), whose processes are
/// listed in `dir/procs` ("PID BYTES" lines), which the command writes.
fn with_double(c: &mut Command, lib: &str, dir: &Path) {
    let script = dir.join("script");
    std::fs::write(
        &script,
        format!(
            "gpu 0 name \"NVIDIA H200\" total 4000000000 util 37 power_mw 300000 temp 45\nproc_from_file 0 {}\n",
            dir.join("procs").display()
        ),
    )
    .unwrap();
    c.env("MEMFIT_NVML_LIB", lib);
    c.env("NVML_DOUBLE_SCRIPT", &script);
}

/// A shell command that publishes its own GPU memory: 3 GB, then 1 GB.
fn publishing_job(dir: &Path) -> String {
    let procs = dir.join("procs").display().to_string();
    format!(
        "publish() {{ echo \"$$ $1\" > {procs}.tmp && mv {procs}.tmp {procs}; }}; \
         publish 3000000000; sleep 0.5; publish 1000000000; sleep 0.3; exit 0"
    )
}

#[test]
fn without_nvml_the_command_runs_and_its_exit_code_is_memfits() {
    let (out, stdout, stderr) = run(memfit().args([
        "watch",
        "--no-tui",
        "--",
        "sh",
        "-c",
        "echo from-the-job; exit 3",
    ]));
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    // The command's stdout is its own; memfit speaks on stderr.
    assert_eq!(stdout, "from-the-job\n");
    assert!(stderr.contains("memfit watch: no NVML: "), "{stderr}");
    assert!(stderr.contains("memfit watch summary"), "{stderr}");
    assert!(stderr.contains("exit code       3\n"), "{stderr}");
    assert!(stderr.contains("duration        "), "{stderr}");
    assert!(
        stderr.contains("GPU memory      not measured: no NVML: "),
        "{stderr}"
    );
}

#[test]
fn without_nvml_the_host_memory_is_reported_as_host_memory() {
    let dir = scratch("host");
    let timeline = dir.join("t.csv");
    let (out, _, stderr) = run(memfit().args([
        "watch",
        "--no-tui",
        "--sample-ms",
        "20",
        "--timeline",
        timeline.to_str().unwrap(),
        "--",
        "sh",
        "-c",
        "sleep 0.3",
    ]));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("host RSS peak   ") && stderr.contains("(host memory of the process tree"),
        "{stderr}"
    );
    let csv = std::fs::read_to_string(&timeline).unwrap();
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some(memfit::watch::TIMELINE_CSV_HEADER));
    let rows: Vec<&str> = lines.collect();
    assert!(rows.len() >= 5, "{csv}");
    // No GPU columns, the host RSS in the last.
    assert!(rows.iter().all(|r| r.contains(",,,,,,,,")), "{csv}");
    assert!(rows.iter().any(|r| !r.ends_with(',')), "{csv}");
}

#[test]
fn json_summary_and_a_command_that_cannot_start() {
    let (out, stdout, stderr) = run(memfit().args([
        "watch", "--no-tui", "--format", "json", "--", "sh", "-c", "exit 0",
    ]));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("the summary is JSON");
    assert_eq!(v["exit_code"], 0);
    assert_eq!(v["nvml"]["available"], false);
    assert!(v["nvml"]["error"].as_str().is_some());
    assert_eq!(v["command"][0], "sh");

    let (out, _, stderr) = run(memfit().args(["watch", "--no-tui", "--", "/nonexistent/trainer"]));
    assert_eq!(out.status.code(), Some(127), "{stderr}");
    assert!(
        stderr.contains("cannot run `/nonexistent/trainer`"),
        "{stderr}"
    );
}

#[test]
fn a_pid_that_does_not_exist_is_bad_input() {
    let (out, _, stderr) = run(memfit().args(["watch", "--no-tui", "--pid", "999999"]));
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--pid 999999: no such process"), "{stderr}");
    // --pid and a command are one or the other; --warn-at is a percentage.
    let (out, _, _) = run(memfit().args(["watch", "--pid", "1", "--", "true"]));
    assert_eq!(out.status.code(), Some(2));
    let (out, _, stderr) = run(memfit().args(["watch", "--warn-at", "0.9", "--", "true"]));
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr.contains("write the percentage, like 90%"),
        "{stderr}"
    );
}

#[test]
fn attaching_to_a_pid_ends_when_it_does() {
    let mut job = Command::new("sleep").arg("0.4").spawn().unwrap();
    let pid = job.id().to_string();
    let started = Instant::now();
    let (out, _, stderr) =
        run(memfit().args(["watch", "--no-tui", "--sample-ms", "20", "--pid", &pid]));
    job.wait().unwrap();
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(stderr.contains("watching sleep (pid "), "{stderr}");
    assert!(
        stderr.contains("unknown (not started by memfit)"),
        "{stderr}"
    );
}

#[test]
fn ctrl_c_stops_the_command_with_sigterm() {
    let child = memfit()
        .args(["watch", "--no-tui", "--grace", "2", "--", "sleep", "30"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(400));
    // SIGINT to memfit alone (a terminal would signal the whole group).
    let ok = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    let started = Instant::now();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(started.elapsed() < Duration::from_secs(5), "{stderr}");
    // sleep dies of the SIGTERM: 128 + 15, as a shell reports it.
    assert_eq!(out.status.code(), Some(143), "{stderr}");
    assert!(stderr.contains("SIGTERM sent to pid"), "{stderr}");
    assert!(
        stderr.contains("exit code       143 (ended by signal 15)"),
        "{stderr}"
    );
}

/// The full-screen view wrote the command's output to memfit-watch.log in
/// the current directory, one file for every watch started there. It now
/// goes to a new file per watch in --out (memfit-watch/ by default), made
/// only when there is output to keep; a headless watch writes nothing.
#[test]
fn the_command_output_goes_to_a_file_per_watch_in_out() {
    let dir = scratch("out");
    let (out, _, stderr) = run(memfit().current_dir(&dir).args([
        "watch",
        "--no-tui",
        "--",
        "sh",
        "-c",
        "echo headless",
    ]));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "headless wrote a file"
    );

    // The full-screen view needs a terminal: script(1) gives it one.
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("SKIPPED: script(1) is not installed (util-linux)");
        return;
    }
    let bin = env!("CARGO_BIN_EXE_memfit");
    // Returns the exit code and what the terminal showed.
    let in_terminal = |extra: &str| {
        let line = format!("{bin} watch {extra} -- sh -c 'echo line-from-the-job; sleep 0.2'");
        let out = Command::new("script")
            .args(["-qec", &line, "/dev/null"])
            .current_dir(&dir)
            .env("MEMFIT_NVML_LIB", "/nonexistent/libnvidia-ml.so.1")
            .env("TERM", "xterm")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let watch = |extra: &str| {
        let (code, text) = in_terminal(extra);
        assert_eq!(code, Some(0), "{text}");
        text
    };
    let logs = |d: &Path| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(d)
            .map(|r| r.map(|e| e.unwrap().path()).collect())
            .unwrap_or_default();
        v.sort();
        v
    };
    let text = watch("");
    let default = logs(&dir.join("memfit-watch"));
    assert_eq!(default.len(), 1, "{text}");
    let name = default[0]
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    assert!(name.ends_with(".log") && name.contains("-sh-"), "{name}");
    assert!(
        std::fs::read_to_string(&default[0])
            .unwrap()
            .contains("line-from-the-job")
    );
    assert!(text.contains(&format!("memfit-watch/{name}")), "{text}");
    // A second watch keeps the first one's output.
    watch("");
    assert_eq!(logs(&dir.join("memfit-watch")).len(), 2);
    // --out picks the folder (made as needed), --log the file.
    watch("--out runs/a");
    assert_eq!(logs(&dir.join("runs/a")).len(), 1);
    watch("--log job.txt");
    assert!(
        std::fs::read_to_string(dir.join("job.txt"))
            .unwrap()
            .contains("line-from-the-job")
    );
    assert_eq!(logs(&dir).len(), 3, "{:?}", logs(&dir));
    // A --log in a folder that does not exist is bad input, before anything runs.
    let (code, text) = in_terminal("--log no/such/dir/job.txt");
    assert_eq!(code, Some(2), "{text}");
    assert!(
        text.contains("--log: cannot write no/such/dir/job.txt"),
        "{text}"
    );
    assert!(!text.contains("line-from-the-job"), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_prediction_is_shown_beside_the_measurement() {
    let (out, _, stderr) = run(memfit().args([
        "watch",
        "--no-tui",
        "--model",
        "gpt2-tiny",
        "--seq-len",
        "32",
        "--",
        "true",
    ]));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("memfit predicts ") && stderr.contains(" tracked per GPU (+ CUDA context"),
        "{stderr}"
    );
    assert!(
        stderr.contains("for gpt2-tiny, seq 32 x micro-batch 4"),
        "{stderr}"
    );
    assert!(
        stderr.contains("nothing measured to compare with"),
        "{stderr}"
    );
    // A bad knob stops before anything runs.
    let (out, _, stderr) = run(memfit().args([
        "watch",
        "--no-tui",
        "--model",
        "no-such-model",
        "--",
        "true",
    ]));
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(!stderr.contains("started"), "{stderr}");
}

#[test]
fn nvml_double_peak_warning_and_timelines() {
    let Some(lib) = nvml_double() else { return };
    for ext in ["csv", "json"] {
        let dir = scratch(&format!("double-{ext}"));
        let timeline = dir.join(format!("timeline.{ext}"));
        let mut c = memfit();
        with_double(&mut c, lib, &dir);
        c.args([
            "watch",
            "--no-tui",
            "--sample-ms",
            "20",
            "--warn-at",
            "70%",
            "--model",
            "gpt2-tiny",
            "--timeline",
            timeline.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            &publishing_job(&dir),
        ]);
        let (out, _, stderr) = run(&mut c);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        assert!(!stderr.contains("no NVML"), "{stderr}");
        assert!(stderr.contains("NVML (driver 999.99.99)"), "{stderr}");
        assert!(
            stderr.contains("job GPU peak    2.79 GiB (3.00 GB) on GPU 0 at "),
            "{stderr}"
        );
        assert!(stderr.contains(": 75.0% of its 3.73 GiB"), "{stderr}");
        assert!(
            stderr.contains("GPU 0           NVIDIA H200, 3.73 GiB total"),
            "{stderr}"
        );
        // Once per crossing: 75% is above 70%, 25% below re-arms it.
        assert_eq!(
            stderr.matches("memfit watch: WARNING").count(),
            1,
            "{stderr}"
        );
        assert!(
            stderr.contains(
                "GPU 0 memory at 75.0% (2.79 GiB of 3.73 GiB; job 2.79 GiB): above --warn-at 70%"
            ),
            "{stderr}"
        );
        assert!(stderr.contains("warnings        1\n"), "{stderr}");
        assert!(
            stderr.contains("measured 2.79 GiB: +2.79 GiB beside the prediction"),
            "{stderr}"
        );
        let text = std::fs::read_to_string(&timeline).unwrap();
        if ext == "csv" {
            let rows: Vec<&str> = text.lines().skip(1).collect();
            assert!(rows.len() >= 10, "{text}");
            assert!(
                rows.iter()
                    .any(|r| r.contains(",0,3000000000,4000000000,3000000000,37,300.0,45,")),
                "{text}"
            );
            assert!(rows.iter().any(|r| r.contains(",1000000000,37,")), "{text}");
        } else {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            let samples = v["samples"].as_array().unwrap();
            assert!(samples.len() >= 10, "{text}");
            let job: Vec<u64> = samples
                .iter()
                .filter_map(|s| s["gpus"][0]["job_bytes"].as_u64())
                .collect();
            assert_eq!(job.iter().max(), Some(&3_000_000_000));
            assert!(job.contains(&1_000_000_000));
        }
    }
}

/// torchrun and DeepSpeed start workers as children: their memory is the job's.
#[test]
fn nvml_double_counts_the_descendants() {
    let Some(lib) = nvml_double() else { return };
    let dir = scratch("double-tree");
    let procs = dir.join("procs").display().to_string();
    // The worker is a grandchild; a stranger's process is on the GPU too.
    let worker = format!(
        "sh -c 'echo \"$$ 2000000000\" >> {procs}.tmp; echo \"1 500000000\" >> {procs}.tmp; mv {procs}.tmp {procs}; sleep 0.5'"
    );
    let mut c = memfit();
    with_double(&mut c, lib, &dir);
    c.args([
        "watch",
        "--no-tui",
        "--sample-ms",
        "20",
        "--format",
        "json",
        "--",
        "sh",
        "-c",
        &format!("{worker}; exit 0"),
    ]);
    let (out, stdout, stderr) = run(&mut c);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("JSON summary");
    assert_eq!(v["job_peak_bytes"], 2_000_000_000u64, "{stdout}");
    assert_eq!(
        v["gpus"][0]["peak_used_bytes"], 2_500_000_000u64,
        "{stdout}"
    );
}

#[test]
fn nvml_double_json_summary() {
    let Some(lib) = nvml_double() else { return };
    let dir = scratch("double-summary");
    let mut c = memfit();
    with_double(&mut c, lib, &dir);
    c.args([
        "watch",
        "--no-tui",
        "--sample-ms",
        "20",
        "--format",
        "json",
        "--model",
        "gpt2-tiny",
        "--",
        "sh",
        "-c",
        &publishing_job(&dir),
    ]);
    let (out, stdout, stderr) = run(&mut c);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("JSON summary");
    assert_eq!(v["job_peak_bytes"], 3_000_000_000u64);
    assert_eq!(v["job_peak_gpu"], 0);
    assert_eq!(v["gpu_total_bytes"], 4_000_000_000u64);
    assert_eq!(v["job_peak_pct"], 75.0);
    assert_eq!(v["gpus"][0]["name"], "NVIDIA H200");
    // The default --warn-at is 90%: nothing to warn about.
    assert_eq!(v["warnings"].as_array().unwrap().len(), 0);
    assert_eq!(v["nvml"]["driver_version"], "999.99.99");
    assert!(v["samples"].as_u64().unwrap() >= 10);
    let p = &v["prediction"];
    assert_eq!(p["model"], "gpt2-tiny");
    let predicted = p["tracked_peak_bytes"].as_i64().unwrap();
    assert!(predicted > 0);
    assert_eq!(
        p["measured_minus_predicted_bytes"].as_i64().unwrap(),
        3_000_000_000 - predicted
    );
}

#[test]
fn nvml_double_gpus_only_until_ctrl_c() {
    let Some(lib) = nvml_double() else { return };
    let dir = scratch("double-gpus");
    std::fs::write(dir.join("procs"), "4242 1000000000\n").unwrap();
    let mut c = memfit();
    with_double(&mut c, lib, &dir);
    let child = c
        .args(["watch", "--no-tui", "--sample-ms", "50"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1300));
    Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("GPU 0 953.67 MiB/3.73 GiB (25.0%) util 37% 300 W 45°C"),
        "{stderr}"
    );
    assert!(
        stderr
            .contains("GPU 0           NVIDIA H200, 3.73 GiB total, used peak 953.67 MiB (25.0%)"),
        "{stderr}"
    );
}

// The TUI's drawing, a pure function of the state, on a 100x30 test terminal.

fn gpu(used: u64, procs: &[(u32, u64)]) -> GpuSample {
    GpuSample {
        index: 0,
        name: "NVIDIA H100 80GB HBM3".into(),
        memory_used_bytes: used,
        memory_total_bytes: 80 * GIB,
        utilization_pct: Some(97),
        memory_utilization_pct: Some(40),
        power_w: Some(312.0),
        power_limit_w: Some(700.0),
        sm_clock_mhz: Some(1980),
        temperature_c: Some(64),
        processes: procs
            .iter()
            .map(|&(pid, b)| ProcSample {
                pid,
                used_bytes: Some(b),
                name: Some(if pid == 4242 { "python" } else { "other" }.into()),
            })
            .collect(),
        error: None,
    }
}

fn draw(st: &WatchState, w: u16, h: u16) -> String {
    let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
    t.draw(|f| memfit::watch::tui::render(st, f)).unwrap();
    let buf = t.backend().buffer().clone();
    (0..h)
        .map(|y| {
            (0..w)
                .map(|x| buf[(x, y)].symbol().to_string())
                .collect::<String>()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn job_state() -> WatchState {
    let mut st = WatchState::new(
        Target::Command {
            argv: vec!["python".into(), "train.py".into()],
            pid: 4242,
        },
        Ok(Some("550.54.15".into())),
        100,
        0.9,
    );
    st.prediction = Some(Prediction {
        model: "llama-3.1-8b".into(),
        knobs: "seq 4096 x micro-batch 1, bf16, adamw, fused attention".into(),
        ranks: 1,
        tracked_peak_bytes: 66 * GIB,
        framework: memfit::engine::Framework::HfEager,
        allocation_profile: "hf-eager (PyTorch eager + transformers)".into(),
    });
    st.log_path = Some("memfit-watch.log".into());
    st.push_log("step 10 loss 3.21".into());
    st.push_log("step 11 loss 3.19".into());
    for i in 0..40u64 {
        let job = (30 + i) * GIB;
        st.on_tick(Tick {
            at_s: i as f64 * 0.5,
            gpus: Some(Ok(Snapshot {
                at_s: i as f64 * 0.5,
                gpus: vec![gpu(job + 4 * GIB, &[(4242, job), (77, 4 * GIB)])],
            })),
            job: vec![4242],
            host_rss: Some(3 * GIB),
        });
    }
    st
}

#[test]
fn tui_draws_the_gpu_row_the_chart_the_warning_and_the_prediction() {
    let st = job_state();
    let screen = draw(&st, 100, 30);
    println!("{screen}");
    let line = |needle: &str| {
        screen
            .lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?}:\n{screen}"))
            .to_string()
    };
    assert!(
        line("memfit watch")
            .contains("python train.py │ pid 4242 │ running 0:19 │ every 100 ms │ warn at 90%")
    );
    assert!(line("job peak").contains(
        "job peak 69.00 GiB (86.2% of GPU 0) │ memfit predicts 66.00 GiB for hf-eager (+ context): +3.00 GiB"
    ));
    // 73 GiB of 80 is 91.2%: above --warn-at, in a banner.
    assert!(line("WARNING").contains(
        "⚠ WARNING GPU 0 memory at 91.2% (73.00 GiB of 80.00 GiB; job 69.00 GiB): above --warn-at 90%"
    ));
    let row = line("NVIDIA H100");
    assert!(row.contains(" 0 NVIDIA H100 80GB HBM3  ["), "{row}");
    assert!(row.contains("█░"), "{row}");
    assert!(
        row.contains("]  73.00 GiB/80.00 GiB  91.2%  util  97%  312/700 W  64°C"),
        "{row}"
    );
    assert!(line("└    4242 python").contains("69.00 GiB  job"));
    assert!(line("   77").contains("4.00 GiB"));
    assert!(line("GPUs (driver 550.54.15)").contains("┌"));
    assert!(line("job GPU memory (NVML): now 69.00 GiB, peak 69.00 GiB").contains("┌"));
    // The legend is a row under the plot, each line its own glyph (they
    // read apart without colour); the y ticks are round and evenly spaced.
    assert!(
        line("⡠⠊ job").contains(
            "⡠⠊ job  · GPU used  ━ capacity 80.00 GiB  ─ warn 90%  ┄ memfit predicts 66.00 GiB"
        ),
        "the legend under the chart"
    );
    let ticks: Vec<usize> = screen
        .lines()
        .enumerate()
        .filter(|(_, l)| l.contains("GiB┤") || l.contains(" 0┤"))
        .map(|(y, _)| y)
        .collect();
    assert!(ticks.len() >= 3, "{screen}");
    assert!(
        ticks.windows(3).all(|g| g[1] - g[0] == g[2] - g[1]),
        "{ticks:?}"
    );
    for t in ["80 GiB┤━", "40 GiB┤", "0┤"] {
        assert!(screen.contains(t), "{t}:\n{screen}");
    }
    assert!(line("output (memfit-watch.log)").contains("┌"));
    assert!(line("step 11 loss 3.19").contains("│"));
    assert!(line("q quit").contains("SIGTERM to the command, SIGKILL after the grace period"));
}

#[test]
fn tui_without_nvml_says_so_and_charts_host_memory() {
    let mut st = WatchState::new(
        Target::Command {
            argv: vec!["python".into(), "train.py".into()],
            pid: 4242,
        },
        Err("libnvidia-ml.so.1 could not be loaded (no NVIDIA driver)".into()),
        100,
        0.9,
    );
    for i in 0..10u64 {
        st.on_tick(Tick {
            at_s: i as f64,
            gpus: None,
            job: vec![4242],
            host_rss: Some(((i + 1) * 100) << 20),
        });
    }
    st.phase = Phase::Stopping {
        since_s: 9.0,
        killed: false,
    };
    let screen = draw(&st, 100, 30);
    println!("{screen}");
    assert!(
        screen.contains("no NVML │ job host RSS peak 1000.00 MiB (host memory, not GPU)"),
        "{screen}"
    );
    assert!(
        screen.contains("│no NVML: libnvidia-ml.so.1 could not be loaded (no NVIDIA driver)"),
        "the GPU panel says it too:\n{screen}"
    );
    assert!(
        screen.contains("job host memory (RSS, not GPU memory), peak 1000.00 MiB"),
        "{screen}"
    );
    assert!(screen.contains("stopping 0:09"), "{screen}");
    assert!(screen.contains("q again: SIGKILL now"), "{screen}");
    assert!(
        !screen.contains("capacity"),
        "no GPU capacity without NVML:\n{screen}"
    );
}

#[test]
fn tui_watching_gpus_only_at_every_size() {
    let mut st = WatchState::new(Target::Gpus, Ok(None), 100, 0.9);
    st.on_tick(Tick {
        at_s: 0.0,
        gpus: Some(Ok(Snapshot {
            at_s: 0.0,
            gpus: vec![gpu(10 * GIB, &[(77, 10 * GIB)])],
        })),
        job: vec![],
        host_rss: None,
    });
    let screen = draw(&st, 100, 30);
    assert!(
        screen.contains("memfit watch │ GPUs │ running 0:00"),
        "{screen}"
    );
    assert!(screen.contains("GPU memory used (fullest GPU)"), "{screen}");
    assert!(screen.contains("q quit"), "{screen}");
    for (w, h) in [(80, 24), (40, 12), (10, 4), (1, 1), (250, 70)] {
        draw(&st, w, h);
        draw(&job_state(), w, h);
    }
}

#[test]
fn help_describes_the_modes() {
    let (out, stdout, _) = run(memfit().args(["watch", "--help"]));
    assert!(out.status.success());
    for s in [
        "-- <CMD>...",
        "--pid <PID>",
        "--warn-at <PCT>",
        "--no-tui",
        "--timeline <FILE>",
        "Prediction (the engine on meta",
        "--framework <FRAMEWORK>",
        "--model <MODEL>",
        "memfit watch -- torchrun",
    ] {
        assert!(stdout.contains(s), "{s:?} missing from:\n{stdout}");
    }
}
