//! One checkpoint file lent to the platform as read-only host memory ([`HostRegion`]): mapped once, read by the CPU
//! with ordinary file reads (no readahead: only the tensors asked for enter the page cache), its pages registered
//! with the driver for the device's copies.
//!
//! Policy for a file changed under a run (decided here, tested in `tests/checkpoint_mapped.rs`):
//! - **Replaced** (written to a new file and renamed over the path, as checkpoint writers do): nothing changes; the
//!   mapping keeps the old inode alive and the run goes on with the bytes it opened.
//! - **Truncated or rewritten in place**: every CPU read of the region (filling a pinned master, the simulated
//!   device's copies, restoring weights to an engine) first compares the file's length and modification time with
//!   those at open and fails with a message naming the file; the read itself is a `pread`, so even a race with the
//!   truncation is a short read, never a SIGBUS. The device's DMA from registered pages cannot be checked per copy:
//!   registered pages stay resident, so after a truncation the device keeps reading the bytes it registered, and
//!   after an in-place rewrite it may read the new ones; the next CPU read (at the latest `disable`) reports the
//!   change.
//! - **The disk tier** ([`DiskSource`](super::DiskSource)) opens the path again for reads around the page cache: that
//!   open must find the file opened here (not one renamed over it since), unchanged, and each of its reads is checked
//!   after it completes, so bytes changed before or during a read are an error, never weights.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use weightferry_actors::platform::HostRegion;

/// What identifies the file's contents as opened: a change in any of these is a modification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    len: u64,
    mtime: (i64, i64),
    ino: u64,
    dev: u64,
}

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Stamp {
        Stamp { len: meta.len(), mtime: (meta.mtime(), meta.mtime_nsec()), ino: meta.ino(), dev: meta.dev() }
    }

    fn of_file(file: &File, path: &Path) -> Result<Stamp, String> {
        file.metadata().map(|m| Stamp::of(&m)).map_err(|e| format!("{}: cannot stat: {e}", path.display()))
    }
}

/// A checkpoint file, open and mapped read-only.
#[derive(Debug)]
pub struct FileRegion {
    path: PathBuf,
    file: File,
    map: memmap2::Mmap,
    stamp: Stamp,
}

impl FileRegion {
    /// Maps `file` (opened from `path`) read-only, remembering its length and modification time.
    pub(crate) fn new(path: &Path, file: File) -> std::io::Result<FileRegion> {
        let stamp = Stamp::of(&file.metadata()?);
        // SAFETY: the mapping is read-only and private. The CPU never reads through it after open except for the
        // header check (`reader::SafetensorsFile::open`, right after the length was checked): every later read is a
        // `pread` on `file` ([`HostRegion::read_at`]); only the device reads the pages, after `cuMemHostRegister`
        // pinned them. The module doc says what happens when the file changes.
        let map = unsafe { memmap2::Mmap::map(&file)? };
        no_readahead(&file, &map);
        Ok(FileRegion { path: path.to_path_buf(), file, map, stamp })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The mapping, for the header check at open only.
    pub(crate) fn mapped(&self) -> &[u8] {
        &self.map
    }

    /// Fails when the file's length or modification time differ from those at open.
    pub fn check_unchanged(&self) -> Result<(), String> {
        self.compare(Stamp::of_file(&self.file, &self.path)?)
    }

    /// Fails, naming the change and the fix, when `now` (a stamp of the same file) is not the stamp at open.
    fn compare(&self, now: Stamp) -> Result<(), String> {
        if now == self.stamp {
            return Ok(());
        }
        let what = if (now.ino, now.dev) != (self.stamp.ino, self.stamp.dev) {
            "replaced by another file".to_string()
        } else if now.len < self.stamp.len {
            format!("truncated from {} to {} bytes", self.stamp.len, now.len)
        } else if now.len != self.stamp.len {
            format!("resized from {} to {} bytes", self.stamp.len, now.len)
        } else {
            "rewritten in place".to_string()
        };
        Err(format!(
            "{}: the checkpoint was {what} while weightferry used it; its weights are no longer the ones enabled. \
             Reload the model, and replace checkpoints by writing a new file and renaming it over the old one",
            self.path.display()
        ))
    }
}

impl crate::model::OpenedFile for FileRegion {
    fn path(&self) -> &Path {
        &self.path
    }

    fn check_unchanged(&self) -> Result<(), String> {
        FileRegion::check_unchanged(self)
    }

    fn check_same(&self, other: &File) -> Result<(), String> {
        self.compare(Stamp::of_file(other, &self.path)?)
    }
}

/// Turns the kernel's readahead off for reads through `file` and faults of `map` (the header check, the driver's
/// registration): weightferry reads whole tensors at known offsets, and readahead around them (8 MiB on some
/// machines) would pull the neighbouring bytes (the disk tier's blocks, read around the page cache, or other
/// components' tensors) into the page cache for nothing. Advice only: a kernel that ignores it changes nothing but
/// the cache.
fn no_readahead(file: &File, map: &memmap2::Mmap) {
    use std::os::fd::AsRawFd;
    // SAFETY: `posix_fadvise` reads no memory of ours; `file` is an open descriptor for the duration of the call.
    let _ = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
    let _ = map.advise(memmap2::Advice::Random);
}

impl HostRegion for FileRegion {
    fn len(&self) -> u64 {
        self.map.len() as u64
    }

    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
        self.check_unchanged()?;
        self.file
            .read_exact_at(out, offset)
            .map_err(|e| format!("{}: reading {} bytes at offset {offset} failed: {e}", self.path.display(), out.len()))
    }

    fn as_ptr(&self) -> *const u8 {
        self.map.as_ptr()
    }
}
