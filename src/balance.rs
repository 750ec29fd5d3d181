//! Contiguous partitioning of layers into pipeline stages (the core of the
//! future `memfit balance`, issue 8).
//!
//! Each layer has a static cost (weights, gradients, optimizer state: what a
//! stage holds however many micro-batches are in flight) and a per-micro-batch
//! cost (the activations it keeps). Stage `s` of `S` holds `in_flight(s)`
//! micro-batches at once: all `K` under GPipe, `min(S - s, K)` under 1F1B
//! (Narayanan et al., PipeDream-Flush / Megatron's 1F1B schedule). A stage's
//! peak is `static + in_flight x per_micro_batch`. [`optimal`] minimises the
//! largest stage peak exactly, by dynamic programming over (stage, prefix) in
//! O(S n^2); the brute force in the tests checks it on small instances.

/// The pipeline schedule, which decides how many micro-batches a stage keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// All K forwards, then all K backwards.
    Gpipe,
    /// Warm-up, one forward one backward, cool-down.
    OneFOneB,
}

impl Schedule {
    /// Micro-batches stage `s` (0-based) of `stages` holds at its peak, with `k` in all.
    pub fn in_flight(self, s: usize, stages: usize, k: usize) -> usize {
        match self {
            Schedule::Gpipe => k,
            Schedule::OneFOneB => (stages - s).min(k),
        }
    }
}

/// One layer's costs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layer {
    pub static_bytes: u64,
    pub per_micro_batch_bytes: u64,
}

/// Stage boundaries: stage `i` holds layers `bounds[i]..bounds[i + 1]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    pub bounds: Vec<usize>,
    /// Each stage's peak.
    pub peaks: Vec<u64>,
}

impl Partition {
    pub fn max_peak(&self) -> u64 {
        self.peaks.iter().copied().max().unwrap_or(0)
    }

    /// Layers per stage, as fairscale's `balance=[...]` takes them.
    pub fn balance(&self) -> Vec<usize> {
        self.bounds.windows(2).map(|w| w[1] - w[0]).collect()
    }
}

/// The peak of stage `s` holding `layers`.
pub fn stage_peak(layers: &[Layer], s: usize, stages: usize, k: usize, sched: Schedule) -> u64 {
    let (st, act) = layers.iter().fold((0u64, 0u64), |(a, b), l| {
        (a + l.static_bytes, b + l.per_micro_batch_bytes)
    });
    st + sched.in_flight(s, stages, k) as u64 * act
}

fn evaluate(layers: &[Layer], bounds: Vec<usize>, k: usize, sched: Schedule) -> Partition {
    let stages = bounds.len() - 1;
    let peaks = (0..stages)
        .map(|s| stage_peak(&layers[bounds[s]..bounds[s + 1]], s, stages, k, sched))
        .collect();
    Partition { bounds, peaks }
}

/// The partition into `stages` non-empty contiguous stages with the smallest
/// largest-stage peak (ties: the first found scanning earlier cuts first).
/// `None` when there are fewer layers than stages.
pub fn optimal(layers: &[Layer], stages: usize, k: usize, sched: Schedule) -> Option<Partition> {
    let n = layers.len();
    if stages == 0 || n < stages {
        return None;
    }
    // Prefix sums make a stage's cost O(1).
    let mut st = vec![0u64; n + 1];
    let mut act = vec![0u64; n + 1];
    for (i, l) in layers.iter().enumerate() {
        st[i + 1] = st[i] + l.static_bytes;
        act[i + 1] = act[i] + l.per_micro_batch_bytes;
    }
    let cost = |s: usize, i: usize, j: usize| {
        (st[j] - st[i]) + sched.in_flight(s, stages, k) as u64 * (act[j] - act[i])
    };
    // best[s][j]: the smallest largest peak putting layers 0..j in stages 0..=s.
    let inf = u64::MAX;
    let mut best = vec![vec![inf; n + 1]; stages];
    let mut cut = vec![vec![0usize; n + 1]; stages];
    for (j, b) in best[0].iter_mut().enumerate().skip(1) {
        *b = cost(0, 0, j);
    }
    for s in 1..stages {
        for j in s + 1..=n {
            for i in s..j {
                if best[s - 1][i] == inf {
                    continue;
                }
                let v = best[s - 1][i].max(cost(s, i, j));
                if v < best[s][j] {
                    best[s][j] = v;
                    cut[s][j] = i;
                }
            }
        }
    }
    let mut bounds = vec![n];
    let mut j = n;
    for s in (1..stages).rev() {
        j = cut[s][j];
        bounds.push(j);
    }
    bounds.push(0);
    bounds.reverse();
    Some(evaluate(layers, bounds, k, sched))
}

/// Equal layer counts per stage (the first stages take the remainder).
pub fn uniform(layers: &[Layer], stages: usize, k: usize, sched: Schedule) -> Option<Partition> {
    let n = layers.len();
    if stages == 0 || n < stages {
        return None;
    }
    let mut bounds = vec![0];
    for s in 0..stages {
        let size = n / stages + usize::from(s < n % stages);
        bounds.push(bounds[s] + size);
    }
    Some(evaluate(layers, bounds, k, sched))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every way to cut `n` layers into `stages` non-empty runs.
    fn brute(layers: &[Layer], stages: usize, k: usize, sched: Schedule) -> u64 {
        fn rec(
            layers: &[Layer],
            start: usize,
            s: usize,
            stages: usize,
            k: usize,
            sched: Schedule,
        ) -> u64 {
            let n = layers.len();
            if s == stages - 1 {
                return stage_peak(&layers[start..], s, stages, k, sched);
            }
            (start + 1..=n - (stages - 1 - s))
                .map(|end| {
                    stage_peak(&layers[start..end], s, stages, k, sched).max(rec(
                        layers,
                        end,
                        s + 1,
                        stages,
                        k,
                        sched,
                    ))
                })
                .min()
                .unwrap()
        }
        rec(layers, 0, 0, stages, k, sched)
    }

    #[test]
    fn optimal_agrees_with_brute_force_on_random_instances() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for _ in 0..300 {
            let n = 1 + next(9) as usize;
            let stages = 1 + next(n as u64) as usize;
            let k = 1 + next(8) as usize;
            let sched = if next(2) == 0 {
                Schedule::Gpipe
            } else {
                Schedule::OneFOneB
            };
            let layers: Vec<Layer> = (0..n)
                .map(|_| Layer {
                    static_bytes: next(1000),
                    per_micro_batch_bytes: next(300),
                })
                .collect();
            let p = optimal(&layers, stages, k, sched).unwrap();
            assert_eq!(
                p.max_peak(),
                brute(&layers, stages, k, sched),
                "{layers:?} S={stages} K={k} {sched:?}"
            );
            assert_eq!(p.bounds.len(), stages + 1);
            assert!(p.balance().iter().all(|&c| c > 0));
            assert_eq!(p.balance().iter().sum::<usize>(), n);
            let u = uniform(&layers, stages, k, sched).unwrap();
            assert!(p.max_peak() <= u.max_peak());
        }
        assert!(
            optimal(
                &[Layer {
                    static_bytes: 1,
                    per_micro_batch_bytes: 1
                }],
                2,
                1,
                Schedule::Gpipe
            )
            .is_none()
        );
    }

    #[test]
    fn a_heavy_embedding_moves_the_cuts() {
        // Embedding-sized first layer, eight equal blocks, a heavy head.
        let mut layers = vec![Layer {
            static_bytes: 800,
            per_micro_batch_bytes: 10,
        }];
        layers.extend((0..8).map(|_| Layer {
            static_bytes: 100,
            per_micro_batch_bytes: 10,
        }));
        layers.push(Layer {
            static_bytes: 800,
            per_micro_batch_bytes: 40,
        });
        let (opt, uni) = (
            optimal(&layers, 4, 8, Schedule::OneFOneB).unwrap(),
            uniform(&layers, 4, 8, Schedule::OneFOneB).unwrap(),
        );
        assert!(opt.max_peak() < uni.max_peak(), "{opt:?} vs {uni:?}");
        assert_eq!(
            opt.balance().first(),
            Some(&1),
            "the embedding stands alone: {opt:?}"
        );
        // 1F1B keeps fewer micro-batches on stage 0 than GPipe when K > S.
        assert!(Schedule::OneFOneB.in_flight(0, 4, 8) < Schedule::Gpipe.in_flight(0, 4, 8));
    }
}
