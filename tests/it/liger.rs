//! `--liger` (hf-eager): Liger's RMSNorm, SwiGLU and RoPE compute what
//! transformers' do, so the losses and gradients are unchanged; they hold
//! less (no `x * rsqrt` product, no silu(gate), SwiGLU's gradient written
//! into the saved gate|up), meta predicts it byte for byte, the step's
//! time loses transformers' unfused kernels, and what is not modelled is
//! refused by name.

use crate::common;

use crate::common::{json, memfit, refused, scratch, stderr};
use memfit::backend::DType;
use memfit::backend::cpu::CpuBackend;
use memfit::backend::meta::MetaBackend;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::{Checkpointing, Engine, Framework, HfRules, Loss, Precision, TrainConfig};

fn tc(liger: bool) -> TrainConfig {
    TrainConfig {
        seq_len: 32,
        micro_batch: 4,
        grad_accum: 2,
        framework: Framework::HfEager,
        liger,
        ..TrainConfig::default()
    }
}

#[test]
fn liger_trains_as_transformers_does_and_meta_holds_what_cpu_does() {
    let model = load_model("llama-tiny").unwrap();
    let cases = [
        (Loss::Full, true, Checkpointing::None),
        (Loss::Full, false, Checkpointing::Full),
        (Loss::FusedLinear, true, Checkpointing::None),
        (Loss::FusedLinear, false, Checkpointing::Full),
    ];
    for (loss, set_to_none, checkpointing) in cases {
        let t = |liger| TrainConfig {
            loss,
            set_to_none,
            checkpointing,
            ..tc(liger)
        };
        let what = format!("{loss:?} set_to_none={set_to_none} {checkpointing:?}");
        let cpu_engine = |liger| {
            Engine::new(model.clone(), t(liger), CpuBackend::new(2).unwrap(), None).unwrap()
        };
        let (mut liger, mut hf) = (cpu_engine(true), cpu_engine(false));
        let mut meta =
            Engine::new(model.clone(), t(true), MetaBackend::emulating_cpu(), None).unwrap();
        let mut data = DataSource::synthetic(model.vocab_size, 3);
        for step in 0..3 {
            let batches: Vec<_> = (0..2).map(|_| data.next_batch(4, 32)).collect();
            let a = liger.step(&batches).unwrap().loss.unwrap();
            let b = hf.step(&batches).unwrap().loss.unwrap();
            // The same kernels in the same order: the same bits.
            assert_eq!(a.to_bits(), b.to_bits(), "{what}: step {step}: {a} vs {b}");
            meta.step(&batches).unwrap();
        }
        assert_eq!(liger.grads_host(), hf.grads_host(), "{what}: gradients");
        let (c, m) = (&liger.dev.tracker, &meta.dev.tracker);
        assert_eq!(c.peak_bytes(), m.peak_bytes(), "{what}");
        assert_eq!(common::events(c), common::events(m), "{what}: timelines");
        let (cc, mc) = (&liger.dev.meter.cost, &meta.dev.meter.cost);
        assert_eq!(cc.flops(), mc.flops(), "{what}: FLOPs");
        assert_eq!(cc.bytes(), mc.bytes(), "{what}: bytes");
        let (lp, hp) = (c.peak_bytes(), hf.dev.tracker.peak_bytes());
        assert!(lp.total < hp.total, "{what}: {lp:?} vs {hp:?}");
    }
}

/// What Liger's kernels drop from the saved set, per block and at the
/// head, in each of hf-eager's precisions: the norms' `x * rsqrt`
/// products (fp32 under autocast and in a 16-bit module) and silu(gate).
#[test]
fn liger_saves_neither_the_norms_products_nor_silu() {
    let model = load_model("llama-3.1-8b").unwrap();
    let bytes = |s: &[(usize, DType)]| s.iter().map(|&(e, d)| e * d.size()).sum::<usize>();
    let (c, dff) = (model.d_model, model.d_ff());
    let n = 2 * 512;
    let cases = [
        (Precision::Fp32, memfit::engine::Finetune::Full, 4, 4),
        (Precision::Bf16, memfit::engine::Finetune::Full, 4, 2),
        (Precision::Bf16, memfit::engine::Finetune::Lora, 4, 2),
    ];
    for (precision, finetune, norm_size, dt) in cases {
        let rules = |liger| {
            let t = TrainConfig {
                seq_len: 512,
                micro_batch: 2,
                precision,
                finetune,
                ..tc(liger)
            };
            HfRules::new(&model, &t, true)
        };
        let (hf, liger) = (rules(false), rules(true));
        let what = format!("{precision:?} {finetune:?}");
        assert_eq!(
            bytes(&hf.block_saved) - bytes(&liger.block_saved),
            2 * n * c * norm_size + n * dff * dt,
            "{what}"
        );
        assert_eq!(
            bytes(&hf.head_saved) - bytes(&liger.head_saved),
            n * c * norm_size,
            "{what}"
        );
        // Autocast's weight casts stay where they were, in the saved set.
        assert_eq!(hf.block_casts.is_some(), liger.block_casts.is_some());
        if let (Some(a), Some(b)) = (&hf.block_casts, &liger.block_casts) {
            assert_eq!(hf.block_saved[a.clone()], liger.block_saved[b.clone()]);
        }
        assert!(liger.liger && !hf.liger);
    }
}

/// The meter charges transformers' unfused kernels beside the engine's
/// own ops, once per block's forward (twice when recomputed) and
/// backward and per final norm; Liger's run has none of them.
#[test]
fn the_step_pays_for_transformers_unfused_kernels_and_not_for_liger() {
    let model = load_model("llama-tiny").unwrap();
    for checkpointing in [Checkpointing::None, Checkpointing::Full] {
        let t = |liger| TrainConfig {
            grad_accum: 1,
            checkpointing,
            ..tc(liger)
        };
        let run = |liger| {
            let mut e =
                Engine::new(model.clone(), t(liger), MetaBackend::emulating_cpu(), None).unwrap();
            e.dev.meter.cost.reset();
            e.step_from(1, || unreachable!("meta reads no batch"))
                .unwrap();
            e.dev.meter.cost.clone()
        };
        let (hf, liger) = (run(false), run(true));
        let r = HfRules::new(&model, &t(false), false);
        let fwd = 1 + (checkpointing == Checkpointing::Full) as u64;
        let per_block = fwd * r.unfused_block[0].bytes + r.unfused_block[1].bytes;
        let head = r.unfused_head[0].bytes + r.unfused_head[1].bytes;
        let want = model.n_layer as u64 * per_block + head;
        assert!(want > 0);
        assert_eq!(
            (hf.bytes() - liger.bytes()) as u64,
            want,
            "{checkpointing:?}"
        );
        assert_eq!(hf.flops(), liger.flops(), "{checkpointing:?}");
        assert!(HfRules::new(&model, &t(true), false).unfused_block[0].kernels == 0);
    }
}

#[test]
fn a_plan_with_liger_is_faster_and_smaller() {
    let dir = scratch("liger-plan");
    let recipe = |liger: bool| {
        let p = dir.join(format!("r-{liger}.yaml"));
        std::fs::write(
            &p,
            format!(
                "model: llama-3.1-8b\nhardware: rtx-4090\nseq_len: 2048\nglobal_batch: 1\nliger: {liger}\ngrid:\n  micro_batch: [1]\n  precision: [bf16]\n  checkpointing: [full]\n  framework: [hf-eager]\n  finetune: [lora]\n  loss: [fused-linear]\n"
            ),
        )
        .unwrap();
        let out = memfit(&["plan", p.to_str().unwrap(), "--format", "json"]);
        assert!(out.status.success(), "{}", stderr(&out));
        json(&out)["points"][0].clone()
    };
    let (hf, liger) = (recipe(false), recipe(true));
    let num = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k}: {v}"));
    assert!(num(&liger, "tokens_per_s") > num(&hf, "tokens_per_s"));
    let peak = |v: &serde_json::Value| v["peak_bytes"]["total"].as_f64().unwrap();
    assert!(peak(&liger) < peak(&hf), "{liger} vs {hf}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn what_liger_is_not_modelled_for_is_refused_by_name() {
    let run = ["run", "--device", "meta", "--steps", "1", "--liger"];
    fn with<'a>(run: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
        [run, more].concat()
    }
    refused(
        &with(&run, &["--model", "llama-tiny"]),
        "--liger: describes PyTorch's implementation; add --framework hf-eager",
    );
    let hf = ["--framework", "hf-eager", "--seq-len", "32"];
    for (model, why) in [
        ("gpt2-tiny", "gpt2-tiny: Liger has no GPT-2 patch"),
        ("gemma-tiny", "gemma-tiny: Liger's Gemma patch"),
        ("qwen3-8b", "qwen3-8b: Liger swaps Qwen3's q/k norms only"),
        ("mixtral-8x7b", "mixtral-8x7b: Liger's expert patch"),
    ] {
        let err = refused(&with(&run, &[&hf[..], &["--model", model]].concat()), why);
        assert!(err.contains("--liger"), "{err}");
    }
    // A plan recipe: at its key, for the model.
    let dir = scratch("liger-refused");
    let p = dir.join("r.yaml");
    std::fs::write(
        &p,
        "model: gpt2\nhardware: rtx-4090\nseq_len: 64\nglobal_batch: 1\nliger: true\ngrid:\n  micro_batch: [1]\n",
    )
    .unwrap();
    let err = refused(&["plan", p.to_str().unwrap()], "Liger has no GPT-2 patch");
    assert!(err.contains("r.yaml:5:1"), "{err}");
    assert!(err.contains("leave `liger` out"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `--attention flash-attention-2` is sdpa's fused kernel plus flash_attn's
/// rng state (two int64 per layer, on the GPU); it is refused where
/// flash_attn cannot run (fp32, a cpu device) and with memfit's engine.
#[test]
fn flash_attention_2_holds_sdpas_tensors_and_its_rng_state() {
    let model = load_model("llama-tiny").unwrap();
    let t = |attention| TrainConfig {
        attention,
        precision: Precision::Bf16,
        ..tc(true)
    };
    let peak = |attention| {
        let mut e = Engine::new(
            model.clone(),
            t(attention),
            MetaBackend::emulating_cuda(),
            None,
        )
        .unwrap();
        e.step_from(1, || unreachable!("meta reads no batch"))
            .unwrap();
        e.dev.tracker.peak_bytes()
    };
    use memfit::engine::Attention;
    let (sdpa, fa2) = (peak(Attention::Fused), peak(Attention::FlashAttention2));
    assert_eq!(
        fa2.activations - sdpa.activations,
        16 * model.n_layer as u64
    );
    assert_eq!(
        (fa2.total - fa2.activations),
        (sdpa.total - sdpa.activations)
    );
    let bytes = |r: &HfRules| {
        r.block_saved
            .iter()
            .map(|&(e, d)| e * d.size())
            .sum::<usize>()
    };
    let cpu = HfRules::new(&model, &t(Attention::FlashAttention2), false);
    assert_eq!(
        bytes(&cpu),
        bytes(&HfRules::new(&model, &t(Attention::Fused), false))
    );

    let run = [
        "run",
        "--model",
        "llama-tiny",
        "--steps",
        "1",
        "--seq-len",
        "32",
    ];
    let fa2 = ["--attention", "flash-attention-2"];
    let hf = ["--framework", "hf-eager"];
    refused(
        &[&run[..], &fa2, &["--device", "meta:rtx-4090"]].concat(),
        "add --framework hf-eager",
    );
    refused(
        &[&run[..], &fa2, &hf, &["--device", "meta:rtx-4090"]].concat(),
        "flash-attention-2 computes in fp16 or bf16 only",
    );
    refused(
        &[
            &run[..],
            &fa2,
            &hf,
            &["--device", "meta", "--precision", "bf16"],
        ]
        .concat(),
        "runs on CUDA GPUs only",
    );
    let out = memfit(
        &[
            &run[..],
            &["--attention", "flash_attention_2"],
            &hf,
            &["--device", "meta:rtx-4090", "--precision", "bf16"],
        ]
        .concat(),
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

/// The figures docs/hf-eager.md and docs/finetuning.md quote for the
/// recipe (peak GiB with the runtime overhead, tokens/s).
#[test]
fn the_fa2_liger_recipe_plans_the_documented_figures() {
    let recipe = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/recipes/llama-8b-hf-fa2-liger-4090.yaml"
    );
    let out = memfit(&["plan", recipe, "--format", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let plan = json(&out);
    let want = [
        ("lora", 1, 17.24, 1974.0),
        ("lora", 4, 19.96, 2125.0),
        ("qlora", 1, 7.95, 1864.0),
        ("qlora", 4, 12.06, 2092.0),
    ];
    for (tune, mb, gib, tokens) in want {
        let p = (plan["points"].as_array().unwrap().iter())
            .find(|p| p["point"]["finetune"] == tune && p["point"]["micro_batch"] == mb)
            .unwrap_or_else(|| panic!("{tune} mb{mb}"));
        let total = p["total_bytes"].as_f64().unwrap() / (1u64 << 30) as f64;
        assert_eq!(format!("{total:.2}"), format!("{gib:.2}"), "{tune} mb{mb}");
        let tps = p["tokens_per_s"].as_f64().unwrap();
        assert_eq!(tps.round(), tokens, "{tune} mb{mb}");
        assert_eq!(p["point"]["attention"], "flash-attention-2");
    }
}

/// On a GPU the 16-bit flash backward allocates its own buffers for the
/// call (flash_api.cpp `mha_bwd`): fp32 `dq_accum` (B, T↑128, H,
/// head_dim↑32), and with grouped k/v the expanded dk and dv (its
/// `softmax_d` is the engine's attention workspace); none on a cpu, none for fp32 (memory-efficient
/// kernel), none for eager attention; sdpa gives up the grouped kernel
/// where a sliding window masks the sequence.
#[test]
fn the_gpu_flash_backward_holds_its_own_buffers() {
    use memfit::engine::Attention;
    let model = load_model("llama-3.1-8b").unwrap();
    let t = |attention, precision| TrainConfig {
        seq_len: 1000,
        micro_batch: 2,
        framework: Framework::HfEager,
        attention,
        precision,
        ..TrainConfig::default()
    };
    let scratch = |m: &memfit::config::ModelConfig, c: TrainConfig, cuda: bool| {
        HfRules::new(m, &c, cuda).attention_backward_scratch
    };
    let (t_r, h, hd) = (1024, 32, 128);
    let want = vec![
        (2 * t_r * h * hd, DType::F32),
        (2 * 1000 * h * hd, DType::Bf16),
        (2 * 1000 * h * hd, DType::Bf16),
    ];
    for a in [Attention::Fused, Attention::FlashAttention2] {
        assert_eq!(scratch(&model, t(a, Precision::Bf16), true), want, "{a:?}");
        assert!(scratch(&model, t(a, Precision::Bf16), false).is_empty());
    }
    assert!(scratch(&model, t(Attention::Fused, Precision::Fp32), true).is_empty());
    assert!(scratch(&model, t(Attention::Eager, Precision::Bf16), true).is_empty());
    // Gemma 2's 4,096-token window masks an 8k sequence: sdpa runs on
    // repeated k and v (no expanded buffers), flash_attn on grouped ones.
    let gemma = load_model("gemma-2-2b").unwrap();
    let long = |a| TrainConfig {
        seq_len: 8192,
        micro_batch: 1,
        ..t(a, Precision::Bf16)
    };
    assert_eq!(scratch(&gemma, long(Attention::Fused), true).len(), 1);
    assert_eq!(
        scratch(&gemma, long(Attention::FlashAttention2), true).len(),
        3
    );
    // The engine allocates them, back to back, before each layer's flash
    // backward on the emulated GPU, and frees them after it.
    let tiny = load_model("llama-tiny").unwrap();
    let c = TrainConfig {
        seq_len: 64,
        micro_batch: 2,
        ..t(Attention::Fused, Precision::Bf16)
    };
    let sizes: Vec<i64> = (HfRules::new(&tiny, &c, true)
        .attention_backward_scratch
        .iter())
    .map(|&(e, d)| (e * d.size()) as i64)
    .collect();
    assert_eq!(sizes.len(), 3);
    let layers = tiny.n_layer;
    let mut e = Engine::new(tiny, c, MetaBackend::emulating_cuda(), None).unwrap();
    e.step_from(1, || unreachable!()).unwrap();
    let allocs: Vec<i64> = (e.dev.tracker.timeline().iter())
        .filter(|ev| matches!(ev.phase, memfit::memory::Phase::Backward(_)))
        .filter(|ev| ev.category == memfit::memory::Category::Temporaries)
        .map(|ev| ev.bytes)
        .collect();
    let runs = allocs
        .windows(sizes.len())
        .filter(|w| *w == &sizes[..])
        .count();
    assert_eq!(runs, layers, "{allocs:?}");
}
