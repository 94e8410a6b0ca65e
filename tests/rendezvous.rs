//! The TCP rendezvous of multi-process runs, with ranks as threads of this process on the loopback interface:
//! broadcast (the 128-byte NCCL unique id), all-gather of bytes of different lengths, barrier, joining through
//! `LaunchEnv`; and every failure as an exact error: mismatched world sizes, a duplicate rank, ranks out of step,
//! a peer that leaves, nobody listening, another protocol on the port, a broadcast without its root payload, and
//! the rendezvous staying broken after a failure; and rank 0 dropping strangers on its port (silent, garbage,
//! partial or non-hello frames, a hello of another protocol version) without delaying the join; with a run id, a
//! hello of this run that cannot join (another world size, a rank outside the group, a rank taken) fails it, a hello
//! of another run naming a rank does not take its place; without a run id, a hello of another world size,
//! fingerprint or a rank outside the group is refused at once while the real ranks join, a second claim on a rank is
//! refused to the newcomer, a claimant that hung up gives its rank up, and rank 0's timeout counts the
//! hellos it refused; a world size over the limit and an address that is not `host:port` are exact errors at once;
//! rank 0 listens on loopback when `MASTER_ADDR` is loopback.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};
use weightferry::dist::rendezvous::VERSION;
use weightferry::dist::{Fingerprint, LaunchEnv, Rendezvous, RendezvousError, RendezvousOptions, RunId};

fn opts(ms: u64) -> RendezvousOptions {
    RendezvousOptions { timeout: Duration::from_millis(ms), ..RendezvousOptions::default() }
}

/// Starts `world` ranks (rank 0 on a fresh loopback port) and runs `f` on each; results indexed by rank.
fn group<T: Send>(
    world: usize,
    worlds: &[usize],
    f: impl Fn(Rendezvous) -> T + Sync,
) -> Vec<Result<T, RendezvousError>> {
    group_with(world, worlds, opts(5000), f)
}

/// [`group`] with `options` on every rank.
fn group_with<T: Send>(
    world: usize,
    worlds: &[usize],
    options: RendezvousOptions,
    f: impl Fn(Rendezvous) -> T + Sync,
) -> Vec<Result<T, RendezvousError>> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let mut listener = Some(listener);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let (addr, f, l) = (addr.clone(), &f, if rank == 0 { listener.take() } else { None });
                let w = worlds.get(rank).copied().unwrap_or(world);
                s.spawn(move || {
                    let rdv = match l {
                        Some(l) => Rendezvous::root(l, w, options),
                        None => Rendezvous::peer(&addr, rank, w, options),
                    }?;
                    Ok(f(rdv))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn broadcast_all_gather_and_barrier_across_three_ranks() {
    let results = group(3, &[], |rdv| {
        let id: Vec<u8> = (0..128u8).map(|i| i.wrapping_mul(7) ^ 0x5A).collect();
        let got = rdv.broadcast(if rdv.rank() == 0 { Some(&id) } else { None }).unwrap();
        assert_eq!(got, id, "rank {}", rdv.rank());
        let mine = vec![rdv.rank() as u8 + 1; rdv.rank() * 3];
        let all = rdv.all_gather_bytes(&mine).unwrap();
        rdv.barrier().unwrap();
        let again = rdv.all_gather_bytes(&[rdv.rank() as u8]).unwrap();
        (rdv.rank(), rdv.world(), all, again)
    });
    for (r, res) in results.into_iter().enumerate() {
        let (rank, world, all, again) = res.unwrap();
        assert_eq!((rank, world), (r, 3));
        assert_eq!(all, vec![vec![], vec![2, 2, 2], vec![3, 3, 3, 3, 3, 3]]);
        assert_eq!(again, vec![vec![0], vec![1], vec![2]]);
    }
}

#[test]
fn a_single_rank_needs_no_network() {
    let rdv = Rendezvous::connect(&LaunchEnv::single(), opts(100)).unwrap();
    assert_eq!(rdv.broadcast(Some(b"id")).unwrap(), b"id");
    assert_eq!(rdv.all_gather_bytes(b"x").unwrap(), vec![b"x".to_vec()]);
    rdv.barrier().unwrap();
}

#[test]
fn ranks_join_through_the_launch_environment() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let results: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                s.spawn(move || {
                    let env = LaunchEnv {
                        rank,
                        world: 2,
                        local_rank: rank,
                        master_addr: Some("127.0.0.1".into()),
                        master_port: Some(port),
                        run_id: Some("run-a".into()),
                    };
                    let rdv = Rendezvous::connect(&env, opts(5000)).unwrap();
                    rdv.all_gather_bytes(&[rank as u8]).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results, vec![vec![vec![0], vec![1]]; 2]);
}

/// With a run id, a rank of another world size is a misconfigured launch: both sides fail at once.
#[test]
fn a_mismatched_world_size_fails_both_sides() {
    let t = Instant::now();
    let results = group_with(2, &[2, 3], run_opts(5000, "run-a"), |_| ());
    assert!(t.elapsed() < Duration::from_secs(3), "took {:?}", t.elapsed());
    assert_eq!(
        results[0].as_ref().unwrap_err().to_string(),
        "rank 1 has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2; launch every rank with the same WORLD_SIZE"
    );
    assert_eq!(
        results[1].as_ref().unwrap_err().to_string(),
        "rank 0 ended the rendezvous: rank 1 has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2; launch every rank with \
         the same WORLD_SIZE"
    );
}

/// With a run id, two processes of the run claiming one rank fail the rendezvous at once, naming both addresses.
#[test]
fn a_duplicate_rank_is_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let o = run_opts(5000, "run-a");
    let t = Instant::now();
    let (root, a, b) = std::thread::scope(|s| {
        let root = s.spawn(move || Rendezvous::root(listener, 3, o).map(|_| ()));
        let a = s.spawn(|| Rendezvous::peer(&addr, 1, 3, o).map(|_| ()));
        let b = s.spawn(|| Rendezvous::peer(&addr, 1, 3, o).map(|_| ()));
        (root.join().unwrap(), a.join().unwrap(), b.join().unwrap())
    });
    assert!(t.elapsed() < Duration::from_secs(3), "took {:?}", t.elapsed());
    let e = root.unwrap_err();
    assert!(matches!(e, RendezvousError::DuplicateRank { rank: 1, .. }), "{e:?}");
    let text = e.to_string();
    assert!(text.starts_with("two processes claim rank 1 (it joined from 127.0.0.1:"), "{text}");
    assert!(
        text.ends_with(
            " claimed it); give every process its own RANK, and every rank of one run the same WEIGHTFERRY_RUN_ID so \
             that rank 0 can tell strangers from its ranks"
        ),
        "{text}"
    );
    for r in [a, b] {
        assert_eq!(r.unwrap_err().to_string(), format!("rank 0 ended the rendezvous: {text}"));
    }
}

#[test]
fn ranks_out_of_step_are_named() {
    let results = group(2, &[], |rdv| {
        if rdv.rank() == 0 {
            rdv.broadcast(Some(b"x")).map(|_| ())
        } else {
            rdv.all_gather_bytes(b"y").map(|_| ())
        }
    });
    let e1 = results[1].as_ref().unwrap().as_ref().unwrap_err().to_string();
    assert_eq!(
        e1,
        "operation #0 (all_gather): rank 0 sent operation #0 (broadcast); every rank must call the same rendezvous \
         operations in the same order"
    );
}

#[test]
fn a_peer_that_leaves_fails_the_others_at_once_and_breaks_the_rendezvous() {
    let t = Instant::now();
    let results = group(3, &[], |rdv| {
        if rdv.rank() == 2 {
            drop(rdv);
            return (Ok(()), Ok(()));
        }
        let first = rdv.all_gather_bytes(b"z").map(|_| ());
        let second = rdv.barrier();
        (first, second)
    });
    assert!(t.elapsed() < Duration::from_secs(3), "took {:?}", t.elapsed());
    let (first0, second0) = results[0].as_ref().unwrap();
    assert_eq!(
        first0.as_ref().unwrap_err().to_string(),
        "rank 0: operation #0 (all_gather) with rank 2 failed: it closed the connection (the process exited or failed)"
    );
    assert!(matches!(second0, Err(RendezvousError::Broken(_))), "{second0:?}");
    // Rank 1 hears why from rank 0.
    let (first1, _) = results[1].as_ref().unwrap();
    assert_eq!(
        first1.as_ref().unwrap_err().to_string(),
        "rank 0 ended the rendezvous: rank 0: operation #0 (all_gather) with rank 2 failed: it closed the connection \
         (the process exited or failed)"
    );
}

#[test]
fn nobody_listening_is_a_connect_error_after_the_timeout() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let t = Instant::now();
    let e = Rendezvous::peer(&format!("127.0.0.1:{port}"), 1, 2, opts(300)).unwrap_err();
    assert!(t.elapsed() >= Duration::from_millis(300) && t.elapsed() < Duration::from_secs(3));
    let text = e.to_string();
    assert!(text.starts_with(&format!("rank 1 cannot reach rank 0 at 127.0.0.1:{port} within ")), "{text}");
    assert!(
        text.ends_with(
            "start rank 0 and check MASTER_ADDR and MASTER_PORT (rank 0's host must be reachable from every rank)"
        ),
        "{text}"
    );
    // Rank 0 waiting for ranks that never come.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    match Rendezvous::root(listener, 3, opts(200)) {
        Err(RendezvousError::Incomplete { world: 3, missing, .. }) => assert_eq!(missing, vec![1, 2]),
        other => panic!("expected Incomplete, got {other:?}"),
    }
}

/// A raw rendezvous frame header (`"WFRV"`, `version`, `kind`, rank, seq 0, payload length) and its payload.
fn frame(version: u16, kind: u8, rank: u32, payload: &[u8]) -> Vec<u8> {
    let mut b = b"WFRV".to_vec();
    b.extend_from_slice(&version.to_le_bytes());
    b.extend_from_slice(&[kind, 0]);
    b.extend_from_slice(&rank.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    b.extend_from_slice(payload);
    b
}

/// Waits (at most 5 s) until rank 0 closes `s`, i.e. dropped it; false if `s` stays open.
fn closed_by_rank0(mut s: TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}

/// Rank 0 with a 200 ms handshake and a long rendezvous timeout, strangers connected before the real ranks:
/// the ranks join at once, broadcast works, and every stranger is dropped.
#[test]
fn strangers_on_the_port_neither_delay_nor_break_the_join() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let long = opts(30_000);
    let t = Instant::now();
    let root = std::thread::spawn(move || {
        let rdv = Rendezvous::root_with_handshake(listener, 3, long, Duration::from_millis(200))?;
        rdv.broadcast(Some(b"nccl-id"))
    });
    // Silent (a port scanner, a health check), garbage (HTTP), a partial hello, a weightferry frame that is no
    // hello: all connected before any real rank, all kept open.
    let silent = TcpStream::connect(addr).unwrap();
    let mut http = TcpStream::connect(addr).unwrap();
    http.write_all(b"GET / HTTP/1.1\r\nHost: example.org\r\n\r\n").unwrap();
    let mut partial = TcpStream::connect(addr).unwrap();
    partial.write_all(&hello(1, 3, 0, 0)[..10]).unwrap();
    let mut not_hello = TcpStream::connect(addr).unwrap();
    not_hello.write_all(&frame(VERSION, 4, 1, b"x")).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let peers: Vec<_> = (1..3)
        .map(|rank| {
            let addr = addr.to_string();
            std::thread::spawn(move || Rendezvous::peer(&addr, rank, 3, long)?.broadcast(None))
        })
        .collect();
    assert_eq!(root.join().unwrap().unwrap(), b"nccl-id");
    for p in peers {
        assert_eq!(p.join().unwrap().unwrap(), b"nccl-id");
    }
    assert!(t.elapsed() < Duration::from_secs(5), "the join took {:?}", t.elapsed());
    for (name, s) in [("silent", silent), ("http", http), ("partial", partial), ("not a hello", not_hello)] {
        assert!(closed_by_rank0(s), "rank 0 kept the {name} connection open");
    }
}

/// Rank 0's default handshake deadline is 5 s, or the rendezvous timeout when shorter.
#[test]
fn the_handshake_deadline_is_five_seconds_at_most() {
    assert_eq!(RendezvousOptions::default().handshake_timeout(), Duration::from_secs(5));
    assert_eq!(opts(300).handshake_timeout(), Duration::from_millis(300));
}

/// A silent connection through `root` (default handshake deadline) does not hold up the ranks either.
#[test]
fn a_silent_connection_does_not_hold_up_root() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let t = Instant::now();
    let root = std::thread::spawn(move || Rendezvous::root(listener, 2, opts(30_000))?.barrier());
    let _silent = TcpStream::connect(addr).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let peer = Rendezvous::peer(&addr.to_string(), 1, 2, opts(30_000)).unwrap();
    peer.barrier().unwrap();
    root.join().unwrap().unwrap();
    assert!(t.elapsed() < Duration::from_secs(4), "the join took {:?}", t.elapsed());
}

/// A raw hello of this protocol version: rank, world size, run id and fingerprint.
fn hello(rank: u32, world: u64, run: u128, fingerprint: u128) -> Vec<u8> {
    let mut payload = world.to_le_bytes().to_vec();
    payload.extend_from_slice(&run.to_le_bytes());
    payload.extend_from_slice(&fingerprint.to_le_bytes());
    frame(VERSION, 1, rank, &payload)
}

/// The next frame rank 0 sends on `s` (within 5 s): its kind, its flags and its payload as text.
fn reply(s: &mut TcpStream) -> (u8, u8, String) {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut h = [0u8; 28];
    s.read_exact(&mut h).unwrap();
    let mut payload = vec![0u8; u64::from_le_bytes(h[20..28].try_into().unwrap()) as usize];
    s.read_exact(&mut payload).unwrap();
    (h[6], h[7], String::from_utf8(payload).unwrap())
}

const REFUSE: u8 = 3;
const WELCOME: u8 = 2;
/// The flags of a `REFUSE` of this connection's hello.
const HELLO_REFUSED: u8 = 1;

/// A hello of another protocol version (an older weightferry, or another job's) is refused, told why, and dropped;
/// the real rank joins at once.
#[test]
fn a_hello_of_another_protocol_version_is_refused_and_dropped() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let t = Instant::now();
    let root = std::thread::spawn(move || Rendezvous::root(listener, 2, opts(30_000))?.barrier());
    let mut old = TcpStream::connect(addr).unwrap();
    // Version 2 (before the fingerprint) is another protocol version.
    let mut v2 = 2u64.to_le_bytes().to_vec();
    v2.extend_from_slice(&0u128.to_le_bytes());
    old.write_all(&frame(2, 1, 1, &v2)).unwrap();
    let (kind, flags, reason) = reply(&mut old);
    assert_eq!((kind, flags), (REFUSE, HELLO_REFUSED));
    assert_eq!(
        reason,
        format!(
            "{} sent magic 0x56524657 version 2, not a weightferry rendezvous v3 frame; is MASTER_PORT used by another \
             program, or do the ranks run different weightferry versions?",
            old.local_addr().unwrap()
        )
    );
    assert!(closed_by_rank0(old), "rank 0 kept the connection of another version open");
    Rendezvous::peer(&addr.to_string(), 1, 2, opts(30_000)).unwrap().barrier().unwrap();
    root.join().unwrap().unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "the join took {:?}", t.elapsed());
}

/// With a run id, a hello of the run with a rank outside the group fails the rendezvous with the exact error.
#[test]
fn a_rank_outside_the_group_is_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let o = run_opts(5000, "run-a");
    let (root, peer) = std::thread::scope(|s| {
        let root = s.spawn(move || Rendezvous::root(listener, 3, o).map(|_| ()));
        let peer = s.spawn(|| Rendezvous::peer(&addr, 5, 3, o).map(|_| ()));
        (root.join().unwrap(), peer.join().unwrap())
    });
    let expected = "a hello as rank 5, which is not one of the ranks 1..3 that join rank 0 in a run of WORLD_SIZE=3; \
                    give every process its own RANK below WORLD_SIZE";
    assert_eq!(root.unwrap_err().to_string(), expected);
    assert_eq!(peer.unwrap_err().to_string(), format!("rank 0 ended the rendezvous: {expected}"));
}

/// A rank whose `MASTER_PORT` is another program's (here an HTTP server) names it.
#[test]
fn another_protocol_on_the_port_is_named() {
    let server = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr().unwrap();
    let http = std::thread::spawn(move || {
        let (mut s, _) = server.accept().unwrap();
        s.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n").unwrap();
        // Keep the connection open until the rank has read the reply.
        std::thread::sleep(Duration::from_millis(500));
    });
    let e = Rendezvous::peer(&addr.to_string(), 1, 2, opts(3000)).unwrap_err();
    http.join().unwrap();
    assert!(matches!(e, RendezvousError::Protocol { magic: 0x5054_5448, .. }), "{e:?}");
    assert!(
        e.to_string().starts_with(&format!("{addr} sent magic 0x50545448 version 12591, not a weightferry")),
        "{e}"
    );
    assert!(e.to_string().contains("is MASTER_PORT used by another program"), "{e}");
}

#[test]
fn broadcast_takes_the_payload_on_rank_zero_only() {
    let results = group(2, &[], |rdv| {
        let wrong = if rdv.rank() == 0 { rdv.broadcast(None) } else { rdv.broadcast(Some(b"no")) };
        wrong.unwrap_err().to_string()
    });
    assert_eq!(
        results[0].as_ref().unwrap(),
        "rank 0: broadcast takes the payload on rank 0 (the root) and `None` on every other rank"
    );
    assert_eq!(
        results[1].as_ref().unwrap(),
        "rank 1: broadcast takes the payload on rank 0 (the root) and `None` on every other rank"
    );
}

fn run_opts(ms: u64, run: &str) -> RendezvousOptions {
    RendezvousOptions { timeout: Duration::from_millis(ms), run: RunId::from_name(run), ..RendezvousOptions::default() }
}

/// A hello of this protocol naming rank 1 but of another run (or of no run) arrives first and stays open: it does
/// not take rank 1's place; the real rank 1 joins at once, and a weightferry rank of the other run is told why.
#[test]
fn a_strangers_hello_naming_a_rank_does_not_block_the_real_rank() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let t = Instant::now();
    let root = std::thread::spawn(move || Rendezvous::root(listener, 2, run_opts(30_000, "run-a"))?.barrier());
    let mut no_run = TcpStream::connect(addr).unwrap();
    no_run.write_all(&hello(1, 2, 0, 0)).unwrap();
    let other = Rendezvous::peer(&addr.to_string(), 1, 2, run_opts(30_000, "run-b")).unwrap_err();
    let (a, b) = (RunId::from_name("run-a"), RunId::from_name("run-b"));
    assert_eq!(
        other.to_string(),
        format!(
            "rank 0 refused the hello of this rank 1: MASTER_PORT belongs to another run (run id {a}), this rank 1 \
             has run id {b}; give every rank of one run the same WEIGHTFERRY_RUN_ID, or use another MASTER_PORT"
        )
    );
    let real = Rendezvous::peer(&addr.to_string(), 1, 2, run_opts(30_000, "run-a")).unwrap();
    real.barrier().unwrap();
    root.join().unwrap().unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "the join took {:?}", t.elapsed());
    assert!(closed_by_rank0(no_run), "rank 0 kept the hello of no run open");
}

fn fp_opts(ms: u64, fingerprint: &[u8]) -> RendezvousOptions {
    RendezvousOptions {
        timeout: Duration::from_millis(ms),
        fingerprint: Fingerprint::of(fingerprint),
        ..RendezvousOptions::default()
    }
}

/// Without a run id: strangers' hellos naming rank 1 arrive first and stay open — one of another fingerprint, one
/// of another world size, one naming a rank outside the group. Each is refused at once with the exact reason and
/// dropped; the real rank 1 joins at once and the rendezvous works (rank 0 neither waits for the timeout nor fails).
#[test]
fn without_a_run_id_strangers_hellos_are_refused_and_the_real_rank_joins_at_once() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let ours = fp_opts(30_000, b"job-a");
    let t = Instant::now();
    let root = std::thread::spawn(move || Rendezvous::root(listener, 2, ours)?.broadcast(Some(b"id")));
    let (a, b) = (Fingerprint::of(b"job-a"), Fingerprint::of(b"job-b"));
    let cases = [
        (
            hello(1, 2, 0, b.0),
            format!(
                "rank 1 has fingerprint {b} but rank 0 has {a} (they run different things), and without a run id \
                 rank 0 takes it for a stranger; launch every rank with the same arguments and files, and every rank \
                 of one run with the same WEIGHTFERRY_RUN_ID"
            ),
        ),
        (
            hello(1, 4, 0, a.0),
            "rank 1 has WORLD_SIZE=4 but rank 0 has WORLD_SIZE=2; launch every rank with the same WORLD_SIZE".into(),
        ),
        (
            hello(7, 2, 0, a.0),
            "a hello as rank 7, which is not one of the ranks 1..2 that join rank 0 in a run of WORLD_SIZE=2; give \
             every process its own RANK below WORLD_SIZE"
                .into(),
        ),
    ];
    let mut strangers = Vec::new();
    for (bytes, expected) in cases {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&bytes).unwrap();
        assert_eq!(reply(&mut s), (REFUSE, HELLO_REFUSED, expected));
        strangers.push(s);
    }
    let real = Rendezvous::peer(&addr.to_string(), 1, 2, ours).unwrap();
    assert_eq!(real.broadcast(None).unwrap(), b"id");
    assert_eq!(root.join().unwrap().unwrap(), b"id");
    assert!(t.elapsed() < Duration::from_secs(5), "the join took {:?}", t.elapsed());
    for s in strangers {
        assert!(closed_by_rank0(s), "rank 0 kept a refused stranger open");
    }
}

/// Without a run id, a peer of another world size is refused at once with the exact reason; rank 0 keeps waiting,
/// and its timeout counts the hello it refused and quotes why.
#[test]
fn without_a_run_id_a_mismatched_world_size_is_refused_and_rank_0_says_so_at_its_timeout() {
    let t = Instant::now();
    let results = group_with(2, &[2, 3], opts(600), |_| ());
    let why = "rank 1 has WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2; launch every rank with the same WORLD_SIZE";
    let refused = results[1].as_ref().unwrap_err();
    assert_eq!(refused, &RendezvousError::HelloRefused { rank: 1, reason: why.into() });
    assert_eq!(refused.to_string(), format!("rank 0 refused the hello of this rank 1: {why}"));
    let e = results[0].as_ref().unwrap_err();
    assert!(matches!(e, RendezvousError::Incomplete { refused: 1, .. }), "{e:?}");
    let text = e.to_string();
    assert!(text.starts_with("rank 0: ranks 1 did not join within "), "{text}");
    assert!(
        text.ends_with(&format!(
            "; start all WORLD_SIZE=2 ranks with the same MASTER_ADDR and MASTER_PORT (rank 0 refused 1 hello: {why})"
        )),
        "{text}"
    );
    assert!(t.elapsed() < Duration::from_secs(3), "took {:?}", t.elapsed());
}

/// Without a run id, a stranger identical to a rank (same world size and fingerprint) that claims rank 1 first and
/// stays connected keeps it (the documented limit): the real rank 1 is refused at once with the exact reason, the
/// others still join, and the stranger is welcomed.
#[test]
fn without_a_run_id_a_second_claim_on_a_joined_rank_is_refused_to_the_newcomer() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let ours = fp_opts(30_000, b"job-a");
    let t = Instant::now();
    let root = std::thread::spawn(move || Rendezvous::root(listener, 3, ours).map(|r| r.world()));
    let mut stranger = TcpStream::connect(addr).unwrap();
    stranger.write_all(&hello(1, 3, 0, Fingerprint::of(b"job-a").0)).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let e = Rendezvous::peer(&addr.to_string(), 1, 3, ours).unwrap_err().to_string();
    let first = stranger.local_addr().unwrap();
    let head =
        format!("rank 0 refused the hello of this rank 1: two processes claim rank 1 (it joined from {first}, then");
    assert!(e.starts_with(&format!("{head} 127.0.0.1:")), "{e}");
    assert!(
        e.ends_with(
            " claimed it); give every process its own RANK, and every rank of one run the same WEIGHTFERRY_RUN_ID so \
             that rank 0 can tell strangers from its ranks"
        ),
        "{e}"
    );
    let rank2 = Rendezvous::peer(&addr.to_string(), 2, 3, ours).unwrap();
    assert_eq!(root.join().unwrap().unwrap(), 3);
    assert_eq!(reply(&mut stranger), (WELCOME, 0, String::new()));
    drop(rank2);
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
}

/// A claimant that hangs up gives its rank up: a stranger's hello as rank 1 that closes does not keep the real
/// rank 1 out, whether the real rank 1 arrives before rank 2 (it takes the closed claimant's place) or after it
/// (the join does not complete with a closed connection).
#[test]
fn a_claimant_that_hung_up_gives_its_rank_up() {
    for first in [1usize, 2] {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let t = Instant::now();
        let root = std::thread::spawn(move || Rendezvous::root(listener, 3, opts(30_000))?.all_gather_bytes(b"0"));
        let mut gone = TcpStream::connect(addr).unwrap();
        gone.write_all(&hello(1, 3, 0, 0)).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        drop(gone);
        std::thread::sleep(Duration::from_millis(100));
        let peers: Vec<_> = [first, 3 - first]
            .into_iter()
            .map(|rank| {
                let addr = addr.to_string();
                let peer = std::thread::spawn(move || {
                    Rendezvous::peer(&addr, rank, 3, opts(30_000))?.all_gather_bytes(&[b'0' + rank as u8])
                });
                std::thread::sleep(Duration::from_millis(100));
                peer
            })
            .collect();
        let expected = vec![b"0".to_vec(), b"1".to_vec(), b"2".to_vec()];
        assert_eq!(root.join().unwrap().unwrap(), expected, "rank {first} first");
        for p in peers {
            assert_eq!(p.join().unwrap().unwrap(), expected, "rank {first} first");
        }
        assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    }
}

/// A world size past `MAX_WORLD` is an exact error at once, on rank 0 and on the others, before anything is
/// allocated for it.
#[test]
fn a_huge_world_size_is_an_exact_error_at_once() {
    let t = Instant::now();
    for world in [4_000_000_000usize, 100_000_000, 16_385, 0] {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let expected = format!(
            "a rendezvous of {world} ranks: the world size must be in 1..=16384 (rank 0 holds one connection per \
             rank); set WORLD_SIZE to the number of processes (one per GPU)"
        );
        assert_eq!(Rendezvous::root(listener, world, opts(60_000)).unwrap_err().to_string(), expected);
        assert_eq!(Rendezvous::peer("127.0.0.1:1", 1, world, opts(60_000)).unwrap_err().to_string(), expected);
    }
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
}

/// Missing ranks are listed as ranges, so the message stays one short line for any world size.
#[test]
fn missing_ranks_are_listed_as_ranges() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let e = Rendezvous::root(listener, 16_384, opts(200)).unwrap_err().to_string();
    assert!(e.starts_with("rank 0: ranks 1-16383 did not join within "), "{e}");
    assert!(e.ends_with(" start all WORLD_SIZE=16384 ranks with the same MASTER_ADDR and MASTER_PORT"), "{e}");
    assert_eq!(weightferry::dist::rendezvous::rank_ranges(&[1, 2, 3, 5, 7, 8]), "1-3, 5, 7-8");
}

/// An address that is not `host:port` (e.g. `MASTER_ADDR=127.0.0.1:5` made `127.0.0.1:5:29500`) is reported at
/// once, not after the 60 s of retries.
#[test]
fn an_address_that_is_not_host_port_is_reported_at_once() {
    let t = Instant::now();
    let e = Rendezvous::peer("127.0.0.1:5:29500", 1, 2, opts(60_000)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "rank 1: \"127.0.0.1:5:29500\" is not a host:port address of rank 0 (the host \"127.0.0.1:5\" has a ':' (a \
         port belongs in MASTER_PORT)); set MASTER_ADDR to the rank-0 host alone (e.g. 10.0.0.1, node0 or ::1) and \
         MASTER_PORT to its port"
    );
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
}

/// The port's listening socket in `/proc/net/tcp` (`"0100007F"` is 127.0.0.1, `"00000000"` all interfaces).
fn listening_address(port: u16) -> Option<String> {
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    table.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let (ip, p) = f.get(1)?.split_once(':')?;
        (u16::from_str_radix(p, 16).ok()? == port && f.get(3) == Some(&"0A")).then(|| ip.to_string())
    })
}

/// With `MASTER_ADDR=127.0.0.1` (as `weightferry launch` sets it) rank 0 listens on loopback only; with another
/// host, on all interfaces.
#[cfg(target_os = "linux")]
#[test]
fn rank_0_listens_on_loopback_when_master_addr_is_loopback() {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    use weightferry::dist::rendezvous::listen_ip;
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let env = move |rank| LaunchEnv {
        rank,
        world: 2,
        local_rank: rank,
        master_addr: Some("127.0.0.1".into()),
        master_port: Some(port),
        run_id: None,
    };
    let root = std::thread::spawn(move || Rendezvous::connect(&env(0), opts(10_000))?.barrier());
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut seen = None;
    while seen.is_none() && Instant::now() < deadline {
        seen = listening_address(port);
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(seen.as_deref(), Some("0100007F"), "rank 0's listening address on port {port}");
    Rendezvous::connect(&env(1), opts(10_000)).unwrap().barrier().unwrap();
    root.join().unwrap().unwrap();
    assert_eq!(listen_ip("127.0.0.1"), IpAddr::V4(Ipv4Addr::LOCALHOST));
    assert_eq!(listen_ip("localhost"), IpAddr::V4(Ipv4Addr::LOCALHOST));
    assert_eq!(listen_ip("::1"), IpAddr::V6(Ipv6Addr::LOCALHOST));
    assert_eq!(listen_ip("10.0.0.1"), IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    assert_eq!(listen_ip("node0"), IpAddr::V4(Ipv4Addr::UNSPECIFIED));
}
