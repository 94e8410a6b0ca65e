//! The one-owner rule for blocks: no block is claimed by two stacks, listed twice, nested inside another claimed
//! block, or reached a second time through tied weights.

use super::PlanError;
use crate::pipeline::PipelineDesc;
use crate::plan::resolved::ResolvedComponent;
use std::collections::BTreeMap;

/// Rejects a block claimed twice, by path or through tied weights, among the blocks of `comps`.
pub(super) fn check_unique_block_owners<'a>(
    p: &PipelineDesc,
    comps: impl Iterator<Item = &'a ResolvedComponent> + Clone,
) -> Result<(), PlanError> {
    let mut owner: BTreeMap<&str, &str> = BTreeMap::new();
    fn visit<'a>(c: &'a ResolvedComponent, owner: &mut BTreeMap<&'a str, &'a str>) -> Result<(), PlanError> {
        for b in c.block_paths() {
            if let Some(prev) = owner.insert(b.as_str(), c.path.as_str()) {
                if prev != c.path {
                    return Err(PlanError(format!(
                        "Offload block '{b}' is claimed by both '{prev}' and '{}'; declare one owner for each block list",
                        c.path
                    )));
                }
                return Err(PlanError(format!(
                    "Offload block '{b}' is listed twice in the block lists of '{}'; declare each block list once",
                    c.path
                )));
            }
        }
        for ch in &c.children {
            visit(ch, owner)?;
        }
        Ok(())
    }
    for c in comps.clone() {
        visit(c, &mut owner)?;
    }
    // A block nested inside another claimed block is also a double claim.
    let keys: Vec<&str> = owner.keys().copied().collect();
    for w in keys.windows(2) {
        if w[1].starts_with(w[0]) && w[1].as_bytes().get(w[0].len()) == Some(&b'.') {
            return Err(PlanError(format!(
                "Offload block '{}' lies inside block '{}' (claimed by '{}' and '{}'); declare one owner for each block \
                 list",
                w[1], w[0], owner[w[0]], owner[w[1]]
            )));
        }
    }
    // The same block reached a second time through tied weights.
    check_tied_blocks(p, comps)
}

/// The weights a block views: every tensor's storage, offset, shape and strides, as a set (names do not matter).
type BlockViews = std::collections::BTreeSet<(crate::pipeline::StorageId, u64, Vec<u64>, Vec<u64>)>;

/// Rejects a block reached twice through tied weights: two blocks (of any stacks, in any components) that view
/// exactly the same weights are one block claimed twice, however they are reached.
fn check_tied_blocks<'a>(
    p: &PipelineDesc,
    comps: impl Iterator<Item = &'a ResolvedComponent>,
) -> Result<(), PlanError> {
    let mut seen: BTreeMap<BlockViews, (&str, &str)> = BTreeMap::new();
    fn visit<'a>(
        p: &PipelineDesc,
        c: &'a ResolvedComponent,
        seen: &mut BTreeMap<BlockViews, (&'a str, &'a str)>,
    ) -> Result<(), PlanError> {
        for b in c.block_paths() {
            let views: BlockViews = p
                .module(b)
                .map(|m| {
                    m.tensors_recursive()
                        .into_iter()
                        .map(|(_, t)| (t.storage, t.storage_offset, t.shape.clone(), t.strides.clone()))
                        .collect()
                })
                .unwrap_or_default();
            if views.is_empty() {
                continue;
            }
            if let Some((prev, prev_owner)) = seen.get(&views) {
                return Err(PlanError(format!(
                    "Offload block '{b}' (of '{}') views exactly the weights of block '{prev}' (of '{prev_owner}'): \
                     the same block is claimed twice through tied weights; declare one owner for each block list",
                    c.path
                )));
            }
            seen.insert(views, (b.as_str(), c.path.as_str()));
        }
        for ch in &c.children {
            visit(p, ch, seen)?;
        }
        Ok(())
    }
    for c in comps {
        visit(p, c, &mut seen)?;
    }
    Ok(())
}
