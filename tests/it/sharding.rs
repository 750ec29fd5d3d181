//! Data parallelism and ZeRO: every level trains to the parameters one rank
//! reaches on the same global batch, per-rank memory follows the ZeRO
//! formulas, and meta predicts every rank byte for byte.

use crate::common::training::{tolerance, train_single};

use memfit::backend::Backend;
use memfit::backend::cpu::CpuBackend;
use memfit::backend::meta::MetaBackend;
use memfit::config::ModelConfig;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::cluster::Cluster;
use memfit::engine::cluster::{cpu_links, meta_links};
use memfit::engine::{Checkpointing, Optimizer, Precision, Sharding, TrainConfig};
use memfit::memory::PeakBytes;

const LEVELS: [Sharding; 4] = [
    Sharding::Ddp,
    Sharding::Zero1,
    Sharding::Zero2,
    Sharding::Zero3,
];

fn cpu_cluster(model: &ModelConfig, tc: &TrainConfig) -> Cluster<CpuBackend> {
    let n = tc.ranks;
    let backends = (0..n).map(|_| CpuBackend::new(1).unwrap()).collect();
    Cluster::new(model, tc, backends, cpu_links(model, tc), None).unwrap()
}

fn meta_cluster(model: &ModelConfig, tc: &TrainConfig) -> Cluster<MetaBackend> {
    let n = tc.ranks;
    let backends = (0..n).map(|_| MetaBackend::emulating_cpu()).collect();
    Cluster::new(model, tc, backends, meta_links(model, tc), None).unwrap()
}

/// The full weights after training, assembled from zero3's shards when the
/// ranks hold only shards; every rank's full copy must agree otherwise.
fn full_params<B: Backend>(c: &Cluster<B>) -> Vec<Vec<f32>> {
    let e0 = &c.ranks[0];
    if e0.train.sharding == Sharding::Zero3 {
        let shards: Vec<_> = c
            .ranks
            .iter()
            .map(|e| e.param_shards_host().unwrap())
            .collect();
        return (0..shards[0].len())
            .map(|i| {
                let mut full = Vec::new();
                for (r, sh) in shards.iter().enumerate() {
                    let (_, own) = e0.shard_extent(i, r).unwrap();
                    full.extend_from_slice(&sh[i][..own]);
                }
                full
            })
            .collect();
    }
    let p0 = e0.params_host().unwrap();
    for e in &c.ranks[1..] {
        assert_eq!(e.params_host().unwrap(), p0, "ranks disagree");
    }
    p0
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> (f32, f32) {
    let mut worst = (0.0f32, 0.0f32);
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        let d = (x - y).abs();
        if d > worst.0 {
            worst = (d, x.abs().max(y.abs()));
        }
    }
    worst
}

#[test]
fn every_level_matches_single_rank_training() {
    for name in ["gpt2-tiny", "llama-tiny"] {
        let model = load_model(name).unwrap();
        for precision in [Precision::Fp32, Precision::Bf16] {
            for ranks in [2, 4] {
                let base = TrainConfig {
                    seq_len: 16,
                    micro_batch: 2,
                    grad_accum: 2,
                    lr: Some(1e-3),
                    precision,
                    ranks,
                    ..TrainConfig::default()
                };
                let want = train_single(&model, &base, 3).0;
                for sharding in LEVELS {
                    let tc = TrainConfig {
                        sharding,
                        ..base.clone()
                    };
                    let mut c = cpu_cluster(&model, &tc);
                    let mut data = DataSource::synthetic(model.vocab_size, 11);
                    for _ in 0..3 {
                        let r = c
                            .step_from(tc.grad_accum, || data.next_batch(2, 16))
                            .unwrap();
                        assert!(!r.skipped);
                    }
                    let got = full_params(&c);
                    let (d, at) = max_diff(&got, &want);
                    eprintln!(
                        "{name} {precision:?} N={ranks} {sharding:?}: max |diff| {d:e} (at |w| {at:.3})"
                    );
                    assert!(
                        d <= tolerance(precision),
                        "{name} {precision:?} N={ranks} {sharding:?}: {d}"
                    );
                }
            }
        }
    }
}

/// SGD is not scale-invariant as AdamW is, so a wrong gradient scale (a
/// missing 1/N, a double reduction) shows. Three ranks over a vocabulary of
/// 251 rows: no tensor divides evenly, so every shard carries padding.
#[test]
fn sgd_with_uneven_shards_matches_single_rank_training() {
    let mut model = load_model("llama-tiny").unwrap();
    model.vocab_size = 251;
    model.name = "llama-tiny-v251".into();
    let base = TrainConfig {
        seq_len: 16,
        micro_batch: 2,
        grad_accum: 1,
        optimizer: Optimizer::Sgd,
        lr: Some(0.2),
        ranks: 3,
        ..TrainConfig::default()
    };
    let want = train_single(&model, &base, 3).0;
    for sharding in LEVELS {
        let tc = TrainConfig {
            sharding,
            ..base.clone()
        };
        let mut c = cpu_cluster(&model, &tc);
        let mut data = DataSource::synthetic(model.vocab_size, 11);
        for _ in 0..3 {
            c.step_from(1, || data.next_batch(2, 16)).unwrap();
        }
        let (d, _) = max_diff(&full_params(&c), &want);
        eprintln!("sgd N=3 vocab 251 {sharding:?}: max |diff| {d:e}");
        assert!(d <= 1e-5, "{sharding:?}: {d}");
    }
}

/// Which FSDP unit a parameter belongs to, from its name: 0 the embedding,
/// 1 + l block l, and the last the head (final norm, untied output projection).
fn unit_of(name: &str, layers: usize) -> usize {
    match name.strip_prefix("h.") {
        Some(rest) => 1 + rest.split('.').next().unwrap().parse::<usize>().unwrap(),
        None if name.starts_with("wte") || name.starts_with("wpe") => 0,
        None => layers + 1,
    }
}

fn meta_peaks(model: &ModelConfig, tc: &TrainConfig) -> Vec<PeakBytes> {
    let mut c = meta_cluster(model, tc);
    c.step_from(tc.grad_accum, || unreachable!("meta reads no data"))
        .unwrap();
    c.ranks.iter().map(|e| e.dev.tracker.peak_bytes()).collect()
}

#[test]
fn per_rank_memory_follows_the_zero_formulas() {
    // Llama-3.1-8B (untied head), 4 ranks, bf16 + AdamW: 2 + 2 + 12 bytes per parameter.
    let model = load_model("llama-3.1-8b").unwrap();
    let n = 4;
    let specs = model.param_layout().0;
    let psi: u64 = specs.iter().map(|s| s.numel() as u64).sum();
    let shards: u64 = specs.iter().map(|s| s.numel().div_ceil(n) as u64).sum();
    let mut unit = vec![0u64; model.n_layer + 2];
    for s in &specs {
        unit[unit_of(&s.name.to_string(), model.n_layer)] += s.numel() as u64;
    }
    let biggest_unit = *unit.iter().max().unwrap();
    let biggest_pair = unit.windows(2).map(|w| w[0] + w[1]).max().unwrap();
    let tc = |sharding, bucket_view| TrainConfig {
        seq_len: 256,
        micro_batch: 1,
        precision: Precision::Bf16,
        attention: memfit::engine::Attention::Fused,
        ranks: if sharding == Sharding::None { 1 } else { n },
        sharding,
        bucket_view,
        ..TrainConfig::default()
    };
    let peak = |sharding, view| {
        let p = meta_peaks(&model, &tc(sharding, view));
        assert!(p.iter().all(|r| *r == p[0]), "ranks are symmetric");
        p[0]
    };
    let none = peak(Sharding::None, false);
    let ddp = peak(Sharding::Ddp, false);
    let ddp_view = peak(Sharding::Ddp, true);
    let z1 = peak(Sharding::Zero1, false);
    let z2 = peak(Sharding::Zero2, false);
    let z3 = peak(Sharding::Zero3, false);
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    for (what, p) in [
        ("none", none),
        ("ddp", ddp),
        ("ddp+view", ddp_view),
        ("zero1", z1),
        ("zero2", z2),
        ("zero3", z3),
    ] {
        eprintln!(
            "llama-3.1-8b bf16 N=4 {what:>8}: params {:6.2} grads {:6.2} optimizer {:6.2} comm {:6.2} total {:6.2} GiB",
            gib(p.parameters),
            gib(p.gradients),
            gib(p.optimizer),
            gib(p.communication),
            gib(p.total)
        );
    }
    assert_eq!(
        (none.parameters, none.gradients, none.optimizer),
        (2 * psi, 2 * psi, 12 * psi)
    );
    // DDP: the buckets are a second copy of the gradients, unless gradients are views.
    assert_eq!(ddp.communication, 2 * psi);
    assert_eq!(ddp_view.communication, 0);
    assert_eq!(ddp.total - ddp_view.total, 2 * psi);
    // zero1: master weights and AdamW state are 1/N (12 bytes per sharded element).
    assert_eq!(z1.optimizer, 12 * shards);
    assert!((z1.optimizer as f64 / none.optimizer as f64 - 0.25).abs() < 1e-4);
    assert_eq!(z1.parameters, 2 * psi);
    // zero1 keeps whole gradients and adds the step's shards.
    assert_eq!(z1.gradients, 2 * (psi + shards));
    // zero2: the gradient shards plus one unit's full gradients while it runs backward.
    assert_eq!(z2.gradients, 2 * (shards + biggest_unit));
    assert_eq!(z2.optimizer, 12 * shards);
    // zero3: the weight shards plus two units (the running one and the prefetched one).
    assert_eq!(z3.parameters, 2 * (shards + biggest_pair));
    assert_eq!(z3.gradients, z2.gradients);
    assert!(z3.total < z2.total && z2.total < z1.total && z1.total < none.total);
    eprintln!(
        "zero3 per-rank parameters: {:.3} of the model (1/N = 0.25, plus two units)",
        z3.parameters as f64 / none.parameters as f64
    );
}

#[test]
fn meta_matches_cpu_on_every_rank() {
    for name in ["gpt2-tiny", "llama-tiny"] {
        let model = load_model(name).unwrap();
        // With the other knobs: 8-bit AdamW quantises each shard in its own
        // blocks; checkpointing recomputes blocks whose weights zero3 gathers.
        for (ranks, precision, optimizer, checkpointing) in [
            (
                2,
                Precision::Fp32,
                Optimizer::Adamw8bit,
                Checkpointing::None,
            ),
            (3, Precision::Bf16, Optimizer::Adamw, Checkpointing::Full),
            (2, Precision::Fp16, Optimizer::Sgd, Checkpointing::Full),
            // Selective checkpointing copies rows of weights zero3 gathers.
            (
                2,
                Precision::Bf16,
                Optimizer::Adamw,
                Checkpointing::Selective,
            ),
        ] {
            for sharding in LEVELS {
                let tc = TrainConfig {
                    seq_len: 16,
                    micro_batch: 2,
                    grad_accum: 2,
                    precision,
                    optimizer,
                    checkpointing,
                    ranks,
                    sharding,
                    bucket_view: ranks == 3,
                    ..TrainConfig::default()
                };
                let mut cpu = cpu_cluster(&model, &tc);
                let mut meta = meta_cluster(&model, &tc);
                let mut data = DataSource::synthetic(model.vocab_size, 5);
                for _ in 0..2 {
                    let r = cpu.step_from(2, || data.next_batch(2, 16)).unwrap();
                    assert!(!r.skipped && r.loss.unwrap().is_finite());
                    meta.step_from(2, || unreachable!()).unwrap();
                }
                for (c, m) in cpu.ranks.iter().zip(&meta.ranks) {
                    let what = format!("{name} N={ranks} {sharding:?} {precision:?}");
                    assert_eq!(
                        c.dev.tracker.peak_bytes(),
                        m.dev.tracker.peak_bytes(),
                        "{what}"
                    );
                    assert_eq!(timeline(&c.dev.tracker), timeline(&m.dev.tracker), "{what}");
                    assert_eq!(
                        (c.dev.meter.sent, c.dev.meter.received),
                        (m.dev.meter.sent, m.dev.meter.received)
                    );
                }
                for (i, dev) in cpu.release().into_iter().enumerate() {
                    assert_eq!(dev.tracker.live().total(), 0, "rank {i} leaked");
                }
            }
        }
    }
}

fn timeline(t: &memfit::memory::Tracker) -> Vec<(String, &'static str, i64)> {
    t.timeline()
        .iter()
        .map(|ev| (ev.phase.to_string(), ev.category.name(), ev.bytes))
        .collect()
}

#[test]
fn traffic_per_step_follows_the_zero_paper() {
    // Per rank and step, in units of the gradient size: ddp, zero1 and zero2
    // move 2(N-1)/N (all-reduce, or reduce-scatter + all-gather); zero3 3(N-1)/N
    // (all-gathers in forward and backward, reduce-scatter).
    let model = load_model("gpt2").unwrap();
    let n = 4;
    let psi: u64 = model
        .param_layout()
        .0
        .iter()
        .map(|s| s.numel() as u64)
        .sum();
    for (sharding, factor) in [
        (Sharding::Ddp, 2.0),
        (Sharding::Zero1, 2.0),
        (Sharding::Zero2, 2.0),
        (Sharding::Zero3, 3.0),
    ] {
        let tc = TrainConfig {
            seq_len: 64,
            micro_batch: 1,
            ranks: n,
            sharding,
            ..TrainConfig::default()
        };
        let mut c = meta_cluster(&model, &tc);
        // ddp's constructor broadcasts the weights; count the step alone.
        let at_start = c.ranks[0].dev.meter.sent;
        c.step_from(1, || unreachable!()).unwrap();
        let sent = (c.ranks[0].dev.meter.sent - at_start) as f64;
        let want = factor * (n - 1) as f64 / n as f64 * (4 * psi) as f64;
        eprintln!(
            "gpt2 N=4 {sharding:?}: sent {:.1} MiB per step, {:.4} x the gradient bytes",
            sent / (1 << 20) as f64,
            sent / (4 * psi) as f64
        );
        assert!(
            (sent / want - 1.0).abs() < 0.01,
            "{sharding:?}: {sent} vs {want}"
        );
    }
}
