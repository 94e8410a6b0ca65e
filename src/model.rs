//! The host engine's loaded model: a pipeline description plus the bytes of every storage, living in platform host
//! buffers.
//!
//! Invariant: every storage has exactly one authoritative home at a time — its loaded host buffer, its tensor's
//! bytes in a checkpoint file the model mapped ([`Home::File`]: no copy in the process at all), a region of an
//! offload backend's host master, or (released for a distributed run) the shards the ranks of a group hold — so the
//! model never exists twice in host memory. Backends move homes with [`HostModel::adopt_master`] /
//! [`HostModel::restore_loaded`], a distributed run with [`HostModel::release_to_shards`] /
//! [`HostModel::restore_from_shards`]; [`HostModel::checksum`] reads through whichever home is current, which is how
//! tests prove weights are bit-identical after enable/disable cycles and faults. A storage whose bytes are not on
//! this host ([`Home::Sharded`]) is never read: every read of it is [`ModelError::Sharded`].

use crate::pipeline::{PipelineDesc, StorageDesc, StorageId};
use std::collections::BTreeMap;
use std::sync::Arc;
use weightferry_actors::platform::{HostBufferId, HostMemoryKind, PlatformError, PlatformRef};

/// Where a storage's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Home {
    /// Its own host buffer, as the loader produced it.
    Loaded {
        /// The buffer.
        buf: HostBufferId,
    },
    /// Its tensor in a checkpoint file: a range of a mapped host buffer ([`HostMemoryKind::Mapped`]) the model owns.
    /// Read through the platform (never through the mapping); a backend may copy to the device from it directly.
    File {
        /// The file's mapped buffer.
        buf: HostBufferId,
        /// Offset of the storage's bytes in the file.
        offset: u64,
    },
    /// A region of an offload backend's host master.
    Master {
        /// The master buffer.
        buf: HostBufferId,
        /// Offset of the storage in it.
        offset: u64,
    },
    /// Released by a distributed run: the bytes are held by the ranks of its group as shards (this rank holds
    /// only its 1/N of them), not in any buffer of this model. The run rebuilds them by a final AllGather and gives
    /// the storage a loaded buffer again ([`HostModel::restore_from_shards`]); until then every read fails with
    /// [`ModelError::Sharded`].
    Sharded,
}

impl Home {
    /// `"loaded"`, `"file"`, `"master"` or `"sharded"`.
    pub fn name(&self) -> &'static str {
        match self {
            Home::Loaded { .. } => "loaded",
            Home::File { .. } => "file",
            Home::Master { .. } => "master",
            Home::Sharded => "sharded",
        }
    }
}

/// Why the model could not read or re-home a storage.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// The platform failed, the storage is unknown, or a range lies outside it.
    #[error(transparent)]
    Platform(#[from] PlatformError),
    /// The storage's bytes are held by a distributed group as shards, not on this host.
    #[error(
        "storage {storage} is released to the shards of a distributed run: its bytes are not on this host until \
         the run restores them (a final AllGather at its end); if that run failed with its collective poisoned, \
         reload the pipeline"
    )]
    Sharded {
        /// The storage id.
        storage: u64,
    },
    /// Bytes given for a storage are not exactly its size.
    #[error("storage {storage} holds {expected} bytes, but {got} bytes were given for it")]
    WrongLength {
        /// The storage id.
        storage: u64,
        /// The storage's size in bytes.
        expected: u64,
        /// Bytes given.
        got: u64,
    },
    /// A storage was asked to move from a home it is not in.
    #[error("storage {storage} is {found}, not {expected}")]
    WrongHome {
        /// The storage id.
        storage: u64,
        /// The home the move needs.
        expected: &'static str,
        /// The home it has.
        found: &'static str,
    },
}

/// A checkpoint file a model's storages live in, as its loader opened it (the checkpoint module's mapped file):
/// its path, and whether a file is still that file with the contents it had then.
pub trait OpenedFile: Send + Sync + std::fmt::Debug {
    /// The file's path.
    fn path(&self) -> &std::path::Path;
    /// Fails, saying what changed and the fix, when the file is no longer as opened (truncated, resized or
    /// rewritten in place).
    fn check_unchanged(&self) -> Result<(), String>;
    /// Fails, saying so, when `other` (the same path opened again) is another file (the path was replaced since)
    /// or the file changed.
    fn check_same(&self, other: &std::fs::File) -> Result<(), String>;
}

/// A loaded model.
#[derive(Debug)]
pub struct HostModel {
    desc: Arc<PipelineDesc>,
    platform: PlatformRef,
    homes: BTreeMap<StorageId, Home>,
    /// Mapped checkpoint files the model owns (freed by [`HostModel::release`]).
    files: Vec<HostBufferId>,
    /// Each mapped file as opened (the disk tier opens it again for reads around the page cache, and checks that
    /// it is the same file, unchanged).
    paths: BTreeMap<HostBufferId, Arc<dyn OpenedFile>>,
    /// Where each file-backed storage lies in its file, whatever its current home: a backend's master gives it
    /// back by re-homing it there, without a copy.
    origins: BTreeMap<StorageId, (HostBufferId, u64)>,
    /// File-backed storages written since (their bytes are no longer the file's): given back as copies, never by
    /// re-homing them in the file.
    diverged: std::collections::BTreeSet<StorageId>,
    /// Storages of a model from a checkpoint that the file does not fill (see [`HostModel::caller_storages`]).
    caller: Vec<StorageId>,
}

/// FNV-1a over bytes, continuing from `h`.
pub fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01B3);
    }
    h
}

/// FNV-1a offset basis.
pub const FNV_OFFSET: u64 = 0xCBF2_9CE4_8422_2325;

/// Most bytes one thread of [`HostModel::checksum`] reads at a time.
pub const CHECKSUM_READ_BYTES: usize = 8 << 20;

/// What one generation thread returns: its storages' buffers, or the error and the buffers to free.
type GenResult = Result<Vec<(StorageId, HostBufferId)>, (ModelError, Vec<HostBufferId>)>;

/// A zero-filled pageable host buffer of exactly its size for each of `ids` (one byte for an empty storage:
/// platforms refuse empty allocations). If an allocation fails, the buffers allocated so far are freed.
pub(crate) fn zeroed_buffers(
    platform: &PlatformRef,
    desc: &PipelineDesc,
    ids: impl IntoIterator<Item = StorageId>,
) -> Result<BTreeMap<StorageId, HostBufferId>, PlatformError> {
    let mut loaded = BTreeMap::new();
    for id in ids {
        let bytes = desc.storages.get(&id).map_or(0, |s| s.byte_size()).max(1);
        match platform.alloc_host(bytes, HostMemoryKind::Pageable) {
            Ok(buf) => {
                loaded.insert(id, buf);
            }
            Err(e) => {
                for buf in loaded.into_values() {
                    let _ = platform.free_host(buf);
                }
                return Err(e);
            }
        }
    }
    Ok(loaded)
}

/// A pageable host buffer holding the bytes `bytes_of` gives for storage `id` ([`HostModel::from_fn`]); freed again
/// if they are not exactly the storage's size or cannot be written.
fn fill_storage<F>(
    platform: &PlatformRef,
    id: StorageId,
    storage: &StorageDesc,
    bytes_of: &F,
) -> Result<HostBufferId, ModelError>
where
    F: Fn(StorageId, &StorageDesc) -> Vec<u8>,
{
    let bytes = bytes_of(id, storage);
    let expected = storage.byte_size();
    if bytes.len() as u64 != expected {
        return Err(ModelError::WrongLength { storage: id.0, expected, got: bytes.len() as u64 });
    }
    let buf = platform.alloc_host(expected.max(1), HostMemoryKind::Pageable)?;
    if let Err(e) = platform.write_host(buf, 0, &bytes) {
        let _ = platform.free_host(buf);
        return Err(e.into());
    }
    Ok(buf)
}

impl HostModel {
    /// A model whose every storage is loaded in its own pageable host buffer holding the bytes `bytes_of` gives for
    /// it (called once per storage with its id and description; it must return exactly the storage's
    /// [`byte_size`](StorageDesc::byte_size), [`ModelError::WrongLength`] otherwise). The storages are filled on all
    /// available cores (at most 32), so `bytes_of` must give the same bytes whatever thread calls it; the model does
    /// not depend on the thread count. On an error every buffer allocated so far is freed; the error is that of the
    /// first thread, in storage order, that failed.
    pub fn from_fn<F>(platform: PlatformRef, desc: Arc<PipelineDesc>, bytes_of: F) -> Result<HostModel, ModelError>
    where
        F: Fn(StorageId, &StorageDesc) -> Vec<u8> + Sync,
    {
        let ids: Vec<StorageId> = desc.storages.keys().copied().collect();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 32);
        let chunk = ids.len().div_ceil(threads).max(1);
        let results: Vec<GenResult> = std::thread::scope(|scope| {
            let handles: Vec<_> = ids
                .chunks(chunk)
                .map(|part| {
                    let (platform, desc, bytes_of) = (&platform, &desc, &bytes_of);
                    scope.spawn(move || {
                        let mut made = Vec::new();
                        for &id in part {
                            match fill_storage(platform, id, &desc.storages[&id], bytes_of) {
                                Ok(buf) => made.push((id, buf)),
                                Err(e) => return Err((e, made.into_iter().map(|(_, b)| b).collect())),
                            }
                        }
                        Ok(made)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        let e = PlatformError::Driver("weight generation thread panicked".into());
                        Err((e.into(), Vec::new()))
                    })
                })
                .collect()
        });
        let mut loaded = BTreeMap::new();
        let mut first_err = None;
        let mut orphans = Vec::new();
        for r in results {
            match r {
                Ok(made) => loaded.extend(made),
                Err((e, made)) => {
                    first_err.get_or_insert(e);
                    orphans.extend(made);
                }
            }
        }
        if let Some(e) = first_err {
            for b in orphans.into_iter().chain(loaded.into_values()) {
                let _ = platform.free_host(b);
            }
            return Err(e);
        }
        Ok(HostModel::from_loaded(platform, desc, loaded))
    }

    /// A model whose every storage is loaded in its own host buffer of `platform` (`loaded` holds one buffer per
    /// storage of `desc`, owned by the model from now on). Loaders that fill buffers themselves use this.
    pub(crate) fn from_loaded(
        platform: PlatformRef,
        desc: Arc<PipelineDesc>,
        loaded: BTreeMap<StorageId, HostBufferId>,
    ) -> HostModel {
        let homes = loaded.into_iter().map(|(id, buf)| (id, Home::Loaded { buf })).collect();
        HostModel {
            desc,
            platform,
            homes,
            files: Vec::new(),
            paths: BTreeMap::new(),
            origins: BTreeMap::new(),
            diverged: Default::default(),
            caller: Vec::new(),
        }
    }

    /// A model whose every storage lies in a mapped file: `files` are mapped host buffers of `platform`
    /// ([`Platform::map_host`](weightferry_actors::platform::Platform::map_host)), owned by the model from now on;
    /// `at` gives each storage of `desc` its file and offset, `paths` each file as opened. Loaders check the ranges
    /// first. `loaded` are the caller's storages (zero-filled, for the caller to write); `converted` storages the
    /// loader filled itself (a file tensor in another float dtype).
    pub(crate) fn from_files(
        platform: PlatformRef,
        desc: Arc<PipelineDesc>,
        paths: BTreeMap<HostBufferId, Arc<dyn OpenedFile>>,
        at: BTreeMap<StorageId, (HostBufferId, u64)>,
        loaded: BTreeMap<StorageId, HostBufferId>,
        converted: BTreeMap<StorageId, HostBufferId>,
    ) -> HostModel {
        let mut homes: BTreeMap<_, _> =
            at.iter().map(|(&id, &(buf, offset))| (id, Home::File { buf, offset })).collect();
        let caller = loaded.keys().copied().collect();
        homes.extend(loaded.into_iter().chain(converted).map(|(id, buf)| (id, Home::Loaded { buf })));
        let files = paths.keys().copied().collect();
        HostModel { desc, platform, homes, files, paths, origins: at, diverged: Default::default(), caller }
    }

    /// Storages of a model from a checkpoint that the file does not fill (non-persistent buffers): zero-filled
    /// until the caller writes them. Empty for other models.
    pub fn caller_storages(&self) -> &[StorageId] {
        &self.caller
    }

    /// Where a file-backed storage lies in its checkpoint file (`(mapped buffer, offset)`), whatever its home now.
    pub fn file_origin(&self, id: StorageId) -> Option<(HostBufferId, u64)> {
        self.origins.get(&id).copied()
    }

    /// Mapped checkpoint file `buf` as the loader opened it.
    pub fn file(&self, buf: HostBufferId) -> Option<&Arc<dyn OpenedFile>> {
        self.paths.get(&buf)
    }

    /// The mapped checkpoint files the model owns.
    pub fn mapped_files(&self) -> &[HostBufferId] {
        &self.files
    }

    /// Bytes of the storages homed in a mapped file.
    pub fn file_bytes(&self) -> u64 {
        self.homes.iter().filter(|(_, h)| matches!(h, Home::File { .. })).map(|(id, _)| self.storage_bytes(*id)).sum()
    }

    /// A model whose every storage has its own zero-filled pageable host buffer of exactly its size (one byte for
    /// an empty storage: platforms refuse empty allocations), for a host engine that fills the bytes itself with
    /// [`write_storage`](Self::write_storage). If an allocation fails, every buffer allocated so far is freed and
    /// the platform's error is returned.
    pub fn zeroed(platform: PlatformRef, desc: Arc<PipelineDesc>) -> Result<HostModel, PlatformError> {
        let loaded = zeroed_buffers(&platform, &desc, desc.storages.keys().copied())?;
        Ok(HostModel::from_loaded(platform, desc, loaded))
    }

    /// Overwrites a loaded storage's bytes: `bytes` must be exactly its [`storage_bytes`](Self::storage_bytes)
    /// ([`ModelError::WrongLength`]), and the storage must be in its own loaded buffer ([`ModelError::WrongHome`]
    /// while a backend holds it in a master or it is released to shards: the authoritative copy is not rewritten
    /// behind the backend's back). An unknown storage is [`PlatformError::InvalidHandle`]. Nothing changes on an
    /// error.
    pub fn write_storage(&mut self, id: StorageId, bytes: &[u8]) -> Result<(), ModelError> {
        let home = self.homes.get(&id).copied().ok_or(PlatformError::InvalidHandle { what: "storage", id: id.0 })?;
        let Home::Loaded { buf } = home else {
            return Err(ModelError::WrongHome { storage: id.0, expected: "loaded", found: home.name() });
        };
        let expected = self.storage_bytes(id);
        if bytes.len() as u64 != expected {
            return Err(ModelError::WrongLength { storage: id.0, expected, got: bytes.len() as u64 });
        }
        Ok(self.platform.write_host(buf, 0, bytes)?)
    }

    /// Overwrites a storage's bytes in its current home, a loaded buffer or an offload backend's master: how a
    /// backend applies a write while it holds the storage (it first waits for every copy reading the master, and
    /// refreshes the device copies after). A storage from a checkpoint file no longer equals its file after a write:
    /// it is marked diverged (its origin stays: blocks keep their file order), so [`restore_loaded`](Self::restore_loaded) gives it a copy of the written master,
    /// not the file; one homed in the file itself (the fixed placement of a model from a checkpoint) moves to a
    /// loaded buffer of its own holding the new bytes, when `detach` allows (the caller says it reads the storage
    /// through its home, not straight from the file's address). `bytes` must be exactly the storage's size
    /// ([`ModelError::WrongLength`]); a storage served from its file without `detach`, or released to shards, is
    /// [`ModelError::WrongHome`]. Nothing changes on an error.
    pub(crate) fn write_through(&mut self, id: StorageId, bytes: &[u8], detach: bool) -> Result<(), ModelError> {
        let home = self.homes.get(&id).copied().ok_or(PlatformError::InvalidHandle { what: "storage", id: id.0 })?;
        let expected = self.storage_bytes(id);
        if bytes.len() as u64 != expected {
            return Err(ModelError::WrongLength { storage: id.0, expected, got: bytes.len() as u64 });
        }
        let (buf, offset) = match home {
            Home::Loaded { buf } => (buf, 0),
            Home::Master { buf, offset } => (buf, offset),
            Home::File { .. } if detach => {
                let buf = self.platform.alloc_host(expected.max(1), HostMemoryKind::Pageable)?;
                if let Err(e) = self.platform.write_host(buf, 0, bytes) {
                    let _ = self.platform.free_host(buf);
                    return Err(e.into());
                }
                self.homes.insert(id, Home::Loaded { buf });
                self.diverged.insert(id);
                return Ok(());
            }
            Home::File { .. } | Home::Sharded => {
                return Err(ModelError::WrongHome { storage: id.0, expected: "loaded or master", found: home.name() })
            }
        };
        self.platform.write_host(buf, offset, bytes)?;
        if self.origins.contains_key(&id) {
            self.diverged.insert(id);
        }
        Ok(())
    }

    /// The pipeline description.
    pub fn desc(&self) -> &Arc<PipelineDesc> {
        &self.desc
    }
    /// The platform holding the host buffers.
    pub fn platform(&self) -> &PlatformRef {
        &self.platform
    }
    /// Where a storage lives.
    pub fn home(&self, id: StorageId) -> Option<Home> {
        self.homes.get(&id).copied()
    }
    /// Byte size of a storage.
    pub fn storage_bytes(&self, id: StorageId) -> u64 {
        self.desc.storages.get(&id).map_or(0, |s| s.byte_size())
    }

    /// Reads a storage's bytes from its current home. A released storage is [`ModelError::Sharded`].
    pub fn read_storage(&self, id: StorageId) -> Result<Vec<u8>, ModelError> {
        let len = self.storage_bytes(id);
        let mut out = vec![0u8; len as usize];
        self.read_storage_range(id, 0, &mut out)?;
        Ok(out)
    }

    /// Reads `out.len()` bytes of a storage, starting `offset` bytes into it, from its current home (no allocation:
    /// this is how masters are filled through a bounded bounce buffer). A storage this model does not hold is
    /// [`PlatformError::InvalidHandle`]; a range that does not lie inside the storage's
    /// [`storage_bytes`](Self::storage_bytes) is [`PlatformError::OutOfBounds`] with `what: "storage range"` and the
    /// storage's size as `size`, and reads nothing (a loaded buffer may be longer than its storage, so the platform's
    /// own check would not catch it); a released storage ([`Home::Sharded`]) is [`ModelError::Sharded`], whatever the
    /// range. `out` is left as it was on every error.
    pub fn read_storage_range(&self, id: StorageId, offset: u64, out: &mut [u8]) -> Result<(), ModelError> {
        let home = self.homes.get(&id).copied().ok_or(PlatformError::InvalidHandle { what: "storage", id: id.0 })?;
        let (buf, base) = match home {
            Home::Loaded { buf } => (buf, 0),
            Home::File { buf, offset: base } | Home::Master { buf, offset: base } => (buf, base),
            Home::Sharded => return Err(ModelError::Sharded { storage: id.0 }),
        };
        let size = self.storage_bytes(id);
        let len = out.len() as u64;
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(PlatformError::OutOfBounds { what: "storage range", offset, len, size }.into());
        }
        Ok(self.platform.read_host(buf, base.saturating_add(offset), out)?)
    }

    /// Checksum of every storage's bytes, read through the current homes: FNV-1a, in storage order, over each
    /// storage's id and the FNV-1a digest of its bytes ([`storage_digest`](Self::storage_digest)). The digests are
    /// computed on all available cores (at most 32), each core reading through its own buffer of at most
    /// [`CHECKSUM_READ_BYTES`]; the result does not depend on the thread count. (A full-size model is tens of GB:
    /// byte-serial FNV-1a runs at about 1 GB/s.) The error is that of the first storage in storage order that cannot
    /// be read; a model with a released storage has no checksum here ([`ModelError::Sharded`]).
    pub fn checksum(&self) -> Result<u64, ModelError> {
        let ids: Vec<StorageId> = self.homes.keys().copied().collect();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 32).min(ids.len().max(1));
        let next = std::sync::atomic::AtomicUsize::new(0);
        type Digests = Vec<(usize, Result<u64, ModelError>)>;
        let per_thread: Vec<Digests> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    let (ids, next) = (&ids, &next);
                    scope.spawn(move || {
                        let mut buf = Vec::new();
                        let mut out = Vec::new();
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let Some(&id) = ids.get(i) else { break };
                            out.push((i, self.digest_into(id, &mut buf)));
                        }
                        out
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        let e = ModelError::Platform(PlatformError::Driver("checksum thread panicked".into()));
                        vec![(0, Err(e))]
                    })
                })
                .collect()
        });
        let mut digests: Vec<(usize, Result<u64, ModelError>)> = per_thread.into_iter().flatten().collect();
        digests.sort_by_key(|(i, _)| *i);
        let mut h = FNV_OFFSET;
        for ((_, digest), id) in digests.into_iter().zip(&ids) {
            h = fnv1a(h, &id.0.to_le_bytes());
            h = fnv1a(h, &digest?.to_le_bytes());
        }
        Ok(h)
    }

    /// FNV-1a digest (from [`FNV_OFFSET`]) of one storage's bytes, read through its current home.
    pub fn storage_digest(&self, id: StorageId) -> Result<u64, ModelError> {
        self.digest_into(id, &mut Vec::new())
    }

    /// [`storage_digest`](Self::storage_digest) through `buf`, grown to at most [`CHECKSUM_READ_BYTES`].
    fn digest_into(&self, id: StorageId, buf: &mut Vec<u8>) -> Result<u64, ModelError> {
        let len = self.storage_bytes(id);
        if len == 0 {
            // Still checks that the storage exists and is readable (a released one is not).
            self.read_storage_range(id, 0, &mut [])?;
            return Ok(FNV_OFFSET);
        }
        let want = usize::try_from(len).unwrap_or(usize::MAX).min(CHECKSUM_READ_BYTES);
        if buf.len() < want {
            buf.resize(want, 0);
        }
        let mut h = FNV_OFFSET;
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(buf.len() as u64) as usize;
            let chunk = &mut buf[..n];
            self.read_storage_range(id, done, chunk)?;
            h = fnv1a(h, chunk);
            done += n as u64;
        }
        Ok(h)
    }

    /// Host bytes held in loaded (non-master) buffers.
    pub fn loaded_bytes(&self) -> u64 {
        self.homes.iter().filter(|(_, h)| matches!(h, Home::Loaded { .. })).map(|(id, _)| self.storage_bytes(*id)).sum()
    }

    /// Makes a master region the storage's home and frees its loaded buffer (a file-backed storage keeps its file,
    /// which the model owns). The caller has already copied the bytes into the master. Returns the previous home.
    pub fn adopt_master(&mut self, id: StorageId, buf: HostBufferId, offset: u64) -> Result<Home, PlatformError> {
        let prev = self.homes.get(&id).copied().ok_or(PlatformError::InvalidHandle { what: "storage", id: id.0 })?;
        if let Home::Loaded { buf: old } = prev {
            self.platform.free_host(old)?;
        }
        self.homes.insert(id, Home::Master { buf, offset });
        Ok(prev)
    }

    /// Gives a storage back its own loaded host buffer, copying its bytes out of the master (a real copy, so the
    /// model no longer aliases the backend's masters); a file-backed storage goes back to its file instead, with no
    /// copy, unless a backend wrote it since (a write while enabled). No-op unless it is homed in a
    /// master.
    pub fn restore_loaded(&mut self, id: StorageId) -> Result<(), ModelError> {
        let Some(Home::Master { .. }) = self.homes.get(&id).copied() else { return Ok(()) };
        if let Some(&(buf, offset)) = self.origins.get(&id).filter(|_| !self.diverged.contains(&id)) {
            self.homes.insert(id, Home::File { buf, offset });
            return Ok(());
        }
        let bytes = self.read_storage(id)?;
        let buf = self.platform.alloc_host(bytes.len().max(1) as u64, HostMemoryKind::Pageable)?;
        if let Err(e) = self.platform.write_host(buf, 0, &bytes) {
            let _ = self.platform.free_host(buf);
            return Err(e.into());
        }
        self.homes.insert(id, Home::Loaded { buf });
        Ok(())
    }

    /// Storages currently homed in masters.
    pub fn mastered(&self) -> Vec<StorageId> {
        self.homes.iter().filter(|(_, h)| matches!(h, Home::Master { .. })).map(|(id, _)| *id).collect()
    }

    /// Frees a loaded storage's host buffer because a distributed run now holds its bytes as the shards of its
    /// group: the storage becomes [`Home::Sharded`] and every read of it fails with [`ModelError::Sharded`] until
    /// [`restore_from_shards`](Self::restore_from_shards). Only a loaded storage can be released
    /// ([`ModelError::WrongHome`] otherwise, changing nothing). If freeing the buffer fails, the storage stays
    /// loaded and the platform's error is returned.
    pub fn release_to_shards(&mut self, id: StorageId) -> Result<(), ModelError> {
        let prev = self.homes.get(&id).copied().ok_or(PlatformError::InvalidHandle { what: "storage", id: id.0 })?;
        let Home::Loaded { buf } = prev else {
            return Err(ModelError::WrongHome { storage: id.0, expected: "loaded", found: prev.name() });
        };
        self.platform.free_host(buf)?;
        self.homes.insert(id, Home::Sharded);
        Ok(())
    }

    /// Makes `buf` — a host buffer of this model's platform holding the storage's bytes at offset 0, rebuilt from
    /// the group's shards — the loaded home of a released storage, which owns it from now on. Checks that the
    /// storage is [`Home::Sharded`] ([`ModelError::WrongHome`]) and that `buf` holds at least the storage's bytes
    /// ([`PlatformError::OutOfBounds`] with `what: "restored storage"`); on an error nothing changes and the
    /// caller keeps `buf`.
    pub fn restore_from_shards(&mut self, id: StorageId, buf: HostBufferId) -> Result<(), ModelError> {
        let prev = self.homes.get(&id).copied().ok_or(PlatformError::InvalidHandle { what: "storage", id: id.0 })?;
        if prev != Home::Sharded {
            return Err(ModelError::WrongHome { storage: id.0, expected: "sharded", found: prev.name() });
        }
        let (len, _) = self.platform.host_buffer_info(buf)?;
        let size = self.storage_bytes(id);
        if len < size {
            return Err(PlatformError::OutOfBounds { what: "restored storage", offset: 0, len: size, size: len }.into());
        }
        self.homes.insert(id, Home::Loaded { buf });
        Ok(())
    }

    /// Storages released to the shards of a distributed run ([`Home::Sharded`]).
    pub fn sharded(&self) -> Vec<StorageId> {
        self.homes.iter().filter(|(_, h)| matches!(h, Home::Sharded)).map(|(id, _)| *id).collect()
    }

    /// Frees every loaded buffer and unmaps every file (the model is dropped). Masters belong to their backend;
    /// released storages hold no buffer of the model.
    pub fn release(mut self) {
        self.release_buffers();
    }

    /// [`release`](Self::release) in place, for an owner about to drop the model with itself: afterwards the
    /// model holds no storage at all.
    pub(crate) fn release_buffers(&mut self) {
        for (_, h) in std::mem::take(&mut self.homes) {
            if let Home::Loaded { buf } = h {
                let _ = self.platform.free_host(buf);
            }
        }
        for f in std::mem::take(&mut self.files) {
            let _ = self.platform.free_host(f);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weightferry_actors::sim::{SimConfig, SimPlatform};

    fn sim() -> Arc<SimPlatform> {
        Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap())
    }

    #[test]
    fn from_fn_loads_each_storage_from_its_bytes() {
        let sim = sim();
        let desc = Arc::new(crate::pipeline::presets::preset("flux-tiny").unwrap());
        let bytes = |id: StorageId, s: &StorageDesc| vec![id.0 as u8; s.byte_size() as usize];
        let model = HostModel::from_fn(sim.clone(), desc.clone(), bytes).unwrap();
        for (&id, s) in &desc.storages {
            assert_eq!(model.home(id).map(|h| h.name()), Some("loaded"));
            assert_eq!(model.read_storage(id).unwrap(), bytes(id, s), "{id:?}");
        }
        model.release();
        assert_eq!(sim.host_memory().in_use, 0);
    }

    #[test]
    fn from_fn_refuses_bytes_of_the_wrong_length_and_frees_what_it_allocated() {
        let sim = sim();
        let desc = Arc::new(crate::pipeline::presets::preset("flux-tiny").unwrap());
        let last = *desc.storages.keys().last().unwrap();
        let expected = desc.storages[&last].byte_size();
        let short = |id: StorageId, s: &StorageDesc| vec![0; s.byte_size() as usize - usize::from(id == last)];
        let e = HostModel::from_fn(sim.clone(), desc, short).unwrap_err();
        assert_eq!(e, ModelError::WrongLength { storage: last.0, expected, got: expected - 1 });
        assert_eq!(sim.host_memory().in_use, 0);
    }
}
