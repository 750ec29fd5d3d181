//! `memfit balance` speed: the exact split of llama-3.1-70b's 82 pipeline
//! layers into 16 stages (32 micro-batches, 1F1B, bf16, 8-bit AdamW, full
//! checkpointing, T=4096) for H100s on the meta backend, by memory and by
//! time (every stage within the 80 GB). Prints the figures docs/benchmarks.md records.
//!
//! `cargo run --release --example bench_balance`

use std::time::Instant;

use memfit::balance_cmd::{BalanceOptions, By, Target, balance};
use memfit::config::hardware::load_hardware;
use memfit::engine::{Checkpointing, Optimizer, Precision, Schedule, TrainConfig};

fn main() {
    let hw = load_hardware("h100-sxm-80gb").unwrap();
    for by in [By::Memory, By::Time] {
        let opts = BalanceOptions {
            model: "llama-3.1-70b".into(),
            train: TrainConfig {
                seq_len: 4096,
                micro_batch: 1,
                grad_accum: 32,
                precision: Precision::Bf16,
                optimizer: Optimizer::Adamw8bit,
                checkpointing: Checkpointing::Full,
                ranks: 16,
                pipeline_stages: 16,
                schedule: Schedule::OneFOneB,
                ..TrainConfig::default()
            },
            by,
            target: Target::Gpu(Box::new(hw.clone())),
            repeats: 1,
            verify: false,
        };
        let mut secs: Vec<f64> = (0..5)
            .map(|_| {
                let t = Instant::now();
                let r = balance(&opts).unwrap();
                std::hint::black_box(r);
                t.elapsed().as_secs_f64()
            })
            .collect();
        secs.sort_by(f64::total_cmp);
        let r = balance(&opts).unwrap();
        println!(
            "llama-3.1-70b, 16 stages, K=32, by {by:?}: median {:.3} s, min {:.3} s (of 5); optimal balance {:?}, largest stage peak {:.2} GiB (fits: {}), slowest stage {:.2} ms",
            secs[2],
            secs[0],
            r.optimal.balance,
            r.optimal.max_peak_bytes as f64 / (1u64 << 30) as f64,
            r.optimal.stages.iter().all(|s| s.fits),
            r.optimal.max_stage_secs * 1e3
        );
    }
}
