//! `weightferry launch --nproc N [--master-port P] -- <command>`: runs `N` copies of this executable with
//! `<command>` as the ranks of one distributed run on this machine (see [`crate::drivers::launch`]). Exit codes: 0
//! when every rank succeeded; 1 when one failed (the message names the first rank that failed and its exit
//! status; the others are stopped); 2 for invalid arguments; 130 / 143 when launch got SIGINT / SIGTERM (sent on
//! to every rank, which were then stopped).

use super::{CliError, LaunchArgs};
use crate::drivers::launch::{launch_forwarding_signals, signal_number, LaunchError, LaunchSpec};
use std::ffi::OsString;

/// Runs `weightferry launch`; returns the exit code.
pub fn launch(a: &LaunchArgs) -> Result<i32, CliError> {
    if a.command.is_empty() {
        return Err(CliError::invalid(
            "launch needs the command every rank runs, after `--`: e.g. weightferry launch --nproc 2 -- run --preset \
             flux-tiny",
        ));
    }
    let program = std::env::current_exe()
        .map_err(|e| CliError::failed(format!("cannot find the weightferry executable to launch: {e}")))?;
    let spec = LaunchSpec {
        nproc: a.nproc as usize,
        master_port: a.master_port,
        program,
        args: a.command.iter().map(OsString::from).collect(),
    };
    match launch_forwarding_signals(&spec) {
        Ok(()) => Ok(0),
        Err(e @ (LaunchError::NoProcesses | LaunchError::NoCommand)) => Err(CliError::invalid(e.to_string())),
        Err(e @ LaunchError::Signalled { signal, .. }) => {
            let mut err = CliError::failed(e.to_string());
            err.code = 128 + signal_number(signal);
            Err(err)
        }
        Err(e) => Err(CliError::failed(e.to_string())),
    }
}
