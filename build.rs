//! Builds the host side of the CUDA kernels.
//!
//! The kernel sources in `src/backend/cuda/kernels/` are CUDA C with no
//! includes. At run time the cuda backend compiles them with NVRTC. Here they
//! are compiled a second time, by the host C++ compiler under the SIMT
//! emulation header (`src/backend/cuda/simt/`), into a static library that the
//! emulated cuda driver runs, so `cargo test` executes every kernel on the CPU.
//!
//! This script also reads every kernel's signature (`extern "C" __global__ void
//! name(...)`, one per kernel) and generates `kernels.rs`: the sources in a
//! fixed order and each kernel's argument kinds, which every launch is checked
//! against, on the GPU and in the emulator alike.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

const KERNEL_DIR: &str = "src/backend/cuda/kernels";
const SIMT_DIR: &str = "src/backend/cuda/simt";
const PREFIX: &str = "extern \"C\" __global__ void ";

struct Kernel {
    name: String,
    args: Vec<&'static str>,
}

fn arg_kind(param: &str, file: &Path, name: &str) -> &'static str {
    if param.contains('*') {
        return "Ptr";
    }
    // The type is everything but the parameter name.
    let words: Vec<&str> = param.split_whitespace().collect();
    let ty = words[..words.len().saturating_sub(1)].join(" ");
    let ty = ty.trim_start_matches("const ").trim();
    match ty {
        "long long" | "i64" => "I64",
        "int" => "I32",
        "unsigned" | "unsigned int" | "u32" => "U32",
        "float" => "F32",
        _ => panic!(
            "{}: kernel `{name}`: parameter `{param}` has a type the launcher does not know (pointers, long long/i64, int, unsigned/u32, float)",
            file.display()
        ),
    }
}

fn kernels_in(src: &str, file: &Path) -> Vec<Kernel> {
    let mut out = Vec::new();
    let mut rest = src;
    while let Some(at) = rest.find(PREFIX) {
        rest = &rest[at + PREFIX.len()..];
        let open = rest.find('(').expect("kernel signature has a `(`");
        let name = rest[..open].trim().to_string();
        let close = rest[open..].find(')').expect("kernel signature has a `)`") + open;
        let params = &rest[open + 1..close];
        let args = params
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty() && *p != "void")
            .map(|p| arg_kind(p, file, &name))
            .collect();
        out.push(Kernel { name, args });
        rest = &rest[close..];
    }
    out
}

fn main() {
    println!("cargo:rerun-if-changed={KERNEL_DIR}");
    println!("cargo:rerun-if-changed={SIMT_DIR}");
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());

    let mut files: Vec<PathBuf> = std::fs::read_dir(root.join(KERNEL_DIR))
        .expect("kernel directory")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    files.sort();
    let prelude = root.join(KERNEL_DIR).join("prelude.cuh");

    let mut kernels = Vec::new();
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
        let src = std::fs::read_to_string(f).unwrap();
        if src.contains("#include") {
            panic!(
                "{}: kernels are header-free; put shared code in prelude.cuh",
                f.display()
            );
        }
        kernels.extend(kernels_in(&src, f));
    }
    let mut names: Vec<&str> = kernels.iter().map(|k| k.name.as_str()).collect();
    names.sort();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        panic!("kernel `{}` is defined twice", w[0]);
    }

    // The host build: every source, then the table the launcher indexes.
    let mut inc = String::new();
    writeln!(inc, "#include \"{}\"", prelude.display()).unwrap();
    for f in &files {
        writeln!(inc, "#include \"{}\"", f.display()).unwrap();
    }
    inc.push_str(
        "struct KernelEntry { const char* name; void (*run)(void**); const char* args; };\n",
    );
    inc.push_str("static const KernelEntry KERNELS[] = {\n");
    for k in &kernels {
        // Argument kinds, one letter each: Ptr, I64 (L), I32, U32, F32.
        let kinds: String = k
            .args
            .iter()
            .map(|a| match *a {
                "Ptr" => 'P',
                "I64" => 'L',
                "I32" => 'I',
                "U32" => 'U',
                _ => 'F',
            })
            .collect();
        writeln!(
            inc,
            "    {{\"{0}\", &simt::thunk<&{0}>, \"{kinds}\"}},",
            k.name
        )
        .unwrap();
    }
    inc.push_str("};\n");
    std::fs::write(out.join("kernels.inc"), inc).unwrap();

    // The Rust side: sources for NVRTC and the argument kinds of each kernel,
    // in the same order as the host table.
    let mut rs = String::from("/// Kernel sources in compile order, the prelude first.\n");
    rs.push_str("pub const SOURCES: &[(&str, &str)] = &[\n");
    for f in std::iter::once(&prelude).chain(&files) {
        let name = f.file_name().unwrap().to_string_lossy();
        writeln!(rs, "    (\"{name}\", include_str!(\"{}\")),", f.display()).unwrap();
    }
    rs.push_str("];\n/// Every kernel and its arguments, in the emulator's table order.\n");
    rs.push_str("pub const KERNELS: &[KernelSig] = &[\n");
    for k in &kernels {
        let args: Vec<String> = k.args.iter().map(|a| format!("ArgKind::{a}")).collect();
        writeln!(
            rs,
            "    KernelSig {{ name: \"{}\", args: &[{}] }},",
            k.name,
            args.join(", ")
        )
        .unwrap();
    }
    rs.push_str("];\n");
    std::fs::write(out.join("kernels.rs"), rs).unwrap();

    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file(root.join(SIMT_DIR).join("simt.cpp"))
        .include(&out)
        .include(root.join(SIMT_DIR))
        .opt_level(2)
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-unused-function")
        .flag_if_supported("-Wno-unused-variable")
        .flag_if_supported("-fno-strict-aliasing")
        .warnings(true)
        .compile("memfit_simt");

    build_nvml_double(&root, &out);
    build_cuda_double(&root, &out);
}

/// Compiles the C-level CUDA driver/cuBLAS/NCCL double
/// (`tests/cuda_double/cuda_double.cpp`, with the SIMT emulator and every
/// kernel) to `$OUT_DIR/cuda_double/libcuda.so.1`, gives it the names an
/// NVIDIA install has (`libcublas.so.13`, `libcublasLt.so.13`,
/// `libnccl.so.2`, links to the same file) and exports the folder as the
/// compile-time env `MEMFIT_CUDA_DOUBLE` (empty, with a warning, where it
/// cannot be built).
fn build_cuda_double(root: &Path, out: &Path) {
    const SRC: &str = "tests/cuda_double/cuda_double.cpp";
    println!("cargo:rerun-if-changed={SRC}");
    let dir = out.join("cuda_double");
    let lib = dir.join("libcuda.so.1");
    let built = (|| -> Result<(), String> {
        if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
            return Err("the CUDA double is built for Linux targets only".into());
        }
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let cxx = cc::Build::new()
            .cpp(true)
            .cargo_metadata(false)
            .try_get_compiler()
            .map_err(|e| format!("no C++ compiler: {e}"))?;
        let output = cxx
            .to_command()
            .args([
                "-std=c++17",
                "-O2",
                "-shared",
                "-fPIC",
                "-fvisibility=hidden",
                "-fno-strict-aliasing",
                "-w",
                "-Wl,-soname,libcuda.so.1",
                "-Wl,-Bsymbolic",
            ])
            .arg("-I")
            .arg(out)
            .arg("-I")
            .arg(root.join(SIMT_DIR))
            .arg("-o")
            .arg(&lib)
            .arg(root.join(SIMT_DIR).join("simt.cpp"))
            .arg(root.join(SRC))
            .args(["-lpthread", "-lrt"])
            .output()
            .map_err(|e| format!("{}: {e}", cxx.path().display()))?;
        if !output.status.success() {
            return Err(String::from_utf8_lossy(&output.stderr).into_owned());
        }
        for name in ["libcublas.so.13", "libcublasLt.so.13", "libnccl.so.2"] {
            let link = dir.join(name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink("libcuda.so.1", &link)
                .map_err(|e| format!("{}: {e}", link.display()))?;
        }
        Ok(())
    })();
    match built {
        Ok(()) => println!("cargo:rustc-env=MEMFIT_CUDA_DOUBLE={}", dir.display()),
        Err(why) => {
            for line in why.lines().take(20) {
                println!("cargo:warning=CUDA double not built: {line}");
            }
            println!("cargo:rustc-env=MEMFIT_CUDA_DOUBLE=");
        }
    }
}

/// Compiles the scripted NVML double (`tests/nvml_double/nvml_double.c`) to
/// `$OUT_DIR/libnvml_double.so` and exports its path as the compile-time env
/// `MEMFIT_NVML_DOUBLE` (empty, with a warning, where it cannot be built).
fn build_nvml_double(root: &Path, out: &Path) {
    const SRC: &str = "tests/nvml_double/nvml_double.c";
    println!("cargo:rerun-if-changed={SRC}");
    let src = root.join(SRC);
    let lib = out.join("libnvml_double.so");
    let built = (|| -> Result<(), String> {
        if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
            return Err("the NVML double is built for Linux targets only".into());
        }
        let cc = cc::Build::new()
            .cargo_metadata(false)
            .try_get_compiler()
            .map_err(|e| format!("no C compiler: {e}"))?;
        let output = cc
            .to_command()
            .args([
                "-std=c11", "-O2", "-Wall", "-Wextra", "-shared", "-fPIC", "-o",
            ])
            .arg(&lib)
            .arg(&src)
            .arg("-ldl")
            .arg("-lpthread")
            .output()
            .map_err(|e| format!("{}: {e}", cc.path().display()))?;
        if !output.status.success() {
            return Err(String::from_utf8_lossy(&output.stderr).into_owned());
        }
        Ok(())
    })();
    match built {
        Ok(()) => println!("cargo:rustc-env=MEMFIT_NVML_DOUBLE={}", lib.display()),
        Err(why) => {
            for line in why.lines() {
                println!("cargo:warning=NVML double not built: {line}");
            }
            println!("cargo:rustc-env=MEMFIT_NVML_DOUBLE=");
        }
    }
}
