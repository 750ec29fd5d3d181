//! Stopping cleanly, and taking children along.
//!
//! A sweep is stopped by whoever runs it: Ctrl-C at a terminal (SIGINT), a
//! scheduler's cancel or timeout (SIGTERM, as Slurm and Kubernetes send),
//! a closed terminal or ssh session (SIGHUP). All three are the same
//! request, "stop now, keep what was measured": [`on_stop`] turns each into
//! one flag, and [`caught`] says which one came, so that the process exits
//! with the shell's `128 + signal` (130, 143, 129).
//!
//! A parent killed outright (SIGKILL, the OOM killer) runs no handler at
//! all; [`die_with_parent`] makes the kernel kill its children then.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

pub const SIGHUP: i32 = 1;
pub const SIGINT: i32 = 2;
pub const SIGKILL: i32 = 9;
pub const SIGTERM: i32 = 15;

/// The signals [`on_stop`] handles, in the order a user meets them.
pub const STOP_SIGNALS: [i32; 3] = [SIGINT, SIGTERM, SIGHUP];

/// The first stop signal received (0: none).
static CAUGHT: AtomicI32 = AtomicI32::new(0);
/// The write end of the self-pipe the handler writes to (-1: not set up).
static PIPE_WRITE: AtomicI32 = AtomicI32::new(-1);

unsafe extern "C" {
    // libc, which std links on every unix.
    fn signal(sig: i32, handler: usize) -> usize;
    fn pipe(fds: *mut i32) -> i32;
    fn write(fd: i32, buf: *const u8, n: usize) -> isize;
    fn read(fd: i32, buf: *mut u8, n: usize) -> isize;
}

extern "C" fn on_signal(sig: i32) {
    // Async-signal-safe only: an atomic and write(2).
    let _ = CAUGHT.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
    let fd = PIPE_WRITE.load(Ordering::SeqCst);
    if fd >= 0 {
        let byte = sig as u8;
        // SAFETY: one byte from the stack to a pipe this module opened.
        unsafe { write(fd, &byte, 1) };
    }
}

/// Sets `flag` when SIGINT, SIGTERM or SIGHUP arrives, for the rest of the
/// process's life. The handler only records the signal and wakes a thread,
/// which sets the flag; the caller polls it. Installed once per process: a
/// second call (a second sweep in one process) sets its flag too. `false`
/// when the handlers could not be installed (the signals then keep their
/// default action, which ends the process).
pub fn on_stop(flag: Arc<AtomicBool>) -> bool {
    static FLAGS: std::sync::Mutex<Vec<Arc<AtomicBool>>> = std::sync::Mutex::new(Vec::new());
    let first = {
        let mut flags = FLAGS.lock().unwrap_or_else(|e| e.into_inner());
        flags.push(flag);
        flags.len() == 1
    };
    if !first {
        return PIPE_WRITE.load(Ordering::SeqCst) >= 0;
    }
    let mut fds = [-1i32; 2];
    // SAFETY: pipe(2) writes two descriptors into the array it is given.
    if unsafe { pipe(fds.as_mut_ptr()) } != 0 {
        return false;
    }
    let [read_end, write_end] = fds;
    PIPE_WRITE.store(write_end, Ordering::SeqCst);
    let spawned = std::thread::Builder::new()
        .name("memfit-signals".into())
        .spawn(move || {
            let mut byte = 0u8;
            loop {
                // SAFETY: one byte into a local, from our own pipe.
                let n = unsafe { read(read_end, &mut byte, 1) };
                if n == 1 {
                    for f in FLAGS.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                        f.store(true, Ordering::SeqCst);
                    }
                } else if n == 0 {
                    return;
                }
                // n < 0: EINTR; read again.
            }
        });
    if spawned.is_err() {
        return false;
    }
    let handler = on_signal as extern "C" fn(i32) as usize;
    for sig in STOP_SIGNALS {
        // SAFETY: glibc's signal(2) installs a persistent, restarting
        // handler; ours is async-signal-safe.
        unsafe { signal(sig, handler) };
    }
    true
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
    use std::os::unix::process::CommandExt as _;
    unsafe extern "C" {
        fn prctl(option: std::ffi::c_int, ...) -> std::ffi::c_int;
    }
    const PR_SET_PDEATHSIG: std::ffi::c_int = 1;
    const ESRCH: i32 = 3;
    let parent = std::process::id();
    // SAFETY: the closure runs between fork and exec, where only
    // async-signal-safe calls are allowed: it makes two system calls and
    // allocates nothing (an `io::Error` from an OS code holds no box).
    unsafe {
        c.pre_exec(move || {
            if prctl(PR_SET_PDEATHSIG, SIGKILL as std::ffi::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if std::os::unix::process::parent_id() != parent {
                return Err(std::io::Error::from_raw_os_error(ESRCH));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
pub fn die_with_parent(_: &mut Command) {}
