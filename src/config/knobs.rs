//! The knob value enums the configuration layer itself reads (a hardware
//! profile's peak rate per [`Precision`]), the derive list every knob enum
//! shares ([`knob_enum!`], used by the engine's own knob enums too), and how
//! a knob value is spelled ([`name`]). The flags and run-recipe keys that
//! take them are `knobs::Knobs`.

/// Declares a knob's value enum: copyable, hashable, with a default, read
/// from recipes (serde) and flags (clap) under the same names. The enum's
/// own attributes (its docs, serde's `rename_all`) come inside.
macro_rules! knob_enum {
    ($(#[$m:meta])* $vis:vis enum $name:ident { $($body:tt)* }) => {
        #[derive(
            Clone,
            Copy,
            Debug,
            Default,
            PartialEq,
            Eq,
            Hash,
            serde::Serialize,
            serde::Deserialize,
            clap::ValueEnum,
        )]
        $(#[$m])*
        $vis enum $name { $($body)* }
    };
}

knob_enum! {
    /// Storage precision of the working weights, activations and gradients.
    ///
    /// Mixed precision (Micikevicius et al., Mixed Precision Training, 2018, and
    /// DeepSpeed/Megatron's bf16 and fp16 modes): the parameters the forward and
    /// backward read are 16-bit; so are activations, activation gradients and
    /// parameter gradients. Normalisation statistics, the attention log-sum-exp
    /// and the per-token losses stay fp32. The optimizer keeps an fp32 master copy
    /// of every weight, updates it from the 16-bit gradients (widened, unscaled
    /// and clipped inside the update kernel), then rounds it into the working copy.
    /// Gradients accumulate over micro-batches in their 16-bit buffers, each add
    /// computed in fp32 and rounded once when stored, as a cuBLAS `beta = 1` GEMM
    /// does. Per parameter with AdamW: 2 (weights) + 2 (gradients) + 12 (fp32
    /// master, m, v) = 16 bytes, the ZeRO paper's `2 + 2 + K` with K = 12;
    /// fp32 is 4 + 4 + 8 = 16 with no master copy.
    ///
    /// `bf16-pure` is the other 16-bit layout: every tensor in bf16 and no
    /// master copy, what torchtune's single-device recipes train with
    /// (`dtype: bf16`: the model built in bf16, `torch.optim.AdamW` over
    /// it) and what `model.to(torch.bfloat16)` + a plain optimizer gives.
    /// AdamW's m and v are bf16 too (torch.optim makes its state
    /// `zeros_like(param)`): 2 + 2 + 4 = 8 bytes per parameter.
    #[serde(rename_all = "lowercase")]
    pub enum Precision {
        /// IEEE single precision throughout: no master copy, no loss scaling.
        #[default]
        Fp32,
        /// bfloat16 mixed precision: fp32's range, so no loss scaling; an
        /// fp32 master copy and optimizer state.
        Bf16,
        /// IEEE half with dynamic loss scaling.
        Fp16,
        /// Pure bfloat16 (torchtune's `dtype: bf16`): bf16 weights,
        /// gradients and optimizer state, no master copy; each update is
        /// computed in fp32 per element and rounded when stored.
        #[serde(rename = "bf16-pure")]
        #[value(name = "bf16-pure")]
        Bf16Pure,
    }
}

impl Precision {
    /// Whether the optimizer keeps fp32 master weights.
    pub fn has_master(self) -> bool {
        matches!(self, Precision::Bf16 | Precision::Fp16)
    }

    /// Whether every tensor, the optimizer's state included, is 16-bit
    /// (no master copy): `bf16-pure`.
    pub fn is_pure(self) -> bool {
        self == Precision::Bf16Pure
    }

    /// Whether the kernels compute in a 16-bit type (mixed or pure).
    pub fn is_16bit(self) -> bool {
        self != Precision::Fp32
    }

    /// The precision whose tensor-core rate the kernels run at: pure bf16
    /// multiplies as mixed bf16 does.
    pub fn rate(self) -> Precision {
        match self {
            Precision::Bf16Pure => Precision::Bf16,
            p => p,
        }
    }

    /// Whether results may differ from fp32 beyond rounding noise (fp16's
    /// narrow range needs loss scaling and can skip steps; pure bf16
    /// rounds every update into 8-bit-mantissa weights, so small updates
    /// are lost, which an fp32 master copy keeps).
    pub fn changes_numerics(self) -> bool {
        matches!(self, Precision::Fp16 | Precision::Bf16Pure)
    }
}

knob_enum! {
    /// How attention is computed.
    #[serde(rename_all = "lowercase")]
    pub enum Attention {
        /// Materialises the B*H*T*T probabilities, as PyTorch eager does.
        #[default]
        Eager,
        /// Flash-style tiles with an online softmax; saves only B*H*T row
        /// statistics. Also spelled `sdpa`: transformers'
        /// `attn_implementation="sdpa"` (checked against PyTorch).
        #[value(alias = "sdpa")]
        #[serde(alias = "sdpa")]
        Fused,
        /// transformers' `attn_implementation="flash_attention_2"`
        /// (flash_attn's `FlashAttnFunc`): the fused kernel's saved set,
        /// which PyTorch's sdpa vendors, plus flash_attn's rng state on
        /// the GPU; fp16 and bf16 only (docs/hf-eager.md, "Liger and
        /// FlashAttention-2").
        #[value(name = "flash-attention-2", alias = "flash_attention_2")]
        #[serde(rename = "flash-attention-2", alias = "flash_attention_2")]
        FlashAttention2,
    }
}

impl Attention {
    /// Whether the engine runs its fused (flash) kernel: everything but
    /// eager attention.
    pub fn fused(self) -> bool {
        self != Attention::Eager
    }
}

knob_enum! {
    /// Activation checkpointing.
    #[serde(rename_all = "lowercase")]
    pub enum Checkpointing {
        /// Every block keeps what its backward needs.
        #[default]
        None,
        /// Each block keeps only its input; backward recomputes the block's forward
        /// first (one extra forward per block, about +33% compute).
        Full,
        /// torchtitan's selective (per-op) checkpointing, `mode = "selective"`,
        /// `selective_ac_option = "op"`: each block keeps its input and the
        /// outputs of the ops on torchtitan's save list (the attention kernel
        /// and every other matmul of the block, counted in call order), and
        /// its backward recomputes the rest (`engine/step/sac.rs`).
        Selective,
    }
}

/// A knob's value as recipes and flags spell it (`zero3`, `hf-eager`).
pub fn name(v: impl clap::ValueEnum) -> String {
    v.to_possible_value()
        .map_or_else(String::new, |p| p.get_name().to_string())
}

/// A group-size knob that may be off (`shard_group`, `hpz_group`): off is
/// `None`, never a size. Reports and recipes spell off as `0`, as they did
/// before the knobs were options (so the report JSON is unchanged), and
/// read `0` or `null` as off.
pub mod group {
    use std::num::NonZeroUsize;

    use serde::{Deserialize, Deserializer, Serializer};

    /// The group as recipes and reports spell it: its size, `0` when off.
    pub fn spelled(g: Option<NonZeroUsize>) -> String {
        g.map_or(0, NonZeroUsize::get).to_string()
    }

    /// `Some(g)` for a size `g` > 0, `None` for 0.
    pub fn from_size(g: usize) -> Option<NonZeroUsize> {
        NonZeroUsize::new(g)
    }

    pub fn serialize<S: Serializer>(g: &Option<NonZeroUsize>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(g.map_or(0, NonZeroUsize::get) as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<NonZeroUsize>, D::Error> {
        Ok(Option::<usize>::deserialize(d)?.and_then(NonZeroUsize::new))
    }

    /// The same for a plan grid's list of groups.
    pub mod list {
        use std::num::NonZeroUsize;

        use serde::{Deserialize, Deserializer, Serializer};

        pub fn serialize<S: Serializer>(
            v: &[Option<NonZeroUsize>],
            s: S,
        ) -> Result<S::Ok, S::Error> {
            s.collect_seq(v.iter().map(|g| g.map_or(0, NonZeroUsize::get)))
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Vec<Option<NonZeroUsize>>, D::Error> {
            let v = Vec::<Option<usize>>::deserialize(d)?;
            Ok(v.into_iter()
                .map(|g| g.and_then(NonZeroUsize::new))
                .collect())
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroUsize;

    #[derive(serde::Serialize, serde::Deserialize)]
    struct One {
        #[serde(with = "super::group")]
        g: Option<NonZeroUsize>,
        #[serde(with = "super::group::list")]
        gs: Vec<Option<NonZeroUsize>>,
    }

    /// Off is `None` in memory; `0` and `null` read as off and off is
    /// written as `0`, so reports and recipes read as before.
    #[test]
    fn a_group_that_is_off_is_none_and_spelled_zero() {
        let one: One = serde_json::from_str(r#"{"g": 0, "gs": [0, null, 8]}"#).unwrap();
        assert_eq!(one.g, None);
        assert_eq!(one.gs, vec![None, None, NonZeroUsize::new(8)]);
        let one: One = serde_json::from_str(r#"{"g": null, "gs": []}"#).unwrap();
        assert_eq!(one.g, None);
        let one = One {
            g: NonZeroUsize::new(4),
            gs: vec![None, NonZeroUsize::new(2)],
        };
        assert_eq!(
            serde_json::to_string(&one).unwrap(),
            r#"{"g":4,"gs":[0,2]}"#
        );
        assert_eq!(super::group::spelled(None), "0");
    }
}
