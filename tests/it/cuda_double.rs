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
