//! Joining a rendezvous: the constructors of [`Rendezvous`] (from the launch environment, as rank 0, as another
//! rank) and a rank's join of rank 0 (connect with retries, hello, welcome).

use super::accept::accept_all;
use super::error::RendezvousError;
use super::identity::RunId;
use super::ops::{Rendezvous, State};
use super::options::RendezvousOptions;
use super::wire::{
    io_reason, kind_name, read_frame, timed_out, write_frame, FrameError, HEADER, HELLO, HELLO_LEN, HELLO_REFUSED,
    MAX_WORLD, REFUSE, WELCOME,
};
use crate::dist::env::LaunchEnv;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;

fn runtime() -> Result<Runtime, RendezvousError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|e| RendezvousError::Runtime(e.to_string()))
}

fn check_world(world: usize) -> Result<(), RendezvousError> {
    if world == 0 || world > MAX_WORLD {
        return Err(RendezvousError::World { world });
    }
    Ok(())
}

/// The address rank 0 listens on for a run whose ranks reach it at `master_addr`: that loopback address when it
/// is one (`127.0.0.1`, `::1`, `localhost`: every rank is on this host, as under `weightferry launch`, so nothing
/// needs to reach it from outside), else all IPv4 interfaces (`0.0.0.0`), since the name may resolve to any of
/// this host's interfaces.
pub fn listen_ip(master_addr: &str) -> IpAddr {
    let host = master_addr.trim();
    if host.eq_ignore_ascii_case("localhost") {
        return IpAddr::V4(Ipv4Addr::LOCALHOST);
    }
    match host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
        Ok(ip) if ip.is_loopback() => ip,
        _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    }
}

/// `host:port`, with an IPv6 literal in brackets.
fn host_port(host: &str, port: u16) -> String {
    let host = host.trim();
    match host.parse::<Ipv6Addr>() {
        Ok(_) => format!("[{host}]:{port}"),
        Err(_) => format!("{host}:{port}"),
    }
}

/// Checks that `addr` is `host:port` (an IPv6 host in brackets); what is wrong otherwise.
fn check_host_port(addr: &str) -> Result<(), String> {
    if addr.parse::<SocketAddr>().is_ok() {
        return Ok(());
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err("no port".into());
    };
    if port.parse::<u16>().is_err() {
        return Err(format!("{port:?} is not a port"));
    }
    if host.is_empty() {
        return Err("no host".into());
    }
    if host.contains(':') {
        return Err(format!("the host {host:?} has a ':' (a port belongs in MASTER_PORT)"));
    }
    if host.chars().any(|c| c.is_whitespace() || c == '/') {
        return Err(format!("the host {host:?} is not a host name"));
    }
    Ok(())
}

impl Rendezvous {
    /// Joins the rendezvous `env` describes: rank 0 listens on `MASTER_PORT` (on [`listen_ip`] of `MASTER_ADDR`)
    /// and waits for every other rank; the others connect to `MASTER_ADDR:MASTER_PORT`. The run id is
    /// `options.run`, else the digest of [`LaunchEnv::run_id`]. A single process needs no connection.
    pub fn connect(env: &LaunchEnv, options: RendezvousOptions) -> Result<Rendezvous, RendezvousError> {
        if env.world <= 1 {
            return Ok(Self::single());
        }
        check_world(env.world)?;
        let mut options = options;
        if options.run == RunId::NONE {
            options.run = env.run_id.as_deref().map_or(RunId::NONE, RunId::from_name);
        }
        let port = env.master_port.unwrap_or(0);
        let host = env.master_addr.as_deref().unwrap_or("127.0.0.1");
        if env.rank == 0 {
            let listener = std::net::TcpListener::bind((listen_ip(host), port))
                .map_err(|e| RendezvousError::Listen { port, reason: e.to_string() })?;
            Self::root(listener, env.world, options)
        } else {
            Self::peer(&host_port(host, port), env.rank, env.world, options)
        }
    }

    /// A rendezvous of one rank (every operation returns at once).
    pub fn single() -> Rendezvous {
        Rendezvous {
            rank: 0,
            world: 1,
            timeout: Duration::ZERO,
            state: Mutex::new(State { streams: vec![None], seq: 0, broken: None }),
            rt: None,
        }
    }

    /// Rank 0 of `world` ranks, accepting on `listener` until every other rank joined; each accepted connection
    /// has [`RendezvousOptions::handshake_timeout`] to send its hello (see [`Rendezvous::root_with_handshake`]).
    pub fn root(
        listener: std::net::TcpListener,
        world: usize,
        options: RendezvousOptions,
    ) -> Result<Rendezvous, RendezvousError> {
        Self::root_with_handshake(listener, world, options, options.handshake_timeout())
    }

    /// Rank 0 of `world` ranks, accepting on `listener` until every other rank joined or `options.timeout` passed.
    ///
    /// Rank 0 keeps accepting while earlier connections are still handshaking, so no connection can hold up the others:
    /// each accepted connection has `handshake` (from its accept) to send a complete hello. Connections that are not
    /// joining ranks of this run are dropped with a `tracing` warning and the wait goes on: one that stays silent past
    /// `handshake`, closes, does not start with [`MAGIC`](super::MAGIC) (another program: a port scanner, a health
    /// check, HTTP), sends a weightferry frame that is not a hello, a hello of another protocol
    /// [`VERSION`](super::VERSION) or of another run ([`RendezvousOptions::run`]; both told why first). With a run id,
    /// a hello of this run that cannot join fails the whole rendezvous, as a misconfigured launch, with the exact error
    /// (rank 0 tells the offender and every joined rank why): another world size ([`RendezvousError::WorldMismatch`]),
    /// a rank outside `1..world` ([`RendezvousError::BadRank`]) or one that joined already
    /// ([`RendezvousError::DuplicateRank`]). Without a run id those hellos, and one with another
    /// [`RendezvousOptions::fingerprint`] ([`RendezvousError::FingerprintMismatch`]), are refused and dropped instead,
    /// and a rank claimed twice stays with the first claimant unless its connection closed (the [module docs](super)
    /// give the rule).
    pub fn root_with_handshake(
        listener: std::net::TcpListener,
        world: usize,
        options: RendezvousOptions,
        handshake: Duration,
    ) -> Result<Rendezvous, RendezvousError> {
        check_world(world)?;
        let rt = runtime()?;
        let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
        let listen_err = |e: std::io::Error| RendezvousError::Listen { port, reason: e.to_string() };
        listener.set_nonblocking(true).map_err(listen_err)?;
        let streams = rt.block_on(async {
            let listener = TcpListener::from_std(listener).map_err(listen_err)?;
            accept_all(listener, port, world, options, handshake).await
        })?;
        Ok(Rendezvous {
            rank: 0,
            world,
            timeout: options.timeout,
            state: Mutex::new(State { streams, seq: 0, broken: None }),
            rt: Some(rt),
        })
    }

    /// Rank `rank` (not 0) of `world` ranks, joining rank 0 at `addr` (`host:port`), retrying until the timeout.
    /// An `addr` that is not `host:port` is an error at once ([`RendezvousError::Address`]).
    pub fn peer(
        addr: &str,
        rank: usize,
        world: usize,
        options: RendezvousOptions,
    ) -> Result<Rendezvous, RendezvousError> {
        check_world(world)?;
        check_host_port(addr).map_err(|reason| RendezvousError::Address { rank, addr: addr.to_string(), reason })?;
        let rt = runtime()?;
        let s = rt.block_on(join_root(addr, rank, world, options))?;
        Ok(Rendezvous {
            rank,
            world,
            timeout: options.timeout,
            state: Mutex::new(State { streams: vec![Some(s)], seq: 0, broken: None }),
            rt: Some(rt),
        })
    }
}

/// A rank's join: connects to rank 0 at `addr` (retrying while it is not listening yet, until the timeout), sends
/// its hello and waits for the welcome.
async fn join_root(
    addr: &str,
    rank: usize,
    world: usize,
    options: RendezvousOptions,
) -> Result<TcpStream, RendezvousError> {
    let start = Instant::now();
    let deadline = start + options.timeout;
    let connect_err =
        |reason: String| RendezvousError::Connect { rank, addr: addr.to_string(), waited: start.elapsed(), reason };
    let mut backoff = Duration::from_millis(10);
    let mut s = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = tokio::time::timeout(left.min(Duration::from_secs(5)), async {
            let mut addrs = tokio::net::lookup_host(addr).await.map_err(|e| e.to_string())?;
            let a = addrs.next().ok_or_else(|| "the address resolves to nothing".to_string())?;
            TcpStream::connect(a).await.map_err(|e| e.to_string())
        })
        .await
        .unwrap_or_else(|_| Err("connecting timed out".to_string()));
        match attempt {
            Ok(s) => break s,
            Err(reason) if Instant::now() >= deadline => return Err(connect_err(reason)),
            Err(_) => {
                tokio::time::sleep(backoff.min(deadline.saturating_duration_since(Instant::now()))).await;
                backoff = (backoff * 2).min(Duration::from_millis(200));
            }
        }
    };
    let io = |e: std::io::Error| RendezvousError::Io { rank, peer: 0, op: "join", seq: 0, reason: io_reason(&e) };
    s.set_nodelay(true).map_err(io)?;
    let mut hello = Vec::with_capacity(HELLO_LEN - HEADER);
    hello.extend_from_slice(&(world as u64).to_le_bytes());
    hello.extend_from_slice(&options.run.0.to_le_bytes());
    hello.extend_from_slice(&options.fingerprint.0.to_le_bytes());
    tokio::time::timeout(options.timeout, write_frame(&mut s, HELLO, rank, 0, &hello))
        .await
        .unwrap_or_else(|_| Err(timed_out()))
        .map_err(io)?;
    let reply = tokio::time::timeout(options.timeout, read_frame(&mut s))
        .await
        .unwrap_or_else(|_| Err(FrameError::Io(timed_out())));
    match reply {
        Ok(f) if f.kind == WELCOME => Ok(s),
        Ok(f) if f.kind == REFUSE => {
            let reason = String::from_utf8_lossy(&f.payload).into_owned();
            Err(match f.flags {
                HELLO_REFUSED => RendezvousError::HelloRefused { rank, reason },
                _ => RendezvousError::Refused { reason },
            })
        }
        Ok(f) => Err(RendezvousError::OutOfStep { seq: 0, op: "join", peer: 0, got: kind_name(f.kind).into() }),
        Err(FrameError::Io(e)) => Err(io(e)),
        Err(FrameError::Protocol { magic, version }) => {
            Err(RendezvousError::Protocol { peer: addr.to_string(), magic, version })
        }
        Err(FrameError::TooLarge(len)) => Err(RendezvousError::TooLarge { len }),
    }
}
