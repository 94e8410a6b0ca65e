//! One rank of distributed layerwise offload on a real GPU over NCCL, through the library's backend API
//! (`get_offload_backend` with an NCCL communicator of one rank): every DiT block is rebuilt by shard H2D + NCCL
//! AllGather, the output is bit-identical to the resident run on the same GPU, and the released host weights are
//! restored bit-exactly at disable. Needs a CUDA GPU and libnccl (`cargo test --features nccl -- --ignored`).
#![cfg(feature = "nccl")]

use std::sync::Arc;
use weightferry::model::HostModel;
use weightferry::pipeline::presets::preset;
use weightferry::platform::cuda::nccl::{NcclCollective, NcclUniqueId};
use weightferry::platform::cuda::CudaPlatform;
use weightferry::scheduler::{Collective, CollectiveFactory, Platform, PlatformRef};
use weightferry_harness::drivers::distributed::{
    rank_session, resident_run_with_model, run_rank_in_session, DistributedRunSpec,
};
use weightferry_harness::engine::compute::Compute;
use weightferry_harness::engine::cuda::{CudaCompute, GpuShape};
use weightferry_harness::engine::synthetic::SyntheticWeights;

#[test]
#[ignore = "needs a CUDA GPU and libnccl"]
fn one_nccl_rank_through_the_backend_api_is_bit_exact_and_restores_the_host_weights() {
    for (name, chunk) in [("flux-tiny", None), ("wan-tiny", Some(4096u64))] {
        let desc = preset(name).unwrap();
        let cuda = Arc::new(CudaPlatform::new(0).expect("GPU 0"));
        let platform: PlatformRef = cuda.clone();
        let shape = GpuShape { tokens: 64, context_tokens: 16 };
        let compute: Arc<dyn Compute> = Arc::new(CudaCompute::new(cuda.clone(), &desc, shape).unwrap());
        let model = HostModel::synthetic(platform.clone(), Arc::new(desc.clone()), 7).unwrap();
        let before = model.checksum().unwrap();
        let mut spec = DistributedRunSpec::new(desc.clone(), 1);
        (spec.seed, spec.depth, spec.chunk_bytes) = (7, 2, chunk);
        let id = NcclUniqueId::generate().expect("unique id");
        let p = cuda.clone();
        let factory: CollectiveFactory = Box::new(move || {
            let comm = NcclCollective::new(p, &id, 0, 1)?;
            Ok(Box::new(comm) as Box<dyn Collective>)
        });
        let mut session = rank_session(model, factory, 0, 1, &spec).unwrap();
        let resident = resident_run_with_model(compute.clone(), session.model(), &desc, 3, 7, None, 1).unwrap();
        let run = run_rank_in_session(compute, &mut session, 0, 1, &spec).unwrap();
        assert!(run.output == resident.output, "{name}: the NCCL rank's output differs from the resident run");
        assert!(run.issued.len() as u64 >= 3 * run.sections, "{name}: {} gathers", run.issued.len());
        assert!(run.released_bytes > 0, "{name}: the rank released its loaded DiT weights");
        assert!(!run.restore_issued.is_empty(), "{name}");
        assert_eq!(session.model().checksum().unwrap(), before, "{name}: host weights after the restore");
        drop(session);
        assert_eq!(cuda.device_memory().in_use, 0, "{name}: device memory left behind");
    }
}
