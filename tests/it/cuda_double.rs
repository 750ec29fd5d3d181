//! The real GPU path (cudarc: driver API, NVRTC, cuBLAS, NCCL), not the
//! emulated driver, run through the C-level double of the CUDA driver,
//! cuBLAS and NCCL (`tests/cuda_double`, built by build.rs as
//! `libcuda.so.1`, `libcublas.so.13`, `libcublasLt.so.13`, `libnccl.so.2`)
//! and the real NVRTC from its PyPI wheel; and `memfit doctor` against the
//! wheels' layouts. CI installs the CUDA 12 and 13 NVRTC wheels and NCCL's
//! and sets MEMFIT_REQUIRE_NVRTC, so a missing piece fails there;
//! elsewhere these tests say what they skipped.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::{comparable, json, losses, stderr};
use memfit::backend::cuda::libs;
use serde_json::Value;

const DOUBLE: &str = env!("MEMFIT_CUDA_DOUBLE");

fn required() -> bool {
    std::env::var_os("MEMFIT_REQUIRE_NVRTC").is_some()
}

/// The double's folder, when NVRTC can be found too (else skip, or fail
/// under MEMFIT_REQUIRE_NVRTC).
fn double() -> Option<&'static str> {
    assert!(
        !DOUBLE.is_empty() || !required(),
        "the CUDA double was not built (see the build warnings)"
    );
    let nvrtc = libs::find_all(&libs::search_dirs(), None)
        .into_iter()
        .any(|f| f.lib == libs::Lib::Nvrtc && f.path.is_some());
    assert!(
        nvrtc || !required(),
        "MEMFIT_REQUIRE_NVRTC is set but no NVRTC was found"
    );
    if DOUBLE.is_empty() || !nvrtc {
        eprintln!("skipped: the CUDA double or NVRTC is missing");
        return None;
    }
    Some(DOUBLE)
}

/// memfit with the double as the machine's NVIDIA stack.
fn on_double(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_memfit"));
    for v in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "MEMFIT_CUDA_EMULATE",
        libs::READY_ENV,
    ] {
        c.env_remove(v);
    }
    c.env(libs::LIBS_ENV, DOUBLE)
        .args(args)
        .envs(env.iter().copied());
    c.output().expect("memfit runs")
}

fn memfit_plain(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memfit"))
        .env_remove("MEMFIT_CUDA_EMULATE")
        .args(args)
        .output()
        .expect("memfit runs")
}

fn train_args<'a>(model: &'a str, device: &'a str) -> Vec<&'a str> {
    vec![
        "run",
        "--model",
        model,
        "--device",
        device,
        "--steps",
        "2",
        "--micro-batch",
        "2",
        "--seq-len",
        "32",
        "--format",
        "json",
    ]
}

/// gpt2-tiny and llama-tiny on cudarc's real path: the double reports its
/// name (so it was not the emulated driver), the losses are cpu's to
/// rounding and the tracked peaks are meta's, byte for byte.
#[test]
fn the_real_driver_path_trains_like_cpu_with_the_peaks_meta_predicts() {
    if double().is_none() {
        return;
    }
    for model in ["gpt2-tiny", "llama-tiny"] {
        let gpu = on_double(&train_args(model, "cuda"), &[]);
        assert!(gpu.status.success(), "{model}: {}", stderr(&gpu));
        let gpu = json(&gpu);
        let desc = gpu["gpu"]["description"].as_str().unwrap_or_default();
        assert!(desc.contains("memfit CUDA double"), "{model}: {desc}");
        let cpu = json(&memfit_plain(&train_args(model, "cpu")));
        let (lc, lg) = (losses(&cpu), losses(&gpu));
        assert_eq!(lc.len(), lg.len());
        for (c, g) in lc.iter().zip(&lg) {
            assert!(
                (c - g).abs() <= 1e-4 * c.abs(),
                "{model}: cpu {lc:?} cuda {lg:?}"
            );
        }
        let meta = json(&memfit_plain(&train_args(model, "meta")));
        assert_eq!(meta["peak_bytes"], gpu["peak_bytes"], "{model}");
    }
}

/// `memfit launch --nproc 2` with NCCL (the double's, over shared memory
/// between the two rank processes, one GPU each) against the same two ranks
/// on threads: every loss and every rank's peak, bit for bit.
#[test]
fn nccl_ranks_match_threaded_ranks_bit_for_bit() {
    if double().is_none() {
        return;
    }
    let env = [
        ("MEMFIT_CUDA_DOUBLE_DEVICES", "2"),
        ("MEMFIT_DIST_BACKEND", "nccl"),
    ];
    for sharding in ["ddp", "zero2"] {
        let mut run = train_args("gpt2-tiny", "cuda");
        run.extend(["--ranks", "2", "--sharding", sharding]);
        let threaded = on_double(&run, &env);
        assert!(
            threaded.status.success(),
            "{sharding}: {}",
            stderr(&threaded)
        );
        let mut launch = vec!["launch", "--nproc", "2", "--"];
        launch.extend(&run);
        let launched = on_double(&launch, &env);
        assert!(
            launched.status.success(),
            "{sharding}: {}",
            stderr(&launched)
        );
        let (t, l) = (json(&threaded), json(&launched));
        assert_eq!(losses(&t), losses(&l), "{sharding}");
        assert_eq!(comparable(&t), comparable(&l), "{sharding}");
    }
}

#[test]
fn selftest_passes_on_the_real_driver_path() {
    if double().is_none() {
        return;
    }
    let out = on_double(&["selftest", "--steps", "2"], &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}\n{}", stderr(&out));
    assert!(text.contains("memfit CUDA double"), "{text}");
    assert!(text.contains("selftest passed"), "{text}");
}

/// `memfit calibrate --device cuda` on cudarc's real path (tiny ladder,
/// scratch cache): the double's GPU name keys the file, and every figure is
/// positive.
#[test]
fn calibrate_measures_the_double_through_the_real_driver_path() {
    if double().is_none() {
        return;
    }
    let cache = std::env::temp_dir().join(format!("memfit-gcal-double-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let args = [
        "calibrate",
        "--device",
        "cuda",
        "--profile",
        "h100-sxm-80gb",
        "--max-dim",
        "32",
        "--format",
        "json",
    ];
    let out = on_double(&args, &[("MEMFIT_CACHE_DIR", cache.to_str().unwrap())]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let c = json(&out);
    let gpu = c["gpu"].as_str().unwrap_or_default();
    assert!(gpu.contains("memfit CUDA double"), "{gpu}");
    let rates = (c["gemm"].as_array().unwrap().iter())
        .chain(c["attention"].as_array().unwrap())
        .map(|p| p["flops_per_s"].as_f64().unwrap());
    assert!(
        rates
            .chain([c["bytes_per_s"].as_f64().unwrap()])
            .all(|r| r > 0.0)
    );
    let stored = std::fs::read_dir(&cache).unwrap().count();
    assert_eq!(stored, 1, "one file for the GPU");
    let _ = std::fs::remove_dir_all(&cache);
}

fn doctor(env: &[(&str, &str)], unset: &[&str]) -> (Option<i32>, Value) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_memfit"));
    for v in unset.iter().chain(&[libs::READY_ENV]) {
        c.env_remove(v);
    }
    let out = c
        .args(["doctor", "--format", "json"])
        .envs(env.iter().copied())
        .output()
        .expect("memfit runs");
    (out.status.code(), json(&out))
}

fn lib<'a>(doc: &'a Value, name: &str) -> &'a Value {
    doc["libraries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == name)
        .unwrap_or_else(|| panic!("{name} in {doc}"))
}

/// The wheels' folders in python3's site-packages: (cu13 lib, cu12 NVRTC
/// lib, NCCL lib), each when installed.
fn wheels() -> (Option<PathBuf>, Option<PathBuf>, Option<PathBuf>) {
    let mut out = (None, None, None);
    for sp in libs::python_site_packages() {
        let nv = sp.join("nvidia");
        let has = |d: &Path, f: &str| d.join(f).is_file().then(|| d.to_path_buf());
        out.0 = out.0.or(has(&nv.join("cu13/lib"), "libnvrtc.so.13"));
        out.1 = out.1.or(has(&nv.join("cuda_nvrtc/lib"), "libnvrtc.so.12"));
        out.2 = out.2.or(has(&nv.join("nccl/lib"), "libnccl.so.2"));
    }
    out
}

/// Which wheel folder a layout puts first.
#[derive(Clone, Copy)]
enum Layout {
    Cu13OnLdLibraryPath,
    Cu13InMemfitCudaLibs,
    Cu12OnLdLibraryPath,
}

/// One layout of the issue: the CUDA 13 (or 12) NVRTC wheel's lib folder
/// and the NCCL wheel's, on LD_LIBRARY_PATH or in MEMFIT_CUDA_LIBS; doctor
/// finds each from that folder, says so, names its version, and cudarc
/// then loads it.
fn doctor_layout(layout: Layout) {
    let (cu13, cu12, nccl) = wheels();
    if cu13.is_none() || cu12.is_none() || nccl.is_none() {
        assert!(
            !required(),
            "MEMFIT_REQUIRE_NVRTC is set but the CUDA 12/13 NVRTC and NCCL wheels are not all installed: {:?}",
            wheels()
        );
        eprintln!("skipped: the NVRTC and NCCL wheels are not installed");
        return;
    }
    let (cu13, cu12, nccl) = (cu13.unwrap(), cu12.unwrap(), nccl.unwrap());
    let (var, dir, major) = match layout {
        Layout::Cu13OnLdLibraryPath => ("LD_LIBRARY_PATH", &cu13, "13."),
        Layout::Cu13InMemfitCudaLibs => (libs::LIBS_ENV, &cu13, "13."),
        Layout::Cu12OnLdLibraryPath => ("LD_LIBRARY_PATH", &cu12, "12."),
    };
    let unset = if var == "LD_LIBRARY_PATH" {
        libs::LIBS_ENV
    } else {
        "LD_LIBRARY_PATH"
    };
    let value = format!("{}:{}", dir.display(), nccl.display());
    let (code, doc) = doctor(&[(var, &value)], &[unset]);
    let nvrtc = lib(&doc, "NVRTC");
    let path = nvrtc["path"].as_str().unwrap_or_default();
    assert!(
        path.starts_with(&dir.display().to_string()),
        "{var}: {nvrtc}"
    );
    assert_eq!(nvrtc["source"], var, "{nvrtc}");
    assert!(
        nvrtc["version"]
            .as_str()
            .unwrap_or_default()
            .starts_with(major),
        "{var}: {nvrtc}"
    );
    assert_eq!(nvrtc["loads"], true, "{var}: {nvrtc}");
    let n = lib(&doc, "NCCL");
    assert!(
        n["path"]
            .as_str()
            .unwrap_or_default()
            .ends_with("libnccl.so.2"),
        "{n}"
    );
    assert_eq!(n["source"], var, "{n}");
    assert!(
        n["version"].as_str().unwrap_or_default().starts_with("2."),
        "{n}"
    );
    assert_eq!(n["loads"], true, "{var}: {n}");
    // No driver on a CI machine: not ready, and it says so.
    if !memfit::backend::cuda::real::driver_present() {
        assert_eq!(code, Some(1), "{doc}");
        let missing = doc["missing"].to_string();
        assert!(missing.contains("libcuda.so.1"), "{missing}");
    }
}

#[test]
fn doctor_finds_the_cuda_13_wheels_on_ld_library_path() {
    doctor_layout(Layout::Cu13OnLdLibraryPath);
}

#[test]
fn doctor_finds_the_cuda_13_wheels_through_memfit_cuda_libs() {
    doctor_layout(Layout::Cu13InMemfitCudaLibs);
}

#[test]
fn doctor_finds_the_cuda_12_wheels_on_ld_library_path() {
    doctor_layout(Layout::Cu12OnLdLibraryPath);
}

/// A CUDA 12.4 driver: NVRTC 13 is passed over (its code would not load)
/// for NVRTC 12, and doctor says which file it passed over.
#[test]
fn a_cuda_12_driver_gets_nvrtc_12() {
    let (Some(cu13), Some(cu12), _) = wheels() else {
        assert!(
            !required(),
            "MEMFIT_REQUIRE_NVRTC: the NVRTC wheels are missing"
        );
        return;
    };
    if double().is_none() {
        return;
    }
    let dirs = format!("{DOUBLE}:{}:{}", cu13.display(), cu12.display());
    let out = on_double(
        &["doctor", "--format", "json"],
        &[
            (libs::LIBS_ENV, &dirs),
            ("MEMFIT_CUDA_DOUBLE_DRIVER", "12040"),
        ],
    );
    let doc = json(&out);
    assert_eq!(doc["driver_cuda"], "12.4", "{doc}");
    let nvrtc = lib(&doc, "NVRTC");
    assert!(
        nvrtc["version"]
            .as_str()
            .unwrap_or_default()
            .starts_with("12."),
        "{nvrtc}"
    );
    assert!(
        nvrtc["path"]
            .as_str()
            .unwrap_or_default()
            .starts_with(&cu12.display().to_string()),
        "{nvrtc}"
    );
}

/// A GPU newer than NVRTC knows (the double as sm_150): the kernels go to
/// the driver as PTX for the newest architecture NVRTC has, which a CUDA 13
/// driver accepts from NVRTC 12, and training runs on it.
#[test]
fn a_gpu_newer_than_nvrtc_trains_from_ptx() {
    let (_, Some(cu12), _) = wheels() else {
        assert!(
            !required(),
            "MEMFIT_REQUIRE_NVRTC: the CUDA 12 NVRTC wheel is missing"
        );
        return;
    };
    if double().is_none() {
        return;
    }
    let dirs = format!("{DOUBLE}:{}", cu12.display());
    let args = [
        "run",
        "--model",
        "gpt2-tiny",
        "--device",
        "cuda",
        "--steps",
        "1",
        "--micro-batch",
        "1",
        "--seq-len",
        "16",
        "--format",
        "json",
    ];
    let out = on_double(
        &args,
        &[(libs::LIBS_ENV, &dirs), ("MEMFIT_CUDA_DOUBLE_CC", "15.0")],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let doc = json(&out);
    assert!(
        doc["gpu"]["description"]
            .as_str()
            .unwrap_or_default()
            .contains("sm_150"),
        "{doc}"
    );
}

/// With the double as the driver, doctor lists its GPU and is ready.
#[test]
fn doctor_is_ready_on_the_double() {
    if double().is_none() {
        return;
    }
    let out = on_double(&["doctor", "--format", "json"], &[]);
    let doc = json(&out);
    assert_eq!(out.status.code(), Some(0), "{doc}");
    assert_eq!(doc["driver_cuda"], "13.0", "{doc}");
    assert_eq!(doc["gpus"][0]["compute_capability"], "9.0", "{doc}");
    assert_eq!(lib(&doc, "cuBLAS")["version"], "13.1.0", "{doc}");
    let text = on_double(&["doctor"], &[]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("ready: --device cuda has everything"),
        "{text}"
    );
}

// ---- the double itself refuses what a driver refuses

type CuInit = unsafe extern "C" fn(u32) -> i32;
type CuAlloc = unsafe extern "C" fn(*mut u64, usize) -> i32;
type CuFree = unsafe extern "C" fn(u64) -> i32;
type CuRetain = unsafe extern "C" fn(*mut usize, i32) -> i32;
type CuSetCurrent = unsafe extern "C" fn(usize) -> i32;
type CuLoad = unsafe extern "C" fn(*mut usize, *const u8) -> i32;
type CuGetFn = unsafe extern "C" fn(*mut usize, usize, *const i8) -> i32;
type CuLaunch = unsafe extern "C" fn(
    usize,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    usize,
    *mut *mut std::ffi::c_void,
    *mut *mut std::ffi::c_void,
) -> i32;
type CuHtoD = unsafe extern "C" fn(u64, *const u8, usize) -> i32;

#[test]
fn the_double_fails_loudly_on_what_a_real_driver_rejects() {
    if DOUBLE.is_empty() {
        assert!(!required(), "the CUDA double was not built");
        return;
    }
    // Kernel names as a module holds them; the double runs the real ones.
    let kernel = memfit::backend::cuda::driver::KERNELS[0].name;
    // SAFETY: the double is loaded by path and called with the CUDA
    // driver API's signatures.
    unsafe {
        let l = libloading::Library::new(Path::new(DOUBLE).join("libcuda.so.1")).unwrap();
        let init: libloading::Symbol<CuInit> = l.get(b"cuInit").unwrap();
        let alloc: libloading::Symbol<CuAlloc> = l.get(b"cuMemAlloc_v2").unwrap();
        let free: libloading::Symbol<CuFree> = l.get(b"cuMemFree_v2").unwrap();
        let retain: libloading::Symbol<CuRetain> = l.get(b"cuDevicePrimaryCtxRetain").unwrap();
        let set: libloading::Symbol<CuSetCurrent> = l.get(b"cuCtxSetCurrent").unwrap();
        let load: libloading::Symbol<CuLoad> = l.get(b"cuModuleLoadData").unwrap();
        let getfn: libloading::Symbol<CuGetFn> = l.get(b"cuModuleGetFunction").unwrap();
        let launch: libloading::Symbol<CuLaunch> = l.get(b"cuLaunchKernel").unwrap();
        let htod: libloading::Symbol<CuHtoD> = l.get(b"cuMemcpyHtoD_v2").unwrap();
        let mut p = 0u64;
        assert_eq!(
            alloc(&mut p, 64),
            3,
            "before cuInit: CUDA_ERROR_NOT_INITIALIZED"
        );
        assert_eq!(init(0), 0);
        assert_eq!(
            alloc(&mut p, 64),
            201,
            "no context: CUDA_ERROR_INVALID_CONTEXT"
        );
        let mut ctx = 0usize;
        assert_eq!(retain(&mut ctx, 0), 0);
        assert_eq!(set(ctx), 0);
        assert_eq!(alloc(&mut p, 64), 0);
        let bytes = [1u8; 64];
        assert_eq!(htod(p, bytes.as_ptr(), 65), 1, "a copy past the allocation");
        assert_eq!(free(p), 0);
        assert_eq!(free(p), 1, "a double free");
        assert_eq!(htod(p, bytes.as_ptr(), 8), 1, "a copy into freed memory");
        // PTX newer than the driver (CUDA 13.0 reads PTX 9.0 at most).
        let ptx = |version: &str, sm: u32, name: &str| {
            format!(
                ".version {version}\n.target sm_{sm}\n.address_size 64\n.visible .entry {name}(\n)\n{{ ret; }}\n\0"
            )
        };
        let mut m = 0usize;
        assert_eq!(load(&mut m, ptx("9.9", 90, kernel).as_ptr()), 222);
        assert_eq!(
            load(&mut m, ptx("8.0", 100, kernel).as_ptr()),
            209,
            "PTX for a newer GPU"
        );
        assert_eq!(load(&mut m, ptx("8.0", 80, "no_such_kernel").as_ptr()), 200);
        assert_eq!(load(&mut m, ptx("8.0", 80, kernel).as_ptr()), 0);
        let mut f = 0usize;
        let missing = std::ffi::CString::new("no_such_kernel").unwrap();
        assert_eq!(getfn(&mut f, m, missing.as_ptr()), 500);
        let name = std::ffi::CString::new(kernel).unwrap();
        assert_eq!(getfn(&mut f, m, name.as_ptr()), 0);
        // Launch limits, before any parameter is read.
        let mut params: [*mut std::ffi::c_void; 0] = [];
        let np = params.as_mut_ptr();
        let null = std::ptr::null_mut();
        assert_eq!(
            launch(f, 1, 1, 1, 2048, 1, 1, 0, 0, np, null),
            1,
            "2048 threads"
        );
        assert_eq!(
            launch(f, 1, 70000, 1, 32, 1, 1, 0, 0, np, null),
            1,
            "grid y"
        );
        assert_eq!(
            launch(f, 1, 1, 1, 32, 1, 1, 64 << 10, 0, np, null),
            1,
            "shared memory"
        );
        assert_eq!(
            launch(f + 8, 1, 1, 1, 32, 1, 1, 0, 0, np, null),
            400,
            "not a function"
        );
        assert_eq!(set(0), 0);
        assert_eq!(
            launch(f, 1, 1, 1, 32, 1, 1, 0, 0, np, null),
            201,
            "no context"
        );
    }
}

// ---- NCCL's point-to-point: all-to-all on ranks in threads of a child

const NCCL_CHILD_ENV: &str = "MEMFIT_TEST_NCCL_CHILD";

/// Runs this binary's `nccl_child` test in a child whose loader finds the
/// double as the machine's NVIDIA stack (`libs::prepare`, as memfit
/// arranges it for itself) with four GPUs; kills it if it has not finished
/// in two minutes. Its output, once it passed.
fn run_nccl_child(mode: &str) -> String {
    use std::io::Read;
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            // The test's name in the `it` binary, module path and all.
            "cuda_double::nccl_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(NCCL_CHILD_ENV, mode)
        .env(libs::LIBS_ENV, DOUBLE)
        .env("MEMFIT_CUDA_DOUBLE_DEVICES", "4")
        .env("MEMFIT_NCCL_DOUBLE_TIMEOUT", "60")
        .env_remove(libs::READY_ENV)
        .env_remove("MEMFIT_CUDA_EMULATE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            s
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = format!("{}{}", out.join().unwrap(), err.join().unwrap());
    let status = status.unwrap_or_else(|| panic!("child {mode} hung:\n{text}"));
    assert!(status.success(), "child {mode} failed:\n{text}");
    assert!(text.contains(&format!("nccl child {mode} ok")), "{text}");
    text
}

/// NCCL's all-to-all (a group of `ncclSend`/`ncclRecv`, `NcclComm`) on 2
/// and 4 ranks, in f32 and bf16, with uneven counts, zero counts, sends to
/// self and parts larger than the double's channel buffer: each rank gets
/// what each rank sent it, in source-rank order, as `CpuComm` delivers it
/// (`all_to_all_delivers_each_pair_its_part` in `backend/cpu/comm.rs`),
/// and nothing past its part. The two staged comms on the same buffers
/// (TCP between the rank processes, `MEMFIT_DIST_BACKEND=tcp`, and ranks
/// sharing one GPU) deliver the same.
#[test]
fn nccl_all_to_all_delivers_each_pair_its_part_on_the_double() {
    if double().is_some() {
        run_nccl_child("all_to_all");
    }
}

/// Ranks that disagree on a pair's count (an engine bug): NCCL leaves that
/// undefined; the double fails the group with ncclInvalidUsage, `NcclComm`
/// fails the job with NCCL's word, nobody waits for the timeout, and the
/// receiver's buffer is untouched.
#[test]
fn nccl_all_to_all_with_mismatched_counts_fails_instead_of_hanging() {
    if double().is_none() {
        return;
    }
    let text = run_nccl_child("mismatch");
    assert!(
        text.contains("a send and its receive must have the same count and type"),
        "{text}"
    );
}

/// The double's groups and point-to-point calls, through cudarc's loader
/// (so by NCCL's exported names): groups nest and only the outermost
/// `ncclGroupEnd` runs them; a pair's sends meet its receives in posting
/// order; a call outside a group is a group of its own; misuse returns
/// NCCL's error codes at once instead of hanging.
#[test]
fn the_nccl_double_groups_sends_and_receives_as_nccl_does() {
    if DOUBLE.is_empty() {
        assert!(!required(), "the CUDA double was not built");
        return;
    }
    run_nccl_child("groups");
}

/// The child of the three tests above; does nothing in a plain test run.
#[test]
fn nccl_child() {
    let Ok(mode) = std::env::var(NCCL_CHILD_ENV) else {
        return;
    };
    libs::prepare();
    match mode.as_str() {
        "all_to_all" => nccl::all_to_all(),
        "mismatch" => nccl::mismatch(),
        "groups" => nccl::groups(),
        other => panic!("no child mode {other}"),
    }
    println!("nccl child {mode} ok");
}

mod nccl {
    use std::net::TcpListener;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use memfit::backend::cpu::process::ProcessComm;
    use memfit::backend::cuda::comm::{CudaComm, Staged};
    use memfit::backend::cuda::driver::Driver;
    use memfit::backend::cuda::nccl::{NcclComm, unique_id};
    use memfit::backend::cuda::{self, AnyDriver, CudaBackend, CudaBuf};
    use memfit::backend::{Backend, DType};
    use memfit::comm::Collective;
    use memfit::comm::process::{DistEnv, ProcessGroup};

    const TIMEOUT: Duration = Duration::from_secs(60);
    /// Elements past each buffer's part, which no all-to-all may touch.
    const PAST: usize = 3;

    /// `f(group, backend, nccl_id)` on `world` ranks, each a thread with
    /// its own GPU of the double and a TCP process group as `memfit launch`
    /// makes them; the results in rank order.
    fn on_ranks<R: Send>(
        world: usize,
        f: impl Fn(&Arc<ProcessGroup>, &mut CudaBackend<AnyDriver>, &[u8]) -> R + Sync,
    ) -> Vec<R> {
        let id = unique_id().expect("the double's NCCL");
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let mut l = Some(l);
        std::thread::scope(|s| {
            let ranks: Vec<_> = (0..world)
                .map(|rank| {
                    let listener = if rank == 0 { l.take() } else { None };
                    let (f, id) = (&f, id.clone());
                    s.spawn(move || {
                        let env = DistEnv {
                            rank,
                            world,
                            local_rank: rank,
                            local_world: world,
                            master_addr: "127.0.0.1".into(),
                            master_port: port,
                            port_var: "MASTER_PORT",
                            port_source: format!("MASTER_PORT={port}"),
                            timeout: TIMEOUT,
                        };
                        let (group, blob) =
                            ProcessGroup::connect_with(&env, listener, || Ok(id)).unwrap();
                        let mut backend = cuda::open(rank, 1).unwrap();
                        let out = f(&group, &mut backend, &blob);
                        // The end of a job, as `launch` ends it: nobody
                        // closes while another rank may still receive.
                        group.gather_to_root(Vec::new());
                        group.release(0);
                        out
                    })
                })
                .collect();
            ranks.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Element `i` of what rank `s` sends rank `d`: exact in `dtype`, and
    /// naming its pair (and, in f32, its place in the part).
    fn value(dtype: DType, s: usize, d: usize, i: usize) -> f32 {
        match dtype {
            DType::F32 => (s * 4_000_000 + d * 1_000_000 + i % 1_000_000) as f32,
            _ => (s * 64 + d * 16 + i % 16) as f32,
        }
    }

    /// Rank `me`'s send buffer: its part for each rank in rank order, then
    /// `PAST` elements that must not travel.
    fn sends(dtype: DType, counts: &[usize], world: usize, me: usize) -> Vec<f32> {
        let mut v: Vec<f32> = (0..world)
            .flat_map(|d| (0..counts[me * world + d]).map(move |i| value(dtype, me, d, i)))
            .collect();
        v.extend([7.0; PAST]);
        v
    }

    /// What rank `me` must hold after the all-to-all: what each rank sent
    /// it, in source-rank order, and the untouched sentinels past it.
    fn wanted(dtype: DType, counts: &[usize], world: usize, me: usize) -> Vec<f32> {
        let mut v: Vec<f32> = (0..world)
            .flat_map(|s| (0..counts[s * world + me]).map(move |i| value(dtype, s, me, i)))
            .collect();
        v.extend([-1.0; PAST]);
        v
    }

    /// Buffers on `backend` for rank `me`: (send, receive full of -1).
    fn buffers(
        backend: &mut CudaBackend<AnyDriver>,
        dtype: DType,
        counts: &[usize],
        world: usize,
        me: usize,
    ) -> (CudaBuf, CudaBuf) {
        let send = sends(dtype, counts, world, me);
        let recv = wanted(dtype, counts, world, me).len();
        let mut inp = backend.alloc(send.len(), dtype);
        backend.upload_f32(&mut inp, &send);
        let mut out = backend.alloc(recv, dtype);
        backend.upload_f32(&mut out, &vec![-1.0; recv]);
        (inp, out)
    }

    /// One all-to-all of `counts` through `comm`; the receive buffer after.
    fn exchange(
        backend: &mut CudaBackend<AnyDriver>,
        comm: &mut dyn Collective<CudaBuf>,
        counts: &[usize],
        dtype: DType,
    ) -> Vec<f32> {
        let (world, me) = (comm.world(), comm.rank());
        let (inp, mut out) = buffers(backend, dtype, counts, world, me);
        comm.all_to_all(&mut out, &inp, counts);
        let got = backend.download_f32(&out).unwrap();
        backend.free(inp);
        backend.free(out);
        got
    }

    /// `counts[s * world + d]`: uneven, with zero parts, zero and non-zero
    /// sends to self, and parts of several chunks of the double's channel
    /// buffer (1 MiB over the ranks) in both types.
    fn counts(world: usize) -> Vec<usize> {
        match world {
            2 => vec![3, 300_000, 0, 270_001],
            4 => vec![
                0, 5, 140_001, 1, //
                2, 0, 0, 7, //
                150_000, 3, 9, 0, //
                0, 0, 4, 160_000,
            ],
            _ => unreachable!(),
        }
    }

    pub fn all_to_all() {
        for world in [2, 4] {
            let counts = counts(world);
            for dtype in [DType::F32, DType::Bf16] {
                let want: Vec<_> = (0..world)
                    .map(|me| wanted(dtype, &counts, world, me))
                    .collect();
                // NCCL, and the host-staged TCP comm, between rank threads
                // with a GPU each.
                let got = on_ranks(world, |group, backend, id| {
                    let rank = group.rank();
                    let stager = backend.driver().stager();
                    let mut nccl = NcclComm::new(rank, group, 1, id, TIMEOUT).unwrap();
                    let mut tcp =
                        Staged::new(ProcessComm::new(group, 2, (0..world).collect()), stager);
                    let nccl = exchange(backend, &mut nccl, &counts, dtype);
                    let tcp = exchange(backend, &mut tcp, &counts, dtype);
                    assert_eq!(group.failure(), None);
                    (nccl, tcp)
                });
                for (me, (nccl, tcp)) in got.iter().enumerate() {
                    let at = format!("world {world} {dtype:?} rank {me}");
                    assert!(
                        nccl == &want[me],
                        "NCCL, {at}: {}",
                        first_diff(nccl, &want[me])
                    );
                    assert!(
                        tcp == &want[me],
                        "TCP, {at}: {}",
                        first_diff(tcp, &want[me])
                    );
                }
                // Ranks sharing one GPU (`CudaComm`).
                let mut backend = cuda::open(0, 1).unwrap();
                let comms = CudaComm::group(world, backend.driver().stager());
                let bufs: Vec<_> = (0..world)
                    .map(|me| buffers(&mut backend, dtype, &counts, world, me))
                    .collect();
                let outs: Vec<CudaBuf> = std::thread::scope(|s| {
                    let ranks: Vec<_> = comms
                        .into_iter()
                        .zip(bufs)
                        .map(|(mut comm, (inp, mut out))| {
                            let counts = &counts;
                            s.spawn(move || {
                                comm.all_to_all(&mut out, &inp, counts);
                                out
                            })
                        })
                        .collect();
                    ranks.into_iter().map(|h| h.join().unwrap()).collect()
                });
                for (me, out) in outs.iter().enumerate() {
                    let got = backend.download_f32(out).unwrap();
                    let at = format!("world {world} {dtype:?} rank {me}");
                    assert!(
                        got == want[me],
                        "one GPU, {at}: {}",
                        first_diff(&got, &want[me])
                    );
                }
            }
        }
    }

    /// Where two long vectors first differ, for a readable failure.
    fn first_diff(got: &[f32], want: &[f32]) -> String {
        match got.iter().zip(want).position(|(g, w)| g != w) {
            Some(i) => format!("element {i}: got {}, want {}", got[i], want[i]),
            None => format!("{} elements, want {}", got.len(), want.len()),
        }
    }

    pub fn mismatch() {
        // Rank 0 sends rank 1 four elements; rank 1 expects five.
        let got = on_ranks(2, |group, backend, id| {
            let rank = group.rank();
            let counts = [[0, 4, 3, 0], [0, 5, 3, 0]][rank];
            let mut nccl = NcclComm::new(rank, group, 1, id, TIMEOUT).unwrap();
            let t0 = Instant::now();
            let out = exchange(backend, &mut nccl, &counts, DType::F32);
            (t0.elapsed(), out, group.failure())
        });
        let failures: Vec<_> = got.iter().map(|g| g.2.clone()).collect();
        for (rank, (took, _, failure)) in got.iter().enumerate() {
            assert!(failure.is_some(), "rank {rank} saw no failure");
            assert!(*took < Duration::from_secs(20), "rank {rank} took {took:?}");
        }
        // Each rank keeps the first failure it heard of: its own, or its
        // peer's (which aborted the communicator under it).
        assert!(
            failures
                .iter()
                .flatten()
                .any(|(_, why)| why.contains("NCCL all-to-all failed: ncclInvalidUsage")),
            "{failures:?}"
        );
        assert_eq!(got[1].1, vec![-1.0; 5 + PAST], "rank 1 received nothing");
    }

    pub fn groups() {
        use cudarc::driver::result as cu;
        use cudarc::nccl::result::{self as nccl, NcclError};
        use cudarc::nccl::sys::{ncclDataType_t as Ty, ncclRedOp_t as Op, ncclResult_t as Rc};
        let id = nccl::get_uniqueid().unwrap();
        std::thread::scope(|s| {
            for rank in 0..2usize {
                s.spawn(move || {
                    let peer = 1 - rank;
                    cu::init().unwrap();
                    // SAFETY: the double's driver and NCCL, called with
                    // live allocations of this rank's device, each at least
                    // as long as the count passed with it.
                    unsafe {
                        let dev = cu::device::get(rank as i32).unwrap();
                        let ctx = cu::primary_ctx::retain(dev).unwrap();
                        cu::ctx::set_current(ctx).unwrap();
                        let mut comm = std::mem::MaybeUninit::uninit();
                        nccl::comm_init_rank(comm.as_mut_ptr(), 2, id, rank as i32).unwrap();
                        let comm = comm.assume_init();
                        let buf = |v: &[f32]| {
                            let p = cu::malloc_sync(v.len() * 4).unwrap();
                            cu::memcpy_htod_sync(p, v).unwrap();
                            p
                        };
                        let read = |p, n| {
                            let mut v = vec![0f32; n];
                            cu::memcpy_dtoh_sync(&mut v, p).unwrap();
                            v
                        };
                        let null = std::ptr::null_mut();
                        let send = |p: u64, n, ty, to: usize| {
                            nccl::send(p as *const _, n, ty, to as i32, comm, null).map(|_| ())
                        };
                        let recv = |p: u64, n, ty, from: usize| {
                            nccl::recv(p as *mut _, n, ty, from as i32, comm, null).map(|_| ())
                        };
                        let end = || nccl::group_end().map(|_| ());
                        let fails = |rc| Err(NcclError(rc));
                        let f32t = Ty::ncclFloat32;
                        let values =
                            |r: usize| (0..5).map(|i| (10 * r + i) as f32).collect::<Vec<_>>();
                        let (mine, theirs) = (values(rank), values(peer));
                        let a = buf(&mine);

                        // Groups nest: the inner end runs nothing, the outer
                        // end runs the send to self with its receive.
                        let b = buf(&[-1.0; 5]);
                        nccl::group_start().unwrap();
                        nccl::group_start().unwrap();
                        send(a, 4, f32t, rank).unwrap();
                        recv(b, 4, f32t, rank).unwrap();
                        end().unwrap();
                        assert_eq!(read(b, 5), [-1.0; 5], "the inner end ran the group");
                        end().unwrap();
                        assert_eq!(read(b, 5), [&mine[..4], &[-1.0][..]].concat());

                        // A pair's sends meet its receives in posting order
                        // (3 elements, then 2): rank 0 posts its sends
                        // first, rank 1 its receives.
                        let (x3, x2) = (buf(&[-1.0; 3]), buf(&[-1.0; 2]));
                        nccl::group_start().unwrap();
                        let sends = || {
                            send(a, 3, f32t, peer).unwrap();
                            send(a + 12, 2, f32t, peer).unwrap();
                        };
                        if rank == 0 {
                            sends();
                        }
                        recv(x3, 3, f32t, peer).unwrap();
                        recv(x2, 2, f32t, peer).unwrap();
                        if rank == 1 {
                            sends();
                        }
                        end().unwrap();
                        assert_eq!(
                            (read(x3, 3), read(x2, 2)),
                            (theirs[..3].to_vec(), theirs[3..].to_vec())
                        );

                        // Outside a group each call is a group of its own:
                        // rank 0 sends, rank 1 receives, a zero count too.
                        let y = buf(&[-1.0; 5]);
                        match rank {
                            0 => {
                                send(a, 5, f32t, peer).unwrap();
                                send(a, 0, f32t, peer).unwrap();
                            }
                            _ => {
                                recv(y, 5, f32t, peer).unwrap();
                                recv(y, 0, f32t, peer).unwrap();
                                assert_eq!(read(y, 5), theirs);
                            }
                        }

                        // A send to self whose receive is not in its group
                        // could never finish: refused, not a hang.
                        assert_eq!(send(a, 1, f32t, rank), fails(Rc::ncclInvalidUsage));
                        nccl::group_start().unwrap();
                        send(a, 1, f32t, rank).unwrap();
                        assert_eq!(end(), fails(Rc::ncclInvalidUsage));

                        // A call that fails in a group fails the group's
                        // end, which runs none of it, and leaves the group.
                        let c = buf(&[-1.0; 2]);
                        nccl::group_start().unwrap();
                        send(a, 2, f32t, rank).unwrap();
                        recv(c, 2, f32t, rank).unwrap();
                        assert_eq!(
                            send(a, 2, f32t, 2),
                            fails(Rc::ncclInvalidArgument),
                            "peer 2 of 2"
                        );
                        assert_eq!(end(), fails(Rc::ncclInvalidArgument));
                        assert_eq!(read(c, 2), [-1.0; 2], "a failed group ran");
                        assert_eq!(end(), fails(Rc::ncclInvalidUsage), "an end without a start");

                        // NCCL defers a collective in a group too; this
                        // double cannot, and says so rather than run it early.
                        nccl::group_start().unwrap();
                        let sum = nccl::all_reduce(
                            a as *const _,
                            c as *mut _,
                            1,
                            f32t,
                            Op::ncclSum,
                            comm,
                            null,
                        );
                        assert_eq!(sum.map(|_| ()), fails(Rc::ncclInvalidUsage));
                        assert_eq!(end(), fails(Rc::ncclInvalidUsage));

                        // Types that disagree (4 float32 sent, 4 bfloat16
                        // expected): both sides fail before a byte moves,
                        // and the communicator stays failed.
                        match rank {
                            0 => assert_eq!(send(a, 4, f32t, peer), fails(Rc::ncclInvalidUsage)),
                            _ => assert_eq!(
                                recv(y, 4, Ty::ncclBfloat16, peer),
                                fails(Rc::ncclInvalidUsage)
                            ),
                        }
                        assert_eq!(send(a, 0, f32t, peer), fails(Rc::ncclInvalidUsage));
                        assert_eq!(
                            read(y, 5),
                            if rank == 0 {
                                vec![-1.0; 5]
                            } else {
                                theirs.clone()
                            }
                        );

                        nccl::comm_destroy(comm).unwrap();
                        for p in [a, b, x3, x2, y, c] {
                            cu::free_sync(p).unwrap();
                        }
                        cu::primary_ctx::release(dev).unwrap();
                    }
                });
            }
        });
    }
}
