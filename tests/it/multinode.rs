//! `memfit launch` across machines, as torchrun's `--nnodes`, `--node-rank`
//! and `--master-addr` run it: two network namespaces joined by a veth pair
//! (10.77.0.1 and 10.77.0.2) stand for two hosts, each running one launcher
//! of two ranks. Node 0's report must equal the threaded `memfit run
//! --ranks 4` bit for bit, and a rank, a launcher or the link lost on node 1
//! must end node 0 in bounded time with exit 4 (a lost peer).
//!
//! Namespaces need root and iproute2's `ip`; without them these tests say
//! why and pass, unless MEMFIT_REQUIRE_NETNS=1 (CI) makes that a failure.
//! The flag checks and a two-node job over loopback run everywhere.

use std::io::Read;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::common::{comparable, json, stderr};
use serde_json::Value;

/// The variables that make `memfit run` a rank (none may leak in).
const DIST_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MEMFIT_DIST_TIMEOUT",
    "MEMFIT_TEST_RANK_FAULT",
    "MEMFIT_DIST_BACKEND",
    "MEMFIT_MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
];

/// Node 0's and node 1's addresses on the veth pair.
const HOST_ADDRS: [&str; 2] = ["10.77.0.1", "10.77.0.2"];
const MASTER_PORT: &str = "29500";

fn memfit() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_memfit"));
    for v in DIST_VARS {
        c.env_remove(v);
    }
    c.env("MEMFIT_LAUNCH_TOKEN", TOKEN);
    c
}

/// The secret every node's launcher shares (required across nodes).
const TOKEN: &str = "multinode-test-secret";

/// `ip ARGS`, which must succeed; why not, otherwise.
fn ip(args: &[&str]) -> Result<String, String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => "the `ip` tool (iproute2) is not installed".to_string(),
            _ => format!("`ip` cannot run: {e}"),
        })?;
    if !out.status.success() {
        return Err(format!(
            "`ip {}` failed ({}): {}",
            args.join(" "),
            out.status,
            stderr(&out).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Two network namespaces joined by a veth pair: two hosts. Dropping it
/// kills whatever still runs in them and deletes them (and so the pair),
/// whether the test passed or not.
struct TwoHosts {
    names: Vec<String>,
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// Deletes the namespaces of earlier test processes that were killed before
/// their guards ran (their names carry the pid, now gone).
fn sweep_stale() {
    let Ok(list) = ip(&["netns", "list"]) else {
        return;
    };
    for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
        let Some(pid) = name
            .strip_prefix("memfit-test-")
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let left = ip(&["netns", "pids", name]).unwrap_or_default();
        for p in left.split_whitespace() {
            let _ = Command::new("kill").args(["-9", p]).status();
        }
        let _ = ip(&["netns", "del", name]);
        let _ = std::fs::remove_dir_all(std::path::Path::new("/etc/netns").join(name));
    }
}

impl TwoHosts {
    fn new() -> Result<TwoHosts, String> {
        static SWEEP: std::sync::Once = std::sync::Once::new();
        SWEEP.call_once(sweep_stale);
        let id = format!(
            "memfit-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        );
        let mut hosts = TwoHosts { names: Vec::new() };
        for node in 0..2 {
            let name = format!("{id}-node{node}");
            // A namespace of this name outlived a killed test process
            // whose pid this one reuses.
            let _ = ip(&["netns", "del", &name]);
            ip(&["netns", "add", &name])?;
            hosts.names.push(name);
        }
        let [a, b] = [hosts.names[0].as_str(), hosts.names[1].as_str()];
        // Created inside the namespaces: no name in the host's namespace.
        ip(&[
            "link", "add", "veth0", "netns", a, "type", "veth", "peer", "name", "veth0", "netns", b,
        ])?;
        for (ns, addr) in [a, b].into_iter().zip(HOST_ADDRS) {
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "veth0",
            ])?;
            ip(&["-n", ns, "link", "set", "veth0", "up"])?;
            // Through `ip netns exec`, as the launchers will run.
            ip(&["netns", "exec", ns, "ip", "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    fn ns(&self, node: usize) -> &str {
        &self.names[node]
    }

    /// The processes running on `node`.
    fn pids(&self, node: usize) -> Vec<u32> {
        ip(&["netns", "pids", self.ns(node)])
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }

    /// Gives `node` its own /etc/hosts (`ip netns exec` mounts
    /// /etc/netns/NAME/hosts over it).
    fn hosts_file(&self, node: usize, text: &str) {
        let dir = std::path::Path::new("/etc/netns").join(self.ns(node));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("hosts"), text).unwrap();
    }

    /// Bytes `node` received over the veth pair.
    fn rx_bytes(&self, node: usize) -> u64 {
        let out = ip(&["-n", self.ns(node), "-j", "-s", "link", "show", "veth0"]).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        v[0]["stats64"]["rx"]["bytes"].as_u64().unwrap()
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for node in 0..self.names.len() {
            // Only this test's processes live in its namespaces.
            for pid in self.pids(node) {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        }
        for name in &self.names {
            if let Err(why) = ip(&["netns", "del", name]) {
                eprintln!("cleaning up: {why}");
            }
            let _ = std::fs::remove_dir_all(std::path::Path::new("/etc/netns").join(name));
        }
    }
}

/// Two hosts, or `None` (with the reason on stderr) where namespaces cannot
/// be made, a failure under MEMFIT_REQUIRE_NETNS=1.
fn two_hosts(test: &str) -> Option<TwoHosts> {
    match TwoHosts::new() {
        Ok(h) => Some(h),
        Err(why) => {
            let why = format!(
                "network namespaces are unavailable (they need root or CAP_SYS_ADMIN and iproute2): {why}"
            );
            if std::env::var("MEMFIT_REQUIRE_NETNS").is_ok_and(|v| v.trim() == "1") {
                panic!("MEMFIT_REQUIRE_NETNS=1 but {why}");
            }
            eprintln!("skipping {test}: {why}");
            None
        }
    }
}

/// `run --format json` on llama-tiny for 3 steps on 4 ranks (unless
/// `extra` says otherwise).
fn run_args(extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = ["run", "--format", "json"].map(String::from).to_vec();
    for (flag, default) in [
        ("--model", "llama-tiny"),
        ("--steps", "3"),
        ("--ranks", "4"),
    ] {
        if !extra.contains(&flag) {
            v.extend([flag.to_string(), default.to_string()]);
        }
    }
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// One node's launcher, running.
struct Node {
    node: usize,
    child: Child,
    out: JoinHandle<Vec<u8>>,
    err: JoinHandle<Vec<u8>>,
}

fn drain(mut r: impl Read + Send + 'static) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = r.read_to_end(&mut v);
        v
    })
}

/// A job of two nodes: where they run, where rank 0 is, ranks per node.
#[derive(Clone, Copy)]
struct Job<'a> {
    /// The two namespaces, or `None`: both launchers on this host.
    hosts: Option<&'a TwoHosts>,
    master: &'a str,
    port: &'a str,
    nproc: usize,
}

impl<'a> Job<'a> {
    /// Two hosts, two ranks each, rank 0 at node 0's address.
    fn on(hosts: &'a TwoHosts) -> Job<'a> {
        Job {
            hosts: Some(hosts),
            master: HOST_ADDRS[0],
            port: MASTER_PORT,
            nproc: 2,
        }
    }

    /// `memfit launch` for `node`.
    fn start(self, node: usize, run: &[String], env: &[(&str, &str)]) -> Node {
        let mut c = match self.hosts {
            Some(h) => {
                let mut c = Command::new("ip");
                for v in DIST_VARS {
                    c.env_remove(v);
                }
                c.env("MEMFIT_LAUNCH_TOKEN", TOKEN);
                // `ip netns exec` execs memfit: the child is the launcher.
                c.args(["netns", "exec", h.ns(node), env!("CARGO_BIN_EXE_memfit")]);
                c
            }
            None => memfit(),
        };
        let (node_s, nproc) = (node.to_string(), self.nproc.to_string());
        c.args([
            "launch",
            "--nnodes",
            "2",
            "--node-rank",
            &node_s,
            "--master-addr",
            self.master,
            "--master-port",
            self.port,
            // torchrun's name for it on node 1, memfit's on node 0.
            if node == 0 {
                "--nproc"
            } else {
                "--nproc-per-node"
            },
            &nproc,
            "--grace",
            "2",
            "--",
        ]);
        let mut child = c
            .args(run)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the launcher starts");
        let out = drain(child.stdout.take().unwrap());
        let err = drain(child.stderr.take().unwrap());
        Node {
            node,
            child,
            out,
            err,
        }
    }

    /// Both nodes; node 1 first (its ranks retry until rank 0 listens).
    fn run(self, run: &[String], env: [&[(&str, &str)]; 2]) -> [Node; 2] {
        let n1 = self.start(1, run, env[1]);
        std::thread::sleep(Duration::from_millis(100));
        let n0 = self.start(0, run, env[0]);
        [n0, n1]
    }

    /// A clean job's outputs, checked against the threaded run: node 0's
    /// report equals it, node 1 prints nothing and succeeds.
    fn assert_same_as_threads(self, extra: &[&str]) -> Value {
        let run = run_args(extra);
        let threaded = memfit().args(&run).output().expect("memfit runs");
        assert!(threaded.status.success(), "{}", stderr(&threaded));
        let start = Instant::now();
        let [n0, n1] = self.run(&run, [&[], &[]]);
        let limit = Duration::from_secs(120);
        let ((o0, took), (o1, _)) = (n0.finish(start, limit), n1.finish(start, limit));
        eprintln!("two nodes, {extra:?}: {took:?}");
        assert!(o0.status.success(), "node 0: {}", stderr(&o0));
        assert!(o1.status.success(), "node 1: {}", stderr(&o1));
        assert!(
            o1.stdout.is_empty(),
            "node 1 printed {:?}",
            String::from_utf8_lossy(&o1.stdout)
        );
        let (t, l) = (json(&threaded), json(&o0));
        assert_eq!(t["ranks"].as_array().unwrap().len(), 2 * self.nproc);
        assert_eq!(comparable(&l), comparable(&t), "{extra:?}");
        l
    }
}

impl Node {
    /// Its output once it exits; killed (and failing the test) if it runs
    /// past `limit` from `since`.
    fn finish(mut self, since: Instant, limit: Duration) -> (Output, Duration) {
        let status: ExitStatus = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if since.elapsed() > limit {
                let _ = self.child.kill();
                let _ = self.child.wait();
                // Ranks that outlived it would hold its stderr open.
                let end = Instant::now() + Duration::from_secs(5);
                while !self.err.is_finished() && Instant::now() < end {
                    std::thread::sleep(Duration::from_millis(20));
                }
                let err = match self.err.is_finished() {
                    true => String::from_utf8_lossy(&self.err.join().unwrap()).into_owned(),
                    false => "(still open: its ranks outlived it)".into(),
                };
                panic!(
                    "node {}'s launcher still ran {limit:?} on; killed. stderr:\n{err}",
                    self.node
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let took = since.elapsed();
        let out = Output {
            status,
            stdout: self.out.join().unwrap(),
            stderr: self.err.join().unwrap(),
        };
        (out, took)
    }
}

#[test]
fn two_hosts_train_as_threads_do() {
    let Some(hosts) = two_hosts("two_hosts_train_as_threads_do") else {
        return;
    };
    let job = Job::on(&hosts);
    let before = hosts.rx_bytes(1);
    let doc = job.assert_same_as_threads(&["--sharding", "zero2"]);
    // Node 1's ranks got their share over the link, not over loopback.
    let rank2 = doc["ranks"][2]["received_bytes_per_step"].as_u64().unwrap();
    assert!(rank2 > 0);
    let crossed = hosts.rx_bytes(1) - before;
    assert!(
        crossed >= rank2,
        "node 1 received {crossed} bytes over the veth pair, rank 2 alone {rank2} a step"
    );
    // ZeRO-3 within each node, replicated across the two; and a pipeline
    // whose stage 0 (ranks 0, 1) is node 0 and stage 1 (ranks 2, 3) node 1.
    job.assert_same_as_threads(&["--sharding", "zero3", "--shard-group", "2"]);
    job.assert_same_as_threads(&[
        "--model",
        "gpt2-tiny",
        "--pipeline-stages",
        "2",
        "--sharding",
        "ddp",
        "--grad-accum",
        "2",
    ]);
}

/// The classic trap: node 0's /etc/hosts maps its own name to a loopback
/// address (Debian's 127.0.1.1), the other hosts resolve it to its real
/// one. Rank 0 listens on every interface, so node 1 reaches it anyway; a
/// second rank on node 0 would reach rank 0 over loopback and listen
/// there, out of node 1's reach, which rank 0 refuses at once, naming
/// MASTER_ADDR, instead of node 1 waiting out the timeout.
#[test]
fn a_master_name_that_is_loopback_on_node_0() {
    let Some(hosts) = two_hosts("a_master_name_that_is_loopback_on_node_0") else {
        return;
    };
    hosts.hosts_file(0, "127.0.0.1 localhost\n127.0.1.1 node0\n");
    hosts.hosts_file(
        1,
        &format!("127.0.0.1 localhost\n{} node0\n", HOST_ADDRS[0]),
    );
    let job = Job {
        master: "node0",
        ..Job::on(&hosts)
    };
    // One rank a node: the job runs.
    Job { nproc: 1, ..job }.assert_same_as_threads(&["--ranks", "2", "--sharding", "zero2"]);
    // Two: refused.
    let start = Instant::now();
    let [n0, n1] = job.run(&run_args(&["--sharding", "zero2"]), [&[], &[]]);
    let limit = Duration::from_secs(90);
    let ((o0, took), (o1, _)) = (n0.finish(start, limit), n1.finish(start, limit));
    let (e0, e1) = (stderr(&o0), stderr(&o1));
    assert!(took < Duration::from_secs(60), "{took:?}");
    assert_eq!(o0.status.code(), Some(2), "node 0: {e0}");
    assert!(
        e0.contains("MASTER_ADDR: rank 1 reached rank 0 over loopback (127.")
            && e0.contains(
                "with MASTER_ADDR=node0) but rank 2 joined from another host (10.77.0.2)"
            ),
        "node 0: {e0}"
    );
    assert_eq!(o1.status.code(), Some(2), "node 1: {e1}");
    // Node 1's ranks say why, in whichever order they print.
    let why = "rank 0 stopped the rendezvous: rank 1 reached rank 0 over loopback";
    assert!(
        ["rank 2: ", "rank 3: "]
            .iter()
            .any(|r| e1.contains(&format!("{r}{why}"))),
        "node 1: {e1}"
    );
}

/// Training long enough to be stopped midway.
fn long_run() -> Vec<String> {
    run_args(&["--sharding", "zero2", "--steps", "100000"])
}

/// Waits until the job's collectives cross the link: past the rendezvous,
/// every connection made.
fn wait_for_training(hosts: &TwoHosts, nodes: &mut [Node; 2]) {
    let start = Instant::now();
    let base = hosts.rx_bytes(1);
    while hosts.rx_bytes(1) < base + (1 << 20) {
        for n in nodes.iter_mut() {
            if let Some(s) = n.child.try_wait().unwrap() {
                panic!("node {} ended ({s}) before training", n.node);
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the job did not start training in 60 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_rank_killed_on_node_1_stops_node_0() {
    let Some(hosts) = two_hosts("a_rank_killed_on_node_1_stops_node_0") else {
        return;
    };
    let run = run_args(&["--sharding", "zero2", "--steps", "50"]);
    let start = Instant::now();
    let fault: &[(&str, &str)] = &[("MEMFIT_TEST_RANK_FAULT", "3:sigkill")];
    let [n0, n1] = Job::on(&hosts).run(&run, [&[], fault]);
    let limit = Duration::from_secs(90);
    let ((o0, took), (o1, _)) = (n0.finish(start, limit), n1.finish(start, limit));
    let (e0, e1) = (stderr(&o0), stderr(&o1));
    eprintln!("a rank killed on node 1: node 0 ended after {took:?}");
    // Well within MEMFIT_DIST_TIMEOUT's default 300 s: the closed
    // connection tells, not a timeout.
    assert!(took < Duration::from_secs(60), "{took:?}");
    assert_eq!(o0.status.code(), Some(4), "node 0: {e0}");
    assert!(e0.contains("rank 3's connection closed"), "node 0: {e0}");
    assert!(o0.stdout.is_empty(), "node 0 printed a report");
    assert_eq!(o1.status.code(), Some(128 + 9), "node 1: {e1}");
    assert!(
        e1.contains("memfit launch (node 1 of 2): rank 3 (pid") && e1.contains("signal 9"),
        "node 1: {e1}"
    );
}

#[test]
fn node_1_launcher_killed_stops_its_ranks_and_node_0() {
    let Some(hosts) = two_hosts("node_1_launcher_killed_stops_its_ranks_and_node_0") else {
        return;
    };
    let mut nodes = Job::on(&hosts).run(&long_run(), [&[], &[]]);
    wait_for_training(&hosts, &mut nodes);
    let [n0, mut n1] = nodes;
    // SIGKILL: the launcher cannot stop its ranks itself.
    let killed = Instant::now();
    n1.child.kill().unwrap();
    let (o1, _) = n1.finish(killed, Duration::from_secs(10));
    assert_eq!(o1.status.code(), None, "killed");
    let (o0, took) = n0.finish(killed, Duration::from_secs(90));
    let e0 = stderr(&o0);
    eprintln!("node 1's launcher killed: node 0 ended after {took:?}");
    assert!(took < Duration::from_secs(60), "{took:?}");
    assert_eq!(o0.status.code(), Some(4), "node 0: {e0}");
    assert!(e0.contains("connection closed"), "node 0: {e0}");
    assert!(o0.stdout.is_empty(), "node 0 printed a report");
    // Its ranks died with it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !hosts.pids(1).is_empty() {
        assert!(
            Instant::now() < deadline,
            "node 1's ranks outlived their launcher: pids {:?}",
            hosts.pids(1)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_cut_link_ends_both_nodes_within_the_timeout() {
    let Some(hosts) = two_hosts("a_cut_link_ends_both_nodes_within_the_timeout") else {
        return;
    };
    let timeout: &[(&str, &str)] = &[("MEMFIT_DIST_TIMEOUT", "5")];
    let mut nodes = Job::on(&hosts).run(&long_run(), [timeout, timeout]);
    wait_for_training(&hosts, &mut nodes);
    // No FIN, no RST: the other host is simply gone.
    let cut = Instant::now();
    ip(&["-n", hosts.ns(0), "link", "set", "veth0", "down"]).unwrap();
    let [n0, n1] = nodes;
    let limit = Duration::from_secs(90);
    let ((o0, t0), (o1, t1)) = (n0.finish(cut, limit), n1.finish(cut, limit));
    let (e0, e1) = (stderr(&o0), stderr(&o1));
    eprintln!("link cut: node 0 ended after {t0:?}, node 1 after {t1:?}");
    // Node 0: the timeout, then one more for the lost ranks' reports, the
    // grace. Node 1: the timeout, then waiting for rank 0's word (two more
    // and 5 s). Either way bounded, with slack for a loaded machine.
    assert!(t0 < Duration::from_secs(40), "{t0:?}");
    assert!(t1 < Duration::from_secs(60), "{t1:?}");
    assert_eq!(o0.status.code(), Some(4), "node 0: {e0}");
    assert_eq!(o1.status.code(), Some(4), "node 1: {e1}");
    for e in [&e0, &e1] {
        assert!(e.contains("for 5 s (MEMFIT_DIST_TIMEOUT)"), "{e}");
    }
    assert!(o0.stdout.is_empty(), "node 0 printed a report");
}

/// Two launchers on one host, as two nodes over loopback: the multi-node
/// placement (ranks, world, MASTER_ADDR) runs without namespaces too.
#[test]
fn two_nodes_on_one_host_over_loopback() {
    let port = std::net::TcpListener::bind("0.0.0.0:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    Job {
        hosts: None,
        master: "127.0.0.1",
        port: &port,
        nproc: 2,
    }
    .assert_same_as_threads(&["--sharding", "zero2"]);
}

/// Offload on two nodes of two ranks: the host record's node figure is one
/// node's ranks' host memory (the fullest node's), not the job's.
#[test]
fn offloaded_host_memory_is_counted_per_node() {
    let port = std::net::TcpListener::bind("0.0.0.0:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let job = Job {
        hosts: None,
        master: "127.0.0.1",
        port: &port,
        nproc: 2,
    };
    let run = run_args(&[
        "--sharding",
        "zero2",
        "--offload",
        "optimizer",
        "--host-memory",
        "8GiB",
    ]);
    let start = Instant::now();
    let [n0, n1] = job.run(&run, [&[], &[]]);
    let limit = Duration::from_secs(120);
    let ((o0, _), (o1, _)) = (n0.finish(start, limit), n1.finish(start, limit));
    assert!(o0.status.success(), "node 0: {}", stderr(&o0));
    assert!(o1.status.success(), "node 1: {}", stderr(&o1));
    let doc: Value = serde_json::from_slice(&o0.stdout).unwrap();
    let host = |r: usize| {
        doc["ranks"][r]["host_peak_bytes"]["total"]
            .as_u64()
            .unwrap()
    };
    let per_node = (host(0) + host(1)).max(host(2) + host(3));
    assert_eq!(doc["host"]["node_bytes"], per_node, "{}", doc["host"]);
    assert!(per_node < (0..4).map(host).sum::<u64>());
}

#[test]
fn multi_node_flags_are_checked() {
    let refused = |flags: &[&str], needle: &str| {
        let out = memfit()
            .args(flags)
            .args(["--"])
            .args(run_args(&["--sharding", "zero2"]))
            .output()
            .unwrap();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.starts_with("memfit launch: "), "{flags:?}: {err}");
        assert!(err.contains(needle), "{flags:?}: {err}");
        assert!(out.stdout.is_empty());
    };
    let node1 = [
        "launch",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--nproc",
        "2",
    ];
    refused(
        &node1,
        "--master-addr: required with --nnodes 2: node 0's address",
    );
    refused(
        &[&node1[..], &["--master-addr", "10.77.0.1"]].concat(),
        "--master-port: required with --nnodes 2",
    );
    refused(
        &[
            "launch",
            "--nnodes",
            "2",
            "--node-rank",
            "2",
            "--nproc",
            "2",
            "--master-addr",
            "10.77.0.1",
            "--master-port",
            "29500",
        ],
        "--node-rank: 2 is outside 0..2 (--nnodes is 2)",
    );
    refused(
        &[
            "launch",
            "--nnodes",
            "4",
            "--nproc",
            "2",
            "--master-addr",
            "10.77.0.1",
            "--master-port",
            "29500",
        ],
        "--ranks: the run has --ranks 4 but the job has --nnodes 4 x --nproc 2 = 8 ranks",
    );
    refused(
        &[
            &node1[..],
            &[
                "--master-addr",
                "no-such-host.invalid",
                "--master-port",
                "29500",
            ],
        ]
        .concat(),
        "--master-addr: cannot resolve `no-such-host.invalid`",
    );
}
