//! Ranks as processes: `memfit launch` (and `memfit run` under torchrun's
//! variables) against the threaded `memfit run --ranks N`: the same losses,
//! bit for bit, and the same per-rank peaks; and every way a rank can fail
//! ends the job in bounded time with a message naming the rank or variable.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::{comparable, json, stderr};
use serde_json::Value;

/// The variables that make `memfit run` a rank.
const DIST_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "MEMFIT_DIST_TIMEOUT",
    "MEMFIT_TEST_RANK_FAULT",
    "MEMFIT_DIST_BACKEND",
    "MEMFIT_MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "MEMFIT_LAUNCH_TOKEN",
];

/// memfit with `args` and exactly the distributed variables in `env`.
fn memfit_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_memfit"));
    for v in DIST_VARS {
        c.env_remove(v);
    }
    c.args(args).envs(env.iter().copied());
    c.output().expect("memfit runs")
}

/// `run --format json` with `extra`, and llama-tiny for 3 steps unless
/// `extra` says otherwise.
fn run_args(extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = ["run", "--format", "json"].map(String::from).to_vec();
    for (flag, default) in [("--model", "llama-tiny"), ("--steps", "3")] {
        if !extra.contains(&flag) {
            v.extend([flag.to_string(), default.to_string()]);
        }
    }
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// `memfit run ARGS` (threads) and `memfit launch --nproc N -- run ARGS`.
fn both(n: usize, extra: &[&str], env: &[(&str, &str)]) -> (Output, Output) {
    let run = run_args(extra);
    let threaded = memfit_with(&refs(&run), env);
    let nproc = n.to_string();
    let mut launch = vec!["launch", "--nproc", &nproc, "--"];
    launch.extend(refs(&run));
    let launched = memfit_with(&launch, env);
    (threaded, launched)
}

fn assert_same(n: usize, extra: &[&str], env: &[(&str, &str)]) -> Value {
    let (threaded, launched) = both(n, extra, env);
    assert!(threaded.status.success(), "{}", stderr(&threaded));
    assert!(launched.status.success(), "{}", stderr(&launched));
    let (t, l) = (json(&threaded), json(&launched));
    assert_eq!(t["steps"].as_array().unwrap().len(), 3, "{extra:?}");
    assert_eq!(t["ranks"].as_array().unwrap().len(), n);
    assert_eq!(comparable(&l), comparable(&t), "{extra:?}");
    l
}

#[test]
fn launched_ranks_train_as_threaded_ranks_do() {
    for sharding in ["zero2", "ddp", "zero3"] {
        let doc = assert_same(4, &["--ranks", "4", "--sharding", sharding], &[]);
        // Ranks really exchanged data.
        assert!(doc["ranks"][3]["received_bytes_per_step"].as_u64().unwrap() > 0);
    }
    // Hybrid sharding: ZeRO-3 within groups of 2, replicated across them.
    assert_same(
        4,
        &["--ranks", "4", "--sharding", "zero3", "--shard-group", "2"],
        &[],
    );
    // Tensor parallelism: pairs of adjacent ranks split each block, the
    // pairs zero2 replicas of each other; pairs (sequence-parallel) as
    // pipeline stages; and ZeRO++ hpZ, zero3 with the backward's gathers
    // within pairs.
    for layout in [
        &["--tensor-parallel", "2", "--sharding", "zero2"][..],
        &[
            "--tensor-parallel",
            "2",
            "--sequence-parallel",
            "--pipeline-stages",
            "2",
        ][..],
        &["--sharding", "zero3", "--hpz-group", "2"][..],
        // Expert parallelism: pairs of ranks split moe-tiny's experts and
        // exchange tokens all-to-all, dropless (each rank's peak its own).
        &[
            "--model",
            "moe-tiny",
            "--sharding",
            "zero2",
            "--expert-parallel",
            "2",
        ][..],
    ] {
        let args = [&["--ranks", "4"][..], layout].concat();
        assert_same(4, &args, &[]);
    }
}

#[test]
fn launched_pipeline_and_offload_match_threads() {
    // 2 stages x 2 replicas (rank r is replica r % 2 of stage r / 2), gpt2's
    // tied embedding across the first and the last stage, 1F1B.
    assert_same(
        4,
        &[
            "--model",
            "gpt2-tiny",
            "--ranks",
            "4",
            "--pipeline-stages",
            "2",
            "--sharding",
            "ddp",
            "--grad-accum",
            "2",
        ],
        &[],
    );
    // Interleaved 1F1B over two processes: each is the other's previous
    // and next stage (the ring of virtual stages), so activations and
    // gradients must not share a channel.
    let doc = assert_same(
        2,
        &[
            "--model",
            "gpt2-tiny",
            "--ranks",
            "2",
            "--pipeline-stages",
            "2",
            "--virtual-stages",
            "2",
            "--grad-accum",
            "4",
        ],
        &[],
    );
    assert_eq!(
        doc["ranks"][0]["chunks"],
        serde_json::json!([[0, 0], [1, 2]])
    );
    // ZeRO-Offload: host peaks per rank and per node, bf16.
    let doc = assert_same(
        2,
        &[
            "--ranks",
            "2",
            "--sharding",
            "zero2",
            "--offload",
            "optimizer",
            "--precision",
            "bf16",
            "--host-memory",
            "8GiB",
        ],
        &[],
    );
    assert!(
        doc["ranks"][1]["host_peak_bytes"]["total"]
            .as_u64()
            .unwrap()
            > 0
    );
}

#[test]
fn out_of_memory_is_reported_by_rank_0_as_threads_report_it() {
    // In a step (every rank fails at the same allocation) and while building
    // the engines (the report shows the failing rank only).
    for extra in [
        &[
            "--ranks",
            "4",
            "--sharding",
            "zero2",
            "--device",
            "cpu:limit=2MiB",
        ][..],
        &[
            "--ranks",
            "2",
            "--sharding",
            "ddp",
            "--device",
            "cpu:limit=1MiB",
        ][..],
    ] {
        let n = extra[1].parse().unwrap();
        let (threaded, launched) = both(n, extra, &[]);
        assert_eq!(threaded.status.code(), Some(3), "{}", stderr(&threaded));
        assert_eq!(launched.status.code(), Some(3), "{}", stderr(&launched));
        let (t, l) = (json(&threaded), json(&launched));
        assert_eq!(l["error"]["rank"], 0);
        assert_eq!(comparable(&l), comparable(&t), "{extra:?}");
        assert!(stderr(&launched).contains("rank 0: out of memory"));
    }
}

#[test]
fn rank_0_prints_the_one_table() {
    let args = [
        "launch",
        "--nproc",
        "2",
        "--",
        "--model",
        "llama-tiny",
        "--ranks",
        "2",
        "--sharding",
        "zero2",
        "--steps",
        "1",
    ];
    let out = memfit_with(&args, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        table
            .matches("peak memory per rank, highest of 2 ranks")
            .count(),
        1,
        "{table}"
    );
    assert_eq!(
        table.matches("\n  1 ").count(),
        1,
        "one line for rank 1: {table}"
    );
}

/// Two `memfit run` processes given the variables by hand, as torchrun
/// `--no-python` does: rank 0 prints the report, rank 1 nothing. torchrun's
/// agent hosts its own store on MASTER_PORT (and says so with
/// TORCHELASTIC_USE_AGENT_STORE=True), so a listener holds it here too and
/// memfit's rank 0 listens on the port after it.
#[test]
fn torchrun_style_environment() {
    // A port held by the "agent" whose successor is free.
    let (agent, port) = loop {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            break (l, p.to_string());
        }
    };
    let run = run_args(&["--ranks", "2", "--sharding", "zero3"]);
    let spawn = |rank: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_memfit"));
        for v in DIST_VARS {
            c.env_remove(v);
        }
        c.args(refs(&run))
            .envs([
                ("RANK", rank),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", rank),
                ("MASTER_ADDR", "localhost"),
                ("MASTER_PORT", port.as_str()),
                ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Rank 1 first: it retries until rank 0 listens.
    let r1 = spawn("1");
    std::thread::sleep(Duration::from_millis(200));
    let r0 = spawn("0");
    let (o0, o1) = (
        r0.wait_with_output().unwrap(),
        r1.wait_with_output().unwrap(),
    );
    drop(agent);
    assert!(o0.status.success(), "{}", stderr(&o0));
    assert!(o1.status.success(), "{}", stderr(&o1));
    assert!(
        o1.stdout.is_empty(),
        "rank 1 printed {:?}",
        String::from_utf8_lossy(&o1.stdout)
    );
    let threaded = memfit_with(&refs(&run), &[]);
    assert_eq!(comparable(&json(&o0)), comparable(&json(&threaded)));
}

#[test]
fn emulated_gpus_launch_like_threads() {
    let emu = [("MEMFIT_CUDA_EMULATE", "2GiB")];
    let extra = [
        "--model",
        "gpt2-tiny",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--device",
        "cuda",
        "--ranks",
        "2",
        "--sharding",
        "zero2",
    ];
    let run = run_args(&extra);
    let threaded = memfit_with(&refs(&run), &emu);
    let mut launch = vec!["launch", "--nproc", "2", "--"];
    launch.extend(refs(&run));
    let launched = memfit_with(&launch, &emu);
    assert!(threaded.status.success(), "{}", stderr(&threaded));
    assert!(launched.status.success(), "{}", stderr(&launched));
    assert_eq!(comparable(&json(&launched)), comparable(&json(&threaded)));
    // NCCL needs a real GPU.
    let mut env = emu.to_vec();
    env.push(("MEMFIT_DIST_BACKEND", "nccl"));
    let out = memfit_with(&launch, &env);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("MEMFIT_DIST_BACKEND: nccl needs a real GPU"),
        "{}",
        stderr(&out)
    );
}

/// `memfit launch ... ` with a fault, timed.
fn faulty(n: usize, env: &[(&str, &str)], grace: &str) -> (Output, Duration) {
    let nproc = n.to_string();
    let ranks = n.to_string();
    let mut args = vec!["launch", "--nproc", &nproc, "--grace", grace, "--"];
    let run = run_args(&["--ranks", &ranks, "--sharding", "zero2", "--steps", "50"]);
    args.extend(refs(&run));
    let start = Instant::now();
    let out = memfit_with(&args, env);
    (out, start.elapsed())
}

#[test]
fn a_killed_rank_stops_the_job() {
    let (out, took) = faulty(4, &[("MEMFIT_TEST_RANK_FAULT", "2:sigkill")], "5");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(128 + 9), "{err}");
    assert!(took < Duration::from_secs(60), "{took:?}");
    assert!(
        err.contains("rank 2 (pid") && err.contains("killed by signal 9"),
        "{err}"
    );
    // Rank 0 names the rank it lost, and prints no report.
    assert!(err.contains("rank 2's connection closed"), "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn a_rank_that_exits_stops_the_job() {
    let (out, took) = faulty(3, &[("MEMFIT_TEST_RANK_FAULT", "1:exit")], "5");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(took < Duration::from_secs(60), "{took:?}");
    assert!(
        err.contains("rank 1 (pid") && err.contains("exited with code 1"),
        "{err}"
    );
}

#[test]
fn a_silent_rank_times_out_and_is_killed() {
    let env = [
        ("MEMFIT_TEST_RANK_FAULT", "2:hang"),
        ("MEMFIT_DIST_TIMEOUT", "2"),
    ];
    let (out, took) = faulty(3, &env, "1");
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(4), "{err}");
    // The timeout, rank 0's wait for the reports (one more), the grace.
    assert!(took < Duration::from_secs(40), "{took:?}");
    assert!(
        err.contains("nothing from rank 2 for 2 s (MEMFIT_DIST_TIMEOUT)"),
        "{err}"
    );
    assert!(err.contains("memfit launch: stopping rank 2"), "{err}");
}

#[test]
fn a_rank_pointed_at_a_bad_port_says_so_in_time() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let run = run_args(&["--ranks", "2", "--sharding", "zero2"]);
    let env = [
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", port.as_str()),
        ("MEMFIT_DIST_TIMEOUT", "1"),
    ];
    let start = Instant::now();
    let out = memfit_with(&refs(&run), &env);
    assert!(start.elapsed() < Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("MASTER_PORT: rank 1 could not reach rank 0")
            && err.contains(&format!("MASTER_PORT={port}")),
        "{err}"
    );
}

#[test]
fn a_rank_environment_missing_a_variable_is_exit_2() {
    let run = run_args(&["--ranks", "2", "--sharding", "zero2"]);
    for (env, var) in [
        (&[("RANK", "1")][..], "WORLD_SIZE"),
        (&[("WORLD_SIZE", "2")][..], "RANK"),
        (&[("RANK", "0"), ("WORLD_SIZE", "2")][..], "MASTER_ADDR"),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
            ][..],
            "MASTER_PORT",
        ),
    ] {
        let out = memfit_with(&refs(&run), env);
        assert_eq!(out.status.code(), Some(2), "{env:?}");
        let err = stderr(&out);
        assert!(
            err.starts_with(&format!("memfit: {var}: ")),
            "{env:?}: {err}"
        );
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn ranks_must_equal_the_world() {
    let run = run_args(&["--ranks", "4", "--sharding", "zero2"]);
    let mut launch = vec!["launch", "--nproc", "2", "--"];
    launch.extend(refs(&run));
    let out = memfit_with(&launch, &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--ranks: the run has --ranks 4 but --nproc is 2"),
        "{}",
        stderr(&out)
    );
    // A rank started by hand.
    let env = [
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29511"),
    ];
    let out = memfit_with(&refs(&run), &env);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--ranks: 4 but WORLD_SIZE is 2"),
        "{}",
        stderr(&out)
    );
    // launch starts memfit run only.
    let out = memfit_with(&["launch", "--nproc", "2", "--", "plan", "x.yaml"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("starts `memfit run` ranks"),
        "{}",
        stderr(&out)
    );
}

/// A port free on loopback now.
fn free_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port().to_string()
}

/// Issue 26: `memfit launch` listened on every interface with no
/// authentication, even on one node, and a peer that connected and stayed
/// silent stalled start-up for 10 s without a word. Rank 0 of a job whose
/// ranks all run on this host now listens on loopback only; a connection
/// without the job's launch token, or one that says nothing for 3 s, is
/// dropped with its address named, and the job goes on.
#[test]
fn strangers_at_master_port_are_dropped_and_named() {
    use memfit::comm::process::{DistEnv, ProcessGroup};
    let port = free_port();
    let env_of = |local_world: &str| {
        let vars = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", local_world),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", port.as_str()),
        ];
        DistEnv::from_vars(|k| {
            vars.iter()
                .find(|(v, _)| *v == k)
                .map(|(_, x)| x.to_string())
        })
        .unwrap()
        .unwrap()
    };
    let one_host = ProcessGroup::listen(&env_of("2")).unwrap();
    assert!(one_host.local_addr().unwrap().ip().is_loopback());
    drop(one_host);
    // Ranks on other hosts must reach it: every interface.
    let spread = ProcessGroup::listen(&env_of("1")).unwrap();
    assert!(spread.local_addr().unwrap().ip().is_unspecified());
    drop(spread);

    let run = run_args(&["--ranks", "2", "--sharding", "ddp", "--steps", "1"]);
    let spawn = |rank: &str, token: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_memfit"));
        for v in DIST_VARS {
            c.env_remove(v);
        }
        c.args(refs(&run))
            .envs([
                ("RANK", rank),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", port.as_str()),
                ("MEMFIT_DIST_TIMEOUT", "30"),
                ("MEMFIT_LAUNCH_TOKEN", token),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let start = Instant::now();
    let r0 = spawn("0", "s3cret");
    let connect = || loop {
        match std::net::TcpStream::connect(("127.0.0.1", port.parse::<u16>().unwrap())) {
            Ok(s) => break s,
            Err(_) if start.elapsed() < Duration::from_secs(20) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("rank 0 never listened: {e}"),
        }
    };
    // One stranger says nothing; another says a rank's hello without the token.
    let silent = connect();
    let mut tokenless = connect();
    let mut hello = b"memfitpg".to_vec();
    for v in [1u32, 1, 2] {
        hello.extend_from_slice(&v.to_le_bytes());
    }
    hello.extend_from_slice(&1u16.to_le_bytes());
    let mut frame = vec![1u8];
    frame.extend_from_slice(&0u32.to_le_bytes());
    frame.extend_from_slice(&(hello.len() as u64).to_le_bytes());
    frame.extend_from_slice(&hello);
    std::io::Write::write_all(&mut tokenless, &frame).unwrap();
    let r1 = spawn("1", "s3cret");
    let (o0, o1) = (
        r0.wait_with_output().unwrap(),
        r1.wait_with_output().unwrap(),
    );
    drop((silent, tokenless));
    let took = start.elapsed();
    let e0 = stderr(&o0);
    assert!(o0.status.success(), "{e0}");
    assert!(o1.status.success(), "{}", stderr(&o1));
    assert!(
        e0.contains("rank 0: dropped a connection from 127.0.0.1:")
            && e0.contains("it sent no hello within 3 s"),
        "{e0}"
    );
    assert!(
        e0.contains("it presented no launch token (MEMFIT_LAUNCH_TOKEN)"),
        "{e0}"
    );
    assert!(took < Duration::from_secs(20), "{took:?}");

    // Across nodes the launchers must share a secret: refused without one.
    let mut launch = vec![
        "launch",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--nproc",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        &port,
        "--",
    ];
    let two = run_args(&["--ranks", "2", "--sharding", "ddp"]);
    launch.extend(refs(&two));
    let o = memfit_with(&launch, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("MEMFIT_LAUNCH_TOKEN: not set"),
        "{}",
        stderr(&o)
    );
}
