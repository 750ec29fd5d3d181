//! `memfit plan`'s table on the recipes users run: it fits the terminal's
//! width, says the knobs every point shares once, shows the hybrid shard
//! group when it varies, prices LoRA's frozen base as frozen, and states
//! the recommended point's margin (issue 27's plan-table defects).

use crate::common;

use std::process::Command;

use crate::common::{memfit, plan_json, scratch, stderr};
use memfit::units::fmt_bytes;
use serde_json::Value;

fn recipe(name: &str) -> String {
    format!("{}/recipes/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// `memfit plan ARGS` with `COLUMNS` set to `width`: its stdout.
fn plan_at(width: usize, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .env("MEMFIT_NO_GPU_CALIBRATION", "1")
        .arg("plan")
        .args(args)
        .env("COLUMNS", width.to_string())
        .output()
        .expect("memfit runs");
    assert!(matches!(out.status.code(), Some(0 | 1)), "{}", stderr(&out));
    String::from_utf8(out.stdout).expect("UTF-8")
}

fn plan_doc(path: &str) -> Value {
    plan_json(&memfit(&["plan", path, "--format", "json"]))
}

/// The longest line, in characters, and the line.
fn widest(text: &str) -> (usize, &str) {
    text.lines()
        .map(|l| (l.chars().count(), l))
        .max()
        .unwrap_or((0, ""))
}

/// The table's header row (the line that starts with `#`) and its rows (the
/// lines under it that start with a point's index).
fn table(text: &str) -> (&str, Vec<&str>) {
    let mut lines = text
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("# "));
    let head = lines.next().expect("a header row");
    let rows = lines
        .take_while(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|t| t.parse::<usize>().is_ok())
        })
        .collect();
    (head, rows)
}

/// The row of point `i`.
fn row<'a>(rows: &[&'a str], i: usize) -> &'a str {
    let i = i.to_string();
    rows.iter()
        .find(|r| r.split_whitespace().next() == Some(&i))
        .unwrap_or_else(|| panic!("no row {i}: {rows:#?}"))
}

/// The text with its line breaks and indents undone (it is wrapped).
fn prose(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The lines from `every point:` up to the header row, joined.
fn every_point(text: &str) -> String {
    let lines: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("every point: "))
        .take_while(|l| !l.trim_start().starts_with("# "))
        .collect();
    prose(&lines.join(" "))
}

#[test]
fn the_cluster_plan_fits_80_and_120_columns_with_shared_knobs_said_once() {
    let path = recipe("llama-70b-cluster.yaml");
    let doc = plan_doc(&path);
    for width in [80, 120] {
        let text = plan_at(width, &[&path]);
        let (w, line) = widest(&text);
        assert!(w <= width, "{w} > {width}: {line}\n{text}");
        // Knobs the same at every point: said once, above the table.
        let every = every_point(&text);
        for knob in [
            "framework hf-eager",
            "sharding zero3",
            "prec bf16",
            "optimizer adamw",
            "ckpt full",
            "mb 2",
        ] {
            assert!(every.contains(knob), "{width}: {knob}: {every}");
        }
        let (head, rows) = table(&text);
        let cols: Vec<&str> = head.split_whitespace().collect();
        for shared in ["framework", "sharding", "prec", "optimizer", "ckpt", "mb"] {
            assert!(!cols.contains(&shared), "{width}: {head}");
        }
        for varies in ["offload", "gpus", "status"] {
            assert!(cols.contains(&varies), "{width}: {head}");
        }
        // The unit once, in the header: `peak GiB` over bare figures.
        assert!(head.contains("peak GiB"), "{head}");
        assert_eq!(rows.len(), doc["points"].as_array().unwrap().len());
        for (i, p) in doc["points"].as_array().unwrap().iter().enumerate() {
            let peak = format!("{:.2}", p["total_bytes"].as_f64().unwrap() / 1073741824.0);
            let r = row(&rows, i);
            assert!(r.split_whitespace().any(|t| t == peak), "{peak}: {r}");
            assert!(!r.contains(&format!("{peak} GiB")), "{r}");
        }
        assert!(text.contains("(70.55 billion parameters)"), "{text}");
        assert!(!text.contains("70553706496"), "{text}");
    }
    // At 80 columns the links are hidden, and the table says so and how to
    // see them.
    let narrow = plan_at(80, &[&path]);
    let said = prose(&narrow);
    assert!(said.contains("columns hidden: links"), "{narrow}");
    assert!(said.contains("--wide shows every column"), "{narrow}");
    assert!(!table(&narrow).0.contains("links"), "{narrow}");
    // --wide: every column, and prose unwrapped.
    let wide = plan_at(80, &[&path, "--wide"]);
    assert!(table(&wide).0.contains("links"), "{wide}");
    assert!(!wide.contains("columns hidden"), "{wide}");
    assert!(widest(&wide).0 > 120, "{wide}");
}

/// Two points that differ only in the hybrid shard group showed as two
/// identical rows with different peaks: the group is a column when it
/// varies, and said nowhere when it does not.
#[test]
fn the_hybrid_shard_group_is_a_column_when_it_varies() {
    let base = std::fs::read_to_string(recipe("llama-70b-cluster.yaml")).unwrap();
    assert!(base.contains("\ngrid:\n"), "{base}");
    let hybrid = base.replace("\ngrid:\n", "\ngrid:\n  shard_group: [0, 8]\n");
    let path = scratch("plan-render-hybrid").join("hybrid.yaml");
    std::fs::write(&path, hybrid).unwrap();
    let path = path.to_str().unwrap();
    let doc = plan_doc(path);
    let pts = doc["points"].as_array().unwrap();
    assert!(pts.iter().any(|p| p["point"]["shard_group"] == 8));
    for width in [80, 120] {
        let text = plan_at(width, &[path]);
        let (w, line) = widest(&text);
        assert!(w <= width, "{w} > {width}: {line}\n{text}");
        let (head, rows) = table(&text);
        let cols: Vec<&str> = head.split_whitespace().collect();
        let at = cols.iter().position(|&c| c == "hybrid");
        let at = at.unwrap_or_else(|| panic!("{width}: no hybrid column: {head}"));
        for (i, p) in pts.iter().enumerate() {
            let cell = row(&rows, i).split_whitespace().nth(at).unwrap();
            let want = match p["point"]["shard_group"].as_u64().unwrap() {
                0 => "-".to_string(),
                g => g.to_string(),
            };
            assert_eq!(cell, want, "{width}: row {i}: {text}");
        }
        // No two rows read the same once their index is set aside.
        let bodies: Vec<String> = rows
            .iter()
            .map(|r| r.split_whitespace().skip(1).collect::<Vec<_>>().join(" "))
            .collect();
        for (a, x) in bodies.iter().enumerate() {
            for y in &bodies[a + 1..] {
                assert_ne!(x, y, "{width}: {text}");
            }
        }
    }
    let plain = plan_at(120, &[&recipe("llama-70b-cluster.yaml")]);
    assert!(!plain.contains("hybrid"), "{plain}");
}

/// LoRA and QLoRA train adapters on a frozen base: their closed form is the
/// base's weights plus the adapters' `2+2+12`, not `2+2+12 = 16 B/param`
/// for every weight, and it lands on what the engine holds.
#[test]
fn lora_and_qlora_bytes_per_param_price_the_frozen_base_as_frozen() {
    let path = recipe("llama-8b-lora-4090.yaml");
    let doc = plan_doc(&path);
    let mut seen = (false, false);
    for p in doc["points"].as_array().unwrap() {
        if p["status"] != "fits" {
            continue;
        }
        let cf = &p["closed_form"];
        let formula = cf["formula"].as_str().unwrap();
        let bpp = cf["bytes_per_param"].as_f64().unwrap();
        let engine = p["engine_bytes_per_param"].as_f64().unwrap();
        assert!(!formula.contains("= 16 B/param"), "{formula}");
        assert!(
            (bpp / engine - 1.0).abs() < 0.05,
            "{bpp} vs {engine}: {formula}"
        );
        match p["point"]["finetune"].as_str().unwrap() {
            "lora" => {
                seen.0 = true;
                assert!(formula.starts_with("LoRA, "), "{formula}");
                assert!(formula.contains("frozen base 2 B/param"), "{formula}");
                assert!(bpp > 2.0 && bpp < 2.5, "{formula}");
            }
            "qlora" => {
                seen.1 = true;
                assert!(formula.contains("NF4"), "{formula}");
                assert!(bpp < 1.0, "{formula}");
            }
            other => panic!("{other}"),
        }
    }
    assert_eq!(seen, (true, true), "a LoRA and a QLoRA point fit");
    let text = prose(&plan_at(100, &[&path]));
    assert!(text.contains("model states: closed form LoRA, AdamW mixed precision: frozen base 2 B/param + adapters"), "{text}");
    assert!(!text.contains("= 16 B/param"), "{text}");
    let text = prose(&plan_at(100, &[&recipe("llama-70b-qlora-a6000.yaml")]));
    assert!(
        text.contains("closed form QLoRA (block projections in NF4)"),
        "{text}"
    );
}

/// The recommendation states the margin below the usable limit, and calls
/// it tight when it is smaller than what the caching allocator's
/// fragmentation takes at that point.
#[test]
fn the_recommendation_states_its_margin_and_flags_a_tight_one() {
    // 8 x H100's pick, alone, with the headroom that leaves it half of
    // its fragmentation: tight by construction.
    let pick = plan_doc(&recipe("llama-70b-8xh100.yaml"));
    let p = &pick["points"][pick["recommendation"]["index"].as_u64().unwrap() as usize];
    let a = &p["allocator"];
    let frag =
        a["max_memory_reserved"].as_u64().unwrap() - a["max_memory_allocated"].as_u64().unwrap();
    let cap = pick["capacity_bytes"].as_u64().unwrap() as f64;
    let headroom = 1.0 - (p["total_bytes"].as_u64().unwrap() + frag / 2) as f64 / cap;
    let q = &p["point"];
    let dir = common::scratch("tight-pick");
    let tight_recipe = dir.join("tight.yaml");
    std::fs::write(
        &tight_recipe,
        format!(
            "model: llama-3.1-70b\nhardware: h100-sxm-80gb\nseq_len: 4096\nglobal_batch: 64\nheadroom: {headroom}\ngrid:\n  micro_batch: [{}]\n  checkpointing: [{}]\n  optimizer: [{}]\n  sharding: [{}]\n  gpus: [{}]\n",
            q["micro_batch"], q["checkpointing"].as_str().unwrap(), q["optimizer"].as_str().unwrap(), q["sharding"].as_str().unwrap(), q["gpus"]
        ),
    )
    .unwrap();
    let mut tight_seen = false;
    for path in [
        recipe("llama-70b-cluster.yaml"),
        recipe("llama-70b-8xh100.yaml"),
        tight_recipe.display().to_string(),
    ] {
        let name = path.clone();
        let doc = plan_doc(&path);
        let i = doc["recommendation"]["index"].as_u64().unwrap() as usize;
        let p = &doc["points"][i];
        let margin = p["margin_bytes"].as_u64().unwrap();
        let a = &p["allocator"];
        let frag = a["max_memory_reserved"].as_u64().unwrap()
            - a["max_memory_allocated"].as_u64().unwrap();
        let text = plan_at(100, &[&path]);
        let said = prose(&text);
        let line = format!(
            "margin {} below the {} usable per GPU ({} less the ",
            fmt_bytes(margin),
            fmt_bytes(p["usable_bytes"].as_u64().unwrap()),
            fmt_bytes(doc["capacity_bytes"].as_u64().unwrap())
        );
        assert!(said.contains(&line), "{name}: {line}: {text}");
        let tight = margin < frag;
        tight_seen |= tight;
        let flag = format!(
            "tight, less than the {} the caching allocator's fragmentation takes",
            fmt_bytes(frag)
        );
        assert_eq!(said.contains(&flag), tight, "{name}: {text}");
        let status = row(&table(&text).1, i)
            .split_whitespace()
            .skip(1)
            .collect::<Vec<_>>()
            .join(" ");
        assert_eq!(status.ends_with("fits (tight)"), tight, "{name}: {status}");
    }
    assert!(tight_seen, "the third recommendation is tight");
}
