//! The execution program: the order in which a host engine runs a pipeline's modules, computed once from the
//! pipeline description.
//!
//! Components run as encoders (and other always-run modules) → the DiT (once per step) → the VAE. Inside a
//! component, children run in declaration order: a block list (a `ModuleList` / `Sequential` whose children are named
//! `0..n`) runs block by block, each block one kernel with hooks around it; a child that contains a block list
//! deeper down is entered (hooks around it) and walked the same way; any other child is one kernel over its whole
//! subtree. A module's own tensors run as one kernel before its children, inside that module's hooks (no hooks of
//! their own).
//!
//! Invariant: a storage that some block owns is computed only inside that block. A non-block module whose tensor
//! aliases a block's storage (e.g. Flux's `proj_alias`) does not read it again outside the block, because a streamed
//! block's bytes are on the device only between its hooks.

use super::math::Phase;
use std::collections::BTreeSet;
use std::sync::Arc;
use weightferry::pipeline::{join, ModuleNode, PipelineDesc, StorageId, TensorDesc};
use weightferry::plan::discovery::discover_components;

/// One step of a component's program.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// `pre_forward` of a module whose subtree is walked (its kernels follow).
    Enter(String),
    /// `post_forward` of a module entered before.
    Exit(String),
    /// One kernel, with hooks around it.
    Kernel(KernelItem),
}

/// One kernel: a block or a non-block module.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelItem {
    /// Module path (also the kernel label and the hook target).
    pub path: String,
    /// `Some(index)` for a block of a block list.
    pub block: Option<usize>,
    /// Whether hooks run around it (false for a module's own tensors: they run inside that module's hooks).
    pub hooked: bool,
    /// Tensors applied, in declaration order.
    pub tensors: Arc<Vec<TensorDesc>>,
    /// Distinct storages the tensors view, in first-use order.
    pub storages: Vec<StorageId>,
}

/// The program of one component.
#[derive(Debug, Clone, PartialEq)]
pub struct ComponentProgram {
    /// Component path.
    pub path: String,
    /// Which activation it transforms.
    pub phase: Phase,
    /// Ops inside the component's own hooks.
    pub ops: Vec<Op>,
}

impl ComponentProgram {
    /// Number of blocks (over all block lists).
    pub fn block_count(&self) -> usize {
        self.ops.iter().filter(|o| matches!(o, Op::Kernel(k) if k.block.is_some())).count()
    }
}

/// The program of a whole pipeline.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Program {
    /// Encoders, then resident and auxiliary modules: run once, before the DiT.
    pub encoders: Vec<ComponentProgram>,
    /// DiTs: each runs once per step.
    pub dits: Vec<ComponentProgram>,
    /// VAEs: run once, after the DiT.
    pub vaes: Vec<ComponentProgram>,
}

fn contains_block_list(m: &ModuleNode) -> bool {
    m.children.iter().any(|(_, c)| (c.is_block_list() && !c.children.is_empty()) || contains_block_list(c))
}

/// Storages owned by blocks anywhere under `m`.
fn block_storages(m: &ModuleNode, out: &mut BTreeSet<StorageId>) {
    for (_, c) in &m.children {
        if c.is_block_list() && !c.children.is_empty() {
            for (_, b) in &c.children {
                out.extend(b.tensors_recursive().into_iter().map(|(_, t)| t.storage));
            }
        } else {
            block_storages(c, out);
        }
    }
}

fn kernel(path: String, block: Option<usize>, hooked: bool, tensors: Vec<TensorDesc>) -> KernelItem {
    let mut storages = Vec::new();
    for t in &tensors {
        if !storages.contains(&t.storage) {
            storages.push(t.storage);
        }
    }
    KernelItem { path, block, hooked, tensors: Arc::new(tensors), storages }
}

fn walk(m: &ModuleNode, path: &str, owned: &BTreeSet<StorageId>, ops: &mut Vec<Op>) {
    let own: Vec<TensorDesc> = m.tensors.iter().filter(|t| !owned.contains(&t.storage)).cloned().collect();
    if !own.is_empty() {
        ops.push(Op::Kernel(kernel(path.to_string(), None, false, own)));
    }
    for (name, c) in &m.children {
        let cpath = join(path, name);
        if c.is_block_list() && !c.children.is_empty() {
            for (i, (bname, b)) in c.children.iter().enumerate() {
                let tensors = b.tensors_recursive().into_iter().map(|(_, t)| t.clone()).collect();
                ops.push(Op::Kernel(kernel(join(&cpath, bname), Some(i), true, tensors)));
            }
        } else if contains_block_list(c) {
            ops.push(Op::Enter(cpath.clone()));
            walk(c, &cpath, owned, ops);
            ops.push(Op::Exit(cpath));
        } else {
            let tensors: Vec<TensorDesc> = c
                .tensors_recursive()
                .into_iter()
                .filter(|(_, t)| !owned.contains(&t.storage))
                .map(|(_, t)| t.clone())
                .collect();
            if !tensors.is_empty() {
                ops.push(Op::Kernel(kernel(cpath, None, true, tensors)));
            }
        }
    }
}

impl Program {
    /// Builds the program of `p`. Components come from the pipeline's declarations (or the deprecated attribute
    /// scan when it declares none); unloaded stubs are skipped.
    pub fn build(p: &PipelineDesc) -> Program {
        let mut warnings = Vec::new();
        let found = discover_components(p, &mut warnings);
        let mut owned = BTreeSet::new();
        block_storages(&p.root, &mut owned);
        let comp = |path: &String, phase: Phase| -> Option<ComponentProgram> {
            let m = p.module(path)?;
            if !m.is_loaded {
                return None;
            }
            let mut ops = Vec::new();
            walk(m, path, &owned, &mut ops);
            Some(ComponentProgram { path: path.clone(), phase, ops })
        };
        let encoders = found
            .encoders
            .iter()
            .chain(&found.residents)
            .chain(&found.auxiliary)
            .filter_map(|c| comp(c, Phase::Encoder))
            .collect();
        Program {
            encoders,
            dits: found.dits.iter().filter_map(|c| comp(c, Phase::Dit)).collect(),
            vaes: found.vaes.iter().filter_map(|c| comp(c, Phase::Vae)).collect(),
        }
    }

    /// Every component, in execution order (the DiT once).
    pub fn components(&self) -> impl Iterator<Item = &ComponentProgram> {
        self.encoders.iter().chain(&self.dits).chain(&self.vaes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weightferry::pipeline::presets::preset;

    fn kernels(c: &ComponentProgram) -> Vec<&KernelItem> {
        c.ops.iter().filter_map(|o| if let Op::Kernel(k) = o { Some(k) } else { None }).collect()
    }

    #[test]
    fn flux_tiny_program_order() {
        let p = Program::build(&preset("flux-tiny").unwrap());
        let paths = |cs: &[ComponentProgram]| cs.iter().map(|c| c.path.clone()).collect::<Vec<_>>();
        assert_eq!(paths(&p.encoders), vec!["text_encoder"]);
        assert_eq!(paths(&p.dits), vec!["transformer"]);
        assert_eq!(paths(&p.vaes), vec!["vae"]);
        let dit = &p.dits[0];
        assert_eq!(dit.block_count(), 57);
        let ks = kernels(dit);
        assert_eq!(ks[0].path, "transformer.pos_embed");
        assert_eq!(ks[3].path, "transformer.context_embedder");
        assert_eq!(ks[4].path, "transformer.transformer_blocks.0");
        assert_eq!(ks[4].block, Some(0));
        assert_eq!(ks[23].path, "transformer.single_transformer_blocks.0");
        assert_eq!(ks[23].block, Some(0));
        // The alias of a block weight is computed inside its block only.
        assert!(ks.iter().all(|k| k.path != "transformer.proj_alias"));
        assert_eq!(ks.last().unwrap().path, "transformer.proj_out");
        // The encoder's block list sits one level down: it is entered, with hooks.
        let enc = &p.encoders[0];
        assert_eq!(enc.block_count(), 24);
        assert_eq!(enc.ops[1], Op::Enter("text_encoder.encoder".into()));
        assert!(matches!(&enc.ops[2], Op::Kernel(k) if k.path == "text_encoder.encoder.embed_tokens" && k.hooked));
        // The VAE's own buffers run inside the VAE's hooks, without hooks of their own.
        let vae = kernels(&p.vaes[0]);
        assert_eq!((vae[0].path.as_str(), vae[0].hooked, vae[0].block), ("vae", false, None));
        assert_eq!(p.vaes[0].block_count(), 8);
    }
}
