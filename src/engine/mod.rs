//! The training engine: GPT-2 and Llama forward and backward, written by hand
//! per layer (llm.c-style), and AdamW. Generic over the backend, so the same
//! code (and therefore the same allocation schedule) runs on cpu and meta.
//!
//! Allocation schedule, which is what the tracker measures:
//! * init: parameters, gradients (always resident, zeroed each step, as with
//!   `zero_grad(set_to_none=False)`), fp32 master weights under mixed
//!   precision, optimizer state (fp32), workspace;
//! * forward: each block's saved tensors are `activations`; a projection output
//!   that is immediately added to the residual stream is a `temporaries`;
//! * backward: activation gradients are `temporaries`, freed as soon as the
//!   layer that needs them is done; each block's saved tensors are freed right
//!   after its backward, as PyTorch frees saved tensors when a node has run;
//!   the logits buffer is turned into its own gradient in place.

pub mod device;
pub mod optim;

use crate::backend::{AttnShape, Backend, DType};
use crate::config::model::{BlockIndex, Init, ParamIndex, ParamSpec};
use crate::config::{Family, ModelConfig};
use crate::data::Batch;
use crate::memory::{Category, OomError, Phase};
use crate::rng::Rng;

pub use device::{CostCounter, Device, OpCost, Tensor};
use optim::OptState;
pub use optim::{OptConfig, Optimizer};

type T<B> = Tensor<<B as Backend>::Buf>;
/// A norm's output, LayerNorm mean (gpt2 only) and reciprocal std.
type NormOut<B> = (T<B>, Option<T<B>>, T<B>);
/// A block's saved tensors and, unless recomputing, its output.
type BlockOut<B> = (BlockActs<T<B>>, Option<T<B>>);

/// The training knobs the engine implements.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TrainConfig {
    pub seq_len: usize,
    pub micro_batch: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    pub optimizer: Optimizer,
    /// `None`: the optimizer's default (Adafactor: relative step).
    pub lr: Option<f32>,
    /// `None`: 0.9 for AdamW; no first moment for Adafactor.
    pub beta1: Option<f32>,
    pub beta2: f32,
    pub eps: f32,
    /// Decoupled (AdamW, Adafactor) or L2 (SGD); matrices only.
    pub weight_decay: f32,
    /// SGD momentum.
    pub momentum: f32,
    /// Global-norm clipping threshold; 0 disables.
    pub grad_clip: f32,
    pub seed: u64,
    pub checkpointing: Checkpointing,
    pub attention: Attention,
    pub precision: Precision,
    /// fp16 only: the first loss scale (PyTorch `GradScaler` and DeepSpeed
    /// start at 2^16).
    pub initial_loss_scale: f32,
    /// fp16 only: steps without an overflow before the scale doubles
    /// (`GradScaler`'s growth_interval, 2000).
    pub loss_scale_window: u32,
}

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
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    Fp32,
    /// bfloat16: fp32's range, so no loss scaling.
    Bf16,
    /// IEEE half with dynamic loss scaling.
    Fp16,
}

impl Precision {
    /// Element type of the working weights, activations and gradients.
    pub fn dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::Bf16,
            Precision::Fp16 => DType::F16,
        }
    }

    /// Whether the optimizer keeps fp32 master weights.
    pub fn has_master(self) -> bool {
        self != Precision::Fp32
    }

    /// Whether results may differ from fp32 beyond rounding noise (fp16's
    /// narrow range needs loss scaling and can skip steps).
    pub fn changes_numerics(self) -> bool {
        self == Precision::Fp16
    }
}

/// How attention is computed.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Attention {
    /// Materialises the B*H*T*T probabilities, as PyTorch eager does.
    #[default]
    Eager,
    /// Flash-style tiles with an online softmax; saves only B*H*T row statistics.
    Fused,
}

/// Activation checkpointing.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Checkpointing {
    /// Every block keeps what its backward needs.
    #[default]
    None,
    /// Each block keeps only its input; backward recomputes the block's forward
    /// first (one extra forward per block, about +33% compute).
    Full,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            seq_len: 64,
            micro_batch: 4,
            grad_accum: 1,
            optimizer: Optimizer::Adamw,
            lr: None,
            beta1: None,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            momentum: 0.9,
            grad_clip: 1.0,
            seed: 1337,
            checkpointing: Checkpointing::None,
            attention: Attention::Eager,
            precision: Precision::Fp32,
            initial_loss_scale: 65536.0,
            loss_scale_window: 2000,
        }
    }
}

impl TrainConfig {
    /// The optimizer settings with defaults resolved: lr 3e-4 for the AdamW
    /// variants, 1e-2 for SGD, Hugging Face's relative step for Adafactor.
    pub fn opt(&self) -> OptConfig {
        let (lr, beta1) = match self.optimizer {
            Optimizer::Adamw | Optimizer::Adamw8bit => (
                Some(self.lr.unwrap_or(3e-4)),
                Some(self.beta1.unwrap_or(0.9)),
            ),
            Optimizer::Sgd => (Some(self.lr.unwrap_or(1e-2)), None),
            Optimizer::Adafactor => (self.lr, self.beta1),
        };
        OptConfig {
            kind: self.optimizer,
            lr,
            beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            momentum: self.momentum,
        }
    }
}

/// What one optimizer step reports. Values are `None` on a backend without data.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepReport {
    /// Mean loss over the step's micro-batches.
    pub loss: Option<f32>,
    /// Global gradient norm before clipping.
    pub grad_norm: Option<f32>,
    /// The update was skipped: the gradient was not finite.
    pub skipped: bool,
}

/// Tensors one block saves for its backward.
struct BlockActs<X> {
    ln1: X,
    /// LayerNorm only (gpt2).
    ln1_mean: Option<X>,
    ln1_rstd: X,
    /// Packed q|k|v, after RoPE on llama.
    qkv: X,
    /// Eager: the attention probabilities (B,H,T,T). Fused: the per-row
    /// log-sum-exp (B,H,T), all the backward pass needs to recompute them.
    att: X,
    /// Attention output before the output projection (N,C).
    atty: X,
    /// Residual stream after attention (N,C).
    res2: X,
    ln2: X,
    ln2_mean: Option<X>,
    ln2_rstd: X,
    /// gpt2: fc output before GELU (N,4C); llama: gate|up (N,2I).
    up: X,
    /// gpt2: GELU output (N,4C); llama: SwiGLU output (N,I).
    act: X,
}

/// Everything a forward pass leaves for the backward pass.
struct Acts<X> {
    tokens: X,
    targets: X,
    /// The residual stream (N,C) into each block: `resid[0]` is the embedding
    /// output, `resid[l + 1]` block l's output (the last one feeds the head).
    resid: Vec<X>,
    /// Each block's saved tensors; `None` when checkpointed (recomputed in backward).
    blocks: Vec<Option<BlockActs<X>>>,
    lnf: X,
    lnf_mean: Option<X>,
    lnf_rstd: X,
    /// (N,Vp); becomes its own gradient in the backward pass.
    logits: X,
    losses: X,
}

pub struct Engine<B: Backend> {
    pub model: ModelConfig,
    pub train: TrainConfig,
    pub dev: Device<B>,
    specs: Vec<ParamSpec>,
    idx: ParamIndex,
    /// Working weights, in the precision's dtype.
    params: Vec<T<B>>,
    /// Same dtype as the weights.
    grads: Vec<T<B>>,
    /// fp32 master weights under mixed precision (tracked as optimizer state,
    /// as the ZeRO paper counts them); empty for fp32.
    master: Vec<T<B>>,
    opt: Vec<OptState<T<B>>>,
    workspace: T<B>,
    /// Optimizer steps taken.
    step: u64,
    /// Steps skipped because the gradient was not finite.
    skipped_steps: u64,
    /// fp16: the current loss scale and the overflow-free steps since it last changed.
    loss_scale: f32,
    good_steps: u32,
}

/// `&mut v[i]` and, when given, `&mut v[j]` (i != j).
fn pair_mut<X>(v: &mut [X], i: usize, j: Option<usize>) -> (&mut X, Option<&mut X>) {
    match j {
        None => (&mut v[i], None),
        Some(j) => {
            assert_ne!(i, j);
            if i < j {
                let (a, b) = v.split_at_mut(j);
                (&mut a[i], Some(&mut b[0]))
            } else {
                let (a, b) = v.split_at_mut(i);
                (&mut b[0], Some(&mut a[j]))
            }
        }
    }
}

impl<B: Backend> Engine<B> {
    /// Allocates and initialises the model on `be`. Weights depend only on
    /// `train.seed` (one seeded stream per tensor), never on the backend or threads.
    pub fn new(
        model: ModelConfig,
        train: TrainConfig,
        be: B,
        capacity: Option<u64>,
    ) -> Result<Self, OomError> {
        let (specs, idx) = model.param_layout();
        let mut dev = Device::new(be, capacity);
        dev.tracker.set_phase(Phase::Init);
        let alloc_all = |dev: &mut Device<B>, dtype, cat| -> Result<Vec<T<B>>, OomError> {
            specs
                .iter()
                .map(|s| dev.alloc(s.numel(), dtype, cat))
                .collect()
        };
        let wdt = train.precision.dtype();
        let mut params = alloc_all(&mut dev, wdt, Category::Parameters)?;
        let grads = alloc_all(&mut dev, wdt, Category::Gradients)?;
        let mut master = if train.precision.has_master() {
            alloc_all(&mut dev, DType::F32, Category::Optimizer)?
        } else {
            Vec::new()
        };
        let opt = optim::alloc_state(&mut dev, &specs, &train.opt())?;
        let shape = attn_shape(&model, &train);
        let ws_bytes = dev
            .be
            .workspace_bytes(shape, train.attention == Attention::Fused);
        let workspace = dev.alloc_f32(ws_bytes.div_ceil(4), Category::Workspace)?;
        if dev.be.holds_data() {
            let host = init_weights(&specs, train.seed);
            for (t, h) in params.iter_mut().zip(&host) {
                dev.be.upload_f32(&mut t.buf, h);
            }
            for (t, h) in master.iter_mut().zip(&host) {
                dev.be.upload_f32(&mut t.buf, h);
            }
        }
        let loss_scale = match train.precision {
            Precision::Fp16 => train.initial_loss_scale,
            _ => 1.0,
        };
        Ok(Engine {
            model,
            train,
            dev,
            specs,
            idx,
            params,
            grads,
            master,
            opt,
            workspace,
            step: 0,
            skipped_steps: 0,
            loss_scale,
            good_steps: 0,
        })
    }

    pub fn param_specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    pub fn tokens_per_step(&self) -> usize {
        self.train.micro_batch * self.train.seq_len * self.train.grad_accum
    }

    /// The parameters on the host, one vector per tensor (`None` on meta).
    pub fn params_host(&self) -> Option<Vec<Vec<f32>>> {
        self.params
            .iter()
            .map(|t| self.dev.be.download_f32(&t.buf))
            .collect()
    }

    pub fn grads_host(&self) -> Option<Vec<Vec<f32>>> {
        self.grads
            .iter()
            .map(|t| self.dev.be.download_f32(&t.buf))
            .collect()
    }

    /// The fp32 master weights under mixed precision (`None` on meta or for fp32).
    pub fn master_host(&self) -> Option<Vec<Vec<f32>>> {
        if self.master.is_empty() {
            return None;
        }
        self.master
            .iter()
            .map(|t| self.dev.be.download_f32(&t.buf))
            .collect()
    }

    /// Replaces the parameters (tests and checkpoints); shapes must match.
    /// Under mixed precision the master copy gets `host` exactly and the
    /// working copy its rounding.
    pub fn set_params_host(&mut self, host: &[Vec<f32>]) {
        assert_eq!(host.len(), self.params.len());
        for (t, h) in self.params.iter_mut().zip(host) {
            assert_eq!(t.len, h.len());
            self.dev.be.upload_f32(&mut t.buf, h);
        }
        for (t, h) in self.master.iter_mut().zip(host) {
            self.dev.be.upload_f32(&mut t.buf, h);
        }
    }

    /// fp16's current loss scale (`None` for fp32 and bf16, which need none).
    pub fn loss_scale(&self) -> Option<f32> {
        (self.train.precision == Precision::Fp16).then_some(self.loss_scale)
    }

    /// Sets fp16's loss scale (tests plant an overflow with a huge one).
    pub fn set_loss_scale(&mut self, scale: f32) {
        self.loss_scale = scale;
        self.good_steps = 0;
    }

    fn zero_grads(&mut self) {
        for g in &mut self.grads {
            self.dev.fill(g, 0.0);
        }
    }

    fn attn_shape(&self) -> AttnShape {
        attn_shape(&self.model, &self.train)
    }

    /// Optimizer steps skipped so far because the gradient was not finite.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped_steps
    }

    /// One optimizer step over `batches.len()` micro-batches (gradient accumulation).
    pub fn step(&mut self, batches: &[Batch]) -> Result<StepReport, OomError> {
        let mut it = batches.iter();
        self.step_from(batches.len(), || {
            it.next().expect("one batch per micro-batch").clone()
        })
    }

    /// One optimizer step over `k` micro-batches, each fetched from `next` only
    /// once its token buffers are allocated (so an oversized batch is a tracked
    /// OOM, not a host allocation failure) and never on a backend without data.
    pub fn step_from(
        &mut self,
        k: usize,
        mut next: impl FnMut() -> Batch,
    ) -> Result<StepReport, OomError> {
        self.zero_grads();
        let mut loss_sum = Some(0.0f64);
        for _ in 0..k {
            let acts = self.forward(&mut next)?;
            let loss = self.read_loss(&acts);
            loss_sum = loss_sum.zip(loss).map(|(s, l)| s + l as f64);
            // d(mean over k micro-batches of the mean over n tokens) / d(token
            // loss), times fp16's loss scale (1 otherwise)
            let dloss = self.loss_scale / (self.train.micro_batch * self.train.seq_len * k) as f32;
            self.backward(acts, dloss)?;
        }
        let (grad_norm, skipped) = self.optimizer_step();
        Ok(StepReport {
            loss: loss_sum.map(|s| (s / k as f64) as f32),
            grad_norm,
            skipped,
        })
    }

    /// Forward and backward without an optimizer step: fills the gradients and
    /// returns the loss (gradient checks).
    pub fn compute_grads(&mut self, batch: &Batch) -> Result<Option<f32>, OomError> {
        self.zero_grads();
        let acts = self.forward(&mut || batch.clone())?;
        let loss = self.read_loss(&acts);
        let dloss = 1.0 / (self.train.micro_batch * self.train.seq_len) as f32;
        self.backward(acts, dloss)?;
        Ok(loss)
    }

    /// Forward only: the mean loss over the batch.
    pub fn eval_loss(&mut self, batch: &Batch) -> Result<Option<f32>, OomError> {
        let acts = self.forward(&mut || batch.clone())?;
        let loss = self.read_loss(&acts);
        self.free_acts(acts);
        Ok(loss)
    }

    fn read_loss(&self, acts: &Acts<T<B>>) -> Option<f32> {
        let losses = self.dev.be.download_f32(&acts.losses.buf)?;
        let sum: f64 = losses.iter().map(|&l| l as f64).sum();
        Some((sum / losses.len() as f64) as f32)
    }

    fn free_acts(&mut self, acts: Acts<T<B>>) {
        let dev = &mut self.dev;
        for a in acts.blocks.into_iter().rev().flatten() {
            free_block(dev, a);
        }
        for x in acts.resid.into_iter().rev() {
            dev.free(x);
        }
        for t in [
            acts.tokens,
            acts.targets,
            acts.lnf,
            acts.lnf_rstd,
            acts.logits,
            acts.losses,
        ] {
            dev.free(t);
        }
        dev.free_opt(acts.lnf_mean);
    }

    fn forward(&mut self, next: &mut dyn FnMut() -> Batch) -> Result<Acts<T<B>>, OomError> {
        let s = self.attn_shape();
        let Engine {
            model,
            dev,
            params: p,
            idx,
            train,
            workspace,
            ..
        } = self;
        let (t, n, c) = (
            train.seq_len,
            train.micro_batch * train.seq_len,
            model.d_model,
        );
        let (v, vp, eps) = (model.vocab_size, model.padded_vocab(), model.norm_eps());
        let gpt2 = model.family == Family::Gpt2;
        let opt = |i: Option<usize>| i.map(|i| &p[i]);
        let act = Category::Activations;
        let dt = train.precision.dtype();

        dev.tracker.set_phase(Phase::ForwardEmbed);
        let mut tokens = dev.alloc(n, DType::U32, act)?;
        let mut targets = dev.alloc(n, DType::U32, act)?;
        if dev.be.holds_data() {
            let batch = next();
            dev.be.upload_u32(&mut tokens.buf, &batch.inputs);
            dev.be.upload_u32(&mut targets.buf, &batch.targets);
        }
        let mut emb = dev.alloc(n * c, dt, act)?;
        dev.embed_forward(&mut emb, &tokens, &p[idx.wte], opt(idx.wpe), n, t, c);

        let mut resid = vec![emb];
        let mut blocks = Vec::with_capacity(model.n_layer);
        for (l, bi) in idx.blocks.iter().enumerate() {
            dev.tracker.set_phase(Phase::Forward(l));
            let (a, out) = block_forward(
                dev,
                model,
                p,
                bi,
                &resid[l],
                s,
                train.attention,
                workspace,
                true,
            )?;
            resid.push(out.expect("asked for the block output"));
            blocks.push(match train.checkpointing {
                Checkpointing::None => Some(a),
                // Keep only the block input (the residual stream, already in
                // `resid`); the backward pass recomputes the rest.
                Checkpointing::Full => {
                    free_block(dev, a);
                    None
                }
            });
        }

        dev.tracker.set_phase(Phase::ForwardHead);
        let x = resid.last().expect("embedding output");
        let (lnf, lnf_mean, lnf_rstd) =
            norm_layer(dev, x, &p[idx.lnf_w], opt(idx.lnf_b), gpt2, n, c, eps)?;
        let head = idx.lm_head.unwrap_or(idx.wte);
        let mut logits = dev.alloc(n * vp, dt, act)?;
        dev.matmul_forward(&mut logits, &lnf, &p[head], None, n, c, vp);
        let mut losses = dev.alloc_f32(n, act)?;
        dev.crossentropy_forward(&mut losses, &logits, &targets, n, v, vp);
        Ok(Acts {
            tokens,
            targets,
            resid,
            blocks,
            lnf,
            lnf_mean,
            lnf_rstd,
            logits,
            losses,
        })
    }

    /// Backward pass; gradients accumulate into `self.grads`. Frees `acts` as it goes.
    fn backward(&mut self, acts: Acts<T<B>>, dloss: f32) -> Result<(), OomError> {
        let s = self.attn_shape();
        let Engine {
            model,
            dev,
            params: p,
            grads: g,
            idx,
            train,
            workspace,
            ..
        } = self;
        let (t, n, c) = (
            train.seq_len,
            train.micro_batch * train.seq_len,
            model.d_model,
        );
        let (v, vp) = (model.vocab_size, model.padded_vocab());
        let (qkvw, upw, dff) = (model.qkv_width(), model.up_width(), model.d_ff());
        let gpt2 = model.family == Family::Gpt2;
        let tmp = Category::Temporaries;
        let dt = train.precision.dtype();
        let Acts {
            tokens,
            targets,
            mut resid,
            mut blocks,
            lnf,
            lnf_mean,
            lnf_rstd,
            mut logits,
            losses,
        } = acts;

        dev.tracker.set_phase(Phase::BackwardHead);
        dev.free(losses);
        dev.crossentropy_backward(&mut logits, &targets, dloss, n, v, vp);
        dev.free(targets);
        let head = idx.lm_head.unwrap_or(idx.wte);
        let mut dlnf = dev.alloc(n * c, dt, tmp)?;
        dev.matmul_backward(
            &mut dlnf,
            &mut g[head],
            None,
            &logits,
            &lnf,
            &p[head],
            n,
            c,
            vp,
        );
        dev.free(logits);
        // dres: gradient of the residual stream, carried down through the blocks.
        let mut dres = dev.alloc(n * c, dt, tmp)?;
        {
            let x = resid.last().expect("embedding output");
            let (dw, db) = pair_mut(g, idx.lnf_w, idx.lnf_b);
            dev.norm_backward(
                &mut dres,
                dw,
                db,
                &dlnf,
                x,
                &p[idx.lnf_w],
                lnf_mean.as_ref(),
                &lnf_rstd,
                n,
                c,
            );
        }
        for x in [dlnf, lnf, lnf_rstd] {
            dev.free(x);
        }
        dev.free_opt(lnf_mean);

        for (l, bi) in idx.blocks.iter().enumerate().rev() {
            dev.tracker.set_phase(Phase::Backward(l));
            let x = &resid[l];
            let a = match blocks.pop().expect("one entry per block") {
                Some(a) => a,
                None => {
                    dev.tracker.set_phase(Phase::Recompute(l));
                    let (a, _) =
                        block_forward(dev, model, p, bi, x, s, train.attention, workspace, false)?;
                    dev.tracker.set_phase(Phase::Backward(l));
                    a
                }
            };
            // MLP: dres is d(out) = d(mlp output)
            let mut dact = dev.alloc(n * dff, dt, tmp)?;
            let (dw, db) = pair_mut(g, bi.down_w, bi.down_b);
            dev.matmul_backward(&mut dact, dw, db, &dres, &a.act, &p[bi.down_w], n, dff, c);
            let dup = if gpt2 {
                dev.gelu_backward(&mut dact, &a.up, n * dff);
                dact
            } else {
                let mut dgu = dev.alloc(n * upw, dt, tmp)?;
                dev.swiglu_backward(&mut dgu, &dact, &a.up, n, dff);
                dev.free(dact);
                dgu
            };
            let mut dln2 = dev.alloc(n * c, dt, tmp)?;
            let (dw, db) = pair_mut(g, bi.up_w, bi.up_b);
            dev.matmul_backward(&mut dln2, dw, db, &dup, &a.ln2, &p[bi.up_w], n, c, upw);
            dev.free(dup);
            let (dw, db) = pair_mut(g, bi.ln2_w, bi.ln2_b);
            dev.norm_backward(
                &mut dres,
                dw,
                db,
                &dln2,
                &a.res2,
                &p[bi.ln2_w],
                a.ln2_mean.as_ref(),
                &a.ln2_rstd,
                n,
                c,
            );
            dev.free(dln2);
            // attention: dres is now d(res2) = d(o-proj output)
            let mut datty = dev.alloc(n * c, dt, tmp)?;
            let (dw, db) = pair_mut(g, bi.o_w, bi.o_b);
            dev.matmul_backward(&mut datty, dw, db, &dres, &a.atty, &p[bi.o_w], n, c, c);
            let mut dqkv = dev.alloc(n * qkvw, dt, tmp)?;
            match train.attention {
                Attention::Eager => {
                    let mut datt = dev.alloc(s.b * s.n_head * t * t, dt, tmp)?;
                    dev.attention_backward(&mut dqkv, &mut datt, &datty, &a.qkv, &a.att, s);
                    dev.free(datt);
                }
                Attention::Fused => {
                    let (out, lse) = (&a.atty, &a.att);
                    dev.flash_attention_backward(&mut dqkv, &datty, out, lse, &a.qkv, workspace, s);
                }
            }
            dev.free(datty);
            if !gpt2 {
                dev.rope_backward(&mut dqkv, s, model.rope_theta());
            }
            let mut dln1 = dev.alloc(n * c, dt, tmp)?;
            let (dw, db) = pair_mut(g, bi.qkv_w, bi.qkv_b);
            dev.matmul_backward(&mut dln1, dw, db, &dqkv, &a.ln1, &p[bi.qkv_w], n, c, qkvw);
            dev.free(dqkv);
            let (dw, db) = pair_mut(g, bi.ln1_w, bi.ln1_b);
            dev.norm_backward(
                &mut dres,
                dw,
                db,
                &dln1,
                x,
                &p[bi.ln1_w],
                a.ln1_mean.as_ref(),
                &a.ln1_rstd,
                n,
                c,
            );
            dev.free(dln1);
            free_block(dev, a);
            // Block l's output: its consumers (block l+1 or the head) are done.
            let out = resid.pop().expect("block output");
            dev.free(out);
        }

        dev.tracker.set_phase(Phase::BackwardEmbed);
        let (dwte, dwpe) = pair_mut(g, idx.wte, idx.wpe);
        dev.embed_backward(dwte, dwpe, &dres, &tokens, n, t, c);
        let emb = resid.pop().expect("embedding output");
        for x in [dres, emb, tokens] {
            dev.free(x);
        }
        Ok(())
    }

    /// Unscales (fp16), clips by global norm, then one optimizer update.
    /// Returns the norm before clipping, and whether the update was skipped (a
    /// non-finite gradient: the parameters and optimizer state stay as they
    /// were, and under fp16 the loss scale halves, as PyTorch's `GradScaler`
    /// and DeepSpeed's dynamic loss scaler do).
    fn optimizer_step(&mut self) -> (Option<f32>, bool) {
        let Engine {
            dev,
            params,
            grads,
            master,
            opt,
            specs,
            train,
            ..
        } = self;
        dev.tracker.set_phase(Phase::Optimizer);
        let fp16 = train.precision == Precision::Fp16;
        let mut norm_sq = Some(0.0f64);
        for g in grads.iter() {
            norm_sq = norm_sq.zip(dev.sum_squares(g)).map(|(a, b)| a + b);
        }
        // The gradients carry the loss scale (1 except under fp16).
        let norm = norm_sq.map(|s| s.sqrt() / self.loss_scale as f64);
        if norm.is_some_and(|n| !n.is_finite()) {
            self.skipped_steps += 1;
            if fp16 {
                self.loss_scale *= 0.5;
                self.good_steps = 0;
            }
            return (norm.map(|n| n as f32), true);
        }
        // Same rule as torch.nn.utils.clip_grad_norm_: scale by clip / (norm + 1e-6) when norm > clip.
        let clip = match norm {
            Some(norm) if train.grad_clip > 0.0 && norm > train.grad_clip as f64 => {
                train.grad_clip as f64 / (norm + 1e-6)
            }
            _ => 1.0,
        };
        // Unscaling and clipping fold into one multiplier the update applies.
        let grad_scale = (clip / self.loss_scale as f64) as f32;
        self.step += 1;
        // Mixed precision updates the fp32 master copy, then rounds it into
        // the 16-bit weights the next forward reads.
        let updated = if master.is_empty() {
            &mut params[..]
        } else {
            &mut master[..]
        };
        optim::update(
            dev,
            updated,
            grads,
            opt,
            specs,
            &train.opt(),
            self.step,
            grad_scale,
        );
        for (p, m) in params.iter_mut().zip(master.iter()) {
            dev.convert(p, m);
        }
        if fp16 {
            self.good_steps += 1;
            if self.good_steps >= train.loss_scale_window {
                self.loss_scale *= 2.0;
                self.good_steps = 0;
            }
        }
        (norm.map(|n| n as f32), false)
    }

    /// Frees everything the engine holds; the tracker then shows zero live bytes.
    pub fn release(mut self) -> Device<B> {
        let mut dev = self.dev;
        for t in self
            .params
            .drain(..)
            .chain(self.grads.drain(..))
            .chain(self.master.drain(..))
        {
            dev.free(t);
        }
        optim::free_state(&mut dev, std::mem::take(&mut self.opt));
        dev.free(self.workspace);
        dev
    }
}

/// One transformer block's forward pass from its input `x` (N,C): the saved
/// tensors, and the block output unless `with_out` is false (a recomputation
/// under checkpointing, where the output was kept).
fn block_forward<B: Backend>(
    dev: &mut Device<B>,
    model: &ModelConfig,
    p: &[T<B>],
    bi: &BlockIndex,
    x: &T<B>,
    s: AttnShape,
    attention: Attention,
    ws: &mut T<B>,
    with_out: bool,
) -> Result<BlockOut<B>, OomError> {
    let (t, n, c) = (s.t, s.b * s.t, model.d_model);
    let eps = model.norm_eps();
    let (qkvw, upw, dff) = (model.qkv_width(), model.up_width(), model.d_ff());
    let gpt2 = model.family == Family::Gpt2;
    let opt = |i: Option<usize>| i.map(|i| &p[i]);
    let act = Category::Activations;
    // Activations take the block input's dtype (16-bit under mixed precision).
    let dt = x.dtype;
    // attention: ln1 -> qkv (-> rope) -> attention -> o-proj, + residual
    let (ln1, ln1_mean, ln1_rstd) =
        norm_layer(dev, x, &p[bi.ln1_w], opt(bi.ln1_b), gpt2, n, c, eps)?;
    let mut qkv = dev.alloc(n * qkvw, dt, act)?;
    dev.matmul_forward(&mut qkv, &ln1, &p[bi.qkv_w], opt(bi.qkv_b), n, c, qkvw);
    if !gpt2 {
        dev.rope_forward(&mut qkv, s, model.rope_theta());
    }
    let mut atty = dev.alloc(n * c, dt, act)?;
    let att = match attention {
        Attention::Eager => {
            let mut att = dev.alloc(s.b * s.n_head * t * t, dt, act)?;
            dev.attention_forward(&mut atty, &mut att, &qkv, s);
            att
        }
        Attention::Fused => {
            let mut lse = dev.alloc_f32(s.b * s.n_head * t, act)?;
            dev.flash_attention_forward(&mut atty, &mut lse, &qkv, ws, s);
            lse
        }
    };
    let mut proj = dev.alloc(n * c, dt, Category::Temporaries)?;
    dev.matmul_forward(&mut proj, &atty, &p[bi.o_w], opt(bi.o_b), n, c, c);
    let mut res2 = dev.alloc(n * c, dt, act)?;
    dev.add(&mut res2, x, &proj, n * c);
    dev.free(proj);
    // MLP: ln2 -> up -> gelu | swiglu -> down, + residual
    let (ln2, ln2_mean, ln2_rstd) =
        norm_layer(dev, &res2, &p[bi.ln2_w], opt(bi.ln2_b), gpt2, n, c, eps)?;
    let mut up = dev.alloc(n * upw, dt, act)?;
    dev.matmul_forward(&mut up, &ln2, &p[bi.up_w], opt(bi.up_b), n, c, upw);
    let mut a = dev.alloc(n * dff, dt, act)?;
    if gpt2 {
        dev.gelu_forward(&mut a, &up, n * dff);
    } else {
        dev.swiglu_forward(&mut a, &up, n, dff);
    }
    // The block output; a recomputation skips it, it was checkpointed.
    let out = if with_out {
        let mut mlp = dev.alloc(n * c, dt, Category::Temporaries)?;
        dev.matmul_forward(&mut mlp, &a, &p[bi.down_w], opt(bi.down_b), n, dff, c);
        let mut out = dev.alloc(n * c, dt, act)?;
        dev.add(&mut out, &res2, &mlp, n * c);
        dev.free(mlp);
        Some(out)
    } else {
        None
    };
    let a = BlockActs {
        ln1,
        ln1_mean,
        ln1_rstd,
        qkv,
        att,
        atty,
        res2,
        ln2,
        ln2_mean,
        ln2_rstd,
        up,
        act: a,
    };
    Ok((a, out))
}

/// A norm's output and what its backward needs (`mean` for LayerNorm only),
/// saved as activations in that order.
fn norm_layer<B: Backend>(
    dev: &mut Device<B>,
    x: &T<B>,
    w: &T<B>,
    b: Option<&T<B>>,
    layernorm: bool,
    n: usize,
    c: usize,
    eps: f32,
) -> Result<NormOut<B>, OomError> {
    let act = Category::Activations;
    // The output takes the input's dtype; the statistics stay fp32.
    let dt = x.dtype;
    let mut out = dev.alloc(n * c, dt, act)?;
    let mut mean = if layernorm {
        Some(dev.alloc_f32(n, act)?)
    } else {
        None
    };
    let mut rstd = dev.alloc_f32(n, act)?;
    dev.norm_forward(&mut out, mean.as_mut(), &mut rstd, x, w, b, n, c, eps);
    Ok((out, mean, rstd))
}

fn attn_shape(model: &ModelConfig, train: &TrainConfig) -> AttnShape {
    AttnShape {
        b: train.micro_batch,
        t: train.seq_len,
        n_head: model.n_head,
        n_kv_head: model.n_kv_head(),
        head_dim: model.head_dim(),
    }
}

fn free_block<B: Backend>(dev: &mut Device<B>, a: BlockActs<T<B>>) {
    for x in [
        a.ln1, a.ln1_rstd, a.qkv, a.att, a.atty, a.res2, a.ln2, a.ln2_rstd, a.up, a.act,
    ] {
        dev.free(x);
    }
    dev.free_opt(a.ln1_mean);
    dev.free_opt(a.ln2_mean);
}

/// Initial weights on the host: one seeded stream per tensor, so the result does
/// not depend on thread scheduling, and a later sharded run can initialise any
/// tensor on its own.
pub fn init_weights(specs: &[ParamSpec], seed: u64) -> Vec<Vec<f32>> {
    use rayon::prelude::*;
    specs
        .par_iter()
        .enumerate()
        .map(|(i, spec)| {
            let n = spec.numel();
            match spec.init {
                Init::Zeros => vec![0.0; n],
                Init::Ones => vec![1.0; n],
                Init::Normal(std) => {
                    let mut rng =
                        Rng::new(seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                    (0..n).map(|_| (rng.normal() * std as f64) as f32).collect()
                }
            }
        })
        .collect()
}
