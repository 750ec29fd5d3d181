//! Import of Gemma 2 and Gemma 3 (text) `config.json`s as family gemma.
//!
//! The facts come from transformers' `Gemma2Config` and `Gemma3TextConfig`
//! (`configuration_gemma2.py`, `configuration_gemma3.py`) and the modelling
//! files beside them: a key the config leaves out takes that class's
//! default, as `AutoConfig` gives it (Gemma 3's multimodal configs set only
//! the keys that differ, e.g. gemma-3-4b's `text_config`), except the three
//! that size the model (`hidden_size`, `intermediate_size`,
//! `num_hidden_layers`), which every published config sets and a config
//! missing them is more likely wrong than meant to be the default.

use serde_json::Value;

use super::hf::Fields;
use super::model::{Family, GemmaConfig, ModelConfig, QkNorm};
use crate::Result;

/// The defaults of transformers' config class for one generation.
struct Defaults {
    vocab_size: usize,
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    max_seq_len: usize,
    rope_theta: f32,
    sliding_window: usize,
    global_every: usize,
    attn_softcap: Option<f32>,
    final_softcap: Option<f32>,
}

/// `Gemma2Config`'s defaults (those of Gemma-2-2B's shape).
const GEMMA2: Defaults = Defaults {
    vocab_size: 256_000,
    n_head: 8,
    n_kv_head: 4,
    head_dim: 256,
    max_seq_len: 8192,
    rope_theta: 10_000.0,
    sliding_window: 4096,
    global_every: 2,
    attn_softcap: Some(50.0),
    final_softcap: Some(30.0),
};

/// `Gemma3TextConfig`'s defaults (those of Gemma-3-4B's text model).
const GEMMA3: Defaults = Defaults {
    vocab_size: 262_208,
    n_head: 8,
    n_kv_head: 4,
    head_dim: 256,
    max_seq_len: 131_072,
    rope_theta: 1_000_000.0,
    sliding_window: 4096,
    global_every: 6,
    attn_softcap: None,
    final_softcap: None,
};

/// A `gemma3` (multimodal) config: its text model, from `text_config`.
pub(super) fn import_text_config(cfg: &Fields, name: String) -> Result<ModelConfig> {
    let Some(Value::Object(map)) = cfg.get("text_config") else {
        return Err(cfg.error(
            "text_config",
            "a gemma3 config.json holds its text model in `text_config`, an object; \
             memfit imports that (the vision tower is left out)"
                .into(),
        ));
    };
    let inner = Fields {
        map,
        model_type: "gemma3_text",
        nested: Some("text_config"),
        ..*cfg
    };
    import(&inner, name)
}

/// A `gemma2` or `gemma3_text` config (or a `gemma3`'s `text_config`).
pub(super) fn import(cfg: &Fields, name: String) -> Result<ModelConfig> {
    let three = cfg.model_type == "gemma3_text";
    let d = if three { &GEMMA3 } else { &GEMMA2 };
    for key in ["hidden_activation", "hidden_act"] {
        cfg.check_str(key, &["gelu_pytorch_tanh"])?;
    }
    for key in ["attention_bias", "use_bidirectional_attention"] {
        if cfg.opt_bool(key)? == Some(true) {
            return Err(cfg.error(
                key,
                format!(
                    "`{key}` is true, which memfit's gemma family does not model \
                     (no attention biases; causal attention only); set it to false"
                ),
            ));
        }
    }
    let d_model = cfg.int("hidden_size")?;
    let n_head = cfg.opt_int("num_attention_heads")?.unwrap_or(d.n_head);
    let n_layer = cfg.int("num_hidden_layers")?;
    let head_dim = cfg.opt_int("head_dim")?.unwrap_or(d.head_dim);
    let (global, local) = rope_bases(cfg, d.rope_theta)?;
    let gemma = GemmaConfig {
        // Both classes default to 256.
        query_pre_attn_scalar: Some(cfg.opt_f32("query_pre_attn_scalar")?.unwrap_or(256.0)),
        attn_softcap: softcap(cfg, "attn_logit_softcapping", d.attn_softcap)?,
        final_softcap: softcap(cfg, "final_logit_softcapping", d.final_softcap)?,
        sliding_window: match cfg.map.get("sliding_window") {
            Some(Value::Null) => None,
            _ => Some(cfg.opt_int("sliding_window")?.unwrap_or(d.sliding_window)),
        },
        global_every: global_every(cfg, n_layer, d.global_every)?,
        rope_local_theta: three.then_some(local),
    };
    Ok(ModelConfig {
        name,
        family: Family::Gemma,
        vocab_size: cfg.opt_int("vocab_size")?.unwrap_or(d.vocab_size),
        pad_vocab_to: 1,
        max_seq_len: (cfg.opt_int("max_position_embeddings")?).unwrap_or(d.max_seq_len),
        n_layer,
        n_head,
        n_kv_head: Some(cfg.opt_int("num_key_value_heads")?.unwrap_or(d.n_kv_head)),
        d_model,
        d_ff: Some(cfg.int("intermediate_size")?),
        rope_theta: Some(global),
        norm_eps: Some(cfg.opt_f32("rms_norm_eps")?.unwrap_or(1e-6)),
        tie_embeddings: Some(cfg.opt_bool("tie_word_embeddings")?.unwrap_or(true)),
        qkv_bias: None,
        moe: None,
        // Kept only where it differs from the derived width, as for llama.
        head_dim: (head_dim.checked_mul(n_head) != Some(d_model)).then_some(head_dim),
        qk_norm: three.then_some(QkNorm::PerHead),
        gemma: Some(gemma),
    })
}

/// A soft cap: the config's number, `null` for none, absent for the class's default.
fn softcap(cfg: &Fields, key: &str, default: Option<f32>) -> Result<Option<f32>> {
    match cfg.map.get(key) {
        None => Ok(default),
        Some(Value::Null) => Ok(None),
        Some(_) => cfg.opt_f32(key),
    }
}

/// The global and the local RoPE bases: `rope_theta` and Gemma 3's
/// `rope_local_base_freq` (10000), or transformers 5's `rope_parameters`
/// (`full_attention.rope_theta`, `sliding_attention.rope_theta`).
fn rope_bases(cfg: &Fields, global: f32) -> Result<(f32, f32)> {
    let mut bases = (
        cfg.opt_f32("rope_theta")?.unwrap_or(global),
        cfg.opt_f32("rope_local_base_freq")?.unwrap_or(10_000.0),
    );
    if let Some(Value::Object(p)) = cfg.get("rope_parameters") {
        let theta = |kind: &str| p.get(kind).and_then(|v| v.get("rope_theta"));
        for (kind, slot) in [
            ("full_attention", &mut bases.0),
            ("sliding_attention", &mut bases.1),
        ] {
            match theta(kind) {
                None => {}
                Some(v) => match v.as_f64() {
                    Some(x) => *slot = x as f32,
                    None => {
                        return Err(cfg.error(
                            "rope_parameters",
                            format!(
                                "`rope_parameters` {kind}.rope_theta must be a number, got {v}"
                            ),
                        ));
                    }
                },
            }
        }
    }
    Ok(bases)
}

/// Which layers are global: every `n`-th (`sliding_window_pattern`, or
/// Gemma 2's alternation), checked against `layer_types` when the config
/// lists them.
fn global_every(cfg: &Fields, n_layer: usize, default: usize) -> Result<usize> {
    let pattern = match cfg.opt_int("sliding_window_pattern")? {
        Some(p) => Some(p),
        None => cfg.opt_int("_sliding_window_pattern")?,
    };
    let Some(types) = cfg.get("layer_types") else {
        return Ok(pattern.unwrap_or(default));
    };
    let bad = |message: String| cfg.error("layer_types", message);
    let Value::Array(types) = types else {
        return Err(bad(format!("`layer_types` must be a list, got {types}")));
    };
    let mut global = Vec::with_capacity(types.len());
    for t in types {
        global.push(match t.as_str() {
            Some("full_attention") => true,
            Some("sliding_attention") => false,
            _ => {
                return Err(bad(format!(
                    "`layer_types` holds {t}: memfit knows \"full_attention\" and \"sliding_attention\""
                )));
            }
        });
    }
    if global.len() != n_layer {
        return Err(bad(format!(
            "`layer_types` lists {} layers, but `num_hidden_layers` is {n_layer}",
            global.len()
        )));
    }
    // Every n-th layer global; none global is a pattern longer than the model.
    let n = global
        .iter()
        .position(|&g| g)
        .map_or(n_layer + 1, |i| i + 1);
    let fits = global
        .iter()
        .enumerate()
        .all(|(l, &g)| g == (l + 1).is_multiple_of(n));
    if !fits {
        return Err(bad(format!(
            "`layer_types` is not \"every {n}-th layer global\", the only pattern memfit lays out"
        )));
    }
    Ok(n)
}
