//! What the tests of the `weightferry` binary share: running it with the test's own launch environment removed (a
//! `RANK` or `WORLD_SIZE` inherited from the shell would turn `run` into one rank of a distributed run).

use std::process::{Command, Output};
use weightferry::dist::LaunchEnv;

/// Runs the binary with `args`, every launch variable ([`LaunchEnv::VARS`]) and `RUST_LOG` removed, then `env` set.
pub(crate) fn weightferry(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_weightferry"));
    c.args(args).env_remove("RUST_LOG");
    for v in LaunchEnv::VARS {
        c.env_remove(v);
    }
    c.envs(env.iter().copied()).output().expect("spawn")
}
