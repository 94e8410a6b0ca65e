#![allow(missing_docs)]
//! Scheduler throughput: blocks per second through a block stack when copies and compute cost nothing, i.e. the
//! ceiling the scheduler itself puts on a pipeline. Also reports the same with a step cache skipping blocks.
//!
//! Run: `cargo bench --bench scheduler_throughput`

mod common;

use std::time::Instant;

fn main() {
    let blocks = 57;
    for (depth, head) in [(1usize, 0usize), (2, 0), (4, 0), (2, 20)] {
        let (_sim, _compute, stream, stack) = common::stack(blocks, 4096, head, depth);
        let passes = 400;
        let t = Instant::now();
        for _ in 0..passes {
            for i in 0..blocks {
                stack.pre_forward(i).expect("pre");
                stack.post_forward(i).expect("post");
            }
        }
        stack.fence().expect("fence");
        let dt = t.elapsed().as_secs_f64();
        let st = stack.stats();
        println!(
            "throughput depth={depth} resident={head}: {:.0} blocks/s ({:.2} µs/block, {} loads, {} host waits)",
            (passes * blocks) as f64 / dt,
            dt * 1e6 / (passes * blocks) as f64,
            st.loads,
            st.record_waits
        );
        stack.disable().expect("disable");
        stream.shutdown();
    }
    // With a step cache skipping every third block of odd passes.
    let (_sim, _c, stream, stack) = common::stack(blocks, 4096, 0, 2);
    let t = Instant::now();
    let mut run = 0u64;
    for pass in 0..400 {
        for i in 0..blocks {
            if pass % 2 == 1 && i % 3 == 0 {
                continue;
            }
            stack.pre_forward(i).expect("pre");
            stack.post_forward(i).expect("post");
            run += 1;
        }
    }
    stack.fence().expect("fence");
    let dt = t.elapsed().as_secs_f64();
    let st = stack.stats();
    println!(
        "throughput with skips depth=2: {:.0} blocks/s ({} sync fetches of {run} blocks)",
        run as f64 / dt,
        st.sync_fetches
    );
    stack.disable().expect("disable");
    stream.shutdown();
}
