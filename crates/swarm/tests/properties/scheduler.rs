//! `PieceScheduler`: what it requests, from whom, how many, and its in-flight
//! bookkeeping through every way a request ends.

use std::collections::{BTreeSet, HashMap, HashSet};

use proptest::prelude::*;
use swarm::scheduler::SchedulerConfig;
use swarm::{Bitfield, PieceScheduler};

use super::{Tally, MIB};

const PEERS: usize = 4;

#[derive(Clone, Debug)]
pub(super) enum SchedOp {
    /// A bitfield or a tracker answer: `None` holds everything.
    SetPeer(usize, Option<Vec<u32>>, u8),
    Have(usize, u32),
    Remove(usize),
    Next(u32),
    /// Ends outstanding request number `.0` (mod the count) the way `.1` says.
    End(usize, End),
    /// A verified piece from elsewhere (the registry stream, the disk).
    DoneElsewhere(u32),
    Claim(u32),
    Unclaim(u32),
    Advance(u64),
    /// The tracker's member count (stall timeouts from 64 on).
    Members(u32),
    /// The housekeeping's stall check.
    Stalls,
}

#[derive(Clone, Copy, Debug)]
pub(super) enum End {
    Done,
    Failed,
    Corrupt,
    Busy,
    NotHeld,
    Forget,
    /// The holder confirmed a cancel.
    Cancelled,
}

pub(super) fn sched_op(pieces: u32) -> impl Strategy<Value = SchedOp> {
    let p = 0..pieces;
    prop_oneof![
        2 => (0..PEERS, proptest::option::of(proptest::collection::vec(0..pieces, 0..pieces as usize)), 0u8..3)
            .prop_map(|(i, h, d)| SchedOp::SetPeer(i, h, d)),
        2 => (0..PEERS, p.clone()).prop_map(|(i, x)| SchedOp::Have(i, x)),
        1 => (0..PEERS).prop_map(SchedOp::Remove),
        5 => (0u32..6).prop_map(SchedOp::Next),
        6 => (any::<usize>(), prop_oneof![
            4 => Just(End::Done), 1 => Just(End::Failed), 1 => Just(End::Corrupt),
            1 => Just(End::Busy), 1 => Just(End::NotHeld), 1 => Just(End::Forget),
            3 => Just(End::Cancelled)
        ]).prop_map(|(i, e)| SchedOp::End(i, e)),
        1 => p.clone().prop_map(SchedOp::DoneElsewhere),
        1 => p.clone().prop_map(SchedOp::Claim),
        1 => p.prop_map(SchedOp::Unclaim),
        3 => (1u64..400).prop_map(SchedOp::Advance),
        2 => prop_oneof![1 => Just(10u32), 1 => Just(64), 2 => Just(10_000)].prop_map(SchedOp::Members),
        3 => Just(SchedOp::Stalls),
    ]
}

fn peer(i: usize) -> String {
    format!("p{i}")
}

struct SchedModel {
    /// What each known peer holds (`None`: everything), as the scheduler was told.
    peers: HashMap<String, Option<BTreeSet<u32>>>,
    banned: HashSet<String>,
    /// Requests sent and not ended: (piece, peer).
    outstanding: Vec<(u32, String)>,
    claimed: BTreeSet<u32>,
    /// Stall timeouts on, when each outstanding request was asked (or last reported
    /// stalled), which were reported, and peers resting after a stall until when.
    stall_timeouts: bool,
    asked_at: HashMap<(u32, String), u64>,
    stall_reported: HashSet<(u32, String)>,
    resting: HashMap<String, u64>,
}

impl SchedModel {
    fn ended(&mut self, piece: u32, peer: &str) {
        let key = (piece, peer.to_owned());
        self.asked_at.remove(&key);
        self.stall_reported.remove(&key);
    }
}

impl SchedModel {
    fn holds(&self, peer: &str, piece: u32) -> bool {
        self.peers
            .get(peer)
            .is_some_and(|h| h.as_ref().is_none_or(|s| s.contains(&piece)))
    }
}

fn check_counts(s: &PieceScheduler, m: &SchedModel) -> Result<(), TestCaseError> {
    prop_assert_eq!(
        s.inflight_count() as usize,
        m.outstanding.len(),
        "in flight {:?}",
        m.outstanding
    );
    for piece in 0..s.have().len() {
        let asked = m.outstanding.iter().any(|(p, _)| *p == piece);
        let claimed = m.claimed.contains(&piece) && !s.have().get(piece);
        prop_assert_eq!(
            s.is_inflight(piece),
            asked || claimed,
            "piece {} in flight",
            piece
        );
    }
    Ok(())
}

pub(super) fn run_scheduler(
    pieces: u32,
    initial: &[u32],
    endgame: u32,
    ops: &[SchedOp],
) -> Result<Tally, TestCaseError> {
    let mut tally = Tally::default();
    let mut have = Bitfield::new(pieces);
    for &i in initial {
        have.set(i);
    }
    let cfg = SchedulerConfig {
        endgame,
        max_inflight_total: 8,
        ..SchedulerConfig::default()
    };
    let mut s = PieceScheduler::new(have, MIB, cfg);
    let mut m = SchedModel {
        peers: HashMap::new(),
        banned: HashSet::new(),
        outstanding: Vec::new(),
        claimed: BTreeSet::new(),
        stall_timeouts: false,
        asked_at: HashMap::new(),
        stall_reported: HashSet::new(),
        resting: HashMap::new(),
    };
    let stall_ms = s.config().stall_ms;
    let stall_backoff_ms = s.config().stall_backoff_ms;
    let mut now = 0u64;
    for op in ops {
        match op {
            SchedOp::SetPeer(i, h, dist) => {
                let bits = h.as_ref().map(|ones| {
                    let mut b = Bitfield::new(pieces);
                    for &x in ones {
                        b.set(x);
                    }
                    b
                });
                let set = bits
                    .as_ref()
                    .filter(|b| !b.is_complete())
                    .map(|b| b.iter_ones().collect());
                s.set_peer_at(&peer(*i), bits, *dist, now);
                m.peers.insert(peer(*i), set);
            }
            SchedOp::Have(i, x) => {
                s.peer_has(&peer(*i), *x, now);
                if let Some(Some(set)) = m.peers.get_mut(&peer(*i)) {
                    set.insert(*x);
                }
            }
            SchedOp::Remove(i) => {
                let mut released = s.remove_peer(&peer(*i));
                released.sort_unstable();
                let mut expected: Vec<u32> = m
                    .outstanding
                    .iter()
                    .filter(|(_, p)| *p == peer(*i))
                    .map(|(x, _)| *x)
                    .collect();
                expected.sort_unstable();
                prop_assert_eq!(released, expected, "remove_peer releases its requests");
                for (x, _) in m.outstanding.clone().iter().filter(|(_, p)| *p == peer(*i)) {
                    m.ended(*x, &peer(*i));
                }
                m.outstanding.retain(|(_, p)| *p != peer(*i));
                m.peers.remove(&peer(*i));
                m.banned.remove(&peer(*i));
                // A peer that comes back is a new one: no rest carried over.
                m.resting.remove(&peer(*i));
            }
            SchedOp::Next(max_new) => {
                let held_before = s.have().clone();
                let reqs = s.next_requests(now, *max_new);
                let non_urgent = reqs.iter().filter(|r| !r.urgent).count();
                prop_assert!(
                    non_urgent <= *max_new as usize,
                    "{} non-urgent requests with a budget of {}: {:?}",
                    non_urgent,
                    max_new,
                    reqs
                );
                prop_assert!(
                    reqs.iter().filter(|r| r.urgent).count() <= 2,
                    "the read head, once or twice in endgame"
                );
                if non_urgent == *max_new as usize && non_urgent > 0 {
                    tally.add("budget used up");
                }
                for r in &reqs {
                    tally.add(if r.urgent {
                        "urgent request"
                    } else {
                        "request"
                    });
                    prop_assert!(
                        !held_before.get(r.piece),
                        "requested held piece {}",
                        r.piece
                    );
                    prop_assert!(
                        !m.banned.contains(&r.peer),
                        "requested from banned {}",
                        r.peer
                    );
                    prop_assert!(
                        m.holds(&r.peer, r.piece),
                        "{} does not hold {}",
                        r.peer,
                        r.piece
                    );
                    prop_assert!(
                        m.resting.get(&r.peer).is_none_or(|&until| until <= now),
                        "asked {} while it rests after a stall",
                        r.peer
                    );
                    let pair = (r.piece, r.peer.clone());
                    prop_assert!(
                        !m.outstanding.contains(&pair),
                        "second request for {:?}",
                        pair
                    );
                    m.asked_at.insert(pair.clone(), now);
                    m.outstanding.push(pair);
                }
            }
            SchedOp::End(i, how) => {
                if m.outstanding.is_empty() {
                    continue;
                }
                // A confirmed cancel is most often one the stall check asked for.
                let mut at = i % m.outstanding.len();
                if matches!(how, End::Cancelled) && i % 4 != 0 {
                    if let Some(k) = m
                        .outstanding
                        .iter()
                        .position(|pair| m.stall_reported.contains(pair))
                    {
                        at = k;
                    }
                }
                let (piece, p) = m.outstanding.remove(at);
                tally.add("request ended");
                let stalled = m.stall_reported.contains(&(piece, p.clone()));
                m.ended(piece, &p);
                match how {
                    End::Done => {
                        s.on_done(piece, &p, now);
                        m.claimed.remove(&piece);
                    }
                    End::Failed => s.on_failed(piece, &p, false),
                    End::Corrupt => {
                        s.on_failed(piece, &p, true);
                        m.banned.insert(p.clone());
                    }
                    End::Busy => s.on_busy(piece, &p, now),
                    End::NotHeld => {
                        s.on_not_held(piece, &p);
                        match m.peers.get_mut(&p) {
                            Some(Some(set)) => {
                                set.remove(&piece);
                            }
                            Some(h @ None) => {
                                *h = Some((0..pieces).filter(|&x| x != piece).collect());
                            }
                            None => {}
                        }
                    }
                    End::Forget => s.forget(piece, &p),
                    End::Cancelled => {
                        s.on_cancelled(piece, &p, now);
                        if stalled {
                            tally.add("stalled request cancelled");
                            let until = m.resting.entry(p.clone()).or_insert(0);
                            *until = (*until).max(now + stall_backoff_ms);
                        }
                    }
                }
            }
            SchedOp::DoneElsewhere(piece) => {
                s.on_done(*piece, "registry", now);
                m.claimed.remove(piece);
            }
            SchedOp::Claim(piece) => {
                s.claim(*piece);
                if !s.have().get(*piece) {
                    m.claimed.insert(*piece);
                }
            }
            SchedOp::Unclaim(piece) => {
                s.unclaim(*piece);
                m.claimed.remove(piece);
            }
            SchedOp::Advance(ms) => now += ms,
            SchedOp::Members(n) => {
                s.set_members(*n, now);
                let on = *n >= swarm::scheduler::STALL_MIN_MEMBERS;
                if on && !m.stall_timeouts {
                    for pair in &m.outstanding {
                        m.asked_at.insert(pair.clone(), now);
                    }
                }
                if !on {
                    m.stall_reported.clear();
                }
                m.stall_timeouts = on;
            }
            SchedOp::Stalls => {
                let mut got: Vec<(u32, String)> = s
                    .stalled_requests(now)
                    .into_iter()
                    .map(|r| (r.piece, r.peer))
                    .collect();
                got.sort();
                let mut want: Vec<(u32, String)> = if m.stall_timeouts {
                    m.outstanding
                        .iter()
                        .filter(|pair| {
                            m.asked_at
                                .get(*pair)
                                .is_some_and(|&at| now.saturating_sub(at) >= stall_ms)
                        })
                        .cloned()
                        .collect()
                } else {
                    Vec::new()
                };
                want.sort();
                prop_assert_eq!(&got, &want, "stalled requests at {}", now);
                for pair in got {
                    tally.add("stalled request");
                    m.asked_at.insert(pair.clone(), now);
                    m.stall_reported.insert(pair);
                }
            }
        }
        check_counts(&s, &m)?;
    }
    // Every request ends (the agent cancels endgame duplicates with `forget`): nothing
    // is left in flight.
    for (piece, p) in std::mem::take(&mut m.outstanding) {
        s.forget(piece, &p);
    }
    for piece in std::mem::take(&mut m.claimed) {
        s.unclaim(piece);
    }
    prop_assert_eq!(s.inflight_count(), 0);
    for piece in 0..pieces {
        prop_assert!(!s.is_inflight(piece), "piece {} still in flight", piece);
    }
    for piece in 0..pieces {
        s.on_done(piece, "disk", now);
    }
    prop_assert!(s.is_complete());
    prop_assert!(
        s.next_requests(now, 10).is_empty(),
        "nothing to ask when complete"
    );
    Ok(tally)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn scheduler_invariants(
        (pieces, initial, ops) in (1u32..24).prop_flat_map(|n| (
            Just(n),
            proptest::collection::vec(0..n, 0..n as usize),
            proptest::collection::vec(sched_op(n), 1..120),
        )),
        endgame in 0u32..6,
    ) {
        run_scheduler(pieces, &initial, endgame, &ops)?;
    }
}
