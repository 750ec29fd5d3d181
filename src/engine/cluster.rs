//! A data-parallel job: one [`Engine`] per rank, each with its own device and
//! memory tracker, stepped together. Ranks run as threads, because the cpu
//! collectives wait for every rank; on meta nothing waits, and the same code
//! runs.

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Mutex;

use super::{Comm, Engine, StepReport, TrainConfig};
use crate::backend::Backend;
use crate::comm::AbortHandle;
use crate::config::ModelConfig;
use crate::data::Batch;
use crate::memory::OomError;

/// A rank's failure: which rank, and its out-of-memory error.
pub type RankError = (usize, OomError);

pub struct Cluster<B: Backend> {
    pub ranks: Vec<Engine<B>>,
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

fn abort(handles: &[Option<AbortHandle>], r: usize) {
    if let Some(a) = &handles[r] {
        a();
    }
}

impl<B> Cluster<B>
where
    B: Backend + Send,
    B::Buf: Send,
{
    /// One engine per backend; `comms[r]` is rank r's communicator (`None`
    /// only for a single rank without sharding). Ranks are built together:
    /// under ddp the constructor broadcasts rank 0's weights.
    pub fn new(
        model: &ModelConfig,
        train: &TrainConfig,
        backends: Vec<B>,
        comms: Vec<Option<Comm<B>>>,
        capacity: Option<u64>,
    ) -> Result<Self, RankError> {
        assert_eq!(backends.len(), comms.len());
        let aborts: Vec<_> = comms
            .iter()
            .map(|c| c.as_ref().map(|c| c.abort_handle()))
            .collect();
        let items: Vec<(B, Option<Comm<B>>)> = backends.into_iter().zip(comms).collect();
        let ranks = on_every_rank(
            items,
            |r, (be, comm)| {
                Engine::new_rank(model.clone(), train.clone(), be, capacity, comm)
                    .map_err(|e| (r, e))
            },
            |r| abort(&aborts, r),
        )?;
        Ok(Cluster { ranks })
    }

    pub fn world(&self) -> usize {
        self.ranks.len()
    }

    /// One optimizer step on every rank: rank r trains on micro-batches
    /// `r*k .. (r+1)*k` of the `k * ranks` that `next` yields (the global
    /// batch, in order), so the job sees what one rank accumulating all of
    /// them would. The loss is the mean over ranks.
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
        let feed = Mutex::new((0usize, BTreeMap::new(), next));
        let batch = |i: usize| {
            let mut f = feed.lock().unwrap_or_else(|e| e.into_inner());
            while f.0 <= i {
                let b = (f.2)();
                let at = f.0;
                f.1.insert(at, b);
                f.0 += 1;
            }
            f.1.remove(&i).expect("each batch is taken once")
        };
        let aborts: Vec<_> = self.ranks.iter().map(Engine::abort_handle).collect();
        let items: Vec<&mut Engine<B>> = self.ranks.iter_mut().collect();
        let reports = on_every_rank(
            items,
            |r, e| {
                let mut j = 0;
                e.step_from(k, || {
                    j += 1;
                    batch(r * k + j - 1)
                })
                .map_err(|err| (r, err))
            },
            |r| abort(&aborts, r),
        )?;
        let losses: Option<Vec<f32>> = reports.iter().map(|r| r.loss).collect();
        Ok(StepReport {
            loss: losses.map(|l| l.iter().map(|&x| x as f64).sum::<f64>() as f32 / n as f32),
            ..reports[0]
        })
    }

    /// Frees every rank's memory; each tracker then shows zero live bytes.
    pub fn release(self) -> Vec<super::Device<B>> {
        self.ranks.into_iter().map(Engine::release).collect()
    }
}
