//! Telemetry through the real nvml-wrapper code path, against the scripted
//! NVML double (`tests/nvml_double/nvml_double.c`, built by build.rs).
//!
//! Each test copies the double into a directory of its own and writes the
//! script next to it (`<lib>.script`), so tests run in parallel without
//! touching the process environment; `Telemetry::open_with` names the copy.
//! Only `open_reads_the_environment` uses `MEMFIT_NVML_LIB` and
//! `NVML_DOUBLE_SCRIPT`, in a child process.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use memfit::telemetry::{NVML_LIB_ENV, Sampler, Seen, Telemetry};

const GB: u64 = 1_000_000_000;

/// A private copy of the NVML double with its script beside it.
struct Double {
    dir: PathBuf,
    lib: PathBuf,
    script: PathBuf,
}

impl Double {
    fn new(tag: &str, script: Option<&str>) -> Double {
        let built = env!("MEMFIT_NVML_DOUBLE");
        assert!(
            !built.is_empty(),
            "the NVML double was not built (build.rs found no C compiler; see its cargo:warning lines)"
        );
        let dir = std::env::temp_dir().join(format!("memfit-nvml-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let lib = dir.join("libnvml_double.so");
        std::fs::copy(built, &lib).unwrap();
        let script_path = dir.join("libnvml_double.so.script");
        let d = Double {
            dir,
            lib,
            script: script_path,
        };
        if let Some(s) = script {
            d.write(s);
        }
        d
    }

    /// Replaces the script atomically: the double re-reads it on every call.
    fn write(&self, text: &str) {
        write_atomic(&self.script, text);
    }

    fn open(&self) -> Result<Telemetry, String> {
        Telemetry::open_with(Some(self.lib.as_os_str()))
    }
}

impl Drop for Double {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn write_atomic(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn my_pid() -> u32 {
    std::process::id()
}

fn my_comm() -> String {
    std::fs::read_to_string("/proc/self/comm")
        .unwrap()
        .trim_end()
        .to_string()
}

/// A pid that cannot exist (above any pid_max).
const NO_SUCH_PID: u32 = 99_999_999;

fn two_gpus() -> String {
    format!(
        "# two GPUs, every figure scripted\n\
         gpus 2\n\
         driver 550.54.15\n\
         gpu 0 name \"NVIDIA H200\" total 150000000000 used 5000000000 util 37 memutil 12\n\
         gpu 0 power_mw 312500 limit_mw 700000 sm_mhz 1980 temp 45\n\
         gpu 1 name \"NVIDIA H100 80GB HBM3\" total 85000000000 used 2000000000 util 99 memutil 50 \
         power_mw 650000 limit_mw 700000 sm_mhz 1755 temp 71\n\
         proc 0 {me} 3000000000\n\
         proc 0 {none} na\n\
         proc 1 {me} 1500000000   # the same process on both GPUs\n",
        me = my_pid(),
        none = NO_SUCH_PID
    )
}

#[test]
fn open_fails_cleanly_when_the_driver_is_not_loaded() {
    let d = Double::new("init-error", Some("init_error 9\n"));
    let e = d.open().unwrap_err();
    assert!(e.contains("NVML_ERROR_DRIVER_NOT_LOADED"), "{e}");
    assert!(!e.contains('\n'), "one line: {e}");
}

#[test]
fn open_fails_cleanly_without_a_library() {
    let e = Telemetry::open_with(Some("/nonexistent/libnvidia-ml.so.1".as_ref())).unwrap_err();
    assert!(e.contains("could not be loaded"), "{e}");
    assert!(!e.contains('\n'), "one line: {e}");

    // A file that is no library at all.
    let d = Double::new("not-a-lib", Some("gpus 1\n"));
    let e = Telemetry::open_with(Some(d.script.as_os_str())).unwrap_err();
    assert!(e.contains("could not be loaded"), "{e}");

    // The double with no script: it refuses to initialise.
    let d = Double::new("no-script", None);
    let e = d.open().unwrap_err();
    assert!(e.contains("NVML_ERROR_LIBRARY_NOT_FOUND"), "{e}");
}

#[test]
fn sample_reports_every_scripted_figure() {
    let d = Double::new("two-gpus", Some(&two_gpus()));
    let t = d.open().unwrap();
    assert_eq!(t.driver_version().as_deref(), Some("550.54.15"));
    assert_eq!(t.gpu_count(), Ok(2));
    let s = t.sample(None).unwrap();
    assert!(s.at_s >= 0.0 && s.at_s < 60.0, "{}", s.at_s);
    assert_eq!(s.gpus.len(), 2);

    let g = &s.gpus[0];
    assert_eq!(g.index, 0);
    assert_eq!(g.name, "NVIDIA H200");
    assert_eq!(g.memory_total_bytes, 150 * GB);
    assert_eq!(g.memory_used_bytes, 5 * GB);
    assert_eq!(g.utilization_pct, Some(37));
    assert_eq!(g.memory_utilization_pct, Some(12));
    assert_eq!(g.power_w, Some(312.5));
    assert_eq!(g.power_limit_w, Some(700.0));
    assert_eq!(g.sm_clock_mhz, Some(1980));
    assert_eq!(g.temperature_c, Some(45));
    assert_eq!(g.error, None);
    assert_eq!(g.processes.len(), 2);
    assert_eq!(g.processes[0].pid, my_pid());
    assert_eq!(g.processes[0].used_bytes, Some(3 * GB));
    assert_eq!(
        g.processes[0].name,
        Some(my_comm()),
        "the name comes from /proc"
    );
    assert_eq!(g.processes[1].pid, NO_SUCH_PID);
    assert_eq!(g.processes[1].used_bytes, None, "NVML_VALUE_NOT_AVAILABLE");
    assert_eq!(g.processes[1].name, None, "no /proc entry");

    let g = &s.gpus[1];
    assert_eq!(g.index, 1);
    assert_eq!(g.name, "NVIDIA H100 80GB HBM3");
    assert_eq!(g.memory_total_bytes, 85 * GB);
    assert_eq!(g.memory_used_bytes, 2 * GB);
    assert_eq!(
        (g.utilization_pct, g.memory_utilization_pct),
        (Some(99), Some(50))
    );
    assert_eq!((g.power_w, g.power_limit_w), (Some(650.0), Some(700.0)));
    assert_eq!((g.sm_clock_mhz, g.temperature_c), (Some(1755), Some(71)));
    assert_eq!(g.processes.len(), 1);
    assert_eq!(g.processes[0].used_bytes, Some(1_500_000_000));

    assert_eq!(t.process_bytes(my_pid(), None), Some(4_500_000_000));
    assert_eq!(t.process_bytes(my_pid(), Some(1)), Some(1_500_000_000));
    assert_eq!(t.process_bytes(NO_SUCH_PID, None), None);
    assert_eq!(t.process_bytes(12345678, None), None);

    let only = t.sample(Some(1)).unwrap();
    assert_eq!(only.gpus.len(), 1);
    assert_eq!(only.gpus[0].index, 1);
    let e = t.sample(Some(2)).unwrap_err();
    assert!(e.contains("no GPU 2"), "{e}");
}

#[test]
fn defaults_and_used_from_processes() {
    // No `gpus` line: one more than the highest index named; no `used`: the
    // processes' sum.
    let d = Double::new(
        "defaults",
        Some("proc 1 100 7000\nproc 1 101 3000\nproc 1 102 na\n"),
    );
    let t = d.open().unwrap();
    let s = t.sample(None).unwrap();
    assert_eq!(s.gpus.len(), 2);
    assert_eq!(s.gpus[0].name, "NVML double GPU 0");
    assert_eq!(s.gpus[0].memory_used_bytes, 0);
    assert_eq!(s.gpus[0].memory_total_bytes, 85_899_345_920);
    assert_eq!(s.gpus[1].memory_used_bytes, 10_000);
    assert_eq!(s.gpus[1].processes.len(), 3);
}

#[test]
fn unsupported_figures_are_none() {
    let d = Double::new(
        "unsupported",
        Some(
            "gpus 2\n\
             gpu 0 used 42 util 5\n\
             proc 0 77 42\n\
             unsupported 0 util power limit clock temp procs\n\
             fail 1 name 999\n",
        ),
    );
    let t = d.open().unwrap();
    let s = t.sample(None).unwrap();
    let g = &s.gpus[0];
    assert_eq!(g.error, None);
    assert_eq!(g.memory_used_bytes, 42);
    assert_eq!((g.utilization_pct, g.memory_utilization_pct), (None, None));
    assert_eq!((g.power_w, g.power_limit_w), (None, None));
    assert_eq!((g.sm_clock_mhz, g.temperature_c), (None, None));
    assert!(g.processes.is_empty());
    // A name that fails becomes a placeholder; the row is still good.
    assert_eq!(s.gpus[1].name, "GPU 1");
    assert_eq!(s.gpus[1].error, None);
    assert_eq!(s.gpus[1].temperature_c, Some(40));
}

#[test]
fn a_lost_gpu_marks_only_its_row() {
    let base = "gpus 2\n\
                gpu 0 name A used 1000 temp 30\n\
                gpu 1 name B used 2000 temp 31\n\
                proc 1 55 2000\n";
    let d = Double::new("lost", Some(base));
    let t = d.open().unwrap();
    let good = t.sample(None).unwrap();
    assert!(good.gpus.iter().all(|g| g.error.is_none()));

    // GPU 1 falls off the bus: its row keeps the last good figures.
    d.write(&format!("{base}gpu 0 used 1500\nlost 1\n"));
    let s = t.sample(None).unwrap();
    assert_eq!(s.gpus.len(), 2);
    assert_eq!(s.gpus[0].error, None);
    assert_eq!(s.gpus[0].memory_used_bytes, 1500);
    let g = &s.gpus[1];
    let e = g.error.as_deref().unwrap();
    assert!(e.contains("NVML_ERROR_GPU_IS_LOST"), "{e}");
    assert_eq!(g.name, "B");
    assert_eq!(g.memory_used_bytes, 2000);
    assert_eq!(g.temperature_c, Some(31));
    assert_eq!(g.processes.len(), 1);

    // Lost on one query only (the temperature) still fails the row.
    d.write(&format!("{base}fail 1 temp 15\n"));
    let s = t.sample(None).unwrap();
    assert!(s.gpus[1].error.as_deref().unwrap().contains("GPU_IS_LOST"));

    // Back: the row is live again.
    d.write(&format!("{base}gpu 1 used 2500\n"));
    let s = t.sample(None).unwrap();
    assert_eq!(s.gpus[1].error, None);
    assert_eq!(s.gpus[1].memory_used_bytes, 2500);
}

#[test]
fn a_gpu_lost_from_the_start_has_a_placeholder_row() {
    let d = Double::new("lost-first", Some("gpus 3\nlost 1\nfail 2 memory 999\n"));
    let t = d.open().unwrap();
    let s = t.sample(None).unwrap();
    assert_eq!(s.gpus.len(), 3);
    assert_eq!(s.gpus[0].error, None);
    assert_eq!(s.gpus[1].name, "GPU 1");
    assert_eq!(s.gpus[1].index, 1);
    assert_eq!(s.gpus[1].memory_used_bytes, 0);
    assert!(s.gpus[1].error.as_deref().unwrap().contains("GPU_IS_LOST"));
    assert!(
        s.gpus[2]
            .error
            .as_deref()
            .unwrap()
            .contains("NVML_ERROR_UNKNOWN")
    );
}

#[test]
fn a_failing_count_is_an_error_not_a_panic() {
    let d = Double::new("count-error", Some("count_error 999\n"));
    let t = d.open().unwrap();
    let e = t.sample(None).unwrap_err();
    assert!(e.contains("NVML_ERROR_UNKNOWN"), "{e}");
    assert_eq!(t.process_bytes(1, None), None);
}

fn wait_for(s: &Sampler, what: &str, ok: impl Fn(&Seen) -> bool) -> Seen {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let seen = s.seen();
        if ok(&seen) {
            return seen;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; seen: {:?}",
            seen.latest
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn latest_bytes(seen: &Seen, pid: u32) -> Option<u64> {
    seen.latest.as_ref()?.process_bytes(pid)
}

#[test]
fn sampler_tracks_a_watched_pid_peak_as_values_change() {
    let d = Double::new("sampler-peak", None);
    let procs = d.dir.join("procs");
    d.write(&format!(
        "gpus 2\ngpu 0 total 200000000000\nproc_from_file 0 {}\nproc 1 9 5\n",
        procs.display()
    ));
    let t = d.open().unwrap();
    let watch = Arc::new(Mutex::new(Vec::new()));
    let sampler = Sampler::start(t, Duration::from_millis(5), None, watch.clone());
    let me = my_pid();

    // Nothing yet for the pid; it is watched only once "spawned".
    wait_for(&sampler, "a first sample", |s| s.latest.is_some());
    watch.lock().unwrap().push(me);
    for gb in [1, 3, 2] {
        write_atomic(&procs, &format!("{me} {}\n", gb * GB));
        wait_for(&sampler, &format!("{gb} GB"), |s| {
            latest_bytes(s, me) == Some(gb * GB)
                && s.watched
                    .iter()
                    .any(|w| w.samples.last().map(|x| x.1) == Some(gb * GB))
        });
    }
    let seen = sampler.stop();
    let w = seen.watched.iter().find(|w| w.pid == me).unwrap();
    assert_eq!(w.peak_bytes, 3 * GB);
    let mut values: Vec<u64> = w.samples.iter().map(|s| s.1).collect();
    values.dedup();
    assert_eq!(values, vec![GB, 3 * GB, 2 * GB]);
    assert!(w.samples.windows(2).all(|p| p[0].0 <= p[1].0));
    // The GPU memory used follows the processes (no `used` in the script).
    let (_, last) = seen.timeline.last().unwrap();
    assert_eq!(last, &vec![2 * GB, 5]);
    assert!(seen.errors.is_empty(), "{:?}", seen.errors);
    let latest = seen.latest.unwrap();
    assert_eq!(latest.gpus[0].processes[0].name, Some(my_comm()));
}

#[test]
fn sampler_timeline_stays_bounded() {
    // Every memory query adds one byte: the used figure counts the samples.
    let d = Double::new(
        "sampler-bounded",
        Some("gpus 1\nused_step 0 1\nproc 0 4 1\n"),
    );
    let t = d.open().unwrap();
    let watch = Arc::new(Mutex::new(vec![4]));
    let cap = 40;
    let sampler = Sampler::start_capped(t, Duration::from_millis(1), None, watch, cap);
    let taken = |s: &Seen| s.latest.as_ref().map_or(0, |l| l.gpus[0].memory_used_bytes);
    let seen = wait_for(&sampler, "many samples", |s| taken(s) >= 10 * cap as u64);
    assert!(seen.timeline.len() <= cap, "{}", seen.timeline.len());
    let seen = sampler.stop();
    let n = taken(&seen);
    assert!(n >= 10 * cap as u64);
    assert!(seen.timeline.len() <= cap, "{}", seen.timeline.len());
    assert!(seen.watched[0].samples.len() <= cap);
    assert_eq!(seen.watched[0].peak_bytes, 1);
    // Oldest first, newest exact; merged points keep the larger figure.
    assert!(seen.timeline.windows(2).all(|p| p[0].0 < p[1].0));
    assert_eq!(seen.timeline.last().unwrap().1, vec![n]);
    assert!(seen.timeline[0].1[0] > 2, "the first points were merged");
}

#[test]
fn sampler_stops_promptly() {
    let d = Double::new("sampler-stop", Some("gpus 1\n"));
    let t = d.open().unwrap();
    let sampler = Sampler::start(
        t,
        Duration::from_secs(30),
        Some(0),
        Arc::new(Mutex::new(vec![])),
    );
    wait_for(&sampler, "a first sample", |s| s.latest.is_some());
    let began = Instant::now();
    let seen = sampler.stop();
    assert!(
        began.elapsed() < Duration::from_secs(1),
        "{:?}",
        began.elapsed()
    );
    assert_eq!(seen.timeline.len(), 1);

    // Dropping it stops it too.
    let d = Double::new("sampler-drop", Some("gpus 1\n"));
    let sampler = Sampler::start(
        d.open().unwrap(),
        Duration::from_secs(30),
        None,
        Arc::new(Mutex::new(vec![])),
    );
    let began = Instant::now();
    drop(sampler);
    assert!(
        began.elapsed() < Duration::from_secs(1),
        "{:?}",
        began.elapsed()
    );
}

#[test]
fn sampler_survives_errors() {
    let d = Double::new("sampler-errors", Some("count_error 999\n"));
    let t = d.open().unwrap();
    let sampler = Sampler::start(
        t,
        Duration::from_millis(2),
        None,
        Arc::new(Mutex::new(vec![])),
    );
    let seen = wait_for(&sampler, "an error", |s| !s.errors.is_empty());
    assert!(seen.latest.is_none());
    assert!(
        seen.errors[0].contains("NVML_ERROR_UNKNOWN"),
        "{:?}",
        seen.errors
    );

    // GPU 1 lost: logged once, the thread goes on.
    d.write("gpus 2\nlost 1\n");
    let seen = wait_for(&sampler, "a sample", |s| s.latest.is_some());
    assert_eq!(seen.latest.unwrap().gpus.len(), 2);
    std::thread::sleep(Duration::from_millis(50));
    let seen = sampler.stop();
    let lost: Vec<_> = seen
        .errors
        .iter()
        .filter(|e| e.starts_with("GPU 1:"))
        .collect();
    assert_eq!(lost.len(), 1, "{:?}", seen.errors);
    assert!(seen.errors.len() <= 20);
    assert!(seen.timeline.len() > 1);
}

/// Runs this binary's `env_child` test in a child with `env` set.
fn run_child(mode: &str, env: &[(&str, &Path)]) -> String {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    // The test's name in the `it` binary, module path and all.
    cmd.args([
        "--exact",
        "telemetry::env_child",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("MEMFIT_TELEMETRY_CHILD", mode)
    .env_remove(NVML_LIB_ENV)
    .env_remove("NVML_DOUBLE_SCRIPT");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "child {mode} failed:\n{text}");
    text
}

#[test]
fn open_reads_the_environment() {
    if std::env::var_os("MEMFIT_TELEMETRY_CHILD").is_some() {
        return;
    }
    // The script named by NVML_DOUBLE_SCRIPT, not the one beside the library.
    let d = Double::new("env", Some("gpu 0 name Beside\n"));
    let script = d.dir.join("elsewhere.txt");
    write_atomic(&script, "gpu 0 name \"From Env\" used 7\n");
    let text = run_child(
        "good",
        &[(NVML_LIB_ENV, &d.lib), ("NVML_DOUBLE_SCRIPT", &script)],
    );
    assert!(text.contains("env child good ok"), "{text}");

    let missing = d.dir.join("missing.so");
    let text = run_child("bad", &[(NVML_LIB_ENV, &missing)]);
    assert!(text.contains("env child bad ok"), "{text}");
}

#[test]
fn env_child() {
    match std::env::var("MEMFIT_TELEMETRY_CHILD").as_deref() {
        Ok("good") => {
            let t = Telemetry::open().unwrap();
            let s = t.sample(None).unwrap();
            assert_eq!(s.gpus.len(), 1);
            assert_eq!(s.gpus[0].name, "From Env");
            assert_eq!(s.gpus[0].memory_used_bytes, 7);
            println!("env child good ok");
        }
        Ok("bad") => {
            let e = Telemetry::open().unwrap_err();
            assert!(e.contains("missing.so"), "{e}");
            assert!(e.contains("MEMFIT_NVML_LIB"), "{e}");
            println!("env child bad ok");
        }
        _ => {}
    }
}

/// The system's NVML, where there is one (a GPU machine); elsewhere only the
/// failure is checked.
#[test]
fn system_nvml_when_present() {
    let t = match Telemetry::open_with(None) {
        Ok(t) => t,
        Err(e) => {
            assert!(!e.is_empty() && !e.contains('\n'), "{e:?}");
            eprintln!("no NVML here ({e}): the real-driver checks are skipped");
            return;
        }
    };
    let s = t.sample(None).unwrap();
    assert!(t.driver_version().is_some());
    for g in &s.gpus {
        assert!(!g.name.is_empty());
        assert!(g.memory_total_bytes > 0 && g.memory_used_bytes <= g.memory_total_bytes);
        assert_eq!(g.error, None, "{g:?}");
    }
    eprintln!("{s:#?}");
}
