//! What the end-to-end tests share: running the memfit binary and reading
//! what it printed. Each test crate uses a part of it.
#![allow(dead_code)]

pub mod training;

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

/// Runs the memfit binary with `args` and waits for it (without the
/// caller's `COLUMNS`, so that `plan`'s table has its default width).
pub fn memfit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memfit"))
        // Plans must not depend on a GPU calibration in this machine's cache.
        .env("MEMFIT_NO_GPU_CALIBRATION", "1")
        .args(args)
        .env_remove("COLUMNS")
        .output()
        .expect("memfit runs")
}

/// Its stdout as one JSON document.
pub fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// Runs `memfit` with `args` then `extra`, which must succeed, and returns
/// its JSON document.
pub fn ok_json(args: &[&str], extra: &[&str]) -> Value {
    let all = [args, extra].concat();
    let out = memfit(&all);
    assert!(out.status.success(), "{all:?}: {}", stderr(&out));
    json(&out)
}

/// A run report's losses, step by step.
pub fn losses(r: &Value) -> Vec<f64> {
    r["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .map(|s| s["loss"].as_f64().expect("a loss"))
        .collect()
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A tracker's allocation events without their times: what meta and cpu
/// must agree on, event for event.
pub fn events(
    t: &memfit::memory::Tracker,
) -> Vec<(memfit::memory::Category, i64, memfit::memory::Phase)> {
    t.timeline()
        .iter()
        .map(|e| (e.category, e.bytes, e.phase))
        .collect()
}

/// A fresh directory for one test's files: a new one each call, so two
/// calls with the same name (or two tests on the harness's threads) never
/// share one.
pub fn scratch(name: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("memfit-{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `text` written to `file` in a fresh [`scratch`] directory: its path.
pub fn scratch_file(name: &str, file: &str, text: impl AsRef<[u8]>) -> PathBuf {
    let path = scratch(name).join(file);
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs memfit with `args`, which must be refused as bad input (exit 2)
/// with `needle` in the message; returns the message.
pub fn refused(args: &[&str], needle: &str) -> String {
    let out = memfit(args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(
        err.contains(needle),
        "{args:?}: {needle:?} missing from: {err}"
    );
    err
}

/// What must agree between a threaded and a launched run: every step's loss,
/// gradient norm and skip (as the JSON numbers, which round-trip f32 bits),
/// each rank's peaks, breakdown and traffic, the top-level peaks, the work
/// per step, the stages and the host memory. Capacities, times and the
/// thread count are the machine's.
pub fn comparable(doc: &Value) -> Value {
    let steps: Vec<Value> = doc["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            serde_json::json!([
                s["step"],
                s["loss"].to_string(),
                s["grad_norm"].to_string(),
                s["skipped"],
                s["loss_scale"]
            ])
        })
        .collect();
    let mut host = doc["host"].clone();
    if let Some(h) = host.as_object_mut() {
        h.remove("capacity_bytes");
    }
    serde_json::json!({
        "steps": steps,
        "ranks": doc["ranks"],
        "stages": doc["stages"],
        "peak_bytes": doc["peak_bytes"],
        "peak_breakdown": doc["peak_breakdown"],
        "flops_per_step": doc["flops_per_step"],
        "bytes_moved_per_step": doc["bytes_moved_per_step"],
        "tokens_per_step": doc["tokens_per_step"],
        "skipped_steps": doc["skipped_steps"],
        "loss_scale": doc["loss_scale"],
        "error": doc["error"],
        "host": host,
    })
}

/// The JSON of `memfit plan --format json`: exit 0 with a recommendation,
/// or exit 1 when no point fits (no recommendation), and nothing else.
pub fn plan_json(out: &Output) -> Value {
    let doc = json(out);
    match out.status.code() {
        Some(0) => assert!(doc["recommendation"].is_object(), "{doc}"),
        Some(1) => assert!(doc["recommendation"].is_null(), "{}", stderr(out)),
        other => panic!("plan exited {other:?}: {}", stderr(out)),
    }
    doc
}
