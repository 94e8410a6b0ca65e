//! Timeline traces: turns the sim platform's execution trace (copies, kernels, stream waits) and the engine's hook
//! spans into a Chrome / Perfetto trace (`{"traceEvents": [...]}` with complete `"ph": "X"` events), so a user can
//! see whether copies hide behind compute.
//!
//! Layout: one process (`pid` 1); one thread per device stream, in order of first appearance (the compute stream
//! first when it appears), named after the stream; the engine's hook calls on a thread of their own (`tid` 0,
//! "host engine (hooks)"). Times are microseconds since the platform was created. A copy whose host buffer is a
//! master is named by the unit it loads (`h2d transformer.transformer_blocks.7`, or a component for model-level
//! units), its platform label kept in `args.copy`; other copies keep the platform's label.

use crate::engine::{HookKind, HookSpan};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;
use weightferry::scheduler::{HostBufferId, TraceEvent, TraceKind};

/// The raw material of a trace: device ops and hook calls on one time base.
#[derive(Debug, Clone, Default)]
pub struct RunTrace {
    /// Executed device ops.
    pub events: Vec<TraceEvent>,
    /// Hook calls of the engine thread.
    pub hooks: Vec<HookSpan>,
    /// The unit (module path) each host master held, from the backend's `master_units`: names copies.
    pub copy_names: HashMap<HostBufferId, String>,
}

/// Errors writing a trace.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be written.
    #[error("cannot write trace file `{path}`: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

fn category(kind: TraceKind) -> &'static str {
    match kind {
        TraceKind::H2d => "h2d",
        TraceKind::D2h => "d2h",
        TraceKind::Kernel => "kernel",
        TraceKind::Wait => "wait",
    }
}

fn thread_name(tid: usize, name: &str) -> Value {
    json!({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}})
}

impl RunTrace {
    /// The Chrome trace JSON object.
    pub fn to_chrome_json(&self) -> Value {
        let mut streams: Vec<String> = Vec::new();
        for e in &self.events {
            if !streams.contains(&e.stream_name) {
                streams.push(e.stream_name.clone());
            }
        }
        if let Some(i) = streams.iter().position(|s| s == "compute") {
            let c = streams.remove(i);
            streams.insert(0, c);
        }
        let mut out = vec![
            json!({"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "weightferry"}}),
            thread_name(0, "host engine (hooks)"),
        ];
        for (i, s) in streams.iter().enumerate() {
            out.push(thread_name(i + 1, &format!("stream {s}")));
        }
        for e in &self.events {
            let tid = streams.iter().position(|s| *s == e.stream_name).map_or(0, |i| i + 1);
            let mut args = json!({"bytes": e.bytes, "stream": e.stream_name});
            let name = match (e.kind, e.host_buffer.and_then(|b| self.copy_names.get(&b))) {
                (TraceKind::H2d | TraceKind::D2h, Some(unit)) => {
                    args["unit"] = json!(unit);
                    args["copy"] = json!(e.label);
                    format!("{} {unit}", category(e.kind))
                }
                _ => e.label.clone(),
            };
            out.push(json!({
                "name": name,
                "cat": category(e.kind),
                "ph": "X",
                "ts": e.start.as_secs_f64() * 1e6,
                "dur": e.duration.as_secs_f64() * 1e6,
                "pid": 1,
                "tid": tid,
                "args": args,
            }));
        }
        for h in &self.hooks {
            let kind = match h.kind {
                HookKind::Pre => "pre_forward",
                HookKind::Post => "post_forward",
            };
            out.push(json!({
                "name": format!("{kind} {}", h.module),
                "cat": "hook",
                "ph": "X",
                "ts": h.start.as_secs_f64() * 1e6,
                "dur": h.duration.as_secs_f64() * 1e6,
                "pid": 1,
                "tid": 0,
                "args": {"module": h.module},
            }));
        }
        json!({"traceEvents": out, "displayTimeUnit": "ms"})
    }

    /// Writes the Chrome trace JSON to `path`.
    pub fn write_chrome(&self, path: &Path) -> Result<(), TraceError> {
        let text = self.to_chrome_json().to_string();
        std::fs::write(path, text).map_err(|source| TraceError::Io { path: path.display().to_string(), source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn streams_get_their_own_threads_and_hooks_thread_zero() {
        let ev = |stream: &str, kind, label: &str, start_us: u64, host: Option<u64>| TraceEvent {
            stream_name: stream.into(),
            kind,
            label: label.into(),
            start: Duration::from_micros(start_us),
            duration: Duration::from_micros(5),
            bytes: 7,
            host_buffer: host.map(HostBufferId),
        };
        let t = RunTrace {
            events: vec![
                ev("copy", TraceKind::H2d, "load", 1, Some(3)),
                ev("compute", TraceKind::Kernel, "blk", 10, None),
                ev("copy", TraceKind::H2d, "h2d #2 host 9+0", 11, Some(9)),
                ev("copy", TraceKind::D2h, "d2h dev 1", 12, Some(3)),
            ],
            hooks: vec![HookSpan {
                module: "m".into(),
                kind: HookKind::Pre,
                start: Duration::from_micros(2),
                duration: Duration::from_micros(1),
            }],
            copy_names: [(HostBufferId(3), "transformer.transformer_blocks.7".to_string())].into(),
        };
        let v = t.to_chrome_json();
        let evs = v["traceEvents"].as_array().unwrap();
        let x: Vec<&Value> = evs.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(x.len(), 5);
        assert_eq!(x[0]["tid"], 2); // copy is the second stream, compute first
        assert_eq!(x[0]["cat"], "h2d");
        assert_eq!(x[0]["ts"], 1.0);
        assert_eq!(x[1]["tid"], 1);
        assert_eq!(x[4]["tid"], 0);
        assert_eq!(x[4]["name"], "pre_forward m");
        // Copies of a master are named by its unit; others keep the platform's label.
        let names: Vec<&str> = x[..4].iter().map(|e| e["name"].as_str().unwrap()).collect();
        let want =
            ["h2d transformer.transformer_blocks.7", "blk", "h2d #2 host 9+0", "d2h transformer.transformer_blocks.7"];
        assert_eq!(names, want);
        assert_eq!(
            x[0]["args"],
            json!({"bytes": 7, "stream": "copy", "unit": "transformer.transformer_blocks.7", "copy": "load"})
        );
        assert_eq!(x[2]["args"], json!({"bytes": 7, "stream": "copy"}));
        let names: Vec<&str> =
            evs.iter().filter(|e| e["ph"] == "M").map(|e| e["args"]["name"].as_str().unwrap()).collect();
        assert_eq!(names, vec!["weightferry", "host engine (hooks)", "stream compute", "stream copy"]);
    }
}
