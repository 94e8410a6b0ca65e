//! Measuring a test process: its threads and resident set, and re-running a test in a child process whose allocator
//! keeps no per-thread arenas (shared by the soak and long-run tests through `#[path]`).

/// Resident set of this process now, in KiB, after the allocator returned its free memory to the system (glibc
/// keeps freed memory in per-thread arenas; which arena a cycle's buffers land in would otherwise move the figure by
/// megabytes either way).
pub(crate) fn rss_kib() -> u64 {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> std::os::raw::c_int;
        }
        // SAFETY: glibc's `malloc_trim` takes a byte count and only releases free memory of the allocator's arenas
        // back to the system; it touches no live allocation and is safe to call from any thread at any time.
        unsafe {
            malloc_trim(0);
        }
    }
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS line");
    line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("VmRSS value")
}

/// Threads of this process now.
pub(crate) fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").expect("/proc/self/task").count()
}

/// Set in the child process that runs the measured body (see [`in_steady_allocator`]).
const CHILD_ENV: &str = "WEIGHTFERRY_MEMORY_TEST_CHILD";

/// Runs this test again in a child process whose allocator keeps no per-thread arenas and no cache of exited threads'
/// stacks (glibc tunables), so its resident set reflects live memory and not which arena or cached stack a cycle's
/// allocations happened to land in (that moves it by megabytes either way); returns `true` in the child, which then
/// runs the body. The parent passes or fails with the child.
pub(crate) fn in_steady_allocator(test: &str) -> bool {
    if std::env::var_os(CHILD_ENV).is_some() {
        return true;
    }
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .env("GLIBC_TUNABLES", "glibc.malloc.arena_max=1:glibc.pthread.stack_cache_size=0")
        .output()
        .expect("run the test in a child process");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    assert!(out.status.success(), "the child run failed: {text}");
    assert!(text.contains("1 passed"), "the child ran no test: {text}");
    false
}
