//! The pyo3 module `weightferry._core` (feature `python`): the exception classes (`weightferry.Error` and its
//! subclasses), thin functions over [`crate::api`], the class `Session` over [`api::Session`], built from a `SessionOptions` (with a `TorchCuda` on CUDA) (calls that can
//! block release the GIL). Every function runs its Rust work under
//! [`crate::api::guarded`], so a panic reaches Python as `weightferry.Error`, never as pyo3's `PanicException` (a
//! `BaseException` that `except Exception` does not catch).

use crate::api::{self, guarded, CoreError, ResidencyParts};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict};
use std::sync::{Mutex, MutexGuard};

create_exception!(weightferry, Error, PyException, "Base class of every error weightferry raises.");
create_exception!(weightferry, ConfigError, Error, "A config that could not be read, parsed or accepted.");
create_exception!(weightferry, PipelineError, Error, "A pipeline that cannot be described, or an invalid description.");
create_exception!(weightferry, PlanError, Error, "A valid config that cannot be applied to the pipeline.");
create_exception!(weightferry, OffloadError, Error, "Offloading failed, or was used out of order.");
create_exception!(
    weightferry,
    DeviceError,
    Error,
    "A device that cannot be used: unknown, absent, or not in torch's CUDA context."
);
create_exception!(
    weightferry,
    CheckpointError,
    Error,
    "A checkpoint that cannot be read or does not match the pipeline."
);

fn raise(e: CoreError) -> PyErr {
    match e {
        CoreError::Config(m) => ConfigError::new_err(m),
        CoreError::Pipeline(m) => PipelineError::new_err(m),
        CoreError::Plan(m) => PlanError::new_err(m),
        CoreError::Offload(m) => OffloadError::new_err(m),
        CoreError::Device(m) => DeviceError::new_err(m),
        CoreError::Checkpoint(m) => CheckpointError::new_err(m),
        CoreError::Internal(m) => Error::new_err(m),
    }
}

/// Resolves the offload plan of `pipeline_json` (a pipeline description in the JSON format) under a config and
/// returns the plan report as JSON text (the object `weightferry plan --json` prints). `config_format` is `"json"`,
/// `"toml"` or `"file"` (then `config` is a path to a `.json` / `.toml` file); `name` is the report's `pipeline`
/// (default `"<python>"`). Touches nothing. Raises `ConfigError`, `PipelineError` or `PlanError` with the CLI's
/// message.
#[pyfunction]
#[pyo3(signature = (pipeline_json, config, config_format = "json", name = None))]
fn plan(
    py: Python<'_>,
    pipeline_json: &str,
    config: &str,
    config_format: &str,
    name: Option<&str>,
) -> PyResult<String> {
    let name = name.unwrap_or("<python>");
    py.detach(|| guarded("plan", || api::plan_json(pipeline_json, config, config_format, name))).map_err(raise)
}

/// Validates a config (`config_format` as for `plan`) and returns the strategy it selects: `"none"`, `"model"`,
/// `"layer"` or `"distributed_layer"`. Raises `ConfigError` with the CLI's message.
#[pyfunction]
#[pyo3(signature = (config, config_format = "json"))]
fn check_config(config: &str, config_format: &str) -> PyResult<&'static str> {
    guarded("check_config", || api::config_strategy(config, config_format)).map_err(raise)
}

/// Validates a pipeline description (the JSON format). Raises `PipelineError` with the CLI's message, naming the
/// pipeline `name` (default `"<python>"`).
#[pyfunction]
#[pyo3(signature = (pipeline_json, name = None))]
fn check_pipeline(pipeline_json: &str, name: Option<&str>) -> PyResult<()> {
    let name = name.unwrap_or("<python>");
    guarded("check_pipeline", || api::load_pipeline(pipeline_json, name).map(|_| ())).map_err(raise)
}

/// The tensors of the checkpoint at `path` (a `.safetensors` or `.gguf` file, an index or a folder of shards), as
/// weightferry's reader checks them: a list of `(name, dtype, shape)` in name order, `dtype` in safetensors' names (a
/// GGUF file's quantized tensor is `U8` of shape `[..., row bytes]`). Reads the headers only. Raises
/// `CheckpointError`.
#[pyfunction]
fn checkpoint_tensors(py: Python<'_>, path: &str) -> PyResult<Vec<(String, String, Vec<u64>)>> {
    py.detach(|| guarded("checkpoint_tensors", || api::checkpoint_tensors(path))).map_err(raise)
}

/// Panics inside the guard: exists so the tests can prove a panic reaches Python as `weightferry.Error`.
/// Gives the C heap's free pages back to the system (glibc's `malloc_trim`; a no-op returning `False` elsewhere):
/// called after releasing torch's host copies of the weights, which the allocator would otherwise keep.
#[pyfunction]
fn trim_host_heap(py: Python<'_>) -> bool {
    py.detach(weightferry::platform::host_heap::trim_host_heap)
}

#[pyfunction]
fn _panic_for_test(message: &str) -> PyResult<()> {
    guarded("_panic_for_test", || -> Result<(), CoreError> { panic!("{message}") }).map_err(raise)
}

/// torch's side of a CUDA session: `stream` is torch's current stream on the device (its `cuda_stream`),
/// `probe_ptr` the `data_ptr()` of a live torch tensor there (the shared-context check), `free_bytes` the device's
/// free memory (for `device_budget = "auto"`), `default_cuda` the ordinal `device="cuda"` means. Ignored on the
/// simulated device.
#[pyclass(frozen, module = "weightferry._core", name = "TorchCuda")]
struct PyTorchCuda(api::TorchCuda);

#[pymethods]
impl PyTorchCuda {
    #[new]
    #[pyo3(signature = (*, stream = 0, probe_ptr = 0, free_bytes = 0, default_cuda = 0))]
    fn new(stream: u64, probe_ptr: u64, free_bytes: u64, default_cuda: usize) -> Self {
        PyTorchCuda(api::TorchCuda { stream, probe_ptr, free_bytes, default_cuda })
    }
}

/// How a `Session` is opened: `config_format` (`"json"`, `"toml"` or `"file"`, as for `plan`), `name` (how errors
/// name the pipeline, default `"<python>"`), `device` (`"sim"`, `"cuda"` or `"cuda:N"`), `checkpoints` (a list
/// of `(path, component)`: a safetensors file or sharded folder and the component it fills), `checkpoint_views`
/// (per component, `{name: [(source, start, end), ...] | None}`: its tensors the file names otherwise, as rows of
/// the file's tensors or held by the module), `rendezvous_port` (a
/// distributed session's rendezvous port, when torch.distributed holds `MASTER_PORT`), `torch` (a `TorchCuda`,
/// for a CUDA device) and `sim_faults` (tests: a JSON fault plan for the simulated device).
#[pyclass(frozen, module = "weightferry._core", name = "SessionOptions")]
struct PySessionOptions(api::SessionOptions);

#[pymethods]
impl PySessionOptions {
    #[new]
    #[pyo3(signature = (**kwargs))]
    fn new(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let mut o = api::SessionOptions::default();
        for (key, value) in kwargs.into_iter().flat_map(|k| k.iter()) {
            let key: String = key.extract()?;
            match key.as_str() {
                "config_format" => o.config_format = value.extract()?,
                "name" => o.name = value.extract()?,
                "device" => o.device = value.extract()?,
                "checkpoints" => o.checkpoints = value.extract()?,
                "checkpoint_views" => o.checkpoint_views = value.extract()?,
                "rendezvous_port" => o.rendezvous_port = value.extract()?,
                "torch" => {
                    let torch: Option<PyRef<'_, PyTorchCuda>> = value.extract()?;
                    o.torch = torch.map(|t| t.0).unwrap_or_default();
                }
                "sim_faults" => o.sim_faults = value.extract()?,
                other => {
                    return Err(PyTypeError::new_err(format!(
                        "SessionOptions() got an unexpected keyword argument '{other}'"
                    )))
                }
            }
        }
        Ok(PySessionOptions(o))
    }
}

/// One pipeline offloaded on the simulated device (see `weightferry.enable`, which drives it). Every method raises
/// a subclass of `weightferry.Error`.
#[pyclass(frozen, module = "weightferry._core", name = "Session")]
struct PySession {
    inner: Mutex<api::Session>,
}

impl PySession {
    fn lock(&self) -> Result<MutexGuard<'_, api::Session>, CoreError> {
        self.inner.lock().map_err(|_| {
            CoreError::Internal("this weightferry session failed inside an earlier call (a bug) and is unusable".into())
        })
    }

    /// Runs `f` on the session without the GIL, under the panic guard.
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        entry: &str,
        f: impl FnOnce(&mut api::Session) -> Result<T, CoreError> + Send,
    ) -> PyResult<T> {
        py.detach(|| guarded(entry, || f(&mut *self.lock()?))).map_err(raise)
    }
}

#[pymethods]
impl PySession {
    /// Resolves the plan (raising `ConfigError`, `PipelineError` or `PlanError` before anything is allocated),
    /// opens the device `options.device` names (`DeviceError`) and builds a zero-filled host model, or one read
    /// from `options.checkpoint` (`CheckpointError` on a mismatch). See `SessionOptions` and `TorchCuda`.
    #[new]
    #[pyo3(signature = (pipeline_json, config, options = None))]
    fn new(
        py: Python<'_>,
        pipeline_json: &str,
        config: &str,
        options: Option<&PySessionOptions>,
    ) -> PyResult<PySession> {
        let options = options.map(|o| o.0.clone()).unwrap_or_default();
        let session =
            py.detach(|| guarded("Session", || api::Session::new(pipeline_json, config, &options))).map_err(raise)?;
        Ok(PySession { inner: Mutex::new(session) })
    }

    /// The plan report as JSON text (what `plan` returns).
    fn plan_json(&self, py: Python<'_>) -> PyResult<String> {
        self.run(py, "Session.plan_json", |s| Ok(s.plan_json().to_string()))
    }

    /// `[(tensor path, storage id)]` of every tensor, depth first.
    fn tensor_storages(&self, py: Python<'_>) -> PyResult<Vec<(String, u64)>> {
        self.run(py, "Session.tensor_storages", |s| Ok(s.tensor_storages()))
    }

    /// `[(storage id, bytes, unit module path or None for the fixed placement)]`, in id order.
    fn storages(&self, py: Python<'_>) -> PyResult<Vec<(u64, u64, Option<String>)>> {
        self.run(py, "Session.storages", |s| Ok(s.storages()))
    }

    /// Fills a storage's host bytes (`bytes` of exactly its size).
    fn write_storage(&self, py: Python<'_>, storage: u64, data: &[u8]) -> PyResult<()> {
        self.run(py, "Session.write_storage", |s| s.write_storage(storage, data))
    }

    /// Fills a storage's host bytes from `len` bytes at host address `address`, read in place. Private to the
    /// package: `address` must be the `data_ptr()` of a live CPU tensor storage of at least `len` bytes, which the
    /// caller keeps referenced and does not write during the call.
    fn _write_storage_at(&self, py: Python<'_>, storage: u64, address: u64, len: u64) -> PyResult<()> {
        if address == 0 && len > 0 {
            return Err(raise(CoreError::Offload(format!("storage {storage}: null address for {len} bytes"))));
        }
        // SAFETY: the package's contract above: enable passes the `data_ptr()` and exact `nbytes()` of a CPU tensor
        // storage it holds a reference to for the call, and no code of the package writes it meanwhile.
        self.run(py, "Session._write_storage_at", |s| unsafe { s.write_storage_from(storage, address, len) })
    }

    /// Writes new bytes for storages from `[(storage, address, len)]`, each read in place (while enabled: through to
    /// weightferry's host copy and every device copy). Private to the package: each `address` must be the
    /// `data_ptr()` of a live CPU tensor storage of at least `len` bytes, which the caller keeps referenced and does
    /// not write during the call.
    fn _write_weights_at(&self, py: Python<'_>, items: Vec<(u64, u64, u64)>) -> PyResult<()> {
        // SAFETY: the package's contract above: `_writes.py` passes the `data_ptr()` and exact `nbytes()` of CPU
        // tensors it holds references to for the call, and no code of the package writes them meanwhile.
        self.run(py, "Session._write_weights_at", |s| unsafe { s.write_weights_from(&items) })
    }

    /// The storages of `[(storage, address, len)]` whose bytes, read in place, differ from the session's (its
    /// checkpoint file's, before enable), in the order given. Private to the package: each `address` must be the
    /// `data_ptr()` of a live CPU tensor storage of at least `len` bytes, which the caller keeps referenced and does
    /// not write during the call.
    fn _differing_at(&self, py: Python<'_>, items: Vec<(u64, u64, u64)>) -> PyResult<Vec<u64>> {
        // SAFETY: the package's contract above: `_enable.py` passes the `data_ptr()` and exact `nbytes()` of CPU
        // tensor storages it holds references to for the call, and no code of the package writes them meanwhile.
        self.run(py, "Session._differing_at", |s| unsafe { s.differing_from(&items) })
    }

    /// Offloads (transactional); returns whether anything is offloaded.
    fn enable(&self, py: Python<'_>) -> PyResult<bool> {
        self.run(py, "Session.enable", api::Session::enable)
    }

    /// Retunes the enabled backend to a new config (`config_format` as for `plan`; `free_bytes` for an auto budget
    /// on CUDA; `reserved_bytes`: device bytes outside the plan, such as adapter layers added after enable, that a
    /// byte-count `device_budget` must hold too): depths, resident layers, budget, masters kept. Returns the new plan
    /// report as JSON text.
    #[pyo3(signature = (config, config_format = "json", free_bytes = 0, reserved_bytes = 0))]
    fn retune(
        &self,
        py: Python<'_>,
        config: &str,
        config_format: &str,
        free_bytes: u64,
        reserved_bytes: u64,
    ) -> PyResult<String> {
        self.run(py, "Session.retune", |s| s.retune(config, config_format, free_bytes, reserved_bytes))
    }

    /// Whether the backend is enabled.
    fn is_enabled(&self, py: Python<'_>) -> PyResult<bool> {
        self.run(py, "Session.is_enabled", |s| Ok(s.is_enabled()))
    }

    /// The unit module paths of each stack with a static schedule (`static_slots`), in execution order; empty while
    /// not enabled.
    fn static_stacks(&self, py: Python<'_>) -> PyResult<Vec<Vec<String>>> {
        self.run(py, "Session.static_stacks", |s| Ok(s.static_stacks()))
    }

    /// The modules with offload hooks (dotted paths), sorted.
    fn hooked_modules(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.run(py, "Session.hooked_modules", |s| Ok(s.hooked_modules()))
    }

    /// Runs the module's pre-forward hooks and waits until its bytes are on the device: `None`, or
    /// `(buffer, base, [(storage id, offset in the block)])`, the list empty unless `with_offsets`.
    #[pyo3(signature = (module, with_offsets = true))]
    fn pre_forward(&self, py: Python<'_>, module: &str, with_offsets: bool) -> PyResult<Option<ResidencyParts>> {
        self.run(py, "Session.pre_forward", |s| s.pre_forward(module, with_offsets))
    }

    /// Storages not written yet, in id order (opened from a checkpoint: its non-persistent buffers).
    fn unwritten(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.run(py, "Session.unwritten", |s| Ok(s.unwritten()))
    }

    /// Runs the module's post-forward hooks.
    fn post_forward(&self, py: Python<'_>, module: &str) -> PyResult<()> {
        self.run(py, "Session.post_forward", |s| s.post_forward(module))
    }

    /// `(buffer, offset)` of a storage on the device.
    fn locate(&self, py: Python<'_>, storage: u64) -> PyResult<(u64, u64)> {
        self.run(py, "Session.locate", |s| s.locate(storage))
    }

    /// A copy of `len` bytes of simulated device memory, as a `bytearray`.
    fn read_device<'py>(
        &self,
        py: Python<'py>,
        buffer: u64,
        offset: u64,
        len: u64,
    ) -> PyResult<Bound<'py, PyByteArray>> {
        let bytes = self.run(py, "Session.read_device", |s| s.read_device(buffer, offset, len))?;
        Ok(PyByteArray::new(py, &bytes))
    }

    /// `(device address, bytes)` of a CUDA device buffer.
    fn device_ptr(&self, py: Python<'_>, buffer: u64) -> PyResult<(u64, u64)> {
        self.run(py, "Session.device_ptr", |s| s.device_ptr(buffer))
    }

    /// What a captured CUDA graph copies for static unit `module`: where its bytes are now (`(buffer, offset)`, if
    /// anywhere), and `(host buffer, offset in it, offset in the block, bytes)` of each flat copy. Touches no device.
    fn capture_copies(&self, py: Python<'_>, module: &str) -> PyResult<weightferry::session::CaptureCopies> {
        self.run(py, "Session.capture_copies", |s| s.capture_copies(module))
    }

    /// The address a CUDA device copy reads host buffer `buffer` at (page-locked memory only).
    fn host_address(&self, py: Python<'_>, buffer: u64) -> PyResult<u64> {
        self.run(py, "Session.host_address", |s| s.host_address(buffer))
    }

    /// A copy of `len` bytes of a simulated host buffer, as a `bytearray`.
    fn read_host<'py>(&self, py: Python<'py>, buffer: u64, offset: u64, len: u64) -> PyResult<Bound<'py, PyByteArray>> {
        let bytes = self.run(py, "Session.read_host", |s| s.read_host(buffer, offset, len))?;
        Ok(PyByteArray::new(py, &bytes))
    }

    /// Writes `data` into simulated device memory at `offset` of `buffer`.
    fn write_device(&self, py: Python<'_>, buffer: u64, offset: u64, data: &[u8]) -> PyResult<()> {
        self.run(py, "Session.write_device", |s| s.write_device(buffer, offset, data))
    }

    /// Blocks until every load issued so far and every released slot's last use have completed.
    fn fence(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, "Session.fence", |s| s.fence())
    }

    /// Whether the session drives a CUDA device.
    fn is_cuda(&self, py: Python<'_>) -> PyResult<bool> {
        self.run(py, "Session.is_cuda", |s| Ok(s.is_cuda()))
    }

    /// Disables offload: every storage gets its own host buffer back, bit-identical.
    fn disable(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, "Session.disable", api::Session::disable)
    }

    /// A storage's host bytes, as a `bytearray`.
    fn read_storage<'py>(&self, py: Python<'py>, storage: u64) -> PyResult<Bound<'py, PyByteArray>> {
        let bytes = self.run(py, "Session.read_storage", |s| s.read_storage(storage))?;
        Ok(PyByteArray::new(py, &bytes))
    }

    /// The simulated device's recorded ordering violations (debug text each); empty when every order held.
    fn hazard_violations(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.run(py, "Session.hazard_violations", |s| Ok(s.hazard_violations()))
    }

    /// The backend's report as JSON text.
    fn report(&self, py: Python<'_>) -> PyResult<String> {
        self.run(py, "Session.report", |s| s.report_json())
    }
}

/// The module `weightferry._core`.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("Error", py.get_type::<Error>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("PipelineError", py.get_type::<PipelineError>())?;
    m.add("PlanError", py.get_type::<PlanError>())?;
    m.add("OffloadError", py.get_type::<OffloadError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("CheckpointError", py.get_type::<CheckpointError>())?;
    // The deprecated scan's component names, by the description's `components` key: Python's discovery falls back
    // to them for modules whose class says nothing of what they are, so Rust and Python share one list.
    let names = pyo3::types::PyDict::new(py);
    names.set_item("dit", weightferry::plan::discovery::FALLBACK_DIT_NAMES.to_vec())?;
    names.set_item("encoders", weightferry::plan::discovery::FALLBACK_ENCODER_NAMES.to_vec())?;
    names.set_item("vaes", weightferry::plan::discovery::FALLBACK_VAE_NAMES.to_vec())?;
    m.add("FALLBACK_COMPONENT_NAMES", names)?;
    m.add_class::<PySession>()?;
    m.add_class::<PySessionOptions>()?;
    m.add_class::<PyTorchCuda>()?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(check_config, m)?)?;
    m.add_function(wrap_pyfunction!(check_pipeline, m)?)?;
    m.add_function(wrap_pyfunction!(checkpoint_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(trim_host_heap, m)?)?;
    m.add_function(wrap_pyfunction!(_panic_for_test, m)?)?;
    Ok(())
}
