//! Hugging Face `config.json` import: published parameter counts, error
//! messages for invalid configs, `--model config.json` through the binary, and
//! the q/k/v bias that Qwen2 brings to the llama family.

use std::path::{Path, PathBuf};
use std::process::Command;

use memfit::config::hf::load_hf_config;
use memfit::config::profile::load_model;
use memfit::config::{Family, ModelConfig};
use memfit::error::Error;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf")
        .join(name)
}

fn load(name: &str) -> ModelConfig {
    let path = fixture(name);
    let via_path = load_hf_config(&path).unwrap_or_else(|e| panic!("{e}"));
    let via_spec = load_model(path.to_str().unwrap()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        via_path, via_spec,
        "{name}: load_model routes .json to the importer"
    );
    via_path
}

/// The error of an invalid fixture, which must be a `Config` error naming the file.
fn error_of(name: &str) -> String {
    let path = fixture(name);
    let spec = path.to_str().unwrap();
    let err = match load_model(spec) {
        Ok(m) => panic!("{name}: loaded as {m:?}, but should fail"),
        Err(e) => e,
    };
    assert!(matches!(err, Error::Config { .. }), "{name}: {err}");
    let msg = err.to_string();
    assert!(msg.starts_with(spec), "{msg}");
    msg
}

#[test]
fn published_parameter_counts() {
    let expected: &[(&str, u64)] = &[
        ("gpt2.json", 124_439_808),
        ("llama-3.1-8b.json", 8_030_261_248),
        ("mistral-7b-v0.3.json", 7_248_023_552),
        ("qwen2-0.5b.json", 494_032_768),
        ("qwen2.5-7b.json", 7_615_616_512),
        // The model card's "3.8B"; transformers 5.24's Phi3ForCausalLM
        // built from this config has 3,821,079,552.
        ("phi-3-mini-4k.json", 3_821_079_552),
    ];
    for &(name, params) in expected {
        let m = load(name);
        assert_eq!(m.num_parameters(), params, "{name}");
        assert_eq!(
            m.name,
            name.trim_end_matches(".json"),
            "name from the file stem"
        );
    }
}

#[test]
fn gpt2_matches_the_builtin_profile() {
    let hf = load("gpt2.json");
    let builtin = load_model("gpt2").unwrap();
    assert_eq!(hf.family, Family::Gpt2);
    assert_eq!(
        hf.pad_vocab_to, 1,
        "Hugging Face does not pad the vocabulary"
    );
    assert_eq!(
        (
            hf.vocab_size,
            hf.max_seq_len,
            hf.n_layer,
            hf.n_head,
            hf.d_model
        ),
        (
            builtin.vocab_size,
            builtin.max_seq_len,
            builtin.n_layer,
            builtin.n_head,
            builtin.d_model
        )
    );
    assert_eq!(hf.d_ff(), 3072, "n_inner absent means 4 * n_embd");
    assert_eq!(hf.norm_eps(), 1e-5);
    assert!(hf.tied() && hf.has_qkv_bias());
    assert_eq!(hf.num_parameters(), builtin.num_parameters());
}

#[test]
fn llama_family_fields() {
    let l = load("llama-3.1-8b.json");
    assert_eq!(
        (l.family, l.n_kv_head(), l.d_ff()),
        (Family::Llama, 8, 14336)
    );
    assert_eq!((l.rope_theta(), l.norm_eps()), (500_000.0, 1e-5));
    assert!(!l.tied() && !l.has_qkv_bias());
    assert_eq!(
        l.num_parameters(),
        load_model("llama-3.1-8b").unwrap().num_parameters()
    );

    let m = load("mistral-7b-v0.3.json");
    assert_eq!((m.max_seq_len, m.vocab_size), (32768, 32768));
    assert_eq!(m.qkv_bias, None);

    let q = load("qwen2-0.5b.json");
    assert_eq!(q.qkv_bias, Some(true));
    assert_eq!((q.n_head, q.n_kv_head(), q.head_dim()), (14, 2, 64));
    assert_eq!((q.rope_theta(), q.norm_eps()), (1_000_000.0, 1e-6));
    assert!(q.tied());
    let (specs, idx) = q.param_layout();
    let b = idx.blocks[0].qkv_b.expect("qwen2 has a q|k|v bias");
    assert_eq!(specs[b].name.to_string(), "h.0.attn.qkv.bias");
    assert_eq!(specs[b].shape, vec![(14 + 2 * 2) * 64]);
    assert!(
        idx.blocks
            .iter()
            .all(|b| b.o_b.is_none() && b.up_b.is_none())
    );

    let q = load("qwen2.5-7b.json");
    assert_eq!(q.qkv_bias, Some(true));
    assert!(!q.tied());
}

#[test]
fn unsupported_model_type() {
    let msg = error_of("bert.json");
    assert!(msg.contains(":14:3: "), "the line of `model_type`: {msg}");
    assert!(
        msg.contains(
            "`model_type` \"bert\" is not supported; memfit imports gpt2, llama, mistral, qwen2, phi3, qwen3, mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek (DeepSeek-MoE), gemma2, gemma3_text and gemma3 (its text model) configs"
        ),
        "{msg}"
    );
}

#[test]
fn missing_field_names_field_and_model_type() {
    let msg = error_of("missing-hidden-size.json");
    assert!(
        msg.contains("`hidden_size` is missing; a llama config.json needs it"),
        "{msg}"
    );
}

#[test]
fn syntax_error_has_line_and_column() {
    let msg = error_of("bad-json.json");
    // The missing comma after `"intermediate_size": 4864` shows at the next key.
    assert!(msg.contains("bad-json.json:7:3: "), "{msg}");
    assert!(msg.contains("invalid JSON"), "{msg}");
    assert!(
        !msg.contains(" at line "),
        "the position is in the location: {msg}"
    );
}

/// Mistral-NeMo's shape (the fixture): 32 heads of 128 on a 5120-wide
/// stream. The head width is kept; the o projection reads 4096 columns;
/// 12.2B parameters, as its card says.
#[test]
fn an_explicit_head_dim_is_kept() {
    let m = load_model(fixture("mistral-nemo-shape.json").to_str().unwrap()).unwrap();
    assert_eq!((m.head_dim, m.attn_width()), (Some(128), 4096));
    let (specs, idx) = m.param_layout();
    assert_eq!(specs[idx.blocks[0].o_w].shape, vec![5120, 4096]);
    assert_eq!(
        specs[idx.blocks[0].qkv_w].shape,
        vec![(32 + 2 * 8) * 128, 5120]
    );
    assert_eq!((m.num_parameters() as f64 / 1e8).round() / 10.0, 12.2);
}

#[test]
fn json_content_is_sniffed_without_the_extension() {
    let dir = std::env::temp_dir().join(format!("memfit-hf-{}", std::process::id()));
    let dir = dir.join("Qwen2-0.5B");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config");
    std::fs::copy(fixture("qwen2-0.5b.json"), &path).unwrap();
    let m = load_model(path.to_str().unwrap()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(m.num_parameters(), 494_032_768);
    assert_eq!(
        m.name, "Qwen2-0.5B",
        "a file named config takes its directory's name"
    );
    std::fs::remove_dir_all(dir.parent().unwrap()).unwrap();
}

#[test]
fn run_meta_with_a_config_json() {
    let out = Command::new(env!("CARGO_BIN_EXE_memfit"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "run",
            "--model",
            "tests/fixtures/hf/qwen2-0.5b.json",
            "--device",
            "meta",
            "--seq-len",
            "128",
            "--micro-batch",
            "1",
            "--format",
            "json",
        ])
        .output()
        .expect("memfit runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}\nstderr: {stderr}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    assert_eq!(doc["num_parameters"], 494_032_768u64, "{doc}");
    assert_eq!(doc["model"], "qwen2-0.5b");
}

/// Phi-3's fused projections are memfit's own layout; what memfit does not
/// model is refused by the key that asks for it.
#[test]
fn phi3_imports_as_llama_and_refuses_what_it_does_not_model() {
    let m = load("phi-3-mini-4k.json");
    assert_eq!((m.n_layer, m.d_model, m.n_kv_head()), (32, 3072, 32));
    assert!(!m.tied());
    let text = std::fs::read_to_string(fixture("phi-3-mini-4k.json")).unwrap();
    for (from, to, key) in [
        (
            "\"rope_theta\": 10000.0,",
            "\"rope_theta\": 10000.0,\n  \"partial_rotary_factor\": 0.75,",
            "partial_rotary_factor",
        ),
        (
            "\"resid_pdrop\": 0.0",
            "\"resid_pdrop\": 0.1",
            "resid_pdrop",
        ),
    ] {
        let edited = text.replace(from, to);
        assert_ne!(edited, text);
        let err = memfit::config::hf::import_hf_config(&edited, "phi.json")
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("`{key}`")), "{err}");
        assert!(err.starts_with("phi.json:"), "{err}");
    }
}
