//! Throughput of one training step: `cargo run --release --example bench_step`.
//!
//! Defaults to the benchmark shape: the `gpt2` (124M) profile,
//! micro-batch 4, seq-len 64, 2 threads, synthetic tokens. Arguments:
//! `[model] [micro_batch] [seq_len] [threads] [steps]`.

use std::time::Instant;

use memfit::backend::cpu::CpuBackend;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::{Engine, TrainConfig};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.to_string());
    let model = load_model(&arg(0, "gpt2")).expect("model");
    let micro_batch: usize = arg(1, "4").parse().expect("micro_batch");
    let seq_len: usize = arg(2, "64").parse().expect("seq_len");
    let threads: usize = arg(3, "2").parse().expect("threads");
    let steps: usize = arg(4, "5").parse().expect("steps");
    let tc = TrainConfig {
        seq_len,
        micro_batch,
        ..TrainConfig::default()
    };
    let t0 = Instant::now();
    let mut engine =
        Engine::new(model.clone(), tc, CpuBackend::new(threads).unwrap(), None).expect("fits");
    let init = t0.elapsed().as_secs_f64();
    let mut data = DataSource::synthetic(model.vocab_size, 1);
    let tokens = (micro_batch * seq_len) as f64;
    let mut secs = Vec::new();
    for step in 0..=steps {
        let batch = data.next_batch(micro_batch, seq_len);
        engine.dev.meter.cost = Default::default();
        let t = Instant::now();
        let r = engine.step(&[batch]).expect("fits");
        let s = t.elapsed().as_secs_f64();
        println!(
            "step {step}: loss {:.4}, {:.0} ms, {:.1} tokens/s{}",
            r.loss.unwrap(),
            s * 1e3,
            tokens / s,
            if step == 0 {
                " (warm-up, not counted)"
            } else {
                ""
            }
        );
        if step > 0 {
            secs.push(s);
        }
    }
    println!(
        "\nlast step by op:  {:>22} {:>8} {:>9} {:>7}",
        "op", "calls", "ms", "GFLOP/s"
    );
    for (op, c) in &engine.dev.meter.cost.ops {
        let ms = c.ns as f64 / 1e6;
        println!(
            "{:>40} {:>8} {:>9.1} {:>7.1}",
            op,
            c.calls,
            ms,
            c.flops as f64 / c.ns.max(1) as f64
        );
    }
    secs.sort_by(f64::total_cmp);
    let median = secs[secs.len() / 2];
    let gflop = engine.dev.meter.cost.flops() as f64 / 1e9;
    println!(
        "{}: B={micro_batch} T={seq_len} threads={threads}: median {:.0} ms/step, {:.1} tokens/s, {:.1} GFLOP/step = {:.1} GFLOP/s (init {:.1} s)",
        model.name,
        median * 1e3,
        tokens / median,
        gflop,
        gflop / median,
        init
    );
}
