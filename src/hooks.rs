//! The forward-hook registry: named hooks per module that the host engine runs around each module's forward pass.
//!
//! Invariants: `pre_forward` hooks run in name order and `post_forward` hooks in reverse name order; at most one
//! hook per module replaces the forward; every hook has an owner and an owner removes only its own hooks; at most
//! one offload strategy owns offload hooks on a pipeline at a time. Hook calls never hold the registry lock while a
//! hook runs. A hook that places its module's weights says where in the [`Residency`] its `pre_forward` returns, so
//! the engine finds a streamed block's weights without asking the backend again.

use crate::pipeline::StorageId;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use weightferry_actors::platform::DeviceBufferId;
use weightferry_actors::SchedulerError;

/// Hook name of the model-level (sequential) strategy.
pub const SEQUENTIAL_OFFLOAD_HOOK: &str = "sequential_offload";
/// Hook name of the layerwise strategy.
pub const LAYERWISE_OFFLOAD_HOOK: &str = "layerwise_offload";
/// Hook name of the distributed layerwise strategy.
pub(crate) const DISTRIBUTED_LAYERWISE_OFFLOAD_HOOK: &str = "distributed_layerwise_offload";

/// Errors from hooks and the registry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HookError {
    /// A second forward-replacing hook on one module.
    #[error(
        "module '{module}' already has a hook that replaces forward ('{existing}'); '{new}' cannot also replace it"
    )]
    ForwardAlreadyReplaced {
        /// Module path.
        module: String,
        /// Existing forward-replacing hook.
        existing: String,
        /// Rejected hook.
        new: String,
    },
    /// A hook owned by someone else.
    #[error("hook '{name}' on module '{module}' belongs to '{owner}', not '{caller}'; only its owner may remove it")]
    NotOwner {
        /// Module path.
        module: String,
        /// Hook name.
        name: String,
        /// Its owner.
        owner: String,
        /// Who tried to remove it.
        caller: String,
    },
    /// Another strategy already owns offload hooks.
    #[error("offload hooks on this pipeline are owned by '{owner}'; disable it before enabling '{requested}'")]
    OffloadOwned {
        /// Current owner.
        owner: String,
        /// Strategy asking.
        requested: String,
    },
    /// A hook failed while running.
    #[error("hook '{name}' failed on module '{module}': {source}")]
    Failed {
        /// Module path.
        module: String,
        /// Hook name.
        name: String,
        /// What went wrong (boxed: a scheduler error is large, and this is the cold path).
        source: Box<HookFailure>,
    },
}

/// Why a hook's `pre_forward` or `post_forward` failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HookFailure {
    /// The transfer scheduler refused or failed (an offload hook): the typed error, for callers that match on it.
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    /// A hook of the host engine's own failed.
    #[error("{0}")]
    Other(String),
}

/// Where a module's weights are on the device while its forward runs: the block's region (`buffer` at `base`) and
/// each of its storages' offset inside that region. Valid from the `pre_forward` that returned it to the module's
/// `post_forward`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Residency {
    /// The device buffer holding the block.
    pub buffer: DeviceBufferId,
    /// Offset of the block's region in `buffer`.
    pub base: u64,
    /// Offset of each storage of the block inside its region.
    pub offsets: Arc<HashMap<StorageId, u64>>,
}

impl Residency {
    /// Device buffer and byte offset of `storage`, if it is one of this block's.
    pub fn locate(&self, storage: StorageId) -> Option<(DeviceBufferId, u64)> {
        self.offsets.get(&storage).map(|&off| (self.buffer, self.base + off))
    }
}

/// A hook run around a module's forward pass.
pub trait ModelHook: Send + Sync {
    /// Runs before the module's forward; a hook that made the module's weights resident says where.
    fn pre_forward(&self, module: &str) -> Result<Option<Residency>, HookFailure>;
    /// Runs after the module's forward.
    fn post_forward(&self, module: &str) -> Result<(), HookFailure>;
    /// Whether this hook replaces the module's forward (at most one per module).
    fn replaces_forward(&self) -> bool {
        false
    }
}

#[derive(Clone)]
struct Entry {
    name: String,
    owner: String,
    hook: Arc<dyn ModelHook>,
}

type HookList = Arc<Vec<Entry>>;

#[derive(Default)]
struct Inner {
    modules: BTreeMap<String, HookList>,
    offload_owner: Option<String>,
}

/// Hooks of one pipeline.
#[derive(Default, Clone)]
pub struct HookRegistry {
    inner: Arc<RwLock<Inner>>,
}

impl std::fmt::Debug for HookRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HookRegistry").field("hooks", &self.hook_names()).finish()
    }
}

impl HookRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `hook` under `name` on `module`, owned by `owner`. Re-registering a name warns and replaces it.
    pub fn register(&self, module: &str, name: &str, owner: &str, hook: Arc<dyn ModelHook>) -> Result<(), HookError> {
        let mut inner = self.write();
        let list = inner.modules.entry(module.to_string()).or_default();
        if hook.replaces_forward() {
            if let Some(e) = list.iter().find(|e| e.name != name && e.hook.replaces_forward()) {
                return Err(HookError::ForwardAlreadyReplaced {
                    module: module.to_string(),
                    existing: e.name.clone(),
                    new: name.to_string(),
                });
            }
        }
        let mut v: Vec<Entry> = list.iter().filter(|e| e.name != name).cloned().collect();
        if v.len() != list.len() {
            tracing::warn!("hook '{name}' on module '{module}' registered again; replacing it");
        }
        v.push(Entry { name: name.to_string(), owner: owner.to_string(), hook });
        v.sort_by(|a, b| a.name.cmp(&b.name));
        *list = Arc::new(v);
        Ok(())
    }

    /// Removes hook `name` from `module` if `owner` owns it. A missing hook is a no-op (`Ok(false)`).
    pub fn remove(&self, module: &str, name: &str, owner: &str) -> Result<bool, HookError> {
        let mut inner = self.write();
        let Some(list) = inner.modules.get_mut(module) else { return Ok(false) };
        let Some(e) = list.iter().find(|e| e.name == name) else { return Ok(false) };
        if e.owner != owner {
            return Err(HookError::NotOwner {
                module: module.to_string(),
                name: name.to_string(),
                owner: e.owner.clone(),
                caller: owner.to_string(),
            });
        }
        let v: Vec<Entry> = list.iter().filter(|e| e.name != name).cloned().collect();
        if v.is_empty() {
            inner.modules.remove(module);
        } else {
            *list = Arc::new(v);
        }
        Ok(true)
    }

    /// Removes every hook `owner` owns; returns how many.
    pub fn remove_owned_by(&self, owner: &str) -> usize {
        let mut inner = self.write();
        let mut removed = 0;
        inner.modules.retain(|_, list| {
            let v: Vec<Entry> = list.iter().filter(|e| e.owner != owner).cloned().collect();
            removed += list.len() - v.len();
            *list = Arc::new(v);
            !list.is_empty()
        });
        if inner.offload_owner.as_deref() == Some(owner) {
            inner.offload_owner = None;
        }
        removed
    }

    /// Claims offload ownership for `strategy`; fails if another strategy holds it.
    pub fn claim_offload(&self, strategy: &str) -> Result<(), HookError> {
        let mut inner = self.write();
        match &inner.offload_owner {
            Some(o) if o != strategy => {
                Err(HookError::OffloadOwned { owner: o.clone(), requested: strategy.to_string() })
            }
            _ => {
                inner.offload_owner = Some(strategy.to_string());
                Ok(())
            }
        }
    }

    /// Releases offload ownership if `strategy` holds it.
    pub fn release_offload(&self, strategy: &str) {
        let mut inner = self.write();
        if inner.offload_owner.as_deref() == Some(strategy) {
            inner.offload_owner = None;
        }
    }

    /// The strategy owning offload hooks, if any.
    pub fn offload_owner(&self) -> Option<String> {
        self.read().offload_owner.clone()
    }

    /// `(module, hook name, owner)` of every hook, sorted.
    pub fn hook_names(&self) -> Vec<(String, String, String)> {
        let inner = self.read();
        inner
            .modules
            .iter()
            .flat_map(|(m, l)| l.iter().map(move |e| (m.clone(), e.name.clone(), e.owner.clone())))
            .collect()
    }

    /// Number of hooks owned by `owner`.
    pub fn count_owned_by(&self, owner: &str) -> usize {
        self.read().modules.values().map(|l| l.iter().filter(|e| e.owner == owner).count()).sum()
    }

    fn snapshot(&self, module: &str) -> Option<HookList> {
        self.read().modules.get(module).cloned()
    }

    /// Runs `module`'s pre-forward hooks in name order; returns the residency the module's weights got (from the
    /// last hook that gave one: at most one offload strategy places a module).
    pub fn pre_forward(&self, module: &str) -> Result<Option<Residency>, HookError> {
        let Some(list) = self.snapshot(module) else { return Ok(None) };
        let mut residency = None;
        for e in list.iter() {
            let r = e.hook.pre_forward(module).map_err(|source| HookError::Failed {
                module: module.to_string(),
                name: e.name.clone(),
                source: Box::new(source),
            })?;
            residency = r.or(residency);
        }
        Ok(residency)
    }

    /// Runs `module`'s post-forward hooks in reverse name order.
    pub fn post_forward(&self, module: &str) -> Result<(), HookError> {
        let Some(list) = self.snapshot(module) else { return Ok(()) };
        for e in list.iter().rev() {
            e.hook.post_forward(module).map_err(|source| HookError::Failed {
                module: module.to_string(),
                name: e.name.clone(),
                source: Box::new(source),
            })?;
        }
        Ok(())
    }
}

/// A forward scope for a non-forward entry point (e.g. a VAE's `decode`): `pre_forward` ran when it was created,
/// `post_forward` runs when it is dropped — also on an early return or a panic unwinding through it. A failure of
/// that release is logged, not raised, so it never masks the caller's own error.
#[must_use = "the module's weights may be released as soon as the scope is dropped"]
pub struct ForwardScope<'a> {
    registry: &'a HookRegistry,
    module: String,
    residency: Option<Residency>,
}

impl HookRegistry {
    /// Runs `module`'s `pre_forward` hooks and returns a scope whose drop runs its `post_forward` hooks.
    pub fn scope(&self, module: &str) -> Result<ForwardScope<'_>, HookError> {
        let residency = self.pre_forward(module)?;
        Ok(ForwardScope { registry: self, module: module.to_string(), residency })
    }
}

impl ForwardScope<'_> {
    /// The module this scope keeps loaded.
    pub fn module(&self) -> &str {
        &self.module
    }

    /// Where the module's weights are while the scope lives, when a hook placed them.
    pub fn residency(&self) -> Option<&Residency> {
        self.residency.as_ref()
    }
}

impl Drop for ForwardScope<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.registry.post_forward(&self.module) {
            tracing::warn!("releasing '{}' at the end of its scope failed: {e}", self.module);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    struct Rec {
        tag: &'static str,
        log: Arc<Mutex<Vec<String>>>,
        replaces: bool,
        fail: bool,
    }
    impl ModelHook for Rec {
        fn pre_forward(&self, m: &str) -> Result<Option<Residency>, HookFailure> {
            self.log.lock().unwrap().push(format!("pre:{}:{m}", self.tag));
            if self.fail {
                Err(HookFailure::Other("boom".into()))
            } else {
                Ok(None)
            }
        }
        fn post_forward(&self, m: &str) -> Result<(), HookFailure> {
            self.log.lock().unwrap().push(format!("post:{}:{m}", self.tag));
            Ok(())
        }
        fn replaces_forward(&self) -> bool {
            self.replaces
        }
    }
    fn rec(tag: &'static str, log: &Arc<Mutex<Vec<String>>>, replaces: bool) -> Arc<dyn ModelHook> {
        Arc::new(Rec { tag, log: log.clone(), replaces, fail: false })
    }

    #[test]
    fn pre_runs_in_name_order_post_in_reverse() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let r = HookRegistry::new();
        r.register("b0", "zeta", "x", rec("z", &log, false)).unwrap();
        r.register("b0", "alpha", "x", rec("a", &log, false)).unwrap();
        r.register("b0", "mid", "y", rec("m", &log, false)).unwrap();
        r.pre_forward("b0").unwrap();
        r.post_forward("b0").unwrap();
        r.pre_forward("other").unwrap();
        assert_eq!(
            *log.lock().unwrap(),
            vec!["pre:a:b0", "pre:m:b0", "pre:z:b0", "post:z:b0", "post:m:b0", "post:a:b0"]
        );
    }

    #[test]
    fn only_one_hook_may_replace_forward() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let r = HookRegistry::new();
        r.register("m", "first", "x", rec("1", &log, true)).unwrap();
        let err = r.register("m", "second", "x", rec("2", &log, true)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "module 'm' already has a hook that replaces forward ('first'); 'second' cannot also replace it"
        );
        // Re-registering the same name is allowed (it replaces itself).
        r.register("m", "first", "x", rec("1b", &log, true)).unwrap();
        assert_eq!(r.hook_names(), vec![("m".to_string(), "first".to_string(), "x".to_string())]);
    }

    #[test]
    fn owners_remove_only_their_hooks() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let r = HookRegistry::new();
        r.register("m", LAYERWISE_OFFLOAD_HOOK, LAYERWISE_OFFLOAD_HOOK, rec("l", &log, false)).unwrap();
        r.register("m", "user_hook", "user", rec("u", &log, false)).unwrap();
        assert!(matches!(r.remove("m", "user_hook", LAYERWISE_OFFLOAD_HOOK), Err(HookError::NotOwner { .. })));
        assert_eq!(r.remove("m", "missing", "user"), Ok(false));
        assert_eq!(r.remove_owned_by(LAYERWISE_OFFLOAD_HOOK), 1);
        assert_eq!(r.hook_names(), vec![("m".to_string(), "user_hook".to_string(), "user".to_string())]);
        assert_eq!(r.remove("m", "user_hook", "user"), Ok(true));
        assert!(r.hook_names().is_empty());
    }

    #[test]
    fn one_offload_owner_at_a_time() {
        let r = HookRegistry::new();
        r.claim_offload(LAYERWISE_OFFLOAD_HOOK).unwrap();
        r.claim_offload(LAYERWISE_OFFLOAD_HOOK).unwrap();
        let err = r.claim_offload(SEQUENTIAL_OFFLOAD_HOOK).unwrap_err();
        assert_eq!(
            err.to_string(),
            "offload hooks on this pipeline are owned by 'layerwise_offload'; disable it before enabling 'sequential_offload'"
        );
        r.release_offload(SEQUENTIAL_OFFLOAD_HOOK);
        assert_eq!(r.offload_owner().as_deref(), Some(LAYERWISE_OFFLOAD_HOOK));
        r.release_offload(LAYERWISE_OFFLOAD_HOOK);
        r.claim_offload(SEQUENTIAL_OFFLOAD_HOOK).unwrap();
    }

    #[test]
    fn a_scope_runs_post_forward_when_dropped_even_on_early_exit() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let r = HookRegistry::new();
        r.register("vae", "sequential_offload", "sequential_offload", rec("s", &log, false)).unwrap();
        let decode = |fail: bool| -> Result<(), String> {
            let scope = r.scope("vae").map_err(|e| e.to_string())?;
            assert_eq!(scope.module(), "vae");
            if fail {
                return Err("decode failed".into());
            }
            Ok(())
        };
        assert_eq!(decode(true), Err("decode failed".to_string()));
        decode(false).unwrap();
        assert_eq!(*log.lock().unwrap(), vec!["pre:s:vae", "post:s:vae", "pre:s:vae", "post:s:vae"]);
    }

    #[test]
    fn failing_hook_reports_module_and_name() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let r = HookRegistry::new();
        r.register("blk", "h", "o", Arc::new(Rec { tag: "f", log: log.clone(), replaces: false, fail: true })).unwrap();
        assert_eq!(r.pre_forward("blk").unwrap_err().to_string(), "hook 'h' failed on module 'blk': boom");
    }

    struct Placing(Option<Residency>, Option<SchedulerError>);
    impl ModelHook for Placing {
        fn pre_forward(&self, _: &str) -> Result<Option<Residency>, HookFailure> {
            match &self.1 {
                Some(e) => Err(e.clone().into()),
                None => Ok(self.0.clone()),
            }
        }
        fn post_forward(&self, _: &str) -> Result<(), HookFailure> {
            Ok(())
        }
    }

    #[test]
    fn pre_forward_hands_back_the_residency_and_typed_scheduler_errors() {
        let offsets = Arc::new(HashMap::from([(StorageId(4), 64u64)]));
        let placed = Residency { buffer: DeviceBufferId(9), base: 4096, offsets };
        let r = HookRegistry::new();
        r.register("blk", "a_user", "u", Arc::new(Placing(None, None))).unwrap();
        r.register("blk", "layerwise_offload", "l", Arc::new(Placing(Some(placed.clone()), None))).unwrap();
        r.register("blk", "z_user", "u", Arc::new(Placing(None, None))).unwrap();
        let got = r.pre_forward("blk").unwrap().expect("the offload hook placed the block");
        assert_eq!(got, placed);
        assert_eq!(got.locate(StorageId(4)), Some((DeviceBufferId(9), 4160)));
        assert_eq!(got.locate(StorageId(5)), None);
        assert_eq!(r.scope("blk").unwrap().residency(), Some(&placed));
        assert_eq!(r.pre_forward("unhooked").unwrap(), None);
        let refused = SchedulerError::Disabled { stack: "dit".into() };
        r.register("bad", "h", "o", Arc::new(Placing(None, Some(refused.clone())))).unwrap();
        assert_eq!(
            r.pre_forward("bad").unwrap_err(),
            HookError::Failed {
                module: "bad".into(),
                name: "h".into(),
                source: Box::new(HookFailure::Scheduler(refused))
            }
        );
    }
}
