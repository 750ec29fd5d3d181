//! One micro-batch's forward and backward, read top to bottom as llm.c's
//! `gpt2_forward` and `gpt2_backward` are: embed, each block, the head and
//! the loss; then the same layers in reverse.
//!
//! What every feature adds to a layer lives in the layer, not in the pass:
//! a [`Linear`] hides NF4 dequantisation (QLoRA), the sequence-parallel
//! gather and its LoRA adapters in its own forward and backward; a
//! [`Pass`] holds what one pass borrows from the engine (the parameter and
//! gradient stores, the tensor-parallel group, ZeRO's unit hooks, the
//! pipeline's links, the framework profile) so no layer takes them as
//! loose arguments. The allocation order is the engine's contract with
//! the tracker: meta, cpu and cuda run this same code, and its order is
//! what the PyTorch fixtures were matched against.

mod sac;

use super::device::Pair;
use super::framework::EagerMask;
use super::*;
use crate::backend::AttnOpts;
use crate::config::model::MoeIndex;

/// One projection of a block: its weight and bias (indices into the flat
/// parameter store, which ZeRO shards and the optimizer walks), its input
/// and output widths on this rank, how tensor parallelism splits it, and
/// which LoRA adapters sit on it (`proj`). Whether the weight is NF4 and
/// whether it trains are the pass's (QLoRA and LoRA apply to every block
/// projection alike).
#[derive(Clone, Copy)]
struct Linear {
    w: usize,
    b: Option<usize>,
    proj: Proj,
    inp: usize,
    out: usize,
    /// Row-parallel (o and down, Megatron's `RowParallelLinear`): its
    /// output is this rank's partial sum, reduced by the caller, and its
    /// bias is added once, on the group's first rank. Column-parallel (qkv
    /// and up): under sequence parallelism it gathers its input's tokens.
    row: bool,
}

/// One of a block's q and k norms: its columns of q|k|v `(offset,
/// width)`, the width it normalises over, its weight tensor.
type QkPiece = ((usize, usize), usize, usize);

/// A block's layers: in a routed block, the experts and, when it has one,
/// the shared expert as `up` and `down`.
struct BlockLayers {
    ln1: (usize, Option<usize>),
    qkv: Linear,
    o: Linear,
    ln2: (usize, Option<usize>),
    up: Option<Linear>,
    down: Option<Linear>,
    moe: Option<(MoeIndex, moe::MoeShape)>,
    /// Gemma's norms of the attention's and the MLP's outputs.
    post_attn: Option<usize>,
    post_mlp: Option<usize>,
}

impl BlockLayers {
    fn of<B: Backend>(ps: &Pass<'_, B>, l: usize) -> Self {
        let (model, c) = (ps.model, ps.model.d_model);
        let mut ly = Self::new(&ps.idx.blocks[l], ps.widths, c);
        if let (Some(mi), Some(m)) = (ps.idx.blocks[l].moe, model.moe_at(l)) {
            // The shared expert and every routed one are split over the
            // tensor-parallel group as the dense MLP is (`tensor.rs`).
            let size = ps.tp.as_ref().map_or(1, |tp| tp.size());
            let dff = model.dense_ff(l).unwrap_or(0) / size;
            if let (Some(up), Some(down)) = (&mut ly.up, &mut ly.down) {
                (up.out, down.inp) = (2 * dff, dff);
            }
            let mut sh = moe::MoeShape::new(m, c, ps.n, ps.train.capacity_factor);
            sh.i /= size;
            ly.moe = Some((mi, sh));
        }
        ly
    }

    fn new(bi: &BlockIndex, wd: tensor::Widths, c: usize) -> Self {
        let linear = |w, b, proj, inp, out, row| Linear {
            w,
            b,
            proj,
            inp,
            out,
            row,
        };
        BlockLayers {
            ln1: (bi.ln1_w, bi.ln1_b),
            qkv: linear(bi.qkv_w, bi.qkv_b, Proj::Qkv, c, wd.qkv, false),
            o: linear(bi.o_w, bi.o_b, Proj::O, wd.attn, c, true),
            ln2: (bi.ln2_w, bi.ln2_b),
            up: (bi.up_w).map(|w| linear(w, bi.up_b, Proj::Up, c, wd.up, false)),
            down: (bi.down_w).map(|w| linear(w, bi.down_b, Proj::Down, wd.dff, c, true)),
            moe: None,
            post_attn: bi.post_attn_norm,
            post_mlp: bi.post_mlp_norm,
        }
    }
}

impl Linear {
    /// `x (N, inp)` through the projection into a new `(N, out)` tensor
    /// tracked as `cat`, the adapters' `scale · x Aᵀ Bᵀ` added (each
    /// adapter's `x Aᵀ` pushed onto `saved`). A row-parallel output is not
    /// yet reduced.
    fn forward<B: Backend>(
        &self,
        ps: &mut Pass<'_, B>,
        l: usize,
        x: &T<B>,
        cat: Category,
        saved: &mut Vec<T<B>>,
    ) -> Result<T<B>, OomError> {
        let n = ps.n;
        let mut y = ps.dev.alloc(n * self.out, x.dtype, cat)?;
        let wq = dequant(
            ps.dev,
            &ps.p[self.w],
            self.inp * self.out,
            ps.qlora,
            x.dtype,
        )?;
        let w = wq.as_ref().unwrap_or(&ps.p[self.w]);
        let gathered = match self.row {
            true => None,
            false => (ps.dev).beside_gemm(Pair::Next, |dev| gather(dev, ps.tp.as_mut(), x))?,
        };
        let inp = gathered.as_ref().unwrap_or(x);
        let first = ps.tp.as_ref().is_none_or(|tp| tp.rank() == 0);
        let b = (self.b.filter(|_| first || !self.row)).map(|i| &ps.p[i]);
        (ps.dev).split_gemm(|dev| dev.matmul_forward(&mut y, inp, w, b, n, self.inp, self.out));
        ps.dev.free_opt(gathered);
        ps.dev.free_opt(wq);
        let lora = ps.lora(l);
        let out = Some((&mut y, self.out));
        lora_forward(ps.dev, ps.p, lora, self.proj, x, out, n, saved)?;
        Ok(y)
    }

    /// A recomputation that skips the projection (its output was kept)
    /// still saves the adapters' `x Aᵀ` for their backward.
    fn save_adapter_inputs<B: Backend>(
        &self,
        ps: &mut Pass<'_, B>,
        l: usize,
        x: &T<B>,
        saved: &mut Vec<T<B>>,
    ) -> Result<(), OomError> {
        let lora = ps.lora(l);
        lora_forward(ps.dev, ps.p, lora, self.proj, x, None, ps.n, saved)
    }

    /// From the output gradient `dout` and the saved input `x`: the input
    /// gradient (a new temporary; for a column-parallel projection this
    /// rank's partial sum, which the caller reduces), the weight's and
    /// bias's gradients accumulated (none when frozen), and the adapters'
    /// backward (`ts`: the block's saved `x Aᵀ`). Under sequence
    /// parallelism the operand holding only this rank's tokens is gathered:
    /// a row-parallel projection's `dout`, a column-parallel one's `x`.
    fn backward<B: Backend>(
        &self,
        ps: &mut Pass<'_, B>,
        l: usize,
        dout: &T<B>,
        x: &T<B>,
        ts: &[T<B>],
    ) -> Result<T<B>, OomError> {
        let (n, dt) = (ps.n, ps.dt);
        let mut dx = ps.dev.alloc(n * self.inp, dt, Category::Temporaries)?;
        let (dw, db) = wgrads(ps.g, ps.frozen, self.w, self.b);
        let wq = dequant(ps.dev, &ps.p[self.w], self.inp * self.out, ps.qlora, dt)?;
        let w = wq.as_ref().unwrap_or(&ps.p[self.w]);
        let local = if self.row { dout } else { x };
        let gathered =
            (ps.dev).beside_gemm(Pair::Next, |dev| gather(dev, ps.tp.as_mut(), local))?;
        let full = gathered.as_ref().unwrap_or(local);
        let (d, inp) = if self.row { (full, x) } else { (dout, full) };
        (ps.dev).split_gemm(|dev| {
            dev.matmul_backward(&mut dx, dw, db, d, inp, w, n, self.inp, self.out)
        });
        ps.dev.free_opt(gathered);
        ps.dev.free_opt(wq);
        let lora = ps.lora(l);
        lora_backward(
            ps.dev, ps.p, ps.g, lora, ts, self.proj, dout, self.out, x, &mut dx, n,
        )?;
        Ok(dx)
    }
}

/// What one micro-batch's forward or backward borrows from the engine, and
/// what it derives from the knobs once.
pub(super) struct Pass<'e, B: Backend> {
    dev: &'e mut Device<B>,
    model: &'e ModelConfig,
    train: &'e TrainConfig,
    p: &'e mut Vec<T<B>>,
    g: &'e mut Vec<T<B>>,
    idx: &'e ParamIndex,
    specs: &'e [ParamSpec],
    trainable: &'e [bool],
    adapters: &'e [Vec<Adapter>],
    workspace: &'e mut T<B>,
    dist: &'e mut Option<Dist<B>>,
    pipe: &'e mut Option<Pipe<B>>,
    tp: &'e mut Option<Tp<B>>,
    ep: &'e mut Option<super::expert::Ep<B>>,
    hf: Option<&'e HfRules>,
    widths: tensor::Widths,
    s: AttnShape,
    /// hf-eager with `set_to_none`: gradients are made by the backward.
    lazy: bool,
    /// Tokens in the micro-batch, and how many of them this rank's
    /// residual stream and norms hold (its share under sequence
    /// parallelism).
    n: usize,
    nl: usize,
    /// The activations' dtype.
    dt: DType,
    /// LoRA: the base is frozen (no weight gradients).
    frozen: bool,
    /// QLoRA: every block projection is stored NF4 (`crate::nf4`).
    qlora: bool,
    /// LoRA's backward: the frozen norms' weight gradients, discarded.
    scratch: NormScratch<B>,
    /// The backward's d loss / d token loss (`Pass::backward` sets it).
    dloss: f32,
    /// The optimizer in the backward: the master copy, the state and the
    /// step's number, when this backward steps each unit as its gradients
    /// are complete ([`Pass::step_unit`]).
    stepper: Option<Stepper<'e, B>>,
}

/// What [`Pass::step_unit`] updates besides the weights.
struct Stepper<'e, B: Backend> {
    master: &'e mut Vec<T<B>>,
    opt: &'e mut Vec<OptState<T<B>>>,
    step: u64,
}

impl<'e, B: Backend> Pass<'e, B> {
    /// hf-eager: charges the launches and bytes of transformers' unfused
    /// kernels that `pick` names (a block's or the head's, forward or
    /// backward); the engine's own profile has none.
    fn charge_unfused(&mut self, pick: impl Fn(&HfRules) -> super::framework::Unfused) {
        if let Some(h) = self.hf {
            self.dev.charge_unfused("hf_unfused", pick(h));
        }
    }

    pub(super) fn new(e: &'e mut Engine<B>) -> Self {
        let s = e.attn_shape();
        let Engine {
            model,
            train,
            dev,
            params,
            grads,
            idx,
            specs,
            trainable,
            adapters,
            workspace,
            dist,
            pipe,
            hf,
            tp,
            ep,
            widths,
            lazy_grads,
            master,
            opt,
            step,
            stepping,
            ..
        } = e;
        let n = train.micro_batch * train.seq_len;
        let stepper = stepping.then_some(Stepper {
            master,
            opt,
            step: *step,
        });
        let hf: &'e Option<HfRules> = hf;
        Pass {
            nl: tp.as_ref().map_or(n, |tp| tp.rows(n)),
            n,
            dt: train.precision.dtype(),
            frozen: !adapters.is_empty(),
            qlora: train.finetune == Finetune::Qlora,
            lazy: *lazy_grads,
            widths: *widths,
            hf: hf.as_ref(),
            s,
            dev,
            model,
            train,
            p: params,
            g: grads,
            idx,
            specs,
            trainable,
            adapters,
            workspace,
            dist,
            pipe,
            tp,
            ep,
            scratch: None,
            dloss: 0.0,
            stepper,
        }
    }

    /// Block `l`'s adapters on its dense projections, their scale and
    /// whether the base is NF4.
    fn lora(&self, l: usize) -> (&'e [Adapter], f32, bool) {
        let ads = lora::split_experts(self.block_adapters(l)).0;
        (ads, self.train.lora.scale(), self.qlora)
    }

    /// Block `l`'s adapters on its routed experts, and their scale.
    fn expert_lora(&self, l: usize) -> moe::ExpertLora<'e> {
        let ads = lora::split_experts(self.block_adapters(l)).1;
        (ads, self.train.lora.scale())
    }

    fn block_adapters(&self, l: usize) -> &'e [Adapter] {
        let adapters: &'e [Vec<Adapter>] = self.adapters;
        adapters.get(l).map_or(&[][..], |v| &v[..])
    }

    /// ZeRO's hooks around a stage: zero3 gathers a unit's weights before
    /// it runs and frees them after; in the backward zero2/3 give it full
    /// gradients, reduce-scattered into the shards when it is done.
    fn hook(&mut self, st: Stage, after: bool, backward: bool) -> Result<(), OomError> {
        unit_hook(self.dist, (self.dev, self.p, self.g), st, after, backward)
    }

    /// The optimizer in the backward: the trainable tensors of `ids`, whose
    /// gradients are now complete, are stepped one by one, each gradient
    /// freed right after its step (torchtune's `OptimizerInBackward` steps
    /// one optimizer per parameter and `zero_grad`s it, so torch.optim's
    /// temporaries are one parameter's at a time), in the backward's
    /// phase. memfit steps a unit (a block, the head, the embedding) at
    /// its end, where PyTorch steps each parameter as its AccumulateGrad
    /// runs: a block's gradients live to the block's end. Nothing unless
    /// this backward steps.
    fn step_unit(&mut self, ids: impl IntoIterator<Item = usize>) -> Result<(), OomError> {
        let Some(st) = self.stepper.as_mut() else {
            return Ok(());
        };
        let cfg = self.train.opt();
        let torch = self.hf.map(|h| (h.optimizer_impl, ParamGroups::One));
        for i in ids {
            if !self.trainable[i] || self.g[i].len == 0 {
                continue;
            }
            let states = (
                &mut self.p[..],
                &mut st.master[..],
                &mut st.opt[..],
                &self.g[..],
            );
            local_update(
                self.dev,
                states,
                self.specs,
                &[i],
                &cfg,
                torch,
                (st.step, 1.0),
            )?;
            let ph = self.dev.placeholder(self.g[i].dtype, Category::Gradients);
            let g = std::mem::replace(&mut self.g[i], ph);
            self.dev.free(g);
        }
        Ok(())
    }

    /// The optimizer in the backward under memfit's own schedule: the
    /// gradients of `ids` made (zeroed) as their unit's backward starts
    /// (hf-eager makes them where autograd does).
    fn make_unit_grads(&mut self, ids: &[usize]) -> Result<(), OomError> {
        if !self.lazy || self.hf.is_some() {
            return Ok(());
        }
        let (specs, trainable) = (self.specs, self.trainable);
        make_grads(self.dev, self.g, specs, trainable, ids, Category::Gradients)
    }

    /// Whether the running chunk holds the embedding and the head (the
    /// whole model without a pipeline).
    fn ends(&self) -> (bool, bool) {
        let pipe = self.pipe.as_ref();
        (pipe.is_none_or(Pipe::first), pipe.is_none_or(Pipe::last))
    }

    /// The running chunk's blocks.
    fn layers(&self) -> std::ops::Range<usize> {
        let all = 0..self.model.n_layer;
        self.pipe.as_ref().map_or(all, Pipe::layers)
    }

    /// A row-parallel output's partial sums summed over the group.
    /// Whether this rank is its tensor-parallel group's first (or has no
    /// group): where a replicated layer's input gradient joins the
    /// column-parallel layers' partial sums, so that the group's reduce
    /// counts it once.
    fn tp_first(&self) -> bool {
        self.tp.as_ref().is_none_or(|tp| tp.rank() == 0)
    }

    fn reduce(&mut self, t: T<B>) -> Result<T<B>, OomError> {
        reduce(self.dev, self.tp.as_mut(), t)
    }

    /// [`Pass::reduce`] of the output (or input gradient) of the split
    /// projection's GEMM just run, paired with it (`Pair::Previous`).
    fn reduce_gemm(&mut self, t: T<B>) -> Result<T<B>, OomError> {
        let tp = self.tp.as_mut();
        (self.dev).beside_gemm(Pair::Previous, |dev| reduce(dev, tp, t))
    }

    /// A norm over this rank's tokens of `x`: its output, mean (LayerNorm)
    /// and reciprocal std, saved as activations.
    fn norm(&mut self, x: &T<B>, (w, b): (usize, Option<usize>)) -> Result<NormOut<B>, OomError> {
        let (gpt2, c) = (self.model.family == Family::Gpt2, self.model.d_model);
        let b = b.map(|i| &self.p[i]);
        let (eps, offset) = (self.model.norm_eps(), self.model.offset_norms());
        norm_layer(self.dev, x, &self.p[w], b, (gpt2, offset), self.nl, c, eps)
    }

    /// The backward of [`Pass::norm`]: `dres += d(norm input)`, and the
    /// norm's weight gradients (LoRA's scratch when frozen).
    fn norm_backward(
        &mut self,
        dres: &mut T<B>,
        dout: &T<B>,
        x: &T<B>,
        (w, b): (usize, Option<usize>),
        (mean, rstd): (Option<&T<B>>, &T<B>),
    ) {
        let c = self.model.d_model;
        let (dw, db) = norm_grads(self.g, &mut self.scratch, w, b);
        let (nl, offset) = (self.nl, self.model.offset_norms());
        (self.dev).norm_backward(dres, dw, db, dout, x, &self.p[w], mean, rstd, nl, c, offset);
    }

    /// Gemma's norm of a sublayer's output `y` (saved, with its rstd) into
    /// a temporary the residual add consumes.
    fn post_norm(&mut self, y: &T<B>, w: usize) -> Result<(T<B>, T<B>), OomError> {
        let (nl, c) = (self.nl, self.model.d_model);
        let mut out = self.dev.alloc(nl * c, y.dtype, Category::Temporaries)?;
        let mut rstd = self.dev.alloc_f32(nl, Category::Activations)?;
        let (eps, wt) = (self.model.norm_eps(), &self.p[w]);
        (self.dev).norm_forward(&mut out, None, &mut rstd, y, wt, None, nl, c, eps, true);
        Ok((out, rstd))
    }

    /// The backward of [`Pass::post_norm`]: the gradient of its input `y`
    /// from that of its output `dout`.
    fn post_norm_backward(
        &mut self,
        dout: &T<B>,
        w: usize,
        (y, rstd): &(T<B>, T<B>),
    ) -> Result<T<B>, OomError> {
        let len = self.nl * self.model.d_model;
        let mut dy = self.dev.alloc_zeroed(len, self.dt, Category::Temporaries)?;
        self.norm_backward(&mut dy, dout, y, (w, None), (None, rstd));
        Ok(dy)
    }

    /// Block `l`'s attention options: Gemma's scale, soft cap and window.
    fn attn_opts(&self, l: usize) -> AttnOpts {
        let m = self.model;
        AttnOpts {
            scale: m.attn_scale(),
            softcap: m.attn_softcap(),
            window: m.sliding_window(l),
        }
    }

    /// `a + b` into a new activation; `b` (a projection's output) is freed.
    fn residual(&mut self, a: &T<B>, b: T<B>) -> Result<T<B>, OomError> {
        let out = self.residual_keeping(a, &b)?;
        self.dev.free(b);
        Ok(out)
    }

    /// `a + b` into a new activation, `b` left as it is.
    fn residual_keeping(&mut self, a: &T<B>, b: &T<B>) -> Result<T<B>, OomError> {
        let len = self.nl * self.model.d_model;
        let mut out = self.dev.alloc(len, self.dt, Category::Activations)?;
        self.dev.add(&mut out, a, b, len);
        Ok(out)
    }

    // ---- forward ----------------------------------------------------------

    /// The forward pass of one micro-batch. `dloss` scales each token's
    /// loss gradient, for a fused loss that makes its gradients here.
    pub(super) fn forward(
        mut self,
        next: &mut dyn FnMut() -> Batch,
        dloss: f32,
    ) -> Result<Acts<T<B>>, OomError> {
        let ((first, last), layers) = (self.ends(), self.layers());
        self.dev.tracker.set_phase(match first {
            true => Phase::ForwardEmbed,
            false if layers.is_empty() => Phase::ForwardHead,
            false => Phase::Forward(layers.start),
        });
        if first {
            self.hook(Stage::Embed, false, false)?;
        }
        let (tokens, targets, host_targets) = self.read_batch(next, first, last)?;
        let input = self.stage_input(tokens.as_ref())?;
        let extra = match (self.hf, first) {
            (Some(h), true) => alloc_saved(self.dev, &h.embed_saved)?,
            _ => Vec::new(),
        };
        let mut mask = match self.eager_mask() {
            Some(m) => Some(self.dev.alloc(m.len, m.dtype, Category::Activations)?),
            None => None,
        };
        let mut resid = vec![input];
        let mut blocks = Vec::with_capacity(layers.len());
        // hf-eager, autocast: the checkpointed blocks' weight casts, held
        // by autocast's cache to the end of the forward.
        let mut cast_cache = Vec::new();
        let mut aux = self.dev.be.holds_data().then_some(0.0);
        for (j, l) in layers.clone().enumerate() {
            self.dev.tracker.set_phase(Phase::Forward(l));
            self.hook(Stage::Block(l), false, false)?;
            let (a, out) = self.block_forward(l, &resid[j], true)?;
            if let Some(r) = a.moe.as_ref().and_then(|m| m.routing.as_ref()) {
                aux = aux.map(|s| s + r.aux);
            }
            self.hook(Stage::Block(l), true, false)?;
            resid.push(out.expect("asked for the block output"));
            let saved = self.checkpoint(l, a, &mut cast_cache, (&resid[j], mask.as_ref()))?;
            blocks.push(saved);
            // The block's input is what its recomputation starts from.
            if self.train.offload_activations {
                move_tensor(self.dev, &mut resid[j], true)?;
            }
        }
        // The mask stays while a checkpoint holds it; otherwise it goes
        // with the base model's forward, after the final norm.
        let held = self.eager_mask().is_some_and(|m| !m.offloaded)
            && (layers.clone()).any(|l| self.checkpointed(l));
        let kept = if held { mask.take() } else { None };
        let head = match last {
            true => {
                Some(self.head_forward(&mut resid, targets.as_ref(), host_targets, dloss, mask)?)
            }
            false => {
                self.dev.free_opt(mask);
                self.send_output(&mut resid);
                None
            }
        };
        for x in cast_cache {
            self.dev.free(x);
        }
        Ok(Acts {
            tokens,
            targets,
            resid,
            blocks,
            head,
            extra,
            mask: kept,
            aux,
        })
    }

    /// The micro-batch's token buffers: the first stage embeds the tokens,
    /// the last computes the loss against the targets. A chunked or fused
    /// loss also keeps the targets on the host, to upload its chunks'.
    #[allow(clippy::type_complexity)]
    fn read_batch(
        &mut self,
        next: &mut dyn FnMut() -> Batch,
        first: bool,
        last: bool,
    ) -> Result<(Option<T<B>>, Option<T<B>>, Option<Vec<u32>>), OomError> {
        let (dev, n, act) = (&mut *self.dev, self.n, Category::Activations);
        let mut tokens = first.then(|| dev.alloc(n, DType::U32, act)).transpose()?;
        let mut targets = last.then(|| dev.alloc(n, DType::U32, act)).transpose()?;
        let mut host_targets = None;
        if dev.be.holds_data() && (first || last) {
            let batch = next();
            if let Some(x) = &mut tokens {
                dev.be.upload_u32(&mut x.buf, &batch.inputs);
            }
            if let Some(x) = &mut targets {
                dev.be.upload_u32(&mut x.buf, &batch.targets);
            }
            if last && !self.train.loss.whole_logits() {
                host_targets = Some(batch.targets);
            }
        }
        Ok((tokens, targets, host_targets))
    }

    /// The residual stream into the chunk's first block: the embedding, or
    /// the previous chunk's output (the previous stage's; with virtual
    /// stages the last stage's comes round to the first), kept in its
    /// receive buffer until this micro-batch's backward of the chunk.
    fn stage_input(&mut self, tokens: Option<&T<B>>) -> Result<T<B>, OomError> {
        let (model, idx, n, c) = (self.model, self.idx, self.n, self.model.d_model);
        let Some(tokens) = tokens else {
            let pp = self
                .pipe
                .as_mut()
                .expect("without a pipeline every rank embeds");
            let mut x = self
                .dev
                .alloc(self.nl * c, self.dt, Category::Communication)?;
            self.dev.recv(&mut *pp.p2p, Peer::Prev, &mut x);
            return Ok(x);
        };
        let mut emb = self.dev.alloc(n * c, self.dt, Category::Activations)?;
        // Tensor parallelism: each rank's rows of the table, the positions
        // added once, the parts summed over the group.
        let tp = self.tp.as_ref();
        let part = tp.map(|tp| tp.vocab(model).0);
        let wpe = (idx.wpe.map(|i| &self.p[i])).filter(|_| tp.is_none_or(|tp| tp.rank() == 0));
        let shape = (n, self.train.seq_len, c);
        (self.dev).embed_forward(&mut emb, tokens, &self.p[idx.wte], wpe, shape, part);
        if let Some(f) = self.embed_scale() {
            self.dev.scale(&mut emb, f);
        }
        let emb = self.reduce(emb)?;
        self.hook(Stage::Embed, true, false)?;
        Ok(emb)
    }

    /// Gemma's embedding scale: √C in the activations' dtype, as
    /// transformers' `Gemma2Model` casts its `normalizer` to the hidden
    /// states' dtype before multiplying.
    fn embed_scale(&self) -> Option<f32> {
        let c = (self.model.d_model as f32).sqrt();
        self.model.offset_norms().then(|| match self.dt {
            DType::Bf16 => half::bf16::from_f32(c).to_f32(),
            DType::F16 => half::f16::from_f32(c).to_f32(),
            _ => c,
        })
    }

    /// One transformer block's forward from its input `x` (N,C): the saved
    /// tensors, and the block output unless `with_out` is false (a
    /// recomputation under checkpointing, where the output was kept).
    fn block_forward(
        &mut self,
        l: usize,
        x: &T<B>,
        with_out: bool,
    ) -> Result<BlockOut<B>, OomError> {
        let (s, act, tmp) = (self.s, Category::Activations, Category::Temporaries);
        let ly = BlockLayers::of(self, l);
        let mut lora_t = Vec::new();
        // attention: ln1 -> qkv (-> rope) -> attention -> o-proj, + residual
        let (ln1, ln1_mean, ln1_rstd) = self.norm(x, ly.ln1)?;
        let mut qkv = ly.qkv.forward(self, l, &ln1, act, &mut lora_t)?;
        let qk = self.qk_norm_forward(l, &mut qkv)?;
        if self.model.family != Family::Gpt2 {
            self.dev
                .rope_forward(&mut qkv, s, self.model.rope_theta_at(l));
        }
        let (atty, att, tanh) = self.attention_forward(l, &qkv)?;
        // Gemma keeps the projection's output for its post-norm's backward.
        let cat = if ly.post_attn.is_some() { act } else { tmp };
        let proj = ly.o.forward(self, l, &atty, cat, &mut lora_t)?;
        let proj = self.reduce_gemm(proj)?;
        let (res2, post_attn) = match ly.post_attn {
            Some(w) => {
                let (y, rstd) = self.post_norm(&proj, w)?;
                (self.residual(x, y)?, Some((proj, rstd)))
            }
            None => (self.residual(x, proj)?, None),
        };
        // MLP: ln2 -> up -> gelu | swiglu -> down (and the routed
        // experts), + residual
        let (ln2, ln2_mean, ln2_rstd) = self.norm(&res2, ly.ln2)?;
        let (up, a) = match (ly.up, ly.down) {
            (Some(up), Some(down)) => {
                let up = up.forward(self, l, &ln2, act, &mut lora_t)?;
                let a = self.activation_forward(&up, down.inp)?;
                (Some(up), Some(a))
            }
            _ => (None, None),
        };
        let moe = match (ly.moe, self.model.moe_at(l)) {
            (Some((mi, sh)), Some(m)) => {
                let edt = match self.hf.is_some_and(|h| h.autocast) {
                    true => DType::F32,
                    false => ln2.dtype,
                };
                let saved = self.hf.map_or(&[][..], |h| &h.experts_saved[..]);
                let lora = self.expert_lora(l);
                let (ep, tp) = (self.ep.as_mut(), self.tp.as_mut());
                let x = (&ln2, edt, saved);
                Some(moe::forward(
                    self.dev,
                    (self.p, ep, tp),
                    (mi, lora),
                    m,
                    x,
                    sh,
                )?)
            }
            _ => None,
        };
        // The framework profile's saved tensors beyond the engine's own.
        let mut extra = alloc_saved(self.dev, self.hf.map_or(&[][..], |h| &h.block_saved[..]))?;
        if let Some(h) = self.hf.filter(|_| self.model.sliding_window(l).is_some()) {
            extra.extend(alloc_saved(self.dev, &h.sliding_saved)?);
        }
        self.charge_unfused(|h| h.unfused_block[0]);
        // The dense MLP's (or shared expert's) output: a temporary summed
        // into the block's, or under Qwen2-MoE's gate kept with the gate,
        // whose backward reads it (so a recomputation makes it too).
        let gate_w = ly.moe.and_then(|(mi, _)| mi.shared_gate);
        let nc = (self.n, self.model.d_model);
        let keep = gate_w.is_some() || ly.post_mlp.is_some();
        // Selective checkpointing keeps it when torchtitan's policy saves it.
        let saved_down = with_out && self.saves(sac::Mm::Down);
        let dense = match (ly.down.zip(a.as_ref()), with_out || keep) {
            (Some((down, a)), true) => {
                let cat = if keep || saved_down { act } else { tmp };
                let y = down.forward(self, l, a, cat, &mut lora_t)?;
                Some(self.reduce_gemm(y)?)
            }
            (Some((down, a)), false) => {
                down.save_adapter_inputs(self, l, a, &mut lora_t)?;
                None
            }
            (None, _) => None,
        };
        let (dense, gate) = match (gate_w, dense) {
            (Some(gw), Some(ys)) => {
                let g = moe::gate_forward(self.dev, &self.p[gw], &ln2, ys, nc)?;
                let y = with_out.then(|| moe::gated(self.dev, &g, nc)).transpose()?;
                (y, Some(g))
            }
            (_, dense) => (dense, None),
        };
        // Gemma: the MLP's output (kept) through its post-norm.
        let (dense, post_mlp) = match (ly.post_mlp, dense) {
            (Some(w), Some(y)) => {
                let (out, rstd) = self.post_norm(&y, w)?;
                let out = match with_out {
                    true => Some(out),
                    false => {
                        self.dev.free(out);
                        None
                    }
                };
                (out, Some((y, rstd)))
            }
            (_, dense) => (dense, None),
        };
        let (out, down) = match with_out {
            true => {
                let mlp = match (&moe, ly.moe) {
                    (Some(m), Some((_, sh))) => moe::combine(self.dev, m, dense, sh)?,
                    _ => dense.expect("a block has a dense MLP or experts"),
                };
                let out = self.residual_keeping(&res2, &mlp)?;
                (Some(out), self.dev.keep_if(saved_down, mlp))
            }
            false => (None, None),
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
            moe,
            gate,
            qk,
            extra,
            lora_t,
            tanh,
            post_attn,
            post_mlp,
            down,
        };
        Ok((a, out))
    }

    /// Block `l`'s q and k norms, each as its columns of q|k|v `(offset,
    /// width)`, the width it normalises over and its weight tensor; `None`
    /// without them.
    fn qk_pieces(&self, l: usize) -> Option<[QkPiece; 2]> {
        let (bi, m) = (&self.idx.blocks[l], self.model);
        let (qw, kw, (nq, nk)) = (bi.q_norm?, bi.k_norm?, m.qk_norm_widths()?);
        // This rank's heads: under tensor parallelism its query heads, then
        // its key heads (per-head norms only, `validate::architecture`).
        let (q, kv) = (self.widths.attn, (self.widths.qkv - self.widths.attn) / 2);
        Some([((0, q), nq, qw), ((q, kv), nk, kw)])
    }

    /// The q and k norms (Qwen3, OLMoE), in place on the projection's
    /// output before RoPE: each piece's input and statistics saved.
    #[allow(clippy::type_complexity)]
    fn qk_norm_forward(
        &mut self,
        l: usize,
        qkv: &mut T<B>,
    ) -> Result<Option<[(T<B>, T<B>); 2]>, OomError> {
        let Some([(q, nq, qw), (k, nk, kw)]) = self.qk_pieces(l) else {
            return Ok(None);
        };
        Ok(Some([
            self.piece_norm_forward(qkv, q, nq, qw)?,
            self.piece_norm_forward(qkv, k, nk, kw)?,
        ]))
    }

    /// RMSNorm over columns `off..off + width` of every row of `qkv`, in
    /// pieces `nw` wide, with weight tensor `w`: (the piece's input, rstd).
    fn piece_norm_forward(
        &mut self,
        qkv: &mut T<B>,
        (off, width): (usize, usize),
        nw: usize,
        w: usize,
    ) -> Result<(T<B>, T<B>), OomError> {
        let (n, cols, act) = (self.n, self.widths.qkv, Category::Activations);
        let rows = n * width / nw;
        let mut x = self.dev.alloc(n * width, qkv.dtype, act)?;
        self.dev
            .copy_cols(&mut x, width, 0, qkv, cols, off, n, width, 1.0, false);
        let mut out = self
            .dev
            .alloc(n * width, qkv.dtype, Category::Temporaries)?;
        let mut rstd = self.dev.alloc_f32(rows, act)?;
        let eps = self.model.norm_eps();
        let offset = self.model.offset_norms();
        (self.dev).norm_forward(
            &mut out, None, &mut rstd, &x, &self.p[w], None, rows, nw, eps, offset,
        );
        self.dev
            .copy_cols(qkv, cols, off, &out, width, 0, n, width, 1.0, false);
        self.dev.free(out);
        Ok((x, rstd))
    }

    /// The q and k norms' backward, in place on `dqkv` (after RoPE's).
    fn qk_norm_backward(
        &mut self,
        l: usize,
        dqkv: &mut T<B>,
        qk: &[(T<B>, T<B>); 2],
    ) -> Result<(), OomError> {
        let pieces = self.qk_pieces(l);
        let pieces = pieces.expect("saved q and k norms come from a block that has them");
        for ((cols, nw, w), saved) in pieces.into_iter().zip(qk) {
            self.piece_norm_backward(dqkv, cols, nw, w, saved)?;
        }
        Ok(())
    }

    fn piece_norm_backward(
        &mut self,
        dqkv: &mut T<B>,
        (off, width): (usize, usize),
        nw: usize,
        w: usize,
        (x, rstd): &(T<B>, T<B>),
    ) -> Result<(), OomError> {
        let (n, cols, tmp) = (self.n, self.widths.qkv, Category::Temporaries);
        let rows = n * width / nw;
        let mut dout = self.dev.alloc(n * width, dqkv.dtype, tmp)?;
        self.dev
            .copy_cols(&mut dout, width, 0, dqkv, cols, off, n, width, 1.0, false);
        let mut dx = self.dev.alloc_zeroed(n * width, dqkv.dtype, tmp)?;
        // LoRA freezes the norm: its gradient goes to a discarded scratch.
        let mut scratch = match self.frozen {
            true => Some(self.dev.alloc(nw, self.g[w].dtype, tmp)?),
            false => None,
        };
        let dw = match scratch.as_mut() {
            Some(s) => s,
            None => &mut self.g[w],
        };
        let offset = self.model.offset_norms();
        (self.dev).norm_backward(
            &mut dx, dw, None, &dout, x, &self.p[w], None, rstd, rows, nw, offset,
        );
        self.dev
            .copy_cols(dqkv, cols, off, &dx, width, 0, n, width, 1.0, false);
        self.dev.free_opt(scratch);
        self.dev.free(dx);
        self.dev.free(dout);
        Ok(())
    }

    /// Block `l`'s attention over `qkv`: its output (N, local heads x
    /// head_dim), what the backward needs of it (eager: the probabilities;
    /// fused: the per-row log-sum-exp) and, eager with Gemma 2's soft cap,
    /// the scores' tanh (B,H,T,T), which the cap's backward reads.
    #[allow(clippy::type_complexity)]
    fn attention_forward(
        &mut self,
        l: usize,
        qkv: &T<B>,
    ) -> Result<(T<B>, T<B>, Option<T<B>>), OomError> {
        let (s, act, o) = (self.s, Category::Activations, self.attn_opts(l));
        let mut atty = self.dev.alloc(self.n * self.widths.attn, self.dt, act)?;
        let tt = s.b * s.n_head * s.t * s.t;
        let (att, tanh) = match self.train.attention {
            Attention::Eager => {
                let mut att = self.dev.alloc(tt, self.dt, act)?;
                let mut tanh = (o.softcap)
                    .map(|_| self.dev.alloc(tt, self.dt, act))
                    .transpose()?;
                (self.dev).attention_forward_with(&mut atty, &mut att, tanh.as_mut(), qkv, s, o);
                (att, tanh)
            }
            Attention::Fused | Attention::FlashAttention2 => {
                let mut lse = self.dev.alloc_f32(s.b * s.n_head * s.t, act)?;
                let ws = &mut *self.workspace;
                (self.dev).flash_attention_forward_with(&mut atty, &mut lse, qkv, ws, s, o);
                (lse, None)
            }
        };
        Ok((atty, att, tanh))
    }

    /// The MLP's nonlinearity over its `dff` inner columns: GELU (gpt2) or
    /// SwiGLU over gate|up (llama).
    fn activation_forward(&mut self, up: &T<B>, dff: usize) -> Result<T<B>, OomError> {
        let n = self.n;
        let mut a = self.dev.alloc(n * dff, self.dt, Category::Activations)?;
        match self.model.family {
            Family::Gpt2 => self.dev.gelu_forward(&mut a, up, n * dff),
            Family::Gemma => self.dev.geglu_forward(&mut a, up, n, dff),
            Family::Llama => self.dev.swiglu_forward(&mut a, up, n, dff),
        }
        Ok(a)
    }

    /// Block `l`'s activations for its backward, from what its forward
    /// kept: all of them, or made again from its input `x` (and what
    /// offloading sent to the host with it, brought back first).
    fn block_acts(
        &mut self,
        l: usize,
        saved: Saved<T<B>>,
        x: &T<B>,
    ) -> Result<BlockActs<T<B>>, OomError> {
        Ok(match saved {
            Saved::All(a) => a,
            Saved::Input(Input { mut half, mut mask }) => {
                for t in half.iter_mut().chain(mask.as_mut()) {
                    move_tensor(self.dev, t, false)?;
                }
                let a = self.recompute(l, x)?;
                // The mask goes as the recomputation returns; the input's
                // other half is the recomputed block's now
                // (`HfRules::block_saved` has it).
                self.dev.free_opt(mask);
                self.dev.free_opt(half);
                a
            }
            Saved::Ops(kept, half) => {
                let a = self.recompute_ops(l, x, kept)?;
                self.dev.free_opt(half);
                a
            }
        })
    }

    /// Whether block `l` is checkpointed. torchtitan's layer SAC counts the
    /// blocks from 1 and checkpoints each whose count is a multiple of N
    /// (parallelize_llama.py @ 9dec370, `_apply_ac_to_transformer_block`,
    /// `use_layer_sac`).
    fn checkpointed(&self, l: usize) -> bool {
        self.train.checkpointing != Checkpointing::None
            && (l + 1).is_multiple_of(self.train.checkpoint_every.max(1))
    }

    /// What block `l` keeps for its backward: everything, unless it is
    /// checkpointed. Under full checkpointing its input (already in the
    /// residual list) and hf-eager's rest of it ([`Input`]; `mask`: eager
    /// attention's, which offloading copies to the host with a GPT-2
    /// block's inputs); under selective checkpointing the outputs of the
    /// ops torchtitan's policy saves. The backward recomputes the rest.
    /// hf-eager's autocast weight casts move to `cast_cache`.
    fn checkpoint(
        &mut self,
        l: usize,
        mut a: BlockActs<T<B>>,
        cast_cache: &mut Vec<T<B>>,
        (input, mask): (&T<B>, Option<&T<B>>),
    ) -> Result<Saved<T<B>>, OomError> {
        if !self.checkpointed(l) {
            return Ok(Saved::All(a));
        }
        if let Some(r) = self.hf.and_then(|h| h.block_casts.clone()) {
            cast_cache.extend(a.extra.drain(r));
        }
        match self.train.checkpointing {
            Checkpointing::Selective => {
                let kept = self.keep_ops(l, a)?;
                let half = self.input_half(input)?;
                Ok(Saved::Ops(kept, half))
            }
            _ => {
                free_block(self.dev, a);
                let half = self.input_half(input)?;
                let copied = self.eager_mask().is_some_and(|m| m.offloaded);
                let mask = match mask.filter(|_| copied) {
                    Some(m) => Some(self.keep_beside(m)?),
                    None => None,
                };
                Ok(Saved::Input(Input { half, mask }))
            }
        }
    }

    /// hf-eager, autocast: the other half of a checkpointed block's fp32
    /// `input` ([`Input::half`]).
    fn input_half(&mut self, input: &T<B>) -> Result<Option<T<B>>, OomError> {
        match self.hf.is_some_and(|h| h.autocast) {
            true => self.keep_beside(input).map(Some),
            false => Ok(None),
        }
    }

    /// A tensor a checkpoint keeps the size of `x`: on the device, or,
    /// with activations offloaded, the copy the pack hook makes on the
    /// host (offloading wants full checkpointing).
    fn keep_beside(&mut self, x: &T<B>) -> Result<T<B>, OomError> {
        match self.train.offload_activations {
            true => copy_tensor(self.dev, x, true),
            false => self.dev.alloc(x.len, x.dtype, x.category),
        }
    }

    /// hf-eager, eager attention: the mask's rule.
    fn eager_mask(&self) -> Option<EagerMask> {
        self.hf.and_then(|h| h.eager_mask)
    }

    /// A chunk before the model's last: its output goes to the next stage
    /// (round to the first from the last, with virtual stages), which
    /// keeps it; this stage needs it no more (Megatron-LM frees it too).
    fn send_output(&mut self, resid: &mut Vec<T<B>>) {
        let pp = self.pipe.as_mut().expect("a stage before the last");
        let out = resid.pop().expect("the stage output");
        self.dev.send(&mut *pp.p2p, Peer::Next, &out);
        self.dev.free(out);
    }

    /// The final norm, the head and the loss, on the last stage.
    fn head_forward(
        &mut self,
        resid: &mut [T<B>],
        targets: Option<&T<B>>,
        host_targets: Option<Vec<u32>>,
        dloss: f32,
        mask: Option<T<B>>,
    ) -> Result<HeadActs<T<B>>, OomError> {
        self.dev.tracker.set_phase(Phase::ForwardHead);
        self.hook(Stage::Head, false, false)?;
        let x = resid.last_mut().expect("embedding output");
        let (lnf, lnf_mean, lnf_rstd) = self.norm(x, (self.idx.lnf_w, self.idx.lnf_b))?;
        // The base model's forward returns: eager attention's mask goes,
        // unless a checkpoint holds it (then `mask` is `None` here).
        self.dev.free_opt(mask);
        // The final norm saved its input, the last block's output: torchtune
        // offloads it too (only the output projection runs under its
        // `NoOpManager`; torchtune 0.6.1: training/_activation_offloading.py,
        // `get_act_offloading_ctx_manager`), until the head's backward.
        if self.train.offload_activations {
            move_tensor(self.dev, x, true)?;
        }
        self.charge_unfused(|h| h.unfused_head[0]);
        let head_extra = match self.hf {
            // Offloaded: what the final norm saves goes to the host with
            // its input (`Step::head_offloaded`).
            Some(h) if self.train.offload_activations => {
                let list: Vec<_> = (h.head_saved.iter().chain(&h.head_offloaded))
                    .copied()
                    .collect();
                let mut saved = alloc_saved(self.dev, &list)?;
                let head = h.head_norm_saved..h.head_saved.len();
                for (i, t) in saved.iter_mut().enumerate() {
                    if !head.contains(&i) {
                        move_tensor(self.dev, t, true)?;
                    }
                }
                saved
            }
            Some(h) => alloc_saved(self.dev, &h.head_saved)?,
            None => Vec::new(),
        };
        let targets = targets.expect("the last stage reads the targets");
        let (lnf, losses, loss) = match self.train.loss {
            Loss::Full | Loss::MegatronUnfused => self.full_loss(lnf, targets)?,
            Loss::FusedLinear => self.fused_loss(lnf, host_targets.as_deref(), dloss)?,
            Loss::Chunked => self.chunked_loss(lnf, host_targets.as_deref())?,
        };
        self.hook(Stage::Head, true, false)?;
        Ok(HeadActs {
            lnf,
            lnf_mean,
            lnf_rstd,
            loss,
            losses,
            extra: head_extra,
        })
    }

    /// The loss's rows per part (`loss.rs`).
    fn loss_rows(&self) -> Vec<usize> {
        let (train, model) = (self.train, self.model);
        let (mb, t, c) = (train.micro_batch, train.seq_len, model.d_model);
        loss::parts(
            train.loss,
            train.loss_chunks,
            mb,
            t,
            model.padded_vocab(),
            c,
        )
    }

    /// `--loss full`: the whole logits, then each token's loss.
    #[allow(clippy::type_complexity)]
    fn full_loss(
        &mut self,
        lnf: T<B>,
        targets: &T<B>,
    ) -> Result<(Option<T<B>>, T<B>, LossActs<T<B>>), OomError> {
        let (n, c, act) = (self.n, self.model.d_model, Category::Activations);
        let (v, vp) = (self.model.vocab_size, self.model.padded_vocab());
        let head = self.idx.lm_head.unwrap_or(self.idx.wte);
        // Tensor parallelism: this rank's columns of the vocabulary.
        let vocab = self
            .tp
            .as_ref()
            .map_or((0, v, vp), |tp| tp.vocab(self.model));
        let vpl = vocab.2;
        let mut logits = self.dev.alloc(n * vpl, self.dt, act)?;
        // hf-eager: the engine's logits buffer stands for the saved
        // log_softmax output (ForCausalLMLoss -> cross_entropy ->
        // log_softmax + nll_loss, transformers/loss/loss_utils.py); the
        // logits themselves live until the loop drops the model output at
        // the end of the forward.
        let hf_logits = alloc_per_token(self.dev, self.hf, |h| &h.logits, n)?;
        let loss_extra = alloc_per_token(self.dev, self.hf, |h| &h.loss_saved, n)?;
        let gathered = gather(self.dev, self.tp.as_mut(), &lnf)?;
        let inp = gathered.as_ref().unwrap_or(&lnf);
        (self.dev).matmul_forward(&mut logits, inp, &self.p[head], None, n, c, vpl);
        self.dev.free_opt(gathered);
        if let Some(cap) = self.model.final_softcap() {
            self.dev.softcap_forward(&mut logits, n * vpl, cap);
        }
        // Megatron's unfused loss: `logits.float()`, beside the logits
        // until the loss returns; the loss then runs over the copy.
        let megatron = self.train.loss == Loss::MegatronUnfused;
        let half = match megatron && self.dt != DType::F32 {
            true => {
                let mut up = self.dev.alloc_f32(n * vpl, act)?;
                self.dev.convert(&mut up, &logits);
                Some(std::mem::replace(&mut logits, up))
            }
            false => None,
        };
        let mut losses = self.dev.alloc_f32(n, act)?;
        let lse = match self.tp.as_mut() {
            None => {
                (self.dev).crossentropy_forward(&mut losses, &logits, targets, n, v, vp);
                None
            }
            Some(tp) => Some(tp_cross_entropy(
                self.dev,
                tp,
                &mut losses,
                &logits,
                targets,
                vocab,
            )?),
        };
        for t in hf_logits {
            self.dev.free(t);
        }
        self.dev.free_opt(half);
        // The passes an unfused loss runs beyond the engine's kernels:
        // Megatron's, or PyTorch's eager cross-entropy under hf-eager.
        let [fwd, bwd] = match (megatron, self.hf) {
            (true, _) => loss::megatron_unfused(n * vpl, self.tp.is_some()),
            (false, Some(h)) => h.loss_unfused(n),
            (false, None) => Default::default(),
        };
        self.dev.charge_unfused(loss::UNFUSED_OP, fwd);
        let part = LogitsPart {
            start: 0,
            rows: n,
            logits,
            input: None,
            targets: None,
            extra: loss_extra,
            unfused: bwd,
        };
        let parts = vec![part];
        Ok((Some(lnf), losses, LossActs::Logits { parts, lse }))
    }

    /// `--loss fused-linear`: Liger's fused linear cross-entropy, which
    /// makes the head's gradients during the forward.
    #[allow(clippy::type_complexity)]
    fn fused_loss(
        &mut self,
        lnf: T<B>,
        targets: Option<&[u32]>,
        dloss: f32,
    ) -> Result<(Option<T<B>>, T<B>, LossActs<T<B>>), OomError> {
        let head = self.idx.lm_head.unwrap_or(self.idx.wte);
        let rows = self.loss_rows();
        let mut losses = self.dev.alloc_f32(self.n, Category::Activations)?;
        // The weight gradient buffer takes the gradient's dtype.
        let dw_dtype = (!self.frozen).then_some(self.g[head].dtype);
        let dims = (
            self.model.d_model,
            self.model.vocab_size,
            self.model.padded_vocab(),
            self.model.final_softcap(),
        );
        let hf_live = self.hf.map_or(&[][..], |h| &h.head_forward[..]);
        let live = alloc_saved(self.dev, hf_live)?;
        let w = &self.p[head];
        let f = loss::fused_forward(
            self.dev,
            &lnf,
            w,
            targets,
            &mut losses,
            dloss,
            dw_dtype,
            &rows,
            dims,
        )?;
        for x in live {
            self.dev.free(x);
        }
        self.dev.free(lnf);
        Ok((None, losses, LossActs::Fused(f)))
    }

    /// `--loss chunked`: torchtune's chunked loss. Each chunk's rows are
    /// selected (a copy the head's matmul saves) with its targets (which
    /// the loss saves); the logits and their fp32 copy live while the
    /// chunk's loss is computed, the engine's buffer standing for the
    /// saved log_softmax output.
    #[allow(clippy::type_complexity)]
    fn chunked_loss(
        &mut self,
        lnf: T<B>,
        targets: Option<&[u32]>,
    ) -> Result<(Option<T<B>>, T<B>, LossActs<T<B>>), OomError> {
        let (c, dt, act) = (self.model.d_model, self.dt, Category::Activations);
        let (v, vp) = (self.model.vocab_size, self.model.padded_vocab());
        let head = self.idx.lm_head.unwrap_or(self.idx.wte);
        let rows = self.loss_rows();
        let (dev, hf) = (&mut *self.dev, self.hf);
        let mut losses = dev.alloc_f32(self.n, act)?;
        let mut parts = Vec::with_capacity(rows.len());
        let mut off = 0;
        for &r in &rows {
            let mut input = dev.alloc(r * c, dt, act)?;
            dev.copy_slice(&mut input, 0, &lnf, off * c, r * c, false);
            let mut tc = dev.alloc(r, DType::U32, act)?;
            if let Some(all) = targets {
                dev.be.upload_u32(&mut tc.buf, &all[off..off + r]);
            }
            let live = alloc_per_token(dev, hf, |h| &h.logits, r)?;
            let mut logits = dev.alloc(r * vp, dt, act)?;
            let extra = alloc_per_token(dev, hf, |h| &h.loss_saved, r)?;
            dev.matmul_forward(&mut logits, &input, &self.p[head], None, r, c, vp);
            if let Some(cap) = self.model.final_softcap() {
                dev.softcap_forward(&mut logits, r * vp, cap);
            }
            let mut lc = dev.alloc_f32(r, Category::Temporaries)?;
            dev.crossentropy_forward(&mut lc, &logits, &tc, r, v, vp);
            let [fwd, bwd] = hf.map_or(Default::default(), |h| h.loss_unfused(r));
            dev.charge_unfused(loss::UNFUSED_OP, fwd);
            dev.copy_slice(&mut losses, off, &lc, 0, r, false);
            for x in live.into_iter().chain([lc]) {
                dev.free(x);
            }
            parts.push(LogitsPart {
                start: off,
                rows: r,
                logits,
                input: Some(input),
                targets: Some(tc),
                extra,
                unfused: bwd,
            });
            off += r;
        }
        dev.free(lnf);
        Ok((None, losses, LossActs::Logits { parts, lse: None }))
    }

    // ---- backward ---------------------------------------------------------

    /// The backward pass of the micro-batch `acts` came from; gradients
    /// accumulate into the engine's. Frees `acts` as it goes.
    pub(super) fn backward(mut self, acts: Acts<T<B>>, dloss: f32) -> Result<(), OomError> {
        self.dloss = dloss;
        self.alloc_scratch()?;
        let layers = self.layers();
        let units = shard::units(self.idx);
        let Acts {
            tokens,
            targets,
            mut resid,
            mut blocks,
            head,
            extra,
            mut mask,
            aux: _,
        } = acts;
        // The lowest checkpointed block's backward releases the mask.
        let lowest = layers.clone().find(|&l| self.checkpointed(l));
        // hf-eager, tied head: the head's weight gradient, a temporary until
        // the embedding's backward adds its own (resident gradients only;
        // with set_to_none it is the gradient buffer itself).
        let mut head_dw = None;
        // dres: gradient of the residual stream, carried down through the blocks.
        let mut dres = match head {
            Some(h) => {
                let targets = targets.expect("the last stage reads the targets");
                // Offloaded, the final norm's input comes back for its
                // backward.
                let x = resid.last_mut().expect("embedding output");
                move_tensor(self.dev, x, false)?;
                let x = resid.last().expect("embedding output");
                // A tied head writes the embedding's gradient first.
                let head_unit = units.last().expect("a head unit");
                let tied = self.idx.lm_head.is_none().then_some(self.idx.wte);
                let ids: Vec<usize> = head_unit.iter().copied().chain(tied).collect();
                self.make_unit_grads(&ids)?;
                let d = self.head_backward(h, targets, x, dloss, &mut head_dw)?;
                self.step_unit(head_unit.iter().copied())?;
                d
            }
            None => self.recv_grad(&layers)?,
        };
        for l in layers.clone().rev() {
            let j = l - layers.start;
            self.dev.tracker.set_phase(Phase::Backward(l));
            self.hook(Stage::Block(l), false, true)?;
            if self.lazy {
                self.make_block_grads(l, &units[l + 1])?;
            }
            move_tensor(self.dev, &mut resid[j], false)?;
            let saved = blocks.pop().expect("one entry per block");
            let a = self.block_acts(l, saved, &resid[j])?;
            self.block_backward(l, a, &resid[j], &mut dres)?;
            if Some(l) == lowest {
                self.dev.free_opt(mask.take());
            }
            // Block l's output: its consumers (block l+1 or the head) are
            // done. (A stage before the last sent its top block's output on.)
            if resid.len() > j + 1 {
                let out = resid.pop().expect("block output");
                self.dev.free(out);
            }
            self.hook(Stage::Block(l), true, true)?;
            let ads = self.block_adapters(l).iter().flat_map(|a| [a.a, a.b]);
            let ids: Vec<usize> = units[l + 1].iter().copied().chain(ads).collect();
            self.step_unit(ids)?;
        }
        self.dev.free_opt(mask);
        // A first stage holding only the embedding sent its output on.
        let input = resid.pop();
        let first = tokens.is_some();
        // Gemma: the embedding was scaled by √C, so is its gradient.
        if let (Some(f), Some(_)) = (self.embed_scale(), &tokens) {
            self.dev.scale(&mut dres, f);
        }
        match &tokens {
            Some(tokens) => self.embed_backward(tokens, &dres, head_dw.take())?,
            None => {
                // The gradient of this stage's input goes back to the stage before.
                let pp = self
                    .pipe
                    .as_mut()
                    .expect("without a pipeline every rank embeds");
                self.dev.send(&mut *pp.p2p, Peer::Prev, &dres);
            }
        }
        self.dev.free(dres);
        self.dev.free_opt(input);
        self.dev.free_opt(tokens);
        for x in extra {
            self.dev.free(x);
        }
        if first {
            self.hook(Stage::Embed, true, true)?;
            self.step_unit(units[0].iter().copied())?;
        }
        // A pipeline's last stage has the tied head but not the embedding:
        // the head's gradient temporary ends with this backward there.
        self.dev.free_opt(head_dw.take());
        if let Some((w, b)) = self.scratch.take() {
            self.dev.free(w);
            self.dev.free(b);
        }
        Ok(())
    }

    /// LoRA freezes every base tensor: no weight gradients for them; the
    /// norm kernels' weight gradients go to a discarded scratch.
    fn alloc_scratch(&mut self) -> Result<(), OomError> {
        if self.frozen {
            let (wdt, c) = (self.g[self.idx.lnf_w].dtype, self.model.d_model);
            let tmp = Category::Temporaries;
            self.scratch = Some((self.dev.alloc(c, wdt, tmp)?, self.dev.alloc(c, wdt, tmp)?));
        }
        Ok(())
    }

    /// A stage before the last: the gradient of its output, received from
    /// the next stage into a buffer that then carries it down the blocks.
    fn recv_grad(&mut self, layers: &std::ops::Range<usize>) -> Result<T<B>, OomError> {
        self.dev.tracker.set_phase(match layers.is_empty() {
            true => Phase::BackwardEmbed,
            false => Phase::Backward(layers.end - 1),
        });
        let pp = self.pipe.as_mut().expect("a stage before the last");
        let len = self.nl * self.model.d_model;
        let mut d = self.dev.alloc(len, self.dt, Category::Communication)?;
        self.dev.recv(&mut *pp.p2p, Peer::Next, &mut d);
        Ok(d)
    }

    /// hf-eager with `set_to_none`: block `l`'s gradients (its unit's and
    /// its adapters'), made as autograd first reaches them.
    fn make_block_grads(&mut self, l: usize, unit: &[usize]) -> Result<(), OomError> {
        let ads = self.block_adapters(l);
        // hf-eager: the stacked experts' gradients are made by their own
        // backward (`moe::fresh_grad`); memfit's schedule makes them here.
        let experts =
            (self.idx.blocks[l].moe.filter(|_| self.hf.is_some())).map(|m| [m.up, m.down]);
        let ids: Vec<usize> = (unit.iter().copied())
            .filter(|i| experts.is_none_or(|e| !e.contains(i)))
            .chain(ads.iter().flat_map(|a| [a.a, a.b]))
            .collect();
        make_grads(
            self.dev,
            self.g,
            self.specs,
            self.trainable,
            &ids,
            Category::Gradients,
        )
    }

    /// A checkpointed block's saved tensors, recomputed from its input.
    fn recompute(&mut self, l: usize, x: &T<B>) -> Result<BlockActs<T<B>>, OomError> {
        self.dev.tracker.set_phase(Phase::Recompute(l));
        let (a, _) = self.block_forward(l, x, false)?;
        self.dev.tracker.set_phase(Phase::Backward(l));
        Ok(a)
    }

    /// The loss, head and final norm backward: returns the gradient of the
    /// residual stream `x` that fed the head.
    fn head_backward(
        &mut self,
        h: HeadActs<T<B>>,
        targets: T<B>,
        x: &T<B>,
        dloss: f32,
        head_dw: &mut Option<T<B>>,
    ) -> Result<T<B>, OomError> {
        let model = self.model;
        let (n, c) = (self.n, model.d_model);
        let (v, vp) = (model.vocab_size, model.padded_vocab());
        let part = self.tp.as_ref().map_or((0, v, vp), |tp| tp.vocab(model));
        self.charge_unfused(|h| h.unfused_head[1]);
        let hf = self.hf.map(|h| HfHead {
            rules: h,
            lazy: self.lazy,
            specs: self.specs,
            trainable: self.trainable,
            dw: head_dw,
        });
        let dist = &mut *self.dist;
        let mut hook = |dev: &mut Device<B>, p: &mut Vec<T<B>>, g: &mut Vec<T<B>>, after: bool| {
            unit_hook(dist, (dev, p, g), Stage::Head, after, true)
        };
        head_backward(
            self.dev,
            self.p,
            self.g,
            self.idx,
            h,
            targets,
            x,
            dloss,
            (n, c, v, vp),
            (self.tp.as_mut(), part),
            hf,
            (self.frozen, &mut self.scratch),
            (self.model.offset_norms(), self.model.final_softcap()),
            &mut hook,
        )
    }

    /// One block's backward: `dres` comes in as the gradient of the block's
    /// output and leaves as that of its input `x`; the weights' gradients
    /// accumulate. Frees what the block saved.
    fn block_backward(
        &mut self,
        l: usize,
        a: BlockActs<T<B>>,
        x: &T<B>,
        dres: &mut T<B>,
    ) -> Result<(), OomError> {
        let ly = BlockLayers::of(self, l);
        let mut a = a;
        self.charge_unfused(|h| h.unfused_block[1]);
        let routed = a.moe.take();
        // Gemma: the MLP's post-norm first; d(mlp output) is then its input's.
        let dpost = match (ly.post_mlp, &a.post_mlp) {
            (Some(w), Some(saved)) => Some(self.post_norm_backward(dres, w, saved)?),
            _ => None,
        };
        let ts = &a.lora_t;
        let dmlp = dpost.as_ref().unwrap_or(&*dres);
        // MLP: dmlp is d(mlp output).
        let liger = self.hf.is_some_and(|h| h.liger);
        let dln2 = match (ly.up, ly.down, a.up.as_mut(), &a.act) {
            (Some(up), Some(down), Some(u), Some(act)) => {
                // Qwen2-MoE's gate: the shared expert sees σ · dres.
                let gated = match (&a.gate, ly.moe.and_then(|(mi, _)| mi.shared_gate)) {
                    (Some(g), Some(gw)) => {
                        let (p, gr) = (&self.p[gw], (!self.frozen).then(|| &mut self.g[gw]));
                        let nc = (self.n, self.model.d_model);
                        Some(moe::gate_backward(
                            self.dev,
                            (p, gr),
                            g,
                            (&*dres, &a.ln2),
                            nc,
                        )?)
                    }
                    _ => None,
                };
                let dout = gated.as_ref().map_or(dmlp, |(d, _)| d);
                let dact = down.backward(self, l, dout, act, ts)?;
                let dup = match liger {
                    // Liger's SwiGLU backward writes gate|up's gradient
                    // into the saved gate|up (framework.rs, `Step::unfused`).
                    true => {
                        let (n, i) = (self.n, down.inp);
                        self.dev.swiglu_backward_in_place(u, &dact, n, i);
                        self.dev.free(dact);
                        None
                    }
                    false => Some(self.activation_backward(dact, u, down.inp)?),
                };
                let mut dln2 = up.backward(self, l, dup.as_ref().unwrap_or(u), &a.ln2, ts)?;
                self.dev.free_opt(dup);
                if let Some((dys, dx)) = gated {
                    self.dev.free(dys);
                    // The gate is replicated: its whole input gradient is
                    // added once to the group's partial sums.
                    let len = dln2.len;
                    if self.tp_first() {
                        self.dev.copy_slice(&mut dln2, 0, &dx, 0, len, true);
                    }
                    self.dev.free(dx);
                }
                Some(dln2)
            }
            _ => None,
        };
        let dln2 = match (routed, ly.moe, self.model.moe_at(l)) {
            (Some(acts), Some((mi, sh)), Some(m)) => {
                // d loss / d this micro-batch's load-balancing loss: its
                // tokens' share of the step's, as `dloss` is one token's.
                let aux_scale = self.dloss * self.n as f32;
                let fresh = self.hf.map(|_| self.lazy);
                let first = self.tp_first();
                let lora = self.expert_lora(l);
                let pg = (&self.p[..], &mut self.g[..], self.frozen);
                let io = (&*dres, &a.ln2);
                let ep = self.ep.as_mut();
                let w = (pg, ep, fresh, first);
                let mi = (mi, lora);
                moe::backward(self.dev, w, mi, m, acts, io, dln2, sh, aux_scale)?
            }
            _ => dln2.expect("a block has a dense MLP or experts"),
        };
        if liger {
            // Its gradient, handed to the up projection's backward, is
            // freed once that has run.
            self.dev.free_opt(a.up.take());
        }
        self.dev.free_opt(dpost);
        // Each rank's up projection saw a slice of the MLP: the norm's
        // output gradient is the sum over the group.
        let dln2 = self.reduce_gemm(dln2)?;
        let stats = (a.ln2_mean.as_ref(), &a.ln2_rstd);
        self.norm_backward(dres, &dln2, &a.res2, ly.ln2, stats);
        self.dev.free(dln2);
        // attention: dres is now d(res2) = d(o-proj output), or under
        // Gemma's post-norm that of the norm's output.
        let dpost = match (ly.post_attn, &a.post_attn) {
            (Some(w), Some(saved)) => Some(self.post_norm_backward(dres, w, saved)?),
            _ => None,
        };
        let dproj = dpost.as_ref().unwrap_or(&*dres);
        let datty = ly.o.backward(self, l, dproj, &a.atty, ts)?;
        self.dev.free_opt(dpost);
        let mut dqkv = self.attention_backward(l, datty, &a)?;
        if let Some(qk) = &a.qk {
            self.qk_norm_backward(l, &mut dqkv, qk)?;
        }
        let dln1 = ly.qkv.backward(self, l, &dqkv, &a.ln1, ts)?;
        self.dev.free(dqkv);
        let dln1 = self.reduce_gemm(dln1)?;
        let stats = (a.ln1_mean.as_ref(), &a.ln1_rstd);
        self.norm_backward(dres, &dln1, x, ly.ln1, stats);
        self.dev.free(dln1);
        free_block(self.dev, a);
        Ok(())
    }

    /// The backward of the nonlinearity: the gradient of the up
    /// projection's output from the activation's (`dact`, consumed).
    fn activation_backward(
        &mut self,
        mut dact: T<B>,
        up: &T<B>,
        dff: usize,
    ) -> Result<T<B>, OomError> {
        let n = self.n;
        if self.model.family == Family::Gpt2 {
            self.dev.gelu_backward(&mut dact, up, n * dff);
            return Ok(dact);
        }
        let mut dgu = self
            .dev
            .alloc(n * 2 * dff, self.dt, Category::Temporaries)?;
        match self.model.family {
            Family::Gemma => self.dev.geglu_backward(&mut dgu, &dact, up, n, dff),
            _ => self.dev.swiglu_backward(&mut dgu, &dact, up, n, dff),
        }
        self.dev.free(dact);
        Ok(dgu)
    }

    /// The attention's backward, from its output's gradient (`datty`,
    /// consumed) to the gradient of q|k|v before RoPE.
    fn attention_backward(
        &mut self,
        l: usize,
        datty: T<B>,
        a: &BlockActs<T<B>>,
    ) -> Result<T<B>, OomError> {
        let (s, tmp, o) = (self.s, Category::Temporaries, self.attn_opts(l));
        let mut dqkv = self.dev.alloc(self.n * self.widths.qkv, self.dt, tmp)?;
        match self.train.attention {
            Attention::Eager => {
                let mut datt = self.dev.alloc(s.b * s.n_head * s.t * s.t, self.dt, tmp)?;
                let saved = (&a.qkv, &a.att, a.tanh.as_ref());
                (self.dev).attention_backward_with(&mut dqkv, &mut datt, &datty, saved, s, o);
                self.dev.free(datt);
            }
            Attention::Fused | Attention::FlashAttention2 => {
                // hf-eager on a GPU: the flash kernel's own buffers, alive
                // for the call.
                let scratch = self
                    .hf
                    .map_or(&[][..], |h| &h.attention_backward_scratch[..]);
                let bufs = alloc_rows(self.dev, scratch, 1, tmp)?;
                let (saved, ws) = ((&a.atty, &a.att, &a.qkv), &mut *self.workspace);
                (self.dev).flash_attention_backward_with(&mut dqkv, &datty, saved, ws, s, o);
                for b in bufs {
                    self.dev.free(b);
                }
            }
        }
        self.dev.free(datty);
        if self.model.family != Family::Gpt2 {
            self.dev
                .rope_backward(&mut dqkv, s, self.model.rope_theta_at(l));
        }
        Ok(dqkv)
    }

    /// The embedding's backward on the first stage: every token's gradient
    /// reaches this rank's rows of the table (none when frozen); hf-eager
    /// adds autograd's gradient tensors around it.
    fn embed_backward(
        &mut self,
        tokens: &T<B>,
        dres: &T<B>,
        head_dw: Option<T<B>>,
    ) -> Result<(), OomError> {
        let (idx, model) = (self.idx, self.model);
        self.dev.tracker.set_phase(Phase::BackwardEmbed);
        self.hook(Stage::Embed, false, true)?;
        let hf_grads = self.hf.is_some() && !self.frozen;
        let (specs, trainable, lazy) = (self.specs, self.trainable, self.lazy);
        let dense = match hf_grads {
            true => hf_embed_grads(self.dev, self.g, specs, trainable, idx, lazy, head_dw)?,
            false => None,
        };
        let ids: Vec<usize> = std::iter::once(idx.wte).chain(idx.wpe).collect();
        self.make_unit_grads(&ids)?;
        if !self.frozen {
            let part = self.tp.as_ref().map(|tp| tp.vocab(model).0);
            let gathered = gather(self.dev, self.tp.as_mut(), dres)?;
            let dout = gathered.as_ref().unwrap_or(dres);
            let (dwte, dwpe) = pair_mut(self.g, idx.wte, idx.wpe);
            let shape = (self.n, self.train.seq_len, model.d_model);
            self.dev
                .embed_backward(dwte, dwpe, dout, tokens, shape, part);
            self.dev.free_opt(gathered);
        }
        if hf_grads {
            hf_embed_handed(self.dev, self.g, idx, lazy, dense);
        }
        Ok(())
    }
}

/// ZeRO's hook around stage `st` (`Dist::before`, or `Dist::after` when
/// `after`); nothing without data parallelism. [`Pass::hook`] and the head's
/// backward, which holds the stores apart from the pass, both call it.
fn unit_hook<B: Backend>(
    dist: &mut Option<Dist<B>>,
    (dev, p, g): (&mut Device<B>, &mut [T<B>], &mut [T<B>]),
    st: Stage,
    after: bool,
    backward: bool,
) -> Result<(), OomError> {
    match dist.as_mut() {
        Some(d) if after => d.after(dev, p, g, st, backward),
        Some(d) => d.before(dev, p, g, st, backward),
        None => Ok(()),
    }
}

/// Tensor parallelism's cross-entropy over the vocabulary's columns: per
/// token, this part's max and sum of exponentials, every part's gathered;
/// the target's logit from the part holding it. Returns each token's
/// log-sum-exp over the whole vocabulary, which the backward needs.
fn tp_cross_entropy<B: Backend>(
    dev: &mut Device<B>,
    tp: &mut Tp<B>,
    losses: &mut T<B>,
    logits: &T<B>,
    targets: &T<B>,
    vocab: (usize, usize, usize),
) -> Result<T<B>, OomError> {
    let n = losses.len;
    let tmp = Category::Temporaries;
    let mut stats = dev.alloc_f32(2 * n, tmp)?;
    let mut tgt = dev.alloc_f32(n, tmp)?;
    dev.crossentropy_part_stats(&mut stats, &mut tgt, logits, targets, n, vocab);
    let mut all = dev.alloc_f32(2 * n * tp.size(), tmp)?;
    tp.all_gather(dev, &mut all, &stats);
    tp.all_reduce(dev, &mut tgt);
    let mut lse = dev.alloc_f32(n, Category::Activations)?;
    dev.crossentropy_combine(losses, &mut lse, &all, &tgt, n, tp.size());
    for x in [stats, tgt, all] {
        dev.free(x);
    }
    Ok(lse)
}
