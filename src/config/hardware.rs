//! Hardware profiles for the planner: one GPU's memory, peak throughput,
//! interconnect, the node it sits in and price. Built-in profiles are embedded
//! in the binary (like the model profiles); a path to a YAML file with the same
//! keys works too. Errors name `file:line[:column]` and suggest the closest
//! known name.
//!
//! Network profiles (`profiles/networks/`) describe a cluster fabric on their
//! own (a NIC's bandwidth and latency), to price the link between nodes with
//! another network than the one a hardware profile assumes; they load the same
//! way ([`load_network`]). `comm::topology` prices collectives on both.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

use super::attention_kernels::{AttentionKernel, KernelRates};
use super::knobs::Precision;
use super::profile::{key_location, parse_yaml};
use crate::units::parse_bytes;
use crate::{Error, Result};

/// `(name, text)` of each `profiles/<dir>/<name>.yaml`, embedded.
macro_rules! builtin {
    ($dir:literal: $($name:literal),* $(,)?) => {
        &[$(($name, include_str!(concat!("../../profiles/", $dir, "/", $name, ".yaml")))),*]
    };
}

static BUILTIN_HARDWARE: &[(&str, &str)] = builtin!(
    "hardware":
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

static BUILTIN_NETWORKS: &[(&str, &str)] = builtin!(
    "networks":
    "ib-ndr-400",
    "ib-hdr-200",
    "roce-200",
    "eth-100",
    "eth-25",
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
    // The node. `interconnect` and `interconnect_gbps` above are its
    // intra-node link; the keys below are optional in a profile file, and a
    // file without them gets the defaults named on each.
    /// GPUs in one node (server), all joined by `interconnect`. Default 8.
    pub gpus_per_node: u32,
    /// Microseconds one step of a collective takes over `interconnect` for a
    /// tiny message (NCCL's low-latency protocol). Default 0.6 for NVLink,
    /// 1.0 otherwise (the per-hop figures of NCCL's tuning model).
    pub intra_node_latency_us: f64,
    /// Whether the node's NVSwitches reduce in the switch (NVLink SHARP,
    /// third-generation NVSwitch: HGX H100/H200), which NCCL uses for
    /// all-reduce inside a node. Default false.
    pub intra_node_nvls: bool,
    /// The network between nodes, e.g. `ib-ndr-400`. Default `eth-100`.
    pub inter_node: String,
    /// Per GPU, per direction, GB/s of network line rate: the node's NIC
    /// bandwidth divided by `gpus_per_node`. Default 1.5625 (one 100 Gb/s
    /// Ethernet port shared by 8 GPUs).
    pub inter_node_gbps: f64,
    /// Microseconds one step of a collective takes across the network for a
    /// tiny message. Default 10 (TCP sockets).
    pub inter_node_latency_us: f64,
    /// The network's non-blocking pod and the oversubscription above it
    /// ([`NetworkProfile::pod_nodes`]); set by a network profile only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inter_node_pod_nodes: Option<u32>,
    #[serde(skip_serializing_if = "is_one")]
    pub inter_node_oversubscription: f64,
    // The host, for offload (ZeRO-Offload): optional keys too.
    /// Per GPU, per direction, GB/s of its link to host memory (PCIe).
    /// Default 32 (PCIe 4.0 x16).
    pub host_link_gbps: f64,
    /// GB/s of the node's CPU memory bandwidth, shared by its GPUs' CPU
    /// optimizer updates. Default 204.8 (8 channels of DDR4-3200).
    pub host_memory_bandwidth_gbps: f64,
    /// The node's host memory; `None`: this machine's available memory.
    pub host_memory: Option<u64>,
    // The kernels' shapes, for the time model: optional keys.
    /// Streaming multiprocessors: how many GEMM tiles run at once (one
    /// wave). `None`: GEMMs are priced without tile and wave quantization.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sm_count: Option<u32>,
    /// The share of the dense peak that large GEMMs sustain inside a
    /// training step on this GPU, where the profile has one of its own
    /// (fitted to published runs; its comment says which). `None`:
    /// `plan::COMPUTE_EFFICIENCY`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gemm_efficiency: Option<f64>,
    /// The share of the dense 16-bit peak that fused (flash) attention's
    /// forward and backward reach together. `None`: the GEMMs' share.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fused_attention_efficiency: Option<f64>,
    /// Fused attention kernels' rates on this GPU (published, or fitted
    /// where the profile's comment says so), by kernel
    /// ([`attention_kernels`](super::attention_kernels)); where the
    /// kernel priced has some, they replace `fused_attention_efficiency`.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub attention_kernels: BTreeMap<AttentionKernel, KernelRates>,
    /// The kernel fused attention is priced at: a plan recipe's
    /// `attention_kernel` ([`HardwareProfile::use_attention_kernel`]).
    pub attention_kernel: AttentionKernel,
    /// This GPU's roofline as `memfit calibrate --device cuda` measured it,
    /// when a stored calibration is bound to this profile and the plan
    /// uses it (`plan::plan_file_measured`); never read from a profile file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub measured: Option<Box<super::gpu_calibration::GpuCalibration>>,
}

impl HardwareProfile {
    /// Puts this profile's nodes on `net` instead of the network they have.
    pub fn use_network(&mut self, net: &NetworkProfile) {
        self.inter_node = net.name.clone();
        self.inter_node_gbps = net.per_gpu_gbps(self.gpus_per_node);
        self.inter_node_latency_us = net.latency_us;
        self.inter_node_pod_nodes = net.pod_nodes;
        self.inter_node_oversubscription = net.oversubscription;
    }

    /// Prices fused attention at `kernel`'s rates in the profile. The default
    /// kernel (FlashAttention-2) needs none: without them the profile's
    /// `fused_attention_efficiency` prices it. Any other kernel must have
    /// rates in this profile.
    pub fn use_attention_kernel(&mut self, kernel: AttentionKernel) -> Result<(), String> {
        if kernel != AttentionKernel::default() && !self.attention_kernels.contains_key(&kernel) {
            let have: Vec<&str> = self.attention_kernels.keys().map(|k| k.name()).collect();
            return Err(format!(
                "hardware profile `{}` gives no rates for the `{kernel}` attention kernel, so a plan cannot price it; {}",
                self.name,
                match have.is_empty() {
                    true => "it gives none for any kernel (its `attention_kernels` key is absent): fused attention is priced at its `fused_attention_efficiency`".to_string(),
                    false => format!("it gives rates for {}", have.join(", ")),
                }
            ));
        }
        self.attention_kernel = kernel;
        Ok(())
    }

    /// The rates fused attention is priced at, if the profile
    /// has them for the kernel chosen.
    pub fn attention_rates(&self) -> Option<&KernelRates> {
        self.attention_kernels.get(&self.attention_kernel)
    }

    /// The same GPU held to a lower SM clock (a power limit): every rate the
    /// SM clock sets (the tensor cores' 16-bit peaks, the fp32 peak and the
    /// published fused-attention rates) scaled so the bf16 peak is
    /// `bf16_tflops`. Memory bandwidth, links and shares of the peak are the
    /// memory's and the network's, and stay. A stored measurement is dropped:
    /// it was taken at the clock this replaces.
    pub fn at_tensor_rate(&self, bf16_tflops: f64) -> HardwareProfile {
        let f = bf16_tflops / self.bf16_tflops;
        let mut hw = self.clone();
        hw.bf16_tflops *= f;
        hw.fp16_tflops *= f;
        hw.fp32_tflops *= f;
        for rates in hw.attention_kernels.values_mut() {
            for by_len in rates.values_mut() {
                by_len.values_mut().for_each(|r| *r *= f);
            }
        }
        hw.measured = None;
        hw
    }

    /// Peak dense FLOP/s for matmuls at `precision`.
    pub fn peak_flops(&self, precision: Precision) -> f64 {
        let tflops = match precision.rate() {
            Precision::Fp32 => self.fp32_tflops,
            Precision::Bf16 | Precision::Bf16Pure => self.bf16_tflops,
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
    gpus_per_node: Option<u32>,
    intra_node_latency_us: Option<f64>,
    intra_node_nvls: Option<bool>,
    inter_node: Option<String>,
    inter_node_gbps: Option<f64>,
    inter_node_latency_us: Option<f64>,
    host_link_gbps: Option<f64>,
    host_memory_bandwidth_gbps: Option<f64>,
    host_memory: Option<Size>,
    sm_count: Option<u32>,
    gemm_efficiency: Option<f64>,
    fused_attention_efficiency: Option<f64>,
    #[serde(default)]
    attention_kernels: BTreeMap<AttentionKernel, KernelRates>,
}

/// Defaults of the node keys for a profile file without them: an 8-GPU
/// server on one shared 100 Gb/s Ethernet port, talking TCP.
const DEFAULT_GPUS_PER_NODE: u32 = 8;
const DEFAULT_INTER_NODE: &str = "eth-100";
const DEFAULT_INTER_NODE_GBPS: f64 = 12.5 / 8.0;
const DEFAULT_INTER_NODE_LATENCY_US: f64 = 10.0;
/// Largest `gpus_per_node` (or `nics_per_node`) accepted: a typo guard, well
/// above any NVLink domain (GB200 NVL72 has 72).
const MAX_PER_NODE: u32 = 1024;

fn is_one(x: &f64) -> bool {
    *x == 1.0
}

/// One network fabric, as a network profile file describes it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct NetworkProfile {
    pub name: String,
    pub display_name: String,
    /// GB/s of line rate per NIC (port), one direction.
    pub nic_gbps: f64,
    /// NICs in one node; `None`: one per GPU, as in rail-optimised clusters
    /// (DGX/HGX nodes have one NIC per GPU).
    pub nics_per_node: Option<u32>,
    /// Microseconds one step of a collective takes across this network for a
    /// tiny message.
    pub latency_us: f64,
    /// Nodes under one non-blocking tier of the fabric (a leaf group, or a
    /// DGX SuperPOD scalable unit of 32 nodes); `None`: the whole fabric
    /// is non-blocking.
    pub pod_nodes: Option<u32>,
    /// How much the tier above `pod_nodes` is oversubscribed (2 for 2:1):
    /// a group spanning more than one pod gets this fraction of its NIC
    /// bandwidth. 1 (the default) is a full fat tree.
    pub oversubscription: f64,
}

impl NetworkProfile {
    /// GB/s per GPU, one direction, in a node of `gpus_per_node` GPUs: the
    /// node's NICs shared evenly among its GPUs.
    pub fn per_gpu_gbps(&self, gpus_per_node: u32) -> f64 {
        match self.nics_per_node {
            None => self.nic_gbps,
            Some(nics) => self.nic_gbps * f64::from(nics) / f64::from(gpus_per_node.max(1)),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNetwork {
    name: String,
    display_name: String,
    nic_gbps: f64,
    nics_per_node: Option<u32>,
    latency_us: f64,
    pod_nodes: Option<u32>,
    oversubscription: Option<f64>,
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
    load_named(spec, &HARDWARE_CATALOG, parse_hardware_yaml)
}

/// The built-in network profiles, `(name, yaml text)`, in a stable order.
pub fn builtin_networks() -> &'static [(&'static str, &'static str)] {
    BUILTIN_NETWORKS
}

/// Loads a network profile by built-in name, or from a YAML file, by the same
/// rules as [`load_hardware`].
pub fn load_network(spec: &str) -> Result<NetworkProfile> {
    load_named(spec, &NETWORK_CATALOG, parse_network_yaml)
}

/// One kind of profile the loader knows: its built-ins and how errors name it.
struct Catalog {
    builtins: &'static [(&'static str, &'static str)],
    /// Where the built-ins live, for error locations: `profiles/hardware`.
    dir: &'static str,
    /// The flag an unknown name is blamed on.
    flag: &'static str,
    /// "hardware profile".
    noun: &'static str,
    /// "hardware" in "known hardware: ...".
    known: &'static str,
}

static HARDWARE_CATALOG: Catalog = Catalog {
    builtins: BUILTIN_HARDWARE,
    dir: "profiles/hardware",
    flag: "hardware",
    noun: "hardware profile",
    known: "hardware",
};

static NETWORK_CATALOG: Catalog = Catalog {
    builtins: BUILTIN_NETWORKS,
    dir: "profiles/networks",
    flag: "network",
    noun: "network profile",
    known: "networks",
};

fn load_named<T>(spec: &str, catalog: &Catalog, parse: fn(&str, &str) -> Result<T>) -> Result<T> {
    let builtins = catalog.builtins;
    if let Some((name, text)) = builtins.iter().find(|(name, _)| *name == spec) {
        return parse(text, &format!("{}/{name}.yaml", catalog.dir));
    }
    let looks_like_path = spec.contains('/')
        || spec.contains(std::path::MAIN_SEPARATOR)
        || spec.ends_with(".yaml")
        || spec.ends_with(".yml");
    if looks_like_path || Path::new(spec).is_file() {
        let text = super::input::read_text(Path::new(spec))?;
        return parse(&text, spec);
    }
    let names: Vec<&str> = builtins.iter().map(|(name, _)| *name).collect();
    let suggestion = match suggest(spec, &names)[..] {
        [] => String::new(),
        [one] => format!(" (did you mean `{one}`?)"),
        ref many => format!(" (did you mean one of `{}`?)", many.join("`, `")),
    };
    // Not `Error::Config`: like `Error::UnknownModel`, this carries no file
    // location of its own, so a caller reading the name from a file (the
    // planner's recipes) can relocate it to that file's line.
    Err(Error::InvalidArg {
        flag: catalog.flag.into(),
        message: format!(
            "`{spec}` is not a built-in {noun}{suggestion}; known {known}: {}. \
             A path to a {noun} YAML also works",
            names.join(", "),
            noun = catalog.noun,
            known = catalog.known,
        ),
    })
}

/// `Error::Config` at `key`'s line of `text`.
fn invalid_key(text: &str, location: &str, key: &str, message: String) -> Error {
    Error::Config {
        location: key_location(text, location, key),
        message: format!("`{key}`: {message}"),
    }
}

/// Checks that each `(key, value)` is finite and greater than zero (or, with
/// `allow_zero`, at least zero).
fn check_numbers(
    text: &str,
    location: &str,
    numbers: &[(&str, f64)],
    allow_zero: bool,
) -> Result<()> {
    for &(key, value) in numbers {
        let ok = value.is_finite() && (value > 0.0 || (allow_zero && value == 0.0));
        if !ok {
            let bound = if allow_zero {
                "at least zero"
            } else {
                "greater than zero"
            };
            return Err(invalid_key(
                text,
                location,
                key,
                format!("must be a finite number {bound}, not {value}"),
            ));
        }
    }
    Ok(())
}

/// Checks that each `(key, value)` is not blank.
fn check_names(text: &str, location: &str, names: &[(&str, &str)]) -> Result<()> {
    for &(key, value) in names {
        if value.trim().is_empty() {
            return Err(invalid_key(text, location, key, "must not be empty".into()));
        }
    }
    Ok(())
}

/// Checks a per-node count: 1 to [`MAX_PER_NODE`].
fn check_count(text: &str, location: &str, key: &str, value: u32) -> Result<()> {
    if !(1..=MAX_PER_NODE).contains(&value) {
        return Err(invalid_key(
            text,
            location,
            key,
            format!("must be between 1 and {MAX_PER_NODE}, not {value}"),
        ));
    }
    Ok(())
}

/// Parses and validates one hardware profile. `location` names the file in errors.
pub fn parse_hardware_yaml(text: &str, location: &str) -> Result<HardwareProfile> {
    let text = super::input::strip_bom(text);
    let raw: RawHardware = parse_yaml(text, location)?;
    let invalid = |key: &str, message: String| invalid_key(text, location, key, message);
    let size = |key: &str, value: &Size| -> Result<u64> {
        let bytes = parse_bytes(&value.0).map_err(|m| invalid(key, m))?;
        if bytes == 0 {
            return Err(invalid(key, "must be greater than zero".into()));
        }
        Ok(bytes)
    };
    // The same rule as `comm::topology::LinkKind::of_interconnect`.
    let nvlink = raw
        .interconnect
        .trim()
        .to_ascii_lowercase()
        .starts_with("nvlink");
    let gpus_per_node = raw.gpus_per_node.unwrap_or(DEFAULT_GPUS_PER_NODE);
    let intra_node_latency_us = raw
        .intra_node_latency_us
        .unwrap_or(if nvlink { 0.6 } else { 1.0 });
    let inter_node = raw
        .inter_node
        .unwrap_or_else(|| DEFAULT_INTER_NODE.to_string());
    let inter_node_gbps = raw.inter_node_gbps.unwrap_or(DEFAULT_INTER_NODE_GBPS);
    let inter_node_latency_us = raw
        .inter_node_latency_us
        .unwrap_or(DEFAULT_INTER_NODE_LATENCY_US);
    let host_link_gbps = raw.host_link_gbps.unwrap_or(32.0);
    let host_memory_bandwidth_gbps = raw.host_memory_bandwidth_gbps.unwrap_or(204.8);
    check_names(
        text,
        location,
        &[
            ("name", &raw.name),
            ("display_name", &raw.display_name),
            ("interconnect", &raw.interconnect),
            ("inter_node", &inter_node),
        ],
    )?;
    check_numbers(
        text,
        location,
        &[
            ("bf16_tflops", raw.bf16_tflops),
            ("fp16_tflops", raw.fp16_tflops),
            ("fp32_tflops", raw.fp32_tflops),
            ("memory_bandwidth_gbps", raw.memory_bandwidth_gbps),
            ("interconnect_gbps", raw.interconnect_gbps),
            ("usd_per_hour", raw.usd_per_hour),
            ("inter_node_gbps", inter_node_gbps),
            ("host_link_gbps", host_link_gbps),
            ("host_memory_bandwidth_gbps", host_memory_bandwidth_gbps),
        ],
        false,
    )?;
    check_numbers(
        text,
        location,
        &[
            ("intra_node_latency_us", intra_node_latency_us),
            ("inter_node_latency_us", inter_node_latency_us),
        ],
        true,
    )?;
    check_count(text, location, "gpus_per_node", gpus_per_node)?;
    if let Some(sms) = raw.sm_count {
        check_count(text, location, "sm_count", sms)?;
    }
    for (key, share) in [
        ("gemm_efficiency", raw.gemm_efficiency),
        ("fused_attention_efficiency", raw.fused_attention_efficiency),
    ] {
        if let Some(f) = share
            && !(f > 0.0 && f <= 1.0)
        {
            return Err(invalid(
                key,
                format!("{f} is not a share of the peak in (0, 1]"),
            ));
        }
    }
    for (&kernel, rates) in &raw.attention_kernels {
        super::attention_kernels::check(kernel, rates)
            .map_err(|m| invalid("attention_kernels", m))?;
    }
    let intra_node_nvls = raw.intra_node_nvls.unwrap_or(false);
    if intra_node_nvls && !nvlink {
        return Err(invalid(
            "intra_node_nvls",
            format!(
                "NVLink SHARP needs an NVLink interconnect, not `{}`",
                raw.interconnect
            ),
        ));
    }
    let memory = size("memory", &raw.memory)?;
    let runtime_overhead = size("runtime_overhead", &raw.runtime_overhead)?;
    let host_memory = match &raw.host_memory {
        Some(v) => Some(size("host_memory", v)?),
        None => None,
    };
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
        gpus_per_node,
        intra_node_latency_us,
        intra_node_nvls,
        inter_node,
        inter_node_gbps,
        inter_node_latency_us,
        inter_node_pod_nodes: None,
        inter_node_oversubscription: 1.0,
        host_link_gbps,
        host_memory_bandwidth_gbps,
        host_memory,
        sm_count: raw.sm_count,
        gemm_efficiency: raw.gemm_efficiency,
        fused_attention_efficiency: raw.fused_attention_efficiency,
        attention_kernels: raw.attention_kernels,
        attention_kernel: AttentionKernel::default(),
        measured: None,
    })
}

/// Parses and validates one network profile. `location` names the file in errors.
pub fn parse_network_yaml(text: &str, location: &str) -> Result<NetworkProfile> {
    let text = super::input::strip_bom(text);
    let raw: RawNetwork = parse_yaml(text, location)?;
    check_names(
        text,
        location,
        &[("name", &raw.name), ("display_name", &raw.display_name)],
    )?;
    check_numbers(text, location, &[("nic_gbps", raw.nic_gbps)], false)?;
    check_numbers(text, location, &[("latency_us", raw.latency_us)], true)?;
    if let Some(nics) = raw.nics_per_node {
        check_count(text, location, "nics_per_node", nics)?;
    }
    if let Some(nodes) = raw.pod_nodes {
        check_count(text, location, "pod_nodes", nodes)?;
    }
    let oversubscription = raw.oversubscription.unwrap_or(1.0);
    if !(oversubscription.is_finite() && oversubscription >= 1.0) {
        return Err(invalid_key(
            text,
            location,
            "oversubscription",
            format!(
                "must be a finite number of at least 1 (1 is non-blocking, 2 is 2:1), not {oversubscription}"
            ),
        ));
    }
    Ok(NetworkProfile {
        name: raw.name,
        display_name: raw.display_name,
        nic_gbps: raw.nic_gbps,
        nics_per_node: raw.nics_per_node,
        latency_us: raw.latency_us,
        pod_nodes: raw.pod_nodes,
        oversubscription,
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

/// The built-in hardware profile a GPU that NVML names `gpu_name`, with
/// `memory_total` bytes, is: the one whose model words ("A100", "RTX 4090")
/// are all in the name, the closest in memory when several are.
pub fn match_profile(gpu_name: &str, memory_total: u64) -> Option<&'static str> {
    let tokens: Vec<String> = gpu_name
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|t| !t.is_empty())
        .map(str::to_ascii_uppercase)
        .collect();
    builtin_hardware()
        .iter()
        .filter_map(|(n, _)| load_hardware(n).ok().map(|hw| (*n, hw)))
        .filter(|(_, hw)| {
            let words: Vec<String> = (hw.display_name.split_whitespace())
                .map(str::to_ascii_uppercase)
                .filter(|w| {
                    !matches!(w.as_str(), "NVIDIA" | "GEFORCE" | "(AWS)")
                        && !w.starts_with("SXM")
                        && !w.ends_with("GB")
                })
                .collect();
            !words.is_empty() && words.iter().all(|w| tokens.contains(w))
        })
        .min_by_key(|(_, hw)| hw.memory.abs_diff(memory_total))
        .map(|(n, _)| n)
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
    fn a_lower_clock_scales_the_rates_the_sm_clock_sets_and_nothing_else() {
        let hw = load_hardware("h100-sxm-80gb").unwrap();
        let low = hw.at_tensor_rate(835.0);
        let f = 835.0 / 989.4;
        assert_eq!(low.bf16_tflops, 835.0);
        assert!((low.fp16_tflops - hw.fp16_tflops * f).abs() < 1e-9);
        assert!((low.fp32_tflops - hw.fp32_tflops * f).abs() < 1e-9);
        let fa2 = |h: &HardwareProfile| {
            h.attention_kernels[&AttentionKernel::FlashAttention2][&128][&2048]
        };
        assert!((fa2(&low) - fa2(&hw) * f).abs() < 1e-9);
        assert_eq!(low.memory_bandwidth_gbps, hw.memory_bandwidth_gbps);
        assert_eq!(low.interconnect_gbps, hw.interconnect_gbps);
        assert_eq!(low.inter_node_gbps, hw.inter_node_gbps);
        assert_eq!(low.memory, hw.memory);
        assert_eq!(hw.at_tensor_rate(hw.bf16_tflops), hw);
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
    fn a_gemm_share_is_a_share_of_the_peak() {
        for bad in ["1.5", "0", "-0.2"] {
            let msg = located_error(
                "gemm_efficiency: 0.62",
                &format!("gemm_efficiency: {bad}"),
                "gemm_efficiency",
            );
            assert!(msg.contains("not a share of the peak in (0, 1]"), "{msg}");
        }
        let hw = parse_hardware_yaml(h100_text(), "x.yaml").unwrap();
        assert_eq!(hw.gemm_efficiency, Some(0.62));
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

    /// The node keys a built-in profile must spell out rather than default.
    const NODE_KEYS: [&str; 6] = [
        "gpus_per_node",
        "intra_node_latency_us",
        "intra_node_nvls",
        "inter_node",
        "inter_node_gbps",
        "inter_node_latency_us",
    ];

    #[test]
    fn every_builtin_sets_its_node() {
        for (name, text) in builtin_hardware() {
            for key in NODE_KEYS {
                assert!(
                    text.lines().any(|l| l.starts_with(&format!("{key}:"))),
                    "{name} does not set `{key}`"
                );
            }
            let hw = load_hardware(name).unwrap();
            assert!((1..=8).contains(&hw.gpus_per_node), "{name}");
            assert!(hw.inter_node_gbps > 0.0 && hw.inter_node_gbps < hw.interconnect_gbps);
            assert!(
                hw.inter_node_latency_us > hw.intra_node_latency_us,
                "{name}"
            );
            assert!(hw.intra_node_latency_us > 0.0, "{name}");
            // NVLink SHARP is Hopper's NVSwitch only.
            assert_eq!(hw.intra_node_nvls, name.starts_with("h"), "{name}");
        }
        let h100 = load_hardware("h100-sxm-80gb").unwrap();
        assert_eq!(
            (
                h100.gpus_per_node,
                h100.inter_node.as_str(),
                h100.inter_node_gbps
            ),
            (8, "ib-ndr-400", 50.0)
        );
        let a100 = load_hardware("a100-40gb").unwrap();
        assert_eq!(
            (a100.inter_node.as_str(), a100.inter_node_gbps),
            ("ib-hdr-200", 25.0)
        );
        let l4 = load_hardware("l4").unwrap();
        assert_eq!((l4.gpus_per_node, l4.inter_node_gbps), (8, 12.5 / 8.0));
    }

    #[test]
    fn node_keys_are_optional() {
        let text: String = h100_text()
            .lines()
            .filter(|l| !NODE_KEYS.iter().any(|k| l.starts_with(&format!("{k}:"))))
            .map(|l| format!("{l}\n"))
            .collect();
        let hw = parse_hardware_yaml(&text, "x.yaml").unwrap();
        assert_eq!(hw.gpus_per_node, 8);
        assert_eq!(hw.intra_node_latency_us, 0.6);
        assert!(!hw.intra_node_nvls);
        assert_eq!(hw.inter_node, "eth-100");
        assert_eq!(hw.inter_node_gbps, 12.5 / 8.0);
        assert_eq!(hw.inter_node_latency_us, 10.0);
        // Everything else as before.
        let full = load_hardware("h100-sxm-80gb").unwrap();
        assert_eq!(
            (hw.memory, hw.interconnect_gbps),
            (full.memory, full.interconnect_gbps)
        );
        let pcie = text.replace("interconnect: nvlink4", "interconnect: pcie5");
        let hw = parse_hardware_yaml(&pcie, "x.yaml").unwrap();
        assert_eq!(hw.intra_node_latency_us, 1.0);
    }

    #[test]
    fn bad_node_keys_name_the_key_and_line() {
        located_error("gpus_per_node: 8", "gpus_per_node: 0", "gpus_per_node");
        located_error("gpus_per_node: 8", "gpus_per_node: 5000", "gpus_per_node");
        located_error(
            "inter_node_gbps: 50",
            "inter_node_gbps: -50",
            "inter_node_gbps",
        );
        located_error(
            "inter_node_latency_us: 2.7",
            "inter_node_latency_us: .nan",
            "inter_node_latency_us",
        );
        located_error("inter_node: ib-ndr-400", "inter_node: \" \"", "inter_node");
        let text = h100_text().replace("interconnect: nvlink4", "interconnect: pcie5");
        let line = line_of(&text, "intra_node_nvls:");
        let msg = parse_hardware_yaml(&text, "x.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            msg.starts_with(&format!("x.yaml:{line}: `intra_node_nvls`: ")),
            "{msg}"
        );
        assert!(msg.contains("needs an NVLink interconnect"), "{msg}");
        // Zero latency is allowed (an idealised link).
        let text = h100_text().replace("intra_node_latency_us: 0.6", "intra_node_latency_us: 0");
        assert_eq!(
            parse_hardware_yaml(&text, "x.yaml")
                .unwrap()
                .intra_node_latency_us,
            0.0
        );
    }

    #[test]
    fn every_builtin_network_parses() {
        let names: Vec<&str> = builtin_networks().iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            ["ib-ndr-400", "ib-hdr-200", "roce-200", "eth-100", "eth-25"]
        );
        for name in names {
            let net = load_network(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(net.name, name);
            assert!(net.nic_gbps > 0.0 && net.latency_us > 0.0, "{name}");
        }
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("profiles/networks");
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
            .map(|p| p.file_stem().unwrap().to_str().unwrap().to_string())
            .collect();
        files.sort();
        let mut names: Vec<&str> = builtin_networks().iter().map(|(n, _)| *n).collect();
        names.sort();
        assert_eq!(files, names);

        let ndr = load_network("ib-ndr-400").unwrap();
        assert_eq!((ndr.nic_gbps, ndr.nics_per_node), (50.0, None));
        assert_eq!(ndr.per_gpu_gbps(8), 50.0);
        let eth = load_network("eth-100").unwrap();
        assert_eq!(eth.per_gpu_gbps(8), 12.5 / 8.0);
        let path = dir.join("eth-25.yaml");
        assert_eq!(
            load_network(path.to_str().unwrap()).unwrap(),
            load_network("eth-25").unwrap()
        );
    }

    #[test]
    fn malformed_network_profiles_are_located() {
        let ndr = builtin_networks()[0].1;
        // A misspelled key: file, line and column, and a suggestion.
        let text = ndr.replace("nic_gbps:", "nic_gpbs:");
        let line = line_of(&text, "nic_gpbs:");
        let msg = parse_network_yaml(&text, "net.yaml")
            .unwrap_err()
            .to_string();
        assert!(msg.starts_with(&format!("net.yaml:{line}:")), "{msg}");
        assert!(
            msg.split(':').nth(2).unwrap().parse::<usize>().is_ok(),
            "{msg}"
        );
        assert!(msg.contains("did you mean `nic_gbps`?"), "{msg}");
        // A value of the wrong type.
        let text = ndr.replace("nic_gbps: 50", "nic_gbps: fast");
        let line = line_of(&text, "nic_gbps:");
        let err = parse_network_yaml(&text, "net.yaml").unwrap_err();
        assert!(matches!(err, Error::Config { .. }), "{err}");
        assert!(
            err.to_string().starts_with(&format!("net.yaml:{line}:")),
            "{err}"
        );
        // Values that parse but cannot work name their key's line.
        for (from, to, key) in [
            ("nic_gbps: 50", "nic_gbps: 0", "nic_gbps"),
            ("latency_us: 2.7", "latency_us: -1", "latency_us"),
            ("name: ib-ndr-400", "name: \"\"", "name"),
        ] {
            let text = ndr.replace(from, to);
            let line = line_of(&text, to);
            let msg = parse_network_yaml(&text, "net.yaml")
                .unwrap_err()
                .to_string();
            assert!(
                msg.starts_with(&format!("net.yaml:{line}: `{key}`: ")),
                "{msg}"
            );
        }
        let text = format!("{ndr}nics_per_node: 0\n");
        let msg = parse_network_yaml(&text, "net.yaml")
            .unwrap_err()
            .to_string();
        let line = line_of(&text, "nics_per_node:");
        assert!(
            msg.starts_with(&format!("net.yaml:{line}: `nics_per_node`: ")),
            "{msg}"
        );
        // A missing key.
        let text: String = ndr
            .lines()
            .filter(|l| !l.starts_with("latency_us:"))
            .map(|l| format!("{l}\n"))
            .collect();
        let msg = parse_network_yaml(&text, "net.yaml")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("missing field `latency_us`"), "{msg}");
    }

    #[test]
    fn unknown_network_suggests_closest() {
        let err = load_network("ib-ndr400").unwrap_err();
        assert!(matches!(err, Error::InvalidArg { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.starts_with("network: `ib-ndr400` is not a built-in network profile"),
            "{msg}"
        );
        assert!(msg.contains("did you mean `ib-ndr-400`?"), "{msg}");
        assert!(
            msg.contains("known networks: ib-ndr-400, ib-hdr-200"),
            "{msg}"
        );
        let msg = load_network("eth").unwrap_err().to_string();
        assert!(
            msg.contains("did you mean one of `eth-100`, `eth-25`?"),
            "{msg}"
        );
        let err = load_network("no/such/net.yaml").unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err}");
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
