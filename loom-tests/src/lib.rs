//! Loom models of the scheduler's ordering invariants.
//!
//! The models live in `tests/` and only compile under `--cfg weightferry_loom`; this library holds the small
//! shared harness they use (compiled to nothing in the ordinary build):
//!
//! - `ModelPlatform`: a loom-friendly implementation of the scheduler's `Platform` contract built from the `sync`
//!   shim's primitives. Streams are in-order queues run by one loom "device" thread (newest runnable operation first);
//!   events follow CUDA
//!   semantics (a record captures a generation at enqueue, a wait captures the event's latest generation at the time
//!   of the call); device buffers are tiny byte arrays. A hazard check panics when an operation starts while a
//!   conflicting operation enqueued earlier (in global enqueue order) has not completed — read-before-ready,
//!   overwrite-before-last-use — and when device memory is freed while enqueued work still touches it.
//! - `Rig`: a tiny pipeline (blocks of two bytes each, one host master per block), a compute stream, a copy-stream
//!   actor running the production `StreamHandle`, and the engine-side "kernel" that reads a block's slot on the
//!   compute stream and checks it sees exactly that block's bytes.
//! - `model`: runs a closure under `loom::model` with a preemption bound (`LOOM_MAX_PREEMPTIONS`, default 2).
//! - Collective models: `CommPlatform`, a host-only platform without a device thread (every stream operation is
//!   logged and completes when it is enqueued), and `CommGroup` / `LoomCollective`, a loom communicator whose
//!   ranks record the tags of the AllGathers they are asked to issue and panic with `collective order` as soon as
//!   one diverges from the plan or from another rank.

#[cfg(weightferry_loom)]
pub use harness::*;

#[cfg(weightferry_loom)]
mod harness {
    use std::collections::{BTreeMap, VecDeque};
    use std::fmt;

    use weightferry_actors::collective::Collective;
    use weightferry_actors::messages::FileRead;
    use weightferry_actors::platform::{
        BlockFile, DeviceBufferId, DeviceMemoryStats, EventId, HostBufferId, HostMemoryKind, Platform, PlatformError,
        PlatformRef, PlatformResult, StreamId, DIRECT_READ_ALIGN,
    };
    use weightferry_actors::sync::{lock, thread, Arc, Condvar, Mutex, MutexGuard};
    use weightferry_actors::{
        BlockLocation, BlockSpec, BlockStack, OrderingFault, ReaderHandle, Segment, StackSpec, StreamHandle,
        StreamOptions, Submission,
    };

    /// Failures the model platform injects.
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct ModelConfig {
        /// Fail the n-th (1-based) `alloc_device` call with `OutOfMemory`.
        pub fail_alloc_at: Option<u32>,
        /// Fail the n-th (1-based) `copy_h2d` call at enqueue with `CopyFailed`.
        pub fail_copy_at: Option<u32>,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Access {
        Read,
        Write,
    }

    /// One access of an enqueued operation to a device buffer range.
    #[derive(Debug, Clone, Copy)]
    struct DevAccess {
        buf: u64,
        off: u64,
        len: u64,
        access: Access,
    }

    #[derive(Debug)]
    enum Effect {
        Wait { event: u32, gen: u64 },
        Record { event: u32, gen: u64 },
        H2D { host: u64, host_off: u64, dev: u64, dev_off: u64, len: u64 },
        D2H { dev: u64, dev_off: u64, host: u64, host_off: u64, len: u64 },
        Kernel { dev: u64, off: u64, expect: Vec<u8>, label: String },
    }

    #[derive(Debug)]
    struct Op {
        seq: u64,
        what: String,
        effect: Effect,
        accesses: Vec<DevAccess>,
    }

    /// An access of an enqueued, not yet completed operation.
    #[derive(Debug)]
    struct Pending {
        seq: u64,
        what: String,
        acc: DevAccess,
    }

    #[derive(Debug)]
    struct StreamQ {
        name: String,
        queue: VecDeque<Op>,
        enqueued: u64,
        done: u64,
        /// `destroy_stream` was called: the handle is invalid.
        destroyed: bool,
    }

    #[derive(Debug, Default)]
    struct Event {
        recorded: u64,
        completed: u64,
    }

    #[derive(Debug, Default)]
    struct State {
        next_id: u64,
        next_seq: u64,
        streams: Vec<StreamQ>,
        events: BTreeMap<u32, Event>,
        device: BTreeMap<u64, Vec<u8>>,
        host: BTreeMap<u64, (Vec<u8>, HostMemoryKind)>,
        pending: Vec<Pending>,
        in_use: u64,
        peak: u64,
        alloc_calls: u32,
        copy_calls: u32,
        kernels_run: u32,
        shutdown: bool,
        /// The device thread is parked on its condvar.
        device_idle: bool,
        /// The device thread has been started.
        device_started: bool,
        /// Host threads parked in `event_synchronize`, `stream_synchronize` or `drain`.
        host_waiters: usize,
    }

    /// Streams a model platform supports (compute + copy).
    pub const MAX_STREAMS: usize = 2;

    struct Shared {
        state: Mutex<State>,
        /// The device thread parks here.
        device: Condvar,
        /// Host threads waiting for device progress.
        host: Condvar,
        config: ModelConfig,
    }

    /// A loom-friendly device: streams are in-order queues run by one loom thread each, events carry generations,
    /// device buffers are byte arrays, and every operation is checked against the conflicting operations enqueued
    /// before it. A violated ordering panics with a message naming the hazard (`read-before-ready`,
    /// `overwrite-before-last-use`, `write-write`, `free-before-last-use`, `use-after-free`, `kernel ... read`).
    pub struct ModelPlatform {
        shared: Arc<Shared>,
    }

    impl fmt::Debug for ModelPlatform {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("ModelPlatform").finish_non_exhaustive()
        }
    }

    fn overlaps(a: &DevAccess, b: &DevAccess) -> bool {
        a.buf == b.buf && a.off < b.off + b.len && b.off < a.off + a.len
    }

    fn wait<'a>(cond: &Condvar, g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        match cond.wait(g) {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    impl State {
        fn id(&mut self) -> u64 {
            self.next_id += 1;
            self.next_id
        }

        fn stream(&mut self, s: StreamId) -> PlatformResult<&mut StreamQ> {
            self.streams
                .get_mut(s.0 as usize)
                .filter(|q| !q.destroyed)
                .ok_or(PlatformError::InvalidHandle { what: "stream", id: s.0 as u64 })
        }

        fn check_dev(&self, buf: u64, off: u64, len: u64) -> PlatformResult<()> {
            let b = self.device.get(&buf).ok_or(PlatformError::InvalidHandle { what: "device buffer", id: buf })?;
            if off + len > b.len() as u64 {
                return Err(PlatformError::OutOfBounds { what: "device", offset: off, len, size: b.len() as u64 });
            }
            Ok(())
        }

        fn check_host(&self, buf: u64, off: u64, len: u64) -> PlatformResult<()> {
            let b = self.host.get(&buf).ok_or(PlatformError::InvalidHandle { what: "host buffer", id: buf })?;
            if off + len > b.0.len() as u64 {
                return Err(PlatformError::OutOfBounds { what: "host", offset: off, len, size: b.0.len() as u64 });
            }
            Ok(())
        }

        fn enqueue(
            &mut self,
            s: StreamId,
            what: String,
            effect: Effect,
            accesses: Vec<DevAccess>,
        ) -> PlatformResult<()> {
            self.stream(s)?;
            self.next_seq += 1;
            let seq = self.next_seq;
            for acc in &accesses {
                self.pending.push(Pending { seq, what: what.clone(), acc: *acc });
            }
            let q = self.stream(s)?;
            q.enqueued += 1;
            q.queue.push_back(Op { seq, what, effect, accesses });
            Ok(())
        }

        /// Whether the operation at the head of stream `si` may start.
        fn head_ready(&self, si: usize) -> Option<bool> {
            let op = self.streams[si].queue.front()?;
            Some(match op.effect {
                Effect::Wait { event, gen } => self.events.get(&event).is_none_or(|e| e.completed >= gen),
                _ => true,
            })
        }

        /// Starts and completes the head operation of stream `si`, checking it against earlier-enqueued work.
        fn execute_head(&mut self, si: usize) {
            let Some(op) = self.streams[si].queue.pop_front() else { return };
            for acc in &op.accesses {
                if let Some(p) = self.pending.iter().find(|p| {
                    p.seq < op.seq
                        && overlaps(&p.acc, acc)
                        && (p.acc.access == Access::Write || acc.access == Access::Write)
                }) {
                    let hazard = match (p.acc.access, acc.access) {
                        (Access::Write, Access::Read) => "read-before-ready",
                        (Access::Read, Access::Write) => "overwrite-before-last-use",
                        _ => "write-write",
                    };
                    panic!(
                        "hazard {hazard}: `{}` (#{}) on stream '{}' started while `{}` (#{}) on device buffer {} had \
                         not completed",
                        op.what, op.seq, self.streams[si].name, p.what, p.seq, acc.buf
                    );
                }
                if !self.device.contains_key(&acc.buf) {
                    panic!(
                        "hazard use-after-free: `{}` (#{}) touches freed device buffer {}",
                        op.what, op.seq, acc.buf
                    );
                }
            }
            self.pending.retain(|p| p.seq != op.seq);
            match op.effect {
                Effect::Wait { .. } => {}
                Effect::Record { event, gen } => {
                    if let Some(e) = self.events.get_mut(&event) {
                        e.completed = e.completed.max(gen);
                    }
                }
                Effect::H2D { host, host_off, dev, dev_off, len } => {
                    let (h, d) = (host_off as usize, dev_off as usize);
                    let data = self.host[&host].0[h..h + len as usize].to_vec();
                    self.device.get_mut(&dev).expect("checked above")[d..d + len as usize].copy_from_slice(&data);
                }
                Effect::D2H { dev, dev_off, host, host_off, len } => {
                    let (h, d) = (host_off as usize, dev_off as usize);
                    let data = self.device[&dev][d..d + len as usize].to_vec();
                    if let Some(hb) = self.host.get_mut(&host) {
                        hb.0[h..h + len as usize].copy_from_slice(&data);
                    }
                }
                Effect::Kernel { dev, off, expect, label } => {
                    let o = off as usize;
                    let seen = &self.device[&dev][o..o + expect.len()];
                    assert_eq!(seen, &expect[..], "kernel `{label}` read the wrong bytes");
                    self.kernels_run += 1;
                }
            }
            self.streams[si].done += 1;
        }
    }

    impl Shared {
        /// Wakes the device thread if it is parked.
        fn wake_device(&self, st: &State) {
            if st.device_idle {
                self.device.notify_one();
            }
        }
    }

    impl State {
        /// The stream whose head operation should start next: among the heads that may start, the one enqueued
        /// *last*. Delaying older work as long as the streams' order and waits allow is the adversarial choice for
        /// the hazard check (an older conflicting operation stays pending as long as possible).
        fn pick(&self) -> Option<usize> {
            (0..self.streams.len())
                .filter(|&si| self.head_ready(si) == Some(true))
                .max_by_key(|&si| self.streams[si].queue.front().map(|op| op.seq))
        }
    }

    /// The device: one loom thread runs every stream. Each time it is scheduled it starts and completes, one by one,
    /// every operation that may start (newest first), then parks until work is enqueued. When it runs relative to
    /// the host threads is what loom explores.
    fn device(shared: Arc<Shared>) {
        let mut st = lock(&shared.state);
        loop {
            let mut ran = false;
            while let Some(si) = st.pick() {
                st.execute_head(si);
                ran = true;
            }
            if ran && st.host_waiters > 0 {
                shared.host.notify_all();
            }
            if st.shutdown && st.streams.iter().all(|s| s.queue.is_empty()) {
                return;
            }
            st.device_idle = true;
            st = wait(&shared.device, st);
            st.device_idle = false;
        }
    }

    impl ModelPlatform {
        /// A platform with no streams yet. The first `create_stream` spawns the device thread; call
        /// [`ModelPlatform::shutdown`] at the end of the model so it exits.
        pub fn new(config: ModelConfig) -> ModelPlatform {
            ModelPlatform {
                shared: Arc::new(Shared {
                    state: Mutex::new(State::default()),
                    device: Condvar::new(),
                    host: Condvar::new(),
                    config,
                }),
            }
        }

        fn state(&self) -> MutexGuard<'_, State> {
            lock(&self.shared.state)
        }

        /// Parks the calling host thread until the device makes progress.
        fn host_wait<'a>(&'a self, mut g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
            g.host_waiters += 1;
            let mut g = wait(&self.shared.host, g);
            g.host_waiters -= 1;
            g
        }

        /// Enqueues `effect` on `stream` and wakes the device.
        fn submit(
            &self,
            g: &mut State,
            stream: StreamId,
            what: String,
            effect: Effect,
            accesses: Vec<DevAccess>,
        ) -> PlatformResult<()> {
            g.enqueue(stream, what, effect, accesses)?;
            self.shared.wake_device(g);
            Ok(())
        }

        /// Blocks until every operation enqueued so far on every stream has completed.
        pub fn drain(&self) {
            let mut g = self.state();
            while g.streams.iter().any(|s| !s.queue.is_empty()) {
                g = self.host_wait(g);
            }
        }

        /// Lets the device thread exit once every queue is empty.
        pub fn shutdown(&self) {
            let mut g = self.state();
            g.shutdown = true;
            self.shared.wake_device(&g);
        }

        /// Enqueues a compute "kernel" on `stream` that reads `expect.len()` bytes of `loc` and asserts they equal
        /// `expect`.
        pub fn enqueue_kernel(&self, stream: StreamId, loc: BlockLocation, expect: Vec<u8>, label: String) {
            let mut g = self.state();
            let len = expect.len() as u64;
            g.check_dev(loc.buffer.0, loc.offset, len).expect("kernel reads a live device buffer");
            let acc = DevAccess { buf: loc.buffer.0, off: loc.offset, len, access: Access::Read };
            let effect = Effect::Kernel { dev: loc.buffer.0, off: loc.offset, expect, label: label.clone() };
            self.submit(&mut g, stream, format!("kernel {label}"), effect, vec![acc]).expect("kernel on a live stream");
        }

        /// Operations enqueued on `stream` that have not completed.
        pub fn pending_ops(&self, stream: StreamId) -> usize {
            self.state().streams[stream.0 as usize].queue.len()
        }

        /// Kernels that ran (and read the right bytes).
        pub fn kernels_run(&self) -> u32 {
            self.state().kernels_run
        }

        /// Live device buffers.
        pub fn live_device_buffers(&self) -> usize {
            self.state().device.len()
        }

        /// Live (created, not destroyed) events.
        pub fn live_events(&self) -> usize {
            self.state().events.len()
        }
    }

    impl Platform for ModelPlatform {
        fn name(&self) -> &'static str {
            "loom-model"
        }

        fn device_memory(&self) -> DeviceMemoryStats {
            let g = self.state();
            DeviceMemoryStats { capacity: 1 << 20, in_use: g.in_use, peak: g.peak }
        }

        fn reset_peak(&self) {
            let mut g = self.state();
            g.peak = g.in_use;
        }

        fn alloc_device(&self, bytes: u64) -> PlatformResult<DeviceBufferId> {
            let mut g = self.state();
            g.alloc_calls += 1;
            if self.shared.config.fail_alloc_at == Some(g.alloc_calls) {
                return Err(PlatformError::OutOfMemory { requested: bytes, in_use: g.in_use, capacity: g.in_use });
            }
            let id = g.id();
            g.device.insert(id, vec![0; bytes as usize]);
            g.in_use += bytes;
            g.peak = g.peak.max(g.in_use);
            Ok(DeviceBufferId(id))
        }

        fn free_device(&self, buf: DeviceBufferId) -> PlatformResult<()> {
            let mut g = self.state();
            if let Some(p) = g.pending.iter().find(|p| p.acc.buf == buf.0) {
                panic!(
                    "hazard free-before-last-use: device buffer {} freed while `{}` (#{}) had not completed",
                    buf.0, p.what, p.seq
                );
            }
            let b = g.device.remove(&buf.0).ok_or(PlatformError::InvalidHandle { what: "device buffer", id: buf.0 })?;
            g.in_use -= b.len() as u64;
            Ok(())
        }

        fn device_buffer_len(&self, buf: DeviceBufferId) -> PlatformResult<u64> {
            let g = self.state();
            g.device
                .get(&buf.0)
                .map(|b| b.len() as u64)
                .ok_or(PlatformError::InvalidHandle { what: "device buffer", id: buf.0 })
        }

        fn alloc_host(&self, bytes: u64, kind: HostMemoryKind) -> PlatformResult<HostBufferId> {
            let mut g = self.state();
            let id = g.id();
            g.host.insert(id, (vec![0; bytes as usize], kind));
            Ok(HostBufferId(id))
        }

        fn free_host(&self, buf: HostBufferId) -> PlatformResult<()> {
            let mut g = self.state();
            g.host.remove(&buf.0).map(|_| ()).ok_or(PlatformError::InvalidHandle { what: "host buffer", id: buf.0 })
        }

        fn write_host(&self, buf: HostBufferId, offset: u64, data: &[u8]) -> PlatformResult<()> {
            let mut g = self.state();
            g.check_host(buf.0, offset, data.len() as u64)?;
            // A host write into bytes an enqueued copy has not read yet (a staging buffer refilled early).
            let end = offset + data.len() as u64;
            for op in g.streams.iter().flat_map(|q| &q.queue) {
                if let Effect::H2D { host, host_off, len, .. } = op.effect {
                    if host == buf.0 && host_off < end && offset < host_off + len {
                        panic!(
                            "hazard host-overwrite-before-copy: write_host into host {} while '{}' (#{}) is pending",
                            buf.0, op.what, op.seq
                        );
                    }
                }
            }
            let o = offset as usize;
            let hb = &mut g.host.get_mut(&buf.0).expect("checked").0;
            hb[o..o + data.len()].copy_from_slice(data);
            Ok(())
        }

        fn read_host(&self, buf: HostBufferId, offset: u64, out: &mut [u8]) -> PlatformResult<()> {
            let g = self.state();
            g.check_host(buf.0, offset, out.len() as u64)?;
            let o = offset as usize;
            out.copy_from_slice(&g.host[&buf.0].0[o..o + out.len()]);
            Ok(())
        }

        fn host_buffer_info(&self, buf: HostBufferId) -> PlatformResult<(u64, HostMemoryKind)> {
            let g = self.state();
            g.host
                .get(&buf.0)
                .map(|(b, k)| (b.len() as u64, *k))
                .ok_or(PlatformError::InvalidHandle { what: "host buffer", id: buf.0 })
        }

        fn create_stream(&self, name: &str) -> PlatformResult<StreamId> {
            let mut g = self.state();
            let si = g.streams.len();
            if si == MAX_STREAMS {
                return Err(PlatformError::Driver(format!(
                    "the loom model platform has at most {MAX_STREAMS} streams"
                )));
            }
            g.streams.push(StreamQ {
                name: name.to_string(),
                queue: VecDeque::new(),
                enqueued: 0,
                done: 0,
                destroyed: false,
            });
            if !g.device_started {
                g.device_started = true;
                let shared = self.shared.clone();
                thread::spawn(move || device(shared));
            }
            Ok(StreamId(si as u32))
        }

        fn create_event(&self) -> PlatformResult<EventId> {
            let mut g = self.state();
            let id = g.id() as u32;
            g.events.insert(id, Event::default());
            Ok(EventId(id))
        }

        fn destroy_event(&self, event: EventId) -> PlatformResult<()> {
            let mut g = self.state();
            g.events
                .remove(&event.0)
                .map(|_| ())
                .ok_or(PlatformError::InvalidHandle { what: "event", id: event.0 as u64 })
        }

        fn record_event(&self, event: EventId, stream: StreamId) -> PlatformResult<()> {
            let mut g = self.state();
            g.stream(stream)?;
            let e =
                g.events.get_mut(&event.0).ok_or(PlatformError::InvalidHandle { what: "event", id: event.0 as u64 })?;
            e.recorded += 1;
            let gen = e.recorded;
            self.submit(
                &mut g,
                stream,
                format!("record event {} gen {gen}", event.0),
                Effect::Record { event: event.0, gen },
                Vec::new(),
            )?;
            Ok(())
        }

        fn stream_wait_event(&self, stream: StreamId, event: EventId) -> PlatformResult<()> {
            let mut g = self.state();
            let gen = g
                .events
                .get(&event.0)
                .ok_or(PlatformError::InvalidHandle { what: "event", id: event.0 as u64 })?
                .recorded;
            self.submit(
                &mut g,
                stream,
                format!("wait event {} gen {gen}", event.0),
                Effect::Wait { event: event.0, gen },
                Vec::new(),
            )?;
            Ok(())
        }

        fn event_query(&self, event: EventId) -> PlatformResult<bool> {
            let g = self.state();
            let e = g.events.get(&event.0).ok_or(PlatformError::InvalidHandle { what: "event", id: event.0 as u64 })?;
            Ok(e.completed >= e.recorded)
        }

        fn event_synchronize(&self, event: EventId) -> PlatformResult<()> {
            let mut g = self.state();
            let target = g
                .events
                .get(&event.0)
                .ok_or(PlatformError::InvalidHandle { what: "event", id: event.0 as u64 })?
                .recorded;
            while g.events.get(&event.0).is_some_and(|e| e.completed < target) {
                g = self.host_wait(g);
            }
            Ok(())
        }

        fn stream_synchronize(&self, stream: StreamId) -> PlatformResult<()> {
            let mut g = self.state();
            let target = g.stream(stream)?.enqueued;
            while g.streams[stream.0 as usize].done < target {
                g = self.host_wait(g);
            }
            Ok(())
        }

        fn destroy_stream(&self, stream: StreamId) -> PlatformResult<()> {
            let mut g = self.state();
            let target = g.stream(stream)?.enqueued;
            while g.streams[stream.0 as usize].done < target {
                g = self.host_wait(g);
            }
            g.stream(stream)?.destroyed = true;
            Ok(())
        }

        fn copy_h2d(
            &self,
            stream: StreamId,
            src: HostBufferId,
            src_offset: u64,
            dst: DeviceBufferId,
            dst_offset: u64,
            len: u64,
        ) -> PlatformResult<()> {
            let mut g = self.state();
            g.copy_calls += 1;
            if self.shared.config.fail_copy_at == Some(g.copy_calls) {
                return Err(PlatformError::CopyFailed {
                    direction: "host-to-device",
                    bytes: len,
                    reason: "injected by the model".into(),
                });
            }
            g.check_host(src.0, src_offset, len)?;
            g.check_dev(dst.0, dst_offset, len)?;
            let acc = DevAccess { buf: dst.0, off: dst_offset, len, access: Access::Write };
            let effect = Effect::H2D { host: src.0, host_off: src_offset, dev: dst.0, dev_off: dst_offset, len };
            self.submit(&mut g, stream, format!("copy host {} -> device {}", src.0, dst.0), effect, vec![acc])?;
            Ok(())
        }

        fn copy_d2h(
            &self,
            stream: StreamId,
            src: DeviceBufferId,
            src_offset: u64,
            dst: HostBufferId,
            dst_offset: u64,
            len: u64,
        ) -> PlatformResult<()> {
            let mut g = self.state();
            g.check_dev(src.0, src_offset, len)?;
            g.check_host(dst.0, dst_offset, len)?;
            let acc = DevAccess { buf: src.0, off: src_offset, len, access: Access::Read };
            let effect = Effect::D2H { dev: src.0, dev_off: src_offset, host: dst.0, host_off: dst_offset, len };
            self.submit(&mut g, stream, format!("copy device {} -> host {}", src.0, dst.0), effect, vec![acc])?;
            Ok(())
        }
    }

    /// Bytes of one block (two, distinct per block).
    pub const BLOCK_BYTES: u64 = 2;

    /// A tiny pipeline on a [`ModelPlatform`]: host masters, a compute stream, and a copy-stream actor.
    pub struct Rig {
        /// The model device.
        pub platform: std::sync::Arc<ModelPlatform>,
        /// The engine's compute stream.
        pub compute: StreamId,
        /// The production stream actor owning the copy stream.
        pub stream: StreamHandle,
        /// The blocks, in execution order.
        pub blocks: Vec<BlockSpec>,
    }

    impl Rig {
        /// `n` blocks, a compute stream (its creation starts the device thread), and a copy-stream actor (its
        /// thread, and with `options.watch_completions` a watcher thread).
        pub fn new(n: usize, options: StreamOptions, config: ModelConfig) -> Rig {
            let platform = std::sync::Arc::new(ModelPlatform::new(config));
            let p: PlatformRef = platform.clone();
            let mut blocks = Vec::new();
            for i in 0..n {
                let h = p.alloc_host(BLOCK_BYTES, HostMemoryKind::Pinned).expect("host master");
                p.write_host(h, 0, &Self::bytes_of(i)).expect("fill host master");
                blocks.push(BlockSpec {
                    segments: vec![Segment { host: h, host_offset: 0, len: BLOCK_BYTES, device_offset: 0 }],
                    reads: Vec::new(),
                    device_bytes: BLOCK_BYTES,
                });
            }
            let compute = p.create_stream("compute").expect("compute stream");
            let stream = StreamHandle::spawn(p, "copy", options).expect("stream actor");
            Rig { platform, compute, stream, blocks }
        }

        /// The platform as the scheduler sees it.
        pub fn platform_ref(&self) -> PlatformRef {
            self.platform.clone()
        }

        /// The bytes of block `i`.
        pub fn bytes_of(i: usize) -> Vec<u8> {
            vec![i as u8 + 1, 0xA0 | i as u8]
        }

        /// A stack spec over all blocks, its loads submitted through the stream actor.
        pub fn spec(&self, resident_head: usize, prefetch_depth: usize, fault: OrderingFault) -> StackSpec {
            StackSpec {
                name: "dit".into(),
                blocks: self.blocks.clone(),
                resident_head,
                prefetch_depth,
                static_slots: false,
                eager_prefetch: true,
                ordering_fault: fault,
                submission: Submission::Actor,
            }
        }

        /// Creates the production block-stack actor on this rig with a static schedule (`static_slots`: block `k` of
        /// the streamed ones always in slot `k mod slots`).
        pub fn static_stack(&self, prefetch_depth: usize, fault: OrderingFault) -> BlockStack {
            let spec = StackSpec { static_slots: true, ..self.spec(0, prefetch_depth, fault) };
            BlockStack::new(self.platform_ref(), spec, self.compute, self.stream.clone()).expect("enable the stack")
        }

        /// Creates the production block-stack actor on this rig.
        pub fn stack(&self, resident_head: usize, prefetch_depth: usize, fault: OrderingFault) -> BlockStack {
            self.stack_in(Submission::Actor, resident_head, prefetch_depth, fault)
        }

        /// Creates the production block-stack actor on this rig, its streamed loads submitted as `submission` says
        /// (with [`Submission::Hook`] the engine thread enqueues them and the stream actor only loads the resident
        /// head).
        pub fn stack_in(
            &self,
            submission: Submission,
            resident_head: usize,
            prefetch_depth: usize,
            fault: OrderingFault,
        ) -> BlockStack {
            let spec = StackSpec { submission, ..self.spec(resident_head, prefetch_depth, fault) };
            BlockStack::new(self.platform_ref(), spec, self.compute, self.stream.clone()).expect("enable the stack")
        }

        /// A stack whose every block is read from a file (the disk tier) through a reader with `staging` staging
        /// buffers; `broken`: the reader refills a buffer without waiting for the copies that read it (needs
        /// `--cfg weightferry_broken`). Returns the stack and its reader (shut it down before [`Rig::finish`]).
        pub fn disk_stack(&self, depth: usize, staging: usize, broken: bool) -> (BlockStack, ReaderHandle) {
            let bytes: Vec<u8> = (0..self.blocks.len()).flat_map(Self::bytes_of).collect();
            let file: std::sync::Arc<dyn BlockFile> = std::sync::Arc::new(MemFile(bytes));
            let blocks = (0..self.blocks.len())
                .map(|i| BlockSpec {
                    // The read fills the aligned window around its range; the bytes lie `offset % DIRECT_READ_ALIGN`
                    // into it, where the copy reads them.
                    segments: vec![Segment {
                        host: HostBufferId(u64::MAX),
                        host_offset: i as u64 * BLOCK_BYTES % DIRECT_READ_ALIGN,
                        len: BLOCK_BYTES,
                        device_offset: 0,
                    }],
                    reads: vec![FileRead {
                        file: file.clone(),
                        offset: i as u64 * BLOCK_BYTES,
                        len: BLOCK_BYTES,
                        staging_offset: i as u64 * BLOCK_BYTES % DIRECT_READ_ALIGN,
                    }],
                    device_bytes: BLOCK_BYTES,
                })
                .collect();
            let kind = HostMemoryKind::Pinned;
            let (p, s) = (self.platform_ref(), self.stream.clone());
            let reader = if broken {
                #[cfg(weightferry_broken)]
                {
                    ReaderHandle::spawn_without_staging_wait(p, "disk", s, staging, DIRECT_READ_ALIGN, kind)
                }
                #[cfg(not(weightferry_broken))]
                {
                    panic!("the broken reader needs --cfg weightferry_broken")
                }
            } else {
                ReaderHandle::spawn(p, "disk", s, staging, DIRECT_READ_ALIGN, kind)
            }
            .expect("reader");
            let spec = StackSpec { blocks, ..self.spec(0, depth, OrderingFault::None) };
            let stack = BlockStack::with_reader(
                self.platform_ref(),
                spec,
                None,
                self.compute,
                self.stream.clone(),
                reader.clone(),
            )
            .expect("enable the disk stack");
            (stack, reader)
        }

        /// One engine step for `block`: `pre_forward`, a compute kernel reading the block's bytes, `post_forward`.
        pub fn run_block(&self, stack: &BlockStack, block: usize) {
            let loc = stack.pre_forward(block).expect("pre_forward");
            self.platform.enqueue_kernel(self.compute, loc, Self::bytes_of(block), format!("block {block}"));
            stack.post_forward(block).expect("post_forward");
        }

        /// Stops the stream actor, waits for the device to run everything enqueued, and lets the device thread exit
        /// (every loom thread must finish).
        pub fn finish(&self) {
            self.stream.shutdown();
            self.platform.drain();
            self.platform.shutdown();
        }
    }

    /// A checkpoint file in memory, for the disk tier's models.
    #[derive(Debug)]
    struct MemFile(Vec<u8>);

    impl BlockFile for MemFile {
        fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
            let o = offset as usize;
            out.copy_from_slice(self.0.get(o..o + out.len()).ok_or("past the end of the file")?);
            Ok(())
        }
    }

    /// An operation a [`CommPlatform`] stream received, in enqueue order.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum CommOp {
        /// `stream_wait_event(event)`.
        Wait(u32),
        /// `record_event(event)`.
        Record(u32),
    }

    #[derive(Debug, Default)]
    struct CommState {
        next_id: u64,
        streams: Vec<Vec<CommOp>>,
        events: BTreeMap<u32, ()>,
        device: BTreeMap<u64, u64>,
        host: BTreeMap<u64, (Vec<u8>, HostMemoryKind)>,
    }

    /// A host-only platform for the collective models. It has **no device thread** (the collective models need
    /// every loom thread they can get: a rank's actor and its completion watcher are two), so nothing runs on a
    /// device: every stream operation is logged per stream and counts as completed when it is enqueued, and the
    /// synchronisation calls return at once. Device buffers are ids with a size; copies are refused. The order in
    /// which AllGathers are issued does not depend on when the device runs them, which is why this is enough for
    /// the collective order invariant.
    #[derive(Debug)]
    pub struct CommPlatform {
        state: Mutex<CommState>,
    }

    impl Default for CommPlatform {
        fn default() -> Self {
            CommPlatform::new()
        }
    }

    impl CommPlatform {
        /// A platform with no streams, events or buffers.
        pub fn new() -> CommPlatform {
            CommPlatform { state: Mutex::new(CommState::default()) }
        }

        /// The operations enqueued on `stream`, in enqueue order.
        pub fn stream_log(&self, stream: StreamId) -> Vec<CommOp> {
            lock(&self.state).streams.get(stream.0 as usize).cloned().unwrap_or_default()
        }

        fn id(st: &mut CommState) -> u64 {
            st.next_id += 1;
            st.next_id
        }

        fn push(&self, stream: StreamId, event: EventId, op: CommOp) -> PlatformResult<()> {
            let mut g = lock(&self.state);
            if !g.events.contains_key(&event.0) {
                return Err(PlatformError::InvalidHandle { what: "event", id: event.0 as u64 });
            }
            let log = g
                .streams
                .get_mut(stream.0 as usize)
                .ok_or(PlatformError::InvalidHandle { what: "stream", id: stream.0 as u64 })?;
            log.push(op);
            Ok(())
        }

        fn check_event(&self, event: EventId) -> PlatformResult<()> {
            if lock(&self.state).events.contains_key(&event.0) {
                Ok(())
            } else {
                Err(PlatformError::InvalidHandle { what: "event", id: event.0 as u64 })
            }
        }
    }

    impl Platform for CommPlatform {
        fn name(&self) -> &'static str {
            "loom-comm"
        }

        fn device_memory(&self) -> DeviceMemoryStats {
            let in_use = lock(&self.state).device.values().sum();
            DeviceMemoryStats { capacity: 1 << 20, in_use, peak: in_use }
        }

        fn reset_peak(&self) {}

        fn alloc_device(&self, bytes: u64) -> PlatformResult<DeviceBufferId> {
            let mut g = lock(&self.state);
            let id = Self::id(&mut g);
            g.device.insert(id, bytes);
            Ok(DeviceBufferId(id))
        }

        fn free_device(&self, buf: DeviceBufferId) -> PlatformResult<()> {
            let mut g = lock(&self.state);
            g.device.remove(&buf.0).map(|_| ()).ok_or(PlatformError::InvalidHandle { what: "device buffer", id: buf.0 })
        }

        fn device_buffer_len(&self, buf: DeviceBufferId) -> PlatformResult<u64> {
            let g = lock(&self.state);
            g.device.get(&buf.0).copied().ok_or(PlatformError::InvalidHandle { what: "device buffer", id: buf.0 })
        }

        fn alloc_host(&self, bytes: u64, kind: HostMemoryKind) -> PlatformResult<HostBufferId> {
            let mut g = lock(&self.state);
            let id = Self::id(&mut g);
            g.host.insert(id, (vec![0; bytes as usize], kind));
            Ok(HostBufferId(id))
        }

        fn free_host(&self, buf: HostBufferId) -> PlatformResult<()> {
            let mut g = lock(&self.state);
            g.host.remove(&buf.0).map(|_| ()).ok_or(PlatformError::InvalidHandle { what: "host buffer", id: buf.0 })
        }

        fn write_host(&self, buf: HostBufferId, offset: u64, data: &[u8]) -> PlatformResult<()> {
            let mut g = lock(&self.state);
            let hb =
                &mut g.host.get_mut(&buf.0).ok_or(PlatformError::InvalidHandle { what: "host buffer", id: buf.0 })?.0;
            let (o, size) = (offset as usize, hb.len() as u64);
            if offset + data.len() as u64 > size {
                return Err(PlatformError::OutOfBounds { what: "host", offset, len: data.len() as u64, size });
            }
            hb[o..o + data.len()].copy_from_slice(data);
            Ok(())
        }

        fn read_host(&self, buf: HostBufferId, offset: u64, out: &mut [u8]) -> PlatformResult<()> {
            let g = lock(&self.state);
            let hb = &g.host.get(&buf.0).ok_or(PlatformError::InvalidHandle { what: "host buffer", id: buf.0 })?.0;
            let (o, size) = (offset as usize, hb.len() as u64);
            if offset + out.len() as u64 > size {
                return Err(PlatformError::OutOfBounds { what: "host", offset, len: out.len() as u64, size });
            }
            out.copy_from_slice(&hb[o..o + out.len()]);
            Ok(())
        }

        fn host_buffer_info(&self, buf: HostBufferId) -> PlatformResult<(u64, HostMemoryKind)> {
            let g = lock(&self.state);
            g.host
                .get(&buf.0)
                .map(|(b, k)| (b.len() as u64, *k))
                .ok_or(PlatformError::InvalidHandle { what: "host buffer", id: buf.0 })
        }

        fn create_stream(&self, _name: &str) -> PlatformResult<StreamId> {
            let mut g = lock(&self.state);
            g.streams.push(Vec::new());
            Ok(StreamId(g.streams.len() as u32 - 1))
        }

        /// Nothing runs on this platform: a valid handle is accepted, and its log kept for the models' checks.
        fn destroy_stream(&self, stream: StreamId) -> PlatformResult<()> {
            let g = lock(&self.state);
            g.streams
                .get(stream.0 as usize)
                .map(|_| ())
                .ok_or(PlatformError::InvalidHandle { what: "stream", id: stream.0 as u64 })
        }

        fn create_event(&self) -> PlatformResult<EventId> {
            let mut g = lock(&self.state);
            let id = Self::id(&mut g) as u32;
            g.events.insert(id, ());
            Ok(EventId(id))
        }

        fn destroy_event(&self, event: EventId) -> PlatformResult<()> {
            let mut g = lock(&self.state);
            g.events.remove(&event.0).ok_or(PlatformError::InvalidHandle { what: "event", id: event.0 as u64 })
        }

        fn record_event(&self, event: EventId, stream: StreamId) -> PlatformResult<()> {
            self.push(stream, event, CommOp::Record(event.0))
        }

        fn stream_wait_event(&self, stream: StreamId, event: EventId) -> PlatformResult<()> {
            self.push(stream, event, CommOp::Wait(event.0))
        }

        fn event_query(&self, event: EventId) -> PlatformResult<bool> {
            self.check_event(event).map(|()| true)
        }

        fn event_synchronize(&self, event: EventId) -> PlatformResult<()> {
            self.check_event(event)
        }

        fn stream_synchronize(&self, stream: StreamId) -> PlatformResult<()> {
            if (stream.0 as usize) < lock(&self.state).streams.len() {
                Ok(())
            } else {
                Err(PlatformError::InvalidHandle { what: "stream", id: stream.0 as u64 })
            }
        }

        fn copy_h2d(
            &self,
            _stream: StreamId,
            _src: HostBufferId,
            _src_offset: u64,
            _dst: DeviceBufferId,
            _dst_offset: u64,
            len: u64,
        ) -> PlatformResult<()> {
            Err(PlatformError::CopyFailed {
                direction: "host-to-device",
                bytes: len,
                reason: "the loom comm platform has no copies".into(),
            })
        }

        fn copy_d2h(
            &self,
            _stream: StreamId,
            _src: DeviceBufferId,
            _src_offset: u64,
            _dst: HostBufferId,
            _dst_offset: u64,
            len: u64,
        ) -> PlatformResult<()> {
            Err(PlatformError::CopyFailed {
                direction: "device-to-host",
                bytes: len,
                reason: "the loom comm platform has no copies".into(),
            })
        }
    }

    /// A loom communicator: what each rank was asked to issue, checked on every call.
    ///
    /// Each rank's [`LoomCollective`] appends the tag of every `all_gather` call to its list (its issue order) and
    /// panics with `collective order violated` when the tag differs from the plan's tag at that position, or with
    /// `collective order diverged` when another rank already issued a different tag at that position, the way a
    /// real communicator would match (and here, with equal lengths, silently mis-gather) two different collectives.
    /// Nothing is enqueued and nothing blocks.
    #[derive(Debug)]
    pub struct CommGroup {
        plan: Option<Vec<u64>>,
        issued: Mutex<Vec<Vec<u64>>>,
    }

    impl CommGroup {
        /// A group of `world` ranks; with `plan`, the tags every rank must issue, in order.
        pub fn new(world: usize, plan: Option<Vec<u64>>) -> Arc<CommGroup> {
            Arc::new(CommGroup { plan, issued: Mutex::new(vec![Vec::new(); world]) })
        }

        /// Rank `rank`'s communicator in `group`.
        pub fn member(group: &Arc<CommGroup>, rank: usize) -> LoomCollective {
            let world = lock(&group.issued).len();
            LoomCollective { group: group.clone(), rank, world }
        }

        /// The tags each rank issued, in issue order, indexed by rank.
        pub fn issued(&self) -> Vec<Vec<u64>> {
            lock(&self.issued).clone()
        }

        fn record(&self, rank: usize, tag: u64) {
            let mut g = lock(&self.issued);
            let pos = g[rank].len();
            if let Some(&want) = self.plan.as_ref().and_then(|p| p.get(pos)) {
                assert!(
                    want == tag,
                    "collective order violated: rank {rank}'s AllGather #{pos} has tag {tag:#x}, the plan's #{pos} \
                     is {want:#x}"
                );
            }
            for (other, list) in g.iter().enumerate() {
                if let Some(&theirs) = list.get(pos) {
                    assert!(
                        theirs == tag,
                        "collective order diverged: AllGather #{pos} has tag {theirs:#x} on rank {other} and {tag:#x} \
                         on rank {rank}"
                    );
                }
            }
            g[rank].push(tag);
        }
    }

    /// One rank of a [`CommGroup`], handed to the production `CollectiveHandle` through its factory.
    #[derive(Debug)]
    pub struct LoomCollective {
        group: Arc<CommGroup>,
        rank: usize,
        world: usize,
    }

    impl Collective for LoomCollective {
        fn rank(&self) -> usize {
            self.rank
        }

        fn world(&self) -> usize {
            self.world
        }

        fn all_gather(
            &self,
            _stream: StreamId,
            _input: (DeviceBufferId, u64, u64),
            _output: (DeviceBufferId, u64),
            tag: u64,
        ) -> PlatformResult<()> {
            self.group.record(self.rank, tag);
            Ok(())
        }
    }

    /// Runs `f` under `loom::model`, with the preemption bound from `LOOM_MAX_PREEMPTIONS` (2 when unset).
    pub fn model<F>(f: F)
    where
        F: Fn() + Sync + Send + 'static,
    {
        let bound = loom::model::Builder::new().preemption_bound.unwrap_or(2);
        model_bounded(bound, f)
    }

    /// [`model`] with a preemption bound of at most `bound` (the smaller of it and `LOOM_MAX_PREEMPTIONS`): for a
    /// model with one more host thread (the disk tier's reader), whose executions at bound 2 take longer than CI has.
    pub fn model_bounded<F>(bound: usize, f: F)
    where
        F: Fn() + Sync + Send + 'static,
    {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(b.preemption_bound.map_or(bound, |set| set.min(bound)));
        let runs = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = runs.clone();
        let start = std::time::Instant::now();
        b.check(move || {
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            f()
        });
        eprintln!(
            "loom model: {} executions in {:.1} s (preemption bound {:?})",
            runs.load(std::sync::atomic::Ordering::Relaxed),
            start.elapsed().as_secs_f64(),
            b.preemption_bound
        );
    }
}
