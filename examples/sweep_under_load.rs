//! Does a sweep name the same winner when the host's load changes under it?
//!
//! Runs one recipe's sweep `--runs` times (default 3) while a CPU hog in
//! this process switches busy threads on and off (each state held for a
//! seeded random 2-15 s, or `--hold MIN-MAX` seconds), so that the load
//! changes both within a trial and between trials, then prints each run's recommendation and its declared
//! tie, and checks issue 27's goal: every run names the same winner, or
//! each run's tie holds the other runs' winners.
//!
//! ```text
//! cargo build --release --bin memfit --example sweep_under_load
//! target/release/examples/sweep_under_load [--runs 3] [--recipe recipes/quickstart.yaml]
//!     [--hog-threads 2] [--hold 2-15] [--seed 1] [-- EXTRA SWEEP FLAGS, e.g. --paired-rounds 0]
//! ```
//!
//! It drives the built `target/release/memfit` (or `--memfit PATH`); exit 0
//! when the goal holds, 1 when it does not.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use memfit::report::sweep::SweepReport;

fn memfit_next_to_me() -> Option<PathBuf> {
    // target/release/examples/sweep_under_load -> target/release/memfit
    let exe = std::env::current_exe().ok()?;
    let p = exe.parent()?.parent()?.join("memfit");
    p.exists().then_some(p)
}

/// Busy threads that spin while `on` is set and sleep otherwise.
struct Hog {
    on: Arc<AtomicBool>,
    done: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    switcher: Option<std::thread::JoinHandle<usize>>,
}

impl Hog {
    fn start(n: usize, seed: u64, hold: (f64, f64)) -> Hog {
        let on = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let (on, done) = (on.clone(), done.clone());
                std::thread::spawn(move || {
                    let mut x = 0u64;
                    while !done.load(Ordering::Relaxed) {
                        if on.load(Ordering::Relaxed) {
                            for _ in 0..100_000 {
                                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                            }
                            std::hint::black_box(x);
                        } else {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    }
                })
            })
            .collect();
        let (flag, stop) = (on.clone(), done.clone());
        let switcher = std::thread::spawn(move || {
            let mut rng = memfit::rng::Rng::new(seed);
            let mut switches = 0;
            while !stop.load(Ordering::Relaxed) {
                flag.store(!flag.load(Ordering::Relaxed), Ordering::Relaxed);
                switches += 1;
                let hold = Duration::from_secs_f64(hold.0 + (hold.1 - hold.0) * rng.uniform());
                let until = Instant::now() + hold;
                while Instant::now() < until && !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            switches
        });
        Hog {
            on,
            done,
            threads,
            switcher: Some(switcher),
        }
    }

    fn stop(mut self) -> usize {
        self.done.store(true, Ordering::Relaxed);
        self.on.store(false, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.switcher.take().map_or(0, |s| s.join().unwrap_or(0))
    }
}

struct Run {
    winner: String,
    tied: Vec<String>,
}

fn main() {
    let mut runs = 3usize;
    let mut recipe = "recipes/quickstart.yaml".to_string();
    let mut hog_threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let mut seed = 1u64;
    let mut hold = (2.0, 15.0);
    let mut bin = memfit_next_to_me();
    let mut extra: Vec<String> = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--runs" => runs = value().parse().expect("--runs N"),
            "--recipe" => recipe = value(),
            "--hog-threads" => hog_threads = value().parse().expect("--hog-threads N"),
            "--seed" => seed = value().parse().expect("--seed N"),
            "--hold" => {
                let v = value();
                let (a, b) = v.split_once('-').expect("--hold MIN-MAX (seconds)");
                hold = (
                    a.parse().expect("--hold MIN"),
                    b.parse().expect("--hold MAX"),
                );
            }
            "--memfit" => bin = Some(PathBuf::from(value())),
            "--" => extra.extend(args.by_ref()),
            other => panic!("unknown argument {other}"),
        }
    }
    let bin = bin.expect("build memfit first (cargo build --release), or pass --memfit PATH");
    let root = std::env::temp_dir().join(format!("memfit-under-load-{}", std::process::id()));
    println!(
        "{runs} sweeps of {recipe} with {hog_threads} hog threads switching on and off every {}-{} s (seed {seed}); extra flags: {extra:?}",
        hold.0, hold.1
    );
    let mut results: Vec<Run> = Vec::new();
    for run in 0..runs {
        let out = root.join(format!("run{run}"));
        let hog = Hog::start(hog_threads, seed + run as u64, hold);
        let t = Instant::now();
        let o = Command::new(&bin)
            .args(["sweep", &recipe, "--format", "json", "--out"])
            .arg(&out)
            .args(&extra)
            .output()
            .expect("run memfit sweep");
        let switches = hog.stop();
        if !o.status.success() {
            eprintln!("{}", String::from_utf8_lossy(&o.stderr));
            panic!("sweep {run} failed: {}", o.status);
        }
        let report: SweepReport = serde_json::from_slice(&o.stdout).expect("report JSON on stdout");
        let Some(rec) = report.recommendation.as_ref() else {
            println!("run {run}: no recommendation");
            results.push(Run {
                winner: "-".into(),
                tied: Vec::new(),
            });
            continue;
        };
        let label = |i: usize| report.trials[i].point.label();
        let rk = rec.ranking.as_ref();
        println!(
            "run {run}: {:.0} s, {switches} hog switches, ranking {}{}",
            t.elapsed().as_secs_f64(),
            rk.map_or("(none)", |r| r.method.as_str()),
            rk.filter(|r| r.method == "paired").map_or(String::new(), |r| format!(
                " ({} contenders, {} finalists, {} rounds, widest ±{:.1}%, tie within {:.0}%{})",
                r.contenders.len(),
                r.paired.len(),
                r.rounds,
                r.widest_half_interval * 100.0,
                r.tie_within * 100.0,
                if r.noisy { ", TOO NOISY" } else { "" }
            ))
        );
        println!("  winner: #{} {}", rec.trial, label(rec.trial));
        for &i in &rec.tied {
            println!("  tied:   #{i} {}", label(i));
        }
        results.push(Run {
            winner: report.trials[rec.trial].id.clone(),
            tied: rec
                .tied
                .iter()
                .map(|&i| report.trials[i].id.clone())
                .collect(),
        });
    }
    let mut goal = true;
    for (a, ra) in results.iter().enumerate() {
        for (b, rb) in results.iter().enumerate() {
            if a != b && ra.winner != rb.winner && !ra.tied.contains(&rb.winner) {
                println!(
                    "run {a} neither names run {b}'s winner nor ties it ({})",
                    rb.winner
                );
                goal = false;
            }
        }
    }
    let distinct: std::collections::BTreeSet<&String> = results.iter().map(|r| &r.winner).collect();
    println!(
        "{}: {} distinct winner(s) in {runs} runs",
        if goal {
            "GOAL HOLDS (same winner, or each run's tie holds the others' winners)"
        } else {
            "GOAL FAILS"
        },
        distinct.len()
    );
    println!("reports: {}/run*/report.json", root.display());
    std::process::exit(if goal { 0 } else { 1 });
}
