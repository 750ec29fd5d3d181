//! LoRA: it learns, the base stays bit-identical, the merged model is the
//! same function, meta == cpu, PEFT's published parameter count, the
//! flags' errors, and data parallelism (DDP, ZeRO-1/2/3) over the adapters.

use crate::common;

use crate::common::training::tolerance;
use crate::common::{memfit, refused, stderr};
use memfit::backend::Backend;
use memfit::backend::cpu::CpuBackend;
use memfit::backend::meta::MetaBackend;
use memfit::config::ModelConfig;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::cluster::Cluster;
use memfit::engine::cluster::{cpu_links, meta_links};
use memfit::engine::lora::{self, Target};
use memfit::engine::{
    Attention, Checkpointing, Engine, Finetune, LoraConfig, Offload, Precision, Proj, Sharding,
    TrainConfig,
};
use memfit::memory::PeakBytes;

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
/// the LoRA model's loss; on a mixture each expert's `W_e + (alpha/r) B_e
/// A_e` too (and the shared expert's and dense block's MLPs).
#[test]
fn merged_weights_equal_base_plus_scaled_ba() {
    for name in ["gpt2-tiny", "llama-tiny", "moe-tiny"] {
        let model = load_model(name).unwrap();
        let mut tc = lora_tc(4);
        let mlp = [Target::Gate, Target::Up, Target::Down];
        tc.lora.targets = match name {
            "gpt2-tiny" => vec![Target::Q, Target::O, Target::Down],
            "moe-tiny" => [&[Target::K, Target::V, Target::Experts][..], &mlp].concat(),
            _ => [&[Target::K, Target::V][..], &mlp].concat(),
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
                let (w, experts) = match ad.proj {
                    Proj::Qkv => (bi.qkv_w, 1),
                    Proj::O => (bi.o_w, 1),
                    Proj::Up => (bi.up_w.unwrap(), 1),
                    Proj::Down => (bi.down_w.unwrap(), 1),
                    Proj::ExpertUp => (bi.moe.unwrap().up, model.moe.as_ref().unwrap().n_experts),
                    Proj::ExpertDown => {
                        (bi.moe.unwrap().down, model.moe.as_ref().unwrap().n_experts)
                    }
                };
                // Each expert's weight, A and B: one block of the stacks.
                let per = |len: usize| len / experts;
                let (pw, pa, pb) = (
                    per(merged[w].len()),
                    per(all[ad.a].len()),
                    per(all[ad.b].len()),
                );
                for x in 0..experts {
                    let a = &all[ad.a][x * pa..(x + 1) * pa];
                    let b = &all[ad.b][x * pb..(x + 1) * pb];
                    let r = a.len() / ad.inp;
                    let we = &mut merged[w][x * pw..(x + 1) * pw];
                    for o in 0..ad.width {
                        for i in 0..ad.inp {
                            let ba: f32 = (0..r).map(|k| b[o * r + k] * a[k * ad.inp + i]).sum();
                            we[(ad.off + o) * ad.inp + i] += scale * ba;
                        }
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
    let zero2 = memfit(&[&lora[..], &["--ranks", "2", "--sharding", "zero2"]].concat());
    assert!(zero2.status.success(), "{}", stderr(&zero2));
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
    let quantized: Vec<usize> = idx.blocks.iter().flat_map(|b| b.projections()).collect();
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
/// and without checkpointing (docs/finetuning.md records the table).
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

const LEVELS: [Sharding; 4] = [
    Sharding::Ddp,
    Sharding::Zero1,
    Sharding::Zero2,
    Sharding::Zero3,
];

fn cpu_cluster(model: &ModelConfig, tc: &TrainConfig) -> Cluster<CpuBackend> {
    let backends = (0..tc.ranks).map(|_| CpuBackend::new(1).unwrap()).collect();
    Cluster::new(model, tc, backends, cpu_links(model, tc), None).unwrap()
}

fn meta_cluster(model: &ModelConfig, tc: &TrainConfig) -> Cluster<MetaBackend> {
    let backends = (0..tc.ranks)
        .map(|_| MetaBackend::emulating_cpu())
        .collect();
    Cluster::new(model, tc, backends, meta_links(model, tc), None).unwrap()
}

/// The whole weights after training: zero3's shards put together, or the
/// ranks' own copies, which must agree.
fn full_params<B: Backend>(c: &Cluster<B>) -> Vec<Vec<f32>> {
    let e0 = &c.ranks[0];
    if e0.train.sharding == Sharding::Zero3 {
        let shards: Vec<_> = c
            .ranks
            .iter()
            .map(|e| e.param_shards_host().unwrap())
            .collect();
        return (0..shards[0].len())
            .map(|i| {
                let mut full = Vec::new();
                for (r, sh) in shards.iter().enumerate() {
                    let (_, own) = e0.shard_extent(i, r).unwrap();
                    full.extend_from_slice(&sh[i][..own]);
                }
                full
            })
            .collect();
    }
    let p0 = e0.params_host().unwrap();
    for e in &c.ranks[1..] {
        assert_eq!(e.params_host().unwrap(), p0, "ranks disagree");
    }
    p0
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Each rank's device and host peaks, and its allocation events.
type RankMemory = (PeakBytes, Option<PeakBytes>, Vec<String>);

fn rank_memory<B: Backend>(c: &Cluster<B>) -> Vec<RankMemory> {
    c.ranks
        .iter()
        .map(|e| {
            let t = &e.dev.tracker;
            let events = t
                .timeline()
                .iter()
                .map(|ev| format!("{} {} {}", ev.phase, ev.category.name(), ev.bytes))
                .collect();
            let host = e.dev.host.as_ref().map(|h| h.peak_bytes());
            (t.peak_bytes(), host, events)
        })
        .collect()
}

/// Trains `tc` (2 ranks of micro-batch 2) on cpu and meta for 3 steps, and
/// one rank of micro-batch 4 on the same sequences: the losses agree within
/// [`tolerance`], meta predicts every rank's device and host memory event
/// for event, and nothing leaks. Returns the cluster and the one rank.
fn against_one_rank(
    model: &ModelConfig,
    tc: &TrainConfig,
) -> (Cluster<CpuBackend>, Engine<CpuBackend>) {
    let what = format!(
        "{} {:?} {:?} {:?} {:?}",
        model.name, tc.finetune, tc.precision, tc.sharding, tc.offload
    );
    let one_tc = TrainConfig {
        micro_batch: tc.micro_batch * tc.ranks,
        ranks: 1,
        sharding: Sharding::None,
        offload: Offload::None,
        host_memory: None,
        ..tc.clone()
    };
    let mut one = Engine::new(model.clone(), one_tc, CpuBackend::new(1).unwrap(), None).unwrap();
    let mut cpu = cpu_cluster(model, tc);
    let mut meta = meta_cluster(model, tc);
    let (mut d1, mut dn) = (
        DataSource::synthetic(model.vocab_size, 11),
        DataSource::synthetic(model.vocab_size, 11),
    );
    let (b, t) = (tc.micro_batch, tc.seq_len);
    for step in 0..3 {
        let want = one.step(&[d1.next_batch(b * tc.ranks, t)]).unwrap();
        let got = cpu.step_from(1, || dn.next_batch(b, t)).unwrap();
        meta.step_from(1, || unreachable!("meta reads no data"))
            .unwrap();
        assert!(!got.skipped && !want.skipped, "{what}");
        let (w, g) = (want.loss.unwrap(), got.loss.unwrap());
        eprintln!("{what} step {step}: loss {g} vs one rank {w}");
        assert!(
            (w - g).abs() <= tolerance(tc.precision),
            "{what} step {step}: {g} vs {w}"
        );
    }
    let (c, m) = (rank_memory(&cpu), rank_memory(&meta));
    for (r, (c, m)) in c.iter().zip(&m).enumerate() {
        assert_eq!(c.0, m.0, "{what} rank {r}: device peaks");
        assert_eq!(c.1, m.1, "{what} rank {r}: host peaks");
        assert_eq!(c.2, m.2, "{what} rank {r}: events");
    }
    // Every rank allocates the same sizes in the same order.
    assert!(c.iter().all(|x| x.0 == c[0].0 && x.1 == c[0].1), "{what}");
    for (e, m) in cpu.ranks.iter().zip(&meta.ranks) {
        assert_eq!(
            (e.dev.meter.sent, e.dev.meter.received),
            (m.dev.meter.sent, m.dev.meter.received)
        );
    }
    for (i, dev) in meta.release().into_iter().enumerate() {
        assert_eq!(
            dev.tracker.live().total(),
            0,
            "{what}: meta rank {i} leaked"
        );
    }
    (cpu, one)
}

fn dp_lora(precision: Precision, sharding: Sharding) -> TrainConfig {
    TrainConfig {
        seq_len: 16,
        micro_batch: 2,
        grad_accum: 1,
        lr: Some(1e-3),
        precision,
        ranks: 2,
        sharding,
        finetune: Finetune::Lora,
        lora: LoraConfig {
            rank: 4,
            alpha: 8.0,
            ..LoraConfig::default()
        },
        ..TrainConfig::default()
    }
}

/// DDP and ZeRO-1/2/3 over LoRA: 2 ranks x micro-batch 2 train the adapters
/// as one rank x micro-batch 4 does, and the frozen base stays bit-identical
/// on every rank (zero3: in every rank's shard).
#[test]
fn data_parallel_lora_trains_as_one_rank() {
    for name in ["gpt2-tiny", "llama-tiny"] {
        let model = load_model(name).unwrap();
        let base = model.param_layout().0.len();
        for precision in [Precision::Fp32, Precision::Bf16] {
            for sharding in LEVELS {
                let tc = dp_lora(precision, sharding);
                let what = format!("{name} {precision:?} {sharding:?}");
                // What every rank starts from: a single rank's weights.
                let single = TrainConfig {
                    ranks: 1,
                    sharding: Sharding::None,
                    ..tc.clone()
                };
                let init = Engine::new(model.clone(), single, CpuBackend::new(1).unwrap(), None)
                    .unwrap()
                    .params_host()
                    .unwrap();
                let (cpu, one) = against_one_rank(&model, &tc);
                let want = one.params_host().unwrap();
                let got = full_params(&cpu);
                let d = max_diff(&got[base..], &want[base..]);
                eprintln!("{what}: adapters max |diff| {d:e}");
                assert!(d <= tolerance(precision), "{what}: adapters {d}");
                assert_ne!(
                    got[base..],
                    init[base..],
                    "{what}: the adapters did not train"
                );
                assert_eq!(got[..base], init[..base], "{what}: a frozen weight moved");
                if sharding == Sharding::Zero3 {
                    for (r, e) in cpu.ranks.iter().enumerate() {
                        let sh = e.param_shards_host().unwrap();
                        for i in 0..base {
                            let (s, own) = e.shard_extent(i, r).unwrap();
                            assert_eq!(
                                sh[i][..own],
                                init[i][r * s..r * s + own],
                                "{what}: rank {r}'s shard of frozen tensor {i} moved"
                            );
                        }
                    }
                } else {
                    // full_params checked every rank's copy against rank 0's.
                    for e in &cpu.ranks {
                        let g = e.grads_host().unwrap();
                        assert!(g[..base].iter().all(Vec::is_empty), "{what}");
                    }
                }
                for (i, dev) in cpu.release().into_iter().enumerate() {
                    assert_eq!(dev.tracker.live().total(), 0, "{what}: rank {i} leaked");
                }
            }
        }
    }
}

/// QLoRA with its NF4 base replicated (ddp, zero1, zero2) trains as one
/// rank does, and meta predicts it.
#[test]
fn data_parallel_qlora_trains_as_one_rank() {
    let model = load_model("llama-tiny").unwrap();
    for sharding in [Sharding::Ddp, Sharding::Zero1, Sharding::Zero2] {
        let tc = TrainConfig {
            finetune: Finetune::Qlora,
            ..dp_lora(Precision::Bf16, sharding)
        };
        let (cpu, _) = against_one_rank(&model, &tc);
        for dev in cpu.release() {
            assert_eq!(dev.tracker.live().total(), 0);
        }
    }
}

/// ZeRO-Offload over LoRA: the adapters' fp32 master, moments and gradient
/// shard go to the host; training is unchanged and meta predicts the host
/// too.
#[test]
fn offloaded_lora_trains_as_one_rank() {
    let model = load_model("llama-tiny").unwrap();
    let mut specs = model.param_layout().0;
    let base = specs.len();
    let tc0 = dp_lora(Precision::Bf16, Sharding::Zero2);
    lora::layout(&model, &tc0.lora, &mut specs);
    let shard_a: u64 = specs[base..]
        .iter()
        .map(|s| s.numel().div_ceil(2) as u64)
        .sum();
    let shard_all: u64 = specs.iter().map(|s| s.numel().div_ceil(2) as u64).sum();
    for (sharding, offload) in [
        (Sharding::Zero1, Offload::Optimizer),
        (Sharding::Zero2, Offload::Optimizer),
        (Sharding::Zero3, Offload::OptimizerParams),
    ] {
        let tc = TrainConfig {
            offload,
            ..dp_lora(Precision::Bf16, sharding)
        };
        let (cpu, _) = against_one_rank(&model, &tc);
        for e in &cpu.ranks {
            let (dev, host) = (
                e.dev.tracker.peak_bytes(),
                e.dev.host.as_ref().unwrap().peak_bytes(),
            );
            assert_eq!(dev.optimizer, 0, "{sharding:?}");
            // fp32 master, m and v of the adapters' shard; its fp32 gradient.
            assert_eq!(host.optimizer, 12 * shard_a, "{sharding:?}");
            assert_eq!(host.gradients, 4 * shard_a, "{sharding:?}");
            let params = match offload.params() {
                true => 2 * shard_all,
                false => 0,
            };
            assert_eq!(host.parameters, params, "{sharding:?}");
        }
    }
}

/// Per-rank memory with LoRA on Llama-3.1-8B (r=16 on the seven projections,
/// 41,943,040 adapter parameters) over 2 ranks: gradients, master weights
/// and optimizer state are the adapters' alone (sharded from zero1 on, the
/// gradients from zero2 on), the frozen base is whole on every rank under
/// ddp and zero1/2 and 1/N under zero3, and DDP's buckets hold the adapters'
/// gradients only.
#[test]
fn per_rank_lora_memory_is_the_adapters_state() {
    let model = load_model("llama-3.1-8b").unwrap();
    let n = 2usize;
    let cfg = LoraConfig {
        rank: 16,
        alpha: 32.0,
        ..LoraConfig::default()
    };
    let (mut specs, _) = model.param_layout();
    let base = specs.len();
    let ads = lora::layout(&model, &cfg, &mut specs);
    let numel = |i: usize| specs[i].numel() as u64;
    let shard = |i: usize| specs[i].numel().div_ceil(n) as u64;
    let psi: u64 = (0..base).map(numel).sum();
    let a: u64 = (base..specs.len()).map(numel).sum();
    assert_eq!(a, 41_943_040);
    let shard_a: u64 = (base..specs.len()).map(shard).sum();
    let shard_all: u64 = (0..specs.len()).map(shard).sum();
    // FSDP units with the adapters in their blocks: the largest pair of
    // neighbours is what zero3 holds gathered at once.
    let mut unit = vec![0u64; model.n_layer + 2];
    for (i, s) in specs.iter().enumerate() {
        let name = s.name.to_string();
        let u = match name.strip_prefix("h.") {
            Some(rest) => 1 + rest.split('.').next().unwrap().parse::<usize>().unwrap(),
            None if name.starts_with("wte") => 0,
            None => model.n_layer + 1,
        };
        unit[u] += numel(i);
    }
    let biggest_pair = unit.windows(2).map(|w| w[0] + w[1]).max().unwrap();
    let unit_a: u64 = ads[0].iter().map(|ad| numel(ad.a) + numel(ad.b)).sum();
    for precision in [Precision::Fp32, Precision::Bf16] {
        let (w, k) = match precision {
            Precision::Fp32 => (4, 8),
            // fp32 master + m + v
            _ => (2, 12),
        };
        let tc = |sharding, bucket_view| TrainConfig {
            seq_len: 256,
            micro_batch: 1,
            precision,
            attention: Attention::Fused,
            ranks: if sharding == Sharding::None { 1 } else { n },
            sharding,
            bucket_view,
            finetune: Finetune::Lora,
            lora: cfg.clone(),
            ..TrainConfig::default()
        };
        let run = |sharding, view| {
            let t = tc(sharding, view);
            let mut c = meta_cluster(&model, &t);
            let before = c.ranks[0].dev.meter.sent;
            c.step_from(1, || unreachable!()).unwrap();
            let p: Vec<PeakBytes> = c.ranks.iter().map(|e| e.dev.tracker.peak_bytes()).collect();
            assert!(p.iter().all(|r| *r == p[0]), "ranks are symmetric");
            (p[0], c.ranks[0].dev.meter.sent - before)
        };
        let (none, _) = run(Sharding::None, false);
        let (ddp, ddp_sent) = run(Sharding::Ddp, false);
        let (view, _) = run(Sharding::Ddp, true);
        let (z1, _) = run(Sharding::Zero1, false);
        let (z2, z2_sent) = run(Sharding::Zero2, false);
        let (z3, _) = run(Sharding::Zero3, false);
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        for (what, p) in [
            ("one rank", none),
            ("ddp", ddp),
            ("ddp+view", view),
            ("zero1", z1),
            ("zero2", z2),
            ("zero3", z3),
        ] {
            eprintln!(
                "llama-3.1-8b lora r=16 {precision:?} N=2 {what:>8}: params {:9.1} grads {:7.1} optimizer {:7.1} comm {:6.1} MiB",
                mib(p.parameters),
                mib(p.gradients),
                mib(p.optimizer),
                mib(p.communication)
            );
        }
        let full_params = w * (psi + a);
        assert_eq!(
            (none.parameters, none.gradients, none.optimizer),
            (full_params, w * a, k * a)
        );
        // DDP: adapters' gradients all-reduced through buckets of their own.
        assert_eq!(
            (ddp.parameters, ddp.gradients, ddp.optimizer),
            (full_params, w * a, k * a)
        );
        assert_eq!(ddp.communication, w * a);
        assert_eq!(view.communication, 0);
        // zero1: the adapters' state sharded; their whole gradients plus the
        // step's shards.
        assert_eq!(
            (z1.parameters, z1.gradients, z1.optimizer),
            (full_params, w * (a + shard_a), k * shard_a)
        );
        // zero2: the adapters' gradient shards plus one block's adapters'
        // whole gradients while its backward runs.
        assert_eq!(
            (z2.parameters, z2.gradients, z2.optimizer),
            (full_params, w * (shard_a + unit_a), k * shard_a)
        );
        // zero3: every weight 1/N, two units gathered at once.
        assert_eq!(z3.parameters, w * (shard_all + biggest_pair));
        assert_eq!((z3.gradients, z3.optimizer), (z2.gradients, z2.optimizer));
        // The all-reduce (ddp) and reduce-scatter + all-gather (zero2) move
        // 2 (N-1)/N of the adapters' gradient bytes, not the model's.
        let want = 2.0 * (n - 1) as f64 / n as f64 * (w * a) as f64;
        for (what, sent) in [("ddp", ddp_sent), ("zero2", z2_sent)] {
            assert!(
                (sent as f64 / want - 1.0).abs() < 0.01,
                "{what}: {sent} vs {want}"
            );
        }
    }
}

/// Pipelines stay refused with LoRA, and QLoRA under zero3 (its NF4 blocks
/// would be cut by per-tensor shards), each naming the flag.
#[test]
fn lora_refusals_name_the_flag() {
    let lora = [
        "run",
        "--device",
        "meta",
        "--model",
        "llama-tiny",
        "--finetune",
    ];
    let err = refused(
        &[
            &lora[..],
            &[
                "lora",
                "--ranks",
                "2",
                "--pipeline-stages",
                "2",
                "--sharding",
                "ddp",
            ],
        ]
        .concat(),
        "--pipeline-stages",
    );
    assert!(err.contains("--finetune lora"), "{err}");
    let err = refused(
        &[
            &lora[..],
            &[
                "qlora",
                "--precision",
                "bf16",
                "--ranks",
                "2",
                "--sharding",
                "zero3",
            ],
        ]
        .concat(),
        "--sharding",
    );
    assert!(
        err.contains("qlora") && err.contains("zero3") && err.contains("NF4"),
        "{err}"
    );
    for sharding in ["ddp", "zero1", "zero2"] {
        let out = memfit(
            &[
                &lora[..],
                &[
                    "qlora",
                    "--precision",
                    "bf16",
                    "--ranks",
                    "2",
                    "--sharding",
                    sharding,
                ],
            ]
            .concat(),
        );
        assert!(out.status.success(), "{sharding}: {}", stderr(&out));
    }
}

/// `memfit plan` prices LoRA on two GPUs: zero2's per-GPU optimizer state
/// is half the single GPU's (padding aside), and QLoRA under zero3 is an
/// invalid point with its reason.
#[test]
fn plan_prices_data_parallel_lora() {
    let dir = common::scratch("lora-plan");
    let recipe = dir.join("plan.yaml");
    std::fs::write(
        &recipe,
        "model: llama-3.1-8b\nhardware: h100-sxm-80gb\nseq_len: 512\nglobal_batch: 8\nlora_rank: 16\nlora_alpha: 32\ngrid:\n  micro_batch: [1]\n  precision: [bf16]\n  attention: [fused]\n  checkpointing: [full]\n  framework: [memfit]\n  finetune: [lora, qlora]\n  gpus: [1, 2]\n  sharding: [none, zero2, zero3]\n",
    )
    .unwrap();
    let out = memfit(&["plan", recipe.to_str().unwrap(), "--format", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let plan = common::json(&out);
    let find = |tune: &str, gpus: u64, sharding: &str| {
        plan["points"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| {
                p["point"]["finetune"] == tune
                    && p["point"]["gpus"] == gpus
                    && p["point"]["sharding"] == sharding
            })
            .unwrap_or_else(|| panic!("{tune} {gpus} {sharding} planned"))
            .clone()
    };
    let one = find("lora", 1, "none");
    let z2 = find("lora", 2, "zero2");
    assert_eq!(one["status"], "fits", "{one}");
    assert_eq!(z2["status"], "fits", "{z2}");
    let opt = |p: &serde_json::Value| p["peak_bytes"]["optimizer"].as_u64().unwrap();
    // 12 bytes per adapter parameter on one GPU; over two, each adapter
    // tensor's shard is ceil(n/2) (448 tensors, so at most 448 x 12 bytes
    // of padding).
    assert_eq!(opt(&one), 12 * 41_943_040);
    let diff = (2 * opt(&z2)).abs_diff(opt(&one));
    assert!(diff <= 2 * 12 * 448, "{} vs {}", opt(&z2), opt(&one));
    assert!(find("lora", 2, "zero3")["status"] == "fits");
    assert!(find("qlora", 2, "zero2")["status"] == "fits");
    let q3 = find("qlora", 2, "zero3");
    assert_eq!(q3["status"], "invalid", "{q3}");
    assert!(q3["reason"].as_str().unwrap().contains("NF4"), "{q3}");
}

/// meta predicts every rank of data-parallel LoRA with the other knobs:
/// three ranks (every adapter shard padded), checkpointing (zero3 gathers
/// the base again for the recomputation), 8-bit AdamW on shards, fp16's
/// loss scale, and hf-eager's tensors.
#[test]
fn data_parallel_lora_meta_equals_cpu_with_the_knobs() {
    use memfit::engine::{Framework, Optimizer};
    for name in ["gpt2-tiny", "llama-tiny"] {
        let model = load_model(name).unwrap();
        for (ranks, precision, optimizer, checkpointing, attention, framework) in [
            (
                3,
                Precision::Fp32,
                Optimizer::Adamw8bit,
                Checkpointing::None,
                Attention::Eager,
                Framework::HfEager,
            ),
            (
                3,
                Precision::Bf16,
                Optimizer::Adamw,
                Checkpointing::Full,
                Attention::Fused,
                Framework::Memfit,
            ),
            (
                2,
                Precision::Fp16,
                Optimizer::Sgd,
                Checkpointing::Full,
                Attention::Eager,
                Framework::Memfit,
            ),
        ] {
            for sharding in LEVELS {
                let what = format!("{name} N={ranks} {sharding:?} {precision:?} {framework:?}");
                let tc = TrainConfig {
                    grad_accum: 2,
                    ranks,
                    optimizer,
                    checkpointing,
                    attention,
                    framework,
                    bucket_view: ranks == 3 && sharding == Sharding::Ddp,
                    lr: Some(1e-2),
                    ..dp_lora(precision, sharding)
                };
                let mut cpu = cpu_cluster(&model, &tc);
                let mut meta = meta_cluster(&model, &tc);
                let mut data = DataSource::synthetic(model.vocab_size, 5);
                for _ in 0..2 {
                    let r = cpu.step_from(2, || data.next_batch(2, 16)).unwrap();
                    assert!(!r.skipped && r.loss.unwrap().is_finite(), "{what}");
                    meta.step_from(2, || unreachable!()).unwrap();
                }
                let (c, m) = (rank_memory(&cpu), rank_memory(&meta));
                assert_eq!(c, m, "{what}");
                assert!(c.iter().all(|x| x.0 == c[0].0), "{what}: ranks differ");
                for (e, m) in cpu.ranks.iter().zip(&meta.ranks) {
                    assert_eq!(
                        (e.dev.meter.sent, e.dev.meter.received),
                        (m.dev.meter.sent, m.dev.meter.received)
                    );
                }
                for (i, dev) in cpu.release().into_iter().enumerate() {
                    assert_eq!(dev.tracker.live().total(), 0, "{what}: rank {i} leaked");
                }
            }
        }
    }
}
