//! Plans beyond one node: collectives priced on the nodes' links
//! (`comm::topology`), the links each point crosses, and a recommendation
//! that follows the network.

use crate::common::{json, memfit, plan_json, scratch, stderr};
use serde_json::Value;

fn plan(name: &str, recipe: &str) -> Value {
    let path = scratch(name).join("p.yaml");
    std::fs::write(&path, recipe).unwrap();
    plan_json(&memfit(&[
        "plan",
        path.to_str().unwrap(),
        "--format",
        "json",
    ]))
}

/// llama-3.1-70b, ZeRO-3, either 8 GPUs in one DGX H100 with the states
/// offloaded or 32 GPUs over four nodes without, on `network`.
fn seventy_b(network: &str) -> Value {
    plan(
        &format!("cluster-{network}"),
        &format!(
            "model: llama-3.1-70b\nhardware: h100-sxm-80gb\nseq_len: 4096\nglobal_batch: 64\nnetwork: {network}\nhost_memory: 2TiB\ngrid:\n  micro_batch: [2]\n  checkpointing: [full]\n  sharding: [zero3]\n  gpus: [8, 32]\n  offload: [none, optimizer+params]\n"
        ),
    )
}

fn recommended(p: &Value) -> &Value {
    &p["points"][p["recommendation"]["index"].as_u64().unwrap() as usize]
}

#[test]
fn the_recommendation_follows_the_network_between_nodes() {
    // On 400 Gb/s InfiniBand per GPU, four nodes without offload are the
    // cheapest; on one 25 Gb/s Ethernet port per node, ZeRO-3's all-gathers
    // across nodes cost more than offloading within one node.
    let ib = seventy_b("ib-ndr-400");
    let eth = seventy_b("eth-25");
    let (a, b) = (recommended(&ib), recommended(&eth));
    assert_eq!(a["point"]["gpus"], 32);
    assert_eq!(a["point"]["offload"], "none");
    assert_eq!(a["links"], "intra_inter");
    assert_eq!(b["point"]["gpus"], 8);
    assert_eq!(b["point"]["offload"], "optimizer+params");
    assert_eq!(b["links"], "intra");
    // Memory does not depend on the network; time does, and only where a
    // point crosses it.
    for (x, y) in ib["points"]
        .as_array()
        .unwrap()
        .iter()
        .zip(eth["points"].as_array().unwrap())
    {
        assert_eq!(x["peak_bytes"], y["peak_bytes"]);
        let (cx, cy) = (x["comm_s"].as_f64().unwrap(), y["comm_s"].as_f64().unwrap());
        if x["point"]["gpus"] == 8 {
            assert_eq!(cx, cy);
        } else {
            assert!(cy > 10.0 * cx, "{cy} vs {cx}");
        }
    }
}

#[test]
fn one_node_prices_nvlink_only_and_more_nodes_cost_more_per_gpu() {
    let p = plan(
        "cluster-scale",
        "model: llama-3.1-8b\nhardware: h100-sxm-80gb\nseq_len: 2048\nglobal_batch: 64\ngrid:\n  sharding: [zero3]\n  gpus: [8, 16, 64]\n",
    );
    let pts = p["points"].as_array().unwrap();
    let by = |g: u64| pts.iter().find(|x| x["point"]["gpus"] == g).unwrap();
    assert_eq!(by(8)["links"], "intra");
    assert_eq!(by(16)["links"], "intra_inter");
    // Per micro-batch each rank gathers and scatters the whole model
    // whatever the GPU count: across nodes that is slower.
    let per_mb = |g: u64| {
        let x = by(g);
        x["comm_s"].as_f64().unwrap() / x["point"]["grad_accum"].as_f64().unwrap()
    };
    assert!(per_mb(16) > per_mb(8));
    assert!(per_mb(64) > per_mb(16));
}

#[test]
fn an_unknown_network_is_a_located_error() {
    let path = scratch("cluster-bad").join("p.yaml");
    std::fs::write(
        &path,
        "model: gpt2\nhardware: h100-sxm-80gb\nseq_len: 64\nglobal_batch: 8\nnetwork: ib-ndr-40\n",
    )
    .unwrap();
    let out = memfit(&["plan", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("p.yaml:5:"), "{err}");
    assert!(err.contains("ib-ndr-400"), "{err}");
}

#[test]
fn pipeline_stages_are_a_plan_axis_priced_stage_by_stage() {
    // memfit's own engine, on the cpu backend's workspace, so that the
    // plan's peak is comparable with `memfit run --device meta`.
    let p = plan(
        "cluster-pp",
        "model: llama-tiny\nhardware: h100-sxm-80gb\nseq_len: 64\nglobal_batch: 8\ndevice: cpu\ngrid:\n  framework: [memfit]\n  precision: [fp32]\n  attention: [eager]\n  sharding: [ddp]\n  gpus: [4]\n  pipeline_stages: [1, 2, 4]\n",
    );
    let pts = p["points"].as_array().unwrap();
    let by = |s: u64| {
        pts.iter()
            .find(|x| x["point"]["pipeline_stages"] == s)
            .unwrap()
    };
    for s in [2u64, 4] {
        let x = by(s);
        assert_eq!(x["status"], "fits", "{x}");
        // The plan's per-GPU peak is its fullest stage's, as a run shows it.
        let accum = x["point"]["grad_accum"].as_u64().unwrap().to_string();
        let out = memfit(&[
            "run",
            "--model",
            "llama-tiny",
            "--device",
            "meta",
            "--seq-len",
            "64",
            "--micro-batch",
            "1",
            "--ranks",
            "4",
            "--sharding",
            "ddp",
            "--pipeline-stages",
            &s.to_string(),
            "--grad-accum",
            &accum,
            "--format",
            "json",
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        let run = json(&out);
        assert_eq!(
            x["peak_bytes"]["total"], run["peak_bytes"]["total"],
            "pp{s}"
        );
    }
    // Fewer layers per GPU: less memory; a bubble: more time per token.
    let peak = |s: u64| by(s)["peak_bytes"]["total"].as_u64().unwrap();
    assert!(peak(4) < peak(2) && peak(2) < peak(1));
    let invalid = plan(
        "cluster-pp-bad",
        "model: llama-tiny\nhardware: h100-sxm-80gb\nseq_len: 64\nglobal_batch: 8\ngrid:\n  sharding: [ddp]\n  gpus: [4]\n  pipeline_stages: [3]\n",
    );
    let reason = invalid["points"][0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("cannot be split into 3 pipeline stages"),
        "{reason}"
    );
    // Regression: more stages than llama-tiny's 2 blocks and 2 ends made
    // the even split underflow and the plan panic.
    let invalid = plan(
        "cluster-pp-deep",
        "model: llama-tiny\nhardware: h100-sxm-80gb\nseq_len: 64\nglobal_batch: 8\ngrid:\n  gpus: [8]\n  pipeline_stages: [8]\n",
    );
    let reason = invalid["points"][0]["reason"].as_str().unwrap();
    assert!(reason.contains("8 is outside 1..=4"), "{reason}");
}

/// Llama 3 405B's pre-training layout (The Llama 3 Herd of Models, Table 4:
/// 16,384 H100s, TP 8, PP 16, DP 128, sequences of 8,192, 16M-token
/// batches) is planned, and a grid one GPU past the limit is refused.
#[test]
fn llama3_405b_on_16384_gpus_is_planned_and_more_is_refused() {
    let recipe = |gpus: usize| {
        format!(
            "model: llama-3.1-405b\nhardware: h100-sxm-80gb\nnetwork: ib-ndr-400\nseq_len: 8192\nglobal_batch: 2048\ngrid:\n  framework: [memfit]\n  micro_batch: [1]\n  checkpointing: [none, full]\n  sharding: [zero1]\n  gpus: [{gpus}]\n  tensor_parallel: [8]\n  pipeline_stages: [16]\n  sequence_parallel: [false, true]\n"
        )
    };
    let p = plan("llama3-405b", &recipe(16_384));
    let points = p["points"].as_array().unwrap();
    assert_eq!(points.len(), 4);
    for x in points {
        assert_eq!(x["point"]["gpus"], 16_384);
        // 16 micro-batches of 1 sequence for each of the 128 replicas.
        assert_eq!(x["point"]["grad_accum"], 16, "{x}");
        assert!(
            x["status"] == "fits" || x["status"] == "does_not_fit",
            "{x}"
        );
        assert_eq!(x["links"], "intra_inter");
    }
    // ZeRO-1 over the 128 replicas shards optimizer states only: each GPU
    // holds 1/128 of the model's weights (126 blocks over 16 stages, 8-way
    // tensor parallel) in bf16, the first stage a slice of the embedding
    // more. (Llama 3 ran FSDP under its pipeline; memfit, as DeepSpeed,
    // refuses ZeRO-2/3 with pipeline stages.)
    let z1 = points
        .iter()
        .find(|x| x["point"]["sequence_parallel"] == true && x["point"]["checkpointing"] == "full")
        .unwrap();
    let params = z1["peak_split"]["parameters"].as_u64().unwrap() as f64;
    let share = 405_853_388_800.0 / 128.0 * 2.0;
    assert!(
        (params / share - 1.0).abs() < 0.1,
        "{params} vs about {share}"
    );
    let path = scratch("llama3-405b-over").join("p.yaml");
    std::fs::write(&path, recipe(16_385)).unwrap();
    let out = memfit(&["plan", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("grid.gpus") && err.contains("16384"), "{err}");
}

/// Regression (issue 27): pipeline sends were priced as compute, so the
/// same layout read 50.0 s of compute on 25 GbE and 25.6 s on InfiniBand.
/// Compute does not depend on the network; the sends are communication.
#[test]
fn pipeline_sends_are_communication_not_compute() {
    let on = |network: &str| {
        plan(
            &format!("pp-sends-{network}"),
            &format!(
                "model: llama-3.1-8b\nhardware: h100-sxm-80gb\nnetwork: {network}\nseq_len: 4096\ngrid:\n  framework: [memfit]\n  micro_batch: [1]\n  checkpointing: [full]\n  sharding: [zero1]\n  gpus: [16]\n  pipeline_stages: [4]\nglobal_batch: 32\n"
            ),
        )
    };
    let (ib, eth) = (on("ib-ndr-400"), on("eth-25"));
    let (a, b) = (&ib["points"][0], &eth["points"][0]);
    assert_eq!(a["status"], "fits", "{a}");
    let f = |x: &Value, k: &str| x[k].as_f64().unwrap();
    assert!(
        (f(a, "compute_s") / f(b, "compute_s") - 1.0).abs() < 1e-12,
        "{a} {b}"
    );
    assert!(f(b, "comm_s") > 2.0 * f(a, "comm_s"), "{a} {b}");
    for x in [a, b] {
        let sum = f(x, "compute_s") + f(x, "comm_s") + f(x, "offload_s");
        assert!((f(x, "step_s") / sum - 1.0).abs() < 1e-12);
    }
}

/// Interleaved 1F1B as a plan axis (`grid.virtual_stages`): each point's
/// peak is `memfit run --device meta:GPU`'s for the same layout, the
/// bubble shrinks from (S - 1) slots to (S - 1) / V, and the points a
/// pipeline cannot interleave are invalid with Megatron's reasons.
#[test]
fn virtual_stages_are_a_plan_axis_with_a_smaller_bubble() {
    let p = plan(
        "cluster-vpp",
        "model: llama-3.1-8b\nhardware: h100-sxm-80gb\nseq_len: 2048\nglobal_batch: 8\ngrid:\n  framework: [memfit]\n  micro_batch: [1]\n  checkpointing: [full]\n  gpus: [4]\n  pipeline_stages: [4]\n  virtual_stages: [1, 2]\n",
    );
    let pts = p["points"].as_array().unwrap();
    assert_eq!(pts.len(), 2);
    let by = |v: u64| {
        (pts.iter())
            .find(|x| {
                x["point"]
                    .get("virtual_stages")
                    .map_or(1, |v| v.as_u64().unwrap())
                    == v
            })
            .unwrap()
    };
    // A point's JSON names virtual stages only when above 1.
    assert!(by(1)["point"].get("virtual_stages").is_none());
    for v in [1u64, 2] {
        let x = by(v);
        assert_eq!(x["status"], "fits", "{x}");
        assert_eq!(x["point"]["grad_accum"], 8);
        let out = memfit(&[
            "run",
            "--model",
            "llama-3.1-8b",
            "--device",
            "meta:h100-sxm-80gb",
            "--seq-len",
            "2048",
            "--micro-batch",
            "1",
            "--precision",
            "bf16",
            "--attention",
            "fused",
            "--checkpointing",
            "full",
            "--ranks",
            "4",
            "--pipeline-stages",
            "4",
            "--virtual-stages",
            &v.to_string(),
            "--grad-accum",
            "8",
            "--format",
            "json",
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        let run = json(&out);
        assert_eq!(
            x["peak_bytes"]["total"], run["peak_bytes"]["total"],
            "vpp{v}"
        );
    }
    // The same compute in K + (S - 1) / V slots instead of K + S - 1: with
    // S = 4, K = 8, a step of 9.5 slots instead of 11.
    let f = |v: u64, k: &str| by(v)[k].as_f64().unwrap();
    println!(
        "S=4 K=8: compute {} s (V=1) vs {} s (V=2); comm {} s vs {} s; peak {} vs {}",
        f(1, "compute_s"),
        f(2, "compute_s"),
        f(1, "comm_s"),
        f(2, "comm_s"),
        by(1)["peak_bytes"]["total"],
        by(2)["peak_bytes"]["total"]
    );
    assert!(f(2, "compute_s") < f(1, "compute_s"));
    let ratio = f(2, "compute_s") / f(1, "compute_s");
    assert!(ratio > 9.0 / 11.0 && ratio < 10.0 / 11.0, "{ratio}");
    assert!(f(2, "step_s") < f(1, "step_s"));
    // Stage 0 holds 2 x 3 + 4 + 1 = 11 chunks of 4 blocks against 4
    // micro-batches of 8: more activations.
    assert!(by(2)["peak_bytes"]["total"].as_u64() > by(1)["peak_bytes"]["total"].as_u64());

    // Without a pipeline, and with micro-batches not in groups of S.
    let invalid = plan(
        "cluster-vpp-bad",
        "model: llama-tiny\nhardware: h100-sxm-80gb\nseq_len: 64\nglobal_batch: 3\ngrid:\n  gpus: [1, 2]\n  pipeline_stages: [1, 2]\n  virtual_stages: [2]\n",
    );
    let reasons: Vec<&str> = (invalid["points"].as_array().unwrap().iter())
        .filter_map(|x| x["reason"].as_str())
        .collect();
    assert!(
        reasons.iter().any(|r| r.contains("there is no pipeline")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.contains("whole groups of 2")),
        "{reasons:?}"
    );
    // The table shows the axis where a point interleaves.
    let path = scratch("cluster-vpp-table").join("p.yaml");
    std::fs::write(
        &path,
        "model: llama-3.1-8b\nhardware: h100-sxm-80gb\nseq_len: 2048\nglobal_batch: 8\ngrid:\n  framework: [memfit]\n  checkpointing: [full]\n  gpus: [4]\n  pipeline_stages: [4]\n  virtual_stages: [1, 2]\n",
    )
    .unwrap();
    let out = memfit(&["plan", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(" vpp "), "{text}");
}

/// Regression: a pipeline's last stage priced its sends on the link to a
/// stage past the end (rank `S x D x T`), so two stages of four
/// tensor-parallel GPUs filling one 8-GPU node read as crossing
/// InfiniBand. Each stage's sends go to the stages beside it: within the
/// node, NVLink only.
#[test]
fn a_pipeline_inside_one_node_sends_over_nvlink_only() {
    let on = |gpus: usize| {
        plan(
            &format!("pp-one-node-{gpus}"),
            &format!(
                "model: llama-3.1-8b\nhardware: h100-sxm-80gb\nseq_len: 2048\nglobal_batch: 8\ngrid:\n  framework: [memfit]\n  micro_batch: [1]\n  checkpointing: [full]\n  sharding: [none]\n  gpus: [{gpus}]\n  tensor_parallel: [4]\n  pipeline_stages: [2]\n"
            ),
        )
    };
    let x = &on(8)["points"][0];
    assert_eq!(x["status"], "fits", "{x}");
    assert_eq!(x["links"], "intra", "{x}");
    // One stage per node: the activations cross the network.
    let y = &plan(
        "pp-two-nodes",
        "model: llama-3.1-8b\nhardware: h100-sxm-80gb\nseq_len: 2048\nglobal_batch: 8\ngrid:\n  framework: [memfit]\n  micro_batch: [1]\n  checkpointing: [full]\n  sharding: [none]\n  gpus: [16]\n  tensor_parallel: [8]\n  pipeline_stages: [2]\n",
    )["points"][0];
    assert_eq!(y["links"], "intra_inter", "{y}");
    assert!(y["comm_s"].as_f64() > x["comm_s"].as_f64(), "{x} {y}");
}

/// ZeRO's per-rank copies (a gathered weight's shards out, a gradient's
/// chunks in) are one kernel each, whatever the rank count, as FSDP2's
/// `split_with_sizes_copy` and `_chunk_cat` are: with the same work per GPU,
/// a ZeRO-3 step on 128 GPUs computes no longer than on 8 (its optimizer
/// shard is smaller). Charging a launch per rank made it 61% longer.
#[test]
fn zero_copies_do_not_grow_with_the_rank_count() {
    let compute = |gpus: usize| {
        let p = plan(
            &format!("zero-copies-{gpus}"),
            &format!(
                "model: llama-3.1-8b\nhardware: h100-sxm-80gb\nseq_len: 4096\nglobal_batch: {}\nnetwork: ib-ndr-400\ngrid:\n  framework: [memfit]\n  micro_batch: [1]\n  checkpointing: [full]\n  sharding: [zero3, zero1]\n  gpus: [{gpus}]\n",
                gpus
            ),
        );
        let s: Vec<f64> = (p["points"].as_array().unwrap().iter())
            .map(|q| q["compute_s"].as_f64().unwrap())
            .collect();
        s
    };
    let (eight, many) = (compute(8), compute(128));
    for (a, b) in eight.iter().zip(&many) {
        assert!(b <= a, "compute {b} s on 128 GPUs against {a} s on 8");
    }
}
