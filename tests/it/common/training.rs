//! The reference the parallel tests compare with: one device accumulating
//! the whole global batch.

use memfit::backend::cpu::CpuBackend;
use memfit::config::ModelConfig;
use memfit::data::DataSource;
use memfit::engine::{Engine, Precision, Sharding, TrainConfig};

/// Trains one cpu device for `steps` steps on the global batch of `tc`
/// (micro-batches x replicas, data seed 11, as the parallel runs read it):
/// the parameters after, and each step's loss.
pub fn train_single(
    model: &ModelConfig,
    tc: &TrainConfig,
    steps: usize,
) -> (Vec<Vec<f32>>, Vec<f32>) {
    let single = TrainConfig {
        grad_accum: tc.grad_accum * tc.data_ranks(),
        ranks: 1,
        sharding: Sharding::None,
        pipeline_stages: 1,
        virtual_stages: 1,
        partition: None,
        tensor_parallel: 1,
        ..tc.clone()
    };
    let mut e = Engine::new(
        model.clone(),
        single.clone(),
        CpuBackend::new(2).unwrap(),
        None,
    )
    .unwrap();
    let mut data = DataSource::synthetic(model.vocab_size, 11);
    let losses = (0..steps)
        .map(|_| {
            let r = e
                .step_from(single.grad_accum, || {
                    data.next_batch(tc.micro_batch, tc.seq_len)
                })
                .unwrap();
            assert!(!r.skipped);
            r.loss.unwrap()
        })
        .collect();
    (e.params_host().unwrap(), losses)
}

/// How far a parallel run may drift from [`train_single`] over the three
/// steps of these tests (lr 1e-3). Ranks and stages add the same gradients
/// in another order, so results differ by rounding. fp32: 1e-5, 1% of one
/// AdamW step (we see about 2e-6). bf16 rounds every gradient to 8 bits, so a
/// gradient near zero can change sign, and AdamW's normalised update then
/// moves that weight by about lr the other way: 2 x lr x 3 steps = 6e-3 (we
/// see up to 3.9e-3, one bf16 ulp at |w| = 1).
pub fn tolerance(p: Precision) -> f32 {
    match p {
        Precision::Fp32 => 1e-5,
        _ => 6e-3,
    }
}
