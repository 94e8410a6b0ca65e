//! What `weightferry._core` does, without Python: a thin adapter over the library session
//! ([`weightferry::session`]). It parses the binding's string arguments (config format, device, sim faults),
//! encodes reports as JSON, and maps every [`SessionError`] onto the [`CoreError`] of the same kind, whose text is
//! what the CLI prints after `error: `. [`guarded`] turns a panic into [`CoreError::Internal`]. [`Session`] is one
//! offloaded pipeline driven by the Python package's torch hooks.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use weightferry::checkpoint::{Checkpoint, RowRange, View};
use weightferry::config::OffloadConfig;
use weightferry::offload::BackendReport;
use weightferry::pipeline::{PipelineDesc, StorageId};
use weightferry::plan::report::PlanReport;
use weightferry::scheduler::{DeviceBufferId, FaultPlan, HostBufferId, SimConfig};
use weightferry::session::{
    self, CheckpointSource, CollectiveSource, ConfigSource, CudaDevice, LaunchExchange, SessionError,
};

pub use weightferry::session::one_line;

/// A failure of an entry point; each variant is raised as the Python exception of the same name (`Internal` as
/// the base `weightferry.Error`). The message is the text the CLI prints after `error: `.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    /// A config that cannot be read, parsed or accepted: `invalid config: {key}: {message}`.
    #[error("{0}")]
    Config(String),
    /// An invalid pipeline description: `pipeline {name}: {message}`.
    #[error("{0}")]
    Pipeline(String),
    /// A valid config the pipeline cannot serve: `the config cannot be applied to {name}: {message}`.
    #[error("{0}")]
    Plan(String),
    /// The offload machinery failed, or was used out of order (enable, a hook, a device read, disable).
    #[error("{0}")]
    Offload(String),
    /// A device that cannot be used: unknown, absent, without CUDA support in this build, or not in torch's context.
    #[error("{0}")]
    Device(String),
    /// A checkpoint that cannot be read, or does not match the pipeline (the CLI's `--checkpoint` messages).
    #[error("{0}")]
    Checkpoint(String),
    /// A bug: a caught panic, or a report that cannot be encoded.
    #[error("{0}")]
    Internal(String),
}

impl From<SessionError> for CoreError {
    fn from(e: SessionError) -> Self {
        match e {
            SessionError::Config(m) => CoreError::Config(m),
            SessionError::Pipeline(m) => CoreError::Pipeline(m),
            SessionError::Plan(m) => CoreError::Plan(m),
            SessionError::Offload(m) => CoreError::Offload(m),
            SessionError::Device(m) => CoreError::Device(m),
            SessionError::Checkpoint(m) => CoreError::Checkpoint(m),
        }
    }
}

/// Runs `f`, turning a panic into [`CoreError::Internal`] naming the entry point `entry`.
pub fn guarded<T>(entry: &str, f: impl FnOnce() -> Result<T, CoreError>) -> Result<T, CoreError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_string());
        Err(CoreError::Internal(one_line(&format!(
            "internal error in weightferry._core.{entry}: {what}; this is a bug, please report it"
        ))))
    })
}

/// Reads a config: `config_format` `"json"` or `"toml"` (then `config` is the text) or `"file"` (then `config` is
/// the path of a `.json` / `.toml` file, read exactly as the CLI's `--config` reads it).
pub fn load_config(config: &str, config_format: &str) -> Result<OffloadConfig, CoreError> {
    let source = match config_format {
        "json" => ConfigSource::Json(config),
        "toml" => ConfigSource::Toml(config),
        "file" => ConfigSource::File(Path::new(config)),
        other => {
            return Err(CoreError::Config(format!(
                "unknown config format '{other}'; use \"json\", \"toml\" or \"file\" (a path to a .json or .toml file)"
            )))
        }
    };
    Ok(session::load_config(source)?)
}

/// Parses and validates a pipeline description in the JSON format; `name` is how errors name the pipeline.
pub fn load_pipeline(pipeline_json: &str, name: &str) -> Result<PipelineDesc, CoreError> {
    Ok(session::load_pipeline(pipeline_json, name)?)
}

fn encode_plan(report: &PlanReport) -> Result<String, CoreError> {
    serde_json::to_string(report).map_err(|e| CoreError::Internal(format!("cannot encode the plan report: {e}")))
}

/// Resolves the plan of `pipeline_json` under the config and encodes its report as JSON: the object
/// `weightferry plan --json` prints, with `name` as its `pipeline`.
pub fn plan_json(pipeline_json: &str, config: &str, config_format: &str, name: &str) -> Result<String, CoreError> {
    let desc = load_pipeline(pipeline_json, name)?;
    let config = load_config(config, config_format)?;
    let report = weightferry::offload::predict::plan_report(name, &desc, &config)
        .map_err(|e| CoreError::Plan(one_line(&format!("the config cannot be applied to {name}: {e}"))))?;
    encode_plan(&report)
}

/// The strategy a valid config selects (`none`, `model`, `layer`, `distributed_layer`).
pub fn config_strategy(config: &str, config_format: &str) -> Result<&'static str, CoreError> {
    load_config(config, config_format).map(|c| c.strategy.report_name())
}

/// A device named by the `device` argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceArg {
    /// `"sim"`: the simulated device (device buffers in host memory).
    Sim,
    /// `"cuda"` (ordinal 0 unless the caller resolved torch's current device) or `"cuda:N"`.
    Cuda(usize),
}

/// Parses the `device` argument: `"sim"`, `"cuda"` or `"cuda:N"`. `"cuda"` means `default_cuda` (the caller passes
/// torch's current device). A CUDA device in a build without the `cuda` feature is refused here, naming the fix.
pub fn parse_device(device: &str, default_cuda: usize) -> Result<DeviceArg, CoreError> {
    let spec = match device {
        "sim" => DeviceArg::Sim,
        "cuda" => DeviceArg::Cuda(default_cuda),
        _ => match device.strip_prefix("cuda:").and_then(|n| n.parse::<usize>().ok()) {
            Some(n) => DeviceArg::Cuda(n),
            None => {
                return Err(CoreError::Device(format!(
                    "unknown device \"{device}\"; use \"cuda\", \"cuda:N\" or \"sim\" (the simulated device)"
                )))
            }
        },
    };
    if matches!(spec, DeviceArg::Cuda(_)) && !cfg!(feature = "cuda") {
        return Err(CoreError::Device(format!(
            "device \"{device}\": this build of weightferry has no CUDA support (built without the `cuda` feature); \
             install it with `pip install ./python`, which enables it, or use device=\"sim\""
        )));
    }
    Ok(spec)
}

/// torch's side of a CUDA session: the stream the pipeline runs on and one device address torch allocated, for
/// the shared-context check. Ignored on the simulated device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TorchCuda {
    /// torch's current stream on the device (`torch.cuda.current_stream().cuda_stream`; 0 is the legacy default
    /// stream). The hooks order it behind the copies and record its reads on it.
    pub stream: u64,
    /// A device address of a live torch tensor on the device.
    pub probe_ptr: u64,
    /// The device's free memory in bytes as torch sees it after emptying its cache (`torch.cuda.mem_get_info`),
    /// for `device_budget = "auto"`; the simulated device uses its capacity instead.
    pub free_bytes: u64,
    /// The ordinal `device="cuda"` means (torch's current device).
    pub default_cuda: usize,
}

/// A component's views as the binding takes them: `name -> Some(row ranges) | None` (see
/// [`SessionOptions::checkpoint_views`]).
pub type ComponentViews = BTreeMap<String, Option<Vec<(String, u64, u64)>>>;
/// Every component's views.
pub type ViewMap = BTreeMap<String, ComponentViews>;

/// The checkpoint views of one component, in the library's type.
fn views_of(views: Option<&ComponentViews>) -> BTreeMap<String, View> {
    let row = |(source, start, end): &(String, u64, u64)| RowRange { source: source.clone(), start: *start, end: *end };
    let view = |v: &Option<Vec<(String, u64, u64)>>| match v {
        Some(rows) => View::Rows(rows.iter().map(row).collect()),
        None => View::Module,
    };
    views.into_iter().flatten().map(|(name, v)| (name.clone(), view(v))).collect()
}

/// The tensors of a checkpoint (a `.safetensors` or `.gguf` file, an index or a folder of shards) as its reader
/// sees them, checked: `(name, dtype, shape)` in name order (a GGUF file's quantized tensor is `uint8` of shape
/// `[..., row bytes]`, as diffusers' GGUF loader holds it).
pub fn checkpoint_tensors(path: &str) -> Result<Vec<(String, String, Vec<u64>)>, CoreError> {
    let checkpoint = Checkpoint::open(path).map_err(|e| CoreError::Checkpoint(e.to_string()))?;
    Ok(checkpoint.tensors().map(|(_, t)| (t.name.clone(), t.dtype.name().to_string(), t.shape.clone())).collect())
}

/// How a session is opened, beside its pipeline and config (the binding's `SessionOptions`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionOptions {
    /// `"json"`, `"toml"` or `"file"`, as for [`load_config`].
    pub config_format: String,
    /// How errors and the plan report name the pipeline (default `<python>`).
    pub name: Option<String>,
    /// `"sim"`, `"cuda"` (meaning `cuda:{torch.default_cuda}`) or `"cuda:N"`.
    pub device: String,
    /// Checkpoints to read components from: `(path, component)`, a safetensors file or sharded folder and the
    /// component it fills (the description's tensor `<component>.K` is the file's tensor `K`); every other storage
    /// is the caller's to write.
    pub checkpoints: Vec<(String, String)>,
    /// Per component, its tensors the checkpoint names otherwise: `name -> Some([(source, start, end), ...])` (rows
    /// of the file's tensors, concatenated) or `None` (the module holds it in a form the file does not give); see
    /// [`weightferry::checkpoint::View`].
    pub checkpoint_views: ViewMap,
    /// A distributed session: the port rank 0 listens on for weightferry's rendezvous instead of `MASTER_PORT`
    /// (which torch.distributed's own store holds once a process group exists; the package agrees on this port
    /// through that store).
    pub rendezvous_port: Option<u16>,
    /// torch's side of a CUDA session.
    pub torch: TorchCuda,
    /// Tests: a JSON fault plan for the simulated device (see [`parse_sim_faults`]).
    pub sim_faults: Option<String>,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            config_format: "json".into(),
            name: None,
            device: "sim".into(),
            checkpoints: Vec::new(),
            checkpoint_views: ViewMap::new(),
            rendezvous_port: None,
            torch: TorchCuda::default(),
            sim_faults: None,
        }
    }
}

/// Faults injected on the simulated device (tests of enable's undo and of a poisoned group).
#[derive(Debug, Clone, Default)]
pub struct SimFaults {
    /// The device's faults.
    pub plan: FaultPlan,
    /// A distributed session's AllGather call of this rank that fails at enqueue (0-based, every call counted).
    pub fail_all_gather: Option<u64>,
}

/// Parses a fault plan for the simulated device from JSON: an object with any of `oom_at_alloc`,
/// `fail_host_alloc`, `fail_h2d_copy`, `fail_h2d_copy_async`, `fail_event_sync`, `fail_d2h_copy`,
/// `fail_all_gather` (each the 0-based count of the call that fails).
pub fn parse_sim_faults(json: &str) -> Result<SimFaults, CoreError> {
    let bad = |m: String| CoreError::Offload(format!("sim faults: {m}"));
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| bad(e.to_string()))?;
    let obj = v.as_object().ok_or_else(|| bad("expected a JSON object".into()))?;
    let mut plan = FaultPlan::none();
    let mut fail_all_gather = None;
    for (k, v) in obj {
        let n = v.as_u64().ok_or_else(|| bad(format!("{k}: expected a count")))?;
        let slot = match k.as_str() {
            "fail_all_gather" => &mut fail_all_gather,
            "oom_at_alloc" => &mut plan.oom_at_alloc,
            "fail_host_alloc" => &mut plan.fail_host_alloc,
            "fail_h2d_copy" => &mut plan.fail_h2d_copy,
            "fail_h2d_copy_async" => &mut plan.fail_h2d_copy_async,
            "fail_event_sync" => &mut plan.fail_event_sync,
            "fail_d2h_copy" => &mut plan.fail_d2h_copy,
            other => return Err(bad(format!("unknown fault '{other}'"))),
        };
        *slot = Some(n);
    }
    Ok(SimFaults { plan, fail_all_gather })
}

/// Where a storage's device bytes are while a block runs: `(buffer, base, [(storage, offset in the block)])`.
pub type ResidencyParts = (u64, u64, Vec<(u64, u64)>);

/// One offloaded pipeline, driven by the Python package: the library session, and its plan report as JSON.
#[derive(Debug)]
pub struct Session {
    inner: session::Session,
    plan: String,
}

impl Session {
    /// Parses the arguments (device first, then the checkpoints and the sim faults), loads the pipeline and
    /// the config, and opens the library session (see [`session::Session::new`]): the plan resolved (errors as
    /// [`plan_json`]'s) before anything is allocated, the device opened (`options.torch` names torch's stream and
    /// memory on CUDA), a distributed session's collective built from the launch environment, and the host model
    /// zero-filled or read from the checkpoint.
    pub fn new(pipeline_json: &str, config: &str, options: &SessionOptions) -> Result<Session, CoreError> {
        let name = options.name.as_deref().unwrap_or("<python>");
        let torch = options.torch;
        let device = parse_device(&options.device, torch.default_cuda)?;
        let checkpoints = options
            .checkpoints
            .iter()
            .map(|(path, component)| CheckpointSource {
                path: path.into(),
                component: component.clone(),
                views: views_of(options.checkpoint_views.get(component)),
            })
            .collect();
        let faults = options.sim_faults.as_deref().map(parse_sim_faults).transpose()?.unwrap_or_default();
        let desc = load_pipeline(pipeline_json, name)?;
        let offload = load_config(config, &options.config_format)?;
        let device = match device {
            DeviceArg::Sim => {
                session::DeviceSpec::Sim(SimConfig { tracing: false, faults: faults.plan, ..SimConfig::default() })
            }
            // SAFETY: `torch.stream` is torch's current stream on this device (the Python package passes
            // `torch.cuda.current_stream(device).cuda_stream`), a stream of the primary context the session checks;
            // torch keeps its pool streams alive for the life of the process, and the package documents that an
            // external stream must outlive the handle.
            DeviceArg::Cuda(ordinal) => session::DeviceSpec::Cuda(unsafe {
                CudaDevice::adopting(ordinal, torch.stream, torch.probe_ptr, torch.free_bytes)
            }),
        };
        let launch = LaunchExchange {
            fingerprint: [pipeline_json.as_bytes(), b"\0", config.as_bytes()].concat(),
            rendezvous_port: options.rendezvous_port,
            fail_all_gather: faults.fail_all_gather,
        };
        let session_options = session::SessionOptions {
            name: name.to_string(),
            checkpoints,
            collective: CollectiveSource::Launch(launch),
            ..session::SessionOptions::default()
        };
        let inner = session::Session::new(desc, offload, device, session_options)?;
        let plan = encode_plan(inner.plan_report())?;
        Ok(Session { inner, plan })
    }

    /// The plan report as JSON (what [`plan_json`] returns for the same arguments).
    pub fn plan_json(&self) -> &str {
        &self.plan
    }

    /// `(tensor path, storage id)` of every tensor of the description, depth first (paths as `describe()` names
    /// them: dotted from the pipeline root).
    pub fn tensor_storages(&self) -> Vec<(String, u64)> {
        self.inner.tensor_storages().into_iter().map(|(p, s)| (p, s.0)).collect()
    }

    /// `(storage id, bytes, the module path of the unit streaming it or None for the fixed placement)` of every
    /// storage, in id order.
    pub fn storages(&self) -> Vec<(u64, u64, Option<String>)> {
        self.inner.storages().into_iter().map(|(s, len, unit)| (s.0, len, unit)).collect()
    }

    /// Storages not written yet, in id order (after opening from a checkpoint: its non-persistent buffers).
    pub fn unwritten(&self) -> Vec<u64> {
        self.inner.unwritten().into_iter().map(|s| s.0).collect()
    }

    /// Fills a storage's host bytes (exactly its size; only before `enable` or after `disable`).
    pub fn write_storage(&mut self, storage: u64, bytes: &[u8]) -> Result<(), CoreError> {
        Ok(self.inner.write_storage(StorageId(storage), bytes)?)
    }

    /// [`write_storage`](Self::write_storage) from `len` bytes at host address `address` (a CPU tensor's storage,
    /// read in place: the Python package makes no copy of its own).
    ///
    /// # Safety
    /// Unless `len` is 0, `address..address + len` must be readable host memory that stays alive and is not
    /// written during the call.
    pub unsafe fn write_storage_from(&mut self, storage: u64, address: u64, len: u64) -> Result<(), CoreError> {
        let len = usize::try_from(len).map_err(|_| CoreError::Offload(format!("storage {storage}: {len} bytes")))?;
        let bytes: &[u8] = if len == 0 {
            &[]
        } else {
            // SAFETY: the caller guarantees `len` readable bytes at `address` that live, unchanged, for this call.
            unsafe { std::slice::from_raw_parts(address as usize as *const u8, len) }
        };
        self.write_storage(storage, bytes)
    }

    /// Writes new bytes for storages, each read in place from `(storage, address, len)`: while enabled through to
    /// the host copy and every device copy (see [`session::Session::write_weights`]); every write is checked before
    /// any is applied.
    ///
    /// # Safety
    /// For each item with `len > 0`, `address..address + len` must be readable host memory that stays alive and is
    /// not written during the call.
    pub unsafe fn write_weights_from(&mut self, items: &[(u64, u64, u64)]) -> Result<(), CoreError> {
        // SAFETY: this function's contract is `in_place`'s.
        let writes = unsafe { in_place(items)? };
        Ok(self.inner.write_weights(&writes)?)
    }

    /// The storages of `items` (`(storage, address, len)`, each read in place) whose bytes differ from the
    /// session's (see [`session::Session::storages_differing`]), in the order of `items`.
    ///
    /// # Safety
    /// For each item with `len > 0`, `address..address + len` must be readable host memory that stays alive and is
    /// not written during the call.
    pub unsafe fn differing_from(&self, items: &[(u64, u64, u64)]) -> Result<Vec<u64>, CoreError> {
        // SAFETY: this function's contract is `in_place`'s.
        let given = unsafe { in_place(items)? };
        Ok(self.inner.storages_differing(&given)?.into_iter().map(|s| s.0).collect())
    }

    /// Offloads (see [`session::Session::enable`]); returns whether anything is offloaded.
    pub fn enable(&mut self) -> Result<bool, CoreError> {
        Ok(self.inner.enable()?)
    }

    /// Retunes the enabled backend to `config` (read as in [`load_config`]; `device_budget = "auto"` resolved from
    /// `free_bytes`, or the sim's capacity; see [`session::Session::retune`]). Returns the new plan report as JSON.
    /// `reserved_bytes`: device bytes outside the plan a byte-count budget must hold too.
    pub fn retune(
        &mut self,
        config: &str,
        config_format: &str,
        free_bytes: u64,
        reserved_bytes: u64,
    ) -> Result<String, CoreError> {
        let config = load_config(config, config_format)?;
        let plan = encode_plan(self.inner.retune(config, free_bytes, reserved_bytes)?)?;
        self.plan = plan.clone();
        Ok(plan)
    }

    /// Whether the backend is enabled.
    pub fn is_enabled(&self) -> bool {
        self.inner.is_enabled()
    }

    /// The unit paths of each stack with a static schedule, in execution order (see
    /// [`session::Session::static_stacks`]).
    pub fn static_stacks(&self) -> Vec<Vec<String>> {
        self.inner.static_stacks()
    }

    /// The modules that have offload hooks (dotted paths), sorted.
    pub fn hooked_modules(&self) -> Vec<String> {
        self.inner.hooked_modules()
    }

    /// Runs `module`'s pre-forward hooks (see [`session::Session::pre_forward`]). `None` for a module whose
    /// weights no hook places.
    ///
    /// The storages' offsets are listed only `with_offsets` (else empty): they change only at a retune, so a
    /// caller asks once per module and keeps them, and the per-forward call converts two integers.
    pub fn pre_forward(&self, module: &str, with_offsets: bool) -> Result<Option<ResidencyParts>, CoreError> {
        let residency = self.inner.pre_forward(module)?;
        Ok(residency.map(|r| {
            let mut offsets: Vec<(u64, u64)> = Vec::new();
            if with_offsets {
                offsets.extend(r.offsets.iter().map(|(s, &o)| (s.0, o)));
                offsets.sort_unstable();
            }
            (r.buffer.0, r.base, offsets)
        }))
    }

    /// Runs `module`'s post-forward hooks.
    pub fn post_forward(&self, module: &str) -> Result<(), CoreError> {
        Ok(self.inner.post_forward(module)?)
    }

    /// Device buffer and byte offset of a storage: always answers for the fixed placement, and for a streamed
    /// storage between its block's `pre_forward` and `post_forward`.
    pub fn locate(&self, storage: u64) -> Result<(u64, u64), CoreError> {
        let (buf, off) = self.inner.locate(StorageId(storage))?;
        Ok((buf.0, off))
    }

    /// Copies `len` bytes of simulated device memory out (the range is checked before anything is allocated).
    pub fn read_device(&self, buffer: u64, offset: u64, len: u64) -> Result<Vec<u8>, CoreError> {
        Ok(self.inner.read_device(DeviceBufferId(buffer), offset, len)?)
    }

    /// The device address and size of a CUDA device buffer (torch views it without a copy). Addresses stay valid
    /// until the buffer is freed: by `disable`, or by the backend when it drops a slot.
    pub fn device_ptr(&self, buffer: u64) -> Result<(u64, u64), CoreError> {
        Ok(self.inner.device_ptr(DeviceBufferId(buffer))?)
    }

    /// What a captured CUDA graph copies for static unit `module` (see [`session::Session::capture_copies`]).
    pub fn capture_copies(&self, module: &str) -> Result<weightferry::session::CaptureCopies, CoreError> {
        Ok(self.inner.capture_copies(module)?)
    }

    /// The address a CUDA device copy reads host buffer `buffer` at (page-locked memory only).
    pub fn host_address(&self, buffer: u64) -> Result<u64, CoreError> {
        Ok(self.inner.host_address(HostBufferId(buffer))?)
    }

    /// Copies `len` bytes of a simulated host buffer out.
    pub fn read_host(&self, buffer: u64, offset: u64, len: u64) -> Result<Vec<u8>, CoreError> {
        Ok(self.inner.read_host(HostBufferId(buffer), offset, len)?)
    }

    /// Writes `data` into simulated device memory.
    pub fn write_device(&self, buffer: u64, offset: u64, data: &[u8]) -> Result<(), CoreError> {
        Ok(self.inner.write_device(DeviceBufferId(buffer), offset, data)?)
    }

    /// Blocks until every load issued so far and every released slot's last use have completed.
    pub fn fence(&self) -> Result<(), CoreError> {
        Ok(self.inner.fence()?)
    }

    /// Whether the session drives a CUDA device.
    pub fn is_cuda(&self) -> bool {
        self.inner.is_cuda()
    }

    /// Waits for the device, frees it, removes the hooks and gives every storage its own host buffer back
    /// (bit-identical). A no-op when not enabled; an incomplete disable can be called again.
    pub fn disable(&mut self) -> Result<(), CoreError> {
        Ok(self.inner.disable()?)
    }

    /// A storage's host bytes, read through its current home.
    pub fn read_storage(&self, storage: u64) -> Result<Vec<u8>, CoreError> {
        Ok(self.inner.read_storage(StorageId(storage))?)
    }

    /// The simulated device's recorded ordering violations (debug text each); empty when every order held.
    pub fn hazard_violations(&self) -> Vec<String> {
        self.inner.hazard_violations()
    }

    /// The backend's report as JSON (`strategy` `"none"` and nothing else when the config disables offload).
    pub fn report_json(&self) -> Result<String, CoreError> {
        let report: BackendReport = self.inner.report();
        serde_json::to_string(&report).map_err(|e| CoreError::Internal(format!("cannot encode the report: {e}")))
    }
}

/// `(storage, address, len)` items as `(storage, the bytes there)`, read in place.
///
/// # Safety
/// For each item with `len > 0`, `address..address + len` must be readable host memory that stays alive and is not
/// written while the result lives.
unsafe fn in_place<'a>(items: &[(u64, u64, u64)]) -> Result<Vec<(StorageId, &'a [u8])>, CoreError> {
    let mut out = Vec::with_capacity(items.len());
    for &(storage, address, len) in items {
        let n = usize::try_from(len).map_err(|_| CoreError::Offload(format!("storage {storage}: {len} bytes")))?;
        if address == 0 && n > 0 {
            return Err(CoreError::Offload(format!("storage {storage}: null address for {len} bytes")));
        }
        let bytes: &[u8] = if n == 0 {
            &[]
        } else {
            // SAFETY: the caller guarantees `len` readable bytes at `address` that live, unchanged, while used.
            unsafe { std::slice::from_raw_parts(address as usize as *const u8, n) }
        };
        out.push((StorageId(storage), bytes));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use weightferry::pipeline::json::load_pipeline_json;

    const PIPELINE: &str = r#"{"class": "P", "modules": {"transformer": {"class": "D", "children": {
        "blocks": {"repeat": 2, "block": {"class": "B", "tensors": {"w": {"dtype": "bf16", "shape": [128]}}}}}}},
        "components": {"dit": ["transformer"]}, "class_block_attrs": {"D": ["blocks"]}}"#;

    #[test]
    fn plan_json_is_the_report() {
        let config = r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#;
        let text = plan_json(PIPELINE, config, "json", "p").unwrap();
        let desc = load_pipeline_json(PIPELINE).unwrap();
        let report =
            weightferry::offload::predict::plan_report("p", &desc, &OffloadConfig::from_json_str(config).unwrap())
                .unwrap();
        assert_eq!(text, serde_json::to_string(&report).unwrap());
        assert_eq!(report.strategy, "layer");
        assert_eq!(report.total_weight_bytes, 512);
    }

    #[test]
    fn errors_carry_the_cli_prefixes() {
        assert_eq!(
            config_strategy(r#"{"diffusion_offload_config": {"mdoe": "layer"}}"#, "json"),
            Err(CoreError::Config(one_line(&format!(
                "invalid config: {}",
                OffloadConfig::from_json_str(r#"{"diffusion_offload_config": {"mdoe": "layer"}}"#).unwrap_err()
            ))))
        );
        let Err(CoreError::Pipeline(m)) = load_pipeline("{}", "p") else { panic!("expected a pipeline error") };
        assert!(m.starts_with("pipeline p: class: required key is missing;"), "{m}");
        let dit_only_missing = r#"{"diffusion_offload_config": {"mode": "layer", "components": ["text_encoder"]}}"#;
        let Err(CoreError::Plan(m)) = plan_json(PIPELINE, dit_only_missing, "json", "p") else {
            panic!("expected a plan error")
        };
        assert!(m.starts_with("the config cannot be applied to p: "), "{m}");
        assert_eq!(
            config_strategy("x", "yaml"),
            Err(CoreError::Config(
                "unknown config format 'yaml'; use \"json\", \"toml\" or \"file\" (a path to a .json or .toml file)"
                    .into()
            ))
        );
    }

    #[test]
    fn toml_and_json_configs_agree() {
        let toml = "[diffusion_offload_config]\nmode = \"module\"\ncomponents = [\"dit\"]\n";
        assert_eq!(config_strategy(toml, "toml"), Ok("model"));
        assert_eq!(config_strategy("{}", "json"), Ok("none"));
    }

    /// Options naming the pipeline `p`, on the simulated device.
    fn named() -> SessionOptions {
        SessionOptions { name: Some("p".into()), ..SessionOptions::default() }
    }

    /// A session on [`PIPELINE`] on the simulated device, its storages still zero.
    fn sim_session(config: &str) -> Session {
        Session::new(PIPELINE, config, &named()).unwrap()
    }

    /// A session on [`PIPELINE`] whose every storage holds `id + 1` in every byte.
    fn session(config: &str) -> Session {
        let mut s = sim_session(config);
        for (id, len, _) in s.storages() {
            s.write_storage(id, &vec![id as u8 + 1; len as usize]).unwrap();
        }
        s
    }

    #[test]
    fn a_session_streams_each_block_and_restores_the_bytes() {
        let config = r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"],
            "layer_options": {"dit": {"prefetch_depth": 1}}}}"#;
        let mut s = session(config);
        assert_eq!(
            s.tensor_storages(),
            [("transformer.blocks.0.w".to_string(), 0), ("transformer.blocks.1.w".into(), 1)]
        );
        let blocks = ["transformer.blocks.0", "transformer.blocks.1"];
        assert_eq!(s.storages(), [(0, 256, Some(blocks[0].to_string())), (1, 256, Some(blocks[1].to_string()))]);
        assert_eq!(s.plan_json(), plan_json(PIPELINE, config, "json", "p").unwrap());
        assert_eq!(s.enable(), Ok(true));
        assert_eq!(s.hooked_modules(), blocks);
        for _step in 0..2 {
            for (i, block) in blocks.iter().enumerate() {
                let (buf, base, offsets) = s.pre_forward(block, true).unwrap().unwrap();
                assert_eq!(offsets, [(i as u64, 0)]);
                s.post_forward(block).unwrap();
                let (again, at, none) = s.pre_forward(block, false).unwrap().unwrap();
                assert_eq!((again, at, none), (buf, base, vec![]));
                assert_eq!(s.read_device(buf, base, 256).unwrap(), vec![i as u8 + 1; 256]);
                assert_eq!(s.locate(i as u64), Ok((buf, base)));
                s.post_forward(block).unwrap();
            }
        }
        assert_eq!(s.pre_forward("transformer", true).unwrap(), None);
        assert_eq!(s.hazard_violations(), Vec::<String>::new());
        let report: serde_json::Value = serde_json::from_str(&s.report_json().unwrap()).unwrap();
        assert_eq!((report["strategy"].as_str(), report["enabled"].as_bool()), (Some("layer"), Some(true)));
        let Err(CoreError::Offload(m)) = s.write_storage(0, &[0; 256]) else {
            panic!("a mastered storage was written")
        };
        assert_eq!(m, "storage 0 is master, not loaded");
        s.disable().unwrap();
        assert!(s.hooked_modules().is_empty());
        assert_eq!(s.read_storage(1).unwrap(), vec![2; 256]);
        let Err(CoreError::Offload(m)) = s.locate(0) else { panic!("located after disable") };
        assert_eq!(m, "storage 0 is not on the device: offload is not enabled");
    }

    #[test]
    fn a_session_refuses_bad_input_before_anything_moves() {
        let layer = r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#;
        let mut s = sim_session(layer);
        s.write_storage(0, &[1; 256]).unwrap();
        assert_eq!(
            s.enable(),
            Err(CoreError::Offload("storage 1 was never written; write every storage's bytes before enable".into()))
        );
        assert_eq!(
            s.write_storage(1, &[1; 3]),
            Err(CoreError::Offload("storage 1 holds 256 bytes, but 3 bytes were given for it".into()))
        );
        assert!(!s.is_enabled());
        let Err(CoreError::Config(_)) = Session::new(PIPELINE, r#"{"x": 1}"#, &named()) else {
            panic!("a bad config was accepted")
        };
        assert_eq!(
            parse_device("cuda:3", 0).map_err(|_| ()),
            if cfg!(feature = "cuda") { Ok(DeviceArg::Cuda(3)) } else { Err(()) }
        );
        assert_eq!(parse_device("sim", 5), Ok(DeviceArg::Sim));
        for bad in ["tpu", "cuda:", "cuda:-1", "cuda:x", "Sim"] {
            assert_eq!(
                parse_device(bad, 0),
                Err(CoreError::Device(format!(
                    "unknown device \"{bad}\"; use \"cuda\", \"cuda:N\" or \"sim\" (the simulated device)"
                )))
            );
        }
        #[cfg(not(feature = "cuda"))]
        assert_eq!(
            parse_device("cuda", 0),
            Err(CoreError::Device(
                "device \"cuda\": this build of weightferry has no CUDA support (built without the `cuda` feature); \
                 install it with `pip install ./python`, which enables it, or use device=\"sim\""
                    .into()
            ))
        );
        // A config that disables offload: nothing to enable, nothing on the device.
        let mut s = session("{}");
        assert_eq!(s.enable(), Ok(false));
        assert!(s.hooked_modules().is_empty());
        assert_eq!(
            s.report_json().unwrap(),
            serde_json::to_string(&BackendReport { strategy: "none".into(), ..Default::default() }).unwrap()
        );
    }

    #[test]
    fn a_panic_becomes_an_internal_error() {
        let r: Result<(), CoreError> = guarded("probe", || panic!("boom\n  here"));
        assert_eq!(
            r,
            Err(CoreError::Internal(
                "internal error in weightferry._core.probe: boom here; this is a bug, please report it".into()
            ))
        );
        let r: Result<(), CoreError> = guarded("probe", || std::panic::panic_any(7_u8));
        assert_eq!(
            r,
            Err(CoreError::Internal(
                "internal error in weightferry._core.probe: a panic without a message; this is a bug, please report it"
                    .into()
            ))
        );
    }
}
