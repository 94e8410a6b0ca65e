//! Reading a checkpoint's byte ranges around the page cache: the disk tier's reads. A [`DirectFile`] opens the
//! file with `O_DIRECT` where the filesystem allows it (else buffered, said by [`DirectFile::is_direct`] so the
//! caller can warn), and reads a range into an [`AlignedBuf`] as the aligned superset `O_DIRECT` requires (offset
//! and length rounded out to [`DIRECT_ALIGN`]), returning where the asked bytes lie in it: no copy, no page cache,
//! and a read never touches a mapping, so a file truncated meanwhile is a [`CheckpointError::Changed`], never a
//! SIGBUS.
//!
//! Invariant: a successful [`DirectFile::read`] fills exactly the returned range with the file's bytes at the asked
//! offset; a short read (the file shrank) or an I/O error is an error and the buffer's contents are unspecified.

use super::error::CheckpointError;
use crate::model::OpenedFile;
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use weightferry_actors::platform::{BlockFile, DIRECT_READ_ALIGN};

/// Alignment of offsets, lengths and buffer addresses of direct reads (the scheduler's
/// [`DIRECT_READ_ALIGN`]: 4 KiB covers the logical block size of every common device, 512 B or 4 KiB).
pub const DIRECT_ALIGN: u64 = DIRECT_READ_ALIGN;

/// A heap buffer aligned to [`DIRECT_ALIGN`], zero-filled when made (the disk tier's pinned ring stands in its
/// place on a GPU).
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation exclusively; moving it between threads moves that ownership.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of `len` bytes rounded up to [`DIRECT_ALIGN`] (at least one block).
    pub fn new(len: usize) -> AlignedBuf {
        let len = len.max(1).next_multiple_of(DIRECT_ALIGN as usize);
        let layout = Layout::from_size_align(len, DIRECT_ALIGN as usize).expect("aligned layout of a usize length");
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = std::ptr::NonNull::new(raw) else { std::alloc::handle_alloc_error(layout) };
        AlignedBuf { ptr, len }
    }
    /// Its bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is a live allocation of `len` initialized (zeroed, then written) bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
    /// Its bytes, to read into (the disk-read bench hands them to io_uring).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
    /// Its length in bytes (a multiple of [`DIRECT_ALIGN`]).
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether it is empty (never: at least one block).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, DIRECT_ALIGN as usize).expect("the layout it was made with");
        // SAFETY: `ptr` was allocated by `alloc_zeroed` with this layout and is freed once.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// A checkpoint file opened for reads around the page cache.
#[derive(Debug)]
pub struct DirectFile {
    file: File,
    path: PathBuf,
    direct: bool,
}

impl DirectFile {
    /// Opens `path` read-only with `O_DIRECT`; a filesystem that refuses it (tmpfs, some network and overlay
    /// filesystems: `EINVAL`) gets a buffered open instead ([`is_direct`](Self::is_direct) is then `false`).
    pub fn open(path: impl AsRef<Path>) -> Result<DirectFile, CheckpointError> {
        Self::open_with(path.as_ref(), |p| File::options().read(true).custom_flags(libc::O_DIRECT).open(p))
    }

    /// [`open`](Self::open) with the direct open given (a test seam: a filesystem that refuses `O_DIRECT`).
    fn open_with(path: &Path, direct: impl Fn(&Path) -> std::io::Result<File>) -> Result<DirectFile, CheckpointError> {
        let path = path.to_path_buf();
        let io = |source| CheckpointError::Io { file: path.clone(), source };
        match direct(&path) {
            Ok(file) => Ok(DirectFile { file, path, direct: true }),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                let file = File::open(&path).map_err(io)?;
                Ok(DirectFile { file, path, direct: false })
            }
            Err(e) => Err(io(e)),
        }
    }

    /// Whether reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// The error of a read of this file that found it changed, for `reason` (which names the file).
    fn changed(&self, reason: String) -> CheckpointError {
        CheckpointError::Changed { file: self.path.clone(), reason }
    }

    /// The buffer size a read of `len` bytes at `offset` needs: the aligned superset of the range.
    pub fn span(offset: u64, len: u64) -> u64 {
        let start = offset - offset % DIRECT_ALIGN;
        (offset + len).next_multiple_of(DIRECT_ALIGN) - start
    }

    /// Reads the file's `len` bytes at `offset` into `buf` and returns where they lie in it. `buf` must hold
    /// [`span`](Self::span)`(offset, len)` bytes. A read that ends early (the file is shorter than the range: it
    /// was truncated since the checkpoint was checked) is [`CheckpointError::Changed`].
    pub fn read(&self, offset: u64, len: u64, buf: &mut AlignedBuf) -> Result<Range<usize>, CheckpointError> {
        self.read_into(offset, len, buf.as_mut_slice())
    }

    /// [`read`](Self::read) into any window that holds [`span`](Self::span)`(offset, len)` bytes; for a direct
    /// file the window must start at an address aligned to [`DIRECT_ALIGN`] (the disk tier's pinned staging
    /// buffers do), else the read is refused before the kernel sees it.
    pub fn read_into(&self, offset: u64, len: u64, window: &mut [u8]) -> Result<Range<usize>, CheckpointError> {
        let start = offset - offset % DIRECT_ALIGN;
        let span = Self::span(offset, len);
        let changed = |reason: String| self.changed(reason);
        if span > window.len() as u64 {
            return Err(changed(format!(
                "{}: a read of {len} bytes at {offset} needs a buffer of {span} bytes, given {}",
                self.path.display(),
                window.len()
            )));
        }
        if self.direct && window.as_ptr() as usize % DIRECT_ALIGN as usize != 0 {
            return Err(changed(format!(
                "{}: a direct read needs a buffer aligned to {DIRECT_ALIGN} bytes (internal)",
                self.path.display()
            )));
        }
        let dst = &mut window[..span as usize];
        let mut done = 0usize;
        let wanted = (offset + len - start) as usize; // bytes up to the range's end; the tail may lie past EOF
        while done < wanted {
            match self.file.read_at(&mut dst[done..], start + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(changed(format!("{}: read failed: {e}; check the disk", self.path.display()))),
            }
        }
        if done < wanted {
            return Err(changed(format!(
                "{}: the file ends at {} but the read needs bytes up to {}; it was truncated or rewritten while in \
                 use: restore it and enable again",
                self.path.display(),
                start + done as u64,
                offset + len
            )));
        }
        let at = (offset - start) as usize;
        Ok(at..at + len as usize)
    }
}

/// A [`DirectFile`] as the disk tier's reader reads it ([`BlockFile`]): a read into an aligned window (the staging
/// buffers the reader fills) goes straight there; any other read goes through one aligned buffer the file keeps
/// (made on first need, grown to the largest such read), copied into the caller's bytes. It is the checkpoint file
/// the model was loaded from ([`OpenedFile`]): opening it again must find that file unchanged, and every read is
/// checked against it once the bytes are in (a file truncated, resized or rewritten in place before or during a read
/// is an error naming it, never weights).
#[derive(Debug)]
pub struct DiskSource {
    file: DirectFile,
    origin: Arc<dyn OpenedFile>,
    buf: std::sync::Mutex<Option<AlignedBuf>>,
}

impl DiskSource {
    /// Opens the model's checkpoint file `origin` again for the disk tier (see [`DirectFile::open`]); fails when the
    /// path now names another file or the file changed since the model was loaded.
    pub fn open(origin: Arc<dyn OpenedFile>) -> Result<DiskSource, CheckpointError> {
        let file = DirectFile::open(origin.path())?;
        origin.check_same(&file.file).map_err(|reason| file.changed(reason))?;
        Ok(DiskSource { file, origin, buf: std::sync::Mutex::new(None) })
    }

    /// Whether reads bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.file.is_direct()
    }

    /// A read's result once it returned: the file's change since it was opened if it changed (which explains a
    /// failed read too), else the read's own result.
    fn checked<T>(&self, read: Result<T, CheckpointError>) -> Result<T, String> {
        self.origin.check_unchanged()?;
        read.map_err(|e| e.to_string())
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf").field("len", &self.len).finish()
    }
}

impl BlockFile for DiskSource {
    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
        let len = out.len() as u64;
        let span = DirectFile::span(offset, len) as usize;
        let mut guard = self.buf.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if guard.as_ref().is_none_or(|b| b.len() < span) {
            *guard = Some(AlignedBuf::new(span));
        }
        let buf = guard.as_mut().expect("allocated above");
        let at = self.checked(self.file.read(offset, len, buf))?;
        out.copy_from_slice(&buf.as_slice()[at]);
        Ok(())
    }

    fn read_window(&self, offset: u64, len: u64, window: &mut [u8]) -> Result<(), String> {
        let aligned = window.as_ptr() as usize % DIRECT_ALIGN as usize == 0;
        if !self.file.direct || aligned {
            return self.checked(self.file.read_into(offset, len, window)).map(drop);
        }
        let at = (offset % DIRECT_ALIGN) as usize;
        let end = at.saturating_add(len as usize);
        let range = window.get_mut(at..end).ok_or_else(|| format!("a read of {len} bytes does not fit its window"))?;
        self.read_at(offset, range)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_of(dir: &Path, name: &str, len: usize) -> (PathBuf, Vec<u8>) {
        let bytes: Vec<u8> = (0..len).map(|i| (i * 31 + i / 7) as u8).collect();
        let path = dir.join(name);
        std::fs::write(&path, &bytes).unwrap();
        (path, bytes)
    }

    /// `path` opened as a model's loader opens its checkpoint file.
    fn opened(path: &Path) -> Arc<dyn OpenedFile> {
        Arc::new(super::super::FileRegion::new(path, File::open(path).unwrap()).unwrap())
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("weightferry-direct-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn any_range_reads_the_file_s_bytes_through_the_aligned_superset() {
        let (path, bytes) = file_of(&scratch("ranges"), "f.bin", 3 * 4096 + 123);
        let f = DirectFile::open(&path).unwrap();
        for (offset, len) in [(0, 1), (1, 4095), (4095, 2), (4096, 4096), (100, 3 * 4096), (12_000, 411), (0, 12_411)] {
            let mut buf = AlignedBuf::new(DirectFile::span(offset, len) as usize);
            let got = f.read(offset, len, &mut buf).unwrap();
            assert_eq!(&buf.as_slice()[got], &bytes[offset as usize..(offset + len) as usize], "{offset}+{len}");
        }
    }

    #[test]
    fn a_window_read_lands_at_the_offset_s_distance_past_alignment_aligned_or_not() {
        let (path, bytes) = file_of(&scratch("window"), "f.bin", 5 * 4096 + 77);
        let f = DiskSource::open(opened(&path)).unwrap();
        for (offset, len) in [(0u64, 10u64), (4097, 5000), (4095, 2), (3 * 4096 + 5, 2 * 4096 + 72)] {
            let span = DirectFile::span(offset, len) as usize;
            let mut aligned = AlignedBuf::new(span + 4096);
            let at = (offset % 4096) as usize;
            f.read_window(offset, len, &mut aligned.as_mut_slice()[..span]).unwrap();
            assert_eq!(&aligned.as_slice()[at..at + len as usize], &bytes[offset as usize..(offset + len) as usize]);
            // A window at an unaligned address goes through the bounce buffer: the same bytes, in the same place.
            let window = &mut aligned.as_mut_slice()[8..8 + span];
            window.fill(0);
            f.read_window(offset, len, window).unwrap();
            assert_eq!(&window[at..at + len as usize], &bytes[offset as usize..(offset + len) as usize]);
        }
        let mut small = AlignedBuf::new(4096);
        let e = f.read_window(4000, 200, small.as_mut_slice()).unwrap_err();
        assert_eq!(
            e,
            format!("{}: a read of 200 bytes at 4000 needs a buffer of 8192 bytes, given 4096", path.display())
        );
    }

    #[test]
    fn a_range_past_the_end_is_a_changed_file_and_a_small_buffer_is_refused() {
        let (path, _) = file_of(&scratch("short"), "f.bin", 5000);
        let f = DirectFile::open(&path).unwrap();
        let mut buf = AlignedBuf::new(3 * 4096);
        let e = f.read(4000, 2000, &mut buf).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "{}: the file ends at 5000 but the read needs bytes up to 6000; it was truncated or rewritten while \
                 in use: restore it and enable again",
                path.display()
            )
        );
        let mut small = AlignedBuf::new(4096);
        let e = f.read(4000, 200, &mut small).unwrap_err();
        assert!(matches!(e, CheckpointError::Changed { .. }));
        assert_eq!(
            e.to_string(),
            format!("{}: a read of 200 bytes at 4000 needs a buffer of 8192 bytes, given 4096", path.display())
        );
    }

    #[test]
    fn a_file_truncated_after_open_is_an_error_not_a_signal() {
        let (path, _) = file_of(&scratch("truncate"), "f.bin", 4 * 4096);
        let f = DirectFile::open(&path).unwrap();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(4096).unwrap();
        let mut buf = AlignedBuf::new(2 * 4096);
        assert!(matches!(f.read(4096, 4096, &mut buf), Err(CheckpointError::Changed { .. })));
    }

    #[test]
    fn a_file_rewritten_in_place_or_replaced_is_an_error_naming_it_never_its_new_bytes() {
        let (path, bytes) = file_of(&scratch("rewrite"), "f.bin", 4 * 4096);
        let source = DiskSource::open(opened(&path)).unwrap();
        let mut out = vec![0u8; 4096];
        source.read_at(4096, &mut out).unwrap();
        assert_eq!(out, bytes[4096..8192]);
        // The same length, other bytes, written into the file (its modification time set apart from the open's, as
        // a rewrite seconds later has it on a filesystem with coarse timestamps).
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&vec![0x5A; 4096], 4096).unwrap();
        file.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(10)).unwrap();
        let want = format!(
            "{}: the checkpoint was rewritten in place while weightferry used it; its weights are no longer the ones \
             enabled. Reload the model, and replace checkpoints by writing a new file and renaming it over the old one",
            path.display()
        );
        assert_eq!(source.read_at(4096, &mut out).unwrap_err(), want);
        let mut window = AlignedBuf::new(4096);
        assert_eq!(source.read_window(4096, 4096, window.as_mut_slice()).unwrap_err(), want);

        // Replaced by a rename between the model's load and the disk tier's open: the tier refuses the new file.
        let (path, _) = file_of(&scratch("replaced"), "f.bin", 4 * 4096);
        let origin = opened(&path);
        let fresh = path.with_extension("new");
        std::fs::write(&fresh, vec![7u8; 4 * 4096]).unwrap();
        std::fs::rename(&fresh, &path).unwrap();
        let e = DiskSource::open(origin).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("{}: the checkpoint was replaced by another file while", path.display())),
            "{e}"
        );
    }

    #[test]
    fn a_filesystem_without_o_direct_falls_back_to_buffered_reads() {
        let (path, bytes) = file_of(&scratch("fallback"), "f.bin", 9000);
        let refuses = |_: &Path| Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        let f = DirectFile::open_with(&path, refuses).unwrap();
        assert!(!f.is_direct());
        let mut buf = AlignedBuf::new(DirectFile::span(10, 8000) as usize);
        let got = f.read(10, 8000, &mut buf).unwrap();
        assert_eq!(&buf.as_slice()[got], &bytes[10..8010]);
        // Another error of the direct open is the file's error, not a fallback.
        let denied = |_: &Path| Err(std::io::Error::from_raw_os_error(libc::EACCES));
        assert!(matches!(DirectFile::open_with(&path, denied), Err(CheckpointError::Io { .. })));
        // On this machine's filesystem the real open is direct (ext4, xfs and recent tmpfs allow it) or falls back.
        let real = DirectFile::open(&path).unwrap();
        let got = real.read(10, 8000, &mut buf).unwrap();
        assert_eq!(&buf.as_slice()[got], &bytes[10..8010]);
    }
}
