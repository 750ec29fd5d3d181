//! ZeRO-Offload: the host as a second tracked memory, trained for real on
//! cpu, planned on meta, and DeepSpeed's estimators beside the engine.

use crate::common::{
    json, losses, memfit, ok_json, plan_json, refused, scratch, scratch_file, stderr,
};
use serde_json::Value;

fn run(extra: &[&str]) -> Value {
    ok_json(
        &[
            "run",
            "--model",
            "llama-tiny",
            "--steps",
            "3",
            "--format",
            "json",
        ],
        extra,
    )
}

#[test]
fn offloading_fp32_state_trains_bit_for_bit_as_zero_without_it() {
    for (sharding, offload) in [
        ("zero1", "optimizer"),
        ("zero2", "optimizer"),
        ("zero3", "optimizer"),
        ("zero3", "optimizer+params"),
    ] {
        let base = run(&["--ranks", "2", "--sharding", sharding]);
        let off = run(&["--ranks", "2", "--sharding", sharding, "--offload", offload]);
        // fp32: the host's copy of the shard is the weights the device
        // updated in place before; the same arithmetic, the same bits.
        assert_eq!(losses(&base), losses(&off), "{sharding} {offload}");
        assert!(losses(&off)[2] < losses(&off)[0]);
        // The state left the device for the host.
        assert!(base["host"].is_null());
        assert_eq!(off["peak_bytes"]["optimizer"], 0, "{sharding} {offload}");
        let host = &off["host"]["peak_bytes"];
        // m and v as before, plus the host's fp32 copy of the shard.
        assert_eq!(
            2 * host["optimizer"].as_u64().unwrap(),
            3 * base["peak_bytes"]["optimizer"].as_u64().unwrap(),
            "{sharding} {offload}"
        );
        assert!(off["host"]["link_bytes_per_step"].as_u64().unwrap() > 0);
        let params_on_host = host["parameters"].as_u64().unwrap();
        assert_eq!(params_on_host > 0, offload == "optimizer+params");
    }
}

#[test]
fn mixed_precision_offload_keeps_an_fp32_gradient_shard_on_the_host() {
    // One GPU, ZeRO-2, bf16: what DeepSpeed's single-GPU offload runs.
    let r = run(&[
        "--sharding",
        "zero2",
        "--precision",
        "bf16",
        "--offload",
        "optimizer",
    ]);
    let ps = r["config"]["offload"].as_str().unwrap();
    assert_eq!(ps, "optimizer");
    let l = losses(&r);
    assert!(l[2] < l[0], "{l:?}");
    let host = &r["host"]["peak_bytes"];
    let dev = &r["peak_bytes"];
    // Parameters stay on the device in bf16 (2 B each); the host holds the
    // fp32 master, m and v (12 B) and the fp32 gradient shard (4 B): the
    // ZeRO-Offload paper's 16 B per parameter on the CPU.
    let p2 = dev["parameters"].as_u64().unwrap();
    assert_eq!(host["gradients"].as_u64().unwrap(), 2 * p2);
    assert_eq!(host["optimizer"].as_u64().unwrap(), 6 * p2);
    assert_eq!(host["total"].as_u64().unwrap(), 8 * p2);
    assert_eq!(r["host"]["node_bytes"], host["total"]);
}

#[test]
fn meta_predicts_device_and_host_byte_for_byte() {
    for (sharding, offload, precision) in [
        ("zero2", "optimizer", "bf16"),
        ("zero3", "optimizer+params", "bf16"),
        ("zero1", "optimizer", "fp32"),
    ] {
        let flags = [
            "--ranks",
            "2",
            "--sharding",
            sharding,
            "--offload",
            offload,
            "--precision",
            precision,
            "--grad-accum",
            "2",
        ];
        let cpu = run(&flags);
        let mut meta_flags = flags.to_vec();
        meta_flags.extend(["--device", "meta"]);
        let meta = run(&meta_flags);
        assert_eq!(
            cpu["peak_bytes"], meta["peak_bytes"],
            "{sharding} {offload}"
        );
        for (c, m) in cpu["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .zip(meta["ranks"].as_array().unwrap())
        {
            assert_eq!(
                c["host_peak_bytes"], m["host_peak_bytes"],
                "{sharding} {offload}"
            );
        }
        assert_eq!(
            cpu["host"]["link_bytes_per_step"],
            meta["host"]["link_bytes_per_step"]
        );
    }
}

#[test]
fn a_host_too_small_is_a_typed_out_of_memory() {
    let out = memfit(&[
        "run",
        "--model",
        "llama-tiny",
        "--sharding",
        "zero2",
        "--offload",
        "optimizer",
        "--host-memory",
        "256KiB",
        "--format",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("out of host memory"),
        "{}",
        stderr(&out)
    );
    let r = json(&out);
    assert!(r["host"]["peak_bytes"]["total"].as_u64().unwrap() <= 256 << 10);
}

#[test]
fn offload_without_its_zero_stage_is_refused() {
    let m = ["run", "--model", "llama-tiny"];
    let with = |extra: &[&'static str]| [&m[..], extra].concat();
    refused(
        &with(&[
            "--ranks",
            "2",
            "--sharding",
            "ddp",
            "--offload",
            "optimizer",
        ]),
        "--offload: offloading the optimizer needs ZeRO",
    );
    refused(
        &with(&["--sharding", "zero2", "--offload", "optimizer+params"]),
        "needs ZeRO-3",
    );
    refused(
        &with(&["--host-memory", "1GiB"]),
        "--host-memory: applies to offload only",
    );
    refused(
        &with(&[
            "--sharding",
            "zero2",
            "--offload",
            "optimizer",
            "--host-memory",
            "0",
        ]),
        "--host-memory",
    );
    // One rank shards nothing unless it offloads.
    refused(&with(&["--sharding", "zero2"]), "--sharding");
}

#[test]
fn recipe_keys_offload_and_host_memory() {
    let path = scratch_file(
        "offload-recipe",
        "r.yaml",
        "model: llama-tiny\nsharding: zero3\noffload: optimizer+params\nhost_memory: 2GiB\nsteps: 1\n",
    );
    let out = memfit(&[
        "run",
        "--recipe",
        path.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let r = json(&out);
    assert_eq!(r["host"]["capacity_bytes"], 2u64 << 30);
    std::fs::write(
        &path,
        "model: llama-tiny\nsharding: zero3\noffload: optimizer\nhost_memory: lots\n",
    )
    .unwrap();
    let out = memfit(&["run", "--recipe", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("r.yaml:4:14"), "{}", stderr(&out));
}

fn plan(recipe: &str) -> Value {
    let dir = scratch("offload-plan");
    let path = dir.join(format!("p{}.yaml", recipe.len()));
    std::fs::write(&path, recipe).unwrap();
    plan_json(&memfit(&[
        "plan",
        path.to_str().unwrap(),
        "--format",
        "json",
    ]))
}

/// The point of `plan` whose offload is `offload` and sharding `sharding`.
fn point<'a>(p: &'a Value, sharding: &str, offload: &str) -> &'a Value {
    p["points"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["point"]["sharding"] == sharding && x["point"]["offload"] == offload)
        .unwrap_or_else(|| panic!("{sharding} {offload}"))
}

#[test]
fn full_finetuning_llama_8b_on_a_4090_fits_only_with_parameters_offloaded() {
    let recipe = "model: llama-3.1-8b\nhardware: rtx-4090\nseq_len: 2048\nglobal_batch: 8\nhost_memory: 192GiB\ngrid:\n  checkpointing: [full]\n  sharding: [zero2, zero3]\n  offload: [optimizer, optimizer+params]\n";
    let p = plan(recipe);
    let z2 = point(&p, "zero2", "optimizer");
    let z3 = point(&p, "zero3", "optimizer+params");
    assert_eq!(
        z2["status"], "does_not_fit",
        "16 GB of bf16 weights stay on the GPU"
    );
    assert_eq!(z3["status"], "fits");
    let host = &z3["host"];
    // 2 + 4 + 12 B per parameter on the host (weights, fp32 gradients,
    // master + Adam), the 18 B/param DeepSpeed's zero3 estimator divides
    // by its 1.5 buffer factor.
    let n = p["num_parameters"].as_f64().unwrap();
    let per_param = host["peak_bytes"]["total"].as_f64().unwrap() / n;
    assert!((17.9..18.1).contains(&per_param), "{per_param}");
    let ds = host["deepspeed"]["per_cpu"].as_f64().unwrap();
    assert!((ds / host["node_bytes"].as_f64().unwrap() - 1.5).abs() < 0.01);
    assert!(z3["offload_s"].as_f64().unwrap() > z3["compute_s"].as_f64().unwrap());
    // The same plan with too little host memory does not fit, on the host.
    let small = plan(&recipe.replace("192GiB", "64GiB"));
    let z3 = point(&small, "zero3", "optimizer+params");
    assert_eq!(z3["status"], "does_not_fit");
    assert!(z3["margin_bytes"].as_i64().unwrap() > 0);
    assert!(z3["host"]["margin_bytes"].as_i64().unwrap() < 0);
}

#[test]
fn offload_is_priced_on_the_host_link() {
    // The same point on a PCIe 5 and a PCIe 3 node: the copies take four
    // times as long (64 vs 16 GB/s); the CPU update, at a similar share of
    // host memory bandwidth, does not.
    let r = |hw: &str| {
        plan(&format!(
            "model: llama-3.2-1b\nhardware: {hw}\nseq_len: 512\nglobal_batch: 8\nhost_memory: 64GiB\ngrid:\n  sharding: [zero3]\n  offload: [optimizer+params]\n  precision: [fp16]\n"
        ))
    };
    let fast = point(&r("h100-sxm-80gb"), "zero3", "optimizer+params")["offload_s"]
        .as_f64()
        .unwrap();
    let slow = point(&r("t4"), "zero3", "optimizer+params")["offload_s"]
        .as_f64()
        .unwrap();
    assert!(slow > 2.0 * fast, "{slow} vs {fast}");
}

/// torchtune's activation offloading: each checkpointed block's input
/// waits in host memory between its forward and its backward. The copies
/// are exact, so training is bit for bit as without it; the device holds
/// less, the host the offloaded inputs, and meta predicts both.
#[test]
fn offloaded_activations_train_bit_for_bit_and_meta_predicts_both_memories() {
    for model in ["llama-tiny", "gpt2-tiny"] {
        let run = |extra: &[&str]| {
            ok_json(
                &["run", "--model", model, "--steps", "3", "--format", "json"],
                extra,
            )
        };
        let flags = ["--checkpointing", "full"];
        let base = run(&flags);
        let off = run(&[&flags[..], &["--offload-activations"]].concat());
        assert_eq!(losses(&base), losses(&off), "{model}");
        let (b, o) = (&base["peak_bytes"], &off["peak_bytes"]);
        assert!(
            o["activations"].as_u64() < b["activations"].as_u64(),
            "{model}: {b} {o}"
        );
        assert_eq!(o["parameters"], b["parameters"], "{model}");
        // Every block's input and the last block's output, which the final
        // norm saves (torchtune keeps only the output projection's on the
        // device): n_layer + 1 tensors of micro-batch x tokens x width, fp32.
        let cfg = &off["config"];
        let (mb, t) = (
            cfg["micro_batch"].as_u64().unwrap(),
            cfg["seq_len"].as_u64().unwrap(),
        );
        let model_cfg = memfit::config::profile::load_model(model).unwrap();
        let inputs = (model_cfg.n_layer as u64 + 1) * mb * t * model_cfg.d_model as u64 * 4;
        let host = &off["host"];
        assert_eq!(host["peak_bytes"]["activations"], inputs, "{model}");
        assert_eq!(host["peak_bytes"]["total"], inputs, "{model}");
        // Down in the forward, up in the backward, every step.
        assert_eq!(host["link_bytes_per_step"], 2 * inputs, "{model}");
        let meta = run(&[&flags[..], &["--offload-activations", "--device", "meta"]].concat());
        assert_eq!(meta["peak_bytes"], off["peak_bytes"], "{model}");
        assert_eq!(meta["host"]["peak_bytes"], host["peak_bytes"], "{model}");
    }
    refused(
        &["run", "--model", "llama-tiny", "--offload-activations"],
        "--offload-activations: offloads each checkpointed block's input; add --checkpointing full",
    );
}

/// A plan axis: an 8B LoRA step on a 24 GB card with checkpointing holds
/// its 32 block inputs and the final norm's input (micro-batch 2 x 2048
/// tokens x 4096, bf16: 33 x 32 MiB), and what transformers' final RMSNorm
/// saves beyond it (its fp32 upcast twice, its normalised product's stand-in
/// and `rsqrt` twice: 8 bytes an element and 8 a row), on the host instead,
/// pays their two copies over PCIe, and a point without checkpointing is
/// invalid with the flag's reason.
#[test]
fn activation_offloading_is_a_plan_axis_with_its_host_bytes_and_link_time() {
    let p = plan(
        "model: llama-3.1-8b\nhardware: rtx-4090\nseq_len: 2048\nglobal_batch: 2\ngrid:\n  micro_batch: [2]\n  precision: [bf16]\n  finetune: [lora]\n  checkpointing: [none, full]\n  offload_activations: [false, true]\n",
    );
    let find = |ckpt: &str, off: bool| {
        p["points"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| {
                x["point"]["checkpointing"] == ckpt
                    && x["point"]["offload_activations"].as_bool().unwrap_or(false) == off
            })
            .unwrap_or_else(|| panic!("{ckpt} {off}"))
    };
    let (on, off) = (find("full", true), find("full", false));
    assert!(off["point"].get("offload_activations").is_none(), "{off}");
    let (n, c) = (2u64 * 2048, 4096u64);
    let inputs = 33 * n * c * 2 + n * c * 8 + n * 8;
    assert_eq!(on["host"]["peak_bytes"]["activations"], inputs);
    assert_eq!(on["host"]["link_bytes_per_step"], 2 * inputs);
    assert!(off["host"].is_null());
    let peak = |x: &Value| x["peak_bytes"]["total"].as_u64().unwrap();
    assert!(peak(on) < peak(off), "{} {}", peak(on), peak(off));
    assert!(on["offload_s"].as_f64().unwrap() > 0.0);
    assert!(on["tokens_per_s"].as_f64() < off["tokens_per_s"].as_f64());
    let bad = find("none", true);
    assert_eq!(bad["status"], "invalid", "{bad}");
    assert!(
        bad["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("--checkpointing full")
            || bad.to_string().contains("--checkpointing full"),
        "{bad}"
    );
}

/// torchtune's own `OffloadActivations` (use_streams=False) over
/// transformers' GPT-2 and Llama (fp32, a bf16 module and bf16 autocast;
/// sdpa and eager attention) with gradient checkpointing, measured under
/// fake tensors
/// (tests/reference/offload_activations.py): the device's peaks per
/// category within the hf-eager tolerances, the host's within 3%.
#[test]
fn activation_offloading_matches_torchtunes_hooks_on_device_and_host() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let fx: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("tests/reference/offload_activations.json")).unwrap(),
    )
    .unwrap();
    let configs = fx["configs"].as_array().unwrap();
    assert_eq!(configs.len(), 9, "{}", fx["failures"]);
    let dir = scratch("offload-torchtune");
    let err = |a: u64, b: u64| (a as f64 - b as f64) / b as f64;
    let (mut report, mut failed) = (Vec::new(), false);
    for c in configs {
        let name = c["name"].as_str().unwrap();
        let mut cfg = c["model_config"].clone();
        cfg["model_type"] = match c["hf_class"].as_str().unwrap() {
            "GPT2LMHeadModel" => "gpt2",
            "LlamaForCausalLM" => "llama",
            other => panic!("{other}"),
        }
        .into();
        let precision = match c["precision"].as_str().unwrap() {
            "bf16-model" => "bf16-pure",
            // hf-eager's bf16 with a master copy is autocast.
            "bf16-autocast" => "bf16",
            p => p,
        };
        let path = dir.join(format!("{name}.json"));
        std::fs::write(&path, cfg.to_string()).unwrap();
        let attention = match c["attention"].as_str().unwrap() {
            "sdpa" => "fused",
            a => a,
        };
        let (b, t) = (c["batch"].as_u64().unwrap(), c["seq_len"].as_u64().unwrap());
        let r = ok_json(
            &[
                "run",
                "--model",
                path.to_str().unwrap(),
                "--framework",
                "hf-eager",
                "--checkpointing",
                "full",
                "--offload-activations",
                "--precision",
                precision,
                "--attention",
                attention,
                "--micro-batch",
                &b.to_string(),
                "--seq-len",
                &t.to_string(),
                "--device",
                "meta",
                "--format",
                "json",
            ],
            &[],
        );
        let (ours, torch) = (&r["peak_bytes"], &c["device_peak_bytes"]);
        let host = r["host"]["peak_bytes"]["total"].as_u64().unwrap();
        let mut line = format!("{name}:");
        let checks = [("total", 0.03), ("host", 0.03)].into_iter().chain(
            [
                "parameters",
                "gradients",
                "optimizer",
                "activations",
                "temporaries",
            ]
            .map(|k| (k, 0.05)),
        );
        for (k, tolerance) in checks {
            let e = match k {
                "host" => err(host, c["host_peak_bytes"].as_u64().unwrap()),
                k => err(ours[k].as_u64().unwrap(), torch[k].as_u64().unwrap()),
            };
            line += &format!(" {k} {:+.2}%", e * 100.0);
            if e.abs() > tolerance {
                line += " (out)";
                failed = true;
            }
        }
        report.push(line);
    }
    eprintln!("{}", report.join("\n"));
    assert!(!failed, "{}", report.join("\n"));
}

/// hf-eager, eager attention: GPT-2 hands each checkpointed block the
/// (B, 1, T, T) mask positionally, so offloading copies it to the host once
/// per block; Llama hands it by keyword, which stays on the device. Either
/// way training is what it is without offloading, and meta predicts the
/// device and the host to the byte.
#[test]
fn eager_attention_masks_offload_as_transformers_passes_them() {
    for (model, positional) in [("gpt2-tiny", true), ("llama-tiny", false)] {
        let run = |extra: &[&str]| {
            let flags = ["--framework", "hf-eager", "--checkpointing", "full"];
            let args = [
                &["run", "--model", model, "--steps", "2", "--format", "json"][..],
                &flags[..],
            ]
            .concat();
            ok_json(&args, extra)
        };
        let eager = ["--attention", "eager", "--offload-activations"];
        let off = run(&eager);
        let kept = run(&eager[..2]);
        assert_eq!(losses(&off), losses(&kept), "{model}");
        let meta = run(&[&eager[..], &["--device", "meta"]].concat());
        assert_eq!(meta["peak_bytes"], off["peak_bytes"], "{model}");
        assert_eq!(
            meta["host"]["peak_bytes"], off["host"]["peak_bytes"],
            "{model}"
        );
        let sdpa = run(&["--attention", "fused", "--offload-activations"]);
        let cfg = &off["config"];
        let (mb, t) = (
            cfg["micro_batch"].as_u64().unwrap(),
            cfg["seq_len"].as_u64().unwrap(),
        );
        let layers = memfit::config::profile::load_model(model).unwrap().n_layer as u64;
        let host = |r: &Value| r["host"]["peak_bytes"]["total"].as_u64().unwrap();
        let masks = if positional {
            layers * mb * t * t * 4
        } else {
            0
        };
        assert_eq!(host(&off) - host(&sdpa), masks, "{model}");
    }
}
