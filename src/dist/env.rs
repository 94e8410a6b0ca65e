//! The launch environment of one process of a distributed run, read the way the ecosystem sets it: `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` (torchrun, `weightferry launch`, or a job script),
//! falling back to SLURM's `SLURM_PROCID`, `SLURM_NTASKS` and `SLURM_LOCALID` for rank, world size and local rank
//! when the torchrun variables are not set (`srun` sets those; `MASTER_ADDR` / `MASTER_PORT` still come from the
//! job script).
//!
//! The run id ([`LaunchEnv::run_id`]) tells the ranks of one run from strangers on the rendezvous port:
//! `WEIGHTFERRY_RUN_ID` (`weightferry launch` sets a fresh one per launch), else torchrun's
//! `TORCHELASTIC_RUN_ID`, else SLURM's `SLURM_JOB_ID` and `SLURM_STEP_ID`.
//!
//! Invariant: a [`LaunchEnv`] exists only if it is consistent: `1 <= world <=` [`MAX_WORLD`], `rank < world`,
//! and, when `world > 1`, a master address that is a host alone (a name or an IP address, no port) and a port in
//! `1..=65535`. Every rejection is a [`LaunchEnvError`] naming the variable, its value and the fix.

use super::rendezvous::MAX_WORLD;

/// Why the launch environment is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchEnvError {
    /// A variable is not a number of the expected kind.
    #[error("{var}={value:?} is not {expected}; {fix}")]
    NotANumber {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What it should be.
        expected: &'static str,
        /// How to fix it.
        fix: &'static str,
    },
    /// `WORLD_SIZE` is 0.
    #[error("{var}=0: a run needs at least one process; set {var} to the number of processes (one per GPU)")]
    ZeroWorld {
        /// The variable read (`WORLD_SIZE` or `SLURM_NTASKS`).
        var: &'static str,
    },
    /// The world size is over [`MAX_WORLD`].
    #[error(
        "{var}={world} is more ranks than a weightferry run supports (at most {MAX_WORLD}: rank 0's rendezvous \
         holds one connection per rank); set {var} to the number of processes (one per GPU)"
    )]
    WorldTooLarge {
        /// The variable read (`WORLD_SIZE` or `SLURM_NTASKS`).
        var: &'static str,
        /// Its value.
        world: usize,
    },
    /// `MASTER_ADDR` is not a host alone.
    #[error(
        "MASTER_ADDR={value:?} is not a host name or IP address ({reason}); set MASTER_ADDR to the rank-0 host \
         alone (e.g. 10.0.0.1, node0 or ::1) and its port in MASTER_PORT"
    )]
    BadAddr {
        /// The value.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A variable a multi-process run needs is not set.
    #[error("{var} is not set but {world_var}={world} asks for a distributed run; {fix}")]
    Missing {
        /// The variable.
        var: &'static str,
        /// The variable the world size was read from (`WORLD_SIZE` or `SLURM_NTASKS`).
        world_var: &'static str,
        /// The world size.
        world: usize,
        /// How to fix it.
        fix: &'static str,
    },
    /// The rank is not below the world size.
    #[error("{var}={rank} is not below WORLD_SIZE={world}; ranks run from 0 to {last}, one per process", last = world - 1)]
    RankOutOfRange {
        /// The variable read (`RANK` or `SLURM_PROCID`).
        var: &'static str,
        /// The rank.
        rank: usize,
        /// The world size.
        world: usize,
    },
    /// The port is not a TCP port.
    #[error("MASTER_PORT={value:?} is not a TCP port; use a free port in 1..=65535 (the same on every rank)")]
    BadPort {
        /// The value.
        value: String,
    },
}

/// Where this process sits in a distributed run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This process's rank (`RANK`), in `0..world`.
    pub rank: usize,
    /// Processes in the run (`WORLD_SIZE`); 1 when not set.
    pub world: usize,
    /// This process's rank on its node (`LOCAL_RANK`; defaults to `rank`): which GPU it drives.
    pub local_rank: usize,
    /// Address of the rank-0 host (`MASTER_ADDR`); `None` only when `world == 1`.
    pub master_addr: Option<String>,
    /// Port rank 0 listens on for the rendezvous (`MASTER_PORT`); `None` only when `world == 1`.
    pub master_port: Option<u16>,
    /// The id every rank of this run shares (`WEIGHTFERRY_RUN_ID`, `TORCHELASTIC_RUN_ID`, or
    /// `SLURM_JOB_ID.SLURM_STEP_ID`), if the launcher set one; rank 0 drops hellos of other runs.
    pub run_id: Option<String>,
}

impl LaunchEnv {
    /// A single process (rank 0 of 1).
    pub fn single() -> LaunchEnv {
        LaunchEnv { rank: 0, world: 1, local_rank: 0, master_addr: None, master_port: None, run_id: None }
    }

    /// Whether more than one process takes part.
    pub fn is_distributed(&self) -> bool {
        self.world > 1
    }

    /// Every variable [`LaunchEnv::from_vars`] reads (to clear a child's launch environment, e.g. in tests).
    pub const VARS: [&'static str; 12] = [
        "WORLD_SIZE",
        "SLURM_NTASKS",
        "RANK",
        "SLURM_PROCID",
        "LOCAL_RANK",
        "SLURM_LOCALID",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WEIGHTFERRY_RUN_ID",
        "TORCHELASTIC_RUN_ID",
        "SLURM_JOB_ID",
        "SLURM_STEP_ID",
    ];

    /// Reads the process environment.
    pub fn from_env() -> Result<LaunchEnv, LaunchEnvError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// Reads the variables through `var` (`None` = not set), so tests need not touch the process environment.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv, LaunchEnvError> {
        let read = |names: &[&'static str]| -> Option<(&'static str, String)> {
            names.iter().find_map(|&n| var(n).filter(|v| !v.trim().is_empty()).map(|v| (n, v)))
        };
        let (world_var, world) = match read(&["WORLD_SIZE", "SLURM_NTASKS"]) {
            None => ("WORLD_SIZE", 1),
            Some((name, v)) => match number(name, &v, "a positive integer", WORLD_FIX)? {
                0 => return Err(LaunchEnvError::ZeroWorld { var: name }),
                n if n > MAX_WORLD => return Err(LaunchEnvError::WorldTooLarge { var: name, world: n }),
                n => (name, n),
            },
        };
        let rank = match read(&["RANK", "SLURM_PROCID"]) {
            None if world == 1 => 0,
            None => return Err(LaunchEnvError::Missing { var: "RANK", world_var, world, fix: RANK_FIX }),
            Some((name, v)) => {
                let rank = number(name, &v, "a rank (an integer from 0)", RANK_FIX)?;
                if rank >= world {
                    return Err(LaunchEnvError::RankOutOfRange { var: name, rank, world });
                }
                rank
            }
        };
        let local_rank = match read(&["LOCAL_RANK", "SLURM_LOCALID"]) {
            None => rank,
            Some((name, v)) => number(name, &v, "a local rank (an integer from 0)", LOCAL_FIX)?,
        };
        if world == 1 {
            return Ok(LaunchEnv { rank, world, local_rank, master_addr: None, master_port: None, run_id: None });
        }
        let Some((_, addr)) = read(&["MASTER_ADDR"]) else {
            return Err(LaunchEnvError::Missing { var: "MASTER_ADDR", world_var, world, fix: ADDR_FIX });
        };
        check_host(addr.trim()).map_err(|reason| LaunchEnvError::BadAddr { value: addr.clone(), reason })?;
        let run_id = read(&["WEIGHTFERRY_RUN_ID", "TORCHELASTIC_RUN_ID"]).map(|(_, v)| v).or_else(|| {
            read(&["SLURM_JOB_ID"]).map(|(_, job)| match read(&["SLURM_STEP_ID"]) {
                Some((_, step)) => format!("slurm-{job}.{step}"),
                None => format!("slurm-{job}"),
            })
        });
        let Some((_, port)) = read(&["MASTER_PORT"]) else {
            return Err(LaunchEnvError::Missing { var: "MASTER_PORT", world_var, world, fix: PORT_FIX });
        };
        let master_port = match port.trim().parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => return Err(LaunchEnvError::BadPort { value: port }),
        };
        Ok(LaunchEnv {
            rank,
            world,
            local_rank,
            master_addr: Some(addr.trim().to_string()),
            master_port: Some(master_port),
            run_id,
        })
    }
}

/// Why `host` (the trimmed `MASTER_ADDR`) is not a host alone: a name or an IP address, an IPv6 one optionally
/// in brackets, no port.
fn check_host(host: &str) -> Result<(), &'static str> {
    if host.parse::<std::net::IpAddr>().is_ok() {
        return Ok(());
    }
    if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return inner.parse::<std::net::Ipv6Addr>().map(|_| ()).map_err(|_| "not an IPv6 address in brackets");
    }
    if host.contains(':') {
        return Err("it has a ':', but a port belongs in MASTER_PORT");
    }
    if host.chars().any(|c| c.is_whitespace() || c == '/') {
        return Err("it has a space or a '/'");
    }
    Ok(())
}

const WORLD_FIX: &str = "set WORLD_SIZE to the number of processes (one per GPU)";
const RANK_FIX: &str =
    "set RANK to this process's rank, from 0 to WORLD_SIZE - 1 (torchrun and weightferry launch set it)";
const LOCAL_FIX: &str = "set LOCAL_RANK to this process's rank on its node (its GPU index), or unset it";
const ADDR_FIX: &str = "set MASTER_ADDR to the address of the rank-0 host, reachable from every rank";
const PORT_FIX: &str = "set MASTER_PORT to a free TCP port on the rank-0 host, the same on every rank";

fn number(var: &'static str, value: &str, expected: &'static str, fix: &'static str) -> Result<usize, LaunchEnvError> {
    value.trim().parse::<usize>().map_err(|_| LaunchEnvError::NotANumber {
        var,
        value: value.to_string(),
        expected,
        fix,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<LaunchEnv, LaunchEnvError> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        LaunchEnv::from_vars(|n| map.get(n).cloned())
    }

    fn err(pairs: &[(&str, &str)]) -> String {
        env(pairs).unwrap_err().to_string()
    }

    const OK: [(&str, &str); 4] =
        [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500")];

    #[test]
    fn nothing_set_is_a_single_process() {
        assert_eq!(env(&[]).unwrap(), LaunchEnv::single());
        assert!(!LaunchEnv::single().is_distributed());
        assert_eq!(env(&[("WORLD_SIZE", "1")]).unwrap(), LaunchEnv::single());
    }

    #[test]
    fn torchrun_variables() {
        let e = env(&OK).unwrap();
        assert_eq!(
            e,
            LaunchEnv {
                rank: 1,
                world: 2,
                local_rank: 1,
                master_addr: Some("10.0.0.1".into()),
                master_port: Some(29500),
                run_id: None,
            }
        );
        assert!(e.is_distributed());
        let mut with_local = OK.to_vec();
        with_local.push(("LOCAL_RANK", "0"));
        assert_eq!(env(&with_local).unwrap().local_rank, 0);
    }

    #[test]
    fn slurm_variables_are_the_fallback() {
        let e = env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29400"),
        ])
        .unwrap();
        assert_eq!((e.rank, e.world, e.local_rank), (3, 8, 1));
        // torchrun's variables win over SLURM's.
        let mut both = OK.to_vec();
        both.extend([("SLURM_PROCID", "5"), ("SLURM_NTASKS", "8")]);
        assert_eq!((env(&both).unwrap().rank, env(&both).unwrap().world), (1, 2));
        // SLURM's world size without a rendezvous address says where it came from.
        assert_eq!(
            env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")]).unwrap_err().to_string(),
            "MASTER_ADDR is not set but SLURM_NTASKS=4 asks for a distributed run; set MASTER_ADDR to the address of \
             the rank-0 host, reachable from every rank"
        );
    }

    #[test]
    fn bad_environments_name_the_variable_and_the_fix() {
        assert_eq!(
            err(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")]),
            "RANK=2 is not below WORLD_SIZE=2; ranks run from 0 to 1, one per process"
        );
        assert_eq!(
            err(&[("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")]),
            "RANK is not set but WORLD_SIZE=2 asks for a distributed run; set RANK to this process's rank, from 0 to WORLD_SIZE - 1 (torchrun \
             and weightferry launch set it)"
        );
        assert_eq!(
            err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")]),
            "MASTER_ADDR is not set but WORLD_SIZE=2 asks for a distributed run; set MASTER_ADDR to the address of the rank-0 host, reachable \
             from every rank"
        );
        assert_eq!(
            err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]),
            "MASTER_PORT is not set but WORLD_SIZE=2 asks for a distributed run; set MASTER_PORT to a free TCP port on the rank-0 host, the same \
             on every rank"
        );
        for port in ["70000", "0", "http", "-1"] {
            assert_eq!(
                err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", port)]),
                format!(
                    "MASTER_PORT={port:?} is not a TCP port; use a free port in 1..=65535 (the same on every rank)"
                )
            );
        }
        assert_eq!(
            err(&[("WORLD_SIZE", "two")]),
            "WORLD_SIZE=\"two\" is not a positive integer; set WORLD_SIZE to the number of processes (one per GPU)"
        );
        assert_eq!(
            err(&[("WORLD_SIZE", "0")]),
            "WORLD_SIZE=0: a run needs at least one process; set WORLD_SIZE to the number of processes (one per GPU)"
        );
        assert_eq!(
            err(&[("RANK", "-1"), ("WORLD_SIZE", "2")]),
            "RANK=\"-1\" is not a rank (an integer from 0); set RANK to this process's rank, from 0 to WORLD_SIZE - 1 \
             (torchrun and weightferry launch set it)"
        );
        assert_eq!(
            err(&[("SLURM_PROCID", "4"), ("SLURM_NTASKS", "4")]),
            "SLURM_PROCID=4 is not below WORLD_SIZE=4; ranks run from 0 to 3, one per process"
        );
        let mut bad_local = OK.to_vec();
        bad_local.push(("LOCAL_RANK", "x"));
        assert_eq!(
            err(&bad_local),
            "LOCAL_RANK=\"x\" is not a local rank (an integer from 0); set LOCAL_RANK to this process's rank on its \
             node (its GPU index), or unset it"
        );
    }

    #[test]
    fn a_huge_world_or_a_master_addr_with_a_port_is_an_exact_error() {
        assert_eq!(
            err(&[("WORLD_SIZE", "4000000000")]),
            "WORLD_SIZE=4000000000 is more ranks than a weightferry run supports (at most 16384: rank 0's rendezvous \
             holds one connection per rank); set WORLD_SIZE to the number of processes (one per GPU)"
        );
        assert_eq!(
            env(&[("WORLD_SIZE", "16384"), ("RANK", "1"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")]).unwrap().world,
            16384
        );
        let with_addr =
            |a: &'static str| [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", a), ("MASTER_PORT", "29500")];
        assert_eq!(
            err(&with_addr("127.0.0.1:5")),
            "MASTER_ADDR=\"127.0.0.1:5\" is not a host name or IP address (it has a ':', but a port belongs in \
             MASTER_PORT); set MASTER_ADDR to the rank-0 host alone (e.g. 10.0.0.1, node0 or ::1) and its port in \
             MASTER_PORT"
        );
        for ok in ["::1", "[::1]", "node0.cluster", "10.0.0.1"] {
            assert_eq!(env(&with_addr(ok)).unwrap().master_addr.as_deref(), Some(ok));
        }
    }

    #[test]
    fn the_run_id_comes_from_the_launcher() {
        let mut vars = OK.to_vec();
        assert_eq!(env(&vars).unwrap().run_id, None);
        vars.extend([("SLURM_JOB_ID", "77"), ("SLURM_STEP_ID", "2")]);
        assert_eq!(env(&vars).unwrap().run_id.as_deref(), Some("slurm-77.2"));
        vars.push(("TORCHELASTIC_RUN_ID", "job-x"));
        assert_eq!(env(&vars).unwrap().run_id.as_deref(), Some("job-x"));
        vars.push(("WEIGHTFERRY_RUN_ID", "launch-1"));
        assert_eq!(env(&vars).unwrap().run_id.as_deref(), Some("launch-1"));
    }

    #[test]
    fn every_variable_read_is_listed_in_vars() {
        // A torchrun-style and a SLURM-style environment between them make the reader ask for every variable.
        let torchrun = [("WORLD_SIZE", "2"), ("RANK", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
        let slurm = [
            ("SLURM_NTASKS", "2"),
            ("SLURM_PROCID", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("SLURM_JOB_ID", "7"),
        ];
        let mut asked = std::collections::BTreeSet::new();
        for set in [&torchrun[..], &slurm[..]] {
            let seen = std::cell::RefCell::new(Vec::new());
            let env = LaunchEnv::from_vars(|n| {
                seen.borrow_mut().push(n.to_string());
                set.iter().find(|(k, _)| *k == n).map(|(_, v)| v.to_string())
            });
            assert_eq!(env.map(|e| (e.rank, e.world)), Ok((1, 2)));
            asked.extend(seen.into_inner());
        }
        let listed: std::collections::BTreeSet<String> = LaunchEnv::VARS.iter().map(|v| v.to_string()).collect();
        assert_eq!(asked, listed);
    }
}
