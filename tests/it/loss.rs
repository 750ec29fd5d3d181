//! `--loss`: torchtune's chunked cross-entropy and Liger's fused linear
//! cross-entropy compute the gradients the full loss does, meta predicts
//! them byte for byte, the fused loss holds no logits, and the combinations
//! that would do nothing are refused. (The chunked loss against PyTorch is
//! in `hf_reference.rs`, with the other MemTracker fixtures.)

use crate::common;

use crate::common::{json, memfit, refused, scratch_file, stderr};
use memfit::backend::cpu::CpuBackend;
use memfit::backend::meta::MetaBackend;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::loss::UNFUSED_OP;
use memfit::engine::{
    Checkpointing, Engine, Framework, Loss, OptimizerImpl, Precision, TrainConfig,
};

fn tc(loss: Loss, framework: Framework) -> TrainConfig {
    TrainConfig {
        seq_len: 32,
        micro_batch: 4,
        loss,
        framework,
        ..TrainConfig::default()
    }
}

/// One forward and backward on cpu: the loss and every gradient.
fn grads(model: &str, tc: &TrainConfig) -> (f32, Vec<Vec<f32>>) {
    let model = load_model(model).unwrap();
    let batch = DataSource::synthetic(model.vocab_size, 5).next_batch(tc.micro_batch, tc.seq_len);
    let mut e = Engine::new(model, tc.clone(), CpuBackend::new(2).unwrap(), None).unwrap();
    let loss = e.compute_grads(&batch).unwrap().unwrap();
    (loss, e.grads_host().unwrap())
}

fn assert_close(what: &str, (l0, g0): &(f32, Vec<Vec<f32>>), (l1, g1): &(f32, Vec<Vec<f32>>)) {
    assert!(
        (l0 - l1).abs() <= 1e-6 * l0.abs(),
        "{what}: loss {l1} vs {l0}"
    );
    let scale = g0.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
    for (i, (a, b)) in g0.iter().zip(g1).enumerate() {
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= 1e-5 * scale,
                "{what}: tensor {i}: gradient {y} vs {x}"
            );
        }
    }
}

#[test]
fn chunked_and_fused_losses_compute_the_full_losss_gradients() {
    for model in ["gpt2-tiny", "llama-tiny"] {
        let full = grads(model, &tc(Loss::Full, Framework::Memfit));
        // 128 tokens, a vocabulary 4 (gpt2-tiny's padded 256 / 64) or 4
        // times the width: Liger's chunks are 32 tokens, four of them.
        let fused = grads(model, &tc(Loss::FusedLinear, Framework::Memfit));
        assert_close(&format!("{model} fused-linear"), &full, &fused);
        let hf_full = grads(model, &tc(Loss::Full, Framework::HfEager));
        for k in [3, 8] {
            let chunked = grads(
                model,
                &TrainConfig {
                    loss_chunks: k,
                    ..tc(Loss::Chunked, Framework::HfEager)
                },
            );
            assert_close(&format!("{model} chunked {k}"), &hf_full, &chunked);
        }
        let hf_fused = grads(model, &tc(Loss::FusedLinear, Framework::HfEager));
        assert_close(
            &format!("{model} hf-eager fused-linear"),
            &hf_full,
            &hf_fused,
        );
    }
}

/// Meta allocated what cpu did, event for event, and counted the same
/// FLOPs and bytes.
fn meta_is_cpu(cpu: &Engine<CpuBackend>, meta: &Engine<MetaBackend>, what: &str) {
    let (c, m) = (&cpu.dev.tracker, &meta.dev.tracker);
    assert_eq!(c.peak_bytes(), m.peak_bytes(), "{what}");
    assert_eq!(
        common::events(c),
        common::events(m),
        "{what}: timelines differ"
    );
    let (c, m) = (&cpu.dev.meter.cost, &meta.dev.meter.cost);
    assert_eq!((c.flops(), c.bytes()), (m.flops(), m.bytes()), "{what}");
}

/// Every loss on cpu allocates what meta predicts, event for event, with
/// accumulation, checkpointing, and PyTorch's resident or freed gradients
/// over tied (gpt2-tiny) and untied (llama-tiny) heads; and training with
/// them follows the full loss's losses.
#[test]
fn meta_predicts_every_loss_byte_for_byte() {
    for model_name in ["gpt2-tiny", "llama-tiny"] {
        let model = load_model(model_name).unwrap();
        let cases = [
            (
                Loss::FusedLinear,
                Framework::Memfit,
                true,
                Checkpointing::None,
            ),
            (
                Loss::FusedLinear,
                Framework::Memfit,
                true,
                Checkpointing::Full,
            ),
            (
                Loss::FusedLinear,
                Framework::HfEager,
                true,
                Checkpointing::None,
            ),
            (
                Loss::FusedLinear,
                Framework::HfEager,
                false,
                Checkpointing::Full,
            ),
            (Loss::Chunked, Framework::HfEager, true, Checkpointing::None),
            (
                Loss::Chunked,
                Framework::HfEager,
                false,
                Checkpointing::Full,
            ),
        ];
        for (loss, framework, set_to_none, checkpointing) in cases {
            let t = TrainConfig {
                grad_accum: 2,
                set_to_none,
                checkpointing,
                loss_chunks: 5,
                optimizer_impl: OptimizerImpl::SingleTensor,
                ..tc(loss, framework)
            };
            let what = format!(
                "{model_name} {loss:?} {framework:?} set_to_none={set_to_none} {checkpointing:?}"
            );
            let mut cpu =
                Engine::new(model.clone(), t.clone(), CpuBackend::new(2).unwrap(), None).unwrap();
            let mut meta =
                Engine::new(model.clone(), t.clone(), MetaBackend::emulating_cpu(), None).unwrap();
            let full_t = TrainConfig {
                loss: Loss::Full,
                ..t.clone()
            };
            let mut full =
                Engine::new(model.clone(), full_t, CpuBackend::new(2).unwrap(), None).unwrap();
            let mut data = DataSource::synthetic(model.vocab_size, 3);
            for step in 0..3 {
                let batches: Vec<_> = (0..2).map(|_| data.next_batch(4, 32)).collect();
                let a = cpu.step(&batches).unwrap().loss.unwrap();
                let b = full.step(&batches).unwrap().loss.unwrap();
                assert!(
                    (a - b).abs() < 1e-4,
                    "{what}: step {step}: loss {a} vs full {b}"
                );
                meta.step(&batches).unwrap();
            }
            meta_is_cpu(&cpu, &meta, &what);
        }
    }
}

/// With a vocabulary far wider than the model, the full loss's logits are
/// most of the activations; the fused loss holds a chunk of them instead.
#[test]
fn the_fused_loss_holds_no_logits() {
    let mut model = load_model("llama-tiny").unwrap();
    model.vocab_size = 32768;
    let peak = |loss| {
        let t = TrainConfig {
            seq_len: 128,
            micro_batch: 4,
            loss,
            ..TrainConfig::default()
        };
        let mut e = Engine::new(model.clone(), t, MetaBackend::emulating_cpu(), None).unwrap();
        e.step_from(1, || unreachable!("meta reads no batch"))
            .unwrap();
        e.dev.tracker.peak_bytes()
    };
    let (full, fused) = (peak(Loss::Full), peak(Loss::FusedLinear));
    // N x V f32 logits: 512 x 32768 x 4 = 64 MiB.
    let logits = 512 * 32768 * 4u64;
    assert!(
        full.total - fused.total > logits / 2,
        "{full:?} vs {fused:?}"
    );
    // Liger's chunk: next_power_of_2(512 / (32768 / 64)) = 1 token.
    assert!(
        fused.activations + logits / 2 < full.activations,
        "{full:?} vs {fused:?}"
    );
}

/// Megatron's unfused loss computes the full loss's loss and gradients
/// (the engine's kernels over the fp32 copy, then the cast back), in fp32,
/// where `.float()` copies nothing, and in bf16, where it does.
#[test]
fn megatrons_unfused_loss_computes_the_full_losss_gradients() {
    for model in ["gpt2-tiny", "llama-tiny"] {
        for precision in [Precision::Fp32, Precision::Bf16] {
            let t = |loss| TrainConfig {
                precision,
                ..tc(loss, Framework::Memfit)
            };
            let full = grads(model, &t(Loss::Full));
            let megatron = grads(model, &t(Loss::MegatronUnfused));
            assert_close(&format!("{model} {precision:?}"), &full, &megatron);
        }
    }
}

/// What Megatron's unfused loss holds and moves beyond the full loss, per
/// micro-batch of N tokens over a padded vocabulary Vp: in bf16 the fp32
/// copy (4 B an element) beside the logits until the loss returns, and
/// again beside the gradient's cast back; 52 B an element moved where the
/// engine's fused kernels move 6 (`loss::megatron_unfused`), and 24 more
/// launches. Meta predicts it byte for byte on cpu.
#[test]
fn megatrons_unfused_loss_holds_an_fp32_copy_and_pays_its_passes() {
    let model = load_model("llama-tiny").unwrap();
    let (n, vp) = (4 * 32, model.padded_vocab() as u64);
    let elems = n * vp;
    let t = |loss| TrainConfig {
        precision: Precision::Bf16,
        grad_accum: 2,
        ..tc(loss, Framework::Memfit)
    };
    let run = |loss| {
        let mut cpu =
            Engine::new(model.clone(), t(loss), CpuBackend::new(2).unwrap(), None).unwrap();
        let mut meta =
            Engine::new(model.clone(), t(loss), MetaBackend::emulating_cpu(), None).unwrap();
        let mut data = DataSource::synthetic(model.vocab_size, 3);
        let batches: Vec<_> = (0..2).map(|_| data.next_batch(4, 32)).collect();
        cpu.step(&batches).unwrap();
        meta.step(&batches).unwrap();
        meta_is_cpu(&cpu, &meta, &format!("{loss:?}"));
        meta
    };
    let (full, megatron) = (run(Loss::Full), run(Loss::MegatronUnfused));
    let copies = |e: &Engine<MetaBackend>| {
        common::events(&e.dev.tracker)
            .iter()
            .filter(|(cat, bytes, _)| {
                *cat == memfit::memory::Category::Activations && *bytes == 4 * elems as i64
            })
            .count()
    };
    // One fp32 copy a micro-batch, none in the full loss.
    assert_eq!((copies(&full), copies(&megatron)), (0, 2));
    let (f, m) = (&full.dev.meter.cost, &megatron.dev.meter.cost);
    assert_eq!(m.bytes() - f.bytes(), 2 * 46 * elems as u128);
    // Per micro-batch: the copy and the cast back, and the passes the
    // engine's two kernels fuse (18 forward, 6 backward).
    assert_eq!(m.calls() - f.calls(), 2 * (2 + 18 + 6));
    assert_eq!(m.ops[UNFUSED_OP].bytes, 2 * 28 * elems as u128);
}

/// hf-eager's eager losses pay PyTorch's passes over the logits beyond the
/// engine's two kernels (`HfRules::loss_unfused`): per element, 12 B more
/// forward and 12 backward in fp32; in 16 bits the fp32 copy and the cast
/// back too, 20 and 22. Per call, one launch more forward and two more
/// backward, and the two casts. torchtune's chunks pay them chunk by
/// chunk; a compiled chunk and Liger's fused loss pay none.
#[test]
fn pytorchs_eager_cross_entropy_pays_its_passes() {
    let model = load_model("llama-tiny").unwrap();
    let elems = (4 * 32 * model.vocab_size) as u128;
    let cases = [
        (Precision::Fp32, Loss::Full, false, 24, 3),
        (Precision::Bf16Pure, Loss::Full, false, 42, 5),
        (Precision::Bf16, Loss::Full, false, 42, 5),
        (Precision::Bf16Pure, Loss::Chunked, false, 42, 5 * 5),
        (Precision::Bf16Pure, Loss::Chunked, true, 0, 0),
        (Precision::Bf16Pure, Loss::FusedLinear, false, 0, 0),
    ];
    for (precision, loss, compile_loss, per_elem, calls) in cases {
        let t = TrainConfig {
            precision,
            compile_loss,
            loss_chunks: 5,
            ..tc(loss, Framework::HfEager)
        };
        let mut e = Engine::new(model.clone(), t, MetaBackend::emulating_cpu(), None).unwrap();
        e.step_from(1, || unreachable!("meta reads no batch"))
            .unwrap();
        let op = e.dev.meter.cost.ops.get(UNFUSED_OP);
        let (bytes, n) = op.map_or((0, 0), |o| (o.bytes, o.calls));
        let what = format!("{precision:?} {loss:?} compiled {compile_loss}");
        assert_eq!(bytes, per_elem * elems, "{what}");
        assert_eq!(n, calls, "{what}");
    }
}

#[test]
fn losses_that_would_do_nothing_are_refused() {
    fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        [&["run", "--device", "meta", "--steps", "1"][..], extra].concat()
    }
    let err = refused(&with(&["--loss", "chunked"]), "--loss");
    assert!(err.contains("--framework hf-eager"), "{err}");
    refused(
        &with(&["--loss-chunks", "4"]),
        "applies to --loss chunked only",
    );
    refused(
        &with(&[
            "--loss",
            "chunked",
            "--framework",
            "hf-eager",
            "--loss-chunks",
            "0",
        ]),
        "--loss-chunks",
    );
    let err = refused(
        &with(&[
            "--loss",
            "fused-linear",
            "--tensor-parallel",
            "2",
            "--model",
            "llama-tiny",
        ]),
        "--loss",
    );
    assert!(err.contains("vocabulary-parallel"), "{err}");
    let err = refused(
        &with(&["--loss", "megatron-unfused", "--framework", "hf-eager"]),
        "--loss",
    );
    assert!(
        err.contains("Megatron-Core") && err.contains("--framework memfit"),
        "{err}"
    );
}

/// `loss` is a plan axis: each point plans its own, the label and the table
/// say which, and a chunked point planned as memfit is invalid with the
/// reason.
#[test]
fn plans_take_the_loss_as_an_axis() {
    let recipe = scratch_file(
        "loss-plan",
        "r.yaml",
        "model: llama-3.2-1b\nhardware: rtx-4090\nseq_len: 2048\nglobal_batch: 1\nloss_chunks: 4\ngrid:\n  micro_batch: [1]\n  precision: [bf16]\n  framework: [hf-eager, memfit]\n  finetune: [lora]\n  loss: [full, chunked, fused-linear]\n",
    );
    let out = memfit(&["plan", recipe.to_str().unwrap(), "--format", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let plan = json(&out);
    let points = plan["points"].as_array().unwrap();
    assert_eq!(points.len(), 6);
    let total = |fw: &str, loss: &str| {
        let p = points
            .iter()
            .find(|p| p["point"]["framework"] == fw && p["point"]["loss"] == loss)
            .unwrap();
        (p["peak_bytes"]["total"].as_u64(), p["reason"].clone())
    };
    let (full, _) = total("hf-eager", "full");
    let (chunked, _) = total("hf-eager", "chunked");
    let (fused, _) = total("hf-eager", "fused-linear");
    assert!(
        fused.unwrap() < chunked.unwrap() && chunked.unwrap() < full.unwrap(),
        "{fused:?} {chunked:?} {full:?}"
    );
    let (none, reason) = total("memfit", "chunked");
    assert_eq!(none, None);
    assert!(
        reason.to_string().contains("--framework hf-eager"),
        "{reason}"
    );
    let out = memfit(&["plan", recipe.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("fused-linear"), "{text}");
}

/// Under data parallelism, LoRA and QLoRA, the fused loss's gradients reach
/// the sharded, bucketed or adapter-only gradients as the full loss's do:
/// the same losses step by step, and meta's peak is cpu's.
#[test]
fn the_fused_loss_trains_under_sharding_and_lora() {
    let run = |args: &[&str], device: &str| {
        let mut all = vec![
            "run", "--device", device, "--steps", "2", "--format", "json",
        ];
        all.extend_from_slice(args);
        let out = memfit(&all);
        assert!(out.status.success(), "{all:?}: {}", stderr(&out));
        let doc = json(&out);
        let losses: Vec<f64> = doc["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["loss"].as_f64().unwrap())
            .collect();
        (doc["peak_bytes"]["total"].as_u64().unwrap(), losses)
    };
    for args in [
        &["--ranks", "2", "--sharding", "zero2"][..],
        &["--ranks", "2", "--sharding", "zero3"],
        &["--ranks", "2", "--sharding", "ddp", "--model", "llama-tiny"],
        &["--finetune", "qlora", "--model", "llama-tiny"],
        &["--pipeline-stages", "2", "--microbatches", "2"],
    ] {
        let fused: Vec<&str> = [args, &["--loss", "fused-linear"]].concat();
        let (cpu, losses) = run(&fused, "cpu");
        let (meta, _) = run(&fused, "meta");
        assert_eq!(cpu, meta, "{fused:?}");
        let (_, full) = run(args, "cpu");
        for (a, b) in losses.iter().zip(&full) {
            assert!((a - b).abs() < 1e-4, "{fused:?}: loss {a} vs full {b}");
        }
    }
}

/// `--compile-loss` changes what the chunked loss holds, not what it
/// computes: the losses are eager's to the bit and meta predicts cpu's
/// bytes (fp32, which cpu runs); in bf16 (meta), with a vocabulary far
/// wider than the model, the parts no longer hold eager's fp32 log-softmax
/// and copies. Without `--loss chunked`, or in a plan recipe whose grid
/// has no chunked point, it is refused.
#[test]
fn the_compiled_loss_holds_less_and_computes_the_same() {
    let mut model = load_model("llama-tiny").unwrap();
    model.vocab_size = 32768;
    let t = |compile: bool, precision: Precision| {
        let t = TrainConfig {
            compile_loss: compile,
            loss_chunks: 4,
            precision,
            ..tc(Loss::Chunked, Framework::HfEager)
        };
        memfit::engine::validate::stack(&t, &model).unwrap();
        t
    };
    let run = |compile: bool| {
        let t = t(compile, Precision::Fp32);
        let mut cpu =
            Engine::new(model.clone(), t.clone(), CpuBackend::new(2).unwrap(), None).unwrap();
        let mut meta =
            Engine::new(model.clone(), t.clone(), MetaBackend::emulating_cpu(), None).unwrap();
        let mut data = DataSource::synthetic(model.vocab_size, 3);
        let mut losses = Vec::new();
        for _ in 0..2 {
            let batch = [data.next_batch(4, 32)];
            losses.push(cpu.step(&batch).unwrap().loss.unwrap());
            meta.step(&batch).unwrap();
        }
        let (c, m) = (&cpu.dev.tracker, &meta.dev.tracker);
        assert_eq!(c.peak_bytes(), m.peak_bytes(), "compile {compile}");
        assert_eq!(common::events(c), common::events(m), "compile {compile}");
        losses
    };
    assert_eq!(run(false), run(true));
    let peak = |compile: bool| {
        let t = t(compile, Precision::Bf16Pure);
        let mut meta = Engine::new(model.clone(), t, MetaBackend::emulating_cpu(), None).unwrap();
        let batch = [DataSource::synthetic(model.vocab_size, 3).next_batch(4, 32)];
        meta.step(&batch).unwrap();
        meta.dev.tracker.peak_bytes().total
    };
    // Eager saves 4 bytes a vocabulary entry a row (the bf16 output's
    // fp32 log-softmax), compiled 2 (the output itself) and 8 a row.
    let rows = 4 * 32;
    let saved_less = (rows * 32768 * 2 - rows * 8) as u64;
    let (eager, compiled) = (peak(false), peak(true));
    assert!(
        compiled + saved_less <= eager,
        "{compiled} + {saved_less} vs {eager}"
    );
    refused(
        &["run", "--device", "meta", "--steps", "1", "--compile-loss"],
        "applies to --loss chunked only",
    );
    // A final logit soft cap's tanh is not modelled compiled.
    let gemma = refused(
        &[
            "run",
            "--device",
            "meta",
            "--steps",
            "1",
            "--model",
            "gemma-tiny",
            "--framework",
            "hf-eager",
            "--loss",
            "chunked",
            "--compile-loss",
        ],
        "--compile-loss",
    );
    assert!(gemma.contains("soft cap"), "{gemma}");
    let recipe = scratch_file(
        "compile-loss",
        "r.yaml",
        "model: llama-tiny\nhardware: rtx-4090\nseq_len: 64\nglobal_batch: 4\ncompile_loss: true\ngrid:\n  micro_batch: [1]\n  framework: [hf-eager]\n",
    );
    let o = memfit(&["plan", recipe.to_str().unwrap()]);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(
        e.contains("r.yaml") && e.contains("`compile_loss` applies to no point"),
        "{e}"
    );
}
