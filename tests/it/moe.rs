//! Mixtures of experts: they train on cpu, meta predicts every byte, the
//! capacity factor and the dispatch shape memory as their formulas say,
//! published models count their parameters as their cards do, and what
//! experts do not combine with is refused by name.

use crate::common::memfit;
use memfit::backend::cpu::CpuBackend;
use memfit::backend::meta::MetaBackend;
use memfit::config::ModelConfig;
use memfit::config::hf::import_hf_config;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::cluster::{Cluster, cpu_links, meta_links};
use memfit::engine::{
    Attention, Checkpointing, Engine, Optimizer, Precision, Sharding, TrainConfig,
};
use memfit::memory::Tracker;

fn timeline(t: &Tracker) -> Vec<(String, &'static str, i64)> {
    t.timeline()
        .iter()
        .map(|e| (e.phase.to_string(), e.category.name(), e.bytes))
        .collect()
}

/// Trains `tc` for `steps` on cpu and on meta: the loss falls, nothing
/// leaks, and meta's peaks and timeline equal cpu's. Returns the peak total.
fn train_and_predict(model: &ModelConfig, tc: &TrainConfig, steps: usize) -> u64 {
    let what = format!(
        "cf {:?} {:?} {:?} {:?} {:?}",
        tc.capacity_factor, tc.precision, tc.checkpointing, tc.attention, tc.optimizer
    );
    let mut e = Engine::new(model.clone(), tc.clone(), CpuBackend::new(2).unwrap(), None).unwrap();
    let resident = e.dev.tracker.live();
    let mut data = DataSource::synthetic(model.vocab_size, 11);
    let (b, t) = (tc.micro_batch, tc.seq_len);
    let losses: Vec<f32> = (0..steps)
        .map(|_| {
            let batches: Vec<_> = (0..tc.grad_accum).map(|_| data.next_batch(b, t)).collect();
            let r = e.step(&batches).unwrap();
            assert!(!r.skipped, "{what}");
            assert_eq!(e.dev.tracker.live(), resident, "{what}: a step leaked");
            r.loss.unwrap()
        })
        .collect();
    let (first, last) = (losses[0], losses[steps - 1]);
    assert!(last < first - 0.1, "{what}: loss {first:.3} -> {last:.3}");
    let mut meta = Engine::new(
        model.clone(),
        tc.clone(),
        MetaBackend::emulating_cpu(),
        None,
    )
    .unwrap();
    for _ in 0..steps {
        meta.step_from(tc.grad_accum, || unreachable!("meta reads no data"))
            .unwrap();
    }
    assert_eq!(
        e.dev.tracker.peak_bytes(),
        meta.dev.tracker.peak_bytes(),
        "{what}"
    );
    assert_eq!(
        timeline(&e.dev.tracker),
        timeline(&meta.dev.tracker),
        "{what}"
    );
    e.dev.tracker.peak_bytes().total
}

#[test]
fn experts_train_and_meta_matches_cpu_byte_for_byte() {
    let model = load_model("moe-tiny").unwrap();
    let mut i = 0;
    for capacity_factor in [None, Some(1.0), Some(1.5)] {
        for checkpointing in [Checkpointing::None, Checkpointing::Full] {
            i += 1;
            let tc = TrainConfig {
                seq_len: 32,
                micro_batch: 2,
                grad_accum: 1 + i % 2,
                capacity_factor,
                checkpointing,
                precision: [Precision::Fp32, Precision::Bf16][i % 2],
                attention: [Attention::Eager, Attention::Fused][(i / 2) % 2],
                optimizer: [Optimizer::Adamw, Optimizer::Adamw8bit, Optimizer::Adafactor][i % 3],
                ..TrainConfig::default()
            };
            // Adafactor's relative step; the others a rate that moves in 20 steps.
            let lr = (tc.optimizer != Optimizer::Adafactor).then_some(2e-3);
            let tc = TrainConfig { lr, ..tc };
            train_and_predict(&model, &tc, 20);
        }
    }
}

/// The permuted buffers hold `N·k` rows dropless and `E·⌈f·N·k/E⌉` under a
/// capacity factor `f`, whatever the routing: the activations differ by
/// exactly those rows' tensors (x, gate|up, SwiGLU, expert output: `2C +
/// 3I` values each, plus a u32 index and an f32 weight).
#[test]
fn the_capacity_factor_sizes_the_expert_buffers() {
    let model = load_model("moe-tiny").unwrap();
    let m = model.moe.clone().unwrap();
    let (c, i) = (model.d_model, m.d_expert);
    let (b, t) = (2, 24);
    let n = b * t;
    let peak = |f: Option<f32>| {
        let tc = TrainConfig {
            seq_len: t,
            micro_batch: b,
            capacity_factor: f,
            ..TrainConfig::default()
        };
        let mut e = Engine::new(model.clone(), tc, MetaBackend::emulating_cpu(), None).unwrap();
        e.step_from(1, || unreachable!()).unwrap();
        e.dev.tracker.peak_bytes().activations as i64
    };
    let row = (4 * (2 * c + 3 * i) + 8) as i64;
    let dropless = peak(None);
    for f in [0.5f32, 1.0, 1.25, 2.0] {
        let cap = ((f as f64) * (n * m.top_k) as f64 / m.n_experts as f64).ceil() as i64;
        let rows = m.n_experts as i64 * cap;
        let diff = peak(Some(f)) - dropless;
        assert_eq!(
            diff,
            (rows - (n * m.top_k) as i64) * row,
            "capacity factor {f}"
        );
    }
}

/// Routed blocks on data-parallel ranks (ddp and every ZeRO stage, where
/// zero3 gathers the stacked experts with their block) and in a pipeline:
/// every rank's peaks and timeline, and its traffic, as meta predicts.
#[test]
fn meta_matches_cpu_on_every_rank_with_experts() {
    let model = load_model("moe-tiny").unwrap();
    for (ranks, stages, sharding) in [
        (2, 1, Sharding::Ddp),
        (2, 1, Sharding::Zero2),
        (3, 1, Sharding::Zero3),
        (2, 2, Sharding::None),
    ] {
        let tc = TrainConfig {
            seq_len: 16,
            micro_batch: 2,
            grad_accum: 2,
            ranks,
            pipeline_stages: stages,
            sharding,
            capacity_factor: (ranks == 3).then_some(1.25),
            ..TrainConfig::default()
        };
        let cpus = (0..ranks).map(|_| CpuBackend::new(1).unwrap()).collect();
        let mut cpu = Cluster::new(&model, &tc, cpus, cpu_links(&model, &tc), None).unwrap();
        let metas = (0..ranks).map(|_| MetaBackend::emulating_cpu()).collect();
        let mut meta = Cluster::new(&model, &tc, metas, meta_links(&model, &tc), None).unwrap();
        let mut data = DataSource::synthetic(model.vocab_size, 5);
        for _ in 0..2 {
            let r = cpu.step_from(2, || data.next_batch(2, 16)).unwrap();
            assert!(!r.skipped && r.loss.unwrap().is_finite());
            meta.step_from(2, || unreachable!()).unwrap();
        }
        let what = format!("{ranks} ranks, {stages} stages, {sharding:?}");
        for (c, m) in cpu.ranks.iter().zip(&meta.ranks) {
            assert_eq!(
                c.dev.tracker.peak_bytes(),
                m.dev.tracker.peak_bytes(),
                "{what}"
            );
            assert_eq!(timeline(&c.dev.tracker), timeline(&m.dev.tracker), "{what}");
            assert_eq!(
                (c.dev.meter.sent, c.dev.meter.received),
                (m.dev.meter.sent, m.dev.meter.received),
                "{what}"
            );
        }
        for (i, dev) in cpu.release().into_iter().enumerate() {
            assert_eq!(dev.tracker.live().total(), 0, "{what}: rank {i} leaked");
        }
    }
}

/// A pipeline's loss is the same as one rank's: the first stage's routed
/// block adds its load-balancing loss to the last stage's.
#[test]
fn a_pipeline_reports_every_stages_balancing_loss() {
    let mut model = load_model("moe-tiny").unwrap();
    // Both blocks routed, so the first stage holds one.
    model.moe.as_mut().unwrap().first_dense = 0;
    let tc = |stages| TrainConfig {
        seq_len: 16,
        micro_batch: 2,
        grad_accum: 2,
        ranks: stages,
        pipeline_stages: stages,
        ..TrainConfig::default()
    };
    let loss = |stages| {
        let tc = tc(stages);
        let cpus = (0..stages).map(|_| CpuBackend::new(1).unwrap()).collect();
        let mut c = Cluster::new(&model, &tc, cpus, cpu_links(&model, &tc), None).unwrap();
        let mut data = DataSource::synthetic(model.vocab_size, 9);
        c.step_from(2, || data.next_batch(2, 16))
            .unwrap()
            .loss
            .unwrap()
    };
    let (one, two) = (loss(1), loss(2));
    assert!((one - two).abs() < 1e-5, "{one} vs {two}");
}

/// Mixtral-8x7B's card: 46.7B parameters, 12.9B active per token. Its
/// config.json imports to the built-in profile.
#[test]
fn mixtral_counts_its_parameters_as_its_card_does() {
    let m = load_model("mixtral-8x7b").unwrap();
    let b = |x: u64| (x as f64 / 1e8).round() / 10.0;
    assert_eq!(b(m.num_parameters()), 46.7);
    assert_eq!(b(m.active_parameters()), 12.9);
    // Exactly: 32 blocks of attention (q, o 4096², k, v 4096x1024), two
    // norms, a router (8x4096) and 8 experts of 3x4096x14336; the
    // embedding and head (32000x4096 each) and the final norm.
    let (c, i) = (4096u64, 14336u64);
    let block = 2 * c * c + 2 * c * 1024 + 2 * c + 8 * c + 8 * 3 * c * i;
    assert_eq!(m.num_parameters(), 32 * block + 2 * 32000 * c + c);
    assert_eq!(
        m.num_parameters() - m.active_parameters(),
        32 * 6 * 3 * c * i
    );

    let text = r#"{
      "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
      "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
      "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
      "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
      "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
      "output_router_logits": false, "tie_word_embeddings": false, "sliding_window": null,
      "hidden_act": "silu", "torch_dtype": "bfloat16"
    }"#;
    let imported = import_hf_config(text, "mixtral/config.json").unwrap();
    assert_eq!(
        ModelConfig {
            name: m.name.clone(),
            ..imported
        },
        m
    );
}

/// Qwen3-30B-A3B's card: 30.5B parameters, 3.3B active; OLMoE-1B-7B's:
/// 6.9B, 1.3B active; Qwen3-8B's: 8.2B, 6.95B without the embedding.
/// Their config.json files import to the built-in profiles.
#[test]
fn qwen3_and_olmoe_count_their_parameters_as_their_cards_do() {
    let b = |x: u64| (x as f64 / 1e8).round() / 10.0;
    let q = load_model("qwen3-30b-a3b").unwrap();
    // Qwen's card truncates: 30.53B and 3.353B.
    let t = |x: u64| (x as f64 / 1e8).floor() / 10.0;
    assert_eq!(
        (t(q.num_parameters()), t(q.active_parameters())),
        (30.5, 3.3)
    );
    assert_eq!(q.active_parameters(), 3_353_032_704);
    let o = load_model("olmoe-1b-7b").unwrap();
    assert_eq!(
        (b(o.num_parameters()), b(o.active_parameters())),
        (6.9, 1.3)
    );
    let d = load_model("qwen3-8b").unwrap();
    let embedding = 2 * 151936 * 4096;
    assert_eq!(b(d.num_parameters()), 8.2);
    assert_eq!(
        ((d.num_parameters() - embedding) as f64 / 1e7).round() / 100.0,
        6.95
    );
    // Qwen3-30B-A3B exactly: 48 blocks of q and o (4096x2048), k and v
    // (512x2048), the two 128-wide q and k norms, two norms, a router
    // (128x2048) and 128 experts of 3x2048x768; embedding, head, final norm.
    let c = 2048u64;
    let block = 2 * 4096 * c + 2 * 512 * c + 2 * 128 + 2 * c + 128 * c + 128 * 3 * c * 768;
    assert_eq!(q.num_parameters(), 48 * block + 2 * 151936 * c + c);

    let configs = [
        (
            &q,
            r#"{"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
            "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
            "num_experts_per_tok": 8, "norm_topk_prob": true, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "max_position_embeddings": 40960, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001, "tie_word_embeddings": false,
            "vocab_size": 151936, "attention_bias": false, "hidden_act": "silu"}"#,
        ),
        (
            &o,
            r#"{"model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024,
            "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
            "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": false,
            "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-05,
            "router_aux_loss_coef": 0.01, "clip_qkv": null, "tie_word_embeddings": false,
            "vocab_size": 50304, "hidden_act": "silu"}"#,
        ),
        (
            &d,
            r#"{"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000,
            "rms_norm_eps": 1e-06, "tie_word_embeddings": false, "vocab_size": 151936,
            "attention_bias": false, "hidden_act": "silu"}"#,
        ),
    ];
    for (want, text) in configs {
        let got = import_hf_config(text, "config.json").unwrap();
        assert_eq!(
            &ModelConfig {
                name: want.name.clone(),
                ..got
            },
            want
        );
    }
    // Qwen1.5-MoE-A2.7B: 14.3B, 2.7B active; a shared expert under a gate.
    let q2 = load_model("qwen1.5-moe-a2.7b").unwrap();
    assert_eq!(
        (b(q2.num_parameters()), b(q2.active_parameters())),
        (14.3, 2.7)
    );
    let text = r#"{"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
        "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": false,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 8192,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": false, "vocab_size": 151936, "hidden_act": "silu"}"#;
    let got = import_hf_config(text, "config.json").unwrap();
    assert_eq!(
        ModelConfig {
            name: q2.name.clone(),
            ..got
        },
        q2
    );
    // DeepSeek-MoE-16B: 16.4B, 2.8B active; a dense first block, shared experts.
    let ds = load_model("deepseek-moe-16b").unwrap();
    assert_eq!(
        (b(ds.num_parameters()), b(ds.active_parameters())),
        (16.4, 2.8)
    );
    let text = r#"{"model_type": "deepseek", "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
        "norm_topk_prob": false, "scoring_func": "softmax", "aux_loss_alpha": 0.001,
        "max_position_embeddings": 4096, "rope_theta": 10000, "rms_norm_eps": 1e-06,
        "tie_word_embeddings": false, "vocab_size": 102400, "hidden_act": "silu"}"#;
    let got = import_hf_config(text, "config.json").unwrap();
    assert_eq!(
        ModelConfig {
            name: ds.name.clone(),
            ..got
        },
        ds
    );
    let bad = text.replace(
        r#""scoring_func": "softmax""#,
        r#""scoring_func": "sigmoid""#,
    );
    let err = import_hf_config(&bad, "config.json")
        .unwrap_err()
        .to_string();
    assert!(err.contains("scoring_func"), "{err}");
    // Phi-3-mini's profile is its config.json's import: 3.8B.
    let phi = load_model("phi-3-mini").unwrap();
    assert_eq!(b(phi.num_parameters()), 3.8);
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hf/phi-3-mini-4k.json"
    );
    let got = load_model(fixture).unwrap();
    assert_eq!(
        ModelConfig {
            name: phi.name.clone(),
            ..got
        },
        phi
    );
    // What memfit does not lay out is refused by its key.
    let bad = configs[0]
        .1
        .replace(r#""decoder_sparse_step": 1"#, r#""decoder_sparse_step": 2"#);
    let err = import_hf_config(&bad, "config.json")
        .unwrap_err()
        .to_string();
    assert!(err.contains("decoder_sparse_step"), "{err}");
    let bad = configs[1]
        .1
        .replace(r#""clip_qkv": null"#, r#""clip_qkv": 8.0"#);
    let err = import_hf_config(&bad, "config.json")
        .unwrap_err()
        .to_string();
    assert!(err.contains("clip_qkv"), "{err}");
}

/// Qwen3's q and k norms and its own head width, OLMoE's whole-q/k norms
/// and Qwen2-MoE's gated shared expert train on cpu and plan on meta byte
/// for byte, with and without checkpointing.
#[test]
fn qwen_and_olmoe_layers_train_and_meta_matches_cpu() {
    for (model_type, extra) in [
        ("qwen3", r#""head_dim": 32"#),
        ("olmoe", r#""num_experts": 4, "num_experts_per_tok": 2"#),
        (
            "qwen2_moe",
            r#""num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 40"#,
        ),
    ] {
        let text = format!(
            r#"{{"model_type": "{model_type}", "hidden_size": 64, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "vocab_size": 256, {extra}}}"#
        );
        let model = import_hf_config(&text, "config.json").unwrap();
        for checkpointing in [Checkpointing::None, Checkpointing::Full] {
            let tc = TrainConfig {
                seq_len: 32,
                micro_batch: 2,
                lr: Some(2e-3),
                checkpointing,
                precision: Precision::Bf16,
                ..TrainConfig::default()
            };
            train_and_predict(&model, &tc, 20);
        }
    }
}

#[test]
fn what_experts_do_not_combine_with_is_refused_by_name() {
    let run = |args: &[&str]| {
        let out = memfit(&[&["run", "--steps", "1", "--seq-len", "16"], args].concat());
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        String::from_utf8(out.stderr).unwrap()
    };
    let err = run(&["--model", "llama-tiny", "--capacity-factor", "1.0"]);
    assert!(
        err.contains("--capacity-factor") && err.contains("no experts"),
        "{err}"
    );
    let err = run(&["--model", "moe-tiny", "--capacity-factor", "0"]);
    assert!(err.contains("positive"), "{err}");
    let err = run(&["--model", "moe-tiny", "--capacity-factor", "9"]);
    assert!(err.contains("experts / top-k"), "{err}");
    let err = run(&["--model", "moe-tiny", "--finetune", "lora"]);
    assert!(
        err.contains("--lora-targets") && err.contains("q,k,v,o"),
        "{err}"
    );
    // gate, up and down adapt a mixture's dense MLPs (moe-tiny's shared
    // expert and dense block); Qwen3-MoE has none.
    let err = run(&[
        "--model",
        "qwen3-30b-a3b",
        "--device",
        "meta",
        "--finetune",
        "lora",
        "--lora-targets",
        "q,up",
    ]);
    assert!(
        err.contains("--lora-targets") && err.contains("no dense MLP"),
        "{err}"
    );
    // QLoRA stores the experts in NF4 and adapts the attention alone
    // (tests/it/qlora_experts.rs): every projection's adapters are refused.
    let err = run(&["--model", "moe-tiny", "--finetune", "qlora"]);
    assert!(
        err.contains("--lora-targets") && err.contains("q,k,v,o"),
        "{err}"
    );
    // hf-eager models Mixtral's, Qwen3-MoE's and OLMoE's blocks, not a
    // shared expert, and transformers' experts never drop tokens.
    let err = run(&["--model", "moe-tiny", "--framework", "hf-eager"]);
    assert!(
        err.contains("--framework") && err.contains("has a shared expert"),
        "{err}"
    );
    let mixtral = [
        "--model",
        "mixtral-8x7b",
        "--device",
        "meta",
        "--framework",
        "hf-eager",
    ];
    let err = run(&[&mixtral[..], &["--capacity-factor", "1.0"]].concat());
    assert!(
        err.contains("--capacity-factor") && err.contains("dropless"),
        "{err}"
    );
    // Tensor parallelism splits the experts, but not with sequence
    // parallelism (tests/it/tensor_parallel.rs runs the rest).
    let err = run(&[
        "--model",
        "moe-tiny",
        "--device",
        "meta",
        "--ranks",
        "2",
        "--tensor-parallel",
        "2",
        "--sequence-parallel",
    ]);
    assert!(
        err.contains("--sequence-parallel") && err.contains("has experts"),
        "{err}"
    );
    for (model_type, what) in [("deepseek_v3", "latent attention"), ("gemma", "Gemma 1")] {
        let text = format!(r#"{{"model_type": "{model_type}", "hidden_size": 64}}"#);
        let err = import_hf_config(&text, "config.json")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(what) && err.contains("config.json:1:"),
            "{err}"
        );
    }
}

/// `memfit run` on cpu trains the tiny mixture and prints its loss; on
/// meta it plans Mixtral-8x7B over 8 ranks with ZeRO-3.
#[test]
fn the_cli_trains_and_plans_experts() {
    let out = memfit(&[
        "run",
        "--model",
        "moe-tiny",
        "--steps",
        "3",
        "--seq-len",
        "16",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = memfit(&[
        "run",
        "--model",
        "mixtral-8x7b",
        "--device",
        "meta",
        "--ranks",
        "8",
        "--sharding",
        "zero3",
        "--precision",
        "bf16",
        "--attention",
        "fused",
        "--checkpointing",
        "full",
        "--seq-len",
        "4096",
        "--micro-batch",
        "1",
        "--capacity-factor",
        "1.25",
        "--format",
        "json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let total = v["peak_bytes"]["total"].as_u64().unwrap_or(0);
    assert!(total > 10 << 30, "{v}");
}

/// A plan recipe of Mixtral that names no framework plans hf-eager (what
/// transformers' MoE modules allocate, `tests/it/hf_reference.rs`), and
/// some of its points fit on 8 H100s.
#[test]
fn a_mixtral_plan_recipe_plans_hf_eager() {
    let recipe = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/recipes/mixtral-8x7b-8xh100.yaml"
    );
    let out = memfit(&["plan", recipe, "--format", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["active_parameters"], 12_879_925_248u64);
    let points = v["points"].as_array().unwrap();
    assert_eq!(points.len(), 16);
    assert!(points.iter().all(|p| p["point"]["framework"] == "hf-eager"));
    assert!(points.iter().any(|p| p["status"] == "fits"));
    assert!(v["recommendation"].is_object());
}

/// LoRA on the attention of a mixture (its experts, router and shared
/// expert frozen) and LoRA and QLoRA on Qwen3's q/k-normed blocks train
/// on cpu and plan on meta byte for byte.
#[test]
fn lora_on_experts_models_and_qk_norms_trains_and_meta_matches_cpu() {
    use memfit::engine::lora::Target;
    use memfit::engine::{Finetune, LoraConfig};
    let qwen3 = import_hf_config(
        r#"{"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "max_position_embeddings": 64, "vocab_size": 256}"#,
        "config.json",
    )
    .unwrap();
    let attention = vec![Target::Q, Target::K, Target::V, Target::O];
    for (model, finetune, targets) in [
        (load_model("moe-tiny").unwrap(), Finetune::Lora, attention),
        (qwen3.clone(), Finetune::Lora, vec![]),
        (qwen3, Finetune::Qlora, vec![]),
    ] {
        let tc = TrainConfig {
            seq_len: 32,
            micro_batch: 2,
            lr: Some(1e-2),
            finetune,
            lora: LoraConfig {
                targets,
                ..LoraConfig::default()
            },
            ..TrainConfig::default()
        };
        train_and_predict(&model, &tc, 20);
    }
}

/// `memfit models` lists a mixture's active parameters and routing; a
/// dense model has neither field.
#[test]
fn models_lists_active_parameters_and_experts() {
    let out = memfit(&["models", "--format", "json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let model = |name: &str| {
        let models = v["models"].as_array().unwrap();
        models.iter().find(|m| m["name"] == name).unwrap().clone()
    };
    let m = model("mixtral-8x7b");
    assert_eq!(m["active_parameters"], 12_879_925_248u64);
    assert_eq!(
        (
            m["experts"]["n_experts"].as_u64(),
            m["experts"]["top_k"].as_u64()
        ),
        (Some(8), Some(2))
    );
    let d = model("llama-3.1-8b");
    assert!(d.get("active_parameters").is_none() && d.get("experts").is_none());
    let table = String::from_utf8(memfit(&["models"]).stdout).unwrap();
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("qwen3-30b-a3b") && l.contains("8 of 128")),
        "{table}"
    );
}
