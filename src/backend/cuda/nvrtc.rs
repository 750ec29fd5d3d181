//! Compiling the kernel sources to PTX with NVRTC, at run time (the cuda
//! backend) and in CI (`tests/cuda_kernels.rs`, which also assembles the PTX
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

/// PTX for virtual architecture `arch` (e.g. `compute_90`), or NVRTC's log.
pub fn compile(arch: &'static str) -> Result<String, String> {
    if !available() {
        return Err(
            "NVRTC (libnvrtc.so.12) was not found: install the CUDA 12 toolkit's NVRTC, or `pip install nvidia-cuda-nvrtc-cu12` and put its lib directory on LD_LIBRARY_PATH".into(),
        );
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
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static CACHE: OnceLock<Mutex<HashMap<String, Vec<u8>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = cache.get(sm) {
        return Ok(c.clone());
    }
    let cubin = compile_cubin_uncached(sm)?;
    cache.insert(sm.to_string(), cubin.clone());
    Ok(cubin)
}

fn compile_cubin_uncached(sm: &str) -> Result<Vec<u8>, String> {
    use cudarc::nvrtc::{result, sys};
    use std::ffi::CString;
    if !available() {
        return Err(compile("compute_80").expect_err("NVRTC is missing"));
    }
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
