//! The wire format: every message is one frame, a 28-byte little-endian header (magic [`MAGIC`], protocol
//! [`VERSION`], kind, a flags byte, the sender's rank, the operation's sequence number, the payload length), then
//! the payload (at most [`MAX_PAYLOAD`] bytes); frame kinds, reading and writing frames, the hello's size.

use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// First four bytes of every frame (`"WFRV"` read as a little-endian `u32`).
pub const MAGIC: u32 = u32::from_le_bytes(*b"WFRV");
/// Protocol version; ranks of different versions refuse each other. Version 2 added the [`RunId`](super::RunId) to the
/// hello, version 3 the [`Fingerprint`](super::Fingerprint).
pub const VERSION: u16 = 3;
/// Largest payload of one frame (1 GiB).
pub const MAX_PAYLOAD: u64 = 1 << 30;
/// Largest world size: rank 0 holds one connection (one file descriptor) per rank.
pub const MAX_WORLD: usize = 16384;
/// Bytes of a frame header.
pub(super) const HEADER: usize = 28;

pub(super) const HELLO: u8 = 1;
pub(super) const WELCOME: u8 = 2;
pub(super) const REFUSE: u8 = 3;
pub(super) const BCAST: u8 = 4;
pub(super) const GATHER: u8 = 5;
pub(super) const GATHERED: u8 = 6;

/// How long rank 0 tries to tell a peer why it ends the rendezvous (best effort).
const REFUSE_TIMEOUT: Duration = Duration::from_secs(1);

pub(super) fn kind_name(kind: u8) -> &'static str {
    match kind {
        HELLO => "hello",
        WELCOME => "welcome",
        REFUSE => "refuse",
        BCAST => "broadcast",
        GATHER | GATHERED => "all_gather",
        _ => "unknown",
    }
}

pub(super) struct Frame {
    pub(super) kind: u8,
    pub(super) flags: u8,
    pub(super) rank: u32,
    pub(super) seq: u64,
    pub(super) payload: Vec<u8>,
}

pub(super) enum FrameError {
    Io(std::io::Error),
    Protocol { magic: u32, version: u16 },
    TooLarge(u64),
}

pub(super) fn timed_out() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out")
}

/// The flags of a `REFUSE` of the connection's hello (it did not join); 0 when rank 0 ends the rendezvous.
pub(super) const HELLO_REFUSED: u8 = 1;

pub(super) async fn write_frame<W: AsyncWrite + Unpin>(
    s: &mut W,
    kind: u8,
    rank: usize,
    seq: u64,
    payload: &[u8],
) -> std::io::Result<()> {
    write_frame_with(s, kind, 0, rank, seq, payload).await
}

async fn write_frame_with<W: AsyncWrite + Unpin>(
    s: &mut W,
    kind: u8,
    flags: u8,
    rank: usize,
    seq: u64,
    payload: &[u8],
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(HEADER + payload.len());
    buf.extend_from_slice(&MAGIC.to_le_bytes());
    buf.extend_from_slice(&VERSION.to_le_bytes());
    buf.push(kind);
    buf.push(flags);
    buf.extend_from_slice(&(rank as u32).to_le_bytes());
    buf.extend_from_slice(&seq.to_le_bytes());
    buf.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    buf.extend_from_slice(payload);
    s.write_all(&buf).await?;
    s.flush().await
}

/// Best effort: tells `s` why rank 0 ends the rendezvous, giving up after [`REFUSE_TIMEOUT`].
pub(super) async fn refuse<W: AsyncWrite + Unpin>(s: &mut W, seq: u64, reason: &str) {
    let _ = tokio::time::timeout(REFUSE_TIMEOUT, write_frame(s, REFUSE, 0, seq, reason.as_bytes())).await;
}

/// Best effort: tells `s` why rank 0 refuses its hello (the rendezvous goes on without it).
pub(super) async fn refuse_hello<W: AsyncWrite + Unpin>(s: &mut W, reason: &str) {
    let write = write_frame_with(s, REFUSE, HELLO_REFUSED, 0, 0, reason.as_bytes());
    let _ = tokio::time::timeout(REFUSE_TIMEOUT, write).await;
}

pub(super) async fn read_frame<R: AsyncRead + Unpin>(s: &mut R) -> Result<Frame, FrameError> {
    let mut h = [0u8; HEADER];
    s.read_exact(&mut h).await.map_err(FrameError::Io)?;
    let le32 = |b: &[u8]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let le64 = |b: &[u8]| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
    let magic = le32(&h[0..4]);
    let version = u16::from_le_bytes([h[4], h[5]]);
    if magic != MAGIC || version != VERSION {
        return Err(FrameError::Protocol { magic, version });
    }
    let len = le64(&h[20..28]);
    if len > MAX_PAYLOAD {
        return Err(FrameError::TooLarge(len));
    }
    // Grows with what arrives, so a header announcing a large payload allocates nothing up front.
    let mut payload = Vec::new();
    let got = (&mut *s).take(len).read_to_end(&mut payload).await.map_err(FrameError::Io)?;
    if got as u64 != len {
        return Err(FrameError::Io(std::io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(Frame { kind: h[6], flags: h[7], rank: le32(&h[8..12]), seq: le64(&h[12..20]), payload })
}

/// Bytes of a hello: the header, the joiner's world size (`u64`), its run id and its fingerprint (`u128` each).
pub(super) const HELLO_LEN: usize = HEADER + 8 + 16 + 16;

pub(super) fn io_reason(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => "timed out waiting for it".to_string(),
        std::io::ErrorKind::UnexpectedEof => "it closed the connection (the process exited or failed)".to_string(),
        _ => e.to_string(),
    }
}
