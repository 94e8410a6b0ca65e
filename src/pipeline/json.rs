//! The pipeline JSON file format: [`load_pipeline_json`], [`load_pipeline_file`] and [`to_pipeline_json`].
//!
//! A pipeline file describes the module tree (modules, block lists, tensors and which tensors share storage) and
//! the pipeline's declarations. It holds metadata only, never weight values. Object keys keep the order they are
//! written in: the order of modules and tensors is their declaration (= execution) order.
//!
//! # Example
//!
//! ```
//! use weightferry::pipeline::json::{load_pipeline_json, to_pipeline_json};
//!
//! let text = r#"{
//!   "format": "weightferry-pipeline/1",
//!   "class": "TinyPipeline",
//!   "modules": {
//!     "transformer": {
//!       "class": "TinyDiT",
//!       "tensors": {
//!         "rope_freqs": {"dtype": "f32", "shape": [64, 8], "kind": "non_persistent_buffer"}
//!       },
//!       "children": {
//!         "x_embedder": {"class": "Linear", "tensors": {
//!           "weight": {"dtype": "bf16", "shape": [32, 16]},
//!           "bias": {"dtype": "bf16", "shape": [32]}
//!         }},
//!         "blocks": {"repeat": 4, "block": {"class": "TinyBlock", "children": {
//!           "fc": {"class": "Linear", "tensors": {"weight": {"dtype": "bf16", "shape": [32, 32]}}}
//!         }}},
//!         "proj_out": {"class": "Linear", "tensors": {
//!           "weight": {"dtype": "bf16", "shape": [16, 32], "strides": [1, 16]}
//!         }},
//!         "proj_alias": {"class": "Linear", "tensors": {
//!           "weight": {"dtype": "bf16", "shape": [32, 32], "tied_to": "transformer.blocks.0.fc.weight"}
//!         }}
//!       }
//!     },
//!     "vae": {"class": "TinyVAE", "has_lifecycle": true, "tensors": {
//!       "enc": {"dtype": "bf16", "shape": [8, 3, 3, 3], "storage": "vae_flat"},
//!       "dec": {"dtype": "bf16", "shape": [3, 8, 3, 3], "storage": "vae_flat", "storage_offset": 216}
//!     }}
//!   },
//!   "storages": {"vae_flat": {"dtype": "bf16", "numel": 432}},
//!   "components": {"dit": ["transformer"], "vaes": ["vae"]},
//!   "offload_plan": {"block_attrs": {"transformer": ["blocks"]}, "on_demand_component_paths": ["vae"]},
//!   "class_block_attrs": {"TinyDiT": ["blocks"]}
//! }"#;
//! let desc = load_pipeline_json(text).expect("valid");
//! assert_eq!(desc.module("transformer.blocks").map(|m| m.children.len()), Some(4));
//! assert_eq!(load_pipeline_json(&to_pipeline_json(&desc)), Ok(desc));
//! ```
//!
//! # Reference
//!
//! **Top level** (an object):
//!
//! | key | required | meaning |
//! | --- | --- | --- |
//! | `format` | no | `"weightferry-pipeline/1"`, the only version |
//! | `class` | yes | the pipeline class (declarations and warnings key on it) |
//! | `modules` | no | the root module's children: attribute name → module, in order |
//! | `tensors` | no | the root module's own tensors: attribute name → tensor |
//! | `root_class`, `root_has_lifecycle`, `root_is_loaded` | no | the root module's class (default: `class`) and flags |
//! | `storages` | no | storage name → `{"dtype": …, "numel": …}`, for storages several views share |
//! | `components` | no | `dit`, `encoders`, `vaes`, `resident`, `auxiliary`: arrays of dotted paths. Absent (or `null`) means the pipeline declares none (the deprecated attribute scan) |
//! | `offload_plan` | no | `block_attrs` and `encoder_block_attrs` (path → array of relative paths), `on_demand_component_paths`, `resident_dit_paths`, `encoder_dlo_weight_replication` (arrays of paths), `offload_submodules` (DiT path → {child name → block attribute}), `encoder_component_types` (encoder path → type), `resident_encoder_block_paths` (array of full block-list paths), the deprecated `layerwise_resident_layers` (DiT path → count); `encoder_host_resident_table_attrs` is refused with its replacement. Absent (or `null`) means no plan |
//! | `class_block_attrs` | no | DiT class → array of block-list attributes (`_layerwise_offload_blocks_attrs`) |
//! | `class_block_attr` | no | DiT class → one block-list attribute (the deprecated singular form) |
//!
//! **Module** (an object): `class` (required, non-empty), `has_lifecycle` (default `false`: the module implements
//! `load_to_device` / `offload_to_cpu`), `is_loaded` (default `true`; `false` for an unloaded stub), `tensors`
//! (attribute name → tensor) and `children` (attribute name → module). Tensors and children share one namespace.
//! Names are non-empty, without `.`, spaces or control characters (torch's rule); a block list's children are named `0`, `1`, ….
//!
//! **Block list shorthand**: `{"repeat": N, "block": {module}}` is a list of class `ModuleList` (or the given
//! `class`, with optional `has_lifecycle` / `is_loaded`) whose children `0` … `N-1` are copies of the `block`
//! template. `N` is 1 to [`MAX_REPEAT`]. An optional `children` object gives leading blocks that differ from the
//! rest; they must be named `0` … `K-1`, and the copies then take the names `K` … `K+N-1`. A `tied_to` inside the
//! template names the same absolute path in every copy. A repeat has no `tensors`.
//!
//! **Tensor** (an object):
//!
//! | key | required | meaning |
//! | --- | --- | --- |
//! | `dtype` | yes | `f32`, `f16`, `bf16`, `f8e4m3`, `f8e5m2`, `i64`, `i32`, `i8` or `u8` |
//! | `shape` | yes | array of extents (`[]` for a scalar) |
//! | `strides` | no | strides in elements, one per dimension; default row-major contiguous |
//! | `kind` | no | `parameter` (default), `persistent_buffer` or `non_persistent_buffer` |
//! | `storage_offset` | no | first element's offset in the storage, default 0 |
//! | `tied_to` | no | dotted path from the root of another tensor; this tensor views that tensor's storage |
//! | `storage` | no | name of an entry in `storages`; this tensor views it |
//!
//! Without `tied_to` or `storage` a tensor owns a storage of exactly `storage_offset + span` elements, where the
//! span is `1 + Σ (extent − 1) · stride` (0 for an empty tensor). Every view must fit inside its storage and have
//! the storage's dtype. Storage ids are assigned depth first (a module's tensors, then its children), in order of
//! first appearance, from 0 — the same order as the builder, so `load_pipeline_json(&to_pipeline_json(&p)) == p`
//! for every valid `p` with canonical ids (see [`PipelineDesc::canonicalize_storage_ids`]).
//!
//! **Errors** name the JSON path of the offending value, with dots between keys and `[i]` for array elements
//! (`modules.transformer.children.blocks.repeat`, `components.dit[0]`), and say how to fix it. Limits: JSON nesting
//! up to 128 levels (each module level takes two, so modules nest about 60 deep), [`MAX_REPEAT`] copies per repeat, [`MAX_NODES`] modules and tensors after expansion; sizes
//! must fit in 64 bits.

mod parse;
mod tree;
mod value;
mod write;

use crate::pipeline::{PipelineDesc, PipelineError};
use crate::textfile::{read_text_capped, MAX_PIPELINE_FILE_BYTES};
use std::path::Path;
use value::Json;

/// The only `format` value this version reads and writes.
pub(crate) const FORMAT: &str = "weightferry-pipeline/1";

/// Largest `repeat` count.
pub const MAX_REPEAT: u64 = 65_536;

/// Largest number of modules plus tensors a file may expand to.
pub const MAX_NODES: u64 = 1 << 20;

/// Parses and validates a pipeline description from JSON text.
pub fn load_pipeline_json(text: &str) -> Result<PipelineDesc, PipelineError> {
    let value: Json = serde_json::from_str(text).map_err(|e| PipelineError::Syntax {
        line: e.line(),
        column: e.column(),
        message: strip_position(&e.to_string()),
    })?;
    parse::parse_document(&value)
}

/// Reads a pipeline description from a JSON file (see [`load_pipeline_json`]).
pub fn load_pipeline_file(path: &Path) -> Result<PipelineDesc, PipelineError> {
    let text = read_text_capped(path, MAX_PIPELINE_FILE_BYTES, "pipeline description")
        .map_err(|e| PipelineError::Io { path: path.display().to_string(), message: e.to_string() })?;
    load_pipeline_json(&text)
}

/// Writes a pipeline description as JSON. Block lists of identical blocks are written with `repeat`; storages
/// shared by views are written as `tied_to` the first view when that view spans the whole storage, and as named
/// `storages` entries otherwise.
pub fn to_pipeline_json(p: &PipelineDesc) -> String {
    let value = write::render_document(p);
    let mut out = String::new();
    write::write_value(&value, 0, &mut out);
    out.push('\n');
    out
}

/// serde_json appends " at line L column C"; the position is reported separately.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(i) => message[..i].to_string(),
        None => message.to_string(),
    }
}
