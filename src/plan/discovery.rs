//! Component discovery: which modules of a pipeline are DiTs, encoders, VAEs and residents, and which block lists
//! each DiT declares.
//!
//! Declarations win over the deprecated fallback attribute scan. Discovery reads the description only; its
//! warnings are returned as values (and logged), so the same input always gives the same answer.

use crate::diag::warn_once;
use crate::pipeline::{join, ModuleNode, PipelineDesc};

/// Attribute names the deprecated scan treats as DiTs.
pub const FALLBACK_DIT_NAMES: &[&str] =
    &["transformer", "transformer_2", "dit", "sr_dit", "language_model", "transformer_blocks", "model"];
/// Attribute names the deprecated scan treats as encoders.
pub const FALLBACK_ENCODER_NAMES: &[&str] =
    &["text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder", "mllm"];
/// Attribute names the deprecated scan treats as VAEs.
pub const FALLBACK_VAE_NAMES: &[&str] = &["vae", "audio_vae"];

/// Components found in a pipeline, by dotted path, in declaration order, deduplicated.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Discovered {
    /// DiT paths.
    pub dits: Vec<String>,
    /// Encoder paths.
    pub encoders: Vec<String>,
    /// VAE paths.
    pub vaes: Vec<String>,
    /// Always-resident module paths.
    pub residents: Vec<String>,
    /// Auxiliary module paths.
    pub auxiliary: Vec<String>,
    /// Whether the deprecated attribute scan was used.
    pub used_fallback_scan: bool,
}

/// Finds the pipeline's components. Warnings (missing declared paths, the deprecated scan) go to `warnings`.
pub fn discover_components(p: &PipelineDesc, warnings: &mut Vec<String>) -> Discovered {
    let mut d = Discovered::default();
    let mut claimed: Vec<String> = Vec::new();
    let mut take = |paths: &[String], out: &mut Vec<String>, what: &str, warnings: &mut Vec<String>| {
        for path in paths {
            if p.module(path).is_none() {
                warnings.push(format!(
                    "declared {what} module '{path}' does not exist in pipeline {}; skipping it",
                    p.class
                ));
                continue;
            }
            if claimed.iter().any(|c| c == path) {
                continue;
            }
            claimed.push(path.clone());
            out.push(path.clone());
        }
    };
    match &p.components {
        Some(decls) => {
            take(&decls.dit, &mut d.dits, "DiT", warnings);
            take(&decls.encoders, &mut d.encoders, "encoder", warnings);
            take(&decls.vaes, &mut d.vaes, "VAE", warnings);
            take(&decls.resident, &mut d.residents, "resident", warnings);
            take(&decls.auxiliary, &mut d.auxiliary, "auxiliary", warnings);
        }
        None => {
            d.used_fallback_scan = true;
            let msg = format!(
                "pipeline {} declares no components; using the deprecated attribute scan (declare `components` in the \
                 pipeline description)",
                p.class
            );
            warn_once(&format!("scan:{}", p.class), &msg);
            warnings.push(msg);
            let scan = |names: &[&str]| -> Vec<String> {
                names.iter().filter(|n| p.root.child(n).is_some()).map(|n| n.to_string()).collect()
            };
            let dits = scan(FALLBACK_DIT_NAMES);
            let encs = scan(FALLBACK_ENCODER_NAMES);
            let vaes = scan(FALLBACK_VAE_NAMES);
            take(&dits, &mut d.dits, "DiT", warnings);
            take(&encs, &mut d.encoders, "encoder", warnings);
            take(&vaes, &mut d.vaes, "VAE", warnings);
        }
    }
    d
}

/// Where a DiT's block-list attributes came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BlockAttrSource {
    /// The pipeline's offload plan (`block_attrs`).
    Plan,
    /// The DiT class's `_layerwise_offload_blocks_attrs`.
    ClassAttrs,
    /// The deprecated singular class attribute.
    ClassAttrSingular,
    /// Nothing declared.
    None,
}

/// The block-list attributes (relative to the DiT) declared for the DiT at `dit_path`, with their source.
pub(crate) fn dit_block_attrs(
    p: &PipelineDesc,
    dit_path: &str,
    dit: &ModuleNode,
    warnings: &mut Vec<String>,
) -> (Vec<String>, BlockAttrSource) {
    if let Some(attrs) = p.offload_plan.as_ref().and_then(|plan| plan.block_attrs.get(dit_path)) {
        return (attrs.clone(), BlockAttrSource::Plan);
    }
    if let Some(attrs) = p.class_block_attrs.get(&dit.class) {
        return (attrs.clone(), BlockAttrSource::ClassAttrs);
    }
    if let Some(attr) = p.class_block_attr_singular.get(&dit.class) {
        let msg = format!(
            "DiT class {} uses the deprecated singular block attribute declaration; declare a list in class_block_attrs",
            dit.class
        );
        warn_once(&format!("singular:{}", dit.class), &msg);
        warnings.push(msg);
        return (vec![attr.clone()], BlockAttrSource::ClassAttrSingular);
    }
    (Vec::new(), BlockAttrSource::None)
}

/// The blocks of one declared attribute: the children of a block list, or the module itself (one block, with a
/// warning) when it is a plain module. `None` when the attribute does not exist.
pub(crate) fn blocks_of(
    owner_path: &str,
    owner: &ModuleNode,
    attr: &str,
    warnings: &mut Vec<String>,
) -> Option<Vec<String>> {
    let m = owner.get(attr)?;
    let base = join(owner_path, attr);
    if m.is_block_list() {
        Some(m.children.iter().map(|(n, _)| join(&base, n)).collect())
    } else {
        warnings.push(format!("'{base}' is not a block list; treating the whole module as one block"));
        Some(vec![base])
    }
}
