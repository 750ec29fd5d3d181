//! `memfit plan`'s output on the recipes users run (issue 27's plan-table
//! defects).

mod common;

use std::process::Command;

use common::{memfit, plan_json, stderr};
use serde_json::Value;

fn recipe(name: &str) -> String {
    format!("{}/recipes/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// `memfit plan ARGS` with `COLUMNS` set to `width`: its stdout.
fn plan_at(width: usize, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_memfit"))
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

/// The text with its line breaks and indents undone (it is wrapped).
fn prose(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
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
