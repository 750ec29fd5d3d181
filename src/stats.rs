//! Step-time statistics: the median and its confidence interval, and when
//! to stop repeating a timed step (hyperfine's way: repeat until the
//! interval is tight or the time budget is spent).
//!
//! The interval is distribution-free: for n sorted samples, the median lies
//! between the j-th and the (n+1-j)-th with probability
//! `P(j <= B <= n-j)`, B ~ Binomial(n, 1/2) (the sign-test interval; e.g.
//! Conover, Practical Nonparametric Statistics, 3rd ed., section 3.2). Step
//! times are skewed by a busy machine (a stall makes one step slow, nothing
//! makes one fast), which is why the median and not the mean is reported.

use serde::{Deserialize, Serialize};

/// The median of `xs` (the mean of the middle two for an even count).
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The geometric mean of `xs` (positive numbers): the centre that a
/// common factor (a host's load) scales every value's ratio to alike.
pub fn geometric_mean(xs: impl IntoIterator<Item = f64>) -> f64 {
    let (sum, n) = xs
        .into_iter()
        .fold((0.0, 0usize), |(s, n), x| (s + x.ln(), n + 1));
    if n == 0 {
        f64::NAN
    } else {
        (sum / n as f64).exp()
    }
}

/// The 1-based rank j of the lower end of the median's ~95% interval over n
/// samples: the largest j with `P(B <= j - 1) <= 0.025`, at least 1 (below
/// six samples the whole range is the interval, covering 1 - 2^(1-n)).
fn lower_rank(n: usize) -> usize {
    let mut pmf = 0.5f64.powi(n as i32);
    let mut cdf = 0.0;
    let mut j = 1;
    for i in 0..n {
        cdf += pmf;
        if cdf > 0.025 {
            break;
        }
        j = i + 1;
        pmf *= (n - i) as f64 / (i + 1) as f64;
    }
    j.min(n.div_ceil(2)).max(1)
}

/// The median and its ~95% confidence interval `[lo, hi]`.
pub fn median_ci(xs: &[f64]) -> (f64, f64, f64) {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let j = lower_rank(n);
    (median(&v), v[j - 1], v[n - j])
}

/// When a trial stops timing steps.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// Untimed steps first (allocation, caches, the thread pool).
    pub warmup_steps: usize,
    /// Timed steps at least, and at most.
    pub min_steps: usize,
    pub max_steps: usize,
    /// Stop once `(hi - lo) / median` of the timed steps is at most this.
    pub target_rel_ci: f64,
    /// Stop once the timed steps took this many seconds in all.
    pub budget_s: f64,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            warmup_steps: 1,
            min_steps: 5,
            max_steps: 40,
            target_rel_ci: 0.05,
            budget_s: 1.0,
        }
    }
}

impl Timing {
    /// Whether the steps timed so far (seconds each, warm-up included) are enough.
    pub fn done(&self, steps_s: &[f64]) -> bool {
        let timed = steps_s.get(self.warmup_steps..).unwrap_or(&[]);
        if timed.len() >= self.max_steps {
            return true;
        }
        if timed.len() < self.min_steps {
            return false;
        }
        if timed.iter().sum::<f64>() >= self.budget_s {
            return true;
        }
        let (m, lo, hi) = median_ci(timed);
        (hi - lo) / m <= self.target_rel_ci
    }

    /// Every step a trial may run, warm-up included.
    pub fn step_cap(&self) -> usize {
        self.warmup_steps + self.max_steps
    }

    /// A one-line error naming the flag, or `None` when the policy is usable.
    pub fn invalid(&self) -> Option<(&'static str, String)> {
        if self.min_steps == 0 {
            return Some(("--steps", "must be at least 1 timed step".into()));
        }
        if self.max_steps < self.min_steps {
            return Some((
                "--max-steps",
                format!("must be at least --steps ({})", self.min_steps),
            ));
        }
        if !(self.target_rel_ci.is_finite() && self.target_rel_ci > 0.0) {
            return Some((
                "--target-ci",
                "must be a positive fraction, e.g. 0.05".into(),
            ));
        }
        if !(self.budget_s.is_finite() && self.budget_s > 0.0) {
            return Some((
                "--time-budget",
                "must be a positive number of seconds".into(),
            ));
        }
        None
    }
}

/// Whether two intervals `[lo, hi]` overlap.
pub fn overlaps(a: [f64; 2], b: [f64; 2]) -> bool {
    a[0] <= b[1] && b[0] <= a[1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lower_ranks_match_the_sign_test_tables() {
        // Conover's table of the sign test / binomial(n, 1/2): n=6 -> j=1
        // (96.9%), n=9 -> j=2 (96.1%), n=17 -> j=5 (95.1%), n=20 -> j=6 (95.9%).
        assert_eq!(lower_rank(3), 1);
        assert_eq!(lower_rank(6), 1);
        assert_eq!(lower_rank(8), 1);
        assert_eq!(lower_rank(9), 2);
        assert_eq!(lower_rank(17), 5);
        assert_eq!(lower_rank(20), 6);
        assert_eq!(lower_rank(1), 1);
    }

    #[test]
    fn median_and_interval() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        let xs: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(median_ci(&xs), (10.5, 6.0, 15.0));
    }

    #[test]
    fn stops_on_a_tight_interval_the_budget_or_the_cap() {
        let t = Timing {
            warmup_steps: 1,
            min_steps: 5,
            max_steps: 8,
            target_rel_ci: 0.05,
            budget_s: 100.0,
        };
        assert!(!t.done(&[9.0, 1.0, 1.0, 1.0, 1.0]));
        assert!(t.done(&[9.0, 1.0, 1.0, 1.0, 1.0, 1.01]));
        // Noisy: goes on until the cap.
        let noisy = [9.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0];
        assert!(!t.done(&noisy));
        assert!(t.done(&[&noisy[..], &[2.0]].concat()));
        // The budget.
        let slow = Timing { budget_s: 5.0, ..t };
        assert!(slow.done(&[9.0, 1.0, 2.0, 1.0, 2.0, 1.0]));
    }

    #[test]
    fn geometric_mean_of_ratios() {
        assert!((geometric_mean([1.0, 4.0]) - 2.0).abs() < 1e-12);
        assert!((geometric_mean([3.0]) - 3.0).abs() < 1e-12);
        assert!(geometric_mean([]).is_nan());
    }

    #[test]
    fn overlap() {
        assert!(overlaps([1.0, 2.0], [2.0, 3.0]));
        assert!(!overlaps([1.0, 2.0], [2.5, 3.0]));
    }
}
