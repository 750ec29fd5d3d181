//! `memfit balance`: the optimal split is the true optimum of the engine's
//! own stage peaks (checked against every split), never worse than the
//! uniform split or fairscale's heuristic, strictly better where the
//! embedding or the head is heavy, and what it predicts is what cpu measures.

use memfit::backend::meta::MetaBackend;
use std::collections::HashMap;

use crate::common::{json, memfit, stderr};

use memfit::balance_cmd::{BalanceOptions, By, Target, balance, blocks_of, stage_peak};
use memfit::config::hardware::load_hardware;
use memfit::config::profile::load_model;
use memfit::engine::{Precision, Schedule, TrainConfig};

fn options(
    model: &str,
    stages: usize,
    k: usize,
    schedule: Schedule,
    target: Target,
) -> BalanceOptions {
    BalanceOptions {
        model: model.into(),
        train: TrainConfig {
            seq_len: 32,
            micro_batch: 2,
            grad_accum: k,
            ranks: stages,
            pipeline_stages: stages,
            schedule,
            ..TrainConfig::default()
        },
        by: By::Memory,
        target,
        repeats: 1,
        verify: false,
    }
}

/// Every split of `n` layers into `stages` non-empty runs.
fn splits(n: usize, stages: usize) -> Vec<Vec<usize>> {
    if stages == 1 {
        return vec![vec![0, n]];
    }
    let mut out = Vec::new();
    for first in 1..=n - (stages - 1) {
        for rest in splits(n - first, stages - 1) {
            let mut b = vec![0, first];
            b.extend(rest[1..].iter().map(|x| x + first));
            out.push(b);
        }
    }
    out
}

#[test]
fn the_optimal_split_is_the_best_of_every_split() {
    for (model, target) in [
        ("gpt2-tiny", Target::Cpu { limit: None }),
        (
            "gpt2",
            Target::Gpu(Box::new(load_hardware("h100-sxm-80gb").unwrap())),
        ),
    ] {
        let m = load_model(model).unwrap();
        let n = m.n_layer + 2;
        for stages in [2, 3, 4] {
            for schedule in [Schedule::Gpipe, Schedule::OneFOneB] {
                let mut o = options(model, stages, 6, schedule, target.clone());
                if model == "gpt2" {
                    o.train.seq_len = 256;
                    o.train.precision = Precision::Bf16;
                }
                let r = balance(&o).unwrap();
                let mut memo = HashMap::new();
                let meta = match target {
                    Target::Cpu { .. } => MetaBackend::emulating_cpu(),
                    _ => MetaBackend::emulating_cuda(),
                };
                let mut cost = |s: usize, i: usize, j: usize| {
                    *memo.entry((s, i, j)).or_insert_with(|| {
                        stage_peak(&m, &o.train, s, blocks_of(i, j, n), &meta).total
                    })
                };
                let best = splits(n, stages)
                    .into_iter()
                    .map(|b| (0..stages).map(|s| cost(s, b[s], b[s + 1])).max().unwrap())
                    .min()
                    .unwrap();
                println!(
                    "{model} S={stages} {schedule:?}: optimal {:?} peak {} (brute force {best}), uniform {:?} {}, fairscale {:?} {:?}",
                    r.optimal.balance,
                    r.optimal.max_peak_bytes,
                    r.uniform.balance,
                    r.uniform.max_peak_bytes,
                    r.fairscale.as_ref().map(|f| f.balance.clone()),
                    r.fairscale.as_ref().map(|f| f.max_peak_bytes)
                );
                assert_eq!(
                    r.optimal.max_peak_bytes, best,
                    "{model} S={stages} {schedule:?}"
                );
                assert!(r.optimal.max_peak_bytes <= r.uniform.max_peak_bytes);
                if let Some(f) = &r.fairscale {
                    assert!(r.optimal.max_peak_bytes <= f.max_peak_bytes);
                }
            }
        }
    }
}

#[test]
fn a_heavy_embedding_and_head_make_the_uniform_split_strictly_worse() {
    // gpt2's 50257 x 768 embedding (and the head's tied copy with its
    // optimizer state) outweigh several blocks.
    let o = BalanceOptions {
        train: TrainConfig {
            seq_len: 1024,
            micro_batch: 4,
            precision: Precision::Bf16,
            ..options(
                "gpt2",
                4,
                8,
                Schedule::OneFOneB,
                Target::Cpu { limit: None },
            )
            .train
        },
        ..options(
            "gpt2",
            4,
            8,
            Schedule::OneFOneB,
            Target::Gpu(Box::new(load_hardware("h100-sxm-80gb").unwrap())),
        )
    };
    let r = balance(&o).unwrap();
    println!(
        "gpt2 S=4 K=8 1f1b bf16 4x1024: optimal {:?} {} B, uniform {:?} {} B ({:.1}% lower), fairscale {:?} {} B ({:.1}% lower)",
        r.optimal.balance,
        r.optimal.max_peak_bytes,
        r.uniform.balance,
        r.uniform.max_peak_bytes,
        r.improvement_vs_uniform_pct,
        r.fairscale.as_ref().unwrap().balance,
        r.fairscale.as_ref().unwrap().max_peak_bytes,
        r.improvement_vs_fairscale_pct.unwrap()
    );
    assert!(r.optimal.max_peak_bytes < r.uniform.max_peak_bytes);
    assert!(r.improvement_vs_uniform_pct > 10.0);
    // The first stage, which holds the most micro-batches and the embedding,
    // gets fewer blocks than the uniform split gives it.
    assert!(
        r.optimal.balance[0] < r.uniform.balance[0],
        "{:?}",
        r.optimal.balance
    );
}

#[test]
fn by_time_balances_the_slowest_stage_within_the_capacity() {
    let hw = load_hardware("h100-sxm-80gb").unwrap();
    let mut o = options("gpt2", 4, 8, Schedule::OneFOneB, Target::Gpu(Box::new(hw)));
    o.train.seq_len = 1024;
    o.by = By::Time;
    let r = balance(&o).unwrap();
    assert!(r.optimal.max_stage_secs <= r.uniform.max_stage_secs);
    assert!(r.optimal.max_stage_secs <= r.fairscale.unwrap().max_stage_secs);
    assert!(r.optimal.stages.iter().all(|s| s.fits));
    // Stage times add up to the model's.
    let total: f64 = r.layers.iter().map(|l| l.secs).sum();
    let staged: f64 = r
        .optimal
        .stages
        .iter()
        .map(|s| s.secs_per_micro_batch)
        .sum();
    assert!((total - staged).abs() <= 1e-9 * total);
}

#[test]
fn verify_measures_what_was_predicted_and_json_exports_the_split() {
    for stages in ["2", "4"] {
        let out = memfit(&[
            "balance",
            "--model",
            "gpt2-tiny",
            "--stages",
            stages,
            "--microbatches",
            "6",
            "--micro-batch",
            "2",
            "--seq-len",
            "32",
            "--verify",
            "--format",
            "json",
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        let doc = json(&out);
        let verify = doc["verify"].as_array().unwrap();
        assert_eq!(verify.len(), stages.parse::<usize>().unwrap());
        for v in verify {
            assert_eq!(v["predicted_bytes"], v["measured_bytes"], "{v}");
        }
        let balance: Vec<u64> = doc["optimal"]["balance"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(balance.iter().sum::<u64>(), 4, "embedding, 2 blocks, head");
        assert!(doc["optimal"]["partition"].as_str().unwrap().contains(':'));
    }
}

#[test]
fn bad_balance_input_is_a_clear_error() {
    for (args, flag) in [
        (vec!["--stages", "5", "--microbatches", "2"], "--stages"),
        (
            vec!["--stages", "2", "--microbatches", "0"],
            "--microbatches",
        ),
        (vec!["--stages", "1", "--microbatches", "2"], "--stages"),
        (
            vec!["--stages", "2", "--microbatches", "2", "--repeats", "0"],
            "--repeats",
        ),
        (
            vec![
                "--stages",
                "2",
                "--microbatches",
                "2",
                "--device",
                "meta:nope",
            ],
            "nope",
        ),
        (
            vec!["--stages", "2", "--microbatches", "2", "--device", "gpu"],
            "--device",
        ),
    ] {
        let out = memfit(&[&["balance", "--model", "gpt2-tiny"], &args[..]].concat());
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(flag), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn a_capacity_no_split_fits_exits_3_with_the_best_split_printed() {
    for by in ["memory", "time"] {
        let out = memfit(&[
            "balance",
            "--model",
            "gpt2-tiny",
            "--stages",
            "2",
            "--microbatches",
            "4",
            "--device",
            "cpu:limit=1MiB",
            "--by",
            by,
            "--repeats",
            "1",
            "--format",
            "json",
        ]);
        assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
        let doc = json(&out);
        assert_eq!(doc["capacity_bytes"], 1 << 20);
        assert!(
            doc["optimal"]["stages"]
                .as_array()
                .unwrap()
                .iter()
                .any(|s| s["fits"] == false)
        );
    }
}

/// balance takes `memfit run`'s knobs: one it cannot honour is refused by
/// its flag, one that says what balance does anyway passes, run's
/// `--pipeline-stages` spells `--stages`, and the micro-batch stays 1
/// unless given.
#[test]
fn run_knobs_balance_cannot_honour_are_refused_by_flag() {
    let base = [
        "balance",
        "--model",
        "gpt2-tiny",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--device",
        "meta:h100-sxm-80gb",
        "--format",
        "json",
    ];
    let refused = [
        ("--seed", "7"),
        ("--lr", "5"),
        ("--weight-decay", "0"),
        ("--beta2", "0.95"),
        ("--momentum", "0.5"),
        ("--grad-clip", "0"),
        ("--steps", "3"),
        ("--data", "README.md"),
        ("--threads", "2"),
        ("--partition", "0:1,1:2"),
        ("--ranks", "4"),
        ("--sharding", "zero1"),
        ("--bucket-view", "true"),
        ("--offload", "optimizer"),
        ("--host-memory", "1GiB"),
        ("--shard-group", "2"),
        ("--hpz-group", "2"),
        ("--tensor-parallel", "2"),
        ("--sequence-parallel", "true"),
        ("--expert-parallel", "2"),
        ("--virtual-stages", "2"),
    ];
    assert_eq!(refused.len(), memfit::balance_cmd::REFUSED.len());
    for (flag, value) in refused {
        let out = memfit(&[&base[..], &[flag, value]].concat());
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{flag}: {err}");
        assert!(
            err.contains(&format!("{flag}: `memfit balance` cannot honour it")),
            "{flag}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    let plain = memfit(&base);
    assert!(plain.status.success(), "{}", stderr(&plain));
    let plain = json(&plain);
    assert_eq!(plain["micro_batch"], 1);
    let args = [
        "--ranks",
        "2",
        "--sharding",
        "none",
        "--tensor-parallel",
        "1",
        "--offload",
        "none",
        "--shard-group",
        "0",
        "--hpz-group",
        "0",
        "--expert-parallel",
        "1",
        "--bucket-view",
        "false",
        "--sequence-parallel",
        "false",
        "--virtual-stages",
        "1",
    ];
    let same = memfit(&[&base[..], &args].concat());
    assert!(same.status.success(), "{}", stderr(&same));
    assert_eq!(json(&same)["optimal"], plain["optimal"]);
    let spelled = [&base[..3], &["--pipeline-stages"], &base[4..]].concat();
    let out = memfit(
        &[
            &spelled[..],
            &["--micro-batch", "2", "--attention", "fused"],
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let doc = json(&out);
    assert_eq!(
        (doc["stages"].as_u64(), doc["micro_batch"].as_u64()),
        (Some(2), Some(2))
    );
    assert_eq!(doc["config"]["attention"], "fused");
}
