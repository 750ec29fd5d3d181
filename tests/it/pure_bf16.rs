//! Pure bf16 (`--precision bf16-pure`: torchtune's `dtype: bf16`) and the
//! optimizer step in the backward (`--optimizer-in-backward`: torchtune's
//! `optimizer_in_bwd`): meta predicts cpu per category and event for event
//! on every layout built, the states each keeps, the numerics, what plans
//! show and price, and the refusals.

use crate::common::{self, json, memfit, ok_json, refused, scratch, stderr};

use memfit::backend::cpu::CpuBackend;
use memfit::backend::meta::MetaBackend;
use memfit::config::ModelConfig;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::cluster::{Cluster, cpu_links, meta_links};
use memfit::engine::{
    Checkpointing, Engine, Finetune, Framework, Optimizer, OptimizerImpl, Precision, Sharding,
    TrainConfig,
};
use memfit::memory::Category;

fn base() -> TrainConfig {
    TrainConfig {
        seq_len: 16,
        micro_batch: 2,
        grad_accum: 1,
        precision: Precision::Bf16Pure,
        ..TrainConfig::default()
    }
}

/// The same knobs with the optimizer in the backward (no clipping, as
/// torchtune requires).
fn in_bwd(tc: &TrainConfig) -> TrainConfig {
    TrainConfig {
        optimizer_in_backward: true,
        grad_clip: 0.0,
        ..tc.clone()
    }
}

/// `tc` on cpu and on meta, `steps` steps each over every rank: the cpu
/// losses, and that every rank's peaks and allocation timeline agree and
/// nothing leaks.
fn meta_equals_cpu(model: &ModelConfig, tc: &TrainConfig, steps: usize, what: &str) -> Vec<f32> {
    let n = tc.ranks;
    let cpus = (0..n).map(|_| CpuBackend::new(1).unwrap()).collect();
    let metas = (0..n).map(|_| MetaBackend::emulating_cpu()).collect();
    let mut cpu = Cluster::new(model, tc, cpus, cpu_links(model, tc), None).unwrap();
    let mut meta = Cluster::new(model, tc, metas, meta_links(model, tc), None).unwrap();
    let mut data = DataSource::synthetic(model.vocab_size, 7);
    let (b, t, k) = (tc.micro_batch, tc.seq_len, tc.grad_accum);
    let mut losses = Vec::new();
    for _ in 0..steps {
        let r = cpu.step_from(k, || data.next_batch(b, t)).unwrap();
        losses.push(r.loss.unwrap());
        meta.step_from(k, || unreachable!("meta reads no batch"))
            .unwrap();
    }
    for (c, m) in cpu.ranks.iter().zip(&meta.ranks) {
        let (ct, mt) = (&c.dev.tracker, &m.dev.tracker);
        assert_eq!(ct.peak_bytes(), mt.peak_bytes(), "{what}");
        assert_eq!(common::events(ct), common::events(mt), "{what}: timelines");
    }
    for (i, dev) in cpu.release().into_iter().enumerate() {
        assert_eq!(dev.tracker.live().total(), 0, "{what}: rank {i} leaked");
    }
    losses
}

fn tiny() -> Vec<ModelConfig> {
    ["gpt2-tiny", "llama-tiny", "gemma-tiny", "moe-tiny"]
        .map(|m| load_model(m).unwrap())
        .to_vec()
}

/// Every layout pure bf16 is built for, both frameworks, every optimizer,
/// LoRA and QLoRA: meta is cpu byte for byte and event for event.
#[test]
fn pure_bf16_meta_equals_cpu_on_every_layout_built() {
    let gpt2 = load_model("gpt2-tiny").unwrap();
    let llama = load_model("llama-tiny").unwrap();
    for model in [&gpt2, &llama] {
        for optimizer in [
            Optimizer::Adamw,
            Optimizer::Adamw8bit,
            Optimizer::Sgd,
            Optimizer::Adafactor,
        ] {
            for framework in [Framework::Memfit, Framework::HfEager] {
                let tc = TrainConfig {
                    optimizer,
                    framework,
                    grad_accum: 2,
                    ..base()
                };
                let what = format!("{} {optimizer:?} {framework:?}", model.name);
                meta_equals_cpu(model, &tc, 2, &what);
            }
        }
        let layouts = [
            (2, Sharding::Ddp, 1, 1),
            (2, Sharding::Zero3, 1, 1),
            (4, Sharding::Zero3, 1, 1),
            (2, Sharding::None, 2, 1),
            (2, Sharding::None, 1, 2),
        ];
        for (ranks, sharding, pipeline_stages, tensor_parallel) in layouts {
            let tc = TrainConfig {
                ranks,
                sharding,
                pipeline_stages,
                tensor_parallel,
                grad_accum: 2,
                checkpointing: Checkpointing::Full,
                ..base()
            };
            let what = format!(
                "{} {ranks} {sharding:?} pp{pipeline_stages} tp{tensor_parallel}",
                model.name
            );
            meta_equals_cpu(model, &tc, 2, &what);
        }
        for finetune in [Finetune::Lora, Finetune::Qlora] {
            let tc = TrainConfig { finetune, ..base() };
            meta_equals_cpu(model, &tc, 2, &format!("{} {finetune:?}", model.name));
        }
    }
}

/// Pure bf16 holds no master copy, AdamW's m and v in bf16 (2 + 2 + 4
/// bytes per parameter), where mixed bf16 holds 2 + 2 + 12; 8-bit AdamW
/// keeps its state as bitsandbytes does, less the master copy. Every
/// update lands on a bf16 value, and training differs from mixed bf16's
/// after the first step (the same loss first).
#[test]
fn pure_bf16_keeps_every_state_in_bf16_and_rounds_each_update() {
    let model = load_model("llama-tiny").unwrap();
    let peaks = |precision, optimizer| {
        let tc = TrainConfig {
            precision,
            optimizer,
            ..base()
        };
        let mut e = Engine::new(model.clone(), tc, MetaBackend::emulating_cpu(), None).unwrap();
        e.step_from(1, || unreachable!()).unwrap();
        let n: usize = e.param_specs().iter().map(|s| s.numel()).sum();
        (e.dev.tracker.peak_bytes(), n as u64)
    };
    let (pure, n) = peaks(Precision::Bf16Pure, Optimizer::Adamw);
    let (mixed, _) = peaks(Precision::Bf16, Optimizer::Adamw);
    assert_eq!(pure.parameters, 2 * n);
    assert_eq!(pure.gradients, 2 * n);
    assert_eq!(pure.optimizer, 4 * n, "m and v in bf16, no master");
    assert_eq!(mixed.optimizer, 12 * n, "fp32 master, m and v");
    let (pure8, _) = peaks(Precision::Bf16Pure, Optimizer::Adamw8bit);
    let (mixed8, _) = peaks(Precision::Bf16, Optimizer::Adamw8bit);
    assert_eq!(
        mixed8.optimizer - pure8.optimizer,
        4 * n,
        "only the master goes"
    );
    let (sgd, _) = peaks(Precision::Bf16Pure, Optimizer::Sgd);
    assert_eq!(sgd.optimizer, 2 * n, "momentum in bf16");

    let train = |precision| {
        let tc = TrainConfig {
            precision,
            ..base()
        };
        let mut e = Engine::new(model.clone(), tc, CpuBackend::new(2).unwrap(), None).unwrap();
        let mut data = DataSource::synthetic(model.vocab_size, 3);
        let losses: Vec<f32> = (0..3)
            .map(|_| e.step(&[data.next_batch(2, 16)]).unwrap().loss.unwrap())
            .collect();
        (e.params_host().unwrap(), e.master_host(), losses)
    };
    let (params, master, pure_losses) = train(Precision::Bf16Pure);
    assert!(master.is_none(), "no master copy");
    for w in params.iter().flatten() {
        let rounded = half::bf16::from_f32(*w).to_f32();
        assert_eq!(w.to_bits(), rounded.to_bits(), "a weight off the bf16 grid");
    }
    let (_, mixed_master, mixed_losses) = train(Precision::Bf16);
    assert!(mixed_master.is_some());
    assert_eq!(pure_losses[0], mixed_losses[0], "the same first forward");
    assert_ne!(
        pure_losses[1..],
        mixed_losses[1..],
        "the master copy changes training"
    );
    assert!(pure_losses.iter().all(|l| l.is_finite()));
}

/// The optimizer in the backward trains exactly as the ordinary step does
/// (no clipping in either): every family, precision, framework and
/// finetune, with checkpointing; meta predicts it byte for byte.
#[test]
fn optimizer_in_backward_trains_as_the_ordinary_step_and_meta_predicts_it() {
    for model in tiny() {
        let cases = [
            (Precision::Fp32, Framework::Memfit, Finetune::Full, false),
            (Precision::Bf16, Framework::Memfit, Finetune::Full, true),
            (
                Precision::Bf16Pure,
                Framework::Memfit,
                Finetune::Full,
                false,
            ),
            (
                Precision::Bf16Pure,
                Framework::HfEager,
                Finetune::Full,
                true,
            ),
            (Precision::Fp32, Framework::HfEager, Finetune::Full, false),
            (
                Precision::Bf16Pure,
                Framework::Memfit,
                Finetune::Lora,
                false,
            ),
            (
                Precision::Bf16Pure,
                Framework::HfEager,
                Finetune::Qlora,
                true,
            ),
        ];
        for (precision, framework, finetune, ckpt) in cases {
            // moe-tiny's shared expert has no hf-eager rules, nor LoRA on
            // its experts unless named.
            let unmodelled = memfit::engine::framework::hf_unmodelled(&model).is_some();
            if model.moe.is_some()
                && (finetune != Finetune::Full || unmodelled && framework == Framework::HfEager)
            {
                continue;
            }
            let ordinary = TrainConfig {
                precision,
                framework,
                finetune,
                checkpointing: if ckpt {
                    Checkpointing::Full
                } else {
                    Checkpointing::None
                },
                optimizer_impl: OptimizerImpl::SingleTensor,
                grad_clip: 0.0,
                ..base()
            };
            let what = format!("{} {precision:?} {framework:?} {finetune:?}", model.name);
            let fused = meta_equals_cpu(&model, &in_bwd(&ordinary), 3, &what);
            let plain = meta_equals_cpu(&model, &ordinary, 3, &what);
            assert_eq!(fused, plain, "{what}: the losses");
        }
    }
}

/// Stepping in the backward frees each unit's gradients as soon as it is
/// stepped: no more than the largest unit's are alive at once, and the
/// step's peak drops when it was the optimizer's.
#[test]
fn optimizer_in_backward_holds_one_units_gradients_at_a_time() {
    let model = load_model("llama-tiny").unwrap();
    for framework in [Framework::Memfit, Framework::HfEager] {
        let tc = TrainConfig {
            framework,
            precision: Precision::Fp32,
            seq_len: 4,
            micro_batch: 1,
            grad_clip: 0.0,
            ..TrainConfig::default()
        };
        let peak = |tc: TrainConfig| {
            let mut e = Engine::new(model.clone(), tc, MetaBackend::emulating_cpu(), None).unwrap();
            e.step_from(1, || unreachable!()).unwrap();
            let specs = e.param_specs().to_vec();
            (e.dev.tracker.peak_bytes(), specs)
        };
        let (plain, specs) = peak(tc.clone());
        let (fused, _) = peak(in_bwd(&tc));
        let all: u64 = specs.iter().map(|s| 4 * s.numel() as u64).sum();
        assert_eq!(plain.gradients, all, "{framework:?}");
        // The embedding (tied: its gradient lives from the head's backward
        // to its own), or a block, whichever is larger.
        let block: u64 = all / model.n_layer as u64;
        let embed = 4 * specs[0].numel() as u64;
        assert!(
            fused.gradients <= embed.max(block) + 4 * model.d_model as u64 * 2,
            "{framework:?}: {} of {all}",
            fused.gradients
        );
        assert!(2 * fused.gradients < plain.gradients, "{framework:?}");
        assert!(fused.total < plain.total, "{framework:?}");
        assert_eq!(
            fused.get(Category::Parameters),
            plain.get(Category::Parameters)
        );
    }
}

#[test]
fn what_torchtune_and_the_layouts_refuse_is_refused_by_name() {
    let run = ["run", "--device", "meta", "--optimizer-in-backward"];
    let err = refused(&run, "--optimizer-in-backward");
    assert!(err.contains("--grad-clip 0"), "{err}");
    let no_clip = [&run[..], &["--grad-clip", "0"]].concat();
    let err = refused(
        &[&no_clip[..], &["--grad-accum", "2"]].concat(),
        "--grad-accum 1",
    );
    assert!(err.contains("--optimizer-in-backward"), "{err}");
    refused(
        &[&no_clip[..], &["--precision", "fp16"]].concat(),
        "loss scaler",
    );
    refused(
        &[&no_clip[..], &["--ranks", "2", "--sharding", "ddp"]].concat(),
        "one rank",
    );
    refused(
        &[
            &no_clip[..],
            &["--framework", "hf-eager", "--set-to-none", "false"],
        ]
        .concat(),
        "set_to_none",
    );
    refused(
        &[
            &no_clip[..],
            &["--framework", "hf-eager", "--param-groups", "trainer"],
        ]
        .concat(),
        "--param-groups",
    );
    let pure = ["run", "--device", "meta", "--precision", "bf16-pure"];
    for sharding in ["zero1", "zero2"] {
        let err = refused(
            &[&pure[..], &["--ranks", "2", "--sharding", sharding]].concat(),
            "--precision",
        );
        assert!(
            err.contains("fp32 master") && err.contains("zero3"),
            "{err}"
        );
    }
    refused(
        &[
            &pure[..],
            &["--ranks", "4", "--sharding", "zero3", "--hpz-group", "2"],
        ]
        .concat(),
        "hpZ",
    );
    refused(
        &[
            &pure[..],
            &[
                "--ranks",
                "2",
                "--sharding",
                "zero3",
                "--offload",
                "optimizer",
            ],
        ]
        .concat(),
        "ZeRO-Offload",
    );
    // Built: one rank, ddp and zero3 (FSDP2), with the step in the backward.
    for extra in [
        &["--ranks", "2", "--sharding", "ddp"][..],
        &["--ranks", "2", "--sharding", "zero3"][..],
        &["--optimizer-in-backward", "--grad-clip", "0"][..],
    ] {
        let out = memfit(&[&pure[..], extra].concat());
        assert!(out.status.success(), "{extra:?}: {}", stderr(&out));
    }
}

/// A plan shows pure bf16 by name, with its closed form (2 + 2 + 4 bytes
/// per parameter under AdamW), marks it as changing numerics, and prices
/// the optimizer's fewer bytes; `optimizer_in_backward: true` plans what
/// `memfit run` gives for the same point, and refuses more than one GPU.
#[test]
fn plans_show_price_and_pin_pure_bf16_and_the_step_in_the_backward() {
    let dir = scratch("pure-bf16-plan");
    let write = |name: &str, extra: &str, gpus: &str| {
        let path = dir.join(name);
        std::fs::write(
            &path,
            format!(
                "model: llama-tiny\nhardware: h100-sxm-80gb\nseq_len: 64\nglobal_batch: 4\n{extra}grid:\n  micro_batch: [4]\n  precision: [bf16, bf16-pure]\n  gpus: [{gpus}]\n  sharding: [none, ddp]\n  framework: [memfit]\n"
            ),
        )
        .unwrap();
        path
    };
    let plan = |path: &std::path::Path| {
        let out = memfit(&["plan", path.to_str().unwrap(), "--format", "json"]);
        assert!(out.status.success(), "{}", stderr(&out));
        json(&out)
    };
    let p = plan(&write("plain.yaml", "", "1"));
    let points = p["points"].as_array().unwrap();
    let of = |prec: &str| {
        points
            .iter()
            .find(|x| x["point"]["precision"] == prec && x["status"] != "invalid")
            .unwrap_or_else(|| panic!("no {prec} point"))
    };
    let (pure, mixed) = (of("bf16-pure"), of("bf16"));
    let form = pure["closed_form"].to_string();
    assert!(
        form.contains("pure bf16") && form.contains("2+2+4 B/param"),
        "{form}"
    );
    assert_eq!(pure["numerics_changes"], serde_json::json!(["bf16-pure"]));
    assert!(
        pure["step_s"].as_f64() < mixed["step_s"].as_f64(),
        "fewer optimizer bytes"
    );
    let (pp, mp) = (&pure["peak_bytes"], &mixed["peak_bytes"]);
    assert_eq!(
        mp["optimizer"].as_u64().unwrap(),
        3 * pp["optimizer"].as_u64().unwrap()
    );

    let fused = plan(&write(
        "fused.yaml",
        "optimizer_in_backward: true\n",
        "1, 2",
    ));
    for x in fused["points"].as_array().unwrap() {
        let pt = &x["point"];
        if pt["gpus"] == 2 {
            if x["status"] == "invalid" {
                continue;
            }
            panic!("optimizer_in_backward planned on 2 GPUs: {x}");
        }
        if pt["sharding"] != "none" {
            continue;
        }
        let prec = pt["precision"].as_str().unwrap();
        let run = ok_json(
            &[
                "run",
                "--model",
                "llama-tiny",
                "--device",
                "meta:h100-sxm-80gb",
                "--seq-len",
                "64",
                "--micro-batch",
                "4",
                "--attention",
                "fused",
                "--precision",
                prec,
                "--optimizer-in-backward",
                "--grad-clip",
                "0",
            ],
            &["--format", "json"],
        );
        assert_eq!(x["peak_bytes"], run["peak_bytes"], "{prec}");
    }
}

/// The torchtune single-device recipes plan: pure bf16, the step in the
/// backward for the full finetune, the loss compiled, each at batch 2 x
/// 2048 on one 4090, with the figures docs/finetuning.md quotes (tensors at
/// the peak and the plan's total, GiB).
#[test]
fn the_torchtune_recipes_plan_their_published_setups() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/recipes/");
    for (file, finetune, tensors, total) in [
        ("llama-8b-torchtune-4090.yaml", "full", 19.99, 21.55),
        ("llama-8b-torchtune-lora-4090.yaml", "lora", 17.11, 18.61),
        ("llama-8b-torchtune-qlora-4090.yaml", "qlora", 7.70, 9.46),
    ] {
        let out = memfit(&["plan", &format!("{dir}{file}"), "--format", "json"]);
        let p = json(&out);
        let x = &p["points"][0];
        assert_eq!(x["point"]["precision"], "bf16-pure", "{file}");
        assert_eq!(x["point"]["finetune"], finetune, "{file}");
        assert_eq!(x["point"]["micro_batch"], 2, "{file}");
        let gib = |v: &serde_json::Value| v.as_f64().unwrap() / (1u64 << 30) as f64;
        assert_eq!(
            format!("{:.2}", gib(&x["peak_split"]["total"])),
            format!("{tensors:.2}"),
            "{file}"
        );
        assert_eq!(
            format!("{:.2}", gib(&x["total_bytes"])),
            format!("{total:.2}"),
            "{file}"
        );
    }
}
