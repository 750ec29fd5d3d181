//! Analytic gradients of every parameter tensor against central finite
//! differences of the loss, for both families.
//!
//! The engine computes in f32, so a finite difference carries rounding noise of
//! about |loss| * 1e-7 / eps. The check therefore perturbs by EPS = 1e-2 (the
//! truncation error of a central difference is O(eps^2)), samples entries where
//! the gradient is not negligible, and accepts |analytic - numeric| <=
//! ATOL + RTOL * |numeric|, with the figures below.

use memfit::backend::cpu::CpuBackend;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::{Engine, TrainConfig};
use memfit::rng::Rng;

const EPS: f32 = 1e-2;
const ATOL: f64 = 2e-5;
const RTOL: f64 = 1e-2;

fn gradcheck(name: &str) {
    let model = load_model(name).unwrap();
    let tc = TrainConfig {
        seq_len: 8,
        micro_batch: 2,
        ..TrainConfig::default()
    };
    let mut e = Engine::new(model.clone(), tc, CpuBackend::new(2).unwrap(), None).unwrap();
    // Move away from the init (zero biases, unit norms) so every tensor gets a real gradient.
    let mut rng = Rng::new(42);
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
    let specs = e.param_specs().to_vec();
    let mut worst = (0.0f64, String::new());
    for (i, spec) in specs.iter().enumerate() {
        let g = &grads[i];
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
            let j = rng.below(g.len() as u64) as usize;
            if g[j].abs() > 0.05 * gmax {
                picks.push(j);
            }
            tries += 1;
        }
        for &j in &picks {
            let orig = params[i][j];
            let mut eval = |delta: f32| {
                params[i][j] = orig + delta;
                e.set_params_host(&params);
                e.eval_loss(&batch).unwrap().unwrap() as f64
            };
            let numeric = (eval(EPS) - eval(-EPS)) / (2.0 * EPS as f64);
            params[i][j] = orig;
            e.set_params_host(&params);
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
