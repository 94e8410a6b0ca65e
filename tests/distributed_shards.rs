//! Sharded host masters of distributed layerwise offload on the tiny presets: for groups of 2, 3 and 4 ranks,
//! unchunked and at several chunk sizes (not dividing the sections, and larger than them), the shards of all ranks
//! reassemble every section of every streamed unit bit-exactly, every shard is zero-padded,
//! and the host bytes of all ranks together equal one copy of the sections plus less than `N · ALIGN` bytes of
//! padding per section. A chunk size so small that a block would need more AllGathers than a stack holds events
//! for is a typed error. A storage released to the shards (`Home::Sharded`) frees its loaded buffer and is a typed
//! error to every read (bytes, range, checksum, resident upload) until it is restored from a buffer holding its
//! bytes, after which the model's checksum is the one before.

use std::sync::Arc;
use weightferry::config::OffloadConfig;
use weightferry::model::{Home, HostModel, ModelError};
use weightferry::offload::distributed::{build_sharded_masters, DistributedError, ShardedMasters};
use weightferry::offload::layout::{section_bytes, UnitLayout, ALIGN};
use weightferry::offload::units::build_unit_plan;
use weightferry::offload::ResidentPlacement;
use weightferry::pipeline::presets::preset;
use weightferry::pipeline::StorageId;
use weightferry::plan::resolve_offload_plan;
use weightferry_actors::platform::{HostMemoryKind, Platform, PlatformError, PlatformRef};
use weightferry_actors::shard::{reassemble, ShardError};
use weightferry_actors::sim::{SimConfig, SimPlatform};

#[path = "support/synthetic.rs"]
mod synthetic;
use synthetic::SyntheticWeights;

const PRESETS: [&str; 3] = ["flux-tiny", "wan-tiny", "qwen-tiny"];

/// Chunk sizes (gathered bytes per AllGather): none, smaller than most sections and not dividing them, larger
/// than every section.
const CHUNKS: [Option<u64>; 4] = [None, Some(100), Some(1000), Some(1 << 30)];

/// The tiny preset loaded with synthetic weights, and the units its layerwise plan streams.
fn model_and_units(name: &str) -> (HostModel, Vec<UnitLayout>) {
    let desc = preset(name).expect("preset");
    let config = OffloadConfig::from_json_str(
        r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"]}}"#,
    )
    .expect("config");
    let plan = resolve_offload_plan(&desc, &config).expect("plan");
    let units: Vec<UnitLayout> =
        build_unit_plan(&desc, &config, &plan).stacks.into_iter().flat_map(|s| s.units).collect();
    let platform: PlatformRef =
        Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap());
    let model = HostModel::synthetic(platform, Arc::new(desc), 7).expect("model");
    (model, units)
}

#[test]
fn shards_of_all_ranks_reassemble_every_section_of_the_tiny_presets() {
    for name in PRESETS {
        let (model, units) = model_and_units(name);
        assert!(units.len() > 2, "{name}: expected streamed units");
        let platform = model.platform().clone();
        let full_bytes: u64 = units.iter().flat_map(|u| &u.sections).map(|s| s.len).sum();
        let sections: u64 = units.iter().map(|u| u.sections.len() as u64).sum();
        for (world, chunk) in [2usize, 3, 4].into_iter().flat_map(|w| CHUNKS.map(|c| (w, c))) {
            let masters: Vec<ShardedMasters> = (0..world)
                .map(|rank| build_sharded_masters(&model, &units, world, rank, HostMemoryKind::Pinned, chunk).unwrap())
                .collect();
            let mut padding_total = 0u64;
            for (u, unit) in units.iter().enumerate() {
                for (s, sec) in unit.sections.iter().enumerate() {
                    let what = format!("{name} N={world} chunk {chunk:?} unit {} section {:?}", unit.path, sec.dtype);
                    let full = section_bytes(&model, sec).unwrap();
                    let shards: Vec<Vec<u8>> = masters.iter().map(|m| m.read_shard(&platform, u, s).unwrap()).collect();
                    let spec = masters[0].units[u].sections[s].spec;
                    assert_eq!(spec.total_bytes(), sec.len, "{what}");
                    assert_eq!(spec.elem_size(), sec.dtype.size_bytes(), "{what}");
                    assert!(shards.iter().all(|x| x.len() as u64 == spec.shard_bytes()), "{what}");
                    assert_eq!(spec.reassemble(&shards).unwrap(), full, "{what}: not bit-exact");
                    if chunk.is_none() {
                        assert_eq!(spec.chunk_count(), 1, "{what}");
                        assert_eq!(reassemble(&shards, full.len()).unwrap(), full, "{what}: not bit-exact");
                    }
                    let gathered = spec.gather(&shards).unwrap();
                    assert!(gathered[full.len()..].iter().all(|&b| b == 0), "{what}: padding is not zero");
                    assert!(spec.padding_bytes() < world as u64 * ALIGN, "{what}");
                    padding_total += spec.padding_bytes();
                    for m in &masters {
                        assert_eq!(m.units[u].sections[s].device_offset, sec.device_offset, "{what}");
                        assert_eq!(m.units[u].path, unit.path, "{what}");
                    }
                }
            }
            if world == 3 && chunk.is_none() {
                // Sections are multiples of 256 bytes, so only a group of 3 pads; make sure padding is exercised.
                assert!(padding_total > 0, "{name}: no padded section at N=3");
            }
            let host: u64 = masters.iter().map(ShardedMasters::host_bytes).sum();
            assert_eq!(host, full_bytes + padding_total, "{name} N={world} chunk {chunk:?}");
            assert!(host < full_bytes + sections * world as u64 * ALIGN, "{name} N={world}");
            for m in masters {
                m.free(&platform).unwrap();
            }
        }
    }
}

#[test]
fn one_rank_keeps_the_whole_master() {
    let (model, units) = model_and_units("flux-tiny");
    let platform = model.platform().clone();
    let m = build_sharded_masters(&model, &units, 1, 0, HostMemoryKind::Pageable, None).unwrap();
    let full_bytes: u64 = units.iter().flat_map(|u| &u.sections).map(|s| s.len).sum();
    assert_eq!(m.host_bytes(), full_bytes);
    assert_eq!(m.read_shard(&platform, 0, 0).unwrap(), section_bytes(&model, &units[0].sections[0]).unwrap());
    assert_eq!(
        m.read_shard(&platform, units.len(), 0),
        Err(DistributedError::NoSuchSection { unit: units.len(), section: 0 })
    );
    m.free(&platform).unwrap();
}

#[test]
fn a_bad_group_is_a_typed_error() {
    let (model, units) = model_and_units("wan-tiny");
    match build_sharded_masters(&model, &units, 2, 2, HostMemoryKind::Pinned, None) {
        Err(DistributedError::Shard { source: ShardError::RankOutOfRange { rank: 2, world: 2 }, .. }) => {}
        other => panic!("expected a rank error, got {other:?}"),
    }
    match build_sharded_masters(&model, &units, 0, 0, HostMemoryKind::Pinned, None) {
        Err(DistributedError::Shard { source: ShardError::ZeroRanks, .. }) => {}
        other => panic!("expected a zero-ranks error, got {other:?}"),
    }
}

#[test]
fn chunked_sections_split_into_several_gathers() {
    let (model, units) = model_and_units("flux-tiny");
    let platform = model.platform().clone();
    let whole = build_sharded_masters(&model, &units, 2, 0, HostMemoryKind::Pinned, None).unwrap();
    let chunked = build_sharded_masters(&model, &units, 2, 0, HostMemoryKind::Pinned, Some(1000)).unwrap();
    let count =
        |m: &ShardedMasters| -> u64 { m.units.iter().flat_map(|u| &u.sections).map(|s| s.spec.chunk_count()).sum() };
    assert_eq!(count(&whole), units.iter().map(|u| u.sections.len() as u64).sum::<u64>());
    assert!(count(&chunked) > count(&whole), "a 1000-byte chunk should split the tiny sections");
    whole.free(&platform).unwrap();
    chunked.free(&platform).unwrap();
}

#[test]
fn a_chunk_too_small_for_the_gather_limit_is_a_typed_error() {
    let (model, units) = model_and_units("flux-tiny");
    match build_sharded_masters(&model, &units, 2, 0, HostMemoryKind::Pinned, Some(1)) {
        Err(e @ DistributedError::TooManyGathers { chunk_bytes: 1, max: 4096, .. }) => {
            assert!(e.to_string().contains("use a larger chunk size"), "{e}");
        }
        other => panic!("expected TooManyGathers, got {other:?}"),
    }
}

#[test]
fn a_released_storage_is_a_typed_error_to_every_read_and_comes_back_bit_exact() {
    let sim = Arc::new(SimPlatform::new(SimConfig { tracing: false, ..SimConfig::default() }).unwrap());
    let platform: PlatformRef = sim.clone();
    let desc = preset("flux-tiny").expect("preset");
    let mut model = HostModel::synthetic(platform.clone(), Arc::new(desc), 7).expect("model");
    let before = model.checksum().expect("checksum");
    let ids: Vec<StorageId> = model.desc().storages.keys().copied().collect();
    let (s, other) = (ids[1], ids[2]);
    let bytes = model.read_storage(s).expect("read");
    assert!(bytes.len() > 8, "pick a storage with bytes");
    let held = sim.host_memory();

    model.release_to_shards(s).expect("release");
    assert_eq!(model.home(s), Some(Home::Sharded));
    assert_eq!(model.sharded(), vec![s]);
    // The loaded buffer is gone: the model holds exactly that many bytes less.
    let now = sim.host_memory();
    assert_eq!((now.in_use, now.buffers), (held.in_use - bytes.len() as u64, held.buffers - 1));
    let sharded = ModelError::Sharded { storage: s.0 };
    assert_eq!(model.read_storage(s), Err(sharded.clone()));
    let mut out = vec![0xA5u8; 4];
    assert_eq!(model.read_storage_range(s, 2, &mut out), Err(sharded.clone()));
    assert_eq!(out, vec![0xA5u8; 4], "a refused read wrote bytes");
    // Whatever the range: a released storage has no bytes here, not an out-of-range read.
    assert_eq!(model.read_storage_range(s, u64::MAX, &mut out), Err(sharded.clone()));
    assert_eq!(model.checksum(), Err(sharded.clone()));
    assert!(sharded.to_string().contains("reload the pipeline"), "{sharded}");
    assert_eq!(
        model.loaded_bytes(),
        model.desc().storages.values().map(|d| d.byte_size()).sum::<u64>() - bytes.len() as u64
    );
    // Nothing reads it through another path either: the resident placement refuses before allocating.
    let stream = platform.create_stream("upload").unwrap();
    assert_eq!(ResidentPlacement::upload(&platform, &model, &[other, s], stream).unwrap_err(), sharded);
    assert_eq!(sim.device_memory().in_use, 0);
    // Moves from the wrong home change nothing.
    let wrong = |found, expected| ModelError::WrongHome { storage: s.0, expected, found };
    assert_eq!(model.release_to_shards(s), Err(wrong("sharded", "loaded")));
    let spare = platform.alloc_host(bytes.len() as u64, HostMemoryKind::Pageable).unwrap();
    assert_eq!(
        model.restore_from_shards(other, spare),
        Err(ModelError::WrongHome { storage: other.0, expected: "sharded", found: "loaded" })
    );
    let short = platform.alloc_host(bytes.len() as u64 - 1, HostMemoryKind::Pageable).unwrap();
    assert!(matches!(
        model.restore_from_shards(s, short),
        Err(ModelError::Platform(PlatformError::OutOfBounds { what: "restored storage", .. }))
    ));
    assert_eq!(model.home(s), Some(Home::Sharded));
    platform.free_host(short).unwrap();

    // Restored from a buffer holding its bytes: loaded again, bit-exact.
    platform.write_host(spare, 0, &bytes).unwrap();
    model.restore_from_shards(s, spare).expect("restore");
    assert_eq!(model.home(s), Some(Home::Loaded { buf: spare }));
    assert!(model.sharded().is_empty());
    assert_eq!(model.read_storage(s).unwrap(), bytes);
    assert_eq!(model.checksum().unwrap(), before);
    assert_eq!(sim.host_memory().in_use, held.in_use);
    model.release();
    assert_eq!(sim.host_memory().in_use, 0, "the restored buffer belongs to the model");
    sim.shutdown();
}
