//! `memfit run --pipeline-stages` as a user runs it: the per-stage JSON
//! document, meta's plan of every stage, the schedules' memory, partitions
//! and recipe keys, and the exit-2 errors for bad pipeline flags.

use crate::common::{json, memfit, stderr};

use std::path::PathBuf;

use serde_json::Value;

/// A small, fast gpt2-tiny run (2 blocks) with `extra` flags; it must succeed.
fn run_json(extra: &[&str]) -> Value {
    let mut args = vec![
        "run",
        "--model",
        "gpt2-tiny",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--steps",
        "2",
        "--format",
        "json",
    ];
    args.extend(extra);
    let out = memfit(&args);
    assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    json(&out)
}

fn losses(doc: &Value) -> Vec<f64> {
    doc["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["loss"].as_f64().unwrap())
        .collect()
}

fn assert_losses_match(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    assert!(!got.is_empty(), "{what}: no steps");
    for (g, w) in got.iter().zip(want) {
        assert!(
            g.is_finite() && w.is_finite(),
            "{what}: {got:?} vs {want:?}"
        );
        assert!(
            (g - w).abs() <= 1e-5 * w.abs(),
            "{what}: losses {got:?} differ from {want:?}"
        );
    }
}

fn stages(doc: &Value) -> &Vec<Value> {
    doc["stages"]
        .as_array()
        .unwrap_or_else(|| panic!("no `stages` array in {doc}"))
}

fn layers(v: &Value) -> [u64; 2] {
    let a = v
        .as_array()
        .unwrap_or_else(|| panic!("layers is not an array: {v}"));
    assert_eq!(a.len(), 2, "{v}");
    [a[0].as_u64().unwrap(), a[1].as_u64().unwrap()]
}

fn stage_layers(doc: &Value) -> Vec<[u64; 2]> {
    stages(doc).iter().map(|s| layers(&s["layers"])).collect()
}

fn stage_total(doc: &Value, stage: usize) -> u64 {
    stages(doc)[stage]["peak_bytes"]["total"].as_u64().unwrap()
}

/// Micro-batches a stage holds: all K under GPipe, at most S - s under 1F1B.
fn in_flight(schedule: &str, stages: usize, stage: usize, k: usize) -> u64 {
    match schedule {
        "gpipe" => k as u64,
        "1f1b" => (stages - stage).min(k) as u64,
        other => panic!("unknown schedule {other}"),
    }
}

const CATEGORIES: [&str; 8] = [
    "total",
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "temporaries",
    "communication",
    "workspace",
];

/// Checks a pipelined document: one `stages` entry per stage with its
/// blocks, in-flight count and peaks, and every rank tagged with its stage.
fn check_pipeline_doc(
    doc: &Value,
    s: usize,
    k: usize,
    schedule: &str,
    want_layers: &[[u64; 2]],
    replicas: usize,
) {
    let what = format!("S={s} K={k} {schedule} x{replicas}");
    assert_eq!(doc["config"]["pipeline_stages"], s, "{what}");
    assert_eq!(doc["config"]["ranks"], s * replicas, "{what}");
    assert_eq!(doc["config"]["grad_accum"], k, "{what}");
    assert_eq!(doc["config"]["schedule"], schedule, "{what}");
    let st = stages(doc);
    assert_eq!(st.len(), s, "{what}: {st:?}");
    assert_eq!(stage_layers(doc), want_layers, "{what}");
    let mut top = 0;
    for (i, e) in st.iter().enumerate() {
        assert_eq!(e["stage"], i, "{what}");
        assert_eq!(
            e["in_flight"].as_u64(),
            Some(in_flight(schedule, s, i, k)),
            "{what}: stage {i}"
        );
        for cat in CATEGORIES {
            assert!(
                e["peak_bytes"][cat].is_u64(),
                "{what}: stages[{i}].peak_bytes.{cat} missing: {e}"
            );
        }
        let total = e["peak_bytes"]["total"].as_u64().unwrap();
        assert!(total > 0, "{what}: stage {i}");
        assert!(e["peak_bytes"]["parameters"].as_u64().unwrap() > 0);
        assert_eq!(e["peak_breakdown"]["total"].as_u64(), Some(total), "{what}");
        top = top.max(total);
    }
    assert_eq!(
        doc["peak_bytes"]["total"].as_u64(),
        Some(top),
        "{what}: the run's peak is its fullest stage's"
    );
    let ranks = doc["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), s * replicas, "{what}");
    let mut per_stage = vec![0usize; s];
    for r in ranks {
        let stage = r["stage"]
            .as_u64()
            .unwrap_or_else(|| panic!("{what}: rank without a stage: {r}"))
            as usize;
        assert!(stage < s, "{what}: {r}");
        per_stage[stage] += 1;
        assert_eq!(layers(&r["layers"]), want_layers[stage], "{what}: {r}");
        assert!(
            r["peak_bytes"]["total"].as_u64().unwrap() <= stage_total(doc, stage),
            "{what}: a stage's peak is the highest of its replicas'"
        );
    }
    assert_eq!(per_stage, vec![replicas; s], "{what}: ranks per stage");
}

#[test]
fn pipelined_json_reports_every_stage_and_trains_like_plain_accumulation() {
    let uniform: [(usize, usize, Vec<[u64; 2]>); 2] = [
        (2, 4, vec![[0, 1], [1, 2]]),
        (4, 6, vec![[0, 0], [0, 1], [1, 2], [2, 2]]),
    ];
    for (s, k, want) in &uniform {
        let (s, k) = (*s, *k);
        let plain = run_json(&["--grad-accum", &k.to_string()]);
        let plain_stages = plain["stages"].as_array().map_or(0, Vec::len);
        assert_eq!(
            plain_stages, 0,
            "no pipeline, no stages: {}",
            plain["stages"]
        );
        for r in plain["ranks"].as_array().unwrap() {
            assert!(r["stage"].is_null(), "no pipeline, no stage: {r}");
        }
        let want_losses = losses(&plain);
        assert_eq!(want_losses.len(), 2);
        for schedule in ["gpipe", "1f1b"] {
            let doc = run_json(&[
                "--pipeline-stages",
                &s.to_string(),
                "--microbatches",
                &k.to_string(),
                "--schedule",
                schedule,
            ]);
            check_pipeline_doc(&doc, s, k, schedule, want, 1);
            assert_eq!(
                doc["tokens_per_step"], plain["tokens_per_step"],
                "S={s} K={k} {schedule}: the same global batch"
            );
            assert_losses_match(
                &losses(&doc),
                &want_losses,
                &format!("S={s} K={k} {schedule} vs --grad-accum {k}"),
            );
        }
    }

    // 1f1b is the default schedule, and --grad-accum sets the micro-batches.
    let doc = run_json(&["--pipeline-stages", "2", "--grad-accum", "4"]);
    check_pipeline_doc(&doc, 2, 4, "1f1b", &[[0, 1], [1, 2]], 1);
    // Both spellings at once are fine when they agree.
    let doc = run_json(&[
        "--pipeline-stages",
        "2",
        "--grad-accum",
        "4",
        "--microbatches",
        "4",
    ]);
    assert_eq!(doc["config"]["grad_accum"], 4);
}

#[test]
fn meta_plans_every_stage_byte_for_byte() {
    for s in ["2", "4"] {
        for schedule in ["gpipe", "1f1b"] {
            for k in ["1", "6"] {
                let flags = [
                    "--pipeline-stages",
                    s,
                    "--microbatches",
                    k,
                    "--schedule",
                    schedule,
                ];
                let what = format!("S={s} K={k} {schedule}");
                let cpu = run_json(&flags);
                let mut meta_flags = flags.to_vec();
                meta_flags.extend(["--device", "meta"]);
                let meta = run_json(&meta_flags);
                assert_eq!(meta["device"], "meta", "{what}");
                assert_eq!(meta["steps"].as_array().unwrap().len(), 0, "{what}");
                let (c, m) = (stages(&cpu), stages(&meta));
                assert_eq!(c.len(), s.parse::<usize>().unwrap(), "{what}");
                assert_eq!(c.len(), m.len(), "{what}");
                for (i, (c, m)) in c.iter().zip(m).enumerate() {
                    assert_eq!(c["layers"], m["layers"], "{what}: stage {i}");
                    assert_eq!(c["in_flight"], m["in_flight"], "{what}: stage {i}");
                    assert_eq!(
                        c["peak_bytes"], m["peak_bytes"],
                        "{what}: stage {i}'s peaks, cpu vs meta"
                    );
                }
                assert_eq!(cpu["peak_bytes"], meta["peak_bytes"], "{what}");
                let rank_peaks = |d: &Value| -> Vec<Value> {
                    d["ranks"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|r| r["peak_bytes"].clone())
                        .collect()
                };
                assert_eq!(rank_peaks(&cpu), rank_peaks(&meta), "{what}: per rank");
            }
        }
    }
}

#[test]
fn one_f_one_b_holds_less_on_the_first_stage_than_gpipe() {
    let run = |schedule: &str, k: &str| {
        run_json(&[
            "--pipeline-stages",
            "2",
            "--microbatches",
            k,
            "--schedule",
            schedule,
        ])
    };
    let gpipe = run("gpipe", "6");
    let one_f_one_b = run("1f1b", "6");
    assert_eq!(stages(&gpipe)[0]["in_flight"], 6);
    assert_eq!(stages(&one_f_one_b)[0]["in_flight"], 2);
    let (g, f) = (stage_total(&gpipe, 0), stage_total(&one_f_one_b, 0));
    assert!(f < g, "stage 0: 1f1b peak {f} should be below gpipe's {g}");
    let act = |d: &Value| stages(d)[0]["peak_bytes"]["activations"].as_u64().unwrap();
    assert!(
        act(&one_f_one_b) < act(&gpipe),
        "stage 0 activations: 1f1b {} vs gpipe {}",
        act(&one_f_one_b),
        act(&gpipe)
    );
    // GPipe's first stage grows with the micro-batches; 1F1B's does not
    // once K reaches the number of stages.
    assert!(stage_total(&run("gpipe", "4"), 0) < g);
    assert_eq!(stage_total(&run("1f1b", "4"), 0), f);
    // Both train the same model.
    assert_losses_match(&losses(&one_f_one_b), &losses(&gpipe), "1f1b vs gpipe");
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "memfit-pipeline-cli-{name}-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn write(&self, file: &str, text: &str) -> String {
        let path = self.0.join(file);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn partitions_and_recipe_keys_apply() {
    // The first stage may hold the embedding only, the last the head only.
    let want_losses = losses(&run_json(&["--grad-accum", "4"]));
    for (partition, want) in [("0:0,0:2", [[0, 0], [0, 2]]), ("0:2,2:2", [[0, 2], [2, 2]])] {
        for schedule in ["gpipe", "1f1b"] {
            let doc = run_json(&[
                "--pipeline-stages",
                "2",
                "--microbatches",
                "4",
                "--schedule",
                schedule,
                "--partition",
                partition,
            ]);
            check_pipeline_doc(&doc, 2, 4, schedule, &want, 1);
            assert_losses_match(
                &losses(&doc),
                &want_losses,
                &format!("--partition {partition} {schedule}"),
            );
        }
    }
    // Both ends empty on three stages.
    let doc = run_json(&[
        "--pipeline-stages",
        "3",
        "--microbatches",
        "4",
        "--partition",
        "0:0,0:2,2:2",
    ]);
    check_pipeline_doc(&doc, 3, 4, "1f1b", &[[0, 0], [0, 2], [2, 2]], 1);

    let dir = TempDir::new("recipe");
    let recipe = dir.write(
        "pipeline.yaml",
        concat!(
            "model: gpt2-tiny\n",
            "seq_len: 32\n",
            "micro_batch: 2\n",
            "steps: 2\n",
            "pipeline_stages: 2\n",
            "microbatches: 4\n",
            "schedule: gpipe\n",
            "partition: \"0:0,0:2\"\n",
        ),
    );
    let from_recipe = |extra: &[&str]| {
        let mut args = vec!["run", "--recipe", &recipe, "--format", "json"];
        args.extend(extra);
        let out = memfit(&args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        json(&out)
    };

    let doc = from_recipe(&[]);
    assert_eq!(doc["config"]["steps"], 2, "from the recipe");
    check_pipeline_doc(&doc, 2, 4, "gpipe", &[[0, 0], [0, 2]], 1);
    assert_losses_match(&losses(&doc), &want_losses, "recipe");

    // Flags override the recipe's keys, one at a time and all together.
    let doc = from_recipe(&["--schedule", "1f1b"]);
    check_pipeline_doc(&doc, 2, 4, "1f1b", &[[0, 0], [0, 2]], 1);
    let doc = from_recipe(&["--partition", "0:2,2:2"]);
    check_pipeline_doc(&doc, 2, 4, "gpipe", &[[0, 2], [2, 2]], 1);
    let doc = from_recipe(&["--microbatches", "6"]);
    check_pipeline_doc(&doc, 2, 6, "gpipe", &[[0, 0], [0, 2]], 1);
    let doc = from_recipe(&[
        "--pipeline-stages",
        "3",
        "--partition",
        "0:1,1:2,2:2",
        "--schedule",
        "1f1b",
    ]);
    check_pipeline_doc(&doc, 3, 4, "1f1b", &[[0, 1], [1, 2], [2, 2]], 1);

    // A bad recipe partition names the recipe's key, file, line and column.
    let bad = dir.write(
        "bad-partition.yaml",
        "model: gpt2-tiny\npipeline_stages: 2\npartition: \"0:1,1:3\"\n",
    );
    let out = memfit(&["run", "--recipe", &bad, "--steps", "1"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("bad-partition.yaml:3:1: `partition`"), "{err}");
    assert!(err.contains("end at block 3"), "{err}");
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
}

/// A `--grad-accum` flag overrides a recipe's `microbatches` key, and
/// `--microbatches` a recipe's `grad_accum`: flags win over recipe keys.
#[test]
fn grad_accum_flag_overrides_a_recipe_microbatches_key() {
    let dir = TempDir::new("accum");
    let recipe = dir.write(
        "pipeline.yaml",
        "model: gpt2-tiny\nseq_len: 32\nmicro_batch: 2\nsteps: 2\npipeline_stages: 2\nmicrobatches: 4\n",
    );
    let out = memfit(&[
        "run",
        "--recipe",
        &recipe,
        "--grad-accum",
        "6",
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(json(&out)["config"]["grad_accum"], 6);
}

#[test]
fn bad_pipeline_flags_exit_2_naming_the_flag() {
    for (args, flag) in [
        // Schedules and partitions need a pipeline.
        (vec!["--schedule", "gpipe"], "--schedule"),
        (vec!["--schedule", "1f1b"], "--schedule"),
        (vec!["--partition", "0:2"], "--partition"),
        (
            vec!["--pipeline-stages", "1", "--schedule", "gpipe"],
            "--schedule",
        ),
        (
            vec!["--pipeline-stages", "1", "--partition", "0:2"],
            "--partition",
        ),
        // --ranks is stages x data-parallel replicas.
        (vec!["--pipeline-stages", "2", "--ranks", "3"], "--ranks"),
        (vec!["--pipeline-stages", "4", "--ranks", "2"], "--ranks"),
        // gpt2-tiny: 2 blocks, an embedding and a head, so at most 4 stages.
        (vec!["--pipeline-stages", "5"], "--pipeline-stages"),
        (vec!["--pipeline-stages", "0"], "--pipeline-stages"),
        // Partitions: the count, the coverage, contiguity, empty middles, syntax.
        (
            vec!["--pipeline-stages", "2", "--partition", "0:2"],
            "--partition",
        ),
        (
            vec!["--pipeline-stages", "2", "--partition", "0:1,1:2,2:2"],
            "--partition",
        ),
        (
            vec!["--pipeline-stages", "2", "--partition", "0:1,1:1"],
            "--partition",
        ),
        (
            vec!["--pipeline-stages", "2", "--partition", "0:1,1:3"],
            "--partition",
        ),
        (
            vec!["--pipeline-stages", "2", "--partition", "0:1,2:2"],
            "--partition",
        ),
        (
            vec!["--pipeline-stages", "2", "--partition", "1:1,1:2"],
            "--partition",
        ),
        (
            vec!["--pipeline-stages", "2", "--partition", "0:2,1:2"],
            "--partition",
        ),
        (
            vec!["--pipeline-stages", "3", "--partition", "0:1,1:1,1:2"],
            "--partition",
        ),
        (
            vec!["--pipeline-stages", "4", "--partition", "0:0,0:0,0:2,2:2"],
            "--partition",
        ),
        (
            vec!["--pipeline-stages", "2", "--partition", "0:a,1:2"],
            "--partition",
        ),
        (
            vec!["--pipeline-stages", "2", "--partition", "0-1,1:2"],
            "--partition",
        ),
        (
            vec!["--pipeline-stages", "2", "--partition", "0:2,"],
            "--partition",
        ),
        (
            vec!["--pipeline-stages", "2", "--partition", "0:1,1:-2"],
            "--partition",
        ),
        (
            vec!["--pipeline-stages", "2", "--partition", "2:0,0:2"],
            "--partition",
        ),
        // The same knob twice, disagreeing.
        (
            vec![
                "--pipeline-stages",
                "2",
                "--grad-accum",
                "4",
                "--microbatches",
                "3",
            ],
            "--microbatches",
        ),
        // Gradient sharding does not combine with a pipeline.
        (
            vec![
                "--pipeline-stages",
                "2",
                "--ranks",
                "4",
                "--sharding",
                "zero2",
            ],
            "--sharding",
        ),
        (
            vec![
                "--pipeline-stages",
                "2",
                "--ranks",
                "4",
                "--sharding",
                "zero3",
            ],
            "--sharding",
        ),
        (
            vec![
                "--pipeline-stages",
                "2",
                "--ranks",
                "2",
                "--sharding",
                "zero2",
            ],
            "--sharding",
        ),
        // Data replicas need a data-parallel scheme.
        (vec!["--pipeline-stages", "2", "--ranks", "4"], "--sharding"),
        (
            vec![
                "--pipeline-stages",
                "2",
                "--ranks",
                "4",
                "--sharding",
                "none",
            ],
            "--sharding",
        ),
        // zero1 shards over replicas, and one replica has nothing to shard over.
        (
            vec![
                "--pipeline-stages",
                "2",
                "--ranks",
                "2",
                "--sharding",
                "zero1",
            ],
            "--sharding",
        ),
    ] {
        let mut all = vec![
            "run",
            "--seq-len",
            "32",
            "--micro-batch",
            "2",
            "--steps",
            "1",
        ];
        all.extend(args.iter());
        let out = memfit(&all);
        let msg = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {msg}");
        assert!(
            msg.contains(&format!("memfit: {flag}:")),
            "{args:?}: expected `memfit: {flag}: ...`, got: {msg}"
        );
        for bad in ["panicked", "backtrace", "RUST_BACKTRACE"] {
            assert!(!msg.contains(bad), "{args:?}: {msg}");
        }
        assert!(out.stdout.is_empty(), "{args:?}: no document on an error");
    }

    // Too many stages for llama-tiny's 2 blocks too.
    let out = memfit(&[
        "run",
        "--model",
        "llama-tiny",
        "--pipeline-stages",
        "5",
        "--steps",
        "1",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("memfit: --pipeline-stages:"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn pipeline_with_data_parallel_replicas() {
    let doc = run_json(&[
        "--pipeline-stages",
        "2",
        "--ranks",
        "4",
        "--sharding",
        "ddp",
    ]);
    assert_eq!(doc["config"]["sharding"], "ddp");
    assert_eq!(doc["ranks"].as_array().unwrap().len(), 4);
    assert_eq!(stages(&doc).len(), 2);
    check_pipeline_doc(&doc, 2, 1, "1f1b", &[[0, 1], [1, 2]], 2);
    assert_eq!(doc["tokens_per_step"], 2 * 32 * 2, "global batch");
    for r in doc["ranks"].as_array().unwrap() {
        assert!(r["sent_bytes_per_step"].as_u64().unwrap() > 0, "{r}");
    }
    // Two replicas of a two-stage pipeline train like two plain ddp ranks.
    let plain = run_json(&["--ranks", "2", "--sharding", "ddp"]);
    assert_losses_match(&losses(&doc), &losses(&plain), "2x2 ddp vs ddp");

    // zero1 over the replicas, with micro-batches, on cpu and meta.
    let flags = [
        "--pipeline-stages",
        "2",
        "--ranks",
        "4",
        "--sharding",
        "zero1",
        "--microbatches",
        "3",
    ];
    let doc = run_json(&flags);
    check_pipeline_doc(&doc, 2, 3, "1f1b", &[[0, 1], [1, 2]], 2);
    let plain = run_json(&["--ranks", "2", "--sharding", "zero1", "--grad-accum", "3"]);
    assert_losses_match(&losses(&doc), &losses(&plain), "2x2 zero1 vs zero1");
    let mut meta_flags = flags.to_vec();
    meta_flags.extend(["--device", "meta"]);
    let meta = run_json(&meta_flags);
    for (c, m) in stages(&doc).iter().zip(stages(&meta)) {
        assert_eq!(
            c["peak_bytes"], m["peak_bytes"],
            "zero1 stage {}",
            c["stage"]
        );
    }
}

/// Interleaved 1F1B (`--virtual-stages`) as a user runs it: each stage's
/// chunks in the JSON document and the table, the in-flight count of
/// Megatron's warm-up, the losses of plain accumulation, meta's prediction
/// of every rank byte for byte, and a recipe's key.
#[test]
fn virtual_stages_run_interleaved_1f1b() {
    let want_losses = losses(&run_json(&["--grad-accum", "4"]));
    let flags = [
        "--pipeline-stages",
        "2",
        "--virtual-stages",
        "2",
        "--grad-accum",
        "4",
    ];
    let cpu = run_json(&flags);
    assert_losses_match(&losses(&cpu), &want_losses, "--virtual-stages 2");
    assert_eq!(cpu["config"]["virtual_stages"], 2);
    // gpt2-tiny's 2 blocks and its ends in 4 chunks: the embedding alone,
    // block 0, block 1, the head alone; stage 0 holds chunks 0 and 2.
    let st = stages(&cpu);
    let chunks = |s: &Value| s["chunks"].clone();
    assert_eq!(chunks(&st[0]), serde_json::json!([[0, 0], [1, 2]]));
    assert_eq!(chunks(&st[1]), serde_json::json!([[0, 1], [2, 2]]));
    assert_eq!(layers(&st[0]["layers"]), [0, 0], "the first chunk's");
    // Megatron's warm-up, (S - s - 1) x 2 + (V - 1) x S, and one more.
    assert_eq!(st[0]["in_flight"], 5);
    assert_eq!(st[1]["in_flight"], 3);
    let mut meta_flags = flags.to_vec();
    meta_flags.extend(["--device", "meta"]);
    let meta = run_json(&meta_flags);
    let rank_peaks = |d: &Value| -> Vec<Value> {
        (d["ranks"].as_array().unwrap().iter())
            .map(|r| r["peak_bytes"].clone())
            .collect()
    };
    assert_eq!(rank_peaks(&cpu), rank_peaks(&meta), "per rank, cpu vs meta");
    // Without virtual stages the document has no `virtual_stages` or `chunks`.
    let plain = run_json(&["--pipeline-stages", "2", "--grad-accum", "4"]);
    assert!(plain["config"].get("virtual_stages").is_none());
    assert!(stages(&plain)[0].get("chunks").is_none());

    // The table names the chunks and the schedule.
    let mut table = vec![
        "run",
        "--model",
        "gpt2-tiny",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--steps",
        "1",
    ];
    table.extend(flags);
    let out = memfit(&table);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("interleaved 1f1b of 2 chunks each"), "{text}");
    assert!(text.contains("0:0,1:2"), "{text}");

    // A recipe's key, and a bad one blamed at its line and column.
    let dir = TempDir::new("virtual");
    let recipe = dir.write(
        "interleaved.yaml",
        "model: gpt2-tiny\nseq_len: 32\nmicro_batch: 2\nsteps: 2\npipeline_stages: 2\nvirtual_stages: 2\ngrad_accum: 4\n",
    );
    let out = memfit(&["run", "--recipe", &recipe, "--format", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let doc = json(&out);
    assert_eq!(stages(&doc)[0]["chunks"], chunks(&st[0]));
    let bad = dir.write(
        "bad-virtual.yaml",
        "model: gpt2-tiny\npipeline_stages: 2\nschedule: gpipe\nvirtual_stages: 2\n",
    );
    let out = memfit(&["run", "--recipe", &bad, "--steps", "1"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("bad-virtual.yaml:4:1: `virtual_stages`"),
        "{err}"
    );
    assert!(err.contains("--schedule 1f1b"), "{err}");
}

#[test]
fn bad_virtual_stages_exit_2_naming_the_flag() {
    for (args, flag, says) in [
        // No pipeline to interleave.
        (
            vec!["--virtual-stages", "2"],
            "--virtual-stages",
            "pipelines only",
        ),
        (
            vec!["--pipeline-stages", "1", "--virtual-stages", "2"],
            "--virtual-stages",
            "pipelines only",
        ),
        (
            vec!["--pipeline-stages", "2", "--virtual-stages", "0"],
            "--virtual-stages",
            "at least 1",
        ),
        // Interleaving is 1F1B's.
        (
            vec![
                "--pipeline-stages",
                "2",
                "--virtual-stages",
                "2",
                "--schedule",
                "gpipe",
                "--grad-accum",
                "4",
            ],
            "--virtual-stages",
            "--schedule 1f1b",
        ),
        // gpt2-tiny: 2 blocks and the two ends, so at most 4 chunks.
        (
            vec![
                "--pipeline-stages",
                "2",
                "--virtual-stages",
                "3",
                "--grad-accum",
                "4",
            ],
            "--virtual-stages",
            "at most 2 virtual stages",
        ),
        // Micro-batches in whole groups of S (Megatron's requirement).
        (
            vec![
                "--pipeline-stages",
                "2",
                "--virtual-stages",
                "2",
                "--grad-accum",
                "3",
            ],
            "--grad-accum",
            "multiple of 2",
        ),
        // A partition lists one range per chunk.
        (
            vec![
                "--pipeline-stages",
                "2",
                "--virtual-stages",
                "2",
                "--grad-accum",
                "2",
                "--partition",
                "0:1,1:2",
            ],
            "--partition",
            "4 model chunks",
        ),
        (
            vec![
                "--pipeline-stages",
                "2",
                "--virtual-stages",
                "2",
                "--grad-accum",
                "2",
                "--partition",
                "0:1,1:1,1:2,2:2",
            ],
            "--partition",
            "chunk 1 holds no block",
        ),
        // LoRA does not run with pipelines at all.
        (
            vec![
                "--pipeline-stages",
                "2",
                "--virtual-stages",
                "2",
                "--grad-accum",
                "2",
                "--finetune",
                "lora",
            ],
            "--pipeline-stages",
            "pipeline",
        ),
    ] {
        let mut all = vec![
            "run",
            "--seq-len",
            "32",
            "--micro-batch",
            "2",
            "--steps",
            "1",
        ];
        all.extend(args.iter());
        let out = memfit(&all);
        let msg = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {msg}");
        assert!(
            msg.contains(&format!("memfit: {flag}:")) && msg.contains(says),
            "{args:?}: expected `memfit: {flag}: ...{says}...`, got: {msg}"
        );
        assert!(!msg.contains("panicked"), "{args:?}: {msg}");
        assert!(out.stdout.is_empty(), "{args:?}: no document on an error");
    }
}
