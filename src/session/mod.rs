//! The library session: the one way to offload a pipeline. A [`Session`] takes a pipeline description (its weights
//! written by the caller, or read from a checkpoint), an [`OffloadConfig`], a device ([`DeviceSpec`]) and, for a
//! distributed run, a collective or the launch environment to build one from ([`CollectiveSource`]); it resolves
//! the plan once and owns the host model, the backend and the hook registry through
//! `write_storage` → `enable` → `pre_forward` / `post_forward` → `retune` → `disable`. Every front end (the Python
//! binding, the harness drivers) drives offload through it.
//!
//! - `device.rs`: which device ([`DeviceSpec`], [`CudaDevice`]), and the opened platform ([`Device`]).
//! - `error.rs`: [`SessionError`], a failure by kind, its message on one line.
//! - `load.rs`: a config ([`ConfigSource`]) and a pipeline description read from text, failures worded as the CLI
//!   words them.
//!
//! ```
//! use weightferry::config::OffloadConfig;
//! use weightferry::pipeline::builder::PipelineBuilder;
//! use weightferry::pipeline::DType;
//! use weightferry::scheduler::SimConfig;
//! use weightferry::session::{DeviceSpec, Session, SessionOptions};
//!
//! // A pipeline of two transformer blocks, streamed one block at a time.
//! let desc = PipelineBuilder::new("TinyPipeline")
//!     .module("transformer", "TinyDiT", |m| {
//!         m.block_list("blocks", 2, "TinyBlock", |b, _| {
//!             b.linear("fc", DType::Bf16, 8, 8, false);
//!         });
//!     })
//!     .dit("transformer")
//!     .class_block_attrs("TinyDiT", &["blocks"])
//!     .build()?;
//! let config = r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#;
//! let config = OffloadConfig::from_json_str(config)?;
//! let mut session = Session::new(desc, config, DeviceSpec::Sim(SimConfig::default()), SessionOptions::default())?;
//!
//! // The host engine hands over its weights, then runs its forward pass between the hooks.
//! for (storage, bytes, _unit) in session.storages() {
//!     session.write_storage(storage, &vec![1; bytes as usize])?;
//! }
//! assert!(session.enable()?);
//! for block in ["transformer.blocks.0", "transformer.blocks.1"] {
//!     let on_device = session.pre_forward(block)?.expect("a streamed block");
//!     // The block's weights are on the device now: run its kernels on them.
//!     assert_eq!(session.read_device(on_device.buffer, on_device.base, 128)?, vec![1; 128]);
//!     session.post_forward(block)?;
//! }
//! session.disable()?; // every storage has its own host bytes back, bit-identical
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod compare;
mod device;
mod error;
mod load;
#[cfg(test)]
mod tests;

pub use device::{CudaDevice, Device, DeviceSpec};
pub use error::{one_line, SessionError};
pub use load::{load_config, load_pipeline, ConfigSource};

use crate::checkpoint::{Checkpoint, View};
use crate::config::OffloadConfig;
use crate::dist::rank::{rank_collective, RankOptions};
use crate::hooks::{HookError, HookFailure, HookRegistry, Residency};
use crate::model::HostModel;
use crate::offload::backend::EnableProgress;
use crate::offload::predict::{check_host_budget, host_of};
use crate::offload::units::build_unit_plan;
use crate::offload::{get_offload_backend, BackendReport, OffloadError, StreamingBackend, WeightSource};
use crate::pipeline::{PipelineDesc, StorageId};
use crate::plan::bytes::human_bytes;
use crate::plan::report::{PlanHost, PlanReport};
use crate::plan::{resolve_offload_plan, ResolvedPlan};
use error::offload_err;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use weightferry_actors::collective_actor::CollectiveFactory;
use weightferry_actors::platform::{DeviceBufferId, HostBufferId, Platform, PlatformRef, StreamId};
use weightferry_actors::{OrderingFault, SchedulerError};

/// A checkpoint the session reads a component's weights from: the description's tensor `<component>.K` is the
/// file's tensor `K` (every one checked before a byte is read).
#[derive(Debug, Clone)]
pub struct CheckpointSource {
    /// A safetensors file, or a folder of shards.
    pub path: PathBuf,
    /// The component of the pipeline the checkpoint fills (e.g. `transformer`).
    pub component: String,
    /// The component's tensors the file names otherwise (an original model's single file), by the component's
    /// names ([`Checkpoint::with_views`]); empty when the file uses the model's names.
    pub views: BTreeMap<String, View>,
}

/// Where a distributed session's collective comes from.
#[derive(Default)]
pub enum CollectiveSource {
    /// No collective: every component moves its blocks rank-locally (AllGather across a group of more than one
    /// rank is refused).
    #[default]
    None,
    /// The host engine's own communicator for this rank, built on the collective actor's thread.
    Factory(CollectiveFactory),
    /// Built from the launch environment when the config gathers across ranks (the launch variables of [`crate::dist::LaunchEnv`]).
    Launch(LaunchExchange),
}

impl std::fmt::Debug for CollectiveSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CollectiveSource::None => f.write_str("None"),
            CollectiveSource::Factory(_) => f.write_str("Factory(..)"),
            CollectiveSource::Launch(l) => f.debug_tuple("Launch").field(l).finish(),
        }
    }
}

/// How a rank joins the others through the launch environment.
#[derive(Debug, Clone, Default)]
pub struct LaunchExchange {
    /// What this rank runs (its pipeline and config): every rank must give the same bytes.
    pub fingerprint: Vec<u8>,
    /// The port rank 0 listens on instead of `MASTER_PORT`.
    pub rendezvous_port: Option<u16>,
    /// Test seam on the simulated device: this rank's AllGather call that fails at enqueue (0-based).
    pub fail_all_gather: Option<u64>,
}

/// What else a session is built with.
#[derive(Debug, Default)]
pub struct SessionOptions {
    /// How errors and the plan report name the pipeline (empty: `<pipeline>`).
    pub name: String,
    /// Checkpoints to read components' weights from, one per component (else, and for every storage outside
    /// them, the host model starts zero-filled and the caller writes it).
    pub checkpoints: Vec<CheckpointSource>,
    /// The rank's collective, for a distributed session.
    pub collective: CollectiveSource,
    /// Test seam: the block stacks run with a deliberately broken ordering, to prove a check can fail (only
    /// builds with `--cfg weightferry_broken` have them; elsewhere anything but `None` is refused at `enable`).
    pub ordering_fault: OrderingFault,
    /// Observes `enable` building host masters (a progress display).
    pub enable_progress: Option<EnableProgress>,
}

/// The length of a read of `len` bytes at `offset` of a `kind` buffer of `size` bytes, checked before anything is
/// allocated.
fn read_len(kind: &str, buffer: u64, offset: u64, len: u64, size: u64) -> Result<usize, SessionError> {
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(SessionError::Offload(format!(
            "{kind} read {offset}+{len} exceeds {kind} buffer {buffer} of {size} bytes"
        )));
    }
    usize::try_from(len).map_err(|_| SessionError::Offload(format!("{kind} read of {len} bytes")))
}

/// What a captured graph copies for one static unit ([`Session::capture_copies`]): where its bytes are now
/// (`(device buffer, offset)`, if in a slot or resident), and `(host buffer, offset in it, offset in the block,
/// bytes)` of each flat copy.
pub type CaptureCopies = (Option<(u64, u64)>, Vec<(u64, u64, u64, u64)>);

/// One offloaded pipeline: its host model (filled by the caller storage by storage, or from a checkpoint), the
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
    plan: ResolvedPlan,
    report: PlanReport,
    /// The simulated device's capacity (what `device_budget = "auto"` plans from there).
    sim_capacity: Option<u64>,
    /// How errors name the pipeline.
    name: String,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("backend", &self.backend).field("written", &self.written.len()).finish()
    }
}

/// Resolves `host_budget = "auto"` ([`OffloadConfig::resolve_auto_host_budget`]) from the memory the process may
/// still take and the weights it holds now (every storage not served by a checkpoint file: the masters take their
/// place), into the config and the report; a note in the report says what it became.
/// With weights bound from checkpoint files, the host side of `report` predicted again over `model`: what its files
/// serve and what the disk tier reads (the plan without the model counts every block as a master).
fn predict_from_files(report: &mut PlanReport, config: &OffloadConfig, plan: &ResolvedPlan, model: &HostModel) {
    if !model.mapped_files().is_empty() {
        report.host = host_of(model.desc(), config, plan, Some(model));
    }
}

fn resolve_auto_host_budget(config: &mut OffloadConfig, model: &HostModel, report: &mut PlanReport) {
    let desc = model.desc();
    let held: u64 =
        desc.storages.iter().filter(|(id, _)| model.file_origin(**id).is_none()).map(|(_, s)| s.byte_size()).sum();
    let available = crate::platform::host_memory::host_available().unwrap_or(0);
    if let Some((budget, headroom)) = config.resolve_auto_host_budget(available, held) {
        report.host.budget = Some(budget);
        report.notes.push(format!(
            "host_budget = \"auto\": {} ({} available + {} of weights held now, less a headroom of {})",
            human_bytes(budget),
            human_bytes(available),
            human_bytes(held),
            human_bytes(headroom)
        ));
    }
}

/// The checkpoints of `sources`, opened and checked, with their components (each component once).
fn open_checkpoints(sources: &[CheckpointSource]) -> Result<Vec<(Checkpoint, String)>, SessionError> {
    for (i, source) in sources.iter().enumerate() {
        if sources[..i].iter().any(|s| s.component == source.component) {
            return Err(SessionError::Checkpoint(format!(
                "component `{}` is given two checkpoints; give each component one",
                source.component
            )));
        }
    }
    sources
        .iter()
        .map(|s| {
            let checkpoint = Checkpoint::open(&s.path).and_then(|c| c.with_views(s.views.clone()));
            Ok((checkpoint.map_err(checkpoint_err)?, s.component.clone()))
        })
        .collect()
}

/// Takes `reserved` bytes out of a byte-count `device_budget` (see [`Session::retune`]): `(budget, reserved)`
/// when it did, `None` for no budget, an `"auto"` one or nothing reserved. A budget the reserved bytes fill is a
/// plan error naming both.
fn reserve_in_budget(
    name: &str,
    config: &mut OffloadConfig,
    reserved: u64,
) -> Result<Option<(u64, u64)>, SessionError> {
    let Some(budget) = config.device_budget.filter(|_| reserved > 0 && !config.device_budget_auto) else {
        return Ok(None);
    };
    if reserved >= budget {
        return Err(SessionError::Plan(one_line(&format!(
            "the config cannot be applied to {name}: diffusion_offload_config.device_budget: {budget} bytes are \
             all taken by the {reserved} bytes of tensors added to the pipeline after enable (adapter layers); \
             raise device_budget, or remove adapters"
        ))));
    }
    config.device_budget = Some(budget - reserved);
    Ok(Some((budget, reserved)))
}

/// A plan error of a retune under a budget less reserved bytes says so (its numbers are of what was left).
fn with_reserved(e: SessionError, reserved: Option<(u64, u64)>) -> SessionError {
    match (e, reserved) {
        (SessionError::Plan(m), Some((budget, reserved))) => SessionError::Plan(format!(
            "{m} (device_budget {budget} bytes less the {reserved} bytes of tensors added to the pipeline after \
             enable: adapter layers)"
        )),
        (e, _) => e,
    }
}

/// A hook's failure in one line. A failed load also says how its stack recovers: the stack keeps the error (every
/// later forward raises it, never an output from missing bytes) until a retune rebuilds the stacks or disable.
fn hook_err(e: HookError) -> SessionError {
    let load_failed = matches!(&e, HookError::Failed { source, .. }
        if matches!(**source, HookFailure::Scheduler(SchedulerError::LoadFailed { .. })));
    let message = e.to_string();
    if !load_failed {
        return SessionError::Offload(one_line(&message));
    }
    SessionError::Offload(one_line(&format!(
        "{message}; the block stack keeps this error until it is rebuilt: once the cause is gone (a file restored, \
         memory freed) call retune(), which rebuilds the stacks and keeps the host masters, or disable()"
    )))
}

/// A plan the config cannot give `name` (the resolver's refusal or the host budget's), in one line.
fn not_applicable(name: &str, e: impl std::fmt::Display) -> SessionError {
    SessionError::Plan(one_line(&format!("the config cannot be applied to {name}: {e}")))
}

/// The plan of `desc` under `config` (its automatic budget resolved from `free` device bytes when given), resolved
/// once, and its report.
fn resolve(
    name: &str,
    desc: &PipelineDesc,
    config: &mut OffloadConfig,
    free: Option<u64>,
) -> Result<(ResolvedPlan, PlanReport), SessionError> {
    if let Some(free) = free {
        config.resolve_auto_budget(free);
    }
    let plan = resolve_offload_plan(desc, config).map_err(|e| not_applicable(name, e))?;
    let report = PlanReport::from_plan(name, desc, config, &plan, host_of(desc, config, &plan, None));
    Ok((plan, report))
}

/// Storage → the unit (module path) that streams it under `plan`.
fn streamed_storages(desc: &PipelineDesc, config: &OffloadConfig, plan: &ResolvedPlan) -> BTreeMap<StorageId, String> {
    let units = build_unit_plan(desc, config, plan);
    let mut streamed = BTreeMap::new();
    for unit in units.stacks.iter().flat_map(|s| &s.units) {
        streamed.extend(unit.storages().map(|s| (s, unit.path.clone())));
    }
    streamed
}

/// The backend of `config` on `platform`, with the options' ordering fault and enable observer.
fn backend(
    config: &OffloadConfig,
    platform: PlatformRef,
    collective: Option<CollectiveFactory>,
    fault: OrderingFault,
    progress: Option<EnableProgress>,
) -> Result<Option<StreamingBackend>, SessionError> {
    let mut backend = get_offload_backend(config, platform, collective).map_err(offload_err)?;
    if let Some(b) = backend.as_mut() {
        b.set_ordering_fault(fault);
        b.set_progress(progress);
    }
    Ok(backend)
}

fn checkpoint_err(e: impl std::fmt::Display) -> SessionError {
    SessionError::Checkpoint(one_line(&e.to_string()))
}

impl Session {
    /// Resolves the plan of `desc` under `config` ([`SessionError::Plan`]), opens the checkpoint if any
    /// ([`SessionError::Checkpoint`]) and the device ([`SessionError::Device`]), builds the rank's collective when
    /// the config gathers across ranks, and builds the host model: zero-filled, or read from the checkpoint.
    /// Nothing is offloaded until every storage was written (from a checkpoint all at once, but for the
    /// non-persistent buffers, which the caller writes: [`unwritten`](Self::unwritten)) and
    /// [`enable`](Self::enable) runs.
    pub fn new(
        desc: impl Into<Arc<PipelineDesc>>,
        mut config: OffloadConfig,
        device: DeviceSpec,
        options: SessionOptions,
    ) -> Result<Session, SessionError> {
        let desc = desc.into();
        let name = if options.name.is_empty() { "<pipeline>".to_string() } else { options.name };
        let (plan, report) = resolve(&name, &desc, &mut config, Some(device.free_bytes()))?;
        let streamed = streamed_storages(&desc, &config, &plan);
        let checkpoints = open_checkpoints(&options.checkpoints)?;
        let sim_capacity = match &device {
            DeviceSpec::Sim(sim) => Some(sim.device_capacity),
            DeviceSpec::Cuda(_) => None,
        };
        let (device, platform, compute) = Device::open(&device)?;
        let collective = match options.collective {
            CollectiveSource::None => None,
            CollectiveSource::Factory(factory) => Some(factory),
            CollectiveSource::Launch(l) => {
                let rank = RankOptions {
                    fingerprint: &l.fingerprint,
                    rendezvous_port: l.rendezvous_port,
                    fail_all_gather: l.fail_all_gather,
                };
                let device = device.rank_device().expect("a device the session opened");
                rank_collective(&config, device, rank).map_err(offload_err)?
            }
        };
        let (model, written) = Self::host_model(platform.clone(), desc, &checkpoints)?;
        let mut report = report;
        predict_from_files(&mut report, &config, &plan, &model);
        resolve_auto_host_budget(&mut config, &model, &mut report);
        if let Err(e) = check_host_budget(&report.host) {
            model.release();
            return Err(not_applicable(&name, e));
        }
        let mut backend = backend(&config, platform, collective, options.ordering_fault, options.enable_progress)?;
        if let Some(b) = backend.as_mut() {
            b.begin_staging(&model, &plan); // the caller's writes go straight into the masters enable will use
        }
        let hooks = HookRegistry::new();
        Ok(Session { device, compute, model, backend, hooks, streamed, written, plan, report, sim_capacity, name })
    }

    /// A session over a host engine's own platform and host model (every storage already written, e.g. by a
    /// reference engine's weight generator): the plan of the model's description under `config` as given (an
    /// automatic budget the engine resolved itself with [`OffloadConfig::resolve_auto_budget`]), the hooks
    /// ordering copies against the engine's `compute` stream. The collective, if any, comes as a
    /// [`CollectiveSource::Factory`]; [`SessionOptions::checkpoints`] do not apply (the model is already
    /// filled). The session releases the model's host buffers when dropped, and never shuts the platform down.
    pub fn from_model(
        model: HostModel,
        compute: StreamId,
        mut config: OffloadConfig,
        options: SessionOptions,
    ) -> Result<Session, SessionError> {
        let name = if options.name.is_empty() { "<pipeline>".to_string() } else { options.name.clone() };
        let built = Self::engine_parts(&model, &name, &mut config, options);
        let (plan, report, backend) = match built {
            Ok(parts) => parts,
            Err(e) => {
                model.release();
                return Err(e);
            }
        };
        let streamed = streamed_storages(model.desc(), &config, &plan);
        let written = model.desc().storages.keys().copied().collect();
        let (device, hooks, sim_capacity) = (Device::Engine(model.platform().clone()), HookRegistry::new(), None);
        Ok(Session { device, compute, model, backend, hooks, streamed, written, plan, report, sim_capacity, name })
    }

    /// The plan, its report and the backend of a [`from_model`](Self::from_model) session.
    fn engine_parts(
        model: &HostModel,
        name: &str,
        config: &mut OffloadConfig,
        options: SessionOptions,
    ) -> Result<(ResolvedPlan, PlanReport, Option<StreamingBackend>), SessionError> {
        let collective = match options.collective {
            CollectiveSource::None => None,
            CollectiveSource::Factory(factory) => Some(factory),
            CollectiveSource::Launch(_) => {
                return Err(SessionError::Offload(
                    "a session over the engine's own platform takes its collective as CollectiveSource::Factory, \
                     not CollectiveSource::Launch"
                        .into(),
                ))
            }
        };
        if !options.checkpoints.is_empty() {
            return Err(SessionError::Checkpoint(
                "a session over the engine's own host model reads no checkpoint: fill the model from it \
                 (HostModel::from_checkpoint) and leave SessionOptions::checkpoints empty"
                    .into(),
            ));
        }
        let (plan, mut report) = resolve(name, model.desc(), config, None)?;
        predict_from_files(&mut report, config, &plan, model);
        resolve_auto_host_budget(config, model, &mut report);
        check_host_budget(&report.host).map_err(|e| not_applicable(name, e))?;
        let platform = model.platform().clone();
        let backend = backend(config, platform, collective, options.ordering_fault, options.enable_progress)?;
        Ok((plan, report, backend))
    }

    /// The host model, zero-filled or read from the checkpoints (each filling its component), and the storages
    /// already written.
    fn host_model(
        platform: PlatformRef,
        desc: Arc<PipelineDesc>,
        checkpoints: &[(Checkpoint, String)],
    ) -> Result<(HostModel, BTreeSet<StorageId>), SessionError> {
        if checkpoints.is_empty() {
            return Ok((HostModel::zeroed(platform, desc).map_err(offload_err)?, BTreeSet::new()));
        }
        let parts: Vec<(&Checkpoint, &str)> = checkpoints.iter().map(|(c, name)| (c, name.as_str())).collect();
        let model = HostModel::from_checkpoints(platform, desc.clone(), &parts).map_err(checkpoint_err)?;
        let caller: BTreeSet<StorageId> = model.caller_storages().iter().copied().collect();
        Ok((model, desc.storages.keys().filter(|s| !caller.contains(s)).copied().collect()))
    }

    /// The plan report (what `weightferry plan` prints for the same pipeline and config).
    pub fn plan_report(&self) -> &PlanReport {
        &self.report
    }

    /// The resolved plan.
    pub fn plan(&self) -> &ResolvedPlan {
        &self.plan
    }

    /// `(tensor path, storage)` of every tensor of the description, depth first (paths dotted from the pipeline
    /// root).
    pub fn tensor_storages(&self) -> Vec<(String, StorageId)> {
        self.model.desc().root.tensors_recursive().into_iter().map(|(p, t)| (p, t.storage)).collect()
    }

    /// `(storage, bytes, the module path of the unit streaming it or None for the fixed placement)` of every
    /// storage, in id order.
    pub fn storages(&self) -> Vec<(StorageId, u64, Option<String>)> {
        let desc = self.model.desc();
        desc.storages.iter().map(|(&id, s)| (id, s.byte_size(), self.streamed.get(&id).cloned())).collect()
    }

    /// Storages not written yet, in id order (after opening from a checkpoint: its non-persistent buffers).
    pub fn unwritten(&self) -> Vec<StorageId> {
        self.model.desc().storages.keys().filter(|s| !self.written.contains(s)).copied().collect()
    }

    /// Fills a storage's host bytes (exactly its size; only before `enable` or after `disable`). Before the first
    /// `enable`, a storage the plan streams is written straight into the host master `enable` will use.
    pub fn write_storage(&mut self, storage: StorageId, bytes: &[u8]) -> Result<(), SessionError> {
        let staged = match self.backend.as_mut() {
            Some(b) => b.stage_write(&mut self.model, storage, bytes).map_err(offload_err)?,
            None => false,
        };
        if !staged {
            self.model.write_storage(storage, bytes).map_err(offload_err)?;
        }
        self.written.insert(storage);
        Ok(())
    }

    /// Writes new bytes for storages (each exactly its size): before `enable` and after `disable` into their own
    /// host buffers, as [`write_storage`](Self::write_storage); while enabled through to the backend's host copy
    /// and every device copy (see [`StreamingBackend::write_weights`]), so the next forward and `disable` see them.
    /// Every write is checked before any is applied.
    pub fn write_weights(&mut self, writes: &[(StorageId, &[u8])]) -> Result<(), SessionError> {
        if !self.is_enabled() {
            for &(s, bytes) in writes {
                let expected = self.model.storage_bytes(s);
                if !self.model.desc().storages.contains_key(&s) || bytes.len() as u64 != expected {
                    return Err(SessionError::Offload(format!(
                        "storage {}: a write of {} bytes; it holds {expected}",
                        s.0,
                        bytes.len()
                    )));
                }
            }
            return writes.iter().try_for_each(|&(s, bytes)| self.write_storage(s, bytes));
        }
        let backend = self.backend.as_mut().ok_or_else(|| SessionError::Offload("nothing is offloaded".into()))?;
        backend.write_weights(&mut self.model, &self.hooks, self.compute, writes).map_err(offload_err)
    }

    /// Offloads: builds host masters, the fixed placement and the block stacks over the plan resolved at
    /// [`new`](Self::new), and installs the hooks. Refuses while a storage was never written. Returns whether
    /// anything is offloaded (`false` for a config that disables offload, or a plan with nothing to stream: then
    /// nothing moved). Transactional, as the backend's.
    pub fn enable(&mut self) -> Result<bool, SessionError> {
        if let Some(missing) = self.model.desc().storages.keys().find(|s| !self.written.contains(s)) {
            return Err(SessionError::Offload(format!(
                "storage {} was never written; write every storage's bytes before enable",
                missing.0
            )));
        }
        self.enable_offload().map_err(offload_err)
    }

    /// [`enable`](Self::enable) with the backend's own typed error, for an engine that tells failures apart (a
    /// distributed rank: a poisoned collective from a failed restore). Checks nothing about written storages: a
    /// [`from_model`](Self::from_model) session's are all written.
    pub fn enable_offload(&mut self) -> Result<bool, OffloadError> {
        let Some(backend) = self.backend.as_mut() else { return Ok(false) };
        backend.enable_planned(&mut self.model, &self.hooks, self.compute, self.plan.clone())?;
        Ok(backend.is_enabled())
    }

    /// Retunes the enabled backend to `config` (`device_budget = "auto"` resolved from `free_bytes` on CUDA, from
    /// the capacity on the simulated device): prefetch depths, resident layers and the device budget change
    /// without rebuilding host masters or the fixed placement; a config that would offload other components or
    /// blocks is refused before anything changes. `reserved_bytes`: device bytes the plan does not place (tensors
    /// the engine added to the pipeline after enable, such as adapter layers) that a byte-count `device_budget`
    /// must hold beside the plan's (an `"auto"` budget reads them in the free memory already). Returns the new
    /// plan report.
    pub fn retune(
        &mut self,
        mut config: OffloadConfig,
        free_bytes: u64,
        reserved_bytes: u64,
    ) -> Result<&PlanReport, SessionError> {
        let free = self.sim_capacity.unwrap_or(free_bytes);
        let reserved = reserve_in_budget(&self.name, &mut config, reserved_bytes)?;
        let (plan, mut report) =
            resolve(&self.name, self.model.desc(), &mut config, Some(free)).map_err(|e| with_reserved(e, reserved))?;
        if let Some((budget, reserved)) = reserved {
            report.notes.push(format!(
                "device_budget {budget} bytes less {reserved} bytes of tensors added to the pipeline after enable \
                 (adapter layers): the plan fits the rest"
            ));
        }
        // Retuning keeps the host masters: the host side is the enabled one's, under the new budget.
        report.host = PlanHost { budget: config.host_budget, ..self.report.host.clone() };
        resolve_auto_host_budget(&mut config, &self.model, &mut report);
        check_host_budget(&report.host).map_err(|e| not_applicable(&self.name, e))?;
        let Some(backend) = self.backend.as_mut().filter(|b| b.is_enabled()) else {
            return Err(SessionError::Offload("retune needs an enabled offload; nothing is offloaded now".into()));
        };
        backend.retune_planned(config, plan.clone(), &self.model, &self.hooks, self.compute).map_err(offload_err)?;
        self.plan = plan;
        self.report = report;
        Ok(&self.report)
    }

    /// Whether the backend is enabled.
    pub fn is_enabled(&self) -> bool {
        self.backend.as_ref().is_some_and(StreamingBackend::is_enabled)
    }

    /// The unit module paths of each stack with a static schedule (`static_slots`), in execution order: every one
    /// lands in the same device place on every pass. Empty while not enabled.
    pub fn static_stacks(&self) -> Vec<Vec<String>> {
        self.backend.as_ref().map(StreamingBackend::static_stacks).unwrap_or_default()
    }

    /// The modules that have offload hooks (dotted paths), sorted.
    pub fn hooked_modules(&self) -> Vec<String> {
        let mut v: Vec<String> = self.hooks.hook_names().into_iter().map(|(m, _, _)| m).collect();
        v.dedup();
        v
    }

    /// Runs `module`'s pre-forward hooks. On the simulated device it then waits on the host for the compute
    /// stream, so the block's bytes are in device memory when this returns; on CUDA nothing waits on the host: the
    /// compute stream was ordered behind the copies, so kernels launched on it next read landed bytes. `None` for
    /// a module whose weights no hook places.
    pub fn pre_forward(&self, module: &str) -> Result<Option<Residency>, SessionError> {
        let residency = self.hooks.pre_forward(module).map_err(hook_err)?;
        if let Some(sim) = self.device.sim() {
            sim.stream_synchronize(self.compute).map_err(offload_err)?;
        }
        Ok(residency)
    }

    /// Runs `module`'s post-forward hooks.
    pub fn post_forward(&self, module: &str) -> Result<(), SessionError> {
        self.hooks.post_forward(module).map_err(hook_err)
    }

    /// Device buffer and byte offset of a storage: always answers for the fixed placement, and for a streamed
    /// storage between its block's `pre_forward` and `post_forward`.
    pub fn locate(&self, storage: StorageId) -> Result<(DeviceBufferId, u64), SessionError> {
        let Some(backend) = self.backend.as_ref() else {
            return Err(SessionError::Offload("offload is disabled by this config: nothing is on the device".into()));
        };
        backend.locate(storage).map_err(offload_err)
    }

    /// Copies `len` bytes of simulated device memory out (the range is checked before anything is allocated).
    pub fn read_device(&self, buffer: DeviceBufferId, offset: u64, len: u64) -> Result<Vec<u8>, SessionError> {
        let Some(sim) = self.device.sim() else {
            return Err(SessionError::Offload(
                "read_device reads the simulated device only; on CUDA use device_ptr".into(),
            ));
        };
        let size = sim.device_buffer_len(buffer).map_err(offload_err)?;
        let mut out = vec![0; read_len("device", buffer.0, offset, len, size)?];
        sim.read_device(buffer, offset, &mut out).map_err(offload_err)?;
        Ok(out)
    }

    /// What a captured CUDA graph copies for static unit `module`: where its bytes are now (in its slot, loaded or
    /// loading, or resident), and `(host buffer, offset in it, offset in the block, bytes)` of each flat copy.
    /// Touches no device (a capture may be under way). Refused for a module that is no unit of a static stack and a
    /// unit the disk tier reads from its file.
    pub fn capture_copies(&self, module: &str) -> Result<CaptureCopies, SessionError> {
        let backend = self.backend.as_ref().ok_or_else(|| SessionError::Offload("nothing is offloaded".into()))?;
        let unit = backend.capture_unit(module).ok_or_else(|| {
            SessionError::Offload(format!("'{module}' is no unit of a stack with a static schedule (static_slots)"))
        })?;
        if unit.from_disk {
            return Err(SessionError::Offload(format!(
                "'{module}' is read from its checkpoint file on every pass (the disk tier), which a CUDA graph cannot \
                 replay: raise host_budget so it has a host copy, or do not capture"
            )));
        }
        let copies = unit.segments.iter().map(|s| (s.host.0, s.host_offset, s.device_offset, s.len)).collect();
        Ok((unit.location.map(|(b, o)| (b.0, o)), copies))
    }

    /// The address a device copy reads host buffer `buffer` at (CUDA), for a captured graph's copies: refused for
    /// pageable memory, which a graph cannot copy from, and on the simulated device (use [`Self::read_host`]).
    pub fn host_address(&self, buffer: HostBufferId) -> Result<u64, SessionError> {
        match &self.device {
            #[cfg(feature = "cuda")]
            Device::Cuda(cuda) => cuda.dma_source(buffer).ok_or_else(|| {
                SessionError::Offload(
                    "a block is copied from pageable host memory, which a CUDA graph cannot replay: enable with \
                     pin_memory = true to capture"
                        .into(),
                )
            }),
            _ => {
                let _ = buffer;
                Err(SessionError::Offload(
                    "host_address is for CUDA devices; on the simulated device use read_host".into(),
                ))
            }
        }
    }

    /// Copies `len` bytes of host buffer `buffer` at `offset` out (the simulated device: what a simulated capture's
    /// replay copies).
    pub fn read_host(&self, buffer: HostBufferId, offset: u64, len: u64) -> Result<Vec<u8>, SessionError> {
        let Some(sim) = self.device.sim() else {
            return Err(SessionError::Offload("read_host reads the simulated device's host memory only".into()));
        };
        let (size, _) = sim.host_buffer_info(buffer).map_err(offload_err)?;
        let mut out = vec![0; read_len("host", buffer.0, offset, len, size)?];
        sim.read_host(buffer, offset, &mut out).map_err(offload_err)?;
        Ok(out)
    }

    /// Writes `data` into simulated device memory at `offset` of `buffer`, synchronously (a simulated capture's
    /// replay; checked by the hazard detector like any host access).
    pub fn write_device(&self, buffer: DeviceBufferId, offset: u64, data: &[u8]) -> Result<(), SessionError> {
        let Some(sim) = self.device.sim() else {
            return Err(SessionError::Offload("write_device writes the simulated device only".into()));
        };
        sim.write_device(buffer, offset, data).map_err(offload_err)
    }

    /// Blocks until every load issued so far and every released slot's last use have completed.
    pub fn fence(&self) -> Result<(), SessionError> {
        match &self.backend {
            Some(b) => b.fence().map_err(offload_err),
            None => Ok(()),
        }
    }

    /// The device address and size of a CUDA device buffer (the engine views it without a copy). Addresses stay
    /// valid until the buffer is freed: by `disable`, or by the backend when it drops a slot.
    pub fn device_ptr(&self, buffer: DeviceBufferId) -> Result<(u64, u64), SessionError> {
        match &self.device {
            #[cfg(feature = "cuda")]
            Device::Cuda(cuda) => cuda.device_ptr(buffer).ok_or_else(|| {
                SessionError::Offload(format!("device buffer {} does not exist (it was freed)", buffer.0))
            }),
            _ => {
                let _ = buffer;
                Err(SessionError::Offload(
                    "device_ptr is for CUDA devices; on the simulated device use read_device".into(),
                ))
            }
        }
    }

    /// The opened device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether the session drives a CUDA device.
    pub fn is_cuda(&self) -> bool {
        self.device.is_cuda()
    }

    /// The stream the hooks order the copies against.
    pub fn compute_stream(&self) -> StreamId {
        self.compute
    }

    /// The host model.
    pub fn model(&self) -> &HostModel {
        &self.model
    }

    /// The backend, or `None` when the config disables offload.
    pub fn backend(&self) -> Option<&StreamingBackend> {
        self.backend.as_ref()
    }

    /// Waits for the device, frees it, removes the hooks and gives every storage its own host buffer back
    /// (bit-identical). A no-op when not enabled; an incomplete disable can be called again.
    pub fn disable(&mut self) -> Result<(), SessionError> {
        self.disable_offload().map_err(offload_err)
    }

    /// [`disable`](Self::disable) with the backend's own typed error ([`OffloadError::Poisoned`],
    /// [`OffloadError::RestoreFailed`] for a distributed rank).
    pub fn disable_offload(&mut self) -> Result<(), OffloadError> {
        match self.backend.as_mut() {
            Some(b) => b.disable(&mut self.model, &self.hooks),
            None => Ok(()),
        }
    }

    /// The hook registry the engine's forward pass calls (`pre_forward` / `post_forward` per module), for an engine
    /// that drives the hooks itself; [`pre_forward`](Self::pre_forward) and [`post_forward`](Self::post_forward)
    /// call the same registry.
    pub fn hooks(&self) -> &HookRegistry {
        &self.hooks
    }

    /// A storage's host bytes, read through its current home.
    pub fn read_storage(&self, storage: StorageId) -> Result<Vec<u8>, SessionError> {
        self.model.read_storage(storage).map_err(offload_err)
    }

    /// The ordering violations the simulated device's hazard detector recorded so far (each as its debug text):
    /// a read of a slot before its copy landed, an overwrite before its last reader finished. Empty when the hooks
    /// kept every order, and on CUDA (which has no detector).
    pub fn hazard_violations(&self) -> Vec<String> {
        let Some(sim) = self.device.sim() else { return Vec::new() };
        sim.violations().iter().map(|v| format!("{v:?}")).collect()
    }

    /// The backend's report (`strategy` `"none"` and nothing else when the config disables offload).
    pub fn report(&self) -> BackendReport {
        match &self.backend {
            Some(b) => b.report(),
            None => BackendReport { strategy: "none".into(), ..Default::default() },
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(b) = self.backend.as_mut() {
            if let Err(e) = b.disable(&mut self.model, &self.hooks) {
                eprintln!("weightferry: disabling a dropped session failed: {e}");
            }
        }
        self.model.release_buffers();
        if let Some(sim) = self.device.sim() {
            sim.shutdown();
        }
    }
}
