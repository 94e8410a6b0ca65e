//! The pyo3 module `weightferry._core` (feature `python`): the exception classes (`weightferry.Error` and its
//! subclasses) and thin functions over [`crate::api`]. Every function runs its Rust work under
//! [`crate::api::guarded`], so a panic reaches Python as `weightferry.Error`, never as pyo3's `PanicException` (a
//! `BaseException` that `except Exception` does not catch).

use crate::api::{self, guarded, CoreError};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(weightferry, Error, PyException, "Base class of every error weightferry raises.");
create_exception!(weightferry, ConfigError, Error, "A config that could not be read, parsed or accepted.");
create_exception!(weightferry, PipelineError, Error, "A pipeline that cannot be described, or an invalid description.");
create_exception!(weightferry, PlanError, Error, "A valid config that cannot be applied to the pipeline.");

fn raise(e: CoreError) -> PyErr {
    match e {
        CoreError::Config(m) => ConfigError::new_err(m),
        CoreError::Pipeline(m) => PipelineError::new_err(m),
        CoreError::Plan(m) => PlanError::new_err(m),
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

/// Panics inside the guard: exists so the tests can prove a panic reaches Python as `weightferry.Error`.
#[pyfunction]
fn _panic_for_test(message: &str) -> PyResult<()> {
    guarded("_panic_for_test", || -> Result<(), CoreError> { panic!("{message}") }).map_err(raise)
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
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(check_config, m)?)?;
    m.add_function(wrap_pyfunction!(check_pipeline, m)?)?;
    m.add_function(wrap_pyfunction!(_panic_for_test, m)?)?;
    Ok(())
}
