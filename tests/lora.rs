//! LoRA: it learns, the base stays bit-identical, the merged model is the
//! same function, meta == cpu, PEFT's published parameter count, and the
//! flags' errors.

mod common;

use common::{memfit, refused, stderr};
use memfit::backend::cpu::CpuBackend;
use memfit::backend::meta::MetaBackend;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::lora::{self, Target};
use memfit::engine::{
    Attention, Checkpointing, Engine, Finetune, LoraConfig, Precision, Proj, TrainConfig,
};

fn lora_tc(rank: usize) -> TrainConfig {
    TrainConfig {
        seq_len: 32,
        micro_batch: 4,
        lr: Some(1e-2),
        finetune: Finetune::Lora,
        lora: LoraConfig {
            rank,
            alpha: 2.0 * rank as f32,
            ..LoraConfig::default()
        },
        ..TrainConfig::default()
    }
}

/// Byte-level text (both tiny models have a 256-token vocabulary or more).
fn text(_vocab: usize) -> DataSource {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/text");
    DataSource::text(&dir, 1337).unwrap()
}

#[test]
fn lora_learns_and_leaves_the_base_bit_identical() {
    for name in ["gpt2-tiny", "llama-tiny"] {
        let model = load_model(name).unwrap();
        let tc = lora_tc(8);
        let mut e =
            Engine::new(model.clone(), tc.clone(), CpuBackend::new(2).unwrap(), None).unwrap();
        let before = e.params_host().unwrap();
        let base = model.param_layout().0.len();
        let mut data = text(model.vocab_size);
        let mut losses = Vec::new();
        for _ in 0..80 {
            let b = data.next_batch(tc.micro_batch, tc.seq_len);
            losses.push(e.step(&[b]).unwrap().loss.unwrap());
        }
        // Means over five steps (a batch's loss moves by about 0.05).
        let first: f32 = losses[..5].iter().sum::<f32>() / 5.0;
        let last: f32 = losses[75..].iter().sum::<f32>() / 5.0;
        assert!(last < first - 0.15, "{name}: loss {first} -> {last}");
        let after = e.params_host().unwrap();
        assert_eq!(
            before[..base],
            after[..base],
            "{name}: a frozen weight moved"
        );
        assert_ne!(
            before[base..],
            after[base..],
            "{name}: the adapters did not train"
        );
        assert!(e.grads_host().unwrap()[..base].iter().all(|g| g.is_empty()));
    }
}

/// After training, W + (alpha/r) B A in a fully trainable engine computes
/// the LoRA model's loss.
#[test]
fn merged_weights_equal_base_plus_scaled_ba() {
    for name in ["gpt2-tiny", "llama-tiny"] {
        let model = load_model(name).unwrap();
        let mut tc = lora_tc(4);
        tc.lora.targets = match name {
            "gpt2-tiny" => vec![Target::Q, Target::O, Target::Down],
            _ => vec![Target::K, Target::V, Target::Gate, Target::Up, Target::Down],
        };
        let mut e =
            Engine::new(model.clone(), tc.clone(), CpuBackend::new(2).unwrap(), None).unwrap();
        let mut data = text(model.vocab_size);
        for _ in 0..10 {
            let b = data.next_batch(tc.micro_batch, tc.seq_len);
            e.step(&[b]).unwrap();
        }
        let (specs, idx) = model.param_layout();
        let all = e.params_host().unwrap();
        let mut merged: Vec<Vec<f32>> = all[..specs.len()].to_vec();
        let mut lspecs = specs.clone();
        let adapters = lora::layout(&model, &tc.lora, &mut lspecs);
        let scale = tc.lora.scale();
        for (l, ads) in adapters.iter().enumerate() {
            let bi = &idx.blocks[l];
            for ad in ads {
                let w = match ad.proj {
                    Proj::Qkv => bi.qkv_w,
                    Proj::O => bi.o_w,
                    Proj::Up => bi.up_w,
                    Proj::Down => bi.down_w,
                };
                let (a, b) = (&all[ad.a], &all[ad.b]);
                let r = a.len() / ad.inp;
                for o in 0..ad.width {
                    for i in 0..ad.inp {
                        let ba: f32 = (0..r).map(|k| b[o * r + k] * a[k * ad.inp + i]).sum();
                        merged[w][(ad.off + o) * ad.inp + i] += scale * ba;
                    }
                }
            }
        }
        let full_tc = TrainConfig {
            finetune: Finetune::Full,
            lora: LoraConfig::default(),
            ..tc.clone()
        };
        let mut full =
            Engine::new(model.clone(), full_tc, CpuBackend::new(2).unwrap(), None).unwrap();
        full.set_params_host(&merged);
        let batch = data.next_batch(tc.micro_batch, tc.seq_len);
        let l_lora = e.eval_loss(&batch).unwrap().unwrap();
        let l_full = full.eval_loss(&batch).unwrap().unwrap();
        assert!(
            (l_lora - l_full).abs() <= 1e-5 * l_full.abs(),
            "{name}: LoRA {l_lora} vs merged {l_full}"
        );
    }
}

#[test]
fn lora_meta_equals_cpu_byte_for_byte() {
    for name in ["gpt2-tiny", "llama-tiny"] {
        let model = load_model(name).unwrap();
        for (prec, attn, ckpt) in [
            (Precision::Fp32, Attention::Eager, Checkpointing::None),
            (Precision::Bf16, Attention::Fused, Checkpointing::Full),
        ] {
            let tc = TrainConfig {
                precision: prec,
                attention: attn,
                checkpointing: ckpt,
                grad_accum: 2,
                ..lora_tc(4)
            };
            let mut cpu =
                Engine::new(model.clone(), tc.clone(), CpuBackend::new(2).unwrap(), None).unwrap();
            let mut meta = Engine::new(
                model.clone(),
                tc.clone(),
                MetaBackend::emulating_cpu(),
                None,
            )
            .unwrap();
            let mut data = DataSource::synthetic(model.vocab_size, 1);
            for _ in 0..2 {
                let b: Vec<_> = (0..2).map(|_| data.next_batch(4, 32)).collect();
                cpu.step(&b).unwrap();
                meta.step(&b).unwrap();
            }
            let (c, m) = (&cpu.dev.tracker, &meta.dev.tracker);
            let what = format!("{name} {prec:?} {attn:?} {ckpt:?}");
            assert_eq!(c.peak_bytes(), m.peak_bytes(), "{what}");
            assert_eq!(
                common::events(c),
                common::events(m),
                "{what}: timelines differ"
            );
            // Frozen weights hold no gradient and no optimizer state: the
            // gradients are the adapters', in the working precision.
            let p = c.peak_bytes();
            let adapters = lora::trainable_params(&model, &tc.lora);
            let size = if prec == Precision::Fp32 { 4 } else { 2 };
            assert_eq!(p.gradients, adapters * size, "{what}: {p:?}");
        }
    }
}

/// PEFT prints `trainable params: 41,943,040` for Llama-3.1-8B with r=16 on
/// q,k,v,o,gate,up,down: per layer r (in + out) summed over the seven, x 32.
#[test]
fn llama_8b_rank_16_on_seven_projections_trains_41943040_parameters() {
    let model = load_model("llama-3.1-8b").unwrap();
    let cfg = LoraConfig {
        rank: 16,
        alpha: 32.0,
        ..LoraConfig::default()
    };
    let (c, i, kv) = (4096u64, 14336u64, 1024u64);
    let per_layer = 16 * ((c + c) + (c + kv) * 2 + (c + c) + 2 * (c + i) + (i + c));
    assert_eq!(per_layer * 32, 41_943_040);
    assert_eq!(lora::trainable_params(&model, &cfg), 41_943_040);
}

#[test]
fn lora_flags_are_checked() {
    refused(
        &["run", "--device", "meta", "--lora-rank", "4"],
        "--finetune lora",
    );
    let lora = ["run", "--device", "meta", "--finetune", "lora"];
    refused(
        &[&lora[..], &["--lora-targets", "q,gate"]].concat(),
        "no gate",
    );
    refused(
        &[&lora[..], &["--ranks", "2", "--sharding", "zero2"]].concat(),
        "--finetune",
    );
    let out = memfit(&[
        "run",
        "--model",
        "llama-tiny",
        "--finetune",
        "lora",
        "--lora-targets",
        "q,v",
        "--steps",
        "2",
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
}

/// QLoRA's base: every block projection in NF4 (0.5 byte per parameter
/// plus 0.127 bits of double-quantised absmax, QLoRA section 3), the rest
/// in bf16, and the adapters' bf16 working copy, exactly.
#[test]
fn qlora_base_bytes_are_nf4_storage() {
    let model = load_model("llama-3.1-8b").unwrap();
    let tc = TrainConfig {
        seq_len: 64,
        micro_batch: 1,
        precision: Precision::Bf16,
        finetune: Finetune::Qlora,
        lora: LoraConfig {
            rank: 16,
            alpha: 32.0,
            ..LoraConfig::default()
        },
        ..TrainConfig::default()
    };
    let mut e = Engine::new(
        model.clone(),
        tc.clone(),
        MetaBackend::emulating_cuda(),
        None,
    )
    .unwrap();
    e.step_from(1, || unreachable!()).unwrap();
    let (specs, idx) = model.param_layout();
    let quantized: Vec<usize> = idx
        .blocks
        .iter()
        .flat_map(|b| [b.qkv_w, b.o_w, b.up_w, b.down_w])
        .collect();
    let nf4: u64 = quantized
        .iter()
        .map(|&i| memfit::nf4::storage_bytes(specs[i].numel()))
        .sum();
    let rest: u64 = (0..specs.len())
        .filter(|i| !quantized.contains(i))
        .map(|i| 2 * specs[i].numel() as u64)
        .sum();
    let adapters = 2 * lora::trainable_params(&model, &tc.lora);
    assert_eq!(e.dev.tracker.peak_bytes().parameters, nf4 + rest + adapters);
    let q: u64 = quantized.iter().map(|&i| specs[i].numel() as u64).sum();
    let bits = 8.0 * nf4 as f64 / q as f64;
    assert!(
        (bits - 4.127).abs() < 0.001,
        "{bits} bits per NF4 parameter"
    );
    // The 16-bit copy a matmul reads is a temporary, never resident.
    assert!(e.dev.tracker.peak_bytes().temporaries >= 2 * 14336 * 4096 * 2);
}

/// QLoRA trains for real on cpu: the NF4 base is quantised once, each
/// matmul reads its dequantised copy, the adapters learn, and meta predicts
/// every allocation.
#[test]
fn qlora_trains_on_cpu_and_meta_predicts_it() {
    let model = load_model("llama-tiny").unwrap();
    let tc = TrainConfig {
        precision: Precision::Bf16,
        finetune: Finetune::Qlora,
        ..lora_tc(8)
    };
    let mut cpu =
        Engine::new(model.clone(), tc.clone(), CpuBackend::new(2).unwrap(), None).unwrap();
    let mut meta = Engine::new(
        model.clone(),
        tc.clone(),
        MetaBackend::emulating_cpu(),
        None,
    )
    .unwrap();
    let mut data = text(model.vocab_size);
    let mut losses = Vec::new();
    for _ in 0..60 {
        let b = data.next_batch(tc.micro_batch, tc.seq_len);
        losses.push(cpu.step(std::slice::from_ref(&b)).unwrap().loss.unwrap());
        meta.step(&[b]).unwrap();
    }
    let first: f32 = losses[..5].iter().sum::<f32>() / 5.0;
    let last: f32 = losses[55..].iter().sum::<f32>() / 5.0;
    assert!(last < first - 0.15, "loss {first} -> {last}");
    assert_eq!(cpu.dev.tracker.peak_bytes(), meta.dev.tracker.peak_bytes());
    assert_eq!(
        common::events(&cpu.dev.tracker),
        common::events(&meta.dev.tracker)
    );
    // The 4-bit base loses what NF4 rounds: the first loss is the base
    // model's within a few percent, not bit for bit.
    let full = TrainConfig {
        finetune: Finetune::Full,
        ..tc.clone()
    };
    let mut base = Engine::new(model.clone(), full, CpuBackend::new(2).unwrap(), None).unwrap();
    let mut fresh =
        Engine::new(model.clone(), tc.clone(), CpuBackend::new(2).unwrap(), None).unwrap();
    let b = text(model.vocab_size).next_batch(4, 32);
    let (lb, lq) = (
        base.eval_loss(&b).unwrap().unwrap(),
        fresh.eval_loss(&b).unwrap().unwrap(),
    );
    assert!(
        lb != lq && (lb - lq).abs() < 0.05 * lb,
        "base {lb} vs NF4 {lq}"
    );
}

/// "Can I fine-tune Llama-3.1-8B on a 24 GB GPU?" at T=2048, as `memfit
/// plan` answers it (hf-eager, an RTX 4090): the largest micro-batch with
/// and without checkpointing (the README records the table).
#[test]
fn the_24_gb_question() {
    let dir = common::scratch("lora-4090");
    let recipe = dir.join("l8.yaml");
    std::fs::write(
        &recipe,
        "model: llama-3.1-8b\nhardware: rtx-4090\nseq_len: 2048\nglobal_batch: 16\nlora_rank: 16\nlora_alpha: 32\ngrid:\n  micro_batch: [1, 2, 4, 8, 16]\n  precision: [bf16]\n  checkpointing: [none, full]\n  attention: [fused]\n  finetune: [lora, qlora]\n",
    )
    .unwrap();
    let out = memfit(&["plan", recipe.to_str().unwrap(), "--format", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let plan = common::json(&out);
    let largest = |tune: &str, ckpt: &str| {
        plan["points"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| {
                p["point"]["finetune"] == tune
                    && p["point"]["checkpointing"] == ckpt
                    && p["status"] == "fits"
            })
            .map(|p| p["point"]["micro_batch"].as_u64().unwrap())
            .max()
    };
    assert_eq!(largest("lora", "none"), None);
    assert_eq!(largest("lora", "full"), Some(1));
    assert_eq!(largest("qlora", "none"), None);
    assert_eq!(largest("qlora", "full"), Some(2));
}

/// A LoRA sweep measures what it predicts (the recipe's rank reaches the
/// trials) and exports PEFT's LoraConfig with it.
#[test]
fn lora_sweep_measures_its_prediction_and_exports_peft() {
    let dir = common::scratch("lora-sweep");
    let recipe = dir.join("lora.yaml");
    std::fs::write(
        &recipe,
        "model: gpt2-tiny\nhardware: t4\ndevice: cpu:limit=64MiB\nseq_len: 32\nglobal_batch: 8\nlora_rank: 4\nlora_alpha: 8\nlora_targets: [q, down]\ngrid:\n  micro_batch: [4, 8]\n  precision: [fp32]\n  finetune: [lora]\n",
    )
    .unwrap();
    let out_dir = dir.join("out");
    let out = memfit(&[
        "sweep",
        recipe.to_str().unwrap(),
        "--out",
        out_dir.to_str().unwrap(),
        "--steps",
        "2",
        "--max-steps",
        "3",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("report.json")).unwrap())
            .unwrap();
    let trials = report["trials"].as_array().unwrap();
    assert_eq!(trials.len(), 2);
    for t in trials {
        assert_eq!(
            t["predicted"]["peak_bytes"], t["measured"]["peak_bytes"],
            "{}",
            t["id"]
        );
    }
    let peft = std::fs::read_to_string(out_dir.join("peft_config.py")).unwrap();
    assert!(
        peft.contains("r=4,") && peft.contains("lora_alpha=8"),
        "{peft}"
    );
    assert!(
        peft.contains("target_modules=[\"c_attn\", \"mlp.c_proj\"]"),
        "{peft}"
    );
    let pinned = std::fs::read_to_string(out_dir.join("recommended.yaml")).unwrap();
    assert!(
        pinned.contains("finetune: [lora]") && pinned.contains("lora_rank: 4"),
        "{pinned}"
    );
}
