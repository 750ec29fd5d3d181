//! `memfit calibrate --device cuda` (issue 28) on the emulated GPU, with a
//! scratch cache and a tiny ladder (`--max-dim 64`: the emulator runs
//! kernels on the host), and `memfit plan` on the profile it is bound to.

use std::path::Path;
use std::process::{Command, Output};

use crate::common::{json, scratch, stderr};
use serde_json::Value;

/// memfit on the emulated GPU, with `cache` as its cache.
fn emulated(cache: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(args)
        .env("MEMFIT_CUDA_EMULATE", "2GiB")
        .env("MEMFIT_CACHE_DIR", cache)
        .env_remove("MEMFIT_NO_GPU_CALIBRATION")
        .env_remove("COLUMNS")
        .output()
        .expect("memfit runs")
}

const CALIBRATE: &[&str] = &[
    "calibrate",
    "--device",
    "cuda",
    "--profile",
    "h100-sxm-80gb",
    "--max-dim",
    "64",
    "--threads",
    "2",
    "--format",
    "json",
];

fn positive(v: &Value, key: &str) -> f64 {
    let x = v[key].as_f64().unwrap_or_else(|| panic!("{key} in {v}"));
    assert!(x.is_finite() && x > 0.0, "{key} = {x}");
    x
}

/// Measures, stores, and reuses: every figure positive, the GEMM ladder
/// within --max-dim for each dtype, the file named from the GPU.
#[test]
fn calibrate_cuda_measures_stores_and_reuses_the_gpus_curves() {
    let cache = scratch("store");
    let out = emulated(&cache, CALIBRATE);
    assert!(out.status.success(), "{}", stderr(&out));
    let c = json(&out);
    assert_eq!(c["gpu"], "emulated GPU");
    assert_eq!(c["profile"], "h100-sxm-80gb");
    assert_eq!(c["max_dim"], 64);
    positive(&c, "bytes_per_s");
    positive(&c, "op_overhead_s");
    let gemm = c["gemm"].as_array().unwrap();
    for dtype in ["fp32", "bf16", "fp16"] {
        let of: Vec<&Value> = gemm.iter().filter(|p| p["dtype"] == dtype).collect();
        assert!(of.len() >= 5, "{dtype}: {of:?}");
        for p in of {
            let rate = positive(p, "flops_per_s");
            let (m, n, k) = (
                p["m"].as_u64().unwrap(),
                p["n"].as_u64().unwrap(),
                p["k"].as_u64().unwrap(),
            );
            assert!(m.max(n).max(k) <= 64, "{p}");
            assert_eq!(p["flops"].as_u64().unwrap(), 2 * m * n * k);
            assert!((rate * positive(p, "seconds") / (2 * m * n * k) as f64 - 1.0).abs() < 1e-9);
        }
    }
    let attention = c["attention"].as_array().unwrap();
    // Two lengths at each of the head dims profiles publish (128, 64).
    assert_eq!(attention.len(), 4, "{attention:?}");
    for (i, p) in attention.iter().enumerate() {
        positive(p, "flops_per_s");
        assert_eq!(p["head_dim"], [128, 64][i % 2], "{p}");
    }
    let file = cache.join("gpu-emulated-gpu.json");
    let stored: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(stored, c);
    // Again: the stored figures, not a new measurement; --force measures.
    let again = emulated(&cache, CALIBRATE);
    assert!(again.status.success(), "{}", stderr(&again));
    assert_eq!(json(&again), c);
    let table = emulated(&cache, &CALIBRATE[..CALIBRATE.len() - 2]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(
        text.contains("cached in") && text.contains("h100-sxm-80gb"),
        "{text}"
    );
    let forced = emulated(&cache, &[CALIBRATE, &["--force"]].concat());
    assert!(forced.status.success(), "{}", stderr(&forced));
    assert_ne!(json(&forced)["measured_unix_s"], Value::Null);
    assert_ne!(json(&forced)["elapsed_s"], c["elapsed_s"]);
    let _ = std::fs::remove_dir_all(&cache);
}

/// A plan on the bound profile prices its steps with the measurement and
/// says so; MEMFIT_NO_GPU_CALIBRATION=1 gives the profile's figures back.
#[test]
fn a_plan_on_the_calibrated_profile_uses_the_measured_curves() {
    let cache = scratch("plan");
    assert!(emulated(&cache, CALIBRATE).status.success());
    let recipe = Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes/llama-8b-8xh100.yaml");
    let plan = |extra: &[(&str, &str)], format: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_memfit"));
        c.args(["plan", recipe.to_str().unwrap(), "--format", format])
            .env("MEMFIT_CACHE_DIR", &cache)
            .env_remove("MEMFIT_NO_GPU_CALIBRATION")
            .env_remove("COLUMNS")
            .envs(extra.iter().copied());
        c.output().expect("memfit runs")
    };
    let measured = plan(&[], "table");
    // The table wraps its lines: compare with its words rejoined.
    let words = |o: &Output| {
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        text.split_whitespace().collect::<Vec<_>>().join(" ")
    };
    let text = words(&measured);
    assert!(
        text.contains("roofline measured on emulated GPU by `memfit calibrate --device cuda` on"),
        "{text}"
    );
    assert!(!text.contains("of peak FLOP/s"), "{text}");
    let off = plan(&[("MEMFIT_NO_GPU_CALIBRATION", "1")], "table");
    assert!(words(&off).contains("of peak FLOP/s"));
    let step = |doc: &Value| doc["points"][0]["step_s"].as_f64().unwrap();
    let on = json(&plan(&[], "json"));
    let off = json(&plan(&[("MEMFIT_NO_GPU_CALIBRATION", "1")], "json"));
    assert_eq!(on["hardware"]["measured"]["gpu"], "emulated GPU");
    assert_eq!(on["hardware"]["measured"]["profile"], "h100-sxm-80gb");
    assert!(
        off["hardware"].get("measured").is_none(),
        "{}",
        off["hardware"]
    );
    // The emulated GPU is thousands of times slower than an H100.
    assert!(
        step(&on) > 100.0 * step(&off),
        "{} vs {}",
        step(&on),
        step(&off)
    );
    // Another profile's plan does not take it.
    let other = Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes/gpt2-rtx4090.yaml");
    let mut c = Command::new(env!("CARGO_BIN_EXE_memfit"));
    let out = c
        .args(["plan", other.to_str().unwrap(), "--format", "json"])
        .env("MEMFIT_CACHE_DIR", &cache)
        .env_remove("MEMFIT_NO_GPU_CALIBRATION")
        .output()
        .unwrap();
    assert!(json(&out)["hardware"].get("measured").is_none());
    let _ = std::fs::remove_dir_all(&cache);
}

/// Without --profile, a GPU no built-in profile matches is still measured
/// and stored, and the output says no plan uses it until one is named.
#[test]
fn an_unmatched_gpu_is_stored_and_said_to_be_unused() {
    let cache = scratch("unbound");
    let out = emulated(
        &cache,
        &[
            "calibrate",
            "--device",
            "cuda",
            "--max-dim",
            "16",
            "--threads",
            "2",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("no plan uses this calibration until one is named"),
        "{text}"
    );
    assert!(cache.join("gpu-emulated-gpu.json").exists());
    let _ = std::fs::remove_dir_all(&cache);
}

/// Bad input: one paragraph naming the flag, exit 2, no panic.
#[test]
fn calibrate_refuses_meta_a_limit_and_a_profile_without_cuda() {
    let cache = scratch("errors");
    for (args, flag) in [
        (vec!["calibrate", "--device", "meta"], "--device"),
        (vec!["calibrate", "--device", "cuda:limit=1GiB"], "--device"),
        (vec!["calibrate", "--profile", "h100-sxm-80gb"], "--profile"),
        (
            vec!["calibrate", "--device", "cuda", "--profile", "no-such-gpu"],
            "no-such-gpu",
        ),
        (
            vec!["calibrate", "--device", "cuda", "--max-dim", "8"],
            "--max-dim",
        ),
    ] {
        let out = emulated(&cache, &args);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(flag) && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&cache);
}

/// No GPU and no emulation: the cuda backend's one clear error, no panic.
#[test]
fn calibrate_cuda_without_a_gpu_is_the_clear_no_cuda_error() {
    if memfit::backend::cuda::real::driver_present() {
        eprintln!("skipped: this machine has a CUDA driver");
        return;
    }
    let cache = scratch("nogpu");
    let out = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .args(["calibrate", "--device", "cuda"])
        .env_remove("MEMFIT_CUDA_EMULATE")
        .env("MEMFIT_CACHE_DIR", &cache)
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(!out.status.success() && !err.contains("panicked"), "{err}");
    assert!(err.to_lowercase().contains("cuda"), "{err}");
    assert!(!cache.join("gpu-emulated-gpu.json").exists());
    let _ = std::fs::remove_dir_all(&cache);
}
