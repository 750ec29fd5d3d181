//! Import of a Hugging Face `config.json` as a [`ModelConfig`].
//!
//! Supported `model_type`s: `gpt2` (family gpt2) and `llama`, `mistral`,
//! `qwen2` (family llama; qwen2 with biases on q, k and v), the MoE
//! families, and `gemma2`, `gemma3_text` and `gemma3` (family gemma; of a
//! multimodal `gemma3` config only the text model in its `text_config` is
//! imported, the vision tower left out). Keys memfit has no
//! use for (dropout, token ids, `rope_scaling`, `sliding_window`, ...) are
//! ignored; keys that would change the parameter layout in a way memfit cannot
//! model are errors that name the key. Errors are [`Error::Config`] with
//! `file:line:column` of the offending key where it can be found, like the
//! YAML profiles' errors.

use std::path::Path;

use serde_json::{Map, Value};

use super::model::{Family, ModelConfig, MoeConfig, QkNorm};
use super::profile::strip_marks;
use crate::{Error, Result};

const SUPPORTED: &str = "memfit imports gpt2, llama, mistral, qwen2, phi3, qwen3, mixtral, qwen2_moe, \
     qwen3_moe, olmoe, deepseek (DeepSeek-MoE), gemma2, gemma3_text and gemma3 (its text model) configs";

/// Reads and imports a Hugging Face `config.json`; errors name the file.
pub fn load_hf_config(path: &Path) -> Result<ModelConfig> {
    let text = super::input::read_text(path)?;
    import_hf_config(&text, &path.display().to_string())
}

/// Imports the text of a Hugging Face `config.json`. `location` names the
/// file in errors and, when `_name_or_path` is absent or empty, gives the
/// model its name: the directory of a file named `config.json`, otherwise the
/// file stem.
pub fn import_hf_config(text: &str, location: &str) -> Result<ModelConfig> {
    let text = super::input::strip_bom(text);
    let root: Value = serde_json::from_str(text).map_err(|e| Error::Config {
        location: if e.line() > 0 {
            format!("{location}:{}:{}", e.line(), e.column())
        } else {
            location.to_string()
        },
        message: format!("invalid JSON: {}", strip_marks(&e.to_string())),
    })?;
    let Value::Object(map) = &root else {
        return Err(Error::Config {
            location: location.to_string(),
            message: "a Hugging Face config.json is a JSON object `{...}`".into(),
        });
    };
    let cfg = Fields {
        map,
        text,
        location,
        model_type: "",
        nested: None,
    };
    let model_type = match map.get("model_type") {
        None | Some(Value::Null) => {
            return Err(cfg.error(
                "model_type",
                format!("`model_type` is missing; {SUPPORTED}"),
            ));
        }
        Some(Value::String(s)) => s.as_str(),
        Some(other) => {
            return Err(cfg.error(
                "model_type",
                format!("`model_type` must be a string, got {other}; {SUPPORTED}"),
            ));
        }
    };
    let cfg = Fields { model_type, ..cfg };
    let name = match map.get("_name_or_path") {
        Some(Value::String(s)) if !s.trim().is_empty() => s.trim().to_string(),
        _ => name_from_location(location),
    };
    let config = match model_type {
        "gpt2" => import_gpt2(&cfg, name)?,
        "llama" | "mistral" | "qwen2" | "phi3" | "mixtral" | "qwen3" | "qwen2_moe"
        | "qwen3_moe" | "olmoe" | "deepseek" => import_llama(&cfg, name)?,
        "deepseek_v2" | "deepseek_v3" => {
            return Err(cfg.error(
                "model_type",
                format!(
                    "`model_type` {model_type:?} uses multi-head latent attention, which \
                     memfit's engine does not model; {SUPPORTED}"
                ),
            ));
        }
        "gemma2" | "gemma3_text" => super::gemma::import(&cfg, name)?,
        "gemma3" => super::gemma::import_text_config(&cfg, name)?,
        "gemma" => {
            return Err(cfg.error(
                "model_type",
                format!(
                    "`model_type` \"gemma\" is Gemma 1, whose blocks have two norms where \
                     Gemma 2 and 3 have four; memfit's gemma family lays out Gemma 2 and 3 only; \
                     {SUPPORTED}"
                ),
            ));
        }
        other => {
            return Err(cfg.error(
                "model_type",
                format!("`model_type` {other:?} is not supported; {SUPPORTED}"),
            ));
        }
    };
    if let Err(message) = config.validate() {
        let message = hf_field_names(&message, model_type);
        let key = message
            .split('`')
            .skip(1)
            .step_by(2)
            .find(|k| map.contains_key(*k))
            .unwrap_or("")
            .to_string();
        return Err(cfg.error(&key, message));
    }
    Ok(config)
}

fn import_gpt2(cfg: &Fields, name: String) -> Result<ModelConfig> {
    for key in ["activation_function", "hidden_act"] {
        cfg.check_str(key, &["gelu_new", "gelu_pytorch_tanh", "gelu"])?;
    }
    if cfg.opt_bool("tie_word_embeddings")? == Some(false) {
        return Err(cfg.error(
            "tie_word_embeddings",
            "`tie_word_embeddings` is false, but memfit's gpt2 always ties its head to the \
             token embedding"
                .into(),
        ));
    }
    let d_model = cfg.int("n_embd")?;
    Ok(ModelConfig {
        name,
        family: Family::Gpt2,
        vocab_size: cfg.int("vocab_size")?,
        pad_vocab_to: 1,
        max_seq_len: cfg.int("n_positions")?,
        n_layer: cfg.int("n_layer")?,
        n_head: cfg.int("n_head")?,
        n_kv_head: None,
        d_model,
        d_ff: Some(cfg.opt_int("n_inner")?.unwrap_or(4 * d_model)),
        rope_theta: None,
        norm_eps: Some(cfg.opt_f32("layer_norm_epsilon")?.unwrap_or(1e-5)),
        tie_embeddings: Some(true),
        qkv_bias: None,
        moe: None,
        head_dim: None,
        qk_norm: None,
        gemma: None,
    })
}

pub(super) fn import_llama(cfg: &Fields, name: String) -> Result<ModelConfig> {
    cfg.check_str("hidden_act", &["silu", "swish"])?;
    let qwen2 = matches!(cfg.model_type, "qwen2" | "qwen2_moe");
    if !qwen2 {
        // Qwen2 hard-wires its biases (q, k, v: yes; o: no) and has no such keys.
        if cfg.opt_bool("attention_bias")? == Some(true) {
            return Err(cfg.error(
                "attention_bias",
                "`attention_bias` is true, which puts biases on the q, k, v and o projections; \
                 memfit's llama family can have biases on q, k and v only (as qwen2 does)"
                    .into(),
            ));
        }
        if cfg.opt_bool("mlp_bias")? == Some(true) {
            return Err(cfg.error(
                "mlp_bias",
                "`mlp_bias` is true; memfit's llama family has no MLP biases".into(),
            ));
        }
    }
    if cfg.model_type == "phi3" {
        // Phi-3 is Llama with its q|k|v and gate|up projections stored
        // fused, as memfit stores every Llama's (transformers'
        // modeling_phi3.py: qkv_proj, gate_up_proj). Phi-3.5/Phi-4-mini's
        // partial rotary embedding is not memfit's.
        if let Some(f) = cfg.opt_f32("partial_rotary_factor")?
            && f != 1.0
        {
            return Err(cfg.error(
                "partial_rotary_factor",
                format!(
                    "`partial_rotary_factor` is {f}: rotary embedding on part of each head,                      which memfit's engine does not model (it rotates whole heads)"
                ),
            ));
        }
        for key in ["resid_pdrop", "embd_pdrop"] {
            if let Some(p) = cfg.opt_f32(key)?
                && p != 0.0
            {
                return Err(cfg.error(
                    key,
                    format!(
                        "`{key}` is {p}: Phi-3's residual and embedding dropout, whose                          masks hf-eager does not model for this family; set it to 0.0"
                    ),
                ));
            }
        }
    }
    let d_model = cfg.int("hidden_size")?;
    let n_head = cfg.int("num_attention_heads")?;
    // An explicit head width is kept only where it differs from the
    // derived one (Qwen3's 128 at every size).
    let head_dim = cfg
        .opt_int("head_dim")?
        .filter(|&hd| n_head == 0 || hd.checked_mul(n_head) != Some(d_model));
    let qk_norm = match cfg.model_type {
        "qwen3" | "qwen3_moe" => Some(QkNorm::PerHead),
        "olmoe" => Some(QkNorm::Full),
        _ => None,
    };
    if cfg.model_type == "olmoe"
        && let Some(v) = cfg.get("clip_qkv")
        && !v.is_null()
    {
        return Err(cfg.error(
            "clip_qkv",
            format!("`clip_qkv` is {v}: OLMoE's clamped q, k and v, which memfit's engine does not model; set it to null"),
        ));
    }
    Ok(ModelConfig {
        name,
        family: Family::Llama,
        vocab_size: cfg.int("vocab_size")?,
        pad_vocab_to: 1,
        max_seq_len: cfg.int("max_position_embeddings")?,
        n_layer: cfg.int("num_hidden_layers")?,
        n_head,
        n_kv_head: Some(cfg.opt_int("num_key_value_heads")?.unwrap_or(n_head)),
        d_model,
        d_ff: Some(cfg.int("intermediate_size")?),
        rope_theta: Some(cfg.opt_f32("rope_theta")?.unwrap_or(10_000.0)),
        norm_eps: Some(cfg.opt_f32("rms_norm_eps")?.unwrap_or(1e-6)),
        tie_embeddings: Some(cfg.opt_bool("tie_word_embeddings")?.unwrap_or(false)),
        qkv_bias: qwen2.then_some(true),
        moe: match cfg.model_type {
            "mixtral" => Some(import_mixtral_experts(cfg)?),
            "qwen2_moe" | "qwen3_moe" | "olmoe" => Some(import_qwen_experts(cfg)?),
            "deepseek" => Some(import_deepseek_experts(cfg)?),
            _ => None,
        },
        head_dim,
        qk_norm,
        gemma: None,
    })
}

/// Qwen2-MoE's, Qwen3-MoE's and OLMoE's sparse MLP (transformers'
/// `Qwen2MoeSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`,
/// `OlmoeSparseMoeBlock`): `num_experts` SwiGLU experts of width
/// `moe_intermediate_size` (OLMoE: `intermediate_size`),
/// `num_experts_per_tok` per token, renormalised when `norm_topk_prob`;
/// Qwen2-MoE adds a shared expert of `shared_expert_intermediate_size`
/// under a sigmoid gate.
fn import_qwen_experts(cfg: &Fields) -> Result<MoeConfig> {
    let olmoe = cfg.model_type == "olmoe";
    if !olmoe {
        // Dense blocks among the routed ones: memfit's dense blocks are
        // the first ones only (`first_dense`).
        if let Some(step) = cfg.opt_int("decoder_sparse_step")?
            && step != 1
        {
            return Err(cfg.error(
                "decoder_sparse_step",
                format!("`decoder_sparse_step` is {step}: dense blocks between routed ones, which memfit does not lay out (every block routes)"),
            ));
        }
        if let Some(Value::Array(v)) = cfg.get("mlp_only_layers")
            && !v.is_empty()
        {
            return Err(cfg.error(
                "mlp_only_layers",
                "`mlp_only_layers` is not empty: dense blocks among routed ones, which memfit does not lay out (every block routes)".into(),
            ));
        }
    }
    let width = if olmoe {
        "intermediate_size"
    } else {
        "moe_intermediate_size"
    };
    let qwen2 = cfg.model_type == "qwen2_moe";
    Ok(MoeConfig {
        n_experts: cfg.int("num_experts")?,
        top_k: cfg.int("num_experts_per_tok")?,
        d_expert: cfg.int(width)?,
        d_shared: match qwen2 {
            true => cfg.int("shared_expert_intermediate_size")?,
            false => 0,
        },
        shared_gate: qwen2,
        first_dense: 0,
        norm_topk: cfg.opt_bool("norm_topk_prob")?.unwrap_or(false),
        // Their configs' defaults.
        aux_loss_coef: (cfg.opt_f32("router_aux_loss_coef")?).unwrap_or(if olmoe {
            0.01
        } else {
            0.001
        }),
    })
}

/// DeepSeek-MoE's (`model_type` "deepseek", its own modelling code):
/// `n_routed_experts` fine-grained experts of `moe_intermediate_size`,
/// `num_experts_per_tok` per token by softmax, beside `n_shared_experts`
/// always-on experts (one MLP of their summed width, as its code fuses
/// them), the first `first_k_dense_replace` blocks dense.
fn import_deepseek_experts(cfg: &Fields) -> Result<MoeConfig> {
    if let Some(freq) = cfg.opt_int("moe_layer_freq")?
        && freq != 1
    {
        return Err(cfg.error(
            "moe_layer_freq",
            format!("`moe_layer_freq` is {freq}: dense blocks between routed ones, which memfit does not lay out (every block after the first dense ones routes)"),
        ));
    }
    if let Some(Value::String(f)) = cfg.get("scoring_func")
        && f != "softmax"
    {
        return Err(cfg.error(
            "scoring_func",
            format!("`scoring_func` is {f:?}: memfit's router scores by softmax"),
        ));
    }
    let width = cfg.int("moe_intermediate_size")?;
    Ok(MoeConfig {
        n_experts: cfg.int("n_routed_experts")?,
        top_k: cfg.int("num_experts_per_tok")?,
        d_expert: width,
        d_shared: cfg.opt_int("n_shared_experts")?.unwrap_or(0) * width,
        shared_gate: false,
        first_dense: cfg.opt_int("first_k_dense_replace")?.unwrap_or(0),
        norm_topk: cfg.opt_bool("norm_topk_prob")?.unwrap_or(false),
        // DeepseekConfig's `aux_loss_alpha`.
        aux_loss_coef: cfg.opt_f32("aux_loss_alpha")?.unwrap_or(0.001),
    })
}

/// Mixtral's sparse MLP (transformers' `MixtralSparseMoeBlock`): every
/// block routes each token to `num_experts_per_tok` of
/// `num_local_experts` SwiGLU experts of width `intermediate_size`, the
/// chosen experts' softmax weights renormalised, no shared expert.
fn import_mixtral_experts(cfg: &Fields) -> Result<MoeConfig> {
    Ok(MoeConfig {
        n_experts: cfg.int("num_local_experts")?,
        top_k: cfg.int("num_experts_per_tok")?,
        d_expert: cfg.int("intermediate_size")?,
        d_shared: 0,
        shared_gate: false,
        first_dense: 0,
        norm_topk: true,
        // MixtralConfig's default.
        aux_loss_coef: cfg.opt_f32("router_aux_loss_coef")?.unwrap_or(0.001),
    })
}

/// The model name when `_name_or_path` gives none: the directory holding a
/// `config.json`, else the file stem.
fn name_from_location(location: &str) -> String {
    let path = Path::new(location);
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    let dir = path
        .parent()
        .and_then(|p| p.file_name())
        .and_then(|s| s.to_str())
        .unwrap_or("");
    if stem == "config" && !dir.is_empty() {
        dir.to_string()
    } else if !stem.is_empty() {
        stem.to_string()
    } else {
        location.to_string()
    }
}

/// Renames memfit's field names in a `validate()` message to the config's keys.
fn hf_field_names(message: &str, model_type: &str) -> String {
    let names: &[(&str, &str)] = if model_type == "gpt2" {
        &[
            ("max_seq_len", "n_positions"),
            ("d_model", "n_embd"),
            ("d_ff", "n_inner"),
            ("norm_eps", "layer_norm_epsilon"),
        ]
    } else {
        &[
            ("max_seq_len", "max_position_embeddings"),
            ("n_layer", "num_hidden_layers"),
            ("n_head", "num_attention_heads"),
            ("n_kv_head", "num_key_value_heads"),
            ("d_model", "hidden_size"),
            ("d_ff", "intermediate_size"),
            ("norm_eps", "rms_norm_eps"),
        ]
    };
    let mut parts: Vec<String> = message.split('`').map(str::to_string).collect();
    for part in parts.iter_mut().skip(1).step_by(2) {
        if let Some((_, hf)) = names.iter().find(|(ours, _)| ours == part) {
            *part = hf.to_string();
        }
    }
    parts.join("`")
}

/// The config's top-level keys (or a nested `text_config`'s), with what
/// errors need to say where they are.
pub(super) struct Fields<'a> {
    pub(super) map: &'a Map<String, Value>,
    pub(super) text: &'a str,
    pub(super) location: &'a str,
    pub(super) model_type: &'a str,
    /// The object the keys are in (`text_config`), when not the top level:
    /// errors then name the file and `text_config.key`.
    pub(super) nested: Option<&'a str>,
}

impl Fields<'_> {
    /// An error at `key`'s line and column when it is a top-level key of the
    /// text; a nested key is named with its object.
    pub(super) fn error(&self, key: &str, message: String) -> Error {
        if let Some(outer) = self.nested {
            let message = message.replacen(&format!("`{key}`"), &format!("`{outer}.{key}`"), 1);
            let location = match top_level_key_position(self.text, outer) {
                Some((line, column)) => format!("{}:{line}:{column}", self.location),
                None => self.location.to_string(),
            };
            return Error::Config { location, message };
        }
        let location = match top_level_key_position(self.text, key) {
            Some((line, column)) => format!("{}:{line}:{column}", self.location),
            None => self.location.to_string(),
        };
        Error::Config { location, message }
    }

    pub(super) fn get(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    pub(super) fn int(&self, key: &str) -> Result<usize> {
        match self.map.get(key) {
            None => Err(self.error(
                key,
                format!(
                    "`{key}` is missing; a {} config.json needs it",
                    self.model_type
                ),
            )),
            Some(Value::Null) => Err(self.error(
                key,
                format!(
                    "`{key}` is null; a {} config.json needs a non-negative integer",
                    self.model_type
                ),
            )),
            Some(_) => Ok(self.opt_int(key)?.expect("present")),
        }
    }

    pub(super) fn opt_int(&self, key: &str) -> Result<Option<usize>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        match v.as_u64() {
            Some(n) if n <= u64::from(u32::MAX) => Ok(Some(n as usize)),
            Some(n) => Err(self.error(
                key,
                format!("`{key}` is {n}, beyond any model memfit can plan"),
            )),
            None => Err(self.error(
                key,
                format!("`{key}` must be a non-negative integer, got {v}"),
            )),
        }
    }

    pub(super) fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        match v.as_f64() {
            Some(x) => Ok(Some(x as f32)),
            None => Err(self.error(key, format!("`{key}` must be a number, got {v}"))),
        }
    }

    pub(super) fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        match v.as_bool() {
            Some(b) => Ok(Some(b)),
            None => Err(self.error(key, format!("`{key}` must be true or false, got {v}"))),
        }
    }

    /// If `key` is present, its value must be one of `allowed`.
    pub(super) fn check_str(&self, key: &str, allowed: &[&str]) -> Result<()> {
        let Some(v) = self.get(key) else {
            return Ok(());
        };
        if v.as_str().is_some_and(|s| allowed.contains(&s)) {
            return Ok(());
        }
        let list = allowed
            .iter()
            .map(|a| format!("{a:?}"))
            .collect::<Vec<_>>()
            .join(", ");
        Err(self.error(
            key,
            format!(
                "`{key}` is {v}, but memfit's {} models use {list}",
                self.model_type
            ),
        ))
    }
}

/// 1-based `(line, column)` of the opening quote of `key` as a key of the
/// top-level object in a JSON text (nested objects' keys do not count).
fn top_level_key_position(text: &str, key: &str) -> Option<(usize, usize)> {
    if key.is_empty() {
        return None;
    }
    let bytes = text.as_bytes();
    let (mut depth, mut i) = (0usize, 0usize);
    // A string that just closed in the top-level object: `(start, end)` of its quotes.
    let mut pending: Option<(usize, usize)> = None;
    while i < bytes.len() {
        let b = bytes[i];
        if b.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        if b == b':'
            && let Some((start, end)) = pending
            && serde_json::from_str::<String>(&text[start..=end])
                .ok()
                .as_deref()
                == Some(key)
        {
            let before = &text[..start];
            let line = before.matches('\n').count() + 1;
            let line_start = before.rfind('\n').map_or(0, |n| n + 1);
            let column = text[line_start..start].chars().count() + 1;
            return Some((line, column));
        }
        pending = None;
        match b {
            b'"' => {
                let start = i;
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                if i >= bytes.len() {
                    return None;
                }
                if depth == 1 {
                    pending = Some((start, i));
                }
            }
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_position_only_counts_top_level_keys() {
        let text = "{\n  \"a\": {\"factor\": 1},\n  \"factor\" : 2,\n  \"s\": \"factor\"\n}";
        assert_eq!(top_level_key_position(text, "factor"), Some((3, 3)));
        assert_eq!(top_level_key_position(text, "a"), Some((2, 3)));
        assert_eq!(top_level_key_position(text, "s"), Some((4, 3)));
        assert_eq!(top_level_key_position(text, "missing"), None);
        let escaped = r#"{"x\"y": 1, "b": "a\\", "c": 2}"#;
        assert_eq!(top_level_key_position(escaped, "c"), Some((1, 25)));
        assert_eq!(top_level_key_position(escaped, "x\"y"), Some((1, 2)));
    }

    #[test]
    fn name_comes_from_the_directory_of_config_json() {
        assert_eq!(
            name_from_location("models/Qwen2-0.5B/config.json"),
            "Qwen2-0.5B"
        );
        assert_eq!(name_from_location("config.json"), "config");
        assert_eq!(name_from_location("x/qwen2-0.5b.json"), "qwen2-0.5b");
        let text = r#"{"_name_or_path": "Qwen/Qwen2-0.5B", "model_type": "qwen2",
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 128, "vocab_size": 256}"#;
        let m = import_hf_config(text, "a/config.json").unwrap();
        assert_eq!(m.name, "Qwen/Qwen2-0.5B");
        assert_eq!(m.qkv_bias, Some(true));
        assert_eq!(m.norm_eps, Some(1e-6));
        assert_eq!(m.rope_theta, Some(10_000.0));
        assert!(!m.tied());
    }

    #[test]
    fn validate_errors_use_the_config_keys() {
        let text = "{\n\"model_type\": \"llama\",\n\"hidden_size\": 100,\n\
                    \"intermediate_size\": 128,\n\"num_hidden_layers\": 2,\n\
                    \"num_attention_heads\": 3,\n\"max_position_embeddings\": 128,\n\
                    \"vocab_size\": 256\n}";
        let msg = import_hf_config(text, "c.json").unwrap_err().to_string();
        assert!(msg.starts_with("c.json:3:1: "), "{msg}");
        assert!(
            msg.contains("`hidden_size` (100) must be divisible by `num_attention_heads` (3)"),
            "{msg}"
        );
    }

    #[test]
    fn value_errors_name_the_field() {
        let base = r#"{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
            "n_positions": 128, "vocab_size": 256}"#;
        import_hf_config(base, "g.json").unwrap();
        for (from, to, want) in [
            (
                "\"n_layer\": 2",
                "\"n_layer\": -2",
                "`n_layer` must be a non-negative integer, got -2",
            ),
            (
                "\"n_layer\": 2",
                "\"n_layer\": 2.5",
                "`n_layer` must be a non-negative integer, got 2.5",
            ),
            (
                "\"n_layer\": 2",
                "\"n_layer\": \"2\"",
                "`n_layer` must be a non-negative integer",
            ),
            (
                "\"n_layer\": 2",
                "\"n_layer\": null",
                "`n_layer` is null; a gpt2 config.json",
            ),
            (
                "\"n_layer\": 2",
                "\"n_layer\": 0",
                "`n_layer` must be positive",
            ),
            (
                "\"n_layer\": 2",
                "\"n_layer\": 2, \"activation_function\": \"relu\"",
                "`activation_function` is \"relu\"",
            ),
            (
                "\"n_layer\": 2",
                "\"n_layer\": 2, \"tie_word_embeddings\": false",
                "`tie_word_embeddings` is false",
            ),
            (
                "\"n_embd\": 64",
                "\"n_embd\": 99999999999",
                "`n_embd` is 99999999999, beyond",
            ),
        ] {
            let text = base.replace(from, to);
            let msg = import_hf_config(&text, "g.json").unwrap_err().to_string();
            assert!(msg.starts_with("g.json:1:"), "{msg}");
            assert!(msg.contains(want), "{msg}\nlacks {want}");
        }
        let msg = import_hf_config("[1]", "g.json").unwrap_err().to_string();
        assert!(msg.contains("JSON object"), "{msg}");
        let msg = import_hf_config("{}", "g.json").unwrap_err().to_string();
        assert!(msg.contains("`model_type` is missing"), "{msg}");
    }

    #[test]
    fn llama_biases_other_than_qwen2s_are_rejected() {
        let base = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 128, "vocab_size": 256, "attention_bias": false,
            "mlp_bias": false, "hidden_act": "silu"}"#;
        let m = import_hf_config(base, "l.json").unwrap();
        assert_eq!((m.n_kv_head(), m.qkv_bias), (4, None));
        for key in ["attention_bias", "mlp_bias"] {
            let text = base.replace(&format!("\"{key}\": false"), &format!("\"{key}\": true"));
            let msg = import_hf_config(&text, "l.json").unwrap_err().to_string();
            assert!(msg.contains(&format!("`{key}` is true")), "{msg}");
        }
        let text = base.replace("\"silu\"", "\"gelu\"");
        let msg = import_hf_config(&text, "l.json").unwrap_err().to_string();
        assert!(msg.contains("`hidden_act` is \"gelu\""), "{msg}");
    }
}
