//! Is the quickstart's recommendation stable on a busy machine?
//!
//! Runs the quickstart sweep `N` times (default 3) into fresh directories
//! while a second sweep of the same recipe loads the machine, then prints
//! each run's recommendation and its declared tie, and whether one
//! configuration is the recommendation or inside the declared tie in every
//! run (docs/benchmarks.md's target: 3 of 3).
//!
//! `cargo build --release && cargo run --release --example bench_stability [N] [recipe]`
//! (it drives the built `target/release/memfit`).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Command, Stdio};

fn memfit() -> PathBuf {
    // target/release/examples/bench_stability -> target/release/memfit
    let exe = std::env::current_exe().expect("own path");
    exe.parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("memfit"))
        .filter(|p| p.exists())
        .expect("build memfit first: cargo build --release")
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runs: usize = args.first().map_or(3, |a| a.parse().expect("N"));
    let recipe = args
        .get(1)
        .cloned()
        .unwrap_or_else(|| "recipes/quickstart.yaml".into());
    let bin = memfit();
    let root = std::env::temp_dir().join(format!("memfit-stability-{}", std::process::id()));
    let mut sets: Vec<(String, BTreeSet<String>)> = Vec::new();
    for run in 0..runs {
        // The load: another sweep of the same grid, started just before.
        let load_dir = root.join(format!("load{run}"));
        let mut load = Command::new(&bin)
            .args(["sweep", &recipe, "--out"])
            .arg(&load_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the load sweep");
        let out = root.join(format!("run{run}"));
        let t = std::time::Instant::now();
        let status = Command::new(&bin)
            .args(["sweep", &recipe, "--format", "json", "--out"])
            .arg(&out)
            .stderr(Stdio::null())
            .output()
            .expect("run the sweep");
        let _ = load.kill();
        let _ = load.wait();
        assert!(status.status.success(), "sweep {run} failed");
        let report: serde_json::Value =
            serde_json::from_slice(&status.stdout).expect("report json");
        let trials = report["trials"].as_array().expect("trials");
        let rec = &report["recommendation"];
        let id = |i: &serde_json::Value| {
            trials[i.as_u64().expect("index") as usize]["id"]
                .as_str()
                .expect("id")
                .to_string()
        };
        let winner = id(&rec["trial"]);
        let mut set: BTreeSet<String> = rec["tied"]
            .as_array()
            .expect("tied")
            .iter()
            .map(id)
            .collect();
        set.insert(winner.clone());
        let m = &trials[rec["trial"].as_u64().unwrap() as usize]["measured"];
        println!(
            "run {run}: {:.0} s, recommended {winner} at {:.0} tokens/s ({:.0}-{:.0}), tied with {} others",
            t.elapsed().as_secs_f64(),
            m["tokens_per_s"].as_f64().unwrap_or(0.0),
            m["tokens_per_s_ci"][0].as_f64().unwrap_or(0.0),
            m["tokens_per_s_ci"][1].as_f64().unwrap_or(0.0),
            set.len() - 1
        );
        for other in set.iter().filter(|s| **s != winner) {
            println!("         tied: {other}");
        }
        sets.push((winner, set));
    }
    // A configuration that every run recommends or declares tied with its
    // recommendation, preferring one that some run recommended.
    let common: BTreeSet<String> = sets
        .iter()
        .map(|(_, s)| s.clone())
        .reduce(|a, b| a.intersection(&b).cloned().collect())
        .unwrap_or_default();
    let stable = sets
        .iter()
        .map(|(w, _)| w)
        .find(|w| common.contains(*w))
        .or(common.iter().next());
    match stable {
        Some(c) => println!(
            "stable: {c} is the recommendation or in its declared tie in {runs} of {runs} runs ({} distinct winners)",
            sets.iter().map(|(w, _)| w).collect::<BTreeSet<_>>().len()
        ),
        None => println!("NOT stable: no configuration is recommended or tied in all {runs} runs"),
    }
    let _ = std::fs::remove_dir_all(&root);
}
