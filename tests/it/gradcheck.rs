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

fn at_perturbed_weights(model: &ModelConfig, seed: u64) -> Checked {
    let tc = TrainConfig {
        seq_len: 8,
        micro_batch: 2,
        ..TrainConfig::default()
    };
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
        let orig = self.params[i][j];
        let mut eval = |delta: f32| {
            self.params[i][j] = orig + delta;
            self.e.set_params_host(&self.params);
            self.e.eval_loss(&self.batch).unwrap().unwrap() as f64
        };
        let numeric = (eval(EPS) - eval(-EPS)) / (2.0 * EPS as f64);
        self.params[i][j] = orig;
        self.e.set_params_host(&self.params);
        numeric
    }
}

fn gradcheck(name: &str) {
    let model = load_model(name).unwrap();
    let mut c = at_perturbed_weights(&model, 42);
    let specs = c.e.param_specs().to_vec();
    let mut worst = (0.0f64, String::new());
    for (i, spec) in specs.iter().enumerate() {
        let g = c.grads[i].clone();
        let gmax = g.iter().fold(0f32, |a, &x| a.max(x.abs()));
        assert!(gmax > 0.0, "{name}: {} has an all-zero gradient", spec.name);
        // The largest entry, plus random entries whose gradient is not negligible.
        let mut picks = vec![
            g.iter()
                .enumerate()
                .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
                .unwrap()
                .0,
        ];
        let mut tries = 0;
        while picks.len() < 4 && tries < 1000 {
            let j = c.rng.below(g.len() as u64) as usize;
            if g[j].abs() > 0.05 * gmax {
                picks.push(j);
            }
            tries += 1;
        }
        for &j in &picks {
            let numeric = c.numeric(i, j);
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
    }
    eprintln!(
        "{name}: worst error at {:.2} of the tolerance, {}",
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
    let mut c = at_perturbed_weights(&model, 7);
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
