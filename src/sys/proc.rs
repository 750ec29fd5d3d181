//! Processes as /proc shows them: whether a pid is alive, its parent and
//! descendants (torchrun and DeepSpeed start their workers as children),
//! resident memory (`VmRSS`, `VmHWM`), name; and signals sent to them.

use std::collections::HashMap;

use super::Signal;

/// The fields of `/proc/PID/stat` memfit reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// `R`, `S`, `D`, `Z` (zombie), `X` (dead), ...
    pub state: char,
    pub ppid: u32,
}

impl Stat {
    /// Dead: a zombie (not yet reaped by its parent) or on its way out.
    pub fn is_dead(&self) -> bool {
        matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// `/proc/PID/stat`'s state and parent, `None` once the process is gone.
pub fn stat(pid: u32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&text)
}

/// The command name is in parentheses and may hold spaces and parentheses
/// itself, so the fields are read after the last `)`.
fn parse_stat(text: &str) -> Option<Stat> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some(Stat { state, ppid })
}

/// Whether `pid` is a live process (a zombie, dead but not yet reaped by
/// its parent, is not).
pub fn alive(pid: u32) -> bool {
    stat(pid).is_some_and(|s| !s.is_dead())
}

/// Whether a process with this pid exists on this host, zombies included
/// (its /proc directory is there).
pub fn exists(pid: u32) -> bool {
    pid != 0 && std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// `root` and every live process descended from it, root first.
pub fn tree(root: u32) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if let Some(s) = stat(pid)
                && !s.is_dead()
            {
                children.entry(s.ppid).or_default().push(pid);
            }
        }
    }
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        if let Some(c) = children.get(&out[i]) {
            for &p in c {
                if !out.contains(&p) {
                    out.push(p);
                }
            }
        }
        i += 1;
    }
    out
}

/// Resident host memory of `pid` (`VmRSS`), `None` once it is gone.
pub fn rss(pid: u32) -> Option<u64> {
    field_bytes(&format!("/proc/{pid}/status"), "VmRSS")
}

/// This process's resident host memory (`VmRSS`).
pub fn self_rss() -> Option<u64> {
    field_bytes("/proc/self/status", "VmRSS")
}

/// This process's resident-set high-water mark (`VmHWM`).
pub fn self_rss_peak() -> Option<u64> {
    field_bytes("/proc/self/status", "VmHWM")
}

/// The process name (`/proc/PID/comm`, without its newline).
pub fn comm(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}

/// Sends `sig` to `pid`; false when it could not (gone, not ours). Only a
/// positive pid is sent to: one process, never a group.
pub fn signal(pid: u32, sig: Signal) -> bool {
    let Some(pid) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
        return false;
    };
    rustix::process::kill_process(pid, sig).is_ok()
}

/// A `Key:   N kB` field of a /proc file (`/proc/meminfo`,
/// `/proc/PID/status`) in bytes; `None` where there is no such file or field.
pub(super) fn field_bytes(path: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text
        .lines()
        .find(|l| l.strip_prefix(key).is_some_and(|r| r.starts_with(':')))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_after_the_name() {
        assert_eq!(
            parse_stat("42 (python (w) 1) S 7 42 42 0 -1"),
            Some(Stat {
                state: 'S',
                ppid: 7
            })
        );
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn this_process_is_alive_and_in_its_own_tree() {
        let me = std::process::id();
        assert!(alive(me));
        assert!(exists(me));
        assert_eq!(tree(me)[0], me);
        assert!(rss(me).is_some_and(|b| b > 0));
        assert!(self_rss().is_some_and(|b| b > 0));
        assert!(self_rss_peak().is_some_and(|b| b > 0));
        assert!(!alive(u32::MAX - 1));
        assert!(!exists(0));
    }

    #[test]
    fn signals_reach_only_single_processes() {
        // pid 0 and pids past i32::MAX would name groups or nothing.
        assert!(!signal(0, Signal::TERM));
        assert!(!signal(u32::MAX, Signal::TERM));
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep runs");
        assert!(signal(child.id(), Signal::KILL));
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(9));
    }
}
