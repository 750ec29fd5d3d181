//! The cuda device as a user meets it, on machines without a GPU: a clear
//! one-line error; and, with MEMFIT_CUDA_EMULATE set, the whole cuda path
//! (driver trait, allocator, every kernel, cuBLAS-shaped GEMMs, host-staged
//! collectives) on the emulated GPU, checked against cpu and meta.

use std::process::{Command, Output};

use crate::common::{json, memfit, stderr};
use serde_json::Value;

/// memfit with the emulated GPU standing in for cuda.
fn emulated(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(args)
        .env("MEMFIT_CUDA_EMULATE", "2GiB")
        .output()
        .expect("memfit runs")
}

fn losses(doc: &Value) -> Vec<f64> {
    doc["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["loss"].as_f64().unwrap())
        .collect()
}

const TINY: &[&str] = &[
    "run",
    "--model",
    "gpt2-tiny",
    "--seq-len",
    "32",
    "--micro-batch",
    "2",
    "--steps",
    "3",
    "--format",
    "json",
];

fn with(extra: &[&str], device: &str) -> Vec<String> {
    let mut v: Vec<String> = TINY.iter().map(|s| s.to_string()).collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v.push("--device".into());
    v.push(device.into());
    v
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn without_a_gpu_cuda_is_one_clear_error() {
    if memfit::backend::cuda::real::driver_present() {
        eprintln!("skipped: this machine has a CUDA driver");
        return;
    }
    for args in [
        vec![
            "run",
            "--model",
            "gpt2-tiny",
            "--device",
            "cuda",
            "--steps",
            "1",
        ],
        vec!["selftest"],
        vec![
            "balance",
            "--model",
            "gpt2-tiny",
            "--stages",
            "2",
            "--microbatches",
            "2",
            "--device",
            "cuda",
        ],
    ] {
        let out = memfit(&args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("no CUDA driver"), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let out = memfit(&["selftest", "--device", "cpu"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--device"), "{}", stderr(&out));
}

/// Losses as the cpu backend's to rounding, tracked peaks exactly as meta
/// predicts for the cuda backend, in fp32 and bf16, eager and fused, one rank,
/// ZeRO-2 over two ranks sharing the GPU, and a tensor-parallel pair.
#[test]
fn emulated_gpu_trains_like_cpu_with_the_peaks_meta_predicts() {
    for (extra, tol) in [
        (&[][..], 1e-4),
        (&["--tensor-parallel", "2", "--precision", "bf16"][..], 2e-2),
        (&["--precision", "bf16", "--attention", "fused"][..], 2e-2),
        // Megatron's unfused loss: the fp32 copy, the loss kernels over it
        // and the cast back, alone and over each rank's vocabulary columns.
        (
            &["--precision", "bf16", "--loss", "megatron-unfused"][..],
            2e-2,
        ),
        (
            &[
                "--tensor-parallel",
                "2",
                "--precision",
                "bf16",
                "--loss",
                "megatron-unfused",
            ][..],
            2e-2,
        ),
        (
            &[
                "--ranks",
                "2",
                "--sharding",
                "zero2",
                "--optimizer",
                "adamw8bit",
            ][..],
            1e-3,
        ),
    ] {
        let cpu = memfit(&refs(&with(extra, "cpu")));
        assert!(cpu.status.success(), "{extra:?} cpu: {}", stderr(&cpu));
        let gpu = emulated(&refs(&with(extra, "cuda")));
        assert!(gpu.status.success(), "{extra:?} cuda: {}", stderr(&gpu));
        let (cpu, gpu) = (json(&cpu), json(&gpu));
        assert_eq!(gpu["device"], "cuda");
        let (lc, lg) = (losses(&cpu), losses(&gpu));
        assert_eq!(lc.len(), lg.len());
        for (c, g) in lc.iter().zip(&lg) {
            assert!(
                (c - g).abs() <= tol * c.abs(),
                "{extra:?}: cpu {lc:?} cuda {lg:?}"
            );
        }
        // Tracked bytes: what meta predicts for cuda is what cuda tracked.
        // `memfit run --device meta` predicts the cpu backend, so compare
        // eager runs (no workspace) here; the selftest compares fused ones.
        if !extra.contains(&"fused") {
            let meta = json(&memfit(&refs(&with(extra, "meta"))));
            assert_eq!(meta["peak_bytes"], gpu["peak_bytes"], "{extra:?}");
        }
    }
}

/// QLoRA on the cuda backend: the NF4 base uploaded as bytes and
/// dequantised by `nf4_dequantize_kernel` before every matmul that reads it.
/// llama-tiny's losses as the cpu backend's (the dequantised weights are the
/// same bits, so only the other kernels' rounding differs), tracked peaks as
/// meta predicts, in fp32 and bf16.
#[test]
fn emulated_gpu_runs_qlora_like_cpu_with_the_peaks_meta_predicts() {
    for (precision, tol) in [("fp32", 1e-4), ("bf16", 2e-2)] {
        let args = |device: &'static str| {
            vec![
                "run",
                "--model",
                "llama-tiny",
                "--seq-len",
                "32",
                "--micro-batch",
                "2",
                "--steps",
                "3",
                "--format",
                "json",
                "--finetune",
                "qlora",
                "--lora-rank",
                "4",
                "--precision",
                precision,
                "--device",
                device,
            ]
        };
        let cpu = memfit(&args("cpu"));
        assert!(cpu.status.success(), "{precision} cpu: {}", stderr(&cpu));
        let gpu = emulated(&args("cuda"));
        assert!(gpu.status.success(), "{precision} cuda: {}", stderr(&gpu));
        let (cpu, gpu) = (json(&cpu), json(&gpu));
        assert_eq!(gpu["device"], "cuda");
        assert_eq!(gpu["config"]["finetune"], "qlora");
        let (lc, lg) = (losses(&cpu), losses(&gpu));
        assert_eq!(lc.len(), 3);
        assert_eq!(lc.len(), lg.len());
        for (c, g) in lc.iter().zip(&lg) {
            assert!(
                (c - g).abs() <= tol * c.abs(),
                "{precision}: cpu {lc:?} cuda {lg:?}"
            );
        }
        // Eager attention: no workspace, so meta's cpu prediction is cuda's.
        let meta = json(&memfit(&args("meta")));
        assert_eq!(meta["peak_bytes"], gpu["peak_bytes"], "{precision}");
        assert_eq!(meta["peak_breakdown"], gpu["peak_breakdown"], "{precision}");
    }
}

/// `memfit` on the emulated GPU of `capacity` bytes.
fn emulated_with(capacity: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(args)
        .env("MEMFIT_CUDA_EMULATE", capacity)
        .output()
        .expect("memfit runs")
}

/// ZeRO-Offload on the cuda backend: master weights, optimizer state and
/// gradient shards (and under zero3 the weight shard) in pinned,
/// device-mapped host memory that the kernels read and write. Losses as the
/// cpu backend's, device and host peaks (per rank and the node's) as meta
/// predicts, and the host-mapped buffers take none of the device's memory:
/// on a 3 MiB emulated GPU the run fits with its state on the host and not
/// without offload, and device plus host would not fit the device.
#[test]
fn emulated_gpu_offloads_like_cpu_with_the_peaks_meta_predicts() {
    for (sharding, offload, precision, capacity, tol) in [
        ("zero2", "optimizer", "fp32", "3MiB", 1e-4),
        ("zero3", "optimizer+params", "fp32", "3MiB", 1e-4),
        ("zero2", "optimizer", "bf16", "2GiB", 2e-2),
    ] {
        let what = format!("{sharding} {offload} {precision}");
        let args = |device: &'static str, offload: &'static str| {
            vec![
                "run",
                "--model",
                "llama-tiny",
                "--seq-len",
                "32",
                "--micro-batch",
                "2",
                "--steps",
                "3",
                "--format",
                "json",
                "--ranks",
                "2",
                "--sharding",
                sharding,
                "--offload",
                offload,
                "--precision",
                precision,
                "--device",
                device,
            ]
        };
        let cpu = memfit(&args("cpu", offload));
        assert!(cpu.status.success(), "{what} cpu: {}", stderr(&cpu));
        let gpu = emulated_with(capacity, &args("cuda", offload));
        assert!(gpu.status.success(), "{what} cuda: {}", stderr(&gpu));
        let meta = memfit(&args("meta", offload));
        assert!(meta.status.success(), "{what} meta: {}", stderr(&meta));
        let (cpu, gpu, meta) = (json(&cpu), json(&gpu), json(&meta));
        assert_eq!(gpu["device"], "cuda");
        assert_eq!(gpu["config"]["offload"], offload);
        let (lc, lg) = (losses(&cpu), losses(&gpu));
        assert_eq!(lc.len(), 3);
        assert_eq!(lc.len(), lg.len());
        for (c, g) in lc.iter().zip(&lg) {
            assert!(
                (c - g).abs() <= tol * c.abs(),
                "{what}: cpu {lc:?} cuda {lg:?}"
            );
        }
        // Eager attention: no workspace, so meta's cpu prediction is cuda's.
        assert_eq!(meta["peak_bytes"], gpu["peak_bytes"], "{what}");
        assert_eq!(gpu["peak_bytes"]["optimizer"], 0, "{what}");
        assert_eq!(
            meta["host"]["peak_bytes"], gpu["host"]["peak_bytes"],
            "{what}"
        );
        assert_eq!(
            meta["host"]["link_bytes_per_step"], gpu["host"]["link_bytes_per_step"],
            "{what}"
        );
        let ranks = gpu["ranks"].as_array().unwrap();
        assert_eq!(ranks.len(), 2);
        for (m, g) in meta["ranks"].as_array().unwrap().iter().zip(ranks) {
            assert_eq!(m["host_peak_bytes"], g["host_peak_bytes"], "{what}");
            assert_eq!(m["peak_bytes"], g["peak_bytes"], "{what}");
        }
        if capacity != "3MiB" {
            continue;
        }
        // The tight GPU: the ranks' device peaks fit it, device and host
        // together would not (so host-mapped memory took no device room),
        // and without offload the state does not fit on the device.
        let cap = 3u64 << 20;
        let both: u64 = ranks
            .iter()
            .map(|r| {
                r["peak_bytes"]["total"].as_u64().unwrap()
                    + r["host_peak_bytes"]["total"].as_u64().unwrap()
            })
            .sum();
        assert!(both > cap, "{what}: {both} bytes fit {cap} anyway");
        let on_device = emulated_with(capacity, &args("cuda", "none"));
        assert!(!on_device.status.success(), "{what}: fits without offload");
        assert!(
            stderr(&on_device).contains("out of memory"),
            "{what}: {}",
            stderr(&on_device)
        );
    }
}

#[test]
fn selftest_passes_on_the_emulated_gpu() {
    let out = emulated(&["selftest", "--steps", "2"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}\n{}", stderr(&out));
    assert!(text.contains("emulated GPU"), "{text}");
    assert!(text.contains("selftest passed"), "{text}");
    for part in [
        "ops: cuda against cpu",
        "training: cpu and cuda",
        "peaks: meta",
    ] {
        assert!(text.contains(part), "{part}: {text}");
    }
    assert!(!text.contains("FAIL"), "{text}");
}

/// A sweep on the (emulated) GPU: trials run on it as child processes, the
/// report names it as the run device, and predicted peaks (meta emulating
/// cuda) equal the measured ones.
#[test]
fn sweep_and_balance_run_on_the_emulated_gpu() {
    let dir = std::env::temp_dir().join(format!("memfit-cuda-sweep-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let recipe = dir.join("gpu.yaml");
    std::fs::write(
        &recipe,
        "model: gpt2-tiny\nhardware: t4\ndevice: cuda\nseq_len: 32\nglobal_batch: 4\ngrid:\n  micro_batch: [2, 4]\n  precision: [fp32]\n  checkpointing: [none]\n  attention: [eager, fused]\n  optimizer: [adamw]\n  sharding: [none]\n  gpus: [1]\n",
    )
    .unwrap();
    let out_dir = dir.join("out");
    let out = emulated(&[
        "sweep",
        recipe.to_str().unwrap(),
        "--out",
        out_dir.to_str().unwrap(),
        "--exhaustive",
        "--steps",
        "1",
        "--max-steps",
        "2",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("report.json")).unwrap())
            .unwrap();
    assert_eq!(report["run_device"]["kind"], "cuda");
    let desc = report["run_device"]["description"].as_str().unwrap();
    assert!(desc.contains("emulated GPU"), "{desc}");
    // This machine has no NVIDIA driver: the sweep goes on and says why.
    if !memfit::backend::cuda::real::driver_present() {
        let nvml = report["nvml"].as_str().unwrap_or_default();
        assert!(nvml.starts_with("no NVML: "), "{nvml}");
    }
    let trials = report["trials"].as_array().unwrap();
    assert_eq!(trials.len(), 4, "{report}");
    for t in trials {
        let m = &t["measured"];
        assert!(!m.is_null(), "{t}");
        assert_eq!(t["memory_error_pct"].as_f64(), Some(0.0), "{t}");
    }
    let _ = std::fs::remove_dir_all(&dir);

    let out = emulated(&[
        "balance",
        "--model",
        "gpt2-tiny",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--micro-batch",
        "2",
        "--seq-len",
        "32",
        "--device",
        "cuda",
        "--verify",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(text.contains("verified on cuda"), "{text}");
    assert_eq!(text.matches("(equal)").count(), 2, "{text}");
}

/// Sweeps `recipe` into `out_dir` on the emulated GPU, with the NVML double
/// scripted by `script`; the report.
fn nvml_sweep(
    recipe: &std::path::Path,
    out_dir: &std::path::Path,
    script: &std::path::Path,
) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args([
            "sweep",
            recipe.to_str().unwrap(),
            "--out",
            out_dir.to_str().unwrap(),
        ])
        .args(["--exhaustive", "--steps", "1", "--max-steps", "2"])
        .env("MEMFIT_CUDA_EMULATE", "2GiB")
        .env("MEMFIT_NVML_LIB", env!("MEMFIT_NVML_DOUBLE"))
        .env("NVML_DOUBLE_SCRIPT", script)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_str(&std::fs::read_to_string(out_dir.join("report.json")).unwrap()).unwrap()
}

/// A GPU sweep with NVML: each trial process's NVML peak is recorded next to
/// the tracked peak and the prediction (md and json), and `memfit check
/// --metric nvml` gates on it. NVML is the scripted double, whose `children`
/// directive reports every trial process the sweep spawns.
#[test]
fn gpu_sweep_records_each_trials_nvml_peak() {
    let double = env!("MEMFIT_NVML_DOUBLE");
    assert!(
        !double.is_empty(),
        "build.rs could not build the NVML double"
    );
    let dir = std::env::temp_dir().join(format!("memfit-cuda-nvml-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("nvml.script");
    std::fs::write(
        &script,
        "gpu 0 name \"NVIDIA H200\" total 150000000000 util 80\nchildren 0 734003200\n",
    )
    .unwrap();
    let recipe = dir.join("gpu.yaml");
    std::fs::write(
        &recipe,
        "model: gpt2-tiny\nhardware: h200-141gb\ndevice: cuda\nseq_len: 32\nglobal_batch: 2\ngrid:\n  micro_batch: [2]\n  precision: [fp32]\n  checkpointing: [none]\n  attention: [eager]\n  optimizer: [adamw]\n  sharding: [none]\n  gpus: [1]\n",
    )
    .unwrap();
    let out_dir = dir.join("out");
    let report = nvml_sweep(&recipe, &out_dir, &script);
    assert_eq!(report["nvml"], "NVML, driver 999.99.99", "{report}");
    let t = &report["trials"][0];
    assert_eq!(t["measured"]["nvml_peak_bytes"], 734003200, "{t}");
    assert!(t["nvml_error_pct"].as_f64().is_some(), "{t}");
    let md = std::fs::read_to_string(out_dir.join("report.md")).unwrap();
    assert!(
        md.contains("GPU memory: predicted, tracked and NVML"),
        "{md}"
    );
    assert!(md.contains("700.00 MiB"), "{md}");
    // The same report against itself passes on the NVML metric.
    let check = memfit(&[
        "check",
        out_dir.to_str().unwrap(),
        "--baseline",
        out_dir.to_str().unwrap(),
        "--metric",
        "nvml",
    ]);
    assert_eq!(check.status.code(), Some(0), "{}", stderr(&check));

    // NVML answers but never lists the trial (a container's pid namespace,
    // MIG): no NVML peak, and the report says why.
    std::fs::write(&script, "gpu 0 name \"NVIDIA H200\" total 150000000000\n").unwrap();
    let out_dir = dir.join("out2");
    let report = nvml_sweep(&recipe, &out_dir, &script);
    let nvml = report["nvml"].as_str().unwrap_or_default();
    assert!(
        nvml.contains("never appeared in NVML's process list"),
        "{nvml}"
    );
    assert!(report["trials"][0]["measured"]["nvml_peak_bytes"].is_null());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every rank's report carries what it tracked, what meta predicts for it
/// and, on a GPU with NVML, what NVML saw its process use: a run of one
/// rank, and each rank process of `memfit launch` (NVML is the scripted
/// double, which lists each process that loads it with the bytes given).
#[test]
fn each_rank_reports_tracked_predicted_and_nvml_peaks() {
    let double = env!("MEMFIT_NVML_DOUBLE");
    assert!(
        !double.is_empty(),
        "build.rs could not build the NVML double"
    );
    let dir = std::env::temp_dir().join(format!("memfit-rank-nvml-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("nvml.script");
    std::fs::write(
        &script,
        // Rank r of a launched job runs on GPU r (LOCAL_RANK).
        "gpu 0 name \"NVIDIA H200\" total 150000000000\ngpu 1 name \"NVIDIA H200\" total 150000000000\nself 0 734003200\nself 1 734003200\n",
    )
    .unwrap();
    let run = [
        "run",
        "--model",
        "gpt2-tiny",
        "--device",
        "cuda",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--steps",
        "2",
        "--format",
        "json",
    ];
    let go = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_memfit"))
            .args(args)
            .env("MEMFIT_CUDA_EMULATE", "2GiB")
            .env("MEMFIT_NVML_LIB", double)
            .env("NVML_DOUBLE_SCRIPT", &script)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        json(&out)
    };
    let one = go(&run);
    let launched = go(&[
        &["launch", "--nproc", "2", "--"][..],
        &run[..],
        &["--ranks", "2", "--sharding", "zero2"],
    ]
    .concat());
    for (doc, ranks) in [(&one, 1), (&launched, 2)] {
        let rs = doc["ranks"].as_array().unwrap();
        assert_eq!(rs.len(), ranks);
        for r in rs {
            assert_eq!(r["predicted_peak_bytes"], r["peak_bytes"]["total"], "{r}");
            assert_eq!(r["nvml_peak_bytes"], 734003200u64, "{r}");
        }
    }
    // Without NVML (the cpu): tracked and predicted only.
    let cpu = json(&memfit(&[
        "run",
        "--model",
        "gpt2-tiny",
        "--steps",
        "1",
        "--ranks",
        "2",
        "--sharding",
        "zero3",
        "--format",
        "json",
    ]));
    for r in cpu["ranks"].as_array().unwrap() {
        assert_eq!(r["predicted_peak_bytes"], r["peak_bytes"]["total"], "{r}");
        assert!(r.get("nvml_peak_bytes").is_none(), "{r}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
