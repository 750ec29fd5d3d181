//! Stopping cleanly, and taking children along.
//!
//! A sweep is stopped by whoever runs it: Ctrl-C at a terminal (SIGINT), a
//! scheduler's cancel or timeout (SIGTERM, as Slurm and Kubernetes send),
//! a closed terminal or ssh session (SIGHUP). All three are the same
//! request, "stop now, keep what was measured": [`on_stop`] turns each into
//! one flag, and [`caught`] says which one came, so that the process exits
//! with the shell's `128 + signal` (130, 143, 129). [`on_interrupt`] is
//! Ctrl-C alone, for commands that leave SIGTERM and SIGHUP their default.
//!
//! A parent killed outright (SIGKILL, the OOM killer) runs no handler at
//! all; [`die_with_parent`] makes the kernel kill its children then.

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};

/// The signals [`on_stop`] handles, in the order a user meets them.
pub const STOP_SIGNALS: [i32; 3] = [SIGINT, SIGTERM, SIGHUP];

/// The first stop signal received (0: none).
static CAUGHT: AtomicI32 = AtomicI32::new(0);
/// The flags [`on_stop`] was given; the signal thread sets them all.
static FLAGS: Mutex<Vec<Arc<AtomicBool>>> = Mutex::new(Vec::new());
/// Whether the handlers are installed (set by the first [`on_stop`]).
static INSTALLED: OnceLock<bool> = OnceLock::new();

/// Sets `flag` when SIGINT, SIGTERM or SIGHUP arrives, for the rest of the
/// process's life. signal-hook's handler only records the signal and wakes
/// a thread, which sets the flags; the caller polls its flag. Installed
/// once per process: a second call (a second sweep in one process) sets
/// its flag too. `false` when the handlers could not be installed (the
/// signals then keep their default action, which ends the process).
pub fn on_stop(flag: Arc<AtomicBool>) -> bool {
    FLAGS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(flag);
    *INSTALLED.get_or_init(install_stop_handlers)
}

/// Starts the thread that waits for the stop signals; it installs the
/// handlers itself, so that a thread that cannot start leaves the signals
/// their default action rather than handled by no one.
fn install_stop_handlers() -> bool {
    let (installed, result) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("memfit-signals".into())
        .spawn(move || {
            let mut signals = match signal_hook::iterator::Signals::new(STOP_SIGNALS) {
                Ok(s) => s,
                Err(_) => {
                    let _ = installed.send(false);
                    return;
                }
            };
            let _ = installed.send(true);
            for sig in signals.forever() {
                let _ = CAUGHT.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
                for f in FLAGS.lock().unwrap_or_else(PoisonError::into_inner).iter() {
                    f.store(true, Ordering::SeqCst);
                }
            }
        });
    spawned.is_ok() && result.recv().unwrap_or(false)
}

/// Sets `flag` on every SIGINT (Ctrl-C), for the rest of the process's
/// life; SIGTERM and SIGHUP keep their default action. `false` when the
/// handler could not be installed.
pub fn on_interrupt(flag: Arc<AtomicBool>) -> bool {
    signal_hook::flag::register(SIGINT, flag).is_ok()
}

/// The stop signal this process received, if any.
pub fn caught() -> Option<i32> {
    match CAUGHT.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// The exit code of a process stopped by `sig`, as a shell reports one
/// killed by it: 128 + the signal (SIGINT 130, SIGTERM 143, SIGHUP 129).
pub fn exit_code(sig: i32) -> i32 {
    128 + sig
}

/// The exit code of a run that was stopped: the signal received, SIGINT's
/// when the stop came from elsewhere (the TUI's stop key).
pub fn stopped_exit_code() -> i32 {
    exit_code(caught().unwrap_or(SIGINT))
}

/// The child dies with this process: the kernel sends it SIGKILL when the
/// parent (the thread that spawned it) ends, however it ends, SIGKILL
/// included, which no handler sees. A parent that died between the fork
/// and the request would never send it, so the child checks its parent
/// first and refuses to start (ESRCH) if it is already someone else's.
#[cfg(target_os = "linux")]
pub fn die_with_parent(c: &mut Command) {
    use rustix::io::Errno;
    use rustix::process::{Signal, set_parent_process_death_signal};
    use std::os::unix::process::CommandExt as _;
    let parent = std::process::id();
    // SAFETY: the closure runs between fork and exec, where only
    // async-signal-safe calls are allowed: it makes two system calls
    // (prctl and getppid, rustix's and std's thin wrappers) and allocates
    // nothing (an `io::Error` from an OS code holds no box).
    unsafe {
        c.pre_exec(move || {
            set_parent_process_death_signal(Some(Signal::KILL))?;
            if std::os::unix::process::parent_id() != parent {
                return Err(Errno::SRCH.into());
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
pub fn die_with_parent(_: &mut Command) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_are_the_shells() {
        assert_eq!(STOP_SIGNALS.map(exit_code), [130, 143, 129]);
    }

    #[test]
    fn a_child_that_dies_with_its_parent_still_runs() {
        let mut c = Command::new("true");
        die_with_parent(&mut c);
        assert!(c.status().expect("true runs").success());
    }
}
