//! Published rates of fused (flash) attention kernels, as a hardware profile
//! holds them: per kernel, per head dimension, the TFLOP/s its causal
//! forward and backward reach together at each sequence length. A plan
//! recipe's `attention_kernel` names the kernel its fused attention is
//! priced at; the profile's comments give each figure's source.
//!
//! FLOPs are counted as FlashAttention's benchmarks count them, which is
//! how `engine::ops` counts them: a causal forward does 4·head_dim FLOPs
//! per (query, key) pair it keeps, and its backward 2.5 times that.

use std::collections::BTreeMap;

knob_enum! {
    /// Which fused-attention kernel a plan prices (a plan recipe's
    /// `attention_kernel`); the memory it saves is the same for all of them.
    #[derive(PartialOrd, Ord)]
    pub enum AttentionKernel {
        /// FlashAttention-2 (Dao, 2023): what PyTorch's sdpa flash backend
        /// and transformers' `flash_attention_2` run.
        #[default]
        #[value(name = "flash-attention-2")]
        #[serde(rename = "flash-attention-2")]
        FlashAttention2,
        /// FlashAttention-1's CUDA kernel (Dao et al., 2022; flash-attn 1.x).
        #[value(name = "flash-attention")]
        #[serde(rename = "flash-attention")]
        FlashAttention,
        /// FlashAttention in Triton (flash-attn's `flash_attn_triton.py`
        /// on the pre-MLIR Triton): MosaicML's `attn_impl: triton`.
        #[value(name = "flash-attention-triton")]
        #[serde(rename = "flash-attention-triton")]
        FlashAttentionTriton,
        /// xFormers' CUTLASS memory-efficient attention.
        #[value(name = "xformers")]
        #[serde(rename = "xformers")]
        Xformers,
    }
}

impl AttentionKernel {
    pub const ALL: [AttentionKernel; 4] = [
        AttentionKernel::FlashAttention2,
        AttentionKernel::FlashAttention,
        AttentionKernel::FlashAttentionTriton,
        AttentionKernel::Xformers,
    ];

    /// The name recipes and profiles spell it with.
    pub fn name(self) -> &'static str {
        match self {
            AttentionKernel::FlashAttention2 => "flash-attention-2",
            AttentionKernel::FlashAttention => "flash-attention",
            AttentionKernel::FlashAttentionTriton => "flash-attention-triton",
            AttentionKernel::Xformers => "xformers",
        }
    }
}

impl std::fmt::Display for AttentionKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One kernel's rates: head dimension -> sequence length -> TFLOP/s.
pub type KernelRates = BTreeMap<u32, BTreeMap<u32, f64>>;

/// The most head dimensions, and sequence lengths per head dimension, one
/// kernel may list (the time model keeps them in fixed arrays).
pub const MAX_HEAD_DIMS: usize = 4;
pub const MAX_LENGTHS: usize = 16;

/// Why `rates` cannot price `kernel`, if it cannot: an empty table, too
/// many points, or a rate or size that is not a positive finite number.
pub fn check(kernel: AttentionKernel, rates: &KernelRates) -> Result<(), String> {
    if rates.is_empty() || rates.len() > MAX_HEAD_DIMS {
        return Err(format!(
            "`{kernel}` must list 1 to {MAX_HEAD_DIMS} head dimensions, not {}",
            rates.len()
        ));
    }
    for (&head_dim, curve) in rates {
        if head_dim == 0 {
            return Err(format!("`{kernel}`: a head dimension of 0"));
        }
        if curve.is_empty() || curve.len() > MAX_LENGTHS {
            return Err(format!(
                "`{kernel}` at head dimension {head_dim} must list 1 to {MAX_LENGTHS} sequence lengths, not {}",
                curve.len()
            ));
        }
        for (&t, &tflops) in curve {
            if t == 0 || !(tflops.is_finite() && tflops > 0.0) {
                return Err(format!(
                    "`{kernel}` at head dimension {head_dim}: {tflops} TFLOP/s at sequence length {t} (both must be above 0)"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_read_back_and_bad_tables_are_refused() {
        for k in AttentionKernel::ALL {
            let back: AttentionKernel = serde_yaml_ng::from_str(k.name()).unwrap();
            assert_eq!(back, k);
        }
        let ok: KernelRates = serde_yaml_ng::from_str("64: {512: 88, 2048: 140}").unwrap();
        assert!(check(AttentionKernel::FlashAttention2, &ok).is_ok());
        let bad: KernelRates = serde_yaml_ng::from_str("64: {512: 0}").unwrap();
        let e = check(AttentionKernel::Xformers, &bad).unwrap_err();
        assert!(e.contains("`xformers` at head dimension 64"), "{e}");
        assert!(check(AttentionKernel::Xformers, &KernelRates::new()).is_err());
    }
}
