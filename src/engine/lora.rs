//! Fine-tuning modes: full training, or LoRA adapters on frozen weights.
//!
//! LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models",
//! 2021): a frozen projection `W (out, in)` gets `A (r, in)` and `B (out, r)`
//! and computes `x W^T + (alpha / r) (x A^T) B^T`; only A and B train. As
//! PEFT does it (`peft/tuners/lora/layer.py`): A starts like
//! `kaiming_uniform_(a=sqrt(5))`, whose standard deviation is
//! `1/sqrt(3 in)` (drawn here from a normal of that deviation), B starts at
//! zero, so the model starts as the base; biases, norms and embeddings stay
//! frozen (`bias="none"`).
//!
//! The engine fuses q|k|v into one projection and Llama's gate|up into
//! another; an adapter on q, k, v, gate or up writes its slice of the
//! fused output (`Device::copy_cols`), as separate PEFT modules would.
//! GPT-2's own `c_attn` is one fused module, so on GPT-2 q, k and v name one
//! adapter over all three (PEFT's `target_modules=["c_attn"]`).
//!
//! Data parallelism (`engine::shard`) trains the adapters alone: each
//! block's adapters join its FSDP unit, and only they have gradients,
//! buckets, master weights and optimizer state on any rank. Pipelines are
//! not supported yet, nor QLoRA under zero3 ([`check_parallel`]).

use crate::config::model::{Init, ParamName, ParamSpec};
use crate::config::{Family, ModelConfig};

knob_enum! {
    /// What trains.
    #[serde(rename_all = "kebab-case")]
    pub enum Finetune {
        /// Every weight trains.
        #[default]
        Full,
        /// LoRA adapters on frozen weights.
        Lora,
        /// LoRA on a base whose block projections (and a mixture's stacked
        /// experts) are stored in 4-bit
        /// NormalFloat (`crate::nf4`) and dequantised to the compute dtype per
        /// matmul (Dettmers et al., QLoRA, 2023). cpu, cuda and meta.
        Qlora,
    }
}

/// Why a fine-tuning run cannot be spread as `t` asks, if it cannot: the
/// flag to name and the message. Full training runs everywhere. LoRA runs
/// under ddp and zero1-3 (only the adapters have gradients, master weights
/// and optimizer state; zero3 partitions the frozen base like any
/// parameter), but not over pipeline stages yet. QLoRA does not run under
/// zero3: ZeRO-3 cuts every parameter into flat per-tensor shards, but an
/// NF4 tensor is stored as 64-value blocks, each with its own
/// double-quantised absmax (`crate::nf4`), which a shard boundary would
/// split from its codes; the engine shards flat elements, not NF4 blocks.
pub fn check_parallel(t: &super::TrainConfig) -> Option<(&'static str, String)> {
    if t.finetune == Finetune::Full {
        return None;
    }
    let name = match t.finetune {
        Finetune::Qlora => "qlora",
        _ => "lora",
    };
    if t.pipeline_stages > 1 {
        return Some((
            "--pipeline-stages",
            format!(
                "--finetune {name} runs with data parallelism (ddp, zero1-3) but not with pipeline stages in memfit's engine; use --pipeline-stages 1"
            ),
        ));
    }
    if t.finetune == Finetune::Qlora && t.sharding.shards_parameters() {
        return Some((
            "--sharding",
            "--finetune qlora does not run with zero3: zero3 partitions every parameter into per-tensor shards, and QLoRA's NF4 base is stored in 64-value blocks with their own quantised scales, which a shard would cut; use ddp, zero1 or zero2 (the NF4 base replicated on every rank) or --finetune lora".into(),
        ));
    }
    None
}

/// A projection LoRA can adapt (PEFT's usual `target_modules`).
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    /// Query (`q_proj`; GPT-2: `c_attn`, with k and v).
    Q,
    /// Key (`k_proj`).
    K,
    /// Value (`v_proj`).
    V,
    /// Attention output (`o_proj`; GPT-2: `attn.c_proj`).
    O,
    /// Llama's MLP gate (`gate_proj`).
    Gate,
    /// MLP up (`up_proj`; GPT-2: `c_fc`).
    Up,
    /// MLP down (`down_proj`; GPT-2: `mlp.c_proj`).
    Down,
    /// Every routed expert's gate, up and down (Mixtral's per-expert `w1`,
    /// `w3`, `w2`; Qwen-MoE's `experts.N.gate_proj`, `up_proj`,
    /// `down_proj`): three stacked adapters per routed block.
    Experts,
}

impl Target {
    /// What no target list means: every dense projection (not the
    /// experts; a mixture must name its targets, `validate::moe`).
    pub const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];
}

/// LoRA's knobs.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f32,
    /// hf-eager only (its masks); the engine's kernels have no dropout.
    pub dropout: f32,
    /// Empty: every attention and MLP projection the model has.
    pub targets: Vec<Target>,
}

impl Default for LoraConfig {
    /// PEFT's `LoraConfig` defaults (r=8, lora_alpha=8, lora_dropout=0),
    /// on every attention and MLP projection.
    fn default() -> Self {
        LoraConfig {
            rank: 8,
            alpha: 8.0,
            dropout: 0.0,
            targets: Vec::new(),
        }
    }
}

impl LoraConfig {
    /// `alpha / r`, the factor on the adapter's output.
    pub fn scale(&self) -> f32 {
        self.alpha / self.rank as f32
    }
}

/// Which of a block's fused projections an adapter belongs to. The
/// `Expert*` ones sit on the routed experts' stacked weights
/// (`moe::experts_ffn`), and come after a block's others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proj {
    Qkv,
    O,
    Up,
    Down,
    /// The experts' gate|up `(E, 2I, C)`: gate writes columns `0..I`.
    ExpertUp,
    /// The experts' down `(E, C, I)`.
    ExpertDown,
}

impl Proj {
    pub fn on_experts(self) -> bool {
        matches!(self, Proj::ExpertUp | Proj::ExpertDown)
    }
}

/// A block's adapters as `(on its dense projections, on its experts)`:
/// [`layout`] puts the experts' last.
pub fn split_experts(ads: &[Adapter]) -> (&[Adapter], &[Adapter]) {
    let at = ads.partition_point(|a| !a.proj.on_experts());
    debug_assert!(ads[at..].iter().all(|a| a.proj.on_experts()));
    ads.split_at(at)
}

/// One adapter: its projection, the slice of that projection's output it
/// writes, its input width, and its two tensors' indices in the flat list.
/// On the experts, `A (E, r, inp)` and `B (E, width, r)` are stacked as
/// the experts are, one adapter per expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Adapter {
    pub proj: Proj,
    pub off: usize,
    pub width: usize,
    pub inp: usize,
    pub a: usize,
    pub b: usize,
}

/// Each block's adapters' tensors, or (`experts_only`) those of its
/// adapters on experts, which expert parallelism splits and reduces with
/// the experts.
pub fn tensors(adapters: &[Vec<Adapter>], experts_only: bool) -> Vec<Vec<usize>> {
    let pick = |b: &[Adapter]| match experts_only {
        true => split_experts(b).1.to_vec(),
        false => b.to_vec(),
    };
    (adapters.iter())
        .map(|b| pick(b).iter().flat_map(|a| [a.a, a.b]).collect())
        .collect()
}

/// Why a target list cannot work on this model, if it cannot.
/// The error names the knob (`rank`, `alpha`, `dropout`, `targets`): the
/// flag `--lora-<knob>` or the recipe key `lora_<knob>`.
pub fn check(model: &ModelConfig, cfg: &LoraConfig) -> Result<(), (&'static str, String)> {
    if cfg.rank == 0 {
        return Err(("rank", "the LoRA rank must be at least 1".into()));
    }
    if !(cfg.alpha.is_finite() && cfg.alpha > 0.0) {
        return Err(("alpha", format!("{} must be positive", cfg.alpha)));
    }
    if !(0.0..1.0).contains(&cfg.dropout) {
        return Err(("dropout", format!("{} is outside [0, 1)", cfg.dropout)));
    }
    if model.moe.is_none() && cfg.targets.contains(&Target::Experts) {
        return Err((
            "targets",
            format!(
                "{} has no routed experts to adapt; its MLP takes gate, up and down",
                model.name
            ),
        ));
    }
    let mlp = [Target::Gate, Target::Up, Target::Down];
    let dense = (0..model.n_layer).any(|l| model.dense_ff(l).is_some());
    if !dense && cfg.targets.iter().any(|t| mlp.contains(t)) {
        return Err((
            "targets",
            format!(
                "{} has no dense MLP (no shared expert, no dense block) for gate, up or down to adapt; its routed experts take experts",
                model.name
            ),
        ));
    }
    if model.family == Family::Gpt2 && cfg.targets.contains(&Target::Gate) {
        return Err((
            "targets",
            format!(
                "{} has no gate projection (GPT-2's MLP is c_fc, GELU, c_proj: up and down)",
                model.name
            ),
        ));
    }
    Ok(())
}

/// Appends every block's adapters to `specs` and returns them per block.
/// The MLP targets adapt a block's dense MLP, of its own width
/// (`ModelConfig::dense_ff`): a mixture's dense blocks and shared expert,
/// none in a routed block without one. `experts` adapts a routed block's
/// experts, after the rest ([`split_experts`]).
pub fn layout(
    model: &ModelConfig,
    cfg: &LoraConfig,
    specs: &mut Vec<ParamSpec>,
) -> Vec<Vec<Adapter>> {
    let c = model.d_model;
    let hd = model.head_dim();
    let (q, kv) = (model.n_head * hd, model.n_kv_head() * hd);
    let r = cfg.rank;
    let gpt2 = model.family == Family::Gpt2;
    let mut targets = match cfg.targets.is_empty() {
        true => Target::ALL.to_vec(),
        false => cfg.targets.clone(),
    };
    if gpt2 {
        targets.retain(|&t| t != Target::Gate);
    }
    targets.sort();
    targets.dedup();
    if gpt2
        && targets
            .iter()
            .any(|t| matches!(t, Target::Q | Target::K | Target::V))
    {
        // One c_attn adapter, placed where q was.
        targets.retain(|t| !matches!(t, Target::K | Target::V));
    }
    let mlp = |t: &Target| matches!(t, Target::Gate | Target::Up | Target::Down);
    (0..model.n_layer)
        .map(|l| {
            let dense = model.dense_ff(l);
            let mut ads = Vec::new();
            for &t in &targets {
                let dff = dense.unwrap_or(0);
                let (proj, off, width, inp, name) = match (t, gpt2) {
                    _ if mlp(&t) && dense.is_none() => continue,
                    (Target::Experts, _) => {
                        if let Some(m) = model.moe_at(l) {
                            ads.extend(expert_adapters(l, (c, m.n_experts, m.d_expert), r, specs));
                        }
                        continue;
                    }
                    (Target::Q, true) => (Proj::Qkv, 0, 3 * c, c, "attn.c_attn"),
                    (Target::Q, false) => (Proj::Qkv, 0, q, c, "self_attn.q_proj"),
                    (Target::K, _) => (Proj::Qkv, q, kv, c, "self_attn.k_proj"),
                    (Target::V, _) => (Proj::Qkv, q + kv, kv, c, "self_attn.v_proj"),
                    (Target::O, true) => (Proj::O, 0, c, c, "attn.c_proj"),
                    (Target::O, false) => (Proj::O, 0, c, q, "self_attn.o_proj"),
                    (Target::Gate, _) => (Proj::Up, 0, dff, c, "mlp.gate_proj"),
                    (Target::Up, true) => (Proj::Up, 0, dff, c, "mlp.c_fc"),
                    (Target::Up, false) => (Proj::Up, dff, dff, c, "mlp.up_proj"),
                    (Target::Down, true) => (Proj::Down, 0, c, dff, "mlp.c_proj"),
                    (Target::Down, false) => (Proj::Down, 0, c, dff, "mlp.down_proj"),
                };
                let (a, b) = push_pair(specs, (l, name), &[], (r, inp, width));
                ads.push(Adapter {
                    proj,
                    off,
                    width,
                    inp,
                    a,
                    b,
                });
            }
            ads
        })
        .collect()
}

/// Appends one adapter's `A (.., r, inp)` (PEFT's kaiming-uniform
/// deviation, `1/sqrt(3 inp)`) and `B (.., width, r)` (zeros), with
/// `lead` dimensions before each (the experts' `E`); their indices.
fn push_pair(
    specs: &mut Vec<ParamSpec>,
    (l, part): (usize, &'static str),
    lead: &[usize],
    (r, inp, width): (usize, usize, usize),
) -> (usize, usize) {
    let a = specs.len();
    let name = |suffix| ParamName {
        layer: Some(l),
        part,
        suffix,
    };
    specs.push(ParamSpec {
        name: name(".lora_A"),
        shape: [lead, &[r, inp]].concat(),
        init: Init::Normal((1.0 / (3.0 * inp as f64)).sqrt() as f32),
    });
    specs.push(ParamSpec {
        name: name(".lora_B"),
        shape: [lead, &[width, r]].concat(),
        init: Init::Zeros,
    });
    (a, a + 1)
}

/// A routed block's expert adapters: gate and up each their own (as PEFT
/// wraps a Qwen-MoE expert's separate `gate_proj` and `up_proj`, or
/// Mixtral's `w1` and `w3`), writing columns `0..I` and `I..2I` of the
/// experts' gate|up, and down; each stacked over the `E` experts.
fn expert_adapters(
    l: usize,
    (c, e, i): (usize, usize, usize),
    r: usize,
    specs: &mut Vec<ParamSpec>,
) -> Vec<Adapter> {
    [
        (Proj::ExpertUp, 0, i, c, "mlp.experts.gate_proj"),
        (Proj::ExpertUp, i, i, c, "mlp.experts.up_proj"),
        (Proj::ExpertDown, 0, c, i, "mlp.experts.down_proj"),
    ]
    .into_iter()
    .map(|(proj, off, width, inp, name)| {
        let (a, b) = push_pair(specs, (l, name), &[e], (r, inp, width));
        Adapter {
            proj,
            off,
            width,
            inp,
            a,
            b,
        }
    })
    .collect()
}

/// Trainable parameters LoRA adds: `r (in + out)` per adapter.
pub fn trainable_params(model: &ModelConfig, cfg: &LoraConfig) -> u64 {
    let mut specs = Vec::new();
    layout(model, cfg, &mut specs);
    specs.iter().map(|s| s.numel() as u64).sum()
}
