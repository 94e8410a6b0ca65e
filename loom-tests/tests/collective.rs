//! Collective order (invariant 4): whatever order a rank's gather requests arrive in, its collective actor issues
//! the AllGathers in sequence order, so ranks that number their gathers from the same plan issue the same
//! AllGathers in the same order.
//!
//! The production `CollectiveHandle` runs with a `LoomCollective` (it records the tag of every AllGather it is
//! asked to issue and panics with `collective order` on a divergence) on a `CommPlatform` (host-only, no device
//! thread). Gather requests carry no ticket board and no notify mailbox, so the completion watcher only waits on
//! its mailbox until shutdown.
//!
//! Models:
//! - arrival race, two senders: the engine thread sends gather #0 while a second thread sends #1 then #2, so the
//!   actor sees the arrival orders 0 1 2, 1 0 2 and 1 2 0 (the test checks that loom produced all three). The
//!   issue order must be 0 1 2 with the plan's tags, and the comm stream must hold the ready events in that order.
//!   Threads: engine, sender, collective actor, watcher.
//! - arrival race, reversed: the same with the second thread sending #2 then #1 (arrival orders 0 2 1, 2 0 1 and
//!   2 1 0). The two arrival-race models together produce all six orders of three requests.
//! - two ranks: the engine sends the same three requests to two collective actors, rank 0 in the order 2 0 1 and
//!   rank 1 in the order 1 2 0; both ranks must issue the same tags in the same order. `CommGroup` compares the
//!   ranks on every call, so a divergence panics at the first mismatched position, in whichever interleaving of
//!   the two actors. Threads: engine, two collective actors, two watchers.
//!
//! Broken variants: an issuer in this file that issues each request on the sending thread, in arrival order (the
//! actor without its sequence buffer). Loom finds an arrival order that breaks the plan (`collective order
//! violated`) and, with two ranks, the ranks diverge (`collective order diverged`).
#![cfg(weightferry_loom)]

use std::collections::BTreeSet;

use weightferry_actors::collective::Collective;
use weightferry_actors::collective_actor::{CollectiveHandle, GatherCmd};
use weightferry_actors::platform::{Platform, PlatformRef, StreamId};
use weightferry_actors::sync::{lock, thread, Arc, Mutex};
use weightferry_loom::{model, CommGroup, CommOp, CommPlatform, LoomCollective};

/// Gathers in each model.
const GATHERS: u64 = 3;

/// What gather `seq` gathers (the same on every rank, as the plan makes it).
fn tag_of(seq: u64) -> u64 {
    0x7A60 + seq
}

fn plan() -> Vec<u64> {
    (0..GATHERS).map(tag_of).collect()
}

/// `(seq, tag)` in sequence order: what `CollectiveHandle::issued` must return.
fn in_sequence_order() -> Vec<(u64, u64)> {
    (0..GATHERS).map(|s| (s, tag_of(s))).collect()
}

/// The request for gather `seq`: a one-byte shard into a two-byte block, no waits, no board, no notify.
fn request(platform: &CommPlatform, seq: u64) -> GatherCmd {
    let shard = platform.alloc_device(1).expect("shard buffer");
    let block = platform.alloc_device(2).expect("block buffer");
    let ready = platform.create_event().expect("ready event");
    GatherCmd {
        seq,
        ticket: seq,
        target: 0,
        block: seq as usize,
        waits: Vec::new(),
        input: (shard, 0, 1),
        output: (block, 0),
        ready,
        tag: tag_of(seq),
        board: None,
        notify: None,
    }
}

/// Deliberately broken: issues every request at once on the sending thread, in arrival order (what the collective
/// actor would do without its sequence buffer).
struct ArrivalOrder {
    platform: PlatformRef,
    stream: StreamId,
    comm: Mutex<LoomCollective>,
    issued: Mutex<Vec<(u64, u64)>>,
}

impl ArrivalOrder {
    fn gather(&self, g: GatherCmd) {
        let comm = lock(&self.comm);
        lock(&self.issued).push((g.seq, g.tag));
        comm.all_gather(self.stream, g.input, g.output, g.tag).expect("all_gather");
        self.platform.record_event(g.ready, self.stream).expect("record the ready event");
    }
}

/// Where a rank's requests go.
#[derive(Clone)]
enum Issuer {
    /// The production collective actor.
    Actor(CollectiveHandle),
    /// The broken arrival-order issuer.
    ArrivalOrder(Arc<ArrivalOrder>),
}

impl Issuer {
    fn new(platform: &std::sync::Arc<CommPlatform>, comm: LoomCollective, broken: bool) -> Issuer {
        let p: PlatformRef = platform.clone();
        if broken {
            let stream = p.create_stream("comm").expect("comm stream");
            let naive = ArrivalOrder { platform: p, stream, comm: Mutex::new(comm), issued: Mutex::new(Vec::new()) };
            Issuer::ArrivalOrder(Arc::new(naive))
        } else {
            let make = Box::new(move || Ok(Box::new(comm) as Box<dyn Collective>));
            Issuer::Actor(CollectiveHandle::spawn(p, "comm", make).expect("collective actor"))
        }
    }

    fn gather(&self, g: GatherCmd) {
        match self {
            Issuer::Actor(h) => h.gather(g).expect("the collective actor takes the request"),
            Issuer::ArrivalOrder(n) => n.gather(g),
        }
    }

    fn stream(&self) -> StreamId {
        match self {
            Issuer::Actor(h) => h.stream(),
            Issuer::ArrivalOrder(n) => n.stream,
        }
    }

    /// Stops the actor (it handles every request sent before) and returns what it issued.
    fn finish(&self) -> Vec<(u64, u64)> {
        match self {
            Issuer::Actor(h) => {
                h.shutdown();
                assert_eq!(h.poisoned(), None, "no gather failed");
                h.issued()
            }
            Issuer::ArrivalOrder(n) => lock(&n.issued).clone(),
        }
    }
}

/// Stops rank `rank` and checks its result: the issue order, the tags its communicator saw, and the comm stream's
/// ready events.
fn check_rank(issuer: &Issuer, platform: &CommPlatform, group: &CommGroup, rank: usize, readies: &[CommOp]) {
    assert_eq!(issuer.finish(), in_sequence_order(), "gathers issued in sequence order");
    assert_eq!(group.issued()[rank], plan(), "the communicator saw the plan's tags in order");
    assert_eq!(platform.stream_log(issuer.stream()), readies, "ready events recorded in sequence order");
}

/// One rank; the engine thread sends the requests in `split[0]`, one more thread per further entry sends its
/// requests, in order. Returns the arrival orders loom produced.
fn arrival_race(split: &'static [&'static [u64]], broken: bool) -> BTreeSet<Vec<u64>> {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(BTreeSet::new()));
    let record = seen.clone();
    model(move || {
        let platform = std::sync::Arc::new(CommPlatform::new());
        let mut requests: Vec<Option<GatherCmd>> = (0..GATHERS).map(|s| Some(request(&platform, s))).collect();
        let readies: Vec<CommOp> = requests.iter().flatten().map(|g| CommOp::Record(g.ready.0)).collect();
        let group = CommGroup::new(1, Some(plan()));
        let issuer = Issuer::new(&platform, CommGroup::member(&group, 0), broken);
        // Held across each send, so the order of this list is the order of arrival in the actor's mailbox.
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let send = |issuer: &Issuer, arrivals: &Mutex<Vec<u64>>, g: GatherCmd| {
            let mut a = lock(arrivals);
            a.push(g.seq);
            issuer.gather(g);
        };
        let mut take = |seqs: &[u64]| -> Vec<GatherCmd> {
            seqs.iter().map(|&s| requests[s as usize].take().expect("each request is sent once")).collect()
        };
        let mine = take(split[0]);
        let senders: Vec<_> = split[1..]
            .iter()
            .map(|seqs| {
                let (cmds, issuer, arrivals) = (take(seqs), issuer.clone(), arrivals.clone());
                thread::spawn(move || cmds.into_iter().for_each(|g| send(&issuer, &arrivals, g)))
            })
            .collect();
        mine.into_iter().for_each(|g| send(&issuer, &arrivals, g));
        senders.into_iter().for_each(|t| t.join().expect("sender"));
        check_rank(&issuer, &platform, &group, 0, &readies);
        record.lock().expect("arrival orders").insert(lock(&arrivals).clone());
    });
    let seen = seen.lock().expect("arrival orders").clone();
    seen
}

fn orders(list: &[[u64; 3]]) -> BTreeSet<Vec<u64>> {
    list.iter().map(|o| o.to_vec()).collect()
}

#[test]
fn gathers_issue_in_sequence_order_whatever_the_arrival_order() {
    let seen = arrival_race(&[&[0], &[1, 2]], false);
    assert_eq!(seen, orders(&[[0, 1, 2], [1, 0, 2], [1, 2, 0]]), "loom produced every arrival order");
}

#[test]
fn gathers_issue_in_sequence_order_when_later_gathers_arrive_reversed() {
    let seen = arrival_race(&[&[0], &[2, 1]], false);
    assert_eq!(seen, orders(&[[0, 2, 1], [2, 0, 1], [2, 1, 0]]), "loom produced every arrival order");
}

#[test]
#[should_panic(expected = "collective order violated")]
fn broken_arrival_order_issuer_is_caught() {
    arrival_race(&[&[0], &[1, 2]], true);
}

/// Two ranks, each with its own platform and collective actor; the engine sends rank 0 the requests in the order
/// 2 0 1 and rank 1 in the order 1 2 0, alternating between the ranks.
fn two_ranks(broken: bool) {
    model(move || {
        let group = CommGroup::new(2, None);
        // Round `i` sends rank 0 its `i`-th request and rank 1 its `i`-th: rank 0 gets 2 0 1, rank 1 gets 1 2 0.
        let rounds: [[usize; 2]; 3] = [[2, 1], [0, 2], [1, 0]];
        let mut ranks: Vec<_> = (0..2)
            .map(|_| {
                let platform = std::sync::Arc::new(CommPlatform::new());
                let requests: Vec<GatherCmd> = (0..GATHERS).map(|s| request(&platform, s)).collect();
                let readies: Vec<CommOp> = requests.iter().map(|g| CommOp::Record(g.ready.0)).collect();
                (platform, requests.into_iter().map(Some).collect::<Vec<_>>(), readies)
            })
            .collect();
        let issuers: Vec<Issuer> = ranks
            .iter()
            .enumerate()
            .map(|(rank, (platform, _, _))| Issuer::new(platform, CommGroup::member(&group, rank), broken))
            .collect();
        for round in rounds {
            for (rank, (_, requests, _)) in ranks.iter_mut().enumerate() {
                issuers[rank].gather(requests[round[rank]].take().expect("each request is sent once"));
            }
        }
        for (rank, (platform, _, readies)) in ranks.iter().enumerate() {
            check_rank(&issuers[rank], platform, &group, rank, readies);
        }
        let tags = group.issued();
        assert_eq!(tags[0], tags[1], "both ranks issued the same AllGathers in the same order");
    });
}

#[test]
fn two_ranks_with_different_arrival_orders_issue_the_same_gathers() {
    two_ranks(false);
}

#[test]
#[should_panic(expected = "collective order diverged")]
fn broken_two_ranks_issuing_in_arrival_order_are_caught() {
    two_ranks(true);
}
