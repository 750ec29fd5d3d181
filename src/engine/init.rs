//! What [`Engine::unshaped`] allocates and fills, step by step: which
//! tensors this rank holds, the model states (weights, gradients, master
//! copy, optimizer state) in the order the tracker sees them, and the
//! seeded weights uploaded into this rank's slices and shards.

use super::*;

/// What this rank holds of each tensor, before sharding.
pub(super) struct Holdings {
    /// The tensors of this rank's pipeline stage (every tensor without a
    /// pipeline; the others are zero-length placeholders).
    pub owned: Vec<bool>,
    /// Elements held (0: another stage's).
    pub numel: Vec<usize>,
    /// Elements held of the tensors that train (LoRA freezes the base's).
    pub tnumel: Vec<usize>,
    /// Held and trainable: the tensors with a gradient, master copy and
    /// optimizer state.
    pub train_owned: Vec<bool>,
}

impl Holdings {
    pub fn new(specs: &[ParamSpec], owned: Vec<bool>, trainable: &[bool]) -> Self {
        let numel: Vec<usize> = (specs.iter().zip(&owned))
            .map(|(s, &o)| if o { s.numel() } else { 0 })
            .collect();
        let tnumel = (numel.iter().zip(trainable))
            .map(|(&n, &t)| if t { n } else { 0 })
            .collect();
        let train_owned = (owned.iter().zip(trainable))
            .map(|(&o, &t)| o && t)
            .collect();
        Holdings {
            owned,
            numel,
            tnumel,
            train_owned,
        }
    }
}

/// The model states one rank allocates, in this order: weights, gradients,
/// fp32 master weights, optimizer state.
pub(super) struct States<B: Backend> {
    pub params: Vec<T<B>>,
    pub grads: Vec<T<B>>,
    pub master: Vec<T<B>>,
    pub opt: Vec<OptState<T<B>>>,
}

/// How [`alloc_states`] lays the states out.
pub(super) struct StateLayout<'a> {
    pub specs: &'a [ParamSpec],
    pub idx: &'a ParamIndex,
    pub train: &'a TrainConfig,
    /// The weights' and gradients' dtype.
    pub wdt: DType,
    /// hf-eager's autocast: fp32 weights, no master copy.
    pub autocast: bool,
    /// hf-eager with `set_to_none` on one rank: no gradient until the
    /// backward makes it.
    pub lazy_grads: bool,
}

/// Allocates this rank's model states: whole, or (`dist`) the shards ZeRO
/// gives it, in device or (offloaded) host memory.
pub(super) fn alloc_states<B: Backend>(
    dev: &mut Device<B>,
    held: &Holdings,
    mut dist: Option<&mut Dist<B>>,
    lay: &StateLayout<'_>,
) -> Result<States<B>, OomError> {
    let (train, wdt) = (lay.train, lay.wdt);
    let (sharding, offload) = (train.sharding, train.offload);
    let owned = &held.owned;
    // Elements of each tensor this rank keeps a copy of, per kind of
    // state: weights (`shard_lens`), and gradients, master and optimizer
    // state, which only trainable tensors have (`tshard_lens`).
    let shard_lens = dist
        .as_ref()
        .map_or(held.numel.clone(), |d| d.shard.clone());
    let tshard_lens = (dist.as_ref()).map_or(held.tnumel.clone(), |d| d.grad_shard.clone());
    let alloc_all = |dev: &mut Device<B>, lens: &[usize], dtype, cat| {
        (lens.iter().zip(owned))
            .map(|(&n, &o)| match o {
                true => dev.alloc(n, dtype, cat),
                false => Ok(dev.placeholder(dtype, cat)),
            })
            .collect::<Result<Vec<T<B>>, OomError>>()
    };
    let placeholders = |dev: &mut Device<B>, dtype, cat| {
        (0..held.numel.len())
            .map(|_| dev.placeholder(dtype, cat))
            .collect::<Vec<_>>()
    };
    let params = if sharding.shards_parameters() {
        let d = dist.as_mut().expect("sharded");
        let cat = Category::Parameters;
        d.param_shards = match offload.params() {
            true => dev.on_host(|dev| alloc_all(dev, &shard_lens, wdt, cat))?,
            false => alloc_all(dev, &shard_lens, wdt, cat)?,
        };
        placeholders(dev, wdt, Category::Parameters)
    } else if train.finetune == Finetune::Qlora {
        alloc_nf4_params(dev, held, lay)?
    } else {
        alloc_all(dev, &held.numel, wdt, Category::Parameters)?
    };
    let grads = if lay.lazy_grads {
        placeholders(dev, wdt, Category::Gradients)
    } else if sharding.shards_gradients() {
        let d = dist.as_mut().expect("sharded");
        let cat = Category::Gradients;
        // Offloaded: DeepSpeed accumulates the gradient shard in fp32
        // on the host.
        d.grad_shards = match offload.optimizer() {
            true => dev.on_host(|dev| alloc_all(dev, &tshard_lens, DType::F32, cat))?,
            false => alloc_all(dev, &tshard_lens, wdt, cat)?,
        };
        placeholders(dev, wdt, Category::Gradients)
    } else {
        alloc_all(dev, &held.tnumel, wdt, Category::Gradients)?
    };
    let opt_lens = match sharding.shards_optimizer() {
        true => &tshard_lens,
        false => &held.tnumel,
    };
    // Offloaded, the host keeps an fp32 copy of the shard to update
    // even under fp32 (the weights the device reads are a copy of it).
    let cat = Category::Optimizer;
    let master = if offload.optimizer() {
        dev.on_host(|dev| alloc_all(dev, opt_lens, DType::F32, cat))?
    } else if train.precision.has_master() && !lay.autocast {
        alloc_all(dev, opt_lens, DType::F32, cat)?
    } else {
        Vec::new()
    };
    let (specs, to, cfg) = (lay.specs, &held.train_owned, &train.opt());
    let opt = match offload.optimizer() {
        true => dev.on_host(|dev| optim::alloc_state(dev, specs, opt_lens, to, cfg))?,
        false => optim::alloc_state(dev, specs, opt_lens, to, cfg)?,
    };
    Ok(States {
        params,
        grads,
        master,
        opt,
    })
}

/// QLoRA's weights: the block projections and the routed experts' stacks
/// (`BlockIndex::nf4`; under expert parallelism this rank's experts) in
/// NF4, exactly as many bytes as `nf4::storage_bytes` counts; the rest in
/// the working dtype.
fn alloc_nf4_params<B: Backend>(
    dev: &mut Device<B>,
    held: &Holdings,
    lay: &StateLayout<'_>,
) -> Result<Vec<T<B>>, OomError> {
    let nf4: std::collections::HashSet<usize> =
        (lay.idx.blocks.iter()).flat_map(|b| b.nf4()).collect();
    let numel = &held.numel;
    (0..numel.len())
        .map(|i| match nf4.contains(&i) {
            true => {
                let bytes = crate::nf4::storage_bytes(numel[i]) as usize;
                dev.alloc(bytes, DType::U8, Category::Parameters)
            }
            false => dev.alloc(numel[i], lay.wdt, Category::Parameters),
        })
        .collect()
}

/// How this rank's tensors were cut from the whole model's: tensor
/// parallelism's slices first, then expert parallelism's experts of those
/// (`expert::split_layout` reads the sliced shapes).
pub(super) fn layouts<'a, B: Backend>(
    tp: Option<&'a super::tensor::Tp<B>>,
    ep: Option<&'a super::expert::Ep<B>>,
) -> [Option<&'a [Option<super::tensor::Split>]>; 2] {
    [tp.map(|t| &t.splits[..]), ep.map(|e| &e.splits[..])]
}

/// Fills the weights (and the fp32 master copy) with the seeded
/// initialisation of the whole model (`full_specs`), each rank keeping its
/// tensor-parallel slices (or expert-parallel experts) and ZeRO shards of
/// it.
pub(super) fn upload_weights<B: Backend>(
    dev: &mut Device<B>,
    full_specs: &[ParamSpec],
    train: &TrainConfig,
    held: &Holdings,
    splits: &[Option<&[Option<super::tensor::Split>]>],
    mut dist: Option<&mut Dist<B>>,
    states: &mut States<B>,
) {
    let sharding = train.sharding;
    let mut host = init_weights(full_specs, train.seed);
    // Each layout in turn (tensor parallelism's, then expert parallelism's
    // of what it kept).
    for splits in splits.iter().flatten() {
        for (h, split) in host.iter_mut().zip(*splits) {
            if let Some(s) = split {
                *h = s.take(h);
            }
        }
    }
    // The elements of each tensor this rank owns under sharding.
    let extent: Vec<(usize, usize)> = match &dist {
        Some(d) => (0..held.numel.len())
            .map(|i| (d.offset(i), d.own(i)))
            .collect(),
        None => held.numel.iter().map(|&n| (0, n)).collect(),
    };
    let part = |i: usize, sharded: bool| -> &[f32] {
        match sharded {
            true => &host[i][extent[i].0..][..extent[i].1],
            false => &host[i],
        }
    };
    for (i, t) in states.params.iter_mut().enumerate() {
        if !sharding.shards_parameters() && held.owned[i] {
            if t.dtype == DType::U8 {
                // QLoRA: the weight quantised once, as bitsandbytes
                // does when the model is loaded in 4 bits.
                let q = crate::nf4::quantize(part(i, false)).to_bytes();
                dev.be.upload_u8(&mut t.buf, &q);
            } else {
                dev.be.upload_f32(&mut t.buf, part(i, false));
            }
        }
    }
    if let Some(d) = dist.as_mut() {
        for (i, t) in d.param_shards.iter_mut().enumerate() {
            dev.be.upload_f32(&mut t.buf, part(i, true));
        }
    }
    for (i, t) in states.master.iter_mut().enumerate() {
        if held.train_owned[i] {
            let sharded = sharding.shards_optimizer();
            dev.be.upload_f32(&mut t.buf, part(i, sharded));
        }
    }
}

/// ddp: rank 0's weights broadcast to every replica. QLoRA's NF4 bytes
/// are not: every rank quantised the same seeded weights (the collectives
/// move floats).
pub(super) fn broadcast_weights<B: Backend>(
    dev: &mut Device<B>,
    d: &mut Dist<B>,
    held: &Holdings,
    params: &mut [T<B>],
) {
    for (i, (t, _)) in (params.iter_mut().zip(&held.owned).enumerate()).filter(|(_, (_, o))| **o) {
        if t.dtype != DType::U8 {
            d.broadcast_param(dev, i, t);
        }
    }
}
