//! Hybrid sharding (FSDP's HYBRID_SHARD): ZeRO within groups of ranks,
//! replicas across them, run for real on cpu and planned across nodes.

use crate::common::{json, losses, memfit, ok_json, refused, scratch, stderr};
use serde_json::Value;

fn run(extra: &[&str]) -> Value {
    ok_json(
        &[
            "run",
            "--model",
            "llama-tiny",
            "--ranks",
            "4",
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
fn hybrid_sharding_trains_as_zero_over_every_rank_with_state_sharded_over_the_group() {
    for sharding in ["zero1", "zero2", "zero3"] {
        let flat = run(&["--sharding", sharding]);
        let hybrid = run(&["--sharding", sharding, "--shard-group", "2"]);
        // Two groups of two: the gradient is the same sum, in another order.
        for (a, b) in losses(&flat).iter().zip(losses(&hybrid)) {
            assert!((a - b).abs() < 1e-5, "{sharding}: {a} vs {b}");
        }
        // State sharded over 2 ranks, not 4: twice the optimizer bytes.
        let opt = |r: &Value| r["peak_bytes"]["optimizer"].as_u64().unwrap();
        assert_eq!(opt(&hybrid), 2 * opt(&flat), "{sharding}");
        // meta predicts every rank.
        let meta = run(&[
            "--sharding",
            sharding,
            "--shard-group",
            "2",
            "--device",
            "meta",
        ]);
        for (c, m) in hybrid["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .zip(meta["ranks"].as_array().unwrap())
        {
            assert_eq!(c["peak_bytes"], m["peak_bytes"], "{sharding}");
            assert_eq!(c["sent_bytes_per_step"], m["sent_bytes_per_step"]);
        }
    }
}

#[test]
fn hybrid_sharding_needs_zero_and_whole_groups() {
    let base = ["run", "--model", "llama-tiny", "--ranks", "4"];
    let with = |extra: &[&'static str]| [&base[..], extra].concat();
    refused(
        &with(&["--sharding", "ddp", "--shard-group", "2"]),
        "--shard-group",
    );
    refused(
        &with(&["--sharding", "zero3", "--shard-group", "3"]),
        "must divide",
    );
    refused(
        &with(&["--sharding", "zero3", "--shard-group", "4"]),
        "two or more groups",
    );
}

#[test]
fn on_a_slow_network_hybrid_sharding_trades_memory_for_traffic_across_nodes() {
    let path = scratch("hybrid-plan").join("p.yaml");
    std::fs::write(
        &path,
        "model: llama-3.1-8b\nhardware: h100-sxm-80gb\nseq_len: 2048\nglobal_batch: 64\nnetwork: eth-25\ngrid:\n  checkpointing: [full]\n  sharding: [zero3]\n  gpus: [32]\n  shard_group: [0, 8]\n",
    )
    .unwrap();
    let out = memfit(&["plan", path.to_str().unwrap(), "--format", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let p = json(&out);
    let pts = p["points"].as_array().unwrap();
    let (flat, hybrid) = (&pts[0], &pts[1]);
    assert_eq!(flat["point"]["shard_group"], 0);
    assert_eq!(hybrid["point"]["shard_group"], 8);
    assert_eq!(hybrid["links"], "intra_inter");
    let f = |x: &Value, k: &str| x[k].as_f64().unwrap();
    // The gathers and reduce-scatters stay in the node; only the gradient
    // shards cross the network, once a step.
    assert!(f(hybrid, "comm_s") * 3.0 < f(flat, "comm_s"));
    assert!(f(hybrid, "total_bytes") > f(flat, "total_bytes"));
    assert_eq!(
        p["points"][p["recommendation"]["index"].as_u64().unwrap() as usize]["point"]["shard_group"],
        8
    );
}
