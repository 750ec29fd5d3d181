//! Bad input is a located error and exit code 2, never a panic or a hang:
//! files that never end, huge grids, deep YAML, absurd model sizes, byte
//! order marks, and run recipes whose errors must name the recipe.

use crate::common::{scratch, scratch_file, stderr};

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Runs memfit, killing it (and failing the test) if it takes longer than
/// `limit`: every case here used to hang or run for minutes.
fn memfit_within(limit: Duration, args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .env("MEMFIT_NO_GPU_CALIBRATION", "1")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("memfit runs");
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            child.kill().unwrap();
            let o = child.wait_with_output().unwrap();
            panic!(
                "memfit {args:?} ran past {limit:?}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn quick(args: &[&str]) -> Output {
    memfit_within(Duration::from_secs(20), args)
}

/// Exit code 2 and an error on stderr containing each of `want`.
fn bad_input(o: &Output, want: &[&str]) -> String {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    for w in want {
        assert!(err.contains(w), "stderr lacks {w:?}:\n{err}");
    }
    err
}

fn fixture(path: &str) -> String {
    format!("{}/tests/fixtures/{path}", env!("CARGO_MANIFEST_DIR"))
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

const PLAN_HEAD: &str = "model: gpt2-tiny\nhardware: t4\nseq_len: 16\nglobal_batch: 8\n";

#[test]
fn model_dev_zero_is_refused_instead_of_read_forever() {
    let dir = scratch("dev-zero");
    let recipe = dir.join("plan.yaml");
    std::fs::write(&recipe, PLAN_HEAD.replace("gpt2-tiny", "/dev/zero")).unwrap();
    // The recipe's file and line, then what is wrong with the model file.
    let err = bad_input(
        &quick(&["plan", s(&recipe)]),
        &["plan.yaml:1:1:", "/dev/zero", "not a regular file"],
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    bad_input(
        &quick(&["run", "--model", "/dev/zero", "--device", "meta"]),
        &["/dev/zero", "not a regular file"],
    );
    let run_recipe = dir.join("run.yaml");
    std::fs::write(&run_recipe, "model: /dev/zero\n").unwrap();
    bad_input(
        &quick(&["run", "--recipe", s(&run_recipe), "--device", "meta"]),
        &["run.yaml:1:1: `model`", "not a regular file"],
    );
    bad_input(&quick(&["plan", "/dev/zero"]), &["not a regular file"]);
    bad_input(
        &quick(&["run", "--recipe", "/dev/zero"]),
        &["not a regular file"],
    );
}

#[test]
fn a_fifo_recipe_is_refused_instead_of_waiting_for_a_writer() {
    let dir = scratch("fifo");
    let fifo = dir.join("recipe.yaml");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    bad_input(&quick(&["plan", s(&fifo)]), &["a FIFO"]);
    bad_input(
        &quick(&["sweep", s(&fifo), "--out", s(&dir.join("out"))]),
        &["a FIFO"],
    );
}

#[test]
fn files_over_four_mib_are_refused() {
    let dir = scratch("big");
    let recipe = dir.join("plan.yaml");
    let mut text = PLAN_HEAD.to_string();
    text.push_str(&"# padding\n".repeat(500_000));
    std::fs::write(&recipe, text).unwrap();
    bad_input(
        &quick(&["plan", s(&recipe)]),
        &["plan.yaml", "larger than 4.00 MiB"],
    );
    let config = dir.join("config.json");
    std::fs::write(&config, format!("{{\"x\": \"{}\"}}", "y".repeat(5 << 20))).unwrap();
    bad_input(
        &quick(&["run", "--model", s(&config), "--device", "meta"]),
        &["config.json", "larger than 4.00 MiB"],
    );
}

#[test]
fn a_grid_of_millions_of_points_is_an_error_before_expansion() {
    // 2000 x 3 x 2 x 2 x 4 x 2 x 2 = 384,000 points; a 5M-point grid ran for minutes.
    let dir = scratch("grid");
    let recipe = dir.join("plan.yaml");
    let mbs: Vec<String> = (1..=2000).map(|i| i.to_string()).collect();
    std::fs::write(
        &recipe,
        format!(
            "{PLAN_HEAD}grid:\n  micro_batch: [{}]\n  precision: [fp32, bf16, fp16]\n  \
             checkpointing: [none, full]\n  attention: [eager, fused]\n  \
             optimizer: [adamw, adamw8bit, adafactor, sgd]\n  gpus: [1, 2]\n  sharding: [ddp, zero1]\n",
            mbs.join(", ")
        ),
    )
    .unwrap();
    let start = Instant::now();
    bad_input(
        &quick(&["plan", s(&recipe)]),
        &[
            "plan.yaml:5:1:",
            "`grid` expands to 384000 points",
            "more than 100000",
        ],
    );
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn deep_yaml_nesting_is_a_located_error_not_minutes_of_parsing() {
    // 200,000 levels took libyaml over a minute (its cost grows with the square).
    let dir = scratch("deep");
    let recipe = dir.join("plan.yaml");
    let n = 200_000;
    std::fs::write(
        &recipe,
        format!("{PLAN_HEAD}grid: {}{}\n", "[".repeat(n), "]".repeat(n)),
    )
    .unwrap();
    let start = Instant::now();
    bad_input(
        &memfit_within(Duration::from_secs(10), &["plan", s(&recipe)]),
        &["plan.yaml:5:71:", "deeper than 64 levels"],
    );
    assert!(start.elapsed() < Duration::from_secs(5));
    // The same for a model profile and a run recipe.
    let profile = dir.join("model.yaml");
    std::fs::write(&profile, format!("name: {}x\n", "{".repeat(n))).unwrap();
    bad_input(
        &quick(&["run", "--model", s(&profile), "--device", "meta"]),
        &["model.yaml:1:71:", "deeper than 64 levels"],
    );
}

#[test]
fn a_million_layer_model_is_refused_naming_the_key_and_the_limit() {
    bad_input(
        &quick(&[
            "run",
            "--model",
            &fixture("invalid/models/too-many-layers.yaml"),
            "--device",
            "meta",
        ]),
        &[
            "too-many-layers.yaml:8:",
            "`n_layer` is 1000000",
            "at most 1024",
        ],
    );
    // A Hugging Face config names its own key.
    let dir = scratch("layers");
    let config = dir.join("config.json");
    std::fs::write(
        &config,
        r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
  "num_hidden_layers": 1000000, "num_attention_heads": 4,
  "max_position_embeddings": 128, "vocab_size": 256}"#,
    )
    .unwrap();
    bad_input(
        &quick(&["plan", "--format", "json", &{
            let recipe = dir.join("plan.yaml");
            std::fs::write(&recipe, PLAN_HEAD.replace("gpt2-tiny", "config.json")).unwrap();
            recipe.display().to_string()
        }]),
        &[
            "config.json:2:3:",
            "`num_hidden_layers` is 1000000",
            "at most 1024",
        ],
    );
}

#[test]
fn a_byte_order_mark_is_accepted_and_lines_stay_right() {
    let dir = scratch("bom");
    let bom = "\u{feff}";
    let recipe = dir.join("plan.yaml");
    std::fs::write(&recipe, format!("{bom}{PLAN_HEAD}")).unwrap();
    let o = quick(&["plan", s(&recipe), "--format", "json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // An error's line and column are the editor's.
    std::fs::write(&recipe, format!("{bom}{PLAN_HEAD}headroom: lots\n")).unwrap();
    bad_input(&quick(&["plan", s(&recipe)]), &["plan.yaml:5:11:"]);
    let config = dir.join("config.json");
    std::fs::write(
        &config,
        format!(
            "{bom}{{\"model_type\": \"gpt2\", \"n_embd\": 32, \"n_layer\": 1, \"n_head\": 2,\n\
             \"n_positions\": 64, \"vocab_size\": 256}}"
        ),
    )
    .unwrap();
    let o = quick(&["run", "--model", s(&config), "--device", "meta"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let run_recipe = dir.join("run.yaml");
    std::fs::write(
        &run_recipe,
        format!("{bom}model: gpt2-tiny\nseq_len: 16\nsteps: 1\n"),
    )
    .unwrap();
    let o = quick(&["run", "--recipe", s(&run_recipe), "--device", "meta"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn a_recipe_device_error_points_at_its_line_and_column() {
    // It pointed at 1:1, the start of the mapping.
    bad_input(
        &quick(&["plan", &fixture("invalid/plans/bad-device.yaml")]),
        &["bad-device.yaml:5:9:", "`lots` is not a size"],
    );
    bad_input(
        &quick(&[
            "run",
            "--recipe",
            &fixture("invalid/recipes/bad-device.yaml"),
        ]),
        &["bad-device.yaml:2:9:", "unknown device `tpu`"],
    );
}

#[test]
fn run_recipe_errors_name_the_recipe_and_its_key() {
    // They named the flag (`--seq-len`) that was never given.
    let err = bad_input(
        &quick(&[
            "run",
            "--recipe",
            &fixture("invalid/recipes/seq-len-too-long.yaml"),
        ]),
        &["seq-len-too-long.yaml:3:1: `seq_len`: 100000 is outside 1..=128"],
    );
    assert!(!err.contains("--seq-len"), "{err}");
    bad_input(
        &quick(&[
            "run",
            "--recipe",
            &fixture("invalid/recipes/zero-threads.yaml"),
        ]),
        &["zero-threads.yaml:3:1: `threads`: must be at least 1"],
    );
    // A flag given on the command line is still named as the flag.
    bad_input(
        &quick(&[
            "run",
            "--recipe",
            &fixture("invalid/recipes/seq-len-too-long.yaml"),
            "--seq-len",
            "99999",
        ]),
        &["--seq-len: 99999 is outside"],
    );
    // A misspelt model gets the suggestion `--model` gets, at the recipe's key
    // (it was read as a file beside the recipe, which did not exist).
    bad_input(
        &quick(&[
            "run",
            "--recipe",
            &fixture("invalid/recipes/unknown-model.yaml"),
        ]),
        &[
            "unknown-model.yaml:1:1: `model`: unknown model `gpt2-tinyy`",
            "did you mean `gpt2-tiny`?",
        ],
    );
}

#[test]
fn a_huge_thread_count_is_refused_instead_of_starting_for_minutes() {
    // `memfit run --threads 100000` spent minutes starting its thread pool.
    bad_input(
        &quick(&["run", "--threads", "100000", "--steps", "1"]),
        &["--threads", "at most 4096"],
    );
    let recipe = scratch_file("threads", "run.yaml", "model: gpt2-tiny\nthreads: 100000\n");
    bad_input(
        &quick(&["run", "--recipe", s(&recipe)]),
        &["run.yaml:2:1: `threads`: must be at most 4096"],
    );
    bad_input(
        &quick(&["calibrate", "--threads", "100000"]),
        &["--threads", "at most 4096"],
    );
}

/// Issue 26: `global_batch: 2^63` was planned, and recommended at $inf per
/// million tokens, "beating the runner-up by NaN%".
#[test]
fn a_global_batch_past_run_bounds_is_refused_not_priced_at_infinity() {
    let recipe = scratch_file(
        "huge-batch",
        "plan.yaml",
        PLAN_HEAD.replace("global_batch: 8", "global_batch: 9223372036854775808"),
    );
    let err = bad_input(
        &quick(&["plan", s(&recipe)]),
        &["plan.yaml:4:1:", "`global_batch`", "2^50 tokens"],
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    // Just inside the bound it plans, with finite prices only.
    let inside = (1u64 << 50) / 16;
    std::fs::write(
        &recipe,
        PLAN_HEAD.replace("global_batch: 8", &format!("global_batch: {inside}")),
    )
    .unwrap();
    let o = quick(&["plan", s(&recipe), "--format", "json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    for bad in ["inf", "NaN", "null"] {
        assert!(!out.contains(bad), "{bad} in {out}");
    }
}

/// Issue 26: meta's peaks for llama-3.1-70b passed 2^64 bytes and wrapped,
/// so micro-batch 1e10 reported a smaller total than 8e9, with exit 0.
#[test]
fn a_step_past_two_to_the_64_bytes_is_refused_not_wrapped() {
    for mb in ["7000000000", "8000000000", "10000000000"] {
        let args = [
            "run",
            "--model",
            "llama-3.1-70b",
            "--device",
            "meta",
            "--seq-len",
            "64",
            "--micro-batch",
            mb,
        ];
        let err = bad_input(&quick(&args), &["--micro-batch", "nothing can hold that"]);
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    // Large but addressable: planned, with a peak that grows with the batch.
    let peak = |mb: &str| {
        let o = quick(&[
            "run",
            "--model",
            "llama-3.1-70b",
            "--device",
            "meta",
            "--seq-len",
            "64",
            "--micro-batch",
            mb,
            "--format",
            "json",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["peak_bytes"]["total"].as_u64().unwrap()
    };
    assert!(peak("2000") < peak("4000"));
}

/// Issue 26: `--data /dev/zero` (or a recipe's `data:`, or `check
/// /dev/zero`) read until memory ran out: 2.1 GB in 4 s under a cap.
#[test]
fn data_and_reports_from_devices_are_refused_instead_of_read_forever() {
    let dir = scratch("data-dev");
    let tiny = ["--model", "gpt2-tiny", "--seq-len", "16", "--steps", "1"];
    for dev in ["/dev/zero", "/dev/urandom"] {
        let mut args = vec!["run", "--data", dev];
        args.extend(tiny);
        let err = bad_input(&quick(&args), &[dev, "not a regular file (a device)"]);
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    let recipe = dir.join("run.yaml");
    std::fs::write(&recipe, "model: gpt2-tiny\nseq_len: 16\ndata: /dev/zero\n").unwrap();
    bad_input(
        &quick(&["run", "--recipe", s(&recipe), "--steps", "1"]),
        &["/dev/zero", "not a regular file"],
    );
    let err = bad_input(
        &quick(&["check", "/dev/zero", "--baseline", "/dev/zero"]),
        &["/dev/zero", "not a regular file", "sweep reports"],
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// Issue 26: a FIFO blocked `check`, `run --data` and `run --timeline`
/// forever, waiting for a writer (or a reader) that never came.
#[test]
fn fifos_are_refused_instead_of_waiting_forever() {
    let dir = scratch("fifo-io");
    let fifo = dir.join("pipe");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    bad_input(
        &quick(&["check", s(&fifo), "--baseline", s(&fifo)]),
        &["a FIFO"],
    );
    let tiny = ["--model", "gpt2-tiny", "--seq-len", "16", "--steps", "1"];
    let mut args = vec!["run", "--data", s(&fifo)];
    args.extend(tiny);
    bad_input(&quick(&args), &["a FIFO"]);
    let mut args = vec!["run", "--timeline", s(&fifo), "--device", "meta"];
    args.extend(tiny);
    bad_input(&quick(&args), &["FIFO that no process is reading"]);
    // With a reader waiting, the timeline goes down the FIFO.
    let path = fifo.clone();
    let reader = std::thread::spawn(move || std::fs::read_to_string(path).unwrap());
    std::thread::sleep(Duration::from_millis(200));
    let o = quick(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let csv = reader.join().unwrap();
    assert!(csv.lines().count() > 10, "{csv}");
}

/// Issue 26, the smaller ones: each was accepted, or ran, or printed, as
/// if nothing were wrong.
#[test]
fn small_hostile_values_are_refused_or_shown_plainly() {
    // A calibration cache of 1e308 FLOP/s made every predicted step time
    // vanish: such a cache is measured again.
    let good = memfit::calibrate::Calibration {
        host: "test cpu".into(),
        threads: 2,
        fp32_flops_per_s: 5e10,
        bf16_flops_per_s: 2e10,
        fp16_flops_per_s: 2e10,
        fp32_kernel_flops_per_s: 1e10,
        bf16_kernel_flops_per_s: 5e9,
        bytes_per_s: 1e10,
        op_overhead_s: 2e-6,
        memfit_version: "0".into(),
        measured_unix_s: 0,
        elapsed_s: 3.0,
    };
    assert!(good.plausible());
    for bad in [
        memfit::calibrate::Calibration {
            fp32_flops_per_s: 1e308,
            ..good.clone()
        },
        memfit::calibrate::Calibration {
            bytes_per_s: f64::INFINITY,
            ..good.clone()
        },
        memfit::calibrate::Calibration {
            op_overhead_s: -1.0,
            ..good.clone()
        },
        memfit::calibrate::Calibration {
            bf16_kernel_flops_per_s: 0.0,
            ..good.clone()
        },
    ] {
        assert!(!bad.plausible(), "{bad:?}");
    }

    // 2^64 bytes saturated into "no limit" while 2^65 was refused.
    use memfit::units::parse_bytes;
    assert_eq!(parse_bytes("18446744073709551615B"), Ok(u64::MAX));
    for over in [
        "18446744073709551616B",
        "36893488147419103232",
        "16777216TiB",
        "1e30",
    ] {
        assert!(parse_bytes(over).is_err(), "{over}");
    }
    assert_eq!(parse_bytes("1.5GiB"), Ok(3 << 29));
    let o = quick(&[
        "run",
        "--model",
        "gpt2-tiny",
        "--seq-len",
        "16",
        "--device",
        "meta:limit=18446744073709551616B",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("out of range"), "{}", stderr(&o));

    // `seq_len: !!str 64` was read as 64.
    let dir = scratch("small-hostile");
    let recipe = dir.join("plan.yaml");
    std::fs::write(
        &recipe,
        PLAN_HEAD.replace("seq_len: 16", "seq_len: !!str 16"),
    )
    .unwrap();
    let err = bad_input(
        &quick(&["plan", s(&recipe)]),
        &["plan.yaml:3:10:", "YAML tag"],
    );
    assert_eq!(err.lines().count(), 1, "{err}");

    // balance --by time with K = 2^20 ran for minutes without a word.
    let err = bad_input(
        &quick(&[
            "balance",
            "--model",
            "llama-tiny",
            "--stages",
            "2",
            "--microbatches",
            "1048576",
            "--by",
            "time",
        ]),
        &["--microbatches", "more than 4096"],
    );
    assert_eq!(err.lines().count(), 1, "{err}");

    // The plan said "0.0 GiB of 0.0 GiB usable" for a 24 MiB device.
    std::fs::write(
        &recipe,
        format!("{PLAN_HEAD}device: meta:limit=24MiB\ngrid:\n  micro_batch: [1, 2]\n"),
    )
    .unwrap();
    let o = quick(&["plan", s(&recipe)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains(" MiB usable per GPU"), "{out}");
    assert!(!out.contains("0.0 GiB"), "{out}");

    // A model's name went into report.md as raw HTML.
    let tiny = fixture("../../profiles/models/gpt2-tiny.yaml");
    let evil = std::fs::read_to_string(tiny).unwrap().replace(
        "name: gpt2-tiny",
        "name: \"<script>alert(1)</script> *x* | y\"",
    );
    std::fs::write(dir.join("evil.yaml"), evil).unwrap();
    std::fs::write(
        &recipe,
        format!(
            "{}device: meta\ngrid:\n  micro_batch: [1, 2]\n",
            PLAN_HEAD.replace("gpt2-tiny", "evil.yaml")
        ),
    )
    .unwrap();
    let out = dir.join("out");
    let o = quick(&["sweep", s(&recipe), "--out", s(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(!md.contains("<script>"), "{md}");
    assert!(
        md.contains("&lt;script&gt;alert(1)&lt;/script&gt; \\*x\\* \\| y"),
        "{md}"
    );
}
