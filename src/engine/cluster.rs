//! A data-parallel job: one [`Engine`] per rank, each with its own device and
//! memory tracker, stepped together. Ranks run as threads, because the cpu
//! collectives wait for every rank; on meta nothing waits, and the same code
//! runs.

use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Mutex;

use super::pipeline::rank_chunks;
use super::{Comm, Engine, Pipe, StepReport, TrainConfig};
use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::backend::cpu::comm::{cpu_group, cpu_pipeline};
use crate::backend::meta::MetaBackend;
use crate::comm::{AbortHandle, PointToPoint};
use crate::comm::{MetaComm, MetaP2p};
use crate::config::ModelConfig;
use crate::data::Batch;
use crate::memory::OomError;

/// A rank's failure: which rank, and its out-of-memory error.
pub type RankError = (usize, OomError);

pub struct Cluster<B: Backend> {
    /// Placed as [`TrainConfig::place`] says.
    pub ranks: Vec<Engine<B>>,
    train: TrainConfig,
    /// Every group's abort: any rank's failure stops the whole job.
    aborts: Vec<AbortHandle>,
}

/// How one rank talks to the others: its data-parallel group (the replicas
/// of its stage), its pipeline links and its tensor-parallel group.
pub struct Links<B: Backend> {
    pub comm: Option<Comm<B>>,
    pub pipe: Option<Pipe<B>>,
    /// Hybrid sharding: the rank's replica group (its counterparts in the
    /// other shard groups).
    pub replicate: Option<Comm<B>>,
    /// Tensor parallelism: the ranks that split this rank's blocks with it.
    pub tp: Option<Comm<B>>,
    /// ZeRO++ hpZ: the rank's group of consecutive data-parallel ranks (a
    /// node), in which zero3's backward gathers run (`shard.rs`).
    pub hpz: Option<Comm<B>>,
    /// Expert parallelism: the rank's group of consecutive data-parallel
    /// ranks that split the experts (tokens go all-to-all within it), and
    /// its expert-data-parallel group, the ranks that hold the same
    /// experts (their gradients and ZeRO state are shared there).
    pub ep: Option<[Comm<B>; 2]>,
}

impl<B: Backend> Links<B> {
    /// A rank alone, or one whose only link is its data-parallel group.
    pub fn data(comm: Option<Comm<B>>) -> Self {
        Links {
            comm,
            pipe: None,
            replicate: None,
            tp: None,
            hpz: None,
            ep: None,
        }
    }

    /// Every link's abort.
    pub fn abort_handles(&self) -> Vec<AbortHandle> {
        let mut v: Vec<AbortHandle> = [&self.comm, &self.replicate, &self.tp, &self.hpz]
            .into_iter()
            .flatten()
            .chain(self.ep.iter().flatten())
            .map(|c| c.abort_handle())
            .collect();
        v.extend(self.pipe.iter().flat_map(Pipe::abort_handles));
        v
    }
}

/// Every rank's links for `train`: `group(w)` makes a collective group of
/// `w` ranks, `chain(s, ring)` the point-to-point links of `s` stages (with
/// `ring`, virtual stages', the last stage's next is the first, and the
/// first's previous the last). Ranks are
/// placed as [`TrainConfig::place`] says. The replicas at one stage and
/// tensor-parallel position form one data-parallel group (or, under hybrid
/// sharding, shard groups of consecutive replicas and the replica groups
/// across them); the stages of one replica and position form one pipeline
/// (with a two-rank group for a tied embedding's gradient); the positions
/// of one replica and stage form one tensor-parallel group. Under hpZ,
/// groups of `hpz_group` consecutive replicas also form a group each.
pub fn links<B: Backend>(
    model: &ModelConfig,
    train: &TrainConfig,
    group: impl Fn(usize) -> Vec<Comm<B>>,
    chain: impl Fn(usize, bool) -> Vec<Box<dyn PointToPoint<B::Buf>>>,
) -> Vec<Links<B>> {
    let stages = train.pipeline_stages.max(1);
    let tps = train.tensor_parallel.max(1);
    let replicas = train.data_ranks();
    let rank = |s: usize, d: usize, t: usize| (s * replicas + d) * tps + t;
    let distributed = replicas > 1 || train.sharding != super::Sharding::None;
    let none = || (0..train.ranks).map(|_| None).collect::<Vec<Option<_>>>();
    let (mut comms, mut replicate, mut tp, mut hpz) = (none(), none(), none(), none());
    // Hybrid sharding: shard groups of consecutive replicas, and replica
    // groups of the replicas a shard group apart.
    let g = train.shard_ranks();
    for s in 0..stages {
        for t in 0..tps {
            if !distributed {
                continue;
            }
            for i in 0..replicas / g {
                for (j, c) in group(g).into_iter().enumerate() {
                    comms[rank(s, i * g + j, t)] = Some(c);
                }
            }
            if g < replicas {
                for j in 0..g {
                    for (i, c) in group(replicas / g).into_iter().enumerate() {
                        replicate[rank(s, i * g + j, t)] = Some(c);
                    }
                }
            }
        }
    }
    let mut pipes: Vec<Option<Pipe<B>>> = (0..train.ranks).map(|_| None).collect();
    if stages > 1 {
        let balance = train.balance(model.n_layer);
        let tied = model.param_layout().1.lm_head.is_none();
        let ring = train.virtual_stages > 1;
        for d in 0..replicas {
            for t in 0..tps {
                let mut p2p = chain(stages, ring).into_iter();
                let mut grp = group(stages).into_iter();
                let mut embed = if tied { group(2) } else { Vec::new() }.into_iter();
                for s in 0..stages {
                    let is_end = s == 0 || s + 1 == stages;
                    pipes[rank(s, d, t)] = Some(Pipe {
                        stage: s,
                        stages,
                        chunks: rank_chunks(&balance, s, stages),
                        chunk: 0,
                        schedule: train.schedule,
                        p2p: p2p.next().expect("one link per stage"),
                        group: grp.next().expect("one rank per stage"),
                        embed: if is_end { embed.next() } else { None },
                    });
                }
            }
        }
    }
    if tps > 1 {
        for s in 0..stages {
            for d in 0..replicas {
                for (t, c) in group(tps).into_iter().enumerate() {
                    tp[rank(s, d, t)] = Some(c);
                }
            }
        }
    }
    // ZeRO++ hpZ: groups of consecutive replicas (a node's ranks).
    let h = train.hpz_group.map_or(0, NonZeroUsize::get);
    if distributed && h > 1 {
        for s in 0..stages {
            for t in 0..tps {
                for i in 0..replicas / h {
                    for (j, c) in group(h).into_iter().enumerate() {
                        hpz[rank(s, i * h + j, t)] = Some(c);
                    }
                }
            }
        }
    }
    let mut ep = expert_groups::<B>(train, &group);
    let mut out = Vec::with_capacity(train.ranks);
    let all = comms.into_iter().zip(pipes).zip(replicate).zip(tp).zip(hpz);
    for (r, ((((comm, pipe), replicate), tp), hpz)) in all.enumerate() {
        out.push(Links {
            comm,
            pipe,
            replicate,
            tp,
            hpz,
            ep: ep[r].take(),
        });
    }
    out
}

/// Expert parallelism's groups, by global rank: at each stage and
/// tensor-parallel position, groups of `P` consecutive replicas split the
/// experts (Megatron-Core's order: the expert-parallel ranks adjacent
/// within the data-parallel ones), and the replicas `P` apart hold the
/// same experts.
fn expert_groups<B: Backend>(
    train: &TrainConfig,
    group: &impl Fn(usize) -> Vec<Comm<B>>,
) -> Vec<Option<[Comm<B>; 2]>> {
    let (stages, tps) = (train.pipeline_stages.max(1), train.tensor_parallel.max(1));
    let (replicas, p) = (train.data_ranks(), train.expert_parallel.max(1));
    let rank = |s: usize, d: usize, t: usize| (s * replicas + d) * tps + t;
    let mut ep: Vec<Option<Comm<B>>> = (0..train.ranks).map(|_| None).collect();
    let mut edp: Vec<Option<Comm<B>>> = (0..train.ranks).map(|_| None).collect();
    if p == 1 {
        return (0..train.ranks).map(|_| None).collect();
    }
    for s in 0..stages {
        for t in 0..tps {
            for i in 0..replicas / p {
                for (j, c) in group(p).into_iter().enumerate() {
                    ep[rank(s, i * p + j, t)] = Some(c);
                }
            }
            for j in 0..p {
                for (i, c) in group(replicas / p).into_iter().enumerate() {
                    edp[rank(s, i * p + j, t)] = Some(c);
                }
            }
        }
    }
    ep.into_iter()
        .zip(edp)
        .map(|(a, b)| {
            Some([
                a.expect("every rank in a group"),
                b.expect("and its replicas"),
            ])
        })
        .collect()
}

/// Runs `f(rank, item)` for every rank, in parallel when there is more than
/// one. A rank that fails or panics aborts the group's collectives first, so
/// the others finish instead of waiting for it; the lowest failing rank's
/// error is returned, and a panic is re-raised once every rank has stopped.
fn on_every_rank<I: Send, R: Send>(
    items: Vec<I>,
    f: impl Fn(usize, I) -> Result<R, RankError> + Sync,
    abort: impl Fn(usize) + Sync,
) -> Result<Vec<R>, RankError> {
    if items.len() == 1 {
        let item = items.into_iter().next().expect("one rank");
        return f(0, item).map(|r| vec![r]);
    }
    let results: Vec<std::thread::Result<Result<R, RankError>>> = std::thread::scope(|s| {
        let handles: Vec<_> = items
            .into_iter()
            .enumerate()
            .map(|(r, item)| {
                let (f, abort) = (&f, &abort);
                s.spawn(move || {
                    let out = catch_unwind(AssertUnwindSafe(|| f(r, item)));
                    if !matches!(out, Ok(Ok(_))) {
                        abort(r);
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(Err))
            .collect()
    });
    let mut out = Vec::with_capacity(results.len());
    let mut first_err = None;
    for res in results {
        match res {
            Ok(Ok(r)) => out.push(r),
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(panic) => resume_unwind(panic),
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

impl<B> Cluster<B>
where
    B: Backend + Send,
    B::Buf: Send,
{
    /// One engine per backend, rank `r` linked by `links[r]` (see [`links`]).
    /// Ranks are built together: under ddp the constructor broadcasts rank
    /// 0's weights.
    pub fn new(
        model: &ModelConfig,
        train: &TrainConfig,
        backends: Vec<B>,
        links: Vec<Links<B>>,
        capacity: Option<u64>,
    ) -> Result<Self, RankError> {
        assert_eq!(backends.len(), links.len());
        let aborts: Vec<AbortHandle> = links.iter().flat_map(Links::abort_handles).collect();
        let items: Vec<(B, Links<B>)> = backends.into_iter().zip(links).collect();
        let ranks = on_every_rank(
            items,
            |r, (be, l)| {
                Engine::new_linked(model.clone(), train.clone(), be, capacity, l)
                    .map_err(|e| (r, e))
            },
            |_| aborts.iter().for_each(|a| a()),
        )?;
        Ok(Cluster {
            ranks,
            train: train.clone(),
            aborts,
        })
    }

    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// One optimizer step on every rank: replica d trains on micro-batches
    /// `d*k .. (d+1)*k` of the `k * replicas` that `next` yields (the global
    /// batch, in order), so the job sees what one rank accumulating all of
    /// them would; under a pipeline the first stage reads each micro-batch's
    /// tokens and the last its targets. The loss is the mean over replicas.
    pub fn step_from(
        &mut self,
        k: usize,
        next: impl FnMut() -> Batch + Send,
    ) -> Result<StepReport, RankError> {
        let n = self.ranks.len();
        if n == 1 {
            let mut next = next;
            return self.ranks[0].step_from(k, &mut next).map_err(|e| (0, e));
        }
        // Each rank asks for its micro-batches once its token buffers are
        // granted (as one rank does); batch `i` of the step is always the
        // i-th that `next` yields, whichever rank asks first.
        let train = &self.train;
        let stages = train.pipeline_stages.max(1);
        let replicas = train.data_ranks();
        // Readers of each batch: the first and the last stage, each with
        // every rank of its tensor-parallel group.
        let readers = if stages > 1 { 2 } else { 1 } * train.tensor_parallel.max(1);
        let feed = Mutex::new((0usize, BTreeMap::new(), next));
        let batch = |i: usize| {
            let mut f = feed.lock().unwrap_or_else(|e| e.into_inner());
            while f.0 <= i {
                let b = (f.2)();
                let at = f.0;
                f.1.insert(at, (b, readers));
                f.0 += 1;
            }
            let (b, left) =
                f.1.get_mut(&i)
                    .expect("each batch is read by its readers only");
            *left -= 1;
            match *left {
                0 => f.1.remove(&i).expect("present").0,
                _ => b.clone(),
            }
        };
        let items: Vec<&mut Engine<B>> = self.ranks.iter_mut().collect();
        let reports = on_every_rank(
            items,
            |r, e| {
                let (d, mut j) = (train.place(r).1, 0);
                e.step_from(k, || {
                    j += 1;
                    batch(d * k + j - 1)
                })
                .map_err(|err| (r, err))
            },
            |_| self.aborts.iter().for_each(|a| a()),
        )?;
        // Every stage reports its replica's loss; the last stage's ranks count.
        // (Tensor-parallel ranks compute the same loss: the first counts.)
        let per_stage = replicas * train.tensor_parallel.max(1);
        let last = &reports[(stages - 1) * per_stage..];
        let tps = train.tensor_parallel.max(1);
        let losses: Option<Vec<f32>> = last.iter().step_by(tps).map(|r| r.loss).collect();
        Ok(StepReport {
            loss: losses.map(|l| l.iter().map(|&x| x as f64).sum::<f64>() as f32 / replicas as f32),
            ..reports[0]
        })
    }

    /// Frees every rank's memory; each tracker then shows zero live bytes.
    pub fn release(self) -> Vec<super::Device<B>> {
        self.ranks.into_iter().map(Engine::release).collect()
    }
}

/// Every rank's links for `train` on meta: collectives and point-to-point
/// that move nothing (see [`links`]).
pub fn meta_links(model: &ModelConfig, train: &TrainConfig) -> Vec<Links<MetaBackend>> {
    links(
        model,
        train,
        |w| {
            (0..w)
                .map(|r| Box::new(MetaComm::new(r, w)) as Comm<MetaBackend>)
                .collect()
        },
        |s, _| (0..s).map(|_| Box::new(MetaP2p) as _).collect(),
    )
}

/// Every rank's links for `train` on cpu: ranks are threads, data moves
/// through shared memory and channels (see [`links`]).
pub fn cpu_links(model: &ModelConfig, train: &TrainConfig) -> Vec<Links<CpuBackend>> {
    links(
        model,
        train,
        |w| {
            cpu_group(w)
                .into_iter()
                .map(|c| Box::new(c) as Comm<CpuBackend>)
                .collect()
        },
        |s, ring| {
            cpu_pipeline(s, ring)
                .into_iter()
                .map(|p| Box::new(p) as _)
                .collect()
        },
    )
}
