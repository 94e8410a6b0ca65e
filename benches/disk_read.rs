#![allow(missing_docs)]
//! Disk read rate by mechanism, for the disk tier's choice (issue: models bigger than host memory): a file of
//! `DISK_READ_MIB` MiB (default 1024) read in block-sized ranges of `DISK_READ_CHUNK_MIB` MiB (default 64) by
//! - `buffered`: `pread` through the page cache, the file's pages dropped first (`posix_fadvise(DONTNEED)`), so
//!   the figure is a cold read as the page cache serves it;
//! - `direct xN`: [`DirectFile`] (`O_DIRECT`, no page cache) with N threads each reading a contiguous part of every
//!   range into its own aligned buffer (N = 1, 2, 4, 8): one reader thread against a small pool of `pread`s;
//! - `uring qN` (Linux): one thread, the file opened with `O_DIRECT`, every range split into N reads submitted to an
//!   io_uring at once and waited for together (N = 1, 2, 4, 8, 16): the kernel's queue deep without threads.
//!
//! Each row is the best of `DISK_READ_ROUNDS` rounds (default 3) in GB/s (10^9 bytes). The file lives in
//! `DISK_READ_DIR` (default the system temp folder); the figures describe that folder's device.
//!
//! Run: `cargo bench --bench disk_read`. Under `cargo test` (no `--bench` argument) it runs a smoke size (8 MiB in
//! ranges of 1 MiB, one round): the code is exercised, nothing is measured.

use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::time::Instant;
use weightferry::checkpoint::{AlignedBuf, DirectFile};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn drop_cache(path: &Path) {
    let f = std::fs::File::open(path).unwrap();
    // SAFETY: a valid open descriptor; the advice only drops clean cached pages of this file.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

/// GB/s of `read(start, end)` called for each range of `chunk` bytes of the first `total`, in order.
fn rate(total: u64, chunk: u64, mut read: impl FnMut(u64, u64)) -> f64 {
    let t0 = Instant::now();
    let mut at = 0;
    while at < total {
        let end = (at + chunk).min(total);
        read(at, end);
        at = end;
    }
    total as f64 / t0.elapsed().as_secs_f64() / 1e9
}

/// The first parts of range `at..end` split every `part` bytes, one per buffer of `bufs`: `(buffer, start, len)`
/// (the parts past the range's end, always the last ones, left out).
fn parts(at: u64, end: u64, part: u64, bufs: &mut [AlignedBuf]) -> impl Iterator<Item = (&mut AlignedBuf, u64, u64)> {
    bufs.iter_mut().enumerate().map(move |(i, buf)| (buf, at + i as u64 * part)).filter_map(move |(buf, start)| {
        let len = part.min(end.saturating_sub(start));
        (len > 0).then_some((buf, start, len))
    })
}

fn buffered(path: &Path, total: u64, chunk: u64) -> f64 {
    drop_cache(path);
    let f = std::fs::File::open(path).unwrap();
    let mut buf = vec![0u8; chunk as usize];
    rate(total, chunk, |at, end| f.read_exact_at(&mut buf[..(end - at) as usize], at).unwrap())
}

fn direct(path: &Path, total: u64, chunk: u64, threads: u64) -> f64 {
    let f = DirectFile::open(path).unwrap();
    assert!(f.is_direct(), "{} refuses O_DIRECT: set DISK_READ_DIR to a disk-backed folder", path.display());
    let part = chunk / threads;
    let mut bufs: Vec<AlignedBuf> = (0..threads).map(|_| AlignedBuf::new(part as usize)).collect();
    rate(total, chunk, |at, end| {
        std::thread::scope(|s| {
            for (buf, start, len) in parts(at, end, part, &mut bufs) {
                let f = &f;
                s.spawn(move || f.read(start, len, buf).unwrap());
            }
        });
    })
}

/// One range of `uring`: its parts submitted at once, then every completion waited for and checked whole.
#[cfg(target_os = "linux")]
fn uring_range(ring: &mut io_uring::IoUring, fd: i32, bufs: &mut [AlignedBuf], at: u64, end: u64, part: u64) {
    use io_uring::{opcode, types};
    let mut wanted = Vec::new();
    for (buf, start, len) in parts(at, end, part, bufs) {
        let read = opcode::Read::new(types::Fd(fd), buf.as_mut_slice().as_mut_ptr(), len as u32)
            .offset(start)
            .build()
            .user_data(wanted.len() as u64);
        // SAFETY: the buffer and the descriptor outlive the read: this function waits for every completion it
        // submitted before it returns, and neither is touched meanwhile.
        unsafe { ring.submission().push(&read).expect("the ring holds one entry per part") };
        wanted.push(len);
    }
    ring.submit_and_wait(wanted.len()).unwrap();
    let mut seen = 0;
    for done in ring.completion() {
        assert_eq!(done.result() as u64, wanted[done.user_data() as usize], "a short or failed io_uring read");
        seen += 1;
    }
    assert_eq!(seen, wanted.len());
}

#[cfg(target_os = "linux")]
fn uring(path: &Path, total: u64, chunk: u64, depth: u64) -> f64 {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).unwrap();
    let mut ring = io_uring::IoUring::new(depth as u32).unwrap();
    let part = chunk / depth;
    let mut bufs: Vec<AlignedBuf> = (0..depth).map(|_| AlignedBuf::new(part as usize)).collect();
    rate(total, chunk, |at, end| uring_range(&mut ring, f.as_raw_fd(), &mut bufs, at, end, part))
}

fn main() {
    let measuring = std::env::args().any(|a| a == "--bench");
    let (mib, chunk_mib, rounds) = if measuring {
        (env("DISK_READ_MIB", 1024), env("DISK_READ_CHUNK_MIB", 64), env("DISK_READ_ROUNDS", 3))
    } else {
        (8, 1, 1)
    };
    let dir = std::env::var("DISK_READ_DIR").map_or_else(|_| std::env::temp_dir(), Into::into);
    let path = dir.join(format!("weightferry-disk-read-{}.bin", std::process::id()));
    let (total, chunk) = (mib << 20, chunk_mib << 20);
    {
        let f = std::fs::File::create(&path).unwrap();
        let block: Vec<u8> = (0..(1usize << 20)).map(|i| (i * 131) as u8).collect();
        for i in 0..mib {
            f.write_all_at(&block, i << 20).unwrap();
        }
        f.sync_all().unwrap();
    }
    println!("disk_read: {mib} MiB file in {}, ranges of {chunk_mib} MiB, best of {rounds}", dir.display());
    let best = |f: &dyn Fn() -> f64| (0..rounds).map(|_| f()).fold(0.0f64, f64::max);
    println!("{:<12} {:>8}", "mechanism", "GB/s");
    println!("{:<12} {:>8.2}", "buffered", best(&|| buffered(&path, total, chunk)));
    for threads in [1, 2, 4, 8] {
        println!("{:<12} {:>8.2}", format!("direct x{threads}"), best(&|| direct(&path, total, chunk, threads)));
    }
    #[cfg(target_os = "linux")]
    for depth in [1, 2, 4, 8, 16] {
        println!("{:<12} {:>8.2}", format!("uring q{depth}"), best(&|| uring(&path, total, chunk, depth)));
    }
    std::fs::remove_file(&path).unwrap();
}
