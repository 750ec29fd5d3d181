//! Finding NVIDIA's libraries where the usual installs put them, for CUDA 12
//! and 13 alike, and making cudarc load exactly those files.
//!
//! Where memfit looks, in order (the first folder holding an accepted file
//! wins; within a folder the newer major version does):
//! 1. `MEMFIT_CUDA_LIBS`, a `:` list of folders;
//! 2. the loader's own path: `LD_LIBRARY_PATH`, the ld.so cache
//!    (`ldconfig -p`) and the system's library folders;
//! 3. `CUDA_HOME` and `CUDA_PATH` (`lib64`, `lib`, `targets/x86_64-linux/lib`);
//! 4. `/usr/local/cuda*/lib64`, newest first;
//! 5. the active `python3`'s site-packages: `nvidia/cu13/lib` (CUDA 13
//!    wheels) and `nvidia/*/lib` (CUDA 12 wheels, NCCL), where PyTorch's
//!    wheels put them.
//!
//! A toolkit library (NVRTC, cuBLAS) whose major version is newer than the
//! CUDA version the driver supports is passed over for an older one: code
//! from NVRTC 13 does not load on a CUDA 12 driver.
//!
//! cudarc's loader dlopens fixed names (`libnvrtc.so`, `libnvrtc.so.12`,
//! ..., never `.so.13` for a CUDA 12 build, never `libnccl.so.2`), and glibc
//! reads `LD_LIBRARY_PATH` once, at start. So [`prepare`] puts a private
//! folder of links, named as cudarc asks and pointing at the files found,
//! first on `LD_LIBRARY_PATH` (the found folders after it, for the libraries'
//! own dependencies) and executes memfit again, once; children (sweep trials,
//! launched ranks) inherit it. ARCHITECTURE.md says why this over a fork.

use std::path::{Path, PathBuf};

/// A `:` list of folders searched first.
pub const LIBS_ENV: &str = "MEMFIT_CUDA_LIBS";
/// Set (to the links folder) once [`prepare`] has run for this process tree.
pub const READY_ENV: &str = "MEMFIT_CUDA_LIBS_READY";
/// `LD_LIBRARY_PATH` as it was before [`prepare`] put its folders first.
const ORIGINAL_LD_ENV: &str = "MEMFIT_CUDA_LIBS_LD_LIBRARY_PATH";

/// One library of the NVIDIA stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lib {
    Driver,
    Nvrtc,
    Cublas,
    CublasLt,
    Nccl,
    Nvml,
}

impl Lib {
    pub const ALL: [Lib; 6] = [
        Lib::Driver,
        Lib::Nvrtc,
        Lib::Cublas,
        Lib::CublasLt,
        Lib::Nccl,
        Lib::Nvml,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Lib::Driver => "CUDA driver",
            Lib::Nvrtc => "NVRTC",
            Lib::Cublas => "cuBLAS",
            Lib::CublasLt => "cuBLASLt",
            Lib::Nccl => "NCCL",
            Lib::Nvml => "NVML",
        }
    }

    /// File names accepted, preferred first.
    pub fn files(self) -> &'static [&'static str] {
        match self {
            Lib::Driver => &["libcuda.so.1"],
            Lib::Nvrtc => &["libnvrtc.so.13", "libnvrtc.so.12"],
            Lib::Cublas => &["libcublas.so.13", "libcublas.so.12"],
            Lib::CublasLt => &["libcublasLt.so.13", "libcublasLt.so.12"],
            Lib::Nccl => &["libnccl.so.2"],
            Lib::Nvml => &["libnvidia-ml.so.1"],
        }
    }

    /// The first name cudarc's loader tries for this library (`None`: not
    /// loaded by cudarc; cuBLASLt is cuBLAS's own dependency, NVML goes
    /// through nvml-wrapper with a path).
    fn cudarc_name(self) -> Option<&'static str> {
        match self {
            Lib::Driver => Some("libcuda.so"),
            Lib::Nvrtc => Some("libnvrtc.so"),
            Lib::Cublas => Some("libcublas.so"),
            Lib::Nccl => Some("libnccl.so"),
            Lib::CublasLt | Lib::Nvml => None,
        }
    }

    /// Whether `--device cuda` needs it (NCCL only serves ranks launched as
    /// processes, NVML only telemetry).
    pub fn required(self) -> bool {
        matches!(self, Lib::Driver | Lib::Nvrtc | Lib::Cublas | Lib::CublasLt)
    }

    /// The one command that installs it.
    pub fn fix(self) -> &'static str {
        match self {
            Lib::Driver | Lib::Nvml => {
                "install NVIDIA's driver (it ships libcuda.so.1 and libnvidia-ml.so.1; `nvidia-smi` then works)"
            }
            Lib::Nvrtc => {
                "pip install nvidia-cuda-nvrtc (CUDA 13 drivers, 580 and later) or nvidia-cuda-nvrtc-cu12 (CUDA 12)"
            }
            Lib::Cublas | Lib::CublasLt => {
                "pip install nvidia-cublas (CUDA 13 drivers, 580 and later) or nvidia-cublas-cu12 (CUDA 12)"
            }
            Lib::Nccl => "pip install nvidia-nccl-cu13 (or nvidia-nccl-cu12 for a CUDA 12 driver)",
        }
    }

    /// The major version in a file name (`libnvrtc.so.13` is 13).
    fn major_of(file: &str) -> Option<u32> {
        file.rsplit('.').next()?.parse().ok()
    }
}

/// Where one library was found, or where it was looked for.
#[derive(Clone, Debug)]
pub struct Found {
    pub lib: Lib,
    pub path: Option<PathBuf>,
    /// Why this folder was searched (`MEMFIT_CUDA_LIBS`, `LD_LIBRARY_PATH`, ...).
    pub source: Option<&'static str>,
    /// Files passed over, and why (a toolkit newer than the driver).
    pub skipped: Vec<String>,
}

/// The folders searched, in order, each with why.
pub fn search_dirs() -> Vec<(PathBuf, &'static str)> {
    let mut dirs: Vec<(PathBuf, &'static str)> = Vec::new();
    let split = |v: std::ffi::OsString| std::env::split_paths(&v).collect::<Vec<_>>();
    if let Some(v) = std::env::var_os(LIBS_ENV) {
        dirs.extend(split(v).into_iter().map(|d| (d, LIBS_ENV)));
    }
    // The user's LD_LIBRARY_PATH, not the one `prepare` made.
    let ld = if std::env::var_os(READY_ENV).is_some() {
        std::env::var_os(ORIGINAL_LD_ENV)
    } else {
        std::env::var_os("LD_LIBRARY_PATH")
    };
    if let Some(v) = ld {
        dirs.extend(split(v).into_iter().map(|d| (d, "LD_LIBRARY_PATH")));
    }
    dirs.extend(ld_cache_dirs().into_iter().map(|d| (d, "ld.so cache")));
    for d in [
        "/lib/x86_64-linux-gnu",
        "/usr/lib/x86_64-linux-gnu",
        "/lib64",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/nvidia/lib64",
        "/usr/lib/wsl/lib",
    ] {
        dirs.push((PathBuf::from(d), "system library folders"));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            let root = PathBuf::from(root);
            for sub in ["lib64", "lib", "targets/x86_64-linux/lib"] {
                dirs.push((
                    root.join(sub),
                    if var == "CUDA_HOME" {
                        "CUDA_HOME"
                    } else {
                        "CUDA_PATH"
                    },
                ));
            }
        }
    }
    let mut cudas: Vec<PathBuf> = std::fs::read_dir("/usr/local")
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with("cuda"))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default();
    // `cuda` (the usual link to the default toolkit) first, then newest.
    cudas.sort_by_key(|p| {
        let name = p
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        (name != "cuda", std::cmp::Reverse(version_key(&name)))
    });
    for c in cudas {
        dirs.push((c.join("lib64"), "/usr/local/cuda*"));
        dirs.push((c.join("targets/x86_64-linux/lib"), "/usr/local/cuda*"));
    }
    for sp in python_site_packages() {
        let nv = sp.join("nvidia");
        dirs.push((nv.join("cu13/lib"), "python3 site-packages"));
        let mut subs: Vec<PathBuf> = std::fs::read_dir(&nv)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.path().join("lib"))
                    .collect()
            })
            .unwrap_or_default();
        subs.sort();
        dirs.extend(subs.into_iter().map(|d| (d, "python3 site-packages")));
    }
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|(d, _)| seen.insert(d.clone()));
    dirs
}

/// `cuda-12.4` as (12, 4), for sorting toolkits.
fn version_key(name: &str) -> Vec<u32> {
    name.trim_start_matches("cuda")
        .trim_start_matches('-')
        .split('.')
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Folders of the libraries the ld.so cache knows (`ldconfig -p`).
fn ld_cache_dirs() -> Vec<PathBuf> {
    let out = ["/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"]
        .iter()
        .find_map(|c| std::process::Command::new(c).arg("-p").output().ok());
    let Some(out) = out.filter(|o| o.status.success()) else {
        return Vec::new();
    };
    let mut dirs = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some((name, path)) = line.trim().split_once(" => ") else {
            continue;
        };
        let interesting = [
            "libcuda.",
            "libnvrtc.",
            "libcublas",
            "libnccl.",
            "libnvidia-ml.",
        ];
        if !interesting.iter().any(|p| name.starts_with(p)) {
            continue;
        }
        if let Some(dir) = Path::new(path.trim()).parent()
            && !dirs.iter().any(|d: &PathBuf| d == dir)
        {
            dirs.push(dir.to_path_buf());
        }
    }
    dirs
}

/// The active `python3`'s site-packages folders (none without python3).
pub fn python_site_packages() -> Vec<PathBuf> {
    let script =
        "import site,sys\nfor p in site.getsitepackages()+[site.getusersitepackages()]: print(p)";
    python(script, std::time::Duration::from_secs(5))
        .map(|s| {
            s.lines()
                .map(PathBuf::from)
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default()
}

/// Runs `python3 -c script` (`limit` at most), its stdout when it succeeded.
pub fn python(script: &str, limit: std::time::Duration) -> Option<String> {
    let mut child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let deadline = std::time::Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                let mut s = String::new();
                use std::io::Read;
                child.stdout.take()?.read_to_string(&mut s).ok()?;
                return status.success().then_some(s);
            }
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// Finds every library in `dirs`; toolkit libraries newer than the driver's
/// CUDA major (`driver_major`, when known) are passed over.
pub fn find_all(dirs: &[(PathBuf, &'static str)], driver_major: Option<u32>) -> Vec<Found> {
    Lib::ALL
        .iter()
        .map(|&lib| {
            let mut found = Found {
                lib,
                path: None,
                source: None,
                skipped: Vec::new(),
            };
            'dirs: for (dir, why) in dirs {
                for file in lib.files() {
                    let p = dir.join(file);
                    if !p.is_file() {
                        continue;
                    }
                    let too_new = matches!(lib, Lib::Nvrtc | Lib::Cublas | Lib::CublasLt)
                        && matches!((Lib::major_of(file), driver_major), (Some(f), Some(d)) if f > d);
                    if too_new {
                        found.skipped.push(format!(
                            "{} (CUDA {} code; the driver supports CUDA {})",
                            p.display(),
                            Lib::major_of(file).unwrap_or(0),
                            driver_major.unwrap_or(0)
                        ));
                        continue;
                    }
                    found.path = Some(p);
                    found.source = Some(why);
                    break 'dirs;
                }
            }
            found
        })
        .collect()
}

/// The CUDA version the driver at `path` supports (`cuDriverGetVersion`,
/// e.g. 13000), loaded by its exact path; `None` when it cannot be asked.
pub fn driver_version(path: &Path) -> Option<i32> {
    // SAFETY: loading the driver library runs its initialisers, as any CUDA
    // program does; cuDriverGetVersion only writes the int it is given.
    unsafe {
        let lib = libloading::Library::new(path).ok()?;
        let f: libloading::Symbol<unsafe extern "C" fn(*mut i32) -> i32> =
            lib.get(b"cuDriverGetVersion").ok()?;
        let mut v = 0;
        (f(&mut v) == 0).then_some(v)
    }
}

/// Discovery as `--device cuda` sees it: the driver first, then the rest
/// with the driver's CUDA major in mind.
pub fn discover() -> (Vec<Found>, Option<i32>) {
    let dirs = search_dirs();
    let first = find_all(&dirs, None);
    let driver = first
        .iter()
        .find(|f| f.lib == Lib::Driver)
        .and_then(|f| f.path.as_deref())
        .and_then(driver_version);
    let found = match driver {
        Some(v) => find_all(&dirs, Some((v / 1000) as u32)),
        None => first,
    };
    (found, driver)
}

/// One line on a library that is missing: the file wanted, where memfit
/// looked, and the command that fixes it.
pub fn missing_line(f: &Found) -> String {
    let mut s = format!(
        "{} not found: wanted {}",
        f.lib.label(),
        f.lib.files().join(" or ")
    );
    if !f.skipped.is_empty() {
        s.push_str(&format!("; passed over {}", f.skipped.join(", ")));
    }
    s.push_str(&format!(
        "; looked in {LIBS_ENV}, LD_LIBRARY_PATH, the ld.so cache, CUDA_HOME/CUDA_PATH, /usr/local/cuda*/lib64 and python3's site-packages (nvidia/*/lib); fix: {}",
        f.lib.fix()
    ));
    s
}

/// Why `lib` cannot be loaded, for error messages (where it was looked for
/// and the fix), after a loader check failed.
pub fn explain(lib: Lib) -> String {
    let (found, _) = discover();
    match found.iter().find(|f| f.lib == lib) {
        Some(f) if f.path.is_none() => missing_line(f),
        Some(f) => format!(
            "{} was found at {} but could not be loaded under the names cudarc tries; run `memfit doctor`",
            lib.label(),
            f.path
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        ),
        None => lib.fix().to_string(),
    }
}

/// The links folder for `found`: one per user and set of files.
fn links_dir(found: &[Found]) -> PathBuf {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    // The layout's version: a folder made by an older layout is not reused.
    2u32.hash(&mut h);
    for f in found {
        f.path.hash(&mut h);
    }
    let uid = crate::sys::uid();
    let base = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|d| d.is_dir())
        .unwrap_or_else(std::env::temp_dir);
    base.join(format!("memfit-cuda-libs-{uid}"))
        .join(format!("{:016x}", h.finish()))
}

/// Makes the folder of links (`libnvrtc.so` -> the NVRTC found, ...) for
/// `found`; returns it, or why not.
pub fn make_links(found: &[Found]) -> Result<PathBuf, String> {
    let dir = links_dir(found);
    let parent = dir.parent().expect("links dir has a parent");
    std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    // The folder decides which code memfit loads: it must be ours alone
    // (another user could have made it first in a shared /tmp).
    {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let _ = std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o700));
        let meta =
            std::fs::symlink_metadata(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        let uid = crate::sys::uid();
        if meta.uid() != uid || meta.mode() & 0o022 != 0 || !meta.is_dir() {
            return Err(format!(
                "{} is not a folder only this user can write; remove it",
                parent.display()
            ));
        }
    }
    // Built beside, then renamed into place: another memfit may race us.
    let tmp = parent.join(format!(".tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    let link = |target: &Path, name: &std::ffi::OsStr| -> Result<(), String> {
        let at = tmp.join(name);
        if at.symlink_metadata().is_ok() {
            return Ok(()); // an earlier folder's file of that name wins
        }
        let target = std::fs::canonicalize(target).unwrap_or_else(|_| target.to_path_buf());
        std::os::unix::fs::symlink(&target, &at).map_err(|e| format!("{}: {e}", at.display()))
    };
    for f in found {
        if let (Some(path), Some(name)) = (&f.path, f.lib.cudarc_name()) {
            link(path, name.as_ref())?;
        }
    }
    // The found libraries' neighbours too: NVRTC loads its builtins from
    // beside the path it was loaded as (here, the link), cuBLAS its Lt.
    for f in found {
        let Some(dir) = f.path.as_deref().and_then(Path::parent) else {
            continue;
        };
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name();
            if name.to_string_lossy().starts_with("lib") && name.to_string_lossy().contains(".so") {
                link(&entry.path(), &name)?;
            }
        }
    }
    if std::fs::rename(&tmp, &dir).is_err() {
        // Already there (same files, same layout): keep it.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    let complete = found
        .iter()
        .filter(|f| f.path.is_some())
        .filter_map(|f| f.lib.cudarc_name())
        .all(|n| dir.join(n).exists());
    if !complete {
        return Err(format!(
            "{} lacks links it should hold; remove it",
            dir.display()
        ));
    }
    Ok(dir)
}

/// Before anything touches CUDA: find the libraries, put links to them
/// first on `LD_LIBRARY_PATH` and execute memfit again with it (once per
/// process tree, [`READY_ENV`]). Returns when nothing needs doing (nothing
/// found: the errors later say what is missing) or the exec failed.
pub fn prepare() {
    if std::env::var_os(READY_ENV).is_some() {
        return;
    }
    let (found, _) = discover();
    if found
        .iter()
        .all(|f| f.path.is_none() || f.lib.cudarc_name().is_none())
    {
        return;
    }
    let Ok(links) = make_links(&found) else {
        return;
    };
    let mut path = vec![links.clone()];
    for f in &found {
        if let Some(dir) = f.path.as_deref().and_then(Path::parent)
            && !path.iter().any(|p| p == dir)
        {
            path.push(dir.to_path_buf());
        }
    }
    let old = std::env::var_os("LD_LIBRARY_PATH").unwrap_or_default();
    path.extend(std::env::split_paths(&old));
    let Ok(joined) = std::env::join_paths(&path) else {
        return;
    };
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    use std::os::unix::process::CommandExt;
    let err = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("LD_LIBRARY_PATH", joined)
        .env(READY_ENV, &links)
        .env(ORIGINAL_LD_ENV, &old)
        .exec();
    // Only reached when exec failed: go on; loading may still work.
    eprintln!(
        "memfit: could not re-execute with the CUDA libraries' folder on LD_LIBRARY_PATH: {err}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(dir: &Path, name: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(name), b"").unwrap();
    }

    #[test]
    fn first_folder_wins_and_the_newer_major_within_it() {
        let root = std::env::temp_dir().join(format!("memfit-libs-{}", std::process::id()));
        let (a, b) = (root.join("a"), root.join("b"));
        touch(&a, "libnvrtc.so.12");
        touch(&a, "libnvrtc.so.13");
        touch(&b, "libnvrtc.so.13");
        touch(&b, "libnccl.so.2");
        let dirs = vec![(a.clone(), "x"), (b.clone(), "y")];
        let found = find_all(&dirs, None);
        let get = |l: Lib| found.iter().find(|f| f.lib == l).unwrap();
        assert_eq!(get(Lib::Nvrtc).path, Some(a.join("libnvrtc.so.13")));
        assert_eq!(get(Lib::Nccl).path, Some(b.join("libnccl.so.2")));
        assert_eq!(get(Lib::Nccl).source, Some("y"));
        assert!(get(Lib::Cublas).path.is_none());
        // A CUDA 12 driver: NVRTC 13 is passed over, and said so.
        let found = find_all(&dirs, Some(12));
        let nvrtc = found.iter().find(|f| f.lib == Lib::Nvrtc).unwrap();
        assert_eq!(nvrtc.path, Some(a.join("libnvrtc.so.12")));
        assert_eq!(nvrtc.skipped.len(), 1, "{:?}", nvrtc.skipped);
        let line = missing_line(found.iter().find(|f| f.lib == Lib::Cublas).unwrap());
        assert!(
            line.contains("libcublas.so.13 or libcublas.so.12"),
            "{line}"
        );
        assert!(line.contains("pip install nvidia-cublas"), "{line}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn toolkit_folders_sort_default_then_newest() {
        assert_eq!(version_key("cuda-12.4"), vec![12, 4]);
        assert!(version_key("cuda-13.0") > version_key("cuda-12.9"));
    }
}
