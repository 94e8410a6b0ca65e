#![allow(missing_docs)]
//! Hook latency: wall time of `pre_forward` + `post_forward` for one streamed block, through the hook registry, on
//! the simulated platform with zero-cost copies (so the figure is the scheduler's own cost: slot bookkeeping, the
//! GPU-side wait and record, and the prefetch message to the stream actor).
//!
//! Two engine paces: back-to-back hooks (the engine does nothing between blocks, so any lag of the stream actor
//! shows up as a host wait inside `pre_forward`), and a realistic pace where the engine spends `work_us` per block
//! enqueueing its kernels between `pre_forward` and `post_forward` (timed separately, not counted in the hook cost).
//!
//! The null-platform rows compare the two submission modes: `actor` (the hook messages the stream actor, which
//! enqueues the copies) and `hook` (the hook enqueues them itself, see `Submission::Hook`).
//!
//! Run: `cargo bench --bench hook_latency` (`HOOK_LATENCY_NULL_ONLY=1` for the null-platform rows only)

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};
use weightferry::hooks::{HookFailure, HookRegistry, ModelHook, Residency};
use weightferry_actors::{BlockStack, Submission};

struct Hook {
    stack: Arc<BlockStack>,
    block: usize,
}
impl ModelHook for Hook {
    fn pre_forward(&self, _: &str) -> Result<Option<Residency>, HookFailure> {
        self.stack.pre_forward(self.block)?;
        Ok(None)
    }
    fn post_forward(&self, _: &str) -> Result<(), HookFailure> {
        Ok(self.stack.post_forward(self.block)?)
    }
}

fn main() {
    let blocks = 57;
    // The scheduler alone: a platform whose operations complete at once (no simulated device threads).
    // The engine's pace between pre_forward and post_forward: spinning (the host thread stays on its core) or
    // sleeping (the host thread blocks, as it does inside the driver when the GPU runs long blocks; then every
    // thread the hooks wake has been parked for that long too). Sleeping paces show the cost of waking parked
    // threads on this machine (on a VM, an inter-processor interrupt through the hypervisor).
    // Hook-submission rows (the engine thread enqueues the copies itself, no stream-actor thread is woken) at the
    // 50 µs spin and the 70 ms paces, beside the actor rows at the same paces, for an A/B on one machine.
    let (actor, hook) = (Submission::Actor, Submission::Hook);
    let paces: [(Submission, usize, u64, bool, usize); 9] = [
        (actor, 2, 0, false, 200),
        (actor, 2, 50, false, 200),
        (actor, 2, 500, true, 60),
        (actor, 2, 4_000, true, 21),
        (actor, 2, 70_000, false, 2),
        (actor, 2, 70_000, true, 2),
        (hook, 2, 50, false, 200),
        (hook, 2, 70_000, false, 2),
        (hook, 2, 70_000, true, 2),
    ];
    for (submission, depth, work_us, sleep, passes) in paces {
        let (stream, stack) = common::null_stack(blocks, depth, submission);
        let mut samples = Vec::new();
        let warm = (passes / 10).max(1);
        for pass in 0..passes {
            for i in 0..blocks {
                let t = Instant::now();
                stack.pre_forward(i).expect("pre");
                let pre = t.elapsed();
                if sleep {
                    std::thread::sleep(Duration::from_micros(work_us));
                } else {
                    let w = Instant::now();
                    while w.elapsed() < Duration::from_micros(work_us) {
                        std::hint::spin_loop();
                    }
                }
                let t = Instant::now();
                stack.post_forward(i).expect("post");
                if pass >= warm {
                    samples.push(pre + t.elapsed());
                }
            }
        }
        let (p50, p99, max) = common::percentiles(samples);
        let st = stack.stats();
        let how = if sleep { "sleeps" } else { "spins" };
        println!(
            "hook_latency null platform submission={} depth={depth} engine {how} {work_us} µs/block: pre+post p50 {:.2} µs, p99 {:.2} µs, max {:.1} µs ({} host waits)",
            submission.as_str(),
            p50.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6,
            max.as_secs_f64() * 1e6,
            st.record_waits
        );
        stack.disable().expect("disable");
        stream.shutdown();
    }
    if std::env::var_os("HOOK_LATENCY_NULL_ONLY").is_some() {
        return;
    }
    for (depth, work_us) in [(1usize, 0u64), (2, 0), (4, 0), (1, 50), (2, 50), (4, 50)] {
        let (sim, _compute, stream, stack) = common::stack(blocks, 4096, 0, depth);
        let reg = HookRegistry::new();
        let names: Vec<String> = (0..blocks).map(|i| format!("transformer.blocks.{i}")).collect();
        for (i, n) in names.iter().enumerate() {
            reg.register(
                n,
                "layerwise_offload",
                "layerwise_offload",
                Arc::new(Hook { stack: stack.clone(), block: i }),
            )
            .expect("register");
        }
        let mut samples: Vec<Duration> = Vec::new();
        for pass in 0..200 {
            for n in &names {
                let t = Instant::now();
                reg.pre_forward(n).expect("pre");
                let pre = t.elapsed();
                let w = Instant::now();
                while w.elapsed() < Duration::from_micros(work_us) {
                    std::hint::spin_loop();
                }
                let t = Instant::now();
                reg.post_forward(n).expect("post");
                if pass >= 20 {
                    samples.push(pre + t.elapsed());
                }
            }
        }
        let (p50, p99, max) = common::percentiles(samples);
        let st = stack.stats();
        println!(
            "hook_latency depth={depth} engine work {work_us} µs/block: pre+post p50 {:.2} µs, p99 {:.2} µs, max {:.1} µs ({} loads, {} prefetch hits, {} sync fetches, {} host waits)",
            p50.as_secs_f64() * 1e6,
            p99.as_secs_f64() * 1e6,
            max.as_secs_f64() * 1e6,
            st.loads,
            st.prefetch_hits,
            st.sync_fetches,
            st.record_waits
        );
        stack.disable().expect("disable");
        stream.shutdown();
        drop(sim);
    }
}
