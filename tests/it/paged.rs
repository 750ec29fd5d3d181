//! Paged optimizers (`paged-adamw`, `paged-adamw8bit`): bitsandbytes' AdamW
//! with its large states in CUDA unified memory. The same numerics as the
//! unpaged optimizer, the paged bytes in their own memory (outside the
//! device peak and the caching allocator), and plans that place them in
//! the room the peak leaves and price what pages out.

use crate::common::{losses, memfit, ok_json, plan_json, refused, scratch_file};
use serde_json::Value;

/// A Llama whose embedding, head and MLP matrices hold at least 100,000
/// elements (paged) and whose attention and norms hold fewer (not paged).
const MODEL: &str = "tests/fixtures/valid/models/paged-llama.yaml";

fn run(optimizer: &str, device: &str, extra: &[&str]) -> Value {
    ok_json(
        &[
            "run",
            "--model",
            MODEL,
            "--steps",
            "3",
            "--optimizer",
            optimizer,
            "--device",
            device,
            "--format",
            "json",
        ],
        extra,
    )
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

/// Elements of the tensors bitsandbytes pages (`p.numel() >= 1e5`): the
/// 1024 x 128 embedding and head, and 2 layers x 3 MLP matrices of 128 x 800.
const PAGED_ELEMENTS: u64 = 2 * 1024 * 128 + 2 * 3 * 128 * 800;

#[test]
fn paged_optimizers_train_bit_for_bit_as_unpaged_and_meta_predicts_the_paged_bytes() {
    for (paged, base, state_bytes) in [
        ("paged-adamw", "adamw", 8),
        ("paged-adamw8bit", "adamw8bit", 2),
    ] {
        for extra in [
            &[][..],
            &["--precision", "bf16"][..],
            &["--ranks", "2", "--sharding", "zero2"][..],
        ] {
            let what = format!("{paged} {extra:?}");
            let b = run(base, "cpu", extra);
            let p = run(paged, "cpu", extra);
            // The same kernels on the same state: the same losses, bit for bit.
            assert_eq!(losses(&b), losses(&p), "{what}");
            assert!(losses(&p)[2] < losses(&p)[0], "{what}");
            assert!(b["paged"].is_null(), "{what}");
            // m and v of the large tensors (this rank's shard of them under
            // ZeRO) left the device's peak for unified memory; the rest of
            // the state (small tensors, 8-bit absmax, master weights) stayed.
            let paged_bytes = u(&p["paged"]["peak_bytes"]);
            let whole = state_bytes * PAGED_ELEMENTS;
            match extra.contains(&"zero2") {
                // The threshold reads the shard, as bitsandbytes' reads
                // FSDP's flat shard: halves under 100,000 stay unpaged.
                true => assert!(paged_bytes > 0 && paged_bytes < whole / 2, "{what}"),
                false => assert_eq!(paged_bytes, whole, "{what}"),
            }
            assert_eq!(
                u(&b["peak_bytes"]["optimizer"]),
                u(&p["peak_bytes"]["optimizer"]) + paged_bytes,
                "{what}"
            );
            assert_eq!(
                u(&b["peak_bytes"]["total"]) - u(&p["peak_bytes"]["total"]),
                paged_bytes,
                "{what}: the state was live at the peak"
            );
            for r in p["ranks"].as_array().unwrap() {
                assert_eq!(u(&r["paged_bytes"]), paged_bytes, "{what}");
            }
            // Meta predicts both memories byte for byte, per category.
            let m = run(paged, "meta", extra);
            assert_eq!(m["peak_bytes"], p["peak_bytes"], "{what}");
            assert_eq!(m["paged"], p["paged"], "{what}");
            for (a, b) in m["ranks"]
                .as_array()
                .unwrap()
                .iter()
                .zip(p["ranks"].as_array().unwrap())
            {
                assert_eq!(a["peak_bytes"], b["peak_bytes"], "{what}");
                assert_eq!(a["paged_bytes"], b["paged_bytes"], "{what}");
            }
        }
    }
}

#[test]
fn paged_state_is_outside_an_emulated_capacity() {
    // An emulated GPU the unpaged state does not fit beside the peak, and
    // the paged one does: unified memory pages out instead of failing.
    let b = run("adamw", "meta", &[]);
    let p = run("paged-adamw", "meta", &[]);
    let cap = (u(&b["peak_bytes"]["total"]) + u(&p["peak_bytes"]["total"])) / 2;
    let dev = format!("cpu:limit={cap}");
    let one_step = |optimizer: &str| {
        memfit(&[
            "run",
            "--model",
            MODEL,
            "--steps",
            "1",
            "--device",
            &dev,
            "--optimizer",
            optimizer,
        ])
    };
    assert_eq!(one_step("adamw").status.code(), Some(3), "out of memory");
    let r = run("paged-adamw", &dev, &[]);
    assert_eq!(losses(&r).len(), 3);
    let table = one_step("paged-adamw");
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.contains("paged optimizer state, unified memory, outside PyTorch's counters"),
        "{text}"
    );
}

#[test]
fn paged_optimizers_refuse_offload_and_the_cuda_backend_by_name() {
    let err = refused(
        &[
            "run",
            "--model",
            MODEL,
            "--optimizer",
            "paged-adamw8bit",
            "--sharding",
            "zero2",
            "--offload",
            "optimizer",
        ],
        "--optimizer",
    );
    assert!(
        err.contains("--offload optimizer keeps it in host memory"),
        "{err}"
    );
    let err = refused(
        &[
            "run",
            "--model",
            MODEL,
            "--optimizer",
            "paged-adamw",
            "--device",
            "cuda",
        ],
        "--optimizer",
    );
    assert!(err.contains("cudaMallocManaged"), "{err}");
    // transformers' names are read as memfit's.
    let r = run("paged_adamw_8bit", "meta", &[]);
    assert_eq!(r["config"]["optimizer"], "paged-adamw8bit");
    let r = run("paged_adamw_32bit", "meta", &[]);
    assert_eq!(r["config"]["optimizer"], "paged-adamw");
}

/// A full fine-tune of Llama-3.2-1B on a 24 GB A10G under hf-eager, where
/// AdamW's state does not fit beside the peak and a paged one does, partly
/// paged out at the larger micro-batches.
fn a10g_plan() -> Value {
    let recipe = scratch_file(
        "paged-plan",
        "r.yaml",
        "model: llama-3.2-1b\nhardware: a10g\nseq_len: 1024\nglobal_batch: 8\nhost_memory: 64GiB\n\
         grid:\n  micro_batch: [1, 2, 4]\n  precision: [fp16]\n  checkpointing: [full]\n  \
         framework: [hf-eager]\n  optimizer: [adamw, paged-adamw, paged_adamw_8bit]\n  \
         offload: [none, optimizer]\n  sharding: [none, zero2]\n",
    );
    plan_json(&memfit(&[
        "plan",
        recipe.to_str().unwrap(),
        "--format",
        "json",
    ]))
}

#[test]
fn plans_place_the_paged_state_in_the_room_the_peak_leaves_and_price_the_rest() {
    let plan = a10g_plan();
    let pts = plan["points"].as_array().unwrap();
    let mut paged_out = 0;
    for p in pts {
        let pt = &p["point"];
        let o = pt["optimizer"].as_str().unwrap();
        if p["status"] == "invalid" {
            // Paging and offloading the same state: refused by name.
            if o != "adamw" && pt["offload"] != "none" {
                let why = p["reason"].as_str().unwrap();
                assert!(why.contains("choose one"), "{why}");
            }
            continue;
        }
        assert_ne!(o, "paged_adamw_8bit", "read as paged-adamw8bit");
        let Some(g) = p["paged"].as_object() else {
            assert_eq!(o, "adamw");
            continue;
        };
        let (bytes, res, host) = (u(&g["bytes"]), u(&g["resident_bytes"]), u(&g["host_bytes"]));
        let margin = p["margin_bytes"].as_i64().unwrap();
        // Resident in the room under the usable limit, the rest paged out.
        assert_eq!(res, bytes.min(margin.max(0) as u64), "{pt}");
        assert_eq!(res + host, bytes);
        assert_eq!(u(&g["link_bytes_per_step"]), 2 * host);
        let secs = g["seconds_per_step"].as_f64().unwrap();
        let rate = g["link_bytes_per_s"].as_f64().unwrap();
        // The A10G profile's PCIe 4.0 x16 at 80%.
        assert_eq!(rate, 32e9 * 0.8);
        assert!((secs - 2.0 * host as f64 / rate).abs() < 1e-9);
        let sum = ["compute_s", "comm_s", "offload_s"]
            .iter()
            .map(|k| p[k].as_f64().unwrap())
            .sum::<f64>()
            + secs;
        assert!((p["step_s"].as_f64().unwrap() - sum).abs() < 1e-9, "{pt}");
        // The caching allocator never saw the paged state: its allocated
        // peak is the device tracker's, rounded to blocks.
        let alloc = u(&p["allocator"]["max_memory_allocated"]);
        let tracked = u(&p["peak_bytes"]["total"]);
        assert!(alloc >= tracked && alloc - tracked < bytes / 100, "{pt}");
        if host > 0 && p["status"] == "fits" {
            paged_out += 1;
        }
    }
    assert!(paged_out > 0, "some fitting point pages out");
    // AdamW does not fit on one GPU without ZeRO; both paged ones do.
    let fits = |o: &str| {
        pts.iter().any(|p| {
            p["point"]["optimizer"] == o
                && p["point"]["sharding"] == "none"
                && p["status"] == "fits"
        })
    };
    assert!(!fits("adamw") && fits("paged-adamw") && fits("paged-adamw8bit"));
}

#[test]
fn a_paged_plan_says_where_the_state_is_and_what_paging_costs() {
    let recipe = scratch_file(
        "paged-plan-text",
        "r.yaml",
        "model: llama-3.2-1b\nhardware: a10g\nseq_len: 1024\nglobal_batch: 8\n\
         grid:\n  micro_batch: [4]\n  precision: [fp16]\n  checkpointing: [full]\n  \
         framework: [hf-eager]\n  optimizer: [paged-adamw]\n",
    );
    let out = memfit(&["plan", recipe.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout).replace("\n    ", " ");
    for needle in [
        "paged optimizer state, unified memory, outside PyTorch's counters (paged-adamw)",
        "not in the peak above (cudaMallocManaged, not PyTorch's allocator)",
        "the driver pages",
        "of paged optimizer state to host memory and back each step, on the host link at 80% of 32 GB/s",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
}
