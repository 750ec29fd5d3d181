//! Gemma 2 and Gemma 3 (text): published configs import with the cards'
//! parameter counts, the tiny models train on cpu with meta predicting
//! every byte, the loss equals a naive reference of transformers'
//! `Gemma2ForCausalLM` / `Gemma3ForCausalLM` forward (soft caps and
//! sliding windows included), and what Gemma does not combine with is
//! refused by name.

use std::path::{Path, PathBuf};

use crate::common::{self, memfit, refused};
use memfit::backend::cpu::CpuBackend;
use memfit::backend::meta::MetaBackend;
use memfit::config::hf::{import_hf_config, load_hf_config};
use memfit::config::profile::load_model;
use memfit::config::{Family, ModelConfig};
use memfit::data::{Batch, DataSource};
use memfit::engine::cluster::{Cluster, cpu_links, meta_links};
use memfit::engine::{Attention, Checkpointing, Engine, Precision, Sharding, TrainConfig};
use memfit::rng::Rng;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

/// The parameter count in closed form: the tied embedding, and per block
/// q, k, v, o, the GeGLU MLP, four norms of C and (Gemma 3) the q and k
/// norms of head_dim; the final norm.
fn closed_form(m: &ModelConfig) -> u64 {
    let (v, c, l) = (m.vocab_size as u64, m.d_model as u64, m.n_layer as u64);
    let (h, kv, hd, i) = (
        m.n_head as u64,
        m.n_kv_head() as u64,
        m.head_dim() as u64,
        m.d_ff() as u64,
    );
    let attn = c * h * hd + 2 * c * kv * hd + h * hd * c;
    let qk = if m.qk_norm.is_some() { 2 * hd } else { 0 };
    let block = attn + 3 * c * i + 4 * c + qk;
    v * c + l * block + c
}

/// Published totals: Gemma 2's model cards (and transformers'
/// `num_parameters()` of the checkpoints), Gemma 3 1B's card; Gemma 3 4B's
/// and 12B's text models (the cards give the multimodal total, rounded;
/// the Gemma 3 report's non-embedding 3,209M and 10,759M are these counts
/// less the embedding, to the million).
#[test]
fn gemma_configs_count_their_parameters_as_their_cards_do() {
    for (file, builtin, params) in [
        ("gemma-2-2b.json", Some("gemma-2-2b"), 2_614_341_888u64),
        ("gemma-2-9b.json", Some("gemma-2-9b"), 9_241_705_984),
        ("gemma-2-27b.json", Some("gemma-2-27b"), 27_227_128_320),
        ("gemma-3-1b-it.json", Some("gemma-3-1b"), 999_885_952),
        ("gemma-3-4b-it.json", Some("gemma-3-4b"), 3_880_263_168),
        ("gemma-3-12b-it.json", None, 11_766_034_176),
    ] {
        let m = load_hf_config(&fixture(file)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(m.family, Family::Gemma, "{file}");
        assert_eq!(m.num_parameters(), params, "{file}");
        assert_eq!(closed_form(&m), params, "{file}: the closed form");
        let non_embedding = params - (m.vocab_size * m.d_model) as u64;
        if file == "gemma-3-4b-it.json" {
            assert_eq!(non_embedding / 1_000_000, 3_209);
        }
        if file == "gemma-3-12b-it.json" {
            assert_eq!(non_embedding / 1_000_000, 10_759);
        }
        if let Some(name) = builtin {
            let b = load_model(name).unwrap();
            assert_eq!(
                ModelConfig {
                    name: m.name.clone(),
                    ..b
                },
                m,
                "{name}"
            );
        }
    }
}

/// What the import reads: Gemma 2's alternation, caps and 27B's own
/// scale; Gemma 3's pattern of 6, local RoPE base, q/k norms and no caps,
/// in transformers 4's keys and in 5's (`layer_types`, `rope_parameters`).
#[test]
fn gemma_imports_windows_caps_and_rope_bases() {
    let g2 = load_hf_config(&fixture("gemma-2-27b.json")).unwrap();
    assert_eq!(g2.attn_softcap(), Some(50.0));
    assert_eq!(g2.final_softcap(), Some(30.0));
    assert_eq!(g2.attn_scale(), 1.0 / 12.0, "144 ** -0.5");
    assert_eq!(g2.sliding_window(0), Some(4096), "even layers slide");
    assert_eq!(g2.sliding_window(1), None);
    assert!(g2.tied() && g2.qk_norm.is_none());
    let g3 = load_hf_config(&fixture("gemma-3-1b-it.json")).unwrap();
    let v5 = load_hf_config(&fixture("gemma-3-1b-it-v5.json")).unwrap();
    assert_eq!(
        ModelConfig {
            name: g3.name.clone(),
            ..v5
        },
        g3
    );
    assert_eq!((g3.attn_softcap(), g3.final_softcap()), (None, None));
    for l in 0..26 {
        let global = l % 6 == 5;
        assert_eq!(g3.sliding_window(l), (!global).then_some(512), "layer {l}");
        let theta = if global { 1e6 } else { 1e4 };
        assert_eq!(g3.rope_theta_at(l), theta, "layer {l}");
    }
    let g3_4b = load_hf_config(&fixture("gemma-3-4b-it.json")).unwrap();
    assert_eq!(g3_4b.vocab_size, 262_208, "Gemma3TextConfig's default");
    assert_eq!(g3_4b.max_seq_len, 131_072);
}

/// Bad Gemma configs: each error names its key, at its line where it is
/// a top-level key.
#[test]
fn bad_gemma_configs_are_refused_by_key() {
    let base = std::fs::read_to_string(fixture("gemma-3-1b-it-v5.json")).unwrap();
    let swap = |from: &str, to: &str| {
        assert!(base.contains(from), "{from}");
        import_hf_config(&base.replacen(from, to, 1), "g.json")
            .unwrap_err()
            .to_string()
    };
    let msg = swap(
        "\"full_attention\",\n    \"sliding_attention\"",
        "\"sliding_attention\",\n    \"full_attention\"",
    );
    assert!(
        msg.contains("`layer_types`") && msg.contains("the only pattern"),
        "{msg}"
    );
    assert!(msg.starts_with("g.json:"), "{msg}");
    let msg = swap("\"gelu_pytorch_tanh\"", "\"silu\"");
    assert!(msg.contains("`hidden_activation` is \"silu\""), "{msg}");
    let msg = swap("\"attention_bias\": false", "\"attention_bias\": true");
    assert!(msg.contains("`attention_bias` is true"), "{msg}");
    let msg = swap(
        "\"model_type\": \"gemma3_text\"",
        "\"model_type\": \"gemma\"",
    );
    assert!(msg.contains("Gemma 1"), "{msg}");
    let mm = std::fs::read_to_string(fixture("gemma-3-4b-it.json")).unwrap();
    let msg = import_hf_config(
        &mm.replace("\"num_hidden_layers\": 34", "\"num_hidden_layers\": -1"),
        "m.json",
    )
    .unwrap_err()
    .to_string();
    assert!(msg.contains("`text_config.num_hidden_layers`"), "{msg}");
}

/// A tiny Gemma 3 (text): q/k norms of (1 + w), a pattern of 3 with a
/// window of 4, local RoPE base 10k, global 1M, no caps.
pub fn gemma3_tiny() -> ModelConfig {
    let text = r#"{"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 16, "max_position_embeddings": 256, "vocab_size": 256,
        "sliding_window": 4, "sliding_window_pattern": 3, "query_pre_attn_scalar": 20}"#;
    import_hf_config(text, "gemma3-tiny.json").unwrap()
}

fn tc(seq_len: usize) -> TrainConfig {
    TrainConfig {
        seq_len,
        micro_batch: 2,
        ..TrainConfig::default()
    }
}

/// Trains on cpu for a few steps (the loss falls, nothing leaks) and
/// steps meta alike: peaks, split at the peak, FLOPs and the whole
/// allocation timeline equal.
fn train_and_predict(model: &ModelConfig, tc: &TrainConfig, steps: usize) {
    let what = format!(
        "{} {:?} {:?} {:?}",
        model.name, tc.precision, tc.checkpointing, tc.attention
    );
    let mut e = Engine::new(model.clone(), tc.clone(), CpuBackend::new(2).unwrap(), None).unwrap();
    let resident = e.dev.tracker.live();
    let mut data = DataSource::synthetic(model.vocab_size, 11);
    let losses: Vec<f32> = (0..steps)
        .map(|_| {
            let r = e
                .step(&[data.next_batch(tc.micro_batch, tc.seq_len)])
                .unwrap();
            assert_eq!(e.dev.tracker.live(), resident, "{what}: a step leaked");
            r.loss.unwrap()
        })
        .collect();
    assert!(
        losses[steps - 1] < losses[0] - 0.05,
        "{what}: loss {losses:?}"
    );
    let mut meta = Engine::new(
        model.clone(),
        tc.clone(),
        MetaBackend::emulating_cpu(),
        None,
    )
    .unwrap();
    for _ in 0..steps {
        meta.step_from(1, || unreachable!("meta reads no data"))
            .unwrap();
    }
    let (c, m) = (&e.dev.tracker, &meta.dev.tracker);
    assert_eq!(c.peak_bytes(), m.peak_bytes(), "{what}");
    assert_eq!(c.at_peak(), m.at_peak(), "{what}");
    assert_eq!(
        common::events(c),
        common::events(m),
        "{what}: timelines differ"
    );
    let (cf, mf) = (e.dev.meter.cost.flops(), meta.dev.meter.cost.flops());
    assert_eq!(cf, mf, "{what}: counted FLOPs differ");
}

#[test]
fn gemma_trains_and_meta_matches_cpu_byte_for_byte() {
    let g2 = load_model("gemma-tiny").unwrap();
    for model in [g2, gemma3_tiny()] {
        for precision in [Precision::Fp32, Precision::Bf16] {
            for checkpointing in [Checkpointing::None, Checkpointing::Full] {
                for attention in [Attention::Eager, Attention::Fused] {
                    let tc = TrainConfig {
                        precision,
                        checkpointing,
                        attention,
                        lr: Some(3e-3),
                        ..tc(16)
                    };
                    train_and_predict(&model, &tc, 4);
                }
            }
        }
    }
}

/// Gemma 2's eager attention keeps each score's tanh beside the
/// probabilities: one (B,H,T,T) more per block, in the activations' dtype;
/// fused attention recomputes it and keeps nothing more.
#[test]
fn the_attention_soft_cap_saves_one_score_tensor_eagerly() {
    let capped = load_model("gemma-tiny").unwrap();
    let mut plain = capped.clone();
    plain.gemma.as_mut().unwrap().attn_softcap = None;
    let peak = |m: &ModelConfig, attention| {
        let tc = TrainConfig {
            attention,
            ..tc(32)
        };
        let mut e = Engine::new(m.clone(), tc, MetaBackend::emulating_cpu(), None).unwrap();
        e.step_from(1, || unreachable!()).unwrap();
        e.dev.tracker.peak_bytes().activations
    };
    let (b, h, t, l) = (2u64, capped.n_head as u64, 32u64, capped.n_layer as u64);
    let eager = peak(&capped, Attention::Eager) - peak(&plain, Attention::Eager);
    assert_eq!(eager, l * b * h * t * t * 4, "fp32 tanh per block");
    assert_eq!(
        peak(&capped, Attention::Fused),
        peak(&plain, Attention::Fused)
    );
}

#[test]
fn gemma_meta_matches_cpu_on_every_rank() {
    let model = load_model("gemma-tiny").unwrap();
    for (ranks, stages, sharding) in [
        (2, 1, Sharding::Ddp),
        (2, 1, Sharding::Zero3),
        (2, 2, Sharding::None),
    ] {
        let tc = TrainConfig {
            grad_accum: 2,
            ranks,
            pipeline_stages: stages,
            sharding,
            precision: Precision::Bf16,
            ..tc(16)
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
            let (ct, mt) = (&c.dev.tracker, &m.dev.tracker);
            assert_eq!(ct.peak_bytes(), mt.peak_bytes(), "{what}");
            assert_eq!(common::events(ct), common::events(mt), "{what}");
        }
        for (i, dev) in cpu.release().into_iter().enumerate() {
            assert_eq!(dev.tracker.live().total(), 0, "{what}: rank {i} leaked");
        }
    }
}

// ---- a naive reference of the forward ---------------------------------------

/// `x / sqrt(mean(x²) + eps) · (1 + w)`: Gemma's RMSNorm.
fn rms1p(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let r = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, &w)| v * r * (1.0 + w as f64))
        .collect()
}

/// `y (out) = W (out, inp) x`.
fn matvec(w: &[f32], x: &[f64], out: usize) -> Vec<f64> {
    let inp = x.len();
    (0..out)
        .map(|o| (0..inp).map(|i| w[o * inp + i] as f64 * x[i]).sum())
        .collect()
}

fn gelu_tanh(x: f64) -> f64 {
    let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
    0.5 * x * (1.0 + u.tanh())
}

/// HF's rotate_half RoPE of one head `x (hd)` at position `pos`.
fn rope(x: &mut [f64], pos: usize, theta: f64) {
    let half = x.len() / 2;
    for i in 0..half {
        let f = pos as f64 * theta.powf(-2.0 * i as f64 / x.len() as f64);
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * f.cos() - b * f.sin();
        x[i + half] = b * f.cos() + a * f.sin();
    }
}

/// The mean token loss of `m` at weights `p` on `batch` (`b` sequences of
/// `t`), in f64, written from transformers' Gemma 2/3 forward: the
/// embedding times √C, per block input norm, q/k/v, the q and k norms,
/// RoPE at the layer's base, scores scaled, soft-capped, masked causally
/// and to the window, softmax, o, post-attention norm, residual,
/// pre-feedforward norm, GeGLU, down, post-feedforward norm, residual;
/// the final norm, the tied head, the final soft cap, cross-entropy.
fn reference_loss(m: &ModelConfig, p: &[Vec<f32>], batch: &Batch, b: usize, t: usize) -> f64 {
    let (_, idx) = m.param_layout();
    let (c, hd, nh, nkv, ff) = (m.d_model, m.head_dim(), m.n_head, m.n_kv_head(), m.d_ff());
    let eps = m.norm_eps() as f64;
    let norm = (c as f32).sqrt() as f64;
    let mut total = 0.0;
    for s in 0..b {
        let toks = &batch.inputs[s * t..][..t];
        let mut x: Vec<Vec<f64>> = toks
            .iter()
            .map(|&k| {
                p[idx.wte][k as usize * c..][..c]
                    .iter()
                    .map(|&v| v as f64 * norm)
                    .collect()
            })
            .collect();
        for (l, bi) in idx.blocks.iter().enumerate() {
            let theta = m.rope_theta_at(l) as f64;
            let qkv: Vec<Vec<f64>> = x
                .iter()
                .enumerate()
                .map(|(pos, xt)| {
                    let mut r = matvec(&p[bi.qkv_w], &rms1p(xt, &p[bi.ln1_w], eps), m.qkv_width());
                    for (h, head) in r.chunks_mut(hd).take(nh + nkv).enumerate() {
                        let w = match h < nh {
                            true => bi.q_norm,
                            false => bi.k_norm,
                        };
                        if let Some(w) = w {
                            let n = rms1p(head, &p[w], eps);
                            head.copy_from_slice(&n);
                        }
                        rope(head, pos, theta);
                    }
                    r
                })
                .collect();
            for i in 0..t {
                let mut att = vec![0.0; nh * hd];
                for h in 0..nh {
                    let g = h / (nh / nkv);
                    let q = &qkv[i][h * hd..][..hd];
                    let keys: Vec<usize> = (0..=i)
                        .filter(|&j| m.sliding_window(l).is_none_or(|w| i - j < w))
                        .collect();
                    let scores: Vec<f64> = keys
                        .iter()
                        .map(|&j| {
                            let k = &qkv[j][(nh + g) * hd..][..hd];
                            let sc = m.attn_scale() as f64
                                * q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>();
                            m.attn_softcap()
                                .map_or(sc, |cap| cap as f64 * (sc / cap as f64).tanh())
                        })
                        .collect();
                    let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|v| (v - mx).exp()).sum();
                    for (&j, sc) in keys.iter().zip(&scores) {
                        let pr = (sc - mx).exp() / z;
                        for e in 0..hd {
                            att[h * hd + e] += pr * qkv[j][(nh + nkv + g) * hd + e];
                        }
                    }
                }
                let o = matvec(&p[bi.o_w], &att, c);
                let o = rms1p(&o, &p[bi.post_attn_norm.unwrap()], eps);
                x[i].iter_mut().zip(o).for_each(|(a, b)| *a += b);
            }
            for xt in x.iter_mut() {
                let gu = matvec(&p[bi.up_w.unwrap()], &rms1p(xt, &p[bi.ln2_w], eps), 2 * ff);
                let a: Vec<f64> = (0..ff).map(|k| gelu_tanh(gu[k]) * gu[ff + k]).collect();
                let y = matvec(&p[bi.down_w.unwrap()], &a, c);
                let y = rms1p(&y, &p[bi.post_mlp_norm.unwrap()], eps);
                xt.iter_mut().zip(y).for_each(|(a, b)| *a += b);
            }
        }
        for (i, xt) in x.iter().enumerate() {
            let mut logits = matvec(&p[idx.wte], &rms1p(xt, &p[idx.lnf_w], eps), m.vocab_size);
            if let Some(cap) = m.final_softcap() {
                logits
                    .iter_mut()
                    .for_each(|v| *v = cap as f64 * (*v / cap as f64).tanh());
            }
            let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = mx + logits.iter().map(|v| (v - mx).exp()).sum::<f64>().ln();
            total += lse - logits[batch.targets[s * t + i] as usize];
        }
    }
    total / (b * t) as f64
}

/// The engine's fp32 loss, eager and fused, equals the naive reference
/// at random weights, and so does each feature's effect: the soft caps
/// and the windows change the loss by what the reference says (a sequence
/// of 80 tokens puts the fused kernel's skipped tiles to work).
#[test]
fn the_loss_matches_a_naive_reference() {
    let g2 = load_model("gemma-tiny").unwrap();
    let no_caps = {
        let mut m = g2.clone();
        let g = m.gemma.as_mut().unwrap();
        (g.attn_softcap, g.final_softcap) = (None, None);
        m
    };
    let no_window = {
        let mut m = g2.clone();
        m.gemma.as_mut().unwrap().sliding_window = None;
        m
    };
    let (b, t) = (2, 80);
    let batch = DataSource::synthetic(256, 9).next_batch(b, t);
    let mut losses = Vec::new();
    for model in [g2, no_caps, no_window, gemma3_tiny()] {
        let mut e = Engine::new(model.clone(), tc(t), CpuBackend::new(2).unwrap(), None).unwrap();
        // Weights of some size, so that the caps and the norms' offsets bite.
        let mut rng = Rng::new(3);
        let mut p = e.params_host().unwrap();
        for x in p.iter_mut().flatten() {
            *x += (0.3 * rng.normal()) as f32;
        }
        e.set_params_host(&p);
        let want = reference_loss(&model, &p, &batch, b, t);
        for attention in [Attention::Eager, Attention::Fused] {
            let mut e = Engine::new(
                model.clone(),
                TrainConfig { attention, ..tc(t) },
                CpuBackend::new(2).unwrap(),
                None,
            )
            .unwrap();
            e.set_params_host(&p);
            let got = e.eval_loss(&batch).unwrap().unwrap() as f64;
            assert!(
                (got - want).abs() < 2e-4 * want.abs().max(1.0),
                "{} {attention:?}: engine {got} vs reference {want}",
                model.name
            );
        }
        losses.push(want);
    }
    // Each feature moves the loss (else the comparison above proves little).
    assert!((losses[0] - losses[1]).abs() > 1e-2, "caps: {losses:?}");
    assert!((losses[0] - losses[2]).abs() > 1e-3, "window: {losses:?}");
}

// ---- the command line -------------------------------------------------------

#[test]
fn what_gemma_does_not_combine_with_is_refused_by_name() {
    let err = refused(
        &[
            "run",
            "--model",
            "gemma-tiny",
            "--device",
            "cuda",
            "--steps",
            "1",
        ],
        "--device",
    );
    assert!(
        err.contains("is a Gemma") && err.contains("cuda backend"),
        "{err}"
    );
    let err = refused(
        &[
            "run",
            "--model",
            "gemma-tiny",
            "--device",
            "meta",
            "--ranks",
            "2",
            "--tensor-parallel",
            "2",
        ],
        "--tensor-parallel",
    );
    assert!(err.contains("is a Gemma"), "{err}");
    // hf-eager models Gemma (tests/it/hf_reference.rs holds it to PyTorch).
    let out = memfit(&[
        "run",
        "--model",
        "gemma-tiny",
        "--device",
        "meta",
        "--framework",
        "hf-eager",
    ]);
    assert!(out.status.success(), "{}", common::stderr(&out));
}

#[test]
fn the_cli_lists_runs_and_plans_gemma() {
    let out = memfit(&["models"]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    for name in ["gemma-2-2b", "gemma-2-9b", "gemma-3-1b", "gemma-tiny"] {
        assert!(text.contains(name), "{name} missing from:\n{text}");
    }
    let r = common::ok_json(
        &[
            "run",
            "--model",
            "gemma-2-9b",
            "--device",
            "meta",
            "--precision",
            "bf16",
        ],
        &[
            "--attention",
            "fused",
            "--checkpointing",
            "full",
            "--seq-len",
            "4096",
            "--format",
            "json",
        ],
    );
    assert!(r["peak_bytes"]["total"].as_u64().unwrap() > 9_000_000_000 * 2);
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes");
    let out = memfit(&["plan", dir.join("gemma-2-9b-8xh100.yaml").to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{}", common::stderr(&out));
    assert!(text.contains("hf-eager"), "{text}");
    let out = memfit(&[
        "plan",
        dir.join("gemma-2-9b-lora-4090.yaml").to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", common::stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let points = v["points"].as_array().unwrap();
    assert!(points.iter().all(|p| p["point"]["framework"] == "hf-eager"));
    assert!(points.iter().any(|p| p["status"] == "fits"), "{v}");
}
