//! The memory-saving knobs: each trains, each changes memory as the tracker
//! shows, and meta predicts it byte for byte.

use memfit::backend::cpu::CpuBackend;
use memfit::backend::meta::MetaBackend;
use memfit::config::ModelConfig;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::{Attention, Checkpointing, Engine, Optimizer, Precision, TrainConfig};
use memfit::memory::{PeakBytes, Tracker};

/// meta never asks for data.
fn no_data() -> memfit::data::Batch {
    unreachable!("the meta backend reads no tokens")
}

fn meta_peaks(model: &ModelConfig, tc: &TrainConfig) -> PeakBytes {
    let mut e = Engine::new(
        model.clone(),
        tc.clone(),
        MetaBackend::emulating_cpu(),
        None,
    )
    .unwrap();
    e.step_from(tc.grad_accum, no_data).unwrap();
    e.dev.tracker.peak_bytes()
}

fn timeline(t: &Tracker) -> Vec<(String, &'static str, i64)> {
    t.timeline()
        .iter()
        .map(|e| (e.phase.to_string(), e.category.name(), e.bytes))
        .collect()
}

/// Every value of every knob, in a sample of the product that pairs each value
/// with several values of the others; each one trains gpt2-tiny for 25 steps.
#[test]
fn every_knob_combination_trains_and_meta_matches_cpu() {
    let model = load_model("gpt2-tiny").unwrap();
    let optimizers = [
        Optimizer::Adamw,
        Optimizer::Adamw8bit,
        Optimizer::Adafactor,
        Optimizer::Sgd,
    ];
    let mut i = 0;
    for optimizer in optimizers {
        for checkpointing in [Checkpointing::None, Checkpointing::Full] {
            for attention in [Attention::Eager, Attention::Fused] {
                i += 1;
                // Each precision meets several values of every other knob.
                let precision = [Precision::Fp32, Precision::Bf16, Precision::Fp16][i % 3];
                let tc = TrainConfig {
                    seq_len: 32,
                    micro_batch: 4,
                    grad_accum: 1 + i % 2,
                    optimizer,
                    lr: match optimizer {
                        Optimizer::Adafactor => None,
                        Optimizer::Sgd => Some(0.3),
                        _ => Some(2e-3),
                    },
                    checkpointing,
                    attention,
                    precision,
                    ..TrainConfig::default()
                };
                let what = format!(
                    "{optimizer:?}/{checkpointing:?}/{attention:?}/{precision:?}/accum {}",
                    tc.grad_accum
                );
                let mut e =
                    Engine::new(model.clone(), tc.clone(), CpuBackend::new(2).unwrap(), None)
                        .unwrap();
                let resident = e.dev.tracker.live();
                let mut data = DataSource::synthetic(model.vocab_size, 7);
                let losses: Vec<f32> = (0..25)
                    .map(|_| {
                        let b: Vec<_> =
                            (0..tc.grad_accum).map(|_| data.next_batch(4, 32)).collect();
                        let r = e.step(&b).unwrap();
                        assert!(!r.skipped, "{what}");
                        assert_eq!(e.dev.tracker.live(), resident, "{what}: a step leaked");
                        r.loss.unwrap()
                    })
                    .collect();
                let (first, last) = (
                    losses[..3].iter().sum::<f32>() / 3.0,
                    losses[22..].iter().sum::<f32>() / 3.0,
                );
                assert!(last < first - 0.1, "{what}: loss {first:.3} -> {last:.3}");

                let mut meta = Engine::new(
                    model.clone(),
                    tc.clone(),
                    MetaBackend::emulating_cpu(),
                    None,
                )
                .unwrap();
                for _ in 0..25 {
                    meta.step_from(tc.grad_accum, no_data).unwrap();
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
            }
        }
    }
}

#[test]
fn fused_attention_matches_eager_and_grows_linearly() {
    for name in ["gpt2-tiny", "llama-tiny"] {
        let model = load_model(name).unwrap();
        let batch = DataSource::synthetic(model.vocab_size, 4).next_batch(2, 96);
        let run = |attention| {
            let tc = TrainConfig {
                seq_len: 96,
                micro_batch: 2,
                attention,
                ..TrainConfig::default()
            };
            let mut e = Engine::new(model.clone(), tc, CpuBackend::new(2).unwrap(), None).unwrap();
            let loss = e.compute_grads(&batch).unwrap().unwrap();
            (loss, e.grads_host().unwrap())
        };
        let (l0, g0) = run(Attention::Eager);
        let (l1, g1) = run(Attention::Fused);
        assert!((l0 - l1).abs() < 1e-5, "{name}: loss {l0} vs {l1}");
        for (a, b) in g0.iter().zip(&g1) {
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x - y).abs() <= 1e-5 + 1e-3 * x.abs(),
                    "{name}: gradient {x} vs {y}"
                );
            }
        }
    }
    // At seq-len 512 the eager probabilities dominate; fused keeps B*H*T statistics.
    let gpt2 = load_model("gpt2").unwrap();
    let at = |t, attention| {
        meta_peaks(
            &gpt2,
            &TrainConfig {
                seq_len: t,
                micro_batch: 1,
                attention,
                ..TrainConfig::default()
            },
        )
        .activations
    };
    let (eager, fused) = (at(512, Attention::Eager), at(512, Attention::Fused));
    eprintln!("gpt2, T=512, B=1: activations eager {eager} B, fused {fused} B");
    // 12 layers x 12 heads x 512^2 x 4 bytes of probabilities = 144 MiB.
    assert!(
        eager - fused >= 12 * 12 * 512 * 512 * 4 - 12 * 12 * 512 * 4,
        "{eager} vs {fused}"
    );
    // Linear in T: doubling T doubles fused activations (within the T-independent part).
    let (f512, f1024) = (
        at(512, Attention::Fused) as f64,
        at(1024, Attention::Fused) as f64,
    );
    assert!(
        (f1024 / f512 - 2.0).abs() < 0.01,
        "fused activations x{:.3} for 2x T",
        f1024 / f512
    );
    let (e512, e1024) = (
        at(512, Attention::Eager) as f64,
        at(1024, Attention::Eager) as f64,
    );
    assert!(
        e1024 / e512 > 2.5,
        "eager activations x{:.3} for 2x T",
        e1024 / e512
    );
}

#[test]
fn optimizer_state_bytes_follow_the_published_figures() {
    let model = load_model("gpt2").unwrap();
    let params = model
        .param_layout()
        .0
        .iter()
        .map(|s| s.numel() as f64)
        .sum::<f64>();
    let bytes = |optimizer| {
        meta_peaks(
            &model,
            &TrainConfig {
                seq_len: 64,
                micro_batch: 1,
                optimizer,
                ..TrainConfig::default()
            },
        )
        .optimizer as f64
            / params
    };
    let (adamw, adamw8, adafactor, sgd) = (
        bytes(Optimizer::Adamw),
        bytes(Optimizer::Adamw8bit),
        bytes(Optimizer::Adafactor),
        bytes(Optimizer::Sgd),
    );
    eprintln!(
        "gpt2 optimizer state per parameter: adamw {adamw:.4}, adamw8bit {adamw8:.4}, adafactor {adafactor:.4}, sgd {sgd:.4}"
    );
    assert_eq!(adamw, 8.0);
    assert_eq!(sgd, 4.0);
    // 2 one-byte codes plus 2 fp32 absmax per 256 = 2.03125; small 1-D tensors stay 32-bit.
    assert!((2.03..2.06).contains(&adamw8), "{adamw8}");
    assert!(adafactor < 0.05, "{adafactor}");
}

#[test]
fn full_checkpointing_saves_about_the_expected_factor() {
    // llama-3.2-1b at T=2048: without checkpointing a block saves about
    // 10 C + 2*I*... per token; with it, one (B,T,C) input per block plus one block's worth.
    let model = load_model("llama-3.2-1b").unwrap();
    let at = |checkpointing| {
        meta_peaks(
            &model,
            &TrainConfig {
                seq_len: 2048,
                micro_batch: 1,
                checkpointing,
                attention: Attention::Fused,
                ..TrainConfig::default()
            },
        )
        .activations
    };
    let (none, full) = (at(Checkpointing::None), at(Checkpointing::Full));
    let (l, t, c) = (model.n_layer as u64, 2048u64, model.d_model as u64);
    let kept = (l + 1) * t * c * 4;
    let head = t * model.padded_vocab() as u64 * 4;
    eprintln!(
        "llama-3.2-1b T=2048: activations none {none}, full {full}; inputs {kept}, logits {head}"
    );
    // What is left under `full`: block inputs, one block's saved tensors, the head.
    let one_block = (none - head - t * 8) / l;
    assert!(full <= kept + one_block + head + t * c * 16, "{full}");
    assert!(none > 3 * full, "{none} vs {full}");
}

fn params_of(model: &ModelConfig) -> u64 {
    model
        .param_layout()
        .0
        .iter()
        .map(|s| s.numel() as u64)
        .sum()
}

#[test]
fn mixed_precision_halves_activations_and_keeps_fp32_master_state() {
    let model = load_model("gpt2").unwrap();
    let n = params_of(&model);
    let peaks = |precision| {
        meta_peaks(
            &model,
            &TrainConfig {
                seq_len: 512,
                micro_batch: 1,
                precision,
                ..TrainConfig::default()
            },
        )
    };
    let (fp32, bf16, fp16) = (
        peaks(Precision::Fp32),
        peaks(Precision::Bf16),
        peaks(Precision::Fp16),
    );
    eprintln!(
        "gpt2 B=1 T=512 activations: fp32 {} B, bf16 {} B ({:.4}x); per parameter fp32 {}+{}+{}, bf16 {}+{}+{}",
        fp32.activations,
        bf16.activations,
        bf16.activations as f64 / fp32.activations as f64,
        fp32.parameters / n,
        fp32.gradients / n,
        fp32.optimizer / n,
        bf16.parameters / n,
        bf16.gradients / n,
        bf16.optimizer / n,
    );
    // 2 + 2 + 12 bytes per parameter (the ZeRO paper's mixed-precision Adam),
    // against fp32's 4 + 4 + 8.
    assert_eq!(
        (fp32.parameters, fp32.gradients, fp32.optimizer),
        (4 * n, 4 * n, 8 * n)
    );
    assert_eq!(
        (bf16.parameters, bf16.gradients, bf16.optimizer),
        (2 * n, 2 * n, 12 * n)
    );
    assert_eq!(bf16, fp16);
    // Half, but for what stays 32-bit: token ids, norm statistics and losses,
    // a few bytes per token against the kilobytes of 16-bit tensors.
    let ratio = bf16.activations as f64 / fp32.activations as f64;
    assert!(
        (0.5..0.505).contains(&ratio),
        "bf16/fp32 activations {ratio}"
    );
}

#[test]
fn bf16_trains_like_fp32_and_stores_16_bit_weights() {
    let model = load_model("gpt2-tiny").unwrap();
    let run = |precision| {
        let tc = TrainConfig {
            seq_len: 32,
            micro_batch: 4,
            lr: Some(2e-3),
            precision,
            ..TrainConfig::default()
        };
        let mut e = Engine::new(model.clone(), tc, CpuBackend::new(2).unwrap(), None).unwrap();
        let mut data = DataSource::synthetic(model.vocab_size, 3);
        let mut loss = 0.0;
        for _ in 0..30 {
            loss = e.step(&[data.next_batch(4, 32)]).unwrap().loss.unwrap();
        }
        (loss, e.params_host().unwrap(), e.master_host())
    };
    let (l32, _, no_master) = run(Precision::Fp32);
    let (l16, working, master) = run(Precision::Bf16);
    let master = master.expect("bf16 keeps fp32 master weights");
    assert!(no_master.is_none());
    eprintln!("gpt2-tiny after 30 steps: fp32 loss {l32:.4}, bf16 loss {l16:.4}");
    assert!((l32 - l16).abs() < 0.05, "fp32 {l32} vs bf16 {l16}");
    // The working weights are the master weights rounded to bf16, and the
    // master weights carry bits bf16 cannot hold.
    let mut finer = 0;
    for (w, m) in working.iter().flatten().zip(master.iter().flatten()) {
        assert_eq!(*w, half::bf16::from_f32(*m).to_f32());
        finer += (w != m) as usize;
    }
    assert!(finer > working.iter().flatten().count() / 2, "{finer}");
}

#[test]
fn fp16_overflow_skips_the_step_and_halves_the_scale() {
    let model = load_model("gpt2-tiny").unwrap();
    let tc = TrainConfig {
        seq_len: 32,
        micro_batch: 4,
        precision: Precision::Fp16,
        loss_scale_window: 3,
        ..TrainConfig::default()
    };
    let mut e = Engine::new(model.clone(), tc, CpuBackend::new(2).unwrap(), None).unwrap();
    let mut data = DataSource::synthetic(model.vocab_size, 5);
    assert_eq!(e.loss_scale(), Some(65536.0));
    // Planted overflow: at 2^40 the scaled logit gradients (2^40 / 128 tokens)
    // pass fp16's 65504 and become inf.
    e.set_loss_scale(2f32.powi(40));
    let before = (e.params_host().unwrap(), e.master_host().unwrap());
    let r = e.step(&[data.next_batch(4, 32)]).unwrap();
    assert!(r.skipped, "{r:?}");
    assert!(!r.grad_norm.unwrap().is_finite());
    assert_eq!(e.loss_scale(), Some(2f32.powi(39)));
    assert_eq!(e.skipped_steps(), 1);
    assert_eq!(
        (e.params_host().unwrap(), e.master_host().unwrap()),
        before,
        "a skipped step changed the weights"
    );
    // Back at a sane scale the steps go through, and after `loss_scale_window`
    // (here 3) clean steps the scale doubles.
    e.set_loss_scale(65536.0);
    for i in 1..=3 {
        let r = e.step(&[data.next_batch(4, 32)]).unwrap();
        assert!(!r.skipped, "step {i}");
        assert!(r.grad_norm.unwrap().is_finite());
    }
    assert_eq!(e.loss_scale(), Some(131072.0));
    assert_eq!(e.skipped_steps(), 1);
    assert_ne!(e.params_host().unwrap(), before.0);
    // bf16 and fp32 have no loss scale.
    let bf = TrainConfig {
        precision: Precision::Bf16,
        ..TrainConfig::default()
    };
    let e = Engine::new(model, bf, MetaBackend::emulating_cpu(), None).unwrap();
    assert_eq!(e.loss_scale(), None);
}
