//! Fixed device placement: storages copied to the device once and kept there for the whole run (non-block state,
//! unselected components, residents — and, for the baseline run, the entire model).
//!
//! Invariant: the device copy is a read-only replica; the host home stays authoritative, so releasing the placement
//! needs no device→host copy. The placement is one device allocation, freed only after the copies into it (and the
//! caller's compute reading it) have completed.

use super::layout::UnitLayout;
use super::{OffloadError, WeightSource};
use crate::model::{Home, HostModel, ModelError};
use crate::pipeline::StorageId;
use std::collections::HashMap;
use weightferry_actors::platform::{DeviceBufferId, HostMemoryKind, PlatformError, PlatformRef, StreamId};

/// Storages placed on the device for good.
#[derive(Debug)]
pub struct ResidentPlacement {
    platform: PlatformRef,
    buf: Option<DeviceBufferId>,
    offsets: HashMap<StorageId, u64>,
    bytes: u64,
}

impl ResidentPlacement {
    /// Copies `storages` from their host homes into one device buffer on `stream`, and waits for the copies. A
    /// storage released to the shards of a distributed run has no host bytes to copy: [`ModelError::Sharded`],
    /// before anything is allocated.
    pub fn upload(
        platform: &PlatformRef,
        model: &HostModel,
        storages: &[StorageId],
        stream: StreamId,
    ) -> Result<ResidentPlacement, ModelError> {
        if let Some(s) = storages.iter().find(|s| model.home(**s) == Some(Home::Sharded)) {
            return Err(ModelError::Sharded { storage: s.0 });
        }
        let layout = UnitLayout::pack(model.desc(), "<fixed>", storages);
        let mut placement =
            ResidentPlacement { platform: platform.clone(), buf: None, offsets: HashMap::new(), bytes: 0 };
        if layout.device_bytes == 0 {
            return Ok(placement);
        }
        let buf = platform.alloc_device(layout.device_bytes)?;
        placement.buf = Some(buf);
        placement.bytes = layout.device_bytes;
        // File-backed storages whose file is not registered for device copies go through pageable staging buffers,
        // freed once the copies completed.
        let mut staging = Vec::new();
        let result = (|| {
            for sec in &layout.sections {
                for &(s, off) in &sec.storages {
                    let len = model.storage_bytes(s);
                    let dev = sec.device_offset + off;
                    placement.offsets.insert(s, dev);
                    if len == 0 {
                        continue;
                    }
                    let (src, src_off) = match model.home(s) {
                        Some(Home::Loaded { buf }) => (buf, 0),
                        Some(Home::Master { buf, offset }) => (buf, offset),
                        Some(Home::File { buf: file, offset }) => {
                            match platform.copy_h2d(stream, file, offset, buf, dev, len) {
                                Err(PlatformError::ReadOnly { .. }) => {}
                                other => {
                                    other?;
                                    continue;
                                }
                            }
                            let bytes = model.read_storage(s)?;
                            let stage = platform.alloc_host(len, HostMemoryKind::Pageable)?;
                            staging.push(stage);
                            platform.write_host(stage, 0, &bytes)?;
                            (stage, 0)
                        }
                        Some(Home::Sharded) => return Err(ModelError::Sharded { storage: s.0 }),
                        None => return Err(PlatformError::InvalidHandle { what: "storage", id: s.0 }.into()),
                    };
                    platform.copy_h2d(stream, src, src_off, buf, dev, len)?;
                }
            }
            Ok(platform.stream_synchronize(stream)?)
        })();
        if result.is_err() {
            let _ = platform.stream_synchronize(stream);
        }
        for b in staging {
            let _ = platform.free_host(b);
        }
        if let Err(e) = result {
            let _ = placement.release();
            return Err(e);
        }
        Ok(placement)
    }

    /// Copies `storages` (each placed here) again from their host homes on `stream` and waits: after a write
    /// changed their host bytes. The caller has waited for every kernel reading the placement. A storage not placed
    /// here, or whose home is not a host buffer (a checkpoint file, shards), is an error before anything is copied.
    pub fn refresh(&self, model: &HostModel, storages: &[StorageId], stream: StreamId) -> Result<(), ModelError> {
        let mut copies = Vec::new();
        for &s in storages {
            let (Some(buf), Some(&dev)) = (self.buf, self.offsets.get(&s)) else {
                return Err(PlatformError::InvalidHandle { what: "fixed-placement storage", id: s.0 }.into());
            };
            let (src, off) = match model.home(s) {
                Some(Home::Loaded { buf }) => (buf, 0),
                Some(Home::Master { buf, offset }) => (buf, offset),
                Some(other) => {
                    return Err(ModelError::WrongHome {
                        storage: s.0,
                        expected: "loaded or master",
                        found: other.name(),
                    })
                }
                None => return Err(PlatformError::InvalidHandle { what: "storage", id: s.0 }.into()),
            };
            copies.push((src, off, buf, dev, model.storage_bytes(s)));
        }
        let issued = copies
            .into_iter()
            .filter(|c| c.4 > 0)
            .try_for_each(|(src, off, buf, dev, len)| self.platform.copy_h2d(stream, src, off, buf, dev, len));
        let waited = self.platform.stream_synchronize(stream);
        issued?;
        Ok(waited?)
    }

    /// Device bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Frees the device buffer. The caller must have observed completion of all compute reading it. Idempotent.
    pub fn release(&mut self) -> Result<(), PlatformError> {
        if let Some(b) = self.buf.take() {
            self.platform.free_device(b)?;
        }
        self.offsets.clear();
        self.bytes = 0;
        Ok(())
    }

    /// Whether `storage` is placed here.
    pub fn contains(&self, storage: StorageId) -> bool {
        self.offsets.contains_key(&storage)
    }
}

impl WeightSource for ResidentPlacement {
    fn locate(&self, storage: StorageId) -> Result<(DeviceBufferId, u64), OffloadError> {
        match (self.buf, self.offsets.get(&storage)) {
            (Some(b), Some(&off)) => Ok((b, off)),
            _ => Err(OffloadError::NotResident { storage: storage.0, reason: "not in the fixed placement".into() }),
        }
    }
}
