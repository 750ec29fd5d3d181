//! Every CUDA kernel compiles with NVRTC for sm_80 and sm_90, and the PTX
//! assembles with ptxas (catching register and shared-memory overuse that
//! NVRTC alone does not). CI installs both from the PyPI wheels
//! `nvidia-cuda-nvrtc-cu12` and `nvidia-cuda-nvcc-cu12` (`.ci/run`) and sets
//! MEMFIT_REQUIRE_NVRTC, so a missing compiler fails there; elsewhere the test
//! says what it skipped.

use std::path::PathBuf;
use std::process::Command;

use memfit::backend::cuda::driver::KERNELS;
use memfit::backend::cuda::nvrtc;

fn required() -> bool {
    std::env::var_os("MEMFIT_REQUIRE_NVRTC").is_some()
}

/// ptxas: $MEMFIT_PTXAS, else on PATH.
fn ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MEMFIT_PTXAS") {
        return Some(PathBuf::from(p));
    }
    Command::new("ptxas")
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| PathBuf::from("ptxas"))
}

#[test]
fn every_kernel_compiles_and_assembles_for_sm80_and_sm90() {
    if !nvrtc::available() {
        assert!(
            !required(),
            "MEMFIT_REQUIRE_NVRTC is set but NVRTC cannot be loaded"
        );
        eprintln!("skipped: NVRTC not found (set LD_LIBRARY_PATH; see .ci/run)");
        return;
    }
    if let Ok(major) = std::env::var("MEMFIT_EXPECT_NVRTC") {
        let v = nvrtc::version().expect("NVRTC reports its version");
        assert_eq!(
            v.0.to_string(),
            major,
            "NVRTC {v:?} loaded, {major} expected"
        );
    }
    let ptxas = ptxas();
    assert!(
        ptxas.is_some() || !required(),
        "MEMFIT_REQUIRE_NVRTC is set but ptxas was not found (MEMFIT_PTXAS or PATH)"
    );
    let dir = std::env::temp_dir().join(format!("memfit-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (arch, sm) in [("compute_80", "sm_80"), ("compute_90", "sm_90")] {
        let ptx = nvrtc::compile(arch).unwrap_or_else(|log| panic!("NVRTC for {arch}:\n{log}"));
        for k in KERNELS {
            assert!(
                ptx.contains(&format!(".entry {}(", k.name)),
                "{arch}: kernel `{}` is missing from the PTX",
                k.name
            );
        }
        let Some(ptxas) = &ptxas else {
            eprintln!("skipped ptxas for {sm}: not found");
            continue;
        };
        let src = dir.join(format!("{sm}.ptx"));
        std::fs::write(&src, &ptx).unwrap();
        let out = Command::new(ptxas)
            .arg(format!("-arch={sm}"))
            .arg("-v")
            .arg("-o")
            .arg(dir.join(format!("{sm}.cubin")))
            .arg(&src)
            .output()
            .expect("run ptxas");
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "ptxas -arch={sm} failed:\n{log}");
        // Spilled registers make a kernel slow; none of ours should spill.
        for line in log.lines().filter(|l| l.contains("spill")) {
            assert!(
                line.contains("0 bytes spill stores, 0 bytes spill loads"),
                "ptxas {sm}: {line}\n{log}"
            );
        }
    }
    // What the backend loads at run time: machine code from NVRTC itself.
    for sm in ["sm_80", "sm_90"] {
        let cubin = nvrtc::compile_cubin(sm).unwrap_or_else(|log| panic!("{log}"));
        assert_eq!(
            &cubin[..4],
            b"\x7fELF",
            "{sm}: NVRTC's CUBIN is an ELF image"
        );
        for k in KERNELS {
            let name = k.name.as_bytes();
            assert!(
                cubin.windows(name.len()).any(|w| w == name),
                "{sm}: kernel `{}` is missing from the CUBIN",
                k.name
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The same compile and assembly with each NVRTC the wheels installed, CUDA
/// 12 (`nvidia/cuda_nvrtc/lib`, ptxas from `nvidia/cuda_nvcc/bin`) and CUDA
/// 13 (`nvidia/cu13/lib` and `nvidia/cu13/bin`): the test above, run again
/// in a process whose loader finds that NVRTC first, as `memfit` arranges it
/// for itself (`libs::make_links`).
#[test]
fn kernels_compile_with_nvrtc_12_and_13() {
    use memfit::backend::cuda::libs::{self, Found, Lib};
    let mut layouts = 0;
    for sp in libs::python_site_packages() {
        let nv = sp.join("nvidia");
        for (lib, file, ptxas, major) in [
            (
                "cuda_nvrtc/lib",
                "libnvrtc.so.12",
                "cuda_nvcc/bin/ptxas",
                "12",
            ),
            ("cu13/lib", "libnvrtc.so.13", "cu13/bin/ptxas", "13"),
        ] {
            let path = nv.join(lib).join(file);
            if !path.is_file() {
                continue;
            }
            layouts += 1;
            let found = [Found {
                lib: Lib::Nvrtc,
                path: Some(path.clone()),
                source: None,
                skipped: Vec::new(),
            }];
            let links = libs::make_links(&found).unwrap();
            let out = Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    // The test's name in the `it` binary, module path and all.
                    "cuda_kernels::every_kernel_compiles_and_assembles_for_sm80_and_sm90",
                    "--nocapture",
                ])
                .env(
                    "LD_LIBRARY_PATH",
                    format!("{}:{}", links.display(), nv.join(lib).display()),
                )
                .env("MEMFIT_PTXAS", nv.join(ptxas))
                .env("MEMFIT_REQUIRE_NVRTC", "1")
                .env("MEMFIT_EXPECT_NVRTC", major)
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && text.contains("1 passed"),
                "NVRTC {major} ({}):\n{text}\n{}",
                path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    if std::env::var_os("MEMFIT_REQUIRE_NVRTC").is_some() {
        assert_eq!(
            layouts, 2,
            "MEMFIT_REQUIRE_NVRTC: CI installs both NVRTC wheels"
        );
    } else if layouts == 0 {
        eprintln!("skipped: no NVRTC wheel in python3's site-packages");
    }
}
