//! Planner speed: one llama-3.1-70b configuration, a grid of more than a
//! thousand points, and the three grids of the speed targets (2,880
//! hf-eager points, a 768-point tensor x pipeline grid on 64 GPUs, a
//! 16,384-GPU Llama 3 405B layout grid), each planned as `memfit plan`
//! plans a recipe file; then the process's peak RSS. Prints the figures
//! docs/benchmarks.md records.
//!
//! `cargo run --release --example bench_plan`

use std::time::Instant;

use memfit::config::hardware::load_hardware;
use memfit::config::profile::load_model;
use memfit::engine::{Attention, Checkpointing, Framework, Optimizer, Precision, Sharding};
use memfit::plan::{Grid, PlanRecipe, Verdict, expand, plan, predict};

// The allocator `memfit` itself runs on (see src/main.rs).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let model = load_model("llama-3.1-70b").unwrap();
    let hw = load_hardware("h100-sxm-80gb").unwrap();
    let single = PlanRecipe {
        model: model.name.clone(),
        hardware: hw.name.clone(),
        seq_len: 4096,
        global_batch: 64,
        grid: Grid {
            micro_batch: vec![1],
            precision: vec![Precision::Bf16],
            checkpointing: vec![Checkpointing::Full],
            attention: vec![Attention::Fused],
            optimizer: vec![Optimizer::Adamw],
            sharding: vec![Sharding::Zero3],
            gpus: vec![8],
            // What `memfit plan` plans by default.
            framework: vec![Framework::HfEager],
            finetune: vec![memfit::engine::Finetune::Full],
            offload: vec![memfit::engine::Offload::None],
            pipeline_stages: vec![1],
            virtual_stages: vec![1],
            shard_group: vec![None],
            tensor_parallel: vec![1],
            hpz_group: vec![None],
            sequence_parallel: vec![false],
            loss: vec![Default::default()],
            capacity_factor: vec![Default::default()],
            offload_activations: vec![false],
            expert_parallel: vec![1],
            tp_comm_overlap: vec![false],
            overlap_param_gather: vec![false],
        },
        headroom: 0.05,
        cost: None,
        host_usd_per_hour: None,
        allow_numerics_change: true,
        device: None,
        knobs: Default::default(),
        network: None,
        attention_kernel: None,
    };
    let point = expand(&single)[0];
    let (cap, overhead) = single.capacity(&hw);
    let rates = memfit::plan::Rates::gpu(&hw, hw.usd_per_hour);
    let target = memfit::plan::PlanTarget {
        recipe: &single,
        model: &model,
        rates: &rates,
        capacity: cap,
        overhead,
    };
    // Warm up, then the median of 21 single-point plans.
    predict(&target, &point);
    let mut ms: Vec<f64> = (0..21)
        .map(|_| {
            let t = Instant::now();
            let p = predict(&target, &point);
            std::hint::black_box(p);
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    println!(
        "llama-3.1-70b, one config (zero3 x8, bf16, full checkpointing, T=4096): median {:.2} ms, min {:.2} ms",
        ms[10], ms[0]
    );

    let grid = PlanRecipe {
        grid: Grid {
            micro_batch: vec![1, 2, 4, 8],
            precision: vec![Precision::Fp32, Precision::Bf16, Precision::Fp16],
            checkpointing: vec![Checkpointing::None, Checkpointing::Full],
            attention: vec![Attention::Eager, Attention::Fused],
            optimizer: vec![Optimizer::Adamw, Optimizer::Adamw8bit, Optimizer::Sgd],
            sharding: vec![
                Sharding::Ddp,
                Sharding::Zero1,
                Sharding::Zero2,
                Sharding::Zero3,
            ],
            gpus: vec![8, 16],
            framework: vec![Framework::HfEager],
            finetune: vec![memfit::engine::Finetune::Full],
            offload: vec![memfit::engine::Offload::None],
            pipeline_stages: vec![1],
            virtual_stages: vec![1],
            shard_group: vec![None],
            tensor_parallel: vec![1],
            hpz_group: vec![None],
            sequence_parallel: vec![false],
            loss: vec![Default::default()],
            capacity_factor: vec![Default::default()],
            offload_activations: vec![false],
            expert_parallel: vec![1],
            tp_comm_overlap: vec![false],
            overlap_param_gather: vec![false],
        },
        ..single
    };
    let t = Instant::now();
    let p = plan(&grid, &model, &hw);
    let secs = t.elapsed().as_secs_f64();
    let fits = p
        .points
        .iter()
        .filter(|x| x.verdict == Verdict::Fits)
        .count();
    println!(
        "llama-3.1-70b grid: {} points in {:.2} s on {} threads ({:.2} ms per point), {} fit",
        p.points.len(),
        secs,
        rayon::current_num_threads(),
        secs * 1e3 / p.points.len() as f64,
        fits
    );

    for (name, yaml) in TARGETS {
        let path = std::env::temp_dir().join(format!("memfit-bench-{}.yaml", std::process::id()));
        std::fs::write(&path, yaml).unwrap();
        // Median of three plans of the whole file.
        let mut runs: Vec<(f64, usize, usize)> = (0..3)
            .map(|_| {
                let t = Instant::now();
                let p = memfit::plan::plan_file(&path).unwrap();
                let secs = t.elapsed().as_secs_f64();
                let invalid = (p.points.iter())
                    .filter(|x| matches!(x.verdict, Verdict::Invalid { .. }))
                    .count();
                (secs, p.points.len(), invalid)
            })
            .collect();
        let _ = std::fs::remove_file(&path);
        runs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (secs, points, invalid) = runs[1];
        println!(
            "{name}: {points} points ({invalid} invalid) in {secs:.2} s (median of 3, {} threads)",
            rayon::current_num_threads()
        );
    }
    // The high-water mark of this process's resident memory.
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    if let Some(line) = status.lines().find(|l| l.starts_with("VmHWM:")) {
        println!("peak RSS: {}", line.trim_start_matches("VmHWM:").trim());
    }
}

/// The grids of the README's speed targets, as recipe files.
const TARGETS: [(&str, &str); 3] = [
    (
        "llama-3.1-70b hf-eager grid",
        "model: llama-3.1-70b
hardware: h100-sxm-80gb
seq_len: 4096
global_batch: 512
grid:
  micro_batch: [1, 2, 4, 8]
  precision: [fp32, bf16, fp16]
  checkpointing: [none, full]
  attention: [eager, fused]
  optimizer: [adamw, adamw8bit, adafactor]
  sharding: [ddp, zero1, zero2, zero3]
  gpus: [8, 16, 32, 64, 128]
",
    ),
    (
        "llama-3.1-70b tensor x pipeline grid on 64 GPUs",
        "model: llama-3.1-70b
hardware: h100-sxm-80gb
network: ib-ndr-400
seq_len: 4096
global_batch: 256
grid:
  framework: [memfit]
  micro_batch: [1, 2, 4]
  checkpointing: [none, full]
  optimizer: [adamw, adamw8bit]
  sharding: [zero1, zero3]
  gpus: [64]
  tensor_parallel: [1, 2, 4, 8]
  pipeline_stages: [1, 2, 4, 8]
  sequence_parallel: [false, true]
",
    ),
    (
        "llama-3.1-405b layouts on 4,096-16,384 GPUs",
        "model: llama-3.1-405b
hardware: h100-sxm-80gb
network: ib-ndr-400
seq_len: 8192
global_batch: 2048
grid:
  framework: [memfit]
  micro_batch: [1, 2, 4]
  checkpointing: [none, full]
  sharding: [zero1, zero3]
  gpus: [4096, 8192, 16384]
  tensor_parallel: [4, 8]
  pipeline_stages: [8, 16]
  sequence_parallel: [false, true]
",
    ),
];
