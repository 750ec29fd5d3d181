//! `memfit run` as a user runs it: output documents, exit codes, error messages.

use crate::common;
use crate::common::{json, losses, memfit, ok_json, stderr};

#[test]
fn run_json_carries_the_documented_fields() {
    let out = memfit(&[
        "run",
        "--model",
        "gpt2-tiny",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--steps",
        "3",
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc = json(&out);
    assert_eq!(doc["model"], "gpt2-tiny");
    assert_eq!(doc["device"], "cpu");
    assert!(doc["num_parameters"].as_u64().unwrap() > 0);
    for knob in [
        "seq_len",
        "micro_batch",
        "grad_accum",
        "lr",
        "weight_decay",
        "grad_clip",
        "seed",
        "steps",
    ] {
        assert!(!doc["config"][knob].is_null(), "config.{knob} missing");
    }
    let steps = doc["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 3);
    for s in steps {
        assert!(s["loss"].as_f64().unwrap().is_finite() && s["ms"].as_f64().unwrap() > 0.0);
    }
    assert!(doc["tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(doc["flops_per_step"].as_u64().unwrap() > 0);
    for cat in [
        "total",
        "parameters",
        "gradients",
        "optimizer",
        "activations",
        "temporaries",
        "workspace",
    ] {
        assert!(doc["peak_bytes"][cat].is_u64(), "peak_bytes.{cat} missing");
    }
    assert!(doc["error"].is_null());
}

#[test]
fn meta_prints_the_same_peaks_as_cpu() {
    let args = [
        "run",
        "--model",
        "llama-tiny",
        "--seq-len",
        "48",
        "--micro-batch",
        "3",
        "--steps",
        "2",
        "--format",
        "json",
    ];
    let cpu = json(&memfit(&args));
    let mut meta_args = args.to_vec();
    meta_args.extend(["--device", "meta"]);
    let meta = json(&memfit(&meta_args));
    assert_eq!(meta["steps"].as_array().unwrap().len(), 0);
    assert!(meta["tokens_per_s"].is_null());
    assert_eq!(cpu["peak_bytes"], meta["peak_bytes"]);
    assert_eq!(cpu["peak_breakdown"], meta["peak_breakdown"]);
    assert_eq!(cpu["flops_per_step"], meta["flops_per_step"]);
}

#[test]
fn meta_plans_llama_70b() {
    let out = memfit(&[
        "run",
        "--model",
        "llama-3.1-70b",
        "--seq-len",
        "4096",
        "--micro-batch",
        "1",
        "--device",
        "meta",
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc = json(&out);
    assert_eq!(doc["num_parameters"], 70_553_706_496u64);
    // fp32 weights, gradients and two AdamW moments: 16 bytes per (padded) parameter.
    let params = doc["peak_bytes"]["parameters"].as_u64().unwrap();
    assert_eq!(doc["peak_bytes"]["optimizer"].as_u64().unwrap(), 2 * params);
    assert_eq!(doc["peak_bytes"]["gradients"].as_u64().unwrap(), params);
    assert!(doc["peak_bytes"]["total"].as_u64().unwrap() > 16 * 70_000_000_000);
}

#[test]
fn out_of_memory_exits_3_with_an_error_object() {
    let out = memfit(&[
        "run",
        "--model",
        "gpt2-tiny",
        "--device",
        "cpu:limit=2MiB",
        "--steps",
        "2",
        "--format",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let doc = json(&out);
    assert_eq!(doc["error"]["kind"], "oom");
    assert!(doc["error"]["requested"].as_u64().unwrap() > 0);
    assert!(doc["error"]["category"].is_string());
    assert!(doc["error"]["live"]["parameters"].as_u64().unwrap() > 0);
    assert!(stderr(&out).contains("out of memory"));
    // The same on meta.
    let out = memfit(&[
        "run",
        "--model",
        "gpt2-tiny",
        "--device",
        "meta:limit=2MiB",
        "--format",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(3));
}

#[test]
fn bad_input_exits_2_with_a_clear_message() {
    let out = memfit(&["run", "--model", "gpt2-tinyy"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("did you mean `gpt2-tiny`"),
        "{}",
        stderr(&out)
    );

    let out = memfit(&["run", "--model", "gpt2-tiny", "--seq-len", "4096"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--seq-len"), "{}", stderr(&out));

    let short = std::env::temp_dir().join(format!("memfit-short-{}.txt", std::process::id()));
    std::fs::write(&short, b"too short").unwrap();
    let out = memfit(&["run", "--data", short.to_str().unwrap(), "--seq-len", "64"]);
    std::fs::remove_file(&short).unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--data") && stderr(&out).contains("9 bytes"),
        "{}",
        stderr(&out)
    );

    let out = memfit(&["run", "--device", "tpu"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("unknown device"), "{}", stderr(&out));

    let out = memfit(&["run", "--data", "/nonexistent/corpus"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("/nonexistent/corpus"),
        "{}",
        stderr(&out)
    );

    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/invalid/models");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let out = memfit(&["run", "--model", path.to_str().unwrap(), "--device", "meta"]);
        assert_eq!(out.status.code(), Some(2), "{}", path.display());
        let msg = stderr(&out);
        let file = path.file_name().unwrap().to_str().unwrap();
        assert!(msg.contains(file), "{msg}");
        assert!(!msg.contains("panicked"), "{msg}");
    }
}

#[test]
fn table_output_and_timeline() {
    let timeline = std::env::temp_dir().join(format!("memfit-timeline-{}.csv", std::process::id()));
    let out = memfit(&[
        "run",
        "--model",
        "llama-tiny",
        "--steps",
        "2",
        "--timeline",
        timeline.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in ["tokens/s", "activations", "KiB", "loss"] {
        assert!(text.contains(needle), "{needle} missing from:\n{text}");
    }
    let csv = std::fs::read_to_string(&timeline).unwrap();
    assert!(csv.starts_with("rank,t_ns,phase,category,bytes,live_total"));
    assert!(csv.contains(",backward:1,activations,-"));
    std::fs::remove_file(timeline).unwrap();
}

#[test]
fn recipe_keys_apply_and_flags_override_them() {
    let recipe = concat!(env!("CARGO_MANIFEST_DIR"), "/recipes/gpt2-tiny-text.yaml");
    let out = memfit(&[
        "run",
        "--recipe",
        recipe,
        "--steps",
        "2",
        "--optimizer",
        "sgd",
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc = json(&out);
    assert_eq!(doc["config"]["micro_batch"], 8, "from the recipe");
    assert_eq!(doc["config"]["steps"], 2, "the flag wins");
    assert_eq!(doc["config"]["optimizer"], "sgd");
    assert_eq!(doc["config"]["precision"], "bf16", "from the recipe");
    assert!(doc["loss_scale"].is_null(), "bf16 needs no loss scale");
    assert!(
        doc["config"]["data"]
            .as_str()
            .unwrap()
            .contains("assets/text"),
        "{}",
        doc["config"]["data"]
    );
    assert_eq!(doc["config"]["lr"].as_f64().unwrap() as f32, 1e-3);

    let bad = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/invalid/recipes/misspelled-key.yaml"
    );
    let out = memfit(&["run", "--recipe", bad]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("misspelled-key.yaml:3:1"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn every_knob_is_in_the_json_config() {
    let out = memfit(&[
        "run",
        "--model",
        "llama-tiny",
        "--steps",
        "2",
        "--seq-len",
        "32",
        "--optimizer",
        "adafactor",
        "--checkpointing",
        "full",
        "--attention",
        "fused",
        "--grad-accum",
        "2",
        "--precision",
        "fp16",
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc = json(&out);
    let c = &doc["config"];
    assert_eq!(c["precision"], "fp16");
    assert_eq!(doc["loss_scale"], 65536.0, "fp16 reports its loss scale");
    assert_eq!(doc["steps"][1]["loss_scale"], 65536.0);
    assert_eq!(c["optimizer"], "adafactor");
    assert_eq!(c["checkpointing"], "full");
    assert_eq!(c["attention"], "fused");
    assert_eq!(c["grad_accum"], 2);
    assert!(c["lr"].is_null(), "adafactor's relative step");
    assert!(
        doc["peak_bytes"]["workspace"].as_u64().unwrap() > 0,
        "fused attention declares its tile scratch"
    );
    assert_eq!(doc["skipped_steps"], 0);

    let out = memfit(&["run", "--optimizer", "sgd", "--momentum", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--momentum"), "{}", stderr(&out));
}

/// Regression: absurd sizes once wrapped around in usize arithmetic and gave
/// tiny meta plans with exit 0, or aborted on cpu.
#[test]
fn oversized_inputs_are_errors_not_wraparounds_or_aborts() {
    for (args, code) in [
        (
            vec![
                "run",
                "--micro-batch",
                "4611686018427387904",
                "--device",
                "meta",
            ],
            2,
        ),
        (
            vec!["run", "--grad-accum", "1000000000", "--device", "meta"],
            2,
        ),
        (
            vec![
                "run",
                "--micro-batch",
                "100000000000",
                "--device",
                "cpu:limit=1GiB",
                "--steps",
                "1",
            ],
            3,
        ),
        (
            vec!["run", "--optimizer", "adafactor", "--momentum", "7"],
            2,
        ),
        (vec!["run", "--timeline", "/nonexistent/dir/t.csv"], 2),
    ] {
        let out = memfit(&args);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {}", stderr(&out));
        assert!(!stderr(&out).contains("panicked"), "{args:?}");
    }
}

#[test]
fn ranks_and_sharding_report_every_rank() {
    let out = memfit(&[
        "run",
        "--model",
        "gpt2-tiny",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--steps",
        "2",
        "--ranks",
        "2",
        "--sharding",
        "zero3",
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc = json(&out);
    assert_eq!(doc["config"]["ranks"], 2);
    assert_eq!(doc["config"]["sharding"], "zero3");
    assert_eq!(doc["tokens_per_step"], 2 * 32 * 2, "global batch");
    let ranks = doc["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    for r in ranks {
        assert!(r["peak_bytes"]["communication"].as_u64().unwrap() > 0);
        assert!(r["sent_bytes_per_step"].as_u64().unwrap() > 0);
        assert!(r["received_bytes_per_step"].as_u64().unwrap() > 0);
        assert!(r["peak_bytes"]["total"].as_u64() <= doc["peak_bytes"]["total"].as_u64());
    }
    assert_eq!(doc["steps"].as_array().unwrap().len(), 2);

    // A table shows the ranks too; meta plans the same job.
    let out = memfit(&[
        "run",
        "--model",
        "llama-3.1-8b",
        "--seq-len",
        "1024",
        "--micro-batch",
        "1",
        "--ranks",
        "8",
        "--sharding",
        "zero3",
        "--precision",
        "bf16",
        "--device",
        "meta",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("communication"), "{text}");
    assert!(text.contains("8 ranks"), "{text}");

    for (args, flag) in [
        (vec!["--ranks", "2"], "--sharding"),
        (vec!["--sharding", "zero3"], "--sharding"),
        (vec!["--ranks", "0", "--sharding", "ddp"], "--ranks"),
        (
            vec!["--ranks", "2", "--sharding", "zero2", "--bucket-view"],
            "--bucket-view",
        ),
        (
            vec![
                "--ranks",
                "2",
                "--sharding",
                "zero1",
                "--optimizer",
                "adafactor",
            ],
            "--optimizer",
        ),
    ] {
        let mut all = vec!["run", "--steps", "1"];
        all.extend(args.iter());
        let out = memfit(&all);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(stderr(&out).contains(flag), "{args:?}: {}", stderr(&out));
    }

    // Out of memory on a rank: exit 3, the error names the rank, nobody hangs.
    let out = memfit(&[
        "run",
        "--ranks",
        "2",
        "--sharding",
        "ddp",
        "--device",
        "cpu:limit=1MiB",
        "--format",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    let doc = json(&out);
    assert_eq!(doc["error"]["kind"], "oom");
    assert!(doc["error"]["rank"].is_u64());
}

/// The visible subcommands, from the clap definition itself.
fn subcommands() -> Vec<String> {
    use clap::CommandFactory;
    memfit::cli::Cli::command()
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .map(|s| s.get_name().to_string())
        .collect()
}

#[test]
fn completions_cover_every_subcommand_in_every_shell() {
    let names = subcommands();
    assert!(names.len() > 10 && names.contains(&"completions".to_string()));
    let out = memfit(&["completions", "bash"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let script = String::from_utf8_lossy(&out.stdout);
    assert!(script.contains("complete -F _memfit"), "{script}");
    for name in &names {
        assert!(
            script.contains(&format!("memfit,{name})")),
            "bash completion lacks `{name}`"
        );
    }
    // `trial` is memfit re-executing itself, not for users.
    assert!(!script.contains("memfit,trial)"), "{script}");
    // Flags of a subcommand and the values of an enum flag complete too.
    assert!(script.contains("--micro-batch") && script.contains("hf-eager"));
    for shell in ["zsh", "fish", "elvish", "powershell"] {
        let out = memfit(&["completions", shell]);
        assert!(out.status.success(), "{shell}: {}", stderr(&out));
        let script = String::from_utf8_lossy(&out.stdout);
        for name in ["run", "plan", "sweep", "watch", "man"] {
            assert!(script.contains(name), "{shell} completion lacks `{name}`");
        }
    }
    let out = memfit(&["completions", "tcsh"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("possible values: bash, zsh, fish, elvish, powershell"));
}

#[test]
fn man_page_names_every_subcommand_and_man_reads_it() {
    let out = memfit(&["man"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let roff = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(roff.contains(".TH memfit 1"), "{roff}");
    // roff writes a hyphen as `\-`.
    for name in subcommands() {
        assert!(
            roff.contains(&format!("memfit\\-{}", name.replace('-', "\\-"))),
            "the man page lacks `{name}`"
        );
    }
    assert!(!roff.contains("memfit\\-trial"), "{roff}");

    // man itself formats it, where man is installed.
    let man = std::process::Command::new("man")
        .args(["-l", "-"])
        .env("MANPAGER", "cat")
        .env("MANWIDTH", "100")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    match man {
        Err(_) => eprintln!("SKIPPED: man is not installed (apt-get install man-db)"),
        Ok(mut child) => {
            use std::io::Write;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(roff.as_bytes())
                .unwrap();
            let shown = child.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&shown.stdout);
            assert!(shown.status.success(), "{}", stderr(&shown));
            assert!(text.contains("SUBCOMMANDS"), "{text}");
            for name in subcommands() {
                assert!(text.contains(&format!("memfit-{name}(1)")), "{text}");
            }
        }
    }

    // --out: one page per subcommand, and memfit.1.
    let dir = common::scratch("man");
    let out = memfit(&["man", "--out", dir.join("man1").to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    for name in subcommands() {
        let page = std::fs::read_to_string(dir.join(format!("man1/memfit-{name}.1")))
            .unwrap_or_else(|e| panic!("memfit-{name}.1: {e}"));
        assert!(page.contains(".SH SYNOPSIS"), "{page}");
    }
    let run = std::fs::read_to_string(dir.join("man1/memfit-run.1")).unwrap();
    assert!(run.contains("\\-\\-micro\\-batch"), "{run}");
    assert!(dir.join("man1/memfit.1").is_file());
    assert!(!dir.join("man1/memfit-trial.1").exists());
    // A folder that cannot be made is an error, not a panic.
    std::fs::write(dir.join("file"), "").unwrap();
    let out = memfit(&["man", "--out", dir.join("file/man1").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("cannot write"), "{}", stderr(&out));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn models_and_profiles_print_documented_json() {
    let doc = json(&memfit(&["models", "--format", "json"]));
    assert_eq!(doc["schema_version"], 1);
    assert!(doc.get("hardware").is_none() && doc.get("networks").is_none());
    let models = doc["models"].as_array().unwrap();
    let gpt2 = models.iter().find(|m| m["name"] == "gpt2").unwrap();
    assert_eq!(gpt2["family"], "gpt2");
    assert_eq!(gpt2["parameters"], 124_439_808u64);
    assert_eq!(gpt2["n_layer"], 12);
    assert_eq!(gpt2["vocab_size"], 50257);
    assert_eq!(gpt2["padded_vocab_size"], 50304);
    assert_eq!(gpt2["tied_embeddings"], true);
    let llama = models.iter().find(|m| m["name"] == "llama-3.1-8b").unwrap();
    assert_eq!(llama["n_kv_head"], 8);
    for m in models {
        for key in [
            "name",
            "family",
            "parameters",
            "n_layer",
            "n_head",
            "n_kv_head",
            "d_model",
            "d_ff",
            "vocab_size",
            "padded_vocab_size",
            "max_seq_len",
            "tied_embeddings",
        ] {
            assert!(!m[key].is_null(), "{}: no {key}", m["name"]);
        }
    }

    let doc = json(&memfit(&["profiles", "--format", "json"]));
    assert_eq!(doc["models"].as_array().unwrap().len(), models.len());
    let hw = doc["hardware"].as_array().unwrap();
    let t4 = hw.iter().find(|h| h["name"] == "t4").unwrap();
    assert_eq!(t4["memory_bytes"], 15u64 << 30);
    for h in hw {
        for key in [
            "display_name",
            "memory_bytes",
            "runtime_overhead_bytes",
            "bf16_tflops",
            "fp16_tflops",
            "fp32_tflops",
            "memory_bandwidth_gbps",
            "interconnect",
            "interconnect_gbps",
            "gpus_per_node",
            "inter_node",
            "inter_node_gbps",
            "usd_per_hour",
        ] {
            assert!(!h[key].is_null(), "{}: no {key}", h["name"]);
        }
    }
    let nets = doc["networks"].as_array().unwrap();
    let names: Vec<&str> = nets.iter().map(|n| n["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["ib-ndr-400", "ib-hdr-200", "roce-200", "eth-100", "eth-25"]
    );
    assert_eq!(nets[0]["nic_gbps"], 50.0);
    assert!(nets[0]["nics_per_node"].is_null(), "one NIC per GPU");
    assert_eq!(nets[3]["nics_per_node"], 1);
    // The table lists the networks too.
    let table = String::from_utf8_lossy(&memfit(&["profiles"]).stdout).into_owned();
    for needle in [
        "network",
        "ib-ndr-400",
        "eth-25",
        "h100-sxm-80gb",
        "gpt2-tiny",
        "a100-40gb, a100-80gb: flash-attention-2, flash-attention, flash-attention-triton, xformers",
        // The GEMM share, and the profiles that fit their own.
        "large GEMMs at 70% of the dense peak inside a step",
        "h100-sxm-80gb 62%, h200-141gb 62%",
    ] {
        assert!(table.contains(needle), "{needle} missing:\n{table}");
    }
    // The JSON holds each profile's GEMM share where it fits one, and its
    // published attention rates.
    let h100 = hw.iter().find(|h| h["name"] == "h100-sxm-80gb").unwrap();
    assert_eq!(h100["gemm_efficiency"], 0.62);
    let a100 = hw.iter().find(|h| h["name"] == "a100-80gb").unwrap();
    assert!(a100["gemm_efficiency"].is_null());
    assert_eq!(
        a100["attention_kernels"]["flash-attention-triton"]["128"]["2048"],
        68.0
    );
    assert_eq!(t4["attention_kernels"], serde_json::json!({}));
    let out = memfit(&["models", "--format", "yaml"]);
    assert_eq!(out.status.code(), Some(2));
}

/// `run --device meta` (12.46 GiB) and `watch` (18.42 GiB) answered "gpt2,
/// T=1024, micro-batch 8" differently with nothing saying why, and `run
/// --device meta:t4` was refused though balance took meta:GPU. Now run
/// predicts a GPU profile, and both name their allocation profile.
#[test]
fn run_predicts_a_gpu_profile_and_names_its_allocation_profile() {
    let gpt2 = [
        "run",
        "--model",
        "gpt2",
        "--seq-len",
        "1024",
        "--micro-batch",
        "8",
    ];
    let doc = ok_json(&gpt2, &["--device", "meta", "--format", "json"]);
    assert_eq!(doc["allocation_profile"], "memfit engine");
    assert_eq!(doc["config"]["framework"], "memfit");
    assert!(doc.get("target").is_none());
    let engine = doc["peak_bytes"]["total"].as_u64().unwrap();

    let doc = ok_json(&gpt2, &["--device", "meta:a100-80gb", "--format", "json"]);
    assert_eq!(doc["device"], "meta");
    assert_eq!(doc["target"]["name"], "a100-80gb");
    let t = &doc["target"];
    assert_eq!(
        doc["capacity_bytes"].as_u64().unwrap(),
        t["memory_bytes"].as_u64().unwrap() - t["runtime_overhead_bytes"].as_u64().unwrap()
    );
    assert_eq!(doc["allocation_profile"], "memfit engine");
    // The cuda backend declares no workspace eager attention needs.
    assert_eq!(doc["peak_bytes"]["total"].as_u64().unwrap(), engine);

    let hf = ok_json(
        &gpt2,
        &[
            "--device",
            "meta:a100-80gb",
            "--framework",
            "hf-eager",
            "--format",
            "json",
        ],
    );
    assert_eq!(
        hf["allocation_profile"],
        "hf-eager (PyTorch eager + transformers)"
    );
    assert!(hf["allocator"]["max_memory_reserved"].as_u64().is_some());
    let pytorch = hf["peak_bytes"]["total"].as_u64().unwrap();
    assert!(pytorch > engine, "{pytorch} vs {engine}");

    // watch predicts hf-eager by default: the same number, named the same.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_memfit"))
        .env("MEMFIT_NVML_LIB", "/nonexistent/libnvidia-ml.so.1")
        .args([
            "watch",
            "--no-tui",
            "--format",
            "json",
            "--model",
            "gpt2",
            "--seq-len",
            "1024",
            "--micro-batch",
            "8",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let w = json(&out);
    assert_eq!(
        w["prediction"]["tracked_peak_bytes"].as_u64(),
        Some(pytorch)
    );
    assert_eq!(w["prediction"]["framework"], "hf-eager");
    assert_eq!(
        w["prediction"]["allocation_profile"],
        "hf-eager (PyTorch eager + transformers)"
    );
    assert!(
        stderr(&out).contains("allocation profile: hf-eager (PyTorch eager + transformers)"),
        "{}",
        stderr(&out)
    );

    // The table says it too, and what the target leaves for tensors.
    let out = memfit(&[&gpt2[..], &["--device", "meta:t4"]].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "on meta predicting t4 (NVIDIA T4",
        "allocation profile: memfit engine; --framework hf-eager",
        "768.00 MiB runtime overhead",
        "capacity 14.25 GiB",
    ] {
        assert!(text.contains(needle), "{needle} missing from:\n{text}");
    }
    // PyTorch's tensors for the same step do not fit a T4: exit 3, with the report.
    let out = memfit(
        &[
            &gpt2[..],
            &[
                "--device",
                "meta:t4",
                "--framework",
                "hf-eager",
                "--format",
                "json",
            ],
        ]
        .concat(),
    );
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert_eq!(json(&out)["error"]["kind"], "oom");

    // A misspelt GPU is bad input, with the closest name.
    common::refused(&["run", "--device", "meta:t5"], "did you mean `t4`");
    common::refused(
        &["run", "--device", "meta:1"],
        "only cuda devices are numbered",
    );
    // A run recipe's `device:` takes it too.
    let dir = common::scratch("meta-gpu-recipe");
    let recipe = dir.join("run.yaml");
    std::fs::write(&recipe, "model: gpt2-tiny\ndevice: meta:l4\n").unwrap();
    let doc = ok_json(
        &["run", "--recipe", recipe.to_str().unwrap()],
        &["--format", "json"],
    );
    assert_eq!(doc["target"]["name"], "l4");
    std::fs::write(&recipe, "model: gpt2-tiny\ndevice: meta:l5\n").unwrap();
    let msg = common::refused(&["run", "--recipe", recipe.to_str().unwrap()], "`l4`");
    assert!(msg.contains("run.yaml:2:9"), "{msg}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// `--beta2` (a knob added through the `[train]` path of src/knobs.rs): it
/// changes AdamW's updates, the report names it, a recipe's key sets it,
/// and it is refused where it would do nothing.
#[test]
fn beta2_reaches_adamw_and_is_refused_where_it_does_nothing() {
    let run = |extra: &[&str]| {
        let base = ["run", "--steps", "3", "--seq-len", "32", "--format", "json"];
        let doc = ok_json(&base, extra);
        (doc["config"]["beta2"].as_f64().unwrap(), losses(&doc))
    };
    let (b_default, default) = run(&[]);
    let (b_flag, flagged) = run(&["--beta2", "0.5"]);
    assert_eq!(b_default as f32, 0.999);
    assert_eq!(b_flag as f32, 0.5);
    assert_eq!(
        default[0], flagged[0],
        "the first step's loss precedes any update"
    );
    assert_ne!(default[2], flagged[2], "beta2 changes the updates");

    let recipe = std::env::temp_dir().join(format!("memfit-beta2-{}.yaml", std::process::id()));
    std::fs::write(&recipe, "beta2: 0.5\nsteps: 3\nseq_len: 32\n").unwrap();
    let (b_key, keyed) = run(&["--recipe", recipe.to_str().unwrap()]);
    std::fs::remove_file(&recipe).unwrap();
    assert_eq!(b_key as f32, 0.5);
    assert_eq!(keyed, flagged, "the recipe's key is the flag");

    for (args, why) in [
        (&["--beta2", "1"][..], "outside [0, 1)"),
        (
            &["--beta2", "0.95", "--optimizer", "sgd"][..],
            "applies to adamw",
        ),
        (
            &["--beta2", "0.95", "--optimizer", "adafactor"][..],
            "applies to adamw",
        ),
    ] {
        let mut a = vec!["run", "--device", "meta"];
        a.extend_from_slice(args);
        let out = memfit(&a);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let msg = stderr(&out);
        assert!(msg.contains("--beta2") && msg.contains(why), "{msg}");
    }
}

/// `--checkpointing selective` and `--checkpoint-every` reach the engine
/// (the report names them, the peak moves) and are refused by name where
/// they are not built or would do nothing.
#[test]
fn selective_and_layer_checkpointing_flags_reach_the_engine_or_are_refused() {
    let peak = |extra: &[&str]| {
        let base = [
            "run",
            "--model",
            "llama-tiny",
            "--device",
            "meta",
            "--seq-len",
            "64",
            "--format",
            "json",
        ];
        let doc = ok_json(&base, extra);
        let c = &doc["config"];
        let every = c.get("checkpoint_every").map_or(1, |v| v.as_u64().unwrap());
        let ckpt = c["checkpointing"].as_str().unwrap().to_string();
        (
            ckpt,
            every,
            doc["peak_bytes"]["activations"].as_u64().unwrap(),
        )
    };
    let (_, _, none) = peak(&[]);
    let (c, _, selective) = peak(&["--checkpointing", "selective"]);
    assert_eq!(c, "selective");
    let (_, _, full) = peak(&["--checkpointing", "full"]);
    let (_, every, half) = peak(&["--checkpointing", "full", "--checkpoint-every", "2"]);
    assert_eq!(every, 2);
    assert!(
        full < selective && selective < none,
        "{full} {selective} {none}"
    );
    assert!(full < half && half < none, "{full} {half} {none}");
    for (args, flag, why) in [
        (
            &["--checkpoint-every", "2"][..],
            "--checkpoint-every",
            "checkpointing is none",
        ),
        (
            &["--checkpointing", "full", "--checkpoint-every", "0"][..],
            "--checkpoint-every",
            "0 checkpoints no block",
        ),
        (
            &["--checkpointing", "selective", "--finetune", "lora"][..],
            "--checkpointing",
            "--finetune lora",
        ),
        (
            &["--checkpointing", "selective", "--offload-activations"][..],
            "--offload-activations",
            "full",
        ),
    ] {
        let mut a = vec!["run", "--model", "llama-tiny", "--device", "meta"];
        a.extend_from_slice(args);
        let out = memfit(&a);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let msg = stderr(&out);
        assert!(msg.contains(flag) && msg.contains(why), "{msg}");
    }
    // flash_attn's op is not on torchtitan's save list (a GPU plan: FA2 is
    // refused on cpu).
    let out = memfit(&[
        "run",
        "--model",
        "llama-tiny",
        "--device",
        "meta:h100-sxm-80gb",
        "--framework",
        "hf-eager",
        "--precision",
        "bf16",
        "--attention",
        "flash-attention-2",
        "--checkpointing",
        "selective",
    ]);
    let msg = stderr(&out);
    assert!(
        out.status.code() == Some(2) && msg.contains("not flash_attn's op"),
        "{msg}"
    );
    for (model, why) in [
        ("qwen3-8b", "normalises q and k"),
        ("gemma-tiny", "is a Gemma"),
        ("moe-tiny", "has experts"),
    ] {
        let a = [
            "run",
            "--model",
            model,
            "--device",
            "meta",
            "--seq-len",
            "64",
        ];
        let out = memfit(&[&a[..], &["--checkpointing", "selective"]].concat());
        let msg = stderr(&out);
        assert!(
            out.status.code() == Some(2) && msg.contains(why),
            "{model}: {msg}"
        );
    }
}
