//! LoRA on the routed experts (`--lora-targets experts`): every expert's
//! gate, up and down get their own adapter, stacked `(E, r, ·)` as the
//! experts are; their gradients are checked against finite differences,
//! they change what trains, and meta predicts cpu byte for byte, alone,
//! under ZeRO-2 and with expert parallelism, for LoRA and QLoRA.

use crate::common::{self, memfit};
use crate::gradcheck::{gradcheck_trained, small};
use memfit::backend::cpu::CpuBackend;
use memfit::backend::meta::MetaBackend;
use memfit::config::ModelConfig;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::cluster::{Cluster, cpu_links, meta_links};
use memfit::engine::lora::{self, Target};
use memfit::engine::{Engine, Finetune, LoraConfig, Precision, Sharding, TrainConfig};

const ATTENTION: [Target; 4] = [Target::Q, Target::K, Target::V, Target::O];

fn targets(experts: bool) -> Vec<Target> {
    let mut t = ATTENTION.to_vec();
    if experts {
        t.push(Target::Experts);
    }
    t
}

fn tuned(finetune: Finetune, precision: Precision, experts: bool) -> TrainConfig {
    TrainConfig {
        seq_len: 16,
        micro_batch: 2,
        lr: Some(1e-2),
        precision,
        finetune,
        lora: LoraConfig {
            targets: targets(experts),
            ..LoraConfig::default()
        },
        ..TrainConfig::default()
    }
}

/// The expert adapters' `dA_e`, `dB_e` (and through them the router's
/// input) against central differences, on moe-tiny (a dense block, then
/// experts beside a shared expert; the shared expert and the dense block
/// adapted with gate, up and down), dropless and with a capacity factor.
#[test]
fn expert_adapter_gradients_match_finite_differences() {
    let model = load_model("moe-tiny").unwrap();
    for cf in [None, Some(1.25)] {
        let mut tc = small(tuned(Finetune::Lora, Precision::Fp32, true));
        tc.lora
            .targets
            .extend([Target::Gate, Target::Up, Target::Down]);
        tc.capacity_factor = cf;
        gradcheck_trained(&model, tc);
    }
}

/// The layout: per routed block, gate, up and down adapters stacked over
/// the experts, `A (E, r, in)` and `B (E, out, r)`, and none on blocks
/// without experts.
#[test]
fn expert_adapters_are_stacked_per_routed_block() {
    let model = load_model("moe-tiny").unwrap();
    let m = model.moe.clone().unwrap();
    let cfg = LoraConfig {
        rank: 4,
        targets: vec![Target::Experts],
        ..LoraConfig::default()
    };
    let (mut specs, _) = model.param_layout();
    let base = specs.len();
    let ads = lora::layout(&model, &cfg, &mut specs);
    assert!(ads[0].is_empty(), "block 0 is dense");
    let (e, c, i) = (m.n_experts, model.d_model, m.d_expert);
    let shapes: Vec<Vec<usize>> = specs[base..].iter().map(|s| s.shape.clone()).collect();
    assert_eq!(
        shapes,
        [
            vec![e, 4, c],
            vec![e, i, 4],
            vec![e, 4, c],
            vec![e, i, 4],
            vec![e, 4, i],
            vec![e, c, 4]
        ]
    );
    let want = (e * 4 * (c + i) * 2 + e * 4 * (i + c)) as u64;
    assert_eq!(lora::trainable_params(&model, &cfg), want);
}

/// B starts at zero, so the first loss is the base's to the bit; training
/// the experts' adapters then moves the loss off the attention-only run's.
#[test]
fn expert_adapters_start_as_the_base_and_change_training() {
    let model = load_model("moe-tiny").unwrap();
    let mut data = DataSource::synthetic(model.vocab_size, 9);
    let tc = tuned(Finetune::Lora, Precision::Fp32, false);
    let batches: Vec<_> = (0..6)
        .map(|_| data.next_batch(tc.micro_batch, tc.seq_len))
        .collect();
    let run = |experts: bool| {
        let tc = tuned(Finetune::Lora, Precision::Fp32, experts);
        let mut e = Engine::new(model.clone(), tc, CpuBackend::new(2).unwrap(), None).unwrap();
        (batches.iter())
            .map(|b| e.step(std::slice::from_ref(b)).unwrap().loss.unwrap())
            .collect::<Vec<f32>>()
    };
    let (attn, both) = (run(false), run(true));
    assert_eq!(attn[0].to_bits(), both[0].to_bits(), "{attn:?} vs {both:?}");
    let moved = (attn.iter().zip(&both)).filter(|(a, b)| a != b).count();
    assert!(
        moved >= 4,
        "the expert adapters changed nothing: {attn:?} vs {both:?}"
    );
    assert!(both[5] < both[0], "{both:?}");
}

/// One rank: meta's peak, every category and the allocation timeline are
/// cpu's, for LoRA and QLoRA, fp32 and bf16, dropless and capacity 1.25;
/// the gradients are the adapters' alone, experts' included.
#[test]
fn expert_adapters_meta_matches_cpu() {
    let model = load_model("moe-tiny").unwrap();
    for finetune in [Finetune::Lora, Finetune::Qlora] {
        for precision in [Precision::Fp32, Precision::Bf16] {
            for cf in [None, Some(1.25)] {
                let tc = TrainConfig {
                    capacity_factor: cf,
                    ..tuned(finetune, precision, true)
                };
                let what = format!("{finetune:?} {precision:?} {cf:?}");
                let cpu_be = CpuBackend::new(2).unwrap();
                let mut cpu = Engine::new(model.clone(), tc.clone(), cpu_be, None).unwrap();
                let resident = cpu.dev.tracker.live();
                let meta_be = MetaBackend::emulating_cpu();
                let mut meta = Engine::new(model.clone(), tc.clone(), meta_be, None).unwrap();
                let mut data = DataSource::synthetic(model.vocab_size, 4);
                for _ in 0..3 {
                    let b = data.next_batch(tc.micro_batch, tc.seq_len);
                    cpu.step(std::slice::from_ref(&b)).unwrap();
                    meta.step(&[b]).unwrap();
                    assert_eq!(cpu.dev.tracker.live(), resident, "{what}: a step leaked");
                }
                let peak = cpu.dev.tracker.peak_bytes();
                assert_eq!(peak, meta.dev.tracker.peak_bytes(), "{what}");
                assert_eq!(
                    common::events(&cpu.dev.tracker),
                    common::events(&meta.dev.tracker),
                    "{what}"
                );
                let bytes = precision.dtype().size() as u64;
                let adapters = lora::trainable_params(&model, &tc.lora);
                assert_eq!(peak.gradients, bytes * adapters, "{what}");
            }
        }
    }
}

fn clusters(
    model: &ModelConfig,
    tc: &TrainConfig,
    steps: usize,
) -> (Cluster<CpuBackend>, Cluster<MetaBackend>, Vec<f32>) {
    let cpus = (0..tc.ranks).map(|_| CpuBackend::new(1).unwrap()).collect();
    let mut cpu = Cluster::new(model, tc, cpus, cpu_links(model, tc), None).unwrap();
    let metas = (0..tc.ranks)
        .map(|_| MetaBackend::emulating_cpu())
        .collect();
    let mut meta = Cluster::new(model, tc, metas, meta_links(model, tc), None).unwrap();
    let mut data = DataSource::synthetic(model.vocab_size, 5);
    let (b, t) = (tc.micro_batch, tc.seq_len);
    let losses = (0..steps)
        .map(|_| {
            let r = cpu
                .step_from(tc.grad_accum, || data.next_batch(b, t))
                .unwrap();
            meta.step_from(tc.grad_accum, || unreachable!("meta reads no data"))
                .unwrap();
            r.loss.unwrap()
        })
        .collect();
    (cpu, meta, losses)
}

/// ZeRO-2 on 2 ranks, and the experts (with their adapters) split over 2
/// of 4 ranks under ddp and ZeRO-2 with a capacity factor: every rank's
/// peak and timeline are meta's, and no rank leaks.
#[test]
fn expert_adapters_over_ranks_meta_matches_cpu() {
    let mut model = load_model("moe-tiny").unwrap();
    model.moe.as_mut().unwrap().first_dense = 0;
    for finetune in [Finetune::Lora, Finetune::Qlora] {
        for (ranks, ep, cf, sharding) in [
            (2, 1, None, Sharding::Zero2),
            (4, 2, Some(1.25), Sharding::Ddp),
            (4, 2, Some(1.25), Sharding::Zero2),
        ] {
            let tc = TrainConfig {
                ranks,
                expert_parallel: ep,
                capacity_factor: cf,
                sharding,
                ..tuned(finetune, Precision::Bf16, true)
            };
            let what = format!("{finetune:?} {ranks} ranks, ep {ep}, {sharding:?}");
            let (cpu, meta, losses) = clusters(&model, &tc, 4);
            assert!(losses.iter().all(|l| l.is_finite()), "{what}: {losses:?}");
            for (c, m) in cpu.ranks.iter().zip(&meta.ranks) {
                let (cp, mp) = (c.dev.tracker.peak_bytes(), m.dev.tracker.peak_bytes());
                assert_eq!(cp, mp, "{what}");
                assert_eq!(
                    common::events(&c.dev.tracker),
                    common::events(&m.dev.tracker),
                    "{what}"
                );
            }
            for (i, dev) in cpu.release().into_iter().enumerate() {
                assert_eq!(dev.tracker.live().total(), 0, "{what}: rank {i} leaked");
            }
        }
    }
}

/// `memfit run` refuses by name what expert adapters cannot do: a model
/// without experts, a mixture with no targets named, hf-eager, and dense
/// MLP targets on a mixture with no dense MLP; it trains them otherwise.
#[test]
fn the_cli_trains_expert_adapters_and_refuses_what_it_cannot() {
    let run = [
        "run",
        "--finetune",
        "lora",
        "--steps",
        "2",
        "--seq-len",
        "16",
    ];
    let out = memfit(
        &[
            &run[..],
            &["--model", "moe-tiny", "--lora-targets", "q,v,experts"],
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", common::stderr(&out));
    for (args, flag, needle) in [
        (
            &["--model", "llama-tiny", "--lora-targets", "q,experts"][..],
            "--lora-targets",
            "no routed experts",
        ),
        (
            &["--model", "moe-tiny"][..],
            "--lora-targets",
            "q,k,v,o,experts",
        ),
        (
            &[
                "--model",
                "moe-tiny",
                "--lora-targets",
                "experts",
                "--framework",
                "hf-eager",
                "--device",
                "meta",
            ][..],
            "--framework",
            "target_modules",
        ),
        (
            &[
                "--model",
                "qwen3-30b-a3b",
                "--lora-targets",
                "q,down",
                "--device",
                "meta",
            ][..],
            "--lora-targets",
            "no dense MLP",
        ),
    ] {
        let out = memfit(&[&run[..], args].concat());
        let err = common::stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(flag) && err.contains(needle) && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
}

fn plan_peaks(text: &str, name: &str) -> Vec<(u64, String)> {
    let dir = common::scratch(name);
    let path = dir.join("recipe.yaml");
    std::fs::write(&path, text).unwrap();
    let out = memfit(&["plan", path.to_str().unwrap(), "--format", "json"]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(out.status.success(), "{}", common::stderr(&out));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    (doc["points"].as_array().unwrap().iter())
        .map(|p| {
            (
                p["peak_bytes"]["total"].as_u64().unwrap_or(0),
                p["status"].to_string(),
            )
        })
        .collect()
}

/// Mixtral-8x7B QLoRA on 2 x 4090 with the experts adapted too (r=16 on
/// each expert's gate, up and down: 226M more trainable parameters):
/// every point's peak grows, and with the experts split over the two
/// GPUs it still fits (docs/moe.md has the figures).
#[test]
fn mixtral_qlora_with_expert_adapters_plans() {
    let src = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/recipes/mixtral-8x7b-qlora-2x4090.yaml"
    );
    let text = std::fs::read_to_string(src).unwrap();
    let experts = text.replace(
        "lora_targets: [q, k, v, o]",
        "lora_targets: [q, k, v, o, experts]",
    );
    assert_ne!(text, experts);
    let attn = plan_peaks(&text, "lexp-attn");
    let both = plan_peaks(&experts, "lexp-experts");
    for ((a, sa), (b, sb)) in attn.iter().zip(&both) {
        if sa.contains("invalid") {
            continue;
        }
        assert!(b > a, "{b} vs {a}");
        assert!(sb.contains("fit"), "{sb}");
    }
    let fits = |v: &[(u64, String)]| v.iter().filter(|p| p.1 == "\"fits\"").count();
    assert_eq!((fits(&attn), fits(&both)), (2, 2));
}
