//! What a collective costs on a cluster of nodes, priced the way NCCL runs it.
//!
//! A [`Topology`] is `nodes` servers of `gpus_per_node` GPUs. Inside a node the
//! GPUs share one link kind ([`Topology::intra`]: NVLink through NVSwitch, or
//! PCIe); between nodes every GPU has its share of the node's NICs
//! ([`Topology::inter`]). Both come from a [`HardwareProfile`], the network
//! optionally from a [`NetworkProfile`] instead.
//!
//! A collective runs over a [`Group`] of ranks, described by where they sit:
//! how many share a node and so how many nodes they span. A tensor-parallel
//! group inside one node only ever uses the intra-node link; a data-parallel
//! group of ranks 8 apart on 8-GPU nodes has one rank per node, and every step
//! of its ring crosses the network.
//!
//! [`Topology::price`] prices one call the way NCCL's tuner chooses: each
//! algorithm (ring; for all-reduce also the double binary tree and, inside an
//! NVSwitch node with in-switch reduction, NVLS) with each protocol (LL,
//! LL128, Simple) costs a latency plus bytes over a bandwidth, and the
//! cheapest wins. The result names the algorithm, the protocol, the links the
//! group crossed, the time, and the bus bandwidth as nccl-tests reports it.
//!
//! The model, per algorithm, for `n` ranks on `nodes` nodes with `g` ranks per
//! node and a buffer of `S` bytes (nccl-tests' `size`):
//!
//! * Ring: every rank sends `2(n-1)/n * S` (all-reduce) or `(n-1)/n * S`
//!   (reduce-scatter, all-gather), or `S` (broadcast, a pipelined chain). NCCL
//!   runs one ring per NIC in parallel, each leaving the node through its own
//!   NIC, so across a node boundary the ring gets the group's share of the
//!   node's NICs, `g` times the per-GPU network bandwidth; inside the node it
//!   gets the intra-node link. The slower of the two sets the pace (NCCL's
//!   tuner: channels times the per-channel speed of the graph it searched).
//!   Latency: one hop per step, `2(n-1)` steps for all-reduce of which
//!   `2(nodes-1)` cross the network.
//! * Tree (all-reduce only): a chain inside each node and NCCL's double binary
//!   tree across nodes, reduce up and broadcast down, pipelined. A GPU in the
//!   chain sends `2S`; a node sends `S` across the network with two nodes (each
//!   node is the other's parent in one of the two trees) and `2S` with more.
//!   Latency: `2((g-1)` intra hops `+ ceil(log2(nodes))` network hops`)`. It
//!   wins for small messages across nodes, and for large ones on two
//!   nodes whose network is the bottleneck (the case where nccl-tests' tree
//!   bus bandwidth exceeds the NICs' line rate).
//! * NVLS (all-reduce inside one node whose NVSwitches reduce, H100/H200):
//!   each GPU sends and receives `S` once and the switch does the sums. Its
//!   bandwidth is calibrated to NVIDIA's published figure (below).
//!
//! Latency is composed the way NCCL's own tuning model composes it
//! (src/graph/tuning.cc in github.com/NVIDIA/nccl; figures from 2.28): a base
//! latency per algorithm and protocol, plus a hop latency per step whose
//! figure depends on the link (NVLink, PCIe, network), the algorithm and the
//! protocol. A profile's `*_latency_us` is NCCL's ring LL hop for its link;
//! the other algorithms and protocols scale from it as NCCL's table does
//! ([`Link`]). Calibrated this way the model lands within 25% of published
//! nccl-tests all-reduce times from 8 bytes to 64 KB on one 8-GPU NVLink
//! node and on 2 and 4 nodes (tests/it/topology.rs).
//!
//! Not modelled: NVLS-Tree and CollNet/SHARP across nodes (NCCL uses them on
//! H100 clusters and InfiniBand SHARP switches; this model prices those
//! clusters with ring and tree, a little pessimistically), PXN, uneven NIC
//! placement, congestion between concurrent groups beyond their share of the
//! NICs, the fewer channels NCCL gives a small message, NCCL's per-size tree
//! corrections, and CUDA-graph launches (which take several microseconds off
//! every small call).

use crate::comm::Op;
use crate::config::hardware::{HardwareProfile, NetworkProfile};
use crate::{Error, Result};

/// What a link is made of, which sets how much of its line rate NCCL gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LinkKind {
    Nvlink,
    Pcie,
    Network,
}

impl LinkKind {
    /// The fraction of line rate NCCL's Simple protocol reaches as bus
    /// bandwidth over this kind of link.
    ///
    /// * NVLink 0.8: "450GB/s is the line rate. With the protocol overhead
    ///   (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s"
    ///   (NVIDIA, github.com/NVIDIA/nccl-tests/issues/212); A100 nodes reach
    ///   about 231 of 300 GB/s (Azure, see tests/it/topology.rs).
    /// * PCIe 0.75: NCCL's topology search rates a Gen4 x16 link at 24 GB/s
    ///   of its 32 (its `PCI[24.0]` in github.com/NVIDIA/nccl-tests/issues/307).
    /// * Network 0.94: "For NDR @ 400Gbps you should see 46-48GB/s per NIC"
    ///   (NVIDIA, github.com/NVIDIA/nccl-tests/issues/290), 47 of 50 GB/s.
    pub fn efficiency(self) -> f64 {
        match self {
            LinkKind::Nvlink => 0.8,
            LinkKind::Pcie => 0.75,
            LinkKind::Network => 0.94,
        }
    }

    /// The intra-node kind of a hardware profile's `interconnect` name.
    pub fn of_interconnect(name: &str) -> LinkKind {
        if name.trim().to_ascii_lowercase().starts_with("nvlink") {
            LinkKind::Nvlink
        } else {
            LinkKind::Pcie
        }
    }
}

/// One kind of link, as each GPU sees it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Link {
    /// `nvlink4`, `ib-ndr-400`, ...
    pub name: String,
    pub kind: LinkKind,
    /// Line rate per GPU, per direction, bytes/s.
    pub bandwidth: f64,
    /// Seconds per step of a ring collective for a tiny message (NCCL's LL
    /// protocol): NCCL's tuning model has 0.6 us for NVLink, 1.0 for PCIe and
    /// 2.7 for the network. Other algorithms and protocols scale from it.
    pub latency: f64,
}

impl Link {
    /// Bytes/s per GPU and direction that NCCL's Simple protocol gets.
    pub fn effective_bandwidth(&self) -> f64 {
        self.bandwidth * self.kind.efficiency()
    }

    /// Seconds one step of `algorithm` with `protocol` spends on this link:
    /// NCCL's hop latency for the link's kind ([`nccl_hop_us`]), scaled by
    /// this link's [`Link::latency`] over NCCL's ring LL figure for that
    /// kind. With a profile's default latencies that is NCCL's figure itself.
    fn hop(&self, algorithm: Algorithm, protocol: Protocol) -> f64 {
        let reference = nccl_hop_us(self.kind, Algorithm::Ring, Protocol::Ll);
        self.latency * nccl_hop_us(self.kind, algorithm, protocol) / reference
    }
}

/// The cluster a job runs on: `nodes` nodes of `gpus_per_node` GPUs, the last
/// one partly used when `world` is not a multiple of `gpus_per_node`.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Topology {
    pub gpus_per_node: usize,
    pub nodes: usize,
    /// Ranks in the job, one per GPU.
    pub world: usize,
    /// The link between GPUs of one node.
    pub intra: Link,
    /// The network between nodes, per GPU.
    pub inter: Link,
    /// The node's NVSwitches reduce in the switch (NVLink SHARP).
    pub nvls: bool,
    /// Nodes under one non-blocking tier of the network, and how much the
    /// tier above is oversubscribed: a group spanning more nodes than a pod
    /// gets `1 / oversubscription` of its NIC bandwidth (a group that
    /// crosses the spine shares it with every other pod's traffic).
    pub pod_nodes: Option<usize>,
    pub oversubscription: f64,
}

/// Where a group's ranks sit: `size` ranks, at most `ranks_per_node` of them
/// on any node, filling nodes in order (so the last node may hold fewer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Group {
    pub size: usize,
    pub ranks_per_node: usize,
}

impl Group {
    /// Nodes the group spans.
    pub fn nodes(&self) -> usize {
        self.size.div_ceil(self.ranks_per_node.max(1))
    }

    /// The group's ranks on its least-filled node: its share of that node's
    /// NICs is what a ring gets across node boundaries.
    pub fn fewest_ranks_per_node(&self) -> usize {
        let full = (self.nodes() - 1) * self.ranks_per_node;
        self.size - full
    }

    /// The links a collective over this group uses.
    pub fn links(&self) -> Links {
        match (self.size > 1, self.nodes() > 1, self.ranks_per_node > 1) {
            (false, _, _) => Links::None,
            (true, false, _) => Links::Intra,
            (true, true, false) => Links::Inter,
            (true, true, true) => Links::IntraInter,
        }
    }
}

/// The links a collective crossed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Links {
    /// One rank: nothing moves.
    None,
    /// The intra-node link only (the group is inside one node).
    Intra,
    /// The network only (one rank per node).
    Inter,
    /// Both.
    IntraInter,
}

impl Links {
    pub fn crosses_network(self) -> bool {
        matches!(self, Links::Inter | Links::IntraInter)
    }
}

/// NCCL's collective algorithms that this model prices.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Algorithm {
    Ring,
    Tree,
    Nvls,
}

/// NCCL's protocols: LL (8-byte stores with a flag each: lowest latency, a
/// quarter of the bandwidth), LL128 (128-byte lines, NVLink only), Simple
/// (bulk copies with a fence per chunk: full bandwidth, highest latency).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Ll,
    Ll128,
    Simple,
}

impl Protocol {
    const ALL: [Protocol; 3] = [Protocol::Ll, Protocol::Ll128, Protocol::Simple];

    /// Fraction of the Simple protocol's bandwidth. NCCL's tuner takes a
    /// quarter for LL (half of each 8-byte store is a flag, and the receiver
    /// polls) and 120/128 (0.92 in the tuner) for LL128.
    fn bandwidth_fraction(self) -> f64 {
        match self {
            Protocol::Ll => 0.25,
            Protocol::Ll128 => 0.92,
            Protocol::Simple => 1.0,
        }
    }
}

/// NCCL's fixed start-up latency of one call, seconds, by algorithm and
/// protocol: `baseLatencies` in NCCL 2.28's src/graph/tuning.cc, 6.6 / 14 /
/// 8.4 us (LL / LL128 / Simple) for the ring and 6.8 / 14 / 8.4 for the
/// tree. NVLS has none besides its one hop ([`NVLS_LATENCY`]).
fn base_latency(algorithm: Algorithm, protocol: Protocol) -> f64 {
    1e-6 * match (algorithm, protocol) {
        (Algorithm::Nvls, _) => 0.0,
        (Algorithm::Ring, Protocol::Ll) => 6.6,
        (Algorithm::Tree, Protocol::Ll) => 6.8,
        (_, Protocol::Ll128) => 14.0,
        (_, Protocol::Simple) => 8.4,
    }
}

/// NCCL's latency of one hop, microseconds, by the link it crosses, the
/// algorithm and the protocol: `hwLatencies` in NCCL 2.28's
/// src/graph/tuning.cc.
///
/// | link    | ring LL | LL128 | Simple | tree LL | LL128 | Simple |
/// |---------|---------|-------|--------|---------|-------|--------|
/// | NVLink  | 0.6     | 1.9   | 3.4    | 0.6     | 1.25  | 4.0    |
/// | PCIe    | 1.0     | 2.5   | 5.7    | 1.0     | 1.9   | 4.0    |
/// | network | 2.7     | 4.0   | 14     | 5.0     | 8.5   | 14     |
///
/// A tree's network hop is almost twice a ring's. NCCL 2.28 also prices a
/// ring's network hops at the tree's figure when the group has one rank per
/// node ("with ppn=1 latencies are fully exposed"), which
/// [`Topology::price_with`] follows. NVLS is priced by [`NVLS_LATENCY`].
fn nccl_hop_us(kind: LinkKind, algorithm: Algorithm, protocol: Protocol) -> f64 {
    // (ring, tree) for LL, LL128 and Simple.
    let [ll, ll128, simple] = match kind {
        LinkKind::Nvlink => [(0.6, 0.6), (1.9, 1.25), (3.4, 4.0)],
        LinkKind::Pcie => [(1.0, 1.0), (2.5, 1.9), (5.7, 4.0)],
        LinkKind::Network => [(2.7, 5.0), (4.0, 8.5), (14.0, 14.0)],
    };
    let (ring, tree) = match protocol {
        Protocol::Ll => ll,
        Protocol::Ll128 => ll128,
        Protocol::Simple => simple,
    };
    if algorithm == Algorithm::Tree {
        tree
    } else {
        ring
    }
}

/// How much longer an intra-node LL hop takes once the group spans nodes:
/// NCCL's tuning model through 2.18 multiplied it by 1.8 (`intraLat *= 1.8`
/// for LL when `nNodes > 1`, src/graph/tuning.cc); its rings now use a
/// floor of 1-2 us a step instead. The figure reproduces the 15 us that the
/// 8-GPU chain adds to a two-node all-reduce (35.85 us with 8 GPUs per
/// node, 21.27 with one, in the NDm A100 v4 figures of tests/it/topology.rs).
const LL_INTRA_HOP_ACROSS_NODES: f64 = 1.8;

/// The LL protocol's bus bandwidth once a collective crosses the network,
/// bytes/s: NCCL caps it at 39 GB/s on two nodes and 20.4 on more with Intel
/// hosts, 22.5 and 19 with AMD ones (`llMaxBws` in NCCL 2.28's
/// src/graph/tuning.cc). One figure here for both: published small-message
/// times across nodes grow with size at about this rate (tests/it/topology.rs).
const LL_NETWORK_BUSBW: f64 = 20e9;

/// The fraction of the bandwidth a ring would get that the tree reaches:
/// NCCL's tuner discounts tree bus bandwidth by 0.9 (src/graph/tuning.cc).
const TREE_EFFICIENCY: f64 = 0.9;

/// NVLS all-reduce's algorithm bandwidth as a fraction of the NVLink line
/// rate. Calibrated: NVIDIA quotes a peak bus bandwidth of ~480 GB/s, algbw
/// ~275 GB/s, on 8 H100s (github.com/NVIDIA/nccl-tests/issues/212; 273 GB/s
/// measured in github.com/NVIDIA/nccl/issues/1455), limited by the switch's
/// reduction rate, not by the 450 GB/s links: 275 / 450 = 0.61. The same
/// issue measures less with fewer GPUs (algbw 258 on 5, and no better than
/// the ring on 2 to 4), which this constant overstates for 4-GPU groups.
const NVLS_EFFICIENCY: f64 = 0.61;

/// NVLS's latency, seconds: NCCL's tuning model has one NVLS hop over NVLink
/// at 25 us in 2.28 (23 in 2.19) and no base latency, so NCCL never picks it
/// for small messages. Azure's tables, which force NVLS, read 25.6 us for a
/// 1 KB all-reduce on 8 H100s (tests/it/topology.rs).
const NVLS_LATENCY: f64 = 25e-6;

/// nccl-tests' bus bandwidth factor: `busbw = algbw * factor`. From
/// nccl-tests' doc/PERFORMANCE.md (github.com/NVIDIA/nccl-tests): all-reduce
/// `2(n-1)/n`, reduce-scatter and all-gather `(n-1)/n`, broadcast 1. It makes
/// the bus bandwidth of a ring independent of `n`: the rate each rank's link
/// carries.
pub fn bus_factor(op: Op, ranks: usize) -> f64 {
    let n = ranks.max(1) as f64;
    match op {
        Op::AllReduce => 2.0 * (n - 1.0) / n,
        Op::ReduceScatter | Op::AllGather | Op::AllToAll => (n - 1.0) / n,
        Op::Broadcast => 1.0,
    }
}

/// `all_reduce`, ..., as nccl-tests names its binaries (without `_perf`).
pub fn op_name(op: Op) -> &'static str {
    match op {
        Op::AllReduce => "all_reduce",
        Op::ReduceScatter => "reduce_scatter",
        Op::AllGather => "all_gather",
        Op::Broadcast => "broadcast",
        Op::AllToAll => "alltoall",
    }
}

fn serialize_op<S: serde::Serializer>(op: &Op, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(op_name(*op))
}

/// One priced collective call.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Cost {
    #[serde(serialize_with = "serialize_op")]
    pub op: Op,
    /// nccl-tests' `size`: the full buffer of one rank (the all-reduce buffer,
    /// the reduce-scatter input, the all-gather output, the broadcast buffer).
    pub bytes: u64,
    pub group: Group,
    pub algorithm: Algorithm,
    pub protocol: Protocol,
    pub links: Links,
    pub seconds: f64,
    /// `bytes / seconds`, bytes/s (0 when nothing moves).
    pub algbw: f64,
    /// `algbw` times [`bus_factor`], bytes/s.
    pub busbw: f64,
}

impl Topology {
    /// `world` GPUs of `hw`'s nodes, filled in order; `network`, when given,
    /// replaces the profile's inter-node network.
    pub fn new(
        hw: &HardwareProfile,
        network: Option<&NetworkProfile>,
        world: usize,
    ) -> Result<Topology> {
        if world == 0 {
            return Err(Error::invalid_arg("gpus", "must be at least 1"));
        }
        let gpus_per_node = hw.gpus_per_node.max(1) as usize;
        let intra = Link {
            name: hw.interconnect.clone(),
            kind: LinkKind::of_interconnect(&hw.interconnect),
            bandwidth: hw.interconnect_gbps * 1e9,
            latency: hw.intra_node_latency_us * 1e-6,
        };
        let (pod_nodes, oversubscription) = match network {
            Some(net) => (net.pod_nodes, net.oversubscription),
            None => (hw.inter_node_pod_nodes, hw.inter_node_oversubscription),
        };
        let inter = match network {
            Some(net) => Link {
                name: net.name.clone(),
                kind: LinkKind::Network,
                bandwidth: net.per_gpu_gbps(hw.gpus_per_node) * 1e9,
                latency: net.latency_us * 1e-6,
            },
            None => Link {
                name: hw.inter_node.clone(),
                kind: LinkKind::Network,
                bandwidth: hw.inter_node_gbps * 1e9,
                latency: hw.inter_node_latency_us * 1e-6,
            },
        };
        let nvls = hw.intra_node_nvls && intra.kind == LinkKind::Nvlink;
        Ok(Topology {
            gpus_per_node,
            nodes: world.div_ceil(gpus_per_node),
            world,
            intra,
            inter,
            nvls,
            pod_nodes: pod_nodes.map(|n| n as usize),
            oversubscription,
        })
    }

    /// Every rank of the job.
    pub fn world_group(&self) -> Group {
        Group {
            size: self.world,
            ranks_per_node: self.world.min(self.gpus_per_node),
        }
    }

    /// `size` ranks, at most `ranks_per_node` on each node they occupy.
    pub fn group(&self, size: usize, ranks_per_node: usize) -> Result<Group> {
        let bad = |message: String| Err(Error::invalid_arg("group", message));
        if size == 0 || ranks_per_node == 0 {
            return bad(format!(
                "a group needs at least one rank and one rank per node, not {size} ranks with {ranks_per_node} per node"
            ));
        }
        if ranks_per_node > self.gpus_per_node {
            return bad(format!(
                "{ranks_per_node} ranks per node, but a node has {} GPUs",
                self.gpus_per_node
            ));
        }
        if ranks_per_node > size {
            return bad(format!(
                "{ranks_per_node} ranks per node in a group of {size}"
            ));
        }
        let group = Group {
            size,
            ranks_per_node,
        };
        if size > self.world || group.nodes() > self.nodes {
            return bad(format!(
                "{size} ranks at {ranks_per_node} per node span {} nodes; the job has {} GPUs on {} nodes",
                group.nodes(),
                self.world,
                self.nodes
            ));
        }
        Ok(group)
    }

    /// `size` ranks `stride` apart (rank `r`, `r + stride`, ...), with ranks
    /// numbered node by node: a data-parallel group under tensor parallelism
    /// of `stride`, say. Ranks 8 apart on 8-GPU nodes are one per node.
    pub fn strided_group(&self, size: usize, stride: usize) -> Result<Group> {
        if stride == 0 {
            return Err(Error::invalid_arg("group", "a stride of 0"));
        }
        let span = (size.max(1) - 1) * stride + 1;
        if span > self.world {
            return Err(Error::invalid_arg(
                "group",
                format!(
                    "{size} ranks {stride} apart need {span} GPUs; the job has {}",
                    self.world
                ),
            ));
        }
        let per_node = self.gpus_per_node.div_ceil(stride).min(size).max(1);
        self.group(size, per_node)
    }

    /// Prices `op` on a buffer of `bytes` (nccl-tests' `size`) over `group`,
    /// with the algorithm and protocol NCCL's tuner would pick: the fastest.
    pub fn price(&self, op: Op, bytes: u64, group: &Group) -> Cost {
        let mut best: Option<Cost> = None;
        for algorithm in [Algorithm::Ring, Algorithm::Tree, Algorithm::Nvls] {
            for protocol in Protocol::ALL {
                if let Some(cost) = self.price_with(op, bytes, group, algorithm, protocol)
                    && best.is_none_or(|b| cost.seconds < b.seconds)
                {
                    best = Some(cost);
                }
            }
        }
        best.expect("the ring with the Simple protocol always applies")
    }

    /// Prices `op` with a given algorithm and protocol, as `NCCL_ALGO` and
    /// `NCCL_PROTO` force them; `None` where NCCL would not run that pair
    /// (tree and NVLS are all-reduce only, NVLS only inside one node with
    /// NVLink SHARP and with Simple, LL128 only on NVLink).
    pub fn price_with(
        &self,
        op: Op,
        bytes: u64,
        group: &Group,
        algorithm: Algorithm,
        protocol: Protocol,
    ) -> Option<Cost> {
        let n = group.size.max(1);
        let nodes = group.nodes();
        let links = group.links();
        let applies = match algorithm {
            Algorithm::Ring => true,
            Algorithm::Tree => op == Op::AllReduce,
            Algorithm::Nvls => {
                op == Op::AllReduce && self.nvls && nodes == 1 && protocol == Protocol::Simple
            }
        };
        if !applies || (protocol == Protocol::Ll128 && self.intra.kind != LinkKind::Nvlink) {
            return None;
        }
        let cost = |seconds: f64| {
            let algbw = if seconds > 0.0 {
                bytes as f64 / seconds
            } else {
                0.0
            };
            Cost {
                op,
                bytes,
                group: *group,
                algorithm,
                protocol,
                links,
                seconds,
                algbw,
                busbw: algbw * bus_factor(op, n),
            }
        };
        if n == 1 || bytes == 0 {
            return Some(cost(0.0));
        }
        let s = bytes as f64;
        // Intra-node LL hops take longer once the group spans nodes.
        let stretch = if nodes > 1 && protocol == Protocol::Ll {
            LL_INTRA_HOP_ACROSS_NODES
        } else {
            1.0
        };
        let intra_hop = |a: Algorithm| self.intra.hop(a, protocol) * stretch;
        let inter_hop = |a: Algorithm| self.inter.hop(a, protocol);
        let fraction = protocol.bandwidth_fraction();
        let intra_bw = self.intra.effective_bandwidth() * fraction;
        // The group's share of the NICs of its least-filled node; LL's is
        // capped (NCCL's `llMaxBws`).
        let mut network_bw =
            self.inter.effective_bandwidth() * group.fewest_ranks_per_node() as f64 * fraction;
        if self.pod_nodes.is_some_and(|pod| nodes > pod) {
            network_bw /= self.oversubscription;
        }
        if protocol == Protocol::Ll {
            network_bw = network_bw.min(LL_NETWORK_BUSBW);
        }
        let seconds = match algorithm {
            // NCCL's all-to-all is one send and one receive per peer, all
            // at once (not a ring): a rank's `(g - 1)/n` of the buffer for
            // its node's peers crosses NVLink while the rest leaves through
            // its own NIC (one per GPU on these nodes), after one hop each.
            Algorithm::Ring if op == Op::AllToAll => {
                let g = group.ranks_per_node.min(n);
                let own_nic = network_bw / group.fewest_ranks_per_node() as f64;
                let intra = s * (g - 1) as f64 / n as f64 / intra_bw;
                let network = s * (n - g) as f64 / n as f64 / own_nic;
                let latency = base_latency(Algorithm::Ring, protocol)
                    + if g > 1 {
                        intra_hop(Algorithm::Ring)
                    } else {
                        0.0
                    }
                    + if nodes > 1 {
                        inter_hop(Algorithm::Ring)
                    } else {
                        0.0
                    };
                latency + intra.max(network)
            }
            Algorithm::Ring => {
                let (steps, network_steps) = match op {
                    Op::AllReduce => (2 * (n - 1), 2 * (nodes - 1)),
                    Op::ReduceScatter | Op::AllGather | Op::Broadcast | Op::AllToAll => {
                        (n - 1, nodes - 1)
                    }
                };
                // One rank per node: every step waits on the network in full,
                // and NCCL prices those hops at the tree's network figure.
                let network_hop = match group.ranks_per_node {
                    1 => inter_hop(Algorithm::Tree),
                    _ => inter_hop(Algorithm::Ring),
                };
                let latency = base_latency(Algorithm::Ring, protocol)
                    + (steps - network_steps) as f64 * intra_hop(Algorithm::Ring)
                    + network_steps as f64 * network_hop;
                let mut bw = f64::INFINITY;
                if group.ranks_per_node > 1 {
                    bw = bw.min(intra_bw);
                }
                if nodes > 1 {
                    bw = bw.min(network_bw);
                }
                let per_rank = match op {
                    Op::Broadcast => s,
                    _ => bus_factor(op, n) * s,
                };
                latency + per_rank / bw
            }
            Algorithm::Tree => {
                let g = group.ranks_per_node;
                let depth = nodes.next_power_of_two().trailing_zeros() as f64;
                let latency = base_latency(Algorithm::Tree, protocol)
                    + 2.0
                        * ((g - 1) as f64 * intra_hop(Algorithm::Tree)
                            + depth * inter_hop(Algorithm::Tree));
                let chain = if g > 1 { 2.0 * s / intra_bw } else { 0.0 };
                let network = match nodes {
                    1 => 0.0,
                    2 => s / network_bw,
                    _ => 2.0 * s / network_bw,
                };
                latency + chain.max(network) / TREE_EFFICIENCY
            }
            Algorithm::Nvls => NVLS_LATENCY + s / (self.intra.bandwidth * NVLS_EFFICIENCY),
        };
        Some(cost(seconds))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::hardware::{load_hardware, load_network};

    const GB: f64 = 1e9;

    fn topo(hw: &str, world: usize) -> Topology {
        Topology::new(&load_hardware(hw).unwrap(), None, world).unwrap()
    }

    #[test]
    fn topology_from_profiles() {
        let t = topo("h100-sxm-80gb", 64);
        assert_eq!((t.gpus_per_node, t.nodes, t.world), (8, 8, 64));
        assert_eq!(t.intra.kind, LinkKind::Nvlink);
        assert_eq!(t.intra.bandwidth, 450.0 * GB);
        assert_eq!(t.inter.name, "ib-ndr-400");
        assert_eq!(t.inter.bandwidth, 50.0 * GB);
        assert!(t.nvls);
        assert_eq!(
            t.world_group(),
            Group {
                size: 64,
                ranks_per_node: 8
            }
        );
        // A partly used last node.
        let t = topo("a100-80gb", 12);
        assert_eq!(t.nodes, 2);
        let g = t.world_group();
        assert_eq!((g.nodes(), g.fewest_ranks_per_node()), (2, 4));
        assert!(!t.nvls);
        // Fewer GPUs than a node: one node.
        assert_eq!(topo("l4", 3).nodes, 1);
        assert!(Topology::new(&load_hardware("l4").unwrap(), None, 0).is_err());
    }

    #[test]
    fn groups_spanning_an_oversubscribed_pod_get_less_network() {
        // A 2:1 fabric above pods of 32 nodes (256 H100s).
        let text = "name: ib-2to1\ndisplay_name: NDR, 2:1 above 32 nodes\nnic_gbps: 50\nlatency_us: 2.7\npod_nodes: 32\noversubscription: 2\n";
        let net = crate::config::hardware::parse_network_yaml(text, "ib-2to1.yaml").unwrap();
        let full = load_network("ib-ndr-400").unwrap();
        let hw = load_hardware("h100-sxm-80gb").unwrap();
        let bytes = 1 << 30;
        let price = |net, size: usize, per_node: usize| {
            let t = Topology::new(&hw, Some(net), 16_384).unwrap();
            let g = t.group(size, per_node).unwrap();
            t.price(Op::AllReduce, bytes, &g).seconds
        };
        // Inside a pod: the same as a non-blocking fabric.
        assert_eq!(price(&net, 32, 1), price(&full, 32, 1));
        // A data-parallel group of 128 nodes, one rank per node: it crosses
        // the spine, whose half bandwidth nearly doubles a large all-reduce.
        let (slow, fast) = (price(&net, 128, 1), price(&full, 128, 1));
        assert!(slow > 1.8 * fast && slow < 2.0 * fast, "{slow} vs {fast}");
        // Keys are checked: less than 1 is refused with the key named.
        let bad = text.replace("oversubscription: 2", "oversubscription: 0.5");
        let e = crate::config::hardware::parse_network_yaml(&bad, "ib.yaml").unwrap_err();
        assert!(e.to_string().contains("oversubscription"), "{e}");
    }

    #[test]
    fn network_override_replaces_the_inter_node_link() {
        let hw = load_hardware("a100-80gb").unwrap();
        let eth = load_network("eth-100").unwrap();
        let t = Topology::new(&hw, Some(&eth), 16).unwrap();
        assert_eq!(t.inter.name, "eth-100");
        // One shared port per node: 12.5 GB/s over 8 GPUs.
        assert_eq!(t.inter.bandwidth, 12.5 / 8.0 * GB);
        assert_eq!(t.intra, topo("a100-80gb", 16).intra);
        let ib = load_network("ib-ndr-400").unwrap();
        let t2 = Topology::new(&hw, Some(&ib), 16).unwrap();
        assert_eq!(t2.inter.bandwidth, 50.0 * GB);
        let g = t.world_group();
        let slow = t.price(Op::AllReduce, 1 << 30, &g);
        let fast = t2.price(Op::AllReduce, 1 << 30, &g);
        assert!(slow.seconds > 10.0 * fast.seconds, "{slow:?} {fast:?}");
    }

    #[test]
    fn groups_by_placement() {
        let t = topo("h100-sxm-80gb", 64);
        // Data-parallel ranks 8 apart: one per node.
        let dp = t.strided_group(8, 8).unwrap();
        assert_eq!((dp.ranks_per_node, dp.nodes()), (1, 8));
        assert_eq!(dp.links(), Links::Inter);
        // Ranks 2 apart: 4 per node.
        let g = t.strided_group(16, 2).unwrap();
        assert_eq!((g.ranks_per_node, g.nodes()), (4, 4));
        assert_eq!(g.links(), Links::IntraInter);
        // Inside one node.
        let tp = t.group(8, 8).unwrap();
        assert_eq!((tp.nodes(), tp.links()), (1, Links::Intra));
        assert_eq!(t.group(1, 1).unwrap().links(), Links::None);
        for bad in [
            t.group(0, 1),
            t.group(4, 0),
            t.group(16, 16),
            t.group(2, 4),
            t.group(128, 8),
            t.group(64, 1),
            t.strided_group(9, 8),
            t.strided_group(2, 0),
        ] {
            assert!(bad.is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_group_inside_one_node_never_touches_the_network() {
        let hw = load_hardware("h100-sxm-80gb").unwrap();
        let ib = Topology::new(&hw, None, 64).unwrap();
        let eth = Topology::new(&hw, Some(&load_network("eth-25").unwrap()), 64).unwrap();
        for op in [
            Op::AllReduce,
            Op::ReduceScatter,
            Op::AllGather,
            Op::Broadcast,
        ] {
            for size in [2, 4, 8] {
                let g = ib.group(size, size).unwrap();
                for bytes in [8, 1 << 16, 1 << 24, 1 << 32] {
                    let a = ib.price(op, bytes, &g);
                    assert_eq!(a.links, Links::Intra);
                    assert!(!a.links.crosses_network());
                    // A network 100x slower changes nothing.
                    assert_eq!(a, eth.price(op, bytes, &g));
                }
            }
        }
    }

    #[test]
    fn pricing_is_monotone_in_size() {
        for hw in ["h100-sxm-80gb", "a100-40gb", "l4", "rtx-4090"] {
            let t = topo(hw, 64);
            let groups = [
                t.world_group(),
                t.group(8, 8).unwrap(),
                t.strided_group(8, 8).unwrap(),
                t.group(4, 4).unwrap(),
            ];
            for op in [
                Op::AllReduce,
                Op::ReduceScatter,
                Op::AllGather,
                Op::Broadcast,
            ] {
                for g in &groups {
                    let mut last = 0.0;
                    for k in 0..36 {
                        for bytes in [1u64 << k, (1u64 << k) * 3 / 2] {
                            let c = t.price(op, bytes, g);
                            assert!(c.seconds >= last, "{hw} {op:?} {g:?} {bytes}");
                            assert!(c.seconds.is_finite() && c.seconds > 0.0);
                            last = c.seconds;
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bus_bandwidth_follows_nccl_tests() {
        assert_eq!(bus_factor(Op::AllReduce, 8), 1.75);
        assert_eq!(bus_factor(Op::ReduceScatter, 8), 0.875);
        assert_eq!(bus_factor(Op::AllGather, 4), 0.75);
        assert_eq!(bus_factor(Op::Broadcast, 8), 1.0);
        let t = topo("a100-80gb", 8);
        let c = t.price(Op::AllGather, 1 << 30, &t.world_group());
        assert!((c.algbw - (1u64 << 30) as f64 / c.seconds).abs() < 1.0);
        assert!((c.busbw - c.algbw * 0.875).abs() < 1.0);
        // A ring's bus bandwidth is the same for every collective and group
        // size once the message is large: the link's effective rate.
        for op in [Op::AllReduce, Op::ReduceScatter, Op::AllGather] {
            for n in [2, 4, 8] {
                let g = t.group(n, n).unwrap();
                let c = t.price_with(op, 1 << 34, &g, Algorithm::Ring, Protocol::Simple);
                let busbw = c.unwrap().busbw / GB;
                assert!((busbw - 240.0).abs() < 1.0, "{op:?} {n}: {busbw}");
            }
        }
    }

    #[test]
    fn single_rank_or_empty_costs_nothing() {
        let t = topo("h100-sxm-80gb", 8);
        let one = t.group(1, 1).unwrap();
        let c = t.price(Op::AllReduce, 1 << 20, &one);
        assert_eq!((c.seconds, c.busbw, c.links), (0.0, 0.0, Links::None));
        assert_eq!(t.price(Op::AllGather, 0, &t.world_group()).seconds, 0.0);
    }

    #[test]
    fn algorithms_apply_where_nccl_runs_them() {
        let t = topo("h100-sxm-80gb", 16);
        let node = t.group(8, 8).unwrap();
        let all = t.world_group();
        let with = |op, g: &Group, a, p| t.price_with(op, 1 << 20, g, a, p).is_some();
        assert!(with(
            Op::AllReduce,
            &node,
            Algorithm::Nvls,
            Protocol::Simple
        ));
        assert!(!with(Op::AllReduce, &node, Algorithm::Nvls, Protocol::Ll));
        assert!(!with(
            Op::AllReduce,
            &all,
            Algorithm::Nvls,
            Protocol::Simple
        ));
        assert!(!with(
            Op::AllGather,
            &node,
            Algorithm::Tree,
            Protocol::Simple
        ));
        assert!(with(Op::AllGather, &node, Algorithm::Ring, Protocol::Ll128));
        // No LL128 over PCIe, no NVLS without NVLink SHARP.
        let l4 = topo("l4", 8);
        let g = l4.world_group();
        assert!(
            l4.price_with(Op::AllReduce, 64, &g, Algorithm::Ring, Protocol::Ll128)
                .is_none()
        );
        let a100 = topo("a100-80gb", 8);
        let g = a100.world_group();
        assert!(
            a100.price_with(Op::AllReduce, 64, &g, Algorithm::Nvls, Protocol::Simple)
                .is_none()
        );
    }

    #[test]
    fn hops_follow_nccls_table() {
        let t = topo("h100-sxm-80gb", 16);
        let us = |l: &Link, a, p| l.hop(a, p) * 1e6;
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(us(&t.intra, Algorithm::Ring, Protocol::Ll), 0.6));
        assert!(close(us(&t.intra, Algorithm::Tree, Protocol::Simple), 4.0));
        assert!(close(us(&t.inter, Algorithm::Ring, Protocol::Ll), 2.7));
        assert!(close(us(&t.inter, Algorithm::Tree, Protocol::Ll), 5.0));
        assert!(close(us(&t.inter, Algorithm::Ring, Protocol::Simple), 14.0));
        // A link twice as slow as NCCL's reference doubles every figure.
        let mut slow = t.inter.clone();
        slow.latency *= 2.0;
        assert!(close(us(&slow, Algorithm::Tree, Protocol::Ll), 10.0));
        // One node, ring LL: 6.6 + 14 x 0.6 us and the bytes.
        let node = t.group(8, 8).unwrap();
        let c = t.price_with(Op::AllReduce, 8, &node, Algorithm::Ring, Protocol::Ll);
        assert!((c.unwrap().seconds * 1e6 - 15.0).abs() < 0.01);
        // Two nodes, tree LL: 6.8 + 2 (7 x 0.6 x 1.8 + 5.0).
        let c = t.price_with(
            Op::AllReduce,
            8,
            &t.world_group(),
            Algorithm::Tree,
            Protocol::Ll,
        );
        assert!((c.unwrap().seconds * 1e6 - 32.0).abs() < 0.1);
        // One rank per node: the ring's network hops take the tree's figure.
        let pair = t.strided_group(2, 8).unwrap();
        let c = t.price_with(Op::AllReduce, 8, &pair, Algorithm::Ring, Protocol::Ll);
        assert!((c.unwrap().seconds * 1e6 - 16.6).abs() < 0.01);
    }

    #[test]
    fn small_messages_use_low_latency_and_large_ones_simple() {
        let t = topo("a100-80gb", 8);
        let g = t.world_group();
        assert_eq!(t.price(Op::AllReduce, 8, &g).protocol, Protocol::Ll);
        assert_eq!(
            t.price(Op::AllReduce, 1 << 32, &g).protocol,
            Protocol::Simple
        );
        // On 8 H100s the large all-reduce goes to the switch.
        let t = topo("h100-sxm-80gb", 8);
        let c = t.price(Op::AllReduce, 1 << 32, &t.world_group());
        assert_eq!(c.algorithm, Algorithm::Nvls);
        // NVLS does not pay off on 2 GPUs: the ring's 2(n-1)/n is only 1 there.
        let pair = t.group(2, 2).unwrap();
        assert_eq!(
            t.price(Op::AllReduce, 1 << 32, &pair).algorithm,
            Algorithm::Ring
        );
    }
}
