//! The process launcher (`weightferry_harness::drivers::launch`) with `sh` as the program: every rank gets the launch
//! environment; a failing rank stops the others (a sleeping rank is killed, not waited for) and is named with its
//! exit status; a rank that exits with `PEER_FAILED_EXIT` (it failed because another did) is named only when no
//! rank failed on its own; a rank stopped by SIGSTOP is named instead of the healthy rank that gave up on it; every
//! launch gives its ranks one fresh run id.

#![cfg(unix)]

use std::ffi::OsString;
use std::time::{Duration, Instant};
use weightferry_harness::drivers::launch::{launch, LaunchError, LaunchSpec, PEER_FAILED_EXIT};

fn sh(nproc: usize, script: &str) -> LaunchSpec {
    LaunchSpec {
        nproc,
        master_port: Some(29_999),
        program: "sh".into(),
        args: vec![OsString::from("-c"), OsString::from(script)],
    }
}

#[test]
fn every_rank_gets_the_launch_environment() {
    let script = r#"test "$WORLD_SIZE" = 3 && test "$RANK" = "$LOCAL_RANK" && test "$RANK" -lt 3 \
        && test "$MASTER_ADDR" = 127.0.0.1 && test "$MASTER_PORT" = 29999"#;
    assert_eq!(launch(&sh(3, script)), Ok(()));
    // NCCL defaults (multicast off, 4 channels) unless the launching environment chose otherwise.
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() && std::env::var_os("NCCL_MAX_NCHANNELS").is_none() {
        let script = r#"test "$NCCL_NVLS_ENABLE" = 0 && test "$NCCL_MAX_NCHANNELS" = 4"#;
        assert_eq!(launch(&sh(2, script)), Ok(()));
    }
}

#[test]
fn a_failing_rank_stops_the_others_and_is_named() {
    let t = Instant::now();
    let r = launch(&sh(3, r#"if [ "$RANK" = 2 ]; then exit 7; fi; sleep 30"#));
    assert_eq!(r, Err(LaunchError::RankFailed { rank: 2, status: "exit status 7".into() }));
    assert!(t.elapsed() < Duration::from_secs(10), "the sleeping ranks were waited for: {:?}", t.elapsed());
    assert_eq!(r.unwrap_err().to_string(), "rank 2 failed (exit status 7); the other ranks were stopped");
}

#[test]
fn the_rank_that_failed_on_its_own_is_named_before_ranks_that_followed_it() {
    let script = format!(r#"if [ "$RANK" = 0 ]; then exit {PEER_FAILED_EXIT}; fi; sleep 0.3; exit 1"#);
    let r = launch(&sh(2, &script));
    assert_eq!(r, Err(LaunchError::RankFailed { rank: 1, status: "exit status 1".into() }));
    // Only ranks that failed because of another: the first is named.
    let script = format!(r#"if [ "$RANK" = 1 ]; then exit {PEER_FAILED_EXIT}; fi; sleep 0.2"#);
    let r = launch(&sh(2, &script));
    assert_eq!(r, Err(LaunchError::RankFailed { rank: 1, status: format!("exit status {PEER_FAILED_EXIT}") }));
}

#[test]
fn bad_launches_are_errors() {
    assert_eq!(launch(&sh(0, "true")), Err(LaunchError::NoProcesses));
    let mut spec = sh(1, "true");
    spec.args.clear();
    assert_eq!(launch(&spec), Err(LaunchError::NoCommand));
    spec.program = "/nonexistent/weightferry".into();
    spec.args = vec!["run".into()];
    match launch(&spec) {
        Err(LaunchError::Spawn { rank: 0, .. }) => {}
        other => panic!("expected a spawn error, got {other:?}"),
    }
}

/// A rank stopped by SIGSTOP is the one named when another rank gives up waiting for it (exit
/// `PEER_FAILED_EXIT`), not the healthy rank that gave up; the stopped rank is killed, and launch returns at once.
#[test]
fn a_stopped_rank_is_named_not_the_rank_that_gave_up_on_it() {
    let t = Instant::now();
    let script = format!(r#"if [ "$RANK" = 1 ]; then kill -STOP $$; fi; sleep 0.5; exit {PEER_FAILED_EXIT}"#);
    let r = launch(&sh(2, &script));
    let Err(LaunchError::Stopped { rank: 1, pid, waiting: 0, status }) = &r else { panic!("{r:?}") };
    assert_eq!(status, &format!("exit status {PEER_FAILED_EXIT}"));
    assert_eq!(
        r.as_ref().unwrap_err().to_string(),
        format!(
            "rank 1 (pid {pid}) was stopped (SIGSTOP or a debugger) and stopped answering; rank 0 gave up waiting for \
             it (exit status 3); every rank was stopped"
        )
    );
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "the stopped rank {pid} was left behind");
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
}

/// Every rank gets a run id, the same for all ranks of one launch and another for the next launch.
#[test]
fn every_launch_gives_its_ranks_one_fresh_run_id() {
    let dir = std::env::temp_dir().join(format!("weightferry-launch-run-id-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = format!(r#"test -n "$WEIGHTFERRY_RUN_ID" && echo "$WEIGHTFERRY_RUN_ID" > {}/$RANK"#, dir.display());
    let read = |r: usize| std::fs::read_to_string(dir.join(r.to_string())).unwrap();
    assert_eq!(launch(&sh(2, &script)), Ok(()));
    let first = read(0);
    assert_eq!(read(1), first);
    assert_eq!(launch(&sh(2, &script)), Ok(()));
    assert_ne!(read(0), first);
}
