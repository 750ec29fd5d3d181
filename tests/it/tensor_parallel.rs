//! Tensor parallelism (Megatron-LM's split of attention heads and MLP
//! width): a group of ranks trains as one rank does, alone and combined with
//! data parallelism, ZeRO and pipelines; meta predicts every rank byte for
//! byte; memory and traffic follow the split.

use crate::common::training::{tolerance, train_single};
use crate::common::{json, losses, memfit, ok_json, refused, scratch, scratch_file, stderr};

use memfit::backend::Backend;
use memfit::backend::cpu::CpuBackend;
use memfit::backend::meta::MetaBackend;
use memfit::comm::Op;
use memfit::config::ModelConfig;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::cluster::Cluster;
use memfit::engine::cluster::{cpu_links, meta_links};
use memfit::engine::{Checkpointing, Loss, Optimizer, Precision, Sharding, TrainConfig};
use memfit::memory::Category;

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

/// One tensor-parallel rank's tensors after training (its slices), from
/// the data-parallel group at position `t` of stage 0: zero3's shards
/// assembled, or the copy every replica holds (which must agree).
fn position_params<B: Backend>(c: &Cluster<B>, t: usize) -> Vec<Vec<f32>> {
    let tc = &c.ranks[0].train;
    let group: Vec<usize> = (0..tc.ranks)
        .filter(|&r| tc.place(r) == (0, tc.place(r).1, t))
        .collect();
    let e0 = &c.ranks[group[0]];
    if tc.sharding == Sharding::Zero3 {
        let shards: Vec<_> = group
            .iter()
            .map(|&r| c.ranks[r].param_shards_host().unwrap())
            .collect();
        return (0..shards[0].len())
            .map(|i| {
                let mut full = Vec::new();
                for (d, sh) in shards.iter().enumerate() {
                    let (_, own) = e0.shard_extent(i, d).unwrap();
                    full.extend_from_slice(&sh[i][..own]);
                }
                full
            })
            .collect();
    }
    let p0 = e0.params_host().unwrap();
    for &r in &group[1..] {
        assert_eq!(c.ranks[r].params_host().unwrap(), p0, "replicas disagree");
    }
    p0
}

/// The whole model's weights: each split tensor put together from every
/// position's slice; a replicated one must be the same at every position.
fn full_params<B: Backend>(c: &Cluster<B>, want: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let tps = c.ranks[0].train.tensor_parallel;
    let parts: Vec<Vec<Vec<f32>>> = (0..tps).map(|t| position_params(c, t)).collect();
    (0..want.len())
        .map(|i| match c.ranks[0].tp_split(i) {
            None => {
                for (t, p) in parts.iter().enumerate().skip(1) {
                    assert_eq!(p[i], parts[0][i], "replicated tensor {i} differs at {t}");
                }
                parts[0][i].clone()
            }
            Some(_) => {
                let mut full = vec![f32::NAN; want[i].len()];
                for (t, p) in parts.iter().enumerate() {
                    let split = c.ranks[t].tp_split(i).expect("split on every rank");
                    split.put(&mut full, &p[i]);
                }
                assert!(full.iter().all(|x| x.is_finite()), "tensor {i} tiled");
                full
            }
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

#[test]
fn a_tensor_parallel_group_trains_as_one_rank() {
    for name in ["gpt2-tiny", "llama-tiny"] {
        let model = load_model(name).unwrap();
        for (precision, optimizer) in [
            (Precision::Fp32, Optimizer::Sgd),
            (Precision::Fp32, Optimizer::Adamw),
            (Precision::Bf16, Optimizer::Adamw),
        ] {
            for (ranks, sharding, sequence_parallel) in [
                (2, Sharding::None, false),
                (2, Sharding::None, true),
                (4, Sharding::Ddp, false),
                (4, Sharding::Zero1, true),
                (4, Sharding::Zero2, false),
                (4, Sharding::Zero2, true),
                (4, Sharding::Zero3, false),
                (4, Sharding::Zero3, true),
            ] {
                let tc = TrainConfig {
                    sequence_parallel,
                    seq_len: 16,
                    micro_batch: 2,
                    grad_accum: 2,
                    lr: Some(1e-3),
                    precision,
                    optimizer,
                    ranks,
                    sharding,
                    tensor_parallel: 2,
                    ..TrainConfig::default()
                };
                let (want, want_losses) = train_single(&model, &tc, 3);
                let mut c = cpu_cluster(&model, &tc);
                let mut data = DataSource::synthetic(model.vocab_size, 11);
                for want_loss in want_losses {
                    let r = c
                        .step_from(tc.grad_accum, || data.next_batch(2, 16))
                        .unwrap();
                    assert!(!r.skipped);
                    let loss = r.loss.unwrap();
                    assert!(
                        (loss - want_loss).abs() < 1e-3 * want_loss.abs(),
                        "{name} {precision:?} {sharding:?}: loss {loss} vs {want_loss}"
                    );
                }
                let got = full_params(&c, &want);
                let d = max_diff(&got, &want);
                eprintln!(
                    "{name} {precision:?} {optimizer:?} TP=2 (SP {sequence_parallel}) x {sharding:?}: max |diff| {d:e}"
                );
                // SGD is linear in the gradient, so its drift is the
                // gradients' rounding (we see 3.7e-9). AdamW divides by
                // sqrt(v): a weight whose gradient is near zero moves by
                // about lr whichever way rounding tips it, and splitting
                // every GEMM's sum changes more roundings than data
                // parallelism does (we see up to 1.6e-5 with the gemm
                // crate's AVX-512 kernels and 3.2e-5 with its AVX2 ones,
                // whose sums split differently: 3% of one step of lr 1e-3).
                let tol = match (precision, optimizer) {
                    (Precision::Fp32, Optimizer::Sgd) => 1e-7,
                    (Precision::Fp32, _) => 1e-4,
                    _ => tolerance(precision),
                };
                assert!(d <= tol, "{name} {precision:?} {sharding:?}: {d}");
            }
        }
    }
}

/// A vocabulary of 90 padded to 128 over 4 ranks: the last rank's rows are
/// all padding, the third's partly; the group still trains as one rank.
#[test]
fn vocabulary_parts_of_padding_train_as_one_rank() {
    let model = ModelConfig {
        vocab_size: 90,
        pad_vocab_to: 128,
        n_kv_head: Some(4),
        ..load_model("llama-tiny").unwrap()
    };
    for optimizer in [Optimizer::Sgd, Optimizer::Adamw] {
        let tc = TrainConfig {
            seq_len: 16,
            micro_batch: 2,
            grad_accum: 2,
            lr: Some(1e-3),
            optimizer,
            ranks: 4,
            tensor_parallel: 4,
            ..TrainConfig::default()
        };
        let (want, want_losses) = train_single(&model, &tc, 3);
        let mut c = cpu_cluster(&model, &tc);
        let mut data = DataSource::synthetic(model.vocab_size, 11);
        for want_loss in want_losses {
            let r = c
                .step_from(tc.grad_accum, || data.next_batch(2, 16))
                .unwrap();
            assert!((r.loss.unwrap() - want_loss).abs() < 1e-5, "{optimizer:?}");
        }
        let d = max_diff(&full_params(&c, &want), &want);
        eprintln!("vocab 90/128 over 4, {optimizer:?}: max |diff| {d:e}");
        assert!(
            d <= if optimizer == Optimizer::Sgd {
                1e-7
            } else {
                3e-5
            }
        );
    }
}

#[test]
fn meta_predicts_every_tensor_parallel_rank() {
    for name in ["gpt2-tiny", "llama-tiny"] {
        let model = load_model(name).unwrap();
        for ((ranks, stages, sharding, precision, checkpointing), sequence_parallel) in [
            (2, 1, Sharding::None, Precision::Fp32, Checkpointing::None),
            (4, 1, Sharding::Zero3, Precision::Bf16, Checkpointing::Full),
            (4, 1, Sharding::Ddp, Precision::Fp16, Checkpointing::None),
            (4, 2, Sharding::None, Precision::Bf16, Checkpointing::Full),
            (8, 2, Sharding::Zero1, Precision::Fp32, Checkpointing::None),
        ]
        .into_iter()
        .flat_map(|c| [(c, false), (c, true)])
        {
            let tc = TrainConfig {
                sequence_parallel,
                seq_len: 16,
                micro_batch: 2,
                grad_accum: 2,
                precision,
                checkpointing,
                ranks,
                sharding,
                pipeline_stages: stages,
                tensor_parallel: 2,
                ..TrainConfig::default()
            };
            let what = format!(
                "{name} N={ranks} S={stages} {sharding:?} {precision:?} SP {sequence_parallel}"
            );
            let mut cpu = cpu_cluster(&model, &tc);
            let mut meta = meta_cluster(&model, &tc);
            let mut data = DataSource::synthetic(model.vocab_size, 5);
            for _ in 0..2 {
                let r = cpu.step_from(2, || data.next_batch(2, 16)).unwrap();
                assert!(r.loss.unwrap().is_finite(), "{what}");
                meta.step_from(2, || unreachable!()).unwrap();
            }
            for (c, m) in cpu.ranks.iter().zip(&meta.ranks) {
                assert_eq!(
                    c.dev.tracker.peak_bytes(),
                    m.dev.tracker.peak_bytes(),
                    "{what}"
                );
                assert_eq!(c.dev.tracker.live(), m.dev.tracker.live(), "{what}");
                assert_eq!(
                    (c.dev.meter.sent, c.dev.meter.received),
                    (m.dev.meter.sent, m.dev.meter.received)
                );
            }
            for (i, dev) in cpu.release().into_iter().enumerate() {
                assert_eq!(dev.tracker.live().total(), 0, "{what}: rank {i} leaked");
            }
        }
    }
}

/// Megatron's unfused loss over each rank's vocabulary columns: the group
/// trains as it does with the full loss, each rank holds its columns' fp32
/// copy, and meta predicts every rank.
#[test]
fn megatrons_unfused_loss_trains_each_ranks_vocabulary_columns() {
    let model = load_model("llama-tiny").unwrap();
    for (ranks, sharding, sequence_parallel) in
        [(2, Sharding::None, false), (4, Sharding::Zero1, true)]
    {
        let tc = |loss| TrainConfig {
            sequence_parallel,
            seq_len: 16,
            micro_batch: 2,
            grad_accum: 2,
            precision: Precision::Bf16,
            ranks,
            sharding,
            tensor_parallel: 2,
            loss,
            ..TrainConfig::default()
        };
        let what = format!("N={ranks} {sharding:?} SP {sequence_parallel}");
        let (mut full, mut cpu) = (
            cpu_cluster(&model, &tc(Loss::Full)),
            cpu_cluster(&model, &tc(Loss::MegatronUnfused)),
        );
        let mut meta = meta_cluster(&model, &tc(Loss::MegatronUnfused));
        let (mut a, mut b) = (
            DataSource::synthetic(model.vocab_size, 5),
            DataSource::synthetic(model.vocab_size, 5),
        );
        for _ in 0..2 {
            let want = full
                .step_from(2, || a.next_batch(2, 16))
                .unwrap()
                .loss
                .unwrap();
            let got = cpu
                .step_from(2, || b.next_batch(2, 16))
                .unwrap()
                .loss
                .unwrap();
            assert!(
                (got - want).abs() < 1e-4 * want.abs(),
                "{what}: {got} vs {want}"
            );
            meta.step_from(2, || unreachable!()).unwrap();
        }
        // Each rank's copy: its 2 x 16 tokens by half the padded vocabulary, fp32.
        let copy = 2 * 16 * (model.padded_vocab() / 2) as u64 * 4;
        for ((c, m), f) in cpu.ranks.iter().zip(&meta.ranks).zip(&full.ranks) {
            let (cp, mp) = (c.dev.tracker.peak_bytes(), m.dev.tracker.peak_bytes());
            assert_eq!(cp, mp, "{what}");
            let more = cp.total - f.dev.tracker.peak_bytes().total;
            assert!(
                more <= copy,
                "{what}: {more} more than the full loss, copy {copy}"
            );
            let copies = crate::common::events(&c.dev.tracker)
                .iter()
                .filter(|(cat, bytes, _)| *cat == Category::Activations && *bytes == copy as i64)
                .count();
            assert_eq!(
                copies, 4,
                "{what}: one copy a micro-batch, two steps of two"
            );
            // Each micro-batch: the copy and the cast back, and the passes
            // the engine's three vocabulary-parallel kernels fuse (17
            // forward, 6 backward).
            let (cc, fc) = (&c.dev.meter.cost, &f.dev.meter.cost);
            assert_eq!(cc.calls() - fc.calls(), 4 * (2 + 17 + 6), "{what}");
        }
    }
}

/// Each rank keeps 1/T of every block projection and of the embedding and
/// head's vocabulary rows, and the whole of the rest. Every block
/// all-reduces one N x C activation after attention and one after the MLP
/// in the forward, and the two norm-input gradients in the backward (the
/// recomputed forward adds the attention's again). Per micro-batch the
/// vocabulary-parallel embedding all-reduces its output, the loss gathers
/// each token's (max, sum of exponentials) and all-reduces the target's
/// logit, and the head all-reduces its input's gradient.
#[test]
fn weights_split_and_activations_all_reduce_as_megatron() {
    // llama-tiny with as many key/value heads as query heads (4), so that
    // it splits four ways too.
    let model = ModelConfig {
        n_kv_head: Some(4),
        ..load_model("llama-tiny").unwrap()
    };
    let (specs, idx) = model.param_layout();
    let split: usize = idx
        .blocks
        .iter()
        .flat_map(|b| b.projections())
        .chain(std::iter::once(idx.wte).chain(idx.lm_head))
        .map(|i| specs[i].numel())
        .sum();
    let all: usize = specs.iter().map(|s| s.numel()).sum();
    let (n, c) = (2 * 16, model.d_model);
    for (tps, checkpointing, per_block) in [
        (2, Checkpointing::None, 4),
        (4, Checkpointing::None, 4),
        (2, Checkpointing::Full, 5),
    ] {
        let tc = TrainConfig {
            seq_len: 16,
            micro_batch: 2,
            grad_accum: 3,
            ranks: tps,
            checkpointing,
            tensor_parallel: tps,
            ..TrainConfig::default()
        };
        let mut meta = meta_cluster(&model, &tc);
        for e in &mut meta.ranks {
            e.dev.meter.collectives = Some(Vec::new());
        }
        meta.step_from(3, || unreachable!()).unwrap();
        for e in &meta.ranks {
            let params = e.dev.tracker.peak_bytes().parameters;
            assert_eq!(
                params as usize,
                4 * (all - split + split / tps),
                "TP={tps}: fp32 weights"
            );
            let calls = e.dev.meter.collectives.as_ref().unwrap();
            for call in calls {
                assert_eq!((call.world, call.stride), (tps, 1));
            }
            let count = |op: Op, bytes: usize| {
                calls
                    .iter()
                    .filter(|x| x.op == op && x.bytes == bytes as u64)
                    .count()
            };
            let what = format!("TP={tps} {checkpointing:?}: a step of 3 micro-batches");
            // Blocks, the embedding's output and the head input's gradient.
            let activations = (per_block * model.n_layer + 2) * 3;
            assert_eq!(count(Op::AllReduce, 4 * n * c), activations, "{what}");
            assert_eq!(count(Op::AllReduce, 4 * n), 3, "{what}: target logits");
            assert_eq!(
                count(Op::AllGather, 4 * 2 * n * tps),
                3,
                "{what}: statistics"
            );
            assert_eq!(calls.len(), activations + 6, "{what}: nothing else");
        }
    }
}

#[test]
fn the_cli_runs_tensor_parallel_groups_and_refuses_what_cannot_split() {
    let base = [
        "run",
        "--model",
        "gpt2-tiny",
        "--steps",
        "3",
        "--micro-batch",
        "2",
        "--seq-len",
        "32",
        "--format",
        "json",
    ];
    let one = ok_json(&base, &[]);
    let tp = ok_json(&base, &["--tensor-parallel", "2"]);
    assert_eq!(
        tp["ranks"].as_array().unwrap().len(),
        2,
        "--ranks defaults to the group"
    );
    for (a, b) in losses(&one).iter().zip(losses(&tp)) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }
    let meta = ok_json(&base, &["--tensor-parallel", "2", "--device", "meta"]);
    for (c, m) in tp["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .zip(meta["ranks"].as_array().unwrap())
    {
        assert_eq!(c["peak_bytes"], m["peak_bytes"]);
        assert_eq!(c["sent_bytes_per_step"], m["sent_bytes_per_step"]);
    }
    let r = ["run", "--model", "llama-tiny", "--steps", "1"];
    let with = |extra: &[&'static str]| [&r[..], extra].concat();
    refused(&with(&["--tensor-parallel", "4"]), "n_kv_head");
    refused(&with(&["--tensor-parallel", "0"]), "--tensor-parallel");
    refused(&with(&["--sequence-parallel"]), "add --tensor-parallel");
    refused(
        &with(&[
            "--tensor-parallel",
            "2",
            "--sequence-parallel",
            "--micro-batch",
            "1",
            "--seq-len",
            "7",
        ]),
        "do not split evenly",
    );
    refused(
        &with(&["--tensor-parallel", "2", "--ranks", "3"]),
        "tensor-parallel groups of 2",
    );
    refused(
        &with(&["--tensor-parallel", "2", "--finetune", "lora"]),
        "LoRA",
    );
    refused(
        &with(&["--tensor-parallel", "2", "--framework", "hf-eager"]),
        "Megatron",
    );
}

fn plan(name: &str, recipe: &str) -> serde_json::Value {
    let path = scratch(name).join("p.yaml");
    std::fs::write(&path, recipe).unwrap();
    let out = memfit(&["plan", path.to_str().unwrap(), "--format", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    json(&out)
}

/// The planner's tensor-parallel points are the engine's: the per-GPU peak
/// is what `memfit run --device meta` shows for the same layout, with
/// pipelines and data parallelism around the group.
#[test]
fn the_plan_puts_tensor_parallel_ranks_where_run_does() {
    let p = plan(
        "tp-plan-tiny",
        "model: llama-tiny\nhardware: h100-sxm-80gb\nseq_len: 64\nglobal_batch: 8\ndevice: cpu\ngrid:\n  framework: [memfit]\n  precision: [bf16]\n  attention: [eager]\n  sharding: [zero1]\n  gpus: [8]\n  tensor_parallel: [1, 2]\n  pipeline_stages: [1, 2]\n  sequence_parallel: [false, true]\n",
    );
    let pts = p["points"].as_array().unwrap();
    assert_eq!(pts.len(), 8);
    for x in pts {
        let sp = x["point"]["sequence_parallel"] == true;
        if sp && x["point"]["tensor_parallel"] == 1 {
            assert_eq!(x["status"], "invalid", "{x}");
            continue;
        }
        assert_eq!(x["status"], "fits", "{x}");
        let (s, t) = (
            x["point"]["pipeline_stages"].to_string(),
            x["point"]["tensor_parallel"].to_string(),
        );
        let accum = x["point"]["grad_accum"].as_u64().unwrap().to_string();
        let run = ok_json(
            &[
                "run",
                "--model",
                "llama-tiny",
                "--device",
                "meta",
                "--seq-len",
                "64",
                "--micro-batch",
                "1",
                "--precision",
                "bf16",
                "--ranks",
                "8",
                "--sharding",
                "zero1",
                "--format",
                "json",
            ],
            &[
                "--pipeline-stages",
                &s,
                "--tensor-parallel",
                &t,
                "--grad-accum",
                &accum,
                if sp {
                    "--sequence-parallel"
                } else {
                    "--seed=1337"
                },
            ],
        );
        assert_eq!(
            x["peak_bytes"]["total"], run["peak_bytes"]["total"],
            "pp{s} tp{t} sp {sp}"
        );
    }
    // One replica fewer per doubling of the group: twice the micro-batches.
    let accum = |t: u64| {
        pts.iter()
            .find(|x| {
                x["point"]["tensor_parallel"] == t
                    && x["point"]["pipeline_stages"] == 1
                    && x["point"]["sequence_parallel"] == false
            })
            .unwrap()["point"]["grad_accum"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(accum(2), 2 * accum(1));
}

/// Llama-3.1-70B on 32 H100s with Megatron's distributed optimizer (zero1):
/// no layout fits without splitting the model; tensor parallelism within a
/// node, with pipeline stages, does, and its all-reduces stay on NVLink.
/// On nodes of 4 GPUs the same 8-wide group crosses the network.
#[test]
fn planning_llama_70b_takes_a_tensor_and_pipeline_parallel_layout() {
    let recipe = |hw: &str| {
        format!(
            "model: llama-3.1-70b\nhardware: {hw}\nseq_len: 4096\nglobal_batch: 64\ngrid:\n  framework: [memfit]\n  checkpointing: [full]\n  sharding: [zero1]\n  gpus: [32]\n  tensor_parallel: [1, 4, 8]\n  pipeline_stages: [1, 2]\n"
        )
    };
    let p = plan("tp-plan-70b", &recipe("h100-sxm-80gb"));
    let pts = p["points"].as_array().unwrap();
    let at = |pts: &[serde_json::Value], t: u64, s: u64| {
        pts.iter()
            .find(|x| x["point"]["tensor_parallel"] == t && x["point"]["pipeline_stages"] == s)
            .unwrap()
            .clone()
    };
    assert_eq!(at(pts, 1, 1)["status"], "does_not_fit");
    let rec = &pts[p["recommendation"]["index"].as_u64().unwrap() as usize]["point"];
    assert!(rec["tensor_parallel"].as_u64().unwrap() > 1, "{rec}");
    // Per-GPU weights shrink with the group.
    let params = |x: &serde_json::Value| x["peak_bytes"]["parameters"].as_f64().unwrap();
    assert!(params(&at(pts, 8, 1)) < params(&at(pts, 4, 1)));
    assert!(params(&at(pts, 4, 1)) < params(&at(pts, 1, 1)));
    // The same H100s four to a node: an 8-wide group spans two nodes, its
    // activations' all-reduces cross the network, and the step pays.
    let hw = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("profiles/hardware/h100-sxm-80gb.yaml"),
    )
    .unwrap()
    .replace("gpus_per_node: 8", "gpus_per_node: 4");
    let hw_path = scratch_file("tp-plan-4-per-node", "h100-4.yaml", hw);
    let q = plan("tp-plan-70b-4", &recipe(hw_path.to_str().unwrap()));
    let qs = q["points"].as_array().unwrap();
    let comm = |x: &serde_json::Value| x["comm_s"].as_f64().unwrap();
    let (near, far) = (comm(&at(pts, 8, 2)), comm(&at(qs, 8, 2)));
    // (Both also carry the data-parallel gradients over the network.)
    assert!(far > 1.5 * near, "{far} vs {near}");
    // A 4-wide group still fits in those nodes.
    assert!(comm(&at(qs, 4, 2)) < far);
}

/// Megatron's sequence parallelism: the norms and residual stream keep half
/// the tokens on each of 2 ranks, so the activations shrink; each
/// column-parallel projection's input is all-gathered (again in the
/// backward) and each row-parallel output reduce-scattered, and the norms'
/// gradients are all-reduced once a step.
#[test]
fn sequence_parallelism_splits_the_tokens_between_the_projections() {
    let model = load_model("llama-tiny").unwrap();
    let l = model.n_layer;
    let (n, c) = (2 * 16, model.d_model);
    let base = TrainConfig {
        seq_len: 16,
        micro_batch: 2,
        grad_accum: 3,
        ranks: 2,
        tensor_parallel: 2,
        checkpointing: Checkpointing::Full,
        ..TrainConfig::default()
    };
    let peaks = |sp: bool| {
        let tc = TrainConfig {
            sequence_parallel: sp,
            ..base.clone()
        };
        let mut meta = meta_cluster(&model, &tc);
        for e in &mut meta.ranks {
            e.dev.meter.collectives = Some(Vec::new());
        }
        meta.step_from(3, || unreachable!()).unwrap();
        let e = meta.ranks.swap_remove(0);
        (e.dev.tracker.peak_bytes(), e.dev.meter.collectives.unwrap())
    };
    let (tp, _) = peaks(false);
    let (sp, calls) = peaks(true);
    assert_eq!(sp.parameters, tp.parameters);
    assert!(sp.activations < tp.activations, "{sp:?} vs {tp:?}");
    let count = |op: Op, bytes: usize| {
        calls
            .iter()
            .filter(|x| x.op == op && x.bytes == bytes as u64)
            .count()
    };
    let act = 4 * n * c;
    // Per micro-batch, with the forward recomputed: each block gathers
    // ln1 and ln2 and scatters the o and down outputs (the recompute skips
    // the down projection), then in the backward gathers d(out) twice and
    // ln1 and ln2 again, and scatters the two norm-input gradients; the
    // embedding scatters its output and gathers its gradient; the head
    // gathers its input twice and scatters its input's gradient.
    let gathers = (2 + 2 + 4) * l + 1 + 2;
    let scatters = (2 + 1 + 2) * l + 1 + 1;
    assert_eq!(count(Op::AllGather, act), 3 * gathers);
    assert_eq!(count(Op::ReduceScatter, act), 3 * scatters);
    // Once a step: every norm weight's gradient (llama: 2 a block + ln_f).
    assert_eq!(count(Op::AllReduce, 4 * c), 2 * l + 1);
}

/// A tiny model of `model_type` from its config.json (as `moe.rs` imports
/// them): Qwen3's per-head q/k norms and heads of their own width,
/// Qwen3-MoE's norms and experts, Qwen2-MoE's gated shared expert.
fn tiny(model_type: &str, extra: &str) -> ModelConfig {
    let text = format!(
        r#"{{"model_type": "{model_type}", "hidden_size": 64, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "vocab_size": 256, {extra}}}"#
    );
    memfit::config::hf::import_hf_config(&text, "config.json").unwrap()
}

/// moe-tiny (a dense block, then 2 of 4 experts beside a shared expert)
/// and the tiny Qwen3, Qwen3-MoE and Qwen2-MoE.
fn experts_and_norms() -> Vec<ModelConfig> {
    let experts = r#""num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24"#;
    vec![
        load_model("moe-tiny").unwrap(),
        tiny("qwen3", r#""head_dim": 32"#),
        tiny("qwen3_moe", &format!(r#""head_dim": 32, {experts}"#)),
        tiny(
            "qwen2_moe",
            &format!(r#"{experts}, "shared_expert_intermediate_size": 40"#),
        ),
    ]
}

/// Experts split over a tensor-parallel group (every expert's gate|up by
/// columns, down by rows, the router replicated) and per-head q/k norms
/// on each rank's heads train as one rank does: alone, under ZeRO, and
/// with expert parallelism among the replicas at each position.
#[test]
fn experts_and_per_head_norms_train_as_one_rank() {
    for model in experts_and_norms() {
        let name = model.name.clone();
        for precision in [Precision::Fp32, Precision::Bf16] {
            for (ranks, sharding, expert_parallel) in [
                (2, Sharding::None, 1),
                (4, Sharding::Zero2, 1),
                (4, Sharding::Zero1, 2),
            ] {
                if expert_parallel > 1 && model.moe.is_none() {
                    continue;
                }
                let tc = TrainConfig {
                    seq_len: 16,
                    micro_batch: 2,
                    grad_accum: 2,
                    lr: Some(1e-3),
                    precision,
                    optimizer: Optimizer::Adamw,
                    ranks,
                    sharding,
                    tensor_parallel: 2,
                    expert_parallel,
                    ..TrainConfig::default()
                };
                let what = format!("{name} {precision:?} {sharding:?} EP {expert_parallel}");
                let (want, want_losses) = train_single(&model, &tc, 3);
                let mut c = cpu_cluster(&model, &tc);
                let mut data = DataSource::synthetic(model.vocab_size, 11);
                for want_loss in want_losses {
                    let r = c
                        .step_from(tc.grad_accum, || data.next_batch(2, 16))
                        .unwrap();
                    let loss = r.loss.unwrap();
                    let rel = ((loss - want_loss) / want_loss).abs();
                    eprintln!("{what}: loss {loss} vs {want_loss} ({rel:e})");
                    // bf16 rounds each rank's partial sums before the
                    // all-reduce (as the dense test allows, 1e-3).
                    let tol = match precision {
                        Precision::Fp32 => 1e-5,
                        _ => 1e-3,
                    };
                    assert!(rel < tol, "{what}: loss {loss} vs {want_loss}");
                }
                if expert_parallel > 1 {
                    // The replicas hold different experts: the losses say it.
                    continue;
                }
                let d = max_diff(&full_params(&c, &want), &want);
                eprintln!("{what}: max |diff| {d:e}");
                let tol = match precision {
                    Precision::Fp32 => 1e-4,
                    _ => tolerance(precision),
                };
                assert!(d <= tol, "{what}: {d}");
            }
        }
    }
}

/// Meta predicts every rank of a tensor-parallel job with experts and q/k
/// norms byte for byte: peaks, the allocation timeline, what is sent and
/// received (with expert parallelism, under a capacity factor, which fixes
/// what each rank receives).
#[test]
fn meta_predicts_tensor_parallel_experts_and_norms() {
    let timeline = |t: &memfit::memory::Tracker| -> Vec<(String, &'static str, i64)> {
        t.timeline()
            .iter()
            .map(|e| (e.phase.to_string(), e.category.name(), e.bytes))
            .collect()
    };
    for model in experts_and_norms() {
        for (ranks, stages, sharding, checkpointing, expert_parallel) in [
            (2, 1, Sharding::None, Checkpointing::None, 1),
            (4, 1, Sharding::Zero3, Checkpointing::Full, 1),
            (4, 2, Sharding::None, Checkpointing::Full, 1),
            (8, 1, Sharding::Zero1, Checkpointing::None, 2),
        ] {
            let moe = model.moe.is_some();
            if expert_parallel > 1 && !moe {
                continue;
            }
            let tc = TrainConfig {
                seq_len: 16,
                micro_batch: 2,
                grad_accum: 2,
                precision: Precision::Bf16,
                checkpointing,
                ranks,
                sharding,
                pipeline_stages: stages,
                tensor_parallel: 2,
                expert_parallel,
                capacity_factor: (expert_parallel > 1).then_some(1.0),
                ..TrainConfig::default()
            };
            let what = format!("{} N={ranks} S={stages} {sharding:?}", model.name);
            let mut cpu = cpu_cluster(&model, &tc);
            let mut meta = meta_cluster(&model, &tc);
            let mut data = DataSource::synthetic(model.vocab_size, 5);
            for _ in 0..2 {
                let r = cpu.step_from(2, || data.next_batch(2, 16)).unwrap();
                assert!(r.loss.unwrap().is_finite(), "{what}");
                meta.step_from(2, || unreachable!()).unwrap();
            }
            for (c, m) in cpu.ranks.iter().zip(&meta.ranks) {
                let (ct, mt) = (&c.dev.tracker, &m.dev.tracker);
                assert_eq!(ct.peak_bytes(), mt.peak_bytes(), "{what}");
                assert_eq!(timeline(ct), timeline(mt), "{what}");
                assert_eq!(
                    (c.dev.meter.sent, c.dev.meter.received),
                    (m.dev.meter.sent, m.dev.meter.received),
                    "{what}"
                );
            }
            for (i, dev) in cpu.release().into_iter().enumerate() {
                assert_eq!(dev.tracker.live().total(), 0, "{what}: rank {i} leaked");
            }
        }
    }
}

/// Each rank keeps `1/T` of every expert (stacked, still `(E, ..)`) and
/// of the shared expert, and the whole router and shared gate.
#[test]
fn experts_split_as_the_dense_mlp() {
    let model = load_model("moe-tiny").unwrap();
    let tc = TrainConfig {
        seq_len: 16,
        micro_batch: 2,
        ranks: 2,
        tensor_parallel: 2,
        ..TrainConfig::default()
    };
    let c = meta_cluster(&model, &tc);
    let (full, _) = model.param_layout();
    let e = &c.ranks[1];
    let mut halved = 0;
    for (spec, local) in full.iter().zip(e.param_specs()) {
        let name = spec.name.to_string();
        if name.contains("router") || name.contains("gate.weight") {
            assert_eq!(local.shape, spec.shape, "{}: replicated", spec.name);
        } else if name.contains("experts") || name.contains("shared") {
            assert_eq!(local.numel() * 2, spec.numel(), "{}: halved", spec.name);
            assert_eq!(local.shape.len(), spec.shape.len(), "{}", spec.name);
            if name.contains("experts") {
                assert_eq!(local.shape[0], spec.shape[0], "{}: every expert", spec.name);
            }
            halved += 1;
        }
    }
    assert!(halved >= 4, "experts and the shared expert: {halved}");
}

#[test]
fn the_cli_runs_experts_and_qk_norms_tensor_parallel_and_refuses_the_rest() {
    let base = [
        "run",
        "--model",
        "moe-tiny",
        "--steps",
        "3",
        "--seq-len",
        "16",
        "--format",
        "json",
    ];
    let one = ok_json(&base, &[]);
    let tp = ok_json(&base, &["--tensor-parallel", "2"]);
    for (a, b) in losses(&one).iter().zip(losses(&tp)) {
        assert!(((a - b) / a).abs() < 1e-5, "{a} vs {b}");
    }
    let meta = ok_json(&base, &["--tensor-parallel", "2", "--device", "meta"]);
    for (c, m) in tp["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .zip(meta["ranks"].as_array().unwrap())
    {
        assert_eq!(c["peak_bytes"], m["peak_bytes"]);
        assert_eq!(c["sent_bytes_per_step"], m["sent_bytes_per_step"]);
    }
    let tp = [&base[..], &["--tensor-parallel", "2"]].concat();
    let err = refused(
        &[&tp[..], &["--sequence-parallel"]].concat(),
        "--sequence-parallel",
    );
    assert!(err.contains("has experts"), "{err}");
    // Qwen3-30B-A3B (per-head norms, 128 experts) splits 4 ways (its 4
    // key/value heads bound it) and plans, alone and with experts split.
    let q = [
        "run",
        "--model",
        "qwen3-30b-a3b",
        "--device",
        "meta",
        "--seq-len",
        "4096",
        "--precision",
        "bf16",
        "--checkpointing",
        "full",
        "--attention",
        "fused",
    ];
    ok_json(
        &q,
        &["--ranks", "4", "--tensor-parallel", "4", "--format", "json"],
    );
    refused(
        &[&q[..], &["--ranks", "8", "--tensor-parallel", "8"]].concat(),
        "n_kv_head",
    );
    ok_json(
        &q,
        &[
            "--ranks",
            "8",
            "--tensor-parallel",
            "2",
            "--expert-parallel",
            "4",
            "--sharding",
            "zero1",
            "--format",
            "json",
        ],
    );
    // OLMoE's norm over every head of a token is refused by name.
    let err = refused(
        &[
            "run",
            "--model",
            "olmoe-1b-7b",
            "--device",
            "meta",
            "--ranks",
            "2",
            "--tensor-parallel",
            "2",
        ],
        "--tensor-parallel",
    );
    assert!(err.contains("qk_norm: full"), "{err}");
}

/// Qwen3-30B-A3B on one node of 8 H100s: expert parallelism, tensor
/// parallelism or both. Tensor parallelism 8 cannot split the 4 key/value
/// heads; the plan recommends expert parallelism 8, and the tensor- and
/// expert-parallel points that fit are priced.
#[test]
fn planning_qwen3_30b_a3b_weighs_expert_and_tensor_parallelism() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/recipes/qwen3-30b-a3b-1node.yaml"
    );
    let out = memfit(&["plan", path, "--format", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let r = json(&out);
    let points = r["points"].as_array().unwrap();
    let at = |tp: u64, ep: u64| {
        points.iter().filter(move |p| {
            p["point"]["tensor_parallel"].as_u64().unwrap_or(1) == tp
                && p["point"]["expert_parallel"].as_u64().unwrap_or(1) == ep
        })
    };
    assert!(at(8, 1).all(|p| p["status"] == "invalid"));
    assert!(at(1, 1).all(|p| p["status"] == "does_not_fit"));
    for (tp, ep) in [(2, 4), (4, 1), (4, 2)] {
        assert!(at(tp, ep).any(|p| p["status"] == "fits"), "tp {tp} ep {ep}");
    }
    let index = r["recommendation"]["index"].as_u64().unwrap() as usize;
    let best = &points[index]["point"];
    assert_eq!(best["expert_parallel"], 8, "{best}");
    assert_eq!(best["tensor_parallel"].as_u64().unwrap_or(1), 1, "{best}");
}
