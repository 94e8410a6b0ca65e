//! The GPU timeline: device-side timestamps of copies and kernels, taken with timing CUDA events, for explaining
//! where a step's time goes (compute busy, compute stream stalled on a copy, copy engine busy).
//!
//! While a timeline is armed ([`CudaPlatform::timeline_arm`]), every host-to-device copy the platform enqueues is
//! bracketed by two timing events on its stream, and an engine brackets its kernels with
//! [`CudaPlatform::timeline_begin`] / [`CudaPlatform::timeline_end`]. [`CudaPlatform::timeline_collect`]
//! synchronises the events, converts them to microseconds after the arming event and disarms. Events come from a
//! pool created when the timeline is armed, so recording a span never creates a driver object; when the pool runs
//! dry further spans are counted as dropped, never blocked on.
//!
//! Copies out of a block's master and AllGathers of a block are named by that block once the offload backend's
//! names are given ([`CudaPlatform::timeline_name`]).
//!
//! Invariant: a disarmed timeline costs one relaxed atomic load per copy and records nothing; timing events are
//! never mixed with the platform's scheduling events (those stay `CU_EVENT_DISABLE_TIMING`).

use std::collections::HashMap;
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use cudarc::driver::sys;
use weightferry_actors::platform::{HostBufferId, PlatformError, PlatformResult, StreamId};

use super::driver::describe;
use super::CudaPlatform;
use crate::platform::timeline::{DeviceSpan, DeviceTracer, GatherNamer};

/// A span begun by [`CudaPlatform::timeline_begin`]; hand it back to [`CudaPlatform::timeline_end`].
#[derive(Debug)]
#[must_use]
pub struct SpanToken {
    index: usize,
}

struct Pending {
    lane: String,
    label: String,
    start: sys::CUevent,
    end: Option<sys::CUevent>,
}

#[derive(Default)]
struct State {
    free: Vec<sys::CUevent>,
    base: Option<sys::CUevent>,
    spans: Vec<Pending>,
    dropped: u64,
    /// What each named host buffer holds (a block's master), for copy spans.
    copy_names: HashMap<HostBufferId, String>,
    gather_namer: Option<GatherNamer>,
}

/// Timing events and recorded spans of one platform.
#[derive(Default)]
pub(crate) struct Timeline {
    armed: AtomicBool,
    state: Mutex<State>,
}

// SAFETY: the raw event handles are plain driver handles, usable from any thread once the owning context is
// current (every method binds it); all access to them goes through the mutex.
unsafe impl Send for Timeline {}
// SAFETY: as above; shared access is serialised by the mutex, the flag is atomic.
unsafe impl Sync for Timeline {}

impl Timeline {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn armed(&self) -> bool {
        self.armed.load(Ordering::Relaxed)
    }

    /// Destroys every pooled event (the context is current).
    pub(crate) fn destroy_all(&self) {
        let mut st = self.lock();
        let mut all = std::mem::take(&mut st.free);
        all.extend(st.base.take());
        for p in st.spans.drain(..) {
            all.push(p.start);
            all.extend(p.end);
        }
        for ev in all {
            // SAFETY: each handle was created by `cuEventCreate` in `timeline_arm` and is destroyed exactly once
            // (it was moved out of the state above).
            let _ = unsafe { sys::cuEventDestroy_v2(ev) };
        }
        self.armed.store(false, Ordering::SeqCst);
    }
}

fn record(ev: sys::CUevent, stream: sys::CUstream) -> PlatformResult<()> {
    // SAFETY: `ev` is a live pooled event and `stream` a live stream of the same context (callers hold its entry).
    unsafe { sys::cuEventRecord(ev, stream) }
        .result()
        .map_err(|e| PlatformError::Driver(format!("timeline event record: {}", describe(e))))
}

impl CudaPlatform {
    /// Names copy spans out of these host buffers by what they hold (`h2d transformer.transformer_blocks.7`), and
    /// AllGather spans by `namer(tag)`; copies from other buffers keep their byte count. Replaces earlier names.
    pub fn timeline_name(&self, copies: impl IntoIterator<Item = (HostBufferId, String)>, namer: Option<GatherNamer>) {
        let mut state = self.timeline.lock();
        state.copy_names = copies.into_iter().collect();
        state.gather_namer = namer;
    }

    /// The label of a copy of `len` bytes out of `src` (only formatted while armed).
    pub(crate) fn copy_label(&self, src: HostBufferId, len: u64) -> String {
        match self.timeline.lock().copy_names.get(&src) {
            Some(name) => format!("h2d {name}"),
            None => format!("h2d {len}"),
        }
    }

    /// The label of an AllGather of `out_len` bytes tagged `tag` (used by the NCCL collective only).
    #[cfg(feature = "nccl")]
    pub(crate) fn gather_label(&self, tag: u64, out_len: u64) -> String {
        let namer = self.timeline.lock().gather_namer.clone();
        match namer.and_then(|f| f(tag)) {
            Some(name) => format!("allgather {name}"),
            None => format!("allgather {out_len}"),
        }
    }

    /// Arms the timeline with a pool of `capacity` timing events and records the arming event on `stream`; earlier
    /// spans are discarded.
    pub fn timeline_arm(&self, stream: StreamId, capacity: usize) -> PlatformResult<()> {
        let st = self.stream_entry(stream)?;
        self.bind_to_thread()?;
        self.timeline.destroy_all();
        let mut state = self.timeline.lock();
        for _ in 0..capacity.max(1) + 1 {
            let mut raw: sys::CUevent = ptr::null_mut();
            // SAFETY: `raw` is a valid out-pointer; flags 0 = a default event with timing.
            unsafe { sys::cuEventCreate(&mut raw, 0) }
                .result()
                .map_err(|e| PlatformError::Driver(format!("timeline event create: {}", describe(e))))?;
            state.free.push(raw);
        }
        let base = state.free.pop().ok_or_else(|| PlatformError::Driver("timeline pool empty".into()))?;
        record(base, st.raw())?;
        state.base = Some(base);
        state.dropped = 0;
        self.timeline.armed.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Records the start of a span on `stream`; `None` when the timeline is not armed or its pool is empty.
    pub fn timeline_begin(&self, stream: StreamId, lane: &str, label: &str) -> Option<SpanToken> {
        if !self.timeline.armed() {
            return None;
        }
        let raw = self.raw_stream(stream)?;
        let mut state = self.timeline.lock();
        let Some(ev) = state.free.pop() else {
            state.dropped += 1;
            return None;
        };
        if record(ev, raw).is_err() {
            state.free.push(ev);
            state.dropped += 1;
            return None;
        }
        state.spans.push(Pending { lane: lane.to_string(), label: label.to_string(), start: ev, end: None });
        Some(SpanToken { index: state.spans.len() - 1 })
    }

    /// Records the end of a span on `stream` (the stream its start was recorded on).
    pub fn timeline_end(&self, stream: StreamId, token: Option<SpanToken>) {
        // A `None` token (the timeline is disarmed: every copy and kernel) returns before any lookup.
        let Some(token) = token else { return };
        let Some(raw) = self.raw_stream(stream) else { return };
        let mut state = self.timeline.lock();
        let Some(ev) = state.free.pop() else {
            state.dropped += 1;
            return;
        };
        if record(ev, raw).is_err() {
            state.free.push(ev);
            state.dropped += 1;
            return;
        }
        match state.spans.get_mut(token.index) {
            Some(p) if p.end.is_none() => p.end = Some(ev),
            _ => state.free.push(ev),
        }
    }

    /// Waits for every recorded span, returns them sorted by start (µs after the arming event) with the number of
    /// spans dropped for want of events, and disarms the timeline (its events are destroyed).
    pub fn timeline_collect(&self) -> PlatformResult<(Vec<DeviceSpan>, u64)> {
        self.bind_to_thread()?;
        self.timeline.armed.store(false, Ordering::SeqCst);
        let result = (|| {
            let state = self.timeline.lock();
            let base = state.base.ok_or_else(|| PlatformError::Driver("the timeline was not armed".into()))?;
            let elapsed = |ev: sys::CUevent| -> PlatformResult<f64> {
                // SAFETY: `ev` is a live pooled event that was recorded; synchronising waits for its work.
                unsafe { sys::cuEventSynchronize(ev) }
                    .result()
                    .map_err(|e| PlatformError::Driver(format!("timeline event sync: {}", describe(e))))?;
                let mut ms = 0f32;
                // SAFETY: both events were created with timing and have completed (synchronised above and in an
                // earlier call for `base`).
                unsafe { sys::cuEventElapsedTime_v2(&mut ms, base, ev) }
                    .result()
                    .map_err(|e| PlatformError::Driver(format!("timeline elapsed time: {}", describe(e))))?;
                Ok(f64::from(ms) * 1e3)
            };
            elapsed(base)?;
            let mut out = Vec::with_capacity(state.spans.len());
            for p in &state.spans {
                let Some(end) = p.end else { continue };
                out.push(DeviceSpan {
                    lane: p.lane.clone(),
                    label: p.label.clone(),
                    start_us: elapsed(p.start)?,
                    end_us: elapsed(end)?,
                });
            }
            out.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
            Ok((out, state.dropped))
        })();
        self.timeline.destroy_all();
        result
    }
}

impl DeviceTracer for CudaPlatform {
    fn arm(&self, stream: StreamId, capacity: usize) -> Result<(), PlatformError> {
        self.timeline_arm(stream, capacity)
    }

    fn collect(&self) -> Result<(Vec<DeviceSpan>, u64), PlatformError> {
        self.timeline_collect()
    }

    fn name_spans(&self, copies: Vec<(HostBufferId, String)>, gathers: Option<GatherNamer>) {
        self.timeline_name(copies, gathers)
    }
}
