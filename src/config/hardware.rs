//! Hardware profiles for the planner: one GPU's memory, peak throughput,
//! interconnect and price. Built-in profiles are embedded in the binary (like
//! the model profiles); a path to a YAML file with the same keys works too.
//! Errors name `file:line[:column]` and suggest the closest known name.

use std::path::Path;

use serde::Deserialize;

use super::profile::{key_location, parse_yaml};
use crate::engine::Precision;
use crate::units::parse_bytes;
use crate::{Error, Result};

macro_rules! builtin {
    ($($name:literal),* $(,)?) => {
        &[$(($name, include_str!(concat!("../../profiles/hardware/", $name, ".yaml")))),*]
    };
}

static BUILTIN_HARDWARE: &[(&str, &str)] = builtin!(
    "h100-sxm-80gb",
    "h200-141gb",
    "a100-40gb",
    "a100-80gb",
    "l40s",
    "rtx-a6000",
    "l4",
    "a10g",
    "rtx-4090",
    "rtx-3090",
    "t4",
);

/// One GPU, as the planner sees it. Throughputs are dense (no sparsity) peaks.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct HardwareProfile {
    pub name: String,
    pub display_name: String,
    /// Device memory in bytes, as the driver reports it.
    pub memory: u64,
    pub bf16_tflops: f64,
    pub fp16_tflops: f64,
    /// Non-tensor-core FP32 peak.
    pub fp32_tflops: f64,
    /// GB/s (10^9 bytes per second).
    pub memory_bandwidth_gbps: f64,
    /// `nvlink4`, `pcie4`, ...
    pub interconnect: String,
    /// Per GPU, per direction, GB/s usable for collectives.
    pub interconnect_gbps: f64,
    /// Typical on-demand price per GPU-hour.
    pub usd_per_hour: f64,
    /// Bytes of `memory` that tensors cannot use: driver reservations, the
    /// CUDA context, library workspaces and communication buffers.
    pub runtime_overhead: u64,
}

impl HardwareProfile {
    /// Peak dense FLOP/s for matmuls at `precision`.
    pub fn peak_flops(&self, precision: Precision) -> f64 {
        let tflops = match precision {
            Precision::Fp32 => self.fp32_tflops,
            Precision::Bf16 => self.bf16_tflops,
            Precision::Fp16 => self.fp16_tflops,
        };
        tflops * 1e12
    }

    /// Bytes left for tensors once the runtime has taken its share.
    pub fn usable_memory(&self) -> u64 {
        self.memory.saturating_sub(self.runtime_overhead)
    }
}

/// The file's keys, before sizes are parsed.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHardware {
    name: String,
    display_name: String,
    memory: Size,
    bf16_tflops: f64,
    fp16_tflops: f64,
    fp32_tflops: f64,
    memory_bandwidth_gbps: f64,
    interconnect: String,
    interconnect_gbps: f64,
    usd_per_hour: f64,
    runtime_overhead: Size,
}

/// A size as written: "80GiB", or a bare number of bytes.
struct Size(String);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Size;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a size such as 80GiB or 512MiB")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Size, E> {
                Ok(Size(v.to_string()))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Size, E> {
                Ok(Size(v.to_string()))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Size, E> {
                Ok(Size(v.to_string()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Size, E> {
                Ok(Size(v.to_string()))
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// The built-in hardware profiles, `(name, yaml text)`, in a stable order.
pub fn builtin_hardware() -> &'static [(&'static str, &'static str)] {
    BUILTIN_HARDWARE
}

/// Loads a hardware profile by built-in name, or from a YAML file.
///
/// `spec` is a built-in name if one matches; otherwise a path when it contains
/// `/`, ends in `.yaml`/`.yml`, or names an existing file (the same rules as
/// `load_model`); otherwise an error that suggests the closest built-in name.
pub fn load_hardware(spec: &str) -> Result<HardwareProfile> {
    if let Some((name, text)) = BUILTIN_HARDWARE.iter().find(|(name, _)| *name == spec) {
        return parse_hardware_yaml(text, &format!("profiles/hardware/{name}.yaml"));
    }
    let looks_like_path = spec.contains('/')
        || spec.contains(std::path::MAIN_SEPARATOR)
        || spec.ends_with(".yaml")
        || spec.ends_with(".yml");
    if looks_like_path || Path::new(spec).is_file() {
        let text = super::input::read_text(Path::new(spec))?;
        return parse_hardware_yaml(&text, spec);
    }
    let names: Vec<&str> = BUILTIN_HARDWARE.iter().map(|(name, _)| *name).collect();
    let suggestion = match suggest(spec, &names)[..] {
        [] => String::new(),
        [one] => format!(" (did you mean `{one}`?)"),
        ref many => format!(" (did you mean one of `{}`?)", many.join("`, `")),
    };
    // Not `Error::Config`: like `Error::UnknownModel`, this carries no file
    // location of its own, so a caller reading the name from a file (the
    // planner's recipes) can relocate it to that file's line.
    Err(Error::InvalidArg {
        flag: "hardware".into(),
        message: format!(
            "`{spec}` is not a built-in hardware profile{suggestion}; known hardware: {}. \
             A path to a hardware profile YAML also works",
            names.join(", ")
        ),
    })
}

/// Parses and validates one hardware profile. `location` names the file in errors.
pub fn parse_hardware_yaml(text: &str, location: &str) -> Result<HardwareProfile> {
    let text = super::input::strip_bom(text);
    let raw: RawHardware = parse_yaml(text, location)?;
    let invalid = |key: &str, message: String| Error::Config {
        location: key_location(text, location, key),
        message: format!("`{key}`: {message}"),
    };
    let size = |key: &str, value: &Size| -> Result<u64> {
        let bytes = parse_bytes(&value.0).map_err(|m| invalid(key, m))?;
        if bytes == 0 {
            return Err(invalid(key, "must be greater than zero".into()));
        }
        Ok(bytes)
    };
    for (key, value) in [
        ("name", &raw.name),
        ("display_name", &raw.display_name),
        ("interconnect", &raw.interconnect),
    ] {
        if value.trim().is_empty() {
            return Err(invalid(key, "must not be empty".into()));
        }
    }
    for (key, value) in [
        ("bf16_tflops", raw.bf16_tflops),
        ("fp16_tflops", raw.fp16_tflops),
        ("fp32_tflops", raw.fp32_tflops),
        ("memory_bandwidth_gbps", raw.memory_bandwidth_gbps),
        ("interconnect_gbps", raw.interconnect_gbps),
        ("usd_per_hour", raw.usd_per_hour),
    ] {
        if !(value.is_finite() && value > 0.0) {
            return Err(invalid(
                key,
                format!("must be a finite number greater than zero, not {value}"),
            ));
        }
    }
    let memory = size("memory", &raw.memory)?;
    let runtime_overhead = size("runtime_overhead", &raw.runtime_overhead)?;
    if runtime_overhead >= memory {
        return Err(invalid(
            "runtime_overhead",
            format!(
                "{} leaves nothing of the {} of `memory`",
                crate::units::fmt_bytes(runtime_overhead),
                crate::units::fmt_bytes(memory)
            ),
        ));
    }
    Ok(HardwareProfile {
        name: raw.name,
        display_name: raw.display_name,
        memory,
        bf16_tflops: raw.bf16_tflops,
        fp16_tflops: raw.fp16_tflops,
        fp32_tflops: raw.fp32_tflops,
        memory_bandwidth_gbps: raw.memory_bandwidth_gbps,
        interconnect: raw.interconnect,
        interconnect_gbps: raw.interconnect_gbps,
        usd_per_hour: raw.usd_per_hour,
        runtime_overhead,
    })
}

/// Names to suggest for an unknown `word`, ignoring case: a name equal to it,
/// else every name containing it ("4090" -> `rtx-4090`, "a100" -> both
/// A100s), else the closest name by edit distance if it is a plausible typo.
fn suggest<'a>(word: &str, names: &[&'a str]) -> Vec<&'a str> {
    let word = word.trim().to_ascii_lowercase();
    if word.is_empty() {
        return Vec::new();
    }
    if let Some(&exact) = names.iter().find(|&&name| name == word) {
        return vec![exact];
    }
    let containing: Vec<&str> = names
        .iter()
        .copied()
        .filter(|name| name.contains(word.as_str()))
        .collect();
    if !containing.is_empty() {
        return containing;
    }
    super::profile::closest(&word, names.iter().copied())
        .map(|name| vec![name])
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn h100_text() -> &'static str {
        BUILTIN_HARDWARE[0].1
    }

    /// 1-based line of the first line of `text` starting with `prefix`.
    fn line_of(text: &str, prefix: &str) -> usize {
        text.lines().position(|l| l.starts_with(prefix)).unwrap() + 1
    }

    #[test]
    fn every_builtin_parses_and_is_named_after_its_file() {
        let names: Vec<&str> = builtin_hardware().iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                "h100-sxm-80gb",
                "h200-141gb",
                "a100-40gb",
                "a100-80gb",
                "l40s",
                "rtx-a6000",
                "l4",
                "a10g",
                "rtx-4090",
                "rtx-3090",
                "t4",
            ]
        );
        for (name, _) in builtin_hardware() {
            let hw = load_hardware(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(hw.name, *name, "profile name matches its file");
            assert!(hw.usable_memory() > hw.memory / 2, "{name}");
            // Tensor cores are never slower than plain FP32 (T4 has no BF16
            // tensor mode, so its BF16 equals its FP32).
            assert!(hw.bf16_tflops >= hw.fp32_tflops, "{name}");
            assert!(hw.fp16_tflops >= hw.fp32_tflops, "{name}");
        }
    }

    #[test]
    fn every_builtin_file_is_listed() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("profiles/hardware");
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
            .map(|p| p.file_stem().unwrap().to_str().unwrap().to_string())
            .collect();
        files.sort();
        let mut names: Vec<&str> = builtin_hardware().iter().map(|(n, _)| *n).collect();
        names.sort();
        assert_eq!(files, names);
    }

    #[test]
    fn h100_figures() {
        let hw = load_hardware("h100-sxm-80gb").unwrap();
        assert_eq!(hw.memory, 80 * GIB);
        assert_eq!(hw.display_name, "NVIDIA H100 SXM5 80GB");
        assert_eq!(hw.interconnect, "nvlink4");
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b;
        assert!(close(hw.peak_flops(Precision::Bf16), 989.4e12));
        assert!(close(hw.peak_flops(Precision::Fp16), 989.4e12));
        assert!(close(hw.peak_flops(Precision::Fp32), 66.9e12));
        let t4 = load_hardware("t4").unwrap();
        assert!(close(t4.peak_flops(Precision::Fp16), 65e12));
        assert!(close(t4.peak_flops(Precision::Bf16), 8.1e12));
        assert_eq!(hw.usable_memory(), hw.memory - hw.runtime_overhead);
    }

    #[test]
    fn reported_sizes() {
        let mib = |n: u64| n << 20;
        for (name, bytes) in [
            ("h200-141gb", mib(143_771)),
            ("a100-40gb", 40 * GIB),
            ("a100-80gb", 80 * GIB),
            ("l40s", mib(46_068)),
            ("l4", mib(23_034)),
            ("t4", 15 * GIB),
        ] {
            assert_eq!(load_hardware(name).unwrap().memory, bytes, "{name}");
        }
    }

    #[test]
    fn misspelled_key_suggests_with_file_line_column() {
        let text = h100_text().replace("bf16_tflops:", "bf16_tflop:");
        let line = line_of(&text, "bf16_tflop:");
        let err = parse_hardware_yaml(&text, "x.yaml").unwrap_err();
        assert!(matches!(err, Error::Config { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.starts_with(&format!("x.yaml:{line}:")), "{msg}");
        let column = msg.split(':').nth(2).unwrap();
        assert!(column.parse::<usize>().is_ok(), "{msg}");
        assert!(msg.contains("did you mean `bf16_tflops`?"), "{msg}");
    }

    #[test]
    fn missing_key_is_reported() {
        let text: String = h100_text()
            .lines()
            .filter(|l| !l.starts_with("usd_per_hour:"))
            .map(|l| format!("{l}\n"))
            .collect();
        let msg = parse_hardware_yaml(&text, "x.yaml")
            .unwrap_err()
            .to_string();
        assert!(msg.starts_with("x.yaml"), "{msg}");
        assert!(msg.contains("missing field `usd_per_hour`"), "{msg}");
    }

    /// The error for the H100 profile with line `from` replaced by `to`,
    /// checked to name the file, `to`'s line and `key`.
    fn located_error(from: &str, to: &str, key: &str) -> String {
        let text = h100_text().replace(from, to);
        assert_ne!(text, h100_text(), "{from}");
        let line = line_of(&text, to);
        let msg = parse_hardware_yaml(&text, "x.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            msg.starts_with(&format!("x.yaml:{line}: `{key}`: ")),
            "{msg}"
        );
        msg
    }

    #[test]
    fn bad_size_names_the_key_and_line() {
        let msg = located_error("memory: 80GiB", "memory: 80 gigs", "memory");
        assert!(msg.contains("`80 gigs`"), "{msg}");
        located_error(
            "runtime_overhead: 2GiB",
            "runtime_overhead: lots",
            "runtime_overhead",
        );
    }

    #[test]
    fn bare_byte_counts_are_sizes() {
        let text = h100_text().replace("memory: 80GiB", "memory: 85899345920");
        let hw = parse_hardware_yaml(&text, "x.yaml").unwrap();
        assert_eq!(hw.memory, 80 * GIB);
    }

    #[test]
    fn numbers_must_be_finite_and_positive() {
        for (from, to, key) in [
            ("bf16_tflops: 989.4", "bf16_tflops: 0", "bf16_tflops"),
            ("fp32_tflops: 66.9", "fp32_tflops: -1", "fp32_tflops"),
            ("usd_per_hour: 2.99", "usd_per_hour: .nan", "usd_per_hour"),
            (
                "interconnect_gbps: 450",
                "interconnect_gbps: .inf",
                "interconnect_gbps",
            ),
            ("memory: 80GiB", "memory: 0GiB", "memory"),
            (
                "runtime_overhead: 2GiB",
                "runtime_overhead: 90GiB",
                "runtime_overhead",
            ),
        ] {
            located_error(from, to, key);
        }
    }

    #[test]
    fn empty_name_is_rejected() {
        let msg = located_error("name: h100-sxm-80gb", "name: \"\"", "name");
        let line = line_of(h100_text(), "name:");
        assert_eq!(msg, format!("x.yaml:{line}: `name`: must not be empty"));
    }

    #[test]
    fn unknown_name_suggests_closest() {
        let err = load_hardware("h100-sxm-80gbb").unwrap_err();
        assert!(matches!(err, Error::InvalidArg { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.starts_with("hardware: `h100-sxm-80gbb` "), "{msg}");
        assert!(msg.contains("did you mean `h100-sxm-80gb`?"), "{msg}");
        assert!(msg.contains("rtx-3090"), "{msg}");

        let msg = load_hardware("rtx4090").unwrap_err().to_string();
        assert!(msg.contains("did you mean `rtx-4090`?"), "{msg}");
        let msg = load_hardware("H200-141GB").unwrap_err().to_string();
        assert!(msg.contains("did you mean `h200-141gb`?"), "{msg}");
        let msg = load_hardware("h100").unwrap_err().to_string();
        assert!(msg.contains("did you mean `h100-sxm-80gb`?"), "{msg}");
        let msg = load_hardware("a100").unwrap_err().to_string();
        assert!(
            msg.contains("did you mean one of `a100-40gb`, `a100-80gb`?"),
            "{msg}"
        );
        let msg = load_hardware("zzzzzzzzzzzz").unwrap_err().to_string();
        assert!(!msg.contains("did you mean"), "{msg}");
    }

    #[test]
    fn paths_load_and_missing_files_are_io_errors() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("profiles/hardware/l4.yaml");
        let hw = load_hardware(path.to_str().unwrap()).unwrap();
        assert_eq!(hw, load_hardware("l4").unwrap());

        let err = load_hardware("no/such/gpu.yaml").unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err}");
        assert!(err.to_string().contains("no/such/gpu.yaml"), "{err}");
    }
}
