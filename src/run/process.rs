//! One rank of a multi-process job (`memfit launch`, torchrun): joining the
//! process group, wiring this rank's links over it (TCP on cpu; NCCL, or
//! TCP staged through the host, on cuda), and training its share.

use super::*;

/// One rank of a multi-process job: its process group, and its own run.
pub type ProcessRun = (
    std::sync::Arc<crate::comm::process::ProcessGroup>,
    Result<(RunReport, Option<Error>)>,
);

/// `memfit run` as rank `env.rank` of a job of `env.world` processes
/// (`memfit launch`, torchrun): joins the process group, builds this rank's
/// one engine linked to the others over it (TCP on cpu; NCCL, or TCP staged
/// through the host, on cuda), and trains on its replica's share of each
/// global batch, so losses and peaks are those of `memfit run --ranks N` in
/// one process. The report is this rank's alone: `launch::rank_main`
/// gathers the ranks' reports on rank 0. An `Err` means this rank never
/// joined the job.
pub fn run_process_rank(
    opts: &RunOptions,
    env: &crate::comm::process::DistEnv,
) -> Result<ProcessRun> {
    let model = load_model(&opts.model)?;
    validate(opts, &model)?;
    check_process_rank(opts, env)?;
    let mut opts = opts.clone();
    let t = &mut opts.train;
    // Offload: this rank's share of its node's host memory.
    if t.offload.optimizer() {
        t.host_memory = t
            .host_memory
            .or_else(mem_available)
            .map(|h| h / env.local_world as u64);
    }
    // This node's cores, shared by its ranks.
    let threads = opts.threads.unwrap_or_else(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / env.local_world).max(1)
    });
    let data = host_data(&opts, &model)?;
    let me = ProcessRank {
        opts,
        model,
        env,
        threads,
        data,
    };
    match me.opts.device.kind {
        DeviceKind::Meta => unreachable!("refused above"),
        DeviceKind::Cpu => me.on_cpu(),
        DeviceKind::Cuda => me.on_cuda(),
    }
}

/// What a multi-process rank refuses beyond [`validate`].
fn check_process_rank(opts: &RunOptions, env: &crate::comm::process::DistEnv) -> Result<()> {
    if opts.train.ranks != env.world {
        return Err(Error::invalid_arg(
            "--ranks",
            format!(
                "{} but WORLD_SIZE is {}: a multi-process job runs one rank per process; pass --ranks {}",
                opts.train.ranks, env.world, env.world
            ),
        ));
    }
    if opts.device.kind == DeviceKind::Meta {
        return Err(Error::invalid_arg(
            "--device",
            "meta plans every rank in one process; run it without memfit launch (memfit run --ranks N)",
        ));
    }
    if opts.timeline.is_some() {
        return Err(Error::invalid_arg(
            "--timeline",
            "a multi-process run writes no timeline yet; run the ranks as threads (memfit run --ranks N, without launch) for one",
        ));
    }
    Ok(())
}

/// One rank of a multi-process job, checked and about to join: its
/// options (its share of the node's host memory and cores), model and data.
struct ProcessRank<'a> {
    opts: RunOptions,
    model: ModelConfig,
    env: &'a crate::comm::process::DistEnv,
    threads: usize,
    data: DataSource,
}

impl ProcessRank<'_> {
    /// On cpu: collectives and pipeline links over TCP.
    fn on_cpu(mut self) -> Result<ProcessRun> {
        use crate::backend::cpu::process::{ProcessComm, ProcessP2p};
        use crate::comm::process::ProcessGroup;
        let env = self.env;
        let backend = CpuBackend::new(self.threads).map_err(Error::Unavailable)?;
        let (group, _) = ProcessGroup::connect(env, || Ok(Vec::new()))?;
        let links = process_links(
            &self.model,
            &self.opts.train,
            env.rank,
            |ch, members| Box::new(ProcessComm::new(&group, ch, members)) as Comm<CpuBackend>,
            |ch, prev, next| Box::new(ProcessP2p::new(&group, ch, prev, next)) as _,
        )?;
        self.opts.device.limit = capped_by_host(self.opts.device.limit, env.local_world);
        let out = self.train(backend, links, &group);
        Ok((group, out))
    }

    /// On cuda: NCCL for the group of every rank where it can run, every
    /// other group and link staged through the host over TCP.
    fn on_cuda(mut self) -> Result<ProcessRun> {
        use crate::backend::cpu::process::{ProcessComm, ProcessP2p};
        use crate::backend::cuda::AnyDriver;
        use crate::backend::cuda::nccl::{NcclComm, Staged, unique_id};
        use crate::comm::process::ProcessGroup;
        let env = self.env;
        let ordinal = self.opts.device.ordinal.unwrap_or(env.local_rank);
        let backend =
            crate::backend::cuda::open(ordinal, self.threads).map_err(Error::Unavailable)?;
        let real = matches!(backend.driver(), AnyDriver::Real(_));
        let use_nccl = use_nccl(real, self.opts.train.pipeline_stages)?;
        let t = &self.opts.train;
        let distributed = t.data_ranks() > 1 || t.sharding != Sharding::None;
        let (group, blob) = ProcessGroup::connect(env, || match use_nccl && distributed {
            true => unique_id().map_err(Error::Unavailable),
            false => Ok(Vec::new()),
        })?;
        let stager = backend.driver().stager();
        // NCCL carries the group of every rank (made once, by all
        // ranks together); other groups stage through the host.
        let nccl_err = std::cell::RefCell::new(None);
        let links = process_links(
            &self.model,
            &self.opts.train,
            env.rank,
            |ch, members| {
                let staged = || {
                    Box::new(Staged::new(
                        ProcessComm::new(&group, ch, members.clone()),
                        stager.clone(),
                    ))
                };
                if !(use_nccl && members.len() == env.world) {
                    return staged() as Comm<crate::backend::cuda::CudaBackend<AnyDriver>>;
                }
                match NcclComm::new(ordinal, &group, ch, &blob, env.timeout) {
                    Ok(c) => Box::new(c),
                    Err(e) => {
                        nccl_err.borrow_mut().get_or_insert(e);
                        staged()
                    }
                }
            },
            |ch, prev, next| {
                Box::new(Staged::new(
                    ProcessP2p::new(&group, ch, prev, next),
                    stager.clone(),
                ))
            },
        )?;
        if let Some(e) = nccl_err.into_inner() {
            return Err(Error::Unavailable(e));
        }
        let backends = [backend];
        let free = device_free_after_startup(&backends);
        self.opts.device.limit = Some(self.opts.device.limit.map_or(free, |l| l.min(free)));
        let [backend] = backends;
        let gpu = GpuRecord {
            description: backend.driver().describe(),
            total_bytes: backend.driver().total_bytes(),
            overhead_bytes: backend.overhead_bytes(),
        };
        let nvml = NvmlWatch::start(ordinal);
        let out = self.train(backend, links, &group).map(|(mut report, err)| {
            report.gpu = Some(gpu);
            let peak = nvml.and_then(NvmlWatch::peak);
            for r in &mut report.ranks {
                r.nvml_peak_bytes = peak;
            }
            (report, err)
        });
        Ok((group, out))
    }

    /// This rank's training: its replica's share of every batch, until
    /// the group fails.
    fn train<B>(
        mut self,
        backend: B,
        links: Links<B>,
        group: &crate::comm::process::ProcessGroup,
    ) -> Result<(RunReport, Option<Error>)>
    where
        B: Backend + Send,
        B::Buf: Send,
    {
        let rank = self.env.rank;
        #[cfg(feature = "test-hooks")]
        crate::faults::rank_fault(rank);
        let failed = || group.failure().is_some();
        let share = Share {
            rank,
            replica: self.opts.train.place(rank).1,
            replicas: self.opts.train.data_ranks(),
            stopped: &failed,
        };
        run_part(
            &self.opts,
            self.model,
            vec![backend],
            vec![links],
            Some(&mut self.data),
            Some(&share),
        )
    }
}

/// Whether the group of every rank runs on NCCL (`MEMFIT_DIST_BACKEND`):
/// by default on a real GPU without pipeline stages; the emulated GPU,
/// `tcp` and pipelines (whose links NCCL is not wired for) stage through
/// the host.
fn use_nccl(real: bool, pipeline_stages: usize) -> Result<bool> {
    use crate::backend::cuda::nccl::BACKEND_ENV;
    Ok(
        match std::env::var(BACKEND_ENV).unwrap_or_default().as_str() {
            "" => real && pipeline_stages == 1,
            "tcp" => false,
            "nccl" if !real => {
                return Err(Error::invalid_arg(
                    BACKEND_ENV,
                    "nccl needs a real GPU; the emulated one (MEMFIT_CUDA_EMULATE) stages collectives through the host: unset it or use tcp",
                ));
            }
            "nccl" if pipeline_stages > 1 => {
                return Err(Error::invalid_arg(
                    BACKEND_ENV,
                    "nccl carries data parallelism only; pipelines stage through the host: unset it or use tcp",
                ));
            }
            "nccl" => true,
            other => {
                return Err(Error::invalid_arg(
                    BACKEND_ENV,
                    format!("`{other}` is not a backend: nccl or tcp"),
                ));
            }
        },
    )
}

/// NVML sampling this process's device memory on one GPU while it trains
/// (`None` without NVML: no driver, no GPU, the emulated one).
pub(super) struct NvmlWatch(crate::telemetry::Sampler);

impl NvmlWatch {
    pub(super) fn start(ordinal: usize) -> Option<NvmlWatch> {
        let t = crate::telemetry::Telemetry::open().ok()?;
        let pid = std::process::id();
        let watch = std::sync::Arc::new(std::sync::Mutex::new(vec![pid]));
        let every = std::time::Duration::from_millis(20);
        Some(NvmlWatch(crate::telemetry::Sampler::start(
            t,
            every,
            Some(ordinal as u32),
            watch,
        )))
    }

    /// The highest memory NVML reported for this process, if it ever did.
    pub(super) fn peak(self) -> Option<u64> {
        let seen = self.0.stop();
        let pid = std::process::id();
        seen.watched
            .iter()
            .find(|w| w.pid == pid && !w.samples.is_empty())
            .map(|w| w.peak_bytes)
    }
}

/// What the meta backend predicts for global rank `rank`'s peak: its
/// links, engine and one step of `train`, on meta emulating this run's
/// device.
pub(super) fn predicted_peak(
    model: &ModelConfig,
    train: &TrainConfig,
    rank: usize,
    gpu: bool,
) -> u64 {
    let meta = match gpu {
        true => MetaBackend::emulating_cuda(),
        false => MetaBackend::emulating_cpu(),
    };
    let link = meta_links(model, train).swap_remove(rank);
    let mut e = Engine::new_linked(model.clone(), train.clone(), meta, None, link)
        .unwrap_or_else(|oom| unreachable!("meta has no capacity: {oom}"));
    e.step_from(train.grad_accum, || unreachable!("meta reads no data"))
        .unwrap_or_else(|oom| unreachable!("meta has no capacity: {oom}"));
    e.dev.tracker.peak_bytes().total
}

/// A cpu rank's capacity: `limit`, capped at its share of the host's
/// available memory among `ranks` ranks (the whole share without a limit),
/// so a model too big for this machine is a typed out-of-memory.
pub(super) fn capped_by_host(limit: Option<u64>, ranks: usize) -> Option<u64> {
    let host = mem_available().map(|h| h / ranks as u64);
    match (limit, host) {
        (Some(l), Some(h)) => Some(l.min(h)),
        (l, h) => l.or(h),
    }
}

/// A group (`false`) or chain (`true`) by its creation index, and a place in it.
type ProbeSeen = std::sync::Arc<std::sync::Mutex<Option<((bool, usize), usize)>>>;

/// Stands in for a group or chain in the first pass of [`process_links`]:
/// calling its abort handle tells which one it is and at which position.
struct Probe {
    id: (bool, usize),
    pos: usize,
    seen: ProbeSeen,
}

impl Probe {
    fn handle(&self) -> crate::comm::AbortHandle {
        let (seen, me) = (self.seen.clone(), (self.id, self.pos));
        std::sync::Arc::new(move || *seen.lock().unwrap_or_else(|e| e.into_inner()) = Some(me))
    }
}

impl<Buf> crate::comm::Collective<Buf> for Probe {
    fn rank(&self) -> usize {
        self.pos
    }
    fn world(&self) -> usize {
        unreachable!("a probe only tells where it is")
    }
    fn all_reduce_sum(&mut self, _: &mut Buf, _: usize) {}
    fn reduce_scatter_sum(&mut self, _: &mut Buf, _: &Buf, _: usize) {}
    fn all_gather(&mut self, _: &mut Buf, _: &Buf, _: usize) {}
    fn broadcast(&mut self, _: &mut Buf, _: usize, _: usize) {}
    fn all_to_all(&mut self, _: &mut Buf, _: &Buf, _: &[usize]) {}
    fn all_reduce_scalar(&mut self, x: f64) -> f64 {
        x
    }
    fn abort_handle(&self) -> crate::comm::AbortHandle {
        self.handle()
    }
}

impl<Buf> crate::comm::PointToPoint<Buf> for Probe {
    fn send(&mut self, _: crate::comm::Peer, _: &Buf, _: usize) {}
    fn recv(&mut self, _: crate::comm::Peer, _: &mut Buf, _: usize) {}
    fn abort_handle(&self) -> crate::comm::AbortHandle {
        self.handle()
    }
}

/// Rank `rank`'s links, wired by [`links`] (the one place that decides who
/// talks to whom) with groups and chains over processes. A first pass with
/// [`Probe`]s learns which global ranks each group and chain `links` makes
/// joins, in its own order; the second makes this rank's: `comm(channel,
/// members)` its collective groups, `p2p(channel, prev, next)` its
/// pipeline links (global ranks), each on a channel of its own. The other
/// ranks' places get [`crate::comm::process::Elsewhere`] and are dropped.
fn process_links<B: Backend>(
    model: &ModelConfig,
    train: &TrainConfig,
    rank: usize,
    comm: impl Fn(u32, Vec<usize>) -> Comm<B>,
    p2p: impl Fn(u32, Option<usize>, Option<usize>) -> Box<dyn crate::comm::PointToPoint<B::Buf>>,
) -> Result<Links<B>> {
    use crate::comm::process::Elsewhere;
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;
    type Id = (bool, usize);
    let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
    let (groups, chains) = (Cell::new(0), Cell::new(0));
    let next = |c: &Cell<usize>| c.replace(c.get() + 1);
    let probes = |id: Id, n: usize| -> Vec<Probe> {
        (0..n)
            .map(|pos| Probe {
                id,
                pos,
                seen: seen.clone(),
            })
            .collect()
    };
    let probed = links::<B>(
        model,
        train,
        |w| {
            let id = (false, next(&groups));
            probes(id, w)
                .into_iter()
                .map(|p| Box::new(p) as Comm<B>)
                .collect()
        },
        |s, _| {
            let id = (true, next(&chains));
            probes(id, s)
                .into_iter()
                .map(|p| Box::new(p) as _)
                .collect()
        },
    );
    let mut members: HashMap<Id, Vec<Option<usize>>> = HashMap::new();
    let mut place = |h: crate::comm::AbortHandle, r: usize| {
        h();
        let (id, pos) = seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .expect("a probe");
        let m = members.entry(id).or_default();
        if m.len() <= pos {
            m.resize(pos + 1, None);
        }
        m[pos] = Some(r);
    };
    for (r, l) in probed.iter().enumerate() {
        // Every field by name: a new kind of link must be placed here too.
        let Links {
            comm,
            pipe,
            replicate,
            tp,
            hpz,
            ep,
        } = l;
        let ep = ep.iter().flatten();
        for c in comm.iter().chain(replicate).chain(tp).chain(hpz).chain(ep) {
            place(c.abort_handle(), r);
        }
        if let Some(p) = pipe {
            place(p.p2p.abort_handle(), r);
            place(p.group.abort_handle(), r);
            if let Some(e) = &p.embed {
                place(e.abort_handle(), r);
            }
        }
    }
    drop(probed);
    // Global ranks of group `id` of `n` places, if every place was found.
    let ranks_of = |id: Id, n: usize| -> Option<Vec<usize>> {
        let m = members.get(&id)?;
        (m.len() == n).then(|| m.iter().copied().collect::<Option<Vec<_>>>())?
    };
    let unknown = RefCell::new(false);
    // Channel 0 is unused; chains after every group.
    let channel = |id: Id| 1 + id.1 as u32 + if id.0 { 1 << 20 } else { 0 };
    let (groups, chains) = (Cell::new(0), Cell::new(0));
    let mut all = links(
        model,
        train,
        |w| {
            let id = (false, next(&groups));
            let Some(ranks) = ranks_of(id, w) else {
                *unknown.borrow_mut() = true;
                return (0..w).map(|_| Box::new(Elsewhere) as Comm<B>).collect();
            };
            ranks
                .iter()
                .map(|&r| match r == rank {
                    true => comm(channel(id), ranks.clone()),
                    false => Box::new(Elsewhere) as Comm<B>,
                })
                .collect()
        },
        |s, ring| {
            let id = (true, next(&chains));
            let Some(ranks) = ranks_of(id, s) else {
                *unknown.borrow_mut() = true;
                return (0..s).map(|_| Box::new(Elsewhere) as _).collect();
            };
            // A ring (virtual stages): the last stage's next is the first.
            let (first, last) = (ranks.first().copied(), ranks.last().copied());
            (0..s)
                .map(|i| match ranks[i] == rank {
                    true => p2p(
                        channel(id),
                        i.checked_sub(1).map(|j| ranks[j]).or(last.filter(|_| ring)),
                        ranks.get(i + 1).copied().or(first.filter(|_| ring)),
                    ),
                    false => Box::new(Elsewhere) as _,
                })
                .collect()
        },
    );
    if unknown.into_inner() {
        return Err(Error::invalid_arg(
            "--ranks",
            "this layout has groups a multi-process run cannot wire yet; run its ranks as threads (memfit run --ranks N, without launch)",
        ));
    }
    Ok(all.swap_remove(rank))
}
