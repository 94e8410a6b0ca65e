//! A rank's collective built from the launch environment: [`rank_collective`] checks that the config's offload
//! group is the launch's world, joins the rendezvous with a fingerprint of what the rank runs, checks that every
//! rank runs the same thing, and builds the AllGather transport: [`TcpCollective`] over the rendezvous on the
//! simulated device, NCCL bootstrapped through it on CUDA (feature `nccl`). The library session uses it for a
//! distributed session; each front end words its failures from the typed [`RankError`].

use super::{Fingerprint, LaunchEnv, LaunchEnvError, Rendezvous, RendezvousError, RendezvousOptions, TcpCollective};
use crate::config::{Component, OffloadConfig};
use std::sync::Arc;
use weightferry_actors::collective::Collective;
use weightferry_actors::collective_actor::CollectiveFactory;
use weightferry_actors::sim::SimPlatform;

/// The device a rank gathers on.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RankDevice<'a> {
    /// The simulated device: the AllGathers run over the rendezvous.
    Sim(&'a Arc<SimPlatform>),
    /// A CUDA device: NCCL runs the AllGathers (feature `nccl`; without it a distributed session is refused).
    #[cfg(feature = "cuda")]
    Cuda(#[cfg_attr(not(feature = "nccl"), allow(dead_code))] &'a Arc<crate::platform::cuda::CudaPlatform>),
}

/// What the rank exchange is built with.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RankOptions<'a> {
    /// What this rank runs (e.g. its pipeline description and config text): every rank must give the same bytes.
    pub fingerprint: &'a [u8],
    /// The port rank 0 listens on instead of `MASTER_PORT` (when another store holds that port).
    pub rendezvous_port: Option<u16>,
    /// Test seam on the simulated device: this rank's AllGather call that fails at enqueue (0-based).
    pub fail_all_gather: Option<u64>,
}

/// Why a rank's collective could not be built. The texts are the Python binding's (flattened to one line there).
#[derive(Debug, thiserror::Error)]
pub(crate) enum RankError {
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
    /// Joining the rendezvous failed.
    #[error("rank {rank}: {source}")]
    Connect {
        /// This rank.
        rank: usize,
        /// Why.
        source: RendezvousError,
    },
    /// Exchanging the fingerprints failed.
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
    /// The NCCL bootstrap failed.
    #[cfg(feature = "nccl")]
    #[error("rank {rank}: NCCL bootstrap: {source}")]
    Nccl {
        /// This rank.
        rank: usize,
        /// Why.
        source: super::BootstrapError,
    },
}

/// This rank's collective, or `None` when `config` gathers nothing across ranks (no AllGather transfer, or a
/// group of one rank). The ranks meet through weightferry's rendezvous (`MASTER_ADDR`, and `MASTER_PORT` or
/// `options.rendezvous_port`).
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
    #[cfg(all(feature = "cuda", not(feature = "nccl")))]
    if let RankDevice::Cuda(_) = device {
        return Err(RankError::NoNccl);
    }
    let fingerprint = options.fingerprint;
    let rdv_options = RendezvousOptions { fingerprint: Fingerprint::of(fingerprint), ..RendezvousOptions::default() };
    let rdv = Arc::new(
        Rendezvous::connect(&env, rdv_options).map_err(|source| RankError::Connect { rank: env.rank, source })?,
    );
    let all = rdv.all_gather_bytes(fingerprint).map_err(RankError::Exchange)?;
    if let Some(other) = all.iter().position(|f| f.as_slice() != fingerprint) {
        return Err(RankError::Disagree { other, rank: env.rank });
    }
    match device {
        RankDevice::Sim(sim) => {
            let collective = TcpCollective::new(rdv, sim.clone());
            if let Some(n) = options.fail_all_gather {
                collective.fail_nth_call(n);
            }
            Ok(Some(Box::new(move || Ok(Box::new(collective) as Box<dyn Collective>))))
        }
        #[cfg(feature = "nccl")]
        RankDevice::Cuda(cuda) => {
            // NCCL: rank 0's unique id (and the AllGather engine every rank can run) go through the rendezvous.
            let engine = super::allgather_engine::AllGatherEngine::Auto;
            let boot = super::bootstrap_nccl(cuda, env.rank, env.world, engine, rdv.as_ref())
                .map_err(|source| RankError::Nccl { rank: env.rank, source })?;
            Ok(Some(boot.factory))
        }
        #[cfg(all(feature = "cuda", not(feature = "nccl")))]
        RankDevice::Cuda(_) => Ok(None),
    }
}
