//! Optimizers: the state each one keeps per parameter tensor (allocated through
//! the tracker as `optimizer`), and one step over all tensors.

use serde::Serialize;

use super::device::{Device, Tensor};
use crate::backend::{AdafactorHyper, AdafactorSecond, AdamHyper, Backend, DType, SgdHyper};
use crate::config::model::ParamSpec;
use crate::memory::{Category, OomError};

knob_enum! {
    /// Which optimizer, and its knobs.
    #[serde(rename_all = "lowercase")]
    pub enum Optimizer {
        /// fp32 m and v: 8 bytes of state per parameter.
        #[default]
        Adamw,
        /// Block-wise 8-bit m and v (Dettmers et al. 2022): about 2.03 bytes per parameter.
        Adamw8bit,
        /// AdamW with m and v in CUDA unified memory (bitsandbytes'
        /// `PagedAdamW`/`PagedAdamW32bit`, transformers' `optim="paged_adamw_32bit"`):
        /// numerics of `adamw`, state outside PyTorch's allocator (from 100,000 elements).
        #[value(alias = "paged_adamw_32bit", alias = "paged-adamw32bit")]
        #[serde(rename = "paged-adamw", alias = "paged_adamw_32bit", alias = "paged-adamw32bit")]
        PagedAdamw,
        /// `adamw8bit` with its 8-bit m and v in unified memory (bitsandbytes'
        /// `PagedAdamW8bit`, transformers' `optim="paged_adamw_8bit"`).
        #[value(alias = "paged_adamw_8bit")]
        #[serde(rename = "paged-adamw8bit", alias = "paged_adamw_8bit")]
        PagedAdamw8bit,
        /// Factored second moment (Shazeer & Stern 2018): O(rows + cols) per matrix.
        Adafactor,
        /// SGD with momentum: 4 bytes per parameter.
        Sgd,
    }
}

impl Optimizer {
    /// Whether it changes the numerics compared with fp32 AdamW (marked in reports).
    pub fn changes_numerics(self) -> bool {
        self.unpaged() != Optimizer::Adamw
    }

    /// The optimizer a paged one computes as (itself when not paged).
    pub fn unpaged(self) -> Optimizer {
        match self {
            Optimizer::PagedAdamw => Optimizer::Adamw,
            Optimizer::PagedAdamw8bit => Optimizer::Adamw8bit,
            o => o,
        }
    }

    /// Whether its large states live in unified memory (paged).
    pub fn is_paged(self) -> bool {
        self != self.unpaged()
    }
}

/// bitsandbytes pages a state tensor only from this many elements of its
/// parameter (of this rank's shard under FSDP); smaller ones, and 8-bit
/// AdamW's absmax, are ordinary device tensors (`Optimizer8bit.get_state_buffer`:
/// `p.numel() < 1e5` -> `torch.zeros_like`, else `F.get_paged`, a
/// `cudaMallocManaged(..., cudaMemAttachHost)` buffer;
/// bitsandbytes-foundation/bitsandbytes @ 95f9af3: bitsandbytes/optim/optimizer.py,
/// csrc/pythonInterface.cpp `cget_managed_ptr`).
pub const PAGED_MIN_NUMEL: usize = 100_000;

/// bitsandbytes keeps tensors smaller than this in 32-bit state (`min_8bit_size`).
pub const MIN_8BIT_SIZE: usize = 4096;
/// Elements per quantisation block (one fp32 absmax each).
pub const QBLOCK: usize = 256;

/// One tensor's optimizer state.
#[derive(Clone)]
pub enum OptState<X> {
    Adam {
        m: X,
        v: X,
    },
    Adam8 {
        m: X,
        v: X,
        m_absmax: X,
        v_absmax: X,
    },
    Adafactor {
        second: FactorState<X>,
        m: Option<X>,
    },
    Sgd {
        momentum: X,
    },
    /// Not held here: the tensor belongs to another pipeline stage.
    Absent,
}

#[derive(Clone)]
pub enum FactorState<X> {
    Factored {
        row: X,
        col: X,
        rows: usize,
        cols: usize,
    },
    Full {
        v: X,
    },
}

/// Resolved optimizer hyper-parameters for a run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct OptConfig {
    pub kind: Optimizer,
    /// `None` only for Adafactor's relative step.
    pub lr: Option<f32>,
    /// AdamW's beta1, or Adafactor's optional first moment.
    pub beta1: Option<f32>,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub momentum: f32,
    /// The dtype of AdamW's m and v and of SGD's momentum: fp32, or bf16
    /// under pure bf16 (torch.optim keeps them `zeros_like(param)`).
    /// 8-bit AdamW and Adafactor keep theirs whatever the weights are
    /// (bitsandbytes: 8-bit codes, fp32 below `min_8bit_size`;
    /// transformers' Adafactor: made from the gradient upcast to fp32).
    #[serde(skip)]
    pub state_dtype: DType,
}

type T<B> = Tensor<<B as Backend>::Buf>;

impl<X> OptState<X> {
    fn into_tensors(self) -> Vec<X> {
        match self {
            OptState::Adam { m, v } => vec![m, v],
            OptState::Adam8 {
                m,
                v,
                m_absmax,
                v_absmax,
            } => vec![m, v, m_absmax, v_absmax],
            OptState::Adafactor { second, m } => {
                let mut out = match second {
                    FactorState::Factored { row, col, .. } => vec![row, col],
                    FactorState::Full { v } => vec![v],
                };
                out.extend(m);
                out
            }
            OptState::Sgd { momentum } => vec![momentum],
            OptState::Absent => Vec::new(),
        }
    }
}

/// Allocates the state of every tensor, zero-filled (as PyTorch initialises
/// it). `lens[i]` is how many elements of tensor `i` this rank updates: the
/// whole tensor, or its shard under ZeRO (8-bit AdamW then quantises the
/// shard in its own blocks, as bitsandbytes does under FSDP).
pub fn alloc_state<B: Backend>(
    dev: &mut Device<B>,
    specs: &[ParamSpec],
    lens: &[usize],
    owned: &[bool],
    cfg: &OptConfig,
) -> Result<Vec<OptState<T<B>>>, OomError> {
    let cat = Category::Optimizer;
    specs
        .iter()
        .zip(lens)
        .zip(owned)
        .map(|((spec, &n), &own)| {
            if !own {
                return Ok(OptState::Absent);
            }
            // Paged: m and v of a large enough tensor in unified memory.
            let paged = cfg.kind.is_paged() && n >= PAGED_MIN_NUMEL;
            let moments = |dev: &mut Device<B>, dtype| {
                let pair = |dev: &mut Device<B>| {
                    Ok((dev.alloc(n, dtype, cat)?, dev.alloc(n, dtype, cat)?))
                };
                match paged {
                    true => dev.paged(pair),
                    false => pair(dev),
                }
            };
            Ok(match cfg.kind.unpaged() {
                Optimizer::Adamw8bit if n >= MIN_8BIT_SIZE => {
                    let blocks = n.div_ceil(QBLOCK);
                    let (m, v) = moments(dev, DType::U8)?;
                    OptState::Adam8 {
                        m,
                        v,
                        m_absmax: dev.alloc_f32(blocks, cat)?,
                        v_absmax: dev.alloc_f32(blocks, cat)?,
                    }
                }
                Optimizer::Adamw | Optimizer::Adamw8bit => {
                    // torch.optim's AdamW keeps its moments in the
                    // parameters' dtype (`zeros_like`); bitsandbytes' 32-bit
                    // state (paged AdamW's, 8-bit AdamW's small tensors) is
                    // fp32 whatever the parameters are.
                    let dtype = match cfg.kind {
                        Optimizer::Adamw => cfg.state_dtype,
                        _ => DType::F32,
                    };
                    let (m, v) = moments(dev, dtype)?;
                    OptState::Adam { m, v }
                }
                Optimizer::Adafactor => {
                    assert_eq!(
                        n,
                        spec.numel(),
                        "Adafactor's factored state needs whole tensors"
                    );
                    let second = if spec.shape.len() >= 2 {
                        let cols = *spec.shape.last().expect("2-D");
                        let rows = n / cols;
                        FactorState::Factored {
                            row: dev.alloc_f32(rows, cat)?,
                            col: dev.alloc_f32(cols, cat)?,
                            rows,
                            cols,
                        }
                    } else {
                        FactorState::Full {
                            v: dev.alloc_f32(n, cat)?,
                        }
                    };
                    let m = match cfg.beta1 {
                        Some(_) => Some(dev.alloc_f32(n, cat)?),
                        None => None,
                    };
                    OptState::Adafactor { second, m }
                }
                // Momentum is required to be positive (validated with the flags), so
                // the buffer always exists, as in PyTorch with momentum != 0.
                Optimizer::Sgd => OptState::Sgd {
                    momentum: dev.alloc(n, cfg.state_dtype, cat)?,
                },
                Optimizer::PagedAdamw | Optimizer::PagedAdamw8bit => unreachable!("unpaged"),
            })
        })
        .collect()
}

pub fn free_state<B: Backend>(dev: &mut Device<B>, state: Vec<OptState<T<B>>>) {
    for s in state {
        for t in s.into_tensors() {
            dev.free(t);
        }
    }
}

/// One update of one tensor (or of this rank's shard of it: `p`, `g` and the
/// state all hold the shard's elements).
pub fn update_one<B: Backend>(
    dev: &mut Device<B>,
    p: &mut T<B>,
    g: &T<B>,
    state: &mut OptState<T<B>>,
    spec: &ParamSpec,
    cfg: &OptConfig,
    step: u64,
    grad_scale: f32,
) {
    {
        // Decoupled weight decay on matrices only (biases, norms and other 1-D tensors are exempt).
        let weight_decay = if spec.shape.len() >= 2 {
            cfg.weight_decay
        } else {
            0.0
        };
        let beta1 = cfg.beta1.unwrap_or(0.9);
        let adam = AdamHyper {
            lr: cfg.lr.unwrap_or(0.0),
            beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            weight_decay,
            m_corr: 1.0 / (1.0 - beta1.powi(step as i32)),
            v_corr: 1.0 / (1.0 - cfg.beta2.powi(step as i32)),
            grad_scale,
        };
        match state {
            OptState::Adam { m, v } => dev.adamw_update(p, g, m, v, adam),
            OptState::Adam8 {
                m,
                v,
                m_absmax,
                v_absmax,
            } => dev.adamw8bit_update(p, g, m, v, m_absmax, v_absmax, adam),
            OptState::Sgd { momentum } => {
                let h = SgdHyper {
                    lr: cfg.lr.unwrap_or(0.0),
                    momentum: cfg.momentum,
                    weight_decay,
                    grad_scale,
                };
                dev.sgd_update(p, g, momentum, h);
            }
            OptState::Absent => {}
            OptState::Adafactor { second, m } => {
                let h = AdafactorHyper {
                    lr: cfg.lr,
                    step,
                    beta1: cfg.beta1,
                    weight_decay,
                    grad_scale,
                    ..AdafactorHyper::default()
                };
                let second = match second {
                    FactorState::Factored {
                        row,
                        col,
                        rows,
                        cols,
                    } => AdafactorSecond::Factored {
                        row,
                        col,
                        rows: *rows,
                        cols: *cols,
                    },
                    FactorState::Full { v } => AdafactorSecond::Full { v, n: p.len },
                };
                dev.adafactor_update(p, g, second, m.as_mut(), h);
            }
        }
    }
}
