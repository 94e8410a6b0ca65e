//! Simulated compute kernels: the context through which a kernel touches device memory.
//!
//! Invariant: a kernel can only read ranges it declared (as a read or a write) and only write ranges it declared
//! as writes; anything else is a [`KernelError`], never a silent access, so the hazard detector's view of what a
//! kernel touches is exact.

use super::hazard::Access;
use super::memory::{BytesError, DeviceBuffer};
use crate::platform::DeviceBufferId;
use crate::sync::{lock, Arc};

/// The body of a kernel: runs on its stream's worker thread, returns an error message on failure.
pub type KernelFn = Box<dyn FnOnce(&SimKernelCtx) -> Result<(), String> + Send>;

/// Why a kernel's memory access failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The range was not declared by the launch (or declared read-only and written).
    #[error("undeclared {} of device buffer {buffer:?} range {offset}+{len}", if *.write { "write" } else { "read" })]
    Undeclared {
        /// The buffer.
        buffer: DeviceBufferId,
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Whether it was a write.
        write: bool,
    },
    /// The buffer was freed while the kernel was pending.
    #[error("device buffer {0:?} was freed")]
    Freed(DeviceBufferId),
    /// The simulated memory could not be materialised.
    #[error("device buffer {buffer:?}: {reason}")]
    Memory {
        /// The buffer.
        buffer: DeviceBufferId,
        /// What failed.
        reason: String,
    },
}

impl From<KernelError> for String {
    fn from(e: KernelError) -> String {
        e.to_string()
    }
}

/// What a kernel sees: its label and the device ranges it declared.
pub struct SimKernelCtx {
    label: String,
    accesses: Vec<(Access, Arc<DeviceBuffer>)>,
}

impl std::fmt::Debug for SimKernelCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let accesses: Vec<&Access> = self.accesses.iter().map(|(a, _)| a).collect();
        f.debug_struct("SimKernelCtx").field("label", &self.label).field("accesses", &accesses).finish()
    }
}

impl SimKernelCtx {
    /// A context over resolved buffers.
    pub(crate) fn new(label: String, accesses: Vec<(Access, Arc<DeviceBuffer>)>) -> Self {
        SimKernelCtx { label, accesses }
    }

    /// The kernel's label.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The accesses declared at launch, in order.
    pub fn accesses(&self) -> Vec<Access> {
        self.accesses.iter().map(|(a, _)| *a).collect()
    }

    /// The buffer behind a declared access covering `offset..offset+len` (a write access when `write`).
    fn find(&self, buffer: DeviceBufferId, offset: u64, len: u64, write: bool) -> Result<&DeviceBuffer, KernelError> {
        let undeclared = KernelError::Undeclared { buffer, offset, len, write };
        let end = offset.checked_add(len).ok_or_else(|| undeclared.clone())?;
        self.accesses
            .iter()
            .find(|(a, _)| {
                a.buffer == buffer
                    && (a.write || !write)
                    && a.offset <= offset
                    && a.offset.checked_add(a.len).is_some_and(|a_end| end <= a_end)
            })
            .map(|(_, b)| &**b)
            .ok_or(undeclared)
    }

    fn map_err(buffer: DeviceBufferId, e: BytesError) -> KernelError {
        match e {
            BytesError::Freed => KernelError::Freed(buffer),
            BytesError::Alloc(reason) | BytesError::Region(reason) => KernelError::Memory { buffer, reason },
            BytesError::OutOfBounds { offset, len, size } => {
                KernelError::Memory { buffer, reason: format!("range {offset}+{len} exceeds {size} bytes") }
            }
        }
    }

    /// Reads `out.len()` bytes of `buffer` at `offset`.
    pub fn read(&self, buffer: DeviceBufferId, offset: u64, out: &mut [u8]) -> Result<(), KernelError> {
        let buf = self.find(buffer, offset, out.len() as u64, false)?;
        lock(&buf.bytes).read(offset, out).map_err(|e| Self::map_err(buffer, e))
    }

    /// Writes `data` into `buffer` at `offset`.
    pub fn write(&self, buffer: DeviceBufferId, offset: u64, data: &[u8]) -> Result<(), KernelError> {
        let buf = self.find(buffer, offset, data.len() as u64, true)?;
        lock(&buf.bytes).write(offset, data).map_err(|e| Self::map_err(buffer, e))
    }

    /// Runs `f` over `buffer[offset..offset+len]` (read-only).
    pub fn with_read<R>(
        &self,
        buffer: DeviceBufferId,
        offset: u64,
        len: u64,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, KernelError> {
        let buf = self.find(buffer, offset, len, false)?;
        lock(&buf.bytes).with_slice(offset, len, f).map_err(|e| Self::map_err(buffer, e))
    }

    /// Runs `f` over `buffer[offset..offset+len]` mutably.
    pub fn with_write<R>(
        &self,
        buffer: DeviceBufferId,
        offset: u64,
        len: u64,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, KernelError> {
        let buf = self.find(buffer, offset, len, true)?;
        lock(&buf.bytes).with_slice_mut(offset, len, f).map_err(|e| Self::map_err(buffer, e))
    }
}
