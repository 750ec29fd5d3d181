//! The collective pricing model (`memfit::comm::topology`) against published
//! nccl-tests results. Each figure is cited where it is used, with the
//! tolerance it is checked to and why.
//!
//! nccl-tests' `size` is one rank's full buffer; its bus bandwidth is the
//! algorithm bandwidth times 2(n-1)/n for all-reduce (doc/PERFORMANCE.md in
//! github.com/NVIDIA/nccl-tests), which the model reports the same way.

use memfit::comm::Op;
use memfit::comm::topology::{Algorithm, Group, Links, Protocol, Topology};
use memfit::config::hardware::{load_hardware, load_network};

const GB: f64 = 1e9;
/// The largest size nccl-tests runs are usually reported at: 8 GiB.
const LARGE: u64 = 8 << 30;

fn topo(hw: &str, world: usize) -> Topology {
    Topology::new(&load_hardware(hw).unwrap(), None, world).unwrap()
}

/// All-reduce bus bandwidth over the whole job, GB/s.
fn all_reduce_busbw(t: &Topology, bytes: u64) -> f64 {
    t.price(Op::AllReduce, bytes, &t.world_group()).busbw / GB
}

fn assert_within(model: f64, published: f64, tolerance: f64, what: &str) {
    let error = (model - published).abs() / published;
    assert!(
        error <= tolerance,
        "{what}: model {model:.1}, published {published:.1} ({:.1}% off, {:.0}% allowed)",
        error * 100.0,
        tolerance * 100.0
    );
}

/// 8 x A100 SXM4 80GB in one node (NVLink 3 through NVSwitch, 300 GB/s per
/// direction). Azure's AI benchmarking guide, ND A100 v4 results
/// (github.com/Azure/AI-benchmarking-guide, Azure_Results/ND_A100_v4_results.md,
/// NCCL 2.18.5): all_reduce_perf in-place bus bandwidth 231.58 GB/s at 8 GB
/// (230.22 at 2 GB). NCCL's own tuner caps A100 at 235 GB/s. The model's
/// NVLink efficiency (0.8) is one figure for A100 and H100, set from NVIDIA's
/// "~20% protocol overhead" (nccl-tests issue 212); it gives 240 GB/s here,
/// so the tolerance is 5%.
#[test]
fn a100_single_node_all_reduce() {
    let t = topo("a100-80gb", 8);
    let busbw = all_reduce_busbw(&t, LARGE);
    assert_within(busbw, 231.58, 0.05, "8 x A100 all-reduce busbw");
    let c = t.price(Op::AllReduce, LARGE, &t.world_group());
    assert_eq!((c.algorithm, c.links), (Algorithm::Ring, Links::Intra));
}

/// 8 x H100 SXM5 in one node (NVLink 4 through third-generation NVSwitch, 450
/// GB/s per direction), where NCCL runs all-reduce with NVLink SHARP (NVLS).
/// Published: 478.87 GB/s bus bandwidth at 8 GB (Azure, ND_H100_v5_results.md
/// in github.com/Azure/AI-benchmarking-guide, NCCL 2.18.5); "476GB/s looks to
/// be in the expected range for H100" (NVIDIA, github.com/NVIDIA/nccl-tests/issues/290);
/// "~480GB/s (algbw ~275GB/s)" (NVIDIA, github.com/NVIDIA/nccl-tests/issues/212).
/// The model's NVLS bandwidth is calibrated to that last figure, so this is a
/// consistency check: 5%.
#[test]
fn h100_single_node_all_reduce_uses_nvls() {
    let t = topo("h100-sxm-80gb", 8);
    let c = t.price(Op::AllReduce, LARGE, &t.world_group());
    assert_eq!(c.algorithm, Algorithm::Nvls);
    assert_within(c.busbw / GB, 478.87, 0.05, "8 x H100 all-reduce busbw");
    assert_within(c.algbw / GB, 275.0, 0.05, "8 x H100 all-reduce algbw");
    // The same on H200, whose NVLink and NVSwitch are the H100's.
    assert_within(
        all_reduce_busbw(&topo("h200-141gb", 8), LARGE),
        478.87,
        0.05,
        "H200",
    );
}

/// 8 x H100 with the ring forced (`NCCL_ALGO=RING`), or any collective that
/// is not an all-reduce: "busbw is about 365-370 GBps when gpus from 2 to 8"
/// (github.com/NVIDIA/nccl/issues/1455, 2-4 GB messages); "NCCL can get an
/// effective NVLink bandwidth of 370GB/s, which you can observe as BusBw when
/// running non-allreduce operations, or when running with NCCL_ALGO=RING"
/// (NVIDIA, github.com/NVIDIA/nccl-tests/issues/212). Model: 0.8 x 450 = 360
/// GB/s; 5%.
#[test]
fn h100_ring_and_other_collectives() {
    let t = topo("h100-sxm-80gb", 8);
    for n in [2, 4, 8] {
        let g = t.group(n, n).unwrap();
        let ring = t
            .price_with(
                Op::AllReduce,
                4 << 30,
                &g,
                Algorithm::Ring,
                Protocol::Simple,
            )
            .unwrap();
        assert_within(ring.busbw / GB, 367.5, 0.05, &format!("{n} x H100 ring"));
    }
    let g = t.world_group();
    for op in [Op::AllGather, Op::ReduceScatter, Op::Broadcast] {
        let c = t.price(op, LARGE, &g);
        assert_eq!(c.algorithm, Algorithm::Ring);
        assert_within(c.busbw / GB, 370.0, 0.05, &format!("8 x H100 {op:?}"));
    }
}

/// Across DGX A100 nodes (8 x ConnectX-6 HDR 200 Gb/s per node): "On an Nvidia
/// DGX-A100 system we have 8x200Gbit/s IB cards and we measure 192GB/s
/// AllReduce BusBW" (NVIDIA, github.com/NVIDIA/nccl/issues/812). The node count
/// is not given; the model is checked on 4 and 16 nodes, where the ring over
/// the eight NICs (8 x 25 x 0.94 = 188 GB/s) sets the pace: 5%.
#[test]
fn dgx_a100_multi_node_all_reduce() {
    for nodes in [4, 16] {
        let t = topo("a100-80gb", 8 * nodes);
        let c = t.price(Op::AllReduce, LARGE, &t.world_group());
        assert_eq!((c.algorithm, c.links), (Algorithm::Ring, Links::IntraInter));
        assert_within(c.busbw / GB, 192.0, 0.05, &format!("{nodes} DGX A100"));
    }
}

/// One NDR InfiniBand NIC: "For NDR @ 400Gbps you should see 46-48GB/s per
/// NIC" (NVIDIA, github.com/NVIDIA/nccl-tests/issues/290, advising
/// NCCL_ALGO=RING on two nodes to measure the network). A group of one GPU
/// per node uses exactly one NIC per rank; the model must land in 46-48.
/// With all 8 GPUs (and NICs) per node the ring is capped by NVLink's ring
/// rate instead (370 GB/s, above), below the NICs' 8 x 47.
#[test]
fn ndr_per_nic_ring_bandwidth() {
    let t = topo("h100-sxm-80gb", 16);
    let one_per_node = t.strided_group(2, 8).unwrap();
    let c = t
        .price_with(
            Op::AllReduce,
            LARGE,
            &one_per_node,
            Algorithm::Ring,
            Protocol::Simple,
        )
        .unwrap();
    assert_eq!(c.links, Links::Inter);
    let busbw = c.busbw / GB;
    assert!((46.0..=48.0).contains(&busbw), "{busbw}");

    let all = t.world_group();
    let c = t
        .price_with(
            Op::AllReduce,
            LARGE,
            &all,
            Algorithm::Ring,
            Protocol::Simple,
        )
        .unwrap();
    assert_within(c.busbw / GB, 370.0, 0.05, "2 x 8 H100 ring");
}

/// Two nodes: NCCL's tree sends each byte across the network once instead of
/// the ring's 2(n-1)/n, so its bus bandwidth can exceed the NICs' line rate
/// ("We often see two nodes Tree BusBW figures that exceed the theoretical
/// limit of the network cards", NVIDIA, github.com/NVIDIA/nccl/issues/812,
/// on DGX A100s with 8 x 100 Gb/s NICs). The model on that system: the tree
/// beats the ring and exceeds 8 x 12.5 GB/s.
#[test]
fn two_node_tree_exceeds_the_network() {
    let hw = load_hardware("a100-80gb").unwrap();
    let mut net = load_network("ib-hdr-200").unwrap();
    net.nic_gbps = 12.5; // 100 Gb/s NICs, one per GPU
    let t = Topology::new(&hw, Some(&net), 16).unwrap();
    let c = t.price(Op::AllReduce, LARGE, &t.world_group());
    assert_eq!(c.algorithm, Algorithm::Tree);
    assert!(c.busbw / GB > 100.0, "{c:?}");
}

/// At scale NCCL runs H100/H200 clusters' all-reduce with NVLS-Tree, which
/// the model does not have; its ring and tree should come out somewhat below
/// what is measured. "typically measuring around 350G" for a 512 MB
/// all-reduce on 248 nodes of 8 x H200 (github.com/NVIDIA/nccl-tests/issues/283).
/// The model (tree, latency-bound ring) gives about 300: checked to be below
/// the published figure and within 20% of it.
#[test]
fn h200_at_248_nodes() {
    let t = topo("h200-141gb", 248 * 8);
    let c = t.price(Op::AllReduce, 512 << 20, &t.world_group());
    assert_eq!(c.algorithm, Algorithm::Tree);
    let busbw = c.busbw / GB;
    assert!(busbw < 350.0, "{busbw}");
    assert_within(busbw, 350.0, 0.20, "248 x 8 H200 all-reduce");
}

/// All-reduce time in microseconds over the whole job.
fn all_reduce_us(t: &Topology, bytes: u64) -> f64 {
    t.price(Op::AllReduce, bytes, &t.world_group()).seconds * 1e6
}

/// Checks a published nccl-tests table of (size, in-place time in us) to 30%.
fn assert_times(t: &Topology, published: &[(u64, f64)], what: &str) {
    for &(bytes, us) in published {
        assert_within(
            all_reduce_us(t, bytes),
            us,
            0.30,
            &format!("{what}, {bytes} B"),
        );
    }
}

/// Small messages are latency, composed as NCCL's tuning model composes it
/// (src/comm/topology.rs): a base latency per algorithm and protocol plus a
/// hop latency per step. The published figures below are nccl-tests'
/// in-place all-reduce times, one process per GPU (`mpirun -np N ...
/// all_reduce_perf -g 1`), NCCL's default tuning. What the model achieves:
/// within 25% of every one of them from 8 bytes to 64 KB, on one 8-GPU
/// NVLink node (-16% to +15%), on two nodes over InfiniBand or RoCE (-25%
/// to 0%) and on four over InfiniBand (-18% to +10%); each is checked to 30%.
/// It tends to be low at 8-64 KB across nodes, where NCCL still runs a
/// message on few channels. No published table for 8 or 16 nodes was found
/// (`small_messages_are_latency_bound` checks the model's structure there).
///
/// Before it followed NCCL's tables the model priced every hop at the
/// ring's LL figure and sat up to 2x below published times across nodes
/// (20 us for 1 KB on two A100 nodes against 35.85; 27 us for 64 KB on four
/// H100 nodes against 56.42), and it was compared with Azure's one-node
/// figures, which are not default runs (`azure_tables_force_nvls_in_one_process`).
///
/// One 8-GPU node, DGX H100: NVIDIA's sample output in
/// github.com/NVIDIA/dgxc-benchmarking, nccl/README.md (8 ranks on one
/// node): 13.03 us at 8 B, 16.17 at 1 KB ... 18.85 at 64 KB. The model's
/// ring LL: 6.6 + 14 x 0.6 = 15.0 us, plus the bytes.
#[test]
fn one_node_small_messages() {
    let t = topo("h100-sxm-80gb", 8);
    let h100 = [
        (8, 13.03),
        (1 << 10, 16.17),
        (4 << 10, 16.46),
        (8 << 10, 16.83),
        (16 << 10, 17.24),
        (32 << 10, 18.68),
        (64 << 10, 18.85),
    ];
    assert_times(&t, &h100, "8 x H100");
    let c = t.price(Op::AllReduce, 8, &t.world_group());
    assert_eq!((c.algorithm, c.protocol), (Algorithm::Ring, Protocol::Ll));
    // 8 x A100 80GB, NCCL 2.17.1: 16.96 us at 1 KB (Microsoft's NDm A100 v4
    // figures, github.com/microsoft/mscclpp, docs/performance-ndmv4.md).
    assert_times(&topo("a100-80gb", 8), &[(1 << 10, 16.96)], "8 x A100");
}

/// Two nodes over InfiniBand HDR. The tree (a chain of 8 GPUs in each node,
/// one network level) wins: 6.8 + 2(7 x 0.6 x 1.8 + 5.0) = 32 us.
/// Published, NDm A100 v4 (8 x A100 80GB and 8 x HDR per node), NCCL
/// 2.17.1, github.com/microsoft/mscclpp docs/performance-ndmv4.md: 35.85 us
/// at 1 KB with 8 GPUs per node, 21.27 with one. With one A100 per node on
/// HDR: 18.96 us at 8 B and 19.07 at 64 B (github.com/NVIDIA/nccl-tests/issues/150).
#[test]
fn two_nodes_small_messages() {
    let t = topo("a100-80gb", 16);
    assert_times(&t, &[(1 << 10, 35.85)], "2 x 8 A100");
    let c = t.price(Op::AllReduce, 1 << 10, &t.world_group());
    assert_eq!((c.algorithm, c.protocol), (Algorithm::Tree, Protocol::Ll));
    let pair = t.strided_group(2, 8).unwrap();
    for (bytes, us) in [(8, 18.96), (64, 19.07), (1 << 10, 21.27)] {
        let model = t.price(Op::AllReduce, bytes, &pair).seconds * 1e6;
        assert_within(model, us, 0.30, &format!("2 x 1 A100, {bytes} B"));
    }
}

/// Two nodes over RoCE: Oracle's example output for two BM.GPU4.8 nodes (8 x
/// A100 40GB each, RDMA over converged Ethernet), github.com/oracle-quickstart/oci-hpc-oke,
/// README.md: 34.74 us at 8 B to 50.09 at 64 KB. The model on the `roce-200`
/// profile (3.5 us a hop where InfiniBand has 2.7). Its growth with size is
/// LL's capped network rate (20 GB/s); the published times grow faster from
/// 8 KB, where NCCL still runs the message on few channels.
#[test]
fn two_nodes_over_roce_small_messages() {
    let hw = load_hardware("a100-40gb").unwrap();
    let t = Topology::new(&hw, Some(&load_network("roce-200").unwrap()), 16).unwrap();
    let oci = [
        (8, 34.74),
        (1 << 10, 40.56),
        (4 << 10, 43.36),
        (8 << 10, 46.51),
        (16 << 10, 48.00),
        (32 << 10, 49.17),
        (64 << 10, 50.09),
    ];
    assert_times(&t, &oci, "2 x 8 A100 over RoCE");
}

/// Four nodes of 8 x H100 over NDR InfiniBand (3.2 Tb/s a node), NCCL
/// 2.24.3: Voltage Park's cluster as benchmarked by AI @ Georgia Tech,
/// github.com/ZiyanIshani/vpbenchmarking,
/// results/nccl/nccl_multinode/nccl_allreduce_20260224_225706.txt: 38.27 us
/// at 8 B to 56.42 at 64 KB. The model's tree: 6.8 + 2(7 x 1.08 + 2 x 5.0)
/// = 41.9 us, plus the bytes.
#[test]
fn four_nodes_small_messages() {
    let t = topo("h100-sxm-80gb", 32);
    let vp = [
        (8, 38.27),
        (1 << 10, 39.02),
        (4 << 10, 43.37),
        (8 << 10, 51.49),
        (16 << 10, 53.44),
        (32 << 10, 55.46),
        (64 << 10, 56.42),
    ];
    assert_times(&t, &vp, "4 x 8 H100");
    let c = t.price(Op::AllReduce, 64 << 10, &t.world_group());
    assert_eq!((c.algorithm, c.protocol), (Algorithm::Tree, Protocol::Ll));
}

/// Azure's AI benchmarking guide (github.com/Azure/AI-benchmarking-guide)
/// reports 0.07 GB/s of bus bandwidth for a 1 KB all-reduce on 8 H100s, i.e.
/// 25.6 us, and 0.04 GB/s (44.8 us) on 8 A100s: 1.5-2.6x the default times
/// above. Its Benchmarks/NVIDIA/NCCLBandwidth.py runs
/// `NCCL_ALGO=NVLS all_reduce_perf -g 8`: NVLS forced (which A100s lack, so
/// NCCL falls back), and all 8 GPUs driven from one thread, which launches
/// their kernels one after another. That launch mode alone makes the same
/// H100 node read 32.5-33.5 us flat up to 64 KB (vpbenchmarking,
/// results/nccl/nccl_allreduce_20260224_223444.txt, `-g 8`) against 13-19 us
/// with a process per GPU. Forced NVLS is what the model can check: its one
/// 25 us NVLS hop against Azure's H100 (ND H100 v5, NCCL 2.18.5) and H200
/// (ND H200 v5, 2.20.5) tables, 1-8 KB, where the times are flat.
#[test]
fn azure_tables_force_nvls_in_one_process() {
    for (hw, table) in [
        (
            "h100-sxm-80gb",
            [
                (1 << 10, 0.07),
                (2 << 10, 0.14),
                (4 << 10, 0.27),
                (8 << 10, 0.53),
            ],
        ),
        (
            "h200-141gb",
            [
                (1 << 10, 0.06),
                (2 << 10, 0.12),
                (4 << 10, 0.23),
                (8 << 10, 0.47),
            ],
        ),
    ] {
        let t = topo(hw, 8);
        let g = t.world_group();
        for (bytes, busbw) in table {
            let published = bytes as f64 * 1.75 / (busbw * GB) * 1e6;
            let nvls = t
                .price_with(Op::AllReduce, bytes, &g, Algorithm::Nvls, Protocol::Simple)
                .unwrap();
            assert_within(
                nvls.seconds * 1e6,
                published,
                0.30,
                &format!("{hw} NVLS, {bytes} B"),
            );
            // NCCL's default picks the ring with LL instead, faster.
            assert!(t.price(Op::AllReduce, bytes, &g).seconds < nvls.seconds);
        }
    }
}

/// Small messages are latency: more nodes add network hops. With NCCL's
/// tree each doubling of the nodes adds one level, two network hops (up and
/// down) of 5.0 us each. No published small-message table for 8 or 16 nodes
/// was found; the model gives about 52 and 62 us for 8 B on 8 and 16 DGX
/// H100s.
#[test]
fn small_messages_are_latency_bound() {
    let t = topo("h100-sxm-80gb", 8);
    let tiny = t.price(Op::AllReduce, 8, &t.world_group());
    assert_eq!(tiny.protocol, Protocol::Ll);
    let mut last = tiny.seconds * 1e6;
    assert!((5.0..50.0).contains(&last), "{last} us");
    let mut last_nodes = 1;
    for nodes in [2, 4, 8, 16, 64] {
        let t = topo("h100-sxm-80gb", 8 * nodes);
        let c = t.price(Op::AllReduce, 8, &t.world_group());
        let us = c.seconds * 1e6;
        assert!(us > last, "{nodes} nodes: {us} us after {last}");
        assert!(c.links.crosses_network());
        assert_eq!(c.algorithm, Algorithm::Tree);
        if last_nodes > 1 {
            let levels = (nodes / last_nodes).trailing_zeros() as f64;
            let added = us - last;
            assert!(
                (added - 10.0 * levels).abs() < 0.1,
                "{nodes} nodes: +{added} us"
            );
        }
        (last, last_nodes) = (us, nodes);
    }
    assert!(last < 200.0, "{last} us");
}

/// Across many nodes the tree's log2(nodes) latency beats the ring's
/// 2(n-1) steps for small messages; for large ones the ring's bandwidth wins.
#[test]
fn tree_for_small_messages_ring_for_large() {
    for hw in ["a100-80gb", "h100-sxm-80gb"] {
        let t = topo(hw, 64 * 8);
        let g = t.world_group();
        let small = t.price(Op::AllReduce, 64 << 10, &g);
        assert_eq!(small.algorithm, Algorithm::Tree, "{hw}");
        let ring = t
            .price_with(Op::AllReduce, 64 << 10, &g, Algorithm::Ring, small.protocol)
            .unwrap();
        assert!(ring.seconds > 2.0 * small.seconds, "{hw}: {ring:?}");
        let large = t.price(Op::AllReduce, 16 << 30, &g);
        assert_eq!(large.algorithm, Algorithm::Ring, "{hw}");
    }
    // Eight nodes, the same split.
    let t = topo("a100-80gb", 64);
    let g = t.world_group();
    assert_eq!(
        t.price(Op::AllReduce, 4 << 10, &g).algorithm,
        Algorithm::Tree
    );
    assert_eq!(
        t.price(Op::AllReduce, 8 << 30, &g).algorithm,
        Algorithm::Ring
    );
}

/// 64 GPUs on 8 nodes take longer than 8 GPUs in one node for the same
/// buffer, at every size.
#[test]
fn eight_nodes_are_slower_than_one() {
    for hw in ["h100-sxm-80gb", "a100-40gb", "l4", "rtx-3090"] {
        let one = topo(hw, load_hardware(hw).unwrap().gpus_per_node as usize);
        let per_node = one.gpus_per_node;
        let many = topo(hw, 8 * per_node);
        for op in [
            Op::AllReduce,
            Op::ReduceScatter,
            Op::AllGather,
            Op::Broadcast,
        ] {
            for bytes in [8u64, 4 << 10, 1 << 20, 64 << 20, 4 << 30] {
                let a = one.price(op, bytes, &one.world_group());
                let b = many.price(op, bytes, &many.world_group());
                assert!(b.seconds > a.seconds, "{hw} {op:?} {bytes}: {b:?} vs {a:?}");
                assert_eq!(a.links, Links::Intra);
                assert_eq!(b.links, Links::IntraInter);
            }
        }
    }
}

/// A data-parallel group under 8-way tensor parallelism (ranks 8 apart) only
/// uses the network, one NIC per rank; the tensor-parallel group only NVLink.
#[test]
fn data_parallel_group_across_nodes() {
    let t = topo("h100-sxm-80gb", 64);
    let dp = t.strided_group(8, 8).unwrap();
    assert_eq!(
        dp,
        Group {
            size: 8,
            ranks_per_node: 1
        }
    );
    let grads = 1 << 30;
    let c = t.price(Op::AllReduce, grads, &dp);
    assert_eq!(c.links, Links::Inter);
    // One NIC per rank: about 47 GB/s of bus bandwidth.
    assert_within(c.busbw / GB, 47.0, 0.05, "DP over one NIC per rank");
    let tp = t.group(8, 8).unwrap();
    let c_tp = t.price(Op::AllReduce, grads, &tp);
    assert_eq!(c_tp.links, Links::Intra);
    assert!(c.seconds > 5.0 * c_tp.seconds);
    // Ranks 4 apart: two per node share two NICs.
    let g = t.strided_group(16, 4).unwrap();
    assert_eq!((g.ranks_per_node, g.nodes()), (2, 8));
    let c2 = t.price(Op::AllReduce, grads, &g);
    assert_within(c2.busbw / GB, 94.0, 0.05, "two NICs per node");
}
