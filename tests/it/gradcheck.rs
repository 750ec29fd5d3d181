//! Analytic gradients of every parameter tensor against central finite
//! differences of the loss, for both families and for Qwen2's q/k/v biases.
//!
//! The engine computes in f32, so a finite difference carries rounding noise of
//! about |loss| * 1e-7 / eps. The check therefore perturbs by EPS = 1e-2 (the
//! truncation error of a central difference is O(eps^2)), samples entries where
//! the gradient is not negligible, and accepts |analytic - numeric| <=
//! ATOL + RTOL * |numeric|, with the figures below.

use memfit::backend::cpu::CpuBackend;
use memfit::config::ModelConfig;
use memfit::config::hf::import_hf_config;
use memfit::config::profile::load_model;
use memfit::data::{Batch, DataSource};
use memfit::engine::{Engine, TrainConfig};
use memfit::rng::Rng;

const EPS: f32 = 1e-2;
const ATOL: f64 = 2e-5;
const RTOL: f64 = 1e-2;

/// An engine at perturbed weights (so that every tensor gets a real
/// gradient), its weights, a batch and the analytic gradients.
struct Checked {
    e: Engine<CpuBackend>,
    params: Vec<Vec<f32>>,
    batch: Batch,
    grads: Vec<Vec<f32>>,
    /// The perturbation's stream, continued: it picks the entries to check.
    rng: Rng,
}

/// The checks' batch shape: 2 sequences of 8 tokens.
pub(crate) fn small(tc: TrainConfig) -> TrainConfig {
    TrainConfig {
        seq_len: 8,
        micro_batch: 2,
        ..tc
    }
}

fn at_perturbed_weights(model: &ModelConfig, tc: TrainConfig, seed: u64) -> Checked {
    let mut e = Engine::new(model.clone(), tc, CpuBackend::new(2).unwrap(), None).unwrap();
    // Move away from the init (zero biases, unit norms) so every tensor gets a real gradient.
    let mut rng = Rng::new(seed);
    let mut params = e.params_host().unwrap();
    for p in params.iter_mut() {
        for x in p.iter_mut() {
            *x += (0.05 * rng.normal()) as f32;
        }
    }
    e.set_params_host(&params);
    let batch = DataSource::synthetic(model.vocab_size, 3).next_batch(2, 8);
    e.compute_grads(&batch).unwrap();
    let grads = e.grads_host().unwrap();
    Checked {
        e,
        params,
        batch,
        grads,
        rng,
    }
}

impl Checked {
    /// The central difference of the loss in entry `j` of tensor `i`.
    fn numeric(&mut self, i: usize, j: usize) -> f64 {
        self.numeric_at(i, j, EPS)
    }

    fn numeric_at(&mut self, i: usize, j: usize, eps: f32) -> f64 {
        let orig = self.params[i][j];
        let mut eval = |delta: f32| {
            self.params[i][j] = orig + delta;
            self.e.set_params_host(&self.params);
            self.e.eval_loss(&self.batch).unwrap().unwrap() as f64
        };
        let numeric = (eval(eps) - eval(-eps)) / (2.0 * eps as f64);
        self.params[i][j] = orig;
        self.e.set_params_host(&self.params);
        numeric
    }

    /// A mixture of experts' loss is piecewise smooth: a step that changes
    /// some token's choice of experts jumps. Such an entry is recognised by
    /// its difference quotient moving with the step (it does not, beyond
    /// rounding, where the loss is smooth) and is not checked.
    fn jumps(&mut self, i: usize, j: usize, numeric: f64) -> bool {
        let half = self.numeric_at(i, j, EPS / 2.0);
        (half - numeric).abs() > ATOL + RTOL * numeric.abs()
    }
}

fn gradcheck(name: &str) {
    gradcheck_model(&load_model(name).unwrap());
}

fn gradcheck_model(model: &ModelConfig) {
    gradcheck_trained(model, small(TrainConfig::default()));
}

/// Every tensor that trains under `tc` (LoRA: the adapters; a frozen
/// tensor has no gradient) against finite differences.
pub(crate) fn gradcheck_trained(model: &ModelConfig, tc: TrainConfig) {
    let name = &model.name;
    let mut c = at_perturbed_weights(model, tc, 42);
    let specs = c.e.param_specs().to_vec();
    let mut worst = (0.0f64, String::new());
    // Entries checked, and skipped where a mixture of experts' routing jumps.
    let (mut checked, mut jumps) = (0, 0);
    for (i, spec) in specs.iter().enumerate() {
        let g = c.grads[i].clone();
        if g.is_empty() {
            continue;
        }
        let gmax = g.iter().fold(0f32, |a, &x| a.max(x.abs()));
        assert!(gmax > 0.0, "{name}: {} has an all-zero gradient", spec.name);
        // The largest entry, then random entries whose gradient is not
        // negligible, until four are checked (where the loss is smooth).
        let largest = (g.iter().enumerate())
            .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
            .unwrap()
            .0;
        let (mut here, mut tries) = (0, 0);
        while here < 4 && tries < 1000 {
            tries += 1;
            let j = match tries {
                1 => largest,
                _ => c.rng.below(g.len() as u64) as usize,
            };
            if g[j].abs() <= 0.05 * gmax {
                continue;
            }
            let numeric = c.numeric(i, j);
            if model.moe.is_some() && c.jumps(i, j, numeric) {
                jumps += 1;
                continue;
            }
            here += 1;
            let analytic = g[j] as f64;
            let err = (analytic - numeric).abs();
            let rel = err / (ATOL + RTOL * numeric.abs());
            if rel > worst.0 {
                worst = (
                    rel,
                    format!(
                        "{}[{j}]: analytic {analytic:.6e}, numeric {numeric:.6e}",
                        spec.name
                    ),
                );
            }
            assert!(
                err <= ATOL + RTOL * numeric.abs(),
                "{name}: {}[{j}]: analytic {analytic:.6e} vs numeric {numeric:.6e}",
                spec.name
            );
        }
        // A tensor with fewer entries above the threshold checks them all.
        let above = g.iter().filter(|x| x.abs() > 0.05 * gmax).count();
        assert!(
            here >= above.min(2),
            "{name}: {} checked at {here} entries",
            spec.name
        );
        checked += here;
    }
    eprintln!(
        "{name}: worst error at {:.2} of the tolerance, {}; {checked} entries checked, {jumps} skipped where the routing jumps",
        worst.0, worst.1
    );
}

#[test]
fn gpt2_tiny_gradients_match_finite_differences() {
    gradcheck("gpt2-tiny");
}

#[test]
fn llama_tiny_gradients_match_finite_differences() {
    gradcheck("llama-tiny");
}

/// A tiny Qwen2-shaped model (imported from a config.json): the gradient of
/// the q|k|v bias matches, in each of its q, k and v parts.
#[test]
fn qkv_bias_gradient_matches_finite_difference() {
    let text = r#"{
        "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "vocab_size": 256, "tie_word_embeddings": true
    }"#;
    let model = import_hf_config(text, "qwen2-tiny.json").unwrap();
    let mut c = at_perturbed_weights(&model, small(TrainConfig::default()), 7);
    let (_, idx) = model.param_layout();
    for block in &idx.blocks {
        let i = block.qkv_b.expect("qkv bias");
        let g = c.grads[i].clone();
        let gmax = g.iter().fold(0f32, |a, &x| a.max(x.abs()));
        assert!(gmax > 0.0, "all-zero gradient for the q|k|v bias");
        // The largest entry, and one from each of the q, k and v parts.
        let width = model.qkv_width();
        let q = model.n_head * model.head_dim();
        let kv = model.n_kv_head() * model.head_dim();
        let argmax = |r: std::ops::Range<usize>| {
            r.max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs()))
                .unwrap()
        };
        for j in [
            argmax(0..width),
            argmax(0..q),
            argmax(q..q + kv),
            argmax(q + kv..width),
        ] {
            let numeric = c.numeric(i, j);
            let analytic = g[j] as f64;
            assert!(
                (analytic - numeric).abs() <= ATOL + RTOL * numeric.abs(),
                "bias[{j}]: analytic {analytic:.6e}, numeric {numeric:.6e}"
            );
        }
    }
}

/// A mixture of experts (a dense block, then a routed block with a shared
/// expert): the router's, the stacked experts' and the shared expert's
/// gradients, through the top-k weights' renormalisation and the
/// load-balancing loss.
#[test]
fn moe_tiny_gradients_match_finite_differences() {
    gradcheck("moe-tiny");
}

/// Qwen3-MoE's shape: q and k normalised per head, heads twice as wide as
/// `hidden_size / num_attention_heads`, every block routed; OLMoE's: q and
/// k normalised whole, top-k weights not renormalised; Qwen2-MoE's: q/k/v
/// biases, a shared expert under a sigmoid gate.
#[test]
fn qwen_and_olmoe_mixtures_gradients_match_finite_differences() {
    for (model_type, extra) in [
        (
            "qwen3_moe",
            r#""head_dim": 32, "num_experts": 4, "moe_intermediate_size": 24, "norm_topk_prob": true"#,
        ),
        ("olmoe", r#""num_experts": 4, "norm_topk_prob": false"#),
        (
            "qwen2_moe",
            r#""num_experts": 4, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40"#,
        ),
    ] {
        let text = format!(
            r#"{{"model_type": "{model_type}", "hidden_size": 64, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "vocab_size": 256, "num_experts_per_tok": 2,
            {extra}}}"#
        );
        let model = import_hf_config(&text, &format!("{model_type}-tiny.json")).unwrap();
        assert!(model.moe.is_some());
        gradcheck_model(&model);
    }
}

/// Gemma 2's block (gemma-tiny): the four (1 + w) norms, GeGLU, the
/// embedding's √C, the attention and final soft caps, the sliding window
/// (4 keys of 8) and the scale of its own; through eager attention (the
/// saved tanh) and fused (recomputed).
#[test]
fn gemma_tiny_gradients_match_finite_differences() {
    let model = load_model("gemma-tiny").unwrap();
    assert!(model.sliding_window(0).is_some_and(|w| w < 8));
    gradcheck_model(&model);
    gradcheck_fused(&model);
}

/// Gemma 3's: the q and k norms of (1 + w), RoPE's local base on the
/// sliding layers, no caps.
#[test]
fn gemma3_tiny_gradients_match_finite_differences() {
    let text = r#"{"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 64, "vocab_size": 256,
        "sliding_window": 3, "sliding_window_pattern": 3, "query_pre_attn_scalar": 20}"#;
    let model = import_hf_config(text, "gemma3-tiny.json").unwrap();
    gradcheck_model(&model);
}

/// The fused kernels' gradients against the eager ones (checked above
/// against finite differences) at the same weights and batch.
fn gradcheck_fused(model: &ModelConfig) {
    let eager = at_perturbed_weights(model, small(TrainConfig::default()), 42);
    let tc = TrainConfig {
        seq_len: 8,
        micro_batch: 2,
        attention: memfit::engine::Attention::Fused,
        ..TrainConfig::default()
    };
    let mut e = Engine::new(model.clone(), tc, CpuBackend::new(2).unwrap(), None).unwrap();
    e.set_params_host(&eager.params);
    e.compute_grads(&eager.batch).unwrap();
    for (i, (f, g)) in e.grads_host().unwrap().iter().zip(&eager.grads).enumerate() {
        for (j, (a, b)) in f.iter().zip(g).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 + 1e-3 * b.abs(),
                "tensor {i}[{j}]: fused {a} vs eager {b}"
            );
        }
    }
}
