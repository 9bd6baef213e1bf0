//! Property tests of the swarm's three cores, each driven by random sequences of the
//! events it sees in production and checked against a small model:
//! - `TrackerState::announce` / `expire`: one live source per blob, handouts, hashes,
//!   refused announces, expiry;
//! - `PieceScheduler`: what it requests, from whom, how many, and its in-flight
//!   bookkeeping through every way a request ends;
//! - `UploadQueue`: slots, counts and order of the holder's upload line.
#![allow(clippy::unwrap_used)] // a test that unwraps reports its failure by panicking

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};

use oci::Digest;
use proptest::prelude::*;
use swarm::pieces::{validate_geometry, PieceHash, MAX_BLOB_SIZE, MIN_PIECE_SIZE};
use swarm::scheduler::SchedulerConfig;
use swarm::upload::{Admit, Queued, UploadConfig, UploadQueue, URGENT_EXTRA_SLOTS};
use swarm::{AnnounceRequest, Bitfield, PieceScheduler, Role, SwarmConfig, Topology, TrackerState};

const MIB: u64 = 1 << 20;

/// How often each interesting event happened in a run: the test at the end checks
/// that the random sequences reach what the properties are about.
#[derive(Default, Debug)]
struct Tally(BTreeMap<&'static str, usize>);

impl Tally {
    fn add(&mut self, what: &'static str) {
        *self.0.entry(what).or_default() += 1;
    }

    fn merge(&mut self, other: Tally) {
        for (k, v) in other.0 {
            *self.0.entry(k).or_default() += v;
        }
    }
}

// -------------------------------------------------------------------------------------
// TrackerState
// -------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Geometry {
    /// What an agent sends: 64 MiB in 1 MiB pieces.
    Agent,
    /// An agent that does not know the size yet.
    Unknown,
    /// Only a piece size (an agent that proposes one before it knows the size).
    PieceOnly(u64),
    /// Only a size (the tracker picks the piece size).
    SizeOnly(u64),
    /// Refused: not a power of two, too small, too large, too many pieces.
    Invalid(u64, u64),
}

#[derive(Clone, Debug)]
struct Announce {
    node: usize,
    blob: usize,
    geometry: Geometry,
    have: Vec<u32>,
    complete: bool,
    fetching: bool,
    leaving: bool,
    hashes: Vec<u32>,
    bad: Vec<usize>,
    known_hashes: u32,
    rack: usize,
}

#[derive(Clone, Debug)]
enum TrackerOp {
    Announce(Announce),
    Advance(u64),
    Expire,
}

fn geometry() -> impl Strategy<Value = Geometry> {
    prop_oneof![
        6 => Just(Geometry::Agent),
        2 => Just(Geometry::Unknown),
        1 => prop_oneof![Just(MIN_PIECE_SIZE), Just(MIB), Just(256 * MIB)].prop_map(Geometry::PieceOnly),
        1 => prop_oneof![Just(1000u64), Just(64 * MIB), Just(1u64 << 40), Just(MAX_BLOB_SIZE)]
            .prop_map(Geometry::SizeOnly),
        1 => prop_oneof![
            Just((64 * MIB, 3 * MIB)),
            Just((64 * MIB, 1024)),
            Just((64 * MIB, 1 << 40)),
            Just((u64::MAX, MIB)),
            Just((1 << 40, MIN_PIECE_SIZE)),
        ]
        .prop_map(|(s, p)| Geometry::Invalid(s, p)),
    ]
}

fn announce_op() -> impl Strategy<Value = Announce> {
    (
        (
            0usize..6,
            0usize..2,
            geometry(),
            proptest::collection::vec(0u32..64, 0..8),
        ),
        (any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()),
        (
            proptest::collection::vec(0u32..70, 0..4),
            proptest::collection::vec(0usize..6, 0..2),
            0u32..8,
            0usize..2,
        ),
    )
        .prop_map(
            |(
                (node, blob, geometry, have),
                (c, fetching, leaving, l2),
                (hashes, bad, known_hashes, rack),
            )| {
                Announce {
                    node,
                    blob,
                    geometry,
                    have,
                    // Completing and leaving are rarer than downloading.
                    complete: c && l2,
                    fetching,
                    leaving: leaving && l2,
                    hashes,
                    bad,
                    known_hashes,
                    rack,
                }
            },
        )
}

fn tracker_op() -> impl Strategy<Value = TrackerOp> {
    prop_oneof![
        8 => announce_op().prop_map(TrackerOp::Announce),
        3 => prop_oneof![Just(300u64), Just(2_000), Just(6_000), Just(60_000)].prop_map(TrackerOp::Advance),
        1 => Just(TrackerOp::Expire),
    ]
}

fn digest(blob: usize) -> Digest {
    Digest::of(format!("blob-{blob}").as_bytes())
}

fn request(a: &Announce) -> AnnounceRequest {
    let node = format!("n{}", a.node);
    let topo = Topology {
        zone: Some("z".into()),
        rack: Some(format!("r{}", a.rack)),
    };
    let mut r = AnnounceRequest::new(&node, &format!("{node}:5051"), &topo, &digest(a.blob));
    let pieces = match a.geometry {
        Geometry::Agent => {
            r.size = Some(64 * MIB);
            r.piece_size = Some(MIB);
            64
        }
        Geometry::Unknown => 0,
        Geometry::PieceOnly(p) => {
            r.piece_size = Some(p);
            0
        }
        Geometry::SizeOnly(s) => {
            r.size = Some(s);
            0
        }
        Geometry::Invalid(s, p) => {
            r.size = Some(s);
            r.piece_size = Some(p);
            64
        }
    };
    if pieces > 0 {
        let mut have = Bitfield::new(pieces);
        for &i in &a.have {
            have.set(i);
        }
        r.have = Some(have);
    }
    r.complete = a.complete;
    r.fetching_from_registry = a.fetching;
    r.leaving = a.leaving;
    for &i in &a.hashes {
        r.hashes
            .insert(i, PieceHash::of(format!("{node}/{i}").as_bytes()).to_hex());
    }
    r.bad_peers = a.bad.iter().map(|b| format!("n{b}")).collect();
    r.known_hashes = a.known_hashes;
    r
}

fn stats(t: &TrackerState) -> String {
    serde_json::to_string(&t.stats()).unwrap_or_default()
}

/// The model of one (blob, node): when it last announced, and whether it said it
/// left or completed (a source that did is no longer the live source).
#[derive(Clone, Copy, Debug)]
struct Member {
    at: u64,
    gone: bool,
}

fn run_tracker(max_peers: usize, ops: &[TrackerOp]) -> Result<Tally, TestCaseError> {
    let mut tally = Tally::default();
    let mut t = TrackerState::new(SwarmConfig {
        max_peers,
        stripe_min_members: 4,
        ..SwarmConfig::default()
    });
    let ttl = t.cfg.peer_ttl_ms;
    let mut now = 1_000u64;
    // Per blob: its members (announced, not left, not expired) and its source as last
    // seen in a response.
    let mut members: HashMap<Digest, BTreeMap<String, Member>> = HashMap::new();
    let mut sources: HashMap<Digest, String> = HashMap::new();
    for op in ops {
        match op {
            TrackerOp::Advance(ms) => now += ms,
            TrackerOp::Expire => {
                t.expire(now);
                let before: usize = members.values().map(BTreeMap::len).sum();
                for m in members.values_mut() {
                    m.retain(|_, p| now.saturating_sub(p.at) <= ttl * 10);
                }
                if members.values().map(BTreeMap::len).sum::<usize>() < before {
                    tally.add("expire");
                }
                members.retain(|_, m| !m.is_empty());
                let swarms: BTreeMap<String, usize> =
                    t.stats().into_iter().map(|s| (s.digest, s.peers)).collect();
                let model: BTreeMap<String, usize> = members
                    .iter()
                    .map(|(d, m)| (d.to_string(), m.len()))
                    .collect();
                prop_assert_eq!(
                    swarms,
                    model,
                    "after expire, exactly the members heard from within 10 TTLs"
                );
                sources.retain(|d, _| members.contains_key(d));
            }
            TrackerOp::Announce(a) => {
                let req = request(a);
                let d = req.digest.clone();
                let before = stats(&t);
                let hashes_before = t.hashes(&d, 0);
                let resp = match t.announce(&req, now) {
                    Ok(r) => r,
                    Err(_) => {
                        tally.add("announce refused");
                        prop_assert_eq!(stats(&t), before, "a refused announce changes nothing");
                        prop_assert_eq!(t.hashes(&d, 0), hashes_before);
                        continue;
                    }
                };
                if let Geometry::Invalid(..) = a.geometry {
                    return Err(TestCaseError::fail(format!(
                        "invalid geometry accepted: {req:?}"
                    )));
                }
                tally.add("announce taken");
                if !resp.peers.is_empty() {
                    tally.add("peers handed out");
                }
                if resp.peers.len() == max_peers && max_peers > 0 {
                    tally.add("full handout");
                }
                let m = members.entry(d.clone()).or_default();
                if req.leaving {
                    m.remove(&req.node);
                } else {
                    m.insert(
                        req.node.clone(),
                        Member {
                            at: now,
                            gone: req.complete,
                        },
                    );
                }
                // A node is never handed itself, nobody twice, at most max_peers
                // (the live source is always included, and takes a slot: see
                // `peers::rank`, so only a handout of max_peers = 0 can hold 1).
                let names: HashSet<&str> = resp.peers.iter().map(|p| p.node.as_str()).collect();
                prop_assert_eq!(names.len(), resp.peers.len(), "nobody twice");
                prop_assert!(
                    !names.contains(req.node.as_str()),
                    "{} handed itself",
                    req.node
                );
                prop_assert!(
                    resp.peers.len() <= max_peers.max(1),
                    "{} peers > {}",
                    resp.peers.len(),
                    max_peers
                );
                if resp.role == Role::Source {
                    prop_assert_eq!(resp.source.as_deref(), Some(req.node.as_str()));
                }
                if req.leaving || req.complete {
                    prop_assert_ne!(resp.source.as_deref(), Some(req.node.as_str()));
                }
                // The source's own final announce (complete or leaving) still counts.
                let was_source = sources.get(&d).map(String::as_str) == Some(req.node.as_str());
                // At most one elected source per blob: a different one only when the
                // previous left, completed or went silent for the TTL.
                if let (Some(old), Some(new)) = (sources.get(&d), resp.source.as_ref()) {
                    if old != new {
                        tally.add("source replaced");
                        let prev = members.get(&d).and_then(|m| m.get(old)).copied();
                        prop_assert!(
                            prev.is_none_or(|p| p.gone || now.saturating_sub(p.at) > ttl),
                            "{} elected while {} is live: {:?}",
                            new,
                            old,
                            prev
                        );
                    }
                }
                match &resp.source {
                    Some(s) => sources.insert(d.clone(), s.clone()),
                    None => sources.remove(&d),
                };
                // A known size always comes with a geometry every agent accepts.
                if let Some(size) = resp.size {
                    prop_assert!(
                        validate_geometry(size, resp.piece_size).is_ok(),
                        "swarm geometry {} in pieces of {}",
                        size,
                        resp.piece_size
                    );
                }
                // Hashes only from the elected source, and only what it sent.
                let hashes_after = t.hashes(&d, 0);
                if resp.source.as_deref() != Some(req.node.as_str()) && !was_source {
                    prop_assert_eq!(&hashes_after, &hashes_before, "hashes from a non-source");
                } else {
                    for (k, v) in &hashes_after {
                        if hashes_before.get(k) != Some(v) {
                            tally.add("hash taken");
                            prop_assert_eq!(req.hashes.get(k), Some(v));
                        }
                    }
                }
                for k in resp.hashes.keys() {
                    prop_assert!(*k >= req.known_hashes);
                }
            }
        }
    }
    t.expire(now + ttl * 10 + 1);
    prop_assert!(t.stats().is_empty(), "nothing outlives 10 TTLs");
    Ok(tally)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn tracker_announce_invariants(
        max_peers in 0usize..6,
        ops in proptest::collection::vec(tracker_op(), 1..80),
    ) {
        run_tracker(max_peers, &ops)?;
    }
}

// -------------------------------------------------------------------------------------
// PieceScheduler
// -------------------------------------------------------------------------------------

const PEERS: usize = 4;

#[derive(Clone, Debug)]
enum SchedOp {
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
enum End {
    Done,
    Failed,
    Corrupt,
    Busy,
    NotHeld,
    Forget,
    /// The holder confirmed a cancel.
    Cancelled,
}

fn sched_op(pieces: u32) -> impl Strategy<Value = SchedOp> {
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

fn run_scheduler(
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

// -------------------------------------------------------------------------------------
// UploadQueue
// -------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum UploadOp {
    Push(u8, u32, u32, bool),
    Next,
    Done,
    Cancel(u8, u32, u32),
    Drop(u8, Option<u32>),
}

fn upload_op() -> impl Strategy<Value = UploadOp> {
    prop_oneof![
        // Piece 0 (a head piece, which alone may take the urgent slot) often.
        6 => (0u8..4, 0u32..3, prop_oneof![1 => Just(0u32), 3 => 0u32..12], prop::bool::weighted(0.2)).prop_map(|(c, ch, p, u)| UploadOp::Push(c, ch, p, u)),
        4 => Just(UploadOp::Next),
        3 => Just(UploadOp::Done),
        2 => (0u8..4, 0u32..3, 0u32..12).prop_map(|(c, ch, p)| UploadOp::Cancel(c, ch, p)),
        1 => (0u8..4, proptest::option::of(0u32..3)).prop_map(|(c, ch)| UploadOp::Drop(c, ch)),
    ]
}

fn run_upload(cfg: UploadConfig, ops: &[UploadOp]) -> Result<Tally, TestCaseError> {
    let mut tally = Tally::default();
    let max_active = cfg.max_active.max(1);
    let extra = cfg.urgent_extra;
    let (per_conn, total) = (cfg.max_queued_per_conn, cfg.max_queued_total);
    let mut u: UploadQueue<u8> = UploadQueue::new(cfg);
    let mut waiting: BTreeMap<u8, VecDeque<Queued>> = BTreeMap::new();
    let mut active = 0usize;
    let (mut pushed, mut served, mut cancelled, mut dropped) = (0usize, 0usize, 0usize, 0usize);
    for op in ops {
        let queued: usize = waiting.values().map(VecDeque::len).sum();
        match op {
            UploadOp::Push(c, chan, piece, urgent) => {
                let q = Queued {
                    chan: *chan,
                    blob: 1,
                    piece: *piece,
                    urgent: *urgent,
                    // Piece 0 stands for a small head piece here.
                    small_head: *piece == 0,
                };
                let line = waiting.entry(*c).or_default();
                let busy = line.len() >= per_conn || queued >= total;
                let admit = u.push(*c, q);
                prop_assert_eq!(admit == Admit::Busy, busy, "admission of {:?}", q);
                tally.add(if busy { "busy" } else { "queued" });
                if admit == Admit::Queued {
                    line.push_back(q);
                    pushed += 1;
                }
            }
            UploadOp::Next => {
                let urgent_waiting = waiting.values().flatten().any(|q| q.urgent);
                let urgent_head_waiting =
                    waiting.values().flatten().any(|q| q.urgent && q.small_head);
                match u.next_to_send() {
                    None => prop_assert!(
                        active >= max_active + extra
                            || queued == 0
                            || (active >= max_active && !urgent_head_waiting),
                        "nothing served with {} active and {} waiting",
                        active,
                        queued
                    ),
                    Some((c, q)) => {
                        prop_assert!(
                            active < max_active
                                || (q.urgent && q.small_head && active < max_active + extra),
                            "a slot past max_active for {:?}",
                            q
                        );
                        if active >= max_active {
                            tally.add("urgent in the extra slot");
                        }
                        prop_assert!(
                            q.urgent || !urgent_waiting,
                            "non-urgent {:?} before an urgent one",
                            q
                        );
                        let line = waiting.get_mut(&c);
                        let at = line.as_ref().and_then(|l| l.iter().position(|x| *x == q));
                        prop_assert!(at.is_some(), "{:?} was not waiting on {}", q, c);
                        if let (Some(line), Some(at)) = (line, at) {
                            line.remove(at);
                        }
                        tally.add(if urgent_waiting {
                            "served urgent first"
                        } else {
                            "served"
                        });
                        active += 1;
                        served += 1;
                    }
                }
            }
            UploadOp::Done => {
                u.done();
                active = active.saturating_sub(1);
            }
            UploadOp::Cancel(c, chan, piece) => {
                let line = waiting.entry(*c).or_default();
                let at = line
                    .iter()
                    .position(|q| q.chan == *chan && q.piece == *piece);
                prop_assert_eq!(u.cancel(*c, *chan, *piece), at.is_some());
                if let Some(at) = at {
                    tally.add("cancelled");
                    line.remove(at);
                    cancelled += 1;
                }
            }
            UploadOp::Drop(c, chan) => {
                u.drop_waiting(*c, *chan);
                let line = waiting.entry(*c).or_default();
                let before = line.len();
                line.retain(|q| chan.is_some_and(|ch| q.chan != ch));
                dropped += before - line.len();
            }
        }
        let queued: usize = waiting.values().map(VecDeque::len).sum();
        prop_assert!(
            u.active() <= max_active + extra,
            "{} active > {} + {}",
            u.active(),
            max_active,
            extra
        );
        prop_assert_eq!(u.active(), active);
        prop_assert_eq!(u.queued(), queued);
        prop_assert_eq!(u.queued(), pushed - served - cancelled - dropped);
    }
    // Draining: everything waiting is served, urgent first, then nothing.
    loop {
        while u.active() > 0 {
            u.done();
        }
        let Some((c, q)) = u.next_to_send() else {
            break;
        };
        let urgent_waiting = waiting.values().flatten().any(|x| x.urgent);
        prop_assert!(q.urgent || !urgent_waiting);
        if let Some(line) = waiting.get_mut(&c) {
            if let Some(at) = line.iter().position(|x| *x == q) {
                line.remove(at);
            }
        }
    }
    prop_assert_eq!(u.queued(), 0);
    prop_assert!(
        waiting.values().all(VecDeque::is_empty),
        "left waiting: {:?}",
        waiting
    );
    Ok(tally)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn upload_queue_invariants(
        max_active in 0usize..4,
        per_conn in 1usize..5,
        total in 1usize..10,
        urgent_extra in 0usize..3,
        ops in proptest::collection::vec(upload_op(), 1..120),
    ) {
        run_upload(UploadConfig { max_active, max_queued_per_conn: per_conn, max_queued_total: total, urgent_extra }, &ops)?;
    }
}

/// The generators reach what the properties are about: refused and taken announces,
/// full handouts, replaced sources, hashes taken, expiry; requests, the budget used
/// up, every way a request ends; busy lines, urgent requests served first,
/// cancellations. 400 deterministic cases of each.
#[test]
fn the_sequences_reach_the_interesting_cases() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut tally = Tally::default();
    let mut runner = TestRunner::deterministic();
    // The upload line's cases draw from a runner of their own, so a change to one
    // generator does not reshuffle the others' cases.
    let mut upload_runner = TestRunner::deterministic();
    let tracker = (0usize..6, proptest::collection::vec(tracker_op(), 1..80));
    let sched = (1u32..24).prop_flat_map(|n| {
        (
            Just(n),
            proptest::collection::vec(0..n, 0..n as usize),
            proptest::collection::vec(sched_op(n), 1..120),
            0u32..6,
        )
    });
    let upload = (
        0usize..4,
        1usize..5,
        1usize..10,
        proptest::collection::vec(upload_op(), 1..120),
    );
    for _ in 0..400 {
        let (max_peers, ops) = tracker.new_tree(&mut runner).expect("case").current();
        tally.merge(run_tracker(max_peers, &ops).expect("tracker properties"));
        let (n, initial, ops, endgame) = sched.new_tree(&mut runner).expect("case").current();
        tally.merge(run_scheduler(n, &initial, endgame, &ops).expect("scheduler properties"));
        let (a, p, t, ops) = upload.new_tree(&mut upload_runner).expect("case").current();
        let cfg = UploadConfig {
            max_active: a,
            max_queued_per_conn: p,
            max_queued_total: t,
            urgent_extra: URGENT_EXTRA_SLOTS,
        };
        tally.merge(run_upload(cfg, &ops).expect("upload properties"));
    }
    for what in [
        "announce refused",
        "announce taken",
        "peers handed out",
        "full handout",
        "source replaced",
        "hash taken",
        "expire",
        "request",
        "urgent request",
        "budget used up",
        "request ended",
        "busy",
        "queued",
        "served",
        "served urgent first",
        "urgent in the extra slot",
        "cancelled",
        "stalled request",
        "stalled request cancelled",
    ] {
        let n = tally.0.get(what).copied().unwrap_or(0);
        assert!(
            n >= 10,
            "{what}: only {n} times in 400 cases: {:?}",
            tally.0
        );
    }
    println!("{:?}", tally.0);
}
