//! The disk tier's reader actor on the simulated platform: blocks read from a file through a ring of two staging
//! buffers arrive in their device buffers byte for byte, loads from host memory pass through in order between them,
//! the hazard detector sees no staging buffer refilled before the copies that read it (it orders by the events the
//! reader waits on, not by timing), and a failed read is that load's error while the others arrive. With
//! `--cfg weightferry_broken`, a reader that refills without waiting overwrites the bytes pending copies still read.

#![cfg(not(weightferry_loom))]

use std::sync::Arc;
use weightferry_actors::messages::{CopyDirection, CopyOp, FileRead, LoadCmd, TicketBoard};
use weightferry_actors::platform::{
    BlockFile, DeviceBufferId, HostBufferId, HostMemoryKind, Platform, PlatformError, DIRECT_READ_ALIGN,
};
use weightferry_actors::sim::{SimConfig, SimPlatform};
use weightferry_actors::{ReaderHandle, StreamHandle, StreamOptions};

const BLOCK: u64 = 256;

/// A checkpoint file in memory; reads of the block at `fail_at` fail.
#[derive(Debug)]
struct MemFile {
    bytes: Vec<u8>,
    fail_at: Option<u64>,
}

impl BlockFile for MemFile {
    fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
        if self.fail_at == Some(offset) {
            return Err("the file was truncated".into());
        }
        let o = offset as usize;
        out.copy_from_slice(self.bytes.get(o..o + out.len()).ok_or("past the end of the file")?);
        Ok(())
    }
}

fn block_bytes(b: usize) -> Vec<u8> {
    (0..BLOCK as usize).map(|i| (i as u8).wrapping_mul(7).wrapping_add(b as u8 * 29 + 1)).collect()
}

struct Rig {
    sim: Arc<SimPlatform>,
    stream: StreamHandle,
    reader: ReaderHandle,
    board: Arc<TicketBoard>,
    file: Arc<MemFile>,
}

fn rig(blocks: usize, fail_at: Option<usize>) -> Rig {
    // Slow copies: the reader gets ahead of them, so a refill that did not wait would overlap a pending copy.
    let config =
        SimConfig { tracing: false, copy_latency: std::time::Duration::from_millis(2), ..SimConfig::default() };
    let sim = Arc::new(SimPlatform::new(config).unwrap());
    let platform: Arc<dyn Platform> = sim.clone();
    let stream = StreamHandle::spawn(platform.clone(), "copy", StreamOptions::default()).unwrap();
    let reader =
        ReaderHandle::spawn(platform, "disk", stream.clone(), 2, DIRECT_READ_ALIGN, HostMemoryKind::Pinned).unwrap();
    let bytes = (0..blocks).flat_map(block_bytes).collect();
    let file = Arc::new(MemFile { bytes, fail_at: fail_at.map(|b| b as u64 * BLOCK) });
    Rig { sim, stream, reader, board: Arc::new(TicketBoard::new()), file }
}

impl Rig {
    fn load(&self, ticket: u64, block: usize, host: HostBufferId, dst: DeviceBufferId, reads: Vec<FileRead>) {
        self.load_through(&self.reader, ticket, block, host, dst, reads);
    }

    /// A load of `block` into `dst` from `host` (or, with `reads`, from the staging buffer they fill) through
    /// `reader`.
    fn load_through(
        &self,
        reader: &ReaderHandle,
        ticket: u64,
        block: usize,
        host: HostBufferId,
        dst: DeviceBufferId,
        reads: Vec<FileRead>,
    ) {
        // A disk load's copy reads the staging buffer where its read put the bytes.
        let host_offset = reads.first().map_or(0, |r| r.staging_offset);
        let copies = vec![CopyOp {
            direction: CopyDirection::HostToDevice,
            host,
            host_offset,
            device: dst,
            device_offset: 0,
            len: BLOCK,
        }];
        let ready = self.sim.create_event().unwrap();
        let cmd = LoadCmd {
            ticket,
            target: block,
            block,
            waits: Vec::new(),
            copies,
            ready,
            staged: None,
            board: self.board.clone(),
            notify: None,
        };
        reader.load(cmd, reads).unwrap();
    }

    fn load_from_disk(&self, ticket: u64, block: usize, dst: DeviceBufferId) {
        self.load_from_disk_through(&self.reader, ticket, block, dst);
    }

    fn load_from_disk_through(&self, reader: &ReaderHandle, ticket: u64, block: usize, dst: DeviceBufferId) {
        // Each read fills the aligned window around its range: the bytes lie `offset % DIRECT_READ_ALIGN` into it.
        let offset = block as u64 * BLOCK;
        let read = FileRead { file: self.file.clone(), offset, len: BLOCK, staging_offset: offset % DIRECT_READ_ALIGN };
        self.load_through(reader, ticket, block, HostBufferId(u64::MAX), dst, vec![read]);
    }

    fn device(&self, buf: DeviceBufferId) -> Vec<u8> {
        let mut out = vec![0u8; BLOCK as usize];
        self.sim.read_device(buf, 0, &mut out).unwrap();
        out
    }
}

#[test]
fn blocks_read_through_two_staging_buffers_arrive_in_order_without_a_hazard() {
    let r = rig(6, None);
    let master = r.sim.alloc_host(BLOCK, HostMemoryKind::Pinned).unwrap();
    r.sim.write_host(master, 0, &[0xAB; BLOCK as usize]).unwrap();
    let dst: Vec<DeviceBufferId> = (0..7).map(|_| r.sim.alloc_device(BLOCK).unwrap()).collect();
    for (b, &d) in dst.iter().enumerate().take(6) {
        r.load_from_disk(b as u64 + 1, b, d);
    }
    r.load(7, 6, master, dst[6], Vec::new()); // from host memory: straight through, after the others
    assert_eq!(r.board.wait(7, &|| true), Some(Ok(())));
    r.stream.fence().unwrap();
    for (b, &d) in dst.iter().enumerate().take(6) {
        assert_eq!(r.device(d), block_bytes(b), "block {b}");
    }
    assert_eq!(r.device(dst[6]), vec![0xAB; BLOCK as usize]);
    assert_eq!(r.reader.staging_bytes().unwrap(), 2 * DIRECT_READ_ALIGN);
    assert_eq!(r.sim.violations(), Vec::new());
    r.reader.destroy().unwrap();
    r.stream.destroy().unwrap();
}

#[test]
fn a_failed_read_is_its_load_s_error_and_the_other_blocks_arrive() {
    let r = rig(4, Some(2));
    let dst: Vec<DeviceBufferId> = (0..4).map(|_| r.sim.alloc_device(BLOCK).unwrap()).collect();
    for (b, &d) in dst.iter().enumerate() {
        r.load_from_disk(b as u64 + 1, b, d);
    }
    assert_eq!(r.board.wait(4, &|| true), Some(Ok(())));
    match r.board.poll(3) {
        Some(Err(PlatformError::FileReadFailed { offset, bytes, reason })) => {
            assert_eq!((offset, bytes, reason.as_str()), (2 * BLOCK, BLOCK, "the file was truncated"));
        }
        other => panic!("load 3: {other:?}"),
    }
    r.stream.fence().unwrap();
    for b in [0, 1, 3] {
        assert_eq!(r.device(dst[b]), block_bytes(b), "block {b}");
    }
    assert_eq!(r.device(dst[2]), vec![0; BLOCK as usize], "nothing copied for the failed read");
    assert_eq!(r.sim.violations(), Vec::new());
    r.reader.destroy().unwrap();
    r.stream.destroy().unwrap();
}

#[cfg(weightferry_broken)]
#[test]
fn a_reader_that_refills_without_waiting_overwrites_bytes_a_pending_copy_still_reads() {
    let r = rig(4, None);
    let platform: Arc<dyn Platform> = r.sim.clone();
    let broken = ReaderHandle::spawn_without_staging_wait(
        platform,
        "broken",
        r.stream.clone(),
        1,
        DIRECT_READ_ALIGN,
        HostMemoryKind::Pinned,
    )
    .unwrap();
    // Hold the copy stream until every read is done: a reader that does not wait refills its one buffer under the
    // pending copies. (The hazard detector takes a copy enqueued after a host write as ordered after it, so the
    // bytes, not its report, show this one.)
    let (release, gate) = std::sync::mpsc::channel::<()>();
    let held: weightferry_actors::sim::KernelFn = Box::new(move |_| release_wait(&gate));
    r.sim.launch(r.stream.stream(), "gate", Vec::new(), held).unwrap();
    let dst: Vec<DeviceBufferId> = (0..4).map(|_| r.sim.alloc_device(BLOCK).unwrap()).collect();
    for (b, &d) in dst.iter().enumerate() {
        r.load_from_disk_through(&broken, b as u64 + 1, b, d);
    }
    assert_eq!(r.board.wait(4, &|| true), Some(Ok(())));
    release.send(()).unwrap();
    r.stream.fence().unwrap();
    let wrong = (0..4).filter(|&b| r.device(dst[b]) != block_bytes(b)).count();
    assert_eq!(wrong, 3, "every block but the last got the last block's bytes");
    broken.destroy().unwrap();
    r.reader.destroy().unwrap();
    r.stream.destroy().unwrap();
}

#[cfg(weightferry_broken)]
fn release_wait(gate: &std::sync::mpsc::Receiver<()>) -> Result<(), String> {
    gate.recv().map_err(|e| e.to_string())
}
