//! How much host memory the process may still take: the smaller of the kernel's estimate of available memory
//! (`MemAvailable` in `/proc/meminfo`) and the room left under the process's cgroup v2 limit (`memory.max` less
//! `memory.current`), which `host_budget = "auto"` starts from. Parsing is separate from reading so it is tested on
//! fixed texts.

use std::path::Path;

/// Bytes the process may still take, or `None` where neither source can be read (not Linux).
pub fn host_available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| mem_available(&t));
    let cgroup = cgroup_room(Path::new("/sys/fs/cgroup"), &std::fs::read_to_string("/proc/self/cgroup").ok()?);
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
pub fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The room under the cgroup v2 limit of the process whose `/proc/self/cgroup` text is `self_cgroup`, reading
/// `memory.max` and `memory.current` under `root`; `None` without a limit (`max`) or a cgroup v2 entry.
fn cgroup_room(root: &Path, self_cgroup: &str) -> Option<u64> {
    let rel = self_cgroup.lines().find_map(|l| l.strip_prefix("0::"))?.trim_start_matches('/');
    let dir = root.join(rel);
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    room(&read("memory.max")?, &read("memory.current")?)
}

/// `max - current` of a cgroup's `memory.max` and `memory.current` texts; `None` for no limit (`max`).
pub fn room(max: &str, current: &str) -> Option<u64> {
    let max: u64 = max.trim().parse().ok()?;
    let current: u64 = current.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_bytes_from_meminfo() {
        let text = "MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   65536000 kB\n";
        assert_eq!(mem_available(text), Some(65_536_000 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn the_cgroup_room_is_its_limit_less_its_use_and_none_without_a_limit() {
        assert_eq!(room("34359738368\n", "8589934592\n"), Some(25_769_803_776));
        assert_eq!(room("100\n", "150\n"), Some(0));
        assert_eq!(room("max\n", "8589934592\n"), None);
    }

    #[test]
    fn the_cgroup_is_found_from_the_process_s_entry() {
        let root = std::env::temp_dir().join(format!("weightferry-cgroup-{}", std::process::id()));
        let dir = root.join("user.slice/job");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.max"), "1000\n").unwrap();
        std::fs::write(dir.join("memory.current"), "400\n").unwrap();
        assert_eq!(cgroup_room(&root, "0::/user.slice/job\n"), Some(600));
        assert_eq!(cgroup_room(&root, "1:memory:/x\n"), None, "cgroup v1 only: no v2 entry");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
