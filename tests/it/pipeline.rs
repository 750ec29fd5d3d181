//! Pipeline parallelism: both schedules, and interleaved 1F1B (virtual
//! stages), train to the parameters one device reaches on the same global
//! batch, meta predicts every stage byte for byte, 1F1B holds fewer
//! micro-batches on the first stage than GPipe, and each stage holds the
//! micro-batches its schedule says.

use crate::common::training::{tolerance, train_single};

use memfit::backend::Backend;
use memfit::backend::cpu::CpuBackend;
use memfit::backend::meta::MetaBackend;
use memfit::config::ModelConfig;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::cluster::Cluster;
use memfit::engine::cluster::{cpu_links, meta_links};
use memfit::engine::{Checkpointing, Optimizer, Precision, Schedule, Sharding, TrainConfig};
use memfit::memory::{Category, PeakBytes};

fn cpu_cluster(
    model: &ModelConfig,
    tc: &TrainConfig,
    capacity: Option<u64>,
) -> Cluster<CpuBackend> {
    let backends = (0..tc.ranks).map(|_| CpuBackend::new(1).unwrap()).collect();
    let l = cpu_links(model, tc);
    match Cluster::new(model, tc, backends, l, capacity) {
        Ok(c) => c,
        Err((r, e)) => panic!("rank {r}: {e}"),
    }
}

fn meta_cluster(model: &ModelConfig, tc: &TrainConfig) -> Cluster<MetaBackend> {
    let backends = (0..tc.ranks)
        .map(|_| MetaBackend::emulating_cpu())
        .collect();
    let l = meta_links(model, tc);
    match Cluster::new(model, tc, backends, l, None) {
        Ok(c) => c,
        Err((r, e)) => panic!("rank {r}: {e}"),
    }
}

fn pipelined(stages: usize, k: usize, schedule: Schedule) -> TrainConfig {
    TrainConfig {
        seq_len: 32,
        micro_batch: 2,
        grad_accum: k,
        lr: Some(1e-3),
        ranks: stages,
        pipeline_stages: stages,
        schedule,
        ..TrainConfig::default()
    }
}

/// The whole model's weights, each tensor from the first stage holding it;
/// a tied embedding's two copies (first and last stage) must be equal, and
/// so must every replica's.
fn gathered<B: Backend>(c: &Cluster<B>) -> Vec<Vec<f32>> {
    let hosts: Vec<Vec<Vec<f32>>> = c.ranks.iter().map(|e| e.params_host().unwrap()).collect();
    (0..hosts[0].len())
        .map(|i| {
            let holders: Vec<usize> = (0..c.ranks.len())
                .filter(|&r| c.ranks[r].holds(i))
                .collect();
            assert!(!holders.is_empty(), "tensor {i} is held by no stage");
            for &r in &holders[1..] {
                assert_eq!(
                    hosts[r][i], hosts[holders[0]][i],
                    "copies of tensor {i} differ"
                );
            }
            hosts[holders[0]][i].clone()
        })
        .collect()
}

fn train<B: Backend + Send>(c: &mut Cluster<B>, tc: &TrainConfig, steps: usize) -> Vec<f32>
where
    B::Buf: Send,
{
    let mut data = DataSource::synthetic(256, 11);
    (0..steps)
        .map(|_| {
            let r = c
                .step_from(tc.grad_accum, || {
                    data.next_batch(tc.micro_batch, tc.seq_len)
                })
                .unwrap();
            assert!(!r.skipped);
            r.loss.unwrap()
        })
        .collect()
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

// The tolerance (common::training): the pipeline adds the same
// per-micro-batch gradients as one device; only the tied embedding's two
// halves (head, embedding) are summed in another order, and data-parallel
// replicas add theirs in rank order.

fn check_equivalent(model: &str, tc: TrainConfig) {
    check_equivalent_model(&load_model(model).unwrap(), tc);
}

fn check_equivalent_model(m: &ModelConfig, tc: TrainConfig) {
    let (model, m) = (&m.name, m.clone());
    let steps = 3;
    let (want, want_loss) = train_single(&m, &tc, steps);
    let mut c = cpu_cluster(&m, &tc, None);
    let loss = train(&mut c, &tc, steps);
    let got = gathered(&c);
    let d = max_diff(&got, &want);
    let label = format!(
        "{model} ({} blocks) S={} V={} ranks={} K={} {:?} {:?} {:?} {:?} {:?}",
        m.n_layer,
        tc.pipeline_stages,
        tc.virtual_stages,
        tc.ranks,
        tc.grad_accum,
        tc.schedule,
        tc.sharding,
        tc.precision,
        tc.optimizer,
        tc.partition
    );
    println!(
        "{label}: max |param difference| after {steps} steps = {d:.3e}; losses {loss:?} vs {want_loss:?}"
    );
    assert!(d <= tolerance(tc.precision), "{label}: {d}");
    for (a, b) in loss.iter().zip(&want_loss) {
        assert!((a - b).abs() <= 1e-3 * b.abs(), "{label}: loss {a} vs {b}");
    }
}

#[test]
fn both_schedules_train_like_one_device() {
    for schedule in [Schedule::Gpipe, Schedule::OneFOneB] {
        // Two stages, tied head (gpt2): the embedding gradient is summed over the ends.
        check_equivalent("gpt2-tiny", pipelined(2, 4, schedule));
        // Four stages of gpt2-tiny's two blocks: the embedding alone, one
        // block each, the head alone.
        check_equivalent("gpt2-tiny", pipelined(4, 6, schedule));
        // An untied head (llama), an uneven partition, fewer micro-batches than stages.
        check_equivalent(
            "llama-tiny",
            TrainConfig {
                partition: Some(vec![2, 0]),
                ..pipelined(2, 1, schedule)
            },
        );
    }
}

#[test]
fn the_pipeline_composes_with_data_parallelism_and_the_knobs() {
    // 2 stages x 2 replicas.
    for sharding in [Sharding::Ddp, Sharding::Zero1] {
        check_equivalent(
            "gpt2-tiny",
            TrainConfig {
                ranks: 4,
                sharding,
                ..pipelined(2, 3, Schedule::OneFOneB)
            },
        );
    }
    check_equivalent(
        "llama-tiny",
        TrainConfig {
            precision: Precision::Bf16,
            checkpointing: Checkpointing::Full,
            optimizer: Optimizer::Adamw8bit,
            ..pipelined(2, 3, Schedule::Gpipe)
        },
    );
    check_equivalent(
        "gpt2-tiny",
        TrainConfig {
            optimizer: Optimizer::Adafactor,
            lr: Some(1e-3),
            ..pipelined(3, 2, Schedule::OneFOneB)
        },
    );
}

fn peaks<B: Backend>(c: &Cluster<B>) -> Vec<(PeakBytes, u64, u64)> {
    c.ranks
        .iter()
        .map(|e| {
            (
                e.dev.tracker.peak_bytes(),
                e.dev.meter.sent,
                e.dev.meter.received,
            )
        })
        .collect()
}

#[test]
fn meta_predicts_every_stage_byte_for_byte() {
    let m = load_model("gpt2-tiny").unwrap();
    for stages in [2, 4] {
        for schedule in [Schedule::Gpipe, Schedule::OneFOneB] {
            for (precision, checkpointing) in [
                (Precision::Fp32, Checkpointing::None),
                (Precision::Bf16, Checkpointing::Full),
                (Precision::Bf16, Checkpointing::Selective),
            ] {
                let tc = TrainConfig {
                    precision,
                    checkpointing,
                    ..pipelined(stages, 5, schedule)
                };
                let mut cpu = cpu_cluster(&m, &tc, None);
                train(&mut cpu, &tc, 1);
                let mut meta = meta_cluster(&m, &tc);
                meta.step_from(tc.grad_accum, || unreachable!("meta reads no data"))
                    .unwrap();
                let (a, b) = (peaks(&cpu), peaks(&meta));
                assert_eq!(
                    a, b,
                    "S={stages} {schedule:?} {precision:?} {checkpointing:?}"
                );
                println!(
                    "S={stages} {schedule:?} {precision:?} {checkpointing:?}: stage peaks {:?}",
                    a.iter().map(|p| p.0.total).collect::<Vec<_>>()
                );
            }
        }
    }
}

#[test]
fn one_f_one_b_holds_fewer_activations_on_the_first_stage() {
    let m = load_model("gpt2-tiny").unwrap();
    let (stages, k) = (2, 6);
    let act = |schedule| {
        let tc = pipelined(stages, k, schedule);
        let mut c = cpu_cluster(&m, &tc, None);
        train(&mut c, &tc, 1);
        c.ranks
            .iter()
            .map(|e| e.dev.tracker.peak_bytes().get(Category::Activations))
            .collect::<Vec<_>>()
    };
    let (gpipe, ofob) = (act(Schedule::Gpipe), act(Schedule::OneFOneB));
    println!("K={k} S={stages}: activation peaks per stage, gpipe {gpipe:?}, 1f1b {ofob:?}");
    assert!(
        ofob[0] < gpipe[0],
        "stage 0: 1f1b {} vs gpipe {}",
        ofob[0],
        gpipe[0]
    );
    // Stage 0 keeps S = 2 micro-batches under 1F1B against K = 6 under
    // GPipe; its per-micro-batch activations (everything but the token ids)
    // scale accordingly.
    let per_mb = |x: u64| x as f64;
    assert!(
        per_mb(gpipe[0]) / per_mb(ofob[0]) > 2.0,
        "{gpipe:?} vs {ofob:?}"
    );
    // The last stage holds one micro-batch either way under 1F1B.
    assert!(ofob[1] < gpipe[1]);
}

#[test]
fn a_stage_that_runs_out_of_memory_stops_the_pipeline_without_hanging() {
    let m = load_model("gpt2-tiny").unwrap();
    let tc = pipelined(2, 4, Schedule::Gpipe);
    // Enough for the weights, not for four micro-batches of activations.
    let mut c = cpu_cluster(&m, &tc, Some(2 << 20));
    let mut data = DataSource::synthetic(256, 11);
    let err = c
        .step_from(tc.grad_accum, || {
            data.next_batch(tc.micro_batch, tc.seq_len)
        })
        .unwrap_err();
    // Stage 0 fills first (it holds all four micro-batches under GPipe);
    // stage 1, waiting for its activations, was released and finished.
    assert_eq!(err.0, 0, "{err:?}");
    assert!(err.1.live.total() > 0);
}

/// `name` with `n_layer` blocks: enough for more model chunks.
fn deeper(name: &str, n_layer: usize) -> ModelConfig {
    ModelConfig {
        n_layer,
        ..load_model(name).unwrap()
    }
}

fn interleaved(stages: usize, v: usize, k: usize) -> TrainConfig {
    TrainConfig {
        virtual_stages: v,
        ..pipelined(stages, k, Schedule::OneFOneB)
    }
}

#[test]
fn interleaved_1f1b_trains_like_one_device() {
    // gpt2-tiny's 2 blocks and its ends in 2 x 2 chunks: the embedding
    // alone and block 1 on rank 0, block 0 and the (tied) head alone on
    // rank 1, whose chunk-0 output goes round to rank 0.
    check_equivalent("gpt2-tiny", interleaved(2, 2, 4));
    // Three chunks per rank, K = S (every forward in the warm-up on rank 0).
    check_equivalent_model(&deeper("gpt2-tiny", 4), interleaved(2, 3, 2));
    check_equivalent_model(&deeper("gpt2-tiny", 4), interleaved(2, 3, 6));
    // Three stages, an untied head, mixed precision and recomputation.
    check_equivalent_model(
        &deeper("llama-tiny", 6),
        TrainConfig {
            precision: Precision::Bf16,
            checkpointing: Checkpointing::Full,
            ..interleaved(3, 2, 6)
        },
    );
    // A partition of one range per chunk, in model order.
    check_equivalent_model(
        &deeper("llama-tiny", 4),
        TrainConfig {
            partition: Some(vec![0, 2, 1, 1]),
            ..interleaved(2, 2, 4)
        },
    );
}

#[test]
fn interleaved_1f1b_composes_with_data_parallelism() {
    // 2 stages x 2 chunks x 2 replicas.
    for sharding in [Sharding::Ddp, Sharding::Zero1] {
        check_equivalent(
            "gpt2-tiny",
            TrainConfig {
                ranks: 4,
                sharding,
                ..interleaved(2, 2, 2)
            },
        );
    }
}

#[test]
fn meta_predicts_every_interleaved_stage_byte_for_byte() {
    for (m, stages, v, k) in [
        (load_model("gpt2-tiny").unwrap(), 2, 2, 4),
        (deeper("gpt2-tiny", 4), 2, 3, 4),
        (deeper("llama-tiny", 4), 3, 2, 6),
        (deeper("gpt2-tiny", 6), 4, 2, 8),
    ] {
        for (precision, checkpointing) in [
            (Precision::Fp32, Checkpointing::None),
            (Precision::Bf16, Checkpointing::Full),
        ] {
            let tc = TrainConfig {
                precision,
                checkpointing,
                ..interleaved(stages, v, k)
            };
            let label = format!(
                "{} S={stages} V={v} K={k} {precision:?} {checkpointing:?}",
                m.name
            );
            let mut cpu = cpu_cluster(&m, &tc, None);
            train(&mut cpu, &tc, 1);
            let mut meta = meta_cluster(&m, &tc);
            meta.step_from(tc.grad_accum, || unreachable!("meta reads no data"))
                .unwrap();
            let (a, b) = (peaks(&cpu), peaks(&meta));
            assert_eq!(a, b, "{label}");
            // Each stage held what Megatron's schedule holds: its warm-up
            // forwards and one more, in chunk-micro-batches.
            for (s, (c, e)) in cpu.ranks.iter().zip(&meta.ranks).enumerate() {
                let want = Schedule::OneFOneB.in_flight(s, stages, v, k);
                assert_eq!(c.held_micro_batches(), want, "{label}: stage {s}");
                assert_eq!(e.held_micro_batches(), want, "{label}: stage {s}");
            }
            println!(
                "{label}: stage peaks {:?}",
                a.iter().map(|p| p.0.total).collect::<Vec<_>>()
            );
        }
    }
}

#[test]
fn interleaving_holds_more_chunks_and_sends_once_per_chunk_boundary() {
    // 6 blocks and the ends: 2 layers per chunk at V = 2, 4 per stage at V = 1.
    let m = deeper("gpt2-tiny", 6);
    let (stages, k) = (2, 4);
    let run = |v| {
        let tc = interleaved(stages, v, k);
        let mut c = cpu_cluster(&m, &tc, None);
        train(&mut c, &tc, 1);
        (c.ranks.iter())
            .map(|e| {
                (
                    e.held_micro_batches(),
                    e.dev.tracker.peak_bytes().get(Category::Activations),
                    e.dev.meter.p2p_sent,
                )
            })
            .collect::<Vec<_>>()
    };
    let (one, two) = (run(1), run(2));
    println!(
        "S={stages} K={k}: (held, activation peak, p2p bytes) per stage, V=1 {one:?}, V=2 {two:?}"
    );
    // Stage 0 holds 2 micro-batches of 4 layers at V = 1, and
    // (2-1) x 2 + (2-1) x 2 + 1 = 5 chunk-micro-batches of 2 at V = 2.
    assert_eq!((one[0].0, two[0].0), (2, 5));
    assert!(two[0].1 > one[0].1, "{one:?} vs {two:?}");
    // Each of the K micro-batches crosses every chunk boundary once each
    // way, 2K(SV - 1) messages against 2K(S - 1): here 3 times the bytes.
    let sent = |x: &[(usize, u64, u64)]| x.iter().map(|r| r.2).sum::<u64>();
    assert!(sent(&one) > 0);
    assert_eq!(
        sent(&two) * (stages as u64 - 1),
        sent(&one) * (2 * stages as u64 - 1)
    );
}

#[test]
fn interleaved_1f1b_composes_with_tensor_and_expert_parallelism() {
    // 2 stages x 2 chunks, each a tensor-parallel pair (each rank holds
    // slices, so the losses are compared): trains as one device, and meta
    // predicts every rank.
    let m = deeper("llama-tiny", 4);
    let tc = TrainConfig {
        ranks: 4,
        tensor_parallel: 2,
        ..interleaved(2, 2, 2)
    };
    let (_, want) = train_single(&m, &tc, 3);
    let got = train(&mut cpu_cluster(&m, &tc, None), &tc, 3);
    println!("tensor-parallel pairs, S=2 V=2: losses {got:?} vs one device {want:?}");
    for (a, b) in got.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "{got:?} vs {want:?}");
    }
    let mut cpu = cpu_cluster(&m, &tc, None);
    train(&mut cpu, &tc, 1);
    let mut meta = meta_cluster(&m, &tc);
    meta.step_from(tc.grad_accum, || unreachable!("meta reads no data"))
        .unwrap();
    assert_eq!(peaks(&cpu), peaks(&meta), "tensor-parallel pairs");

    // A mixture in 2 x 2 chunks over 2 replicas that split its experts
    // (capacity-bounded, so meta's routing is cpu's): each chunk's routed
    // block adds its balancing loss, and the step is the one plain 1F1B
    // takes.
    let mut moe = load_model("moe-tiny").unwrap();
    moe.moe.as_mut().unwrap().first_dense = 0;
    let tc = |v| TrainConfig {
        seq_len: 16,
        ranks: 4,
        sharding: Sharding::Zero1,
        expert_parallel: 2,
        capacity_factor: Some(1.5),
        ..interleaved(2, v, 2)
    };
    let losses = |v| {
        let tc = tc(v);
        let mut c = cpu_cluster(&moe, &tc, None);
        let got = train(&mut c, &tc, 1);
        let mut meta = meta_cluster(&moe, &tc);
        meta.step_from(tc.grad_accum, || unreachable!("meta reads no data"))
            .unwrap();
        assert_eq!(peaks(&c), peaks(&meta), "V={v}");
        got
    };
    let (one, two) = (losses(1), losses(2));
    for (a, b) in one.iter().zip(&two) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "{one:?} vs {two:?}");
    }
}
