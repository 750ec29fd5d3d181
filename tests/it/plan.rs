//! `memfit plan`: predictions are the engine's own peaks (meta == cpu seen
//! through the planner), the published bytes-per-parameter figures come out,
//! and bad recipes get located messages.

use crate::common;
use crate::common::memfit;

use memfit::backend::cpu::CpuBackend;
use memfit::config::hardware::load_hardware;
use memfit::config::profile::load_model;
use memfit::data::DataSource;
use memfit::engine::cluster::Cluster;
use memfit::engine::cluster::cpu_links;
use memfit::engine::{Optimizer, Precision, Sharding};
use memfit::plan::{Grid, PlanRecipe, Point, Verdict, closed_form, plan};

fn fixture(name: &str) -> String {
    format!(
        "{}/tests/fixtures/invalid/plans/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn predictions_equal_cpu_measured_peaks() {
    for name in ["gpt2-tiny", "llama-tiny"] {
        let model = load_model(name).unwrap();
        let hw = load_hardware("t4").unwrap();
        let recipe = PlanRecipe {
            model: name.into(),
            hardware: "t4".into(),
            seq_len: 32,
            global_batch: 8,
            grid: Grid {
                micro_batch: vec![2, 4],
                precision: vec![Precision::Fp32, Precision::Bf16],
                checkpointing: vec![
                    memfit::engine::Checkpointing::None,
                    memfit::engine::Checkpointing::Full,
                ],
                attention: vec![memfit::engine::Attention::Fused],
                optimizer: vec![Optimizer::Adamw, Optimizer::Adamw8bit],
                sharding: vec![Sharding::None, Sharding::Zero2, Sharding::Zero3],
                gpus: vec![1, 2],
                framework: Vec::new(),
                finetune: vec![memfit::engine::Finetune::Full],
                offload: vec![memfit::engine::Offload::None],
                pipeline_stages: vec![1],
                virtual_stages: vec![1],
                shard_group: vec![None],
                tensor_parallel: vec![1],
                hpz_group: vec![None],
                sequence_parallel: vec![false],
                loss: vec![Default::default()],
                capacity_factor: vec![Default::default()],
                offload_activations: vec![false],
                expert_parallel: vec![1],
                tp_comm_overlap: vec![false],
                overlap_param_gather: vec![false],
            },
            headroom: 0.05,
            cost: None,
            host_usd_per_hour: None,
            knobs: Default::default(),
            network: None,
            attention_kernel: None,
            allow_numerics_change: true,
            // A plan for the cpu backend (a GPU plan declares the cuda
            // backend's attention workspace; tests/it/cuda_cli.rs checks that one).
            device: Some(memfit::backend::DeviceSpec::new(
                memfit::backend::DeviceKind::Cpu,
                None,
            )),
        };
        let p = plan(&recipe, &model, &hw);
        let mut checked = 0;
        for pred in &p.points {
            if matches!(pred.verdict, Verdict::Invalid { .. }) {
                continue;
            }
            let pt = pred.point;
            let tc = pt.train_config(32);
            let backends = (0..pt.gpus).map(|_| CpuBackend::new(1).unwrap()).collect();
            let links = cpu_links(&model, &tc);
            let mut c = Cluster::new(&model, &tc, backends, links, None).unwrap();
            let mut data = DataSource::synthetic(model.vocab_size, 1);
            c.step_from(pt.grad_accum, || data.next_batch(pt.micro_batch, 32))
                .unwrap();
            for e in &c.ranks {
                assert_eq!(
                    Some(e.dev.tracker.peak_bytes()),
                    pred.peak_bytes,
                    "{name} {}",
                    pt.label()
                );
            }
            checked += 1;
        }
        eprintln!("{name}: {checked} planned points equal their cpu runs");
        assert!(checked >= 30, "{checked}");
    }
}

fn point(sharding: Sharding, gpus: usize) -> Point {
    Point {
        micro_batch: 1,
        precision: Precision::Bf16,
        checkpointing: memfit::engine::Checkpointing::None,
        attention: memfit::engine::Attention::Fused,
        optimizer: Optimizer::Adamw,
        sharding,
        gpus,
        grad_accum: 1,
        ..Point::default()
    }
}

#[test]
fn published_bytes_per_parameter_are_reproduced() {
    // ZeRO paper, Figure 1: Psi = 7.5B, N = 64, K = 12 (mixed-precision Adam):
    // baseline 120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB per device.
    let psi = 7.5e9;
    let gb = |s, n| closed_form(&point(s, n)).bytes_per_param * psi / 1e9;
    assert_eq!(gb(Sharding::Ddp, 64), 120.0);
    assert!((gb(Sharding::Zero1, 64) - 31.4).abs() < 0.05);
    assert!((gb(Sharding::Zero2, 64) - 16.6).abs() < 0.05);
    assert!((gb(Sharding::Zero3, 64) - 1.9).abs() < 0.05);
    let z2 = closed_form(&point(Sharding::Zero2, 8));
    assert!(
        z2.formula.contains("2+2+12 B/param") && z2.formula.contains("ZeRO-2 over 8: 2 + 14/8"),
        "{}",
        z2.formula
    );
    assert_eq!(z2.bytes_per_param, 3.75);
    let fp32 = closed_form(&Point {
        precision: Precision::Fp32,
        ..point(Sharding::None, 1)
    });
    assert_eq!(fp32.bytes_per_param, 16.0);
    assert!(fp32.formula.contains("4+4+8"), "{}", fp32.formula);

    // The engine's steady state agrees: over 8 GPUs, gpt2's optimizer state
    // (fp32 master + m + v) is 12/8 bytes per parameter, padding aside.
    let model = load_model("gpt2").unwrap();
    let hw = load_hardware("h100-sxm-80gb").unwrap();
    let recipe = PlanRecipe {
        model: "gpt2".into(),
        hardware: "h100-sxm-80gb".into(),
        seq_len: 256,
        global_batch: 8,
        grid: Grid {
            sharding: vec![
                Sharding::Ddp,
                Sharding::Zero1,
                Sharding::Zero2,
                Sharding::Zero3,
            ],
            gpus: vec![8],
            ..Grid::default()
        },
        headroom: 0.05,
        cost: None,
        host_usd_per_hour: None,
        knobs: Default::default(),
        network: None,
        attention_kernel: None,
        allow_numerics_change: true,
        device: None,
    };
    let p = plan(&recipe, &model, &hw);
    let psi = model
        .param_layout()
        .0
        .iter()
        .map(|s| s.numel() as f64)
        .sum::<f64>();
    for pred in &p.points {
        let pk = pred.peak_bytes.unwrap();
        let per = |b: u64| b as f64 / psi;
        let (w, g, k) = (per(pk.parameters), per(pk.gradients), per(pk.optimizer));
        eprintln!(
            "gpt2 bf16 AdamW {:?} x8: engine {w:.3}+{g:.3}+{k:.3} B/param; closed form {}",
            pred.point.sharding, pred.closed_form.formula
        );
        let want_k = if pred.point.sharding == Sharding::Ddp {
            12.0
        } else {
            1.5
        };
        assert!((k - want_k).abs() < 1e-3, "{k}");
        assert!(pred.engine_bytes_per_param >= pred.closed_form.bytes_per_param - 1e-3);
    }
}

#[test]
fn invalid_recipes_get_located_messages() {
    for (file, want) in [
        (
            "misspelled-key.yaml",
            vec!["misspelled-key.yaml:4:1", "globl_batch", "global_batch"],
        ),
        (
            "seq-len-too-long.yaml",
            vec!["seq-len-too-long.yaml:3:1", "seq_len", "128"],
        ),
        (
            "zero3-one-gpu.yaml",
            vec!["zero3-one-gpu.yaml:7:19", "zero3", "gpus"],
        ),
        (
            "unknown-hardware.yaml",
            vec!["unknown-hardware.yaml:2:1", "h100-sxm-80gb"],
        ),
        (
            "bad-precision.yaml",
            vec!["bad-precision.yaml:6", "fp61", "fp16"],
        ),
        (
            "negative-headroom.yaml",
            vec!["negative-headroom.yaml:5:1", "headroom"],
        ),
        (
            "unused-knob.yaml",
            vec![
                "unused-knob.yaml:5:1",
                "`lora_rank` applies to no point of the grid",
                "grid.finetune",
            ],
        ),
    ] {
        let out = memfit(&["plan", &fixture(file)]);
        assert_eq!(out.status.code(), Some(2), "{file}");
        let err = String::from_utf8_lossy(&out.stderr);
        for w in want {
            assert!(err.contains(w), "{file}: `{w}` missing from: {err}");
        }
        assert!(!err.contains("panicked"), "{err}");
    }
    let out = memfit(&["plan", "/nonexistent/recipe.yaml"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn plan_command_prints_table_json_and_markdown() {
    let recipe = concat!(env!("CARGO_MANIFEST_DIR"), "/recipes/tiny.yaml");
    let out = memfit(&["plan", recipe]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in ["recommended:", "B/param", "tokens/s", "$/Mtok", "fits"] {
        assert!(text.contains(needle), "{needle} missing:\n{text}");
    }
    let out = memfit(&["plan", recipe, "--format", "json"]);
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["schema_version"], 1);
    let points = doc["points"].as_array().unwrap();
    assert_eq!(points.len(), 5 * 2 * 2 * 2 * 2);
    let rec = doc["recommendation"]["index"].as_u64().unwrap() as usize;
    assert_eq!(points[rec]["status"], "fits");
    assert_eq!(doc["ranking"][0].as_u64().unwrap() as usize, rec);
    // Cheapest first.
    let cost = |i: &serde_json::Value| {
        points[i.as_u64().unwrap() as usize]["usd_per_mtok"]
            .as_f64()
            .unwrap()
    };
    let ranking = doc["ranking"].as_array().unwrap();
    assert!(ranking.windows(2).all(|w| cost(&w[0]) <= cost(&w[1])));
    let out = memfit(&["plan", recipe, "--format", "md"]);
    let md = String::from_utf8_lossy(&out.stdout);
    assert!(
        md.starts_with("# memfit plan") && md.contains("| --- |") || md.contains("|---|"),
        "{md}"
    );

    let out = memfit(&["profiles"]);
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in ["llama-3.1-70b", "h100-sxm-80gb", "rtx-4090", "t4"] {
        assert!(text.contains(needle), "{needle} missing:\n{text}");
    }
}

#[test]
fn allow_numerics_change_false_rules_out_fp16_and_8bit() {
    let model = load_model("gpt2").unwrap();
    let hw = load_hardware("rtx-4090").unwrap();
    let mut recipe = PlanRecipe {
        model: "gpt2".into(),
        hardware: "rtx-4090".into(),
        seq_len: 1024,
        global_batch: 16,
        grid: Grid {
            micro_batch: vec![4, 8, 16],
            precision: vec![Precision::Bf16, Precision::Fp16],
            optimizer: vec![Optimizer::Adamw, Optimizer::Adamw8bit],
            ..Grid::default()
        },
        headroom: 0.05,
        cost: None,
        host_usd_per_hour: None,
        knobs: Default::default(),
        network: None,
        attention_kernel: None,
        allow_numerics_change: false,
        device: None,
    };
    let p = plan(&recipe, &model, &hw);
    let best = &p.points[p.recommendation.as_ref().unwrap().index];
    assert!(best.numerics_changes.is_empty(), "{:?}", best.point);
    assert!(p.points.iter().any(|x| x.excluded));
    recipe.allow_numerics_change = true;
    let p = plan(&recipe, &model, &hw);
    assert!(p.points.iter().all(|x| !x.excluded));
    // Regression: SGD was left out, so an SGD pick said "changes no
    // numerics" and `allow_numerics_change: false` still allowed it.
    recipe.grid.optimizer = vec![Optimizer::Sgd, Optimizer::Adamw];
    recipe.grid.precision = vec![Precision::Bf16];
    recipe.allow_numerics_change = false;
    let p = plan(&recipe, &model, &hw);
    let best = &p.points[p.recommendation.as_ref().unwrap().index];
    assert_eq!(best.point.optimizer, Optimizer::Adamw);
    for x in p
        .points
        .iter()
        .filter(|x| x.point.optimizer == Optimizer::Sgd)
    {
        assert_eq!(x.numerics_changes, ["sgd"]);
        assert!(x.excluded);
    }
}

#[test]
fn shipped_plan_recipes_plan_and_recommend() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/recipes");
    let mut n = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        if !text.lines().any(|l| l.starts_with("hardware:")) {
            continue;
        }
        let p = memfit::plan::plan_file(&path).unwrap_or_else(|e| panic!("{e}"));
        let rec = p
            .recommendation
            .as_ref()
            .unwrap_or_else(|| panic!("{}: nothing fits", path.display()));
        eprintln!(
            "{}: {} points, recommends {}",
            path.file_name().unwrap().to_string_lossy(),
            p.points.len(),
            p.points[rec.index].point.label()
        );
        n += 1;
    }
    assert!(n >= 4, "{n} plan recipes");
}

/// `memfit plan --watch`: a plan at start, another each time the recipe
/// changes (here its global batch, which the second plan must show), a
/// recipe that stops parsing reported without ending the watch, and
/// SIGTERM ending it with 143.
#[test]
fn plan_watch_replans_when_the_recipe_changes() {
    use std::io::Read;
    let dir = common::scratch("plan-watch");
    let recipe = dir.join("watch.yaml");
    let text = |batch: u32| {
        format!(
            "model: gpt2-tiny\nhardware: t4\nseq_len: 64\nglobal_batch: {batch}\ngrid:\n  micro_batch: [1, 2]\n  precision: [fp32]\n"
        )
    };
    std::fs::write(&recipe, text(8)).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_memfit"))
        .env("MEMFIT_NO_GPU_CALIBRATION", "1")
        .args(["plan", "--watch", "--format", "json"])
        .arg(&recipe)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    // Read what the watcher printed so far, on a thread, until it closes.
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 65536];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    // Bytes, decoded whole: a chunk may end inside a UTF-8 character.
    let mut seen: Vec<u8> = Vec::new();
    let mut wait_for = |pred: &dyn Fn(&str) -> bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !pred(&String::from_utf8_lossy(&seen)) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            assert!(
                !left.is_zero(),
                "timed out; the watcher printed:\n{}",
                String::from_utf8_lossy(&seen)
            );
            if let Ok(chunk) = rx.recv_timeout(left) {
                seen.extend(chunk);
            }
        }
        String::from_utf8_lossy(&seen).into_owned()
    };
    // The plans, less the error lines printed between them.
    let docs = |s: &str| -> Vec<serde_json::Value> {
        let json: String = s
            .lines()
            .filter(|l| !l.starts_with("memfit: "))
            .map(|l| format!("{l}\n"))
            .collect();
        serde_json::Deserializer::from_str(&json)
            .into_iter::<serde_json::Value>()
            .filter_map(|d| d.ok())
            .collect()
    };
    wait_for(&|s| docs(s).len() == 1);
    // A new modification time may not differ within the clock's step:
    // change the size too.
    std::thread::sleep(std::time::Duration::from_millis(300));
    std::fs::write(&recipe, text(16)).unwrap();
    let out = wait_for(&|s| docs(s).len() == 2);
    let plans = docs(&out);
    assert_eq!(plans[0]["global_batch"], 8);
    assert_eq!(plans[1]["global_batch"], 16);
    std::thread::sleep(std::time::Duration::from_millis(300));
    std::fs::write(&recipe, "model: gpt2-tiny\nseq_len: [\n").unwrap();
    wait_for(&|s| s.contains("memfit: "));
    std::thread::sleep(std::time::Duration::from_millis(300));
    std::fs::write(&recipe, text(32)).unwrap();
    let out = wait_for(&|s| docs(s).len() == 3);
    assert_eq!(docs(&out)[2]["global_batch"], 32);
    assert!(memfit::sys::proc::signal(
        child.id(),
        memfit::sys::Signal::TERM
    ));
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(143));
}

/// A plan where no point fits exits 1 (a failed plan, for scripts), says
/// how far the nearest point is, and suggests what the grid did not try,
/// instead of exiting 0 with advice that repeats the grid.
#[test]
fn a_plan_where_nothing_fits_exits_1_with_the_distance_and_what_to_try() {
    let dir = common::scratch("plan-nofit");
    let recipe = dir.join("nofit.yaml");
    std::fs::write(
        &recipe,
        "model: llama-3.1-8b\nhardware: t4\nseq_len: 2048\nglobal_batch: 8\ngrid:\n  micro_batch: [2, 4]\n  precision: [bf16]\n  checkpointing: [none, full]\n",
    )
    .unwrap();
    let out = memfit(&["plan", recipe.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("no point fits. The nearest, #"), "{text}");
    assert!(
        text.contains("more than the 14.25 GiB usable per GPU"),
        "{text}"
    );
    // Checkpointing was in the grid: not suggested again; the rest are.
    assert!(!text.contains("grid.checkpointing"), "{text}");
    for hint in [
        "grid.sharding: [zero3]",
        "grid.finetune: [lora, qlora]",
        "grid.offload: [optimizer]",
        "grid.micro_batch: [1]",
    ] {
        assert!(text.contains(hint), "{hint}: {text}");
    }
    let out = memfit(&["plan", recipe.to_str().unwrap(), "--format", "json"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(common::json(&out)["recommendation"].is_null());
}

/// Regression (issue 27): a grid of memfit's engine beside hf-eager
/// recommended the engine's row, a layout PyTorch will not run.
#[test]
fn a_mixed_framework_grid_recommends_from_the_users_stack() {
    let dir = common::scratch("mixed-framework");
    let path = dir.join("p.yaml");
    std::fs::write(
        &path,
        "model: gpt2\nhardware: rtx-4090\nseq_len: 1024\nglobal_batch: 16\ngrid:\n  framework: [memfit, hf-eager]\n  micro_batch: [4, 8, 16]\n",
    )
    .unwrap();
    let p = common::plan_json(&common::memfit(&[
        "plan",
        path.to_str().unwrap(),
        "--format",
        "json",
    ]));
    let i = p["recommendation"]["index"].as_u64().unwrap() as usize;
    assert_eq!(p["points"][i]["point"]["framework"], "hf-eager");
    let engine_fits = p["points"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["point"]["framework"] == "memfit" && x["status"] == "fits");
    assert!(engine_fits, "the engine's rows are still planned");
    let reasons = p["recommendation"]["reasons"].to_string();
    assert!(
        reasons.contains("recommended from hf-eager's rows"),
        "{reasons}"
    );
}

/// The caching allocator can by chance reserve less at a bigger
/// micro-batch (70B, fp32, ZeRO-1, checkpointing, 8 GPUs: the same
/// allocated peak at 1 and 2, 0.9 GB less reserved at 2). A plan never
/// lets what a point holds fall as the micro-batch grows, says where the
/// figure came from, and keeps the allocator's own figures as modelled.
#[test]
fn what_a_point_holds_never_falls_as_its_micro_batch_grows() {
    let dir = common::scratch("monotone-micro-batch");
    let path = dir.join("p.yaml");
    std::fs::write(
        &path,
        "model: llama-3.1-70b\nhardware: h100-sxm-80gb\nseq_len: 4096\nglobal_batch: 64\nnetwork: ib-ndr-400\ngrid:\n  framework: [hf-eager]\n  precision: [fp32, bf16]\n  micro_batch: [1, 2, 4]\n  checkpointing: [full, none]\n  sharding: [zero1, zero3]\n  gpus: [8, 16]\n  shard_group: [0, 8]\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_memfit"))
        .env("MEMFIT_NO_GPU_CALIBRATION", "1")
        .args(["plan", path.to_str().unwrap(), "--format", "json"])
        .output()
        .unwrap();
    let p: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let points = p["points"].as_array().unwrap();
    let mut lifted = 0;
    for a in points
        .iter()
        .filter(|x| x["total_bytes"].as_u64() > Some(0))
    {
        for b in points
            .iter()
            .filter(|x| x["total_bytes"].as_u64() > Some(0))
        {
            let (pa, pb) = (&a["point"], &b["point"]);
            let same = pa
                .as_object()
                .unwrap()
                .iter()
                .all(|(k, v)| k == "micro_batch" || k == "grad_accum" || pb[k.as_str()] == *v);
            let smaller = pa["micro_batch"].as_u64() < pb["micro_batch"].as_u64();
            if same && smaller {
                assert!(
                    b["total_bytes"].as_u64() >= a["total_bytes"].as_u64(),
                    "{pa} holds more than {pb}"
                );
            }
        }
        if let Some(mb) = a["reserved_from_micro_batch"].as_u64() {
            lifted += 1;
            assert!(mb < a["point"]["micro_batch"].as_u64().unwrap());
            let own = a["allocator"]["max_memory_reserved"].as_u64().unwrap();
            let held =
                a["total_bytes"].as_u64().unwrap() - a["runtime_overhead_bytes"].as_u64().unwrap();
            assert!(own < held, "the allocator's own figure stays as modelled");
        }
    }
    assert!(
        lifted > 0,
        "the grid holds the case the allocator fragments less at"
    );
}

/// `capacity_factor` is a grid axis: on a mixture of experts each value is
/// a point whose expert buffers shrink below dropless routing (0.5) or pad
/// past it (1.25), and each point's peak is what `memfit run --device meta
/// --capacity-factor F` gives for the same knobs.
#[test]
fn the_capacity_factor_axis_plans_what_run_gives() {
    let dir = common::scratch("plan-capacity");
    let recipe = dir.join("moe.yaml");
    std::fs::write(
        &recipe,
        "model: moe-tiny\nhardware: t4\ndevice: cpu\nseq_len: 32\nglobal_batch: 4\ngrid:\n  framework: [memfit]\n  micro_batch: [2]\n  precision: [bf16]\n  capacity_factor: [null, 0.5, 1.0, 1.25]\n",
    )
    .unwrap();
    let doc = common::plan_json(&memfit(&[
        "plan",
        recipe.to_str().unwrap(),
        "--format",
        "json",
    ]));
    let points = doc["points"].as_array().unwrap();
    assert_eq!(points.len(), 4);
    let activations = |i: usize| points[i]["peak_bytes"]["activations"].as_u64().unwrap();
    let factors: Vec<Option<f64>> = points
        .iter()
        .map(|p| {
            p["point"]
                .get("capacity_factor")
                .map(|f| f.as_f64().unwrap())
        })
        .collect();
    assert_eq!(factors, [None, Some(0.5), Some(1.0), Some(1.25)]);
    assert!(activations(1) < activations(0), "{doc}");
    assert!(activations(3) > activations(0), "{doc}");
    assert!(activations(1) < activations(2) && activations(2) < activations(3));
    for (p, f) in points.iter().zip(&factors) {
        assert_eq!(p["status"], "fits", "{p}");
        let mut args = vec![
            "run",
            "--model",
            "moe-tiny",
            "--device",
            "meta",
            "--seq-len",
            "32",
            "--micro-batch",
            "2",
            "--grad-accum",
            "2",
            "--precision",
            "bf16",
            "--attention",
            "fused",
            "--checkpointing",
            "none",
            "--optimizer",
            "adamw",
            "--format",
            "json",
        ];
        let f = f.map(|f| f.to_string());
        if let Some(f) = &f {
            args.extend(["--capacity-factor", f]);
        }
        let run = common::ok_json(&args, &[]);
        assert_eq!(p["peak_bytes"], run["peak_bytes"], "{f:?}");
    }
    // The table says the factor in its own column; the label names it.
    let out = memfit(&["plan", recipe.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("cap"), "{text}");
    assert!(
        text.lines().any(|l| l.contains("1.25")) && text.lines().any(|l| l.contains("0.5")),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every planned point says what its compute is spent on (`kernel_s`):
/// GEMMs, fused attention, norms, other kernels and launches, which add
/// up to `compute_s`, one rank's or a pipeline's; invalid points have
/// none. Attention's share grows with the sequence, as its FLOPs do.
#[test]
fn plans_split_the_compute_by_what_prices_it() {
    let root = env!("CARGO_MANIFEST_DIR");
    let share = |recipe: &str| -> Vec<(f64, f64)> {
        let out = memfit(&["plan", &format!("{root}/{recipe}"), "--format", "json"]);
        let doc = common::plan_json(&out);
        let mut shares = Vec::new();
        for p in doc["points"].as_array().unwrap() {
            let Some(k) = p["kernel_s"].as_object() else {
                assert!(p["status"] == "invalid", "{p}");
                continue;
            };
            let parts: Vec<f64> = ["gemm_s", "attention_s", "norm_s", "other_s", "launch_s"]
                .iter()
                .map(|f| k[*f].as_f64().unwrap())
                .collect();
            assert!(parts.iter().all(|&s| s >= 0.0), "{k:?}");
            let (total, compute) = (parts.iter().sum::<f64>(), p["compute_s"].as_f64().unwrap());
            assert!((total / compute - 1.0).abs() < 1e-9, "{total} vs {compute}");
            assert!(parts[0] > 0.0 && parts[2] > 0.0, "GEMMs and norms: {k:?}");
            shares.push((parts[1] / total, parts[0] / total));
        }
        assert!(!shares.is_empty(), "{recipe}");
        shares
    };
    // A pipeline (pp 2) and tensor parallelism beside it.
    share("recipes/llama-70b-megatron.yaml");
    let short = share("tests/reference/calibration/recipes/mpt-1b-8xh100-t512.yaml")[0];
    let long = share("tests/reference/calibration/recipes/mpt-1b-8xh100-t65536.yaml")[0];
    assert!(short.0 < 0.2 && short.1 > 0.6, "{short:?}");
    assert!(long.0 > 0.8, "{long:?}");
}
