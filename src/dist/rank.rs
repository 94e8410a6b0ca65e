//! A rank's collective built from the launch environment, in two steps every front end composes:
//!
//! 1. [`join`]: this rank joins the weightferry [`Rendezvous`] at `MASTER_ADDR:MASTER_PORT` with a fingerprint of
//!    what it runs (its digest goes in the hello, so rank 0 turns away a rank of another run), and all-gathers
//!    every rank's fingerprint bytes ([`RankJoin`]); the caller checks them and words a disagreement its own way
//!    ([`RankJoin::first_disagreeing`] finds it).
//! 2. [`collective`]: the AllGather transport over the joined rendezvous — [`TcpCollective`] on the simulated
//!    device, NCCL bootstrapped through the rendezvous on CUDA (feature `nccl`;
//!    [`nccl_bootstrap`](super::nccl_bootstrap)) — with what the bootstrap learnt ([`RankCollective`]: the
//!    simulated collective's peer-failed flag, the NCCL AllGather engine the ranks agreed on).
//!
//! The library session composes them for a distributed session (`rank_collective`: the config's offload group
//! checked against the launch's world, then both steps, a disagreement refused); the CLI's distributed `run`
//! (`weightferry-harness`'s `cli/dist_run.rs`) composes them with its own rank check and keeps the rendezvous for
//! its verdicts. Each front end words its failures from the typed [`RankError`].
//!
//! Invariant: every rank calls [`join`] and then [`collective`] in the same order, with the same AllGather engine
//! request; a rank that fails between them drops its connection, so the others fail at their next exchange.

use super::allgather_engine::{AllGatherEngine, EngineChoice};
use super::{Fingerprint, LaunchEnv, LaunchEnvError, Rendezvous, RendezvousError, RendezvousOptions, TcpCollective};
use crate::config::{Component, OffloadConfig};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use weightferry_actors::collective::Collective;
use weightferry_actors::collective_actor::CollectiveFactory;
use weightferry_actors::sim::SimPlatform;

/// The device a rank gathers on.
#[derive(Debug, Clone, Copy)]
pub enum RankDevice<'a> {
    /// The simulated device: the AllGathers run over the rendezvous.
    Sim(&'a Arc<SimPlatform>),
    /// A CUDA device: NCCL runs the AllGathers (feature `nccl`; without it a distributed session is refused).
    #[cfg(feature = "cuda")]
    Cuda(&'a Arc<crate::platform::cuda::CudaPlatform>),
}

/// What the library session's rank exchange is built with ([`rank_collective`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RankOptions<'a> {
    /// What this rank runs (e.g. its pipeline description and config text): every rank must give the same bytes.
    pub fingerprint: &'a [u8],
    /// The port rank 0 listens on instead of `MASTER_PORT` (when another store holds that port).
    pub rendezvous_port: Option<u16>,
    /// Test seam on the simulated device: this rank's AllGather call that fails at enqueue (0-based).
    pub fail_all_gather: Option<u64>,
}

/// Why a rank's collective could not be built. The texts are the Python binding's (flattened to one line there);
/// the CLI words the rendezvous and NCCL failures from the `source`s.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RankError {
    /// The launch environment is unusable.
    #[error(transparent)]
    Env(#[from] LaunchEnvError),
    /// The config's offload group is not the launch's world.
    #[error(
        "the config gathers weights across an offload group of {group} ranks, but this process is rank {rank} of \
         WORLD_SIZE={world}; start {group} processes (torchrun --nproc-per-node {group}) or change the config's \
         parallel sizes"
    )]
    WorldMismatch {
        /// Ranks of the config's offload group.
        group: usize,
        /// This rank.
        rank: usize,
        /// The launch's world size.
        world: usize,
    },
    /// A CUDA rank in a build without NCCL.
    #[error(
        "distributed offload (weight_transfer = \"allgather\") on CUDA needs a build of weightferry with NCCL \
         (feature `nccl`); use device=\"sim\" or rank-local transfer"
    )]
    #[cfg(all(feature = "cuda", not(feature = "nccl")))]
    NoNccl,
    /// Joining the rendezvous failed ([`join`]).
    #[error("rank {rank}: {source}")]
    Connect {
        /// This rank.
        rank: usize,
        /// Why.
        source: RendezvousError,
    },
    /// Exchanging the fingerprints failed ([`join`]).
    #[error(transparent)]
    Exchange(RendezvousError),
    /// Another rank runs another pipeline or config.
    #[error(
        "rank {other} enables another pipeline or config than rank {rank}; every rank must enable the same model \
         with the same config"
    )]
    Disagree {
        /// The first rank whose fingerprint differs.
        other: usize,
        /// This rank.
        rank: usize,
    },
    /// The NCCL bootstrap failed ([`collective`]).
    #[cfg(feature = "nccl")]
    #[error("rank {rank}: NCCL bootstrap: {source}")]
    Nccl {
        /// This rank.
        rank: usize,
        /// Why.
        source: super::BootstrapError,
    },
}

/// A rank that joined the rendezvous ([`join`]).
#[derive(Debug)]
pub struct RankJoin {
    /// Where this rank sits: the launch environment it joined with.
    pub env: LaunchEnv,
    /// The rendezvous every rank joined: [`collective`] builds over it, and the caller may keep it for its own
    /// exchanges (a barrier, the ranks' results).
    pub rendezvous: Arc<Rendezvous>,
    /// Every rank's fingerprint, indexed by rank.
    pub fingerprints: Vec<Vec<u8>>,
}

impl RankJoin {
    /// The first rank whose fingerprint is not `reference` (this rank's, or rank 0's), if any.
    pub fn first_disagreeing(&self, reference: &[u8]) -> Option<usize> {
        self.fingerprints.iter().position(|f| f.as_slice() != reference)
    }
}

/// Joins the rendezvous `env` names (`MASTER_ADDR:MASTER_PORT`) with `fingerprint` — what this rank runs; every
/// rank of the run must give the same bytes, and their digest goes in the hello — and all-gathers every rank's
/// fingerprint. Checking them is the caller's ([`RankJoin::first_disagreeing`]).
pub fn join(env: &LaunchEnv, fingerprint: &[u8]) -> Result<RankJoin, RankError> {
    let options = RendezvousOptions { fingerprint: Fingerprint::of(fingerprint), ..RendezvousOptions::default() };
    let rendezvous =
        Arc::new(Rendezvous::connect(env, options).map_err(|source| RankError::Connect { rank: env.rank, source })?);
    let fingerprints = rendezvous.all_gather_bytes(fingerprint).map_err(RankError::Exchange)?;
    Ok(RankJoin { env: env.clone(), rendezvous, fingerprints })
}

/// How [`collective`] builds a rank's collective.
#[derive(Debug, Clone, Copy, Default)]
pub struct CollectiveOptions {
    /// CUDA: the NCCL AllGather asked for (every rank must ask for the same; `Auto` by default).
    pub allgather_engine: AllGatherEngine,
    /// Test seam on the simulated device: this rank's AllGather call that fails at enqueue (0-based;
    /// [`TcpCollective::fail_nth_call`]). Ignored on CUDA.
    pub fail_all_gather: Option<u64>,
}

/// A rank's collective ([`collective`]) and what its bootstrap learnt.
pub struct RankCollective {
    /// Builds this rank's collective on the collective actor's thread.
    pub factory: CollectiveFactory,
    /// Simulated device: set once an exchange with the other ranks failed, i.e. this rank fails because another one
    /// did ([`TcpCollective::peer_failed_flag`]); `None` on CUDA.
    pub peer_failed: Option<Arc<AtomicBool>>,
    /// CUDA: the AllGather engine the ranks agreed on (and with `Auto` and kernels, why not the copy engines);
    /// `None` on the simulated device.
    pub engine: Option<EngineChoice>,
}

impl std::fmt::Debug for RankCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankCollective")
            .field("peer_failed", &self.peer_failed)
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}

/// This rank's collective over the rendezvous it joined: on the simulated device a [`TcpCollective`] over the
/// rendezvous (failing its `options.fail_all_gather`-th call, if given); on CUDA NCCL, bootstrapped through the
/// rendezvous with the `options.allgather_engine` request ([`nccl_bootstrap`](super::nccl_bootstrap); without
/// feature `nccl`, `RankError::NoNccl`). Every rank calls it after [`join`], in the same order.
pub fn collective(
    join: &RankJoin,
    device: RankDevice<'_>,
    options: CollectiveOptions,
) -> Result<RankCollective, RankError> {
    match device {
        RankDevice::Sim(sim) => {
            let collective = TcpCollective::new(join.rendezvous.clone(), sim.clone());
            let peer_failed = collective.peer_failed_flag();
            if let Some(n) = options.fail_all_gather {
                collective.fail_nth_call(n);
            }
            let factory: CollectiveFactory = Box::new(move || Ok(Box::new(collective) as Box<dyn Collective>));
            Ok(RankCollective { factory, peer_failed: Some(peer_failed), engine: None })
        }
        #[cfg(feature = "nccl")]
        RankDevice::Cuda(cuda) => {
            // NCCL: the AllGather engine every rank can run, and rank 0's unique id, go through the rendezvous.
            let (rank, world) = (join.env.rank, join.env.world);
            let boot = super::bootstrap_nccl(cuda, rank, world, options.allgather_engine, join.rendezvous.as_ref())
                .map_err(|source| RankError::Nccl { rank, source })?;
            Ok(RankCollective { factory: boot.factory, peer_failed: None, engine: Some(boot.engine) })
        }
        #[cfg(all(feature = "cuda", not(feature = "nccl")))]
        RankDevice::Cuda(_) => Err(RankError::NoNccl),
    }
}

/// The library session's collective for a distributed session: `None` when `config` gathers nothing across ranks
/// (no AllGather transfer, or a group of one rank); else the launch environment ([`LaunchEnv::from_env`], with
/// `options.rendezvous_port` instead of `MASTER_PORT` if given) checked against the config's offload group, then
/// [`join`] (every rank's fingerprint must be this rank's: [`RankError::Disagree`]) and [`collective`] with the
/// `Auto` AllGather engine.
pub(crate) fn rank_collective(
    config: &OffloadConfig,
    device: RankDevice<'_>,
    options: RankOptions<'_>,
) -> Result<Option<CollectiveFactory>, RankError> {
    let gathers = Component::ALL.iter().any(|&c| config.uses_allgather(c));
    if !gathers || config.group.size <= 1 {
        return Ok(None);
    }
    let group = config.group.size as usize;
    let mut env = LaunchEnv::from_env()?;
    if env.world != group {
        return Err(RankError::WorldMismatch { group, rank: env.rank, world: env.world });
    }
    if let Some(port) = options.rendezvous_port {
        env.master_port = Some(port);
    }
    // Refused before joining, so the other ranks are not kept waiting on a rank that cannot gather.
    #[cfg(all(feature = "cuda", not(feature = "nccl")))]
    if let RankDevice::Cuda(_) = device {
        return Err(RankError::NoNccl);
    }
    let joined = join(&env, options.fingerprint)?;
    if let Some(other) = joined.first_disagreeing(options.fingerprint) {
        return Err(RankError::Disagree { other, rank: env.rank });
    }
    let options =
        CollectiveOptions { allgather_engine: AllGatherEngine::Auto, fail_all_gather: options.fail_all_gather };
    Ok(Some(collective(&joined, device, options)?.factory))
}

#[cfg(test)]
mod tests {
    use super::*;
    use weightferry_actors::sim::SimConfig;

    /// Two ranks (threads) on a fresh loopback port, each running `f` on its launch environment.
    fn two_ranks<T: Send>(f: impl Fn(LaunchEnv) -> T + Sync) -> Vec<T> {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        std::thread::scope(|s| {
            let f = &f;
            let hs: Vec<_> = (0..2)
                .map(|rank| {
                    s.spawn(move || {
                        f(LaunchEnv {
                            rank,
                            world: 2,
                            local_rank: rank,
                            master_addr: Some("127.0.0.1".into()),
                            master_port: Some(port),
                            run_id: None,
                        })
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn ranks_join_with_their_fingerprints_and_build_the_simulated_collective() {
        let results = two_ranks(|env| {
            let joined = join(&env, b"same pipeline").unwrap();
            assert_eq!(joined.env, env);
            assert_eq!(joined.fingerprints, vec![b"same pipeline".to_vec(); 2]);
            assert_eq!(joined.first_disagreeing(b"same pipeline"), None);
            assert_eq!(joined.first_disagreeing(b"another"), Some(0));
            let sim = Arc::new(SimPlatform::new(SimConfig::default()).unwrap());
            let options = CollectiveOptions { fail_all_gather: Some(3), ..CollectiveOptions::default() };
            let built = collective(&joined, RankDevice::Sim(&sim), options).unwrap();
            let peer_failed = built.peer_failed.as_ref().map(|f| f.load(std::sync::atomic::Ordering::SeqCst));
            let engine = built.engine.clone();
            let c = (built.factory)().unwrap();
            let rank_world = (c.rank(), c.world());
            drop(c);
            joined.rendezvous.barrier().unwrap();
            sim.shutdown();
            (peer_failed, engine, rank_world)
        });
        assert_eq!(results, vec![(Some(false), None, (0, 2)), (Some(false), None, (1, 2))]);
    }
}
