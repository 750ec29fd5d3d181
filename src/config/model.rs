//! Model configuration: one struct for both families, and the parameter layout
//! computed from it in one place (llm.c's `fill_in_parameter_sizes`).

use serde::{Deserialize, Serialize};

/// The architectures the engine implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// LayerNorm with bias, tanh-GELU MLP (4x), learned positions, biases, tied head.
    Gpt2,
    /// RMSNorm, SwiGLU MLP, RoPE, grouped-query attention, no biases
    /// (Qwen2: biases on q, k and v, see `ModelConfig::qkv_bias`).
    Llama,
    /// Gemma 2 and 3 (text): llama's block with RMSNorms of weight `1 + w`
    /// around both sublayers ("sandwich" norms), a GeGLU MLP, the embedding
    /// scaled by √C and tied to the head, and what [`GemmaConfig`] adds.
    Gemma,
}

/// A model profile (profiles/models/*.yaml).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub name: String,
    pub family: Family,
    /// Vocabulary size as published (before padding).
    pub vocab_size: usize,
    /// The embedding and head are padded to a multiple of this (gpt2: 64, as llm.c does).
    #[serde(default = "one")]
    pub pad_vocab_to: usize,
    /// Maximum sequence length (gpt2: learned position table size).
    pub max_seq_len: usize,
    pub n_layer: usize,
    pub n_head: usize,
    /// Key/value heads; fewer than `n_head` means grouped-query attention.
    #[serde(default)]
    pub n_kv_head: Option<usize>,
    /// Hidden size C.
    pub d_model: usize,
    /// MLP inner size (gpt2: 4C; llama: its own intermediate_size).
    #[serde(default)]
    pub d_ff: Option<usize>,
    /// RoPE base (llama only).
    #[serde(default)]
    pub rope_theta: Option<f32>,
    /// Norm epsilon.
    #[serde(default)]
    pub norm_eps: Option<f32>,
    /// Output head shares the token embedding (gpt2: always; llama-3.2-1b: yes).
    #[serde(default)]
    pub tie_embeddings: Option<bool>,
    /// Biases on the q, k and v projections (llama only; Qwen2 has them).
    /// Absent means none; gpt2 always has all its biases.
    #[serde(default)]
    pub qkv_bias: Option<bool>,
    /// Mixture-of-experts MLPs (llama family only); absent means dense.
    #[serde(default)]
    pub moe: Option<MoeConfig>,
    /// Each head's width where it is not `d_model / n_head` (Qwen3:
    /// 128 at every size; llama family only).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// RMSNorm on q and k before RoPE (llama family only).
    #[serde(default)]
    pub qk_norm: Option<QkNorm>,
    /// What Gemma 2 and 3 set apart (family gemma only; absent means
    /// `GemmaConfig::default()`).
    #[serde(default)]
    pub gemma: Option<GemmaConfig>,
}

/// Gemma 2's and 3's attention and head (transformers'
/// `modeling_gemma2.py`, `modeling_gemma3.py`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GemmaConfig {
    /// The scores are scaled by `query_pre_attn_scalar ** -0.5` (not
    /// `head_dim ** -0.5`); absent means `head_dim`.
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f32>,
    /// Attention logits soft-capped, `cap · tanh(s / cap)`, before the mask
    /// and the softmax (Gemma 2: 50; Gemma 3: none).
    #[serde(default)]
    pub attn_softcap: Option<f32>,
    /// The head's logits soft-capped before the loss (Gemma 2: 30; Gemma 3: none).
    #[serde(default)]
    pub final_softcap: Option<f32>,
    /// Keys a sliding layer's query sees, itself included (`sliding_window`:
    /// Gemma 2: 4096; Gemma 3: 512 at 1B, 1024 above); absent: every layer global.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Every `global_every`-th layer attends globally, the others slide
    /// (Gemma 2: 2, so the even layers slide; Gemma 3: 6,
    /// `sliding_window_pattern`).
    #[serde(default = "two")]
    pub global_every: usize,
    /// The RoPE base of the sliding layers (Gemma 3's
    /// `rope_local_base_freq`, 10000); absent: `rope_theta` everywhere.
    #[serde(default)]
    pub rope_local_theta: Option<f32>,
}

fn two() -> usize {
    2
}

impl Default for GemmaConfig {
    fn default() -> Self {
        GemmaConfig {
            query_pre_attn_scalar: None,
            attn_softcap: None,
            final_softcap: None,
            sliding_window: None,
            global_every: 2,
            rope_local_theta: None,
        }
    }
}

/// Where a model normalises its queries and keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum QkNorm {
    /// Each head on its own, one weight of `head_dim` shared by the heads
    /// (Qwen3's `q_norm`, `k_norm`).
    PerHead,
    /// The whole q and the whole k of a token, weights of `n_head x
    /// head_dim` and `n_kv_head x head_dim` (OLMo 2 and OLMoE).
    Full,
}

/// A mixture-of-experts MLP in place of the dense one: a router over
/// `n_experts` SwiGLU experts of width `d_expert`, each token sent to its
/// `top_k` highest-scoring experts (Mixtral, Qwen3-MoE, OLMoE; Megatron-Core's
/// `MoELayer`), plus an optional always-on shared expert (DeepSeek-MoE).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeConfig {
    pub n_experts: usize,
    pub top_k: usize,
    /// Each expert's inner width (HF `moe_intermediate_size`; Mixtral's
    /// `intermediate_size`).
    pub d_expert: usize,
    /// The shared expert's inner width (DeepSeek: `n_shared_experts x
    /// moe_intermediate_size`, fused into one MLP); 0 means none.
    #[serde(default)]
    pub d_shared: usize,
    /// The shared expert's output scaled per token by `σ(x gᵀ)`, a
    /// learned gate `(1, C)` (Qwen2-MoE's `shared_expert_gate`).
    #[serde(default)]
    pub shared_gate: bool,
    /// The first layers stay dense (DeepSeek's `first_k_dense_replace`):
    /// their MLP has width `d_ff`.
    #[serde(default)]
    pub first_dense: usize,
    /// The top-k weights renormalised to sum to 1 (Mixtral: yes, its softmax
    /// over the chosen logits is the same; Qwen3-MoE: `norm_topk_prob`;
    /// OLMoE: no).
    #[serde(default)]
    pub norm_topk: bool,
    /// Weight of the load-balancing loss (Switch Transformer's, as
    /// transformers' `load_balancing_loss_func` computes it;
    /// `router_aux_loss_coef`).
    #[serde(default = "aux_coef")]
    pub aux_loss_coef: f32,
}

fn aux_coef() -> f32 {
    0.01
}

impl MoeConfig {
    /// Whether block `l` has experts.
    pub fn routed(&self, l: usize) -> bool {
        l >= self.first_dense
    }
}

fn one() -> usize {
    1
}

/// Gemma's settings are positive numbers where set.
fn validate_gemma(g: &GemmaConfig) -> Result<(), String> {
    for (field, v) in [
        ("gemma.query_pre_attn_scalar", g.query_pre_attn_scalar),
        ("gemma.attn_softcap", g.attn_softcap),
        ("gemma.final_softcap", g.final_softcap),
        ("gemma.rope_local_theta", g.rope_local_theta),
    ] {
        if let Some(v) = v
            && !(v.is_finite() && v > 0.0)
        {
            return Err(format!("`{field}` must be a positive number, got {v}"));
        }
    }
    if g.sliding_window == Some(0) {
        return Err("`gemma.sliding_window` must be positive".into());
    }
    if g.global_every == 0 {
        return Err("`gemma.global_every` must be positive (1: every layer global)".into());
    }
    Ok(())
}

/// Limits on a model's dimensions (`ModelConfig::validate`): several times
/// the largest published model's.
pub const MAX_LAYERS: usize = 1024;
/// Hidden and MLP widths (the largest published: about 20k and 74k).
pub const MAX_WIDTH: usize = 1 << 20;
/// Vocabulary (the largest published: about 256k).
pub const MAX_VOCAB: usize = 1 << 24;
/// Routed experts per block (the most published: 384).
pub const MAX_EXPERTS: usize = 4096;
/// Context length (the longest published: 10M).
pub const MAX_SEQ_LEN: usize = 1 << 26;

/// How one parameter tensor is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Normal with this standard deviation.
    Normal(f32),
    Zeros,
    Ones,
}

/// One parameter tensor: its name (HF-like), shape, and initialisation.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    pub name: ParamName,
    pub shape: Vec<usize>,
    pub init: Init,
}

/// A parameter's name as Hugging Face-like checkpoints spell it, kept in
/// parts and spelled out only when shown: a plan builds the layout of every
/// point, and formatting ~500 names each was a twentieth of its time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParamName {
    /// The block it belongs to (`h.{layer}.`), if any.
    pub layer: Option<usize>,
    pub part: &'static str,
    /// A suffix after the part (LoRA's `.lora_A`), or empty.
    pub suffix: &'static str,
}

impl ParamName {
    pub const fn top(part: &'static str) -> Self {
        ParamName {
            layer: None,
            part,
            suffix: "",
        }
    }
}

impl std::fmt::Display for ParamName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(l) = self.layer {
            write!(f, "h.{l}.")?;
        }
        write!(f, "{}{}", self.part, self.suffix)
    }
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Indices into the flat parameter list for one transformer block.
/// `None` marks a tensor this family does not have (biases on llama).
#[derive(Clone, Debug, Default)]
pub struct BlockIndex {
    pub ln1_w: usize,
    pub ln1_b: Option<usize>,
    /// Fused q|k|v projection, `(qkv_width, C)`.
    pub qkv_w: usize,
    pub qkv_b: Option<usize>,
    /// The q and k norms' weights (`ModelConfig::qk_norm`).
    pub q_norm: Option<usize>,
    pub k_norm: Option<usize>,
    pub o_w: usize,
    pub o_b: Option<usize>,
    /// Gemma's norm of the attention's output before the residual add
    /// (`post_attention_layernorm`).
    pub post_attn_norm: Option<usize>,
    /// The MLP's input norm (Gemma: `pre_feedforward_layernorm`).
    pub ln2_w: usize,
    pub ln2_b: Option<usize>,
    /// gpt2: fc `(4C, C)`; llama: fused gate|up `(2I, C)`. In a block
    /// with experts, the shared expert's (`MoeConfig::d_shared`), if any.
    pub up_w: Option<usize>,
    pub up_b: Option<usize>,
    pub down_w: Option<usize>,
    pub down_b: Option<usize>,
    /// Gemma's norm of the MLP's output before the residual add
    /// (`post_feedforward_layernorm`).
    pub post_mlp_norm: Option<usize>,
    /// A block with experts: the router and the stacked experts.
    pub moe: Option<MoeIndex>,
}

/// A block's routed experts: the router `(E, C)`, every expert's fused
/// gate|up stacked `(E, 2I, C)` and down stacked `(E, C, I)` (Megatron's
/// `GroupedMLP` holds them as one tensor each, as here).
#[derive(Clone, Copy, Debug, Default)]
pub struct MoeIndex {
    pub router: usize,
    /// The shared expert's gate `(1, C)` (`MoeConfig::shared_gate`).
    pub shared_gate: Option<usize>,
    pub up: usize,
    pub down: usize,
}

impl BlockIndex {
    /// The block's dense projection weights, q|k|v, o, up and down (a
    /// routed block's shared expert's, if any): what tensor parallelism
    /// splits.
    pub fn projections(&self) -> impl Iterator<Item = usize> + '_ {
        [Some(self.qkv_w), Some(self.o_w), self.up_w, self.down_w]
            .into_iter()
            .flatten()
    }

    /// The routed experts' stacked weights, gate|up `(E, 2I, C)` and down
    /// `(E, C, I)` (none in a dense block).
    pub fn experts(&self) -> impl Iterator<Item = usize> + '_ {
        self.moe.map(|m| [m.up, m.down]).into_iter().flatten()
    }

    /// What QLoRA stores in NF4: the projections and the routed experts'
    /// stacks, each quantised whole in 64-value blocks (the router, the
    /// shared expert's gate, norms and biases stay in the working dtype).
    pub fn nf4(&self) -> impl Iterator<Item = usize> + '_ {
        self.projections().chain(self.experts())
    }

    /// Every tensor of the block, in layout order.
    pub fn tensors(&self) -> impl Iterator<Item = usize> + '_ {
        let moe = self
            .moe
            .map(|m| [Some(m.router), m.shared_gate, Some(m.up), Some(m.down)]);
        [
            Some(self.ln1_w),
            self.ln1_b,
            Some(self.qkv_w),
            self.qkv_b,
            self.q_norm,
            self.k_norm,
            Some(self.o_w),
            self.o_b,
            self.post_attn_norm,
            Some(self.ln2_w),
            self.ln2_b,
        ]
        .into_iter()
        .chain(moe.into_iter().flatten())
        .chain([self.up_w, self.up_b, self.down_w, self.down_b])
        .chain([self.post_mlp_norm])
        .flatten()
    }
}

/// Where each parameter lives in the flat list.
#[derive(Clone, Debug, Default)]
pub struct ParamIndex {
    pub wte: usize,
    pub wpe: Option<usize>,
    pub blocks: Vec<BlockIndex>,
    pub lnf_w: usize,
    pub lnf_b: Option<usize>,
    /// `None` when the head is tied to `wte`.
    pub lm_head: Option<usize>,
}

impl ModelConfig {
    pub fn n_kv_head(&self) -> usize {
        self.n_kv_head.unwrap_or(self.n_head)
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.n_head)
    }
    /// The attention output's width, the o projection's input: `n_head x head_dim`.
    pub fn attn_width(&self) -> usize {
        self.n_head * self.head_dim()
    }
    /// The q norm's and the k norm's widths (rows of `qkv` are normalised
    /// in pieces this wide).
    pub fn qk_norm_widths(&self) -> Option<(usize, usize)> {
        let hd = self.head_dim();
        self.qk_norm.map(|q| match q {
            QkNorm::PerHead => (hd, hd),
            QkNorm::Full => (self.n_head * hd, self.n_kv_head() * hd),
        })
    }
    pub fn d_ff(&self) -> usize {
        self.d_ff.unwrap_or(4 * self.d_model)
    }
    pub fn padded_vocab(&self) -> usize {
        self.vocab_size.div_ceil(self.pad_vocab_to) * self.pad_vocab_to
    }
    pub fn tied(&self) -> bool {
        self.tie_embeddings.unwrap_or(self.family != Family::Llama)
    }
    pub fn norm_eps(&self) -> f32 {
        self.norm_eps.unwrap_or(match self.family {
            Family::Gpt2 => 1e-5,
            Family::Llama => 1e-5,
            Family::Gemma => 1e-6,
        })
    }

    /// Gemma's attention and head settings (family gemma only).
    pub fn gemma(&self) -> Option<&GemmaConfig> {
        const DEFAULT: GemmaConfig = GemmaConfig {
            query_pre_attn_scalar: None,
            attn_softcap: None,
            final_softcap: None,
            sliding_window: None,
            global_every: 2,
            rope_local_theta: None,
        };
        match self.family {
            Family::Gemma => Some(self.gemma.as_ref().unwrap_or(&DEFAULT)),
            _ => None,
        }
    }

    /// Whether every norm multiplies by `1 + w` (Gemma's RMSNorm), its
    /// weights starting at zero.
    pub fn offset_norms(&self) -> bool {
        self.family == Family::Gemma
    }

    /// The attention scores' scale: `query_pre_attn_scalar ** -0.5`
    /// (Gemma), else `head_dim ** -0.5`.
    pub fn attn_scale(&self) -> f32 {
        let d = self.gemma().and_then(|g| g.query_pre_attn_scalar);
        1.0 / d.unwrap_or(self.head_dim() as f32).sqrt()
    }

    /// Block `l`'s sliding window (keys each query sees, itself included),
    /// `None` for a global layer.
    pub fn sliding_window(&self, l: usize) -> Option<usize> {
        let g = self.gemma()?;
        let w = g.sliding_window?;
        (!(l + 1).is_multiple_of(g.global_every.max(1))).then_some(w)
    }

    /// Block `l`'s RoPE base: Gemma 3's local base on a sliding layer,
    /// `rope_theta` otherwise.
    pub fn rope_theta_at(&self, l: usize) -> f32 {
        let local = self.gemma().and_then(|g| g.rope_local_theta);
        match (local, self.sliding_window(l)) {
            (Some(t), Some(_)) => t,
            _ => self.rope_theta(),
        }
    }

    /// The attention logits' soft cap, if any.
    pub fn attn_softcap(&self) -> Option<f32> {
        self.gemma().and_then(|g| g.attn_softcap)
    }

    /// The final logits' soft cap, if any.
    pub fn final_softcap(&self) -> Option<f32> {
        self.gemma().and_then(|g| g.final_softcap)
    }
    /// Whether the fused q|k|v projection has a bias (gpt2: always).
    pub fn has_qkv_bias(&self) -> bool {
        self.family == Family::Gpt2 || self.qkv_bias == Some(true)
    }
    pub fn rope_theta(&self) -> f32 {
        self.rope_theta.unwrap_or(10_000.0)
    }
    /// Width of the fused q|k|v projection output.
    pub fn qkv_width(&self) -> usize {
        (self.n_head + 2 * self.n_kv_head()) * self.head_dim()
    }
    /// Width of the first MLP projection output (gpt2: 4C; llama, gemma:
    /// gate|up = 2I).
    pub fn up_width(&self) -> usize {
        match self.family {
            Family::Gpt2 => self.d_ff(),
            Family::Llama | Family::Gemma => 2 * self.d_ff(),
        }
    }

    /// Block `l`'s routed experts, if it has them.
    pub fn moe_at(&self, l: usize) -> Option<&MoeConfig> {
        self.moe.as_ref().filter(|m| m.routed(l))
    }

    /// The inner width of block `l`'s dense MLP: `d_ff`, or in a block with
    /// experts the shared expert's (`None` when it has none).
    pub fn dense_ff(&self, l: usize) -> Option<usize> {
        match self.moe_at(l) {
            Some(m) => (m.d_shared > 0).then_some(m.d_shared),
            None => Some(self.d_ff()),
        }
    }

    /// Parameters a token passes through: the published "active" count of
    /// a mixture of experts (its `top_k` experts of each routed block, not
    /// all of them); the total for a dense model.
    pub fn active_parameters(&self) -> u64 {
        let Some(m) = &self.moe else {
            return self.num_parameters();
        };
        let per_expert = 3 * (m.d_expert as u64) * self.d_model as u64;
        let routed = self.n_layer.saturating_sub(m.first_dense) as u64;
        self.num_parameters() - routed * (m.n_experts - m.top_k) as u64 * per_expert
    }

    /// Checks the dimensions fit together; the message names the offending field.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("pad_vocab_to", self.pad_vocab_to),
            ("max_seq_len", self.max_seq_len),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_kv_head", self.n_kv_head()),
            ("d_model", self.d_model),
            ("d_ff", self.d_ff()),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(format!("`{field}` must be positive"));
            }
        }
        if self.head_dim == Some(0) {
            return Err("`head_dim` must be positive".into());
        }
        if self.head_dim.is_none() && !self.d_model.is_multiple_of(self.n_head) {
            return Err(format!(
                "`d_model` ({}) must be divisible by `n_head` ({})",
                self.d_model, self.n_head
            ));
        }
        if !self.n_head.is_multiple_of(self.n_kv_head()) {
            return Err(format!(
                "`n_head` ({}) must be a multiple of `n_kv_head` ({})",
                self.n_head,
                self.n_kv_head()
            ));
        }
        // Published models stay far below these (the largest have about 126
        // layers, a hidden size of 20k and a vocabulary of 256k); past them
        // memfit's own bookkeeping, not the model, would fill the host (a
        // million layers take gigabytes to plan on meta).
        for (field, v, limit, largest) in [
            ("n_layer", self.n_layer, MAX_LAYERS, "about 126"),
            ("d_model", self.d_model, MAX_WIDTH, "about 20k"),
            ("head_dim", self.head_dim(), MAX_WIDTH, "256"),
            ("d_ff", self.d_ff(), MAX_WIDTH, "about 74k"),
            ("vocab_size", self.vocab_size, MAX_VOCAB, "about 256k"),
            ("pad_vocab_to", self.pad_vocab_to, MAX_VOCAB, "128"),
            ("max_seq_len", self.max_seq_len, MAX_SEQ_LEN, "about 10M"),
        ] {
            if v > limit {
                return Err(format!(
                    "`{field}` is {v}, more than memfit plans: at most {limit} (the largest published models have {largest})"
                ));
            }
        }
        for (field, v) in [("norm_eps", self.norm_eps), ("rope_theta", self.rope_theta)] {
            if let Some(v) = v
                && !(v.is_finite() && v > 0.0)
            {
                return Err(format!("`{field}` must be a positive number, got {v}"));
            }
        }
        if let Some(m) = &self.moe {
            self.validate_moe(m)?;
        }
        // Sizes in u128 so that absurd dimensions are an error here, not an
        // overflow later: every tensor's bytes must fit comfortably in u64.
        let (c, l) = (self.d_model as u128, self.n_layer as u128);
        let experts = self
            .moe
            .as_ref()
            .map_or(0, |m| (m.n_experts * (3 * m.d_expert + 1)) as u128);
        let per_block = (self.qkv_width() as u128
            + self.attn_width() as u128
            + self.up_width() as u128
            + self.d_ff() as u128
            + experts)
            * c;
        let total = 2 * self.padded_vocab() as u128 * c + l * per_block;
        if total > 1 << 50 {
            return Err(format!(
                "the model has about {total} parameters, beyond any model memfit can plan (2^50)"
            ));
        }
        match self.family {
            Family::Gpt2 => {
                if self.n_kv_head() != self.n_head {
                    return Err("gpt2 has no grouped-query attention: drop `n_kv_head`".into());
                }
                if self.rope_theta.is_some() {
                    return Err("gpt2 uses learned positions: drop `rope_theta`".into());
                }
                if self.tie_embeddings == Some(false) {
                    return Err("gpt2 always ties its head to the token embedding".into());
                }
                if self.qkv_bias.is_some() {
                    return Err(
                        "gpt2 always has biases on q, k and v: drop `qkv_bias` (llama only)".into(),
                    );
                }
                if self.head_dim.is_some() || self.qk_norm.is_some() {
                    return Err("gpt2's heads are d_model / n_head wide and unnormalised: drop `head_dim` and `qk_norm` (llama only)".into());
                }
            }
            Family::Llama | Family::Gemma => {
                if !self.head_dim().is_multiple_of(2) {
                    return Err(format!(
                        "RoPE needs an even head dimension, got {}",
                        self.head_dim()
                    ));
                }
            }
        }
        match (&self.gemma, self.family) {
            (Some(g), Family::Gemma) => validate_gemma(g),
            (Some(_), _) => Err("`gemma` holds Gemma's settings: it needs `family: gemma`".into()),
            (None, _) => Ok(()),
        }
    }

    fn validate_moe(&self, m: &MoeConfig) -> Result<(), String> {
        // (A Gemma block with experts would need GeGLU experts.)
        if self.family != Family::Llama {
            return Err("experts (`moe`) need the llama family's SwiGLU MLP".into());
        }
        for (field, v) in [
            ("moe.n_experts", m.n_experts),
            ("moe.top_k", m.top_k),
            ("moe.d_expert", m.d_expert),
        ] {
            if v == 0 {
                return Err(format!("`{field}` must be positive"));
            }
        }
        if m.top_k > m.n_experts {
            return Err(format!(
                "`moe.top_k` ({}) cannot exceed `moe.n_experts` ({})",
                m.top_k, m.n_experts
            ));
        }
        // DeepSeek-V3 has 256 routed experts, Kimi K2 384.
        if m.n_experts > MAX_EXPERTS {
            return Err(format!(
                "`moe.n_experts` is {}, more than memfit plans: at most {MAX_EXPERTS} (the largest published models have 384)",
                m.n_experts
            ));
        }
        if m.d_expert > MAX_WIDTH || m.d_shared > MAX_WIDTH {
            return Err(format!("expert widths are at most {MAX_WIDTH}"));
        }
        if m.shared_gate && m.d_shared == 0 {
            return Err(
                "`moe.shared_gate` gates the shared expert: give it a width (`moe.d_shared`)"
                    .into(),
            );
        }
        if m.first_dense > self.n_layer {
            return Err(format!(
                "`moe.first_dense` ({}) cannot exceed `n_layer` ({})",
                m.first_dense, self.n_layer
            ));
        }
        if !(m.aux_loss_coef.is_finite() && m.aux_loss_coef >= 0.0) {
            return Err(format!(
                "`moe.aux_loss_coef` must be a non-negative number, got {}",
                m.aux_loss_coef
            ));
        }
        Ok(())
    }

    /// Every parameter tensor, in order, with the index of each named one.
    ///
    /// Init follows GPT-2 (std 0.02; residual output projections scaled by
    /// 1/sqrt(2*n_layer), as in the GPT-2 paper, section 2.3).
    pub fn param_layout(&self) -> (Vec<ParamSpec>, ParamIndex) {
        let c = self.d_model;
        let gpt2 = self.family == Family::Gpt2;
        let gemma = self.offset_norms();
        // Gemma's norms multiply by `1 + w`: their weights start at zero.
        let norm_init = if gemma { Init::Zeros } else { Init::Ones };
        let std = 0.02f32;
        let resid_std = std / (2.0 * self.n_layer as f32).sqrt();
        let mut specs = Vec::new();
        let mut push = |name: ParamName, shape: Vec<usize>, init: Init| {
            specs.push(ParamSpec { name, shape, init });
            specs.len() - 1
        };
        let mut idx = ParamIndex {
            wte: push(
                ParamName::top("wte"),
                vec![self.padded_vocab(), c],
                Init::Normal(std),
            ),
            ..Default::default()
        };
        if gpt2 {
            idx.wpe = Some(push(
                ParamName::top("wpe"),
                vec![self.max_seq_len, c],
                Init::Normal(std),
            ));
        }
        for l in 0..self.n_layer {
            let p = |part: &'static str| ParamName {
                layer: Some(l),
                part,
                suffix: "",
            };
            let ln1_w = push(p("ln_1.weight"), vec![c], norm_init);
            let ln1_b = gpt2.then(|| push(p("ln_1.bias"), vec![c], Init::Zeros));
            let qkv_w = push(
                p("attn.qkv.weight"),
                vec![self.qkv_width(), c],
                Init::Normal(std),
            );
            let qkv_b = self
                .has_qkv_bias()
                .then(|| push(p("attn.qkv.bias"), vec![self.qkv_width()], Init::Zeros));
            let (q_norm, k_norm) = match self.qk_norm_widths() {
                Some((q, k)) => (
                    Some(push(p("attn.q_norm.weight"), vec![q], norm_init)),
                    Some(push(p("attn.k_norm.weight"), vec![k], norm_init)),
                ),
                None => (None, None),
            };
            let o_w = push(
                p("attn.o.weight"),
                vec![c, self.attn_width()],
                Init::Normal(resid_std),
            );
            let o_b = gpt2.then(|| push(p("attn.o.bias"), vec![c], Init::Zeros));
            let post_attn_norm =
                gemma.then(|| push(p("attn.post_norm.weight"), vec![c], norm_init));
            let ln2_w = push(p("ln_2.weight"), vec![c], norm_init);
            let ln2_b = gpt2.then(|| push(p("ln_2.bias"), vec![c], Init::Zeros));
            let moe = self.moe_at(l).map(|m| {
                let (e, i) = (m.n_experts, m.d_expert);
                MoeIndex {
                    router: push(p("mlp.router.weight"), vec![e, c], Init::Normal(std)),
                    shared_gate: (m.shared_gate)
                        .then(|| push(p("mlp.shared_gate.weight"), vec![1, c], Init::Normal(std))),
                    up: push(p("mlp.experts.up"), vec![e, 2 * i, c], Init::Normal(std)),
                    down: push(
                        p("mlp.experts.down"),
                        vec![e, c, i],
                        Init::Normal(resid_std),
                    ),
                }
            });
            let dense = self.dense_ff(l);
            let (up, down) = match moe {
                Some(_) => ("mlp.shared.up.weight", "mlp.shared.down.weight"),
                None => ("mlp.up.weight", "mlp.down.weight"),
            };
            let up_width = |dff: usize| if gpt2 { dff } else { 2 * dff };
            let up_w = dense.map(|f| push(p(up), vec![up_width(f), c], Init::Normal(std)));
            let up_b = gpt2.then(|| push(p("mlp.up.bias"), vec![self.up_width()], Init::Zeros));
            let down_w = dense.map(|f| push(p(down), vec![c, f], Init::Normal(resid_std)));
            let down_b = gpt2.then(|| push(p("mlp.down.bias"), vec![c], Init::Zeros));
            let post_mlp_norm = gemma.then(|| push(p("mlp.post_norm.weight"), vec![c], norm_init));
            idx.blocks.push(BlockIndex {
                ln1_w,
                ln1_b,
                qkv_w,
                qkv_b,
                q_norm,
                k_norm,
                o_w,
                o_b,
                post_attn_norm,
                ln2_w,
                ln2_b,
                up_w,
                up_b,
                down_w,
                down_b,
                post_mlp_norm,
                moe,
            });
        }
        idx.lnf_w = push(ParamName::top("ln_f.weight"), vec![c], norm_init);
        idx.lnf_b = gpt2.then(|| push(ParamName::top("ln_f.bias"), vec![c], Init::Zeros));
        if !self.tied() {
            idx.lm_head = Some(push(
                ParamName::top("lm_head"),
                vec![self.padded_vocab(), c],
                Init::Normal(std),
            ));
        }
        (specs, idx)
    }

    /// Parameters as published: the vocabulary is counted unpadded.
    pub fn num_parameters(&self) -> u64 {
        let (specs, idx) = self.param_layout();
        let padded: u64 = specs.iter().map(|s| s.numel() as u64).sum();
        let pad_rows = (self.padded_vocab() - self.vocab_size) as u64;
        let vocab_tensors = 1 + idx.lm_head.is_some() as u64;
        padded - pad_rows * self.d_model as u64 * vocab_tensors
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::profile::load_model;

    #[test]
    fn qkv_bias_adds_a_fused_bias_per_block() {
        let plain = load_model("llama-tiny").unwrap();
        assert_eq!(plain.qkv_bias, None);
        let (specs, idx) = plain.param_layout();
        assert!(idx.blocks.iter().all(|b| b.qkv_b.is_none()));
        assert!(
            !specs
                .iter()
                .any(|s| s.name.to_string().ends_with("attn.qkv.bias"))
        );

        let biased = ModelConfig {
            qkv_bias: Some(true),
            ..plain.clone()
        };
        biased.validate().unwrap();
        let (specs, idx) = biased.param_layout();
        assert_eq!(idx.blocks.len(), biased.n_layer);
        for (l, b) in idx.blocks.iter().enumerate() {
            let i = b.qkv_b.expect("qkv bias index");
            let spec = &specs[i];
            assert_eq!(spec.name.to_string(), format!("h.{l}.attn.qkv.bias"));
            assert_eq!(spec.shape, vec![biased.qkv_width()]);
            assert_eq!(spec.init, Init::Zeros);
            // Right after the weight, as gpt2 lays it out.
            assert_eq!(i, b.qkv_w + 1);
            assert_eq!(b.o_w, i + 1);
            // Still no other biases on llama.
            assert!(b.ln1_b.is_none() && b.o_b.is_none() && b.up_b.is_none());
        }
        assert_eq!(
            biased.num_parameters(),
            plain.num_parameters() + (biased.n_layer * biased.qkv_width()) as u64
        );

        // `Some(false)` is the same as absent.
        let off = ModelConfig {
            qkv_bias: Some(false),
            ..plain.clone()
        };
        assert_eq!(off.num_parameters(), plain.num_parameters());
    }

    #[test]
    fn qkv_bias_is_rejected_on_gpt2() {
        let g = load_model("gpt2-tiny").unwrap();
        assert!(g.has_qkv_bias());
        for v in [true, false] {
            let bad = ModelConfig {
                qkv_bias: Some(v),
                ..g.clone()
            };
            let msg = bad.validate().unwrap_err();
            assert!(msg.contains("`qkv_bias`"), "{msg}");
        }
    }
}
