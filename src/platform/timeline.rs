//! The device-timeline contract: timed spans on named lanes (one per stream role) and the tracer that arms and
//! collects them around an execution. The CUDA platform implements [`DeviceTracer`] with timing events; the
//! harness summarises the spans (stalls, copy and collective overlap) and writes traces.

use serde::Serialize;
use std::sync::Arc;
use weightferry_actors::platform::{HostBufferId, PlatformError, StreamId};

/// Lane of the engine's kernels.
pub const COMPUTE_LANE: &str = "compute";
/// Lane of host-to-device copies.
pub const COPY_LANE: &str = "copy";
/// Lane of collectives (NCCL AllGathers, on the communicator's stream).
pub const COMM_LANE: &str = "comm";
/// One timed span on one lane, in microseconds after a common origin.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceSpan {
    /// The lane (one per stream role: [`COMPUTE_LANE`], [`COPY_LANE`], [`COMM_LANE`]).
    pub lane: String,
    /// What ran (a module path, `h2d <bytes>`).
    pub label: String,
    /// Start, µs.
    pub start_us: f64,
    /// End, µs.
    pub end_us: f64,
}

/// Names an AllGather's span from its tag (an offload backend's `gather_names` knows which block a tag gathers).
pub type GatherNamer = Arc<dyn Fn(u64) -> Option<String> + Send + Sync>;

/// Arms and collects a device timeline around one execution: the CUDA platform's timing events, or a test's fake.
/// `arm` starts recording (spans after it are measured from an event recorded on `stream`); `collect` waits for
/// every recorded span, returns them (sorted by start) with the number dropped for want of events, and disarms.
pub trait DeviceTracer: Send + Sync {
    /// Starts recording, with room for `capacity` spans.
    fn arm(&self, stream: StreamId, capacity: usize) -> Result<(), PlatformError>;
    /// Stops recording and returns the spans and the number dropped.
    fn collect(&self) -> Result<(Vec<DeviceSpan>, u64), PlatformError>;
    /// Names copy spans out of `copies`' host buffers by what they hold, and AllGather spans by `gathers(tag)`
    /// (an offload backend's `master_units` and `gather_names`); a tracer without names ignores this.
    fn name_spans(&self, _copies: Vec<(HostBufferId, String)>, _gathers: Option<GatherNamer>) {}
}
