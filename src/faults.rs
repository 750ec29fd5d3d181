//! Test hooks, compiled only with the cargo feature `test-hooks`, which the
//! test build turns on (Cargo.toml's dev-dependency on this package) and a
//! shipped binary never has: ways to make a sweep's trial (`memfit sweep
//! --test-fault N:KIND`) or a launched rank ([`RANK_FAULT_ENV`]) fail as
//! real ones do, so the tests can check that nothing already measured is
//! lost and that a lost rank is reported.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How a process fails on purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// `std::process::abort()` (SIGABRT), as a failed assertion in native code would.
    Abort,
    /// The process SIGKILLs itself, as the kernel's OOM killer would.
    Sigkill,
    /// Exits 1 without a word.
    Exit,
    /// Sleeps forever, to be killed by a timeout or a watchdog.
    Hang,
}

impl Fault {
    /// `abort`, `sigkill`, `exit` or `hang`.
    pub fn parse(s: &str) -> Result<Fault, String> {
        match s.trim() {
            "abort" => Ok(Fault::Abort),
            "sigkill" => Ok(Fault::Sigkill),
            "exit" => Ok(Fault::Exit),
            "hang" => Ok(Fault::Hang),
            other => Err(format!("unknown fault `{other}`")),
        }
    }

    /// Fails this process.
    pub fn strike(self) -> ! {
        match self {
            Fault::Abort => std::process::abort(),
            Fault::Sigkill => {
                let _ = std::process::Command::new("kill")
                    .args(["-9", &std::process::id().to_string()])
                    .status();
            }
            Fault::Exit => std::process::exit(1),
            Fault::Hang => {}
        }
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
}

/// `RANK:KIND` makes that rank of `memfit launch` (or of a multi-process
/// `memfit run`) fail right after joining its group.
pub const RANK_FAULT_ENV: &str = "MEMFIT_TEST_RANK_FAULT";

/// Applies [`RANK_FAULT_ENV`] to `rank`, if it names it.
pub fn rank_fault(rank: usize) {
    let Ok(v) = std::env::var(RANK_FAULT_ENV) else {
        return;
    };
    let Some((r, kind)) = v.split_once(':') else {
        return;
    };
    if r.trim().parse::<usize>() == Ok(rank)
        && let Ok(f) = Fault::parse(kind)
    {
        f.strike();
    }
}

/// `memfit sweep --test-fault`: `N:abort`, `N:sigkill` or `N:hang`, the
/// N-th trial in run order.
pub fn parse_trial_fault(s: &str) -> Result<(usize, Fault), String> {
    let (n, kind) = s.split_once(':').ok_or("expected N:abort|sigkill|hang")?;
    let n = n.parse().map_err(|e| format!("{e}"))?;
    Ok((n, Fault::parse(kind)?))
}
