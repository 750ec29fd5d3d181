//! `memfit doctor`: what of the NVIDIA stack this machine has, as
//! `--device cuda` will see it. The driver and the CUDA version it
//! supports, each GPU (name, memory, compute capability, MIG mode), and for
//! NVRTC, cuBLAS, cuBLASLt, NCCL and NVML the file found (by the search of
//! [`crate::backend::cuda::libs`]), its version as the library itself
//! reports it, and whether cudarc then loads it; or why not, and the fix.
//! Also whether a `python3` with PyTorch is importable, and its CUDA.
//!
//! Exit 0 when everything `--device cuda` needs is there (driver, a GPU,
//! NVRTC, cuBLAS and cuBLASLt, all loadable), 1 otherwise with one line per
//! missing piece. Without any NVIDIA stack it still reports the libraries
//! that wheels installed.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::backend::cuda::libs::{self, Found, Lib};

#[derive(Debug, Serialize)]
pub struct Report {
    /// The CUDA version the driver supports (`cuDriverGetVersion`), e.g. "13.0".
    pub driver_cuda: Option<String>,
    /// The driver's own version (NVML), e.g. "580.65.06".
    pub driver_version: Option<String>,
    pub gpus: Vec<Gpu>,
    pub libraries: Vec<Library>,
    pub python: Option<Python>,
    /// One line for each thing `--device cuda` needs and lacks.
    pub missing: Vec<String>,
    /// Whether `--device cuda` has what it needs.
    pub ready: bool,
}

#[derive(Debug, Serialize)]
pub struct Gpu {
    pub index: usize,
    pub name: String,
    pub memory_bytes: u64,
    pub compute_capability: String,
    /// "enabled", "disabled", or absent where NVML cannot say.
    pub mig: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Library {
    #[serde(skip)]
    pub lib: Lib,
    pub name: &'static str,
    pub required: bool,
    pub path: Option<PathBuf>,
    /// Why the folder was searched (`MEMFIT_CUDA_LIBS`, `LD_LIBRARY_PATH`, ...).
    pub source: Option<&'static str>,
    pub version: Option<String>,
    /// Whether cudarc loads it under memfit's links (absent: not loaded by cudarc).
    pub loads: Option<bool>,
    /// Why not, and the fix.
    pub problem: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Python {
    pub executable: String,
    pub torch: Option<String>,
    pub torch_cuda: Option<String>,
    pub torch_sees_gpu: Option<bool>,
}

/// `22703` as "2.27.3" (NCCL 2.9 and later; earlier codes had 3 digits of
/// minor and patch together).
fn nccl_version(v: i32) -> String {
    if v >= 20900 {
        format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
    } else {
        format!("{}.{}.{}", v / 1000, v / 100 % 10, v % 100)
    }
}

/// The library's own version, asked of the exact file found.
fn version_of(lib: Lib, path: &Path) -> Option<String> {
    type I1 = unsafe extern "C" fn(*mut i32) -> i32;
    type I2 = unsafe extern "C" fn(*mut i32, *mut i32) -> i32;
    type Prop = unsafe extern "C" fn(i32, *mut i32) -> i32;
    type Lt = unsafe extern "C" fn() -> usize;
    // SAFETY: each library is loaded by path, as a CUDA program loads it,
    // and asked its version through the documented signature.
    unsafe {
        let l = libloading::Library::new(path).ok()?;
        let v = match lib {
            Lib::Driver => {
                let f: libloading::Symbol<I1> = l.get(b"cuDriverGetVersion").ok()?;
                let mut v = 0;
                (f(&mut v) == 0).then(|| crate::backend::cuda::nvrtc::cuda_version_name(v))?
            }
            Lib::Nvrtc => {
                let f: libloading::Symbol<I2> = l.get(b"nvrtcVersion").ok()?;
                let (mut a, mut b) = (0, 0);
                (f(&mut a, &mut b) == 0).then(|| format!("{a}.{b}"))?
            }
            Lib::Cublas => {
                let f: libloading::Symbol<Prop> = l.get(b"cublasGetProperty").ok()?;
                let mut p = [0; 3];
                for (i, x) in p.iter_mut().enumerate() {
                    if f(i as i32, x) != 0 {
                        return None;
                    }
                }
                format!("{}.{}.{}", p[0], p[1], p[2])
            }
            Lib::CublasLt => {
                let f: libloading::Symbol<Lt> = l.get(b"cublasLtGetVersion").ok()?;
                let v = f();
                format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
            }
            Lib::Nccl => {
                let f: libloading::Symbol<I1> = l.get(b"ncclGetVersion").ok()?;
                let mut v = 0;
                (f(&mut v) == 0).then(|| nccl_version(v))?
            }
            Lib::Nvml => return None, // asked through nvml-wrapper, below
        };
        // Leave it loaded: unloading CUDA libraries mid-process is not
        // something they are tested for.
        std::mem::forget(l);
        Some(v)
    }
}

/// Whether cudarc finds `lib` under the names it tries.
fn cudarc_loads(lib: Lib) -> Option<bool> {
    // SAFETY: each only tries to dlopen the library.
    unsafe {
        match lib {
            Lib::Driver => Some(cudarc::driver::sys::is_culib_present()),
            Lib::Nvrtc => Some(cudarc::nvrtc::sys::is_culib_present()),
            Lib::Cublas => Some(cudarc::cublas::sys::is_culib_present()),
            Lib::Nccl => Some(cudarc::nccl::sys::is_culib_present()),
            Lib::CublasLt | Lib::Nvml => None,
        }
    }
}

/// The GPUs, through the CUDA driver as `--device cuda` opens them.
fn gpus() -> Result<Vec<Gpu>, String> {
    use cudarc::driver::{result as cu, sys};
    if !crate::backend::cuda::real::driver_present() {
        return Ok(Vec::new());
    }
    cu::init().map_err(|e| format!("cuInit failed: {e:?}"))?;
    let n = cu::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e:?}"))?;
    let mut out = Vec::new();
    for i in 0..n {
        let dev = cu::device::get(i).map_err(|e| format!("cuDeviceGet({i}) failed: {e:?}"))?;
        let attr = |a| {
            // SAFETY: dev is a valid device; a is a device attribute.
            unsafe { cu::device::get_attribute(dev, a) }.unwrap_or(0)
        };
        out.push(Gpu {
            index: i as usize,
            name: cu::device::get_name(dev).unwrap_or_else(|_| "NVIDIA GPU".into()),
            // SAFETY: dev is valid.
            memory_bytes: unsafe { cu::device::total_mem(dev) }.unwrap_or(0) as u64,
            compute_capability: format!(
                "{}.{}",
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            ),
            mig: None,
        });
    }
    Ok(out)
}

/// NVML's version, the driver's version, and each GPU's MIG mode.
type NvmlView = (String, Option<String>, Vec<Option<String>>);

/// What NVML says, loaded from `path`.
fn nvml(path: &Path) -> Result<NvmlView, String> {
    let nvml = nvml_wrapper::Nvml::builder()
        .lib_path(path.as_os_str())
        .init()
        .map_err(|e| format!("NVML did not initialise: {e}"))?;
    let version = nvml.sys_nvml_version().unwrap_or_default();
    let driver = nvml.sys_driver_version().ok();
    let count = nvml.device_count().unwrap_or(0);
    let mig = (0..count)
        .map(|i| {
            let d = nvml.device_by_index(i).ok()?;
            let m = d.mig_mode().ok()?;
            Some(
                if m.current == 1 {
                    "enabled"
                } else {
                    "disabled"
                }
                .to_string(),
            )
        })
        .collect();
    Ok((version, driver, mig))
}

fn python() -> Option<Python> {
    let script = "import sys\nprint(sys.executable)\ntry:\n import torch\n print(torch.__version__)\n print(torch.version.cuda)\n print(torch.cuda.is_available())\nexcept Exception:\n pass";
    let out = libs::python(script, std::time::Duration::from_secs(30))?;
    let mut lines = out.lines();
    let executable = lines.next()?.to_string();
    let torch = lines.next().map(str::to_string);
    let torch_cuda = lines.next().filter(|s| *s != "None").map(str::to_string);
    let torch_sees_gpu = lines.next().map(|s| s == "True");
    Some(Python {
        executable,
        torch,
        torch_cuda,
        torch_sees_gpu,
    })
}

/// Everything `memfit doctor` reports.
pub fn diagnose() -> Report {
    let (found, driver) = libs::discover();
    let mut libraries: Vec<Library> = found.iter().map(library).collect();
    let mut missing: Vec<String> = found
        .iter()
        .filter(|f| f.lib.required() && f.path.is_none())
        .map(libs::missing_line)
        .collect();
    for l in &libraries {
        if l.required && l.path.is_some() && l.loads == Some(false) {
            missing.push(format!(
                "{} at {} does not load: {}",
                l.name,
                l.path
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                l.problem.clone().unwrap_or_default()
            ));
        }
    }
    let mut gpus = match gpus() {
        Ok(g) => g,
        Err(e) => {
            missing.push(format!("the CUDA driver could not list GPUs: {e}"));
            Vec::new()
        }
    };
    let driver_present = found
        .iter()
        .any(|f| f.lib == Lib::Driver && f.path.is_some());
    if driver_present && gpus.is_empty() && missing.is_empty() {
        missing.push("the CUDA driver reports no GPU".into());
    }
    let mut driver_version = None;
    if let Some(lib) = libraries.iter_mut().find(|l| l.lib == Lib::Nvml) {
        // The NVML that `watch` and sweeps would load, when named.
        if let Some(named) =
            std::env::var_os(crate::telemetry::NVML_LIB_ENV).filter(|v| !v.is_empty())
        {
            lib.path = Some(PathBuf::from(named));
            lib.source = Some(crate::telemetry::NVML_LIB_ENV);
            lib.problem = None;
        }
    }
    if let Some(lib) = libraries.iter_mut().find(|l| l.lib == Lib::Nvml)
        && let Some(path) = lib.path.clone()
    {
        match nvml(&path) {
            Ok((version, driver, mig)) => {
                lib.version = Some(version);
                driver_version = driver;
                for (g, m) in gpus.iter_mut().zip(mig) {
                    g.mig = m;
                }
            }
            Err(e) => lib.problem = Some(e),
        }
    }
    Report {
        driver_cuda: driver.map(crate::backend::cuda::nvrtc::cuda_version_name),
        driver_version,
        ready: missing.is_empty(),
        gpus,
        libraries,
        python: python(),
        missing,
    }
}

fn library(f: &Found) -> Library {
    let (version, loads, problem) = match &f.path {
        None => (None, None, Some(libs::missing_line(f))),
        Some(p) => {
            let version = version_of(f.lib, p);
            let loads = cudarc_loads(f.lib);
            let problem = match loads {
                Some(false) => Some(format!(
                    "cudarc does not find it under its names; {} was not set up (run memfit doctor again, or report this)",
                    libs::READY_ENV
                )),
                _ if version.is_none() && f.lib != Lib::Nvml => {
                    Some("it loaded but did not report a version".into())
                }
                _ => None,
            };
            (version, loads, problem)
        }
    };
    Library {
        lib: f.lib,
        name: f.lib.label(),
        required: f.lib.required(),
        path: f.path.clone(),
        source: f.source,
        version,
        loads,
        problem,
    }
}

/// The report as aligned text.
pub fn render(r: &Report) -> String {
    let mut s = String::from("memfit doctor: the NVIDIA stack as --device cuda sees it\n\n");
    match (&r.driver_cuda, &r.driver_version) {
        (Some(c), Some(v)) => s.push_str(&format!("driver    {v}, supports CUDA {c}\n")),
        (Some(c), None) => s.push_str(&format!("driver    supports CUDA {c}\n")),
        _ => s.push_str("driver    none (libcuda.so.1 not found)\n"),
    }
    if r.gpus.is_empty() {
        s.push_str("GPUs      none\n");
    }
    for g in &r.gpus {
        s.push_str(&format!(
            "GPU {:<5} {}, {}, sm_{}{}\n",
            g.index,
            g.name,
            crate::units::fmt_bytes(g.memory_bytes),
            g.compute_capability.replace('.', ""),
            g.mig
                .as_deref()
                .map(|m| format!(", MIG {m}"))
                .unwrap_or_default()
        ));
    }
    s.push('\n');
    for l in &r.libraries {
        let need = if l.required { "needed  " } else { "optional" };
        match &l.path {
            Some(p) => s.push_str(&format!(
                "{:<9} {need} {:<8} {} ({}){}\n",
                l.name,
                l.version.as_deref().unwrap_or("?"),
                p.display(),
                l.source.unwrap_or(""),
                if l.loads == Some(false) {
                    ", does NOT load"
                } else {
                    ""
                }
            )),
            None => s.push_str(&format!("{:<9} {need} missing  {}\n", l.name, l.lib.fix())),
        }
    }
    s.push('\n');
    match &r.python {
        None => s.push_str("python3   not found\n"),
        Some(p) => match &p.torch {
            None => s.push_str(&format!("python3   {} (no torch)\n", p.executable)),
            Some(t) => s.push_str(&format!(
                "python3   {}: torch {t}, CUDA {}, {}\n",
                p.executable,
                p.torch_cuda.as_deref().unwrap_or("none"),
                if p.torch_sees_gpu == Some(true) {
                    "sees a GPU"
                } else {
                    "sees no GPU"
                }
            )),
        },
    }
    if r.ready {
        s.push_str("\nready: --device cuda has everything it needs\n");
    } else {
        s.push_str("\nnot ready for --device cuda:\n");
        for m in &r.missing {
            s.push_str(&format!("  - {m}\n"));
        }
    }
    s
}

/// `memfit doctor`: prints the report; 0 when ready, 1 otherwise.
pub fn doctor_main(json: bool) -> i32 {
    let r = diagnose();
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&r).expect("report serialises")
        );
    } else {
        print!("{}", render(&r));
    }
    if !r.ready && json {
        for m in &r.missing {
            eprintln!("memfit: {m}");
        }
    }
    if r.ready { 0 } else { 1 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_version_codes() {
        assert_eq!(nccl_version(22703), "2.27.3");
        assert_eq!(nccl_version(2804), "2.8.4");
    }
}
