//! Writes `<dir>/<preset>.json` for each preset named: the preset's pipeline description in the pipeline JSON
//! format (`weightferry::pipeline::json::to_pipeline_json`), the exact module tree, tensors, shapes and dtypes that
//! `weightferry bench` runs. `benches/peers/peer_bench.py` builds its PyTorch model from these files.
fn main() {
    let mut args = std::env::args().skip(1);
    let dir = args.next().expect("usage: export DIR PRESET...");
    std::fs::create_dir_all(&dir).expect("create output folder");
    for name in args {
        let desc = weightferry::pipeline::presets::preset(&name).unwrap_or_else(|| panic!("unknown preset {name}"));
        let path = std::path::Path::new(&dir).join(format!("{name}.json"));
        std::fs::write(&path, weightferry::pipeline::json::to_pipeline_json(&desc)).expect("write");
        eprintln!("wrote {}", path.display());
    }
}
