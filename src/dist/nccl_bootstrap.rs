//! The NCCL bootstrap of one rank as a library call: the ranks agree on the AllGather engine (copy engines or
//! kernels), install NCCL's symmetric heap when they chose the copy engines, and share rank 0's NCCL unique id;
//! the result is the [`CollectiveFactory`] a distributed offload backend takes.
//!
//! The ranks talk through a [`RankExchange`]: the weightferry [`Rendezvous`] is one, and a host engine can supply
//! its own (torch.distributed's store, say). Every rank makes the same two exchanges in this order:
//!
//! 1. an all-gather of every rank's [`EngineOffer`] ([`EngineOffer::to_bytes`]); every rank then decides with
//!    [`choose_engine`] from the same offers ([`agree_engine`]);
//! 2. a broadcast of rank 0's NCCL unique id: its 128 raw bytes, or an empty payload when rank 0 could not make
//!    one, so the other ranks fail at once instead of waiting in NCCL's init ([`share_unique_id`]).
//!
//! Those two steps are pure and tested on the CPU with a fake exchange. The CUDA side — `open_rank_gpu`,
//! `bootstrap_nccl` and `bootstrap_nccl_from_env` (the torchrun / SLURM environment and the weightferry
//! rendezvous) — needs feature `nccl`.
//!
//! Invariant: every rank decides the engine from the same offers, so either every rank registers symmetric windows
//! or none does. What one rank finds alone (no symmetric memory, an installed heap, a failed unique id) travels in
//! an exchange — its offer, rank 0's empty id — rather than ending that rank between two exchanges. Every rank must
//! pass the same [`AllGatherEngine`] request (the `weightferry run` rank check compares it).

use super::allgather_engine::{
    choose_engine, AllGatherEngine, CopyEngineRefused, EngineChoice, EngineOffer, OfferError,
};
use super::env::LaunchEnvError;
use super::rendezvous::{Rendezvous, RendezvousError};
#[cfg(doc)]
use weightferry_actors::collective_actor::CollectiveFactory;

/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;

#[cfg(feature = "nccl")]
const _: () = assert!(UNIQUE_ID_BYTES == crate::platform::cuda::nccl::NCCL_UNIQUE_ID_BYTES);

/// Collective exchanges of small byte strings between the ranks of one run. Every rank calls the same methods in
/// the same order; both block until every rank took part.
pub trait RankExchange {
    /// Every rank's `mine`, indexed by rank.
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, ExchangeError>;

    /// Rank 0's payload on every rank: rank 0 passes `Some`, every other rank `None`.
    fn broadcast_from_zero(&self, root_payload: Option<&[u8]>) -> Result<Vec<u8>, ExchangeError>;
}

/// Why an exchange failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExchangeError {
    /// The weightferry rendezvous failed.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// Another exchange (a host engine's) failed; its own message.
    #[error("{0}")]
    Other(String),
}

impl RankExchange for Rendezvous {
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, ExchangeError> {
        Ok(Rendezvous::all_gather_bytes(self, mine)?)
    }

    fn broadcast_from_zero(&self, root_payload: Option<&[u8]>) -> Result<Vec<u8>, ExchangeError> {
        Ok(self.broadcast(root_payload)?)
    }
}

/// Why the bootstrap of a rank failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BootstrapError {
    /// The launch environment is unusable.
    #[error(transparent)]
    Env(#[from] LaunchEnvError),
    /// An exchange with the other ranks failed.
    #[error("{step}: {source}")]
    Exchange {
        /// What the ranks were exchanging.
        step: &'static str,
        /// Why it failed.
        source: ExchangeError,
    },
    /// The exchange returned another number of entries than there are ranks.
    #[error("{step}: the exchange returned {got} entries for a world of {world} ranks")]
    WrongCount {
        /// What the ranks were exchanging.
        step: &'static str,
        /// Entries returned.
        got: usize,
        /// The world size.
        world: usize,
    },
    /// A rank's AllGather engine offer cannot be read.
    #[error(
        "rank {rank} sent an AllGather engine offer this rank cannot read ({source}); do all ranks run the same \
         weightferry version?"
    )]
    MalformedOffer {
        /// The rank that sent it.
        rank: usize,
        /// What is wrong with it.
        source: OfferError,
    },
    /// The copy-engine AllGather was demanded and some rank cannot use it.
    #[error(transparent)]
    CopyEngine(#[from] CopyEngineRefused),
    /// This rank (rank 0) could not make the NCCL unique id; the others were told.
    #[error("cannot generate the NCCL unique id: {0}")]
    UniqueId(String),
    /// Rank 0 sent an empty id: it could not make one.
    #[error("rank 0 could not generate the NCCL unique id (rank 0's error says why)")]
    NoUniqueId,
    /// Rank 0 sent an id of the wrong length.
    #[error(
        "rank 0 sent an NCCL unique id of {len} bytes, not {UNIQUE_ID_BYTES}; do all ranks run the same weightferry \
         version?"
    )]
    BadUniqueId {
        /// Bytes received.
        len: usize,
    },
    /// The CUDA driver is unusable.
    #[error("no usable CUDA driver: {0}")]
    Driver(String),
    /// No GPU is visible.
    #[error("no GPU is visible to this process (check CUDA_VISIBLE_DEVICES)")]
    NoGpu,
    /// `LOCAL_RANK` names a GPU this process does not see.
    #[error(
        "LOCAL_RANK={local_rank} but this process sees {visible} GPUs (0..{last}); start at most {visible} ranks per \
         node, or give each rank one GPU with CUDA_VISIBLE_DEVICES",
        last = visible - 1
    )]
    LocalRank {
        /// `LOCAL_RANK`.
        local_rank: usize,
        /// GPUs visible (at least 2).
        visible: usize,
    },
    /// The rank's GPU cannot be opened.
    #[error("GPU {ordinal} (LOCAL_RANK {local_rank}): {reason}")]
    Gpu {
        /// The device ordinal.
        ordinal: usize,
        /// `LOCAL_RANK`.
        local_rank: usize,
        /// What the driver said.
        reason: String,
    },
    /// Another allocator took the platform's shared device memory between the offer and the install.
    #[error("the GPU's shared device memory was installed already; bootstrap NCCL once per platform")]
    SharedMemoryTaken,
}

/// The AllGather engine every rank takes: all-gathers `mine` (this rank's offer), reads every rank's offer and
/// decides with [`choose_engine`], so every rank gets the same answer (or the same [`BootstrapError::CopyEngine`]).
pub fn agree_engine(
    exchange: &dyn RankExchange,
    world: usize,
    request: AllGatherEngine,
    mine: &EngineOffer,
) -> Result<EngineChoice, BootstrapError> {
    const STEP: &str = "agreeing on the AllGather engine";
    let all = exchange
        .all_gather_bytes(&mine.to_bytes())
        .map_err(|source| BootstrapError::Exchange { step: STEP, source })?;
    if all.len() != world {
        return Err(BootstrapError::WrongCount { step: STEP, got: all.len(), world });
    }
    let offers = all
        .iter()
        .enumerate()
        .map(|(rank, b)| EngineOffer::from_bytes(b).map_err(|source| BootstrapError::MalformedOffer { rank, source }))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(choose_engine(request, &offers)?)
}

/// Rank 0's NCCL unique id on every rank: rank 0 calls `generate` (no other rank does) and broadcasts the 128
/// bytes; when `generate` fails, rank 0 broadcasts an empty payload, so every other rank fails at once with
/// [`BootstrapError::NoUniqueId`] while rank 0 returns [`BootstrapError::UniqueId`].
pub fn share_unique_id(
    exchange: &dyn RankExchange,
    rank: usize,
    generate: impl FnOnce() -> Result<[u8; UNIQUE_ID_BYTES], String>,
) -> Result<[u8; UNIQUE_ID_BYTES], BootstrapError> {
    const STEP: &str = "sharing the NCCL unique id";
    let exchange_err = |source| BootstrapError::Exchange { step: STEP, source };
    if rank == 0 {
        return match generate() {
            Ok(id) => exchange.broadcast_from_zero(Some(&id)).map(|_| id).map_err(exchange_err),
            Err(why) => {
                // Best effort: the other ranks learn that no id comes; this rank's error is the generation's.
                let _ = exchange.broadcast_from_zero(Some(&[]));
                Err(BootstrapError::UniqueId(why))
            }
        };
    }
    let bytes = exchange.broadcast_from_zero(None).map_err(exchange_err)?;
    match <[u8; UNIQUE_ID_BYTES]>::try_from(bytes.as_slice()) {
        Ok(id) => Ok(id),
        Err(_) if bytes.is_empty() => Err(BootstrapError::NoUniqueId),
        Err(_) => Err(BootstrapError::BadUniqueId { len: bytes.len() }),
    }
}

/// The GPU a rank drives: `LOCAL_RANK` among the `visible` devices, or the only visible device when a launcher
/// gave each process one GPU (SLURM's GPU binding, `CUDA_VISIBLE_DEVICES` per rank).
pub fn gpu_ordinal(local_rank: usize, visible: usize) -> Result<usize, BootstrapError> {
    match visible {
        0 => Err(BootstrapError::NoGpu),
        1 => Ok(0),
        n if local_rank < n => Ok(local_rank),
        n => Err(BootstrapError::LocalRank { local_rank, visible: n }),
    }
}

#[cfg(feature = "nccl")]
pub use cuda::{bootstrap_nccl, bootstrap_nccl_from_env, open_rank_gpu, EnvBootstrap, NcclBootstrap};

#[cfg(feature = "nccl")]
mod cuda {
    use super::*;
    use crate::dist::allgather_engine::node_key;
    use crate::dist::env::LaunchEnv;
    use crate::dist::rendezvous::RendezvousOptions;
    use crate::platform::cuda::nccl::{factory_with_options, NcclOptions, NcclUniqueId};
    use crate::platform::cuda::symmetric::SymmetricHeap;
    use crate::platform::cuda::CudaPlatform;
    use std::sync::Arc;
    use weightferry_actors::collective_actor::CollectiveFactory;

    /// What [`bootstrap_nccl`] returns.
    pub struct NcclBootstrap {
        /// Builds this rank's NCCL communicator on the collective actor's thread (NCCL's init blocks there until
        /// every rank joined).
        pub factory: CollectiveFactory,
        /// The AllGather engine the ranks agreed on, and with `auto` and kernels, why not the copy engines.
        pub engine: EngineChoice,
    }

    impl std::fmt::Debug for NcclBootstrap {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("NcclBootstrap").field("engine", &self.engine).finish_non_exhaustive()
        }
    }

    /// Opens the GPU of the rank `env` describes ([`gpu_ordinal`] of its `LOCAL_RANK`).
    pub fn open_rank_gpu(env: &LaunchEnv) -> Result<Arc<CudaPlatform>, BootstrapError> {
        let visible = CudaPlatform::device_count().map_err(|e| BootstrapError::Driver(e.to_string()))?;
        let ordinal = gpu_ordinal(env.local_rank, visible)?;
        CudaPlatform::new(ordinal).map(Arc::new).map_err(|e| BootstrapError::Gpu {
            ordinal,
            local_rank: env.local_rank,
            reason: e.to_string(),
        })
    }

    /// Bootstraps NCCL for rank `rank` of `world` on `cuda` (see the module docs): probes the copy-engine
    /// AllGather unless kernels are asked for ([`SymmetricHeap::for_copy_engine`]), agrees on the engine with every
    /// rank, installs the heap as the platform's shared device memory when the copy engines were chosen, and shares
    /// rank 0's unique id. The factory builds the communicator with those options.
    pub fn bootstrap_nccl(
        cuda: &Arc<CudaPlatform>,
        rank: usize,
        world: usize,
        request: AllGatherEngine,
        exchange: &dyn RankExchange,
    ) -> Result<NcclBootstrap, BootstrapError> {
        let (heap, unable) = match request {
            AllGatherEngine::Kernel => (None, Some("kernels were asked for".to_string())),
            _ if cuda.has_shared_device_memory() => {
                (None, Some("the GPU's shared device memory is installed already".to_string()))
            }
            _ => match SymmetricHeap::for_copy_engine(cuda) {
                Ok(heap) => (Some(heap), None),
                Err(why) => (None, Some(why)),
            },
        };
        let engine = agree_engine(exchange, world, request, &EngineOffer { node: node_key(), unable })?;
        let options = match heap {
            Some(heap) if engine.copy_engine => match cuda.set_shared_device_memory(heap.clone()) {
                true => Ok(NcclOptions { copy_engine: Some(heap) }),
                false => Err(BootstrapError::SharedMemoryTaken),
            },
            _ => Ok(NcclOptions::default()),
        };
        // Rank 0 takes part in the id's broadcast even when its install failed, so no rank waits for it.
        let id = share_unique_id(exchange, rank, || match &options {
            Ok(_) => NcclUniqueId::generate().map(|id| id.to_bytes()).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        });
        let options = options?;
        let id = NcclUniqueId::from(id?);
        Ok(NcclBootstrap { factory: factory_with_options(cuda.clone(), id, rank, world, options), engine })
    }

    /// Everything a rank needs from the torchrun / SLURM environment: where it sits, its GPU, the rendezvous it
    /// joined and its NCCL bootstrap.
    #[derive(Debug)]
    pub struct EnvBootstrap {
        /// The launch environment ([`LaunchEnv::from_env`]).
        pub env: LaunchEnv,
        /// The rank's GPU ([`open_rank_gpu`]).
        pub cuda: Arc<CudaPlatform>,
        /// The weightferry rendezvous the rank joined (for the host engine's own exchanges, or a barrier).
        pub rendezvous: Arc<Rendezvous>,
        /// The communicator's factory and the AllGather engine.
        pub nccl: NcclBootstrap,
    }

    /// [`bootstrap_nccl`] from the process environment: reads [`LaunchEnv::from_env`], joins the weightferry
    /// rendezvous at `MASTER_ADDR:MASTER_PORT` with `options`, opens the rank's GPU and bootstraps NCCL over the
    /// rendezvous. It joins before opening the GPU, so a rank whose GPU fails drops its connection and the other
    /// ranks fail at their next exchange rather than at the rendezvous timeout.
    pub fn bootstrap_nccl_from_env(
        request: AllGatherEngine,
        options: RendezvousOptions,
    ) -> Result<EnvBootstrap, BootstrapError> {
        let env = LaunchEnv::from_env()?;
        let rendezvous = Rendezvous::connect(&env, options)
            .map_err(|e| BootstrapError::Exchange { step: "joining the rendezvous", source: e.into() })?;
        let rendezvous = Arc::new(rendezvous);
        let cuda = open_rank_gpu(&env)?;
        let nccl = bootstrap_nccl(&cuda, env.rank, env.world, request, rendezvous.as_ref())?;
        Ok(EnvBootstrap { env, cuda, rendezvous, nccl })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier, Mutex};

    /// An in-memory group of `world` ranks (threads); `tamper` rewrites what one rank contributes.
    struct Shared {
        barrier: Barrier,
        slots: Mutex<Vec<Vec<u8>>>,
        tamper: Option<(usize, Vec<u8>)>,
    }

    struct Fake {
        rank: usize,
        shared: Arc<Shared>,
    }

    impl Fake {
        fn exchange(&self, slot: usize, mine: Option<&[u8]>) -> Vec<Vec<u8>> {
            if let Some(mine) = mine {
                let mine = match &self.shared.tamper {
                    Some((r, bytes)) if *r == self.rank => bytes.clone(),
                    _ => mine.to_vec(),
                };
                self.shared.slots.lock().unwrap()[slot] = mine;
            }
            self.shared.barrier.wait();
            let all = self.shared.slots.lock().unwrap().clone();
            self.shared.barrier.wait();
            all
        }
    }

    impl RankExchange for Fake {
        fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, ExchangeError> {
            Ok(self.exchange(self.rank, Some(mine)))
        }

        fn broadcast_from_zero(&self, root_payload: Option<&[u8]>) -> Result<Vec<u8>, ExchangeError> {
            Ok(self.exchange(0, root_payload).swap_remove(0))
        }
    }

    /// Runs `f` on every rank of a fake group of `world`; results by rank.
    fn group<T: Send>(world: usize, tamper: Option<(usize, Vec<u8>)>, f: impl Fn(usize, &Fake) -> T + Sync) -> Vec<T> {
        let shared =
            Arc::new(Shared { barrier: Barrier::new(world), slots: Mutex::new(vec![Vec::new(); world]), tamper });
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|rank| {
                    let (f, fake) = (&f, Fake { rank, shared: shared.clone() });
                    s.spawn(move || f(rank, &fake))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn offer(unable: Option<&str>) -> EngineOffer {
        EngineOffer { node: "node-a".to_string(), unable: unable.map(str::to_string) }
    }

    /// Every rank's choice when `unable[r]` is what rank `r` cannot do.
    fn agree(request: AllGatherEngine, unable: &[Option<&str>]) -> Vec<Result<EngineChoice, BootstrapError>> {
        group(unable.len(), None, |rank, ex| agree_engine(ex, unable.len(), request, &offer(unable[rank])))
    }

    #[test]
    fn every_rank_takes_the_copy_engines_when_all_can() {
        for world in [2, 3] {
            for request in [AllGatherEngine::Auto, AllGatherEngine::CopyEngine] {
                let got = agree(request, &vec![None; world]);
                assert_eq!(got, vec![Ok(EngineChoice { copy_engine: true, note: None }); world], "{request:?}");
            }
        }
    }

    #[test]
    fn auto_falls_back_to_kernels_on_every_rank_with_the_reason() {
        let got = agree(AllGatherEngine::Auto, &[None, Some("NCCL 22703 has no copy-engine AllGather")]);
        let kernels = EngineChoice {
            copy_engine: false,
            note: Some("rank 1: NCCL 22703 has no copy-engine AllGather".to_string()),
        };
        assert_eq!(got, vec![Ok(kernels.clone()), Ok(kernels)]);
        let got = agree(AllGatherEngine::Auto, &[None, None, Some("NCCL_WIN_ENABLE=0")]);
        assert!(
            got.iter().all(|c| c.as_ref().unwrap().note.as_deref() == Some("rank 2: NCCL_WIN_ENABLE=0")),
            "{got:?}"
        );
        assert!(got.iter().all(|c| !c.as_ref().unwrap().copy_engine));
    }

    #[test]
    fn a_demanded_copy_engine_fails_on_every_rank_when_one_cannot() {
        let got = agree(AllGatherEngine::CopyEngine, &[None, Some("no symmetric memory"), None]);
        let refused = BootstrapError::CopyEngine(CopyEngineRefused { why: "rank 1: no symmetric memory".to_string() });
        assert_eq!(got, vec![Err(refused.clone()), Err(refused.clone()), Err(refused.clone())]);
        assert_eq!(
            refused.to_string(),
            "--allgather-engine copy-engine: rank 1: no symmetric memory; use --allgather-engine auto or kernel"
        );
        // Kernels asked for: no rank's offer matters.
        let got = agree(AllGatherEngine::Kernel, &[Some("kernels were asked for"), None]);
        assert_eq!(got, vec![Ok(EngineChoice { copy_engine: false, note: None }); 2]);
    }

    #[test]
    fn a_malformed_offer_is_an_error_naming_its_rank() {
        for (world, bad) in [(2, 1), (3, 2)] {
            let got = group(world, Some((bad, b"garbage without a separator".to_vec())), |_, ex| {
                agree_engine(ex, world, AllGatherEngine::Auto, &offer(None))
            });
            for r in got {
                let e = r.unwrap_err();
                assert_eq!(
                    e,
                    BootstrapError::MalformedOffer {
                        rank: bad,
                        source: OfferError::NoSeparator { text: "garbage without a separator".into() }
                    }
                );
                assert_eq!(
                    e.to_string(),
                    format!(
                        "rank {bad} sent an AllGather engine offer this rank cannot read (malformed AllGather engine \
                         offer \"garbage without a separator\"); do all ranks run the same weightferry version?"
                    )
                );
            }
        }
    }

    /// An exchange that fails, or answers with the wrong number of entries.
    struct Broken(Option<usize>);

    impl RankExchange for Broken {
        fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, ExchangeError> {
            match self.0 {
                Some(n) => Ok(vec![mine.to_vec(); n]),
                None => Err(ExchangeError::Other("the store is gone".into())),
            }
        }

        fn broadcast_from_zero(&self, _: Option<&[u8]>) -> Result<Vec<u8>, ExchangeError> {
            Err(ExchangeError::Other("the store is gone".into()))
        }
    }

    #[test]
    fn exchange_failures_name_the_step() {
        let e = agree_engine(&Broken(None), 2, AllGatherEngine::Auto, &offer(None)).unwrap_err();
        assert_eq!(e.to_string(), "agreeing on the AllGather engine: the store is gone");
        let e = agree_engine(&Broken(Some(3)), 2, AllGatherEngine::Auto, &offer(None)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "agreeing on the AllGather engine: the exchange returned 3 entries for a world of 2 ranks"
        );
        let e = share_unique_id(&Broken(None), 1, || unreachable!("only rank 0 generates")).unwrap_err();
        assert_eq!(e.to_string(), "sharing the NCCL unique id: the store is gone");
        let rdv = RendezvousError::Broken("rank 2 left".into());
        assert_eq!(
            BootstrapError::Exchange { step: "sharing the NCCL unique id", source: rdv.into() }.to_string(),
            "sharing the NCCL unique id: the rendezvous is broken by an earlier failure: rank 2 left"
        );
    }

    #[test]
    fn rank_0s_unique_id_reaches_every_rank_byte_for_byte() {
        let id: [u8; UNIQUE_ID_BYTES] = std::array::from_fn(|i| (i as u8).wrapping_mul(31) ^ 0xA5);
        for world in [2, 3] {
            let got = group(world, None, |rank, ex| {
                share_unique_id(ex, rank, || {
                    assert_eq!(rank, 0, "rank {rank} generated an id");
                    Ok(id)
                })
            });
            assert_eq!(got, vec![Ok(id); world]);
        }
    }

    #[test]
    fn a_failed_or_wrong_unique_id_fails_every_rank_at_once() {
        let got = group(3, None, |rank, ex| share_unique_id(ex, rank, || Err("ncclGetUniqueId failed".into())));
        assert_eq!(
            got,
            vec![
                Err(BootstrapError::UniqueId("ncclGetUniqueId failed".into())),
                Err(BootstrapError::NoUniqueId),
                Err(BootstrapError::NoUniqueId)
            ]
        );
        assert_eq!(
            got[1].as_ref().unwrap_err().to_string(),
            "rank 0 could not generate the NCCL unique id (rank 0's error says why)"
        );
        // Rank 0 of another version sending 64 bytes.
        let got = group(2, Some((0, vec![7; 64])), |rank, ex| share_unique_id(ex, rank, || Ok([7; UNIQUE_ID_BYTES])));
        assert_eq!(
            got[1].as_ref().unwrap_err().to_string(),
            "rank 0 sent an NCCL unique id of 64 bytes, not 128; do all ranks run the same weightferry version?"
        );
    }

    #[test]
    fn a_rank_takes_its_local_rank_or_the_only_visible_gpu() {
        assert_eq!(gpu_ordinal(0, 2), Ok(0));
        assert_eq!(gpu_ordinal(1, 2), Ok(1));
        assert_eq!(gpu_ordinal(3, 1), Ok(0));
        assert_eq!(gpu_ordinal(0, 0), Err(BootstrapError::NoGpu));
        assert_eq!(
            gpu_ordinal(2, 2).unwrap_err().to_string(),
            "LOCAL_RANK=2 but this process sees 2 GPUs (0..1); start at most 2 ranks per node, or give each rank one \
             GPU with CUDA_VISIBLE_DEVICES"
        );
        assert_eq!(BootstrapError::NoGpu.to_string(), "no GPU is visible to this process (check CUDA_VISIBLE_DEVICES)");
    }

    #[test]
    fn the_rendezvous_is_a_rank_exchange() {
        let rdv = Rendezvous::single();
        let ex: &dyn RankExchange = &rdv;
        assert_eq!(ex.all_gather_bytes(b"x"), Ok(vec![b"x".to_vec()]));
        assert_eq!(share_unique_id(ex, 0, || Ok([3; UNIQUE_ID_BYTES])), Ok([3; UNIQUE_ID_BYTES]));
        assert_eq!(
            agree_engine(ex, 1, AllGatherEngine::Auto, &offer(None)),
            Ok(EngineChoice { copy_engine: true, note: None })
        );
    }
}
