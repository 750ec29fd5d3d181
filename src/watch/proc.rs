//! The watched job as the host sees it, through /proc: whether a pid is
//! alive, its descendants (torchrun and DeepSpeed start their workers as
//! children), their resident memory, and signals.

use std::collections::HashMap;

/// Whether `pid` is a live process (a zombie, dead but not yet reaped by
/// its parent, is not).
pub fn alive(pid: u32) -> bool {
    match stat(pid) {
        Some((state, _)) => !matches!(state, 'Z' | 'X' | 'x'),
        None => false,
    }
}

/// `(state, ppid)` from `/proc/PID/stat`. The command name is in
/// parentheses and may hold spaces and parentheses itself, so the fields
/// are read after the last `)`.
fn stat(pid: u32) -> Option<(char, u32)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&text)
}

fn parse_stat(text: &str) -> Option<(char, u32)> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    Some((state, ppid))
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
            if let Some((state, ppid)) = stat(pid)
                && !matches!(state, 'Z' | 'X' | 'x')
            {
                children.entry(ppid).or_default().push(pid);
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
    crate::units::proc_bytes(&format!("/proc/{pid}/status"), "VmRSS")
}

/// The process name (`/proc/PID/comm`).
pub fn name(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}

pub const SIGKILL: i32 = 9;
pub const SIGTERM: i32 = 15;

unsafe extern "C" {
    // libc's kill(2); std links libc on every unix.
    fn kill(pid: i32, sig: i32) -> i32;
}

/// Sends `sig` to `pid`; false when it could not (gone, not ours).
pub fn signal(pid: u32, sig: i32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill(2) takes two integers and touches no memory of ours; a
    // positive pid names one process, never a group.
    unsafe { kill(pid, sig) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_after_the_name() {
        assert_eq!(
            parse_stat("42 (python (w) 1) S 7 42 42 0 -1"),
            Some(('S', 7))
        );
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn this_process_is_alive_and_in_its_own_tree() {
        let me = std::process::id();
        assert!(alive(me));
        assert_eq!(tree(me)[0], me);
        assert!(rss(me).is_some_and(|b| b > 0));
        assert!(!alive(u32::MAX - 1));
    }
}
