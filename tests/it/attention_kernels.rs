//! Fused attention priced at the published rates of the kernel a plan
//! recipe names (`attention_kernel`), from its hardware profile's
//! `attention_kernels`: the step's time moves, its bytes do not, and a
//! kernel the profile has no figure for is refused where the recipe names
//! it.

use crate::common::{memfit, plan_json, refused, scratch, stderr};
use serde_json::Value;

fn recipe(kernel: Option<&str>, hardware: &str, attention: &str) -> String {
    let key = kernel.map_or(String::new(), |k| format!("attention_kernel: {k}\n"));
    format!(
        "model: llama-3.2-1b\nhardware: {hardware}\n{key}seq_len: 2048\nglobal_batch: 64\ngrid:\n  framework: [memfit]\n  attention: [{attention}]\n  precision: [bf16]\n  micro_batch: [2]\n  sharding: [zero1]\n  gpus: [8]\n"
    )
}

fn plan(name: &str, text: &str) -> (Value, String) {
    let path = scratch(name).join("p.yaml");
    std::fs::write(&path, text).unwrap();
    let table = memfit(&["plan", path.to_str().unwrap(), "--wide"]);
    let text = String::from_utf8_lossy(&table.stdout).into_owned();
    let doc = plan_json(&memfit(&[
        "plan",
        path.to_str().unwrap(),
        "--format",
        "json",
    ]));
    (doc, text)
}

/// MosaicML's Triton kernel runs attention at about half FlashAttention-2's
/// rate on an A100 (FlashAttention-2's benchmark): the same step takes
/// longer, holds the same bytes, and says which kernel priced it.
#[test]
fn the_named_kernel_prices_fused_attention_and_moves_no_byte() {
    let (fa2, fa2_text) = plan("attn-fa2", &recipe(None, "a100-80gb", "fused"));
    let (triton, triton_text) = plan(
        "attn-triton",
        &recipe(Some("flash-attention-triton"), "a100-80gb", "fused"),
    );
    let (named, _) = plan(
        "attn-fa2-named",
        &recipe(Some("flash-attention-2"), "a100-80gb", "fused"),
    );
    let (a, b, c) = (&fa2["points"][0], &triton["points"][0], &named["points"][0]);
    assert_eq!(a["peak_bytes"], b["peak_bytes"]);
    assert_eq!(a["peak_breakdown"], b["peak_breakdown"]);
    assert_eq!(a["step_s"], c["step_s"], "flash-attention-2 is the default");
    let (fast, slow) = (a["step_s"].as_f64().unwrap(), b["step_s"].as_f64().unwrap());
    assert!(slow > fast * 1.02, "{slow} vs {fast}");
    assert_eq!(fa2["hardware"]["attention_kernel"], "flash-attention-2");
    assert_eq!(
        triton["hardware"]["attention_kernel"],
        "flash-attention-triton"
    );
    assert!(
        triton_text.contains("flash-attention-triton's rates in the hardware profile"),
        "{triton_text}"
    );
    assert!(
        fa2_text.contains("flash-attention-2's rates in the hardware profile"),
        "{fa2_text}"
    );
    // A profile without rates prices the default at its share of the peak.
    let (plain, plain_text) = plan("attn-4090", &recipe(None, "rtx-4090", "fused"));
    assert!(
        plain["hardware"]["attention_kernels"].is_null(),
        "{}",
        plain["hardware"]
    );
    assert!(
        plain_text.contains("fused attention at 67% of peak"),
        "{plain_text}"
    );
}

/// A kernel the hardware profile gives no rates for, a grid without fused
/// attention and a misspelt kernel are each refused at the key.
#[test]
fn a_kernel_that_cannot_be_priced_is_refused_at_its_key() {
    let dir = scratch("attn-refused");
    let write = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    let p = write("a.yaml", recipe(Some("xformers"), "h100-sxm-80gb", "fused"));
    let err = refused(&["plan", &p], "a.yaml:3:19: ");
    assert!(
        err.contains(
            "hardware profile `h100-sxm-80gb` gives no rates for the `xformers` attention kernel"
        ) && err.contains(
            "it gives rates for flash-attention-2, flash-attention, flash-attention-triton"
        ),
        "{err}"
    );
    let p = write(
        "b.yaml",
        recipe(Some("flash-attention"), "rtx-4090", "fused"),
    );
    let err = refused(&["plan", &p], "b.yaml:3:19: ");
    assert!(
        err.contains("its `attention_kernels` key is absent"),
        "{err}"
    );
    let p = write(
        "c.yaml",
        recipe(Some("flash-attention"), "a100-80gb", "eager"),
    );
    refused(&["plan", &p], "the grid's `attention` lists only eager");
    let p = write(
        "d.yaml",
        recipe(Some("flash-atention-2"), "a100-80gb", "fused"),
    );
    refused(&["plan", &p], "did you mean `flash-attention-2`?");
}

/// A profile's rates must be positive, at most four head dimensions of at
/// most sixteen lengths; a bad one is refused at its key.
#[test]
fn a_profile_with_a_bad_rate_is_refused_at_its_key() {
    let dir = scratch("attn-profile");
    let profile = include_str!("../../profiles/hardware/a100-80gb.yaml")
        .replace("2048: 155,", "2048: 0,")
        .replace("name: a100-80gb", "name: a100-bad");
    let hw = dir.join("a100-bad.yaml");
    std::fs::write(&hw, profile).unwrap();
    let p = dir.join("p.yaml");
    std::fs::write(&p, recipe(None, hw.to_str().unwrap(), "fused")).unwrap();
    let out = memfit(&["plan", p.to_str().unwrap()]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("a100-bad.yaml:")
            && err.contains(
                "`flash-attention-2` at head dimension 128: 0 TFLOP/s at sequence length 2048"
            ),
        "{err}"
    );
}
