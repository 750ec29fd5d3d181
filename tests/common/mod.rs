//! What the end-to-end tests share: running the memfit binary and reading
//! what it printed. Each test crate uses a part of it.
#![allow(dead_code)]

pub mod training;

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

/// Runs the memfit binary with `args` and waits for it.
pub fn memfit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(args)
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

/// A fresh directory for one test's files.
pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("memfit-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
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
