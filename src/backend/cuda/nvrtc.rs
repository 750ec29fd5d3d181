//! Compiling the kernel sources to PTX with NVRTC, at run time (the cuda
//! backend) and in CI (`tests/it/cuda_kernels.rs`, which also assembles the PTX
//! with ptxas). NVRTC is loaded dynamically; without it, [`compile`] says so.

use super::driver::SOURCES;

/// The kernel program: the prelude and every kernel file, in one translation
/// unit (kernel names are unique across files; build.rs checks).
pub fn program_source() -> String {
    let mut src = String::new();
    for (name, text) in SOURCES {
        src.push_str(&format!("// ---- {name}\n"));
        src.push_str(text);
        src.push('\n');
    }
    src
}

/// Whether the NVRTC library can be loaded (cudarc would panic otherwise).
pub fn available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's (major, minor) version.
pub fn version() -> Option<(i32, i32)> {
    if !available() {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC writes the two ints.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
}

/// The real architectures this NVRTC compiles for (75, 80, 86, 89, 90, ...).
pub fn supported_archs() -> Vec<i32> {
    use cudarc::nvrtc::sys;
    if !available() {
        return Vec::new();
    }
    let mut n = 0;
    // SAFETY: NVRTC writes n, then n ints into a buffer of that size.
    unsafe {
        if sys::nvrtcGetNumSupportedArchs(&mut n) != sys::nvrtcResult::NVRTC_SUCCESS || n <= 0 {
            return Vec::new();
        }
        let mut archs = vec![0; n as usize];
        if sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) != sys::nvrtcResult::NVRTC_SUCCESS {
            return Vec::new();
        }
        archs
    }
}

/// What the kernels are built as for one GPU.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// Machine code for `sm_XY`: loads on any driver that knows the GPU.
    Cubin(String),
    /// PTX for `compute_XY`, which the driver compiles (JIT) for a GPU newer
    /// than this NVRTC knows.
    Ptx(String),
}

/// `12040` as `12.4`.
pub fn cuda_version_name(v: i32) -> String {
    format!("{}.{}", v / 1000, v / 10 % 100)
}

/// The target for a GPU of compute capability `cc` (90 for 9.0) under a
/// driver of CUDA `driver` (`cuDriverGetVersion`, 13000 for 13.0), with an
/// NVRTC of `nvrtc` (major, minor) that compiles for `archs`:
/// - NVRTC of a newer major than the driver makes code it cannot load
///   (CUDA's minor-version compatibility stops at the major): refused;
/// - a GPU NVRTC knows gets a CUBIN, so the driver never JIT-compiles and a
///   newer NVRTC minor than the driver's is fine;
/// - a newer GPU gets PTX for the newest architecture NVRTC knows below it,
///   which the driver accepts only if it is at least NVRTC's version (PTX
///   ISA versions follow the toolkit's).
pub fn choose_target(
    cc: i32,
    nvrtc: (i32, i32),
    archs: &[i32],
    driver: i32,
) -> Result<Target, String> {
    let nv = nvrtc.0 * 1000 + nvrtc.1 * 10;
    if nvrtc.0 > driver / 1000 {
        return Err(format!(
            "NVRTC {}.{} makes code for CUDA {} drivers, and this driver supports CUDA {}: install the NVRTC of CUDA {} (pip install {}) or update the driver",
            nvrtc.0,
            nvrtc.1,
            nvrtc.0,
            cuda_version_name(driver),
            driver / 1000,
            if driver / 1000 == 12 {
                "nvidia-cuda-nvrtc-cu12"
            } else {
                "nvidia-cuda-nvrtc"
            }
        ));
    }
    if archs.contains(&cc) {
        return Ok(Target::Cubin(format!("sm_{cc}")));
    }
    let Some(&below) = archs.iter().filter(|&&a| a < cc).max() else {
        return Err(format!(
            "NVRTC {}.{} cannot compile for sm_{cc} (it knows sm_{})",
            nvrtc.0,
            nvrtc.1,
            archs
                .iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>()
                .join(", sm_")
        ));
    };
    if nv > driver {
        return Err(format!(
            "this GPU (sm_{cc}) is newer than NVRTC {}.{} knows, so its kernels would be PTX for the driver to compile, and a driver of CUDA {} refuses PTX from NVRTC {}.{}: install an NVRTC that knows sm_{cc} or update the driver",
            nvrtc.0,
            nvrtc.1,
            cuda_version_name(driver),
            nvrtc.0,
            nvrtc.1
        ));
    }
    Ok(Target::Ptx(format!("compute_{below}")))
}

/// PTX for virtual architecture `arch` (e.g. `compute_90`), or NVRTC's log.
pub fn compile(arch: &'static str) -> Result<String, String> {
    if !available() {
        return Err(super::libs::explain(super::libs::Lib::Nvrtc));
    }
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        // IEEE division and square root, no flush to zero: the cpu backend's
        // arithmetic, so the two backends agree to rounding.
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(true),
        options: vec!["--std=c++17".into()],
        name: Some("memfit_kernels.cu".into()),
        ..Default::default()
    };
    match cudarc::nvrtc::compile_ptx_with_opts(program_source(), opts) {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(cudarc::nvrtc::CompileError::CompileError { log, .. }) => {
            Err(log.to_string_lossy().into_owned())
        }
        Err(e) => Err(format!("NVRTC failed: {e}")),
    }
}

/// A CUBIN (machine code) for real architecture `sm` (e.g. `sm_90`): what
/// the cuda backend loads. Loading PTX instead would make the driver JIT it,
/// and a driver older than the NVRTC refuses newer PTX versions
/// (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`: NVRTC 12.9 emits PTX 8.8, which
/// R575 and later drivers accept); a CUBIN only needs the architecture.
/// Compiled once per process and architecture: every rank simulated on a
/// GPU opens its own driver, and they all load the same image.
pub fn compile_cubin(sm: &str) -> Result<Vec<u8>, String> {
    compile_image(&Target::Cubin(sm.to_string()))
}

/// The module image for `target`: a CUBIN, or NUL-terminated PTX text (as
/// `cuModuleLoadData` takes it). Cached per process and target.
pub fn compile_image(target: &Target) -> Result<Vec<u8>, String> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static CACHE: OnceLock<Mutex<HashMap<Target, Vec<u8>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = cache.get(target) {
        return Ok(c.clone());
    }
    let image = compile_uncached(target)?;
    cache.insert(target.clone(), image.clone());
    Ok(image)
}

fn compile_uncached(target: &Target) -> Result<Vec<u8>, String> {
    use cudarc::nvrtc::{result, sys};
    use std::ffi::CString;
    if !available() {
        return Err(compile("compute_80").expect_err("NVRTC is missing"));
    }
    let (sm, cubin) = match target {
        Target::Cubin(a) => (a.as_str(), true),
        Target::Ptx(a) => (a.as_str(), false),
    };
    let src = CString::new(program_source()).map_err(|e| format!("kernel source: {e}"))?;
    let name = CString::new("memfit_kernels.cu").expect("no NUL");
    let prog = result::create_program(&src, Some(&name)).map_err(|e| format!("NVRTC: {e:?}"))?;
    let options = [
        format!("--gpu-architecture={sm}"),
        "--ftz=false".into(),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--fmad=true".into(),
        "--std=c++17".into(),
    ];
    // SAFETY: prog is a live program; it is destroyed once, below.
    let out = unsafe {
        match result::compile_program(prog, &options) {
            Err(e) => {
                let log = result::get_program_log(prog)
                    .map(|l| {
                        let bytes: Vec<u8> = l
                            .iter()
                            .take_while(|&&c| c != 0)
                            .map(|&c| c as u8)
                            .collect();
                        String::from_utf8_lossy(&bytes).into_owned()
                    })
                    .unwrap_or_default();
                Err(format!(
                    "NVRTC could not compile the kernels for {sm} ({e:?}):\n{log}"
                ))
            }
            Ok(()) if !cubin => result::get_ptx(prog)
                .map(|p| {
                    let mut text: Vec<u8> = p
                        .iter()
                        .take_while(|&&c| c != 0)
                        .map(|&c| c as u8)
                        .collect();
                    text.push(0);
                    text
                })
                .map_err(|e| format!("NVRTC: getting the PTX failed: {e:?}")),
            Ok(()) => {
                let mut size = 0usize;
                match sys::nvrtcGetCUBINSize(prog, &mut size).result() {
                    Err(e) => Err(format!(
                        "NVRTC has no CUBIN for {sm} ({e:?}): this NVRTC may predate the GPU's architecture"
                    )),
                    Ok(()) => {
                        let mut cubin = vec![0u8; size];
                        sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut std::ffi::c_char)
                            .result()
                            .map(|()| cubin)
                            .map_err(|e| format!("NVRTC: getting the CUBIN failed: {e:?}"))
                    }
                }
            }
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const ARCHS_12_9: &[i32] = &[75, 80, 86, 87, 89, 90, 100, 101, 103, 120, 121];

    #[test]
    fn a_known_gpu_gets_machine_code_whatever_the_minor_versions() {
        let t = choose_target(90, (12, 9), ARCHS_12_9, 12020).unwrap();
        assert_eq!(t, Target::Cubin("sm_90".into()));
        let t = choose_target(90, (13, 5), &[75, 80, 90, 100, 120], 13000).unwrap();
        assert_eq!(t, Target::Cubin("sm_90".into()));
    }

    #[test]
    fn nvrtc_of_a_newer_major_than_the_driver_is_refused_with_the_fix() {
        let e = choose_target(90, (13, 5), &[80, 90], 12040).unwrap_err();
        assert!(e.contains("NVRTC 13.5") && e.contains("CUDA 12.4"), "{e}");
        assert!(e.contains("nvidia-cuda-nvrtc-cu12"), "{e}");
    }

    #[test]
    fn a_gpu_newer_than_nvrtc_gets_ptx_only_when_the_driver_reads_it() {
        let t = choose_target(130, (12, 9), ARCHS_12_9, 13000).unwrap();
        assert_eq!(t, Target::Ptx("compute_121".into()));
        let e = choose_target(130, (12, 9), ARCHS_12_9, 12080).unwrap_err();
        assert!(e.contains("refuses PTX"), "{e}");
        let e = choose_target(70, (12, 9), ARCHS_12_9, 12090).unwrap_err();
        assert!(e.contains("cannot compile for sm_70"), "{e}");
    }
}
