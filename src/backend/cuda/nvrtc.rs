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
