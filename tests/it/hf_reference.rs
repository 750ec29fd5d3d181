//! The hf-eager framework profile: against every PyTorch fixture in
//! tests/reference/hf_memory.json, meta == cpu, unchanged numerics, the
//! issue's quoted GPU figure, and the flags' errors.

use crate::common;

use std::path::Path;

use crate::common::{json, memfit, refused, scratch, scratch_file, stderr};
use memfit::backend::cpu::CpuBackend;
use memfit::backend::meta::MetaBackend;
use memfit::config::ModelConfig;
use memfit::config::hf::import_hf_config;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::{Attention, Checkpointing, Engine, Framework, OptimizerImpl, TrainConfig};
use memfit::memory::Tracker;
use memfit::reference::{self, CATEGORY_TOLERANCE, TOTAL_TOLERANCE};

fn fixture() -> reference::Fixture {
    reference::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference/hf_memory.json"))
        .unwrap()
}

#[test]
fn every_fixture_within_three_percent_total_and_five_per_category() {
    let fx = fixture();
    assert!(fx.configs.len() >= 90, "the fixture lost configurations");
    let mut failures = Vec::new();
    for c in &fx.configs {
        let m = reference::plan(c).unwrap();
        let (total, cats) = reference::compared(c);
        let err = reference::error(m.total, c.peak_bytes.total);
        if total && err.abs() > TOTAL_TOLERANCE {
            failures.push(format!(
                "{}: total {} vs PyTorch {} ({:+.2}%)",
                c.name,
                m.total,
                c.peak_bytes.total,
                100.0 * err
            ));
        }
        for &k in cats {
            let e = reference::error(m.get(k), c.peak_bytes.get(k));
            if e.abs() > CATEGORY_TOLERANCE {
                failures.push(format!(
                    "{}: {} {} vs PyTorch {} ({:+.2}%)",
                    c.name,
                    k.name(),
                    m.get(k),
                    c.peak_bytes.get(k),
                    100.0 * e
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The peak phase agrees with PyTorch's too: the optimizer's foreach list
/// makes short sequences peak there, long ones peak at the loss backward.
#[test]
fn the_peak_lands_in_pytorchs_phase() {
    for c in fixture().configs {
        if !reference::compared(&c).0 {
            continue;
        }
        let (model, train) = reference::config(&c).unwrap();
        let mut e = Engine::new(model, train, MetaBackend::emulating_cpu(), None).unwrap();
        e.step_from(1, || unreachable!()).unwrap();
        let t = &e.dev.tracker;
        let peak = t.peak_total();
        // The phase of the first event that reaches the peak.
        let phase = t
            .timeline()
            .iter()
            .find_map(|ev| (ev.live_total == peak).then_some(ev.phase))
            .expect("the peak is on the timeline");
        let ours = match phase {
            memfit::memory::Phase::Optimizer => "optimizer",
            _ => "backward",
        };
        assert_eq!(ours, c.peak_phase, "{}: peak phase", c.name);
    }
}

fn run_both(model: &ModelConfig, tc: &TrainConfig) -> (Tracker, Tracker, Vec<f32>) {
    let model = model.clone();
    let mut cpu =
        Engine::new(model.clone(), tc.clone(), CpuBackend::new(2).unwrap(), None).unwrap();
    let mut meta = Engine::new(
        model.clone(),
        tc.clone(),
        MetaBackend::emulating_cpu(),
        None,
    )
    .unwrap();
    let mut data = DataSource::synthetic(model.vocab_size, tc.seed);
    let mut losses = Vec::new();
    for _ in 0..3 {
        let batches: Vec<_> = (0..tc.grad_accum)
            .map(|_| data.next_batch(tc.micro_batch, tc.seq_len))
            .collect();
        losses.push(cpu.step(&batches).unwrap().loss.unwrap());
        meta.step(&batches).unwrap();
    }
    (cpu.dev.tracker.clone(), meta.dev.tracker.clone(), losses)
}

/// Test-size models of issue 30's families, as config.json imports them:
/// Qwen3 (per-head q/k norms, 32-wide heads on a 64-wide stream), Mixtral
/// (every block routed, 2 of 4 experts, renormalised), OLMoE (full q/k
/// norms, 2 of 4 experts, not renormalised) and Gemma 3 (q/k norms of
/// `1 + w`, two RoPE bases, an 8-token window on every other layer, which
/// the tests' 16 and 32 tokens pass).
fn new_families() -> Vec<ModelConfig> {
    [
        ("qwen3", r#""head_dim": 32"#),
        (
            "mixtral",
            r#""num_local_experts": 4, "num_experts_per_tok": 2"#,
        ),
        ("olmoe", r#""num_experts": 4, "num_experts_per_tok": 2"#),
        (
            "gemma3_text",
            r#""head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 2"#,
        ),
    ]
    .into_iter()
    .map(|(model_type, extra)| {
        let text = format!(
            r#"{{"model_type": "{model_type}", "hidden_size": 64, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "vocab_size": 256, {extra}}}"#
        );
        import_hf_config(&text, model_type).unwrap()
    })
    .collect()
}

/// hf-eager on cpu allocates every tensor it models for real: meta predicts
/// it byte for byte, event for event; and it only changes what is held, so
/// the losses are memfit's own, bit for bit.
#[test]
fn hf_eager_meta_equals_cpu_and_keeps_the_numerics() {
    let tiny = ["gpt2-tiny", "llama-tiny", "gemma-tiny"].map(|m| load_model(m).unwrap());
    for model in tiny.iter().chain(&new_families()) {
        for (attention, opt_impl, set_to_none, ckpt) in [
            (
                Attention::Eager,
                OptimizerImpl::Foreach,
                true,
                Checkpointing::None,
            ),
            (
                Attention::Fused,
                OptimizerImpl::SingleTensor,
                false,
                Checkpointing::None,
            ),
            (
                Attention::Eager,
                OptimizerImpl::Fused,
                true,
                Checkpointing::Full,
            ),
        ] {
            let memfit_tc = TrainConfig {
                seq_len: 32,
                micro_batch: 2,
                grad_accum: 2,
                attention,
                checkpointing: ckpt,
                ..TrainConfig::default()
            };
            let hf_tc = TrainConfig {
                framework: Framework::HfEager,
                optimizer_impl: opt_impl,
                set_to_none,
                ..memfit_tc.clone()
            };
            let what = format!(
                "{} {attention:?} {opt_impl:?} set_to_none={set_to_none}",
                model.name
            );
            let (cpu, meta, hf_losses) = run_both(model, &hf_tc);
            assert_eq!(cpu.peak_bytes(), meta.peak_bytes(), "{what}");
            assert_eq!(
                common::events(&cpu),
                common::events(&meta),
                "{what}: timelines differ"
            );
            let (mcpu, _, memfit_losses) = run_both(model, &memfit_tc);
            // gpt2-tiny pads its vocabulary, which hf-eager does not: the
            // logits differ in padding columns only, which the loss ignores.
            assert_eq!(
                hf_losses, memfit_losses,
                "{what}: hf-eager changed the numerics"
            );
            assert_ne!(
                cpu.peak_bytes(),
                mcpu.peak_bytes(),
                "{what}: hf-eager held what memfit holds"
            );
        }
    }
}

/// The issue's quoted figure for gpt2 T=1024 dropout 0.1 (HF's default) on
/// a GPU: 13570.4 MiB, which the fixture's cpu run cannot show (cpu dropout
/// saves 4-byte noise where CUDA saves a 1-byte mask). `memfit plan` targets
/// a GPU; its peak less the hardware's runtime overhead is PyTorch's.
#[test]
fn plan_reproduces_the_issues_cuda_dropout_figure() {
    let recipe = scratch_file(
        "hfref-plan",
        "gpt2.yaml",
        "model: gpt2\nhardware: h100-sxm-80gb\nseq_len: 1024\nglobal_batch: 4\ndropout: 0.1\nset_to_none: false\ngrid:\n  micro_batch: [4]\n  precision: [fp32]\n  attention: [eager]\n",
    );
    let out = memfit(&["plan", recipe.to_str().unwrap(), "--format", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let plan = json(&out);
    let p = &plan["points"][0];
    assert_eq!(
        p["point"]["framework"], "hf-eager",
        "plan's default framework"
    );
    let engine = p["peak_bytes"]["total"].as_u64().unwrap();
    let mib = engine as f64 / (1u64 << 20) as f64;
    assert!((mib - 13570.4).abs() < 0.05, "{mib} MiB");
}

#[test]
fn hf_only_knobs_and_unmeasurable_points_are_refused() {
    let err = refused(
        &["run", "--device", "meta", "--dropout", "0.1"],
        "--dropout",
    );
    assert!(err.contains("--framework hf-eager"), "{err}");
    let err = refused(
        &["run", "--device", "meta", "--param-groups", "trainer"],
        "--param-groups",
    );
    assert!(err.contains("--framework hf-eager"), "{err}");
    refused(
        &[
            "run",
            "--device",
            "meta",
            "--framework",
            "hf-eager",
            "--optimizer-impl",
            "fused",
            "--param-groups",
            "trainer",
        ],
        "changes no memory",
    );
    let hf_bf16 = ["run", "--framework", "hf-eager", "--precision", "bf16"];
    let err = refused(&[&hf_bf16[..], &["--steps", "1"]].concat(), "--framework");
    assert!(err.contains("autocast"), "{err}");
    refused(
        &[
            "run",
            "--framework",
            "hf-eager",
            "--dropout",
            "1.5",
            "--device",
            "meta",
        ],
        "outside [0, 1)",
    );
    // Planned on meta, autocast and dropout are fine.
    let out = memfit(&[
        "run",
        "--framework",
        "hf-eager",
        "--precision",
        "bf16",
        "--dropout",
        "0.1",
        "--device",
        "meta",
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let dir = scratch("hfref-sweep");
    let recipe = dir.join("sweep.yaml");
    std::fs::write(
        &recipe,
        "model: gpt2-tiny\nhardware: t4\ndevice: cpu:limit=64MiB\nseq_len: 32\nglobal_batch: 4\ngrid:\n  micro_batch: [2]\n  precision: [fp32, bf16]\n  framework: [hf-eager]\n",
    )
    .unwrap();
    let out = dir.join("out");
    let sweep = [
        "sweep",
        recipe.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    let err = refused(&sweep, "sweep.yaml");
    assert!(err.contains("autocast"), "{err}");
}

/// A pipeline's last stage holds the tied head but not the embedding: the
/// head's gradient temporary must end with each backward there, so more
/// micro-batches do not raise any stage's peak.
#[test]
fn hf_eager_pipeline_peaks_do_not_grow_with_micro_batches() {
    let temps = |k: &str| {
        let out = memfit(&[
            "run",
            "--model",
            "gpt2-tiny",
            "--device",
            "meta",
            "--framework",
            "hf-eager",
            "--pipeline-stages",
            "2",
            "--grad-accum",
            k,
            "--format",
            "json",
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        json(&out)["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["peak_bytes"]["temporaries"].as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(temps("1"), temps("4"));
}

/// Plan recipes' LoRA keys are checked where `memfit run`'s flags are.
#[test]
fn plan_recipe_lora_keys_are_checked() {
    let dir = scratch("hfref-lora-keys");
    for (key, bad) in [
        ("lora_rank", "lora_rank: 0"),
        ("lora_alpha", "lora_alpha: -1"),
        ("lora_dropout", "lora_dropout: 1.5"),
        ("lora_targets", "lora_targets: [gate]"),
    ] {
        let recipe = dir.join(format!("{key}.yaml"));
        std::fs::write(
            &recipe,
            format!(
                "model: gpt2\nhardware: t4\nseq_len: 64\nglobal_batch: 4\n{bad}\ngrid:\n  finetune: [lora]\n  optimizer: [adafactor]\n"
            ),
        )
        .unwrap();
        let out = memfit(&["plan", recipe.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(2), "{key}: {}", stderr(&out));
        assert!(stderr(&out).contains(key), "{key}: {}", stderr(&out));
    }
}

/// Every profile and fine-tuning mode frees what it allocates: after two
/// steps and `release`, nothing is live in any category.
#[test]
fn every_mode_releases_everything() {
    use memfit::engine::{Finetune, Precision, Sharding};
    let tiny = ["gpt2-tiny", "llama-tiny", "gemma-tiny"].map(|m| load_model(m).unwrap());
    for model in tiny.iter().chain(&new_families()) {
        for (framework, finetune, precision, set_to_none, ckpt) in [
            (
                Framework::HfEager,
                Finetune::Full,
                Precision::Fp32,
                true,
                Checkpointing::None,
            ),
            (
                Framework::HfEager,
                Finetune::Full,
                Precision::Bf16,
                false,
                Checkpointing::Full,
            ),
            (
                Framework::HfEager,
                Finetune::Lora,
                Precision::Bf16,
                true,
                Checkpointing::None,
            ),
            (
                Framework::Memfit,
                Finetune::Qlora,
                Precision::Bf16,
                true,
                Checkpointing::Full,
            ),
            (
                Framework::HfEager,
                Finetune::Qlora,
                Precision::Bf16,
                true,
                Checkpointing::None,
            ),
        ] {
            // Adapters on a mixture go on the attention only, and QLoRA on
            // experts is refused (tests/it/moe.rs).
            if model.moe.is_some() && finetune != Finetune::Full {
                continue;
            }
            let tc = TrainConfig {
                seq_len: 16,
                micro_batch: 2,
                grad_accum: 2,
                framework,
                finetune,
                precision,
                set_to_none,
                checkpointing: ckpt,
                sharding: Sharding::None,
                ..TrainConfig::default()
            };
            for gpu in [false, true] {
                let be = match gpu {
                    true => MetaBackend::emulating_cuda(),
                    false => MetaBackend::emulating_cpu(),
                };
                let mut e = Engine::new(model.clone(), tc.clone(), be, None).unwrap();
                let start = e.dev.tracker.live();
                for _ in 0..2 {
                    e.step_from(2, || unreachable!()).unwrap();
                    assert_eq!(
                        e.dev.tracker.live(),
                        start,
                        "{tc:?}: a step left bytes live"
                    );
                }
                let dev = e.release();
                assert_eq!(dev.tracker.live().total(), 0, "{tc:?}");
                if let Some(c) = &dev.caching {
                    assert_eq!(c.allocated(), 0, "{tc:?}: the allocator model kept blocks");
                }
            }
        }
    }
}
