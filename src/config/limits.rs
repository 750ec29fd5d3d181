//! Bounds on what a user may ask for that the command line and the
//! library check alike (a sweep driven from a recipe or the TUI, as well as
//! a flag): kept here, below both, so the library never reaches up into
//! `cli` for them.

/// The most cpu threads memfit starts: more than the largest hosts have (a
/// pool of 100,000 took minutes to start, and then did nothing faster).
pub const MAX_THREADS: usize = 4096;

/// The longest a trial may be given, in seconds (11.6 days).
pub const MAX_TRIAL_SECONDS: f64 = 1e6;

/// `--threads` of `memfit run`, `calibrate` and a sweep's trials: 1..=[`MAX_THREADS`].
pub fn check_threads(n: usize) -> Result<usize, String> {
    match n {
        0 => Err("must be at least 1".into()),
        n if n > MAX_THREADS => Err(format!("must be at most {MAX_THREADS}")),
        n => Ok(n),
    }
}

/// `--trial-timeout`: positive seconds, at most [`MAX_TRIAL_SECONDS`].
pub fn check_seconds(s: f64) -> Result<f64, String> {
    if s.is_finite() && s > 0.0 && s <= MAX_TRIAL_SECONDS {
        Ok(s)
    } else {
        Err(format!(
            "must be a positive number of seconds, at most {MAX_TRIAL_SECONDS:.0}"
        ))
    }
}
