//! `memfit models` and `memfit profiles`: the built-in model, hardware and
//! network profiles, as a table or as one JSON document whose fields are
//! documented in docs/cli.md (keep them stable; add, do not rename).

use std::fmt::Write as _;

use serde::Serialize;

use crate::config::ModelConfig;
use crate::config::hardware::{
    HardwareProfile, NetworkProfile, builtin_hardware, builtin_networks, load_hardware,
    load_network,
};
use crate::config::profile::{builtin_models, load_model};
use crate::error::Result;
use crate::units::fmt_bytes;

/// Bumped when a field changes meaning or goes away (adding one does not).
pub const SCHEMA_VERSION: u32 = 1;

/// One model profile.
#[derive(Clone, Debug, Serialize)]
pub struct ModelRecord {
    pub name: String,
    /// `gpt2` or `llama`.
    pub family: crate::config::Family,
    /// Unpadded, comparable with published counts.
    pub parameters: u64,
    /// A mixture of experts: the parameters a token passes through (its
    /// top-k experts per block), the "active" count model cards publish.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub active_parameters: Option<u64>,
    /// A mixture of experts: its routed experts.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertsRecord>,
    pub n_layer: usize,
    pub n_head: usize,
    /// Key/value heads (fewer than `n_head`: grouped-query attention).
    pub n_kv_head: usize,
    pub d_model: usize,
    pub d_ff: usize,
    /// As published, and as the embedding and head hold it (padded).
    pub vocab_size: usize,
    pub padded_vocab_size: usize,
    pub max_seq_len: usize,
    /// Whether the head shares the token embedding.
    pub tied_embeddings: bool,
}

/// A mixture of experts' routing, as `memfit models` lists it.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct ExpertsRecord {
    /// Routed experts per block.
    pub n_experts: usize,
    /// Experts per token.
    pub top_k: usize,
}

impl From<&ModelConfig> for ModelRecord {
    fn from(m: &ModelConfig) -> Self {
        ModelRecord {
            name: m.name.clone(),
            family: m.family,
            parameters: m.num_parameters(),
            active_parameters: m.moe.as_ref().map(|_| m.active_parameters()),
            experts: (m.moe.as_ref()).map(|e| ExpertsRecord {
                n_experts: e.n_experts,
                top_k: e.top_k,
            }),
            n_layer: m.n_layer,
            n_head: m.n_head,
            n_kv_head: m.n_kv_head(),
            d_model: m.d_model,
            d_ff: m.d_ff(),
            vocab_size: m.vocab_size,
            padded_vocab_size: m.padded_vocab(),
            max_seq_len: m.max_seq_len,
            tied_embeddings: m.tied(),
        }
    }
}

/// One GPU profile (`--device meta:NAME`, a plan recipe's `hardware:`).
#[derive(Clone, Debug, Serialize)]
pub struct HardwareRecord {
    pub name: String,
    pub display_name: String,
    /// Device memory, as the driver reports it.
    pub memory_bytes: u64,
    /// What the CUDA context, driver and libraries take of it before any tensor.
    pub runtime_overhead_bytes: u64,
    /// Dense peaks.
    pub bf16_tflops: f64,
    pub fp16_tflops: f64,
    pub fp32_tflops: f64,
    pub memory_bandwidth_gbps: f64,
    /// The link between the GPUs of a node, and its GB/s per GPU and direction.
    pub interconnect: String,
    pub interconnect_gbps: f64,
    pub gpus_per_node: u32,
    /// The network between nodes (a network profile's name), and its GB/s
    /// per GPU and direction.
    pub inter_node: String,
    pub inter_node_gbps: f64,
    /// On-demand price of one GPU-hour.
    pub usd_per_hour: f64,
    /// The node's host memory; `null`: this machine's available memory.
    pub host_memory_bytes: Option<u64>,
    /// The time model's kernels: SMs (a wave of GEMM tiles), and fused
    /// attention's share of the dense peak; `null` where the profile has
    /// no figure.
    pub sm_count: Option<u32>,
    /// Large GEMMs' share of the dense peak inside a step, where the
    /// profile has one of its own (fitted; its comment says to what);
    /// `null`: memfit's default.
    pub gemm_efficiency: Option<f64>,
    pub fused_attention_efficiency: Option<f64>,
    /// Fused attention kernels' published rates, TFLOP/s by kernel, head
    /// dimension and sequence length (a plan recipe's `attention_kernel`
    /// picks one); empty where the profile gives none.
    pub attention_kernels: std::collections::BTreeMap<
        crate::config::attention_kernels::AttentionKernel,
        crate::config::attention_kernels::KernelRates,
    >,
}

impl From<&HardwareProfile> for HardwareRecord {
    fn from(h: &HardwareProfile) -> Self {
        HardwareRecord {
            name: h.name.clone(),
            display_name: h.display_name.clone(),
            memory_bytes: h.memory,
            runtime_overhead_bytes: h.runtime_overhead,
            bf16_tflops: h.bf16_tflops,
            fp16_tflops: h.fp16_tflops,
            fp32_tflops: h.fp32_tflops,
            memory_bandwidth_gbps: h.memory_bandwidth_gbps,
            interconnect: h.interconnect.clone(),
            interconnect_gbps: h.interconnect_gbps,
            gpus_per_node: h.gpus_per_node,
            inter_node: h.inter_node.clone(),
            inter_node_gbps: h.inter_node_gbps,
            usd_per_hour: h.usd_per_hour,
            host_memory_bytes: h.host_memory,
            sm_count: h.sm_count,
            gemm_efficiency: h.gemm_efficiency,
            fused_attention_efficiency: h.fused_attention_efficiency,
            attention_kernels: h.attention_kernels.clone(),
        }
    }
}

/// One network profile (a plan recipe's `network:`).
#[derive(Clone, Debug, Serialize)]
pub struct NetworkRecord {
    pub name: String,
    pub display_name: String,
    /// GB/s of line rate per NIC, one direction.
    pub nic_gbps: f64,
    /// NICs in a node; `null`: one per GPU (rail-optimised).
    pub nics_per_node: Option<u32>,
    /// Microseconds per step of a collective across it, for a tiny message.
    pub latency_us: f64,
    /// Nodes under one non-blocking tier; `null`: the whole fabric.
    pub pod_nodes: Option<u32>,
    /// The oversubscription above a pod (1: non-blocking).
    pub oversubscription: f64,
}

impl From<&NetworkProfile> for NetworkRecord {
    fn from(n: &NetworkProfile) -> Self {
        NetworkRecord {
            name: n.name.clone(),
            display_name: n.display_name.clone(),
            nic_gbps: n.nic_gbps,
            nics_per_node: n.nics_per_node,
            latency_us: n.latency_us,
            pod_nodes: n.pod_nodes,
            oversubscription: n.oversubscription,
        }
    }
}

/// What `memfit profiles --format json` prints; `memfit models` prints
/// the same document without `hardware` and `networks`.
#[derive(Clone, Debug, Serialize)]
pub struct Catalog {
    pub schema_version: u32,
    pub models: Vec<ModelRecord>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hardware: Option<Vec<HardwareRecord>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub networks: Option<Vec<NetworkRecord>>,
}

/// The built-in profiles, in their stable order; `all` adds the hardware
/// and network profiles to the models.
pub fn catalog(all: bool) -> Result<Catalog> {
    let models = builtin_models()
        .iter()
        .map(|(name, _)| load_model(name).map(|m| ModelRecord::from(&m)))
        .collect::<Result<Vec<_>>>()?;
    let (hardware, networks) = if all {
        let hw = builtin_hardware()
            .iter()
            .map(|(name, _)| load_hardware(name).map(|h| HardwareRecord::from(&h)))
            .collect::<Result<Vec<_>>>()?;
        let net = builtin_networks()
            .iter()
            .map(|(name, _)| load_network(name).map(|n| NetworkRecord::from(&n)))
            .collect::<Result<Vec<_>>>()?;
        (Some(hw), Some(net))
    } else {
        (None, None)
    };
    Ok(Catalog {
        schema_version: SCHEMA_VERSION,
        models,
        hardware,
        networks,
    })
}

/// The catalog as aligned tables, one per kind of profile.
impl crate::report::Report for Catalog {
    fn table(&self) -> String {
        render_table(self)
    }
}

pub fn render_table(c: &Catalog) -> String {
    let mut s = String::new();
    let w = (c.models.iter().map(|m| m.name.len()).max().unwrap_or(0)).max(16);
    let _ = writeln!(
        s,
        "{:<w$} {:<6} {:>16} {:>14} {:>8} {:>7} {:>9}",
        "model", "family", "parameters", "active", "experts", "layers", "max seq"
    );
    for m in &c.models {
        let _ = writeln!(
            s,
            "{:<w$} {:<6} {:>16} {:>14} {:>8} {:>7} {:>9}",
            m.name,
            format!("{:?}", m.family).to_lowercase(),
            m.parameters,
            m.active_parameters.map_or("-".into(), |a| a.to_string()),
            m.experts
                .map_or("-".into(), |e| format!("{} of {}", e.top_k, e.n_experts)),
            m.n_layer,
            m.max_seq_len
        );
    }
    if let Some(hw) = &c.hardware {
        let _ = writeln!(
            s,
            "\n{:<16} {:<28} {:>10} {:>10} {:>10} {:>8}",
            "hardware", "", "memory", "bf16 TF/s", "HBM GB/s", "$/hour"
        );
        for h in hw {
            let _ = writeln!(
                s,
                "{:<16} {:<28} {:>10} {:>10.1} {:>10.0} {:>8.2}",
                h.name,
                h.display_name,
                fmt_bytes(h.memory_bytes),
                h.bf16_tflops,
                h.memory_bandwidth_gbps,
                h.usd_per_hour
            );
        }
        // Which profiles publish fused-attention rates, grouped by the
        // kernels they have (a plan recipe's `attention_kernel`).
        let mut groups: Vec<(String, Vec<&str>)> = Vec::new();
        for h in hw.iter().filter(|h| !h.attention_kernels.is_empty()) {
            let kernels: Vec<&str> = h.attention_kernels.keys().map(|k| k.name()).collect();
            let kernels = kernels.join(", ");
            match groups.iter_mut().find(|(k, _)| *k == kernels) {
                Some((_, names)) => names.push(&h.name),
                None => groups.push((kernels, vec![&h.name])),
            }
        }
        if !groups.is_empty() {
            let _ = writeln!(
                s,
                "attention kernels with rates, published or fitted (a plan recipe's attention_kernel):"
            );
            for (kernels, names) in groups {
                let _ = writeln!(s, "  {}: {kernels}", names.join(", "));
            }
            let _ = writeln!(
                s,
                "  the others: fused attention at a share of the peak (flash-attention-2 only)"
            );
        }
        // Which profiles replace the default GEMM share with a fitted one.
        let fitted: Vec<String> = (hw.iter())
            .filter_map(|h| {
                h.gemm_efficiency
                    .map(|f| format!("{} {:.0}%", h.name, f * 100.0))
            })
            .collect();
        let _ = writeln!(
            s,
            "large GEMMs at {:.0}% of the dense peak inside a step{}",
            crate::plan::COMPUTE_EFFICIENCY * 100.0,
            match fitted.is_empty() {
                true => String::new(),
                false => format!(
                    ", except where a profile fits its own:\n  {} (their comments say to what)",
                    fitted.join(", ")
                ),
            }
        );
    }
    if let Some(nets) = &c.networks {
        let _ = writeln!(
            s,
            "\n{:<16} {:<28} {:>10} {:>10} {:>10}",
            "network", "", "NIC GB/s", "NICs/node", "latency"
        );
        for n in nets {
            let _ = writeln!(
                s,
                "{:<16} {:<28} {:>10.2} {:>10} {:>7.1} us",
                n.name,
                n.display_name,
                n.nic_gbps,
                n.nics_per_node
                    .map_or("one/GPU".to_string(), |k| k.to_string()),
                n.latency_us
            );
        }
    }
    s
}
