//! The structural rules every pipeline description obeys, checked by
//! [`PipelineBuilder::build`](super::builder::PipelineBuilder::build), by the JSON loader and by
//! [`PipelineDesc::validate`]; and the per-view checks the builder and the loader share.

use super::{
    join, ComponentDecls, DType, ModuleNode, OffloadPlanDecl, PipelineDesc, PipelineError, StorageDesc, StorageId,
};
use std::collections::{BTreeMap, BTreeSet};

/// Whether `name` is a valid attribute name: torch's rule for module and tensor names (non-empty, no `.`, which
/// joins the segments of a path), without whitespace or control characters, so a `ModuleDict` key such as `2-1`
/// is a name.
pub(crate) fn is_valid_name(name: &str) -> bool {
    !name.is_empty() && !name.chars().any(|c| c == '.' || c.is_whitespace() || c.is_control())
}

/// Whether `path` is a valid dotted path: one or more valid names joined by single dots.
pub(crate) fn is_valid_path(path: &str) -> bool {
    !path.is_empty() && path.split('.').all(is_valid_name)
}

/// Checked element count of `shape` (product of the extents).
fn checked_numel(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &s| acc.checked_mul(s))
}

/// Checked span of a view in its storage: `1 + Σ (size−1)·stride`, 0 for an empty tensor. `shape` and `strides`
/// must have equal lengths.
pub(crate) fn checked_span(shape: &[u64], strides: &[u64]) -> Option<u64> {
    if shape.contains(&0) {
        return Some(0);
    }
    shape.iter().zip(strides).try_fold(1u64, |acc, (&s, &st)| (s - 1).checked_mul(st).and_then(|d| acc.checked_add(d)))
}

/// Checks the per-view rules that need no storage: stride count and 64-bit sizes. Returns the storage elements the
/// view needs (`storage_offset + span`).
pub(crate) fn check_view(
    at: &str,
    dtype: DType,
    shape: &[u64],
    strides: &[u64],
    storage_offset: u64,
) -> Result<u64, PipelineError> {
    if shape.len() != strides.len() {
        return Err(PipelineError::StrideRank {
            at: at.to_string(),
            shape_len: shape.len(),
            strides_len: strides.len(),
        });
    }
    let overflow = |what| PipelineError::Overflow { at: at.to_string(), what };
    let numel = checked_numel(shape).ok_or_else(|| overflow("the element count"))?;
    numel.checked_mul(dtype.size_bytes()).ok_or_else(|| overflow("the byte size"))?;
    let span = checked_span(shape, strides).ok_or_else(|| overflow("the storage span"))?;
    storage_offset.checked_add(span).ok_or_else(|| overflow("storage_offset + span"))
}

/// Checks the storage-dependent rules of one view: dtype equality and fit.
pub(crate) fn check_fit(at: &str, dtype: DType, needed: u64, storage: &StorageDesc) -> Result<(), PipelineError> {
    if dtype != storage.dtype {
        return Err(PipelineError::DTypeMismatch { at: at.to_string(), tensor: dtype, storage: storage.dtype });
    }
    if needed > storage.numel {
        return Err(PipelineError::ViewOutsideStorage { at: at.to_string(), needed, numel: storage.numel });
    }
    Ok(())
}

fn check_path_at(at: String, path: &str) -> Result<(), PipelineError> {
    if is_valid_path(path) {
        Ok(())
    } else {
        Err(PipelineError::InvalidPath { at, path: path.to_string() })
    }
}

fn check_path_list(at: &str, paths: &[String]) -> Result<(), PipelineError> {
    for (i, p) in paths.iter().enumerate() {
        check_path_at(format!("{at}[{i}]"), p)?;
    }
    Ok(())
}

fn check_path_map(at: &str, map: &BTreeMap<String, Vec<String>>) -> Result<(), PipelineError> {
    for (key, paths) in map {
        check_path_at(at.to_string(), key)?;
        check_path_list(&format!("{at}.{key}"), paths)?;
    }
    Ok(())
}

/// Checks that every declared path is a valid dotted path. Error locations use the JSON notation
/// (`components.dit[0]`, `offload_plan.block_attrs.transformer[1]`).
pub(crate) fn check_declarations(
    components: Option<&ComponentDecls>,
    plan: Option<&OffloadPlanDecl>,
    class_block_attrs: &BTreeMap<String, Vec<String>>,
    class_block_attr_singular: &BTreeMap<String, String>,
) -> Result<(), PipelineError> {
    if let Some(c) = components {
        check_path_list("components.dit", &c.dit)?;
        check_path_list("components.encoders", &c.encoders)?;
        check_path_list("components.vaes", &c.vaes)?;
        check_path_list("components.resident", &c.resident)?;
        check_path_list("components.auxiliary", &c.auxiliary)?;
    }
    if let Some(p) = plan {
        check_path_map("offload_plan.block_attrs", &p.block_attrs)?;
        check_path_map("offload_plan.encoder_block_attrs", &p.encoder_block_attrs)?;
        check_path_list("offload_plan.on_demand_component_paths", &p.on_demand_component_paths)?;
        check_path_list("offload_plan.resident_dit_paths", &p.resident_dit_paths)?;
        check_path_list("offload_plan.encoder_dlo_weight_replication", &p.encoder_dlo_weight_replication)?;
        for (dit, subs) in &p.offload_submodules {
            check_path_at("offload_plan.offload_submodules".to_string(), dit)?;
            let at = format!("offload_plan.offload_submodules.{dit}");
            for (child, attr) in subs {
                if !is_valid_name(child) {
                    return Err(PipelineError::InvalidName { at, name: child.clone() });
                }
                check_path_at(format!("{at}.{child}"), attr)?;
            }
        }
        for key in p.encoder_component_types.keys() {
            check_path_at("offload_plan.encoder_component_types".to_string(), key)?;
        }
        check_path_list("offload_plan.resident_encoder_block_paths", &p.resident_encoder_block_paths)?;
        for key in p.layerwise_resident_layers.keys() {
            check_path_at("offload_plan.layerwise_resident_layers".to_string(), key)?;
        }
    }
    for (class, attrs) in class_block_attrs {
        if class.is_empty() {
            return Err(PipelineError::EmptyClass { at: "class_block_attrs".to_string() });
        }
        check_path_list(&format!("class_block_attrs.{class}"), attrs)?;
    }
    for (class, attr) in class_block_attr_singular {
        if class.is_empty() {
            return Err(PipelineError::EmptyClass { at: "class_block_attr".to_string() });
        }
        check_path_at(format!("class_block_attr.{class}"), attr)?;
    }
    Ok(())
}

pub(super) fn module_at(path: &str) -> String {
    if path.is_empty() {
        "<root>".to_string()
    } else {
        path.to_string()
    }
}

impl PipelineDesc {
    /// Checks every structural rule. Locations are dotted module/tensor paths, or `storage N` for a storage, or
    /// JSON-style paths for declarations.
    ///
    /// The rules:
    /// - class names are non-empty; attribute names are non-empty, without `.`, spaces or control characters;
    /// - a module never has two attributes (tensors and children together) with the same name;
    /// - every tensor has one stride per dimension, its sizes fit in 64 bits, its dtype equals its storage's dtype,
    ///   and its view lies inside its storage (`storage_offset + physical_numel <= storage numel`);
    /// - every storage is viewed by at least one tensor;
    /// - every declared path (components, offload plan, per-class block attributes) is a valid dotted path.
    pub fn validate(&self) -> Result<(), PipelineError> {
        if self.class.is_empty() {
            return Err(PipelineError::EmptyClass { at: "class".to_string() });
        }
        let mut total = 0u64;
        for (id, s) in &self.storages {
            let at = format!("storage {}", id.0);
            let bytes = s
                .numel
                .checked_mul(s.dtype.size_bytes())
                .ok_or(PipelineError::Overflow { at: at.clone(), what: "the byte size" })?;
            total = total
                .checked_add(bytes)
                .ok_or(PipelineError::Overflow { at, what: "the total byte size of all storages" })?;
        }
        let mut used = BTreeSet::new();
        let mut stack = vec![(String::new(), &self.root)];
        while let Some((path, m)) = stack.pop() {
            self.validate_module(&path, m, &mut used)?;
            for (name, c) in m.children.iter().rev() {
                stack.push((join(&path, name), c));
            }
        }
        if let Some(id) = self.storages.keys().find(|id| !used.contains(*id)) {
            return Err(PipelineError::UnusedStorage { at: format!("storage {}", id.0) });
        }
        check_path_list("pinned", &self.pinned)?;
        if let Some((i, p)) = self.pinned.iter().enumerate().find(|(_, p)| self.module(p).is_none()) {
            return Err(PipelineError::UnknownModule { at: format!("pinned[{i}]"), path: p.clone() });
        }
        check_declarations(
            self.components.as_ref(),
            self.offload_plan.as_ref(),
            &self.class_block_attrs,
            &self.class_block_attr_singular,
        )
    }

    fn validate_module(&self, path: &str, m: &ModuleNode, used: &mut BTreeSet<StorageId>) -> Result<(), PipelineError> {
        if m.class.is_empty() {
            return Err(PipelineError::EmptyClass { at: module_at(path) });
        }
        let mut names = BTreeSet::new();
        let attr_names = m.tensors.iter().map(|t| t.name.as_str()).chain(m.children.iter().map(|(n, _)| n.as_str()));
        for name in attr_names {
            if !is_valid_name(name) {
                return Err(PipelineError::InvalidName { at: module_at(path), name: name.to_string() });
            }
            if !names.insert(name) {
                return Err(PipelineError::DuplicateName { at: join(path, name) });
            }
        }
        for t in &m.tensors {
            let at = join(path, &t.name);
            let needed = check_view(&at, t.dtype, &t.shape, &t.strides, t.storage_offset)?;
            let storage = self
                .storages
                .get(&t.storage)
                .ok_or(PipelineError::MissingStorage { at: at.clone(), id: t.storage.0 })?;
            check_fit(&at, t.dtype, needed, storage)?;
            used.insert(t.storage);
        }
        Ok(())
    }
}
