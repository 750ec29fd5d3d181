//! ZeRO++ hierarchical weight partitioning (hpZ): zero3 whose backward
//! all-gathers run within groups of ranks, from a secondary copy of the
//! weights sharded over the group. It trains bit for bit as zero3 does,
//! meta predicts every rank byte for byte, it costs exactly the secondary
//! shards, and the planner prices the backward's gathers inside the node.

use crate::common::{
    events, json, losses, memfit, ok_json, refused, scratch, scratch_file, stderr,
};

use std::num::NonZeroUsize;

use memfit::backend::cpu::CpuBackend;
use memfit::backend::meta::MetaBackend;
use memfit::comm::Op;
use memfit::config::ModelConfig;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::cluster::Cluster;
use memfit::engine::cluster::{cpu_links, meta_links};
use memfit::engine::shard::units;
use memfit::engine::{Checkpointing, Finetune, Offload, Precision, Sharding, TrainConfig};
use memfit::memory::{Category, Phase, Tracker};
use serde_json::Value;

fn cpu_cluster(model: &ModelConfig, tc: &TrainConfig) -> Cluster<CpuBackend> {
    let backends = (0..tc.ranks).map(|_| CpuBackend::new(1).unwrap()).collect();
    Cluster::new(model, tc, backends, cpu_links(model, tc), None).unwrap()
}

fn meta_cluster(model: &ModelConfig, tc: &TrainConfig) -> Cluster<MetaBackend> {
    let backends = (0..tc.ranks)
        .map(|_| MetaBackend::emulating_cpu())
        .collect();
    Cluster::new(model, tc, backends, meta_links(model, tc), None).unwrap()
}

fn zero3(ranks: usize, hpz_group: usize) -> TrainConfig {
    TrainConfig {
        seq_len: 16,
        micro_batch: 2,
        grad_accum: 2,
        lr: Some(1e-3),
        ranks,
        sharding: Sharding::Zero3,
        hpz_group: NonZeroUsize::new(hpz_group),
        ..TrainConfig::default()
    }
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|t| t.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// Each step's loss and, after the last, every rank's weight shards (and
/// fp32 master shards under mixed precision), as bits; and how many
/// all-gathers ran in groups of `g` ranks.
type Trained = (Vec<u32>, Vec<Vec<Vec<u32>>>, Vec<Vec<Vec<u32>>>, usize);

fn train(model: &ModelConfig, tc: &TrainConfig, g: usize) -> Trained {
    let mut c = cpu_cluster(model, tc);
    for e in &mut c.ranks {
        e.dev.meter.collectives = Some(Vec::new());
    }
    let mut data = DataSource::synthetic(model.vocab_size, 11);
    let losses = (0..3)
        .map(|_| {
            let r = c
                .step_from(tc.grad_accum, || data.next_batch(2, 16))
                .unwrap();
            assert!(!r.skipped);
            r.loss.unwrap().to_bits()
        })
        .collect();
    let shards = c
        .ranks
        .iter()
        .map(|e| bits(&e.param_shards_host().unwrap()))
        .collect();
    let master = c
        .ranks
        .iter()
        .map(|e| e.master_host().map_or_else(Vec::new, |m| bits(&m)))
        .collect();
    let grouped = c.ranks[0].dev.meter.collectives.as_ref().unwrap();
    let grouped = grouped
        .iter()
        .filter(|c| c.op == Op::AllGather && c.world == g)
        .count();
    (losses, shards, master, grouped)
}

/// The backward gathers the same weights, from other ranks: every loss
/// and every weight is zero3's, bit for bit.
#[test]
fn hpz_trains_bit_for_bit_as_zero3() {
    for name in ["gpt2-tiny", "llama-tiny"] {
        let model = load_model(name).unwrap();
        for precision in [Precision::Fp32, Precision::Bf16] {
            for checkpointing in [Checkpointing::None, Checkpointing::Full] {
                let what = format!("{name} {precision:?} {checkpointing:?}");
                let tc = TrainConfig {
                    precision,
                    checkpointing,
                    ..zero3(4, 0)
                };
                let flat = train(&model, &tc, 2);
                let hpz = train(
                    &model,
                    &TrainConfig {
                        hpz_group: NonZeroUsize::new(2),
                        ..tc
                    },
                    2,
                );
                assert_eq!(flat.0, hpz.0, "{what}: losses");
                assert_eq!(flat.1, hpz.1, "{what}: weight shards");
                assert_eq!(flat.2, hpz.2, "{what}: master shards");
                // The runs did differ: zero3 gathers over all 4 ranks only;
                // hpZ's backward gathers each block in its pair, once per
                // micro-batch (the recompute reads what that gather brought).
                assert_eq!(flat.3, 0, "{what}");
                assert_eq!(hpz.3, 3 * 2 * model.n_layer, "{what}");
            }
        }
    }
}

#[test]
fn meta_predicts_every_hpz_rank() {
    let bf16 = Precision::Bf16;
    let full = Checkpointing::Full;
    let cases = [
        (
            "gpt2-tiny",
            TrainConfig {
                precision: bf16,
                checkpointing: full,
                ..zero3(4, 2)
            },
        ),
        ("llama-tiny", zero3(4, 2)),
        (
            "llama-tiny",
            TrainConfig {
                precision: bf16,
                ..zero3(8, 4)
            },
        ),
        (
            "gpt2-tiny",
            TrainConfig {
                precision: Precision::Fp16,
                checkpointing: full,
                ..zero3(8, 2)
            },
        ),
        (
            "llama-tiny",
            TrainConfig {
                precision: bf16,
                offload: Offload::Optimizer,
                ..zero3(4, 2)
            },
        ),
        // LoRA adapters train over the gathered (frozen) base.
        (
            "llama-tiny",
            TrainConfig {
                finetune: Finetune::Lora,
                checkpointing: full,
                ..zero3(4, 2)
            },
        ),
        // Tensor-parallel pairs, hpZ over pairs of their replicas.
        (
            "llama-tiny",
            TrainConfig {
                tensor_parallel: 2,
                ..zero3(8, 2)
            },
        ),
    ];
    for (name, tc) in cases {
        let model = load_model(name).unwrap();
        let what = format!(
            "{name} N={} G={} TP={} {:?} {:?} {:?} {:?}",
            tc.ranks,
            memfit::config::knobs::group::spelled(tc.hpz_group),
            tc.tensor_parallel,
            tc.precision,
            tc.checkpointing,
            tc.offload,
            tc.finetune
        );
        let mut cpu = cpu_cluster(&model, &tc);
        let mut meta = meta_cluster(&model, &tc);
        let mut data = DataSource::synthetic(model.vocab_size, 5);
        for _ in 0..2 {
            let r = cpu.step_from(2, || data.next_batch(2, 16)).unwrap();
            assert!(r.loss.unwrap().is_finite(), "{what}");
            meta.step_from(2, || unreachable!()).unwrap();
        }
        for (r, (c, m)) in cpu.ranks.iter().zip(&meta.ranks).enumerate() {
            let (ct, mt) = (&c.dev.tracker, &m.dev.tracker);
            assert_eq!(ct.peak_bytes(), mt.peak_bytes(), "{what}: rank {r}");
            assert_eq!(ct.at_peak(), mt.at_peak(), "{what}: rank {r}");
            assert_eq!(ct.live(), mt.live(), "{what}: rank {r}");
            assert_eq!(events(ct), events(mt), "{what}: rank {r}");
            assert_eq!(
                (c.dev.meter.sent, c.dev.meter.received),
                (m.dev.meter.sent, m.dev.meter.received)
            );
            let host = |t: Option<&Tracker>| t.map(Tracker::peak_bytes);
            assert_eq!(host(c.dev.host.as_ref()), host(m.dev.host.as_ref()));
        }
        for (i, dev) in cpu.release().into_iter().enumerate() {
            assert_eq!(dev.tracker.live().total(), 0, "{what}: rank {i} leaked");
        }
    }
}

/// Parameters live at the end of each stretch of one phase in a rank's
/// timeline: (phase, bytes).
fn params_by_phase(t: &Tracker) -> Vec<(Phase, i64)> {
    let mut out: Vec<(Phase, i64)> = Vec::new();
    let mut live = 0i64;
    for e in t.timeline() {
        if e.category == Category::Parameters {
            live += e.bytes;
        }
        match out.last_mut() {
            Some((p, b)) if *p == e.phase => *b = live,
            _ => out.push((e.phase, live)),
        }
    }
    out
}

/// Each rank holds zero3's bytes plus its secondary shards: unit u's is
/// `sum over its tensors of ceil(n/N) * N/G` elements in the working
/// dtype, written when the unit is first released in a step (the
/// embedding's and each block's after their forward, the head's after its
/// backward) and held through the update, as DeepSpeed holds
/// `ds_secondary_tensor` until `_post_step`.
#[test]
fn hpz_costs_exactly_the_secondary_shards() {
    for (name, ranks, g, precision) in [
        ("gpt2-tiny", 4, 2, Precision::Bf16),
        ("llama-tiny", 8, 2, Precision::Fp32),
        ("llama-tiny", 8, 4, Precision::Bf16),
    ] {
        let model = load_model(name).unwrap();
        let tc = TrainConfig {
            precision,
            checkpointing: Checkpointing::Full,
            ..zero3(ranks, 0)
        };
        let (specs, idx) = model.param_layout();
        let unit_bytes: Vec<i64> = units(&idx)
            .iter()
            .map(|u| {
                u.iter()
                    .map(|&i| specs[i].numel().div_ceil(ranks) * (ranks / g))
                    .sum::<usize>() as i64
                    * precision.dtype().size() as i64
            })
            .collect();
        let all: i64 = unit_bytes.iter().sum();
        let head = unit_bytes.len() - 1;
        let what = format!("{name} N={ranks} G={g} {precision:?}");
        let mut flat = meta_cluster(&model, &tc);
        let mut hpz = meta_cluster(
            &model,
            &TrainConfig {
                hpz_group: NonZeroUsize::new(g),
                ..tc
            },
        );
        for _ in 0..2 {
            flat.step_from(2, || unreachable!()).unwrap();
            hpz.step_from(2, || unreachable!()).unwrap();
        }
        for (r, (f, h)) in flat.ranks.iter().zip(&hpz.ranks).enumerate() {
            let (ft, ht) = (&f.dev.tracker, &h.dev.tracker);
            let (fp, hp) = (params_by_phase(ft), params_by_phase(ht));
            assert_eq!(fp.len(), hp.len(), "{what}: rank {r}");
            let mut held = vec![false; unit_bytes.len()];
            let mut forwards = 0;
            for ((phase, zb), (hphase, hb)) in fp.iter().zip(&hp) {
                assert_eq!(phase, hphase, "{what}: rank {r}");
                match *phase {
                    Phase::ForwardEmbed => {
                        // A step's first micro-batch (of 2) writes them
                        // anew: the update made the last step's stale.
                        if forwards % 2 == 0 {
                            held.fill(false);
                        }
                        forwards += 1;
                        held[0] = true;
                    }
                    Phase::Forward(l) => held[1 + l] = true,
                    Phase::BackwardHead => held[head] = true,
                    _ => {}
                }
                let want: i64 = (0..held.len())
                    .filter(|&u| held[u])
                    .map(|u| unit_bytes[u])
                    .sum();
                assert_eq!(hb - zb, want, "{what}: rank {r} at {phase}");
            }
            // The update ran with every unit's secondary shard held, and
            // they are still held after it ...
            assert_eq!(
                ht.live().total() - ft.live().total(),
                all as u64,
                "{what}: rank {r}"
            );
            // ... until the next step frees them, before it allocates
            // anything.
            let starts: Vec<usize> = (1..ht.timeline().len())
                .filter(|&i| {
                    let (a, b) = (&ht.timeline()[i - 1], &ht.timeline()[i]);
                    a.phase == Phase::BackwardEmbed && b.phase == Phase::ForwardEmbed
                })
                .collect();
            let second_step = ht.timeline()[starts[1]..]
                .iter()
                .take(unit_bytes.len())
                .map(|e| (e.category, -e.bytes))
                .collect::<Vec<_>>();
            let freed: Vec<_> = unit_bytes
                .iter()
                .map(|&b| (Category::Parameters, b))
                .collect();
            assert_eq!(second_step, freed, "{what}: rank {r}");
            let peak = |t: &Tracker| t.peak_bytes().total as i64;
            let extra = peak(ht) - peak(ft);
            assert!(
                extra > 0 && extra <= all,
                "{what}: rank {r}: {extra} of {all}"
            );
        }
    }
}

/// zero3 gathers every unit over all N ranks in the forward and again in
/// the backward; under hpZ the backward's gathers run in groups of G
/// consecutive ranks (stride 1, one node), over the same bytes, and the
/// gradients are still reduce-scattered over all N.
#[test]
fn hpz_backward_gathers_run_within_the_group() {
    let model = load_model("llama-tiny").unwrap();
    let (n, g, k) = (8, 4, 3);
    for checkpointing in [Checkpointing::None, Checkpointing::Full] {
        let tc = TrainConfig {
            grad_accum: k,
            checkpointing,
            ..zero3(n, 0)
        };
        let calls = |tc: &TrainConfig| {
            let mut m = meta_cluster(&model, tc);
            for e in &mut m.ranks {
                e.dev.meter.collectives = Some(Vec::new());
            }
            m.step_from(k, || unreachable!()).unwrap();
            m.ranks[0].dev.meter.collectives.take().unwrap()
        };
        let flat = calls(&tc);
        let hpz = calls(&TrainConfig {
            hpz_group: NonZeroUsize::new(g),
            ..tc
        });
        let gathers = |c: &[memfit::engine::device::Call], world: usize| {
            let mut b: Vec<(u64, usize)> = c
                .iter()
                .filter(|c| c.op == Op::AllGather && c.world == world)
                .map(|c| (c.bytes, c.stride))
                .collect();
            b.sort();
            b
        };
        let layers = model.n_layer;
        let grouped = gathers(&hpz, g);
        assert_eq!(grouped.len(), k * layers, "{checkpointing:?}");
        assert!(grouped.iter().all(|&(_, s)| s == 1), "{grouped:?}");
        // The gathers that left the full group are the backward's: the
        // same buffers, now gathered by G ranks.
        let (all_flat, all_hpz) = (gathers(&flat, n), gathers(&hpz, n));
        assert_eq!(all_flat.len(), all_hpz.len() + k * layers);
        let mut moved = all_hpz.clone();
        moved.extend(&grouped);
        moved.sort();
        assert_eq!(moved, all_flat, "{checkpointing:?}");
        let scatters = |c: &[memfit::engine::device::Call]| {
            c.iter()
                .filter(|c| c.op == Op::ReduceScatter)
                .map(|c| (c.bytes, c.world))
                .collect::<Vec<_>>()
        };
        assert_eq!(scatters(&flat), scatters(&hpz));
        assert!(scatters(&hpz).iter().all(|&(_, w)| w == n));
    }
    // With tensor parallelism (groups of 2) the group's ranks are a
    // tensor-parallel group apart, as every data-parallel group's are.
    let tc = TrainConfig {
        grad_accum: 1,
        tensor_parallel: 2,
        ..zero3(16, 4)
    };
    let mut m = meta_cluster(&model, &tc);
    for e in &mut m.ranks {
        e.dev.meter.collectives = Some(Vec::new());
    }
    m.step_from(1, || unreachable!()).unwrap();
    let calls = m.ranks[0].dev.meter.collectives.take().unwrap();
    let grouped: Vec<_> = calls
        .iter()
        .filter(|c| c.op == Op::AllGather && c.world == 4)
        .collect();
    assert_eq!(grouped.len(), model.n_layer);
    assert!(grouped.iter().all(|c| c.stride == 2), "{grouped:?}");
}

fn run(extra: &[&str]) -> Value {
    ok_json(
        &[
            "run",
            "--model",
            "llama-tiny",
            "--ranks",
            "4",
            "--sharding",
            "zero3",
            "--micro-batch",
            "2",
            "--steps",
            "3",
            "--format",
            "json",
        ],
        extra,
    )
}

#[test]
fn the_cli_runs_hpz_and_meta_predicts_it() {
    let flat = run(&[]);
    let hpz = run(&["--hpz-group", "2"]);
    assert_eq!(losses(&flat), losses(&hpz));
    assert_eq!(hpz["config"]["hpz_group"], 2);
    let p = |r: &Value| r["peak_bytes"]["parameters"].as_u64().unwrap();
    assert!(p(&hpz) > p(&flat));
    let meta = run(&["--hpz-group", "2", "--device", "meta"]);
    for (c, m) in hpz["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .zip(meta["ranks"].as_array().unwrap())
    {
        assert_eq!(c["peak_bytes"], m["peak_bytes"]);
        assert_eq!(c["sent_bytes_per_step"], m["sent_bytes_per_step"]);
    }
    // The recipe key is the flag's.
    let recipe = scratch_file("hpz-recipe", "r.yaml", "hpz_group: 2\n");
    let from_recipe = run(&["--recipe", recipe.to_str().unwrap()]);
    assert_eq!(from_recipe["peak_bytes"], hpz["peak_bytes"]);
    std::fs::write(&recipe, "hpz_group: 3\n").unwrap();
    let err = refused(
        &[
            "run",
            "--recipe",
            recipe.to_str().unwrap(),
            "--model",
            "llama-tiny",
            "--ranks",
            "4",
            "--sharding",
            "zero3",
        ],
        "hpz_group",
    );
    assert!(err.contains("must divide"), "{err}");
}

#[test]
fn hpz_is_refused_where_it_cannot_run() {
    let base = [
        "run",
        "--model",
        "llama-tiny",
        "--ranks",
        "4",
        "--steps",
        "1",
    ];
    let with = |extra: &[&'static str]| [&base[..], extra].concat();
    for (extra, needle) in [
        (&["--sharding", "zero2", "--hpz-group", "2"][..], "zero3"),
        (&["--sharding", "zero3", "--hpz-group", "3"], "must divide"),
        (
            &["--sharding", "zero3", "--hpz-group", "4"],
            "two or more groups",
        ),
        (
            &["--sharding", "zero3", "--hpz-group", "1"],
            "two or more groups",
        ),
        (
            &[
                "--sharding",
                "zero3",
                "--hpz-group",
                "2",
                "--shard-group",
                "2",
            ],
            "--shard-group",
        ),
        (
            &[
                "--sharding",
                "zero3",
                "--hpz-group",
                "2",
                "--offload",
                "optimizer+params",
            ],
            "host memory",
        ),
    ] {
        let err = refused(&with(extra), needle);
        assert!(err.contains("--hpz-group"), "{extra:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "one paragraph: {err}");
    }
    let err = refused(
        &[
            "run",
            "--model",
            "llama-tiny",
            "--ranks",
            "8",
            "--pipeline-stages",
            "2",
            "--sharding",
            "zero3",
            "--hpz-group",
            "2",
            "--steps",
            "1",
        ],
        "pipeline",
    );
    assert!(err.contains("--hpz-group"), "{err}");
}

/// Llama-3.1-8B on 32 H100s (four nodes of eight) over 25 Gb/s Ethernet:
/// hpZ's backward gathers stay on NVLink, so a step spends far less on
/// the network, for 1/8 of the bf16 weights (2 GB) more per GPU.
#[test]
fn on_a_slow_network_hpz_trades_memory_for_traffic_across_nodes() {
    let path = scratch("hpz-plan").join("p.yaml");
    std::fs::write(
        &path,
        "model: llama-3.1-8b\nhardware: h100-sxm-80gb\nseq_len: 2048\nglobal_batch: 64\nnetwork: eth-25\ngrid:\n  framework: [memfit]\n  checkpointing: [full]\n  sharding: [zero3]\n  gpus: [32]\n  hpz_group: [0, 8, 3]\n",
    )
    .unwrap();
    let out = memfit(&["plan", path.to_str().unwrap(), "--format", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let p = json(&out);
    let pts = p["points"].as_array().unwrap();
    let (flat, hpz, odd) = (&pts[0], &pts[1], &pts[2]);
    assert_eq!(flat["point"]["hpz_group"], 0);
    assert_eq!(hpz["point"]["hpz_group"], 8);
    assert_eq!(odd["status"], "invalid", "{odd}");
    assert!(odd["reason"].as_str().unwrap().contains("must divide"));
    let f = |x: &Value, k: &str| x[k].as_f64().unwrap();
    let pk = |x: &Value, k: &str| x["peak_bytes"][k].as_f64().unwrap();
    eprintln!(
        "flat: comm {:.3} s, step {:.3} s, peak {:.3} GB; hpz8: comm {:.3} s, step {:.3} s, peak {:.3} GB",
        f(flat, "comm_s"),
        f(flat, "step_s"),
        pk(flat, "total") / 1e9,
        f(hpz, "comm_s"),
        f(hpz, "step_s"),
        pk(hpz, "total") / 1e9
    );
    // Of the three collectives per unit, the backward's gather leaves the
    // network.
    assert!(f(hpz, "comm_s") < 0.8 * f(flat, "comm_s"));
    assert!(f(hpz, "step_s") < f(flat, "step_s"));
    assert_eq!(hpz["links"], "intra_inter");
    // At most 1/8 of the 16-bit weights (the exact count is
    // hpz_costs_exactly_the_secondary_shards'): at the parameters' peak,
    // the head's backward, every unit's secondary shard but the head's
    // own (1/16 of Llama-3.1-8B) is held.
    let secondary = 2.0 * p["num_parameters"].as_f64().unwrap() / 8.0;
    let extra = pk(hpz, "parameters") - pk(flat, "parameters");
    assert!(
        extra > 0.9 * secondary && extra <= 1.001 * secondary,
        "{extra} vs {secondary}"
    );
    assert!(f(hpz, "total_bytes") > f(flat, "total_bytes"));
    // The table tells the two apart.
    let out = memfit(&["plan", path.to_str().unwrap()]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains(" zero3+hpz8 "), "{table}");
}
