//! Prints memfit `hf-eager` against PyTorch's MemTracker for every
//! configuration in tests/reference/hf_memory.json (docs/hf-eager.md's table):
//! `cargo run --release --example hf_reference`. With arguments, only the
//! configurations whose names contain one of them, each category of each.

use std::path::Path;

use memfit::memory::Category;
use memfit::reference;

fn main() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/hf_memory.json");
    let fx = match reference::load(&path) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "PyTorch {} + transformers {}, fake cpu tensors; MiB; error = memfit / PyTorch - 1",
        fx.versions.torch, fx.versions.transformers
    );
    println!("| config | PyTorch total | memfit hf-eager | error | worst category |");
    println!("|---|---:|---:|---:|---|");
    let only: Vec<String> = std::env::args().skip(1).collect();
    let mut worst_total: f64 = 0.0;
    for c in &fx.configs {
        if !only.is_empty() && !only.iter().any(|o| c.name.contains(o.as_str())) {
            continue;
        }
        let m = match reference::plan(c) {
            Ok(m) => m,
            Err(e) => {
                println!("| {} | error: {e} |", c.name);
                continue;
            }
        };
        let (total, cats) = reference::compared(c);
        let err = reference::error(m.total, c.peak_bytes.total);
        if total {
            worst_total = worst_total.max(err.abs());
        }
        let (cat, cerr) = cats
            .iter()
            .map(|&k| (k, reference::error(m.get(k), c.peak_bytes.get(k))))
            .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
            .unwrap_or((Category::Parameters, 0.0));
        let err = match total {
            true => format!("{:+.2}%", 100.0 * err),
            false => "(not compared)".to_string(),
        };
        println!(
            "| {} | {:.1} | {:.1} | {err} | {} {:+.2}% |",
            c.name,
            mib(c.peak_bytes.total),
            mib(m.total),
            cat.name(),
            100.0 * cerr
        );
        if !only.is_empty() {
            for &k in Category::ALL.iter() {
                let (a, b) = (mib(c.peak_bytes.get(k)), mib(m.get(k)));
                if a > 0.0 || b > 0.0 {
                    println!("|   {} | {a:.1} | {b:.1} | {:+.1} |", k.name(), b - a);
                }
            }
        }
    }
    println!("largest total error: {:.2}%", 100.0 * worst_total);
}
