//! The TCP rendezvous of multi-process runs, with ranks as threads of this process on the loopback interface:
//! broadcast (the 128-byte NCCL unique id), all-gather of bytes of different lengths, barrier, joining through
//! `LaunchEnv`; and every failure as an exact error: mismatched world sizes, a duplicate rank, ranks out of step,
//! a peer that leaves, nobody listening, another protocol on the port, a broadcast without its root payload, and
//! the rendezvous staying broken after a failure.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};
use weightferry::dist::{LaunchEnv, Rendezvous, RendezvousError, RendezvousOptions};

fn opts(ms: u64) -> RendezvousOptions {
    RendezvousOptions { timeout: Duration::from_millis(ms) }
}

/// Starts `world` ranks (rank 0 on a fresh loopback port) and runs `f` on each; results indexed by rank.
fn group<T: Send>(
    world: usize,
    worlds: &[usize],
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
                        Some(l) => Rendezvous::root(l, w, opts(5000)),
                        None => Rendezvous::peer(&addr, rank, w, opts(5000)),
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

#[test]
fn a_mismatched_world_size_fails_both_sides() {
    let results = group(2, &[2, 3], |_| ());
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

#[test]
fn a_duplicate_rank_is_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (root, a, b) = std::thread::scope(|s| {
        let root = s.spawn(move || Rendezvous::root(listener, 3, opts(5000)).map(|_| ()));
        let a = s.spawn(|| Rendezvous::peer(&addr, 1, 3, opts(5000)).map(|_| ()));
        let b = s.spawn(|| Rendezvous::peer(&addr, 1, 3, opts(5000)).map(|_| ()));
        (root.join().unwrap(), a.join().unwrap(), b.join().unwrap())
    });
    let expected = "two processes joined as rank 1 (or it is outside 0..3); give every process its own RANK";
    assert_eq!(root.unwrap_err().to_string(), expected);
    for r in [a, b] {
        assert_eq!(r.unwrap_err().to_string(), format!("rank 0 ended the rendezvous: {expected}"));
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

#[test]
fn another_protocol_on_the_port_is_named() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let root = std::thread::spawn(move || Rendezvous::root(listener, 2, opts(3000)).map(|_| ()));
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: example.org\r\n\r\n").unwrap();
    let e = root.join().unwrap().unwrap_err();
    assert!(matches!(e, RendezvousError::Protocol { magic: 0x2054_4547, .. }), "{e:?}");
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
