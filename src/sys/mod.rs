//! The host as the operating system shows it: /proc, signals, pids and
//! file descriptors. Every OS call memfit makes beyond std is here, made
//! through `rustix` and `signal-hook`, so no module declares libc by hand.
//! (The NVIDIA libraries memfit loads, in `backend::cuda`, `telemetry` and
//! `doctor`, are dynamic-library bindings, not OS calls, and stay there.)
//!
//! - [`proc`]: processes through /proc (state, parent, descendants,
//!   resident memory, name) and sending them signals.
//! - [`signals`]: stopping cleanly on SIGINT, SIGTERM and SIGHUP, and
//!   children that die with their parent.
//! - [`fs`]: the descriptor-level file operations (a FIFO opened only
//!   when someone reads it).

pub mod fs;
pub mod proc;
pub mod signals;

pub use rustix::process::Signal;

/// `MemAvailable` from /proc/meminfo, where there is one.
pub fn mem_available() -> Option<u64> {
    proc::field_bytes("/proc/meminfo", "MemAvailable")
}

/// This host's name (/proc/sys/kernel/hostname), where it has one.
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// The CPU's model name (the first `model name` in /proc/cpuinfo).
pub fn cpu_model() -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

/// The real user id of this process.
pub fn uid() -> u32 {
    rustix::process::getuid().as_raw()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_facts() {
        assert!(mem_available().is_some_and(|b| b > 0));
        assert!(hostname().is_none_or(|h| !h.is_empty() && h == h.trim()));
    }
}
