//! Ranking the cheapest trials on paired measurements.
//!
//! A sweep times its trials one after another, over minutes. On a shared
//! host the load drifts in between, so two trials' figures differ by the
//! load as much as by their configurations: one quickstart configuration
//! measured 21,085 tokens/s in one sweep and 57,359 in the next, each with
//! a tight 95% interval, because the load was steady within each trial.
//!
//! So the contenders (the cheapest fitting trials by their own measurement)
//! are timed again, interleaved, the way hyperfine alternates commands:
//! round after round each contender runs one short bout (a child process:
//! one warm-up step and a few timed ones), in an order rotated every round.
//! The bouts of one round run within seconds of each other and share the
//! load, so the ratio of two contenders' costs in the same round cancels
//! it. Each finalist's figure is the median of its per-round ratios to the
//! fastest, with the sign-test interval of that median ([`crate::stats`]).
//!
//! When there are more contenders than finalists, a few screening rounds
//! over all of them pick the finalists first (the same paired score), so a
//! trial that was slowed by load when it ran alone still gets its chance.
//! Paired intervals wider than the noise bound are re-timed with more
//! rounds, a bounded number of times; if they stay wide, the ranking says
//! the host was too noisy to separate the finalists and widens the tie.

use serde::{Deserialize, Serialize};

use crate::report::sweep::{PairedTrial, Ranking};
use crate::stats::median_ci;

/// How contenders are re-timed and when they count as tied.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Retime {
    /// Interleaved rounds of the finalists (0: rank on each trial's own
    /// measurement, as sweeps did before).
    pub rounds: usize,
    /// Timed steps per bout at least, after one warm-up step ...
    pub bout_steps: usize,
    /// ... and until its timed steps took this many seconds (at most ten
    /// times `bout_steps` steps). A bout of three 70 ms steps varied as
    /// much as the contenders differ, even on an idle host.
    pub bout_budget_s: f64,
    /// Trials re-timed at most: the cheapest by their own measurement ...
    pub max_contenders: usize,
    /// ... among those whose cost interval reaches within this factor of
    /// the cheapest median (load that drifts between trials can make a
    /// trial look this much slower than it is).
    pub within: f64,
    /// With more contenders than `max_finalists`: screening rounds over
    /// all of them, then the `max_finalists` fastest by paired score are
    /// the finalists (keeping every near one: a tie can only name
    /// finalists).
    pub screen_rounds: usize,
    pub max_finalists: usize,
    /// Finalists more than this fraction slower than the fastest even at
    /// their paired interval's low end are out of the running: their
    /// intervals neither call for re-timing nor widen the tie.
    pub in_running: f64,
    /// Paired intervals (of the finalists in the running) wider than ±this
    /// fraction are not ranked on: the finalists run `rounds` more rounds,
    /// at most `max_retries` times.
    pub noise_bound: f64,
    pub max_retries: usize,
    /// Finalists whose paired interval reaches within this fraction of
    /// the fastest are tied with it, at the least.
    pub tie_floor: f64,
}

impl Default for Retime {
    fn default() -> Self {
        Retime {
            rounds: 9,
            bout_steps: 3,
            bout_budget_s: 0.5,
            max_contenders: 12,
            within: 2.0,
            screen_rounds: 3,
            in_running: 0.25,
            max_finalists: 6,
            noise_bound: 0.10,
            max_retries: 2,
            tie_floor: 0.05,
        }
    }
}

impl Retime {
    /// No re-timing: rank on each trial's own measurement.
    pub fn off() -> Self {
        Retime {
            rounds: 0,
            ..Retime::default()
        }
    }
}

/// The most rounds `--paired-rounds` may ask for.
pub const MAX_ROUNDS: usize = 1000;

/// Why `rounds` cannot be a `--paired-rounds`, if it cannot.
pub fn check_rounds(rounds: usize) -> Result<(), String> {
    if rounds > MAX_ROUNDS {
        return Err(format!("must be at most {MAX_ROUNDS}"));
    }
    Ok(())
}

/// One bout's result.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bout {
    /// Cost per token in the ranking's unit ($ or host seconds per
    /// million tokens): only ratios between bouts are used.
    pub cost: f64,
    pub tokens_per_s: f64,
}

/// What times bouts: child processes in a sweep, a fake clock in tests.
pub trait Bench {
    /// One bout of trial `trial`; `None` when it failed (a crash, an OOM,
    /// a timeout), which never stops the ranking.
    fn bout(&mut self, trial: usize) -> Option<Bout>;
    /// The sweep is stopping: start no more bouts.
    fn stopped(&self) -> bool {
        false
    }
    /// A progress line (which stage is running).
    fn say(&mut self, _line: &str) {}
}

/// The contenders among `costs` (trial index, median cost, the cost
/// interval's low end) of the fitting trials the recommendation may pick:
/// those whose low end is within `policy.within` of the cheapest median,
/// the `policy.max_contenders` cheapest by median. Deterministic: equal
/// medians keep `costs`' order.
pub fn contenders(costs: &[(usize, f64, f64)], policy: &Retime) -> Vec<usize> {
    let mut v: Vec<&(usize, f64, f64)> = costs.iter().filter(|c| c.1.is_finite()).collect();
    v.sort_by(|a, b| a.1.total_cmp(&b.1));
    let Some(best) = v.first().map(|c| c.1) else {
        return Vec::new();
    };
    v.into_iter()
        .filter(|c| c.2 <= best * policy.within)
        .take(policy.max_contenders)
        .map(|c| c.0)
        .collect()
}

/// Bouts by round: `rows[r][c]` is column `c`'s bout in round `r`.
type Rows = Vec<Vec<Option<Bout>>>;

/// Runs `n` rounds over `trials` (columns), starting the rotation at
/// round `first`. `false` when the bench stopped part-way (the rows of
/// finished rounds are kept).
fn run_rounds(
    bench: &mut dyn Bench,
    trials: &[usize],
    n: usize,
    first: usize,
    rows: &mut Rows,
) -> bool {
    let k = trials.len();
    for r in 0..n {
        let mut row = vec![None; k];
        // A B C, then B C A, then C A B: no contender always runs first
        // (after the previous round's last bout) or last.
        for j in 0..k {
            let c = (first + r + j) % k;
            if bench.stopped() {
                return false;
            }
            row[c] = bench.bout(trials[c]);
        }
        rows.push(row);
    }
    true
}

/// Paired figures of the columns of `rows`.
#[derive(Debug)]
struct Analysis {
    /// Columns that gave a time in more than half their bouts (and in at
    /// least two), fastest first by paired score.
    order: Vec<usize>,
    /// Per column: its cost over the fastest's in the same round, median
    /// and interval `(median, lo, hi)`.
    ratio: Vec<(f64, f64, f64)>,
    ok: Vec<usize>,
    failed: Vec<usize>,
    tokens_per_s: Vec<f64>,
    /// The widest paired interval among `order` (half-width over median),
    /// of the columns in the running.
    widest: f64,
}

fn analyse(rows: &Rows, k: usize, in_running: f64) -> Analysis {
    let ok: Vec<usize> = (0..k)
        .map(|c| rows.iter().filter(|r| r[c].is_some()).count())
        .collect();
    let failed: Vec<usize> = (0..k).map(|c| rows.len() - ok[c]).collect();
    let active: Vec<usize> = (0..k)
        .filter(|&c| ok[c] >= 2 && ok[c] * 2 > rows.len())
        .collect();
    let tokens_per_s: Vec<f64> = (0..k)
        .map(|c| {
            let t: Vec<f64> = rows
                .iter()
                .filter_map(|r| r[c])
                .map(|b| b.tokens_per_s)
                .collect();
            crate::stats::median(&t)
        })
        .collect();
    // The score cancels each round's load: a bout's cost over the
    // geometric mean of its round (rounds every active column ran).
    let complete: Vec<&Vec<Option<Bout>>> = rows
        .iter()
        .filter(|r| active.iter().all(|&c| r[c].is_some()))
        .collect();
    let mut score = vec![f64::INFINITY; k];
    for &c in &active {
        let s: Vec<f64> = if complete.is_empty() {
            rows.iter().filter_map(|r| r[c]).map(|b| b.cost).collect()
        } else {
            complete
                .iter()
                .map(|r| {
                    let g = crate::stats::geometric_mean(
                        active.iter().map(|&a| r[a].expect("complete").cost),
                    );
                    r[c].expect("complete").cost / g
                })
                .collect()
        };
        score[c] = crate::stats::median(&s);
    }
    let mut order = active.clone();
    order.sort_by(|&a, &b| score[a].total_cmp(&score[b]).then(a.cmp(&b)));
    let mut ratio = vec![(f64::NAN, f64::NAN, f64::NAN); k];
    let mut widest: f64 = 0.0;
    if let Some(&fastest) = order.first() {
        for &c in &order {
            if c == fastest {
                ratio[c] = (1.0, 1.0, 1.0);
                continue;
            }
            let q: Vec<f64> = rows
                .iter()
                .filter_map(|r| Some(r[c]?.cost / r[fastest]?.cost))
                .collect();
            let (m, lo, hi) = median_ci(&q);
            ratio[c] = (m, lo, hi);
            // A finalist slower than the fastest by more than `in_running`
            // even at its interval's low end is out of the running: how
            // well it is known changes no decision.
            if lo > 1.0 + in_running {
                continue;
            }
            let half = (hi - lo) / 2.0 / m;
            widest = widest.max(if half.is_finite() {
                half
            } else {
                f64::INFINITY
            });
        }
    }
    Analysis {
        order,
        ratio,
        ok,
        failed,
        tokens_per_s,
        widest,
    }
}

/// A ranking that re-timed nothing: `method` `single` or `predicted`, and why.
pub fn unranked(method: &str, note: &str, policy: &Retime) -> Ranking {
    Ranking {
        method: method.into(),
        note: Some(note.into()),
        contenders: Vec::new(),
        rounds: 0,
        bout_steps: policy.bout_steps,
        bout_budget_s: policy.bout_budget_s,
        paired: Vec::new(),
        widest_half_interval: 0.0,
        noise_bound: policy.noise_bound,
        retries: 0,
        max_retries: policy.max_retries,
        tie_within: policy.tie_floor,
        tie_floor: policy.tie_floor,
        noisy: false,
        drift: None,
        load_swing: None,
        screened: Vec::new(),
    }
}

/// Re-times `contenders` (trial indices, cheapest first) on `bench` and
/// ranks them on paired ratios. With fewer than two contenders, or when
/// the bench stops before the finalists' rounds are done, the ranking is
/// `single` and its note says why.
pub fn rank(contenders: &[usize], bench: &mut dyn Bench, policy: &Retime) -> Ranking {
    let mut ranking = Ranking {
        note: None,
        contenders: contenders.to_vec(),
        ..unranked("single", "", policy)
    };
    if policy.rounds == 0 {
        ranking.note = Some(
            "not re-timed: paired re-timing is off (--paired-rounds 0, or the TUI, which ranks trials as they come in)"
                .into(),
        );
        return ranking;
    }
    if contenders.len() < 2 {
        ranking.note = Some(format!(
            "no other fitting trial's cost came within {}x of the cheapest's, so nothing was re-timed",
            policy.within
        ));
        return ranking;
    }
    if let Err(why) = rank_paired(contenders, bench, policy, &mut ranking) {
        ranking.note = Some(why.into());
    }
    ranking
}

const STOPPED: &str =
    "re-timing was interrupted, so the ranking rests on each trial's own measurement";

/// The finalists and their paired bouts so far.
struct Finals {
    /// Trial indices.
    finalists: Vec<usize>,
    /// One row per round, one column per finalist.
    rows: Rows,
    /// The screening's rows over every contender, kept to place the ones
    /// screened out against the fastest finalist (`None`: no screening).
    screening: Option<Rows>,
}

/// Re-times the contenders interleaved and fills in `ranking` as
/// `paired`; the error is why the ranking stays `single`.
fn rank_paired(
    contenders: &[usize],
    bench: &mut dyn Bench,
    policy: &Retime,
    ranking: &mut Ranking,
) -> std::result::Result<(), &'static str> {
    let mut finals = pick_finalists(contenders, bench, policy)?;
    let (a, futile) = retime_finalists(bench, &mut finals, policy, ranking)?;
    if a.order.is_empty() {
        return Err(
            "every finalist's bouts failed, so the ranking rests on each trial's own measurement",
        );
    }
    let Finals {
        finalists,
        rows,
        screening,
    } = &finals;
    let dropped: Vec<usize> = (0..finalists.len())
        .filter(|c| !a.order.contains(c))
        .collect();
    let mut notes: Vec<String> = futile.into_iter().collect();
    if !dropped.is_empty() {
        let list: Vec<String> = dropped
            .iter()
            .map(|&c| {
                format!(
                    "#{} ({} of {} bouts failed)",
                    finalists[c],
                    a.failed[c],
                    rows.len()
                )
            })
            .collect();
        notes.push(format!(
            "left out of the paired ranking: {}",
            list.join(", ")
        ));
    }
    if !notes.is_empty() {
        ranking.note = Some(notes.join("; "));
    }
    ranking.method = "paired".into();
    ranking.rounds = rows.len();
    ranking.widest_half_interval = a.widest;
    ranking.noisy = a.widest > policy.noise_bound;
    ranking.tie_within = policy.tie_floor.max(2.0 * a.widest);
    ranking.tie_floor = policy.tie_floor;
    ranking.load_swing = load_swing(rows);
    if let (Some(screen), Some(&fastest)) = (screening, a.order.first()) {
        ranking.screened = screened_out(contenders, finalists, screen, finalists[fastest]);
    }
    ranking.paired = a
        .order
        .iter()
        .map(|&c| PairedTrial {
            trial: finalists[c],
            cost_ratio: a.ratio[c].0,
            cost_ratio_ci: [a.ratio[c].1, a.ratio[c].2],
            tokens_per_s: a.tokens_per_s[c],
            bouts: a.ok[c],
            failed_bouts: a.failed[c],
        })
        .collect();
    Ok(())
}

/// The finalists: every contender when there are few enough, else the
/// fastest of a screening of them all (a few rounds, whose rows are paired
/// data for the finalists too).
fn pick_finalists(
    contenders: &[usize],
    bench: &mut dyn Bench,
    policy: &Retime,
) -> std::result::Result<Finals, &'static str> {
    if contenders.len() <= policy.max_finalists {
        return Ok(Finals {
            finalists: contenders.to_vec(),
            rows: Vec::new(),
            screening: None,
        });
    }
    bench.say(&format!(
        "screening {} contenders in {} interleaved rounds",
        contenders.len(),
        policy.screen_rounds
    ));
    let mut screen = Vec::new();
    if !run_rounds(bench, contenders, policy.screen_rounds, 0, &mut screen) {
        return Err(STOPPED);
    }
    let a = analyse(&screen, contenders.len(), policy.in_running);
    if a.order.is_empty() {
        return Err(
            "every screening bout failed, so the ranking rests on each trial's own measurement",
        );
    }
    let keep: Vec<usize> = a.order.iter().copied().take(policy.max_finalists).collect();
    Ok(Finals {
        finalists: keep.iter().map(|&c| contenders[c]).collect(),
        rows: screen
            .iter()
            .map(|r| keep.iter().map(|&c| r[c]).collect())
            .collect(),
        screening: Some(screen),
    })
}

/// Times the finalists in batches of `policy.rounds` interleaved rounds
/// until their paired intervals are within the noise bound, the retries
/// are spent, or more rounds could not get them there (the note saying
/// so). `ranking.retries` counts the batches after the first.
fn retime_finalists(
    bench: &mut dyn Bench,
    finals: &mut Finals,
    policy: &Retime,
    ranking: &mut Ranking,
) -> std::result::Result<(Analysis, Option<String>), &'static str> {
    let Finals {
        finalists, rows, ..
    } = finals;
    let k = finalists.len();
    let mut a = None;
    let mut futile = None;
    for batch in 0..=policy.max_retries {
        bench.say(&format!(
            "re-timing {k} finalists interleaved, rounds {}-{}",
            rows.len() + 1,
            rows.len() + policy.rounds
        ));
        let first = rows.len();
        if !run_rounds(bench, finalists, policy.rounds, first, rows) {
            return Err(STOPPED);
        }
        ranking.retries = batch;
        let now = analyse(rows, k, policy.in_running);
        let settled = now.widest <= policy.noise_bound;
        let left = (policy.max_retries - batch) * policy.rounds;
        let widest = now.widest;
        a = Some(now);
        if settled || left == 0 {
            break;
        }
        if !worth_retrying(widest, rows.len(), rows.len() + left, policy.noise_bound) {
            futile = Some(format!(
                "not re-timed further: at ±{:.0}% after {} rounds, even {} rounds would not narrow the paired intervals to ±{:.0}%",
                widest * 100.0,
                rows.len(),
                rows.len() + left,
                policy.noise_bound * 100.0
            ));
            break;
        }
    }
    Ok((a.expect("one batch at least"), futile))
}

/// Contenders screened out, against the fastest finalist in the same
/// screening rounds: a few rounds under load can drop one that is as
/// fast (a sweep under a switching CPU hog dropped the idle host's
/// runner-up this way, then settled its finalists to ±9% and tied
/// none of them with it). Cheapest first.
fn screened_out(
    contenders: &[usize],
    finalists: &[usize],
    screen: &Rows,
    fastest: usize,
) -> Vec<PairedTrial> {
    let f = contenders
        .iter()
        .position(|&t| t == fastest)
        .expect("finalists are contenders");
    let mut screened: Vec<PairedTrial> = (0..contenders.len())
        .filter(|&c| !finalists.contains(&contenders[c]))
        .filter_map(|c| {
            let q: Vec<f64> = (screen.iter())
                .filter_map(|r| Some(r[c]?.cost / r[f]?.cost))
                .collect();
            let t: Vec<f64> = (screen.iter())
                .filter_map(|r| r[c])
                .map(|b| b.tokens_per_s)
                .collect();
            let (m, lo, hi) = median_ci(&q);
            (!q.is_empty()).then(|| PairedTrial {
                trial: contenders[c],
                cost_ratio: m,
                cost_ratio_ci: [lo, hi],
                tokens_per_s: crate::stats::median(&t),
                bouts: t.len(),
                failed_bouts: screen.len() - t.len(),
            })
        })
        .collect();
    screened.sort_by(|x, y| x.cost_ratio.total_cmp(&y.cost_ratio));
    screened
}

/// Of each column's bouts, the 90th percentile of their costs over the
/// 10th; the largest of these (`None` without two bouts in a column).
/// Percentiles, not the costliest and cheapest bout: one bout in a dozen
/// that a stray process slowed is not the load swinging (on an idle host
/// the extremes alone made it 1.85x, and tied 59 of 68 trials), while load
/// that comes and goes for seconds at a time slows a tenth of the bouts
/// and more.
fn load_swing(rows: &Rows) -> Option<f64> {
    let k = rows.first().map_or(0, Vec::len);
    (0..k)
        .filter_map(|c| {
            let mut costs: Vec<f64> = rows.iter().filter_map(|r| r[c]).map(|b| b.cost).collect();
            costs.sort_by(f64::total_cmp);
            let lo = percentile(&costs, 0.1)?;
            let hi = percentile(&costs, 0.9)?;
            (costs.len() >= 2 && lo > 0.0).then(|| hi / lo)
        })
        .reduce(f64::max)
}

/// The `q`-quantile of `sorted` (nearest rank: the smallest value at or
/// above which lies at least `1 - q` of them).
fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    let n = sorted.len();
    let rank = ((q * n as f64).ceil() as usize).clamp(1, n.max(1));
    sorted.get(rank - 1).copied()
}

/// Whether re-timing can still narrow intervals of relative half-width
/// `widest` after `rounds` rounds to `bound` within `at_most` rounds: an
/// interval of the median narrows as one over the square root of the
/// rounds, so wider than that it is futile, and the host is called noisy
/// now rather than after minutes of bouts.
pub fn worth_retrying(widest: f64, rounds: usize, at_most: usize, bound: f64) -> bool {
    at_most > rounds && widest * (rounds as f64 / at_most as f64).sqrt() <= bound
}

/// The paired finalists `ranking` ties with the fastest (its interval
/// reaches within `tie_within`; and the contenders screened out whose
/// screening interval does), and those timing cannot tell from it at
/// all (its interval reaches 1.0 and its median is within `tie_floor`:
/// on a noisy host a wide interval alone would let a slower one in), each
/// fastest first.
pub fn tie_sets(ranking: &Ranking) -> (Vec<usize>, Vec<usize>) {
    // Contenders screened out whose screening interval still reaches
    // within the tie are tied too (never the pick: they ran too few
    // rounds to be one).
    let tied = (ranking.paired.iter())
        .chain(&ranking.screened)
        .filter(|p| p.cost_ratio_ci[0] <= 1.0 + ranking.tie_within)
        .map(|p| p.trial)
        .collect();
    let same = ranking
        .paired
        .iter()
        .filter(|p| p.cost_ratio_ci[0] <= 1.0 && p.cost_ratio <= 1.0 + ranking.tie_floor)
        .map(|p| p.trial)
        .collect();
    (tied, same)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::report::sweep::SweepReport;

    /// A host whose load follows `load(t)` on a fake clock: a bout of a
    /// trial whose unloaded step takes `step_s[trial]` seconds takes
    /// `step_s * load` per step, with a little deterministic jitter, and
    /// advances the clock by its warm-up and timed steps.
    pub(crate) struct FakeHost {
        pub t: f64,
        pub step_s: Vec<f64>,
        pub load: fn(f64) -> f64,
        pub jitter: f64,
        pub rng: crate::rng::Rng,
        pub fail: Vec<usize>,
        /// Trials whose steps vary from 0.1x to 1.9x.
        pub wild: Vec<usize>,
        pub bouts: usize,
    }

    impl FakeHost {
        pub(crate) fn new(step_s: Vec<f64>, load: fn(f64) -> f64) -> Self {
            FakeHost {
                t: 0.0,
                step_s,
                load,
                jitter: 0.01,
                rng: crate::rng::Rng::new(7),
                fail: Vec::new(),
                wild: Vec::new(),
                bouts: 0,
            }
        }

        /// One step of `trial` now, with the load and jitter of this moment.
        pub(crate) fn step(&mut self, trial: usize) -> f64 {
            let jitter = if self.wild.contains(&trial) {
                0.9
            } else {
                self.jitter
            };
            let s = self.step_s[trial]
                * (self.load)(self.t)
                * (1.0 + jitter * (2.0 * self.rng.uniform() - 1.0));
            self.t += s;
            s
        }
    }

    impl Bench for FakeHost {
        fn bout(&mut self, trial: usize) -> Option<Bout> {
            self.bouts += 1;
            self.t += 0.03; // process start
            self.step(trial); // warm-up
            let steps: Vec<f64> = (0..3).map(|_| self.step(trial)).collect();
            if self.fail.contains(&trial) {
                return None;
            }
            let s = crate::stats::median(&steps);
            Some(Bout {
                cost: s,
                tokens_per_s: 4096.0 / s,
            })
        }
    }

    /// Load that a CPU hog switches on and off: 2x for 30 s, 1x for 30 s.
    pub(crate) fn hog(t: f64) -> f64 {
        if (t / 30.0).floor() as i64 % 2 == 0 {
            2.0
        } else {
            1.0
        }
    }

    #[test]
    fn contenders_are_the_cheapest_within_the_factor() {
        let p = Retime {
            max_contenders: 3,
            ..Retime::default()
        };
        // (trial, median, low end): #3's median is far, its low end near.
        let costs = [
            (0, 10.0, 9.0),
            (1, 12.0, 11.0),
            (2, 30.0, 25.0),
            (3, 40.0, 19.0),
            (4, f64::INFINITY, 1.0),
        ];
        assert_eq!(contenders(&costs, &p), vec![0, 1, 3]);
        assert_eq!(contenders(&costs[..1], &p), vec![0]);
        assert!(contenders(&[], &p).is_empty());
    }

    #[test]
    fn paired_ratios_cancel_load_that_drifts_between_bouts() {
        // #0 is 4% slower than #1, #2 is 30% slower; the hog doubles every
        // time for 30 s at a time, far more than any difference here.
        let mut host = FakeHost::new(vec![0.104, 0.100, 0.130], hog);
        let r = rank(&[0, 1, 2], &mut host, &Retime::default());
        assert_eq!(r.method, "paired");
        let order: Vec<usize> = r.paired.iter().map(|p| p.trial).collect();
        assert_eq!(order, vec![1, 0, 2], "{r:#?}");
        let by = |t: usize| r.paired.iter().find(|p| p.trial == t).unwrap();
        assert!((by(0).cost_ratio - 1.04).abs() < 0.02, "{r:#?}");
        assert!((by(2).cost_ratio - 1.30).abs() < 0.05, "{r:#?}");
        assert!(!r.noisy, "{r:#?}");
        // 4% is within the 5% tie floor; 30% is not.
        let (tied, same) = tie_sets(&r);
        assert_eq!(tied, vec![1, 0]);
        assert_eq!(same, vec![1]);
    }

    #[test]
    fn many_contenders_are_screened_down_to_the_finalists() {
        let step_s: Vec<f64> = (0..10).map(|i| 0.1 * (1.0 + 0.1 * i as f64)).collect();
        let mut host = FakeHost::new(step_s, hog);
        let p = Retime {
            max_finalists: 3,
            ..Retime::default()
        };
        let all: Vec<usize> = (0..10).rev().collect();
        let r = rank(&all, &mut host, &p);
        let order: Vec<usize> = r.paired.iter().map(|p| p.trial).collect();
        assert_eq!(order, vec![0, 1, 2], "{r:#?}");
        // 10 x 3 screening bouts, then 3 x 9.
        assert_eq!(host.bouts, 30 + 27);
        assert_eq!(r.rounds, 3 + 9);
    }

    #[test]
    fn a_contender_screened_out_but_as_fast_stays_in_the_tie() {
        // Four as fast as each other (within 2%), four 50-80% slower, and
        // room for three finalists: one of the fast four is screened out.
        let step_s = vec![0.100, 0.101, 0.102, 0.1005, 0.15, 0.16, 0.17, 0.18];
        let mut host = FakeHost::new(step_s, hog);
        let p = Retime {
            max_finalists: 3,
            ..Retime::default()
        };
        let all: Vec<usize> = (0..8).collect();
        let r = rank(&all, &mut host, &p);
        assert_eq!(r.paired.len(), 3, "{r:#?}");
        assert_eq!(r.screened.len(), 5, "{r:#?}");
        let (mut tied, same) = tie_sets(&r);
        tied.sort();
        assert_eq!(tied, vec![0, 1, 2, 3], "{r:#?}");
        // The pick is still a finalist.
        assert!(same.iter().all(|t| r.paired.iter().any(|p| p.trial == *t)));
        // Without screening nothing is screened out.
        let r = rank(&all[..3], &mut host, &p);
        assert!(r.screened.is_empty());
    }

    #[test]
    fn retrying_stops_where_more_rounds_cannot_reach_the_bound() {
        // ±15% after 9 rounds: 27 would make it ±8.7%, so re-time.
        assert!(worth_retrying(0.15, 9, 27, 0.10));
        // ±20%: 27 rounds would leave ±11.5%.
        assert!(!worth_retrying(0.20, 9, 27, 0.10));
        assert!(!worth_retrying(0.05, 27, 27, 0.10));
    }

    #[test]
    fn a_noisy_host_is_retimed_a_bounded_number_of_times_then_said_to_be() {
        for (jitter, seed) in [
            (0.9, 7),
            (0.4, 7),
            (0.4, 8),
            (0.3, 9),
            (0.25, 7),
            (0.2, 7),
            (0.2, 8),
            (0.15, 7),
        ] {
            let mut host = FakeHost::new(vec![0.100, 0.103], |_| 1.0);
            host.jitter = jitter; // each step anywhere in 1 ± jitter
            host.rng = crate::rng::Rng::new(seed);
            let r = rank(&[0, 1], &mut host, &Retime::default());
            eprintln!(
                "jitter {jitter} seed {seed}: {} rounds, ±{:.1}%, noisy {}",
                r.rounds,
                r.widest_half_interval * 100.0,
                r.noisy
            );
            assert_eq!(r.method, "paired");
            assert!(r.retries <= 2, "{r:#?}");
            assert_eq!(r.rounds, 9 * (r.retries + 1), "{r:#?}");
            assert_eq!(host.bouts, 2 * r.rounds);
            assert_eq!(r.noisy, r.widest_half_interval > 0.10, "{r:#?}");
            if r.noisy && r.retries < 2 {
                assert!(
                    r.note.as_deref().unwrap().contains("not re-timed further"),
                    "{r:#?}"
                );
            }
            if r.noisy {
                // The tie is widened to twice the noise: both are tied.
                assert!(r.tie_within >= 0.2, "{r:#?}");
                assert_eq!(tie_sets(&r).0.len(), 2);
            }
        }
        let run = |jitter: f64, seed: u64| {
            let mut host = FakeHost::new(vec![0.100, 0.103], |_| 1.0);
            host.jitter = jitter;
            host.rng = crate::rng::Rng::new(seed);
            rank(&[0, 1], &mut host, &Retime::default())
        };
        // Steps anywhere from 0.1x to 1.9x: hopeless after one batch.
        let r = run(0.9, 7);
        assert_eq!((r.retries, r.rounds, r.noisy), (0, 9, true), "{r:#?}");
        // Both re-timings used, still wider than ±10%: noisy.
        let r = run(0.4, 8);
        assert_eq!((r.retries, r.rounds, r.noisy), (2, 27, true), "{r:#?}");
        // One re-timing, then the last could not have reached ±10%.
        let r = run(0.4, 7);
        assert_eq!((r.retries, r.rounds, r.noisy), (1, 18, true), "{r:#?}");
        // Quiet enough at once.
        let r = run(0.2, 7);
        assert_eq!((r.retries, r.rounds, r.noisy), (0, 9, false), "{r:#?}");
        // And somewhere between, re-timing narrows an interval to the bound.
        let settled = (1..40)
            .map(|seed| run(0.3, seed))
            .find(|r| r.retries > 0 && !r.noisy);
        assert!(settled.is_some_and(|r| r.widest_half_interval <= 0.10));
    }

    #[test]
    fn a_finalist_out_of_the_running_neither_retimes_nor_widens_the_tie() {
        let mut host = FakeHost::new(vec![0.100, 0.102, 0.300], |_| 1.0);
        host.wild = vec![2];
        let r = rank(&[0, 1, 2], &mut host, &Retime::default());
        let by = |t: usize| r.paired.iter().find(|p| p.trial == t).unwrap();
        let [lo, hi] = by(2).cost_ratio_ci;
        assert!(
            lo > 1.25 && (hi - lo) / 2.0 / by(2).cost_ratio > 0.1,
            "{r:#?}"
        );
        assert_eq!((r.retries, r.rounds, r.noisy), (0, 9, false), "{r:#?}");
        assert!(
            r.widest_half_interval < 0.05 && r.tie_within == 0.05,
            "{r:#?}"
        );
        assert_eq!(tie_sets(&r).0, vec![0, 1]);
    }

    #[test]
    fn failing_bouts_leave_the_trial_out_and_never_stop_the_ranking() {
        let mut host = FakeHost::new(vec![0.100, 0.090, 0.120], |_| 1.0);
        host.fail = vec![1];
        let r = rank(&[1, 0, 2], &mut host, &Retime::default());
        assert_eq!(r.method, "paired");
        let order: Vec<usize> = r.paired.iter().map(|p| p.trial).collect();
        assert_eq!(order, vec![0, 2]);
        assert!(
            r.note
                .as_deref()
                .unwrap()
                .contains("#1 (9 of 9 bouts failed)"),
            "{r:?}"
        );
    }

    /// Load that drifts over minutes, as on a shared build host: between
    /// 1x and 2x, a two-minute period.
    fn drifting(t: f64) -> f64 {
        1.5 + 0.5 * (2.0 * std::f64::consts::PI * t / 120.0).sin()
    }

    /// Four configurations, whose unloaded steps take `STEP_S` seconds
    /// (#2 fastest, #3 2% slower, #1 4% slower, #0 30% slower) and whose
    /// peaks grow with the micro-batch (#0 leaves the most memory spare).
    const STEP_S: [f64; 4] = [0.130, 0.104, 0.100, 0.102];

    /// A sweep on `host`: each trial timed alone, one after another as the
    /// driver runs them (#0, #1, #3, #2), until the median's interval is
    /// tight or a second is spent, as `Timing::default` says.
    fn simulated_sweep(host: &mut FakeHost) -> SweepReport {
        use crate::engine::{Checkpointing, Optimizer};
        use crate::report::sweep::{Measured, Outcome};
        use crate::sweep::plots::tests::{peaks, point, trial};
        let mut report = SweepReport::empty_for_tests();
        for (mb, mib) in [(2, 10), (4, 14), (8, 22), (16, 40)] {
            let mut t = trial(
                point(mb, Checkpointing::None, Optimizer::Adamw),
                Outcome::Ran,
                true,
            );
            t.measured = Some(Measured::for_tests(peaks(mib), 1.0));
            report.trials.push(t);
        }
        let timing = crate::stats::Timing::default();
        for i in [0, 1, 3, 2] {
            let mut steps = Vec::new();
            while !timing.done(&steps) {
                steps.push(host.step(i));
            }
            let (step_s, lo, hi) = median_ci(&steps[timing.warmup_steps..]);
            let tps = |s: f64| 4096.0 / s;
            let usd = |s: f64| 2.5 / 3600.0 / tps(s) * 1e6;
            let m = report.trials[i].measured.as_mut().unwrap();
            m.step_ms = steps.iter().map(|s| s * 1e3).collect();
            m.step_s = step_s;
            m.step_s_ci = [lo, hi];
            m.tokens_per_s = tps(step_s);
            m.tokens_per_s_ci = [tps(hi), tps(lo)];
            m.usd_per_mtok = Some(usd(step_s));
        }
        report
    }

    /// What `sweep` does after its trials: the contenders re-timed on the
    /// same host, then the recommendation.
    fn paired_recommendation(report: &mut SweepReport, host: &mut FakeHost) {
        let policy = Retime::default();
        let costs: Vec<(usize, f64, f64)> = crate::sweep::driver::eligible(report)
            .into_iter()
            .filter_map(|i| {
                let (c, [lo, _]) = crate::sweep::driver::cost_of(&report.trials[i])?;
                Some((i, c, lo))
            })
            .collect();
        let ranking = rank(&contenders(&costs, &policy), host, &policy);
        crate::sweep::driver::recommend_with(report, Some(ranking));
    }

    fn pick(r: &SweepReport) -> (usize, Vec<usize>) {
        let rec = r.recommendation.as_ref().unwrap();
        (rec.trial, rec.tied.clone())
    }

    #[test]
    fn load_drifting_between_trials_misleads_single_timing_but_not_paired_timing() {
        let mut host = FakeHost::new(STEP_S.to_vec(), drifting);
        let measured = simulated_sweep(&mut host);
        // Each trial alone: #2 ran last, under 5% more load than #1, and
        // looks slower than it; the overlapping intervals settle on the
        // smaller micro-batch, #1, which is 4% slower than #2 in truth.
        let mut old = measured.clone();
        crate::sweep::driver::recommend(&mut old);
        assert_eq!(pick(&old).0, 1, "{:#?}", old.recommendation);
        // Paired: #2 is the fastest, and the pick; #1 and #3 are within
        // the 5% tie, #0 is not.
        let mut new = measured;
        paired_recommendation(&mut new, &mut host);
        let rec = new.recommendation.as_ref().unwrap();
        let rk = rec.ranking.as_ref().unwrap();
        assert_eq!(rk.method, "paired");
        assert_eq!(rk.paired[0].trial, 2, "{rk:#?}");
        assert_eq!(pick(&new).0, 2, "{:#?}", new.recommendation);
        let mut tied = rec.tied.clone();
        tied.sort();
        assert_eq!(tied, vec![1, 3], "{rk:#?}");
        assert!(
            rec.reasons
                .iter()
                .any(|r| r.contains("timed again, interleaved")),
            "{:#?}",
            rec.reasons
        );
    }

    #[test]
    fn three_sweeps_under_drifting_load_name_the_same_winner_or_each_others_in_their_tie() {
        let mut old = Vec::new();
        let mut new = Vec::new();
        for start in [0.0, 45.0, 80.0] {
            let mut host = FakeHost::new(STEP_S.to_vec(), drifting);
            host.t = start;
            let mut r = simulated_sweep(&mut host);
            let mut single = r.clone();
            crate::sweep::driver::recommend(&mut single);
            old.push(pick(&single));
            paired_recommendation(&mut r, &mut host);
            new.push(pick(&r));
        }
        let agree = |runs: &[(usize, Vec<usize>)]| {
            runs.iter()
                .all(|(wa, ta)| runs.iter().all(|(wb, _)| wa == wb || ta.contains(wb)))
        };
        eprintln!("single: {old:?}\npaired: {new:?}");
        assert!(agree(&new), "paired: {new:?}");
        // Each trial alone, the drift decides: the sweeps disagree.
        assert!(!agree(&old), "single: {old:?}");
    }

    #[test]
    fn a_noisy_ranking_ties_the_trials_that_never_became_finalists() {
        let mut host = FakeHost::new(STEP_S.to_vec(), drifting);
        let measured = simulated_sweep(&mut host);
        let pair = |trial, cost_ratio, ci| PairedTrial {
            trial,
            cost_ratio,
            cost_ratio_ci: ci,
            tokens_per_s: 30000.0,
            bouts: 9,
            failed_bouts: 0,
        };
        let noisy = Ranking {
            method: "paired".into(),
            contenders: vec![2, 3],
            rounds: 9,
            paired: vec![pair(2, 1.0, [1.0, 1.0]), pair(3, 1.02, [0.7, 1.4])],
            widest_half_interval: 0.35,
            tie_within: 0.7,
            noisy: true,
            ..unranked("paired", "", &Retime::default())
        };
        let mut r = measured.clone();
        crate::sweep::driver::recommend_with(&mut r, Some(noisy.clone()));
        let rec = r.recommendation.as_ref().unwrap();
        let mut tied = rec.tied.clone();
        tied.sort();
        // #0 and #1 were never finalists; their own figures are within 70%.
        assert_eq!((rec.trial, tied), (2, vec![0, 1, 3]), "{rec:#?}");
        assert!(
            rec.reasons
                .iter()
                .any(|s| s.contains("too noisy to separate"))
        );
        // A quiet host: the tie is the finalists'.
        let quiet = Ranking {
            noisy: false,
            widest_half_interval: 0.02,
            tie_within: 0.05,
            paired: vec![pair(2, 1.0, [1.0, 1.0]), pair(3, 1.02, [1.01, 1.03])],
            ..noisy.clone()
        };
        let mut r = measured.clone();
        crate::sweep::driver::recommend_with(&mut r, Some(quiet));
        let rec = r.recommendation.as_ref().unwrap();
        assert_eq!((rec.trial, rec.tied.clone()), (2, vec![3]), "{rec:#?}");
        assert!(!rec.reasons.iter().any(|s| s.contains("too noisy")));

        // #0 ran alone under a load that made it look 2.5x the cheapest:
        // outside a 70% tie, unless the finalists show the load drifting
        // 2x between trials (#2's bouts ran twice as fast as its trial).
        let mut r = measured;
        let best = crate::sweep::driver::cost_of(&r.trials[2]).unwrap().0;
        let m = r.trials[0].measured.as_mut().unwrap();
        let k = 2.5 * best / m.usd_per_mtok.unwrap();
        m.usd_per_mtok = Some(2.5 * best);
        m.tokens_per_s /= k;
        m.tokens_per_s_ci = [m.tokens_per_s * 0.99, m.tokens_per_s * 1.01];
        let own = |r: &SweepReport, i: usize| r.trials[i].measured.as_ref().unwrap().tokens_per_s;
        let steady = Ranking {
            paired: vec![
                PairedTrial {
                    tokens_per_s: own(&r, 2),
                    ..pair(2, 1.0, [1.0, 1.0])
                },
                PairedTrial {
                    tokens_per_s: own(&r, 3),
                    ..pair(3, 1.02, [0.7, 1.4])
                },
            ],
            ..noisy.clone()
        };
        let drifted = Ranking {
            paired: vec![
                PairedTrial {
                    tokens_per_s: 2.0 * own(&r, 2),
                    ..pair(2, 1.0, [1.0, 1.0])
                },
                steady.paired[1].clone(),
            ],
            ..steady.clone()
        };
        let mut a = r.clone();
        crate::sweep::driver::recommend_with(&mut a, Some(steady.clone()));
        let rec = a.recommendation.as_ref().unwrap();
        assert!(!rec.tied.contains(&0), "{rec:#?}");
        let drift = rec.ranking.as_ref().unwrap().drift.unwrap();
        assert!((drift - 1.0).abs() < 1e-9, "{drift}");
        crate::sweep::driver::recommend_with(&mut r, Some(drifted));
        let rec = r.recommendation.as_ref().unwrap();
        assert!(rec.tied.contains(&0), "{rec:#?}");
        let drift = rec.ranking.as_ref().unwrap().drift.unwrap();
        assert!((drift - 2.0).abs() < 1e-9, "{drift}");

        // The finalists' own figures agree with their bouts, but the load
        // swung 3x during the re-timing: a trial timed alone may have been
        // slowed that much, and #0 is tied again.
        let swung = Ranking {
            load_swing: Some(3.0),
            ..steady.clone()
        };
        let mut b = a.clone();
        crate::sweep::driver::recommend_with(&mut b, Some(swung));
        let rec = b.recommendation.as_ref().unwrap();
        assert!(rec.tied.contains(&0), "{rec:#?}");
        let drift = rec.ranking.as_ref().unwrap().drift.unwrap();
        assert!((drift - 3.0).abs() < 1e-9, "{drift}");
    }

    #[test]
    fn the_load_swing_is_the_widest_spread_of_one_finalists_bouts_bar_outliers() {
        let bout = |cost| {
            Some(Bout {
                cost,
                tokens_per_s: 1.0 / cost,
            })
        };
        let rows: Rows = vec![
            vec![bout(1.0), bout(2.0)],
            vec![bout(1.5), None],
            vec![bout(1.2), bout(5.0)],
        ];
        // Column 0 spans 1.0-1.5, column 1 spans 2.0-5.0.
        assert_eq!(load_swing(&rows), Some(2.5));
        assert_eq!(load_swing(&vec![vec![bout(1.0)]]), None);
        // Twelve bouts on a steady host, one slowed 1.85x by a stray
        // process: the swing is that of the other eleven.
        let mut steady: Rows = (0..12)
            .map(|r| vec![bout(1.0 + 0.01 * (r % 4) as f64)])
            .collect();
        steady[5][0] = bout(1.85);
        let swing = load_swing(&steady).unwrap();
        assert!((swing - 1.03).abs() < 1e-9, "{swing}");
        // Load on for a third of the bouts doubles their cost: it shows.
        let loaded: Rows = (0..12)
            .map(|r| vec![bout(if r % 3 == 0 { 2.0 } else { 1.0 })])
            .collect();
        assert_eq!(load_swing(&loaded), Some(2.0));
    }

    #[test]
    fn one_contender_or_no_rounds_is_a_single_ranking_that_says_why() {
        let mut host = FakeHost::new(vec![0.1, 0.2], |_| 1.0);
        let r = rank(&[0], &mut host, &Retime::default());
        assert_eq!(r.method, "single");
        assert!(r.note.unwrap().contains("nothing was re-timed"));
        let r = rank(&[0, 1], &mut host, &Retime::off());
        assert_eq!(r.method, "single");
        assert_eq!(host.bouts, 0);
    }
}
