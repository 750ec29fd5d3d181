//! QLoRA on mixtures of experts: the stacked experts are stored in NF4 as
//! the dense projections are, each grouped GEMM reads a dequantised copy
//! (a temporary, made again in the backward), the adapters on the
//! attention learn, and meta predicts cpu byte for byte on one rank, under
//! ddp and under expert parallelism.

use crate::common::{self, memfit};
use memfit::backend::cpu::CpuBackend;
use memfit::backend::meta::MetaBackend;
use memfit::config::ModelConfig;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::cluster::{Cluster, cpu_links, meta_links};
use memfit::engine::lora::{self, Target};
use memfit::engine::{
    Checkpointing, Engine, Finetune, LoraConfig, Precision, Sharding, TrainConfig,
};
use memfit::nf4::storage_bytes;

fn qlora(precision: Precision, checkpointing: Checkpointing) -> TrainConfig {
    TrainConfig {
        seq_len: 32,
        micro_batch: 2,
        lr: Some(1e-2),
        precision,
        checkpointing,
        finetune: Finetune::Qlora,
        lora: LoraConfig {
            targets: vec![Target::Q, Target::K, Target::V, Target::O],
            ..LoraConfig::default()
        },
        ..TrainConfig::default()
    }
}

/// What a rank's parameters take under QLoRA: every `nf4` tensor (the
/// projections and the experts' stacks, the experts `1/ep` of them) in
/// NF4, the rest and the adapters in `bytes` per value.
fn parameter_bytes(model: &ModelConfig, tc: &TrainConfig, bytes: u64, ep: usize) -> u64 {
    let (specs, idx) = model.param_layout();
    let nf4: Vec<usize> = idx.blocks.iter().flat_map(|b| b.nf4()).collect();
    let experts: Vec<usize> = idx.blocks.iter().flat_map(|b| b.experts()).collect();
    let numel = |i: usize| match experts.contains(&i) {
        true => specs[i].numel() / ep,
        false => specs[i].numel(),
    };
    let quantised: u64 = nf4.iter().map(|&i| storage_bytes(numel(i))).sum();
    let rest: u64 = (0..specs.len())
        .filter(|i| !nf4.contains(i))
        .map(|i| bytes * specs[i].numel() as u64)
        .sum();
    quantised + rest + bytes * lora::trainable_params(model, &tc.lora)
}

/// Loss falls on cpu, no step leaks, and meta's peak and timeline are
/// cpu's, in fp32 and bf16, with and without checkpointing.
#[test]
fn qlora_on_experts_trains_and_meta_matches_cpu() {
    let model = load_model("moe-tiny").unwrap();
    for precision in [Precision::Fp32, Precision::Bf16] {
        for ckpt in [Checkpointing::None, Checkpointing::Full] {
            let tc = qlora(precision, ckpt);
            let what = format!("{precision:?} {ckpt:?}");
            let mut cpu =
                Engine::new(model.clone(), tc.clone(), CpuBackend::new(2).unwrap(), None).unwrap();
            let resident = cpu.dev.tracker.live();
            let mut meta = Engine::new(
                model.clone(),
                tc.clone(),
                MetaBackend::emulating_cpu(),
                None,
            )
            .unwrap();
            let mut data = DataSource::synthetic(model.vocab_size, 11);
            let losses: Vec<f32> = (0..20)
                .map(|_| {
                    let b = data.next_batch(tc.micro_batch, tc.seq_len);
                    let r = cpu.step(std::slice::from_ref(&b)).unwrap();
                    meta.step(&[b]).unwrap();
                    assert_eq!(cpu.dev.tracker.live(), resident, "{what}: a step leaked");
                    r.loss.unwrap()
                })
                .collect();
            assert!(
                losses[19] < losses[0] - 0.1,
                "{what}: loss {} -> {}",
                losses[0],
                losses[19]
            );
            let bytes = precision.dtype().size() as u64;
            let peak = cpu.dev.tracker.peak_bytes();
            assert_eq!(peak, meta.dev.tracker.peak_bytes(), "{what}");
            assert_eq!(
                common::events(&cpu.dev.tracker),
                common::events(&meta.dev.tracker),
                "{what}"
            );
            assert_eq!(
                peak.parameters,
                parameter_bytes(&model, &tc, bytes, 1),
                "{what}"
            );
            // Frozen experts: gradients and optimizer state are the
            // adapters' alone.
            let adapters = lora::trainable_params(&model, &tc.lora);
            assert_eq!(peak.gradients, bytes * adapters, "{what}");
        }
    }
}

/// The NF4 experts compute what the 16-bit ones do, up to NF4's rounding:
/// the first loss is LoRA's (the same base in bf16) within a few percent,
/// not bit for bit.
#[test]
fn nf4_experts_lose_only_what_nf4_rounds() {
    let model = load_model("moe-tiny").unwrap();
    let tc = qlora(Precision::Bf16, Checkpointing::None);
    let lora = TrainConfig {
        finetune: Finetune::Lora,
        ..tc.clone()
    };
    let b = DataSource::synthetic(model.vocab_size, 3).next_batch(tc.micro_batch, tc.seq_len);
    let loss = |tc: TrainConfig| {
        let mut e = Engine::new(model.clone(), tc, CpuBackend::new(2).unwrap(), None).unwrap();
        e.eval_loss(&b).unwrap().unwrap()
    };
    let (l16, l4) = (loss(lora), loss(tc));
    assert!(
        l16 != l4 && (l16 - l4).abs() < 0.05 * l16,
        "bf16 {l16} vs NF4 {l4}"
    );
}

/// Mixtral-8x7B's 64 expert stacks in NF4: the parameters are exactly
/// `nf4::storage_bytes` of each, 4.127 bits a value, and a grouped GEMM's
/// dequantised gate|up stack (`8 x 28672 x 4096` bf16) is a temporary.
#[test]
fn mixtral_experts_are_nf4_storage_bytes() {
    let model = load_model("mixtral-8x7b").unwrap();
    let tc = TrainConfig {
        seq_len: 64,
        micro_batch: 1,
        checkpointing: Checkpointing::Full,
        ..qlora(Precision::Bf16, Checkpointing::Full)
    };
    let mut e = Engine::new(
        model.clone(),
        tc.clone(),
        MetaBackend::emulating_cuda(),
        None,
    )
    .unwrap();
    e.step_from(1, || unreachable!()).unwrap();
    let peak = e.dev.tracker.peak_bytes();
    assert_eq!(peak.parameters, parameter_bytes(&model, &tc, 2, 1));
    let (specs, idx) = model.param_layout();
    let experts: Vec<usize> = idx.blocks.iter().flat_map(|b| b.experts()).collect();
    assert_eq!(experts.len(), 64);
    let values: u64 = experts.iter().map(|&i| specs[i].numel() as u64).sum();
    let bytes: u64 = experts
        .iter()
        .map(|&i| storage_bytes(specs[i].numel()))
        .sum();
    let bits = 8.0 * bytes as f64 / values as f64;
    assert!((bits - 4.127).abs() < 0.001, "{bits} bits per expert value");
    assert!(peak.parameters < 25 << 30, "{}", peak.parameters);
    assert!(peak.temporaries >= 2 * 8 * 28672 * 4096, "{peak:?}");
}

fn mean(x: &[f32]) -> f32 {
    x.iter().sum::<f32>() / x.len() as f32
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

/// ddp on 2 ranks (dropless) and, with a capacity factor, experts split
/// over 2 of 4 ranks: every rank's peak and timeline are meta's, each
/// rank's experts are NF4 bytes of its share, and the loss falls.
#[test]
fn qlora_on_experts_over_ranks_meta_matches_cpu() {
    let mut model = load_model("moe-tiny").unwrap();
    model.moe.as_mut().unwrap().first_dense = 0;
    for (ranks, ep, cf, sharding) in [
        (2, 1, None, Sharding::Ddp),
        (4, 2, Some(1.25), Sharding::Ddp),
        (4, 2, Some(1.25), Sharding::Zero2),
    ] {
        let tc = TrainConfig {
            seq_len: 16,
            ranks,
            expert_parallel: ep,
            capacity_factor: cf,
            sharding,
            ..qlora(Precision::Bf16, Checkpointing::None)
        };
        let what = format!("{ranks} ranks, ep {ep}, {sharding:?}");
        let (cpu, meta, losses) = clusters(&model, &tc, 20);
        // Random tokens and 2 x 16 per rank: the mean of five steps falls.
        let (first, last) = (mean(&losses[..5]), mean(&losses[15..]));
        assert!(first - last > 0.05, "{what}: loss {losses:?}");
        let params = parameter_bytes(&model, &tc, 2, ep);
        for (c, m) in cpu.ranks.iter().zip(&meta.ranks) {
            let (cp, mp) = (c.dev.tracker.peak_bytes(), m.dev.tracker.peak_bytes());
            assert_eq!(cp, mp, "{what}");
            assert_eq!(
                common::events(&c.dev.tracker),
                common::events(&m.dev.tracker),
                "{what}"
            );
            assert_eq!(cp.parameters, params, "{what}");
        }
        for (i, dev) in cpu.release().into_iter().enumerate() {
            assert_eq!(dev.tracker.live().total(), 0, "{what}: rank {i} leaked");
        }
    }
}

/// `memfit run` trains QLoRA on the tiny mixture; hf-eager, whose
/// transformers leaves stacked experts in 16 bits, and adapters beyond
/// the attention are refused by name.
#[test]
fn the_cli_runs_qlora_on_experts_and_refuses_what_it_cannot() {
    let attention = ["--lora-targets", "q,k,v,o"];
    let base = ["run", "--model", "moe-tiny", "--finetune", "qlora"];
    let out = memfit(&[&base[..], &attention, &["--steps", "2", "--seq-len", "16"]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = memfit(&[&base[..], &["--steps", "1", "--seq-len", "16"]].concat());
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("--lora-targets") && err.contains("q,k,v,o"),
        "{err}"
    );
    let mixtral = [
        "run",
        "--model",
        "mixtral-8x7b",
        "--device",
        "meta",
        "--finetune",
        "qlora",
        "--framework",
        "hf-eager",
        "--seq-len",
        "64",
    ];
    let out = memfit(&[&mixtral[..], &attention].concat());
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("--framework") && err.contains("nn.Linear") && !err.contains("panicked"),
        "{err}"
    );
}

/// The recipe for the question users ask: the plan runs and prices the
/// experts in NF4 in its closed form. Replicated (ddp) the NF4 base alone
/// nearly fills a 4090, so nothing fits on one or two; with the experts
/// split over the two (`--expert-parallel 2`) each holds half of them and
/// it fits.
#[test]
fn mixtral_qlora_on_4090s_plans() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/recipes/mixtral-8x7b-qlora-2x4090.yaml"
    );
    let out = memfit(&["plan", path, "--format", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let points = doc["points"].as_array().unwrap();
    assert_eq!(points.len(), 8);
    for p in points.iter().filter(|p| p["status"] != "invalid") {
        let formula = p["closed_form"]["formula"].as_str().unwrap_or("");
        assert!(formula.contains("experts in NF4"), "{p}");
        let bpp = p["closed_form"]["bytes_per_param"].as_f64().unwrap();
        assert!(bpp < 0.6, "{formula}");
        let ep = p["point"]["expert_parallel"].as_u64().unwrap_or(1);
        let fits = p["status"] == "fits";
        assert_eq!(fits, ep == 2, "{p}");
    }
}

/// Replicated on two 4090s nothing fits, and the plan does not send a
/// QLoRA grid to ZeRO-3, which QLoRA refuses.
#[test]
fn a_qlora_grid_that_does_not_fit_is_not_sent_to_zero3() {
    let src = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/recipes/mixtral-8x7b-qlora-2x4090.yaml"
    );
    let text = std::fs::read_to_string(src).unwrap();
    let text = text.replace("expert_parallel: [1, 2]", "expert_parallel: [1]");
    let path = std::env::temp_dir().join(format!("qlora-experts-ddp-{}.yaml", std::process::id()));
    std::fs::write(&path, text).unwrap();
    let out = memfit(&["plan", path.to_str().unwrap()]);
    std::fs::remove_file(&path).unwrap();
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.contains("no point fits"), "{table}");
    assert!(!table.contains("zero3"), "{table}");
}
