//! What `weightferry._core` does, without Python: loads a config (JSON or TOML text, or a file read exactly as the
//! CLI's `--config`), loads a pipeline description (the JSON format), resolves the plan report, and maps every
//! failure onto [`CoreError`] with the text the CLI prints after `error: `. [`guarded`] turns a panic into
//! [`CoreError::Internal`]. [`Session`] is one offloaded pipeline on the simulated device: host model, backend,
//! hook registry and compute stream, driven by the Python package's torch hooks.

use std::collections::{BTreeMap, BTreeSet};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::Arc;
use weightferry::config::OffloadConfig;
use weightferry::hooks::HookRegistry;
use weightferry::model::HostModel;
use weightferry::offload::units::build_unit_plan;
use weightferry::offload::{get_offload_backend, BackendReport, StreamingBackend, WeightSource};
use weightferry::pipeline::json::load_pipeline_json;
use weightferry::pipeline::{PipelineDesc, StorageId};
use weightferry::plan::report::PlanReport;
use weightferry::plan::resolve_offload_plan;
use weightferry_actors::collective::Collective;
use weightferry_actors::collective_actor::CollectiveFactory;
use weightferry_actors::platform::{DeviceBufferId, Platform, PlatformRef, StreamId};
use weightferry_actors::sim::{SimConfig, SimPlatform};

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

/// Collapses a message onto one line, as the CLI does before printing it.
pub fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
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
    let parsed = match config_format {
        "json" => OffloadConfig::from_json_str(config),
        "toml" => OffloadConfig::from_toml_str(config),
        "file" => OffloadConfig::from_path(Path::new(config)),
        other => {
            return Err(CoreError::Config(format!(
                "unknown config format '{other}'; use \"json\", \"toml\" or \"file\" (a path to a .json or .toml file)"
            )))
        }
    };
    parsed.map_err(|e| CoreError::Config(one_line(&format!("invalid config: {e}"))))
}

/// Parses and validates a pipeline description in the JSON format; `name` is how errors name the pipeline.
pub fn load_pipeline(pipeline_json: &str, name: &str) -> Result<PipelineDesc, CoreError> {
    load_pipeline_json(pipeline_json).map_err(|e| CoreError::Pipeline(one_line(&format!("pipeline {name}: {e}"))))
}

/// Resolves the plan of `pipeline_json` under the config and encodes its report as JSON: the object
/// `weightferry plan --json` prints, with `name` as its `pipeline`.
pub fn plan_json(pipeline_json: &str, config: &str, config_format: &str, name: &str) -> Result<String, CoreError> {
    let desc = load_pipeline(pipeline_json, name)?;
    let config = load_config(config, config_format)?;
    let report = PlanReport::resolve(name, &desc, &config)
        .map_err(|e| CoreError::Plan(one_line(&format!("the config cannot be applied to {name}: {e}"))))?;
    serde_json::to_string(&report).map_err(|e| CoreError::Internal(format!("cannot encode the plan report: {e}")))
}

/// The strategy a valid config selects (`none`, `model`, `layer`, `distributed_layer`).
pub fn config_strategy(config: &str, config_format: &str) -> Result<&'static str, CoreError> {
    load_config(config, config_format).map(|c| c.strategy.report_name())
}

/// A device a session can offload to, parsed from the `device` argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    /// `"sim"`: the simulated device (device buffers in host memory).
    Sim,
    /// `"cuda"` (ordinal 0 unless the caller resolved torch's current device) or `"cuda:N"`.
    Cuda(usize),
}

/// Parses the `device` argument: `"sim"`, `"cuda"` or `"cuda:N"`. `"cuda"` means `default_cuda` (the caller passes
/// torch's current device). A CUDA device in a build without the `cuda` feature is refused here, naming the fix.
pub fn parse_device(device: &str, default_cuda: usize) -> Result<DeviceSpec, CoreError> {
    let spec = match device {
        "sim" => DeviceSpec::Sim,
        "cuda" => DeviceSpec::Cuda(default_cuda),
        _ => match device.strip_prefix("cuda:").and_then(|n| n.parse::<usize>().ok()) {
            Some(n) => DeviceSpec::Cuda(n),
            None => {
                return Err(CoreError::Device(format!(
                    "unknown device \"{device}\"; use \"cuda\", \"cuda:N\" or \"sim\" (the simulated device)"
                )))
            }
        },
    };
    if matches!(spec, DeviceSpec::Cuda(_)) && !cfg!(feature = "cuda") {
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
}

/// What else a session is built with: a checkpoint to read the weights from, and (tests) faults to inject on the
/// simulated device.
#[derive(Debug, Clone, Default)]
pub struct SessionOptions<'a> {
    /// `(path, component)`: the description's tensor `<component>.K` is the file's tensor `K`.
    pub checkpoint: Option<(&'a str, &'a str)>,
    /// Faults the simulated device injects (ignored on CUDA): each fires once, at a counted call.
    pub sim_faults: SimFaults,
    /// A distributed session: the port rank 0 listens on for weightferry's rendezvous instead of `MASTER_PORT`
    /// (which torch.distributed's own store holds once a process group exists; the package agrees on this port
    /// through that store).
    pub rendezvous_port: Option<u16>,
}

/// Faults injected on the simulated device (tests of enable's undo and of a poisoned group).
#[derive(Debug, Clone, Default)]
pub struct SimFaults {
    /// The device's faults.
    pub plan: weightferry_actors::sim::FaultPlan,
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
    let mut plan = weightferry_actors::sim::FaultPlan::none();
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

/// The collective of a distributed session, or `None` when the config gathers nothing across ranks: the config's
/// offload group must be the launch's world (`WORLD_SIZE`, as torchrun sets it); the ranks meet through
/// weightferry's rendezvous (`MASTER_ADDR`, and `MASTER_PORT` or `rendezvous_port`), each checking that every rank
/// runs the same pipeline and config. On the simulated device the AllGathers run over that rendezvous
/// ([`TcpCollective`]); on CUDA NCCL runs them, bootstrapped through it.
fn session_collective(
    config: &OffloadConfig,
    device: &Device,
    fingerprint: &[u8],
    fail_all_gather: Option<u64>,
    rendezvous_port: Option<u16>,
) -> Result<Option<CollectiveFactory>, CoreError> {
    use weightferry::config::Component;
    use weightferry::dist::rendezvous::{Fingerprint, Rendezvous, RendezvousOptions};
    use weightferry::dist::tcp_collective::TcpCollective;
    use weightferry::dist::LaunchEnv;
    let gathers = Component::ALL.iter().any(|&c| config.uses_allgather(c));
    if !gathers || config.group.size <= 1 {
        return Ok(None);
    }
    let group = config.group.size as usize;
    let env = LaunchEnv::from_env().map_err(|e| CoreError::Offload(one_line(&e.to_string())))?;
    if env.world != group {
        return Err(CoreError::Offload(format!(
            "the config gathers weights across an offload group of {group} ranks, but this process is rank {} of \
             WORLD_SIZE={}; start {group} processes (torchrun --nproc-per-node {group}) or change the config's \
             parallel sizes",
            env.rank, env.world
        )));
    }
    let mut env = env;
    if let Some(port) = rendezvous_port {
        env.master_port = Some(port);
    }
    #[cfg(all(feature = "cuda", not(feature = "nccl")))]
    if let Device::Cuda(_) = device {
        return Err(CoreError::Offload(
            "distributed offload (weight_transfer = \"allgather\") on CUDA needs a build of weightferry with NCCL \
             (feature `nccl`); use device=\"sim\" or rank-local transfer"
                .into(),
        ));
    }
    let options = RendezvousOptions { fingerprint: Fingerprint::of(fingerprint), ..RendezvousOptions::default() };
    let rdv = Arc::new(
        Rendezvous::connect(&env, options)
            .map_err(|e| CoreError::Offload(one_line(&format!("rank {}: {e}", env.rank))))?,
    );
    let all = rdv.all_gather_bytes(fingerprint).map_err(|e| CoreError::Offload(one_line(&e.to_string())))?;
    if let Some(r) = all.iter().position(|f| f.as_slice() != fingerprint) {
        return Err(CoreError::Offload(format!(
            "rank {r} enables another pipeline or config than rank {}; every rank must enable the same model with \
             the same config",
            env.rank
        )));
    }
    match device {
        Device::Sim(sim) => {
            let collective = TcpCollective::new(rdv, sim.clone());
            if let Some(n) = fail_all_gather {
                collective.fail_nth_call(n);
            }
            Ok(Some(Box::new(move || Ok(Box::new(collective) as Box<dyn Collective>))))
        }
        #[cfg(feature = "nccl")]
        Device::Cuda(cuda) => {
            // NCCL: rank 0's unique id (and the AllGather engine every rank can run) go through the rendezvous.
            let boot = weightferry::dist::bootstrap_nccl(
                cuda,
                env.rank,
                env.world,
                weightferry::dist::allgather_engine::AllGatherEngine::Auto,
                rdv.as_ref(),
            )
            .map_err(|e| CoreError::Offload(one_line(&format!("rank {}: NCCL bootstrap: {e}", env.rank))))?;
            Ok(Some(boot.factory))
        }
        #[cfg(all(feature = "cuda", not(feature = "nccl")))]
        Device::Cuda(_) => Ok(None),
    }
}

/// The platform a session drives.
enum Device {
    Sim(Arc<SimPlatform>),
    #[cfg(feature = "cuda")]
    Cuda(Arc<weightferry::platform::cuda::CudaPlatform>),
}

impl Device {
    /// Opens the device and names the compute stream: the simulated device's own, or torch's stream adopted.
    fn open(
        spec: DeviceSpec,
        torch: TorchCuda,
        faults: weightferry_actors::sim::FaultPlan,
    ) -> Result<(Device, PlatformRef, StreamId), CoreError> {
        match spec {
            DeviceSpec::Sim => {
                let sim = Arc::new(
                    SimPlatform::new(SimConfig { tracing: false, faults, ..SimConfig::default() })
                        .map_err(offload_err)?,
                );
                let platform: PlatformRef = sim.clone();
                let compute = platform.create_stream("compute").map_err(offload_err)?;
                Ok((Device::Sim(sim), platform, compute))
            }
            #[cfg(feature = "cuda")]
            DeviceSpec::Cuda(ordinal) => {
                use weightferry::platform::cuda::CudaPlatform;
                let unavailable = |e: weightferry_actors::platform::PlatformError| {
                    CoreError::Device(one_line(&e.to_string().replace("--platform sim", "device=\"sim\"")))
                };
                let cuda = Arc::new(CudaPlatform::new(ordinal).map_err(unavailable)?);
                if !cuda.shares_context_with(torch.probe_ptr).map_err(unavailable)? {
                    return Err(CoreError::Device(format!(
                        "torch's memory on cuda:{ordinal} is not in the device's primary context; weightferry shares \
                         torch's primary CUDA context and cannot offload next to another context (one made with \
                         cuCtxCreate)"
                    )));
                }
                // SAFETY: `stream` is torch's current stream on this device (the Python package passes
                // `torch.cuda.current_stream(device).cuda_stream`), a stream of the primary context just checked;
                // torch keeps its pool streams alive for the life of the process, and the package documents that
                // an external stream must outlive the handle.
                let compute = unsafe { cuda.adopt_stream(torch.stream as usize as _, "torch") }.map_err(offload_err)?;
                let platform: PlatformRef = cuda.clone();
                Ok((Device::Cuda(cuda), platform, compute))
            }
            #[cfg(not(feature = "cuda"))]
            DeviceSpec::Cuda(_) => {
                let _ = (torch, faults);
                Err(CoreError::Device("this build of weightferry has no CUDA support".into()))
            }
        }
    }

    fn sim(&self) -> Option<&Arc<SimPlatform>> {
        match self {
            Device::Sim(sim) => Some(sim),
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => None,
        }
    }
}

fn offload_err(e: impl std::fmt::Display) -> CoreError {
    CoreError::Offload(one_line(&e.to_string()))
}

/// Where a storage's device bytes are while a block runs: `(buffer, base, [(storage, offset in the block)])`.
pub type ResidencyParts = (u64, u64, Vec<(u64, u64)>);

/// One pipeline offloaded on the simulated device: its host model (filled by the caller storage by storage), the
/// backend of its config, the hook registry, and the compute stream the hooks order. Created with the plan already
/// resolved, so a bad pipeline or config fails before anything is allocated. Dropping it disables the backend and
/// shuts the simulated device down.
pub struct Session {
    device: Device,
    compute: StreamId,
    model: HostModel,
    backend: Option<StreamingBackend>,
    hooks: HookRegistry,
    /// Storage → the unit (module path) that streams it; fixed placement when absent.
    streamed: BTreeMap<StorageId, String>,
    written: BTreeSet<StorageId>,
    plan: String,
    /// How errors name the pipeline.
    name: String,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("backend", &self.backend).field("written", &self.written.len()).finish()
    }
}

impl Session {
    /// Resolves the plan of `pipeline_json` under the config (errors as [`plan_json`]'s), then opens the device
    /// (`torch` names torch's stream and memory on a CUDA device) and builds the host model: zero-filled, or read
    /// from `checkpoint` (`(path, component)`: the description's tensor `<component>.K` is the file's tensor `K`,
    /// every one checked before a byte is read, see [`HostModel::from_checkpoint`]). Nothing is offloaded until
    /// every storage was written (from a checkpoint all at once, but for the non-persistent buffers, which the
    /// caller writes: [`unwritten`](Self::unwritten)) and [`enable`](Self::enable) runs.
    pub fn new(
        pipeline_json: &str,
        config: &str,
        config_format: &str,
        name: &str,
        device: DeviceSpec,
        torch: TorchCuda,
        options: SessionOptions<'_>,
    ) -> Result<Session, CoreError> {
        let checkpoint = options.checkpoint;
        let desc = Arc::new(load_pipeline(pipeline_json, name)?);
        let config_text = config;
        let mut config = load_config(config, config_format)?;
        let free = match device {
            DeviceSpec::Sim => SimConfig::default().device_capacity,
            DeviceSpec::Cuda(_) => torch.free_bytes,
        };
        config.resolve_auto_budget(free);
        let plan_error = |e: weightferry::plan::PlanError| {
            CoreError::Plan(one_line(&format!("the config cannot be applied to {name}: {e}")))
        };
        let report = PlanReport::resolve(name, &desc, &config).map_err(plan_error)?;
        let plan = serde_json::to_string(&report)
            .map_err(|e| CoreError::Internal(format!("cannot encode the plan report: {e}")))?;
        let resolved = resolve_offload_plan(&desc, &config).map_err(plan_error)?;
        let units = build_unit_plan(&desc, &config, &resolved);
        let mut streamed = BTreeMap::new();
        for unit in units.stacks.iter().flat_map(|s| &s.units) {
            streamed.extend(unit.storages().map(|s| (s, unit.path.clone())));
        }
        let opened = match checkpoint {
            Some((path, _)) => Some(
                weightferry::checkpoint::Checkpoint::open(path)
                    .map_err(|e| CoreError::Checkpoint(one_line(&e.to_string())))?,
            ),
            None => None,
        };
        let (device, platform, compute) = Device::open(device, torch, options.sim_faults.plan)?;
        let fingerprint = [pipeline_json.as_bytes(), b"\0", config_text.as_bytes()].concat();
        let faults = options.sim_faults.fail_all_gather;
        let collective = session_collective(&config, &device, &fingerprint, faults, options.rendezvous_port)?;
        let (model, written) = match (&opened, checkpoint) {
            (Some(ckpt), Some((_, component))) => {
                let model = HostModel::from_checkpoint(platform.clone(), desc.clone(), ckpt, component)
                    .map_err(|e| CoreError::Checkpoint(one_line(&e.to_string())))?;
                let caller: BTreeSet<StorageId> = model.caller_storages().iter().copied().collect();
                (model, desc.storages.keys().filter(|s| !caller.contains(s)).copied().collect())
            }
            _ => (HostModel::zeroed(platform.clone(), desc).map_err(offload_err)?, BTreeSet::new()),
        };
        let backend = get_offload_backend(&config, platform, collective).map_err(offload_err)?;
        Ok(Session {
            device,
            compute,
            model,
            backend,
            hooks: HookRegistry::new(),
            streamed,
            written,
            plan,
            name: name.to_string(),
        })
    }

    /// The plan report as JSON (what [`plan_json`] returns for the same arguments).
    pub fn plan_json(&self) -> &str {
        &self.plan
    }

    /// `(tensor path, storage id)` of every tensor of the description, depth first (paths as `describe()` names
    /// them: dotted from the pipeline root).
    pub fn tensor_storages(&self) -> Vec<(String, u64)> {
        self.model.desc().root.tensors_recursive().into_iter().map(|(p, t)| (p, t.storage.0)).collect()
    }

    /// `(storage id, bytes, the module path of the unit streaming it or None for the fixed placement)` of every
    /// storage, in id order.
    pub fn storages(&self) -> Vec<(u64, u64, Option<String>)> {
        let desc = self.model.desc();
        desc.storages.iter().map(|(&id, s)| (id.0, s.byte_size(), self.streamed.get(&id).cloned())).collect()
    }

    /// Storages not written yet, in id order (after opening from a checkpoint: its non-persistent buffers).
    pub fn unwritten(&self) -> Vec<u64> {
        self.model.desc().storages.keys().filter(|s| !self.written.contains(s)).map(|s| s.0).collect()
    }

    /// Fills a storage's host bytes (exactly its size; only before `enable` or after `disable`).
    pub fn write_storage(&mut self, storage: u64, bytes: &[u8]) -> Result<(), CoreError> {
        self.model.write_storage(StorageId(storage), bytes).map_err(offload_err)?;
        self.written.insert(StorageId(storage));
        Ok(())
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

    /// Offloads: builds host masters, the fixed placement and the block stacks, and installs the hooks. Refuses
    /// while a storage was never written. Returns whether anything is offloaded (`false` for a config that
    /// disables offload, or a plan with nothing to stream: then nothing moved). Transactional, as the backend's.
    pub fn enable(&mut self) -> Result<bool, CoreError> {
        if let Some(missing) = self.model.desc().storages.keys().find(|s| !self.written.contains(s)) {
            return Err(CoreError::Offload(format!(
                "storage {} was never written; write every storage's bytes before enable",
                missing.0
            )));
        }
        let Some(backend) = self.backend.as_mut() else { return Ok(false) };
        backend.enable(&mut self.model, &self.hooks, self.compute).map_err(offload_err)?;
        Ok(backend.is_enabled())
    }

    /// Retunes the enabled backend to `config` (read as in [`load_config`]; `device_budget = "auto"` resolved from
    /// `free_bytes`, or the sim's capacity): prefetch depths, resident layers and the device budget change without
    /// rebuilding host masters or the fixed placement; a config that would offload other components or blocks is
    /// refused before anything changes (see `StreamingBackend::retune`). Returns the new plan report as JSON.
    pub fn retune(&mut self, config: &str, config_format: &str, free_bytes: u64) -> Result<String, CoreError> {
        let mut config = load_config(config, config_format)?;
        let free = if self.device.sim().is_some() { SimConfig::default().device_capacity } else { free_bytes };
        config.resolve_auto_budget(free);
        let name = self.name.clone();
        let report = PlanReport::resolve(&name, self.model.desc(), &config)
            .map_err(|e| CoreError::Plan(one_line(&format!("the config cannot be applied to {name}: {e}"))))?;
        let plan = serde_json::to_string(&report)
            .map_err(|e| CoreError::Internal(format!("cannot encode the plan report: {e}")))?;
        let Some(backend) = self.backend.as_mut().filter(|b| b.is_enabled()) else {
            return Err(CoreError::Offload("retune needs an enabled offload; nothing is offloaded now".into()));
        };
        backend.retune(config, &self.model, &self.hooks, self.compute).map_err(offload_err)?;
        self.plan = plan.clone();
        Ok(plan)
    }

    /// Whether the backend is enabled.
    pub fn is_enabled(&self) -> bool {
        self.backend.as_ref().is_some_and(StreamingBackend::is_enabled)
    }

    /// The modules that have offload hooks (dotted paths), sorted.
    pub fn hooked_modules(&self) -> Vec<String> {
        let mut v: Vec<String> = self.hooks.hook_names().into_iter().map(|(m, _, _)| m).collect();
        v.dedup();
        v
    }

    /// Runs `module`'s pre-forward hooks. On the simulated device it then waits on the host for the compute
    /// stream, so the block's bytes are in device memory when this returns; on CUDA nothing waits on the host:
    /// torch's stream was ordered behind the copies, so kernels torch launches next read landed bytes. `None` for
    /// a module whose weights no hook places.
    ///
    /// The storages' offsets are listed only `with_offsets` (else empty): they change only at a retune, so a
    /// caller asks once per module and keeps them, and the per-forward call converts two integers.
    pub fn pre_forward(&self, module: &str, with_offsets: bool) -> Result<Option<ResidencyParts>, CoreError> {
        let residency = self.hooks.pre_forward(module).map_err(offload_err)?;
        if let Some(sim) = self.device.sim() {
            sim.stream_synchronize(self.compute).map_err(offload_err)?;
        }
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
        self.hooks.post_forward(module).map_err(offload_err)
    }

    /// Device buffer and byte offset of a storage: always answers for the fixed placement, and for a streamed
    /// storage between its block's `pre_forward` and `post_forward`.
    pub fn locate(&self, storage: u64) -> Result<(u64, u64), CoreError> {
        let Some(backend) = self.backend.as_ref() else {
            return Err(CoreError::Offload("offload is disabled by this config: nothing is on the device".into()));
        };
        let (buf, off) = backend.locate(StorageId(storage)).map_err(offload_err)?;
        Ok((buf.0, off))
    }

    /// Copies `len` bytes of simulated device memory out (the range is checked before anything is allocated).
    pub fn read_device(&self, buffer: u64, offset: u64, len: u64) -> Result<Vec<u8>, CoreError> {
        let Some(sim) = self.device.sim() else {
            return Err(CoreError::Offload(
                "read_device reads the simulated device only; on CUDA use device_ptr".into(),
            ));
        };
        let buf = DeviceBufferId(buffer);
        let size = sim.device_buffer_len(buf).map_err(offload_err)?;
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(CoreError::Offload(format!(
                "device read {offset}+{len} exceeds device buffer {buffer} of {size} bytes"
            )));
        }
        let mut out = vec![0; len as usize];
        sim.read_device(buf, offset, &mut out).map_err(offload_err)?;
        Ok(out)
    }

    /// The device address and size of a CUDA device buffer (torch views it without a copy). Addresses stay valid
    /// until the buffer is freed: by `disable`, or by the backend when it drops a slot.
    pub fn device_ptr(&self, buffer: u64) -> Result<(u64, u64), CoreError> {
        match &self.device {
            #[cfg(feature = "cuda")]
            Device::Cuda(cuda) => cuda
                .device_ptr(DeviceBufferId(buffer))
                .ok_or_else(|| CoreError::Offload(format!("device buffer {buffer} does not exist (it was freed)"))),
            Device::Sim(_) => {
                let _ = buffer;
                Err(CoreError::Offload(
                    "device_ptr is for CUDA devices; on the simulated device use read_device".into(),
                ))
            }
        }
    }

    /// Whether the session drives a CUDA device.
    pub fn is_cuda(&self) -> bool {
        self.device.sim().is_none()
    }

    /// Waits for the device, frees it, removes the hooks and gives every storage its own host buffer back
    /// (bit-identical). A no-op when not enabled; an incomplete disable can be called again.
    pub fn disable(&mut self) -> Result<(), CoreError> {
        match self.backend.as_mut() {
            Some(b) => b.disable(&mut self.model, &self.hooks).map_err(offload_err),
            None => Ok(()),
        }
    }

    /// A storage's host bytes, read through its current home.
    pub fn read_storage(&self, storage: u64) -> Result<Vec<u8>, CoreError> {
        self.model.read_storage(StorageId(storage)).map_err(offload_err)
    }

    /// The ordering violations the simulated device's hazard detector recorded so far (each as its debug text):
    /// a read of a slot before its copy landed, an overwrite before its last reader finished. Empty when the hooks
    /// kept every order, and on CUDA (which has no detector).
    pub fn hazard_violations(&self) -> Vec<String> {
        let Some(sim) = self.device.sim() else { return Vec::new() };
        sim.violations().iter().map(|v| format!("{v:?}")).collect()
    }

    /// The backend's report as JSON (`strategy` `"none"` and nothing else when the config disables offload).
    pub fn report_json(&self) -> Result<String, CoreError> {
        let report = match &self.backend {
            Some(b) => b.report(),
            None => BackendReport { strategy: "none".into(), ..Default::default() },
        };
        serde_json::to_string(&report).map_err(|e| CoreError::Internal(format!("cannot encode the report: {e}")))
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(b) = self.backend.as_mut() {
            if let Err(e) = b.disable(&mut self.model, &self.hooks) {
                eprintln!("weightferry: disabling a dropped session failed: {e}");
            }
        }
        if let Some(sim) = self.device.sim() {
            sim.shutdown();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PIPELINE: &str = r#"{"class": "P", "modules": {"transformer": {"class": "D", "children": {
        "blocks": {"repeat": 2, "block": {"class": "B", "tensors": {"w": {"dtype": "bf16", "shape": [128]}}}}}}},
        "components": {"dit": ["transformer"]}, "class_block_attrs": {"D": ["blocks"]}}"#;

    #[test]
    fn plan_json_is_the_report() {
        let config = r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#;
        let text = plan_json(PIPELINE, config, "json", "p").unwrap();
        let desc = load_pipeline_json(PIPELINE).unwrap();
        let report = PlanReport::resolve("p", &desc, &OffloadConfig::from_json_str(config).unwrap()).unwrap();
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

    /// A session on [`PIPELINE`] on the simulated device, its storages still zero.
    fn sim_session(config: &str) -> Session {
        let options = SessionOptions::default();
        Session::new(PIPELINE, config, "json", "p", DeviceSpec::Sim, TorchCuda::default(), options).unwrap()
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
        let Err(CoreError::Config(_)) = Session::new(
            PIPELINE,
            r#"{"x": 1}"#,
            "json",
            "p",
            DeviceSpec::Sim,
            TorchCuda::default(),
            SessionOptions::default(),
        ) else {
            panic!("a bad config was accepted")
        };
        assert_eq!(
            parse_device("cuda:3", 0).map_err(|_| ()),
            if cfg!(feature = "cuda") { Ok(DeviceSpec::Cuda(3)) } else { Err(()) }
        );
        assert_eq!(parse_device("sim", 5), Ok(DeviceSpec::Sim));
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
