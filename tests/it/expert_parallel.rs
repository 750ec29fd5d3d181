//! Expert parallelism: ranks that split a mixture's experts train as data
//! parallelism does (the same losses and gradient norms, up to the order
//! of the sums), meta predicts every rank's bytes with a capacity factor,
//! bounds them dropless, and what it does not combine with is refused.

use crate::common::memfit;
use memfit::backend::cpu::CpuBackend;
use memfit::backend::meta::MetaBackend;
use memfit::config::ModelConfig;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::cluster::{Cluster, cpu_links, meta_links};
use memfit::engine::expert::ExpertLoad;
use memfit::engine::{Sharding, TrainConfig};
use memfit::memory::Tracker;

fn timeline(t: &Tracker) -> Vec<(String, &'static str, i64)> {
    t.timeline()
        .iter()
        .map(|e| (e.phase.to_string(), e.category.name(), e.bytes))
        .collect()
}

fn config(ranks: usize, stages: usize, sharding: Sharding, ep: usize) -> TrainConfig {
    TrainConfig {
        seq_len: 16,
        micro_batch: 2,
        grad_accum: 2,
        ranks,
        pipeline_stages: stages,
        sharding,
        expert_parallel: ep,
        ..TrainConfig::default()
    }
}

/// Every routed block: moe-tiny with its dense first block routed too.
fn model() -> ModelConfig {
    let mut m = load_model("moe-tiny").unwrap();
    m.moe.as_mut().unwrap().first_dense = 0;
    m
}

fn cpu_cluster(model: &ModelConfig, tc: &TrainConfig) -> Cluster<CpuBackend> {
    let cpus = (0..tc.ranks).map(|_| CpuBackend::new(1).unwrap()).collect();
    Cluster::new(model, tc, cpus, cpu_links(model, tc), None).unwrap()
}

fn meta_cluster(model: &ModelConfig, tc: &TrainConfig, load: ExpertLoad) -> Cluster<MetaBackend> {
    let metas = (0..tc.ranks)
        .map(|_| MetaBackend::emulating_cpu())
        .collect();
    let mut c = Cluster::new(model, tc, metas, meta_links(model, tc), None).unwrap();
    for r in &mut c.ranks {
        r.assume_expert_load(load);
    }
    c.step_from(tc.grad_accum, || unreachable!("meta reads no data"))
        .unwrap();
    c
}

/// (loss, grad norm) of each of `steps` steps on cpu.
fn train(c: &mut Cluster<CpuBackend>, tc: &TrainConfig, steps: usize) -> Vec<(f32, f32)> {
    let mut data = DataSource::synthetic(c.ranks[0].model.vocab_size, 5);
    (0..steps)
        .map(|_| {
            let r = c
                .step_from(tc.grad_accum, || data.next_batch(2, 16))
                .unwrap();
            assert!(!r.skipped);
            (r.loss.unwrap(), r.grad_norm.unwrap())
        })
        .collect()
}

/// `got` trains as `want` does: losses within 1e-5 and gradient norms
/// within 1e-4 relative, step by step, and it learns.
fn same_training(got: &[(f32, f32)], want: &[(f32, f32)], what: &str) {
    for ((l, g), (wl, wg)) in got.iter().zip(want) {
        assert!(
            (l - wl).abs() <= 1e-5 * wl.abs(),
            "{what}: loss {l} vs {wl}"
        );
        assert!(
            (g - wg).abs() <= 1e-4 * wg.abs(),
            "{what}: norm {g} vs {wg}"
        );
    }
    assert!(got[2].0 < got[0].0, "{what}: it learns");
}

/// Splitting the experts changes where they run, not what they compute:
/// every sharding level trains as it does without expert parallelism.
#[test]
fn experts_split_over_ranks_train_as_data_parallelism_does() {
    let model = model();
    for sharding in [
        Sharding::Ddp,
        Sharding::Zero1,
        Sharding::Zero2,
        Sharding::Zero3,
    ] {
        for cf in [None, Some(1.25)] {
            let base = TrainConfig {
                capacity_factor: cf,
                ..config(4, 1, sharding, 1)
            };
            let want = train(&mut cpu_cluster(&model, &base), &base, 3);
            for ep in [2, 4] {
                let tc = TrainConfig {
                    expert_parallel: ep,
                    ..base.clone()
                };
                let mut c = cpu_cluster(&model, &tc);
                let got = train(&mut c, &tc, 3);
                same_training(&got, &want, &format!("{sharding:?} cf {cf:?} ep {ep}"));
                for (i, dev) in c.release().into_iter().enumerate() {
                    assert_eq!(dev.tracker.live().total(), 0, "rank {i} leaked");
                }
            }
        }
    }
}

/// With a capacity factor every rank exchanges a fixed number of rows,
/// so meta predicts every rank's peak, timeline and traffic.
#[test]
fn meta_matches_cpu_on_every_rank_with_a_capacity() {
    let model = model();
    for (ranks, stages, sharding, ep) in [
        (4, 1, Sharding::Ddp, 2),
        (4, 1, Sharding::Zero1, 4),
        (4, 1, Sharding::Zero2, 2),
        (4, 1, Sharding::Zero3, 2),
        (4, 2, Sharding::Zero2, 2),
    ] {
        let tc = TrainConfig {
            capacity_factor: Some(1.25),
            ..config(ranks, stages, sharding, ep)
        };
        let mut cpu = cpu_cluster(&model, &tc);
        train(&mut cpu, &tc, 1);
        let meta = meta_cluster(&model, &tc, ExpertLoad::Worst);
        let what = format!("{ranks} ranks, {stages} stages, {sharding:?}, ep {ep}");
        for (c, m) in cpu.ranks.iter().zip(&meta.ranks) {
            let (cp, mp) = (c.dev.tracker.peak_bytes(), m.dev.tracker.peak_bytes());
            assert_eq!(cp, mp, "{what}");
            assert_eq!(timeline(&c.dev.tracker), timeline(&m.dev.tracker), "{what}");
            assert_eq!(
                (c.dev.meter.sent, c.dev.meter.received),
                (m.dev.meter.sent, m.dev.meter.received),
                "{what}"
            );
        }
    }
}

/// Dropless, what a rank receives depends on everyone's routing: each
/// cpu rank's peak lies at or under meta's worst case, which is above its
/// balanced case by the extra rows the experts would receive.
#[test]
fn dropless_peaks_lie_under_the_worst_routing() {
    let model = model();
    let tc = config(4, 1, Sharding::Zero2, 4);
    let mut cpu = cpu_cluster(&model, &tc);
    train(&mut cpu, &tc, 2);
    let balanced = meta_cluster(&model, &tc, ExpertLoad::Balanced);
    let worst = meta_cluster(&model, &tc, ExpertLoad::Worst);
    let peak = |e: &memfit::engine::Engine<MetaBackend>| e.dev.tracker.peak_bytes();
    for (r, c) in cpu.ranks.iter().enumerate() {
        let (b, w) = (peak(&balanced.ranks[r]), peak(&worst.ranks[r]));
        let got = c.dev.tracker.peak_bytes();
        assert!(b.total < w.total, "rank {r}: {} vs {}", b.total, w.total);
        assert!(
            got.total <= w.total,
            "rank {r}: {} over {}",
            got.total,
            w.total
        );
        assert!(got.activations <= w.activations, "rank {r}");
        // What does not depend on routing is the same in all three.
        for (x, y) in [(got, b), (w, b)] {
            assert_eq!(
                (x.parameters, x.optimizer),
                (y.parameters, y.optimizer),
                "rank {r}"
            );
        }
    }
}

/// The experts' weights are split: each rank holds `E/P` of every stacked
/// expert tensor, and under zero3 a shard of those over its replicas.
#[test]
fn each_rank_holds_its_share_of_the_experts() {
    let model = model();
    let (e, c, i) = (4, model.d_model, model.moe.as_ref().unwrap().d_expert);
    for (sharding, ep, want) in [
        (Sharding::Ddp, 2, 2 * 3 * c * i),
        (Sharding::Ddp, 4, 3 * c * i),
        // zero3 over the 2 ranks that hold the same 2 experts.
        (Sharding::Zero3, 2, 3 * c * i),
    ] {
        let tc = config(4, 1, sharding, ep);
        let meta = meta_cluster(&model, &tc, ExpertLoad::Balanced);
        let r = &meta.ranks[0];
        let (_, idx) = model.param_layout();
        let m = idx.blocks[0].moe.unwrap();
        let held: usize = [m.up, m.down]
            .iter()
            .map(|&t| match r.shard_extent(t, 0) {
                Some((s, _)) if sharding == Sharding::Zero3 => s,
                _ => r.param_specs()[t].numel(),
            })
            .sum();
        assert_eq!(held, want, "{sharding:?} ep {ep} (of {} experts)", e);
    }
}

#[test]
fn what_expert_parallelism_does_not_combine_with_is_refused_by_name() {
    let run = |args: &[&str]| {
        let mut v = vec!["run", "--device", "meta", "--steps", "1"];
        v.extend(args);
        memfit(&v)
    };
    for (args, flag, says) in [
        (
            &[
                "--model",
                "llama-tiny",
                "--ranks",
                "2",
                "--sharding",
                "ddp",
                "--expert-parallel",
                "2",
            ][..],
            "--expert-parallel",
            "has no experts",
        ),
        (
            &[
                "--model",
                "moe-tiny",
                "--ranks",
                "3",
                "--sharding",
                "ddp",
                "--expert-parallel",
                "2",
            ],
            "--expert-parallel",
            "3 data-parallel ranks",
        ),
        (
            &[
                "--model",
                "moe-tiny",
                "--ranks",
                "3",
                "--sharding",
                "ddp",
                "--expert-parallel",
                "3",
            ],
            "--expert-parallel",
            "4 experts",
        ),
        (
            &[
                "--model",
                "moe-tiny",
                "--ranks",
                "4",
                "--sharding",
                "zero3",
                "--expert-parallel",
                "2",
                "--hpz-group",
                "2",
            ],
            "--hpz-group",
            "expert-parallel",
        ),
        (
            &[
                "--model",
                "moe-tiny",
                "--ranks",
                "4",
                "--sharding",
                "zero2",
                "--expert-parallel",
                "2",
                "--offload",
                "optimizer",
            ],
            "--offload",
            "expert-parallel",
        ),
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag) && err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// `grid.expert_parallel` plans what `memfit run --expert-parallel` gives
/// on meta; dropless points carry the worst routing's peak beside their
/// balanced one, and a grid that splits experts plans memfit's engine.
#[test]
fn the_expert_parallel_axis_plans_what_run_gives() {
    let dir = crate::common::scratch("plan-expert-parallel");
    let recipe = dir.join("ep.yaml");
    std::fs::write(
        &recipe,
        "model: moe-tiny\nhardware: h100-sxm-80gb\nseq_len: 32\nglobal_batch: 8\ngrid:\n  micro_batch: [2]\n  precision: [bf16]\n  sharding: [zero2]\n  gpus: [4]\n  expert_parallel: [1, 2, 4]\n  capacity_factor: [null, 1.25]\n",
    )
    .unwrap();
    let path = recipe.to_str().unwrap();
    let doc = crate::common::plan_json(&memfit(&["plan", path, "--format", "json"]));
    let points = doc["points"].as_array().unwrap();
    assert_eq!(points.len(), 6);
    for p in points {
        assert_eq!(p["status"], "fits", "{p}");
        assert_eq!(p["point"]["framework"], "memfit", "{p}");
        let ep = p["point"]
            .get("expert_parallel")
            .map_or(1, |e| e.as_u64().unwrap());
        let cf = p["point"].get("capacity_factor").map(|f| f.to_string());
        let ep_s = ep.to_string();
        let mut args = vec![
            "run",
            "--model",
            "moe-tiny",
            "--device",
            "meta:h100-sxm-80gb",
            "--seq-len",
            "32",
            "--micro-batch",
            "2",
            "--precision",
            "bf16",
            "--attention",
            "fused",
            "--ranks",
            "4",
            "--sharding",
            "zero2",
            "--expert-parallel",
            &ep_s,
            "--format",
            "json",
        ];
        if let Some(f) = &cf {
            args.extend(["--capacity-factor", f]);
        }
        let run = crate::common::ok_json(&args, &[]);
        assert_eq!(p["peak_bytes"], run["peak_bytes"], "ep {ep} cf {cf:?}");
        // The worst routing only where routing decides: dropless, split.
        let worst = p.get("worst_routing_bytes").map(|w| w.as_u64().unwrap());
        match (ep, &cf) {
            (1, _) | (_, Some(_)) => assert_eq!(worst, None, "{p}"),
            _ => assert!(worst.unwrap() > p["total_bytes"].as_u64().unwrap(), "{p}"),
        }
    }
    let out = memfit(&["plan", path]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(" ep ") && text.contains("worst-routed"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// With pipeline stages too, a point plans what `memfit run` gives on
/// meta, and a dropless split carries the worst routing's peak: its
/// highest stage's, at least the balanced one (planning such a point
/// used to panic wiring the stages' expert groups).
#[test]
fn expert_parallel_pipelines_plan_what_run_gives_with_their_worst_routing() {
    let dir = crate::common::scratch("plan-expert-parallel-pp");
    let recipe = dir.join("ep-pp.yaml");
    std::fs::write(
        &recipe,
        "model: moe-tiny\nhardware: h100-sxm-80gb\nseq_len: 32\nglobal_batch: 16\ngrid:\n  micro_batch: [2]\n  precision: [bf16]\n  sharding: [zero1]\n  gpus: [8]\n  pipeline_stages: [2]\n  expert_parallel: [1, 2, 4]\n",
    )
    .unwrap();
    let doc = crate::common::plan_json(&memfit(&[
        "plan",
        recipe.to_str().unwrap(),
        "--format",
        "json",
    ]));
    let points = doc["points"].as_array().unwrap();
    assert_eq!(points.len(), 3);
    for p in points {
        assert_eq!(p["status"], "fits", "{p}");
        let ep = p["point"]
            .get("expert_parallel")
            .map_or(1, |e| e.as_u64().unwrap());
        let ep_s = ep.to_string();
        let run = crate::common::ok_json(
            &[
                "run",
                "--model",
                "moe-tiny",
                "--device",
                "meta:h100-sxm-80gb",
                "--seq-len",
                "32",
                "--micro-batch",
                "2",
                "--grad-accum",
                "2",
                "--precision",
                "bf16",
                "--attention",
                "fused",
                "--ranks",
                "8",
                "--pipeline-stages",
                "2",
                "--sharding",
                "zero1",
                "--expert-parallel",
                &ep_s,
                "--format",
                "json",
            ],
            &[],
        );
        // The highest rank's total (run's categories are each one's
        // highest over the ranks).
        assert_eq!(
            p["peak_bytes"]["total"], run["peak_bytes"]["total"],
            "ep {ep}"
        );
        let worst = p.get("worst_routing_bytes").map(|w| w.as_u64().unwrap());
        match ep {
            1 => assert_eq!(worst, None, "{p}"),
            _ => assert!(worst.unwrap() >= p["total_bytes"].as_u64().unwrap(), "{p}"),
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// LoRA adapters on the experts (`--lora-targets experts`) go with their
/// experts: split over the ranks, they train as without expert
/// parallelism, the adapters' gradients reduced over the ranks that hold
/// the same experts.
#[test]
fn expert_adapters_split_over_ranks_train_as_data_parallelism_does() {
    use memfit::engine::lora::Target;
    use memfit::engine::{Finetune, LoraConfig};
    let model = model();
    for sharding in [Sharding::Ddp, Sharding::Zero2] {
        for cf in [None, Some(1.25)] {
            let base = TrainConfig {
                capacity_factor: cf,
                finetune: Finetune::Lora,
                lora: LoraConfig {
                    targets: vec![Target::Q, Target::V, Target::Experts],
                    ..LoraConfig::default()
                },
                lr: Some(1e-2),
                ..config(4, 1, sharding, 1)
            };
            let want = train(&mut cpu_cluster(&model, &base), &base, 3);
            let tc = TrainConfig {
                expert_parallel: 2,
                ..base.clone()
            };
            let got = train(&mut cpu_cluster(&model, &tc), &tc, 3);
            same_training(&got, &want, &format!("{sharding:?} cf {cf:?}"));
        }
    }
}
